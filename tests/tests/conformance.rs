//! The ONNX backend node-test suite (the suite every ONNX runtime is measured on), run the way a
//! user runs a model: each case's binary `model.onnx` is read, its shapes inferred with the
//! inputs' values known (shape parameters given as graph inputs), lowered to one device and run
//! on the CPU executor and on wgpu; every output is compared with the suite's expected `.pb`
//! tensors at the case's tolerances (`|got − want| ≤ atol + rtol·|want|`, NaN equals NaN,
//! exact for integers, booleans and strings).
//!
//! The suite's data is generated, not committed: `scripts/gen-onnx-node-tests.py DIR` (needs the
//! `onnx` Python package; `.ci/run` installs it in a virtual environment) writes it, and this
//! test reads `$SHARDC_ONNX_NODE_TESTS` or `target/onnx-node-tests`. Without the data the test
//! says so and passes, unless `SHARDC_REQUIRE_CONFORMANCE` is set (as `.ci/run` does).
//!
//! Every case runs as two trials, `cpu::NAME` and `wgpu::NAME`. A trial is *unsupported* (shown
//! as ignored, outside the denominator) when its inputs or outputs are not tensors shardc
//! holds (sequences, maps, optionals; complex, 8-bit float and packed 4-bit types).
//! `tests/conformance/expected-failures.txt` lists the trials that fail, each with its reason;
//! a listed trial that passes fails the test (take it off the list: the list only shrinks), and
//! so does an unlisted failure. `SHARDC_CONFORMANCE_LIMIT=N` runs every N-th case only (for a
//! quick look), `SHARDC_CONFORMANCE_REPORT=FILE` writes every outcome to FILE.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use codegen::{Backend, Placement, RunOptions};
use ir::eval::{Array, Data};
use libtest_mimic::{Arguments, Failed, Trial};
use shardc_tests::repo_root;

/// One data set: inputs by graph input name, expected outputs in graph output order.
struct DataSet {
    inputs: HashMap<String, Array>,
    outputs: Vec<(String, Array)>,
}

struct Case {
    name: String,
    dir: PathBuf,
    rtol: f64,
    atol: f64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Pass,
    Fail(String),
    Unsupported(String),
}

fn suite_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("SHARDC_ONNX_NODE_TESTS") {
        Some(d) => PathBuf::from(d),
        None => repo_root().join("target/onnx-node-tests"),
    };
    dir.is_dir().then_some(dir)
}

fn cases(dir: &Path) -> Vec<Case> {
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    entries.sort();
    for d in entries {
        let meta: serde_json::Value = std::fs::read_to_string(d.join("meta.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null);
        out.push(Case {
            name: d.file_name().expect("named").to_string_lossy().into_owned(),
            rtol: meta["rtol"].as_f64().unwrap_or(1e-3),
            atol: meta["atol"].as_f64().unwrap_or(1e-7),
            dir: d,
        });
    }
    out
}

fn read_pb(path: &Path) -> Result<Array, Outcome> {
    let bytes = std::fs::read(path).map_err(|e| Outcome::Fail(format!("{}: {e}", path.display())))?;
    let t = frontend::onnx::read_tensor(&bytes)
        .map_err(|e| Outcome::Unsupported(format!("{}: {e}", path.file_name().unwrap().to_string_lossy())))?;
    Array::from_tensor(&t).map_err(|e| Outcome::Unsupported(format!("{} tensors: {e}", t.dtype)))
}

fn data_sets(case: &Case, g: &ir::Graph) -> Result<Vec<DataSet>, Outcome> {
    let meta: serde_json::Value = std::fs::read_to_string(case.dir.join("meta.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null);
    if let Some(nt) = meta["non_tensor"].as_array().filter(|a| !a.is_empty()) {
        let what: Vec<&str> = nt.iter().filter_map(|v| v.as_str()).collect();
        return Err(Outcome::Unsupported(format!("not tensors: {}", what.join(", "))));
    }
    let mut sets = Vec::new();
    let mut k = 0;
    while case.dir.join(format!("test_data_set_{k}")).is_dir() {
        let d = case.dir.join(format!("test_data_set_{k}"));
        // Inputs are numbered over the graph inputs that are not initializers.
        let names: Vec<String> = g.input_values().iter().map(|v| g.value_name(*v).to_string()).collect();
        let mut inputs = HashMap::new();
        for (j, name) in names.iter().enumerate() {
            let p = d.join(format!("input_{j}.pb"));
            if p.is_file() {
                inputs.insert(name.clone(), read_pb(&p)?);
            }
        }
        let mut outputs = Vec::new();
        for (j, o) in g.outputs().iter().enumerate() {
            let p = d.join(format!("output_{j}.pb"));
            outputs.push((g.value_name(o.value).to_string(), read_pb(&p)?));
        }
        sets.push(DataSet { inputs, outputs });
        k += 1;
    }
    if sets.is_empty() {
        return Err(Outcome::Fail("no test_data_set_0".into()));
    }
    Ok(sets)
}

/// `got` equals `want` within the tolerances.
fn same(name: &str, got: &Array, want: &Array, rtol: f64, atol: f64) -> Result<(), String> {
    if got.shape != want.shape {
        return Err(format!("{name}: shape {:?}, expected {:?}", got.shape, want.shape));
    }
    if got.dtype != want.dtype {
        return Err(format!("{name}: element type {}, expected {}", got.dtype, want.dtype));
    }
    match (&got.data, &want.data) {
        (Data::Str(a), Data::Str(b)) => match a.iter().zip(b).position(|(x, y)| x != y) {
            Some(i) => Err(format!("{name}[{i}]: {:?}, expected {:?}", a[i], b[i])),
            None => Ok(()),
        },
        _ if want.dtype.is_float() => {
            let (a, b) = (got.to_f64().map_err(|e| e.to_string())?, want.to_f64().map_err(|e| e.to_string())?);
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let ok = if y.is_nan() || x.is_nan() {
                    x.is_nan() && y.is_nan()
                } else if y.is_infinite() || x.is_infinite() {
                    x == y
                } else {
                    (x - y).abs() <= atol + rtol * y.abs()
                };
                if !ok {
                    return Err(format!("{name}[{i}]: {x}, expected {y} (rtol {rtol}, atol {atol})"));
                }
            }
            Ok(())
        }
        _ => {
            let (a, b) = (got.to_i64().map_err(|e| e.to_string())?, want.to_i64().map_err(|e| e.to_string())?);
            match a.iter().zip(&b).position(|(x, y)| x != y) {
                Some(i) => Err(format!("{name}[{i}]: {}, expected {}", a[i], b[i])),
                None => Ok(()),
            }
        }
    }
}

fn run_case(case: &Case, backend: Backend) -> Outcome {
    let bytes = match std::fs::read(case.dir.join("model.onnx")) {
        Ok(b) => b,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    let model = match frontend::parse_binary(&bytes) {
        Ok((p, _)) => p.model,
        Err((d, _)) => return Outcome::Fail(d.iter().map(|d| d.message.clone()).collect::<Vec<_>>().join("; ")),
    };
    let sets = match data_sets(case, &model.graph) {
        Ok(s) => s,
        Err(o) => return o,
    };
    for (k, set) in sets.iter().enumerate() {
        match run_set(&model, set, backend, case) {
            Ok(()) => {}
            Err(e) => return Outcome::Fail(if sets.len() > 1 { format!("data set {k}: {e}") } else { e }),
        }
    }
    Outcome::Pass
}

fn run_set(model: &ir::Model, set: &DataSet, backend: Backend, case: &Case) -> Result<(), String> {
    let mut m = model.clone();
    shardc::exec::prepare_with_values(&mut m, &set.inputs)?;
    let prog = codegen::lower(&m.graph, &Placement::single()).map_err(|e| format!("lower: {e}"))?;
    let r = codegen::run(&prog, &set.inputs, &RunOptions { backend, ..Default::default() })
        .map_err(|e| format!("run: {e}"))?;
    if r.outputs.len() != set.outputs.len() {
        return Err(format!("{} outputs, expected {}", r.outputs.len(), set.outputs.len()));
    }
    for ((name, got), (_, want)) in r.outputs.iter().zip(&set.outputs) {
        same(name, got, want, case.rtol, case.atol)?;
    }
    Ok(())
}

/// `trial name → reason` from the expected-failures list.
fn expected_failures() -> BTreeMap<String, String> {
    let path = repo_root().join("tests/conformance/expected-failures.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (names, reason) = line.split_once('#').unwrap_or((line, ""));
        let reason = reason.trim();
        assert!(!reason.is_empty(), "{}:{}: an expected failure needs a reason (`NAME  # why`)", path.display(), i + 1);
        let mut words = names.split_whitespace();
        let name = words.next().expect("a name");
        let backends: Vec<&str> = match words.next() {
            Some(b) => b.split(',').collect(),
            None => vec!["cpu", "wgpu"],
        };
        for b in backends {
            assert!(matches!(b, "cpu" | "wgpu"), "{}:{}: backend `{b}` is not cpu or wgpu", path.display(), i + 1);
            out.insert(format!("{b}::{name}"), reason.to_string());
        }
    }
    out
}

fn main() {
    let args = Arguments::from_args();
    let Some(dir) = suite_dir() else {
        if std::env::var_os("SHARDC_REQUIRE_CONFORMANCE").is_some() {
            panic!(
                "SHARDC_REQUIRE_CONFORMANCE is set but the node tests are not generated: run \
                 scripts/gen-onnx-node-tests.py target/onnx-node-tests"
            );
        }
        eprintln!(
            "skipping the ONNX conformance suite: no data (run scripts/gen-onnx-node-tests.py target/onnx-node-tests, \
             or set SHARDC_ONNX_NODE_TESTS)"
        );
        return;
    };
    let every: usize = std::env::var("SHARDC_CONFORMANCE_LIMIT").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
    let expected = expected_failures();
    let all = cases(&dir);
    let results: &'static Mutex<BTreeMap<String, Outcome>> = Box::leak(Box::new(Mutex::new(BTreeMap::new())));
    let mut trials = Vec::new();
    let mut known = Vec::new();
    for case in all.into_iter().step_by(every) {
        let case = std::sync::Arc::new(case);
        for (label, backend) in [("cpu", Backend::Cpu), ("wgpu", Backend::Wgpu)] {
            let name = format!("{label}::{}", case.name);
            known.push(name.clone());
            let expect = expected.get(&name).cloned();
            let case = case.clone();
            trials.push(Trial::test(name.clone(), move || {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_case(&case, backend)))
                    .unwrap_or_else(|p| {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        Outcome::Fail(format!("PANIC: {msg}"))
                    });
                results.lock().expect("results").insert(name.clone(), outcome.clone());
                match (outcome, expect) {
                    (Outcome::Pass, None) | (Outcome::Unsupported(_), None) => Ok(()),
                    (Outcome::Fail(e), Some(_)) if !e.starts_with("PANIC") => Ok(()),
                    (Outcome::Fail(e), _) => Err(Failed::from(e)),
                    (Outcome::Pass, Some(why)) => Err(Failed::from(format!(
                        "passes now: take `{name}` off tests/conformance/expected-failures.txt (listed: {why})"
                    ))),
                    (Outcome::Unsupported(u), Some(_)) => Err(Failed::from(format!(
                        "unsupported ({u}), so not a failure: take it off tests/conformance/expected-failures.txt"
                    ))),
                }
            }));
        }
    }
    let conclusion = libtest_mimic::run(&args, trials);
    let results = results.lock().expect("results");
    summarize(&results);
    if every == 1 && args.filter.is_none() && args.skip.is_empty() {
        let stale: Vec<&String> = expected.keys().filter(|k| !known.contains(k)).collect();
        assert!(stale.is_empty(), "expected failures of cases the suite does not have: {stale:?}");
    }
    conclusion.exit();
}

fn summarize(results: &BTreeMap<String, Outcome>) {
    for backend in ["cpu", "wgpu"] {
        let (mut pass, mut fail, mut unsupported) = (0, 0, 0);
        for (k, o) in results {
            if !k.starts_with(&format!("{backend}::")) {
                continue;
            }
            match o {
                Outcome::Pass => pass += 1,
                Outcome::Fail(_) => fail += 1,
                Outcome::Unsupported(_) => unsupported += 1,
            }
        }
        if pass + fail + unsupported == 0 {
            continue;
        }
        eprintln!(
            "conformance {backend}: {pass} of {} supported node tests pass ({:.1}%), {fail} fail; {unsupported} unsupported",
            pass + fail,
            100.0 * pass as f64 / (pass + fail).max(1) as f64
        );
    }
    if let Ok(path) = std::env::var("SHARDC_CONFORMANCE_REPORT") {
        let mut text = String::new();
        for (k, o) in results {
            let line = match o {
                Outcome::Pass => format!("{k}\tpass\n"),
                Outcome::Fail(e) => format!("{k}\tfail\t{}\n", e.replace(['\n', '\t'], " ")),
                Outcome::Unsupported(u) => format!("{k}\tunsupported\t{}\n", u.replace(['\n', '\t'], " ")),
            };
            text.push_str(&line);
        }
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}
