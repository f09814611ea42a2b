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
