//! The layout algebra ([`crate::layout`], re-exported here) applied to a graph's nodes: each
//! node's iteration space from its op's rules ([`iter_space`]) and whether a strategy can run
//! it ([`strategy_valid`]).

pub use crate::layout::*;
pub use crate::ops::space::pointwise;

use crate::graph::{Graph, NodeId, Value};
use crate::ops::NodeCx;
use crate::types::TensorType;

/// The iteration space of node `n` (see [`crate::ops::OpRules::space`]); shapes must be
/// inferred and static, otherwise the op is treated as whole, as is an op without a rule.
pub fn iter_space(g: &Graph, n: NodeId) -> IterSpace {
    let cx = NodeCx { g, n };
    if !crate::ops::static_node(g, n) {
        return IterSpace::whole(&cx);
    }
    g.node(n).op.rules().space(&cx).unwrap_or_else(|| IterSpace::whole(&cx))
}

/// True when `strategy` is admissible for `space` on `mesh`: split dims are splittable,
/// distinct, and divide evenly (the iteration dim and every tensor dim that follows it).
pub fn strategy_valid(space: &IterSpace, strategy: &[Option<usize>], mesh: &Mesh, g: &Graph, n: NodeId) -> bool {
    let mut factor: std::collections::HashMap<usize, i64> = std::collections::HashMap::new();
    for (a, s) in strategy.iter().enumerate() {
        if let Some(i) = s {
            let Some(d) = space.dims.get(*i) else { return false };
            match d.kind {
                DimKind::Fixed => return false,
                // No extent to divide: partial sums on any axes.
                DimKind::Linear => continue,
                _ => {}
            }
            *factor.entry(*i).or_insert(1) *= mesh.axes[a].size as i64;
        }
    }
    for (&i, &f) in &factor {
        if space.dims[i].size % f != 0 {
            return false;
        }
        // A dim split over several axes must be split by each of them in order; keep one.
        if strategy.iter().filter(|s| **s == Some(i)).count() > 1
            && !matches!(space.dims[i].kind, DimKind::Parallel | DimKind::Reduction)
        {
            return false;
        }
    }
    // Tensor dims that follow a split iteration dim must divide too.
    let node = g.node(n);
    let check = |map: &[Option<usize>], d: &[i64]| {
        map.iter().zip(d).all(|(m, &sz)| m.is_none_or(|i| factor.get(&i).is_none_or(|&f| sz % f == 0)))
    };
    for (j, m) in space.inputs.iter().enumerate() {
        if let (Some(m), Some(v)) = (m, node.input(j))
            && !check(m, &dims(g, Some(v)))
        {
            return false;
        }
    }
    for (s, m) in space.outputs.iter().enumerate() {
        if !check(m, &dims(g, Some(Value::new(n, s as u16)))) {
            return false;
        }
    }
    // Only splits the lowering can express (the cost model prices the same mode).
    crate::ops::split::split_mode(g, n, space, strategy, mesh).is_ok()
}

fn dims(g: &Graph, v: Option<Value>) -> Vec<i64> {
    v.and_then(|v| g.tensor_type(v)).and_then(TensorType::static_dims).unwrap_or_default()
}
