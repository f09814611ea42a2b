//! Which dims of every value carry the batch (or the sequence) of the graph's inputs: an
//! analysis over the whole graph that follows the ops' dim-flow rules
//! ([`crate::ops::OpRules::flow`]) from the inputs, with the graph's constants from shape
//! inference. The cost model, the named strategies and the lowering's micro-batching read it.

use std::collections::HashMap;

use crate::graph::{Graph, Value};
use crate::ops::Mono;

/// Per value (with a static shape), per dim: does it carry the batch? The batch is dim 0 of
/// the graph inputs that share the first input's dim 0; it is followed through every op's
/// flow rule (merged dims such as `batch × sequence` carry it too). Shapes must be inferred.
pub fn batch_dims(g: &Graph) -> HashMap<Value, Vec<bool>> {
    dims_following(g, 0)
}

/// Per value (with a static shape), per dim: does it carry the sequence — dim 1 of the graph
/// inputs that share the first input of rank ≥ 2's extent there (tokens `[batch, seq]`,
/// embeddings `[batch, seq, hidden]`), followed as [`batch_dims`] follows the batch.
pub fn sequence_dims(g: &Graph) -> HashMap<Value, Vec<bool>> {
    dims_following(g, 1)
}

/// Per value, per dim: does it carry dim `axis` of the graph inputs that share the first
/// (of rank > `axis`) input's extent there.
fn dims_following(g: &Graph, axis: usize) -> HashMap<Value, Vec<bool>> {
    let mut old: HashMap<Value, Vec<i64>> = HashMap::new();
    for n in g.node_ids() {
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            if let Some(d) = g.tensor_type(v).and_then(crate::types::TensorType::static_dims) {
                old.insert(v, d);
            }
        }
    }
    let inputs: Vec<Value> = g
        .input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, crate::graph::op::Op::Input { default: None }))
        .collect();
    let Some(b) = inputs.iter().find_map(|v| old.get(v).and_then(|d| d.get(axis).copied())) else {
        return old.into_iter().map(|(v, d)| (v, vec![false; d.len()])).collect();
    };
    let syms = [(b, 2 * b.max(1))];
    // Seeds: dim 0 of the inputs that share the first input's size there, except recurrent
    // initial states (their batch is found from the requirements the recurrent op states).
    let mut seeds: HashMap<Value, Vec<Mono>> = HashMap::new();
    for &v in &inputs {
        if let Some(d) = old.get(&v)
            && d.get(axis) == Some(&b)
            && !crate::ops::recurrent::feeds_recurrent_state(g, v)
        {
            let mut m: Vec<Mono> = d.iter().map(|&x| Mono::constant(x)).collect();
            m[axis] = Mono::sym(0);
            seeds.insert(v, m);
        }
    }
    let consts =
        crate::infer::infer_shapes(&mut g.clone(), crate::infer::Mode::Check).map(|r| r.consts).unwrap_or_default();
    let order = g.topo_order().unwrap_or_default();
    let mut fl = crate::ops::flow::flow_graph(g, &order, &syms, &old, &consts, &seeds, &HashMap::new());
    // Requirements on values computed from graph inputs by slicing, casting or renaming
    // (a recurrent op's initial state, cut per layer from one input): that input's axis
    // carries the batch too.
    for _round in 0..4 {
        let mut grew = false;
        for (v, a, m) in std::mem::take(&mut fl.reqs) {
            let Some(x) = trace_to_input(g, v, a, &old) else { continue };
            let d = &old[&x];
            let e = seeds.entry(x).or_insert_with(|| d.iter().map(|&s| Mono::constant(s)).collect());
            if a < e.len() && !e[a].is_tracked() {
                e[a] = m;
                grew = true;
            }
        }
        if !grew {
            break;
        }
        fl = crate::ops::flow::flow_graph(g, &order, &syms, &old, &consts, &seeds, &HashMap::new());
    }
    old.into_iter()
        .map(|(v, d)| {
            let flags = match fl.monos.get(&v) {
                Some(m) => (0..d.len())
                    .map(|i| matches!(m.get(i), Some(Mono::Known { pows, .. }) if pows.contains_key(&0)))
                    .collect(),
                None => vec![false; d.len()],
            };
            (v, flags)
        })
        .collect()
}

/// The graph input (and its axis) that axis `a` of `v` comes from unchanged through ops
/// that keep the axis (slices along other axes, casts, identities).
fn trace_to_input(g: &Graph, v: Value, a: usize, old: &HashMap<Value, Vec<i64>>) -> Option<Value> {
    use crate::graph::op::Op;
    let mut v = v;
    for _ in 0..16 {
        let node = g.node(v.node);
        match &node.op {
            Op::Input { default: None } => return Some(v),
            Op::Slice(_) | Op::Identity(_) | Op::Cast(_) => {
                let x = node.input(0)?;
                let (dv, dx) = (old.get(&v)?, old.get(&x)?);
                if dv.len() != dx.len() || dv.get(a) != dx.get(a) {
                    return None;
                }
                v = x;
            }
            _ => return None,
        }
    }
    None
}
