//! Ring attention's price (`SplitMode::Ring`): the point-to-point passes of the keys and
//! values (and in the backward of their gradients) around the ring that the lowering emits
//! (codegen/src/lower/ring.rs), each overlapped with the block of attention computed
//! meanwhile; the zig-zag's moves into the ring's chunks and back, exposed; and, for a causal
//! ring that cannot run zig-zag, the imbalance — device `d` of `c` computes the `d` blocks
//! before its own and half of its own, so the last one runs `c − ½` blocks where an even split
//! would run `c / 2`.

use super::*;

/// The passes of one ring: how many rotate the keys and values, how many their gradients.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RingPasses {
    /// Passes of the keys and values.
    pub kv: usize,
    /// Passes of the keys' and values' gradients.
    pub grads: usize,
}

/// The passes op `op` runs over a ring of `c` devices: the forward rotates the keys and
/// values `c − 1` times; the gradient rotates them once for each row's log-sum-exp, again
/// beside the gradients, which pass `c` times (the last pass brings each block's gradient
/// home). `(forward, backward)`: a forward attention's backward is its gradient's.
pub fn ring_passes(op: &Op, c: usize) -> (RingPasses, RingPasses) {
    let c1 = c.saturating_sub(1);
    let grad = RingPasses { kv: 2 * c1, grads: c };
    match op {
        Op::AttentionGrad(_) => (grad, RingPasses { kv: 0, grads: 0 }),
        _ => (RingPasses { kv: c1, grads: 0 }, grad),
    }
}

/// The factor by which the busiest device's share of a ring attention exceeds an even
/// split's: `(2c − 1) / c` when causal without zig-zag load balancing (device `c − 1` runs
/// `c − ½` of the `c²/2` blocks' worth), 1 otherwise (every device the same share).
pub fn ring_imbalance(op: &Op, c: usize, zigzag: bool) -> f64 {
    let causal = ir::ops::flash::ring_mask(op).is_some_and(|(causal, _)| causal);
    if causal && !zigzag && c > 0 { (2 * c - 1) as f64 / c as f64 } else { 1.0 }
}

/// The extra work of a ring gradient: the ring recomputes the forward blocks for each row's
/// log-sum-exp (`QKᵀ` and `PV`) before the gradient's blocks (`QKᵀ` again, `dY·Vᵀ`, `Pᵀ·dY`,
/// `dS·K`, `dSᵀ·Q`) — `4·QK + 3·PV` — against what the op is priced at alone: a forward
/// attention's backward as flash attention runs it (`3·QK + 2·PV`), an `AttentionGrad`
/// computing the log-sum-exp itself (`4·QK + 2·PV`). Head sizes `d`, `dv`.
pub fn ring_grad_factor(op: &Op, d: f64, dv: f64) -> f64 {
    let alone = match op {
        Op::AttentionGrad(_) => 8.0 * d + 4.0 * dv,
        _ => 6.0 * d + 4.0 * dv,
    };
    if alone <= 0.0 { 1.0 } else { (8.0 * d + 6.0 * dv) / alone }
}

/// A point-to-point step over mesh axis `axis` (a ring of `c` devices) moving `moved` bytes
/// a device, taking `time` of which `latency` is the link's.
fn p2p_step(axis: usize, c: usize, moved: f64, latency: f64, time: f64) -> Step {
    Step { kind: CommKind::P2p, axes: vec![axis], group: c, bytes: moved, moved, moved_by_device: None, latency, time }
}

impl CostModel<'_> {
    /// Whether ring attention `n` over mesh axis `axis` runs zig-zag
    /// ([`ir::ops::flash::zigzag`]: causal, each device's rows halving).
    pub(super) fn ring_zigzag(&self, n: NodeId, axis: usize) -> bool {
        let node = self.g.node(n);
        let c = self.mesh.axes[axis].size;
        let causal = ir::ops::flash::ring_mask(&node.op).is_some_and(|(causal, _)| causal);
        let seq = node.input(0).and_then(|q| self.value_shape(q).0.get(2).copied()).unwrap_or(0).max(0) as usize;
        ir::ops::flash::zigzag(causal, seq / c.max(1), c)
    }

    /// The head sizes `(d, dv)` of attention `n` (4-D: the last dims of Q and V).
    pub(super) fn head_sizes(&self, n: NodeId) -> (f64, f64) {
        let node = self.g.node(n);
        let last = |j: usize| node.input(j).map_or(0.0, |v| self.value_shape(v).0.last().copied().unwrap_or(0) as f64);
        (last(0), last(2))
    }

    /// The ring's point-to-point steps, forward then backward, for op `n` over mesh axis
    /// `axis` with its inputs laid out as `ins`: each pass sends the local keys and values
    /// (or their gradients, as large) to the next device on the axis; its time is what the
    /// block of attention computed meanwhile does not hide.
    /// `f`: the devices the op's work divides over.
    pub(super) fn ring_steps(&self, n: NodeId, axis: usize, f: f64, ins: &[Option<Sharding>]) -> Vec<(Phase, Step)> {
        let node = self.g.node(n);
        let c = self.mesh.axes[axis].size;
        let moved = self.local_input(n, ins, 1) + self.local_input(n, ins, 2);
        if c < 2 || moved <= 0.0 {
            return Vec::new();
        }
        let (alpha, beta) = alpha_beta(self.cluster, self.mesh.axes[axis].level, 2, self.busy(), moved);
        let transfer = p2p(moved, alpha, beta);
        // One full block of keys: a `c`-th of the even split's share of the op (each device
        // computes `c` blocks), twice that under a causal mask (the even share averages
        // half-masked blocks).
        let cost = &self.costs[&n];
        let zigzag = self.ring_zigzag(n, axis);
        let causal = if ring_imbalance(&node.op, c, zigzag) > 1.0 { 2.0 } else { 1.0 };
        let block = cost.fwd_flops / f.max(1.0) / c as f64 * causal;
        let eff = match self.cluster.device.attention_efficiency {
            [f, _] if f > 0.0 => f,
            _ => self.cluster.device.efficiency,
        };
        let hidden = |work: f64| self.roofline_at(work, 0.0, eff);
        let step = |exposed: f64| p2p_step(axis, c, moved, alpha, exposed.max(alpha));
        let (fwd, bwd) = ring_passes(&node.op, c);
        let mut out = Vec::new();
        for (phase, passes, per_block) in [(Phase::Forward, fwd, block), (Phase::Backward, bwd, 2.5 * block)] {
            let exposed = (transfer - hidden(per_block)).max(0.0);
            out.extend(std::iter::repeat_n((phase, step(exposed)), passes.kv + passes.grads));
        }
        if zigzag {
            out.extend(self.zigzag_moves(n, axis, ins));
        }
        out
    }

    /// The zig-zag's moves of op `n`'s tensors into the ring's chunks and of its results
    /// back (codegen/src/lower/ring.rs), forward then backward, as the busiest device sends
    /// them: exposed, nothing computed meanwhile.
    fn zigzag_moves(&self, n: NodeId, axis: usize, ins: &[Option<Sharding>]) -> Vec<(Phase, Step)> {
        let c = self.mesh.axes[axis].size;
        let (q, k, v) = (self.local_input(n, ins, 0), self.local_input(n, ins, 1), self.local_input(n, ins, 2));
        let (d, dv) = self.head_sizes(n);
        let y = if d > 0.0 { q * dv / d } else { q };
        // (tensors moved in, results moved out) of the forward and of the gradient.
        let forward = (q + k + v, y);
        let gradient = (q + k + v + 2.0 * y, q + k + v);
        let phases = match self.g.node(n).op {
            Op::AttentionGrad(_) => vec![(Phase::Forward, gradient)],
            _ => vec![(Phase::Forward, forward), (Phase::Backward, gradient)],
        };
        let level = self.mesh.axes[axis].level;
        phases
            .into_iter()
            .map(|(phase, (into, out))| {
                let moved = (0..c)
                    .map(|dev| {
                        let (i, o) = ir::ops::flash::zigzag_sends(dev, c);
                        (i as f64 * into + o as f64 * out) / 2.0
                    })
                    .fold(0.0, f64::max);
                let (alpha, beta) = alpha_beta(self.cluster, level, 2, self.busy(), moved);
                (phase, p2p_step(axis, c, moved, alpha, p2p(moved, alpha, beta)))
            })
            .collect()
    }

    /// The bytes of input `j` of op `n` on one device with its inputs laid out as `ins`.
    fn local_input(&self, n: NodeId, ins: &[Option<Sharding>], j: usize) -> f64 {
        match (self.g.node(n).input(j), ins.get(j)) {
            (Some(v), Some(Some(layout))) => self.value_bytes(v) / split_factor(layout, &self.mesh),
            _ => 0.0,
        }
    }

    /// The buffers ring attention holds beyond the op's outputs under `strategy` (0 unless it
    /// splits the sequence), bytes on one device for a micro-batch of `1/k` of the batch: the
    /// keys and values received while the held ones are in use (forward); those and the
    /// running sums of their gradients, sent on as they are received, and the query rows'
    /// gradient summed over the blocks (`backward`, or the gradient op itself).
    pub(super) fn ring_scratch(&self, n: NodeId, strategy: &[Option<usize>], backward: bool, k: f64) -> f64 {
        let op = &self.g.node(n).op;
        let sp = self.space(n);
        if ir::ops::flash::ring_mask(op).is_none()
            || !matches!(split_mode(self.g, n, sp, strategy, &self.mesh), Ok(SplitMode::Ring { .. }))
        {
            return 0.0;
        }
        let (ins, _) = ir::shard::strategy_shardings(sp, strategy);
        let local = |j: usize| self.local_input(n, &ins, j) / k.max(1.0);
        let kv = local(1) + local(2);
        if backward || matches!(op, Op::AttentionGrad(_)) { 4.0 * kv + local(0) } else { 2.0 * kv }
    }
}
