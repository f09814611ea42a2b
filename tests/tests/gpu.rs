//! The wgpu executor on lavapipe (or any adapter): every golden case on one simulated device
//! matches onnxruntime's outputs, and sharded runs match the reference.
//!
//! Without an adapter these tests are skipped, unless `SHARDC_REQUIRE_GPU` is set (as `.ci/run`
//! does), when a missing adapter is a failure.

use codegen::{Backend, Placement, RunOptions};
use shardc_tests::*;

fn gpu_available() -> bool {
    match codegen::runtime::gpu::open() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var_os("SHARDC_REQUIRE_GPU").is_some() {
                panic!("SHARDC_REQUIRE_GPU is set but no adapter opens: {e}");
            }
            eprintln!("skipping: no GPU adapter ({e})");
            false
        }
    }
}

fn prepared(path: &std::path::Path) -> ir::Model {
    let mut m = load_model(path);
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default()).add(passes::Canonicalize);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m
}

#[test]
fn every_golden_case_runs_on_one_wgpu_device() {
    if !gpu_available() {
        return;
    }
    let mut host_ops = std::collections::BTreeMap::new();
    for path in data_files("golden") {
        let m = prepared(&path);
        let io = load_io(&path);
        let prog = codegen::lower(&m.graph, &Placement::single()).unwrap();
        let r = codegen::run(&prog, &io.inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() })
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(r.outputs.len(), io.outputs.len());
        for (name, want) in &io.outputs {
            let got = &r.outputs.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no output `{name}`")).1;
            compare(name, got, want, io.rtol, io.atol).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        for (op, k) in &r.devices[0].host_ops {
            *host_ops.entry(op.clone()).or_insert(0) += k;
        }
    }
    eprintln!("ops run on the host: {host_ops:?}");
}

#[test]
fn sharded_plans_run_on_wgpu_devices_and_match_the_reference() {
    use passes::cost::{Cluster, CostModel, Named, Options};
    if !gpu_available() {
        return;
    }
    let c = Cluster::preset("dgx-a100").unwrap();
    let mut ran = 0;
    for path in data_files("golden") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if ![
            "tiny_resnet.onnxtxt",
            "tiny_gpt.onnxtxt",
            "tiny_mlp.onnxtxt",
            "tiny_lstm_lm.onnxtxt",
            "conv2d_basic.onnxtxt",
            "norm_layers.onnxtxt",
        ]
        .contains(&name.as_str())
        {
            continue;
        }
        let m = prepared(&path);
        let g = &m.graph;
        let io = load_io(&path);
        let reference = ir::eval::run(g, &io.inputs, &Default::default()).unwrap();
        for (strategy, devices) in [("data", 2), ("model", 2), ("spatial", 2), ("hybrid:2x2", 4), ("model", 4)] {
            let named = Named::parse(strategy).unwrap();
            let Ok(mesh) = named.mesh(&c, devices) else { continue };
            let cm = CostModel::new(g, &c, mesh.clone(), Options::default());
            let Ok(asg) = passes::cost::strategy::assign(&cm, &named) else { continue };
            let pl = Placement {
                stages: vec![codegen::StagePlacement { mesh, devices: (0..devices).collect() }],
                strategies: asg.strategies,
                stage_of: Default::default(),
                micro_batches: 1,
            };
            let prog = codegen::lower(g, &pl).unwrap_or_else(|e| panic!("{name} {strategy}: {e}"));
            codegen::check(&prog).unwrap_or_else(|e| panic!("{name} {strategy}: {e:?}"));
            let r = codegen::run(&prog, &io.inputs, &RunOptions { backend: Backend::Wgpu, ..Default::default() })
                .unwrap_or_else(|e| panic!("{name} {strategy} on {devices}: {e}"));
            for ((out, got), want) in r.outputs.iter().zip(&reference) {
                compare(out, got, want, 1e-4, 1e-5).unwrap_or_else(|e| panic!("{name} {strategy} on {devices}: {e}"));
            }
            ran += 1;
        }
    }
    assert!(ran >= 15, "{ran}");
}
