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

/// The `.onnx` cases in `dir` (each beside its `.io.json`), sorted.
fn onnx_cases(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut cases: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnx"))
        .collect();
    cases.sort();
    cases
}

/// Case `path` against its `.io.json` on the reference and, when `gpu`, on wgpu: what differs.
fn case_failures(path: &std::path::Path, gpu: bool) -> Vec<String> {
    let name = path.file_stem().unwrap().to_string_lossy().to_string();
    let mut m = load_model(path);
    let io = load_io(path);
    let mut failures = Vec::new();
    match ir::eval::run(&m.graph, &io.inputs, &Default::default()) {
        Ok(reference) => {
            for ((out, want), got) in io.outputs.iter().zip(&reference) {
                if let Err(e) = compare(out, got, want, io.rtol, io.atol) {
                    failures.push(format!("{name} (cpu): {e}"));
                }
            }
        }
        Err(e) => failures.push(format!("{name} (cpu): {e}")),
    }
    if gpu {
        shardc::exec::prepare_with_values(&mut m, &io.inputs).unwrap();
        let prog = codegen::lower(&m.graph, &codegen::Placement::single()).unwrap();
        let opts = codegen::RunOptions { backend: codegen::Backend::Wgpu, ..Default::default() };
        match codegen::run(&prog, &io.inputs, &opts) {
            Ok(r) => {
                for ((out, got), (_, want)) in r.outputs.iter().zip(&io.outputs) {
                    if let Err(e) = compare(out, got, want, io.rtol, io.atol) {
                        failures.push(format!("{name} (wgpu): {e}"));
                    }
                }
            }
            Err(e) => failures.push(format!("{name} (wgpu): {e}")),
        }
    }
    failures
}

/// The cases `script` (under scripts/, with onnxruntime as truth) draws into a fresh
/// directory with `args` after it; `None` where no Python with onnxruntime is found (and
/// SHARDC_REQUIRE_PYTHON_TRUTH is unset).
fn drawn_cases(script: &str, tag: &str, args: &[&str]) -> Option<(std::path::PathBuf, Vec<std::path::PathBuf>)> {
    let Some(python) = python_with(&["onnx", "onnxruntime", "numpy"]) else {
        eprintln!("skipped: no Python with onnx and onnxruntime");
        return None;
    };
    let dir = std::env::temp_dir().join(format!("shardc-{tag}-{}", std::process::id()));
    let o = std::process::Command::new(&python)
        .arg(repo_root().join("scripts").join(script))
        .arg(&dir)
        .args(args)
        .output()
        .expect("python runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cases = onnx_cases(&dir);
    Some((dir, cases))
}

/// GRU in every direction, with and without linear_before_reset and an initial state,
/// against onnxruntime (tests/data/gru, scripts/gen-gru-cases.py), on the reference and, with
/// an adapter, on wgpu.
#[test]
fn gru_matches_onnxruntime_in_every_configuration() {
    let cases = onnx_cases(&repo_root().join("tests/data/gru"));
    assert_eq!(cases.len(), 12);
    let gpu = codegen::runtime::gpu::open().is_ok();
    let failures: Vec<String> = cases.iter().flat_map(|p| case_failures(p, gpu)).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// GRU on random configurations — direction, linear_before_reset, bias, initial_h,
/// sequence_lens, layout and sizes — against onnxruntime (onnx's reference for layout 1), drawn
/// at test time by scripts/gru-property.py, on the reference and, with an adapter, on wgpu.
#[test]
fn gru_matches_onnxruntime_on_random_configurations() {
    let seed = std::env::var("SHARDC_GRU_SEED").unwrap_or_else(|_| "20261128".into());
    let Some((dir, cases)) = drawn_cases("gru-property.py", "gru-prop", &["48", &seed]) else { return };
    assert_eq!(cases.len(), 48);
    let gpu = codegen::runtime::gpu::open().is_ok();
    let failures: Vec<String> = cases.iter().flat_map(|p| case_failures(p, gpu)).collect();
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        failures.is_empty(),
        "{} failures over {} cases (seed {seed}):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// NaN and ±Inf as onnxruntime has them, in element-wise ops, folds, reductions and pooling
/// (scripts/nan-cases.py draws inputs holding them at test time), on the reference and, with
/// an adapter, on wgpu: NaN where onnxruntime has NaN, the same infinities.
#[test]
fn nan_and_inf_as_onnxruntime_has_them() {
    let Some((dir, cases)) = drawn_cases("nan-cases.py", "nan", &["7"]) else { return };
    assert!(cases.len() >= 30, "{} cases", cases.len());
    let gpu = codegen::runtime::gpu::open().is_ok();
    let failures: Vec<String> = cases.iter().flat_map(|p| case_failures(p, gpu)).collect();
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{} failures over {} cases:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
