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
    /// Smaller tensors and fewer repetitions (a rough figure in about a second).
    #[arg(long)]
    pub quick: bool,
    /// Print the constants and timings as one JSON document instead of TOML.
    #[arg(long)]
    pub json: bool,
    /// Write to this file instead of stdout.
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
}

pub fn run(args: &CalibrateArgs) -> CliResult {
    guard_outputs(&[("-o", args.output.as_ref())], &[])?;
    let effort = if args.quick { Effort { gemm_n: 256, stream_elems: 1 << 18, reps: 3 } } else { Effort::default() };
    let measured = match args.backend.as_str() {
        #[cfg(feature = "gpu")]
        "wgpu" => calibrate::measure(codegen::runtime::gpu::GpuExecutor::new, effort),
        #[cfg(not(feature = "gpu"))]
        "wgpu" => return Err(CliError::msg("--backend wgpu: this shardc was built without the `gpu` feature")),
        "cpu" => calibrate::measure(|| Ok(codegen::runtime::cpu::CpuExecutor::new()), effort),
        other => return Err(CliError::msg(format!("--backend: `{other}` is not wgpu or cpu"))),
    }
    .map_err(|e| CliError::msg(format!("calibration failed: {e}")))?;
    let (_, toml) = calibrate::cluster_toml(&measured, args.devices);
    let text = if args.json {
        let k = &measured.calibration;
        serde_json::to_string_pretty(&serde_json::json!({
            "adapter": measured.adapter,
            "gemm_flops": k.gemm_flops,
            "efficiency": k.efficiency,
            "mem_bandwidth": k.mem_bandwidth,
            "launch_s": k.launch,
            "copy_bandwidth": k.copy_bandwidth,
            "copy_latency_s": k.copy_latency,
            "samples": measured.samples.iter().map(|s| serde_json::json!({"what": s.what, "median_s": s.median_s, "reps": s.reps})).collect::<Vec<_>>(),
        }))
        .expect("JSON")
    } else {
        toml
    };
    write_output(&text, args.output.as_ref(), std::path::Path::new(""))
}
