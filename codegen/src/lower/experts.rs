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
//! are. The cost model prices these all-to-alls (passes/src/cost/model/compute.rs).

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
    /// Tokens, pairs per token, rows of the buffer (`parts · capacity`).
    t: usize,
    k: usize,
    rows: usize,
    base: String,
}

impl Dispatch {
    /// `x [T, w]` (one row per token) or, `per_pair`, `[T, k]` (one value per pair, `w` = 1)
    /// written into the send buffer's rows of its pairs and sent by one all-to-all: the
    /// `[rows, w]` rows this device receives, block `d` from device `d`.
    fn send(&self, l: &mut Local<'_>, x: Value, w: usize, per_pair: bool, what: &str) -> Value {
        let base = format!("{}__{what}", self.base);
        let (t, k) = (self.t as i64, self.k as i64);
        let pairs = if per_pair {
            reshape(l, x, &[t, k, 1], &base)
        } else {
            let one = reshape(l, x, &[t, 1, w as i64], &base);
            let to = l.const_i64(&format!("{base}__pairs_shape"), &[t, k, w as i64]);
            l.op1(Op::Expand(o::Expand::default()), &[one, to], &format!("{base}__pairs"))
        };
        let shape = Some(vec![self.rows as i64, w as i64]);
        let buf =
            l.op1(Op::GatherGrad(o::GatherGrad { axis: Some(0), shape }), &[self.pos, pairs], &format!("{base}__rows"));
        self.exchange(l, buf, &base)
    }

    /// Rows sent back to their owners by one all-to-all.
    fn exchange(&self, l: &mut Local<'_>, x: Value, base: &str) -> Value {
        let op = o::AllToAll { concat_axis: Some(0), group: Some(self.group.clone()), split_axis: Some(0) };
        l.op1(Op::AllToAll(op), &[x], &format!("{base}__a2a"))
    }

    /// The rows `r [rows, w]` came back: per token the sum over its pairs' rows
    /// (`per_pair`: each pair's row, `[T, k]` for `w` = 1).
    fn combine(&self, l: &mut Local<'_>, r: Value, w: usize, per_pair: bool, out: &str) -> Value {
        let back = self.exchange(l, r, &format!("{out}__back"));
        let got = l.op1(Op::Gather(o::Gather { axis: Some(0) }), &[back, self.pos], &format!("{out}__pairs"));
        let (t, k) = (self.t as i64, self.k as i64);
        if per_pair {
            return reshape_named(l, got, &[t, k], out);
        }
        let sum = super::stats::reduce(l, true, got, &[1], &format!("{out}__sum"));
        reshape_named(l, sum, &[t, w as i64], out)
    }
}

fn reshape(l: &mut Local<'_>, x: Value, shape: &[i64], base: &str) -> Value {
    let s = l.const_i64(&format!("{base}__shape"), shape);
    l.op1(Op::Reshape(o::Reshape::default()), &[x, s], &format!("{base}__r"))
}

fn reshape_named(l: &mut Local<'_>, x: Value, shape: &[i64], name: &str) -> Value {
    let s = l.const_i64(&format!("{name}__shape"), shape);
    l.op_named(Op::Reshape(o::Reshape::default()), &[x, s], name)
}

/// A mixture (`MoE`) or its gradient (`MoEGrad`) under the all-to-all dispatcher over mesh
/// axis `axis` with buffers of `capacity` rows per device: see the module's comment.
pub(super) fn dispatch(
    l: &mut Local<'_>,
    n: NodeId,
    (sp, s): (&IterSpace, &[Option<usize>]),
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
    let (Some(x_v), Some(ids_v), Some(w1_v)) = (node.input(at), node.input(at + 1), node.input(at + 3)) else {
        return Err(missing);
    };
    let (tk, experts, h) = (l.micro_dims(ids_v)?, l.micro_dims(w1_v)?[0], l.micro_dims(x_v)?[1]);
    let parts = l.mesh.axes[axis].size;
    let group = l.group(&[axis]);
    let (layouts, _) = strategy_shardings(sp, s);
    let x_layout =
        layouts.get(at).cloned().flatten().ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "no tokens"))?;
    let local_t = l.local_dims(x_v, &x_layout)?[0];
    let base = g.value_name(Value::new(n, 0)).to_string();
    let route = o::MoERoute {
        capacity: Some(capacity as i64),
        experts: Some((experts / parts) as i64),
        parts: Some(parts as i64),
    };
    let names = [l.fresh(&format!("{base}__pos")), l.fresh(&format!("{base}__expert_rows"))];
    let routed = l.emit(Op::MoERoute(route), vec![Some(ids)], &names);
    let d = Dispatch { pos: routed[0], group, t: local_t, k: tk[1], rows: parts * capacity, base: base.clone() };
    let xr = d.send(l, x, h, false, "x");
    let wr = d.send(l, w, 1, true, "w");
    let local_ids = reshape(l, routed[1], &[d.rows as i64, 1], &format!("{base}__ids"));
    let er = d.exchange(l, local_ids, &format!("{base}__ids"));
    let activation = match &node.op {
        Op::MoE(m) => m.activation.clone(),
        Op::MoEGrad(m) => m.activation.clone(),
        _ => None,
    };
    if !grad {
        let op = Op::MoE(o::MoE { activation, capacity_factor: None });
        let r = l.op1(op, &[xr, er, wr, w1, w2], &format!("{base}__expert_rows_out"));
        return Ok(vec![d.combine(l, r, h, false, &outs[0])]);
    }
    let Some(dy) = input(0) else { return Err(missing) };
    let dyr = d.send(l, dy, h, false, "dy");
    let names: Vec<String> =
        ["dx_rows", "dw_rows", "dw1", "dw2"].iter().map(|s| l.fresh(&format!("{base}__{s}"))).collect();
    let op = Op::MoEGrad(o::MoEGrad { activation, capacity_factor: None });
    let r = l.emit(op, vec![Some(dyr), Some(xr), Some(er), Some(wr), Some(w1), Some(w2)], &names);
    let dx = d.combine(l, r[0], h, false, &outs[0]);
    let dw = d.combine(l, r[1], 1, true, &outs[1]);
    // The experts' weight gradients are this device's experts' whole gradients.
    let dw1 = l.op_named(Op::Identity(o::Identity::default()), &[r[2]], &outs[2]);
    let dw2 = l.op_named(Op::Identity(o::Identity::default()), &[r[3]], &outs[3]);
    Ok(vec![dx, dw, dw1, dw2])
}
