//! Priced vs lowered bytes of training: a forward model's plan (a named strategy, or `auto`
//! for the searched one) on `local-wgpu`, the bytes per device it prices per phase (forward,
//! backward, gradient synchronisation), and the bytes per device the training program that
//! `exec::training_result` derives from it moves (and the named strategy applied to the whole
//! training graph, for comparison). `DUMP=1` lists device 0's collectives.
//!
//! ```sh
//! cargo run --release --example train_bytes MODEL DEVICES data|megatron|auto [LOSS]
//! ```
use shardc::passes;
use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::passes::cost::{Cluster, CostModel, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::Path::new(&args[1]);
    let devices: usize = args[2].parse().unwrap();
    let strategy = &args[3];
    let mut m = shardc::load_model(path).unwrap().model;
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default());
    pm.run(&mut m).unwrap();
    let opt = OptimizerSpec::Sgd { lr: 0.1, momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    let loss = if args.len() > 4 { LossSpec::parse(&args[4]).unwrap() } else { LossSpec::Model };
    let (tm, _) = shardc::train::training_model(&m, &loss, &opt).unwrap();
    let c = Cluster::preset("local-wgpu").unwrap();
    let o = Options::default();
    let fwd = if strategy == "auto" {
        let so =
            passes::autoshard::SearchOptions { pipeline: passes::autoshard::PipelineMode::Off, ..Default::default() };
        passes::autoshard::search(&m.graph, &c, devices, &o, &so).unwrap()
    } else {
        shardc::exec::named_result(&m.graph, &c, devices, strategy, &o).unwrap()
    };
    let cm = CostModel::new(&m.graph, &c, fwd.mesh.clone(), o.clone());
    let priced = cm.evaluate(&fwd.assignment).bytes_moved_per_device;
    let (tr, _) = shardc::exec::training_result(&tm.graph, &m.graph, &fwd.assignment, &fwd.mesh, &c, &o).unwrap();
    let prog = shardc::exec::program_for_search(&tm.graph, &tr, devices).unwrap();
    let named = shardc::exec::named_result(&tm.graph, &c, devices, strategy, &o)
        .ok()
        .and_then(|r| shardc::exec::program_for_search(&tm.graph, &r, devices).ok());
    println!("forward plan priced   {priced:?}");
    println!("training step priced  {:?}", tr.breakdown.bytes_moved_per_device);
    println!("training step lowered {:?}", prog.bytes_moved_per_device());
    if let Some(n) = named {
        println!("named   {:?}", n.bytes_moved_per_device());
    }
    println!("fallbacks {:?}", prog.fallbacks);
    if std::env::var("DUMP").is_ok() {
        dump(&prog.devices[0].graph);
    }
}

fn dump(g: &shardc::ir::Graph) {
    for n in g.op_nodes().unwrap() {
        let node = g.node(n);
        if node.op.class() == shardc::ir::OpClass::Comm {
            let ins: Vec<String> = node.inputs().iter().flatten().map(|v| g.value_name(*v).to_string()).collect();
            println!(
                "  {} {:?} <- {:?}",
                node.op.op_type(),
                g.tensor_type(shardc::ir::Value::new(n, 0)).map(|t| t.to_string()),
                ins
            );
        }
    }
}
