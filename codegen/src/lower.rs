//! Lowering: from a graph and a placement to one graph per device on local shapes, with every
//! resharding written out as communication.
//!
//! Per device, ops are emitted in the global topological order, so every device meets the
//! collectives of a group in the same order. For each op:
//! - its inputs are brought to the layouts its strategy needs: graph inputs and parameters
//!   arrive as the device's piece; a tensor computed in another layout is resharded
//!   (`AllReduce` for pending sums, `ReduceScatter`, `AllGather`, `AllToAll`, a local `Slice`
//!   to take one's piece); a tensor from another pipeline stage arrives by `Recv`;
//! - the op runs on its local shapes. Shape literals (Reshape, Expand, Resize sizes) are
//!   rewritten to local shapes; a split reduction keeps the bias on one device only and
//!   rescales means; a split window exchanges halos with its neighbours and pads only at the
//!   tensor's borders; softmax and layer norm over a split dim become local reductions with an
//!   all-reduce of their statistics; an embedding split by rows becomes a masked gather whose
//!   results are partial sums;
//! - an op whose strategy this lowering cannot express runs replicated instead (its inputs
//!   gathered, its outputs sliced back to the planned layouts) and is reported.

use std::collections::HashMap;

use ir::attr::{AttrValue, Attribute};
use ir::eval::Array;
use ir::shard::{AxisShard, DimKind, IterSpace, Mesh, Sharding, iter_space, sharding_to_string, strategy_shardings};
use ir::{DType, Graph, NodeId, Op, Output, TensorType, Type, Value};

use crate::layout::{local_shape, piece};
use crate::program::{DeviceProgram, Feed, GlobalValue, Placement, Program, Result_};

/// Why lowering failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LowerError {
    /// The graph is not ready (shapes not static, weights not loaded, a cycle).
    #[error("{0}")]
    Graph(String),
    /// The placement does not fit the graph.
    #[error("{0}")]
    Placement(String),
}

/// The per-device builder state.
struct Local<'a> {
    g: &'a Graph,
    mesh: &'a Mesh,
    coords: Vec<usize>,
    stage: usize,
    placement: &'a Placement,
    lg: Graph,
    /// Local value of (global value, layout).
    have: HashMap<(Value, Sharding), Value>,
    /// Layout each op output was produced in (by this device's stage).
    produced: HashMap<Value, Sharding>,
    feeds: Vec<Feed>,
    names: HashMap<String, usize>,
    fallbacks: Vec<String>,
    /// Global value index (for Send/Recv tags).
    value_tag: &'a HashMap<Value, i64>,
    stage_of_value: &'a HashMap<Value, usize>,
}

fn dims_of(g: &Graph, v: Value) -> Result<Vec<usize>, LowerError> {
    g.tensor_type(v)
        .and_then(TensorType::static_dims)
        .map(|d| d.into_iter().map(|x| x.max(0) as usize).collect())
        .ok_or_else(|| LowerError::Graph(format!("`{}` has no static shape; infer shapes first", g.value_name(v))))
}

fn dtype_of(g: &Graph, v: Value) -> DType {
    g.tensor_type(v).map_or(DType::Float, |t| t.dtype)
}

fn attr(name: &str, v: AttrValue) -> Attribute {
    Attribute::new(name, v)
}

fn op(domain: &str, ty: &str, attrs: Vec<Attribute>) -> Op {
    Op::from_parts(domain, ty, attrs).unwrap_or_else(|e| panic!("building {ty}: {e:?}"))
}

impl Local<'_> {
    fn fresh(&mut self, base: &str) -> String {
        let k = self.names.entry(base.to_string()).or_insert(0);
        *k += 1;
        if *k == 1 && self.lg.lookup(base).is_none() { base.to_string() } else { format!("{base}__{}", *k) }
    }

    fn node(&mut self, o: Op, inputs: Vec<Option<Value>>, outs: &[String]) -> Vec<Value> {
        let outputs: Vec<Output> = outs.iter().map(|n| Output::named(n.clone())).collect();
        let id = self.lg.add_node(o, inputs, outputs);
        (0..outs.len()).map(|s| Value::new(id, s as u16)).collect()
    }

    fn simple(&mut self, ty: &str, attrs: Vec<Attribute>, inputs: &[Value], base: &str) -> Value {
        let name = self.fresh(base);
        self.node(op("", ty, attrs), inputs.iter().map(|v| Some(*v)).collect(), &[name])[0]
    }

    fn comm(&mut self, ty: &str, attrs: Vec<Attribute>, input: Value, base: &str) -> Value {
        let name = self.fresh(base);
        self.node(op(ir::op::SHARDC_DOMAIN, ty, attrs), vec![Some(input)], &[name])[0]
    }

    fn init(&mut self, base: &str, a: &Array) -> Value {
        let name = self.fresh(base);
        let mut t = a.to_tensor();
        t.name = None;
        self.lg.add_initializer(name, t)
    }

    fn const_i64(&mut self, base: &str, v: &[i64]) -> Value {
        self.init(base, &Array::i64(vec![v.len()], v.to_vec()))
    }

    fn scalar(&mut self, base: &str, dtype: DType, x: f64) -> Value {
        let a = match dtype {
            DType::Int64 | DType::Int32 => Array::int(dtype, vec![], vec![x as i64]),
            _ => Array::float(dtype, vec![], vec![x]),
        };
        self.init(base, &a)
    }

    /// Global device ids of the devices that differ from this one only on `axes`, in order.
    fn group(&self, axes: &[usize]) -> Vec<i64> {
        let stage = &self.placement.stages[self.stage];
        let mut out = Vec::new();
        let total: usize = axes.iter().map(|&a| self.mesh.axes[a].size).product();
        for k in 0..total {
            let mut c = self.coords.clone();
            let mut rem = k;
            for &a in axes.iter().rev() {
                c[a] = rem % self.mesh.axes[a].size;
                rem /= self.mesh.axes[a].size;
            }
            out.push(stage.devices[self.mesh.device(&c)] as i64);
        }
        out
    }

    /// `x` (global value `v`, local) from layout `from` to layout `to`.
    fn reshard(&mut self, v: Value, x: Value, from: &Sharding, to: &Sharding) -> Result<Value, LowerError> {
        let g = self.g;
        let shape = dims_of(g, v)?;
        let dtype = dtype_of(g, v);
        let base = g.value_name(v).to_string();
        let axes = from.len();
        let mut cur = from.clone();
        let mut x = x;
        let split_dims = |l: &Sharding| -> Vec<Vec<usize>> { crate::layout::split_axes(l, shape.len()) };
        // 1. Pending sums: reduce-scatter when one axis goes P→S(d) and nothing else splits d;
        // otherwise an all-reduce over every P axis that is not staying P.
        let p_axes: Vec<usize> =
            (0..axes).filter(|&a| cur[a] == AxisShard::Partial && to[a] != AxisShard::Partial).collect();
        if !p_axes.is_empty() {
            let single_scatter = p_axes.len() == 1 && {
                let a = p_axes[0];
                matches!(to[a], AxisShard::Split(d) if split_dims(&cur)[d as usize].is_empty()
                    && split_dims(to)[d as usize] == vec![a])
            };
            if single_scatter {
                let a = p_axes[0];
                let AxisShard::Split(d) = to[a] else { unreachable!() };
                let group = self.group(&[a]);
                x = self.comm(
                    "ReduceScatter",
                    vec![attr("axis", AttrValue::Int(d as i64)), attr("group", AttrValue::Ints(group))],
                    x,
                    &format!("{base}__rs"),
                );
                cur[a] = AxisShard::Split(d);
            } else {
                let group = self.group(&p_axes);
                x = self.comm("AllReduce", vec![attr("group", AttrValue::Ints(group))], x, &format!("{base}__ar"));
                for &a in &p_axes {
                    cur[a] = AxisShard::Replicate;
                }
            }
        }
        // 2. One axis moving a split from dim d to dim e, nothing else on d or e: all-to-all.
        for a in 0..axes {
            if let (AxisShard::Split(d), AxisShard::Split(e)) = (cur[a], to[a])
                && d != e
                && split_dims(&cur)[d as usize] == vec![a]
                && split_dims(&cur)[e as usize].is_empty()
                && split_dims(to)[e as usize] == vec![a]
                && split_dims(to)[d as usize].is_empty()
            {
                let group = self.group(&[a]);
                x = self.comm(
                    "AllToAll",
                    vec![
                        attr("concat_axis", AttrValue::Int(d as i64)),
                        attr("group", AttrValue::Ints(group)),
                        attr("split_axis", AttrValue::Int(e as i64)),
                    ],
                    x,
                    &format!("{base}__a2a"),
                );
                cur[a] = AxisShard::Split(e);
            }
        }
        // 3. Gather every dim whose splitting axes differ (inner axes first).
        let from_dims = split_dims(&cur);
        let to_dims = split_dims(to);
        for d in 0..shape.len() {
            if from_dims[d] == to_dims[d] {
                continue;
            }
            for &a in from_dims[d].iter().rev() {
                let group = self.group(&[a]);
                x = self.comm(
                    "AllGather",
                    vec![attr("axis", AttrValue::Int(d as i64)), attr("group", AttrValue::Ints(group))],
                    x,
                    &format!("{base}__ag"),
                );
                cur[a] = AxisShard::Replicate;
            }
        }
        // 4. Take one's piece of every dim newly split (outer axes first).
        let cur_dims = split_dims(&cur);
        let mut starts = Vec::new();
        let mut ends = Vec::new();
        let mut sl_axes = Vec::new();
        for d in 0..shape.len() {
            if cur_dims[d] == to_dims[d] {
                continue;
            }
            let (s, e) = crate::layout::dim_range(to, self.mesh, &self.coords, d, shape[d]);
            starts.push(s as i64);
            ends.push(e as i64);
            sl_axes.push(d as i64);
            for &a in &to_dims[d] {
                cur[a] = AxisShard::Split(d as u8);
            }
        }
        if !sl_axes.is_empty() {
            let s = self.const_i64(&format!("{base}__starts"), &starts);
            let e = self.const_i64(&format!("{base}__ends"), &ends);
            let ax = self.const_i64(&format!("{base}__axes"), &sl_axes);
            let name = self.fresh(&format!("{base}__slice"));
            x = self.node(op("", "Slice", vec![]), vec![Some(x), Some(s), Some(e), Some(ax)], &[name])[0];
        }
        // 5. Partial sums wanted where the value is whole: one device keeps it.
        let zero_axes: Vec<usize> =
            (0..axes).filter(|&a| to[a] == AxisShard::Partial && cur[a] != AxisShard::Partial).collect();
        if !zero_axes.is_empty() {
            let keep = zero_axes.iter().all(|&a| self.coords[a] == 0);
            let k = self.scalar(&format!("{base}__keep"), dtype, if keep { 1.0 } else { 0.0 });
            x = self.simple("Mul", vec![], &[x, k], &format!("{base}__p"));
        }
        let _ = &shape;
        Ok(x)
    }

    /// The local value of global `v` in layout `need`.
    fn get(&mut self, v: Value, need: &Sharding) -> Result<Value, LowerError> {
        if let Some(&x) = self.have.get(&(v, need.clone())) {
            return Ok(x);
        }
        let g = self.g;
        let node = g.node(v.node);
        let name = g.value_name(v).to_string();
        let x = match &node.op {
            Op::Input { default: None } => {
                // The first layout is fed from the host; others are resharded from it.
                if let Some(from) = self.produced.get(&v).cloned() {
                    let x0 = self.have[&(v, from.clone())];
                    self.reshard(v, x0, &from, need)?
                } else {
                    let local = self.fresh(&name);
                    let shape = local_shape(&dims_of(g, v)?, need, self.mesh);
                    let t = TensorType::fixed(dtype_of(g, v), &shape.iter().map(|&x| x as i64).collect::<Vec<_>>());
                    let x = self.lg.add_input(local.clone(), Some(Type::Tensor(t)));
                    self.feeds.push(Feed { local, global: name.clone(), layout: need.clone() });
                    // Later layouts are resharded from this one.
                    self.produced.insert(v, need.clone());
                    x
                }
            }
            Op::Initializer(t) | Op::Input { default: Some(t) } if t.is_external() => {
                // Shape only: the device's piece keeps a reference to the data it comes from.
                let dims = dims_of(g, v)?;
                let local = local_shape(&dims, need, self.mesh);
                let mut entries = match &t.data {
                    ir::TensorData::External(e) => e.iter().filter(|(k, _)| k == "location").cloned().collect(),
                    _ => Vec::new(),
                };
                entries
                    .push(("shardc_piece".to_string(), format!("{} at {:?}", sharding_to_string(need), self.coords)));
                let tensor = ir::Tensor {
                    dtype: t.dtype,
                    dims: local.iter().map(|&x| x as i64).collect(),
                    name: None,
                    data: ir::TensorData::External(entries),
                };
                let local_name = self.fresh(&name);
                self.lg.add_initializer(local_name, tensor)
            }
            Op::Initializer(t) | Op::Input { default: Some(t) } => {
                let a = Array::from_tensor(t).map_err(|e| LowerError::Graph(format!("`{name}`: {e}")))?;
                let p = piece(&a, need, self.mesh, &self.coords);
                self.init(&name, &p)
            }
            Op::OuterRef => return Err(LowerError::Graph(format!("outer-scope value `{name}` in the main graph"))),
            _ => {
                let producer_stage = self.stage_of_value.get(&v).copied().unwrap_or(0);
                if producer_stage != self.stage {
                    self.receive(v, need)?
                } else {
                    let from = self
                        .produced
                        .get(&v)
                        .cloned()
                        .ok_or_else(|| LowerError::Graph(format!("`{name}` is used before it is computed")))?;
                    let x0 = self.have[&(v, from.clone())];
                    self.reshard(v, x0, &from, need)?
                }
            }
        };
        self.have.insert((v, need.clone()), x);
        Ok(x)
    }

    /// A tensor from an earlier pipeline stage: received whole from the device of that stage
    /// at this device's rank (modulo its size), then sliced to `need`.
    fn receive(&mut self, v: Value, need: &Sharding) -> Result<Value, LowerError> {
        let g = self.g;
        let replicated: Sharding = vec![AxisShard::Replicate; self.mesh.axes.len()];
        if let Some(&x) = self.have.get(&(v, replicated.clone())) {
            return self.reshard(v, x, &replicated, need);
        }
        let from_stage = self.stage_of_value.get(&v).copied().unwrap_or(0);
        let src = &self.placement.stages[from_stage].devices;
        let rank = self.mesh.device(&self.coords);
        let peer = src[rank % src.len()];
        let shape = dims_of(g, v)?;
        let name = self.fresh(&format!("{}__recv", g.value_name(v)));
        let o = op(
            ir::op::SHARDC_DOMAIN,
            "Recv",
            vec![
                attr("dtype", AttrValue::Int(dtype_of(g, v).code())),
                attr("peer", AttrValue::Int(peer as i64)),
                attr("shape", AttrValue::Ints(shape.iter().map(|&x| x as i64).collect())),
                attr("tag", AttrValue::Int(self.value_tag[&v])),
            ],
        );
        let x = self.node(o, vec![], &[name])[0];
        self.have.insert((v, replicated.clone()), x);
        self.reshard(v, x, &replicated, need)
    }
}

/// What an op needs to run as planned, or why it runs replicated.
enum Mode {
    Direct,
    Softmax { log: bool, axes: Vec<usize> },
    LayerNorm { axis: usize },
    VocabGather,
    Halo,
    Replicated(String),
}

fn mode(g: &Graph, n: NodeId, sp: &IterSpace, s: &[Option<usize>]) -> Mode {
    let node = g.node(n);
    let split: Vec<usize> = s.iter().flatten().copied().collect();
    if split.is_empty() {
        return Mode::Direct;
    }
    let kinds: Vec<&DimKind> = split.iter().map(|&i| &sp.dims[i].kind).collect();
    let has = |f: &dyn Fn(&DimKind) -> bool| kinds.iter().any(|k| f(k));
    if matches!(node.op, Op::If(_) | Op::Loop(_) | Op::Scan(_)) || node.op.class() == ir::OpClass::Comm {
        return Mode::Replicated("control flow and communication ops run whole".into());
    }
    if has(&|k| matches!(k, DimKind::Spatial { .. })) {
        return match node.op {
            Op::Conv(_) | Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_) => Mode::Halo,
            _ => Mode::Replicated("split window of this op".into()),
        };
    }
    if has(&|k| matches!(k, DimKind::Statistic { .. })) {
        return match &node.op {
            Op::Softmax(_) | Op::LogSoftmax(_) => {
                let axes: Vec<usize> =
                    (0..sp.dims.len()).filter(|&i| matches!(sp.dims[i].kind, DimKind::Statistic { .. })).collect();
                Mode::Softmax { log: matches!(node.op, Op::LogSoftmax(_)), axes }
            }
            Op::LayerNormalization(l)
                if node.num_outputs() == 1 || node.outputs()[1..].iter().all(|o| o.name.is_empty()) =>
            {
                let r = sp.dims.len();
                let a = l.axis();
                Mode::LayerNorm { axis: if a < 0 { (a + r as i64) as usize } else { a as usize } }
            }
            // Inference batch norm uses running statistics: nothing to reduce.
            Op::BatchNormalization(b) if b.training_mode() == 0 && node.num_outputs() == 1 => Mode::Direct,
            _ => Mode::Replicated("split statistics of this op".into()),
        };
    }
    if let Op::Gather(_) = node.op
        && split.iter().any(|&i| sp.dims[i].role == ir::shard::DimRole::Vocab)
    {
        return Mode::VocabGather;
    }
    if matches!(node.op, Op::Reshape(_) | Op::Expand(_) | Op::Resize(_)) && !literal_shape_input(g, n) {
        return Mode::Replicated("its shape input is not a constant".into());
    }
    Mode::Direct
}

/// True when the op's shape-like second input (Reshape/Expand shape, Resize sizes) is a
/// constant or absent.
fn literal_shape_input(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    let idx = if matches!(node.op, Op::Resize(_)) { 3 } else { 1 };
    match node.input(idx) {
        None => true,
        Some(v) => matches!(g.node(v.node).op, Op::Initializer(_) | Op::Constant(_)),
    }
}

/// Lowers `g` (shapes static and inferred, weights loaded) under `placement`.
pub fn lower(g: &Graph, placement: &Placement) -> Result<Program, LowerError> {
    let order = g.op_nodes().map_err(|_| LowerError::Graph("the graph has a cycle".into()))?;
    if placement.stages.is_empty() {
        return Err(LowerError::Placement("no stages".into()));
    }
    let mut stage_of_value: HashMap<Value, usize> = HashMap::new();
    let mut value_tag: HashMap<Value, i64> = HashMap::new();
    for &n in &order {
        let st = placement.stage_of.get(&n).copied().unwrap_or(0);
        if st >= placement.stages.len() {
            return Err(LowerError::Placement(format!(
                "{} is in stage {st}, of {}",
                g.describe(n),
                placement.stages.len()
            )));
        }
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            stage_of_value.insert(v, st);
            value_tag.insert(v, value_tag.len() as i64);
        }
    }
    // Stages must come in order: an op reads only from its stage or earlier ones.
    for &n in &order {
        let st = placement.stage_of.get(&n).copied().unwrap_or(0);
        for v in g.node(n).inputs().iter().flatten() {
            if let Some(&ps) = stage_of_value.get(v)
                && ps > st
            {
                return Err(LowerError::Placement(format!("{} reads from a later stage", g.describe(n))));
            }
        }
    }
    for (i, s) in placement.stages.iter().enumerate() {
        if s.mesh.devices() != s.devices.len() {
            return Err(LowerError::Placement(format!(
                "stage {i}: the mesh has {} devices, {} given",
                s.mesh.devices(),
                s.devices.len()
            )));
        }
    }
    let total = placement.device_count();
    let mut programs: Vec<Option<DeviceProgram>> = vec![None; total];
    let mut fallbacks: Vec<String> = Vec::new();
    for (si, stage) in placement.stages.iter().enumerate() {
        for (rank, &device) in stage.devices.iter().enumerate() {
            if device >= total {
                return Err(LowerError::Placement(format!("device {device} of {total}")));
            }
            let mut lg = Graph::new(format!("{}_device{device}", g.name));
            lg.opset = g.opset;
            let mut l = Local {
                g,
                mesh: &stage.mesh,
                coords: stage.mesh.coords(rank),
                stage: si,
                placement,
                lg,
                have: HashMap::new(),
                produced: HashMap::new(),
                feeds: Vec::new(),
                names: HashMap::new(),
                fallbacks: Vec::new(),
                value_tag: &value_tag,
                stage_of_value: &stage_of_value,
            };
            for &n in order.iter().filter(|&&n| placement.stage_of.get(&n).copied().unwrap_or(0) == si) {
                lower_op(&mut l, n)?;
            }
            // Sends of values later stages read.
            let mut sent: Vec<(Value, usize)> = Vec::new();
            for &n in &order {
                let st = placement.stage_of.get(&n).copied().unwrap_or(0);
                if st <= si {
                    continue;
                }
                for v in g.node(n).inputs().iter().flatten() {
                    if stage_of_value.get(v) == Some(&si) {
                        let dst_devices = &placement.stages[st].devices;
                        for (j, &dst) in dst_devices.iter().enumerate() {
                            if j % stage.devices.len() == rank && !sent.contains(&(*v, dst)) {
                                sent.push((*v, dst));
                            }
                        }
                    }
                }
            }
            for (v, dst) in sent {
                let replicated: Sharding = vec![AxisShard::Replicate; stage.mesh.axes.len()];
                let x = l.get(v, &replicated)?;
                let o = op(
                    ir::op::SHARDC_DOMAIN,
                    "Send",
                    vec![attr("peer", AttrValue::Int(dst as i64)), attr("tag", AttrValue::Int(value_tag[&v]))],
                );
                l.node(o, vec![Some(x)], &[]);
            }
            // Graph outputs computed in this stage.
            let mut results = Vec::new();
            for out in g.outputs() {
                let v = out.value;
                let in_stage = match g.node(v.node).op {
                    Op::Input { .. } | Op::Initializer(_) => si == 0,
                    _ => stage_of_value.get(&v) == Some(&si),
                };
                if !in_stage {
                    continue;
                }
                let layout =
                    l.produced.get(&v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; stage.mesh.axes.len()]);
                let x = l.get(v, &layout)?;
                l.lg.add_output(x, None);
                results.push(Result_ {
                    local: l.lg.value_name(x).to_string(),
                    global: g.value_name(v).to_string(),
                    layout,
                });
            }
            ir::infer::infer_shapes(&mut l.lg, ir::infer::Mode::Check).map_err(|e| {
                LowerError::Graph(format!(
                    "device {device}: local shapes do not infer: {}{}",
                    e.first().map(|x| x.msg.clone()).unwrap_or_default(),
                    if std::env::var_os("SHARDC_DEBUG_LOWER").is_some() {
                        format!("\n{}", ir::print::model_to_string(&ir::Model::new(l.lg.clone(), g.opset)))
                    } else {
                        String::new()
                    }
                ))
            })?;
            if si == 0 && rank == 0 || fallbacks.is_empty() {
                for f in &l.fallbacks {
                    if !fallbacks.contains(f) {
                        fallbacks.push(f.clone());
                    }
                }
            }
            programs[device] = Some(DeviceProgram { device, stage: si, rank, graph: l.lg, feeds: l.feeds, results });
        }
    }
    let devices: Vec<DeviceProgram> = programs
        .into_iter()
        .enumerate()
        .map(|(i, p)| p.ok_or_else(|| LowerError::Placement(format!("device {i} is in no stage"))))
        .collect::<Result<_, _>>()?;
    let io = |v: Value| -> Result<GlobalValue, LowerError> {
        Ok(GlobalValue {
            name: g.value_name(v).to_string(),
            shape: dims_of(g, v)?,
            dtype: dtype_of(g, v),
            batch_axis: None,
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
        micro_batches: placement.micro_batches.max(1),
        inputs,
        outputs,
        fallbacks,
    })
}

fn lower_op(l: &mut Local<'_>, n: NodeId) -> Result<(), LowerError> {
    let g = l.g;
    let node = g.node(n);
    let axes = l.mesh.axes.len();
    let mut s = l.placement.strategies.get(&n).cloned().unwrap_or_else(|| vec![None; axes]);
    if s.len() != axes {
        return Err(LowerError::Placement(format!(
            "{}: the strategy has {} axes, the mesh {axes}",
            g.describe(n),
            s.len()
        )));
    }
    let sp = iter_space(g, n);
    if s.iter().flatten().any(|&i| i >= sp.dims.len()) {
        return Err(LowerError::Placement(format!(
            "{}: the strategy names an iteration dim it does not have",
            g.describe(n)
        )));
    }
    let planned = s.clone();
    let (_, planned_outs) = strategy_shardings(&sp, &planned);
    let mut m = mode(g, n, &sp, &s);
    if let Mode::Halo = m
        && let Err(why) = halo_plan(l, n, &sp, &s)
    {
        m = Mode::Replicated(why);
    }
    if let Mode::Replicated(why) = &m {
        let msg = format!("{} ({}): {why}", g.describe(n), describe(&sp, &planned, l.mesh));
        if !l.fallbacks.contains(&msg) {
            l.fallbacks.push(msg);
        }
        s = vec![None; axes];
    }
    let (ins, outs) = strategy_shardings(&sp, &s);
    let replicated: Sharding = vec![AxisShard::Replicate; axes];
    // Local inputs.
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
    let out_names: Vec<String> =
        node.outputs().iter().map(|o| if o.name.is_empty() { String::new() } else { l.fresh(&o.name) }).collect();
    let outs_local: Vec<Value> = match m {
        Mode::Direct | Mode::Replicated(_) => emit_direct(l, n, &sp, &s, local_in, &out_names)?,
        Mode::Halo => emit_halo(l, n, &sp, &s, local_in, &out_names)?,
        Mode::Softmax { log, axes: stat } => {
            let x = local_in[0].expect("softmax input");
            vec![emit_softmax(l, n, &sp, &s, x, log, &stat, &out_names[0])?]
        }
        Mode::LayerNorm { axis } => vec![emit_layernorm(l, n, &sp, &s, &local_in, axis, &out_names[0])?],
        Mode::VocabGather => vec![emit_vocab_gather(l, n, &sp, &s, &local_in, &out_names[0])?],
    };
    // Record outputs; a replicated fallback is sliced back to the planned layouts.
    for (slot, x) in outs_local.into_iter().enumerate() {
        let v = Value::new(n, slot as u16);
        if node.outputs()[slot].name.is_empty() {
            continue;
        }
        let got = outs[slot].clone();
        let want = planned_outs[slot].clone();
        l.have.insert((v, got.clone()), x);
        if got != want {
            let y = l.reshard(v, x, &got, &want)?;
            l.have.insert((v, want.clone()), y);
        }
        l.produced.insert(v, want);
    }
    Ok(())
}

fn describe(sp: &IterSpace, s: &[Option<usize>], mesh: &Mesh) -> String {
    let parts: Vec<String> = s
        .iter()
        .enumerate()
        .filter_map(|(a, d)| d.map(|i| format!("{}→{}", sp.dims[i].name, mesh.axes[a].name)))
        .collect();
    if parts.is_empty() { "replicated".into() } else { parts.join(", ") }
}

/// The op on local shapes, with its shape literals and attributes made local.
fn emit_direct(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    mut ins: Vec<Option<Value>>,
    out_names: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let mut o = node.op.clone();
    let (_, outs) = strategy_shardings(sp, s);
    let split_kind = |k: &dyn Fn(&DimKind) -> bool| -> Vec<(usize, usize)> {
        s.iter().enumerate().filter_map(|(a, d)| d.filter(|&i| k(&sp.dims[i].kind)).map(|i| (a, i))).collect()
    };
    let reduced = split_kind(&|k| matches!(k, DimKind::Reduction));
    // Shape literals.
    let shape_input = match node.op {
        Op::Reshape(_) | Op::Expand(_) => Some(1),
        Op::Resize(_) if node.input(3).is_some() => Some(3),
        _ => None,
    };
    if let Some(j) = shape_input
        && s.iter().any(Option::is_some)
    {
        let out_shape = local_shape(&dims_of(g, Value::new(n, 0))?, &outs[0], l.mesh);
        let lit: Vec<i64> = out_shape.iter().map(|&x| x as i64).collect();
        let c = l.const_i64(&format!("{}__shape", g.value_name(Value::new(n, 0))), &lit);
        ins[j] = Some(c);
    }
    // Squeeze without axes squeezes what is 1 globally (a split can make other dims 1).
    if let Op::Squeeze(sq) = &mut o
        && sq.axes.is_none()
        && node.input(1).is_none()
    {
        let xd = dims_of(g, node.input(0).expect("squeeze input"))?;
        let axes: Vec<i64> = (0..xd.len()).filter(|&i| xd[i] == 1).map(|i| i as i64).collect();
        if g.opset >= 13 {
            let c = l.const_i64(&format!("{}__axes", g.value_name(Value::new(n, 0))), &axes);
            if ins.len() < 2 {
                ins.resize(2, None);
            }
            ins[1] = Some(c);
        } else {
            sq.axes = Some(axes);
        }
    }
    // A split reduction adds the bias once.
    if !reduced.is_empty() {
        let keep = reduced.iter().all(|&(a, _)| l.coords[a] == 0);
        match node.op {
            Op::Conv(_) | Op::ConvTranspose(_) | Op::Gemm(_) if !keep && ins.len() > 2 => {
                ins[2] = None;
            }
            _ => {}
        }
    }
    // Depthwise groups split.
    if let Op::Conv(c) = &mut o {
        let gsplit: usize = s
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_some_and(|i| sp.dims[i].name == "g"))
            .map(|(a, _)| l.mesh.axes[a].size)
            .product();
        if gsplit > 1 {
            c.group = Some(c.group() / gsplit as i64);
        }
    }
    let mut outs_v = l.node(o, ins, out_names);
    // Means over a split dim become partial sums of local means: scale by the local share.
    if !reduced.is_empty() && matches!(node.op, Op::ReduceMean(_) | Op::GlobalAveragePool(_)) {
        let f: usize = reduced.iter().map(|&(a, _)| l.mesh.axes[a].size).product();
        let dtype = dtype_of(g, Value::new(n, 0));
        let k = l.scalar(&format!("{}__share", out_names[0]), dtype, 1.0 / f as f64);
        // The node above produced a temporary; rename by emitting the scaled value under a
        // fresh name (the recorded output is the scaled one).
        let scaled = l.simple("Mul", vec![], &[outs_v[0], k], &format!("{}__scaled", out_names[0]));
        outs_v[0] = scaled;
    }
    Ok(outs_v)
}

/// Halo geometry of one split spatial dim on this device.
struct HaloDim {
    tensor_dim: usize,
    axis: usize,
    from_prev: usize,
    from_next: usize,
    to_prev: usize,
    to_next: usize,
    trim_start: usize,
    trim_end: usize,
    pad_before: usize,
    pad_after: usize,
    spatial: usize,
}

/// Spatial input dims, kernel, dilations, the window geometry and ceil mode of a windowed op.
type WindowParams = (Vec<usize>, Vec<usize>, Vec<usize>, ir::eval::Window, bool);

fn window_params(node: &ir::Node, g: &Graph) -> Option<WindowParams> {
    let x = g.tensor_type(node.input(0)?)?.static_dims()?;
    let spatial: Vec<usize> = x[2..].iter().map(|&d| d as usize).collect();
    let (kernel, strides, dil, pads, auto_pad, ceil) = match &node.op {
        Op::Conv(c) => {
            let w = g.tensor_type(node.input(1)?)?.static_dims()?;
            (
                c.kernel_shape.clone().unwrap_or_else(|| w[2..].to_vec()),
                c.strides.clone(),
                c.dilations.clone(),
                c.pads.clone(),
                c.auto_pad().to_string(),
                false,
            )
        }
        op => {
            let a = op.pool_attrs()?;
            (
                a.kernel_shape?.to_vec(),
                a.strides.map(<[i64]>::to_vec),
                a.dilations.map(<[i64]>::to_vec),
                a.pads.map(<[i64]>::to_vec),
                a.auto_pad.to_string(),
                a.ceil_mode,
            )
        }
    };
    let w = ir::eval::window(&spatial, &kernel, strides.as_deref(), dil.as_deref(), pads.as_deref(), &auto_pad, ceil)
        .ok()?;
    Some((spatial, w.kernel.clone(), w.dilations.clone(), w, ceil))
}

/// Per split spatial dim, what this device exchanges; an error when a halo would reach past
/// a neighbour.
fn halo_plan(l: &Local<'_>, n: NodeId, sp: &IterSpace, s: &[Option<usize>]) -> Result<Vec<HaloDim>, String> {
    let g = l.g;
    let node = g.node(n);
    let (spatial, kernel, dil, w, ceil) = window_params(node, g).ok_or("window geometry unknown")?;
    if ceil && matches!(&node.op, Op::AveragePool(p) if p.count_include_pad() != 0) {
        return Err("ceil_mode with count_include_pad".into());
    }
    let xmap = sp.inputs[0].as_ref().ok_or("no input map")?;
    let mut out = Vec::new();
    for (a, d) in s.iter().enumerate() {
        let Some(i) = d else { continue };
        let DimKind::Spatial { .. } = sp.dims[*i].kind else { continue };
        let t = xmap.iter().position(|m| *m == Some(*i)).ok_or("split spatial dim not in the input")?;
        let k = t - 2;
        let p = l.mesh.axes[a].size;
        let (big_i, o) = (spatial[k], w.out[k]);
        if o % p != 0 || big_i % p != 0 {
            return Err("uneven spatial split".into());
        }
        let (ol, b) = (o / p, big_i / p);
        let st = w.strides[k];
        let eff = (kernel[k] - 1) * dil[k] + 1;
        let pb = w.pad_begin[k] as i64;
        let geom = |c: usize| -> (i64, i64, i64, i64) {
            let need_start = (c * ol * st) as i64 - pb;
            let need_end = ((c * ol + ol - 1) * st + eff) as i64 - pb;
            let ns = need_start.max(0);
            let ne = need_end.min(big_i as i64);
            (need_start, need_end, ns, ne)
        };
        let c = l.coords[a];
        let (need_start, need_end, ns, ne) = geom(c);
        let (bs, be) = ((c * b) as i64, (c * b + b) as i64);
        let from_prev = (bs - ns).max(0) as usize;
        let from_next = (ne - be).max(0) as usize;
        let to_prev = if c > 0 {
            let (_, _, _, ne2) = geom(c - 1);
            (ne2 - ((c - 1) * b + b) as i64).max(0) as usize
        } else {
            0
        };
        let to_next = if c + 1 < p {
            let (_, _, ns2, _) = geom(c + 1);
            (((c + 1) * b) as i64 - ns2).max(0) as usize
        } else {
            0
        };
        if from_prev > b || from_next > b || to_prev > b || to_next > b {
            return Err(format!("halo wider than a neighbour's block ({b})"));
        }
        out.push(HaloDim {
            tensor_dim: t,
            axis: a,
            from_prev,
            from_next,
            to_prev,
            to_next,
            trim_start: (ns - bs).max(0) as usize,
            trim_end: (be - ne).max(0) as usize,
            pad_before: (ns - need_start) as usize,
            pad_after: (need_end - ne) as usize,
            spatial: k,
        });
    }
    Ok(out)
}

fn emit_halo(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    mut ins: Vec<Option<Value>>,
    out_names: &[String],
) -> Result<Vec<Value>, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let plan = halo_plan(l, n, sp, s).map_err(LowerError::Graph)?;
    let (spatial, _, _, w, _) = window_params(node, g).ok_or_else(|| LowerError::Graph("window".into()))?;
    let k = spatial.len();
    let mut x = ins[0].expect("windowed op input");
    let base = g.value_name(node.input(0).expect("input")).to_string();
    let mut pads: Vec<i64> = w.pad_begin.iter().chain(&w.pad_end).map(|&p| p as i64).collect();
    for h in &plan {
        if h.from_prev + h.from_next + h.to_prev + h.to_next > 0 {
            let group = l.group(&[h.axis]);
            x = l.comm(
                "HaloExchange",
                vec![
                    attr("axis", AttrValue::Int(h.tensor_dim as i64)),
                    attr("group", AttrValue::Ints(group)),
                    attr(
                        "widths",
                        AttrValue::Ints(vec![
                            h.from_prev as i64,
                            h.from_next as i64,
                            h.to_prev as i64,
                            h.to_next as i64,
                        ]),
                    ),
                ],
                x,
                &format!("{base}__halo"),
            );
        }
        if h.trim_start + h.trim_end > 0 {
            let len = l.lg.tensor_type(x).and_then(TensorType::static_dims);
            // The exchanged extent: own block plus what came in.
            let ext = match len {
                Some(d) => d[h.tensor_dim],
                None => {
                    let dims = dims_of(g, node.input(0).expect("input"))?;
                    (dims[h.tensor_dim] / l.mesh.axes[h.axis].size + h.from_prev + h.from_next) as i64
                }
            };
            let st = l.const_i64(&format!("{base}__trim_s"), &[h.trim_start as i64]);
            let en = l.const_i64(&format!("{base}__trim_e"), &[ext - h.trim_end as i64]);
            let ax = l.const_i64(&format!("{base}__trim_a"), &[h.tensor_dim as i64]);
            let name = l.fresh(&format!("{base}__trim"));
            x = l.node(op("", "Slice", vec![]), vec![Some(x), Some(st), Some(en), Some(ax)], &[name])[0];
        }
        pads[h.spatial] = h.pad_before as i64;
        pads[h.spatial + k] = h.pad_after as i64;
    }
    ins[0] = Some(x);
    let mut o = node.op.clone();
    match &mut o {
        Op::Conv(c) => {
            c.pads = Some(pads);
            c.auto_pad = None;
        }
        Op::MaxPool(p) => {
            p.pads = Some(pads);
            p.auto_pad = None;
            p.ceil_mode = None;
        }
        Op::AveragePool(p) => {
            p.pads = Some(pads);
            p.auto_pad = None;
            p.ceil_mode = None;
        }
        Op::LpPool(p) => {
            p.pads = Some(pads);
            p.auto_pad = None;
            p.ceil_mode = None;
        }
        _ => {}
    }
    // Other splits of the same op (batch, channels) are handled as in the direct case.
    let (_, outs) = strategy_shardings(sp, s);
    let _ = outs;
    let reduced: Vec<usize> = s
        .iter()
        .enumerate()
        .filter_map(|(a, d)| d.filter(|&i| matches!(sp.dims[i].kind, DimKind::Reduction)).map(|_| a))
        .collect();
    if !reduced.is_empty() && !reduced.iter().all(|&a| l.coords[a] == 0) && ins.len() > 2 {
        ins[2] = None;
    }
    if let Op::Conv(c) = &mut o {
        let gsplit: usize = s
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_some_and(|i| sp.dims[i].name == "g"))
            .map(|(a, _)| l.mesh.axes[a].size)
            .product();
        if gsplit > 1 {
            c.group = Some(c.group() / gsplit as i64);
        }
    }
    Ok(l.node(o, ins, out_names))
}

/// Axes as the op expects them at this opset: an input (opset ≥ 13 for Sum, ≥ 18 otherwise) or
/// an attribute.
fn reduce(l: &mut Local<'_>, kind: &str, x: Value, axes: &[usize], base: &str) -> Value {
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let as_input = if kind == "ReduceSum" { l.g.opset >= 13 } else { l.g.opset >= 18 };
    if as_input {
        let a = l.const_i64(&format!("{base}__axes"), &ax);
        let name = l.fresh(base);
        l.node(op("", kind, vec![attr("keepdims", AttrValue::Int(1))]), vec![Some(x), Some(a)], &[name])[0]
    } else {
        l.simple(kind, vec![attr("axes", AttrValue::Ints(ax)), attr("keepdims", AttrValue::Int(1))], &[x], base)
    }
}

/// The mesh axes splitting any of the iteration dims `dims`.
fn axes_splitting(s: &[Option<usize>], dims: &[usize]) -> Vec<usize> {
    s.iter().enumerate().filter_map(|(a, d)| d.filter(|i| dims.contains(i)).map(|_| a)).collect()
}

#[allow(clippy::too_many_arguments)]
fn emit_softmax(
    l: &mut Local<'_>,
    n: NodeId,
    _sp: &IterSpace,
    s: &[Option<usize>],
    x: Value,
    log: bool,
    stat: &[usize],
    out: &str,
) -> Result<Value, LowerError> {
    let g = l.g;
    let base = g.value_name(Value::new(n, 0)).to_string();
    // Pointwise spaces: iteration dim i is tensor dim i.
    let axes = axes_splitting(s, stat);
    let group = l.group(&axes);
    let m = reduce(l, "ReduceMax", x, stat, &format!("{base}__max"));
    let mg = l.comm(
        "AllReduce",
        vec![attr("group", AttrValue::Ints(group.clone())), attr("op", AttrValue::String("max".into()))],
        m,
        &format!("{base}__gmax"),
    );
    let shifted = l.simple("Sub", vec![], &[x, mg], &format!("{base}__shift"));
    let e = l.simple("Exp", vec![], &[shifted], &format!("{base}__exp"));
    let sum = reduce(l, "ReduceSum", e, stat, &format!("{base}__sum"));
    let sg = l.comm("AllReduce", vec![attr("group", AttrValue::Ints(group))], sum, &format!("{base}__gsum"));
    let name = out.to_string();
    Ok(if log {
        let lg = l.simple("Log", vec![], &[sg], &format!("{base}__logsum"));
        l.node(op("", "Sub", vec![]), vec![Some(shifted), Some(lg)], &[name])[0]
    } else {
        l.node(op("", "Div", vec![]), vec![Some(e), Some(sg)], &[name])[0]
    })
}

#[allow(clippy::too_many_arguments)]
fn emit_layernorm(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    ins: &[Option<Value>],
    axis: usize,
    out: &str,
) -> Result<Value, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let Op::LayerNormalization(ln) = &node.op else { unreachable!() };
    let xv = node.input(0).expect("x");
    let dims = dims_of(g, xv)?;
    let r = dims.len();
    let stat: Vec<usize> = (axis..r).collect();
    let axes = axes_splitting(s, &stat);
    let group = l.group(&axes);
    let count: usize = dims[axis..].iter().product();
    let base = g.value_name(Value::new(n, 0)).to_string();
    let x = ins[0].expect("x");
    let dtype = dtype_of(g, xv);
    let inv_n = l.scalar(&format!("{base}__invn"), dtype, 1.0 / count as f64);
    let s1 = reduce(l, "ReduceSum", x, &stat, &format!("{base}__s1"));
    let s1g = l.comm("AllReduce", vec![attr("group", AttrValue::Ints(group.clone()))], s1, &format!("{base}__gs1"));
    let mean = l.simple("Mul", vec![], &[s1g, inv_n], &format!("{base}__mean"));
    let d = l.simple("Sub", vec![], &[x, mean], &format!("{base}__centered"));
    let d2 = l.simple("Mul", vec![], &[d, d], &format!("{base}__sq"));
    let s2 = reduce(l, "ReduceSum", d2, &stat, &format!("{base}__s2"));
    let s2g = l.comm("AllReduce", vec![attr("group", AttrValue::Ints(group))], s2, &format!("{base}__gs2"));
    let var = l.simple("Mul", vec![], &[s2g, inv_n], &format!("{base}__var"));
    let eps = l.scalar(&format!("{base}__eps"), dtype, ln.epsilon() as f64);
    let ve = l.simple("Add", vec![], &[var, eps], &format!("{base}__vareps"));
    let sd = l.simple("Sqrt", vec![], &[ve], &format!("{base}__std"));
    let y = l.simple("Div", vec![], &[d, sd], &format!("{base}__norm"));
    // Scale and bias: the device's slice of the normalized dims.
    let (_, outs) = strategy_shardings(sp, s);
    let out_layout = outs[0].clone();
    let mut cur = y;
    for (k, kind) in [(1usize, "Mul"), (2, "Add")] {
        let Some(pv) = node.input(k) else { continue };
        let pd = dims_of(g, pv)?;
        // Right-aligned broadcast: parameter dim j is x dim r - pd.len() + j.
        let off = r - pd.len();
        let layout: Sharding = out_layout
            .iter()
            .map(|x| match x {
                AxisShard::Split(d) if (*d as usize) >= off && pd[*d as usize - off] > 1 => {
                    AxisShard::Split((*d as usize - off) as u8)
                }
                AxisShard::Split(_) => AxisShard::Replicate,
                other => *other,
            })
            .collect();
        let p = l.get(pv, &layout)?;
        let last = k == 2 || node.input(2).is_none();
        if last {
            let name = out.to_string();
            cur = l.node(op("", kind, vec![]), vec![Some(cur), Some(p)], &[name])[0];
        } else {
            cur = l.simple(kind, vec![], &[cur, p], &format!("{base}__scaled"));
        }
    }
    if node.input(1).is_none() {
        let name = out.to_string();
        cur = l.node(op("", "Identity", vec![]), vec![Some(cur)], &[name])[0];
    }
    Ok(cur)
}

fn emit_vocab_gather(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    ins: &[Option<Value>],
    out: &str,
) -> Result<Value, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let Op::Gather(gt) = &node.op else { unreachable!() };
    let data_v = node.input(0).expect("data");
    let ddims = dims_of(g, data_v)?;
    let axis = {
        let a = gt.axis();
        if a < 0 { (a + ddims.len() as i64) as usize } else { a as usize }
    };
    let v_dim = (0..sp.dims.len()).find(|&i| sp.dims[i].role == ir::shard::DimRole::Vocab).expect("vocab dim");
    let (ins_l, _) = strategy_shardings(sp, s);
    let data_layout = ins_l[0].clone().expect("data layout");
    let (start, end) = crate::layout::dim_range(&data_layout, l.mesh, &l.coords, axis, ddims[axis]);
    let base = g.value_name(Value::new(n, 0)).to_string();
    let data = ins[0].expect("data");
    let idx = ins[1].expect("indices");
    let idx_t = dtype_of(g, node.input(1).expect("indices"));
    let _ = v_dim;
    let vfull = l.scalar(&format!("{base}__V"), idx_t, ddims[axis] as f64);
    let zero = l.scalar(&format!("{base}__zero"), idx_t, 0.0);
    let neg = l.simple("Less", vec![], &[idx, zero], &format!("{base}__neg"));
    let wrapped = l.simple("Add", vec![], &[idx, vfull], &format!("{base}__wrapped"));
    let idx_n = l.simple("Where", vec![], &[neg, wrapped, idx], &format!("{base}__idx"));
    let off = l.scalar(&format!("{base}__off"), idx_t, start as f64);
    let len = l.scalar(&format!("{base}__len"), idx_t, (end - start) as f64);
    let rel = l.simple("Sub", vec![], &[idx_n, off], &format!("{base}__rel"));
    let ge = l.simple("GreaterOrEqual", vec![], &[rel, zero], &format!("{base}__ge"));
    let lt = l.simple("Less", vec![], &[rel, len], &format!("{base}__lt"));
    let mask = l.simple("And", vec![], &[ge, lt], &format!("{base}__mask"));
    let safe = l.simple("Where", vec![], &[mask, rel, zero], &format!("{base}__safe"));
    let got =
        l.simple("Gather", vec![attr("axis", AttrValue::Int(axis as i64))], &[data, safe], &format!("{base}__local"));
    // Output dims: data[..axis] + indices + data[axis+1..]; the mask covers the index dims.
    let idims = dims_of(g, node.input(1).expect("indices"))?;
    let trailing = ddims.len() - axis - 1;
    let mut m = mask;
    if trailing > 0 {
        let axes: Vec<i64> = (0..trailing).map(|k| (axis + idims.len() + k) as i64).collect();
        m = if l.g.opset >= 13 {
            let a = l.const_i64(&format!("{base}__uaxes"), &axes);
            let name = l.fresh(&format!("{base}__maskx"));
            l.node(op("", "Unsqueeze", vec![]), vec![Some(mask), Some(a)], &[name])[0]
        } else {
            l.simple("Unsqueeze", vec![attr("axes", AttrValue::Ints(axes))], &[mask], &format!("{base}__maskx"))
        };
    }
    if axis > 0 {
        // Leading data dims come first in the output: the mask broadcasts from the right only
        // when they are absent; unsqueeze in front.
        let axes: Vec<i64> = (0..axis as i64).collect();
        m = if l.g.opset >= 13 {
            let a = l.const_i64(&format!("{base}__uaxes0"), &axes);
            let name = l.fresh(&format!("{base}__maskf"));
            l.node(op("", "Unsqueeze", vec![]), vec![Some(m), Some(a)], &[name])[0]
        } else {
            l.simple("Unsqueeze", vec![attr("axes", AttrValue::Ints(axes))], &[m], &format!("{base}__maskf"))
        };
    }
    let dt = dtype_of(g, data_v);
    let z = l.scalar(&format!("{base}__z"), dt, 0.0);
    let name = out.to_string();
    Ok(l.node(op("", "Where", vec![]), vec![Some(m), Some(got), Some(z)], &[name])[0])
}

/// The layout of a value a device holds, as text (for messages).
pub fn layout_text(l: &Sharding) -> String {
    sharding_to_string(l)
}
