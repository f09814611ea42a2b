//! Normalization kernels: layer normalization over contiguous rows (with its mean and
//! inverse standard deviation outputs), batch normalization per channel (inference, and
//! training with the batch's statistics and the updated running ones), and
//! instance normalization per (sample, channel) row.

use ir::DType;
use ir::op;
use ir::ops::norm_axis;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, OutSpec, groups, nested};
use super::wgsl::{Binding, source};

impl Kernel for op::LayerNormalization {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(s)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if x.elem() != Elem::F32 {
            return Ok(None);
        }
        let r = x.shape.len();
        let a = norm_axis(self.axis(), r)?;
        let len: usize = x.shape[a..].iter().product();
        let rows = x.numel() / len.max(1);
        let bias = cx.input(2);
        let stats = cx.extra_outputs();
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let mut stat_shape: Vec<usize> = x.shape[..a].to_vec();
        stat_shape.extend(std::iter::repeat_n(1, r - a));
        let eps = self.epsilon().to_bits();
        let p = vec![rows as u32, len as u32, s.numel() as u32, bias.map_or(1, |b| b.numel()) as u32, eps];
        let mut bufs = vec![Buf::In(0), Buf::In(1)];
        if bias.is_some() {
            bufs.push(Buf::In(2));
        }
        bufs.push(Buf::Out(0));
        if stats {
            for _ in 0..2 {
                c.outputs.push(OutSpec { shape: stat_shape.clone(), dtype: DType::Float, view_of: None });
            }
            c.outputs.truncate(cx.outs.len());
            // Both statistics are written; an omitted one lands in scratch.
            let mean = if c.outputs.len() > 1 { Buf::Out(1) } else { c.temp(stat_shape.clone(), DType::Float) };
            let inv = if c.outputs.len() > 2 { Buf::Out(2) } else { c.temp(stat_shape, DType::Float) };
            bufs.extend([mean, inv]);
        }
        if rows > 0 {
            // Mean, variance, normalize: three walks of the row.
            c.launch_loop(layernorm_src(bias.is_some(), stats), bufs, p, groups(rows), 3 * len as u64);
        }
        Ok(Some(c))
    }
}

impl Kernel for op::BatchNormalization {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), true) = (cx.input(0), (1..5).all(|k| cx.input(k).is_some())) else { return Ok(None) };
        let training = self.training_mode() != 0;
        if (!training && cx.extra_outputs()) || x.elem() != Elem::F32 || x.shape.len() < 2 {
            return Ok(None);
        }
        let ch = x.shape[1];
        let inner: usize = x.shape[2..].iter().product();
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let p = vec![x.numel() as u32, ch as u32, inner as u32, self.epsilon().to_bits()];
        let (mean, var) = if training {
            // The batch's statistics per channel, and the running ones updated with them.
            let (rm, rv) = param_outputs(&mut c, cx, vec![ch]);
            let mean = c.temp(vec![ch], DType::Float);
            let var = c.temp(vec![ch], DType::Float);
            let ps = vec![ch as u32, x.shape[0] as u32, inner as u32, self.momentum().to_bits()];
            let bufs = vec![Buf::In(0), Buf::In(3), Buf::In(4), mean, var, rm, rv];
            if ch > 0 {
                c.launch_loop(batchnorm_stats_src(), bufs, ps, groups(ch), 2 * nested(&[x.shape[0], inner]));
            }
            (mean, var)
        } else {
            (Buf::In(3), Buf::In(4))
        };
        let bufs = vec![Buf::In(0), Buf::In(1), Buf::In(2), mean, var, Buf::Out(0)];
        if x.numel() > 0 {
            c.launch(batchnorm_src(), bufs, p, groups(x.numel()));
        }
        Ok(Some(c))
    }
}

impl Kernel for op::InstanceNormalization {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(_), Some(_)) = (cx.input(0), cx.input(1), cx.input(2)) else { return Ok(None) };
        if x.elem() != Elem::F32 || x.shape.len() < 2 {
            return Ok(None);
        }
        let ch = x.shape[1];
        let len: usize = x.shape[2..].iter().product();
        let rows = x.numel() / len.max(1);
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let p = vec![rows as u32, len as u32, ch as u32, self.epsilon().to_bits()];
        if rows > 0 {
            let bufs = vec![Buf::In(0), Buf::In(1), Buf::In(2), Buf::Out(0)];
            c.launch_loop(instancenorm_src(), bufs, p, groups(rows), 3 * len as u64);
        }
        Ok(Some(c))
    }
}

/// Outputs 1 and 2 (parameter gradients), or scratch for an omitted one.
fn param_outputs(c: &mut Compiled, cx: &CompileCx<'_>, shape: Vec<usize>) -> (Buf, Buf) {
    c.outputs.truncate(1);
    for _ in 0..2 {
        c.outputs.push(OutSpec { shape: shape.clone(), dtype: DType::Float, view_of: None });
    }
    let mut bufs = [Buf::Out(1), Buf::Out(2)];
    for (k, b) in bufs.iter_mut().enumerate() {
        if cx.outs.get(k + 1).is_none_or(Option::is_none) {
            *b = c.temp(shape.clone(), DType::Float);
        }
    }
    c.outputs.truncate(cx.outs.len().max(1));
    (bufs[0], bufs[1])
}

impl Kernel for op::BatchNormGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), true) = (cx.input(0), (1..5).all(|k| cx.input(k).is_some())) else { return Ok(None) };
        if x.elem() != Elem::F32 || x.shape.len() < 2 {
            return Ok(None);
        }
        let ch = x.shape[1];
        let inner: usize = x.shape[2..].iter().product();
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let (ds, db) = param_outputs(&mut c, cx, vec![ch]);
        let mean = c.temp(vec![ch], DType::Float);
        let inv = c.temp(vec![ch], DType::Float);
        let p = vec![
            ch as u32,
            x.shape[0] as u32,
            ch as u32,
            inner as u32,
            self.epsilon().to_bits(),
            u32::from(self.training_mode() != 0),
        ];
        let bufs = vec![Buf::In(0), Buf::In(2), Buf::In(3), Buf::In(4), ds, db, mean, inv];
        if ch > 0 {
            // Per channel: mean, variance and the two parameter sums, each over every image
            // and position.
            let trips = 3 * nested(&[x.shape[0], inner]);
            c.launch_loop(batchnorm_grad_stats_src(), bufs, p.clone(), groups(ch), trips);
        }
        let n = x.numel();
        let mut p2 = p;
        p2[0] = n as u32;
        if n > 0 {
            let bufs = vec![Buf::In(0), Buf::In(1), Buf::In(4), ds, db, mean, inv, Buf::Out(0)];
            c.launch(batchnorm_grad_src(), bufs, p2, groups(n));
        }
        Ok(Some(c))
    }
}

/// Per channel of a training-mode batch normalization: the batch's mean and (biased)
/// variance, two walks over every image and position, and the running statistics
/// `running·momentum + batch·(1 − momentum)`. `P = [C, N, inner, momentum_bits]`.
pub fn batchnorm_stats_src() -> String {
    let body = "    let C = P[0]; let N = P[1]; let L = P[2];
    let cnt = f32(N * L);
    var m = 0.0;
    for (var n = 0u; n < N; n = n + 1u) { for (var k = 0u; k < L; k = k + 1u) { m = m + X[(n * C + i) * L + k]; } }
    m = m / cnt;
    var v = 0.0;
    for (var n = 0u; n < N; n = n + 1u) { for (var k = 0u; k < L; k = k + 1u) { let d = X[(n * C + i) * L + k] - m; v = v + d * d; } }
    v = v / cnt;
    MEAN[i] = m;
    VAR[i] = v;
    let mo = bitcast<f32>(P[3]);
    RM[i] = RM0[i] * mo + m * (1.0 - mo);
    RV[i] = RV0[i] * mo + v * (1.0 - mo);";
    source(
        &[
            ("X", Elem::F32, false),
            ("RM0", Elem::F32, false),
            ("RV0", Elem::F32, false),
            ("MEAN", Elem::F32, true),
            ("VAR", Elem::F32, true),
            ("RM", Elem::F32, true),
            ("RV", Elem::F32, true),
        ],
        "",
        body,
    )
}

/// Per channel: its mean and inverse deviation (the batch's in training mode, else the
/// given ones), `dscale = Σ dY·x̂`, `dbias = Σ dY`. `P = [C, N, C, inner, eps_bits, training]`.
pub fn batchnorm_grad_stats_src() -> String {
    let body = "    let N = P[1]; let C = P[2]; let L = P[3];
    var m = M[i];
    var v = V[i];
    let cnt = f32(N * L);
    if (P[5] == 1u) {
        m = 0.0;
        for (var n = 0u; n < N; n = n + 1u) { for (var k = 0u; k < L; k = k + 1u) { m = m + X[(n * C + i) * L + k]; } }
        m = m / cnt;
        v = 0.0;
        for (var n = 0u; n < N; n = n + 1u) { for (var k = 0u; k < L; k = k + 1u) { let d = X[(n * C + i) * L + k] - m; v = v + d * d; } }
        v = v / cnt;
    }
    let inv = 1.0 / sqrt(v + bitcast<f32>(P[4]));
    var sb = 0.0;
    var ss = 0.0;
    for (var n = 0u; n < N; n = n + 1u) {
        for (var k = 0u; k < L; k = k + 1u) {
            let o = (n * C + i) * L + k;
            sb = sb + DY[o];
            ss = ss + DY[o] * (X[o] - m) * inv;
        }
    }
    DS[i] = ss;
    DB[i] = sb;
    MEAN[i] = m;
    INV[i] = inv;";
    source(
        &[
            ("X", Elem::F32, false),
            ("M", Elem::F32, false),
            ("V", Elem::F32, false),
            ("DY", Elem::F32, false),
            ("DS", Elem::F32, true),
            ("DB", Elem::F32, true),
            ("MEAN", Elem::F32, true),
            ("INV", Elem::F32, true),
        ],
        "",
        body,
    )
}

/// Per element: `dX = scale·inv/cnt·(cnt·dY − dbias − x̂·dscale)` (training) or
/// `dY·scale·inv`. `P = [count, N, C, inner, eps_bits, training]`.
pub fn batchnorm_grad_src() -> String {
    let body = "    let c = (i / P[3]) % P[2];
    let inv = INV[c];
    if (P[5] == 0u) { DX[i] = DY[i] * S[c] * inv; return; }
    let cnt = f32(P[1] * P[3]);
    let xh = (X[i] - MEAN[c]) * inv;
    DX[i] = S[c] * inv / cnt * (cnt * DY[i] - DB[c] - xh * DS[c]);";
    source(
        &[
            ("X", Elem::F32, false),
            ("S", Elem::F32, false),
            ("DY", Elem::F32, false),
            ("DS", Elem::F32, false),
            ("DB", Elem::F32, false),
            ("MEAN", Elem::F32, false),
            ("INV", Elem::F32, false),
            ("DX", Elem::F32, true),
        ],
        "",
        body,
    )
}

impl Kernel for op::LayerNormGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(s), Some(_)) = (cx.input(0), cx.input(1), cx.input(2)) else { return Ok(None) };
        if x.elem() != Elem::F32 {
            return Ok(None);
        }
        let r = x.shape.len();
        let a = norm_axis(self.axis(), r)?;
        let len: usize = x.shape[a..].iter().product();
        if s.numel() != len && s.numel() != 1 {
            return Ok(None);
        }
        let rows = x.numel() / len.max(1);
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let (ds, db) = param_outputs(&mut c, cx, x.shape[a..].to_vec());
        let mean = c.temp(vec![rows], DType::Float);
        let inv = c.temp(vec![rows], DType::Float);
        let p = vec![rows as u32, len as u32, s.numel() as u32, self.epsilon().to_bits()];
        if rows > 0 {
            c.launch_loop(
                layernorm_grad_src(),
                vec![Buf::In(0), Buf::In(1), Buf::In(2), mean, inv, Buf::Out(0)],
                p.clone(),
                groups(rows),
                4 * len as u64,
            );
            let mut p2 = p;
            p2[0] = len as u32;
            p2.push(rows as u32);
            let bufs = vec![Buf::In(0), Buf::In(2), mean, inv, ds, db];
            c.launch_loop(layernorm_grad_params_src(), bufs, p2, groups(len), rows as u64);
        }
        Ok(Some(c))
    }
}

/// Per row: mean and inverse deviation, and `dX = r·(g − mean(g) − x̂·mean(g·x̂))` with
/// `g = dY·scale`. `P = [rows, len, scale_len, eps_bits]`.
pub fn layernorm_grad_src() -> String {
    let body = "    let len = P[1];
    let base = i * len;
    var m = 0.0;
    for (var k = 0u; k < len; k = k + 1u) { m = m + X[base + k]; }
    m = m / f32(len);
    var v = 0.0;
    for (var k = 0u; k < len; k = k + 1u) { let d = X[base + k] - m; v = v + d * d; }
    let inv = 1.0 / sqrt(v / f32(len) + bitcast<f32>(P[3]));
    var mg = 0.0;
    var mgx = 0.0;
    for (var k = 0u; k < len; k = k + 1u) {
        let g = DY[base + k] * S[k % P[2]];
        mg = mg + g;
        mgx = mgx + g * (X[base + k] - m) * inv;
    }
    mg = mg / f32(len);
    mgx = mgx / f32(len);
    for (var k = 0u; k < len; k = k + 1u) {
        let g = DY[base + k] * S[k % P[2]];
        DX[base + k] = inv * (g - mg - (X[base + k] - m) * inv * mgx);
    }
    MEAN[i] = m;
    INV[i] = inv;";
    source(
        &[
            ("X", Elem::F32, false),
            ("S", Elem::F32, false),
            ("DY", Elem::F32, false),
            ("MEAN", Elem::F32, true),
            ("INV", Elem::F32, true),
            ("DX", Elem::F32, true),
        ],
        "",
        body,
    )
}

/// Per normalized position: `dscale = Σ_rows dY·x̂`, `dbias = Σ_rows dY`.
/// `P = [len, len, scale_len, eps_bits, rows]`.
pub fn layernorm_grad_params_src() -> String {
    let body = "    let len = P[1];
    var ss = 0.0;
    var sb = 0.0;
    for (var r = 0u; r < P[4]; r = r + 1u) {
        let o = r * len + i;
        ss = ss + DY[o] * (X[o] - MEAN[r]) * INV[r];
        sb = sb + DY[o];
    }
    DS[i] = ss;
    DB[i] = sb;";
    source(
        &[
            ("X", Elem::F32, false),
            ("DY", Elem::F32, false),
            ("MEAN", Elem::F32, false),
            ("INV", Elem::F32, false),
            ("DS", Elem::F32, true),
            ("DB", Elem::F32, true),
        ],
        "",
        body,
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn normalization_kernels_validate() {
        for (bias, stats) in [(false, false), (true, false), (false, true), (true, true)] {
            validate("layernorm", &layernorm_src(bias, stats));
        }
        validate("batchnorm", &batchnorm_src());
        validate("instancenorm", &instancenorm_src());
        validate("batchnorm grad stats", &batchnorm_grad_stats_src());
        validate("batchnorm grad", &batchnorm_grad_src());
        validate("layernorm grad", &layernorm_grad_src());
        validate("layernorm grad params", &layernorm_grad_params_src());
    }
}
