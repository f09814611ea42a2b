//! Reference kernels for contractions, pooling, normalization, resizing and recurrent layers.

use super::array::{Array, Data, numel, strides};
use super::ops::{axis, broadcast_index, broadcast_shapes, cast, opt, req, transpose};
use super::{EvalError, Result};
use crate::op::{self, Op};
use crate::types::DType;

/// Output sizes and leading pads of a windowed op (conv or pool) over spatial dims.
///
/// `pads` holds begins then ends, as ONNX writes them; `auto_pad` overrides them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    /// Output spatial sizes.
    pub out: Vec<usize>,
    /// Padding before each spatial dim.
    pub pad_begin: Vec<usize>,
    /// Padding after each spatial dim.
    pub pad_end: Vec<usize>,
    /// Kernel sizes.
    pub kernel: Vec<usize>,
    /// Strides.
    pub strides: Vec<usize>,
    /// Dilations.
    pub dilations: Vec<usize>,
}

/// Computes the geometry of a conv/pool window (ONNX rules, including `SAME_UPPER`,
/// `SAME_LOWER`, `VALID` and `ceil_mode`).
pub fn window(
    input: &[usize],
    kernel: &[i64],
    strides: Option<&[i64]>,
    dilations: Option<&[i64]>,
    pads: Option<&[i64]>,
    auto_pad: &str,
    ceil_mode: bool,
) -> std::result::Result<Window, String> {
    let k = input.len();
    if kernel.len() != k {
        return Err(format!("kernel has {} dims, input has {k} spatial dims", kernel.len()));
    }
    let get = |v: Option<&[i64]>, what: &str, default: i64| -> std::result::Result<Vec<usize>, String> {
        match v {
            None => Ok(vec![default as usize; k]),
            Some(v) if v.len() == k && v.iter().all(|&x| x > 0) => Ok(v.iter().map(|&x| x as usize).collect()),
            Some(v) => Err(format!("{what} {v:?} do not fit {k} spatial dims")),
        }
    };
    let strides = get(strides, "strides", 1)?;
    let dilations = get(dilations, "dilations", 1)?;
    let kernel: Vec<usize> = kernel.iter().map(|&x| x.max(1) as usize).collect();
    let mut pb = vec![0usize; k];
    let mut pe = vec![0usize; k];
    let mut out = vec![0usize; k];
    for i in 0..k {
        let ext = dilations[i] * (kernel[i] - 1) + 1;
        match auto_pad {
            "SAME_UPPER" | "SAME_LOWER" => {
                let o = input[i].div_ceil(strides[i]);
                let total = ((o.max(1) - 1) * strides[i] + ext).saturating_sub(input[i]);
                let (a, b) = if auto_pad == "SAME_UPPER" {
                    (total / 2, total - total / 2)
                } else {
                    (total - total / 2, total / 2)
                };
                pb[i] = a;
                pe[i] = b;
                out[i] = o;
            }
            "VALID" | "NOTSET" | "" => {
                if (auto_pad == "NOTSET" || auto_pad.is_empty())
                    && let Some(p) = pads
                {
                    if p.len() != 2 * k || p.iter().any(|&x| x < 0) {
                        return Err(format!("pads {p:?} do not fit {k} spatial dims"));
                    }
                    pb[i] = p[i] as usize;
                    pe[i] = p[i + k] as usize;
                }
                let span = input[i] + pb[i] + pe[i];
                if span < ext {
                    return Err(format!(
                        "the window ({ext}) is larger than the padded input ({span}) in spatial dim {i}"
                    ));
                }
                let num = span - ext;
                out[i] = if ceil_mode { num.div_ceil(strides[i]) + 1 } else { num / strides[i] + 1 };
                // A window may not start in the end padding.
                if ceil_mode && (out[i] - 1) * strides[i] >= input[i] + pb[i] {
                    out[i] -= 1;
                }
            }
            other => return Err(format!("unknown auto_pad `{other}`")),
        }
    }
    Ok(Window { out, pad_begin: pb, pad_end: pe, kernel, strides, dilations })
}

fn f32s<'a>(a: &'a Array, what: &str) -> Result<&'a [f32]> {
    match &a.data {
        Data::F32(v) => Ok(v),
        _ => Err(EvalError::Unsupported(format!("{what} on {}", a.dtype))),
    }
}

/// Expands spatial dims to 3 (leading 1s) so one loop nest serves 1-D, 2-D and 3-D.
fn to3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut o = [fill; 3];
    let off = 3 - v.len().min(3);
    for (i, &x) in v.iter().enumerate().take(3) {
        o[off + i] = x;
    }
    o
}

fn conv(c: &op::Conv, inputs: &[Option<&Array>]) -> Result<Array> {
    let x = req(inputs, 0, "Conv")?;
    let w = req(inputs, 1, "Conv")?;
    let b = opt(inputs, 2);
    if x.rank() < 3 || x.rank() > 5 || w.rank() != x.rank() {
        return Err(EvalError::Unsupported(format!("Conv of rank {} with weight rank {}", x.rank(), w.rank())));
    }
    let (xs, ws) = (f32s(x, "Conv")?, f32s(w, "Conv")?);
    let (n, cin) = (x.shape[0], x.shape[1]);
    let m = w.shape[0];
    let g = c.group() as usize;
    if g == 0 || cin % g != 0 || m % g != 0 || w.shape[1] != cin / g {
        return Err(EvalError::Invalid(format!(
            "Conv weight {:?} does not fit input {:?} with group {g}",
            w.shape, x.shape
        )));
    }
    let kernel: Vec<i64> = c.kernel_shape.clone().unwrap_or_else(|| w.shape[2..].iter().map(|&d| d as i64).collect());
    let win = window(
        &x.shape[2..],
        &kernel,
        c.strides.as_deref(),
        c.dilations.as_deref(),
        c.pads.as_deref(),
        c.auto_pad(),
        false,
    )
    .map_err(EvalError::Invalid)?;
    let [id, ih, iw] = to3(&x.shape[2..], 1);
    let [od, oh, ow] = to3(&win.out, 1);
    let [kd, kh, kw] = to3(&win.kernel, 1);
    let [sd, sh, sw] = to3(&win.strides, 1);
    let [dd, dh, dw] = to3(&win.dilations, 1);
    let [pd, ph, pw] = to3(&win.pad_begin, 0);
    let (cg, mg) = (cin / g, m / g);
    let bias: Vec<f32> = match b {
        Some(b) => f32s(b, "Conv bias")?.to_vec(),
        None => vec![0.0; m],
    };
    let mut out = vec![0f32; n * m * od * oh * ow];
    let in_sp = id * ih * iw;
    let k_sp = kd * kh * kw;
    for ni in 0..n {
        for mi in 0..m {
            let gi = mi / mg;
            let obase = (ni * m + mi) * od * oh * ow;
            for z in 0..od {
                for y in 0..oh {
                    for xx in 0..ow {
                        let mut acc = bias[mi];
                        for ci in 0..cg {
                            let xbase = (ni * cin + gi * cg + ci) * in_sp;
                            let wbase = (mi * cg + ci) * k_sp;
                            for a in 0..kd {
                                let iz = (z * sd + a * dd) as isize - pd as isize;
                                if iz < 0 || iz >= id as isize {
                                    continue;
                                }
                                for bb in 0..kh {
                                    let iy = (y * sh + bb * dh) as isize - ph as isize;
                                    if iy < 0 || iy >= ih as isize {
                                        continue;
                                    }
                                    let row = xbase + (iz as usize * ih + iy as usize) * iw;
                                    let wrow = wbase + (a * kh + bb) * kw;
                                    for cc in 0..kw {
                                        let ix = (xx * sw + cc * dw) as isize - pw as isize;
                                        if ix < 0 || ix >= iw as isize {
                                            continue;
                                        }
                                        acc += xs[row + ix as usize] * ws[wrow + cc];
                                    }
                                }
                            }
                        }
                        out[obase + (z * oh + y) * ow + xx] = acc;
                    }
                }
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend(&win.out);
    Ok(Array::f32(shape, out))
}

/// Output spatial sizes and begin pads of a ConvTranspose.
pub fn conv_transpose_geometry(
    c: &op::ConvTranspose,
    input: &[usize],
    kernel: &[usize],
) -> std::result::Result<(Vec<usize>, Vec<usize>), String> {
    let k = input.len();
    let ones = vec![1i64; k];
    let strides = c.strides.clone().unwrap_or_else(|| ones.clone());
    let dil = c.dilations.clone().unwrap_or_else(|| ones.clone());
    let outpad = c.output_padding.clone().unwrap_or_else(|| vec![0; k]);
    if strides.len() != k || dil.len() != k || outpad.len() != k {
        return Err("ConvTranspose attributes do not fit the input rank".into());
    }
    let mut pads = c.pads.clone().unwrap_or_else(|| vec![0; 2 * k]);
    if pads.len() != 2 * k {
        return Err(format!("pads {pads:?} do not fit {k} spatial dims"));
    }
    let mut out = vec![0usize; k];
    for i in 0..k {
        let full = strides[i] * (input[i] as i64 - 1) + outpad[i] + (kernel[i] as i64 - 1) * dil[i] + 1;
        if let Some(os) = &c.output_shape {
            let target = *os.get(os.len().wrapping_sub(k) + i).ok_or("output_shape does not fit")?;
            let total = (full - target).max(0);
            let (a, b) = if c.auto_pad() == "SAME_UPPER" {
                (total / 2, total - total / 2)
            } else {
                (total - total / 2, total / 2)
            };
            pads[i] = a;
            pads[i + k] = b;
            out[i] = target.max(0) as usize;
        } else if matches!(c.auto_pad(), "SAME_UPPER" | "SAME_LOWER") {
            let target = input[i] as i64 * strides[i];
            let total = (full - target).max(0);
            let (a, b) = if c.auto_pad() == "SAME_UPPER" {
                (total / 2, total - total / 2)
            } else {
                (total - total / 2, total / 2)
            };
            pads[i] = a;
            pads[i + k] = b;
            out[i] = target as usize;
        } else {
            let o = full - pads[i] - pads[i + k];
            if o <= 0 {
                return Err("ConvTranspose output would be empty".into());
            }
            out[i] = o as usize;
        }
    }
    Ok((out, pads[..k].iter().map(|&p| p as usize).collect()))
}

fn conv_transpose(c: &op::ConvTranspose, inputs: &[Option<&Array>]) -> Result<Array> {
    let x = req(inputs, 0, "ConvTranspose")?;
    let w = req(inputs, 1, "ConvTranspose")?;
    if x.rank() < 3 || x.rank() > 5 || w.rank() != x.rank() {
        return Err(EvalError::Unsupported(format!("ConvTranspose of rank {}", x.rank())));
    }
    let (xs, ws) = (f32s(x, "ConvTranspose")?, f32s(w, "ConvTranspose")?);
    let (n, cin) = (x.shape[0], x.shape[1]);
    let g = c.group() as usize;
    let mg = w.shape[1];
    let m = mg * g;
    let cg = cin / g.max(1);
    let kernel: Vec<usize> = w.shape[2..].to_vec();
    let (out_sp, pb) = conv_transpose_geometry(c, &x.shape[2..], &kernel).map_err(EvalError::Invalid)?;
    let k = kernel.len();
    let strides = c.strides.clone().unwrap_or_else(|| vec![1; k]);
    let dil = c.dilations.clone().unwrap_or_else(|| vec![1; k]);
    let [id, ih, iw] = to3(&x.shape[2..], 1);
    let [od, oh, ow] = to3(&out_sp, 1);
    let [kd, kh, kw] = to3(&kernel, 1);
    let st: Vec<usize> = strides.iter().map(|&v| v as usize).collect();
    let dl: Vec<usize> = dil.iter().map(|&v| v as usize).collect();
    let [sd, sh, sw] = to3(&st, 1);
    let [dd, dh, dw] = to3(&dl, 1);
    let [pd, ph, pw] = to3(&pb, 0);
    let mut out = vec![0f32; n * m * od * oh * ow];
    if let Some(b) = opt(inputs, 2) {
        let b = f32s(b, "ConvTranspose bias")?;
        for ni in 0..n {
            for mi in 0..m {
                let base = (ni * m + mi) * od * oh * ow;
                out[base..base + od * oh * ow].iter_mut().for_each(|v| *v = b[mi]);
            }
        }
    }
    for ni in 0..n {
        for ci in 0..cin {
            let gi = ci / cg.max(1);
            for z in 0..id {
                for y in 0..ih {
                    for xx in 0..iw {
                        let v = xs[(((ni * cin + ci) * id + z) * ih + y) * iw + xx];
                        for mo in 0..mg {
                            let mi = gi * mg + mo;
                            for a in 0..kd {
                                let oz = (z * sd + a * dd) as isize - pd as isize;
                                if oz < 0 || oz >= od as isize {
                                    continue;
                                }
                                for bb in 0..kh {
                                    let oy = (y * sh + bb * dh) as isize - ph as isize;
                                    if oy < 0 || oy >= oh as isize {
                                        continue;
                                    }
                                    for cc in 0..kw {
                                        let ox = (xx * sw + cc * dw) as isize - pw as isize;
                                        if ox < 0 || ox >= ow as isize {
                                            continue;
                                        }
                                        let wv = ws[(((ci * mg + mo) * kd + a) * kh + bb) * kw + cc];
                                        out[(((ni * m + mi) * od + oz as usize) * oh + oy as usize) * ow
                                            + ox as usize] += v * wv;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend(out_sp);
    Ok(Array::f32(shape, out))
}

#[derive(Copy, Clone, PartialEq)]
enum PoolKind {
    Max,
    Avg { include_pad: bool },
    Lp(i64),
}

#[allow(clippy::too_many_arguments)]
fn pool(
    x: &Array,
    kind: PoolKind,
    kernel: &[i64],
    strides: Option<&[i64]>,
    dilations: Option<&[i64]>,
    pads: Option<&[i64]>,
    auto_pad: &str,
    ceil_mode: bool,
    want_indices: bool,
) -> Result<Vec<Array>> {
    if x.rank() < 3 || x.rank() > 5 {
        return Err(EvalError::Unsupported(format!("pooling of rank {}", x.rank())));
    }
    let xs = f32s(x, "pooling")?;
    let win =
        window(&x.shape[2..], kernel, strides, dilations, pads, auto_pad, ceil_mode).map_err(EvalError::Invalid)?;
    let (n, c) = (x.shape[0], x.shape[1]);
    let [id, ih, iw] = to3(&x.shape[2..], 1);
    let [od, oh, ow] = to3(&win.out, 1);
    let [kd, kh, kw] = to3(&win.kernel, 1);
    let [sd, sh, sw] = to3(&win.strides, 1);
    let [dd, dh, dw] = to3(&win.dilations, 1);
    let [pd, ph, pw] = to3(&win.pad_begin, 0);
    let [ped, peh, pew] = to3(&win.pad_end, 0);
    let mut out = Vec::with_capacity(n * c * od * oh * ow);
    let mut idx = Vec::new();
    for plane in 0..n * c {
        let base = plane * id * ih * iw;
        for z in 0..od {
            for y in 0..oh {
                for xx in 0..ow {
                    let mut best = f32::NEG_INFINITY;
                    let mut best_i = 0usize;
                    let mut sum = 0f64;
                    let mut count = 0usize;
                    let mut padded_count = 0usize;
                    for a in 0..kd {
                        let iz = (z * sd + a * dd) as isize - pd as isize;
                        for b in 0..kh {
                            let iy = (y * sh + b * dh) as isize - ph as isize;
                            for cc in 0..kw {
                                let ix = (xx * sw + cc * dw) as isize - pw as isize;
                                let inside_pad = iz >= -(pd as isize)
                                    && iz < (id + ped) as isize
                                    && iy >= -(ph as isize)
                                    && iy < (ih + peh) as isize
                                    && ix >= -(pw as isize)
                                    && ix < (iw + pew) as isize;
                                if inside_pad {
                                    padded_count += 1;
                                }
                                if iz < 0
                                    || iz >= id as isize
                                    || iy < 0
                                    || iy >= ih as isize
                                    || ix < 0
                                    || ix >= iw as isize
                                {
                                    continue;
                                }
                                let off = (iz as usize * ih + iy as usize) * iw + ix as usize;
                                let v = xs[base + off];
                                count += 1;
                                match kind {
                                    PoolKind::Max => {
                                        if v > best || best.is_nan() {
                                            best = v;
                                            best_i = base + off;
                                        }
                                    }
                                    PoolKind::Avg { .. } => sum += f64::from(v),
                                    PoolKind::Lp(p) => sum += f64::from(v.abs()).powi(p as i32),
                                }
                            }
                        }
                    }
                    out.push(match kind {
                        PoolKind::Max => best,
                        PoolKind::Avg { include_pad } => {
                            let d = if include_pad { padded_count } else { count };
                            (sum / d.max(1) as f64) as f32
                        }
                        PoolKind::Lp(p) => sum.powf(1.0 / p as f64) as f32,
                    });
                    if want_indices {
                        idx.push(best_i as i64);
                    }
                }
            }
        }
    }
    let mut shape = vec![n, c];
    shape.extend(&win.out);
    let mut res = vec![Array::f32(shape.clone(), out)];
    if want_indices {
        res.push(Array::i64(shape, idx));
    }
    Ok(res)
}

fn global_pool(x: &Array, kind: PoolKind) -> Result<Array> {
    let kernel: Vec<i64> = x.shape[2..].iter().map(|&d| d as i64).collect();
    Ok(pool(x, kind, &kernel, None, None, None, "NOTSET", false, false)?.remove(0))
}

fn channel_params(a: &Array, c: usize, what: &str) -> Result<Vec<f64>> {
    let v = a.to_f64()?;
    if v.len() != c {
        return Err(EvalError::Invalid(format!("{what} has {} values for {c} channels", v.len())));
    }
    Ok(v)
}

fn batch_norm(b: &op::BatchNormalization, inputs: &[Option<&Array>], n_out: usize) -> Result<Vec<Array>> {
    let x = req(inputs, 0, "BatchNormalization")?;
    let c = *x.shape.get(1).unwrap_or(&1);
    let scale = channel_params(req(inputs, 1, "BatchNormalization")?, c, "scale")?;
    let bias = channel_params(req(inputs, 2, "BatchNormalization")?, c, "bias")?;
    let mut mean = channel_params(req(inputs, 3, "BatchNormalization")?, c, "mean")?;
    let mut var = channel_params(req(inputs, 4, "BatchNormalization")?, c, "var")?;
    let eps = f64::from(b.epsilon());
    let v = x.to_f64()?;
    let n = x.shape[0];
    let sp: usize = x.shape[2..].iter().product();
    let training = b.training_mode() != 0;
    let (running_mean, running_var) = (mean.clone(), var.clone());
    if training {
        for ci in 0..c {
            let mut s = 0.0;
            for ni in 0..n {
                s += v[(ni * c + ci) * sp..(ni * c + ci + 1) * sp].iter().sum::<f64>();
            }
            let m = s / (n * sp) as f64;
            let mut q = 0.0;
            for ni in 0..n {
                q += v[(ni * c + ci) * sp..(ni * c + ci + 1) * sp].iter().map(|a| (a - m) * (a - m)).sum::<f64>();
            }
            mean[ci] = m;
            var[ci] = q / (n * sp) as f64;
        }
    }
    let mut out = vec![0.0; v.len()];
    for ni in 0..n {
        for ci in 0..c {
            let k = scale[ci] / (var[ci] + eps).sqrt();
            for s in 0..sp {
                let i = (ni * c + ci) * sp + s;
                out[i] = (v[i] - mean[ci]) * k + bias[ci];
            }
        }
    }
    let mut res = vec![Array::float(x.dtype, x.shape.clone(), out)];
    if training && n_out > 1 {
        let mo = f64::from(b.momentum());
        let rm: Vec<f64> = (0..c).map(|i| running_mean[i] * mo + mean[i] * (1.0 - mo)).collect();
        let rv: Vec<f64> = (0..c).map(|i| running_var[i] * mo + var[i] * (1.0 - mo)).collect();
        res.push(Array::float(x.dtype, vec![c], rm));
        res.push(Array::float(x.dtype, vec![c], rv));
    }
    Ok(res)
}

fn layer_norm(l: &op::LayerNormalization, inputs: &[Option<&Array>], n_out: usize) -> Result<Vec<Array>> {
    let x = req(inputs, 0, "LayerNormalization")?;
    let a = axis(l.axis(), x.rank())?;
    let outer: usize = x.shape[..a].iter().product();
    let inner: usize = x.shape[a..].iter().product();
    let v = x.to_f64()?;
    let norm_shape = &x.shape[a..];
    let expand = |arr: &Array| -> Result<Vec<f64>> {
        let vals = arr.to_f64()?;
        let out = broadcast_shapes(norm_shape, &arr.shape)?;
        if out != norm_shape {
            return Err(EvalError::Invalid(format!(
                "LayerNormalization parameter {:?} does not fit {norm_shape:?}",
                arr.shape
            )));
        }
        Ok(broadcast_index(norm_shape, &arr.shape).iter().map(|&i| vals[i]).collect())
    };
    let scale = expand(req(inputs, 1, "LayerNormalization")?)?;
    let bias = match opt(inputs, 2) {
        Some(b) => expand(b)?,
        None => vec![0.0; inner],
    };
    let eps = f64::from(l.epsilon());
    let mut out = vec![0.0; v.len()];
    let mut means = Vec::with_capacity(outer);
    let mut inv = Vec::with_capacity(outer);
    for o in 0..outer {
        let row = &v[o * inner..(o + 1) * inner];
        let m = row.iter().sum::<f64>() / inner as f64;
        let var = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / inner as f64;
        let r = 1.0 / (var + eps).sqrt();
        for j in 0..inner {
            out[o * inner + j] = (row[j] - m) * r * scale[j] + bias[j];
        }
        means.push(m);
        inv.push(r);
    }
    let mut res = vec![Array::float(x.dtype, x.shape.clone(), out)];
    let stat_shape: Vec<usize> = (0..x.rank()).map(|d| if d < a { x.shape[d] } else { 1 }).collect();
    if n_out > 1 {
        res.push(Array::float(DType::Float, stat_shape.clone(), means));
    }
    if n_out > 2 {
        res.push(Array::float(DType::Float, stat_shape, inv));
    }
    Ok(res)
}

fn group_like_norm(
    x: &Array,
    groups: usize,
    scale: &[f64],
    bias: &[f64],
    eps: f64,
    per_group_params: bool,
) -> Result<Array> {
    let n = x.shape[0];
    let c = x.shape[1];
    let sp: usize = x.shape[2..].iter().product();
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(EvalError::Invalid(format!("{c} channels do not split into {groups} groups")));
    }
    let cpg = c / groups;
    let v = x.to_f64()?;
    let mut out = vec![0.0; v.len()];
    for ni in 0..n {
        for gi in 0..groups {
            let start = (ni * c + gi * cpg) * sp;
            let len = cpg * sp;
            let seg = &v[start..start + len];
            let m = seg.iter().sum::<f64>() / len as f64;
            let var = seg.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / len as f64;
            let r = 1.0 / (var + eps).sqrt();
            for k in 0..len {
                let ch = gi * cpg + k / sp;
                let pi = if per_group_params { gi } else { ch };
                out[start + k] = (seg[k] - m) * r * scale[pi] + bias[pi];
            }
        }
    }
    Ok(Array::float(x.dtype, x.shape.clone(), out))
}

fn lrn(l: &op::LRN, x: &Array) -> Result<Array> {
    let size = l.size.unwrap_or(1).max(1) as usize;
    let (alpha, beta, bias) = (f64::from(l.alpha()), f64::from(l.beta()), f64::from(l.bias()));
    let v = x.to_f64()?;
    let (n, c) = (x.shape[0], x.shape[1]);
    let sp: usize = x.shape[2..].iter().product();
    let lo = (size - 1) / 2;
    let hi = size - 1 - lo;
    let mut out = vec![0.0; v.len()];
    for ni in 0..n {
        for ci in 0..c {
            for s in 0..sp {
                let a = ci.saturating_sub(lo);
                let b = (ci + hi).min(c - 1);
                let sq: f64 = (a..=b).map(|k| v[(ni * c + k) * sp + s].powi(2)).sum();
                let i = (ni * c + ci) * sp + s;
                out[i] = v[i] / (bias + alpha / size as f64 * sq).powf(beta);
            }
        }
    }
    Ok(Array::float(x.dtype, x.shape.clone(), out))
}

/// Numpy matmul of float arrays, with 1-D promotion and batch broadcasting.
pub fn matmul(a: &Array, b: &Array) -> Result<Array> {
    if a.dtype != b.dtype {
        return Err(EvalError::Invalid(format!("MatMul of {} and {}", a.dtype, b.dtype)));
    }
    let (mut ash, mut bsh) = (a.shape.clone(), b.shape.clone());
    let (a1, b1) = (ash.len() == 1, bsh.len() == 1);
    if a1 {
        ash.insert(0, 1);
    }
    if b1 {
        bsh.push(1);
    }
    if ash.len() < 2 || bsh.len() < 2 {
        return Err(EvalError::Invalid("MatMul of scalars".into()));
    }
    let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
    let (k2, n) = (bsh[bsh.len() - 2], bsh[bsh.len() - 1]);
    if k != k2 {
        return Err(EvalError::Invalid(format!("MatMul of {:?} and {:?}: inner dims differ", a.shape, b.shape)));
    }
    let abatch = &ash[..ash.len() - 2];
    let bbatch = &bsh[..bsh.len() - 2];
    let batch = broadcast_shapes(abatch, bbatch)?;
    let ia = broadcast_index(&batch, abatch);
    let ib = broadcast_index(&batch, bbatch);
    let nb = numel(&batch);
    let mut out_shape = batch.clone();
    if !a1 {
        out_shape.push(m);
    }
    if !b1 {
        out_shape.push(n);
    }
    match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            let mut out = vec![0f32; nb * m * n];
            for bi in 0..nb {
                let (ao, bo, oo) = (ia[bi] * m * k, ib[bi] * k * n, bi * m * n);
                for i in 0..m {
                    let orow = &mut out[oo + i * n..oo + (i + 1) * n];
                    for p in 0..k {
                        let av = x[ao + i * k + p];
                        if av == 0.0 {
                            continue;
                        }
                        let brow = &y[bo + p * n..bo + (p + 1) * n];
                        for (o, &bv) in orow.iter_mut().zip(brow) {
                            *o += av * bv;
                        }
                    }
                }
            }
            Ok(Array { dtype: a.dtype, shape: out_shape, data: Data::F32(out) })
        }
        _ => {
            let (x, y) = (a.to_f64()?, b.to_f64()?);
            let mut out = vec![0f64; nb * m * n];
            for bi in 0..nb {
                let (ao, bo, oo) = (ia[bi] * m * k, ib[bi] * k * n, bi * m * n);
                for i in 0..m {
                    for p in 0..k {
                        let av = x[ao + i * k + p];
                        for j in 0..n {
                            out[oo + i * n + j] += av * y[bo + p * n + j];
                        }
                    }
                }
            }
            match a.data {
                Data::I64(_) => Ok(Array::int(a.dtype, out_shape, out.iter().map(|&v| v as i64).collect())),
                _ => Ok(Array::float(a.dtype, out_shape, out)),
            }
        }
    }
}

fn gemm(g: &op::Gemm, inputs: &[Option<&Array>]) -> Result<Array> {
    let mut a = req(inputs, 0, "Gemm")?.clone();
    let mut b = req(inputs, 1, "Gemm")?.clone();
    if a.rank() != 2 || b.rank() != 2 {
        return Err(EvalError::Invalid(format!("Gemm needs 2-D inputs, got {:?} and {:?}", a.shape, b.shape)));
    }
    if g.trans_a() != 0 {
        a = transpose(&a, &[1, 0]);
    }
    if g.trans_b() != 0 {
        b = transpose(&b, &[1, 0]);
    }
    let y = matmul(&a, &b)?;
    let alpha = g.alpha();
    let beta = g.beta();
    let mut v = y.to_f32()?;
    if alpha != 1.0 {
        v.iter_mut().for_each(|x| *x *= alpha);
    }
    if let Some(c) = opt(inputs, 2) {
        let cv = c.to_f32()?;
        let idx = broadcast_index(&y.shape, &c.shape);
        if broadcast_shapes(&y.shape, &c.shape)? != y.shape {
            return Err(EvalError::Invalid(format!("Gemm C {:?} does not broadcast to {:?}", c.shape, y.shape)));
        }
        for (o, &i) in v.iter_mut().zip(&idx) {
            *o += beta * cv[i];
        }
    }
    Ok(Array { dtype: y.dtype, shape: y.shape, data: Data::F32(v) })
}

fn einsum(equation: &str, inputs: &[&Array]) -> Result<Array> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != inputs.len() {
        return Err(EvalError::Invalid(format!(
            "Einsum `{equation}` has {} terms for {} inputs",
            terms.len(),
            inputs.len()
        )));
    }
    // Expand `...` into upper-case placeholder letters.
    let ell_rank = terms
        .iter()
        .zip(inputs)
        .filter(|(t, _)| t.contains("..."))
        .map(|(t, a)| a.rank() + 3 - t.len())
        .max()
        .unwrap_or(0);
    let ell: String = (0..ell_rank).map(|i| (b'A' + i as u8) as char).collect();
    let expand = |t: &str, rank: usize| -> String {
        if let Some(pos) = t.find("...") {
            let k = rank + 3 - t.len();
            format!("{}{}{}", &t[..pos], &ell[ell_rank - k..], &t[pos + 3..])
        } else {
            t.to_string()
        }
    };
    let terms: Vec<String> = terms.iter().zip(inputs).map(|(t, a)| expand(t, a.rank())).collect();
    let out_term = match rhs {
        Some(r) => expand(&r, ell_rank + r.len().saturating_sub(3)).replace("...", &ell),
        None => {
            let mut counts = std::collections::BTreeMap::new();
            for t in &terms {
                for c in t.chars() {
                    *counts.entry(c).or_insert(0) += 1;
                }
            }
            let mut s: String = ell.clone();
            s.extend(counts.iter().filter(|(c, n)| **n == 1 && c.is_ascii_lowercase()).map(|(c, _)| *c));
            s
        }
    };
    let mut size = std::collections::BTreeMap::new();
    for (t, a) in terms.iter().zip(inputs) {
        if t.len() != a.rank() {
            return Err(EvalError::Invalid(format!("Einsum term `{t}` does not fit rank {}", a.rank())));
        }
        for (c, &d) in t.chars().zip(&a.shape) {
            let e = size.entry(c).or_insert(d);
            if *e == 1 {
                *e = d;
            } else if d != 1 && *e != d {
                return Err(EvalError::Invalid(format!("Einsum index `{c}` has sizes {e} and {d}")));
            }
        }
    }
    let letters: Vec<char> = size.keys().copied().collect();
    let dims: Vec<usize> = letters.iter().map(|c| size[c]).collect();
    let pos = |c: char| letters.iter().position(|&l| l == c).expect("letter collected");
    let vals: Vec<Vec<f64>> = inputs.iter().map(|a| a.to_f64()).collect::<Result<_>>()?;
    let in_maps: Vec<Vec<(usize, usize)>> = terms
        .iter()
        .zip(inputs)
        .map(|(t, a)| {
            let st = strides(&a.shape);
            t.chars().enumerate().map(|(i, c)| (pos(c), if a.shape[i] == 1 { 0 } else { st[i] })).collect()
        })
        .collect();
    let out_shape: Vec<usize> = out_term.chars().map(|c| size[&c]).collect();
    let ost = strides(&out_shape);
    let out_map: Vec<(usize, usize)> = out_term.chars().enumerate().map(|(i, c)| (pos(c), ost[i])).collect();
    let mut out = vec![0.0; numel(&out_shape)];
    let total = numel(&dims);
    let mut counter = vec![0usize; dims.len()];
    for _ in 0..total {
        let mut prod = 1.0;
        for (v, m) in vals.iter().zip(&in_maps) {
            let off: usize = m.iter().map(|&(l, s)| counter[l] * s).sum();
            prod *= v[off];
        }
        let o: usize = out_map.iter().map(|&(l, s)| counter[l] * s).sum();
        out[o] += prod;
        for d in (0..dims.len()).rev() {
            counter[d] += 1;
            if counter[d] < dims[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(Array::float(inputs[0].dtype, out_shape, out))
}

// ---------------------------------------------------------------- resize

fn cubic_weights(t: f64, a: f64) -> [f64; 4] {
    let w = |x: f64| {
        let x = x.abs();
        if x <= 1.0 {
            (a + 2.0) * x.powi(3) - (a + 3.0) * x * x + 1.0
        } else if x < 2.0 {
            a * x.powi(3) - 5.0 * a * x * x + 8.0 * a * x - 4.0 * a
        } else {
            0.0
        }
    };
    [w(1.0 + t), w(t), w(1.0 - t), w(2.0 - t)]
}

fn resize_axis(
    v: &[f64],
    shape: &[usize],
    ax: usize,
    out_len: usize,
    scale: f64,
    r: &ResizeParams,
) -> Result<Vec<f64>> {
    let outer: usize = shape[..ax].iter().product();
    let n = shape[ax];
    let inner: usize = shape[ax + 1..].iter().product();
    let mut out = vec![0.0; outer * out_len * inner];
    for j in 0..out_len {
        let x = match r.coord.as_str() {
            "half_pixel" => (j as f64 + 0.5) / scale - 0.5,
            "half_pixel_symmetric" => {
                let adj = out_len as f64 / (scale * n as f64);
                let center = n as f64 / 2.0;
                let offset = center * (1.0 - adj);
                offset + (j as f64 + 0.5) / scale - 0.5
            }
            "pytorch_half_pixel" => {
                if out_len > 1 {
                    (j as f64 + 0.5) / scale - 0.5
                } else {
                    0.0
                }
            }
            "align_corners" => {
                if out_len > 1 {
                    j as f64 * (n as f64 - 1.0) / (out_len as f64 - 1.0)
                } else {
                    0.0
                }
            }
            "asymmetric" => j as f64 / scale,
            other => return Err(EvalError::Unsupported(format!("Resize coordinate_transformation_mode `{other}`"))),
        };
        // (source index, weight) pairs.
        let taps: Vec<(usize, f64)> = match r.mode.as_str() {
            "nearest" => {
                let i = match r.nearest.as_str() {
                    "round_prefer_ceil" => (x + 0.5).floor(),
                    "floor" => x.floor(),
                    "ceil" => x.ceil(),
                    _ => {
                        if x.fract() == 0.5 {
                            x.floor()
                        } else {
                            x.round()
                        }
                    }
                };
                vec![(i.clamp(0.0, n as f64 - 1.0) as usize, 1.0)]
            }
            "linear" => {
                let xc = x.clamp(0.0, n as f64 - 1.0);
                let i0 = xc.floor() as usize;
                let i1 = (i0 + 1).min(n - 1);
                let t = xc - i0 as f64;
                vec![(i0, 1.0 - t), (i1, t)]
            }
            "cubic" => {
                let i0 = x.floor();
                let t = x - i0;
                let w = cubic_weights(t, r.cubic_a);
                let mut taps = Vec::new();
                let mut wsum = 0.0;
                for (k, wk) in w.iter().enumerate() {
                    let idx = i0 as i64 - 1 + k as i64;
                    if r.exclude_outside && (idx < 0 || idx >= n as i64) {
                        continue;
                    }
                    wsum += wk;
                    taps.push((idx.clamp(0, n as i64 - 1) as usize, *wk));
                }
                if r.exclude_outside && wsum != 0.0 {
                    taps.iter_mut().for_each(|t| t.1 /= wsum);
                }
                taps
            }
            other => return Err(EvalError::Unsupported(format!("Resize mode `{other}`"))),
        };
        for o in 0..outer {
            for i in 0..inner {
                out[(o * out_len + j) * inner + i] = taps.iter().map(|&(s, w)| w * v[(o * n + s) * inner + i]).sum();
            }
        }
    }
    Ok(out)
}

struct ResizeParams {
    mode: String,
    coord: String,
    nearest: String,
    cubic_a: f64,
    exclude_outside: bool,
}

/// Output sizes and per-axis scales of a Resize.
pub fn resize_sizes(
    r: &op::Resize,
    input: &[usize],
    scales: Option<&[f64]>,
    sizes: Option<&[i64]>,
) -> std::result::Result<(Vec<usize>, Vec<f64>), String> {
    let rank = input.len();
    let axes: Vec<usize> = match &r.axes {
        Some(a) => a.iter().map(|&x| (if x < 0 { x + rank as i64 } else { x }) as usize).collect(),
        None => (0..rank).collect(),
    };
    let mut out = input.to_vec();
    let mut sc = vec![1.0; rank];
    if let Some(sz) = sizes.filter(|s| !s.is_empty()) {
        if sz.len() != axes.len() {
            return Err(format!("Resize sizes {sz:?} do not fit {} axes", axes.len()));
        }
        let policy = r.keep_aspect_ratio_policy();
        let ratios: Vec<f64> = axes.iter().zip(sz).map(|(&a, &s)| s as f64 / input[a] as f64).collect();
        let common = match policy {
            "not_larger" => ratios.iter().copied().fold(f64::INFINITY, f64::min),
            "not_smaller" => ratios.iter().copied().fold(0.0, f64::max),
            _ => 0.0,
        };
        for (k, &a) in axes.iter().enumerate() {
            if policy == "stretch" {
                out[a] = sz[k].max(0) as usize;
                sc[a] = ratios[k];
            } else {
                sc[a] = common;
                out[a] = (input[a] as f64 * common).round() as usize;
            }
        }
    } else if let Some(s) = scales.filter(|s| !s.is_empty()) {
        if s.len() != axes.len() {
            return Err(format!("Resize scales {s:?} do not fit {} axes", axes.len()));
        }
        for (k, &a) in axes.iter().enumerate() {
            sc[a] = s[k];
            out[a] = (input[a] as f64 * s[k]).floor() as usize;
        }
    } else {
        return Err("Resize needs scales or sizes".into());
    }
    Ok((out, sc))
}

fn resize(r: &op::Resize, inputs: &[Option<&Array>]) -> Result<Array> {
    let x = req(inputs, 0, "Resize")?;
    // Opset 10 has (X, scales); later opsets (X, roi, scales, sizes).
    let (scales, sizes) = if inputs.len() == 2 {
        (opt(inputs, 1).map(|a| a.to_f64()).transpose()?, None)
    } else {
        (opt(inputs, 2).map(|a| a.to_f64()).transpose()?, opt(inputs, 3).map(|a| a.to_i64()).transpose()?)
    };
    let (out_shape, sc) = resize_sizes(r, &x.shape, scales.as_deref(), sizes.as_deref()).map_err(EvalError::Invalid)?;
    let params = ResizeParams {
        mode: r.mode().to_string(),
        coord: r.coordinate_transformation_mode().to_string(),
        nearest: r.nearest_mode().to_string(),
        cubic_a: f64::from(r.cubic_coeff_a()),
        exclude_outside: r.exclude_outside() != 0,
    };
    let mut v = x.to_f64()?;
    let mut shape = x.shape.clone();
    for ax in 0..shape.len() {
        if out_shape[ax] != shape[ax] || sc[ax] != 1.0 {
            v = resize_axis(&v, &shape, ax, out_shape[ax], sc[ax], &params)?;
            shape[ax] = out_shape[ax];
        }
    }
    Ok(Array::float(x.dtype, shape, v))
}

fn upsample(u: &op::Upsample, inputs: &[Option<&Array>]) -> Result<Array> {
    let x = req(inputs, 0, "Upsample")?;
    let scales: Vec<f64> = match (opt(inputs, 1), &u.scales) {
        (Some(s), _) => s.to_f64()?,
        (None, Some(s)) => s.iter().map(|&v| f64::from(v)).collect(),
        _ => return Err(EvalError::Invalid("Upsample without scales".into())),
    };
    let r = op::Resize {
        mode: Some(if u.mode() == "nearest" { "nearest".into() } else { "linear".into() }),
        coordinate_transformation_mode: Some("asymmetric".into()),
        nearest_mode: Some("floor".into()),
        ..Default::default()
    };
    let s = Array { dtype: DType::Double, shape: vec![scales.len()], data: Data::F64(scales) };
    resize(&r, &[Some(x), None, Some(&s)])
}

// ---------------------------------------------------------------- recurrent

fn activation(name: &str, alpha: Option<f64>, beta: Option<f64>) -> Result<Box<dyn Fn(f64) -> f64>> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "sigmoid" => Box::new(|x: f64| 1.0 / (1.0 + (-x).exp())),
        "tanh" => Box::new(|x: f64| x.tanh()),
        "relu" => Box::new(|x: f64| x.max(0.0)),
        "affine" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(0.0));
            Box::new(move |x| a * x + b)
        }
        "leakyrelu" => {
            let a = alpha.unwrap_or(0.01);
            Box::new(move |x| if x >= 0.0 { x } else { a * x })
        }
        "thresholdedrelu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x| if x > a { x } else { 0.0 })
        }
        "scaledtanh" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(1.0));
            Box::new(move |x| a * (b * x).tanh())
        }
        "hardsigmoid" => {
            let (a, b) = (alpha.unwrap_or(0.2), beta.unwrap_or(0.5));
            Box::new(move |x| (a * x + b).clamp(0.0, 1.0))
        }
        "elu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x| if x >= 0.0 { x } else { a * (x.exp() - 1.0) })
        }
        "softsign" => Box::new(|x: f64| x / (1.0 + x.abs())),
        "softplus" => Box::new(|x: f64| x.exp().ln_1p()),
        other => return Err(EvalError::Unsupported(format!("recurrent activation `{other}`"))),
    })
}

struct Rnn<'a> {
    kind: &'a str,
    gates: usize,
    hidden: usize,
    direction: String,
    layout: i64,
    clip: Option<f64>,
    activations: Vec<String>,
    alphas: Vec<f32>,
    betas: Vec<f32>,
    linear_before_reset: bool,
    input_forget: bool,
}

fn recurrent(r: &Rnn<'_>, inputs: &[Option<&Array>], n_out: usize) -> Result<Vec<Array>> {
    let what = r.kind;
    let mut x = req(inputs, 0, what)?.clone();
    if r.layout == 1 {
        x = transpose(&x, &[1, 0, 2]);
    }
    let xv = x.to_f64()?;
    let (seq, batch, isz) = (x.shape[0], x.shape[1], x.shape[2]);
    let w = req(inputs, 1, what)?.to_f64()?;
    let rr = req(inputs, 2, what)?.to_f64()?;
    let dirs = if r.direction == "bidirectional" { 2 } else { 1 };
    let h = r.hidden;
    let g = r.gates;
    if w.len() != dirs * g * h * isz || rr.len() != dirs * g * h * h {
        return Err(EvalError::Invalid(format!("{what} weights do not fit hidden_size {h} and input size {isz}")));
    }
    let bias = opt(inputs, 3).map(|b| b.to_f64()).transpose()?.unwrap_or_else(|| vec![0.0; dirs * 2 * g * h]);
    let lens: Vec<usize> = match opt(inputs, 4) {
        Some(l) => l.to_i64()?.iter().map(|&v| v.max(0) as usize).collect(),
        None => vec![seq; batch],
    };
    let h0 = opt(inputs, 5).map(|a| a.to_f64()).transpose()?;
    let c0 = if r.kind == "LSTM" { opt(inputs, 6).map(|a| a.to_f64()).transpose()? } else { None };
    let peep = if r.kind == "LSTM" { opt(inputs, 7).map(|a| a.to_f64()).transpose()? } else { None };
    // Activations: f, g, h for LSTM; f, g for GRU; f for RNN; per direction.
    let per_dir = match r.kind {
        "LSTM" => 3,
        "GRU" => 2,
        _ => 1,
    };
    let defaults: &[&str] = match r.kind {
        "LSTM" => &["Sigmoid", "Tanh", "Tanh"],
        "GRU" => &["Sigmoid", "Tanh"],
        _ => &["Tanh"],
    };
    let mut acts = Vec::new();
    let mut ai = 0;
    for d in 0..dirs {
        let mut set = Vec::new();
        for k in 0..per_dir {
            let name = r.activations.get(d * per_dir + k).map(String::as_str).unwrap_or(defaults[k]);
            let needs = matches!(
                name.to_ascii_lowercase().as_str(),
                "affine" | "leakyrelu" | "thresholdedrelu" | "scaledtanh" | "hardsigmoid" | "elu"
            );
            let (a, b) = if needs {
                let a = r.alphas.get(ai).map(|&v| f64::from(v));
                let b = r.betas.get(ai).map(|&v| f64::from(v));
                ai += 1;
                (a, b)
            } else {
                (None, None)
            };
            set.push(activation(name, a, b)?);
        }
        acts.push(set);
    }
    let clip = |v: f64| match r.clip {
        Some(c) => v.clamp(-c, c),
        None => v,
    };
    let mut y = vec![0.0; seq * dirs * batch * h];
    let mut yh = vec![0.0; dirs * batch * h];
    let mut yc = vec![0.0; dirs * batch * h];
    for d in 0..dirs {
        let reverse = r.direction == "reverse" || d == 1;
        let wd = &w[d * g * h * isz..(d + 1) * g * h * isz];
        let rd = &rr[d * g * h * h..(d + 1) * g * h * h];
        let wb = &bias[d * 2 * g * h..d * 2 * g * h + g * h];
        let rb = &bias[d * 2 * g * h + g * h..(d + 1) * 2 * g * h];
        let act = &acts[d];
        for b in 0..batch {
            let mut hs: Vec<f64> = match &h0 {
                Some(v) => v[(d * batch + b) * h..(d * batch + b + 1) * h].to_vec(),
                None => vec![0.0; h],
            };
            let mut cs: Vec<f64> = match &c0 {
                Some(v) => v[(d * batch + b) * h..(d * batch + b + 1) * h].to_vec(),
                None => vec![0.0; h],
            };
            let len = lens[b].min(seq);
            for step in 0..len {
                let t = if reverse { len - 1 - step } else { step };
                let xt = &xv[(t * batch + b) * isz..(t * batch + b + 1) * isz];
                // gx[j] = W_j·x + Wb_j, gh[j] = R_j·h + Rb_j
                let mut gx = vec![0.0; g * h];
                let mut gh = vec![0.0; g * h];
                for j in 0..g * h {
                    gx[j] = wb[j] + wd[j * isz..(j + 1) * isz].iter().zip(xt).map(|(a, b)| a * b).sum::<f64>();
                    gh[j] = rb[j] + rd[j * h..(j + 1) * h].iter().zip(&hs).map(|(a, b)| a * b).sum::<f64>();
                }
                let mut hn = vec![0.0; h];
                match r.kind {
                    "LSTM" => {
                        // Gate order i, o, f, c.
                        let p = peep.as_ref().map(|p| &p[d * 3 * h..(d + 1) * 3 * h]);
                        for k in 0..h {
                            let pi = p.map_or(0.0, |p| p[k] * cs[k]);
                            let pf = p.map_or(0.0, |p| p[2 * h + k] * cs[k]);
                            let i = act[0](clip(gx[k] + gh[k] + pi));
                            let mut f = act[0](clip(gx[2 * h + k] + gh[2 * h + k] + pf));
                            if r.input_forget {
                                f = 1.0 - i;
                            }
                            let c = act[1](clip(gx[3 * h + k] + gh[3 * h + k]));
                            let cn = f * cs[k] + i * c;
                            let po = p.map_or(0.0, |p| p[h + k] * cn);
                            let o = act[0](clip(gx[h + k] + gh[h + k] + po));
                            cs[k] = cn;
                            hn[k] = o * act[2](cn);
                        }
                    }
                    "GRU" => {
                        // Gate order z, r, h.
                        let mut rgate = vec![0.0; h];
                        let mut z = vec![0.0; h];
                        for k in 0..h {
                            z[k] = act[0](clip(gx[k] + gh[k]));
                            rgate[k] = act[0](clip(gx[h + k] + gh[h + k]));
                        }
                        for k in 0..h {
                            let hh = if r.linear_before_reset {
                                gx[2 * h + k] + rgate[k] * gh[2 * h + k]
                            } else {
                                let rh: f64 = (0..h).map(|q| rd[(2 * h + k) * h + q] * rgate[q] * hs[q]).sum();
                                gx[2 * h + k] + rh + rb[2 * h + k]
                            };
                            let ht = act[1](clip(hh));
                            hn[k] = (1.0 - z[k]) * ht + z[k] * hs[k];
                        }
                    }
                    _ => {
                        for k in 0..h {
                            hn[k] = act[0](clip(gx[k] + gh[k]));
                        }
                    }
                }
                hs = hn;
                y[((t * dirs + d) * batch + b) * h..((t * dirs + d) * batch + b + 1) * h].copy_from_slice(&hs);
            }
            yh[(d * batch + b) * h..(d * batch + b + 1) * h].copy_from_slice(&hs);
            yc[(d * batch + b) * h..(d * batch + b + 1) * h].copy_from_slice(&cs);
        }
    }
    let dt = x.dtype;
    let mut ya = Array::float(dt, vec![seq, dirs, batch, h], y);
    let mut yha = Array::float(dt, vec![dirs, batch, h], yh);
    let mut yca = Array::float(dt, vec![dirs, batch, h], yc);
    if r.layout == 1 {
        ya = transpose(&ya, &[2, 0, 1, 3]);
        yha = transpose(&yha, &[1, 0, 2]);
        yca = transpose(&yca, &[1, 0, 2]);
    }
    let mut out = vec![ya, yha];
    if r.kind == "LSTM" {
        out.push(yca);
    }
    out.truncate(n_out.max(1));
    Ok(out)
}

pub(crate) fn eval_nn(op: &Op, inputs: &[Option<&Array>], n_out: usize) -> Result<Vec<Array>> {
    let one = |a: Array| Ok(vec![a]);
    let name = op.op_type();
    match op {
        Op::MatMul(_) => one(matmul(req(inputs, 0, name)?, req(inputs, 1, name)?)?),
        Op::Gemm(g) => one(gemm(g, inputs)?),
        Op::Einsum(e) => {
            let all: Vec<&Array> = inputs.iter().flatten().copied().collect();
            one(einsum(e.equation.as_deref().unwrap_or(""), &all)?)
        }
        Op::Conv(c) => one(conv(c, inputs)?),
        Op::ConvTranspose(c) => one(conv_transpose(c, inputs)?),
        Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_) => {
            let x = req(inputs, 0, name)?;
            let a = op.pool_attrs().expect("a pooling op");
            let kernel =
                a.kernel_shape.ok_or_else(|| EvalError::Invalid(format!("{} without kernel_shape", op.op_type())))?;
            let (kind, indices) = match op {
                Op::MaxPool(_) => (PoolKind::Max, n_out > 1),
                Op::AveragePool(p) => (PoolKind::Avg { include_pad: p.count_include_pad() != 0 }, false),
                Op::LpPool(p) => (PoolKind::Lp(p.p()), false),
                _ => unreachable!("matched above"),
            };
            pool(x, kind, kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode, indices)
        }
        Op::GlobalAveragePool(_) => one(global_pool(req(inputs, 0, name)?, PoolKind::Avg { include_pad: false })?),
        Op::GlobalMaxPool(_) => one(global_pool(req(inputs, 0, name)?, PoolKind::Max)?),
        Op::GlobalLpPool(p) => one(global_pool(req(inputs, 0, name)?, PoolKind::Lp(p.p()))?),
        Op::BatchNormalization(b) => batch_norm(b, inputs, n_out),
        Op::LayerNormalization(l) => layer_norm(l, inputs, n_out),
        Op::InstanceNormalization(i) => {
            let x = req(inputs, 0, name)?;
            let c = x.shape[1];
            let s = channel_params(req(inputs, 1, name)?, c, "scale")?;
            let b = channel_params(req(inputs, 2, name)?, c, "bias")?;
            one(group_like_norm(x, c, &s, &b, f64::from(i.epsilon()), false)?)
        }
        Op::GroupNormalization(gn) => {
            let x = req(inputs, 0, name)?;
            let groups = gn.num_groups.unwrap_or(1) as usize;
            let s = req(inputs, 1, name)?.to_f64()?;
            let b = req(inputs, 2, name)?.to_f64()?;
            let per_group = s.len() == groups && groups != x.shape[1];
            one(group_like_norm(x, groups, &s, &b, f64::from(gn.epsilon()), per_group)?)
        }
        Op::LRN(l) => one(lrn(l, req(inputs, 0, name)?)?),
        Op::LpNormalization(l) => {
            let x = req(inputs, 0, name)?;
            let a = axis(l.axis(), x.rank())?;
            let v = x.to_f64()?;
            let outer: usize = x.shape[..a].iter().product();
            let n = x.shape[a];
            let inner: usize = x.shape[a + 1..].iter().product();
            let mut out = v.clone();
            for o in 0..outer {
                for i in 0..inner {
                    let norm: f64 = if l.p() == 1 {
                        (0..n).map(|j| v[(o * n + j) * inner + i].abs()).sum()
                    } else {
                        (0..n).map(|j| v[(o * n + j) * inner + i].powi(2)).sum::<f64>().sqrt()
                    };
                    for j in 0..n {
                        out[(o * n + j) * inner + i] =
                            if norm == 0.0 { 0.0 } else { v[(o * n + j) * inner + i] / norm };
                    }
                }
            }
            one(Array::float(x.dtype, x.shape.clone(), out))
        }
        Op::MeanVarianceNormalization(m) => {
            let x = req(inputs, 0, name)?;
            let axes: Vec<usize> = m
                .axes
                .clone()
                .unwrap_or_else(|| vec![0, 2, 3])
                .iter()
                .map(|&a| axis(a, x.rank()))
                .collect::<Result<_>>()?;
            let v = x.to_f64()?;
            let st = strides(&x.shape);
            let key = |f: usize| -> usize {
                (0..x.rank()).filter(|d| !axes.contains(d)).map(|d| ((f / st[d]) % x.shape[d]) * st[d]).sum()
            };
            let mut sum = std::collections::HashMap::new();
            let mut sq = std::collections::HashMap::new();
            let count: usize = axes.iter().map(|&a| x.shape[a]).product();
            for (f, &a) in v.iter().enumerate() {
                *sum.entry(key(f)).or_insert(0.0) += a;
                *sq.entry(key(f)).or_insert(0.0) += a * a;
            }
            let out: Vec<f64> = v
                .iter()
                .enumerate()
                .map(|(f, &a)| {
                    let k = key(f);
                    let m = sum[&k] / count as f64;
                    let var = sq[&k] / count as f64 - m * m;
                    (a - m) / (var.max(0.0).sqrt() + 1e-9)
                })
                .collect();
            one(Array::float(x.dtype, x.shape.clone(), out))
        }
        Op::Resize(r) => one(resize(r, inputs)?),
        Op::Upsample(u) => one(upsample(u, inputs)?),
        Op::LSTM(l) => recurrent(
            &Rnn {
                kind: "LSTM",
                gates: 4,
                hidden: l.hidden_size.unwrap_or(0) as usize,
                direction: l.direction().to_string(),
                layout: l.layout(),
                clip: l.clip.map(f64::from),
                activations: l.activations.clone().unwrap_or_default(),
                alphas: l.activation_alpha.clone().unwrap_or_default(),
                betas: l.activation_beta.clone().unwrap_or_default(),
                linear_before_reset: false,
                input_forget: l.input_forget() != 0,
            },
            inputs,
            n_out,
        ),
        Op::GRU(l) => recurrent(
            &Rnn {
                kind: "GRU",
                gates: 3,
                hidden: l.hidden_size.unwrap_or(0) as usize,
                direction: l.direction().to_string(),
                layout: l.layout(),
                clip: l.clip.map(f64::from),
                activations: l.activations.clone().unwrap_or_default(),
                alphas: l.activation_alpha.clone().unwrap_or_default(),
                betas: l.activation_beta.clone().unwrap_or_default(),
                linear_before_reset: l.linear_before_reset() != 0,
                input_forget: false,
            },
            inputs,
            n_out,
        ),
        Op::RNN(l) => recurrent(
            &Rnn {
                kind: "RNN",
                gates: 1,
                hidden: l.hidden_size.unwrap_or(0) as usize,
                direction: l.direction().to_string(),
                layout: l.layout(),
                clip: l.clip.map(f64::from),
                activations: l.activations.clone().unwrap_or_default(),
                alphas: l.activation_alpha.clone().unwrap_or_default(),
                betas: l.activation_beta.clone().unwrap_or_default(),
                linear_before_reset: false,
                input_forget: false,
            },
            inputs,
            n_out,
        ),
        _ => {
            let _ = cast;
            Err(EvalError::Unsupported(format!(
                "evaluating {}{}",
                if op.domain().is_empty() { String::new() } else { format!("{}.", op.domain()) },
                name
            )))
        }
    }
}
