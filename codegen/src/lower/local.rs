//! The per-device emit context: the local graph being built, typed constructors for the ops
//! lowering adds, local shapes (mesh pieces and micro-batches), and the layouts each global
//! value is held in.

use std::collections::HashMap;

use ir::eval::Array;
use ir::op::{self as o, Op};
use ir::reshard::{CommStep, Policy, StepKind};
use ir::shard::{AxisShard, Mesh, Sharding, sharding_to_string};
use ir::{DType, Graph, NodeId, Output, TensorType, Type, Value};

use super::{LowerError, LowerErrorKind};
use crate::layout::piece;
use crate::program::{Feed, Placement};

/// What every device's lowering shares.
pub(crate) struct Shared<'a> {
    /// The global graph (full batch, shapes inferred).
    pub g: &'a Graph,
    /// The placement.
    pub placement: &'a Placement,
    /// Per op output: its stage.
    pub stage_of_value: HashMap<Value, usize>,
    /// Per op output: the tag of its pipeline messages.
    pub value_tag: HashMap<Value, i64>,
    /// Per value: which dims carry the batch (divided into micro-batches).
    pub batch: HashMap<Value, Vec<bool>>,
    /// Per graph output, the dims its delivered layout keeps cuts of
    /// ([`ir::reshard::output_cuts`]).
    pub cuts: HashMap<Value, Vec<bool>>,
    /// Ops computed from constants alone, which every stage computes for itself.
    pub everywhere: std::collections::HashSet<NodeId>,
    /// Carried state's next values delivered to other stages than their own, which hold the
    /// state too (a tied weight): those stages.
    pub deliver: HashMap<Value, Vec<usize>>,
    /// A training graph's op phases ([`ir::reshard::step_phases`]), which tag the
    /// communication each op's lowering emits.
    pub phases: Option<HashMap<NodeId, ir::reshard::Phase>>,
    /// Every stage has the same mesh: a value crossing a cut goes as each device's piece
    /// ([`ir::reshard::send_layout`]) to the device at its place; else whole.
    pub shard_sends: bool,
    /// ZeRO's layouts of parameters and gradients ([`ir::reshard::ZeroLayouts`]).
    pub zero: ir::reshard::ZeroLayouts,
}

/// One device's lowering state.
pub(crate) struct Local<'a> {
    pub sh: &'a Shared<'a>,
    pub g: &'a Graph,
    pub mesh: &'a Mesh,
    pub coords: Vec<usize>,
    pub stage: usize,
    pub device: usize,
    pub policy: Policy,
    pub lg: Graph,
    /// Local value of (global value, layout).
    pub have: HashMap<(Value, Sharding), Value>,
    /// Layout each value was produced (or first fed) in on this device's stage.
    pub produced: HashMap<Value, Sharding>,
    pub feeds: Vec<Feed>,
    /// The initializers cut from the graph's ([`crate::DeviceProgram::pieces`]).
    pub pieces: Vec<Feed>,
    names: HashMap<String, usize>,
    pub fallbacks: Vec<String>,
    /// The phase of the op being lowered (a training graph's), put on the communication
    /// it emits ([`ir::reshard::PHASE`]).
    pub phase: Option<ir::reshard::Phase>,
    /// The model chunk being lowered (its position among the stages the device holds).
    pub chunk: usize,
    /// The chunk of every op emitted in a chunk after the first.
    pub chunk_of: HashMap<NodeId, usize>,
    /// The step phase of every op emitted for a training graph's op.
    pub phase_of: HashMap<NodeId, ir::reshard::Phase>,
    /// The receives of a tensor from a later stage.
    pub from_later: std::collections::HashSet<NodeId>,
}

impl<'a> Local<'a> {
    pub fn new(sh: &'a Shared<'a>, stage: usize, rank: usize) -> Local<'a> {
        let st = &sh.placement.stages[stage];
        let mut lg = Graph::new(format!("{}_device{}", sh.g.name, st.devices[rank]));
        lg.opset = sh.g.opset;
        Local {
            sh,
            g: sh.g,
            mesh: &st.mesh,
            coords: st.mesh.coords(rank),
            stage,
            device: st.devices[rank],
            policy: sh.placement.policy,
            lg,
            have: HashMap::new(),
            produced: HashMap::new(),
            feeds: Vec::new(),
            pieces: Vec::new(),
            names: HashMap::new(),
            fallbacks: Vec::new(),
            phase: None,
            chunk: 0,
            chunk_of: HashMap::new(),
            phase_of: HashMap::new(),
            from_later: Default::default(),
        }
    }

    /// An error at node `n` of the global graph.
    pub fn err(&self, n: Option<NodeId>, kind: LowerErrorKind, msg: impl Into<String>) -> LowerError {
        LowerError { device: Some(self.device), node: n.map(|n| self.g.describe(n)), kind, message: msg.into() }
    }

    /// A fresh local name from `base`.
    pub fn fresh(&mut self, base: &str) -> String {
        let k = self.names.entry(base.to_string()).or_insert(0);
        *k += 1;
        if *k == 1 && self.lg.lookup(base).is_none() { base.to_string() } else { format!("{base}__{}", *k) }
    }

    /// Adds `op` with `inputs` and outputs named `outs` (empty: omitted).
    pub fn emit(&mut self, op: Op, inputs: Vec<Option<Value>>, outs: &[String]) -> Vec<Value> {
        let outputs: Vec<Output> = outs.iter().map(|n| Output::named(n.clone())).collect();
        let comm = op.class() == ir::OpClass::Comm;
        let id = self.lg.add_node(op, inputs, outputs);
        if self.chunk > 0 {
            self.chunk_of.insert(id, self.chunk);
        }
        if let Some(p) = self.phase {
            self.phase_of.insert(id, p);
            if comm {
                self.lg.set_annotation(id, ir::reshard::PHASE, p.name());
            }
        }
        (0..outs.len()).map(|s| Value::new(id, s as u16)).collect()
    }

    /// Adds a one-output op on `inputs`, its output named after `base`.
    pub fn op1(&mut self, op: Op, inputs: &[Value], base: &str) -> Value {
        let name = self.fresh(base);
        self.emit(op, inputs.iter().map(|v| Some(*v)).collect(), &[name])[0]
    }

    /// Adds a one-output op whose output takes exactly `name`.
    pub fn op_named(&mut self, op: Op, inputs: &[Value], name: &str) -> Value {
        self.emit(op, inputs.iter().map(|v| Some(*v)).collect(), &[name.to_string()])[0]
    }

    /// A local initializer.
    pub fn init(&mut self, base: &str, a: &Array) -> Value {
        let name = self.fresh(base);
        let mut t = a.to_tensor();
        t.name = None;
        self.lg.add_initializer(name, t)
    }

    /// An int64 vector initializer.
    pub fn const_i64(&mut self, base: &str, v: &[i64]) -> Value {
        self.init(base, &Array::i64(vec![v.len()], v.to_vec()))
    }

    /// A scalar initializer of `dtype`.
    pub fn scalar(&mut self, base: &str, dtype: DType, x: f64) -> Value {
        let a = match dtype {
            DType::Bool => Array::bool(vec![], vec![x != 0.0]),
            d if d.is_int() => Array::int(dtype, vec![], vec![x as i64]),
            _ => Array::float(dtype, vec![], vec![x]),
        };
        self.init(base, &a)
    }

    /// Global device ids of the devices that differ from this one only on `axes`, in order.
    pub fn group(&self, axes: &[usize]) -> Vec<i64> {
        let stage = &self.sh.placement.stages[self.stage];
        let total: usize = axes.iter().map(|&a| self.mesh.axes[a].size).product();
        (0..total)
            .map(|k| {
                let mut c = self.coords.clone();
                let mut rem = k;
                for &a in axes.iter().rev() {
                    c[a] = rem % self.mesh.axes[a].size;
                    rem /= self.mesh.axes[a].size;
                }
                stage.devices[self.mesh.device(&c)] as i64
            })
            .collect()
    }

    /// The shape of one micro-batch of global value `v` (its batch dims divided).
    pub fn micro_dims(&self, v: Value) -> Result<Vec<usize>, LowerError> {
        let dims = self.global_dims(v)?;
        let m = self.sh.placement.micro_batches.max(1);
        if m == 1 {
            return Ok(dims);
        }
        let flags = self.sh.batch.get(&v).cloned().unwrap_or_default();
        Ok(dims
            .iter()
            .enumerate()
            .map(|(d, &x)| if flags.get(d).copied().unwrap_or(false) { x / m } else { x })
            .collect())
    }

    /// The global shape of `v`.
    pub fn global_dims(&self, v: Value) -> Result<Vec<usize>, LowerError> {
        self.g
            .tensor_type(v)
            .and_then(TensorType::static_dims)
            .map(|d| d.into_iter().map(|x| x.max(0) as usize).collect())
            .ok_or_else(|| {
                self.err(
                    Some(v.node),
                    LowerErrorKind::Graph,
                    format!("`{}` has no static shape; infer shapes first", self.g.value_name(v)),
                )
            })
    }

    /// The shape of this device's piece of one micro-batch of `v` under `layout`.
    pub fn local_dims(&self, v: Value, layout: &Sharding) -> Result<Vec<usize>, LowerError> {
        Ok(crate::layout::local_shape(&self.micro_dims(v)?, layout, self.mesh))
    }

    /// The element type of `v`.
    pub fn dtype(&self, v: Value) -> DType {
        self.g.tensor_type(v).map_or(DType::Float, |t| t.dtype)
    }

    /// The algebra's steps from `from` to `to` for global value `v` (one micro-batch).
    pub fn steps(&self, v: Value, from: &Sharding, to: &Sharding) -> Result<Vec<CommStep>, LowerError> {
        let dims: Vec<i64> = self.micro_dims(v)?.iter().map(|&d| d as i64).collect();
        Ok(ir::reshard::reshard(&dims, self.dtype(v).size_bytes() as f64, from, to, self.mesh, self.policy))
    }

    /// Emits the steps that reshard local `x` (global `v`, layout `from`) to `to`.
    pub fn reshard(&mut self, v: Value, x: Value, from: &Sharding, to: &Sharding) -> Result<Value, LowerError> {
        let steps = self.steps(v, from, to)?;
        let base = self.g.value_name(v).to_string();
        let mut x = x;
        let mut cur = from.clone();
        for st in steps {
            x = self.step(v, x, &cur, &st, &base)?;
            cur = st.to.clone();
        }
        Ok(x)
    }

    /// Emits one step of the algebra.
    fn step(&mut self, v: Value, x: Value, cur: &Sharding, st: &CommStep, base: &str) -> Result<Value, LowerError> {
        let group = Some(self.group(&st.axes));
        Ok(match &st.kind {
            StepKind::AllReduce => {
                self.op1(Op::AllReduce(o::AllReduce { group, op: None }), &[x], &format!("{base}__ar"))
            }
            StepKind::ReduceScatter { dim } => self.op1(
                Op::ReduceScatter(o::ReduceScatter { axis: Some(*dim as i64), group, op: None }),
                &[x],
                &format!("{base}__rs"),
            ),
            StepKind::AllGather { dim } => {
                self.op1(Op::AllGather(o::AllGather { axis: Some(*dim as i64), group }), &[x], &format!("{base}__ag"))
            }
            StepKind::AllToAll { split, concat } => self.op1(
                Op::AllToAll(o::AllToAll { concat_axis: Some(*concat as i64), group, split_axis: Some(*split as i64) }),
                &[x],
                &format!("{base}__a2a"),
            ),
            StepKind::Slice => {
                let dims = self.micro_dims(v)?;
                let (mut starts, mut ends, mut axes) = (Vec::new(), Vec::new(), Vec::new());
                let before = ir::reshard::split_axes(cur, dims.len());
                let after = ir::reshard::split_axes(&st.to, dims.len());
                for d in 0..dims.len() {
                    if before[d] == after[d] {
                        continue;
                    }
                    // The piece of the new layout within the piece of the old one.
                    let (s0, _) = crate::layout::dim_range(cur, self.mesh, &self.coords, d, dims[d]);
                    let (s1, e1) = crate::layout::dim_range(&st.to, self.mesh, &self.coords, d, dims[d]);
                    starts.push((s1 - s0) as i64);
                    ends.push((e1 - s0) as i64);
                    axes.push(d as i64);
                }
                let s = self.const_i64(&format!("{base}__starts"), &starts);
                let e = self.const_i64(&format!("{base}__ends"), &ends);
                let a = self.const_i64(&format!("{base}__axes"), &axes);
                self.op1(Op::Slice(o::Slice::default()), &[x, s, e, a], &format!("{base}__slice"))
            }
            StepKind::Zero => {
                let keep = st.axes.iter().all(|&a| self.coords[a] == 0);
                let k = self.scalar(&format!("{base}__keep"), self.dtype(v), if keep { 1.0 } else { 0.0 });
                self.op1(Op::Mul(o::Mul::default()), &[x, k], &format!("{base}__p"))
            }
        })
    }

    /// The local value of global `v` in layout `need` (fed, sliced from a weight, received
    /// from an earlier stage, or resharded from what this device holds).
    pub fn get(&mut self, v: Value, need: &Sharding) -> Result<Value, LowerError> {
        if let Some(&x) = self.have.get(&(v, need.clone())) {
            return Ok(x);
        }
        let g = self.g;
        let node = g.node(v.node);
        let name = g.value_name(v).to_string();
        // A source held once is held in the layout its first reader needs, whole where that
        // reader wants partial sums (`ir::reshard::held_layout`); other layouts are resharded
        // from it.
        let source = matches!(node.op, Op::Input { .. } | Op::Initializer(_));
        if source && ir::reshard::held_once(g, v) {
            let first = || self.sh.zero.params.get(&v).cloned().unwrap_or_else(|| ir::reshard::held_layout(need));
            let held = self.produced.get(&v).cloned().or_else(|| Some(first()).filter(|w| w != need));
            if let Some(from) = held {
                let x0 = self.get(v, &from)?;
                let x = self.reshard(v, x0, &from, need)?;
                self.have.insert((v, need.clone()), x);
                return Ok(x);
            }
        }
        let x = match &node.op {
            Op::Input { default: None } => {
                let local = self.fresh(&name);
                let shape: Vec<i64> = self.local_dims(v, need)?.iter().map(|&x| x as i64).collect();
                let t = TensorType::fixed(self.dtype(v), &shape);
                let x = self.lg.add_input(local.clone(), Some(Type::Tensor(t)));
                self.feeds.push(Feed { local, global: name.clone(), layout: need.clone() });
                x
            }
            Op::Initializer(t) | Op::Input { default: Some(t) } => {
                if self.sh.placement.micro_batches > 1 && self.sh.batch.get(&v).is_some_and(|f| f.iter().any(|&b| b)) {
                    return Err(self.err(
                        Some(v.node),
                        LowerErrorKind::Graph,
                        format!("constant `{name}` carries the batch, so it cannot be cut into micro-batches"),
                    ));
                }
                if t.is_external() {
                    // Shape only: the device's piece keeps a reference to the data it comes from.
                    let local = self.local_dims(v, need)?;
                    let mut entries = match &t.data {
                        ir::TensorData::External(e) => {
                            e.iter().filter(|(k, _)| k == "location" || k == ir::FILL).cloned().collect()
                        }
                        _ => Vec::new(),
                    };
                    entries.push((
                        "shardc_piece".to_string(),
                        format!("{} at {:?}", sharding_to_string(need), self.coords),
                    ));
                    let tensor = ir::Tensor {
                        dtype: t.dtype,
                        dims: local.iter().map(|&x| x as i64).collect(),
                        name: None,
                        data: ir::TensorData::External(entries),
                    };
                    let local_name = self.fresh(&name);
                    self.pieces.push(Feed { local: local_name.clone(), global: name.clone(), layout: need.clone() });
                    self.lg.add_initializer(local_name, tensor)
                } else {
                    let a = Array::from_tensor(t)
                        .map_err(|e| self.err(Some(v.node), LowerErrorKind::Graph, format!("`{name}`: {e}")))?;
                    let p = piece(&a, need, self.mesh, &self.coords);
                    let x = self.init(&name, &p);
                    let local = self.lg.value_name(x).to_string();
                    self.pieces.push(Feed { local, global: name.clone(), layout: need.clone() });
                    x
                }
            }
            Op::OuterRef => {
                return Err(self.err(
                    Some(v.node),
                    LowerErrorKind::Graph,
                    format!("outer-scope value `{name}` in the main graph"),
                ));
            }
            _ => {
                let producer_stage = self.sh.stage_of_value.get(&v).copied().unwrap_or(0);
                // (A value of an earlier chunk of this device's is held, not received.)
                if producer_stage != self.stage
                    && !self.sh.everywhere.contains(&v.node)
                    && !self.produced.contains_key(&v)
                {
                    self.receive(v, need)?
                } else {
                    let from = self.produced.get(&v).cloned().ok_or_else(|| {
                        self.err(Some(v.node), LowerErrorKind::Graph, format!("`{name}` is used before it is computed"))
                    })?;
                    let x0 = self.have[&(v, from.clone())];
                    self.reshard(v, x0, &from, need)?
                }
            }
        };
        if source {
            self.produced.entry(v).or_insert_with(|| need.clone());
        }
        self.have.insert((v, need.clone()), x);
        Ok(x)
    }

    /// The forward pass has ended: copies of ZeRO-3 parameters gathered for it are not kept
    /// for the backward pass, which gathers them again ([`ir::reshard::ZeroLayouts::regathered`]).
    pub fn end_forward(&mut self) {
        let (zero, produced) = (&self.sh.zero, &self.produced);
        self.have.retain(|(v, layout), _| !zero.regathered(*v) || produced.get(v) == Some(layout));
    }

    /// The layout value `v` of another stage crosses the cut in ([`Shared::shard_sends`]):
    /// the layout its op's planned strategy produces, partial sums reduced; or whole.
    pub fn sent_layout(&self, v: Value) -> Sharding {
        let axes = self.mesh.axes.len();
        if !self.sh.shard_sends {
            return vec![AxisShard::Replicate; axes];
        }
        let s = self.sh.placement.strategies.get(&v.node).cloned().unwrap_or_else(|| vec![None; axes]);
        ir::reshard::send_layout(self.g, v, &s, axes)
    }

    /// A tensor from another pipeline stage: received, in the layout it crosses the cut in
    /// ([`Local::sent_layout`]), from the device of that stage at this device's rank (modulo
    /// its size), then resharded to `need`.
    fn receive(&mut self, v: Value, need: &Sharding) -> Result<Value, LowerError> {
        let sent: Sharding = self.sent_layout(v);
        if let Some(&x) = self.have.get(&(v, sent.clone())) {
            return self.reshard(v, x, &sent, need);
        }
        let from_stage = self.sh.stage_of_value.get(&v).copied().unwrap_or(0);
        let src = &self.sh.placement.stages[from_stage].devices;
        let rank = self.mesh.device(&self.coords);
        let peer = src[rank % src.len()];
        let shape: Vec<i64> = self.local_dims(v, &sent)?.iter().map(|&x| x as i64).collect();
        let name = self.fresh(&format!("{}__recv", self.g.value_name(v)));
        let recv = o::Recv {
            dtype: Some(self.dtype(v).code()),
            peer: Some(peer as i64),
            shape: Some(shape),
            tag: Some(self.sh.value_tag[&v]),
        };
        let x = self.emit(Op::Recv(recv), vec![], &[name])[0];
        if from_stage > self.stage {
            self.from_later.insert(x.node);
        }
        self.have.insert((v, sent.clone()), x);
        self.reshard(v, x, &sent, need)
    }
}
