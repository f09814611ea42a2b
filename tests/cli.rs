//! The command line: exit codes, outputs, refusal to overwrite the input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn shardc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("shardc runs")
}

fn model(name: &str) -> String {
    format!("tests/data/models/{name}")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn every_malformed_input_exits_1_with_a_located_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/diagnostics");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "onnxtxt" && x != "onnx") {
            continue;
        }
        let rel = format!("tests/diagnostics/{}", p.file_name().unwrap().to_string_lossy());
        let o = shardc(&["parse", &rel]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{rel}: {err}");
        assert!(err.starts_with("error"), "{rel}: {err}");
        assert!(err.contains(&format!("{rel}:")), "{rel}: no location in {err}");
        assert!(!err.contains("panicked"), "{rel}: {err}");
        assert!(o.stdout.is_empty(), "{rel}: printed a model");
        n += 1;
    }
    assert!(n >= 25);
}

#[test]
fn parse_prints_the_model_back_exactly() {
    let path = model("tv_resnet18.onnxtxt");
    let o = shardc(&["parse", &path]);
    assert!(o.status.success(), "{}", stderr(&o));
    let original = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(&path)).unwrap();
    assert_eq!(String::from_utf8(o.stdout).unwrap().trim_end(), original);
}

#[test]
fn output_file_and_refusal_to_overwrite_the_input() {
    let dir = std::env::temp_dir().join(format!("shardc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out.onnxtxt");
    let o = shardc(&["parse", &model("tv_alexnet.onnxtxt"), "--passes", "canonicalize", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let again = shardc(&["parse", out.to_str().unwrap()]);
    assert!(again.status.success(), "{}", stderr(&again));
    // Writing over the model being read is refused, and the file is untouched.
    let copy: PathBuf = dir.join("copy.onnxtxt");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(model("tv_alexnet.onnxtxt")), &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let o = shardc(&["parse", copy.to_str().unwrap(), "--passes", "canonicalize", "-o", copy.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("refusing to write"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&copy).unwrap(), before);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn json_and_dot() {
    let o = shardc(&["parse", &model("tv_squeezenet1_1.onnxtxt"), "--emit", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["graph"]["nodes"].as_array().unwrap().len(), 83);
    let o = shardc(&["parse", &model("tv_squeezenet1_1.onnxtxt"), "--emit", "dot"]);
    assert!(String::from_utf8(o.stdout).unwrap().starts_with("digraph"));
}

#[test]
fn passes_dumps_and_unknown_names() {
    let o = shardc(&[
        "parse",
        &model("hf_bert_base.onnxtxt"),
        "--passes",
        "infer-shapes,canonicalize",
        "--dump-after",
        "canonicalize",
        "--timings",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("# ---- after canonicalize ----"));
    assert!(err.contains("canonicalize") && err.contains(" ms"));
    let o = shardc(&["parse", &model("hf_bert_base.onnxtxt"), "--passes", "fold-everything"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("unknown pass `fold-everything`"));
}

#[test]
fn stats_json_and_rebatching() {
    let o = shardc(&["stats", &model("tv_resnet50.onnxtxt"), "--batch", "256", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["params"], 25_507_944);
    assert_eq!(v["inputs"][0]["type"], "float[256,3,224,224]");
    let f = v["forward_flops"].as_f64().unwrap();
    assert!(f > 256.0 * 8.0e9 && f < 256.0 * 8.5e9, "{f}");
    let o = shardc(&["stats", &model("hf_gpt2_124m.onnxtxt"), "--input-shape", "input_ids=8x1024", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["outputs"][0]["type"], "float[8,1024,50257]");
    let o = shardc(&["stats", &model("hf_gpt2_124m.onnxtxt"), "--input-shape", "nope=1x2"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("there is no graph input `nope`"), "{}", stderr(&o));
}

#[test]
fn cost_json_keys_and_strategy_errors() {
    let o = shardc(&[
        "cost",
        &model("tv_resnet50.onnxtxt"),
        "--cluster",
        "dgx-a100",
        "--strategy",
        "data",
        "--batch",
        "256",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in
        ["step_time_s", "compute_s", "communication_s", "bubble_s", "input_s", "memory_per_device_bytes", "feasible"]
    {
        assert!(v.get(k).is_some(), "missing `{k}`");
    }
    assert_eq!(v["memory_per_device_bytes"].as_array().unwrap().len(), 8);
    assert_eq!(v["feasible"], true);
    assert_eq!(v["summary"]["text"], "data 8, pipeline 1");
    assert!(v["summary"]["samples_per_s"].as_f64().unwrap() > 0.0);
    let o = shardc(&[
        "cost",
        &model("tv_vgg16.onnxtxt"),
        "--cluster",
        "pcie-v100x8",
        "--strategy",
        "pipeline:4:8",
        "--batch",
        "64",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["stages"].as_array().unwrap().len(), 4);
    assert!(v["bubble_s"].as_f64().unwrap() > 0.0);
    assert_eq!(v["summary"]["text"], "pipeline 4 × 8 micro-batches (1f1b); stage 0: data 2");
    let o = shardc(&["cost", &model("hf_gpt2_small4.onnxtxt"), "--cluster", "dgx-a100", "--strategy", "spatial"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("does not apply"), "{}", stderr(&o));
    let o = shardc(&["cost", &model("hf_gpt2_small4.onnxtxt"), "--cluster", "no-such-machine", "--strategy", "data"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("unknown cluster"), "{}", stderr(&o));
}

/// `sweep --strategies` takes configurations set off by `;` beside comma-separated names, each
/// priced as `cost --strategy` prices it.
#[test]
fn sweep_compares_configurations_as_cost_prices_them() {
    let gpt = golden("tiny_gpt.onnxtxt");
    let o = shardc(&[
        "sweep",
        &gpt,
        "--cluster",
        "dgx-a100",
        "--axis",
        "devices",
        "--values",
        "4",
        "--strategies",
        "data,megatron;tp=2,dp=2,sp;tp=2,dp=2,recompute=full",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v["strategies"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    assert_eq!(names, ["data", "megatron", "tp=2,dp=2,sp", "tp=2,dp=2,recompute=full"]);
    let swept = v.to_string();
    for config in ["tp=2,dp=2,sp", "tp=2,dp=2,recompute=full"] {
        let c = shardc(&["cost", &gpt, "--cluster", "dgx-a100", "--devices", "4", "--strategy", config, "--json"]);
        assert!(c.status.success(), "{}", stderr(&c));
        let cv: serde_json::Value = serde_json::from_slice(&c.stdout).unwrap();
        let step = cv["step_time_s"].as_f64().unwrap();
        assert!(swept.contains(&format!("{step}")), "{config}: cost says {step}, the sweep {swept}");
    }
    let bad = shardc(&[
        "sweep",
        &gpt,
        "--cluster",
        "dgx-a100",
        "--axis",
        "devices",
        "--values",
        "4",
        "--strategies",
        "tp=2,dq=2",
    ]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("dq"), "{}", stderr(&bad));
}

#[test]
fn sweep_table_svg_and_cluster_files() {
    let dir = std::env::temp_dir().join(format!("shardc-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("s.svg");
    let o = shardc(&[
        "sweep",
        &model("tv_alexnet.onnxtxt"),
        "--cluster",
        "pcie-v100x8",
        "--batch",
        "256",
        "--axis",
        "linkbw",
        "--values",
        "0.1x,1x,10x",
        "--strategies",
        "data,owt,data",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("best"), "{text}");
    // Bandwidths in their unit, in the table and on the chart.
    assert!(text.contains("11 GB/s") && !text.contains("e10"), "{text}");
    let drawing = std::fs::read_to_string(&svg).unwrap().replace('\n', "");
    assert!(drawing.starts_with("<svg"));
    // The title names the file, not its whole path; the axis speaks GB/s; a strategy drawn
    // on top of another says so; nothing fails to fit, so no legend for it.
    assert!(drawing.contains("tv_alexnet.onnxtxt on pcie-v100x8") && !drawing.contains("tests/data"), "{drawing}");
    assert!(drawing.contains("GB/s") && !drawing.contains("e10"), "{drawing}");
    assert!(drawing.contains("data (same as data)"), "{drawing}");
    assert!(!drawing.contains("does not fit"), "{drawing}");
    // A preset printed as TOML is a valid cluster file.
    let o = shardc(&["cluster", "dgx-a100"]);
    assert!(o.status.success());
    let file = dir.join("c.toml");
    std::fs::write(&file, &o.stdout).unwrap();
    let o = shardc(&[
        "cost",
        &model("tv_alexnet.onnxtxt"),
        "--cluster",
        file.to_str().unwrap(),
        "--strategy",
        "data",
        "--devices",
        "4",
        "--batch",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(&file, "name = \"broken\"\nnodes = 0\n").unwrap();
    let o = shardc(&["cluster", file.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn plan_json_report_annotations_and_dumps() {
    let dir = std::env::temp_dir().join(format!("shardc-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let m = model("tv_resnet18.onnxtxt");
    let o = shardc(&["plan", &m, "--cluster", "dgx-a100", "--batch", "64", "--json", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in ["step_time_s", "data_parallel_step_time_s", "feasible", "memory_per_device_bytes", "timings"] {
        assert!(v.get(k).is_some(), "missing `{k}`");
    }
    assert!(v["timings"]["search_s"].as_f64().unwrap() > 0.0);
    assert_eq!(v["format"], "shardc-plan");
    assert_eq!(v["version"], 2);
    assert_eq!(v["model"]["sha256"].as_str().unwrap().len(), 64);
    assert!(v["step_time_s"].as_f64().unwrap() <= v["data_parallel_step_time_s"].as_f64().unwrap());
    assert!(v["ops"].as_array().unwrap().len() > 40);
    assert!(!v["search"]["meshes"].as_array().unwrap().is_empty());
    // -o wrote the same document.
    assert!(std::fs::read(&out).unwrap() == o.stdout, "-o and stdout differ");
    // The same command gives the same plan, byte for byte outside `timings`.
    let strip = |mut v: serde_json::Value| {
        v["timings"] = serde_json::Value::Null;
        v
    };
    let o2 = shardc(&["plan", &m, "--cluster", "dgx-a100", "--batch", "64", "--json"]);
    assert_eq!(strip(serde_json::from_slice(&o2.stdout).unwrap()), strip(v));

    // --report: a per-layer table with data parallel beside it.
    let o = shardc(&["plan", &m, "--cluster", "dgx-a100", "--batch", "64", "--report"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("data parallel") && text.contains("/conv1/Conv"), "{text}");

    // --emit text: the annotated model parses back.
    let o = shardc(&["plan", &m, "--cluster", "dgx-a100", "--batch", "64", "--emit", "text"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let annotated = dir.join("annotated.onnxtxt");
    std::fs::write(&annotated, &o.stdout).unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("shardc_strategy: string = ") && text.contains("\"shardc_mesh\""));
    let o = shardc(&["parse", annotated.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), text);

    // --dump-after autoshard prints the annotated model to stderr.
    let o = shardc(&["plan", &m, "--cluster", "dgx-a100", "--batch", "64", "--dump-after", "autoshard"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("# ---- after autoshard ----") && stderr(&o).contains("shardc_strategy"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn plan_errors_and_refusals() {
    let m = model("tv_resnet18.onnxtxt");
    let cases: &[(&[&str], &str)] = &[
        (&["--cluster", "dgx-a100", "--devices", "9"], "has 8 devices"),
        (&["--cluster", "a100-cluster-4", "--devices", "12"], "do not fill whole nodes"),
        (&["--cluster", "nowhere"], "unknown cluster"),
        (&["--cluster", "dgx-a100", "--dump-after", "nonsense"], "unknown pass"),
        (&["--cluster", "dgx-a100", "-o", "tests/data/models/tv_resnet18.onnxtxt"], "refusing to write"),
        (&["--cluster", "dgx-a100", "--pipeline", "3"], "do not divide"),
    ];
    for (args, want) in cases {
        let mut all = vec!["plan", m.as_str()];
        all.extend_from_slice(args);
        let o = shardc(&all);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
    // Numbers out of range and a bad --pipeline are usage errors (exit 2), a safety net of
    // 1e300 s among them.
    for (args, want) in [
        (["--pipeline", "many"], "is not off, auto or a stage count"),
        (["--time-limit", "0"], "--time-limit"),
        (["--time-limit", "1e300"], "at most a year"),
        (["--devices", "-1"], "must be from 1"),
        (["--node-limit", "0"], "--node-limit"),
    ] {
        let mut all = vec!["plan", m.as_str(), "--cluster", "dgx-a100"];
        all.extend_from_slice(&args);
        let o = shardc(&all);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want) && !stderr(&o).contains("-- -1"), "{args:?}: {}", stderr(&o));
    }
    // The model survived the refused -o.
    assert!(std::fs::read_to_string(&m).unwrap().contains("Conv"));
    // A model that fits nowhere (without pipelining, recomputation or ZeRO) says so and gives
    // the smallest plan's memory.
    let o = shardc(&[
        "plan",
        &model("hf_gpt2_small4.onnxtxt"),
        "--cluster",
        "pcie-v100x8",
        "--input-shape",
        "input_ids=512x1024",
        "--pipeline",
        "off",
        "--no-memory-saving",
        "--no-rewrites",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("no plan fits; the smallest found needs"), "{text}");
}

#[test]
fn plan_pipelines_with_a_stage_table_and_a_timeline() {
    let dir = std::env::temp_dir().join(format!("shardc-pipe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("schedule.svg");
    let o = shardc(&[
        "plan",
        &model("hf_gpt2_small4.onnxtxt"),
        "--cluster",
        "dgx-a100",
        "--batch",
        "32",
        "--pipeline",
        "4",
        "--report",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("4 pipeline stages"), "{text}");
    assert!(text.contains("pipeline: 4 stages") && text.contains("recompute"), "{text}");
    let drawing = std::fs::read_to_string(&svg).unwrap();
    assert!(drawing.starts_with("<svg") && drawing.matches("stage ").count() >= 4);
    let o = shardc(&[
        "plan",
        &model("hf_gpt2_small4.onnxtxt"),
        "--cluster",
        "dgx-a100",
        "--batch",
        "32",
        "--pipeline",
        "4",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["stages"].as_array().unwrap().len(), 4);
    assert!(v["micro_batches"].as_u64().unwrap() >= 4);
    assert!(v["schedule"].is_string());
    assert!(v["pipeline"]["reason"].as_str().unwrap().starts_with("requested"));
    std::fs::remove_dir_all(&dir).ok();
}

fn golden(name: &str) -> String {
    format!("tests/data/golden/{name}")
}

/// `shardc plan` of the golden tiny GPT in two pipeline stages on `devices` local devices,
/// written to `dir/plan.json`.
fn two_stage_plan(dir: &Path, devices: usize) -> PathBuf {
    let plan = dir.join("plan.json");
    let n = devices.to_string();
    let o = shardc(&[
        "plan",
        &golden("tiny_gpt.onnxtxt"),
        "--cluster",
        "local-wgpu",
        "--devices",
        &n,
        "--pipeline",
        "2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    plan
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardc-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Two tensors of the golden JSON format hold the same number of values, each within
/// `atol + rtol·|expected|` of `want`'s; `what` names them in the failure.
fn assert_close(got: &serde_json::Value, want: &serde_json::Value, (rtol, atol): (f64, f64), what: &str) {
    let (g, w) = (got["data"].as_array().unwrap(), want["data"].as_array().unwrap());
    assert_eq!(g.len(), w.len(), "{what}");
    for (i, (a, b)) in g.iter().zip(w).enumerate() {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!((a - b).abs() <= atol + rtol * b.abs(), "{what}[{i}]: {a}, expected {b}");
    }
}

/// `o` exited 1 (a refusal, not a crash) and its stderr says `says`; `what` names the case
/// in a failure.
fn assert_refused(o: &Output, says: &str, what: &str) {
    assert_eq!(o.status.code(), Some(1), "{what}: {}", stderr(o));
    assert!(stderr(o).contains(says), "{what}: {}", stderr(o));
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// Largest |a - b| over the outputs of two `.io.json` documents.
fn max_output_diff(a: &serde_json::Value, b: &serde_json::Value) -> f64 {
    let mut worst = 0.0f64;
    let outs = a["outputs"].as_object().expect("outputs");
    assert!(!outs.is_empty());
    for (name, x) in outs {
        let y = &b["outputs"][name];
        let (xs, ys) = (x["data"].as_array().expect("data"), y["data"].as_array().expect("the same output"));
        assert_eq!(xs.len(), ys.len(), "{name}");
        for (p, q) in xs.iter().zip(ys) {
            worst = worst.max((p.as_f64().unwrap() - q.as_f64().unwrap()).abs());
        }
    }
    worst
}

#[test]
fn run_checks_saves_and_replays_outputs() {
    let dir = tmpdir("run");
    let saved = dir.join("out.io.json");
    let io = golden("tiny_resnet.io.json");
    let o = shardc(&[
        "run",
        &golden("tiny_resnet.onnxtxt"),
        "--strategy",
        "data",
        "--devices",
        "2",
        "--backend",
        "cpu",
        "--inputs",
        &io,
        "--check",
        "--save-outputs",
        saved.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for want in ["strategy `data` on 2 devices", "ran          2 devices", "time per op kind", "Conv", "check", " ok"] {
        assert!(text.contains(want), "`{want}` missing:\n{text}");
    }
    // The outputs written are onnxruntime's (the golden file's), within its tolerance.
    let got: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(&io)).unwrap())
            .unwrap();
    assert!(max_output_diff(&got, &want) < 1e-3, "{}", max_output_diff(&got, &want));
    // Replaying the saved inputs under another plan gives the same outputs.
    let again = dir.join("again.io.json");
    let o = shardc(&[
        "run",
        &golden("tiny_resnet.onnxtxt"),
        "--strategy",
        "model",
        "--devices",
        "4",
        "--backend",
        "cpu",
        "--inputs",
        saved.to_str().unwrap(),
        "--save-outputs",
        again.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let second: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&again).unwrap()).unwrap();
    assert!(max_output_diff(&got, &second) < 1e-4);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn run_json_and_plans_from_files() {
    let dir = tmpdir("runplan");
    let plan = two_stage_plan(&dir, 4);
    let o = shardc(&[
        "run",
        &golden("tiny_gpt.onnxtxt"),
        "--plan",
        plan.to_str().unwrap(),
        "--backend",
        "cpu",
        "--check",
        "--steps",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 4);
    assert_eq!(v["micro_batches"].as_u64(), Some(2));
    assert_eq!(v["steps"].as_u64(), Some(2));
    assert_eq!(v["backend"].as_str(), Some("cpu"));
    let checks = v["check"].as_array().unwrap();
    assert!(!checks.is_empty() && checks.iter().all(|c| c["ok"].as_bool() == Some(true)), "{}", v["check"]);
    // The searched plan, printed as text, with the cost model's prediction.
    let o = shardc(&["run", &golden("tiny_mlp.onnxtxt"), "--devices", "2", "--backend", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("searched plan on 2 devices"), "{}", stdout(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// `run --strategy` takes a configuration too: sequence parallelism runs (its reduce-scatters
/// and all-gathers instead of all-reduces) and matches one device; what a forward run cannot
/// do is refused.
#[test]
fn run_takes_a_configuration() {
    let gpt = golden("tiny_gpt.onnxtxt");
    let run =
        |s: &str| shardc(&["run", &gpt, "--devices", "4", "--strategy", s, "--backend", "cpu", "--check", "--json"]);
    let kinds = |o: &Output| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(v["check"].as_array().unwrap().iter().all(|c| c["ok"].as_bool() == Some(true)), "{}", v["check"]);
        let mut k: Vec<String> = v["devices"][0]["by_collective"].as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let plain = run("tp=2,dp=2");
    assert!(plain.status.success(), "{}", stderr(&plain));
    let sp = run("tp=2,dp=2,sp,zero=1");
    assert!(sp.status.success(), "{}", stderr(&sp));
    let v: serde_json::Value = serde_json::from_slice(&sp.stdout).unwrap();
    assert!(
        v["plan"].as_str().unwrap().contains("strategy `tp=2,dp=2,sp,zero=1` as `hybrid:dp:2,tp:2`"),
        "{}",
        v["plan"]
    );
    assert_eq!(kinds(&plain), vec!["AllReduce"]);
    assert_eq!(kinds(&sp), vec!["AllGather", "ReduceScatter"]);
    for (s, says) in
        [("tp=2,dp=2,zero=3", "zero=3"), ("tp=2,dp=2,recompute=full", "recompute"), ("tp=2,dp=2,flash", "flash")]
    {
        let o = run(s);
        assert_eq!(o.status.code(), Some(1), "{s}");
        assert!(stderr(&o).contains(says), "{s}: {}", stderr(&o));
    }
}

#[test]
fn run_errors_exit_1_and_never_overwrite_inputs() {
    let dir = tmpdir("runerr");
    let io = dir.join("in.io.json");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(golden("tiny_mlp.io.json")), &io).unwrap();
    let before = std::fs::read(&io).unwrap();
    let m = golden("tiny_mlp.onnxtxt");
    // Out-of-range numbers are usage errors: the argument parser's exit 2.
    let cases: Vec<(Vec<&str>, &str, i32)> = vec![
        (vec!["--backend", "tpu"], "--backend", 1),
        (vec!["--steps", "0"], "--steps", 2),
        (vec!["--devices", "0"], "--devices", 2),
        (vec!["--devices", "-1"], "must be from 1", 2),
        (vec!["--rtol", "nan"], "--rtol", 2),
        (vec!["--strategy", "diagonal"], "diagonal", 1),
        (vec!["--plan", "no/such/plan.json"], "no/such/plan.json", 1),
        (vec!["--inputs", io.to_str().unwrap(), "--save-outputs", io.to_str().unwrap()], "refusing to write", 1),
        (vec!["--save-outputs", "no/such/dir/out.json"], "does not exist", 1),
        (vec!["--pipeline", "lots"], "lots", 1),
        (vec!["--cluster", "no-such-cluster"], "no-such-cluster", 1),
    ];
    for (extra, want, code) in cases {
        let mut args = vec!["run", m.as_str(), "--backend", "cpu"];
        if extra[0] == "--backend" {
            args.truncate(2);
        }
        args.extend(extra.iter().copied());
        let o = shardc(&args);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: `{want}` not in\n{}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?}: {}", stderr(&o));
    }
    assert_eq!(std::fs::read(&io).unwrap(), before, "the inputs file was changed");
    // Inputs of the wrong shape are named.
    let bad = dir.join("bad.io.json");
    std::fs::write(&bad, r#"{"inputs": {"x": {"dtype": "float32", "shape": [1, 1], "data": [0.0]}}}"#).unwrap();
    let o = shardc(&["run", &m, "--backend", "cpu", "--inputs", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn lower_prints_programs_that_parse_back() {
    let dir = tmpdir("lower");
    let plan = two_stage_plan(&dir, 2);
    let p = plan.to_str().unwrap();
    let o = shardc(&["lower", p]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("---- device 0") && text.contains("---- device 1"), "{text}");
    assert!(text.contains("shardc.Send") && text.contains("shardc.Recv"), "{text}");
    // One device to a file: it parses back, and prints back identically.
    let one = dir.join("d1.onnxtxt");
    let o = shardc(&["lower", p, "--device", "1", "-o", one.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = shardc(&["parse", one.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o) == std::fs::read_to_string(&one).unwrap(),
        "the lowered program does not print back identically"
    );
    // All devices to a directory.
    let out = dir.join("all");
    let o = shardc(&["lower", p, "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("device0.onnxtxt").exists() && out.join("device1.onnxtxt").exists());
    // As binary ONNX: one file per device, which reads back to the same text.
    let bin = dir.join("bin");
    let o = shardc(&["lower", p, "--emit", "onnx", "-o", bin.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = shardc(&["parse", bin.join("device1.onnx").to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), std::fs::read_to_string(&one).unwrap(), "device 1 as .onnx reads back differently");
    // JSON summary and DOT.
    let o = shardc(&["lower", p, "--emit", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 2, "{v}");
    let o = shardc(&["lower", p, "--device", "0", "--emit", "dot"]);
    assert!(stdout(&o).starts_with("digraph"), "{}", stdout(&o));
    // Errors: a device that is not there, a file that is not a plan, overwriting the plan.
    let o = shardc(&["lower", p, "--device", "9"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--device 9"), "{}", stderr(&o));
    let o = shardc(&["lower", &golden("tiny_gpt.onnxtxt")]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let before = std::fs::read(&plan).unwrap();
    let o = shardc(&["lower", p, "--device", "0", "-o", p]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("refusing to write"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&plan).unwrap(), before);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn calibrate_writes_a_cluster_file_the_planner_loads() {
    let dir = tmpdir("calib");
    let toml = dir.join("local.toml");
    let o = shardc(&["calibrate", "--quick", "--backend", "cpu", "--devices", "4", "-o", toml.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&toml).unwrap();
    assert!(text.contains("# Measured by `shardc calibrate`") && text.contains("MatMul"), "{text}");
    assert!(text.contains("devices_per_node = 4") && text.contains("shared_host = true"), "{text}");
    // Collectives through the host, their ring slower with more busy devices than cores.
    assert!(text.contains("host_staged = true") && text.contains("ring_contention = "), "{text}");
    assert!(text.contains("all-reduce of 1024 floats") && text.contains("copy of 4100 floats"), "{text}");
    let o = shardc(&[
        "cost",
        &golden("tiny_gpt.onnxtxt"),
        "--cluster",
        toml.to_str().unwrap(),
        "--strategy",
        "data",
        "--devices",
        "4",
        "--batch",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v.to_string().contains("local-calibrated"), "{v}");
    // Written again: the file is replaced, and that is said.
    let o = shardc(&["calibrate", "--quick", "--backend", "cpu", "--devices", "4", "-o", toml.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("(replaced the previous file)"), "{}", stderr(&o));
    // Two rounds: every timing is the median of both, with twice the runs.
    let o = shardc(&["calibrate", "--quick", "--backend", "cpu", "--json", "--rounds", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v.is_object(), "{v}");
    let matmul =
        v["samples"].as_array().and_then(|s| s.iter().find(|x| x["what"].as_str().unwrap_or("").starts_with("MatMul")));
    assert_eq!(matmul.map(|m| m["reps"].as_u64()), Some(Some(6)), "{v}");
    // The kernels of the calibration models' training steps against their prices: the op
    // types whose price is mostly kernel time, each a positive factor.
    let factors = v["kernel_factors"].as_object().unwrap_or_else(|| panic!("{v}"));
    for (op, k) in factors {
        assert!(k.as_f64().is_some_and(|k| k > 0.0 && k.is_finite()), "{op}: {k}");
    }
    for op in ["Conv", "ConvGradWeight", "MatMul", "MaxPoolGrad"] {
        let k = factors.get(op).and_then(|k| k.as_f64()).unwrap_or_else(|| panic!("no factor for {op}: {v}"));
        assert!(k > 0.0 && k.is_finite(), "{op}: {k}");
    }
    assert!(!factors.contains_key("Reshape"), "a view has no price to compare with: {v}");
    // The invocations that fill a device, and how much slower a single one runs.
    assert!(v["parallel_width"].as_f64().is_some_and(|w| w >= 1.0), "{v}");
    assert!(v["serial_slowdown"].as_f64().is_some_and(|s| s >= 1.0), "{v}");
    // The copies' and the ring's rate by size: positive factors at increasing sizes from
    // 256 KB on.
    for key in ["copy_by_size", "ring_by_size"] {
        let points = v[key].as_array().unwrap_or_else(|| panic!("no {key}: {v}"));
        assert!(!points.is_empty(), "{key}: {v}");
        let sizes: Vec<f64> = points.iter().map(|p| p[0].as_f64().unwrap()).collect();
        assert!(sizes[0] >= 262144.0 && sizes.windows(2).all(|w| w[0] < w[1]), "{key}: {sizes:?}");
        assert!(points.iter().all(|p| p[1].as_f64().is_some_and(|f| f > 0.0 && f.is_finite())), "{key}: {v}");
    }
    // A tile's fixed work as reduction length, from GEMMs of short reductions.
    assert!(v["gemm_k_overhead"].as_f64().is_some_and(|o| (0.0..=1024.0).contains(&o)), "{v}");
    let whats: Vec<&str> = v["samples"].as_array().unwrap().iter().filter_map(|s| s["what"].as_str()).collect();
    assert!(whats.iter().any(|w| w.contains("×16·16×")), "no short-reduction GEMM timed: {whats:?}");
    let o = shardc(&["calibrate", "--quick", "--backend", "cpu", "--rounds", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = shardc(&["calibrate", "--backend", "tpu"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn rebatching_never_changes_a_parameter() {
    // Every bundled model at batch 1, 3 and 8: the float parameters are the same ones, or the
    // command refuses with an error naming the parameter the export baked the batch into.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models");
    let mut models: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "onnxtxt"))
        .collect();
    models.sort();
    let float_params = |o: &Output| -> u64 {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stats JSON");
        v["float_params"].as_u64().expect("float_params")
    };
    let (mut same, mut refused) = (0, 0);
    for p in &models {
        let rel = format!("tests/data/models/{}", p.file_name().unwrap().to_string_lossy());
        let base = shardc(&["stats", &rel, "--json"]);
        assert_eq!(base.status.code(), Some(0), "{rel}: {}", stderr(&base));
        let want = float_params(&base);
        for b in ["1", "3", "8"] {
            let o = shardc(&["stats", &rel, "--batch", b, "--json"]);
            if o.status.code() == Some(0) {
                assert_eq!(float_params(&o), want, "{rel} --batch {b} changed the parameters");
                same += 1;
            } else {
                let err = stderr(&o);
                assert_eq!(o.status.code(), Some(1), "{rel} --batch {b}: {err}");
                assert!(err.contains("cannot rebatch: parameter `"), "{rel} --batch {b}: {err}");
                assert!(!err.contains("panicked"), "{rel}: {err}");
                refused += 1;
            }
        }
    }
    assert!(same >= 3 * (models.len() - 2), "{same} kept, {refused} refused");
}

/// `shardc parse --passes autodiff` prints the training graph; it parses back to the same
/// text, and `shardc train` trains it as it is, matching training the model itself.
#[test]
fn the_training_graph_prints_parses_back_and_trains() {
    let dir = std::env::temp_dir().join(format!("shardc-autodiff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = "tests/data/golden-train/mlp_xent.onnxtxt";
    let o = shardc(&["parse", m, "--passes", "autodiff"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(text.contains("fc1.weight__grad") && text.contains("SgdUpdate"), "{text}");
    let p = dir.join("train.onnxtxt");
    std::fs::write(&p, &text).unwrap();
    let o2 = shardc(&["parse", p.to_str().unwrap()]);
    assert!(o2.status.success(), "{}", stderr(&o2));
    assert_eq!(String::from_utf8_lossy(&o2.stdout), text);
    let losses = |model: &str| -> Vec<f64> {
        let o = shardc(&["train", model, "--steps", "3", "--backend", "cpu", "--lr", "0.01", "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        doc["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
    };
    assert_eq!(losses(p.to_str().unwrap()), losses(m));
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue #19's cases, each with the error it now gives: a run too large for the host, sizes
/// past 64 bits, outputs onto an input through a hard link or a symlink, replacing an
/// unrelated file, and plans applied to the wrong model or edited into nonsense.
#[test]
fn guard_rails_refuse_before_doing() {
    let dir = tmpdir("guards");
    let r18 = model("tv_resnet18.onnxtxt");
    // A run the host cannot hold is refused before anything is allocated.
    let o = shardc(&["run", &r18, "--input-shape", "input=100000x3x224x224", "--strategy", "data", "--backend", "cpu"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("of host memory") && stderr(&o).contains("reduce --batch"), "{}", stderr(&o));
    // Sizes that overflow 64 bits: the sum in `stats`, a tensor at shape inference.
    let o = shardc(&["stats", &r18, "--batch", "1000000000000", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("activation bytes overflow 64 bits at `"), "{}", stderr(&o));
    let o = shardc(&["stats", &r18, "--batch", "100000000000000"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("more than 64-bit sizes can count"), "{}", stderr(&o));
    assert_eq!(stderr(&o).matches("error:").count(), 1, "one error, where it first appears: {}", stderr(&o));
    // Outputs over an input by another name: a hard link and a symlink.
    let m = dir.join("m.onnxtxt");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(golden("tiny_mlp.onnxtxt")), &m).unwrap();
    let before = std::fs::read(&m).unwrap();
    let hard = dir.join("hard.onnxtxt");
    std::fs::hard_link(&m, &hard).unwrap();
    let soft = dir.join("soft.onnxtxt");
    std::os::unix::fs::symlink(&m, &soft).unwrap();
    for out in [&hard, &soft] {
        let o = shardc(&["parse", m.to_str().unwrap(), "--passes", "canonicalize", "-o", out.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(stderr(&o).contains("refusing to write") && stderr(&o).contains("is the same file"), "{}", stderr(&o));
    }
    assert_eq!(std::fs::read(&m).unwrap(), before);
    // An unrelated file is replaced, and that is said; nothing is left beside it.
    let plan = dir.join("plan.json");
    std::fs::write(&plan, "old").unwrap();
    let p = plan.to_str().unwrap();
    let o = shardc(&["plan", m.to_str().unwrap(), "--cluster", "local-wgpu", "--devices", "2", "-o", p]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("(replaced the previous file)"), "{}", stderr(&o));
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
    // The plan runs on its model; on another file only with --force, and it must still fit.
    let run = |model: &str, extra: &[&str]| {
        let mut a = vec!["run", model, "--plan", p, "--backend", "cpu"];
        a.extend_from_slice(extra);
        shardc(&a)
    };
    assert!(run(m.to_str().unwrap(), &[]).status.success());
    let edited = dir.join("edited.onnxtxt");
    // A re-export: the same graph, other bytes.
    std::fs::write(&edited, format!("{}\n\n", String::from_utf8_lossy(&before))).unwrap();
    let o = run(edited.to_str().unwrap(), &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("was made for another file") && stderr(&o).contains("--force"), "{}", stderr(&o));
    let o = run(edited.to_str().unwrap(), &["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("applied anyway (--force)"), "{}", stdout(&o));
    let o = run(edited.to_str().unwrap(), &["--force", "--batch", "3"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("the plan does not fit this model"), "{}", stderr(&o));
    // Edited plans: an op removed, an op's type changed, a device count that is not the mesh's.
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    let first_op = doc["ops"][0]["name"].as_str().unwrap().to_string();
    let mut no_op = doc.clone();
    no_op["ops"].as_array_mut().unwrap().remove(0);
    let mut retyped = doc.clone();
    retyped["ops"][0]["op"] = "Conv".into();
    let mut devices = doc.clone();
    devices["devices"] = 3.into();
    // A sha256 edited into something that is not hex is another file's, not a crash.
    let mut sha = doc.clone();
    sha["model"]["sha256"] = "aééééééééééééé".into();
    // A split along a mesh axis the plan does not have.
    let mut split = doc.clone();
    split["ops"][0]["split"] = serde_json::json!([7, 7]);
    for (edit, want) in [
        (no_op, "the plan has no strategy for"),
        (retyped, "is Conv in the plan"),
        (devices, "malformed plan: device 2 of the plan's 3 is in no stage"),
        (sha, "sha256 aééééééééééé…"),
        (split, ""),
    ] {
        let e = dir.join("edit.json");
        std::fs::write(&e, edit.to_string()).unwrap();
        let o = shardc(&["lower", e.to_str().unwrap(), "--model", m.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{want}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{want} ({first_op}): {}", stderr(&o));
        // `train --plan` validates as `lower` does: the same refusal, never a panic or a
        // strategy filled in for an op the plan lacks.
        let o = shardc(&[
            "train",
            m.to_str().unwrap(),
            "--plan",
            e.to_str().unwrap(),
            "--loss",
            "mse",
            "--backend",
            "cpu",
            "--steps",
            "1",
        ]);
        assert_eq!(o.status.code(), Some(1), "train {want}: {}", stderr(&o));
        assert!(stderr(&o).contains(want) && !stderr(&o).contains("panicked"), "train {want}: {}", stderr(&o));
    }
    // -o into a directory that is not there fails before the search.
    let o = shardc(&["plan", &r18, "--cluster", "dgx-a100", "-o", "no/such/dir/plan.json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// Reads a command's JSON output without what varies between files and runs: the model's
/// path and hash, and measured times.
fn comparable(o: &Output) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                for k in ["model", "path", "sha256", "timings"] {
                    m.remove(k);
                }
                m.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut v);
    v
}

/// Binary `.onnx` (written by the onnx package) is read by every command, detected by content:
/// `parse` converts it to the same text, `stats`, `cost` and `plan` give the same results as
/// for the text file, and `-o NAME.onnx` writes binary that reads back the same.
#[test]
fn binary_models_work_in_every_command() {
    for name in ["tv_alexnet", "tv_resnet18", "hf_gpt2_small4", "pt_lstm_lm", "magika_standard_v3_3"] {
        let text = model(&format!("{name}.onnxtxt"));
        let bin = format!("tests/data/onnx/{name}.onnx");
        let a = shardc(&["parse", &text]);
        let b = shardc(&["parse", &bin]);
        assert!(b.status.success(), "{name}: {}", stderr(&b));
        assert_eq!(a.stdout, b.stdout, "{name}: parse --emit text differs");
        for args in [
            vec!["stats", "--json", "--batch", "4"],
            vec!["cost", "--json", "--cluster", "dgx-a100", "--devices", "8", "--strategy", "data", "--batch", "8"],
        ] {
            let mut ta = args.clone();
            ta.insert(1, &text);
            let mut tb = args.clone();
            tb.insert(1, &bin);
            let (oa, ob) = (shardc(&ta), shardc(&tb));
            assert!(oa.status.success() && ob.status.success(), "{name} {args:?}: {} {}", stderr(&oa), stderr(&ob));
            assert_eq!(comparable(&oa), comparable(&ob), "{name}: `{}` differs", args[0]);
        }
    }
    // A plan of the binary equals the plan of the text (outside timings and the file's hash).
    let plan = |m: &str| shardc(&["plan", m, "--cluster", "dgx-a100", "--devices", "4", "--batch", "8", "--json"]);
    let (pa, pb) = (plan(&model("tv_resnet18.onnxtxt")), plan("tests/data/onnx/tv_resnet18.onnx"));
    assert!(pa.status.success() && pb.status.success(), "{} {}", stderr(&pa), stderr(&pb));
    assert_eq!(comparable(&pa), comparable(&pb), "plan differs");
    // parse -o x.onnx writes binary; --emit text converts back.
    let dir = tmpdir("binary");
    let out = dir.join("alexnet.onnx");
    let o = shardc(&["parse", &model("tv_alexnet.onnxtxt"), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let written = std::fs::read(&out).unwrap();
    assert_eq!(written.first(), Some(&0x08), "a ModelProto starts with ir_version");
    let back = shardc(&["parse", out.to_str().unwrap(), "--emit", "text"]);
    assert_eq!(back.stdout, shardc(&["parse", &model("tv_alexnet.onnxtxt")]).stdout);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Symbolic dims: `stats` says what it cannot count and why, the commands that price or run
/// refuse with the flag that fixes it, and `--dim` binds them by name. An op outside the op
/// table parses and prints, but pricing, planning and running name it.
#[test]
fn symbolic_dims_and_unsupported_ops_are_refused_with_the_fix() {
    let dir = tmpdir("symbolic");
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(model("tv_resnet50_dynbatch.onnxtxt")))
            .unwrap()
            .replacen("float[batch,3,224,224] input", "float[batch,3,height,width] input", 1);
    let sym = dir.join("r50sym.onnxtxt");
    std::fs::write(&sym, text).unwrap();
    let p = sym.to_str().unwrap();
    let o = shardc(&["stats", p]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("forward FLOPs    unknown") && out.contains("--dim batch=N --dim height=N --dim width=N"),
        "{out}"
    );
    assert!(!out.contains("0.000 FLOP"), "{out}");
    let o = shardc(&["stats", p, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["forward_flops"].is_null() && v["unknown_shapes"].as_u64().unwrap() > 0, "{v}");
    for args in [
        vec!["cost", p, "--cluster", "dgx-a100", "--strategy", "data"],
        vec!["plan", p, "--cluster", "dgx-a100", "--devices", "8"],
        vec!["run", p, "--devices", "2", "--backend", "cpu"],
    ] {
        let o = shardc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains("whose size is not known") && e.contains("--dim batch=N --dim height=N --dim width=N"),
            "{args:?}: {e}"
        );
        assert!(o.stdout.is_empty() && !e.contains("step time"), "{args:?} printed a step time");
    }
    let o = shardc(&[
        "cost",
        p,
        "--cluster",
        "dgx-a100",
        "--strategy",
        "data",
        "--dim",
        "batch=64",
        "--dim",
        "height=224",
        "--dim",
        "width=224",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["batch"], 64, "{v}");
    let o = shardc(&["cost", p, "--cluster", "dgx-a100", "--strategy", "data", "--dim", "bacth=64"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no input has a dim named `bacth`; they have batch, height, width"), "{}", stderr(&o));
    let o = shardc(&["stats", p, "--dim", "batch=0"]);
    assert_ne!(o.status.code(), Some(0), "{}", stderr(&o));
    // An op shardc does not know: kept by parse, named by every command that computes.
    let unknown = dir.join("unknown.onnxtxt");
    std::fs::write(
        &unknown,
        "<ir_version: 8, opset_import: [\"\" : 17, \"com.example\" : 1]>\ng (float[2,3] x) => (float[2,3] y) {\n   [mystery] h = com.example.Frobnicate <gain: float = 2.0> (x)\n   y = Relu (h)\n}\n",
    )
    .unwrap();
    let u = unknown.to_str().unwrap();
    let o = shardc(&["parse", u]);
    assert!(o.status.success() && stdout(&o).contains("com.example.Frobnicate"), "{}", stderr(&o));
    for args in [
        vec!["cost", u, "--cluster", "dgx-a100", "--strategy", "data", "--devices", "2"],
        vec!["run", u, "--backend", "cpu", "--devices", "1"],
    ] {
        let o = shardc(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let e = stderr(&o);
        assert!(
            e.contains("unsupported op `Frobnicate` (domain `com.example`)") && e.contains("mystery"),
            "{args:?}: {e}"
        );
        assert!(e.contains(":3:"), "{args:?}: no location in {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model whose shapes are symbolic and whose branch depends on an input (as Silero VAD's
/// sample rate picks its network) runs at the shapes of the given inputs: the branch the
/// value takes is inlined, the other (which does not fit these shapes) is not checked.
/// Inputs come as `.io.json` or as a directory of `input_K.pb` tensors.
#[test]
fn run_takes_shapes_and_branches_from_the_given_inputs() {
    let dir = tmpdir("given");
    let m = dir.join("rate.onnxtxt");
    std::fs::write(
        &m,
        r#"<ir_version: 8, opset_import: ["" : 17]>
select_rate (float[N, L] x, int64 sr) => (float[N, K] y) {
  rate = Constant <value = int64 {16000}> ()
  wide = Equal (sr, rate)
  y = If (wide) <
    then_branch = wide_branch () => (float[N, 4] t) {
      s16 = Constant <value = int64[3] {1, 4, 128}> ()
      r16 = Reshape (x, s16)
      a16 = Constant <value = int64[1] {2}> ()
      t = ReduceSum <keepdims = 0> (r16, a16)
    },
    else_branch = narrow_branch () => (float[N, 2] e) {
      s8 = Constant <value = int64[3] {1, 2, 128}> ()
      r8 = Reshape (x, s8)
      a8 = Constant <value = int64[1] {2}> ()
      e = ReduceSum <keepdims = 0> (r8, a8)
    }
  >
}
"#,
    )
    .unwrap();
    let mp = m.to_str().unwrap();
    // Without values the sizes are unknown, and the refusal says so.
    let o = shardc(&["run", mp, "--backend", "cpu"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("--dim N=N --dim L=N"), "{}", stderr(&o));
    let xs = |n: usize| (0..n).map(|i| ((i * 7) % 13) as f32 * 0.25 - 1.0).collect::<Vec<f32>>();
    let sums = |x: &[f32], parts: usize| -> Vec<f64> {
        x.chunks(x.len() / parts).map(|c| c.iter().map(|&v| v as f64).sum()).collect()
    };
    // 16 kHz from JSON: the `then` branch, four sums of 128.
    let x16 = xs(512);
    let io = dir.join("16k.io.json");
    let doc = serde_json::json!({"inputs": {
        "x": {"dtype": "float32", "shape": [1, 512], "data": x16},
        "sr": {"dtype": "int64", "shape": [], "data": [16000]},
    }});
    std::fs::write(&io, doc.to_string()).unwrap();
    // 8 kHz from ONNX test data: the `else` branch, two sums of 128.
    let x8 = xs(256);
    let pb = dir.join("8k");
    std::fs::create_dir_all(&pb).unwrap();
    let t = ir::Tensor::from_f32(vec![1, 256], x8.clone());
    std::fs::write(pb.join("input_0.pb"), frontend::onnx::tensor_to_bytes(&t, Some("x"))).unwrap();
    let sr = ir::Tensor::from_i64(vec![], vec![8000]);
    std::fs::write(pb.join("input_1.pb"), frontend::onnx::tensor_to_bytes(&sr, Some("sr"))).unwrap();
    for (inputs, want) in [(io, sums(&x16, 4)), (pb, sums(&x8, 2))] {
        let out = dir.join("out.io.json");
        std::fs::remove_file(&out).ok();
        let o = shardc(&[
            "run",
            mp,
            "--backend",
            "cpu",
            "--devices",
            "2",
            "--check",
            "--inputs",
            inputs.to_str().unwrap(),
            "--save-outputs",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{inputs:?}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        let y = &v["outputs"]["y"];
        assert_eq!(y["shape"], serde_json::json!([1, want.len()]), "{inputs:?}");
        let got: Vec<f64> = y["data"].as_array().unwrap().iter().map(|d| d.as_f64().unwrap()).collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-4, "{inputs:?}: {got:?} vs {want:?}");
        }
        // The branch was inlined: its ops ran on the devices, not one `If` on the host.
        assert!(!stdout(&o).contains(" If "), "{inputs:?}: {}", stdout(&o));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A headless browser, when one is installed: `chromium` (Debian) or `chromium-browser`.
/// `SHARDC_REQUIRE_BROWSER=1` (set by `.ci/run`) makes its absence a failure.
fn browser() -> Option<&'static str> {
    for b in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()) {
            return Some(b);
        }
    }
    assert!(
        std::env::var("SHARDC_REQUIRE_BROWSER").is_err(),
        "SHARDC_REQUIRE_BROWSER is set and no chromium is installed (apt-get install chromium)"
    );
    eprintln!("skipped: no chromium installed to render the HTML report (apt-get install chromium)");
    None
}

/// Opens `page` in headless Chromium: the DOM after its scripts ran, and a screenshot's
/// pixels (RGBA) with its width.
fn render(browser: &str, page: &Path, dir: &Path, height: u32) -> (String, Vec<u8>, u32) {
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    let common = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files"];
    let profile = format!("--user-data-dir={}", dir.join("profile").display());
    let dom = Command::new(browser).args(common).arg(&profile).args(["--dump-dom", &url]).output().unwrap();
    assert!(dom.status.success(), "{}", stderr(&dom));
    let png = dir.join("shot.png");
    let shot = Command::new(browser)
        .args(common)
        .arg(&profile)
        .args([&format!("--window-size=1280,{height}"), &format!("--screenshot={}", png.display()), &url])
        .output()
        .unwrap();
    assert!(shot.status.success() && png.exists(), "{}", stderr(&shot));
    let decoder = png::Decoder::new(std::fs::File::open(&png).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    let rgba: Vec<u8> = match info.color_type {
        png::ColorType::Rgba => buf,
        png::ColorType::Rgb => buf.chunks(3).flat_map(|p| [p[0], p[1], p[2], 255]).collect(),
        other => panic!("unexpected screenshot colour type {other:?}"),
    };
    (String::from_utf8_lossy(&dom.stdout).to_string(), rgba, info.width)
}

/// `plan --html` (with `--explain`) and `sweep --html` write pages that render in a real
/// browser: the page's script ran without errors and counted its charts, and the screenshot
/// is not blank (a good share of non-white pixels, in many colours: charts, not one flat box).
#[test]
fn html_reports_render_in_a_headless_browser() {
    let dir = std::env::temp_dir().join(format!("shardc-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("plan.html");
    let o = shardc(&[
        "plan",
        &model("hf_gpt2_small4.onnxtxt"),
        "--cluster",
        "dgx-a100",
        "--batch",
        "8",
        "--explain",
        "--html",
        page.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("parallelism") && text.contains("why this plan"), "{text}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        !html.contains("<script src") && !html.contains("<link") && !html.contains("<img src=\"http"),
        "the page loads nothing"
    );
    for section in ["the model, coloured by strategy", "memory", "communication per block", "timeline"] {
        assert!(html.contains(&format!("<h2>{section}</h2>")), "no `{section}` section");
    }
    let sweep = dir.join("sweep.html");
    let o = shardc(&[
        "sweep",
        &model("tv_alexnet.onnxtxt"),
        "--cluster",
        "pcie-v100x8",
        "--batch",
        "256",
        "--axis",
        "linkbw",
        "--values",
        "0.1x,1x,10x",
        "--strategies",
        "data,owt",
        "--html",
        sweep.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let Some(b) = browser() else { return };
    for (page, charts, height) in [(&page, 4, 2400), (&sweep, 1, 900)] {
        let (dom, rgba, width) = render(b, page, &dir, height);
        let body = dom.split("<body").nth(1).unwrap_or_default();
        assert!(
            body.contains("data-errors=\"0\""),
            "{}: script errors: {}",
            page.display(),
            &body[..200.min(body.len())]
        );
        let n: usize = body
            .split("data-charts=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{}: the page's script did not run", page.display()));
        assert!(n >= charts, "{}: {n} charts", page.display());
        let pixels = rgba.len() / 4;
        let ink = rgba.chunks(4).filter(|p| p[0] < 235 || p[1] < 235 || p[2] < 235).count();
        let colours: std::collections::HashSet<[u8; 3]> = rgba.chunks(4).map(|p| [p[0], p[1], p[2]]).collect();
        assert!(width >= 1000, "{width}");
        assert!(ink * 50 > pixels, "{}: nearly blank ({ink} of {pixels} pixels drawn)", page.display());
        assert!(colours.len() > 50, "{}: {} colours", page.display(), colours.len());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Progress is drawn on a terminal (here a pseudo-terminal from util-linux's `script`), never
/// into a pipe or with `--quiet`; `-v` prints each pass's time and the search's phases.
#[test]
fn progress_on_terminals_only_and_verbose_timings() {
    let args = ["plan", "tests/data/models/hf_gpt2_small4.onnxtxt", "--cluster", "dgx-a100", "--batch", "8"];
    let piped = shardc(&args);
    assert!(piped.status.success(), "{}", stderr(&piped));
    assert!(!stderr(&piped).contains("searching"), "progress into a pipe: {}", stderr(&piped));
    let mut verbose = args.to_vec();
    verbose.push("-v");
    let o = shardc(&verbose);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    for want in ["pass verify", "pass autoshard", "search mesh", "search total"] {
        assert!(err.contains(want), "no `{want}` in {err}");
    }
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped the terminal half: no `script` (util-linux) to make a pseudo-terminal");
        return;
    }
    let on_terminal = |extra: &str| {
        let cmd = format!("{} {} {extra}", env!("CARGO_BIN_EXE_shardc"), args.join(" "));
        let o = Command::new("script")
            .args(["-qec", &cmd, "/dev/null"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let shown = on_terminal("");
    assert!(shown.contains("searching: mesh"), "{shown}");
    assert!(shown.contains("parallelism"), "the summary follows the progress: {shown}");
    let quiet = on_terminal("--quiet");
    assert!(!quiet.contains("searching") && quiet.contains("parallelism"), "{quiet}");
}

/// `run` on wgpu: one step is not compared with the prediction (it also compiled the
/// kernels), adapter names are printed whole, and a check that passes on atol says so.
#[test]
fn run_reports_say_what_their_numbers_mean() {
    let args = ["run", "tests/data/models/tv_resnet18.onnxtxt", "--batch", "2", "--devices", "2"];
    let tail = ["--strategy", "data", "--cluster", "local-wgpu", "--check", "--backend", "wgpu"];
    let o = shardc(&[&args[..], &tail[..]].concat());
    if !o.status.success() && std::env::var_os("SHARDC_REQUIRE_GPU").is_none() {
        eprintln!("skipped: no wgpu adapter: {}", stderr(&o));
        return;
    }
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("not compared: the only step also compiled the kernels"), "{text}");
    assert!(!text.contains("vs measured"), "{text}");
    // The same run as JSON names the adapters; the table has each whole.
    let o = shardc(&[&args[..], &tail[..], &["--json"]].concat());
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for d in doc["devices"].as_array().unwrap() {
        let name = d["adapter"].as_str().unwrap();
        assert!(text.contains(name), "`{name}` cut in:\n{text}");
    }
    // ResNet-18's logits have elements near zero: the relative error passes the 1e-4 rtol
    // only through atol, and the verdict says so.
    let line = text.lines().find(|l| l.contains("max rel error")).unwrap();
    let rel: f64 = line.split("max rel error").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    if rel > 1e-4 {
        assert!(line.contains("ok (within atol"), "{line}");
    } else {
        assert!(line.trim_end().ends_with(" ok"), "{line}");
    }
}

/// `plan --export`: launch settings on stdout when the plan fits a framework's template, a
/// clear error and exit 1 when it does not.
#[test]
fn plan_exports_or_says_why_not() {
    let gpt2 = model("hf_gpt2_small4.onnxtxt");
    let o = shardc(&["plan", &gpt2, "--cluster", "dgx-a100", "--batch", "8", "--export", "megatron"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("--tensor-model-parallel-size") && text.contains("--global-batch-size 8"), "{text}");
    let o = shardc(&["plan", &gpt2, "--cluster", "dgx-a100", "--batch", "8", "--export", "deepspeed"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["train_batch_size"], 8);
    let r18 = model("tv_resnet18.onnxtxt");
    let o = shardc(&["plan", &r18, "--cluster", "dgx-a100", "--devices", "4", "--batch", "8", "--export", "torch-tp"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stderr(&o).starts_with("error: ") && !stderr(&o).contains("panicked"), "{}", stderr(&o));
}

/// `calibrate --transport threads`: the in-process all-reduce timed and fitted, written as a
/// cluster file (the compared cluster with the fitted link) that `shardc cluster` accepts.
#[test]
fn transports_are_calibrated_into_cluster_files() {
    let dir = tmpdir("calibrate-transport");
    let file = dir.join("threads.toml");
    let o = shardc(&["calibrate", "--transport", "threads", "--devices", "2", "--quick", "-o", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let toml = std::fs::read_to_string(&file).unwrap();
    assert!(toml.contains("# fitted") && toml.contains("name = \"local-wgpu-threads\""), "{toml}");
    let o = shardc(&["cluster", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Without MPI built in, the mpi transport is refused with the way to get it.
    if !cfg!(feature = "mpi") {
        let o = shardc(&["calibrate", "--transport", "mpi"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains("--features mpi"), "{}", stderr(&o));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plan` says what its strategies' letters mean, and `run` says why its plan pipelines.
#[test]
fn plans_say_what_their_letters_mean_and_runs_why_they_pipeline() {
    let o = shardc(&["plan", &model("hf_gpt2_small4.onnxtxt"), "--cluster", "dgx-a100", "--batch", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("notation") && text.contains("m rows, n columns, k the reduction"), "{text}");
    let o = shardc(&["run", &golden("tiny_mlp.onnxtxt"), "--devices", "2", "--pipeline", "2", "--backend", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("pipelined because requested: 2 stages"), "{text}");
}

/// The search tries `conv-as-matmul` on the whole graph and keeps it when its plan is priced
/// faster (SqueezeNet's 17 pointwise convolutions: on two local-wgpu devices at batch 4 the
/// GEMMs are; on eight NVLink V100s at batch 8 they are not), then at the places priced cheaper only; the plan says
/// so, and `lower` makes the rewrite again before applying the plan. `--no-rewrites` does not
/// try it.
#[test]
fn the_search_chooses_the_pointwise_conv_rewrite_by_price() {
    let dir = std::env::temp_dir().join(format!("shardc-rewrite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let m = model("tv_squeezenet1_1.onnxtxt");
    let plan = |cluster: &str, devices: &str, batch: &str, extra: &[&str]| {
        let mut args = vec!["plan", &m, "--cluster", cluster, "--devices", devices, "--batch", batch, "--json"];
        args.extend_from_slice(extra);
        let o = shardc(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let v = plan("local-wgpu", "2", "4", &["-o", out.to_str().unwrap()]);
    let c = &v["rewrites"][0];
    assert_eq!(
        (c["rule"].as_str(), c["sites"].as_u64(), c["applied"].as_bool()),
        (Some("conv-as-matmul"), Some(17), Some(true))
    );
    let (with, without) = (c["with_step_time_s"].as_f64().unwrap(), c["without_step_time_s"].as_f64().unwrap());
    assert!(with < without, "{c}");
    // The plan is the rewrite everywhere, or at the places priced cheaper where that plan
    // is faster still (as it is without pipelining, below).
    let cheaper: Vec<&str> =
        c["cheaper_at"].as_array().map_or(Vec::new(), |a| a.iter().map(|l| l.as_str().unwrap()).collect());
    let (step, matmuls) = if c["applied_at_cheaper"].as_bool() == Some(true) {
        (c["cheaper_at_step_time_s"].as_f64().unwrap(), cheaper.len())
    } else {
        (with, 17)
    };
    assert!(step <= with && v["step_time_s"].as_f64().unwrap() == step, "{c}");
    let ops: Vec<&str> = v["ops"].as_array().unwrap().iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert_eq!(ops.iter().filter(|&&o| o == "MatMul").count(), matmuls, "{ops:?}");
    let o = shardc(&["lower", out.to_str().unwrap(), "--device", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("MatMul"));

    // Place by place: without pipelining on four devices, the plans price every squeeze
    // convolution cheaper as a GEMM and not every expand one; the graph rewritten at those
    // places only is searched and its plan is the fastest of the three. `lower` makes the
    // rewrite at those places.
    let part = dir.join("part.json");
    let v = plan("local-wgpu", "4", "4", &["--pipeline", "off", "-o", part.to_str().unwrap()]);
    let c = &v["rewrites"][0];
    let at: Vec<&str> = c["cheaper_at"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
    let squeezes = ["3", "4", "6", "7", "9", "10", "11", "12"].map(|i| format!("/features/features.{i}/squeeze/Conv"));
    assert!(at.len() < 17 && squeezes.iter().all(|s| at.contains(&s.as_str())), "{c}");
    let t = |k: &str| c[k].as_f64().unwrap();
    assert!(t("cheaper_at_step_time_s") < t("with_step_time_s").min(t("without_step_time_s")), "{c}");
    assert_eq!((c["applied"].as_bool(), c["applied_at_cheaper"].as_bool()), (Some(true), Some(true)), "{c}");
    assert_eq!(v["step_time_s"].as_f64(), c["cheaper_at_step_time_s"].as_f64());
    let ops: Vec<&str> = v["ops"].as_array().unwrap().iter().map(|o| o["op"].as_str().unwrap()).collect();
    assert_eq!(ops.iter().filter(|&&o| o == "MatMul").count(), at.len(), "{ops:?}");
    let o = shardc(&["lower", part.to_str().unwrap(), "--device", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("MatMul") && text.contains("Conv"));

    let v = plan("dgx1-v100", "8", "8", &[]);
    let c = &v["rewrites"][0];
    assert_eq!(c["applied"].as_bool(), Some(false), "{c}");
    assert!(c["with_step_time_s"].as_f64().unwrap() > v["step_time_s"].as_f64().unwrap());
    assert!(v["ops"].as_array().unwrap().iter().all(|o| o["op"] != "MatMul"));
    let v = plan("local-wgpu", "2", "4", &["--no-rewrites"]);
    assert_eq!(v["rewrites"].as_array().map(Vec::len), Some(0));
    std::fs::remove_dir_all(&dir).ok();
}

/// The search tries `fuse-gemms` (GEMMs reading one input joined) and keeps it when its plan
/// is priced faster: the tiny GPT's query, key and value projections (un-fused by `algebra`)
/// on two local-wgpu devices, where one larger GEMM beats three small ones; `train --plan`
/// makes the rewrite again, checks against the reference and takes the steps the original
/// model takes; `run` without a plan chooses it too. On 8 dgx-a100 GPUs at batch 8, GPT-2
/// joins its projections head by head (each split into heads after the GEMM), so the one
/// GEMM's column split is a split by heads: attention by heads with one GEMM is priced
/// faster than with three.
#[test]
fn the_search_chooses_fusing_gemms_by_price() {
    let dir = std::env::temp_dir().join(format!("shardc-fuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let m = golden("tiny_gpt.onnxtxt");
    let o = shardc(&["plan", &m, "--cluster", "local-wgpu", "--devices", "2", "--json", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let c = v["rewrites"].as_array().unwrap().iter().find(|c| c["rule"] == "fuse-gemms").unwrap();
    assert_eq!((c["sites"].as_u64(), c["applied"].as_bool()), (Some(1), Some(true)), "{c}");
    let (with, without) = (c["with_step_time_s"].as_f64().unwrap(), c["without_step_time_s"].as_f64().unwrap());
    assert!(with < without && v["step_time_s"].as_f64().unwrap() == with, "{c}");
    assert!(v["ops"].as_array().unwrap().iter().any(|o| o["op"] == "Split"));
    let train = |extra: &[&str]| {
        let mut args =
            vec!["train", &m, "--loss", "softmax-cross-entropy", "--steps", "2", "--backend", "cpu", "--json"];
        args.extend_from_slice(extra);
        let o = shardc(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let planned = train(&["--plan", out.to_str().unwrap(), "--check"]);
    assert!(planned["check"].as_array().unwrap().iter().all(|c| c["ok"] == true), "{}", planned["check"]);
    // `run`'s own search makes the same choice, and the program of the joined GEMM computes
    // the model's logits.
    let o = shardc(&["run", &m, "--cluster", "local-wgpu", "--devices", "2", "--backend", "cpu", "--check"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("rewrite fuse-gemms at 1 place: the search priced its plan faster"), "{text}");
    assert!(text.contains("logits") && text.contains(" ok"), "{text}");
    let saved = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let plain = train(&["--devices", "1", "--save-state", &saved("plain.json")]);
    for (a, b) in planned["losses"].as_array().unwrap().iter().zip(plain["losses"].as_array().unwrap()) {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} with the joined GEMM, {b} without");
    }
    // `train`'s own search is `plan`'s (the same rewrite), checked against the model as
    // written; a plan searched without rewrites trains the projections un-fused. Either way
    // the trained tensors are the model's, by name and shape.
    let searched =
        train(&["--cluster", "local-wgpu", "--devices", "2", "--check", "--save-state", &saved("searched.json")]);
    let notes = searched["notes"].to_string();
    assert!(notes.contains("rewrite fuse-gemms at 1 place") && notes.contains("the model as written"), "{notes}");
    assert!(searched["check"].as_array().unwrap().iter().all(|c| c["ok"] == true), "{}", searched["check"]);
    let unfused = dir.join("unfused.json");
    let o = shardc(&[
        "plan",
        &m,
        "--cluster",
        "local-wgpu",
        "--devices",
        "2",
        "--no-rewrites",
        "-o",
        unfused.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let split = train(&["--plan", unfused.to_str().unwrap(), "--check", "--save-state", &saved("split.json")]);
    assert!(split["check"].as_array().unwrap().iter().all(|c| c["ok"] == true), "{}", split["check"]);
    let read =
        |name: &str| -> serde_json::Value { serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap() };
    let want = read("plain.json");
    for got in [read("searched.json"), read("split.json")] {
        for what in ["parameters", "gradients"] {
            let (w, g) = (want[what].as_object().unwrap(), got[what].as_object().unwrap());
            assert_eq!(w.keys().collect::<Vec<_>>(), g.keys().collect::<Vec<_>>(), "{what}");
            for (k, a) in w {
                assert_eq!(a["shape"], g[k]["shape"], "{what} {k}");
                let (a, b) = (a["data"].as_array().unwrap(), g[k]["data"].as_array().unwrap());
                for (x, y) in a.iter().zip(b) {
                    let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                    assert!((x - y).abs() <= 1e-5 + 1e-4 * x.abs(), "{what} {k}: {x} vs {y}");
                }
            }
        }
    }

    let o = shardc(&[
        "plan",
        &model("hf_gpt2_124m.onnxtxt"),
        "--cluster",
        "dgx-a100",
        "--devices",
        "8",
        "--batch",
        "8",
        "--pipeline",
        "off",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let c = v["rewrites"].as_array().unwrap().iter().find(|c| c["rule"] == "fuse-gemms").unwrap();
    assert_eq!((c["sites"].as_u64(), c["applied"].as_bool()), (Some(12), Some(true)), "{c}");
    assert!(c["without_step_time_s"].as_f64().unwrap() > v["step_time_s"].as_f64().unwrap(), "{c}");
    // One GEMM per layer, its columns head by head, and attention split by heads.
    let ops = v["ops"].as_array().unwrap();
    assert_eq!(ops.iter().filter(|o| o["name"].as_str().unwrap().ends_with("}/heads")).count(), 12);
    // Attention fused (one op per layer, split by heads) or as the model writes it (its two
    // products split by heads).
    let fused = v["rewrites"].as_array().unwrap().iter().any(|c| c["rule"] == "fuse-attention" && c["applied"] == true);
    let split = |op: &str, dim: &str| {
        ops.iter().filter(|o| o["op"] == op && o["strategy"].as_str().unwrap().contains(dim)).count()
    };
    let by_heads = if fused { split("Attention", "h→") } else { split("MatMul", "b1→") };
    assert_eq!(by_heads, if fused { 12 } else { 24 }, "attention split by heads");
    std::fs::remove_dir_all(&dir).ok();
}

/// BERT-base on 8 PCIe V100s at batch 8, its Q, K and V projections kept apart
/// (`--no-rewrites`): the search splits attention by heads (both attention products of
/// every layer over mesh axes, from the per-axis data × Megatron seeds) and its plan is
/// priced faster than the `megatron` named strategy. (On NVSwitch A100s at this size the
/// cheapest plans split the batch and the keys instead: the products' tiles are too few
/// to fill the SMs either way.)
#[test]
fn bert_attention_splits_by_heads() {
    let m = model("hf_bert_base.onnxtxt");
    let common = ["--cluster", "pcie-v100x8", "--devices", "8", "--batch", "8", "--json"];
    let mut args = vec!["plan", m.as_str(), "--pipeline", "off", "--no-rewrites"];
    args.extend_from_slice(&common);
    let o = shardc(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ops = v["ops"].as_array().unwrap();
    let products: Vec<&serde_json::Value> = ops
        .iter()
        .filter(|o| {
            let n = o["name"].as_str().unwrap();
            n.ends_with("attention/self/MatMul") || n.ends_with("attention/self/MatMul_1")
        })
        .collect();
    assert_eq!(products.len(), 24);
    for o in &products {
        assert!(o["strategy"].as_str().unwrap().contains("b1→"), "{}: {}", o["name"], o["strategy"]);
    }
    let mut args = vec!["cost", m.as_str(), "--strategy", "megatron"];
    args.extend_from_slice(&common);
    let o = shardc(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let megatron: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (plan, named) = (v["step_time_s"].as_f64().unwrap(), megatron["step_time_s"].as_f64().unwrap());
    assert!(plan < named, "searched {plan} s, megatron {named} s");
}

// A model written after a rewrite split its weights is a plain ONNX model: the parts are
// inline (read from the data file beside the model), not shardc's description of columns of
// another tensor, and it computes what the model as written does.
#[test]
fn rewritten_models_are_written_with_their_weights() {
    let dir = std::env::temp_dir().join(format!("shardc-inline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
qkv (float[4,6] x) => (float[4,3] q, float[4,3] k, float[4,3] v)
   <float[6,9] w = ["location": "w.bin", "offset": "0", "length": "216"], float[9] c = {1, 2, 3, 4, 5, 6, 7, 8, 9}>
{
   y = Gemm (x, w, c)
   q, k, v = Split <axis: int = 1, num_outputs: int = 3> (y)
}"#;
    std::fs::write(dir.join("m.onnxtxt"), text).unwrap();
    let w: Vec<u8> = (0..54).flat_map(|i| (i as f32 * 0.25 - 6.0).to_le_bytes()).collect();
    std::fs::write(dir.join("w.bin"), &w).unwrap();
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let o = shardc(&["parse", &p("m.onnxtxt"), "--passes", "algebra", "-o", &p("out.onnx")]);
    assert!(o.status.success() && stderr(&o).is_empty(), "{}", stderr(&o));
    let o = shardc(&["parse", &p("out.onnx")]);
    let printed = stdout(&o);
    assert!(printed.contains("w[:,3:6]") && !printed.contains("shardc_") && !printed.contains("location"), "{printed}");
    let run = |m: &str, out: &str| {
        let o = shardc(&["run", &p(m), "--backend", "cpu", "--save-outputs", &p(out)]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p(out)).unwrap()).unwrap();
        v
    };
    let (a, b) = (run("m.onnxtxt", "a.json"), run("out.onnx", "b.json"));
    for name in ["q", "k", "v"] {
        assert!(a.to_string().contains(name));
    }
    assert_eq!(a, b);
    // Without the data file the description stays, and the output says who can read it.
    std::fs::remove_file(dir.join("w.bin")).unwrap();
    let o = shardc(&["parse", &p("m.onnxtxt"), "--passes", "infer-shapes,algebra", "-o", &p("out2.onnx")]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("3 weights split or joined by a rewrite keep shardc's description"), "{}", stderr(&o));
    std::fs::remove_dir_all(&dir).ok();
}

/// `-o` over something that is not a regular file: a FIFO and a character device are written
/// in place and keep their type; a directory is an error; `-o -` is stdout.
#[test]
fn outputs_never_replace_special_files() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tmpdir("special-out");
    let m = golden("tiny_mlp.onnxtxt");
    // A FIFO with a reader: what shardc writes arrives through it.
    let fifo = dir.join("pipe");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    let o = shardc(&["parse", &m, "-o", fifo.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = reader.join().unwrap();
    assert!(got.contains("MatMul") || got.contains("Gemm"), "{got}");
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    assert!(!stderr(&o).contains("replaced"), "{}", stderr(&o));
    // A character device: /dev/null itself (never replaced, even as root), and a node of our
    // own where mknod is permitted.
    let o = shardc(&["parse", &m, "-o", "/dev/null"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device());
    let node = dir.join("null");
    if Command::new("mknod").arg(&node).args(["c", "1", "3"]).status().is_ok_and(|s| s.success()) {
        let o = shardc(&["parse", &m, "-o", node.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(std::fs::symlink_metadata(&node).unwrap().file_type().is_char_device(), "the device was replaced");
    }
    // A directory is an error; nothing is left in it.
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let o = shardc(&["parse", &m, "-o", sub.to_str().unwrap()]);
    assert_refused(&o, "directory", "-o a directory");
    assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 0);
    // `-o -`: standard output, no file named `-`.
    let o = shardc(&["parse", &m, "-o", "-"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("MatMul") || stdout(&o).contains("Gemm"), "{}", stdout(&o));
    assert!(!Path::new(env!("CARGO_MANIFEST_DIR")).join("-").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// `stats` counts the weights inside subgraphs: 6 at the top, 4 and 2 in an `If`'s branches.
#[test]
fn stats_count_the_weights_of_subgraphs() {
    let o = shardc(&["stats", "tests/data/stats/if_branch_weights.onnxtxt", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["params"], 12, "{v}");
    assert_eq!(v["float_params"], 12, "{v}");
    assert_eq!(v["param_bytes"], 48, "{v}");
}

/// A weight whose external data file is absent: `run` and `train` draw it from the seed and
/// say so on stderr; `--require-weights` refuses.
#[test]
fn absent_weights_warn_or_are_refused() {
    let dir = tmpdir("absent-weights");
    let m = dir.join("m.onnxtxt");
    std::fs::write(&m, shardc_tests::external_weight_model("absent.bin", "0")).unwrap();
    let m = m.to_str().unwrap();
    for cmd in
        [vec!["run", m, "--backend", "cpu"], vec!["train", m, "--loss", "mse", "--backend", "cpu", "--steps", "1"]]
    {
        let o = shardc(&cmd);
        assert!(o.status.success(), "{cmd:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("warning: 1 tensors have external data whose file is not there"),
            "{cmd:?}: {}",
            stderr(&o)
        );
        let mut strict = cmd.clone();
        strict.push("--require-weights");
        let o = shardc(&strict);
        assert_refused(&o, "--require-weights", &format!("{cmd:?}"));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `--inputs`: every value read exactly or refused with where it is; NaN and ±Inf are spelled
/// `"nan"`, `"inf"`, `"-inf"` both ways (in --save-outputs too), and Relu keeps a NaN.
#[test]
fn inputs_are_read_exactly_or_refused() {
    let dir = tmpdir("inputs-exact");
    let m = dir.join("m.onnxtxt");
    std::fs::write(
        &m,
        r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[4] x, int64[2] ids) => (float[4] y, int64[2] j) {
   y = Relu (x)
   j = Identity (ids)
}"#,
    )
    .unwrap();
    let run = |ins: &str| {
        let f = dir.join("in.json");
        std::fs::write(&f, ins).unwrap();
        let out = dir.join("out.json");
        std::fs::remove_file(&out).ok();
        let o = shardc(&[
            "run",
            m.to_str().unwrap(),
            "--inputs",
            f.to_str().unwrap(),
            "--backend",
            "cpu",
            "--save-outputs",
            out.to_str().unwrap(),
        ]);
        (o, std::fs::read_to_string(&out).unwrap_or_default())
    };
    let ids = |d: &str| format!(r#""ids": {{"dtype": "int64", "shape": [2], "data": {d}}}"#);
    let x = |d: &str| format!(r#""x": {{"dtype": "float32", "shape": [4], "data": {d}}}"#);
    let (o, out) = run(&format!(r#"{{"inputs": {{{}, {}}}}}"#, x(r#"["nan", "inf", "-inf", -1.5]"#), ids("[3, 5]")));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let y = v["outputs"]["y"]["data"].to_string();
    assert_eq!(y, r#"["nan","inf",0.0,0.0]"#, "{v}");
    for (bad, want) in [
        (ids("[3.7, 5]"), "inputs.ids.data[0]: 3.7 is not an int64"),
        (ids(r#"[1, "5"]"#), r#"inputs.ids.data[1]: "5" is not an int64"#),
        (ids("[1, null]"), "inputs.ids.data[1]: null is not an int64"),
        (ids("[18446744073709551615, 1]"), "inputs.ids.data[0]: 18446744073709551615 is not an int64"),
    ] {
        let (o, _) = run(&format!(r#"{{"inputs": {{{}, {bad}}}}}"#, x("[1, 2, 3, 4]")));
        assert_refused(&o, want, &bad);
    }
    for (bad, want) in [
        (x(r#"[1, "one", 3, 4]"#), r#"inputs.x.data[1]: "one" is not a number"#),
        (x("[1, true, 3, 4]"), "inputs.x.data[1]: true is not a number"),
        (x("[1, 2, 1e39, 4]"), "inputs.x.data[2]: 1e+39 is not a float32"),
    ] {
        let (o, _) = run(&format!(r#"{{"inputs": {{{bad}, {}}}}}"#, ids("[1, 2]")));
        assert_refused(&o, want, &bad);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A run that diverges says so, and where, and fails unless `--allow-divergence`; under
/// `--check` NaN equals NaN and the note says the single-device reference diverged too (not a
/// parallelization bug).
#[test]
fn divergence_is_reported_not_blamed_on_the_plan() {
    let m = golden("tiny_mlp.onnxtxt");
    let args = [
        "train",
        &m,
        "--loss",
        "mse",
        "--optimizer",
        "sgd",
        "--lr",
        "1e12",
        "--steps",
        "6",
        "--devices",
        "2",
        "--backend",
        "cpu",
        "--check",
    ];
    let o = shardc(&args);
    assert_eq!(o.status.code(), Some(1), "{}{}", stdout(&o), stderr(&o));
    assert!(stderr(&o).contains("training diverged:") && stderr(&o).contains("--allow-divergence"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("differs from the expected"), "{}", stderr(&o));
    assert!(stdout(&o).contains("the single-device reference diverged too"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("FAILED"), "{}", stdout(&o));
    let mut go_on = args.to_vec();
    go_on.push("--allow-divergence");
    let o = shardc(&go_on);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("diverged: "), "{}", stdout(&o));
}

/// An output that cannot be written is refused before any work (here a directory where no
/// file can be made, even by root), with nothing printed on stdout.
#[test]
fn unwritable_outputs_are_refused_before_training() {
    let m = golden("tiny_mlp.onnxtxt");
    let o = shardc(&[
        "train",
        &m,
        "--loss",
        "mse",
        "--backend",
        "cpu",
        "--steps",
        "1",
        "--save-state",
        "/proc/shardc-state.json",
    ]);
    assert_refused(&o, "--save-state `/proc/shardc-state.json`: cannot write in `/proc`", "an unwritable --save-state");
    assert!(o.stdout.is_empty(), "{}", stdout(&o));
}

/// HF Llama and Qwen2 from small configs, exported by torch's dynamo exporter at 2×16 tokens
/// (scripts/gen-dynamo-llm.py), whose causal masks and rotary tables are folded into
/// external-data initializers: at a shorter sequence their values are read and cut (the
/// logits equal torch's), at a longer one the rotary table cannot be extended and the change
/// is refused with advice — never run on the bytes of the old shape.
#[test]
fn dynamo_exports_change_sequence_length_correctly_or_refuse() {
    let dir = tmpdir("dynamo-seq");
    for name in ["llama_tiny", "qwen2_tiny"] {
        for seq in [16, 8, 24] {
            let case = format!("tests/data/dynamo/{name}.s{seq}.io.json");
            let doc: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(&case)).unwrap(),
            )
            .unwrap();
            let ins = dir.join("in.json");
            std::fs::write(&ins, serde_json::json!({"inputs": doc["inputs"]}).to_string()).unwrap();
            let out = dir.join("out.json");
            std::fs::remove_file(&out).ok();
            let shape = format!("input_ids=2x{seq}");
            let model = format!("tests/data/dynamo/{name}.onnx");
            let o = shardc(&[
                "run",
                &model,
                "--input-shape",
                &shape,
                "--inputs",
                ins.to_str().unwrap(),
                "--backend",
                "cpu",
                "--devices",
                "1",
                "--check",
                "--save-outputs",
                out.to_str().unwrap(),
            ]);
            if seq > 16 {
                assert_eq!(o.status.code(), Some(1), "{name} at {seq}: {}", stderr(&o));
                assert!(
                    stderr(&o).contains("cannot rebatch constant") && stderr(&o).contains("re-export"),
                    "{}",
                    stderr(&o)
                );
                continue;
            }
            assert!(o.status.success(), "{name} at {seq}: {}", stderr(&o));
            // The check's independent reference: the model as written at its own length.
            if seq < 16 {
                let row = format!("logits (model as written, first {seq} positions)");
                let line = stdout(&o).lines().find(|l| l.contains(&row)).map(str::to_string);
                // `ok`, possibly with why (`ok (within atol: …)`).
                let ok = |l: &String| l.trim_end().ends_with("ok") || l.contains(" ok (within atol");
                assert!(line.as_ref().is_some_and(ok), "{name} at {seq}: {}", stdout(&o));
            }
            let got: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
            let what = format!("{name} at {seq}: logits (torch's)");
            assert_close(&got["outputs"]["logits"], &doc["outputs"]["logits"], (1e-4, 1e-4), &what);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// External data that is not a plain file inside the model's directory is refused, never
/// waited on or followed: a FIFO, a symlink out of the directory; an offset past 64 bits is
/// said as it is.
#[test]
fn external_data_is_a_file_in_the_models_directory() {
    let dir = tmpdir("external-kinds");
    let model = |offset: &str| shardc_tests::external_weight_model("w.bin", offset);
    let m = dir.join("m.onnxtxt");
    std::fs::write(&m, model("0")).unwrap();
    let run = || shardc(&["run", m.to_str().unwrap(), "--backend", "cpu", "--require-weights"]);
    let w = dir.join("w.bin");
    assert!(Command::new("mkfifo").arg(&w).status().unwrap().success());
    let o = run();
    assert_refused(&o, "is not a regular file", "a FIFO as external data");
    std::fs::remove_file(&w).unwrap();
    let outside = std::env::temp_dir().join(format!("shardc-outside-{}.bin", std::process::id()));
    std::fs::write(&outside, vec![0u8; 72]).unwrap();
    std::os::unix::fs::symlink(&outside, &w).unwrap();
    let o = run();
    assert_refused(&o, "outside the model's directory", "a symlink out of the model's folder");
    std::fs::remove_file(&w).unwrap();
    std::fs::remove_file(&outside).ok();
    std::fs::write(&w, vec![0u8; 72]).unwrap();
    assert!(run().status.success());
    std::fs::write(&m, model("18446744073709551615")).unwrap();
    let o = run();
    assert_refused(&o, "`offset` 18446744073709551615 and `length` 72 overflow 64 bits", "a wrapping offset");
    std::fs::remove_dir_all(&dir).ok();
}

/// `run --check` on a re-shaped model also checks against the model as written: at a batch
/// that is a multiple of the exported one, the written model runs batch by batch on the same
/// inputs; at another sequence length of a causal model, on the positions both lengths share;
/// where neither can be (an image's height and width changed), the check says its reference
/// is the re-shaped model instead of claiming more.
#[test]
fn checks_of_reshaped_models_use_the_model_as_written() {
    let m = golden("tiny_gpt.onnxtxt");
    let o = shardc(&["run", &m, "--batch", "6", "--backend", "cpu", "--devices", "2", "--check", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let checks = v["check"].as_array().unwrap();
    assert!(checks.iter().any(|c| c["output"] == "logits (model as written)" && c["ok"] == true), "{v}");
    let o = shardc(&[
        "run",
        &m,
        "--input-shape",
        "input_ids=2x4",
        "--backend",
        "cpu",
        "--devices",
        "2",
        "--check",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A shorter sequence of a causal model: the model as written at its own length, on the
    // positions both share (its later positions probed for no effect on them).
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let checks = v["check"].as_array().unwrap();
    assert!(
        checks.iter().any(|c| c["output"] == "logits (model as written, first 4 positions)" && c["ok"] == true),
        "{v}"
    );
    // An image's height and width: no reference from the model as written, and the check says so.
    let m = golden("tiny_resnet.onnxtxt");
    let o = shardc(&["run", &m, "--input-shape", "input=2x3x8x8", "--backend", "cpu", "--check", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["notes"].to_string().contains("no reference from the model as written"), "{v}");
    assert!(!v["check"].to_string().contains("model as written"), "{v}");
}

/// docs/cli-reference.md is every subcommand's `--help`, as the program prints it: it cannot
/// drift from the flags. After a change to the command line, re-bless it with
/// `BLESS=1 cargo test --test cli the_cli_reference_is_current`.
#[test]
fn the_cli_reference_is_current() {
    let help = |args: &[&str]| {
        let o = shardc(args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        stdout(&o)
    };
    let top = help(&["--help"]);
    let mut doc = String::from(
        "# CLI reference\n\nEvery subcommand's `--help`, generated from the program (`BLESS=1 cargo test --test cli \
         the_cli_reference_is_current` writes it; the test fails when it is stale). What the commands do and how \
         they fit together is in the [user guide](user-guide.md).\n\n## shardc\n\n```text\n",
    );
    doc.push_str(&top);
    doc.push_str("```\n");
    // The subcommands, as the top-level help lists them.
    let subs: Vec<String> = top
        .split("Commands:")
        .nth(1)
        .unwrap_or_default()
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|s| s != "help")
        .collect();
    assert!(subs.len() >= 8, "{subs:?}");
    for s in &subs {
        doc.push_str(&format!("\n## shardc {s}\n\n```text\n{}```\n", help(&[s, "--help"])));
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/cli-reference.md");
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &doc).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == doc,
        "docs/cli-reference.md is stale: re-bless with BLESS=1 cargo test --test cli the_cli_reference_is_current"
    );
}

/// Three GRUs of one layout-0 input `[sequence, batch, features]` (forward with initial_h,
/// bidirectional with linear_before_reset, reverse without bias), against onnxruntime's
/// outputs: the search pipelined it in 5 micro-batches cut along dim 0 — the sequence — and
/// every output was off by up to 1.24. Rebatching now refuses a batch that reaches a
/// recurrent layer's sequence, so a requested pipeline runs whole batches and says why.
#[test]
fn recurrent_sequences_are_never_cut_as_batches() {
    let case = "tests/data/recurrent/three_grus";
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let io: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join(format!("{case}.io.json"))).unwrap()).unwrap();
    let dir = tmpdir("three-grus");
    let out = dir.join("out.json");
    for extra in [&["--devices", "4"][..], &["--devices", "2", "--pipeline", "2"][..]] {
        let mut args =
            vec!["run", "tests/data/recurrent/three_grus.onnx", "--inputs", "tests/data/recurrent/three_grus.io.json"];
        args.extend_from_slice(&["--backend", "cpu", "--save-outputs", out.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let o = shardc(&args);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        if extra.contains(&"--pipeline") {
            assert!(
                stdout(&o).contains("one whole batch at a time") && stdout(&o).contains("its sequence"),
                "{}",
                stdout(&o)
            );
        }
        let got: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        for (name, want) in io["outputs"].as_object().unwrap() {
            assert_close(&got["outputs"][name], want, (1e-4, 1e-5), &format!("{extra:?} {name} (onnxruntime's)"));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// SIGINT or SIGTERM in the middle of writing `-o FILE` (held half-written by the tests'
/// pause) removes the partial temporary file, says so, ends as the signal ends a process,
/// and leaves the file that was there as it was.
#[cfg(unix)]
#[test]
fn an_interrupted_write_removes_its_partial_file_and_says_so() {
    use std::os::unix::process::ExitStatusExt;
    for (signal, number) in [("INT", 2), ("TERM", 15)] {
        let dir = tmpdir(&format!("signal-{signal}"));
        let out = dir.join("out.onnxtxt");
        std::fs::write(&out, "the previous contents\n").unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_shardc"))
            .args(["parse", &model("tv_alexnet.onnxtxt"), "-o"])
            .arg(&out)
            .env("SHARDC_TEST_PAUSE_WRITE_MS", "20000")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let tmp = dir.join(format!(".out.onnxtxt.shardc-{}.tmp", child.id()));
        let start = std::time::Instant::now();
        while !tmp.exists() {
            assert!(start.elapsed().as_secs() < 60, "the temporary file never appeared");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let killed = Command::new("kill").args([format!("-{signal}"), child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.signal(), Some(number), "{signal}: {:?}", o.status);
        assert!(start.elapsed().as_secs() < 15, "{signal}: the process waited out the pause");
        assert!(stderr(&o).contains("the partial file was removed"), "{signal}: {}", stderr(&o));
        assert!(!tmp.exists(), "{signal}: {} is left", tmp.display());
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "the previous contents\n");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 1, "{signal}: {left:?}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// `train --plan` of a pipelined plan prices the stages again: the figures a plan file says
/// (edited here) are not what it predicts, and the edit changes nothing.
#[test]
fn train_prices_a_pipelined_plan_file_again() {
    let dir = tmpdir("reprice");
    let plan = two_stage_plan(&dir, 2);
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    doc["memory_per_device_bytes"] = 12345.into();
    doc["step_time_s"] = 99.0.into();
    let edited = dir.join("edited.json");
    std::fs::write(&edited, serde_json::to_vec(&doc).unwrap()).unwrap();
    let predicted = |p: &Path| {
        let o = shardc(&[
            "train",
            &golden("tiny_gpt.onnxtxt"),
            "--plan",
            p.to_str().unwrap(),
            "--loss",
            "softmax-cross-entropy",
            "--steps",
            "1",
            "--backend",
            "cpu",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["memory_predicted_bytes"].as_u64().unwrap(), v["predicted"].clone(), v["notes"].clone())
    };
    let (memory, step, notes) = predicted(&plan);
    assert!(memory > 12345, "{memory}");
    assert!(!notes.to_string().contains("could not be priced"), "{notes}");
    let (memory_edited, step_edited, _) = predicted(&edited);
    assert_eq!((memory_edited, step_edited), (memory, step));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cost_prices_and_exports_a_configuration() {
    let dir = std::env::temp_dir().join(format!("shardc-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = dir.join("gpt.onnxtxt");
    let gpt = shardc::synthetic::Gpt { layers: 2, hidden: 64, heads: 4, batch: 8, seq: 32, fused_gelu: true, vocab: 0 };
    std::fs::write(&m, gpt.to_text()).unwrap();
    let m = m.to_str().unwrap();
    let config = "tp=2,dp=2,sp,recompute=selective,zero=1";
    let base = ["cost", m, "--cluster", "dgx-a100", "--devices", "4", "--precision", "bf16", "--strategy", config];
    let o = shardc(&[&base[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in ["parameters", "gradients", "optimizer_state", "activations", "other"] {
        assert!(doc["memory_breakdown"][k].as_f64().is_some_and(|x| x >= 0.0), "{k}: {}", doc["memory_breakdown"]);
    }
    assert_eq!(doc["summary"]["memory"], "recompute=selective,sp,zero=1");
    let o = shardc(&[&base[..], &["--export", "megatron"]].concat());
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    for want in [
        "--tensor-model-parallel-size 2",
        "--sequence-parallel",
        "--recompute-granularity selective",
        "--use-distributed-optimizer",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    let o = shardc(&[&base[..], &["--export", "deepspeed"]].concat());
    let ds: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ds["zero_optimization"]["stage"], 1);
    // torchtitan's op-level policy, which Megatron-LM has not: its layers recomputed whole,
    // said.
    let op = ["cost", m, "--cluster", "dgx-a100", "--devices", "4", "--strategy", "tp=2,dp=2,recompute=op"];
    let o = shardc(&[&op[..], &["--export", "megatron"]].concat());
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(text.contains("--recompute-granularity full") && text.contains("op-level policy"), "{text}");
    // A pipeline of tensor-parallel stages, interleaved: priced, reported and exported.
    let pipe = ["cost", m, "--cluster", "dgx-a100", "--devices", "4", "--precision", "bf16", "--strategy"];
    let o = shardc(&[&pipe[..], &["tp=2,pp=2,vp=2,mbs=1", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["stages"].as_array().map(Vec::len), Some(2), "{doc}");
    assert_eq!(doc["schedule"], "interleaved:2");
    assert_eq!(doc["summary"]["text"], "pipeline 2 × 8 micro-batches (interleaved:2); stage 0: tensor 2");
    assert!(doc["communication_by_kind"]["p2p"].as_f64().is_some_and(|t| t > 0.0), "{doc}");
    let o = shardc(&[&pipe[..], &["tp=2,pp=2,vp=2,mbs=1", "--export", "megatron"]].concat());
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    for want in [
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
        "--num-virtual-stages-per-pipeline-rank 2",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    // Flash attention: the same configuration with each attention one op keeps fewer
    // activations, and the Megatron arguments ask for the fused kernel.
    let activations = |config: &str| {
        let o = shardc(&[&pipe[..8], &["--strategy", config, "--json"]].concat());
        assert!(o.status.success(), "{config}: {}", stderr(&o));
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        doc["memory_breakdown"]["activations"].as_f64().unwrap()
    };
    assert!(activations("tp=2,dp=2,flash") < activations("tp=2,dp=2"));
    let o = shardc(&[&pipe[..8], &["--strategy", "tp=2,dp=2,flash", "--export", "megatron"]].concat());
    assert!(String::from_utf8_lossy(&o.stdout).contains("--attention-backend flash"), "{}", stderr(&o));
    let o = shardc(&["cost", &model("tv_alexnet.onnxtxt"), "--cluster", "dgx-a100", "--strategy", "dp=8,flash"]);
    assert!(!o.status.success() && stderr(&o).contains("no attention"), "{}", stderr(&o));
    // Degrees that do not multiply to the devices, and fields the cost model does not price.
    for (bad, want) in [("tp=2,dp=4", "8 devices"), ("cp=2", "fuse-attention"), ("zero=5", "0, 1, 2 or 3")] {
        let o = shardc(&["cost", m, "--cluster", "dgx-a100", "--devices", "4", "--strategy", bad]);
        assert!(!o.status.success() && stderr(&o).contains(want), "{bad}: {}", stderr(&o));
    }
}
