//! `rebatch`: changes the batch size (and, with `--input-shape`, other input dims such as
//! sequence length or resolution) of a model whose export baked them into constants.
//!
//! Exporters write shape operands as literals: a GPT-2 export reshapes to `{1,128,2304}`.
//! Changing an input's dims therefore means finding every constant that carries a changed dim
//! and rewriting it. This pass does that by tracking, for every axis of every value, its size
//! as a *monomial* `coef × Π tᵢ^eᵢ` over the changed input dims `tᵢ` (old value → new value):
//!
//! - forward through the graph, each op's rule gives its outputs' monomials from its inputs'
//!   (reshapes are factored by aligning old sizes; a size-1 batch is matched by position);
//! - where an op combines a tracked axis with a constant axis of the same old size (a causal
//!   mask `[1,1,128,128]` added to scores `[b,h,s,s]`), the constant side must follow: the
//!   requirement travels back through elementwise producers to a literal, which is rewritten
//!   (shape operands, slice bounds) or regenerated (growing: constants that are uniform,
//!   arithmetic progressions such as position ids, or triangular masks along the axis;
//!   shrinking: the prefix of position-indexed data; external data only changes shape);
//! - shape operands (Reshape, Expand, ConstantOfShape, Tile, Range, Slice) get the new values
//!   of the tracked axes they produce;
//! - shapes are inferred afresh and checked against the monomials.
//!
//! Anything that cannot be rewritten with certainty is an error naming the node. Inputs whose
//! changed dims are symbolic (`batch`) need no tracking: they are substituted and inferred.

use std::collections::{BTreeMap, HashMap};

use ir::eval::Array;
use ir::infer::{Mode, infer_shapes};
use ir::{Dim, Graph, NodeId, Op, OpClass, Tensor, TensorData, TensorType, Type, Value};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

const NAME: &str = "rebatch";

/// What to change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RebatchSpec {
    /// New batch size: dim 0 of every graph input (without a default) of rank ≥ 1.
    pub batch: Option<i64>,
    /// Full new shapes of named inputs (take precedence over `batch`).
    pub input_shapes: Vec<(String, Vec<i64>)>,
}

impl RebatchSpec {
    /// True when nothing is asked.
    pub fn is_empty(&self) -> bool {
        self.batch.is_none() && self.input_shapes.is_empty()
    }
}

/// Parses `NAME=D0xD1x…` (as `--input-shape` takes it).
pub fn parse_input_shape(s: &str) -> Result<(String, Vec<i64>), String> {
    let (name, dims) =
        s.rsplit_once('=').ok_or_else(|| format!("`{s}`: expected NAME=D0xD1x…, e.g. input_ids=8x1024"))?;
    if name.is_empty() {
        return Err(format!("`{s}`: the input name is empty"));
    }
    let dims: Result<Vec<i64>, _> = dims.split(['x', 'X', ',']).map(|d| d.trim().parse::<i64>()).collect();
    match dims {
        Ok(d) if d.iter().all(|&x| x > 0) => Ok((name.to_string(), d)),
        _ => Err(format!("`{s}`: dims must be positive integers separated by `x`, e.g. {name}=8x1024")),
    }
}

/// The pass.
pub struct Rebatch {
    /// What to change.
    pub spec: RebatchSpec,
}

impl Pass for Rebatch {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        if self.spec.is_empty() {
            return Ok(Changed::No);
        }
        let report = rebatch(g, &self.spec)?;
        cx.stats.add("shape literals rewritten", report.literals_rewritten as u64);
        cx.stats.add("constants regenerated", report.constants_regenerated as u64);
        cx.warnings.extend(report.notes);
        Ok(Changed::Yes)
    }
}

/// What a rebatch did.
#[derive(Clone, Debug, Default)]
pub struct RebatchReport {
    /// Shape operands changed.
    pub literals_rewritten: usize,
    /// Constant tensors regenerated along a changed axis.
    pub constants_regenerated: usize,
    /// Things worth telling the user.
    pub notes: Vec<Located>,
}

// ---------------------------------------------------------------- monomials

/// An axis size as `coef × Π sym^exp`, or untracked-and-changing (`Opaque`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Mono {
    Known { coef: i64, pows: BTreeMap<usize, u32> },
    Opaque,
}

impl Mono {
    fn constant(v: i64) -> Mono {
        Mono::Known { coef: v, pows: BTreeMap::new() }
    }

    fn sym(s: usize) -> Mono {
        Mono::Known { coef: 1, pows: BTreeMap::from([(s, 1)]) }
    }

    fn is_tracked(&self) -> bool {
        match self {
            Mono::Known { pows, .. } => !pows.is_empty(),
            Mono::Opaque => true,
        }
    }

    fn mul(&self, o: &Mono) -> Mono {
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

    fn eval(&self, syms: &[(i64, i64)], new: bool) -> Option<i64> {
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

struct Cx<'a> {
    syms: &'a [(i64, i64)],
    old: HashMap<Value, Vec<i64>>,
    monos: HashMap<Value, Vec<Mono>>,
    reqs: Vec<(Value, usize, Mono)>,
    errors: Vec<Located>,
}

fn err(g: &Graph, n: NodeId, msg: String) -> Located {
    Located::at(g, n, format!("cannot rebatch {}: {msg}", g.describe(n)))
}

fn consts_i64(consts: &HashMap<Value, Array>, v: Option<Value>) -> Option<Vec<i64>> {
    consts.get(&v?).and_then(|a| a.to_i64().ok())
}

impl Cx<'_> {
    fn old_dims(&self, v: Value) -> Option<&Vec<i64>> {
        self.old.get(&v)
    }

    fn input_monos(&self, g: &Graph, v: Value) -> Option<Vec<Mono>> {
        if let Some(m) = self.monos.get(&v) {
            return Some(m.clone());
        }
        let _ = g;
        self.old_dims(v).map(|d| d.iter().map(|&x| Mono::constant(x)).collect())
    }

    /// Unifies aligned axes of `inputs` (right-aligned, numpy broadcasting) into `out_old`.
    fn broadcast(&mut self, g: &Graph, n: NodeId, inputs: &[Value], out_old: &[i64]) -> Vec<Mono> {
        let r = out_old.len();
        let mut out = Vec::with_capacity(r);
        for (i, &ov) in out_old.iter().enumerate() {
            let mut tracked: Option<Mono> = None;
            let mut constants: Vec<(Value, usize)> = Vec::new();
            for &v in inputs {
                let (Some(dims), Some(monos)) = (self.old_dims(v).cloned(), self.input_monos(g, v)) else { continue };
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
                                self.errors.push(err(
                                    g,
                                    n,
                                    format!("axis {i} combines two different changed dims ({t:?} and {m:?})"),
                                ));
                            }
                        }
                    }
                } else {
                    constants.push((v, a));
                }
            }
            match tracked {
                Some(t) => {
                    if ov != 1 {
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

    /// Unifies two specific axes that must be equal (a matmul's contraction axis).
    fn unify(&mut self, g: &Graph, n: NodeId, a: (Value, usize), b: (Value, usize)) {
        let (Some(ma), Some(mb)) = (self.input_monos(g, a.0), self.input_monos(g, b.0)) else { return };
        let (x, y) = (&ma[a.1], &mb[b.1]);
        match (x.is_tracked(), y.is_tracked()) {
            (true, false) => self.reqs.push((b.0, b.1, x.clone())),
            (false, true) => self.reqs.push((a.0, a.1, y.clone())),
            (true, true) if x != y => {
                self.errors.push(err(g, n, "the contracted axes follow different changed dims".into()))
            }
            _ => {}
        }
    }
}

/// Factors a reshape: monomials of the output dims from the input's, aligning old sizes.
///
/// Dims of old size 1 are set aside; the rest are grouped so that products agree. Changed
/// dims of old size > 1 are split among their group's output dims (preferring a dim of equal
/// old size); changed dims of old size 1 (a batch of 1) go to a size-1 output dim just before
/// the group they preceded, or multiply that group's first dim when there is none.
fn factor_reshape(in_old: &[i64], in_m: &[Mono], out_old: &[i64], syms: &[(i64, i64)]) -> Result<Vec<Mono>, String> {
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
    let mut anchored: Vec<(usize, Vec<(usize, u32)>)> = Vec::new();
    for (k, &d) in in_old.iter().enumerate() {
        if d == 1 && in_m[k].is_tracked() {
            let anchor = groups.iter().position(|(gi, _)| gi.first().is_some_and(|&f| f > k)).unwrap_or(groups.len());
            let (rest, unit) = split_unit(&in_m[k]);
            if rest.is_tracked() {
                return Err("a size-1 axis carries a changed dim that is not of size 1".into());
            }
            anchored.push((anchor, unit));
        }
    }
    for (gidx, (gi, go)) in groups.iter().enumerate() {
        let mono = gi.iter().fold(Mono::constant(1), |acc, &k| acc.mul(&in_m[k]));
        let (mono, unit) = split_unit(&mono);
        if !unit.is_empty() {
            anchored.push((gidx, unit));
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
    for (anchor, unit) in anchored {
        let lo = if anchor == 0 { 0 } else { groups[anchor - 1].1.last().map_or(0, |&l| l + 1) };
        let hi = groups.get(anchor).and_then(|(_, go)| go.first().copied()).unwrap_or(out_old.len());
        let slot = (lo..hi).find(|&k| out_old[k] == 1 && !used[k] && !out[k].is_tracked());
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
                let target = groups
                    .get(anchor)
                    .and_then(|(_, go)| go.first().copied())
                    .or_else(|| (0..out_old.len()).rev().find(|&k| out_old[k] != 1));
                match target {
                    Some(t) => out[t] = out[t].mul(&factor),
                    None => return Err("a changed dim of size 1 has no place in the output".into()),
                }
            }
        }
    }
    Ok(out)
}

/// The value of element `k` of a 1-D shape-like value, when a literal supplies it:
/// `(initializer value, index)`. Follows Concat/Cast/Identity/Unsqueeze/Squeeze/Reshape of
/// 1-element pieces. `None`: the element is computed (from `Shape`), nothing to rewrite.
fn literal_source(g: &Graph, v: Value, k: usize, old: &HashMap<Value, Vec<i64>>) -> Option<(Value, usize)> {
    match &g.node(v.node).op {
        Op::Initializer(_) | Op::Input { default: Some(_) } => Some((v, k)),
        Op::Constant(_) => Some((v, k)),
        Op::Identity(_) | Op::Cast(_) | Op::Unsqueeze(_) | Op::Squeeze(_) | Op::Reshape(_) => {
            literal_source(g, g.node(v.node).input(0)?, k, old)
        }
        Op::Concat(_) => {
            let mut off = 0usize;
            for inp in g.node(v.node).inputs().iter().flatten() {
                let len = old.get(inp).map_or(1, |d| d.iter().product::<i64>().max(0) as usize);
                if k < off + len {
                    return literal_source(g, *inp, k - off, old);
                }
                off += len;
            }
            None
        }
        _ => None,
    }
}

fn tensor_of(g: &Graph, v: Value) -> Option<Tensor> {
    match &g.node(v.node).op {
        Op::Initializer(t) | Op::Input { default: Some(t) } => Some(t.clone()),
        Op::Constant(c) => {
            ir::eval::eval_op(&Op::Constant(c.clone()), &[], 1, g.opset).ok().map(|mut a| a.remove(0).to_tensor())
        }
        _ => None,
    }
}

/// The current value of `v` when it is computed from constants only (evaluated now).
fn const_value(g: &Graph, v: Value, depth: usize) -> Option<Array> {
    if depth > 32 {
        return None;
    }
    if let Some(t) = tensor_of(g, v) {
        return Array::from_tensor(&t).ok();
    }
    let node = g.node(v.node);
    if matches!(node.op, Op::Input { .. } | Op::OuterRef | Op::Shape(_) | Op::Size(_))
        || ir::infer::has_subgraph(&node.op)
    {
        return None;
    }
    let ins: Vec<Option<Array>> = node
        .inputs()
        .iter()
        .map(|i| i.map(|x| const_value(g, x, depth + 1)))
        .collect::<Option<Vec<_>>>()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let mut arrays = Vec::with_capacity(node.inputs().len());
    for (i, inp) in node.inputs().iter().enumerate() {
        match inp {
            Some(x) => arrays.push(Some(match ins.get(i).cloned().flatten() {
                Some(a) => a,
                None => const_value(g, *x, depth + 1)?,
            })),
            None => arrays.push(None),
        }
    }
    let refs: Vec<Option<&Array>> = arrays.iter().map(Option::as_ref).collect();
    ir::eval::fold_node(g, v.node, &refs)
        .and_then(|mut o| (usize::from(v.slot) < o.len()).then(|| o.swap_remove(v.slot as usize)))
}

/// Writes `updates` (flat index → value) into the literal feeding input `slot` of `user`,
/// through a private copy so other users keep the old value. Returns how many literals
/// changed.
fn rewrite_operand(
    g: &mut Graph,
    user: NodeId,
    slot: usize,
    updates: &[(usize, i64)],
    old: &HashMap<Value, Vec<i64>>,
) -> Result<usize, String> {
    let Some(current) = g.node(user).input(slot) else { return Ok(0) };
    // Group the updates by the literal that supplies each element.
    let mut by_lit: BTreeMap<Value, Vec<(usize, i64)>> = BTreeMap::new();
    let mut computed: Vec<(usize, i64)> = Vec::new();
    for &(k, new) in updates {
        match literal_source(g, current, k, old) {
            Some((lit, idx)) => by_lit.entry(lit).or_default().push((idx, new)),
            None => computed.push((k, new)),
        }
    }
    let mut count = 0;
    if !computed.is_empty() {
        // Not a plain literal: if the whole operand is computed from constants, replace it by
        // a literal of its new value; otherwise it is computed from shapes and follows by
        // itself.
        if let Some(a) = const_value(g, current, 0) {
            let mut vals = a.to_i64().map_err(|e| e.to_string())?;
            let mut changed = false;
            for (k, new) in computed {
                if k < vals.len() && vals[k] != new {
                    vals[k] = new;
                    changed = true;
                }
            }
            if changed {
                let name = g.fresh_name(&format!("{}.rebatched", g.value_name(current)));
                let copy = g.add_initializer(name, Tensor::from_i64(vec![vals.len() as i64], vals));
                g.set_input(user, slot, Some(copy));
                return Ok(1);
            }
        }
    }
    for (lit, ups) in by_lit {
        let Some(mut t) = tensor_of(g, lit) else { continue };
        let mut vals = t.to_i64_vec().ok_or("the shape literal is not an integer tensor")?;
        let mut changed = false;
        for (idx, new) in ups {
            if idx >= vals.len() {
                return Err("the shape literal is shorter than the shape it describes".into());
            }
            if vals[idx] != new {
                vals[idx] = new;
                changed = true;
            }
        }
        if !changed {
            continue;
        }
        t.data = match t.dtype {
            ir::DType::Int64 => TensorData::Int64(vals),
            _ => TensorData::Int32(vals.iter().map(|&x| x as i32).collect()),
        };
        t.name = None;
        let name = g.fresh_name(&format!("{}.rebatched", g.value_name(lit)));
        let copy = g.add_initializer(name, t);
        let operand = g.node(user).input(slot).expect("present");
        let new_operand = clone_chain(g, operand, lit, copy);
        g.set_input(user, slot, Some(new_operand));
        count += 1;
    }
    Ok(count)
}

/// Copies the nodes on the path from `top` down to `lit`, with `lit` replaced by `copy`.
fn clone_chain(g: &mut Graph, top: Value, lit: Value, copy: Value) -> Value {
    if top == lit {
        return copy;
    }
    let node = g.node(top.node).clone();
    let inputs: Vec<Option<Value>> = node
        .inputs()
        .iter()
        .map(|i| i.map(|v| if reaches(g, v, lit) { clone_chain(g, v, lit, copy) } else { v }))
        .collect();
    let outs: Vec<ir::Output> = node
        .outputs()
        .iter()
        .map(|o| ir::Output {
            name: if o.name.is_empty() { String::new() } else { g.fresh_name(&format!("{}.rebatched", o.name)) },
            ty: None,
        })
        .collect();
    let id = g.add_node(node.op.clone(), inputs, outs);
    Value::new(id, top.slot)
}

fn reaches(g: &Graph, from: Value, target: Value) -> bool {
    if from == target {
        return true;
    }
    g.node(from.node).inputs().iter().flatten().any(|&v| reaches(g, v, target))
}

/// Regenerates constant `t` so that axis `axis` grows from `old` to `new` elements, when the
/// data follows a pattern along that axis.
fn regenerate(t: &Tensor, axis: usize, new: i64) -> Result<Tensor, String> {
    let mut out = t.clone();
    out.dims[axis] = new;
    if let TensorData::External(entries) = &t.data {
        let bytes = out.numel() * t.dtype.size_bytes();
        out.data = TensorData::External(
            entries
                .iter()
                .map(|(k, v)| if k == "length" { (k.clone(), bytes.to_string()) } else { (k.clone(), v.clone()) })
                .collect(),
        );
        return Ok(out);
    }
    let a = Array::from_tensor(t).map_err(|e| e.to_string())?;
    let v = a.to_f64().map_err(|e| e.to_string())?;
    let dims: Vec<usize> = a.shape.clone();
    let n_old = dims[axis];
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let at = |o: usize, j: usize, i: usize| v[(o * n_old + j) * inner + i];
    let new_n = new as usize;
    let mut res = vec![0.0; outer * new_n * inner];
    if new_n <= n_old {
        // Shrinking keeps the prefix: position-indexed data (embeddings, masks) of the
        // first `new` positions.
        let sliced = ir::eval::slice_axis(&a, axis, 0, new_n);
        return Ok(sliced.to_tensor());
    }
    let uniform = (0..outer).all(|o| (0..n_old).all(|j| (0..inner).all(|i| at(o, j, i) == at(o, 0, i))));
    let arithmetic = n_old >= 2 && {
        let d = |o, i| at(o, 1, i) - at(o, 0, i);
        (0..outer).all(|o| (1..n_old).all(|j| (0..inner).all(|i| at(o, j, i) - at(o, j - 1, i) == d(o, i))))
    };
    if uniform {
        for o in 0..outer {
            for j in 0..new_n {
                for i in 0..inner {
                    res[(o * new_n + j) * inner + i] = at(o, 0, i);
                }
            }
        }
    } else if arithmetic {
        for o in 0..outer {
            for j in 0..new_n {
                for i in 0..inner {
                    let d = at(o, 1, i) - at(o, 0, i);
                    res[(o * new_n + j) * inner + i] = at(o, 0, i) + d * j as f64;
                }
            }
        }
    } else {
        return Err(format!(
            "its values along axis {axis} follow no pattern that can be extended (uniform or arithmetic)"
        ));
    }
    let arr = match a.data {
        ir::eval::Data::F32(_) | ir::eval::Data::F64(_) => Array::float(a.dtype, vec![], vec![]),
        _ => Array::int(a.dtype, vec![], vec![]),
    };
    let mut shape = dims.clone();
    shape[axis] = new_n;
    let arr = match arr.data {
        ir::eval::Data::F32(_) | ir::eval::Data::F64(_) => Array::float(a.dtype, shape, res),
        _ if a.dtype == ir::DType::Bool => Array::bool(shape, res.iter().map(|&x| x != 0.0).collect()),
        _ => Array::int(a.dtype, shape, res.iter().map(|&x| x as i64).collect()),
    };
    Ok(arr.to_tensor())
}

/// Regenerates a square mask over two axes that both grow (causal masks): values must depend
/// only on the sign of `col - row`.
fn regenerate_square(t: &Tensor, ax: (usize, usize), new: i64) -> Result<Tensor, String> {
    let mut out = t.clone();
    out.dims[ax.0] = new;
    out.dims[ax.1] = new;
    if let TensorData::External(entries) = &t.data {
        let bytes = out.numel() * t.dtype.size_bytes();
        out.data = TensorData::External(
            entries
                .iter()
                .map(|(k, v)| if k == "length" { (k.clone(), bytes.to_string()) } else { (k.clone(), v.clone()) })
                .collect(),
        );
        return Ok(out);
    }
    if ax.1 != ax.0 + 1 || ax.1 != t.dims.len() - 1 {
        return Err("a mask over two changed axes must have them last".into());
    }
    let a = Array::from_tensor(t).map_err(|e| e.to_string())?;
    if (new as usize) <= a.shape[ax.0] {
        let sliced = ir::eval::slice_axis(&ir::eval::slice_axis(&a, ax.0, 0, new as usize), ax.1, 0, new as usize);
        return Ok(sliced.to_tensor());
    }
    let v = a.to_f64().map_err(|e| e.to_string())?;
    let n = a.shape[ax.0];
    let outer: usize = a.shape[..ax.0].iter().product();
    let mut by_sign: [Option<f64>; 3] = [None; 3];
    for o in 0..outer {
        for i in 0..n {
            for j in 0..n {
                let s = (j as i64 - i as i64).signum() + 1;
                let x = v[(o * n + i) * n + j];
                match by_sign[s as usize] {
                    None => by_sign[s as usize] = Some(x),
                    Some(y) if y == x => {}
                    _ => return Err("its values depend on more than the position relative to the diagonal".into()),
                }
            }
        }
    }
    let nn = new as usize;
    let mut res = Vec::with_capacity(outer * nn * nn);
    for _ in 0..outer {
        for i in 0..nn {
            for j in 0..nn {
                res.push(by_sign[((j as i64 - i as i64).signum() + 1) as usize].unwrap_or(0.0));
            }
        }
    }
    let mut shape = a.shape.clone();
    shape[ax.0] = nn;
    shape[ax.1] = nn;
    Ok(match a.data {
        ir::eval::Data::F32(_) | ir::eval::Data::F64(_) => Array::float(a.dtype, shape, res),
        ir::eval::Data::Bool(_) => Array::bool(shape, res.iter().map(|&x| x != 0.0).collect()),
        _ => Array::int(a.dtype, shape, res.iter().map(|&x| x as i64).collect()),
    }
    .to_tensor())
}

/// True when `v` reaches an initial-state input of a recurrent op through data movement only.
fn feeds_recurrent_state(g: &Graph, v: Value) -> bool {
    let mut stack = vec![v];
    let mut seen = std::collections::HashSet::new();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        for (user, slot) in g.users(x) {
            match &g.node(user).op {
                Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) if slot >= 5 => return true,
                Op::Slice(_) | Op::Squeeze(_) | Op::Unsqueeze(_) | Op::Identity(_) | Op::Cast(_) | Op::Gather(_)
                    if slot == 0 =>
                {
                    stack.extend((0..g.node(user).num_outputs()).map(|s| Value::new(user, s as u16)));
                }
                _ => {}
            }
        }
    }
    false
}

/// Changes input dims and rewrites what depends on them; see the module docs.
pub fn rebatch(g: &mut Graph, spec: &RebatchSpec) -> Result<RebatchReport, PassError> {
    let fail = |errors: Vec<Located>| PassError { pass: NAME.into(), errors };
    let mut report = RebatchReport::default();
    infer_shapes(g, Mode::Check)
        .map_err(|e| fail(e.into_iter().map(|e| Located { node: e.node, span: e.span, msg: e.msg }).collect()))?;

    // The inputs to change.
    let real_inputs: Vec<Value> =
        g.input_values().into_iter().filter(|v| matches!(g.node(v.node).op, Op::Input { default: None })).collect();
    let names: Vec<String> = real_inputs.iter().map(|&v| g.value_name(v).to_string()).collect();
    let mut new_dims: Vec<(Value, Vec<Dim>, Vec<Dim>)> = Vec::new(); // (input, old dims, new dims)
    for (name, dims) in &spec.input_shapes {
        let Some(&v) = real_inputs.iter().find(|&&v| g.value_name(v) == name) else {
            return Err(fail(vec![Located::global(format!(
                "there is no graph input `{name}`; inputs are: {}",
                names.join(", ")
            ))]));
        };
        let old = g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default();
        if old.len() != dims.len() {
            return Err(fail(vec![Located::at(
                g,
                v.node,
                format!("input `{name}` has rank {}, but the new shape {dims:?} has rank {}", old.len(), dims.len()),
            )]));
        }
        new_dims.push((v, old, dims.iter().map(|&d| Dim::Fixed(d)).collect()));
    }
    if let Some(b) = spec.batch {
        if b <= 0 {
            return Err(fail(vec![Located::global(format!("the batch size must be positive, got {b}"))]));
        }
        // The batch is dim 0 of the first input and of the inputs that share its size there;
        // recurrent state inputs (batch on axis 1) and inputs the analysis reaches later are
        // found by following the graph.
        let first = real_inputs
            .iter()
            .find_map(|&v| g.tensor_type(v).and_then(|t| t.dims.as_ref()).and_then(|d| d.first().cloned()));
        for &v in &real_inputs {
            if new_dims.iter().any(|(x, _, _)| *x == v) || feeds_recurrent_state(g, v) {
                continue;
            }
            let old = g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default();
            if old.is_empty() || Some(&old[0]) != first.as_ref() {
                continue;
            }
            let mut nd = old.clone();
            nd[0] = Dim::Fixed(b);
            new_dims.push((v, old, nd));
        }
    }

    // Symbols: changed fixed dims, keyed by (old, new); symbolic dims are substituted.
    let mut syms: Vec<(i64, i64)> = Vec::new();
    let mut input_monos: HashMap<Value, Vec<Mono>> = HashMap::new();
    for (v, old, new) in &new_dims {
        let mut monos = Vec::new();
        for (o, n) in old.iter().zip(new) {
            let Some(nv) = n.value() else {
                monos.push(Mono::Opaque);
                continue;
            };
            match o.value() {
                Some(ov) if ov != nv => {
                    let s = syms.iter().position(|&p| p == (ov, nv)).unwrap_or_else(|| {
                        syms.push((ov, nv));
                        syms.len() - 1
                    });
                    monos.push(Mono::sym(s));
                }
                Some(ov) => monos.push(Mono::constant(ov)),
                None => monos.push(Mono::Opaque),
            }
        }
        input_monos.insert(*v, monos);
    }

    // Old shapes and folded constants, from the model as it was.
    let consts = infer_shapes(g, Mode::Check)
        .map_err(|e| fail(e.into_iter().map(|e| Located { node: e.node, span: e.span, msg: e.msg }).collect()))?
        .consts;
    let mut old: HashMap<Value, Vec<i64>> = HashMap::new();
    for n in g.node_ids() {
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            if let Some(d) = g.tensor_type(v).and_then(TensorType::static_dims) {
                old.insert(v, d);
            }
        }
    }
    // Axes made to follow a changed dim by rewriting (regenerated constants, grown slices,
    // graph inputs found to carry the batch).
    let mut overrides: HashMap<Value, Vec<(usize, Mono)>> = HashMap::new();
    for _round in 0..8 {
        let mut cx =
            Cx { syms: &syms, old: old.clone(), monos: input_monos.clone(), reqs: Vec::new(), errors: Vec::new() };
        let order = g.topo_order().map_err(|_| fail(vec![Located::global("the graph has a cycle")]))?;
        for &n in &order {
            propagate(g, n, &mut cx, &consts);
            for s in 0..g.node(n).num_outputs() {
                let v = Value::new(n, s as u16);
                if let Some(ov) = overrides.get(&v) {
                    let rank = cx.old_dims(v).map_or(0, Vec::len);
                    let mut m = cx.monos.get(&v).cloned().unwrap_or_else(|| {
                        cx.old_dims(v).map(|d| d.iter().map(|&x| Mono::constant(x)).collect()).unwrap_or_default()
                    });
                    m.resize(rank, Mono::Opaque);
                    for (a, mono) in ov {
                        if *a < m.len() {
                            m[*a] = mono.clone();
                        }
                    }
                    cx.monos.insert(v, m);
                }
            }
        }
        if !cx.errors.is_empty() {
            return Err(fail(cx.errors));
        }
        // Requirements already met by an override are not new.
        cx.reqs.retain(|(v, a, _)| !overrides.get(v).is_some_and(|o| o.iter().any(|(x, _)| x == a)));
        if cx.reqs.is_empty() {
            // Rewrite shape operands, then re-infer with the new inputs.
            let monos = cx.monos;
            report.literals_rewritten += rewrite_literals(g, &order, &monos, &old, &syms, &consts).map_err(fail)?;
            for (v, _, new) in &new_dims {
                let dtype = g.tensor_type(*v).map_or(ir::DType::Float, |t| t.dtype);
                g.set_type(*v, Some(Type::Tensor(TensorType::new(dtype, new.clone()))));
            }
            let inferred = infer_shapes(g, Mode::Reset).map_err(|e| {
                fail(
                    e.into_iter()
                        .map(|e| Located {
                            node: e.node,
                            span: e.span,
                            msg: format!("after changing the inputs: {}", e.msg),
                        })
                        .collect(),
                )
            })?;
            report.notes.extend(inferred.warnings.into_iter().map(|w| Located {
                node: w.node,
                span: w.span,
                msg: w.msg,
            }));
            // Check: every tracked axis has the size its monomial predicts.
            let mut errors = Vec::new();
            for (v, ms) in &monos {
                if !g.contains(v.node) {
                    continue;
                }
                let Some(dims) = g.tensor_type(*v).and_then(|t| t.dims.clone()) else { continue };
                for (a, m) in ms.iter().enumerate() {
                    if let (Some(want), Some(got)) = (m.eval(&syms, true), dims.get(a).and_then(Dim::value))
                        && want != got
                    {
                        errors.push(Located::at(
                            g,
                            v.node,
                            format!("after rebatching, `{}` has size {got} on axis {a} where {want} was expected; a constant in its computation still carries the old size", g.value_name(*v)),
                        ));
                        break;
                    }
                }
            }
            if !errors.is_empty() {
                errors.truncate(5);
                return Err(fail(errors));
            }
            return Ok(report);
        }
        // Resolve requirements: make constant axes follow a changed dim.
        let reqs = std::mem::take(&mut cx.reqs);
        let mut by_value: BTreeMap<Value, Vec<(usize, Mono)>> = BTreeMap::new();
        for (v, a, m) in reqs {
            let e = by_value.entry(v).or_default();
            if !e.iter().any(|(x, _)| *x == a) {
                e.push((a, m));
            }
        }
        for (v, axes) in by_value {
            resolve(g, v, &axes, &syms, &old, &consts, &mut report, &mut overrides).map_err(|e| fail(vec![e]))?;
        }
        // Graph inputs reached: they change too.
        for (v, axes) in &overrides {
            if !matches!(g.node(v.node).op, Op::Input { default: None }) {
                continue;
            }
            let old_d = g.tensor_type(*v).and_then(|t| t.dims.clone()).unwrap_or_default();
            let entry = match new_dims.iter().position(|(x, _, _)| x == v) {
                Some(i) => i,
                None => {
                    new_dims.push((*v, old_d.clone(), old_d.clone()));
                    new_dims.len() - 1
                }
            };
            let monos = input_monos
                .entry(*v)
                .or_insert_with(|| old_d.iter().map(|d| d.value().map_or(Mono::Opaque, Mono::constant)).collect());
            for (a, m) in axes {
                if let Some(nv) = m.eval(&syms, true)
                    && *a < monos.len()
                {
                    monos[*a] = m.clone();
                    new_dims[entry].2[*a] = Dim::Fixed(nv);
                }
            }
        }
    }
    Err(fail(vec![Located::global("rebatching did not settle after 8 rounds of rewriting constants")]))
}

#[allow(clippy::too_many_arguments)]
/// Makes the given axes of value `v` (a constant, or computed from constants) follow changed
/// dims.
fn resolve(
    g: &mut Graph,
    v: Value,
    axes: &[(usize, Mono)],
    syms: &[(i64, i64)],
    old: &HashMap<Value, Vec<i64>>,
    consts: &HashMap<Value, Array>,
    report: &mut RebatchReport,
    overrides: &mut HashMap<Value, Vec<(usize, Mono)>>,
) -> Result<(), Located> {
    let n = v.node;
    overrides.entry(v).or_default().extend(axes.iter().cloned());
    if let Op::Input { default: None } = g.node(n).op {
        // Another graph input carries the changed dim: it changes with the others.
        return Ok(());
    }
    let span = g.span(n);
    let new_of = |m: &Mono| {
        m.eval(syms, true).ok_or_else(|| Located { node: Some(n), span, msg: "cannot compute a new size".into() })
    };
    let op = g.node(n).op.clone();
    match &op {
        Op::Initializer(_) | Op::Constant(_) => {
            let mut t = tensor_of(g, v).ok_or_else(|| Located::at(g, n, "not a constant"))?;

            let describe = format!("constant `{}`", g.value_name(v));
            if axes.len() == 2 && axes[0].1 == axes[1].1 {
                t = regenerate_square(&t, (axes[0].0.min(axes[1].0), axes[0].0.max(axes[1].0)), new_of(&axes[0].1)?)
                    .map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))?;
            } else {
                for (a, m) in axes {
                    t = regenerate(&t, *a, new_of(m)?)
                        .map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))?;
                }
            }
            if t.is_external() {
                report.notes.push(Located::at(
                    g,
                    n,
                    format!("{describe} has external data; only its shape was changed"),
                ));
            }
            t.name = None;
            // A private copy for the users that need the new size (all of them here).
            g.set_inputs(n, vec![]);
            let ty = Type::Tensor(t.tensor_type());
            g.set_op(n, Op::Initializer(t));
            g.set_label(n, None);
            g.set_type(v, Some(ty));
            report.constants_regenerated += 1;
            Ok(())
        }
        _ if matches!(op.class(), OpClass::Unary | OpClass::Binary | OpClass::Variadic)
            || matches!(op, Op::Where(_) | Op::Cast(_) | Op::Not(_)) =>
        {
            let out_rank = old.get(&v).map_or(0, Vec::len);
            let inputs: Vec<Value> = g.node(n).inputs().iter().flatten().copied().collect();
            let mut any = false;
            for inp in inputs {
                let Some(d) = old.get(&inp) else { continue };
                let mut sub = Vec::new();
                for (a, m) in axes {
                    if d.len() + a < out_rank {
                        continue;
                    }
                    let ia = d.len() + a - out_rank;
                    if (d[ia] != 1 || m.eval(syms, false) == Some(1)) && d[ia] == old[&v][*a] {
                        sub.push((ia, m.clone()));
                    }
                }
                if !sub.is_empty() {
                    any = true;
                    resolve(g, inp, &sub, syms, old, consts, report, overrides)?;
                }
            }
            if any {
                Ok(())
            } else {
                Err(Located::at(g, n, format!("cannot rebatch {}: no input carries the axis", g.describe(n))))
            }
        }
        Op::Unsqueeze(_)
        | Op::Squeeze(_)
        | Op::Transpose(_)
        | Op::Reshape(_)
        | Op::Expand(_)
        | Op::Slice(_)
        | Op::Gather(_)
        | Op::Range(_)
        | Op::ConstantOfShape(_) => {
            let in_dims = g.node(n).input(0).and_then(|i| old.get(&i)).cloned().unwrap_or_default();
            let out_dims = old.get(&v).cloned().unwrap_or_default();
            match &op {
                Op::Transpose(t) => {
                    let perm: Vec<usize> = t
                        .perm
                        .clone()
                        .map_or((0..out_dims.len()).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
                    let sub: Vec<(usize, Mono)> = axes.iter().map(|(a, m)| (perm[*a], m.clone())).collect();
                    resolve(g, g.node(n).input(0).expect("input"), &sub, syms, old, consts, report, overrides)
                }
                Op::Unsqueeze(_) | Op::Squeeze(_) | Op::Reshape(_) => {
                    // Map axes by dropping/adding size-1 dims in order.
                    let non1_in: Vec<usize> = (0..in_dims.len()).filter(|&i| in_dims[i] != 1).collect();
                    let non1_out: Vec<usize> = (0..out_dims.len()).filter(|&i| out_dims[i] != 1).collect();
                    if non1_in.len() != non1_out.len()
                        || non1_in.iter().zip(&non1_out).any(|(&i, &o)| in_dims[i] != out_dims[o])
                    {
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
                    resolve(g, g.node(n).input(0).expect("input"), &sub, syms, old, consts, report, overrides)
                }
                Op::Gather(gt) => {
                    let data = g.node(n).input(0).expect("data");
                    let idx = g.node(n).input(1).expect("indices");
                    let r = old.get(&data).map_or(0, Vec::len);
                    let ax = if gt.axis() < 0 { (gt.axis() + r as i64) as usize } else { gt.axis() as usize };
                    let q = old.get(&idx).map_or(0, Vec::len);
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
                        resolve(g, idx, &to_idx, syms, old, consts, report, overrides)?;
                    }
                    if !to_data.is_empty() {
                        resolve(g, data, &to_data, syms, old, consts, report, overrides)?;
                    }
                    Ok(())
                }
                Op::Slice(_) => {
                    // Grow the slice: end = start + new size (step 1, literal bounds); axes that
                    // are not sliced pass the requirement to the input.
                    let mut through = Vec::new();
                    for (a, m) in axes {
                        let starts = consts_i64(consts, g.node(n).input(1)).unwrap_or_default();
                        let ax_list = consts_i64(consts, g.node(n).input(3))
                            .unwrap_or_else(|| (0..starts.len() as i64).collect());
                        let Some(k) = ax_list
                            .iter()
                            .position(|&x| (if x < 0 { x + out_dims.len() as i64 } else { x }) as usize == *a)
                        else {
                            through.push((*a, m.clone()));
                            continue;
                        };
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
                        let count = rewrite_operand(g, n, 2, &[(k, new_end)], old).map_err(|e| Located::at(g, n, e))?;
                        report.literals_rewritten += count;
                    }
                    if !through.is_empty() {
                        resolve(g, g.node(n).input(0).expect("input"), &through, syms, old, consts, report, overrides)?;
                    }
                    Ok(())
                }
                Op::Range(_) => {
                    let start = consts_i64(consts, g.node(n).input(0)).and_then(|v| v.first().copied());
                    let delta = consts_i64(consts, g.node(n).input(2)).and_then(|v| v.first().copied());
                    let (Some(s), Some(d)) = (start, delta) else {
                        return Err(Located::at(
                            g,
                            n,
                            format!("cannot rebatch {}: its bounds are not literals", g.describe(n)),
                        ));
                    };
                    let new_limit = s + d * new_of(&axes[0].1)?;
                    report.literals_rewritten +=
                        rewrite_operand(g, n, 1, &[(0, new_limit)], old).map_err(|e| Located::at(g, n, e))?;
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
                            resolve(g, x, &sub, syms, old, consts, report, overrides)?;
                        }
                    }
                    let spec_len = g
                        .node(n)
                        .input(slot)
                        .and_then(|v| old.get(&v))
                        .and_then(|d| d.first().copied())
                        .unwrap_or(out_dims.len() as i64) as usize;
                    let ups: Vec<(usize, i64)> = axes
                        .iter()
                        .map(|(a, m)| Ok((*a + spec_len.saturating_sub(out_dims.len()), new_of(m)?)))
                        .collect::<Result<_, Located>>()?;
                    report.literals_rewritten +=
                        rewrite_operand(g, n, slot, &ups, old).map_err(|e| Located::at(g, n, e))?;
                    Ok(())
                }
                _ => unreachable!(),
            }
        }
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

/// Monomials of node `n`'s outputs.
fn propagate(g: &Graph, n: NodeId, cx: &mut Cx<'_>, consts: &HashMap<Value, Array>) {
    let node = g.node(n);
    let out0 = Value::new(n, 0);
    let Some(out_old) = cx.old_dims(out0).cloned() else {
        // Symbolic old shape: the export computed it dynamically; re-inference updates it.
        return;
    };
    let tracked_in =
        node.inputs().iter().flatten().any(|v| cx.monos.get(v).is_some_and(|m| m.iter().any(Mono::is_tracked)));
    let ins: Vec<Value> = node.inputs().iter().flatten().copied().collect();
    let input = |i: usize| node.input(i);
    let set = |cx: &mut Cx<'_>, slot: usize, m: Vec<Mono>| {
        cx.monos.insert(Value::new(n, slot as u16), m);
    };
    let in_m = |cx: &Cx<'_>, i: usize| input(i).and_then(|v| cx.input_monos(g, v));
    let in_old = |cx: &Cx<'_>, i: usize| input(i).and_then(|v| cx.old_dims(v).cloned());
    match &node.op {
        Op::Input { .. } | Op::Initializer(_) | Op::OuterRef | Op::Constant(_) => {}
        _ if matches!(node.op.class(), OpClass::Unary | OpClass::Binary | OpClass::Variadic)
            || matches!(node.op, Op::Where(_)) =>
        {
            let m = cx.broadcast(g, n, &ins, &out_old);
            for s in 0..node.num_outputs() {
                set(cx, s, m.clone());
            }
        }
        Op::Softmax(_)
        | Op::LogSoftmax(_)
        | Op::Hardmax(_)
        | Op::LRN(_)
        | Op::LpNormalization(_)
        | Op::Trilu(_)
        | Op::CumSum(_)
        | Op::MeanVarianceNormalization(_)
        | Op::InstanceNormalization(_)
        | Op::GroupNormalization(_)
        | Op::ScatterND(_)
        | Op::ScatterElements(_) => {
            if let Some(m) = in_m(cx, 0) {
                set(cx, 0, m);
            }
        }
        Op::BatchNormalization(_) | Op::LayerNormalization(_) => {
            let m = cx.broadcast(g, n, &ins[..1.min(ins.len())], &out_old);
            set(cx, 0, m.clone());
            if let Op::LayerNormalization(l) = &node.op {
                let r = m.len() as i64;
                let a = if l.axis() < 0 { l.axis() + r } else { l.axis() } as usize;
                let stat: Vec<Mono> =
                    (0..m.len()).map(|i| if i < a { m[i].clone() } else { Mono::constant(1) }).collect();
                for s in 1..node.num_outputs() {
                    set(cx, s, stat.clone());
                }
            }
        }
        Op::MatMul(_) => {
            let (Some(a), Some(b), Some(ao), Some(bo)) = (in_m(cx, 0), in_m(cx, 1), in_old(cx, 0), in_old(cx, 1))
            else {
                return;
            };
            if !ao.is_empty() && bo.len() >= 2 {
                cx.unify(g, n, (input(0).expect("A"), ao.len() - 1), (input(1).expect("B"), bo.len() - 2));
            }
            let r = out_old.len();
            let mut m = vec![Mono::Opaque; r];
            // Batch dims broadcast; M from A, N from B.
            let batch = r.saturating_sub(2);
            if ao.len() >= 2 && bo.len() >= 2 {
                let ab: Vec<Value> = vec![input(0).expect("A"), input(1).expect("B")];
                let _ = ab;
                for i in 0..batch {
                    let pick = |mm: &[Mono], oo: &[i64]| -> Option<Mono> {
                        let off = batch.checked_sub(oo.len() - 2)?;
                        (i >= off && oo[i - off] == out_old[i]).then(|| mm[i - off].clone())
                    };
                    m[i] = match (pick(&a, &ao), pick(&b, &bo)) {
                        (Some(x), _) if x.is_tracked() => x,
                        (_, Some(y)) if y.is_tracked() => y,
                        _ => Mono::constant(out_old[i]),
                    };
                }
                m[r - 2] = a[ao.len() - 2].clone();
                m[r - 1] = b[bo.len() - 1].clone();
            } else if ao.len() == 1 && r >= 1 {
                m = (0..r).map(|i| if i + 2 <= bo.len() { b[i].clone() } else { b[bo.len() - 1].clone() }).collect();
                m.truncate(r);
            } else if bo.len() == 1 && r >= 1 {
                m = a[..r].to_vec();
            }
            set(cx, 0, m);
        }
        Op::Gemm(gm) => {
            let (Some(a), Some(b)) = (in_m(cx, 0), in_m(cx, 1)) else { return };
            if a.len() != 2 || b.len() != 2 {
                return;
            }
            let (mi, ka) = if gm.trans_a() != 0 { (1, 0) } else { (0, 1) };
            let (kb, ni) = if gm.trans_b() != 0 { (1, 0) } else { (0, 1) };
            cx.unify(g, n, (input(0).expect("A"), ka), (input(1).expect("B"), kb));
            set(cx, 0, vec![a[mi].clone(), b[ni].clone()]);
        }
        Op::Conv(_)
        | Op::ConvTranspose(_)
        | Op::MaxPool(_)
        | Op::AveragePool(_)
        | Op::LpPool(_)
        | Op::GlobalAveragePool(_)
        | Op::GlobalMaxPool(_)
        | Op::GlobalLpPool(_) => {
            let Some(x) = in_m(cx, 0) else { return };
            let mut m: Vec<Mono> = out_old.iter().map(|&v| Mono::constant(v)).collect();
            m[0] = x[0].clone();
            let global = matches!(node.op, Op::GlobalAveragePool(_) | Op::GlobalMaxPool(_) | Op::GlobalLpPool(_));
            if matches!(node.op, Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_)) || global {
                m[1] = x[1].clone();
            }
            if !global {
                for (i, mi) in m.iter_mut().enumerate().skip(2) {
                    if x.get(i).is_some_and(Mono::is_tracked) {
                        *mi = Mono::Opaque;
                    }
                }
            }
            for s in 0..node.num_outputs() {
                set(cx, s, m.clone());
            }
        }
        Op::Reshape(_) => {
            let (Some(xm), Some(xo)) = (in_m(cx, 0), in_old(cx, 0)) else { return };
            if !xm.iter().any(Mono::is_tracked) {
                return;
            }
            match factor_reshape(&xo, &xm, &out_old, cx.syms) {
                Ok(m) => set(cx, 0, m),
                Err(e) => cx.errors.push(err(g, n, e)),
            }
        }
        Op::Flatten(f) => {
            let Some(xm) = in_m(cx, 0) else { return };
            let r = xm.len() as i64;
            let a = (if f.axis() < 0 { f.axis() + r } else { f.axis() }).clamp(0, r) as usize;
            let left = xm[..a].iter().fold(Mono::constant(1), |acc, m| acc.mul(m));
            let right = xm[a..].iter().fold(Mono::constant(1), |acc, m| acc.mul(m));
            set(cx, 0, vec![left, right]);
        }
        Op::Transpose(t) => {
            let Some(xm) = in_m(cx, 0) else { return };
            let perm: Vec<usize> =
                t.perm.clone().map_or((0..xm.len()).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
            set(cx, 0, perm.iter().map(|&p| xm[p].clone()).collect());
        }
        Op::Squeeze(_) | Op::Unsqueeze(_) => {
            let (Some(xm), Some(xo)) = (in_m(cx, 0), in_old(cx, 0)) else { return };
            // Keep non-1 axes in order; size-1 axes: tracked ones kept by position.
            let removed: Vec<usize>;
            if let Op::Squeeze(s) = &node.op {
                let axes = consts_i64(consts, input(1)).or_else(|| s.axes.clone());
                removed = match axes {
                    Some(ax) => ax.iter().map(|&a| (if a < 0 { a + xm.len() as i64 } else { a }) as usize).collect(),
                    None => (0..xo.len()).filter(|&i| xo[i] == 1).collect(),
                };
                for &r in &removed {
                    if xm.get(r).is_some_and(Mono::is_tracked) {
                        cx.errors.push(err(g, n, format!("it squeezes away axis {r}, which changes size")));
                        return;
                    }
                }
                set(
                    cx,
                    0,
                    xm.iter().enumerate().filter(|(i, _)| !removed.contains(i)).map(|(_, m)| m.clone()).collect(),
                );
            } else {
                let axes = consts_i64(consts, input(1))
                    .or_else(|| if let Op::Unsqueeze(u) = &node.op { u.axes.clone() } else { None });
                let Some(axes) = axes else { return };
                let r = out_old.len() as i64;
                let mut ax: Vec<usize> = axes.iter().map(|&a| (if a < 0 { a + r } else { a }) as usize).collect();
                ax.sort();
                let mut m = xm.clone();
                for a in ax {
                    m.insert(a.min(m.len()), Mono::constant(1));
                }
                set(cx, 0, m);
            }
        }
        Op::Concat(c) => {
            let r = out_old.len() as i64;
            let a = c.axis.map(|x| (if x < 0 { x + r } else { x }) as usize).unwrap_or(0);
            let mut m = cx.broadcast(g, n, &ins, &out_old);
            let parts: Vec<Mono> =
                ins.iter().filter_map(|&v| cx.input_monos(g, v).and_then(|mm| mm.get(a).cloned())).collect();
            m[a] = if parts.iter().any(Mono::is_tracked) { Mono::Opaque } else { Mono::constant(out_old[a]) };
            set(cx, 0, m);
        }
        Op::Split(s) => {
            let Some(xm) = in_m(cx, 0) else { return };
            let r = xm.len() as i64;
            let a = (if s.axis() < 0 { s.axis() + r } else { s.axis() }) as usize;
            if xm.get(a).is_some_and(Mono::is_tracked) {
                cx.errors.push(err(g, n, format!("it splits axis {a}, which changes size, into fixed parts")));
                return;
            }
            for k in 0..node.num_outputs() {
                let mut m = xm.clone();
                if let Some(d) = cx.old_dims(Value::new(n, k as u16)) {
                    m[a] = Mono::constant(d[a]);
                }
                set(cx, k, m);
            }
        }
        Op::Slice(_) => {
            let (Some(xm), Some(xo)) = (in_m(cx, 0), in_old(cx, 0)) else { return };
            // A full slice of a changing axis follows it; a partial one has a literal size.
            let m: Vec<Mono> =
                (0..out_old.len())
                    .map(|i| {
                        if out_old[i] == xo[i] && xm[i].is_tracked() {
                            xm[i].clone()
                        } else {
                            Mono::constant(out_old[i])
                        }
                    })
                    .collect();
            if tracked_in {
                set(cx, 0, m);
            }
        }
        Op::Gather(gt) => {
            let (Some(dm), Some(im)) = (in_m(cx, 0), in_m(cx, 1)) else { return };
            let r = dm.len() as i64;
            let a = (if gt.axis() < 0 { gt.axis() + r } else { gt.axis() }) as usize;
            let mut m = dm[..a].to_vec();
            m.extend(im);
            m.extend(dm[a + 1..].iter().cloned());
            set(cx, 0, m);
        }
        Op::GatherElements(_) => {
            if let Some(im) = in_m(cx, 1) {
                set(cx, 0, im);
            }
        }
        Op::Expand(_) => {
            let (Some(xm), Some(xo)) = (in_m(cx, 0), in_old(cx, 0)) else { return };
            let r = out_old.len();
            let m: Vec<Mono> = (0..r)
                .map(|i| {
                    let k = (i + xo.len()).checked_sub(r);
                    match k {
                        Some(k) if xo[k] == out_old[i] => xm[k].clone(),
                        _ => Mono::constant(out_old[i]),
                    }
                })
                .collect();
            set(cx, 0, m);
        }
        Op::Tile(_) => {
            if let Some(xm) = in_m(cx, 0)
                && xm.iter().any(Mono::is_tracked)
            {
                let reps = consts_i64(consts, input(1)).unwrap_or_default();
                set(
                    cx,
                    0,
                    xm.iter().enumerate().map(|(i, m)| m.mul(&Mono::constant(*reps.get(i).unwrap_or(&1)))).collect(),
                );
            }
        }
        _ if node.op.class() == OpClass::Reduce => {
            let Some(xm) = in_m(cx, 0) else { return };
            let keep_rank = out_old.len() == xm.len();
            let mut m = Vec::new();
            let xo = in_old(cx, 0).unwrap_or_default();
            if keep_rank {
                for i in 0..xm.len() {
                    m.push(if out_old[i] == xo[i] { xm[i].clone() } else { Mono::constant(out_old[i]) });
                }
            } else {
                // Match kept axes in order by old size.
                let mut j = 0;
                for i in 0..xm.len() {
                    if j < out_old.len() && xo[i] == out_old[j] && m.len() < out_old.len() {
                        // Ambiguous when a reduced axis equals a kept one; prefer keeping.
                        m.push(xm[i].clone());
                        j += 1;
                    }
                }
                if m.len() != out_old.len() {
                    m = out_old.iter().map(|&v| Mono::constant(v)).collect();
                }
            }
            set(cx, 0, m);
        }
        Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) => {
            let Some(xm) = in_m(cx, 0) else { return };
            let layout = match &node.op {
                Op::LSTM(l) => l.layout(),
                Op::GRU(l) => l.layout(),
                Op::RNN(l) => l.layout(),
                _ => 0,
            };
            let (seq, batch) =
                if layout == 0 { (xm[0].clone(), xm[1].clone()) } else { (xm[1].clone(), xm[0].clone()) };
            for s in 0..node.num_outputs() {
                let Some(d) = cx.old_dims(Value::new(n, s as u16)).cloned() else { continue };
                let m: Vec<Mono> = if s == 0 {
                    if layout == 0 {
                        vec![seq.clone(), Mono::constant(d[1]), batch.clone(), Mono::constant(d[3])]
                    } else {
                        vec![batch.clone(), seq.clone(), Mono::constant(d[2]), Mono::constant(d[3])]
                    }
                } else if layout == 0 {
                    vec![Mono::constant(d[0]), batch.clone(), Mono::constant(d[2])]
                } else {
                    vec![batch.clone(), Mono::constant(d[1]), Mono::constant(d[2])]
                };
                set(cx, s, m);
            }
            // Initial states carry the batch too.
            for slot in [5usize, 6] {
                if let (Some(v), Some(d)) = (input(slot), in_old(cx, slot))
                    && batch.is_tracked()
                {
                    let a = if layout == 0 { 1 } else { 0 };
                    let hm = cx.input_monos(g, v).unwrap_or_default();
                    if !hm.get(a).is_some_and(Mono::is_tracked) && d.get(a).is_some() {
                        cx.reqs.push((v, a, batch.clone()));
                    }
                }
            }
        }
        Op::Shape(_) | Op::Size(_) | Op::NonZero(_) | Op::ConstantOfShape(_) | Op::Range(_) => {}
        _ => {
            if tracked_in {
                for s in 0..node.num_outputs() {
                    let rank = cx.old_dims(Value::new(n, s as u16)).map_or(0, Vec::len);
                    set(cx, s, vec![Mono::Opaque; rank]);
                }
            }
        }
    }
}

/// Writes the new sizes of tracked axes into the literal shape operands that produce them.
fn rewrite_literals(
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
        match rewrite_operand(g, n, slot, &ups, old) {
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
    }

    #[test]
    fn constants_regenerate_along_an_axis() {
        let pos = Tensor::from_i64(vec![1, 4], vec![0, 1, 2, 3]);
        let t = regenerate(&pos, 1, 6).unwrap();
        assert_eq!(t.to_i64_vec().unwrap(), vec![0, 1, 2, 3, 4, 5]);
        let ones = Tensor::from_f32(vec![2, 2], vec![1.0, 2.0, 1.0, 2.0]);
        assert_eq!(regenerate(&ones, 0, 3).unwrap().to_f64_vec().unwrap(), vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
        let noise = Tensor::from_f32(vec![3], vec![1.0, 5.0, 2.0]);
        assert!(regenerate(&noise, 0, 4).is_err());
        let causal = Tensor {
            dtype: ir::DType::Bool,
            dims: vec![1, 3, 3],
            name: None,
            data: TensorData::Int32(vec![1, 0, 0, 1, 1, 0, 1, 1, 1]),
        };
        let t = regenerate_square(&causal, (1, 2), 4).unwrap();
        assert_eq!(t.to_i64_vec().unwrap(), vec![1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1]);
    }

    #[test]
    fn input_shapes_parse() {
        assert_eq!(parse_input_shape("input_ids=8x1024").unwrap(), ("input_ids".into(), vec![8, 1024]));
        assert!(parse_input_shape("x=8xq").is_err());
        assert!(parse_input_shape("nothing").is_err());
    }
}
