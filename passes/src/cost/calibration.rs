//! The `local-wgpu` preset: the runtime's simulated accelerators on this machine.
//!
//! Each simulated device is a wgpu device on Mesa's lavapipe (a software Vulkan driver running
//! compute shaders on the CPU); collectives move data through host staging buffers. The
//! numbers below come from `shardc calibrate`, which times the runtime's own GEMM kernel, a
//! memory-bound copy kernel, an empty dispatch, and buffer round trips between devices, and
//! prints a cluster file; redo them on another machine with
//! `shardc calibrate > local.toml` and pass `--cluster local.toml`.

use super::cluster::{Cluster, Device, HostLink, Link, PeakFlops, Topology};

/// A cluster of `devices` simulated accelerators with measured constants `c`.
pub fn local_cluster(c: &Calibration, name: &str, source: &str, devices: usize) -> Cluster {
    Cluster {
        name: name.into(),
        source: source.into(),
        nodes: 1,
        devices_per_node: devices.max(1),
        device: Device {
            name: "wgpu-lavapipe".into(),
            peak_flops: PeakFlops { fp32: c.gemm_flops, tf32: None, fp16: None },
            efficiency: c.efficiency,
            mem_bandwidth: c.mem_bandwidth,
            mem_capacity: 2.0e9,
            mem_usable: 0.9,
            launch_overhead: c.launch,
            shared_host: true,
            // The runtime's GEMM kernel computes 4×4 blocks per invocation in 16×16 workgroups.
            gemm_tile: 16,
            gemm_k_overhead: 4.0,
            conv_grad_efficiency: c.conv_grad_efficiency,
        },
        intra: Link { bandwidth: c.copy_bandwidth, latency: c.copy_latency, topology: Topology::Switch, shared_by: 1 },
        inter: None,
        nics_per_node: 1,
        host: HostLink { bandwidth: c.copy_bandwidth, latency: c.copy_latency, shared_by: 1 },
    }
}

/// Measured constants.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// GEMM FLOP/s of one simulated device (the runtime's tiled kernel, large square GEMM).
    pub gemm_flops: f64,
    /// Fraction of the GEMM rate that convolutions reach.
    pub efficiency: f64,
    /// Fraction of the convolution's rate that its gradient kernels reach.
    pub conv_grad_efficiency: f64,
    /// Bytes/s of a memory-bound kernel.
    pub mem_bandwidth: f64,
    /// Seconds per kernel dispatch.
    pub launch: f64,
    /// Bytes/s of a device→host→device transfer.
    pub copy_bandwidth: f64,
    /// Seconds of fixed cost per transfer.
    pub copy_latency: f64,
}

/// The convolution gradients' rate against the convolution's, measured by `shardc calibrate`
/// on the development machine on 2026-11-26 (79% and 100% in two runs; a ratio of two kernels' rates on one machine, so
/// it outlives that day's absolute speed).
pub const CONV_GRAD_EFFICIENCY: f64 = 0.9;

/// Values from the last calibration run on the development machine (`shardc calibrate`,
/// 2 cores, lavapipe: MatMul 512³ 53.1 ms, Conv 3×3 8×64×16×16 33.1 ms, 4-float Relu
/// 0.100 ms, 4M-float Add 23.1 ms, 16K/4M-float copies 0.161/30.4 ms).
pub const CALIBRATED: Calibration = Calibration {
    gemm_flops: 5.1e9,
    efficiency: 0.9,
    conv_grad_efficiency: CONV_GRAD_EFFICIENCY,
    mem_bandwidth: 2.2e9,
    launch: 100e-6,
    copy_bandwidth: 0.55e9,
    copy_latency: 160e-6,
};
