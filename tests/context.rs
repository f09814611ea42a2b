//! Context parallelism as DeepSpeed-Ulysses runs it (`--strategy context`, `cp=N`): the
//! sequence split over the devices, attention by heads, all-to-alls between — lowered, proved
//! and trained equal to one device.

mod common;

use std::collections::{BTreeMap, HashMap};

use shardc::codegen::{Backend, Program, verify};
use shardc::ir::Op;
use shardc::passes::autodiff::{LossSpec, OptimizerSpec, TrainInfo};
use shardc::passes::cost::{Cluster, Options};
use shardc::synthetic::Llama;

/// `text` parsed and prepared as `shardc parse --passes infer-shapes,canonicalize,fuse-attention`
/// prepares it (verified, shapes inferred, canonicalized, attention fused).
fn fused(text: &str) -> shardc::ir::Model {
    let mut m = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify)
        .add(shardc::passes::InferShapes::default())
        .add(shardc::passes::Canonicalize)
        .add(shardc::passes::FuseAttention);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{e}"));
    m
}

/// A reduced Llama (fused attention, weights drawn) of one sequence of `seq` tokens, and its
/// training graph (MSE of its output, Adam).
fn llama(seq: usize) -> (shardc::ir::Graph, TrainInfo) {
    llama_batch(1, seq)
}

/// [`llama`] of `batch` sequences.
fn llama_batch(batch: usize, seq: usize) -> (shardc::ir::Graph, TrainInfo) {
    let mut m = fused(&Llama::reduced(2, batch, seq).to_text());
    shardc::exec::materialize(&mut m, std::path::Path::new("/nonexistent"), 3).expect("weights drawn");
    let (tm, info) =
        shardc::train::training_model(&m, &LossSpec::Mse(None), &OptimizerSpec::adam(1e-3)).expect("training graph");
    (tm.graph, info)
}

fn program(g: &shardc::ir::Graph, strategy: &str, devices: usize) -> Program {
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let opts = Options::default();
    let r = shardc::exec::named_result(g, &cluster, devices, strategy, &opts).unwrap_or_else(|e| panic!("{e}"));
    shardc::exec::training_program(g, &r, devices, 0).unwrap_or_else(|e| panic!("{e}"))
}

/// The query dims of the first attention of `device`'s program.
fn attention_query(p: &Program, device: usize) -> Vec<i64> {
    let lg = &p.devices[device].graph;
    let attention = lg.op_nodes().unwrap().into_iter().find(|&n| matches!(lg.node(n).op, Op::Attention(_))).unwrap();
    lg.tensor_type(lg.node(attention).input(0).unwrap()).and_then(|t| t.static_dims()).unwrap()
}

/// Trained gradients and parameters `got` within (1e-4, 1e-5) of one device's, `one`.
fn assert_trains_like(got: &shardc::train::TrainRun, one: &shardc::train::TrainRun, label: &str) {
    assert_trains_within(got, one, label, (1e-4, 1e-5));
}

/// [`assert_trains_like`] within `tol` (relative, absolute).
fn assert_trains_within(got: &shardc::train::TrainRun, one: &shardc::train::TrainRun, label: &str, tol: (f64, f64)) {
    for (what, a, b) in
        [("gradients", &got.gradients, &one.gradients), ("parameters", &got.parameters, &one.parameters)]
    {
        let (r, at) = shardc::train::worst(a, b, tol);
        assert!(r <= 1.0, "{label} {what}: {r:.2}× the tolerance at {at}");
    }
}

/// `steps` training steps of `g` on one device, on the CPU executor.
fn one_device(
    g: &shardc::ir::Graph,
    info: &TrainInfo,
    inputs: &HashMap<String, shardc::ir::eval::Array>,
    steps: usize,
) -> shardc::train::TrainRun {
    shardc::train::run_steps(&program(g, "data", 1), info, inputs, Backend::Cpu, steps).expect("one device")
}

/// Per kind, the collectives device 0 runs.
fn collectives(p: &Program) -> BTreeMap<String, usize> {
    let g = &p.devices[0].graph;
    let mut out = BTreeMap::new();
    for n in g.op_nodes().unwrap() {
        if g.node(n).op.class() == shardc::ir::OpClass::Comm {
            *out.entry(g.node(n).op.op_type().to_string()).or_insert(0) += 1;
        }
    }
    out
}

/// Every op but attention holds a quarter of the sequence; each attention (forward and
/// backward) a quarter of the heads, reached by all-to-alls; the other communication is the
/// weights' gradients all-reduced (partial sums over the sequence), the loss, and a few
/// gathers per layer. The
/// program is proved to compute the training step, and trains as one device does.
#[test]
fn ulysses_splits_the_sequence_and_attention_by_heads_and_trains_like_one_device() {
    let (g, info) = llama(96);
    let p = program(&g, "context", 4);
    let kinds = collectives(&p);
    let layers = 2;
    assert!(kinds.get("AllToAll").copied().unwrap_or(0) >= 8 * layers, "{kinds:?}");
    let weights = info.trainable.len();
    assert!(kinds.keys().all(|k| ["AllToAll", "AllReduce", "AllGather"].contains(&k.as_str())), "{kinds:?}");
    // (Gathered per layer: the value gradient of grouped-query attention, summed back over
    // each key/value head's query heads — the flow of the sequence does not see through the
    // attention's probabilities. The rotary embedding's slice gradients stay split.)
    assert!(kinds.get("AllGather").copied().unwrap_or(0) <= layers, "{kinds:?}");
    assert!(kinds["AllReduce"] <= weights + 1, "{kinds:?} for {weights} weights");
    assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
    // Each device's attention runs on 1 of the 4 query heads.
    assert_eq!(attention_query(&p, 1), vec![1, 1, 96, 16], "the query of device 1's attention");
    verify(&g, &p).unwrap_or_else(|e| panic!("not proved: {e}"));
    let inputs = shardc::train::seeded_inputs(&g, &info, 5).expect("inputs");
    let one = one_device(&g, &info, &inputs, 3);
    let four = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 3).expect("context 4");
    assert_trains_like(&four, &one, "context 4");
    for (a, b) in four.losses.iter().zip(&one.losses) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "loss {a} vs {b}");
    }
}

/// `cp=4` is the same plan; the strategy needs fused attention whose heads the devices
/// divide and a sequence they divide, and says so.
#[test]
fn context_parallelism_says_where_it_does_not_apply() {
    let (g, _) = llama(96);
    let cluster = Cluster::preset("dgx-a100").expect("preset");
    let opts = Options::default();
    let named = |s: &str, d: usize| shardc::exec::named_result(&g, &cluster, d, s, &opts).map(|_| ());
    named("context", 4).expect("4 devices");
    let e = named("context", 8).unwrap_err();
    assert!(e.contains("heads"), "8 devices over 4 heads: {e}");
    let (odd, _) = llama(90);
    let e = shardc::exec::named_result(&odd, &cluster, 4, "context", &opts).map(|_| ()).unwrap_err();
    assert!(e.contains("sequence (90) does not divide"), "{e}");
    let config = shardc::passes::autoshard::config::Config::parse("cp=4").unwrap();
    let (n, _) = config.resolve(4, Some(1), &opts).unwrap();
    assert_eq!(n.name(), "context");
    let unfused = {
        let mut m = shardc::frontend::parse(&Llama::reduced(2, 1, 96).to_text()).unwrap().model;
        let mut pm = shardc::passes::PassManager::new();
        pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default());
        pm.run(&mut m).unwrap();
        m.graph
    };
    let e = shardc::exec::named_result(&unfused, &cluster, 4, "context", &opts).map(|_| ()).unwrap_err();
    assert!(e.contains("fuse-attention"), "{e}");
}

fn shardc(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_shardc")).args(args).output().unwrap()
}

/// A directory of its own (`tag`) holding a reduced Llama of 2 sequences of 96 tokens with its
/// attention fused, as `shardc parse` writes it; the directory and the model.
fn cli_model(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    cli_model_of(tag, &Llama::reduced(2, 2, 96).to_text())
}

/// [`cli_model`] of the model `text`.
fn cli_model_of(tag: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("shardc-context-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (model, fused) = (dir.join("llama.onnxtxt"), dir.join("fused.onnxtxt"));
    std::fs::write(&model, text).unwrap();
    let passes = "infer-shapes,canonicalize,fuse-attention";
    let o = shardc(&["parse", model.to_str().unwrap(), "--passes", passes, "-o", fused.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    (dir, fused)
}

/// `shardc cost` prices `cp=4` (and `dp=2,cp=2`) with its all-to-alls, says it is context
/// parallelism, and exports it where the framework has the setting; `cp=4,cp_comm=p2p` with
/// ring attention's passes.
#[test]
fn cost_prices_and_names_context_parallelism() {
    let (dir, fused) = cli_model("cost");
    let o = shardc(&["cost", fused.to_str().unwrap(), "--cluster", "dgx-a100", "--devices", "4", "--strategy", "cp=4"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{o:?}");
    assert!(out.contains("parallelism  context 4"), "{out}");
    assert!(out.contains("all_to_all"), "{out}");
    // Data × context, and its launch settings: Megatron-LM's a2a context parallelism,
    // DeepSpeed's Ulysses group size; torch's tensor-parallel plan has none and says so.
    let cost = |extra: &[&str]| {
        let args = [
            "cost",
            fused.to_str().unwrap(),
            "--cluster",
            "dgx-a100",
            "--devices",
            "4",
            "--strategy",
            "dp=2,cp=2",
            "--batch",
            "2",
        ];
        shardc(&[&args[..], extra].concat())
    };
    let o = cost(&[]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("parallelism  data 2 × context 2"), "{o:?}");
    let o = cost(&["--export", "megatron"]);
    let megatron = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && megatron.contains("--context-parallel-size 2 --cp-comm-type a2a"), "{o:?}");
    assert!(megatron.contains("data 2 × tensor 1 × pipeline 1 × context 2 = 4 devices"), "{megatron}");
    let o = cost(&["--export", "deepspeed"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("\"sequence_parallel_size\": 2"), "{o:?}");
    let o = cost(&["--export", "torch-tp"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("context parallel"), "{o:?}");
    // Ring attention: its passes priced as point-to-point, Megatron-LM's p2p context
    // parallelism; DeepSpeed's is Ulysses, and its configuration says so.
    let ring = |extra: &[&str]| {
        let args = ["cost", fused.to_str().unwrap(), "--cluster", "dgx-a100", "--devices", "4"];
        shardc(&[&args[..], &["--strategy", "cp=4,cp_comm=p2p"], extra].concat())
    };
    let o = ring(&[]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && out.contains("parallelism  context 4") && out.contains("p2p"), "{o:?}");
    assert!(!out.contains("all_to_all"), "{out}");
    let o = ring(&["--export", "megatron"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("--context-parallel-size 4 --cp-comm-type p2p"), "{o:?}");
    let o = ring(&["--export", "deepspeed"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("priced with ring attention"), "{o:?}");
    let o = ring(&["--export", "torch-tp"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("ring attention"), "{o:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A long sequence's rotary positions (a `Range` of 131,072, too large to fold) have a known
/// shape, so a Llama at that length is planned, not refused for unknown shapes.
#[test]
fn a_long_sequence_has_known_shapes() {
    let mut m = shardc::frontend::parse(&Llama::reduced(1, 1, 131_072).to_text()).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default()).add(shardc::passes::RequireStatic);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{e}"));
    let g = &m.graph;
    let pos = g.lookup("rope_pos").expect("the rotary positions");
    assert_eq!(g.tensor_type(pos).and_then(|t| t.static_dims()), Some(vec![131_072]));
}

/// Data × context (`dp=2,cp=2`, `context:dp:2`): the batch over the first axis, Ulysses over
/// the second — all-to-alls within each pair of devices that share samples, the weights'
/// gradients all-reduced over all four — proved, and trained as one device trains.
#[test]
fn data_times_context_trains_like_one_device() {
    let (g, info) = llama_batch(2, 32);
    let p = program(&g, "context:dp:2", 4);
    let kinds = collectives(&p);
    assert!(kinds.get("AllToAll").copied().unwrap_or(0) >= 8 * 2, "{kinds:?}");
    assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
    // Device 1 (sample 0, heads 2–3 of 4) runs its attention on one sample and half the heads.
    assert_eq!(attention_query(&p, 1), vec![1, 2, 32, 16], "the query of device 1's attention");
    verify(&g, &p).unwrap_or_else(|e| panic!("not proved: {e}"));
    let inputs = shardc::train::seeded_inputs(&g, &info, 7).expect("inputs");
    let one = one_device(&g, &info, &inputs, 3);
    let four = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 3).expect("dp 2 × cp 2");
    assert_trains_like(&four, &one, "dp 2 × cp 2");
    let config = shardc::passes::autoshard::config::Config::parse("dp=2,cp=2").unwrap();
    let (n, _) = config.resolve(4, Some(2), &Options::default()).unwrap();
    assert_eq!(n.name(), "context:dp:2");
    let e =
        shardc::passes::autoshard::config::Config::parse("pp=2,cp=2").unwrap().resolve(4, Some(2), &Options::default());
    assert!(e.unwrap_err().contains("pp=1"));
}

/// Llama-3-8B at 131,072 tokens, 8 sequences, on 64 H100s (8 nodes) in bf16: the search
/// finds a data × context plan within memory; the causal mask is the attention's
/// `is_causal` (no 131,072² mask is made); the hand configuration that fits without context
/// parallelism (tensor 8 with sequence parallelism, full recomputation, ZeRO-3) is slower,
/// and without recomputation neither 8 × 8 fits.
#[test]
fn a_long_context_llama_3_8b_plans_with_context_parallelism() {
    use shardc::passes::autoshard::{self, config::Config};
    use shardc::passes::cost::Precision;
    let m = fused(&Llama::llama3_8b(8, 131_072).to_text());
    let g = &m.graph;
    let causal = g.op_nodes().unwrap().into_iter().filter_map(|n| match &g.node(n).op {
        Op::Attention(a) => Some(a.is_causal == Some(1) && g.node(n).input(3).is_none()),
        _ => None,
    });
    assert_eq!(causal.collect::<Vec<_>>(), vec![true; 32]);
    let cluster = Cluster::preset("h100-cluster-8").expect("preset");
    let opts = Options { precision: Precision::Fp16, ..Options::default() };
    let r = autoshard::search(g, &cluster, 64, &opts, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    let plan = r.same_as.clone().unwrap_or_default();
    assert!(r.breakdown.feasible, "{plan}: {:?}", r.breakdown.memory);
    assert!(plan.contains(",cp=") && !plan.contains("tp="), "{plan}");
    let axes: Vec<&str> = r.mesh.axes.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(axes, ["data", "context"]);
    // The plan says what fits without it (`plan --explain` prints this).
    let reason = r.context_reason.clone().expect("a context plan says what fits without it");
    assert!(reason.contains("tp=8") && reason.contains("× this plan's"), "{reason}");
    let priced = |config: &str| {
        let (named, o) = Config::parse(config).and_then(|c| c.resolve(64, Some(8), &opts)).unwrap();
        autoshard::named::price(g, &cluster, 64, &named, &o).unwrap_or_else(|e| panic!("{config}: {e}")).breakdown
    };
    let tensor = priced("dp=8,tp=8,sp,recompute=full,zero=3");
    assert!(tensor.feasible && tensor.step_time_s > r.breakdown.step_time_s, "{}", tensor.step_time_s);
    for config in ["dp=8,cp=8,zero=3", "dp=8,tp=8,sp,zero=3"] {
        assert!(!priced(config).feasible, "{config} fits");
    }
}

/// `shardc train --strategy dp=2,cp=2 --check` runs data × context on 4 devices and checks
/// losses, gradients and parameters against one device.
#[test]
fn train_runs_data_times_context_and_checks_it() {
    let (dir, fused) = cli_model("train");
    let args = ["train", fused.to_str().unwrap(), "--loss", "mse", "--devices", "4", "--strategy", "dp=2,cp=2"];
    let o = shardc(&[&args[..], &["--steps", "2", "--check", "--backend", "cpu"]].concat());
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success(), "{o:?}");
    assert!(out.contains("parallelism  data 2 × context 2"), "{out}");
    for what in ["losses", "gradients", "parameters"] {
        assert!(
            out.lines().any(|l| l.contains(&format!("check        {what}")) && l.contains(" ok ")),
            "{what}: {out}"
        );
    }
}

/// A forward model under data × context delivers its output cut along the batch and the
/// sequence (what a per-token loss reads where it is; the host assembles the pieces): no
/// collective gathers the sequence at the end, and `shardc run --check` assembles outputs
/// equal to one device's.
#[test]
fn a_context_parallel_output_stays_on_its_sequence_shards() {
    let m = fused(&Llama::reduced(2, 2, 32).to_text());
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let r = shardc::exec::named_result(&m.graph, &cluster, 4, "context:dp:2", &Options::default()).unwrap();
    let p = shardc::exec::program_for_search(&m.graph, &r, 4).unwrap();
    use shardc::ir::shard::AxisShard::Split;
    for d in &p.devices {
        let y = d.results.iter().find(|r| r.global == "y").expect("y");
        assert_eq!(y.layout, vec![Split(0), Split(1)], "y: [batch over data, sequence over context]");
    }
    assert!(!collectives(&p).contains_key("AllGather"), "{:?}", collectives(&p));
    let (dir, fused) = cli_model("run");
    let args = ["run", fused.to_str().unwrap(), "--devices", "4", "--strategy", "context:dp:2", "--check"];
    let o = shardc(&[&args[..], &["--backend", "cpu"]].concat());
    let _ = std::fs::remove_dir_all(&dir);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success() && out.lines().any(|l| l.trim_start().starts_with('y') && l.contains(" ok")), "{o:?}");
}

/// Context × tensor (`tp=2,cp=2`, `context:tp:2`), and data × context × tensor on 8 devices:
/// Megatron over the tensor axis, Ulysses over the context axis, each attention's heads over
/// both — proved, and trained as one device trains.
#[test]
fn context_times_tensor_trains_like_one_device() {
    let (g, info) = llama_batch(2, 32);
    let inputs = shardc::train::seeded_inputs(&g, &info, 11).expect("inputs");
    let one = one_device(&g, &info, &inputs, 2);
    for (strategy, devices) in [("context:tp:2", 4), ("context:dp:2,tp:2", 8)] {
        let p = program(&g, strategy, devices);
        let kinds = collectives(&p);
        // Ulysses' exchanges within each tensor rank's context group: q, k, v and the output
        // in the forward, their gradients in the backward, per layer.
        assert!(kinds.get("AllToAll").copied().unwrap_or(0) >= 2 * 8, "{strategy}: {kinds:?}");
        assert!(p.fallbacks.is_empty(), "{strategy}: {:?}", p.fallbacks);
        // Each attention runs on one of the 4 query heads (2 tensor × 2 context).
        let q = attention_query(&p, 1);
        assert_eq!(q[1], 1, "{strategy}: device 1's attention query {q:?}");
        verify(&g, &p).unwrap_or_else(|e| panic!("{strategy}: not proved: {e}"));
        let got = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 2).expect(strategy);
        assert_trains_like(&got, &one, strategy);
    }
    let config = shardc::passes::autoshard::config::Config::parse("dp=2,tp=2,cp=2").unwrap();
    let (n, _) = config.resolve(8, Some(2), &Options::default()).unwrap();
    assert_eq!(n.name(), "context:dp:2,tp:2");
    assert_eq!(shardc::passes::autoshard::Named::parse("context:dp:2,tp:2").unwrap(), n);
}

/// A reduced Llama at a long sequence — 512 tokens, 4,096 with `SHARDC_FULL_TRAIN=1` (about
/// 2 minutes a strategy here) — trains 5 steps on 4 devices under context 4 and context 2 ×
/// tensor 2, each as Ulysses and as ring attention, as one device trains it.
#[test]
fn a_long_sequence_trains_under_context_parallelism_like_one_device() {
    let seq = if std::env::var_os("SHARDC_FULL_TRAIN").is_some() { 4096 } else { 512 };
    let (g, info) = llama_batch(1, seq);
    let inputs = shardc::train::seeded_inputs(&g, &info, 13).expect("inputs");
    let steps = 5;
    let one = one_device(&g, &info, &inputs, steps);
    for strategy in ["context", "context:tp:2", "context:ring", "context:ring:tp:2"] {
        let p = program(&g, strategy, 4);
        assert!(p.fallbacks.is_empty(), "{strategy}: {:?}", p.fallbacks);
        verify(&g, &p).unwrap_or_else(|e| panic!("{strategy}: not proved: {e}"));
        let got = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, steps).expect(strategy);
        assert_trains_like(&got, &one, &format!("{strategy} at {seq} tokens"));
    }
}

/// Tensor-parallel configurations at a long sequence export to Megatron-LM: the attention
/// between the tensor-parallel GEMMs (heads split, a dim without a role of its own; most of
/// the tensor axis' FLOPs at 131,072 tokens) rides along the tensor axis — alone and beside
/// context parallelism.
#[test]
fn long_sequence_tensor_parallel_configurations_export() {
    let (dir, fused) = cli_model_of("export", &Llama::llama3_8b(8, 131_072).to_text());
    let cases = [
        ("dp=8,tp=8,recompute=full,sp,zero=1", &["--tensor-model-parallel-size 8", "--sequence-parallel"][..]),
        ("dp=2,tp=4,cp=8,mbs=1,zero=1", &["--tensor-model-parallel-size 4", "--context-parallel-size 8"][..]),
    ];
    for (config, want) in cases {
        let args = ["cost", fused.to_str().unwrap(), "--cluster", "h100-cluster-8", "--devices", "64"];
        let o = shardc(&[&args[..], &["--precision", "bf16", "--strategy", config, "--export", "megatron"]].concat());
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(o.status.success(), "{config}: {}", String::from_utf8_lossy(&o.stderr));
        for w in want {
            assert!(out.contains(w), "{config}: no `{w}` in\n{out}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One truth for the all-to-alls: a forward context plan prices, per kind of collective, the
/// bytes its lowered program moves — under context, data × context, context × tensor and
/// data × context × tensor; ring attention's passes of keys and values likewise.
#[test]
fn context_plans_move_the_bytes_their_programs_move() {
    let m = fused(&Llama::reduced(2, 2, 32).to_text());
    let (g, cluster, opts) = (&m.graph, Cluster::preset("local-wgpu").expect("preset"), Options::default());
    let plans = [
        ("context", 4, "all_to_all"),
        ("context:dp:2", 4, "all_to_all"),
        ("context:tp:2", 4, "all_to_all"),
        ("context:dp:2,tp:2", 8, "all_to_all"),
        ("context:ring", 4, "p2p"),
        ("context:ring:dp:2", 4, "p2p"),
        ("context:ring:tp:2", 4, "p2p"),
    ];
    for (strategy, devices, kind) in plans {
        let r = shardc::exec::named_result(g, &cluster, devices, strategy, &opts).unwrap();
        let plan = shardc::passes::autoshard::Plan::new(g, &cluster, devices, &opts, Default::default(), &r);
        let p = shardc::exec::program_for_search(g, &r, devices).unwrap();
        common::assert_forward_bytes_as_lowered(&plan, &p, kind, strategy);
    }
}

/// Llama-3-70B at 131,072 tokens, 16 sequences, on 256 H100s fits only with context
/// parallelism, and the plan says so: no configuration the grid priced without it fits.
#[test]
fn a_long_context_llama_3_70b_fits_only_with_context_parallelism() {
    use shardc::passes::autoshard;
    use shardc::passes::cost::Precision;
    let m = fused(&Llama::llama3_70b(16, 131_072).to_text());
    let cluster = Cluster::preset("h100-cluster-32").expect("preset");
    let opts = Options { precision: Precision::Fp16, ..Options::default() };
    let r = autoshard::search(&m.graph, &cluster, 256, &opts, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    let plan = r.same_as.clone().unwrap_or_default();
    assert!(r.breakdown.feasible && plan.contains(",cp="), "{plan}: {:?}", r.breakdown.memory);
    let reason = r.context_reason.clone().expect("a context plan says what fits without it");
    assert!(reason.starts_with("no configuration without it"), "{reason}");
}

/// Ring attention (`context:ring`, `cp=4,cp_comm=p2p`): every op, attention included, holds a
/// quarter of the sequence; each attention passes its keys and values around the four devices
/// (three passes forward; in the backward three for the log-sum-exp, three more beside the
/// four passes of their gradients) and merges the blocks it sees — zig-zag, so that under the
/// causal mask every device computes the same blocks. Proved, and trained as one device trains.
#[test]
fn ring_attention_passes_keys_and_values_around_and_trains_like_one_device() {
    let (g, info) = llama(96);
    let p = program(&g, "context:ring", 4);
    assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
    let kinds = collectives(&p);
    let layers = 2;
    // Zig-zag: each device runs the ring on two chunks of keys and values. Keys and values:
    // 3 passes forward, 3 + 3 backward; their gradients: 4 passes — two chunks each; device 0
    // moves one of its chunks of Q, K, V (forward) and of Q, K, V, dY, Y (gradient) into the
    // ring's order, and one of Y's (forward) and of dQ, dK, dV's (gradient) back.
    let (moved_in, moved_out) = shardc::ir::ops::flash::zigzag_sends(0, 4);
    let passes = 2 * (2 * 3 + 2 * 3 + 2 * 3 + 2 * 4);
    let moves = 8 * moved_in + 4 * moved_out;
    assert_eq!(kinds.get("Send").copied(), Some(layers * (passes + moves)), "{kinds:?}");
    assert_eq!(kinds.get("Send"), kinds.get("Recv"), "{kinds:?}");
    assert!(!kinds.contains_key("AllToAll"), "no Ulysses exchange: {kinds:?}");
    // Forward and the backward's log-sum-exp ring: every device computes the same blocks —
    // its own three (two halves on the diagonal), then two of each other device's — where
    // a plain ring's device d computes d + 1.
    let blocks = |d: usize| ring_blocks(&p, d).len();
    assert_eq!((0..4).map(blocks).collect::<Vec<_>>(), [2 * layers * (3 + 2 * 3); 4], "blocks per device");
    verify(&g, &p).unwrap_or_else(|e| panic!("not proved: {e}"));
    let inputs = shardc::train::seeded_inputs(&g, &info, 5).expect("inputs");
    let one = one_device(&g, &info, &inputs, 3);
    let four = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 3).expect("ring 4");
    assert_trains_like(&four, &one, "ring 4");
    let config = shardc::passes::autoshard::config::Config::parse("cp=4,cp_comm=p2p").unwrap();
    let (n, _) = config.resolve(4, Some(1), &Options::default()).unwrap();
    assert_eq!(n.name(), "context:ring");
}

/// Ring attention beside data and tensor parallelism: `context:ring:dp:2` (the ring within
/// each pair of devices that share samples) and `context:ring:tp:2` (heads over the tensor
/// axis, the sequence around the context axis) — proved, and trained as one device trains.
#[test]
fn ring_attention_beside_data_and_tensor_parallelism_trains_like_one_device() {
    let (g, info) = llama_batch(2, 32);
    let inputs = shardc::train::seeded_inputs(&g, &info, 11).expect("inputs");
    let one = one_device(&g, &info, &inputs, 2);
    for strategy in ["context:ring:dp:2", "context:ring:tp:2"] {
        let p = program(&g, strategy, 4);
        assert!(p.fallbacks.is_empty(), "{strategy}: {:?}", p.fallbacks);
        assert!(collectives(&p).contains_key("Send"), "{strategy}: {:?}", collectives(&p));
        verify(&g, &p).unwrap_or_else(|e| panic!("{strategy}: not proved: {e}"));
        let got = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 2).expect(strategy);
        assert_trains_like(&got, &one, strategy);
        assert_eq!(shardc::passes::autoshard::Named::parse(strategy).unwrap().name(), strategy);
    }
}

/// The `AttentionBlock` ops of `device`'s program, in order (the forward's first).
fn ring_blocks(p: &Program, device: usize) -> Vec<shardc::ir::NodeId> {
    let lg = &p.devices[device].graph;
    lg.op_nodes().unwrap().into_iter().filter(|&n| matches!(lg.node(n).op, Op::AttentionBlock(_))).collect()
}

/// Seeded ring-attention bugs the prover refutes, naming the op: a block whose key offset
/// does not place its keys (device 2's causal mask off by one block), one block merged
/// twice in place of another (device 3 merging its own keys again, the offset matching), and
/// a zig-zag chunk sent to a device that does not run the ring on it.
#[test]
fn seeded_ring_attention_bugs_are_refuted() {
    use shardc::codegen::RefutationKind;
    let (g, _) = llama(32);
    let p = program(&g, "context:ring", 4);
    let offset_by = |op: &Op, k: Option<i64>| match op {
        Op::AttentionBlock(a) => Op::AttentionBlock(shardc::ir::op::AttentionBlock { k_offset: k, ..a.clone() }),
        other => panic!("not a block: {other:?}"),
    };
    let mut shifted = p.clone();
    let n = ring_blocks(&shifted, 2)[1];
    let lg = &mut shifted.devices[2].graph;
    let Op::AttentionBlock(a) = &lg.node(n).op else { unreachable!() };
    let op = offset_by(&lg.node(n).op, Some(a.k_offset.unwrap_or(0) + 8));
    lg.set_op(n, op);
    let mut twice = p.clone();
    // Device 3's first block and the next one merged into the same query chunk's output.
    let blocks = ring_blocks(&twice, 3);
    let own = blocks[0];
    let query = |n| twice.devices[3].graph.node(n).input(0);
    let next = *blocks[1..].iter().find(|&&n| query(n) == query(own)).expect("a second block of the chunk");
    let lg = &mut twice.devices[3].graph;
    let (k, v) = (lg.node(own).input(1), lg.node(own).input(2));
    lg.set_input(next, 1, k);
    lg.set_input(next, 2, v);
    let Op::AttentionBlock(a) = &lg.node(own).op else { unreachable!() };
    let op = offset_by(&lg.node(next).op, a.k_offset);
    lg.set_op(next, op);
    // Zig-zag: device 1 sends one of its chunks to a device that does not run the ring on it.
    let mut astray = p.clone();
    let lg = &mut astray.devices[1].graph;
    let chunk_send = lg
        .op_nodes()
        .unwrap()
        .into_iter()
        .find(|&n| {
            matches!(lg.node(n).op, Op::Send(_))
                && lg.node(n).input(0).is_some_and(|x| matches!(lg.node(x.node).op, Op::Slice(_)))
        })
        .expect("a zig-zag move");
    let Op::Send(s) = lg.node(chunk_send).op.clone() else { unreachable!() };
    let peer = (s.peer.unwrap() + 1) % 4;
    let peer = if peer == 1 { 2 } else { peer };
    lg.set_op(chunk_send, Op::Send(shardc::ir::op::Send { peer: Some(peer), ..s }));
    for (what, bad, expect) in [("shifted", shifted, "offsets"), ("twice", twice, "twice"), ("astray", astray, "waits")]
    {
        let e = verify(&g, &bad).map(|_| ()).expect_err(what);
        assert_eq!(e.kind, RefutationKind::Wrong, "{what}: {e}");
        assert!(e.device.is_some() && e.op.is_some() && e.to_string().contains(expect), "{what}: {e}");
    }
}

/// Ring attention trains on wgpu, a device per simulated accelerator: the blocks and their
/// gradients on their own kernels (none on the host), equal to one device on the CPU
/// executor (f32 kernels against the reference: 1e-3 relative).
#[test]
fn ring_attention_trains_on_wgpu_like_one_device() {
    if !shardc_tests::gpu_available() {
        return;
    }
    let (g, info) = llama(32);
    let p = program(&g, "context:ring", 4);
    let inputs = shardc::train::seeded_inputs(&g, &info, 5).expect("inputs");
    let one = one_device(&g, &info, &inputs, 2);
    let got = shardc::train::run_steps(&p, &info, &inputs, Backend::Wgpu, 2).expect("ring 4 on wgpu");
    for d in &got.report.devices {
        let host = &d.host_ops;
        assert!(!host.contains_key("AttentionBlock") && !host.contains_key("AttentionGrad"), "on the host: {host:?}");
    }
    assert_trains_within(&got, &one, "ring on wgpu", (1e-3, 1e-5));
}

/// Ring attention needs no head count the devices divide: the reduced Llama's 4 query heads
/// (2 key/value heads) keep Ulysses to 4 devices, while the ring splits its sequence over 8 —
/// proved, and trained as one device trains.
#[test]
fn ring_attention_splits_the_sequence_over_more_devices_than_heads() {
    let (g, info) = llama(96);
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let e = shardc::exec::named_result(&g, &cluster, 8, "context", &Options::default()).map(|_| ()).unwrap_err();
    assert!(e.contains("heads"), "{e}");
    let p = program(&g, "context:ring", 8);
    assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
    let lg = &p.devices[7].graph;
    let block = ring_blocks(&p, 7)[0];
    let q = lg.tensor_type(lg.node(block).input(0).unwrap()).and_then(|t| t.static_dims()).unwrap();
    assert_eq!(q, vec![1, 4, 6, 16], "device 7's queries: all heads, a zig-zag chunk of 6 of 96 positions");
    assert_eq!(ring_blocks(&p, 7).len(), 2 * 2 * (3 + 2 * 7), "device 7's blocks, forward and backward, 2 layers");
    verify(&g, &p).unwrap_or_else(|e| panic!("not proved: {e}"));
    let inputs = shardc::train::seeded_inputs(&g, &info, 3).expect("inputs");
    let one = one_device(&g, &info, &inputs, 2);
    let eight = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 2).expect("ring 8");
    assert_trains_like(&eight, &one, "ring 8");
}
