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
use ir::shard::{AxisShard, DimKind, IterSpace, Mesh, OpStrategy, Sharding, iter_space, strategy_shardings};
use ir::{Graph, NodeId, Op, OpClass, TensorType, Value};

use super::batch::{BatchDims, batch_dims};
use super::cluster::Cluster;
use super::collective::{CommKind, Step, all_reduce, alpha_beta, p2p, reshard};

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
    /// Slowdown of backward compute while gradient synchronisation runs beside it (the
    /// collectives take SMs and memory bandwidth; Galvatron measures 1.1–1.3).
    pub overlap_slowdown: f64,
    /// Factor on gradient bytes communicated (e.g. 0.5 for fp16 compression).
    pub grad_compression: f64,
    /// The host input path.
    pub input_path: InputPath,
    /// Load the next batch while this one computes.
    pub preload: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            precision: Precision::Fp32,
            optimizer: Optimizer::Adam,
            overlap_grad_sync: true,
            bucket_bytes: 25e6,
            overlap_slowdown: 1.2,
            grad_compression: 1.0,
            input_path: InputPath::Scatter,
            preload: true,
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
    /// Synchronisation of the gradients of the parameters whose last reader (in backward, the
    /// first to finish) it is, before bucketing, seconds.
    pub grad_sync_s: f64,
    /// Optimizer update of the parameters it reads first, seconds.
    pub update_s: f64,
}

/// When in the step a communication happens.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Forward pass: an input resharded for its consumer, a halo, statistics.
    Forward,
    /// Backward pass: an activation gradient brought back to its producer's layout.
    Backward,
    /// Gradient synchronisation of a parameter before the update.
    Gradient,
}

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
}

/// A resharding: from, to, bytes (as bits).
type ReshardKey = (Sharding, Sharding, u64);

/// A gradient bucket being filled: bytes, bandwidth seconds, latency seconds, ready time.
type OpenBucket = (f64, f64, f64, f64);

/// An op under one strategy: its time and the layouts it needs and makes.
struct OpEval {
    strategy: OpStrategy,
    time: OpTime,
    ins: Vec<Option<Sharding>>,
    outs: Vec<Sharding>,
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
    order: Vec<NodeId>,
    spaces: HashMap<NodeId, IterSpace>,
    costs: HashMap<NodeId, OpCost>,
    batch: BatchDims,
    op_memo: RefCell<FxHashMap<(NodeId, OpStrategy), Rc<OpEval>>>,
    reshard_memo: RefCell<FxHashMap<ReshardKey, Rc<[Step]>>>,
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

fn split_factor(s: &[AxisShard], mesh: &Mesh) -> f64 {
    s.iter()
        .enumerate()
        .filter(|(_, x)| matches!(x, AxisShard::Split(_)))
        .map(|(a, _)| mesh.axes[a].size as f64)
        .product()
}

impl<'a> CostModel<'a> {
    /// Prepares the model: iteration spaces, FLOP counts, the batch analysis.
    pub fn new(g: &'a Graph, cluster: &'a Cluster, mesh: Mesh, opts: Options) -> CostModel<'a> {
        let order = g.op_nodes().unwrap_or_default();
        let batch = batch_dims(g);
        let mut spaces = HashMap::new();
        let mut costs = HashMap::new();
        for &n in &order {
            let mut sp = iter_space(g, n);
            mark_batch(g, n, &mut sp, &batch);
            spaces.insert(n, sp);
            costs.insert(n, node_cost(g, n));
        }
        CostModel {
            g,
            cluster,
            mesh,
            opts,
            order,
            spaces,
            costs,
            batch,
            op_memo: RefCell::default(),
            reshard_memo: RefCell::default(),
        }
    }

    /// Operator nodes in topological order.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }

    /// The iteration space of an op.
    pub fn space(&self, n: NodeId) -> &IterSpace {
        &self.spaces[&n]
    }

    /// The batch analysis.
    pub fn batch(&self) -> &BatchDims {
        &self.batch
    }

    /// Bytes per element factor of float tensors in the training precision.
    fn precision_factor(&self) -> f64 {
        if self.opts.precision == Precision::Fp16 { 0.5 } else { 1.0 }
    }

    /// Bytes of a value in training precision.
    pub fn value_bytes(&self, v: Value) -> f64 {
        let Some(t) = self.g.tensor_type(v) else { return 0.0 };
        let b = t.size_bytes().unwrap_or(0) as f64;
        if t.dtype.is_float() { b * self.precision_factor() } else { b }
    }

    fn peak(&self) -> f64 {
        let p = &self.cluster.device.peak_flops;
        let peak = match self.opts.precision {
            Precision::Fp32 => p.fp32,
            Precision::Tf32 => p.tf32.unwrap_or(p.fp32),
            Precision::Fp16 => p.fp16.unwrap_or(p.fp32),
        };
        peak / self.host_share()
    }

    /// How many devices share one device's compute and memory bandwidth: the mesh's size on
    /// a cluster of devices simulated on one host, else 1.
    fn host_share(&self) -> f64 {
        if self.cluster.device.shared_host { self.mesh.devices().max(1) as f64 } else { 1.0 }
    }

    /// Memory bandwidth of one device, bytes/s.
    fn mem_bandwidth(&self) -> f64 {
        self.cluster.device.mem_bandwidth / self.host_share()
    }

    /// Roofline time of `flops` and `bytes` on one device.
    pub fn roofline(&self, flops: f64, bytes: f64) -> f64 {
        let d = &self.cluster.device;
        (flops / (self.peak() * d.efficiency)).max(bytes / self.mem_bandwidth())
    }

    /// The number of devices sharing an op's work under a strategy.
    pub fn strategy_factor(&self, strategy: &[Option<usize>]) -> f64 {
        strategy.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(a, _)| self.mesh.axes[a].size as f64).product()
    }

    /// Compute, halo and statistics time of `n` under `strategy`.
    pub fn op_time(&self, n: NodeId, strategy: &[Option<usize>]) -> OpTime {
        let node = self.g.node(n);
        if is_view(&node.op) || is_host(&node.op) {
            return OpTime::default();
        }
        let c = &self.costs[&n];
        let sp = &self.spaces[&n];
        let f = self.strategy_factor(strategy);
        let pf = self.precision_factor();
        let (ins, _) = strategy_shardings(sp, strategy);
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
        let bytes = act_bytes + param_local;
        let launch = self.cluster.device.launch_overhead * c.launches.max(1.0);
        let fwd = self.roofline(c.fwd_flops / f, bytes) + launch;
        let bwd_flops = (c.bwd_data_flops + c.bwd_weight_flops) / f;
        let bwd = if bwd_flops > 0.0 { self.roofline(bwd_flops, 2.0 * bytes) + 2.0 * launch } else { 0.0 };
        let mut halo = 0.0;
        let mut stats = 0.0;
        for (a, s) in strategy.iter().enumerate() {
            let Some(i) = s else { continue };
            let p = self.mesh.axes[a].size;
            let (alpha, beta) = alpha_beta(self.cluster, self.mesh.axes[a].level, p);
            match &sp.dims[*i].kind {
                DimKind::Spatial { halo: (before, after), .. } => {
                    // The main input's slab along the split dim, per element of that dim.
                    if let (Some(x), Some(Some(map))) = (node.input(0), sp.inputs.first())
                        && let Some(t) = map.iter().position(|m| *m == Some(*i))
                    {
                        let dims = self.g.tensor_type(x).and_then(TensorType::static_dims).unwrap_or_default();
                        let extent = dims.get(t).copied().unwrap_or(1).max(1) as f64;
                        let local = self.value_bytes(x) / f;
                        let slab = local / (extent / p as f64);
                        let edge = (*before).max(*after) as f64 * slab;
                        if edge > 0.0 {
                            // Forward halo of the input, backward halo of its gradient.
                            halo += 2.0 * p2p(edge, alpha, beta);
                        }
                    }
                }
                DimKind::Statistic { values } => {
                    let out = self.value_bytes(Value::new(n, 0)) / f;
                    let extent = sp.dims[*i].size.max(1) as f64 / p as f64;
                    let n_stats = out / extent * *values as f64;
                    stats += 2.0 * all_reduce(n_stats, p, alpha, beta);
                }
                _ => {}
            }
        }
        OpTime { fwd, bwd, halo, stats }
    }

    fn op_eval(&self, n: NodeId, s: &[Option<usize>]) -> Rc<OpEval> {
        if let Some(e) = self.op_memo.borrow().get(&(n, s.to_vec())) {
            return e.clone();
        }
        let (ins, outs) = strategy_shardings(&self.spaces[&n], s);
        let e = Rc::new(OpEval { strategy: s.to_vec(), time: self.op_time(n, s), ins, outs });
        self.op_memo.borrow_mut().insert((n, s.to_vec()), e.clone());
        e
    }

    fn reshard_memo(&self, from: &Sharding, to: &Sharding, bytes: f64) -> Rc<[Step]> {
        let key = (from.clone(), to.clone(), bytes.to_bits());
        if let Some(st) = self.reshard_memo.borrow().get(&key) {
            return st.clone();
        }
        let st: Rc<[Step]> = reshard(from, to, bytes, &self.mesh, self.cluster).into();
        self.reshard_memo.borrow_mut().insert(key, st.clone());
        st
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
        let g = self.g;
        let mesh = &self.mesh;
        let axes = mesh.axes.len();
        let pf = self.precision_factor();
        let mut comm_kind: BTreeMap<&'static str, f64> = BTreeMap::new();
        let add_steps = |steps: &[Step], comm_kind: &mut BTreeMap<&'static str, f64>| -> f64 {
            let mut t = 0.0;
            for s in steps {
                *comm_kind.entry(s.kind.name()).or_insert(0.0) += s.time;
                t += s.time;
            }
            t
        };
        let replicated: Sharding = vec![AxisShard::Replicate; axes];

        // Shardings: op outputs from their strategies; parameters, constants and graph inputs
        // as their first consumer needs them.
        let evals: Vec<Rc<OpEval>> = self.order.iter().map(|&n| self.op_eval(n, &self.strategy_of(asg, n))).collect();
        let mut out_sh: FxHashMap<Value, &Sharding> = FxHashMap::default();
        out_sh.reserve(self.order.len());
        for (&n, e) in self.order.iter().zip(&evals) {
            for (slot, sh) in e.outs.iter().enumerate() {
                out_sh.insert(Value::new(n, slot as u16), sh);
            }
        }
        let mut storage: BTreeMap<Value, Sharding> = BTreeMap::new();
        for (&n, e) in self.order.iter().zip(&evals) {
            for (j, v) in g.node(n).inputs().iter().enumerate() {
                if let Some(v) = v
                    && !out_sh.contains_key(v)
                    && !storage.contains_key(v)
                {
                    storage.insert(*v, e.ins.get(j).cloned().flatten().unwrap_or_else(|| replicated.clone()));
                }
            }
        }
        let have =
            |v: Value| -> &Sharding { out_sh.get(&v).copied().or_else(|| storage.get(&v)).unwrap_or(&replicated) };

        let needs_grad = |v: Value| -> bool {
            let node = g.node(v.node);
            let float = g.tensor_type(v).is_some_and(|t| t.dtype.is_float());
            float
                && !matches!(node.op, Op::Input { default: None } | Op::OuterRef | Op::Constant(_))
                && !is_host(&node.op)
                || ir::cost::is_param(g, v)
        };

        let mut rows = Vec::with_capacity(if detail { self.order.len() } else { 0 });
        let (mut fwd_total, mut compute_total) = (0.0, 0.0);
        let mut bwd_items: Vec<(NodeId, f64)> = Vec::with_capacity(self.order.len());
        let mut comm_total = 0.0;
        let mut workspace: f64 = 0.0;
        let mut activations = 0.0;
        // Gradient sharding of each parameter, accumulated over its consumers.
        let mut param_grad: BTreeMap<Value, Sharding> = BTreeMap::new();
        let mut param_first_use: FxHashMap<Value, usize> = FxHashMap::default();
        let mut materialized: FxHashSet<(Value, &Sharding)> = FxHashSet::default();
        let mut grads_sent: FxHashSet<(Value, Sharding)> = FxHashSet::default();
        let mut events: Vec<CommEvent> = Vec::new();
        let mut bwd_events: Vec<CommEvent> = Vec::new();
        for (pos, (&n, e)) in self.order.iter().zip(&evals).enumerate() {
            let node = g.node(n);
            let s = &e.strategy;
            let t = e.time;
            let mut fwd_comm = 0.0;
            let mut bwd_comm = 0.0;
            for (j, v) in node.inputs().iter().enumerate() {
                let Some(v) = v else { continue };
                let Some(Some(need)) = e.ins.get(j) else { continue };
                let src = have(*v);
                let produced = out_sh.contains_key(v);
                if !produced && !g.tensor_type(*v).is_some_and(|t| t.dtype.is_float()) {
                    continue; // shape literals, indices from the host: free
                }
                let bytes = self.value_bytes(*v);
                // A tensor is materialized in a sharding once, however many ops read it there.
                if src != need && materialized.insert((*v, need)) {
                    let steps = self.reshard_memo(src, need, bytes);
                    fwd_comm += add_steps(&steps, &mut comm_kind);
                    for st in steps.iter() {
                        workspace = workspace.max(st.bytes);
                    }
                    if detail && !steps.is_empty() {
                        events.push(CommEvent {
                            phase: Phase::Forward,
                            value: *v,
                            op: Some(n),
                            from: src.clone(),
                            to: need.clone(),
                            steps: steps.to_vec(),
                        });
                    }
                }
                if !needs_grad(*v) {
                    continue;
                }
                // The gradient comes back partial along axes this op splits while the input
                // is replicated on them.
                let grad: Sharding =
                    (0..axes)
                        .map(|a| {
                            if need[a] == AxisShard::Replicate && s[a].is_some() { AxisShard::Partial } else { need[a] }
                        })
                        .collect();
                if ir::cost::is_param(g, *v) {
                    let e = param_grad.entry(*v).or_insert_with(|| src.clone());
                    for a in 0..axes {
                        if grad[a] == AxisShard::Partial {
                            e[a] = AxisShard::Partial;
                        }
                    }
                    // Its gradient is complete when its first reader's backward finishes.
                    param_first_use.entry(*v).or_insert(pos);
                } else if !grads_sent.contains(&(*v, grad.clone())) {
                    // Gradients of one sharding from several readers are summed locally first.
                    let target: Sharding =
                        src.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
                    let steps = self.reshard_memo(&grad, &target, bytes);
                    bwd_comm += add_steps(&steps, &mut comm_kind);
                    if detail && !steps.is_empty() {
                        bwd_events.push(CommEvent {
                            phase: Phase::Backward,
                            value: *v,
                            op: Some(n),
                            from: grad.clone(),
                            to: target,
                            steps: steps.to_vec(),
                        });
                    }
                    grads_sent.insert((*v, grad));
                }
            }
            *comm_kind.entry(CommKind::Halo.name()).or_insert(0.0) += t.halo;
            if t.stats > 0.0 {
                *comm_kind.entry(CommKind::AllReduce.name()).or_insert(0.0) += t.stats;
            }
            for (kind, time) in [(CommKind::Halo, t.halo), (CommKind::AllReduce, t.stats)] {
                if detail && time > 0.0 {
                    let out = Value::new(n, 0);
                    let sh = have(out).clone();
                    let axes_used: Vec<usize> = (0..axes).filter(|&a| s[a].is_some()).collect();
                    events.push(CommEvent {
                        phase: Phase::Forward,
                        value: out,
                        op: Some(n),
                        from: sh.clone(),
                        to: sh,
                        steps: vec![Step { kind, axes: axes_used, bytes: 0.0, time }],
                    });
                }
            }
            fwd_total += t.fwd + fwd_comm + (t.halo + t.stats) / 2.0;
            compute_total += t.fwd + t.bwd;
            let op_comm = fwd_comm + bwd_comm + t.halo + t.stats;
            comm_total += op_comm;
            bwd_items.push((n, t.bwd + bwd_comm + (t.halo + t.stats) / 2.0));
            // Activations kept for backward: outputs of ops that compute something.
            let mut kept = 0.0;
            if !is_view(&node.op) && !is_host(&node.op) {
                for slot in 0..node.num_outputs() {
                    let v = Value::new(n, slot as u16);
                    if g.value_name(v).is_empty() {
                        continue;
                    }
                    let b = self.value_bytes(v) / split_factor(have(v), mesh);
                    kept += b;
                    workspace = workspace.max(b);
                }
            }
            activations += kept;
            if detail {
                rows.push(OpRow {
                    name: node
                        .label
                        .clone()
                        .unwrap_or_else(|| node.outputs().first().map(|o| o.name.clone()).unwrap_or_default()),
                    op: node.op.op_type().to_string(),
                    strategy: self.describe_strategy(n, s),
                    compute_s: t.fwd + t.bwd,
                    communication_s: op_comm,
                    memory_bytes: kept,
                    forward_s: t.fwd + fwd_comm + (t.halo + t.stats) / 2.0,
                    backward_s: t.bwd + bwd_comm + (t.halo + t.stats) / 2.0,
                    param_memory_bytes: 0.0,
                    grad_sync_s: 0.0,
                    update_s: 0.0,
                });
            }
        }

        // Gradient synchronisation of parameters. Gradients are synchronised in buckets (as
        // DDP does): gradients with the same collectives share one bucket until it holds
        // `bucket_bytes`, so the latency terms are paid per bucket, the bandwidth terms per
        // byte.
        struct GradEvent {
            pos: usize,
            bytes: f64,
            bandwidth: f64,
            latency: f64,
            sig: Vec<(CommKind, Vec<usize>)>,
        }
        let mut grad_events: Vec<GradEvent> = Vec::new();
        let mut sync_events: Vec<CommEvent> = Vec::new();
        let mut weights = 0.0;
        let mut param_elems_local = 0.0;
        let mut n_params = 0usize;
        for (v, grad) in &param_grad {
            let st = storage.get(v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; axes]);
            let target: Sharding =
                st.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
            let bytes = self.value_bytes(*v) * self.opts.grad_compression;
            let steps = reshard(grad, &target, bytes, mesh, self.cluster);
            if steps.is_empty() {
                continue;
            }
            let t: f64 = steps.iter().map(|s| s.time).sum();
            let latency: f64 =
                reshard(grad, &target, f64::MIN_POSITIVE, mesh, self.cluster).iter().map(|s| s.time).sum();
            for s in &steps {
                *comm_kind.entry(s.kind.name()).or_insert(0.0) += s.time * (1.0 - latency / t.max(1e-300));
            }
            if detail {
                rows[param_first_use[v]].grad_sync_s += t;
            }
            grad_events.push(GradEvent {
                pos: param_first_use[v],
                bytes,
                bandwidth: t - latency,
                latency,
                sig: steps.iter().map(|s| (s.kind, s.axes.clone())).collect(),
            });
            if detail {
                sync_events.push(CommEvent {
                    phase: Phase::Gradient,
                    value: *v,
                    op: None,
                    from: grad.clone(),
                    to: target,
                    steps,
                });
            }
        }
        let opt_bytes_per_elem = match self.opts.optimizer {
            Optimizer::Sgd => 4.0,
            Optimizer::Adam => 8.0,
        } + if self.opts.precision == Precision::Fp16 { 4.0 } else { 0.0 };
        let update_bytes_per_elem = match self.opts.optimizer {
            Optimizer::Sgd => 20.0,
            Optimizer::Adam => 28.0,
        } + if self.opts.precision == Precision::Fp16 { 8.0 } else { 0.0 };
        for (v, st) in &storage {
            if ir::cost::is_param(g, *v) {
                let local = self.value_bytes(*v) / split_factor(st, mesh);
                weights += local;
                param_elems_local += local / (4.0 * pf);
                n_params += 1;
                if detail && let Some(&first) = param_first_use.get(v) {
                    let elems = local / (4.0 * pf);
                    rows[first].param_memory_bytes += 2.0 * local + elems * opt_bytes_per_elem;
                    rows[first].update_s += elems * update_bytes_per_elem / self.mem_bandwidth();
                }
            }
        }

        // Backward timeline with bucketed, overlapped gradient synchronisation.
        let bwd_total;
        bwd_events.reverse();
        events.extend(bwd_events);
        sync_events.sort_by_key(|e| e.value);
        events.extend(sync_events);
        let grad_sync;
        let mut exposed;
        {
            // Completion time (from the start of backward) of each op's backward.
            let mut done_at: HashMap<NodeId, f64> = HashMap::new();
            let mut t = 0.0;
            for &(n, dt) in bwd_items.iter().rev() {
                t += dt;
                done_at.insert(n, t);
            }
            bwd_total = t;
            // Gradients are ready when the earliest consumer's backward finishes; buckets
            // fill in readiness order and leave when full (or at the end).
            let mut ready: Vec<(f64, usize)> =
                grad_events.iter().enumerate().map(|(i, e)| (done_at[&self.order[e.pos]], i)).collect();
            ready.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let mut open: BTreeMap<&[(CommKind, Vec<usize>)], OpenBucket> = BTreeMap::new();
            let mut buckets: Vec<(f64, f64, &str)> = Vec::new(); // (ready, seconds, kind)
            for &(r, i) in &ready {
                let e = &grad_events[i];
                let b = open.entry(&e.sig).or_insert((0.0, 0.0, 0.0, 0.0));
                b.0 += e.bytes;
                b.1 += e.bandwidth;
                b.2 = b.2.max(e.latency);
                b.3 = r;
                if b.0 >= self.opts.bucket_bytes {
                    let (_, bw, lat, r) = open.remove(e.sig.as_slice()).expect("open bucket");
                    buckets.push((r, bw + lat, e.sig[0].0.name()));
                    *comm_kind.entry(e.sig[0].0.name()).or_insert(0.0) += lat;
                }
            }
            for (sig, (_, bw, lat, r)) in open {
                buckets.push((r, bw + lat, sig[0].0.name()));
                *comm_kind.entry(sig[0].0.name()).or_insert(0.0) += lat;
            }
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            grad_sync = buckets.iter().map(|b| b.1).sum::<f64>();
            exposed = grad_sync;
            if self.opts.overlap_grad_sync && !buckets.is_empty() {
                let mut comm_free: f64 = 0.0;
                for &(r, dt, _) in &buckets {
                    // A bucket leaves when its last gradient is ready and the link is free.
                    comm_free = comm_free.max(r) + dt;
                }
                // Compute beside communication runs slower; what does not fit behind the
                // backward pass is exposed.
                let overlapped = grad_sync.min(bwd_total);
                exposed = (comm_free - bwd_total).max(0.0) + overlapped * (self.opts.overlap_slowdown - 1.0);
            }
        }
        comm_total += grad_sync;

        // Optimizer update: memory-bound traffic over the local parameters.
        let per_param_traffic = match self.opts.optimizer {
            Optimizer::Sgd => 20.0,
            Optimizer::Adam => 28.0,
        } + if self.opts.precision == Precision::Fp16 { 8.0 } else { 0.0 };
        let update = param_elems_local * per_param_traffic / self.mem_bandwidth()
            + self.cluster.device.launch_overhead * (n_params as f64 / 10.0).ceil();

        // Host→device input.
        let (input_transfer, input_bytes) = self.input_time(&storage, mesh);
        let before_input = fwd_total + bwd_total + exposed + update;
        let input_exposed = if self.opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };

        let gradients = weights;
        let optimizer = param_elems_local
            * match self.opts.optimizer {
                Optimizer::Sgd => 4.0,
                Optimizer::Adam => 8.0,
            }
            + if self.opts.precision == Precision::Fp16 { param_elems_local * 4.0 } else { 0.0 };
        let memory = Memory { weights, gradients, optimizer, activations, workspace };
        let capacity = self.cluster.device.mem_capacity * self.cluster.device.mem_usable;
        let total = memory.total();
        let feasible = total <= capacity;
        let infeasible_reason = (!feasible).then(|| overflow_reason(&memory, capacity));
        Breakdown {
            step_time_s: before_input + input_exposed,
            compute_s: compute_total,
            forward_s: fwd_total,
            backward_s: bwd_total,
            update_s: update,
            communication_s: comm_total,
            communication_by_kind: comm_kind
                .into_iter()
                .filter(|(_, v)| *v > 0.0)
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            gradient_sync_s: grad_sync,
            exposed_gradient_sync_s: exposed,
            bubble_s: 0.0,
            input_s: input_exposed,
            input_transfer_s: input_transfer,
            input_bytes,
            memory_per_device_bytes: vec![total as u64; mesh.devices()],
            memory,
            memory_capacity_bytes: capacity as u64,
            feasible,
            infeasible_reason,
            ops: rows,
            events,
        }
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
            // its own device link, one after another.
            InputPath::Staged => {
                let (alpha, beta) = alpha_beta(self.cluster, ir::shard::LinkLevel::Intra, p);
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
