//! Attention block by block (`AttentionBlock`, `AttentionGrad`; ir/src/ops/flash.rs) as WGSL
//! kernels, flash attention's way: one invocation per query row walks the keys with a
//! running maximum and sum (the block), or recomputes each probability from its row's
//! log-sum-exp (the gradient: per query row `dQ`, then per key row `dK` and `dV`, each
//! element owned by one invocation — no float atomics). 4-D f32 operands only.

use ir::DType;
use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, groups};
use super::wgsl::{Binding, source};

/// `P = [count, hq, sq, sk, d, dv, group, causal, scale, q_offset, k_offset, hk]`, from
/// 4-D f32 `Q`, `K`, `V`.
fn params(
    cx: &CompileCx<'_>,
    count: Count,
    causal: Option<i64>,
    offsets: [Option<i64>; 2],
    scale: Option<f32>,
) -> Option<Vec<u32>> {
    let (q, k, v) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let f32s = [q, k, v].iter().all(|t| t.elem() == Elem::F32 && t.shape.len() == 4);
    if !f32s || k.shape[0] != q.shape[0] || v.shape[..3] != k.shape[..3] || k.shape[3] != q.shape[3] {
        return None;
    }
    let (b, hq, sq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (hk, sk, dv) = (k.shape[1], k.shape[2], v.shape[3]);
    if hk == 0 || !hq.is_multiple_of(hk) {
        return None;
    }
    let count = match count {
        Count::QueryRows => b * hq * sq,
        Count::KeyRows => b * hk * sk,
    };
    let scale = scale.unwrap_or(1.0 / (d.max(1) as f32).sqrt());
    let off = |o: Option<i64>| i32::try_from(o.unwrap_or(0)).ok().map(|x| x as u32);
    let mut p = vec![count, hq, sq, sk, d, dv, hq / hk].into_iter().map(|x| x as u32).collect::<Vec<_>>();
    p.extend([u32::from(causal.unwrap_or(0) != 0), scale.to_bits(), off(offsets[0])?, off(offsets[1])?, hk as u32]);
    Some(p)
}

/// What one invocation owns.
#[derive(Copy, Clone)]
enum Count {
    QueryRows,
    KeyRows,
}

/// The row's coordinates (query row `i`) and the helpers every kernel shares.
const FNS: &str = "
fn hidden(j: u32, qi: u32) -> bool {
    return P[7] != 0u && i32(j) + bitcast<i32>(P[10]) > i32(qi) + bitcast<i32>(P[9]);
}
fn score(qb: u32, kb: u32) -> f32 {
    var s = 0.0;
    for (var e = 0u; e < P[4]; e = e + 1u) { s = s + Q[qb + e] * K[kb + e]; }
    return s * bitcast<f32>(P[8]);
}
";

const ROW: &str = "    let qi = i % P[2];
    let h = (i / P[2]) % P[1];
    let bi = i / (P[2] * P[1]);
    let kb = (bi * P[11] + h / P[6]) * P[3];
    let qb = i * P[4];
    let yb = i * P[5];
";

fn f32s(names: &[&'static str], out: &[&'static str]) -> Vec<Binding<'static>> {
    names.iter().map(|n| (*n, Elem::F32, false)).chain(out.iter().map(|n| (*n, Elem::F32, true))).collect()
}

/// One query row per invocation: the block's softmax-weighted values (running maximum and
/// sum), merged into the running `YI`, `LI` when `running`.
fn block_src(running: bool) -> String {
    let ins: &[&str] = if running { &["Q", "K", "V", "YI", "LI"] } else { &["Q", "K", "V"] };
    let merge = if running {
        "    if (l == 0.0) {
        for (var e = 0u; e < P[5]; e = e + 1u) { Y[yb + e] = YI[yb + e]; }
        L[i] = LI[i];
        return;
    }
    let a = LI[i];
    if (a >= -3.0e38) {
        let mx = max(a, lb);
        let wa = exp(a - mx);
        let wb = exp(lb - mx);
        for (var e = 0u; e < P[5]; e = e + 1u) { Y[yb + e] = (wa * YI[yb + e] + wb * Y[yb + e]) / (wa + wb); }
        L[i] = mx + log(wa + wb);
    }
"
    } else {
        ""
    };
    let body = format!(
        "{ROW}
    for (var e = 0u; e < P[5]; e = e + 1u) {{ Y[yb + e] = 0.0; }}
    var m = -3.0e38;
    var l = 0.0;
    for (var j = 0u; j < P[3]; j = j + 1u) {{
        if (hidden(j, qi)) {{ continue; }}
        let s = score(qb, (kb + j) * P[4]);
        let mn = max(m, s);
        let corr = exp(m - mn);
        let w = exp(s - mn);
        l = l * corr + w;
        for (var e = 0u; e < P[5]; e = e + 1u) {{ Y[yb + e] = Y[yb + e] * corr + w * V[(kb + j) * P[5] + e]; }}
        m = mn;
    }}
    let inv = select(1.0 / l, 0.0, l == 0.0);
    for (var e = 0u; e < P[5]; e = e + 1u) {{ Y[yb + e] = Y[yb + e] * inv; }}
    let lb = select(m + log(l), bitcast<f32>(0xff800000u), l == 0.0);
    L[i] = lb;
{merge}"
    );
    source(&f32s(ins, &["Y", "L"]), FNS, &body)
}

impl Kernel for op::AttentionBlock {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let offsets = [self.q_offset, self.k_offset];
        let Some(p) = params(cx, Count::QueryRows, self.is_causal, offsets, self.scale) else { return Ok(None) };
        let running = cx.input(3).is_some() && cx.input(4).is_some();
        if running && [3, 4].iter().any(|&j| cx.input(j).is_some_and(|t| t.elem() != Elem::F32)) {
            return Ok(None);
        }
        let (q, v) = (cx.input(0).map(|t| t.shape.clone()), cx.input(2).map(|t| t.shape.clone()));
        let (Some(q), Some(v)) = (q, v) else { return Ok(None) };
        let f = DType::Float;
        let mut c = Compiled::new(vec![(vec![q[0], q[1], q[2], v[3]], f), (q[..3].to_vec(), f)]);
        c.subgroup = cx.subgroup;
        let mut bufs = vec![Buf::In(0), Buf::In(1), Buf::In(2)];
        if running {
            bufs.extend([Buf::In(3), Buf::In(4)]);
        }
        bufs.extend([Buf::Out(0), Buf::Out(1)]);
        let (rows, sk, d, dv) = (p[0] as usize, p[3] as u64, p[4] as u64, p[5] as u64);
        if rows > 0 {
            c.launch_loop(block_src(running), bufs, p, groups(rows), sk * (1 + d + dv) + 4 * dv);
        }
        c.outputs.truncate(cx.outs.len().max(1));
        Ok(Some(c))
    }
}

/// Per query row: its log-sum-exp (`LI`, or over these keys) and `D = Σ dY ⊙ Y`, into `ST`.
fn stats_src(given: bool) -> String {
    let (ins, lse): (&[&str], &str) = if given {
        (&["Q", "K", "DY", "YO", "LI"], "    let lse = LI[i];\n")
    } else {
        (
            &["Q", "K", "DY", "YO"],
            "    var m = -3.0e38;
    var l = 0.0;
    for (var j = 0u; j < P[3]; j = j + 1u) {
        if (hidden(j, qi)) { continue; }
        let s = score(qb, (kb + j) * P[4]);
        let mn = max(m, s);
        l = l * exp(m - mn) + exp(s - mn);
        m = mn;
    }
    let lse = select(m + log(l), 3.0e38, l == 0.0);
",
        )
    };
    let body = format!(
        "{ROW}
{lse}
    var dd = 0.0;
    for (var e = 0u; e < P[5]; e = e + 1u) {{ dd = dd + DY[yb + e] * YO[yb + e]; }}
    ST[2u * i] = lse;
    ST[2u * i + 1u] = dd;"
    );
    source(&f32s(ins, &["ST"]), FNS, &body)
}

/// Per query row: `dQ = scale · Σⱼ P (dY·Vⱼ − D) Kⱼ`.
fn dq_src() -> String {
    let body = format!(
        "{ROW}
    for (var e = 0u; e < P[4]; e = e + 1u) {{ DQ[qb + e] = 0.0; }}
    for (var j = 0u; j < P[3]; j = j + 1u) {{
        if (hidden(j, qi)) {{ continue; }}
        let p = exp(score(qb, (kb + j) * P[4]) - ST[2u * i]);
        var dp = 0.0;
        for (var e = 0u; e < P[5]; e = e + 1u) {{ dp = dp + DY[yb + e] * V[(kb + j) * P[5] + e]; }}
        let ds = p * (dp - ST[2u * i + 1u]) * bitcast<f32>(P[8]);
        for (var e = 0u; e < P[4]; e = e + 1u) {{ DQ[qb + e] = DQ[qb + e] + ds * K[(kb + j) * P[4] + e]; }}
    }}"
    );
    source(&f32s(&["Q", "K", "V", "DY", "ST"], &["DQ"]), FNS, &body)
}

/// Per key row (of `b·hk·sk`): `dK = scale · Σ P (dY·V − D) Q` and `dV = Σ P dY` over the
/// query rows of its group of heads that see it.
fn dkv_src() -> String {
    let body = "    let j = i % P[3];
    let kh = (i / P[3]) % P[11];
    let bi = i / (P[3] * P[11]);
    for (var e = 0u; e < P[4]; e = e + 1u) { DK[i * P[4] + e] = 0.0; }
    for (var e = 0u; e < P[5]; e = e + 1u) { DV[i * P[5] + e] = 0.0; }
    for (var g = 0u; g < P[6]; g = g + 1u) {
        let h = kh * P[6] + g;
        for (var qi = 0u; qi < P[2]; qi = qi + 1u) {
            if (hidden(j, qi)) { continue; }
            let r = (bi * P[1] + h) * P[2] + qi;
            let p = exp(score(r * P[4], i * P[4]) - ST[2u * r]);
            var dp = 0.0;
            for (var e = 0u; e < P[5]; e = e + 1u) { dp = dp + DY[r * P[5] + e] * V[i * P[5] + e]; }
            let ds = p * (dp - ST[2u * r + 1u]) * bitcast<f32>(P[8]);
            for (var e = 0u; e < P[4]; e = e + 1u) { DK[i * P[4] + e] = DK[i * P[4] + e] + ds * Q[r * P[4] + e]; }
            for (var e = 0u; e < P[5]; e = e + 1u) { DV[i * P[5] + e] = DV[i * P[5] + e] + p * DY[r * P[5] + e]; }
        }
    }";
    source(&f32s(&["Q", "K", "V", "DY", "ST"], &["DK", "DV"]), FNS, body)
}

impl Kernel for op::AttentionGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let offsets = [self.q_offset, self.k_offset];
        let Some(pq) = params(cx, Count::QueryRows, self.is_causal, offsets, self.scale) else { return Ok(None) };
        let Some(pk) = params(cx, Count::KeyRows, self.is_causal, offsets, self.scale) else { return Ok(None) };
        let given = cx.input(5).is_some();
        let floats = (3..if given { 6 } else { 5 }).all(|j| cx.input(j).is_some_and(|t| t.elem() == Elem::F32));
        let shapes: Vec<Vec<usize>> = (0..3).filter_map(|j| cx.input(j).map(|t| t.shape.clone())).collect();
        if !floats || shapes.len() != 3 {
            return Ok(None);
        }
        let f = DType::Float;
        let mut c = Compiled::new(shapes.iter().map(|s| (s.clone(), f)).collect());
        c.subgroup = cx.subgroup;
        let (rows, keys) = (pq[0] as usize, pk[0] as usize);
        let (sq, sk, d, dv, group) = (pq[2] as u64, pq[3] as u64, pq[4] as u64, pq[5] as u64, pq[6] as u64);
        let st = c.temp(vec![rows.max(1), 2], f);
        let (q, k, v, dy, y) = (Buf::In(0), Buf::In(1), Buf::In(2), Buf::In(3), Buf::In(4));
        if rows > 0 {
            let mut bufs = vec![q, k, dy, y];
            if given {
                bufs.push(Buf::In(5));
            }
            bufs.push(st);
            let trips = if given { dv } else { sk * (d + 1) + dv };
            c.launch_loop(stats_src(given), bufs, pq.clone(), groups(rows), trips);
            let bufs = vec![q, k, v, dy, st, Buf::Out(0)];
            c.launch_loop(dq_src(), bufs, pq, groups(rows), d + sk * (2 * d + dv));
        }
        if keys > 0 {
            let bufs = vec![q, k, v, dy, st, Buf::Out(1), Buf::Out(2)];
            c.launch_loop(dkv_src(), bufs, pk, groups(keys), d + dv + group * sq * (2 * d + 2 * dv));
        }
        Ok(Some(c))
    }
}
