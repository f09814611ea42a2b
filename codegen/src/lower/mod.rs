//! Lowering: from a graph and a placement to one graph per device on local shapes, with every
//! resharding written out as communication.
//!
//! Per device, ops are emitted in the global topological order, so every device meets the
//! collectives of a group in the same order. For each op:
//! - its inputs are brought to the layouts its strategy needs: graph inputs and parameters
//!   arrive as the device's piece; a tensor computed in another layout is resharded by the
//!   steps of the one resharding algebra ([`ir::reshard`], the steps the cost model prices);
//!   a tensor from another pipeline stage arrives by `Recv`;
//! - the op runs on its local shapes, in the way its split demands ([`ir::ops::split::split_mode`], the mode the cost model prices):
//!   [`direct`] (shape literals made local, a split reduction's bias kept once, means
//!   rescaled), [`halo`] (a split window exchanges rows with its neighbours and pads only at
//!   the tensor's borders), [`stats`] (softmax and layer norm over a split dim all-reduce
//!   their statistics), [`vocab`] (an embedding split by rows gathers the rows it holds, as
//!   partial sums);
//! - an op whose strategy this lowering cannot express runs replicated instead (its inputs
//!   gathered, its outputs resharded back to the planned layouts) and is reported;
//! - graph outputs are delivered reduced, cut only along their batch dims
//!   ([`ir::reshard::output_layout`]), as the plan prices them.
//!
//! Micro-batches: with `m` micro-batches every device's program computes one micro-batch;
//! dims that carry the batch ([`ir::dims::batch_dims`]) are divided by `m`.

mod direct;
mod experts;
mod halo;
mod local;
mod ring;
mod stats;
mod vocab;

use std::collections::HashMap;

use ir::ops::split::{SplitMode, split_mode};
use ir::shard::{AxisShard, IterSpace, Mesh, Sharding, iter_space, strategy_shardings};
use ir::{Graph, NodeId, Op, Value};

use crate::program::{DeviceProgram, GlobalValue, Placement, Program, Result_};
use local::{Local, Shared};

/// What went wrong.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LowerErrorKind {
    /// The graph is not ready (shapes not static, weights unreadable, a cycle).
    Graph,
    /// The placement does not fit the graph.
    Placement,
    /// A device's local program does not type.
    LocalShapes,
}

/// A lowering failure, with the device and node it concerns when there is one.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}{}{message}", .device.map(|d| format!("device {d}: ")).unwrap_or_default(), .node.as_ref().map(|n| format!("{n}: ")).unwrap_or_default())]
pub struct LowerError {
    /// The device whose program failed.
    pub device: Option<usize>,
    /// The node of the global graph, described.
    pub node: Option<String>,
    /// What kind of failure.
    pub kind: LowerErrorKind,
    /// What is wrong.
    pub message: String,
}

impl LowerError {
    fn global(kind: LowerErrorKind, message: impl Into<String>) -> LowerError {
        LowerError { device: None, node: None, kind, message: message.into() }
    }
}

fn describe(sp: &IterSpace, s: &[Option<usize>], mesh: &Mesh) -> String {
    let parts: Vec<String> = s
        .iter()
        .enumerate()
        .filter_map(|(a, d)| d.map(|i| format!("{}→{}", sp.dims[i].name, mesh.axes[a].name)))
        .collect();
    if parts.is_empty() { "replicated".into() } else { parts.join(", ") }
}

/// Emits node `n` on device `l`.
fn lower_op(l: &mut Local<'_>, n: NodeId) -> Result<(), LowerError> {
    let g = l.g;
    let node = g.node(n);
    let axes = l.mesh.axes.len();
    // An op computed from constants runs replicated on the stages other than its own.
    let own = l.sh.placement.stage_of.get(&n).copied().unwrap_or(0) == l.stage;
    let mut s = match l.sh.placement.strategies.get(&n) {
        Some(s) if own => s.clone(),
        _ => vec![None; axes],
    };
    if s.len() != axes {
        return Err(l.err(
            Some(n),
            LowerErrorKind::Placement,
            format!("the strategy has {} axes, the mesh {axes}", s.len()),
        ));
    }
    let sp = iter_space(g, n);
    if s.iter().flatten().any(|&i| i >= sp.dims.len()) {
        return Err(l.err(
            Some(n),
            LowerErrorKind::Placement,
            "the strategy names an iteration dim the op does not have",
        ));
    }
    let planned = s.clone();
    let (_, planned_outs) = strategy_shardings(&sp, &planned);
    let m = match split_mode(g, n, &sp, &s, l.mesh) {
        Ok(m) => m,
        Err(why) => {
            // A placement from outside the search (a plan file, a user) may ask for a split
            // no rule expresses: the op runs replicated and the fallback is reported.
            let msg = format!("{} ({}): {why}", g.describe(n), describe(&sp, &planned, l.mesh));
            if !l.fallbacks.contains(&msg) {
                l.fallbacks.push(msg);
            }
            s = vec![None; axes];
            SplitMode::Direct
        }
    };
    let (ins, outs) = strategy_shardings(&sp, &s);
    let replicated: Sharding = vec![AxisShard::Replicate; axes];
    let mut local_in: Vec<Option<Value>> = Vec::with_capacity(node.inputs().len());
    for (j, v) in node.inputs().iter().enumerate() {
        match v {
            None => local_in.push(None),
            Some(v) => {
                let need = ins.get(j).cloned().flatten().unwrap_or_else(|| replicated.clone());
                local_in.push(Some(l.get(*v, &need)?));
            }
        }
    }
    // Values the op's subgraphs read from this graph, replicated: control flow runs whole.
    let mut local_caps: Vec<Value> = Vec::with_capacity(node.captures().len());
    for &c in node.captures() {
        local_caps.push(l.get(c, &replicated)?);
    }
    let out_names: Vec<String> =
        node.outputs().iter().map(|o| if o.name.is_empty() { String::new() } else { l.fresh(&o.name) }).collect();
    let outs_local: Vec<Value> = match m {
        SplitMode::Direct => direct::emit(l, n, &sp, &s, local_in, &out_names)?,
        SplitMode::Halo(splits) => halo::emit(l, n, &sp, &s, &splits, local_in, &out_names)?,
        SplitMode::Softmax { log, axes: stat } => {
            let x = local_in[0].ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "softmax without an input"))?;
            vec![stats::softmax(l, n, &s, x, log, &stat, &out_names[0])?]
        }
        SplitMode::LayerNorm { axis } => vec![stats::layer_norm(l, n, &sp, &s, &local_in, axis, &out_names[0])?],
        SplitMode::VocabGather => vec![vocab::emit(l, n, &sp, &s, &local_in, &out_names[0])?],
        SplitMode::Experts { ids, weight } => {
            let local_in = experts::shift_ids(l, n, &sp, &s, local_in, ids, weight)?;
            direct::emit(l, n, &sp, &s, local_in, &out_names)?
        }
        SplitMode::Loss { ignore_index } => stats::mean_loss(l, n, &s, local_in, ignore_index, &out_names)?,
        SplitMode::BatchNorm { stat, grad } => stats::batch_norm(l, n, &s, &local_in, &stat, grad, &out_names)?,
        SplitMode::Ring { axis } => ring::emit(l, n, &sp, &s, axis, &local_in, &out_names)?,
        SplitMode::Dispatch { axis, capacity } => experts::dispatch(l, n, axis, capacity, &local_in, &out_names)?,
    };
    if !local_caps.is_empty()
        && let Some(id) = outs_local.first().map(|v| v.node)
    {
        // The subgraphs name what they read; the local copies may be named otherwise.
        let renames: HashMap<String, String> = node
            .captures()
            .iter()
            .zip(&local_caps)
            .map(|(c, lc)| (g.value_name(*c).to_string(), l.lg.value_name(*lc).to_string()))
            .filter(|(a, b)| a != b)
            .collect();
        if !renames.is_empty() {
            let mut op = l.lg.node(id).op.clone();
            op.rename_outer_refs(&renames);
            l.lg.set_op(id, op);
        }
        l.lg.set_captures(id, local_caps);
    }
    // Record outputs; a replicated fallback is resharded back to the planned layouts.
    for (slot, x) in outs_local.into_iter().enumerate() {
        let v = Value::new(n, slot as u16);
        if node.outputs()[slot].name.is_empty() {
            continue;
        }
        let (got, want) = (outs[slot].clone(), planned_outs[slot].clone());
        l.have.insert((v, got.clone()), x);
        if got != want {
            let y = l.reshard(v, x, &got, &want)?;
            l.have.insert((v, want.clone()), y);
        }
        l.produced.insert(v, want);
    }
    Ok(())
}

/// Per op output: its stage and the tag of its pipeline messages; the ops every stage
/// computes for itself.
type StageMaps = (HashMap<Value, usize>, HashMap<Value, i64>, std::collections::HashSet<NodeId>);

/// Stage and message tag of every op output, and the ops every stage computes itself
/// instead of receiving them ([`ir::reshard::computed_everywhere`]).
///
/// A stage may read any other stage's values: a training step's backward part reads the
/// gradient from the next stage. The checker simulates the schedule, so a placement whose
/// stages wait on each other is refused there.
fn stages(g: &Graph, order: &[NodeId], placement: &Placement) -> Result<StageMaps, LowerError> {
    let mut stage_of_value: HashMap<Value, usize> = HashMap::new();
    let mut value_tag: HashMap<Value, i64> = HashMap::new();
    let everywhere =
        if placement.stages.len() > 1 { ir::reshard::computed_everywhere(g, order) } else { Default::default() };
    for &n in order {
        let st = placement.stage_of.get(&n).copied().unwrap_or(0);
        if st >= placement.stages.len() {
            return Err(LowerError {
                device: None,
                node: Some(g.describe(n)),
                kind: LowerErrorKind::Placement,
                message: format!("in stage {st}, of {}", placement.stages.len()),
            });
        }
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            stage_of_value.insert(v, st);
            value_tag.insert(v, value_tag.len() as i64);
        }
    }
    for (i, s) in placement.stages.iter().enumerate() {
        if s.mesh.devices() != s.devices.len() {
            return Err(LowerError::global(
                LowerErrorKind::Placement,
                format!("stage {i}: the mesh has {} devices, {} given", s.mesh.devices(), s.devices.len()),
            ));
        }
    }
    Ok((stage_of_value, value_tag, everywhere))
}

/// Lowers `g` (full batch, shapes static and inferred) under `placement`.
pub fn lower(g: &Graph, placement: &Placement) -> Result<Program, LowerError> {
    let order = g.op_nodes().map_err(|_| LowerError::global(LowerErrorKind::Graph, "the graph has a cycle"))?;
    if placement.stages.is_empty() {
        return Err(LowerError::global(LowerErrorKind::Placement, "no stages"));
    }
    // An op outside the op table cannot run: say which, where.
    if let Some(l) = unsupported_op(g) {
        return Err(LowerError { device: None, node: l.0, kind: LowerErrorKind::Graph, message: l.1 });
    }
    let (stage_of_value, value_tag, everywhere) = stages(g, &order, placement)?;
    let batch = ir::dims::batch_dims(g);
    let cuts = ir::reshard::output_cuts(g, &batch);
    let m = placement.micro_batches.max(1);
    // A weight held in several stages (tied): its new value goes from the stage that updates
    // it to the others, which carry it too.
    let mut deliver: HashMap<Value, Vec<usize>> = HashMap::new();
    for (next, state) in ir::train::carried_state(g) {
        let Some(&own) = stage_of_value.get(&next) else { continue };
        for (r, _) in g.users(state) {
            let st = placement.stage_of.get(&r).copied().unwrap_or(0);
            let list = deliver.entry(next).or_default();
            if st != own && !everywhere.contains(&r) && !everywhere.contains(&next.node) && !list.contains(&st) {
                list.push(st);
            }
        }
    }
    let phases = ir::reshard::step_phases(g, &order);
    let shard_sends = placement.stages.windows(2).all(|w| w[0].mesh == w[1].mesh);
    let zero = ir::reshard::ZeroLayouts::new(g, placement.zero, |u, j| {
        let s = placement.strategies.get(&u)?;
        strategy_shardings(&iter_space(g, u), s).0.get(j).cloned().flatten()
    });
    let sh =
        Shared { g, placement, stage_of_value, value_tag, batch, cuts, everywhere, deliver, phases, shard_sends, zero };
    let total = placement.device_count();
    let mut programs: Vec<Option<DeviceProgram>> = vec![None; total];
    let mut fallbacks: Vec<String> = Vec::new();
    for (device, held) in held_stages(placement)?.into_iter().enumerate() {
        if held.is_empty() {
            continue;
        }
        let p = lower_device(&sh, &order, &held)?;
        for f in &p.1 {
            if !fallbacks.contains(f) {
                fallbacks.push(f.clone());
            }
        }
        programs[device] = Some(p.0);
    }
    let devices: Vec<DeviceProgram> = programs
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            p.ok_or_else(|| LowerError::global(LowerErrorKind::Placement, format!("device {i} is in no stage")))
        })
        .collect::<Result<_, _>>()?;
    let io = |v: Value| -> Result<GlobalValue, LowerError> {
        let shape = g.tensor_type(v).and_then(ir::TensorType::static_dims).ok_or_else(|| {
            LowerError::global(LowerErrorKind::Graph, format!("`{}` has no static shape", g.value_name(v)))
        })?;
        let flags = sh.batch.get(&v).cloned().unwrap_or_default();
        Ok(GlobalValue {
            name: g.value_name(v).to_string(),
            shape: shape.into_iter().map(|d| d.max(0) as usize).collect(),
            dtype: g.tensor_type(v).map_or(ir::DType::Float, |t| t.dtype),
            batch_axis: if m > 1 { flags.iter().position(|&b| b) } else { None },
        })
    };
    let inputs = g
        .input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .map(io)
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = g.outputs().iter().map(|o| io(o.value)).collect::<Result<Vec<_>, _>>()?;
    Ok(Program {
        devices,
        meshes: placement.stages.iter().map(|s| s.mesh.clone()).collect(),
        stage_devices: placement.stages.iter().map(|s| s.devices.clone()).collect(),
        micro_batches: m,
        inputs,
        outputs,
        fallbacks,
        schedule: placement.schedule,
        recompute: placement.recompute.clone(),
    })
}

/// Per device, the (virtual) stages it holds and its rank in them: one stage, or under the
/// interleaved schedule one per model chunk, in order, at the same place of equal meshes.
fn held_stages(placement: &Placement) -> Result<Vec<Vec<(usize, usize)>>, LowerError> {
    let total = placement.device_count();
    let mut held: Vec<Vec<(usize, usize)>> = vec![Vec::new(); total];
    for (si, stage) in placement.stages.iter().enumerate() {
        for (rank, &device) in stage.devices.iter().enumerate() {
            let Some(list) = held.get_mut(device) else {
                return Err(LowerError::global(LowerErrorKind::Placement, format!("device {device} of {total}")));
            };
            if let Some(&(s0, r0)) = list.first()
                && (r0 != rank || placement.stages[s0].mesh != stage.mesh)
            {
                return Err(LowerError::global(
                    LowerErrorKind::Placement,
                    format!("device {device} is in stages {s0} and {si} at different places of their meshes"),
                ));
            }
            list.push((si, rank));
        }
    }
    Ok(held)
}

/// One device's program — each of the (virtual) stages it holds in turn, a later one's ops
/// marked with their chunk — and the ops it ran replicated instead of as planned.
fn lower_device(
    sh: &Shared<'_>,
    order: &[NodeId],
    held: &[(usize, usize)],
) -> Result<(DeviceProgram, Vec<String>), LowerError> {
    let (first, rank) = held[0];
    let mut l = Local::new(sh, first, rank);
    let mut results = Vec::new();
    for (chunk, &(si, _)) in held.iter().enumerate() {
        l.stage = si;
        l.chunk = chunk;
        // What an earlier chunk received from this one (a gradient summed in an earlier
        // stage) is this chunk's to compute, and to send.
        let own: std::collections::HashSet<usize> = held[chunk..].iter().map(|h| h.0).collect();
        l.have.retain(|(v, _), _| !sh.stage_of_value.get(v).is_some_and(|s| own.contains(s)));
        lower_stage(&mut l, order, &mut results)?;
    }
    let g = sh.g;
    ir::infer::infer_shapes(&mut l.lg, ir::infer::Mode::Check).map_err(|e| LowerError {
        device: Some(l.device),
        node: None,
        kind: LowerErrorKind::LocalShapes,
        message: format!(
            "local shapes do not infer: {}{}",
            e.first().map(|x| x.msg.clone()).unwrap_or_default(),
            if std::env::var_os("SHARDC_DEBUG_LOWER").is_some() {
                format!("\n{}", ir::print::model_to_string(&ir::Model::new(l.lg.clone(), g.opset)))
            } else {
                String::new()
            }
        ),
    })?;
    let program = DeviceProgram {
        device: l.device,
        stage: first,
        rank,
        graph: l.lg,
        feeds: l.feeds,
        pieces: l.pieces,
        results,
        chunk_of: l.chunk_of,
        phase_of: l.phase_of,
        from_later: l.from_later,
    };
    Ok((program, l.fallbacks))
}

/// Lowers the ops of stage `l.stage` onto `l` (with the ops every stage computes, in the
/// device's first chunk) and delivers the graph outputs it computes into `results`.
fn lower_stage(l: &mut Local<'_>, order: &[NodeId], results: &mut Vec<Result_>) -> Result<(), LowerError> {
    let (sh, g, si) = (l.sh, l.g, l.stage);
    let placement = sh.placement;
    let stage_of = |n: NodeId| placement.stage_of.get(&n).copied().unwrap_or(0);
    let stage = &placement.stages[si];
    let rank = stage.mesh.device(&l.coords);
    // Per value this stage computes, the devices of other stages that read it, from this
    // device (a reader at rank j of its stage hears from rank j modulo this stage's size);
    // not this device's own later chunks, which read what it holds.
    let mut readers: HashMap<Value, Vec<usize>> = HashMap::new();
    let mut add = |v: Value, st: usize| {
        for (j, &dst) in placement.stages[st].devices.iter().enumerate() {
            let list = readers.entry(v).or_default();
            if j % stage.devices.len() == rank && !list.contains(&dst) && !(dst == l.device && st > si) {
                list.push(dst);
            }
        }
    };
    for &n in order.iter().filter(|&&n| stage_of(n) != si && !sh.everywhere.contains(&n)) {
        for v in g.node(n).inputs().iter().flatten() {
            if sh.stage_of_value.get(v) == Some(&si) && !sh.everywhere.contains(&v.node) {
                add(*v, stage_of(n));
            }
        }
    }
    for (v, sts) in &sh.deliver {
        if sh.stage_of_value.get(v) == Some(&si) {
            for &st in sts {
                add(*v, st);
            }
        }
    }
    let phase_of = |n: NodeId| sh.phases.as_ref().and_then(|p| p.get(&n).copied());
    let first = l.chunk == 0;
    for &n in order.iter().filter(|&&n| stage_of(n) == si || (first && sh.everywhere.contains(&n))) {
        let phase = phase_of(n);
        if ir::reshard::ZeroLayouts::ends_forward(l.phase, phase) {
            l.end_forward();
        }
        l.phase = phase;
        lower_op(l, n)?;
        // A ZeRO gradient is brought to its update's shard as soon as it is computed.
        for slot in 0..g.node(n).num_outputs() {
            if let Some(shard) = sh.zero.gradients.get(&Value::new(n, slot as u16)) {
                l.get(Value::new(n, slot as u16), shard)?;
            }
        }
        // Each value another stage reads is sent as soon as it is computed (a training
        // step's backward part waits for it in the next stage).
        for slot in 0..g.node(n).num_outputs() {
            let v = Value::new(n, slot as u16);
            let Some(dsts) = readers.get(&v) else { continue };
            let layout = l.sent_layout(v);
            let x = l.get(v, &layout)?;
            for &dst in dsts {
                let send = ir::op::Send { peer: Some(dst as i64), tag: Some(sh.value_tag[&v]) };
                l.emit(Op::Send(send), vec![Some(x)], &[]);
            }
        }
    }
    // Graph outputs computed in this stage, delivered reduced and cut only along the batch
    // and the sequence.
    let carried = ir::train::carried_state(g);
    for out in g.outputs() {
        let v = out.value;
        let in_stage = match g.node(v.node).op {
            Op::Input { .. } | Op::Initializer(_) => si == 0,
            _ => {
                sh.stage_of_value.get(&v) == Some(&si)
                    || (first && sh.everywhere.contains(&v.node))
                    || sh.deliver.get(&v).is_some_and(|s| s.contains(&si))
            }
        };
        if !in_stage {
            continue;
        }
        let produced = l.produced.get(&v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; stage.mesh.axes.len()]);
        let cuts = sh.cuts.get(&v).map_or(&[][..], Vec::as_slice);
        let layout = sh.zero.delivered(g, &carried, v, &produced, cuts, |s| l.produced.get(&s).cloned());
        l.phase = phase_of(v.node);
        let x = l.get(v, &layout)?;
        l.lg.add_output(x, None);
        results.push(Result_ { local: l.lg.value_name(x).to_string(), global: g.value_name(v).to_string(), layout });
    }
    Ok(())
}

/// A program that reshards one float tensor of global shape `dims` from layout `from` to
/// `to` on `mesh`, with the steps the algebra gives ([`ir::reshard::reshard`]) — what the
/// lowering emits between ops. Its input `x` is fed in `from` with each partial-sum axis
/// made of unequal summands (coordinate 0 holds twice the value, the others share −1 of
/// it), so a wrong reduction shows; its output is `x` in `to`.
pub fn reshard_program(
    dims: &[usize],
    from: &Sharding,
    to: &Sharding,
    mesh: &Mesh,
    policy: ir::reshard::Policy,
) -> Result<Program, LowerError> {
    let mut g = Graph::new("reshard");
    let shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
    let x = g.add_input("x", Some(ir::Type::Tensor(ir::TensorType::fixed(ir::DType::Float, &shape))));
    g.add_output(x, None);
    let placement = Placement {
        stages: vec![crate::program::StagePlacement { mesh: mesh.clone(), devices: (0..mesh.devices()).collect() }],
        strategies: HashMap::new(),
        stage_of: HashMap::new(),
        micro_batches: 1,
        policy,
        schedule: Default::default(),
        recompute: Vec::new(),
        zero: 0,
    };
    let sh = Shared {
        g: &g,
        placement: &placement,
        stage_of_value: HashMap::new(),
        value_tag: HashMap::new(),
        batch: HashMap::new(),
        cuts: HashMap::new(),
        everywhere: Default::default(),
        deliver: HashMap::new(),
        phases: None,
        shard_sends: false,
        zero: Default::default(),
    };
    let fed: Sharding = from.iter().map(|s| if *s == AxisShard::Partial { AxisShard::Replicate } else { *s }).collect();
    let mut devices = Vec::new();
    for rank in 0..mesh.devices() {
        let mut l = Local::new(&sh, 0, rank);
        let mut xl = l.get(x, &fed)?;
        let mut w = 1.0;
        for (a, s) in from.iter().enumerate() {
            if *s == AxisShard::Partial && mesh.axes[a].size > 1 {
                let p = mesh.axes[a].size as f64;
                w *= if l.coords[a] == 0 { 2.0 } else { -1.0 / (p - 1.0) };
            }
        }
        if w != 1.0 {
            let k = l.scalar("w", ir::DType::Float, w);
            xl = l.op1(Op::Mul(ir::op::Mul::default()), &[xl, k], "x_partial");
        }
        let y = l.reshard(x, xl, from, to)?;
        l.lg.add_output(y, None);
        let results = vec![Result_ { local: l.lg.value_name(y).to_string(), global: "x".into(), layout: to.clone() }];
        ir::infer::infer_shapes(&mut l.lg, ir::infer::Mode::Check).map_err(|e| LowerError {
            device: Some(l.device),
            node: None,
            kind: LowerErrorKind::LocalShapes,
            message: format!("local shapes do not infer: {}", e.first().map(|x| x.msg.clone()).unwrap_or_default()),
        })?;
        devices.push(DeviceProgram {
            device: rank,
            stage: 0,
            rank,
            graph: l.lg,
            feeds: l.feeds,
            pieces: l.pieces,
            results,
            chunk_of: HashMap::new(),
            phase_of: HashMap::new(),
            from_later: Default::default(),
        });
    }
    let gv = GlobalValue { name: "x".into(), shape: dims.to_vec(), dtype: ir::DType::Float, batch_axis: None };
    Ok(Program {
        devices,
        meshes: vec![mesh.clone()],
        stage_devices: vec![(0..mesh.devices()).collect()],
        micro_batches: 1,
        inputs: vec![gv.clone()],
        outputs: vec![gv],
        fallbacks: Vec::new(),
        schedule: Default::default(),
        recompute: Vec::new(),
    })
}

/// The first op of `g` (or of its subgraphs) outside shardc's op table: the node's
/// description and the message.
fn unsupported_op(g: &Graph) -> Option<(Option<String>, String)> {
    for n in g.node_ids() {
        let op = &g.node(n).op;
        if let Op::Opaque(o) = op {
            let domain = if o.domain.is_empty() { "ai.onnx" } else { o.domain.as_str() };
            return Some((
                Some(g.describe(n)),
                format!("unsupported op `{}` (domain `{domain}`): shardc cannot compute it", o.op_type),
            ));
        }
        for a in op.attributes() {
            let subs: Vec<&Graph> = match &a.value {
                ir::AttrValue::Graph(sg) => vec![sg.as_ref()],
                ir::AttrValue::Graphs(gs) => gs.iter().collect(),
                _ => Vec::new(),
            };
            for sg in subs {
                if let Some((node, msg)) = unsupported_op(sg) {
                    return Some((
                        Some(g.describe(n)),
                        format!("{msg} (in {} of its subgraph)", node.unwrap_or_default()),
                    ));
                }
            }
        }
    }
    None
}
