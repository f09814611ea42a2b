//! Resampling and block moves: `Resize` (nearest, linear, cubic; every coordinate
//! transformation mode), the deprecated `Upsample`, `DepthToSpace` and `SpaceToDepth`.
//!
//! Dims a resize leaves alone split; resized dims stay whole.

use super::shape::{no_work_whole, passthrough_space};
use super::{Arity, Arrays, EvalCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::eval::{Array, Data, EvalError, transpose};
use crate::op;
use crate::shard::IterSpace;
use crate::types::DType;
use crate::types::Dim;

type Result<T> = std::result::Result<T, EvalError>;

impl OpRules for op::Resize {
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

impl OpRules for op::Upsample {
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

impl OpRules for op::DepthToSpace {
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
        Ok(vec![space_to_depth(cx.req(0)?, self.blocksize.unwrap_or(1) as usize)?])
    }
}

struct ResizeParams {
    mode: String,
    coord: String,
    nearest: String,
    cubic_a: f64,
    exclude_outside: bool,
}

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

fn resize(r: &op::Resize, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    // Opset 10 has (X, scales); later opsets (X, roi, scales, sizes).
    let (scales, sizes) = if cx.inputs.len() == 2 {
        (cx.opt(1).map(|a| a.to_f64()).transpose()?, None)
    } else {
        (cx.opt(2).map(|a| a.to_f64()).transpose()?, cx.opt(3).map(|a| a.to_i64()).transpose()?)
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

fn upsample(u: &op::Upsample, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let scales: Vec<f64> = match (cx.opt(1), &u.scales) {
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
    let inputs = [Some(x), None, Some(&s)];
    resize(&r, &EvalCx { inputs: &inputs, n_out: 1, opset: cx.opset, name: "Upsample" })
}

fn depth_to_space(x: &Array, b: usize, mode: &str) -> Result<Array> {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let cc = c / (b * b);
    let tmp = if mode == "CRD" {
        transpose(&x.clone().reshaped(vec![n, cc, b, b, h, w]), &[0, 1, 4, 2, 5, 3])
    } else {
        transpose(&x.clone().reshaped(vec![n, b, b, cc, h, w]), &[0, 3, 4, 1, 5, 2])
    };
    Ok(tmp.reshaped(vec![n, cc, h * b, w * b]))
}

fn space_to_depth(x: &Array, b: usize) -> Result<Array> {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let tmp = transpose(&x.clone().reshaped(vec![n, c, h / b, b, w / b, b]), &[0, 3, 5, 1, 2, 4]);
    Ok(tmp.reshaped(vec![n, c * b * b, h / b, w / b]))
}
