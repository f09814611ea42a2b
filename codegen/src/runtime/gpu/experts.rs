//! The experts of a mixture (`MoE`, `MoEGrad`; ir/src/ops/experts.rs) as WGSL kernels, each
//! output element computed by one invocation (no float atomics: the weights' gradients are
//! owner-computes, each element walking the routed pairs in order).
//!
//! Forward: the gated activations `A [T·k, I]` of every routed pair (`silu(W1[e]·x)` times
//! the up half), then `Y[t, h] = Σⱼ w · W2[e, h, :]·A[pair]`. Backward: the gate and up
//! halves again, `D [T·k, I] = W2[e]ᵀ·dY[t]`, `dw = A·D`, the gate-and-up gradient
//! `DGU [T·k, 2I]`, then `dX`, `dW2` and `dW1`. A pair whose id is outside `0..E` adds
//! nothing.

use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, groups, nested};
use super::wgsl::{MATH_FNS, source};

/// The sizes `(T, k, H, E, I)` from the token operand at `x` on; `None` unless every operand
/// is f32 (ids i32) and the shapes agree.
fn sizes(cx: &CompileCx<'_>, x: usize) -> Option<(usize, usize, usize, usize, usize)> {
    let (xs, ids, w, w1, w2) = (cx.input(x)?, cx.input(x + 1)?, cx.input(x + 2)?, cx.input(x + 3)?, cx.input(x + 4)?);
    let f32s = [xs, w, w1, w2].iter().all(|d| d.elem() == Elem::F32) && ids.elem() == Elem::I32;
    match (&xs.shape[..], &ids.shape[..], &w1.shape[..], &w2.shape[..]) {
        ([t, h], [_, k], [e, i2, _], [_, _, i]) if f32s && *i2 == 2 * i && w.shape == ids.shape => {
            Some((*t, *k, *h, *e, *i))
        }
        _ => None,
    }
}

/// `P = [count, T, k, H, E, I]`.
fn params(count: usize, (t, k, h, e, i): (usize, usize, usize, usize, usize)) -> Vec<u32> {
    [count, t, k, h, e, i].into_iter().map(|v| v as u32).collect()
}

const HEAD: &str = "    let tt = P[1]; let kk = P[2]; let hh = P[3]; let ee = P[4]; let ii = P[5];";

/// Per (pair, i): the gate and up products of the pair's expert (G, U), 0 when unrouted.
fn gate_up_src() -> String {
    let body = format!(
        "{HEAD}
    let pr = i / ii; let r = i % ii; let t = pr / kk;
    let e = ID[pr];
    var g = 0.0; var u = 0.0;
    if (e >= 0 && u32(e) < ee) {{
        let gb = (u32(e) * 2u * ii + r) * hh; let ub = gb + ii * hh;
        for (var c = 0u; c < hh; c = c + 1u) {{
            let xv = X[t * hh + c];
            g = g + W1[gb + c] * xv;
            u = u + W1[ub + c] * xv;
        }}
    }}
    G[i] = g; U[i] = u;"
    );
    source(
        &[
            ("X", Elem::F32, false),
            ("ID", Elem::I32, false),
            ("W1", Elem::F32, false),
            ("G", Elem::F32, true),
            ("U", Elem::F32, true),
        ],
        "",
        &body,
    )
}

/// Per (t, h): `Σⱼ w · W2[e, h, :]·(silu(G)·U)[pair]`.
fn down_src() -> String {
    let body = format!(
        "{HEAD}
    let t = i / hh; let h = i % hh;
    var acc = 0.0;
    for (var j = 0u; j < kk; j = j + 1u) {{
        let pr = t * kk + j; let e = ID[pr];
        if (e >= 0 && u32(e) < ee) {{
            let wb = (u32(e) * hh + h) * ii;
            var s = 0.0;
            for (var r = 0u; r < ii; r = r + 1u) {{
                let g = G[pr * ii + r];
                s = s + W2[wb + r] * g * sigmoid_(g) * U[pr * ii + r];
            }}
            acc = acc + W[pr] * s;
        }}
    }}
    Y[i] = acc;"
    );
    source(
        &[
            ("ID", Elem::I32, false),
            ("W", Elem::F32, false),
            ("W2", Elem::F32, false),
            ("G", Elem::F32, false),
            ("U", Elem::F32, false),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        &body,
    )
}

impl Kernel for op::MoE {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(s) = sizes(cx, 0) else { return Ok(None) };
        let (t, k, h, _, i) = s;
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let (g, u) = (c.temp(vec![t * k, i], ir::DType::Float), c.temp(vec![t * k, i], ir::DType::Float));
        if t * k * i > 0 {
            let bufs = vec![Buf::In(0), Buf::In(1), Buf::In(3), g, u];
            c.launch_loop(gate_up_src(), bufs, params(t * k * i, s), groups(t * k * i), h as u64);
        }
        if t * h > 0 {
            let bufs = vec![Buf::In(1), Buf::In(2), Buf::In(4), g, u, Buf::Out(0)];
            c.launch_loop(down_src(), bufs, params(t * h, s), groups(t * h), nested(&[k, i]));
        }
        Ok(Some(c))
    }
}

/// Per (pair, i): `D = W2[e]ᵀ·dY[t]` (0 when unrouted).
fn back_down_src() -> String {
    let body = format!(
        "{HEAD}
    let pr = i / ii; let r = i % ii; let t = pr / kk;
    let e = ID[pr];
    var d = 0.0;
    if (e >= 0 && u32(e) < ee) {{
        for (var h = 0u; h < hh; h = h + 1u) {{
            d = d + W2[(u32(e) * hh + h) * ii + r] * DY[t * hh + h];
        }}
    }}
    D[i] = d;"
    );
    source(
        &[("DY", Elem::F32, false), ("ID", Elem::I32, false), ("W2", Elem::F32, false), ("D", Elem::F32, true)],
        "",
        &body,
    )
}

/// Per pair: `dw = Σᵢ silu(G)·U·D`; per (pair, r) of the gate-and-up gradient
/// `DGU = [w·D·U·silu'(G); w·D·silu(G)]` (one launch each).
fn dw_src() -> String {
    let body = format!(
        "{HEAD}
    var s = 0.0;
    for (var r = 0u; r < ii; r = r + 1u) {{
        let g = G[i * ii + r];
        s = s + g * sigmoid_(g) * U[i * ii + r] * D[i * ii + r];
    }}
    DW[i] = s;"
    );
    source(
        &[("G", Elem::F32, false), ("U", Elem::F32, false), ("D", Elem::F32, false), ("DW", Elem::F32, true)],
        MATH_FNS,
        &body,
    )
}

fn dgu_src() -> String {
    let body = format!(
        "{HEAD}
    let pr = i / (2u * ii); let r = i % (2u * ii);
    let q = pr * ii + (r % ii);
    let g = G[q]; let sg = sigmoid_(g);
    let d = W[pr] * D[q];
    if (r < ii) {{
        DGU[i] = d * U[q] * sg * (1.0 + g * (1.0 - sg));
    }} else {{
        DGU[i] = d * g * sg;
    }}"
    );
    source(
        &[
            ("W", Elem::F32, false),
            ("G", Elem::F32, false),
            ("U", Elem::F32, false),
            ("D", Elem::F32, false),
            ("DGU", Elem::F32, true),
        ],
        MATH_FNS,
        &body,
    )
}

/// Per (t, c): `dX = Σⱼ W1[e, :, c]·DGU[pair]`.
fn dx_src() -> String {
    let body = format!(
        "{HEAD}
    let t = i / hh; let c = i % hh;
    var acc = 0.0;
    for (var j = 0u; j < kk; j = j + 1u) {{
        let pr = t * kk + j; let e = ID[pr];
        if (e >= 0 && u32(e) < ee) {{
            for (var r = 0u; r < 2u * ii; r = r + 1u) {{
                acc = acc + W1[(u32(e) * 2u * ii + r) * hh + c] * DGU[pr * 2u * ii + r];
            }}
        }}
    }}
    DX[i] = acc;"
    );
    source(
        &[("ID", Elem::I32, false), ("W1", Elem::F32, false), ("DGU", Elem::F32, false), ("DX", Elem::F32, true)],
        "",
        &body,
    )
}

/// Per (e, h, r): `dW2 = Σ_{pairs of e} w · dY[t, h] · silu(G)·U` (pairs in order).
fn dw2_src() -> String {
    let body = format!(
        "{HEAD}
    let e = i / (hh * ii); let h = (i / ii) % hh; let r = i % ii;
    var acc = 0.0;
    for (var pr = 0u; pr < tt * kk; pr = pr + 1u) {{
        if (ID[pr] == i32(e)) {{
            let g = G[pr * ii + r];
            acc = acc + W[pr] * DY[(pr / kk) * hh + h] * g * sigmoid_(g) * U[pr * ii + r];
        }}
    }}
    DW2[i] = acc;"
    );
    source(
        &[
            ("DY", Elem::F32, false),
            ("ID", Elem::I32, false),
            ("W", Elem::F32, false),
            ("G", Elem::F32, false),
            ("U", Elem::F32, false),
            ("DW2", Elem::F32, true),
        ],
        MATH_FNS,
        &body,
    )
}

/// Per (e, r, c): `dW1 = Σ_{pairs of e} DGU[pair, r] · X[t, c]` (pairs in order).
fn dw1_src() -> String {
    let body = format!(
        "{HEAD}
    let e = i / (2u * ii * hh); let r = (i / hh) % (2u * ii); let c = i % hh;
    var acc = 0.0;
    for (var pr = 0u; pr < tt * kk; pr = pr + 1u) {{
        if (ID[pr] == i32(e)) {{
            acc = acc + DGU[pr * 2u * ii + r] * X[(pr / kk) * hh + c];
        }}
    }}
    DW1[i] = acc;"
    );
    source(
        &[("X", Elem::F32, false), ("ID", Elem::I32, false), ("DGU", Elem::F32, false), ("DW1", Elem::F32, true)],
        "",
        &body,
    )
}

impl Kernel for op::MoEGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(s) = sizes(cx, 1) else { return Ok(None) };
        if cx.input(0).is_none_or(|d| d.elem() != Elem::F32) {
            return Ok(None);
        }
        let (t, k, h, e, i) = s;
        let f = ir::DType::Float;
        let mut c = Compiled::new(vec![(vec![t, h], f), (vec![t, k], f), (vec![e, 2 * i, h], f), (vec![e, h, i], f)]);
        c.subgroup = cx.subgroup;
        let (pairs, rows) = (t * k, t * k * i);
        let (g, u, d, dgu) = (
            c.temp(vec![pairs, i], f),
            c.temp(vec![pairs, i], f),
            c.temp(vec![pairs, i], f),
            c.temp(vec![pairs, 2 * i], f),
        );
        let (dy, x, ids, w, w1, w2) = (Buf::In(0), Buf::In(1), Buf::In(2), Buf::In(3), Buf::In(4), Buf::In(5));
        let run = |c: &mut Compiled, src: String, bufs: Vec<Buf>, count: usize, trips: u64| {
            if count > 0 {
                c.launch_loop(src, bufs, params(count, s), groups(count), trips);
            }
        };
        run(&mut c, gate_up_src(), vec![x, ids, w1, g, u], rows, h as u64);
        run(&mut c, back_down_src(), vec![dy, ids, w2, d], rows, h as u64);
        run(&mut c, dw_src(), vec![g, u, d, Buf::Out(1)], pairs, i as u64);
        run(&mut c, dgu_src(), vec![w, g, u, d, dgu], 2 * rows, 0);
        run(&mut c, dx_src(), vec![ids, w1, dgu, Buf::Out(0)], t * h, nested(&[k, 2 * i]));
        run(&mut c, dw2_src(), vec![dy, ids, w, g, u, Buf::Out(3)], e * h * i, pairs as u64);
        run(&mut c, dw1_src(), vec![x, ids, dgu, Buf::Out(2)], e * 2 * i * h, pairs as u64);
        Ok(Some(c))
    }
}
