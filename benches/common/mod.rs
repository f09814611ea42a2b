//! Shared by the benches (each uses part of it).
#![allow(dead_code)]

use shardc::codegen::{Backend, RunOptions};
use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::passes::cost::Cluster;
use shardc::session::{self, Choice};

/// Training steps a training-step figure runs, and the first ones it leaves out (they
/// compile kernels and fill caches).
pub const STEPS: usize = 8;
pub const WARMUP: usize = 2;

/// The median.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median warm training step of `path` (inputs reshaped to `shapes`) on one device of
/// `backend`, element-wise chains fused or not (SGD, lr 0.01, on a softmax cross-entropy,
/// after the `algebra` pass as `shardc train` trains it), and the kernels its last step
/// dispatched.
pub fn train_step(path: &str, shapes: &[(&str, &[i64])], backend: Backend, fusion: bool) -> (f64, u64) {
    let mut m = prepare(path, shapes, false);
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Algebra);
    pm.run(&mut m).expect("algebra");
    let loss = LossSpec::parse("softmax-cross-entropy").expect("loss");
    let sgd = OptimizerSpec::Sgd { lr: 0.01, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    let (tm, info) = shardc::train::training_model(&m, &loss, &sgd).expect("training graph");
    let cluster = Cluster::load("local-wgpu").expect("preset");
    let planned = session::plan(&tm.graph, Choice::Strategy("data"), &cluster, 1, &Default::default()).expect("plan");
    let inputs = shardc::train::seeded_inputs(&tm.graph, &info, 0).expect("inputs");
    let opts = RunOptions {
        backend,
        fusion,
        steps: STEPS,
        carry: info.state.iter().map(|(s, n)| (s.clone(), n.clone())).collect(),
        every_step: vec![info.loss.clone()],
        outputs_at_end: false,
        ..Default::default()
    };
    let r = shardc::codegen::run(&planned.program, &inputs, &opts).expect("trains");
    let d = &r.devices[0];
    (median(d.step_wall_s[WARMUP..].to_vec()), d.dispatches)
}

/// torch's figures from `scripts/torch-train-step.py` (eager, one thread: GEMM rates and the
/// training steps of ResNet-18 and GPT-2 small4), or why there are none.
pub fn torch() -> Result<serde_json::Value, String> {
    let python = std::env::var("SHARDC_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/torch-train-step.py");
    let out = std::process::Command::new(&python)
        .args([script, &STEPS.to_string(), &WARMUP.to_string()])
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("failed").to_string());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

/// A one-device training case beside torch: name, model, input shapes, torch's key.
pub type TrainCase = (&'static str, String, Vec<(&'static str, &'static [i64])>, &'static str);

/// The one-device training cases beside torch.
pub fn train_cases() -> Vec<TrainCase> {
    let root = env!("CARGO_MANIFEST_DIR");
    vec![
        (
            "ResNet-18 8×3×32×32",
            format!("{root}/tests/data/models/tv_resnet18.onnxtxt"),
            vec![("input", &[8, 3, 32, 32])],
            "resnet18",
        ),
        (
            "GPT-2 small4 4×32",
            format!("{root}/tests/data/models/hf_gpt2_small4.onnxtxt"),
            vec![("input_ids", &[4, 32])],
            "gpt2_small4",
        ),
    ]
}

/// A model with some inputs re-shaped (`rebatch`), shapes inferred, canonicalized when
/// `canonical` (a training graph keeps the parameters as the model names them), and its
/// weights inline: read from the external data beside it, else drawn from seed 0.
pub fn prepare(path: &str, shapes: &[(&str, &[i64])], canonical: bool) -> shardc::ir::Model {
    let mut m = shardc::load_model(std::path::Path::new(path)).expect("model loads").model;
    let mut pm = shardc::passes::PassManager::new();
    let dir = std::path::Path::new(path).parent().unwrap_or(std::path::Path::new("."));
    if !shapes.is_empty() {
        // Constants in external data change with the new dims: read, or drawn where the file
        // is absent (as `shardc train --input-shape` does).
        let spec = shardc::passes::RebatchSpec {
            batch: None,
            input_shapes: shapes.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect(),
            external: shardc::passes::ExternalData::Read(shardc::exec::external_reader(dir)),
            ..Default::default()
        };
        pm.add(shardc::passes::Rebatch { spec });
    }
    pm.add(shardc::passes::InferShapes::default());
    if canonical {
        pm.add(shardc::passes::Canonicalize);
    }
    pm.run(&mut m).expect("passes run");
    shardc::exec::materialize(&mut m, dir, 0).expect("weights");
    m
}
