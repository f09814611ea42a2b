//! Parse + verify + shape inference time, side by side with the reference parser: onnx's C++
//! `onnx.parser.parse_model` (and `onnx.shape_inference.infer_shapes` after it) on the same
//! text, run in the same process tree, in the same bench run. Models: the largest bundled
//! ones and synthetic chains of 6,000 and 20,000 nodes. Target (DESIGN.md): under 0.2 s for
//! 6,000 nodes; parity with `parse_model` (issue #14).
//!
//! Run with `cargo bench --bench parse`. Prints medians (and min/max) of repeated runs in CPU
//! milliseconds of this thread (wall time on a shared machine is noisier). The reference
//! column needs a Python with `onnx`: `SHARDC_PYTHON`, else `target/onnx-venv/bin/python`
//! (made by `.ci/run`), else `python3`; without one it says so and prints shardc's alone.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc_timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through the pointer it is given.
    unsafe { clock_gettime(3, &mut ts) }; // CLOCK_THREAD_CPUTIME_ID
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[repr(C)]
struct libc_timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

unsafe extern "C" {
    fn clock_gettime(clock: i32, ts: *mut libc_timespec) -> i32;
}

/// Median, min and max of `runs` runs of `f`, in CPU milliseconds.
fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, f64, f64) {
    let mut v: Vec<f64> = (0..runs)
        .map(|_| {
            let t = thread_cpu();
            std::hint::black_box(f());
            (thread_cpu() - t).as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[runs / 2], v[0], v[runs - 1])
}

fn parse_only(text: &str) -> usize {
    shardc::frontend::parse(text).expect("parses").model.graph.node_count()
}

fn pipeline(text: &str) -> usize {
    let parsed = shardc::frontend::parse(text).expect("parses");
    let mut g = parsed.model.graph;
    shardc::ir::verify(&g).expect("verifies");
    shardc::ir::infer::infer_shapes(&mut g, shardc::ir::infer::Mode::Check).expect("infers");
    g.op_count()
}

/// The Python that has `onnx`, if any.
fn python() -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut candidates: Vec<String> = Vec::new();
    if let Ok(p) = std::env::var("SHARDC_PYTHON") {
        candidates.push(p);
    }
    candidates.push(root.join("target/onnx-venv/bin/python").display().to_string());
    candidates.push("python3".into());
    candidates
        .into_iter()
        .find(|p| Command::new(p).args(["-c", "import onnx.parser"]).output().is_ok_and(|o| o.status.success()))
}

const REFERENCE: &str = r#"
import sys, time, onnx, onnx.parser, onnx.shape_inference
text = open(sys.argv[1]).read()
runs = int(sys.argv[2])
def med(f):
    v = []
    for _ in range(runs):
        t = time.thread_time(); f(); v.append((time.thread_time() - t) * 1e3)
    v.sort()
    return v[runs // 2]
m = onnx.parser.parse_model(text)
print(med(lambda: onnx.parser.parse_model(text)), med(lambda: onnx.shape_inference.infer_shapes(onnx.parser.parse_model(text))))
"#;

/// onnx's medians (parse_model; parse_model + infer_shapes) on `text`, in CPU ms.
fn reference(py: &str, text: &str, runs: usize) -> Option<(f64, f64)> {
    let dir = std::env::temp_dir().join(format!("shardc-parse-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let model = dir.join("model.onnxtxt");
    let script = dir.join("reference.py");
    std::fs::File::create(&model).ok()?.write_all(text.as_bytes()).ok()?;
    std::fs::write(&script, REFERENCE).ok()?;
    let out = Command::new(py).arg(&script).arg(&model).arg(runs.to_string()).output().ok()?;
    std::fs::remove_dir_all(&dir).ok();
    if !out.status.success() {
        eprintln!("reference failed: {}", String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
        return None;
    }
    let s = String::from_utf8_lossy(&out.stdout);
    let mut it = s.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some((it.next()??, it.next()??))
}

fn measure(name: &str, text: &str, runs: usize, py: Option<&str>) {
    let nodes = pipeline(text);
    let (p_med, _, _) = time(runs, || parse_only(text));
    let (med, min, max) = time(runs, || pipeline(text));
    let reference = py.and_then(|py| reference(py, text, runs));
    let ref_cols = match reference {
        Some((rp, ri)) => format!(
            "   onnx parse {rp:>8.2}   +infer {ri:>8.2}   ratio parse {:>5.2}×  all {:>5.2}×",
            p_med / rp,
            med / ri
        ),
        None => String::new(),
    };
    println!(
        "{name:<28} {nodes:>6} nodes {:>8.1} KB   shardc parse {p_med:>8.2}   +verify+infer {med:>8.2} (min {min:.2}, max {max:.2}){ref_cols}",
        text.len() as f64 / 1024.0,
    );
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = python();
    println!(
        "parse (+ verify + shape inference): median CPU ms of this thread; ratio = shardc / onnx (< 1: shardc faster)"
    );
    if py.is_none() {
        println!("(no Python with `onnx`: the reference columns are left out; set SHARDC_PYTHON)");
    }
    for name in ["pt_nn_transformer", "hf_bert_base", "ppocrv5_rec", "onnxzoo_light_resnet50", "hf_gpt2_124m"] {
        let text = std::fs::read_to_string(root.join("tests/data/models").join(format!("{name}.onnxtxt")))
            .expect("bundled model");
        measure(name, &text, 21, py.as_deref());
    }
    let text = shardc::synthetic::chain(6000);
    measure("synthetic 6000-node graph", &text, 11, py.as_deref());
    let text = shardc::synthetic::chain(20000);
    measure("synthetic 20000-node graph", &text, 5, py.as_deref());
}
