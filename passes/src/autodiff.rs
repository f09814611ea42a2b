//! `autodiff`: turns a model into its training step — forward, loss, backward, optimizer
//! update — as one graph of ordinary IR ops.
//!
//! The loss is the model's only output when that is a rank-0 float (or the output
//! `--loss-output` names), or is appended (`softmax-cross-entropy`, `mse`, `mean` of an
//! output) with a graph input for the labels. Reverse mode walks the forward ops from the
//! loss back, calling each op's gradient rule ([`ir::ops::OpRules::grad`], in the op's own
//! module); gradients of a value read by several ops are summed. Every parameter
//! ([`ir::cost::is_param`]: a float initializer of two or more elements; single-element ones
//! are the exporter's constants, and one holding an infinity or NaN, or frozen by the user,
//! is a constant too) that receives a gradient is trainable (BatchNormalization's
//! running statistics get none); it
//! is updated by the optimizer's op (`SgdUpdate`, `AdamUpdate`) with its state in new
//! initializers.
//!
//! The training graph's interface ([`ir::train`] reads and writes it):
//! output 0 is the loss; an output per trainable initializer `P` is its gradient; an output
//! per initializer `S` (a parameter, optimizer state, the step counter `shardc__step`) is
//! the value it takes for the next step.
//!
//! [`TrainInfo::of`] reads it back, so a printed training graph parses back into one.

use std::collections::{BTreeMap, HashMap};

use ir::eval::Array;
use ir::op::{self, Op};
use ir::ops::grad::{GradCx, infer_node};
use ir::{DType, Graph, GraphOutput, NodeId, Output, TensorType, Value};
use serde::Serialize;

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

const NAME: &str = "autodiff";

/// The step counter initializer.
pub const STEP: &str = "shardc__step";

/// Which loss to train.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum LossSpec {
    /// The model's output: the only one (or `output`), a rank-0 float.
    #[default]
    Model,
    /// The named output as the loss.
    Output(String),
    /// Softmax cross-entropy over the last dim of an output (all outputs' first when
    /// `None`), against int64 class ids in a new input.
    SoftmaxCrossEntropy(Option<String>),
    /// Mean squared error of an output against a float target in a new input.
    Mse(Option<String>),
    /// The mean of an output.
    Mean(Option<String>),
}

impl LossSpec {
    /// Parses `softmax-cross-entropy[:OUTPUT]`, `mse[:OUTPUT]`, `mean[:OUTPUT]`.
    pub fn parse(s: &str) -> Result<LossSpec, String> {
        let (kind, out) = match s.split_once(':') {
            Some((k, o)) => (k, Some(o.to_string())),
            None => (s, None),
        };
        Ok(match kind {
            "softmax-cross-entropy" | "cross-entropy" | "xent" => LossSpec::SoftmaxCrossEntropy(out),
            "mse" => LossSpec::Mse(out),
            "mean" => LossSpec::Mean(out),
            _ => {
                return Err(format!(
                    "unknown loss `{s}`; losses are softmax-cross-entropy[:OUTPUT], mse[:OUTPUT], mean[:OUTPUT]"
                ));
            }
        })
    }
}

/// The optimizer and its hyper-parameters (torch.optim's meaning and defaults).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerSpec {
    /// torch.optim.SGD.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum.
        momentum: f64,
        /// Dampening.
        dampening: f64,
        /// Nesterov momentum.
        nesterov: bool,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
    },
    /// torch.optim.Adam, or AdamW with `decoupled`.
    Adam {
        /// Learning rate.
        lr: f64,
        /// β₁.
        beta1: f64,
        /// β₂.
        beta2: f64,
        /// ε.
        eps: f64,
        /// Weight decay (L2 for Adam, decoupled for AdamW).
        weight_decay: f64,
        /// AdamW.
        decoupled: bool,
    },
}

impl OptimizerSpec {
    /// SGD with torch's defaults except `lr` and `momentum`.
    pub fn sgd(lr: f64, momentum: f64) -> OptimizerSpec {
        OptimizerSpec::Sgd { lr, momentum, dampening: 0.0, nesterov: false, weight_decay: 0.0 }
    }

    /// Adam with torch's defaults except `lr`.
    pub fn adam(lr: f64) -> OptimizerSpec {
        OptimizerSpec::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false }
    }

    /// The state initializers of parameter `p`: (suffix, element type).
    fn state(&self) -> &'static [&'static str] {
        match self {
            OptimizerSpec::Sgd { .. } => &["momentum_buffer"],
            OptimizerSpec::Adam { .. } => &["exp_avg", "exp_avg_sq"],
        }
    }

    fn op(&self) -> Op {
        match *self {
            OptimizerSpec::Sgd { lr, momentum, dampening, nesterov, weight_decay } => Op::SgdUpdate(op::SgdUpdate {
                lr: Some(lr as f32),
                momentum: Some(momentum as f32),
                dampening: Some(dampening as f32),
                nesterov: Some(i64::from(nesterov)),
                weight_decay: Some(weight_decay as f32),
            }),
            OptimizerSpec::Adam { lr, beta1, beta2, eps, weight_decay, decoupled } => Op::AdamUpdate(op::AdamUpdate {
                lr: Some(lr as f32),
                beta1: Some(beta1 as f32),
                beta2: Some(beta2 as f32),
                epsilon: Some(eps as f32),
                weight_decay: Some(weight_decay as f32),
                decoupled: Some(i64::from(decoupled)),
            }),
        }
    }
}

/// The autodiff pass.
#[derive(Clone, Debug)]
pub struct Autodiff {
    /// The loss.
    pub loss: LossSpec,
    /// The optimizer.
    pub optimizer: OptimizerSpec,
}

impl Default for Autodiff {
    fn default() -> Self {
        Autodiff { loss: LossSpec::Model, optimizer: OptimizerSpec::sgd(0.01, 0.0) }
    }
}

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let info = autodiff(g, &self.loss, &self.optimizer).map_err(|e| PassError { pass: NAME.into(), errors: e })?;
        cx.stats.add("trainable parameters", info.trainable.len() as u64);
        let meta = cx.metadata.get_or_insert_with(Vec::new);
        meta.retain(|(k, _)| k != "shardc_optimizer");
        meta.push(("shardc_optimizer".into(), serde_json::to_string(&self.optimizer).expect("JSON")));
        Ok(Changed::Yes)
    }
}

/// The interface of a training graph (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TrainInfo {
    /// The loss output.
    pub loss: String,
    /// Trainable initializers, in graph order.
    pub trainable: Vec<String>,
    /// Per trainable initializer, its gradient output.
    pub gradients: BTreeMap<String, String>,
    /// Per state initializer (parameters, optimizer state, the step), its next-value output.
    pub state: BTreeMap<String, String>,
    /// Inputs added for the loss's labels or target.
    pub labels: Vec<String>,
    /// Where the loss is a mean over a count of labels (ignored labels, class weights): what
    /// it counts ([`crate::counted`]); gradient accumulation weighs micro-batches by it.
    pub counted: Option<crate::counted::CountedLabels>,
}

impl TrainInfo {
    /// Reads the interface of a training graph ([`ir::train`]); `None` when `g` is not one (no
    /// carried state).
    pub fn of(g: &Graph) -> Option<TrainInfo> {
        let mut info = TrainInfo { loss: g.value_name(g.outputs().first()?.value).to_string(), ..TrainInfo::default() };
        for (grad, p) in ir::train::gradient_outputs(g) {
            info.trainable.push(g.value_name(p).to_string());
            info.gradients.insert(g.value_name(p).to_string(), g.value_name(grad).to_string());
        }
        for (next, s) in ir::train::carried_state(g) {
            info.state.insert(g.value_name(s).to_string(), g.value_name(next).to_string());
        }
        info.counted = crate::counted::CountedLabels::of(g, g.outputs().first()?.value);
        (!info.state.is_empty()).then_some(info)
    }
}

fn err(msg: impl Into<String>) -> Vec<Located> {
    vec![Located::global(msg)]
}

/// The backward pass alone, in place: the loss (new label inputs named in `labels`), the
/// parameters trained (those that get a gradient are the keys of the map) and each one's
/// gradient value. [`autodiff`] adds the optimizer to it; the cost model reads what the
/// backward pass keeps of the forward from it ([`crate::cost::stash`]).
#[allow(clippy::type_complexity)]
pub fn gradients(
    g: &mut Graph,
    loss: &LossSpec,
    labels: &mut Vec<String>,
) -> Result<(Value, Vec<Value>, HashMap<Value, Value>), Vec<Located>> {
    if TrainInfo::of(g).is_some() {
        return Err(err("the graph is already a training graph"));
    }
    let infer = |g: &mut Graph| {
        ir::infer::infer_shapes(g, ir::infer::Mode::Check)
            .map_err(|e| e.into_iter().map(Located::from).collect::<Vec<_>>())
    };
    infer(g)?;
    let loss_v = loss_value(g, loss, labels)?;
    let order = g.topo_order().map_err(|_| err("the graph has a cycle"))?;
    for &n in &order {
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            if !g.value_name(v).is_empty() && !g.tensor_type(v).is_some_and(TensorType::is_static) {
                return Err(vec![Located::at(
                    g,
                    n,
                    format!(
                        "`{}` has no static shape; training needs static shapes (give --batch or --input-shape)",
                        g.value_name(v)
                    ),
                )]);
            }
        }
    }
    // An initializer also listed among the graph inputs (exports before IR 4 list every
    // weight there) is an input with a default value; trained, it is a parameter.
    let defaulted: Vec<(Value, ir::Tensor)> = g
        .inputs()
        .iter()
        .filter_map(|&n| match &g.node(n).op {
            Op::Input { default: Some(t) } if ir::cost::is_param(g, Value::new(n, 0)) => {
                Some((Value::new(n, 0), t.clone()))
            }
            _ => None,
        })
        .collect();
    for (v, t) in defaulted {
        g.bind_input(v, t);
    }
    // Tensors no step can train (an additive mask's `-inf`) are constants.
    ir::cost::freeze_non_finite(g);
    let candidates: Vec<Value> = g
        .initializers()
        .iter()
        .map(|&n| Value::new(n, 0))
        // The parameters the cost model prices (single-element initializers are the
        // exporter's constants: scales, epsilons, mask fill values, exponents).
        .filter(|&v| ir::cost::is_param(g, v))
        .collect();
    let grads = backward(g, &order, loss_v, &candidates)?;
    Ok((loss_v, candidates, grads))
}

/// Builds the training graph in place; returns its interface.
pub fn autodiff(g: &mut Graph, loss: &LossSpec, opt: &OptimizerSpec) -> Result<TrainInfo, Vec<Located>> {
    let mut labels = Vec::new();
    let (loss_v, candidates, grads) = gradients(g, loss, &mut labels)?;
    // Trainable: the candidates that received a gradient.
    let counted = crate::counted::CountedLabels::of(g, loss_v);
    let mut info = TrainInfo { loss: g.value_name(loss_v).to_string(), labels, counted, ..Default::default() };
    let mut outputs = vec![GraphOutput { value: loss_v, ty: g.value_type(loss_v).cloned() }];
    let step = g.add_initializer(STEP, Array::i64(vec![], vec![0]).to_tensor());
    let one = g.add_initializer(format!("{STEP}__one"), Array::i64(vec![], vec![1]).to_tensor());
    let next_step = add_named(g, Op::Add(op::Add::default()), &[Some(step), Some(one)], &[ir::train::next_name(STEP)])
        .map_err(err)?[0];
    let mut next: Vec<(String, Value)> = Vec::new();
    for &p in &candidates {
        let Some(&gv) = grads.get(&p) else { continue };
        let name = g.value_name(p).to_string();
        let gout = add_named(g, Op::Identity(op::Identity::default()), &[Some(gv)], &[ir::train::gradient_name(&name)])
            .map_err(err)?[0];
        outputs.push(GraphOutput { value: gout, ty: g.value_type(gout).cloned() });
        info.trainable.push(name.clone());
        info.gradients.insert(name.clone(), ir::train::gradient_name(&name));
        // The optimizer's state, zeros like the parameter.
        let t = g.initializer(p).expect("a parameter").clone();
        let dims: Vec<usize> = t.dims.iter().map(|&d| d.max(0) as usize).collect();
        let mut ins = vec![Some(p), Some(gout)];
        let mut outs = vec![ir::train::next_name(&name)];
        let mut states = Vec::new();
        for suffix in opt.state() {
            let sname = format!("{name}__{suffix}");
            // Of a parameter not loaded (external data), a fill: nothing held until run.
            let z = if t.is_external() {
                ir::Tensor::filled(t.dtype, t.dims.clone(), 0.0)
            } else {
                Array::zeros(t.dtype, dims.clone()).map_err(|e| err(e.to_string()))?.to_tensor()
            };
            let sv = g.add_initializer(sname.clone(), z);
            ins.push(Some(sv));
            outs.push(ir::train::next_name(&sname));
            states.push(sname);
        }
        ins.push(Some(next_step));
        let upd = add_named(g, opt.op(), &ins, &outs).map_err(err)?;
        next.push((name.clone(), upd[0]));
        for (k, s) in states.into_iter().enumerate() {
            next.push((s, upd[k + 1]));
        }
    }
    if info.trainable.is_empty() {
        return Err(err("no float initializer reaches the loss: nothing to train"));
    }
    // Running statistics: a training-mode BatchNormalization's running mean and variance
    // outputs become the next values of the initializers it read them from.
    let order = g.topo_order().map_err(|_| err("the graph has a cycle"))?;
    for &n in &order {
        let Op::BatchNormalization(b) = &g.node(n).op else { continue };
        if b.training_mode() == 0 {
            continue;
        }
        for (input, slot) in [(3usize, 1u16), (4, 2)] {
            let Some(src) = g.node(n).input(input) else { continue };
            if g.initializer(src).is_none() || g.node(n).outputs().len() <= slot as usize {
                continue;
            }
            let out = Value::new(n, slot);
            if g.value_name(out).is_empty() {
                let name = g.fresh_name(&format!("{}__batch", g.value_name(src)));
                g.rename(out, name);
                infer_node(g, n).map_err(err)?;
            }
            let sname = g.value_name(src).to_string();
            if info.state.contains_key(&sname) || next.iter().any(|(s, _)| *s == sname) {
                continue;
            }
            let v = add_named(g, Op::Identity(op::Identity::default()), &[Some(out)], &[ir::train::next_name(&sname)])
                .map_err(err)?[0];
            next.push((sname, v));
        }
    }
    next.push((STEP.to_string(), next_step));
    for (s, v) in next {
        info.state.insert(s, g.value_name(v).to_string());
        outputs.push(GraphOutput { value: v, ty: g.value_type(v).cloned() });
    }
    g.set_outputs(outputs);
    ir::infer::infer_shapes(g, ir::infer::Mode::Check)
        .map_err(|e| e.into_iter().map(Located::from).collect::<Vec<_>>())?;
    Ok(info)
}

/// Adds a node with outputs named `outs` and infers their types.
fn add_named(g: &mut Graph, op: Op, ins: &[Option<Value>], outs: &[String]) -> Result<Vec<Value>, String> {
    let id = g.add_node(op, ins.to_vec(), outs.iter().map(|n| Output::named(n.clone())).collect());
    infer_node(g, id)?;
    Ok((0..outs.len()).map(|s| Value::new(id, s as u16)).collect())
}

/// The output `name`, or the only one.
fn pick_output(g: &Graph, name: Option<&str>) -> Result<Value, Vec<Located>> {
    let outs: Vec<Value> = g.outputs().iter().map(|o| o.value).collect();
    match name {
        Some(n) => outs.iter().copied().find(|&v| g.value_name(v) == n).ok_or_else(|| {
            err(format!(
                "there is no output `{n}`; outputs are: {}",
                outs.iter().map(|&v| g.value_name(v)).collect::<Vec<_>>().join(", ")
            ))
        }),
        None => outs.first().copied().ok_or_else(|| err("the model has no outputs")),
    }
}

/// The loss value: the model's scalar output, or a loss appended to an output.
fn loss_value(g: &mut Graph, spec: &LossSpec, labels: &mut Vec<String>) -> Result<Value, Vec<Located>> {
    let scalar_float =
        |g: &Graph, v: Value| g.tensor_type(v).is_some_and(|t| t.dtype.is_float() && t.rank() == Some(0));
    let out_names =
        |g: &Graph| g.outputs().iter().map(|o| g.value_name(o.value).to_string()).collect::<Vec<_>>().join(", ");
    let (kind, out) = match spec {
        LossSpec::Model | LossSpec::Output(_) => {
            let v = match spec {
                LossSpec::Output(n) => pick_output(g, Some(n))?,
                _ => {
                    if g.outputs().len() != 1 {
                        return Err(err(format!(
                            "the model has {} outputs ({}): name the loss with --loss-output, or append one with --loss softmax-cross-entropy[:OUTPUT] | mse[:OUTPUT] | mean[:OUTPUT]",
                            g.outputs().len(),
                            out_names(g)
                        )));
                    }
                    pick_output(g, None)?
                }
            };
            if !scalar_float(g, v) {
                return Err(err(format!(
                    "output `{}` ({}) is not a scalar loss: append one with --loss softmax-cross-entropy[:OUTPUT] | mse[:OUTPUT] | mean[:OUTPUT]",
                    g.value_name(v),
                    g.tensor_type(v).map_or("untyped".into(), |t| t.to_string())
                )));
            }
            return Ok(v);
        }
        LossSpec::SoftmaxCrossEntropy(o) => ("xent", pick_output(g, o.as_deref())?),
        LossSpec::Mse(o) => ("mse", pick_output(g, o.as_deref())?),
        LossSpec::Mean(o) => ("mean", pick_output(g, o.as_deref())?),
    };
    let t = g.tensor_type(out).cloned().ok_or_else(|| err("the loss's output has no type"))?;
    let dims = t.static_dims().ok_or_else(|| err(format!("output `{}` has no static shape", g.value_name(out))))?;
    let base = g.value_name(out).to_string();
    let fresh = |g: &Graph, n: &str| -> String {
        let mut k = 0;
        loop {
            let c = if k == 0 { n.to_string() } else { format!("{n}_{k}") };
            if g.lookup(&c).is_none() {
                return c;
            }
            k += 1;
        }
    };
    let loss_name = fresh(g, "loss");
    let v = match kind {
        "xent" => {
            if dims.len() < 2 {
                return Err(err(format!("softmax cross-entropy needs class scores of rank ≥ 2, `{base}` is {t}")));
            }
            let c = *dims.last().expect("rank ≥ 2");
            let rows: i64 = dims[..dims.len() - 1].iter().product();
            let lname = fresh(g, "labels");
            let label_dims: Vec<i64> = dims[..dims.len() - 1].to_vec();
            let lab = g.add_input(lname.clone(), Some(ir::Type::Tensor(TensorType::fixed(DType::Int64, &label_dims))));
            labels.push(lname);
            let shape =
                g.add_initializer(fresh(g, "loss__scores_shape"), Array::i64(vec![2], vec![rows, c]).to_tensor());
            let lshape = g.add_initializer(fresh(g, "loss__labels_shape"), Array::i64(vec![1], vec![rows]).to_tensor());
            let s2 = add_named(
                g,
                Op::Reshape(op::Reshape::default()),
                &[Some(out), Some(shape)],
                &[fresh(g, "loss__scores")],
            )
            .map_err(err)?[0];
            let l2 = add_named(
                g,
                Op::Reshape(op::Reshape::default()),
                &[Some(lab), Some(lshape)],
                &[fresh(g, "loss__labels")],
            )
            .map_err(err)?[0];
            add_named(
                g,
                Op::SoftmaxCrossEntropyLoss(op::SoftmaxCrossEntropyLoss::default()),
                &[Some(s2), Some(l2)],
                &[loss_name],
            )
            .map_err(err)?[0]
        }
        _ => {
            let mut x = out;
            if kind == "mse" {
                let tname = fresh(g, "target");
                let tv = g.add_input(tname.clone(), Some(ir::Type::Tensor(TensorType::fixed(t.dtype, &dims))));
                labels.push(tname);
                let d = add_named(g, Op::Sub(op::Sub::default()), &[Some(out), Some(tv)], &[fresh(g, "loss__diff")])
                    .map_err(err)?[0];
                x = add_named(g, Op::Mul(op::Mul::default()), &[Some(d), Some(d)], &[fresh(g, "loss__sq")])
                    .map_err(err)?[0];
            }
            let axes: Vec<i64> = (0..dims.len() as i64).collect();
            let (op, ins) = if g.opset >= 18 {
                let a = g.add_initializer(fresh(g, "loss__axes"), Array::i64(vec![axes.len()], axes).to_tensor());
                (Op::ReduceMean(op::ReduceMean { keepdims: Some(0), ..Default::default() }), vec![Some(x), Some(a)])
            } else {
                (
                    Op::ReduceMean(op::ReduceMean { axes: Some(axes), keepdims: Some(0), ..Default::default() }),
                    vec![Some(x)],
                )
            };
            add_named(g, op, &ins, &[loss_name]).map_err(err)?[0]
        }
    };
    g.set_outputs(vec![GraphOutput { value: v, ty: g.value_type(v).cloned() }]);
    Ok(v)
}

/// Reverse mode from `loss` over the forward ops `order`; the gradient of each candidate
/// parameter that gets one.
fn backward(
    g: &mut Graph,
    order: &[NodeId],
    loss: Value,
    params: &[Value],
) -> Result<HashMap<Value, Value>, Vec<Located>> {
    // Values that depend on a parameter (gradients flow into them).
    let reach = ir::cost::reach(g, order, params.iter().copied().collect(), false);
    let mut contrib: HashMap<Value, Vec<Value>> = HashMap::new();
    let dt = g.tensor_type(loss).map_or(DType::Float, |t| t.dtype);
    let seed =
        g.add_initializer(ir::train::seed_name(g.value_name(loss)), Array::float(dt, vec![], vec![1.0]).to_tensor());
    contrib.insert(loss, vec![seed]);
    let mut counter = 0usize;
    for &n in order.iter().rev() {
        if matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef) {
            continue;
        }
        let n_out = g.node(n).num_outputs();
        let mut dys = Vec::with_capacity(n_out);
        for s in 0..n_out {
            let v = Value::new(n, s as u16);
            dys.push(match contrib.remove(&v) {
                Some(c) => Some(sum(g, &c, &mut counter).map_err(err)?),
                None => None,
            });
        }
        if dys.iter().all(Option::is_none) {
            continue;
        }
        let wants: Vec<bool> = g.node(n).inputs().iter().map(|v| v.is_some_and(|v| reach.contains(&v))).collect();
        if !wants.iter().any(|&w| w) {
            continue;
        }
        let op = g.node(n).op.clone();
        let mut cx = GradCx::new(g, n, dys, wants, &mut counter);
        match op.rules().grad(&mut cx) {
            None => {
                let g = cx.g;
                return Err(vec![Located::at(
                    g,
                    n,
                    format!(
                        "{} has no gradient rule, and it is on the path from the parameters to the loss",
                        g.describe(n)
                    ),
                )]);
            }
            Some(Err(e)) => {
                let g = cx.g;
                return Err(vec![Located::at(g, n, format!("the gradient of {}: {e}", g.describe(n)))]);
            }
            Some(Ok(())) => {}
        }
        let (dxs, added) = cx.into_grads();
        // Each backward op names the forward op it differentiates, so that a plan of the
        // forward model can run it on the same devices (autoshard::training).
        let key = g.node(n).outputs().first().map(|o| o.name.clone()).unwrap_or_default();
        if !key.is_empty() {
            for a in added {
                ir::train::set_grad_of(g, a, &key);
            }
        }
        for (i, dx) in dxs.into_iter().enumerate() {
            if let (Some(dx), Some(x)) = (dx, g.node(n).input(i)) {
                contrib.entry(x).or_default().push(dx);
            }
        }
    }
    let mut out = HashMap::new();
    for &p in params {
        if let Some(c) = contrib.remove(&p) {
            out.insert(p, sum(g, &c, &mut counter).map_err(err)?);
        }
    }
    Ok(out)
}

/// The sum of gradient contributions (one `Sum` node for several).
fn sum(g: &mut Graph, c: &[Value], counter: &mut usize) -> Result<Value, String> {
    if c.len() == 1 {
        return Ok(c[0]);
    }
    let base = g.value_name(c[0]).to_string();
    let name = loop {
        *counter += 1;
        let n = format!("{base}__sum{}", *counter);
        if g.lookup(&n).is_none() {
            break n;
        }
    };
    Ok(add_named(g, Op::Sum(op::Sum::default()), &c.iter().map(|&v| Some(v)).collect::<Vec<_>>(), &[name])?[0])
}
