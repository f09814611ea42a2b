//! Attention computed block by block, as flash attention and ring attention compute it (the
//! `shardc` domain): `AttentionBlock` and `AttentionGrad`.
//!
//! `AttentionBlock(Q, K, V[, Y, LSE]) → Y', LSE'`: the attention of the queries over one
//! block of keys, merged into a running output `Y` whose rows have seen other keys — the
//! softmax over the union of the keys, kept stable by each row's log-sum-exp `LSE`
//! (`Y' = (e^{LSE−M}·Y + e^{L−M}·Y_b) / (e^{LSE−M} + e^{L−M})`, `LSE' = M + ln(…)`, with `M`
//! the larger of the two and `Y_b`, `L` the block's own). A row none of whose keys it may
//! see keeps what it had (an empty block: `L = −∞`).
//!
//! `AttentionGrad(Q, K, V, dY, Y[, LSE]) → dQ, dK, dV`: the backward of a plain 4-D
//! `Attention` as flash attention's backward computes it — each probability recomputed as
//! `P = e^{S − LSE}` from its row's log-sum-exp over *all* keys (given, or computed here by
//! a pass over these keys), `D = Σ dY ⊙ Y` per row, `dS = P ⊙ (dY·Vᵀ − D)`,
//! `dQ = scale·dS·K`, `dK = scale·dSᵀ·Q`, `dV = Pᵀ·dY`. Given the full rows' `Y` and `LSE`,
//! it is exact on any block of the keys: ring attention's backward sums `dQ` over the blocks
//! and `dK`, `dV` over the query blocks.
//!
//! Both are 4-D: `[batch, heads, positions, head size]`, grouped-query heads (`K`, `V` have
//! `hk` heads dividing `Q`'s `hq`). `q_offset` and `k_offset` place the first query and key
//! in the sequence: a causal mask hides key `k_offset + j` from query `q_offset + i` when
//! `j + k_offset > i + q_offset`.

use super::flow::flow_positional;
use super::{Arity, Arrays, Backward, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::op;
use crate::layout::{DimKind, DimRole, IterDim, IterSpace};
use crate::types::TensorType;

type Result<T> = std::result::Result<T, EvalError>;

/// The shapes of one blockwise attention.
#[derive(Copy, Clone, Debug)]
pub struct Shape {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub hq: usize,
    /// Key and value heads.
    pub hk: usize,
    /// Query positions.
    pub sq: usize,
    /// Key positions.
    pub sk: usize,
    /// Query and key head size.
    pub d: usize,
    /// Value head size.
    pub dv: usize,
}

impl Shape {
    /// From the dims of `Q`, `K`, `V`, or why they do not form a blockwise attention.
    pub fn of(q: &[i64], k: &[i64], v: &[i64]) -> std::result::Result<Shape, String> {
        if q.len() != 4 || k.len() != 4 || v.len() != 4 {
            return Err(format!("blockwise attention needs 4-D Q, K, V; got {q:?}, {k:?}, {v:?}"));
        }
        let u = |x: i64| usize::try_from(x).map_err(|_| format!("unknown dim in {q:?}, {k:?}, {v:?}"));
        let s =
            Shape { b: u(q[0])?, hq: u(q[1])?, hk: u(k[1])?, sq: u(q[2])?, sk: u(k[2])?, d: u(q[3])?, dv: u(v[3])? };
        if k[0] != q[0] || v[0] != q[0] || v[1] != k[1] || v[2] != k[2] || k[3] != q[3] {
            return Err(format!("blockwise attention: Q {q:?}, K {k:?} and V {v:?} do not match"));
        }
        if s.hk == 0 || !s.hq.is_multiple_of(s.hk) {
            return Err(format!("blockwise attention: {} query heads do not group over {} key heads", s.hq, s.hk));
        }
        Ok(s)
    }

    fn rows(&self) -> usize {
        self.b * self.hq * self.sq
    }

    /// The key/value row of query row `(bh, j)`: `bh` = batch·hq + head.
    fn krow(&self, bh: usize, j: usize) -> usize {
        let (bi, h) = (bh / self.hq, bh % self.hq);
        (bi * self.hk + h / (self.hq / self.hk)) * self.sk + j
    }
}

/// The causal mask and the scale of a blockwise attention.
#[derive(Copy, Clone, Debug)]
pub struct Mask {
    /// Whether later keys are hidden.
    pub causal: bool,
    /// The first query's position.
    pub q_offset: i64,
    /// The first key's position.
    pub k_offset: i64,
    /// The scores' scale.
    pub scale: f64,
}

impl Mask {
    fn of(causal: Option<i64>, q_offset: Option<i64>, k_offset: Option<i64>, scale: Option<f32>, d: usize) -> Mask {
        Mask {
            causal: causal.unwrap_or(0) != 0,
            q_offset: q_offset.unwrap_or(0),
            k_offset: k_offset.unwrap_or(0),
            scale: scale.map_or(1.0 / (d.max(1) as f64).sqrt(), f64::from),
        }
    }

    /// The keys `0..n` query `i` may see (all of them without a causal mask).
    pub fn visible(&self, i: usize, sk: usize) -> usize {
        if !self.causal {
            return sk;
        }
        (i as i64 + self.q_offset - self.k_offset + 1).clamp(0, sk as i64) as usize
    }

    /// The fraction of the `sq × sk` scores the mask keeps.
    pub fn kept(&self, sq: usize, sk: usize) -> f64 {
        if sq == 0 || sk == 0 {
            return 0.0;
        }
        (0..sq).map(|i| self.visible(i, sk)).sum::<usize>() as f64 / (sq * sk) as f64
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The attention of each query row over the keys it may see: `(Y [rows, dv], LSE [rows])`
/// (a row that sees none: zeros and −∞).
pub fn block(s: &Shape, m: &Mask, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (mut y, mut lse) = (vec![0.0; s.rows() * s.dv], vec![f64::NEG_INFINITY; s.rows()]);
    let mut sc = vec![0.0; s.sk];
    for r in 0..s.rows() {
        let (bh, i) = (r / s.sq, r % s.sq);
        let n = m.visible(i, s.sk);
        if n == 0 {
            continue;
        }
        let qr = &q[r * s.d..][..s.d];
        for (j, x) in sc[..n].iter_mut().enumerate() {
            *x = m.scale * dot(qr, &k[s.krow(bh, j) * s.d..][..s.d]);
        }
        let mx = sc[..n].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = sc[..n].iter().map(|x| (x - mx).exp()).sum();
        let yr = &mut y[r * s.dv..][..s.dv];
        for (j, x) in sc[..n].iter().enumerate() {
            let p = (x - mx).exp() / sum;
            for (o, vv) in yr.iter_mut().zip(&v[s.krow(bh, j) * s.dv..][..s.dv]) {
                *o += p * vv;
            }
        }
        lse[r] = mx + sum.ln();
    }
    (y, lse)
}

/// Merges a block's `(y2, l2)` into the running `(y1, l1)` (rows of `dv`).
pub fn merge(y1: &mut [f64], l1: &mut [f64], y2: &[f64], l2: &[f64], dv: usize) {
    for r in 0..l1.len() {
        let (a, b) = (l1[r], l2[r]);
        if b == f64::NEG_INFINITY {
            continue;
        }
        if a == f64::NEG_INFINITY {
            y1[r * dv..][..dv].copy_from_slice(&y2[r * dv..][..dv]);
            l1[r] = b;
            continue;
        }
        let mx = a.max(b);
        let (wa, wb) = ((a - mx).exp(), (b - mx).exp());
        for (o, x) in y1[r * dv..][..dv].iter_mut().zip(&y2[r * dv..][..dv]) {
            *o = (wa * *o + wb * x) / (wa + wb);
        }
        l1[r] = mx + (wa + wb).ln();
    }
}

/// The gradients `(dQ, dK, dV)` of a blockwise attention, given every row's output `y` and
/// log-sum-exp `lse` over all its keys.
#[allow(clippy::too_many_arguments)]
pub fn grad(
    s: &Shape,
    m: &Mask,
    (q, k, v): (&[f64], &[f64], &[f64]),
    dy: &[f64],
    y: &[f64],
    lse: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dq, mut dk, mut dvv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for r in 0..s.rows() {
        let (bh, i) = (r / s.sq, r % s.sq);
        let n = m.visible(i, s.sk);
        if n == 0 || lse[r] == f64::NEG_INFINITY {
            continue;
        }
        let (qr, dyr) = (&q[r * s.d..][..s.d], &dy[r * s.dv..][..s.dv]);
        let drow = dot(dyr, &y[r * s.dv..][..s.dv]);
        for j in 0..n {
            let kr = s.krow(bh, j);
            let p = (m.scale * dot(qr, &k[kr * s.d..][..s.d]) - lse[r]).exp();
            let dp = dot(dyr, &v[kr * s.dv..][..s.dv]);
            let ds = p * (dp - drow) * m.scale;
            for (o, x) in dvv[kr * s.dv..][..s.dv].iter_mut().zip(dyr) {
                *o += p * x;
            }
            for e in 0..s.d {
                dq[r * s.d + e] += ds * k[kr * s.d + e];
                dk[kr * s.d + e] += ds * qr[e];
            }
        }
    }
    (dq, dk, dvv)
}

/// Whether attention op `op` (`Attention` or `AttentionGrad`, the ops whose sequence splits as
/// ring attention) is causal, and its scale; `None` for other ops.
pub fn ring_mask(op: &crate::graph::op::Op) -> Option<(bool, Option<f32>)> {
    use crate::graph::op::Op;
    let (causal, scale) = match op {
        Op::Attention(a) => (a.is_causal, a.scale),
        Op::AttentionGrad(a) => (a.is_causal, a.scale),
        _ => return None,
    };
    Some((causal.unwrap_or(0) != 0, scale))
}

/// Zig-zag load balancing of a causal ring of `c` devices holding `rows` positions each: the
/// sequence is cut into `2c` chunks of `rows / 2` and device `d` runs the ring on chunks `d`
/// and `2c − 1 − d` (an early and a late one), so every device computes the same share of
/// the causal blocks. Used where the ring is causal and the rows halve; the lowering
/// (codegen/src/lower/ring.rs) and the cost model read this one decision.
pub fn zigzag(causal: bool, rows: usize, c: usize) -> bool {
    causal && c > 1 && rows >= 2 && rows.is_multiple_of(2)
}

/// The device of the zig-zag ring of `c` devices that computes on chunk `g` of the `2c`.
pub fn zigzag_owner(g: usize, c: usize) -> usize {
    if g < c { g } else { 2 * c - 1 - g }
}

/// The chunks of the `2c` device `d` of a zig-zag ring computes on.
pub fn zigzag_chunks(d: usize, c: usize) -> [usize; 2] {
    [d, 2 * c - 1 - d]
}

/// How many of its two chunks device `d` of a zig-zag ring of `c` sends to another device
/// going in (from its rows `2d`, `2d + 1` to the ring's chunks) and coming back out.
pub fn zigzag_sends(d: usize, c: usize) -> (usize, usize) {
    let into = [2 * d, 2 * d + 1].iter().filter(|&&g| zigzag_owner(g, c) != d).count();
    let out = zigzag_chunks(d, c).iter().filter(|&&g| g / 2 != d).count();
    (into, out)
}

/// The operands `0..n` as `f64`, and the shape.
fn operands(cx: &EvalCx<'_>, n: usize) -> Result<(Shape, Vec<Vec<f64>>)> {
    let (q, k, v) = (cx.req(0)?, cx.req(1)?, cx.req(2)?);
    let dims = |a: &Array| a.shape.iter().map(|&x| x as i64).collect::<Vec<_>>();
    let s = Shape::of(&dims(q), &dims(k), &dims(v)).map_err(EvalError::Invalid)?;
    let xs = (0..n).map(|j| cx.req(j)?.to_f64()).collect::<Result<Vec<_>>>()?;
    Ok((s, xs))
}

/// The shape from static input dims.
fn shape_of(cx: &NodeCx<'_>) -> Option<Shape> {
    Shape::of(&cx.in_dims(0), &cx.in_dims(1), &cx.in_dims(2)).ok()
}

/// Batch and heads (a key/value head with its group of query heads), and — for the gradient
/// — the sequence of the queries, keys and values at once (role [`DimRole::Sequence`]: a
/// split runs as ring attention, ir/src/ops/split.rs).
fn space(cx: &NodeCx<'_>, lse: usize, sequence: bool, outputs: Vec<Vec<Option<usize>>>) -> Option<IterSpace> {
    let s = shape_of(cx)?;
    let sequence = sequence && s.sq == s.sk;
    let par =
        |name: &str, size: usize, role| IterDim { name: name.into(), size: size as i64, kind: DimKind::Parallel, role };
    let mut dims = vec![par("b", s.b, DimRole::Other), par("h", s.hk, DimRole::Other)];
    let seq = sequence.then(|| {
        dims.push(par("s", s.sq, DimRole::Sequence));
        2
    });
    let t4 = Some(vec![Some(0), Some(1), seq, None]);
    let node = cx.g.node(cx.n);
    let ins = (0..node.inputs().len())
        .map(|j| {
            node.input(j).map(|_| if j == lse { vec![Some(0), Some(1), seq] } else { t4.clone().unwrap_or_default() })
        })
        .collect();
    Some(IterSpace { dims, inputs: ins, outputs })
}

impl OpRules for op::AttentionBlock {
    fn matrix_units(&self) -> bool {
        true
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(3, 5, 1, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(q), Some(k), Some(v)) = (cx.dims(0), cx.dims(1), cx.dims(2)) else {
            return Ok(vec![None; cx.n_out]);
        };
        if q.len() != 4 || k.len() != 4 || v.len() != 4 {
            return Err(format!("AttentionBlock needs 4-D Q, K, V; got ranks {}, {}, {}", q.len(), k.len(), v.len()));
        }
        let t = |d| cx.dtype().map(|dt| TensorType::new(dt, d));
        let mut out = vec![t(vec![q[0].clone(), q[1].clone(), q[2].clone(), v[3].clone()]), t(q[..3].to_vec())];
        out.truncate(cx.n_out);
        Ok(out)
    }

    /// Batch and heads.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        space(cx, 4, false, vec![vec![Some(0), Some(1), None, None], vec![Some(0), Some(1), None]])
    }

    /// `QKᵀ` and `PV` over the keys the mask keeps, the softmax, and the merge.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let s = shape_of(cx)?;
        let m = Mask::of(self.is_causal, self.q_offset, self.k_offset, self.scale, s.d);
        let pairs = (s.rows() * s.sk) as f64 * m.kept(s.sq, s.sk);
        let flops = pairs * (2.0 * (s.d + s.dv) as f64 + 5.0) + (s.rows() * s.dv) as f64 * 4.0;
        Some(Work { fwd_flops: flops, backward: Backward::LikeForward, launches: 1.0, parallel: Some(s.rows() as f64) })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (s, x) = operands(cx, 3)?;
        let m = Mask::of(self.is_causal, self.q_offset, self.k_offset, self.scale, s.d);
        let (mut y, mut lse) = block(&s, &m, &x[0], &x[1], &x[2]);
        if let (Some(y0), Some(l0)) = (cx.opt(3), cx.opt(4)) {
            let (mut y0, mut l0) = (y0.to_f64()?, l0.to_f64()?);
            if y0.len() != y.len() || l0.len() != lse.len() {
                return Err(EvalError::Invalid("AttentionBlock: the running Y or LSE does not match Q".into()));
            }
            merge(&mut y0, &mut l0, &y, &lse, s.dv);
            (y, lse) = (y0, l0);
        }
        let dt = cx.req(0)?.dtype;
        let mut out =
            vec![Array::float(dt, vec![s.b, s.hq, s.sq, s.dv], y), Array::float(dt, vec![s.b, s.hq, s.sq], lse)];
        out.truncate(cx.n_out.max(1));
        Ok(out)
    }
}

impl OpRules for op::AttentionGrad {
    fn matrix_units(&self) -> bool {
        true
    }

    fn arity(&self) -> Arity {
        Arity::new(5, 6, 3, 3)
    }

    /// Each gradient follows its operand.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        for s in 0..3 {
            let m = cx.in_m(s)?;
            cx.set(s, m);
        }
        Some(())
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        if [0, 1, 2, 3, 4].iter().any(|&j| cx.dims(j).is_some_and(|d| d.len() != 4)) {
            return Err("AttentionGrad needs 4-D Q, K, V, dY and Y".into());
        }
        Ok(vec![cx.input(0).cloned(), cx.input(1).cloned(), cx.input(2).cloned()])
    }

    fn sharded(&self) -> Sharded {
        Sharded::Ring
    }

    /// Batch, heads and the sequence (ring attention's backward when it splits).
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let t4 = vec![Some(0), Some(1), shape_of(cx).filter(|s| s.sq == s.sk).map(|_| 2), None];
        space(cx, 5, true, vec![t4.clone(), t4.clone(), t4])
    }

    /// Flash attention's backward over the keys the mask keeps: `QKᵀ` again, `dY·Vᵀ`, `Pᵀ·dY`,
    /// `dS·K` and `dSᵀ·Q` — and `QKᵀ` once more for the log-sum-exp when it is not given.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let s = shape_of(cx)?;
        let m = Mask::of(self.is_causal, self.q_offset, self.k_offset, self.scale, s.d);
        let pairs = (s.rows() * s.sk) as f64 * m.kept(s.sq, s.sk);
        let given = cx.g.node(cx.n).input(5).is_some();
        let qk = 2.0 * s.d as f64 * if given { 3.0 } else { 4.0 };
        let flops = pairs * (qk + 4.0 * s.dv as f64 + 8.0) + (s.rows() * s.dv) as f64 * 2.0;
        Some(Work { fwd_flops: flops, backward: Backward::LikeForward, launches: 1.0, parallel: Some(s.rows() as f64) })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (s, x) = operands(cx, 5)?;
        let m = Mask::of(self.is_causal, self.q_offset, self.k_offset, self.scale, s.d);
        if x[3].len() != s.rows() * s.dv || x[4].len() != s.rows() * s.dv {
            return Err(EvalError::Invalid("AttentionGrad: dY or Y does not match Q and V".into()));
        }
        let lse = match cx.opt(5) {
            Some(l) => l.to_f64()?,
            None => block(&s, &m, &x[0], &x[1], &x[2]).1,
        };
        if lse.len() != s.rows() {
            return Err(EvalError::Invalid("AttentionGrad: LSE does not match Q".into()));
        }
        let (dq, dk, dv) = grad(&s, &m, (&x[0], &x[1], &x[2]), &x[3], &x[4], &lse);
        let dt = |j: usize| cx.req(j).map(|a| a.dtype);
        Ok(vec![
            Array::float(dt(0)?, vec![s.b, s.hq, s.sq, s.d], dq),
            Array::float(dt(1)?, vec![s.b, s.hk, s.sk, s.d], dk),
            Array::float(dt(2)?, vec![s.b, s.hk, s.sk, s.dv], dv),
        ])
    }
}
