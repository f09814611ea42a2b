//! The `local-wgpu` preset: the runtime's simulated accelerators on this machine.
//!
//! Each simulated device is a wgpu device on Mesa's lavapipe (a software Vulkan driver running
//! compute shaders on the CPU); collectives move data through host staging buffers. The
//! numbers below come from `shardc calibrate`, which times the runtime's own GEMM kernel, a
//! memory-bound copy kernel, an empty dispatch, and buffer round trips between devices, and
//! prints a cluster file; redo them on another machine with
//! `shardc calibrate > local.toml` and pass `--cluster local.toml`.

use super::cluster::{BySize, Cluster, Device, HostLink, Link, PeakFlops, Topology};

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
            launch_contention: c.launch_contention,
            host_use: c.host_use,
            host_staged: true,
            ring_contention: c.ring_contention,
            host_cores: c.host_cores,
            // The runtime's GEMM kernel computes 4×4 blocks per invocation in 16×16 workgroups.
            gemm_tile: 16,
            gemm_k_overhead: c.gemm_k_overhead,
            sms: 0,
            conv_grad_efficiency: c.conv_grad_efficiency,
            attention_efficiency: [0.0; 2],
            transpose_efficiency: c.transpose_efficiency,
            transpose_cached_bytes: c.transpose_cached_bytes,
            kernel_factors: c.kernel_factors.iter().cloned().collect(),
            parallel_width: c.parallel_width,
            serial_slowdown: c.serial_slowdown,
            in_place_update: false,
            fused_elementwise: c.fused_elementwise,
        },
        // Between the devices: the in-process transport's ring steps between host buffers.
        intra: Link {
            bandwidth: c.ring_bandwidth,
            latency: c.ring_latency,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize(c.ring_by_size.clone()),
        },
        inter: None,
        nics_per_node: 1,
        // One copy each way: a round trip (a download and an upload) took `copy_latency`
        // and moved its bytes twice.
        host: HostLink {
            bandwidth: 2.0 * c.copy_bandwidth,
            latency: c.copy_latency / 2.0,
            shared_by: 1,
            by_size: BySize(c.copy_by_size.clone()),
        },
    }
}

/// Measured constants.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// GEMM FLOP/s of one simulated device (the runtime's tiled kernel, large square GEMM).
    pub gemm_flops: f64,
    /// A GEMM tile's fixed work as extra reduction length
    /// ([`super::cluster::Device::gemm_k_overhead`]).
    pub gemm_k_overhead: f64,
    /// Fraction of the GEMM rate that convolutions reach.
    pub efficiency: f64,
    /// Fraction of the convolution's rate that its gradient kernels reach.
    pub conv_grad_efficiency: f64,
    /// Fraction of the memory bandwidth a transpose of the innermost dim reaches.
    pub transpose_efficiency: f64,
    /// The largest tensor whose transpose streams at full bandwidth, bytes.
    pub transpose_cached_bytes: f64,
    /// Bytes/s of a memory-bound kernel.
    pub mem_bandwidth: f64,
    /// Seconds per kernel dispatch.
    pub launch: f64,
    /// Bytes/s of a device→host→device round trip (a download and an upload of a tensor of
    /// that many bytes).
    pub copy_bandwidth: f64,
    /// Seconds of fixed cost per round trip.
    pub copy_latency: f64,
    /// The copies' bandwidth by size, `(bytes, factor of copy_bandwidth)`
    /// ([`super::cluster::BySize`]).
    pub copy_by_size: Vec<(f64, f64)>,
    /// Seconds per ring step of the in-process transport (threads exchanging host buffers).
    pub ring_latency: f64,
    /// Bytes/s of the in-process transport's ring steps.
    pub ring_bandwidth: f64,
    /// The ring's bandwidth by the all-reduced tensor's size, `(bytes, factor of
    /// ring_bandwidth)` ([`super::cluster::BySize`]).
    pub ring_by_size: Vec<(f64, f64)>,
    /// The extra fraction of `ring_latency` each member of a ring beyond `host_cores` adds
    /// when the devices are busy (their threads wait for cores to wake up).
    pub ring_contention: f64,
    /// The host's cores.
    pub host_cores: usize,
    /// The extra fraction of `launch` each further device dispatching at once adds.
    pub launch_contention: f64,
    /// The fraction of the host one device's kernels keep busy ([`Device::host_use`]).
    pub host_use: f64,
    /// Per op type, its kernels' measured time against their price
    /// ([`super::cluster::Device::kernel_factors`]).
    pub kernel_factors: Vec<(String, f64)>,
    /// Invocations that fill a device ([`super::cluster::Device::parallel_width`]).
    pub parallel_width: f64,
    /// A kernel's slowdown with one invocation.
    pub serial_slowdown: f64,
    /// The executor runs element-wise chains as one kernel ([`Device::fused_elementwise`]).
    pub fused_elementwise: bool,
}

// The constants below come from two runs of `shardc calibrate --rounds 3` on the development
// machine on 2026-12-06 (2 cores, Mesa 25.0.7's lavapipe from Debian 12's backports, as
// `.ci/run` installs it; the runtime's subgroup GEMM and element-wise fusion), each constant
// the mean of the two runs' medians; both runs' values are given where they differ by more
// than a few percent. The previous constants (2026-11-26, Mesa 22.3, the GEMM kernel without
// subgroups at 4.79 GFLOP/s) over-predicted the Mesa 25 runs 2–4×.

/// The convolution gradients' rate against the convolution's (0.746 and 0.760; a ratio of
/// two kernels' rates on one machine, so it outlives that day's absolute speed).
pub const CONV_GRAD_EFFICIENCY: f64 = 0.75;

/// The fraction of the memory bandwidth a transpose of the innermost dim reaches once its
/// tensor is over [`CALIBRATED`]'s `transpose_cached_bytes` (0.89 and 0.84 against a Relu of
/// the same 2048×2048 floats; both runs put the threshold at 16 MB).
pub const TRANSPOSE_EFFICIENCY: f64 = 0.87;

/// The extra fraction of a dispatch each further simulated device adds (empty dispatches:
/// 139 and 155 µs from one device; 0.40 and 0.53 from the times on 2 and 4 at once).
pub const LAUNCH_CONTENTION: f64 = 0.46;

/// The in-process transport's ring (threads passing host buffers): α per ring step fitted to
/// all-reduces of 1 KB to 64 MB between two idle threads (9.2 and 9.9 µs).
pub const RING_LATENCY: f64 = 9.6e-6;
/// The ring's bandwidth over the same all-reduces (1.90 and 1.85 GB/s).
pub const RING_BANDWIDTH: f64 = 1.87e9;
/// The ring's bandwidth by the all-reduced tensor's size as multiples of [`RING_BANDWIDTH`]
/// ([`super::cluster::BySize`]), 256 KB to 64 MB.
pub const RING_BY_SIZE: &[(f64, f64)] =
    &[(262144.0, 1.17), (1048576.0, 1.22), (4194304.0, 1.29), (16777216.0, 1.23), (67108864.0, 0.99)];

/// The device → host → device copies' bandwidth by size as multiples of [`CALIBRATED`]'s
/// `copy_bandwidth`, 256 KB to 64 MB.
pub const COPY_BY_SIZE: &[(f64, f64)] =
    &[(262144.0, 0.99), (1048576.0, 1.12), (4194304.0, 1.09), (16777216.0, 1.0), (67108864.0, 0.73)];

/// Each device communicating beyond the host's cores adds this many times α to a ring step
/// when the devices are busy (two Relus and an all-reduce per step on 2 and 4 devices: 20.5
/// and 13.5 — the noisiest constant here).
pub const RING_CONTENTION: f64 = 17.0;

/// Invocations that fill the simulated device: reductions of 2M floats to 1 … 16384 outputs
/// (one invocation per output looping over its run) took 24 ms down to 16 outputs, 2.7 ms at
/// 64 and 1.4–1.6 ms from 256 on (both runs): 64 is the least count within twice the flat
/// time. Below it the time grows as the outputs shrink, up to [`SERIAL_SLOWDOWN`].
pub const PARALLEL_WIDTH: f64 = 64.0;
/// See [`PARALLEL_WIDTH`]: one output took 16.9 times as long as the flat time.
pub const SERIAL_SLOWDOWN: f64 = 16.9;

/// Per kernel family (op type, or `Fused` for the fused element-wise groups), the runtime's
/// kernels in calibrate's training steps against their roofline price under [`CALIBRATED`]'s
/// GEMM rate and memory bandwidth. The pooling gradient's gather kernel rescans every window
/// per tap; the reductions loop serially per output (a bias gradient has few outputs).
pub const KERNEL_FACTORS: &[(&str, f64)] = &[
    ("Add", 1.33),
    ("Conv", 1.51),
    ("ConvGradInput", 0.93),
    ("ConvGradWeight", 1.66),
    ("ElementwiseGrad", 0.69),
    ("Expand", 2.72),
    ("Fused", 0.71),
    ("Gemm", 0.73),
    ("GlobalAveragePool", 0.25),
    ("LayerNormGrad", 0.86),
    ("LayerNormalization", 0.76),
    ("MatMul", 0.75),
    ("MaxPool", 0.62),
    ("MaxPoolGrad", 5.17),
    ("Mul", 1.5),
    ("ReduceMean", 0.21),
    ("ReduceSum", 1.99),
    ("Relu", 1.43),
    ("SgdUpdate", 0.63),
    ("Softmax", 0.43),
    ("SoftmaxGrad", 0.25),
    ("Sum", 1.07),
    ("Transpose", 1.32),
];

/// A GEMM tile's fixed work as extra reduction length: the line through MatMuls 512×K·K×512
/// for K = 16, 32, 64, 128 (40.4 and 26.6); a ratio of one kernel's rates, like
/// [`CONV_GRAD_EFFICIENCY`].
pub const GEMM_K_OVERHEAD: f64 = 33.5;

/// The two runs' GEMM rate (MatMul 512³ in 10.2 ms both times: 28.6 and 28.3 GFLOP/s with the
/// reduction overhead taken off), the convolution's efficiency against it (0.669, 0.673), the
/// memory bandwidth of a 4M-float Add (1.10 and 1.00 GB/s: 46 and 50 ms; the kernel factors
/// above are relative to it), the dispatch, and the copies (device → host → device round
/// trips: 0.62 GB/s and 48 µs past the bytes). The host's share one device keeps busy measured
/// 1.0 in both runs. The preset `local-wgpu` is these with [`KERNEL_FACTORS`] and the by-size
/// tables.
pub const CALIBRATED: Calibration = Calibration {
    gemm_flops: 28.4e9,
    gemm_k_overhead: GEMM_K_OVERHEAD,
    efficiency: 0.67,
    conv_grad_efficiency: CONV_GRAD_EFFICIENCY,
    transpose_efficiency: TRANSPOSE_EFFICIENCY,
    transpose_cached_bytes: 16.8e6,
    mem_bandwidth: 1.05e9,
    launch: 147e-6,
    copy_bandwidth: 0.617e9,
    copy_latency: 48e-6,
    copy_by_size: Vec::new(),
    ring_latency: RING_LATENCY,
    ring_bandwidth: RING_BANDWIDTH,
    ring_by_size: Vec::new(),
    ring_contention: RING_CONTENTION,
    host_cores: 2,
    launch_contention: LAUNCH_CONTENTION,
    host_use: 1.0,
    kernel_factors: Vec::new(),
    parallel_width: PARALLEL_WIDTH,
    serial_slowdown: SERIAL_SLOWDOWN,
    fused_elementwise: true,
};
