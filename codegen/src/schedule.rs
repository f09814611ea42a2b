//! Pipeline schedules: the order in which a device runs the parts of its program over the
//! micro-batches of a step. The runtime runs this order and the checker simulates it, so a
//! schedule that could deadlock is refused before it runs.
//!
//! A device's program is cut in three:
//! - the **once-per-step** ops: under gradient accumulation, the optimizer updates, every op
//!   that reads what they compute and the receive of a tied weight's new value from the stage
//!   that updates it, run once after every micro-batch;
//! - the **backward** part: every op downstream of a tensor received from a later pipeline
//!   stage (the gradient flowing back). It reads the forward part's values of the same
//!   micro-batch (the activation stash);
//! - the **forward** part: the rest.
//!
//! The backward part is closed downstream, so each part reads only its own micro-batch's
//! earlier parts. Stage `s` of `S` then runs, for `m` micro-batches:
//! - GPipe: `F0 … F(m−1)`, then `B0 … B(m−1)`: every micro-batch's stash is live at once;
//! - 1F1B: `min(S−1−s, m)` forwards to fill the pipeline, then one forward and one backward
//!   in turn, then the remaining backwards: stage `s` holds at most `S − s` stashes;
//! - interleaved over `V` model chunks (Megatron's schedule): each device holds `V` chunks
//!   (virtual stages `s`, `s + S`, …), each part is one chunk's, in the order [`interleaved`]
//!   gives; a chunk's backward part is downstream of a receive from a later virtual stage.
//!
//! A stage without a backward part (the last stage, whose loss gradient it computes itself,
//! or an inference pipeline) runs each micro-batch whole, in order.
//!
//! Recomputation (per stage, as planned): after a micro-batch's forward part the device
//! keeps only what it received from the earlier stage and its inputs; before the backward
//! part it runs the forward part again (its collectives included, its sends and receives not).

pub use ir::schedule::Schedule;

/// The order of a schedule's parts for one stage (the runtime's, the checker's and the
/// simulator's).
pub trait Order {
    /// The parts stage `stage` of `stages` runs, in order, over `m` micro-batches; `split`:
    /// the stage's program has a backward part.
    fn items(self, stage: usize, stages: usize, m: usize, split: bool) -> Vec<Item>;
}

impl Order for Schedule {
    /// The parts stage `stage` of `stages` runs, in order, over `m` micro-batches; `split`:
    /// the stage's program has a backward part.
    fn items(self, stage: usize, stages: usize, m: usize, split: bool) -> Vec<Item> {
        let item = |part, chunk, micro| Item { part, chunk, micro };
        if let Schedule::Interleaved(v) = self {
            return interleaved(stage, stages, m, v, split);
        }
        if !split {
            return (0..m).map(|k| item(Part::Whole, 0, k)).collect();
        }
        let (f, b) = (|k| item(Part::Forward, 0, k), |k| item(Part::Backward, 0, k));
        match self {
            Schedule::GPipe => (0..m).map(f).chain((0..m).map(b)).collect(),
            _ => one_forward_one_backward(m, stages.saturating_sub(stage + 1), f, b),
        }
    }
}

/// Megatron's interleaved schedule on stage `stage` of `stages`, `v` chunks each: the
/// micro-batches go in groups of `stages` (the last group may be smaller), each group through
/// chunk 0, 1, … forward and through chunk v−1, …, 0 backward; the stage warms up with
/// `2·(stages − stage − 1) + (v − 1)·stages` forwards, then alternates one forward and one
/// backward, then drains. Without a backward part the forwards run whole, in that order.
fn interleaved(stage: usize, stages: usize, m: usize, v: usize, split: bool) -> Vec<Item> {
    let order = |backward: bool| -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(m * v);
        for g0 in (0..m).step_by(stages.max(1)) {
            for c in 0..v {
                let chunk = if backward { v - 1 - c } else { c };
                out.extend((g0..(g0 + stages.max(1)).min(m)).map(|k| (chunk, k)));
            }
        }
        out
    };
    let fwd = order(false);
    if !split {
        return fwd.into_iter().map(|(chunk, micro)| Item { part: Part::Whole, chunk, micro }).collect();
    }
    let bwd = order(true);
    let total = fwd.len();
    let warm = 2 * stages.saturating_sub(stage + 1) + (v - 1) * stages;
    let f = |i: usize| Item { part: Part::Forward, chunk: fwd[i].0, micro: fwd[i].1 };
    let b = |i: usize| Item { part: Part::Backward, chunk: bwd[i].0, micro: bwd[i].1 };
    one_forward_one_backward(total, warm, f, b)
}

/// `warm` forwards (at most `total`), then one forward and one backward in turn, then the
/// remaining backwards: the `i`-th forward `f(i)`, the `i`-th backward `b(i)`, `total` each.
fn one_forward_one_backward(
    total: usize,
    warm: usize,
    f: impl Fn(usize) -> Item,
    b: impl Fn(usize) -> Item,
) -> Vec<Item> {
    let warm = warm.min(total);
    let mut out: Vec<Item> = (0..warm).map(&f).collect();
    for i in 0..total - warm {
        out.push(f(warm + i));
        out.push(b(i));
    }
    out.extend((total - warm..total).map(b));
    out
}

/// One entry of a device's schedule: a part of one model chunk for one micro-batch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// Which part.
    pub part: Part,
    /// The model chunk (0 but under the interleaved schedule).
    pub chunk: usize,
    /// The micro-batch.
    pub micro: usize,
}

/// A part of a device's program for one micro-batch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// The ops before the gradient arrives from the next stage.
    Forward,
    /// The ops downstream of it.
    Backward,
    /// Both (a stage without a backward part).
    Whole,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn show(items: &[Item]) -> String {
        let part = |p: Part| match p {
            Part::Forward => "F",
            Part::Backward => "B",
            Part::Whole => "W",
        };
        items.iter().map(|i| format!("{}{}.{}", part(i.part), i.chunk, i.micro)).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn the_interleaved_schedule_is_megatrons() {
        let s = Schedule::Interleaved(2);
        // Two stages, two chunks each, four micro-batches in groups of two: stage 0 warms up
        // with 2·1 + 1·2 = 4 forwards, stage 1 with 2; backwards go through the chunks in
        // reverse.
        assert_eq!(
            show(&s.items(0, 2, 4, true)),
            "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3"
        );
        assert_eq!(
            show(&s.items(1, 2, 4, true)),
            "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3"
        );
        assert_eq!(show(&s.items(1, 2, 2, false)), "W0.0 W0.1 W1.0 W1.1");
        // Every part of every chunk and micro-batch once, each forward before its backward.
        for (stages, m, v) in [(2, 4, 2), (4, 8, 2), (2, 6, 3), (3, 5, 2)] {
            for st in 0..stages {
                let items = Schedule::Interleaved(v).items(st, stages, m, true);
                assert_eq!(items.len(), 2 * m * v);
                for c in 0..v {
                    for k in 0..m {
                        let at = |p| items.iter().position(|i| *i == Item { part: p, chunk: c, micro: k });
                        assert!(at(Part::Forward).unwrap() < at(Part::Backward).unwrap(), "{stages} {m} {v}");
                    }
                }
            }
        }
        assert_eq!(Schedule::parse("interleaved:3"), Some(Schedule::Interleaved(3)));
        assert_eq!(Schedule::parse("interleaved:1"), None);
        assert_eq!(Schedule::Interleaved(3).name(), "interleaved:3");
    }
}
