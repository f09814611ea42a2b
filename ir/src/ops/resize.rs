//! Resampling and block moves: `Resize` (nearest, linear, cubic; every coordinate
//! transformation mode), the deprecated `Upsample`, `DepthToSpace` and `SpaceToDepth`.
//!
//! Dims a resize leaves alone split; resized dims stay whole.

use super::flow::flow_positional;
use super::grad::GradCx;
use super::shape::{no_work_whole, passthrough_space};
use super::util::norm_axis;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::array::{Array, Data, EvalError};
use crate::graph::op;
use crate::layout::IterSpace;
use crate::ops::shape::transpose;
use crate::types::DType;
use crate::types::Dim;

type Result<T> = std::result::Result<T, EvalError>;

impl OpRules for op::Resize {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        let floats = |cx: &GradCx<'_>, i: usize| cx.x_opt(i).and_then(|v| cx.const_array(v)?.to_f64().ok());
        let n = cx.g.node(cx.n).inputs().len();
        let (roi, scales, sizes) = if n == 2 {
            (None, floats(cx, 1), None)
        } else {
            (floats(cx, 1), floats(cx, 2), cx.const_ints(cx.x_opt(3)))
        };
        if scales.as_ref().is_none_or(|s| s.is_empty()) && sizes.as_ref().is_none_or(|s| s.is_empty()) {
            return Some(Err("the gradient of a Resize needs constant scales or sizes".into()));
        }
        Some(resize_grad(cx, self, roi, scales, sizes))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let (scales, sizes) = if cx.ins.len() == 2 {
            (cx.konst(1).and_then(|a| a.to_f64().ok()), None)
        } else {
            (cx.konst(2).and_then(|a| a.to_f64().ok()), cx.ints(3))
        };
        let static_in: Option<Vec<usize>> = d.iter().map(|v| v.value().map(|v| v as usize)).collect();
        match static_in {
            Some(si)
                if scales.as_ref().is_some_and(|s| !s.is_empty()) || sizes.as_ref().is_some_and(|s| !s.is_empty()) =>
            {
                let (o, _) = resize_sizes(self, &si, scales.as_deref(), sizes.as_deref())?;
                cx.one(Some(o.iter().map(|&v| Dim::Fixed(v as i64)).collect()))
            }
            _ => cx.one(Some(vec![Dim::Unknown; d.len()])),
        }
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(passthrough_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![resize(self, cx)?])
    }
}

/// The gradient of a resize: it is linear and separable, `Y = A_{r−1} ⋯ A_0 · X` with `A_k`
/// (`[M_k, L_k]`) interpolating axis `k` alone, so `dX` is `dY` with each resized axis
/// contracted with its `A_k` ([`GradCx::contract_axes`]). Each `A_k` is the
/// evaluator's own interpolation of that axis applied to the identity (`[L, L]` resized along
/// its last axis gives `A_kᵀ`), a constant of the training graph; `tf_crop_and_resize`'s
/// extrapolated positions are constants of no gradient.
fn resize_grad(
    cx: &mut GradCx<'_>,
    r: &op::Resize,
    roi: Option<Vec<f64>>,
    scales: Option<Vec<f64>>,
    sizes: Option<Vec<i64>>,
) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    if !cx.want(0) {
        return Ok(());
    }
    let x = cx.x(0)?;
    let dims = cx.dims(x)?;
    let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
    let mut plan = resize_plan(r, &shape, roi, scales, sizes).map_err(|e| e.to_string())?;
    plan.params.extrapolation = 0.0;
    let crop = plan.params.coord == "tf_crop_and_resize";
    let mut mats = Vec::new();
    for ax in 0..dims.len() {
        if !plan.resizes(&shape, ax) {
            continue;
        }
        let (l, m) = (shape[ax], plan.out_shape[ax]);
        let eye: Vec<f64> = (0..l * l).map(|i| if i / l == i % l { 1.0 } else { 0.0 }).collect();
        let at = resize_axis(&eye, &[l, l], 1, m, plan.scales[ax], crop.then_some(plan.roi[ax]), &plan.params)
            .map_err(|e| e.to_string())?;
        mats.push((ax, m, l, (0..m * l).map(|i| at[(i % l) * m + i / l]).collect()));
    }
    let g = cx.contract_axes(dy, cx.dtype(x), mats)?;
    cx.set(0, g);
    Ok(())
}

impl OpRules for op::Upsample {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        let scales = match cx.x_opt(1) {
            Some(v) => cx.const_array(v).and_then(|a| a.to_f64().ok()),
            None => self.scales.as_ref().map(|s| s.iter().map(|&v| f64::from(v)).collect()),
        };
        let Some(scales) = scales else {
            return Some(Err("the gradient of an Upsample needs constant scales".into()));
        };
        Some(resize_grad(cx, &upsample_as_resize(self), None, Some(scales), None))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let scales: Option<Vec<f64>> = match cx.konst(1) {
            Some(a) => a.to_f64().ok(),
            None => self.scales.as_ref().map(|s| s.iter().map(|&v| f64::from(v)).collect()),
        };
        let Some(scales) = scales else { return cx.one(Some(vec![Dim::Unknown; d.len()])) };
        let scaled =
            |(v, &s): (&Dim, &f64)| v.value().map_or(Dim::Unknown, |v| Dim::Fixed((v as f64 * s).floor() as i64));
        cx.one(Some(d.iter().zip(&scales).map(scaled).collect()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(passthrough_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![upsample(self, cx)?])
    }
}

/// Dims after moving `b × b` blocks between depth and space (`to_space`: depth → space).
fn block_dims(d: &[Dim], b: i64, to_space: bool) -> Vec<Dim> {
    let f =
        |v: &Dim, k: i64, mul: bool| v.value().map_or(Dim::Unknown, |v| Dim::Fixed(if mul { v * k } else { v / k }));
    vec![d[0].clone(), f(&d[1], b * b, !to_space), f(&d[2], b, to_space), f(&d[3], b, to_space)]
}

/// The gradient of a block move: `dY` viewed as the six dims the forward transpose made
/// (`six`), transposed back (`perm`) and reshaped to the input's dims — both ops are
/// permutations, so their gradients are the inverse permutations.
fn block_grad(cx: &mut GradCx<'_>, six: [i64; 6], perm: [i64; 6]) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    if !cx.want(0) {
        return Ok(());
    }
    let dims = cx.dims(cx.x(0)?)?;
    let v = cx.reshape(dy, &six)?;
    let t = cx.transpose(v, &perm)?;
    let dx = cx.reshape(t, &dims)?;
    cx.set(0, dx);
    Ok(())
}

/// `(n, c, h, w, b)` of a block move's input (`to_space`: `c` counts the output's channels).
fn block_extents(cx: &GradCx<'_>, b: Option<i64>, to_space: bool) -> std::result::Result<[i64; 5], String> {
    let d = cx.dims(cx.x(0)?)?;
    let b = b.filter(|&b| b > 0).ok_or("a block move needs a positive blocksize")?;
    if d.len() != 4 {
        return Err("a block move needs rank 4".into());
    }
    Ok(if to_space { [d[0], d[1] / (b * b), d[2], d[3], b] } else { [d[0], d[1], d[2] / b, d[3] / b, b] })
}

impl OpRules for op::DepthToSpace {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(block_extents(cx, self.blocksize, true).and_then(|[n, c, h, w, b]| {
            // dY is `[n, c, h, b, w, b]` after the forward transpose.
            let perm = if self.mode() == "CRD" { [0, 1, 3, 5, 2, 4] } else { [0, 3, 5, 1, 2, 4] };
            block_grad(cx, [n, c, h, b, w, b], perm)
        }))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let b = self.blocksize.ok_or("DepthToSpace needs blocksize")?;
        if d.len() != 4 {
            return Err("DepthToSpace needs rank 4".into());
        }
        cx.one(Some(block_dims(d, b, true)))
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![depth_to_space(cx.req(0)?, self.blocksize.unwrap_or(1) as usize, self.mode())?])
    }
}

impl OpRules for op::SpaceToDepth {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(block_extents(cx, self.blocksize, false).and_then(|[n, c, h, w, b]| {
            // dY is `[n, c, b, b, h, w]` (CRD) or `[n, b, b, c, h, w]` (DCR) after the forward transpose.
            if self.mode() == "CRD" {
                block_grad(cx, [n, c, b, b, h, w], [0, 1, 4, 2, 5, 3])
            } else {
                block_grad(cx, [n, b, b, c, h, w], [0, 3, 4, 1, 5, 2])
            }
        }))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let b = self.blocksize.ok_or("SpaceToDepth needs blocksize")?;
        if d.len() != 4 {
            return Err("SpaceToDepth needs rank 4".into());
        }
        cx.one(Some(block_dims(d, b, false)))
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![space_to_depth(cx.req(0)?, self.blocksize.unwrap_or(1) as usize, self.mode())?])
    }
}

struct ResizeParams {
    mode: String,
    coord: String,
    nearest: String,
    cubic_a: f64,
    exclude_outside: bool,
    antialias: bool,
    extrapolation: f64,
}

/// The interpolation coefficients of one output position, `ratio` in (0, 1] past the source
/// pixel on its left, as ONNX defines them (antialiasing widens the kernel by 1/scale when
/// downsampling).
fn coeffs(r: &ResizeParams, ratio: f64, scale: f64) -> Vec<f64> {
    let a = r.cubic_a;
    match r.mode.as_str() {
        "nearest" => {
            if ratio.fract() == 0.0 {
                return vec![0.0, 1.0];
            }
            let right = match r.nearest.as_str() {
                "round_prefer_ceil" => ratio >= 0.5,
                "floor" => false,
                "ceil" => true,
                _ => ratio > 0.5,
            };
            if right { vec![0.0, 1.0] } else { vec![1.0, 0.0] }
        }
        "linear" if r.antialias => {
            let scale = scale.min(1.0);
            let start = (-1.0 / scale).floor() as i64 + 1;
            let footprint = 2 - 2 * start;
            let c: Vec<f64> = (start..start + footprint)
                .map(|i| (1.0 - ((i as f64 - ratio) * scale).abs()).clamp(0.0, 1.0))
                .collect();
            let sum: f64 = c.iter().sum();
            c.into_iter().map(|x| x / sum).collect()
        }
        "linear" => vec![1.0 - ratio, ratio],
        "cubic" if r.antialias => {
            let scale = scale.min(1.0);
            let k = |x: f64| {
                let x = x.abs();
                if x <= 1.0 {
                    (a + 2.0) * x.powi(3) - (a + 3.0) * x * x + 1.0
                } else if x < 2.0 {
                    a * x.powi(3) - 5.0 * a * x * x + 8.0 * a * x - 4.0 * a
                } else {
                    0.0
                }
            };
            let start = (-2.0 / scale).floor() as i64 + 1;
            let end = 2 - start;
            let c: Vec<f64> = (start..end).map(|i| k(scale * (i as f64 - ratio))).collect();
            let sum: f64 = c.iter().sum();
            c.into_iter().map(|x| x / sum).collect()
        }
        _ => {
            let t = ratio;
            vec![
                ((a * (t + 1.0) - 5.0 * a) * (t + 1.0) + 8.0 * a) * (t + 1.0) - 4.0 * a,
                ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0,
                ((a + 2.0) * (1.0 - t) - (a + 3.0)) * (1.0 - t) * (1.0 - t) + 1.0,
                ((a * ((1.0 - t) + 1.0) - 5.0 * a) * ((1.0 - t) + 1.0) + 8.0 * a) * ((1.0 - t) + 1.0) - 4.0 * a,
            ]
        }
    }
}

/// Resizes axis `ax` of `v` (shape `shape`) to `out_len`, as ONNX's reference does: the
/// source coordinate of each output position by the coordinate mode (with the unrounded output
/// width `scale × n`), the `n` coefficients of the mode around it, edge-clamped neighbours,
/// `exclude_outside` renormalization, and `tf_crop_and_resize`'s extrapolation outside `roi`.
fn resize_axis(
    v: &[f64],
    shape: &[usize],
    ax: usize,
    out_len: usize,
    scale: f64,
    roi: Option<(f64, f64)>,
    r: &ResizeParams,
) -> Result<Vec<f64>> {
    let outer: usize = shape[..ax].iter().product();
    let n = shape[ax];
    let inner: usize = shape[ax + 1..].iter().product();
    let mut out = vec![0.0; outer * out_len * inner];
    let width = scale * n as f64;
    for j in 0..out_len {
        let y = j as f64;
        let mut outside = false;
        let x = match r.coord.as_str() {
            "half_pixel" => (y + 0.5) / scale - 0.5,
            "half_pixel_symmetric" => {
                let adj = out_len as f64 / width;
                let center = n as f64 / 2.0;
                center * (1.0 - adj) + (y + 0.5) / scale - 0.5
            }
            "pytorch_half_pixel" => {
                if width == 1.0 {
                    -0.5
                } else {
                    (y + 0.5) / scale - 0.5
                }
            }
            "align_corners" => {
                if width == 1.0 {
                    0.0
                } else {
                    y * (n as f64 - 1.0) / (width - 1.0)
                }
            }
            "asymmetric" => y / scale,
            "tf_crop_and_resize" => {
                let (r0, r1) = roi.ok_or_else(|| EvalError::Invalid("tf_crop_and_resize needs roi".into()))?;
                let x = if width == 1.0 {
                    (r1 - r0) * (n as f64 - 1.0) / 2.0
                } else {
                    y * (r1 - r0) * (n as f64 - 1.0) / (width - 1.0)
                } + r0 * (n as f64 - 1.0);
                outside = x < 0.0 || x > n as f64 - 1.0;
                x
            }
            other => return Err(EvalError::Unsupported(format!("Resize coordinate_transformation_mode `{other}`"))),
        };
        if outside {
            for o in 0..outer {
                for i in 0..inner {
                    out[(o * out_len + j) * inner + i] = r.extrapolation;
                }
            }
            continue;
        }
        let xi = x.floor();
        let ratio = if x == xi { 1.0 } else { x - xi };
        let mut c = coeffs(r, ratio, scale);
        let k = c.len() as i64;
        // The k neighbours nearest x (ties to the smaller index), in edge-padded coordinates.
        let pad = (k + 1) / 2;
        let xp = x + pad as f64;
        let p = xp.floor() as i64;
        let frac = xp - p as f64;
        let offset = if k % 2 == 0 {
            if frac == 0.0 { -(k / 2) } else { -(k / 2) + 1 }
        } else {
            let base = -((k - 1) / 2);
            if frac <= 0.5 { base } else { base + 1 }
        };
        let first = p + offset - pad;
        let idx: Vec<i64> = (0..k).map(|t| first + t).collect();
        if r.exclude_outside {
            for (t, &i) in idx.iter().enumerate() {
                if i < 0 || i >= n as i64 {
                    c[t] = 0.0;
                }
            }
            let sum: f64 = c.iter().sum();
            let sum = if sum == 0.0 { 1.0 } else { sum };
            c.iter_mut().for_each(|w| *w /= sum);
        }
        let taps: Vec<(usize, f64)> =
            idx.iter().zip(&c).map(|(&i, &w)| (i.clamp(0, n as i64 - 1) as usize, w)).collect();
        for o in 0..outer {
            for i in 0..inner {
                out[(o * out_len + j) * inner + i] = taps.iter().map(|&(s, w)| w * v[(o * n + s) * inner + i]).sum();
            }
        }
    }
    Ok(out)
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
        if sz.iter().any(|&x| x < 0) {
            return Err(format!("Resize sizes {sz:?} must not be negative"));
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
        if s.iter().any(|&x| !(x > 0.0 && x.is_finite())) {
            return Err(format!("Resize scales {s:?} must be positive"));
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

/// What a Resize of an input of `shape` does per axis: the output shape, the scales, the
/// region of interest per axis, and the interpolation parameters.
struct ResizePlan {
    out_shape: Vec<usize>,
    scales: Vec<f64>,
    roi: Vec<(f64, f64)>,
    params: ResizeParams,
}

impl ResizePlan {
    /// Whether axis `ax` is resized (an identity axis is left alone).
    fn resizes(&self, shape: &[usize], ax: usize) -> bool {
        let crop = self.params.coord == "tf_crop_and_resize";
        !(self.out_shape[ax] == shape[ax] && self.scales[ax] == 1.0 && (!crop || self.roi[ax] == (0.0, 1.0)))
    }
}

/// The [`ResizePlan`] of `r` on an input of `shape` with these `roi`, `scales` and `sizes`.
fn resize_plan(
    r: &op::Resize,
    shape: &[usize],
    roi_in: Option<Vec<f64>>,
    scales: Option<Vec<f64>>,
    sizes: Option<Vec<i64>>,
) -> Result<ResizePlan> {
    let (out_shape, sc) = resize_sizes(r, shape, scales.as_deref(), sizes.as_deref()).map_err(EvalError::Invalid)?;
    let params = ResizeParams {
        mode: r.mode().to_string(),
        coord: r.coordinate_transformation_mode().to_string(),
        nearest: r.nearest_mode().to_string(),
        cubic_a: f64::from(r.cubic_coeff_a()),
        exclude_outside: r.exclude_outside() != 0,
        antialias: r.antialias() != 0 && r.mode() != "nearest",
        extrapolation: f64::from(r.extrapolation_value()),
    };
    // roi: per resized axis its start, then its end (axes as the `axes` attribute lists).
    let rank = shape.len();
    let mut roi: Vec<(f64, f64)> = vec![(0.0, 1.0); rank];
    if let Some(rv) = roi_in.filter(|v| !v.is_empty()) {
        let axes: Vec<usize> = match &r.axes {
            Some(a) => a.iter().map(|&v| norm_axis(v, rank)).collect::<std::result::Result<_, _>>()?,
            None => (0..rank).collect(),
        };
        if rv.len() != 2 * axes.len() {
            return Err(EvalError::Invalid(format!("Resize roi has {} values for {} axes", rv.len(), axes.len())));
        }
        for (k, &a) in axes.iter().enumerate() {
            roi[a] = (rv[k], rv[axes.len() + k]);
        }
    }
    Ok(ResizePlan { out_shape, scales: sc, roi, params })
}

fn resize(r: &op::Resize, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    // Opset 10 has (X, scales); later opsets (X, roi, scales, sizes).
    let (roi_in, scales, sizes) = if cx.inputs.len() == 2 {
        (None, cx.opt(1).map(|a| a.to_f64()).transpose()?, None)
    } else {
        (
            cx.opt(1).map(|a| a.to_f64()).transpose()?,
            cx.opt(2).map(|a| a.to_f64()).transpose()?,
            cx.opt(3).map(|a| a.to_i64()).transpose()?,
        )
    };
    let plan = resize_plan(r, &x.shape, roi_in, scales, sizes)?;
    let ResizePlan { out_shape, scales: sc, roi, params } = &plan;
    let crop = params.coord == "tf_crop_and_resize";
    let mut v = x.to_f64()?;
    let mut shape = x.shape.clone();
    for ax in 0..shape.len() {
        if plan.resizes(&x.shape, ax) {
            v = resize_axis(&v, &shape, ax, out_shape[ax], sc[ax], crop.then_some(roi[ax]), params)?;
            shape[ax] = out_shape[ax];
        }
    }
    if !x.dtype.is_float() {
        // Integer images round and saturate, as the reference casts.
        let (lo, hi) = match x.dtype {
            DType::Uint8 => (0.0, 255.0),
            DType::Int8 => (-128.0, 127.0),
            _ => (f64::MIN, f64::MAX),
        };
        return Ok(Array::int(
            x.dtype,
            shape,
            v.into_iter().map(|f| f.round_ties_even().clamp(lo, hi) as i64).collect(),
        ));
    }
    Ok(Array::float(x.dtype, shape, v))
}

/// The Resize an Upsample is: asymmetric coordinates, nearest rounding down.
fn upsample_as_resize(u: &op::Upsample) -> op::Resize {
    op::Resize {
        mode: Some(if u.mode() == "nearest" { "nearest".into() } else { "linear".into() }),
        coordinate_transformation_mode: Some("asymmetric".into()),
        nearest_mode: Some("floor".into()),
        ..Default::default()
    }
}

fn upsample(u: &op::Upsample, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let scales: Vec<f64> = match (cx.opt(1), &u.scales) {
        (Some(s), _) => s.to_f64()?,
        (None, Some(s)) => s.iter().map(|&v| f64::from(v)).collect(),
        _ => return Err(EvalError::Invalid("Upsample without scales".into())),
    };
    let r = upsample_as_resize(u);
    let s = Array { dtype: DType::Double, shape: vec![scales.len()], data: Data::F64(scales) };
    let inputs = [Some(x), None, Some(&s)];
    resize(&r, &EvalCx { inputs: &inputs, n_out: 1, opset: cx.opset, name: "Upsample" })
}

fn depth_to_space(x: &Array, b: usize, mode: &str) -> Result<Array> {
    if x.rank() != 4 || b == 0 {
        return Err(EvalError::Invalid("DepthToSpace needs rank 4 and a blocksize".into()));
    }
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let cc = c / (b * b);
    let tmp = if mode == "CRD" {
        transpose(&x.clone().reshaped(vec![n, cc, b, b, h, w]), &[0, 1, 4, 2, 5, 3])
    } else {
        transpose(&x.clone().reshaped(vec![n, b, b, cc, h, w]), &[0, 3, 4, 1, 5, 2])
    };
    Ok(tmp.reshaped(vec![n, cc, h * b, w * b]))
}

fn space_to_depth(x: &Array, b: usize, mode: &str) -> Result<Array> {
    if x.rank() != 4 || b == 0 {
        return Err(EvalError::Invalid("SpaceToDepth needs rank 4 and a blocksize".into()));
    }
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    // DCR puts the block offsets before the channel, CRD after it (the inverses of
    // DepthToSpace's modes).
    let perm: &[usize] = if mode == "CRD" { &[0, 1, 3, 5, 2, 4] } else { &[0, 3, 5, 1, 2, 4] };
    let tmp = transpose(&x.clone().reshaped(vec![n, c, h / b, b, w / b, b]), perm);
    Ok(tmp.reshaped(vec![n, c * b * b, h / b, w / b]))
}
