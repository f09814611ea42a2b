//! Snapshots of what the GPU compiler makes of every golden model: per node, its launches
//! (source hash, parameters, workgroups, bindings) or `host`. A change in the generated
//! kernels shows up as a diff here; after an intended change, re-bless with
//! `BLESS=1 cargo test -p shardc-tests --test kernels`.

use std::collections::HashMap;
use std::fmt::Write;

use codegen::runtime::gpu::compile::{self, Step};
use ir::eval::Array;
use ir::{Graph, Value};
use shardc_tests::*;

/// FNV-1a of a kernel source, to name it compactly.
fn hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// What the GPU compiler makes of node `n`.
fn compiled(g: &Graph, n: ir::NodeId, consts: &HashMap<Value, Array>) -> Result<Option<compile::Compiled>, String> {
    compile::compile(&g.node(n).op, &compile_cx(g, n, consts))
}

fn snapshot(g: &Graph, consts: &HashMap<Value, Array>) -> String {
    let mut out = String::new();
    for n in g.op_nodes().unwrap() {
        let _ = write!(out, "{}:", g.describe(n));
        match compiled(g, n, consts) {
            Ok(None) => out.push_str(" host\n"),
            Err(e) => {
                let _ = writeln!(out, " error: {e}");
            }
            Ok(Some(c)) => {
                out.push('\n');
                for t in &c.temps {
                    let _ = writeln!(out, "  temp {:?} {}", t.0, t.1);
                }
                for o in &c.outputs {
                    let _ = writeln!(
                        out,
                        "  out {:?} {}{}",
                        o.shape,
                        o.dtype,
                        o.view_of.map_or(String::new(), |k| format!(" = view of input {k}"))
                    );
                }
                for s in &c.steps {
                    let _ = match s {
                        Step::Launch(l) => writeln!(
                            out,
                            "  launch {:016x} groups {:?} bufs {:?} params {:?}{}",
                            hash(&l.src),
                            l.groups,
                            l.bufs,
                            &l.params[..l.params.len().min(12)],
                            match l.trips {
                                0 => String::new(),
                                compile::UNKNOWN_TRIPS => " trips unknown".to_string(),
                                t => format!(" trips {t}"),
                            }
                        ),
                        Step::Zero(b) => writeln!(out, "  zero {b:?}"),
                        Step::Copy { src, offset, dst, n } => writeln!(out, "  copy {src:?}+{offset} → {dst:?} ×{n}"),
                    };
                }
            }
        }
    }
    out
}

#[test]
fn compiled_kernels_of_the_golden_models_match_their_snapshots() {
    let dir = repo_root().join("tests/snapshots/kernels");
    let bless = std::env::var_os("BLESS").is_some();
    let mut diffs = Vec::new();
    for path in data_files("golden") {
        let mut m = load_model(&path);
        let consts = ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap().consts;
        let got = snapshot(&m.graph, &consts);
        let file = dir.join(path.file_stem().unwrap()).with_extension("txt");
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&file, &got).unwrap();
            continue;
        }
        match std::fs::read_to_string(&file) {
            Ok(want) if want == got => {}
            Ok(_) => diffs.push(format!("{} differs (BLESS=1 to re-bless)", file.display())),
            // A golden case from ../shared without a committed snapshot is not compared.
            Err(_) if !path.starts_with(repo_root().join("tests/data")) => {}
            Err(e) => diffs.push(format!("{}: {e} (BLESS=1 to write it)", file.display())),
        }
    }
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}

/// Every kernel with loops bounds them (so an adapter that cuts long loops short, as lavapipe
/// does, runs the op on the host instead of returning wrong values): over the golden models
/// and the training graphs of the golden training cases (every gradient and optimizer kernel).
#[test]
fn every_launched_kernel_bounds_its_loops() {
    use passes::autodiff::LossSpec;
    use shardc::train::{TrainCase, training_model};
    let mut graphs: Vec<(String, ir::Model)> =
        data_files("golden").iter().map(|p| (p.display().to_string(), load_model(p))).collect();
    for path in golden_train_cases() {
        let case = TrainCase::load(&path.with_extension("train.json")).unwrap();
        let m = load_model(&path);
        for kind in ["sgd", "adam"] {
            let opt = case.optimizer(kind).unwrap_or_else(|| panic!("{}: no {kind}", path.display()));
            let (t, _) = training_model(&m, &LossSpec::Model, opt).unwrap();
            graphs.push((format!("{} ({kind} training graph)", path.display()), t));
        }
    }
    let (mut launches, mut unknown) = (0, Vec::new());
    for (name, mut m) in graphs {
        let consts = ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap().consts;
        for n in m.graph.op_nodes().unwrap() {
            if let Ok(Some(c)) = compiled(&m.graph, n, &consts) {
                for l in c.launches() {
                    launches += 1;
                    if l.trips == compile::UNKNOWN_TRIPS {
                        unknown.push(format!("{name}: {}", m.graph.describe(n)));
                    }
                }
            }
        }
    }
    assert!(launches > 500, "only {launches} launches compiled");
    assert!(unknown.is_empty(), "kernels with loops of unknown length:\n{}", unknown.join("\n"));
}
