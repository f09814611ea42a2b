//! A compiler built on shardc's driver (`shardc::session`): load a model, insert a pass of its
//! own, plan the model for two devices, lower and run it checked against one device, then
//! train it data-parallel. `cargo run --example driver [MODEL]` (default: a bundled MLP).

use shardc::codegen::Backend;
use shardc::ir::{Graph, Op};
use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::passes::{self, Changed, Pass, PassCx, PassError, PassManager, cost::Cluster};
use shardc::session::{self, Choice, train};

/// A pass of the compiler's own, run between shardc's: counts the matrix products.
struct CountMatMuls;

impl Pass for CountMatMuls {
    fn name(&self) -> &'static str {
        "count-matmuls"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let n = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::MatMul(_) | Op::Gemm(_))).count();
        cx.stats.add("matrix products", n as u64);
        Ok(Changed::No)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bundled = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/golden/tiny_mlp.onnxtxt");
    let path = std::env::args().nth(1).unwrap_or_else(|| bundled.into());
    let mut model = shardc::load_model(path.as_ref()).map_err(|e| e.render())?.model;
    let mut pm = PassManager::new();
    pm.add(passes::InferShapes::default()).add(CountMatMuls).add(passes::Canonicalize);
    let report = pm.run(&mut model).map_err(|e| format!("{e:?}"))?;
    println!("{:?}", report.stats.iter().collect::<Vec<_>>());
    let (cluster, opts) = (Cluster::load("local-wgpu").map_err(|e| e.to_string())?, Default::default());

    // Forward: plan, lower, run on two CPU devices, check against one.
    let g = &model.graph;
    let planned = session::plan(g, Choice::Strategy("data"), &cluster, 2, &opts)?;
    let inputs = shardc::exec::inputs_for(g, None, 0)?;
    let run = shardc::codegen::RunOptions { backend: Backend::Cpu, ..Default::default() };
    let ran = shardc::codegen::run(&planned.program, &inputs, &run).map_err(|e| e.to_string())?;
    let (checks, _) = session::check(g, &ran.outputs, &inputs, None, (1e-4, 1e-5))?;
    for c in &checks {
        println!("{}: max abs error {:.1e}, {}", c.output, c.max_abs_error, if c.ok { "ok" } else { "FAILED" });
    }

    // Training: the training graph planned data-parallel on two devices, three SGD steps.
    let sgd = OptimizerSpec::Sgd { lr: 0.1, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    let loss = LossSpec::parse("softmax-cross-entropy")?;
    let c = train::TrainChoice { devices: Some(2), strategy: Some("data"), micro_batches: 1, plan: None };
    let t = train::compile(&model, &c, None, (&loss, &sgd), (&cluster, &opts))?;
    let inputs = shardc::train::seeded_inputs(&t.tm.graph, &t.info, 0)?;
    let trained = shardc::train::run_steps(&t.program, &t.info, &inputs, Backend::Cpu, 3)?;
    println!("losses {:?}", trained.losses);
    if checks.iter().all(|c| c.ok) && trained.losses.last() < trained.losses.first() {
        Ok(())
    } else {
        Err("failed".into())
    }
}

#[test]
fn the_driver_plans_runs_and_trains_the_bundled_model() {
    main().unwrap();
}
