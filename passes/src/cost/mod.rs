//! The cost model: how long a training step takes and how much memory it needs, for a graph
//! sharded over a device mesh of a cluster.
//!
//! Analytical and explainable: every formula is in [`collective`] (α–β communication),
//! [`model`] (roofline compute, resharding, gradient synchronisation, memory, input path) and
//! [`pipeline`] (stages, schedules, bubbles); every constant is in the [`Cluster`] description.
//! [`strategy`] turns named strategies (`data`, `model`, `spatial`, `megatron`, `hybrid:dp:D,tp:T`, `spatial-hybrid:DxS`, `owt`,
//! `pipeline:S:M`) into per-op assignments so they can be compared.

pub mod batch;
pub mod calibration;
pub mod cluster;
pub mod collective;
pub mod config;
pub mod model;
pub mod pipeline;
pub mod stash;
pub mod strategy;

pub use cluster::{Cluster, ClusterError};
pub use model::{Assignment, Breakdown, CostModel, InputPath, OpRow, Optimizer, Options, Precision};
pub use pipeline::PipelineReport;
pub use stash::Recompute;
pub use strategy::Named;
pub use strategy::Schedule;

use ir::Graph;
use ir::shard::Mesh;

/// A priced named strategy.
pub struct Priced {
    /// The mesh it ran on (a pipeline's: its first stage's).
    pub mesh: Mesh,
    /// The price.
    pub breakdown: Breakdown,
    /// Pipeline details, for `pipeline:S:M`.
    pub pipeline: Option<PipelineReport>,
    /// The strategies priced (a pipeline's first stage's, on its mesh).
    pub assignment: Assignment,
}

/// Prices a named strategy on `devices` devices of `cluster`. Errors say why the strategy does
/// not apply.
pub fn price(g: &Graph, cluster: &Cluster, devices: usize, named: &Named, opts: &Options) -> Result<Priced, String> {
    if let Named::Pipeline { stages, micro, schedule, tensor } = named {
        // Priced as the search prices the pipelines it makes: one function for both.
        let p = crate::autoshard::pipeline::price_configuration(
            g, cluster, devices, *stages, *micro, *schedule, *tensor, opts,
        )?;
        let first = p.stages.first().ok_or("a pipeline without stages")?;
        return Ok(Priced {
            mesh: first.sub_mesh.clone(),
            assignment: first.assignment.clone(),
            breakdown: p.breakdown.clone(),
            pipeline: Some(p.report()),
        });
    }
    let mesh = named.mesh(cluster, devices)?;
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let asg = strategy::assign(&cm, named)?;
    Ok(Priced { mesh, breakdown: cm.evaluate(&asg), pipeline: None, assignment: asg })
}
#[cfg(test)]
mod tests;
