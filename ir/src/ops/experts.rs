//! The experts of a sparse mixture-of-experts layer: `MoE` and its gradient `MoEGrad` (the
//! `shardc` domain; ONNX has no such op — `fuse-experts` makes it from the exporters' gathered
//! batched products, passes/src/algebra/experts.rs).
//!
//! `MoE(X [T, H], ids [T, k], w [T, k], W1 [E, 2I, H], W2 [E, H, I]) → Y [T, H]`:
//! `Y[t] = Σⱼ w[t, j] · W2[e] · (silu(g) ⊙ u)` with `[g; u] = W1[e] · X[t]` and `e = ids[t, j]`
//! — every token through the SiLU-gated MLPs of the `k` experts its router chose, weighted by
//! the router's weights and summed (Mixtral, Qwen-MoE, DeepSeek-MoE, OLMoE). The router (its
//! GEMM, softmax and top-k) stays ordinary ops before it.
//!
//! A pair whose id lies outside `0..E` adds nothing. That is what an expert split needs: the
//! op splits over the experts (`e`, [`DimRole::Expert`]), each device holding `E/p` of them
//! and reading every id shifted by its first expert (the lowering's `SplitMode::Experts`), so
//! that it computes exactly the pairs routed to its experts and its output is a partial sum —
//! Megatron-core's all-gather token dispatcher: tokens gathered over the expert axis before,
//! the partial outputs reduced (or reduce-scattered back to the tokens' split) after. The
//! tokens (`t`) split as any batch does.

use super::grad::GradCx;
use super::{Arity, Arrays, Backward, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace};
use crate::types::Dim;

type Result<T> = std::result::Result<T, EvalError>;

/// The experts' dim: a reduction over the experts (a split leaves partial sums).
fn experts(size: i64) -> IterDim {
    IterDim { name: "e".into(), size, kind: DimKind::Reduction, role: DimRole::Expert }
}

/// The tokens' dim.
fn tokens(size: i64, kind: DimKind) -> IterDim {
    IterDim { name: "t".into(), size, kind, role: DimRole::Other }
}

/// The all-to-all dispatcher's dim, when the op asks for it (a `capacity_factor`): tokens and
/// experts at once ([`DimRole::Dispatch`]); its size divides both, so a split of it divides
/// both evenly.
fn dispatch(factor: Option<f32>, t: i64, e: i64) -> Option<IterDim> {
    fn gcd(a: i64, b: i64) -> i64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    factor.map(|_| IterDim { name: "x".into(), size: gcd(t, e), kind: DimKind::Parallel, role: DimRole::Dispatch })
}

/// The rows per device of the all-to-all dispatcher's buffers: each of `parts` devices holds
/// `experts / parts` experts and `tokens` tokens routing `k` pairs each. Dropless (`factor`
/// 0): every pair that can reach one device — `tokens · min(k, experts / parts)` (a token's
/// `k` experts are distinct); else `factor` times an even share, `⌈factor · tokens · k /
/// parts⌉`, at most that. The lowering sizes its buffers and the cost model its all-to-alls
/// by this one function.
pub fn dispatch_capacity(tokens: usize, k: usize, experts: usize, parts: usize, factor: f32) -> usize {
    let per = experts / parts.max(1);
    let dropless = tokens * k.min(per);
    if factor <= 0.0 {
        return dropless;
    }
    let share = (f64::from(factor) * (tokens * k) as f64 / parts.max(1) as f64).ceil() as usize;
    share.clamp(1, dropless.max(1))
}

/// The sizes `(T, k, H, E, I)` of an `MoE` (or `MoEGrad`, from `x` on) whose token, id and
/// weight operands are at `x`, `x + 1`, `x + 2` and expert weights at `x + 3`, `x + 4`.
fn sizes(d: &dyn Fn(usize) -> Vec<i64>, x: usize) -> Option<(i64, i64, i64, i64, i64)> {
    let (xd, ids, w1, w2) = (d(x), d(x + 1), d(x + 3), d(x + 4));
    match (&xd[..], &ids[..], &w1[..], &w2[..]) {
        ([t, h], [t2, k], [e, i2, h1], [e2, h2, i]) if t == t2 && e == e2 && h == h1 && h == h2 && *i2 == 2 * i => {
            Some((*t, *k, *h, *e, *i))
        }
        _ => None,
    }
}

/// Checks the operands' shapes for inference: `(T, k, H, E, I)` when all are known.
fn check_shapes(cx: &InferCx<'_>, x: usize, what: &str) -> std::result::Result<Option<Vec<Dim>>, String> {
    let (Some(xd), Some(ids), Some(w), Some(w1), Some(w2)) =
        (cx.dims(x), cx.dims(x + 1), cx.dims(x + 2), cx.dims(x + 3), cx.dims(x + 4))
    else {
        return Ok(None);
    };
    if xd.len() != 2 || ids.len() != 2 || w.len() != 2 || w1.len() != 3 || w2.len() != 3 {
        return Err(format!(
            "{what} needs X [T, H], ids and weights [T, k], W1 [E, 2I, H] and W2 [E, H, I]; got ranks {}, {}, {}, {}, {}",
            xd.len(),
            ids.len(),
            w.len(),
            w1.len(),
            w2.len()
        ));
    }
    let known = |a: &Dim, b: &Dim| a.value().zip(b.value()).is_none_or(|(a, b)| a == b);
    let twice = w1[1].value().zip(w2[2].value()).is_none_or(|(a, b)| a == 2 * b);
    if !known(&xd[0], &ids[0]) || !known(&ids[0], &w[0]) || !known(&ids[1], &w[1]) || !known(&w1[0], &w2[0]) {
        return Err(format!("{what}: the tokens, their ids and weights, or the experts of W1 and W2 disagree"));
    }
    if !known(&xd[1], &w1[2]) || !known(&xd[1], &w2[1]) || !twice {
        return Err(format!("{what}: W1 must be [E, 2I, H] and W2 [E, H, I] for X [T, H]"));
    }
    Ok(Some(xd.clone()))
}

/// `x·σ(x)` and its derivative.
fn silu(x: f64) -> (f64, f64) {
    let s = 1.0 / (1.0 + (-x).exp());
    (x * s, s * (1.0 + x * (1.0 - s)))
}

fn not_silu(a: &Option<String>) -> bool {
    a.as_deref().is_some_and(|a| a != "silu")
}

/// The operands as f64 with their sizes, from input `x` on.
struct Operands {
    x: Vec<f64>,
    ids: Vec<i64>,
    w: Vec<f64>,
    w1: Vec<f64>,
    w2: Vec<f64>,
    t: usize,
    k: usize,
    h: usize,
    e: usize,
    i: usize,
}

fn operands(cx: &EvalCx<'_>, x: usize, what: &str) -> Result<Operands> {
    let shape = |j: usize| cx.req(j).map(|a| a.shape.iter().map(|&d| d as i64).collect::<Vec<i64>>());
    let dims = [shape(x)?, shape(x + 1)?, shape(x + 2)?, shape(x + 3)?, shape(x + 4)?];
    let d = |j: usize| dims[j - x].clone();
    let (t, k, h, e, i) = sizes(&d, x).ok_or_else(|| EvalError::Invalid(format!("{what}: operand shapes {dims:?}")))?;
    if dims[2] != [t, k] {
        return Err(EvalError::Invalid(format!("{what}: weights {:?} for ids [{t}, {k}]", dims[2])));
    }
    Ok(Operands {
        x: cx.req(x)?.to_f64()?,
        ids: cx.req(x + 1)?.to_i64()?,
        w: cx.req(x + 2)?.to_f64()?,
        w1: cx.req(x + 3)?.to_f64()?,
        w2: cx.req(x + 4)?.to_f64()?,
        t: t as usize,
        k: k as usize,
        h: h as usize,
        e: e as usize,
        i: i as usize,
    })
}

impl Operands {
    /// The expert of pair `(t, j)`, when its id is in range.
    fn expert(&self, t: usize, j: usize) -> Option<usize> {
        usize::try_from(self.ids[t * self.k + j]).ok().filter(|&e| e < self.e)
    }

    /// `W1[e]·X[t]`, split into the gate and the up halves.
    fn gate_up(&self, e: usize, t: usize) -> (Vec<f64>, Vec<f64>) {
        let (h, i) = (self.h, self.i);
        let xt = &self.x[t * h..(t + 1) * h];
        let row = |r: usize| -> f64 {
            let w = &self.w1[(e * 2 * i + r) * h..(e * 2 * i + r + 1) * h];
            w.iter().zip(xt).map(|(a, b)| a * b).sum()
        };
        ((0..i).map(row).collect(), (i..2 * i).map(row).collect())
    }

    /// `W2[e]·a`.
    fn down(&self, e: usize, a: &[f64]) -> Vec<f64> {
        let (h, i) = (self.h, self.i);
        (0..h).map(|r| self.w2[(e * h + r) * i..(e * h + r + 1) * i].iter().zip(a).map(|(p, q)| p * q).sum()).collect()
    }
}

impl OpRules for op::MoE {
    fn matrix_units(&self) -> bool {
        true
    }

    fn arity(&self) -> Arity {
        Arity::fixed(5)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        if not_silu(&self.activation) {
            return Err(format!("MoE: activation `{}` is not supported (silu)", self.activation()));
        }
        let y = check_shapes(cx, 0, "MoE")?;
        cx.one(y)
    }

    fn sharded(&self) -> Sharded {
        Sharded::Experts
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (t, _, _, e, _) = sizes(&|j| cx.in_dims(j), 0)?;
        Some(IterSpace {
            dims: [tokens(t, DimKind::Parallel), experts(e)]
                .into_iter()
                .chain(dispatch(self.capacity_factor, t, e))
                .collect(),
            inputs: vec![
                Some(vec![Some(0), None]),
                Some(vec![Some(0), None]),
                Some(vec![Some(0), None]),
                Some(vec![Some(1), None, None]),
                Some(vec![Some(1), None, None]),
            ],
            outputs: vec![vec![Some(0), None]],
        })
    }

    /// Per routed pair: the gate-and-up product `2·2I·H`, the down product `2·H·I`, the gate
    /// `≈ 6·I` and the weighted sum `2·H`. The backward recomputes both products (it keeps no
    /// `[T·k, I]` intermediate) and runs four more of their sizes — the data and weight
    /// gradients of each — plus the routing weights' gradient: 3 times the forward's products.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let (t, k, h, _, i) = sizes(&|j| cx.in_dims(j), 0)?;
        let pairs = (t * k) as f64;
        let fwd = pairs * (6.0 * (i * h) as f64 + 6.0 * i as f64 + 2.0 * h as f64);
        Some(Work { fwd_flops: fwd, backward: Backward::Times(3.0), launches: 1.0, parallel: None })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let o = operands(cx, 0, "MoE")?;
        let mut y = vec![0.0; o.t * o.h];
        for t in 0..o.t {
            for j in 0..o.k {
                let Some(e) = o.expert(t, j) else { continue };
                let (g, u) = o.gate_up(e, t);
                let a: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu(g).0 * u).collect();
                let wt = o.w[t * o.k + j];
                for (yr, d) in y[t * o.h..(t + 1) * o.h].iter_mut().zip(o.down(e, &a)) {
                    *yr += wt * d;
                }
            }
        }
        Ok(vec![Array::float(cx.req(0)?.dtype, vec![o.t, o.h], y)])
    }

    fn differentiates(&self, i: usize) -> bool {
        i != 1
    }

    fn grad_kernel(&self) -> Option<&'static str> {
        Some("MoEGrad")
    }

    /// `MoEGrad(dY, X, ids, w, W1, W2) → dX, dw, dW1, dW2`.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let ins: Vec<Option<Value>> =
                std::iter::once(Some(dy)).chain((0..5).map(|i| cx.x(i).ok())).collect::<Vec<_>>();
            let op =
                Op::MoEGrad(op::MoEGrad { activation: self.activation.clone(), capacity_factor: self.capacity_factor });
            let d = cx.add(op, &ins, 4)?;
            for (i, slot) in [(0, 0), (2, 1), (3, 2), (4, 3)] {
                if cx.want(i) {
                    cx.set(i, d[slot]);
                }
            }
            Ok(())
        })())
    }

    /// The tokens flow from `X` to `Y`.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let m = cx.in_m(0)?;
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::MoEGrad {
    fn matrix_units(&self) -> bool {
        true
    }

    fn arity(&self) -> Arity {
        Arity::new(6, 6, 4, 4)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        if not_silu(&self.activation) {
            return Err(format!("MoEGrad: activation `{}` is not supported (silu)", self.activation()));
        }
        check_shapes(cx, 1, "MoEGrad")?;
        Ok(vec![cx.input(1).cloned(), cx.input(3).cloned(), cx.input(4).cloned(), cx.input(5).cloned()])
    }

    fn sharded(&self) -> Sharded {
        Sharded::Experts
    }

    /// Tokens `t` (the expert weights' gradients sum over them) and experts `e` (the tokens'
    /// and routing weights' gradients sum over them).
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (t, _, _, e, _) = sizes(&|j| cx.in_dims(j), 1)?;
        let tok = Some(vec![Some(0), None]);
        let exp = Some(vec![Some(1), None, None]);
        Some(IterSpace {
            dims: [tokens(t, DimKind::Reduction), experts(e)]
                .into_iter()
                .chain(dispatch(self.capacity_factor, t, e))
                .collect(),
            inputs: vec![tok.clone(), tok.clone(), tok.clone(), tok, exp.clone(), exp],
            outputs: vec![
                vec![Some(0), None],
                vec![Some(0), None],
                vec![Some(1), None, None],
                vec![Some(1), None, None],
            ],
        })
    }

    /// The forward's products again and four more (see `MoE`'s work).
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let (t, k, h, _, i) = sizes(&|j| cx.in_dims(j), 1)?;
        let pairs = (t * k) as f64;
        Work::flops(pairs * (18.0 * (i * h) as f64 + 12.0 * i as f64 + 4.0 * h as f64))
    }

    /// Per routed pair `(t, j)` of expert `e`: `[g; u] = W1[e]·X[t]`, `a = silu(g)·u`,
    /// `o = W2[e]·a`; `dw = dY[t]·o`, `do = w·dY[t]`, `dW2[e] += do ⊗ a`, `da = W2[e]ᵀ·do`,
    /// `dg = da·u·silu'(g)`, `du = da·silu(g)`, `dW1[e] += [dg; du] ⊗ X[t]`,
    /// `dX[t] += W1[e]ᵀ·[dg; du]`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let o = operands(cx, 1, "MoEGrad")?;
        let dy = cx.req(0)?.to_f64()?;
        if dy.len() != o.t * o.h {
            return Err(EvalError::Invalid(format!("MoEGrad: dY of {} elements for [{}, {}]", dy.len(), o.t, o.h)));
        }
        let (h, i) = (o.h, o.i);
        let (mut dx, mut dw) = (vec![0.0; o.t * h], vec![0.0; o.t * o.k]);
        let (mut dw1, mut dw2) = (vec![0.0; o.w1.len()], vec![0.0; o.w2.len()]);
        for t in 0..o.t {
            let dyt = &dy[t * h..(t + 1) * h];
            for j in 0..o.k {
                let Some(e) = o.expert(t, j) else { continue };
                let (g, u) = o.gate_up(e, t);
                let act: Vec<(f64, f64)> = g.iter().map(|&g| silu(g)).collect();
                let a: Vec<f64> = act.iter().zip(&u).map(|(s, u)| s.0 * u).collect();
                let out = o.down(e, &a);
                dw[t * o.k + j] = dyt.iter().zip(&out).map(|(p, q)| p * q).sum();
                let wt = o.w[t * o.k + j];
                let mut da = vec![0.0; i];
                for r in 0..h {
                    let dor = wt * dyt[r];
                    let base = (e * h + r) * i;
                    for c in 0..i {
                        dw2[base + c] += dor * a[c];
                        da[c] += o.w2[base + c] * dor;
                    }
                }
                let dgu: Vec<f64> = (0..2 * i)
                    .map(|r| if r < i { da[r] * u[r] * act[r].1 } else { da[r - i] * act[r - i].0 })
                    .collect();
                let xt = &o.x[t * h..(t + 1) * h];
                for (r, &d) in dgu.iter().enumerate() {
                    let base = (e * 2 * i + r) * h;
                    for c in 0..h {
                        dw1[base + c] += d * xt[c];
                        dx[t * h + c] += o.w1[base + c] * d;
                    }
                }
            }
        }
        let f = |j: usize| cx.req(j).map(|a| a.dtype);
        Ok(vec![
            Array::float(f(1)?, vec![o.t, h], dx),
            Array::float(f(3)?, vec![o.t, o.k], dw),
            Array::float(f(4)?, vec![o.e, 2 * i, h], dw1),
            Array::float(f(5)?, vec![o.e, h, i], dw2),
        ])
    }

    /// The tokens flow from `X` to `dX` and from the weights to `dw`.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (x, w) = (cx.in_m(1)?, cx.in_m(3)?);
        let (w1, w2) = (cx.in_m(4)?, cx.in_m(5)?);
        cx.set(0, x);
        cx.set(1, w);
        cx.set(2, w1);
        cx.set(3, w2);
        Some(())
    }
}

impl OpRules for op::MoERoute {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 2, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (c, p) = (self.capacity.unwrap_or(0), self.parts.unwrap_or(0));
        if c < 1 || p < 1 || self.experts.unwrap_or(0) < 1 {
            return Err("MoERoute needs capacity, experts and parts of at least 1".into());
        }
        let Some(ids) = cx.dims(0) else { return Ok(vec![None, None]) };
        if ids.len() != 2 {
            return Err(format!("MoERoute needs ids [T, k]; got rank {}", ids.len()));
        }
        let i64t = |d: Vec<Dim>| Some(crate::types::TensorType::new(crate::types::DType::Int64, d));
        Ok(vec![i64t(ids.clone()), i64t(vec![Dim::Fixed(p * c), Dim::Fixed(1)])])
    }

    /// Whole: a pair's row depends on the pairs before it.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    /// A count per pair.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.in_dims(0).iter().product::<i64>() as f64)
    }

    /// Pairs in order, each to the next free row of its expert's block.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let a = cx.req(0)?;
        let ids = a.to_i64()?;
        let (c, per, p) = (self.capacity.unwrap_or(0), self.experts.unwrap_or(0), self.parts.unwrap_or(0));
        let (c, per, p) = (c.max(0) as usize, per.max(1) as usize, p.max(0) as usize);
        let mut used = vec![0usize; p];
        let mut local = vec![-1i64; p * c];
        let mut pos = Vec::with_capacity(ids.len());
        for &e in &ids {
            let d = usize::try_from(e).ok().map(|e| e / per).filter(|&d| d < p).ok_or_else(|| {
                EvalError::Invalid(format!("MoERoute: expert {e} is outside the {} experts", per * p))
            })?;
            if used[d] == c {
                return Err(EvalError::Invalid(format!(
                    "MoERoute: more than {c} routed pairs for the experts of device {d} (the all-to-all dispatcher's capacity; raise the capacity factor, or 0 for dropless buffers)"
                )));
            }
            let row = d * c + used[d];
            local[row] = (e as usize % per) as i64;
            pos.push(row as i64);
            used[d] += 1;
        }
        Ok(vec![Array::i64(a.shape.clone(), pos), Array::i64(vec![p * c, 1], local)])
    }
}

/// The all-to-all dispatcher's mode for a mixture (or its gradient) `n` whose dispatch dim
/// `x` strategy `s` splits: over one mesh axis, the experts not split otherwise, the tokens
/// dividing evenly over every axis that splits them.
pub(crate) fn dispatch_mode(
    g: &crate::graph::Graph,
    n: crate::graph::NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    mesh: &crate::layout::Mesh,
    x: usize,
) -> std::result::Result<super::split::SplitMode, String> {
    let node = g.node(n);
    let (ids_slot, factor) = match &node.op {
        Op::MoE(m) => (1, m.capacity_factor),
        Op::MoEGrad(m) => (2, m.capacity_factor),
        _ => return Err("not a mixture of experts".into()),
    };
    let size = |a: usize| mesh.axes.get(a).map_or(1, |m| m.size);
    let on = |i: usize| -> Vec<usize> { (0..s.len()).filter(|&a| s[a] == Some(i) && size(a) > 1).collect() };
    let axis = match on(x)[..] {
        [a] => a,
        _ => return Err("the all-to-all dispatcher runs over one mesh axis".into()),
    };
    let dim = |role: DimRole| sp.dims.iter().position(|d| d.role == role);
    if dim(DimRole::Expert).is_some_and(|e| !on(e).is_empty()) {
        return Err("the all-to-all dispatcher places the experts itself; they split no further".into());
    }
    let ids = node.input(ids_slot).and_then(|v| g.tensor_type(v)).and_then(|t| t.static_dims());
    let (Some(ids), Some(e)) = (ids, dim(DimRole::Expert).map(|e| sp.dims[e].size)) else {
        return Err("a mixture of experts of unknown sizes".into());
    };
    let (t, k) = match ids[..] {
        [t, k] if t > 0 && k > 0 => (t as usize, k as usize),
        _ => return Err("a mixture of experts whose ids are not [T, k]".into()),
    };
    let token_ways: usize =
        sp.dims.iter().position(|d| d.name == "t").map_or(vec![], on).iter().chain(&[axis]).map(|&a| size(a)).product();
    let p = size(axis);
    if !t.is_multiple_of(token_ways) || !(e as usize).is_multiple_of(p) {
        return Err(format!(
            "{t} tokens and {e} experts do not divide over the dispatcher's {token_ways} and {p} devices"
        ));
    }
    let capacity = dispatch_capacity(t / token_ways, k, e as usize, p, factor.unwrap_or(0.0));
    Ok(super::split::SplitMode::Dispatch { axis, capacity })
}

/// The capacity factor the mixtures of experts of `g` ask the all-to-all dispatcher for, if
/// any does.
pub fn capacity_of(g: &crate::graph::Graph) -> Option<f32> {
    g.node_ids().find_map(|n| match &g.node(n).op {
        Op::MoE(m) => m.capacity_factor,
        Op::MoEGrad(m) => m.capacity_factor,
        _ => None,
    })
}

/// Asks every mixture of experts in `g` (and its gradient) for the all-to-all token
/// dispatcher with buffers of `factor` times an even share of the pairs (0: dropless); the
/// count of mixtures. A negative or non-finite factor is refused.
pub fn set_capacity(g: &mut crate::graph::Graph, factor: f32) -> std::result::Result<usize, String> {
    if !factor.is_finite() || factor < 0.0 {
        return Err(format!("capacity factor {factor}: give a number ≥ 0 (0: dropless buffers)"));
    }
    let ids: Vec<_> = g.node_ids().collect();
    let mut count = 0;
    for n in ids {
        let op = match &g.node(n).op {
            Op::MoE(m) => Op::MoE(op::MoE { capacity_factor: Some(factor), ..m.clone() }),
            Op::MoEGrad(m) => Op::MoEGrad(op::MoEGrad { capacity_factor: Some(factor), ..m.clone() }),
            _ => continue,
        };
        count += usize::from(matches!(op, Op::MoE(_)));
        g.set_op(n, op);
    }
    Ok(count)
}

/// The rows `pos [T, k]` names, checked against `rows` (−1 would be no row; MoERoute gives
/// none).
fn positions(cx: &EvalCx<'_>, j: usize, rows: usize, what: &str) -> Result<(Vec<usize>, usize, usize)> {
    let a = cx.req(j)?;
    let [t, k] = a.shape[..] else {
        return Err(EvalError::Invalid(format!("{what}: positions of shape {:?}, not [T, k]", a.shape)));
    };
    let pos = a.to_i64()?;
    let pos: Vec<usize> = pos
        .iter()
        .map(|&r| usize::try_from(r).ok().filter(|&r| r < rows))
        .collect::<Option<_>>()
        .ok_or_else(|| EvalError::Invalid(format!("{what}: a position outside the {rows} rows")))?;
    Ok((pos, t, k))
}

/// The dispatcher's moves: one per routed pair (positions `[T, k]`, input 1) and element of a
/// row of `width`.
fn row_moves(cx: &NodeCx<'_>, width: i64) -> Option<Work> {
    Work::flops((cx.in_dims(1).iter().product::<i64>() * width) as f64)
}

impl OpRules for op::MoEDispatch {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    /// Whole: the lowering places it on one device's pieces.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        row_moves(cx, if self.per_pair.unwrap_or(0) != 0 { 1 } else { cx.in_dims(0).get(1).copied().unwrap_or(1) })
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let rows = self.rows.unwrap_or(0);
        if rows < 1 {
            return Err("MoEDispatch needs rows of at least 1".into());
        }
        let Some(x) = cx.dims(0) else { return Ok(vec![None]) };
        let w = if self.per_pair.unwrap_or(0) != 0 { Dim::Fixed(1) } else { x.get(1).cloned().unwrap_or(Dim::Unknown) };
        Ok(vec![cx.dtype().map(|dt| crate::types::TensorType::new(dt, vec![Dim::Fixed(rows), w]))])
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let rows = self.rows.unwrap_or(0).max(0) as usize;
        let x = cx.req(0)?;
        let (pos, t, k) = positions(cx, 1, rows, "MoEDispatch")?;
        let per_pair = self.per_pair.unwrap_or(0) != 0;
        let w = if per_pair { 1 } else { x.shape.get(1).copied().unwrap_or(0) };
        let xv = x.to_f64()?;
        if xv.len() != t * if per_pair { k } else { w } {
            return Err(EvalError::Invalid(format!("MoEDispatch: X {:?} for positions [{t}, {k}]", x.shape)));
        }
        let mut b = vec![0.0; rows * w];
        for (i, &r) in pos.iter().enumerate() {
            let src = if per_pair { &xv[i..i + 1] } else { &xv[(i / k) * w..(i / k + 1) * w] };
            b[r * w..(r + 1) * w].copy_from_slice(src);
        }
        Ok(vec![Array::float(x.dtype, vec![rows, w], b)])
    }
}

impl OpRules for op::MoECombine {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    /// Whole: the lowering places it on one device's pieces.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        row_moves(cx, cx.in_dims(0).get(1).copied().unwrap_or(1))
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(b), Some(pos)) = (cx.dims(0), cx.dims(1)) else { return Ok(vec![None]) };
        let (Some(t), Some(k)) = (pos.first(), pos.get(1)) else {
            return Err("MoECombine needs positions [T, k]".into());
        };
        let w = if self.per_pair.unwrap_or(0) != 0 { k.clone() } else { b.get(1).cloned().unwrap_or(Dim::Unknown) };
        Ok(vec![cx.dtype().map(|dt| crate::types::TensorType::new(dt, vec![t.clone(), w]))])
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let b = cx.req(0)?;
        let [rows, w] = b.shape[..] else {
            return Err(EvalError::Invalid(format!("MoECombine: rows of shape {:?}, not [R, w]", b.shape)));
        };
        let (pos, t, k) = positions(cx, 1, rows, "MoECombine")?;
        let bv = b.to_f64()?;
        if self.per_pair.unwrap_or(0) != 0 {
            let y: Vec<f64> = pos.iter().map(|&r| bv[r * w]).collect();
            return Ok(vec![Array::float(b.dtype, vec![t, k], y)]);
        }
        let mut y = vec![0.0; t * w];
        for (i, &r) in pos.iter().enumerate() {
            for (yc, bc) in y[(i / k) * w..(i / k + 1) * w].iter_mut().zip(&bv[r * w..(r + 1) * w]) {
                *yc += bc;
            }
        }
        Ok(vec![Array::float(b.dtype, vec![t, w], y)])
    }
}
