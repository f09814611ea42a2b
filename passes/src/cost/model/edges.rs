//! What each op reads and delivers: ZeRO's layouts, copies between layouts, the reshards on each
//! edge and of the graph outputs.

use super::*;

impl<'a> CostModel<'a> {
    /// ZeRO's layouts in this training graph ([`ir::reshard::ZeroLayouts`]), from its updates'
    /// strategies, as the lowering reads them.
    pub(super) fn zero_layouts(&self, evals: &[Rc<OpEval>]) -> ir::reshard::ZeroLayouts {
        if self.opts.zero < 2 {
            return ir::reshard::ZeroLayouts::default();
        }
        let pos: FxHashMap<NodeId, usize> = self.order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        ir::reshard::ZeroLayouts::new(self.g, self.opts.zero, |u, j| {
            pos.get(&u).and_then(|&p| evals[p].ins.get(j).cloned().flatten())
        })
    }

    /// The layout graph output `v` (held in `from`) is delivered in: a ZeRO gradient's shard,
    /// else [`ir::reshard::delivered_layout`].
    pub(super) fn delivered(
        &self,
        v: Value,
        from: &Sharding,
        storage: &BTreeMap<Value, Sharding>,
        zero: &ir::reshard::ZeroLayouts,
        carried: &[(Value, Value)],
    ) -> Sharding {
        let cuts = self.cuts.get(&v).map_or(&[][..], Vec::as_slice);
        zero.delivered(self.g, carried, v, from, cuts, |s| storage.get(&s).cloned())
    }

    /// The copies a training step holds beside its ops' outputs, as the lowering makes them:
    /// a value brought to another layout for a reader is held from the first reader that
    /// needs it there to the last — to the end when the value is also delivered so — except
    /// that a ZeRO-3 parameter's copies made in the forward pass end with it; a graph output
    /// delivered in a layout no reader made is made at the end, in place of the value.
    pub(super) fn copies<'e>(
        &self,
        evals: &[Rc<OpEval>],
        have: &dyn Fn(Value) -> &'e Sharding,
        produced: &dyn Fn(Value) -> bool,
        deliveries: &[(Value, Sharding)],
        zero: &ir::reshard::ZeroLayouts,
    ) -> Copies {
        let g = self.g;
        let end = self.order.len();
        // A ZeRO-3 parameter's copies live within one pass (`epoch`): they end when a forward
        // pass does.
        let mut life: FxHashMap<(Value, Sharding, usize), (usize, usize)> = FxHashMap::default();
        let mut last: FxHashMap<Value, usize> = FxHashMap::default();
        let (mut prev, mut epoch) = (None, 0);
        let mut pos_of: FxHashMap<NodeId, usize> = FxHashMap::default();
        for (pos, (&n, e)) in self.order.iter().zip(evals).enumerate() {
            pos_of.insert(n, pos);
            let phase = Some(self.phase(n));
            epoch += usize::from(ir::reshard::ZeroLayouts::ends_forward(prev, phase));
            prev = phase;
            for (j, v) in g.node(n).inputs().iter().enumerate() {
                let Some(v) = v else { continue };
                let need = e.ins.get(j).cloned().flatten();
                let copy = need
                    .filter(|need| (ir::reshard::held_once(g, *v) || produced(*v)) && self.copies_on(have(*v), need));
                // The value is read here, or copied where its copy is made.
                let at = match copy {
                    None => pos,
                    Some(need) => {
                        // A ZeRO gradient is brought to its update's shard where it is computed.
                        let first = if zero.gradients.get(v) == Some(&need) { pos_of[&v.node] } else { pos };
                        let key = (*v, need, if zero.regathered(*v) { epoch } else { 0 });
                        let l = life.entry(key).or_insert((first, pos));
                        l.1 = pos;
                        l.0
                    }
                };
                let l = last.entry(*v).or_insert(at);
                *l = (*l).max(at);
            }
        }
        let mut c =
            Copies { made: vec![0.0; end], freed: vec![0.0; end], frees: vec![Vec::new(); end], ..Copies::default() };
        for (v, to) in deliveries {
            let v = *v;
            if to == have(v) {
                continue;
            }
            match life.get_mut(&(v, to.clone(), if zero.regathered(v) { epoch } else { 0 })) {
                Some(l) => {
                    l.1 = end;
                    c.delivered_early.insert(v);
                }
                // Made at the end, after which the value itself is not held.
                None => {
                    c.at_end += self.value_bytes(v) / split_factor(to, &self.mesh)
                        - self.value_bytes(v) / split_factor(have(v), &self.mesh)
                }
            }
        }
        for ((v, layout, _), (first, last)) in life {
            let bytes = self.value_bytes(v) / split_factor(&layout, &self.mesh);
            c.made[first] += bytes;
            if last < end {
                c.freed[last] += bytes;
            }
        }
        for (&v, &at) in &last {
            c.frees[at].push(v);
        }
        c.read = last.into_keys().collect();
        c
    }

    /// Layouts: op outputs from their strategies; parameters, constants and graph inputs as
    /// their first reader needs them, never as partial sums (see [`ir::reshard::held_once`],
    /// [`ir::reshard::held_layout`]).
    pub(super) fn layouts<'e>(
        &self,
        evals: &'e [Rc<OpEval>],
        zero: &ir::reshard::ZeroLayouts,
    ) -> (FxHashMap<Value, &'e Sharding>, BTreeMap<Value, Sharding>) {
        let g = self.g;
        let replicated: Sharding = vec![AxisShard::Replicate; self.mesh.axes.len()];
        let mut out_sh: FxHashMap<Value, &Sharding> = FxHashMap::default();
        out_sh.reserve(self.order.len());
        for (&n, e) in self.order.iter().zip(evals) {
            for (slot, sh) in e.outs.iter().enumerate() {
                out_sh.insert(Value::new(n, slot as u16), sh);
            }
        }
        let mut storage: BTreeMap<Value, Sharding> = zero.params.iter().map(|(v, l)| (*v, l.clone())).collect();
        for (&n, e) in self.order.iter().zip(evals) {
            for (j, v) in g.node(n).inputs().iter().enumerate() {
                if let Some(v) = v
                    && !out_sh.contains_key(v)
                    && !storage.contains_key(v)
                {
                    let need = e.ins.get(j).cloned().flatten();
                    storage.insert(*v, need.map_or_else(|| replicated.clone(), |l| ir::reshard::held_layout(&l)));
                }
            }
        }
        (out_sh, storage)
    }

    /// Gradients flow back into `v` in the backward pass priced ([`ir::cost::grad_flow`]; a
    /// training graph computes its gradients itself, so none are added for it).
    pub(crate) fn needs_grad(&self, v: Value) -> bool {
        self.phases.is_none() && self.grads.contains(&v)
    }

    /// The reshardings on the inputs of op `n` (position `pos`): forward, each input brought
    /// to the layout the op needs (once per layout); backward, the input's gradient — partial
    /// along axes the op splits while the input is replicated on them — brought back to the
    /// layout it was held in. Parameters' gradients are collected for synchronisation.
    /// Returns the forward and backward communication seconds, and the backward compute
    /// seconds of summing the gradients of a value read more than once (autodiff's `Sum`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn op_edges<'e>(
        &self,
        w: &mut Walk,
        edges: &mut Edges<'e>,
        pos: usize,
        n: NodeId,
        e: &'e OpEval,
        have: &dyn Fn(Value) -> &'e Sharding,
        produced: &dyn Fn(Value) -> bool,
    ) -> (f64, f64, f64) {
        let g = self.g;
        let axes = self.mesh.axes.len();
        let s = &e.strategy;
        let (mut fwd, mut bwd, mut sum) = (0.0, 0.0, 0.0);
        let node = g.node(n);
        for (j, v) in node.inputs().iter().enumerate() {
            let Some(v) = v else { continue };
            let Some(Some(need)) = e.ins.get(j) else { continue };
            if !ir::reshard::held_once(g, *v) && !produced(*v) {
                continue; // integer inputs and constants: the host provides every layout
            }
            let src = have(*v);
            // A tensor is materialized in a layout once, however many ops read it there.
            if src != need && edges.materialized.insert((*v, need)) {
                let steps = self.reshard(*v, src, need, 1.0);
                fwd += w.record(self.phase(n), *v, Some(n), src, need, &steps) + self.reshard_local(*v, src, need);
            }
            if !self.needs_grad(*v) || !node.op.rules().differentiates(j) {
                continue;
            }
            let whole = e.reduces_param_grads && ir::cost::is_param(g, *v);
            let grad: Sharding = (0..axes)
                .map(|a| {
                    if need[a] == AxisShard::Replicate && s[a].is_some() && !whole {
                        AxisShard::Partial
                    } else {
                        need[a]
                    }
                })
                .collect();
            // The gradients of a value read more than once are summed by one kernel reading
            // them all: its launch and two passes with the second read, a pass per further one.
            let reads = edges.grad_reads.entry(*v).or_insert(0);
            *reads += 1;
            if *reads > 1 {
                let first = *reads == 2;
                let bytes = self.value_bytes(*v) / split_factor(&grad, &self.mesh);
                let kernel = self.cluster.device.kernel_factors.get("Sum").copied().unwrap_or(1.0);
                sum += bytes * if first { 3.0 } else { 1.0 } / self.mem_bandwidth() * kernel
                    + if first { self.launch() } else { 0.0 };
            }
            if ir::cost::is_param(g, *v) {
                let acc = edges.param_grad.entry(*v).or_insert_with(|| src.clone());
                for a in 0..axes {
                    if grad[a] == AxisShard::Partial {
                        acc[a] = AxisShard::Partial;
                    }
                }
                // Its gradient is complete when its first reader's backward finishes.
                edges.param_first_use.entry(*v).or_insert(pos);
            } else if !edges.grads_sent.contains(&(*v, grad.clone())) {
                // Gradients of one layout from several readers are summed locally first.
                let target: Sharding =
                    src.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
                let steps = self.reshard(*v, &grad, &target, 1.0);
                bwd += w.record(Phase::Backward, *v, Some(n), &grad, &target, &steps)
                    + self.reshard_local(*v, &grad, &target);
                edges.grads_sent.insert((*v, grad));
            }
        }
        (fwd, bwd, sum)
    }

    /// The collectives that bring every graph output to [`ir::reshard::delivered_layout`].
    pub(super) fn output_comm<'e>(
        &self,
        w: &mut Walk,
        edges: &Edges<'e>,
        have: &dyn Fn(Value) -> &'e Sharding,
        deliveries: &[(Value, Sharding)],
    ) -> [f64; 3] {
        let mut t = [0.0; 3];
        for (v, to) in deliveries {
            let (v, from) = (*v, have(*v));
            if edges.materialized.contains(&(v, to)) {
                continue; // a reader already made it
            }
            let steps = self.reshard(v, from, to, 1.0);
            let phase = self.phase(v.node);
            t[phase as usize] += w.record(phase, v, None, from, to, &steps) + self.reshard_local(v, from, to);
        }
        t
    }

    /// Each graph output held once ([`ir::reshard::held_once`]), once, with the layout it is
    /// delivered in ([`CostModel::delivered`]).
    pub(super) fn deliveries<'e>(
        &self,
        have: &dyn Fn(Value) -> &'e Sharding,
        storage: &BTreeMap<Value, Sharding>,
        zero: &ir::reshard::ZeroLayouts,
    ) -> Vec<(Value, Sharding)> {
        let carried = ir::train::carried_state(self.g);
        let mut done: FxHashSet<Value> = FxHashSet::default();
        let outs = self.g.outputs().iter().map(|o| o.value);
        outs.filter(|&v| done.insert(v) && ir::reshard::held_once(self.g, v))
            .map(|v| (v, self.delivered(v, have(v), storage, zero, &carried)))
            .collect()
    }
}
