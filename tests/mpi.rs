//! The MPI transport: `mpirun -np 4 shardc train … --transport mpi` trains exactly as the
//! in-process `threads` transport does (losses, step-1 gradients and final parameters equal
//! bit for bit, since the collectives run the same ring algorithms in the same order) for
//! data, tensor, spatial, hybrid, context and pipeline plans, equal to one device under `--check`; a
//! job started with the wrong number of processes and a killed rank end with a clear message
//! and a non-zero exit. Built only with `--features mpi`; `.ci/run` installs Open MPI and
//! sets SHARDC_REQUIRE_MPI=1, without which a machine with no `mpirun` skips.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn mpirun_available() -> bool {
    if Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    assert!(std::env::var_os("SHARDC_REQUIRE_MPI").is_none(), "SHARDC_REQUIRE_MPI is set and there is no mpirun");
    eprintln!("skipped: no mpirun (apt-get install openmpi-bin libopenmpi-dev)");
    false
}

fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string()]);
    c.env("OMPI_MCA_rmaps_base_oversubscribe", "1").current_dir(root());
    c
}

fn shardc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shardc"));
    c.current_dir(root());
    c
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("shardc-mpi-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Trains `case` on 4 devices under `plan` with both transports; the saved states must be
/// identical, and the MPI run passes `--check` against one device.
fn same_under_both(case: &str, plan: &[&str], dir: &Path) {
    let model = format!("tests/data/golden-train/{case}.onnxtxt");
    let data = format!("tests/data/golden-train/{case}.train.json");
    same_under_both_with(case, &[&model[..], "--data", &data], plan, dir);
}

/// [`same_under_both`] for the model and data arguments `model` (`case` names the files).
fn same_under_both_with(case: &str, model: &[&str], plan: &[&str], dir: &Path) {
    let common = [model, &["--backend", "cpu", "--steps", "5", "--devices", "4", "--json"][..]].concat();
    let tag = plan.join("_").replace([':', ','], "-");
    let threads = dir.join(format!("{case}-{tag}-threads.json"));
    let o = shardc().arg("train").args(&common).args(plan).arg("--save-state").arg(&threads).output().unwrap();
    assert!(o.status.success(), "{case} {plan:?} threads: {}", text(&o));
    let viampi = dir.join(format!("{case}-{tag}-mpi.json"));
    let o = mpirun(4)
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .arg("train")
        .args(&common)
        .args(plan)
        .args(["--transport", "mpi", "--check", "--save-state"])
        .arg(&viampi)
        .output()
        .unwrap();
    assert!(o.status.success(), "{case} {plan:?} mpi: {}", text(&o));
    // Rank 0 alone reports: one JSON document.
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{case} {plan:?}: not one JSON document ({e}): {}", text(&o)));
    assert_eq!(doc["devices"].as_array().map(|d| d.len()), Some(4), "{case} {plan:?}");
    assert!(doc["check"].as_array().unwrap().iter().all(|c| c["ok"] == true), "{case} {plan:?}: {}", doc["check"]);
    let a: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&threads).unwrap()).unwrap();
    let b: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&viampi).unwrap()).unwrap();
    assert_eq!(a["losses"], b["losses"], "{case} {plan:?}: losses differ");
    assert_eq!(a["gradients"], b["gradients"], "{case} {plan:?}: gradients differ");
    assert_eq!(a["parameters"], b["parameters"], "{case} {plan:?}: parameters differ");
}

#[test]
fn mpi_training_equals_the_threads_transport_for_every_plan_kind() {
    if !mpirun_available() {
        return;
    }
    let dir = tmp("plans");
    for (case, plan) in [
        ("mlp_xent", &["--strategy", "data"][..]),
        ("tiny_gpt_train", &["--strategy", "megatron"][..]),
        ("cnn_small", &["--strategy", "spatial"][..]),
        ("tiny_gpt_train", &["--strategy", "hybrid:dp:2,tp:2"][..]),
        ("mlp_xent", &["--pipeline", "2"][..]),
    ] {
        same_under_both(case, plan, &dir);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Context parallelism's all-to-alls over MPI: a reduced Llama (attention fused) under
/// data × context and context × tensor on 4 ranks — and ring attention's point-to-point
/// passes under data × ring — trains bit for bit as the threads transport does, and equal to
/// one device.
#[test]
fn mpi_context_parallel_training_equals_the_threads_transport() {
    if !mpirun_available() {
        return;
    }
    let dir = tmp("context");
    let (model, fused) = (dir.join("llama.onnxtxt"), dir.join("llama-fused.onnxtxt"));
    std::fs::write(&model, shardc::synthetic::Llama::reduced(2, 2, 32).to_text()).unwrap();
    let passes = "infer-shapes,canonicalize,fuse-attention";
    let o = shardc().arg("parse").arg(&model).args(["--passes", passes, "-o"]).arg(&fused).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let args = [fused.to_str().unwrap(), "--loss", "mse"];
    for plan in ["context:dp:2", "context:tp:2", "context:ring:dp:2"] {
        same_under_both_with("llama", &args, &["--strategy", plan], &dir);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Expert parallelism over MPI: the all-gather dispatcher and the all-to-all one (its
/// integer expert ids travel too) on 4 ranks train bit for bit as the threads transport does,
/// and equal to one device.
#[test]
fn mpi_expert_parallel_training_equals_the_threads_transport() {
    if !mpirun_available() {
        return;
    }
    let dir = tmp("expert");
    let args = ["tests/data/moe/mixtral_tiny_dynamo.onnx", "--loss", "softmax-cross-entropy"];
    for plan in ["ep=4", "ep=4,ep_comm=a2a,capacity=2"] {
        same_under_both_with("mixtral", &args, &["--strategy", plan], &dir);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The `shardc` processes whose parent is `parent` (from /proc: `pid (comm) state ppid …`).
fn shardc_children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let comm = &stat[open + 1..close];
        let ppid = stat[close + 1..].split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok());
        if comm == "shardc" && ppid == Some(parent) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

#[test]
fn mpi_jobs_fail_clearly() {
    if !mpirun_available() {
        return;
    }
    // Two processes for a four-device plan.
    let o = mpirun(2)
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .args(["train", "tests/data/golden-train/mlp_xent.onnxtxt", "--backend", "cpu", "--devices", "4"])
        .args(["--strategy", "data", "--transport", "mpi"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("mpirun started 2 processes"), "{}", text(&o));
    // A rank killed mid-run ends the job (no hang), non-zero.
    let mut job = mpirun(4)
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .args(["train", "tests/data/golden-train/cnn_small.onnxtxt", "--backend", "cpu", "--devices", "4"])
        .args(["--strategy", "data", "--transport", "mpi", "--steps", "100000", "--comm-timeout", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the ranks to start, then kill one.
    let start = Instant::now();
    let victim = loop {
        let pids = shardc_children(job.id());
        if pids.len() >= 4 {
            break pids[2];
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the ranks did not start");
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_secs(3));
    Command::new("kill").args(["-9", &victim.to_string()]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            job.kill().ok();
            panic!("the job did not end within 90 s of a rank being killed");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = job.wait_with_output().unwrap();
    assert!(!status.success(), "{}", text(&out));
    // A check that fails (tolerance 0 against the float64 reference) fails the job.
    let o = mpirun(4)
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .args(["train", "tests/data/golden-train/mlp_xent.onnxtxt", "--backend", "cpu", "--devices", "4"])
        .args(["--strategy", "data", "--transport", "mpi", "--check", "--rtol", "0", "--atol", "0"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("differs from the expected values beyond the tolerance"), "{}", text(&o));
}

/// `calibrate --transport mpi`: the all-reduce over groups of 2 and all 4 of the job's ranks,
/// with the ring model fitted per group size (rank 0 prints one document).
#[test]
fn mpi_collectives_are_calibrated() {
    if !mpirun_available() {
        return;
    }
    let o = mpirun(4)
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .args(["calibrate", "--transport", "mpi", "--quick", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert_eq!(v["devices"], 4);
    assert_eq!(v["transport"], "mpi");
    assert_eq!(v["samples"].as_array().unwrap().len(), 4);
    assert!(v["alpha_s"].as_f64().unwrap() >= 0.0 && v["beta_bytes_per_s"].as_f64().unwrap() > 0.0, "{v}");
    // Per group size: pairs of ranks, then all four.
    let groups: Vec<u64> =
        v["by_group_size"].as_array().unwrap().iter().map(|g| g["devices"].as_u64().unwrap()).collect();
    assert_eq!(groups, vec![2, 4]);
}

/// `run --transport mpi`: a spatially split ResNet-18 (halo exchanges between ranks) gives the
/// outputs the threads transport gives, bit for bit.
#[test]
fn mpi_run_equals_the_threads_transport() {
    if !mpirun_available() {
        return;
    }
    let dir = tmp("run");
    let common = [
        "run",
        "tests/data/models/tv_resnet18.onnxtxt",
        "--input-shape",
        "input=2x3x32x32",
        "--devices",
        "4",
        "--strategy",
        "spatial",
        "--backend",
        "cpu",
        "--check",
        "--save-outputs",
    ];
    let (a, b) = (dir.join("threads.io.json"), dir.join("mpi.io.json"));
    let o = shardc().args(common).arg(&a).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o =
        mpirun(4).arg(env!("CARGO_BIN_EXE_shardc")).args(common).arg(&b).args(["--transport", "mpi"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("HaloExchange") && text(&o).contains(" ok"), "{}", text(&o));
    let read = |p: &Path| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    assert_eq!(read(&a)["outputs"], read(&b)["outputs"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// `--mpi-all-reduce native`: all-reduces run as MPI_Allreduce on each group's communicator
/// (data-parallel gradients over all four ranks, Megatron's partial sums over pairs); the
/// training still equals one device under `--check`, and the losses equal the ring's within
/// rounding.
#[test]
fn native_mpi_all_reduce_trains_like_one_device() {
    if !mpirun_available() {
        return;
    }
    for (case, plan) in [("mlp_xent", "data"), ("tiny_gpt_train", "hybrid:dp:2,tp:2")] {
        let model = format!("tests/data/golden-train/{case}.onnxtxt");
        let data = format!("tests/data/golden-train/{case}.train.json");
        let run = |extra: &[&str]| {
            let o = mpirun(4)
                .arg(env!("CARGO_BIN_EXE_shardc"))
                .args(["train", &model, "--data", &data, "--backend", "cpu", "--steps", "5", "--devices", "4"])
                .args(["--strategy", plan, "--transport", "mpi", "--check", "--json"])
                .args(extra)
                .output()
                .unwrap();
            assert!(o.status.success(), "{case} {plan} {extra:?}: {}", text(&o));
            serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
        };
        let ring = run(&[]);
        let native = run(&["--mpi-all-reduce", "native"]);
        for (a, b) in ring["losses"].as_array().unwrap().iter().zip(native["losses"].as_array().unwrap()) {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{case} {plan}: {a} vs {b}");
        }
    }
}

/// Pipelines whose stages hold two devices each (data or tensor inside a stage, as the search
/// picks), for a CNN and a transformer, with activations and gradients large enough that MPI
/// sends them only when their receiver takes them (rendezvous): a rank that received only
/// from the rank it waited on deadlocked here, each stage's two devices waiting on each other.
/// They train equal to one device under `--check`.
#[test]
fn mpi_pipelines_with_several_devices_per_stage_train_like_one_device() {
    if !mpirun_available() {
        return;
    }
    for (model, shape) in [
        ("tests/data/golden/tiny_resnet.onnxtxt", "input=8x3x16x16"),
        ("tests/data/golden/tiny_gpt.onnxtxt", "input_ids=16x8"),
    ] {
        let o = mpirun(4)
            .arg(env!("CARGO_BIN_EXE_shardc"))
            .args(["train", model, "--input-shape", shape, "--loss", "softmax-cross-entropy"])
            .args(["--pipeline", "2", "--devices", "4", "--transport", "mpi", "--backend", "cpu"])
            .args(["--steps", "2", "--check", "--comm-timeout", "60"])
            .output()
            .unwrap();
        let out = text(&o);
        assert!(o.status.success(), "{model}: {out}");
        let two = ["data 2", "tensor 2"].iter().any(|k| out.contains(&format!("stage 0: {k}")));
        assert!(out.contains("pipeline 2 ×") && two, "{model}: not two devices per stage: {out}");
        assert_eq!(out.matches(" ok ").count(), 4, "{model}: {out}");
    }
}

/// Rank 0 speaks for the job: a warning (here, weights drawn because their file is absent)
/// is printed once, not once per rank.
#[test]
fn mpi_jobs_warn_once() {
    if !mpirun_available() {
        return;
    }
    let dir = tmp("warn-once");
    let m = dir.join("m.onnxtxt");
    std::fs::write(&m, shardc_tests::external_weight_model("absent.bin", "0")).unwrap();
    let o = mpirun(2)
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .arg("train")
        .arg(&m)
        .args(["--loss", "mse", "--devices", "2", "--transport", "mpi", "--backend", "cpu", "--steps", "1"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert_eq!(out.matches("warning: 1 tensors have external data").count(), 1, "{out}");
    std::fs::remove_dir_all(&dir).ok();
}
