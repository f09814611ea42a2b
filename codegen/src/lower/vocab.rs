//! An embedding (Gather along axis 0) whose table is split by rows: each device gathers the
//! rows it holds (indices outside its range masked to zero), so the results are partial sums.

use ir::op::{self as o, Op};
use ir::shard::{IterSpace, strategy_shardings};
use ir::{NodeId, Value};

use super::local::Local;
use super::{LowerError, LowerErrorKind};

/// `x` with size-1 dims inserted at `axes`.
fn unsqueeze(l: &mut Local<'_>, x: Value, axes: &[i64], base: &str) -> Value {
    if l.g.opset >= 13 {
        let a = l.const_i64(&format!("{base}__uaxes"), axes);
        l.op1(Op::Unsqueeze(o::Unsqueeze::default()), &[x, a], base)
    } else {
        l.op1(Op::Unsqueeze(o::Unsqueeze { axes: Some(axes.to_vec()) }), &[x], base)
    }
}

/// The masked local gather.
pub(super) fn emit(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    ins: &[Option<Value>],
    out: &str,
) -> Result<Value, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let Op::Gather(gt) = &node.op else { return Err(l.err(Some(n), LowerErrorKind::Graph, "not a gather")) };
    let missing = || l.err(Some(n), LowerErrorKind::Graph, "a gather without its inputs");
    let (data_v, idx_v) = (node.input(0).ok_or_else(missing)?, node.input(1).ok_or_else(missing)?);
    let (data, idx) = (ins[0].ok_or_else(missing)?, ins[1].ok_or_else(missing)?);
    let ddims = l.micro_dims(data_v)?;
    let axis = ir::ops::norm_axis(gt.axis(), ddims.len()).map_err(|e| l.err(Some(n), LowerErrorKind::Graph, e))?;
    let (ins_l, _) = strategy_shardings(sp, s);
    let data_layout = ins_l[0].clone().ok_or_else(missing)?;
    let (start, end) = crate::layout::dim_range(&data_layout, l.mesh, &l.coords, axis, ddims[axis]);
    let base = g.value_name(Value::new(n, 0)).to_string();
    let it = l.dtype(idx_v);
    let vfull = l.scalar(&format!("{base}__V"), it, ddims[axis] as f64);
    let zero = l.scalar(&format!("{base}__zero"), it, 0.0);
    let neg = l.op1(Op::Less(o::Less::default()), &[idx, zero], &format!("{base}__neg"));
    let wrapped = l.op1(Op::Add(o::Add::default()), &[idx, vfull], &format!("{base}__wrapped"));
    let idx_n = l.op1(Op::Where(o::Where::default()), &[neg, wrapped, idx], &format!("{base}__idx"));
    let off = l.scalar(&format!("{base}__off"), it, start as f64);
    let len = l.scalar(&format!("{base}__len"), it, (end - start) as f64);
    let rel = l.op1(Op::Sub(o::Sub::default()), &[idx_n, off], &format!("{base}__rel"));
    let ge = l.op1(Op::GreaterOrEqual(o::GreaterOrEqual::default()), &[rel, zero], &format!("{base}__ge"));
    let lt = l.op1(Op::Less(o::Less::default()), &[rel, len], &format!("{base}__lt"));
    let mask = l.op1(Op::And(o::And::default()), &[ge, lt], &format!("{base}__mask"));
    let safe = l.op1(Op::Where(o::Where::default()), &[mask, rel, zero], &format!("{base}__safe"));
    let got = l.op1(Op::Gather(o::Gather { axis: Some(axis as i64) }), &[data, safe], &format!("{base}__local"));
    // Output dims: data[..axis] + indices + data[axis+1..]; the mask covers the index dims.
    let idims = l.micro_dims(idx_v)?;
    let trailing = ddims.len() - axis - 1;
    let mut m = mask;
    if trailing > 0 {
        let axes: Vec<i64> = (0..trailing).map(|k| (axis + idims.len() + k) as i64).collect();
        m = unsqueeze(l, m, &axes, &format!("{base}__maskx"));
    }
    if axis > 0 {
        // Leading data dims come first in the output: unsqueeze the mask in front.
        let axes: Vec<i64> = (0..axis as i64).collect();
        m = unsqueeze(l, m, &axes, &format!("{base}__maskf"));
    }
    let z = l.scalar(&format!("{base}__z"), l.dtype(data_v), 0.0);
    Ok(l.op_named(Op::Where(o::Where::default()), &[m, got, z], out))
}
