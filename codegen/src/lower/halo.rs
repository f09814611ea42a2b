//! Windowed ops (convolution, pooling) split along spatial dims: each device receives the
//! rows its window reads from its neighbours ([`ir::ops::split::SpatialSplit`]), trims what it does not
//! need, and pads only at the tensor's borders.

use ir::op::{self as o, Op};
use ir::ops::split::{SpatialSplit, window_of};
use ir::shard::IterSpace;
use ir::{NodeId, Value};

use super::direct::{group_split, reduced_axes};
use super::local::Local;
use super::{LowerError, LowerErrorKind};

/// The windowed op with halos exchanged, trimmed, and its pads made local.
pub(super) fn emit(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    splits: &[SpatialSplit],
    mut ins: Vec<Option<Value>>,
    out_names: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let (spatial, w, _) = window_of(g, n).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "window geometry"))?;
    let k = spatial.len();
    let xv = node.input(0).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "a windowed op without input"))?;
    let mut x = ins[0].ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "a windowed op without input"))?;
    let base = g.value_name(xv).to_string();
    let mut pads: Vec<i64> = w.pad_begin.iter().chain(&w.pad_end).map(|&p| p as i64).collect();
    for h in splits {
        let hw = &h.halos[l.coords[h.axis]];
        if hw.from_prev + hw.from_next + hw.to_prev + hw.to_next > 0 {
            let exchange = o::HaloExchange {
                axis: Some(h.tensor_dim as i64),
                group: Some(l.group(&[h.axis])),
                widths: Some(vec![hw.from_prev as i64, hw.from_next as i64, hw.to_prev as i64, hw.to_next as i64]),
            };
            x = l.op1(Op::HaloExchange(exchange), &[x], &format!("{base}__halo"));
        }
        if hw.trim_start + hw.trim_end > 0 {
            // The exchanged extent: own block plus what came in.
            let ext = (l.micro_dims(xv)?[h.tensor_dim] / l.mesh.axes[h.axis].size + hw.from_prev + hw.from_next) as i64;
            let st = l.const_i64(&format!("{base}__trim_s"), &[hw.trim_start as i64]);
            let en = l.const_i64(&format!("{base}__trim_e"), &[ext - hw.trim_end as i64]);
            let ax = l.const_i64(&format!("{base}__trim_a"), &[h.tensor_dim as i64]);
            x = l.op1(Op::Slice(o::Slice::default()), &[x, st, en, ax], &format!("{base}__trim"));
        }
        pads[h.spatial] = hw.pad_before as i64;
        pads[h.spatial + k] = hw.pad_after as i64;
    }
    ins[0] = Some(x);
    let mut op = node.op.clone();
    match &mut op {
        Op::Conv(c) => {
            c.pads = Some(pads);
            c.auto_pad = None;
            let gsplit = group_split(l, sp, s);
            if gsplit > 1 {
                c.group = Some(c.group() / gsplit as i64);
            }
        }
        Op::MaxPool(p) => (p.pads, p.auto_pad, p.ceil_mode) = (Some(pads), None, None),
        Op::AveragePool(p) => (p.pads, p.auto_pad, p.ceil_mode) = (Some(pads), None, None),
        Op::LpPool(p) => (p.pads, p.auto_pad, p.ceil_mode) = (Some(pads), None, None),
        _ => return Err(l.err(Some(n), LowerErrorKind::Graph, "a halo for an op without a window")),
    }
    // Other splits of the same op (batch, channels) are handled as in the direct case.
    let reduced = reduced_axes(sp, s);
    if !reduced.is_empty() && !reduced.iter().all(|&a| l.coords[a] == 0) && ins.len() > 2 {
        ins[2] = None;
    }
    Ok(l.emit(op, ins, out_names))
}
