//! What a training step keeps of its forward pass for the backward pass, and what activation
//! recomputation keeps instead.
//!
//! The stash is read off the training graph the autodiff pass writes for the model: a forward
//! value is kept when a backward op reads it (a view's storage is its source's). That is the
//! liveness the training program has, op by op, so an op that the backward needs nothing of
//! (a bias add, a residual add, a scale by a constant) keeps nothing.
//!
//! Recomputation trades compute for that memory, in the granularities Megatron-LM names:
//! - `selective` recomputes the attention core: from the output of a product of two
//!   activations (`Q·Kᵀ`) through the ops that follow it on activations and constants alone
//!   (scale, mask, softmax, dropout) up to the next such product (`·V`), which reads the
//!   recomputed probabilities; the `s × s` tensors are not kept (Korthikanti et al. 2022, §5).
//! - `op` is torchtitan's op-level selective policy (`selective_ac_option = "op"`): each
//!   repeated block keeps its inputs and the outputs of every other linear-layer product
//!   (torch's `mm`: a contraction of one activation with weights; the first, third, … of the
//!   block) and of its other matrix-unit ops but products of two activations (fused attention,
//!   experts); everything else in the block (norms, rotations, activation functions,
//!   `Q·Kᵀ` and softmax when attention is not fused) runs again inside the backward pass.
//! - `full` keeps only each repeated block's inputs (the exporter's module blocks,
//!   [`ir::scope::block_of`]: `transformer.h.7`, `layer.3`) and runs the block's forward
//!   again, one block at a time, inside the backward pass.
//!
//! Either way a region's recomputed values live again while its backward runs: the peak adds
//! the largest region's.

use std::collections::{HashMap, HashSet};

use ir::{Graph, NodeId, Op, OpClass, Value};
use serde::Serialize;

/// Activation recomputation granularity, ordered by the memory it saves.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep everything the backward pass reads.
    #[default]
    None,
    /// Recompute the attention core (scores, softmax, dropout).
    Selective,
    /// torchtitan's op-level policy: keep each block's input and every other linear layer's
    /// output (and fused attention's); recompute the rest of the block.
    Op,
    /// Keep only each block's inputs; recompute the block.
    Full,
}

impl Recompute {
    /// Parses `none`, `selective`, `op`, `full`.
    pub fn parse(s: &str) -> Result<Recompute, String> {
        Ok(match s {
            "none" | "off" => Recompute::None,
            "selective" => Recompute::Selective,
            "op" => Recompute::Op,
            "full" => Recompute::Full,
            _ => return Err(format!("unknown recomputation `{s}`: write none, selective, op or full")),
        })
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Op => "op",
            Recompute::Full => "full",
        }
    }
}

/// The stash of a forward graph under one recomputation granularity.
#[derive(Clone, Debug, Default)]
pub struct Stash {
    /// The values kept from the forward pass to the backward pass (storage roots: no view
    /// outputs).
    pub kept: HashSet<Value>,
    /// Ops whose forward runs again in the backward pass.
    pub recomputed: HashSet<NodeId>,
    /// The regions recomputed one at a time: the values each holds again while its backward
    /// runs.
    pub regions: Vec<Vec<Value>>,
    /// Per region, the ops run again, in the forward order.
    pub region_ops: Vec<Vec<NodeId>>,
}

/// The forward values (storage roots) the backward pass of `g` reads, from the training graph
/// the autodiff pass writes for it ([`crate::autodiff::gradients`]; the loss: the mean of its
/// first output); `None` when the
/// model cannot be differentiated (an op with no gradient rule, no float output).
pub fn saved_values(g: &Graph) -> Option<HashSet<Value>> {
    use crate::autodiff::{LossSpec, gradients};
    let mut t = g.clone();
    let first = g.outputs().first().map(|o| g.value_name(o.value).to_string())?;
    gradients(&mut t, &LossSpec::Mean(Some(first)), &mut Vec::new()).ok()?;
    let order = t.op_nodes().ok()?;
    let (_, read) = backward_reads(&t, &order);
    // The forward graph's nodes keep their ids in `t` (freed ids may be reused by new ones).
    Some(read.into_iter().filter(|v| g.contains(v.node)).map(|v| storage_root(g, v)).collect())
}

/// In training graph `t` (ops in topological `order`): its backward ops — the gradient ops
/// the autodiff pass annotates ([`ir::train::grad_of`]) and every op downstream of one
/// (sums of gradients, updates) — and the forward values they read (computed ones: no
/// inputs, initializers or host-side shape values).
pub fn backward_reads(t: &Graph, order: &[NodeId]) -> (HashSet<NodeId>, HashSet<Value>) {
    let mut backward: HashSet<NodeId> = HashSet::new();
    let mut read = HashSet::new();
    for &n in order {
        let node = t.node(n);
        let grad = ir::train::grad_of(t, n).is_some();
        if !(grad || node.inputs().iter().flatten().any(|v| backward.contains(&v.node))) {
            continue;
        }
        backward.insert(n);
        for v in node.inputs().iter().flatten() {
            if !backward.contains(&v.node) && computes(&t.node(v.node).op) {
                read.insert(*v);
            }
        }
    }
    (backward, read)
}

/// A value's storage: a view's is its source's.
pub fn storage_root(g: &Graph, mut v: Value) -> Value {
    while super::model::is_view(&g.node(v.node).op) {
        match g.node(v.node).input(0) {
            Some(src) => v = src,
            None => break,
        }
    }
    v
}

/// An op that makes a value on a device (not a graph input, an initializer or a host-side
/// shape computation).
fn computes(op: &Op) -> bool {
    !super::model::is_host(op)
}

impl Stash {
    /// The stash of `g` (in topological `order`) whose backward reads `saved`, under `mode`.
    pub fn new(g: &Graph, order: &[NodeId], saved: &HashSet<Value>, mode: Recompute) -> Stash {
        let mut s = Stash { kept: saved.clone(), ..Stash::default() };
        if mode == Recompute::None {
            return s;
        }
        // Values of parameters and constants alone (a step counter) are not activations.
        let act = activations(g, order);
        let groups = match mode {
            Recompute::Selective => attention_cores(g, order, &act),
            _ => blocks(g, order),
        };
        let mut checkpoints: HashSet<Value> = HashSet::new();
        for ops in groups {
            let mut inside: HashSet<NodeId> = ops.iter().copied().filter(|n| act.contains(n)).collect();
            if mode == Recompute::Op {
                // The policy's outputs are kept whether the backward reads them or not (torch
                // stores each as it is made); recomputation reads them as it reads the input.
                let keep = op_policy(g, &ops, &act);
                inside.retain(|n| !keep.contains(n));
                checkpoints.extend(keep.iter().map(|&n| storage_root(g, Value::new(n, 0))));
            }
            let mut again: Vec<Value> = saved.iter().copied().filter(|v| inside.contains(&v.node)).collect();
            if again.is_empty() {
                continue;
            }
            let ops_again = ancestors_within(g, &inside, &again);
            s.region_ops.push(ops.iter().copied().filter(|n| ops_again.contains(n)).collect());
            s.recomputed.extend(ops_again);
            for &n in &inside {
                for v in g.node(n).inputs().iter().flatten() {
                    if !inside.contains(&v.node) && computes(&g.node(v.node).op) {
                        checkpoints.insert(storage_root(g, *v));
                    }
                }
            }
            again.sort();
            s.regions.push(again);
        }
        s.kept.retain(|v| !s.recomputed.contains(&v.node));
        s.kept.extend(checkpoints);
        s
    }

    /// The largest region's recomputed bytes: what lives again while its backward runs.
    pub fn transient_bytes(&self, bytes: &dyn Fn(Value) -> f64) -> f64 {
        self.regions.iter().map(|r| r.iter().map(|&v| bytes(v)).sum::<f64>()).fold(0.0, f64::max)
    }
}

/// The ops in `inside` that `targets` are computed from, through ops in `inside`.
fn ancestors_within(g: &Graph, inside: &HashSet<NodeId>, targets: &[Value]) -> HashSet<NodeId> {
    let mut seen: HashSet<NodeId> = HashSet::new();
    let mut stack: Vec<NodeId> = targets.iter().map(|v| v.node).collect();
    while let Some(n) = stack.pop() {
        if !inside.contains(&n) || !seen.insert(n) {
            continue;
        }
        stack.extend(g.node(n).inputs().iter().flatten().map(|v| v.node));
    }
    seen
}

/// Values computed from the graph's data inputs (not from parameters and constants alone).
fn activations(g: &Graph, order: &[NodeId]) -> HashSet<NodeId> {
    let mut act: HashSet<NodeId> = g
        .input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .map(|v| v.node)
        .collect();
    for &n in order {
        if g.node(n).inputs().iter().flatten().any(|v| act.contains(&v.node)) {
            act.insert(n);
        }
    }
    act
}

/// torchtitan's op-level policy over one block's `ops` (in order): the ops whose outputs it
/// keeps — every other linear-layer product (a contraction of one activation with weights,
/// torch's `mm`; the first, third, … in the block) and every other op on the matrix units but
/// products of two activations (`Q·Kᵀ`, `·V`: torch's `bmm`, recomputed).
fn op_policy(g: &Graph, ops: &[NodeId], act: &HashSet<NodeId>) -> HashSet<NodeId> {
    let mut linear = 0usize;
    let mut keep = HashSet::new();
    for &n in ops {
        let node = g.node(n);
        if !act.contains(&n) || !node.op.rules().matrix_units() {
            continue;
        }
        if node.op.class() == OpClass::Contraction {
            if node.inputs().iter().flatten().filter(|v| act.contains(&v.node)).count() >= 2 {
                continue;
            }
            linear += 1;
            if linear.is_multiple_of(2) {
                continue;
            }
        }
        keep.insert(n);
    }
    keep
}

/// The attention cores of `g`: each from a product of two activations (`Q·Kᵀ`) through the
/// ops that follow it on activations of the core and constants alone, to (not including) the
/// next product (`·V`), which ends the core rather than starting another.
fn attention_cores(g: &Graph, order: &[NodeId], act: &HashSet<NodeId>) -> Vec<Vec<NodeId>> {
    let product = |n: NodeId| {
        let node = g.node(n);
        node.op.class() == OpClass::Contraction
            && node.inputs().iter().flatten().filter(|v| act.contains(&v.node)).count() >= 2
    };
    let mut core_of: HashMap<NodeId, usize> = HashMap::new();
    let mut cores: Vec<Vec<NodeId>> = Vec::new();
    for &n in order {
        let node = g.node(n);
        let reads_core = node.inputs().iter().flatten().any(|v| core_of.contains_key(&v.node));
        if product(n) && !reads_core {
            core_of.insert(n, cores.len());
            cores.push(vec![n]);
            continue;
        }
        if node.op.class() == OpClass::Contraction || !act.contains(&n) {
            continue;
        }
        let mut from: Option<usize> = None;
        let mut only_core = true;
        for v in node.inputs().iter().flatten().filter(|v| act.contains(&v.node)) {
            match (core_of.get(&v.node), from) {
                (Some(&c), None) => from = Some(c),
                (Some(&c), Some(f)) if c == f => {}
                _ => only_core = false,
            }
        }
        if let (Some(c), true) = (from, only_core) {
            core_of.insert(n, c);
            cores[c].push(n);
        }
    }
    cores
}

/// The ops of each repeated block ([`ir::scope::block_of`] of their module path), blocks in
/// order; ops outside any named block are in none.
fn blocks(g: &Graph, order: &[NodeId]) -> Vec<Vec<NodeId>> {
    let paths = ir::scope::module_paths_among(g, order);
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut out: Vec<Vec<NodeId>> = Vec::new();
    for &n in order {
        let block = paths.get(&n).map(|p| ir::scope::block_of(p)).unwrap_or_default();
        if block.is_empty() {
            continue;
        }
        let i = *index.entry(block).or_insert_with(|| {
            out.push(Vec::new());
            out.len() - 1
        });
        out[i].push(n);
    }
    out
}
