//! Context parallelism as DeepSpeed-Ulysses runs it (`--strategy context`, `cp=N`): the
//! sequence split over the devices, attention by heads, all-to-alls between — lowered, proved
//! and trained equal to one device.

use std::collections::BTreeMap;

use shardc::codegen::{Backend, Program, verify};
use shardc::ir::Op;
use shardc::passes::autodiff::{LossSpec, OptimizerSpec, TrainInfo};
use shardc::passes::cost::{Cluster, Options};
use shardc::synthetic::Llama;

/// A reduced Llama (fused attention, weights drawn) of one sequence of `seq` tokens, and its
/// training graph (MSE of its output, Adam).
fn llama(seq: usize) -> (shardc::ir::Graph, TrainInfo) {
    let mut m = shardc::frontend::parse(&Llama::reduced(2, 1, seq).to_text()).expect("parses").model;
    shardc::exec::materialize(&mut m, std::path::Path::new("/nonexistent"), 3).expect("weights drawn");
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify)
        .add(shardc::passes::InferShapes::default())
        .add(shardc::passes::Canonicalize)
        .add(shardc::passes::FuseAttention);
    pm.run(&mut m).expect("fused");
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
    // attention's probabilities — and the four gradients of the rotary embedding's slices,
    // which split only along the batch.)
    assert!(kinds.get("AllGather").copied().unwrap_or(0) <= 5 * layers, "{kinds:?}");
    assert!(kinds["AllReduce"] <= weights + 1, "{kinds:?} for {weights} weights");
    assert!(p.fallbacks.is_empty(), "{:?}", p.fallbacks);
    // Each device's attention runs on 1 of the 4 query heads.
    let lg = &p.devices[1].graph;
    let attention = lg.op_nodes().unwrap().into_iter().find(|&n| matches!(lg.node(n).op, Op::Attention(_))).unwrap();
    let q = lg.tensor_type(lg.node(attention).input(0).unwrap()).and_then(|t| t.static_dims()).unwrap();
    assert_eq!(q, vec![1, 1, 96, 16], "the query of device 1's attention");
    verify(&g, &p).unwrap_or_else(|e| panic!("not proved: {e}"));
    let inputs = shardc::train::seeded_inputs(&g, &info, 5).expect("inputs");
    let one = shardc::train::run_steps(&program(&g, "data", 1), &info, &inputs, Backend::Cpu, 3).expect("one device");
    let four = shardc::train::run_steps(&p, &info, &inputs, Backend::Cpu, 3).expect("context 4");
    let tol = (1e-4, 1e-5);
    for (what, a, b) in
        [("gradients", &four.gradients, &one.gradients), ("parameters", &four.parameters, &one.parameters)]
    {
        let (r, at) = shardc::train::worst(a, b, tol);
        assert!(r <= 1.0, "{what}: {r:.2}× the tolerance at {at}");
    }
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

/// `shardc cost` prices `cp=4` with its all-to-alls and says it is context parallelism.
#[test]
fn cost_prices_and_names_context_parallelism() {
    let dir = std::env::temp_dir().join(format!("shardc-context-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (model, fused) = (dir.join("llama.onnxtxt"), dir.join("fused.onnxtxt"));
    std::fs::write(&model, Llama::reduced(2, 1, 96).to_text()).unwrap();
    let shardc = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_shardc")).args(args).output().unwrap();
    let passes = "infer-shapes,canonicalize,fuse-attention";
    let o = shardc(&["parse", model.to_str().unwrap(), "--passes", passes, "-o", fused.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let o = shardc(&["cost", fused.to_str().unwrap(), "--cluster", "dgx-a100", "--devices", "4", "--strategy", "cp=4"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success(), "{o:?}");
    assert!(out.contains("parallelism  context 4"), "{out}");
    assert!(out.contains("all_to_all"), "{out}");
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
