//! The device side: one wgpu instance, device and queue per simulated accelerator; compiled
//! programs ([`super::compile`]) are allocated and launched here.

use super::Elem;
use super::compile::{self, Buf, CompileCx, Compiled, Step, TensorDesc};
use super::fused;
use ir::DType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ir::eval::{Array, Data, eval_node};
use ir::{Graph, NodeId};

use crate::runtime::fuse::{Group, Source};
use crate::runtime::{Executor, RunFused};

/// A tensor on a device.
#[derive(Clone, Debug)]
pub struct GpuTensor {
    /// The storage buffer (shared by views: reshapes do not copy).
    pub buf: Arc<Storage>,
    /// Shape.
    pub shape: Vec<usize>,
    /// Logical element type.
    pub dtype: DType,
    /// Exact host copy, for small tensors uploaded from the host (shapes, indices, scalars).
    pub host: Option<Arc<Array>>,
}

/// A storage buffer that goes back to its device's [`Pool`] when the last tensor holding it
/// is dropped, instead of being destroyed.
pub struct Storage {
    buf: Option<wgpu::Buffer>,
    pool: Arc<Mutex<Pool>>,
}

impl std::ops::Deref for Storage {
    type Target = wgpu::Buffer;

    fn deref(&self) -> &wgpu::Buffer {
        self.buf.as_ref().expect("a storage buffer is held until dropped")
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Storage({} bytes)", self.buf.as_ref().map_or(0, |b| b.size()))
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut pool)) = (self.buf.take(), self.pool.lock()) {
            pool.put(b);
        }
    }
}

/// Freed storage buffers of one device by size, reused for the next outputs of that size: a
/// training step frees and makes the same tensors every step, and a new buffer costs what a
/// reused one does not (the driver's allocation, on lavapipe page faults on first touch, and
/// wgpu's zero-initialisation before first use). Kernels never read an output before writing
/// it, and those that accumulate clear their buffer first (`Step::Zero`), so a reused buffer's
/// old contents are never seen. At most [`POOL_LIMIT`] bytes are kept; the rest are destroyed.
#[derive(Default)]
pub struct Pool {
    free: HashMap<u64, Vec<wgpu::Buffer>>,
    bytes: u64,
}

/// The most bytes of freed buffers a device keeps for reuse.
pub const POOL_LIMIT: u64 = 1 << 30;

impl Pool {
    fn put(&mut self, b: wgpu::Buffer) {
        let size = b.size();
        if self.bytes + size <= POOL_LIMIT {
            self.bytes += size;
            self.free.entry(size).or_default().push(b);
        }
    }

    fn take(&mut self, size: u64) -> Option<wgpu::Buffer> {
        let b = self.free.get_mut(&size)?.pop()?;
        self.bytes -= size;
        Some(b)
    }

    /// Bytes held for reuse.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl GpuTensor {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element storage.
    pub fn elem(&self) -> Elem {
        Elem::of(self.dtype)
    }
}

/// Host copies are kept for tensors at most this large.
const HOST_COPY_LIMIT: usize = 4096;

/// A wgpu device with its queue and pipeline cache.
pub struct GpuExecutor {
    device: wgpu::Device,
    queue: wgpu::Queue,
    adapter: String,
    /// Loop iterations an invocation may run before the adapter cuts it short
    /// ([`compile::LAVAPIPE_LOOP_LIMIT`] on llvmpipe; `None`: unbounded).
    loop_limit: Option<u64>,
    /// The device's fixed subgroup size, when kernels may use subgroup operations.
    subgroup: Option<u32>,
    pipelines: HashMap<String, (Arc<wgpu::ComputePipeline>, Arc<wgpu::BindGroupLayout>)>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Dispatches encoded since the last submit.
    pending: usize,
    /// Dispatches encoded since the device opened.
    dispatched: u64,
    /// Freed storage buffers for reuse.
    pool: Arc<Mutex<Pool>>,
}

/// Which adapter a process opens when several are there: `SHARDC_ADAPTER` (an index into
/// wgpu's list), else the process's node-local rank under mpirun (`OMPI_COMM_WORLD_LOCAL_RANK`,
/// `MPI_LOCALRANKID`, `SLURM_LOCALID`: one GPU per rank), else the preferred one.
fn adapter_index() -> Option<usize> {
    ["SHARDC_ADAPTER", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
}

/// The adapter this process uses ([`adapter_index`]) of a fresh instance (Vulkan, or any
/// backend wgpu was built with).
fn first_adapter() -> Result<wgpu::Adapter, String> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::all();
    let instance = wgpu::Instance::new(desc);
    if let Some(i) = adapter_index() {
        let mut all = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        // Physical devices first; the index wraps when ranks outnumber the adapters.
        all.retain(|a| {
            a.get_info().device_type != wgpu::DeviceType::Cpu || std::env::var_os("SHARDC_ADAPTER").is_some()
        });
        if !all.is_empty() {
            let n = all.len();
            return Ok(all.swap_remove(i % n));
        }
    }
    pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        force_fallback_adapter: false,
        compatible_surface: None,
        apply_limit_buckets: false,
    }))
    .map_err(|e| format!("{e} (install a Vulkan driver such as Mesa's lavapipe: apt-get install mesa-vulkan-drivers)"))
}

/// What the first adapter can hold ([`crate::runtime::AdapterLimits`]).
pub fn limits() -> Result<crate::runtime::AdapterLimits, String> {
    let adapter = first_adapter()?;
    let info = adapter.get_info();
    let have = adapter.limits();
    Ok(crate::runtime::AdapterLimits {
        name: info.name,
        host_memory: matches!(info.device_type, wgpu::DeviceType::Cpu | wgpu::DeviceType::IntegratedGpu),
        max_buffer_bytes: have.max_buffer_size.min(have.max_storage_buffer_binding_size),
    })
}

/// Opens the first adapter of a fresh instance (Vulkan, or any backend wgpu was built with).
pub fn open() -> Result<(wgpu::Device, wgpu::Queue, String), String> {
    open_device(true).map(|(d, q, name, _)| (d, q, name))
}

/// The subgroup sizes kernels are generated for: a device whose subgroups always have this
/// many invocations (CPU adapters' SIMD width: lavapipe's 8 at 256 bits, 4 at 128, 16 at
/// 512). GPUs with wider or varying subgroups use the kernels written without them.
const SUBGROUP_SIZES: [u32; 3] = [4, 8, 16];

/// [`open`], with the fixed subgroup size kernels may rely on ([`SUBGROUP_SIZES`]; the
/// device is opened with subgroup operations then) unless `subgroups` is false or
/// `SHARDC_NO_SUBGROUPS` is set.
fn open_device(subgroups: bool) -> Result<(wgpu::Device, wgpu::Queue, String, Option<u32>), String> {
    let adapter = first_adapter()?;
    let info = adapter.get_info();
    let mut limits = wgpu::Limits::default();
    let have = adapter.limits();
    limits.max_storage_buffers_per_shader_stage = have.max_storage_buffers_per_shader_stage.min(16);
    limits.max_storage_buffer_binding_size = have.max_storage_buffer_binding_size;
    limits.max_buffer_size = have.max_buffer_size;
    limits.max_compute_workgroup_storage_size = have.max_compute_workgroup_storage_size;
    let subgroup = (subgroups
        && adapter.features().contains(wgpu::Features::SUBGROUP)
        && info.subgroup_min_size == info.subgroup_max_size
        && SUBGROUP_SIZES.contains(&info.subgroup_min_size)
        && std::env::var_os("SHARDC_NO_SUBGROUPS").is_none())
    .then_some(info.subgroup_min_size);
    let features = if subgroup.is_some() { wgpu::Features::SUBGROUP } else { wgpu::Features::empty() };
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("shardc device"),
        required_features: features,
        required_limits: limits,
        experimental_features: Default::default(),
        memory_hints: wgpu::MemoryHints::Performance,
        trace: Default::default(),
    }))
    .map_err(|e| format!("cannot open {}: {e}", info.name))?;
    Ok((device, queue, format!("{} ({:?}, {})", info.name, info.backend, info.driver), subgroup))
}

/// A kernel of the kind every program compiles (an element-wise map), for measuring what a
/// device with compiled kernels holds.
const PROBE_KERNEL: &str = "@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if (id.x < arrayLength(&y)) { y[id.x] = max(x[id.x], 0.0) * 2.0 + 1.0; }
}
";

/// See [`crate::runtime::gpu_device_host_bytes`].
pub fn device_host_bytes() -> Result<Option<u64>, String> {
    let before = crate::runtime::resident_bytes();
    let mut probe = GpuExecutor::new()?;
    probe.pipeline(PROBE_KERNEL)?;
    let after = crate::runtime::resident_bytes();
    drop(probe);
    Ok(before.zip(after).map(|(b, a)| a.saturating_sub(b)))
}

impl GpuExecutor {
    /// Opens a device on a fresh instance.
    pub fn new() -> Result<GpuExecutor, String> {
        GpuExecutor::open(true)
    }

    /// A device whose kernels use no subgroup operations (what adapters without fixed
    /// subgroups run), for comparing kernels on one adapter.
    pub fn without_subgroups() -> Result<GpuExecutor, String> {
        GpuExecutor::open(false)
    }

    fn open(subgroups: bool) -> Result<GpuExecutor, String> {
        let (device, queue, adapter, subgroup) = open_device(subgroups)?;
        let loop_limit = adapter.contains("llvmpipe").then_some(compile::LAVAPIPE_LOOP_LIMIT);
        Ok(GpuExecutor {
            device,
            queue,
            adapter,
            loop_limit,
            subgroup,
            pipelines: HashMap::new(),
            encoder: None,
            pending: 0,
            dispatched: 0,
            pool: Default::default(),
        })
    }

    /// The device's fixed subgroup size, when kernels use subgroup operations on it.
    pub fn subgroup(&self) -> Option<u32> {
        self.subgroup
    }

    /// The storage bindings a kernel declares, in binding order: `true` where written.
    /// The layout is built from these rather than from what the shader happens to use,
    /// so a kernel that leaves an operand unread still binds in the order launched.
    fn declared_bindings(src: &str) -> Vec<bool> {
        let mut out: Vec<(u32, bool)> = Vec::new();
        for line in src.lines() {
            let Some(at) = line.find("@binding(") else { continue };
            let rest = &line[at + 9..];
            let Some(close) = rest.find(')') else { continue };
            let Ok(b) = rest[..close].trim().parse::<u32>() else { continue };
            out.push((b, line.contains("read_write")));
        }
        out.sort();
        out.into_iter().map(|(_, w)| w).collect()
    }

    fn pipeline(&mut self, src: &str) -> Result<(Arc<wgpu::ComputePipeline>, Arc<wgpu::BindGroupLayout>), String> {
        if let Some(p) = self.pipelines.get(src) {
            return Ok(p.clone());
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: None,
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
        let entries: Vec<wgpu::BindGroupLayoutEntry> = Self::declared_bindings(src)
            .into_iter()
            .enumerate()
            .map(|(i, written)| wgpu::BindGroupLayoutEntry {
                binding: i as u32,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: !written },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let bgl =
            self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries });
        let pl = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&bgl)],
            immediate_size: 0,
        });
        let p = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: None,
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(format!("shader rejected: {e}\n{src}"));
        }
        let p = (Arc::new(p), Arc::new(bgl));
        self.pipelines.insert(src.to_string(), p.clone());
        Ok(p)
    }

    /// A storage buffer for `n` elements: a freed one of that size, else a new one.
    pub fn alloc(&self, n: usize) -> Arc<Storage> {
        let size = (n.max(1) * 4) as u64;
        let reused = self.pool.lock().ok().and_then(|mut p| p.take(size));
        let buf = reused.unwrap_or_else(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        Arc::new(Storage { buf: Some(buf), pool: self.pool.clone() })
    }

    /// Bytes of freed buffers held for reuse.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.lock().map_or(0, |p| p.bytes())
    }

    /// An output tensor.
    pub fn output(&self, shape: Vec<usize>, dtype: DType) -> GpuTensor {
        let n = shape.iter().product();
        GpuTensor { buf: self.alloc(n), shape, dtype, host: None }
    }

    /// Encodes one dispatch of `src` with `bufs` bound in order and `params` after them;
    /// `threads` invocations of 64-wide workgroups (or `groups` explicitly).
    pub fn launch(
        &mut self,
        src: &str,
        bufs: &[&wgpu::Buffer],
        params: &[u32],
        groups: [u32; 3],
    ) -> Result<(), String> {
        let (pipeline, layout) = self.pipeline(src)?;
        let pbuf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (params.len().max(1) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if !params.is_empty() {
            self.queue.write_buffer(&pbuf, 0, bytemuck::cast_slice(params));
        }
        let mut entries: Vec<wgpu::BindGroupEntry<'_>> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
            .collect();
        entries.push(wgpu::BindGroupEntry { binding: bufs.len() as u32, resource: pbuf.as_entire_binding() });
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        let enc = self.encoder.get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(groups[0].max(1), groups[1].max(1), groups[2].max(1));
        }
        self.pending += 1;
        self.dispatched += 1;
        if self.pending >= 64 {
            self.flush();
        }
        Ok(())
    }

    /// Writes `bytes` at the start of `buf` after the work encoded so far. A queue write
    /// lands before the next submission's command buffers, so with work still encoded (which
    /// may read what a freed buffer, now `buf`, held) the bytes go through a staging buffer
    /// copied in the encoder's order instead.
    fn write(&mut self, buf: &wgpu::Buffer, bytes: &[u8]) {
        use wgpu::util::DeviceExt;
        match self.encoder.as_mut() {
            Some(enc) => {
                let staging = self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: None,
                    contents: bytes,
                    usage: wgpu::BufferUsages::COPY_SRC,
                });
                enc.copy_buffer_to_buffer(&staging, 0, buf, 0, bytes.len() as u64);
            }
            None => self.queue.write_buffer(buf, 0, bytes),
        }
    }

    /// Submits what is encoded.
    pub fn flush(&mut self) {
        if let Some(enc) = self.encoder.take() {
            self.queue.submit([enc.finish()]);
        }
        self.pending = 0;
    }

    fn read(&mut self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<u8>, String> {
        let size = (n.max(1) * 4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let enc = self.encoder.get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
        enc.copy_buffer_to_buffer(buf, 0, &staging, 0, size);
        self.flush();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| format!("device lost: {e}"))?;
        rx.recv().map_err(|e| e.to_string())?.map_err(|e| format!("read-back failed: {e}"))?;
        let bytes = slice.get_mapped_range().map_err(|e| format!("{e:?}"))?.to_vec();
        staging.unmap();
        Ok(bytes[..n * 4].to_vec())
    }

    /// The values of a tensor as i64 (host copy if any, else read back).
    pub fn ints(&mut self, t: &GpuTensor) -> Result<Vec<i64>, String> {
        if let Some(h) = &t.host {
            return h.to_i64().map_err(|e| e.to_string());
        }
        let a = self.download(t)?;
        a.to_i64().map_err(|e| e.to_string())
    }

    /// The values of a tensor as f64.
    pub fn floats(&mut self, t: &GpuTensor) -> Result<Vec<f64>, String> {
        if let Some(h) = &t.host {
            return h.to_f64().map_err(|e| e.to_string());
        }
        let a = self.download(t)?;
        a.to_f64().map_err(|e| e.to_string())
    }

    /// A view of `t` with another shape (no copy).
    pub fn view(t: &GpuTensor, shape: Vec<usize>) -> GpuTensor {
        GpuTensor {
            buf: t.buf.clone(),
            shape: shape.clone(),
            dtype: t.dtype,
            host: t.host.as_ref().map(|h| Arc::new((**h).clone().reshaped(shape))),
        }
    }

    /// Compiles node `n` for its inputs and runs it; `None` when it has no kernel.
    fn run_kernel(
        &mut self,
        g: &Graph,
        n: NodeId,
        inputs: &[Option<&GpuTensor>],
    ) -> Result<Option<Vec<GpuTensor>>, String> {
        let node = g.node(n);
        // The values the compiler needs, read back when there is no host copy.
        let mut values: HashMap<usize, Array> = HashMap::new();
        for &k in compile::value_inputs(&node.op) {
            if let Some(Some(t)) = inputs.get(k)
                && t.host.is_none()
            {
                values.insert(k, self.download(t)?);
            }
        }
        let ins: Vec<Option<TensorDesc<'_>>> = inputs
            .iter()
            .enumerate()
            .map(|(k, t)| {
                t.map(|t| TensorDesc {
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                    value: t.host.as_deref().or_else(|| values.get(&k)),
                })
            })
            .collect();
        let cx = CompileCx { ins, outs: out_descs(g, n), opset: g.opset, subgroup: self.subgroup };
        if cx.out0().is_none() && node.num_outputs() > 0 && !node.outputs()[0].name.is_empty() {
            return Ok(None);
        }
        let Some(program) = compile::compile(&node.op, &cx)? else { return Ok(None) };
        // A kernel the adapter would stop early (its loops too long): the host computes it.
        if self.loop_limit.is_some_and(|limit| program.max_trips() >= limit) {
            return Ok(None);
        }
        self.execute(&program, inputs).map(Some)
    }

    /// Allocates a compiled program's outputs and scratch buffers and encodes its steps.
    pub fn execute(&mut self, p: &compile::Compiled, inputs: &[Option<&GpuTensor>]) -> Result<Vec<GpuTensor>, String> {
        let input = |k: usize| inputs.get(k).copied().flatten().ok_or_else(|| format!("input {k} is missing"));
        let mut outs = Vec::with_capacity(p.outputs.len());
        for o in &p.outputs {
            outs.push(match o.view_of {
                Some(k) => GpuExecutor::view(input(k)?, o.shape.clone()),
                None => self.output(o.shape.clone(), o.dtype),
            });
        }
        let temps: Vec<GpuTensor> = p.temps.iter().map(|(s, d)| self.output(s.clone(), *d)).collect();
        let buf = |b: Buf| -> Result<Arc<Storage>, String> {
            Ok(match b {
                Buf::In(k) => input(k)?.buf.clone(),
                Buf::Out(k) => outs.get(k).ok_or("no such output")?.buf.clone(),
                Buf::Tmp(k) => temps.get(k).ok_or("no such scratch buffer")?.buf.clone(),
            })
        };
        for step in &p.steps {
            match step {
                Step::Launch(l) => {
                    let bufs: Vec<Arc<Storage>> = l.bufs.iter().map(|&b| buf(b)).collect::<Result<_, _>>()?;
                    let refs: Vec<&wgpu::Buffer> = bufs.iter().map(|b| &***b).collect();
                    self.launch(&l.src, &refs, &l.params, l.groups)?;
                }
                Step::Zero(b) => {
                    let b = buf(*b)?;
                    let enc =
                        self.encoder.get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
                    enc.clear_buffer(&b, 0, None);
                }
                Step::Copy { src, offset, dst, n } => {
                    if *n > 0 {
                        let (s, d) = (buf(*src)?, buf(*dst)?);
                        let enc =
                            self.encoder.get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
                        enc.copy_buffer_to_buffer(&s, (offset * 4) as u64, &d, 0, (n * 4) as u64);
                    }
                }
            }
        }
        Ok(outs)
    }

    fn host_fallback(
        &mut self,
        g: &Graph,
        n: NodeId,
        inputs: &[Option<&GpuTensor>],
        captures: &[Option<&GpuTensor>],
    ) -> Result<Vec<GpuTensor>, String> {
        let mut get = |ts: &[Option<&GpuTensor>]| -> Result<Vec<Option<Array>>, String> {
            ts.iter().map(|t| t.map(|t| self.download(t)).transpose()).collect()
        };
        let arrays = get(inputs)?;
        let caps = get(captures)?;
        let refs: Vec<Option<&Array>> = arrays.iter().map(Option::as_ref).collect();
        let cap_refs: Vec<Option<&Array>> = caps.iter().map(Option::as_ref).collect();
        let outs = eval_node(g, n, &refs, &cap_refs).map_err(|e| e.to_string())?;
        outs.iter().map(|a| self.upload(a)).collect()
    }
}

/// Per output slot of node `n`: its static shape and type (`None`: omitted or not static).
fn out_descs(g: &Graph, n: NodeId) -> Vec<Option<(Vec<usize>, DType)>> {
    let node = g.node(n);
    (0..node.num_outputs())
        .map(|s| {
            let v = ir::Value::new(n, s as u16);
            let t = g.tensor_type(v)?;
            let dims = t.static_dims()?;
            (!node.outputs()[s].name.is_empty())
                .then(|| (dims.into_iter().map(|d| d.max(0) as usize).collect(), t.dtype))
        })
        .collect()
}

impl GpuExecutor {
    /// The members of `grp` compiled as each would run alone on these outside values.
    fn group_members(&self, g: &Graph, grp: &Group, outside: &[&GpuTensor]) -> Result<Option<Vec<Compiled>>, String> {
        let mut programs: Vec<Compiled> = Vec::with_capacity(grp.nodes.len());
        for (&n, sources) in grp.nodes.iter().zip(&grp.sources) {
            let desc = |s: &Option<Source>| {
                s.map(|s| match s {
                    Source::Outside(o) => {
                        let t = outside[o];
                        TensorDesc { shape: t.shape.clone(), dtype: t.dtype, value: t.host.as_deref() }
                    }
                    Source::Member(m) => {
                        let o = &programs[m].outputs[0];
                        TensorDesc { shape: o.shape.clone(), dtype: o.dtype, value: None }
                    }
                })
            };
            let ins: Vec<Option<TensorDesc<'_>>> = sources.iter().map(desc).collect();
            // A value the compiler reads on the host that is not there: the members run alone.
            if compile::value_inputs(&g.node(n).op)
                .iter()
                .any(|&k| ins.get(k).is_some_and(|t| t.as_ref().is_some_and(|t| t.value.is_none())))
            {
                return Ok(None);
            }
            let cx = CompileCx { ins, outs: out_descs(g, n), opset: g.opset, subgroup: self.subgroup };
            match compile::compile(&g.node(n).op, &cx)? {
                Some(p) => programs.push(p),
                None => return Ok(None),
            }
        }
        Ok(Some(programs))
    }
}

fn to_device_bytes(a: &Array) -> Result<Vec<u8>, String> {
    Ok(match &a.data {
        Data::F32(v) => bytemuck::cast_slice(v).to_vec(),
        Data::F64(v) => {
            let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            bytemuck::cast_slice(&f).to_vec()
        }
        Data::I64(v) => {
            let i: Vec<i32> = v.iter().map(|&x| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32).collect();
            bytemuck::cast_slice(&i).to_vec()
        }
        Data::Bool(v) => {
            let i: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            bytemuck::cast_slice(&i).to_vec()
        }
        // Strings stay on the host (the tensor's host copy); ops on them run there.
        Data::Str(_) => Vec::new(),
    })
}

impl Executor for GpuExecutor {
    type Tensor = GpuTensor;

    fn name(&self) -> String {
        self.adapter.clone()
    }

    fn upload(&mut self, a: &Array) -> Result<GpuTensor, String> {
        let bytes = to_device_bytes(a)?;
        let buf = self.alloc(a.numel());
        if !bytes.is_empty() {
            self.write(&buf, &bytes);
        }
        let host = (a.numel() <= HOST_COPY_LIMIT || !a.dtype.is_float() || a.dtype == DType::String)
            .then(|| Arc::new(a.clone()));
        Ok(GpuTensor { buf, shape: a.shape.clone(), dtype: a.dtype, host })
    }

    fn storage(&self, t: &GpuTensor) -> (usize, u64) {
        (Arc::as_ptr(&t.buf) as usize, t.buf.size())
    }

    fn download(&mut self, t: &GpuTensor) -> Result<Array, String> {
        if let Some(h) = &t.host {
            return Ok((**h).clone());
        }
        let n = t.numel();
        let bytes = self.read(&t.buf, n)?;
        Ok(match t.elem() {
            Elem::F32 => {
                let v: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                let v: Vec<f32> = if matches!(t.dtype, DType::Float16 | DType::Bfloat16) {
                    v.into_iter().map(|x| ir::eval::round_to(t.dtype, x)).collect()
                } else {
                    v
                };
                match t.dtype {
                    DType::Double => {
                        Array::float(DType::Double, t.shape.clone(), v.into_iter().map(f64::from).collect())
                    }
                    d => Array { dtype: d, shape: t.shape.clone(), data: Data::F32(v) },
                }
            }
            Elem::I32 => {
                let v: Vec<i32> = bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                if t.dtype == DType::Bool {
                    Array::bool(t.shape.clone(), v.into_iter().map(|x| x != 0).collect())
                } else {
                    Array::int(t.dtype, t.shape.clone(), v.into_iter().map(i64::from).collect())
                }
            }
        })
    }

    fn run(
        &mut self,
        g: &Graph,
        n: NodeId,
        inputs: &[Option<&GpuTensor>],
        captures: &[Option<&GpuTensor>],
    ) -> Result<(Vec<GpuTensor>, bool), String> {
        // Strings live on the host: ops reading or making them run there.
        let strings = inputs.iter().flatten().any(|t| t.dtype == DType::String)
            || (0..g.node(n).num_outputs())
                .any(|s| g.tensor_type(ir::Value::new(n, s as u16)).is_some_and(|t| t.dtype == DType::String));
        if !g.node(n).op.has_subgraphs()
            && !strings
            && let Some(outs) = self.run_kernel(g, n, inputs)?
        {
            return Ok((outs, false));
        }
        Ok((self.host_fallback(g, n, inputs, captures)?, true))
    }

    fn fuses(&self) -> bool {
        true
    }

    fn fusible(&self, g: &Graph, n: NodeId) -> bool {
        ir::fusion::elementwise(g, n) && !compile::host_only(g.node(n).op.op_type())
    }

    fn run_fused(&mut self, g: &Graph, grp: &Group, outside: &[&GpuTensor]) -> RunFused<GpuTensor> {
        if outside.iter().any(|t| t.dtype == DType::String) {
            return Ok(None);
        }
        let Some(members) = self.group_members(g, grp, outside)? else { return Ok(None) };
        let Some(program) = fused::compile_group(&members, &grp.sources, &grp.outputs) else { return Ok(None) };
        let ins: Vec<Option<&GpuTensor>> = outside.iter().map(|&t| Some(t)).collect();
        Ok(Some(self.execute(&program, &ins)?))
    }

    fn sync(&mut self) {
        self.flush();
        let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
    }

    fn dispatches(&self) -> u64 {
        self.dispatched
    }
}
