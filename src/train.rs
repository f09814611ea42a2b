//! Training: golden training cases (`*.train.json`, the ../shared/golden-train format), the
//! training graph of a model, and the checks of a run against a case.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use ir::eval::Array;
use passes::autodiff::{LossSpec, OptimizerSpec, TrainInfo};

use crate::exec::array_from_json;

/// A golden training case.
#[derive(Clone, Debug)]
pub struct TrainCase {
    /// Every graph input.
    pub inputs: HashMap<String, Array>,
    /// The loss at the initial parameters.
    pub loss: f64,
    /// The trainable initializers, in torch order.
    pub trainable: Vec<String>,
    /// The gradient of every trainable initializer at the initial parameters.
    pub gradients: BTreeMap<String, Array>,
    /// Single steps from the initial parameters: the optimizer, the parameters after.
    pub steps: Vec<(OptimizerSpec, BTreeMap<String, Array>)>,
    /// Per optimizer kind, the losses before each of 10 steps.
    pub losses_over_steps: BTreeMap<String, Vec<f64>>,
    /// `(rtol, atol)`.
    pub tolerance: (f64, f64),
}

/// The optimizer of a case's `steps[k].optimizer` entry.
pub fn optimizer_from_json(v: &serde_json::Value) -> Result<OptimizerSpec, String> {
    let f = |k: &str, d: f64| v[k].as_f64().unwrap_or(d);
    Ok(match v["kind"].as_str().ok_or("an optimizer without kind")? {
        "sgd" => OptimizerSpec::Sgd {
            lr: f("lr", 0.01),
            momentum: f("momentum", 0.0),
            dampening: f("dampening", 0.0),
            nesterov: v["nesterov"].as_bool().unwrap_or(false),
            weight_decay: f("weight_decay", 0.0),
        },
        k @ ("adam" | "adamw") => {
            if v["amsgrad"].as_bool().unwrap_or(false) {
                return Err("amsgrad is not supported".into());
            }
            OptimizerSpec::Adam {
                lr: f("lr", 1e-3),
                beta1: f("beta1", 0.9),
                beta2: f("beta2", 0.999),
                eps: f("eps", 1e-8),
                weight_decay: f("weight_decay", if k == "adamw" { 1e-2 } else { 0.0 }),
                decoupled: k == "adamw",
            }
        }
        other => return Err(format!("unknown optimizer `{other}`")),
    })
}

fn tensors(v: &serde_json::Value) -> Result<BTreeMap<String, Array>, String> {
    let obj = v.as_object().ok_or("a tensor map is not an object")?;
    obj.iter().map(|(k, t)| Ok((k.clone(), array_from_json(t, k)?))).collect()
}

impl TrainCase {
    /// Reads a `*.train.json`.
    pub fn load(path: &Path) -> Result<TrainCase, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut steps = Vec::new();
        for s in v["steps"].as_array().cloned().unwrap_or_default() {
            steps.push((optimizer_from_json(&s["optimizer"])?, tensors(&s["parameters_after"])?));
        }
        let mut losses_over_steps = BTreeMap::new();
        if let Some(o) = v["losses_over_steps"].as_object() {
            for (k, l) in o {
                losses_over_steps
                    .insert(k.clone(), l.as_array().into_iter().flatten().filter_map(|x| x.as_f64()).collect());
            }
        }
        Ok(TrainCase {
            inputs: tensors(&v["inputs"])?.into_iter().collect(),
            loss: v["loss"].as_f64().ok_or("no loss")?,
            trainable: v["trainable"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|x| x.as_str().map(String::from))
                .collect(),
            gradients: tensors(&v["gradients"])?,
            steps,
            losses_over_steps,
            tolerance: (
                v["tolerance"]["rtol"].as_f64().unwrap_or(1e-4),
                v["tolerance"]["atol"].as_f64().unwrap_or(1e-5),
            ),
        })
    }

    /// The optimizer of kind `kind` (`sgd`, `adam`) in the case's steps.
    pub fn optimizer(&self, kind: &str) -> Option<&OptimizerSpec> {
        self.steps.iter().map(|s| &s.0).find(|o| match o {
            OptimizerSpec::Sgd { .. } => kind == "sgd",
            OptimizerSpec::Adam { decoupled, .. } => kind == if *decoupled { "adamw" } else { "adam" },
        })
    }
}

/// The training graph of `m` (shapes inferred, verified): forward, loss, backward, update.
pub fn training_model(m: &ir::Model, loss: &LossSpec, opt: &OptimizerSpec) -> Result<(ir::Model, TrainInfo), String> {
    let mut t = m.clone();
    // A training graph already (`shardc parse --passes autodiff` output): trained as it is.
    if let Some(info) = TrainInfo::of(&t.graph) {
        ir::infer::infer_shapes(&mut t.graph, ir::infer::Mode::Check).map_err(|e| format!("{e:?}"))?;
        return Ok((t, info));
    }
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default());
    pm.run(&mut t).map_err(|e| e.to_string())?;
    let info = passes::autodiff::autodiff(&mut t.graph, loss, opt).map_err(|e| {
        let g = &t.graph;
        e.first().map_or("autodiff failed".to_string(), |l| match l.node {
            Some(n) if g.contains(n) => l.msg.clone(),
            _ => l.msg.clone(),
        })
    })?;
    Ok((t, info))
}

/// The training graph of one of `m` micro-batches: the model re-batched to 1/m of its batch
/// (wherever each input carries it), then differentiated. Lowered and run with
/// [`crate::exec::as_micro_batches`], the runtime accumulates the gradients of the `m`
/// micro-batches and the optimizer steps once on their mean.
pub fn micro_training_model(
    model: &ir::Model,
    loss: &LossSpec,
    opt: &OptimizerSpec,
    m: usize,
) -> Result<ir::Model, String> {
    let mut micro = model.clone();
    micro.graph = crate::exec::one_micro_batch(&model.graph, m).map_err(|e| format!("--micro-batches {m}: {e}"))?;
    Ok(training_model(&micro, loss, opt)?.0)
}

/// Makes constant the float initializers of `g` that are not to be trained: those holding an
/// infinity or NaN ([`ir::cost::freeze_non_finite`]), those `patterns` name (a name, or a
/// prefix ending in `*`), and, given a golden case's `trainable` list (not empty), every other
/// ([`ir::cost::FROZEN`]; BatchNormalization's running statistics, its state, are left as
/// they are). Returns their names; a pattern that names no parameter is an error.
pub fn freeze(g: &mut ir::Graph, patterns: &[String], trainable: Option<&[String]>) -> Result<Vec<String>, String> {
    let mut names = ir::cost::freeze_non_finite(g);
    let params: Vec<ir::Value> = g
        .initializers()
        .iter()
        .chain(g.inputs())
        .map(|&n| ir::Value::new(n, 0))
        .filter(|&v| ir::cost::is_param(g, v))
        .collect();
    let matches = |p: &str, name: &str| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    };
    for p in patterns {
        if !params.iter().any(|&v| matches(p, g.value_name(v))) {
            return Err(format!("--freeze {p}: no float initializer of two or more elements is named so"));
        }
    }
    let listed = trainable.filter(|t| !t.is_empty());
    let running_stat = |g: &ir::Graph, v: ir::Value| {
        let users = g.users(v);
        !users.is_empty()
            && users.iter().all(|&(n, i)| matches!(g.node(n).op, ir::Op::BatchNormalization(_)) && (i == 3 || i == 4))
    };
    for v in params {
        if running_stat(g, v) {
            continue;
        }
        let name = g.value_name(v).to_string();
        if patterns.iter().any(|p| matches(p, &name)) || listed.is_some_and(|t| !t.contains(&name)) {
            ir::cost::freeze(g, v);
            names.push(name);
        }
    }
    Ok(names)
}

/// Makes constant the parameters of `g` that `plan` priced as constants (a plan made with
/// `--freeze`), so the step that runs is the step it priced. Returns their names.
pub fn freeze_as_planned(g: &mut ir::Graph, plan: &passes::autoshard::Plan) -> Vec<String> {
    let mut names = Vec::new();
    for t in plan.tensors.iter().filter(|t| t.kind == passes::autoshard::plan::TensorKind::Constant) {
        if let Some(v) = g.lookup(&t.name)
            && ir::cost::is_param(g, v)
        {
            ir::cost::freeze(g, v);
            names.push(t.name.clone());
        }
    }
    names
}

/// How far `a` is from the expected `e` in units of the tolerance `atol + rtol·|e|`: 0 for
/// the same value (the same infinity included: a mask's `-inf`), infinite for anything else
/// against an infinity, and for NaN.
pub fn excess(a: f64, e: f64, tol: (f64, f64)) -> f64 {
    // The same value, and NaN where NaN is expected (both runs diverged alike): no error.
    if a == e || (a.is_nan() && e.is_nan()) {
        0.0
    } else if e.is_finite() && !a.is_nan() {
        (a - e).abs() / (tol.1 + tol.0 * e.abs())
    } else {
        f64::INFINITY
    }
}

/// `|a − e| ≤ atol + rtol·|e|`, or `a` and `e` the same infinity or both NaN ([`excess`] at
/// most 1).
pub fn close(a: f64, e: f64, tol: (f64, f64)) -> bool {
    excess(a, e, tol) <= 1.0
}

/// `|a − e| ≤ atol + rtol·|e|` for every element; the first violation.
pub fn within(name: &str, actual: &Array, expected: &Array, tol: (f64, f64)) -> Result<(), String> {
    if actual.shape != expected.shape {
        return Err(format!("{name}: shape {:?}, expected {:?}", actual.shape, expected.shape));
    }
    let (a, e) = (actual.to_f64().map_err(|e| e.to_string())?, expected.to_f64().map_err(|e| e.to_string())?);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        if !close(*x, *y, tol) {
            return Err(format!("{name}[{i}]: {x}, expected {y} (rtol {}, atol {})", tol.0, tol.1));
        }
    }
    Ok(())
}

/// [`within`] for parameters trained by Adam, which divides each element's step by the root
/// of its squared gradients: the step follows the gradient's sign and its relative changes,
/// not its size, so an element whose gradient is numerically zero (a bias before a BatchNorm,
/// an attention key's bias: zero in exact arithmetic, rounding noise in float) moves by up to
/// `lr` a step in the direction of its noise, which two correct runs draw differently, and a
/// small gradient's rounding differences move it by `lr` times their relative size. Each
/// element is compared to within the tolerance plus what its gradient's rounding can move it
/// through that normalization over the steps: `lr_steps · min(2, 2·max(|Δg|, rtol·rms(g)) /
/// |g|)`, with `g` and `Δg` step 1's gradient and the two runs' difference in it (`grads`:
/// actual, expected — themselves checked within the tolerance) and `rms(g)` over its tensor:
/// rounding scales with the tensor's gradients, not the element's. A well-determined
/// element (`|g|` near the tensor's) gets `2·rtol·lr_steps`, below most `atol`s; a
/// numerically zero one up to `2·lr` a step. Returns how many elements needed more than the
/// tolerance.
pub fn within_adam(
    name: &str,
    actual: &Array,
    expected: &Array,
    tol: (f64, f64),
    grads: (Option<&Array>, Option<&Array>),
    lr_steps: f64,
) -> Result<usize, String> {
    let values = |g: Option<&Array>| g.and_then(|g| g.to_f64().ok()).filter(|g| g.len() == actual.numel());
    let (Some(ga), Some(ge)) = (values(grads.0), values(grads.1)) else {
        return within(name, actual, expected, tol).map(|()| 0);
    };
    if actual.shape != expected.shape {
        return Err(format!("{name}: shape {:?}, expected {:?}", actual.shape, expected.shape));
    }
    let (a, e) = (actual.to_f64().map_err(|e| e.to_string())?, expected.to_f64().map_err(|e| e.to_string())?);
    // Rounding in a gradient scales with its tensor's gradients (sums of the same terms), not
    // with the element's own: `rtol` of their root mean square.
    let rms = (ge.iter().map(|g| g * g).sum::<f64>() / ge.len().max(1) as f64).sqrt();
    let mut loose = 0;
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        if close(*x, *y, tol) {
            continue;
        }
        let relative = 2.0 * (ga[i] - ge[i]).abs().max(tol.0 * rms) / ge[i].abs();
        let slack = lr_steps * if relative.is_finite() { relative.min(2.0) } else { 2.0 };
        if !close(*x, *y, (tol.0, tol.1 + slack)) {
            return Err(format!(
                "{name}[{i}]: {x}, expected {y} (rtol {}, atol {} + {slack:.2e}: Adam's steps from step 1's gradients {}, expected {})",
                tol.0, tol.1, ga[i], ge[i]
            ));
        }
        loose += 1;
    }
    Ok(loose)
}

/// Inputs for training `g` drawn from `seed`: the model's inputs as `shardc run` draws them,
/// and class labels within the classes the loss scores (float targets in `[0, 1)`).
pub fn seeded_inputs(g: &ir::Graph, info: &TrainInfo, seed: u64) -> Result<HashMap<String, Array>, String> {
    let mut out = crate::exec::inputs_for(g, None, seed)?;
    for name in &info.labels {
        let v = g.lookup(name).ok_or_else(|| format!("no input `{name}`"))?;
        let t = g.tensor_type(v).ok_or_else(|| format!("input `{name}` has no type"))?;
        let dims: Vec<usize> = t
            .static_dims()
            .ok_or_else(|| format!("`{name}` has no static shape"))?
            .iter()
            .map(|&d| d as usize)
            .collect();
        let n: usize = dims.iter().product();
        let mut rng = ir::eval::Rng::new(seed ^ 0x1abe1);
        let a = if t.dtype.is_float() {
            Array::float(t.dtype, dims, (0..n).map(|_| rng.uniform(0.0, 1.0)).collect())
        } else {
            // The classes: the last dim of the scores the loss reads (through its reshape).
            let classes = g
                .node_ids()
                .find_map(|m| match &g.node(m).op {
                    ir::Op::SoftmaxCrossEntropyLoss(_) | ir::Op::NegativeLogLikelihoodLoss(_) => g
                        .node(m)
                        .input(0)
                        .and_then(|s| g.tensor_type(s))
                        .and_then(|t| t.static_dims())
                        .and_then(|d| d.last().copied()),
                    _ => None,
                })
                .ok_or("no classification loss reads the labels")?;
            Array::int(
                t.dtype,
                dims,
                (0..n).map(|_| ((rng.uniform(0.0, 1.0) * classes as f64) as i64).min(classes - 1)).collect(),
            )
        };
        out.insert(name.clone(), a);
    }
    Ok(out)
}

/// Named tensors.
pub type Tensors = BTreeMap<String, Array>;

/// The results of `steps` training steps run by a lowered program.
pub struct TrainRun {
    /// The loss before each step and after the last (`steps + 1` values).
    pub losses: Vec<f64>,
    /// Per trainable parameter, its gradient in step 1 (gathered from the shards).
    pub gradients: BTreeMap<String, Array>,
    /// Per trainable parameter, its value after the last step (gathered from the shards).
    pub parameters: BTreeMap<String, Array>,
    /// The other state the steps carry, after the last step: BatchNorm's running statistics,
    /// the optimizer's moments and step count (gathered from the shards).
    pub state: BTreeMap<String, Array>,
    /// The runtime's report (per device times and memory; the first step's outputs and the
    /// state moved into the fields above).
    pub report: codegen::RunReport,
}

/// Runs `steps` training steps of `program` (the training graph of `info`, lowered), with
/// parameters and optimizer state resident on the devices, then one more forward for the
/// loss after the last update.
pub fn run_steps(
    program: &codegen::Program,
    info: &TrainInfo,
    inputs: &HashMap<String, Array>,
    backend: codegen::Backend,
    steps: usize,
) -> Result<TrainRun, String> {
    run_steps_with(program, info, inputs, backend, steps, codegen::StepHook::default(), None)
}

/// [`run_steps`], calling `on_step` after each step (`steps + 1` calls: the last is the loss
/// after the last update), and with `distributed` this process's device only (then only
/// device 0's process gets the losses, gradients and parameters).
pub fn run_steps_with(
    program: &codegen::Program,
    info: &TrainInfo,
    inputs: &HashMap<String, Array>,
    backend: codegen::Backend,
    steps: usize,
    on_step: codegen::StepHook,
    distributed: Option<codegen::Distributed>,
) -> Result<TrainRun, String> {
    let micro_weights = micro_weights(program, info, inputs)?;
    let run_opts = codegen::RunOptions {
        on_step,
        distributed,
        micro_weights,
        backend,
        steps: steps + 1,
        carry: info.state.iter().map(|(s, n)| (s.clone(), n.clone())).collect(),
        every_step: vec![info.loss.clone()],
        first_step: info.gradients.values().cloned().collect(),
        // The extra step measures the loss after the last update; the rest stays on the devices.
        outputs_at_end: false,
        updates: Some(steps),
        ..Default::default()
    };
    let mut report = codegen::run(program, inputs, &run_opts).map_err(|e| format!("training failed: {e}"))?;
    let losses: Vec<f64> = report
        .per_step
        .iter()
        .map(|s| s.iter().find(|(n, _)| *n == info.loss).and_then(|(_, a)| a.to_f64().ok()).map_or(f64::NAN, |v| v[0]))
        .collect();
    // The first step's gradients and the final state move out of the report.
    let mut first: HashMap<String, Array> =
        report.per_step.first_mut().map(|s| s.drain(..).collect()).unwrap_or_default();
    let gradients: BTreeMap<String, Array> =
        info.gradients.iter().filter_map(|(p, gname)| first.remove(gname).map(|a| (p.clone(), a))).collect();
    let mut state: HashMap<String, Array> = report.state.drain(..).collect();
    let parameters: BTreeMap<String, Array> =
        info.trainable.iter().filter_map(|p| state.remove(p).map(|a| (p.clone(), a))).collect();
    let state: BTreeMap<String, Array> = state.into_iter().filter(|(n, _)| info.state.contains_key(n)).collect();
    Ok(TrainRun { losses, gradients, parameters, state, report })
}

/// Under gradient accumulation, each micro-batch's weight in the step's mean, where the loss
/// is a mean over labels the micro-batches count differently (ignored labels, class weights;
/// [`passes::counted`]): its count over the batch's. `None` where they weigh the same. A loss
/// that adds such a mean to other terms cannot be weighed so: refused when the counts differ.
pub fn micro_weights(
    program: &codegen::Program,
    info: &TrainInfo,
    inputs: &HashMap<String, Array>,
) -> Result<Option<Vec<f64>>, String> {
    let m = program.micro_batches.max(1);
    let Some(counted) = info.counted.as_ref().filter(|_| m > 1) else { return Ok(None) };
    let axis = program.inputs.iter().find(|gi| gi.name == counted.input).and_then(|gi| gi.batch_axis);
    let (Some(axis), Some(labels)) = (axis, inputs.get(&counted.input)) else { return Ok(None) };
    let counts = counted.counts(labels, axis, m)?;
    let total: f64 = counts.iter().sum();
    if total == 0.0 || counts.iter().all(|&c| c == counts[0]) {
        return Ok(None);
    }
    if !counted.alone {
        return Err(format!(
            "the {m} micro-batches count {counts:?} of the labels in `{}` (not ignored, or by class \
             weight), and the loss `{}` adds its mean over them to other terms: accumulating the \
             micro-batches would not compute the whole batch's step; run one micro-batch",
            counted.input, info.loss
        ));
    }
    Ok(Some(counts.into_iter().map(|c| c / total).collect()))
}

/// The same steps on the reference trainer (CPU, one device, float64 evaluation of the
/// training graph): losses (`steps + 1`), step 1's gradients, the parameters after.
pub fn reference_steps(
    g: &ir::Graph,
    inputs: &HashMap<String, Array>,
    steps: usize,
) -> Result<(Vec<f64>, Tensors, Tensors), String> {
    reference_run(g, inputs, steps).map(|(l, g, p, _)| (l, g, p))
}

/// [`reference_steps`], and the other state after the last step ([`TrainRun::state`]).
pub fn reference_run(
    g: &ir::Graph,
    inputs: &HashMap<String, Array>,
    steps: usize,
) -> Result<(Vec<f64>, Tensors, Tensors, Tensors), String> {
    let mut tr = passes::train::Trainer::new(g.clone())?;
    let mut losses = Vec::new();
    let mut gradients = BTreeMap::new();
    for i in 0..steps {
        let out = tr.step(inputs)?;
        losses.push(out.loss);
        if i == 0 {
            gradients = out.gradients;
        }
    }
    losses.push(tr.loss(inputs)?);
    let params = tr.info.trainable.clone();
    let parameters = params.iter().filter_map(|p| tr.get(p).map(|a| (p.clone(), a))).collect();
    let others: Vec<String> = tr.info.state.keys().filter(|s| !params.contains(s)).cloned().collect();
    let state = others.iter().filter_map(|s| tr.get(s).map(|a| (s.clone(), a))).collect();
    Ok((losses, gradients, parameters, state))
}

/// The largest `|a − e| / (atol + rtol·|e|)` over the elements of every tensor of `want`
/// (≤ 1: within tolerance), with the tensor it is in; a missing tensor or a shape mismatch
/// is infinite.
pub fn worst(got: &BTreeMap<String, Array>, want: &BTreeMap<String, Array>, tol: (f64, f64)) -> (f64, String) {
    let mut out = (0.0, String::new());
    for (name, w) in want {
        let r = match got.get(name) {
            Some(g) if g.shape == w.shape => match (g.to_f64(), w.to_f64()) {
                (Ok(a), Ok(e)) => a.iter().zip(&e).map(|(x, y)| excess(*x, *y, tol)).fold(0.0, f64::max),
                _ => f64::INFINITY,
            },
            _ => f64::INFINITY,
        };
        if r > out.0 || out.1.is_empty() {
            out = (r.max(out.0), if r >= out.0 { name.clone() } else { out.1 });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adam's parameters: a numerically zero gradient's noise step passes (within 2·lr a
    /// step), a well-determined element off by what a wrong update would make fails, and so
    /// does a zero-gradient element off by more than Adam's steps can move it.
    #[test]
    fn adam_parameters_are_compared_within_what_rounding_can_move_them() {
        let tol = (1e-4, 1e-5);
        let (lr, steps) = (0.01, 3.0);
        let arr = |v: Vec<f32>| Array::f32(vec![v.len()], v);
        // Step 1's gradients: a tensor's worth of real gradients and one numerically zero.
        let grads = arr(vec![0.5, -0.3, 0.2, 3e-10]);
        let grads_other = arr(vec![0.5, -0.3, 0.2, -2e-10]);
        let want = arr(vec![1.0, 2.0, 3.0, 0.1]);
        let check =
            |got: Vec<f32>| within_adam("p", &arr(got), &want, tol, (Some(&grads_other), Some(&grads)), lr * steps);
        // The zero-gradient element stepped the other way three times: 0.06 apart.
        assert_eq!(check(vec![1.0, 2.0, 3.0, 0.16]), Ok(1));
        assert!(check(vec![1.0, 2.0, 3.0, 0.2]).is_err(), "beyond 2·lr a step");
        // A real gradient's element off by one step of lr.
        let err = check(vec![1.0, 2.01, 3.0, 0.1]).unwrap_err();
        assert!(err.starts_with("p[1]"), "{err}");
        assert_eq!(check(vec![1.0, 2.0, 3.0, 0.1]), Ok(0));
        // Without gradients: the plain tolerance.
        assert!(within_adam("p", &arr(vec![1.0, 2.0, 3.0, 0.16]), &want, tol, (None, None), lr * steps).is_err());
    }
}

/// Where a training run diverged: the first step whose loss is not finite, and the tensors
/// (parameters, gradients) holding NaN or an infinity after it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Divergence {
    /// The first step (from 1) whose loss is NaN or infinite.
    pub loss_step: Option<usize>,
    /// Parameters with a non-finite element, and how many parameters there are.
    pub parameters: (Vec<String>, usize),
    /// Gradients with a non-finite element.
    pub gradients: Vec<String>,
}

/// The run's divergence, if any ([`Divergence`]).
pub fn divergence(
    losses: &[f64],
    parameters: &BTreeMap<String, Array>,
    gradients: &BTreeMap<String, Array>,
) -> Option<Divergence> {
    let bad = |m: &BTreeMap<String, Array>| -> Vec<String> {
        m.iter()
            .filter(|(_, a)| a.to_f64().is_ok_and(|v| v.iter().any(|x| !x.is_finite())))
            .map(|(k, _)| k.clone())
            .collect()
    };
    let d = Divergence {
        loss_step: losses.iter().position(|l| !l.is_finite()).map(|i| i + 1),
        parameters: (bad(parameters), parameters.len()),
        gradients: bad(gradients),
    };
    (d.loss_step.is_some() || !d.parameters.0.is_empty() || !d.gradients.is_empty()).then_some(d)
}

/// What to say of the single-device reference's divergence beside the run's (`run_diverged`):
/// divergence is the model's and its settings', not the plan's, when one device does it too.
pub fn reference_divergence_note(run_diverged: bool, reference: Option<Divergence>) -> Option<String> {
    match (run_diverged, reference) {
        (true, Some(r)) => Some(format!("the single-device reference diverged too: {r}")),
        (false, Some(r)) => Some(format!("the single-device reference diverged: {r}")),
        (true, None) => Some("the single-device reference did not diverge".into()),
        (false, None) => None,
    }
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            let mut s: Vec<String> = v.iter().take(3).map(|n| format!("`{n}`")).collect();
            if v.len() > 3 {
                s.push("…".into());
            }
            s.join(", ")
        };
        let mut parts = Vec::new();
        if let Some(k) = self.loss_step {
            parts.push(format!("the loss is not finite from step {k}"));
        }
        if !self.parameters.0.is_empty() {
            parts.push(format!(
                "{} of {} parameters hold NaN or Inf after the last step ({})",
                self.parameters.0.len(),
                self.parameters.1,
                list(&self.parameters.0)
            ));
        }
        if !self.gradients.is_empty() {
            parts.push(format!("{} gradients hold NaN or Inf ({})", self.gradients.len(), list(&self.gradients)));
        }
        f.write_str(&parts.join("; "))
    }
}
