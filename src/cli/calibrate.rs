//! `shardc calibrate`: measure the runtime's simulated devices and print a cluster file for
//! `--cluster`.

use std::path::PathBuf;

use clap::Args;
use shardc::calibrate::{self, Effort};

use super::common::*;

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Executor to measure: wgpu (default) or cpu.
    #[arg(long, default_value = "wgpu")]
    pub backend: String,
    /// Devices in the cluster file.
    #[arg(long, default_value_t = 8, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: usize,
    /// Smaller tensors, smaller calibration models and fewer repetitions (a rough figure in a
    /// few seconds).
    #[arg(long)]
    pub quick: bool,
    /// Measure this many times; each constant is the median of the rounds' (steadier on a
    /// busy machine).
    #[arg(long, default_value_t = 1, value_parser = parse_count)]
    pub rounds: usize,
    /// Print the constants and timings as one JSON document instead of TOML.
    #[arg(long)]
    pub json: bool,
    /// Write to this file instead of stdout.
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Measure a transport's all-reduce instead of the devices: `threads` (--devices threads
    /// of this process) or `mpi` (under mpirun, one device per rank), with the ring model's
    /// α and β fitted and the cost model's prediction on --cluster beside each size.
    #[arg(long, value_enum)]
    pub transport: Option<super::transport::TransportKind>,
    /// Under `--transport mpi`: all-reduce, all-gather and reduce-scatter as the runtime's rings
    /// over point-to-point messages (`ring`, results bit-identical to `threads`) or as MPI's own
    /// collectives on each group's communicator (`native`: the library's tuned algorithms,
    /// equal within rounding).
    #[arg(long = "mpi-all-reduce", value_enum, default_value = "ring")]
    pub mpi_all_reduce: super::transport::MpiAllReduce,
    /// The cluster whose links the transport's measurements are compared with.
    #[arg(long, default_value = "local-wgpu")]
    pub cluster: String,
}

pub fn run(args: &CalibrateArgs) -> CliResult {
    guard_outputs(&[("-o", args.output.as_ref())], &[])?;
    if let Some(t) = args.transport {
        return transport(args, t);
    }
    let effort = if args.quick {
        Effort { gemm_n: 256, stream_elems: 1 << 18, reps: 3, rounds: args.rounds }
    } else {
        Effort { rounds: args.rounds, ..Effort::default() }
    };
    let (measured, backend) = match args.backend.as_str() {
        #[cfg(feature = "gpu")]
        "wgpu" => (calibrate::measure(codegen::runtime::gpu::GpuExecutor::new, effort), codegen::Backend::Wgpu),
        #[cfg(not(feature = "gpu"))]
        "wgpu" => return Err(CliError::msg("--backend wgpu: this shardc was built without the `gpu` feature")),
        "cpu" => (calibrate::measure(|| Ok(codegen::runtime::cpu::CpuExecutor::new()), effort), codegen::Backend::Cpu),
        other => return Err(CliError::msg(format!("--backend: `{other}` is not wgpu or cpu"))),
    };
    let mut measured = measured.map_err(|e| CliError::msg(format!("calibration failed: {e}")))?;
    calibrate::add_kernel_factors(&mut measured, backend, effort.rounds.max(1), args.quick)
        .map_err(|e| CliError::msg(format!("calibration failed: {e}")))?;
    let (_, toml) = calibrate::cluster_toml(&measured, args.devices);
    let text = if args.json {
        let k = &measured.calibration;
        serde_json::to_string_pretty(&serde_json::json!({
            "adapter": measured.adapter,
            "gemm_flops": k.gemm_flops,
            "gemm_k_overhead": k.gemm_k_overhead,
            "efficiency": k.efficiency,
            "conv_grad_efficiency": k.conv_grad_efficiency,
            "transpose_efficiency": k.transpose_efficiency,
            "transpose_cached_bytes": k.transpose_cached_bytes,
            "mem_bandwidth": k.mem_bandwidth,
            "launch_s": k.launch,
            "copy_bandwidth": k.copy_bandwidth,
            "copy_latency_s": k.copy_latency,
            "copy_by_size": k.copy_by_size,
            "launch_contention": k.launch_contention,
            "host_use": k.host_use,
            "ring_latency_s": k.ring_latency,
            "ring_bandwidth": k.ring_bandwidth,
            "ring_by_size": k.ring_by_size,
            "ring_contention": k.ring_contention,
            "host_cores": k.host_cores,
            "parallel_width": k.parallel_width,
            "serial_slowdown": k.serial_slowdown,
            "fused_elementwise": k.fused_elementwise,
            "kernel_factors": k.kernel_factors.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
            "samples": measured.samples.iter().map(|s| serde_json::json!({"what": s.what, "median_s": s.median_s, "reps": s.reps})).collect::<Vec<_>>(),
        }))
        .expect("JSON")
    } else {
        toml
    };
    write_output(&text, args.output.as_ref(), std::path::Path::new(""))
}

/// `--transport`: the all-reduce of a transport, fitted and compared with the cost model.
fn transport(args: &CalibrateArgs, kind: super::transport::TransportKind) -> CliResult {
    let cluster = super::cost::load_cluster(&args.cluster)?;
    let reps = if args.quick { 3 } else { 9 };
    let sizes = calibrate::COLLECTIVE_SIZES;
    // Per group size (2, 4, … and all of them), the all-reduce timings.
    let (name, timed) = match kind {
        super::transport::TransportKind::Threads => {
            let mut all = Vec::new();
            for g in calibrate::group_sizes(args.devices) {
                all.push((g, calibrate::time_threads(g, sizes, reps).map_err(CliError::msg)?));
            }
            ("threads", all)
        }
        super::transport::TransportKind::Mpi => {
            let native = args.mpi_all_reduce == super::transport::MpiAllReduce::Native;
            match super::transport::mpi_all_reduce(sizes, reps, native)? {
                Some(t) => (if native { "mpi-native" } else { "mpi" }, t),
                // Ranks other than 0 measured with it and say nothing.
                None => return Ok(()),
            }
        }
    };
    let by_group: Vec<calibrate::CollectiveCalibration> =
        timed.iter().map(|(g, t)| calibrate::collective_calibration(name, *g, t, &cluster)).collect();
    let c = by_group.last().cloned().ok_or_else(|| CliError::msg("nothing was measured"))?;
    // The compared cluster with the transport's fitted link: what the cost model then predicts
    // this transport with (`--cluster that.toml`).
    let mut fitted = cluster.clone();
    fitted.name = format!("{}-{name}", cluster.name);
    fitted.intra.latency = c.alpha_s;
    fitted.intra.bandwidth = c.beta_bytes_per_s;
    // One bandwidth fitted over every size.
    fitted.intra.by_size = Default::default();
    let text = if args.json {
        let mut doc = serde_json::to_value(&c).expect("JSON");
        doc["by_group_size"] = serde_json::to_value(&by_group).expect("JSON");
        serde_json::to_string_pretty(&doc).expect("JSON")
    } else {
        let commented: String =
            by_group.iter().flat_map(|c| c.text().lines().map(|l| format!("# {l}\n")).collect::<Vec<_>>()).collect();
        format!("{commented}\n{}", fitted.to_toml())
    };
    write_output(&text, args.output.as_ref(), std::path::Path::new(""))
}
