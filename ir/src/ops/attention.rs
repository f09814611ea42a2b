//! The transformer ops of the ONNX standard: `Attention` (scaled dot-product attention with
//! masks, causal and sliding windows, grouped-query heads, a key/value cache and soft-capping)
//! and `RotaryEmbedding`.
//!
//! Both run whole on one device (their pieces would need the heads or the sequence kept
//! together; an exported model's attention as separate MatMul/Softmax ops splits by heads).

use super::flow::flow_positional;
use super::grad::GradCx;
use super::shape::no_work_whole;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::Value;
use crate::array::{Array, EvalError};
use crate::graph::op::{self, Op};
use crate::layout::IterSpace;
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// The flat position of `[batch, seq, head, feature]` in a tensor's own layout.
type FlatIndex = Box<dyn Fn(usize, usize, usize, usize) -> usize>;

fn dim_div(d: &Dim, k: i64) -> Dim {
    match d {
        Dim::Fixed(v) if k > 0 && v % k == 0 => Dim::Fixed(v / k),
        _ => Dim::Unknown,
    }
}

fn dim_add(a: &Dim, b: &Dim) -> Dim {
    match (a, b) {
        (Dim::Fixed(x), Dim::Fixed(y)) => Dim::Fixed(x + y),
        _ => Dim::Unknown,
    }
}

impl OpRules for op::Attention {
    fn matrix_units(&self) -> bool {
        true
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(3, 7, 1, 4)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(q), Some(k), Some(v)) = (cx.dims(0), cx.dims(1), cx.dims(2)) else {
            return Ok(vec![None; cx.n_out]);
        };
        let dtype = cx.dtype();
        let rank = q.len();
        if k.len() != rank || v.len() != rank || !(rank == 3 || rank == 4) {
            return Err(format!(
                "Attention needs Q, K and V all of rank 3 or all of rank 4, got {rank}, {}, {}",
                k.len(),
                v.len()
            ));
        }
        // As [batch, heads, seq, head size].
        let (qh, kvh, q4, k4, v4) = if rank == 4 {
            (q[1].clone(), k[1].clone(), q.clone(), k.clone(), v.clone())
        } else {
            let (qn, kn) = (
                self.q_num_heads.ok_or("3-D Attention needs q_num_heads")?,
                self.kv_num_heads.ok_or("3-D Attention needs kv_num_heads")?,
            );
            (
                Dim::Fixed(qn),
                Dim::Fixed(kn),
                vec![q[0].clone(), Dim::Fixed(qn), q[1].clone(), dim_div(&q[2], qn)],
                vec![k[0].clone(), Dim::Fixed(kn), k[1].clone(), dim_div(&k[2], kn)],
                vec![v[0].clone(), Dim::Fixed(kn), v[1].clone(), dim_div(&v[2], kn)],
            )
        };
        let past = cx.dims(4).and_then(|p| p.get(2).cloned()).unwrap_or(Dim::Fixed(0));
        let total = if cx.has(4) { dim_add(&past, &k4[2]) } else { k4[2].clone() };
        let y = if rank == 4 {
            vec![q4[0].clone(), qh.clone(), q4[2].clone(), v4[3].clone()]
        } else {
            let hidden = match (&qh, &v4[3]) {
                (Dim::Fixed(a), Dim::Fixed(b)) => Dim::Fixed(a * b),
                _ => Dim::Unknown,
            };
            vec![q[0].clone(), q[1].clone(), hidden]
        };
        let t = |d: Vec<Dim>| dtype.map(|dt| TensorType::new(dt, d));
        let mut out = vec![
            t(y),
            t(vec![k4[0].clone(), kvh.clone(), total.clone(), k4[3].clone()]),
            t(vec![v4[0].clone(), kvh, total.clone(), v4[3].clone()]),
            t(vec![q4[0].clone(), qh, q4[2].clone(), total]),
        ];
        out.truncate(cx.n_out);
        Ok(out)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(attention_space(self, cx))
    }

    /// QKᵀ and PV: 2·b·h·q·kv·(d + dv), and the softmax over the scores — of the scores a
    /// causal mask keeps only (a query row attends to the keys up to its own position, after
    /// the cache: `q·past + q(q+1)/2` of `q·kv`; flash kernels skip the blocks above the
    /// diagonal, as the runtime's kernel skips the keys). The backward recomputes the scores
    /// and probabilities (the op keeps none of them) and runs four products of the forward's
    /// size: 2.5 times the forward's work.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let q = cx.in_dims(0);
        let y = cx.out_dims(0);
        let total =
            cx.out_dims(1).get(2).copied().or_else(|| cx.in_dims(1).get(if q.len() == 4 { 2 } else { 1 }).copied())?;
        let rows = if q.len() == 4 { q[0] * q[1] * q[2] } else { q[0] * q[1] * self.q_num_heads.unwrap_or(1) };
        let d = *q.last()? / if q.len() == 3 { self.q_num_heads.unwrap_or(1).max(1) } else { 1 };
        let dv = *y.last()? / if q.len() == 3 { self.q_num_heads.unwrap_or(1).max(1) } else { 1 };
        let sq = if q.len() == 4 { q[2] } else { q[1] };
        let kept = if self.is_causal.unwrap_or(0) != 0 && sq > 0 && total >= sq {
            let past = (total - sq) as f64;
            let sq = sq as f64;
            (sq * past + sq * (sq + 1.0) / 2.0) / (sq * total as f64)
        } else {
            1.0
        };
        let fwd = kept * (2.0 * (rows * total) as f64 * (d + dv) as f64 + 5.0 * (rows * total) as f64);
        // (Flash attention's backward as frameworks run it, the log-sum-exp kept from the
        // forward. shardc's own `AttentionGrad` computes it again — ONNX's op does not
        // output it — and the training graph prices that op as it runs: 3 times.)
        Some(Work { fwd_flops: fwd, backward: super::Backward::Times(2.5), launches: 1.0, parallel: None })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        attention(self, cx)
    }

    fn sharded(&self) -> Sharded {
        Sharded::Ring
    }

    /// In heads (`[b, h, s, d]`), with `P` the probabilities (the op itself recomputes them:
    /// its `qk_matmul_output_mode = 3` output) and `K`, `V` the keys and values after the cache,
    /// each key/value head repeated for its group of query heads:
    /// `dV = Pᵀ·dY`, `dP = dY·Vᵀ`, `dS = P ⊙ (dP − Σ dP ⊙ P)`, through a soft cap
    /// `dS ⊙ (1 − (S_c/c)²)` (`S_c` the capped scores: mode 0), `dQ = scale · dS·K`,
    /// `dK = scale · dSᵀ·Q`; the repeated heads summed back to their key/value head, the
    /// cache's share split off to `past_key`/`past_value`, and the gradients of the present
    /// key/value and score outputs added where they flow. Masks, windows and padding are in
    /// `P` (a masked score has probability 0 and passes nothing).
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(attention_grad(self, cx))
    }
}

/// The op splits by batch and by head (every device attends with its own query heads over
/// their own key/value heads: the groups of grouped-query attention stay whole when the split
/// divides the key/value heads) and, with no causal mask, window or cache, by query rows
/// (each device's rows against all keys); a plain causal self-attention by its sequence —
/// queries, keys and values at once — as ring attention (`Sharded::Ring`). Heads split only
/// in the 4-D form: the 3-D form's head counts are attributes the pieces would have to change.
fn attention_space(a: &op::Attention, cx: &NodeCx<'_>) -> IterSpace {
    use crate::layout::{DimKind, DimRole, IterDim};
    let (q, k) = (cx.in_dims(0), cx.in_dims(1));
    let rank = q.len();
    if !(rank == 3 || rank == 4) || k.len() != rank || q.iter().chain(&k).any(|&d| d <= 0) {
        return IterSpace::whole(cx);
    }
    let node = cx.g.node(cx.n);
    let cache = node.input(4).is_some() || node.input(5).is_some() || node.input(6).is_some();
    let rows_split = a.is_causal.unwrap_or(0) == 0
        && a.left_window_size.unwrap_or(-1) < 0
        && a.right_window_size.unwrap_or(-1) < 0
        && !cache;
    let par =
        |name: &str, size: i64| IterDim { name: name.into(), size, kind: DimKind::Parallel, role: DimRole::Other };
    let mut dims = vec![par("b", q[0])];
    let heads = (rank == 4).then(|| {
        dims.push(par("h", k[1]));
        dims.len() - 1
    });
    let seq_axis = if rank == 4 { 2 } else { 1 };
    let rows = rows_split.then(|| {
        dims.push(par("q", q[seq_axis]));
        dims.len() - 1
    });
    // A plain causal self-attention's sequence — queries, keys and values at once — splits
    // as ring attention.
    let ring = (!rows_split && a.is_causal.unwrap_or(0) != 0 && flash_grad(a, node, rank) && q[2] == k[2]).then(|| {
        dims.push(IterDim { name: "s".into(), size: q[2], kind: DimKind::Parallel, role: DimRole::Sequence });
        dims.len() - 1
    });
    // [b, h, s, e] or [b, s, h·e]: batch, heads (4-D), and the sequence when it follows `seq`.
    let map = |r: usize, seq: Option<usize>| -> Vec<Option<usize>> {
        (0..r)
            .map(|t| match t {
                0 => Some(0),
                1 if r == 4 => heads,
                t if t == seq_axis => seq,
                _ => None,
            })
            .collect()
    };
    let qn = if rank == 4 { q[1] } else { a.q_num_heads.unwrap_or(0) };
    // The mask: right-aligned against [b, q heads, q rows, keys]; a broadcast 1 stays whole.
    let mask = node.input(3).map(|_| {
        let m = cx.in_dims(3);
        let full = [Some((0usize, q[0])), heads.map(|h| (h, qn)), rows.map(|r| (r, q[seq_axis])), None];
        m.iter()
            .enumerate()
            .map(|(t, &sz)| {
                let at = (t + 4).checked_sub(m.len());
                at.and_then(|at| full.get(at).copied().flatten())
                    .and_then(|(i, size)| (sz == size && sz != 1).then_some(i))
            })
            .collect()
    });
    let inputs = (0..node.inputs().len())
        .map(|j| {
            node.input(j).map(|v| match j {
                0 => map(cx.rank(v), rows.or(ring)),
                1 | 2 => map(cx.rank(v), ring),
                3 => mask.clone().unwrap_or_default(),
                6 => vec![Some(0)],
                _ => map(cx.rank(v), None),
            })
        })
        .collect();
    let outputs = (0..node.num_outputs())
        .map(|s| {
            let r = cx.rank(cx.output(s));
            match s {
                0 => map(r, rows.or(ring)),
                1 | 2 => map(r, ring),
                // The scores: [b, h, q rows, keys].
                3 => (0..r).map(|t| [Some(0), heads, rows, None].get(t).copied().flatten()).collect(),
                _ => map(r, None),
            }
        })
        .collect();
    IterSpace { dims, inputs, outputs }
}

/// Whether attention `a` at `node` (of rank `rank`) is plain — 4-D, no mask, cache, window,
/// soft cap or score output — so its gradient is one `AttentionGrad` and its sequence can
/// split as ring attention.
fn flash_grad(a: &op::Attention, node: &crate::graph::Node, rank: usize) -> bool {
    rank == 4
        && (3..7).all(|j| node.input(j).is_none())
        && node.outputs().get(3).is_none_or(|o| o.name.is_empty())
        && a.softcap.is_none_or(|c| c == 0.0)
        && a.left_window_size.is_none_or(|w| w < 0)
        && a.right_window_size.is_none_or(|w| w < 0)
}

/// A plain attention's gradient (`flash_grad`): `AttentionGrad(Q, K, V, dY, Y)`, the present
/// keys' and values' gradients (the inputs themselves) added.
fn attention_flash_grad(a: &op::Attention, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let ins = [Some(cx.x(0)?), Some(cx.x(1)?), Some(cx.x(2)?), Some(cx.dy_or_zeros(0)?), Some(cx.y(0))];
    let op = op::AttentionGrad { is_causal: a.is_causal, scale: a.scale, ..Default::default() };
    let d = cx.add(Op::AttentionGrad(op), &ins, 3)?;
    for i in 0..3 {
        if !cx.want(i) {
            continue;
        }
        let g = match cx.dy(i).filter(|_| i > 0) {
            Some(present) => cx.add2(d[i], present)?,
            None => d[i],
        };
        cx.set(i, g);
    }
    Ok(())
}

fn attention_grad(a: &op::Attention, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let wants: Vec<usize> = [0, 1, 2, 4, 5].into_iter().filter(|&i| cx.want(i) && cx.x_opt(i).is_some()).collect();
    if wants.is_empty() || (0..4).all(|s| cx.dy(s).is_none()) {
        return Ok(());
    }
    let rank = cx.dims(cx.x(0)?)?.len();
    if flash_grad(a, cx.g.node(cx.n), rank) && cx.dy(3).is_none() {
        return attention_flash_grad(a, cx);
    }
    let (q, k, v) = (cx.x(0)?, cx.x(1)?, cx.x(2)?);
    let (qd, kd, vd) = (cx.dims(q)?, cx.dims(k)?, cx.dims(v)?);
    let rank = qd.len();
    if qd.iter().chain(&kd).chain(&vd).any(|&d| d < 0) || !(rank == 3 || rank == 4) {
        return Err(format!("Attention of {qd:?}, {kd:?}, {vd:?}: needs known shapes of rank 3 or 4"));
    }
    let (hq, hk) = if rank == 4 {
        (qd[1], kd[1])
    } else {
        (
            a.q_num_heads.ok_or("3-D Attention needs q_num_heads")?,
            a.kv_num_heads.ok_or("3-D Attention needs kv_num_heads")?,
        )
    };
    if hk <= 0 || hq % hk != 0 {
        return Err(format!("Attention: {hq} query heads do not group over {hk} key heads"));
    }
    let b = qd[0];
    let (sq, d, dv) = if rank == 4 { (qd[2], qd[3], vd[3]) } else { (qd[1], qd[2] / hq, vd[2] / hk) };
    let sk = if rank == 4 { kd[2] } else { kd[1] };
    let past = match cx.x_opt(4) {
        Some(p) => cx.dims(p)?.get(2).copied().unwrap_or(0),
        None => 0,
    };
    let total = past + sk;
    let group = hq / hk;
    let scale = a.scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
    let dt = cx.dtype(q);
    // [b, s, h·e] → [b, h, s, e] and back.
    let heads = |cx: &mut GradCx<'_>, x: Value, h: i64, s: i64, e: i64| -> std::result::Result<Value, String> {
        if rank == 4 {
            return Ok(x);
        }
        let r = cx.reshape(x, &[b, s, h, e])?;
        cx.transpose(r, &[0, 2, 1, 3])
    };
    let unheads = |cx: &mut GradCx<'_>, x: Value, h: i64, s: i64, e: i64| -> std::result::Result<Value, String> {
        if rank == 4 {
            return Ok(x);
        }
        let t = cx.transpose(x, &[0, 2, 1, 3])?;
        cx.reshape(t, &[b, s, h * e])
    };
    // Each key/value head repeated for its query heads: [b, hk, t, e] → [b, hq, t, e].
    let repeat = |cx: &mut GradCx<'_>, x: Value, e: i64| -> std::result::Result<Value, String> {
        if group == 1 {
            return Ok(x);
        }
        let r = cx.reshape(x, &[b, hk, 1, total, e])?;
        let x = cx.expand(r, &[b, hk, group, total, e])?;
        cx.reshape(x, &[b, hq, total, e])
    };
    let summed = |cx: &mut GradCx<'_>, x: Value, e: i64| -> std::result::Result<Value, String> {
        if group == 1 {
            return Ok(x);
        }
        let r = cx.reshape(x, &[b, hk, group, total, e])?;
        cx.reduce_sum(r, &[2], false)
    };
    let cached = |cx: &mut GradCx<'_>, past_in: Option<Value>, x: Value| -> std::result::Result<Value, String> {
        match past_in {
            Some(p) => cx.add1(Op::Concat(op::Concat { axis: Some(2) }), &[p, x]),
            None => Ok(x),
        }
    };
    let q4 = heads(cx, q, hq, sq, d)?;
    let k4 = heads(cx, k, hk, sk, d)?;
    let v4 = heads(cx, v, hk, sk, dv)?;
    let (pk, pv) = (cx.x_opt(4), cx.x_opt(5));
    let kt = cached(cx, pk, k4)?;
    let vt = cached(cx, pv, v4)?;
    let (kr, vr) = (repeat(cx, kt, d)?, repeat(cx, vt, dv)?);
    let ins: Vec<Option<Value>> = (0..7).map(|i| cx.x_opt(i)).collect();
    // The scores output of the op in `mode`.
    let scores = |cx: &mut GradCx<'_>, mode: i64| -> std::result::Result<Value, String> {
        let mut again = a.clone();
        again.qk_matmul_output_mode = Some(mode);
        Ok(cx.add(Op::Attention(again), &ins, 4)?[3])
    };
    let p = scores(cx, 3)?;
    let mode = a.qk_matmul_output_mode.unwrap_or(0);
    let dy = cx.dy_or_zeros(0)?;
    let dy4 = heads(cx, dy, hq, sq, dv)?;
    let vrt = cx.transpose(vr, &[0, 1, 3, 2])?;
    let mut dp = cx.add1(Op::MatMul(op::MatMul {}), &[dy4, vrt])?;
    let d_qk = cx.dy(3);
    if let (Some(g), 3) = (d_qk, mode) {
        dp = cx.add2(dp, g)?;
    }
    let pt = cx.transpose(p, &[0, 1, 3, 2])?;
    let dvr = cx.add1(Op::MatMul(op::MatMul {}), &[pt, dy4])?;
    let dpp = cx.mul(dp, p)?;
    let row = cx.reduce_sum(dpp, &[3], true)?;
    let centred = cx.sub(dp, row)?;
    let mut ds = cx.mul(p, centred)?;
    if let (Some(g), false) = (d_qk, mode == 3) {
        ds = cx.add2(ds, g)?;
    }
    let softcap = a.softcap.map_or(0.0, f64::from);
    if softcap > 0.0 {
        let capped = scores(cx, 0)?;
        let t = cx.scale(capped, 1.0 / softcap)?;
        let tt = cx.mul(t, t)?;
        let one = cx.scalar(dt, 1.0);
        let slope = cx.sub(one, tt)?;
        ds = cx.mul(ds, slope)?;
    }
    let dq4 = cx.add1(Op::MatMul(op::MatMul {}), &[ds, kr])?;
    let dq4 = cx.scale(dq4, scale)?;
    let dst = cx.transpose(ds, &[0, 1, 3, 2])?;
    let dkr = cx.add1(Op::MatMul(op::MatMul {}), &[dst, q4])?;
    let dkr = cx.scale(dkr, scale)?;
    let mut dkt = summed(cx, dkr, d)?;
    let mut dvt = summed(cx, dvr, dv)?;
    if let Some(g) = cx.dy(1) {
        dkt = cx.add2(dkt, g)?;
    }
    if let Some(g) = cx.dy(2) {
        dvt = cx.add2(dvt, g)?;
    }
    // The new positions' share, and the cache's.
    let part = |cx: &mut GradCx<'_>, x: Value, from: i64, to: i64| -> std::result::Result<Value, String> {
        if from == 0 && to == total {
            return Ok(x);
        }
        let (s, e, ax) = (cx.ints(&[from]), cx.ints(&[to]), cx.ints(&[2]));
        cx.add1(Op::Slice(op::Slice::default()), &[x, s, e, ax])
    };
    for i in wants {
        let g = match i {
            0 => unheads(cx, dq4, hq, sq, d)?,
            1 => {
                let x = part(cx, dkt, past, total)?;
                unheads(cx, x, hk, sk, d)?
            }
            2 => {
                let x = part(cx, dvt, past, total)?;
                unheads(cx, x, hk, sk, dv)?
            }
            4 => part(cx, dkt, 0, past)?,
            _ => part(cx, dvt, 0, past)?,
        };
        cx.set(i, g);
    }
    Ok(())
}

/// `[b, s, h·d]` → `[b, h, s, d]`.
fn to_heads(x: &Array, heads: usize) -> Result<(Vec<f64>, [usize; 4])> {
    let v = x.to_f64()?;
    if x.rank() == 4 {
        let s = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
        return Ok((v, s));
    }
    let (b, s, hd) = (x.shape[0], x.shape[1], x.shape[2]);
    if heads == 0 || hd % heads != 0 {
        return Err(EvalError::Invalid(format!("Attention: hidden size {hd} does not split into {heads} heads")));
    }
    let d = hd / heads;
    let mut out = vec![0.0; v.len()];
    for bi in 0..b {
        for si in 0..s {
            for h in 0..heads {
                for di in 0..d {
                    out[((bi * heads + h) * s + si) * d + di] = v[(bi * s + si) * hd + h * d + di];
                }
            }
        }
    }
    Ok((out, [b, heads, s, d]))
}

/// The value of a right-aligned broadcast operand at `[b, h, i, j]`.
fn bcast_at(a: &[f64], shape: &[usize], idx: [usize; 4]) -> f64 {
    let r = shape.len();
    let mut off = 0;
    let mut stride = 1;
    for k in 0..r {
        let d = r - 1 - k;
        let i = idx[3 - k];
        let n = shape[d];
        off += if n == 1 { 0 } else { i } * stride;
        stride *= n;
    }
    a[off]
}

fn attention(op: &op::Attention, cx: &EvalCx<'_>) -> Arrays {
    let (q, k, v) = (cx.req(0)?, cx.req(1)?, cx.req(2)?);
    let rank = q.rank();
    let qn = op.q_num_heads.unwrap_or(0).max(0) as usize;
    let kvn = op.kv_num_heads.unwrap_or(0).max(0) as usize;
    let (qv, [b, hq, sq, d]) = to_heads(q, qn)?;
    let (mut kv_k, [_, hk, sk, dk]) = to_heads(k, kvn)?;
    let (mut kv_v, [_, hv, _, dv]) = to_heads(v, kvn)?;
    if dk != d {
        return Err(EvalError::Invalid(format!("Attention: Q's head size {d} differs from K's {dk}")));
    }
    // The cache: past keys and values before the new ones.
    let (past_k, past_v) = (cx.opt(4), cx.opt(5));
    let past = past_k.map_or(0, |p| p.shape.get(2).copied().unwrap_or(0));
    let total = past + sk;
    let concat = |prev: Option<&Array>, new: &[f64], h: usize, dd: usize| -> Result<Vec<f64>> {
        let Some(p) = prev else { return Ok(new.to_vec()) };
        let pv = p.to_f64()?;
        let mut out = vec![0.0; b * h * total * dd];
        for bh in 0..b * h {
            out[bh * total * dd..bh * total * dd + past * dd]
                .copy_from_slice(&pv[bh * past * dd..(bh + 1) * past * dd]);
            out[bh * total * dd + past * dd..(bh + 1) * total * dd]
                .copy_from_slice(&new[bh * sk * dd..(bh + 1) * sk * dd]);
        }
        Ok(out)
    };
    kv_k = concat(past_k, &kv_k, hk, d)?;
    kv_v = concat(past_v, &kv_v, hv, dv)?;
    if hk == 0 || hq % hk != 0 || hk != hv {
        return Err(EvalError::Invalid(format!("Attention: {hq} query heads do not group over {hk} key heads")));
    }
    let group = hq / hk;
    let scale = op.scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
    let s2 = scale.sqrt();
    // The additive bias [b, h, q, kv]: the mask (boolean: allowed or −∞; padded to the
    // total length), causal and sliding windows, and the per-batch valid lengths.
    let mask = cx.opt(3);
    let mask_vals: Option<(Vec<f64>, Vec<usize>, bool)> = mask
        .map(|m| -> Result<_> {
            let is_bool = m.dtype == DType::Bool;
            Ok((m.to_f64()?, m.shape.clone(), is_bool))
        })
        .transpose()?;
    let nonpad: Option<Vec<i64>> = cx.opt(6).map(|a| a.to_i64()).transpose()?;
    let causal = op.is_causal.unwrap_or(0) != 0;
    let (left, right) = (op.left_window_size.unwrap_or(-1), op.right_window_size.unwrap_or(-1));
    let offset = |bi: usize| -> i64 {
        match (&nonpad, past_k) {
            (Some(np), None) => np.get(bi).copied().unwrap_or(total as i64) - sq as i64,
            _ => past as i64,
        }
    };
    let bias = |bi: usize, h: usize, i: usize, j: usize| -> f64 {
        let mut x = 0.0;
        if let Some((mv, ms, is_bool)) = &mask_vals {
            let last = *ms.last().unwrap_or(&0);
            x = if j >= last {
                f64::NEG_INFINITY
            } else {
                // Index within the (unpadded) mask.
                let val = bcast_at(mv, ms, [bi, h, i, j]);
                if *is_bool { if val != 0.0 { 0.0 } else { f64::NEG_INFINITY } } else { val }
            };
        }
        if causal && (j as i64) > i as i64 + offset(bi) {
            x = f64::NEG_INFINITY;
        }
        if left >= 0 || right >= 0 {
            let diff = i as i64 + offset(bi) - j as i64;
            if (left >= 0 && diff > left) || (right >= 0 && -diff > right) {
                x = f64::NEG_INFINITY;
            }
        }
        if let Some(np) = &nonpad
            && (j as i64) >= np.get(bi).copied().unwrap_or(total as i64)
        {
            x = f64::NEG_INFINITY;
        }
        x
    };
    let softcap = op.softcap.map_or(0.0, f64::from);
    let mode = op.qk_matmul_output_mode.unwrap_or(0);
    let mut y = vec![0.0; b * hq * sq * dv];
    // The scores output only when asked for: the op otherwise holds one row of scores at a
    // time (what a fused kernel keeps), not the `s × s` of them.
    let want_qk = cx.n_out >= 4;
    let mut qk_out = vec![0.0; if want_qk { b * hq * sq * total } else { 0 }];
    let mut scores = vec![0.0; total];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..sq {
                let qrow = &qv[((bi * hq + h) * sq + i) * d..][..d];
                let mut all_masked = true;
                for (j, sc) in scores.iter_mut().enumerate() {
                    let krow = &kv_k[((bi * hk + kh) * total + j) * d..][..d];
                    let mut dot: f64 = qrow.iter().zip(krow).map(|(a, c)| (a * s2) * (c * s2)).sum();
                    if softcap > 0.0 {
                        dot = (dot / softcap).tanh() * softcap;
                    }
                    let bb = bias(bi, h, i, j);
                    all_masked &= bb == f64::NEG_INFINITY;
                    let with_bias = dot + bb;
                    if want_qk {
                        qk_out[((bi * hq + h) * sq + i) * total + j] = if mode == 2 { with_bias } else { dot };
                    }
                    *sc = with_bias;
                }
                // Softmax; a row with no attendable key is all zeros.
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let safe = if mx == f64::NEG_INFINITY { 0.0 } else { mx };
                let mut sum = 0.0;
                for sc in scores.iter_mut() {
                    *sc = (*sc - safe).exp();
                    sum += *sc;
                }
                let sum = if sum == 0.0 { 1.0 } else { sum };
                for (j, sc) in scores.iter_mut().enumerate() {
                    *sc = if all_masked { 0.0 } else { *sc / sum };
                    if want_qk && mode == 3 {
                        qk_out[((bi * hq + h) * sq + i) * total + j] = *sc;
                    }
                }
                let yrow = &mut y[((bi * hq + h) * sq + i) * dv..][..dv];
                for (j, p) in scores.iter().enumerate() {
                    if *p == 0.0 {
                        continue;
                    }
                    let vrow = &kv_v[((bi * hv + kh) * total + j) * dv..][..dv];
                    for (yo, vv) in yrow.iter_mut().zip(vrow) {
                        *yo += p * vv;
                    }
                }
            }
        }
    }
    // Y back to the input layout.
    let y = if rank == 3 {
        let mut out = vec![0.0; y.len()];
        for bi in 0..b {
            for h in 0..hq {
                for i in 0..sq {
                    for c in 0..dv {
                        out[(bi * sq + i) * hq * dv + h * dv + c] = y[((bi * hq + h) * sq + i) * dv + c];
                    }
                }
            }
        }
        Array::float(q.dtype, vec![b, sq, hq * dv], out)
    } else {
        Array::float(q.dtype, vec![b, hq, sq, dv], y)
    };
    let mut outs = vec![
        y,
        Array::float(k.dtype, vec![b, hk, total, d], kv_k),
        Array::float(v.dtype, vec![b, hv, total, dv], kv_v),
    ];
    if want_qk {
        outs.push(Array::float(q.dtype, vec![b, hq, sq, total], qk_out));
    }
    outs.truncate(cx.n_out.max(1));
    Ok(outs)
}

impl OpRules for op::RotaryEmbedding {
    flow_positional!(0);

    /// A rotation's transpose is the rotation by the opposite angle: dX is dY rotated with
    /// the sine negated (the caches and positions get no gradient).
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let (c, s) = (cx.x(1)?, cx.x(2)?);
            let ns = cx.neg(s)?;
            let ins = vec![Some(dy), Some(c), Some(ns), cx.x_opt(3)];
            let dx = cx.add(Op::RotaryEmbedding(self.clone()), &ins, 1)?[0];
            cx.set(0, dx);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::new(3, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![rotary(self, cx)?])
    }
}

/// Rotates the first `rotary_embedding_dim` features of every head by the position's angle:
/// halves (or interleaved pairs) as the real and imaginary parts.
fn rotary(op: &op::RotaryEmbedding, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let (cos, sin) = (cx.req(1)?, cx.req(2)?);
    let pos = cx.opt(3).map(|p| p.to_i64()).transpose()?;
    let xv = x.to_f64()?;
    // As [b, s, h, d] indices into x.
    let (b, s, h, d, at): (usize, usize, usize, usize, FlatIndex) = match x.rank() {
        4 => {
            let (b, h, s, d) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
            (b, s, h, d, Box::new(move |bi, si, hi, di| ((bi * h + hi) * s + si) * d + di))
        }
        3 => {
            let nh = op.num_heads.unwrap_or(0).max(0) as usize;
            let (b, s, hd) = (x.shape[0], x.shape[1], x.shape[2]);
            if nh == 0 || hd % nh != 0 {
                return Err(EvalError::Invalid(format!("RotaryEmbedding: hidden size {hd} over num_heads {nh}")));
            }
            let d = hd / nh;
            (b, s, nh, d, Box::new(move |bi, si, hi, di| (bi * s + si) * hd + hi * d + di))
        }
        r => return Err(EvalError::Invalid(format!("RotaryEmbedding input of rank {r}"))),
    };
    let rd = match op.rotary_embedding_dim.unwrap_or(0) {
        0 => d,
        r => r as usize,
    };
    let half = rd / 2;
    if rd > d || half == 0 {
        return Err(EvalError::Invalid(format!("RotaryEmbedding: rotary dim {rd} for head size {d}")));
    }
    let (cv, sv) = (cos.to_f64()?, sin.to_f64()?);
    if *cos.shape.last().unwrap_or(&0) != half || *sin.shape.last().unwrap_or(&0) != half {
        return Err(EvalError::Invalid(format!(
            "RotaryEmbedding: caches of width {:?}, need {half}",
            cos.shape.last()
        )));
    }
    // The cache row of (batch, position): by position id, or the cache's own [b, s, half].
    let row = |bi: usize, si: usize| -> Result<usize> {
        match &pos {
            Some(p) => {
                let id = if p.len() == b * s { p[bi * s + si] } else { p.get(si).copied().unwrap_or(0) };
                usize::try_from(id)
                    .ok()
                    .filter(|&r| r * half < cv.len())
                    .ok_or_else(|| EvalError::Invalid(format!("position id {id} is outside the cache")))
            }
            None => {
                let r = if cos.rank() == 3 { bi * s + si } else { si };
                if r * half < cv.len() {
                    Ok(r)
                } else {
                    Err(EvalError::Invalid("the caches are shorter than the sequence".into()))
                }
            }
        }
    };
    let interleaved = op.interleaved.unwrap_or(0) != 0;
    let mut out = xv.clone();
    for bi in 0..b {
        for si in 0..s {
            let r = row(bi, si)?;
            for hi in 0..h {
                for k in 0..half {
                    let (i1, i2) = if interleaved { (2 * k, 2 * k + 1) } else { (k, k + half) };
                    let (x1, x2) = (xv[at(bi, si, hi, i1)], xv[at(bi, si, hi, i2)]);
                    let (c, sn) = (cv[r * half + k], sv[r * half + k]);
                    out[at(bi, si, hi, i1)] = c * x1 - sn * x2;
                    out[at(bi, si, hi, i2)] = sn * x1 + c * x2;
                }
            }
        }
    }
    Ok(Array::float(x.dtype, x.shape.clone(), out))
}
