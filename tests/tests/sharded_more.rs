//! Sharded execution beyond single-stage named strategies: pipelined plans (stages exchanging
//! micro-batches by Send/Recv) on the golden networks, and reduced shared models (random
//! weights where their external data is absent) under named strategies and searched plans on
//! 2, 4 and 8 simulated devices — every output equal to the single-device reference.

use std::collections::HashMap;
use std::time::Duration;

use codegen::{Backend, RunOptions};
use ir::eval::Array;
use passes::autoshard::{self, PipelineMode, SearchOptions};
use passes::cost::{Cluster, Options};
use shardc_tests::*;

fn prepared(path: &std::path::Path, shapes: &[(&str, &[i64])]) -> ir::Model {
    let mut m = load_model(path);
    let mut pm = passes::PassManager::new();
    if !shapes.is_empty() {
        let spec = passes::RebatchSpec {
            batch: None,
            input_shapes: shapes.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect(),
            // External constants read beside the model (absent here: drawn from the seed).
            external: passes::ExternalData::Read(shardc::exec::external_reader(path.parent().unwrap())),
            ..Default::default()
        };
        pm.add(passes::Rebatch { spec });
    }
    pm.add(passes::Verify).add(passes::InferShapes::default()).add(passes::Canonicalize);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    shardc::exec::materialize(&mut m, path.parent().unwrap(), 7).unwrap_or_else(|e| panic!("{e}"));
    m
}

fn search(g: &ir::Graph, devices: usize, pipeline: PipelineMode) -> autoshard::SearchResult {
    let c = Cluster::preset("local-wgpu").unwrap();
    let so = SearchOptions { pipeline, time_limit: Duration::from_secs(20), ..Default::default() };
    autoshard::search(g, &c, devices, &Options::default(), &so).unwrap_or_else(|e| panic!("{e}"))
}

/// Lowers, checks, proves and runs `r` on the CPU executor; every output within `rtol` of
/// `reference`.
fn run_and_compare(
    what: &str,
    g: &ir::Graph,
    r: &autoshard::SearchResult,
    devices: usize,
    inputs: &HashMap<String, Array>,
    reference: &[Array],
) -> codegen::Program {
    let prog = shardc::exec::program_for_search(g, r, devices).unwrap_or_else(|e| panic!("{what}: {e}"));
    codegen::check(&prog).unwrap_or_else(|e| panic!("{what}: {e:?}"));
    // Proved before it runs (docs/verify.md): a pipeline's programs against one micro-batch.
    let proof = shardc::exec::proof_graph(g, &prog).unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Err(e) = codegen::verify(&proof, &prog) {
        panic!("{what}: not proved ({:?}): {e}", e.kind);
    }
    let out = codegen::run(&prog, inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(out.outputs.len(), reference.len(), "{what}");
    for ((name, got), want) in out.outputs.iter().zip(reference) {
        compare(name, got, want, 1e-4, 1e-5).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    prog
}

#[test]
fn pipelined_plans_run_and_match_the_reference() {
    let mut ran = 0;
    for name in ["tiny_mlp", "tiny_resnet", "tiny_gpt", "tiny_lstm_lm"] {
        let path = repo_root().join(format!("tests/data/golden/{name}.onnxtxt"));
        let path = if path.exists() { path } else { repo_root().join(format!("../shared/golden/{name}.onnxtxt")) };
        let m = prepared(&path, &[]);
        let g = &m.graph;
        let inputs = load_io(&path).inputs;
        let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
        for (devices, stages) in [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)] {
            let r = search(g, devices, PipelineMode::Stages(stages));
            let Some(p) = &r.pipeline else { continue };
            let what = format!("{name}: {stages} stages on {devices} devices, {} micro-batches", p.micro_batches);
            let prog = run_and_compare(&what, g, &r, devices, &inputs, &reference);
            // The stages really exchange activations.
            let sends: usize = prog
                .devices
                .iter()
                .map(|d| {
                    d.graph
                        .op_nodes()
                        .unwrap()
                        .iter()
                        .filter(|&&n| matches!(d.graph.node(n).op, ir::Op::Send(_)))
                        .count()
                })
                .sum();
            assert!(sends > 0, "{what}: no Send between stages");
            assert_eq!(prog.stage_devices.len(), p.stages.len(), "{what}");
            ran += 1;
        }
    }
    assert!(ran >= 12, "{ran} pipelined plans ran");
}

#[test]
fn reduced_shared_models_run_sharded_and_match_the_reference() {
    type Case<'a> = (&'a str, Vec<(&'a str, &'a [i64])>, &'a [(&'a str, usize)]);
    let cnn: &[(&str, usize)] =
        &[("data", 2), ("model", 4), ("megatron", 4), ("spatial", 2), ("spatial-hybrid:2x2", 4), ("owt", 8)];
    let seq: &[(&str, usize)] =
        &[("data", 2), ("model", 2), ("model", 4), ("megatron", 4), ("hybrid:dp:2,tp:4", 8), ("hybrid:dp:2,tp:2", 4)];
    let cases: Vec<Case<'_>> = vec![
        ("tv_resnet18", vec![("input", &[4, 3, 32, 32])], cnn),
        ("tv_squeezenet1_1", vec![("input", &[4, 3, 48, 48])], cnn),
        ("tv_mobilenet_v2", vec![("input", &[2, 3, 32, 32])], cnn),
        ("hf_gpt2_small4", vec![("input_ids", &[2, 16])], seq),
        ("pt_lstm_lm", vec![], seq),
    ];
    let mut ran = 0;
    for (name, shapes, strategies) in &cases {
        let path = repo_root().join(format!("tests/data/models/{name}.onnxtxt"));
        let m = prepared(&path, shapes);
        let g = &m.graph;
        let inputs = shardc::exec::inputs_for(g, None, 3).unwrap();
        let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
        let c = Cluster::preset("local-wgpu").unwrap();
        for (strategy, devices) in strategies.iter() {
            let Ok(r) = shardc::exec::named_result(g, &c, *devices, strategy, &Options::default()) else { continue };
            run_and_compare(&format!("{name}: {strategy} on {devices}"), g, &r, *devices, &inputs, &reference);
            ran += 1;
        }
        // The searched plan (pipelines allowed) on 8 devices.
        let r = search(g, 8, PipelineMode::Auto);
        run_and_compare(&format!("{name}: searched plan on 8"), g, &r, 8, &inputs, &reference);
        ran += 1;
    }
    assert!(ran >= 20, "{ran}");
}
