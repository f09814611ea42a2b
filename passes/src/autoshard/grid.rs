//! The configuration grid: the 3-D configurations people train transformer stacks with —
//! tensor (Megatron) × data × pipeline stages or data × context, the micro-batch size,
//! interleaving, and, where the search may save memory, recomputation, sequence parallelism
//! and ZeRO — each priced as
//! `shardc cost` prices a hand configuration ([`super::pipeline::price_configuration_in`] for
//! pipelines, the named strategies otherwise). The fastest that fits is a candidate beside the
//! e-graph's plans. On a model of repeated blocks it finds in seconds the plans the per-op
//! search spends minutes on, and it holds every published configuration of the degrees it
//! walks, so the search's plan is never slower than one of them in the same model.
//!
//! The walk: tensor degrees that divide a node (largest first), then pipeline stage counts
//! (fewest first, at most the model's blocks), then micro-batch sizes — and on a model with
//! fused attention, data × context (Ulysses) × tensor points after them; for each, the memory
//! rungs in about the order of their cost (as given; ZeRO-1; selective recomputation; with
//! ZeRO-1; torchtitan's op-level recomputation; with ZeRO-1; full recomputation; with ZeRO-1;
//! with ZeRO-3 — with tensor parallelism, each with sequence parallelism) until one fits and
//! on while the step falls (a pipeline whose stages hold more activations balances worse:
//! saving memory can save time), a pipeline that fits
//! priced again interleaved over 2 and 3 chunks on the same rung. A rung whose parameters,
//! gradients and optimizer state alone overflow a device at the point's degrees is passed
//! over unpriced (`model_state_floor`).

use std::collections::BTreeSet;
use std::time::Instant;

use ir::Graph;

use super::budget::SafetyNet;
use super::named::Named;
use super::pipeline::{MicroGraphs, PipelinePlan, UNFIT, price_configuration_in};
use crate::cost::model::{Analysis, model_state_floor, parameter_elements};
use crate::cost::pipeline::graph_batch;
use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options, Recompute, Schedule};

/// The best configuration the grid found.
pub struct GridPlan {
    /// The configuration, in the grammar `cost --strategy` reads.
    pub config: String,
    /// The mesh (a pipeline's: its first stage's).
    pub mesh: ir::shard::Mesh,
    /// Strategies (a pipeline's: every stage's, each on its own mesh).
    pub assignment: Assignment,
    /// The step's price.
    pub breakdown: Breakdown,
    /// The pipeline, when it has stages.
    pub pipeline: Option<PipelinePlan>,
    /// The cost-model options it needs.
    pub options: Options,
    /// Configurations priced.
    pub priced: usize,
    /// Seconds.
    pub time_s: f64,
    /// For a context-parallel plan, what fits without context parallelism: the fastest such
    /// configuration the grid priced and its step, or that none fits.
    pub context_reason: Option<String>,
    /// The fastest configuration without pipeline stages that fits, of those the grid priced,
    /// and its step seconds (why a pipeline was chosen: speed, not memory).
    pub flat: Option<(String, f64)>,
}

/// One point of the grid.
#[derive(Clone, Copy)]
struct Point {
    tensor: usize,
    stages: usize,
    data: usize,
    /// Context-parallel ways (beside data and tensor parallelism; `stages` 1).
    context: usize,
    /// Context parallelism as ring attention (else Ulysses).
    ring: bool,
    /// Expert-parallel ways, within the data-parallel ranks (`tensor`, `stages` and `context` 1).
    expert: usize,
    /// Micro-batch size per data-parallel replica (`None`: the replica's whole batch).
    mbs: Option<usize>,
}

/// The memory rungs, cheapest first: (recompute, ZeRO stage). With tensor parallelism every
/// rung has sequence parallelism too: it saves memory and, replacing the tensor-parallel
/// all-reduces by reduce-scatters and all-gathers and splitting the norms, time.
const RUNGS: &[(Recompute, u8)] = &[
    (Recompute::None, 0),
    (Recompute::None, 1),
    (Recompute::Selective, 0),
    (Recompute::Selective, 1),
    (Recompute::Op, 0),
    (Recompute::Op, 1),
    (Recompute::Full, 0),
    (Recompute::Full, 1),
    (Recompute::Full, 3),
];

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The points of the grid on `devices` devices for a batch of `batch`, in walking order:
/// `stages` limits the pipeline stage counts (`None`: any), never more than the model's
/// `blocks`. Without `accumulate`, a configuration without stages runs the replica's whole
/// batch (the lowering runs no gradient accumulation of its own). With `context`, data ×
/// context × tensor points follow (each power-of-two context degree, each tensor degree; with
/// `ring` each as Ulysses and as ring attention); with
/// `experts` (the fewest experts of a mixture), data × expert points (each expert degree above
/// 1 that divides the experts and the devices), and pipelines of data × expert stages.
fn points(
    cluster: &Cluster,
    devices: usize,
    batch: usize,
    stages: Option<&[usize]>,
    blocks: usize,
    (accumulate, context, ring, experts): (bool, bool, bool, usize),
) -> Vec<Point> {
    let mut tensors: Vec<usize> =
        divisors(devices).into_iter().filter(|t| *t <= cluster.devices_per_node && t.is_power_of_two()).collect();
    tensors.reverse();
    let mut out = Vec::new();
    for &tensor in &tensors {
        for pp in divisors(devices / tensor) {
            // A stage holds at least one block.
            if stages.is_some_and(|s| !s.contains(&pp)) || pp > blocks {
                continue;
            }
            let data = devices / (tensor * pp);
            if !batch.is_multiple_of(data) {
                continue;
            }
            let p = Point { tensor, stages: pp, data, context: 1, ring: false, expert: 1, mbs: None };
            out.extend(micro_sizes(p, batch, accumulate));
            // Pipelines of data × expert stages (expert parallelism within each stage's
            // data-parallel devices).
            if tensor == 1 && pp > 1 {
                for ep in expert_degrees(data, experts) {
                    out.extend(micro_sizes(Point { expert: ep, ..p }, batch, accumulate));
                }
            }
        }
    }
    if context && stages.is_none_or(|s| s.contains(&1)) {
        for cp in divisors(devices).into_iter().filter(|c| *c > 1 && c.is_power_of_two()) {
            for &tensor in tensors.iter().filter(|&&t| (devices / cp).is_multiple_of(t)) {
                let data = devices / (cp * tensor);
                if batch.is_multiple_of(data) {
                    let p = Point { tensor, stages: 1, data, context: cp, ring: false, expert: 1, mbs: None };
                    out.extend(micro_sizes(p, batch, accumulate));
                    if ring {
                        out.extend(micro_sizes(Point { ring: true, ..p }, batch, accumulate));
                    }
                }
            }
        }
    }
    if stages.is_none_or(|s| s.contains(&1)) {
        // Data × expert (× tensor) points: the expert-parallel groups within the data ranks.
        for &tensor in tensors.iter().rev() {
            let data = devices / tensor;
            if !batch.is_multiple_of(data) {
                continue;
            }
            for ep in expert_degrees(data, experts) {
                let p = Point { tensor, stages: 1, data, context: 1, ring: false, expert: ep, mbs: None };
                out.extend(micro_sizes(p, batch, accumulate));
            }
        }
    }
    out
}

/// The expert-parallel degrees of `data` data-parallel devices for mixtures of `experts`
/// experts (0: no mixture, none): each divisor above 1 of both.
fn expert_degrees(data: usize, experts: usize) -> impl Iterator<Item = usize> {
    divisors(data).into_iter().filter(move |e| *e > 1 && experts > 0 && experts.is_multiple_of(*e))
}

/// Point `p` with each micro-batch size it may take: a pipeline micro-batches of 1 or 2 (more
/// fills fewer slots and holds more); without stages, the replica's whole batch and, with
/// `accumulate`, 1, 2 and 4.
fn micro_sizes(p: Point, batch: usize, accumulate: bool) -> impl Iterator<Item = Point> {
    let replica = batch / p.data;
    let pp = p.stages;
    let mut sizes: Vec<Option<usize>> = [1, 2, 4]
        .into_iter()
        .filter(|m| replica.is_multiple_of(*m) && (pp > 1 && *m <= 2 && replica / m >= pp || pp == 1 && accumulate))
        .map(Some)
        .collect();
    if pp == 1 {
        sizes.insert(0, None);
    }
    sizes.into_iter().map(move |mbs| Point { mbs, ..p })
}

/// The configuration string of a point on a rung.
fn describe(p: Point, schedule: Schedule, o: &Options) -> String {
    let mut f = vec![format!("dp={}", p.data)];
    if p.tensor > 1 || p.context == 1 {
        f.push(format!("tp={}", p.tensor));
    }
    if p.context > 1 {
        f.push(format!("cp={}", p.context));
        if p.ring {
            f.push("cp_comm=p2p".into());
        }
    }
    if p.expert > 1 {
        f.push(format!("ep={}", p.expert));
    }
    if p.stages > 1 {
        f.push(format!("pp={}", p.stages));
        if schedule.chunks() > 1 {
            f.push(format!("vp={}", schedule.chunks()));
        }
    }
    if let Some(m) = p.mbs {
        f.push(format!("mbs={m}"));
    }
    let memory = o.memory_fields();
    if memory != "none" {
        f.push(memory);
    }
    f.join(",")
}

/// Walks the grid for `g` (its batch the graph's, `blocks` its repeated blocks) on `devices`
/// devices; `rungs` says whether it may change what the user set to save memory and time
/// (recomputation, sequence parallelism, ZeRO, interleaving; a search for `train` keeps the
/// options it was given). `None` when the model has no
/// batch or nothing applies.
#[allow(clippy::too_many_arguments)]
pub fn search_grid(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    stages: Option<&[usize]>,
    blocks: usize,
    rungs: bool,
    net: &SafetyNet,
) -> Option<GridPlan> {
    let start = Instant::now();
    let batch = graph_batch(g)?;
    let mut graphs = MicroGraphs::new(g, batch);
    let whole = Analysis::of(g);
    let elems = parameter_elements(g, &whole);
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    let mut best: Option<GridPlan> = None;
    // The fastest that fits without context parallelism: (configuration, step seconds).
    let mut plain: Option<(String, f64)> = None;
    // The fastest that fits without pipeline stages.
    let mut flat: Option<(String, f64)> = None;
    let mut priced = 0usize;
    // (tensor, context) degrees that do not apply (Megatron's, Ulysses')
    let mut refused: BTreeSet<(usize, usize, bool)> = BTreeSet::new();
    let attention = g.op_nodes().is_ok_and(|o| o.iter().any(|&n| g.node(n).op.op_type().starts_with("Attention")));
    // (Ring attention where an attention splits its sequence so.)
    let ring = attention
        && g.op_nodes().is_ok_and(|o| {
            o.iter().any(|&n| {
                matches!(g.node(n).op, ir::Op::Attention(_))
                    && ir::shard::iter_space(g, n).dims.iter().any(|d| d.role == ir::shard::DimRole::Sequence)
            })
        });
    let experts = fewest_experts(g);
    let rungs: Vec<Options> = if rungs {
        RUNGS.iter().map(|&(recompute, zero)| Options { recompute, zero, ..opts.clone() }).collect()
    } else {
        vec![opts.clone()]
    };
    for p in points(cluster, devices, batch as usize, stages, blocks, (rungs.len() > 1, attention, ring, experts)) {
        if refused.contains(&(p.tensor, p.context, p.ring)) {
            continue;
        }
        if net.expired("configurations") {
            break;
        }
        let mut first = true;
        let mut fitted: Option<f64> = None;
        let saving = rungs.len() > 1;
        // No rung after the first is faster than `bound` (see `rung_bound`).
        let mut bound: Option<f64> = None;
        // (ZeRO shards over the devices a gradient is all-reduced over: data and context.)
        let sharders = p.data * p.context;
        for o in rungs.iter().filter(|o| o.zero == 0 || sharders > 1) {
            if bound.is_some_and(|lb| best.as_ref().is_some_and(|b| lb >= b.breakdown.step_time_s)) {
                break;
            }
            // (Not beside context parallelism: `config::Config::resolve` says why.)
            let sp = p.tensor > 1 && p.context == 1 && (saving || o.sequence_parallel);
            let o = &Options { sequence_parallel: sp, ..o.clone() };
            // A rung whose model state alone overflows a device fits under no split (expert
            // parallelism splits the experts' state further: priced instead).
            if p.expert == 1 && model_state_floor(o, elems, (p.tensor * p.stages) as f64, sharders as f64) > capacity {
                continue;
            }
            let at = (p, Schedule::OneFOneB, o, first && saving);
            let mut cand = match price_point(&mut graphs, (g, &whole), cluster, devices, at) {
                Priced::NotApplicable => {
                    if first && (p.tensor > 1 || p.context > 1) && p.stages == 1 {
                        refused.insert((p.tensor, p.context, p.ring));
                    }
                    break;
                }
                Priced::Unfit(unconstrained) => {
                    if first {
                        bound = unconstrained.map(|b| rung_bound(b, p, batch as usize));
                    }
                    priced += 1;
                    first = false;
                    continue;
                }
                Priced::Fit(c) => *c,
            };
            priced += 1;
            first = false;
            // A rung that fits may still be slower than the next: a stage holding more
            // micro-batches' activations takes fewer blocks, and the stages balance worse.
            // The walk goes on while the step falls.
            if fitted.is_some_and(|f| cand.breakdown.step_time_s >= f) {
                break;
            }
            fitted = Some(cand.breakdown.step_time_s);
            if p.stages > 1 && saving {
                for v in [2, 3].into_iter().filter(|v| p.stages * v <= blocks) {
                    match price_point(
                        &mut graphs,
                        (g, &whole),
                        cluster,
                        devices,
                        (p, Schedule::Interleaved(v), o, false),
                    ) {
                        Priced::Fit(c) => {
                            priced += 1;
                            if c.breakdown.step_time_s < cand.breakdown.step_time_s {
                                cand = *c;
                            }
                        }
                        Priced::Unfit(_) => priced += 1,
                        Priced::NotApplicable => {}
                    }
                }
            }
            let step = cand.breakdown.step_time_s;
            if p.context == 1 && plain.as_ref().is_none_or(|(_, s)| step < *s) {
                plain = Some((cand.config.clone(), step));
            }
            if p.stages == 1 && flat.as_ref().is_none_or(|(_, s)| step < *s) {
                flat = Some((cand.config.clone(), step));
            }
            if best.as_ref().is_none_or(|b| step < b.breakdown.step_time_s) {
                best = Some(cand);
            }
        }
    }
    best.map(|mut b| {
        if b.pipeline.is_none() {
            // The winner's per-op rows and communication events.
            let cm = CostModel::with_analysis(g, &whole, cluster, b.mesh.clone(), b.options.clone());
            b.breakdown = cm.evaluate(&b.assignment);
        }
        b.priced = priced;
        b.time_s = start.elapsed().as_secs_f64();
        b.flat = flat;
        if b.config.contains(",cp=") {
            b.context_reason = Some(match plain {
                Some((c, s)) => format!(
                    "the fastest configuration without it that fits of those the grid priced, `{c}`, steps in {s:.3} s ({:.2}× this plan's)",
                    s / b.breakdown.step_time_s
                ),
                None => format!("no configuration without it of the {priced} the grid priced fits in device memory"),
            });
        }
        b
    })
}

/// The fewest experts any mixture of experts of `g` has (0: none).
fn fewest_experts(g: &Graph) -> usize {
    let Ok(ops) = g.op_nodes() else { return 0 };
    ops.iter()
        .filter(|&&n| matches!(g.node(n).op, ir::Op::MoE(_)))
        .filter_map(|&n| g.tensor_type(g.node(n).input(3)?)?.static_dims()?.first().copied())
        .min()
        .map_or(0, |e| e.max(0) as usize)
}

/// What pricing a point gave.
enum Priced {
    /// The configuration does not apply to the model or the cluster.
    NotApplicable,
    /// It applies but does not fit in device memory; its step seconds and those of its
    /// update and gradient synchronisation as if memory were unbounded, where it was priced
    /// so.
    Unfit(Option<(f64, f64)>),
    /// Its plan.
    Fit(Box<GridPlan>),
}

/// Prices point `p` under `schedule` with options `o` (`g` the whole graph and its analysis);
/// with `unbounded`, a point that does not fit is priced as if memory were unbounded too.
fn price_point(
    graphs: &mut MicroGraphs<'_>,
    whole: (&Graph, &Analysis),
    cluster: &Cluster,
    devices: usize,
    (p, schedule, o, unbounded): (Point, Schedule, &Options, bool),
) -> Priced {
    match plan_point(graphs, whole, cluster, devices, p, schedule, o, unbounded) {
        Err(unfit) if unfit => Priced::Unfit(None),
        Err(_) => Priced::NotApplicable,
        Ok(c) if !c.breakdown.feasible => {
            let b = &c.breakdown;
            Priced::Unfit(Some((b.step_time_s, b.update_s + b.gradient_sync_s)))
        }
        Ok(c) => Priced::Fit(Box::new(c)),
    }
}

/// No later memory rung of point `p` steps faster than this, given the first rung's step and
/// update and gradient-synchronisation seconds with memory unbounded: a later rung only adds
/// work (recomputation, ZeRO's gathers) and memory limits, but may save the update and
/// change the synchronisation (ZeRO shards them) and, interleaved over at most 3 chunks,
/// shrink the pipeline's `(M + S − 1)` slots to `M + (S − 1)/3`.
fn rung_bound((step, update): (f64, f64), p: Point, batch: usize) -> f64 {
    let m = (batch / (p.data * p.mbs.unwrap_or(1))).max(1) as f64;
    let s = p.stages as f64;
    let interleaved = (m + (s - 1.0) / 3.0) / (m + s - 1.0);
    (step - update).max(0.0) * interleaved
}

/// [`price_point`]'s plan; the error says whether the point applies but does not fit.
#[allow(clippy::too_many_arguments)]
fn plan_point(
    graphs: &mut MicroGraphs<'_>,
    (g, whole): (&Graph, &Analysis),
    cluster: &Cluster,
    devices: usize,
    p: Point,
    schedule: Schedule,
    o: &Options,
    unbounded: bool,
) -> Result<GridPlan, bool> {
    let batch = graphs.batch() as usize;
    if p.stages > 1 {
        let micro = batch / (p.data * p.mbs.unwrap_or(1));
        let shape = (p.stages, micro, schedule, p.tensor, p.expert);
        let pipe = price_configuration_in(graphs, cluster, devices, shape, o, unbounded).map_err(|e| e == UNFIT)?;
        return Ok(GridPlan {
            config: describe(p, schedule, o),
            mesh: pipe.stages.first().ok_or(false)?.sub_mesh.clone(),
            assignment: pipe.assignment(),
            breakdown: pipe.breakdown.clone(),
            pipeline: Some(pipe),
            options: o.clone(),
            priced: 0,
            time_s: 0.0,
            context_reason: None,
            flat: None,
        });
    }
    let named = if p.expert > 1 && p.stages == 1 {
        Named::Expert { ep: p.expert, tp: p.tensor }
    } else if p.context > 1 {
        Named::Context { dp: p.data, tp: p.tensor, ring: p.ring }
    } else {
        Named::stage_strategy(p.tensor, 1, devices).map_err(|_| false)?
    };
    let mut o = o.clone();
    o.accumulation = p.mbs.map_or(1, |m| batch / (p.data * m));
    let mesh = named.mesh(cluster, devices).map_err(|_| false)?;
    let cm = CostModel::with_analysis(g, whole, cluster, mesh.clone(), o.clone());
    let assignment = crate::autoshard::named::assign(&cm, &named).map_err(|_| false)?;
    let breakdown = cm.price(&assignment);
    let mut config = describe(p, schedule, &o);
    // Mixtures that allow the all-to-all dispatcher: the all-gather one priced too, the
    // faster kept (a fit first).
    let dispatch = matches!(named, Named::Expert { .. }) && crate::autoshard::named::has_dispatch(&cm);
    let (assignment, breakdown) = if dispatch {
        let gathered = crate::autoshard::named::assign_with(&cm, &named, false).map_err(|_| false)?;
        let other = cm.price(&gathered);
        if (other.feasible, -other.step_time_s) > (breakdown.feasible, -breakdown.step_time_s) {
            (gathered, other)
        } else {
            config.push_str(",ep_comm=a2a");
            if let Some(f) = ir::ops::experts::capacity_of(g).filter(|&f| f > 0.0) {
                config.push_str(&format!(",capacity={f}"));
            }
            (assignment, breakdown)
        }
    } else {
        (assignment, breakdown)
    };
    Ok(GridPlan {
        config,
        breakdown,
        mesh,
        assignment,
        pipeline: None,
        options: o,
        priced: 0,
        time_s: 0.0,
        context_reason: None,
        flat: None,
    })
}
