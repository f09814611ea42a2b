//! Priced vs lowered communication: for every shared model, plans it (intra-operator search,
//! batch 8) on 8 devices of `dgx-a100` and 64 of `a100-cluster-8`, lowers the plan to
//! per-device programs, and compares the forward bytes each device moves per collective kind
//! as the plan prices them (`bytes_moved_per_device`) with what the program's communication
//! ops move (`Program::bytes_moved_per_device`).
//!
//! ```sh
//! cargo run --release --example plan_vs_program [MODEL_DIR]
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use shardc::passes::autoshard::{self, PipelineMode, SearchOptions};
use shardc::passes::cost::{Cluster, Options};

fn main() {
    let dir = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("tests/data/models"));
    let mut models: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnxtxt"))
        .collect();
    models.sort();
    println!("{:<26} {:<16} {:>14} {:>14} {:>8}", "model", "cluster", "priced (MB)", "lowered (MB)", "ratio");
    for path in models {
        for (cluster_name, devices) in [("dgx-a100", 8), ("a100-cluster-8", 64)] {
            let name = path.file_stem().unwrap().to_string_lossy().to_string();
            let mut m = shardc::load_model(&path).unwrap().model;
            let mut pm = shardc::passes::PassManager::new();
            pm.add(shardc::passes::Verify)
                .add(shardc::passes::Rebatch {
                    spec: shardc::passes::RebatchSpec { batch: Some(8), ..Default::default() },
                })
                .add(shardc::passes::InferShapes::default())
                .add(shardc::passes::Canonicalize);
            if let Err(e) = pm.run(&mut m) {
                println!(
                    "{name:<26} {cluster_name:<16} cannot prepare: {}",
                    e.errors.first().map(|x| x.msg.clone()).unwrap_or_default()
                );
                continue;
            }
            let cluster = Cluster::preset(cluster_name).unwrap();
            let so = SearchOptions { pipeline: PipelineMode::Off, ..Default::default() };
            let r = match autoshard::search(&m.graph, &cluster, devices, &Options::default(), &so) {
                Ok(r) => r,
                Err(e) => {
                    println!("{name:<26} {cluster_name:<16} no plan: {e}");
                    continue;
                }
            };
            let plan = autoshard::Plan::new(&m.graph, &cluster, devices, &Options::default(), Default::default(), &r);
            let priced: BTreeMap<String, f64> = plan.bytes_moved_per_device.get("forward").cloned().unwrap_or_default();
            let prog = match shardc::exec::program_for_search(&m.graph, &r, devices) {
                Ok(p) => p,
                Err(e) => {
                    println!("{name:<26} {cluster_name:<16} cannot lower: {e}");
                    continue;
                }
            };
            let lowered: BTreeMap<String, f64> =
                prog.bytes_moved_per_device().get("forward").cloned().unwrap_or_default();
            let (a, b): (f64, f64) = (priced.values().sum(), lowered.values().sum());
            let mesh: Vec<String> = plan.mesh.iter().map(|x| x.size.to_string()).collect();
            println!(
                "{name:<26} {:<16} {:>14.3} {:>14.3} {:>8}   mesh {}  priced {:?}  lowered {:?}",
                cluster_name,
                a / 1e6,
                b / 1e6,
                if a > 0.0 {
                    format!("{:.2}", b / a)
                } else if b > 0.0 {
                    "inf".into()
                } else {
                    "-".into()
                },
                mesh.join("×"),
                priced.iter().map(|(k, v)| format!("{k}:{:.2}", v / 1e6)).collect::<Vec<_>>(),
                lowered.iter().map(|(k, v)| format!("{k}:{:.2}", v / 1e6)).collect::<Vec<_>>()
            );
        }
    }
}
