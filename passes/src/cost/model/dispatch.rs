//! The all-to-all token dispatcher's price (`SplitMode::Dispatch`): the all-to-alls the
//! lowering emits (codegen/src/lower/experts.rs) — for a mixture, the tokens' rows, their
//! routing weights and their experts' ids out and the outputs' rows back; for its gradient
//! the same three and `dY`'s rows out, `dX`'s and `dw`'s rows back — each of the buffer's
//! `parts · capacity` rows on every device of the axis ([`ir::ops::experts::dispatch_capacity`]).

use super::*;

/// The all-to-alls of one dispatch, in order: the width of each row (elements) and whether
/// it carries the experts' ids (int64) rather than values of the op's element type.
pub fn dispatch_transfers(grad: bool, hidden: usize) -> Vec<(usize, bool)> {
    let out = [(hidden, false), (1, false), (1, true)];
    if grad {
        out.into_iter().chain([(hidden, false), (hidden, false), (1, false)]).collect()
    } else {
        out.into_iter().chain([(hidden, false)]).collect()
    }
}

impl CostModel<'_> {
    /// The dispatcher's all-to-alls for op `n` over mesh axis `axis` with `capacity` rows per
    /// device, forward then backward (a mixture's backward is its gradient's dispatch).
    pub(super) fn dispatch_steps(
        &self,
        n: NodeId,
        axis: usize,
        capacity: usize,
        layout: &Sharding,
    ) -> Vec<(Phase, Step)> {
        let node = self.g.node(n);
        let Some((hidden, eb, rows)) = self.dispatch_buffer(n, axis, capacity) else { return Vec::new() };
        let steps = |grad: bool| -> Vec<Step> {
            dispatch_transfers(grad, hidden)
                .into_iter()
                .filter_map(|(w, ids)| {
                    let bytes = rows * w as f64 * if ids { 8.0 } else { eb };
                    let a2a = CommStep {
                        kind: StepKind::AllToAll { split: 0, concat: 0 },
                        axes: vec![axis],
                        bytes,
                        to: layout.clone(),
                    };
                    price(&a2a, 1.0, &self.mesh, self.cluster)
                })
                .collect()
        };
        let grad = matches!(node.op, Op::MoEGrad(_));
        let mut out: Vec<(Phase, Step)> = steps(grad).into_iter().map(|s| (Phase::Forward, s)).collect();
        if !grad {
            out.extend(steps(true).into_iter().map(|s| (Phase::Backward, s)));
        }
        out
    }

    /// Op `n`'s row width (elements) and element bytes, and the rows of its buffer over mesh
    /// axis `axis` at `capacity` rows per device.
    fn dispatch_buffer(&self, n: NodeId, axis: usize, capacity: usize) -> Option<(usize, f64, f64)> {
        let (dims, eb) = self.value_shape(self.g.node(n).input(0)?);
        let hidden = dims.last().copied().unwrap_or(0).max(0) as usize;
        Some((hidden, eb, (self.mesh.axes[axis].size * capacity) as f64))
    }

    /// The dispatcher's buffers on one device for a micro-batch of `1/k` of the batch, op `n`
    /// dispatching over mesh axis `axis` at `capacity` rows per device: the rows sent and
    /// received of each all-to-all of the op (and, `backward`, of its gradient's).
    pub(super) fn dispatch_scratch(&self, n: NodeId, (axis, capacity): (usize, usize), backward: bool, k: f64) -> f64 {
        let Some((hidden, eb, rows)) = self.dispatch_buffer(n, axis, capacity) else { return 0.0 };
        let grad = matches!(self.g.node(n).op, Op::MoEGrad(_)) || backward;
        let elems: usize = dispatch_transfers(grad, hidden).iter().map(|(w, _)| w).sum();
        2.0 * rows / k.max(1.0) * elems as f64 * eb
    }
}
