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

use serde::{Deserialize, Serialize};

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

mod compute;
mod dispatch;
mod edges;
mod evaluate;
mod ring;
mod sync;

/// Arithmetic precision of training.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// SGD with momentum: one fp32 state per parameter.
    Sgd,
    /// Adam: two fp32 states per parameter.
    Adam,
}

/// How input batches reach the devices (ScaleDNN).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputPath {
    /// Each device's slice goes straight from host memory over its own link.
    Scatter,
    /// The whole batch goes to device 0, which scatters it over device links.
    Staged,
}

/// Modelling options (a plan document's `options`: a field it leaves out has its default).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
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
    /// In mixed precision, an fp32 copy of each gradient held beside the optimizer state and
    /// sharded with it (DeepSpeed's mixed-precision optimizers: its estimators count
    /// `4Ψ + 16Ψ/N` for ZeRO-1/2 and `18Ψ/N` for ZeRO-3); under ZeRO-2 and 3 the gradients are
    /// reduced straight into it and no half-precision shard is kept.
    pub fp32_grads: bool,
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
            fp32_grads: false,
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
    /// Bytes per device of those parameters' weights (the rest of `param_memory_bytes` is
    /// their gradients and optimizer state).
    pub weight_memory_bytes: f64,
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
    /// Per graph output, the dims its delivered layout keeps cuts of
    /// ([`ir::reshard::output_cuts`]).
    cuts: Arc<BatchDims>,
    /// A training graph's op phases ([`ir::reshard::step_phases`]): the graph is priced as
    /// it runs, each op once in its phase, with no backward pass or update added.
    phases: Arc<Option<HashMap<NodeId, Phase>>>,
    /// A forward graph's stash under the recomputation chosen ([`super::stash`]); `None` for
    /// a training graph or a model that cannot be differentiated (then every computed value
    /// counts as kept).
    stash: Option<Stash>,
    /// The values gradients flow into ([`ir::cost::grad_flow`]).
    grads: Arc<std::collections::HashSet<Value>>,
    /// A training graph's element-wise fusion groups, by member (priced where the device
    /// runs them fused: [`super::cluster::Device::fused_elementwise`]).
    fused: Arc<HashMap<NodeId, Fused>>,
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
pub fn optimizer_bytes_per_elem(o: &Options) -> f64 {
    (match o.optimizer {
        Optimizer::Sgd => 4.0,
        Optimizer::Adam => 8.0,
    }) + if o.precision == Precision::Fp16 { 4.0 } else { 0.0 }
}

/// Whether `o` holds an fp32 copy of each gradient ([`Options::fp32_grads`], mixed precision).
fn grad_copy(o: &Options) -> bool {
    o.fp32_grads && o.precision == Precision::Fp16
}

/// The half-precision gradient bytes per byte of parameter under `o` at ZeRO stage ≥ 2: none
/// when the gradients are reduced straight into their fp32 copy's shard.
fn half_grads_kept(o: &Options) -> f64 {
    if grad_copy(o) && o.zero >= 2 { 0.0 } else { 1.0 }
}

/// Bytes per trained parameter element of the gradient's fp32 copy
/// ([`Options::fp32_grads`]), sharded like the optimizer state.
fn grad_copy_bytes_per_elem(o: &Options) -> f64 {
    if grad_copy(o) { 4.0 } else { 0.0 }
}

/// Bytes per trained parameter element sharded like the optimizer state (ZeRO-1): the
/// optimizer's and the gradient's fp32 copy.
pub fn sharded_bytes_per_elem(o: &Options) -> f64 {
    optimizer_bytes_per_elem(o) + grad_copy_bytes_per_elem(o)
}

/// Memory traffic of the update per parameter element under `o`: the parameter, its gradient
/// and the optimizer state read and written (the fp32 master weights in mixed precision; the
/// gradient's fp32 copy written by its reduction and read instead of the half one).
pub fn update_bytes_per_elem(o: &Options) -> f64 {
    (match o.optimizer {
        Optimizer::Sgd => 20.0,
        Optimizer::Adam => 28.0,
    }) + if o.precision == Precision::Fp16 { 8.0 } else { 0.0 }
        + if grad_copy(o) { 6.0 } else { 0.0 }
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
    (all * w / at(3) + trained * (w * half_grads_kept(o) / at(2) + sharded_bytes_per_elem(o) / at(1))) / ways.max(1.0)
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
    cuts: Arc<BatchDims>,
    phases: Arc<Option<HashMap<NodeId, Phase>>>,
    grads: Arc<std::collections::HashSet<Value>>,
    saved: Arc<Option<std::collections::HashSet<Value>>>,
    fused: Arc<HashMap<NodeId, Fused>>,
}

/// A member of an element-wise fusion group of a training graph ([`ir::fusion::groups`]),
/// for executors that run them as one kernel.
#[derive(Clone, Copy, Debug)]
pub(super) struct Fused {
    /// The group's last member: its launch stays.
    pub root: bool,
    /// The kernel writes the member's value (something outside the group reads it).
    pub written: bool,
    /// Reads of the value by other members, which the kernel takes from registers.
    pub reads: usize,
}

/// The fusion groups of a training graph (`phases`: its ops' phases; a group stays in one),
/// by member.
fn fusion_members(g: &Graph, order: &[NodeId], phases: &HashMap<NodeId, Phase>) -> HashMap<NodeId, Fused> {
    let outputs: std::collections::HashSet<Value> = g.outputs().iter().map(|o| o.value).collect();
    let rules = ir::fusion::Rules {
        fusible: &|n| ir::fusion::elementwise(g, n),
        held: &|v| outputs.contains(v),
        together: &|a, b| phases.get(&a) == phases.get(&b),
    };
    let mut out = HashMap::new();
    for grp in ir::fusion::groups(g, order, &rules) {
        for (j, &n) in grp.nodes.iter().enumerate() {
            let reads = grp.sources.iter().flatten().filter(|s| **s == Some(ir::fusion::Source::Member(j))).count();
            let fused = Fused { root: j + 1 == grp.nodes.len(), written: grp.outputs.contains(&j), reads };
            out.insert(n, fused);
        }
    }
    out
}

impl Analysis {
    /// The analysis of `g` (shapes inferred).
    pub fn of(g: &Graph) -> Analysis {
        let order = g.op_nodes().unwrap_or_default();
        let batch = batch_dims(g);
        let cuts = ir::reshard::output_cuts(g, &batch);
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
        let fused = phases.as_ref().map(|p| fusion_members(g, &order, p)).unwrap_or_default();
        Analysis {
            order: Arc::new(order),
            spaces: Arc::new(spaces),
            costs: Arc::new(costs),
            batch: Arc::new(batch),
            cuts: Arc::new(cuts),
            phases: Arc::new(phases),
            grads: Arc::new(grads),
            saved: Arc::new(saved),
            fused: Arc::new(fused),
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
            cuts: a.cuts.clone(),
            phases: a.phases.clone(),
            stash,
            grads: a.grads.clone(),
            fused: a.fused.clone(),
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

    /// Per graph output, the dims its delivered layout keeps cuts of
    /// ([`ir::reshard::output_cuts`]).
    pub fn output_cuts(&self) -> &BatchDims {
        &self.cuts
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

    /// Peak FLOP/s of one device's matrix units in the training precision.
    fn peak(&self) -> f64 {
        self.cluster.device.peak_flops.at(self.opts.precision) / self.host_share()
    }

    /// Peak FLOP/s of op `n`'s kernel: the matrix units' in the training precision for an op
    /// made of matrix products, the float32 peak of the regular cores for the rest
    /// ([`ir::ops::OpRules::matrix_units`]).
    pub(super) fn op_peak(&self, n: NodeId) -> f64 {
        if self.g.node(n).op.rules().matrix_units() {
            self.peak()
        } else {
            self.cluster.device.peak_flops.fp32 / self.host_share()
        }
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
