//! Repeated-layer folding: a stack of identical blocks (transformer layers) is searched as
//! three of them — the first, one interior block standing for every interior one, the last —
//! and the plan found is copied to every block.
//!
//! Blocks are the exporter's repeated modules ([`ir::scope::block_of`]: `transformer.h.7`,
//! `layer.3`, `h12`); two blocks repeat when their ops match one for one (op and attributes,
//! shapes, which op of the block or which outside value each input reads). The longest run of
//! consecutive repeating blocks is folded when each block reads from the run only the block
//! before it. The reduced graph keeps blocks 0, 1 and L−1, the last reading block 1 where it
//! read block L−2; interior blocks take block 1's strategies, the first and last their own.
//! Autoparallel and ColossalAI force repeated layers to share a solution the same way; the
//! search's time then hardly grows with depth.

use std::collections::HashMap;

use ir::{Graph, NodeId, Op, Value};

/// A run of repeating blocks.
#[derive(Clone, Debug)]
pub struct Folding {
    /// The blocks' names, in order.
    pub names: Vec<String>,
    /// Each block's ops, in topological order (the same length for all: op `i` of one block
    /// corresponds to op `i` of every other).
    pub ops: Vec<Vec<NodeId>>,
}

impl Folding {
    /// Blocks in the run.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True when there is no block.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The block that stands for block `k` in the reduced graph (0, 1 or the last).
    pub fn representative(&self, k: usize) -> usize {
        let last = self.len() - 1;
        if k == 0 || k == last { k } else { 1 }
    }
}

/// How an op reads an input, relative to its block: op `i` of the block (and slot), a
/// parameter (only its shape: weights differ from block to block), a constant (by value), op
/// `i` of the block before, or any other value (which must be the same value).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Read {
    Local(usize, u16),
    Param(Option<Vec<i64>>),
    Const(String),
    /// Op `i` of the block before (the chain the fold cuts).
    Prev(usize, u16),
    Outside(Value),
}

/// How each op of `ops` (a block) reads its inputs and what it makes, as comparable text;
/// `prev` is the block before it (its reads are recorded by position).
fn signature(g: &Graph, ops: &[NodeId], prev: Option<&[NodeId]>) -> Vec<String> {
    let pos: HashMap<NodeId, usize> = ops.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let prev_pos: HashMap<NodeId, usize> =
        prev.map(|p| p.iter().enumerate().map(|(i, &n)| (n, i)).collect()).unwrap_or_default();
    let read = |v: &Value| {
        if let Some(&i) = pos.get(&v.node) {
            Read::Local(i, v.slot)
        } else if matches!(g.node(v.node).op, Op::Initializer(_)) && ir::cost::is_param(g, *v) {
            Read::Param(g.tensor_type(*v).and_then(|t| t.static_dims()))
        } else if let Some(t) = g.initializer(*v) {
            // A constant (a shape, a scale): the same values, wherever they are stored.
            Read::Const(format!("{:?} {:?} {:?}", t.dtype, t.dims, t.data))
        } else if let Some(&i) = prev_pos.get(&v.node) {
            Read::Prev(i, v.slot)
        } else {
            Read::Outside(*v)
        }
    };
    ops.iter()
        .map(|&n| {
            let node = g.node(n);
            let reads: Vec<Option<Read>> = node.inputs().iter().map(|v| v.as_ref().map(read)).collect();
            let outs: Vec<Option<Vec<i64>>> = (0..node.num_outputs())
                .map(|s| g.tensor_type(Value::new(n, s as u16)).and_then(|t| t.static_dims()))
                .collect();
            format!("{:?} {reads:?} {outs:?}", node.op)
        })
        .collect()
}

/// Finds the longest run of at least `min_blocks` consecutive repeating blocks of `g`.
pub fn find(g: &Graph, order: &[NodeId], min_blocks: usize) -> Option<Folding> {
    let paths = ir::scope::module_paths(g, order);
    let mut names: Vec<String> = Vec::new();
    let mut ops: HashMap<String, Vec<NodeId>> = HashMap::new();
    for &n in order {
        let b = ir::scope::block_of(paths.get(&n).map_or("", String::as_str));
        if b.is_empty() {
            continue;
        }
        if !ops.contains_key(&b) {
            names.push(b.clone());
        }
        ops.entry(b).or_default().push(n);
    }
    // Signatures relative to the block before (the first block of a run has none).
    let mut best: Option<(usize, usize)> = None;
    let mut start = 0;
    while start < names.len() {
        let first = signature(g, &ops[&names[start]], None);
        let mut end = start + 1;
        let mut chained: Option<Vec<String>> = None;
        while end < names.len() {
            let s = signature(g, &ops[&names[end]], Some(&ops[&names[end - 1]]));
            // The second block fixes what every later block must look like; the first block
            // must match it except for the reads of the chain (which it takes from outside).
            let same = match &chained {
                None => {
                    s.len() == first.len()
                        && ops[&names[end]].iter().zip(&ops[&names[start]]).all(|(&a, &b)| g.node(a).op == g.node(b).op)
                }
                Some(c) => *c == s,
            };
            if !same {
                break;
            }
            chained.get_or_insert(s);
            end += 1;
        }
        if end - start >= min_blocks && best.is_none_or(|(s, e)| end - start > e - s) {
            best = Some((start, end));
        }
        start = end.max(start + 1);
    }
    let (s, e) = best?;
    let names: Vec<String> = names[s..e].to_vec();
    let ops: Vec<Vec<NodeId>> = names.iter().map(|b| ops[b].clone()).collect();
    // Only the block before may read a block (and the graph outside, only the last block).
    let block_of: HashMap<NodeId, usize> =
        ops.iter().enumerate().flat_map(|(k, b)| b.iter().map(move |&n| (n, k))).collect();
    for (k, b) in ops.iter().enumerate() {
        for &n in b {
            for s in 0..g.node(n).num_outputs() {
                let v = Value::new(n, s as u16);
                for (u, _) in g.users(v) {
                    match block_of.get(&u) {
                        Some(&j) if j == k || j == k + 1 => {}
                        None if k == ops.len() - 1 => {}
                        _ => return None,
                    }
                }
                if k + 1 < ops.len() && g.is_output(v) {
                    return None;
                }
            }
        }
    }
    Some(Folding { names, ops })
}

/// The graph with blocks 2 … L−2 of `f` removed: block L−1 reads block 1 where it read block
/// L−2. Node ids of what remains are `g`'s.
pub fn reduce(g: &Graph, f: &Folding) -> Graph {
    let mut r = g.clone();
    let last = f.len() - 1;
    if last < 3 {
        return r;
    }
    let pos: HashMap<NodeId, usize> = f.ops[last - 1].iter().enumerate().map(|(i, &n)| (n, i)).collect();
    for &n in &f.ops[last] {
        let inputs: Vec<Option<Value>> = r.node(n).inputs().to_vec();
        for (j, v) in inputs.iter().enumerate() {
            if let Some(v) = v
                && let Some(&i) = pos.get(&v.node)
            {
                r.set_input(n, j, Some(Value::new(f.ops[1][i], v.slot)));
            }
        }
    }
    // Later blocks first: each reads only the block before it.
    for b in f.ops[2..last].iter().rev() {
        for &n in b.iter().rev() {
            r.remove_node(n);
        }
    }
    crate::canonicalize::eliminate_unused_initializers(&mut r);
    r
}

/// The strategies of the full graph from those of the reduced one: each block's ops take
/// their representative's.
pub fn expand(f: &Folding, reduced: &crate::cost::Assignment) -> crate::cost::Assignment {
    let mut out = reduced.clone();
    for (k, b) in f.ops.iter().enumerate() {
        let r = f.representative(k);
        if r == k {
            continue;
        }
        for (i, &n) in b.iter().enumerate() {
            match reduced.strategies.get(&f.ops[r][i]) {
                Some(s) => {
                    out.strategies.insert(n, s.clone());
                }
                None => {
                    out.strategies.remove(&n);
                }
            }
        }
    }
    out
}
