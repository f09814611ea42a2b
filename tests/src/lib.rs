//! Helpers shared by shardc's integration tests: where the test data lives, loading models
//! and golden input/output files, comparing arrays.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ir::DType;
use ir::eval::{Array, Data};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is inside the repository").to_path_buf()
}

/// Directories holding `*.onnxtxt` models of a kind (`models` or `golden`): the copy bundled
/// in `tests/data`, plus `../shared/<kind>` when a checkout has it beside the repository (so
/// new shared files are tested too). Files with the same name are taken once.
pub fn data_files(kind: &str) -> Vec<PathBuf> {
    // Model files (`.onnxtxt`, or binary `.onnx`), by name, the repository's first.
    let mut dirs = vec![repo_root().join("tests/data").join(kind)];
    if let Ok(extra) = std::env::var("SHARDC_SHARED_DIR") {
        dirs.push(PathBuf::from(extra).join(kind));
    }
    dirs.push(repo_root().join("../shared").join(kind));
    let mut seen = std::collections::BTreeMap::new();
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "onnxtxt" || x == "onnx") {
                let name = p.file_name().expect("file").to_string_lossy().to_string();
                seen.entry(name).or_insert(p);
            }
        }
    }
    assert!(!seen.is_empty(), "no {kind} test data found under tests/data/{kind}");
    seen.into_values().collect()
}

/// The seed property tests use unless `SHARDC_PROPTEST_SEED` says otherwise.
pub const PROPTEST_SEED: u64 = 0x5ba2_dc0f_fee1_600d;

/// Configuration for property tests: `cases` cases from a fixed seed, so a test run is the
/// same on every machine and every run, and no failure-persistence files are written into
/// the checkout. `SHARDC_PROPTEST_SEED=random` draws fresh seeds (and prints the failing
/// seed's case on failure); `SHARDC_PROPTEST_SEED=N` replays seed N. A failure found that
/// way becomes a fixed test case or the new default seed, not a regression file.
pub fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    use proptest::test_runner::{Config, RngSeed};
    let rng_seed = match std::env::var("SHARDC_PROPTEST_SEED").as_deref() {
        Ok("random") => RngSeed::Random,
        Ok(n) => RngSeed::Fixed(n.parse().unwrap_or_else(|_| panic!("SHARDC_PROPTEST_SEED={n}: not a number"))),
        Err(_) => RngSeed::Fixed(PROPTEST_SEED),
    };
    Config { cases, rng_seed, failure_persistence: None, ..Config::default() }
}

/// Reads and parses a model file, panicking with rendered diagnostics on failure.
pub fn load_model(path: &Path) -> ir::Model {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if frontend::onnx::is_binary(&bytes) {
        return match frontend::parse_binary(&bytes) {
            Ok((p, _)) => p.model,
            Err((d, _)) => panic!("{}: {d:?}", path.display()),
        };
    }
    let text = String::from_utf8(bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match frontend::parse(&text) {
        Ok(p) => p.model,
        Err(d) => panic!("{}", frontend::render(&d, &path.display().to_string(), &text)),
    }
}

/// One tensor of a golden `.io.json` file.
pub fn array_from_json(v: &serde_json::Value) -> Array {
    let dtype = match v["dtype"].as_str().expect("dtype") {
        "float32" => DType::Float,
        "int64" => DType::Int64,
        "int32" => DType::Int32,
        "bool" => DType::Bool,
        other => panic!("unknown golden dtype {other}"),
    };
    let shape: Vec<usize> =
        v["shape"].as_array().expect("shape").iter().map(|d| d.as_u64().expect("dim") as usize).collect();
    let data = v["data"].as_array().expect("data");
    let data = match dtype {
        DType::Float => Data::F32(data.iter().map(json_float).collect()),
        DType::Bool => Data::Bool(data.iter().map(|x| x.as_bool().expect("bool")).collect()),
        _ => Data::I64(data.iter().map(|x| x.as_i64().expect("int")).collect()),
    };
    Array { dtype, shape, data }
}

/// A float of the golden format: a number, or `"nan"`, `"inf"`, `"-inf"`.
fn json_float(x: &serde_json::Value) -> f32 {
    match x.as_str() {
        Some("nan") => f32::NAN,
        Some("inf") => f32::INFINITY,
        Some("-inf") => f32::NEG_INFINITY,
        _ => x.as_f64().expect("float") as f32,
    }
}

/// Inputs, expected outputs (in graph order) and tolerances of a golden case.
pub struct GoldenIo {
    /// Inputs by name.
    pub inputs: HashMap<String, Array>,
    /// Expected outputs by name, in graph order.
    pub outputs: Vec<(String, Array)>,
    /// Relative tolerance.
    pub rtol: f64,
    /// Absolute tolerance.
    pub atol: f64,
}

/// Reads `NAME.io.json` beside `NAME.onnxtxt`.
pub fn load_io(model_path: &Path) -> GoldenIo {
    let p = model_path.with_extension("io.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let inputs =
        v["inputs"].as_object().expect("inputs").iter().map(|(k, a)| (k.clone(), array_from_json(a))).collect();
    let outputs =
        v["outputs"].as_object().expect("outputs").iter().map(|(k, a)| (k.clone(), array_from_json(a))).collect();
    let rtol = v["tolerance"]["rtol"].as_f64().unwrap_or(1e-4);
    let atol = v["tolerance"]["atol"].as_f64().unwrap_or(1e-5);
    GoldenIo { inputs, outputs, rtol, atol }
}

/// Compares arrays: floats by `|a-e| <= atol + rtol*|e|`, others exactly. On mismatch, says
/// where.
pub fn compare(name: &str, actual: &Array, expected: &Array, rtol: f64, atol: f64) -> Result<(), String> {
    if actual.shape != expected.shape {
        return Err(format!("{name}: shape {:?}, expected {:?}", actual.shape, expected.shape));
    }
    match (&expected.data, expected.dtype) {
        (Data::F32(e), _) => {
            let a = actual.to_f64().map_err(|e| format!("{name}: {e}"))?;
            for (i, (x, y)) in a.iter().zip(e).enumerate() {
                let y = f64::from(*y);
                // The same value (an infinity), or NaN where NaN is expected; any other value
                // against a non-finite one is wrong.
                if *x == y || (x.is_nan() && y.is_nan()) {
                    continue;
                }
                if !x.is_finite() || !y.is_finite() || (x - y).abs() > atol + rtol * y.abs() {
                    return Err(format!("{name}[{i}]: {x}, expected {y}"));
                }
            }
            Ok(())
        }
        _ => {
            let a = actual.to_i64().map_err(|e| format!("{name}: {e}"))?;
            let e = expected.to_i64().map_err(|e| format!("{name}: {e}"))?;
            if a != e {
                let i = a.iter().zip(&e).position(|(x, y)| x != y).unwrap_or(0);
                return Err(format!(
                    "{name}[{i}]: {}, expected {}",
                    a.get(i).copied().unwrap_or_default(),
                    e.get(i).copied().unwrap_or_default()
                ));
            }
            Ok(())
        }
    }
}

pub mod samples;

/// The golden training cases (`*.onnxtxt` beside a `*.train.json`): tests/data/golden-train,
/// tests/data/golden-train-more (`scripts/gen-golden-train.py`: architectures the shared set
/// does not have) and ../shared/golden-train where present, each file name once.
pub fn golden_train_cases() -> Vec<PathBuf> {
    let mut seen = std::collections::BTreeMap::new();
    for d in [
        repo_root().join("tests/data/golden-train"),
        repo_root().join("tests/data/golden-train-more"),
        repo_root().join("../shared/golden-train"),
    ] {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "onnxtxt") {
                seen.entry(p.file_name().unwrap().to_string_lossy().to_string()).or_insert(p);
            }
        }
    }
    assert!(seen.len() >= 8, "golden training cases missing");
    seen.into_values().collect()
}

/// The GPU compile context of node `n` of `g`: its inputs' and outputs' static shapes and
/// types, and the constant values the compiler may read.
pub fn compile_cx<'a>(
    g: &ir::Graph,
    n: ir::NodeId,
    consts: &'a HashMap<ir::Value, Array>,
) -> codegen::runtime::gpu::compile::CompileCx<'a> {
    use codegen::runtime::gpu::compile::{CompileCx, TensorDesc};
    let node = g.node(n);
    let desc = |v: ir::Value| -> Option<TensorDesc<'a>> {
        let t = g.tensor_type(v)?;
        Some(TensorDesc {
            shape: t.static_dims()?.iter().map(|&d| d as usize).collect(),
            dtype: t.dtype,
            value: consts.get(&v),
        })
    };
    CompileCx {
        ins: node.inputs().iter().map(|i| i.and_then(desc)).collect(),
        outs: (0..node.num_outputs())
            .map(|s| {
                let v = ir::Value::new(n, s as u16);
                let t = g.tensor_type(v)?;
                (!node.outputs()[s].name.is_empty())
                    .then(|| (t.static_dims().unwrap().iter().map(|&d| d as usize).collect(), t.dtype))
            })
            .collect(),
        opset: g.opset,
        subgroup: None,
    }
}

/// A program of one stage in which device `k` runs `graphs[k]` (no feeds or results), on a
/// mesh of one intra-node axis over all of them: what the checker tests hand-write.
pub fn one_stage_program(graphs: Vec<ir::Graph>) -> codegen::Program {
    use ir::shard::{LinkLevel, Mesh, MeshAxis};
    let n = graphs.len();
    let devices = graphs
        .into_iter()
        .enumerate()
        .map(|(k, graph)| codegen::DeviceProgram {
            device: k,
            stage: 0,
            rank: k,
            graph,
            feeds: vec![],
            pieces: vec![],
            results: vec![],
            chunk_of: Default::default(),
            phase_of: Default::default(),
            from_later: Default::default(),
        })
        .collect();
    codegen::Program {
        devices,
        meshes: vec![Mesh { axes: vec![MeshAxis { name: "d".into(), size: n, level: LinkLevel::Intra }] }],
        stage_devices: vec![(0..n).collect()],
        micro_batches: 1,
        inputs: vec![],
        outputs: vec![],
        fallbacks: vec![],
        schedule: Default::default(),
        recompute: vec![],
    }
}

/// A Python interpreter that imports `modules` (`$SHARDC_PYTHON`, else `python3`), for tests
/// whose truth comes from onnxruntime or onnx at test time; `None` when there is none, unless
/// `SHARDC_REQUIRE_PYTHON_TRUTH` is set (CI), where its absence fails the test.
pub fn python_with(modules: &[&str]) -> Option<String> {
    let python = std::env::var("SHARDC_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = format!("import {}", modules.join(", "));
    let ok = std::process::Command::new(&python).args(["-c", &probe]).output().is_ok_and(|o| o.status.success());
    if !ok && std::env::var_os("SHARDC_REQUIRE_PYTHON_TRUTH").is_some() {
        panic!("`{python} -c '{probe}'` fails, and SHARDC_REQUIRE_PYTHON_TRUTH is set");
    }
    ok.then_some(python)
}

/// A one-MatMul model, `y = x·w` with `x` float[4,6], whose weight `w` (float[6,3], 72 bytes)
/// is external data at `location` and `offset`: for the tests of absent, odd and unreadable
/// weight files.
pub fn external_weight_model(location: &str, offset: &str) -> String {
    format!(
        r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[4,6] x) => (float[4,3] y) <float[6,3] w = ["location": "{location}", "offset": "{offset}", "length": "72"]> {{
   y = MatMul (x, w)
}}"#
    )
}

/// Random floats for every input of `g`, drawn as `random_tensor` draws a tensor of `role`
/// from `seed` and the input's name.
pub fn float_inputs(g: &ir::Graph, role: &str, seed: u64) -> std::collections::HashMap<String, ir::eval::Array> {
    g.input_values()
        .into_iter()
        .map(|v| {
            let dims = g.tensor_type(v).unwrap().static_dims().unwrap();
            let name = g.value_name(v).to_string();
            (name.clone(), ir::eval::random_tensor(ir::DType::Float, &dims, role, seed, &name).unwrap())
        })
        .collect()
}

/// Token ids for every input of `g` (integers below 500).
pub fn token_inputs(g: &ir::Graph) -> std::collections::HashMap<String, ir::eval::Array> {
    g.input_values()
        .into_iter()
        .map(|v| {
            let t = g.tensor_type(v).unwrap();
            let dims = t.static_dims().unwrap();
            let n = dims.iter().product::<i64>();
            let shape = dims.iter().map(|&d| d as usize).collect();
            (
                g.value_name(v).to_string(),
                ir::eval::Array::int(t.dtype, shape, (0..n).map(|i| (i * 37) % 500).collect()),
            )
        })
        .collect()
}

/// Whether a wgpu adapter opens; without one the GPU tests are skipped (said on stderr),
/// unless `SHARDC_REQUIRE_GPU` is set (as `.ci/run` does), when a missing adapter is a failure.
pub fn gpu_available() -> bool {
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
