//! Stage cuts: the units a model is cut into, a balanced partition of them over stages (a dynamic program over stage costs), and the stage tables it reads.

use super::*;

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
    /// Their weights' bytes, prefix sums.
    pub weight: Vec<f64>,
    /// Bytes per device crossing the cut before unit `j` (`j` in `0..=units`).
    pub cross: Vec<f64>,
    /// Workspace per device.
    pub workspace: f64,
}

impl Units {
    /// Units of a per-op table: op `bounds[u]..bounds[u + 1]` is unit `u`; `pieces`: the
    /// stages' meshes are equal, so each device sends its piece of what crosses a cut.
    pub(super) fn new(t: &Table, bounds: &[usize], pieces: bool) -> Units {
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
            weight: pre(&t.weight),
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
        Units {
            fwd: pre(fwd),
            bwd: pre(bwd),
            act: pre(act),
            param: pre(param),
            weight: pre(param),
            grad,
            cross: cross.to_vec(),
            workspace,
        }
    }

    /// What the parameters of units `a..b` hold per device with `micro` micro-batches: weights,
    /// gradients and optimizer state, and the gradients' accumulator when there are several.
    pub(super) fn params(&self, a: usize, b: usize, micro: usize) -> f64 {
        let acc = if micro > 1 { self.grad[b] - self.grad[a] } else { 0.0 };
        self.param[b] - self.param[a] + acc
    }

    pub(super) fn len(&self) -> usize {
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
pub(super) fn stage_sends(
    p: &PartitionInput<'_>,
    t: &Units,
    a: usize,
    b: usize,
    offset: usize,
    d: usize,
) -> (f64, f64) {
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

pub(super) fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Largest divisor of `b` that is at most `x` (at least 1).
pub(super) fn divisor_at_most(b: i64, x: i64) -> i64 {
    (1..=x.max(1).min(b)).rev().find(|d| b % d == 0).unwrap_or(1)
}

/// Drops split axes (last first) until a strategy is admissible on the re-batched graph.
pub(super) fn repair(cm: &CostModel<'_>, n: NodeId, s: &[Option<usize>]) -> OpStrategy {
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
pub(super) fn table(
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
pub(super) fn table_on(cm: &CostModel<'_>, reference: &HashMap<String, OpStrategy>) -> Table {
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
        weight: b.ops.iter().map(|r| r.weight_memory_bytes).collect(),
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
pub(super) fn partition_on(
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
pub(super) fn valid_size(cluster: &Cluster, d: usize) -> bool {
    d >= 1 && cluster.mesh(d).is_ok()
}

/// A stage of `d` devices may start at device `offset` without straddling a node.
pub(super) fn aligned(cluster: &Cluster, offset: usize, d: usize) -> bool {
    let dpn = cluster.devices_per_node;
    if d <= dpn { offset % dpn + d <= dpn && dpn.is_multiple_of(d) } else { offset.is_multiple_of(dpn) }
}

/// Seconds and latency of sending `n` bytes from the last device of one stage to the first
/// of the next (over their link, through the host where the devices stage through it), the
/// pipeline's `devices` running at once.
pub(super) fn send_between(cluster: &Cluster, devices: usize, last: usize, next: usize, n: f64) -> (f64, f64) {
    let dpn = cluster.devices_per_node;
    let level = if last / dpn == next / dpn { LinkLevel::Intra } else { LinkLevel::Inter };
    let (alpha, _) = alpha_beta(cluster, level, 2, devices, n);
    (send(cluster, level, n, devices), alpha + staging(cluster, 0.0, 0.0, devices))
}
