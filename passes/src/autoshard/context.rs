//! Context parallelism as DeepSpeed-Ulysses runs it: every op splits the sequence over the
//! devices, but attention, which splits its heads — the layout algebra then moves the query,
//! key and value from sequence shards to head shards by an all-to-all before each attention
//! (and its gradient) and its output back after, and the weights' gradients, partial sums
//! over the sequence, are all-reduced as under data parallelism. Or as ring attention
//! ([`context`] with `ring`): attention keeps the sequence split too, and its keys and values
//! pass around the devices (`SplitMode::Ring`, codegen/src/lower/ring.rs).
//!
//! The sequence is the second dim of the model's first input of rank two or more (tokens
//! `[batch, seq]`, embeddings `[batch, seq, hidden]`), followed through the graph as the
//! batch is ([`ir::dims::sequence_dims`]); an op's sequence dim is the iteration dim its
//! tensors' sequence-carrying dims follow (an output's, else an input's: a weight's gradient
//! sums over it).

use std::collections::HashMap;

use ir::shard::{DimKind, strategy_valid};
use ir::{NodeId, Op, Value};

use crate::cost::CostModel;

/// The sequence length: the extent of the first graph input's sequence dim (`seq`:
/// [`ir::dims::sequence_dims`]).
pub fn sequence_len(cm: &CostModel<'_>, seq: &SequenceDims) -> Option<i64> {
    let g = cm.g;
    g.input_values().into_iter().filter(|v| matches!(g.node(v.node).op, Op::Input { default: None })).find_map(|v| {
        let t = seq.get(&v)?.iter().position(|&f| f)?;
        g.tensor_type(v)?.static_dims()?.get(t).copied()
    })
}

/// Whether `n` is an attention (or its gradient) with a heads dim to split.
pub fn is_attention(cm: &CostModel<'_>, n: NodeId) -> bool {
    cm.g.node(n).op.op_type().starts_with("Attention") && heads_dim(cm, n).is_some()
}

fn heads_dim(cm: &CostModel<'_>, n: NodeId) -> Option<usize> {
    cm.space(n).dims.iter().position(|d| d.name == "h" && d.kind != DimKind::Fixed)
}

/// Per value, per dim: does it carry the sequence.
pub type SequenceDims = HashMap<Value, Vec<bool>>;

/// Ulysses' strategy for op `n` over mesh `axes`: an attention's heads, any other op's
/// sequence dim (`seq`: [`ir::dims::sequence_dims`]); `None` where neither splits
/// validly (the op follows its input).
pub fn ulysses(cm: &CostModel<'_>, n: NodeId, seq: &SequenceDims, axes: &[usize]) -> Option<Vec<Option<usize>>> {
    context(cm, n, seq, axes, false)
}

/// The sequence dim of an attention (or its gradient) that splits as ring attention (role
/// [`ir::shard::DimRole::Sequence`]: a plain causal self-attention, ir/src/ops/attention.rs).
pub fn ring_dim(cm: &CostModel<'_>, n: NodeId) -> Option<usize> {
    cm.space(n).dims.iter().position(|d| d.role == ir::shard::DimRole::Sequence)
}

/// Context parallelism's strategy for op `n` over mesh `axes`: [`ulysses`], or with `ring`
/// ring attention's — an attention that can splits its sequence ([`ring_dim`]; one that
/// cannot, its heads), every other op as under Ulysses.
pub fn context(
    cm: &CostModel<'_>,
    n: NodeId,
    seq: &SequenceDims,
    axes: &[usize],
    ring: bool,
) -> Option<Vec<Option<usize>>> {
    let sp = cm.space(n);
    let ringed = (ring && cm.g.node(n).op.op_type().starts_with("Attention")).then(|| ring_dim(cm, n)).flatten();
    let dim = if let Some(d) = ringed {
        Some(d)
    } else if is_attention(cm, n) {
        heads_dim(cm, n)
    } else {
        pairwise_heads(cm, n, seq).or_else(|| sequence_dim(cm, n, seq))
    }?;
    let mut s = vec![None; cm.mesh.axes.len()];
    for &a in axes {
        s[a] = Some(dim);
    }
    strategy_valid(sp, &s, &cm.mesh, cm.g, n).then_some(s)
}

/// For an op that relates sequence positions to one another — attention's scores and their
/// gradients, computed apart from a fused attention (two iteration dims carry the sequence:
/// query rows and keys, or it sums over the sequence) — the heads: dim 1 of its first 4-D
/// tensor `[batch, heads, …]`, as the attention beside it splits.
fn pairwise_heads(cm: &CostModel<'_>, n: NodeId, seq: &SequenceDims) -> Option<usize> {
    let sp = cm.space(n);
    let node = cm.g.node(n);
    let tensors: Vec<(Value, &Vec<Option<usize>>)> = sp
        .outputs
        .iter()
        .enumerate()
        .map(|(s, m)| (Value::new(n, s as u16), m))
        .chain(sp.inputs.iter().enumerate().filter_map(|(j, m)| Some((node.input(j)?, m.as_ref()?))))
        .collect();
    let mut carrying: Vec<usize> = Vec::new();
    for (v, map) in &tensors {
        for (t, _) in seq.get(v).into_iter().flatten().enumerate().filter(|(_, f)| **f) {
            if let Some(Some(i)) = map.get(t)
                && !carrying.contains(i)
            {
                carrying.push(*i);
            }
        }
    }
    // (One that sums over the sequence — `Pᵀ·dY` of attention's backward, where the
    // probabilities' dims are opaque to the flow — would leave partial sums to all-reduce.)
    let sums_sequence = carrying.len() == 1 && sp.dims[carrying[0]].kind == DimKind::Reduction;
    if carrying.len() < 2 && !sums_sequence {
        return None;
    }
    tensors.iter().find_map(|(v, map)| {
        let flags = seq.get(v)?;
        let i = (flags.len() == 4 && !flags[1]).then(|| map.get(1).copied().flatten()).flatten()?;
        (sp.dims[i].kind == DimKind::Parallel && !carrying.contains(&i)).then_some(i)
    })
}

/// The iteration dim of `n` that its tensors' sequence dims follow: an output's, else an
/// input's.
fn sequence_dim(cm: &CostModel<'_>, n: NodeId, seq: &SequenceDims) -> Option<usize> {
    let sp = cm.space(n);
    let node = cm.g.node(n);
    let outs = sp.outputs.iter().enumerate().map(|(s, m)| (Some(Value::new(n, s as u16)), Some(m)));
    let ins = sp.inputs.iter().enumerate().map(|(j, m)| (node.input(j), m.as_ref()));
    for (v, map) in outs.chain(ins) {
        let (Some(v), Some(map)) = (v, map) else { continue };
        let Some(flags) = seq.get(&v) else { continue };
        for (t, _) in flags.iter().enumerate().filter(|(_, f)| **f) {
            if let Some(Some(i)) = map.get(t)
                && sp.dims[*i].kind != DimKind::Fixed
            {
                return Some(*i);
            }
        }
    }
    None
}
