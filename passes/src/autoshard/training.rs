//! The strategies of a training graph from the plan of its forward model.
//!
//! The search prices a forward model as a whole training step (forward, backward, gradient
//! synchronisation, update), so it runs on the forward model. The training graph that
//! executes the step holds the same forward ops plus the backward, loss and update ops the
//! autodiff pass wrote. [`derive`] keeps the plan's strategy on every forward op and runs
//! the rest as the cost model priced the step:
//! - the backward ops of a forward op (annotated [`ir::train::grad_of`]) on no mesh
//!   axes but those that op splits over — replicated where it is replicated — the way that
//!   takes the least time, compute and resharding of the forward layouts together (ties: the
//!   least resharding): the dual of its strategy where that is cheapest (data parallelism's
//!   weight gradients as partial sums over the batch, a column-parallel GEMM's input gradient
//!   as partial sums over its features, a channel-split convolution's gradients by channels);
//! - every optimizer update on the shard of the parameter it updates, so gradients are
//!   synchronised into the parameter's layout and nothing is gathered after the update (under
//!   ZeRO and without pipeline stages, on its share of a parameter held whole over the
//!   data-parallel axes, as the named strategies run it);
//! - the other ops (gradient sums, the loss and its gradient when the loss was appended) with
//!   the least compute plus resharding on the edges around them — first greedily in
//!   topological order, then op by op against their inputs' and readers' layouts.
//!
//! Pipelines ([`stages`]): a backward op runs in its forward op's stage, so the gradient flows
//! back through the stages the activations came forward through; an optimizer update runs
//! where its gradient is, the loss where its input is; each stage's ops are then derived on
//! that stage's mesh ([`derive_stage`]).
//!
//! Resharding is priced by the cost model's algebra, the one the lowering emits; a value read
//! in a layout it was already brought to (by a forward op) costs nothing more.

use std::collections::{HashMap, HashSet};

use ir::shard::{OpStrategy, Sharding, strategy_shardings, strategy_valid};
use ir::{Graph, NodeId, Value};

use crate::cost::{Assignment, CostModel};

/// Rounds of op-by-op improvement after the greedy pass.
const ROUNDS: usize = 4;

/// Resharding seconds, compute seconds, collective steps.
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    comm: f64,
    compute: f64,
    steps: usize,
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        self.comm += o.comm;
        self.compute += o.compute;
        self.steps += o.steps;
    }
}

/// `a < b` beyond rounding; `None` when equal within it.
fn less(a: f64, b: f64) -> Option<bool> {
    let tol = 1e-9 * a.abs().max(b.abs());
    ((a - b).abs() > tol).then_some(a < b)
}

impl Cost {
    /// Less time (or, for a backward op, less resharding, then less compute); then fewer
    /// collective steps (an all-reduce beats a reduce-scatter and an all-gather of the same
    /// bytes).
    fn better(&self, o: &Cost, backward: bool) -> bool {
        let order = if backward {
            less(self.comm, o.comm).or_else(|| less(self.compute, o.compute))
        } else {
            less(self.comm + self.compute, o.comm + o.compute)
        };
        order.unwrap_or(self.steps < o.steps)
    }

    /// Less time in all, then (for a backward op) less resharding; then fewer steps.
    fn faster(&self, o: &Cost, backward: bool) -> bool {
        less(self.comm + self.compute, o.comm + o.compute).unwrap_or_else(|| self.better(o, backward))
    }
}

/// Work state of [`derive`].
struct Derive<'a, 'g> {
    cm: &'a CostModel<'g>,
    /// Per op: its strategy.
    chosen: HashMap<NodeId, OpStrategy>,
    /// Per op: the strategies it may take (one for pinned ops).
    cands: HashMap<NodeId, Vec<OpStrategy>>,
    /// Layouts sources (parameters, optimizer state, inputs) are held in: their first
    /// reader's.
    held: HashMap<Value, Sharding>,
    /// Carried state: output → the state it replaces.
    carried: HashMap<Value, Value>,
    /// Backward ops of forward ops with a strategy.
    backward: std::collections::HashSet<NodeId>,
    /// Layouts each value has been brought to by the forward plan's ops.
    materialized: HashMap<Value, Vec<Sharding>>,
}

impl Derive<'_, '_> {
    fn sh(&self, n: NodeId, s: &OpStrategy) -> (Vec<Option<Sharding>>, Vec<Sharding>) {
        strategy_shardings(self.cm.space(n), s)
    }

    /// The layout value `v` is in, if it is produced by an op with a strategy or held.
    fn layout_of(&self, v: Value) -> Option<Sharding> {
        match self.chosen.get(&v.node) {
            Some(s) => self.sh(v.node, s).1.get(v.slot as usize).cloned(),
            None => self.held.get(&v).cloned(),
        }
    }

    /// Seconds and collective steps of a resharding.
    fn reshard(&self, v: Value, from: &Sharding, to: &Sharding) -> Cost {
        if from == to {
            return Cost::default();
        }
        let steps = self.cm.reshard(v, from, to, 1.0);
        Cost {
            comm: crate::cost::collective::total(&steps),
            compute: self.cm.reshard_local(v, from, to),
            steps: steps.iter().filter(|s| s.time > 0.0).count(),
        }
    }

    /// Compute of `n` under `s` plus resharding into it, and — with `readers` — out of it
    /// to its readers' current layouts (each layout once) and to carried state's layout.
    fn cost(&self, n: NodeId, s: &OpStrategy, readers: bool) -> Cost {
        let g = self.cm.g;
        let (ins, outs) = self.sh(n, s);
        let t = self.cm.op_time(n, s);
        let mut c = Cost { comm: 0.0, compute: t.fwd + t.comm_fwd, steps: 0 };
        for (j, v) in g.node(n).inputs().iter().enumerate() {
            let (Some(v), Some(Some(need))) = (v, ins.get(j)) else { continue };
            if !self.chosen.contains_key(&v.node) && !ir::reshard::held_once(g, *v) {
                continue; // integers and constants: the host provides every layout
            }
            let have = self.materialized.get(v).is_some_and(|l| l.contains(need));
            if !have && let Some(from) = self.layout_of(*v) {
                c += self.reshard(*v, &from, need);
            }
        }
        for (slot, out) in outs.iter().enumerate() {
            let v = Value::new(n, slot as u16);
            if let Some(state) = self.carried.get(&v) {
                let to =
                    self.held.get(state).cloned().unwrap_or_else(|| vec![ir::shard::AxisShard::Replicate; out.len()]);
                c += self.reshard(v, out, &to);
            }
            if !readers {
                continue;
            }
            let mut seen: Vec<Sharding> = Vec::new();
            for (r, j) in g.users(v) {
                let Some(rs) = self.chosen.get(&r) else { continue };
                let Some(Some(need)) = self.sh(r, rs).0.get(j).cloned() else { continue };
                if !seen.contains(&need) {
                    c += self.reshard(v, out, &need);
                    seen.push(need);
                }
            }
        }
        c
    }

    /// The cheapest of `n`'s candidates; ties keep the earlier (the replicated one first).
    fn best(&self, n: NodeId, readers: bool) -> (Cost, OpStrategy) {
        let mut best: Option<(Cost, &OpStrategy)> = None;
        for s in &self.cands[&n] {
            let c = self.cost(n, s, readers);
            if best.as_ref().is_none_or(|(b, _)| c.faster(b, self.backward.contains(&n))) {
                best = Some((c, s));
            }
        }
        best.map(|(c, s)| (c, s.clone())).unwrap_or_else(|| (Cost::default(), vec![None; self.cm.mesh.axes.len()]))
    }
}

/// Whether update `n` under strategy `s` reads its parameter (input 0) in layout `held`, the
/// layout the parameter is held in: the update then runs on the parameter's shard.
pub(crate) fn reads_parameter_as(cm: &CostModel<'_>, n: NodeId, s: &OpStrategy, held: &Sharding) -> bool {
    strategy_shardings(cm.space(n), s).0.first().cloned().flatten().as_ref() == Some(held)
}

/// The training graph's assignment: `pinned` strategies (the forward plan's, keyed by the
/// training graph's nodes) where they are admissible on `cm`'s mesh, optimizer updates on
/// their parameter's shard, the cheapest admissible strategy elsewhere. Returns the
/// assignment and the pinned ops whose strategy was not admissible here (chosen like the
/// others instead).
pub fn derive(cm: &CostModel<'_>, pinned: &HashMap<NodeId, OpStrategy>) -> (Assignment, Vec<NodeId>) {
    derive_in(cm, pinned, None)
}

/// [`derive`] for the ops of one pipeline stage (`ops`), on that stage's mesh (`cm`'s):
/// values from other stages arrive whole, in any layout their readers want.
pub fn derive_stage(
    cm: &CostModel<'_>,
    pinned: &HashMap<NodeId, OpStrategy>,
    ops: &HashSet<NodeId>,
) -> (Assignment, Vec<NodeId>) {
    derive_in(cm, pinned, Some(ops))
}

fn derive_in(
    cm: &CostModel<'_>,
    pinned: &HashMap<NodeId, OpStrategy>,
    only: Option<&HashSet<NodeId>>,
) -> (Assignment, Vec<NodeId>) {
    let g = cm.g;
    let k = cm.mesh.axes.len();
    let mut d = Derive {
        cm,
        chosen: HashMap::new(),
        cands: HashMap::new(),
        held: HashMap::new(),
        carried: ir::train::carried_state(g).into_iter().collect(),
        materialized: HashMap::new(),
        backward: Default::default(),
    };
    // Forward ops by their first output's name (what backward ops are annotated with).
    let by_key: HashMap<&str, NodeId> = cm
        .order()
        .iter()
        .filter_map(|&n| Some((g.node(n).outputs().first()?.name.as_str(), n)))
        .filter(|(k, _)| !k.is_empty())
        .collect();
    let mut unpinned = Vec::new();
    let mut free: Vec<NodeId> = Vec::new();
    for &n in cm.order() {
        if only.is_some_and(|o| !o.contains(&n)) {
            continue;
        }
        let sp = cm.space(n);
        let node = g.node(n);
        let fixed = pinned.get(&n).filter(|s| s.len() == k && strategy_valid(sp, s, &cm.mesh, g, n));
        if pinned.contains_key(&n) && fixed.is_none() {
            unpinned.push(n);
        }
        let mut cands: Vec<OpStrategy> = match fixed {
            Some(s) => vec![s.clone()],
            None => super::problem::enumerate(cm, n),
        };
        // A backward op runs on the axes its forward op splits over.
        let owner = ir::train::grad_of(g, n).and_then(|f| by_key.get(f)).and_then(|f| d.chosen.get(f));
        if fixed.is_none()
            && let Some(fs) = owner
        {
            let axes = |s: &OpStrategy| s.iter().map(Option::is_some).collect::<Vec<bool>>();
            let within = |s: &OpStrategy| axes(s).iter().zip(axes(fs)).all(|(a, b)| !*a || b);
            let same: Vec<OpStrategy> = cands.iter().filter(|s| within(s)).cloned().collect();
            if !same.is_empty() {
                cands = same;
            }
            d.backward.insert(n);
        }
        // An update runs where its parameter (input 0) is held, when a strategy reads it so;
        // under ZeRO (without pipeline stages) on its shard of what is held whole over the
        // data-parallel axes.
        if fixed.is_none()
            && node.op.is_update()
            && let Some(p) = node.input(0)
            && let Some(held) = d.layout_of(p)
        {
            let flat = only.is_none() && cm.opts.zero >= 1;
            let zero = |s: &&OpStrategy| flat && crate::autoshard::named::zero_shard(cm, n, s, &held);
            let sharded: Vec<OpStrategy> = cands.iter().filter(zero).cloned().collect();
            let at_home: Vec<OpStrategy> =
                cands.iter().filter(|s| reads_parameter_as(cm, n, s, &held)).cloned().collect();
            if !sharded.is_empty() {
                cands = sharded;
            } else if !at_home.is_empty() {
                cands = at_home;
            }
        }
        // Backward ops keep the dual of their forward op's strategy, except views, which
        // settle partial sums where their readers want them.
        if cands.len() > 1 && (owner.is_none() || crate::cost::model::is_view(&node.op)) {
            free.push(n);
        }
        d.cands.insert(n, cands);
        let (_, s) = d.best(n, false);
        let (ins, outs) = d.sh(n, &s);
        for (j, v) in node.inputs().iter().enumerate() {
            if let (Some(v), Some(Some(need))) = (v, ins.get(j)) {
                if !d.chosen.contains_key(&v.node) {
                    d.held.entry(*v).or_insert_with(|| ir::reshard::held_layout(need));
                }
                if fixed.is_some() {
                    let m = d.materialized.entry(*v).or_default();
                    if !m.contains(need) {
                        m.push(need.clone());
                    }
                }
            }
        }
        for (slot, out) in outs.into_iter().enumerate() {
            d.materialized.entry(Value::new(n, slot as u16)).or_default().push(out);
        }
        d.chosen.insert(n, s);
    }
    // Op by op, against both sides, until a round changes nothing.
    for _ in 0..ROUNDS {
        let mut changed = false;
        for &n in free.iter().rev().chain(free.iter()) {
            let cur = d.chosen[&n].clone();
            let (c, s) = d.best(n, true);
            if s != cur && c.faster(&d.cost(n, &cur, true), d.backward.contains(&n)) {
                d.chosen.insert(n, s);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let mut asg = Assignment::default();
    asg.strategies.extend(d.chosen);
    (asg, unpinned)
}

/// The pipeline stage of every op of training graph `g` from the stages of the forward
/// model's ops (`forward`, by first output name):
/// - a forward op keeps its stage;
/// - a backward op (annotated [`ir::train::grad_of`]) runs in its forward op's stage;
/// - another op downstream of a gradient (a sum of gradients, an optimizer update) runs in
///   the earliest stage it reads from, where the gradient is headed; any other (the loss)
///   in the latest, where its inputs are complete;
/// - ops on constants alone ([`ir::reshard::computed_everywhere`]: the step counter) run in
///   every stage (the lowering computes them there) and are listed in stage 0.
///
/// A weight read in several stages (tied embeddings) has its gradient summed and its update
/// run in the earliest; the lowering sends its new value to the others.
pub fn stages(g: &Graph, forward: &HashMap<String, usize>) -> Result<HashMap<NodeId, usize>, String> {
    let order = g.op_nodes().map_err(|_| "the training graph has a cycle".to_string())?;
    let constant = ir::reshard::computed_everywhere(g, &order);
    let first = |n: NodeId| g.node(n).outputs().first().map(|o| o.name.clone()).unwrap_or_default();
    let mut stage: HashMap<NodeId, usize> = HashMap::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    let mut backward: HashSet<NodeId> = HashSet::new();
    for &n in &order {
        let node = g.node(n);
        let grad_of = ir::train::grad_of(g, n).map(str::to_string);
        let inputs: Vec<NodeId> = node
            .inputs()
            .iter()
            .flatten()
            .map(|v| v.node)
            .filter(|p| stage.contains_key(p) && !constant.contains(p))
            .collect();
        let downstream = inputs.iter().any(|p| backward.contains(p));
        if grad_of.is_some() || downstream {
            backward.insert(n);
        }
        let s = if constant.contains(&n) {
            0
        } else if let Some(&s) = forward.get(&first(n)) {
            s
        } else if let Some(s) = grad_of.as_ref().and_then(|f| forward.get(f).or_else(|| by_name.get(f))) {
            *s
        } else if downstream {
            inputs.iter().map(|p| stage[p]).min().unwrap_or(0)
        } else {
            inputs.iter().map(|p| stage[p]).max().unwrap_or(0)
        };
        stage.insert(n, s);
        by_name.insert(first(n), s);
    }
    Ok(stage)
}
