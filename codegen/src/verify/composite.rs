//! Composite ops the prover knows by their definitions (layer normalization, the mean losses)
//! and the gradients whose parameter outputs sum over rows (layer normalization's, gather's).
//!
//! A definition is written once here as terms; a device that computes the op whole or row by
//! row builds it through this rule, a device that computes it from statistics all-reduced
//! over a split dim builds the same terms op by op ([`super::rules`]), so both meet the global
//! op's term.

use ir::eval::Array;
use ir::op::{self as o, Op};
use ir::{DType, NodeId, Value};

use super::rules::{Cx, Why, op_key, out_dims_of, pointwise_term, reduce_term, whole_rule};
use super::term::{Fact, Region, Share, TermId, extents, whole};

type Out = Result<Vec<Option<Fact>>, Why>;

fn wrong<T>(m: impl Into<String>) -> Result<T, Why> {
    Err(Why::Wrong(m.into()))
}

fn first(ins: &[Option<Fact>], k: usize) -> Option<&Fact> {
    ins.get(k).and_then(Option::as_ref)
}

/// A scalar literal of `dtype` as the lowering writes one.
fn scalar_literal(cx: &mut Cx<'_>, dtype: DType, x: f64) -> TermId {
    let a =
        if dtype.is_int() { Array::int(dtype, vec![], vec![x as i64]) } else { Array::float(dtype, vec![], vec![x]) };
    cx.literal(&a)
}

/// LayerNormalization over dims `axis..`: `(x − μ)/√(σ² + ε)·scale + bias`, μ and σ² as sums
/// times `1/n`; rows held whole along the normalized dims.
pub fn layer_norm(cx: &mut Cx<'_>, n: NodeId, ln: &o::LayerNormalization, ins: &[Option<Fact>]) -> Out {
    let Some(x) = first(ins, 0) else { return wrong("LayerNormalization without input") };
    if ins.iter().flatten().any(|f| !f.is_exact()) {
        return wrong("a partial sum reaches LayerNormalization");
    }
    let shape = cx.terms.shape(x.term).to_vec();
    let r = shape.len() as i64;
    let axis = ln.axis.unwrap_or(-1);
    let axis = (if axis < 0 { axis + r } else { axis }) as usize;
    let stat: Vec<usize> = (axis..shape.len()).collect();
    for &d in &stat {
        if x.region[d] != (0, shape[d]) {
            return wrong(format!("LayerNormalization over dim {d}, of which this device holds {:?}", x.region[d]));
        }
    }
    let mut params = Vec::new();
    for k in [1, 2] {
        if let Some(p) = first(ins, k) {
            let Some(w) = p.at(&whole(cx.terms.shape(p.term))) else {
                return wrong(format!("LayerNormalization's parameter {k} held in part {:?}", p.region));
            };
            params.push((k, w.term));
        }
    }
    let dtype = cx.g.tensor_type(cx.g.node(n).input(0).unwrap_or(Value::new(n, 0))).map_or(DType::Float, |t| t.dtype);
    let count: i64 = stat.iter().map(|&d| shape[d]).product();
    let inv = (1.0 / count as f64) as f32 as f64;
    let s1 = reduce_term(cx, "ReduceSum", x.term, &stat, true);
    let mean = cx.terms.scaled(s1, inv);
    let d = pointwise_term(cx, &Op::Sub(o::Sub::default()), &[x.term, mean]);
    let d2 = pointwise_term(cx, &Op::Mul(o::Mul::default()), &[d, d]);
    let s2 = reduce_term(cx, "ReduceSum", d2, &stat, true);
    let var = cx.terms.scaled(s2, inv);
    let eps = scalar_literal(cx, dtype, f64::from(ln.epsilon()));
    let ve = pointwise_term(cx, &Op::Add(o::Add::default()), &[var, eps]);
    let sd = pointwise_term(cx, &Op::Sqrt(o::Sqrt::default()), &[ve]);
    let mut y = pointwise_term(cx, &Op::Div(o::Div::default()), &[d, sd]);
    for (k, p) in params {
        let op = if k == 1 { Op::Mul(o::Mul::default()) } else { Op::Add(o::Add::default()) };
        y = pointwise_term(cx, &op, &[y, p]);
    }
    let mut out = vec![Some(Fact::exact(y, x.region.clone()))];
    // The statistics outputs: one per row.
    let key = op_key(&cx.g.node(n).op);
    let ins_t: Vec<TermId> = ins.iter().flatten().map(|f| f.term).collect();
    let srow: Vec<i64> = shape.iter().enumerate().map(|(i, &d)| if i >= axis { 1 } else { d }).collect();
    let rrow: Region = x.region.iter().enumerate().map(|(i, &r)| if i >= axis { (0, 1) } else { r }).collect();
    for slot in 1..cx.g.node(n).num_outputs() {
        let t = cx.terms.op(&key, slot as u16, &ins_t, &srow);
        out.push(Some(Fact::exact(t, rrow.clone())));
    }
    Ok(out)
}

/// LayerNormGrad (X, scale, dY → dX, dscale, dbias): dX row by row; dscale and dbias sum over
/// the rows, partial where the device holds some of them.
pub fn layer_norm_grad(cx: &mut Cx<'_>, op: &Op, axis: Option<i64>, ins: &[Option<Fact>]) -> Out {
    let (Some(x), Some(scale), Some(dy)) = (first(ins, 0), first(ins, 1), first(ins, 2)) else {
        return Err(Why::Uncovered("LayerNormGrad without its three inputs".into()));
    };
    if !x.is_exact() || !dy.is_exact() || !scale.is_exact() {
        return wrong("a partial sum reaches LayerNormGrad");
    }
    let shape = cx.terms.shape(x.term).to_vec();
    let r = shape.len() as i64;
    let a = axis.unwrap_or(-1);
    let a = (if a < 0 { a + r } else { a }) as usize;
    if dy.region != x.region {
        return wrong(format!("LayerNormGrad's X holds {:?}, dY {:?}", x.region, dy.region));
    }
    if (a..shape.len()).any(|d| x.region[d] != (0, shape[d])) {
        return wrong(format!("LayerNormGrad over dims {a}.., held in part: {:?}", x.region));
    }
    let Some(scale) = scale.at(&whole(cx.terms.shape(scale.term))) else {
        return wrong(format!("LayerNormGrad's scale held in part {:?}", scale.region));
    };
    let key = op_key(op);
    let ins_t = [x.term, scale.term, dy.term];
    let dx = cx.terms.op(&key, 0, &ins_t, &shape);
    let mut out = vec![Some(Fact::exact(dx, x.region.clone()))];
    let pshape = cx.terms.shape(scale.term).to_vec();
    let lead = shape[..a].to_vec();
    let held: Region = x.region[..a].to_vec();
    for slot in 1..3u16 {
        let t = cx.terms.op(&key, slot, &ins_t, &pshape);
        let mut f = Fact::whole(cx.terms, t);
        if held != whole(&lead) {
            f.shares.push(Share { site: t, space: lead.clone(), held: vec![held.clone()], max: false });
        }
        out.push(Some(f));
    }
    Ok(out)
}

/// The count of labels not ignored, as the lowering counts them.
fn kept_count(cx: &mut Cx<'_>, labels: TermId, labels_dtype: DType, ix: i64, float: DType) -> TermId {
    let k = scalar_literal(cx, labels_dtype, ix as f64);
    let eq = pointwise_term(cx, &Op::Equal(o::Equal::default()), &[labels, k]);
    let keep = pointwise_term(cx, &Op::Not(o::Not::default()), &[eq]);
    let f = pointwise_term(cx, &Op::Cast(o::Cast { saturate: None, to: Some(float.code()) }), &[keep]);
    let rank = cx.terms.shape(labels).len();
    reduce_term(cx, "ReduceSum", f, &(0..rank).collect::<Vec<_>>(), false)
}

/// SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss and their gradients: a sum over the rows held (partial where some
/// are elsewhere), a mean as that sum over the count of labels (all of them, or those not
/// ignored).
pub fn loss(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let grad = matches!(node.op, Op::SoftmaxCrossEntropyLossGrad(_));
    let grad = grad || matches!(node.op, Op::NegativeLogLikelihoodLossGrad(_));
    let (reduction, ignore) = match &node.op {
        Op::SoftmaxCrossEntropyLoss(l) => (l.reduction.clone(), l.ignore_index),
        Op::SoftmaxCrossEntropyLossGrad(l) => (l.reduction.clone(), l.ignore_index),
        Op::NegativeLogLikelihoodLoss(l) => (l.reduction.clone(), l.ignore_index),
        Op::NegativeLogLikelihoodLossGrad(l) => (l.reduction.clone(), l.ignore_index),
        _ => return wrong("not a loss"),
    };
    let reduction = reduction.unwrap_or_else(|| "mean".into());
    let off = usize::from(grad);
    let (Some(scores), Some(labels)) = (first(ins, off), first(ins, off + 1)) else {
        return Err(Why::Uncovered("a loss without scores and labels".into()));
    };
    if first(ins, off + 2).is_some() || reduction == "none" {
        return whole_rule(cx, n, ins);
    }
    if !scores.is_exact() || !labels.is_exact() {
        return wrong("a partial sum reaches the loss");
    }
    let ss = cx.terms.shape(scores.term).to_vec();
    let ls = cx.terms.shape(labels.term).to_vec();
    let rows: Region = scores.region.iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, &r)| r).collect();
    if scores.region[1] != (0, ss[1]) || rows != labels.region {
        return wrong(format!("the loss's scores hold {:?}, its labels {:?}", scores.region, labels.region));
    }
    let mut sum_op = node.op.clone();
    match &mut sum_op {
        Op::SoftmaxCrossEntropyLoss(l) => l.reduction = Some("sum".into()),
        Op::SoftmaxCrossEntropyLossGrad(l) => l.reduction = Some("sum".into()),
        Op::NegativeLogLikelihoodLoss(l) => l.reduction = Some("sum".into()),
        Op::NegativeLogLikelihoodLossGrad(l) => l.reduction = Some("sum".into()),
        _ => {}
    }
    let key = op_key(&sum_op);
    let mut ins_t: Vec<TermId> = Vec::new();
    if grad {
        let Some(dl) = first(ins, 0).and_then(|f| f.at(&whole(cx.terms.shape(f.term)))) else {
            return wrong("the loss gradient's seed is not held whole");
        };
        ins_t.push(dl.term);
    }
    ins_t.extend([scores.term, labels.term]);
    let out_shape = if grad { ss.clone() } else { Vec::new() };
    let t_sum = cx.terms.op(&key, 0, &ins_t, &out_shape);
    let mut term = t_sum;
    let part = labels.region != whole(&ls);
    if reduction == "mean" {
        term = match ignore {
            // The op divides by the count of the labels it holds: on a part, a mean of the
            // part, the whole's mean times (all / held), as ReduceMean.
            None => cx.terms.scaled(t_sum, 1.0 / extents(&labels.region).iter().product::<i64>() as f64),
            Some(_) if part => {
                return wrong(
                    "a mean over the labels not ignored, on part of them: its count is the part's, \
                     no share of the whole's (a mean of means)",
                );
            }
            Some(ix) => {
                let ld = node.input(off + 1).and_then(|v| cx.g.tensor_type(v)).map_or(DType::Int64, |t| t.dtype);
                let fd = cx.g.tensor_type(Value::new(n, 0)).map_or(DType::Float, |t| t.dtype);
                let count = kept_count(cx, labels.term, ld, ix, fd);
                pointwise_term(cx, &Op::Div(o::Div::default()), &[t_sum, count])
            }
        };
    }
    let mut out = Vec::new();
    if grad {
        out.push(Some(Fact::exact(term, scores.region.clone())));
    } else {
        let mut f = Fact::exact(term, Vec::new());
        if part {
            f.shares.push(Share { site: t_sum, space: ls.clone(), held: vec![labels.region.clone()], max: false });
        }
        out.push(Some(f));
        if node.num_outputs() > 1 {
            let lp = cx.terms.op(&key, 1, &ins_t, &ss);
            out.push(Some(Fact::exact(lp, scores.region.clone())));
        }
    }
    Ok(out)
}

/// GatherGrad (indices, dY → dData along `axis`): rows summed over the index positions held,
/// partial where some are elsewhere.
pub fn gather_grad(cx: &mut Cx<'_>, n: NodeId, axis: i64, ins: &[Option<Fact>]) -> Out {
    let (Some(ix), Some(dy)) = (first(ins, 0), first(ins, 1)) else {
        return Err(Why::Uncovered("GatherGrad without indices and dY".into()));
    };
    if !ix.is_exact() || !dy.is_exact() {
        return wrong("a partial sum reaches GatherGrad");
    }
    let Some(local) = out_dims_of(cx, n, 0) else { return Err(Why::Uncovered("GatherGrad of unknown shape".into())) };
    let a = (if axis < 0 { axis + local.len() as i64 } else { axis }) as usize;
    let is = cx.terms.shape(ix.term).to_vec();
    let ds = cx.terms.shape(dy.term).to_vec();
    let k = is.len();
    if dy.region[a..a + k] != ix.region[..] {
        return wrong(format!("GatherGrad's indices hold {:?}, its dY {:?}", ix.region, dy.region));
    }
    let mut shape = ds[..a].to_vec();
    shape.push(local[a]);
    shape.extend(&ds[a + k..]);
    let mut region = dy.region[..a].to_vec();
    region.push((0, local[a]));
    region.extend(&dy.region[a + k..]);
    let t = cx.terms.op(&op_key(&cx.g.node(n).op), 0, &[ix.term, dy.term], &shape);
    let mut f = Fact::exact(t, region);
    if ix.region != whole(&is) {
        f.shares.push(Share { site: t, space: is.clone(), held: vec![ix.region.clone()], max: false });
    }
    Ok(vec![Some(f)])
}

/// The normalization of batch normalization in training mode, as terms: x̂ and σ over the
/// statistic dims `stat`.
struct Normalized {
    xhat: TermId,
    sd: TermId,
    mean: TermId,
    var: TermId,
}

fn normalized(cx: &mut Cx<'_>, x: TermId, stat: &[usize], eps: f32, dtype: DType) -> Normalized {
    let shape = cx.terms.shape(x).to_vec();
    let count: i64 = stat.iter().map(|&d| shape[d]).product();
    let inv = (1.0 / count as f64) as f32 as f64;
    let s1 = reduce_term(cx, "ReduceSum", x, stat, true);
    let mean = cx.terms.scaled(s1, inv);
    let d = pointwise_term(cx, &Op::Sub(o::Sub::default()), &[x, mean]);
    let d2 = pointwise_term(cx, &Op::Mul(o::Mul::default()), &[d, d]);
    let s2 = reduce_term(cx, "ReduceSum", d2, stat, true);
    let var = cx.terms.scaled(s2, inv);
    let e = scalar_literal(cx, dtype, f64::from(eps));
    let ve = pointwise_term(cx, &Op::Add(o::Add::default()), &[var, e]);
    let sd = pointwise_term(cx, &Op::Sqrt(o::Sqrt::default()), &[ve]);
    let xhat = pointwise_term(cx, &Op::Div(o::Div::default()), &[d, sd]);
    Normalized { xhat, sd, mean, var }
}

/// A per-channel vector `[C]` as `[1, C, 1, ..]` (rank `r`), and back.
fn view(cx: &mut Cx<'_>, t: TermId, shape: &[i64]) -> TermId {
    cx.terms.op(".View|", 0, &[t], shape)
}

/// BatchNormalization and BatchNormGrad in training mode: statistics over every dim but the
/// channels (held whole), per channel as the device holds them; the definition is the
/// synchronized batch norm's, the statistics as sums times `1/n`. Inference mode is per
/// channel with the given statistics.
pub fn batch_norm(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let (training, eps, momentum, grad) = match &node.op {
        Op::BatchNormalization(b) => (b.training_mode.unwrap_or(0) != 0, b.epsilon(), b.momentum(), false),
        Op::BatchNormGrad(b) => (b.training_mode.unwrap_or(0) != 0, b.epsilon(), 0.0, true),
        _ => return wrong("not a batch normalization"),
    };
    let facts: Vec<&Fact> = ins.iter().flatten().collect();
    if facts.len() != 5 || facts.iter().any(|f| !f.is_exact()) {
        return Err(Why::Uncovered("a batch normalization without its five exact inputs".into()));
    }
    let x = facts[0];
    let shape = cx.terms.shape(x.term).to_vec();
    let c = x.region[1];
    for f in &facts[1..] {
        let s = cx.terms.shape(f.term);
        let want = if s.len() == 1 { vec![c] } else { x.region.clone() };
        if f.at(&want).is_none() {
            return wrong(format!("{} operands hold {:?} and {:?}", node.op.op_type(), x.region, f.region));
        }
    }
    if !training {
        return if grad { inference_grad(cx, n, &facts) } else { whole_or_rows(cx, n, ins, x) };
    }
    let stat: Vec<usize> = (0..shape.len()).filter(|&d| d != 1).collect();
    if stat.iter().any(|&d| x.region[d] != (0, shape[d])) {
        return wrong(format!("{} over dims {stat:?}, held in part: {:?}", node.op.op_type(), x.region));
    }
    let dtype = cx.g.tensor_type(node.input(0).unwrap_or(Value::new(n, 0))).map_or(DType::Float, |t| t.dtype);
    let nz = normalized(cx, x.term, &stat, eps, dtype);
    let mut b = vec![1i64; shape.len()];
    b[1] = shape[1];
    let chan = vec![shape[1]];
    let scale_b = view(cx, facts[1].term, &b);
    let rows = |t: TermId| Some(Fact::exact(t, x.region.clone()));
    let per_c = |t: TermId| Some(Fact::exact(t, vec![c]));
    if grad {
        let dy = facts[4].term;
        let inv = (1.0 / stat.iter().map(|&d| shape[d]).product::<i64>() as f64) as f32 as f64;
        let db = reduce_term(cx, "ReduceSum", dy, &stat, true);
        let dyx = pointwise_term(cx, &Op::Mul(o::Mul::default()), &[dy, nz.xhat]);
        let ds = reduce_term(cx, "ReduceSum", dyx, &stat, true);
        let mdb = cx.terms.scaled(db, inv);
        let mds = cx.terms.scaled(ds, inv);
        let t = pointwise_term(cx, &Op::Mul(o::Mul::default()), &[nz.xhat, mds]);
        let u = pointwise_term(cx, &Op::Sub(o::Sub::default()), &[dy, mdb]);
        let v = pointwise_term(cx, &Op::Sub(o::Sub::default()), &[u, t]);
        let k = pointwise_term(cx, &Op::Div(o::Div::default()), &[scale_b, nz.sd]);
        let dx = pointwise_term(cx, &Op::Mul(o::Mul::default()), &[v, k]);
        let (dscale, dbias) = (view(cx, ds, &chan), view(cx, db, &chan));
        return Ok(vec![rows(dx), per_c(dscale), per_c(dbias)]);
    }
    let bias_b = view(cx, facts[2].term, &b);
    let ys = pointwise_term(cx, &Op::Mul(o::Mul::default()), &[nz.xhat, scale_b]);
    let y = pointwise_term(cx, &Op::Add(o::Add::default()), &[ys, bias_b]);
    let mut out = vec![rows(y)];
    for (k, batch) in [(3, nz.mean), (4, nz.var)] {
        if out.len() >= node.num_outputs() {
            break;
        }
        let kept = cx.terms.scaled(facts[k].term, f64::from(momentum));
        let bc = view(cx, batch, &chan);
        let taken = cx.terms.scaled(bc, f64::from((1.0 - f64::from(momentum)) as f32));
        out.push(per_c(pointwise_term(cx, &Op::Add(o::Add::default()), &[kept, taken])));
    }
    Ok(out)
}

/// BatchNormGrad with the running statistics (inference mode, a frozen normalization whose
/// scale and bias train): dX row by row; dScale and dBias per channel, summed over the other
/// dims, partial where the device holds some of them.
fn inference_grad(cx: &mut Cx<'_>, n: NodeId, facts: &[&Fact]) -> Out {
    let (x, dy) = (facts[0], facts[4]);
    if dy.region != x.region {
        return wrong(format!("BatchNormGrad's X holds {:?}, dY {:?}", x.region, dy.region));
    }
    let key = op_key(&cx.g.node(n).op);
    let ins_t: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let shape = cx.terms.shape(x.term).to_vec();
    let dx = cx.terms.op(&key, 0, &ins_t, &shape);
    let mut out = vec![Some(Fact::exact(dx, x.region.clone()))];
    let stat: Vec<usize> = (0..shape.len()).filter(|&d| d != 1).collect();
    let space: Vec<i64> = stat.iter().map(|&d| shape[d]).collect();
    let held: Region = stat.iter().map(|&d| x.region[d]).collect();
    for slot in 1..cx.g.node(n).num_outputs().min(3) as u16 {
        let t = cx.terms.op(&key, slot, &ins_t, &[shape[1]]);
        let mut f = Fact::exact(t, vec![x.region[1]]);
        if held != whole(&space) {
            f.shares.push(Share { site: t, space: space.clone(), held: vec![held.clone()], max: false });
        }
        out.push(Some(f));
    }
    Ok(out)
}

/// Inference-mode batch normalization: each output element from its channel's parameters.
fn whole_or_rows(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>], x: &Fact) -> Out {
    let key = op_key(&cx.g.node(n).op);
    let terms: Vec<TermId> = ins.iter().flatten().map(|f| f.term).collect();
    let shape = cx.terms.shape(x.term).to_vec();
    let t = cx.terms.op(&key, 0, &terms, &shape);
    Ok(vec![Some(Fact::exact(t, x.region.clone()))])
}
