//! Which dims of which values carry the batch.
//!
//! Found by re-batching a copy of the graph to twice its batch and comparing shapes: a dim
//! that doubled carries the batch (merged dims such as `batch × sequence` included). Models
//! that cannot be re-batched fall back to dim 0 of values computed from the graph inputs.

use std::collections::HashMap;

use ir::{Graph, Op, TensorType, Value};

use crate::rebatch::{RebatchSpec, rebatch};

/// Per value (with a static shape), per dim: does it carry the batch?
pub type BatchDims = HashMap<Value, Vec<bool>>;

/// The batch analysis of `g` (shapes must be inferred).
pub fn batch_dims(g: &Graph) -> BatchDims {
    let old: HashMap<Value, Vec<i64>> = values(g).filter_map(|v| Some((v, g.tensor_type(v)?.static_dims()?))).collect();
    let batch = g
        .input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .find_map(|v| g.tensor_type(v).and_then(TensorType::static_dims).and_then(|d| d.first().copied()));
    if let Some(b) = batch {
        let mut copy = g.clone();
        if rebatch(&mut copy, &RebatchSpec { batch: Some(b * 2), ..Default::default() }).is_ok() {
            let mut out = HashMap::new();
            for (v, d) in &old {
                if !copy.contains(v.node) {
                    continue;
                }
                if let Some(nd) = copy.tensor_type(*v).and_then(TensorType::static_dims)
                    && nd.len() == d.len()
                {
                    out.insert(*v, d.iter().zip(&nd).map(|(a, b)| *b == 2 * *a && *a > 0).collect());
                }
            }
            return out;
        }
    }
    // Fallback: dim 0 of everything computed from the inputs.
    let mut from_input: std::collections::HashSet<Value> =
        g.input_values().into_iter().filter(|v| matches!(g.node(v.node).op, Op::Input { default: None })).collect();
    let mut out = HashMap::new();
    if let Ok(order) = g.topo_order() {
        for n in order {
            let node = g.node(n);
            let derived = node.inputs().iter().flatten().any(|v| from_input.contains(v))
                || matches!(node.op, Op::Input { default: None });
            for s in 0..node.num_outputs() {
                let v = Value::new(n, s as u16);
                if derived {
                    from_input.insert(v);
                }
                if let Some(d) = old.get(&v) {
                    out.insert(v, d.iter().enumerate().map(|(i, _)| derived && i == 0).collect());
                }
            }
        }
    }
    out
}

fn values(g: &Graph) -> impl Iterator<Item = Value> + '_ {
    g.node_ids().flat_map(move |n| (0..g.node(n).num_outputs()).map(move |s| Value::new(n, s as u16)))
}
