//! Fused attention: the exporters' scaled dot-product attention, written as separate ops,
//! becomes one ONNX `Attention` op (opset 23) that never materialises the `s × s` scores.
//!
//! `Attention(Q, K, V, M; scale = c) = Softmax(c · Q·Kᵀ + M, last axis) · V`, on `[b, h, s, d]`
//! heads. Matched, from the product with `V` back:
//! - `MatMul(P, V)`, `P` read by nothing else, `V` of rank 4;
//! - optionally the exporters' guard of fully masked rows, `P = Where(IsNaN(P₀), 0, P₀)` (the
//!   op's rows with no attendable key are zeros, as the guard makes them);
//! - `P₀ = Softmax(S, last axis)`;
//! - optionally `S = Add(S₁, M)`, the mask `M` broadcasting to the scores' shape — the op's
//!   `is_causal` instead where `M` is the causal mask, `Trilu(upper, k = 1)` of a tensor of
//!   one constant `c ≤ −10⁴` (or of ones times `c`), so that no `s × s` mask is made;
//! - optionally `S₁ = Mul(S₂, c)` or `Div(S₂, c)`, `c` a constant scalar;
//! - `S₂ = MatMul(A, B)`, both of rank 4 with the same leading dims, where `A` and `B` may be
//!   `Mul`s by constant scalars (PyTorch's decomposed `scaled_dot_product_attention` scales
//!   each side by `√c`) that nothing else reads.
//!
//! Every value inside the pattern is read once (by the next op of the pattern) and is not a
//! graph output. The key enters the op as `[b, h, s, d]`: `B`'s producer when it is a
//! transpose swapping the last two dims, else a new `Transpose` of `B`. The fused op is
//! labelled after the softmax's scope (`…/attention/self/Softmax` → `…/attention/self/Attention`).
//!
//! What it changes for a plan: the training step keeps `Q`, `K` and `V` for the backward, not
//! the probabilities (flash attention's stash); the backward recomputes the scores, at 2.5 times
//! the forward's work instead of 2 ([`ir::ops::Backward::Times`]). The op splits by batch and
//! heads, and by query rows under a mask given as a tensor. Where that pays is the search's
//! choice ([`super::SEARCH_CHOICES`]).

use ir::eval::Array;
use ir::{Graph, NodeId, Op, Output, Value, op};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// One attention found: the nodes it replaces and the operands of the fused op.
struct Found {
    /// The pattern's nodes, from the scores' product to the product with `V`.
    nodes: Vec<NodeId>,
    /// The `MatMul(P, V)` whose output the fused op takes over.
    context: NodeId,
    softmax: NodeId,
    q: Value,
    /// `Kᵀ` as `[b, h, d, s]`, and the transpose that made it from `[b, h, s, d]` when it
    /// swaps the last two dims and nothing else reads it.
    kt: Value,
    v: Value,
    mask: Option<Value>,
    scale: f64,
}

/// The one reader of `v`, when it has exactly one and is not a graph output.
fn lone_reader(g: &Graph, v: Value) -> Option<NodeId> {
    if g.is_output(v) {
        return None;
    }
    match g.users(v).as_slice() {
        [(n, _)] => Some(*n),
        _ => None,
    }
}

fn dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(|t| t.static_dims())
}

/// The value of `v` when it is a constant float scalar (one element).
fn scalar(g: &Graph, v: Value) -> Option<f64> {
    g.tensor_type(v).is_some_and(|t| t.dtype.is_float()).then(|| constant(g, v)).flatten()
}

/// The value of `v` when it is a constant of one element, of any number type.
fn constant(g: &Graph, v: Value) -> Option<f64> {
    if g.tensor_type(v).and_then(|t| t.numel()) != Some(1) {
        return None;
    }
    constant_values(g, v)?.first().copied()
}

/// The most a causal mask's masked entries may add to a score for the op's `is_causal` to
/// stand in for it: a masked weight is then `exp(≤ −10⁴ + (its score − the row's largest))`,
/// below the smallest `f32` (`e^−104`) unless the scores span nearly 10⁴ — zero, as
/// `is_causal` makes it. (Exporters write −10⁴, `finfo.min` or −∞.)
const CAUSAL_FILL: f64 = -1e4;

/// The elements of `v` when it is a constant (an initializer or `Constant` with its data).
fn constant_values(g: &Graph, v: Value) -> Option<Vec<f64>> {
    let t = match &g.node(v.node).op {
        Op::Initializer(t) => t.clone(),
        Op::Constant(c) => ir::eval::eval_op(&Op::Constant(c.clone()), &[], 1, g.opset).ok()?.remove(0).to_tensor(),
        _ => return None,
    };
    Array::from_tensor(&t).ok()?.to_f64().ok()
}

/// The value of a tensor every element of which is the same constant: `Expand(c, shape)` or
/// `ConstantOfShape(value = c)`.
fn uniform(g: &Graph, v: Value) -> Option<f64> {
    let node = g.node(v.node);
    match &node.op {
        Op::Expand(_) => constant(g, node.input(0)?),
        Op::ConstantOfShape(c) => {
            let t = c.value.clone()?;
            (t.numel() == 1).then(|| Array::from_tensor(&t).ok()?.to_f64().ok()?.first().copied()).flatten()
        }
        _ => constant(g, v),
    }
}

/// Whether mask `m` of the scores `[b, h, s, s]` is the causal one: `c` above the diagonal, 0
/// on and below it, `c ≤` [`CAUSAL_FILL`] — `Trilu(upper, k = 1)` of a tensor of `c`s, or of
/// ones multiplied by `c`, its last two dims `s × s` (leading dims broadcasting).
fn is_causal_mask(g: &Graph, m: Value, sd: &[i64]) -> bool {
    let md = dims(g, m).unwrap_or_default();
    if md.len() < 2 || sd[2] != sd[3] || md[md.len() - 2..] != sd[2..] {
        return false;
    }
    let upper_of = |t: Value| -> Option<f64> {
        let node = g.node(t.node);
        let Op::Trilu(tr) = &node.op else { return None };
        let k = constant(g, node.input(1)?)?;
        (tr.upper.unwrap_or(1) == 1 && k == 1.0).then(|| uniform(g, node.input(0)?)).flatten()
    };
    if let Some(values) = constant_values(g, m) {
        // (Folded already: small sequences.)
        let n = sd[2] as usize;
        return values.chunks(n * n).all(|square| {
            square.iter().enumerate().all(|(at, &x)| if at % n > at / n { x <= CAUSAL_FILL } else { x == 0.0 })
        });
    }
    let node = g.node(m.node);
    let fill = match (&node.op, node.input(0), node.input(1)) {
        (Op::Mul(_), Some(a), Some(b)) => match (upper_of(a), scalar(g, b), upper_of(b), scalar(g, a)) {
            (Some(1.0), Some(c), _, _) | (_, _, Some(1.0), Some(c)) => Some(c),
            _ => None,
        },
        _ => upper_of(m),
    };
    fill.is_some_and(|c| c <= CAUSAL_FILL)
}

/// `x · c` or `x / c` with `c` a constant scalar, read only by `reader`: `(x, factor)`.
fn scaled(g: &Graph, v: Value) -> Option<(Value, f64)> {
    let node = g.node(v.node);
    let (a, b) = (node.input(0)?, node.input(1)?);
    match node.op {
        Op::Mul(_) => match (scalar(g, b), scalar(g, a)) {
            (Some(c), _) => Some((a, c)),
            (None, Some(c)) => Some((b, c)),
            _ => None,
        },
        Op::Div(_) => scalar(g, b).filter(|c| *c != 0.0).map(|c| (a, 1.0 / c)),
        _ => None,
    }
}

/// `x` with the scale of a scaling op producing it that nothing else reads folded out.
fn unscaled(g: &Graph, v: Value, nodes: &mut Vec<NodeId>) -> (Value, f64) {
    match scaled(g, v) {
        Some((x, c)) if lone_reader(g, v).is_some() => {
            nodes.push(v.node);
            (x, c)
        }
        _ => (v, 1.0),
    }
}

/// The softmax `P` is read through: `Where(IsNaN(P), 0, P)`, when that is `P`'s only use
/// (besides the guard's `IsNaN`). Returns the guarded value and the guard's nodes.
fn nan_guard(g: &Graph, p: Value) -> Option<(Value, Vec<NodeId>)> {
    let users = g.users(p);
    if users.len() != 2 || g.is_output(p) {
        return None;
    }
    let isnan = users.iter().find(|(n, _)| matches!(g.node(*n).op, Op::IsNaN(_)))?.0;
    let wh = users.iter().find(|(n, _)| matches!(g.node(*n).op, Op::Where(_)))?.0;
    let w = g.node(wh);
    let cond = Value::new(isnan, 0);
    let zero = w.input(1).and_then(|z| scalar(g, z));
    (w.input(0) == Some(cond) && w.input(2) == Some(p) && zero == Some(0.0) && lone_reader(g, cond) == Some(wh))
        .then(|| (Value::new(wh, 0), vec![wh, isnan]))
}

/// The attention whose product with `V` is node `n`, if it is one.
fn find(g: &Graph, n: NodeId) -> Option<Found> {
    let node = g.node(n);
    if !matches!(node.op, Op::MatMul(_)) {
        return None;
    }
    let (p, v) = (node.input(0)?, node.input(1)?);
    if dims(g, v)?.len() != 4 || lone_reader(g, p)? != n {
        return None;
    }
    let mut nodes = Vec::new();
    // Through the NaN guard, back to the softmax.
    let p0 = match &g.node(p.node).op {
        Op::Where(_) => {
            let x = g.node(p.node).input(2)?;
            let (guarded, guard) = nan_guard(g, x)?;
            (guarded == p).then_some(())?;
            nodes.extend(guard);
            x
        }
        _ => {
            lone_reader(g, p)?;
            p
        }
    };
    let softmax = p0.node;
    let sm = g.node(softmax);
    let Op::Softmax(s) = &sm.op else { return None };
    let sd = dims(g, p0)?;
    if sd.len() != 4 || !matches!(s.axis.unwrap_or(-1), -1 | 3) {
        return None;
    }
    nodes.push(softmax);
    let mut s_in = sm.input(0)?;
    lone_reader(g, s_in)?;
    // The mask.
    let mut mask = None;
    if let Op::Add(_) = g.node(s_in.node).op {
        let add = g.node(s_in.node);
        let (a, b) = (add.input(0)?, add.input(1)?);
        let from_product = |x: Value| {
            let (y, _) = scaled(g, x).unwrap_or((x, 1.0));
            matches!(g.node(y.node).op, Op::MatMul(_)) && dims(g, y).as_ref() == Some(&sd)
        };
        let (scores, m) = if from_product(a) {
            (a, b)
        } else if from_product(b) {
            (b, a)
        } else {
            return None;
        };
        let md = dims(g, m)?;
        let float = g.tensor_type(m).is_some_and(|t| t.dtype.is_float());
        let broadcasts = md.len() <= 4 && md.iter().rev().zip(sd.iter().rev()).all(|(x, y)| *x == 1 || x == y);
        if !float || !broadcasts || lone_reader(g, scores).is_none() {
            return None;
        }
        nodes.push(s_in.node);
        mask = Some(m);
        s_in = scores;
    }
    let (product, post) = unscaled(g, s_in, &mut nodes);
    let mm = g.node(product.node);
    if !matches!(mm.op, Op::MatMul(_)) || lone_reader(g, product).is_none() {
        return None;
    }
    nodes.push(product.node);
    let (a, b) = (mm.input(0)?, mm.input(1)?);
    let (q, ca) = unscaled(g, a, &mut nodes);
    let (kt, cb) = unscaled(g, b, &mut nodes);
    let (qd, kd, vd) = (dims(g, q)?, dims(g, kt)?, dims(g, v)?);
    let lead = |d: &[i64]| d[..2].to_vec();
    if qd.len() != 4 || kd.len() != 4 || lead(&qd) != lead(&kd) || lead(&kd) != lead(&vd) || kd[3] != vd[2] {
        return None;
    }
    let float = |x: Value| g.tensor_type(x).is_some_and(|t| t.dtype.is_float());
    if !(float(q) && float(kt) && float(v)) {
        return None;
    }
    nodes.reverse();
    nodes.push(n);
    Some(Found { nodes, context: n, softmax, q, kt, v, mask, scale: post * ca * cb })
}

/// The key as `[b, h, s, d]` from `kᵀ`: the source of a transpose that swaps the last two
/// dims and that nothing else reads (the transpose is then dropped), else a new transpose.
fn key(g: &mut Graph, kt: Value, label: &str) -> (Value, Option<NodeId>) {
    if let Op::Transpose(t) = &g.node(kt.node).op
        && t.perm.as_deref() == Some(&[0, 1, 3, 2][..])
        && lone_reader(g, kt).is_some()
        && let Some(src) = g.node(kt.node).input(0)
    {
        return (src, Some(kt.node));
    }
    let name = g.fresh_name(&format!("{}_key", g.value_name(kt)));
    let perm = op::Transpose { perm: Some(vec![0, 1, 3, 2]) };
    let t = g.add_labeled_node(
        Some(format!("{label}_key")),
        Op::Transpose(perm),
        vec![Some(kt)],
        vec![Output::named(name)],
    );
    (Value::new(t, 0), None)
}

/// The fused op's label: the softmax's scope with its last part `Attention`.
fn label_of(g: &Graph, softmax: NodeId) -> String {
    let l = g.node(softmax).label.clone().unwrap_or_else(|| g.op_name(softmax));
    match l.rfind('/') {
        Some(i) => format!("{}/Attention", &l[..i]),
        None => "Attention".into(),
    }
}

fn fuse(g: &mut Graph, f: Found) {
    let label = label_of(g, f.softmax);
    let (k, dropped) = key(g, f.kt, &label);
    let out = Value::new(f.context, 0);
    let (name, ty) = (g.value_name(out).to_string(), g.node(f.context).outputs()[0].ty.clone());
    let sd = dims(g, f.q).map(|q| {
        let kt = dims(g, f.kt).unwrap_or_default();
        vec![q[0], q[1], q[2], kt.get(3).copied().unwrap_or(-1)]
    });
    // A causal mask given as a tensor is the op's `is_causal`: no `s × s` mask is made.
    let causal = f.mask.zip(sd).is_some_and(|(m, sd)| is_causal_mask(g, m, &sd));
    let mask = if causal { None } else { f.mask };
    let attention = op::Attention { scale: Some(f.scale as f32), is_causal: causal.then_some(1), ..Default::default() };
    let mut output = Output::named(g.fresh_name(&format!("{name}_fused")));
    output.ty = ty;
    let n = g.add_labeled_node(
        Some(label),
        Op::Attention(attention),
        vec![Some(f.q), Some(k), Some(f.v), mask],
        vec![output],
    );
    let y = Value::new(n, 0);
    g.replace_all_uses(out, y);
    for &m in f.nodes.iter().rev() {
        g.remove_node(m);
    }
    if let Some(t) = dropped {
        g.remove_node(t);
    }
    g.rename(y, name);
}

/// The places [`fuse_attention`] rewrites: each attention's softmax, by label (else op name),
/// in topological order.
pub fn sites(g: &Graph) -> Vec<String> {
    let Ok(order) = g.topo_order() else { return Vec::new() };
    order
        .into_iter()
        .filter_map(|n| find(g, n))
        .map(|f| g.node(f.softmax).label.clone().unwrap_or_else(|| g.op_name(f.softmax)))
        .collect()
}

/// Rewrites every attention of `g` into one `Attention` op; returns how many.
pub fn fuse_attention(g: &mut Graph) -> Result<u64, Located> {
    fuse_attention_where(g, &mut |_| true)
}

/// [`fuse_attention`] at the attentions `pick` accepts (by index in [`sites`]' order).
pub fn fuse_attention_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let found: Vec<Found> = order.into_iter().filter_map(|n| find(g, n)).collect();
    let mut done = 0;
    for (i, f) in found.into_iter().enumerate() {
        if pick(i) {
            fuse(g, f);
            done += 1;
        }
    }
    if done > 0 {
        // The scales' constants.
        crate::canonicalize::eliminate_dead_code(g);
        crate::canonicalize::eliminate_unused_initializers(g);
    }
    Ok(done)
}

/// The `fuse-attention` pass: [`fuse_attention`] on every attention.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseAttention;

impl Pass for FuseAttention {
    fn name(&self) -> &'static str {
        "fuse-attention"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        super::run_rewrite(g, cx, self.name(), "attentions fused", fuse_attention)
    }
}
