//! The stages before and around [`super::plan`] and [`super::lower`]: the model made ready for
//! training ([`freeze`], [`rewrite`]) and its training program compiled in one call
//! ([`compile`]: the training graph, gradient accumulation's micro-batch graph, recomputation,
//! ZeRO's early gradients, the plan and the lowering).

use ir::{Graph, Model};
use passes::autodiff::{LossSpec, OptimizerSpec, TrainInfo};
use passes::autoshard::{Plan, SearchOptions, SearchResult};
use passes::cost::{Cluster, Options};

use super::{TrainChoice, TrainPlan, early_gradients, lower, named_strategy, plan, recomputed};
use crate::error::{Error, Result};

/// Makes the initializers that are not trained constants: those matching `patterns`
/// (`--freeze`), those outside a case's `trainable` list, and those a plan document priced as
/// constants (`plan --freeze`). Returns a note naming them, `None` when none is.
pub fn freeze(
    g: &mut Graph,
    patterns: &[String],
    trainable: Option<&[String]>,
    plan: Option<&Plan>,
) -> Result<Option<String>> {
    let mut frozen = crate::train::freeze(g, patterns, trainable).map_err(Error::Training)?;
    if let Some(p) = plan {
        frozen.extend(crate::train::freeze_as_planned(g, p));
    }
    Ok((!frozen.is_empty()).then(|| {
        let shown: Vec<&str> = frozen.iter().take(8).map(String::as_str).collect();
        let more = if frozen.len() > 8 { format!(" and {} more", frozen.len() - 8) } else { String::new() };
        format!("constant, not trained: {}{more}", shown.join(", "))
    }))
}

/// The model as `plan` and `cost` price it, rewritten as the run's plan chose: identities
/// bypassed, the `algebra` pass (fused GEMMs that are split un-fused, reshape detours folded)
/// and the mixtures' capacity (`moe_capacity`), then a plan document's rewrites made or — with
/// neither a named strategy nor a plan — the search run with `search` (rewriting the model as
/// it chooses), its result returned. The program trains that model's parameters.
pub fn rewrite(
    model: &mut Model,
    c: &TrainChoice<'_>,
    moe_capacity: Option<f32>,
    search: SearchOptions,
    (cluster, opts): (&Cluster, &Options),
) -> Result<Option<SearchResult>> {
    // Identities bypassed as `plan` canonicalizes them: a plan names the op computing a graph
    // output by the output's name.
    passes::canonicalize::bypass_identities(&mut model.graph);
    let mut pm = passes::PassManager::new();
    pm.add(passes::Algebra);
    if let Some(f) = moe_capacity {
        pm.add(passes::MoeCapacity(f));
    }
    pm.run(model).map_err(Error::Pass)?;
    if let Some((p, _)) = &c.plan {
        apply_plan_rewrites(&mut model.graph, p).map_err(Error::Plan)?;
        return Ok(None);
    }
    if named_strategy(c).is_some() {
        return Ok(None);
    }
    let devices = c.devices.unwrap_or(1);
    passes::autoshard::search_rewriting(&mut model.graph, cluster, devices, opts, &search)
        .map(Some)
        .map_err(Error::Search)
}

/// Makes on `g` the algebraic rewrites `plan` was searched with and applied
/// ([`Plan::rewrites`]), and its mixtures' capacity, so the plan's ops are `g`'s.
pub fn apply_plan_rewrites(g: &mut Graph, plan: &Plan) -> std::result::Result<(), String> {
    for c in plan.rewrites.iter().filter(|c| c.applied) {
        match (&c.cheaper_at, c.applied_at_cheaper) {
            (Some(at), true) => passes::algebra::apply_named_at(g, &c.rule, at),
            _ => passes::algebra::apply_named(g, &c.rule),
        }
        .map_err(|e| format!("the plan's rewrite `{}` does not apply: {e}", c.rule))?;
    }
    if let Some(f) = plan.moe_capacity {
        ir::ops::experts::set_capacity(g, f).map_err(|e| format!("the plan's capacity factor: {e}"))?;
    }
    Ok(())
}

/// A training run's program and what it was made from.
pub struct Compiled {
    /// The training graph of the whole batch (forward, loss, backward, update) and its
    /// interface.
    pub tm: Model,
    pub info: TrainInfo,
    /// With gradient accumulation, the training graph of one micro-batch.
    pub micro_tm: Option<Model>,
    /// The plan lowered.
    pub chosen: TrainPlan,
    pub program: codegen::Program,
    /// Micro-batches per step.
    pub micro: usize,
    /// The graph the program was lowered from (one micro-batch's training graph, recomputed
    /// and reordered as run): what the prover proves the program computes.
    pub lowered: Graph,
    pub notes: Vec<String>,
}

/// Compiles the training step of `model` (rewritten as [`rewrite`] left it, `searched` its
/// search's result) with `loss` and `opt`: the training graph, with `c.micro_batches` the
/// graph of one micro-batch, `opts.recompute`'s regions recomputed, ZeRO-2/3's gradients
/// handed to their updates early, planned as `c` asks ([`plan`]) and lowered ([`lower`]).
pub fn compile(
    model: &Model,
    c: &TrainChoice<'_>,
    searched: Option<SearchResult>,
    (loss, opt): (&LossSpec, &OptimizerSpec),
    (cluster, opts): (&Cluster, &Options),
) -> Result<Compiled> {
    let mut notes = Vec::new();
    let (tm, info) = crate::train::training_model(model, loss, opt).map_err(Error::Training)?;
    // With micro-batches, the program is the training graph of one micro-batch (the model
    // re-batched to 1/M of its batch), run M times per step before the update.
    let micro_tm = match c.micro_batches {
        1 => None,
        m => Some(crate::train::micro_training_model(model, loss, opt, m).map_err(Error::Training)?),
    };
    let gl = micro_tm.as_ref().map_or(&tm.graph, |t| &t.graph);
    // Recomputation rewrites the graph the program runs; the references keep the graph as
    // differentiated.
    let recomputed = recomputed(gl, opts.recompute, &mut notes)?;
    let gl = recomputed.as_ref().unwrap_or(gl);
    let early = early_gradients(gl, opts.zero, c.micro_batches, &mut notes)?;
    let gl = early.as_ref().unwrap_or(gl);
    let chosen = plan(c, searched, &model.graph, gl, cluster, opts)?;
    notes.extend(chosen.notes.iter().cloned());
    let (program, micro, pipelined) = lower(c, model, (loss, opt), (cluster, opts), &tm, gl, &chosen, &mut notes)?;
    let lowered = pipelined.unwrap_or_else(|| gl.clone());
    Ok(Compiled { tm, info, micro_tm, chosen, program, micro, lowered, notes })
}
