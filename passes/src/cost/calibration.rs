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

/// The convolution gradients' rate against the convolution's, measured by `shardc calibrate`
/// on the development machine on 2026-11-26 (79% and 100% in two runs; a ratio of two kernels' rates on one machine, so
/// it outlives that day's absolute speed).
pub const CONV_GRAD_EFFICIENCY: f64 = 0.9;

/// The fraction of the memory bandwidth a transpose of the innermost dim reaches, measured by
/// `shardc calibrate` on the development machine on 2026-11-26 (a 2048×2048 transpose: 81.5
/// ms for 32 MB moved against an Add of the same size moving 48 MB in 28.9 ms: 0.24; against
/// a Relu of the same tensor: 0.66, 0.83, 0.43, 0.26 of its rate at 256², 512², 1024² and
/// 2048² floats, so up to 1 MB the strided side stays in cache).
pub const TRANSPOSE_EFFICIENCY: f64 = 0.24;

/// The extra fraction of a dispatch each further simulated device adds, measured by
/// `shardc calibrate` on the development machine on 2026-11-26 (empty dispatches: 124 µs
/// from one device, 153–162 µs each from two at once, 158–192 µs from four; a ratio of
/// one machine's times, like [`CONV_GRAD_EFFICIENCY`]).
pub const LAUNCH_CONTENTION: f64 = 0.16;

/// The in-process transport's ring (threads passing host buffers), measured by `shardc
/// calibrate --rounds 3` on the development machine on 2026-11-26: all-reduces of 1 KB,
/// 16 KB, 256 KB and 1 MB between two idle threads in 59 µs, 88 µs, 0.56 ms and 2.1 ms,
/// fitted α 25.2 µs per ring step (and β 0.51 GB/s at those sizes).
pub const RING_LATENCY: f64 = 25.2e-6;
/// The ring's bandwidth at the sizes of a training step's large gradients, measured by
/// `cargo bench --bench train`'s calibration (`shardc calibrate --rounds 3`'s) on the
/// development machine on 2026-11-26: 0.22 GB/s fitted to all-reduces of 16 MB and 64 MB
/// between two threads (by hand: 61.8 ms and 327 ms; 1 MB took 3.85 ms, 4 MB 12.4 ms) — tensors
/// that stream through memory, not cache.
pub const RING_BANDWIDTH: f64 = 0.22e9;
/// The ring's bandwidth by the all-reduced tensor's size as multiples of [`RING_BANDWIDTH`]
/// ([`super::cluster::BySize`]), measured by `shardc calibrate --rounds 3` on the development
/// machine on 2026-11-27 (two runs, their mean): all-reduces between two threads of 256 KB,
/// 1 MB, 4 MB, 16 MB and 64 MB at 0.37, 0.38, 0.59, 0.38 and 0.21 GB/s once the steps' α is
/// taken off — up to a few MB the buffers stay in the caches.
pub const RING_BY_SIZE: &[(f64, f64)] =
    &[(262144.0, 1.68), (1048576.0, 1.73), (4194304.0, 2.68), (16777216.0, 1.70), (67108864.0, 0.93)];

/// The device → host → device copies' bandwidth by size as multiples of [`CALIBRATED`]'s
/// `copy_bandwidth` (the same runs as [`RING_BY_SIZE`]): round trips of 256 KB, 1 MB, 4 MB,
/// 16 MB and 64 MB at 0.98, 1.14, 1.09, 0.51 and 0.28 GB/s of the tensor's bytes once the
/// fixed cost is taken off.
pub const COPY_BY_SIZE: &[(f64, f64)] =
    &[(262144.0, 1.74), (1048576.0, 2.04), (4194304.0, 1.95), (16777216.0, 0.90), (67108864.0, 0.49)];

/// The same run: two Relus (256K and 1024 floats) per step on 4 devices at once took 3.34
/// ms, and 4.36 ms with an all-reduce of the small one's output through the host: with the
/// copies taken off, each of its 6 ring steps took 3.58 times as long as between idle
/// threads; the 2 devices beyond the machine's 2 cores add 2.58 times α each.
pub const RING_CONTENTION: f64 = 2.58;

/// Invocations that fill the simulated device, measured by `shardc calibrate --rounds 3` on
/// the development machine on 2026-11-26 (the run of [`KERNEL_FACTORS`]): reductions of 2M
/// floats to 1, 4, 16, 64, 256 … 16384 outputs (one invocation per output looping over its
/// run) took 23.7, 24.0, 24.8, 4.5 ms and then 2.3–2.5 ms; 64 is the least count within twice
/// the flat time (another run's was 256: the knee lies between). Below it the time grows as
/// the outputs shrink, up to [`SERIAL_SLOWDOWN`].
pub const PARALLEL_WIDTH: f64 = 64.0;
/// See [`PARALLEL_WIDTH`]: one output took 9.6 times as long as the flat time.
pub const SERIAL_SLOWDOWN: f64 = 9.6;

/// Per op type, the runtime's kernels in a training step against their roofline price,
/// measured by `shardc calibrate --rounds 3` on the development machine on 2026-11-26 (with
/// [`CALIBRATED`]'s GEMM rate and memory bandwidth from the same run). The pooling gradient's
/// gather kernel rescans every window per tap; the reductions loop serially per output (a
/// bias gradient has few outputs); the normalizations and softmax loop per row.
pub const KERNEL_FACTORS: &[(&str, f64)] = &[
    ("Add", 1.87),
    ("Conv", 1.12),
    ("ConvGradInput", 1.08),
    ("ConvGradWeight", 1.22),
    ("Div", 1.64),
    ("ElementwiseGrad", 0.88),
    ("Erf", 1.83),
    ("LayerNormalization", 4.4),
    ("MatMul", 0.96),
    ("MaxPool", 1.71),
    ("MaxPoolGrad", 15.69),
    ("Mul", 1.45),
    ("ReduceMean", 1.45),
    ("ReduceSum", 5.38),
    ("Relu", 1.55),
    ("Softmax", 1.85),
    ("SoftmaxGrad", 1.49),
    ("Sub", 1.38),
    ("Sum", 1.31),
    ("Transpose", 2.26),
];

/// A GEMM tile's fixed work as extra reduction length, measured by `shardc calibrate` on the
/// development machine on 2026-11-26 (MatMuls 512×K·K×512 for K = 16, 32, 64, 128, the line
/// through their times: 8.1 and 8.2 in two runs; by hand 4.81 GFLOP/s at K = 512 and 3.21,
/// 3.92, 4.39 at K = 16, 32, 64, each about `K/(K + 7.5)` of the peak); a ratio of one
/// kernel's rates, like [`CONV_GRAD_EFFICIENCY`].
pub const GEMM_K_OVERHEAD: f64 = 8.0;

/// Values from calibration runs on the development machine (`shardc calibrate`, 2 cores,
/// lavapipe). GEMM and memory from the run of [`KERNEL_FACTORS`] (MatMul 512³ 56.2 ms, 4M-float
/// Add 14.0 ms), the convolution's rates and the dispatch from an earlier one (Conv 3×3
/// 8×64×16×16 33.1 ms, 4-float Relu 0.100 ms); the copies from the run of [`RING_LATENCY`]
/// (device → host → device round trips of 4100, 16K and 4M floats in 0.104, 0.145 and 29.9 ms:
/// 0.56 GB/s and 75 µs past the bytes). The preset `local-wgpu` is these with
/// [`KERNEL_FACTORS`].
pub const CALIBRATED: Calibration = Calibration {
    gemm_flops: 4.79e9,
    gemm_k_overhead: GEMM_K_OVERHEAD,
    efficiency: 0.9,
    conv_grad_efficiency: CONV_GRAD_EFFICIENCY,
    transpose_efficiency: TRANSPOSE_EFFICIENCY,
    transpose_cached_bytes: 1.0e6,
    mem_bandwidth: 3.62e9,
    launch: 100e-6,
    copy_bandwidth: 0.56e9,
    copy_latency: 75e-6,
    copy_by_size: Vec::new(),
    ring_latency: RING_LATENCY,
    ring_bandwidth: RING_BANDWIDTH,
    ring_by_size: Vec::new(),
    ring_contention: RING_CONTENTION,
    host_cores: 2,
    launch_contention: LAUNCH_CONTENTION,
    // Not measured in these runs: devices share the host in proportion to their count.
    host_use: 1.0,
    kernel_factors: Vec::new(),
    parallel_width: PARALLEL_WIDTH,
    serial_slowdown: SERIAL_SLOWDOWN,
    // The wgpu runtime fuses element-wise chains (since 2026-12-06).
    fused_elementwise: true,
};
