//! Gradient accumulation over micro-batches: what each micro-batch's values add to, the boundary values averaged or kept, and the device-side sums.

use super::*;

/// What gradient accumulation holds over a step's micro-batches: per boundary value its sum
/// (an averaged value) or its last value (the others), the results of each micro-batch, and
/// the one-op graphs that sum and scale on the device.
pub(super) struct Accumulated<T> {
    pub(super) boundary: HashMap<Value, T>,
    pub(super) per_micro: Vec<(String, Vec<Array>)>,
    pub(super) sums: Summer<T>,
    /// Per micro-batch, its weight in the step's mean ([`RunOptions::micro_weights`]).
    pub(super) weights: Option<Vec<f64>>,
}

impl<T> Default for Accumulated<T> {
    fn default() -> Self {
        Accumulated { boundary: HashMap::new(), per_micro: Vec::new(), sums: Summer::default(), weights: None }
    }
}

impl<T: Clone> Accumulated<T> {
    /// A new step: nothing accumulated yet.
    pub(super) fn start_step(&mut self) {
        self.boundary.clear();
        self.per_micro.clear();
    }

    /// Micro-batch `k`'s boundary values added to the sums (or kept, for the others), and the
    /// results wanted per micro-batch downloaded. With weights, an averaged value is scaled
    /// by its micro-batch's weight times their number before it is added (the step divides
    /// the sum by their number).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_micro<E: Executor<Tensor = T>>(
        &mut self,
        cx: &mut NodeRun<'_, '_, E>,
        a: &Accumulation,
        env: &HashMap<Value, T>,
        fixed: &HashMap<Value, T>,
        live: &mut Live,
        d: &DeviceProgram,
        wanted: &dyn Fn(&crate::program::Result_) -> bool,
        k: usize,
    ) -> Result<(), String> {
        let g = cx.g;
        let scale = self.weights.as_ref().map_or(1.0, |w| w.get(k).copied().unwrap_or(0.0) * w.len() as f64);
        for &v in &a.boundary {
            let t = env.get(&v).ok_or_else(|| format!("`{}` was not computed", g.value_name(v)))?;
            if scale == 0.0 && a.averaged.contains(&v) {
                // A micro-batch that counts nothing (every label ignored: its mean is 0/0)
                // adds nothing.
                continue;
            }
            let scaled;
            let t = if scale != 1.0 && a.averaged.contains(&v) {
                scaled = self.sums.scale(cx.e, g, v, t, scale)?;
                &scaled
            } else {
                t
            };
            let t = match self.boundary.remove(&v) {
                Some(mut sum) if a.averaged.contains(&v) => {
                    if cx.e.add_in_place(&mut sum, t) {
                        // Summed where it lies (already counted).
                        self.boundary.insert(v, sum);
                        continue;
                    }
                    let s = self.sums.add(cx.e, g, v, &sum, t)?;
                    live.remove(cx.e.storage(&sum));
                    s
                }
                Some(old) => {
                    live.remove(cx.e.storage(&old));
                    t.clone()
                }
                None => t.clone(),
            };
            live.add(cx.e.storage(&t));
            self.boundary.insert(v, t);
        }
        for r in d.results.iter().filter(|r| wanted(r)) {
            let Some(v) = g.lookup(&r.local) else { continue };
            if a.per_micro(v) {
                let t = result(g, &r.local, env, fixed)?;
                let x = cx.e.download(t)?;
                match self.per_micro.iter_mut().find(|s| s.0 == r.local) {
                    Some(s) => s.1.push(x),
                    None => self.per_micro.push((r.local.clone(), vec![x])),
                }
            }
        }
        Ok(())
    }

    /// The once-per-step ops, on the mean of the micro-batches; the step's results (the mean
    /// or last of the per-micro-batch ones, or the once-per-step ops') and the carried
    /// state's next values.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub(super) fn finish_step<E: Executor<Tensor = T>>(
        &mut self,
        cx: &mut NodeRun<'_, '_, E>,
        a: &Accumulation,
        order: &[NodeId],
        fixed: &HashMap<Value, T>,
        live: &mut Live,
        d: &DeviceProgram,
        wanted: &dyn Fn(&crate::program::Result_) -> bool,
        carries: &[(String, Value, Value)],
        m: usize,
    ) -> Result<(Vec<(String, Array)>, Vec<(Value, T)>), String> {
        let g = cx.g;
        let mut next_state = Vec::new();
        // The once-per-step ops, on the mean of the micro-batches.
        let mut env: HashMap<Value, E::Tensor> = HashMap::new();
        for (v, mut t) in self.boundary.drain() {
            let k = 1.0 / m as f64;
            let t = if a.averaged.contains(&v) && m > 1 && !cx.e.scale_in_place(&mut t, k) {
                let mean = self.sums.scale(cx.e, g, v, &t, k)?;
                live.remove(cx.e.storage(&t));
                live.add(cx.e.storage(&mean));
                mean
            } else {
                t
            };
            env.insert(v, t);
        }
        let no_feed = HashMap::new();
        for &n in order.iter().filter(|n| a.once.contains(n)) {
            let produced = cx.node(n, &env, fixed, &no_feed, m)?;
            cx.store(produced, &mut env, live);
        }
        let mut outs = Vec::new();
        for r in d.results.iter().filter(|r| wanted(r)) {
            if let Some((_, xs)) = self.per_micro.iter().find(|s| s.0 == r.local) {
                let fed = g.lookup(&r.local).is_some_and(|v| a.fed.contains(&v));
                let x = if fed { mean(xs, self.weights.as_deref())? } else { xs[xs.len() - 1].clone() };
                outs.push((r.local.clone(), x));
            } else {
                let t = result(g, &r.local, &env, fixed)?;
                outs.push((r.local.clone(), cx.e.download(t)?));
            }
        }
        for (_, iv, nv) in carries {
            let t = env.get(nv).ok_or_else(|| format!("`{}` was not computed", g.value_name(*nv)))?;
            next_state.push((*iv, t.clone()));
        }
        for (_, t) in env.drain() {
            live.remove(cx.e.storage(&t));
        }
        Ok((outs, next_state))
    }
}

/// The element-wise mean of equally shaped float arrays (a result over the micro-batches),
/// weighted by `weights` (one per array, summing to 1) where given.
pub(super) fn mean(xs: &[Array], weights: Option<&[f64]>) -> Result<Array, String> {
    let first = xs.first().ok_or("no micro-batches")?;
    if !first.dtype.is_float() {
        return Err(format!("cannot average {:?} results over micro-batches", first.dtype));
    }
    let mut sum = vec![0.0; first.shape.iter().product::<usize>()];
    let m = xs.len() as f64;
    for (k, x) in xs.iter().enumerate() {
        if x.shape != first.shape {
            return Err(format!("micro-batch results of shapes {:?} and {:?}", first.shape, x.shape));
        }
        let w = weights.map_or(1.0 / m, |w| w.get(k).copied().unwrap_or(0.0));
        if w == 0.0 {
            continue;
        }
        for (s, v) in sum.iter_mut().zip(x.to_f64().map_err(|e| e.to_string())?) {
            *s += w * v;
        }
    }
    Ok(Array::float(first.dtype, first.shape.clone(), sum))
}

/// Whether a run accumulates gradients ([`crate::cut::accumulates`]; it trains when it
/// carries state).
pub(super) fn accumulates(p: &Program, opts: &RunOptions) -> bool {
    crate::cut::accumulates(p, !opts.carry.is_empty())
}

/// The tensor of result `local`: computed this micro-batch, or a parameter.
pub(super) fn result<'t, T>(
    g: &Graph,
    local: &str,
    env: &'t HashMap<Value, T>,
    fixed: &'t HashMap<Value, T>,
) -> Result<&'t T, String> {
    let v = g.lookup(local).ok_or_else(|| format!("no value `{local}`"))?;
    env.get(&v).or_else(|| fixed.get(&v)).ok_or_else(|| format!("output `{local}` was not computed"))
}

/// Which ops of a training program run once per step under gradient accumulation, and the
/// values that cross into them.
pub(super) struct Accumulation {
    /// The optimizer updates and every op that reads what they compute.
    pub(super) once: std::collections::HashSet<NodeId>,
    /// Values the once-per-step ops read that the per-micro-batch ops compute.
    pub(super) boundary: Vec<Value>,
    /// Those of them that are floats depending on the step's inputs: averaged.
    pub(super) averaged: std::collections::HashSet<Value>,
    /// Values that depend on the step's inputs (on this device: its feeds and what it
    /// receives from other stages).
    pub(super) fed: std::collections::HashSet<Value>,
}

impl Accumulation {
    /// [`Accumulation::new`], and carried state (`(name, init, next)`) no once-per-step op
    /// computes (a pipeline stage's own step counter) crosses too: its last micro-batch's
    /// value.
    pub(super) fn for_step(
        g: &Graph,
        order: &[NodeId],
        once: std::collections::HashSet<NodeId>,
        carries: &[(String, Value, Value)],
    ) -> Accumulation {
        let mut a = Accumulation::new(g, order, once);
        for (_, _, nv) in carries {
            if !a.once.contains(&nv.node) && !a.boundary.contains(nv) {
                a.boundary.push(*nv);
            }
        }
        a
    }

    pub(super) fn new(g: &Graph, order: &[NodeId], once: std::collections::HashSet<NodeId>) -> Accumulation {
        use std::collections::HashSet;
        let mut fed: HashSet<Value> = HashSet::new();
        for &n in order {
            let node = g.node(n);
            // A micro-batch's inputs, and what another stage sends of it.
            let varies = matches!(node.op, Op::Input { default: None } | Op::Recv(_));
            if varies || node.inputs().iter().flatten().any(|v| fed.contains(v)) {
                for slot in 0..node.num_outputs() {
                    fed.insert(Value::new(n, slot as u16));
                }
            }
        }
        let mut boundary: Vec<Value> = Vec::new();
        for &n in order.iter().filter(|n| once.contains(n)) {
            for &v in g.node(n).inputs().iter().flatten() {
                let computed = !once.contains(&v.node)
                    && !matches!(g.node(v.node).op, Op::Initializer(_) | Op::Input { default: Some(_) });
                if computed && !boundary.contains(&v) {
                    boundary.push(v);
                }
            }
        }
        let averaged = boundary
            .iter()
            .copied()
            .filter(|v| fed.contains(v) && g.tensor_type(*v).is_some_and(|t| t.dtype.is_float()))
            .collect();
        Accumulation { once, boundary, averaged, fed }
    }

    /// Whether `v` is a result of each micro-batch (not computed once per step, and not
    /// carried into the once-per-step ops).
    pub(super) fn per_micro(&self, v: Value) -> bool {
        !self.once.contains(&v.node) && !self.boundary.contains(&v)
    }
}
