//! Activation recomputation in a training graph: the forward ops whose outputs the backward
//! pass would read from the stash run again inside the backward pass, just before their first
//! backward reader, and the backward pass reads the copies — so the originals die at their
//! last forward reader and the peak falls as the cost model prices it
//! ([`crate::cost::stash`]: the same regions, `selective` the attention cores, `full` each
//! repeated block).
//!
//! The copies carry [`ir::train::grad_of`] naming the op they copy, so they run in its
//! pipeline stage, on the axes it splits over, in the backward phase; their outputs are named
//! `<name>__recompute`. The graph is renumbered so that the runtime's order (oldest ready
//! node first) is the one written here.

use std::collections::{HashMap, HashSet};

use ir::{Graph, NodeId, Output, Value};

use crate::cost::stash::{Recompute, Stash, backward_reads};
use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// The pass: recomputes `mode`'s regions of a training graph.
#[derive(Clone, Debug, Default)]
pub struct Rematerialize {
    /// The granularity.
    pub mode: Recompute,
}

const NAME: &str = "recompute";

impl Pass for Rematerialize {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let copied =
            recompute(g, self.mode).map_err(|e| PassError { pass: NAME.into(), errors: vec![Located::global(e)] })?;
        cx.stats.add("ops recomputed", copied as u64);
        Ok(if copied > 0 { Changed::Yes } else { Changed::No })
    }
}

/// Rewrites training graph `g` to recompute `mode`'s regions in the backward pass; returns
/// the ops copied.
pub fn recompute(g: &mut Graph, mode: Recompute) -> Result<usize, String> {
    if mode == Recompute::None {
        return Ok(0);
    }
    let order = g.op_nodes().map_err(|_| "the training graph has a cycle".to_string())?;
    let (backward, read) = backward_reads(g, &order);
    if backward.is_empty() {
        return Err("not a training graph: recomputation needs the autodiff pass's backward pass".into());
    }
    let forward: Vec<NodeId> = order.iter().copied().filter(|n| !backward.contains(n)).collect();
    let stash = Stash::new(g, &forward, &read, mode);
    if let Some(n) = stash.region_ops.iter().flatten().find(|&&n| !g.node(n).captures().is_empty()) {
        return Err(format!("recomputation does not copy control flow yet ({})", g.describe(*n)));
    }
    let all = g.topo_order().map_err(|_| "the training graph has a cycle".to_string())?;
    // Copy each region's ops; `copy_of` maps an original op to its copy.
    let mut copy_of: HashMap<NodeId, NodeId> = HashMap::new();
    let mut region_of: HashMap<NodeId, usize> = HashMap::new();
    for (r, ops) in stash.region_ops.iter().enumerate() {
        // A copy reads the copies of its own region; what it reads from outside (the block's
        // input, Q and K) is the original, kept.
        let mut local: HashMap<NodeId, NodeId> = HashMap::new();
        for &n in ops {
            let c = copy_op(g, n, &local);
            local.insert(n, c);
            region_of.insert(c, r);
        }
        copy_of.extend(local);
    }
    // The backward pass reads the copies.
    for &b in all.iter().filter(|n| backward.contains(n)) {
        let inputs = reading_copies(g.node(b).inputs(), &copy_of);
        if inputs.as_slice() != g.node(b).inputs() {
            g.set_inputs(b, inputs);
        }
    }
    // Each region's copies just before its first backward reader.
    let mut placed: HashSet<usize> = HashSet::new();
    let mut new_order: Vec<NodeId> = Vec::with_capacity(all.len() + copy_of.len());
    // Sources first: a copy may read a constant the original order meets late.
    let source = |n: &NodeId| g.node(*n).op.class() == ir::OpClass::Source;
    new_order.extend(all.iter().copied().filter(source));
    for &n in all.iter().filter(|n| !source(n)) {
        if backward.contains(&n) {
            for v in g.node(n).inputs().iter().flatten() {
                if let Some(&r) = region_of.get(&v.node)
                    && placed.insert(r)
                {
                    new_order.extend(stash.region_ops[r].iter().map(|o| copy_of[o]));
                }
            }
        }
        new_order.push(n);
    }
    *g = g.reordered(&new_order).ok_or("recomputation: the copies do not fit the graph's order")?;
    Ok(copy_of.len())
}

/// `inputs` with each value of an op in `copy_of` read from its copy instead.
fn reading_copies(inputs: &[Option<Value>], copy_of: &HashMap<NodeId, NodeId>) -> Vec<Option<Value>> {
    inputs.iter().map(|i| i.map(|v| copy_of.get(&v.node).map_or(v, |c| Value::new(*c, v.slot)))).collect()
}

/// Adds a copy of op `n` reading the copies in `copy_of` where it read their originals.
fn copy_op(g: &mut Graph, n: NodeId, copy_of: &HashMap<NodeId, NodeId>) -> NodeId {
    let node = g.node(n).clone();
    let inputs = reading_copies(node.inputs(), copy_of);
    let outputs: Vec<Output> = node
        .outputs()
        .iter()
        .map(|o| {
            let mut c = o.clone();
            if !o.name.is_empty() {
                c.name = g.fresh_name(&format!("{}__recompute", o.name));
            }
            c
        })
        .collect();
    let key = node.outputs().first().map(|o| o.name.clone()).unwrap_or_default();
    let c = g.add_node(node.op.clone(), inputs, outputs);
    g.set_label(c, node.label.as_ref().map(|l| format!("{l}/recompute")));
    for (k, v) in &node.annotations {
        g.set_annotation(c, k.clone(), v.clone());
    }
    if !key.is_empty() {
        ir::train::set_grad_of(g, c, &key);
    }
    c
}
