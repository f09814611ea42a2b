//! Loss kernels: softmax cross-entropy and negative log-likelihood over `[N, C, d..]` scores
//! with int labels (class dim 1), forward and gradient. Per sample: the log-sum-exp (for the
//! softmax), its weight (0 when ignored) and its term; one invocation sums the terms and the
//! weights for the `mean` and `sum` reductions.

use ir::{DType, op};

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, OutSpec, groups};
use super::wgsl::{Binding, source};

/// The loss attributes a kernel needs: `(reduction code, ignore flag, ignore index)`;
/// reductions: 0 none, 1 sum, 2 mean.
fn reduction(r: &str, ignore: Option<i64>) -> Option<[u32; 3]> {
    let code = match r {
        "none" => 0,
        "sum" => 1,
        "mean" => 2,
        _ => return None,
    };
    Some([code, u32::from(ignore.is_some()), ignore.unwrap_or(0) as i32 as u32])
}

/// How a loss kernel finds a sample's log-sum-exp over the classes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Lse {
    /// None (the scores are log-probabilities already).
    None,
    /// One loop over the classes.
    Loop,
    /// From its chunks' maxima `M` and sums of exponentials `E` ([`chunks_src`]): this many
    /// chunks per sample (`P[6]`).
    Chunks(usize),
}

/// Per sample `s = n·D + j` and chunk `q` of [`ir::ops::loss::LSE_CHUNK`] classes (invocation
/// `s·Q + q`): the chunk's max `M` and its sum of exponentials below it `E` (0 where every
/// score is −∞). `P = [S·Q, C, D, Q, chunk]`.
pub fn chunks_src() -> String {
    let body = "    let C = P[1]; let D = P[2]; let Q = P[3]; let B = P[4];
    let s = i / Q; let q = i % Q;
    let n = s / D; let j = s % D;
    let c0 = q * B; let c1 = min(c0 + B, C);
    var mx = bitcast<f32>(0xff800000u);
    for (var c = c0; c < c1; c = c + 1u) { mx = max(mx, X[(n * C + c) * D + j]); }
    var se = 0.0;
    if (mx > bitcast<f32>(0xff800000u)) {
        for (var c = c0; c < c1; c = c + 1u) { se = se + exp(X[(n * C + c) * D + j] - mx); }
    }
    M[i] = mx;
    E[i] = se;";
    source(&[("X", Elem::F32, false), ("M", Elem::F32, true), ("E", Elem::F32, true)], "", body)
}

/// The log-probabilities from the samples' log-sum-exps: `LP[e] = X[e] − LSE[s]`.
/// `P = [count, C, D]`.
pub fn log_prob_src() -> String {
    let body = "    let C = P[1]; let D = P[2];
    let j = i % D; let n = i / (D * C);
    LP[i] = X[i] - LSE[n * D + j];";
    source(&[("X", Elem::F32, false), ("LSE", Elem::F32, false), ("LP", Elem::F32, true)], "", body)
}

/// Per sample `s = n·D + j` of scores `X` with labels `L`: `WS[s]` (its weight), `LSE[s]`
/// (log-sum-exp over the classes, see [`Lse`]), `T[s]` (its loss term) and, when `log_prob`
/// (with [`Lse::Loop`]), the log-probabilities. `P = [S, C, D, reduction, ignore?, ignore]`
/// and, with [`Lse::Chunks`], the chunks per sample.
pub fn samples_src(lse: Lse, weights: bool, log_prob: bool) -> String {
    let mut b: Vec<Binding<'_>> = vec![("X", Elem::F32, false), ("L", Elem::I32, false)];
    if weights {
        b.push(("Wt", Elem::F32, false));
    }
    if matches!(lse, Lse::Chunks(_)) {
        b.extend([("M", Elem::F32, false), ("E", Elem::F32, false)]);
    }
    b.extend([("WS", Elem::F32, true), ("LSE", Elem::F32, true), ("T", Elem::F32, true)]);
    if log_prob {
        b.push(("LP", Elem::F32, true));
    }
    let lse = match lse {
        Lse::Loop => {
            "    var mx = bitcast<f32>(0xff800000u);
    for (var c = 0u; c < C; c = c + 1u) { mx = max(mx, X[(n * C + c) * D + j]); }
    var se = 0.0;
    for (var c = 0u; c < C; c = c + 1u) { se = se + exp(X[(n * C + c) * D + j] - mx); }
    let lse = mx + log(se);"
        }
        Lse::Chunks(_) => {
            "    let Q = P[6];
    var mx = bitcast<f32>(0xff800000u);
    for (var q = 0u; q < Q; q = q + 1u) { mx = max(mx, M[i * Q + q]); }
    var se = 0.0;
    for (var q = 0u; q < Q; q = q + 1u) {
        if (M[i * Q + q] > bitcast<f32>(0xff800000u)) { se = se + E[i * Q + q] * exp(M[i * Q + q] - mx); }
    }
    let lse = mx + log(se);"
        }
        Lse::None => "    let lse = 0.0;",
    };
    let w = if weights { "Wt[u32(lab)]" } else { "1.0" };
    let lp = if log_prob {
        "    for (var c = 0u; c < C; c = c + 1u) { LP[(n * C + c) * D + j] = X[(n * C + c) * D + j] - lse; }\n"
    } else {
        ""
    };
    let body = format!(
        "    let C = P[1]; let D = P[2];
    let n = i / D; let j = i % D;
{lse}
    LSE[i] = lse;
{lp}    let lab = L[i];
    if ((P[4] == 1u && lab == bitcast<i32>(P[5])) || lab < 0 || u32(lab) >= C) {{
        WS[i] = 0.0;
        T[i] = 0.0;
        return;
    }}
    let w = {w};
    WS[i] = w;
    T[i] = -w * (X[(n * C + u32(lab)) * D + j] - lse);"
    );
    source(&b, "", &body)
}

/// One invocation: `Y[0]` = Σ T (sum) or Σ T / Σ WS (mean); or, for none, `Y[s] = T[s]` per
/// sample. `P = [count, S, reduction]`.
pub fn reduce_src() -> String {
    let body = "    if (P[2] == 0u) { Y[i] = T[i]; return; }
    var t = 0.0;
    var w = 0.0;
    for (var s = 0u; s < P[1]; s = s + 1u) { t = t + T[s]; w = w + WS[s]; }
    Y[0] = select(t, t / w, P[2] == 2u);";
    source(&[("T", Elem::F32, false), ("WS", Elem::F32, false), ("Y", Elem::F32, true)], "", body)
}

/// One invocation: `Y[0]` = Σ WS, the mean's divisor. `P = [1, S]`.
pub fn weight_sum_src() -> String {
    let body = "    var w = 0.0;
    for (var s = 0u; s < P[1]; s = s + 1u) { w = w + WS[s]; }
    Y[0] = w;";
    source(&[("WS", Elem::F32, false), ("Y", Elem::F32, true)], "", body)
}

/// The bindings of the gradient kernels: the loss's gradient, the scores, the labels, the
/// samples' weights and log-sum-exps, the mean's divisor; the scores' gradient.
const GRAD_BINDINGS: [Binding<'static>; 7] = [
    ("DL", Elem::F32, false),
    ("X", Elem::F32, false),
    ("L", Elem::I32, false),
    ("WS", Elem::F32, false),
    ("LSE", Elem::F32, false),
    ("W", Elem::F32, false),
    ("DX", Elem::F32, true),
];

/// The gradient per score element `e = (n·C + c)·D + j`: `f = dL·WS[s]` (over `W[0]` = Σ WS
/// for mean), `dX = f·(softmax − onehot)` or `−f·onehot`. `P = [count, C, D, S, reduction]`.
pub fn grad_src(softmax: bool) -> String {
    let d = if softmax { "f * (exp(X[i] - LSE[s]) - hot)" } else { "-f * hot" };
    let body = format!(
        "    let C = P[1]; let D = P[2];
    let j = i % D; let c = (i / D) % C; let n = i / (D * C);
    let s = n * D + j;
    var scale = DL[0];
    if (P[4] == 0u) {{ scale = DL[s]; }}
    if (P[4] == 2u) {{ scale = scale / W[0]; }}
    let f = scale * WS[s];
    let hot = select(0.0, 1.0, WS[s] != 0.0 && L[s] == i32(c));
    DX[i] = {d};"
    );
    source(&GRAD_BINDINGS, "", &body)
}

/// The per-sample buffers of a loss's kernels (weights, log-sum-exps, terms) and how the
/// log-sum-exps were found.
struct Samples {
    ws: Buf,
    lse: Buf,
    t: Buf,
    mode: Lse,
}

/// Adds the samples' kernel of a loss over scores of `(s, cl, d)` ([`dims`]): `bufs` holds the
/// scores, the labels and the class weights if any. Over many classes the log-sum-exp's chunks
/// run first ([`chunks_src`]); with one loop over the classes it also writes the
/// log-probabilities into output 1 when `log_prob`.
fn samples(
    c: &mut Compiled,
    (s, cl, d): (usize, usize, usize),
    softmax: bool,
    red: [u32; 3],
    log_prob: bool,
    mut bufs: Vec<Buf>,
) -> Samples {
    let weights = bufs.len() > 2;
    let (ws, lse, t) = (c.temp(vec![s], DType::Float), c.temp(vec![s], DType::Float), c.temp(vec![s], DType::Float));
    let q = ir::ops::loss::lse_chunks(cl);
    let mode = match () {
        _ if !softmax => Lse::None,
        _ if q <= 1 => Lse::Loop,
        _ => Lse::Chunks(q),
    };
    if s == 0 {
        return Samples { ws, lse, t, mode };
    }
    let mut p = vec![s as u32, cl as u32, d as u32, red[0], red[1], red[2]];
    if let Lse::Chunks(q) = mode {
        let (m, e) = (c.temp(vec![s * q], DType::Float), c.temp(vec![s * q], DType::Float));
        let chunk = ir::ops::loss::LSE_CHUNK;
        let pc = vec![(s * q) as u32, cl as u32, d as u32, q as u32, chunk as u32];
        c.launch_loop(chunks_src(), vec![bufs[0], m, e], pc, groups(s * q), 2 * chunk as u64);
        bufs.extend([m, e]);
        p.push(q as u32);
    }
    bufs.extend([ws, lse, t]);
    let in_loop = log_prob && mode == Lse::Loop;
    if in_loop {
        bufs.push(Buf::Out(1));
    }
    // Loop iterations of one invocation.
    let trips = match mode {
        Lse::None => 0,
        Lse::Loop => (cl * (2 + usize::from(in_loop))) as u64,
        Lse::Chunks(q) => 2 * q as u64,
    };
    c.launch_loop(samples_src(mode, weights, in_loop), bufs, p, groups(s), trips);
    Samples { ws, lse, t, mode }
}

/// The softmax loss's gradient per sample `s` and chunk `q` of [`ir::ops::loss::LSE_CHUNK`]
/// classes (invocation `s·Q + q`): `dX = f·(softmax − onehot)` over the chunk's scores, `f` as
/// in [`grad_src`]. `P = [S·Q, C, D, S, reduction, Q, chunk]`.
pub fn grad_chunks_src() -> String {
    let body = "    let C = P[1]; let D = P[2]; let Q = P[5]; let B = P[6];
    let s = i / Q; let q = i % Q;
    let n = s / D; let j = s % D;
    var scale = DL[0];
    if (P[4] == 0u) { scale = DL[s]; }
    if (P[4] == 2u) { scale = scale / W[0]; }
    let f = scale * WS[s];
    let lab = select(-1, L[s], WS[s] != 0.0);
    let lse = LSE[s];
    let c1 = min(q * B + B, C);
    for (var c = q * B; c < c1; c = c + 1u) {
        let e = (n * C + c) * D + j;
        DX[e] = f * (exp(X[e] - lse) - select(0.0, 1.0, lab == i32(c)));
    }";
    source(&GRAD_BINDINGS, "", body)
}

/// `(S, C, D)` of scores of this shape.
fn dims(shape: &[usize]) -> Option<(usize, usize, usize)> {
    (shape.len() >= 2).then(|| {
        let d: usize = shape[2..].iter().product();
        (shape[0] * d, shape[1], d)
    })
}

fn forward(cx: &CompileCx<'_>, softmax: bool, red: Option<[u32; 3]>) -> CompileResult {
    let (Some(x), Some(l), Some(red)) = (cx.input(0), cx.input(1), red) else { return Ok(None) };
    let Some((s, cl, d)) = dims(&x.shape) else { return Ok(None) };
    if x.elem() != Elem::F32 || l.elem() != Elem::I32 {
        return Ok(None);
    }
    let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
    let log_prob = softmax && cx.outs.len() > 1 && cx.outs[1].is_some();
    if log_prob {
        c.outputs.push(OutSpec { shape: x.shape.clone(), dtype: x.dtype, view_of: None });
    }
    let mut bufs = vec![Buf::In(0), Buf::In(1)];
    if cx.input(2).is_some() {
        bufs.push(Buf::In(2));
    }
    let Samples { ws, lse, t, mode } = samples(&mut c, (s, cl, d), softmax, red, log_prob, bufs);
    // The log-probabilities: in the samples' loop over the classes, or from the log-sum-exps
    // after it when chunks found them.
    if s > 0 && log_prob && mode != Lse::Loop {
        let n = x.numel();
        c.launch(log_prob_src(), vec![Buf::In(0), lse, Buf::Out(1)], vec![n as u32, cl as u32, d as u32], groups(n));
    }
    let count = if red[0] == 0 { s } else { 1 };
    let trips = if red[0] == 0 { 0 } else { s as u64 };
    c.launch_loop(reduce_src(), vec![t, ws, Buf::Out(0)], vec![count as u32, s as u32, red[0]], groups(count), trips);
    Ok(Some(c))
}

fn backward(cx: &CompileCx<'_>, softmax: bool, red: Option<[u32; 3]>) -> CompileResult {
    let (Some(_), Some(x), Some(l), Some(red)) = (cx.input(0), cx.input(1), cx.input(2), red) else { return Ok(None) };
    let Some((s, cl, d)) = dims(&x.shape) else { return Ok(None) };
    if x.elem() != Elem::F32 || l.elem() != Elem::I32 {
        return Ok(None);
    }
    let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
    let mut bufs = vec![Buf::In(1), Buf::In(2)];
    if cx.input(3).is_some() {
        bufs.push(Buf::In(3));
    }
    let Samples { ws, lse, mode, .. } = samples(&mut c, (s, cl, d), softmax, red, false, bufs);
    if s > 0 {
        // The mean's divisor, summed once (not by every element's invocation).
        let w = c.temp(vec![1], DType::Float);
        if red[0] == 2 {
            c.launch_loop(weight_sum_src(), vec![ws, w], vec![1, s as u32], groups(1), s as u64);
        }
        let bufs = vec![Buf::In(0), Buf::In(1), Buf::In(2), ws, lse, w, Buf::Out(0)];
        if let Lse::Chunks(q) = mode {
            // Over many classes, one invocation per sample and chunk (its factor found once,
            // not decoded per element).
            let chunk = ir::ops::loss::LSE_CHUNK;
            let p = vec![(s * q) as u32, cl as u32, d as u32, s as u32, red[0], q as u32, chunk as u32];
            c.launch_loop(grad_chunks_src(), bufs, p, groups(s * q), chunk as u64);
        } else {
            let n = x.numel();
            let p = vec![n as u32, cl as u32, d as u32, s as u32, red[0]];
            c.launch_loop(grad_src(softmax), bufs, p, groups(n), 0);
        }
    }
    Ok(Some(c))
}

impl Kernel for op::SoftmaxCrossEntropyLoss {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        forward(cx, true, reduction(self.reduction(), self.ignore_index))
    }
}

impl Kernel for op::NegativeLogLikelihoodLoss {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        forward(cx, false, reduction(self.reduction(), self.ignore_index))
    }
}

impl Kernel for op::SoftmaxCrossEntropyLossGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        backward(cx, true, reduction(self.reduction(), self.ignore_index))
    }
}

impl Kernel for op::NegativeLogLikelihoodLossGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        backward(cx, false, reduction(self.reduction(), self.ignore_index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn loss_kernels_validate() {
        for lse in [Lse::None, Lse::Loop, Lse::Chunks(2)] {
            for weights in [false, true] {
                validate("loss samples", &samples_src(lse, weights, lse == Lse::Loop));
            }
        }
        for softmax in [false, true] {
            validate("loss grad", &grad_src(softmax));
        }
        validate("loss chunks", &chunks_src());
        validate("loss grad chunks", &grad_chunks_src());
        validate("loss log-probabilities", &log_prob_src());
        validate("loss reduce", &reduce_src());
        validate("loss weight sum", &weight_sum_src());
    }
}
