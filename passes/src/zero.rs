//! Gradients handed to their updates as soon as they are complete: the schedule ZeRO-2 and
//! ZeRO-3 need (`ir::reshard::ZeroLayouts`). In the autodiff pass's graph the ops that hand
//! each parameter's gradient to its update (the identity that is its gradient output, the
//! sum of a tied weight's gradients) come after the whole backward pass, so each device holds every
//! whole gradient until then. Run early, each gradient is reduce-scattered into the shard its
//! update runs on while the backward pass goes on (DeepSpeed's ZeRO-2 buckets), and the
//! whole gradient dies there; the updates stay at the end, where the backward pass has freed
//! its activations.
//!
//! The hand-offs (gradient-phase ops, [`ir::reshard::step_phases`], other than the updates
//! and what reads their results) move to the first point where their inputs are ready. The
//! graph is renumbered so that the runtime's order (oldest ready node first) is the one
//! written here; what each op computes is unchanged.

use std::collections::HashSet;

use ir::reshard::Phase;
use ir::{Graph, NodeId, Op, Value};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// The pass: gradients handed to their updates as early as they are complete.
#[derive(Clone, Debug, Default)]
pub struct EarlyGradients;

const NAME: &str = "early-gradients";

impl Pass for EarlyGradients {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let moved =
            early_gradients(g).map_err(|e| PassError { pass: NAME.into(), errors: vec![Located::global(e)] })?;
        cx.stats.add("ops moved", moved as u64);
        Ok(if moved > 0 { Changed::Yes } else { Changed::No })
    }
}

/// Whether `n` hands a gradient to its update: a gradient-phase op that is no update and
/// reads none's result.
fn hands_off(g: &Graph, phases: &std::collections::HashMap<NodeId, Phase>, n: NodeId) -> bool {
    let update = |m: NodeId| g.node(m).op.is_update();
    phases.get(&n) == Some(&Phase::Gradient)
        && !update(n)
        && !g.node(n).inputs().iter().flatten().any(|v| update(v.node))
}

/// Work state: the order being written.
struct Order<'g> {
    g: &'g Graph,
    eager: HashSet<NodeId>,
    constant: HashSet<NodeId>,
    placed: HashSet<NodeId>,
    out: Vec<NodeId>,
}

impl Order<'_> {
    /// Whether every input of `n` is placed or can be pulled (computed from constants).
    fn ready(&self, n: NodeId) -> bool {
        self.g
            .node(n)
            .inputs()
            .iter()
            .flatten()
            .all(|v| self.placed.contains(&v.node) || self.constant.contains(&v.node))
    }

    /// Places `n` after what it reads, then the hand-offs this makes ready.
    fn place(&mut self, n: NodeId) {
        if self.placed.contains(&n) {
            return;
        }
        let inputs: Vec<NodeId> = self.g.node(n).inputs().iter().flatten().map(|v| v.node).collect();
        for p in inputs {
            self.place(p);
        }
        // (Placing an input may have placed `n`, a hand-off it made ready.)
        if !self.placed.insert(n) {
            return;
        }
        self.out.push(n);
        let g = self.g;
        let readers: Vec<NodeId> = (0..g.node(n).num_outputs())
            .flat_map(|s| g.users(Value::new(n, s as u16)))
            .map(|(r, _)| r)
            .filter(|r| self.eager.contains(r))
            .collect();
        for r in readers {
            if !self.placed.contains(&r) && self.ready(r) {
                self.place(r);
            }
        }
    }
}

/// Renumbers training graph `g` so that the ops handing gradients to their updates run as
/// soon as their inputs are ready; returns how many ops now run earlier than before.
pub fn early_gradients(g: &mut Graph) -> Result<usize, String> {
    let cycle = || "the training graph has a cycle".to_string();
    let ops = g.op_nodes().map_err(|_| cycle())?;
    let phases = ir::reshard::step_phases(g, &ops).ok_or("not a training graph: it updates no parameter")?;
    let all = g.topo_order().map_err(|_| cycle())?;
    let mut o = Order {
        g,
        eager: ops.iter().copied().filter(|&n| hands_off(g, &phases, n)).collect(),
        constant: ir::reshard::computed_everywhere(g, &ops),
        placed: HashSet::new(),
        out: Vec::with_capacity(all.len()),
    };
    for &n in &all {
        let source = matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef);
        if source || !o.eager.contains(&n) {
            o.place(n);
        }
    }
    for &n in &all {
        o.place(n);
    }
    let was: std::collections::HashMap<NodeId, usize> = all.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let moved = o.out.iter().enumerate().filter(|&(i, n)| i < was[n] && o.eager.contains(n)).count();
    if moved > 0 {
        *g = g.reordered(&o.out).ok_or_else(|| "the new order does not hold every node once".to_string())?;
    }
    Ok(moved)
}
