//! Ops that compute their piece from their inputs' pieces: shape literals become local, a
//! split reduction keeps its bias on one device and rescales means, depthwise groups split.

use ir::op::{self as o, Op};
use ir::shard::{DimKind, IterSpace, strategy_shardings};
use ir::{NodeId, Value};

use super::LowerError;
use super::local::Local;

pub(super) use ir::ops::split::shape_input;

/// Mesh axes splitting a reduction dim of the strategy, with the dim.
pub(super) fn reduced_axes(sp: &IterSpace, s: &[Option<usize>]) -> Vec<usize> {
    s.iter()
        .enumerate()
        .filter_map(|(a, d)| d.filter(|&i| matches!(sp.dims[i].kind, DimKind::Reduction)).map(|_| a))
        .collect()
}

/// How many ways a depthwise convolution's groups split.
pub(super) fn group_split(l: &Local<'_>, sp: &IterSpace, s: &[Option<usize>]) -> usize {
    s.iter()
        .enumerate()
        .filter(|(_, d)| d.is_some_and(|i| sp.dims[i].name == "g"))
        .map(|(a, _)| l.mesh.axes[a].size)
        .product()
}

/// The op on local shapes, with its shape literals and attributes made local.
pub(super) fn emit(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    mut ins: Vec<Option<Value>>,
    out_names: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let mut op = node.op.clone();
    let (_, outs) = strategy_shardings(sp, s);
    let reduced = reduced_axes(sp, s);
    let out0 = Value::new(n, 0);
    // Shape literals: the local output shape (a split or micro-batching changes it).
    if let Some(j) = shape_input(node) {
        let local: Vec<i64> = l.local_dims(out0, &outs[0])?.iter().map(|&x| x as i64).collect();
        let global: Vec<i64> = l.global_dims(out0)?.iter().map(|&x| x as i64).collect();
        // A shape received from another pipeline stage is known only when it arrives:
        // the literal keeps the local shapes static.
        let received = ins[j].is_some_and(|v| matches!(l.lg.node(v.node).op, Op::Recv(_)));
        if local != global || received {
            let c = l.const_i64(&format!("{}__shape", g.value_name(out0)), &local);
            ins[j] = Some(c);
        }
    }
    // Gradient ops that bake their output's shape in an attribute.
    if let Some(attr) = ir::ops::split::output_shape_attr(&mut op) {
        *attr = Some(l.local_dims(out0, &outs[0])?.iter().map(|&x| x as i64).collect());
    }
    // Squeeze without axes squeezes what is 1 globally (a split can make other dims 1).
    if let Op::Squeeze(sq) = &mut op
        && sq.axes.is_none()
        && node.input(1).is_none()
        && let Some(x) = node.input(0)
    {
        let xd = l.global_dims(x)?;
        let axes: Vec<i64> = (0..xd.len()).filter(|&i| xd[i] == 1).map(|i| i as i64).collect();
        if g.opset >= 13 {
            let c = l.const_i64(&format!("{}__axes", g.value_name(out0)), &axes);
            ins.resize(ins.len().max(2), None);
            ins[1] = Some(c);
        } else {
            sq.axes = Some(axes);
        }
    }
    // A split reduction adds the bias once.
    if !reduced.is_empty()
        && !reduced.iter().all(|&a| l.coords[a] == 0)
        && matches!(node.op, Op::Conv(_) | Op::ConvTranspose(_) | Op::Gemm(_))
        && ins.len() > 2
    {
        ins[2] = None;
    }
    // Depthwise groups split.
    if let Op::Conv(c) = &mut op {
        let gsplit = group_split(l, sp, s);
        if gsplit > 1 {
            c.group = Some(c.group() / gsplit as i64);
        }
    }
    let mut outs_v = l.emit(op, ins, out_names);
    // Means over a split dim become partial sums of local means: scale by the local share.
    if !reduced.is_empty() && matches!(node.op, Op::ReduceMean(_) | Op::GlobalAveragePool(_)) {
        let f: usize = reduced.iter().map(|&a| l.mesh.axes[a].size).product();
        let k = l.scalar(&format!("{}__share", out_names[0]), l.dtype(out0), 1.0 / f as f64);
        outs_v[0] = l.op1(Op::Mul(o::Mul::default()), &[outs_v[0], k], &format!("{}__scaled", out_names[0]));
    }
    Ok(outs_v)
}
