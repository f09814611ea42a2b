//! A mixture of experts split by experts (`MoE`, `MoEGrad`): each device holds a range of the
//! experts and reads the experts' ids shifted by the range's first, so the pairs routed to
//! other devices' experts fall outside its range and add nothing (the op's rule,
//! ir/src/ops/experts.rs); its outputs are partial sums over the expert axes.
//!
//! The all-to-all token dispatcher (`SplitMode::Dispatch`): each device of the axis holds its
//! tokens and its experts. It routes its tokens' pairs into one buffer of `capacity` rows per
//! device of the axis (`MoERoute`; an overflow is an error, never a dropped pair), fills the
//! rows with the tokens, routing weights and the experts' local ids, and sends each device
//! its block by one all-to-all per tensor; it runs its experts on the rows it received (one
//! pair per row, the empty rows' id −1 adding nothing) and sends the outputs back by another;
//! each token sums its pairs' rows. The gradient routes the same way, `dY` beside the tokens,
//! and returns the rows' `dX` and `dw`; the experts' weight gradients stay where the experts
//! are. The cost model prices these all-to-alls (passes/src/cost/model/dispatch.rs).

use ir::op::{self as o, Op};
use ir::shard::{IterSpace, strategy_shardings};
use ir::{NodeId, Value};

use super::local::Local;
use super::{LowerError, LowerErrorKind};

/// The op's inputs with input `ids` shifted by the device's first expert, read from the
/// layout of input `weight` (experts in its dim 0).
pub(super) fn shift_ids(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    mut ins: Vec<Option<Value>>,
    ids: usize,
    weight: usize,
) -> Result<Vec<Option<Value>>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let missing = || l.err(Some(n), LowerErrorKind::Graph, "a mixture of experts without its ids or weights");
    let (ids_v, w_v) = (node.input(ids).ok_or_else(missing)?, node.input(weight).ok_or_else(missing)?);
    let local = ins.get(ids).copied().flatten().ok_or_else(missing)?;
    let experts = *l.micro_dims(w_v)?.first().ok_or_else(missing)?;
    let (layouts, _) = strategy_shardings(sp, s);
    let layout = layouts.get(weight).cloned().flatten().ok_or_else(missing)?;
    let (start, _) = crate::layout::dim_range(&layout, l.mesh, &l.coords, 0, experts);
    let base = g.value_name(Value::new(n, 0)).to_string();
    let first = l.scalar(&format!("{base}__first_expert"), l.dtype(ids_v), start as f64);
    ins[ids] = Some(l.op1(Op::Sub(o::Sub::default()), &[local, first], &format!("{base}__local_ids")));
    Ok(ins)
}

/// One device's view of the dispatcher: its routing and the axis' group.
struct Dispatch {
    /// `pos [T, k]`: each pair's row in the send buffer.
    pos: Value,
    /// The group of the axis, in coordinate order.
    group: Vec<i64>,
    /// Rows of the buffer (`parts · capacity`).
    rows: usize,
    base: String,
}

impl Dispatch {
    /// `x [T, w]` (one row per token) or, `per_pair`, `[T, k]` (one value per pair) written
    /// into the send buffer's rows of its pairs (`MoEDispatch`) and sent by one all-to-all:
    /// the rows this device receives, block `d` from device `d`.
    fn send(&self, l: &mut Local<'_>, x: Value, per_pair: bool, what: &str) -> Value {
        let base = format!("{}__{what}", self.base);
        let op = o::MoEDispatch { per_pair: Some(i64::from(per_pair)), rows: Some(self.rows as i64) };
        let buf = l.op1(Op::MoEDispatch(op), &[x, self.pos], &format!("{base}__rows"));
        self.exchange(l, buf, &base)
    }

    /// Rows sent to (or back from) the devices of the axis by one all-to-all.
    fn exchange(&self, l: &mut Local<'_>, x: Value, base: &str) -> Value {
        let op = o::AllToAll { concat_axis: Some(0), group: Some(self.group.clone()), split_axis: Some(0) };
        l.op1(Op::AllToAll(op), &[x], &format!("{base}__a2a"))
    }

    /// The rows `r` sent back, then per token the sum of its pairs' rows (`per_pair`: each
    /// pair's value, `[T, k]`) (`MoECombine`), named `out`.
    fn combine(&self, l: &mut Local<'_>, r: Value, per_pair: bool, out: &str) -> Value {
        let back = self.exchange(l, r, &format!("{out}__back"));
        let op = o::MoECombine { per_pair: Some(i64::from(per_pair)) };
        l.op_named(Op::MoECombine(op), &[back, self.pos], out)
    }
}

/// A mixture (`MoE`) or its gradient (`MoEGrad`) under the all-to-all dispatcher over mesh
/// axis `axis` with buffers of `capacity` rows per device: see the module's comment.
pub(super) fn dispatch(
    l: &mut Local<'_>,
    n: NodeId,
    axis: usize,
    capacity: usize,
    ins: &[Option<Value>],
    outs: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let grad = matches!(node.op, Op::MoEGrad(_));
    let at = usize::from(grad);
    let missing = l.err(Some(n), LowerErrorKind::Graph, "a mixture of experts without its operands");
    let input = |j: usize| ins.get(j).copied().flatten();
    let (x, ids, w, w1, w2) = (input(at), input(at + 1), input(at + 2), input(at + 3), input(at + 4));
    let (Some(x), Some(ids), Some(w), Some(w1), Some(w2)) = (x, ids, w, w1, w2) else { return Err(missing) };
    let Some(w1_v) = node.input(at + 3) else { return Err(missing) };
    let experts = l.micro_dims(w1_v)?[0];
    let parts = l.mesh.axes[axis].size;
    let base = g.value_name(Value::new(n, 0)).to_string();
    let route = o::MoERoute {
        capacity: Some(capacity as i64),
        experts: Some((experts / parts) as i64),
        parts: Some(parts as i64),
    };
    let names = [l.fresh(&format!("{base}__pos")), l.fresh(&format!("{base}__expert_of_row"))];
    let routed = l.emit(Op::MoERoute(route), vec![Some(ids)], &names);
    let d = Dispatch { pos: routed[0], group: l.group(&[axis]), rows: parts * capacity, base: base.clone() };
    let xr = d.send(l, x, false, "x");
    let wr = d.send(l, w, true, "w");
    let er = d.exchange(l, routed[1], &format!("{base}__ids"));
    // The op itself on the rows received: one pair a row, the experts this device holds.
    if !grad {
        let r = l.op1(node.op.clone(), &[xr, er, wr, w1, w2], &format!("{base}__expert_rows_out"));
        return Ok(vec![d.combine(l, r, false, &outs[0])]);
    }
    let Some(dy) = input(0) else { return Err(missing) };
    let dyr = d.send(l, dy, false, "dy");
    let names: Vec<String> =
        ["dx_rows", "dw_rows", "dw1", "dw2"].iter().map(|s| l.fresh(&format!("{base}__{s}"))).collect();
    let r = l.emit(node.op.clone(), vec![Some(dyr), Some(xr), Some(er), Some(wr), Some(w1), Some(w2)], &names);
    let dx = d.combine(l, r[0], false, &outs[0]);
    let dw = d.combine(l, r[1], true, &outs[1]);
    // The experts' weight gradients are this device's experts' (over the tokens of its group).
    let dw1 = l.op_named(Op::Identity(o::Identity::default()), &[r[2]], &outs[2]);
    let dw2 = l.op_named(Op::Identity(o::Identity::default()), &[r[3]], &outs[3]);
    Ok(vec![dx, dw, dw1, dw2])
}
