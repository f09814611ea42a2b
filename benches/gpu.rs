//! The runtime on this machine's wgpu adapter (lavapipe without a GPU): kernel rates against
//! the CPU reference kernels, and the cost model's forward-pass prediction (the `local-wgpu`
//! preset, from `shardc calibrate`) against measured forward steps of real models under
//! several strategies, with the mean absolute percentage error.
//!
//! Run with `cargo bench --bench gpu` (`XDG_RUNTIME_DIR` set, a Vulkan driver installed);
//! `SHARDC_BENCH_ONLY=Conv` measures the kernels whose name contains `Conv`, alone.
//! Each figure is the median of several runs in this one process.

mod common;
use common::prepare;

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use shardc::calibrate::{one_op, time_node};
use shardc::codegen::runtime::Executor;
use shardc::codegen::runtime::cpu::CpuExecutor;
use shardc::codegen::runtime::gpu::GpuExecutor;
use shardc::codegen::{Backend, RunOptions};
use shardc::ir::eval::Array;
use shardc::passes::cost::{Cluster, Options};

fn filled(shape: &[usize]) -> Array {
    let n: usize = shape.iter().product();
    Array::f32(shape.to_vec(), (0..n).map(|i| ((i % 11) as f32 - 5.0) * 0.03).collect())
}

struct Kernel {
    name: &'static str,
    signature: String,
    body: &'static str,
    shapes: Vec<Vec<usize>>,
    /// FLOPs (or bytes for memory-bound kernels).
    work: f64,
    unit: &'static str,
}

fn kernels() -> Vec<Kernel> {
    let mut v = Vec::new();
    for n in [256usize, 512, 1024, 2048] {
        v.push(Kernel {
            name: ["MatMul 256³", "MatMul 512³", "MatMul 1024³", "MatMul 2048³"][n.trailing_zeros() as usize - 8],
            signature: format!("(float[{n},{n}] a, float[{n},{n}] b) => (y)"),
            body: "y = MatMul (a, b)",
            shapes: vec![vec![n, n], vec![n, n]],
            work: 2.0 * (n as f64).powi(3),
            unit: "GFLOP/s",
        });
    }
    // Long reductions over few rows (an output-head gradient, `[tokens × vocabulary] ·
    // [vocabulary × hidden]`), computed in chunks (`gemm::SPLIT_K_FROM`): the rate against the
    // square GEMMs' above.
    for (m, k, n) in [(64usize, 16384usize, 768usize), (32, 32768, 768)] {
        v.push(Kernel {
            name: if k == 16384 { "MatMul 64×16384·16384×768" } else { "MatMul 32×32768·32768×768" },
            signature: format!("(float[{m},{k}] a, float[{k},{n}] b) => (y)"),
            body: "y = MatMul (a, b)",
            shapes: vec![vec![m, k], vec![k, n]],
            work: 2.0 * (m * k * n) as f64,
            unit: "GFLOP/s",
        });
    }
    let conv = |name, x: [usize; 4], w: [usize; 4], attrs: &'static str, body: &'static str| {
        let (ho, wo) = (x[2], x[3]);
        let _ = attrs;
        Kernel {
            name,
            signature: format!(
                "(float[{},{},{},{}] x, float[{},{},{},{}] w) => (y)",
                x[0], x[1], x[2], x[3], w[0], w[1], w[2], w[3]
            ),
            body,
            shapes: vec![x.to_vec(), w.to_vec()],
            work: 0.0 * (ho * wo) as f64,
            unit: "GFLOP/s",
        }
    };
    let mut c = conv(
        "Conv 3×3 8×64×16×16→64",
        [8, 64, 16, 16],
        [64, 64, 3, 3],
        "",
        "y = Conv <pads: ints = [1, 1, 1, 1]> (x, w)",
    );
    c.work = 2.0 * (8 * 64 * 256 * 64 * 9) as f64;
    v.push(c);
    // Its two gradients, each as many FLOPs as the convolution.
    v.push(Kernel {
        name: "ConvGradInput of the same",
        signature: "(float[8,64,16,16] dy, float[64,64,3,3] w) => (dx)".into(),
        body: "dx = shardc.ConvGradInput <input_shape: ints = [8, 64, 16, 16], kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (dy, w)",
        shapes: vec![vec![8, 64, 16, 16], vec![64, 64, 3, 3]],
        work: 2.0 * (8 * 64 * 256 * 64 * 9) as f64,
        unit: "GFLOP/s",
    });
    v.push(Kernel {
        name: "ConvGradWeight of the same",
        signature: "(float[8,64,16,16] x, float[8,64,16,16] dy) => (dw)".into(),
        body: "dw = shardc.ConvGradWeight <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (x, dy)",
        shapes: vec![vec![8, 64, 16, 16], vec![8, 64, 16, 16]],
        work: 2.0 * (8 * 64 * 256 * 64 * 9) as f64,
        unit: "GFLOP/s",
    });
    let mut c = conv(
        "Conv 7×7/2 8×3×64×64→64",
        [8, 3, 64, 64],
        [64, 3, 7, 7],
        "",
        "y = Conv <pads: ints = [3, 3, 3, 3], strides: ints = [2, 2]> (x, w)",
    );
    c.work = 2.0 * (8 * 64 * 32 * 32 * 3 * 49) as f64;
    v.push(c);
    let mut c = conv(
        "depthwise 3×3 8×64×32×32",
        [8, 64, 32, 32],
        [64, 1, 3, 3],
        "",
        "y = Conv <group: int = 64, pads: ints = [1, 1, 1, 1]> (x, w)",
    );
    c.work = 2.0 * (8 * 64 * 32 * 32 * 9) as f64;
    v.push(c);
    let s = 1usize << 22;
    v.push(Kernel {
        name: "Add 4M floats",
        signature: format!("(float[{s}] a, float[{s}] b) => (y)"),
        body: "y = Add (a, b)",
        shapes: vec![vec![s], vec![s]],
        work: 12.0 * s as f64,
        unit: "GB/s",
    });
    let t = 8 * 64 * 32 * 32;
    v.push(Kernel {
        name: "Transpose 8×64×32×32 NCHW→NHWC",
        signature: "(float[8,64,32,32] x) => (y)".into(),
        body: "y = Transpose <perm: ints = [0, 2, 3, 1]> (x)",
        shapes: vec![vec![8, 64, 32, 32]],
        work: 8.0 * t as f64,
        unit: "GB/s",
    });
    v.push(Kernel {
        name: "Add 8×64×32×32 + 64×1×1",
        signature: "(float[8,64,32,32] a, float[64,1,1] b) => (y)".into(),
        body: "y = Add (a, b)",
        shapes: vec![vec![8, 64, 32, 32], vec![64, 1, 1]],
        work: 8.0 * t as f64,
        unit: "GB/s",
    });
    v
}

/// Prints the kernel rates; the wgpu executor's, by kernel name.
fn kernel_rates() -> BTreeMap<&'static str, f64> {
    let mut rates = BTreeMap::new();
    println!(
        "kernel rates (median of 5; wgpu = one simulated device, cpu = the CPU executor, ref = the reference \
         evaluator it is checked against)"
    );
    let mut gpu = GpuExecutor::new().ok();
    // The same adapter without subgroup operations (the kernels other adapters run), where
    // the kernels use them: its rate beside the subgroup kernels' for the GEMMs and the
    // convolutions (im2col and a GEMM).
    let mut plain = gpu.as_ref().and_then(GpuExecutor::subgroup).and_then(|_| GpuExecutor::without_subgroups().ok());
    if let Some(g) = &gpu {
        println!("  adapter: {} (subgroups of {:?})", g.name(), g.subgroup());
    } else {
        println!("  no wgpu adapter: CPU only");
    }
    let mut cpu = CpuExecutor::new();
    for k in kernels().into_iter().filter(|k| only().is_none_or(|o| k.name.contains(o.as_str()))) {
        let (m, node) = one_op(&k.signature, k.body).expect("kernel model");
        let inputs: Vec<Array> = k.shapes.iter().map(|s| filled(s)).collect();
        let tc = time_node(&mut cpu, &m.graph, node, &inputs, 5).expect("cpu run");
        let tr = reference_time(&m.graph, node, &inputs);
        let tg = gpu.as_mut().map(|g| time_node(g, &m.graph, node, &inputs, 5).expect("gpu run"));
        let rate = |t: f64| k.work / t / 1e9;
        if let Some(p) = plain.as_mut().filter(|_| k.unit == "GFLOP/s") {
            let tp = time_node(p, &m.graph, node, &inputs, 5).expect("gpu run");
            println!("  {:<28} wgpu without subgroups {:>9.3} ms {:>6.2} {}", k.name, tp * 1e3, rate(tp), k.unit);
        }
        if let Some(tg) = tg {
            rates.insert(k.name, rate(tg));
        }
        match tg {
            Some(tg) => println!(
                "  {:<28} wgpu {:>9.3} ms {:>6.2} {}   cpu {:>9.3} ms {:>6.2} {}   ref {:>6.2} {}   wgpu/cpu {:.2}×",
                k.name,
                tg * 1e3,
                rate(tg),
                k.unit,
                tc * 1e3,
                rate(tc),
                k.unit,
                rate(tr),
                k.unit,
                tc / tg
            ),
            None => println!(
                "  {:<28} cpu {:>9.3} ms {:>6.2} {}   ref {:>6.2} {}",
                k.name,
                tc * 1e3,
                rate(tc),
                k.unit,
                rate(tr),
                k.unit
            ),
        }
    }
    rates
}

/// The median of 5 runs of `node` by the reference evaluator (`ir::eval`), seconds.
fn reference_time(g: &shardc::ir::Graph, node: shardc::ir::NodeId, inputs: &[Array]) -> f64 {
    let refs: Vec<Option<&Array>> = inputs.iter().map(Some).collect();
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(shardc::ir::eval::eval_node(g, node, &refs, &[]).expect("reference run"));
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[2]
}

fn prediction_vs_measurement() {
    if GpuExecutor::new().is_err() {
        println!("no wgpu adapter: skipping the cost model comparison");
        return;
    }
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let k = &shardc::passes::cost::calibration::CALIBRATED;
    println!(
        "\ncost model (local-wgpu: GEMM {:.2} GFLOP/s × {:.2}, {:.2} GB/s, dispatch {:.0} µs, copies {:.2} GB/s + {:.0} µs, devices share the host) vs measured forward steps (2nd of 2 steps, median of 3 runs)",
        k.gemm_flops / 1e9,
        k.efficiency,
        k.mem_bandwidth / 1e9,
        k.launch * 1e6,
        k.copy_bandwidth / 1e9,
        k.copy_latency * 1e6
    );
    let root = env!("CARGO_MANIFEST_DIR");
    let model = |f: &str| format!("{root}/tests/data/models/{f}");
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a [i64])>, &'a str, usize);
    let cases: Vec<Case<'_>> = vec![
        ("resnet18 8×3×64×64", model("tv_resnet18.onnxtxt"), vec![("input", &[8, 3, 64, 64])], "data", 1),
        ("resnet18 8×3×64×64", model("tv_resnet18.onnxtxt"), vec![("input", &[8, 3, 64, 64])], "data", 2),
        ("resnet18 8×3×64×64", model("tv_resnet18.onnxtxt"), vec![("input", &[8, 3, 64, 64])], "data", 4),
        ("resnet18 8×3×64×64", model("tv_resnet18.onnxtxt"), vec![("input", &[8, 3, 64, 64])], "model", 2),
        ("resnet18 8×3×64×64", model("tv_resnet18.onnxtxt"), vec![("input", &[8, 3, 64, 64])], "spatial", 2),
        ("squeezenet 4×3×112×112", model("tv_squeezenet1_1.onnxtxt"), vec![("input", &[4, 3, 112, 112])], "data", 2),
        ("mobilenet_v2 4×3×112×112", model("tv_mobilenet_v2.onnxtxt"), vec![("input", &[4, 3, 112, 112])], "data", 2),
        ("alexnet 4×3×224×224", model("tv_alexnet.onnxtxt"), vec![("input", &[4, 3, 224, 224])], "owt", 4),
        ("gpt2_small4 1×128", model("hf_gpt2_small4.onnxtxt"), vec![], "model", 2),
        ("gpt2_small4 4×64", model("hf_gpt2_small4.onnxtxt"), vec![("input_ids", &[4, 64])], "data", 4),
        ("nn.Transformer 1×64/32", model("pt_nn_transformer.onnxtxt"), vec![], "model", 2),
        ("lstm_lm 1×35", model("pt_lstm_lm.onnxtxt"), vec![], "model", 2),
    ];
    let mut errors = Vec::new();
    let mut by_op: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (name, path, shapes, strategy, devices) in &cases {
        let m = prepare(path, shapes, true);
        let g = &m.graph;
        let r = match shardc::exec::named_result(g, &cluster, *devices, strategy, &Options::default()) {
            Ok(r) => r,
            Err(e) => {
                println!("  {name:<26} {strategy:>8}@{devices}: skipped ({e})");
                continue;
            }
        };
        let prog = shardc::exec::program_for_search(g, &r, *devices).expect("lowers");
        let inputs: HashMap<String, Array> = shardc::exec::inputs_for(g, None, 0).expect("inputs");
        let mut steps = Vec::new();
        let mut last = None;
        for _ in 0..3 {
            let t = Instant::now();
            let rep = shardc::codegen::run(
                &prog,
                &inputs,
                &RunOptions { backend: Backend::Wgpu, steps: 2, ..Default::default() },
            )
            .expect("runs");
            let _ = t.elapsed();
            steps.push(rep.step_s());
            last = Some(rep);
        }
        steps.sort_by(f64::total_cmp);
        let measured = steps[1];
        let predicted = r.breakdown.forward_s;
        let err = (predicted - measured) / measured;
        errors.push(err.abs());
        println!(
            "  {name:<26} {strategy:>8}@{devices}  predicted {:>9.2} ms  measured {:>9.2} ms  error {:>+6.1}%",
            predicted * 1e3,
            measured * 1e3,
            err * 100.0
        );
        // Per op type, summed over devices / per device: the predicted forward rows
        // (with their communication) against the measured compute and communication.
        let rep = last.expect("a run");
        let nd = rep.devices.len() as f64;
        for row in &r.breakdown.ops {
            by_op.entry(row.op.clone()).or_default().0 += row.forward_s;
        }
        for d in &rep.devices {
            for (op, t) in &d.by_op {
                by_op.entry(op.clone()).or_default().1 += t / nd;
            }
            for (c, t) in &d.by_collective {
                by_op.entry(format!("[{c}]")).or_default().1 += t / nd;
            }
        }
    }
    if !errors.is_empty() {
        let mape = errors.iter().sum::<f64>() / errors.len() as f64 * 100.0;
        println!("  mean absolute percentage error over {} cases: {mape:.1}% (target < 15%)", errors.len());
    }
    println!("  per op type over all cases (predicted forward incl. its communication / measured per device):");
    let mut rows: Vec<_> = by_op.into_iter().collect();
    rows.sort_by(|a, b| (b.1.0 + b.1.1).total_cmp(&(a.1.0 + a.1.1)));
    for (op, (p, m)) in rows.iter().take(16) {
        println!("    {op:<22} predicted {:>9.2} ms  measured {:>9.2} ms", p * 1e3, m * 1e3);
    }
}

/// The wgpu executor beside torch eager on this CPU (one thread; `SHARDC_TORCH_PYTHON`):
/// GEMM rates, and the training steps of ResNet-18 and GPT-2 small4 on one device with
/// element-wise chains fused and run one by one, with the kernels each step dispatched.
fn beside_torch(rates: &BTreeMap<&'static str, f64>) {
    if GpuExecutor::new().is_err() {
        return;
    }
    let torch = common::torch();
    match &torch {
        Ok(t) => println!("\nbeside torch {} eager, one thread", t["torch"].as_str().unwrap_or("?")),
        Err(e) => println!("\nno torch column ({e}); set SHARDC_TORCH_PYTHON to a Python with torch"),
    }
    let col = |key: &str| torch.as_ref().ok().and_then(|t| t[key].as_f64());
    let ratio = |x: Option<f64>, t: Option<f64>| match (x, t) {
        (Some(x), Some(t)) => format!("{:.2}×", x / t),
        _ => "-".into(),
    };
    let cell = |t: Option<f64>, digits: usize| t.map_or("-".into(), |t| format!("{t:.digits$}"));
    println!("  GEMM (GFLOP/s)                      wgpu    torch  wgpu/torch");
    for (name, key) in [("MatMul 512³", "gemm512_gflops"), ("MatMul 2048³", "gemm2048_gflops")] {
        let w = rates.get(name).copied();
        println!("  {name:<30} {:>9} {:>8} {:>11}", cell(w, 1), cell(col(key), 1), ratio(w, col(key)));
    }
    println!("  training step (s)            wgpu fused  dispatches  one by one  dispatches   torch  fused/torch");
    for (name, path, shapes, key) in common::train_cases() {
        let (f, fd) = common::train_step(&path, &shapes, Backend::Wgpu, true);
        let (a, ad) = common::train_step(&path, &shapes, Backend::Wgpu, false);
        let t = col(key);
        println!("  {name:<26} {f:>12.3} {fd:>11} {a:>11.3} {ad:>11} {:>7} {:>12}", cell(t, 3), ratio(Some(f), t));
    }
}

/// `SHARDC_BENCH_ONLY=TEXT`: the kernels whose name contains it, alone (no torch column, no
/// forward-step comparison).
fn only() -> Option<String> {
    std::env::var("SHARDC_BENCH_ONLY").ok().filter(|s| !s.is_empty())
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let rates = kernel_rates();
    if only().is_some() {
        return;
    }
    beside_torch(&rates);
    prediction_vs_measurement();
}
