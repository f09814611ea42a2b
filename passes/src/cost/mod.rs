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
    /// The mesh it ran on.
    pub mesh: Mesh,
    /// The price.
    pub breakdown: Breakdown,
    /// Pipeline details, for `pipeline:S:M`.
    pub pipeline: Option<PipelineReport>,
    /// The strategies priced (empty for a pipeline, whose stages hold theirs).
    pub assignment: Assignment,
}

/// Prices a named strategy on `devices` devices of `cluster`. Errors say why the strategy does
/// not apply.
pub fn price(g: &Graph, cluster: &Cluster, devices: usize, named: &Named, opts: &Options) -> Result<Priced, String> {
    if let Named::Pipeline(stages, micro, schedule) = named {
        let r = pipeline::price_pipeline(g, cluster, devices, *stages, *micro, *schedule, opts)?;
        return Ok(Priced {
            mesh: cluster.mesh(devices)?,
            breakdown: r.breakdown.clone(),
            pipeline: Some(r),
            assignment: Assignment::default(),
        });
    }
    let mesh = named.mesh(cluster, devices)?;
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let asg = strategy::assign(&cm, named)?;
    Ok(Priced { mesh, breakdown: cm.evaluate(&asg), pipeline: None, assignment: asg })
}
#[cfg(test)]
mod tests;
