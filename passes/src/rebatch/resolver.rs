//! The resolver: each op's new output dims from its inputs' (symbolic where they follow a changed input), and the constants rewritten to match.

use super::*;

/// What resolving constant axes reads and records: the symbol values, the old dims, the
/// folded constants, the monomials the flow found, the report and, per value, the axes made
/// to follow.
pub(super) struct Resolver<'a> {
    pub(super) syms: &'a [(i64, i64)],
    pub(super) old: &'a HashMap<Value, Vec<i64>>,
    pub(super) consts: &'a HashMap<Value, Array>,
    pub(super) monos: &'a HashMap<Value, Vec<Mono>>,
    pub(super) report: &'a mut RebatchReport,
    pub(super) overrides: &'a mut HashMap<Value, Vec<(usize, Mono)>>,
    /// [`RebatchSpec::micro_batch`].
    pub(super) micro: bool,
    /// [`RebatchSpec::external`].
    pub(super) external: &'a ExternalData,
}

impl Resolver<'_> {
    /// Makes the given axes of value `v` (a constant, or computed from constants) follow changed
    /// dims.
    pub(super) fn resolve(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        self.overrides.entry(v).or_default().extend(axes.iter().cloned());
        if let Op::Input { default: None } = g.node(n).op {
            // Another graph input carries the changed dim: it changes with the others.
            return Ok(());
        }
        let op = g.node(n).op.clone();
        match &op {
            Op::Initializer(_) | Op::Constant(_) => {
                let t = tensor_of(g, v).ok_or_else(|| Located::at(g, n, "not a constant"))?;
                let batch: Vec<usize> = axes
                    .iter()
                    .filter(|(_, m)| self.report.batch_syms.iter().any(|&b| m.uses(b)))
                    .map(|(a, _)| *a)
                    .collect();
                if t.dtype.is_float() && !batch.is_empty() {
                    if ir::cost::is_param(g, v) {
                        return Err(self.parameter(g, v, &t.dims, axes));
                    }
                    // Made in an earlier round (the constant is its own copy): done.
                    if axes.iter().all(|(a, m)| m.eval(self.syms, true).is_some_and(|d| t.dims.get(*a) == Some(&d))) {
                        return Ok(());
                    }
                    // A constant along the batch is the same for every sample (an exporter's
                    // zeros for a recurrent state), or a function of the sample's index that a
                    // new batch extends (`arange(B)`, uniform or arithmetic: `regenerate`) but a
                    // micro-batch would restart.
                    if self.micro
                        && let Some(&a) = batch.iter().find(|&&a| !uniform_along(&t, a))
                    {
                        return Err(Located::at(
                            g,
                            n,
                            format!(
                                "cannot cut the batch into micro-batches: constant `{}` {:?} holds different values along axis {a}, which follows the batch (the samples' index or data traced into the export), so a micro-batch would not compute what its samples compute in the whole batch",
                                g.value_name(v),
                                t.dims
                            ),
                        ));
                    }
                }
                self.regenerate(g, v, axes)
            }
            _ if matches!(op.class(), OpClass::Unary | OpClass::Binary | OpClass::Variadic)
                || matches!(op, Op::Where(_) | Op::Cast(_) | Op::Not(_)) =>
            {
                self.elementwise(g, v, axes)
            }
            Op::Unsqueeze(_)
            | Op::Squeeze(_)
            | Op::Transpose(_)
            | Op::Reshape(_)
            | Op::Expand(_)
            | Op::Slice(_)
            | Op::Gather(_)
            | Op::Range(_)
            | Op::ConstantOfShape(_) => self.shape_op(g, v, &op, axes),
            Op::Concat(c) => self.concat(g, v, c.axis.unwrap_or(0), axes),
            Op::MatMul(_) | Op::Gemm(_) => self.contraction(g, v, &op, axes),
            // A scatter's output is its data with some elements replaced: where the updates
            // follow the batch, the data (zeros of a traced shape, say) must too.
            Op::ScatterElements(_) | Op::ScatterND(_) | Op::Scatter(_) => match g.node(n).input(0) {
                Some(data) => self.resolve(g, data, axes),
                None => Err(Located::at(g, n, format!("cannot rebatch {}: it has no data", g.describe(n)))),
            },
            // Any other op of constants (a cumulative sum of a traced mask of ones: position
            // ids): its value, known, becomes a constant made to follow like the others.
            _ if g.node(n).num_outputs() == 1 && self.consts.contains_key(&v) => self.fold(g, v, axes),
            _ => Err(Located::at(
                g,
                n,
                format!(
                    "cannot rebatch {}: its output `{}` must follow a changed dim, but it is not computed from constants in a way that can be rewritten",
                    g.describe(n),
                    g.value_name(v)
                ),
            )),
        }
    }

    /// Value `v` of a one-output op of constants (the callers' condition), its value known,
    /// made a constant that follows the changed dims as the others do.
    pub(super) fn fold(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let a = self.consts[&v].clone();
        if let Some(o) = self.overrides.get_mut(&v) {
            o.truncate(o.len().saturating_sub(axes.len()));
        }
        g.make_initializer(v.node, a.to_tensor());
        // A value computed from constants is not a parameter.
        ir::cost::freeze(g, v);
        self.resolve(g, v, axes)
    }

    /// The error for a parameter the batch would change.
    pub(super) fn parameter(&self, g: &Graph, v: Value, dims: &[i64], axes: &[(usize, Mono)]) -> Located {
        let syms = self.syms;
        // A parameter: rebatching must never change the network it defines.
        let readers: Vec<String> = g.users(v).into_iter().map(|(u, _)| g.describe(u)).take(2).collect();
        let want: Vec<String> =
            axes.iter().map(|(a, m)| format!("axis {a} → {}", m.eval(syms, true).unwrap_or(-1))).collect();
        Located::at(
            g,
            v.node,
            format!(
                "cannot rebatch: parameter `{}` {:?} (read by {}) would have to change ({}): following the batch through this export leads into a parameter (a batch traced into reshapes, often a batch of 1, cannot be told apart from the features) — re-export with a dynamic batch axis (torch.onnx.export(..., dynamic_axes=...)) or keep the exported batch",
                g.value_name(v),
                dims,
                if readers.is_empty() { "no op".to_string() } else { readers.join(", ") },
                want.join(", ")
            ),
        )
    }

    /// Rewrites a constant (or non-parameter initializer) with the new sizes.
    pub(super) fn regenerate(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let (syms, span) = (self.syms, g.span(n));
        let new_of = |m: &Mono| {
            m.eval(syms, true).ok_or_else(|| Located { node: Some(n), span, msg: "cannot compute a new size".into() })
        };
        let mut t = tensor_of(g, v).ok_or_else(|| Located::at(g, n, "not a constant"))?;
        let describe = format!("constant `{}`", g.value_name(v));
        // External data: its values, read, are regenerated like any others; the bytes at its
        // offset are never read as another shape (a [8,1,128,128] mask's first 2·64·64 bytes
        // are not a [2,1,64,64] mask).
        let absent = t.is_external() && self.external_values(g, v, &mut t, &describe)?;
        if axes.len() == 2 && axes[0].1 == axes[1].1 {
            t = regenerate_square(&t, (axes[0].0.min(axes[1].0), axes[0].0.max(axes[1].0)), new_of(&axes[0].1)?)
                .map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))?;
        } else {
            for (a, m) in axes {
                t = regenerate(&t, *a, new_of(m)?)
                    .map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))?;
            }
        }
        if absent {
            self.report.notes.push(Located::at(
                g,
                n,
                format!("{describe} has external data whose file is not there: its values are drawn, at the new shape"),
            ));
        }
        t.name = None;
        // A private copy for the users that need the new size (all of them here), a constant
        // as the one it replaces (a `Constant` made initializer is not a parameter).
        let frozen = !ir::cost::is_param(g, v);
        g.set_inputs(n, vec![]);
        let ty = Type::Tensor(t.tensor_type());
        g.set_op(n, Op::Initializer(t));
        g.set_label(n, None);
        g.set_type(v, Some(ty));
        if frozen && ir::cost::is_param(g, v) {
            ir::cost::freeze(g, v);
        }
        self.report.constants_regenerated += 1;
        Ok(())
    }

    /// Replaces external tensor `t` (of value `v`) by its values, read; returns true when its
    /// file is not there (its values are drawn from a seed at whatever shape it has). Refused
    /// when [`ExternalData::Refuse`]; left as it is (its shape to change) when
    /// [`ExternalData::ShapesOnly`].
    pub(super) fn external_values(&self, g: &Graph, v: Value, t: &mut Tensor, describe: &str) -> Result<bool, Located> {
        let n = v.node;
        let read = match self.external {
            ExternalData::ShapesOnly => return Ok(false),
            ExternalData::Read(r) => r,
            ExternalData::Refuse => {
                return Err(Located::at(
                    g,
                    n,
                    format!(
                        "cannot rebatch {describe}: its values (external data) must change with the new dims and are not loaded here; load the model with its data, or re-export with dynamic axes (torch.onnx.export(..., dynamic_axes=...) or dynamic_shapes=...) so the exporter does not fold it"
                    ),
                ));
            }
        };
        match (read.0)(t).map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))? {
            Some(mut values) => {
                values.name = t.name.clone();
                *t = values;
                Ok(false)
            }
            None => Ok(true),
        }
    }

    /// An element-wise op: the inputs that carry an axis (not broadcast into it) follow.
    pub(super) fn elementwise(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let syms = self.syms;
        let out_rank = self.old.get(&v).map_or(0, Vec::len);
        let inputs: Vec<Value> = g.node(n).inputs().iter().flatten().copied().collect();
        let mut any = false;
        for inp in inputs {
            let Some(d) = self.old.get(&inp) else { continue };
            let mut sub = Vec::new();
            for (a, m) in axes {
                if d.len() + a < out_rank {
                    continue;
                }
                let ia = d.len() + a - out_rank;
                if (d[ia] != 1 || m.eval(syms, false) == Some(1)) && d[ia] == self.old[&v][*a] {
                    sub.push((ia, m.clone()));
                }
            }
            if !sub.is_empty() {
                any = true;
                self.resolve(g, inp, &sub)?;
            }
        }
        if any {
            Ok(())
        } else {
            Err(Located::at(g, n, format!("cannot rebatch {}: no input carries the axis", g.describe(n))))
        }
    }

    /// A concatenation: off the concat axis every input follows; along it, the parts follow
    /// in proportion to their old sizes (`[3,16] ++ [3,16]` as `[6·b,16]` is `[3·b] ++ [3·b]`:
    /// the halves of a split whose sizes carried the batch).
    pub(super) fn concat(&mut self, g: &mut Graph, v: Value, axis: i64, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let out_old = self.old.get(&v).cloned().unwrap_or_default();
        let r = out_old.len() as i64;
        let ax = (if axis < 0 { axis + r } else { axis }) as usize;
        let inputs: Vec<Value> = g.node(n).inputs().iter().flatten().copied().collect();
        for inp in inputs {
            let Some(d) = self.old.get(&inp).cloned() else { continue };
            let mut sub = Vec::new();
            for (a, m) in axes {
                if *a != ax {
                    sub.push((*a, m.clone()));
                    continue;
                }
                let part = match m {
                    Mono::Known { coef, pows } if (coef * d[ax]) % out_old[ax] == 0 => {
                        Mono::Known { coef: coef * d[ax] / out_old[ax], pows: pows.clone() }
                    }
                    _ => {
                        return Err(Located::at(
                            g,
                            n,
                            format!(
                                "cannot rebatch {}: its axis {ax} must follow a changed dim, and its parts cannot be divided in proportion",
                                g.describe(n)
                            ),
                        ));
                    }
                };
                if d[ax] > 0 {
                    sub.push((*a, part));
                }
            }
            if !sub.is_empty() {
                self.resolve(g, inp, &sub)?;
            }
        }
        Ok(())
    }

    /// A matrix product: its row axis follows the left operand's, its column axis the
    /// right's, its batch axes whichever operand has them at that size.
    pub(super) fn contraction(
        &mut self,
        g: &mut Graph,
        v: Value,
        op: &Op,
        axes: &[(usize, Mono)],
    ) -> Result<(), Located> {
        let n = v.node;
        let out_rank = self.old.get(&v).map_or(0, Vec::len);
        let (a, b) = (g.node(n).input(0).expect("A"), g.node(n).input(1).expect("B"));
        let (ra, rb) = (self.old.get(&a).map_or(0, Vec::len), self.old.get(&b).map_or(0, Vec::len));
        let (mut to_a, mut to_b) = (Vec::new(), Vec::new());
        for (ax, m) in axes {
            match op {
                Op::Gemm(gm) => {
                    if *ax == 0 {
                        to_a.push((usize::from(gm.trans_a() != 0), m.clone()));
                    } else {
                        to_b.push((usize::from(gm.trans_b() == 0), m.clone()));
                    }
                }
                _ if ra >= 2 && *ax == out_rank - 2 => to_a.push((ra - 2, m.clone())),
                _ if rb >= 2 && *ax == out_rank - 1 => to_b.push((rb - 1, m.clone())),
                _ if ra == 1 && *ax == out_rank - 1 => to_b.push((rb - 1, m.clone())),
                _ if rb == 1 && *ax == out_rank - 1 => to_a.push((ra - 2, m.clone())),
                _ => {
                    // A batch axis: the operands that have it at the output's size.
                    let want = self.old[&v][*ax];
                    for (x, rx, to) in [(a, ra, &mut to_a), (b, rb, &mut to_b)] {
                        if rx >= 2 && out_rank - ax <= rx && self.old[&x][rx - (out_rank - ax)] == want {
                            to.push((rx - (out_rank - ax), m.clone()));
                        }
                    }
                }
            }
        }
        if !to_a.is_empty() {
            self.resolve(g, a, &to_a)?;
        }
        if !to_b.is_empty() {
            self.resolve(g, b, &to_b)?;
        }
        Ok(())
    }

    /// A shape op: map the axes to its input's, or rewrite its literal operands.
    pub(super) fn shape_op(&mut self, g: &mut Graph, v: Value, op: &Op, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let (syms, span) = (self.syms, g.span(n));
        let new_of = |m: &Mono| {
            m.eval(syms, true).ok_or_else(|| Located { node: Some(n), span, msg: "cannot compute a new size".into() })
        };
        let in_dims = g.node(n).input(0).and_then(|i| self.old.get(&i)).cloned().unwrap_or_default();
        let out_dims = self.old.get(&v).cloned().unwrap_or_default();
        match op {
            Op::Transpose(t) => {
                let perm: Vec<usize> = t
                    .perm
                    .clone()
                    .map_or((0..out_dims.len()).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
                let sub: Vec<(usize, Mono)> = axes.iter().map(|(a, m)| (perm[*a], m.clone())).collect();
                self.resolve(g, g.node(n).input(0).expect("input"), &sub)
            }
            Op::Unsqueeze(_) | Op::Squeeze(_) | Op::Reshape(_) => {
                // Map axes by dropping/adding size-1 dims in order.
                let non1_in: Vec<usize> = (0..in_dims.len()).filter(|&i| in_dims[i] != 1).collect();
                let non1_out: Vec<usize> = (0..out_dims.len()).filter(|&i| out_dims[i] != 1).collect();
                if non1_in.len() != non1_out.len()
                    || non1_in.iter().zip(&non1_out).any(|(&i, &o)| in_dims[i] != out_dims[o])
                {
                    if self.consts.contains_key(&v) {
                        return self.fold(g, v, axes);
                    }
                    return Err(Located::at(
                        g,
                        n,
                        format!("cannot rebatch {}: a reshape that regroups a changing axis", g.describe(n)),
                    ));
                }
                let sub: Vec<(usize, Mono)> = axes
                    .iter()
                    .filter_map(|(a, m)| non1_out.iter().position(|&o| o == *a).map(|k| (non1_in[k], m.clone())))
                    .collect();
                if sub.len() != axes.len() {
                    return Err(Located::at(
                        g,
                        n,
                        format!("cannot rebatch {}: a size-1 axis would have to grow", g.describe(n)),
                    ));
                }
                self.resolve(g, g.node(n).input(0).expect("input"), &sub)
            }
            Op::Gather(gt) => {
                let data = g.node(n).input(0).expect("data");
                let idx = g.node(n).input(1).expect("indices");
                let r = self.old.get(&data).map_or(0, Vec::len);
                let ax = if gt.axis() < 0 { (gt.axis() + r as i64) as usize } else { gt.axis() as usize };
                let q = self.old.get(&idx).map_or(0, Vec::len);
                let (mut to_idx, mut to_data) = (Vec::new(), Vec::new());
                for (a, m) in axes {
                    if *a < ax {
                        to_data.push((*a, m.clone()));
                    } else if *a < ax + q {
                        to_idx.push((*a - ax, m.clone()));
                    } else {
                        to_data.push((*a - q + 1, m.clone()));
                    }
                }
                if !to_idx.is_empty() {
                    self.resolve(g, idx, &to_idx)?;
                }
                if !to_data.is_empty() {
                    self.resolve(g, data, &to_data)?;
                }
                Ok(())
            }
            Op::Slice(_) => {
                // A slice of an axis that itself follows a changed dim, in proportion to it
                // (`[0:3]` and `[3:6]` of `6·b` rows are the halves `[0:3·b]`, `[3·b:6·b]`):
                // both bounds scale. Otherwise grow the slice of a constant: end = start + new
                // size (step 1, literal bounds). Axes that are not sliced pass the
                // requirement to the input.
                let input = g.node(n).input(0).expect("input");
                let in_m = self.monos.get(&input).cloned();
                let starts = consts_i64(self.consts, g.node(n).input(1)).unwrap_or_default();
                let ends = consts_i64(self.consts, g.node(n).input(2)).unwrap_or_default();
                let ax_list =
                    consts_i64(self.consts, g.node(n).input(3)).unwrap_or_else(|| (0..starts.len() as i64).collect());
                let steps = consts_i64(self.consts, g.node(n).input(4)).unwrap_or_default();
                let r = in_dims.len() as i64;
                let mut through = Vec::new();
                for (a, m) in axes {
                    let Some(k) = ax_list.iter().position(|&x| (if x < 0 { x + r } else { x }) as usize == *a) else {
                        through.push((*a, m.clone()));
                        continue;
                    };
                    if let Some(im) = in_m.as_ref().and_then(|im| im.get(*a)).filter(|im| im.is_tracked())
                        && let (Some(new_in), Some(new_out)) = (im.eval(syms, true), m.eval(syms, true))
                        && let (Some(&d_in), Some(&d_out)) = (in_dims.get(*a), out_dims.get(*a))
                        && d_in > 0
                        && new_out * d_in == new_in * d_out
                    {
                        let scale = |x: i64| -> Option<i64> {
                            let x = if x < 0 { x + d_in } else { x }.clamp(0, d_in);
                            ((x * new_in) % d_in == 0).then(|| x * new_in / d_in)
                        };
                        let (Some(s0), Some(e0)) = (scale(starts[k]), ends.get(k).and_then(|&e| scale(e))) else {
                            return Err(Located::at(
                                g,
                                n,
                                format!(
                                    "cannot rebatch {}: its bounds do not divide the axis in proportion",
                                    g.describe(n)
                                ),
                            ));
                        };
                        if steps.get(k).is_some_and(|&st| st != 1) {
                            return Err(Located::at(
                                g,
                                n,
                                format!("cannot rebatch {}: a strided slice of a changing axis", g.describe(n)),
                            ));
                        }
                        let mut count = rewrite_operand(g, n, 1, &[(k, s0)], self.old, self.consts)
                            .map_err(|e| Located::at(g, n, e))?;
                        count += rewrite_operand(g, n, 2, &[(k, e0)], self.old, self.consts)
                            .map_err(|e| Located::at(g, n, e))?;
                        self.report.literals_rewritten += count;
                        continue;
                    }
                    let new_end = starts[k] + new_of(m)?;
                    if let Some(&dim) = in_dims.get(*a)
                        && new_end > dim
                    {
                        return Err(Located::at(
                            g,
                            n,
                            format!(
                                "cannot rebatch {}: the slice would need {new_end} of the {dim} entries its input has",
                                g.describe(n)
                            ),
                        ));
                    }
                    let count = rewrite_operand(g, n, 2, &[(k, new_end)], self.old, self.consts)
                        .map_err(|e| Located::at(g, n, e))?;
                    self.report.literals_rewritten += count;
                }
                if !through.is_empty() {
                    self.resolve(g, input, &through)?;
                }
                Ok(())
            }
            Op::Range(_) => {
                let start = consts_i64(self.consts, g.node(n).input(0)).and_then(|v| v.first().copied());
                let delta = consts_i64(self.consts, g.node(n).input(2)).and_then(|v| v.first().copied());
                let (Some(s), Some(d)) = (start, delta) else {
                    return Err(Located::at(
                        g,
                        n,
                        format!("cannot rebatch {}: its bounds are not literals", g.describe(n)),
                    ));
                };
                let new_limit = s + d * new_of(&axes[0].1)?;
                self.report.literals_rewritten += rewrite_operand(g, n, 1, &[(0, new_limit)], self.old, self.consts)
                    .map_err(|e| Located::at(g, n, e))?;
                Ok(())
            }
            Op::Expand(_) | Op::ConstantOfShape(_) => {
                let slot = if matches!(op, Op::Expand(_)) { 1 } else { 0 };
                if let Op::Expand(_) = op {
                    // Input axes of the same old size (not broadcast) must follow too.
                    let x = g.node(n).input(0).expect("input");
                    let r = out_dims.len();
                    let sub: Vec<(usize, Mono)> = axes
                        .iter()
                        .filter_map(|(a, m)| {
                            let k = (a + in_dims.len()).checked_sub(r)?;
                            (in_dims[k] == out_dims[*a] && in_dims[k] != 1).then(|| (k, m.clone()))
                        })
                        .collect();
                    if !sub.is_empty() {
                        self.resolve(g, x, &sub)?;
                    }
                }
                let spec_len = g
                    .node(n)
                    .input(slot)
                    .and_then(|v| self.old.get(&v))
                    .and_then(|d| d.first().copied())
                    .unwrap_or(out_dims.len() as i64) as usize;
                let ups: Vec<(usize, i64)> = axes
                    .iter()
                    .map(|(a, m)| Ok((*a + spec_len.saturating_sub(out_dims.len()), new_of(m)?)))
                    .collect::<Result<_, Located>>()?;
                self.report.literals_rewritten +=
                    rewrite_operand(g, n, slot, &ups, self.old, self.consts).map_err(|e| Located::at(g, n, e))?;
                Ok(())
            }
            _ => unreachable!(),
        }
    }
}

/// Writes the new sizes of tracked axes into the literal shape operands that produce them.
pub(super) fn rewrite_literals(
    g: &mut Graph,
    order: &[NodeId],
    monos: &HashMap<Value, Vec<Mono>>,
    old: &HashMap<Value, Vec<i64>>,
    syms: &[(i64, i64)],
    consts: &HashMap<Value, Array>,
) -> Result<usize, Vec<Located>> {
    let mut count = 0;
    let mut errors = Vec::new();
    for &n in order {
        if !g.contains(n) {
            continue;
        }
        let out = Value::new(n, 0);
        let Some(m) = monos.get(&out).cloned() else { continue };
        if !m.iter().any(Mono::is_tracked) {
            continue;
        }
        let op = g.node(n).op.clone();
        let (slot, spec) = match &op {
            Op::Reshape(_) | Op::Expand(_) => (1, consts_i64(consts, g.node(n).input(1))),
            Op::Tile(_) => (1, consts_i64(consts, g.node(n).input(1))),
            _ => continue,
        };
        // Elements of the operand to update: (index, new value).
        let mut ups = Vec::new();
        for (i, mm) in m.iter().enumerate() {
            if !mm.is_tracked() {
                continue;
            }
            let Some(new) = mm.eval(syms, true) else {
                // Opaque: fine when the literal is -1/0/1 (derived from the input).
                if let Some(s) = &spec
                    && let Some(&lit) = s.get(i)
                    && !matches!(lit, -1..=1)
                    && !matches!(op, Op::Tile(_))
                {
                    errors.push(Located::at(g, n, format!("cannot rebatch {}: axis {i} changes in a way that cannot be computed, but its size is the literal {lit}", g.describe(n))));
                }
                continue;
            };
            match &op {
                Op::Reshape(r) => {
                    if let Some(s) = &spec
                        && let Some(&lit) = s.get(i)
                        && (lit == -1 || (lit == 0 && r.allowzero() == 0))
                    {
                        continue;
                    }
                    ups.push((i, new));
                }
                Op::Expand(_) => {
                    let r = m.len();
                    let xo = g.node(n).input(0).and_then(|v| old.get(&v)).cloned().unwrap_or_default();
                    let k = (i + xo.len()).checked_sub(r);
                    let lit = spec.as_ref().and_then(|s| s.get(i + s.len().saturating_sub(r))).copied();
                    if lit == Some(1)
                        && k.is_some_and(|k| {
                            xo[k] != 1
                                || monos.get(&g.node(n).input(0).expect("x")).is_some_and(|xm| xm[k].is_tracked())
                        })
                    {
                        continue;
                    }
                    let sl = spec.as_ref().map_or(0, Vec::len);
                    ups.push((i + sl.saturating_sub(r), new));
                }
                Op::Tile(_) => {
                    let xo = g
                        .node(n)
                        .input(0)
                        .and_then(|v| monos.get(&v))
                        .and_then(|xm| xm.get(i).and_then(|x| x.eval(syms, true)));
                    let rep = match xo {
                        Some(x) if x > 0 && new % x == 0 => new / x,
                        _ => continue,
                    };
                    ups.push((i, rep));
                }
                _ => {}
            }
        }
        if ups.is_empty() {
            continue;
        }
        match rewrite_operand(g, n, slot, &ups, old, consts) {
            Ok(c) => count += c,
            Err(e) => errors.push(Located::at(g, n, format!("cannot rebatch {}: {e}", g.describe(n)))),
        }
    }
    // Literals orphaned by private copies are dead now.
    if errors.is_empty() {
        crate::canonicalize::eliminate_unused_initializers(g);
        Ok(count)
    } else {
        Err(errors)
    }
}
