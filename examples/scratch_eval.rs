use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = &args[1];
    let cluster = &args[2];
    let devices: usize = args[3].parse().unwrap();
    let batch: Option<i64> = args.get(4).and_then(|b| b.parse().ok());
    let text = if let Some(spec) = path.strip_prefix("gpt:") {
        let v: Vec<usize> = spec.split(':').map(|x| x.parse().unwrap()).collect();
        shardc::synthetic::Gpt { layers: v[0], hidden: v[1], heads: v[2], batch: v[3], seq: v[4] }.to_text()
    } else if let Some(n) = path.strip_prefix("chain:") {
        shardc::synthetic::chain(n.parse().unwrap())
    } else {
        std::fs::read_to_string(path).unwrap()
    };
    let parsed = shardc::frontend::parse(&text).unwrap();
    let mut m = parsed.model;
    let mut pm = shardc::passes::PassManager::new();
    if batch.is_some() {
        pm.add(shardc::passes::Rebatch { spec: shardc::passes::RebatchSpec { batch, input_shapes: vec![] } });
    }
    pm.add(shardc::passes::InferShapes::default());
    pm.add(shardc::passes::Canonicalize);
    pm.run(&mut m).unwrap();
    let c = shardc::passes::cost::Cluster::load(cluster).unwrap();
    let caps: Vec<usize> =
        std::env::var("CAPS").map(|s| s.split(',').map(|x| x.parse().unwrap()).collect()).unwrap_or(vec![32]);
    let beams: Vec<usize> =
        std::env::var("BEAMS").map(|s| s.split(',').map(|x| x.parse().unwrap()).collect()).unwrap_or(vec![1024]);
    for &cap in &caps {
        for &beam in &beams {
            let so = shardc::passes::autoshard::SearchOptions { per_op_strategies: cap, beam, ..Default::default() };
            let t = Instant::now();
            let r = shardc::passes::autoshard::search(&m.graph, &c, devices, &Default::default(), &so).unwrap();
            let dp = r.data_parallel.as_ref().map(|d| d.step_time_s).unwrap_or(f64::NAN);
            println!(
                "cap {cap:>3} beam {beam:>5}: {:.6} s (dp {:.6}) feasible {} in {:.2} s",
                r.breakdown.step_time_s,
                dp,
                r.breakdown.feasible,
                t.elapsed().as_secs_f64()
            );
            if std::env::var("SHOW").is_ok() {
                let cm = shardc::passes::cost::CostModel::new(&m.graph, &c, r.mesh.clone(), Default::default());
                for &n in cm.order() {
                    let st = cm.strategy_of(&r.assignment, n);
                    if matches!(m.graph.node(n).op, shardc::ir::Op::MatMul(_)) {
                        println!("   {} {}", m.graph.describe(n), cm.describe_strategy(n, &st));
                    }
                }
                println!("   memory {:.2} GiB", r.breakdown.memory.total() / 1073741824.0);
            }
            for m in &r.meshes {
                println!(
                    "   {:<40} {:.6} eg {:.2}s {} nodes | ex {:.2}s dp {:.2}s ({} runs, {} states) ls {:.2}s evals {} moves {}",
                    m.mesh,
                    m.step_time_s,
                    m.egraph.time_s,
                    m.egraph.nodes,
                    m.extraction.time_s,
                    m.extraction.dp_time_s,
                    m.extraction.dp_runs,
                    m.extraction.dp_max_states,
                    m.extraction.local_search_time_s,
                    m.extraction.evaluations,
                    m.extraction.local_moves
                );
            }
        }
    }
}
