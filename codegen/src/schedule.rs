//! Pipeline schedules: the order in which a device runs the parts of its program over the
//! micro-batches of a step. The runtime runs this order and the checker simulates it, so a
//! schedule that could deadlock is refused before it runs.
//!
//! A device's program is cut in three:
//! - the **once-per-step** ops: under gradient accumulation, the optimizer updates, every op
//!   that reads what they compute and the receive of a tied weight's new value from the stage
//!   that updates it, run once after every micro-batch;
//! - the **backward** part: every op downstream of a tensor received from a later pipeline
//!   stage (the gradient flowing back). It reads the forward part's values of the same
//!   micro-batch (the activation stash);
//! - the **forward** part: the rest.
//!
//! The backward part is closed downstream, so each part reads only its own micro-batch's
//! earlier parts. Stage `s` of `S` then runs, for `m` micro-batches:
//! - GPipe: `F0 … F(m−1)`, then `B0 … B(m−1)`: every micro-batch's stash is live at once;
//! - 1F1B: `min(S−1−s, m)` forwards to fill the pipeline, then one forward and one backward
//!   in turn, then the remaining backwards: stage `s` holds at most `S − s` stashes.
//!
//! A stage without a backward part (the last stage, whose loss gradient it computes itself,
//! or an inference pipeline) runs each micro-batch whole, in order.
//!
//! Recomputation (per stage, as planned): after a micro-batch's forward part the device
//! keeps only what it received from the earlier stage and its inputs; before the backward
//! part it runs the forward part again (its collectives included, its sends and receives not).

use std::collections::HashSet;

use ir::{Graph, NodeId, Op, Value};
use serde::Serialize;

use crate::program::Program;

/// The order of forward and backward parts over the micro-batches.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub enum Schedule {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward in the steady state.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl Schedule {
    /// `gpipe` or `1f1b`.
    pub fn parse(s: &str) -> Option<Schedule> {
        match s {
            "gpipe" => Some(Schedule::GPipe),
            "1f1b" => Some(Schedule::OneFOneB),
            _ => None,
        }
    }

    /// The schedule's name.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }

    /// The parts stage `stage` of `stages` runs, in order, over `m` micro-batches; `split`:
    /// the stage's program has a backward part.
    pub fn items(self, stage: usize, stages: usize, m: usize, split: bool) -> Vec<(Part, usize)> {
        if !split {
            return (0..m).map(|k| (Part::Whole, k)).collect();
        }
        match self {
            Schedule::GPipe => (0..m).map(|k| (Part::Forward, k)).chain((0..m).map(|k| (Part::Backward, k))).collect(),
            Schedule::OneFOneB => {
                let warm = stages.saturating_sub(stage + 1).min(m);
                let mut out: Vec<(Part, usize)> = (0..warm).map(|k| (Part::Forward, k)).collect();
                for k in 0..m - warm {
                    out.push((Part::Forward, warm + k));
                    out.push((Part::Backward, k));
                }
                out.extend((m - warm..m).map(|k| (Part::Backward, k)));
                out
            }
        }
    }
}

/// A part of a device's program for one micro-batch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// The ops before the gradient arrives from the next stage.
    Forward,
    /// The ops downstream of it.
    Backward,
    /// Both (a stage without a backward part).
    Whole,
}

/// Whether a run accumulates gradients over micro-batches: a training step (`trains`: state
/// is carried between steps) over several micro-batches or several pipeline stages (whose
/// updates, and a tied weight's new value sent to another stage, wait for every backward
/// part).
pub fn accumulates(p: &Program, trains: bool) -> bool {
    trains && (p.micro_batches > 1 || p.stage_devices.len() > 1)
}

/// The ops run once per step under gradient accumulation, per device of `p`: the optimizer
/// updates, every op that reads what they compute, and a receive of what another device
/// sends from its once-per-step ops (the new value of a weight two stages hold).
pub fn once_ops(p: &Program) -> Vec<HashSet<NodeId>> {
    let orders: Vec<Vec<NodeId>> = p.devices.iter().map(|d| d.graph.op_nodes().unwrap_or_default()).collect();
    // (sender, receiver, tag) of the sends made once per step.
    let mut sent: HashSet<(usize, i64, i64)> = HashSet::new();
    loop {
        let mut out = Vec::with_capacity(p.devices.len());
        for (i, d) in p.devices.iter().enumerate() {
            let g = &d.graph;
            let mut once: HashSet<NodeId> = HashSet::new();
            for &n in &orders[i] {
                let node = g.node(n);
                let seed = match &node.op {
                    Op::SgdUpdate(_) | Op::AdamUpdate(_) => true,
                    Op::Recv(r) => sent.contains(&(r.peer.unwrap_or(-1) as usize, i as i64, r.tag())),
                    _ => false,
                };
                if seed || node.inputs().iter().flatten().any(|v| once.contains(&v.node)) {
                    once.insert(n);
                }
            }
            out.push(once);
        }
        let before = sent.len();
        for (i, d) in p.devices.iter().enumerate() {
            for &n in &out[i] {
                if let Op::Send(s) = &d.graph.node(n).op {
                    sent.insert((i, s.peer.unwrap_or(-1), s.tag()));
                }
            }
        }
        if sent.len() == before {
            return out;
        }
    }
}

/// One device's program cut for its schedule.
#[derive(Clone, Debug)]
pub struct Cut {
    /// Ops run once per step (empty without gradient accumulation).
    pub once: HashSet<NodeId>,
    /// Ops of the backward part.
    pub backward: HashSet<NodeId>,
    /// Its stage recomputes the forward part before the backward part.
    pub recompute: bool,
    /// The parts to run, in order.
    pub items: Vec<(Part, usize)>,
}

impl Cut {
    /// Cuts device `device`'s program of `p` (`order`: its graph's ops in topological
    /// order); `accumulate`: gradients are accumulated over the micro-batches.
    pub fn new(p: &Program, device: usize, order: &[NodeId], accumulate: bool) -> Cut {
        let d = &p.devices[device];
        let g = &d.graph;
        let once = if accumulate { once_ops(p).swap_remove(device) } else { HashSet::new() };
        let stage_of_device = |peer: i64| usize::try_from(peer).ok().and_then(|x| p.devices.get(x)).map(|x| x.stage);
        let mut backward: HashSet<NodeId> = HashSet::new();
        for &n in order.iter().filter(|n| !once.contains(n)) {
            let node = g.node(n);
            let from_later =
                matches!(&node.op, Op::Recv(r) if r.peer.and_then(stage_of_device).is_some_and(|s| s > d.stage));
            if from_later || node.inputs().iter().flatten().any(|v| backward.contains(&v.node)) {
                backward.insert(n);
            }
        }
        let m = p.micro_batches.max(1);
        let items = p.schedule.items(d.stage, p.stage_devices.len(), m, !backward.is_empty());
        Cut { once, recompute: p.recompute.get(d.stage).copied().unwrap_or(false), backward, items }
    }

    /// Whether op `n` runs in `part`.
    pub fn runs_in(&self, n: NodeId, part: Part) -> bool {
        !self.once.contains(&n)
            && match part {
                Part::Whole => true,
                Part::Forward => !self.backward.contains(&n),
                Part::Backward => self.backward.contains(&n),
            }
    }

    /// Whether `part` is the last of its micro-batch.
    pub fn finishes(part: Part) -> bool {
        part != Part::Forward
    }
}

/// Under recomputation, whether a value of a forward part is kept until its backward part:
/// what was received from another device (another stage's tensors, which are not sent again).
pub fn stashed(g: &Graph, v: Value) -> bool {
    matches!(g.node(v.node).op, Op::Recv(_))
}
