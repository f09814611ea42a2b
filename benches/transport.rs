//! The transports' ring all-reduce on this machine, side by side in one run: the in-process
//! `threads` transport and, when shardc is built with `--features mpi` and `mpirun` is
//! installed, the MPI transport over loopback (`mpirun -np 4 shardc calibrate --transport mpi`),
//! each beside the cost model's prediction on the `local-wgpu` cluster.
//!
//! The MPI transport is measured twice: all-reduce as the ring over point-to-point messages
//! (the default) and as MPI_Allreduce (`--mpi-all-reduce native`).
//!
//! Run with `cargo bench --bench transport --features mpi`. Medians of 9 repetitions per size.

use std::process::Command;

use shardc::calibrate::{self, COLLECTIVE_SIZES, CollectiveCalibration};
use shardc::passes::cost::Cluster;

const DEVICES: usize = 4;

fn mpi(native: bool) -> Result<CollectiveCalibration, String> {
    if !cfg!(feature = "mpi") {
        return Err("shardc was built without --features mpi".into());
    }
    let o = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &DEVICES.to_string()])
        .arg(env!("CARGO_BIN_EXE_shardc"))
        .args(["calibrate", "--transport", "mpi", "--json", "--mpi-all-reduce", if native { "native" } else { "ring" }])
        .output()
        .map_err(|e| format!("no mpirun: {e}"))?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
    let timed: Vec<(f64, f64)> = v["samples"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s["bytes"].as_f64()?, s["all_reduce_s"].as_f64()?)))
        .collect();
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    Ok(calibrate::collective_calibration(if native { "mpi-native" } else { "mpi" }, DEVICES, &timed, &cluster))
}

fn main() {
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let threads = calibrate::time_threads(DEVICES, COLLECTIVE_SIZES, 9).expect("threads transport");
    let threads = calibrate::collective_calibration("threads", DEVICES, &threads, &cluster);
    print!("{}", threads.text());
    match (mpi(false), mpi(true)) {
        (Ok(m), Ok(n)) => {
            print!("{}", m.text());
            print!("{}", n.text());
            println!("\n       bytes   threads µs   mpi ring µs   mpi native µs   ring / threads   native / threads");
            for ((t, m), n) in threads.samples.iter().zip(&m.samples).zip(&n.samples) {
                println!(
                    "{:>12.0} {:>12.1} {:>13.1} {:>15.1} {:>16.2} {:>18.2}",
                    t.bytes,
                    t.all_reduce_s * 1e6,
                    m.all_reduce_s * 1e6,
                    n.all_reduce_s * 1e6,
                    m.all_reduce_s / t.all_reduce_s,
                    n.all_reduce_s / t.all_reduce_s
                );
            }
        }
        (Err(e), _) | (_, Err(e)) => println!("mpi: not measured ({})", e.trim()),
    }
}
