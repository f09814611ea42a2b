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
pub mod model;
pub mod pipeline;
pub mod stash;

pub use cluster::{Cluster, ClusterError};
pub use model::{Assignment, Breakdown, CostModel, InputPath, OpRow, Optimizer, Options, Precision};
pub use pipeline::PipelineReport;
pub use pipeline::Schedule;
pub use stash::Recompute;

#[cfg(test)]
mod tests;
