//! An embedding whose table is split by rows (Megatron's vocabulary-parallel embedding):
//! each device gathers the rows it holds with its indices shifted into its block and masks
//! the positions whose index falls elsewhere to zero, giving partial sums of the gather.
//!
//! `Gather(data, I)` at a position is `Σ_v [I = v]·data[v]`, a sum over the table's rows; a
//! device holding rows `s..e` that computes `[s ≤ I < e]·data[I]` holds that sum restricted to
//! those rows. The prover builds the index and mask terms such a device must compute from
//! `I` (negative indices wrapped, shifted by `s`, masked to `0 ≤ · < e − s`) and accepts the
//! device's gather and mask when their terms are exactly those.

use ir::DType;
use ir::eval::Array;
use ir::op::{self as o, Op};

use super::rules::{Cx, pointwise_term};
use super::term::{Fact, Head, Share, TermId};

pub(super) fn int(cx: &mut Cx<'_>, dtype: DType, x: i64) -> TermId {
    cx.literal(&Array::int(dtype, vec![], vec![x]))
}

/// `op` on `ins`: the literal it evaluates to where every input is a literal (as the
/// prover folds them), else its term.
pub(super) fn build(cx: &mut Cx<'_>, op: Op, ins: &[TermId]) -> TermId {
    let arrays: Option<Vec<Array>> = ins.iter().map(|&t| cx.terms.value(t).cloned()).collect();
    if let Some(arrays) = arrays {
        let refs: Vec<Option<&Array>> = arrays.iter().map(Some).collect();
        if let Ok(mut out) = ir::eval::eval_op(&op, &refs, 1, cx.g.opset)
            && let Some(a) = out.pop()
        {
            return cx.literal(&a);
        }
    }
    pointwise_term(cx, &op, ins)
}

/// The terms a device holding rows `s..e` of a table of `v` rows computes from indices `i`:
/// (the shifted index it gathers with, the mask of the positions it holds).
fn shifted(cx: &mut Cx<'_>, i: TermId, dtype: DType, v: i64, (s, e): (i64, i64)) -> (TermId, TermId) {
    let zero = int(cx, dtype, 0);
    let vfull = int(cx, dtype, v);
    let neg = build(cx, Op::Less(o::Less::default()), &[i, zero]);
    let wrapped = build(cx, Op::Add(o::Add::default()), &[i, vfull]);
    let idx = build(cx, Op::Where(o::Where::default()), &[neg, wrapped, i]);
    let off = int(cx, dtype, s);
    let len = int(cx, dtype, e - s);
    let rel = build(cx, Op::Sub(o::Sub::default()), &[idx, off]);
    let ge = build(cx, Op::GreaterOrEqual(o::GreaterOrEqual::default()), &[rel, zero]);
    let lt = build(cx, Op::Less(o::Less::default()), &[rel, len]);
    let mask = build(cx, Op::And(o::And::default()), &[ge, lt]);
    let safe = build(cx, Op::Where(o::Where::default()), &[mask, rel, zero]);
    (safe, mask)
}

/// The graph's gathers from `data`: (their term, their indices).
fn gathers(cx: &Cx<'_>, data: TermId) -> Vec<(TermId, TermId)> {
    cx.terms
        .users(data)
        .iter()
        .copied()
        .filter(|&u| matches!(cx.terms.head(u), Head::Op { key, slot: 0 } if key.starts_with(".Gather|")))
        .filter(|&u| cx.terms.inputs(u).len() == 2 && cx.terms.inputs(u)[0] == data)
        .map(|u| (u, cx.terms.inputs(u)[1]))
        .collect()
}

fn masked_key(axis: usize, rows: (i64, i64)) -> String {
    format!(".MaskedGather|axis={axis}|rows={rows:?}")
}

/// A gather from rows `rows` of `data`'s dim `axis` with indices `idx` (a fact of the shifted
/// index): the masked gather, right where the index falls in those rows.
pub fn gather(cx: &mut Cx<'_>, data: &Fact, idx: &Fact, axis: usize, dtype: DType) -> Option<Fact> {
    let v = cx.terms.shape(data.term)[axis];
    let rows = data.region[axis];
    let cands: Vec<TermId> = gathers(cx, data.term).into_iter().map(|(_, i)| i).collect();
    let i = cands.into_iter().find(|&i| shifted(cx, i, dtype, v, rows).0 == idx.term)?;
    let ds = cx.terms.shape(data.term).to_vec();
    let is = cx.terms.shape(i).to_vec();
    let mut shape = ds[..axis].to_vec();
    shape.extend(&is);
    shape.extend(&ds[axis + 1..]);
    let mut region = data.region[..axis].to_vec();
    region.extend(&idx.region);
    region.extend(&data.region[axis + 1..]);
    let t = cx.terms.op(&masked_key(axis, rows), 0, &[data.term, i], &shape);
    Some(Fact::exact(t, region))
}

/// `Where(mask, masked gather, 0)`: the gather's partial sum over the rows held.
pub fn completed(cx: &mut Cx<'_>, cond: &Fact, x: &Fact, zero: &Fact) -> Option<Fact> {
    let Head::Op { key, .. } = cx.terms.head(x.term) else { return None };
    let rest = key.strip_prefix(".MaskedGather|axis=")?;
    let (axis, rows) = rest.split_once("|rows=")?;
    let axis: usize = axis.parse().ok()?;
    let nums: Vec<i64> = rows.split(|c: char| !c.is_ascii_digit() && c != '-').filter_map(|x| x.parse().ok()).collect();
    let rows = (*nums.first()?, *nums.get(1)?);
    if !matches!(cx.terms.head(zero.term), Head::Const(k) if k.ends_with("[0.0]")) {
        return None;
    }
    let (data, i) = (cx.terms.inputs(x.term)[0], cx.terms.inputs(x.term)[1]);
    let v = cx.terms.shape(data)[axis];
    // The mask, with size-1 dims added to broadcast over the table's other dims.
    let mut m = cond.term;
    while let Head::Op { key, .. } = cx.terms.head(m)
        && key == ".View|"
    {
        m = cx.terms.inputs(m)[0];
    }
    let held = [DType::Int64, DType::Int32].into_iter().any(|dt| shifted(cx, i, dt, v, rows).1 == m);
    if !held {
        return None;
    }
    let g = gathers(cx, data).into_iter().find(|&(_, j)| j == i).map(|(g, _)| g)?;
    let share = Share { site: g, space: vec![v], held: vec![vec![rows]], max: false };
    Some(Fact { term: g, region: x.region.clone(), shares: vec![share], alts: Vec::new() })
}
