//! A mixture of experts split by experts (`MoE`, `MoEGrad`): a device holding experts `s..e`
//! reads the ids shifted by `s`, and the op adds nothing for a pair whose shifted id falls
//! outside `0..e − s` (its rule, ir/src/ops/experts.rs). So it holds the op's sum over the
//! experts restricted to its own: the tokens' outputs (`Y`; `dX`, `dw`) as partial sums over
//! the experts, the expert weights' gradients (`dW1`, `dW2`) as their rows `s..e` — partial
//! sums over the tokens where the tokens are split. The prover builds the shifted ids such a
//! device must read from the graph's ids and accepts the op when its operands are exactly
//! those; the tokens are rows held alike by every token operand, whole along the features.
//!
//! Also `TopK`, whose rows along the other dims are independent.

use ir::DType;
use ir::NodeId;
use ir::op::{self as o, Op};

use super::rules::{Cx, Out, op_key, whole_rule, wrong};
use super::term::{Fact, Head, Share, TermId, whole};
use super::vocab::{build, int};

/// `TopK` on rows held whole along its axis: both outputs' same rows.
pub fn topk(cx: &mut Cx<'_>, n: NodeId, axis: i64, ins: &[Option<Fact>]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("TopK without input") };
    let shape = cx.terms.shape(x.term).to_vec();
    let a = (if axis < 0 { axis + shape.len() as i64 } else { axis }) as usize;
    if !x.is_exact() {
        return wrong("a partial sum reaches TopK");
    }
    if a >= shape.len() || x.region[a] != (0, shape[a]) {
        return wrong(format!("TopK along dim {a}, of which this device holds only part"));
    }
    let mut terms = vec![x.term];
    for f in ins.iter().skip(1).flatten() {
        if !f.is_exact() || f.region != whole(cx.terms.shape(f.term)) {
            return wrong("TopK's k held in part");
        }
        terms.push(f.term);
    }
    let key = op_key(&cx.g.node(n).op);
    let mut out = Vec::new();
    for slot in 0..2 {
        let Some(local) = cx.out_dims(n, slot) else { return wrong("TopK of unknown shape") };
        let (mut full, mut region) = (shape.clone(), x.region.clone());
        full[a] = local[a];
        region[a] = (0, local[a]);
        let t = cx.terms.op(&key, slot as u16, &terms, &full);
        out.push(Some(Fact::exact(t, region)));
    }
    Ok(out)
}

/// The graph's `MoE` (or `MoEGrad`) terms over expert weights `w1` at operand `at`: their
/// ids (operand `at − 2`).
fn graph_ids(cx: &Cx<'_>, key: &str, w1: TermId, at: usize) -> Vec<TermId> {
    cx.terms
        .users(w1)
        .iter()
        .copied()
        .filter(|&u| matches!(cx.terms.head(u), Head::Op { key: k, slot: 0 } if k == key))
        .filter(|&u| cx.terms.inputs(u).get(at) == Some(&w1))
        .map(|u| cx.terms.inputs(u)[at - 2])
        .collect()
}

/// `MoE` (`grad` false: X, ids, w, W1, W2) or `MoEGrad` (dY first) on a device's pieces.
pub fn apply(cx: &mut Cx<'_>, n: NodeId, grad: bool, ins: &[Option<Fact>]) -> Out {
    // On the all-to-all dispatcher's rows received.
    if let Some(out) = super::dispatch::experts(cx, n, grad, ins) {
        return out;
    }
    let facts: Vec<&Fact> = ins.iter().flatten().collect();
    if facts.len() != ins.len() {
        return wrong("a mixture of experts without its operands");
    }
    if facts.iter().all(|f| f.is_exact() && f.region == whole(cx.terms.shape(f.term))) {
        return whole_rule(cx, n, ins);
    }
    let x0 = usize::from(grad);
    let (ids, w1, w2) = (facts[x0 + 1], facts[x0 + 3], facts[x0 + 4]);
    let experts = cx.terms.shape(w1.term)[0];
    let held = w1.region[0];
    if w2.region[0] != held
        || w1.region[1..] != whole(cx.terms.shape(w1.term))[1..]
        || w2.region[1..] != whole(cx.terms.shape(w2.term))[1..]
    {
        return wrong(format!(
            "the experts' weights held as {:?} and {:?}: not one range of whole experts",
            w1.region, w2.region
        ));
    }
    // The token operands: exact, the same rows, whole along the rest.
    let token_ops: Vec<usize> = if grad { vec![0, 1, 2, 3] } else { vec![0, 1, 2] };
    let rows = facts[x0].region[0];
    for &j in &token_ops {
        let f = facts[j];
        let shape = cx.terms.shape(f.term);
        if !f.is_exact() || f.region[0] != rows || f.region[1] != (0, shape[1]) {
            return wrong(format!("a mixture's token operand {j} held as {:?}, not rows {rows:?} whole", f.region));
        }
    }
    if !w1.is_exact() || !w2.is_exact() {
        return wrong("a partial sum reaches a mixture's expert weights");
    }
    let key = op_key(&cx.g.node(n).op);
    let at = x0 + 3;
    // The graph's ids, as a device holding experts from `held.0` reads them shifted.
    let shifted = |cx: &mut Cx<'_>, c: TermId| {
        (held.0 == 0 && ids.term == c)
            || [DType::Int64, DType::Int32].into_iter().any(|dt| {
                let s = int(cx, dt, held.0);
                build(cx, Op::Sub(o::Sub::default()), &[c, s]) == ids.term
            })
    };
    let ids_g = graph_ids(cx, &key, w1.term, at).into_iter().find(|&c| shifted(cx, c));
    let Some(ids_g) = ids_g else {
        return wrong(format!(
            "a mixture holding experts {held:?} reads ids that are not the graph's shifted by {}",
            held.0
        ));
    };
    let mut terms: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    terms[x0 + 1] = ids_g;
    let t_all = cx.terms.shape(facts[x0].term)[0];
    let partial_experts = held != (0, experts);
    let mut out = Vec::new();
    for slot in 0..cx.g.node(n).num_outputs() {
        let Some(local) = cx.out_dims(n, slot) else { return wrong("a mixture's output of unknown shape") };
        let per_token = !grad || slot < 2;
        let (shape, region): (Vec<i64>, Vec<(i64, i64)>) = if per_token {
            let w = local[1];
            (vec![t_all, w], vec![rows, (0, w)])
        } else {
            // (dW1, dW2: the shapes of W1, W2.)
            let full = cx.terms.shape(terms[x0 + slot + 1]).to_vec();
            let mut r = whole(&full);
            r[0] = held;
            (full, r)
        };
        let t = cx.terms.op(&key, slot as u16, &terms, &shape);
        let mut shares = Vec::new();
        if per_token && partial_experts {
            shares.push(Share { site: t, space: vec![experts], held: vec![vec![held]], max: false });
        }
        if !per_token && rows != (0, t_all) {
            shares.push(Share { site: t, space: vec![t_all], held: vec![vec![rows]], max: false });
        }
        out.push(Some(Fact { term: t, region, shares, alts: Vec::new() }));
    }
    Ok(out)
}
