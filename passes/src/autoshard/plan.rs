//! The plan: what the search chose, as a versioned JSON document (the contract with codegen
//! and other tools), a per-layer report, and IR annotations that parse back.
//!
//! The JSON schema (`format: "shardc-plan"`, `version: 1`) is documented in the README.

use std::collections::{BTreeMap, HashMap};

use ir::shard::{LinkLevel, Mesh, MeshAxis, Sharding, parse_sharding, sharding_to_string, strategy_shardings};
use ir::{Graph, NodeId, Op, Value};
use serde::{Deserialize, Serialize};

use super::{MeshSearch, SearchResult};
use crate::cost::model::is_host;
use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options};

/// The plan format's name.
pub const FORMAT: &str = "shardc-plan";
/// The plan format's version.
pub const VERSION: u32 = 2;

/// Where the model came from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The file, as given.
    pub path: String,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
    /// The graph's name.
    pub graph: String,
    /// The batch size planned for (the first graph input's leading dim), if known.
    pub batch: Option<i64>,
    /// Graph inputs' shapes as planned (after `--batch` / `--input-shape`).
    pub input_shapes: BTreeMap<String, Vec<i64>>,
}

/// One mesh axis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanAxis {
    /// Name.
    pub name: String,
    /// Devices along it.
    pub size: usize,
    /// `intra` (inside a node) or `inter` (across nodes).
    pub level: String,
}

/// One op's strategy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanOp {
    /// The node's label, or its first output's name.
    pub name: String,
    /// The ONNX op type.
    pub op: String,
    /// Its outputs' names (the first one identifies the op).
    pub outputs: Vec<String>,
    /// Per mesh axis: the index of the iteration dim split over it, or null.
    pub split: Vec<Option<usize>>,
    /// Per mesh axis: that dim's name, or null.
    pub split_names: Vec<Option<String>>,
    /// Readable strategy (`b→nodes, n→gpus` or `replicated`).
    pub strategy: String,
    /// Per input: the layout it needs (`[S(0), R]`), or null for an input it reads whole
    /// from the host (shapes, indices) or an omitted one.
    pub inputs: Vec<Option<String>>,
    /// Per output: the layout it produces.
    pub output_layouts: Vec<String>,
    /// Forward + backward compute, seconds.
    pub compute_s: f64,
    /// Communication attributed to it, seconds.
    pub communication_s: f64,
    /// Activation bytes it keeps per device.
    pub memory_bytes: f64,
    /// The pipeline stage it runs in (0 when the plan does not pipeline).
    pub stage: usize,
    /// Under the interleaved schedule, its model chunk on that stage: it runs in virtual
    /// stage `chunk × stages + stage` ([`super::interleave`]). 0 otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// One pipeline stage (a plan that does not pipeline has one, with every device and op).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanStage {
    /// Global device ids.
    pub devices: Vec<usize>,
    /// The stage's mesh.
    pub mesh: Vec<PlanAxis>,
    /// Its ops (first output names), in order.
    pub ops: Vec<String>,
    /// Forward time per micro-batch (with its sends), seconds.
    pub forward_s: f64,
    /// Backward time per micro-batch (with recomputation and sends), seconds.
    pub backward_s: f64,
    /// `forward_s + backward_s`.
    pub time_s: f64,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Recomputes its activations in the backward pass.
    pub recompute: bool,
    /// Bytes per device sent to the next stage per micro-batch.
    pub send_bytes: f64,
}

/// How the pipeline was chosen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanPipeline {
    /// Slowest over fastest stage time.
    pub imbalance: f64,
    /// What keeps the stages from balancing within 10%, when they do not.
    pub blocker: Option<String>,
    /// What drove the choice (memory or speed).
    pub reason: String,
    /// Configurations priced: stages, micro-batches, schedule, devices per stage, step time.
    pub tried: serde_json::Value,
}

/// One tensor's layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanTensor {
    /// Its name.
    pub name: String,
    /// `input`, `parameter`, `constant` or `activation`.
    pub kind: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// The layout it is produced (or stored) in.
    pub layout: String,
    /// Each device's piece.
    pub local_shape: Vec<i64>,
}

/// One communication the plan inserts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanCollective {
    /// `forward`, `backward` or `gradient`.
    pub phase: String,
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `halo` …
    pub kind: String,
    /// The tensor moved.
    pub tensor: String,
    /// The op it is for, if any.
    pub op: Option<String>,
    /// Layout before and after.
    pub from: String,
    /// Layout after.
    pub to: String,
    /// Mesh axes it runs over.
    pub axes: Vec<String>,
    /// Bytes per device of the tensor the step operates on: the input of an all-reduce,
    /// reduce-scatter or all-to-all, the output of an all-gather, the slab of a halo.
    pub bytes: f64,
    /// Devices in its group.
    #[serde(default)]
    pub group_size: usize,
    /// Bytes each device sends: `(p−1)/p · bytes`, twice that for an all-reduce, the slab
    /// for a halo exchange (its busiest member's).
    #[serde(default)]
    pub bytes_moved: f64,
    /// Seconds.
    pub time_s: f64,
}

/// Search statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanSearch {
    /// Per mesh tried: the e-graph, the extraction, the best plan on it.
    pub meshes: serde_json::Value,
    /// The chosen plan equals this named plan (`data`, `owt`…), if it does.
    pub same_as: Option<String>,
    /// The wall-clock safety net cut the search short.
    pub time_limit_hit: bool,
    /// The work budgets the safety net cut (`egraph`, `dp`, `local-search`, `pipeline` …),
    /// empty when the search ran to its budgets.
    #[serde(default)]
    pub budget_cut: Vec<String>,
    /// The repeated blocks the search folded (see [`super::fold`]), if it folded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folded: Option<String>,
    /// The memory ladder's rungs when no plan fit with the options given
    /// ([`super::memory_ladder`]): each one's best plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_ladder: Vec<super::LadderRung>,
}

/// Where the search's time went. Everything that depends on the machine's speed lives here,
/// so two runs of the same command give the same plan document outside this object.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanTimings {
    /// The whole search, seconds.
    pub search_s: f64,
    /// Per mesh tried, in the order of `search.meshes`.
    pub meshes: Vec<MeshTimings>,
    /// The pipeline search, seconds (null when it did not run).
    pub pipeline_search_s: Option<f64>,
}

/// Where one mesh's search spent its time, seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MeshTimings {
    /// The mesh.
    pub mesh: String,
    /// Everything on this mesh.
    pub total_s: f64,
    /// Growing the e-graph.
    pub egraph_s: f64,
    /// The extraction (dynamic program and local search included).
    pub extraction_s: f64,
    /// The dynamic program.
    pub dp_s: f64,
    /// The local search.
    pub local_search_s: f64,
    /// The lower bound of the dynamic program's objective (only when its beam pruned).
    #[serde(default)]
    pub bound_s: f64,
}

impl PlanTimings {
    /// The timings of a search result.
    pub fn of(r: &SearchResult) -> PlanTimings {
        PlanTimings {
            search_s: r.search_time_s,
            meshes: r
                .meshes
                .iter()
                .map(|m| MeshTimings {
                    mesh: m.mesh.clone(),
                    total_s: m.time_s,
                    egraph_s: m.egraph.time_s,
                    extraction_s: m.extraction.time_s,
                    dp_s: m.extraction.dp_time_s,
                    local_search_s: m.extraction.local_search_time_s,
                    bound_s: m.extraction.bound_time_s,
                })
                .collect(),
            pipeline_search_s: r.pipeline_considered.as_ref().map(|p| p.search_time_s),
        }
    }
}

/// A sharding plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Always `shardc-plan`.
    pub format: String,
    /// Format version.
    pub version: u32,
    /// The model.
    pub model: ModelInfo,
    /// The cluster's name.
    pub cluster: String,
    /// Devices used.
    pub devices: usize,
    /// The device mesh.
    pub mesh: Vec<PlanAxis>,
    /// Cost-model options.
    pub options: serde_json::Value,
    /// Predicted step time of this plan, seconds.
    pub step_time_s: f64,
    /// The same model as pure data parallelism on the cluster's natural mesh, seconds; null
    /// when that does not fit or does not apply.
    pub data_parallel_step_time_s: Option<f64>,
    /// `data_parallel_step_time_s / step_time_s`.
    pub speedup_over_data_parallel: Option<f64>,
    /// The plan fits in device memory.
    pub feasible: bool,
    /// Why not, when it does not.
    pub infeasible_reason: Option<String>,
    /// Memory per device, bytes (the fullest device).
    pub memory_per_device_bytes: u64,
    /// Usable memory per device, bytes.
    pub memory_capacity_bytes: u64,
    /// Memory per device by what holds it (the fullest device).
    #[serde(default)]
    pub memory_breakdown: crate::cost::model::MemoryBreakdown,
    /// The step's breakdown (the `shardc cost --json` keys).
    pub breakdown: serde_json::Value,
    /// Per op (topological order).
    pub ops: Vec<PlanOp>,
    /// Per tensor that has a layout.
    pub tensors: Vec<PlanTensor>,
    /// Inserted communication, in step order.
    pub collectives: Vec<PlanCollective>,
    /// Per phase and kind, the bytes the busiest device sends (`{phase: {kind: bytes}}`);
    /// the lowered program moves the same (`shardc lower --emit json`).
    #[serde(default)]
    pub bytes_moved_per_device: BTreeMap<String, BTreeMap<String, f64>>,
    /// Search statistics.
    pub search: PlanSearch,
    /// Pipeline stages (one when the plan does not pipeline).
    pub stages: Vec<PlanStage>,
    /// Micro-batches per step (1 without pipelining).
    pub micro_batches: usize,
    /// Pipeline schedule (`1f1b`, `gpipe`), or null.
    pub schedule: Option<String>,
    /// How the pipeline was chosen, when the plan pipelines (null otherwise).
    pub pipeline: Option<PlanPipeline>,
    /// The resharding algebra's machine-dependent choices the plan was priced with (the
    /// lowering follows them).
    #[serde(default)]
    pub policy: ir::reshard::Policy,
    /// Where the search's time went (the only part that differs between runs).
    #[serde(default)]
    pub timings: PlanTimings,
    /// The plan in the terms ML engineers use: degrees of parallelism and throughput.
    #[serde(default)]
    pub summary: PlanSummary,
    /// The algebraic rewrites the search tried on the whole graph, with the step time with
    /// and without each; the plan's ops are those of the model with the `applied` ones made
    /// (`lower`, `run` and `train` make them again before applying the plan).
    #[serde(default)]
    pub rewrites: Vec<super::RewriteChoice>,
}

/// What one mesh axis does in a plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AxisUse {
    /// The axis.
    pub axis: String,
    /// Devices along it.
    pub size: usize,
    /// `data` (batch dims), `tensor` (weights' feature or vocabulary dims), `spatial`,
    /// `other`, `mixed` (no kind splits 80% of what the axis splits), `unused`.
    pub kind: String,
    /// Share of the step's FLOPs that ops split over this axis, per kind (`{kind: share}`).
    pub shares: BTreeMap<String, f64>,
}

/// A plan in the terms ML engineers use.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanSummary {
    /// E.g. `data 2 × tensor 4, pipeline 1` or `pipeline 2 × 4 micro-batches (1f1b), stage 0: data 4`.
    pub text: String,
    /// Per axis of the (first stage's) mesh.
    pub axes: Vec<AxisUse>,
    /// Samples per second at the predicted step time.
    pub samples_per_s: Option<f64>,
    /// Tokens per second (sequence models: an integer input of rank 2, `[batch, sequence]`).
    pub tokens_per_s: Option<f64>,
    /// Model FLOPs utilisation: the training step's FLOPs (forward and backward) over the
    /// predicted step time times the devices' peak in the training precision.
    pub mfu: Option<f64>,
    /// Consecutive blocks of the model (by the exporter's module paths, [`ir::scope`]) that
    /// the plan parallelises alike, with their degrees; one region when it is uniform.
    #[serde(default)]
    pub regions: Vec<Region>,
    /// What the plan does to save memory, as a configuration's fields
    /// (`recompute=selective,sp,zero=1`; `none`).
    #[serde(default)]
    pub memory: String,
}

/// Consecutive blocks of a model parallelised alike.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Region {
    /// Its first block.
    pub first: String,
    /// Its last block.
    pub last: String,
    /// Its degrees, e.g. `data 2 × tensor 4`.
    pub degrees: String,
    /// Its share of the step's FLOPs.
    pub flops_share: f64,
}

/// The kind of parallelism splitting a dim of this role is: `data` (batch), `spatial`,
/// `tensor` (a weight's feature or vocabulary dim) or `other`.
pub fn role_kind(r: &ir::shard::DimRole) -> &'static str {
    match r {
        ir::shard::DimRole::Batch => "data",
        ir::shard::DimRole::Spatial => "spatial",
        ir::shard::DimRole::OutFeature | ir::shard::DimRole::InFeature | ir::shard::DimRole::Vocab => "tensor",
        ir::shard::DimRole::Other => "other",
    }
}

/// `kind`, or for a split of a dim without a role of its own (`other`) the kind of its axis in
/// the whole plan (`whole`), when that axis has one kind: the element-wise ops between two
/// tensor-parallel GEMMs are tensor parallel too.
fn inherit_kind<'a>(kind: &'a str, whole: Option<&'a AxisUse>) -> &'a str {
    match whole {
        Some(w) if kind == "other" && !matches!(w.kind.as_str(), "mixed" | "unused") => w.kind.as_str(),
        _ => kind,
    }
}

/// Classifies each mesh axis by the roles of the iteration dims the ops split over it,
/// weighted by each op's training FLOPs.
fn axis_uses(cm: &CostModel<'_>, asg: &Assignment) -> Vec<AxisUse> {
    axis_uses_of(cm, asg, cm.order())
}

/// [`axis_uses`] over the ops of `ops` only.
fn axis_uses_of(cm: &CostModel<'_>, asg: &Assignment, ops: &[NodeId]) -> Vec<AxisUse> {
    let mesh = &cm.mesh;
    let mut total = 0.0;
    let mut per: Vec<BTreeMap<String, f64>> = vec![BTreeMap::new(); mesh.axes.len()];
    for &n in ops {
        let flops = cm.node_cost(n).total_flops();
        total += flops;
        let Some(s) = asg.strategies.get(&n) else { continue };
        let sp = cm.space(n);
        for (a, d) in s.iter().enumerate() {
            let Some(i) = d else { continue };
            let kind = sp.dims.get(*i).map_or("other", |d| role_kind(&d.role));
            if let Some(m) = per.get_mut(a) {
                *m.entry(kind.to_string()).or_insert(0.0) += flops;
            }
        }
    }
    mesh.axes
        .iter()
        .zip(per)
        .map(|(ax, m)| {
            let split: f64 = m.values().sum();
            let shares: BTreeMap<String, f64> = m.into_iter().map(|(k, v)| (k, v / total.max(1e-300))).collect();
            let top = shares.iter().max_by(|a, b| a.1.total_cmp(b.1));
            let kind = match top {
                _ if ax.size <= 1 || split <= 0.0 => "unused".to_string(),
                Some((k, v)) if *v * total >= 0.8 * split => k.clone(),
                _ => "mixed".to_string(),
            };
            AxisUse { axis: ax.name.clone(), size: ax.size, kind, shares }
        })
        .collect()
}

/// What each op of `cm`'s order does under `asg`, in the summary's terms: `data 2 × tensor 4`
/// from the roles of the dims it splits over each mesh axis, `replicated` when it splits none.
/// A dim without a role of its own (an element-wise op's) takes the kind of its axis in
/// `axes` (the plan's [`AxisUse`]s), so the ops between two tensor-parallel GEMMs read as
/// tensor parallel.
pub fn op_kinds(cm: &CostModel<'_>, asg: &Assignment, axes: &[AxisUse]) -> Vec<String> {
    cm.order()
        .iter()
        .map(|&n| {
            let mut by: Vec<(&str, usize)> = Vec::new();
            if let Some(s) = asg.strategies.get(&n) {
                for (a, d) in s.iter().enumerate() {
                    let Some(i) = d else { continue };
                    let own = cm.space(n).dims.get(*i).map_or("other", |d| role_kind(&d.role));
                    let kind = inherit_kind(own, axes.get(a));
                    let size = cm.mesh.axes.get(a).map_or(1, |x| x.size);
                    match by.iter_mut().find(|(k, _)| *k == kind) {
                        Some(e) => e.1 *= size,
                        None => by.push((kind, size)),
                    }
                }
            }
            if by.is_empty() {
                "replicated".to_string()
            } else {
                by.iter().map(|(k, s)| format!("{k} {s}")).collect::<Vec<_>>().join(" × ")
            }
        })
        .collect()
}

/// The regions of a plan: its blocks in model order ([`ir::scope::block_of`] of each op's
/// module path), each with the degrees of its own ops (FLOP-weighted as for the whole plan),
/// consecutive blocks with the same degrees merged; blocks without FLOPs, and glue blocks
/// that split only role-less dims, join the region before them.
fn regions(g: &Graph, cm: &CostModel<'_>, asg: &Assignment, whole: &[AxisUse]) -> Vec<Region> {
    let order = cm.order();
    let paths = ir::scope::module_paths(g, order);
    let mut blocks: Vec<(String, Vec<NodeId>)> = Vec::new();
    for &n in order {
        let b = paths.get(&n).map(|p| ir::scope::block_of(p)).unwrap_or_default();
        match blocks.last_mut() {
            Some((last, ops)) if *last == b => ops.push(n),
            _ => blocks.push((b, vec![n])),
        }
    }
    let flops = |ops: &[NodeId]| ops.iter().map(|&n| cm.node_cost(n).total_flops()).sum::<f64>();
    let total = flops(order).max(1e-300);
    let mut out: Vec<Region> = Vec::new();
    for (b, ops) in blocks {
        let f = flops(&ops);
        let name = if b.is_empty() { "(unnamed)".to_string() } else { b };
        // Dims without a role of their own (an activation's, a pooling's channels) take their
        // axis's kind in the whole plan; a block that splits nothing else (`relu`, `maxpool`
        // between two layers) is glue and joins the region before it.
        let mut uses = axis_uses_of(cm, asg, &ops);
        for (u, w) in uses.iter_mut().zip(whole) {
            u.kind = inherit_kind(&u.kind, Some(w)).to_string();
        }
        let glue = uses.iter().all(|u| matches!(u.kind.as_str(), "other" | "unused"));
        if let Some(r) = out.last_mut()
            && (f <= 0.0 || glue)
        {
            r.last = name;
            r.flops_share += f / total;
            continue;
        }
        if f <= 0.0 {
            continue;
        }
        let d = degrees(&uses);
        match out.last_mut() {
            Some(r) if r.degrees == d => {
                r.last = name;
                r.flops_share += f / total;
            }
            _ => out.push(Region { first: name.clone(), last: name, degrees: d, flops_share: f / total }),
        }
    }
    out
}

/// `data 2 × tensor 4` from axis uses (axes of one kind multiply; `mixed` lists its kinds).
fn degrees(axes: &[AxisUse]) -> String {
    // (kind, detail for a mixed axis, devices)
    let mut by_kind: Vec<(String, String, usize)> = Vec::new();
    for a in axes.iter().filter(|a| a.kind != "unused") {
        let detail = if a.kind == "mixed" {
            let kinds: Vec<String> =
                a.shares.iter().filter(|(_, v)| **v >= 0.005).map(|(k, v)| format!("{k} {:.0}%", v * 100.0)).collect();
            format!(" ({} of the FLOPs)", kinds.join(", "))
        } else {
            String::new()
        };
        match by_kind.iter_mut().find(|(k, d, _)| *k == a.kind && *d == detail) {
            Some(e) => e.2 *= a.size,
            None => by_kind.push((a.kind.clone(), detail, a.size)),
        }
    }
    if by_kind.is_empty() {
        return "replicated (no op split)".into();
    }
    by_kind.iter().map(|(k, d, n)| format!("{k} {n}{d}")).collect::<Vec<_>>().join(" × ")
}

impl PlanSummary {
    fn of(cms: &[CostModel<'_>], cluster: &Cluster, opts: &Options, devices: usize, r: &SearchResult) -> PlanSummary {
        let pipeline = r.pipeline.as_ref().map(|p| (p.stages.len(), p.micro_batches, p.schedule.name()));
        match cms.first() {
            Some(cm) => PlanSummary::new(cm, &r.assignment, cluster, opts, devices, r.breakdown.step_time_s, pipeline),
            None => PlanSummary::default(),
        }
    }

    /// The summary of `asg` on `cm`'s mesh (the first stage's, for a pipeline of `stages ×
    /// micro-batches (schedule)`), at step time `step` on `devices` devices.
    pub fn new(
        cm: &CostModel<'_>,
        asg: &Assignment,
        cluster: &Cluster,
        opts: &Options,
        devices: usize,
        step: f64,
        pipeline: Option<(usize, usize, String)>,
    ) -> PlanSummary {
        let g = cm.g;
        let axes = axis_uses(cm, asg);
        let regions = regions(g, cm, asg, &axes);
        // A plan that parallelises regions of the model differently says so region by
        // region.
        let whole = if axes.iter().any(|a| a.kind == "mixed") && regions.len() > 1 {
            let parts: Vec<String> = regions
                .iter()
                .map(|r| {
                    let span = if r.first == r.last { r.first.clone() } else { format!("{} … {}", r.first, r.last) };
                    format!("{} in {span}", r.degrees)
                })
                .collect();
            format!("mixed: {}", parts.join("; "))
        } else {
            degrees(&axes)
        };
        let text = match pipeline {
            Some((stages, micro, schedule)) if asg.strategies.is_empty() => {
                format!("pipeline {stages} × {micro} micro-batches ({schedule})")
            }
            Some((stages, micro, schedule)) => {
                format!("pipeline {stages} × {micro} micro-batches ({schedule}); stage 0: {whole}")
            }
            None => format!("{whole}, pipeline 1"),
        };
        let batch = crate::cost::pipeline::graph_batch(g).map(|b| b as f64);
        let tokens = g.input_values().into_iter().find_map(|v| {
            let t = g.tensor_type(v)?;
            let d = t.static_dims()?;
            (!t.dtype.is_float() && d.len() == 2).then(|| (d[0] * d[1]) as f64)
        });
        let flops: f64 = cm.order().iter().map(|&n| cm.node_cost(n).total_flops()).sum();
        let peak = cluster.device.peak_flops.at(opts.precision);
        let ok = step > 0.0 && step.is_finite();
        // Sequence parallelism only changes plans with tensor parallelism.
        let tensor = axes.iter().any(|a| a.shares.get("tensor").is_some_and(|&x| x > 0.0));
        let memory = Options { sequence_parallel: opts.sequence_parallel && tensor, ..opts.clone() }.memory_fields();
        PlanSummary {
            text,
            axes,
            samples_per_s: batch.filter(|_| ok).map(|b| b / step),
            tokens_per_s: tokens.filter(|_| ok).map(|t| t / step),
            mfu: (ok && flops > 0.0 && peak > 0.0).then(|| flops / (step * devices as f64 * peak)),
            regions,
            memory,
        }
    }

    /// The `parallelism` and `throughput` lines `plan` and `cost` print.
    pub fn lines(&self) -> String {
        let mut t = format!("parallelism  {}\n", self.text);
        if !self.memory.is_empty() && self.memory != "none" {
            t.push_str(&format!("memory saved {}\n", self.memory));
        }
        let mut rates = Vec::new();
        if let Some(x) = self.samples_per_s {
            rates.push(format!("{x:.1} samples/s"));
        }
        if let Some(x) = self.tokens_per_s {
            rates.push(format!("{x:.0} tokens/s"));
        }
        if let Some(x) = self.mfu {
            rates.push(format!("model FLOPs utilisation {:.1}%", x * 100.0));
        }
        if !rates.is_empty() {
            t.push_str(&format!("throughput   {}\n", rates.join(", ")));
        }
        t
    }
}

fn level_name(l: LinkLevel) -> &'static str {
    match l {
        LinkLevel::Intra => "intra",
        LinkLevel::Inter => "inter",
    }
}

fn value_name(g: &Graph, v: Value) -> String {
    g.value_name(v).to_string()
}

impl Plan {
    /// Builds the plan document of a search result.
    pub fn new(
        g: &Graph,
        cluster: &Cluster,
        devices: usize,
        opts: &Options,
        model: ModelInfo,
        r: &SearchResult,
    ) -> Plan {
        // The options the plan needs, where the search changed them to make it fit.
        let opts = r.options.as_ref().unwrap_or(opts);
        let b = &r.breakdown;
        let dp = r.data_parallel.as_ref().filter(|d| d.feasible).map(|d| d.step_time_s);
        let axes = |m: &Mesh| -> Vec<PlanAxis> {
            m.axes
                .iter()
                .map(|a| PlanAxis { name: a.name.clone(), size: a.size, level: level_name(a.level).into() })
                .collect()
        };
        // The mesh of each op: its stage's.
        let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
        let stage_meshes: Vec<Mesh> = match &r.pipeline {
            Some(p) => {
                for (i, st) in p.stages.iter().enumerate() {
                    for &n in &st.nodes {
                        stage_of.insert(n, i);
                    }
                }
                p.stages.iter().map(|s| s.sub_mesh.clone()).collect()
            }
            None => vec![r.mesh.clone()],
        };
        // Under the interleaved schedule each stage's ops are those of its model chunks.
        let chunks = r.pipeline.as_ref().map_or(1, |p| p.schedule.chunks());
        let virt = super::interleave::virtual_stages(g, &stage_of, stage_meshes.len(), chunks).unwrap_or_default();
        for (n, j) in &virt {
            stage_of.insert(*n, j % stage_meshes.len());
        }
        let cms: Vec<CostModel<'_>> =
            stage_meshes.iter().map(|m| CostModel::new(g, cluster, m.clone(), opts.clone())).collect();
        let (mut ops, tensors) = layouts(&cms, &stage_of, &r.assignment, b);
        if chunks > 1 {
            for op in &mut ops {
                let n = op.outputs.first().and_then(|o| g.lookup(o)).map(|v| v.node);
                op.chunk = n.and_then(|n| virt.get(&n)).map_or(0, |j| j / stage_meshes.len());
            }
        }
        let summary = PlanSummary::of(&cms, cluster, opts, devices, r);
        let stages = match &r.pipeline {
            Some(p) => p
                .stages
                .iter()
                .enumerate()
                .map(|(i, s)| PlanStage {
                    devices: s.devices.clone(),
                    mesh: axes(&s.sub_mesh),
                    ops: if chunks > 1 {
                        ops.iter().filter(|o| o.stage == i).filter_map(|o| o.outputs.first().cloned()).collect()
                    } else {
                        s.ops.clone()
                    },
                    forward_s: s.forward_s,
                    backward_s: s.backward_s,
                    time_s: s.time_s,
                    memory_bytes: s.memory_bytes,
                    recompute: s.recompute,
                    send_bytes: s.send_bytes,
                })
                .collect(),
            None => vec![PlanStage {
                devices: (0..devices).collect(),
                mesh: axes(&r.mesh),
                ops: ops.iter().filter_map(|o| o.outputs.first().cloned()).collect(),
                forward_s: b.forward_s,
                backward_s: b.backward_s,
                time_s: b.forward_s + b.backward_s,
                memory_bytes: b.memory_per_device_bytes.iter().copied().max().unwrap_or(0),
                recompute: false,
                send_bytes: 0.0,
            }],
        };
        let pipeline = r.pipeline.as_ref().map(|p| PlanPipeline {
            imbalance: p.imbalance,
            blocker: p.blocker.clone(),
            reason: pipeline_reason(r, p),
            tried: serde_json::to_value(&p.tried).expect("configurations serialize"),
        });
        Plan {
            format: FORMAT.into(),
            version: VERSION,
            model,
            cluster: cluster.name.clone(),
            devices,
            mesh: axes(&r.mesh),
            options: serde_json::to_value(opts).expect("options serialize"),
            step_time_s: b.step_time_s,
            data_parallel_step_time_s: dp,
            speedup_over_data_parallel: dp.filter(|_| b.feasible).map(|d| d / b.step_time_s),
            feasible: b.feasible,
            infeasible_reason: b.infeasible_reason.clone(),
            memory_per_device_bytes: b.memory_per_device_bytes.iter().copied().max().unwrap_or(0),
            memory_capacity_bytes: b.memory_capacity_bytes,
            memory_breakdown: b.memory.breakdown(),
            breakdown: breakdown_json(b),
            ops,
            tensors,
            collectives: collectives(g, &stage_meshes, &stage_of, b),
            bytes_moved_per_device: b.bytes_moved_per_device.clone(),
            search: PlanSearch {
                meshes: serde_json::to_value::<&[MeshSearch]>(&r.meshes).expect("stats serialize"),
                same_as: r.same_as.clone(),
                time_limit_hit: r.time_limit_hit,
                budget_cut: r.budget_cut.clone(),
                folded: r.folded.clone(),
                memory_ladder: r.ladder.clone(),
            },
            micro_batches: r.pipeline.as_ref().map_or(1, |p| p.micro_batches),
            schedule: r.pipeline.as_ref().map(|p| p.schedule.name().to_string()),
            stages,
            pipeline,
            policy: r.breakdown.policy,
            timings: PlanTimings::of(r),
            summary,
            rewrites: r.rewrites.clone(),
        }
    }

    /// The plan's mesh (the first stage's, when it pipelines).
    pub fn mesh(&self) -> Result<Mesh, String> {
        mesh_of(&self.mesh)
    }

    /// Each stage's mesh.
    pub fn stage_meshes(&self) -> Result<Vec<Mesh>, String> {
        self.stages.iter().map(|s| mesh_of(&s.mesh)).collect()
    }

    /// Reads a plan document, checking its format and version.
    pub fn from_json(text: &str) -> Result<Plan, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        match v.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            Some(f) => return Err(format!("format `{f}` is not `{FORMAT}`")),
            None => return Err(format!("no `format` key; not a {FORMAT} document")),
        }
        match v.get("version").and_then(|f| f.as_u64()) {
            Some(x) if x == VERSION as u64 => {}
            Some(x) => return Err(format!("plan version {x}; this shardc reads version {VERSION}")),
            None => return Err("no `version` key".into()),
        }
        let plan: Plan = serde_json::from_value(v).map_err(|e| format!("malformed plan: {e}"))?;
        plan.validate().map_err(|e| format!("malformed plan: {e}"))?;
        Ok(plan)
    }

    /// Checks what the document says of itself: devices, stages, meshes, micro-batches and
    /// op stages agree (a hand-edited plan is read only when it still describes a placement).
    pub fn validate(&self) -> Result<(), String> {
        const MOST: usize = 1 << 20;
        if self.devices == 0 || self.devices > MOST {
            return Err(format!("`devices` is {}; it must be from 1 to {MOST}", self.devices));
        }
        if self.micro_batches > MOST {
            return Err(format!("`micro_batches` is {}; it must be at most {MOST}", self.micro_batches));
        }
        if self.stages.is_empty() {
            return Err("no stages".into());
        }
        let mut seen = vec![false; self.devices];
        for (i, s) in self.stages.iter().enumerate() {
            let mesh = mesh_of(&s.mesh)?;
            let size = s.mesh.iter().try_fold(1usize, |a, x| a.checked_mul(x.size));
            if s.mesh.iter().any(|a| a.size == 0) || size != Some(s.devices.len()) {
                return Err(format!(
                    "stage {i}: the mesh {} does not cover its {} devices",
                    super::mesh_string(&mesh),
                    s.devices.len()
                ));
            }
            for &d in &s.devices {
                match seen.get_mut(d) {
                    None => return Err(format!("stage {i}: device {d} is not below `devices` ({})", self.devices)),
                    Some(true) => return Err(format!("stage {i}: device {d} is in two places")),
                    Some(x) => *x = true,
                }
            }
        }
        if let Some(d) = seen.iter().position(|x| !x) {
            return Err(format!("device {d} of the plan's {} is in no stage", self.devices));
        }
        if self.stages.len() == 1 && self.mesh != self.stages[0].mesh {
            return Err("the plan's mesh is not its stage's".into());
        }
        if let Some(op) = self.ops.iter().find(|o| o.stage >= self.stages.len()) {
            return Err(format!("op `{}` is in stage {}; the plan has {}", op.name, op.stage, self.stages.len()));
        }
        if let Some(op) = self.ops.iter().find(|o| o.chunk >= self.chunks()) {
            return Err(format!(
                "op `{}` is in model chunk {}; the schedule ({}) has {}",
                op.name,
                op.chunk,
                self.schedule.as_deref().unwrap_or("none"),
                self.chunks()
            ));
        }
        Ok(())
    }

    /// The virtual stage op `op` runs in: `chunk × stages + stage` (its stage without
    /// interleaving).
    pub fn virtual_stage(&self, op: &PlanOp) -> usize {
        op.chunk * self.stages.len() + op.stage
    }

    /// Model chunks per device: `V` under the interleaved schedule (`interleaved:V`), else 1.
    pub fn chunks(&self) -> usize {
        let v = self.schedule.as_deref().and_then(|s| s.strip_prefix("interleaved:")).and_then(|v| v.parse().ok());
        v.unwrap_or(1).max(1)
    }

    /// The plan's strategies as an assignment of `g`'s ops, matching ops by their first
    /// output's name. Errors name ops the plan does not cover or whose strategy does not fit.
    pub fn assignment(&self, g: &Graph) -> Result<Assignment, String> {
        self.stage_assignment(g).map(|(a, _)| a)
    }

    /// [`Plan::assignment`] with each op's pipeline stage (its virtual stage
    /// `chunk × stages + stage` under the interleaved schedule): the one step from the plan's
    /// names to a graph's nodes.
    pub fn stage_assignment(&self, g: &Graph) -> Result<(Assignment, HashMap<NodeId, usize>), String> {
        self.stage_assignment_with(g, false)
    }

    /// [`Plan::stage_assignment`] of a graph that is not canonicalized (what `train` runs: its
    /// parameters must stay the model's own): ops computed from constants alone, which
    /// canonicalization folds into the constants the plan was made with, need no strategy
    /// and get none; every other op must have one that fits.
    pub fn stage_assignment_uncanonical(&self, g: &Graph) -> Result<(Assignment, HashMap<NodeId, usize>), String> {
        self.stage_assignment_with(g, true)
    }

    fn stage_assignment_with(
        &self,
        g: &Graph,
        constants_folded: bool,
    ) -> Result<(Assignment, HashMap<NodeId, usize>), String> {
        let diffs = self.differences(g, constants_folded);
        if !diffs.is_empty() {
            return Err(differences_message(&diffs));
        }
        let meshes: Vec<Mesh> = self.stages.iter().map(|s| mesh_of(&s.mesh)).collect::<Result<Vec<_>, String>>()?;
        let by_output: BTreeMap<&str, &PlanOp> =
            self.ops.iter().filter_map(|o| Some((o.outputs.first()?.as_str(), o))).collect();
        let mut asg = Assignment::default();
        let mut stage_of = HashMap::new();
        // The values shape inference folds to constants (a Shape of a static shape, ops of
        // constants): canonicalization made them constants of the plan's graph.
        let folded = if constants_folded {
            ir::infer::infer_shapes(&mut g.clone(), ir::infer::Mode::Check).map(|r| r.consts).unwrap_or_default()
        } else {
            Default::default()
        };
        for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
            let key = g.node(n).outputs().first().map(|o| o.name.as_str()).unwrap_or("");
            let Some(op) = by_output.get(key) else {
                let outputs = g.node(n).num_outputs();
                if (0..outputs).all(|s| folded.contains_key(&Value::new(n, s as u16))) {
                    continue;
                }
                return Err(format!("the plan has no strategy for {}", g.describe(n)));
            };
            let mesh = meshes.get(op.stage).ok_or_else(|| format!("{}: no stage {}", g.describe(n), op.stage))?;
            check_strategy(g, n, &op.split, mesh)?;
            asg.strategies.insert(n, op.split.clone());
            stage_of.insert(n, self.virtual_stage(op));
        }
        Ok((asg, stage_of))
    }
}

impl Plan {
    /// What differs between this plan and `g`, the graph it is applied to: ops of the plan
    /// that `g` lacks (unless `partial`: a plan of the forward model applied to its training
    /// graph), ops whose type differs, tensors whose shape differs. Ops and tensors are
    /// matched by name (an op by its first output). Empty when the plan fits `g`.
    pub fn differences(&self, g: &Graph, partial: bool) -> Vec<String> {
        let mut out = Vec::new();
        let mut ops: HashMap<&str, NodeId> = HashMap::new();
        let mut values: HashMap<&str, Value> = HashMap::new();
        for n in g.node_ids() {
            let node = g.node(n);
            for (slot, o) in node.outputs().iter().enumerate() {
                if !o.name.is_empty() {
                    values.insert(o.name.as_str(), Value::new(n, slot as u16));
                }
            }
            if !matches!(node.op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef)
                && let Some(o) = node.outputs().first()
            {
                ops.insert(o.name.as_str(), n);
            }
        }
        for op in &self.ops {
            let Some(key) = op.outputs.first() else {
                out.push(format!("plan op `{}` has no outputs", op.name));
                continue;
            };
            match ops.get(key.as_str()) {
                None if !partial => {
                    out.push(format!("plan op `{}` ({}, output `{key}`) is not in the model", op.name, op.op))
                }
                None => {}
                Some(&n) => {
                    let ty = g.node(n).op.op_type();
                    if ty != op.op {
                        out.push(format!("op with output `{key}` is {} in the plan, {ty} in the model", op.op));
                    }
                }
            }
        }
        for t in &self.tensors {
            if let Some(&v) = values.get(t.name.as_str()) {
                let have = g.tensor_type(v).and_then(|t| t.static_dims());
                if have.as_deref() != Some(t.shape.as_slice()) {
                    let have = have.map_or("an unknown shape".into(), |d| format!("{d:?}"));
                    out.push(format!("tensor `{}` is {:?} in the plan, {have} in the model", t.name, t.shape));
                }
            } else if !partial {
                out.push(format!("plan tensor `{}` is not in the model", t.name));
            }
        }
        out
    }
}

/// The error for a plan that does not fit a graph: the first differences and how many more.
pub fn differences_message(diffs: &[String]) -> String {
    let mut m = String::from("the plan does not fit this model:");
    for d in diffs.iter().take(8) {
        m.push_str("\n  ");
        m.push_str(d);
    }
    if diffs.len() > 8 {
        m.push_str(&format!("\n  ... and {} more differences", diffs.len() - 8));
    }
    m
}

fn mesh_of(axes: &[PlanAxis]) -> Result<Mesh, String> {
    let axes = axes
        .iter()
        .map(|a| {
            let level = match a.level.as_str() {
                "intra" => LinkLevel::Intra,
                "inter" => LinkLevel::Inter,
                l => return Err(format!("mesh axis `{}`: unknown level `{l}`", a.name)),
            };
            Ok(MeshAxis { name: a.name.clone(), size: a.size, level })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Mesh { axes })
}

fn check_strategy(g: &Graph, n: NodeId, split: &[Option<usize>], mesh: &Mesh) -> Result<(), String> {
    if split.len() != mesh.axes.len() {
        return Err(format!("{}: the strategy has {} axes, the mesh {}", g.describe(n), split.len(), mesh.axes.len()));
    }
    if split.iter().all(Option::is_none) {
        return Ok(());
    }
    let sp = ir::shard::iter_space(g, n);
    if !ir::shard::strategy_valid(&sp, split, mesh, g, n) {
        return Err(format!("{}: the strategy {split:?} does not fit its iteration space", g.describe(n)));
    }
    Ok(())
}

fn breakdown_json(b: &Breakdown) -> serde_json::Value {
    let mut v = serde_json::to_value(b).expect("breakdown serializes");
    if let Some(o) = v.as_object_mut() {
        o.remove("ops");
    }
    v
}

fn layouts(
    cms: &[CostModel<'_>],
    stage_of: &HashMap<NodeId, usize>,
    asg: &Assignment,
    b: &Breakdown,
) -> (Vec<PlanOp>, Vec<PlanTensor>) {
    let g = cms[0].g;
    let mut ops = Vec::new();
    let mut tensors: Vec<PlanTensor> = Vec::new();
    let mut seen: std::collections::HashSet<Value> = std::collections::HashSet::new();
    let shape = |v: Value| g.tensor_type(v).and_then(|t| t.static_dims()).unwrap_or_default();
    let mut tensor = |v: Value, kind: &str, l: &Sharding, mesh: &Mesh, tensors: &mut Vec<PlanTensor>| {
        if seen.insert(v) && !g.value_name(v).is_empty() {
            let s = shape(v);
            tensors.push(PlanTensor {
                name: value_name(g, v),
                kind: kind.into(),
                local_shape: ir::shard::local_dims(&s, l, mesh),
                shape: s,
                layout: sharding_to_string(l),
            });
        }
    };
    for (i, &n) in cms[0].order().iter().enumerate() {
        let stage = stage_of.get(&n).copied().unwrap_or(0);
        let cm = &cms[stage.min(cms.len() - 1)];
        let node = g.node(n);
        let s = cm.strategy_of(asg, n);
        let sp = cm.space(n);
        let (ins, outs) = strategy_shardings(sp, &s);
        for (j, v) in node.inputs().iter().enumerate() {
            let (Some(v), Some(Some(l))) = (v, ins.get(j)) else { continue };
            let kind = match &g.node(v.node).op {
                Op::Input { default: None } => "input",
                Op::Input { .. } | Op::Initializer(_) if ir::cost::is_param(g, *v) => "parameter",
                Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => "constant",
                _ => continue,
            };
            tensor(*v, kind, l, &cm.mesh, &mut tensors);
        }
        for (slot, l) in outs.iter().enumerate() {
            let kind = if is_host(&node.op) { "constant" } else { "activation" };
            tensor(Value::new(n, slot as u16), kind, l, &cm.mesh, &mut tensors);
        }
        let row = b.ops.get(i);
        ops.push(PlanOp {
            name: g.op_name(n),
            op: node.op.op_type().to_string(),
            outputs: node.outputs().iter().map(|o| o.name.clone()).collect(),
            split: s.to_vec(),
            split_names: s.iter().map(|x| x.map(|d| sp.dims[d].name.clone())).collect(),
            strategy: cm.describe_strategy(n, &s),
            inputs: ins.iter().map(|l| l.as_ref().map(|l| sharding_to_string(l))).collect(),
            output_layouts: outs.iter().map(|l| sharding_to_string(l)).collect(),
            compute_s: row.map_or(0.0, |r| r.compute_s),
            communication_s: row.map_or(0.0, |r| r.communication_s),
            memory_bytes: row.map_or(0.0, |r| r.memory_bytes),
            stage,
            chunk: 0,
        });
    }
    (ops, tensors)
}

/// Why the plan pipelines: memory (nothing else fits) or speed.
pub fn pipeline_reason(r: &SearchResult, p: &super::pipeline::PipelinePlan) -> String {
    let intra = r.meshes.iter().filter(|m| m.feasible).map(|m| m.step_time_s).fold(f64::INFINITY, f64::min);
    let smallest = r.meshes.iter().map(|m| m.memory_per_device_bytes).min().unwrap_or(0);
    let gib = |x: f64| x / 1073741824.0;
    let whole = p.whole_batch.as_ref().map_or(String::new(), |why| format!("; one whole batch at a time: {why}"));
    let why = if p.requested {
        format!(
            "requested: {} stages (--pipeline); {:.3} ms per step against {:.3} ms without pipelining",
            p.stages.len(),
            p.breakdown.step_time_s * 1e3,
            intra * 1e3
        )
    } else if !intra.is_finite() {
        format!(
            "memory: without pipelining the smallest plan needs {:.2} GiB per device, {:.2} GiB usable; {} stages with {} micro-batches ({}{}) need {:.2} GiB",
            gib(smallest as f64),
            gib(p.breakdown.memory_capacity_bytes as f64),
            p.stages.len(),
            p.micro_batches,
            p.schedule.name(),
            if p.stages.iter().any(|s| s.recompute) { ", recomputing activations" } else { "" },
            gib(p.stages.iter().map(|s| s.memory_bytes).max().unwrap_or(0) as f64)
        )
    } else {
        format!(
            "speed: {:.3} ms per step pipelined against {:.3} ms for the best plan without pipelining",
            p.breakdown.step_time_s * 1e3,
            intra * 1e3
        )
    };
    let replanned = p.replanned.map_or(String::new(), |(k, reference)| {
        format!(
            "; {k} of {} stages on their own ops' plan ({:.3} ms with every stage on its sub-mesh's whole-graph plan)",
            p.stages.len(),
            reference * 1e3
        )
    });
    why + &whole + &replanned
}

fn collectives(g: &Graph, meshes: &[Mesh], stage_of: &HashMap<NodeId, usize>, b: &Breakdown) -> Vec<PlanCollective> {
    let mut out = Vec::new();
    for e in &b.events {
        if !g.contains(e.value.node) {
            continue;
        }
        let mesh = &meshes[e.op.and_then(|o| stage_of.get(&o).copied()).unwrap_or(0).min(meshes.len() - 1)];
        for st in e.steps.iter().filter(|s| s.kind.communicates()) {
            out.push(PlanCollective {
                phase: e.phase.name().into(),
                kind: st.kind.name().into(),
                tensor: value_name(g, e.value),
                op: e.op.filter(|o| g.contains(*o)).map(|n| g.op_name(n)),
                from: sharding_to_string(&e.from),
                to: sharding_to_string(&e.to),
                axes: st
                    .axes
                    .iter()
                    .map(|&a| mesh.axes.get(a).map_or(format!("axis{a}"), |x| x.name.clone()))
                    .collect(),
                bytes: st.bytes,
                group_size: st.group,
                bytes_moved: st.moved,
                time_s: st.time,
            });
        }
    }
    out
}

/// The annotation keys written on each op.
pub const ANN_STRATEGY: &str = "shardc_strategy";
/// Input layouts, `;`-separated (`-` for none).
pub const ANN_INPUTS: &str = "shardc_inputs";
/// Output layouts, `;`-separated.
pub const ANN_OUTPUTS: &str = "shardc_outputs";
/// The model-level mesh, in `metadata_props`.
pub const ANN_MESH: &str = "shardc_mesh";

/// The mesh as an annotation: `nodes=8:inter x gpus=8:intra`.
pub fn mesh_annotation(m: &Mesh) -> String {
    m.axes.iter().map(|a| format!("{}={}:{}", a.name, a.size, level_name(a.level))).collect::<Vec<_>>().join(" x ")
}

/// Parses [`mesh_annotation`]'s form.
pub fn parse_mesh_annotation(s: &str) -> Result<Mesh, String> {
    let axes = s
        .split(" x ")
        .map(|part| {
            let (name, rest) =
                part.trim().split_once('=').ok_or_else(|| format!("mesh axis `{part}`: expected name=size:level"))?;
            let (size, level) =
                rest.split_once(':').ok_or_else(|| format!("mesh axis `{part}`: expected name=size:level"))?;
            let size: usize = size.parse().map_err(|_| format!("mesh axis `{part}`: `{size}` is not a size"))?;
            let level = match level {
                "intra" => LinkLevel::Intra,
                "inter" => LinkLevel::Inter,
                _ => return Err(format!("mesh axis `{part}`: the level is intra or inter")),
            };
            Ok(MeshAxis { name: name.to_string(), size, level })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Mesh { axes })
}

/// The op's pipeline stage, when the plan pipelines.
pub const ANN_STAGE: &str = "shardc_stage";

/// Writes the plan onto the graph: per op its strategy (`d0@nodes, 2@gpus` or `replicated`,
/// by iteration-dim index), input and output layouts, and its pipeline stage when there are
/// several; the meshes (one per stage, ` | `-separated) go in the model's `metadata_props`.
pub fn annotate(model: &mut ir::Model, r: &SearchResult) {
    let (meshes, stage_of) = stage_meshes(r);
    annotate_graph(&mut model.graph, &meshes, &stage_of, &r.assignment);
    set_mesh_metadata(&mut model.metadata_props, &meshes);
}

/// Each stage's mesh and each op's stage (one stage when the plan does not pipeline).
pub fn stage_meshes(r: &SearchResult) -> (Vec<Mesh>, HashMap<NodeId, usize>) {
    match &r.pipeline {
        Some(p) => (
            p.stages.iter().map(|s| s.sub_mesh.clone()).collect(),
            p.stages.iter().enumerate().flat_map(|(i, s)| s.nodes.iter().map(move |&n| (n, i))).collect(),
        ),
        None => (vec![r.mesh.clone()], HashMap::new()),
    }
}

/// Records the meshes in a model's `metadata_props`.
pub fn set_mesh_metadata(props: &mut Option<Vec<(String, String)>>, meshes: &[Mesh]) {
    let props = props.get_or_insert_with(Vec::new);
    props.retain(|(k, _)| k != ANN_MESH);
    let text: Vec<String> = meshes.iter().map(mesh_annotation).collect();
    props.push((ANN_MESH.into(), text.join(" | ")));
}

/// Writes per-op annotations (see [`annotate`]).
pub fn annotate_graph(g: &mut Graph, meshes: &[Mesh], stage_of: &HashMap<NodeId, usize>, asg: &Assignment) {
    // An earlier plan's annotations go; the others stay (a constant's `shardc_frozen`, a
    // rewritten weight's `shardc_origin`).
    g.remove_annotations(&[ANN_STRATEGY, ANN_INPUTS, ANN_OUTPUTS, ANN_STAGE]);
    let order = g.op_nodes().unwrap_or_default();
    for n in order {
        let stage = stage_of.get(&n).copied().unwrap_or(0);
        let mesh = &meshes[stage.min(meshes.len() - 1)];
        let s = asg.strategies.get(&n).cloned().unwrap_or_else(|| vec![None; mesh.axes.len()]);
        let sp = ir::shard::iter_space(g, n);
        let (ins, outs) = strategy_shardings(&sp, &s);
        let strat: Vec<String> =
            s.iter().enumerate().filter_map(|(a, d)| d.map(|d| format!("{d}@{}", mesh.axes[a].name))).collect();
        let strat = if strat.is_empty() { "replicated".to_string() } else { strat.join(", ") };
        let ins: Vec<String> =
            ins.iter().map(|l| l.as_ref().map_or("-".to_string(), |l| sharding_to_string(l))).collect();
        let outs: Vec<String> = outs.iter().map(|l| sharding_to_string(l)).collect();
        g.set_annotation(n, ANN_STRATEGY, strat);
        g.set_annotation(n, ANN_INPUTS, ins.join("; "));
        g.set_annotation(n, ANN_OUTPUTS, outs.join("; "));
        if meshes.len() > 1 {
            g.set_annotation(n, ANN_STAGE, stage.to_string());
        }
    }
}

/// A plan read back from annotations.
pub struct Annotated {
    /// One mesh per stage.
    pub meshes: Vec<Mesh>,
    /// Each op's stage (absent: 0).
    pub stages: HashMap<NodeId, usize>,
    /// Each op's strategy on its stage's mesh.
    pub assignment: Assignment,
}

/// Reads annotations written by [`annotate`] back (the graph's shapes inferred). Errors say
/// which op's annotation is missing or malformed.
pub fn read_annotations(model: &ir::Model) -> Result<Annotated, String> {
    let g = &model.graph;
    let mesh_text = model
        .metadata_props
        .iter()
        .flatten()
        .find(|(k, _)| k == ANN_MESH)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| format!("the model has no `{ANN_MESH}` in its metadata_props"))?;
    let meshes: Vec<Mesh> = mesh_text.split(" | ").map(parse_mesh_annotation).collect::<Result<_, _>>()?;
    let mut asg = Assignment::default();
    let mut stages = HashMap::new();
    for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
        let node = g.node(n);
        let ann = |key: &str| node.annotations.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        let text = ann(ANN_STRATEGY).ok_or_else(|| format!("{} has no `{ANN_STRATEGY}` annotation", g.describe(n)))?;
        let stage: usize = match ann(ANN_STAGE) {
            Some(x) => x.parse().map_err(|_| format!("{}: `{ANN_STAGE}` is not a number", g.describe(n)))?,
            None => 0,
        };
        let mesh = meshes.get(stage).ok_or_else(|| format!("{}: no stage {stage} in `{ANN_MESH}`", g.describe(n)))?;
        stages.insert(n, stage);
        let mut s = vec![None; mesh.axes.len()];
        if text != "replicated" {
            for part in text.split(',') {
                let (d, axis) = part
                    .trim()
                    .split_once('@')
                    .ok_or_else(|| format!("{}: `{part}` is not dim@axis", g.describe(n)))?;
                let d: usize = d.parse().map_err(|_| format!("{}: `{d}` is not a dim index", g.describe(n)))?;
                let a = mesh
                    .axes
                    .iter()
                    .position(|x| x.name == axis)
                    .ok_or_else(|| format!("{}: no mesh axis `{axis}`", g.describe(n)))?;
                s[a] = Some(d);
            }
        }
        check_strategy(g, n, &s, mesh)?;
        // Layout annotations, when present, must agree with the strategy.
        if let Some(outs) = ann(ANN_OUTPUTS) {
            let sp = ir::shard::iter_space(g, n);
            let (_, want) = strategy_shardings(&sp, &s);
            let got: Vec<Option<Sharding>> = outs.split(';').map(parse_sharding).collect();
            if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.as_ref() != Some(b)) {
                return Err(format!("{}: `{ANN_OUTPUTS}` disagrees with its strategy", g.describe(n)));
            }
        }
        asg.strategies.insert(n, s);
    }
    Ok(Annotated { meshes, stages, assignment: asg })
}

/// A per-layer table with data parallelism beside it, grouped by the repeated block each op
/// lies in ([`ir::scope`]): a total row per block, then its ops. `order` is the op order the
/// breakdowns' rows follow; columns fit their widest cell.
pub fn report(g: &Graph, order: &[NodeId], plan: &Breakdown, dp: Option<&Breakdown>) -> String {
    let us = |s: f64| format!("{:.1}", s * 1e6);
    let mib = |b: f64| format!("{:.1}", b / (1024.0 * 1024.0));
    let paths = if order.len() == plan.ops.len() { ir::scope::module_paths(g, order) } else { HashMap::new() };
    let dp = dp.filter(|d| d.ops.len() == plan.ops.len());
    let dash = || "-".to_string();
    // Blocks in order of first appearance, each with its rows.
    let mut blocks: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, r) in plan.ops.iter().enumerate() {
        if r.compute_s == 0.0 && r.communication_s == 0.0 && r.memory_bytes == 0.0 {
            continue;
        }
        let block = order.get(i).and_then(|n| paths.get(n)).map(|p| ir::scope::block_of(p)).unwrap_or_default();
        match blocks.iter_mut().find(|(b, _)| *b == block) {
            Some((_, rows)) => rows.push(i),
            None => blocks.push((block, vec![i])),
        }
    }
    let sums = |b: &Breakdown, rows: &[usize]| {
        let f = |k: &dyn Fn(&crate::cost::OpRow) -> f64| rows.iter().filter_map(|&i| b.ops.get(i)).map(k).sum::<f64>();
        (f(&|r| r.compute_s), f(&|r| r.communication_s), f(&|r| r.memory_bytes))
    };
    let mut rows: Vec<[String; 9]> = Vec::new();
    let grouped = blocks.len() > 1;
    for (block, idx) in &blocks {
        if grouped {
            let (c, m, a) = sums(plan, idx);
            let (dc, dm) = dp.map(|d| sums(d, idx)).map_or((dash(), dash()), |(c, m, _)| (us(c), us(m)));
            let name = if block.is_empty() { "(unnamed)".to_string() } else { block.clone() };
            rows.push([
                format!("{name}/"),
                format!("{} ops", idx.len()),
                String::new(),
                us(c),
                us(m),
                mib(a),
                String::new(),
                dc,
                dm,
            ]);
        }
        for &i in idx {
            let r = &plan.ops[i];
            let (ds, dc, dm) = match dp.map(|d| &d.ops[i]) {
                Some(d) => (d.strategy.clone(), us(d.compute_s), us(d.communication_s)),
                None => (dash(), dash(), dash()),
            };
            let indent = if grouped { "  " } else { "" };
            rows.push([
                format!("{indent}{}", r.name),
                r.op.clone(),
                r.strategy.clone(),
                us(r.compute_s),
                us(r.communication_s),
                mib(r.memory_bytes),
                ds,
                dc,
                dm,
            ]);
        }
    }
    let all: Vec<usize> = blocks.iter().flat_map(|(_, i)| i.iter().copied()).collect();
    let (c, m, a) = sums(plan, &all);
    let (dc, dm) = dp.map(|d| sums(d, &all)).map_or((dash(), dash()), |(c, m, _)| (us(c), us(m)));
    rows.push(["total (per-op)".into(), String::new(), String::new(), us(c), us(m), mib(a), String::new(), dc, dm]);
    crate::table::table(
        &["layer", "op", "strategy", "comp µs", "comm µs", "mem MiB", "data parallel", "comp µs", "comm µs"],
        &rows,
        &[false, false, false, true, true, true, false, true, true],
    )
}

/// A per-stage table of a pipelined plan.
pub fn stage_report(plan: &Plan) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "pipeline: {} stages, {} micro-batches, {}\n",
        plan.stages.len(),
        plan.micro_batches,
        plan.schedule.as_deref().unwrap_or("-")
    ));
    t.push_str(&format!(
        "{:>5} {:>9} {:<28} {:>6} {:>11} {:>11} {:>11} {:>10} {:>9}   {}\n",
        "stage",
        "devices",
        "mesh",
        "ops",
        "fwd µs/µb",
        "bwd µs/µb",
        "total µs",
        "mem MiB",
        "recompute",
        "first .. last op"
    ));
    for (i, s) in plan.stages.iter().enumerate() {
        let mesh: Vec<String> = s.mesh.iter().map(|a| format!("{}={}", a.name, a.size)).collect();
        let first = s.ops.first().cloned().unwrap_or_default();
        let last = s.ops.last().cloned().unwrap_or_default();
        t.push_str(&format!(
            "{:>5} {:>9} {:<28} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>10.1} {:>9}   {first} .. {last}\n",
            i,
            format!("{}-{}", s.devices.first().unwrap_or(&0), s.devices.last().unwrap_or(&0)),
            mesh.join(" × "),
            s.ops.len(),
            s.forward_s * 1e6,
            s.backward_s * 1e6,
            s.time_s * 1e6,
            s.memory_bytes as f64 / 1048576.0,
            if s.recompute { "yes" } else { "no" },
        ));
    }
    t
}

/// One stage's forward or backward of one micro-batch in a simulated schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimelineBlock {
    /// The stage.
    pub stage: usize,
    /// The micro-batch.
    pub micro_batch: usize,
    /// Backward (else forward).
    pub backward: bool,
    /// Start, seconds from the step's start.
    pub start_s: f64,
    /// End, seconds.
    pub end_s: f64,
}

/// A plan's schedule simulated from its stages' per-micro-batch times: each stage runs its
/// forwards and backwards in the schedule's order (GPipe, or 1F1B's warm-up, alternation and
/// drain), each starting when its stage is free and its dependency (the previous stage's
/// forward, the next stage's backward) has ended. Returns the blocks and the span, seconds.
pub fn timeline(plan: &Plan) -> (Vec<TimelineBlock>, f64) {
    let s = plan.stages.len();
    let m = plan.micro_batches.max(1);
    let f: Vec<f64> = plan.stages.iter().map(|x| x.forward_s).collect();
    let b: Vec<f64> = plan.stages.iter().map(|x| x.backward_s).collect();
    // Simulate the schedule: each stage runs its ops in schedule order, each op starts when its
    // stage is free and its dependency (previous stage's forward, next stage's backward) ends.
    let mut fwd_end = vec![vec![0.0f64; m]; s];
    let mut bwd_end = vec![vec![0.0f64; m]; s];
    let mut blocks: Vec<TimelineBlock> = Vec::new();
    let order: Vec<Vec<(bool, usize)>> = (0..s)
        .map(|st| {
            let mut ops = Vec::new();
            if plan.schedule.as_deref() == Some("gpipe") || s == 1 {
                ops.extend((0..m).map(|i| (false, i)));
                ops.extend((0..m).rev().map(|i| (true, i)));
            } else {
                // 1F1B: warm-up forwards, then alternate, then drain backwards.
                let warm = (s - st).min(m);
                ops.extend((0..warm).map(|i| (false, i)));
                let (mut nf, mut nb) = (warm, 0);
                while nb < m {
                    ops.push((true, nb));
                    nb += 1;
                    if nf < m {
                        ops.push((false, nf));
                        nf += 1;
                    }
                }
            }
            ops
        })
        .collect();
    let mut pos = vec![0usize; s];
    let mut free = vec![0.0f64; s];
    let total_ops = s * m * 2;
    let mut done = 0;
    let mut guard = 0;
    while done < total_ops && guard < total_ops * (s + 2) {
        guard += 1;
        for st in 0..s {
            let Some(&(back, i)) = order[st].get(pos[st]) else { continue };
            let ready = if !back {
                if st == 0 { Some(0.0) } else { (fwd_end[st - 1][i] > 0.0).then_some(fwd_end[st - 1][i]) }
            } else if st + 1 == s {
                (fwd_end[st][i] > 0.0).then_some(fwd_end[st][i])
            } else {
                (bwd_end[st + 1][i] > 0.0).then_some(bwd_end[st + 1][i])
            };
            let Some(ready) = ready else { continue };
            let start = ready.max(free[st]);
            let end = start + if back { b[st] } else { f[st] };
            if back {
                bwd_end[st][i] = end;
            } else {
                fwd_end[st][i] = end;
            }
            free[st] = end;
            blocks.push(TimelineBlock { stage: st, micro_batch: i, backward: back, start_s: start, end_s: end });
            pos[st] += 1;
            done += 1;
        }
    }
    (blocks, free.iter().copied().fold(0.0, f64::max))
}
