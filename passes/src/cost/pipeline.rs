//! Pipeline schedules and the report of a priced pipeline. The ops in topological order are
//! cut into S contiguous stages, each on its own group of devices; the batch is split into M
//! micro-batches that flow through the stages.
//!
//! Step time: with per-micro-batch stage times `t_s = f_s + b_s` (compute, plus the
//! point-to-point send of activations to the next stage and of gradients back),
//! GPipe runs all forwards then all backwards: `(M + S − 1)(max f + max b)`;
//! 1F1B alternates in steady state: `(M + S − 1) · max(f + b)`; Megatron's interleaved 1F1B
//! with V model chunks per device `(M + (S − 1)/V) · max(f + b)`, each stage's sends V times
//! as many. The bubble is the `(S − 1)/V` slots beyond the M. Then each stage synchronises
//! its gradients inside its group and updates. Memory: GPipe keeps the activations of all M
//! micro-batches; 1F1B keeps `min(M, S − s)` in stage s; interleaved see
//! [`Schedule::in_flight`].
//!
//! Stages are cut and priced by `crate::autoshard::pipeline` (the balanced partition, the
//! stage tables), for the pipelines the search makes and the configurations `cost` prices.

use serde::Serialize;

use ir::{Graph, Op, TensorType};

use super::model::Breakdown;
pub use ir::schedule::Schedule;

/// One stage of a priced pipeline.
#[derive(Clone, Debug, Serialize)]
pub struct StageReport {
    /// Devices of the stage.
    pub devices: Vec<usize>,
    /// Number of ops.
    pub op_count: usize,
    /// First and last op (labels or output names).
    pub first_op: String,
    /// Last op.
    pub last_op: String,
    /// Forward + backward time per micro-batch (with boundary sends), seconds.
    pub time_s: f64,
    /// Forward per micro-batch, seconds.
    pub forward_s: f64,
    /// Backward per micro-batch, seconds.
    pub backward_s: f64,
    /// Bytes sent to the next stage per micro-batch and device.
    pub send_bytes: f64,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
}

/// A priced pipeline.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineReport {
    /// The stages.
    pub stages: Vec<StageReport>,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Schedule.
    pub schedule: Schedule,
    /// The step's price.
    pub breakdown: Breakdown,
    /// Slowest over fastest stage time.
    pub imbalance: f64,
}

/// The batch of a graph: dim 0 of its first real input.
pub fn graph_batch(g: &Graph) -> Option<i64> {
    g.input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .find_map(|v| g.tensor_type(v).and_then(TensorType::static_dims).and_then(|d| d.first().copied()))
}
