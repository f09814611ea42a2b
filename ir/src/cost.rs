//! FLOP and byte counts of ops, forward and backward, from inferred shapes.
//!
//! Conventions: a multiply-add is 2 FLOPs; elementwise ops cost 1 FLOP per output element
//! (transcendentals [`TRANSCENDENTAL_FLOPS`]); the backward pass of a contraction is split
//! into the data gradient (w.r.t. activation inputs) and the weight gradient (w.r.t.
//! initializers), each as many FLOPs as the forward; other ops' backward costs about as much
//! as their forward. Bytes are what the op reads and writes in the forward pass.

use std::collections::HashSet;

use serde::Serialize;

use crate::graph::op::Op;
use crate::graph::{Graph, NodeId, Value};
use crate::ops::Backward;
use crate::types::{DType, TensorType};

pub use crate::ops::TRANSCENDENTAL_FLOPS;

/// Work of one op for one training step.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct OpCost {
    /// Forward FLOPs.
    pub fwd_flops: f64,
    /// Backward FLOPs for gradients of activation inputs.
    pub bwd_data_flops: f64,
    /// Backward FLOPs for gradients of weights.
    pub bwd_weight_flops: f64,
    /// Bytes read in the forward pass (inputs, weights included).
    pub bytes_read: f64,
    /// Bytes written in the forward pass (outputs).
    pub bytes_written: f64,
    /// Bytes of the weights (initializers) this op reads, counted once per read (a
    /// recurrent op reads its recurrent weights every time step; a gather reads the rows it
    /// gathers).
    pub param_bytes: f64,
    /// Kernel launches of the forward pass: 1, or per time step for recurrent ops.
    pub launches: f64,
    /// Independent invocations of its main kernel (0: unknown).
    pub parallel: f64,
}

impl OpCost {
    /// Forward plus backward FLOPs.
    pub fn total_flops(&self) -> f64 {
        self.fwd_flops + self.bwd_data_flops + self.bwd_weight_flops
    }

    /// Scales every count by `k` (e.g. the fraction of the op a device computes).
    pub fn scaled(&self, k: f64) -> OpCost {
        OpCost {
            fwd_flops: self.fwd_flops * k,
            bwd_data_flops: self.bwd_data_flops * k,
            bwd_weight_flops: self.bwd_weight_flops * k,
            bytes_read: self.bytes_read * k,
            bytes_written: self.bytes_written * k,
            param_bytes: self.param_bytes * k,
            launches: self.launches,
            parallel: self.parallel * k,
        }
    }
}

fn numel(t: Option<&TensorType>) -> f64 {
    t.and_then(TensorType::numel).map_or(0.0, |n| n as f64)
}

fn bytes(t: Option<&TensorType>) -> f64 {
    t.and_then(TensorType::size_bytes).map_or(0.0, |n| n as f64)
}

/// The annotation that makes a float initializer a constant, not trained whatever its size:
/// one that holds an infinity or NaN ([`freeze_non_finite`]: an additive attention mask's
/// `-inf`), or one the user froze (`shardc train --freeze`, a golden case's `trainable` list).
pub const FROZEN: &str = "shardc_frozen";

/// True when `v` is a trainable parameter: a float initializer (or input default) of two or
/// more elements, not [`FROZEN`]. A single-element one is the exporter's constant (a scale, an
/// epsilon, a mask's fill value, an exponent; `canonicalize` makes `Constant`s initializers),
/// not a parameter: the autodiff pass trains exactly these, and the cost model prices
/// gradients, their synchronisation and updates for exactly these.
pub fn is_param(g: &Graph, v: Value) -> bool {
    let node = g.node(v.node);
    match &node.op {
        Op::Initializer(t) | Op::Input { default: Some(t) } => {
            t.dtype.is_float() && t.numel() >= 2 && !node.annotations.iter().any(|(k, _)| k == FROZEN)
        }
        _ => false,
    }
}

/// Makes initializer (or defaulted input) `v` a constant ([`FROZEN`]).
pub fn freeze(g: &mut Graph, v: Value) {
    g.set_annotation(v.node, FROZEN, "true");
}

/// Freezes the float initializers of two or more elements whose values hold an infinity, NaN
/// or a magnitude of 1e30 or more — no optimizer step can train them (an additive causal
/// mask's `-inf` plus any update is `-inf` or NaN, and its `finfo.min` absorbs any update in
/// rounding: exporters fold such masks into initializers; torch keeps them as buffers) — and
/// returns their names (those frozen before too: it can run again).
pub fn freeze_non_finite(g: &mut Graph) -> Vec<String> {
    let mut frozen = Vec::new();
    for n in g.node_ids().collect::<Vec<_>>() {
        let non_finite = match &g.node(n).op {
            Op::Initializer(t) | Op::Input { default: Some(t) } if t.dtype.is_float() && t.numel() >= 2 => {
                match &t.data {
                    crate::TensorData::Float(x) => x.iter().any(|x| x.is_nan() || x.abs() >= 1e30),
                    crate::TensorData::Double(x) => x.iter().any(|x| x.is_nan() || x.abs() >= 1e30),
                    _ => false,
                }
            }
            _ => false,
        };
        if non_finite {
            let v = Value::new(n, 0);
            freeze(g, v);
            frozen.push(g.value_name(v).to_string());
        }
    }
    frozen
}

/// The values gradients flow into in a training step: the parameters ([`is_param`]) and the
/// float values computed from them through float values (`order`: the ops, topologically) — what
/// reverse mode differentiates ([`reach`] from every parameter, as the autodiff pass does from
/// the ones it trains). A value computed from inputs and constants only (an attention mask,
/// positions, a causal bias) gets no gradient, nor does an integer value (shapes, indices). An
/// op with subgraphs may read parameters its inputs do not name, so its float outputs are
/// counted in.
pub fn grad_flow(g: &Graph, order: &[NodeId]) -> HashSet<Value> {
    let params = g.node_ids().map(|n| Value::new(n, 0)).filter(|&v| is_param(g, v)).collect();
    reach(g, order, params, true)
}

/// `seeds` and the float values computed from them through float values, visiting `order`
/// (topological); with `subgraphs`, every float output of an op with subgraphs too.
pub fn reach(g: &Graph, order: &[NodeId], seeds: HashSet<Value>, subgraphs: bool) -> HashSet<Value> {
    let mut reach = seeds;
    for &n in order {
        let node = g.node(n);
        if subgraphs && node.op.has_subgraphs() || node.inputs().iter().flatten().any(|v| reach.contains(v)) {
            for s in 0..node.num_outputs() {
                let v = Value::new(n, s as u16);
                if g.tensor_type(v).is_some_and(|t| t.dtype.is_float()) {
                    reach.insert(v);
                }
            }
        }
    }
    reach
}

/// How many times the forward pass of node `n` reads input `i`, as a multiple of its size:
/// 1 for most ops; the fraction of the table a gather reads (its output's size, at most the
/// table); the time steps for the recurrent weights of LSTM, GRU and RNN (kernels that are
/// not persistent read them every step).
pub fn read_factor(g: &Graph, n: NodeId, i: usize) -> f64 {
    let node = g.node(n);
    let size = |v: Option<Value>| v.and_then(|v| g.tensor_type(v)).and_then(TensorType::numel).map(|x| x as f64);
    match (&node.op, i) {
        (Op::Gather(_) | Op::GatherElements(_) | Op::GatherND(_), 0) => {
            match (size(node.input(0)), size(Some(Value::new(n, 0)))) {
                (Some(table), Some(out)) if table > 0.0 => (out / table).min(1.0),
                _ => 1.0,
            }
        }
        (Op::LSTM(_) | Op::GRU(_) | Op::RNN(_), 2) => node
            .input(0)
            .and_then(|v| g.tensor_type(v))
            .and_then(TensorType::static_dims)
            .and_then(|d| d.first().copied())
            .map_or(1.0, |s| s.max(1) as f64),
        _ => 1.0,
    }
}

/// Counts FLOPs and bytes of node `n`. Shapes must have been inferred; unknown shapes count
/// as zero. Backward FLOPs count the gradients of the inputs in `grads` ([`grad_flow`]) and
/// of the parameters.
pub fn node_cost(g: &Graph, n: NodeId, grads: &HashSet<Value>) -> OpCost {
    let node = g.node(n);
    let out = |i: usize| g.tensor_type(Value::new(n, i as u16));
    let mut c = OpCost { launches: 1.0, ..OpCost::default() };
    for (i, v) in node.inputs().iter().enumerate() {
        if let Some(v) = v {
            let read = bytes(g.tensor_type(*v)) * read_factor(g, n, i);
            c.bytes_read += read;
            if is_param(g, *v) {
                c.param_bytes += read;
            }
        }
    }
    for i in 0..node.num_outputs() {
        c.bytes_written += bytes(out(i));
    }
    let y = numel(out(0));
    let grad_in = |i: usize| node.input(i).is_some_and(|v| !is_param(g, v) && grads.contains(&v));
    let param_in = |i: usize| node.input(i).is_some_and(|v| is_param(g, v));
    let cx = crate::ops::NodeCx { g, n };
    let Some(w) = node.op.rules().work(&cx) else { return c };
    c.fwd_flops = w.fwd_flops;
    c.launches = w.launches;
    c.parallel = w.parallel.unwrap_or(y);
    match w.backward {
        // A contraction's backward splits between data and weight gradients by input.
        Backward::Contraction { inputs, bias } => {
            for i in inputs {
                if param_in(i) {
                    c.bwd_weight_flops += w.fwd_flops;
                } else if grad_in(i) {
                    c.bwd_data_flops += w.fwd_flops;
                }
            }
            if bias.is_some_and(param_in) {
                c.bwd_weight_flops += y;
            }
        }
        Backward::Recurrent { matmul, pointwise } => {
            c.bwd_weight_flops = matmul;
            c.bwd_data_flops = matmul + pointwise;
        }
        Backward::Times(k) => {
            if (0..node.inputs().len()).any(grad_in) {
                c.bwd_data_flops = k * w.fwd_flops;
            }
        }
        Backward::LikeForward => {}
    }
    if c.bwd_data_flops == 0.0 && c.bwd_weight_flops == 0.0 && c.fwd_flops > 0.0 {
        // Pointwise, pooling, normalization: the backward pass does about the forward's work
        // when any input carries a gradient.
        if (0..node.inputs().len()).any(grad_in) {
            c.bwd_data_flops = c.fwd_flops;
        }
        if (0..node.inputs().len()).any(param_in) {
            c.bwd_weight_flops = c.fwd_flops.min(y);
        }
    }
    c
}

/// Totals over a graph.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GraphStats {
    /// Operator nodes.
    pub nodes: usize,
    /// Operator histogram, op type → count, most frequent first (ties by name).
    pub op_counts: Vec<(String, usize)>,
    /// Elements of all initializers.
    pub params: u64,
    /// Elements of floating-point initializers.
    pub float_params: u64,
    /// Bytes of all initializers.
    pub param_bytes: u64,
    /// Forward FLOPs of one step.
    pub forward_flops: f64,
    /// Backward FLOPs of one step (data plus weight gradients).
    pub backward_flops: f64,
    /// Bytes of every operator output in one forward pass (what training keeps for backward,
    /// at most).
    pub activation_bytes: u64,
    /// Operator outputs whose size is unknown (not counted above).
    pub unknown_shapes: usize,
}

/// Computes [`GraphStats`]. Shapes should have been inferred. A count or size that
/// overflows 64 bits is an error naming the tensor where it does.
pub fn compute_stats(g: &Graph) -> Result<GraphStats, String> {
    let add = |total: &mut u64, x: u64, what: &str, v: Value| -> Result<(), String> {
        *total = total.checked_add(x).ok_or_else(|| {
            format!("{what} overflow 64 bits at `{}` (the model is too large to count)", g.value_name(v))
        })?;
        Ok(())
    };
    let mut s = GraphStats::default();
    let mut hist: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    let grads = grad_flow(g, &g.topo_order().unwrap_or_else(|_| g.node_ids().collect()));
    for n in g.node_ids() {
        let node = g.node(n);
        let tensor = match &node.op {
            Op::Initializer(t) => Some(t),
            Op::Input { default: Some(t) } => Some(t),
            _ => None,
        };
        if let Some(t) = tensor {
            let v = Value::new(n, 0);
            add(&mut s.params, t.numel(), "parameter counts", v)?;
            if t.dtype.is_float() {
                add(&mut s.float_params, t.numel(), "parameter counts", v)?;
            }
            add(&mut s.param_bytes, t.size_bytes(), "parameter bytes", v)?;
            continue;
        }
        // The weights of subgraphs (an `If`'s branches hold whole networks: Silero VAD).
        for sub in node.op.subgraphs() {
            let inner = compute_stats(sub)?;
            add(&mut s.params, inner.params, "parameter counts", Value::new(n, 0))?;
            add(&mut s.float_params, inner.float_params, "parameter counts", Value::new(n, 0))?;
            add(&mut s.param_bytes, inner.param_bytes, "parameter bytes", Value::new(n, 0))?;
        }
        if matches!(node.op, Op::Input { .. } | Op::OuterRef) {
            continue;
        }
        s.nodes += 1;
        let key = if node.op.domain().is_empty() {
            node.op.op_type().to_string()
        } else {
            format!("{}.{}", node.op.domain(), node.op.op_type())
        };
        *hist.entry(key).or_insert(0) += 1;
        let c = node_cost(g, n, &grads);
        s.forward_flops += c.fwd_flops;
        s.backward_flops += c.bwd_data_flops + c.bwd_weight_flops;
        for o in 0..node.num_outputs() {
            match g.tensor_type(Value::new(n, o as u16)).and_then(TensorType::size_bytes) {
                Some(b) => add(&mut s.activation_bytes, b, "activation bytes", Value::new(n, o as u16))?,
                None if !node.outputs()[o].name.is_empty() => s.unknown_shapes += 1,
                None => {}
            }
        }
    }
    let mut counts: Vec<(String, usize)> = hist.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    s.op_counts = counts;
    Ok(s)
}

/// Bytes of one element of `dtype`, as f64.
pub fn elem_bytes(dtype: DType) -> f64 {
    dtype.size_bytes() as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Tensor, TensorData};

    fn init(g: &mut Graph, name: &str, v: Vec<f32>) -> Value {
        let dims = vec![v.len() as i64];
        g.add_initializer(name, Tensor { dtype: crate::DType::Float, dims, name: None, data: TensorData::Float(v) })
    }

    /// Additive masks folded into initializers — `-inf`, or torch's `finfo.min`, which absorbs
    /// any update in rounding — are frozen; weights, large ones included, are not.
    #[test]
    fn masks_of_infinities_or_finfo_min_are_frozen() {
        let mut g = Graph::new("g");
        let inf = init(&mut g, "mask_inf", vec![0.0, f32::NEG_INFINITY]);
        let min = init(&mut g, "mask_min", vec![0.0, f32::MIN]);
        let w = init(&mut g, "w", vec![0.5, -2.0e6]);
        let mut frozen = freeze_non_finite(&mut g);
        frozen.sort();
        assert_eq!(frozen, ["mask_inf", "mask_min"]);
        assert!(!is_param(&g, inf) && !is_param(&g, min) && is_param(&g, w));
    }
}
