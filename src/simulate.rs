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
//! op replicated over a mesh of all the program's devices. Where devices share a host
//! ([`passes::cost::Cluster`]'s `shared_host`: the runtime's simulated devices) a kernel runs
//! at the host's throughput divided among the devices running kernels at that moment, which
//! in a pipeline's fill and drain, or while others wait for a message or a collective, are
//! fewer than all: each op is priced at every count ([`CostModel::with_busy`]) and the step
//! is played as events, an op's progress at each moment at the rate of the count then.
//! Collectives are priced as the plan's
//! steps are ([`passes::cost::collective`]: the ring over the group's link, the host copies
//! around it where devices stage through the host), for the devices communicating or
//! running kernels when the collective starts (its group's and the others computing or
//! copying then: on a shared host they share its cores); a send costs its sender the copy
//! down, its receiver the copy up, and the message the link between them.
//!
//! Pipelines are what this is for: the plan prices a pipeline from its forward model's
//! stages and a closed-form schedule, while the runtime runs the stages' lowered training
//! programs, micro-batch by micro-batch.

use std::collections::{BTreeMap, HashMap, HashSet};

use codegen::Program;
use codegen::cut::{Cut, accumulates};
use codegen::schedule::Part;
use ir::shard::LinkLevel;
use ir::{NodeId, Op, OpClass, Value};
use passes::cost::collective::{self, alpha_beta};
use passes::cost::{Cluster, CostModel, Options};

/// What one device does next.
#[derive(Clone, Debug)]
enum Work {
    /// A kernel or a local sum (what: its op type): seconds with `k` devices running kernels
    /// at once at index `k − 1`.
    Compute(String, Vec<f64>),
    /// A message to `to` (tag, micro-batch): `down` seconds the sender is busy with it
    /// (copying it to the host; on one host, into the receiver's buffer too), then `flight`
    /// seconds on the link.
    Send { to: usize, tag: i64, micro: usize, down: f64, flight: f64 },
    /// The message from `from` (tag, micro-batch), then `up` seconds of copying it to the
    /// device.
    Recv { from: usize, tag: i64, micro: usize, up: f64 },
    /// A collective (what: its op type) over `group` taking, once every member is there,
    /// `seconds` with `k` devices communicating or running kernels at once at index `k − 1`
    /// (on devices sharing a host they share its cores).
    Collective { what: &'static str, group: Vec<i64>, seconds: Vec<f64> },
}

/// The simulated step.
#[derive(Clone, Debug)]
pub struct Simulated {
    /// Seconds until the last device finishes, all devices starting the step together.
    pub step_s: f64,
    /// Seconds per step of steps run back to back, as the runtime runs them: each device
    /// starts its next step when it is through the last, with no barrier between steps, so
    /// one stage's tail (a last backward, an update) overlaps the other stages' next step.
    /// The makespan of three steps less that of one, halved.
    pub period_s: f64,
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
    let mut once = codegen::cut::once_per_device(p, accumulate);
    for d in &p.devices {
        let g = &d.graph;
        let order = g.topo_order().map_err(|_| format!("device {}: the graph has a cycle", d.device))?;
        // The model with 1, 2, … all devices running kernels at once, and each collective's
        // price with as many communicating or computing (only one count where devices do
        // not share a host: there they are all the same).
        let counts = if cluster.device.shared_host { total } else { 1 };
        let cms: Vec<CostModel> =
            (1..=counts).map(|k| CostModel::new(g, cluster, mesh.clone(), opts.clone()).with_busy(k)).collect();
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
                let at = |k: usize| {
                    if p <= 1 {
                        return 0.0;
                    }
                    let (a, b) = alpha_beta(cluster, level(&grp), p, k, n_bytes);
                    f(n_bytes, p, a, b) + collective::staging(cluster, down, up, k)
                };
                let seconds = (1..=counts).map(at).collect();
                Work::Collective { what, group: grp, seconds }
            };
            match &node.op {
                Op::AllReduce(c) => ring("AllReduce", &c.group, collective::all_reduce, x, x, x),
                Op::AllGather(c) => ring("AllGather", &c.group, collective::all_gather, y, x, y),
                Op::ReduceScatter(c) => ring("ReduceScatter", &c.group, collective::reduce_scatter, x, x, y),
                Op::AllToAll(c) => ring("AllToAll", &c.group, collective::all_to_all, x, x, y),
                Op::HaloExchange(c) => {
                    let grp = group(&c.group);
                    let at = |k: usize| {
                        if grp.len() <= 1 {
                            return 0.0;
                        }
                        let moved = (y - x).max(0.0);
                        let (a, b) = alpha_beta(cluster, level(&grp), 2, k, moved);
                        collective::p2p(moved, a, b) + collective::staging(cluster, x, y, k)
                    };
                    let seconds = (1..=counts).map(at).collect();
                    Work::Collective { what: "HaloExchange", group: grp, seconds }
                }
                Op::Send(s) => {
                    let to = s.peer.unwrap_or(-1).max(0) as usize;
                    let down = collective::host_copy(cluster, x, total);
                    let flight = collective::message(cluster, level(&[d.device as i64, to as i64]), x, total);
                    // Devices of one host: the sender copies the message into the receiver's
                    // buffer itself; elsewhere it is on the link while the sender goes on.
                    let (down, flight) =
                        if collective::in_host_memory(cluster) { (down + flight, 0.0) } else { (down, flight) };
                    Work::Send { to, tag: s.tag(), micro, down, flight }
                }
                Op::Recv(r) => {
                    let from = r.peer.unwrap_or(-1).max(0) as usize;
                    Work::Recv { from, tag: r.tag(), micro, up: collective::host_copy(cluster, y, total) }
                }
                Op::Input { .. } | Op::Initializer(_) | Op::Constant(_) => Work::Compute(String::new(), vec![0.0]),
                op if op.class() == OpClass::Comm => Work::Compute(String::new(), vec![0.0]),
                _ => {
                    let at = |cm: &CostModel| {
                        let t = cm.op_time(n, &replicated);
                        if cm.is_training_graph() { t.fwd + t.bwd + t.halo + t.stats } else { t.fwd + t.comm_fwd }
                    };
                    Work::Compute(cms[0].kernel_kind(n), cms.iter().map(at).collect())
                }
            }
        };
        let cut = Cut::new(p, d.device, &order, std::mem::take(&mut once[d.device]));
        // The values the once-per-step ops read from the micro-batches: summed on the device
        // after each micro-batch but the first (an element-wise Add: a dispatch, two reads and
        // a write), and the float ones scaled to their mean before the once-per-step ops (a
        // dispatch, a read and a write).
        let (summed, scaled) = {
            let mut seen = HashSet::new();
            let (mut add, mut scale) = (vec![0.0; cms.len()], vec![0.0; cms.len()]);
            for &n in order.iter().filter(|n| cut.once.contains(n)) {
                for v in g.node(n).inputs().iter().flatten() {
                    let from = &g.node(v.node).op;
                    let per_micro = !cut.once.contains(&v.node)
                        && !matches!(from, Op::Initializer(_) | Op::Input { .. } | Op::Constant(_));
                    if per_micro && seen.insert(*v) {
                        let b = bytes(Some(*v));
                        let float = g.tensor_type(*v).is_some_and(|t| t.dtype.is_float());
                        for (k, cm) in cms.iter().enumerate() {
                            add[k] += cm.launch() + cm.roofline(0.0, 3.0 * b);
                            if float {
                                scale[k] += cm.launch() + cm.roofline(0.0, 2.0 * b);
                            }
                        }
                    }
                }
            }
            (add, scale)
        };
        let mut work = Vec::new();
        let mut finished = 0usize;
        for (idx, &it) in cut.items.iter().enumerate() {
            let (part, k) = (it.part, it.micro);
            let passes: &[(Part, bool)] =
                if cut.reruns(it) { &[(Part::Forward, true), (part, false)] } else { &[(part, false)] };
            for &(pass, again) in passes {
                for &n in &order {
                    if !cut.runs_in(n, pass, it.chunk) || (again && matches!(g.node(n).op, Op::Send(_) | Op::Recv(_))) {
                        continue;
                    }
                    work.push(price(n, k));
                }
            }
            if cut.last[idx] {
                if accumulate && finished > 0 {
                    work.push(Work::Compute("accumulation".into(), summed.clone()));
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
    play_steps(&plans)
}

/// [`play`] for one step, with the period of steps run back to back (see
/// [`Simulated::period_s`]).
fn play_steps(plans: &[Vec<Work>]) -> Result<Simulated, String> {
    let mut one = play(plans)?;
    let three: Vec<Vec<Work>> = plans.iter().map(|w| [w.as_slice(), w, w].concat()).collect();
    let three = play(&three)?;
    one.period_s = (three.step_s - one.step_s) / 2.0;
    Ok(one)
}

/// What a device is doing.
#[derive(Clone, Copy, Debug)]
enum State {
    /// Ready for its next work.
    Idle,
    /// Running a kernel with this fraction of it left, started at that time.
    Computing { left: f64, since: f64 },
    /// Copying or on a link until that time.
    Busy { until: f64 },
    /// Waiting for a message or for the other members of a collective.
    Blocked,
    /// Through its work.
    Done,
}

/// Plays the devices' work as events: a device takes its next work when it is ready; a
/// kernel progresses at the rate of the number of devices running kernels at each moment
/// (its price at that count); a send copies its message down and puts it on the link; a
/// receive waits for its message and copies it up; a collective starts when its group's
/// last member reaches it and ends for all of them together.
fn play(plans: &[Vec<Work>]) -> Result<Simulated, String> {
    let n = plans.len();
    let mut now = 0.0f64;
    let mut state = vec![State::Idle; n];
    let mut finish = vec![0.0f64; n];
    let mut waiting = vec![0.0f64; n];
    let mut blocked_since = vec![0.0f64; n];
    let mut pc = vec![0usize; n];
    // (from, to, tag, micro) → the times its messages are there, in order.
    let mut mail: HashMap<(usize, usize, i64, usize), Vec<f64>> = HashMap::new();
    // (group, its collective number) → the members there.
    let mut met: HashMap<(Vec<i64>, usize), HashSet<usize>> = HashMap::new();
    let mut seq: Vec<HashMap<Vec<i64>, usize>> = vec![HashMap::new(); n];
    let mut by_op: Vec<BTreeMap<String, f64>> = vec![BTreeMap::new(); n];
    let price = |d: usize, pc: usize, k: usize| match &plans[d][pc] {
        Work::Compute(_, by_k) => by_k[k.clamp(1, by_k.len()) - 1],
        _ => 0.0,
    };
    loop {
        // Every ready device takes work until it computes, is busy or blocks.
        let mut changed = true;
        while changed {
            changed = false;
            for d in 0..n {
                loop {
                    if !matches!(state[d], State::Idle | State::Blocked) {
                        break;
                    }
                    let Some(w) = plans[d].get(pc[d]) else {
                        state[d] = State::Done;
                        finish[d] = now;
                        break;
                    };
                    let was_blocked = matches!(state[d], State::Blocked);
                    let mut next = State::Idle;
                    match w {
                        Work::Compute(what, by_k) => {
                            if by_k.iter().all(|&t| t <= 0.0) {
                                by_op[d].entry(what.clone()).or_default();
                            } else {
                                next = State::Computing { left: 1.0, since: now };
                            }
                        }
                        Work::Send { to, tag, micro, down, flight } => {
                            *by_op[d].entry("Send".into()).or_default() += down;
                            mail.entry((d, *to, *tag, *micro)).or_default().push(now + down + flight);
                            next = State::Busy { until: now + down };
                        }
                        Work::Recv { from, tag, micro, up } => {
                            let Some(q) = mail.get_mut(&(*from, d, *tag, *micro)).filter(|q| !q.is_empty()) else {
                                if !was_blocked {
                                    blocked_since[d] = now;
                                }
                                state[d] = State::Blocked;
                                break;
                            };
                            let there = q.remove(0);
                            let since = if was_blocked { blocked_since[d] } else { now };
                            waiting[d] += there.max(now) - since;
                            *by_op[d].entry("Recv".into()).or_default() += up;
                            next = State::Busy { until: there.max(now) + up };
                        }
                        Work::Collective { what, group, seconds } => {
                            if group.len() > 1 {
                                let k = *seq[d].get(group).unwrap_or(&0);
                                let there = met.entry((group.clone(), k)).or_default();
                                if !was_blocked {
                                    there.insert(d);
                                    blocked_since[d] = now;
                                }
                                if there.len() < group.len() {
                                    state[d] = State::Blocked;
                                    break;
                                }
                                // The last member: everyone starts now, sharing the host with
                                // the devices computing or copying meanwhile.
                                let members: Vec<usize> = there.iter().copied().collect();
                                met.remove(&(group.clone(), k));
                                let others = (0..n)
                                    .filter(|o| !members.contains(o))
                                    .filter(|&o| matches!(state[o], State::Computing { .. } | State::Busy { .. }))
                                    .count();
                                let at_once = (members.len() + others).clamp(1, seconds.len().max(1));
                                let seconds = seconds.get(at_once - 1).copied().unwrap_or(0.0);
                                for m in members {
                                    waiting[m] += now - blocked_since[m];
                                    *by_op[m].entry(what.to_string()).or_default() += seconds;
                                    seq[m].insert(group.clone(), k + 1);
                                    pc[m] += 1;
                                    state[m] = State::Busy { until: now + seconds };
                                }
                                changed = true;
                                break;
                            }
                        }
                    }
                    pc[d] += 1;
                    state[d] = next;
                    changed = true;
                }
            }
        }
        if state.iter().all(|s| matches!(s, State::Done)) {
            break;
        }
        // The next event: a kernel finishing at the current count, or a copy or link ending.
        let k = state.iter().filter(|s| matches!(s, State::Computing { .. })).count();
        let mut next = f64::INFINITY;
        for d in 0..n {
            match state[d] {
                State::Computing { left, .. } => next = next.min(now + left * price(d, pc[d] - 1, k)),
                State::Busy { until } => next = next.min(until),
                _ => {}
            }
        }
        if !next.is_finite() {
            let stuck: Vec<String> =
                (0..n).filter(|&d| matches!(state[d], State::Blocked)).map(|d| d.to_string()).collect();
            return Err(format!("the program's devices {} wait for each other", stuck.join(", ")));
        }
        let dt = next - now;
        now = next;
        for d in 0..n {
            match state[d] {
                State::Computing { left, since } => {
                    // Work priced at nothing at this concurrency (a fused group's member) ends
                    // at once, and so does work whose rest is too short to move the clock.
                    let t = price(d, pc[d] - 1, k);
                    let left = if t > 0.0 { left - dt / t } else { 0.0 };
                    if left <= 1e-9 || now + left * t <= now {
                        if let Work::Compute(what, _) = &plans[d][pc[d] - 1] {
                            *by_op[d].entry(what.clone()).or_default() += now - since;
                        }
                        state[d] = State::Idle;
                    } else {
                        state[d] = State::Computing { left, since };
                    }
                }
                State::Busy { until } if until <= now => state[d] = State::Idle,
                _ => {}
            }
        }
    }
    by_op.iter_mut().for_each(|m| m.retain(|k, _| !k.is_empty()));
    let step_s = finish.iter().copied().fold(0.0, f64::max);
    Ok(Simulated { step_s, period_s: step_s, devices: finish, waiting, by_op })
}

#[cfg(test)]
mod tests {
    use super::{Work, play, play_steps};

    fn compute(what: &str, alone: f64) -> Work {
        // Twice as long with two devices running kernels.
        Work::Compute(what.into(), vec![alone, 2.0 * alone])
    }

    #[test]
    fn kernels_share_the_host_only_while_both_run() {
        // Both run a 1 s kernel at half speed (2 s); then device 1's second kernel runs alone.
        let s = play(&[vec![compute("a", 1.0)], vec![compute("b", 1.0), compute("c", 1.0)]]).unwrap();
        assert_eq!(s.devices, vec![2.0, 3.0]);
        assert_eq!(s.by_op[1]["b"], 2.0);
        assert_eq!(s.by_op[1]["c"], 1.0);
        // Kernels that follow each other on one device share with the other's throughout: the
        // 1.5 s kernel and the 0.5 s and 1 s ones both end at 3 s, each at half speed.
        let s = play(&[vec![compute("a", 1.5)], vec![compute("w", 0.5), compute("b", 1.0)]]).unwrap();
        assert_eq!(s.devices, vec![3.0, 3.0]);
        assert_eq!((s.by_op[1]["w"], s.by_op[1]["b"]), (1.0, 2.0));
        // One finishing first leaves the other the host: 1 s together (0.5 s of each done),
        // then the 2 s kernel's remaining 1.5 s alone.
        let s = play(&[vec![compute("a", 0.5)], vec![compute("b", 2.0)]]).unwrap();
        assert_eq!(s.devices, vec![1.0, 2.5]);
    }

    #[test]
    fn work_priced_at_nothing_at_some_concurrency_ends_at_once() {
        // Device 0's second kernel costs nothing while both run (a fused group's member whose
        // saving exceeds its price) and 1 s alone: it ends as it starts, beside device 1's
        // kernel (2 s for `a`, `m` at once, 1 s for `b`; `c` has 2.5 s of its 4 left at 3 s).
        let s = play(&[
            vec![compute("a", 1.0), Work::Compute("m".into(), vec![1.0, 0.0]), compute("b", 0.5)],
            vec![compute("c", 4.0)],
        ])
        .unwrap();
        assert_eq!(s.devices, vec![3.0, 5.5]);
        assert_eq!(s.by_op[0]["m"], 0.0);
        // Work too short to move the clock after a long one ends too.
        let s =
            play(&[vec![compute("a", 1e6), Work::Compute("m".into(), vec![1e-12, 1e-12]), compute("b", 1.0)]]).unwrap();
        assert_eq!(s.devices, vec![1e6 + 1.0]);
    }

    #[test]
    fn a_receiver_waits_while_the_sender_computes_alone() {
        // Device 1 waits for device 0's message, so device 0 computes alone (1 s); the copy
        // down (0.5 s) and the link (0.25 s) bring the message at 1.75 s, the copy up takes
        // 0.5 s, and device 1 then computes alone.
        let s = play(&[
            vec![compute("x", 1.0), Work::Send { to: 1, tag: 7, micro: 0, down: 0.5, flight: 0.25 }],
            vec![Work::Recv { from: 0, tag: 7, micro: 0, up: 0.5 }, compute("y", 1.0)],
        ])
        .unwrap();
        assert_eq!(s.devices, vec![1.5, 3.25]);
        assert_eq!(s.waiting, vec![0.0, 1.75]);
        // Back to back, device 1's step overlaps device 0's next one: with kernels that do
        // not slow each other, a step every 1.5 s (device 0's kernel and copy down), not
        // every 3.25 s; with kernels sharing the host, device 0's next kernel runs beside
        // device 1's at half speed for a while (1.875 s).
        let pair = |k: fn(&str, f64) -> Work| {
            play_steps(&[
                vec![k("x", 1.0), Work::Send { to: 1, tag: 7, micro: 0, down: 0.5, flight: 0.25 }],
                vec![Work::Recv { from: 0, tag: 7, micro: 0, up: 0.5 }, k("y", 1.0)],
            ])
            .unwrap()
        };
        let apart = pair(|w, t| Work::Compute(w.into(), vec![t, t]));
        assert_eq!((apart.step_s, apart.period_s), (3.25, 1.5));
        let shared = pair(compute);
        assert_eq!((shared.step_s, shared.period_s), (3.25, 1.875));
        // Busy and waiting make up each device's time.
        for d in 0..2 {
            assert!((s.by_op[d].values().sum::<f64>() + s.waiting[d] - s.devices[d]).abs() < 1e-12);
        }
        // A collective starts when the last member arrives, and ends for both together.
        let ar = || Work::Collective { what: "AllReduce", group: vec![0, 1], seconds: vec![0.5, 0.5] };
        let s = play(&[vec![compute("x", 1.0), ar()], vec![ar()]]).unwrap();
        assert_eq!(s.devices, vec![1.5, 1.5]);
        assert_eq!(s.waiting, vec![0.0, 1.0]);
        // A receive nobody sends to is a deadlock, said.
        let e = play(&[vec![Work::Recv { from: 1, tag: 0, micro: 0, up: 0.0 }], vec![]]).unwrap_err();
        assert!(e.contains("wait for each other"), "{e}");
    }
}
