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
use common::{median, torch, train_cases, train_step};

use std::time::Instant;

use shardc::codegen::Backend;
use shardc::codegen::runtime::cpu::CpuExecutor;
use shardc::ir::eval::Array;

/// The allocator the `shardc` binary runs with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

fn main() {
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
    for (name, path, shapes, key) in train_cases() {
        let (s, _) = train_step(&path, &shapes, Backend::Cpu, true);
        let t = col(key);
        println!(
            "  {name:<24} {s:>14.3} {:>7} {:>15}",
            t.map_or("-".into(), |t| format!("{t:.3}")),
            t.map_or("-".into(), |t| format!("{:.2}×", s / t))
        );
    }
}
