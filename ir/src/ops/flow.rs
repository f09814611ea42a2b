//! How changed dims flow through ops: the engine behind rebatching.
//!
//! When an input's dims change (a new batch size, sequence length or resolution), every axis
//! of every value is described by a [`Mono`]: its size as a constant times a product of the
//! changed dims (symbols, each an `(old, new)` pair), or `Opaque` when it changes in a way
//! that cannot be followed. Each op's [`crate::ops::OpRules::flow`] computes its outputs'
//! monomials from its inputs' through a [`FlowCx`]; where an op needs two axes to be equal
//! (a matmul's contraction, a broadcast), a constant axis that meets a changing one becomes a
//! requirement the rebatch pass resolves by rewriting the constant.

use std::collections::{BTreeMap, HashMap};

use crate::array::Array;
use crate::graph::{Graph, NodeId, Value};

/// An axis size as `coef × Π sym^exp`, or untracked-and-changing (`Opaque`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mono {
    /// A known product.
    Known {
        /// The constant factor.
        coef: i64,
        /// Symbol → exponent.
        pows: BTreeMap<usize, u32>,
    },
    /// Changes in a way that cannot be followed.
    Opaque,
}

impl Mono {
    /// A constant size.
    pub fn constant(v: i64) -> Mono {
        Mono::Known { coef: v, pows: BTreeMap::new() }
    }

    /// A changed dim.
    pub fn sym(s: usize) -> Mono {
        Mono::Known { coef: 1, pows: BTreeMap::from([(s, 1)]) }
    }

    /// The size depends on symbol `s`.
    pub fn uses(&self, s: usize) -> bool {
        matches!(self, Mono::Known { pows, .. } if pows.contains_key(&s))
    }

    /// The axis changes size.
    pub fn is_tracked(&self) -> bool {
        match self {
            Mono::Known { pows, .. } => !pows.is_empty(),
            Mono::Opaque => true,
        }
    }

    /// The product of two sizes.
    pub fn mul(&self, o: &Mono) -> Mono {
        match (self, o) {
            (Mono::Known { coef: a, pows: p }, Mono::Known { coef: b, pows: q }) => {
                let mut pows = p.clone();
                for (k, e) in q {
                    *pows.entry(*k).or_insert(0) += e;
                }
                Mono::Known { coef: a.saturating_mul(*b), pows }
            }
            _ => Mono::Opaque,
        }
    }

    /// The size with every symbol at its old (`new == false`) or new value.
    pub fn eval(&self, syms: &[(i64, i64)], new: bool) -> Option<i64> {
        match self {
            Mono::Known { coef, pows } => {
                let mut v = *coef;
                for (s, e) in pows {
                    let base = if new { syms[*s].1 } else { syms[*s].0 };
                    v = v.checked_mul(base.checked_pow(*e)?)?;
                }
                Some(v)
            }
            Mono::Opaque => None,
        }
    }
}

/// The state of one flow over a graph, and the node being visited.
pub struct FlowCx<'a> {
    /// The graph (as it was, old shapes).
    pub g: &'a Graph,
    /// The node visited.
    pub n: NodeId,
    /// The symbols: `(old, new)` size of each changed dim.
    pub syms: &'a [(i64, i64)],
    /// Old static dims of every value.
    pub old: &'a HashMap<Value, Vec<i64>>,
    /// Folded constants of the old graph.
    pub consts: &'a HashMap<Value, Array>,
    /// Monomials of the values visited so far (values absent here keep their old sizes).
    pub monos: &'a mut HashMap<Value, Vec<Mono>>,
    /// Requirements: axis `.1` of constant value `.0` must follow the monomial `.2`.
    pub reqs: &'a mut Vec<(Value, usize, Mono)>,
    /// Why the flow cannot go on, per node.
    pub errors: &'a mut Vec<(NodeId, String)>,
    /// The op of the node visited has no flow rule (set by the default rule).
    pub missing_rule: bool,
}

impl FlowCx<'_> {
    /// Old dims of a value.
    pub fn old_dims(&self, v: Value) -> Option<&Vec<i64>> {
        self.old.get(&v)
    }

    /// Old dims of output 0.
    pub fn out_old(&self) -> Vec<i64> {
        self.old_dims(Value::new(self.n, 0)).cloned().unwrap_or_default()
    }

    /// Old dims of output `s`.
    pub fn out_old_at(&self, s: usize) -> Option<Vec<i64>> {
        self.old_dims(Value::new(self.n, s as u16)).cloned()
    }

    /// Input `i`.
    pub fn input(&self, i: usize) -> Option<Value> {
        self.g.node(self.n).input(i)
    }

    /// Every present input, in order.
    pub fn inputs(&self) -> Vec<Value> {
        self.g.node(self.n).inputs().iter().flatten().copied().collect()
    }

    /// The node's output count.
    pub fn n_out(&self) -> usize {
        self.g.node(self.n).num_outputs()
    }

    /// Monomials of a value (its old sizes as constants when it does not change).
    pub fn monos_of(&self, v: Value) -> Option<Vec<Mono>> {
        if let Some(m) = self.monos.get(&v) {
            return Some(m.clone());
        }
        self.old_dims(v).map(|d| d.iter().map(|&x| Mono::constant(x)).collect())
    }

    /// Monomials of input `i`.
    pub fn in_m(&self, i: usize) -> Option<Vec<Mono>> {
        self.input(i).and_then(|v| self.monos_of(v))
    }

    /// Old dims of input `i`.
    pub fn in_old(&self, i: usize) -> Option<Vec<i64>> {
        self.input(i).and_then(|v| self.old_dims(v).cloned())
    }

    /// Input `i`'s folded value as integers.
    pub fn ints(&self, i: usize) -> Option<Vec<i64>> {
        self.consts.get(&self.input(i)?).and_then(|a| a.to_i64().ok())
    }

    /// Some input changes size.
    pub fn tracked_in(&self) -> bool {
        self.g
            .node(self.n)
            .inputs()
            .iter()
            .flatten()
            .any(|v| self.monos.get(v).is_some_and(|m| m.iter().any(Mono::is_tracked)))
    }

    /// Sets output `slot`'s monomials.
    pub fn set(&mut self, slot: usize, m: Vec<Mono>) {
        self.monos.insert(Value::new(self.n, slot as u16), m);
    }

    /// Sets every output's monomials.
    pub fn set_all(&mut self, m: Vec<Mono>) {
        for s in 0..self.n_out() {
            self.set(s, m.clone());
        }
    }

    /// Records why the node cannot be rebatched.
    pub fn error(&mut self, msg: impl Into<String>) {
        self.errors.push((self.n, msg.into()));
    }

    /// Output 0 follows input 0 axis for axis (same shape).
    pub fn same_as_input(&mut self) {
        if let Some(m) = self.in_m(0) {
            self.set(0, m);
        }
    }

    /// Unifies aligned axes of the inputs (right-aligned, numpy broadcasting) into the old
    /// output dims `out_old`; a constant axis that meets a changing one is required to follow
    /// it.
    pub fn broadcast(&mut self, inputs: &[Value], out_old: &[i64]) -> Vec<Mono> {
        self.align(inputs, out_old, false)
    }

    /// Like [`FlowCx::broadcast`], for inputs whose axes must be equal (no broadcasting):
    /// a size-1 constant axis meeting a changing one must follow it too (the class token
    /// `Expand`ed to a batch of 1, concatenated with the patches).
    pub fn equal_axes(&mut self, inputs: &[Value], out_old: &[i64]) -> Vec<Mono> {
        self.align(inputs, out_old, true)
    }

    fn align(&mut self, inputs: &[Value], out_old: &[i64], strict: bool) -> Vec<Mono> {
        let r = out_old.len();
        let mut out = Vec::with_capacity(r);
        for (i, &ov) in out_old.iter().enumerate() {
            let mut tracked: Option<Mono> = None;
            let mut constants: Vec<(Value, usize)> = Vec::new();
            for &v in inputs {
                let (Some(dims), Some(monos)) = (self.old_dims(v).cloned(), self.monos_of(v)) else { continue };
                if dims.len() + i < r {
                    continue;
                }
                let a = dims.len() + i - r;
                if dims[a] != ov {
                    continue; // broadcasting from 1
                }
                let m = &monos[a];
                if m.is_tracked() {
                    match &tracked {
                        None => tracked = Some(m.clone()),
                        Some(t) if t == m => {}
                        Some(t) => {
                            if ov != 1 {
                                let msg = format!("axis {i} combines two different changed dims ({t:?} and {m:?})");
                                self.error(msg);
                            }
                        }
                    }
                } else {
                    constants.push((v, a));
                }
            }
            match tracked {
                Some(t) => {
                    if ov != 1 || strict {
                        for (v, a) in constants {
                            self.reqs.push((v, a, t.clone()));
                        }
                    }
                    out.push(t);
                }
                None => out.push(Mono::constant(ov)),
            }
        }
        out
    }

    /// Each output axis follows the same-numbered axis of input `from` when their old sizes
    /// agree (the batch of a per-sample op, the axes a pad or resize leaves alone); other axes
    /// keep their old size, and a changing axis whose size the op changes cannot be followed.
    /// Re-inference after rebatching checks every claim.
    pub fn positional(&mut self, from: usize) {
        let (Some(in_m), Some(in_old)) = (self.in_m(from), self.in_old(from)) else { return };
        for s in 0..self.n_out() {
            let Some(out_old) = self.out_old_at(s) else { continue };
            let m = out_old
                .iter()
                .enumerate()
                .map(|(a, &o)| match in_old.get(a) {
                    Some(&i) if i == o => in_m[a].clone(),
                    Some(_) if in_m[a].is_tracked() => Mono::Opaque,
                    _ => Mono::constant(o),
                })
                .collect();
            self.set(s, m);
        }
    }

    /// The outputs keep their old sizes: they depend on input values, not input dims.
    pub fn constant_outputs(&mut self) {
        for s in 0..self.n_out() {
            if let Some(d) = self.out_old_at(s) {
                self.set(s, d.iter().map(|&x| Mono::constant(x)).collect());
            }
        }
    }

    /// Every output is the broadcast of every input (element-wise ops).
    pub fn broadcast_all(&mut self) {
        let ins = self.inputs();
        let out_old = self.out_old();
        let m = self.broadcast(&ins, &out_old);
        self.set_all(m);
    }

    /// Unifies two axes that must be equal (a matmul's contraction axis).
    pub fn unify(&mut self, a: (Value, usize), b: (Value, usize)) {
        let (Some(ma), Some(mb)) = (self.monos_of(a.0), self.monos_of(b.0)) else { return };
        let (x, y) = (&ma[a.1], &mb[b.1]);
        match (x.is_tracked(), y.is_tracked()) {
            (true, false) => self.reqs.push((b.0, b.1, x.clone())),
            (false, true) => self.reqs.push((a.0, a.1, y.clone())),
            (true, true) if x != y => self.error("the contracted axes follow different changed dims"),
            _ => {}
        }
    }

    /// The default of ops without a rule: [`FlowCx::opaque_outputs`], recorded as missing.
    pub fn no_rule(&mut self) {
        self.missing_rule = true;
        self.opaque_outputs();
    }

    /// When an input changes, every output axis changes in a way that cannot be followed.
    pub fn opaque_outputs(&mut self) {
        if self.tracked_in() {
            for s in 0..self.n_out() {
                let rank = self.old_dims(Value::new(self.n, s as u16)).map_or(0, Vec::len);
                self.set(s, vec![Mono::Opaque; rank]);
            }
        }
    }
}

/// The flow rule of an op whose output axes follow input `$i`'s by position
/// ([`FlowCx::positional`]): per-sample ops, and ops that leave some axes alone.
macro_rules! flow_positional {
    ($i:expr) => {
        fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
            cx.positional($i);
            Some(())
        }
    };
}
pub(crate) use flow_positional;

/// Flows changed dims through `order` (a topological order of `g`) with each op's rule:
/// returns the monomials of every value visited, the requirements on constants, and the
/// errors by node. `input_monos` seeds the changed inputs; `overrides` pin axes already made
/// to follow a changed dim.
pub fn flow_graph(
    g: &Graph,
    order: &[NodeId],
    syms: &[(i64, i64)],
    old: &HashMap<Value, Vec<i64>>,
    consts: &HashMap<Value, Array>,
    input_monos: &HashMap<Value, Vec<Mono>>,
    overrides: &HashMap<Value, Vec<(usize, Mono)>>,
) -> Flow {
    let mut monos = input_monos.clone();
    let mut reqs = Vec::new();
    let mut errors: Vec<(NodeId, String)> = Vec::new();
    let mut missing = Vec::new();
    for &n in order {
        // Symbolic old shapes were computed dynamically by the export; re-inference updates them.
        if old.contains_key(&Value::new(n, 0)) {
            let mut cx = FlowCx {
                g,
                n,
                syms,
                old,
                consts,
                monos: &mut monos,
                reqs: &mut reqs,
                errors: &mut errors,
                missing_rule: false,
            };
            g.node(n).op.rules().flow(&mut cx);
            if cx.missing_rule {
                missing.push(n);
            }
        }
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            let Some(ov) = overrides.get(&v) else { continue };
            let old_d = old.get(&v);
            let rank = old_d.map_or(0, Vec::len);
            let mut m = monos
                .get(&v)
                .cloned()
                .unwrap_or_else(|| old_d.map(|d| d.iter().map(|&x| Mono::constant(x)).collect()).unwrap_or_default());
            m.resize(rank, Mono::Opaque);
            for (a, mono) in ov {
                if *a < m.len() {
                    m[*a] = mono.clone();
                }
            }
            monos.insert(v, m);
        }
    }
    Flow { monos, reqs, errors, missing }
}

/// What a flow over a graph found.
pub struct Flow {
    /// Monomials of the values that change.
    pub monos: HashMap<Value, Vec<Mono>>,
    /// Requirements: axis `.1` of constant value `.0` must follow the monomial `.2`.
    pub reqs: Vec<(Value, usize, Mono)>,
    /// Why the flow cannot go on, per node.
    pub errors: Vec<(NodeId, String)>,
    /// Nodes a changed dim reached whose op has no rule (their outputs became opaque).
    pub missing: Vec<NodeId>,
}

/// Size-1 changed dims as `(symbol, exponent)`.
type UnitFactors = Vec<(usize, u32)>;

/// Factors a reshape: monomials of the output dims from the input's, aligning old sizes.
///
/// Dims of old size 1 are set aside; the rest are grouped so that products agree. Changed
/// dims of old size > 1 are split among their group's output dims (preferring a dim of equal
/// old size); changed dims of old size 1 (a batch of 1) go to a size-1 output dim just before
/// the group they preceded, or multiply that group's first dim when there is none — or the
/// previous group's last dim when the next is the innermost output axis (the features).
pub fn factor_reshape(
    in_old: &[i64],
    in_m: &[Mono],
    out_old: &[i64],
    syms: &[(i64, i64)],
) -> Result<Vec<Mono>, String> {
    let mut out: Vec<Mono> = out_old.iter().map(|&v| Mono::constant(v)).collect();
    let ins: Vec<usize> = (0..in_old.len()).filter(|&i| in_old[i] != 1).collect();
    let outs: Vec<usize> = (0..out_old.len()).filter(|&j| out_old[j] != 1).collect();
    // Groups of (input dims, output dims) with equal products.
    let mut groups: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < ins.len() || j < outs.len() {
        let (mut gi, mut go) = (Vec::new(), Vec::new());
        let (mut pi, mut pj) = (1i64, 1i64);
        if i < ins.len() {
            pi = in_old[ins[i]];
            gi.push(ins[i]);
            i += 1;
        }
        if j < outs.len() {
            pj = out_old[outs[j]];
            go.push(outs[j]);
            j += 1;
        }
        while pi != pj {
            if pi < pj && i < ins.len() {
                pi *= in_old[ins[i]];
                gi.push(ins[i]);
                i += 1;
            } else if pj < pi && j < outs.len() {
                pj *= out_old[outs[j]];
                go.push(outs[j]);
                j += 1;
            } else {
                return Err(format!("old shapes {in_old:?} and {out_old:?} do not factor"));
            }
        }
        groups.push((gi, go));
    }
    let split_unit = |m: &Mono| -> (Mono, Vec<(usize, u32)>) {
        // Separates factors whose old size is 1 (they cannot be located by size).
        match m {
            Mono::Known { coef, pows } => {
                let mut keep = BTreeMap::new();
                let mut unit = Vec::new();
                for (&s, &e) in pows {
                    if syms[s].0 == 1 {
                        unit.push((s, e));
                    } else {
                        keep.insert(s, e);
                    }
                }
                (Mono::Known { coef: *coef, pows: keep }, unit)
            }
            Mono::Opaque => (Mono::Opaque, Vec::new()),
        }
    };
    // Size-1 factors, anchored to the group they precede (groups.len() = after the last).
    // Each also says whether it may sit after its group instead (a factor of a merged group:
    // `[S·B,E] → [S,1,E]` has its place after `S`).
    let mut anchored: Vec<(usize, UnitFactors, bool)> = Vec::new();
    for (k, &d) in in_old.iter().enumerate() {
        if d == 1 && in_m[k].is_tracked() {
            let anchor = groups.iter().position(|(gi, _)| gi.first().is_some_and(|&f| f > k)).unwrap_or(groups.len());
            let (rest, unit) = split_unit(&in_m[k]);
            if rest.is_tracked() {
                return Err("a size-1 axis carries a changed dim that is not of size 1".into());
            }
            anchored.push((anchor, unit, false));
        }
    }
    for (gidx, (gi, go)) in groups.iter().enumerate() {
        let mono = gi.iter().fold(Mono::constant(1), |acc, &k| acc.mul(&in_m[k]));
        let (mono, unit) = split_unit(&mono);
        if !unit.is_empty() {
            anchored.push((gidx, unit, true));
        }
        if go.len() == 1 {
            out[go[0]] = mono;
            continue;
        }
        let Mono::Known { pows, .. } = &mono else {
            if gi.iter().any(|&k| in_m[k].is_tracked()) {
                return Err("a changing dim is split in a way that cannot be followed".into());
            }
            continue;
        };
        if pows.is_empty() {
            continue;
        }
        let group: Vec<i64> = go.iter().map(|&o| out_old[o]).collect();
        let mut rest = group.clone();
        let mut assigned = vec![false; go.len()];
        for (&s, &e) in pows {
            let old = syms[s].0.pow(e);
            let pick = (0..group.len())
                .find(|&k| !assigned[k] && rest[k] == old)
                .or_else(|| (0..group.len()).find(|&k| rest[k] % old == 0))
                .ok_or_else(|| format!("cannot tell which of {group:?} carries a changed dim of size {old}"))?;
            assigned[pick] = true;
            rest[pick] /= old;
            let cur = std::mem::replace(&mut out[go[pick]], Mono::Opaque);
            let Mono::Known { pows: mut p, .. } = cur else { unreachable!("fresh constants") };
            *p.entry(s).or_insert(0) += e;
            out[go[pick]] = Mono::Known { coef: rest[pick], pows: p };
        }
    }
    // Place size-1 factors on size-1 output dims before their anchor group.
    let mut used = vec![false; out_old.len()];
    for (anchor, unit, either_side) in anchored {
        let lo = if anchor == 0 { 0 } else { groups[anchor - 1].1.last().map_or(0, |&l| l + 1) };
        let hi = groups.get(anchor).and_then(|(_, go)| go.first().copied()).unwrap_or(out_old.len());
        let free = |k: &usize| out_old[*k] == 1 && !used[*k] && !out[*k].is_tracked();
        let mut slot = (lo..hi).find(free);
        if slot.is_none() && either_side {
            let lo = groups[anchor].1.last().map_or(hi, |&l| l + 1);
            let hi = groups.get(anchor + 1).and_then(|(_, go)| go.first().copied()).unwrap_or(out_old.len());
            slot = (lo..hi).find(free);
        }
        let factor = unit.iter().fold(Mono::constant(1), |acc, &(s, e)| {
            let mut m = acc;
            for _ in 0..e {
                m = m.mul(&Mono::sym(s));
            }
            m
        });
        match slot {
            Some(k) => {
                used[k] = true;
                out[k] = factor;
            }
            None => {
                // Merged into a neighbouring group: the one it preceded, unless that is the
                // innermost output axis (features: a `[S,1,E] → [S·1,E]` before a Gemm) and a
                // group precedes it (then `S·B`, as reshapes of sequence-first layouts mean).
                let innermost = (0..out_old.len()).rev().find(|&k| out_old[k] != 1);
                let after = groups.get(anchor).and_then(|(_, go)| go.first().copied());
                let before = anchor.checked_sub(1).and_then(|a| groups[a].1.last().copied());
                let target = match (after, before) {
                    (Some(a), Some(b)) if Some(a) == innermost => Some(b),
                    (Some(a), _) => Some(a),
                    (None, _) => innermost,
                };
                match target {
                    Some(t) => out[t] = out[t].mul(&factor),
                    None => return Err("a changed dim of size 1 has no place in the output".into()),
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reshape_factoring_follows_a_size_one_batch() {
        let syms = [(1, 8), (128, 1024)];
        let b = Mono::sym(0);
        let s = Mono::sym(1);
        let x = vec![b.clone(), s.clone(), Mono::constant(768)];
        let out = factor_reshape(&[1, 128, 768], &x, &[1, 128, 12, 64], &syms).unwrap();
        assert_eq!(out, vec![b.clone(), s.clone(), Mono::constant(12), Mono::constant(64)]);
        // Merging batch and sequence, then splitting them again.
        let merged = factor_reshape(&[1, 128, 768], &x, &[128, 768], &syms).unwrap();
        assert_eq!(merged[0], b.mul(&s));
        let split = factor_reshape(&[128, 768], &merged, &[1, 128, 768], &syms).unwrap();
        assert_eq!(split, x);
        // Sequence-first: `[S,1,E] → [S·1,E]` merges the batch into the sequence, not the
        // features; `[S,1,H·D] → [S,1·H,D]` into the heads.
        let seq_first = vec![s.clone(), b.clone(), Mono::constant(768)];
        let rows = factor_reshape(&[128, 1, 768], &seq_first, &[128, 768], &syms).unwrap();
        assert_eq!(rows, vec![s.mul(&b), Mono::constant(768)]);
        let heads = factor_reshape(&[128, 1, 768], &seq_first, &[128, 12, 64], &syms).unwrap();
        assert_eq!(heads, vec![s.clone(), b.mul(&Mono::constant(12)), Mono::constant(64)]);
        // … and splitting the rows again puts the batch back after the sequence.
        let back = factor_reshape(&[128, 768], &rows, &[128, 1, 768], &syms).unwrap();
        assert_eq!(back, seq_first);
    }
}
