//! WGSL kernels for reductions, normalizations, contractions, windows, data movement and
//! recurrent layers (see [`super::kernels`] for the scheme).

use ir::{DType, Graph, NodeId, Op, Value};

use super::kernels::{Binding, MATH_FNS, dims, float_attr, int_attr, ints_attr, source, specialize, str_attr, strides};
use super::{Elem, GpuExecutor, GpuTensor};

fn norm_axis(a: i64, r: usize) -> usize {
    (if a < 0 { a + r as i64 } else { a }).clamp(0, r.max(1) as i64 - 1) as usize
}

/// Reduction kinds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Red {
    /// Σ
    Sum,
    /// mean
    Mean,
    /// max
    Max,
    /// min
    Min,
    /// Π
    Prod,
    /// Σ|x|
    L1,
    /// √Σx²
    L2,
    /// Σx²
    SumSquare,
    /// log Σ
    LogSum,
    /// log Σ exp
    LogSumExp,
    /// index of the max
    ArgMax,
    /// index of the min
    ArgMin,
}

/// Source of a reduction kernel: one invocation per output element, looping over the reduced
/// sub-box. `P = [count, rank, in_shape[r], reduced[r] (0/1), last_index]`.
pub fn reduce_src(red: Red, xe: Elem, ye: Elem) -> String {
    let t = xe.wgsl();
    let (init, step, fin) = match red {
        Red::Sum | Red::Mean => (format!("{t}(0)"), "acc = acc + v;".to_string(), "acc".to_string()),
        Red::Max | Red::ArgMax => (
            if xe == Elem::F32 { "bitcast<f32>(0xff800000u)".into() } else { "-2147483647 - 1".into() },
            "acc = max(acc, v);".into(),
            "acc".into(),
        ),
        Red::Min | Red::ArgMin => (
            if xe == Elem::F32 { "bitcast<f32>(0x7f800000u)".into() } else { "2147483647".into() },
            "acc = min(acc, v);".into(),
            "acc".into(),
        ),
        Red::Prod => (format!("{t}(1)"), "acc = acc * v;".into(), "acc".into()),
        Red::L1 => (format!("{t}(0)"), "acc = acc + abs(v);".into(), "acc".into()),
        Red::L2 => ("0.0".into(), "acc = acc + f32(v) * f32(v);".into(), "sqrt(acc)".into()),
        Red::SumSquare => (format!("{t}(0)"), "acc = acc + v * v;".into(), "acc".into()),
        Red::LogSum => ("0.0".into(), "acc = acc + f32(v);".into(), "log(acc)".into()),
        Red::LogSumExp => ("0.0".into(), "acc = acc + exp(f32(v) - m);".into(), "m + log(acc)".into()),
    };
    let arg = matches!(red, Red::ArgMax | Red::ArgMin);
    let cmp = if red == Red::ArgMax { ">" } else { "<" };
    let mut body = String::from(
        "    let r = P[1];
    // Base offset of this output element, and the reduced extent.
    var rem = i;
    var base = 0u;
    var stride = 1u;
    var total = 1u;
    for (var t = 0u; t < r; t = t + 1u) {
        let d = r - 1u - t;
        let dim = P[2u + d];
        if (P[2u + r + d] == 0u) {
            let c = rem % dim;
            rem = rem / dim;
            base = base + c * stride;
        } else {
            total = total * dim;
        }
        stride = stride * dim;
    }
",
    );
    // Offset of the j-th element of the reduced sub-box.
    let offset = "        var jr = j;
        var off = base;
        var st = 1u;
        for (var t = 0u; t < r; t = t + 1u) {
            let d = r - 1u - t;
            let dim = P[2u + d];
            if (P[2u + r + d] != 0u) {
                off = off + (jr % dim) * st;
                jr = jr / dim;
            }
            st = st * dim;
        }
";
    if red == Red::LogSumExp {
        body.push_str(&format!("    var m = bitcast<f32>(0xff800000u);\n    for (var j = 0u; j < total; j = j + 1u) {{\n{offset}        m = max(m, f32(X[off]));\n    }}\n"));
    }
    body.push_str(&format!("    var acc = {init};\n"));
    if arg {
        body.push_str(&format!(
            "    var best = 0u;\n    for (var j = 0u; j < total; j = j + 1u) {{\n{offset}        let v = X[off];\n        if (j == 0u || v {cmp} acc || (P[2u + 2u * r] != 0u && v == acc)) {{ acc = v; best = j; }}\n    }}\n    Y[i] = i32(best);\n"
        ));
    } else {
        body.push_str(&format!(
            "    for (var j = 0u; j < total; j = j + 1u) {{\n{offset}        let v = X[off];\n        {step}\n    }}\n"
        ));
        let mean = if red == Red::Mean { format!(" / {t}(total)") } else { String::new() };
        let conv = if ye == Elem::F32 { format!("f32({fin}{mean})") } else { format!("i32({fin}{mean})") };
        body.push_str(&format!("    Y[i] = {conv};\n"));
    }
    source(&[("X", xe, false), ("Y", ye, true)], MATH_FNS, &body)
}

fn reduce(
    e: &mut GpuExecutor,
    x: &GpuTensor,
    axes: &[usize],
    red: Red,
    oshape: Vec<usize>,
    odt: DType,
    last: bool,
) -> Result<GpuTensor, String> {
    let out = e.output(oshape, odt);
    let r = x.shape.len();
    let mut params = vec![out.numel() as u32, r as u32];
    params.extend(x.shape.iter().map(|&d| d as u32));
    params.extend((0..r).map(|d| axes.contains(&d) as u32));
    params.push(last as u32);
    let src = reduce_src(red, x.elem(), out.elem());
    e.launch(&src, &[&x.buf, &out.buf], &params, GpuExecutor::groups(out.numel()))?;
    Ok(out)
}

/// Source of a row kernel over `axis_len` elements `inner` apart: softmax, log-softmax,
/// hardmax. `P = [rows, axis_len, inner]`.
pub fn softmax_src(kind: &str) -> String {
    let write = match kind {
        "log" => "Y[idx] = (X[idx] - m) - log(s);",
        "hard" => "Y[idx] = select(0.0, 1.0, k == arg);",
        _ => "Y[idx] = exp(X[idx] - m) / s;",
    };
    let body = format!(
        "    let len = P[1];
    let inner = P[2];
    let base = (i / inner) * len * inner + i % inner;
    var m = bitcast<f32>(0xff800000u);
    var arg = 0u;
    for (var k = 0u; k < len; k = k + 1u) {{
        let v = X[base + k * inner];
        if (v > m) {{ m = v; arg = k; }}
    }}
    var s = 0.0;
    for (var k = 0u; k < len; k = k + 1u) {{
        s = s + exp(X[base + k * inner] - m);
    }}
    for (var k = 0u; k < len; k = k + 1u) {{
        let idx = base + k * inner;
        {write}
    }}"
    );
    source(&[("X", Elem::F32, false), ("Y", Elem::F32, true)], "", &body)
}

/// Layer norm over contiguous rows of `len`: `P = [rows, len, scale_len, bias_len, eps_bits]`.
pub fn layernorm_src(with_bias: bool, stats: bool) -> String {
    let mut b: Vec<Binding<'_>> = vec![("X", Elem::F32, false), ("S", Elem::F32, false)];
    if with_bias {
        b.push(("B", Elem::F32, false));
    }
    b.push(("Y", Elem::F32, true));
    if stats {
        b.push(("MEAN", Elem::F32, true));
        b.push(("INV", Elem::F32, true));
    }
    let bias = if with_bias { "+ B[k % P[3]]" } else { "" };
    let st = if stats { "    MEAN[i] = mean;\n    INV[i] = inv;\n" } else { "" };
    let body = format!(
        "    let len = P[1];
    let base = i * len;
    var mean = 0.0;
    for (var k = 0u; k < len; k = k + 1u) {{ mean = mean + X[base + k]; }}
    mean = mean / f32(len);
    var var_ = 0.0;
    for (var k = 0u; k < len; k = k + 1u) {{ let d = X[base + k] - mean; var_ = var_ + d * d; }}
    var_ = var_ / f32(len);
    let inv = 1.0 / sqrt(var_ + bitcast<f32>(P[4]));
    for (var k = 0u; k < len; k = k + 1u) {{
        Y[base + k] = (X[base + k] - mean) * inv * S[k % P[2]] {bias};
    }}
{st}"
    );
    source(&b, "", &body)
}

/// Per-channel affine normalization (inference batch norm):
/// `P = [count, channels, inner, eps_bits]`.
pub fn batchnorm_src() -> String {
    let body = "    let c = (i / P[2]) % P[1];
    Y[i] = (X[i] - M[c]) / sqrt(V[c] + bitcast<f32>(P[3])) * S[c] + B[c];";
    source(
        &[
            ("X", Elem::F32, false),
            ("S", Elem::F32, false),
            ("B", Elem::F32, false),
            ("M", Elem::F32, false),
            ("V", Elem::F32, false),
            ("Y", Elem::F32, true),
        ],
        "",
        body,
    )
}

/// Instance norm over contiguous rows (one per sample and channel):
/// `P = [rows, len, channels, eps_bits]`.
pub fn instancenorm_src() -> String {
    let body = "    let len = P[1];
    let base = i * len;
    let c = i % P[2];
    var mean = 0.0;
    for (var k = 0u; k < len; k = k + 1u) { mean = mean + X[base + k]; }
    mean = mean / f32(len);
    var v = 0.0;
    for (var k = 0u; k < len; k = k + 1u) { let d = X[base + k] - mean; v = v + d * d; }
    let inv = 1.0 / sqrt(v / f32(len) + bitcast<f32>(P[3]));
    for (var k = 0u; k < len; k = k + 1u) { Y[base + k] = (X[base + k] - mean) * inv * S[c] + B[c]; }";
    source(
        &[("X", Elem::F32, false), ("S", Elem::F32, false), ("B", Elem::F32, false), ("Y", Elem::F32, true)],
        "",
        body,
    )
}

/// Tiled GEMM: `Y[b, m, n] = alpha · Σ_k A[a_off(b) + m·ars + k·acs] · B[b_off(b) + k·brs + n·bcs]
/// (+ beta · C[c_off(b) + m·crs + n·ccs])`. 16×16 tiles in workgroup memory; one workgroup
/// per output tile and batch entry. `P = [M, N, K, ars, acs, brs, bcs, crs, ccs, nb,
/// batch dims[4], a batch strides[4], b batch strides[4], c batch strides[4], a_base, b_base,
/// c_base, alpha_bits, beta_bits]`.
pub fn gemm_src(with_c: bool) -> String {
    let c_binding = if with_c { "@group(0) @binding(2) var<storage, read> C: array<f32>;\n" } else { "" };
    let (yb, pb) = if with_c { (3, 4) } else { (2, 3) };
    let c_term = if with_c {
        "        let coff = P[28] + cb + row * P[7] + col * P[8];\n        v = v + bitcast<f32>(P[30]) * C[coff];\n"
    } else {
        ""
    };
    format!(
        "@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
{c_binding}@group(0) @binding({yb}) var<storage, read_write> Y: array<f32>;
@group(0) @binding({pb}) var<storage, read> P: array<u32>;
var<workgroup> TA: array<f32, 256>;
var<workgroup> TB: array<f32, 256>;
@compute @workgroup_size(16, 16)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {{
    let M = P[0];
    let N = P[1];
    let K = P[2];
    let row = wid.y * 16u + lid.y;
    let col = wid.x * 16u + lid.x;
    // Batch offsets.
    var rem = wid.z;
    var ab = 0u;
    var bb = 0u;
    var cb = 0u;
    let nb = P[9];
    for (var t = 0u; t < nb; t = t + 1u) {{
        let d = nb - 1u - t;
        let dim = P[10u + d];
        let c = rem % dim;
        rem = rem / dim;
        ab = ab + c * P[14u + d];
        bb = bb + c * P[18u + d];
        cb = cb + c * P[22u + d];
    }}
    var acc = 0.0;
    let tiles = (K + 15u) / 16u;
    for (var t = 0u; t < tiles; t = t + 1u) {{
        let ka = t * 16u + lid.x;
        let kb = t * 16u + lid.y;
        let va = A[P[26] + ab + min(row, M - 1u) * P[3] + min(ka, K - 1u) * P[4]];
        let vb = B[P[27] + bb + min(kb, K - 1u) * P[5] + min(col, N - 1u) * P[6]];
        TA[lid.y * 16u + lid.x] = select(0.0, va, row < M && ka < K);
        TB[lid.y * 16u + lid.x] = select(0.0, vb, kb < K && col < N);
        workgroupBarrier();
        for (var k = 0u; k < 16u; k = k + 1u) {{
            acc = acc + TA[lid.y * 16u + k] * TB[k * 16u + lid.x];
        }}
        workgroupBarrier();
    }}
    if (row < M && col < N) {{
        var v = bitcast<f32>(P[29]) * acc;
{c_term}        Y[wid.z * M * N + row * N + col] = v;
    }}
}}
"
    )
}

/// Register-tiled GEMM: each invocation computes a 4×4 block of `Y` with no workgroup memory
/// (barriers are costly on CPU-backed drivers such as lavapipe); an 8×8 workgroup covers a
/// 32×32 tile. Parameters as [`gemm_src`].
pub fn gemm_rt_src(with_c: bool) -> String {
    let c_binding = if with_c { "@group(0) @binding(2) var<storage, read> C: array<f32>;\n" } else { "" };
    let (yb, pb) = if with_c { (3, 4) } else { (2, 3) };
    let c_term = if with_c { "v = v + bitcast<f32>(P[30]) * C[P[28] + cb + row * P[7] + col * P[8]];" } else { "" };
    format!(
        "@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
{c_binding}@group(0) @binding({yb}) var<storage, read_write> Y: array<f32>;
@group(0) @binding({pb}) var<storage, read> P: array<u32>;
@compute @workgroup_size(8, 8)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {{
    let M = P[0];
    let N = P[1];
    let K = P[2];
    let row0 = wid.y * 32u + lid.y * 4u;
    let col0 = wid.x * 32u + lid.x * 4u;
    if (row0 >= M || col0 >= N) {{ return; }}
    var rem = wid.z;
    var ab = 0u;
    var bb = 0u;
    var cb = 0u;
    let nb = P[9];
    for (var t = 0u; t < nb; t = t + 1u) {{
        let d = nb - 1u - t;
        let dim = P[10u + d];
        let c = rem % dim;
        rem = rem / dim;
        ab = ab + c * P[14u + d];
        bb = bb + c * P[18u + d];
        cb = cb + c * P[22u + d];
    }}
    let abase = P[26] + ab;
    let bbase = P[27] + bb;
    let ars = P[3]; let acs = P[4]; let brs = P[5]; let bcs = P[6];
    let r0 = abase + min(row0, M - 1u) * ars;
    let r1 = abase + min(row0 + 1u, M - 1u) * ars;
    let r2 = abase + min(row0 + 2u, M - 1u) * ars;
    let r3 = abase + min(row0 + 3u, M - 1u) * ars;
    let c0 = bbase + min(col0, N - 1u) * bcs;
    let c1 = bbase + min(col0 + 1u, N - 1u) * bcs;
    let c2 = bbase + min(col0 + 2u, N - 1u) * bcs;
    let c3 = bbase + min(col0 + 3u, N - 1u) * bcs;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k = 0u; k < K; k = k + 1u) {{
        let ka = k * acs;
        let kb = k * brs;
        let bv = vec4<f32>(B[c0 + kb], B[c1 + kb], B[c2 + kb], B[c3 + kb]);
        acc0 = acc0 + A[r0 + ka] * bv;
        acc1 = acc1 + A[r1 + ka] * bv;
        acc2 = acc2 + A[r2 + ka] * bv;
        acc3 = acc3 + A[r3 + ka] * bv;
    }}
    let alpha = bitcast<f32>(P[29]);
    var accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var r = 0u; r < 4u; r = r + 1u) {{
        let row = row0 + r;
        if (row >= M) {{ break; }}
        for (var q = 0u; q < 4u; q = q + 1u) {{
            let col = col0 + q;
            if (col >= N) {{ break; }}
            var v = alpha * accs[r][q];
            {c_term}
            Y[wid.z * M * N + row * N + col] = v;
        }}
    }}
}}
"
    )
}

/// A GEMM launch description.
pub struct Gemm<'a> {
    pub a: &'a GpuTensor,
    pub b: &'a GpuTensor,
    pub c: Option<&'a GpuTensor>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// (row stride, col stride) of A, B, C.
    pub a_st: (usize, usize),
    pub b_st: (usize, usize),
    pub c_st: (usize, usize),
    /// Batch dims and per-operand batch strides.
    pub batch: Vec<usize>,
    pub a_bst: Vec<usize>,
    pub b_bst: Vec<usize>,
    pub c_bst: Vec<usize>,
    pub bases: (usize, usize, usize),
    pub alpha: f32,
    pub beta: f32,
}

/// Runs a GEMM into a new tensor of `out_shape`.
pub fn gemm(e: &mut GpuExecutor, g: &Gemm<'_>, out_shape: Vec<usize>) -> Result<GpuTensor, String> {
    if g.batch.len() > 4 {
        return Err("more than 4 batch dims".into());
    }
    let out = e.output(out_shape, DType::Float);
    let pad4 = |v: &[usize], fill: u32| -> Vec<u32> {
        let mut o: Vec<u32> = v.iter().map(|&x| x as u32).collect();
        o.resize(4, fill);
        o
    };
    let mut p: Vec<u32> = vec![
        g.m as u32,
        g.n as u32,
        g.k as u32,
        g.a_st.0 as u32,
        g.a_st.1 as u32,
        g.b_st.0 as u32,
        g.b_st.1 as u32,
        g.c_st.0 as u32,
        g.c_st.1 as u32,
        g.batch.len() as u32,
    ];
    p.extend(pad4(&g.batch, 1));
    p.extend(pad4(&g.a_bst, 0));
    p.extend(pad4(&g.b_bst, 0));
    p.extend(pad4(&g.c_bst, 0));
    p.extend([g.bases.0 as u32, g.bases.1 as u32, g.bases.2 as u32, g.alpha.to_bits(), g.beta.to_bits()]);
    let nbatch: usize = g.batch.iter().product::<usize>().max(1);
    let groups = [g.n.div_ceil(32) as u32, g.m.div_ceil(32) as u32, nbatch as u32];
    if g.m == 0 || g.n == 0 {
        return Ok(out);
    }
    if g.k == 0 {
        return Err("empty reduction".into());
    }
    match g.c {
        Some(c) => e.launch(&gemm_rt_src(true), &[&g.a.buf, &g.b.buf, &c.buf, &out.buf], &p, groups)?,
        None => e.launch(&gemm_rt_src(false), &[&g.a.buf, &g.b.buf, &out.buf], &p, groups)?,
    }
    Ok(out)
}

/// Direct N-d convolution (N ≤ 3, as 3-d). One invocation per output element.
/// `P = [count, N, C, M, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]`.
pub fn conv_src(bias: bool) -> String {
    let mut b: Vec<Binding<'_>> = vec![("X", Elem::F32, false), ("Wt", Elem::F32, false)];
    if bias {
        b.push(("Bs", Elem::F32, false));
    }
    b.push(("Y", Elem::F32, true));
    let init = if bias { "Bs[m]" } else { "0.0" };
    let body = format!(
        "    let C = P[2]; let M = P[3]; let G = P[4];
    let D = P[5]; let H = P[6]; let W = P[7];
    let OD = P[8]; let OH = P[9]; let OW = P[10];
    let KD = P[11]; let KH = P[12]; let KW = P[13];
    var rem = i;
    let ow = rem % OW; rem = rem / OW;
    let oh = rem % OH; rem = rem / OH;
    let od = rem % OD; rem = rem / OD;
    let m = rem % M; let n = rem / M;
    let cg = C / G;
    let c0 = (m / (M / G)) * cg;
    var acc = {init};
    for (var c = 0u; c < cg; c = c + 1u) {{
        for (var kd = 0u; kd < KD; kd = kd + 1u) {{
            let id = i32(od * P[14] + kd * P[17]) - i32(P[20]);
            if (id < 0 || id >= i32(D)) {{ continue; }}
            for (var kh = 0u; kh < KH; kh = kh + 1u) {{
                let ih = i32(oh * P[15] + kh * P[18]) - i32(P[21]);
                if (ih < 0 || ih >= i32(H)) {{ continue; }}
                for (var kw = 0u; kw < KW; kw = kw + 1u) {{
                    let iw = i32(ow * P[16] + kw * P[19]) - i32(P[22]);
                    if (iw < 0 || iw >= i32(W)) {{ continue; }}
                    let xo = (((n * C + c0 + c) * D + u32(id)) * H + u32(ih)) * W + u32(iw);
                    let wo = (((m * cg + c) * KD + kd) * KH + kh) * KW + kw;
                    acc = acc + X[xo] * Wt[wo];
                }}
            }}
        }}
    }}
    Y[i] = acc;"
    );
    source(&b, "", &body)
}

/// im2col for a grouped N-d convolution (as 3-d): `COL[(b, k, p)]` with `b = n·G + g`,
/// or, `wide`, `COL[(g, k, n, p)]` (one GEMM per group over all images, for small outputs),
/// `k = (c, kd, kh, kw)` within the group, `p = (od, oh, ow)`; zero outside the input. One
/// invocation per row `(b, k)` walks the output positions (no divisions in the inner loop).
/// `P = [rows, C, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]`.
pub fn im2col_src(wide: bool) -> String {
    let out = if wide { "((g * kk + k) * (P[0] / (G * kk)) + n) * npos" } else { "i * npos" };
    let body = format!(
        "    let C = P[1]; let G = P[2];
    let D = P[3]; let H = P[4]; let W = P[5];
    let OD = P[6]; let OH = P[7]; let OW = P[8];
    let KD = P[9]; let KH = P[10]; let KW = P[11];
    let cg = C / G;
    let npos = OD * OH * OW;
    let kk = cg * KD * KH * KW;
    let k = i % kk; let b = i / kk;
    let kw = k % KW; let kh = (k / KW) % KH; let kd = (k / (KW * KH)) % KD; let c = k / (KW * KH * KD);
    let n = b / G; let g = b % G;
    let plane = ((n * C + g * cg + c) * D) * H * W;
    var out = {out};
    for (var od = 0u; od < OD; od = od + 1u) {{
        let id = i32(od * P[12] + kd * P[15]) - i32(P[18]);
        let din = id >= 0 && id < i32(D);
        for (var oh = 0u; oh < OH; oh = oh + 1u) {{
            let ih = i32(oh * P[13] + kh * P[16]) - i32(P[19]);
            let hin = din && ih >= 0 && ih < i32(H);
            let rowbase = plane + (u32(max(id, 0)) * H + u32(max(ih, 0))) * W;
            var iw = i32(kw * P[17]) - i32(P[20]);
            for (var ow = 0u; ow < OW; ow = ow + 1u) {{
                var v = 0.0;
                if (hin && iw >= 0 && iw < i32(W)) {{ v = X[rowbase + u32(iw)]; }}
                COL[out] = v;
                out = out + 1u;
                iw = iw + i32(P[14]);
            }}
        }}
    }}"
    );
    source(&[("X", Elem::F32, false), ("COL", Elem::F32, true)], "", &body)
}

/// Largest im2col scratch buffer (elements) the GEMM path of a convolution may allocate;
/// larger convolutions use the direct kernel.
const IM2COL_MAX_ELEMS: usize = 1 << 25;

/// Convolution as im2col + one batched GEMM over `(n, g)`: `Y[n, g·Mg + m, p] =
/// Σ_k W[g·Mg + m, k] · COL[n·G + g, k, p] (+ bias[g·Mg + m])`. `p` is the parameter vector
/// of [`conv_src`]. Returns `None` (direct kernel) for tiny reductions or when the column
/// buffer would be too large.
fn conv_im2col(
    e: &mut GpuExecutor,
    x: &GpuTensor,
    w: &GpuTensor,
    bias: Option<&GpuTensor>,
    p: &[u32],
    oshape: &[usize],
) -> Result<Option<GpuTensor>, String> {
    let [_, n, c, m, g] = [p[0], p[1], p[2], p[3], p[4]].map(|v| v as usize);
    let npos = (p[8] * p[9] * p[10]) as usize;
    let kvol = (p[11] * p[12] * p[13]) as usize;
    let (cg, mg) = (c / g, m / g);
    let kk = cg * kvol;
    let rows = n * g * kk;
    if kk < 16 || mg < 4 || npos == 0 || rows * npos > IM2COL_MAX_ELEMS {
        return Ok(None);
    }
    let col = e.output(vec![rows, npos], DType::Float);
    // [rows, C, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]
    let mut q: Vec<u32> = vec![rows as u32, c as u32, g as u32];
    q.extend_from_slice(&p[5..]);
    // Few output positions per image make thin GEMMs; then one GEMM per group spans all
    // images (`wide`) and a permutation puts the images back in front.
    let wide = n > 1 && npos < WIDE_BELOW;
    e.launch(&specialize(&im2col_src(wide), &q), &[&x.buf, &col.buf], &q, GpuExecutor::groups(rows))?;
    let (cols, b_bst) = if wide { (n * npos, vec![0, kk * n * npos]) } else { (npos, vec![g * kk * npos, kk * npos]) };
    let spec = Gemm {
        a: w,
        b: &col,
        c: bias,
        m: mg,
        n: cols,
        k: kk,
        a_st: (kk, 1),
        b_st: (cols, 1),
        c_st: (1, 0),
        batch: vec![if wide { 1 } else { n }, g],
        a_bst: vec![0, mg * kk],
        b_bst,
        c_bst: vec![0, mg],
        bases: (0, 0, 0),
        alpha: 1.0,
        beta: 1.0,
    };
    if !wide {
        return Ok(Some(gemm(e, &spec, oshape.to_vec())?));
    }
    // `T[g, m, n, p]` → `Y[n, g, m, p]`.
    let t = gemm(e, &spec, vec![g, mg, n, npos])?;
    let axes = [Axis::Same(npos), Axis::Same(mg * n * npos), Axis::Same(n * npos), Axis::Same(1)];
    let mut y = remap(e, &t, vec![n, g, mg, npos], &axes, 0.0)?;
    y.shape = oshape.to_vec();
    Ok(Some(y))
}

/// Output positions per image below which a convolution's GEMM spans all images.
const WIDE_BELOW: usize = 64;

/// Transposed convolution, gathering for each output. Weights `[C, M/G, k…]`.
/// `P` as [`conv_src`].
pub fn conv_transpose_src(bias: bool) -> String {
    let mut b: Vec<Binding<'_>> = vec![("X", Elem::F32, false), ("Wt", Elem::F32, false)];
    if bias {
        b.push(("Bs", Elem::F32, false));
    }
    b.push(("Y", Elem::F32, true));
    let init = if bias { "Bs[m]" } else { "0.0" };
    let body = format!(
        "    let C = P[2]; let M = P[3]; let G = P[4];
    let D = P[5]; let H = P[6]; let W = P[7];
    let OD = P[8]; let OH = P[9]; let OW = P[10];
    let KD = P[11]; let KH = P[12]; let KW = P[13];
    var rem = i;
    let ow = rem % OW; rem = rem / OW;
    let oh = rem % OH; rem = rem / OH;
    let od = rem % OD; rem = rem / OD;
    let m = rem % M; let n = rem / M;
    let mg = M / G;
    let cg = C / G;
    let g = m / mg;
    var acc = {init};
    for (var c = g * cg; c < (g + 1u) * cg; c = c + 1u) {{
        for (var kd = 0u; kd < KD; kd = kd + 1u) {{
            let td = i32(od) + i32(P[20]) - i32(kd * P[17]);
            if (td < 0 || td % i32(P[14]) != 0) {{ continue; }}
            let id = td / i32(P[14]);
            if (id >= i32(D)) {{ continue; }}
            for (var kh = 0u; kh < KH; kh = kh + 1u) {{
                let th = i32(oh) + i32(P[21]) - i32(kh * P[18]);
                if (th < 0 || th % i32(P[15]) != 0) {{ continue; }}
                let ih = th / i32(P[15]);
                if (ih >= i32(H)) {{ continue; }}
                for (var kw = 0u; kw < KW; kw = kw + 1u) {{
                    let tw = i32(ow) + i32(P[22]) - i32(kw * P[19]);
                    if (tw < 0 || tw % i32(P[16]) != 0) {{ continue; }}
                    let iw = tw / i32(P[16]);
                    if (iw >= i32(W)) {{ continue; }}
                    let xo = (((n * C + c) * D + u32(id)) * H + u32(ih)) * W + u32(iw);
                    let wo = (((c * mg + (m - g * mg)) * KD + kd) * KH + kh) * KW + kw;
                    acc = acc + X[xo] * Wt[wo];
                }}
            }}
        }}
    }}
    Y[i] = acc;"
    );
    source(&b, "", &body)
}

/// Pooling: `kind` is `max`, `avg` or `lp`. `P = [count, N·C, C, D, H, W, OD, OH, OW, KD, KH,
/// KW, SD, SH, SW, DD, DH, DW, PD, PH, PW, PED, PEH, PEW, count_include_pad, p]`.
pub fn pool_src(kind: &str) -> String {
    let (init, step, fin) = match kind {
        "max" => ("bitcast<f32>(0xff800000u)", "acc = max(acc, v);", "acc"),
        "lp" => ("0.0", "acc = acc + pow(abs(v), f32(P[25]));", "pow(acc, 1.0 / f32(P[25]))"),
        _ => ("0.0", "acc = acc + v;", "acc / f32(select(cnt_valid, cnt_all, P[24] != 0u))"),
    };
    let body = format!(
        "    let D = P[3]; let H = P[4]; let W = P[5];
    let OD = P[6]; let OH = P[7]; let OW = P[8];
    var rem = i;
    let ow = rem % OW; rem = rem / OW;
    let oh = rem % OH; rem = rem / OH;
    let od = rem % OD; rem = rem / OD;
    let nc = rem;
    var acc = {init};
    var cnt_valid = 0u;
    var cnt_all = 0u;
    for (var kd = 0u; kd < P[9]; kd = kd + 1u) {{
        let id = i32(od * P[12] + kd * P[15]) - i32(P[18]);
        if (id >= i32(D) + i32(P[21])) {{ continue; }}
        for (var kh = 0u; kh < P[10]; kh = kh + 1u) {{
            let ih = i32(oh * P[13] + kh * P[16]) - i32(P[19]);
            if (ih >= i32(H) + i32(P[22])) {{ continue; }}
            for (var kw = 0u; kw < P[11]; kw = kw + 1u) {{
                let iw = i32(ow * P[14] + kw * P[17]) - i32(P[20]);
                if (iw >= i32(W) + i32(P[23])) {{ continue; }}
                cnt_all = cnt_all + 1u;
                if (id < 0 || ih < 0 || iw < 0 || id >= i32(D) || ih >= i32(H) || iw >= i32(W)) {{ continue; }}
                cnt_valid = cnt_valid + 1u;
                let v = X[((nc * D + u32(id)) * H + u32(ih)) * W + u32(iw)];
                {step}
            }}
        }}
    }}
    Y[i] = {fin};"
    );
    source(&[("X", Elem::F32, false), ("Y", Elem::F32, true)], "", &body)
}

/// Data movement by per-dim index tables: `Y[i] = X[Σ_d in(c_d)·stride_d]` where `in(c)` is
/// `c` or a table entry (-1: out of bounds, the pad value). The output shape, strides, table
/// offsets (`None`: no table) and pad bits are baked into the source; `P = [count, tables…]`.
pub fn remap_src(e: Elem, shape: &[usize], strides: &[u32], tables: &[Option<u32>], pad_bits: u32) -> String {
    let keep: Vec<bool> = tables.iter().map(Option::is_some).collect();
    // Merge only dims without tables; keep table dims (and their offsets) in place.
    let (ms, mst, mtab) = {
        let mut ms = Vec::new();
        let mut mst = Vec::new();
        let mut mtab: Vec<Option<u32>> = Vec::new();
        for d in 0..shape.len() {
            let merge = !keep[d]
                && !ms.is_empty()
                && mtab.last() == Some(&None)
                && mst.last().copied() == Some(strides[d] * shape[d] as u32);
            if shape[d] == 1 && !keep[d] {
                continue;
            }
            if merge {
                *ms.last_mut().expect("a dim") *= shape[d];
                *mst.last_mut().expect("a dim") = strides[d];
            } else {
                ms.push(shape[d]);
                mst.push(strides[d]);
                mtab.push(tables[d]);
            }
        }
        (ms, mst, mtab)
    };
    let mut body = String::from("    var valid = true;\n");
    let coord = |d: usize, c: &str| -> String {
        match mtab[d] {
            None => c.to_string(),
            Some(off) => format!("tab(&valid, {off}u + {c})"),
        }
    };
    body.push_str(&super::kernels::unrolled_offsets(&ms, &[mst], &coord));
    let pad = if e == Elem::F32 { format!("bitcast<f32>({pad_bits}u)") } else { format!("bitcast<i32>({pad_bits}u)") };
    body.push_str(&format!("    Y[i] = select({pad}, X[o0], valid);"));
    let fns = "fn tab(valid: ptr<function, bool>, at: u32) -> u32 {
    let v = bitcast<i32>(P[at]);
    if (v < 0) { *valid = false; }
    return u32(max(v, 0));
}
";
    source(&[("X", e, false), ("Y", e, true)], fns, &body)
}

/// How each output dim of a remap reads its input.
pub enum Axis {
    /// Input coordinate = output coordinate, input stride.
    Same(usize),
    /// Input coordinate from a table (-1: pad), input stride.
    Table(Vec<i64>, usize),
}

/// Runs a remap into `oshape`.
pub fn remap(
    e: &mut GpuExecutor,
    x: &GpuTensor,
    oshape: Vec<usize>,
    axes: &[Axis],
    pad: f64,
) -> Result<GpuTensor, String> {
    let out = e.output(oshape.clone(), x.dtype);
    let mut p: Vec<u32> = vec![out.numel() as u32];
    let mut strides = Vec::with_capacity(axes.len());
    let mut offs = Vec::with_capacity(axes.len());
    for a in axes {
        match a {
            Axis::Same(st) => {
                strides.push(*st as u32);
                offs.push(None);
            }
            Axis::Table(t, st) => {
                strides.push(*st as u32);
                offs.push(Some(p.len() as u32));
                p.extend(t.iter().map(|&v| (v.clamp(-1, i32::MAX as i64) as i32) as u32));
            }
        }
    }
    let pad_bits = if x.elem() == Elem::F32 { (pad as f32).to_bits() } else { (pad as i32) as u32 };
    if out.numel() == 0 {
        return Ok(out);
    }
    let src = remap_src(x.elem(), &oshape, &strides, &offs, pad_bits);
    e.launch(&src, &[&x.buf, &out.buf], &p, GpuExecutor::groups(out.numel()))?;
    Ok(out)
}

/// Gather along an axis: `P = [count, idx_count, axis_len, inner]`.
pub fn gather_src(e: Elem) -> String {
    let body = "    let ic = P[1]; let al = P[2]; let inner = P[3];
    let within = i % inner;
    let rest = i / inner;
    let j = rest % ic;
    let o = rest / ic;
    var idx = I[j];
    if (idx < 0) { idx = idx + i32(al); }
    let k = u32(clamp(idx, 0, i32(al) - 1));
    Y[i] = X[(o * al + k) * inner + within];";
    source(&[("X", e, false), ("I", Elem::I32, false), ("Y", e, true)], "", body)
}

/// Writes one input of a concat into its place: `P = [count, block, out_block, offset]`.
pub fn place_src(e: Elem) -> String {
    let body = "    let j = i % P[1];
    let o = i / P[1];
    Y[o * P[2] + P[3] + j] = X[i];";
    source(&[("X", e, false), ("Y", e, true)], "", body)
}

/// One LSTM step for one direction: thread per (batch, unit). Gates `iofc`. `XW` holds the
/// input projections `[seq, batch, 4H]`. `P = [count=B·H, H, B, t, dir, dirs, has_bias,
/// has_y]`.
pub fn lstm_step_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4]; let dirs = P[5];
    let b = i / Hs; let j = i % Hs;
    var g = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var q = 0u; q < 4u; q = q + 1u) {
        var acc = XW[(t * Bn + b) * 4u * Hs + q * Hs + j];
        if (P[6] != 0u) { acc = acc + BI[dir * 8u * Hs + q * Hs + j] + BI[dir * 8u * Hs + 4u * Hs + q * Hs + j]; }
        let rrow = (dir * 4u * Hs + q * Hs + j) * Hs;
        for (var k = 0u; k < Hs; k = k + 1u) { acc = acc + HP[b * Hs + k] * R[rrow + k]; }
        g[q] = acc;
    }
    let ig = sigmoid_(g[0]); let og = sigmoid_(g[1]); let fg = sigmoid_(g[2]); let cg = tanh_(g[3]);
    let c = fg * CP[b * Hs + j] + ig * cg;
    let h = og * tanh_(c);
    CN[b * Hs + j] = c;
    HN[b * Hs + j] = h;
    Y[((t * dirs + dir) * Bn + b) * Hs + j] = h;";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("CP", Elem::F32, false),
            ("HN", Elem::F32, true),
            ("CN", Elem::F32, true),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// GRU step, first half: update and reset gates, and the reset hidden state (`r ⊙ h` before
/// the recurrence, or the recurrence of `h` for `linear_before_reset`).
/// `P = [count, H, B, t, dir, dirs, has_bias, linear_before_reset]`.
pub fn gru_gates_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4];
    let b = i / Hs; let j = i % Hs;
    var zr = array<f32, 2>(0.0, 0.0);
    for (var q = 0u; q < 2u; q = q + 1u) {
        var acc = XW[(t * Bn + b) * 3u * Hs + q * Hs + j];
        if (P[6] != 0u) { acc = acc + BI[dir * 6u * Hs + q * Hs + j] + BI[dir * 6u * Hs + 3u * Hs + q * Hs + j]; }
        let rrow = (dir * 3u * Hs + q * Hs + j) * Hs;
        for (var k = 0u; k < Hs; k = k + 1u) { acc = acc + HP[b * Hs + k] * R[rrow + k]; }
        zr[q] = sigmoid_(acc);
    }
    Z[b * Hs + j] = zr[0];
    RG[b * Hs + j] = zr[1];";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("Z", Elem::F32, true),
            ("RG", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// GRU step, second half: the candidate state and the new hidden state.
pub fn gru_state_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4]; let dirs = P[5];
    let b = i / Hs; let j = i % Hs;
    var acc = XW[(t * Bn + b) * 3u * Hs + 2u * Hs + j];
    var wb = 0.0; var rb = 0.0;
    if (P[6] != 0u) { wb = BI[dir * 6u * Hs + 2u * Hs + j]; rb = BI[dir * 6u * Hs + 5u * Hs + j]; }
    let rrow = (dir * 3u * Hs + 2u * Hs + j) * Hs;
    var rec = 0.0;
    if (P[7] != 0u) {
        for (var k = 0u; k < Hs; k = k + 1u) { rec = rec + HP[b * Hs + k] * R[rrow + k]; }
        rec = RG[b * Hs + j] * (rec + rb);
    } else {
        for (var k = 0u; k < Hs; k = k + 1u) { rec = rec + RG[b * Hs + k] * HP[b * Hs + k] * R[rrow + k]; }
        rec = rec + rb;
    }
    let hc = tanh_(acc + wb + rec);
    let z = Z[b * Hs + j];
    let h = (1.0 - z) * hc + z * HP[b * Hs + j];
    HN[b * Hs + j] = h;
    Y[((t * dirs + dir) * Bn + b) * Hs + j] = h;";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("Z", Elem::F32, false),
            ("RG", Elem::F32, false),
            ("HN", Elem::F32, true),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

/// Plain RNN step (tanh). `P = [count, H, B, t, dir, dirs, has_bias]`.
pub fn rnn_step_src() -> String {
    let body = "    let Hs = P[1]; let Bn = P[2]; let t = P[3]; let dir = P[4]; let dirs = P[5];
    let b = i / Hs; let j = i % Hs;
    var acc = XW[(t * Bn + b) * Hs + j];
    if (P[6] != 0u) { acc = acc + BI[dir * 2u * Hs + j] + BI[dir * 2u * Hs + Hs + j]; }
    let rrow = (dir * Hs + j) * Hs;
    for (var k = 0u; k < Hs; k = k + 1u) { acc = acc + HP[b * Hs + k] * R[rrow + k]; }
    let h = tanh_(acc);
    HN[b * Hs + j] = h;
    Y[((t * dirs + dir) * Bn + b) * Hs + j] = h;";
    source(
        &[
            ("XW", Elem::F32, false),
            ("R", Elem::F32, false),
            ("BI", Elem::F32, false),
            ("HP", Elem::F32, false),
            ("HN", Elem::F32, true),
            ("Y", Elem::F32, true),
        ],
        MATH_FNS,
        body,
    )
}

fn red_of(op: &Op) -> Option<Red> {
    Some(match op {
        Op::ReduceSum(_) => Red::Sum,
        Op::ReduceMean(_) => Red::Mean,
        Op::ReduceMax(_) => Red::Max,
        Op::ReduceMin(_) => Red::Min,
        Op::ReduceProd(_) => Red::Prod,
        Op::ReduceL1(_) => Red::L1,
        Op::ReduceL2(_) => Red::L2,
        Op::ReduceSumSquare(_) => Red::SumSquare,
        Op::ReduceLogSum(_) => Red::LogSum,
        Op::ReduceLogSumExp(_) => Red::LogSumExp,
        Op::ArgMax(_) => Red::ArgMax,
        Op::ArgMin(_) => Red::ArgMin,
        Op::GlobalAveragePool(_) => Red::Mean,
        Op::GlobalMaxPool(_) => Red::Max,
        _ => return None,
    })
}

/// Window attributes as 3-d (leading 1s / 0s).
fn to3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut o = [fill; 3];
    let off = 3 - v.len().min(3);
    for (k, &x) in v.iter().take(3).enumerate() {
        o[off + k] = x;
    }
    o
}

/// The nn kernels; `None` for ops without one.
pub fn run_nn(
    e: &mut GpuExecutor,
    g: &Graph,
    n: NodeId,
    ins: &[Option<&GpuTensor>],
    oshape: Vec<usize>,
    odt: DType,
) -> Result<Option<Vec<GpuTensor>>, String> {
    let node = g.node(n);
    let op = &node.op;
    let inp = |k: usize| ins.get(k).copied().flatten();
    let Some(x) = inp(0) else { return Ok(None) };
    let r = x.shape.len();
    let f32_only = |t: &GpuTensor| t.elem() == Elem::F32;
    // Reductions.
    if let Some(red) = red_of(op) {
        let axes: Vec<usize> = match op {
            Op::GlobalAveragePool(_) | Op::GlobalMaxPool(_) => (2..r).collect(),
            Op::ArgMax(_) | Op::ArgMin(_) => vec![norm_axis(int_attr(op, "axis", 0), r)],
            _ => {
                let from_input = inp(1).map(|t| e.ints(t)).transpose()?;
                let list = from_input.or_else(|| ints_attr(op, "axes"));
                match list {
                    Some(l) if !l.is_empty() => l.iter().map(|&a| norm_axis(a, r)).collect(),
                    _ => {
                        if int_attr(op, "noop_with_empty_axes", 0) != 0 {
                            return Ok(Some(vec![GpuExecutor::view(x, oshape)]));
                        }
                        (0..r).collect()
                    }
                }
            }
        };
        let last = int_attr(op, "select_last_index", 0) != 0;
        if matches!(red, Red::L2 | Red::LogSum | Red::LogSumExp | Red::Mean) && !f32_only(x) {
            return Ok(None);
        }
        return Ok(Some(vec![reduce(e, x, &axes, red, oshape, odt, last)?]));
    }
    match op {
        Op::Softmax(_) | Op::LogSoftmax(_) | Op::Hardmax(_) => {
            if !f32_only(x) {
                return Ok(None);
            }
            let legacy = g.opset < 13;
            let a = norm_axis(int_attr(op, "axis", if legacy { 1 } else { -1 }), r);
            let (len, inner) = if legacy {
                (x.shape[a..].iter().product::<usize>(), 1)
            } else {
                (x.shape[a], x.shape[a + 1..].iter().product())
            };
            let rows = x.shape.iter().product::<usize>() / len.max(1);
            let kind = match op {
                Op::LogSoftmax(_) => "log",
                Op::Hardmax(_) => "hard",
                _ => "soft",
            };
            let out = e.output(oshape, odt);
            e.launch(
                &softmax_src(kind),
                &[&x.buf, &out.buf],
                &[rows as u32, len as u32, inner as u32],
                GpuExecutor::groups(rows),
            )?;
            Ok(Some(vec![out]))
        }
        Op::LayerNormalization(_) => {
            let Some(s) = inp(1) else { return Ok(None) };
            if !f32_only(x) {
                return Ok(None);
            }
            let a = norm_axis(int_attr(op, "axis", -1), r);
            let len: usize = x.shape[a..].iter().product();
            let rows = x.numel() / len.max(1);
            let bias = inp(2);
            let stats = node.num_outputs() > 1 && node.outputs()[1..].iter().any(|o| !o.name.is_empty());
            let out = e.output(oshape, odt);
            let mut stat_shape: Vec<usize> = x.shape[..a].to_vec();
            stat_shape.extend(std::iter::repeat_n(1, r - a));
            let mean = e.output(stat_shape.clone(), DType::Float);
            let inv = e.output(stat_shape, DType::Float);
            let eps = (float_attr(op, "epsilon", 1e-5) as f32).to_bits();
            let p = [rows as u32, len as u32, s.numel() as u32, bias.map_or(1, |b| b.numel()) as u32, eps];
            let mut bufs: Vec<&wgpu::Buffer> = vec![&x.buf, &s.buf];
            if let Some(b) = bias {
                bufs.push(&b.buf);
            }
            bufs.push(&out.buf);
            if stats {
                bufs.push(&mean.buf);
                bufs.push(&inv.buf);
            }
            e.launch(&layernorm_src(bias.is_some(), stats), &bufs, &p, GpuExecutor::groups(rows))?;
            Ok(Some(if stats { vec![out, mean, inv] } else { vec![out] }))
        }
        Op::BatchNormalization(_) => {
            let (Some(s), Some(b), Some(m), Some(v)) = (inp(1), inp(2), inp(3), inp(4)) else { return Ok(None) };
            if int_attr(op, "training_mode", 0) != 0
                || node.num_outputs() > 1 && node.outputs()[1..].iter().any(|o| !o.name.is_empty())
            {
                return Ok(None);
            }
            let c = if r > 1 { x.shape[1] } else { 1 };
            let inner: usize = x.shape.get(2..).map_or(1, |d| d.iter().product());
            let out = e.output(oshape, odt);
            let eps = (float_attr(op, "epsilon", 1e-5) as f32).to_bits();
            e.launch(
                &batchnorm_src(),
                &[&x.buf, &s.buf, &b.buf, &m.buf, &v.buf, &out.buf],
                &[x.numel() as u32, c as u32, inner as u32, eps],
                GpuExecutor::groups(x.numel()),
            )?;
            Ok(Some(vec![out]))
        }
        Op::InstanceNormalization(_) => {
            let (Some(s), Some(b)) = (inp(1), inp(2)) else { return Ok(None) };
            let c = x.shape[1];
            let len: usize = x.shape[2..].iter().product();
            let rows = x.numel() / len.max(1);
            let out = e.output(oshape, odt);
            let eps = (float_attr(op, "epsilon", 1e-5) as f32).to_bits();
            e.launch(
                &instancenorm_src(),
                &[&x.buf, &s.buf, &b.buf, &out.buf],
                &[rows as u32, len as u32, c as u32, eps],
                GpuExecutor::groups(rows),
            )?;
            Ok(Some(vec![out]))
        }
        Op::MatMul(_) => {
            let Some(w) = inp(1) else { return Ok(None) };
            if !f32_only(x) || !f32_only(w) {
                return Ok(None);
            }
            // 1-d operands become matrices.
            let ash: Vec<usize> = if x.shape.len() == 1 { vec![1, x.shape[0]] } else { x.shape.clone() };
            let bsh: Vec<usize> = if w.shape.len() == 1 { vec![w.shape[0], 1] } else { w.shape.clone() };
            let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
            let nn = bsh[bsh.len() - 1];
            let ab = &ash[..ash.len() - 2];
            let bb = &bsh[..bsh.len() - 2];
            let nb = ab.len().max(bb.len());
            let mut batch = vec![1usize; nb];
            for (d, slot) in batch.iter_mut().enumerate() {
                let a = ab.len().checked_sub(nb - d).map_or(1, |i| ab[i]);
                let b = bb.len().checked_sub(nb - d).map_or(1, |i| bb[i]);
                *slot = a.max(b);
            }
            // Batch strides of each operand (0 where it broadcasts).
            let bst = |b: &[usize], full: &[usize]| -> Vec<usize> {
                let st = strides(full);
                (0..nb)
                    .map(|d| match b.len().checked_sub(nb - d) {
                        Some(i) if b[i] != 1 => st[i],
                        _ => 0,
                    })
                    .collect()
            };
            let a_full: Vec<usize> = ab.iter().copied().chain([m, k]).collect();
            let b_full: Vec<usize> = bb.iter().copied().chain([k, nn]).collect();
            let mut a_bst = bst(ab, &a_full);
            let b_bst = bst(bb, &b_full);
            let mut m = m;
            if bb.iter().all(|&d| d == 1) {
                // A shared B: A's batch folds into its rows (one GEMM, not many thin ones).
                m *= batch.iter().product::<usize>();
                batch.iter_mut().for_each(|d| *d = 1);
                a_bst.iter_mut().for_each(|s| *s = 0);
            }
            let spec = Gemm {
                a: x,
                b: w,
                c: None,
                m,
                n: nn,
                k,
                a_st: (k, 1),
                b_st: (nn, 1),
                c_st: (0, 0),
                batch: batch.clone(),
                a_bst,
                b_bst,
                c_bst: vec![0; nb],
                bases: (0, 0, 0),
                alpha: 1.0,
                beta: 0.0,
            };
            if nb > 4 {
                return Ok(None);
            }
            Ok(Some(vec![gemm(e, &spec, oshape)?]))
        }
        Op::Gemm(_) => {
            let Some(w) = inp(1) else { return Ok(None) };
            if !f32_only(x) || !f32_only(w) || x.shape.len() != 2 || w.shape.len() != 2 {
                return Ok(None);
            }
            let ta = int_attr(op, "transA", 0) != 0;
            let tb = int_attr(op, "transB", 0) != 0;
            let (m, k) = if ta { (x.shape[1], x.shape[0]) } else { (x.shape[0], x.shape[1]) };
            let nn = if tb { w.shape[0] } else { w.shape[1] };
            let a_st = if ta { (1, x.shape[1]) } else { (x.shape[1], 1) };
            let b_st = if tb { (1, w.shape[1]) } else { (w.shape[1], 1) };
            let c = inp(2);
            let c_st = match c {
                Some(c) => {
                    let st = super::kernels::broadcast_strides(&c.shape, &[m, nn]);
                    (st[0] as usize, st[1] as usize)
                }
                None => (0, 0),
            };
            let spec = Gemm {
                a: x,
                b: w,
                c,
                m,
                n: nn,
                k,
                a_st,
                b_st,
                c_st,
                batch: vec![],
                a_bst: vec![],
                b_bst: vec![],
                c_bst: vec![],
                bases: (0, 0, 0),
                alpha: float_attr(op, "alpha", 1.0) as f32,
                beta: float_attr(op, "beta", 1.0) as f32,
            };
            Ok(Some(vec![gemm(e, &spec, oshape)?]))
        }
        Op::Conv(_) | Op::ConvTranspose(_) => {
            let Some(w) = inp(1) else { return Ok(None) };
            if !f32_only(x) || !(3..=5).contains(&r) {
                return Ok(None);
            }
            let k = r - 2;
            let spatial: Vec<usize> = x.shape[2..].to_vec();
            let kernel: Vec<usize> = w.shape[2..].to_vec();
            let strides_: Vec<usize> =
                ints_attr(op, "strides").map_or(vec![1; k], |v| v.iter().map(|&s| s as usize).collect());
            let dil: Vec<usize> =
                ints_attr(op, "dilations").map_or(vec![1; k], |v| v.iter().map(|&s| s as usize).collect());
            let group = int_attr(op, "group", 1) as usize;
            let bias = inp(2);
            let osp: Vec<usize> = oshape[2..].to_vec();
            let pads: Vec<usize> = if matches!(op, Op::Conv(_)) {
                let kshape: Vec<i64> = kernel.iter().map(|&v| v as i64).collect();
                let ks: Vec<i64> = strides_.iter().map(|&v| v as i64).collect();
                let kd: Vec<i64> = dil.iter().map(|&v| v as i64).collect();
                let w_ = ir::eval::window(
                    &spatial,
                    &kshape,
                    Some(&ks),
                    Some(&kd),
                    ints_attr(op, "pads").as_deref(),
                    &str_attr(op, "auto_pad", "NOTSET"),
                    false,
                )?;
                w_.pad_begin
            } else {
                // Transposed: the leading pads as the reference computes them.
                let Op::ConvTranspose(ct) = op else { unreachable!() };
                let (_, pb) = ir::eval::conv_transpose_geometry(ct, &spatial, &kernel)?;
                pb
            };
            let (n, c) = (x.shape[0], x.shape[1]);
            let m = oshape[1];
            let s3 = to3(&spatial, 1);
            let o3 = to3(&osp, 1);
            let k3 = to3(&kernel, 1);
            let st3 = to3(&strides_, 1);
            let d3 = to3(&dil, 1);
            let p3 = to3(&pads, 0);
            let count: usize = oshape.iter().product();
            let mut p: Vec<u32> = vec![count as u32, n as u32, c as u32, m as u32, group as u32];
            for v in [s3, o3, k3, st3, d3, p3] {
                p.extend(v.iter().map(|&x| x as u32));
            }
            if matches!(op, Op::Conv(_))
                && let Some(y) = conv_im2col(e, x, w, bias, &p, &oshape)?
            {
                return Ok(Some(vec![y]));
            }
            let out = e.output(oshape.clone(), odt);
            let src =
                if matches!(op, Op::Conv(_)) { conv_src(bias.is_some()) } else { conv_transpose_src(bias.is_some()) };
            let mut bufs: Vec<&wgpu::Buffer> = vec![&x.buf, &w.buf];
            if let Some(b) = bias {
                bufs.push(&b.buf);
            }
            bufs.push(&out.buf);
            e.launch(&specialize(&src, &p), &bufs, &p, GpuExecutor::groups(out.numel()))?;
            Ok(Some(vec![out]))
        }
        Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_) => {
            if !f32_only(x) || !(3..=5).contains(&r) {
                return Ok(None);
            }
            if node.num_outputs() > 1 && node.outputs()[1..].iter().any(|o| !o.name.is_empty()) {
                return Ok(None);
            }
            let Some(kernel) = ints_attr(op, "kernel_shape") else { return Ok(None) };
            let spatial: Vec<usize> = x.shape[2..].to_vec();
            let w_ = ir::eval::window(
                &spatial,
                &kernel,
                ints_attr(op, "strides").as_deref(),
                ints_attr(op, "dilations").as_deref(),
                ints_attr(op, "pads").as_deref(),
                &str_attr(op, "auto_pad", "NOTSET"),
                int_attr(op, "ceil_mode", 0) != 0,
            )?;
            let out = e.output(oshape, odt);
            let nc = x.shape[0] * x.shape[1];
            // [count, NC, C, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW,
            //  PED, PEH, PEW, count_include_pad, p]
            let mut p: Vec<u32> = vec![out.numel() as u32, nc as u32, x.shape[1] as u32];
            for v in [
                to3(&spatial, 1),
                to3(&w_.out, 1),
                to3(&w_.kernel, 1),
                to3(&w_.strides, 1),
                to3(&w_.dilations, 1),
                to3(&w_.pad_begin, 0),
                to3(&w_.pad_end, 0),
            ] {
                p.extend(v.iter().map(|&x| x as u32));
            }
            p.push(int_attr(op, "count_include_pad", 0) as u32);
            p.push(int_attr(op, "p", 2) as u32);
            let kind = match op {
                Op::MaxPool(_) => "max",
                Op::LpPool(_) => "lp",
                _ => "avg",
            };
            e.launch(&specialize(&pool_src(kind), &p), &[&x.buf, &out.buf], &p, GpuExecutor::groups(out.numel()))?;
            Ok(Some(vec![out]))
        }
        Op::Transpose(_) => {
            let perm: Vec<usize> =
                ints_attr(op, "perm").map_or((0..r).rev().collect(), |p| p.iter().map(|&v| norm_axis(v, r)).collect());
            let st = strides(&x.shape);
            let axes: Vec<Axis> = perm.iter().map(|&p| Axis::Same(st[p])).collect();
            Ok(Some(vec![remap(e, x, oshape, &axes, 0.0)?]))
        }
        Op::Expand(_) => {
            let st = super::kernels::broadcast_strides(&x.shape, &oshape);
            let axes: Vec<Axis> = st.iter().map(|&s| Axis::Same(s as usize)).collect();
            Ok(Some(vec![remap(e, x, oshape, &axes, 0.0)?]))
        }
        Op::Tile(_) => {
            let st = strides(&x.shape);
            let axes: Vec<Axis> = (0..r)
                .map(|d| Axis::Table((0..oshape[d]).map(|c| (c % x.shape[d].max(1)) as i64).collect(), st[d]))
                .collect();
            Ok(Some(vec![remap(e, x, oshape, &axes, 0.0)?]))
        }
        Op::Slice(_) => {
            let (starts, ends, axes_l, steps) = if g.opset >= 10 {
                let get = |k: usize, e: &mut GpuExecutor| inp(k).map(|t| e.ints(t)).transpose();
                let s = get(1, e)?.unwrap_or_default();
                let en = get(2, e)?.unwrap_or_default();
                let a = get(3, e)?;
                let stp = get(4, e)?;
                (s, en, a, stp)
            } else {
                (
                    ints_attr(op, "starts").unwrap_or_default(),
                    ints_attr(op, "ends").unwrap_or_default(),
                    ints_attr(op, "axes"),
                    None,
                )
            };
            let axes_l: Vec<usize> =
                axes_l.unwrap_or_else(|| (0..starts.len() as i64).collect()).iter().map(|&a| norm_axis(a, r)).collect();
            let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
            let st = strides(&x.shape);
            let mut axes: Vec<Axis> = (0..r).map(|d| Axis::Same(st[d])).collect();
            for (k, &a) in axes_l.iter().enumerate() {
                let (start, _, len) = ir::eval::slice_params(x.shape[a] as i64, starts[k], ends[k], steps[k]);
                if len != oshape[a] {
                    return Ok(None);
                }
                axes[a] = Axis::Table((0..len).map(|c| start + c as i64 * steps[k]).collect(), st[a]);
            }
            Ok(Some(vec![remap(e, x, oshape, &axes, 0.0)?]))
        }
        Op::Pad(_) => {
            let mode = str_attr(op, "mode", "constant");
            let pads = if g.opset >= 11 {
                inp(1).map(|t| e.ints(t)).transpose()?.unwrap_or_default()
            } else {
                ints_attr(op, "pads").unwrap_or_default()
            };
            let value = if g.opset >= 11 {
                inp(2).map(|t| e.floats(t)).transpose()?.and_then(|v| v.first().copied()).unwrap_or(0.0)
            } else {
                float_attr(op, "value", 0.0)
            };
            let axes_list: Vec<usize> = match inp(3) {
                Some(t) => e.ints(t)?.iter().map(|&a| norm_axis(a, r)).collect(),
                None => (0..r).collect(),
            };
            let na = axes_list.len();
            if pads.len() != 2 * na {
                return Ok(None);
            }
            let st = strides(&x.shape);
            let mut axes: Vec<Axis> = (0..r).map(|d| Axis::Same(st[d])).collect();
            for (k, &a) in axes_list.iter().enumerate() {
                let (b, _) = (pads[k], pads[k + na]);
                let n = x.shape[a] as i64;
                let table: Vec<i64> = (0..oshape[a] as i64)
                    .map(|c| {
                        let i = c - b;
                        if (0..n).contains(&i) {
                            return i;
                        }
                        match mode.as_str() {
                            "edge" => i.clamp(0, n - 1),
                            "reflect" => {
                                if n == 1 {
                                    0
                                } else {
                                    let p = 2 * (n - 1);
                                    let m = i.rem_euclid(p);
                                    if m < n { m } else { p - m }
                                }
                            }
                            "wrap" => i.rem_euclid(n),
                            _ => -1,
                        }
                    })
                    .collect();
                axes[a] = Axis::Table(table, st[a]);
            }
            Ok(Some(vec![remap(e, x, oshape, &axes, value)?]))
        }
        Op::Resize(_) | Op::Upsample(_) => {
            if str_attr(op, "mode", "nearest") != "nearest" || int_attr(op, "antialias", 0) != 0 {
                return Ok(None);
            }
            let ctm = str_attr(op, "coordinate_transformation_mode", "half_pixel");
            if ctm == "tf_crop_and_resize" {
                return Ok(None);
            }
            let nearest = str_attr(op, "nearest_mode", "round_prefer_floor");
            let st = strides(&x.shape);
            let mut axes = Vec::with_capacity(r);
            for d in 0..r {
                let (inn, out) = (x.shape[d] as f64, oshape[d] as f64);
                let scale = out / inn;
                let table: Vec<i64> = (0..oshape[d])
                    .map(|c| {
                        let c = c as f64;
                        let xo = match ctm.as_str() {
                            "asymmetric" => c / scale,
                            "align_corners" => {
                                if out > 1.0 {
                                    c * (inn - 1.0) / (out - 1.0)
                                } else {
                                    0.0
                                }
                            }
                            "pytorch_half_pixel" => {
                                if out > 1.0 {
                                    (c + 0.5) / scale - 0.5
                                } else {
                                    0.0
                                }
                            }
                            "half_pixel_symmetric" => {
                                let adj = out / (inn * scale);
                                let center = inn / 2.0;
                                let offset = center * (1.0 - adj);
                                offset + (c + 0.5) / scale - 0.5
                            }
                            _ => (c + 0.5) / scale - 0.5,
                        };
                        let i = match nearest.as_str() {
                            "floor" => xo.floor(),
                            "ceil" => xo.ceil(),
                            "round_prefer_ceil" => {
                                if (xo - xo.floor() - 0.5).abs() < 1e-9 {
                                    xo.ceil()
                                } else {
                                    xo.round()
                                }
                            }
                            _ => {
                                if (xo - xo.floor() - 0.5).abs() < 1e-9 {
                                    xo.floor()
                                } else {
                                    xo.round()
                                }
                            }
                        };
                        (i as i64).clamp(0, x.shape[d] as i64 - 1)
                    })
                    .collect();
                axes.push(Axis::Table(table, st[d]));
            }
            Ok(Some(vec![remap(e, x, oshape, &axes, 0.0)?]))
        }
        Op::Split(_) => {
            let a = norm_axis(int_attr(op, "axis", 0), r);
            let st = strides(&x.shape);
            let mut outs = Vec::new();
            let mut start = 0usize;
            for slot in 0..node.num_outputs() {
                let Some(sh) = dims(g, Value::new(n, slot as u16)) else { return Ok(None) };
                let len = sh[a];
                let axes: Vec<Axis> = (0..r)
                    .map(|d| {
                        if d == a {
                            Axis::Table((start..start + len).map(|c| c as i64).collect(), st[d])
                        } else {
                            Axis::Same(st[d])
                        }
                    })
                    .collect();
                outs.push(remap(e, x, sh, &axes, 0.0)?);
                start += len;
            }
            Ok(Some(outs))
        }
        Op::Gather(_) => {
            let Some(idx) = inp(1) else { return Ok(None) };
            if idx.elem() != Elem::I32 {
                return Ok(None);
            }
            let a = norm_axis(int_attr(op, "axis", 0), r);
            let outer: usize = x.shape[..a].iter().product();
            let inner: usize = x.shape[a + 1..].iter().product();
            let out = e.output(oshape, odt);
            let _ = outer;
            let p = [out.numel() as u32, idx.numel() as u32, x.shape[a] as u32, inner as u32];
            if out.numel() > 0 {
                e.launch(
                    &super::kernels_nn::gather_src(x.elem()),
                    &[&x.buf, &idx.buf, &out.buf],
                    &p,
                    GpuExecutor::groups(out.numel()),
                )?;
            }
            Ok(Some(vec![out]))
        }
        Op::Concat(_) => {
            let a = norm_axis(int_attr(op, "axis", 0), oshape.len());
            let out = e.output(oshape.clone(), odt);
            let inner: usize = oshape[a + 1..].iter().product();
            let out_block = oshape[a] * inner;
            let mut off = 0usize;
            for t in ins.iter().flatten() {
                if t.elem() != out.elem() {
                    return Ok(None);
                }
                let block = t.shape.get(a).copied().unwrap_or(1) * inner;
                if t.numel() > 0 {
                    e.launch(
                        &place_src(t.elem()),
                        &[&t.buf, &out.buf],
                        &[t.numel() as u32, block as u32, out_block as u32, off as u32],
                        GpuExecutor::groups(t.numel()),
                    )?;
                }
                off += block;
            }
            Ok(Some(vec![out]))
        }
        Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) => recurrent(e, g, n, ins),
        _ => Ok(None),
    }
}

/// LSTM, GRU, RNN: the input projection of every step in one GEMM per direction, then a step
/// kernel per time step (the hidden state ping-pongs between two buffers).
fn recurrent(
    e: &mut GpuExecutor,
    g: &Graph,
    n: NodeId,
    ins: &[Option<&GpuTensor>],
) -> Result<Option<Vec<GpuTensor>>, String> {
    let node = g.node(n);
    let op = &node.op;
    let inp = |k: usize| ins.get(k).copied().flatten();
    let (Some(x), Some(w), Some(rw)) = (inp(0), inp(1), inp(2)) else { return Ok(None) };
    if int_attr(op, "layout", 0) != 0
        || inp(4).is_some()
        || ints_attr(op, "activations").is_some()
        || op
            .attributes()
            .iter()
            .any(|a| a.name == "clip" || a.name == "activation_alpha" || a.name == "activation_beta")
        || int_attr(op, "input_forget", 0) != 0
        || (matches!(op, Op::LSTM(_)) && inp(7).is_some())
    {
        return Ok(None);
    }
    let gates = match op {
        Op::LSTM(_) => 4,
        Op::GRU(_) => 3,
        _ => 1,
    };
    let (seq, b, isz) = (x.shape[0], x.shape[1], x.shape[2]);
    let dirs = w.shape[0];
    let h = w.shape[1] / gates;
    let direction = str_attr(op, "direction", "forward");
    let bias = inp(3);
    let zero_bias;
    let bias = match bias {
        Some(t) => t,
        None => {
            zero_bias = e.output(vec![dirs, 2 * gates * h], DType::Float);
            e.queue_zero(&zero_bias)?;
            &zero_bias
        }
    };
    let y = e.output(vec![seq, dirs, b, h], DType::Float);
    let mut last_h = Vec::new();
    let mut last_c = Vec::new();
    for dir in 0..dirs {
        let reverse = direction == "reverse" || (direction == "bidirectional" && dir == 1);
        // XW[t·B + b, q] = Σ_k X[t, b, k] · W[dir, q, k].
        let spec = Gemm {
            a: x,
            b: w,
            c: None,
            m: seq * b,
            n: gates * h,
            k: isz,
            a_st: (isz, 1),
            b_st: (1, isz),
            c_st: (0, 0),
            batch: vec![],
            a_bst: vec![],
            b_bst: vec![],
            c_bst: vec![],
            bases: (0, dir * gates * h * isz, 0),
            alpha: 1.0,
            beta: 0.0,
        };
        let xw = gemm(e, &spec, vec![seq * b, gates * h])?;
        // Initial states.
        let init = |e: &mut GpuExecutor, k: usize| -> Result<GpuTensor, String> {
            let t = e.output(vec![b, h], DType::Float);
            match inp(k) {
                Some(s) => e.copy_range(s, dir * b * h, &t, b * h)?,
                None => e.queue_zero(&t)?,
            }
            Ok(t)
        };
        let mut hp = init(e, 5)?;
        let mut hn = e.output(vec![b, h], DType::Float);
        let mut cp = if gates == 4 { Some(init(e, 6)?) } else { None };
        let mut cn = if gates == 4 { Some(e.output(vec![b, h], DType::Float)) } else { None };
        let zg = e.output(vec![b, h], DType::Float);
        let rg = e.output(vec![b, h], DType::Float);
        for step in 0..seq {
            let t = if reverse { seq - 1 - step } else { step };
            let p = [
                (b * h) as u32,
                h as u32,
                b as u32,
                t as u32,
                dir as u32,
                dirs as u32,
                1,
                int_attr(op, "linear_before_reset", 0) as u32,
            ];
            match gates {
                4 => {
                    let (c_prev, c_next) = (cp.as_ref().expect("cell"), cn.as_ref().expect("cell"));
                    e.launch(
                        &lstm_step_src(),
                        &[&xw.buf, &rw.buf, &bias.buf, &hp.buf, &c_prev.buf, &hn.buf, &c_next.buf, &y.buf],
                        &p[..7],
                        GpuExecutor::groups(b * h),
                    )?;
                }
                3 => {
                    e.launch(
                        &gru_gates_src(),
                        &[&xw.buf, &rw.buf, &bias.buf, &hp.buf, &zg.buf, &rg.buf],
                        &p,
                        GpuExecutor::groups(b * h),
                    )?;
                    e.launch(
                        &gru_state_src(),
                        &[&xw.buf, &rw.buf, &bias.buf, &hp.buf, &zg.buf, &rg.buf, &hn.buf, &y.buf],
                        &p,
                        GpuExecutor::groups(b * h),
                    )?;
                }
                _ => {
                    e.launch(
                        &rnn_step_src(),
                        &[&xw.buf, &rw.buf, &bias.buf, &hp.buf, &hn.buf, &y.buf],
                        &p[..7],
                        GpuExecutor::groups(b * h),
                    )?;
                }
            }
            std::mem::swap(&mut hp, &mut hn);
            if let (Some(a), Some(c)) = (cp.as_mut(), cn.as_mut()) {
                std::mem::swap(a, c);
            }
        }
        last_h.push(hp);
        if let Some(c) = cp {
            last_c.push(c);
        }
    }
    // Y_h and Y_c: [dirs, B, H] from the per-direction states.
    let stack = |e: &mut GpuExecutor, parts: &[GpuTensor]| -> Result<GpuTensor, String> {
        let out = e.output(vec![parts.len(), b, h], DType::Float);
        for (d, p) in parts.iter().enumerate() {
            e.launch(
                &place_src(Elem::F32),
                &[&p.buf, &out.buf],
                &[(b * h) as u32, (b * h) as u32, (parts.len() * b * h) as u32, (d * b * h) as u32],
                GpuExecutor::groups(b * h),
            )?;
        }
        Ok(out)
    };
    let yh = stack(e, &last_h)?;
    let mut outs = vec![y, yh];
    if gates == 4 {
        outs.push(stack(e, &last_c)?);
    }
    outs.truncate(node.num_outputs());
    Ok(Some(outs))
}
