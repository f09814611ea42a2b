//! The checker: proves a lowered program consistent before it runs.
//!
//! - Every device's graph verifies and its shapes infer.
//! - Feeds and results have the local shapes their layouts imply.
//! - The members of each collective group meet the same collectives, in the same order, on the
//!   same shapes; halo widths agree between neighbours.
//! - Every `Send` has its `Recv` (same tag, the receiver expects the sent shape) and the other
//!   way round.
//! - The program cannot deadlock: a simulation in which collectives complete when every
//!   member has reached them, receives when their send has been issued, and sends never
//!   block, runs every device to its end.

use std::collections::{BTreeMap, HashMap};

use ir::attr::AttrValue;
use ir::{Graph, NodeId, Op, OpClass, TensorType, Value};

use crate::cut::Cut;
use crate::layout::local_shape;
use crate::program::Program;
use crate::schedule::Part;

/// One finding of the checker: what is inconsistent, on which device and at which of its
/// nodes (when one is at fault).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckError {
    /// The device whose program is at fault.
    pub device: Option<usize>,
    /// The node of that device's graph at fault.
    pub node: Option<NodeId>,
    /// What is wrong (naming the devices involved).
    pub message: String,
}

impl CheckError {
    fn new(device: impl Into<Option<usize>>, node: impl Into<Option<NodeId>>, message: String) -> CheckError {
        CheckError { device: device.into(), node: node.into(), message }
    }
}

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// One communication op of a device, as the checker sees it.
#[derive(Clone, Debug, PartialEq)]
enum Event {
    /// A collective: kind, group, attributes that must agree, input shape.
    Collective { kind: String, group: Vec<i64>, key: String, shape: Vec<i64> },
    /// A send to `peer`.
    Send { peer: i64, tag: i64, shape: Vec<i64> },
    /// A receive from `peer`.
    Recv { peer: i64, tag: i64, shape: Vec<i64> },
}

/// Per group, per member: its collectives as (kind, attributes, shape), and their nodes.
type Sequences = BTreeMap<Vec<i64>, BTreeMap<usize, (Vec<CollectiveSig>, Vec<NodeId>)>>;
type CollectiveSig = (String, String, Vec<i64>);

/// A halo exchange's widths and its node.
type Halo = (Vec<i64>, NodeId);

fn ints(op: &Op, name: &str) -> Vec<i64> {
    op.attributes()
        .into_iter()
        .find(|a| a.name == name)
        .and_then(|a| if let AttrValue::Ints(v) = a.value { Some(v) } else { None })
        .unwrap_or_default()
}

fn int(op: &Op, name: &str) -> i64 {
    op.attributes()
        .into_iter()
        .find(|a| a.name == name)
        .and_then(|a| if let AttrValue::Int(v) = a.value { Some(v) } else { None })
        .unwrap_or(0)
}

fn shape_of(g: &Graph, v: Option<Value>) -> Vec<i64> {
    v.and_then(|v| g.tensor_type(v)).and_then(TensorType::static_dims).unwrap_or_default()
}

fn events(g: &Graph) -> Vec<(NodeId, Event)> {
    let mut out = Vec::new();
    for n in g.op_nodes().unwrap_or_default() {
        let node = g.node(n);
        if node.op.class() != OpClass::Comm {
            continue;
        }
        let op = &node.op;
        let e = match op {
            Op::Send(_) => {
                Event::Send { peer: int(op, "peer"), tag: int(op, "tag"), shape: shape_of(g, node.input(0)) }
            }
            Op::Recv(_) => Event::Recv { peer: int(op, "peer"), tag: int(op, "tag"), shape: ints(op, "shape") },
            _ => {
                // Attributes every member must agree on (halo widths differ by position and are
                // checked separately).
                let key: Vec<String> = op
                    .attributes()
                    .into_iter()
                    .filter(|a| a.name != "group" && a.name != "widths")
                    .map(|a| format!("{}={:?}", a.name, a.value))
                    .collect();
                let mut shape = shape_of(g, node.input(0));
                // Halo exchanges move blocks of different lengths along their axis.
                if let Op::HaloExchange(_) = op
                    && let Some(x) = shape.get_mut(int(op, "axis") as usize)
                {
                    *x = -1;
                }
                Event::Collective {
                    kind: op.op_type().to_string(),
                    group: ints(op, "group"),
                    key: key.join(","),
                    shape,
                }
            }
        };
        out.push((n, e));
    }
    out
}

/// Checks a program; the errors say what is inconsistent, and where.
pub fn check(p: &Program) -> Result<(), Vec<CheckError>> {
    let mut errors = Vec::new();
    let n_dev = p.devices.len();
    let mut per_device: Vec<Vec<(NodeId, Event)>> = Vec::with_capacity(n_dev);
    for (i, d) in p.devices.iter().enumerate() {
        if d.device != i {
            errors.push(CheckError::new(i, None, format!("device program {i} says it is device {}", d.device)));
        }
        if let Err(e) = ir::verify(&d.graph) {
            for x in e.0.iter().take(5) {
                errors.push(CheckError::new(i, x.at, format!("device {i}: {}", x.msg)));
            }
        }
        let mesh = &p.meshes[d.stage];
        for f in &d.feeds {
            let Some(global) = p.inputs.iter().find(|x| x.name == f.global) else {
                let msg = format!("device {i}: feed `{}` names no global input `{}`", f.local, f.global);
                errors.push(CheckError::new(i, None, msg));
                continue;
            };
            let want = local_shape(&micro_shape(p, &global.shape, global.batch_axis), &f.layout, mesh);
            let got = d.graph.lookup(&f.local).map(|v| shape_of(&d.graph, Some(v)));
            if got.map(|g| g.iter().map(|&x| x as usize).collect::<Vec<_>>()) != Some(want.clone()) {
                errors.push(CheckError::new(
                    i,
                    None,
                    format!("device {i}: input `{}` should be {want:?} for its layout", f.local),
                ));
            }
        }
        for r in &d.results {
            let Some(global) = p.outputs.iter().find(|x| x.name == r.global) else {
                errors.push(CheckError::new(
                    i,
                    None,
                    format!("device {i}: result `{}` names no global output", r.local),
                ));
                continue;
            };
            let want = local_shape(&micro_shape(p, &global.shape, global.batch_axis), &r.layout, mesh);
            let got = d.graph.lookup(&r.local).map(|v| shape_of(&d.graph, Some(v)));
            if got.map(|g| g.iter().map(|&x| x as usize).collect::<Vec<_>>()) != Some(want.clone()) {
                let msg = format!("device {i}: output `{}` should be {want:?} for its layout", r.local);
                errors.push(CheckError::new(i, None, msg));
            }
        }
        let ev = events(&d.graph);
        for (n, e) in &ev {
            if let Event::Collective { kind, group, .. } = e {
                if !group.contains(&(i as i64)) {
                    errors.push(CheckError::new(
                        i,
                        *n,
                        format!("device {i}: a {kind} over {group:?} does not include it"),
                    ));
                }
                if group.iter().any(|&x| x < 0 || x as usize >= n_dev) {
                    let msg = format!("device {i}: a {kind} names a device outside the program: {group:?}");
                    errors.push(CheckError::new(i, *n, msg));
                }
            }
        }
        per_device.push(ev);
    }
    // Collective sequences per group agree.
    let mut seqs: Sequences = BTreeMap::new();
    for (i, ev) in per_device.iter().enumerate() {
        for (n, e) in ev {
            if let Event::Collective { kind, group, key, shape } = e {
                let (sigs, nodes) = seqs.entry(group.clone()).or_default().entry(i).or_default();
                sigs.push((kind.clone(), key.clone(), shape.clone()));
                nodes.push(*n);
            }
        }
    }
    for (group, by_dev) in &seqs {
        let mut reference: Option<(usize, &Vec<CollectiveSig>)> = None;
        for &m in group {
            let list = by_dev.get(&(m as usize));
            let at = (m >= 0).then_some(m as usize);
            match (reference, list) {
                (_, None) => errors.push(CheckError::new(
                    at,
                    None,
                    format!("device {m} never joins the collectives of group {group:?}"),
                )),
                (None, Some((l, _))) => reference = Some((m as usize, l)),
                (Some((r, want)), Some((l, nodes))) => {
                    if l.len() != want.len() {
                        let msg = format!(
                            "group {group:?}: device {m} meets {} collectives, device {r} {}",
                            l.len(),
                            want.len()
                        );
                        errors.push(CheckError::new(at, nodes.get(want.len()).copied(), msg));
                    } else if let Some(k) = (0..l.len()).find(|&k| l[k] != want[k]) {
                        let msg = format!(
                            "group {group:?}: collective {k} is {:?} on device {m} but {:?} on device {r}",
                            l[k], want[k]
                        );
                        errors.push(CheckError::new(at, nodes[k], msg));
                    }
                }
            }
        }
    }
    // Halo widths agree between neighbours.
    let mut halos: HashMap<Vec<i64>, HashMap<usize, Vec<Halo>>> = HashMap::new();
    for (i, d) in p.devices.iter().enumerate() {
        for (n, e) in &per_device[i] {
            if let Event::Collective { kind, group, .. } = e
                && kind == "HaloExchange"
            {
                halos
                    .entry(group.clone())
                    .or_default()
                    .entry(i)
                    .or_default()
                    .push((ints(&d.graph.node(*n).op, "widths"), *n));
            }
        }
    }
    for (group, by_dev) in &halos {
        for w in 0..group.len().saturating_sub(1) {
            let (a, b) = (group[w] as usize, group[w + 1] as usize);
            let (Some(la), Some(lb)) = (by_dev.get(&a), by_dev.get(&b)) else { continue };
            for (k, ((x, _), (y, at))) in la.iter().zip(lb).enumerate() {
                if x.len() == 4 && y.len() == 4 && (x[3] != y[0] || y[2] != x[1]) {
                    let msg = format!(
                        "halo {k} of group {group:?}: device {a} sends {} / receives {} but device {b} expects {} / sends {}",
                        x[3], x[1], y[0], y[2]
                    );
                    errors.push(CheckError::new(b, *at, msg));
                }
            }
        }
    }
    // Sends and receives pair up.
    let mut sends: HashMap<(i64, i64, i64), (Vec<i64>, NodeId)> = HashMap::new();
    let mut recvs: HashMap<(i64, i64, i64), (Vec<i64>, NodeId)> = HashMap::new();
    for (i, ev) in per_device.iter().enumerate() {
        for (n, e) in ev {
            match e {
                Event::Send { peer, tag, shape } => {
                    sends.insert((i as i64, *peer, *tag), (shape.clone(), *n));
                }
                Event::Recv { peer, tag, shape } => {
                    recvs.insert((*peer, i as i64, *tag), (shape.clone(), *n));
                }
                _ => {}
            }
        }
    }
    let dev = |d: i64| usize::try_from(d).ok();
    for (k, (s, at)) in &sends {
        match recvs.get(k) {
            None => {
                let msg = format!("device {} sends tag {} to device {}, which never receives it", k.0, k.2, k.1);
                errors.push(CheckError::new(dev(k.0), *at, msg));
            }
            Some((r, rat)) if r != s => {
                let msg = format!("tag {} from device {} to {}: sent {s:?}, received {r:?}", k.2, k.0, k.1);
                errors.push(CheckError::new(dev(k.1), *rat, msg));
            }
            _ => {}
        }
    }
    for (k, (_, at)) in &recvs {
        if !sends.contains_key(k) {
            let msg = format!("device {} waits for tag {} from device {}, which never sends it", k.1, k.2, k.0);
            errors.push(CheckError::new(dev(k.1), *at, msg));
        }
    }
    if errors.is_empty()
        && let Err(e) = simulate(&scheduled(p, &per_device))
    {
        errors.push(CheckError::new(None, None, e));
    }
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

fn micro_shape(p: &Program, shape: &[usize], batch_axis: Option<usize>) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some(a) = batch_axis
        && p.micro_batches > 1
        && let Some(x) = s.get_mut(a)
    {
        *x /= p.micro_batches;
    }
    s
}

/// Each device's communication over one step, in the order its schedule runs it
/// ([`crate::schedule`]): per (part, micro-batch) the events of that part (a recomputed
/// forward part's collectives again before its backward part), then the once-per-step part;
/// each event with its micro-batch.
fn scheduled(p: &Program, per_device: &[Vec<(NodeId, Event)>]) -> Vec<Vec<(NodeId, Event, usize)>> {
    let m = p.micro_batches.max(1);
    let mut out = Vec::with_capacity(per_device.len());
    // Gradients are accumulated when a training step (a program with optimizer updates) runs
    // several micro-batches or stages.
    let trains = p
        .devices
        .iter()
        .any(|d| d.graph.op_nodes().unwrap_or_default().iter().any(|&n| d.graph.node(n).op.is_update()));
    let accumulate = crate::cut::accumulates(p, trains);
    let mut once = crate::cut::once_per_device(p, accumulate);
    for (i, ev) in per_device.iter().enumerate() {
        let g = &p.devices[i].graph;
        let order = g.op_nodes().unwrap_or_default();
        let cut = Cut::new(p, i, &order, std::mem::take(&mut once[i]));
        let mut list = Vec::new();
        for &it in &cut.items {
            let (c, k) = (it.chunk, it.micro);
            if cut.reruns(it) {
                list.extend(
                    ev.iter()
                        .filter(|(n, e)| cut.runs_in(*n, Part::Forward, c) && matches!(e, Event::Collective { .. }))
                        .map(|(n, e)| (*n, e.clone(), k)),
                );
            }
            list.extend(ev.iter().filter(|(n, _)| cut.runs_in(*n, it.part, c)).map(|(n, e)| (*n, e.clone(), k)));
        }
        list.extend(ev.iter().filter(|(n, _)| cut.once.contains(n)).map(|(n, e)| (*n, e.clone(), m)));
        out.push(list);
    }
    out
}

/// Runs the communication schedule: `Err` names the devices stuck and what they wait for.
fn simulate(per_device: &[Vec<(NodeId, Event, usize)>]) -> Result<(), String> {
    let n = per_device.len();
    let mut pos = vec![0usize; n];
    let mut sent: std::collections::HashSet<(usize, i64, i64, usize)> = Default::default();
    // How many collectives each device has completed per group.
    let mut done: Vec<HashMap<Vec<i64>, usize>> = vec![HashMap::new(); n];
    loop {
        let mut progress = false;
        for i in 0..n {
            while let Some((_, e, k)) = per_device[i].get(pos[i]) {
                match e {
                    Event::Send { peer, tag, .. } => {
                        sent.insert((i, *peer, *tag, *k));
                        pos[i] += 1;
                        progress = true;
                    }
                    Event::Recv { peer, tag, .. } => {
                        if sent.contains(&(*peer as usize, i as i64, *tag, *k)) {
                            pos[i] += 1;
                            progress = true;
                        } else {
                            break;
                        }
                    }
                    Event::Collective { group, .. } => {
                        let k = done[i].get(group).copied().unwrap_or(0);
                        // Every member at its k-th collective of this group.
                        let ready = group.iter().all(|&m| {
                            let m = m as usize;
                            m < n && done[m].get(group).copied().unwrap_or(0) == k && {
                                matches!(per_device[m].get(pos[m]), Some((_, Event::Collective { group: g2, .. }, _)) if g2 == group)
                            }
                        });
                        if ready {
                            for &m in group {
                                let m = m as usize;
                                *done[m].entry(group.clone()).or_insert(0) += 1;
                                pos[m] += 1;
                            }
                            progress = true;
                        } else {
                            break;
                        }
                    }
                }
            }
        }
        if (0..n).all(|i| pos[i] >= per_device[i].len()) {
            return Ok(());
        }
        if !progress {
            let stuck: Vec<String> = (0..n)
                .filter(|&i| pos[i] < per_device[i].len())
                .map(|i| {
                    format!("device {i} at {:?} of micro-batch {}", per_device[i][pos[i]].1, per_device[i][pos[i]].2)
                })
                .collect();
            return Err(format!("the program deadlocks: {}", stuck.join("; ")));
        }
    }
}
