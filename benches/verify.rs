//! `shardc verify` at the sizes people train: Llama 3 graphs from the project's synthetic
//! generator (weights absent, Adam), each 3-D plan built and proved end to end by the release
//! binary, as a user runs it. Per case: the command's wall time, the proof's own time (what
//! `verified: …` reports), the values proved and the peak memory of the process.
//!
//! Run with `cargo bench --bench verify`. By default the 8B case on 64 devices and the 70B
//! case on 512; `SHARDC_BENCH_FULL=1` adds Llama-3-70B on 4,096 devices (about six minutes
//! and 19 GB here); `SHARDC_BENCH_ONLY=NAME[,NAME]` runs the named cases.

use std::process::Command;
use std::time::Instant;

struct Case {
    name: &'static str,
    size: &'static str,
    batch: usize,
    strategy: &'static str,
    devices: usize,
    cluster: &'static str,
    full_only: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "llama3-8b-64",
        size: "8b",
        batch: 64,
        strategy: "tp=8,pp=2,dp=4",
        devices: 64,
        cluster: "h100-cluster-8",
        full_only: false,
    },
    Case {
        name: "llama3-70b-512",
        size: "70b",
        batch: 64,
        strategy: "tp=8,pp=8,dp=8",
        devices: 512,
        cluster: "h100-cluster-64",
        full_only: false,
    },
    Case {
        name: "llama3-70b-4096",
        size: "70b",
        batch: 64,
        strategy: "tp=8,pp=8,dp=64",
        devices: 4096,
        cluster: "a100-cluster-512",
        full_only: true,
    },
];

/// Runs `cmd` (its stdout and stderr into files in `dir`), returning whether it succeeded,
/// what it wrote to each, and its peak resident memory (KiB).
fn run_measured(cmd: &mut Command, dir: &std::path::Path) -> (bool, String, String, i64) {
    let (o, e) = (dir.join("stdout"), dir.join("stderr"));
    cmd.stdout(std::fs::File::create(&o).expect("file")).stderr(std::fs::File::create(&e).expect("file"));
    // Reaped by `wait4` below, which reports the child's own peak memory.
    #[allow(clippy::zombie_processes)]
    let child = cmd.spawn().expect("runs");
    // SAFETY: `wait4` reaps this child (never waited for otherwise) and writes into the
    // zeroed status and usage it is given.
    let (status, peak) = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        let mut status = 0;
        libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut u);
        (status, u.ru_maxrss)
    };
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    (libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, read(&o), read(&e), peak)
}

fn main() {
    let only: Option<Vec<String>> =
        std::env::var("SHARDC_BENCH_ONLY").ok().map(|s| s.split(',').map(str::to_string).collect());
    let full = std::env::var("SHARDC_BENCH_FULL").is_ok_and(|v| v == "1");
    let dir = std::env::temp_dir().join(format!("shardc-bench-verify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    println!("case               devices  command s  proof s  values      peak GB");
    for c in CASES {
        let wanted = match &only {
            Some(names) => names.iter().any(|n| n == c.name),
            None => full || !c.full_only,
        };
        if !wanted {
            continue;
        }
        let l = match c.size {
            "8b" => shardc::synthetic::Llama::llama3_8b(c.batch, 4096),
            _ => shardc::synthetic::Llama::llama3_70b(c.batch, 4096),
        };
        let path = dir.join(format!("{}.onnxtxt", c.name));
        std::fs::write(&path, l.to_text()).expect("model written");
        let devices = c.devices.to_string();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_shardc"));
        cmd.args(["verify", path.to_str().expect("utf-8"), "--strategy", c.strategy, "--devices", &devices]);
        cmd.args(["--cluster", c.cluster, "--loss", "mean", "--optimizer", "adam", "--lr", "0.001", "-q"]);
        let t0 = Instant::now();
        let (ok, stdout, stderr, peak_kib) = run_measured(&mut cmd, &dir);
        let wall = t0.elapsed().as_secs_f64();
        let Some(line) = stdout.lines().find(|l| l.starts_with("verified: ")).filter(|_| ok) else {
            println!("{:<18} {:>7}  failed: {}", c.name, c.devices, stderr.trim());
            continue;
        };
        // "verified: N values on D devices compute … results (T s)"
        let values = line.split_whitespace().nth(1).unwrap_or("?");
        let proof = line.rsplit('(').next().and_then(|s| s.split_whitespace().next()).unwrap_or("?");
        println!(
            "{:<18} {:>7}  {:>9.1}  {:>7}  {:<10}  {:>7.2}",
            c.name,
            c.devices,
            wall,
            proof,
            values,
            peak_kib as f64 / (1024.0 * 1024.0)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
