//! The training driver as a library: the stages `shardc train` runs between reading its
//! arguments and printing, each a function a compiler can call or replace.
//!
//! a forward model and its training graph ([`crate::train::training_model`]) → a
//! [`TrainPlan`] ([`plan`]: a named strategy priced on the training graph, a plan document
//! of the forward model or the search's result, the backward and update ops following the
//! forward plan) → the devices' program ([`lower`]: gradient accumulation's micro-batches and
//! a pipeline's stages cut in) → its price ([`price`]) → training steps
//! ([`crate::train::run_steps`]). Before them, [`freeze`] and [`rewrite`] make the model ready
//! (constants, the `algebra` pass, a plan's rewrites or the search); [`compile`] runs the
//! stages from the training graph to the program in one call.

use ir::Graph;
use passes::autodiff::{LossSpec, OptimizerSpec};
use passes::cost::{Cluster, Options};

use crate::error::Error;
use crate::exec;
use crate::report::secs;

mod compile;
pub use compile::{Compiled, apply_plan_rewrites, compile, freeze, rewrite};

/// What a training run asks of the plan, beside the model: the devices, a named strategy, a
/// plan document, the micro-batches of gradient accumulation.
#[derive(Clone, Debug, Default)]
pub struct TrainChoice<'a> {
    /// Devices (`None`: one, or the plan document's).
    pub devices: Option<usize>,
    /// A named strategy (`data`, `megatron`, `pipeline:S:M`, …) or `auto` (the search).
    pub strategy: Option<&'a str>,
    /// A plan document of the forward model, checked against it by the caller, and its name
    /// for messages.
    pub plan: Option<(&'a passes::autoshard::Plan, String)>,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: usize,
}

/// The plan a training run lowers.
pub struct TrainPlan {
    /// Strategies of the training graph's ops (what is lowered), or a pipelined plan of the
    /// forward model whose stages the training graph's ops are then given.
    pub lowering: Lowering,
    pub devices: usize,
    /// The cost model's step time and peak memory per device: the training program's price
    /// for a flat plan, the pipelined plan's for a pipeline (its step then replaced by the
    /// lowered program's, [`shardc::simulate`]).
    pub predicted: Option<(f64, u64)>,
    pub desc: String,
    pub notes: Vec<String>,
    /// The plan in ML engineers' terms (degrees of parallelism, throughput at the predicted
    /// step), from the forward model's strategies.
    pub summary: Option<passes::autoshard::plan::PlanSummary>,
}

pub enum Lowering {
    /// One stage: the training graph's strategies.
    Flat(Box<passes::autoshard::SearchResult>),
    /// Pipelined: the forward plan's stages and strategies.
    Pipeline(exec::TrainPipeline, passes::cost::Assignment),
}

/// The forward plan a training program follows: pipelined (the choice made: stages and
/// strategies), or flat — its strategies on a mesh, the devices, its own price of the step
/// and its description — for the training graph's ops to be derived from.
enum ForwardPlan {
    Pipelined(Box<TrainPlan>),
    Flat(passes::cost::Assignment, ir::shard::Mesh, usize, (f64, u64), String),
}

/// The named strategy `train` runs: `--strategy` unless `auto`, and `data` for one device
/// without a plan; `None` when it searches or follows a plan.
pub fn named_strategy<'a>(c: &TrainChoice<'a>) -> Option<&'a str> {
    match (c.strategy, c.plan.is_some(), c.devices.unwrap_or(1)) {
        (Some(s), _, _) if s != "auto" => Some(s),
        (None, false, 1) => Some("data"),
        _ => None,
    }
}

/// The plan a training run lowers: a named strategy priced on the training graph `train`, a
/// plan document of the forward model, or the search's result `searched` on it; for the last
/// two the training graph's backward and update ops follow the forward plan
/// ([`exec::training_result`]).
pub fn plan(
    c: &TrainChoice<'_>,
    searched: Option<passes::autoshard::SearchResult>,
    forward: &Graph,
    train: &Graph,
    cluster: &Cluster,
    opts: &Options,
) -> crate::error::Result<TrainPlan> {
    plan_inner(c, searched, forward, train, cluster, opts).map_err(Error::Plan)
}

/// [`plan`], its failures as messages.
fn plan_inner(
    c: &TrainChoice<'_>,
    searched: Option<passes::autoshard::SearchResult>,
    forward: &Graph,
    train: &Graph,
    cluster: &Cluster,
    opts: &Options,
) -> Result<TrainPlan, String> {
    if let Some(s) = named_strategy(c) {
        // A pipeline (`pipeline:S:M…`, `pp=…`) priced as the search prices its pipelines,
        // then trained as a searched one is.
        if let Ok(named @ passes::autoshard::Named::Pipeline { .. }) = passes::autoshard::Named::parse(s) {
            let devices = c.devices.unwrap_or(1);
            let r = exec::pipeline_result(forward, cluster, devices, &named, opts)?;
            if let ForwardPlan::Pipelined(p) = from_search(c, Some(r), forward, cluster, opts)? {
                return Ok(TrainPlan { desc: s.to_string(), ..*p });
            }
        }
        return named_plan(c, s, forward, train, cluster, opts);
    }
    let mut notes = Vec::new();
    let chosen = match &c.plan {
        Some((plan, name)) => from_plan(c, plan, name, forward, cluster, opts, &mut notes)?,
        // No plan given: the search's.
        None => from_search(c, searched, forward, cluster, opts)?,
    };
    let (fwd, mesh, devices, predicted, desc) = match chosen {
        ForwardPlan::Pipelined(p) => return Ok(TrainPlan { notes, ..*p }),
        ForwardPlan::Flat(fwd, mesh, devices, predicted, desc) => (fwd, mesh, devices, predicted, desc),
    };
    let (result, kept) = exec::training_result(train, forward, &fwd, &mesh, cluster, opts)?;
    // The prediction is the derived training program's price (what runs); the forward
    // plan's own estimate of the step is said beside it.
    let program = step_and_memory(&result.breakdown);
    notes.push(format!(
        "the plan prices the step at {} ({:.1} MB per device) from the forward model; the training program derived from it at {} ({:.1} MB)",
        secs(predicted.0),
        predicted.1 as f64 / 1e6,
        secs(program.0),
        program.1 as f64 / 1e6
    ));
    let predicted = program;
    if kept < fwd.strategies.len() {
        notes.push(format!(
            "{kept} of the plan's {} forward ops keep their strategy; the others are chosen like the backward ops",
            fwd.strategies.len()
        ));
    }
    let summary = summary_of(forward, cluster, opts, devices, &fwd, &mesh, Some(predicted.0), None);
    Ok(TrainPlan {
        lowering: Lowering::Flat(Box::new(result)),
        devices,
        predicted: Some(predicted),
        desc,
        notes,
        summary,
    })
}

/// A named strategy on the training graph, priced as the training program runs.
fn named_plan(
    c: &TrainChoice<'_>,
    s: &str,
    forward: &Graph,
    train: &Graph,
    cluster: &Cluster,
    opts: &Options,
) -> Result<TrainPlan, String> {
    let devices = c.devices.unwrap_or(1);
    let result = exec::named_result(train, cluster, devices, s, opts)?;
    // The training program priced as it runs (each op of the step once, in its phase).
    let predicted = Some(step_and_memory(&result.breakdown));
    let summary = exec::named_result(forward, cluster, devices, s, opts).ok().and_then(|f| {
        summary_of(forward, cluster, opts, devices, &f.assignment, &f.mesh, predicted.map(|p| p.0), None)
    });
    Ok(TrainPlan {
        lowering: Lowering::Flat(Box::new(result)),
        devices,
        predicted,
        desc: s.to_string(),
        notes: Vec::new(),
        summary,
    })
}

/// The forward plan of a plan file, checked against the model (and its pipeline priced again).
fn from_plan(
    c: &TrainChoice<'_>,
    plan: &passes::autoshard::Plan,
    name: &str,
    forward: &Graph,
    cluster: &Cluster,
    opts: &Options,
    notes: &mut Vec<String>,
) -> Result<ForwardPlan, String> {
    if let Some(d) = c.devices
        && d != plan.devices
    {
        return Err(format!("--devices {d}: `{}` is a plan for {} devices", name, plan.devices));
    }
    let diffs = plan.differences(forward, true);
    if !diffs.is_empty() {
        return Err(format!("`{}`: {}", name, passes::autoshard::plan::differences_message(&diffs)));
    }
    let pipe = exec::TrainPipeline::of_plan(plan)?;
    let mesh = plan.stage_meshes()?.remove(0);
    // One validation for run, lower and train: every op has a strategy its stage's
    // mesh can hold.
    let (fwd, _) = plan.stage_assignment_uncanonical(forward).map_err(|e| format!("`{name}`: {e}"))?;
    if let Some(pipe) = pipe {
        let desc = format!(
            "plan {} ({} stages × {} micro-batches, {})",
            name,
            pipe.stages.len(),
            pipe.micro_batches,
            pipe.schedule.name()
        );
        // Priced again (time and memory) rather than read from the file.
        let predicted = match pipe.price(forward, &fwd, cluster, opts) {
            Ok(p) => Some(step_and_memory(&p.breakdown)),
            Err(e) => {
                notes.push(format!("the plan's pipeline could not be priced again ({e}): no prediction"));
                None
            }
        };
        let shape = (pipe.stages.len(), pipe.micro_batches, pipe.schedule.name().to_string());
        let step = predicted.map(|p| p.0);
        let summary = summary_of(forward, cluster, opts, plan.devices, &fwd, &mesh, step, Some(shape));
        return Ok(ForwardPlan::Pipelined(Box::new(TrainPlan {
            lowering: Lowering::Pipeline(pipe, fwd),
            devices: plan.devices,
            predicted,
            desc,
            notes: Vec::new(),
            summary,
        })));
    }
    let cm = passes::cost::CostModel::new(forward, cluster, mesh.clone(), opts.clone());
    let predicted = step_and_memory(&cm.evaluate(&fwd));
    Ok(ForwardPlan::Flat(fwd, mesh, plan.devices, predicted, format!("plan {}", name)))
}

/// The forward plan of the search `run` made.
fn from_search(
    c: &TrainChoice<'_>,
    searched: Option<passes::autoshard::SearchResult>,
    forward: &Graph,
    cluster: &Cluster,
    opts: &Options,
) -> Result<ForwardPlan, String> {
    let devices = c.devices.unwrap_or(1);
    let r = searched.ok_or_else(|| "no plan, strategy or search".to_string())?;
    if let Some(pipe) = exec::TrainPipeline::of_search(forward, &r)? {
        let desc = format!(
            "searched plan ({} stages × {} micro-batches, {})",
            pipe.stages.len(),
            pipe.micro_batches,
            pipe.schedule.name()
        );
        let predicted = r.pipeline.as_ref().map(|p| step_and_memory(&p.breakdown));
        let shape = (pipe.stages.len(), pipe.micro_batches, pipe.schedule.name().to_string());
        let summary =
            summary_of(forward, cluster, opts, devices, &r.assignment, &r.mesh, predicted.map(|p| p.0), Some(shape));
        return Ok(ForwardPlan::Pipelined(Box::new(TrainPlan {
            lowering: Lowering::Pipeline(pipe, r.assignment),
            devices,
            predicted,
            desc,
            notes: Vec::new(),
            summary,
        })));
    }
    let what = r.same_as.clone().map_or("per-layer strategies".into(), |s| format!("the `{s}` plan"));
    let desc = format!("searched plan ({what}, mesh {})", passes::autoshard::mesh_string(&r.mesh));
    Ok(ForwardPlan::Flat(r.assignment, r.mesh, devices, step_and_memory(&r.breakdown), desc))
}

/// The summary of the forward strategies `asg` on `mesh` at step time `step`.
#[allow(clippy::too_many_arguments)]
fn summary_of(
    forward: &Graph,
    cluster: &Cluster,
    opts: &Options,
    devices: usize,
    asg: &passes::cost::Assignment,
    mesh: &ir::shard::Mesh,
    step: Option<f64>,
    pipeline: Option<(usize, usize, String)>,
) -> Option<passes::autoshard::plan::PlanSummary> {
    let cm = passes::cost::CostModel::new(forward, cluster, mesh.clone(), opts.clone());
    Some(passes::autoshard::plan::PlanSummary::new(&cm, asg, cluster, opts, devices, step?, pipeline))
}

fn step_and_memory(b: &passes::cost::Breakdown) -> (f64, u64) {
    (b.step_time_s, b.memory_per_device_bytes.iter().copied().max().unwrap_or(0))
}

/// The training program `chosen` lowers to (one micro-batch's training graph `gl` for a flat
/// plan with gradient accumulation, each stage's for a pipeline), its micro-batch count, and
/// a pipeline's training graph of one micro-batch (the graph lowered). `model` is the forward
/// model the training graph `tm` was made from with `loss` and `opt`.
#[allow(clippy::too_many_arguments)]
pub fn lower(
    c: &TrainChoice<'_>,
    model: &ir::Model,
    (loss, opt): (&LossSpec, &OptimizerSpec),
    (cluster, opts): (&Cluster, &Options),
    tm: &ir::Model,
    gl: &Graph,
    chosen: &TrainPlan,
    notes: &mut Vec<String>,
) -> crate::error::Result<(codegen::Program, usize, Option<Graph>)> {
    let (g, devices) = (&tm.graph, chosen.devices);
    let (program, micro, pipelined) = match &chosen.lowering {
        Lowering::Flat(r) => (exec::training_program(gl, r, devices, opts.zero)?, c.micro_batches, None),
        Lowering::Pipeline(pipe, fwd) => {
            // The stages' updates run on their parameters whole: a pipeline priced with ZeRO
            // would run without it.
            if opts.zero >= 1 {
                return Err(Error::Plan(format!(
                    "ZeRO-{}: `train` runs ZeRO on plans without pipelines; `cost` and `plan` price it with pipelines",
                    opts.zero
                )));
            }
            let m = pipe.micro_batches;
            if c.micro_batches != 1 && c.micro_batches != m {
                return Err(Error::Plan(format!(
                    "--micro-batches {}: the pipelined plan runs {m} micro-batches",
                    c.micro_batches
                )));
            }
            let micro_tm = match m {
                1 => tm.clone(),
                m => crate::train::micro_training_model(model, loss, opt, m).map_err(Error::Training)?,
            };
            let (p, kept) = exec::training_pipeline_program(&micro_tm.graph, &model.graph, fwd, pipe, cluster, opts)
                .map_err(Error::Plan)?;
            if kept < fwd.strategies.len() {
                notes.push(format!(
                    "{kept} of the plan's {} forward ops keep their strategy; the others are chosen like the backward ops",
                    fwd.strategies.len()
                ));
            }
            (p, m, Some(micro_tm.graph))
        }
    };
    let program = exec::as_micro_batches(program, g, micro).map_err(Error::Plan)?;
    for f in &program.fallbacks {
        notes.push(format!("runs replicated instead of as planned: {f}"));
    }
    Ok((program, micro, pipelined))
}

/// The cost model's price of the training program. A pipeline's, and gradient accumulation
/// over micro-batches, are its devices' lowered programs played through the runtime's
/// schedule, steps back to back as the runtime runs them (the plan's closed form prices the
/// forward model's stages).
pub fn price(
    program: &codegen::Program,
    chosen: &TrainPlan,
    (cluster, opts): (&Cluster, &Options),
    notes: &mut Vec<String>,
) -> Option<(f64, u64)> {
    let mut predicted = chosen.predicted;
    if program.stage_devices.len() > 1 || program.micro_batches > 1 {
        match crate::simulate::simulate(program, cluster, opts, true) {
            Ok(s) => predicted = predicted.map(|(_, memory)| (s.period_s, memory)),
            Err(e) => {
                notes.push(format!("the program's step could not be priced op by op ({e}); predicted: the plan's"))
            }
        }
    }
    predicted
}

/// `g` with `mode`'s regions recomputed in its backward pass ([`passes::recompute`]), `None`
/// when there is nothing to recompute. The references keep the graph as differentiated.
pub fn recomputed(
    g: &Graph,
    mode: passes::cost::Recompute,
    notes: &mut Vec<String>,
) -> crate::error::Result<Option<Graph>> {
    let mut r = g.clone();
    let copied = passes::recompute::recompute(&mut r, mode)
        .map_err(|e| Error::Training(format!("recomputation ({}): {e}", mode.name())))?;
    if copied == 0 {
        return Ok(None);
    }
    notes.push(format!("recomputation ({}): {copied} forward ops run again in the backward pass", mode.name()));
    Ok(Some(r))
}

/// `g` with each gradient handed to its update as soon as it is complete ([`passes::zero`]),
/// which ZeRO stages 2 and 3 need; `None` below stage 2. Refused with micro-batches: the
/// accumulated gradient is whole until the last micro-batch.
pub fn early_gradients(
    g: &Graph,
    zero: u8,
    micro_batches: usize,
    notes: &mut Vec<String>,
) -> crate::error::Result<Option<Graph>> {
    if zero < 2 {
        return Ok(None);
    }
    if micro_batches > 1 {
        return Err(Error::Training(format!(
            "ZeRO-{zero}: stages 2 and 3 run without micro-batches (each update runs when its gradient is complete); `cost` and `plan` price them with accumulation"
        )));
    }
    let mut r = g.clone();
    let moved = passes::zero::early_gradients(&mut r).map_err(|e| Error::Training(format!("ZeRO-{zero}: {e}")))?;
    notes.push(format!(
        "ZeRO-{zero}: {moved} gradients reduce-scattered into their updates' shards as soon as they are complete"
    ));
    Ok(Some(r))
}
