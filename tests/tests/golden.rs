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
