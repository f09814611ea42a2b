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
/// A pipeline schedule.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All micro-batch forwards, then all backwards.
    GPipe,
    /// One forward, one backward, in steady state.
    OneFOneB,
    /// Megatron's interleaved 1F1B: each device holds this many (≥ 2) model chunks (virtual
    /// stages), its layers round-robin over the devices.
    Interleaved(usize),
}

impl serde::Serialize for Schedule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl Schedule {
    /// The schedule's name (`gpipe`, `1f1b`, `interleaved:V`), as strategy names and plan
    /// documents spell it.
    pub fn name(self) -> String {
        match self {
            Schedule::GPipe => "gpipe".into(),
            Schedule::OneFOneB => "1f1b".into(),
            Schedule::Interleaved(v) => format!("interleaved:{v}"),
        }
    }

    /// Virtual stages (model chunks) per device: 1 but for the interleaved schedule.
    pub fn chunks(self) -> usize {
        match self {
            Schedule::Interleaved(v) => v,
            _ => 1,
        }
    }

    /// Micro-batches whose activations stage `s` (0-based) of `stages` keeps at once, in
    /// whole micro-batches of the stage's layers. Interleaved (Megatron's schedule): the
    /// device runs `2(S − s − 1) + (V − 1)S` chunk forwards before its first backward and
    /// holds one more in the steady state, each a V-th of its layers — stage 0 keeps
    /// `S + (S − 1)/V` micro-batches' worth (Korthikanti et al. 2022, §4.2.3).
    pub fn in_flight(self, s: usize, stages: usize, micro: usize) -> f64 {
        match self {
            Schedule::GPipe => micro as f64,
            Schedule::OneFOneB => micro.min(stages - s) as f64,
            Schedule::Interleaved(v) => {
                let chunks = 2 * (stages - s - 1) + (v - 1) * stages + 1;
                (chunks as f64 / v as f64).min(micro as f64)
            }
        }
    }

    /// Time slots of the step in per-micro-batch stage times: `M + S − 1`, the interleaved
    /// schedule's bubble a V-th of that, `M + (S − 1)/V`.
    pub fn slots(self, stages: usize, micro: usize) -> f64 {
        micro as f64 + (stages - 1) as f64 / self.chunks() as f64
    }

    /// Step time of the pipelined part from per-stage forward and backward times per
    /// micro-batch.
    pub fn makespan(self, fwd: &[f64], bwd: &[f64], micro: usize) -> f64 {
        let slots = self.slots(fwd.len(), micro);
        match self {
            Schedule::GPipe => {
                slots * (fwd.iter().copied().fold(0.0, f64::max) + bwd.iter().copied().fold(0.0, f64::max))
            }
            Schedule::OneFOneB | Schedule::Interleaved(_) => {
                slots * fwd.iter().zip(bwd).map(|(f, b)| f + b).fold(0.0, f64::max)
            }
        }
    }
}

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
