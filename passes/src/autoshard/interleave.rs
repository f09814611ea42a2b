//! The model chunks of an interleaved pipeline (Megatron's schedule over `V` chunks per
//! device): the op sequence cut again into `V·S` virtual stages, virtual stage `c·S + s` on
//! stage `s`'s devices.
//!
//! The search prices stage `s` as a contiguous run of ops whose `V` chunks are each a `V`-th
//! of it ([`crate::cost::pipeline`]). The chunks that run are cut from the whole op sequence
//! so that virtual stage `c·S + s` holds a `V`-th of stage `s`'s FLOPs (forward and backward,
//! [`ir::cost::node_cost`]): each device keeps the work it was priced with, in `V` pieces
//! spread over the model. With one chunk the stages are returned as they are.

use std::collections::HashMap;

use ir::{Graph, NodeId};

/// The virtual stage of every op of `stage_of` (its stage among `stages`) under `chunks`
/// model chunks per device. An error when a virtual stage would hold no op.
pub fn virtual_stages(
    g: &Graph,
    stage_of: &HashMap<NodeId, usize>,
    stages: usize,
    chunks: usize,
) -> Result<HashMap<NodeId, usize>, String> {
    if chunks <= 1 {
        return Ok(stage_of.clone());
    }
    let all = g.op_nodes().map_err(|_| "the graph has a cycle".to_string())?;
    let grads = ir::cost::grad_flow(g, &all);
    let order: Vec<NodeId> = all.into_iter().filter(|n| stage_of.contains_key(n)).collect();
    let work: Vec<f64> = order.iter().map(|&n| ir::cost::node_cost(g, n, &grads).total_flops()).collect();
    let mut per_stage = vec![0.0; stages.max(1)];
    for (&n, w) in order.iter().zip(&work) {
        per_stage[stage_of[&n].min(stages.max(1) - 1)] += w;
    }
    let virtual_count = stages * chunks;
    // Where each virtual stage's share of the work ends.
    let ends: Vec<f64> = (0..virtual_count)
        .scan(0.0, |acc, j| {
            *acc += per_stage[j % stages] / chunks as f64;
            Some(*acc)
        })
        .collect();
    let mut out = HashMap::with_capacity(order.len());
    let (mut done, mut j) = (0.0, 0);
    for (&n, &w) in order.iter().zip(&work) {
        // An op goes where the middle of its work falls.
        while j + 1 < virtual_count && done + w / 2.0 >= ends[j] {
            j += 1;
        }
        out.insert(n, j);
        done += w;
    }
    let mut held = vec![0usize; virtual_count];
    for &j in out.values() {
        held[j] += 1;
    }
    if let Some(empty) = held.iter().position(|&k| k == 0) {
        return Err(format!(
            "the interleaved schedule needs {virtual_count} model chunks ({stages} stages × {chunks}); chunk {empty} would hold no op"
        ));
    }
    Ok(out)
}
