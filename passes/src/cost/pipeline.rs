//! Pipeline parallelism: the ops in topological order are cut into S contiguous stages, each on
//! its own group of devices (data parallel inside the stage); the batch is split into M
//! micro-batches that flow through the stages.
//!
//! Step time: with per-micro-batch stage times `t_s = f_s + b_s` (compute, plus the
//! point-to-point send of activations to the next stage and of gradients back),
//! GPipe runs all forwards then all backwards: `(M + S − 1)(max f + max b)`;
//! 1F1B alternates in steady state: `(M + S − 1) · max(f + b)`. The bubble is the
//! `(S − 1)/(M + S − 1)` part of it. Then each stage synchronises its gradients inside its group
//! and updates. Memory: GPipe keeps the activations of all M micro-batches; 1F1B keeps
//! `min(M, S − s)` in stage s.
//!
//! The cut minimises the slowest stage by dynamic programming over cut positions, with stages
//! that do not fit in memory excluded (BaPipe's balanced partition).

use serde::Serialize;

use ir::shard::LinkLevel;
use ir::{Graph, NodeId, Op, TensorType, Value};

use super::cluster::Cluster;
use super::collective::{self, all_reduce_over, total};
use super::model::{Breakdown, CostModel, Memory, Optimizer, Options, Precision};
use super::strategy::{Named, Schedule, assign};
use crate::rebatch::{RebatchSpec, rebatch};

impl Schedule {
    /// The schedule's name.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }

    /// Micro-batches whose activations stage `s` (0-based) of `stages` keeps at once.
    pub fn in_flight(self, s: usize, stages: usize, micro: usize) -> usize {
        match self {
            Schedule::GPipe => micro,
            Schedule::OneFOneB => micro.min(stages - s),
        }
    }

    /// Step time of the pipelined part from per-stage forward and backward times per
    /// micro-batch.
    pub fn makespan(self, fwd: &[f64], bwd: &[f64], micro: usize) -> f64 {
        let s = fwd.len();
        let slots = (micro + s - 1) as f64;
        match self {
            Schedule::GPipe => {
                slots * (fwd.iter().copied().fold(0.0, f64::max) + bwd.iter().copied().fold(0.0, f64::max))
            }
            Schedule::OneFOneB => slots * fwd.iter().zip(bwd).map(|(f, b)| f + b).fold(0.0, f64::max),
        }
    }
}

/// One stage of a priced pipeline.
#[derive(Clone, Debug, Serialize)]
pub struct StageReport {
    /// Devices of the stage.
    pub devices: Vec<usize>,
    /// Number of ops.
    pub op_count: usize,
    /// First and last op (labels or output names).
    pub first_op: String,
    /// Last op.
    pub last_op: String,
    /// Forward + backward time per micro-batch (with boundary sends), seconds.
    pub time_s: f64,
    /// Forward per micro-batch, seconds.
    pub forward_s: f64,
    /// Backward per micro-batch, seconds.
    pub backward_s: f64,
    /// Bytes sent to the next stage per micro-batch and device.
    pub send_bytes: f64,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
}

/// A priced pipeline.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineReport {
    /// The stages.
    pub stages: Vec<StageReport>,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Schedule.
    pub schedule: Schedule,
    /// The step's price.
    pub breakdown: Breakdown,
    /// Slowest over fastest stage time.
    pub imbalance: f64,
}

/// Per-op quantities the partitioner works with.
struct Unit {
    fwd: f64,
    bwd: f64,
    act_bytes: f64,
    param_bytes: f64,
    param_sync: f64,
    update: f64,
    names: (String, String),
    ops: usize,
}

fn node_name(g: &Graph, n: NodeId) -> String {
    let node = g.node(n);
    node.label.clone().unwrap_or_else(|| node.outputs().first().map(|o| o.name.clone()).unwrap_or_default())
}

/// The batch of a graph: dim 0 of its first real input.
pub fn graph_batch(g: &Graph) -> Option<i64> {
    g.input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .find_map(|v| g.tensor_type(v).and_then(TensorType::static_dims).and_then(|d| d.first().copied()))
}

/// Prices `stages` balanced stages with `micro` micro-batches on `devices` devices.
pub fn price_pipeline(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    stages: usize,
    micro: usize,
    schedule: Schedule,
    opts: &Options,
) -> Result<PipelineReport, String> {
    if stages == 0 || !devices.is_multiple_of(stages) {
        return Err(format!("pipeline: {stages} stages do not divide {devices} devices"));
    }
    let batch = graph_batch(g).ok_or("pipeline: the model has no input with a batch dim")?;
    if micro as i64 > batch || batch % micro as i64 != 0 {
        return Err(format!("pipeline: {micro} micro-batches do not divide the batch of {batch}"));
    }
    let per_stage = devices / stages;
    let stage_mesh = cluster.mesh(per_stage)?;
    // The graph at micro-batch size.
    let mut gm = g.clone();
    let mb = batch / micro as i64;
    if mb != batch {
        rebatch(&mut gm, &RebatchSpec::priced_micro_batch(mb)).map_err(|e| {
            format!(
                "pipeline: cannot re-batch to micro-batches of {mb}: {}",
                e.errors.first().map(|x| x.msg.clone()).unwrap_or_default()
            )
        })?;
    }
    // Every stage runs in the steady state: on devices sharing a host, all of them.
    let cm = CostModel::new(&gm, cluster, stage_mesh.clone(), opts.clone()).with_busy(devices);
    let asg = assign(&cm, &Named::Data).unwrap_or_default();
    let priced = cm.evaluate(&asg);
    let order = cm.order().to_vec();
    if stages > order.len() {
        return Err(format!("pipeline: {stages} stages for {} ops", order.len()));
    }

    // Units: one per op, with parameters charged to their first consumer.
    let mut seen_params = std::collections::HashSet::new();
    let pf = if opts.precision == Precision::Fp16 { 0.5 } else { 1.0 };
    let opt_bytes = match opts.optimizer {
        Optimizer::Sgd => 4.0,
        Optimizer::Adam => 8.0,
    } + if opts.precision == Precision::Fp16 { 4.0 } else { 0.0 };
    let mut units: Vec<Unit> = Vec::with_capacity(order.len());
    for (pos, &n) in order.iter().enumerate() {
        let row = &priced.ops[pos];
        let mut pbytes = 0.0;
        for v in gm.node(n).inputs().iter().flatten() {
            if ir::cost::is_param(&gm, *v) && seen_params.insert(*v) {
                pbytes += cm.value_bytes(*v);
            }
        }
        let sync = total(&all_reduce_over(
            pbytes * opts.grad_compression,
            &(0..stage_mesh.axes.len()).collect::<Vec<_>>(),
            &stage_mesh,
            cluster,
            cm.policy,
            devices,
        ));
        let elems = pbytes / (4.0 * pf);
        units.push(Unit {
            fwd: row.forward_s,
            bwd: row.backward_s,
            act_bytes: row.memory_bytes,
            // weights + gradients + optimizer state, and the gradients' accumulator over
            // several micro-batches
            param_bytes: (if micro > 1 { 3.0 } else { 2.0 }) * pbytes + elems * opt_bytes,
            param_sync: sync,
            update: elems * if opts.optimizer == Optimizer::Adam { 28.0 } else { 20.0 } / cluster.device.mem_bandwidth,
            names: (node_name(&gm, n), node_name(&gm, n)),
            ops: 1,
        });
    }
    // Bytes crossing each cut (values produced before it and used after), per device.
    let pos_of: std::collections::HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut cross = vec![0.0f64; order.len() + 1];
    // What every stage computes for itself is never sent.
    let everywhere = ir::reshard::computed_everywhere_in_training(&gm, &order);
    for (i, &n) in order.iter().enumerate() {
        if everywhere.contains(&n) {
            continue;
        }
        for slot in 0..gm.node(n).num_outputs() {
            let v = Value::new(n, slot as u16);
            let last = gm.users(v).iter().filter_map(|(u, _)| pos_of.get(u)).copied().max();
            if let Some(last) = last
                && last > i
            {
                let b = cm.value_bytes(v) / per_stage as f64;
                for c in cross.iter_mut().take(last + 1).skip(i + 1) {
                    *c += b;
                }
            }
        }
    }
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    let workspace = priced.memory.workspace;
    let partition = partition(&units, &cross, stages, micro, schedule, capacity, workspace, cluster, per_stage)?;

    // Assemble the report.
    let mut fwd = Vec::new();
    let mut bwd = Vec::new();
    let mut reports = Vec::new();
    let mut mem_per_device = Vec::with_capacity(devices);
    let mut worst_mem = Memory::default();
    let mut worst_total = 0.0;
    let mut grad_sync = Vec::new();
    let mut updates = Vec::new();
    let mut p2p_total = 0.0;
    for (s, &(a, b)) in partition.iter().enumerate() {
        let seg = &units[a..b];
        let send = if b < units.len() { cross[b] } else { 0.0 };
        let send_t = collective::send(cluster, boundary_link(cluster, per_stage, s), send, devices);
        p2p_total += 2.0 * send_t * micro as f64;
        let f: f64 = seg.iter().map(|u| u.fwd).sum::<f64>() + send_t;
        let bw: f64 = seg.iter().map(|u| u.bwd).sum::<f64>() + send_t;
        fwd.push(f);
        bwd.push(bw);
        // Kept activations and what the stage received, per micro-batch in flight.
        let received = if a > 0 { cross[a] } else { 0.0 };
        let act: f64 =
            (seg.iter().map(|u| u.act_bytes).sum::<f64>() + received) * schedule.in_flight(s, stages, micro) as f64;
        let params: f64 = seg.iter().map(|u| u.param_bytes).sum();
        // Parameters' weights, gradients and optimizer state are kept together per stage.
        let mem = Memory { weights: params, gradients: 0.0, optimizer: 0.0, activations: act, workspace };
        let total = mem.total();
        if total > worst_total {
            worst_total = total;
            worst_mem = mem;
        }
        for _ in 0..per_stage {
            mem_per_device.push(total as u64);
        }
        grad_sync.push(seg.iter().map(|u| u.param_sync).sum::<f64>());
        updates.push(seg.iter().map(|u| u.update).sum::<f64>());
        reports.push(StageReport {
            devices: (s * per_stage..(s + 1) * per_stage).collect(),
            op_count: seg.iter().map(|u| u.ops).sum(),
            first_op: seg.first().map(|u| u.names.0.clone()).unwrap_or_default(),
            last_op: seg.last().map(|u| u.names.1.clone()).unwrap_or_default(),
            time_s: f + bw,
            forward_s: f,
            backward_s: bw,
            send_bytes: send,
            memory_bytes: total as u64,
        });
    }
    let makespan = schedule.makespan(&fwd, &bwd, micro);
    let slot = makespan / (micro + stages - 1) as f64;
    let bubble = slot * (stages - 1) as f64;
    // Stage 0 finishes its backward last; the others' synchronisation overlaps with it.
    let exposed_sync =
        if opts.overlap_grad_sync { grad_sync[0] } else { grad_sync.iter().copied().fold(0.0, f64::max) };
    let update = updates.iter().copied().fold(0.0, f64::max);
    let step_before_input = makespan + exposed_sync + update;
    let input_transfer = priced.input_transfer_s * micro as f64;
    let input = if opts.preload { (input_transfer - step_before_input).max(0.0) } else { input_transfer };
    let times: Vec<f64> = reports.iter().map(|r| r.time_s).collect();
    let imbalance =
        times.iter().copied().fold(0.0, f64::max) / times.iter().copied().fold(f64::INFINITY, f64::min).max(1e-30);
    let compute: f64 = micro as f64 * fwd.iter().zip(&bwd).map(|(f, b)| f + b).fold(0.0, f64::max);
    let mut by_kind = priced.communication_by_kind.clone();
    by_kind.values_mut().for_each(|v| *v *= micro as f64 / stages as f64);
    *by_kind.entry("p2p".into()).or_insert(0.0) += p2p_total;
    let feasible = worst_total <= capacity;
    let breakdown = Breakdown {
        step_time_s: step_before_input + input,
        compute_s: compute,
        forward_s: micro as f64 * fwd.iter().copied().fold(0.0, f64::max),
        backward_s: micro as f64 * bwd.iter().copied().fold(0.0, f64::max),
        update_s: update,
        communication_s: p2p_total + grad_sync.iter().sum::<f64>(),
        communication_by_kind: by_kind,
        gradient_sync_s: grad_sync.iter().sum(),
        exposed_gradient_sync_s: exposed_sync,
        bubble_s: bubble,
        input_s: input,
        input_transfer_s: input_transfer,
        input_bytes: priced.input_bytes * micro as f64,
        memory_per_device_bytes: mem_per_device,
        memory: worst_mem,
        memory_capacity_bytes: capacity as u64,
        feasible,
        infeasible_reason: (!feasible).then(|| {
            format!(
                "the fullest stage needs {:.2} GiB per device, {:.2} GiB usable",
                worst_total / 1073741824.0,
                capacity / 1073741824.0
            )
        }),
        ops: Vec::new(),
        events: Vec::new(),
        bytes_moved_per_device: Default::default(),
        policy: cm.policy,
    };
    Ok(PipelineReport { stages: reports, micro_batches: micro, schedule, breakdown, imbalance })
}

/// The link level between stage `s` and `s + 1` when each stage has `per_stage` devices.
fn boundary_link(cluster: &Cluster, per_stage: usize, s: usize) -> LinkLevel {
    let dpn = cluster.devices_per_node;
    let last_dev = (s + 1) * per_stage - 1;
    let next_dev = (s + 1) * per_stage;
    if last_dev / dpn == next_dev / dpn { LinkLevel::Intra } else { LinkLevel::Inter }
}

/// Contiguous partition of `units` into `stages` minimising the slowest stage, by dynamic
/// programming over cut positions; stages that do not fit in memory are excluded. Returns
/// `[start, end)` ranges.
#[allow(clippy::too_many_arguments)]
fn partition(
    units: &[Unit],
    cross: &[f64],
    stages: usize,
    micro: usize,
    schedule: Schedule,
    capacity: f64,
    workspace: f64,
    cluster: &Cluster,
    per_stage: usize,
) -> Result<Vec<(usize, usize)>, String> {
    let n = units.len();
    let mut pre_t = vec![0.0; n + 1];
    let mut pre_a = vec![0.0; n + 1];
    let mut pre_p = vec![0.0; n + 1];
    for (i, u) in units.iter().enumerate() {
        pre_t[i + 1] = pre_t[i] + u.fwd + u.bwd;
        pre_a[i + 1] = pre_a[i] + u.act_bytes;
        pre_p[i + 1] = pre_p[i] + u.param_bytes;
    }
    let stage_cost = |s: usize, a: usize, b: usize| -> f64 {
        let send = if b < n { cross[b] } else { 0.0 };
        let t = pre_t[b] - pre_t[a]
            + 2.0 * collective::send(cluster, boundary_link(cluster, per_stage, s), send, per_stage * stages);
        let mem =
            (pre_a[b] - pre_a[a]) * schedule.in_flight(s, stages, micro) as f64 + (pre_p[b] - pre_p[a]) + workspace;
        if mem > capacity { f64::INFINITY } else { t }
    };
    // best[s][j]: the slowest stage of the best split of units[..j] into s + 1 stages.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; stages];
    let mut from = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = stage_cost(0, 0, j);
    }
    for s in 1..stages {
        for j in (s + 1)..=n {
            for i in s..j {
                let c = best[s - 1][i].max(stage_cost(s, i, j));
                if c < best[s][j] {
                    best[s][j] = c;
                    from[s][j] = i;
                }
            }
        }
    }
    if !best[stages - 1][n].is_finite() {
        return Err(format!("pipeline: no split into {stages} stages fits in device memory"));
    }
    let mut cuts = vec![(0, n); stages];
    let mut j = n;
    for s in (0..stages).rev() {
        let i = if s == 0 { 0 } else { from[s][j] };
        cuts[s] = (i, j);
        j = i;
    }
    Ok(cuts)
}
