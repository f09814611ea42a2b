//! Pipeline search: cut the topological order into S contiguous stages, each on its own
//! sub-mesh and sharded by the intra-op search, with M micro-batches under a GPipe or 1F1B
//! schedule and optional activation recomputation per stage.
//!
//! How it works (BaPipe's balanced partition, Alpa's inter-/intra-operator split):
//! 1. For each sub-mesh size d a stage may have, the intra-op search (the e-graph and its
//!    extraction) plans the whole graph at a micro-batch size on d devices. That plan prices
//!    every op on d devices: forward and backward time with its own communication, kept
//!    activations, parameter memory, gradient synchronisation, update; and every tensor that
//!    would cross a cut, in its layout there. For other micro-batch sizes the same strategies
//!    are re-priced on the re-batched graph.
//! 2. A dynamic program over cut positions × stage sizes (device offsets keep stages inside
//!    node boundaries) minimises the slowest stage's time per micro-batch, `f + b` plus the
//!    point-to-point sends to its neighbours, under per-device memory: parameters, activations
//!    of the micro-batches in flight (GPipe keeps M, 1F1B `min(M, S − s)`), workspace. A stage
//!    that does not fit may recompute: it keeps only its input per micro-batch and pays its
//!    forward again in the backward pass. A second pass keeps that bottleneck and raises the
//!    fastest stage (balance).
//! 3. Every (S, M, schedule) is priced as a whole step: makespan `(M + S − 1)` slots, gradient
//!    synchronisation not hidden behind later stages' backward, the update, the input.
//!
//! 4. The best configuration's stages are searched again, each on a graph of its own ops
//!    ([`stage_graph`]) on its sub-mesh at the micro-batch size (Alpa's stage-mesh
//!    intra-op pass), their plans taken all at once or stage by stage where a stage gets
//!    faster, and cut again on the new prices; kept when the step drops.
//!
//! The exactness of step 2 for a given table is tested against brute force over all cuts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use ir::shard::{LinkLevel, Mesh, OpStrategy, strategy_valid};
use ir::{Graph, NodeId, Value};
use serde::Serialize;

use crate::cost::Schedule;
use crate::cost::collective::{alpha_beta, send, staging};
use crate::cost::model::{CommEvent, Memory, OpRow, Phase};
use crate::cost::pipeline::graph_batch;
use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options};
use crate::rebatch::{RebatchSpec, rebatch};

use super::{SearchOptions, mesh_string};

mod partition;
mod price;
pub use partition::*;
pub use price::*;

/// Whether and how to pipeline.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PipelineMode {
    /// Never.
    Off,
    /// When it is faster (or the only way to fit).
    Auto,
    /// With exactly this many stages.
    Stages(usize),
}

impl PipelineMode {
    /// Parses `off`, `auto` or a stage count.
    pub fn parse(s: &str) -> Result<PipelineMode, String> {
        match s {
            "off" => Ok(PipelineMode::Off),
            "auto" => Ok(PipelineMode::Auto),
            n => match n.parse::<usize>() {
                Ok(k) if k >= 1 => Ok(if k == 1 { PipelineMode::Off } else { PipelineMode::Stages(k) }),
                _ => Err(format!("--pipeline: `{s}` is not off, auto or a stage count")),
            },
        }
    }
}

/// One stage of a pipeline plan.
#[derive(Clone, Debug, Serialize)]
pub struct StagePlan {
    /// Global device ids.
    pub devices: Vec<usize>,
    /// The stage's own mesh.
    pub mesh: String,
    #[serde(skip)]
    /// The stage's mesh.
    pub sub_mesh: Mesh,
    /// Its ops (first output names), in order.
    pub ops: Vec<String>,
    #[serde(skip)]
    /// Its ops.
    pub nodes: Vec<NodeId>,
    /// First op.
    pub first_op: String,
    /// Last op.
    pub last_op: String,
    /// Forward time per micro-batch (with the send to the next stage), seconds.
    pub forward_s: f64,
    /// Backward time per micro-batch (with recomputation and the send back), seconds.
    pub backward_s: f64,
    /// `forward_s + backward_s`.
    pub time_s: f64,
    /// Recomputes its activations in the backward pass.
    pub recompute: bool,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Bytes per device sent to the next stage per micro-batch.
    pub send_bytes: f64,
    /// Gradient synchronisation inside the stage, seconds.
    pub grad_sync_s: f64,
    #[serde(skip)]
    /// Strategies of its ops on its mesh.
    pub assignment: Assignment,
    #[serde(skip)]
    /// Per-op rows (at the micro-batch size).
    pub rows: Vec<OpRow>,
    #[serde(skip)]
    /// Communication inside the stage.
    pub events: Vec<CommEvent>,
}

/// A configuration the search priced.
#[derive(Clone, Debug, Serialize)]
pub struct Tried {
    /// Stages.
    pub stages: usize,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Schedule.
    pub schedule: String,
    /// Devices per stage.
    pub stage_devices: Vec<usize>,
    /// Step time, seconds (infinite when nothing fits).
    pub step_time_s: f64,
    /// It fits.
    pub feasible: bool,
}

/// A pipeline plan.
#[derive(Clone, Debug)]
pub struct PipelinePlan {
    /// The stages, in order.
    pub stages: Vec<StagePlan>,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Schedule.
    pub schedule: Schedule,
    /// The step's price.
    pub breakdown: Breakdown,
    /// Slowest over fastest stage time.
    pub imbalance: f64,
    /// When the stages are not balanced within 10%: what prevents it.
    pub blocker: Option<String>,
    /// Configurations priced (best of each).
    pub tried: Vec<Tried>,
    /// Seconds.
    pub search_time_s: f64,
    /// The stage count was requested (`--pipeline S`), not chosen.
    pub requested: bool,
    /// Why it runs one whole batch at a time when the graph refused every micro-batch size.
    pub whole_batch: Option<String>,
    /// When stages took the plans of their own ops' search (see `refine_stages`): how many,
    /// and the step with every stage on its size's reference plan, seconds.
    pub replanned: Option<(usize, f64)>,
}

/// What one op costs on a sub-mesh at one micro-batch size.
#[derive(Clone)]
struct Table {
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    act: Vec<f64>,
    param: Vec<f64>,
    /// Gradient bytes per device of the parameters each op reads first.
    grad: Vec<f64>,
    /// Their weights' bytes per device.
    weight: Vec<f64>,
    sync: Vec<f64>,
    update: Vec<f64>,
    /// Bytes per device crossing the cut before op `j` (`j` in `0..=n`), each tensor whole
    /// (between stages of unequal meshes).
    cross: Vec<f64>,
    /// The same when the stages' meshes are equal: each device sends its piece
    /// ([`ir::reshard::send_layout`]).
    cross_piece: Vec<f64>,
    /// The tensors crossing each cut.
    crossing: Vec<Vec<Value>>,
    workspace: f64,
    input_transfer: f64,
    strategies: Vec<OpStrategy>,
    rows: Vec<OpRow>,
    events: Vec<CommEvent>,
}

impl Table {
    /// Bytes per device crossing each cut: pieces between equal meshes, else whole tensors.
    fn crossing_bytes(&self, pieces: bool) -> &[f64] {
        if pieces { &self.cross_piece } else { &self.cross }
    }
}

/// The graph at each micro-batch size the search tries, re-batched once per size.
pub(super) struct MicroGraphs<'g> {
    g: &'g Graph,
    batch: i64,
    cache: HashMap<i64, Arc<Graph>>,
    /// The cost model's analysis of each micro-batch graph, made once.
    analyses: HashMap<i64, Arc<crate::cost::model::Analysis>>,
    /// Why the graph would not take a micro-batch size (the last such size and reason).
    refused: Option<(i64, String)>,
    /// The stage tables [`price_configuration_in`] made, by what they depend on: the
    /// schedule and the stage count's split into cuts do not change them.
    stage_tables: HashMap<StageKey, Arc<StageTable>>,
}

/// What a configuration's stage table depends on: tensor and expert degrees, devices per stage,
/// micro-batch size, the cost-model options (as printed: every field) and the devices busy.
type StageKey = (usize, usize, usize, i64, String, usize);

/// A configuration's stage on its mesh at one micro-batch size: the per-op table (keyed as
/// [`price_cuts`] reads it) and the micro-batch graph it prices.
struct StageTable {
    gm: Arc<Graph>,
    mesh: Mesh,
    tables: HashMap<(usize, i64), Table>,
}

impl<'g> MicroGraphs<'g> {
    /// Micro-batch graphs of `g`, whose batch is `batch`.
    pub(super) fn new(g: &'g Graph, batch: i64) -> MicroGraphs<'g> {
        MicroGraphs {
            g,
            batch,
            cache: HashMap::new(),
            analyses: HashMap::new(),
            refused: None,
            stage_tables: HashMap::new(),
        }
    }

    /// The whole graph's batch.
    pub(super) fn batch(&self) -> i64 {
        self.batch
    }

    fn get(&mut self, mb: i64) -> Option<Graph> {
        self.shared(mb).map(|g| (*g).clone())
    }

    /// The micro-batch graph, shared.
    fn shared(&mut self, mb: i64) -> Option<Arc<Graph>> {
        if let Some(x) = self.cache.get(&mb) {
            return Some(x.clone());
        }
        let mut gm = self.g.clone();
        if mb != self.batch
            && let Err(e) = rebatch(&mut gm, &RebatchSpec::priced_micro_batch(mb))
        {
            self.refused = Some((mb, e.to_string()));
            return None;
        }
        let gm = Arc::new(gm);
        self.cache.insert(mb, gm.clone());
        Some(gm)
    }

    /// [`MicroGraphs::shared`] with the graph's cost-model analysis.
    fn analyzed(&mut self, mb: i64) -> Option<(Arc<Graph>, Arc<crate::cost::model::Analysis>)> {
        let gm = self.shared(mb)?;
        let a = self.analyses.entry(mb).or_insert_with(|| Arc::new(crate::cost::model::Analysis::of(&gm))).clone();
        Some((gm, a))
    }
}

/// The options of the intra-op searches a pipeline search runs for its stages: smaller
/// budgets, one thread each, no pipeline, rewrites or local search of their own.
fn stage_search_options(so: &SearchOptions) -> SearchOptions {
    SearchOptions {
        meshes: None,
        pipeline: PipelineMode::Off,
        threads: 1,
        beam: so.beam.min(256),
        per_op_strategies: so.per_op_strategies.min(24),
        local_search: false,
        local_search_work: 0,
        exhaustive_limit: so.exhaustive_limit,
        node_limit: so.node_limit.min(150_000),
        time_limit: so.time_limit,
        clock_scale: so.clock_scale,
        // The stages' searches are not the search the user watches.
        progress: Default::default(),
        fold: so.fold,
        rewrites: false,
        memory_ladder: false,
        grid_only: false,
        unfold_when_unfit: so.unfold_when_unfit,
    }
}

/// A reference plan per sub-mesh size a stage may get (the even share, half and double it),
/// each searched on the whole graph at the micro-batch size of its most natural configuration;
/// keyed by device count, strategies keyed by first-output name. Searches run on `so.threads`.
#[allow(clippy::too_many_arguments)]
fn reference_plans(
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
    net: &super::SafetyNet,
    stage_counts: &[usize],
    batch: i64,
    micro_graph: &mut dyn FnMut(i64) -> Option<Graph>,
) -> (HashMap<usize, HashMap<String, OpStrategy>>, HashMap<usize, Mesh>) {
    // Sub-mesh sizes, and the reference plan of each (at the micro-batch size of its most
    // natural configuration).
    let mut sizes: Vec<usize> = Vec::new();
    for &s in stage_counts {
        let d = devices / s;
        for x in [d, d / 2, d * 2] {
            // A stage never has every device (the others would have none).
            if x >= 1 && x < devices && valid_size(cluster, x) && !sizes.contains(&x) {
                sizes.push(x);
            }
        }
    }
    sizes.sort_unstable();
    let inner = stage_search_options(so);
    let mut reference: HashMap<usize, HashMap<String, OpStrategy>> = HashMap::new();
    let mut meshes: HashMap<usize, Mesh> = HashMap::new();
    let jobs: Vec<(usize, Graph, Mesh)> = sizes
        .iter()
        .filter_map(|&d| {
            let mesh = cluster.mesh(d).ok()?;
            let mb = divisor_at_most(batch, (batch / (2 * (devices / d)) as i64).max(1));
            // (The whole batch where the graph takes no micro-batch.)
            let gm = micro_graph(mb).or_else(|| micro_graph(batch))?;
            Some((d, gm, mesh))
        })
        .collect();
    let results: Vec<(usize, Mesh, HashMap<String, OpStrategy>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .chunks(jobs.len().div_ceil(so.threads.max(1)).max(1))
            .map(|chunk| {
                let inner = inner.clone();
                sc.spawn(move || {
                    chunk
                        .iter()
                        .filter_map(|(d, gm, mesh)| {
                            let so = SearchOptions { meshes: Some(vec![mesh.clone()]), ..inner.clone() };
                            // A stage holds about 1/S of the model: plan the whole graph on d
                            // devices with S times the memory, and check each stage's own
                            // memory in the partition.
                            let mut roomy = cluster.clone();
                            roomy.device.mem_capacity *= (devices / d) as f64;
                            let r = super::search_intra_with(gm, &roomy, *d, opts, &so, net).ok()?;
                            let map: HashMap<String, OpStrategy> = r
                                .assignment
                                .strategies
                                .iter()
                                .filter_map(|(n, s)| Some((gm.node(*n).outputs().first()?.name.clone(), s.clone())))
                                .collect();
                            Some((*d, mesh.clone(), map))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a pipeline search thread panicked")).collect()
    });
    for (d, mesh, map) in results {
        reference.insert(d, map);
        meshes.insert(d, mesh);
    }

    (reference, meshes)
}

/// The pipelines `search_pipeline` prices under `mode`: the stage counts (dividing the
/// devices, at most the ops), the batch, and per stage count the micro-batch counts (1, 2, 4
/// and 8 per stage that divide the batch). `None` where no pipeline applies (off, no batch,
/// too few ops); `Err` where a requested one cannot be.
#[allow(clippy::type_complexity)]
fn configurations(
    g: &Graph,
    devices: usize,
    mode: PipelineMode,
) -> Result<Option<(Vec<usize>, i64, Vec<(usize, usize)>)>, String> {
    let stage_counts: Vec<usize> = match mode {
        PipelineMode::Off => return Ok(None),
        PipelineMode::Stages(s) => {
            if !devices.is_multiple_of(s) {
                return Err(format!("--pipeline {s}: {s} stages do not divide {devices} devices"));
            }
            vec![s]
        }
        PipelineMode::Auto => (2..=devices.min(16)).filter(|s| devices.is_multiple_of(*s)).collect(),
    };
    let Some(batch) = graph_batch(g) else {
        return match mode {
            PipelineMode::Stages(_) => {
                Err("--pipeline: the model has no input with a batch dim to split into micro-batches".into())
            }
            _ => Ok(None),
        };
    };
    let n_ops = g.op_nodes().map_err(|_| "the graph has a cycle".to_string())?.len();
    let stage_counts: Vec<usize> = stage_counts.into_iter().filter(|&s| s <= n_ops).collect();
    if stage_counts.is_empty() {
        return match mode {
            PipelineMode::Stages(s) => Err(format!("--pipeline {s}: the model has only {n_ops} ops")),
            _ => Ok(None),
        };
    }
    // Configurations: stage count, micro-batch count, stage sizes.
    let mut configs: Vec<(usize, usize)> = Vec::new(); // (stages, micro)
    for &s in &stage_counts {
        let mut ms: Vec<usize> = [1usize, 2, 4, 8].iter().map(|k| k * s).filter(|&m| batch % m as i64 == 0).collect();
        if ms.is_empty() && batch >= 1 {
            ms.push(batch as usize);
        }
        for m in ms {
            configs.push((s, m));
        }
    }
    Ok(Some((stage_counts, batch, configs)))
}

/// Searches pipelines of `g` on `devices` devices. `None` when the model cannot be
/// pipelined (no batch dim, or too few ops), with the reason.
pub fn search_pipeline(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
    mode: PipelineMode,
    net: &super::SafetyNet,
) -> Result<Option<PipelinePlan>, String> {
    let start = Instant::now();
    let Some((stage_counts, batch, configs)) = configurations(g, devices, mode)? else { return Ok(None) };
    let graphs = std::cell::RefCell::new(MicroGraphs::new(g, batch));
    let mut micro_graph = |mb: i64| graphs.borrow_mut().get(mb);
    let (reference, meshes) = reference_plans(cluster, devices, opts, so, net, &stage_counts, batch, &mut micro_graph);

    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    let mut tables: HashMap<(usize, i64), Table> = HashMap::new();
    let mut best: Option<PipelinePlan> = None;
    let mut tried: Vec<Tried> = Vec::new();
    // How the best plan was made, to re-plan its stages.
    let mut recipe: Option<Recipe> = None;
    let consider = |plan: Option<PipelinePlan>,
                    s: usize,
                    m: usize,
                    schedule: Schedule,
                    shape: Vec<usize>,
                    best: &mut Option<PipelinePlan>,
                    tried: &mut Vec<Tried>| {
        let (step, feasible) = plan.as_ref().map_or((f64::INFINITY, false), |p| (p.breakdown.step_time_s, true));
        so.progress.emit(super::SearchEvent::PipelinePriced { stages: s, micro_batches: m, step_time_s: step });
        tried.push(Tried {
            stages: s,
            micro_batches: m,
            schedule: schedule.name(),
            stage_devices: shape,
            step_time_s: step,
            feasible,
        });
        if let Some(p) = plan
            && best.as_ref().is_none_or(|b| p.breakdown.step_time_s < b.breakdown.step_time_s)
        {
            *best = Some(p);
            return true;
        }
        false
    };
    for &s in &stage_counts {
        let d0 = devices / s;
        if !reference.contains_key(&d0) {
            continue;
        }
        let mut best_m: Option<(f64, usize)> = None;
        let mut ms: Vec<usize> = configs.iter().filter(|c| c.0 == s).map(|c| c.1).collect();
        let mut k = 0;
        let mut cut = false;
        while k < ms.len() {
            let m = ms[k];
            k += 1;
            if net.expired("pipeline") {
                break;
            }
            let mb = batch / m as i64;
            let Some(gm) = micro_graph(mb) else {
                // The graph takes no micro-batch (a BatchNorm in training mode): the stages
                // still split the model and its memory, one whole batch at a time.
                if k == ms.len() && !cut && !ms.contains(&1) {
                    ms.push(1);
                }
                continue;
            };
            cut = true;
            tables.entry((d0, mb)).or_insert_with(|| table(&gm, cluster, &meshes[&d0], devices, opts, &reference[&d0]));
            let t = &tables[&(d0, mb)];
            let bounds = unit_bounds(t, FINE_UNITS);
            let units = Units::new(t, &bounds, true);
            for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
                let cuts = partition_on(cluster, devices, &[&units], &[d0], s, m, schedule, capacity, true);
                let plan = cuts.as_ref().and_then(|cuts| {
                    price_cuts(
                        &gm,
                        g,
                        cluster,
                        opts,
                        &tables,
                        &[d0],
                        cuts,
                        &bounds,
                        mb,
                        s,
                        m,
                        schedule,
                        capacity,
                        &meshes,
                        true,
                    )
                });
                if let Some(p) = &plan
                    && best_m.is_none_or(|(t, _)| p.breakdown.step_time_s < t)
                {
                    best_m = Some((p.breakdown.step_time_s, m));
                }
                if consider(plan, s, m, schedule, vec![d0; s], &mut best, &mut tried) {
                    recipe =
                        cuts.map(|cuts| Recipe { mb, sizes: vec![d0], cuts, bounds: bounds.clone(), s, m, schedule });
                }
            }
        }
        // Stages of different sizes (half and double the even share), at the best micro-batch
        // count, on coarser units.
        let Some((_, m)) = best_m else { continue };
        let mb = batch / m as i64;
        let sizes: Vec<usize> = [d0 / 2, d0, d0 * 2]
            .into_iter()
            .filter(|&d| d >= 1 && d <= devices && reference.contains_key(&d))
            .collect();
        if sizes.len() < 2 || net.expired("pipeline") {
            continue;
        }
        let Some(gm) = micro_graph(mb) else { continue };
        for &d in &sizes {
            tables.entry((d, mb)).or_insert_with(|| table(&gm, cluster, &meshes[&d], devices, opts, &reference[&d]));
        }
        let bounds = unit_bounds(&tables[&(d0, mb)], COARSE_UNITS);
        // (Stages of unequal meshes send whole tensors.)
        let units: Vec<Units> = sizes.iter().map(|d| Units::new(&tables[&(*d, mb)], &bounds, false)).collect();
        for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
            let units: Vec<&Units> = units.iter().collect();
            let Some(cuts) = partition_on(cluster, devices, &units, &sizes, s, m, schedule, capacity, true) else {
                continue;
            };
            let shape: Vec<usize> = cuts.iter().map(|c| sizes[c.size]).collect();
            if shape.iter().all(|&d| d == d0) {
                continue; // the uniform case, already priced on finer units
            }
            let plan = price_cuts(
                &gm, g, cluster, opts, &tables, &sizes, &cuts, &bounds, mb, s, m, schedule, capacity, &meshes, true,
            );
            if consider(plan, s, m, schedule, shape, &mut best, &mut tried) {
                recipe = Some(Recipe { mb, sizes: sizes.clone(), cuts, bounds: bounds.clone(), s, m, schedule });
            }
        }
    }
    // The best plan's stages searched again on their own ops (the reference plans priced each
    // stage as its sub-mesh's plan of the whole graph), kept when the step drops.
    if let (Some(b), Some(r)) = (&best, &recipe)
        && !net.expired("pipeline")
        && let Some(gm) = micro_graph(r.mb)
        && let Some((mut p, changed)) =
            refine_stages(&gm, g, cluster, devices, opts, so, net, &reference, &meshes, &tables, r, b, capacity)
        && p.breakdown.feasible
        && p.breakdown.step_time_s < b.breakdown.step_time_s
    {
        p.replanned = Some((changed, b.breakdown.step_time_s));
        best = Some(p);
    }
    // A requested pipeline whose every micro-batch size the graph refused: say why, not
    // that nothing fits.
    let graphs = graphs.into_inner();
    if let (PipelineMode::Stages(s), None, true, Some((mb, why))) =
        (mode, &best, graphs.cache.is_empty(), &graphs.refused)
    {
        return Err(format!("--pipeline {s}: the batch of {batch} does not cut into micro-batches of {mb}: {why}"));
    }
    let best = best.map(|p| (p.breakdown.step_time_s, true, p));
    Ok(best.map(|(_, _, mut p)| {
        p.tried = tried;
        p.search_time_s = start.elapsed().as_secs_f64();
        if p.micro_batches == 1 && batch > 1 {
            p.whole_batch = graphs.refused.clone().map(|(_, why)| why);
        }
        p
    }))
}

/// How a pipeline plan was made: its micro-batch size, stage sizes, cuts over units of
/// `bounds`, stage and micro-batch counts, schedule.
struct Recipe {
    mb: i64,
    sizes: Vec<usize>,
    cuts: Vec<Cut>,
    bounds: Vec<usize>,
    s: usize,
    m: usize,
    schedule: Schedule,
}

/// The ops `stage` of `gm` (topological `order`) as a graph of their own: each value they
/// read from an op of another stage becomes a graph input of its name and type, what another
/// stage (or the model) reads of theirs a graph output; what every stage computes for itself
/// (shapes, masks from constants) stays; inputs and initializers no kept op reads go.
pub(crate) fn stage_graph(gm: &Graph, order: &[NodeId], stage: &[NodeId]) -> Graph {
    let everywhere = ir::reshard::computed_everywhere_in_training(gm, order);
    let own: std::collections::HashSet<NodeId> = stage.iter().copied().collect();
    let keep: std::collections::HashSet<NodeId> =
        own.iter().copied().chain(order.iter().copied().filter(|n| everywhere.contains(n))).collect();
    let mut sub = gm.clone();
    // Graph outputs: the model's outputs the stage computes, and what other stages read.
    let mut outputs: Vec<ir::GraphOutput> =
        gm.outputs().iter().filter(|o| own.contains(&o.value.node)).cloned().collect();
    let mut listed: std::collections::HashSet<Value> = outputs.iter().map(|o| o.value).collect();
    for &n in stage {
        for slot in 0..gm.node(n).num_outputs() {
            let v = Value::new(n, slot as u16);
            if gm.users(v).iter().any(|(u, _)| !keep.contains(u)) && listed.insert(v) {
                outputs.push(ir::GraphOutput { value: v, ty: gm.value_type(v).cloned() });
            }
        }
    }
    sub.set_outputs(outputs);
    let mut renames = Vec::new();
    for &n in order.iter().filter(|n| !keep.contains(n)) {
        for slot in 0..gm.node(n).num_outputs() {
            let v = Value::new(n, slot as u16);
            if gm.users(v).iter().any(|(u, _)| keep.contains(u)) {
                let name = gm.value_name(v).to_string();
                let input = sub.add_input(sub.fresh_name(&name), gm.value_type(v).cloned());
                sub.replace_all_uses(v, input);
                renames.push((input, name));
            }
        }
    }
    for &n in order.iter().rev().filter(|n| !keep.contains(n)) {
        sub.remove_node(n);
    }
    for (v, name) in renames {
        sub.rename(v, name);
    }
    let outputs: std::collections::HashSet<Value> = sub.outputs().iter().map(|o| o.value).collect();
    let unread: Vec<NodeId> = sub
        .initializers()
        .iter()
        .chain(sub.inputs())
        .copied()
        .filter(|&i| sub.users(Value::new(i, 0)).is_empty() && !outputs.contains(&Value::new(i, 0)))
        .collect();
    for i in unread {
        sub.remove_node(i);
    }
    sub
}

/// The strategies of ops `order[a..b]` of `gm`, searched on their own graph ([`stage_graph`])
/// on `mesh` (`d` devices) with options `inner`, keyed by first output name; `None` when the
/// search fails.
#[allow(clippy::too_many_arguments)]
fn stage_own_plan(
    gm: &Graph,
    order: &[NodeId],
    (a, b): (usize, usize),
    cluster: &Cluster,
    (d, mesh): (usize, &Mesh),
    opts: &Options,
    inner: &SearchOptions,
    net: &super::SafetyNet,
) -> Option<HashMap<String, OpStrategy>> {
    let sub = stage_graph(gm, order, &order[a..b]);
    let so = SearchOptions { meshes: Some(vec![mesh.clone()]), ..inner.clone() };
    let res = super::search_intra_with(&sub, cluster, d, opts, &so, net).ok()?;
    let names: std::collections::HashSet<&str> =
        order[a..b].iter().filter_map(|&n| gm.node(n).outputs().first().map(|o| o.name.as_str())).collect();
    Some(
        res.assignment
            .strategies
            .iter()
            .filter_map(|(n, s)| {
                let name = sub.node(*n).outputs().first()?.name.as_str();
                names.contains(name).then(|| (name.to_string(), s.clone()))
            })
            .collect(),
    )
}

/// The pipeline `r` with each stage's ops searched again on their own graph
/// ([`stage_graph`]) on the stage's sub-mesh at the micro-batch size, in place of the
/// reference plan of that many devices: every stage's own plan at once, and (the stage's
/// search prices one step of its ops alone, not the pipeline's slots and exposed
/// synchronisation) stage by stage where the stage gets faster and the step no slower; each
/// cut again on its new prices. `reference_tables` and `reference_plan` are the search's own
/// tables at `r`'s micro-batch size and the plan `r` made from them. The fastest of those, and
/// how many stages took their own plan (`None` when no stage's plan differs or none is faster).
#[allow(clippy::too_many_arguments)]
fn refine_stages(
    gm: &Graph,
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
    net: &super::SafetyNet,
    reference: &HashMap<usize, HashMap<String, OpStrategy>>,
    meshes: &HashMap<usize, Mesh>,
    reference_tables: &HashMap<(usize, i64), Table>,
    r: &Recipe,
    reference_plan: &PipelinePlan,
    capacity: f64,
) -> Option<(PipelinePlan, usize)> {
    let order = gm.op_nodes().ok()?;
    let inner = stage_search_options(so);
    // Each stage's own strategies, where they differ from the reference's.
    let mut own: Vec<Option<HashMap<String, OpStrategy>>> = Vec::with_capacity(r.cuts.len());
    for cut in &r.cuts {
        if net.expired("pipeline") {
            return None;
        }
        let d = r.sizes[cut.size];
        let (a, b) = (r.bounds[cut.start], r.bounds[cut.end]);
        let found = stage_own_plan(gm, &order, (a, b), cluster, (d, &meshes[&d]), opts, &inner, net)
            .filter(|map| map.iter().any(|(k, s)| reference[&d].get(k) != Some(s)));
        own.push(found);
    }
    if own.iter().all(Option::is_none) {
        return None;
    }
    let price = |tables: &HashMap<(usize, i64), Table>, cuts: &[Cut]| {
        price_cuts(
            gm, g, cluster, opts, tables, &r.sizes, cuts, &r.bounds, r.mb, r.s, r.m, r.schedule, capacity, meshes, true,
        )
    };
    let step = |p: &PipelinePlan| if p.breakdown.feasible { p.breakdown.step_time_s } else { f64::INFINITY };
    let tables_of = |maps: &HashMap<usize, HashMap<String, OpStrategy>>| -> HashMap<(usize, i64), Table> {
        r.sizes.iter().map(|&d| ((d, r.mb), table(gm, cluster, &meshes[&d], devices, opts, &maps[&d]))).collect()
    };
    // The partition again on `tables`, priced, when it cuts elsewhere.
    let recut = |tables: &HashMap<(usize, i64), Table>| -> Option<PipelinePlan> {
        let pieces = r.sizes.len() == 1;
        let units: Vec<Units> = r.sizes.iter().map(|d| Units::new(&tables[&(*d, r.mb)], &r.bounds, pieces)).collect();
        let units: Vec<&Units> = units.iter().collect();
        partition_on(cluster, devices, &units, &r.sizes, r.s, r.m, r.schedule, capacity, true)
            .filter(|cuts| *cuts != r.cuts)
            .and_then(|cuts| price(tables, &cuts))
    };
    let base: HashMap<usize, HashMap<String, OpStrategy>> =
        r.sizes.iter().map(|&d| (d, reference[&d].clone())).collect();
    let mut tables: HashMap<(usize, i64), Table> =
        r.sizes.iter().map(|&d| ((d, r.mb), reference_tables[&(d, r.mb)].clone())).collect();
    let mut candidates: Vec<(PipelinePlan, usize)> = Vec::new();
    // Every stage's own plan at once.
    let mut all = base.clone();
    for (cut, map) in r.cuts.iter().zip(&own) {
        if let Some(map) = map {
            all.get_mut(&r.sizes[cut.size])?.extend(map.clone());
        }
    }
    let all_tables = tables_of(&all);
    let taken = own.iter().flatten().count();
    candidates.extend(price(&all_tables, &r.cuts).map(|p| (p, taken)));
    candidates.extend(recut(&all_tables).map(|p| (p, taken)));
    // Stage by stage.
    let mut current = base;
    let mut best = reference_plan.clone();
    let mut changed = 0;
    for (i, (cut, map)) in r.cuts.iter().zip(&own).enumerate() {
        let Some(map) = map else { continue };
        let d = r.sizes[cut.size];
        let mut trial = current[&d].clone();
        trial.extend(map.clone());
        let old = tables.insert((d, r.mb), table(gm, cluster, &meshes[&d], devices, opts, &trial))?;
        match price(&tables, &r.cuts) {
            Some(p)
                if step(&p) <= step(&best)
                    && p.stages[i].time_s + p.stages[i].grad_sync_s
                        < best.stages[i].time_s + best.stages[i].grad_sync_s =>
            {
                best = p;
                current.insert(d, trial);
                changed += 1;
            }
            _ => {
                tables.insert((d, r.mb), old);
            }
        }
    }
    if changed > 0 {
        candidates.extend(recut(&tables).map(|p| (p, changed)));
        candidates.push((best, changed));
    }
    candidates.into_iter().min_by(|a, b| step(&a.0).total_cmp(&step(&b.0)))
}

/// The brute-force reference for a search that would plan cuts and stages together, on two
/// stages of `devices / 2` devices at `m` micro-batches under `schedule`: at every cut
/// position between ops, each stage priced on its sub-mesh's whole-graph plan and on its own
/// ops' plan ([`stage_graph`]), all four combinations. The fastest feasible step and its cut
/// (the ops before it form stage 0), or `None` when nothing fits. One intra-op search per
/// stage per cut: for tests and benchmarks on small models, not for the search itself.
pub fn every_cut_two_stages(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    so: &SearchOptions,
    m: usize,
    schedule: Schedule,
) -> Result<Option<(f64, usize)>, String> {
    let net = super::SafetyNet::new(so.time_limit, so.clock_scale);
    let batch = graph_batch(g).ok_or("the model has no batch dim")?;
    if !devices.is_multiple_of(2) || batch % m as i64 != 0 {
        return Err(format!("{devices} devices in 2 stages, {m} micro-batches of {batch}"));
    }
    let (d, mb) = (devices / 2, batch / m as i64);
    let graphs = std::cell::RefCell::new(MicroGraphs::new(g, batch));
    let mut micro_graph = |b: i64| graphs.borrow_mut().get(b);
    let (reference, meshes) = reference_plans(cluster, devices, opts, so, &net, &[2], batch, &mut micro_graph);
    let reference = reference.get(&d).ok_or("no reference plan")?;
    let gm = micro_graph(mb).ok_or("the graph takes no micro-batch")?;
    let order = gm.op_nodes().map_err(|_| "the graph has a cycle".to_string())?;
    let n = order.len();
    let bounds: Vec<usize> = (0..=n).collect();
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    let inner = stage_search_options(so);
    let own = |a: usize, b: usize| {
        stage_own_plan(&gm, &order, (a, b), cluster, (d, &meshes[&d]), opts, &inner, &net).unwrap_or_default()
    };
    let mut best: Option<(f64, usize)> = None;
    for c in 1..n {
        let cuts = [Cut { start: 0, end: c, size: 0, offset: 0 }, Cut { start: c, end: n, size: 0, offset: d }];
        let (first, second) = (own(0, c), own(c, n));
        for (x, y) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut map = reference.clone();
            if x {
                map.extend(first.clone());
            }
            if y {
                map.extend(second.clone());
            }
            let tables: HashMap<(usize, i64), Table> =
                [((d, mb), table(&gm, cluster, &meshes[&d], devices, opts, &map))].into();
            if let Some(p) = price_cuts(
                &gm,
                g,
                cluster,
                opts,
                &tables,
                &[d],
                &cuts,
                &bounds,
                mb,
                2,
                m,
                schedule,
                capacity,
                &meshes,
                true,
            ) && p.breakdown.feasible
                && best.is_none_or(|(t, _)| p.breakdown.step_time_s < t)
            {
                best = Some((p.breakdown.step_time_s, c));
            }
        }
    }
    Ok(best)
}
