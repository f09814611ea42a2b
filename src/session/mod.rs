//! The forward-run driver as a library: one typed value per stage, each a function a compiler
//! can call or replace. `shardc run` is these calls between parsing its arguments and printing.
//!
//! a prepared graph (canonical, weights materialized: [`crate::exec::materialize`]) →
//! [`Planned`] ([`plan`]: a program for the devices, how it was chosen and what the cost model
//! predicts) → a run ([`codegen::run`]) → [`CheckRow`]s ([`check`]: every output against the
//! single-device reference and, for a re-shaped model, the model as written:
//! [`crate::written`]).

use std::collections::HashMap;

use codegen::Program;
use ir::Graph;
use ir::eval::Array;
use passes::autoshard::{self, Plan, SearchOptions, SearchResult};
use passes::cost::{Cluster, Options};

use crate::exec;

pub mod train;

/// How the devices' program is chosen.
pub enum Choice<'a> {
    /// A plan document already checked against the graph (`name` says where it came from).
    Plan { plan: &'a Plan, name: String },
    /// A named strategy (`data`, `megatron`, `hybrid:dp:2,tp:2`, …) on the cluster's devices.
    Strategy(&'a str),
    /// The search `shardc plan` runs, rewrites included.
    Search(SearchOptions),
}

/// How a [`Planned`] program was chosen, for the report.
pub enum How {
    /// From a plan document: its name and device count.
    Plan { name: String, devices: usize },
    /// A named strategy on the cluster's devices.
    Strategy { name: String, devices: usize, cluster: String },
    /// The search's result (its rewrites, pipeline and mesh) on the cluster's devices.
    Search { result: Box<SearchResult>, devices: usize, cluster: String },
}

/// A program for the devices, how it was chosen, and the cost model's forward time for it
/// (cluster name, seconds) where the cost model prices it as one forward pass.
pub struct Planned {
    pub program: Program,
    /// The graph the program was lowered from where the search rewrote `g`; `None`: `g`.
    pub rewritten: Option<Graph>,
    pub how: How,
    pub predicted: Option<(String, f64)>,
}

/// The program for `g` on `devices` devices of `cluster`, chosen as `choice` says.
pub fn plan(
    g: &Graph,
    choice: Choice<'_>,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
) -> crate::error::Result<Planned> {
    use crate::error::Error;
    match choice {
        Choice::Plan { plan, name } => {
            let program = exec::program_for_plan(g, plan).map_err(|e| match e {
                Error::Plan(m) => Error::Plan(format!("the plan does not lower: {m}")),
                e => e,
            })?;
            let predicted = (plan.stages.len() <= 1)
                .then(|| plan.breakdown.get("forward_s").and_then(|v| v.as_f64()))
                .flatten()
                .map(|f| (plan.cluster.clone(), f));
            Ok(Planned { program, rewritten: None, how: How::Plan { name, devices: plan.devices }, predicted })
        }
        Choice::Strategy(s) => {
            let r = exec::named_result(g, cluster, devices, s, opts).map_err(Error::Plan)?;
            let program = exec::program_for_search(g, &r, devices)?;
            let predicted = Some((cluster.name.clone(), r.breakdown.forward_s));
            Ok(Planned {
                program,
                rewritten: None,
                how: How::Strategy { name: s.into(), devices, cluster: cluster.name.clone() },
                predicted,
            })
        }
        Choice::Search(so) => {
            // The program runs the graph as the search rewrote it; checks compare with `g`.
            let mut h = g.clone();
            let r = autoshard::search_rewriting(&mut h, cluster, devices, opts, &so).map_err(Error::Search)?;
            let program = exec::program_for_search(&h, &r, devices)?;
            let predicted = r.pipeline.is_none().then(|| (cluster.name.clone(), r.breakdown.forward_s));
            let how = How::Search { result: Box::new(r), devices, cluster: cluster.name.clone() };
            Ok(Planned { program, rewritten: Some(h), how, predicted })
        }
    }
}

/// One output compared with a reference: its label, the largest absolute and relative errors,
/// and whether every element is within `atol + rtol·|expected|`.
#[derive(Clone, Debug)]
pub struct CheckRow {
    pub output: String,
    pub max_abs_error: f64,
    pub max_rel_error: f64,
    pub ok: bool,
}

/// The run's outputs (`got`, by name in graph order) against `g` evaluated on one device on
/// the same `inputs`, and where `written` is given (the model as written, for a re-shaped
/// `g`), against it too ([`crate::written::reference`]). The second value says why there is no
/// reference from the model as written, when there is none.
pub fn check(
    g: &Graph,
    got: &[(String, Array)],
    inputs: &HashMap<String, Array>,
    written: Option<&Graph>,
    (rtol, atol): (f64, f64),
) -> Result<(Vec<CheckRow>, Option<String>), String> {
    let row = |output: String, got: &Array, want: &Array| {
        let (max_abs_error, max_rel_error, ok) = exec::compare(got, want, rtol, atol);
        CheckRow { output, max_abs_error, max_rel_error, ok }
    };
    let reference =
        ir::eval::run(g, inputs, &Default::default()).map_err(|e| format!("the reference run failed: {e}"))?;
    let mut rows: Vec<CheckRow> = got.iter().zip(&reference).map(|((n, a), r)| row(n.clone(), a, r)).collect();
    let Some(original) = written else { return Ok((rows, None)) };
    match crate::written::reference(g, original, inputs, (rtol, atol)) {
        Ok(w) => {
            for (i, ((name, a), want)) in got.iter().zip(&w.outputs).enumerate() {
                rows.push(row(format!("{name} ({})", w.label(i)), &w.covered(i, a), want));
            }
            Ok((rows, None))
        }
        Err(why) => Ok((rows, Some(why))),
    }
}

/// A configuration (`tp=2,dp=2,sp,zero=1`: [`passes::autoshard::config`]) as what runs: the
/// named strategy it is, the cost-model options it sets, and its mixtures' capacity factor
/// (`ep_comm=a2a,capacity=F`).
#[derive(Clone, Debug)]
pub struct Configured {
    /// The named strategy (`hybrid:dp:2,tp:2`, `pipeline:2:8:1f1b:tp:2`, …).
    pub strategy: String,
    /// `opts` with the configuration's recomputation, sequence parallelism and ZeRO stage.
    pub options: Options,
    /// The all-to-all dispatcher's capacity factor, where it names one.
    pub capacity: Option<f32>,
}

/// `c` on `devices` devices (`batch`: the model's, which sizes a pipeline's micro-batches),
/// its options set on `opts`. Refused: `mbs` (a run takes its micro-batches from
/// `--micro-batches`) and `flash` (a run executes attention as the model writes it; `cost` and
/// `plan` price it fused).
pub fn configured(
    c: &autoshard::config::Config,
    devices: usize,
    batch: Option<i64>,
    opts: &Options,
) -> crate::error::Result<Configured> {
    use crate::error::Error;
    if c.mbs.is_some() {
        return Err(Error::Plan("mbs: a run accumulates gradients with --micro-batches".into()));
    }
    if c.flash {
        return Err(Error::Plan(
            "flash: a run executes attention as the model writes it; `cost` and `plan` price it fused".into(),
        ));
    }
    let (named, options) = c.resolve(devices, batch, opts).map_err(Error::Plan)?;
    Ok(Configured { strategy: named.name(), options, capacity: c.capacity_factor() })
}
