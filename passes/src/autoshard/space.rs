//! The search space as an e-graph (egg).
//!
//! An e-class stands for one tensor in one layout; its e-nodes are the ways to obtain it:
//! computing it with one strategy of its producer from its inputs' classes (`compute`),
//! resharding it from another layout its producer can make (`reshard`), or, for graph inputs
//! and parameters, storing it that way (`source`). Every e-node carries its class's
//! (tensor, layout) key, so equal keys are unioned into one class.
//!
//! The e-graph starts from the seed plans (data parallel, replicated, and the other named
//! strategies that apply) and grows by rewrites, one per kind of split: `split-batch`,
//! `split-spatial` (with halo), `split-out-features` (GEMM columns, conv filters),
//! `split-in-features` (GEMM rows / conv channels: the reduction, into partial sums),
//! `split-vocab`, `split-other` (heads, sequence, …) and `unsplit` change one mesh axis of an
//! existing `compute` e-node's strategy; `reshard` connects every layout of a tensor to the
//! layouts its producer makes. Node and time limits bound the growth; each op keeps at most
//! a fixed number of strategies (the cheapest to compute first), so a large graph is explored
//! evenly rather than front to back.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egg::{Analysis, Applier, DidMerge, EGraph, Id, Language, PatternAst, Rewrite, Runner, SearchMatches, Searcher};
use egg::{SimpleScheduler, StopReason, Subst, Symbol, Var};
use ir::shard::DimRole;
use serde::Serialize;

use super::problem::{LayoutId, Origin, Problem, ValueId};

/// An e-node: one way to obtain tensor `value` in layout `layout`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShardNode {
    /// A graph input, parameter or constant, stored in the layout.
    Source {
        /// The tensor.
        value: ValueId,
        /// Its layout.
        layout: LayoutId,
    },
    /// Output of op `op` (a position in topological order) under its strategy `strategy`,
    /// from its inputs' classes.
    Compute {
        /// The tensor.
        value: ValueId,
        /// Its layout.
        layout: LayoutId,
        /// The op.
        op: u32,
        /// The strategy's index in the op's table.
        strategy: u32,
        /// The input classes.
        children: Box<[Id]>,
    },
    /// The child class's tensor moved into another layout.
    Reshard {
        /// The tensor.
        value: ValueId,
        /// The layout it is moved into.
        layout: LayoutId,
        /// The class it is moved from.
        child: [Id; 1],
    },
}

impl ShardNode {
    /// The (tensor, layout) key of the class this node belongs to.
    pub fn key(&self) -> (ValueId, LayoutId) {
        match self {
            ShardNode::Source { value, layout }
            | ShardNode::Compute { value, layout, .. }
            | ShardNode::Reshard { value, layout, .. } => (*value, *layout),
        }
    }
}

impl Language for ShardNode {
    type Discriminant = (u8, u32, u32, u32, u32);

    fn discriminant(&self) -> Self::Discriminant {
        match self {
            ShardNode::Source { value, layout } => (0, value.0, layout.0, 0, 0),
            ShardNode::Compute { value, layout, op, strategy, .. } => (1, value.0, layout.0, *op, *strategy),
            ShardNode::Reshard { value, layout, .. } => (2, value.0, layout.0, 0, 0),
        }
    }

    fn matches(&self, other: &Self) -> bool {
        self.discriminant() == other.discriminant() && self.children().len() == other.children().len()
    }

    fn children(&self) -> &[Id] {
        match self {
            ShardNode::Source { .. } => &[],
            ShardNode::Compute { children, .. } => children,
            ShardNode::Reshard { child, .. } => child,
        }
    }

    fn children_mut(&mut self) -> &mut [Id] {
        match self {
            ShardNode::Source { .. } => &mut [],
            ShardNode::Compute { children, .. } => children,
            ShardNode::Reshard { child, .. } => child,
        }
    }
}

impl fmt::Display for ShardNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardNode::Source { value, layout } => write!(f, "source v{} l{}", value.0, layout.0),
            ShardNode::Compute { value, layout, op, strategy, .. } => {
                write!(f, "compute v{} l{} op{op} s{strategy}", value.0, layout.0)
            }
            ShardNode::Reshard { value, layout, .. } => write!(f, "reshard v{} l{}", value.0, layout.0),
        }
    }
}

/// The e-graph's bookkeeping: the problem tables, and which classes and strategies exist.
pub struct Tables {
    problem: Arc<Problem>,
    class_of: HashMap<(ValueId, LayoutId), Id>,
    /// Strategies with `compute` nodes, per op.
    present: Vec<BTreeSet<u32>>,
    /// Layouts a tensor's producer makes (classes with a `compute` node).
    produced: Vec<BTreeSet<LayoutId>>,
    /// Every layout a tensor has a class for.
    layouts: Vec<BTreeSet<LayoutId>>,
    reshards: HashSet<(ValueId, LayoutId, LayoutId)>,
    /// Most strategies an op may have.
    per_op_cap: usize,
    node_limit: usize,
    /// A strategy was refused because its op was at the cap.
    hit_cap: bool,
    /// A node was refused because the e-graph was at its node limit.
    hit_node_limit: bool,
}

impl Analysis<ShardNode> for Tables {
    type Data = (ValueId, LayoutId);

    fn make(_egraph: &mut EGraph<ShardNode, Self>, enode: &ShardNode, _id: Id) -> Self::Data {
        enode.key()
    }

    fn merge(&mut self, a: &mut Self::Data, b: Self::Data) -> DidMerge {
        debug_assert_eq!(*a, b, "only classes of one (tensor, layout) are merged");
        DidMerge(false, false)
    }
}

type Graph = EGraph<ShardNode, Tables>;

/// Adds `node` to the class of its key, creating the class if needed. Returns the class.
fn add(eg: &mut Graph, node: ShardNode) -> Id {
    let key = node.key();
    let id = eg.add(node);
    match eg.analysis.class_of.get(&key).copied() {
        Some(c) => {
            eg.union(c, id);
            eg.find(c)
        }
        None => {
            eg.analysis.class_of.insert(key, id);
            eg.analysis.layouts[key.0.ix()].insert(key.1);
            id
        }
    }
}

/// The class of tensor `v` in layout `l`, created from its sources or by resharding from
/// its producer's layouts when it does not exist yet.
fn class(eg: &mut Graph, v: ValueId, l: LayoutId) -> Id {
    if let Some(&c) = eg.analysis.class_of.get(&(v, l)) {
        return eg.find(c);
    }
    let p = eg.analysis.problem.clone();
    match p.values[v.ix()].origin {
        Origin::Source { .. } => add(eg, ShardNode::Source { value: v, layout: l }),
        Origin::Op { .. } => {
            let from: Vec<LayoutId> = eg.analysis.produced[v.ix()].iter().copied().collect();
            let mut id = None;
            for f in from {
                id = Some(reshard(eg, v, f, l));
            }
            id.expect("a tensor's producer is added before its consumers")
        }
    }
}

fn reshard(eg: &mut Graph, v: ValueId, from: LayoutId, to: LayoutId) -> Id {
    let child = eg.find(eg.analysis.class_of[&(v, from)]);
    eg.analysis.reshards.insert((v, from, to));
    add(eg, ShardNode::Reshard { value: v, layout: to, child: [child] })
}

/// Adds the `compute` nodes of op `op` under strategy `s`. Returns false when the op is at
/// its cap or the e-graph at its node limit.
fn add_strategy(eg: &mut Graph, op: usize, s: u32, force: bool) -> Option<Id> {
    if eg.analysis.present[op].contains(&s) {
        return None;
    }
    if !force && (eg.analysis.present[op].len() >= eg.analysis.per_op_cap || eg.total_size() >= eg.analysis.node_limit)
    {
        return None;
    }
    let p = eg.analysis.problem.clone();
    let info = &p.ops[op];
    let children: Vec<Id> =
        info.inputs.iter().zip(&info.needs[s as usize]).filter_map(|(v, l)| Some(class(eg, (*v)?, (*l)?))).collect();
    let children: Box<[Id]> = children.into();
    eg.analysis.present[op].insert(s);
    let mut first = None;
    for (slot, &v) in info.outputs.iter().enumerate() {
        let l = info.makes[s as usize][slot];
        let id =
            add(eg, ShardNode::Compute { value: v, layout: l, op: op as u32, strategy: s, children: children.clone() });
        first.get_or_insert(id);
        eg.analysis.produced[v.ix()].insert(l);
    }
    first
}

/// What a split rule changes an axis to.
#[derive(Copy, Clone, Debug)]
enum Target {
    Role(DimRole),
    Other,
    Unsplit,
}

/// A sharding rewrite: changes one mesh axis of an existing strategy.
struct SplitRule {
    target: Target,
}

fn all_matches(eg: &Graph, want: impl Fn(&ShardNode) -> bool) -> Vec<SearchMatches<'static, ShardNode>> {
    eg.classes()
        .filter(|c| c.nodes.iter().any(&want))
        .map(|c| SearchMatches { eclass: c.id, substs: vec![Subst::default()], ast: None })
        .collect()
}

impl Searcher<ShardNode, Tables> for SplitRule {
    fn search_eclass_with_limit(&self, eg: &Graph, eclass: Id, limit: usize) -> Option<SearchMatches<'_, ShardNode>> {
        (limit > 0 && eg[eclass].nodes.iter().any(|n| matches!(n, ShardNode::Compute { .. }))).then(|| SearchMatches {
            eclass,
            substs: vec![Subst::default()],
            ast: None,
        })
    }

    fn search_with_limit(&self, eg: &Graph, _limit: usize) -> Vec<SearchMatches<'_, ShardNode>> {
        all_matches(eg, |n| matches!(n, ShardNode::Compute { .. }))
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

impl Applier<ShardNode, Tables> for SplitRule {
    fn apply_one(&self, _: &mut Graph, _: Id, _: &Subst, _: Option<&PatternAst<ShardNode>>, _: Symbol) -> Vec<Id> {
        Vec::new()
    }

    fn apply_matches(&self, eg: &mut Graph, matches: &[SearchMatches<ShardNode>], _rule: Symbol) -> Vec<Id> {
        let p = eg.analysis.problem.clone();
        // Each matched op's strategies, once (an op has a compute node per output).
        let mut seen: BTreeSet<(u32, u32)> = BTreeSet::new();
        for m in matches {
            for n in &eg[m.eclass].nodes {
                if let ShardNode::Compute { op, strategy, .. } = n {
                    seen.insert((*op, *strategy));
                }
            }
        }
        // Candidates per op, cheapest first.
        let mut per_op: BTreeMap<u32, BTreeSet<(u64, u32)>> = BTreeMap::new();
        for (op, s) in seen {
            let info = &p.ops[op as usize];
            let base = &info.strategies[s as usize];
            for a in 0..p.axes {
                let dims: Vec<Option<usize>> = match self.target {
                    Target::Unsplit => vec![None],
                    Target::Role(r) => (0..info.roles.len()).filter(|&i| info.roles[i] == r).map(Some).collect(),
                    Target::Other => {
                        (0..info.roles.len()).filter(|&i| matches!(info.roles[i], DimRole::Other)).map(Some).collect()
                    }
                };
                for d in dims {
                    if base[a] == d {
                        continue;
                    }
                    let mut t = base.clone();
                    t[a] = d;
                    if let Some(&k) = info.index.get(&t)
                        && !eg.analysis.present[op as usize].contains(&k)
                    {
                        per_op.entry(op).or_default().insert((info.time[k as usize].to_bits(), k));
                    }
                }
            }
        }
        let mut added = Vec::new();
        for (op, cands) in per_op {
            for (_, k) in cands {
                if let Some(id) = add_strategy(eg, op as usize, k, false) {
                    added.push(id);
                }
            }
        }
        added
    }
}

/// Connects every class of a tensor to the layouts its producer makes.
struct ReshardRule;

impl Searcher<ShardNode, Tables> for ReshardRule {
    fn search_eclass_with_limit(&self, eg: &Graph, eclass: Id, limit: usize) -> Option<SearchMatches<'_, ShardNode>> {
        (limit > 0).then(|| SearchMatches { eclass, substs: vec![Subst::default()], ast: None }).filter(|_| {
            let (v, l) = eg[eclass].data;
            eg.analysis.produced[v.ix()].iter().any(|&f| f != l && !eg.analysis.reshards.contains(&(v, f, l)))
        })
    }

    fn search_with_limit(&self, eg: &Graph, _limit: usize) -> Vec<SearchMatches<'_, ShardNode>> {
        eg.classes()
            .filter(|c| {
                let (v, l) = c.data;
                matches!(eg.analysis.problem.values[v.ix()].origin, Origin::Op { .. })
                    && eg.analysis.produced[v.ix()]
                        .iter()
                        .any(|&f| f != l && !eg.analysis.reshards.contains(&(v, f, l)))
            })
            .map(|c| SearchMatches { eclass: c.id, substs: vec![Subst::default()], ast: None })
            .collect()
    }

    fn vars(&self) -> Vec<Var> {
        Vec::new()
    }
}

impl Applier<ShardNode, Tables> for ReshardRule {
    fn apply_one(&self, _: &mut Graph, _: Id, _: &Subst, _: Option<&PatternAst<ShardNode>>, _: Symbol) -> Vec<Id> {
        Vec::new()
    }

    fn apply_matches(&self, eg: &mut Graph, matches: &[SearchMatches<ShardNode>], _rule: Symbol) -> Vec<Id> {
        let mut added = Vec::new();
        let keys: Vec<(ValueId, LayoutId)> = matches.iter().map(|m| eg[m.eclass].data).collect();
        for (v, l) in keys {
            let from: Vec<LayoutId> = eg.analysis.produced[v.ix()].iter().copied().collect();
            for f in from {
                if f != l && !eg.analysis.reshards.contains(&(v, f, l)) {
                    if eg.total_size() >= eg.analysis.node_limit {
                        eg.analysis.hit_node_limit = true;
                        return added;
                    }
                    added.push(reshard(eg, v, f, l));
                }
            }
        }
        added
    }
}

/// The names of the rewrite rules, in the order they run.
pub const RULES: &[&str] = &[
    "split-batch",
    "split-spatial",
    "split-out-features",
    "split-in-features",
    "split-vocab",
    "split-experts",
    "split-other",
    "unsplit",
    "reshard",
];

fn rules() -> Vec<Rewrite<ShardNode, Tables>> {
    let split = |name: &str, target: Target| Rewrite::new(name, SplitRule { target }, SplitRule { target }).unwrap();
    vec![
        split("split-batch", Target::Role(DimRole::Batch)),
        split("split-spatial", Target::Role(DimRole::Spatial)),
        split("split-out-features", Target::Role(DimRole::OutFeature)),
        split("split-in-features", Target::Role(DimRole::InFeature)),
        split("split-vocab", Target::Role(DimRole::Vocab)),
        split("split-experts", Target::Role(DimRole::Expert)),
        split("split-other", Target::Other),
        split("unsplit", Target::Unsplit),
        Rewrite::new("reshard", ReshardRule, ReshardRule).unwrap(),
    ]
}

/// Limits on the e-graph's growth.
#[derive(Clone, Debug)]
pub struct Limits {
    /// E-nodes.
    pub nodes: usize,
    /// Wall-clock time.
    pub time: Duration,
    /// Rewrite iterations.
    pub iterations: usize,
    /// Strategies per op.
    pub per_op: usize,
}

/// What the e-graph did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EgraphStats {
    /// E-classes at the end.
    pub classes: usize,
    /// E-nodes at the end.
    pub nodes: usize,
    /// Rewrite iterations run.
    pub iterations: usize,
    /// `saturated`, `node limit`, `time limit` or `iteration limit`.
    pub stop_reason: String,
    /// New e-nodes per rule, over all iterations.
    pub rule_applications: BTreeMap<String, usize>,
    /// Strategies in the space, summed over ops.
    pub strategies: usize,
    /// Admissible strategies, summed over ops (what an unbounded space would hold).
    pub admissible_strategies: usize,
    /// Seconds (reported under the plan's `timings`).
    #[serde(skip)]
    pub time_s: f64,
}

/// The explored space: per op, the strategies (indices into its table) the e-graph holds.
pub struct Space {
    /// Per op (topological position), the strategy indices, sorted.
    pub candidates: Vec<Vec<u32>>,
    /// Statistics.
    pub stats: EgraphStats,
}

/// Builds the e-graph from seed plans (per seed, per op a strategy index) and grows it.
pub(crate) fn grow(problem: Arc<Problem>, seeds: &[Vec<u32>], limits: &Limits) -> Runner<ShardNode, Tables> {
    grow_with(problem, seeds, limits, RULES)
}

/// [`grow`] with only the named rules.
pub(crate) fn grow_with(
    problem: Arc<Problem>,
    seeds: &[Vec<u32>],
    limits: &Limits,
    only: &[&str],
) -> Runner<ShardNode, Tables> {
    let n_ops = problem.ops.len();
    let n_values = problem.values.len();
    let tables = Tables {
        problem,
        class_of: HashMap::new(),
        present: vec![BTreeSet::new(); n_ops],
        produced: vec![BTreeSet::new(); n_values],
        layouts: vec![BTreeSet::new(); n_values],
        reshards: HashSet::new(),
        per_op_cap: limits.per_op.max(1),
        node_limit: limits.nodes,
        hit_cap: false,
        hit_node_limit: false,
    };
    let mut runner = Runner::new(tables)
        .with_scheduler(SimpleScheduler)
        .with_node_limit(limits.nodes)
        .with_time_limit(limits.time)
        .with_iter_limit(limits.iterations);
    for seed in seeds {
        for (op, &s) in seed.iter().enumerate() {
            add_strategy(&mut runner.egraph, op, s, true);
        }
    }
    runner.egraph.rebuild();
    let rules: Vec<_> = rules().into_iter().filter(|r| only.contains(&r.name.as_str())).collect();
    runner.run(&rules)
}

/// The strategies of each op held by `compute` nodes of the e-graph.
pub(crate) fn candidates(eg: &Graph, n_ops: usize) -> Vec<Vec<u32>> {
    let mut out: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n_ops];
    for c in eg.classes() {
        for n in &c.nodes {
            if let ShardNode::Compute { op, strategy, .. } = n {
                out[*op as usize].insert(*strategy);
            }
        }
    }
    out.into_iter().map(|s| s.into_iter().collect()).collect()
}

/// Builds and grows the e-graph; returns the space it holds.
pub(crate) fn explore(problem: Arc<Problem>, seeds: &[Vec<u32>], limits: &Limits) -> Space {
    let start = Instant::now();
    let runner = grow(problem.clone(), seeds, limits);
    let mut stats = EgraphStats {
        classes: runner.egraph.number_of_classes(),
        nodes: runner.egraph.total_number_of_nodes(),
        iterations: runner.iterations.len(),
        stop_reason: match &runner.stop_reason {
            Some(StopReason::Saturated) | None => "saturated".into(),
            Some(StopReason::NodeLimit(_)) => "node limit".into(),
            Some(StopReason::TimeLimit(_)) => "time limit".into(),
            Some(StopReason::IterationLimit(_)) => "iteration limit".into(),
            Some(StopReason::Other(s)) => s.clone(),
        },
        rule_applications: BTreeMap::new(),
        strategies: 0,
        admissible_strategies: problem.ops.iter().map(|o| o.strategies.len()).sum(),
        time_s: 0.0,
    };
    // The rules stop at the limits themselves, so the runner may see a saturated e-graph.
    if stats.stop_reason == "saturated" {
        if runner.egraph.analysis.hit_node_limit {
            stats.stop_reason = "node limit".into();
        } else if runner.egraph.analysis.hit_cap {
            stats.stop_reason = "saturated (per-op strategy cap)".into();
        }
    }
    for it in &runner.iterations {
        for (rule, n) in &it.applied {
            *stats.rule_applications.entry(rule.to_string()).or_insert(0) += n;
        }
    }
    let candidates = candidates(&runner.egraph, problem.ops.len());
    stats.strategies = candidates.iter().map(Vec::len).sum();
    stats.time_s = start.elapsed().as_secs_f64();
    Space { candidates, stats }
}
