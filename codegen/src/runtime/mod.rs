//! The runtime: runs a lowered program, one thread per simulated device.
//!
//! Each device thread owns its executor — the CPU reference kernels, or its own
//! `wgpu::Instance`, device and queue — and runs its graph in order. Communication ops stop at
//! the host: the tensor is read back, exchanged through the [`hub`]'s mailboxes by ring
//! collectives, halo exchanges or point-to-point messages, and uploaded again. Inputs are
//! scattered from host memory straight to each device (its piece only); a pipeline's
//! micro-batches stream through the stages, each stage sending its boundary tensors on as
//! soon as they are ready, and the next micro-batch's inputs are uploaded while the current
//! one computes (the executors queue work asynchronously).

pub mod cpu;
pub mod gpu;
pub mod hub;
mod outcome;
pub use hub::{Hub, Key, Transport};

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use ir::eval::Array;
use ir::reshard::Phase;
use ir::{Graph, NodeId, Op, OpClass, Value};
use serde::{Deserialize, Serialize};

use crate::cut::Cut;
use crate::layout::{assemble, concat, piece, split_even};
use crate::program::{DeviceProgram, Program};
use crate::schedule::Part;

mod accumulate;
pub mod fuse;
mod live;
mod summer;
use accumulate::*;
use live::Live;
use summer::*;

/// Opens a GPU adapter and names it; an error when none opens or this build has no `gpu`
/// feature.
pub fn gpu_adapter() -> Result<String, String> {
    #[cfg(feature = "gpu")]
    {
        gpu::open().map(|(_, _, name)| name)
    }
    #[cfg(not(feature = "gpu"))]
    {
        Err("this shardc was built without the `gpu` feature".into())
    }
}

/// What a GPU adapter can hold, for the check before a run allocates.
#[derive(Clone, Debug)]
pub struct AdapterLimits {
    /// The adapter's name.
    pub name: String,
    /// Its memory is the host's (a CPU or integrated adapter, such as lavapipe).
    pub host_memory: bool,
    /// The largest buffer one tensor may occupy (buffer size and storage binding size).
    pub max_buffer_bytes: u64,
}

/// [`AdapterLimits`] of the adapter [`gpu_adapter`] opens.
pub fn gpu_limits() -> Result<AdapterLimits, String> {
    #[cfg(feature = "gpu")]
    {
        gpu::limits()
    }
    #[cfg(not(feature = "gpu"))]
    {
        Err("this shardc was built without the `gpu` feature".into())
    }
}

/// Host memory one GPU device costs the process, measured: the resident set's growth while a
/// device opens on a fresh instance and compiles a kernel (the driver's state, and on a CPU
/// adapter such as lavapipe its compiler's). `Ok(None)` where the resident set cannot be read;
/// `Err` when no device opens.
pub fn gpu_device_host_bytes() -> Result<Option<u64>, String> {
    #[cfg(feature = "gpu")]
    {
        gpu::device_host_bytes()
    }
    #[cfg(not(feature = "gpu"))]
    {
        Err("this shardc was built without the `gpu` feature".into())
    }
}

/// The memory this process holds now (its resident set, Linux's `VmRSS`), bytes; `None`
/// where the system does not say.
pub fn resident_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

/// A `kB` line of `/proc/self/status`, bytes.
pub fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Bytes of memory the host can still give (Linux's `MemAvailable`); `None` where unknown.
pub fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Which executor runs the devices.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The CPU reference kernels.
    Cpu,
    /// WGSL compute shaders through wgpu, one instance per device.
    Wgpu,
}

/// Why a run failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    /// No wgpu adapter (install a Vulkan driver, e.g. Mesa's lavapipe).
    #[error("no GPU adapter: {0}")]
    NoAdapter(String),
    /// A device failed.
    #[error("device {device}: {message}")]
    Device {
        /// Which.
        device: usize,
        /// What happened.
        message: String,
    },
    /// The inputs do not fit the program.
    #[error("{0}")]
    Input(String),
}

/// One device's account of a run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DeviceReport {
    /// Global id.
    pub device: usize,
    /// The adapter it ran on.
    pub adapter: String,
    /// Wall time of its (last) step, seconds: feed uploads, compute, communication and
    /// result downloads.
    pub wall_s: f64,
    /// Time to upload parameters and constants before the first step, seconds.
    pub setup_s: f64,
    /// Time in compute ops, seconds.
    pub compute_s: f64,
    /// Time in communication, seconds.
    pub communication_s: f64,
    /// Compute time per op type, seconds.
    pub by_op: BTreeMap<String, f64>,
    /// Communication time per kind, seconds.
    pub by_collective: BTreeMap<String, f64>,
    /// Ops the executor ran on the host (no kernel for them), by type.
    pub host_ops: BTreeMap<String, usize>,
    /// Wall time of every step, seconds.
    pub step_wall_s: Vec<f64>,
    /// Kernel dispatches of the last step (0 on the CPU executor, which runs no kernels).
    pub dispatches: u64,
    /// Compute time of the last step per training phase (`forward`, `backward`, `update`;
    /// only `forward` for an inference graph), seconds.
    pub by_phase: BTreeMap<String, f64>,
    /// The most bytes of tensors live on the device at once (parameters, optimizer state,
    /// activations kept for the backward pass, gradients), measured at op boundaries;
    /// kernels' scratch buffers are not counted.
    pub memory_allocated_bytes: u64,
    /// The most bytes of one step's micro-batch values live at once beyond what the device
    /// holds between steps (activations kept for the backward pass, gradients being
    /// accumulated): what a pipeline schedule and recomputation bound.
    pub activation_peak_bytes: u64,
}

/// The result of a run.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// Global outputs of the last step, in graph order (none without
    /// [`RunOptions::outputs_at_end`]).
    pub outputs: Vec<(String, Array)>,
    /// Per step, the outputs named in [`RunOptions::every_step`] (and for the first step
    /// those in [`RunOptions::first_step`]).
    pub per_step: Vec<Vec<(String, Array)>>,
    /// After the last step, the carried state (see [`RunOptions::carry`]) by name.
    pub state: Vec<(String, Array)>,
    /// Per device.
    pub devices: Vec<DeviceReport>,
    /// Wall time of the whole run (device start-up, parameter uploads, every step), seconds.
    pub wall_s: f64,
}

impl RunReport {
    /// The measured step time: the slowest device's wall time of the last step, seconds.
    pub fn step_s(&self) -> f64 {
        self.devices.iter().map(|d| d.wall_s).fold(0.0, f64::max)
    }
}

/// A device-side tensor store.
pub trait Executor {
    /// A tensor on the device.
    type Tensor: Clone;
    /// Describes the device (adapter name).
    fn name(&self) -> String;
    /// Copies a host array to the device.
    fn upload(&mut self, a: &Array) -> Result<Self::Tensor, String>;
    /// Copies a device tensor to the host.
    fn download(&mut self, t: &Self::Tensor) -> Result<Array, String>;
    /// Moves a device tensor no longer needed on the device to the host (where the device
    /// is the host, without a copy).
    fn take(&mut self, t: Self::Tensor) -> Result<Array, String> {
        self.download(&t)
    }
    /// The tensor itself where the device is the host (nothing to download).
    fn on_host<'t>(&self, _t: &'t Self::Tensor) -> Option<&'t Array> {
        None
    }
    /// Moves a host array to the device (where the device is the host, without a copy).
    fn upload_owned(&mut self, a: Array) -> Result<Self::Tensor, String> {
        self.upload(&a)
    }
    /// Runs one (non-communication) op on its inputs and the values its subgraphs read
    /// (`captures`, control flow only). Returns its outputs and whether it ran on the host.
    fn run(
        &mut self,
        g: &Graph,
        n: NodeId,
        inputs: &[Option<&Self::Tensor>],
        captures: &[Option<&Self::Tensor>],
    ) -> Result<(Vec<Self::Tensor>, bool), String>;
    /// Whether the executor runs element-wise fusion groups ([`fuse`]) as one kernel.
    fn fuses(&self) -> bool {
        false
    }
    /// Whether op `n` may run inside a fused element-wise group here (never where
    /// [`Executor::fuses`] is false).
    fn fusible(&self, _g: &Graph, _n: NodeId) -> bool {
        false
    }
    /// Runs a group of element-wise ops as one kernel on its outside values (in
    /// [`fuse::Group::outside`]'s order): the values of [`fuse::Group::outputs`], or `None`
    /// where no single kernel computes the group (its members then run one by one).
    fn run_fused(&mut self, _g: &Graph, _grp: &fuse::Group, _outside: &[&Self::Tensor]) -> RunFused<Self::Tensor> {
        Ok(None)
    }
    /// Waits until queued work is done (for timing).
    fn sync(&mut self) {}
    /// Kernel dispatches encoded since the device opened (0 where it runs no kernels).
    fn dispatches(&self) -> u64 {
        0
    }
    /// The storage a tensor occupies: an identity shared by views of one allocation, and
    /// its bytes.
    fn storage(&self, t: &Self::Tensor) -> (usize, u64);
    /// `acc += b` where `acc` lies, when the device can (a float32 tensor nothing else holds),
    /// summing as the `Add` kernel does; `false` leaves both as they were, for the caller to
    /// add into a new tensor.
    fn add_in_place(&mut self, _acc: &mut Self::Tensor, _b: &Self::Tensor) -> bool {
        false
    }
    /// `acc ·= k` where `acc` lies, as [`Executor::add_in_place`] (`k` rounded to float32, as
    /// the `Mul` kernel's scalar operand).
    fn scale_in_place(&mut self, _acc: &mut Self::Tensor, _k: f64) -> bool {
        false
    }
}

/// What [`Executor::run_fused`] gives.
pub type RunFused<T> = Result<Option<Vec<T>>, String>;

/// Options of a run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The executor.
    pub backend: Backend,
    /// Longest a device waits for another before the run is declared stuck.
    pub timeout: Duration,
    /// Steps to run on the same devices (at least 1); the report times the last, after
    /// the earlier ones have compiled the kernels.
    pub steps: usize,
    /// State carried from one step to the next: `(initializer, output)` by global name —
    /// after each step the initializer takes the output's value, on the device, in place
    /// (a training graph's parameters, optimizer state and step counter).
    pub carry: Vec<(String, String)>,
    /// Outputs downloaded after every step (a training step's loss); the others only after
    /// the last.
    pub every_step: Vec<String>,
    /// Outputs also downloaded after the first step (a training step's gradients).
    pub first_step: Vec<String>,
    /// Download every output after the last step (`true` by default; a run whose last step
    /// only measures the loss leaves the others on the devices).
    pub outputs_at_end: bool,
    /// Steps whose carried state is applied (`None`: every step); a later step runs on the
    /// state as it then is (the loss after the last update).
    pub updates: Option<usize>,
    /// Called by device 0 after each step (for progress displays).
    pub on_step: StepHook,
    /// Run one device of the program in this process, the others elsewhere (`None`: every
    /// device here, on threads, through a [`Hub`]).
    pub distributed: Option<Distributed>,
    /// Chains of element-wise ops run as one kernel where the executor can ([`fuse`]); by
    /// default unless `SHARDC_NO_FUSION` is set.
    pub fusion: bool,
    /// Under gradient accumulation, per micro-batch its weight in the step's mean (summing to
    /// 1): a loss averaged over the labels each micro-batch counts (ignored labels, class
    /// weights) is the whole batch's when each micro-batch's mean weighs by its count
    /// (`passes::counted`). `None`: every micro-batch weighs the same.
    pub micro_weights: Option<Vec<f64>>,
}

/// One process's part of a program spread over processes (one device each): its device and
/// the transport to the others. Device 0's process assembles the report.
#[derive(Clone)]
pub struct Distributed {
    /// The device this process runs (its rank).
    pub rank: usize,
    /// Processes (= the program's devices).
    pub size: usize,
    /// Messages between processes.
    pub transport: std::sync::Arc<dyn Transport + Send>,
}

impl std::fmt::Debug for Distributed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Distributed {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

/// A callback `(steps done, steps)` after each step of a run; none by default.
#[derive(Clone, Default)]
pub struct StepHook(Option<std::sync::Arc<dyn Fn(usize, usize) + Send + Sync>>);

impl StepHook {
    /// A hook that calls `f`.
    pub fn new(f: impl Fn(usize, usize) + Send + Sync + 'static) -> StepHook {
        StepHook(Some(std::sync::Arc::new(f)))
    }

    fn call(&self, done: usize, of: usize) {
        if let Some(f) = &self.0 {
            f(done, of);
        }
    }
}

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "StepHook(set)" } else { "StepHook(none)" })
    }
}

impl RunOptions {
    /// Whether output `name` is kept after step `step` beside the last step's outputs (the
    /// loss of every step, the first step's gradients).
    fn kept_at(&self, step: usize, name: &str) -> bool {
        self.every_step.iter().any(|n| n == name) || (step == 0 && self.first_step.iter().any(|n| n == name))
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            backend: Backend::Wgpu,
            timeout: Duration::from_secs(300),
            steps: 1,
            carry: Vec::new(),
            every_step: Vec::new(),
            first_step: Vec::new(),
            outputs_at_end: true,
            updates: None,
            on_step: StepHook::default(),
            fusion: std::env::var_os("SHARDC_NO_FUSION").is_none(),
            distributed: None,
            micro_weights: None,
        }
    }
}

/// Per device, per micro-batch, its feeds: local input name → array.
type Feeds = Vec<Vec<HashMap<String, Array>>>;

fn scatter(p: &Program, inputs: &HashMap<String, Array>) -> Result<Feeds, RuntimeError> {
    let m = p.micro_batches.max(1);
    // Each global input split into micro-batches.
    let mut micro: HashMap<&str, Vec<Array>> = HashMap::new();
    for gi in &p.inputs {
        let a = inputs.get(&gi.name).ok_or_else(|| RuntimeError::Input(format!("no value for input `{}`", gi.name)))?;
        if a.shape != gi.shape {
            return Err(RuntimeError::Input(format!(
                "input `{}` has shape {:?}, the program expects {:?}",
                gi.name, a.shape, gi.shape
            )));
        }
        let parts = match gi.batch_axis {
            Some(ax) if m > 1 => split_even(a, ax, m),
            _ => vec![a.clone(); m],
        };
        micro.insert(&gi.name, parts);
    }
    Ok(p.devices
        .iter()
        .map(|d| {
            let (mesh, rank) = p.mesh_of(d.device);
            let coords = mesh.coords(rank);
            (0..m)
                .map(|k| {
                    d.feeds
                        .iter()
                        .map(|f| (f.local.clone(), piece(&micro[f.global.as_str()][k], &f.layout, mesh, &coords)))
                        .collect()
                })
                .collect()
        })
        .collect())
}

/// Runs a program on `inputs` (global graph inputs by name).
pub fn run(p: &Program, inputs: &HashMap<String, Array>, opts: &RunOptions) -> Result<RunReport, RuntimeError> {
    if let Some(d) = &opts.distributed {
        return run_distributed(p, inputs, opts, d);
    }
    let feeds = scatter(p, inputs)?;
    let hub = hub::Hub::new(opts.timeout);
    let start = Instant::now();
    let results: Vec<Result<DeviceOutcome, RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = p
            .devices
            .iter()
            .zip(feeds)
            .map(|(d, f)| {
                let hub = &hub;
                let backend = opts.backend;
                s.spawn(move || {
                    // A device that panics fails the run (its peers are told) instead of
                    // leaving them waiting.
                    let _ = backend;
                    run_one(d, f, p, opts, hub)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(RuntimeError::Input("a device thread panicked".into()))))
            .collect()
    });
    let wall_s = start.elapsed().as_secs_f64();
    report_of(p, opts, results, wall_s)
}

/// Runs device `d` of `p` on `feeds` through `t`, on the backend of `opts`; a failure (or a
/// panic) is told to the other devices through `t`.
fn run_one(
    d: &DeviceProgram,
    feeds: Vec<HashMap<String, Array>>,
    p: &Program,
    opts: &RunOptions,
    t: &dyn Transport,
) -> Result<DeviceOutcome, RuntimeError> {
    // A device that panics fails the run (its peers are told) instead of leaving them
    // waiting.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match opts.backend {
        Backend::Cpu => drive(&mut cpu::CpuExecutor::new(), d, feeds, p, opts, t),
        #[cfg(feature = "gpu")]
        Backend::Wgpu => match gpu::GpuExecutor::new() {
            Ok(mut e) => drive(&mut e, d, feeds, p, opts, t),
            Err(e) => Err(RuntimeError::NoAdapter(e)),
        },
        #[cfg(not(feature = "gpu"))]
        Backend::Wgpu => Err(RuntimeError::NoAdapter("this shardc was built without the `gpu` feature".into())),
    }))
    .unwrap_or_else(|_| {
        Err(RuntimeError::Device { device: d.device, message: "internal error: the device panicked".into() })
    });
    if let Err(e) = &r {
        t.fail(e.to_string());
    }
    r
}

/// The key under which device `rank` sends its outcome's `i`-th message to device 0.
fn gather_key(rank: usize, i: usize) -> Key {
    (u64::MAX - 1, rank as u64, i as u64)
}

/// One process's device of a distributed run: runs it, then device 0 gathers every device's
/// outcome and assembles the report as a one-process run would; the other processes return
/// their own device's report alone (no outputs).
fn run_distributed(
    p: &Program,
    inputs: &HashMap<String, Array>,
    opts: &RunOptions,
    dist: &Distributed,
) -> Result<RunReport, RuntimeError> {
    if p.devices.len() != dist.size {
        return Err(RuntimeError::Input(format!(
            "the program has {} devices but {} processes run it (one device each)",
            p.devices.len(),
            dist.size
        )));
    }
    let t: &dyn Transport = dist.transport.as_ref();
    let feed = scatter(p, inputs)?.into_iter().nth(dist.rank).expect("a feed per device");
    let d = &p.devices[dist.rank];
    let start = Instant::now();
    let mine = run_one(d, feed, p, opts, t)?;
    if dist.rank != 0 {
        for (i, a) in outcome::encode(&mine).into_iter().enumerate() {
            t.put(dist.rank, 0, gather_key(dist.rank, i), a);
        }
        let (_, report, _) = mine;
        return Ok(RunReport {
            outputs: Vec::new(),
            per_step: Vec::new(),
            state: Vec::new(),
            devices: vec![report],
            wall_s: start.elapsed().as_secs_f64(),
        });
    }
    let mut results = vec![Ok(mine)];
    for rank in 1..dist.size {
        let got = outcome::decode(|i| t.take(rank, 0, gather_key(rank, i)))
            .map_err(|message| RuntimeError::Device { device: rank, message })?;
        results.push(Ok(got));
    }
    report_of(p, opts, results, start.elapsed().as_secs_f64())
}

/// The report of a run from every device's outcome (in device order).
fn report_of(
    p: &Program,
    opts: &RunOptions,
    results: Vec<Result<DeviceOutcome, RuntimeError>>,
    wall_s: f64,
) -> Result<RunReport, RuntimeError> {
    // Report the first real failure (others may only say they were stopped).
    let mut per_device = Vec::new();
    let mut first_err: Option<RuntimeError> = None;
    for r in results {
        match r {
            Ok(x) => per_device.push(x),
            Err(e) => {
                let stopped = matches!(&e, RuntimeError::Device { message, .. } if message.starts_with("stopped:"));
                if first_err.is_none()
                    || (!stopped
                        && matches!(&first_err, Some(RuntimeError::Device { message, .. }) if message.starts_with("stopped:")))
                {
                    first_err = Some(e);
                }
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    // Assemble the outputs: those of the last step, and per step those kept. The devices'
    // results move into them.
    let steps = per_device.first().map_or(0, |x| x.0.len());
    let mut per_step = Vec::with_capacity(steps);
    let mut outputs = Vec::new();
    for step in 0..steps {
        let mut outs: Vec<&mut Vec<Vec<(String, Array)>>> = per_device.iter_mut().map(|x| &mut x.0[step]).collect();
        let all = step + 1 == steps && opts.outputs_at_end;
        // Under gradient accumulation a device returns one set of results per step.
        let parts = if accumulates(p, opts) { 1 } else { p.micro_batches.max(1) };
        let got = assemble_outputs(p, &p.outputs, parts, &mut outs, all)?;
        if all {
            per_step.push(got.iter().filter(|(n, _)| opts.kept_at(step, n)).cloned().collect());
            outputs = got;
        } else {
            per_step.push(got.into_iter().filter(|(n, _)| opts.kept_at(step, n)).collect());
        }
    }
    // The carried state, assembled in the layout of the output it takes its value from.
    let mut state = Vec::new();
    for (init, next) in &opts.carry {
        let Some(go) = p.outputs.iter().find(|o| &o.name == next) else {
            return Err(RuntimeError::Input(format!("carried state `{init}`: no output `{next}`")));
        };
        let mut outs: Vec<Vec<Vec<(String, Array)>>> = per_device
            .iter_mut()
            .enumerate()
            .map(|(dev, x)| {
                let dp = &p.devices[dev];
                let taken = x.2.iter().position(|(n, _)| n == init).map(|i| x.2.swap_remove(i).1);
                let locals = dp.results.iter().filter(|r| &r.global == next).map(|r| r.local.clone());
                vec![locals.zip(taken).collect()]
            })
            .collect();
        let mut refs: Vec<&mut Vec<Vec<(String, Array)>>> = outs.iter_mut().collect();
        let mut got = assemble_outputs(p, std::slice::from_ref(go), 1, &mut refs, true)?;
        state.push((init.clone(), got.pop().expect("one output").1));
    }
    Ok(RunReport { outputs, per_step, state, devices: per_device.into_iter().map(|x| x.1).collect(), wall_s })
}

/// The global outputs of one step from each device's results (per micro-batch), which move
/// into them (a result two outputs share is copied).
fn assemble_outputs(
    p: &Program,
    gos: &[crate::program::GlobalValue],
    m: usize,
    per_device: &mut [&mut Vec<Vec<(String, Array)>>],
    require: bool,
) -> Result<Vec<(String, Array)>, RuntimeError> {
    // Per device and result, the outputs still to read it: the last one takes it.
    let mut readers: HashMap<(usize, &str), usize> = HashMap::new();
    for (dev, dp) in p.devices.iter().enumerate().take(per_device.len()) {
        for r in dp.results.iter().filter(|r| gos.iter().any(|go| go.name == r.global)) {
            *readers.entry((dev, r.local.as_str())).or_default() += 1;
        }
    }
    let mut outputs = Vec::new();
    for go in gos {
        let mut micro_parts = Vec::with_capacity(m);
        for k in 0..m {
            // The devices holding pieces of this output, in stage-mesh order.
            let mut holders: Vec<(usize, Array, &ir::shard::Sharding, usize)> = Vec::new();
            for (dev, outs) in per_device.iter_mut().enumerate() {
                let dp = &p.devices[dev];
                for r in dp.results.iter().filter(|r| r.global == go.name) {
                    // Another output reads the same result later: copy it.
                    let left = readers.get(&(dev, r.local.as_str())).copied().unwrap_or(0);
                    let shared = left > 1;
                    if k + 1 == m {
                        readers.insert((dev, r.local.as_str()), left.saturating_sub(1));
                    }
                    let Some(o) = outs.get_mut(k) else { continue };
                    let Some(i) = o.iter().position(|(n, _)| *n == r.local) else { continue };
                    let a = if shared { o[i].1.clone() } else { o.swap_remove(i).1 };
                    holders.push((dp.rank, a, &r.layout, dp.stage));
                }
            }
            let Some((layout, stage)) = holders.first().map(|h| (h.2, h.3)) else {
                if k == 0 && !require {
                    break;
                }
                return Err(RuntimeError::Input(format!("no device produced output `{}`", go.name)));
            };
            let mesh = &p.meshes[stage];
            // A value every stage computes (a step counter) is taken from the first stage
            // that delivers it.
            holders.retain(|h| h.3 == stage);
            holders.sort_by_key(|h| h.0);
            let mut shape = go.shape.clone();
            if let Some(ax) = go.batch_axis
                && m > 1
            {
                shape[ax] /= m;
            }
            for h in &holders {
                let (piece, c) = (&h.1, mesh.coords(h.0));
                let fits = piece.shape.len() == shape.len()
                    && (0..shape.len()).all(|d| {
                        let (a, b) = crate::layout::dim_range(layout, mesh, &c, d, shape[d]);
                        piece.shape[d] == b - a
                    });
                if !fits {
                    return Err(RuntimeError::Input(format!(
                        "output `{}` came out as {:?} on device rank {}, but the program declares {:?} (an op computed another shape than inference gave it)",
                        go.name, piece.shape, h.0, shape
                    )));
                }
            }
            let pieces: Vec<Array> = holders.into_iter().map(|h| h.1).collect();
            micro_parts.push(assemble(pieces, layout, mesh, &shape));
        }
        if micro_parts.is_empty() {
            continue;
        }
        let whole = match go.batch_axis {
            Some(ax) if m > 1 => concat(&micro_parts, ax),
            _ => micro_parts.pop().expect("one micro-batch"),
        };
        let whole = Array { dtype: go.dtype, ..whole };
        outputs.push((go.name.clone(), whole));
    }
    Ok(outputs)
}

/// Per step, per micro-batch, a device's results; its report; and its carried state after
/// the last step (by the initializer's global name).
type DeviceOutcome = (Vec<Vec<Vec<(String, Array)>>>, DeviceReport, Vec<(String, Array)>);

/// The training phase of each op of a device program, as the lowering recorded it
/// ([`crate::DeviceProgram::phase_of`]): `update` for optimizer ops, `backward` for the
/// backward pass and gradient synchronisation, `forward` for the rest (a forward model's
/// program is all `forward`).
fn phases(d: &DeviceProgram) -> HashMap<NodeId, &'static str> {
    let g = &d.graph;
    g.node_ids()
        .map(|n| {
            let phase = match d.phase_of.get(&n) {
                _ if g.node(n).op.is_update() => "update",
                Some(Phase::Backward | Phase::Gradient) => "backward",
                _ => "forward",
            };
            (n, phase)
        })
        .collect()
}

/// After the forward part of a chunk that recomputes: frees its values (`chunk` says which
/// are its) but what it received and what `kept` holds; the rest is computed again before
/// its backward part.
fn drop_recomputed<E: Executor>(
    e: &E,
    g: &Graph,
    env: &mut HashMap<Value, E::Tensor>,
    live: &mut Live,
    kept: &dyn Fn(&Value) -> bool,
    chunk: impl Fn(&Value) -> bool,
) {
    let dropped: Vec<Value> =
        env.keys().copied().filter(|v| !kept(v) && chunk(v) && !crate::cut::stashed(g, *v)).collect();
    for v in dropped {
        if let Some(t) = env.remove(&v) {
            live.remove(e.storage(&t));
        }
    }
}

/// The values an op of another model chunk than the one that computes them reads, or that
/// ops of two chunks read (under the interleaved schedule: what every chunk computes for
/// itself is computed once, in the first).
fn cross_chunk_reads(g: &ir::Graph, order: &[ir::NodeId], cut: &Cut) -> std::collections::HashSet<Value> {
    let mut readers: HashMap<Value, usize> = HashMap::new();
    let mut out = std::collections::HashSet::new();
    if cut.chunk_of.is_empty() {
        return out;
    }
    for &n in order {
        let c = cut.chunk(n);
        for &v in g.node(n).inputs().iter().flatten() {
            let first = *readers.entry(v).or_insert(c);
            if first != c || cut.chunk(v.node) != c {
                out.insert(v);
            }
        }
    }
    out
}

/// Runs one device's program for every step and micro-batch.
///
/// Gradient accumulation: with carried state and several micro-batches, the optimizer
/// update and what follows from it run once per step, after every micro-batch. The float
/// values they read that depend on the step's inputs (the gradients) are the mean over the
/// micro-batches, summed on the device; values that do not (the step counter) are the last
/// micro-batch's. The step's float scalar results (the loss) are the mean over the
/// micro-batches. The mean is the full batch's gradient when the loss is a mean over the
/// samples and every micro-batch counts the same number of them; where they count different
/// numbers of labels (ignored labels, class weights) the mean weighs each by its count
/// ([`RunOptions::micro_weights`]), and a micro-batch that counts none adds nothing.
fn drive<E: Executor>(
    e: &mut E,
    d: &DeviceProgram,
    feeds: Vec<HashMap<String, Array>>,
    p: &Program,
    opts: &RunOptions,
    hub: &dyn Transport,
) -> Result<DeviceOutcome, RuntimeError> {
    let err = |message: String| RuntimeError::Device { device: d.device, message };
    let g = &d.graph;
    let steps = opts.steps.max(1);
    let order = g.topo_order().map_err(|_| err("the graph has a cycle".into()))?;
    let phase = phases(d);
    let mut port = hub::Port::new(hub, d.device);
    let mut report = DeviceReport { device: d.device, adapter: e.name(), ..Default::default() };
    let start = Instant::now();
    let carries = carried_state(g, d, opts).map_err(err)?;
    let once = crate::cut::once_per_device(p, accumulates(p, opts)).swap_remove(d.device);
    let cut = Cut::new(p, d.device, &order, once);
    // What the backward part reads: kept through the forward part.
    let backward_reads: std::collections::HashSet<Value> =
        cut.backward.iter().flat_map(|&n| g.node(n).inputs().iter().flatten().copied()).collect();
    // What the ops of another chunk than its own read: kept until the micro-batch ends.
    let shared = cross_chunk_reads(g, &order, &cut);
    let acc = accumulates(p, opts).then(|| Accumulation::for_step(g, &order, cut.once.clone(), &carries));
    // (One micro-batch — a pipeline that does not cut the batch — updates it once a step.)
    if let Some(a) = &acc
        && p.micro_batches > 1
        && let Some((name, _, _)) = carries.iter().find(|c| !a.once.contains(&c.2.node) && a.fed.contains(&c.2))
    {
        return Err(err(format!(
            "carried state `{name}` is updated by every micro-batch (as BatchNorm's running statistics are), \
             so steps over several micro-batches would not equal one step over the whole batch"
        )));
    }
    let keep = kept_values(g, d, &carries, acc.as_ref());
    let mut last_use = g.last_uses(&order);
    let held = |v: &Value| keep.contains(v) || shared.contains(v);
    let fusion = fuse::Fusion::of_device(&*e, g, &order, &cut, opts.fusion, &held);
    fusion.delay_last_uses(&order, &mut last_use);
    let movable = movable_results(g, d, &carries);
    // Parameters and constants are uploaded once.
    let mut live = Live { by_storage: HashMap::new(), bytes: 0, peak: 0, base: u64::MAX, act_peak: 0 };
    let mut fixed = upload_fixed(e, g, &order, &mut live).map_err(err)?;
    let mut accd = Accumulated { weights: opts.micro_weights.clone(), ..Default::default() };
    let setup_s = start.elapsed().as_secs_f64();
    let mut outs_steps = Vec::with_capacity(steps);
    let mut step_start = Instant::now();
    for step in 0..steps {
        let last = step + 1 == steps;
        if last {
            // Only the last step is reported: earlier ones warm the kernel caches.
            report.by_op.clear();
            report.by_collective.clear();
            report.host_ops.clear();
            report.by_phase.clear();
        }
        step_start = Instant::now();
        let dispatched = e.dispatches();
        let fetch_all = last && opts.outputs_at_end;
        let wanted = |r: &crate::program::Result_| fetch_all || opts.kept_at(step, &r.global);
        let mut outs_micro = Vec::with_capacity(feeds.len());
        let mut next_state: Vec<(Value, E::Tensor)> = Vec::new();
        accd.start_step();
        // Per micro-batch in flight: its values, and its inputs (uploaded before its first
        // part runs, the next micro-batch's queued while this one computes).
        let mut envs: HashMap<usize, HashMap<Value, E::Tensor>> = HashMap::new();
        let mut uploaded: HashMap<usize, HashMap<String, E::Tensor>> = HashMap::new();
        let mut cx = NodeRun { e: &mut *e, g, port: &mut port, report: &mut report, phase: &phase };
        live.base = live.bytes;
        for (idx, &it) in cut.items.iter().enumerate() {
            let (part, k, c) = (it.part, it.micro, it.chunk);
            let recomputes = cut.recomputes(c);
            for j in [k, k + 1] {
                if (j == k || part != Part::Backward)
                    && !uploaded.contains_key(&j)
                    && let Some(feed) = feeds.get(j)
                {
                    let t = upload_feed(cx.e, feed).map_err(err)?;
                    uploaded.insert(j, t);
                }
            }
            let inputs = &uploaded[&k];
            let mut env = envs.remove(&k).unwrap_or_default();
            // Under recomputation the forward part runs again (without its messages).
            let rerun = cut.reruns(it);
            let passes: &[(Part, bool)] =
                if rerun { &[(Part::Forward, true), (part, false)] } else { &[(part, false)] };
            for &(pass, again) in passes {
                for (i, &n) in order.iter().enumerate() {
                    if !cut.runs_in(n, pass, c) {
                        continue;
                    }
                    if let Some(grp) = fusion.root(n) {
                        let produced = cx.fused(grp, &mut env, &fixed, inputs, k, &mut live).map_err(err)?;
                        cx.store(produced, &mut env, &mut live);
                    } else if !(fusion.deferred(n) || again && matches!(g.node(n).op, Op::Send(_) | Op::Recv(_))) {
                        // (A recomputed part sends and receives nothing again.)
                        let produced = cx.node(n, &env, &fixed, inputs, k).map_err(err)?;
                        cx.store(produced, &mut env, &mut live);
                    }
                    // Values no later op reads are freed (under recomputation not what the
                    // forward part received: it runs again from them; nor, in a forward part,
                    // what the backward part reads: an op later in the order may run in the
                    // forward part, as one a gradient rule adds that reads forward values only).
                    // (Nor what another chunk reads, until the micro-batch ends.)
                    let held = |v: &Value| {
                        keep.contains(v)
                            || shared.contains(v)
                            || (pass == Part::Forward
                                && (backward_reads.contains(v) || (recomputes && crate::cut::stashed(g, *v))))
                    };
                    for v in &fusion.reads(g, n) {
                        if last_use.get(v) == Some(&i)
                            && !held(v)
                            && let Some(t) = env.remove(v)
                        {
                            live.remove(cx.e.storage(&t));
                        }
                    }
                }
            }
            if cut.drops(it) {
                let kept = |v: &Value| keep.contains(v) || shared.contains(v);
                drop_recomputed(cx.e, g, &mut env, &mut live, &kept, cut.chunk_values(c));
            }
            if !cut.last[idx] {
                envs.insert(k, env);
                continue;
            }
            uploaded.remove(&k);
            let mut outs = Vec::new();
            match &acc {
                None => {
                    // The env is dropped after this: its values move out rather than copy.
                    for r in d.results.iter().filter(|r| wanted(r)) {
                        let x = match g.lookup(&r.local).filter(|v| movable.contains(v)).and_then(|v| env.remove(&v)) {
                            Some(t) => {
                                live.remove(cx.e.storage(&t));
                                cx.e.take(t)
                            }
                            None => cx.e.download(result(g, &r.local, &env, &fixed).map_err(err)?),
                        };
                        outs.push((r.local.clone(), x.map_err(err)?));
                    }
                    for (_, iv, nv) in &carries {
                        let t =
                            env.remove(nv).ok_or_else(|| err(format!("`{}` was not computed", g.value_name(*nv))))?;
                        live.remove(cx.e.storage(&t));
                        next_state.push((*iv, t));
                    }
                }
                Some(a) => accd.take_micro(&mut cx, a, &env, &fixed, &mut live, d, &wanted, k).map_err(err)?,
            }
            outs_micro.push(outs);
            for (_, t) in env.drain() {
                live.remove(cx.e.storage(&t));
            }
        }
        live.base = u64::MAX;
        if let Some(a) = &acc {
            let (outs, next) = accd
                .finish_step(&mut cx, a, &order, &fixed, &mut live, d, &wanted, &carries, feeds.len())
                .map_err(err)?;
            outs_micro = vec![outs];
            next_state.extend(next);
        }
        // The state takes its next values, on the device.
        if opts.updates.is_some_and(|u| step >= u) {
            next_state.clear();
        }
        for (iv, t) in next_state {
            live.add(e.storage(&t));
            if let Some(old) = fixed.insert(iv, t) {
                live.remove(e.storage(&old));
            }
        }
        e.sync();
        report.step_wall_s.push(step_start.elapsed().as_secs_f64());
        report.dispatches = e.dispatches() - dispatched;
        if d.device == 0 {
            opts.on_step.call(step + 1, steps);
        }
        outs_steps.push(outs_micro);
    }
    report.wall_s = step_start.elapsed().as_secs_f64();
    report.setup_s = setup_s;
    report.compute_s = report.by_op.values().sum();
    report.communication_s = report.by_collective.values().sum();
    report.memory_allocated_bytes = live.peak;
    report.activation_peak_bytes = live.act_peak;
    let mut state = Vec::new();
    for (name, iv, _) in &carries {
        let t = fixed.remove(iv).ok_or_else(|| err(format!("carried state `{name}` was not kept")))?;
        state.push((name.clone(), e.take(t).map_err(err)?));
    }
    Ok((outs_steps, report, state))
}

/// Values kept to the end of a micro-batch: results, carried values and, under gradient
/// accumulation, the values the once-per-step ops read.
fn kept_values(
    g: &Graph,
    d: &DeviceProgram,
    carries: &[(String, Value, Value)],
    acc: Option<&Accumulation>,
) -> std::collections::HashSet<Value> {
    let mut keep: std::collections::HashSet<Value> = carries.iter().map(|c| c.2).collect();
    keep.extend(acc.iter().flat_map(|a| a.boundary.iter().copied()));
    for r in &d.results {
        if let Some(v) = g.lookup(&r.local) {
            keep.insert(v);
        }
    }
    keep
}

/// Results that may move out of a finished micro-batch's values: those named once and not
/// carried to the next step.
fn movable_results(
    g: &Graph,
    d: &DeviceProgram,
    carries: &[(String, Value, Value)],
) -> std::collections::HashSet<Value> {
    let mut named: HashMap<Value, usize> = HashMap::new();
    for v in d.results.iter().filter_map(|r| g.lookup(&r.local)) {
        *named.entry(v).or_default() += 1;
    }
    named.into_iter().filter(|&(v, k)| k == 1 && !carries.iter().any(|c| c.2 == v)).map(|(v, _)| v).collect()
}

/// The parameters and constants of `g`, uploaded once and counted in `live`: initializers,
/// input defaults, and Constant ops (their value never changes; run as ops, each micro-batch
/// of each step would make it on the host and upload it again).
fn upload_fixed<E: Executor>(
    e: &mut E,
    g: &Graph,
    order: &[NodeId],
    live: &mut Live,
) -> Result<HashMap<Value, E::Tensor>, String> {
    let mut fixed: HashMap<Value, E::Tensor> = HashMap::new();
    for &n in order {
        if let Op::Initializer(t) | Op::Input { default: Some(t) } = &g.node(n).op {
            let a =
                Array::from_tensor(t).map_err(|x| format!("initializer `{}`: {x}", g.value_name(Value::new(n, 0))))?;
            let t = e.upload_owned(a)?;
            live.add(e.storage(&t));
            fixed.insert(Value::new(n, 0), t);
        }
        if matches!(g.node(n).op, Op::Constant(_)) && g.node(n).inputs().is_empty() {
            let outs = ir::eval::eval_node(g, n, &[], &[]).map_err(|x| format!("{}: {x}", g.describe(n)))?;
            for (slot, a) in outs.into_iter().enumerate() {
                let t = e.upload_owned(a)?;
                live.add(e.storage(&t));
                fixed.insert(Value::new(n, slot as u16), t);
            }
        }
    }
    Ok(fixed)
}

/// Runs single ops of one device's program, recording their times.
struct NodeRun<'a, 'h, E: Executor> {
    e: &'a mut E,
    g: &'a Graph,
    port: &'a mut hub::Port<'h>,
    report: &'a mut DeviceReport,
    phase: &'a HashMap<NodeId, &'static str>,
}

impl<E: Executor> NodeRun<'_, '_, E> {
    /// Runs op `n` of micro-batch `micro` on the values computed so far (`env`), the
    /// parameters (`fixed`) and the micro-batch's inputs; its outputs.
    fn node(
        &mut self,
        n: NodeId,
        env: &HashMap<Value, E::Tensor>,
        fixed: &HashMap<Value, E::Tensor>,
        inputs: &HashMap<String, E::Tensor>,
        micro: usize,
    ) -> Result<Vec<(Value, E::Tensor)>, String> {
        let (g, e) = (self.g, &mut *self.e);
        let node = g.node(n);
        let mut produced: Vec<(Value, E::Tensor)> = Vec::new();
        match &node.op {
            Op::Input { default: None } => {
                let name = g.value_name(Value::new(n, 0));
                let t = inputs.get(name).ok_or_else(|| format!("no feed for `{name}`"))?;
                produced.push((Value::new(n, 0), t.clone()));
            }
            Op::Initializer(_) | Op::Input { .. } => {}
            // Made once, with the parameters.
            Op::Constant(_) if fixed.contains_key(&Value::new(n, 0)) => {}
            op if op.class() == OpClass::Comm && alone(op) => {
                // A collective over a group of one device leaves its operand as it is: no
                // copies to the host and back (the cost model prices none).
                if let Some(v) = node.input(0) {
                    let t = env.get(&v).or_else(|| fixed.get(&v)).ok_or("a comm input was not computed")?;
                    produced.push((Value::new(n, 0), t.clone()));
                }
            }
            op if op.class() == OpClass::Comm => {
                let t0 = Instant::now();
                // The operand as a host array: the tensor itself on the CPU, else a download.
                let t = match node.input(0) {
                    Some(v) => Some(env.get(&v).or_else(|| fixed.get(&v)).ok_or_else(|| {
                        format!("`{}` (read by {}) was not computed", g.value_name(v), g.describe(n))
                    })?),
                    None => None,
                };
                let downloaded = match t {
                    Some(t) if e.on_host(t).is_none() => Some(e.download(t)?),
                    _ => None,
                };
                let x = downloaded.as_ref().or_else(|| t.and_then(|t| e.on_host(t)));
                if let Some(a) = collective(self.port, op, x, micro)? {
                    produced.push((Value::new(n, 0), e.upload_owned(a)?));
                }
                *self.report.by_collective.entry(op.op_type().to_string()).or_insert(0.0) += t0.elapsed().as_secs_f64();
            }
            op => {
                let ins: Vec<Option<&E::Tensor>> =
                    node.inputs().iter().map(|i| i.and_then(|v| env.get(&v).or_else(|| fixed.get(&v)))).collect();
                if let Some((v, _)) = node.inputs().iter().zip(&ins).find(|(i, t)| i.is_some() && t.is_none()) {
                    let v = v.expect("present");
                    return Err(format!("{}: its input `{}` was not computed", g.describe(n), g.value_name(v)));
                }
                let caps: Vec<Option<&E::Tensor>> =
                    node.captures().iter().map(|v| env.get(v).or_else(|| fixed.get(v))).collect();
                if caps.iter().any(Option::is_none) {
                    return Err(format!("{}: a value its subgraph reads was not computed", g.describe(n)));
                }
                let t0 = Instant::now();
                let (outs, host) = e.run(g, n, &ins, &caps).map_err(|m| format!("{}: {m}", g.describe(n)))?;
                e.sync();
                self.timed(op.op_type(), n, t0.elapsed().as_secs_f64());
                if host {
                    *self.report.host_ops.entry(op.op_type().to_string()).or_insert(0) += 1;
                }
                for (slot, t) in outs.into_iter().enumerate() {
                    if slot < node.num_outputs() && !node.outputs()[slot].name.is_empty() {
                        produced.push((Value::new(n, slot as u16), t));
                    }
                }
            }
        }
        Ok(produced)
    }

    /// Counts `dt` seconds of kernels of `kind` for op `n` (its phase's time too).
    fn timed(&mut self, kind: &str, n: NodeId, dt: f64) {
        *self.report.by_op.entry(kind.to_string()).or_insert(0.0) += dt;
        let phase = self.phase.get(&n).copied().unwrap_or("forward");
        *self.report.by_phase.entry(phase.to_string()).or_insert(0.0) += dt;
    }

    /// Keeps an op's outputs, counting their storage.
    fn store(&mut self, produced: Vec<(Value, E::Tensor)>, env: &mut HashMap<Value, E::Tensor>, live: &mut Live) {
        for (v, t) in produced {
            live.add(self.e.storage(&t));
            if let Some(old) = env.insert(v, t) {
                live.remove(self.e.storage(&old));
            }
        }
    }
}

/// The carried state on one device: (initializer's global name, the initializer's value, the
/// value that replaces it after a step). A pair whose next value another device computes is
/// not this device's.
fn carried_state(g: &Graph, d: &DeviceProgram, opts: &RunOptions) -> Result<Vec<(String, Value, Value)>, String> {
    let mut carries = Vec::new();
    for (init, next) in &opts.carry {
        let Some(r) = d.results.iter().find(|r| &r.global == next) else { continue };
        let (Some(iv), Some(nv)) = (g.lookup(init), g.lookup(&r.local)) else {
            return Err(format!("carried state `{init}` is not held where `{next}` is computed"));
        };
        if !matches!(g.node(iv.node).op, Op::Initializer(_)) {
            return Err(format!("carried state `{init}` is not an initializer on this device"));
        }
        let (held, next_dims) = (g.tensor_type(iv).map(|t| &t.dims), g.tensor_type(nv).map(|t| &t.dims));
        if held != next_dims {
            return Err(format!(
                "carried state `{init}` is held as {held:?} but `{next}` is delivered as {next_dims:?}: \
                 the program does not deliver the next state in the layout the state is held in"
            ));
        }
        carries.push((init.clone(), iv, nv));
    }
    Ok(carries)
}

/// Runs one communication op through this device's port: its result (none for `Send`).
/// `micro` tags point-to-point messages with the micro-batch they belong to.
/// A collective whose group is this device alone.
fn alone(op: &Op) -> bool {
    let group = match op {
        Op::AllReduce(c) => &c.group,
        Op::AllGather(c) => &c.group,
        Op::ReduceScatter(c) => &c.group,
        Op::AllToAll(c) => &c.group,
        Op::HaloExchange(c) => &c.group,
        _ => return false,
    };
    group.as_ref().is_some_and(|g| g.len() <= 1)
}

fn collective(port: &mut hub::Port<'_>, op: &Op, x: Option<&Array>, micro: usize) -> Result<Option<Array>, String> {
    let name = op.op_type();
    let input = || x.ok_or_else(|| format!("{name} has no input"));
    let list = |g: &Option<Vec<i64>>| g.clone().ok_or_else(|| format!("{name} is missing a list attribute"));
    let index = |a: Option<i64>, what: &str| {
        a.and_then(|a| usize::try_from(a).ok()).ok_or_else(|| format!("{name}: `{what}` is missing or negative"))
    };
    let r = match op {
        Op::AllReduce(c) => port.all_reduce(&list(&c.group)?, input()?, c.op()),
        Op::AllGather(c) => port.all_gather(&list(&c.group)?, input()?, index(c.axis, "axis")?),
        Op::ReduceScatter(c) => port.reduce_scatter(&list(&c.group)?, input()?, index(c.axis, "axis")?, c.op()),
        Op::AllToAll(c) => port.all_to_all(
            &list(&c.group)?,
            input()?,
            index(c.split_axis, "split_axis")?,
            index(c.concat_axis, "concat_axis")?,
        ),
        Op::HaloExchange(c) => port.halo(&list(&c.group)?, input()?, index(c.axis, "axis")?, &list(&c.widths)?),
        Op::Send(c) => {
            port.send(index(c.peer, "peer")?, c.tag(), micro, input()?);
            return Ok(None);
        }
        Op::Recv(c) => port.recv(index(c.peer, "peer")?, c.tag(), micro),
        other => return Err(format!("unknown communication op {}", other.op_type())),
    };
    r.map(Some)
}

fn upload_feed<E: Executor>(e: &mut E, feed: &HashMap<String, Array>) -> Result<HashMap<String, E::Tensor>, String> {
    let mut keys: Vec<&String> = feed.keys().collect();
    keys.sort();
    keys.into_iter().map(|k| Ok((k.clone(), e.upload(&feed[k])?))).collect()
}
