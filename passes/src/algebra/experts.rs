//! Fused experts: a sparse mixture of experts as exporters write it becomes one `MoE` op
//! (ir/src/ops/experts.rs) that never gathers a weight matrix per token.
//!
//! transformers' static-shape experts (`batched_mm`, the form its own ONNX export uses and the
//! one `torch.onnx.export` traces, TorchScript or dynamo) route each token to its `k` experts
//! by gathering the experts' whole weight matrices per routed pair — `[T·k, 2I, H]` and
//! `[T·k, H, I]` tensors, at Mixtral-8×7B's size 235 MB and 117 MB per pair in bf16 — and
//! multiplying each pair's matrix by its token. Matched, from the weighted sum back:
//! - `Y = ReduceSum(Z, axes = [1], keepdims = 0)`, `Z [T, k, H]` a reshape of `P [T·k, H]`;
//! - `P = Mul(O, w')`, `w' [T·k, 1]` the routing weights `w [T, k]` through reshapes;
//! - `O = Squeeze(MatMul(gather(W2), Unsqueeze(A, -1)), -1)`, `W2 [E, H, I]`;
//! - `A = Mul(Mul(G, Sigmoid(G)), U)` (SiLU of the gate times the up projection), `G` and `U`
//!   the two halves of `Hh [T·k, 2I]` along its last axis (`Split`, or two `Slice`s);
//! - `Hh = Squeeze(MatMul(gather(W1), Unsqueeze(X', -1)), -1)`, `W1 [E, 2I, H]`;
//! - `gather(W)` = `Gather(W, ids', axis 0)` or `GatherND(W, Unsqueeze(ids', -1))`, both
//!   gathers by the same ids `[T, k]` through reshapes — a `TopK`'s indices (through casts),
//!   so never negative;
//! - `X' [T·k, H]` each token repeated `k` times: a reshape of `Tile(Unsqueeze(X, 1), [1, k, 1])`
//!   or `Expand(Unsqueeze(X, 1), [T, k, H])`, `X [T, H]`.
//!
//! Every value inside the pattern is read only inside it and is not a graph output (run after
//! `canonicalize`, which folds the shapes the exporters compute from the tensors). Other
//! activations (a non-gated MLP, GELU) are left as they are.

use ir::eval::Array;
use ir::{Graph, NodeId, Op, Output, Value, op};

use super::static_dims as dims;
use crate::manager::{Changed, Located, Pass, PassCx, PassError};

fn is_float(g: &Graph, v: Value) -> bool {
    g.tensor_type(v).is_some_and(|t| t.dtype.is_float())
}

/// `v`'s constant integers (an initializer, a `Constant`, or an op of them).
fn ints(g: &Graph, v: Value) -> Option<Vec<i64>> {
    ir::ops::constant_value(g, v, 8).and_then(|a: Array| a.to_i64().ok())
}

/// One mixture found.
struct Found {
    /// The pattern's nodes.
    nodes: Vec<NodeId>,
    /// The weighted sum whose output the fused op takes over.
    sum: NodeId,
    x: Value,
    ids: Value,
    w: Value,
    w1: Value,
    w2: Value,
}

/// The walk: the nodes passed so far.
struct Walk<'g> {
    g: &'g Graph,
    nodes: Vec<NodeId>,
}

impl Walk<'_> {
    /// `v`'s producer when it is an op of type `is`, recorded.
    fn op(&mut self, v: Value, is: fn(&Op) -> bool) -> Option<NodeId> {
        let n = v.node;
        is(&self.g.node(n).op).then(|| {
            self.nodes.push(n);
            n
        })
    }

    fn input(&self, n: NodeId, i: usize) -> Option<Value> {
        self.g.node(n).input(i)
    }

    /// The value of dims `want` that `v` is through reshapes (`Reshape`, `Flatten`,
    /// `Squeeze`, `Unsqueeze`: row-major order kept), the reshapes recorded.
    fn reshaped_from(&mut self, mut v: Value, want: &[i64]) -> Option<Value> {
        loop {
            if dims(self.g, v)? == want {
                return Some(v);
            }
            let reshape = |o: &Op| matches!(o, Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_));
            let n = self.op(v, reshape)?;
            v = self.input(n, 0)?;
        }
    }

    /// `W[ids']` along dim 0 (`Gather`, or `GatherND` of ids with a trailing 1): `(W, ids')`.
    fn gather(&mut self, v: Value) -> Option<(Value, Value)> {
        let n = self.op(v, |o| matches!(o, Op::Gather(_) | Op::GatherND(_)))?;
        let (w, i) = (self.input(n, 0)?, self.input(n, 1)?);
        match &self.g.node(n).op {
            Op::Gather(gt) if gt.axis.unwrap_or(0) == 0 => Some((w, i)),
            Op::GatherND(gn) if gn.batch_dims.unwrap_or(0) == 0 && dims(self.g, i)?.last() == Some(&1) => Some((w, i)),
            _ => None,
        }
    }

    /// `Squeeze(MatMul(gather(W), Unsqueeze(a, -1)), -1)` of rows `rows`: `(W, ids', a)`.
    fn routed_product(&mut self, v: Value, rows: i64) -> Option<(Value, Value, Value)> {
        let sq = self.op(v, |o| matches!(o, Op::Squeeze(_) | Op::Reshape(_)))?;
        let mm = self.op(self.input(sq, 0)?, |o| matches!(o, Op::MatMul(_)))?;
        let (gathered, col) = (self.input(mm, 0)?, self.input(mm, 1)?);
        let (w, ids) = self.gather(gathered)?;
        let wd = dims(self.g, w)?;
        if wd.len() != 3 || dims(self.g, gathered)? != [rows, wd[1], wd[2]] || !is_float(self.g, w) {
            return None;
        }
        let a = self.reshaped_from(col, &[rows, wd[2]])?;
        (dims(self.g, col)? == [rows, wd[2], 1] && dims(self.g, v)? == [rows, wd[1]]).then_some((w, ids, a))
    }

    /// `a·b` in either order with `a` matched by `left`: `(left's result, b)`.
    fn product<T>(&mut self, v: Value, mut left: impl FnMut(&mut Self, Value) -> Option<T>) -> Option<(T, Value)> {
        let n = self.op(v, |o| matches!(o, Op::Mul(_)))?;
        let (a, b) = (self.input(n, 0)?, self.input(n, 1)?);
        let mark = self.nodes.len();
        if let Some(t) = left(self, a) {
            return Some((t, b));
        }
        self.nodes.truncate(mark);
        left(self, b).map(|t| (t, a))
    }

    /// `G·σ(G)`: `G`.
    fn silu(&mut self, v: Value) -> Option<Value> {
        let n = self.op(v, |o| matches!(o, Op::Mul(_)))?;
        let (a, b) = (self.input(n, 0)?, self.input(n, 1)?);
        for (x, s) in [(a, b), (b, a)] {
            if matches!(self.g.node(s.node).op, Op::Sigmoid(_)) && self.input(s.node, 0) == Some(x) {
                self.nodes.push(s.node);
                return Some(x);
            }
        }
        None
    }

    /// The halves of `Hh [rows, 2I]` that `g` and `u` are: `Hh`.
    fn halves(&mut self, g: Value, u: Value, rows: i64, i: i64) -> Option<Value> {
        let gn = self.g.node(g.node);
        match &gn.op {
            Op::Split(_) => {
                let hh = gn.input(0)?;
                let (parts, axis) = (gn.num_outputs(), split_axis(self.g, g.node)?);
                let ok = u.node == g.node && g.slot == 0 && u.slot == 1 && parts == 2 && (axis == 1 || axis == -1);
                (ok && dims(self.g, hh)? == [rows, 2 * i]).then(|| {
                    self.nodes.push(g.node);
                    hh
                })
            }
            Op::Slice(_) => {
                let hh = gn.input(0)?;
                let hu = self.g.node(u.node).input(0)?;
                let ok = matches!(self.g.node(u.node).op, Op::Slice(_))
                    && hh == hu
                    && slice_cols(self.g, g.node) == Some((0, i))
                    && slice_cols(self.g, u.node) == Some((i, 2 * i));
                (ok && dims(self.g, hh)? == [rows, 2 * i]).then(|| {
                    self.nodes.push(g.node);
                    self.nodes.push(u.node);
                    hh
                })
            }
            _ => None,
        }
    }
}

/// A `Split`'s axis (its halves must be equal: no sizes, or two equal ones).
fn split_axis(g: &Graph, n: NodeId) -> Option<i64> {
    let node = g.node(n);
    let Op::Split(s) = &node.op else { return None };
    let equal = match node.input(1) {
        Some(sz) => ints(g, sz).is_some_and(|v| v.len() == 2 && v[0] == v[1]),
        None => s.split.as_ref().is_none_or(|v| v.len() == 2 && v[0] == v[1]),
    };
    equal.then_some(s.axis.unwrap_or(0))
}

/// The column range `[start, end)` a `Slice` of a 2-D tensor takes along its last axis, with
/// unit steps (and the rows whole).
fn slice_cols(g: &Graph, n: NodeId) -> Option<(i64, i64)> {
    let node = g.node(n);
    let x = dims(g, node.input(0)?)?;
    let (starts, ends) = (ints(g, node.input(1)?)?, ints(g, node.input(2)?)?);
    let axes = match node.input(3) {
        Some(a) => ints(g, a)?,
        None => (0..starts.len() as i64).collect(),
    };
    let steps_ok = node.input(4).is_none_or(|s| ints(g, s).is_some_and(|v| v.iter().all(|&x| x == 1)));
    if x.len() != 2 || starts.len() != 1 || ends.len() != 1 || axes.len() != 1 || !steps_ok {
        return None;
    }
    if axes[0] != 1 && axes[0] != -1 {
        return None;
    }
    let clamp = |v: i64| if v < 0 { (v + x[1]).max(0) } else { v.min(x[1]) };
    Some((clamp(starts[0]), clamp(ends[0])))
}

/// The axes a `ReduceSum` sums over (its input or, before opset 13, its attribute).
fn sum_axes(g: &Graph, n: NodeId) -> Option<Vec<i64>> {
    let node = g.node(n);
    let Op::ReduceSum(r) = &node.op else { return None };
    if r.keepdims.unwrap_or(1) != 0 {
        return None;
    }
    match node.input(1) {
        Some(a) => ints(g, a),
        None => r.axes.clone(),
    }
}

/// The mixture whose weighted sum is node `n`.
fn find(g: &Graph, n: NodeId) -> Option<Found> {
    let axes = sum_axes(g, n)?;
    let z = g.node(n).input(0)?;
    let zd = dims(g, z)?;
    if zd.len() != 3 || (axes != [1] && axes != [-2]) || !is_float(g, z) {
        return None;
    }
    let (t, k, h) = (zd[0], zd[1], zd[2]);
    let rows = t * k;
    let mut wk = Walk { g, nodes: vec![n] };
    let p = wk.reshaped_from(z, &[rows, h])?;
    // P = O · w'.
    let ((w2, ids2, a), wcol) = wk.product(p, |wk, o| wk.routed_product(o, rows))?;
    if dims(g, wcol)? != [rows, 1] {
        return None;
    }
    let w = wk.reshaped_from(wcol, &[t, k]).filter(|&w| is_float(g, w))?;
    let w2d = dims(g, w2)?;
    let (e, i) = (w2d[0], w2d[2]);
    if w2d[1] != h {
        return None;
    }
    // A = silu(G) · U.
    let (gate, up) = wk.product(a, |wk, s| wk.silu(s))?;
    let hh = wk.halves(gate, up, rows, i)?;
    let (w1, ids1, xr) = wk.routed_product(hh, rows)?;
    if dims(g, w1)? != [e, 2 * i, h] {
        return None;
    }
    let ids = wk.reshaped_from(ids1, &[t, k])?;
    if wk.reshaped_from(ids2, &[t, k])? != ids || !g.tensor_type(ids).is_some_and(|ty| ty.dtype.is_int()) {
        return None;
    }
    // The ids a router's top-k chose (never negative: `Gather` would wrap a negative id to
    // the last experts, where `MoE` reads it as no expert).
    if !top_k_indices(g, ids, |o| matches!(o, Op::Cast(_))) {
        return None;
    }
    let x = repeated(&mut wk, xr, t, k, h)?;
    let mut nodes = wk.nodes;
    nodes.sort();
    nodes.dedup();
    closed(g, &nodes, n).then_some(Found { nodes, sum: n, x, ids, w, w1, w2 })
}

/// Whether `v` is a `TopK`'s indices (output 1), directly or through ops `through` accepts.
fn top_k_indices(g: &Graph, mut v: Value, through: fn(&Op) -> bool) -> bool {
    loop {
        let node = g.node(v.node);
        match &node.op {
            Op::TopK(_) => return v.slot == 1,
            op if through(op) => match node.input(0) {
                Some(i) => v = i,
                None => return false,
            },
            _ => return false,
        }
    }
}

/// `X [T, H]` whose rows `xr [T·k, H]` repeats `k` times each.
fn repeated(wk: &mut Walk<'_>, xr: Value, t: i64, k: i64, h: i64) -> Option<Value> {
    let g = wk.g;
    let tiled = wk.reshaped_from(xr, &[t, k, h])?;
    let n = wk.op(tiled, |o| matches!(o, Op::Tile(_) | Op::Expand(_)))?;
    let (src, reps) = (wk.input(n, 0)?, wk.input(n, 1)?);
    let ok = match &g.node(n).op {
        Op::Tile(_) => ints(g, reps)? == [1, k, 1],
        _ => true,
    };
    if !ok || dims(g, src)? != [t, 1, h] {
        return None;
    }
    let x = wk.reshaped_from(src, &[t, h])?;
    is_float(g, x).then_some(x)
}

/// Whether every value the pattern's nodes make, but the sum's, is read only inside it (or
/// by a `Shape` of it, whose value its static shape is: TorchScript computes the halves'
/// bounds so) and is not a graph output.
fn closed(g: &Graph, nodes: &[NodeId], sum: NodeId) -> bool {
    nodes.iter().filter(|&&m| m != sum).all(|&m| {
        (0..g.node(m).num_outputs()).all(|s| {
            let v = Value::new(m, s as u16);
            let inside = |r: &NodeId| nodes.binary_search(r).is_ok() || static_shape(g, *r).is_some();
            !g.is_output(v) && g.users(v).iter().all(|(r, _)| inside(r))
        })
    })
}

/// The value of node `n` when it is a `Shape` of a tensor of static shape.
fn static_shape(g: &Graph, n: NodeId) -> Option<ir::Tensor> {
    matches!(g.node(n).op, Op::Shape(_))
        .then(|| ir::ops::constant_value(g, Value::new(n, 0), 1))
        .flatten()
        .map(|a| a.to_tensor())
}

/// The `Shape`s of the pattern's values made constants (their values are known).
fn fold_shapes(g: &mut Graph, nodes: &[NodeId]) {
    let gr: &Graph = g;
    let readers: Vec<NodeId> = nodes
        .iter()
        .flat_map(|&m| (0..gr.node(m).num_outputs()).flat_map(move |s| gr.users(Value::new(m, s as u16))))
        .map(|(r, _)| r)
        .filter(|r| nodes.binary_search(r).is_err())
        .collect();
    for r in readers {
        if let Some(t) = static_shape(g, r) {
            g.make_initializer(r, t);
        }
    }
}

/// The fused op's label: the sum's scope with its last part `MoE`.
fn label_of(g: &Graph, n: NodeId) -> String {
    let l = g.node(n).label.clone().unwrap_or_else(|| g.op_name(n));
    match l.rfind('/') {
        Some(i) => format!("{}/MoE", &l[..i]),
        None => "MoE".into(),
    }
}

fn fuse(g: &mut Graph, f: Found) {
    let out = Value::new(f.sum, 0);
    let (name, ty) = (g.value_name(out).to_string(), g.node(f.sum).outputs()[0].ty.clone());
    let mut output = Output::named(g.fresh_name(&format!("{name}_fused")));
    output.ty = ty;
    let label = label_of(g, f.sum);
    let ins = vec![Some(f.x), Some(f.ids), Some(f.w), Some(f.w1), Some(f.w2)];
    let n = g.add_labeled_node(Some(label), Op::MoE(op::MoE::default()), ins, vec![output]);
    let y = Value::new(n, 0);
    g.replace_all_uses(out, y);
    fold_shapes(g, &f.nodes);
    // (The rest of the pattern, read by nothing now, goes with the dead code.)
    g.remove_node(f.sum);
    g.rename(y, name);
}

/// Rewrites every mixture of experts of `g` into one `MoE` op; returns how many.
pub fn fuse_experts(g: &mut Graph) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let found: Vec<Found> = order.into_iter().filter_map(|n| find(g, n)).collect();
    let done = found.len() as u64;
    for f in found {
        fuse(g, f);
    }
    if done > 0 {
        crate::canonicalize::eliminate_dead_code(g);
        crate::canonicalize::eliminate_unused_initializers(g);
    }
    Ok(done)
}

/// The gathers left in `g` that gather expert weights per routed token: a `Gather` (axis 0)
/// or `GatherND` of a float tensor of rank 3 whose indices come, through reshapes, from a
/// `TopK`'s indices — a mixture of experts [`fuse_experts`] did not recognise.
pub fn unfused(g: &Graph) -> Vec<NodeId> {
    let Ok(order) = g.topo_order() else { return Vec::new() };
    order
        .into_iter()
        .filter(|&n| {
            let wk = &mut Walk { g, nodes: Vec::new() };
            let Some((w, ids)) = wk.gather(Value::new(n, 0)) else { return false };
            if dims(g, w).is_none_or(|d| d.len() != 3) || !is_float(g, w) {
                return false;
            }
            top_k_indices(g, ids, |o| {
                matches!(o, Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_) | Op::Cast(_))
            })
        })
        .collect()
}

/// The warning for an unfused mixture at gather `n`.
pub fn unfused_warning(g: &Graph, n: NodeId) -> Located {
    Located::at(
        g,
        n,
        format!(
            "{} gathers expert weights per routed token and was not fused into one MoE op: `fuse-experts` recognizes transformers' batched_mm experts with a SiLU-gated MLP (the gate-and-up product, SiLU of its first half times its second, the down product, weighted by the router and summed over the k experts); as written every routed token materialises its experts' weight matrices, and expert parallelism does not apply",
            g.describe(n)
        ),
    )
}

/// The `fuse-experts` pass: [`fuse_experts`] on every mixture of experts.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseExperts;

impl Pass for FuseExperts {
    fn name(&self) -> &'static str {
        "fuse-experts"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let changed = super::run_rewrite(g, cx, self.name(), "mixtures of experts fused", fuse_experts)?;
        for n in unfused(g) {
            cx.warnings.push(unfused_warning(g, n));
        }
        Ok(changed)
    }
}

/// Asks every mixture of experts for the all-to-all token dispatcher with buffers of
/// `factor` times an even share of the routed pairs (0: dropless;
/// [`ir::ops::experts::set_capacity`]); an error when the model has none. Run after
/// `fuse-experts`.
pub struct MoeCapacity(pub f32);

impl Pass for MoeCapacity {
    fn name(&self) -> &'static str {
        "moe-capacity"
    }

    fn run(&mut self, g: &mut Graph, _cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let err = |m: String| PassError::new(self.name(), Located::global(m));
        match ir::ops::experts::set_capacity(g, self.0).map_err(err)? {
            0 => Err(err(
                "a capacity factor for the all-to-all dispatcher, but the model has no mixture of experts (`fuse-experts`; docs/user-guide.md)"
                    .into(),
            )),
            _ => Ok(Changed::Yes),
        }
    }
}
