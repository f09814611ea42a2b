//! Autoshard: the search for the per-op strategies and per-tensor layouts that minimise the
//! cost model's step time on a cluster, under its per-device memory.
//!
//! For each candidate mesh ([`meshes::candidates`]):
//! 1. the problem's tables are built: every admissible strategy of every op
//!    ([`problem`]);
//! 2. an e-graph (egg) is seeded with the named plans and grown by sharding rewrites within
//!    node and time limits ([`space`]); the strategies of one more seed per mesh axis (data
//!    parallel over the other axes, Megatron over it) join its candidates;
//! 3. a plan is extracted from it, DAG-aware: enumeration when small, a dynamic program over
//!    the topological order with λ-weighted memory otherwise, then local search with the full
//!    cost model, one op at a time and by chains of ops ([`extract`]).
//!
//! The best plan over the meshes wins (fitting plans first, then the fastest). The named
//! plans, data parallel among them, are always candidates, so the result is never worse than
//! them in the model. The search is deterministic.

pub mod budget;
pub mod config;
pub mod context;
pub mod explain;
pub mod export;
pub mod extract;
pub mod fold;
pub mod grid;
pub mod interleave;
pub mod meshes;
pub mod named;
pub mod pipeline;
pub mod plan;
pub(crate) mod problem;
pub mod space;
#[cfg(test)]
mod tests;
pub mod training;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use budget::SafetyNet;

use ir::Graph;
use ir::shard::Mesh;
use serde::Serialize;

use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options};
pub use extract::ExtractStats;
pub use fold::Folding;
pub use named::Named;
pub use pipeline::PipelineMode;
pub use plan::Plan;
pub use space::EgraphStats;

use problem::Problem;

/// Search knobs. The search is bounded by work (the budgets below), so its result does not
/// depend on the machine's speed or load; `time_limit` is only a safety net.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// Wall-clock safety net for the whole search; when it fires, the running phase stops,
    /// the best plan so far is returned and the plan names the budgets that were cut.
    pub time_limit: Duration,
    /// E-nodes per mesh.
    pub node_limit: usize,
    /// Strategies one op may have in the e-graph.
    pub per_op_strategies: usize,
    /// Enumerate every combination when the space has at most this many.
    pub exhaustive_limit: f64,
    /// Dynamic-program states kept per op.
    pub beam: usize,
    /// Improve the extracted plan with local search.
    pub local_search: bool,
    /// Work the local search may do per mesh, in op-evaluations (plans priced × ops).
    pub local_search_work: usize,
    /// Meshes to try (default: [`meshes::candidates`]).
    pub meshes: Option<Vec<Mesh>>,
    /// Worker threads (meshes are searched in parallel).
    pub threads: usize,
    /// Pipelining: off, auto (when it is faster or the only way to fit) or a stage count.
    pub pipeline: PipelineMode,
    /// Multiplies the safety net's clock (tests simulate a slower machine with it).
    #[doc(hidden)]
    pub clock_scale: f64,
    /// Told what the search is doing as it goes (progress displays); nothing by default.
    pub progress: Progress,
    /// Repeated-layer folding ([`fold`]).
    pub fold: FoldMode,
    /// Let [`search_rewriting`] try the algebraic rewrites of
    /// [`crate::algebra::SEARCH_CHOICES`].
    pub rewrites: bool,
    /// When no plan fits, search again with the options of [`memory_ladder`] (recomputation,
    /// sequence parallelism, ZeRO) until one does.
    pub memory_ladder: bool,
    /// Where the configuration grid finds a plan that fits, take the grid's best without the
    /// per-op (e-graph) and pipeline searches. [`search_rewriting`] searches a rewritten graph
    /// so when the graph as written took the grid's configuration: a rewrite of a few ops per
    /// block does not change which kind of plan wins.
    pub grid_only: bool,
    /// When a folded search's plan does not fit, search every block of the mesh again. Off
    /// where a plan that fits is known already (the configuration grid's): the per-block
    /// search is for finding one that fits, and costs the graph's depth.
    pub unfold_when_unfit: bool,
}

/// When the search folds repeated blocks ([`fold`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum FoldMode {
    /// When the graph has at least [`FOLD_MIN_OPS`] ops and [`FOLD_MIN_BLOCKS`] repeating
    /// blocks: below that the full search takes a few seconds at most.
    #[default]
    Auto,
    /// Whenever [`FOLD_MIN_BLOCKS`] blocks repeat.
    Always,
    /// Never.
    Never,
}

/// Ops from which [`FoldMode::Auto`] folds.
pub const FOLD_MIN_OPS: usize = 1000;

/// Repeating blocks from which the search folds (three are searched).
pub const FOLD_MIN_BLOCKS: usize = 5;

/// What the search reports while it runs.
#[derive(Clone, Debug, PartialEq)]
pub enum SearchEvent {
    /// A mesh's search began: the `index`-th (from 0) of `of`.
    MeshStarted {
        /// The mesh, as [`mesh_string`] writes it.
        mesh: String,
        /// Its position among the meshes tried.
        index: usize,
        /// How many meshes are tried.
        of: usize,
    },
    /// A mesh's search ended with its best plan.
    MeshDone {
        /// The mesh.
        mesh: String,
        /// Its best plan's step time, seconds.
        step_time_s: f64,
        /// That plan fits in memory.
        feasible: bool,
    },
    /// A pipeline configuration was priced.
    PipelinePriced {
        /// Stages.
        stages: usize,
        /// Micro-batches.
        micro_batches: usize,
        /// Its step time, seconds (infinite when nothing fits).
        step_time_s: f64,
    },
}

/// A callback for [`SearchEvent`]s (called from the search's threads).
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<ProgressFn>>);

/// What a [`Progress`] calls.
pub type ProgressFn = dyn Fn(&SearchEvent) + Send + Sync;

impl Progress {
    /// A callback that calls `f`.
    pub fn new(f: impl Fn(&SearchEvent) + Send + Sync + 'static) -> Progress {
        Progress(Some(Arc::new(f)))
    }

    pub(crate) fn emit(&self, e: SearchEvent) {
        if let Some(f) = &self.0 {
            f(&e);
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Progress(set)" } else { "Progress(none)" })
    }
}

/// Default local-search work per mesh: about 4 s of plan pricing on one core of the
/// development machine for the largest shared models; small models finish well before it.
pub const DEFAULT_LOCAL_SEARCH_WORK: usize = 8_000_000;

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            time_limit: Duration::from_secs(60),
            node_limit: 400_000,
            per_op_strategies: 32,
            exhaustive_limit: 4096.0,
            beam: 1024,
            local_search: true,
            local_search_work: DEFAULT_LOCAL_SEARCH_WORK,
            meshes: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            pipeline: PipelineMode::Auto,
            clock_scale: 1.0,
            progress: Progress::default(),
            fold: FoldMode::Auto,
            rewrites: true,
            memory_ladder: true,
            grid_only: false,
            unfold_when_unfit: true,
        }
    }
}

/// The search on one mesh.
#[derive(Clone, Debug, Serialize)]
pub struct MeshSearch {
    /// The mesh, as `nodes=8:inter × gpus=8:intra`.
    pub mesh: String,
    /// The best plan's step time on it, seconds.
    pub step_time_s: f64,
    /// It fits.
    pub feasible: bool,
    /// Its memory per device, bytes.
    pub memory_per_device_bytes: u64,
    /// The e-graph.
    pub egraph: EgraphStats,
    /// The extraction.
    pub extraction: ExtractStats,
    /// Seconds (reported under the plan's `timings`, never beside the results).
    #[serde(skip)]
    pub time_s: f64,
}

/// A search result.
pub struct SearchResult {
    /// The chosen mesh.
    pub mesh: Mesh,
    /// Per op, its strategy.
    pub assignment: Assignment,
    /// The chosen plan's price.
    pub breakdown: Breakdown,
    /// Which named plan it is, when it is exactly one (`data`, `owt`…).
    pub same_as: Option<String>,
    /// Pure data parallelism on the cluster's natural mesh (`None`: not applicable).
    pub data_parallel: Option<Breakdown>,
    /// Why data parallelism does not apply, when it does not (no batch dim, a batch the
    /// devices do not divide).
    pub data_parallel_unavailable: Option<String>,
    /// Per mesh tried.
    pub meshes: Vec<MeshSearch>,
    /// Seconds.
    pub search_time_s: f64,
    /// The time limit (the safety net) cut the search short.
    pub time_limit_hit: bool,
    /// The budgets the safety net cut (`egraph`, `dp`, `local-search`, `pipeline` …).
    pub budget_cut: Vec<String>,
    /// The pipeline, when the plan pipelines (then `mesh` is the first stage's and
    /// `assignment` holds every stage's strategies on its own mesh).
    pub pipeline: Option<pipeline::PipelinePlan>,
    /// What the pipeline search found, whether or not it was chosen.
    pub pipeline_considered: Option<PipelineSummary>,
    /// Memory the whole step would need on one device, bytes (what makes a model "not fit").
    pub single_device_memory_bytes: f64,
    /// The repeated blocks folded, when the search folded them (`48 blocks h0 … h47 searched
    /// as 3`).
    pub folded: Option<String>,
    /// The algebraic rewrites the search tried ([`search_rewriting`]), in order.
    pub rewrites: Vec<RewriteChoice>,
    /// The cost-model options the plan needs when the search changed the caller's to make it
    /// fit ([`memory_ladder`]: recomputation, sequence parallelism, ZeRO); `None` when it kept
    /// them.
    pub options: Option<Options>,
    /// The rungs of the memory ladder searched, the caller's options first (empty when the
    /// first plan fit).
    pub ladder: Vec<LadderRung>,
    /// Where the plan is the configuration grid's context-parallel one: what fits without
    /// context parallelism ([`grid::GridPlan::context_reason`]).
    pub context_reason: Option<String>,
    /// Where the plan is the configuration grid's: the fastest configuration without pipeline
    /// stages that fits, of those the grid priced, and its step seconds
    /// ([`grid::GridPlan::flat`]).
    pub grid_flat: Option<(String, f64)>,
}

/// One rung of the memory ladder: its best plan's step time and memory.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct LadderRung {
    /// The memory-saving options, as configuration fields (`recompute=full,sp,zero=1`).
    pub options: String,
    /// The best plan's step time, seconds.
    pub step_time_s: f64,
    /// Its memory per device, bytes.
    pub memory_per_device_bytes: u64,
    /// It fits.
    pub feasible: bool,
}

/// An algebraic rewrite the search tried on the whole graph: the plan's step time with and
/// without it, and whether the plan uses it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RewriteChoice {
    /// The rewrite (a pass name: `conv-as-matmul`).
    pub rule: String,
    /// The places it rewrites.
    pub sites: u64,
    /// The plan's graph is the rewritten one.
    pub applied: bool,
    /// The best plan's step time of the rewritten graph, seconds (absent when it was not
    /// searched: no time left).
    pub with_step_time_s: Option<f64>,
    /// The best plan's step time of the graph without it, seconds.
    pub without_step_time_s: f64,
    /// The places (by label) where the two plans priced the rewritten ops cheaper than the
    /// original's, when some but not all: the graph rewritten there only is searched too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cheaper_at: Option<Vec<String>>,
    /// That graph's best plan's step time, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cheaper_at_step_time_s: Option<f64>,
    /// The plan's graph is rewritten at `cheaper_at` only (`applied` is then true).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub applied_at_cheaper: bool,
}

/// The pipeline search's outcome, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineSummary {
    /// The best pipeline's step time, seconds.
    pub best_step_time_s: f64,
    /// Configurations priced.
    pub tried: Vec<pipeline::Tried>,
    /// Seconds.
    pub search_time_s: f64,
}

/// Describes a mesh as `nodes=8:inter × gpus=8:intra`.
pub fn mesh_string(m: &Mesh) -> String {
    m.axes
        .iter()
        .map(|a| {
            format!(
                "{}={}:{}",
                a.name,
                a.size,
                match a.level {
                    ir::shard::LinkLevel::Intra => "intra",
                    ir::shard::LinkLevel::Inter => "inter",
                }
            )
        })
        .collect::<Vec<_>>()
        .join(" × ")
}

/// Named plans used as seeds and baselines.
const SEEDS: &[(&str, Named)] = &[
    ("data", Named::Data),
    ("model", Named::Model),
    ("megatron", Named::Megatron),
    ("hybrid", Named::Hybrid { dp: 0, tp: 0 }),
    ("owt", Named::Owt),
    ("expert", Named::Expert { ep: 0, tp: 1 }),
    ("spatial", Named::Spatial),
    ("spatial-hybrid", Named::SpatialHybrid(0, 0)),
];

/// The seed plans that apply on `cm`'s mesh: the named ones, then per mesh axis data parallel
/// over the others and Megatron over it ([`crate::autoshard::named::hybrid_over`]) where that
/// differs from every named one. The flag is true for the named ones: they seed the e-graph;
/// the per-axis ones only add their strategies to the candidates the extraction chooses from
/// (seeding the e-graph with them too changes which strategies its per-op cap keeps, and
/// measured worse: ResNet-50 on 64 A100s 4.755 ms against 4.516 ms).
fn seed_plans(cm: &CostModel<'_>) -> Vec<(String, Assignment, bool)> {
    let mut seeds: Vec<(String, Assignment, bool)> = SEEDS
        .iter()
        .filter_map(|(name, named)| {
            crate::autoshard::named::assign(cm, named).ok().map(|a| ((*name).to_string(), a, true))
        })
        .collect();
    for tp in 0..cm.mesh.axes.len() {
        if let Ok(a) = crate::autoshard::named::hybrid_over(cm, tp)
            && seeds.iter().all(|(_, b, _)| *b != a)
        {
            seeds.push((format!("hybrid, tensor over {}", cm.mesh.axes[tp].name), a, false));
        }
    }
    for ep in 0..cm.mesh.axes.len() {
        if let Ok(a) = crate::autoshard::named::expert_over(cm, ep)
            && seeds.iter().all(|(_, b, _)| *b != a)
        {
            seeds.push((format!("expert over {}", cm.mesh.axes[ep].name), a, false));
        }
    }
    seeds
}

struct MeshOutcome {
    mesh: Mesh,
    assignment: Assignment,
    breakdown: Breakdown,
    same_as: Option<String>,
    summary: MeshSearch,
}

fn search_mesh(
    g: &Graph,
    cluster: &Cluster,
    mesh: Mesh,
    opts: &Options,
    so: &SearchOptions,
    net: &SafetyNet,
    folded: Option<&(fold::Folding, Graph)>,
) -> MeshOutcome {
    let start = Instant::now();
    if let Some((f, reduced)) = folded {
        return search_mesh_folded(g, reduced, f, cluster, mesh, opts, so, net, start);
    }
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let problem = Arc::new(Problem::new(&cm));
    // (name, choice, whether it seeds the e-graph)
    let mut seeds: Vec<(String, Vec<u32>, bool)> = vec![("replicated".into(), vec![0; problem.ops.len()], true)];
    for (name, asg, grows) in seed_plans(&cm) {
        seeds.push((name, problem.indices_of(&asg), grows));
    }
    let seed_choices: Vec<Vec<u32>> = seeds.iter().map(|s| s.1.clone()).collect();
    let growing: Vec<Vec<u32>> = seeds.iter().filter(|s| s.2).map(|s| s.1.clone()).collect();
    let limits = space::Limits {
        nodes: so.node_limit,
        time: net.remaining(),
        iterations: mesh.axes.len() + 2,
        per_op: so.per_op_strategies,
    };
    let mut space = space::explore(problem.clone(), &growing, &limits);
    for (_, choice, _) in seeds.iter().filter(|s| !s.2) {
        for (cands, &c) in space.candidates.iter_mut().zip(choice) {
            if let Err(at) = cands.binary_search(&c) {
                cands.insert(at, c);
            }
        }
    }
    if space.stats.stop_reason == "time limit" {
        net.record("egraph");
    }
    let knobs = extract::Knobs {
        exhaustive_limit: so.exhaustive_limit,
        beam: so.beam,
        local_search: so.local_search,
        local_search_work: so.local_search_work,
        net,
    };
    let ex = extract::extract(&cm, &problem, &space.candidates, &seed_choices, &knobs);
    let same_as = seeds.iter().find(|(_, c, _)| *c == ex.best.choice).map(|(n, _, _)| n.clone());
    let assignment = problem.assignment(&ex.best.choice);
    // The full breakdown (per-op rows, communication events) of the winner.
    let breakdown = cm.evaluate(&assignment);
    let summary = MeshSearch {
        mesh: mesh_string(&mesh),
        step_time_s: breakdown.step_time_s,
        feasible: breakdown.feasible,
        memory_per_device_bytes: breakdown.memory.total() as u64,
        egraph: space.stats,
        extraction: ex.stats,
        time_s: start.elapsed().as_secs_f64(),
    };
    MeshOutcome { assignment, mesh, breakdown, same_as, summary }
}

/// [`search_mesh`] of a graph with repeated blocks: searches the reduced graph, copies its
/// blocks' strategies to every block and prices them on the whole graph (the named plans on
/// the whole graph stay candidates), refines with tied moves, and searches every block when
/// the folded plan does not fit.
#[allow(clippy::too_many_arguments)]
fn search_mesh_folded(
    g: &Graph,
    reduced: &Graph,
    f: &fold::Folding,
    cluster: &Cluster,
    mesh: Mesh,
    opts: &Options,
    so: &SearchOptions,
    net: &SafetyNet,
    start: Instant,
) -> MeshOutcome {
    let o = search_mesh(reduced, cluster, mesh.clone(), opts, so, net, None);
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let mut assignment = fold::expand(f, &o.assignment);
    let mut price = cm.price(&assignment);
    let mut same_as = None;
    for (name, asg, _) in seed_plans(&cm) {
        let p = cm.price(&asg);
        if extract::better(&p, &price) {
            (price, assignment, same_as) = (p, asg, Some(name));
        }
    }
    if so.local_search {
        // Tied moves: one op of the interior block changes one mesh axis's split in every
        // interior block, kept when the whole graph's price improves.
        let n_ops = cm.order().len().max(1);
        let mut work = 0usize;
        'sweeps: for _ in 0..2 {
            let mut improved = false;
            for (i, &rep) in f.ops[1].iter().enumerate() {
                let cur = assignment.strategies.get(&rep).cloned().unwrap_or_else(|| vec![None; mesh.axes.len()]);
                for s in problem::enumerate(&cm, rep) {
                    if s.iter().zip(&cur).filter(|(a, b)| a != b).count() != 1 {
                        continue;
                    }
                    work += n_ops;
                    if work > so.local_search_work || net.expired("local-search") {
                        break 'sweeps;
                    }
                    let mut a = assignment.clone();
                    for b in &f.ops[1..f.len() - 1] {
                        a.strategies.insert(b[i], s.clone());
                    }
                    let p = cm.price(&a);
                    if extract::better(&p, &price) {
                        (price, assignment, same_as, improved) = (p, a, None, true);
                    }
                }
            }
            if !improved {
                break;
            }
        }
    }
    let breakdown = cm.evaluate(&assignment);
    if !breakdown.feasible && so.unfold_when_unfit && could_fit(g, cluster, &mesh, opts) {
        // The reduced graph's memory says little about the whole one: when the folded plan
        // does not fit, search every block.
        let full = search_mesh(g, cluster, mesh.clone(), opts, so, net, None);
        if extract::better(&full.breakdown, &breakdown) {
            return full;
        }
    }
    let summary = MeshSearch {
        step_time_s: breakdown.step_time_s,
        feasible: breakdown.feasible,
        memory_per_device_bytes: breakdown.memory.total() as u64,
        time_s: start.elapsed().as_secs_f64(),
        ..o.summary
    };
    MeshOutcome { assignment, mesh, breakdown, same_as, summary }
}

/// Whether the configuration grid ([`grid`]) runs: on models of repeated blocks (the
/// transformer stacks its configurations are for) as large as folding takes.
/// Returns the blocks' count.
fn grid_blocks(g: &Graph, so: &SearchOptions) -> Option<usize> {
    let order = g.op_nodes().ok()?;
    if so.fold == FoldMode::Never || order.len() < FOLD_MIN_OPS {
        return None;
    }
    fold::find(g, &order, FOLD_MIN_BLOCKS).map(|f| f.len())
}

/// The grid under the search's pipeline mode; it may save memory (what the lowering does not
/// run yet) where the search may ([`SearchOptions::memory_ladder`]).
fn configurations(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
    blocks: usize,
    net: &SafetyNet,
) -> Option<grid::GridPlan> {
    let stages: Option<Vec<usize>> = match so.pipeline {
        PipelineMode::Off => Some(vec![1]),
        PipelineMode::Stages(s) => Some(vec![s]),
        PipelineMode::Auto => None,
    };
    grid::search_grid(g, cluster, devices, opts, stages.as_deref(), blocks, so.memory_ladder, net)
}

impl SearchResult {
    /// A plan made without a search: its mesh, strategies and price, nothing else reported.
    pub fn unsearched(mesh: Mesh, assignment: Assignment, breakdown: Breakdown, same_as: Option<String>) -> Self {
        SearchResult {
            breakdown,
            mesh,
            assignment,
            same_as,
            data_parallel: None,
            data_parallel_unavailable: None,
            meshes: Vec::new(),
            search_time_s: 0.0,
            time_limit_hit: false,
            budget_cut: Vec::new(),
            pipeline: None,
            pipeline_considered: None,
            single_device_memory_bytes: 0.0,
            folded: None,
            rewrites: Vec::new(),
            options: None,
            ladder: Vec::new(),
            context_reason: None,
            grid_flat: None,
        }
    }

    /// With what a search reports beside its plan: data parallelism's price (or why it has
    /// none) and what one device would hold.
    fn with_references(mut self, g: &Graph, cluster: &Cluster, devices: usize, opts: &Options) -> Self {
        match crate::autoshard::named::price(g, cluster, devices, &Named::Data, opts) {
            Ok(p) => self.data_parallel = Some(p.breakdown),
            Err(e) => self.data_parallel_unavailable = Some(e.to_string()),
        }
        self.single_device_memory_bytes = single_device_memory(g, cluster, opts);
        self
    }
}

/// Takes the grid's configuration as the search's plan.
fn adopt_grid(r: &mut SearchResult, gp: grid::GridPlan, opts: &Options) {
    r.mesh = gp.mesh;
    r.assignment = gp.assignment;
    r.breakdown = gp.breakdown;
    r.same_as = Some(gp.config);
    r.context_reason = gp.context_reason;
    r.grid_flat = gp.flat;
    let changed = gp.options.memory_fields() != opts.memory_fields() || gp.options.accumulation != opts.accumulation;
    r.options = changed.then_some(gp.options);
    r.pipeline = gp.pipeline.map(|mut p| {
        p.search_time_s = gp.time_s;
        p
    });
}

/// Whether some plan of `g` on `mesh` might fit: what one device would hold for the whole
/// step, split evenly over the mesh's devices, is a lower bound of any plan's memory per
/// device (a split divides at best; replicas and collectives' buffers only add).
fn could_fit(g: &Graph, cluster: &Cluster, mesh: &Mesh, opts: &Options) -> bool {
    let need = single_device_memory(g, cluster, opts) / mesh.devices() as f64;
    need <= cluster.device.mem_capacity * cluster.device.mem_usable
}

/// Bytes one device would hold for the whole step of `g` on its own.
fn single_device_memory(g: &Graph, cluster: &Cluster, opts: &Options) -> f64 {
    let one = CostModel::new(g, cluster, Mesh::line(1, ir::shard::LinkLevel::Intra), opts.clone());
    one.price(&Assignment::default()).memory.total()
}

/// Searches for the best plan of `g` (shapes inferred) on `devices` devices of `cluster`.
pub fn search(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
) -> Result<SearchResult, String> {
    let start = Instant::now();
    let first = search_once(g, cluster, devices, opts, so)?;
    if first.breakdown.feasible || !so.memory_ladder {
        return Ok(first);
    }
    // No plan fits: each rung of [`memory_ladder`] is searched again (under the same time
    // limit each); the fastest plan that fits wins (a later rung saves more memory, which
    // may let a faster layout fit: ZeRO-sharded data parallelism instead of wide tensor
    // parallelism), else the plan that needs the least.
    let rung_of = |o: &Options, r: &SearchResult| LadderRung {
        options: o.memory_fields(),
        step_time_s: r.breakdown.step_time_s,
        memory_per_device_bytes: r.breakdown.memory.total() as u64,
        feasible: r.breakdown.feasible,
    };
    let mut ladder = vec![rung_of(opts, &first)];
    let mut best = first;
    for rung in memory_ladder(opts) {
        let mut r = search_once(g, cluster, devices, &rung, so)?;
        ladder.push(rung_of(&rung, &r));
        r.options = Some(rung);
        if extract::better(&r.breakdown, &best.breakdown) {
            best = r;
        }
    }
    best.ladder = ladder;
    best.search_time_s = start.elapsed().as_secs_f64();
    Ok(best)
}

/// The options that save memory, in the order the search tries them when no plan fits,
/// each keeping what the caller asked for and the rungs before it: selective recomputation
/// with sequence parallelism (the attention core's `s × s` tensors; a few percent of compute),
/// torchtitan's op-level policy (each block keeps its input and every other linear layer's
/// output), full recomputation (each block keeps only its input; a third more compute), then ZeRO-1
/// (the optimizer state sharded over the data-parallel devices) and ZeRO-3 (the parameters
/// and gradients too, gathered before each use).
pub fn memory_ladder(opts: &Options) -> Vec<Options> {
    use crate::cost::Recompute;
    let rungs = [
        (Recompute::Selective, 0u8),
        (Recompute::Op, 0),
        (Recompute::Full, 0),
        (Recompute::Full, 1),
        (Recompute::Full, 3),
    ];
    let mut out: Vec<Options> = Vec::new();
    for (recompute, zero) in rungs {
        let o = Options {
            recompute: recompute.max(opts.recompute),
            sequence_parallel: true,
            zero: zero.max(opts.zero),
            ..opts.clone()
        };
        let same =
            |a: &Options| a.recompute == o.recompute && a.sequence_parallel == o.sequence_parallel && a.zero == o.zero;
        if !same(opts) && !out.iter().any(same) {
            out.push(o);
        }
    }
    out
}

/// One search with the caller's options ([`search`] without the memory ladder).
fn search_once(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
) -> Result<SearchResult, String> {
    let start = Instant::now();
    let net = SafetyNet::new(so.time_limit, so.clock_scale);
    if let PipelineMode::Stages(s) = so.pipeline
        && !devices.is_multiple_of(s)
    {
        return Err(format!("--pipeline {s}: {s} stages do not divide {devices} devices"));
    }
    let mut grid = grid_blocks(g, so).and_then(|blocks| configurations(g, cluster, devices, opts, so, blocks, &net));
    if so.grid_only
        && let Some(gp) = grid.take_if(|gp| gp.breakdown.feasible)
    {
        let mut r = SearchResult::unsearched(gp.mesh.clone(), gp.assignment.clone(), gp.breakdown.clone(), None)
            .with_references(g, cluster, devices, opts);
        adopt_grid(&mut r, gp, opts);
        r.search_time_s = start.elapsed().as_secs_f64();
        r.time_limit_hit = net.fired() || net.expired("the search's last phase");
        r.budget_cut = net.cut();
        return Ok(r);
    }
    // The grid walked pipelines of every stage count with even stages: where one of its
    // configurations fits, the pipeline search (uneven stage sizes, stages re-planned) runs
    // only when a stage count is asked for.
    let pipelines = match so.pipeline {
        PipelineMode::Auto if grid.as_ref().is_some_and(|gp| gp.breakdown.feasible) => PipelineMode::Off,
        mode => mode,
    };
    // A grid plan that fits: the per-op search looks for faster ones, not for one that fits.
    let grid_fits = grid.as_ref().is_some_and(|gp| gp.breakdown.feasible);
    let intra_so = SearchOptions { unfold_when_unfit: so.unfold_when_unfit && !grid_fits, ..so.clone() };
    // The intra-operator search and the pipeline search are independent: run them side by side.
    let (intra, pipe) = std::thread::scope(|sc| {
        let pipe = sc.spawn(|| pipeline::search_pipeline(g, cluster, devices, opts, so, pipelines, &net));
        let intra = search_intra_with(g, cluster, devices, opts, &intra_so, &net);
        (intra, pipe.join().expect("the pipeline search panicked"))
    });
    let mut r = intra?;
    let pipe = pipe?;
    let take = match (so.pipeline, &pipe) {
        (PipelineMode::Stages(s), None) => {
            return Err(format!("no {s}-stage pipeline fits in device memory"));
        }
        (PipelineMode::Stages(_), Some(_)) => true,
        (_, Some(p)) => extract::better(&p.breakdown, &r.breakdown),
        (_, None) => false,
    };
    if let Some(mut p) = pipe {
        p.requested = matches!(so.pipeline, PipelineMode::Stages(_));
        r.pipeline_considered = Some(PipelineSummary {
            best_step_time_s: p.breakdown.step_time_s,
            tried: p.tried.clone(),
            search_time_s: p.search_time_s,
        });
        if take {
            r.mesh = p.stages[0].sub_mesh.clone();
            r.assignment = p.assignment();
            r.breakdown = p.breakdown.clone();
            r.same_as = None;
            r.pipeline = Some(p);
        }
    }
    if let Some(gp) = grid
        && (r.pipeline.is_none() || !matches!(so.pipeline, PipelineMode::Stages(_)) || gp.pipeline.is_some())
        && extract::better(&gp.breakdown, &r.breakdown)
    {
        adopt_grid(&mut r, gp, opts);
    }
    r.search_time_s = start.elapsed().as_secs_f64();
    // A search can run past the limit between the net's checks: that is a hit too.
    r.time_limit_hit = net.fired() || net.expired("the search's last phase");
    r.budget_cut = net.cut();
    Ok(r)
}

/// [`search`], then each rewrite of [`crate::algebra::SEARCH_CHOICES`] with matches in `g`
/// tried on the whole graph: the rewritten graph is searched too (within what is left of the
/// time limit; folded where it has repeated blocks, unless [`SearchOptions::fold`] is
/// [`FoldMode::Never`]) and kept, in `g`, when its plan is better ([`extract::better`]: faster
/// among plans that fit); for a rule made place by place, so is the graph rewritten only where
/// the two plans price a place cheaper rewritten ([`RewriteChoice::cheaper_at`]). The result
/// says what was tried ([`SearchResult::rewrites`]); its plan is a plan of `g` as it is on
/// return. With [`SearchOptions::rewrites`] off it is [`search`].
pub fn search_rewriting(
    g: &mut Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
) -> Result<SearchResult, String> {
    let start = Instant::now();
    let mut best = search(g, cluster, devices, opts, so)?;
    if !so.rewrites {
        return Ok(best);
    }
    let mut tried = Vec::new();
    // What the time limit cut in any search made here, whichever plan is kept.
    let mut fired = best.time_limit_hit;
    let mut cut: Vec<String> = best.budget_cut.clone();
    let mut note = |r: &SearchResult| {
        fired |= r.time_limit_hit;
        for c in &r.budget_cut {
            if !cut.contains(c) {
                cut.push(c.clone());
            }
        }
    };
    for &rule in crate::algebra::SEARCH_CHOICES {
        let mut h = g.clone();
        let sites = crate::algebra::apply_named(&mut h, rule)?;
        if sites == 0 {
            continue;
        }
        let without = best.breakdown.step_time_s;
        let left = so.time_limit.saturating_sub(start.elapsed());
        if left.is_zero() {
            tried.push(RewriteChoice {
                rule: rule.into(),
                sites,
                with_step_time_s: None,
                without_step_time_s: without,
                ..Default::default()
            });
            continue;
        }
        // The alternative is searched folded (a stack of identical blocks as three of them,
        // within 0.2% of the full search on the shared transformers) unless folding is off:
        // each rule then costs a fraction of the first search.
        let fold = if so.fold == FoldMode::Auto { FoldMode::Always } else { so.fold };
        // Where the graph as written took the grid's configuration, so is the rewritten one
        // searched (the grid alone, unless nothing in it fits).
        let grid_only = so.grid_only || best.same_as.as_deref().is_some_and(crate::autoshard::config::is_config);
        let alt = SearchOptions { time_limit: left, fold, grid_only, ..so.clone() };
        let r = search(&h, cluster, devices, opts, &alt)?;
        note(&r);
        let mut choice = RewriteChoice {
            rule: rule.into(),
            sites,
            with_step_time_s: Some(r.breakdown.step_time_s),
            without_step_time_s: without,
            ..Default::default()
        };
        // Place by place: where the plan of the rewritten graph prices a place's ops (with
        // their reshardings, gradient sync and update) cheaper than the plan without prices
        // the original op, and not everywhere, the graph rewritten at those places only is
        // searched too (the places' costs interact through layouts, so it is searched, not summed).
        let mut partial = None;
        let left = so.time_limit.saturating_sub(start.elapsed());
        if let Some(at) = cheaper_sites(g, rule, &best, &r)
            && !left.is_zero()
        {
            let mut hp = g.clone();
            crate::algebra::apply_named_at(&mut hp, rule, &at)?;
            let rp = search(&hp, cluster, devices, opts, &SearchOptions { time_limit: left, ..alt.clone() })?;
            note(&rp);
            choice.cheaper_at_step_time_s = Some(rp.breakdown.step_time_s);
            choice.cheaper_at = Some(at);
            partial = Some((hp, rp));
        }
        let mut take = extract::better(&r.breakdown, &best.breakdown).then_some((h, r));
        if let Some((hp, rp)) = partial {
            let bar = take.as_ref().map_or(&best.breakdown, |(_, r)| &r.breakdown);
            if extract::better(&rp.breakdown, bar) {
                take = Some((hp, rp));
                choice.applied_at_cheaper = true;
            }
        }
        if let Some((h, r)) = take {
            choice.applied = true;
            *g = h;
            best = r;
        }
        tried.push(choice);
    }
    best.rewrites = tried;
    best.search_time_s = start.elapsed().as_secs_f64();
    // Rules not searched for want of time were cut too, and so is a search that ran past the
    // limit between the net's checks.
    if best.rewrites.iter().any(|c| c.with_step_time_s.is_none()) {
        fired = true;
        cut.push("rewrite alternatives".into());
    }
    best.time_limit_hit = fired || start.elapsed() > so.time_limit;
    best.budget_cut = cut;
    if best.time_limit_hit && best.budget_cut.is_empty() {
        best.budget_cut.push("the search's last phase (it ran past the limit between checks)".into());
    }
    Ok(best)
}

/// The places of rule `rule` in `g` ([`crate::algebra::sites`]) where `with` (the plan of `g`
/// rewritten everywhere) prices the rewritten ops cheaper than `without` (the plan of `g`)
/// prices the original one: `None` unless that is some places but not all, their savings
/// summed promise a faster plan than both, both plans are flat (a pipeline's rows are its
/// stages') and the rule is made place by place.
fn cheaper_sites(g: &Graph, rule: &str, without: &SearchResult, with: &SearchResult) -> Option<Vec<String>> {
    if without.pipeline.is_some() || with.pipeline.is_some() {
        return None;
    }
    let labels = crate::algebra::sites(g, rule)?;
    // A place's ops: the op of its label and those its rewrite labelled `label/…`.
    let cost = |rows: &[crate::cost::OpRow], label: &str| -> f64 {
        let sub = format!("{label}/");
        rows.iter()
            .filter(|o| o.name == label || o.name.starts_with(&sub))
            .map(|o| o.compute_s + o.communication_s + o.grad_sync_s + o.update_s)
            .sum()
    };
    let mut at = Vec::new();
    let mut gain = 0.0;
    for l in &labels {
        let (c0, c1) = (cost(&without.breakdown.ops, l), cost(&with.breakdown.ops, l));
        if c0 > 0.0 && c1 < c0 {
            at.push(l.clone());
            gain += c0 - c1;
        }
    }
    // Searched only when the places' savings, summed, promise a plan 0.5% faster than both.
    let bar = without.breakdown.step_time_s.min(with.breakdown.step_time_s);
    let promise = without.breakdown.step_time_s - gain < bar * (1.0 - 5e-3);
    (!at.is_empty() && at.len() < labels.len() && promise).then_some(at)
}

/// The intra-operator search alone (no pipelining).
pub fn search_intra(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
) -> Result<SearchResult, String> {
    let net = SafetyNet::new(so.time_limit, so.clock_scale);
    search_intra_with(g, cluster, devices, opts, so, &net)
}

/// [`search_intra`] under a safety net shared with other parts of a search.
pub(crate) fn search_intra_with(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
    net: &SafetyNet,
) -> Result<SearchResult, String> {
    let start = Instant::now();
    let meshes = match &so.meshes {
        Some(m) if !m.is_empty() => m.clone(),
        _ => meshes::candidates(cluster, devices)?,
    };
    for m in &meshes {
        if m.devices() != devices {
            return Err(format!("mesh {} has {} devices, not {devices}", mesh_string(m), m.devices()));
        }
    }
    let order = g.op_nodes().map_err(|_| "the graph has a cycle".to_string())?;
    if order.is_empty() {
        // Nothing computes (the outputs are inputs or constants): every device holds them.
        let cm = crate::cost::CostModel::new(g, cluster, meshes[0].clone(), opts.clone());
        let assignment = Assignment::default();
        return Ok(SearchResult {
            breakdown: cm.evaluate(&assignment),
            mesh: meshes[0].clone(),
            assignment,
            same_as: Some("nothing to compute".into()),
            data_parallel: None,
            data_parallel_unavailable: Some("the model computes nothing: its outputs are inputs or constants".into()),
            meshes: Vec::new(),
            search_time_s: start.elapsed().as_secs_f64(),
            time_limit_hit: false,
            budget_cut: Vec::new(),
            pipeline: None,
            pipeline_considered: None,
            single_device_memory_bytes: 0.0,
            rewrites: Vec::new(),
            options: None,
            ladder: Vec::new(),
            context_reason: None,
            grid_flat: None,
            folded: None,
        });
    }
    // Repeated blocks: searched as three (see `fold`).
    let folding = match so.fold {
        FoldMode::Never => None,
        FoldMode::Auto if order.len() < FOLD_MIN_OPS => None,
        _ => fold::find(g, &order, FOLD_MIN_BLOCKS).map(|f| {
            let reduced = fold::reduce(g, &f);
            (f, reduced)
        }),
    };
    let folded = folding
        .as_ref()
        .map(|(f, _)| format!("{} repeated blocks {} … {} searched as 3", f.len(), f.names[0], f.names[f.len() - 1]));
    // Meshes in parallel, results in mesh order.
    let threads = so.threads.clamp(1, meshes.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut outcomes: Vec<Option<MeshOutcome>> = (0..meshes.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if i >= meshes.len() {
                            break;
                        }
                        let mesh = mesh_string(&meshes[i]);
                        so.progress.emit(SearchEvent::MeshStarted { mesh: mesh.clone(), index: i, of: meshes.len() });
                        let o = search_mesh(g, cluster, meshes[i].clone(), opts, so, net, folding.as_ref());
                        so.progress.emit(SearchEvent::MeshDone {
                            mesh,
                            step_time_s: o.breakdown.step_time_s,
                            feasible: o.breakdown.feasible,
                        });
                        done.push((i, o));
                    }
                    done
                })
            })
            .collect();
        for h in handles {
            for (i, o) in h.join().expect("a search thread panicked") {
                outcomes[i] = Some(o);
            }
        }
    });
    let outcomes: Vec<MeshOutcome> = outcomes.into_iter().map(|o| o.expect("every mesh searched")).collect();
    let summaries: Vec<MeshSearch> = outcomes.iter().map(|o| o.summary.clone()).collect();
    let mut best: Option<MeshOutcome> = None;
    for o in outcomes {
        if best.as_ref().is_none_or(|b| extract::better(&o.breakdown, &b.breakdown)) {
            best = Some(o);
        }
    }
    let best = best.expect("at least one mesh");
    Ok(SearchResult {
        meshes: summaries,
        search_time_s: start.elapsed().as_secs_f64(),
        time_limit_hit: net.fired() || net.expired("the search's last phase"),
        budget_cut: net.cut(),
        folded,
        ..SearchResult::unsearched(best.mesh, best.assignment, best.breakdown, best.same_as)
            .with_references(g, cluster, devices, opts)
    })
}

/// The search as a pass: plans the graph (shapes inferred) and writes the plan onto it as
/// annotations (see [`plan::annotate`]); the result is kept for the caller in `result`.
pub struct Autoshard {
    /// The machine.
    pub cluster: Cluster,
    /// Devices to use.
    pub devices: usize,
    /// Cost-model options.
    pub options: Options,
    /// Search knobs.
    pub search: SearchOptions,
    /// The last result.
    pub result: Rc<RefCell<Option<SearchResult>>>,
}

impl crate::Pass for Autoshard {
    fn name(&self) -> &'static str {
        "autoshard"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut crate::PassCx<'_>) -> Result<crate::Changed, crate::PassError> {
        let r = search_rewriting(g, &self.cluster, self.devices, &self.options, &self.search)
            .map_err(|e| crate::PassError::new("autoshard", crate::Located::global(e)))?;
        let (meshes, stage_of) = plan::stage_meshes(&r);
        plan::annotate_graph(g, &meshes, &stage_of, &r.assignment);
        plan::set_mesh_metadata(cx.metadata, &meshes);
        cx.stats.add("autoshard.egraph_nodes", r.meshes.iter().map(|m| m.egraph.nodes as u64).sum());
        cx.stats.add("autoshard.meshes", r.meshes.len() as u64);
        *self.result.borrow_mut() = Some(r);
        Ok(crate::Changed::Yes)
    }
}
