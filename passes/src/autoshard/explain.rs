//! Why a plan beats data parallelism: the layers where it differs, with what each difference
//! saves or costs.
//!
//! Both plans are priced per op by the same cost model (compute, the communication its input
//! layouts need, the gradient synchronisation and optimizer update of the parameters it reads
//! first, the activations and parameter state it keeps). The ops whose price differs are grouped by the layer the exporter named ([`ir::scope`]), and the layers sorted
//! by the time they save. What per-op prices cannot attribute (overlap of gradient
//! synchronisation with backward, the pipeline bubble) is the remainder of the step-time
//! difference, reported beside them.

use std::collections::BTreeMap;

use ir::{Graph, NodeId};
use serde::Serialize;

use crate::cost::{Breakdown, OpRow};

/// One layer where the plan differs from data parallelism.
#[derive(Clone, Debug, Serialize)]
pub struct LayerEffect {
    /// The layer's module path (`transformer.h.0.mlp.c_fc`), or the first op's name when the
    /// export names none.
    pub layer: String,
    /// The repeated block it lies in (`transformer.h.0`).
    pub block: String,
    /// How many layers this entry stands for: layers that differ only in their block index
    /// (`transformer.h.0.mlp` … `transformer.h.11.mlp`), with the same strategies, are one
    /// entry `transformer.h.*.mlp` with their effects summed.
    pub repeats: usize,
    /// Ops of the layer whose strategy or price differs.
    pub ops: usize,
    /// The plan's strategies there, `Op strategy` each (distinct, in op order).
    pub strategies: Vec<String>,
    /// Data parallelism's strategies there.
    pub data_parallel: Vec<String>,
    /// Data parallelism's time for these ops minus the plan's, seconds (positive: the plan
    /// saves it).
    pub time_saved_s: f64,
    /// Of which communication, seconds.
    pub communication_saved_s: f64,
    /// Data parallelism's memory per device for these ops minus the plan's, bytes.
    pub memory_saved_bytes: f64,
}

/// The plan against data parallelism, layer by layer.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    /// Layers where the plan differs, the largest effect (time, then memory) first.
    pub layers: Vec<LayerEffect>,
    /// Ops priced alike in both plans (the same time and memory, whatever the strategies'
    /// names: `n→x, n→y` on a 2-D mesh is data parallelism too).
    pub same_ops: usize,
    /// Data parallelism's step time minus the plan's, seconds.
    pub step_time_saved_s: f64,
    /// Of it, what the per-op prices do not attribute (overlap, bucketing, bubble), seconds.
    pub unattributed_s: f64,
    /// Data parallelism's memory per device minus the plan's, bytes.
    pub memory_saved_bytes: f64,
}

fn op_time(r: &OpRow) -> f64 {
    r.compute_s + r.communication_s + r.grad_sync_s + r.update_s
}

fn op_memory(r: &OpRow) -> f64 {
    r.memory_bytes + r.param_memory_bytes
}

/// Explains `plan` against `dp`, both priced over `order` (the cost model's op order, which
/// their rows follow). An error when their rows are not the same ops (a pipelined plan prices
/// stages, not ops on one mesh).
pub fn explain(g: &Graph, order: &[NodeId], plan: &Breakdown, dp: &Breakdown) -> Result<Explanation, String> {
    if plan.ops.len() != dp.ops.len()
        || plan.ops.len() != order.len()
        || plan.ops.iter().zip(&dp.ops).any(|(a, b)| a.name != b.name)
    {
        return Err("the plan's ops are not priced one by one against data parallelism's".into());
    }
    let paths = ir::scope::module_paths(g, order);
    let mut layers: BTreeMap<String, (usize, LayerEffect)> = BTreeMap::new();
    let mut same_ops = 0;
    for (i, (&n, (p, d))) in order.iter().zip(plan.ops.iter().zip(&dp.ops)).enumerate() {
        let dt = op_time(d) - op_time(p);
        let dm = op_memory(d) - op_memory(p);
        let scale = op_time(d).abs().max(op_time(p).abs());
        if dt.abs() <= 1e-9 * scale.max(1e-12) && dm.abs() < 1.0 {
            same_ops += 1;
            continue;
        }
        let path = paths.get(&n).filter(|p| !p.is_empty()).cloned().unwrap_or_else(|| p.name.clone());
        let (_, e) = layers.entry(path.clone()).or_insert_with(|| {
            (
                i,
                LayerEffect {
                    block: ir::scope::block_of(&path),
                    repeats: 1,
                    layer: path,
                    ops: 0,
                    strategies: Vec::new(),
                    data_parallel: Vec::new(),
                    time_saved_s: 0.0,
                    communication_saved_s: 0.0,
                    memory_saved_bytes: 0.0,
                },
            )
        });
        e.ops += 1;
        e.time_saved_s += dt;
        e.communication_saved_s += (d.communication_s + d.grad_sync_s) - (p.communication_s + p.grad_sync_s);
        e.memory_saved_bytes += dm;
        for (list, r) in [(&mut e.strategies, p), (&mut e.data_parallel, d)] {
            let s = format!("{} {}", r.op, r.strategy);
            if !list.contains(&s) {
                list.push(s);
            }
        }
    }
    let mut layers = fold_repeats(layers.into_values().collect());
    layers.sort_by(|(ia, a), (ib, b)| {
        b.time_saved_s
            .abs()
            .total_cmp(&a.time_saved_s.abs())
            .then(b.memory_saved_bytes.abs().total_cmp(&a.memory_saved_bytes.abs()))
            .then(ia.cmp(ib))
    });
    let attributed: f64 = layers.iter().map(|(_, l)| l.time_saved_s).sum();
    let step_time_saved_s = dp.step_time_s - plan.step_time_s;
    Ok(Explanation {
        layers: layers.into_iter().map(|(_, l)| l).collect(),
        same_ops,
        step_time_saved_s,
        unattributed_s: step_time_saved_s - attributed,
        memory_saved_bytes: dp.memory.total() - plan.memory.total(),
    })
}

/// Folds layers that differ only in numeric path components and have the same strategies
/// into one entry (`h.*.mlp`), first position kept, effects summed.
fn fold_repeats(layers: Vec<(usize, LayerEffect)>) -> Vec<(usize, LayerEffect)> {
    let star = |path: &str| {
        let p: Vec<&str> = path
            .split('.')
            .map(|c| if !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()) { "*" } else { c })
            .collect();
        p.join(".")
    };
    let pattern = |l: &LayerEffect| (star(&l.layer), l.strategies.clone(), l.data_parallel.clone());
    let mut out: Vec<(usize, LayerEffect)> = Vec::new();
    let mut index: std::collections::HashMap<(String, Vec<String>, Vec<String>), usize> = Default::default();
    for (i, l) in layers {
        let key = pattern(&l);
        match index.get(&key) {
            Some(&k) => {
                let (first, e) = &mut out[k];
                *first = (*first).min(i);
                e.repeats += 1;
                e.layer = key.0.clone();
                e.block = star(&e.block);
                e.ops += l.ops;
                e.time_saved_s += l.time_saved_s;
                e.communication_saved_s += l.communication_saved_s;
                e.memory_saved_bytes += l.memory_saved_bytes;
            }
            None => {
                index.insert(key, out.len());
                out.push((i, l));
            }
        }
    }
    out
}

/// The first `n` items joined, with how many more.
fn some(list: &[String], n: usize) -> String {
    let mut s = list.iter().take(n).cloned().collect::<Vec<_>>().join(", ");
    if list.len() > n {
        s.push_str(&format!(" … +{}", list.len() - n));
    }
    s
}

impl Explanation {
    /// The explanation as text: a header, then the top `limit` layers (all with `None`).
    pub fn text(&self, limit: Option<usize>, secs: &dyn Fn(f64) -> String, bytes: &dyn Fn(f64) -> String) -> String {
        let signed = |x: f64, f: &dyn Fn(f64) -> String| {
            if x < 0.0 { format!("-{}", f(-x)) } else { format!("+{}", f(x)) }
        };
        let mut t = String::new();
        if self.layers.is_empty() {
            t.push_str("the plan prices every op as data parallelism does\n");
            return t;
        }
        t.push_str(&format!(
            "the plan differs from data parallelism in {} layers ({} ops alike); saved per step: {} (layers {}, overlap and bubble {}), memory per device {}\n",
            self.layers.len(),
            self.same_ops,
            signed(self.step_time_saved_s, secs),
            signed(self.step_time_saved_s - self.unattributed_s, secs),
            signed(self.unattributed_s, secs),
            signed(self.memory_saved_bytes, bytes),
        ));
        let shown: Vec<&LayerEffect> = self.layers.iter().take(limit.unwrap_or(usize::MAX)).collect();
        let rows: Vec<[String; 6]> = shown
            .iter()
            .map(|l| {
                [
                    if l.repeats > 1 { format!("{} (×{})", l.layer, l.repeats) } else { l.layer.clone() },
                    signed(l.time_saved_s, secs),
                    signed(l.communication_saved_s, secs),
                    signed(l.memory_saved_bytes, bytes),
                    some(&l.strategies, 3),
                    some(&l.data_parallel, 3),
                ]
            })
            .collect();
        let head = ["layer", "time saved", "of it comm", "memory saved", "plan", "data parallel"];
        t.push_str(&crate::table::table(&head, &rows, &[false, true, true, true, false, false]));
        if shown.len() < self.layers.len() {
            let rest = &self.layers[shown.len()..];
            t.push_str(&format!(
                "… {} more layers: {} together\n",
                rest.len(),
                signed(rest.iter().map(|l| l.time_saved_s).sum(), secs)
            ));
        }
        t
    }
}
