//! Search time of `autoshard` (the `shardc plan` search) on real and synthetic models, with
//! the plans' quality: predicted step time, speedup over data parallelism, e-graph size and
//! stop reason per mesh.
//!
//! Run with `cargo bench --bench plan`. Each case is searched several times; the median, min
//! and max wall-clock times are printed. Targets: ResNet-50 on 64 devices under 1 s, the
//! PyTorch nn.Transformer on 64 under 5 s, a 6,000-node graph under 30 s, GPT-2 (with the
//! pipeline search) on 64 and 512 devices and a 48-layer GPT on 64 devices under 10 s. The
//! last section times the search as `shardc plan` runs it, with the algebraic rewrites it
//! chooses between (one more search per rule that matches, and one where it is chosen place
//! by place), beside the search without them; `SHARDC_BENCH_ONLY=rewrites` runs
//! that section alone. Then PaSE's dynamic program beside shardc's search on PaSE's
//! evaluation models where `SHARDC_PASE_DIR` names a clone of PaSE (`SHARDC_BENCH_ONLY=pase`
//! runs that section alone).

use std::time::{Duration, Instant};

/// The allocator the `shardc` binary plans with.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use shardc::passes::autoshard::{self, FoldMode, PipelineMode, SearchOptions};
use shardc::passes::cost::{Cluster, Options};

fn prepare(text: &str, batch: Option<i64>) -> shardc::ir::Model {
    let mut m = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    if batch.is_some() {
        pm.add(shardc::passes::Rebatch { spec: shardc::passes::RebatchSpec { batch, ..Default::default() } });
    }
    pm.add(shardc::passes::InferShapes::default()).add(shardc::passes::Canonicalize).add(shardc::passes::Algebra);
    pm.run(&mut m).expect("passes run");
    m
}

fn case(name: &str, m: &shardc::ir::Model, cluster: &str, devices: usize, runs: usize) {
    case_with(name, m, cluster, devices, runs, PipelineMode::Auto);
}

fn case_with(name: &str, m: &shardc::ir::Model, cluster: &str, devices: usize, runs: usize, pipeline: PipelineMode) {
    case_folded(name, m, cluster, devices, runs, pipeline, FoldMode::Auto);
}

fn case_folded(
    name: &str,
    m: &shardc::ir::Model,
    cluster: &str,
    devices: usize,
    runs: usize,
    pipeline: PipelineMode,
    fold: FoldMode,
) {
    let c = Cluster::load(cluster).expect("preset");
    let so = SearchOptions { pipeline, fold, ..Default::default() };
    let (times, r) = timed(runs, || (), |()| autoshard::search(&m.graph, &c, devices, &Options::default(), &so));
    let dp = r.data_parallel.as_ref().filter(|d| d.feasible).map(|d| d.step_time_s);
    let pipe = match (&r.pipeline, &r.pipeline_considered) {
        (Some(p), _) => {
            format!("pipelined: {} stages × {} micro-batches ({})", p.stages.len(), p.micro_batches, p.schedule.name())
        }
        (None, Some(pc)) => format!("not pipelined (best pipeline {:.3} ms)", pc.best_step_time_s * 1e3),
        (None, None) => "not pipelined".into(),
    };
    let s = |d: Duration| d.as_secs_f64();
    println!(
        "{name:<28} {cluster:>15} {devices:>4} dev  median {:>7.3} s  min {:>7.3} s  max {:>7.3} s ({runs} runs)   step {:.3} ms  data parallel {}  speedup {}",
        s(times[runs / 2]),
        s(times[0]),
        s(times[runs - 1]),
        r.breakdown.step_time_s * 1e3,
        dp.map_or("-".into(), |d| format!("{:.3} ms", d * 1e3)),
        dp.map_or("-".into(), |d| format!("{:.2}×", d / r.breakdown.step_time_s)),
    );
    if let Some(f) = &r.folded {
        println!("{:<28} folded: {f}", "");
    }
    println!("    {pipe}; {:?}", pipeline);
    for ms in &r.meshes {
        println!(
            "    mesh {:<46} e-graph {:>6} classes {:>7} nodes, {} iterations, {:<32} {:>5}/{:<5} strategies; {} ({} DP states max{}), {} plans priced",
            ms.mesh,
            ms.egraph.classes,
            ms.egraph.nodes,
            ms.egraph.iterations,
            ms.egraph.stop_reason,
            ms.egraph.strategies,
            ms.egraph.admissible_strategies,
            ms.extraction.method,
            ms.extraction.dp_max_states,
            if ms.extraction.exact { ", exact" } else { "" },
            ms.extraction.evaluations,
        );
    }
}

/// The 48-layer synthetic GPT the search and rewrite sections time.
const GPT48: shardc::synthetic::Gpt =
    shardc::synthetic::Gpt { layers: 48, hidden: 1600, heads: 25, batch: 8, seq: 1024, fused_gelu: false, vocab: 0 };

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = |name: &str| {
        std::fs::read_to_string(root.join("tests/data/models").join(format!("{name}.onnxtxt"))).expect("bundled model")
    };
    // `SHARDC_BENCH_ONLY=rewrites`: only the last section.
    let only_rewrites = std::env::var("SHARDC_BENCH_ONLY").is_ok_and(|s| s == "rewrites");
    if std::env::var("SHARDC_BENCH_ONLY").is_ok_and(|s| s == "pase") {
        pase_section(&model);
        return;
    }
    if only_rewrites {
        let gpt48 = prepare(&GPT48.to_text(), None);
        let gpt2 = prepare(&model("hf_gpt2_124m"), Some(8));
        let bert = prepare(&model("hf_bert_base"), Some(8));
        rewriting_section(&gpt48, &gpt2, &bert, &model);
        return;
    }
    println!("autoshard search (default options, all candidate meshes)");
    let resnet = prepare(&model("tv_resnet50"), Some(256));
    case("tv_resnet50 (batch 256)", &resnet, "dgx-a100", 8, 5);
    case("tv_resnet50 (batch 256)", &resnet, "a100-cluster-8", 64, 5);
    let transformer = prepare(&model("pt_nn_transformer"), None);
    case("pt_nn_transformer", &transformer, "a100-cluster-8", 64, 3);
    for name in ["hf_bert_base", "hf_gpt2_124m"] {
        let m = prepare(&model(name), None);
        case(name, &m, "a100-cluster-8", 64, 3);
        case(name, &m, "a100-cluster-64", 512, 3);
    }
    let gpt48 = prepare(&GPT48.to_text(), None);
    case("synthetic GPT, 48 layers", &gpt48, "a100-cluster-8", 64, 3);
    println!("\nrepeated-layer folding: never / always (auto folds from 1,000 ops)");
    let gpt2 = prepare(&model("hf_gpt2_124m"), Some(8));
    let bert = prepare(&model("hf_bert_base"), Some(8));
    for (name, m, cluster, devices) in [
        ("synthetic GPT, 48 layers", &gpt48, "a100-cluster-8", 64),
        ("hf_gpt2_124m (batch 8)", &gpt2, "dgx-a100", 8),
        ("hf_gpt2_124m (batch 8)", &gpt2, "a100-cluster-64", 512),
        ("hf_bert_base (batch 8)", &bert, "dgx-a100", 8),
    ] {
        for fold in [FoldMode::Never, FoldMode::Always] {
            case_folded(&format!("{name} {fold:?}"), m, cluster, devices, 3, PipelineMode::Auto, fold);
        }
    }
    let chain = prepare(&shardc::synthetic::chain(6000), None);
    case("synthetic chain, 6000 ops", &chain, "a100-cluster-8", 64, 3);
    println!("\nintra-operator search alone (--pipeline off)");
    case_with("tv_resnet50 (batch 256)", &resnet, "a100-cluster-8", 64, 5, PipelineMode::Off);
    case_with("pt_nn_transformer", &transformer, "a100-cluster-8", 64, 3, PipelineMode::Off);
    case_with("synthetic chain, 6000 ops", &chain, "a100-cluster-8", 64, 3, PipelineMode::Off);
    println!("\npipelines that are needed: GPT-2 at batch 64 × 1024 tokens on 16 GB V100s");
    let spec = shardc::passes::RebatchSpec {
        batch: Some(64),
        input_shapes: vec![shardc::passes::rebatch::parse_input_shape("input_ids=64x1024").expect("shape")],
        ..Default::default()
    };
    let mut big = shardc::frontend::parse(&model("hf_gpt2_124m")).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Rebatch { spec })
        .add(shardc::passes::InferShapes::default())
        .add(shardc::passes::Canonicalize)
        .add(shardc::passes::Algebra);
    pm.run(&mut big).expect("passes run");
    case("hf_gpt2_124m 64×1024", &big, "dgx1-v100", 8, 3);
    case("hf_gpt2_124m 64×1024", &big, "a100-cluster-8", 64, 3);
    case("hf_gpt2_124m 64×1024", &big, "a100-cluster-64", 512, 3);
    rewriting_section(&gpt48, &gpt2, &bert, &model);
    pase_section(&model);
}

/// PaSE's dynamic program (Elango, IPDPS 2021; its published `scheduler.py`) beside `shardc
/// plan --pipeline off` (the rewrite search counted) on the models of PaSE's evaluation at 8,
/// 16, 32 and 64 devices, one run each of PaSE and the median of three of shardc, side by
/// side. Runs where `SHARDC_PASE_DIR` holds a clone of github.com/baidu-research/PaSE and
/// `SHARDC_PASE_PYTHON` (default `python3`) imports its requirements (pandas < 2, networkx,
/// numpy); else says so. PaSE's graphs are its own (`graph.py`, batch 128); shardc's are the
/// bundled exports of the same networks at batch 128 (PyTorch's AlexNet, an LSTM language
/// model, nn.Transformer); no Inception-v3 export is bundled.
fn pase_section(model: &dyn Fn(&str) -> String) {
    println!("\nbeside PaSE's dynamic program (shardc: search_rewriting, --pipeline off)");
    let Ok(dir) = std::env::var("SHARDC_PASE_DIR") else {
        println!("  SHARDC_PASE_DIR is not set (a clone of github.com/baidu-research/PaSE): skipped");
        return;
    };
    let python = std::env::var("SHARDC_PASE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ours: [(&str, Option<&str>, Option<i64>); 4] = [
        ("alexnet", Some("tv_alexnet"), Some(128)),
        ("inception3", None, None),
        ("rnnlm", Some("pt_lstm_lm"), Some(128)),
        ("transformer", Some("pt_nn_transformer"), Some(128)),
    ];
    let c = Cluster::load("a100-cluster-8").expect("preset");
    for (graph, file, batch) in ours {
        let m = file.map(|f| prepare(&model(f), batch));
        for devices in [8usize, 16, 32, 64] {
            let t = Instant::now();
            let out = std::process::Command::new(&python)
                .args(["-O", "scheduler.py", "-p", &devices.to_string(), "-g", graph, "-b", "128"])
                .current_dir(&dir)
                .output();
            let pase = t.elapsed().as_secs_f64();
            let pase = match out {
                Ok(o) if o.status.success() => pase,
                Ok(o) => {
                    println!(
                        "  {graph} {devices}: PaSE failed: {}",
                        String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")
                    );
                    continue;
                }
                Err(e) => {
                    println!("  {graph} {devices}: `{python}` does not run: {e}");
                    return;
                }
            };
            let Some(m) = &m else {
                println!("  {graph:<12} {devices:>3} dev  PaSE {pase:>8.3} s  shardc: no bundled export");
                continue;
            };
            let so = SearchOptions { pipeline: PipelineMode::Off, ..Default::default() };
            let (times, _) = timed(
                3,
                || m.graph.clone(),
                |mut g| autoshard::search_rewriting(&mut g, &c, devices, &Options::default(), &so),
            );
            let ours = times[1].as_secs_f64();
            println!(
                "  {graph:<12} {devices:>3} dev  PaSE {pase:>8.3} s  shardc {ours:>8.3} s (median of 3)  PaSE / shardc {:>6.2}",
                pase / ours
            );
        }
    }
}

fn rewriting_section(
    gpt48: &shardc::ir::Model,
    gpt2: &shardc::ir::Model,
    bert: &shardc::ir::Model,
    model: &dyn Fn(&str) -> String,
) {
    println!("\nwith the rewrites the search chooses (`shardc plan` by default: search_rewriting)");
    for (name, m, cluster, devices) in [
        ("synthetic GPT, 48 layers", gpt48, "a100-cluster-8", 64),
        ("hf_gpt2_124m (batch 8)", gpt2, "dgx-a100", 8),
        ("hf_gpt2_124m (batch 8)", gpt2, "a100-cluster-64", 512),
        ("hf_bert_base (batch 8)", bert, "dgx-a100", 8),
    ] {
        case_rewriting(name, m, cluster, devices, 3, PipelineMode::Auto);
    }
    // Pointwise convolutions, chosen place by place where the plans price some places
    // cheaper as GEMMs (flat plans).
    let squeeze4 = prepare(&model("tv_squeezenet1_1"), Some(4));
    case_rewriting("tv_squeezenet1_1 (batch 4)", &squeeze4, "local-wgpu", 2, 3, PipelineMode::Off);
    for name in ["tv_mobilenet_v2", "tv_squeezenet1_1", "tv_resnet50"] {
        let m = prepare(&model(name), Some(32));
        case_rewriting(&format!("{name} (batch 32)"), &m, "dgx-a100", 8, 3, PipelineMode::Auto);
    }
}

/// `name` searched as `shardc plan` does, trying the rewrites ([`autoshard::search_rewriting`]),
/// beside the search without them (`--no-rewrites`): wall-clock times of both and what each
/// rule priced.
fn case_rewriting(
    name: &str,
    m: &shardc::ir::Model,
    cluster: &str,
    devices: usize,
    runs: usize,
    pipeline: PipelineMode,
) {
    let c = Cluster::load(cluster).expect("preset");
    // Each run rewrites its own copy of the graph, made before the clock starts.
    let time = |rewrites: bool| {
        let so = SearchOptions { pipeline, rewrites, ..Default::default() };
        timed(
            runs,
            || m.graph.clone(),
            |mut g| autoshard::search_rewriting(&mut g, &c, devices, &Options::default(), &so),
        )
    };
    let (times, r) = time(true);
    let (plain_times, _) = time(false);
    let s = |d: Duration| d.as_secs_f64();
    println!(
        "{name:<28} {cluster:>15} {devices:>4} dev  median {:>7.3} s  min {:>7.3} s  max {:>7.3} s ({runs} runs; without rewrites median {:.3} s)   step {:.3} ms",
        s(times[runs / 2]),
        s(times[0]),
        s(times[runs - 1]),
        s(plain_times[runs / 2]),
        r.breakdown.step_time_s * 1e3,
    );
    for w in &r.rewrites {
        let partial = match (&w.cheaper_at, w.cheaper_at_step_time_s) {
            (Some(at), Some(t)) => format!("; at the {} places priced cheaper {:.3} ms", at.len(), t * 1e3),
            _ => String::new(),
        };
        println!(
            "    rewrite {} at {} sites: {} with, {:.3} ms without{partial}: {}",
            w.rule,
            w.sites,
            w.with_step_time_s.map_or("not searched".into(), |t| format!("{:.3} ms", t * 1e3)),
            w.without_step_time_s * 1e3,
            match (w.applied, w.applied_at_cheaper) {
                (true, true) => "applied there",
                (true, false) => "applied",
                _ => "not applied",
            }
        );
    }
}

/// Runs `search` `runs` times, each on what `prepare` makes (untimed): the sorted wall-clock
/// times and the last result.
fn timed<S, R>(
    runs: usize,
    mut prepare: impl FnMut() -> S,
    mut search: impl FnMut(S) -> Result<R, String>,
) -> (Vec<Duration>, R) {
    let mut times = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs {
        let input = prepare();
        let t = Instant::now();
        last = Some(search(input).expect("search"));
        times.push(t.elapsed());
    }
    times.sort();
    (times, last.expect("a run"))
}
