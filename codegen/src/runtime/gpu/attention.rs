//! Fused attention (ONNX `Attention`) as flash attention computes it: one invocation per
//! query row walks the keys once, keeping a running maximum and sum of the softmax and
//! rescaling its output row as the maximum grows, so no `s × s` scores exist. The backward
//! pass's recomputation of the probabilities (the op with `qk_matmul_output_mode` 3) walks
//! the keys a second time to write them.
//!
//! Covered: 3-D and 4-D inputs, grouped-query heads, `scale`, `is_causal`, an additive float
//! mask broadcast to `[batch, heads, queries, keys]`, the present keys and values of the 4-D
//! form (views of the inputs: there is no cache). A cache, per-batch lengths, windows, a soft
//! cap, a boolean mask, the 3-D form's present keys and values or other score outputs run on
//! the reference kernel.

use ir::DType;
use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, OutSpec, groups};
use super::wgsl::{Binding, source};

/// The shapes of one attention: batch, query and key heads, query and key lengths, head sizes.
struct Dims {
    b: usize,
    hq: usize,
    hk: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
}

/// Strides (batch, head, position) of a `[b, h, s, e]` tensor, or of its `[b, s, h·e]` form.
fn strides(rank: usize, h: usize, s: usize, e: usize) -> [u32; 3] {
    let st = if rank == 4 { [h * s * e, s * e, e] } else { [s * h * e, e, h * e] };
    st.map(|x| x as u32)
}

/// The shapes, when the kernel covers attention `a` on these inputs.
fn covered(a: &op::Attention, cx: &CompileCx<'_>) -> Option<Dims> {
    let (q, k, v) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let rank = q.shape.len();
    // Without a cache the present keys and values are the inputs, in the 4-D form.
    let plain = (4..7).all(|i| cx.input(i).is_none())
        && (rank == 4 || cx.outs.iter().skip(1).take(2).all(Option::is_none))
        && cx.outs.get(3).is_none_or(|o| o.is_none() || a.qk_matmul_output_mode == Some(3))
        && a.softcap.is_none_or(|c| c == 0.0)
        && a.left_window_size.is_none_or(|w| w < 0)
        && a.right_window_size.is_none_or(|w| w < 0);
    let floats = [q, k, v].iter().all(|t| t.elem() == Elem::F32);
    if !plain || !floats || k.shape.len() != rank || v.shape.len() != rank {
        return None;
    }
    let dims = if rank == 4 {
        let (hk, sk) = (k.shape[1], k.shape[2]);
        (v.shape[1] == hk && v.shape[2] == sk && k.shape[3] == q.shape[3]).then_some(Dims {
            b: q.shape[0],
            hq: q.shape[1],
            hk,
            sq: q.shape[2],
            sk,
            d: q.shape[3],
            dv: v.shape[3],
        })?
    } else if rank == 3 {
        let (hq, hk) = (a.q_num_heads? as usize, a.kv_num_heads? as usize);
        if hq == 0 || hk == 0 || q.shape[2] % hq != 0 || k.shape[2] % hk != 0 || v.shape[2] % hk != 0 {
            return None;
        }
        let d = q.shape[2] / hq;
        (k.shape[2] / hk == d && v.shape[1] == k.shape[1]).then_some(Dims {
            b: q.shape[0],
            hq,
            hk,
            sq: q.shape[1],
            sk: k.shape[1],
            d,
            dv: v.shape[2] / hk,
        })?
    } else {
        return None;
    };
    let same_batch = k.shape[0] == dims.b && v.shape[0] == dims.b;
    (same_batch && dims.hq % dims.hk == 0 && mask_strides(cx, &dims).is_some()).then_some(dims)
}

/// Strides of the mask over `[batch, heads, queries, keys]` (zero where it broadcasts);
/// `Some(None)` without a mask, `None` for a mask the kernel does not take.
fn mask_strides(cx: &CompileCx<'_>, d: &Dims) -> Option<Option<[u32; 4]>> {
    let Some(m) = cx.input(3) else { return Some(None) };
    let r = m.shape.len();
    if m.elem() != Elem::F32 || r > 4 || m.shape.last() != Some(&d.sk) {
        return None;
    }
    let full = [d.b, d.hq, d.sq, d.sk];
    let mut st = [0u32; 4];
    let mut stride = 1usize;
    for k in 0..r {
        let (n, want) = (m.shape[r - 1 - k], full[3 - k]);
        if n != 1 && n != want {
            return None;
        }
        st[3 - k] = if n == 1 { 0 } else { stride as u32 };
        stride *= n;
    }
    Some(Some(st))
}

impl Kernel for op::Attention {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(d) = covered(self, cx) else { return Ok(None) };
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let rank = cx.input(0).map_or(4, |q| q.shape.len());
        let mask = mask_strides(cx, &d).flatten();
        let probs = cx.outs.get(3).is_some_and(Option::is_some);
        let total = d.sk;
        let scale = self.scale.map_or(1.0 / (d.d as f32).sqrt(), |s| s);
        let mut p = vec![(d.b * d.hq * d.sq) as u32, d.hq as u32, d.sq as u32, total as u32, d.d as u32];
        p.extend([d.dv as u32, (d.hq / d.hk) as u32, u32::from(self.is_causal.unwrap_or(0) != 0), scale.to_bits()]);
        p.extend(strides(rank, d.hq, d.sq, d.d));
        p.extend(strides(rank, d.hk, d.sk, d.d));
        p.extend(strides(rank, d.hk, d.sk, d.dv));
        p.extend(strides(rank, d.hq, d.sq, d.dv));
        p.extend(mask.unwrap_or_default());
        let mut bufs = vec![Buf::In(0), Buf::In(1), Buf::In(2)];
        if mask.is_some() {
            bufs.push(Buf::In(3));
        }
        bufs.push(Buf::Out(0));
        if rank == 4 {
            for k in [1, 2] {
                let shape = cx.input(k).map_or_else(Vec::new, |t| t.shape.clone());
                c.outputs.push(OutSpec { shape, dtype: DType::Float, view_of: Some(k) });
            }
        }
        if probs {
            while c.outputs.len() < 3 {
                c.outputs.push(OutSpec { shape: vec![0], dtype: DType::Float, view_of: None });
            }
            c.outputs.push(OutSpec { shape: vec![d.b, d.hq, d.sq, total], dtype: DType::Float, view_of: None });
            bufs.push(Buf::Out(3));
        }
        if d.b * d.hq * d.sq > 0 {
            // Per key: the dot product, then the output row's update; a second walk for the
            // probabilities.
            let walk = (total * (1 + d.d + d.dv)) as u64;
            let trips = d.dv as u64 * 2 + walk * if probs { 2 } else { 1 };
            c.launch_loop(attention_src(mask.is_some(), probs), bufs, p, groups(d.b * d.hq * d.sq), trips);
        }
        c.outputs.truncate(cx.outs.len().max(1));
        Ok(Some(c))
    }
}

/// One query row per invocation: `P = [rows, hq, sq, keys, d, dv, group, causal, scale_bits,
/// Q strides (batch, head, position), K strides, V strides, Y strides, mask strides (batch,
/// head, query, key)]`.
pub fn attention_src(mask: bool, probs: bool) -> String {
    let mut b: Vec<Binding<'_>> = vec![("Q", Elem::F32, false), ("K", Elem::F32, false), ("V", Elem::F32, false)];
    if mask {
        b.push(("M", Elem::F32, false));
    }
    b.push(("Y", Elem::F32, true));
    if probs {
        b.push(("PR", Elem::F32, true));
    }
    let bias = if mask { "s = s + M[mb + j * P[24]];" } else { "" };
    let fns = format!(
        "
fn score(qb: u32, kb: u32, mb: u32, j: u32, qi: u32) -> f32 {{
    // Causally hidden, or masked to −∞: no weight.
    if (P[7] != 0u && j > qi) {{ return -3.0e38; }}
    var s = 0.0;
    for (var e = 0u; e < P[4]; e = e + 1u) {{ s = s + Q[qb + e] * K[kb + j * P[14] + e]; }}
    s = s * bitcast<f32>(P[8]);
    {bias}
    return max(s, -3.0e38);
}}
"
    );
    let second = if probs {
        "    let pb = i * P[3];
    for (var j = 0u; j < P[3]; j = j + 1u) {
        let s = score(qb, kb, mb, j, qi);
        PR[pb + j] = select(exp(s - m) / l, 0.0, s <= -3.0e38 || l == 0.0);
    }
"
    } else {
        ""
    };
    let body = format!(
        "    let qi = i % P[2];
    let h = (i / P[2]) % P[1];
    let bi = i / (P[2] * P[1]);
    let kh = h / P[6];
    let qb = bi * P[9] + h * P[10] + qi * P[11];
    let kb = bi * P[12] + kh * P[13];
    let vb = bi * P[15] + kh * P[16];
    let yb = bi * P[18] + h * P[19] + qi * P[20];
    let mb = bi * P[21] + h * P[22] + qi * P[23];
    for (var e = 0u; e < P[5]; e = e + 1u) {{ Y[yb + e] = 0.0; }}
    // The running maximum and sum of the row's weights; the output row holds the weighted
    // sum of values so far, scaled to the current maximum.
    var m = -3.0e38;
    var l = 0.0;
    for (var j = 0u; j < P[3]; j = j + 1u) {{
        let s = score(qb, kb, mb, j, qi);
        if (s <= -3.0e38) {{ continue; }}
        let mn = max(m, s);
        let corr = exp(m - mn);
        let w = exp(s - mn);
        l = l * corr + w;
        for (var e = 0u; e < P[5]; e = e + 1u) {{
            Y[yb + e] = Y[yb + e] * corr + w * V[vb + j * P[17] + e];
        }}
        m = mn;
    }}
    // A row with no key to attend to is zeros.
    let inv = select(1.0 / l, 0.0, l == 0.0);
    for (var e = 0u; e < P[5]; e = e + 1u) {{ Y[yb + e] = Y[yb + e] * inv; }}
{second}"
    );
    source(&b, &fns, &body)
}
