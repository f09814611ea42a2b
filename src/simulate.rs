//! A lowered program's step, priced op by op and played through the runtime's schedule.
//!
//! Every device runs what the runtime runs, in its order: the parts of its schedule (the
//! forward and backward part of each micro-batch, as GPipe or 1F1B orders them; a
//! recomputing stage's forward part again before its backward part), the gradient sums of
//! accumulation after each micro-batch but the first, then its once-per-step ops (the
//! optimizer updates). A receive waits for its send, a collective for every member of its
//! group (the runtime's hub matches a group's collectives in order). The predicted step is
//! the last device's finish.
//!
//! Each op is priced by the cost model on the device's own graph (its local shapes), every
//! op replicated over a mesh of all the program's devices, so that devices sharing a host
//! share its throughput as they do in a plan's price. Collectives are priced as the plan's
//! steps are ([`passes::cost::collective`]: the ring over the group's link, the host copies
//! around it where devices stage through the host); a send costs its sender the copy down,
//! its receiver the copy up, and the message the link between them.
//!
//! Pipelines are what this is for: the plan prices a pipeline from its forward model's
//! stages and a closed-form schedule, while the runtime runs the stages' lowered training
//! programs, micro-batch by micro-batch.

use std::collections::{BTreeMap, HashMap, HashSet};

use codegen::Program;
use codegen::schedule::{Cut, Part, accumulates};
use ir::shard::LinkLevel;
use ir::{NodeId, Op, OpClass, Value};
use passes::cost::collective::{self, alpha_beta};
use passes::cost::{Cluster, CostModel, Options};

/// What one device does next.
#[derive(Clone, Debug)]
enum Work {
    /// A kernel or a local sum (what: its op type): seconds.
    Compute(String, f64),
    /// A message to `to` (tag, micro-batch): `down` seconds of copying it to the host here,
    /// then `flight` seconds on the link.
    Send { to: usize, tag: i64, micro: usize, down: f64, flight: f64 },
    /// The message from `from` (tag, micro-batch), then `up` seconds of copying it to the
    /// device.
    Recv { from: usize, tag: i64, micro: usize, up: f64 },
    /// A collective (what: its op type) over `group` taking `seconds` once every member is
    /// there.
    Collective { what: &'static str, group: Vec<i64>, seconds: f64 },
}

/// The simulated step.
#[derive(Clone, Debug)]
pub struct Simulated {
    /// Seconds until the last device finishes.
    pub step_s: f64,
    /// Per device (program order), seconds until it finishes.
    pub devices: Vec<f64>,
    /// Per device, seconds spent waiting (for messages and for the other members of
    /// collectives).
    pub waiting: Vec<f64>,
    /// Per device, seconds per op type (compute) and per communication op type (their own
    /// time, without waiting), as the runtime's report counts them.
    pub by_op: Vec<BTreeMap<String, f64>>,
}

/// Plays one step of `p` (`trains`: a training step, with its state carried between steps)
/// on `cluster`.
pub fn simulate(p: &Program, cluster: &Cluster, opts: &Options, trains: bool) -> Result<Simulated, String> {
    if p.devices.iter().enumerate().any(|(i, d)| d.device != i) {
        return Err("the program's devices are not numbered in order".into());
    }
    let total = p.devices.len().max(1);
    let mesh = cluster.mesh(total).map_err(|e| e.to_string())?;
    let node_of = |d: usize| d / cluster.devices_per_node.max(1);
    let level = |group: &[i64]| {
        let first = group.first().map_or(0, |&g| node_of(g.max(0) as usize));
        if group.iter().all(|&g| node_of(g.max(0) as usize) == first) { LinkLevel::Intra } else { LinkLevel::Inter }
    };
    let accumulate = accumulates(p, trains);
    let mut plans: Vec<Vec<Work>> = Vec::with_capacity(p.devices.len());
    for d in &p.devices {
        let g = &d.graph;
        let order = g.topo_order().map_err(|_| format!("device {}: the graph has a cycle", d.device))?;
        let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
        let replicated = vec![None; mesh.axes.len()];
        let bytes =
            |v: Option<Value>| v.and_then(|v| g.tensor_type(v)).and_then(|t| t.size_bytes()).map_or(0.0, |b| b as f64);
        let price = |n: NodeId, micro: usize| -> Work {
            let node = g.node(n);
            let group = |grp: &Option<Vec<i64>>| grp.clone().unwrap_or_default();
            let (x, y) = (bytes(node.input(0)), bytes(Some(Value::new(n, 0))));
            // A ring collective of `what` over `grp` priced by `f` on `n_bytes` (the plan's
            // convention: the input, an all-gather's output), copying `down` bytes to the host
            // and `up` back.
            type Ring = fn(f64, usize, f64, f64) -> f64;
            let ring = |what, grp: &Option<Vec<i64>>, f: Ring, n_bytes: f64, down: f64, up: f64| {
                let grp = group(grp);
                let p = grp.len();
                let seconds = if p <= 1 {
                    0.0
                } else {
                    let (a, b) = alpha_beta(cluster, level(&grp), p, n_bytes);
                    f(n_bytes, p, a, b) + collective::staging(cluster, down, up)
                };
                Work::Collective { what, group: grp, seconds }
            };
            match &node.op {
                Op::AllReduce(c) => ring("AllReduce", &c.group, collective::all_reduce, x, x, x),
                Op::AllGather(c) => ring("AllGather", &c.group, collective::all_gather, y, x, y),
                Op::ReduceScatter(c) => ring("ReduceScatter", &c.group, collective::reduce_scatter, x, x, y),
                Op::AllToAll(c) => ring("AllToAll", &c.group, collective::all_to_all, x, x, y),
                Op::HaloExchange(c) => {
                    let grp = group(&c.group);
                    let seconds = if grp.len() <= 1 {
                        0.0
                    } else {
                        let moved = (y - x).max(0.0);
                        let (a, b) = alpha_beta(cluster, level(&grp), 2, moved);
                        collective::p2p(moved, a, b) + collective::staging(cluster, x, y)
                    };
                    Work::Collective { what: "HaloExchange", group: grp, seconds }
                }
                Op::Send(s) => {
                    let to = s.peer.unwrap_or(-1).max(0) as usize;
                    let (a, b) = alpha_beta(cluster, level(&[d.device as i64, to as i64]), 2, x);
                    let (down, flight) = (collective::host_copy(cluster, x), collective::p2p(x, a, b));
                    Work::Send { to, tag: s.tag(), micro, down, flight }
                }
                Op::Recv(r) => {
                    let from = r.peer.unwrap_or(-1).max(0) as usize;
                    Work::Recv { from, tag: r.tag(), micro, up: collective::host_copy(cluster, y) }
                }
                Op::Input { .. } | Op::Initializer(_) | Op::Constant(_) => Work::Compute(String::new(), 0.0),
                op if op.class() == OpClass::Comm => Work::Compute(String::new(), 0.0),
                op => {
                    let t = cm.op_time(n, &replicated);
                    let s = if cm.is_training_graph() { t.fwd + t.bwd + t.halo + t.stats } else { t.fwd + t.comm_fwd };
                    Work::Compute(op.op_type().to_string(), s)
                }
            }
        };
        let cut = Cut::new(p, d.device, &order, accumulate);
        // The values the once-per-step ops read from the micro-batches: summed on the device
        // after each micro-batch but the first (an element-wise Add: a dispatch, two reads and
        // a write), and the float ones scaled to their mean before the once-per-step ops (a
        // dispatch, a read and a write).
        let (summed, scaled) = {
            let mut seen = HashSet::new();
            let (mut add, mut scale) = (0.0, 0.0);
            for &n in order.iter().filter(|n| cut.once.contains(n)) {
                for v in g.node(n).inputs().iter().flatten() {
                    let from = &g.node(v.node).op;
                    let per_micro = !cut.once.contains(&v.node)
                        && !matches!(from, Op::Initializer(_) | Op::Input { .. } | Op::Constant(_));
                    if per_micro && seen.insert(*v) {
                        let b = bytes(Some(*v));
                        add += cm.launch() + cm.roofline(0.0, 3.0 * b);
                        if g.tensor_type(*v).is_some_and(|t| t.dtype.is_float()) {
                            scale += cm.launch() + cm.roofline(0.0, 2.0 * b);
                        }
                    }
                }
            }
            (add, scale)
        };
        let mut work = Vec::new();
        let mut finished = 0usize;
        for &(part, k) in &cut.items {
            let rerun = part == Part::Backward && cut.recompute;
            let passes: &[(Part, bool)] =
                if rerun { &[(Part::Forward, true), (part, false)] } else { &[(part, false)] };
            for &(pass, again) in passes {
                for &n in &order {
                    if !cut.runs_in(n, pass) || (again && matches!(g.node(n).op, Op::Send(_) | Op::Recv(_))) {
                        continue;
                    }
                    work.push(price(n, k));
                }
            }
            if Cut::finishes(part) {
                if accumulate && finished > 0 {
                    work.push(Work::Compute("accumulation".into(), summed));
                }
                finished += 1;
            }
        }
        if accumulate && finished > 1 {
            work.push(Work::Compute("accumulation".into(), scaled));
        }
        for &n in order.iter().filter(|n| cut.once.contains(n)) {
            work.push(price(n, usize::MAX));
        }
        plans.push(work);
    }
    play(&plans)
}

/// Runs the devices' work until every device is done: each goes on until it waits for a
/// message not yet sent or a collective not everyone has reached.
fn play(plans: &[Vec<Work>]) -> Result<Simulated, String> {
    let n = plans.len();
    let mut clock = vec![0.0f64; n];
    let mut waiting = vec![0.0f64; n];
    let mut pc = vec![0usize; n];
    // (from, to, tag, micro) → the time the message is there.
    let mut mail: HashMap<(usize, usize, i64, usize), Vec<f64>> = HashMap::new();
    // (group, its collective number) → each member's arrival.
    let mut met: HashMap<(Vec<i64>, usize), HashMap<usize, f64>> = HashMap::new();
    let mut seq: Vec<HashMap<Vec<i64>, usize>> = vec![HashMap::new(); n];
    let mut by_op: Vec<BTreeMap<String, f64>> = vec![BTreeMap::new(); n];
    let mut count = |d: usize, what: &str, t: f64| {
        if !what.is_empty() {
            *by_op[d].entry(what.to_string()).or_default() += t;
        }
    };
    loop {
        let mut progress = false;
        for d in 0..n {
            while let Some(w) = plans[d].get(pc[d]) {
                match w {
                    Work::Compute(what, t) => {
                        clock[d] += t;
                        count(d, what, *t);
                    }
                    Work::Send { to, tag, micro, down, flight } => {
                        clock[d] += down;
                        count(d, "Send", *down);
                        mail.entry((d, *to, *tag, *micro)).or_default().push(clock[d] + flight);
                    }
                    Work::Recv { from, tag, micro, up } => {
                        let Some(q) = mail.get_mut(&(*from, d, *tag, *micro)).filter(|q| !q.is_empty()) else { break };
                        let there = q.remove(0);
                        waiting[d] += (there - clock[d]).max(0.0);
                        clock[d] = clock[d].max(there) + up;
                        count(d, "Recv", *up);
                    }
                    Work::Collective { what, group, seconds } => {
                        if group.len() > 1 {
                            let k = *seq[d].get(group).unwrap_or(&0);
                            let arrived = met.entry((group.clone(), k)).or_default();
                            arrived.entry(d).or_insert(clock[d]);
                            if arrived.len() < group.len() {
                                break;
                            }
                            let start = arrived.values().copied().fold(0.0, f64::max);
                            waiting[d] += start - clock[d];
                            clock[d] = start + seconds;
                            count(d, what, *seconds);
                            seq[d].insert(group.clone(), k + 1);
                        }
                    }
                }
                pc[d] += 1;
                progress = true;
            }
        }
        if (0..n).all(|d| pc[d] >= plans[d].len()) {
            break;
        }
        if !progress {
            let stuck: Vec<String> = (0..n).filter(|&d| pc[d] < plans[d].len()).map(|d| d.to_string()).collect();
            return Err(format!("the program's devices {} wait for each other", stuck.join(", ")));
        }
    }
    Ok(Simulated { step_s: clock.iter().copied().fold(0.0, f64::max), devices: clock, waiting, by_op })
}
