//! Softmax and layer normalization over split dims: local reductions, an all-reduce of the
//! statistics over the devices that split them, then the local normalization.

use ir::op::{self as o, Op};
use ir::shard::{AxisShard, IterSpace, Sharding, strategy_shardings};
use ir::{NodeId, Value};

use super::local::Local;
use super::{LowerError, LowerErrorKind};

/// A keepdims reduction of `x` over `axes`, with the axes as an input (opset ≥ 13 for
/// ReduceSum, ≥ 18 otherwise) or an attribute.
fn reduce(l: &mut Local<'_>, sum: bool, x: Value, axes: &[usize], base: &str) -> Value {
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let as_input = if sum { l.g.opset >= 13 } else { l.g.opset >= 18 };
    let keep = Some(1);
    let attr_axes = (!as_input).then(|| ax.clone());
    let red = if sum {
        Op::ReduceSum(o::ReduceSum { axes: attr_axes, keepdims: keep, noop_with_empty_axes: None })
    } else {
        Op::ReduceMax(o::ReduceMax { axes: attr_axes, keepdims: keep, noop_with_empty_axes: None })
    };
    if as_input {
        let a = l.const_i64(&format!("{base}__axes"), &ax);
        l.op1(red, &[x, a], base)
    } else {
        l.op1(red, &[x], base)
    }
}

/// The mesh axes splitting any of the iteration dims `dims`.
fn axes_splitting(s: &[Option<usize>], dims: &[usize]) -> Vec<usize> {
    s.iter().enumerate().filter_map(|(a, d)| d.filter(|i| dims.contains(i)).map(|_| a)).collect()
}

fn all_reduce(l: &mut Local<'_>, x: Value, group: &[i64], max: bool, base: &str) -> Value {
    let op = Op::AllReduce(o::AllReduce { group: Some(group.to_vec()), op: max.then(|| "max".to_string()) });
    l.op1(op, &[x], base)
}

/// Softmax (or log-softmax) over statistic dims `stat`, some of them split.
pub(super) fn softmax(
    l: &mut Local<'_>,
    n: NodeId,
    s: &[Option<usize>],
    x: Value,
    log: bool,
    stat: &[usize],
    out: &str,
) -> Result<Value, LowerError> {
    let base = l.g.value_name(Value::new(n, 0)).to_string();
    // Pointwise spaces: iteration dim i is tensor dim i.
    let group = l.group(&axes_splitting(s, stat));
    let m = reduce(l, false, x, stat, &format!("{base}__max"));
    let mg = all_reduce(l, m, &group, true, &format!("{base}__gmax"));
    let shifted = l.op1(Op::Sub(o::Sub::default()), &[x, mg], &format!("{base}__shift"));
    let e = l.op1(Op::Exp(o::Exp::default()), &[shifted], &format!("{base}__exp"));
    let sum = reduce(l, true, e, stat, &format!("{base}__sum"));
    let sg = all_reduce(l, sum, &group, false, &format!("{base}__gsum"));
    Ok(if log {
        let lg = l.op1(Op::Log(o::Log::default()), &[sg], &format!("{base}__logsum"));
        l.op_named(Op::Sub(o::Sub::default()), &[shifted, lg], out)
    } else {
        l.op_named(Op::Div(o::Div::default()), &[e, sg], out)
    })
}

/// Layer normalization over dims `axis..`, some of them split.
pub(super) fn layer_norm(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    ins: &[Option<Value>],
    axis: usize,
    out: &str,
) -> Result<Value, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let Op::LayerNormalization(ln) = &node.op else {
        return Err(l.err(Some(n), LowerErrorKind::Graph, "not a layer normalization"));
    };
    let xv = node.input(0).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "no input"))?;
    let dims = l.micro_dims(xv)?;
    let r = dims.len();
    let stat: Vec<usize> = (axis..r).collect();
    let group = l.group(&axes_splitting(s, &stat));
    let count: usize = dims[axis..].iter().product();
    let base = g.value_name(Value::new(n, 0)).to_string();
    let x = ins[0].ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "no input"))?;
    let dtype = l.dtype(xv);
    let inv_n = l.scalar(&format!("{base}__invn"), dtype, 1.0 / count as f64);
    let s1 = reduce(l, true, x, &stat, &format!("{base}__s1"));
    let s1g = all_reduce(l, s1, &group, false, &format!("{base}__gs1"));
    let mean = l.op1(Op::Mul(o::Mul::default()), &[s1g, inv_n], &format!("{base}__mean"));
    let d = l.op1(Op::Sub(o::Sub::default()), &[x, mean], &format!("{base}__centered"));
    let d2 = l.op1(Op::Mul(o::Mul::default()), &[d, d], &format!("{base}__sq"));
    let s2 = reduce(l, true, d2, &stat, &format!("{base}__s2"));
    let s2g = all_reduce(l, s2, &group, false, &format!("{base}__gs2"));
    let var = l.op1(Op::Mul(o::Mul::default()), &[s2g, inv_n], &format!("{base}__var"));
    let eps = l.scalar(&format!("{base}__eps"), dtype, ln.epsilon() as f64);
    let ve = l.op1(Op::Add(o::Add::default()), &[var, eps], &format!("{base}__vareps"));
    let sd = l.op1(Op::Sqrt(o::Sqrt::default()), &[ve], &format!("{base}__std"));
    let y = l.op1(Op::Div(o::Div::default()), &[d, sd], &format!("{base}__norm"));
    // Scale and bias: the device's slice of the normalized dims.
    let (_, outs) = strategy_shardings(sp, s);
    let out_layout = outs[0].clone();
    let mut cur = y;
    let params: Vec<(usize, Value)> = [1, 2].into_iter().filter_map(|k| node.input(k).map(|v| (k, v))).collect();
    for (i, &(k, pv)) in params.iter().enumerate() {
        let pd = l.global_dims(pv)?;
        // Right-aligned broadcast: parameter dim j is x dim r - pd.len() + j.
        let off = r - pd.len();
        let layout: Sharding = out_layout
            .iter()
            .map(|x| match x {
                AxisShard::Split(d) if (*d as usize) >= off && pd[*d as usize - off] > 1 => {
                    AxisShard::Split((*d as usize - off) as u8)
                }
                AxisShard::Split(_) => AxisShard::Replicate,
                other => *other,
            })
            .collect();
        let p = l.get(pv, &layout)?;
        let op = if k == 1 { Op::Mul(o::Mul::default()) } else { Op::Add(o::Add::default()) };
        cur = if i + 1 == params.len() {
            l.op_named(op, &[cur, p], out)
        } else {
            l.op1(op, &[cur, p], &format!("{base}__scaled"))
        };
    }
    if params.is_empty() {
        cur = l.op_named(Op::Identity(o::Identity::default()), &[cur], out);
    }
    Ok(cur)
}

/// Training-mode batch normalization (`grad`: its gradient, `BatchNormGrad`) over statistic
/// dims `stat`, some of them split: the per-channel sums are all-reduced over the devices
/// that split them, so every device normalizes with the statistics of the whole batch
/// (synchronized batch norm), as one device would. One local value per output slot (an
/// unnamed output is not computed; its slot holds the input).
pub(super) fn batch_norm(
    l: &mut Local<'_>,
    n: NodeId,
    s: &[Option<usize>],
    ins: &[Option<Value>],
    stat: &[usize],
    grad: bool,
    outs: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let (eps, momentum) = match &node.op {
        Op::BatchNormalization(b) => (b.epsilon(), b.momentum()),
        Op::BatchNormGrad(b) => (b.epsilon(), 0.0),
        _ => return Err(l.err(Some(n), LowerErrorKind::Graph, "not a batch normalization")),
    };
    // Both take five inputs: (x, scale, bias, mean, var) and (x, scale, mean, var, dy).
    let missing = (0..5).find(|&k| ins.get(k).copied().flatten().is_none());
    if let Some(k) = missing {
        return Err(l.err(Some(n), LowerErrorKind::Graph, format!("no input {k}")));
    }
    let input = |k: usize| -> Result<Value, LowerError> { Ok(ins[k].expect("checked above")) };
    let xv = node.input(0).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "no input"))?;
    let dims = l.micro_dims(xv)?;
    let count: usize = stat.iter().map(|&d| dims[d]).product();
    let group = l.group(&axes_splitting(s, stat));
    let base = g.value_name(Value::new(n, 0)).to_string();
    let dtype = l.dtype(xv);
    let x = input(0)?;
    // Per-channel vectors as [1, C, 1, ...] (C: this device's channels) and back.
    let mut bshape = vec![1i64; dims.len()];
    bshape[1] = -1;
    let to_b = l.const_i64(&format!("{base}__bshape"), &bshape);
    let to_c = l.const_i64(&format!("{base}__cshape"), &[-1]);
    let reshape = |l: &mut Local<'_>, v: Value, shape: Value, name: &str| {
        l.op1(Op::Reshape(o::Reshape::default()), &[v, shape], name)
    };
    let inv_n = l.scalar(&format!("{base}__invn"), dtype, 1.0 / count as f64);
    let mul = |l: &mut Local<'_>, a: Value, b: Value, name: &str| l.op1(Op::Mul(o::Mul::default()), &[a, b], name);
    let s1 = reduce(l, true, x, stat, &format!("{base}__s1"));
    let s1g = all_reduce(l, s1, &group, false, &format!("{base}__gs1"));
    let mean = mul(l, s1g, inv_n, &format!("{base}__mean"));
    let d = l.op1(Op::Sub(o::Sub::default()), &[x, mean], &format!("{base}__centered"));
    let d2 = mul(l, d, d, &format!("{base}__sq"));
    let s2 = reduce(l, true, d2, stat, &format!("{base}__s2"));
    let s2g = all_reduce(l, s2, &group, false, &format!("{base}__gs2"));
    let var = mul(l, s2g, inv_n, &format!("{base}__var"));
    let e = l.scalar(&format!("{base}__eps"), dtype, eps as f64);
    let ve = l.op1(Op::Add(o::Add::default()), &[var, e], &format!("{base}__vareps"));
    let sd = l.op1(Op::Sqrt(o::Sqrt::default()), &[ve], &format!("{base}__std"));
    let xhat = l.op1(Op::Div(o::Div::default()), &[d, sd], &format!("{base}__xhat"));
    let scale = input(1)?;
    let scale_b = reshape(l, scale, to_b, &format!("{base}__scale"));
    let name = |k: usize| outs.get(k).filter(|o| !o.is_empty()).cloned();
    let mut res = vec![x; outs.len()];
    if !grad {
        let bias = input(2)?;
        let bias_b = reshape(l, bias, to_b, &format!("{base}__bias"));
        let ys = mul(l, xhat, scale_b, &format!("{base}__scaled"));
        if let Some(o) = name(0) {
            res[0] = l.op_named(Op::Add(o::Add::default()), &[ys, bias_b], &o);
        }
        // Running statistics: `running·momentum + batch·(1 − momentum)`.
        let keep = l.scalar(&format!("{base}__momentum"), dtype, momentum as f64);
        let take = l.scalar(&format!("{base}__1_momentum"), dtype, 1.0 - momentum as f64);
        for (slot, (k, batch)) in [(1, (3, mean)), (2, (4, var))] {
            let Some(o) = name(slot) else { continue };
            let running = input(k)?;
            let bc = reshape(l, batch, to_c, &format!("{base}__batch{slot}"));
            let a = mul(l, running, keep, &format!("{base}__kept{slot}"));
            let b = mul(l, bc, take, &format!("{base}__taken{slot}"));
            res[slot] = l.op_named(Op::Add(o::Add::default()), &[a, b], &o);
        }
    } else {
        // dx = scale/σ · (dy − Σdy/N − x̂·Σ(dy·x̂)/N); dscale = Σ(dy·x̂); dbias = Σdy.
        let dy = input(4)?;
        let sb = reduce(l, true, dy, stat, &format!("{base}__sdy"));
        let db = all_reduce(l, sb, &group, false, &format!("{base}__gsdy"));
        let dyx = mul(l, dy, xhat, &format!("{base}__dyxhat"));
        let ss = reduce(l, true, dyx, stat, &format!("{base}__sdyx"));
        let ds = all_reduce(l, ss, &group, false, &format!("{base}__gsdyx"));
        if let Some(o) = name(0) {
            let mdb = mul(l, db, inv_n, &format!("{base}__mdy"));
            let mds = mul(l, ds, inv_n, &format!("{base}__mdyx"));
            let t = mul(l, xhat, mds, &format!("{base}__xmdyx"));
            let u = l.op1(Op::Sub(o::Sub::default()), &[dy, mdb], &format!("{base}__dyc"));
            let v = l.op1(Op::Sub(o::Sub::default()), &[u, t], &format!("{base}__dyct"));
            let k = l.op1(Op::Div(o::Div::default()), &[scale_b, sd], &format!("{base}__k"));
            res[0] = l.op_named(Op::Mul(o::Mul::default()), &[v, k], &o);
        }
        for (slot, sum) in [(1, ds), (2, db)] {
            if let Some(o) = name(slot) {
                res[slot] = l.op_named(Op::Reshape(o::Reshape::default()), &[sum, to_c], &o);
            }
        }
    }
    Ok(res)
}

/// A loss averaged over split samples, or its gradient: the op with `reduction = "sum"` on
/// the device's samples, divided by the count of the samples not ignored, all-reduced over
/// the devices that split them. The loss comes out as partial sums of the mean (its layout),
/// the gradient as the device's rows of the whole batch's gradient. `ignore` is the op's
/// `ignore_index`, as its split mode read it (without one, the count is the labels' size).
pub(super) fn mean_loss(
    l: &mut Local<'_>,
    n: NodeId,
    s: &[Option<usize>],
    ins: Vec<Option<Value>>,
    ignore: Option<i64>,
    outs: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let mut op = node.op.clone();
    // `reduction` was unset (the default, mean) or mean; the op sums its device's terms.
    let (reduction, labels_at) = match &mut op {
        Op::SoftmaxCrossEntropyLoss(o) => (&mut o.reduction, 1),
        Op::NegativeLogLikelihoodLoss(o) => (&mut o.reduction, 1),
        Op::SoftmaxCrossEntropyLossGrad(o) => (&mut o.reduction, 2),
        Op::NegativeLogLikelihoodLossGrad(o) => (&mut o.reduction, 2),
        _ => return Err(l.err(Some(n), LowerErrorKind::Graph, "not a loss")),
    };
    *reduction = Some("sum".into());
    let base = g.value_name(Value::new(n, 0)).to_string();
    let out0 = Value::new(n, 0);
    let dtype = l.dtype(out0);
    let labels_v = node.input(labels_at).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "no labels"))?;
    let labels = ins[labels_at].ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "no labels"))?;
    let count = match ignore {
        // Every sample counts: the count is the labels' global size.
        None => l.scalar(&format!("{base}__count"), dtype, l.micro_dims(labels_v)?.iter().product::<usize>() as f64),
        Some(ix) => {
            let k = l.scalar(&format!("{base}__ignore"), l.dtype(labels_v), ix as f64);
            let eq = l.op1(Op::Equal(o::Equal::default()), &[labels, k], &format!("{base}__ignored"));
            let keep = l.op1(Op::Not(o::Not::default()), &[eq], &format!("{base}__counts"));
            let f = l.op1(
                Op::Cast(o::Cast { saturate: None, to: Some(dtype.code()) }),
                &[keep],
                &format!("{base}__countf"),
            );
            let local = l.op1(
                Op::ReduceSum(o::ReduceSum { axes: None, keepdims: Some(0), noop_with_empty_axes: None }),
                &[f],
                &format!("{base}__nlocal"),
            );
            let axes: Vec<usize> = s.iter().enumerate().filter_map(|(a, d)| d.map(|_| a)).collect();
            let group = l.group(&axes);
            all_reduce(l, local, &group, false, &format!("{base}__count"))
        }
    };
    let mut names: Vec<String> = outs.to_vec();
    let sum_name = l.fresh(&format!("{base}__sum"));
    names[0] = sum_name;
    let mut res = l.emit(op, ins, &names);
    res[0] = l.op_named(Op::Div(o::Div::default()), &[res[0], count], &outs[0]);
    Ok(res)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use ir::op::Op;
    use ir::ops::split::{Expansion, split_mode};
    use ir::shard::{LinkLevel, Mesh, MeshAxis};

    use crate::{Placement, StagePlacement};

    /// Kernels and full-size passes of the ops device 0 runs, views, constants and
    /// communication left out.
    fn counted(prog: &crate::Program, numel: usize) -> Expansion {
        let g = &prog.devices[0].graph;
        let mut e = Expansion { launches: 0, passes: 0 };
        for n in g.op_nodes().unwrap() {
            let node = g.node(n);
            if node.op.class() == ir::OpClass::Comm
                || matches!(node.op, Op::Reshape(_) | Op::Initializer(_) | Op::Constant(_))
            {
                continue;
            }
            e.launches += 1;
            let size = |v: &ir::Value| {
                g.tensor_type(*v).and_then(|t| t.static_dims()).map(|d| d.iter().product::<i64>() as usize)
            };
            let ins: HashSet<ir::Value> = node.inputs().iter().flatten().copied().collect();
            e.passes += ins.iter().filter(|v| size(v) == Some(numel)).count();
            e.passes += (0..node.outputs().len())
                .map(|k| ir::Value::new(n, k as u16))
                .filter(|v| size(v) == Some(numel))
                .count();
        }
        e
    }

    /// Training-mode batch normalization and its gradient, and mean losses and their
    /// gradients, with the batch split over two devices run, per device, the ops
    /// `SplitMode::expansion` states (what the cost model prices): with and without the
    /// running statistics, dx, log_prob, an ignore_index.
    #[test]
    fn split_statistics_run_the_kernels_their_modes_state() {
        let bn = "float[4,3,5,5] x, float[3] s, float[3] b, float[3] m, float[3] v, float[4,3,5,5] dy";
        let loss = "float[4,5] x, int64[4] labels, float dl";
        for (sig, body, numel) in [
            (bn, "y, rm, rv = BatchNormalization <training_mode: int = 1> (x, s, b, m, v)", 2 * 3 * 25),
            (bn, "y = BatchNormalization <training_mode: int = 1> (x, s, b, m, v)", 2 * 3 * 25),
            (bn, "y, ds, db = shardc.BatchNormGrad <training_mode: int = 1> (x, s, m, v, dy)", 2 * 3 * 25),
            (bn, ", y, db = shardc.BatchNormGrad <training_mode: int = 1> (x, s, m, v, dy)", 2 * 3 * 25),
            (loss, "y = SoftmaxCrossEntropyLoss <ignore_index: int = 1> (x, labels)", 2 * 5),
            (loss, "y, lp = SoftmaxCrossEntropyLoss (x, labels)", 2 * 5),
            (loss, "y = NegativeLogLikelihoodLoss <ignore_index: int = 1> (x, labels)", 2 * 5),
            (loss, "y = shardc.SoftmaxCrossEntropyLossGrad <ignore_index: int = 1> (dl, x, labels)", 2 * 5),
            (loss, "y = shardc.SoftmaxCrossEntropyLossGrad (dl, x, labels)", 2 * 5),
        ] {
            let text = format!(
                "<ir_version: 8, opset_import: [\"\" : 17, \"shardc\" : 1]>\nbn ({sig}) => (y) {{\n   {body}\n}}\n"
            );
            let mut m = frontend::parse(&text).unwrap_or_else(|d| panic!("{d:?}")).model;
            ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
            let g = &m.graph;
            let mesh = Mesh { axes: vec![MeshAxis { name: "x".into(), size: 2, level: LinkLevel::Intra }] };
            let n = g.op_nodes().unwrap().into_iter().find(|&n| !matches!(g.node(n).op, Op::Initializer(_))).unwrap();
            let sp = ir::shard::iter_space(g, n);
            let s = vec![Some(0)];
            assert!(ir::shard::strategy_valid(&sp, &s, &mesh, g, n), "{body}: the batch splits");
            let pl = Placement {
                stages: vec![StagePlacement { mesh: mesh.clone(), devices: vec![0, 1] }],
                strategies: [(n, s.clone())].into(),
                stage_of: HashMap::new(),
                micro_batches: 1,
                policy: Default::default(),
                schedule: Default::default(),
                recompute: Vec::new(),
                zero: 0,
            };
            let prog = crate::lower(g, &pl).unwrap();
            let mode = split_mode(g, n, &sp, &s, &mesh).unwrap();
            let (stated, _) = mode.expansion(g.node(n)).unwrap_or_else(|| panic!("{body}: {mode:?} states none"));
            assert_eq!(counted(&prog, numel), stated, "{body}");
        }
    }
}
