//! The `local-wgpu` preset: the runtime's simulated accelerators on this machine.
//!
//! Each simulated device is a wgpu device on Mesa's lavapipe (a software Vulkan driver running
//! compute shaders on the CPU); collectives move data through host staging buffers. The
//! numbers below come from `shardc calibrate`, which times the runtime's own GEMM kernel, a
//! memory-bound copy kernel, an empty dispatch, and buffer round trips between devices, and
//! prints a cluster file; redo them on another machine with
//! `shardc calibrate > local.toml` and pass `--cluster local.toml`.

use super::cluster::{Cluster, Device, HostLink, Link, PeakFlops, Topology};

/// The preset, from a calibration run on the development machine (2 cores, lavapipe).
pub fn local_wgpu_preset() -> Cluster {
    Cluster {
        name: "local-wgpu".into(),
        source: "shardc calibrate on the development machine (Mesa lavapipe, 2 cores)".into(),
        nodes: 1,
        devices_per_node: 8,
        device: Device {
            name: "wgpu-lavapipe".into(),
            peak_flops: PeakFlops { fp32: CALIBRATED.gemm_flops, tf32: None, fp16: None },
            efficiency: 1.0,
            mem_bandwidth: CALIBRATED.mem_bandwidth,
            mem_capacity: 2.0e9,
            mem_usable: 0.9,
            launch_overhead: CALIBRATED.launch,
        },
        intra: Link {
            bandwidth: CALIBRATED.copy_bandwidth,
            latency: CALIBRATED.copy_latency,
            topology: Topology::Switch,
            shared_by: 1,
        },
        inter: None,
        nics_per_node: 1,
        host: HostLink { bandwidth: CALIBRATED.copy_bandwidth, latency: CALIBRATED.copy_latency, shared_by: 1 },
    }
}

/// Measured constants.
pub struct Calibration {
    /// GEMM FLOP/s of one simulated device (the runtime's tiled kernel, large square GEMM).
    pub gemm_flops: f64,
    /// Bytes/s of a memory-bound kernel.
    pub mem_bandwidth: f64,
    /// Seconds per kernel dispatch.
    pub launch: f64,
    /// Bytes/s of a device→host→device transfer.
    pub copy_bandwidth: f64,
    /// Seconds of fixed cost per transfer.
    pub copy_latency: f64,
}

/// Values from the last calibration run on the development machine.
pub const CALIBRATED: Calibration =
    Calibration { gemm_flops: 2.0e9, mem_bandwidth: 2.0e9, launch: 50e-6, copy_bandwidth: 1.0e9, copy_latency: 100e-6 };
