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
        let Some(x) = node.input(0) else { return Vec::new() };
        let (dims, eb) = self.value_shape(x);
        let hidden = dims.last().copied().unwrap_or(0).max(0) as usize;
        let rows = (self.mesh.axes[axis].size * capacity) as f64;
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

    /// The dispatcher's buffers on one device for a micro-batch of `1/k` of the batch: the
    /// rows sent and received of each all-to-all of the op (and, `backward`, of its
    /// gradient's), 0 unless `strategy` dispatches.
    pub(super) fn dispatch_scratch(&self, n: NodeId, strategy: &[Option<usize>], backward: bool, k: f64) -> f64 {
        let Ok(SplitMode::Dispatch { axis, capacity }) = split_mode(self.g, n, self.space(n), strategy, &self.mesh)
        else {
            return 0.0;
        };
        let node = self.g.node(n);
        let Some(x) = node.input(0) else { return 0.0 };
        let (dims, eb) = self.value_shape(x);
        let hidden = dims.last().copied().unwrap_or(0).max(0) as usize;
        let rows = (self.mesh.axes[axis].size * capacity) as f64 / k.max(1.0);
        let grad = matches!(node.op, Op::MoEGrad(_)) || backward;
        let elems: usize = dispatch_transfers(grad, hidden).iter().map(|(w, _)| w).sum();
        2.0 * rows * elems as f64 * eb
    }
}
