//! Pricing a sharded training step.
//!
//! An [`Assignment`] gives each op a strategy (per mesh axis, the iteration dim split over it).
//! From it follow the sharding of every tensor and the collectives between ops. The step time
//! is, per op, roofline compute `max(flops/(peak·eff), bytes/mem_bw) + launch` of the local
//! shard (forward, and backward = data-gradient + weight-gradient); halo exchanges for split
//! windows and all-reduces of statistics for split normalizations; on every edge the
//! resharding from what the producer holds to what the consumer needs (forward) and the dual
//! for the gradient (backward: an input replicated across an axis the consumer splits comes
//! back as a partial sum); per parameter the gradient synchronisation (all-reduce or
//! reduce-scatter), optionally overlapped with the backward pass in buckets; the optimizer
//! update; and the host→device input path.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use rustc_hash::{FxHashMap, FxHashSet};

use serde::Serialize;

use ir::cost::{OpCost, node_cost};
use ir::ops::split::{SplitMode, split_mode};
use ir::reshard::{CommStep, Policy, StepKind};
use ir::shard::{AxisShard, DimKind, IterSpace, Mesh, OpStrategy, Sharding, iter_space, strategy_shardings};
use ir::{Graph, NodeId, Op, OpClass, TensorType, Value};

use super::batch::{BatchDims, batch_dims};
use super::cluster::Cluster;
use super::collective::{self, CommKind, Step, alpha_beta, choose_policy, p2p, price};
use super::stash::{Recompute, Stash};
use std::sync::Arc;

/// Arithmetic precision of training.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// float32 everywhere.
    Fp32,
    /// float32 storage, TF32 tensor-core math.
    Tf32,
    /// float16/bfloat16 activations and weights, float32 master weights (mixed precision).
    Fp16,
}

impl Precision {
    /// Parses `fp32`, `tf32`, `fp16`, `bf16`, `mixed`.
    pub fn parse(s: &str) -> Option<Precision> {
        Some(match s {
            "fp32" => Precision::Fp32,
            "tf32" => Precision::Tf32,
            "fp16" | "bf16" | "mixed" => Precision::Fp16,
            _ => return None,
        })
    }
}

/// The optimizer, for update time and state memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// SGD with momentum: one fp32 state per parameter.
    Sgd,
    /// Adam: two fp32 states per parameter.
    Adam,
}

/// How input batches reach the devices (ScaleDNN).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InputPath {
    /// Each device's slice goes straight from host memory over its own link.
    Scatter,
    /// The whole batch goes to device 0, which scatters it over device links.
    Staged,
}

/// Modelling options.
#[derive(Clone, Debug, Serialize)]
pub struct Options {
    /// Arithmetic precision.
    pub precision: Precision,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Overlap gradient synchronisation with the backward pass (bucketed).
    pub overlap_grad_sync: bool,
    /// Bucket size for overlapped gradient synchronisation, bytes.
    pub bucket_bytes: f64,
    /// Size of the first bucket, bytes (DDP: 1 MB, so synchronisation starts early).
    pub first_bucket_bytes: f64,
    /// Slowdown of backward compute while gradient synchronisation runs beside it (the
    /// collectives take SMs and memory bandwidth; Galvatron measures 1.1–1.3).
    pub overlap_slowdown: f64,
    /// Factor on gradient bytes communicated (e.g. 0.5 for fp16 compression).
    pub grad_compression: f64,
    /// The host input path.
    pub input_path: InputPath,
    /// Load the next batch while this one computes.
    pub preload: bool,
    /// Activation recomputation (a model priced as its forward graph; a training graph is
    /// priced as written).
    pub recompute: Recompute,
    /// Megatron's sequence parallelism in the tensor-parallel named strategies: the ops
    /// between tensor-parallel regions split along the sequence over the tensor axis.
    pub sequence_parallel: bool,
    /// ZeRO stage (0–3): over each parameter's data-parallel devices (those its gradient is
    /// all-reduced over), 1 shards the optimizer state, 2 also the gradients, 3 also the
    /// parameters (gathered before each use, as FSDP does).
    pub zero: u8,
    /// Gradient accumulation without a pipeline: each step runs this many micro-batches of
    /// batch / `accumulation` before one gradient synchronisation and update; activations are
    /// a micro-batch's.
    pub accumulation: usize,
    /// The layers' activation collectives (tensor and sequence parallelism) overlap with the
    /// GEMM they feed or come from, as Megatron-LM's `--tp-comm-overlap` pipelines them in
    /// chunks beside the GEMM: only what outlasts that GEMM is exposed, and the GEMM runs
    /// `overlap_slowdown` times slower beside it. Off for shardc's own runtime, which runs
    /// its collectives between kernels.
    pub tp_comm_overlap: bool,
}

impl Options {
    /// What the options do to save memory, as a configuration's fields
    /// (`recompute=full,sp,zero=1`), `none` when nothing.
    pub fn memory_fields(&self) -> String {
        let mut f: Vec<String> = Vec::new();
        if self.recompute != Recompute::None {
            f.push(format!("recompute={}", self.recompute.name()));
        }
        if self.sequence_parallel {
            f.push("sp".into());
        }
        if self.zero > 0 {
            f.push(format!("zero={}", self.zero));
        }
        if f.is_empty() { "none".into() } else { f.join(",") }
    }
}

impl Default for Options {
    fn default() -> Options {
        Options {
            precision: Precision::Fp32,
            optimizer: Optimizer::Adam,
            overlap_grad_sync: true,
            bucket_bytes: 25e6,
            first_bucket_bytes: 1e6,
            overlap_slowdown: 1.2,
            grad_compression: 1.0,
            input_path: InputPath::Scatter,
            preload: true,
            recompute: Recompute::None,
            sequence_parallel: false,
            zero: 0,
            accumulation: 1,
            tp_comm_overlap: false,
        }
    }
}

/// A strategy per op; ops not listed run whole on every device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    /// Strategies by node.
    pub strategies: HashMap<NodeId, OpStrategy>,
}

/// The compute and op-internal communication of one op under a strategy, seconds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct OpTime {
    /// Forward compute.
    pub fwd: f64,
    /// Backward compute.
    pub bwd: f64,
    /// Halo exchange, forward + backward.
    pub halo: f64,
    /// Statistics all-reduces, forward + backward.
    pub stats: f64,
    /// The forward part of `halo + stats`.
    pub comm_fwd: f64,
}

impl OpTime {
    /// The backward part of `halo + stats`.
    pub fn comm_bwd(&self) -> f64 {
        self.halo + self.stats - self.comm_fwd
    }
}

/// Memory per device, bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct Memory {
    /// Parameters.
    pub weights: f64,
    /// Their gradients.
    pub gradients: f64,
    /// Optimizer state (and fp32 master weights in mixed precision).
    pub optimizer: f64,
    /// Activations kept for the backward pass.
    pub activations: f64,
    /// The largest transient buffer (an op's output, a collective's buffer).
    pub workspace: f64,
}

impl Memory {
    /// Everything.
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer + self.activations + self.workspace
    }

    /// The breakdown as `--json` of `cost` and `plan` names it (`memory_breakdown`).
    pub fn breakdown(&self) -> MemoryBreakdown {
        MemoryBreakdown {
            parameters: self.weights,
            gradients: self.gradients,
            optimizer_state: self.optimizer,
            activations: self.activations,
            other: self.workspace,
        }
    }
}

/// Memory per device by what holds it, bytes: `memory_breakdown` in the JSON of `cost` and
/// `plan`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct MemoryBreakdown {
    /// The parameters (in the training precision; ZeRO-3: the device's shard).
    pub parameters: f64,
    /// Their gradients (ZeRO-2 and 3: the shard).
    pub gradients: f64,
    /// Optimizer state, with fp32 master weights in mixed precision (ZeRO: the shard).
    pub optimizer_state: f64,
    /// Activations kept for the backward pass, with a recomputed region's while it runs.
    pub activations: f64,
    /// Buffers: the largest transient output, ZeRO-3's gathered parameter.
    pub other: f64,
}

/// One op's line in a report.
#[derive(Clone, Debug, Serialize)]
pub struct OpRow {
    /// The node's label or output name.
    pub name: String,
    /// Op type.
    pub op: String,
    /// The strategy, e.g. `n→gpus` or `replicated`.
    pub strategy: String,
    /// Forward + backward compute, seconds.
    pub compute_s: f64,
    /// Communication attributed to this op (its input reshardings, halo, statistics), seconds.
    pub communication_s: f64,
    /// Activation bytes it keeps per device.
    pub memory_bytes: f64,
    /// Forward time with its forward communication, seconds.
    pub forward_s: f64,
    /// Backward time with its backward communication, seconds.
    pub backward_s: f64,
    /// Bytes per device of the parameters it reads first: weights, gradients and optimizer
    /// state.
    pub param_memory_bytes: f64,
    /// Bytes per device of those parameters' gradients: what a pipeline's accumulator over
    /// micro-batches holds beside the gradients of the micro-batch being computed.
    pub grad_memory_bytes: f64,
    /// Synchronisation of the gradients of the parameters whose last reader (in backward, the
    /// first to finish) it is, before bucketing, seconds.
    pub grad_sync_s: f64,
    /// Optimizer update of the parameters it reads first, seconds.
    pub update_s: f64,
}

pub use ir::reshard::Phase;

/// One communication of a step: a tensor (or its gradient) moved from one layout to another.
#[derive(Clone, Debug)]
pub struct CommEvent {
    /// When.
    pub phase: Phase,
    /// The tensor (for a halo or statistics, the op's first output).
    pub value: Value,
    /// The op it is for (the consumer, or the op whose halo/statistics it is).
    pub op: Option<NodeId>,
    /// Layout before.
    pub from: Sharding,
    /// Layout after.
    pub to: Sharding,
    /// The collectives, in order.
    pub steps: Vec<Step>,
}

/// The price of a step.
#[derive(Clone, Debug, Serialize)]
pub struct Breakdown {
    /// Step time, seconds.
    pub step_time_s: f64,
    /// Forward and backward compute (no communication), seconds.
    pub compute_s: f64,
    /// Forward pass (compute and communication), seconds.
    pub forward_s: f64,
    /// Backward pass (compute and activation-gradient communication), seconds.
    pub backward_s: f64,
    /// Optimizer update, seconds.
    pub update_s: f64,
    /// All communication (forward, backward, gradient synchronisation), seconds, before
    /// overlap.
    pub communication_s: f64,
    /// Communication by kind, seconds.
    pub communication_by_kind: BTreeMap<String, f64>,
    /// Gradient synchronisation, seconds, before overlap.
    pub gradient_sync_s: f64,
    /// The part of gradient synchronisation not hidden behind the backward pass, seconds.
    pub exposed_gradient_sync_s: f64,
    /// Pipeline bubble, seconds.
    pub bubble_s: f64,
    /// Host→device input time not hidden by preloading, seconds.
    pub input_s: f64,
    /// Host→device input time, seconds, before overlap.
    pub input_transfer_s: f64,
    /// Bytes per step moved host→devices.
    pub input_bytes: f64,
    /// Memory per device, bytes.
    pub memory_per_device_bytes: Vec<u64>,
    /// Memory of the most loaded device by category.
    pub memory: Memory,
    /// Usable memory per device, bytes.
    pub memory_capacity_bytes: u64,
    /// The plan fits in memory.
    pub feasible: bool,
    /// Why not, when it does not.
    pub infeasible_reason: Option<String>,
    /// Per-op lines (topological order).
    pub ops: Vec<OpRow>,
    /// Every communication, in step order (forward, backward, gradient synchronisation).
    #[serde(skip)]
    pub events: Vec<CommEvent>,
    /// Per phase and kind, the bytes the busiest device sends (filled by
    /// [`CostModel::evaluate`], empty from [`CostModel::price`]).
    pub bytes_moved_per_device: BTreeMap<String, BTreeMap<String, f64>>,
    /// The resharding algebra's choices this price assumes.
    pub policy: Policy,
}

/// A resharding: the value, from and to packed ([`pack`]), the byte scale (as bits).
type ReshardKey = (Value, u64, u64, u64);

/// A sharding in one word, a byte per mesh axis (`None` beyond eight axes): the memo's key
/// without allocating.
fn pack(s: &Sharding) -> Option<u64> {
    if s.len() > 8 {
        return None;
    }
    Some(s.iter().enumerate().fold(0u64, |acc, (i, a)| {
        let b = match a {
            AxisShard::Replicate => 1u64,
            AxisShard::Partial => 2,
            AxisShard::Split(d) => 3 + u64::from(*d),
        };
        acc | (b << (8 * i))
    }))
}
/// A resharding's priced collectives and the seconds of its local steps.
type Resharded = (Rc<[Step]>, f64);

/// A gradient bucket being filled: bytes, bandwidth seconds, latency seconds, ready time.
type OpenBucket = (f64, f64, f64, f64);

/// An op under one strategy: its time and the layouts it needs and makes.
struct OpEval {
    strategy: OpStrategy,
    time: OpTime,
    ins: Vec<Option<Sharding>>,
    outs: Vec<Sharding>,
    /// Halo exchanges and statistics all-reduces, forward then backward.
    comm: Vec<(Phase, Step)>,
    /// Its backward reduces its parameters' gradients itself: synchronised batch
    /// normalization all-reduces the per-channel sums its scale's and bias's gradients are.
    reduces_param_grads: bool,
}

/// Prices assignments of one graph on one mesh.
pub struct CostModel<'a> {
    /// The graph (shapes inferred).
    pub g: &'a Graph,
    /// The machine.
    pub cluster: &'a Cluster,
    /// The mesh of devices used.
    pub mesh: Mesh,
    /// Options.
    pub opts: Options,
    /// The resharding algebra's choices on this mesh (chosen by pricing).
    pub policy: Policy,
    order: Arc<Vec<NodeId>>,
    spaces: Arc<HashMap<NodeId, IterSpace>>,
    costs: Arc<HashMap<NodeId, OpCost>>,
    batch: Arc<BatchDims>,
    /// A training graph's op phases ([`ir::reshard::step_phases`]): the graph is priced as
    /// it runs, each op once in its phase, with no backward pass or update added.
    phases: Arc<Option<HashMap<NodeId, Phase>>>,
    /// A forward graph's stash under the recomputation chosen ([`super::stash`]); `None` for
    /// a training graph or a model that cannot be differentiated (then every computed value
    /// counts as kept).
    stash: Option<Stash>,
    /// The values gradients flow into ([`ir::cost::grad_flow`]).
    grads: Arc<std::collections::HashSet<Value>>,
    op_memo: RefCell<FxHashMap<(NodeId, OpStrategy), Rc<OpEval>>>,
    reshard_memo: RefCell<FxHashMap<ReshardKey, Resharded>>,
    /// How many devices run kernels at once on a shared host (see [`CostModel::with_busy`]).
    busy: Option<usize>,
}

/// What one evaluation accumulates: communication by kind, events, rows, the largest buffer.
struct Walk {
    detail: bool,
    comm_kind: BTreeMap<&'static str, f64>,
    events: Vec<CommEvent>,
    bwd_events: Vec<CommEvent>,
    sync_events: Vec<CommEvent>,
    rows: Vec<OpRow>,
    workspace: f64,
}

impl Walk {
    fn new(detail: bool, ops: usize) -> Walk {
        Walk {
            detail,
            comm_kind: BTreeMap::new(),
            events: Vec::new(),
            bwd_events: Vec::new(),
            sync_events: Vec::new(),
            rows: Vec::with_capacity(if detail { ops } else { 0 }),
            workspace: 0.0,
        }
    }

    /// Communication seconds per kind, those that took any.
    fn by_kind(&mut self) -> BTreeMap<String, f64> {
        std::mem::take(&mut self.comm_kind)
            .into_iter()
            .filter(|(_, v)| *v > 0.0)
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// Adds steps to the totals (and to the events in detail); their seconds.
    fn record(
        &mut self,
        phase: Phase,
        value: Value,
        op: Option<NodeId>,
        from: &Sharding,
        to: &Sharding,
        steps: &[Step],
    ) -> f64 {
        let mut t = 0.0;
        for s in steps {
            *self.comm_kind.entry(s.kind.name()).or_insert(0.0) += s.time;
            t += s.time;
            self.workspace = self.workspace.max(s.bytes);
        }
        if self.detail && !steps.is_empty() {
            let e = CommEvent { phase, value, op, from: from.clone(), to: to.clone(), steps: steps.to_vec() };
            if phase == Phase::Backward { self.bwd_events.push(e) } else { self.events.push(e) }
        }
        t
    }
}

/// Edge bookkeeping of one evaluation.
#[derive(Default)]
struct Edges<'e> {
    /// (value, layout) pairs already materialized.
    materialized: FxHashSet<(Value, &'e Sharding)>,
    /// (value, gradient layout) pairs whose gradient was already sent back.
    grads_sent: FxHashSet<(Value, Sharding)>,
    /// Per parameter, the layout of its accumulated gradient.
    param_grad: BTreeMap<Value, Sharding>,
    /// Per parameter, the position of its first reader.
    param_first_use: FxHashMap<Value, usize>,
    /// Per value a gradient flows into, the reads of it so far (their gradients are summed).
    grad_reads: FxHashMap<Value, usize>,
}

/// Bytes per element factor of float tensors in the training precision of `o`.
fn precision_factor(o: &Options) -> f64 {
    if o.precision == Precision::Fp16 { 0.5 } else { 1.0 }
}

/// Optimizer state per parameter element under `o` (with fp32 master weights in mixed
/// precision).
fn optimizer_bytes_per_elem(o: &Options) -> f64 {
    (match o.optimizer {
        Optimizer::Sgd => 4.0,
        Optimizer::Adam => 8.0,
    }) + if o.precision == Precision::Fp16 { 4.0 } else { 0.0 }
}

/// The parameter elements of `g` (its analysis `a`): all of them, and those a gradient
/// flows into (trained).
pub fn parameter_elements(g: &Graph, a: &Analysis) -> (f64, f64) {
    let (mut all, mut trained) = (0.0, 0.0);
    for n in g.initializers().iter().chain(g.input_values().iter().map(|v| &v.node)) {
        let v = Value::new(*n, 0);
        if !ir::cost::is_param(g, v) {
            continue;
        }
        let elems = g.tensor_type(v).and_then(|t| t.static_dims()).map_or(0.0, |d| d.iter().product::<i64>() as f64);
        all += elems;
        if a.grads.contains(&v) {
            trained += elems;
        }
    }
    (all, trained)
}

/// The least model state (parameters, their gradients and optimizer state, as
/// [`CostModel::evaluate`] counts them under `o`) the fullest device holds when the parameters
/// (`elems`: all, trained) are divided `ways` ways (tensor × pipeline degrees: no device holds
/// less than the average) and ZeRO shards them over `data` more. A configuration whose floor
/// exceeds the device's memory fits under no split.
pub fn model_state_floor(o: &Options, (all, trained): (f64, f64), ways: f64, data: f64) -> f64 {
    let at = |stage: u8| if o.zero >= stage { data.max(1.0) } else { 1.0 };
    let w = 4.0 * precision_factor(o);
    (all * w / at(3) + trained * (w / at(2) + optimizer_bytes_per_elem(o) / at(1))) / ways.max(1.0)
}

/// The copies of values in other layouts a training step holds ([`CostModel::copies`]): bytes
/// made at each position, bytes freed after it, bytes made at the end, and the graph outputs
/// a reader brought to their delivered layout (the value itself not held to the end); and
/// where each value is last read, a copy's making counting as a read.
#[derive(Default)]
struct Copies {
    made: Vec<f64>,
    freed: Vec<f64>,
    at_end: f64,
    delivered_early: FxHashSet<Value>,
    /// Per position, the values last read there (directly, or copied into another layout).
    frees: Vec<Vec<Value>>,
    /// The values some op reads.
    read: FxHashSet<Value>,
}

/// One parameter's gradient synchronisation, before bucketing.
struct GradEvent {
    value: Value,
    pos: usize,
    /// The gradient bytes a device holds (the parameter's local shard): what fills a bucket.
    bytes: f64,
    bandwidth: f64,
    latency: f64,
    sig: Vec<(CommKind, Vec<usize>)>,
    /// The bandwidth seconds of each step of `sig`.
    step_bandwidth: Vec<f64>,
}

/// Parameters stored per device.
#[derive(Default)]
struct Params {
    /// Bytes of the parameters stored.
    bytes: f64,
    /// Bytes, elements and count of those trained (a gradient reaches them; not a batch
    /// normalization's running statistics).
    trained_bytes: f64,
    elems: f64,
    count: usize,
    /// ZeRO-3: the largest parameter gathered whole, with its gradient before the
    /// reduce-scatter.
    gathered: f64,
}

/// Per phase and kind, the bytes the busiest device sends (`{phase: {kind: bytes}}`).
pub fn bytes_moved_per_device(events: &[CommEvent], mesh: &Mesh) -> BTreeMap<String, BTreeMap<String, f64>> {
    let devices = mesh.devices();
    let mut per: BTreeMap<(Phase, CommKind), Vec<f64>> = BTreeMap::new();
    for e in events {
        for s in &e.steps {
            let v = per.entry((e.phase, s.kind)).or_insert_with(|| vec![0.0; devices]);
            for (d, x) in v.iter_mut().enumerate() {
                *x += s.moved_by_device.as_ref().and_then(|by| by.get(d).copied()).unwrap_or(s.moved);
            }
        }
    }
    let mut out: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for ((phase, kind), v) in per {
        out.entry(phase.name().to_string())
            .or_default()
            .insert(kind.name().to_string(), v.iter().copied().fold(0.0, f64::max));
    }
    out
}

/// Ops that only reinterpret memory (no kernel).
pub fn is_view(op: &Op) -> bool {
    matches!(op, Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_) | Op::Identity(_) | Op::Dropout(_))
}

/// Ops computed on the host from shapes and constants.
pub fn is_host(op: &Op) -> bool {
    matches!(
        op,
        Op::Shape(_)
            | Op::Size(_)
            | Op::Constant(_)
            | Op::ConstantOfShape(_)
            | Op::Range(_)
            | Op::Input { .. }
            | Op::Initializer(_)
            | Op::OuterRef
    )
}

/// A report row's name: the node's label, or its first output's name.
fn row_name(node: &ir::Node) -> String {
    node.label.clone().unwrap_or_else(|| node.outputs().first().map(|o| o.name.clone()).unwrap_or_default())
}

fn split_factor(s: &[AxisShard], mesh: &Mesh) -> f64 {
    s.iter()
        .enumerate()
        .filter(|(_, x)| matches!(x, AxisShard::Split(_)))
        .map(|(a, _)| mesh.axes[a].size as f64)
        .product()
}

/// What the cost model knows of a graph whatever the mesh and options — op order, iteration
/// spaces, FLOP counts, the batch analysis, a training graph's phases, the values the
/// backward pass reads — computed once and shared by the cost models of one graph on many
/// meshes and options (the configurations a search prices).
#[derive(Clone)]
pub struct Analysis {
    order: Arc<Vec<NodeId>>,
    spaces: Arc<HashMap<NodeId, IterSpace>>,
    costs: Arc<HashMap<NodeId, OpCost>>,
    batch: Arc<BatchDims>,
    phases: Arc<Option<HashMap<NodeId, Phase>>>,
    grads: Arc<std::collections::HashSet<Value>>,
    saved: Arc<Option<std::collections::HashSet<Value>>>,
}

impl Analysis {
    /// The analysis of `g` (shapes inferred).
    pub fn of(g: &Graph) -> Analysis {
        let order = g.op_nodes().unwrap_or_default();
        let batch = batch_dims(g);
        let mut spaces = HashMap::new();
        let mut costs = HashMap::new();
        let grads = ir::cost::grad_flow(g, &order);
        for &n in &order {
            let mut sp = iter_space(g, n);
            mark_batch(g, n, &mut sp, &batch);
            spaces.insert(n, sp);
            costs.insert(n, node_cost(g, n, &grads));
        }
        let phases = ir::reshard::step_phases(g, &order);
        let saved = if phases.is_some() { None } else { super::stash::saved_values(g) };
        Analysis {
            order: Arc::new(order),
            spaces: Arc::new(spaces),
            costs: Arc::new(costs),
            batch: Arc::new(batch),
            phases: Arc::new(phases),
            grads: Arc::new(grads),
            saved: Arc::new(saved),
        }
    }
}

impl<'a> CostModel<'a> {
    /// Prepares the model: iteration spaces, FLOP counts, the batch analysis.
    pub fn new(g: &'a Graph, cluster: &'a Cluster, mesh: Mesh, opts: Options) -> CostModel<'a> {
        CostModel::with_analysis(g, &Analysis::of(g), cluster, mesh, opts)
    }

    /// The model of `g` from its analysis `a` ([`Analysis::of`] of `g`).
    pub fn with_analysis(g: &'a Graph, a: &Analysis, cluster: &'a Cluster, mesh: Mesh, opts: Options) -> CostModel<'a> {
        let policy = choose_policy(&mesh, cluster);
        let stash = (*a.saved).as_ref().map(|saved| Stash::new(g, &a.order, saved, opts.recompute));
        CostModel {
            g,
            cluster,
            mesh,
            opts,
            policy,
            order: a.order.clone(),
            spaces: a.spaces.clone(),
            costs: a.costs.clone(),
            batch: a.batch.clone(),
            phases: a.phases.clone(),
            stash,
            grads: a.grads.clone(),
            op_memo: RefCell::default(),
            reshard_memo: RefCell::default(),
            busy: None,
        }
    }

    /// The model with `k` devices running kernels at once where devices share a host
    /// ([`super::cluster::Device::shared_host`]; elsewhere nothing changes): each kernel gets
    /// `1/k` of the host's compute and memory bandwidth and pays the launch contention of
    /// `k − 1` others. By default all the mesh's devices do, as they do in a plan's steady
    /// state; a simulated pipeline prices its ops at the concurrency its schedule has.
    pub fn with_busy(mut self, k: usize) -> Self {
        self.busy = Some(k.max(1));
        self
    }

    /// The devices running kernels at once ([`CostModel::with_busy`]).
    fn busy(&self) -> usize {
        self.busy.unwrap_or_else(|| self.mesh.devices()).max(1)
    }

    /// Operator nodes in topological order.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }

    /// The FLOPs and bytes of an op, backward counted over the values gradients flow into.
    pub fn node_cost(&self, n: NodeId) -> &OpCost {
        &self.costs[&n]
    }

    /// The iteration space of an op.
    pub fn space(&self, n: NodeId) -> &IterSpace {
        &self.spaces[&n]
    }

    /// The extent-less dim of a sum of its inputs ([`DimKind::Linear`]), in a training graph:
    /// there it keeps a parameter's gradients from several readers partial until their one
    /// synchronisation. A forward model's plan prices that synchronisation per parameter
    /// already, so its search leaves the dim alone.
    pub fn linear_dim(&self, n: NodeId) -> Option<usize> {
        if !self.is_training_graph() {
            return None;
        }
        self.spaces.get(&n)?.dims.iter().position(|d| d.kind == DimKind::Linear)
    }

    /// The batch analysis.
    pub fn batch(&self) -> &BatchDims {
        &self.batch
    }

    /// Whether the graph is a training step (priced as it runs: each op once, in its
    /// phase) rather than a forward model (priced with its backward pass and update).
    pub fn is_training_graph(&self) -> bool {
        self.phases.is_some()
    }

    /// The phase op `n` runs in: its training-graph phase, else forward.
    pub fn phase(&self, n: NodeId) -> Phase {
        (*self.phases).as_ref().and_then(|p| p.get(&n).copied()).unwrap_or(Phase::Forward)
    }

    /// Bytes per element factor of float tensors in the training precision.
    fn precision_factor(&self) -> f64 {
        precision_factor(&self.opts)
    }

    /// Bytes of a value in training precision.
    pub fn value_bytes(&self, v: Value) -> f64 {
        let Some(t) = self.g.tensor_type(v) else { return 0.0 };
        let b = t.size_bytes().unwrap_or(0) as f64;
        if t.dtype.is_float() { b * self.precision_factor() } else { b }
    }

    fn peak(&self) -> f64 {
        self.cluster.device.peak_flops.at(self.opts.precision) / self.host_share()
    }

    /// Usable memory per device, bytes.
    fn capacity(&self) -> f64 {
        self.cluster.device.mem_capacity * self.cluster.device.mem_usable
    }

    /// Records op `n`'s own halo and statistics steps (their event is its first output).
    fn record_op_comm<'e>(&self, w: &mut Walk, n: NodeId, e: &OpEval, have: &dyn Fn(Value) -> &'e Sharding) {
        for (phase, st) in &e.comm {
            let out = Value::new(n, 0);
            w.record(*phase, out, Some(n), have(out), have(out), std::slice::from_ref(st));
        }
    }

    /// The static dims of `v` on one device under layout `l` (the whole tensor without one).
    fn local_static_dims(&self, v: Value, l: Option<&Sharding>) -> Option<Vec<i64>> {
        let d = self.g.tensor_type(v)?.static_dims()?;
        Some(match l {
            Some(l) => ir::reshard::local_dims(&d, l, &self.mesh),
            None => d,
        })
    }

    /// Whether op `n` is a view of its input on each device under input layouts `ins`: a sum,
    /// mean, max, min or product over axes whose local extent is 1 (the runtime makes it
    /// one — a reduction over a batch split down to one sample per device, say).
    fn local_view(&self, n: NodeId, ins: &[Option<Sharding>]) -> bool {
        let Some(axes) = ir::ops::reduce::single_element_axes(self.g, n) else { return false };
        let Some(local) =
            self.g.node(n).input(0).and_then(|x| self.local_static_dims(x, ins.first().and_then(Option::as_ref)))
        else {
            return false;
        };
        axes.iter().all(|&a| local.get(a) == Some(&1))
    }

    /// The kernels the runtime launches for convolution `n` (or one of its gradient ops) at
    /// its local shapes under `ins`/`outs`: forward, input gradient, weight gradient
    /// ([`ir::ops::conv::launches`]; a gradient op's own in all three); `None` for other ops.
    fn conv_launches(&self, n: NodeId, ins: &[Option<Sharding>], outs: &[Sharding]) -> Option<[f64; 3]> {
        let g = self.g;
        let node = g.node(n);
        let global = |v: Value| self.local_static_dims(v, None);
        let input = |i: usize| self.local_static_dims(node.input(i)?, ins.get(i).and_then(Option::as_ref));
        let out = self.local_static_dims(Value::new(n, 0), outs.first());
        // A grouped convolution split by its groups has fewer of them on each device.
        let groups = |group: i64, w_global: Option<Vec<i64>>, w_local: &[i64]| match w_global {
            Some(wg) if group > 1 && wg.first().is_some_and(|&m| m > 0) => {
                (group * w_local.first().copied().unwrap_or(0) / wg[0]).max(1)
            }
            _ => group,
        };
        match &node.op {
            Op::Conv(c) => {
                let (x, w, y) = (input(0)?, input(1)?, out?);
                let gr = groups(c.group(), global(node.input(1)?), &w);
                ir::ops::conv::launches_of(&x, &w, &y, gr)
            }
            Op::ConvGradInput(c) => {
                let (dy, w, dx) = (input(0)?, input(1)?, out?);
                let gr = groups(c.group(), global(node.input(1)?), &w);
                ir::ops::conv::launches_of(&dx, &w, &dy, gr).map(|l| [l[1]; 3])
            }
            Op::ConvGradWeight(c) => {
                let (x, dy, dw) = (input(0)?, input(1)?, out?);
                let gr = groups(c.group(), global(Value::new(n, 0)), &dw);
                ir::ops::conv::launches_of(&x, &dw, &dy, gr).map(|l| [l[2]; 3])
            }
            _ => None,
        }
    }

    /// How many devices share one device's compute and memory bandwidth: the mesh's size on
    /// a cluster of devices simulated on one host, else 1.
    fn host_share(&self) -> f64 {
        self.cluster.device.host_share(self.busy())
    }

    /// The fixed cost of one kernel on one device: the device's launch overhead, more on
    /// devices simulated on one host the more of them dispatch at once
    /// ([`super::cluster::Device::launch_at`]).
    pub fn launch(&self) -> f64 {
        self.cluster.device.launch_at(self.busy())
    }

    /// How much slower a kernel of `parallel` independent invocations runs than one that
    /// fills the device ([`super::cluster::Device::parallel_width`]; 1 when unknown).
    pub fn underfill(&self, parallel: f64) -> f64 {
        let d = &self.cluster.device;
        if d.parallel_width <= 0.0 || parallel <= 0.0 {
            return 1.0;
        }
        (d.parallel_width / parallel).clamp(1.0, d.serial_slowdown.max(1.0))
    }

    /// Memory bandwidth of one device, bytes/s.
    fn mem_bandwidth(&self) -> f64 {
        self.cluster.device.mem_bandwidth / self.host_share()
    }

    /// Roofline time of `flops` and `bytes` on one device, at the device's GEMM efficiency.
    pub fn roofline(&self, flops: f64, bytes: f64) -> f64 {
        self.roofline_at(flops, bytes, self.cluster.device.efficiency)
    }

    /// Roofline time at efficiency `eff`.
    fn roofline_at(&self, flops: f64, bytes: f64, eff: f64) -> f64 {
        (flops / (self.peak() * eff.max(1e-6))).max(bytes / self.mem_bandwidth())
    }

    /// The local GEMM problem (`m × n` output, reduction `k`) of a contraction or
    /// convolution under layouts `ins`/`outs`, for its shape-dependent efficiency, and how
    /// many such GEMMs one batched kernel runs.
    fn gemm_shape(&self, n: NodeId, ins: &[Option<Sharding>], outs: &[Sharding]) -> Option<(f64, f64, f64, f64)> {
        let (m, nn, k) = self.gemm_extents(n, ins, outs)?;
        let node = self.g.node(n);
        let batch = match &node.op {
            Op::MatMul(_) if !self.one_product(n, ins) => {
                let y = self.local_static_dims(Value::new(n, 0), outs.first())?;
                y.iter().rev().skip(2).product::<i64>() as f64
            }
            _ => 1.0,
        };
        Some((m, nn, k, batch))
    }

    /// The `(m, n, k)` of [`CostModel::gemm_shape`].
    fn gemm_extents(&self, n: NodeId, ins: &[Option<Sharding>], outs: &[Sharding]) -> Option<(f64, f64, f64)> {
        let g = self.g;
        let node = g.node(n);
        let local = |v: Value, l: Option<&Sharding>| -> Option<Vec<f64>> {
            Some(self.local_static_dims(v, l)?.into_iter().map(|x| x as f64).collect())
        };
        let a = local(node.input(0)?, ins.first().and_then(Option::as_ref))?;
        let y = local(Value::new(n, 0), outs.first())?;
        let last2 = |d: &[f64]| (d.len().checked_sub(2).map_or(1.0, |i| d[i]), d.last().copied().unwrap_or(1.0));
        match &node.op {
            Op::MatMul(_) => {
                let (m, nn) = if y.len() >= 2 { last2(&y) } else { (1.0, y.last().copied().unwrap_or(1.0)) };
                // A B without batch dims of its own is shared: the runtime folds A's batch into
                // the rows of one GEMM (`[64, 1, 512]·[512, 1536]` is 64 rows, not 64 GEMMs of one).
                let m = if self.one_product(n, ins) && y.len() >= 2 { y[..y.len() - 1].iter().product() } else { m };
                Some((m, nn, a.last().copied().unwrap_or(1.0)))
            }
            Op::Gemm(gm) => {
                let k = if gm.trans_a() != 0 { a.first().copied() } else { a.get(1).copied() };
                Some((y.first().copied().unwrap_or(1.0), y.get(1).copied().unwrap_or(1.0), k.unwrap_or(1.0)))
            }
            Op::Conv(_) | Op::ConvTranspose(_) => {
                let w = local(node.input(1)?, ins.get(1).and_then(Option::as_ref))?;
                let m = y.first().copied().unwrap_or(1.0) * y.iter().skip(2).product::<f64>();
                let (nn, k) = match &node.op {
                    Op::Conv(_) => (w.first().copied().unwrap_or(1.0), w.iter().skip(1).product::<f64>()),
                    _ => (
                        w.get(1).copied().unwrap_or(1.0),
                        w.first().copied().unwrap_or(1.0) * w.iter().skip(2).product::<f64>(),
                    ),
                };
                Some((m, nn, k))
            }
            // The runtime's gradient GEMMs (per group): dW[M, C·k] over the images and output
            // positions of dY; the columns of dX, Wᵀ·dY, over M.
            Op::ConvGradWeight(_) => {
                let dy = local(node.input(1)?, ins.get(1).and_then(Option::as_ref))?;
                let positions = dy.first().copied().unwrap_or(1.0) * dy.iter().skip(2).product::<f64>();
                Some((y.first().copied().unwrap_or(1.0), y.iter().skip(1).product::<f64>(), positions))
            }
            Op::ConvGradInput(_) => {
                let w = local(node.input(1)?, ins.get(1).and_then(Option::as_ref))?;
                let positions = a.first().copied().unwrap_or(1.0) * a.iter().skip(2).product::<f64>();
                Some((w.iter().skip(1).product::<f64>(), positions, w.first().copied().unwrap_or(1.0)))
            }
            _ => None,
        }
    }

    /// Whether a MatMul or Gemm runs as one GEMM product on the device: a Gemm always; a
    /// MatMul whose B has no batch of its own (A's batch folds into the rows).
    fn one_product(&self, n: NodeId, ins: &[Option<Sharding>]) -> bool {
        let node = self.g.node(n);
        match &node.op {
            Op::Gemm(_) => true,
            Op::MatMul(_) => node
                .input(1)
                .and_then(|b| self.local_static_dims(b, ins.get(1).and_then(Option::as_ref)))
                .is_some_and(|b| b.len() <= 2 || b[..b.len() - 2].iter().all(|&d| d == 1)),
            _ => false,
        }
    }

    /// The number of devices sharing an op's work under a strategy.
    pub fn strategy_factor(&self, n: NodeId, strategy: &[Option<usize>]) -> f64 {
        // A sum's extent-less dim divides no work: each device sums its partial sums.
        let sp = self.space(n);
        strategy
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some_and(|i| sp.dims[i].kind != DimKind::Linear))
            .map(|(a, _)| self.mesh.axes[a].size as f64)
            .product()
    }

    /// Compute, halo and statistics time of `n` under `strategy`.
    pub fn op_time(&self, n: NodeId, strategy: &[Option<usize>]) -> OpTime {
        self.op_eval(n, strategy).time
    }

    /// Forward and backward compute of `n` under `strategy`: the roofline of its local share.
    fn compute_time(
        &self,
        n: NodeId,
        strategy: &[Option<usize>],
        mode: Option<&SplitMode>,
        ins: &[Option<Sharding>],
        outs: &[Sharding],
    ) -> (f64, f64) {
        let node = self.g.node(n);
        if is_view(&node.op) || is_host(&node.op) || self.local_view(n, ins) {
            return (0.0, 0.0);
        }
        let c = &self.costs[&n];
        let f = self.strategy_factor(n, strategy);
        let pf = self.precision_factor();
        // Local bytes: activations divide by the op's split, weights by their own split.
        let mut param_local = 0.0;
        for (j, s) in ins.iter().enumerate() {
            if let (Some(v), Some(s)) = (node.input(j), s)
                && ir::cost::is_param(self.g, v)
            {
                param_local += self.value_bytes(v) * ir::cost::read_factor(self.g, n, j) / split_factor(s, &self.mesh);
            }
        }
        let act_bytes = (c.bytes_read - c.param_bytes + c.bytes_written) * pf / f;
        let d = &self.cluster.device;
        // A transpose that moves the innermost dim of a tensor too large for the cache reads or
        // writes with a stride.
        let strided = match (&node.op, node.input(0)) {
            (Op::Transpose(t), Some(x)) => {
                let rank = self.g.tensor_type(x).and_then(|t| t.rank()).unwrap_or(0);
                let last = t.perm.as_ref().map_or(0, |p| p.last().copied().unwrap_or(0) as usize);
                rank > 1 && last != rank - 1 && self.value_bytes(x) / f > d.transpose_cached_bytes
            }
            _ => false,
        };
        let stride_factor = if strided { 1.0 / d.transpose_efficiency.clamp(0.01, 1.0) } else { 1.0 };
        let bytes = (act_bytes + param_local) * stride_factor;
        // A convolution launches what the runtime's convolution kernels launch at this shape.
        let conv_launches = self.conv_launches(n, ins, outs);
        let launch = self.launch() * conv_launches.map_or(c.launches.max(1.0), |l| l[0]);
        // GEMMs and convolutions reach less of peak when small or skinny. The backward GEMMs
        // have the same three extents, permuted: of an `m × n` output over `k`, the input's
        // gradient is `m × k` over `n` (a convolution's runs transposed, `k × m`), the
        // weight's `k × n` over `m` — a convolution's each at its own shape's efficiency, as
        // the training program prices its gradient ops.
        let shape = self.gemm_shape(n, ins, outs);
        let eff = shape.map_or(d.efficiency, |(m, nn, k, b)| d.batched_gemm_efficiency(m, nn, k, b));
        // A MatMul or Gemm that is one product (a shared B folds A's batch into its rows)
        // splits a long reduction into a second dispatch, its forward and each gradient GEMM
        // by its own reduction (the input's over `n`, the weight's over the rows `m`).
        let split = |k: f64| ir::ops::contraction::gemm_dispatches(1, k as usize) as f64 - 1.0;
        let (fwd_split, bwd_split) = match (&node.op, shape) {
            (Op::MatMul(_) | Op::Gemm(_), Some((m, nn, k, _))) if self.one_product(n, ins) => {
                (split(k), split(nn) + split(m))
            }
            _ => (0.0, 0.0),
        };
        // A convolution's gradients run kernels of their own, at their own rate.
        let grad_rate = if matches!(node.op, Op::Conv(_)) { d.conv_grad_efficiency } else { 1.0 };
        let (fwd_eff, bwd_eff) = match &node.op {
            Op::ConvGradInput(_) | Op::ConvGradWeight(_) => (eff * d.conv_grad_efficiency, eff),
            _ => (eff, eff * grad_rate),
        };
        let bwd_flops = (c.bwd_data_flops + c.bwd_weight_flops) / f;
        // A statistic split the lowering expands into several kernels (synchronised batch
        // normalization) runs those kernels: their launches and their passes over the local
        // input, as the lowering emits them.
        let expansion = mode.and_then(|m| m.expansion(node));
        if let Some((e, grad)) = expansion {
            let x = node.input(SplitMode::main_input(node)).map_or(0.0, |v| self.value_bytes(v) / f);
            let run = |flops: f64, e: ir::ops::split::Expansion, eff: f64| {
                self.roofline_at(flops, e.passes as f64 * x, eff) + self.launch() * e.launches as f64
            };
            let fwd = run(c.fwd_flops / f, e, fwd_eff);
            let bwd = grad.map_or(0.0, |ge| if bwd_flops > 0.0 { run(bwd_flops, ge, bwd_eff) } else { 0.0 });
            return (fwd, bwd);
        }
        // What this device's kernels for the op take against their roofline (measured; the
        // launches are priced on their own). A strided transpose has its own measured rate
        // (`transpose_efficiency`) instead: the factor is measured on transposes that stream.
        let kernel = if strided { 1.0 } else { d.kernel_factors.get(node.op.op_type()).copied().unwrap_or(1.0) };
        // A kernel with fewer invocations than fill the device runs at that share of it.
        let fill = self.underfill(c.parallel / f);
        let fwd =
            self.roofline_at(c.fwd_flops / f, bytes, fwd_eff) * kernel * fill + launch + fwd_split * self.launch();
        let bwd = match shape {
            _ if bwd_flops <= 0.0 => 0.0,
            // The two gradient GEMMs, each reading and writing about what the op does (a
            // convolution's: the runtime's gradient kernels are GEMMs of exactly these shapes;
            // a MatMul's batched and broadcast gradients fold their batch dims into rows the
            // forward shape does not show, so they keep the forward's efficiency).
            // Each at its gradient kernel's measured rate, as the training program prices it.
            Some((m, nn, k, _)) if matches!(node.op, Op::Conv(_)) => {
                let factor = |k: &str| d.kernel_factors.get(k).copied().unwrap_or(1.0);
                self.roofline_at(c.bwd_data_flops / f, bytes, d.gemm_efficiency(m, k, nn) * grad_rate)
                    * factor("ConvGradInput")
                    + self.roofline_at(c.bwd_weight_flops / f, bytes, d.gemm_efficiency(k, nn, m) * grad_rate)
                        * factor("ConvGradWeight")
                    + conv_launches.map_or(2.0 * launch, |l| (l[1] + l[2]) * self.launch())
            }
            _ => {
                // An op whose gradient is a kernel of its own runs at that kernel's rate.
                let grad_kernel = node.op.rules().grad_kernel().and_then(|k| d.kernel_factors.get(k)).copied();
                self.roofline_at(bwd_flops, 2.0 * bytes, bwd_eff) * grad_kernel.unwrap_or(1.0)
                    + 2.0 * launch
                    + bwd_split * self.launch()
            }
        };
        (fwd, bwd)
    }

    /// The halo exchanges and statistics all-reduces `n` runs under `strategy`, forward then
    /// backward: exactly what the lowering emits for its [`SplitMode`].
    fn op_comm(
        &self,
        n: NodeId,
        strategy: &[Option<usize>],
        mode: Option<&SplitMode>,
        ins: &[Option<Sharding>],
    ) -> Vec<(Phase, Step)> {
        let node = self.g.node(n);
        let Some(mode) = mode else { return Vec::new() };
        let Some(x) = node.input(0) else { return Vec::new() };
        let (dims, eb) = self.value_shape(x);
        let layout = ins.first().cloned().flatten().unwrap_or_else(|| vec![AxisShard::Replicate; self.mesh.axes.len()]);
        let local = ir::reshard::local_dims(&dims, &layout, &self.mesh);
        let mut out = Vec::new();
        match mode {
            SplitMode::Halo(splits) => {
                let steps = self.halo_steps(splits, &local, eb);
                out.extend(steps.iter().cloned().map(|s| (Phase::Forward, s)));
                out.extend(steps.into_iter().map(|s| (Phase::Backward, s)));
            }
            SplitMode::Softmax { .. } | SplitMode::LayerNorm { .. } | SplitMode::BatchNorm { .. } => {
                let stat: Vec<usize> = match mode {
                    SplitMode::Softmax { axes, .. } | SplitMode::BatchNorm { stat: axes, .. } => axes.clone(),
                    SplitMode::LayerNorm { axis } => (*axis..local.len()).collect(),
                    _ => unreachable!(),
                };
                let axes: Vec<usize> =
                    (0..strategy.len()).filter(|&a| strategy[a].is_some_and(|i| stat.contains(&i))).collect();
                let elems: i64 = local.iter().enumerate().filter(|(d, _)| !stat.contains(d)).map(|(_, &e)| e).product();
                let ar = CommStep { kind: StepKind::AllReduce, axes, bytes: elems as f64 * eb, to: layout };
                let Some(step) = price(&ar, 1.0, &self.mesh, self.cluster) else { return out };
                let (f, b) = mode.stat_all_reduces();
                out.extend(std::iter::repeat_n((Phase::Forward, step.clone()), f));
                out.extend(std::iter::repeat_n((Phase::Backward, step), b));
            }
            SplitMode::Loss { ignore_index: Some(_) } => {
                // The count of the samples that count: one scalar all-reduce.
                let axes: Vec<usize> = (0..strategy.len()).filter(|&a| strategy[a].is_some()).collect();
                let ar = CommStep { kind: StepKind::AllReduce, axes, bytes: eb, to: layout };
                if let Some(step) = price(&ar, 1.0, &self.mesh, self.cluster) {
                    let (f, b) = mode.stat_all_reduces();
                    out.extend(std::iter::repeat_n((Phase::Forward, step.clone()), f));
                    out.extend(std::iter::repeat_n((Phase::Backward, step), b));
                }
            }
            SplitMode::Direct | SplitMode::VocabGather | SplitMode::Loss { ignore_index: None } => {}
        }
        out
    }

    /// One halo step per split spatial dim, as the lowering exchanges them in turn: every
    /// device sends its neighbours the rows their windows read (a slab of the tensor as it is
    /// after the earlier exchanges); the step takes as long as its busiest device.
    fn halo_steps(&self, splits: &[ir::ops::split::SpatialSplit], local: &[i64], eb: f64) -> Vec<Step> {
        let devices = self.mesh.devices();
        let coords: Vec<Vec<usize>> = (0..devices).map(|d| self.mesh.coords(d)).collect();
        let mut cur: Vec<Vec<i64>> = vec![local.to_vec(); devices];
        let mut steps = Vec::new();
        for h in splits {
            let level = self.mesh.axes[h.axis].level;
            let mut by_device = vec![0.0; devices];
            // Through the host: the busiest device's tensor down and the widened one back.
            let mut staged: f64 = 0.0;
            for d in 0..devices {
                let hw = &h.halos[coords[d][h.axis]];
                let before = cur[d].iter().map(|&e| e as f64).product::<f64>() * eb;
                let slab: f64 = cur[d]
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != h.tensor_dim)
                    .map(|(_, &e)| e as f64)
                    .product::<f64>()
                    * eb;
                by_device[d] = (hw.to_prev + hw.to_next) as f64 * slab;
                let t = &mut cur[d][h.tensor_dim];
                *t += (hw.from_prev + hw.from_next) as i64 - (hw.trim_start + hw.trim_end) as i64;
                let after = cur[d].iter().map(|&e| e as f64).product::<f64>() * eb;
                staged = staged.max(collective::staging(self.cluster, before, after, self.busy()));
            }
            let moved = by_device.iter().copied().fold(0.0, f64::max);
            if moved <= 0.0 {
                continue;
            }
            let (alpha, beta) = alpha_beta(self.cluster, level, 2, self.busy(), moved);
            steps.push(Step {
                kind: CommKind::Halo,
                axes: vec![h.axis],
                group: self.mesh.axes[h.axis].size,
                bytes: moved,
                moved,
                moved_by_device: Some(by_device),
                latency: alpha + collective::staging(self.cluster, 0.0, 0.0, self.busy()),
                time: p2p(moved, alpha, beta) + staged,
            });
        }
        steps
    }

    fn op_eval(&self, n: NodeId, s: &[Option<usize>]) -> Rc<OpEval> {
        if let Some(e) = self.op_memo.borrow().get(&(n, s.to_vec())) {
            return e.clone();
        }
        let (ins, outs) = strategy_shardings(&self.spaces[&n], s);
        let mode = split_mode(self.g, n, &self.spaces[&n], s, &self.mesh).ok();
        let (fwd, mut bwd) = self.compute_time(n, s, mode.as_ref(), &ins, &outs);
        let mut comm = self.op_comm(n, s, mode.as_ref(), &ins);
        if self.phases.is_some() {
            // A training graph's op runs once: its own work and communication, in its phase.
            bwd = 0.0;
            let phase = self.phase(n);
            comm = comm.into_iter().filter(|(p, _)| *p == Phase::Forward).map(|(_, st)| (phase, st)).collect();
        }
        let mut time = OpTime { fwd, bwd, ..OpTime::default() };
        for (phase, st) in &comm {
            match st.kind {
                CommKind::Halo => time.halo += st.time,
                _ => time.stats += st.time,
            }
            if *phase != Phase::Backward || self.phases.is_some() {
                time.comm_fwd += st.time;
            }
        }
        let reduces_param_grads = matches!(mode, Some(ir::ops::split::SplitMode::BatchNorm { .. }));
        let e = Rc::new(OpEval { strategy: s.to_vec(), time, ins, outs, comm, reduces_param_grads });
        self.op_memo.borrow_mut().insert((n, s.to_vec()), e.clone());
        e
    }

    /// The global dims of a value and the bytes of one element in training precision (a
    /// value without a static shape counts as a flat buffer).
    fn value_shape(&self, v: Value) -> (Vec<i64>, f64) {
        let Some(t) = self.g.tensor_type(v) else { return (vec![0], 1.0) };
        let eb = t.dtype.size_bytes() as f64 * if t.dtype.is_float() { self.precision_factor() } else { 1.0 };
        match t.static_dims() {
            Some(d) => (d, eb),
            None => (vec![(self.value_bytes(v) / eb.max(1e-30)).round() as i64], eb),
        }
    }

    /// The priced steps that reshard `v` from `from` to `to`, bytes scaled by `scale`.
    pub fn reshard(&self, v: Value, from: &Sharding, to: &Sharding, scale: f64) -> Rc<[Step]> {
        self.reshard_both(v, from, to, scale).0
    }

    /// The seconds of the local steps of a resharding (the algebra's slices and zeroings):
    /// no bytes cross a link, but the device runs a kernel for each, reading and writing its
    /// piece — a launch and a memory-bound pass, as the lowering's `Slice` and `Mul` run.
    pub fn reshard_local(&self, v: Value, from: &Sharding, to: &Sharding) -> f64 {
        self.reshard_both(v, from, to, 1.0).1
    }

    /// Whether bringing a value from layout `from` to `to` makes a new array: the layouts
    /// differ on an axis of more than one device (on an axis of one, a split or a partial sum
    /// is the whole value, which the runtime hands on).
    fn copies_on(&self, from: &Sharding, to: &Sharding) -> bool {
        self.mesh.axes.iter().zip(from.iter().zip(to)).any(|(a, (f, t))| a.size > 1 && f != t)
    }

    /// [`CostModel::reshard`] and [`CostModel::reshard_local`], memoised together.
    fn reshard_both(&self, v: Value, from: &Sharding, to: &Sharding, scale: f64) -> Resharded {
        if from == to {
            return (Rc::from(Vec::new()), 0.0);
        }
        let key = pack(from).zip(pack(to)).map(|(f, t)| (v, f, t, scale.to_bits()));
        if let Some(st) = key.as_ref().and_then(|k| self.reshard_memo.borrow().get(k).cloned()) {
            return st;
        }
        let (dims, eb) = self.value_shape(v);
        let algebra = ir::reshard::reshard(&dims, eb, from, to, &self.mesh, self.policy);
        let steps: Rc<[Step]> =
            super::collective::price_steps(&algebra, scale, &self.mesh, self.cluster, self.busy()).into();
        let whole = dims.iter().map(|&d| d.max(0) as f64).product::<f64>() * eb;
        let local: f64 = algebra
            .iter()
            .filter(|s| !s.kind.communicates())
            .map(|s| self.launch() + 2.0 * whole / split_factor(&s.to, &self.mesh) / self.mem_bandwidth())
            .sum();
        let both = (steps, local);
        if let Some(key) = key {
            self.reshard_memo.borrow_mut().insert(key, both.clone());
        }
        both
    }

    /// The strategy of `n` in an assignment (replicated when absent).
    pub fn strategy_of<'s>(&self, asg: &'s Assignment, n: NodeId) -> std::borrow::Cow<'s, [Option<usize>]> {
        match asg.strategies.get(&n) {
            Some(s) => std::borrow::Cow::Borrowed(s.as_slice()),
            None => std::borrow::Cow::Owned(vec![None; self.mesh.axes.len()]),
        }
    }

    /// Prices a whole assignment.
    pub fn evaluate(&self, asg: &Assignment) -> Breakdown {
        self.evaluate_with(asg, true)
    }

    /// Prices an assignment without the per-op rows and the communication events (for
    /// searches that price many plans): every other field is as [`CostModel::evaluate`]'s.
    pub fn price(&self, asg: &Assignment) -> Breakdown {
        self.evaluate_with(asg, false)
    }

    fn evaluate_with(&self, asg: &Assignment, detail: bool) -> Breakdown {
        if self.phases.is_some() {
            return self.evaluate_training(asg, detail);
        }
        let g = self.g;
        let mesh = &self.mesh;
        let evals: Vec<Rc<OpEval>> = self.order.iter().map(|&n| self.op_eval(n, &self.strategy_of(asg, n))).collect();
        let (out_sh, storage) = self.layouts(&evals, &ir::reshard::ZeroLayouts::default());
        let replicated: Sharding = vec![AxisShard::Replicate; mesh.axes.len()];
        let have =
            |v: Value| -> &Sharding { out_sh.get(&v).copied().or_else(|| storage.get(&v)).unwrap_or(&replicated) };

        let mut w = Walk::new(detail, self.order.len());
        let mut edges = Edges::default();
        let (mut fwd_total, mut compute_total, mut comm_total, mut activations) = (0.0, 0.0, 0.0, 0.0);
        let mut bwd_items: Vec<(NodeId, f64)> = Vec::with_capacity(self.order.len());
        // Gradient accumulation: a micro-batch's values are 1/k of the batch's.
        let k = self.opts.accumulation.max(1) as f64;
        let micro_local = |v: Value| self.value_bytes(v) / split_factor(have(v), mesh) / k;
        for (pos, (&n, e)) in self.order.iter().zip(&evals).enumerate() {
            let node = g.node(n);
            let t = e.time;
            let (fwd_comm, bwd_comm, grad_sum) =
                self.op_edges(&mut w, &mut edges, pos, n, e, &have, &|v| out_sh.contains_key(&v));
            let (fwd_comm, bwd_comm) =
                self.tp_overlapped(n, fwd_comm, bwd_comm, &|m| self.op_eval(m, &self.strategy_of(asg, m)).time);
            self.record_op_comm(&mut w, n, e, &have);
            // Accumulating over k micro-batches launches each kernel k times.
            let relaunch = if is_view(&node.op) || is_host(&node.op) { 0.0 } else { (k - 1.0) * self.launch() };
            fwd_total += t.fwd + fwd_comm + t.comm_fwd + relaunch;
            // A recomputed op runs its forward (and its forward communication) again inside
            // the backward pass.
            let again = if self.stash.as_ref().is_some_and(|s| s.recomputed.contains(&n)) { t.fwd } else { 0.0 };
            let again_comm = if again > 0.0 { fwd_comm + t.comm_fwd } else { 0.0 };
            let bwd_compute = t.bwd + grad_sum + again;
            compute_total += t.fwd + bwd_compute;
            let op_comm = fwd_comm + bwd_comm + t.halo + t.stats + again_comm;
            comm_total += op_comm;
            bwd_items.push((n, bwd_compute + bwd_comm + t.comm_bwd() + again_comm + relaunch));
            let kept = self.kept_by(n, &micro_local, &mut w.workspace);
            activations += kept;
            if detail {
                w.rows.push(OpRow {
                    name: row_name(node),
                    op: node.op.op_type().to_string(),
                    strategy: self.describe_strategy(n, &e.strategy),
                    compute_s: t.fwd + bwd_compute,
                    communication_s: op_comm,
                    memory_bytes: kept,
                    forward_s: t.fwd + fwd_comm + t.comm_fwd,
                    backward_s: bwd_compute + bwd_comm + t.comm_bwd(),
                    param_memory_bytes: 0.0,
                    grad_memory_bytes: 0.0,
                    grad_sync_s: 0.0,
                    update_s: 0.0,
                });
            }
        }
        // Graph outputs end reduced and cut only along their batch dims (what a loss or the
        // host reads); the collectives that make them so are part of the forward pass.
        let deliveries = self.deliveries(&have, &storage, &ir::reshard::ZeroLayouts::default());
        let out_comm: f64 = self.output_comm(&mut w, &edges, &have, &deliveries).iter().sum();
        fwd_total += out_comm;
        comm_total += out_comm;

        if let Some(st) = &self.stash {
            activations += st.transient_bytes(&micro_local);
        }
        let mut grads = self.gradient_sync(&mut w, &edges, &storage);
        let (ways, gather) = self.zero_sync(&mut w, &mut grads);
        let params = self.parameters(&mut w, &edges, &storage, &ways);
        w.workspace += params.gathered;
        w.bwd_events.reverse();
        let mut events = std::mem::take(&mut w.events);
        events.append(&mut w.bwd_events);
        let mut sync_events = std::mem::take(&mut w.sync_events);
        sync_events.sort_by_key(|e| e.value);
        events.extend(sync_events);
        // Synchronisation overlaps the last micro-batch's backward pass only.
        let last: Vec<(NodeId, f64)> = bwd_items.iter().map(|&(n, t)| (n, t / k)).collect();
        let (last_bwd, grad_sync, exposed) = self.backward_timeline(&mut w, &last, &grads);
        let bwd_total = last_bwd * k;
        comm_total += grad_sync;
        // ZeRO-3 gathers the parameters for every micro-batch.
        let gather = if self.opts.zero >= 3 { gather * k } else { gather };
        let gather_exposed = self.zero_gather_exposed(gather, fwd_total, bwd_total, fwd_total / k);
        let gathers = if self.opts.zero >= 3 { 2.0 * gather } else { gather };
        comm_total += gathers;

        // Optimizer update: memory-bound traffic over the local parameters, one kernel per
        // parameter (the runtime's `SgdUpdate`/`AdamUpdate` per parameter, as the training
        // program prices them).
        let update =
            params.elems * self.update_bytes_per_elem() / self.mem_bandwidth() + self.launch() * params.count as f64;

        // Host→device input.
        let (input_transfer, input_bytes) = self.input_time(&storage, mesh);
        let before_input = fwd_total + bwd_total + exposed + gather_exposed + update;
        let input_exposed = if self.opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };

        let memory = Memory {
            weights: params.bytes,
            gradients: params.trained_bytes,
            optimizer: params.elems * self.optimizer_bytes_per_elem(),
            activations,
            workspace: w.workspace,
        };
        let capacity = self.capacity();
        let total = memory.total();
        let feasible = total <= capacity;
        let infeasible_reason = (!feasible).then(|| overflow_reason(&memory, capacity));
        let bytes_moved_per_device = if detail { bytes_moved_per_device(&events, mesh) } else { BTreeMap::new() };
        Breakdown {
            step_time_s: before_input + input_exposed,
            compute_s: compute_total,
            forward_s: fwd_total,
            backward_s: bwd_total,
            update_s: update,
            communication_s: comm_total,
            communication_by_kind: w.by_kind(),
            gradient_sync_s: grad_sync + gathers,
            exposed_gradient_sync_s: exposed + gather_exposed,
            bubble_s: 0.0,
            input_s: input_exposed,
            input_transfer_s: input_transfer,
            input_bytes,
            memory_per_device_bytes: vec![total as u64; mesh.devices()],
            memory,
            memory_capacity_bytes: capacity as u64,
            feasible,
            infeasible_reason,
            ops: w.rows,
            events,
            bytes_moved_per_device,
            policy: self.policy,
        }
    }

    /// The activation bytes op `n` keeps for the backward pass on one device, with `local`
    /// the bytes of a value there: the outputs the stash keeps ([`super::stash`]), or, for a
    /// model that cannot be differentiated, every output of an op that computes something.
    /// Raises `workspace` to the largest computed output.
    fn kept_by(&self, n: NodeId, local: &dyn Fn(Value) -> f64, workspace: &mut f64) -> f64 {
        let node = self.g.node(n);
        if is_view(&node.op) || is_host(&node.op) {
            return 0.0;
        }
        let mut kept = 0.0;
        for slot in 0..node.num_outputs() {
            let v = Value::new(n, slot as u16);
            if self.g.value_name(v).is_empty() {
                continue;
            }
            let b = local(v);
            *workspace = workspace.max(b);
            if self.stash.as_ref().is_none_or(|s| s.kept.contains(&v)) {
                kept += b;
            }
        }
        kept
    }

    /// Prices a training graph as it runs: each op once, in its phase
    /// ([`ir::reshard::step_phases`]); the collectives its layouts need, tagged with the phase
    /// of the op that reads them (what the lowering emits, tagged the same); no backward pass
    /// or optimizer update added, since the graph has them. Gradient synchronisation is the
    /// resharding of the gradients into the updates, exposed whole (the runtime runs it where
    /// the update reads it). Memory by liveness over the op order: initializers (parameters,
    /// optimizer state) for the whole step, every other value from its op to its last reader
    /// (graph outputs to the end); the peak is what the step needs.
    fn evaluate_training(&self, asg: &Assignment, detail: bool) -> Breakdown {
        let g = self.g;
        let mesh = &self.mesh;
        let evals: Vec<Rc<OpEval>> = self.order.iter().map(|&n| self.op_eval(n, &self.strategy_of(asg, n))).collect();
        let zero = self.zero_layouts(&evals);
        let (out_sh, storage) = self.layouts(&evals, &zero);
        let replicated: Sharding = vec![AxisShard::Replicate; mesh.axes.len()];
        let have =
            |v: Value| -> &Sharding { out_sh.get(&v).copied().or_else(|| storage.get(&v)).unwrap_or(&replicated) };
        let local = |v: Value| self.value_bytes(v) / split_factor(have(v), mesh);
        let fixed = |v: Value| matches!(g.node(v.node).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef);
        let deliveries = self.deliveries(&have, &storage, &zero);
        let copies = self.copies(&evals, &have, &|v| out_sh.contains_key(&v), &deliveries, &zero);
        // Outputs are held to the end, but for those delivered in a layout a reader made
        // before (a ZeRO gradient's shard): that copy is, the value itself only to its reader.
        let outputs: FxHashSet<Value> =
            g.outputs().iter().map(|o| o.value).filter(|v| !copies.delivered_early.contains(v)).collect();

        let mut w = Walk::new(detail, self.order.len());
        let mut edges = Edges::default();
        // Per phase (forward, backward, gradient): compute and communication seconds.
        let (mut compute, mut comm) = ([0.0f64; 3], [0.0f64; 3]);
        let (mut live, mut peak) = (0.0f64, 0.0f64);
        let mut prev = None;
        for (pos, (&n, e)) in self.order.iter().zip(&evals).enumerate() {
            let node = g.node(n);
            let phase = self.phase(n);
            // ZeRO-3 parameters gathered for the forward pass are gathered again after it.
            if ir::reshard::ZeroLayouts::ends_forward(prev, Some(phase)) {
                edges.materialized.retain(|(v, l)| !zero.regathered(*v) || storage.get(v) == Some(*l));
            }
            prev = Some(phase);
            live += copies.made[pos];
            let (edge_comm, _, _) = self.op_edges(&mut w, &mut edges, pos, n, e, &have, &|v| out_sh.contains_key(&v));
            self.record_op_comm(&mut w, n, e, &have);
            let op_comm = edge_comm + e.time.comm_fwd;
            compute[phase as usize] += e.time.fwd;
            comm[phase as usize] += op_comm;
            let mut made = 0.0;
            for slot in 0..node.num_outputs() {
                let v = Value::new(n, slot as u16);
                if !g.value_name(v).is_empty() {
                    made += local(v);
                }
            }
            w.workspace = w.workspace.max(made);
            live += made;
            peak = peak.max(live);
            for v in &copies.frees[pos] {
                if !fixed(*v) && !outputs.contains(v) {
                    live -= local(*v);
                }
            }
            for slot in 0..node.num_outputs() {
                let v = Value::new(n, slot as u16);
                if !g.value_name(v).is_empty() && !copies.read.contains(&v) && !outputs.contains(&v) {
                    live -= local(v);
                }
            }
            live -= copies.freed[pos];
            if detail {
                w.rows.push(OpRow {
                    name: row_name(node),
                    op: node.op.op_type().to_string(),
                    strategy: self.describe_strategy(n, &e.strategy),
                    compute_s: e.time.fwd,
                    communication_s: op_comm,
                    memory_bytes: made,
                    forward_s: if phase == Phase::Forward { e.time.fwd + op_comm } else { 0.0 },
                    backward_s: if phase == Phase::Backward { e.time.fwd + op_comm } else { 0.0 },
                    param_memory_bytes: 0.0,
                    grad_memory_bytes: 0.0,
                    grad_sync_s: if phase == Phase::Gradient { op_comm } else { 0.0 },
                    update_s: if phase == Phase::Gradient { e.time.fwd } else { 0.0 },
                });
            }
        }
        let out_comm = self.output_comm(&mut w, &edges, &have, &deliveries);
        for (c, o) in comm.iter_mut().zip(out_comm) {
            *c += o;
        }
        // The outputs delivered in another layout at the end, beside what is held then.
        peak = peak.max(live + copies.at_end);
        w.events.append(&mut w.bwd_events);

        // Held for the whole step: parameters (trainable initializers), the optimizer's and
        // the normalizations' state, and the graph's inputs.
        let trainable: FxHashSet<Value> = ir::train::gradient_outputs(g).into_iter().map(|(_, p)| p).collect();
        let (mut weights, mut state, mut inputs) = (0.0, 0.0, 0.0);
        for v in storage.keys().copied().filter(|&v| fixed(v)) {
            match g.node(v.node).op {
                Op::Initializer(_) if trainable.contains(&v) => weights += local(v),
                Op::Initializer(_) => state += local(v),
                _ => inputs += local(v),
            }
        }
        let (input_transfer, input_bytes) = self.input_time(&storage, mesh);
        let [fwd, bwd, grad] = [0, 1, 2].map(|p| compute[p] + comm[p]);
        let before_input = fwd + bwd + grad;
        let input_exposed = if self.opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };
        let memory =
            Memory { weights, gradients: 0.0, optimizer: state, activations: peak + inputs, workspace: w.workspace };
        let capacity = self.capacity();
        let total = memory.total();
        let feasible = total <= capacity;
        let bytes_moved_per_device = if detail { bytes_moved_per_device(&w.events, mesh) } else { BTreeMap::new() };
        Breakdown {
            step_time_s: before_input + input_exposed,
            compute_s: compute[0] + compute[1],
            forward_s: fwd,
            backward_s: bwd,
            update_s: compute[2],
            communication_s: comm.iter().sum(),
            communication_by_kind: w.by_kind(),
            gradient_sync_s: comm[2],
            exposed_gradient_sync_s: comm[2],
            bubble_s: 0.0,
            input_s: input_exposed,
            input_transfer_s: input_transfer,
            input_bytes,
            memory_per_device_bytes: vec![total as u64; mesh.devices()],
            infeasible_reason: (!feasible).then(|| overflow_reason(&memory, capacity)),
            memory,
            memory_capacity_bytes: capacity as u64,
            feasible,
            ops: w.rows,
            events: w.events,
            bytes_moved_per_device,
            policy: self.policy,
        }
    }

    /// ZeRO's layouts in this training graph ([`ir::reshard::ZeroLayouts`]), from its updates'
    /// strategies, as the lowering reads them.
    fn zero_layouts(&self, evals: &[Rc<OpEval>]) -> ir::reshard::ZeroLayouts {
        if self.opts.zero < 2 {
            return ir::reshard::ZeroLayouts::default();
        }
        let pos: FxHashMap<NodeId, usize> = self.order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        ir::reshard::ZeroLayouts::new(self.g, self.opts.zero, |u, j| {
            pos.get(&u).and_then(|&p| evals[p].ins.get(j).cloned().flatten())
        })
    }

    /// The layout graph output `v` (held in `from`) is delivered in: a ZeRO gradient's shard,
    /// else [`ir::reshard::delivered_layout`].
    fn delivered(
        &self,
        v: Value,
        from: &Sharding,
        storage: &BTreeMap<Value, Sharding>,
        zero: &ir::reshard::ZeroLayouts,
        carried: &[(Value, Value)],
    ) -> Sharding {
        let batch = self.batch.get(&v).map_or(&[][..], Vec::as_slice);
        zero.delivered(self.g, carried, v, from, batch, |s| storage.get(&s).cloned())
    }

    /// The copies a training step holds beside its ops' outputs, as the lowering makes them:
    /// a value brought to another layout for a reader is held from the first reader that
    /// needs it there to the last — to the end when the value is also delivered so — except
    /// that a ZeRO-3 parameter's copies made in the forward pass end with it; a graph output
    /// delivered in a layout no reader made is made at the end, in place of the value.
    fn copies<'e>(
        &self,
        evals: &[Rc<OpEval>],
        have: &dyn Fn(Value) -> &'e Sharding,
        produced: &dyn Fn(Value) -> bool,
        deliveries: &[(Value, Sharding)],
        zero: &ir::reshard::ZeroLayouts,
    ) -> Copies {
        let g = self.g;
        let end = self.order.len();
        // A ZeRO-3 parameter's copies live within one pass (`epoch`): they end when a forward
        // pass does.
        let mut life: FxHashMap<(Value, Sharding, usize), (usize, usize)> = FxHashMap::default();
        let mut last: FxHashMap<Value, usize> = FxHashMap::default();
        let (mut prev, mut epoch) = (None, 0);
        let mut pos_of: FxHashMap<NodeId, usize> = FxHashMap::default();
        for (pos, (&n, e)) in self.order.iter().zip(evals).enumerate() {
            pos_of.insert(n, pos);
            let phase = Some(self.phase(n));
            epoch += usize::from(ir::reshard::ZeroLayouts::ends_forward(prev, phase));
            prev = phase;
            for (j, v) in g.node(n).inputs().iter().enumerate() {
                let Some(v) = v else { continue };
                let need = e.ins.get(j).cloned().flatten();
                let copy = need
                    .filter(|need| (ir::reshard::held_once(g, *v) || produced(*v)) && self.copies_on(have(*v), need));
                // The value is read here, or copied where its copy is made.
                let at = match copy {
                    None => pos,
                    Some(need) => {
                        // A ZeRO gradient is brought to its update's shard where it is computed.
                        let first = if zero.gradients.get(v) == Some(&need) { pos_of[&v.node] } else { pos };
                        let key = (*v, need, if zero.regathered(*v) { epoch } else { 0 });
                        let l = life.entry(key).or_insert((first, pos));
                        l.1 = pos;
                        l.0
                    }
                };
                let l = last.entry(*v).or_insert(at);
                *l = (*l).max(at);
            }
        }
        let mut c =
            Copies { made: vec![0.0; end], freed: vec![0.0; end], frees: vec![Vec::new(); end], ..Copies::default() };
        for (v, to) in deliveries {
            let v = *v;
            if to == have(v) {
                continue;
            }
            match life.get_mut(&(v, to.clone(), if zero.regathered(v) { epoch } else { 0 })) {
                Some(l) => {
                    l.1 = end;
                    c.delivered_early.insert(v);
                }
                // Made at the end, after which the value itself is not held.
                None => {
                    c.at_end += self.value_bytes(v) / split_factor(to, &self.mesh)
                        - self.value_bytes(v) / split_factor(have(v), &self.mesh)
                }
            }
        }
        for ((v, layout, _), (first, last)) in life {
            let bytes = self.value_bytes(v) / split_factor(&layout, &self.mesh);
            c.made[first] += bytes;
            if last < end {
                c.freed[last] += bytes;
            }
        }
        for (&v, &at) in &last {
            c.frees[at].push(v);
        }
        c.read = last.into_keys().collect();
        c
    }

    /// Layouts: op outputs from their strategies; parameters, constants and graph inputs as
    /// their first reader needs them, never as partial sums (see [`ir::reshard::held_once`],
    /// [`ir::reshard::held_layout`]).
    fn layouts<'e>(
        &self,
        evals: &'e [Rc<OpEval>],
        zero: &ir::reshard::ZeroLayouts,
    ) -> (FxHashMap<Value, &'e Sharding>, BTreeMap<Value, Sharding>) {
        let g = self.g;
        let replicated: Sharding = vec![AxisShard::Replicate; self.mesh.axes.len()];
        let mut out_sh: FxHashMap<Value, &Sharding> = FxHashMap::default();
        out_sh.reserve(self.order.len());
        for (&n, e) in self.order.iter().zip(evals) {
            for (slot, sh) in e.outs.iter().enumerate() {
                out_sh.insert(Value::new(n, slot as u16), sh);
            }
        }
        let mut storage: BTreeMap<Value, Sharding> = zero.params.iter().map(|(v, l)| (*v, l.clone())).collect();
        for (&n, e) in self.order.iter().zip(evals) {
            for (j, v) in g.node(n).inputs().iter().enumerate() {
                if let Some(v) = v
                    && !out_sh.contains_key(v)
                    && !storage.contains_key(v)
                {
                    let need = e.ins.get(j).cloned().flatten();
                    storage.insert(*v, need.map_or_else(|| replicated.clone(), |l| ir::reshard::held_layout(&l)));
                }
            }
        }
        (out_sh, storage)
    }

    /// Gradients flow back into `v` in the backward pass priced ([`ir::cost::grad_flow`]; a
    /// training graph computes its gradients itself, so none are added for it).
    pub(crate) fn needs_grad(&self, v: Value) -> bool {
        self.phases.is_none() && self.grads.contains(&v)
    }

    /// The reshardings on the inputs of op `n` (position `pos`): forward, each input brought
    /// to the layout the op needs (once per layout); backward, the input's gradient — partial
    /// along axes the op splits while the input is replicated on them — brought back to the
    /// layout it was held in. Parameters' gradients are collected for synchronisation.
    /// Returns the forward and backward communication seconds, and the backward compute
    /// seconds of summing the gradients of a value read more than once (autodiff's `Sum`).
    #[allow(clippy::too_many_arguments)]
    fn op_edges<'e>(
        &self,
        w: &mut Walk,
        edges: &mut Edges<'e>,
        pos: usize,
        n: NodeId,
        e: &'e OpEval,
        have: &dyn Fn(Value) -> &'e Sharding,
        produced: &dyn Fn(Value) -> bool,
    ) -> (f64, f64, f64) {
        let g = self.g;
        let axes = self.mesh.axes.len();
        let s = &e.strategy;
        let (mut fwd, mut bwd, mut sum) = (0.0, 0.0, 0.0);
        let node = g.node(n);
        for (j, v) in node.inputs().iter().enumerate() {
            let Some(v) = v else { continue };
            let Some(Some(need)) = e.ins.get(j) else { continue };
            if !ir::reshard::held_once(g, *v) && !produced(*v) {
                continue; // integer inputs and constants: the host provides every layout
            }
            let src = have(*v);
            // A tensor is materialized in a layout once, however many ops read it there.
            if src != need && edges.materialized.insert((*v, need)) {
                let steps = self.reshard(*v, src, need, 1.0);
                fwd += w.record(self.phase(n), *v, Some(n), src, need, &steps) + self.reshard_local(*v, src, need);
            }
            if !self.needs_grad(*v) || !node.op.rules().differentiates(j) {
                continue;
            }
            let whole = e.reduces_param_grads && ir::cost::is_param(g, *v);
            let grad: Sharding = (0..axes)
                .map(|a| {
                    if need[a] == AxisShard::Replicate && s[a].is_some() && !whole {
                        AxisShard::Partial
                    } else {
                        need[a]
                    }
                })
                .collect();
            // The gradients of a value read more than once are summed by one kernel reading
            // them all: its launch and two passes with the second read, a pass per further one.
            let reads = edges.grad_reads.entry(*v).or_insert(0);
            *reads += 1;
            if *reads > 1 {
                let first = *reads == 2;
                let bytes = self.value_bytes(*v) / split_factor(&grad, &self.mesh);
                let kernel = self.cluster.device.kernel_factors.get("Sum").copied().unwrap_or(1.0);
                sum += bytes * if first { 3.0 } else { 1.0 } / self.mem_bandwidth() * kernel
                    + if first { self.launch() } else { 0.0 };
            }
            if ir::cost::is_param(g, *v) {
                let acc = edges.param_grad.entry(*v).or_insert_with(|| src.clone());
                for a in 0..axes {
                    if grad[a] == AxisShard::Partial {
                        acc[a] = AxisShard::Partial;
                    }
                }
                // Its gradient is complete when its first reader's backward finishes.
                edges.param_first_use.entry(*v).or_insert(pos);
            } else if !edges.grads_sent.contains(&(*v, grad.clone())) {
                // Gradients of one layout from several readers are summed locally first.
                let target: Sharding =
                    src.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
                let steps = self.reshard(*v, &grad, &target, 1.0);
                bwd += w.record(Phase::Backward, *v, Some(n), &grad, &target, &steps)
                    + self.reshard_local(*v, &grad, &target);
                edges.grads_sent.insert((*v, grad));
            }
        }
        (fwd, bwd, sum)
    }

    /// The collectives that bring every graph output to [`ir::reshard::delivered_layout`].
    fn output_comm<'e>(
        &self,
        w: &mut Walk,
        edges: &Edges<'e>,
        have: &dyn Fn(Value) -> &'e Sharding,
        deliveries: &[(Value, Sharding)],
    ) -> [f64; 3] {
        let mut t = [0.0; 3];
        for (v, to) in deliveries {
            let (v, from) = (*v, have(*v));
            if edges.materialized.contains(&(v, to)) {
                continue; // a reader already made it
            }
            let steps = self.reshard(v, from, to, 1.0);
            let phase = self.phase(v.node);
            t[phase as usize] += w.record(phase, v, None, from, to, &steps) + self.reshard_local(v, from, to);
        }
        t
    }

    /// Each graph output held once ([`ir::reshard::held_once`]), once, with the layout it is
    /// delivered in ([`CostModel::delivered`]).
    fn deliveries<'e>(
        &self,
        have: &dyn Fn(Value) -> &'e Sharding,
        storage: &BTreeMap<Value, Sharding>,
        zero: &ir::reshard::ZeroLayouts,
    ) -> Vec<(Value, Sharding)> {
        let carried = ir::train::carried_state(self.g);
        let mut done: FxHashSet<Value> = FxHashSet::default();
        let outs = self.g.outputs().iter().map(|o| o.value);
        outs.filter(|&v| done.insert(v) && ir::reshard::held_once(self.g, v))
            .map(|v| (v, self.delivered(v, have(v), storage, zero, &carried)))
            .collect()
    }

    /// Per parameter, the synchronisation of its gradient: from the layout its readers leave
    /// it in to its storage layout, partial sums reduced.
    fn gradient_sync(&self, w: &mut Walk, edges: &Edges<'_>, storage: &BTreeMap<Value, Sharding>) -> Vec<GradEvent> {
        let axes = self.mesh.axes.len();
        let mut out = Vec::new();
        for (v, grad) in &edges.param_grad {
            let st = storage.get(v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; axes]);
            let target: Sharding =
                st.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
            let steps = self.reshard(*v, grad, &target, self.opts.grad_compression);
            if steps.is_empty() {
                continue;
            }
            let local_bytes = self.value_bytes(*v) * self.opts.grad_compression / split_factor(&target, &self.mesh);
            let t = super::collective::total(&steps);
            let latency: f64 = steps.iter().map(|s| s.latency).sum();
            // Bandwidth terms are paid per tensor; latency terms per bucket (below).
            for s in steps.iter() {
                *w.comm_kind.entry(s.kind.name()).or_insert(0.0) += s.time - s.latency;
            }
            if w.detail {
                w.rows[edges.param_first_use[v]].grad_sync_s += t;
                w.sync_events.push(CommEvent {
                    phase: Phase::Gradient,
                    value: *v,
                    op: None,
                    from: grad.clone(),
                    to: target,
                    steps: steps.to_vec(),
                });
            }
            out.push(GradEvent {
                value: *v,
                pos: edges.param_first_use[v],
                bytes: local_bytes,
                bandwidth: t - latency,
                latency,
                sig: steps.iter().map(|s| (s.kind, s.axes.clone())).collect(),
                step_bandwidth: steps.iter().map(|s| s.time - s.latency).collect(),
            });
        }
        out
    }

    /// Optimizer state bytes per parameter element.
    fn optimizer_bytes_per_elem(&self) -> f64 {
        optimizer_bytes_per_elem(&self.opts)
    }

    /// Memory traffic of the update per parameter element.
    fn update_bytes_per_elem(&self) -> f64 {
        (match self.opts.optimizer {
            Optimizer::Sgd => 20.0,
            Optimizer::Adam => 28.0,
        }) + if self.opts.precision == Precision::Fp16 { 8.0 } else { 0.0 }
    }

    /// The parameters each device stores, and their rows' memory and update time.
    fn parameters(
        &self,
        w: &mut Walk,
        edges: &Edges<'_>,
        storage: &BTreeMap<Value, Sharding>,
        ways: &FxHashMap<Value, f64>,
    ) -> Params {
        let pf = self.precision_factor();
        let zero = self.opts.zero;
        let mut p = Params::default();
        for (v, st) in storage {
            if !ir::cost::is_param(self.g, *v) {
                continue;
            }
            let local = self.value_bytes(*v) / split_factor(st, &self.mesh);
            let n = ways.get(v).copied().unwrap_or(1.0);
            let at = |stage: u8| if zero >= stage { n } else { 1.0 };
            let elems = local / (4.0 * pf) / at(1);
            p.bytes += local / at(3);
            if !edges.param_first_use.contains_key(v) {
                continue; // stored, never trained
            }
            if zero >= 3 && n > 1.0 {
                p.gathered = p.gathered.max(2.0 * local);
            }
            p.trained_bytes += local / at(2);
            p.elems += elems;
            p.count += 1;
            if w.detail
                && let Some(&first) = edges.param_first_use.get(v)
            {
                w.rows[first].param_memory_bytes +=
                    local / at(3) + local / at(2) + elems * self.optimizer_bytes_per_elem();
                w.rows[first].grad_memory_bytes += local / at(2);
                w.rows[first].update_s += elems * self.update_bytes_per_elem() / self.mem_bandwidth();
            }
        }
        p
    }

    /// ZeRO's synchronisation (`opts.zero` ≥ 1): a gradient all-reduced over its parameter's
    /// data-parallel devices is reduce-scattered instead (half the all-reduce's time, in the
    /// backward pass's buckets as before) and the updated shards all-gathered after the update
    /// (the other half; stage 3 gathers before the forward and again before the backward
    /// instead). Returns each such parameter's data-parallel ways and the seconds of one
    /// all-gather of them all.
    fn zero_sync(&self, w: &mut Walk, grads: &mut [GradEvent]) -> (FxHashMap<Value, f64>, f64) {
        let mut ways = FxHashMap::default();
        let (mut gather, mut bytes, mut latency) = (0.0f64, 0.0f64, 0.0f64);
        if self.opts.zero == 0 {
            return (ways, 0.0);
        }
        for e in grads.iter_mut() {
            // An all-reduce: one, or the link hierarchy's reduce-scatter, all-reduce and
            // all-gather (multi-node meshes under the hierarchical policy).
            let reduces =
                |k: &CommKind| matches!(k, CommKind::AllReduce | CommKind::ReduceScatter | CommKind::AllGather);
            if e.sig.is_empty()
                || !e.sig.iter().all(|(k, _)| reduces(k))
                || e.sig.iter().all(|(k, _)| *k == CommKind::AllGather)
            {
                continue;
            }
            let mut axes: Vec<usize> = e.sig.iter().flat_map(|(_, a)| a.iter().copied()).collect();
            axes.sort_unstable();
            axes.dedup();
            let n: usize = axes.iter().map(|&a| self.mesh.axes[a].size).product();
            for ((k, _), bw) in e.sig.iter().zip(&e.step_bandwidth) {
                *w.comm_kind.entry(k.name()).or_insert(0.0) -= bw;
            }
            e.bandwidth /= 2.0;
            e.latency /= 2.0;
            e.sig = vec![(CommKind::ReduceScatter, axes)];
            e.step_bandwidth = vec![e.bandwidth];
            gather += e.bandwidth;
            bytes += e.bytes;
            latency = latency.max(e.latency);
            *w.comm_kind.entry(CommKind::ReduceScatter.name()).or_insert(0.0) += e.bandwidth;
            ways.insert(e.value, n as f64);
        }
        // The gathers are bucketed as the gradients are: latency per bucket.
        gather += latency * (bytes / self.opts.bucket_bytes).ceil();
        let gathers = if self.opts.zero >= 3 { 2.0 } else { 1.0 };
        *w.comm_kind.entry(CommKind::AllGather.name()).or_insert(0.0) += gathers * gather;
        (ways, gather)
    }

    /// The exposed seconds of ZeRO's parameter all-gathers (`gather`: one of all the
    /// parameters). Where gradient synchronisation overlaps ([`Options::overlap_grad_sync`],
    /// not on host-staged devices) they are prefetched beside compute, which runs
    /// `overlap_slowdown` times slower meanwhile: stages 1 and 2 gather the updated shards
    /// beside the next step's first micro-batch forward (`first_fwd`; Megatron-LM's
    /// `--overlap-param-gather`), stage 3 before the forward and the backward pass, each beside
    /// that pass. Without overlap they are exposed whole.
    fn zero_gather_exposed(&self, gather: f64, fwd: f64, bwd: f64, first_fwd: f64) -> f64 {
        if gather == 0.0 {
            return 0.0;
        }
        let overlaps = self.opts.overlap_grad_sync && !self.cluster.device.host_staged;
        let passes: &[f64] = match (self.opts.zero >= 3, overlaps) {
            (false, false) => return gather,
            (true, false) => return 2.0 * gather,
            (false, true) => &[first_fwd],
            (true, true) => &[fwd, bwd],
        };
        let slow = (self.opts.overlap_slowdown - 1.0).max(0.0);
        passes.iter().map(|&c| (gather - c).max(0.0) + gather.min(c) * slow).sum()
    }

    /// The backward pass with gradient synchronisation in buckets, as DDP does: gradients
    /// with the same collectives share a bucket, in readiness order, until it holds
    /// `bucket_bytes` (the first bucket `first_bucket_bytes`); latency terms are paid per
    /// bucket. Overlapped, a bucket leaves when its last gradient is ready and the link is
    /// free; what outlasts the backward pass is exposed, and compute beside communication
    /// runs `overlap_slowdown` times slower. Returns (backward, synchronisation, exposed).
    fn backward_timeline(&self, w: &mut Walk, bwd_items: &[(NodeId, f64)], grads: &[GradEvent]) -> (f64, f64, f64) {
        let mut done_at: FxHashMap<NodeId, f64> = FxHashMap::default();
        let mut bwd_total = 0.0;
        for &(n, dt) in bwd_items.iter().rev() {
            bwd_total += dt;
            done_at.insert(n, bwd_total);
        }
        let mut ready: Vec<(f64, usize)> =
            grads.iter().enumerate().map(|(i, e)| (done_at[&self.order[e.pos]], i)).collect();
        ready.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut open: BTreeMap<&[(CommKind, Vec<usize>)], OpenBucket> = BTreeMap::new();
        let mut buckets: Vec<(f64, f64, &str)> = Vec::new(); // (ready, seconds, kind)
        for &(r, i) in &ready {
            let e = &grads[i];
            let b = open.entry(&e.sig).or_insert((0.0, 0.0, 0.0, 0.0));
            b.0 += e.bytes;
            b.1 += e.bandwidth;
            b.2 = b.2.max(e.latency);
            b.3 = r;
            let cap = if buckets.is_empty() {
                self.opts.first_bucket_bytes.min(self.opts.bucket_bytes)
            } else {
                self.opts.bucket_bytes
            };
            if b.0 >= cap {
                let (_, bw, lat, r) = open.remove(e.sig.as_slice()).expect("open bucket");
                buckets.push((r, bw + lat, e.sig[0].0.name()));
                *w.comm_kind.entry(e.sig[0].0.name()).or_insert(0.0) += lat;
            }
        }
        for (sig, (_, bw, lat, r)) in open {
            buckets.push((r, bw + lat, sig[0].0.name()));
            *w.comm_kind.entry(sig[0].0.name()).or_insert(0.0) += lat;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let grad_sync = buckets.iter().map(|b| b.1).sum::<f64>();
        let mut exposed = grad_sync;
        // Host-staged collectives (the runtime's simulated devices, its MPI transport) run on
        // the device's own thread between its kernels, as the training program prices them:
        // nothing of them overlaps the backward pass.
        let overlaps = self.opts.overlap_grad_sync && !self.cluster.device.host_staged;
        if overlaps && !buckets.is_empty() {
            let mut comm_free: f64 = 0.0;
            for &(r, dt, _) in &buckets {
                comm_free = comm_free.max(r) + dt;
            }
            let tail = (comm_free - bwd_total).max(0.0);
            let overlapped = (grad_sync - tail).max(0.0);
            exposed = tail + overlapped * (self.opts.overlap_slowdown - 1.0).max(0.0);
            debug_assert!(tail <= grad_sync * (1.0 + 1e-9) + 1e-15, "tail {tail} > total {grad_sync}");
            exposed = exposed.min(grad_sync);
        }
        (bwd_total, grad_sync, exposed)
    }

    /// The exposed part of an op's activation collectives (`fwd`, `bwd` seconds) under
    /// [`Options::tp_comm_overlap`]: each pass's collectives hide behind the GEMM beside them
    /// (the op itself when it is a contraction, else the contraction producing one of its
    /// inputs, `time_of` giving that op's times), the GEMM `overlap_slowdown` slower
    /// meanwhile. Unchanged without the option.
    fn tp_overlapped(&self, n: NodeId, fwd: f64, bwd: f64, time_of: &dyn Fn(NodeId) -> OpTime) -> (f64, f64) {
        if !self.opts.tp_comm_overlap || fwd + bwd <= 0.0 {
            return (fwd, bwd);
        }
        let gemm = |m: NodeId| matches!(self.g.node(m).op, Op::MatMul(_) | Op::Gemm(_));
        let beside =
            if gemm(n) { Some(n) } else { self.g.node(n).inputs().iter().flatten().map(|v| v.node).find(|&m| gemm(m)) };
        let Some(t) = beside.map(time_of) else { return (fwd, bwd) };
        let slow = (self.opts.overlap_slowdown - 1.0).max(0.0);
        let exposed = |c: f64, budget: f64| (c - budget).max(0.0) + c.min(budget) * slow;
        (exposed(fwd, t.fwd), exposed(bwd, t.bwd))
    }

    /// Host→device input time (before overlap) and bytes per step.
    fn input_time(&self, storage: &BTreeMap<Value, Sharding>, mesh: &Mesh) -> (f64, f64) {
        let host = &self.cluster.host;
        let mut full = 0.0;
        let mut local = 0.0;
        for v in self.g.input_values() {
            if !matches!(self.g.node(v.node).op, Op::Input { default: None }) {
                continue;
            }
            let b = self.g.tensor_type(v).and_then(TensorType::size_bytes).unwrap_or(0) as f64;
            full += b;
            let sh = storage.get(&v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; mesh.axes.len()]);
            local += b / split_factor(&sh, mesh);
        }
        if full == 0.0 {
            return (0.0, 0.0);
        }
        let p = mesh.devices();
        let t = match self.opts.input_path {
            // Every device pulls its own slice; devices under one host link share it.
            InputPath::Scatter => host.latency + local * host.shared_by.min(p) as f64 / host.bandwidth,
            // The batch lands on device 0, which then sends every other device its slice over
            // its own device link, one after another. (At the links' bandwidth for large
            // transfers, as the search's extraction prices a byte of input.)
            InputPath::Staged => {
                let (alpha, beta) = alpha_beta(self.cluster, ir::shard::LinkLevel::Intra, p, p, f64::INFINITY);
                host.latency + full / host.bandwidth + (p as f64 - 1.0) * (alpha + local / beta)
            }
        };
        (t, local * p as f64)
    }

    /// `n→gpus, s0→nodes` or `replicated`.
    pub fn describe_strategy(&self, n: NodeId, s: &[Option<usize>]) -> String {
        let sp = &self.spaces[&n];
        let parts: Vec<String> = s
            .iter()
            .enumerate()
            .filter_map(|(a, x)| x.map(|i| format!("{}→{}", sp.dims[i].name, self.mesh.axes[a].name)))
            .collect();
        if parts.is_empty() { "replicated".into() } else { parts.join(", ") }
    }
}

fn overflow_reason(m: &Memory, capacity: f64) -> String {
    let gib = |x: f64| x / (1024.0 * 1024.0 * 1024.0);
    let parts = [
        ("weights", m.weights),
        ("gradients", m.gradients),
        ("optimizer state", m.optimizer),
        ("activations", m.activations),
        ("workspace", m.workspace),
    ];
    let (big, val) = parts.iter().copied().fold(("", 0.0), |acc, x| if x.1 > acc.1 { x } else { acc });
    format!(
        "needs {:.2} GiB per device, {:.2} GiB usable; the largest part is {big} ({:.2} GiB)",
        gib(m.total()),
        gib(capacity),
        gib(val)
    )
}

/// Marks iteration dims that carry the batch.
fn mark_batch(g: &Graph, n: NodeId, sp: &mut IterSpace, batch: &BatchDims) {
    for (slot, map) in sp.outputs.iter().enumerate() {
        let Some(flags) = batch.get(&Value::new(n, slot as u16)) else { continue };
        for (t, m) in map.iter().enumerate() {
            if let Some(i) = m
                && flags.get(t).copied().unwrap_or(false)
                && sp.dims[*i].kind != DimKind::Fixed
            {
                sp.dims[*i].role = ir::shard::DimRole::Batch;
            }
        }
    }
    let _ = (g, OpClass::Other);
}
