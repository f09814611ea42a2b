//! What a program will hold in memory, before it runs: the guard that refuses a run the
//! host or the devices cannot hold, instead of letting an allocation abort the process.

use std::collections::HashSet;

use ir::op::Op;
use ir::{Graph, Value};

use crate::program::{DeviceProgram, Program};

/// Bytes a graph holds at its peak when run op by op in topological order: every
/// initializer and input for the whole run, each op's outputs from the op until their last
/// reader (kept to the end when in `keep` or a graph output). An estimate of what the
/// runtime allocates: views that share storage are counted as copies, so it errs high.
/// A collective also holds, while it runs, the pieces the ring moves ([`staging_bytes`]).
/// `None` when a size is unknown or overflows 64 bits.
pub fn peak_bytes(g: &Graph, keep: &HashSet<Value>) -> Option<u64> {
    let order = g.topo_order().ok()?;
    let size = |v: Value| -> Option<u64> { g.tensor_type(v).map_or(Some(0), |t| t.size_bytes()) };
    let last_use = g.last_uses(&order);
    // Weights and inputs stay for the whole run.
    let fixed = |n: ir::NodeId| matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef);
    let outputs: HashSet<Value> = g.outputs().iter().map(|o| o.value).collect();
    let mut live: u64 = 0;
    let mut peak: u64 = 0;
    for (i, &n) in order.iter().enumerate() {
        let node = g.node(n);
        for slot in 0..node.num_outputs() {
            live = live.checked_add(size(Value::new(n, slot as u16))?)?;
        }
        let operand = node.input(0).map_or(Some(0), size)?;
        peak = peak.max(live.checked_add(staging_bytes(&node.op, operand))?);
        if fixed(n) {
            continue;
        }
        for v in node.inputs().iter().flatten() {
            if last_use.get(v) == Some(&i) && !fixed(v.node) && !keep.contains(v) && !outputs.contains(v) {
                live = live.saturating_sub(size(*v)?);
            }
        }
        for slot in 0..node.num_outputs() {
            let v = Value::new(n, slot as u16);
            if !last_use.contains_key(&v) && !outputs.contains(&v) && !keep.contains(&v) {
                live = live.saturating_sub(size(v)?);
            }
        }
    }
    Some(peak)
}

/// What a collective over `operand` bytes holds beside its operand and result while it runs
/// on the host's rings (`runtime::hub`): a reduce-scatter the piece it sends on and the piece
/// it receives (each `1/p` of the operand); an all-gather the members' pieces it joins (its
/// result's size); an all-reduce both, its chunks being the operand's size; an all-to-all the
/// pieces it sends and receives. Point-to-point messages and halos hold their one array.
pub fn staging_bytes(op: &Op, operand: u64) -> u64 {
    let members = |g: &Option<Vec<i64>>| g.as_ref().map_or(1, |g| g.len().max(1)) as u64;
    match op {
        Op::ReduceScatter(c) if members(&c.group) > 1 => 2 * operand / members(&c.group),
        Op::AllGather(c) if members(&c.group) > 1 => operand * members(&c.group),
        Op::AllReduce(c) if members(&c.group) > 1 => operand + 2 * operand / members(&c.group),
        Op::AllToAll(c) if members(&c.group) > 1 => operand,
        _ => 0,
    }
}

impl DeviceProgram {
    /// [`peak_bytes`] of this device's graph, its results kept.
    pub fn peak_bytes(&self) -> Option<u64> {
        let keep: HashSet<Value> = self.results.iter().filter_map(|r| self.graph.lookup(&r.local)).collect();
        peak_bytes(&self.graph, &keep)
    }

    /// The largest single tensor of this device's graph, bytes (what one buffer must hold).
    pub fn largest_tensor_bytes(&self) -> Option<u64> {
        let g = &self.graph;
        let mut most = 0;
        for n in g.node_ids() {
            for slot in 0..g.node(n).num_outputs() {
                let b = g.tensor_type(Value::new(n, slot as u16)).map_or(Some(0), |t| t.size_bytes())?;
                most = most.max(b);
            }
        }
        Some(most)
    }
}

impl Program {
    /// Each device's [`DeviceProgram::peak_bytes`].
    pub fn peak_bytes(&self) -> Vec<Option<u64>> {
        self.devices.iter().map(DeviceProgram::peak_bytes).collect()
    }
}
