//! Training steps on this machine's wgpu adapter (lavapipe without a GPU) against the cost
//! model's predicted training step for the same plan, on the simulated devices' constants
//! measured at the start of the run (`shardc calibrate`'s measurements, not the
//! `local-wgpu` preset's numbers from another day): reduced real
//! models and golden training cases under named strategies and the searched plan, on 1–4
//! simulated devices, with the mean absolute percentage error of two predictions side by
//! side: the forward model's plan priced as a training step (what the search compares), and
//! the training program that runs priced op by op (what `shardc train` predicts: for a
//! pipeline, its stages' programs played through the runtime's schedule by
//! `shardc::simulate`).
//!
//! Run with `cargo bench --bench train` (`XDG_RUNTIME_DIR` set, a Vulkan driver installed).
//! The dispatch cost (and how much more it costs with 2 and 4 devices dispatching at once)
//! is measured again just before each case: on lavapipe it moves between runs minutes apart.
//! The measured step is the median of the steady steps on the slowest device: the first two
//! steps are left out (the first compiles kernels; the second still allocates and caches, on
//! lavapipe typically 1.5–2× a steady step), and the median of the remaining eight is taken
//! with their spread printed, since the simulated devices share the machine's cores and a
//! step now and then takes twice as long. Cases of under 200 ms a step run five times on
//! fresh devices (`×5` in the row, with the slowest and fastest run's median and their
//! ratio) and take the median run: their steps are mostly dispatches, and whole runs of
//! them differ by up to 2× on this machine (tiny_gpt's runs: 47, 53, 96, 100, 103 ms), so
//! the error is also given over the longer cases alone.

mod common;
use common::prepare;

use shardc::codegen::Backend;
use shardc::codegen::runtime::gpu::GpuExecutor;
use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::passes::cost::Options;

const STEPS: usize = 10;
/// Steps left out of the measurement (kernel compilation, first allocations).
const WARMUP: usize = 2;
/// Cases whose step is shorter than this are run [`REPEATS`] times.
const REPEAT_BELOW_S: f64 = 0.2;
/// Runs of a short case.
const REPEATS: usize = 5;

fn main() {
    if GpuExecutor::new().is_err() {
        println!("no wgpu adapter: skipping");
        return;
    }
    // The machine's constants measured now, in this run (`shardc calibrate`): the
    // `local-wgpu` preset holds another day's numbers, and a shared machine's speed drifts
    // (this one has measured 2.6–5.1 GFLOP/s for the same GEMM on different days).
    let mut measured =
        shardc::calibrate::measure(GpuExecutor::new, shardc::calibrate::Effort { rounds: 3, ..Default::default() })
            .expect("calibrates");
    shardc::calibrate::add_kernel_factors(&mut measured, Backend::Wgpu, 3, false).expect("kernel factors");
    let (cluster, toml) = shardc::calibrate::cluster_toml(&measured, 8);
    for line in toml.lines().filter(|l| l.starts_with("# GEMM") || l.starts_with("# Kernels")) {
        println!("calibrated in this run: {}", line.trim_start_matches("# "));
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let model = |f: &str| format!("{root}/tests/data/models/{f}");
    let golden = |f: &str| format!("{root}/tests/data/golden-train/{f}");
    let xent = "softmax-cross-entropy";
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a [i64])>, &'a str, &'a str, usize);
    let r18: &[i64] = &[4, 3, 32, 32];
    let small: &[i64] = &[4, 3, 64, 64];
    let ids: &[i64] = &[2, 32];
    let cases: Vec<Case<'_>> = vec![
        ("resnet18 4×3×32×32", model("tv_resnet18.onnxtxt"), vec![("input", r18)], xent, "data", 1),
        ("resnet18 4×3×32×32", model("tv_resnet18.onnxtxt"), vec![("input", r18)], xent, "data", 2),
        ("resnet18 4×3×32×32", model("tv_resnet18.onnxtxt"), vec![("input", r18)], xent, "data", 4),
        ("resnet18 4×3×32×32", model("tv_resnet18.onnxtxt"), vec![("input", r18)], xent, "auto", 4),
        ("resnet18 4×3×32×32", model("tv_resnet18.onnxtxt"), vec![("input", r18)], xent, "spatial", 2),
        ("squeezenet 4×3×64×64", model("tv_squeezenet1_1.onnxtxt"), vec![("input", small)], xent, "data", 2),
        ("mobilenet_v2 4×3×64×64", model("tv_mobilenet_v2.onnxtxt"), vec![("input", small)], xent, "data", 2),
        ("gpt2_small4 2×32", model("hf_gpt2_small4.onnxtxt"), vec![("input_ids", ids)], xent, "data", 2),
        ("gpt2_small4 2×32", model("hf_gpt2_small4.onnxtxt"), vec![("input_ids", ids)], xent, "megatron", 2),
        ("gpt2_small4 2×32", model("hf_gpt2_small4.onnxtxt"), vec![("input_ids", ids)], xent, "auto", 4),
        ("cnn_small (golden)", golden("cnn_small.onnxtxt"), vec![], "", "data", 2),
        ("tiny_gpt (golden)", golden("tiny_gpt_train.onnxtxt"), vec![], "", "megatron", 2),
        ("resnet_block (golden)", golden("resnet_block_train.onnxtxt"), vec![], "", "auto", 4),
        ("cnn_small (golden)", golden("cnn_small.onnxtxt"), vec![], "", "pipe:2", 2),
        ("tiny_gpt (golden)", golden("tiny_gpt_train.onnxtxt"), vec![], "", "pipe:2", 2),
        ("gpt2_small4 2×32", model("hf_gpt2_small4.onnxtxt"), vec![("input_ids", ids)], xent, "pipe:2", 4),
    ];
    let opt = OptimizerSpec::Sgd { lr: 0.01, momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    let opts = Options { optimizer: shardc::passes::cost::Optimizer::Sgd, ..Default::default() };
    println!(
        "training step on local-wgpu: predicted from the forward plan (plan) and from the training program (program) vs measured (median of {} steady steps after {WARMUP}, slowest device; their min–max in brackets; ×{REPEATS}: the median of {REPEATS} runs)",
        STEPS - WARMUP
    );
    let mut errors = Errors::new();
    // `SHARDC_BENCH_ONLY=TEXT`: only the cases whose name or strategy contains it;
    // `SHARDC_BENCH_OPS=1`: each case's time per op type, measured against the program's price.
    let only = std::env::var("SHARDC_BENCH_ONLY").unwrap_or_default();
    let per_op = std::env::var_os("SHARDC_BENCH_OPS").is_some();
    for (name, path, shapes, loss, strategy, devices) in &cases {
        if !only.is_empty() && !name.contains(&only) && !strategy.contains(&only) {
            continue;
        }
        // The dispatch cost again, just before the case runs: on lavapipe it moves between
        // runs a few minutes apart (77–150 µs for the same empty dispatch), and the short
        // cases are mostly dispatches.
        let l = shardc::calibrate::measure_launch(&GpuExecutor::new, 28).expect("dispatch timing");
        let mut cluster = cluster.clone();
        cluster.device.launch_overhead = l.alone;
        cluster.device.launch_contention = l.contention;
        let cluster = &cluster;
        let mut m = prepare(path, shapes, false);
        // As `shardc train` trains it: after the `algebra` pass (fused GEMMs that are split
        // un-fused, reshape detours folded, a transposed weight read by a GEMM as it is).
        let mut pm = shardc::passes::PassManager::new();
        pm.add(shardc::passes::Algebra);
        pm.run(&mut m).expect("algebra");
        let loss = if loss.is_empty() { LossSpec::Model } else { LossSpec::parse(loss).expect("loss") };
        let (tm, info) = shardc::train::training_model(&m, &loss, &opt).expect("training graph");
        if let Some(stages) = strategy.strip_prefix("pipe:") {
            // The search's pipeline with this many stages, trained with its micro-batches.
            let so = shardc::passes::autoshard::SearchOptions {
                pipeline: shardc::passes::autoshard::PipelineMode::Stages(stages.parse().expect("stages")),
                ..Default::default()
            };
            let f = shardc::passes::autoshard::search(&m.graph, cluster, *devices, &opts, &so).expect("search");
            let pipe =
                shardc::exec::TrainPipeline::of_search(&m.graph, &f).expect("a lowered schedule").expect("a pipeline");
            let micro = shardc::train::micro_training_model(&m, &loss, &opt, pipe.micro_batches).expect("micro");
            let (prog, _) =
                shardc::exec::training_pipeline_program(&micro.graph, &m.graph, &f.assignment, &pipe, cluster, &opts)
                    .expect("lowers");
            let prog = shardc::exec::as_micro_batches(prog, &tm.graph, pipe.micro_batches).expect("micro-batches");
            let predicted = f.pipeline.as_ref().map_or(f.breakdown.step_time_s, |p| p.breakdown.step_time_s);
            let label = format!("{strategy}×{}", pipe.micro_batches);
            // The program's price: its stages' lowered training programs played through the
            // runtime's schedule, steps back to back (the period), as the runtime runs them.
            let sim = shardc::simulate::simulate(&prog, cluster, &opts, true).expect("simulates");
            let m = measure(&prog, &tm.graph, &info);
            report(&mut errors, name, &label, *devices, (predicted, sim.period_s), &m);
            if per_op && let Some(d) = &m.last {
                // Compute per op type and communication per op type on the slowest device and
                // on the last device (the last stage's).
                let last = m.all.iter().max_by_key(|r| r.device).filter(|r| r.device != d.device);
                for d in std::iter::once(d).chain(last) {
                    println!("    device {}:", d.device);
                    let mut kinds = std::collections::BTreeMap::<&str, (f64, f64)>::new();
                    for (k, v) in d.by_op.iter().chain(&d.by_collective) {
                        kinds.entry(k).or_default().0 += v;
                    }
                    for (k, v) in &sim.by_op[d.device] {
                        kinds.entry(k).or_default().1 += v;
                    }
                    for (k, (got, p)) in kinds {
                        println!("      {k:<28} measured {:>9.3} ms  simulated {:>9.3} ms", got * 1e3, p * 1e3);
                    }
                    println!("      waiting: simulated {:.3} ms", sim.waiting[d.device] * 1e3);
                }
                // Every device, its last step: its ops' own time (kernels and communication,
                // waits included as the runtime counts them) against the simulation's (its
                // waiting apart), and its step against the simulated finish.
                for r in &m.all {
                    let own: f64 = r.by_op.values().chain(r.by_collective.values()).sum();
                    let step = r.step_wall_s.last().copied().unwrap_or(0.0);
                    let sim_own: f64 = sim.by_op.get(r.device).map_or(0.0, |b| b.values().sum());
                    let (wait, finish) = (sim.waiting[r.device], sim.devices[r.device]);
                    println!(
                        "      device {}: ops measured {:>9.3} ms, simulated {:>9.3} ms + {:>9.3} ms waiting; step measured {:>9.3} ms, simulated {:>9.3} ms",
                        r.device,
                        own * 1e3,
                        sim_own * 1e3,
                        wait * 1e3,
                        step * 1e3,
                        finish * 1e3
                    );
                }
            }
            continue;
        }
        let (r, predicted) = if *strategy == "auto" {
            let so = shardc::passes::autoshard::SearchOptions {
                pipeline: shardc::passes::autoshard::PipelineMode::Off,
                ..Default::default()
            };
            let f = shardc::passes::autoshard::search(&m.graph, cluster, *devices, &opts, &so).expect("search");
            let (r, _) = shardc::exec::training_result(&tm.graph, &m.graph, &f.assignment, &f.mesh, cluster, &opts)
                .expect("derived");
            (r, f.breakdown.step_time_s)
        } else {
            let f = shardc::exec::named_result(&m.graph, cluster, *devices, strategy, &opts).expect("applies");
            (
                shardc::exec::named_result(&tm.graph, cluster, *devices, strategy, &opts).expect("applies"),
                f.breakdown.step_time_s,
            )
        };
        let prog = shardc::exec::program_for_search(&tm.graph, &r, *devices).expect("lowers");
        let program = r.breakdown.step_time_s;
        let m = measure(&prog, &tm.graph, &info);
        report(&mut errors, name, strategy, *devices, (predicted, program), &m);
        if per_op {
            print_per_op(&r.breakdown, &m, &prog);
        }
    }
    // Over every case, or over those long enough to be measured in one run.
    let mape = |long_only: bool, which: fn(&(f64, f64, bool)) -> f64| {
        let e: Vec<f64> = errors.iter().filter(|r| !long_only || r.2).map(which).collect();
        (e.iter().sum::<f64>() / e.len().max(1) as f64 * 100.0, e.len())
    };
    let (plan, n) = mape(false, |r| r.0);
    let (program, _) = mape(false, |r| r.1);
    let (plan_long, n_long) = mape(true, |r| r.0);
    let (program_long, _) = mape(true, |r| r.1);
    println!(
        "  mean absolute percentage error (target < 15%): plan {plan:.1}%, program {program:.1}% over {n} cases; plan {plan_long:.1}%, program {program_long:.1}% over the {n_long} cases of {:.0} ms a step or more",
        REPEAT_BELOW_S * 1e3
    );
}

/// Per case, the absolute relative errors of the plan's and the program's prediction, and
/// whether its step is long enough to be measured in one run ([`REPEAT_BELOW_S`]).
type Errors = Vec<(f64, f64, bool)>;

/// The measured step: the median of the warm steps, on the slowest device; a case whose
/// step is under [`REPEAT_BELOW_S`] is run [`REPEATS`] times on fresh devices and the median
/// of the runs' medians taken (a few-millisecond step is mostly dispatches, and on lavapipe
/// a whole run's dispatches are now and then twice as slow as another's: the steps within
/// a run agree, the runs do not).
fn measure(
    prog: &shardc::codegen::Program,
    g: &shardc::ir::Graph,
    info: &shardc::passes::autodiff::TrainInfo,
) -> Measured {
    let inputs = shardc::train::seeded_inputs(g, info, 0).expect("inputs");
    let mut medians = Vec::new();
    let (mut min, mut max) = (f64::INFINITY, 0.0f64);
    let (mut last, mut all);
    loop {
        let run = shardc::train::run_steps(prog, info, &inputs, Backend::Wgpu, STEPS).expect("trains");
        let mut per_step: Vec<f64> = (WARMUP..STEPS)
            .map(|i| run.report.devices.iter().filter_map(|d| d.step_wall_s.get(i).copied()).fold(0.0, f64::max))
            .collect();
        per_step.sort_by(f64::total_cmp);
        min = min.min(per_step[0]);
        max = max.max(per_step[per_step.len() - 1]);
        medians.push(per_step[per_step.len() / 2]);
        all = run.report.devices;
        last = all.iter().max_by(|a, b| a.wall_s.total_cmp(&b.wall_s)).cloned();
        if medians[0] >= REPEAT_BELOW_S || medians.len() == REPEATS {
            break;
        }
    }
    medians.sort_by(f64::total_cmp);
    Measured { median: medians[medians.len() / 2], min, max, runs: medians.clone(), last, all }
}

/// The measured time per op type and collective kind (the last step of the last run, on
/// its slowest device) beside the program's predicted time for them, and the counts.
fn print_per_op(b: &shardc::passes::cost::Breakdown, m: &Measured, prog: &shardc::codegen::Program) {
    let Some(d) = &m.last else { return };
    let mut lowered: std::collections::BTreeMap<String, usize> = Default::default();
    if let Some(dp) = prog.devices.iter().find(|p| p.device == d.device) {
        for n in dp.graph.node_ids() {
            *lowered.entry(dp.graph.node(n).op.op_type().to_string()).or_default() += 1;
        }
    }
    let mut predicted: std::collections::BTreeMap<String, (f64, usize)> = Default::default();
    for row in &b.ops {
        let e = predicted.entry(row.op.clone()).or_default();
        e.0 += row.compute_s;
        e.1 += 1;
    }
    let keys: std::collections::BTreeSet<&String> = predicted.keys().chain(d.by_op.keys()).collect();
    for k in keys {
        let (p, n) = predicted.get(k).copied().unwrap_or_default();
        let got = d.by_op.get(k).copied().unwrap_or(0.0);
        let l = lowered.get(k).copied().unwrap_or(0);
        println!("      {k:<28} ×{n:<4} run ×{l:<4} measured {:>9.3} ms  predicted {:>9.3} ms", got * 1e3, p * 1e3);
    }
    // The runtime names collectives by op type (`AllReduce`), the cost model by kind (`all_reduce`).
    // (`HaloExchange` is the cost model's `halo`.)
    let snake = |k: &str| {
        if k == "HaloExchange" {
            return "halo".to_string();
        }
        k.chars().enumerate().fold(String::new(), |mut s, (i, c)| {
            if c.is_uppercase() && i > 0 {
                s.push('_');
            }
            s.push(c.to_ascii_lowercase());
            s
        })
    };
    let kinds: std::collections::BTreeSet<String> =
        b.communication_by_kind.keys().cloned().chain(d.by_collective.keys().map(|k| snake(k))).collect();
    for k in kinds {
        let got = d.by_collective.iter().filter(|(c, _)| snake(c) == k).map(|(_, v)| *v).sum::<f64>();
        let l: usize = lowered.iter().filter(|(c, _)| snake(c) == k).map(|(_, v)| *v).sum();
        let p = b.communication_by_kind.get(&k).copied().unwrap_or(0.0);
        let n: usize = b.events.iter().map(|e| e.steps.iter().filter(|s| s.kind.name() == k).count()).sum();
        println!("      {k:<28} ×{n:<4} run ×{l:<4} measured {:>9.3} ms  predicted {:>9.3} ms", got * 1e3, p * 1e3);
    }
    if std::env::var_os("SHARDC_BENCH_STEPS").is_some() {
        for e in &b.events {
            for s in &e.steps {
                println!(
                    "        {:?} {:?} group {} bytes {:.0} time {:.3} ms",
                    e.phase,
                    s.kind,
                    s.group,
                    s.bytes,
                    s.time * 1e3
                );
            }
        }
        if let Some(dp) = prog.devices.iter().find(|p| p.device == d.device) {
            for n in dp.graph.node_ids() {
                let node = dp.graph.node(n);
                if node.op.class() == shardc::ir::OpClass::Comm {
                    let t = |v: Option<shardc::ir::Value>| {
                        v.and_then(|v| dp.graph.tensor_type(v)).map(|t| format!("{}", t))
                    };
                    println!(
                        "        run {} {:?} -> {:?}",
                        node.op.op_type(),
                        t(node.input(0)),
                        t(Some(shardc::ir::Value::new(n, 0)))
                    );
                }
            }
        }
    }
}

/// A measured step time and the spread of the steps it is the median of.
struct Measured {
    median: f64,
    min: f64,
    max: f64,
    /// The medians of the runs on fresh devices it is the median of, in order.
    runs: Vec<f64>,
    /// The slowest device's report of the last run.
    last: Option<shardc::codegen::runtime::DeviceReport>,
    /// Every device's report of the last run.
    all: Vec<shardc::codegen::runtime::DeviceReport>,
}

/// Prints one case's row and records its error.
fn report(errors: &mut Errors, name: &str, strategy: &str, devices: usize, pred: (f64, f64), m: &Measured) {
    let (plan, program) = pred;
    let measured = m.median;
    let err = (plan - measured) / measured;
    let prog = (program - measured) / measured;
    errors.push((err.abs(), prog.abs(), measured >= REPEAT_BELOW_S));
    println!(
        "  {name:<24} {strategy:>8}@{devices}  measured {:>9.2} ms [{:>6.0}–{:<6.0}]{}  plan {:>9.2} ms ({:>+7.1}%)  program {:>9.2} ms ({:>+7.1}%)",
        measured * 1e3,
        m.min * 1e3,
        m.max * 1e3,
        if m.runs.len() > 1 {
            let (lo, hi) = (m.runs[0], m.runs[m.runs.len() - 1]);
            format!(" ×{} (runs {:.0}–{:.0}, {:.1}×)", m.runs.len(), lo * 1e3, hi * 1e3, hi / lo)
        } else {
            " ".repeat(26)
        },
        plan * 1e3,
        err * 100.0,
        program * 1e3,
        prog * 100.0
    );
}
