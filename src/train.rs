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
    obj.iter().map(|(k, t)| Ok((k.clone(), array_from_json(t).map_err(|e| format!("`{k}`: {e}"))?))).collect()
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

/// `|a − e| ≤ atol + rtol·|e|` (false for NaN).
pub fn close(a: f64, e: f64, tol: (f64, f64)) -> bool {
    (a - e).abs() <= tol.1 + tol.0 * e.abs()
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
