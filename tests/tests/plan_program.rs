//! Plan = program: for every bundled real model (batch 8), the searched plan on 8 devices of
//! `dgx-a100` and on 64 of `a100-cluster-8` is lowered to per-device programs, and the bytes
//! each device sends per phase and kind as the plan prices them (`bytes_moved_per_device`)
//! equal what the lowered program's communication ops move. No op of a searched plan may fall
//! back to running replicated, and no graph output may be left as partial sums.

use std::collections::BTreeMap;

use passes::autoshard::{self, PipelineMode, SearchOptions};
use passes::cost::{Cluster, Options};
use shardc_tests::*;

/// Inputs whose non-batch dims the export leaves symbolic get a concrete shape.
fn fixed_shapes(name: &str) -> Vec<(String, Vec<i64>)> {
    match name {
        "ppocrv5_rec" => vec![("x".into(), vec![8, 3, 48, 320])],
        _ => Vec::new(),
    }
}

/// The model at batch 8 — or at its exported batch where the export baked the batch into a
/// parameter's shape (rebatching refuses to change a parameter).
fn prepared(path: &std::path::Path) -> ir::Model {
    let name = path.file_stem().unwrap().to_string_lossy().to_string();
    let run = |batch: Option<i64>| {
        let mut m = load_model(path);
        let spec = passes::RebatchSpec {
            batch,
            input_shapes: fixed_shapes(&name).into_iter().collect(),
            ..Default::default()
        };
        let mut pm = passes::PassManager::new();
        pm.add(passes::Verify)
            .add(passes::Rebatch { spec })
            .add(passes::InferShapes::default())
            .add(passes::Canonicalize)
            .add(passes::Algebra);
        pm.run(&mut m).map(|_| m)
    };
    match run(Some(8)) {
        Ok(m) => m,
        Err(e) if e.to_string().contains("cannot rebatch: parameter") => {
            run(None).unwrap_or_else(|e| panic!("{name}: {e}"))
        }
        Err(e) => panic!("{name}: {e}"),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) + 1e-3
}

/// Checks one model on one cluster; the description of each disagreement.
fn check(name: &str, g: &ir::Graph, cluster: &str, devices: usize) -> Vec<String> {
    let c = Cluster::preset(cluster).unwrap();
    let so = SearchOptions { pipeline: PipelineMode::Off, ..Default::default() };
    let r = autoshard::search(g, &c, devices, &Options::default(), &so).unwrap_or_else(|e| panic!("{name}: {e}"));
    compare(name, g, cluster, devices, &r)
}

/// Lowers the searched plan `r` of `g` and compares what it prices with what the program
/// moves; the description of each disagreement.
fn compare(name: &str, g: &ir::Graph, cluster: &str, devices: usize, r: &autoshard::SearchResult) -> Vec<String> {
    let c = Cluster::preset(cluster).unwrap();
    let plan = autoshard::Plan::new(g, &c, devices, &Options::default(), Default::default(), r);
    let prog = shardc::exec::program_for_search(g, r, devices).unwrap_or_else(|e| panic!("{name} on {cluster}: {e}"));
    let mut bad = Vec::new();
    // The program computes the model (docs/verify.md); a pipeline's, one micro-batch of it.
    let proof = shardc::exec::proof_graph(g, &prog).unwrap_or_else(|e| panic!("{name} on {cluster}: {e}"));
    if let Err(e) = codegen::verify(&proof, &prog) {
        bad.push(format!("{name} on {cluster}: not proved ({:?}): {e}", e.kind));
    }
    if !prog.fallbacks.is_empty() {
        bad.push(format!("{name} on {cluster}: ops fell back to replicated: {:?}", prog.fallbacks));
    }
    for res in prog.devices.iter().flat_map(|d| &d.results) {
        if res.layout.contains(&ir::shard::AxisShard::Partial) {
            bad.push(format!("{name} on {cluster}: output `{}` left as partial sums", res.global));
        }
    }
    let priced = &plan.bytes_moved_per_device;
    let lowered = prog.bytes_moved_per_device();
    let empty = BTreeMap::new();
    let fwd_p = priced.get("forward").unwrap_or(&empty);
    let fwd_l = lowered.get("forward").unwrap_or(&empty);
    let kinds: std::collections::BTreeSet<&String> = fwd_p.keys().chain(fwd_l.keys()).collect();
    for kind in kinds {
        let (a, b) = (fwd_p.get(kind).copied().unwrap_or(0.0), fwd_l.get(kind).copied().unwrap_or(0.0));
        if !close(a, b) {
            bad.push(format!("{name} on {cluster}: forward {kind}: plan {a:.0} B, program {b:.0} B per device"));
        }
    }
    // Every collective entry carries its group and bytes moved, consistent with its kind.
    for col in &plan.collectives {
        let p = col.group_size as f64;
        use passes::cost::collective::CommKind;
        let want = match col.kind {
            CommKind::AllReduce => 2.0 * (p - 1.0) / p * col.bytes,
            CommKind::Halo | CommKind::P2p => col.bytes,
            _ => (p - 1.0) / p * col.bytes,
        };
        if col.group_size == 0 || !close(col.bytes_moved, want) {
            bad.push(format!("{name} on {cluster}: collective {col:?} has inconsistent bytes_moved"));
        }
    }
    bad
}

#[test]
fn plans_move_the_bytes_their_programs_move() {
    let dir = repo_root().join("tests/data/models");
    let mut models: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnxtxt"))
        .collect();
    models.sort();
    assert!(models.len() >= 15, "{} models", models.len());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(4);
    let chunks: Vec<Vec<std::path::PathBuf>> =
        (0..threads).map(|t| models.iter().skip(t).step_by(threads).cloned().collect()).collect();
    let bad: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .iter()
            .map(|chunk| {
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for path in chunk {
                        let name = path.file_stem().unwrap().to_string_lossy().to_string();
                        let m = prepared(path);
                        for (cluster, devices) in [("dgx-a100", 8), ("a100-cluster-8", 64)] {
                            bad.extend(check(&name, &m.graph, cluster, devices));
                        }
                    }
                    bad
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The plans `shardc plan` makes for the shared GPT-2 and BERT on 8 dgx-a100 GPUs at batch 8,
/// with the rewrites the search chooses (`fuse-gemms` joins each layer's Q, K and V
/// projections head by head; `fuse-attention` makes each attention one op): every layer's
/// attention split by heads, the
/// plans priced faster than the `megatron` and `data` named strategies, and the lowered
/// programs of the rewritten graphs move the bytes the plans price.
#[test]
fn transformer_plans_with_rewrites_split_heads_and_move_what_they_price() {
    let c = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    for name in ["hf_gpt2_124m", "hf_bert_base"] {
        let mut m = prepared(&repo_root().join(format!("tests/data/models/{name}.onnxtxt")));
        let named = |s: &str| shardc::exec::named_result(&m.graph, &c, 8, s, &opts).unwrap().breakdown.step_time_s;
        let (megatron, data) = (named("megatron"), named("data"));
        let so = SearchOptions { pipeline: PipelineMode::Off, ..Default::default() };
        let r = autoshard::search_rewriting(&mut m.graph, &c, 8, &opts, &so).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(r.rewrites.iter().any(|x| x.rule == "fuse-gemms" && x.applied), "{name}: {:?}", r.rewrites);
        let step = r.breakdown.step_time_s;
        assert!(step < megatron && step < data, "{name}: searched {step}, megatron {megatron}, data {data}");
        // The attention: one `Attention` op per layer where `fuse-attention` was taken, else
        // its two products, MatMuls of two rank-4 activations.
        let g = &m.graph;
        let fused = r.rewrites.iter().any(|x| x.rule == "fuse-attention" && x.applied);
        let rank4 = |v: Option<ir::Value>| {
            v.is_some_and(|v| g.initializer(v).is_none() && g.tensor_type(v).is_some_and(|t| t.rank() == Some(4)))
        };
        let products: Vec<String> = g
            .op_nodes()
            .unwrap()
            .into_iter()
            .filter(|&n| match g.node(n).op {
                ir::Op::Attention(_) => true,
                ir::Op::MatMul(_) => rank4(g.node(n).input(0)) && rank4(g.node(n).input(1)),
                _ => false,
            })
            .map(|n| g.node(n).outputs()[0].name.clone())
            .collect();
        assert_eq!(products.len(), if fused { 12 } else { 24 }, "{name}");
        let plan = autoshard::Plan::new(g, &c, 8, &opts, Default::default(), &r);
        let heads = if fused { "h→" } else { "b1→" };
        for p in &products {
            let op = plan.ops.iter().find(|o| o.outputs.first() == Some(p)).unwrap();
            assert!(op.strategy.contains(heads), "{name}: {}: {}", op.name, op.strategy);
        }
        let bad = compare(name, g, "dgx-a100", 8, &r);
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }
}
