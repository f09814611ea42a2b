//! One device's program cut into the parts its pipeline schedule runs ([`crate::schedule`]
//! describes the parts and the orders): the once-per-step ops under gradient accumulation,
//! the backward part, the forward part, and the model chunk of each op.

use std::collections::{HashMap, HashSet};

use ir::{Graph, NodeId, Op, Value};

use crate::program::Program;
use crate::schedule::Order;
use crate::schedule::{Item, Part};

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
                    op if op.is_update() => true,
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

/// Per device of `p`, its ops run once per step: [`once_ops`] under gradient accumulation,
/// none without. Computed once for all devices (it follows sends between them).
pub fn once_per_device(p: &Program, accumulate: bool) -> Vec<HashSet<NodeId>> {
    if accumulate { once_ops(p) } else { vec![HashSet::new(); p.devices.len()] }
}

/// One device's program cut for its schedule.
#[derive(Clone, Debug)]
pub struct Cut {
    /// Ops run once per step (empty without gradient accumulation).
    pub once: HashSet<NodeId>,
    /// Ops of the backward parts.
    pub backward: HashSet<NodeId>,
    /// Per model chunk: its virtual stage recomputes the forward part before the backward part.
    pub recompute: Vec<bool>,
    /// The parts to run, in order.
    pub items: Vec<Item>,
    /// Per item: it is the last of its micro-batch.
    pub last: Vec<bool>,
    /// Per op of a device with several model chunks: its chunk (absent: 0).
    pub chunk_of: HashMap<NodeId, usize>,
}

impl Cut {
    /// Cuts device `device`'s program of `p` (`order`: its graph's ops in topological
    /// order); `accumulate`: gradients are accumulated over the micro-batches. The backward
    /// part is what is downstream of a receive from a later (virtual) stage, as the lowering
    /// marked them.
    /// `once`: the device's ops run once per step ([`once_per_device`]).
    pub fn new(p: &Program, device: usize, order: &[NodeId], once: HashSet<NodeId>) -> Cut {
        let d = &p.devices[device];
        let g = &d.graph;
        let mut backward: HashSet<NodeId> = HashSet::new();
        for &n in order.iter().filter(|n| !once.contains(n)) {
            if d.from_later.contains(&n) || g.node(n).inputs().iter().flatten().any(|v| backward.contains(&v.node)) {
                backward.insert(n);
            }
        }
        let m = p.micro_batches.max(1);
        let v = p.schedule.chunks();
        let stages = (p.stage_devices.len() / v).max(1);
        let items = p.schedule.items(d.stage, stages, m, !backward.is_empty());
        let last = (0..items.len()).map(|i| items[i + 1..].iter().all(|x| x.micro != items[i].micro)).collect();
        let recompute = (0..v).map(|c| p.recompute.get(c * stages + d.stage).copied().unwrap_or(false)).collect();
        Cut { once, recompute, backward, items, last, chunk_of: d.chunk_of.clone() }
    }

    /// The model chunk op `n` belongs to.
    pub fn chunk(&self, n: NodeId) -> usize {
        self.chunk_of.get(&n).copied().unwrap_or(0)
    }

    /// Whether a value is computed by an op of `chunk`.
    pub fn chunk_values(&self, chunk: usize) -> impl Fn(&Value) -> bool + '_ {
        move |v: &Value| self.chunk(v.node) == chunk
    }

    /// Whether op `n` runs in `part` of `chunk`.
    pub fn runs_in(&self, n: NodeId, part: Part, chunk: usize) -> bool {
        !self.once.contains(&n)
            && self.chunk(n) == chunk
            && match part {
                Part::Whole => true,
                Part::Forward => !self.backward.contains(&n),
                Part::Backward => self.backward.contains(&n),
            }
    }

    /// Whether ops `a` and `b` always run in the same part of the step (neither once per
    /// step, the same model chunk, both forward or both backward).
    pub fn same_part(&self, a: NodeId, b: NodeId) -> bool {
        !self.once.contains(&a)
            && !self.once.contains(&b)
            && self.chunk(a) == self.chunk(b)
            && self.backward.contains(&a) == self.backward.contains(&b)
    }

    /// Whether `chunk`'s virtual stage recomputes its forward part before its backward part.
    pub fn recomputes(&self, chunk: usize) -> bool {
        self.recompute.get(chunk).copied().unwrap_or(false)
    }

    /// Whether `item` recomputes its chunk's forward part first.
    pub fn reruns(&self, item: Item) -> bool {
        item.part == Part::Backward && self.recomputes(item.chunk)
    }

    /// Whether `item` is a forward part whose chunk recomputes (it keeps only what it received).
    pub fn drops(&self, item: Item) -> bool {
        item.part == Part::Forward && self.recomputes(item.chunk)
    }
}

/// Under recomputation, whether a value of a forward part is kept until its backward part:
/// what was received from another device (another stage's tensors, which are not sent again).
pub fn stashed(g: &Graph, v: Value) -> bool {
    matches!(g.node(v.node).op, Op::Recv(_))
}
