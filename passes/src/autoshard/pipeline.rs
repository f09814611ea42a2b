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

/// A table grouped into units (runs of consecutive ops), with prefix sums for O(1) stage
/// prices.
pub struct Units {
    /// Forward time, prefix sums (`len = units + 1`).
    pub fwd: Vec<f64>,
    /// Backward time, prefix sums.
    pub bwd: Vec<f64>,
    /// Kept activation bytes per micro-batch, prefix sums.
    pub act: Vec<f64>,
    /// Parameter bytes (weights, gradients, optimizer state), prefix sums.
    pub param: Vec<f64>,
    /// Their gradients' bytes, prefix sums: with several micro-batches the runtime keeps an
    /// accumulator of this size beside the micro-batch's own gradients.
    pub grad: Vec<f64>,
    /// Bytes per device crossing the cut before unit `j` (`j` in `0..=units`).
    pub cross: Vec<f64>,
    /// Workspace per device.
    pub workspace: f64,
}

impl Units {
    /// Units of a per-op table: op `bounds[u]..bounds[u + 1]` is unit `u`; `pieces`: the
    /// stages' meshes are equal, so each device sends its piece of what crosses a cut.
    fn new(t: &Table, bounds: &[usize], pieces: bool) -> Units {
        let pre = |v: &[f64]| {
            let mut out = vec![0.0; bounds.len()];
            for u in 0..bounds.len() - 1 {
                out[u + 1] = out[u] + v[bounds[u]..bounds[u + 1]].iter().sum::<f64>();
            }
            out
        };
        Units {
            fwd: pre(&t.fwd),
            bwd: pre(&t.bwd),
            act: pre(&t.act),
            param: pre(&t.param),
            grad: pre(&t.grad),
            cross: bounds.iter().map(|&b| t.crossing_bytes(pieces)[b]).collect(),
            workspace: t.workspace,
        }
    }

    /// Units from per-unit values (one op each), for tests and other tools.
    pub fn from_parts(fwd: &[f64], bwd: &[f64], act: &[f64], param: &[f64], cross: &[f64], workspace: f64) -> Units {
        let pre = |v: &[f64]| {
            let mut out = vec![0.0; v.len() + 1];
            for (i, x) in v.iter().enumerate() {
                out[i + 1] = out[i] + x;
            }
            out
        };
        let grad = pre(&vec![0.0; fwd.len()]);
        Units { fwd: pre(fwd), bwd: pre(bwd), act: pre(act), param: pre(param), grad, cross: cross.to_vec(), workspace }
    }

    /// What the parameters of units `a..b` hold per device with `micro` micro-batches: weights,
    /// gradients and optimizer state, and the gradients' accumulator when there are several.
    fn params(&self, a: usize, b: usize, micro: usize) -> f64 {
        let acc = if micro > 1 { self.grad[b] - self.grad[a] } else { 0.0 };
        self.param[b] - self.param[a] + acc
    }

    fn len(&self) -> usize {
        self.fwd.len() - 1
    }
}

/// The stage-partition problem of one configuration: everything the dynamic program reads.
pub struct PartitionInput<'a> {
    /// Per allowed stage size: the units priced on a sub-mesh of that size.
    pub tables: Vec<&'a Units>,
    /// The allowed stage sizes (devices), parallel to `tables`.
    pub sizes: Vec<usize>,
    /// Devices in all (the stages' sizes sum to it).
    pub devices: usize,
    /// Stages.
    pub stages: usize,
    /// Micro-batches.
    pub micro: usize,
    /// Schedule.
    pub schedule: Schedule,
    /// Usable memory per device.
    pub capacity: f64,
    /// Seconds and latency (α and staging) of sending some bytes from one device (the last of
    /// a stage) to another (the first of the next).
    pub link: &'a dyn Fn(usize, usize, f64) -> (f64, f64),
    /// A stage of `size` devices may start at device `offset`.
    pub aligned: &'a dyn Fn(usize, usize) -> bool,
    /// Allow recomputation.
    pub recompute: bool,
}

/// One stage of a partition.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Cut {
    /// First unit.
    pub start: usize,
    /// One past the last unit.
    pub end: usize,
    /// Index of its size in [`PartitionInput::sizes`].
    pub size: usize,
    /// Its first device.
    pub offset: usize,
}

/// Forward and backward time per micro-batch of stage `s` over units `a..b` on sizes[k]
/// devices from device `offset`, and whether it recomputes; `None` when it does not fit.
pub fn stage_cost(
    p: &PartitionInput<'_>,
    k: usize,
    s: usize,
    a: usize,
    b: usize,
    offset: usize,
) -> Option<(f64, f64, bool)> {
    let t = p.tables[k];
    let d = p.sizes[k];
    let (send_next, send_prev) = stage_sends(p, t, a, b, offset, d);
    let fwd = t.fwd[b] - t.fwd[a];
    let f = fwd + send_next;
    let bw = t.bwd[b] - t.bwd[a] + send_prev;
    let flight = p.schedule.in_flight(s, p.stages, p.micro);
    let params = t.params(a, b, p.micro);
    let act = t.act[b] - t.act[a];
    // What the stage received for each micro-batch in flight is held until its backward.
    let input = if a > 0 { t.cross[a] } else { 0.0 };
    if params + (act + input) * flight + t.workspace <= p.capacity {
        return Some((f, bw, false));
    }
    if p.recompute && params + input * flight + act + t.workspace <= p.capacity {
        return Some((f, bw + fwd, true));
    }
    None
}

/// Seconds per micro-batch stage `a..b` (on `d` devices from `offset`) spends sending its
/// activations forward and their gradients back. Interleaved over V chunks, a stage sends V
/// times as often, its V chunks' boundaries each as large as its own (the layers of a chunk
/// are a V-th of the stage's, its boundaries alike): the last stage's first V − 1 chunks feed
/// the first stage's next ones, the first stage's later chunks send gradients back to the
/// last.
fn stage_sends(p: &PartitionInput<'_>, t: &Units, a: usize, b: usize, offset: usize, d: usize) -> (f64, f64) {
    let n = t.len();
    let v = p.schedule.chunks() as f64;
    let send = |from: usize, to: usize, bytes: f64| if bytes > 0.0 { (p.link)(from, to, bytes).0 } else { 0.0 };
    let next = if b < n { v * send(offset + d - 1, offset + d, t.cross[b]) } else { 0.0 };
    let prev = if a > 0 && offset > 0 { v * send(offset, offset - 1, t.cross[a]) } else { 0.0 };
    if v == 1.0 {
        return (next, prev);
    }
    // The wrap between the last stage and the first.
    let wrap_next = if b == n && a > 0 { (v - 1.0) * send(offset + d - 1, 0, t.cross[a]) } else { 0.0 };
    let wrap_prev = if a == 0 && b < n { (v - 1.0) * send(0, p.devices - 1, t.cross[b]) } else { 0.0 };
    (next + wrap_next, prev + wrap_prev)
}

/// The partition into `stages` contiguous runs of units with sizes summing to the devices that
/// minimises the slowest stage's time per micro-batch (then, among those, maximises the
/// fastest), or `None` when none fits. Exact: dynamic programming over every cut position,
/// stage size and device offset.
pub fn partition(p: &PartitionInput<'_>) -> Option<Vec<Cut>> {
    let n = p.tables.first()?.len();
    let st = p.stages;
    if st == 0 || st > n {
        return None;
    }
    let g = p.sizes.iter().copied().fold(0, gcd).max(1);
    let offs = p.devices / g + 1; // offsets in units of g
    let idx = |s: usize, j: usize, o: usize| (s * (n + 1) + j) * offs + o;
    let cost =
        |k: usize, s: usize, a: usize, b: usize, off: usize| stage_cost(p, k, s, a, b, off).map(|(f, b, _)| f + b);
    let inf = f64::INFINITY;
    let run = |cap: Option<f64>| -> (Vec<f64>, Vec<(u32, u32)>) {
        // With `cap`: maximise the fastest stage subject to every stage ≤ cap; else minimise
        // the slowest.
        let worst = if cap.is_some() { -inf } else { inf };
        let mut val = vec![worst; st * (n + 1) * offs];
        let mut from = vec![(u32::MAX, u32::MAX); st * (n + 1) * offs];
        for s in 0..st {
            // Offsets some split of the first s stages ends at (stages of one size: one).
            let reached: Vec<bool> =
                (0..offs).map(|o| s == 0 || (s..=n).any(|i| val[idx(s - 1, i, o)] != worst)).collect();
            for j in (s + 1)..=n {
                for (k, &d) in p.sizes.iter().enumerate() {
                    for o_start in 0..offs {
                        let off = o_start * g;
                        if !reached[o_start] || off + d > p.devices || !(p.aligned)(off, d) {
                            continue;
                        }
                        if s == 0 && off != 0 {
                            continue;
                        }
                        let o_end = (off + d) / g;
                        let lo = if s == 0 { 0 } else { s };
                        let hi = if s == 0 { 1 } else { j };
                        for i in lo..hi {
                            let prev = if s == 0 {
                                if cap.is_some() { inf } else { -inf }
                            } else {
                                val[idx(s - 1, i, o_start)]
                            };
                            if s > 0 && prev == worst {
                                continue;
                            }
                            let Some(c) = cost(k, s, i, j, off) else { continue };
                            let v = match cap {
                                Some(cap) => {
                                    if c > cap {
                                        continue;
                                    }
                                    prev.min(c)
                                }
                                None => prev.max(c),
                            };
                            let slot = idx(s, j, o_end);
                            let better = match cap {
                                Some(_) => v > val[slot],
                                None => v < val[slot],
                            };
                            if better {
                                val[slot] = v;
                                from[slot] = (i as u32, k as u32);
                            }
                        }
                    }
                }
            }
        }
        (val, from)
    };
    let last = idx(st - 1, n, p.devices / g);
    let (val, _) = run(None);
    let bottleneck = val[last];
    if !bottleneck.is_finite() {
        return None;
    }
    let (val2, from) = run(Some(bottleneck * (1.0 + 1e-9)));
    if val2[last] == -inf {
        return None;
    }
    let mut cuts = Vec::with_capacity(st);
    let (mut j, mut o) = (n, p.devices / g);
    for s in (0..st).rev() {
        let (i, k) = from[idx(s, j, o)];
        if i == u32::MAX {
            return None;
        }
        let d = p.sizes[k as usize];
        let off = o * g - d;
        cuts.push(Cut { start: i as usize, end: j, size: k as usize, offset: off });
        j = i as usize;
        o = off / g;
    }
    cuts.reverse();
    Some(cuts)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Largest divisor of `b` that is at most `x` (at least 1).
fn divisor_at_most(b: i64, x: i64) -> i64 {
    (1..=x.max(1).min(b)).rev().find(|d| b % d == 0).unwrap_or(1)
}

/// Drops split axes (last first) until a strategy is admissible on the re-batched graph.
fn repair(cm: &CostModel<'_>, n: NodeId, s: &[Option<usize>]) -> OpStrategy {
    let mut s = s.to_vec();
    let sp = cm.space(n);
    if s.iter().all(Option::is_none)
        || (s.iter().all(|d| d.is_none_or(|i| i < sp.dims.len())) && strategy_valid(sp, &s, &cm.mesh, cm.g, n))
    {
        return s;
    }
    for a in (0..s.len()).rev() {
        s[a] = None;
        if s.iter().all(Option::is_none)
            || (s.iter().all(|d| d.is_none_or(|i| i < sp.dims.len())) && strategy_valid(sp, &s, &cm.mesh, cm.g, n))
        {
            return s;
        }
    }
    s
}

/// Builds the table of one sub-mesh at one micro-batch size from a reference plan, its ops
/// priced with the pipeline's `devices` all running kernels (the steady state, every stage
/// busy; it matters only where devices share a host).
fn table(
    gm: &Graph,
    cluster: &Cluster,
    mesh: &Mesh,
    devices: usize,
    opts: &Options,
    reference: &HashMap<String, OpStrategy>,
) -> Table {
    table_on(&CostModel::new(gm, cluster, mesh.clone(), opts.clone()).with_busy(devices), reference)
}

/// [`table`] on a cost model of the micro-batch graph and sub-mesh.
fn table_on(cm: &CostModel<'_>, reference: &HashMap<String, OpStrategy>) -> Table {
    let (gm, mesh) = (cm.g, &cm.mesh);
    let order = cm.order().to_vec();
    let mut asg = Assignment::default();
    let mut strategies = Vec::with_capacity(order.len());
    for &n in &order {
        let key = gm.node(n).outputs().first().map(|o| o.name.as_str()).unwrap_or("");
        let s = reference.get(key).cloned().unwrap_or_else(|| vec![None; mesh.axes.len()]);
        let s = if s.len() == mesh.axes.len() { repair(cm, n, &s) } else { vec![None; mesh.axes.len()] };
        strategies.push(s.clone());
        asg.strategies.insert(n, s);
    }
    let b = cm.evaluate(&asg);
    let n = order.len();
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &x)| (x, i)).collect();
    let mut cross = vec![0.0; n + 1];
    let mut cross_piece = vec![0.0; n + 1];
    let mut crossing: Vec<Vec<Value>> = vec![Vec::new(); n + 1];
    // What every stage computes for itself (the lowering copies it) is never sent.
    let everywhere = ir::reshard::computed_everywhere_in_training(gm, &order);
    for (i, &op) in order.iter().enumerate() {
        if everywhere.contains(&op) {
            continue;
        }
        for slot in 0..gm.node(op).num_outputs() {
            let v = Value::new(op, slot as u16);
            let last = gm.users(v).iter().filter_map(|(u, _)| pos.get(u)).copied().max();
            if let Some(last) = last
                && last > i
            {
                // Each device of the stage sends a value another stage reads to its
                // counterpart in the reading stage (`codegen::lower`, a stage's sends): its
                // piece where the meshes are equal, else the whole tensor. That is what a
                // device sends and the next stage holds.
                let bytes = cm.value_bytes(v);
                let sent = ir::reshard::send_layout(gm, v, &strategies[i], mesh.axes.len());
                let piece = ir::reshard::local_bytes(bytes, &sent, mesh);
                for j in (i + 1)..=last {
                    cross[j] += bytes;
                    cross_piece[j] += piece;
                    crossing[j].push(v);
                }
            }
        }
    }
    Table {
        fwd: b.ops.iter().map(|r| r.forward_s).collect(),
        bwd: b.ops.iter().map(|r| r.backward_s).collect(),
        act: b.ops.iter().map(|r| r.memory_bytes).collect(),
        param: b.ops.iter().map(|r| r.param_memory_bytes).collect(),
        grad: b.ops.iter().map(|r| r.grad_memory_bytes).collect(),
        sync: b.ops.iter().map(|r| r.grad_sync_s).collect(),
        update: b.ops.iter().map(|r| r.update_s).collect(),
        cross,
        cross_piece,
        crossing,
        workspace: b.memory.workspace,
        input_transfer: b.input_transfer_s,
        strategies,
        rows: b.ops.clone(),
        events: b.events.clone(),
    }
}

/// [`partition`] of `units` (one per stage size in `sizes`) into `stages` stages of `micro`
/// micro-batches under `schedule`, on the cluster's links, stages inside node boundaries,
/// a stage that does not fit recomputing where `recompute` allows it.
#[allow(clippy::too_many_arguments)]
fn partition_on(
    cluster: &Cluster,
    devices: usize,
    units: &[&Units],
    sizes: &[usize],
    stages: usize,
    micro: usize,
    schedule: Schedule,
    capacity: f64,
    recompute: bool,
) -> Option<Vec<Cut>> {
    // A send's price depends on its link level and size alone: the dynamic program asks for
    // the same few many times.
    let memo: std::cell::RefCell<rustc_hash::FxHashMap<(bool, u64), (f64, f64)>> = Default::default();
    let dpn = cluster.devices_per_node;
    let link = |a: usize, b: usize, n: f64| {
        let key = (a / dpn == b / dpn, n.to_bits());
        if let Some(&x) = memo.borrow().get(&key) {
            return x;
        }
        let x = send_between(cluster, devices, a.min(b), a.max(b), n);
        memo.borrow_mut().insert(key, x);
        x
    };
    let align = |off: usize, d: usize| aligned(cluster, off, d);
    partition(&PartitionInput {
        tables: units.to_vec(),
        sizes: sizes.to_vec(),
        devices,
        stages,
        micro,
        schedule,
        capacity,
        link: &link,
        aligned: &align,
        recompute,
    })
}

/// Sizes a stage's sub-mesh may have: `cluster.mesh(d)` must exist.
fn valid_size(cluster: &Cluster, d: usize) -> bool {
    d >= 1 && cluster.mesh(d).is_ok()
}

/// A stage of `d` devices may start at device `offset` without straddling a node.
fn aligned(cluster: &Cluster, offset: usize, d: usize) -> bool {
    let dpn = cluster.devices_per_node;
    if d <= dpn { offset % dpn + d <= dpn && dpn.is_multiple_of(d) } else { offset.is_multiple_of(dpn) }
}

/// Seconds and latency of sending `n` bytes from the last device of one stage to the first
/// of the next (over their link, through the host where the devices stage through it), the
/// pipeline's `devices` running at once.
fn send_between(cluster: &Cluster, devices: usize, last: usize, next: usize, n: f64) -> (f64, f64) {
    let dpn = cluster.devices_per_node;
    let level = if last / dpn == next / dpn { LinkLevel::Intra } else { LinkLevel::Inter };
    let (alpha, _) = alpha_beta(cluster, level, 2, devices, n);
    (send(cluster, level, n, devices), alpha + staging(cluster, 0.0, 0.0, devices))
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

/// What a configuration's stage table depends on: tensor degree, devices per stage,
/// micro-batch size, the cost-model options (as printed: every field) and the devices busy.
type StageKey = (usize, usize, i64, String, usize);

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

/// Units the uniform dynamic program works on (ops are grouped beyond this).
const FINE_UNITS: usize = 512;
/// Units the dynamic program over stage sizes works on.
const COARSE_UNITS: usize = 96;
/// Units a configuration's stages are cut from (`price_configuration`: `cost --strategy` and
/// the configuration grid): about two per block of the largest models planned (GPT 1T's 128
/// layers), a quarter of the uniform program's work at [`FINE_UNITS`]; and at least four per
/// model chunk (stages × virtual stages), up to [`FINE_UNITS`], so chunks still balance.
const CONFIG_UNITS: usize = 256;

/// Unit boundaries: every op its own unit when there are at most `max` ops, else runs of
/// consecutive ops of about equal time.
fn unit_bounds(t: &Table, max: usize) -> Vec<usize> {
    let n = t.fwd.len();
    if n <= max {
        return (0..=n).collect();
    }
    let time: Vec<f64> = (0..n).map(|i| t.fwd[i] + t.bwd[i]).collect();
    let total: f64 = time.iter().sum();
    let target = total / max as f64;
    let mut bounds = vec![0];
    let mut acc = 0.0;
    for (i, x) in time.iter().enumerate() {
        acc += x;
        if acc >= target && i + 1 < n && bounds.len() < max {
            bounds.push(i + 1);
            acc = 0.0;
        }
    }
    bounds.push(n);
    bounds
}

/// Bytes per device each stage (ops `ranges[s]` of `order`) holds for the parameters it
/// shares with other stages (tied weights, as a language model's embedding and output
/// projection): a later reader holds its own copy of the weight and of its gradient (and the
/// gradient's accumulator with several micro-batches); the first reader receives each later
/// reader's gradient and sums it into its own in the backward (the received gradient and the
/// sum beside its own). Returns what each stage holds for the whole step and what it holds
/// while it sums in its backward.
fn shared_params(gm: &Graph, order: &[NodeId], ranges: &[(usize, usize)], micro: usize) -> (Vec<f64>, Vec<f64>) {
    let mut readers: HashMap<Value, Vec<usize>> = HashMap::new();
    for (st, &(a, b)) in ranges.iter().enumerate() {
        for &n in &order[a.min(order.len())..b.min(order.len())] {
            for v in gm.node(n).inputs().iter().flatten().filter(|v| ir::cost::is_param(gm, **v)) {
                let r = readers.entry(*v).or_default();
                if !r.contains(&st) {
                    r.push(st);
                }
            }
        }
    }
    let (mut held, mut summing) = (vec![0.0; ranges.len()], vec![0.0; ranges.len()]);
    for (v, stages) in readers.iter().filter(|(_, s)| s.len() > 1) {
        let bytes = gm.tensor_type(*v).and_then(|t| t.size_bytes()).unwrap_or(0) as f64;
        summing[stages[0]] += 2.0 * bytes;
        for &st in &stages[1..] {
            held[st] += bytes * if micro > 1 { 3.0 } else { 2.0 };
        }
    }
    (held, summing)
}

/// Prices a partition (stages of units `cuts`, sizes `sizes[cut.size]`) as a whole step.
#[allow(clippy::too_many_arguments)]
fn price_cuts(
    gm: &Graph,
    g: &Graph,
    cluster: &Cluster,
    opts: &Options,
    tables: &HashMap<(usize, i64), Table>,
    sizes: &[usize],
    cuts: &[Cut],
    bounds: &[usize],
    mb: i64,
    s: usize,
    m: usize,
    schedule: Schedule,
    capacity: f64,
    meshes: &HashMap<usize, Mesh>,
    recompute: bool,
) -> Option<PipelinePlan> {
    let order = g.op_nodes().ok()?;
    let names: HashMap<String, NodeId> =
        order.iter().filter_map(|&n| Some((g.node(n).outputs().first()?.name.clone(), n))).collect();
    let gm_order = gm.op_nodes().ok()?;
    let devices: usize = cuts.iter().map(|c| sizes[c.size]).sum();
    let link = |a: usize, b: usize, n: f64| send_between(cluster, devices, a.min(b), a.max(b), n);
    let align = |_: usize, _: usize| true;
    let mut stages = Vec::with_capacity(s);
    let (mut fwd, mut bwd) = (Vec::with_capacity(s), Vec::with_capacity(s));
    let mut mem_per_device = Vec::new();
    let mut worst = Memory::default();
    let mut worst_total = 0.0;
    let (mut syncs, mut updates) = (Vec::new(), Vec::new());
    let mut p2p_total = 0.0;
    let mut rows_all = Vec::new();
    let mut events = Vec::new();
    let mut op_cuts = Vec::with_capacity(s);
    let ranges: Vec<(usize, usize)> = cuts.iter().map(|c| (bounds[c.start], bounds[c.end])).collect();
    let (shared, summing) = shared_params(gm, &gm_order, &ranges, m);
    // Between stages of equal meshes each device sends its piece (`codegen::lower`).
    let pieces = cuts.iter().all(|c| sizes[c.size] == sizes[cuts[0].size]);
    for (st, cut) in cuts.iter().enumerate() {
        let d = sizes[cut.size];
        let t = &tables[&(d, mb)];
        let (a, b) = (bounds[cut.start], bounds[cut.end]);
        op_cuts.push((a, b));
        let all: Vec<usize> = (0..=t.fwd.len()).collect();
        let units = Units::new(t, &all, pieces);
        let pin = PartitionInput {
            tables: vec![&units],
            sizes: vec![d],
            devices,
            stages: s,
            micro: m,
            schedule,
            capacity,
            link: &link,
            aligned: &align,
            recompute,
        };
        let (f, bw, rc) = stage_cost(&pin, 0, st, a, b, cut.offset)?;
        let flight = schedule.in_flight(st, s, m);
        let params = units.params(a, b, m);
        let act_one = units.act[b] - units.act[a];
        let input = if a > 0 { units.cross[a] } else { 0.0 };
        let act = if rc { input * flight + act_one } else { (act_one + input) * flight };
        // The update, after the last backward, makes each weight's and optimizer state's next
        // value while the current ones are held (the micro-batch's own gradients freed by
        // then), unless the device's optimizer updates in place.
        let (param, grad) = (units.param[b] - units.param[a], units.grad[b] - units.grad[a]);
        let update = if cluster.device.in_place_update { 0.0 } else { param - grad * if m > 1 { 2.0 } else { 1.0 } };
        let act = (act + summing[st]).max(update);
        let mem = Memory {
            weights: params + shared[st],
            gradients: 0.0,
            optimizer: 0.0,
            activations: act,
            workspace: t.workspace,
        };
        let total = mem.total();
        if total > worst_total {
            worst_total = total;
            worst = mem;
        }
        let send = if b < t.fwd.len() { units.cross[b] } else { 0.0 };
        if send > 0.0 {
            let (time, latency) = link(cut.offset + d - 1, cut.offset + d, send);
            events.extend(t.crossing[b].iter().map(|&v| crossing_event(v, send, time, latency)));
        }
        let (sends_fwd, sends_bwd) = stage_sends(&pin, &units, a, b, cut.offset, d);
        p2p_total += (sends_fwd + sends_bwd) * m as f64;
        let mut asg = Assignment::default();
        let mut nodes = Vec::with_capacity(b - a);
        for (k, &n) in gm_order[a..b].iter().enumerate() {
            if let Some(&orig) = gm.node(n).outputs().first().and_then(|o| names.get(o.name.as_str())) {
                asg.strategies.insert(orig, t.strategies[a + k].clone());
                nodes.push(orig);
            }
        }
        let in_stage: std::collections::HashSet<NodeId> = gm_order[a..b].iter().copied().collect();
        events.extend(t.events.iter().filter(|e| e.op.is_some_and(|o| in_stage.contains(&o))).cloned());
        rows_all.extend(t.rows[a..b].iter().cloned());
        let sync: f64 = t.sync[a..b].iter().sum();
        syncs.push(sync);
        updates.push(t.update[a..b].iter().sum::<f64>());
        fwd.push(f);
        bwd.push(bw);
        mem_per_device.extend(std::iter::repeat_n(total as u64, d));
        let name = |n: NodeId| gm.op_name(n);
        stages.push(StagePlan {
            devices: (cut.offset..cut.offset + d).collect(),
            mesh: mesh_string(&meshes[&d]),
            sub_mesh: meshes[&d].clone(),
            ops: gm_order[a..b]
                .iter()
                .map(|&n| gm.node(n).outputs().first().map(|o| o.name.clone()).unwrap_or_default())
                .collect(),
            nodes,
            first_op: name(gm_order[a]),
            last_op: name(gm_order[b - 1]),
            forward_s: f,
            backward_s: bw,
            time_s: f + bw,
            recompute: rc,
            memory_bytes: total as u64,
            send_bytes: send,
            grad_sync_s: sync,
            assignment: asg,
            rows: t.rows[a..b].to_vec(),
            events: Vec::new(),
        });
    }
    let makespan = schedule.makespan(&fwd, &bwd, m);
    let slot_b = bwd.iter().copied().fold(0.0, f64::max);
    // Stage s finishes its last backward about s slots before stage 0; its synchronisation
    // hides behind that (when overlap is on), the rest is exposed.
    let exposed = syncs
        .iter()
        .enumerate()
        .map(|(st, &x)| if opts.overlap_grad_sync { (x - st as f64 * slot_b).max(0.0) } else { x })
        .fold(0.0, f64::max);
    let update = updates.iter().copied().fold(0.0, f64::max);
    let before_input = makespan + exposed + update;
    let input_transfer = tables[&(sizes[cuts[0].size], mb)].input_transfer * m as f64;
    let input = if opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };
    let times: Vec<f64> = fwd.iter().zip(&bwd).map(|(f, b)| f + b).collect();
    let tmax = times.iter().copied().fold(0.0, f64::max);
    let tmin = times.iter().copied().fold(f64::INFINITY, f64::min);
    let imbalance = tmax / tmin.max(1e-30);
    let reference = &tables[&(sizes[cuts[0].size], mb)];
    let blocker = (imbalance > 1.10).then(|| blocker(gm, reference, &op_cuts, &times, s));
    let feasible = worst_total <= capacity;
    let slots = schedule.slots(s, m);
    let mut by_kind = std::collections::BTreeMap::new();
    by_kind.insert("p2p".to_string(), p2p_total);
    let breakdown = Breakdown {
        step_time_s: before_input + input,
        compute_s: m as f64 * tmax,
        forward_s: m as f64 * fwd.iter().copied().fold(0.0, f64::max),
        backward_s: m as f64 * slot_b,
        update_s: update,
        communication_s: p2p_total + syncs.iter().sum::<f64>(),
        communication_by_kind: by_kind,
        gradient_sync_s: syncs.iter().sum(),
        exposed_gradient_sync_s: exposed,
        bubble_s: makespan / slots * (slots - m as f64),
        input_s: input,
        input_transfer_s: input_transfer,
        input_bytes: 0.0,
        memory_per_device_bytes: mem_per_device,
        memory: worst,
        memory_capacity_bytes: capacity as u64,
        feasible,
        infeasible_reason: (!feasible).then(|| "a pipeline stage does not fit".into()),
        ops: rows_all,
        events,
        // Stages have their own meshes; per-device bytes are reported for one mesh only.
        bytes_moved_per_device: Default::default(),
        policy: Default::default(),
    };
    Some(PipelinePlan {
        stages,
        micro_batches: m,
        schedule,
        breakdown,
        imbalance,
        blocker,
        tried: Vec::new(),
        search_time_s: 0.0,
        requested: false,
        whole_batch: None,
        replanned: None,
    })
}

/// The send of a value crossing a stage cut to the next stage (`bytes` in `time`).
fn crossing_event(value: ir::Value, bytes: f64, time: f64, latency: f64) -> CommEvent {
    let step = crate::cost::collective::Step {
        kind: crate::cost::collective::CommKind::P2p,
        axes: vec![],
        group: 2,
        bytes,
        moved: bytes,
        moved_by_device: None,
        latency,
        time,
    };
    CommEvent { phase: Phase::Forward, value, op: None, from: vec![], to: vec![], steps: vec![step] }
}

/// Why stages are not balanced: the heaviest single op, when it alone is more than a fair
/// share; else the op the fastest stage would have to take from a neighbour, when that would
/// make it the slowest; else memory (recomputation) or the tensors crossing the cuts.
fn blocker(g: &Graph, t: &Table, cuts: &[(usize, usize)], times: &[f64], s: usize) -> String {
    let total: f64 = times.iter().sum();
    let share = total / s as f64;
    let op_time = |i: usize| t.fwd[i] + t.bwd[i];
    let order = g.op_nodes().unwrap_or_default();
    let name = |i: usize| order.get(i).map(|&n| g.op_name(n)).unwrap_or_default();
    let (heavy, ht) = (0..t.fwd.len()).map(|i| (i, op_time(i))).fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    if ht > 0.5 * share {
        return format!(
            "op `{}` alone takes {:.1}% of a fair stage share ({:.3} ms of {:.3} ms per micro-batch); cuts between ops cannot balance finer",
            name(heavy),
            100.0 * ht / share,
            ht * 1e3,
            share * 1e3
        );
    }
    let slowest = times.iter().copied().fold(0.0, f64::max);
    let fastest = (0..times.len()).fold(0, |a, b| if times[b] < times[a] { b } else { a });
    let (a, b) = cuts[fastest];
    let mut neighbours = Vec::new();
    if fastest + 1 < cuts.len() && b < t.fwd.len() {
        neighbours.push(b);
    }
    if fastest > 0 && a > 0 {
        neighbours.push(a - 1);
    }
    if let Some(&i) = neighbours.iter().min_by(|&&x, &&y| op_time(x).total_cmp(&op_time(y)))
        && times[fastest] + op_time(i) > slowest
    {
        return format!(
            "the fastest stage {fastest} ({:.3} ms) cannot take op `{}` ({:.3} ms) from its neighbour without becoming slower than the slowest ({:.3} ms): the ops are too coarse to balance finer",
            times[fastest] * 1e3,
            name(i),
            op_time(i) * 1e3,
            slowest * 1e3
        );
    }
    format!(
        "stage {fastest} cannot grow: moving a boundary would exceed memory or add a costly transfer of the tensors crossing the cut"
    )
}

/// Prices a hand pipeline configuration — `stages` stages of `devices / stages` devices,
/// each sharded data-parallel or, with `tensor` > 1, Megatron-style over `tensor` of them
/// (the rest data-parallel), `micro` micro-batches under `schedule` — with the tables,
/// partition and step price the search uses for the pipelines it makes. The layers are
/// balanced over the stages as the search balances them; recomputation is what `opts` says
/// (no stage recomputes on its own). A configuration that does not fit is priced on the
/// time-balanced cut and marked so, with what its fullest stage needs.
#[allow(clippy::too_many_arguments)]
pub fn price_configuration(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    stages: usize,
    micro: usize,
    schedule: Schedule,
    tensor: usize,
    opts: &Options,
) -> Result<PipelinePlan, String> {
    let batch = graph_batch(g).ok_or("pipeline: the model has no input with a batch dim")?;
    let shape = (stages, micro, schedule, tensor);
    price_configuration_in(&mut MicroGraphs::new(g, batch), cluster, devices, shape, opts, true)
}

/// The stage table of a configuration: each op priced on a stage of `per_stage` devices
/// (tensor `tensor` within) at micro-batch size `mb`, made once per [`MicroGraphs`].
fn stage_table(
    graphs: &mut MicroGraphs<'_>,
    cluster: &Cluster,
    devices: usize,
    tensor: usize,
    per_stage: usize,
    mb: i64,
    opts: &Options,
) -> Result<Arc<StageTable>, String> {
    let key: StageKey = (tensor, per_stage, mb, format!("{opts:?}"), devices);
    if let Some(t) = graphs.stage_tables.get(&key) {
        return Ok(t.clone());
    }
    let inner = crate::autoshard::Named::stage_strategy(tensor, per_stage)?;
    let mesh = inner.mesh(cluster, per_stage)?;
    let (gm, analysis) = graphs.analyzed(mb).ok_or_else(|| {
        let why = graphs.refused.as_ref().map_or(String::new(), |(_, e)| format!(": {e}"));
        format!("pipeline: the model takes no micro-batch of {mb}{why}")
    })?;
    let cm = CostModel::with_analysis(&gm, &analysis, cluster, mesh.clone(), opts.clone()).with_busy(devices);
    let asg = match crate::autoshard::named::assign(&cm, &inner) {
        Ok(a) => a,
        // A stage of one device runs every op whole, whatever carries the batch (a micro-batch
        // of one sample has no dim that shows it).
        Err(_) if per_stage == 1 => Assignment::default(),
        Err(e) => return Err(e),
    };
    let strategies: HashMap<String, OpStrategy> = asg
        .strategies
        .iter()
        .filter_map(|(n, s)| Some((gm.node(*n).outputs().first()?.name.clone(), s.clone())))
        .collect();
    let t = table_on(&cm, &strategies);
    let st = Arc::new(StageTable { tables: HashMap::from([((per_stage, mb), t)]), gm, mesh });
    graphs.stage_tables.insert(key, st.clone());
    Ok(st)
}

/// What [`price_configuration_in`] answers, told not to price a configuration whose stages
/// fit no split, when none does.
pub(super) const UNFIT: &str = "pipeline: no split into stages fits in device memory";

/// [`price_configuration`] with the micro-batch graphs of `graphs` (re-batched once per
/// size over many configurations); `shape` is (stages, micro-batches, schedule, tensor).
/// With `report_unfit`, a configuration no split of which fits is priced at the split that
/// needs least (infeasible); without, it is the error [`UNFIT`] (the grid walks on without
/// the second partition).
pub(super) fn price_configuration_in(
    graphs: &mut MicroGraphs<'_>,
    cluster: &Cluster,
    devices: usize,
    shape: (usize, usize, Schedule, usize),
    opts: &Options,
    report_unfit: bool,
) -> Result<PipelinePlan, String> {
    let (stages, micro, schedule, tensor) = shape;
    let (g, batch) = (graphs.g, graphs.batch);
    if stages == 0 || !devices.is_multiple_of(stages) {
        return Err(format!("pipeline: {stages} stages do not divide {devices} devices"));
    }
    if micro == 0 || micro as i64 > batch || batch % micro as i64 != 0 {
        return Err(format!("pipeline: {micro} micro-batches do not divide the batch of {batch}"));
    }
    if schedule.chunks() > 1 && !micro.is_multiple_of(stages) {
        return Err(format!(
            "pipeline: the interleaved schedule runs micro-batches in groups of the {stages} stages; {micro} is not a multiple"
        ));
    }
    let per_stage = devices / stages;
    let mb = batch / micro as i64;
    let st = stage_table(graphs, cluster, devices, tensor, per_stage, mb, opts)?;
    let chunks = stages * schedule.chunks();
    let (gm, tables) = (&st.gm, &st.tables);
    let table = &tables[&(per_stage, mb)];
    let bounds = &unit_bounds(table, (4 * chunks).clamp(CONFIG_UNITS, FINE_UNITS));
    let units = &Units::new(table, bounds, true);
    let cuttable = bounds.len() - 1;
    if chunks > cuttable {
        return Err(format!(
            "pipeline: {chunks} model chunks for {cuttable} places to cut (runs of ops of about equal time)"
        ));
    }
    let meshes = HashMap::from([(per_stage, st.mesh.clone())]);
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    let price = |cap: f64| {
        let cuts = partition_on(cluster, devices, &[units], &[per_stage], stages, micro, schedule, cap, false)?;
        let (s, m) = (stages, micro);
        price_cuts(gm, g, cluster, opts, tables, &[per_stage], &cuts, bounds, mb, s, m, schedule, cap, &meshes, false)
    };
    if let Some(p) = price(capacity) {
        return Ok(p);
    }
    if !report_unfit {
        return Err(UNFIT.into());
    }
    let mut p = price(f64::INFINITY).ok_or("pipeline: no split into stages")?;
    let b = &mut p.breakdown;
    b.memory_capacity_bytes = capacity as u64;
    b.feasible = false;
    b.infeasible_reason = Some(format!(
        "the fullest stage needs {:.2} GiB per device, {:.2} GiB usable",
        b.memory.total() / 1073741824.0,
        capacity / 1073741824.0
    ));
    Ok(p)
}

impl PipelinePlan {
    /// Every stage's strategies together (each on its stage's mesh), keyed by the whole
    /// graph's nodes.
    pub fn assignment(&self) -> Assignment {
        let mut asg = Assignment::default();
        for st in &self.stages {
            asg.strategies.extend(st.assignment.strategies.iter().map(|(k, v)| (*k, v.clone())));
        }
        asg
    }

    /// The stages as `shardc cost` reports a priced pipeline.
    pub fn report(&self) -> crate::cost::PipelineReport {
        use crate::cost::pipeline::StageReport;
        crate::cost::PipelineReport {
            stages: self
                .stages
                .iter()
                .map(|s| StageReport {
                    devices: s.devices.clone(),
                    op_count: s.ops.len(),
                    first_op: s.first_op.clone(),
                    last_op: s.last_op.clone(),
                    time_s: s.time_s,
                    forward_s: s.forward_s,
                    backward_s: s.backward_s,
                    send_bytes: s.send_bytes,
                    memory_bytes: s.memory_bytes,
                })
                .collect(),
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            breakdown: self.breakdown.clone(),
            imbalance: self.imbalance,
        }
    }
}

/// One stage of a pipeline given whole (a plan file's): its ops (first output names), its
/// mesh and its first global device.
pub struct GivenStage<'a> {
    pub ops: &'a [String],
    pub mesh: &'a Mesh,
    pub offset: usize,
}

/// Prices the pipeline of `stages` over `g` (its ops' `strategies` by first output name) with
/// `micro` micro-batches under `schedule`, as the search prices the partitions it makes
/// (per-stage time and memory, the step): a plan read from a file is priced again rather than
/// trusted. Stages of one size share that size's first mesh, as the search's tables do. An
/// error when the graph takes no such micro-batch, a stage names ops the graph lacks or not
/// after the previous stage's, or the stages do not fit in memory.
pub fn price_stages(
    g: &Graph,
    cluster: &Cluster,
    opts: &Options,
    stages: &[GivenStage<'_>],
    strategies: &HashMap<String, OpStrategy>,
    micro: usize,
    schedule: Schedule,
) -> Result<PipelinePlan, String> {
    let batch = graph_batch(g).ok_or("the model has no input with a batch dim to split into micro-batches")?;
    if micro == 0 || batch % micro as i64 != 0 {
        return Err(format!("{micro} micro-batches do not divide the batch of {batch}"));
    }
    let mb = batch / micro as i64;
    let mut graphs = MicroGraphs::new(g, batch);
    let gm = graphs.get(mb).ok_or_else(|| {
        let why = graphs.refused.as_ref().map_or(String::new(), |(_, e)| format!(": {e}"));
        format!("the model takes no micro-batch of {mb}{why}")
    })?;
    let order = gm.op_nodes().map_err(|_| "the graph has a cycle".to_string())?;
    let pos: HashMap<&str, usize> =
        order.iter().enumerate().filter_map(|(i, &n)| Some((gm.node(n).outputs().first()?.name.as_str(), i))).collect();
    let devices: usize = stages.iter().map(|s| s.mesh.devices()).sum();
    let mut sizes: Vec<usize> = stages.iter().map(|s| s.mesh.devices()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut meshes: HashMap<usize, Mesh> = HashMap::new();
    // Each stage runs from its first named op to the next stage's first; ops no stage names
    // (constants the micro-batch graph adds) go with the stage whose run holds them.
    let mut runs: Vec<(usize, usize)> = Vec::with_capacity(stages.len());
    for (i, s) in stages.iter().enumerate() {
        let d = s.mesh.devices();
        meshes.entry(d).or_insert_with(|| s.mesh.clone());
        let at: Vec<usize> = s.ops.iter().filter_map(|o| pos.get(o.as_str()).copied()).collect();
        let (Some(&first), Some(&last)) = (at.iter().min(), at.iter().max()) else {
            return Err(format!("stage {i} names no op of the model"));
        };
        if at.len() != s.ops.len() {
            return Err(format!("stage {i} names ops the model does not have"));
        }
        if runs.last().is_some_and(|&(_, prev_last)| prev_last >= first) {
            return Err(format!("stage {i}'s ops are not after stage {}'s in the model's order", i - 1));
        }
        runs.push((first, last));
    }
    let cuts: Vec<Cut> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| Cut {
            start: if i == 0 { 0 } else { runs[i].0 },
            end: runs.get(i + 1).map_or(order.len(), |r| r.0),
            size: sizes.iter().position(|&x| x == s.mesh.devices()).unwrap_or(0),
            offset: s.offset,
        })
        .collect();
    let tables: HashMap<(usize, i64), Table> =
        sizes.iter().map(|&d| ((d, mb), table(&gm, cluster, &meshes[&d], devices, opts, strategies))).collect();
    let bounds: Vec<usize> = (0..=order.len()).collect();
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    price_cuts(
        &gm,
        g,
        cluster,
        opts,
        &tables,
        &sizes,
        &cuts,
        &bounds,
        mb,
        stages.len(),
        micro,
        schedule,
        capacity,
        &meshes,
        true,
    )
    .ok_or_else(|| "the stages do not fit in memory on this cluster".into())
}
