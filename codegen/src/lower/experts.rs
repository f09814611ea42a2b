//! A mixture of experts split by experts (`MoE`, `MoEGrad`): each device holds a range of the
//! experts and reads the experts' ids shifted by the range's first, so the pairs routed to
//! other devices' experts fall outside its range and add nothing (the op's rule,
//! ir/src/ops/experts.rs); its outputs are partial sums over the expert axes.

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
