//! Measures the constants of the cost model's device and link on the runtime's own
//! executors (`shardc calibrate`): GEMM FLOP/s of the runtime's GEMM kernel, bytes/s of a
//! memory-bound elementwise kernel, the fixed cost of one dispatch, the bandwidth and
//! latency of moving a tensor from one device to another through the host (what the
//! runtime's collectives do), and per op type how long its kernels take in a training step
//! against their price ([`measure_kernel_factors`]).

use std::time::Instant;

use codegen::runtime::Executor;
use ir::eval::Array;
use ir::{Graph, NodeId};
use passes::cost::Cluster;
use passes::cost::calibration::{Calibration, local_cluster};

/// One measurement: what was timed and its median.
#[derive(Clone, Debug)]
pub struct Sample {
    /// What was timed.
    pub what: String,
    /// Median seconds per repetition.
    pub median_s: f64,
    /// Repetitions.
    pub reps: usize,
}

/// The result of a calibration.
#[derive(Clone, Debug)]
pub struct Measured {
    /// The adapter (or `cpu`).
    pub adapter: String,
    /// The constants.
    pub calibration: Calibration,
    /// The raw timings.
    pub samples: Vec<Sample>,
}

/// How long to measure.
#[derive(Copy, Clone, Debug)]
pub struct Effort {
    /// GEMM side (n×n·n×n).
    pub gemm_n: usize,
    /// Elements of the bandwidth tensors.
    pub stream_elems: usize,
    /// Repetitions of each measurement (the median is kept).
    pub reps: usize,
    /// Rounds of the whole measurement; each constant is the median of the rounds' (a slow
    /// second on a shared machine spoils one round's kernel, not the constant).
    pub rounds: usize,
}

impl Default for Effort {
    fn default() -> Self {
        Effort { gemm_n: 512, stream_elems: 1 << 22, reps: 7, rounds: 1 }
    }
}

/// A one-op model (the standard ops and shardc's own, `shardc.ConvGradInput` …),
/// shape-checked, and its op node.
pub fn one_op(signature: &str, body: &str) -> Result<(ir::Model, NodeId), String> {
    let text =
        format!("<\n ir_version: 8,\n opset_import: [\"\" : 17, \"shardc\" : 1]\n>\nk {signature}\n{{\n {body}\n}}\n");
    let mut m = frontend::parse(&text).map_err(|d| frontend::render(&d, "calibration", &text))?.model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check)
        .map_err(|e| e.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("; "))?;
    let n = *m.graph.op_nodes().map_err(|_| "cycle".to_string())?.first().ok_or("no op")?;
    Ok((m, n))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of running node `n` of `g` (with a sync) on `e`, after one warm-up run.
pub fn time_node<E: Executor>(e: &mut E, g: &Graph, n: NodeId, inputs: &[Array], reps: usize) -> Result<f64, String> {
    let ts: Vec<E::Tensor> = inputs.iter().map(|a| e.upload(a)).collect::<Result<_, _>>()?;
    let refs: Vec<Option<&E::Tensor>> = ts.iter().map(Some).collect();
    let (warm, _) = e.run(g, n, &refs, &[])?;
    e.sync();
    drop(warm);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let (o, _) = e.run(g, n, &refs, &[])?;
        e.sync();
        times.push(t.elapsed().as_secs_f64());
        drop(o);
    }
    Ok(median(times))
}

/// Runs `body` on each of `k` executors made by `make`, each on its own thread as the
/// simulated devices of one run are, all starting at once (every thread waits for the others
/// to have made their executor); each thread's result, in device order.
fn on_devices<E: Executor, T: Send>(
    make: &(dyn Fn() -> Result<E, String> + Sync),
    k: usize,
    body: impl Fn(usize, E) -> Result<T, String> + Sync,
) -> Result<Vec<T>, String> {
    let barrier = std::sync::Barrier::new(k.max(1));
    let results: Vec<Result<T, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..k.max(1))
            .map(|me| {
                let (barrier, body) = (&barrier, &body);
                s.spawn(move || {
                    let e = make();
                    // Every thread reaches the barrier, made or not.
                    barrier.wait();
                    body(me, e?)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a device thread panicked".into()))).collect()
    });
    results.into_iter().collect()
}

/// Median seconds per tiny dispatch (a 4-float Relu and a sync, as the runtime runs each
/// op) on each of `k` executors made by `make`, all dispatching at once from their own
/// threads, as the simulated devices of one run do.
pub fn time_launch_concurrent<E: Executor>(
    make: &(dyn Fn() -> Result<E, String> + Sync),
    k: usize,
    reps: usize,
) -> Result<f64, String> {
    let (m, node) = one_op("(float[4] x) => (y)", "y = Relu (x)")?;
    let times = on_devices(make, k, |_, mut e| time_node(&mut e, &m.graph, node, &[filled(vec![4])], reps))?;
    Ok(median(times))
}

/// Median seconds of one step of `k` executors made by `make`, each on its own thread as the
/// devices of a run, when every step is what a sharded program does most: a kernel that
/// keeps the cores busy for a while (a Relu of 256K floats), a small one (a Relu of 1024
/// floats), then — `with_ring` — an all-reduce of the small one's output through the host
/// (download, ring over an in-process hub, upload), each followed by a sync. The ring's
/// wake-ups then wait for cores the other devices' kernels hold, which an all-reduce between
/// idle threads never sees; the difference of the two timings is the collective under load.
pub fn time_loaded_all_reduce<E: Executor>(
    make: &(dyn Fn() -> Result<E, String> + Sync),
    k: usize,
    reps: usize,
    with_ring: bool,
) -> Result<f64, String> {
    let (big_m, big) = one_op("(float[262144] x) => (y)", "y = Relu (x)")?;
    let (small_m, small) = one_op("(float[1024] x) => (y)", "y = Relu (x)")?;
    let hub = codegen::Hub::new(std::time::Duration::from_secs(60));
    let group: Vec<i64> = (0..k.max(1) as i64).collect();
    let times = on_devices(make, k, |me, mut e| {
        let mut port = codegen::runtime::hub::Port::new(&hub, me);
        let xb = e.upload(&filled(vec![262144]))?;
        let xs = e.upload(&filled(vec![1024]))?;
        let mut times = Vec::with_capacity(reps);
        for r in 0..=reps.max(1) {
            let t0 = Instant::now();
            let (load, _) = e.run(&big_m.graph, big, &[Some(&xb)], &[])?;
            e.sync();
            drop(load);
            let (outs, _) = e.run(&small_m.graph, small, &[Some(&xs)], &[])?;
            e.sync();
            if with_ring {
                let y = outs.into_iter().next().ok_or("no output")?;
                let host = e.download(&y)?;
                let sum = port.all_reduce(&group, &host, "sum")?;
                let back = e.upload(&sum)?;
                e.sync();
                drop(back);
            }
            if r > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(median(times))
    })?;
    Ok(median(times))
}

/// A dispatch's fixed cost measured on its own and from several devices at once.
#[derive(Clone, Debug)]
pub struct LaunchTimes {
    /// Seconds per dispatch from one device.
    pub alone: f64,
    /// `(devices, seconds per dispatch on each)` with 2 and 4 devices dispatching at once.
    pub together: Vec<(usize, f64)>,
    /// The extra fraction of `alone` each further device adds (least squares through the
    /// origin of `t_k / t_1 − 1 = contention · (k − 1)`; never negative).
    pub contention: f64,
}

/// Times a tiny dispatch (a 4-float Relu and a sync, `reps` times) on one executor made by
/// `make`, then on 2 and 4 at once, each on its own thread as the devices of a run.
pub fn measure_launch<E: Executor>(
    make: &(dyn Fn() -> Result<E, String> + Sync),
    reps: usize,
) -> Result<LaunchTimes, String> {
    let alone = time_launch_concurrent(make, 1, reps)?;
    let mut together = Vec::new();
    for k in [2usize, 4] {
        together.push((k, time_launch_concurrent(make, k, reps)?));
    }
    let xy: f64 = together.iter().map(|&(k, t)| (k as f64 - 1.0) * (t / alone - 1.0)).sum();
    let xx: f64 = together.iter().map(|&(k, _)| (k as f64 - 1.0).powi(2)).sum();
    Ok(LaunchTimes { alone, together, contention: (xy / xx).max(0.0) })
}

fn filled(shape: Vec<usize>) -> Array {
    let n: usize = shape.iter().product();
    Array::f32(shape, (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect())
}

/// Median seconds of moving `a` from one device to another through the host: a download
/// on `src` and an upload on `dst`, and the receiving queue drained (what the runtime's
/// collectives do per message: the next op's sync drains the upload).
fn time_copy<E: Executor>(src: &mut E, dst: &mut E, a: &Array, reps: usize) -> Result<f64, String> {
    let t = src.upload(a)?;
    src.sync();
    let mut times = Vec::with_capacity(reps);
    for r in 0..=reps.max(1) {
        let t0 = Instant::now();
        let host = src.download(&t)?;
        let back = dst.upload(&host)?;
        dst.sync();
        if r > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
        drop(back);
    }
    Ok(median(times))
}

/// Measures the constants on two executors made by `make` (the second is the receiving
/// device of the copy measurement), `effort.rounds` times: each constant and each timing is
/// the median of the rounds'.
pub fn measure<E: Executor>(make: impl Fn() -> Result<E, String> + Sync, effort: Effort) -> Result<Measured, String> {
    let rounds: Vec<Measured> =
        (0..effort.rounds.max(1)).map(|_| measure_once(&make, effort)).collect::<Result<_, _>>()?;
    let mid = |f: &dyn Fn(&Measured) -> f64| median(rounds.iter().map(f).collect());
    let c = |f: fn(&Calibration) -> f64| mid(&|m: &Measured| f(&m.calibration));
    let calibration = Calibration {
        gemm_flops: c(|k| k.gemm_flops),
        gemm_k_overhead: c(|k| k.gemm_k_overhead),
        efficiency: c(|k| k.efficiency),
        conv_grad_efficiency: c(|k| k.conv_grad_efficiency),
        transpose_efficiency: c(|k| k.transpose_efficiency),
        transpose_cached_bytes: c(|k| k.transpose_cached_bytes),
        mem_bandwidth: c(|k| k.mem_bandwidth),
        launch: c(|k| k.launch),
        copy_bandwidth: c(|k| k.copy_bandwidth),
        copy_latency: c(|k| k.copy_latency),
        copy_by_size: median_points(rounds.iter().map(|m| &m.calibration.copy_by_size)),
        ring_latency: c(|k| k.ring_latency),
        ring_bandwidth: c(|k| k.ring_bandwidth),
        ring_by_size: median_points(rounds.iter().map(|m| &m.calibration.ring_by_size)),
        ring_contention: c(|k| k.ring_contention),
        host_cores: rounds[0].calibration.host_cores,
        launch_contention: c(|k| k.launch_contention),
        host_use: c(|k| k.host_use),
        kernel_factors: Vec::new(),
        parallel_width: c(|k| k.parallel_width),
        serial_slowdown: c(|k| k.serial_slowdown),
        fused_elementwise: rounds[0].calibration.fused_elementwise,
    };
    let samples = rounds[0]
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| Sample {
            what: s.what.clone(),
            median_s: mid(&|m: &Measured| m.samples.get(i).map_or(f64::NAN, |x| x.median_s)),
            reps: s.reps * rounds.len(),
        })
        .collect();
    Ok(Measured { adapter: rounds[0].adapter.clone(), calibration, samples })
}

/// Per size, the median factor of the rounds' bandwidth-by-size points (sizes every round
/// measured), the time still never falling as the size grows.
fn median_points<'a>(rounds: impl Iterator<Item = &'a Vec<(f64, f64)>>) -> Vec<(f64, f64)> {
    let rounds: Vec<&Vec<(f64, f64)>> = rounds.collect();
    let Some(first) = rounds.first() else { return Vec::new() };
    let points: Vec<(f64, f64)> = first
        .iter()
        .filter_map(|&(bytes, _)| {
            let fs: Vec<f64> = rounds.iter().filter_map(|r| r.iter().find(|p| p.0 == bytes).map(|p| p.1)).collect();
            (fs.len() == rounds.len()).then(|| (bytes, median(fs)))
        })
        .collect();
    monotone_time(points)
}

/// Bandwidth-by-size points from measured rates `(bytes, bytes/s)` in increasing size, as
/// factors of `base`: a larger transfer never priced faster than a smaller one.
pub fn by_size(rates: &[(f64, f64)], base: f64) -> Vec<(f64, f64)> {
    monotone_time(rates.iter().filter(|r| r.1 > 0.0 && r.1.is_finite()).map(|&(n, r)| (n, r / base)).collect())
}

/// Caps each point's factor so that moving its bytes takes no less time than the point
/// before's (`n_i / f_i ≥ n_{i−1} / f_{i−1}`): measured rates are noisy, and a price that
/// falls as a tensor grows would have the search split tensors to make them larger.
fn monotone_time(mut points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    for i in 1..points.len() {
        let (n0, f0) = points[i - 1];
        let (n, f) = &mut points[i];
        *f = f.min(f0 * *n / n0);
    }
    points
}

/// Transposes of the innermost dim against a streaming kernel over the same tensor (a Relu),
/// square matrices from 256² floats up to `s` elements: the rate at the largest (transpose
/// efficiency), and the largest tensor still transposed at ≥ 60% of the stream's rate, bytes.
fn measure_transposes<E: Executor>(
    e: &mut E,
    s: usize,
    reps: usize,
    samples: &mut Vec<Sample>,
) -> Result<(f64, f64), String> {
    let side = ((s as f64).sqrt() as usize).max(256);
    let mut transpose_efficiency = 1.0;
    let mut transpose_cached_bytes = 0.0;
    let mut k = 256;
    while k <= side {
        let (m, node) = one_op(&format!("(float[{k},{k}] a) => (y)"), "y = Transpose <perm: ints = [1, 0]> (a)")?;
        let t_tr = time_node(e, &m.graph, node, &[filled(vec![k, k])], reps)?;
        let (m, node) = one_op(&format!("(float[{k},{k}] a) => (y)"), "y = Relu (a)")?;
        let t_relu = time_node(e, &m.graph, node, &[filled(vec![k, k])], reps)?;
        samples.push(Sample {
            what: format!("Transpose of {k}×{k} floats (Relu {:.3} ms)", t_relu * 1e3),
            median_s: t_tr,
            reps,
        });
        transpose_efficiency = (t_relu / t_tr).clamp(0.01, 1.0);
        if transpose_efficiency >= 0.6 && (k * k * 4) as f64 > transpose_cached_bytes {
            transpose_cached_bytes = (k * k * 4) as f64;
        }
        k *= 2;
    }
    Ok((transpose_efficiency, transpose_cached_bytes))
}

/// Reductions of `s` elements (rounded down to a power of two) to 1, 4, … outputs: the
/// device's parallel width and the slowdown of a single output (as the body says).
fn measure_reductions<E: Executor>(
    e: &mut E,
    s: usize,
    reps: usize,
    samples: &mut Vec<Sample>,
) -> Result<(f64, f64), String> {
    // Reductions of the same elements to 1, 4, … outputs (one invocation per output, looping
    // over its run): from some count on the time is flat (the device is filled); the width is
    // the least count at which the time is within twice that (the knee: above it the time
    // falls slowly to the flat rate, below it in proportion to the outputs, down to the
    // single output's), and the slowdown the single output's time over the flat one.
    let total = s.next_power_of_two() / 2;
    let mut reduced = Vec::new();
    let mut outputs = 1;
    while outputs <= total / 16 && outputs <= 1 << 15 {
        let len = total / outputs;
        let (m, node) = one_op(
            &format!("(float[{outputs},{len}] a) => (y)"),
            "y = ReduceSum <axes: ints = [1], keepdims: int = 0> (a)",
        )?;
        let t = time_node(e, &m.graph, node, &[filled(vec![outputs, len])], reps)?;
        samples.push(Sample { what: format!("ReduceSum of {total} floats to {outputs}"), median_s: t, reps });
        reduced.push((outputs, t));
        outputs *= 4;
    }
    let filled_t = reduced.iter().rev().take(2).map(|&(_, t)| t).fold(f64::INFINITY, f64::min);
    let parallel_width = reduced.iter().find(|&&(_, t)| t <= 2.0 * filled_t).map_or(0.0, |&(k, _)| k as f64).max(1.0);
    let serial_slowdown = reduced.first().map_or(1.0, |&(_, t)| (t / filled_t).max(1.0));
    Ok((parallel_width, serial_slowdown))
}

fn measure_once<E: Executor>(
    make: &(impl Fn() -> Result<E, String> + Sync),
    effort: Effort,
) -> Result<Measured, String> {
    let mut e = make()?;
    let mut samples = Vec::new();
    let reps = effort.reps.max(1);
    // GEMM.
    let n = effort.gemm_n.max(16);
    let (gemm_m, gemm_node) = one_op(&format!("(float[{n},{n}] a, float[{n},{n}] b) => (y)"), "y = MatMul (a, b)")?;
    let gemm_inputs = [filled(vec![n, n]), filled(vec![n, n])];
    let t_gemm = time_node(&mut e, &gemm_m.graph, gemm_node, &gemm_inputs, reps)?;
    samples.push(Sample { what: format!("MatMul {n}×{n}·{n}×{n}"), median_s: t_gemm, reps });
    // The same output from short reductions: each tile's fixed work (loading, the epilogue)
    // stays while its loop over K shrinks, so the kernel's time is `a·(K + o)` with `o` the
    // overhead as extra reduction length (least squares over K = 16 … 128).
    let mut short_k = Vec::new();
    for k in [16usize, 32, 64, 128] {
        let (m, node) = one_op(&format!("(float[{n},{k}] a, float[{k},{n}] b) => (y)"), "y = MatMul (a, b)")?;
        let t = time_node(&mut e, &m.graph, node, &[filled(vec![n, k]), filled(vec![k, n])], reps)?;
        samples.push(Sample { what: format!("MatMul {n}×{k}·{k}×{n}"), median_s: t, reps });
        short_k.push((k as f64, t));
    }
    // A convolution (3×3, 64 → 64 channels): its rate against the GEMM's is the efficiency
    // that convolutions and small GEMMs reach.
    let b = (n / 64).max(1);
    let (m, node) = one_op(
        &format!("(float[{b},64,16,16] x, float[64,64,3,3] w) => (y)"),
        "y = Conv <pads: ints = [1, 1, 1, 1]> (x, w)",
    )?;
    let t_conv = time_node(&mut e, &m.graph, node, &[filled(vec![b, 64, 16, 16]), filled(vec![64, 64, 3, 3])], reps)?;
    samples.push(Sample { what: format!("Conv 3×3 {b}×64×16×16 → 64"), median_s: t_conv, reps });
    // Its two gradients (the input's and the weight's), each as many FLOPs as the convolution.
    let (m, node) = one_op(
        &format!("(float[{b},64,16,16] dy, float[64,64,3,3] w) => (dx)"),
        &format!(
            "dx = shardc.ConvGradInput <input_shape: ints = [{b}, 64, 16, 16], kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (dy, w)"
        ),
    )?;
    let t_gi = time_node(&mut e, &m.graph, node, &[filled(vec![b, 64, 16, 16]), filled(vec![64, 64, 3, 3])], reps)?;
    samples.push(Sample { what: "ConvGradInput of the same".into(), median_s: t_gi, reps });
    let (m, node) = one_op(
        &format!("(float[{b},64,16,16] x, float[{b},64,16,16] dy) => (dw)"),
        "dw = shardc.ConvGradWeight <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (x, dy)",
    )?;
    let t_gw = time_node(&mut e, &m.graph, node, &[filled(vec![b, 64, 16, 16]), filled(vec![b, 64, 16, 16])], reps)?;
    samples.push(Sample { what: "ConvGradWeight of the same".into(), median_s: t_gw, reps });
    // One tiny dispatch (the fixed cost of an op), alone and from 2 and 4 devices at once.
    let l = measure_launch(make, reps * 4)?;
    samples.push(Sample { what: "Relu of 4 floats (one dispatch)".into(), median_s: l.alone, reps: reps * 4 });
    for &(k, t) in &l.together {
        samples.push(Sample { what: format!("the same from {k} devices at once"), median_s: t, reps: reps * 4 });
    }
    let (t_launch, launch_contention) = (l.alone, l.contention);
    // The same GEMM on 2 and 4 devices at once: how much of the host one device keeps busy.
    let mut together = Vec::new();
    for k in [2usize, 4] {
        let t =
            median(on_devices(make, k, |_, mut d| time_node(&mut d, &gemm_m.graph, gemm_node, &gemm_inputs, reps))?);
        samples.push(Sample { what: format!("MatMul {n}³ on {k} devices at once"), median_s: t, reps });
        together.push((k, t));
    }
    let host_use = host_use(t_gemm, &together);
    // A memory-bound kernel: read two tensors, write one.
    let s = effort.stream_elems.max(1024);
    let (m, node) = one_op(&format!("(float[{s}] a, float[{s}] b) => (y)"), "y = Add (a, b)")?;
    let t_add = time_node(&mut e, &m.graph, node, &[filled(vec![s]), filled(vec![s])], reps)?;
    samples.push(Sample { what: format!("Add of {s} floats"), median_s: t_add, reps });
    // Transposes and reductions of as many elements as the Add.
    let (transpose_efficiency, transpose_cached_bytes) = measure_transposes(&mut e, s, reps, &mut samples)?;
    let (parallel_width, serial_slowdown) = measure_reductions(&mut e, s, reps, &mut samples)?;
    // Device → host → device.
    let mut f = make()?;
    // Small enough to be all latency, large enough not to be served from the host copy that
    // executors keep of tiny tensors.
    let small = 16384;
    let t_small = time_copy(&mut e, &mut f, &filled(vec![small]), reps * 2)?;
    samples.push(Sample { what: format!("copy of {small} floats between devices"), median_s: t_small, reps: reps * 2 });
    // Just above that limit: as close to a collective's fixed cost as a copy gets.
    let tiny = 4100;
    let t_tiny = time_copy(&mut e, &mut f, &filled(vec![tiny]), reps * 4)?;
    samples.push(Sample { what: format!("copy of {tiny} floats between devices"), median_s: t_tiny, reps: reps * 4 });
    let t_big = time_copy(&mut e, &mut f, &filled(vec![s]), reps)?;
    samples.push(Sample { what: format!("copy of {s} floats between devices"), median_s: t_big, reps });
    // The copies' rate by size, from tensors of 256 KB (mostly bytes, not latency) up to four
    // times the bandwidth kernels' (as the ring below): through host memory, the rate falls
    // as the tensors outgrow the caches.
    let mut copies = Vec::new();
    for n in CURVE_SIZES.iter().copied().chain([s, 4 * s]).filter(|&n| n >= CURVE_FROM && n <= 4 * s) {
        let t = if n == s {
            t_big
        } else {
            let t = time_copy(&mut e, &mut f, &filled(vec![n]), reps)?;
            samples.push(Sample { what: format!("copy of {n} floats between devices"), median_s: t, reps });
            t
        };
        copies.push((4.0 * n as f64, t));
    }
    copies.sort_by(|a, b| a.0.total_cmp(&b.0));
    copies.dedup_by(|a, b| a.0 == b.0);
    // The in-process transport's ring between host buffers (two threads): latency-bound
    // sizes for α, then tensors as large as the bandwidth kernels' and four times that —
    // gradients of that size stream through memory, not cache — for β.
    let mut sizes = RING_SIZES.to_vec();
    let wide = 1 << 20;
    sizes.extend([wide, s, 4 * s].into_iter().filter(|&n| n >= wide));
    sizes.sort_unstable();
    sizes.dedup();
    let ring = time_threads(2, &sizes, reps)?;
    for &(bytes, t) in &ring {
        samples.push(Sample { what: format!("all-reduce of {bytes} bytes between 2 threads"), median_s: t, reps });
    }
    let (ring_latency, ring_bandwidth) = fit_ring_split(&ring, 2, 4.0 * wide as f64);
    // The same ring between devices that are busy: kernels and an all-reduce through the host
    // per step, on 2 and 4 devices at once. Less the kernels (the same steps timed without
    // the all-reduce) and the copies, what is left is the ring's 2(k−1) steps.
    let mut loaded = Vec::new();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for k in [cores.max(2), 2 * cores.max(2)] {
        let without = time_loaded_all_reduce(make, k, reps * 2, false)?;
        let t = time_loaded_all_reduce(make, k, reps * 2, true)?;
        samples.push(Sample { what: format!("two Relus on {k} devices at once"), median_s: without, reps: reps * 2 });
        samples.push(Sample {
            what: "the same and an all-reduce of 1024 floats".to_string(),
            median_s: t,
            reps: reps * 2,
        });
        loaded.push((k, t, without));
    }
    let flops = 2.0 * (n as f64).powi(3);
    let launch = t_launch;
    let copy_bandwidth = 4.0 * (s - small.min(s)) as f64 / (t_big - t_small).max(t_big * 0.5);
    // The smallest copy less its bytes' time.
    let copy_latency = (t_tiny - 4.0 * tiny as f64 / copy_bandwidth).max(t_tiny * 0.5);
    // Each size's rate once the fixed cost is taken off, against the fitted one.
    let copy_rates: Vec<(f64, f64)> = copies.iter().map(|&(n, t)| (n, n / (t - copy_latency).max(t * 0.5))).collect();
    let copy_by_size = by_size(&copy_rates, copy_bandwidth);
    // The ring's the same way: the bytes' time of each all-reduce of at least 256 KB (two
    // members: one step each way, `n` bytes in all).
    let ring_rates: Vec<(f64, f64)> = ring
        .iter()
        .filter(|&&(n, _)| n >= 4.0 * CURVE_FROM as f64)
        .map(|&(n, t)| (n, n / (t - 2.0 * ring_latency).max(t * 0.5)))
        .collect();
    let ring_by_size = by_size(&ring_rates, ring_bandwidth);
    // Each member beyond the cores' extra fraction of a ring step (least squares through the
    // origin of `α_k / α − 1 = c · (k − cores)`; never negative).
    let (xy, xx) = loaded.iter().filter(|&&(k, _, _)| k > cores).fold((0.0, 0.0), |(xy, xx), &(k, t, without)| {
        let steps = 2.0 * (k as f64 - 1.0);
        let alpha_k = (t - without - copy_latency - 2.0 * 4096.0 / copy_bandwidth).max(0.0) / steps;
        let x = (k - cores) as f64;
        (xy + x * (alpha_k / ring_latency.max(1e-9) - 1.0), xx + x * x)
    });
    let ring_contention = if xx > 0.0 { (xy / xx).max(0.0) } else { 0.0 };
    // A kernel's own time: less its dispatch, never below half of what was measured.
    let busy = |t: f64| (t - launch).max(t * 0.5);
    let gemm_k_overhead = k_overhead(&short_k.iter().map(|&(k, t)| (k, busy(t))).collect::<Vec<_>>());
    // The peak: the square GEMM's rate without its own (small) reduction overhead.
    let gemm_flops = flops / busy(t_gemm) * (n as f64 + gemm_k_overhead) / n as f64;
    // FLOPs of the convolution, and of each of its gradients.
    let conv_work = 2.0 * (b * 64 * 256 * 64 * 9) as f64;
    let conv_flops = conv_work / busy(t_conv);
    let grad_flops = 2.0 * conv_work / (busy(t_gi) + busy(t_gw));
    let calibration = Calibration {
        gemm_flops,
        gemm_k_overhead,
        efficiency: (conv_flops / gemm_flops).clamp(0.05, 1.0),
        conv_grad_efficiency: (grad_flops / conv_flops).clamp(0.05, 1.5),
        mem_bandwidth: 12.0 * s as f64 / busy(t_add),
        transpose_efficiency,
        transpose_cached_bytes,
        launch,
        copy_bandwidth,
        copy_latency,
        copy_by_size,
        ring_latency,
        ring_bandwidth,
        ring_by_size,
        ring_contention,
        host_cores: cores,
        launch_contention,
        host_use,
        kernel_factors: Vec::new(),
        parallel_width,
        serial_slowdown,
        // As `run` and `train` run: fused unless SHARDC_NO_FUSION says otherwise.
        fused_elementwise: e.fuses() && codegen::RunOptions::default().fusion,
    };
    Ok(Measured { adapter: e.name(), calibration, samples })
}

/// The fraction of the host one device's kernels keep busy from a kernel's time alone and
/// on `k` devices at once, `(k, seconds)`: each takes `max(1, k·u)` times as long as alone,
/// `u` by least squares through the origin of the slowdowns (a slowdown under 1 read as 1),
/// within `[1/8, 1]`.
pub fn host_use(alone: f64, together: &[(usize, f64)]) -> f64 {
    let xy: f64 = together.iter().map(|&(k, t)| k as f64 * (t / alone).max(1.0)).sum();
    let xx: f64 = together.iter().map(|&(k, _)| (k * k) as f64).sum();
    if xx > 0.0 && alone > 0.0 { (xy / xx).clamp(0.125, 1.0) } else { 1.0 }
}

/// The reduction overhead `o` of GEMMs timed at several reduction lengths, `(K, seconds)`:
/// the least-squares line `t = a·K + b` gives `o = b/a` (the extra reduction length a tile's
/// fixed work costs); 0 where the line does not rise with K, at most 1024.
pub fn k_overhead(timed: &[(f64, f64)]) -> f64 {
    match regression(timed) {
        (mk, mt, Some(a)) if a > 0.0 => ((mt - a * mk) / a).clamp(0.0, 1024.0),
        _ => 0.0,
    }
}

/// The means of `x` and `y` over `(x, y)` points and the least-squares slope of `y` on `x`
/// (`None` where every `x` is the same).
fn regression(points: &[(f64, f64)]) -> (f64, f64, Option<f64>) {
    let k = points.len().max(1) as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |a, &(x, y)| (a.0 + x, a.1 + y));
    let (mx, my) = (sx / k, sy / k);
    let (sxx, sxy) =
        points.iter().fold((0.0, 0.0), |a, &(x, y)| (a.0 + (x - mx) * (x - mx), a.1 + (x - mx) * (y - my)));
    (mx, my, (sxx > 0.0).then(|| sxy / sxx))
}

/// A cluster of `devices` simulated accelerators with the measured constants, as a TOML
/// cluster file with the measurements in comments.
pub fn cluster_toml(m: &Measured, devices: usize) -> (Cluster, String) {
    let c = local_cluster(&m.calibration, "local-calibrated", &format!("shardc calibrate on {}", m.adapter), devices);
    let mut t = String::from("# Measured by `shardc calibrate` (medians):\n");
    for s in &m.samples {
        t.push_str(&format!("#   {:<40} {:>12.3} ms  ({} runs)\n", s.what, s.median_s * 1e3, s.reps));
    }
    let k = &m.calibration;
    t.push_str(&format!(
        "# GEMM {:.2} GFLOP/s (+{:.1} of reduction length per tile; convolutions at {:.0}%, their gradients at {:.0}% of that), memory {:.2} GB/s (transposes of over {:.1} MB at {:.0}%), dispatch {:.1} µs (+{:.0}% per further device at once), one device keeps {:.0}% of the host busy, copies {:.2} GB/s + {:.1} µs, ring steps {:.2} GB/s + {:.1} µs (+{:.0}% per busy device beyond the {} cores)\n\n",
        k.gemm_flops / 1e9,
        k.gemm_k_overhead,
        k.efficiency * 100.0,
        k.conv_grad_efficiency * 100.0,
        k.mem_bandwidth / 1e9,
        k.transpose_cached_bytes / 1e6,
        k.transpose_efficiency * 100.0,
        k.launch * 1e6,
        k.launch_contention * 100.0,
        k.host_use * 100.0,
        k.copy_bandwidth / 1e9,
        k.copy_latency * 1e6,
        k.ring_bandwidth / 1e9,
        k.ring_latency * 1e6,
        k.ring_contention * 100.0,
        k.host_cores
    ));
    let rates = |base: f64, points: &[(f64, f64)]| -> String {
        let r: Vec<String> =
            points.iter().map(|&(n, f)| format!("{:.2} at {}", base * f / 1e9, human_bytes(n))).collect();
        r.join(", ")
    };
    if !k.copy_by_size.is_empty() || !k.ring_by_size.is_empty() {
        t.push_str(&format!(
            "# By size (GB/s): copies {}; ring {}\n\n",
            rates(k.copy_bandwidth, &k.copy_by_size),
            rates(k.ring_bandwidth, &k.ring_by_size)
        ));
    }
    if !k.kernel_factors.is_empty() {
        let f: Vec<String> = k.kernel_factors.iter().map(|(op, x)| format!("{op} ×{x:.2}")).collect();
        t.push_str(&format!("# Kernels against their price: {}\n\n", f.join(", ")));
    }
    t.push_str(&c.to_toml());
    (c, t)
}

/// `n` bytes as KB, MB or GB (powers of 1024).
fn human_bytes(n: f64) -> String {
    match n {
        n if n >= (1u64 << 30) as f64 => format!("{:.0} GB", n / (1u64 << 30) as f64),
        n if n >= (1 << 20) as f64 => format!("{:.0} MB", n / (1 << 20) as f64),
        n => format!("{:.0} KB", n / 1024.0),
    }
}

/// One collective size measured on a transport.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CollectiveSample {
    /// Bytes per device (float32 elements × 4).
    pub bytes: f64,
    /// Median seconds of one ring all-reduce over every device, on device 0.
    pub all_reduce_s: f64,
    /// What the cost model predicts for it on the cluster it was compared with.
    pub predicted_s: f64,
}

/// A transport's all-reduce measured over `devices` devices, and the ring model's constants
/// fitted to it (`t = 2(p−1)α + 2(p−1)/p · n/β`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct CollectiveCalibration {
    /// `threads` or `mpi`.
    pub transport: String,
    /// Devices in the ring.
    pub devices: usize,
    /// Per size.
    pub samples: Vec<CollectiveSample>,
    /// Fitted latency per ring step, seconds.
    pub alpha_s: f64,
    /// Fitted bandwidth, bytes/s.
    pub beta_bytes_per_s: f64,
    /// The cluster the predictions are for.
    pub cluster: String,
}

/// Sizes (float32 elements) of the collective calibration.
pub const COLLECTIVE_SIZES: &[usize] = &[256, 4096, 65536, 1 << 20];

/// The group sizes a transport is calibrated for on `devices`: the powers of two from 2
/// below it, and `devices`.
pub fn group_sizes(devices: usize) -> Vec<usize> {
    let mut g: Vec<usize> = (1..).map(|k| 1usize << k).take_while(|&s| s < devices).collect();
    g.push(devices);
    g
}

/// Runs the all-reduce timing on device `me` through `t`, over the group of devices
/// `0..group` (a device outside it does nothing): for each size, `reps` timed all-reduces,
/// each after a one-element all-reduce that lines the group up; the median of device `me`'s
/// times.
pub fn time_all_reduce(
    t: &dyn codegen::Transport,
    me: usize,
    group: usize,
    sizes: &[usize],
    reps: usize,
) -> Result<Vec<(f64, f64)>, String> {
    if me >= group {
        return Ok(Vec::new());
    }
    let group: Vec<i64> = (0..group as i64).collect();
    let mut port = codegen::runtime::hub::Port::new(t, me);
    let mut out = Vec::new();
    let line_up = Array::f32(vec![1], vec![1.0]);
    for &n in sizes {
        let x = Array::f32(vec![n], (0..n).map(|i| (i % 7) as f32).collect());
        let mut times = Vec::with_capacity(reps);
        for rep in 0..reps + 1 {
            port.all_reduce(&group, &line_up, "sum")?;
            let start = Instant::now();
            port.all_reduce(&group, &x, "sum")?;
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        out.push(((n * 4) as f64, times[times.len() / 2]));
    }
    Ok(out)
}

/// The in-process (`threads`) transport's all-reduce over `devices` threads.
pub fn time_threads(devices: usize, sizes: &[usize], reps: usize) -> Result<Vec<(f64, f64)>, String> {
    let hub = codegen::Hub::new(std::time::Duration::from_secs(60));
    let results: Vec<Result<Vec<(f64, f64)>, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..devices)
            .map(|me| {
                let hub = &hub;
                s.spawn(move || time_all_reduce(hub, me, devices, sizes, reps))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a device thread panicked".into()))).collect()
    });
    results.into_iter().next().unwrap_or_else(|| Err("no devices".into()))
}

/// Sizes (float32 elements) of the in-process ring measured with the device constants.
const RING_SIZES: &[usize] = &[256, 4096, 65536, 262144];

/// Sizes (float32 elements) at which the copies' and the ring's rate by size are measured,
/// with the bandwidth kernels' tensor and four times it.
const CURVE_SIZES: &[usize] = &[65536, 262144, 1 << 20];
/// The least size (float32 elements) of a rate-by-size point: 256 KB, where a transfer's
/// time is mostly its bytes'.
const CURVE_FROM: usize = 65536;

/// The ring model's `(α per step, β)` fitted to all-reduces `(bytes, seconds)` over `p`
/// members (`t = 2(p−1)α + 2(p−1)/p · n/β`) by least squares of `t = a + b·n`.
pub fn fit_ring(timed: &[(f64, f64)], p: usize) -> (f64, f64) {
    let (mx, my, slope) = regression(timed);
    let b = slope.map_or(1e-12, |s| s.max(1e-15));
    let a = (my - b * mx).max(0.0);
    let steps = 2.0 * (p.max(2) as f64 - 1.0);
    (a / steps, steps / p.max(1) as f64 / b)
}

/// The ring model fitted in two parts: α from the sizes below `split` bytes (as [`fit_ring`]),
/// β from those at or above it once their `2(p−1)` steps of α are taken off (least squares
/// through the origin) — the rate of tensors too large for the caches, which the large
/// gradients of a training step are; β of the small sizes where none is that large.
pub fn fit_ring_split(timed: &[(f64, f64)], p: usize, split: f64) -> (f64, f64) {
    let small: Vec<(f64, f64)> = timed.iter().copied().filter(|&(n, _)| n < split).collect();
    let large = timed.iter().filter(|&&(n, _)| n >= split);
    let (alpha, beta) = fit_ring(if small.len() >= 2 { &small } else { timed }, p);
    let steps = 2.0 * (p.max(2) as f64 - 1.0);
    let (xy, xx) = large.fold((0.0, 0.0), |(xy, xx), &(n, t)| {
        let x = steps / p.max(1) as f64 * n;
        (xy + x * (t - steps * alpha).max(0.0), xx + x * x)
    });
    if xy > 0.0 { (alpha, xx / xy) } else { (alpha, beta) }
}

/// Fits the ring model to `(bytes, seconds)` over `p` devices and prices each size on
/// `cluster`'s intra-node link.
pub fn collective_calibration(
    transport: &str,
    p: usize,
    timed: &[(f64, f64)],
    cluster: &Cluster,
) -> CollectiveCalibration {
    let (alpha_s, beta_bytes_per_s) = fit_ring(timed, p);
    CollectiveCalibration {
        transport: transport.into(),
        devices: p,
        samples: timed
            .iter()
            .map(|&(bytes, t)| {
                let (alpha, beta) =
                    passes::cost::collective::alpha_beta(cluster, ir::shard::LinkLevel::Intra, p, p, bytes);
                CollectiveSample {
                    bytes,
                    all_reduce_s: t,
                    predicted_s: passes::cost::collective::all_reduce(bytes, p, alpha, beta),
                }
            })
            .collect(),
        alpha_s,
        beta_bytes_per_s,
        cluster: cluster.name.clone(),
    }
}

impl CollectiveCalibration {
    /// A table: size, measured, predicted, error; and the fitted constants.
    pub fn text(&self) -> String {
        let mut t = format!(
            "all-reduce over {} devices, {} transport; predictions for {}\n",
            self.devices, self.transport, self.cluster
        );
        t.push_str("       bytes      measured     predicted     error\n");
        for s in &self.samples {
            t.push_str(&format!(
                "{:>12.0} {:>10.1} µs {:>10.1} µs {:>+8.0}%\n",
                s.bytes,
                s.all_reduce_s * 1e6,
                s.predicted_s * 1e6,
                (s.predicted_s - s.all_reduce_s) / s.all_reduce_s * 100.0
            ));
        }
        t.push_str(&format!(
            "fitted       α {:.1} µs per ring step, β {:.3} GB/s\n",
            self.alpha_s * 1e6,
            self.beta_bytes_per_s / 1e9
        ));
        t
    }
}

/// Steps of each training run of [`measure_kernel_factors`] (the runtime reports the last;
/// the first compile kernels and allocate).
const FACTOR_STEPS: usize = 3;

/// Per op type, its kernels' time against their price.
pub type KernelFactors = Vec<(String, f64)>;

/// The least roofline time, summed over the calibration models, an op type needs for its
/// factor to be measured.
const FACTOR_MIN_S: f64 = 0.2e-3;

/// The models [`measure_kernel_factors`] trains: a small residual convolutional network
/// (3×3 and strided 1×1 convolutions, max pooling, global pooling, a classifier) and a small
/// transformer (two pre-norm blocks, four heads) — neither a model the project benchmarks
/// — with their loss, as ONNX text whose weights are drawn. Large enough that their
/// element-wise kernels take longer than a dispatch (a price mostly launches says nothing of
/// a kernel's rate); `small`: a few-millisecond version (`--quick`).
pub fn factor_models(small: bool) -> Vec<(&'static str, String, passes::autodiff::LossSpec)> {
    use passes::autodiff::LossSpec;
    let w = |dims: &[usize], name: &str| crate::synthetic::ext("float", dims, name);
    let inits = [
        w(&[32, 3, 3, 3], "w1"),
        w(&[32], "b1"),
        w(&[32, 32, 3, 3], "w2"),
        w(&[32], "b2"),
        w(&[64, 32, 3, 3], "w3"),
        w(&[64], "b3"),
        w(&[64, 32, 1, 1], "w4"),
        w(&[64, 64, 3, 3], "w5"),
        w(&[10, 64], "wf"),
        w(&[10], "bf"),
    ];
    // Quick: still enough pooling-gradient work (4·32·16·16 windows of 81 scans) that its
    // roofline clears [`FACTOR_MIN_S`] on a fast executor.
    let (b, side) = if small { (4, 32) } else { (8, 64) };
    let cnn = format!(
        "<\n ir_version: 8,\n opset_import: [\"\" : 17]\n>\ncnn (float[{b},3,{side},{side}] x) => (float[{b},10] y)\n <{}>\n{{\n{}\n}}\n",
        inits.join(", "),
        [
            "c1 = Conv <pads: ints = [1, 1, 1, 1]> (x, w1, b1)",
            "r1 = Relu (c1)",
            "p1 = MaxPool <kernel_shape: ints = [3, 3], strides: ints = [2, 2], pads: ints = [1, 1, 1, 1]> (r1)",
            "c2 = Conv <pads: ints = [1, 1, 1, 1]> (p1, w2, b2)",
            "r2 = Relu (c2)",
            "a2 = Add (r2, p1)",
            "c3 = Conv <pads: ints = [1, 1, 1, 1], strides: ints = [2, 2]> (a2, w3, b3)",
            "r3 = Relu (c3)",
            "d4 = Conv <strides: ints = [2, 2]> (a2, w4)",
            "c5 = Conv <pads: ints = [1, 1, 1, 1]> (r3, w5)",
            "a5 = Add (c5, d4)",
            "r5 = Relu (a5)",
            "g = GlobalAveragePool (r5)",
            "f = Flatten (g)",
            "y = Gemm <transB: int = 1> (f, wf, bf)",
        ]
        .map(|l| format!(" {l}"))
        .join("\n")
    );
    // Quick: still enough GEMM work that the products' roofline clears [`FACTOR_MIN_S`] on an
    // executor with a vectorised SGEMM.
    let (hidden, seq, batch) = if small { (64, 32, 2) } else { (128, 128, 4) };
    let gpt = crate::synthetic::Gpt { layers: 2, hidden, heads: 4, batch, seq, fused_gelu: false, vocab: 0 }.to_text();
    vec![("cnn", cnn, LossSpec::SoftmaxCrossEntropy(None)), ("transformer", gpt, LossSpec::Mse(None))]
}

/// Per op type, how long the runtime's kernels on `backend` take against the price the cost
/// model gives them on a device of `calibration` (without factors): [`factor_models`] each
/// trained single-device with momentum SGD for [`FACTOR_STEPS`] steps, `runs` times; per
/// run and op type the measured time of the last step summed over both models, less the
/// launches priced in it, over the roofline part of its price, and per op type the median
/// over the runs. Types priced mostly as launches (views, tiny kernels) are left out. Also
/// returns the measurements.
pub fn measure_kernel_factors(
    calibration: &Calibration,
    backend: codegen::Backend,
    runs: usize,
    small: bool,
) -> Result<(KernelFactors, Vec<Sample>), String> {
    use std::collections::BTreeMap;
    let opt = passes::autodiff::OptimizerSpec::Sgd {
        lr: 0.01,
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
    };
    let opts = passes::cost::Options { optimizer: passes::cost::Optimizer::Sgd, ..Default::default() };
    let mut cal = calibration.clone();
    cal.kernel_factors.clear();
    let cluster = local_cluster(&cal, "calibration", "shardc calibrate", 1);
    // The same device without launch costs: what is left of a price is its roofline.
    let mut rooflines = cluster.clone();
    rooflines.device.launch_overhead = 0.0;
    // Per model: the lowered training program and its inputs; per op type over both models,
    // its price and the roofline part of it.
    let mut prepared = Vec::new();
    let mut priced = BTreeMap::<String, (f64, f64)>::new();
    for (name, text, loss) in factor_models(small) {
        let mut m = frontend::parse(&text).map_err(|d| frontend::render(&d, name, &text))?.model;
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check)
            .map_err(|e| e.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("; "))?;
        crate::exec::materialize(&mut m, std::path::Path::new("."), 0)?;
        let (tm, info) = crate::train::training_model(&m, &loss, &opt)?;
        let r = crate::exec::named_result(&tm.graph, &cluster, 1, "data", &opts)?;
        let prog = crate::exec::program_for_search(&tm.graph, &r, 1).map_err(|e| e.to_string())?;
        let inputs = crate::train::seeded_inputs(&tm.graph, &info, 0)?;
        let roof = crate::exec::named_result(&tm.graph, &rooflines, 1, "data", &opts)?;
        for row in &r.breakdown.ops {
            priced.entry(row.op.clone()).or_default().0 += row.compute_s;
        }
        for row in &roof.breakdown.ops {
            priced.entry(row.op.clone()).or_default().1 += row.compute_s;
        }
        prepared.push((prog, info, inputs));
    }
    let mut ratios = BTreeMap::<String, Vec<f64>>::new();
    let mut samples = Vec::new();
    for _ in 0..runs.max(1) {
        let mut measured = BTreeMap::<String, f64>::new();
        for (prog, info, inputs) in &prepared {
            let run = crate::train::run_steps(prog, info, inputs, backend, FACTOR_STEPS)?;
            let d = run.report.devices.first().ok_or("the run reported no device")?;
            for (op, t) in &d.by_op {
                *measured.entry(op.clone()).or_default() += t;
            }
        }
        // The measured time less the priced launches, over the roofline part of the price
        // (never below a twentieth of the measured time: launches the run did not pay). Only
        // where the roofline is half the price or more and [`FACTOR_MIN_S`] at least: a price
        // that is mostly launches says nothing of its kernels' rate (and the launches' jitter
        // would swamp it).
        for (op, &(total, roof)) in &priced {
            if let Some(&m) = measured.get(op)
                && roof >= FACTOR_MIN_S
                && roof >= total / 2.0
                && m > 0.0
            {
                let kernels = (m - (total - roof)).max(m / 20.0);
                ratios.entry(op.clone()).or_default().push(kernels / roof);
            }
        }
        samples = measured
            .into_iter()
            .map(|(op, m)| {
                let p = priced.get(&op).map_or(0.0, |p| p.0);
                Sample { what: format!("{op} in a training step (priced {:.3} ms)", p * 1e3), median_s: m, reps: 1 }
            })
            .collect();
    }
    let factors = ratios.into_iter().map(|(op, r)| (op, median(r).clamp(0.05, 50.0))).collect();
    Ok((factors, samples))
}

/// [`measure_kernel_factors`] into `m`: its factors, and the last run's timings among its
/// samples.
pub fn add_kernel_factors(m: &mut Measured, backend: codegen::Backend, runs: usize, small: bool) -> Result<(), String> {
    let (factors, samples) = measure_kernel_factors(&m.calibration, backend, runs, small)?;
    m.calibration.kernel_factors = factors;
    m.samples.extend(samples);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{host_use, k_overhead};

    #[test]
    fn the_rings_bandwidth_comes_from_the_large_sizes_and_its_latency_from_the_small() {
        // 2 members: t = 2α + n/β; α = 20 µs, β = 1 GB/s up to 1 MB, 0.25 GB/s beyond.
        let t = |n: f64, beta: f64| 2.0 * 20e-6 + n / beta;
        let timed: Vec<(f64, f64)> = [1e3, 1.6e4, 2.6e5, 1e6]
            .iter()
            .map(|&n| (n, t(n, 1e9)))
            .chain([1.6e7, 6.4e7].iter().map(|&n| (n, t(n, 0.25e9))))
            .collect();
        let (alpha, beta) = super::fit_ring_split(&timed, 2, 4e6);
        assert!((alpha - 20e-6).abs() < 1e-9, "{alpha}");
        assert!((beta / 0.25e9 - 1.0).abs() < 1e-9, "{beta}");
        // No large size: the small sizes' fit.
        let (a2, b2) = super::fit_ring_split(&timed[..4], 2, 4e6);
        assert!((a2 - 20e-6).abs() < 1e-9 && (b2 / 1e9 - 1.0).abs() < 1e-9, "{a2} {b2}");
    }

    #[test]
    fn rates_by_size_become_factors_whose_time_never_falls_with_the_size() {
        // 1 GB/s at 1 MB, 2 GB/s at 4 MB (twice as fast, still longer), 10 GB/s at 8 MB (the
        // 8 MB would move faster than the 4 MB: capped at 4 GB/s, the same time), against a
        // base of 0.5 GB/s.
        let f = super::by_size(&[(1e6, 1e9), (4e6, 2e9), (8e6, 10e9)], 0.5e9);
        assert_eq!(f, vec![(1e6, 2.0), (4e6, 4.0), (8e6, 8.0)]);
        // Unmeasurable rates are left out.
        assert_eq!(super::by_size(&[(1e6, f64::INFINITY), (2e6, 1e9)], 1e9), vec![(2e6, 1.0)]);
        // Rounds: per size the median factor, a size one round lacks left out.
        let rounds = [vec![(1e6, 1.0), (2e6, 3.0)], vec![(1e6, 3.0), (2e6, 1.0)], vec![(1e6, 2.0)]];
        assert_eq!(super::median_points(rounds.iter()), vec![(1e6, 2.0)]);
    }

    #[test]
    fn the_host_use_is_the_slowdown_per_device_at_once() {
        // 2 devices at once as fast as one alone, 4 at twice its time: half the host each.
        assert!((host_use(1.0, &[(2, 1.0), (4, 2.0)]) - 0.5).abs() < 0.06);
        // Twice and four times as long: each device fills the host.
        assert_eq!(host_use(1.0, &[(2, 2.0), (4, 4.0)]), 1.0);
        assert_eq!(host_use(1.0, &[(2, 3.0), (4, 6.0)]), 1.0, "never more than the whole host");
        assert!((host_use(1.0, &[(2, 0.5), (4, 0.5)]) - 0.3).abs() < 1e-9, "faster together is read as no slowdown");
    }

    #[test]
    fn the_reduction_overhead_is_the_lines_intercept_over_its_slope() {
        // t = 2·(K + 7) exactly: o = 7; the timings' scale does not matter.
        let timed: Vec<(f64, f64)> = [16.0, 32.0, 64.0, 128.0].iter().map(|&k| (k, 2e-3 * (k + 7.0))).collect();
        assert!((k_overhead(&timed) - 7.0).abs() < 1e-9);
        // Proportional to K: no overhead. Falling with K (noise): none either, never negative.
        assert!(k_overhead(&[(16.0, 1.6), (32.0, 3.2)]) < 1e-9);
        assert_eq!(k_overhead(&[(16.0, 3.0), (32.0, 2.0)]), 0.0);
        assert_eq!(k_overhead(&[(16.0, 3.0)]), 0.0);
        // Flat with K except a hair: bounded.
        assert_eq!(k_overhead(&[(16.0, 1.0), (32.0, 1.0 + 1e-12)]), 1024.0);
    }
}
