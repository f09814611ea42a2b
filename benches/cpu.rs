//! The CPU executor against the reference evaluator it is checked against and against torch
//! eager on this machine's CPU, side by side in one run: GEMM rates (512³, 2048³) and
//! training steps of ResNet-18 (8×3×32×32) and GPT-2 (4 layers, width 256; 4×32 tokens), one
//! simulated device (one thread) each, SGD on a softmax cross-entropy.
//!
//! Run with `cargo bench --bench cpu`. torch's column needs a Python with `torch`,
//! `torchvision` and `transformers` (`SHARDC_TORCH_PYTHON`, else `python3`); without it the
//! column is skipped with a note. torch runs on one thread (`torch.set_num_threads(1)`), as
//! each simulated device does. A step is the median of the steps after the first two.

mod common;
use common::prepare;

use std::time::Instant;

use shardc::codegen::Backend;
use shardc::codegen::runtime::cpu::CpuExecutor;
use shardc::ir::eval::Array;
use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::passes::cost::Cluster;
use shardc::session::{self, Choice};

/// The allocator the `shardc` binary runs with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const STEPS: usize = 8;
const WARMUP: usize = 2;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn filled(n: usize) -> Array {
    Array::f32(vec![n, n], (0..n * n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect())
}

/// GFLOP/s of an `n³` MatMul on the CPU executor and on the reference evaluator.
fn gemm_rates(n: usize) -> (f64, f64) {
    let (m, node) =
        shardc::calibrate::one_op(&format!("(float[{n},{n}] a, float[{n},{n}] b) => (y)"), "y = MatMul (a, b)")
            .expect("a GEMM model");
    let inputs = [filled(n), filled(n)];
    let mut cpu = CpuExecutor::new();
    let t = shardc::calibrate::time_node(&mut cpu, &m.graph, node, &inputs, 5).expect("runs");
    let refs: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
    let reps = if n > 1024 { 1 } else { 3 };
    let tr = median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(shardc::ir::eval::eval_node(&m.graph, node, &refs, &[]).expect("reference"));
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    let flops = 2.0 * (n as f64).powi(3);
    (flops / t / 1e9, flops / tr / 1e9)
}

/// The median warm training step of `path` (inputs reshaped to `shapes`) on one CPU device.
fn train_step(path: &str, shapes: &[(&str, &[i64])]) -> f64 {
    let mut m = prepare(path, shapes, false);
    // As `shardc train` trains it: after the `algebra` pass.
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Algebra);
    pm.run(&mut m).expect("algebra");
    let loss = LossSpec::parse("softmax-cross-entropy").expect("loss");
    let sgd = OptimizerSpec::Sgd { lr: 0.01, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    let (tm, info) = shardc::train::training_model(&m, &loss, &sgd).expect("training graph");
    let cluster = Cluster::load("local-wgpu").expect("preset");
    let planned = session::plan(&tm.graph, Choice::Strategy("data"), &cluster, 1, &Default::default()).expect("plan");
    let inputs = shardc::train::seeded_inputs(&tm.graph, &info, 0).expect("inputs");
    let run = shardc::train::run_steps(&planned.program, &info, &inputs, Backend::Cpu, STEPS).expect("trains");
    let steps = &run.report.devices[0].step_wall_s;
    median(steps[WARMUP..STEPS.min(steps.len())].to_vec())
}

/// torch's figures from `scripts/torch-train-step.py`, or why there are none.
fn torch() -> Result<serde_json::Value, String> {
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

fn main() {
    let root = env!("CARGO_MANIFEST_DIR");
    let torch = torch();
    match &torch {
        Ok(t) => println!("torch {} eager, one thread", t["torch"].as_str().unwrap_or("?")),
        Err(e) => println!("no torch column ({e}); set SHARDC_TORCH_PYTHON to a Python with torch"),
    }
    let col = |key: &str| torch.as_ref().ok().and_then(|t| t[key].as_f64());
    println!("GEMM (GFLOP/s, median of 5)      executor  reference  torch  executor/torch");
    for (n, key) in [(512usize, "gemm512_gflops"), (2048, "gemm2048_gflops")] {
        let (fast, reference) = gemm_rates(n);
        let t = col(key);
        println!(
            "  MatMul {n}³ {:>22.1} {:>10.1} {:>6} {:>15}",
            fast,
            reference,
            t.map_or("-".into(), |t| format!("{t:.1}")),
            t.map_or("-".into(), |t| format!("{:.2}", fast / t))
        );
    }
    println!("training step (s, median of warm steps)  executor   torch  executor/torch");
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a [i64])>, &'a str);
    let cases: [Case<'_>; 2] = [
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
    ];
    for (name, path, shapes, key) in cases {
        let s = train_step(&path, &shapes);
        let t = col(key);
        println!(
            "  {name:<24} {s:>14.3} {:>7} {:>15}",
            t.map_or("-".into(), |t| format!("{t:.3}")),
            t.map_or("-".into(), |t| format!("{:.2}×", s / t))
        );
    }
}
