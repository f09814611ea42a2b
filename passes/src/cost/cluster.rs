//! Cluster descriptions: devices, their links as a hierarchy (inside a node, across nodes),
//! and the host links that feed input data. A TOML format and built-in presets.

use serde::{Deserialize, Serialize};

use ir::shard::{LinkLevel, Mesh, MeshAxis};

/// Peak FLOP/s of a device per arithmetic precision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeakFlops {
    /// IEEE float32 on the regular cores.
    pub fp32: f64,
    /// TF32 tensor cores, where the device has them.
    #[serde(default)]
    pub tf32: Option<f64>,
    /// FP16 / BF16 tensor cores (mixed precision), where the device has them.
    #[serde(default)]
    pub fp16: Option<f64>,
}

impl PeakFlops {
    /// The peak in `precision` (float32's where the device has no faster units).
    pub fn at(&self, precision: super::model::Precision) -> f64 {
        use super::model::Precision;
        match precision {
            Precision::Fp32 => self.fp32,
            Precision::Tf32 => self.tf32.unwrap_or(self.fp32),
            Precision::Fp16 => self.fp16.unwrap_or(self.fp32),
        }
    }
}

/// One accelerator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// Marketing name.
    pub name: String,
    /// Peak FLOP/s per precision.
    pub peak_flops: PeakFlops,
    /// Fraction of peak that large GEMMs and convolutions reach.
    pub efficiency: f64,
    /// Memory bandwidth, bytes/s.
    pub mem_bandwidth: f64,
    /// Memory capacity, bytes.
    pub mem_capacity: f64,
    /// Fraction of the capacity a training job can use (the rest: runtime, fragmentation).
    #[serde(default = "default_usable")]
    pub mem_usable: f64,
    /// Fixed cost of launching one kernel, seconds.
    pub launch_overhead: f64,
    /// The devices are simulated on one host and share its cores and memory: the FLOP/s and
    /// memory bandwidth above are the host's, divided among the devices a plan uses.
    #[serde(default)]
    pub shared_host: bool,
    /// On such a host, the extra fraction of `launch_overhead` each further device adds to
    /// every launch (dispatches are host work, and the devices' dispatches contend for its
    /// cores): a launch on `D` devices takes `launch_overhead · (1 + launch_contention · (D − 1))`.
    /// Measured by `shardc calibrate` (empty dispatches from 1, 2 and 4 devices at once).
    #[serde(default)]
    pub launch_contention: f64,
    /// On such a host, the fraction of it one device's kernels keep busy: `D` devices running
    /// kernels at once each take `max(1, D · host_use)` times as long as one alone (1: one
    /// device's kernels already fill every core; less where a device leaves cores idle between
    /// and within its dispatches, which other devices then use). Measured by
    /// `shardc calibrate` (a GEMM on 1, 2 and 4 devices at once).
    #[serde(default = "default_one")]
    pub host_use: f64,
    /// The devices have no path to each other but through the host: every collective and
    /// stage-to-stage send copies its operand to the host (`host` link), runs over the
    /// `intra`/`inter` links between host buffers, and copies the result back (the runtime's
    /// simulated devices, and its MPI transport). Each such copy costs the host link's
    /// latency and bandwidth on top of the collective's own α–β time.
    #[serde(default)]
    pub host_staged: bool,
    /// On a shared host, the extra fraction of a ring step's latency each device
    /// communicating at once beyond `host_cores` adds: a step waits for its receiver's thread
    /// to wake up, and the other devices' kernels hold the cores
    /// (`α · (1 + ring_contention · (D − cores))`, `D` the devices of the plan's mesh).
    /// Measured by `shardc calibrate` (kernels and an all-reduce per step on as many devices
    /// as cores and on twice as many).
    #[serde(default)]
    pub ring_contention: f64,
    /// The shared host's cores (0: unknown, no ring contention).
    #[serde(default)]
    pub host_cores: usize,
    /// Output tile of the GEMM kernels (rows = columns): a GEMM computes whole tiles, so an
    /// `M × N` output reaches `M/(⌈M/T⌉T) · N/(⌈N/T⌉T)` of `efficiency` (tile quantization:
    /// skinny or small shards waste the padded part of their last tiles).
    #[serde(default = "default_tile")]
    pub gemm_tile: usize,
    /// The fixed work of a tile (loading, epilogue) as extra reduction length: a GEMM with
    /// reduction `K` reaches `K/(K + gemm_k_overhead)` of `efficiency` (a reduction split
    /// over many devices leaves short, overhead-bound loops).
    #[serde(default = "default_k_overhead")]
    pub gemm_k_overhead: f64,
    /// Streaming multiprocessors (compute units) that run a GEMM's tiles side by side, one
    /// tile each at a time (0: not modelled). A GEMM runs its tiles in waves of this many; the
    /// last wave, part full, takes a whole wave's time (wave quantization, NVIDIA's *Matrix
    /// Multiplication Background User's Guide*), so `t` tiles reach `t / (⌈t/sms⌉·sms)` of
    /// the rate.
    #[serde(default)]
    pub sms: usize,
    /// Fraction of a convolution's rate its gradient kernels (`ConvGradInput`,
    /// `ConvGradWeight`) reach: 1 where they run as fast as the forward convolution (the
    /// vendors' libraries, as far as published), measured by `shardc calibrate` for the
    /// runtime's own kernels.
    #[serde(default = "default_one")]
    pub conv_grad_efficiency: f64,
    /// Fraction of peak a fused attention kernel (`Attention`: flash attention) reaches in
    /// the forward and in the backward pass, with a causal mask's skipped half not counted as
    /// work; 0: the GEMM `efficiency`. From published kernel benchmarks where the presets
    /// have them.
    #[serde(default)]
    pub attention_efficiency: [f64; 2],
    /// Fraction of `mem_bandwidth` a transpose that moves the innermost dim reaches once its
    /// tensor outgrows `transpose_cached_bytes` (its reads or its writes are strided): 1 where
    /// such copies stream like any other, measured by `shardc calibrate` for the runtime's own
    /// kernel.
    #[serde(default = "default_one")]
    pub transpose_efficiency: f64,
    /// The largest tensor, bytes, whose transpose still streams at full bandwidth (its
    /// strided side stays in cache); measured by `shardc calibrate`.
    #[serde(default)]
    pub transpose_cached_bytes: f64,
    /// Per op type, the time its kernels take against the price the model gives them (their
    /// roofline; launches are priced apart, by `launch_overhead`): where a device's kernels for an op reach much less (or more)
    /// of the roofline than the model assumes (a reduction looping serially per output, a
    /// pooling gradient re-scanning every window). Measured by `shardc calibrate`, which
    /// trains two small models of its own and divides each op type's measured time by its
    /// price; an op type not listed is priced at its roofline (factor 1). `Fused` scales the
    /// fused element-wise groups' kernels ([`Device::fused_elementwise`]).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub kernel_factors: std::collections::BTreeMap<String, f64>,
    /// Independent invocations a kernel needs to fill the device (0: not modelled): a kernel
    /// with `p` fewer (a reduction to a few outputs, a loss parallel over samples, a
    /// normalization over a few rows) runs `width / p` times slower, at most
    /// `serial_slowdown` times. Measured by `shardc calibrate` (reductions of one tensor to
    /// 1…32768 outputs).
    #[serde(default)]
    pub parallel_width: f64,
    /// The most a kernel of too few invocations is slowed (its rate with one invocation).
    #[serde(default = "default_one")]
    pub serial_slowdown: f64,
    /// The optimizer updates the weights and its state in place, as the fused optimizers of
    /// the frameworks that train on these devices do (apex and Transformer Engine FusedAdam
    /// in Megatron-LM and DeepSpeed): nothing beside them at the update. Off, the update makes
    /// the next values beside the current ones, as shardc's pipeline runtime does, and a
    /// stage's memory counts them.
    #[serde(default)]
    pub in_place_update: bool,
    /// The executor runs element-wise ops that only each other read as one kernel
    /// ([`ir::fusion`]; the wgpu runtime does): each such group of a training program is
    /// priced as it runs — one launch, its intermediate values neither written nor read back.
    #[serde(default)]
    pub fused_elementwise: bool,
}

fn default_usable() -> f64 {
    0.9
}

fn default_tile() -> usize {
    128
}

fn default_k_overhead() -> f64 {
    32.0
}

fn default_one() -> f64 {
    1.0
}

impl Device {
    /// How many devices share one device's compute and memory bandwidth when `busy` of them
    /// run kernels at once: `busy · host_use` (at least 1) on devices simulated on one host
    /// ([`Device::shared_host`], [`Device::host_use`]), else 1.
    pub fn host_share(&self, busy: usize) -> f64 {
        if self.shared_host { (busy.max(1) as f64 * self.host_use).max(1.0) } else { 1.0 }
    }

    /// How many shares of a host core each device's communication gets when `at_once`
    /// devices communicate: on devices simulated on one host ([`Device::shared_host`]) the
    /// ring's steps and the copies to and from the host are the host's threads copying
    /// memory, measured with a thread per core; beyond `host_cores` devices they share them
    /// (`at_once / host_cores`). 1 elsewhere.
    pub fn comm_share(&self, at_once: usize) -> f64 {
        if self.shared_host && self.host_cores > 0 { (at_once as f64 / self.host_cores as f64).max(1.0) } else { 1.0 }
    }

    /// The fixed cost of one kernel when `busy` devices dispatch at once: the launch overhead,
    /// more on devices simulated on one host the more of them dispatch
    /// ([`Device::launch_contention`]).
    pub fn launch_at(&self, busy: usize) -> f64 {
        let others = if self.shared_host { busy.max(1) as f64 - 1.0 } else { 0.0 };
        self.launch_overhead * (1.0 + self.launch_contention.max(0.0) * others)
    }

    /// The fraction of peak a GEMM (or convolution as a GEMM) with an `m × n` output and
    /// reduction length `k` reaches: `efficiency` × tile quantization on `m` and `n` × wave
    /// quantization over the SMs × the reduction-loop overhead (see [`Device::gemm_tile`],
    /// [`Device::sms`], [`Device::gemm_k_overhead`]).
    pub fn gemm_efficiency(&self, m: f64, n: f64, k: f64) -> f64 {
        self.batched_gemm_efficiency(m, n, k, 1.0)
    }

    /// [`Device::gemm_efficiency`] of `batch` such GEMMs run as one batched kernel: their
    /// tiles fill the waves together. Tiles too few to fill the SMs split their reduction
    /// over more of them (split-K, as cuBLAS and CUTLASS do), in chunks of at least a tile's
    /// width of `k`, each chunk paying the loop overhead.
    pub fn batched_gemm_efficiency(&self, m: f64, n: f64, k: f64, batch: f64) -> f64 {
        let t = self.gemm_tile.max(1) as f64;
        let tiles = |x: f64| if x <= 0.0 { 1.0 } else { (x / t).ceil() };
        let q = |x: f64| if x <= 0.0 { 1.0 } else { x / (tiles(x) * t) };
        let (count, sms) = (tiles(m) * tiles(n) * batch.max(1.0), self.sms as f64);
        let split = if self.sms == 0 || count >= sms || k <= 0.0 {
            1.0
        } else {
            (sms / count).floor().min((k / t).floor()).max(1.0)
        };
        let chunk = k / split;
        let kf = if k <= 0.0 { 1.0 } else { chunk / (chunk + self.gemm_k_overhead.max(0.0)) };
        let wave = if self.sms == 0 {
            1.0
        } else {
            let units = count * split;
            units / ((units / sms).ceil() * sms)
        };
        self.efficiency * q(m) * q(n) * wave * kf
    }
}

/// How the devices of a link level are connected.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// A switch (NVSwitch, an IB fabric): every device has its full bandwidth to any peer.
    Switch,
    /// A ring of point-to-point links.
    Ring,
    /// A PCIe tree: devices under one switch share its uplink.
    Tree,
}

/// A link level.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bandwidth per device and direction, bytes/s.
    pub bandwidth: f64,
    /// Latency of one message, seconds.
    pub latency: f64,
    /// How the devices are connected.
    pub topology: Topology,
    /// Devices sharing one upstream link (a PCIe switch); their traffic that leaves the switch
    /// divides its bandwidth.
    #[serde(default = "one")]
    pub shared_by: usize,
    /// The bandwidth by transfer size, as multiples of `bandwidth` (absent: `bandwidth` at
    /// every size; see [`BySize`]).
    #[serde(default, skip_serializing_if = "BySize::is_empty")]
    pub by_size: BySize,
}

impl Link {
    /// Bytes/s of a transfer of `bytes` (see [`BySize`]).
    pub fn bandwidth_at(&self, bytes: f64) -> f64 {
        self.bandwidth * self.by_size.factor(bytes)
    }
}

fn one() -> usize {
    1
}

/// A link's bandwidth by transfer size: `(bytes, factor)` points in increasing size, the
/// bandwidth at that size a multiple `factor` of the link's `bandwidth`. Between two points
/// the time per byte is interpolated linearly in log `bytes`; below the first point and above
/// the last their factors hold. Transports through host memory slow down as their buffers
/// outgrow the caches (this machine's in-process ring measured 0.35 GB/s at 1 MB and 0.21 at
/// 64 MB), so one bandwidth fitted at one size misprices the others; GPU links are flat
/// (no points).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BySize(pub Vec<(f64, f64)>);

impl BySize {
    /// No points: the same bandwidth at every size.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The factor at `bytes`.
    pub fn factor(&self, bytes: f64) -> f64 {
        let pts = &self.0;
        let (Some(first), Some(last)) = (pts.first(), pts.last()) else { return 1.0 };
        if bytes <= first.0 {
            return first.1;
        }
        if bytes >= last.0 {
            return last.1;
        }
        let i = pts.partition_point(|&(b, _)| b <= bytes);
        let ((b0, f0), (b1, f1)) = (pts[i - 1], pts[i]);
        let w = (bytes.ln() - b0.ln()) / (b1.ln() - b0.ln());
        1.0 / ((1.0 - w) / f0 + w / f1)
    }

    /// Points in increasing size with positive, finite factors.
    fn validate(&self, name: &str) -> Result<(), String> {
        for (i, &(b, f)) in self.0.iter().enumerate() {
            if !(b > 0.0 && b.is_finite() && f > 0.0 && f.is_finite()) {
                return Err(format!("`{name}.by_size` needs positive sizes and factors, got [{b}, {f}]"));
            }
            if i > 0 && b <= self.0[i - 1].0 {
                return Err(format!("`{name}.by_size` must list sizes in increasing order"));
            }
        }
        Ok(())
    }
}

/// The path from host memory to a device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostLink {
    /// Bandwidth host→device per link, bytes/s.
    pub bandwidth: f64,
    /// Latency of one transfer, seconds.
    pub latency: f64,
    /// Devices sharing one host link.
    #[serde(default = "one")]
    pub shared_by: usize,
    /// The bandwidth by transfer size, as multiples of `bandwidth` (see [`BySize`]).
    #[serde(default, skip_serializing_if = "BySize::is_empty")]
    pub by_size: BySize,
}

impl HostLink {
    /// Bytes/s of a transfer of `bytes` (see [`BySize`]).
    pub fn bandwidth_at(&self, bytes: f64) -> f64 {
        self.bandwidth * self.by_size.factor(bytes)
    }
}

/// A machine: `nodes` nodes of `devices_per_node` identical devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Name (a preset's name, or what the file says).
    pub name: String,
    /// Where the numbers come from.
    #[serde(default)]
    pub source: String,
    /// Number of nodes.
    pub nodes: usize,
    /// Devices in each node.
    pub devices_per_node: usize,
    /// The device.
    pub device: Device,
    /// Links between devices of one node.
    pub intra: Link,
    /// Links between nodes (per NIC); absent for a single node.
    #[serde(default)]
    pub inter: Option<Link>,
    /// NICs per node (traffic of a node's devices shares them).
    #[serde(default = "one")]
    pub nics_per_node: usize,
    /// Host→device links.
    pub host: HostLink,
}

/// A cluster file or preset name could not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    /// Neither a preset nor a readable file.
    #[error("unknown cluster `{0}`: not a preset ({1}) and not a readable file")]
    Unknown(String, String),
    /// The file is not valid.
    #[error("cluster file `{0}`: {1}")]
    Invalid(String, String),
}

const GB: f64 = 1e9;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

fn a100() -> Device {
    Device {
        // NVIDIA A100 datasheet (SXM4 80 GB): FP32 19.5 TFLOPS, TF32 156, FP16/BF16 312 (dense);
        // HBM2e 2,039 GB/s; 80 GB (binary: nvidia-smi reports 81,920 MiB).
        name: "A100-SXM4-80GB".into(),
        peak_flops: PeakFlops { fp32: 19.5e12, tf32: Some(156e12), fp16: Some(312e12) },
        // Large cuBLAS GEMMs reach 70-80% of tensor-core peak; whole networks less.
        efficiency: 0.859,
        mem_bandwidth: 2039.0 * GB,
        mem_capacity: 80.0 * GIB,
        mem_usable: 0.9,
        // CUDA kernel launch and framework dispatch, a few microseconds.
        launch_overhead: 5e-6,
        shared_host: false,
        launch_contention: 0.0,
        host_use: 1.0,
        host_staged: false,
        ring_contention: 0.0,
        host_cores: 0,
        // cuBLAS SGEMM/HGEMM tiles of 128×128 on large problems; ~32 of K per tile in
        // prologue/epilogue. 108 SMs (A100 datasheet).
        gemm_tile: 128,
        gemm_k_overhead: 32.0,
        sms: 108,
        conv_grad_efficiency: 1.0,
        attention_efficiency: [0.0; 2],
        transpose_efficiency: 1.0,
        transpose_cached_bytes: 0.0,
        kernel_factors: Default::default(),
        parallel_width: 0.0,
        serial_slowdown: 1.0,
        in_place_update: true,
        fused_elementwise: false,
    }
}

fn dgx_a100(nodes: usize) -> Cluster {
    Cluster {
        name: if nodes == 1 { "dgx-a100".into() } else { format!("a100-cluster-{nodes}") },
        source: "NVIDIA DGX A100 system architecture whitepaper and A100 datasheet".into(),
        nodes,
        devices_per_node: 8,
        device: a100(),
        // NVLink 3: 12 links × 25 GB/s per direction = 300 GB/s per GPU per direction, through
        // six NVSwitches (all-to-all at full bandwidth). NCCL reaches ~230-250 GB/s bus bandwidth.
        intra: Link {
            bandwidth: 240.0 * GB,
            latency: 3e-6,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize::default(),
        },
        // 8 × Mellanox ConnectX-6 HDR 200 Gb/s (25 GB/s) InfiniBand, one per GPU; ~22 GB/s achieved.
        inter: (nodes > 1).then_some(Link {
            bandwidth: 22.0 * GB,
            latency: 5e-6,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize::default(),
        }),
        nics_per_node: 8,
        // PCIe Gen4 x16: 32 GB/s theoretical, ~25 GB/s achieved host→device; two GPUs per PCIe
        // switch in DGX A100.
        host: HostLink { bandwidth: 25.0 * GB, latency: 10e-6, shared_by: 2, by_size: BySize::default() },
    }
}

fn dgx_h100(nodes: usize) -> Cluster {
    Cluster {
        name: if nodes == 1 { "dgx-h100".into() } else { format!("h100-cluster-{nodes}") },
        source: "NVIDIA DGX H100 user guide and H100 SXM5 datasheet".into(),
        nodes,
        devices_per_node: 8,
        device: Device {
            // H100 SXM5: FP32 67 TFLOPS, TF32 495, FP16/BF16 989 (dense); HBM3 3.35 TB/s; 80 GB.
            name: "H100-SXM5-80GB".into(),
            peak_flops: PeakFlops { fp32: 67e12, tf32: Some(495e12), fp16: Some(989e12) },
            efficiency: 0.801,
            mem_bandwidth: 3350.0 * GB,
            mem_capacity: 80.0 * GIB,
            mem_usable: 0.9,
            launch_overhead: 4e-6,
            shared_host: false,
            launch_contention: 0.0,
            host_use: 1.0,
            host_staged: false,
            ring_contention: 0.0,
            host_cores: 0,
            gemm_tile: 128,
            gemm_k_overhead: 32.0,
            sms: 132,
            conv_grad_efficiency: 1.0,
            // cuDNN's fused attention (what Transformer Engine runs on Hopper), head dim 128
            // at 16k tokens, bf16: forward 595 and backward 516 TFLOP/s of 989 (Shah et al.
            // 2024, FlashAttention-3, Figs. 5–6; FlashAttention-2 reaches 370 and 322).
            attention_efficiency: [595.0 / 989.0, 516.0 / 989.0],
            transpose_efficiency: 1.0,
            transpose_cached_bytes: 0.0,
            kernel_factors: Default::default(),
            parallel_width: 0.0,
            serial_slowdown: 1.0,
            in_place_update: true,
            fused_elementwise: false,
        },
        // NVLink 4: 18 links, 900 GB/s bidirectional = 450 GB/s per direction, NVSwitch gen 3;
        // NCCL reaches ~360 GB/s bus bandwidth.
        intra: Link {
            bandwidth: 360.0 * GB,
            latency: 2.5e-6,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize::default(),
        },
        // 8 × ConnectX-7 NDR 400 Gb/s (50 GB/s) InfiniBand, one per GPU (DGX H100 user guide);
        // the achieved share taken as the A100 preset's HDR links reach (22 of 25 GB/s), 44 GB/s.
        inter: (nodes > 1).then_some(Link {
            bandwidth: 44.0 * GB,
            latency: 5e-6,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize::default(),
        }),
        nics_per_node: 8,
        // PCIe Gen5 x16: 64 GB/s theoretical, ~50 GB/s achieved.
        host: HostLink { bandwidth: 50.0 * GB, latency: 8e-6, shared_by: 2, by_size: BySize::default() },
    }
}

fn pcie_v100x8() -> Cluster {
    Cluster {
        name: "pcie-v100x8".into(),
        source: "NVIDIA V100 PCIe datasheet; 8-GPU PCIe Gen3 servers (2 GPUs per PLX switch, no NVLink)".into(),
        nodes: 1,
        devices_per_node: 8,
        device: Device {
            // V100 PCIe 32 GB: FP32 14 TFLOPS, FP16 tensor 112 TFLOPS; HBM2 900 GB/s.
            name: "V100-PCIe-32GB".into(),
            peak_flops: PeakFlops { fp32: 14e12, tf32: None, fp16: Some(112e12) },
            efficiency: 0.65,
            mem_bandwidth: 900.0 * GB,
            mem_capacity: 32.0 * GIB,
            mem_usable: 0.9,
            launch_overhead: 6e-6,
            shared_host: false,
            launch_contention: 0.0,
            host_use: 1.0,
            host_staged: false,
            ring_contention: 0.0,
            host_cores: 0,
            gemm_tile: 128,
            gemm_k_overhead: 32.0,
            sms: 80,
            conv_grad_efficiency: 1.0,
            attention_efficiency: [0.0; 2],
            transpose_efficiency: 1.0,
            transpose_cached_bytes: 0.0,
            kernel_factors: Default::default(),
            parallel_width: 0.0,
            serial_slowdown: 1.0,
            in_place_update: true,
            fused_elementwise: false,
        },
        // GPU↔GPU over PCIe Gen3 x16 (15.75 GB/s theoretical, ~11 GB/s achieved); pairs of GPUs
        // share a PLX switch uplink to the CPU root complex, which rings across switches cross.
        intra: Link {
            bandwidth: 11.0 * GB,
            latency: 10e-6,
            topology: Topology::Tree,
            shared_by: 2,
            by_size: BySize::default(),
        },
        inter: None,
        nics_per_node: 1,
        // Host→GPU over the same PCIe Gen3 switches: ~11 GB/s per link, shared by two GPUs.
        host: HostLink { bandwidth: 11.0 * GB, latency: 10e-6, shared_by: 2, by_size: BySize::default() },
    }
}

fn dgx1_v100() -> Cluster {
    Cluster {
        name: "dgx1-v100".into(),
        source: "NVIDIA DGX-1 (Volta) system architecture whitepaper and V100 SXM2 datasheet".into(),
        nodes: 1,
        devices_per_node: 8,
        device: Device {
            // V100 SXM2 16 GB: FP32 15.7 TFLOPS, FP16 tensor 125 TFLOPS; HBM2 900 GB/s.
            name: "V100-SXM2-16GB".into(),
            peak_flops: PeakFlops { fp32: 15.7e12, tf32: None, fp16: Some(125e12) },
            efficiency: 0.65,
            mem_bandwidth: 900.0 * GB,
            mem_capacity: 16.0 * GIB,
            mem_usable: 0.9,
            launch_overhead: 6e-6,
            shared_host: false,
            launch_contention: 0.0,
            host_use: 1.0,
            host_staged: false,
            ring_contention: 0.0,
            host_cores: 0,
            gemm_tile: 128,
            gemm_k_overhead: 32.0,
            sms: 80,
            conv_grad_efficiency: 1.0,
            attention_efficiency: [0.0; 2],
            transpose_efficiency: 1.0,
            transpose_cached_bytes: 0.0,
            kernel_factors: Default::default(),
            parallel_width: 0.0,
            serial_slowdown: 1.0,
            in_place_update: true,
            fused_elementwise: false,
        },
        // NVLink 2 hybrid cube-mesh: 6 links × 25 GB/s per GPU; NCCL rings reach ~130 GB/s bus
        // bandwidth over all 8 GPUs.
        intra: Link {
            bandwidth: 130.0 * GB,
            latency: 5e-6,
            topology: Topology::Switch,
            shared_by: 1,
            by_size: BySize::default(),
        },
        inter: None,
        nics_per_node: 4,
        // PCIe Gen3 x16 to the host through PLX switches shared by two GPUs, ~11 GB/s.
        host: HostLink { bandwidth: 11.0 * GB, latency: 10e-6, shared_by: 2, by_size: BySize::default() },
    }
}

/// The runtime's simulated accelerators on this machine: wgpu on Mesa's lavapipe (software
/// Vulkan on the CPU), collectives through host staging buffers; the constants are a
/// calibration run on the development machine (2 cores, lavapipe; see
/// [`crate::cost::calibration`] for how they were measured).
fn local_wgpu() -> Cluster {
    use crate::cost::calibration::{
        CALIBRATED, COPY_BY_SIZE, Calibration, KERNEL_FACTORS, RING_BY_SIZE, local_cluster,
    };
    let c = Calibration {
        kernel_factors: KERNEL_FACTORS.iter().map(|&(op, k)| (op.to_string(), k)).collect(),
        ring_by_size: RING_BY_SIZE.to_vec(),
        copy_by_size: COPY_BY_SIZE.to_vec(),
        ..CALIBRATED
    };
    local_cluster(&c, "local-wgpu", "shardc calibrate on the development machine (Mesa lavapipe, 2 cores)", 8)
}

/// Names of the built-in presets (`a100-cluster-N` and `h100-cluster-N` take any N ≥ 2 nodes
/// of eight).
pub const PRESETS: &[&str] =
    &["dgx-a100", "dgx-h100", "dgx1-v100", "pcie-v100x8", "a100-cluster-N", "h100-cluster-N", "local-wgpu"];

impl Cluster {
    /// A built-in preset.
    pub fn preset(name: &str) -> Option<Cluster> {
        Some(match name {
            "dgx-a100" => dgx_a100(1),
            "dgx-h100" => dgx_h100(1),
            "pcie-v100x8" => pcie_v100x8(),
            "dgx1-v100" => dgx1_v100(),
            "local-wgpu" => local_wgpu(),
            _ => {
                let (make, n): (fn(usize) -> Cluster, &str) = match name.strip_prefix("a100-cluster-") {
                    Some(n) => (dgx_a100, n),
                    None => (dgx_h100, name.strip_prefix("h100-cluster-")?),
                };
                let n: usize = n.parse().ok()?;
                if n == 0 {
                    return None;
                }
                make(n)
            }
        })
    }

    /// A preset name or a TOML file.
    pub fn load(spec: &str) -> Result<Cluster, ClusterError> {
        if let Some(c) = Cluster::preset(spec) {
            return Ok(c);
        }
        let text = std::fs::read_to_string(spec).map_err(|_| ClusterError::Unknown(spec.into(), PRESETS.join(", ")))?;
        Cluster::from_toml(&text).map_err(|e| ClusterError::Invalid(spec.into(), e))
    }

    /// Parses the TOML format (see the README): top-level `name`, `nodes`,
    /// `devices_per_node`, and tables `[device]`, `[device.peak_flops]`, `[intra]`,
    /// `[inter]`, `[host]`.
    pub fn from_toml(text: &str) -> Result<Cluster, String> {
        let c: Cluster = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    /// The description as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("clusters serialize")
    }

    /// Checks that every number is positive and the structure is complete.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |name: &str, v: f64| {
            if v > 0.0 && v.is_finite() { Ok(()) } else { Err(format!("`{name}` must be a positive number, got {v}")) }
        };
        if self.nodes == 0 || self.devices_per_node == 0 {
            return Err("`nodes` and `devices_per_node` must be at least 1".into());
        }
        pos("device.peak_flops.fp32", self.device.peak_flops.fp32)?;
        pos("device.efficiency", self.device.efficiency)?;
        if self.device.efficiency > 1.0 {
            return Err("`device.efficiency` is a fraction of peak and must be at most 1".into());
        }
        pos("device.mem_bandwidth", self.device.mem_bandwidth)?;
        pos("device.mem_capacity", self.device.mem_capacity)?;
        pos("intra.bandwidth", self.intra.bandwidth)?;
        pos("host.bandwidth", self.host.bandwidth)?;
        if self.device.launch_overhead < 0.0 || self.intra.latency < 0.0 || self.host.latency < 0.0 {
            return Err("latencies and overheads cannot be negative".into());
        }
        let u = self.device.host_use;
        if !(u > 0.0 && u <= 1.0) {
            return Err(format!("`device.host_use` must be a fraction in (0, 1], got {u}"));
        }
        let c = self.device.ring_contention;
        if !(c >= 0.0 && c.is_finite()) {
            return Err(format!("`device.ring_contention` must be a number of at least 0, got {c}"));
        }
        let (w, s) = (self.device.parallel_width, self.device.serial_slowdown);
        if !(w >= 0.0 && w.is_finite() && s >= 1.0 && s.is_finite()) {
            return Err(format!(
                "`device.parallel_width` must be at least 0 and `device.serial_slowdown` at least 1, got {w} and {s}"
            ));
        }
        for (op, &k) in &self.device.kernel_factors {
            // Keyed by the op type whose kernels they scale (or the fused groups' kernels): a
            // name no op has would silently price that op at 1.0.
            if op != ir::fusion::FUSED && !ir::Op::known_op_types().iter().any(|(_, t)| t == op) {
                return Err(format!(
                    "`device.kernel_factors.{op}`: no op is called `{op}` (the factors are keyed by op type: Conv, MatMul, ConvGradInput, …)"
                ));
            }
            pos(&format!("device.kernel_factors.{op}"), k)?;
        }
        if self.nodes > 1 && self.inter.is_none() {
            return Err("a cluster of several nodes needs an `[inter]` link".into());
        }
        if let Some(l) = &self.inter {
            pos("inter.bandwidth", l.bandwidth)?;
            l.by_size.validate("inter")?;
        }
        self.intra.by_size.validate("intra")?;
        self.host.by_size.validate("host")?;
        Ok(())
    }

    /// Total devices.
    pub fn devices(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// The link of a level (the intra link when there is no inter link).
    pub fn link(&self, level: LinkLevel) -> &Link {
        match level {
            LinkLevel::Intra => &self.intra,
            LinkLevel::Inter => self.inter.as_ref().unwrap_or(&self.intra),
        }
    }

    /// The natural mesh for `n` devices: one intra-node axis when they fit in a node, else
    /// `[nodes, devices per node]`. Errors when `n` does not fit the machine's shape.
    pub fn mesh(&self, n: usize) -> Result<Mesh, String> {
        if n == 0 {
            return Err("the device count must be at least 1".into());
        }
        if n > self.devices() {
            return Err(format!("{} has {} devices; {n} asked", self.name, self.devices()));
        }
        if n <= self.devices_per_node {
            return Ok(Mesh::line(n, LinkLevel::Intra));
        }
        if !n.is_multiple_of(self.devices_per_node) {
            return Err(format!("{n} devices do not fill whole nodes of {}", self.devices_per_node));
        }
        Ok(Mesh {
            axes: vec![
                MeshAxis { name: "nodes".into(), size: n / self.devices_per_node, level: LinkLevel::Inter },
                MeshAxis { name: "gpus".into(), size: self.devices_per_node, level: LinkLevel::Intra },
            ],
        })
    }

    /// Human-readable summary.
    pub fn describe(&self) -> String {
        format!(
            "{}: {} node(s) × {} {} ({:.0} GiB, {:.1} TFLOP/s fp32), intra {:.0} GB/s{}",
            self.name,
            self.nodes,
            self.devices_per_node,
            self.device.name,
            self.device.mem_capacity / GIB,
            self.device.peak_flops.fp32 / 1e12,
            self.intra.bandwidth / GB,
            self.inter.as_ref().map_or(String::new(), |l| format!(", inter {:.0} GB/s", l.bandwidth / GB))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_round_trip_through_toml() {
        for name in
            ["dgx-a100", "dgx-h100", "dgx1-v100", "pcie-v100x8", "a100-cluster-8", "h100-cluster-4", "local-wgpu"]
        {
            let c = Cluster::preset(name).unwrap();
            c.validate().unwrap();
            let back = Cluster::from_toml(&c.to_toml()).unwrap();
            assert_eq!(back, c, "{name}");
        }
        assert!(Cluster::preset("a100-cluster-0").is_none());
        assert_eq!(Cluster::preset("a100-cluster-8").unwrap().devices(), 64);
    }

    #[test]
    fn meshes_follow_the_hierarchy() {
        let c = Cluster::preset("a100-cluster-8").unwrap();
        let m = c.mesh(64).unwrap();
        assert_eq!(
            m.axes.iter().map(|a| (a.size, a.level)).collect::<Vec<_>>(),
            vec![(8, LinkLevel::Inter), (8, LinkLevel::Intra)]
        );
        assert_eq!(c.mesh(8).unwrap().axes.len(), 1);
        assert!(c.mesh(12).is_err());
        assert!(c.mesh(128).is_err());
    }

    /// Devices on one host share it by their count times the part one of them keeps busy,
    /// never less than alone; launches contend by the count alone.
    #[test]
    fn devices_share_a_host_by_the_part_each_keeps_busy() {
        let mut c = Cluster::preset("local-wgpu").unwrap();
        assert_eq!((c.device.host_share(1), c.device.host_share(4)), (1.0, 4.0));
        c.device.host_use = 0.5;
        assert_eq!((c.device.host_share(1), c.device.host_share(2), c.device.host_share(4)), (1.0, 1.0, 2.0));
        let l = c.device.launch_overhead * (1.0 + 3.0 * c.device.launch_contention);
        assert!((c.device.launch_at(4) - l).abs() < 1e-15);
        let back = Cluster::from_toml(&c.to_toml()).unwrap();
        assert_eq!(back.device.host_use, 0.5);
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let mut c = Cluster::preset("dgx-a100").unwrap();
        c.device.efficiency = 1.5;
        let e = Cluster::from_toml(&c.to_toml()).unwrap_err();
        assert!(e.contains("efficiency"), "{e}");
        let mut c = Cluster::preset("local-wgpu").unwrap();
        c.device.ring_contention = -1.0;
        let e = Cluster::from_toml(&c.to_toml()).unwrap_err();
        assert!(e.contains("ring_contention"), "{e}");
        let mut c = Cluster::preset("local-wgpu").unwrap();
        c.device.host_use = 1.5;
        let e = Cluster::from_toml(&c.to_toml()).unwrap_err();
        assert!(e.contains("host_use"), "{e}");
        let mut c = Cluster::preset("local-wgpu").unwrap();
        c.device.kernel_factors.insert("ReduceSum".into(), 0.0);
        let e = Cluster::from_toml(&c.to_toml()).unwrap_err();
        assert!(e.contains("kernel_factors.ReduceSum"), "{e}");
        // A misspelt op type is an error, not a factor no op reads.
        let mut c = Cluster::preset("local-wgpu").unwrap();
        c.device.kernel_factors.insert("Convv".into(), 1.2);
        let e = Cluster::from_toml(&c.to_toml()).unwrap_err();
        assert!(e.contains("no op is called `Convv`"), "{e}");
        // Every factor the calibration writes names an op.
        assert!(Cluster::from_toml(&Cluster::preset("local-wgpu").unwrap().to_toml()).is_ok());
        let mut c = Cluster::preset("local-wgpu").unwrap();
        c.device.serial_slowdown = 0.5;
        let e = Cluster::from_toml(&c.to_toml()).unwrap_err();
        assert!(e.contains("serial_slowdown"), "{e}");
        assert!(Cluster::from_toml("name = 3").is_err());
    }
}
