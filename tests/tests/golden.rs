//! The reference interpreter reproduces onnxruntime's outputs for every golden case.

use shardc_tests::*;

#[test]
fn reference_interpreter_matches_onnxruntime() {
    let mut failures = Vec::new();
    let files = data_files("golden");
    for path in &files {
        let model = load_model(path);
        let io = load_io(path);
        let opts = ir::eval::RunOptions::default();
        match ir::eval::run(&model.graph, &io.inputs, &opts) {
            Ok(outs) => {
                for (name, expected) in &io.outputs {
                    let Some(k) = model.graph.outputs().iter().position(|o| model.graph.value_name(o.value) == name)
                    else {
                        failures.push(format!("{}: no graph output `{name}`", path.display()));
                        continue;
                    };
                    if let Err(e) = compare(name, &outs[k], expected, io.rtol, io.atol) {
                        failures.push(format!("{}: {e}", path.display()));
                    }
                }
            }
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
    }
    assert!(failures.is_empty(), "{} of {} golden cases fail:\n{}", failures.len(), files.len(), failures.join("\n"));
}

/// GRU in every direction, with and without linear_before_reset and an initial state,
/// against onnxruntime (tests/data/gru, scripts/gen-gru-cases.py), on the reference and, with
/// an adapter, on wgpu.
#[test]
fn gru_matches_onnxruntime_in_every_configuration() {
    let dir = repo_root().join("tests/data/gru");
    let mut cases: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
        .collect();
    cases.sort();
    assert_eq!(cases.len(), 12);
    let gpu = codegen::runtime::gpu::open().is_ok();
    for path in cases {
        let mut m = load_model(&path);
        let io = load_io(&path);
        let reference = ir::eval::run(&m.graph, &io.inputs, &Default::default()).unwrap();
        for ((name, want), got) in io.outputs.iter().zip(&reference) {
            compare(name, got, want, io.rtol, io.atol).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        if gpu {
            shardc::exec::prepare_with_values(&mut m, &io.inputs).unwrap();
            let prog = codegen::lower(&m.graph, &codegen::Placement::single()).unwrap();
            let opts = codegen::RunOptions { backend: codegen::Backend::Wgpu, ..Default::default() };
            let r = codegen::run(&prog, &io.inputs, &opts).unwrap();
            for ((name, got), (_, want)) in r.outputs.iter().zip(&io.outputs) {
                compare(name, got, want, io.rtol, io.atol)
                    .unwrap_or_else(|e| panic!("{} on wgpu: {e}", path.display()));
            }
        }
    }
}
