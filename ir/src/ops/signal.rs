//! Signal processing: `DFT`, `STFT`, the `HannWindow`, `HammingWindow` and `BlackmanWindow`
//! generators, and `MelWeightMatrix`.
//!
//! Complex values are a trailing dim of 2 (real, imaginary); a trailing dim of 1 is a real
//! signal. They run whole on one device, evaluated by the reference kernels (a direct DFT).

use super::flow::flow_positional;
use super::grad::GradCx;
use super::shape::no_work_whole;
use super::util::{inverse_perm, norm_axis};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::array::{Array, EvalError, strides};
use crate::graph::op::{self, Op};
use crate::layout::IterSpace;
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// The DFT's axis: the `axis` input (opset 20) or attribute, normalized for `rank`.
fn dft_axis(d: &op::DFT, axis_input: Option<i64>, rank: usize, opset: i64) -> std::result::Result<usize, String> {
    let a = axis_input.or(d.axis).unwrap_or(if opset >= 20 { -2 } else { 1 });
    norm_axis(a, rank)
}

impl OpRules for op::DFT {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        if cx.has(2) && !cx.needs_values(&[2]) {
            return cx.one(Some(vec![Dim::Unknown; d.len()]));
        }
        let axis_in = cx.ints(2).and_then(|v| v.first().copied());
        let a = dft_axis(self, axis_in, d.len(), cx.opset)?;
        let (inverse, onesided) = (self.inverse() != 0, self.onesided() != 0);
        let n = if cx.has(1) {
            if !cx.needs_values(&[1]) {
                return cx.one(Some(vec![Dim::Unknown; d.len()]));
            }
            cx.ints(1).and_then(|v| v.first().copied()).map(Dim::Fixed).unwrap_or(Dim::Unknown)
        } else if inverse && onesided {
            d[a].value().map_or(Dim::Unknown, |v| Dim::Fixed(2 * (v - 1)))
        } else {
            d[a].clone()
        };
        let mut out = d.clone();
        out[a] = match (&n, inverse, onesided) {
            (Dim::Fixed(v), false, true) => Dim::Fixed(v / 2 + 1),
            _ => n,
        };
        let last = out.len() - 1;
        out[last] = Dim::Fixed(if inverse && onesided { 1 } else { 2 });
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let d = cx.in_dims(0);
        let n = d.iter().copied().max().unwrap_or(1) as f64;
        Work::flops(8.0 * cx.out_numel(0) * n)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let axis_in = cx.opt(2).map(|a| a.to_i64()).transpose()?.and_then(|v| v.first().copied());
        let a = dft_axis(self, axis_in, x.rank(), cx.opset)?;
        let n = cx.opt(1).map(|n| n.to_i64()).transpose()?.and_then(|v| v.first().copied());
        Ok(vec![dft(x, a, n, self.inverse() != 0, self.onesided() != 0)?])
    }

    /// Every variant (inverse, one-sided, cut or padded to a length) is a real-linear map of
    /// each line along the axis with its (real, imaginary) pairs: `y = A·x` with `A` of
    /// `[out · c_out, len · c_in]`, computed by [`dft`] itself on the unit lines, so
    /// `dX = Aᵀ·dY`: dY with the axis moved beside the complex dim, both merged, contracted
    /// with `A`, and moved back. `O(len²)` constants, as the direct DFT is in time.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let (xd, yd) = (cx.dims(x)?, cx.dims(dy)?);
            let r = xd.len();
            // An optional input's one value, which must be a constant.
            let given = |i: usize, what: &str| -> std::result::Result<Option<i64>, String> {
                let Some(v) = cx.x_opt(i) else { return Ok(None) };
                let value = cx.const_ints(Some(v)).and_then(|c| c.first().copied());
                value.map(Some).ok_or_else(|| format!("DFT's gradient needs a constant {what}"))
            };
            let a = dft_axis(self, given(2, "axis")?, r, cx.opset())?;
            let n = given(1, "length")?;
            if r < 2 || a == r - 1 {
                return Err(format!("DFT's gradient: input {xd:?}, axis {a}"));
            }
            let (len, c_in, out, c_out) = (xd[a] as usize, xd[r - 1] as usize, yd[a] as usize, yd[r - 1] as usize);
            let (rows, cols) = (out * c_out, len * c_in);
            let map = dft_map(len, c_in, rows, n, self.inverse() != 0, self.onesided() != 0)?;
            // dY as `[.., out · c_out]`: the other dims, then the axis and the complex dim.
            let mut perm: Vec<i64> = (0..r as i64).filter(|&d| d != a as i64 && d != r as i64 - 1).collect();
            perm.extend([a as i64, r as i64 - 1]);
            let moved = cx.transpose(dy, &perm)?;
            let mut merged: Vec<i64> = perm[..r - 2].iter().map(|&d| yd[d as usize]).collect();
            merged.push(rows as i64);
            let flat = cx.reshape(moved, &merged)?;
            let dtype = cx.dtype(dy);
            let back = cx.contract_axes(flat, dtype, vec![(r - 2, rows, cols, map)])?;
            let mut split: Vec<i64> = merged[..r - 2].to_vec();
            split.extend([len as i64, c_in as i64]);
            let back = cx.reshape(back, &split)?;
            let d = cx.transpose(back, &inverse_perm(&perm)?)?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

/// A DFT variant of lines of `len` positions of `c_in` values as a real-linear map
/// `A[row, col]`, `[rows, len · c_in]` row-major: [`dft`] itself applied to the unit lines
/// (one per input position), `A[row, col]` being unit line `col`'s output at `row`.
fn dft_map(
    len: usize,
    c_in: usize,
    rows: usize,
    n: Option<i64>,
    inverse: bool,
    onesided: bool,
) -> std::result::Result<Vec<f64>, String> {
    let cols = len * c_in;
    let mut unit = vec![0.0; cols * cols];
    for j in 0..cols {
        unit[j * cols + j] = 1.0;
    }
    let basis = Array::float(DType::Double, vec![cols, len, c_in], unit);
    let images = dft(&basis, 1, n, inverse, onesided).map_err(|e| e.to_string())?;
    let images = images.to_f64().map_err(|e| e.to_string())?;
    if images.len() != cols * rows {
        return Err(format!("a transform of {} values for a [{rows}, {cols}] map", images.len()));
    }
    Ok((0..rows * cols).map(|i| images[(i % cols) * rows + i / cols]).collect())
}

/// The (inverse) DFT of `x` along `axis` (x's last dim: 1 real, 2 complex), of length `n`
/// (the input cut or zero-padded to it), one-sided forward (the first n/2+1 bins) or from a
/// one-sided spectrum back to a real signal (inverse).
fn dft(x: &Array, axis: usize, n: Option<i64>, inverse: bool, onesided: bool) -> Result<Array> {
    let r = x.rank();
    if r < 2 || axis == r - 1 || !(x.shape[r - 1] == 1 || x.shape[r - 1] == 2) {
        return Err(EvalError::Invalid(format!("DFT input {:?} needs a last dim of 1 or 2 and another axis", x.shape)));
    }
    let len = x.shape[axis];
    let n = match n {
        Some(v) if v > 0 => v as usize,
        Some(v) => return Err(EvalError::Invalid(format!("DFT length {v}"))),
        None if inverse && onesided => 2 * len.saturating_sub(1),
        None => len,
    };
    let v = x.to_f64()?;
    let complex = x.shape[r - 1] == 2;
    let st = strides(&x.shape);
    let out_len = if !inverse && onesided { n / 2 + 1 } else { n };
    let out_c = if inverse && onesided { 1 } else { 2 };
    let mut shape = x.shape.clone();
    shape[axis] = out_len;
    shape[r - 1] = out_c;
    let ost = strides(&shape);
    let mut out = vec![0.0; shape.iter().product()];
    // Every line along the axis: the other coordinates, the last one 0.
    let mut others: Vec<usize> = shape.clone();
    others[axis] = 1;
    others[r - 1] = 1;
    let lines: usize = others.iter().product();
    let ls = strides(&others);
    let sign = if inverse { 1.0 } else { -1.0 };
    for l in 0..lines {
        let coord: Vec<usize> = (0..r).map(|d| (l / ls[d]) % others[d]).collect();
        let base: usize = coord.iter().zip(&st).map(|(c, s)| c * s).sum();
        let obase: usize = coord.iter().zip(&ost).map(|(c, s)| c * s).sum();
        // The input line, complex, cut or padded to n (one-sided inverse: rebuilt by symmetry).
        let get = |k: usize| -> (f64, f64) {
            if k >= len {
                return (0.0, 0.0);
            }
            let o = base + k * st[axis];
            (v[o], if complex { v[o + 1] } else { 0.0 })
        };
        let line: Vec<(f64, f64)> = if inverse && onesided {
            (0..n)
                .map(|k| {
                    if k <= n / 2 {
                        let (re, im) = get(k);
                        // Bins 0 and n/2 of a real signal are real.
                        if k == 0 || (n % 2 == 0 && k == n / 2) { (re, 0.0) } else { (re, im) }
                    } else {
                        let (re, im) = get(n - k);
                        (re, -im)
                    }
                })
                .collect()
        } else {
            (0..n).map(get).collect()
        };
        for k in 0..out_len {
            let (mut re, mut im) = (0.0, 0.0);
            for (t, &(a, b)) in line.iter().enumerate() {
                let ang = sign * 2.0 * std::f64::consts::PI * ((k * t) % n) as f64 / n as f64;
                let (c, s) = (ang.cos(), ang.sin());
                re += a * c - b * s;
                im += a * s + b * c;
            }
            if inverse {
                re /= n as f64;
                im /= n as f64;
            }
            let o = obase + k * ost[axis];
            out[o] = re;
            if out_c == 2 {
                out[o + 1] = im;
            }
        }
    }
    Ok(Array::float(x.dtype, shape, out))
}

impl OpRules for op::STFT {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        if d.len() != 3 {
            return Err(format!("STFT needs a signal [batch, length, 1 or 2], got rank {}", d.len()));
        }
        let step = cx.ints(1).and_then(|v| v.first().copied());
        cx.needs_values(&[1]);
        let frame = if cx.has(3) {
            cx.needs_values(&[3]);
            cx.ints(3).and_then(|v| v.first().copied())
        } else {
            cx.dims(2).and_then(|w| w.first().and_then(Dim::value))
        };
        let (Some(step), Some(frame), Some(len)) = (step, frame, d[1].value()) else {
            return cx.one(Some(vec![d[0].clone(), Dim::Unknown, Dim::Unknown, Dim::Fixed(2)]));
        };
        if step <= 0 || frame <= 0 || frame > len {
            return Err(format!("STFT frame {frame} and step {step} do not fit a signal of {len}"));
        }
        let frames = 1 + (len - frame) / step;
        let bins = if self.onesided() != 0 { frame / 2 + 1 } else { frame };
        cx.one(Some(vec![d[0].clone(), Dim::Fixed(frames), Dim::Fixed(bins), Dim::Fixed(2)]))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let bins = cx.out_dims(0).get(2).copied().unwrap_or(1) as f64;
        Work::flops(8.0 * cx.out_numel(0) * bins)
    }

    /// Frames of `frame_length` every `frame_step`, weighted by the window, each
    /// transformed (one-sided unless `onesided = 0`).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        if x.rank() != 3 {
            return Err(EvalError::Invalid("STFT needs a signal [batch, length, 1 or 2]".into()));
        }
        let step = cx.req(1)?.to_i64()?.first().copied().unwrap_or(0);
        let window = cx.opt(2).map(|w| w.to_f64()).transpose()?;
        let frame = match cx.opt(3) {
            Some(f) => f.to_i64()?.first().copied().unwrap_or(0),
            None => window.as_ref().map_or(x.shape[1] as i64, |w| w.len() as i64),
        };
        let (b, len, c) = (x.shape[0], x.shape[1] as i64, x.shape[2]);
        if step <= 0 || frame <= 0 || frame > len {
            return Err(EvalError::Invalid(format!("STFT frame {frame} and step {step} for a signal of {len}")));
        }
        let (frames, frame) = ((1 + (len - frame) / step) as usize, frame as usize);
        let w = window.unwrap_or_else(|| vec![1.0; frame]);
        let v = x.to_f64()?;
        // [b, frames, frame, c] weighted frames, then a DFT along the frame axis.
        let mut fr = vec![0.0; b * frames * frame * c];
        for bi in 0..b {
            for f in 0..frames {
                for t in 0..frame {
                    for k in 0..c {
                        let src = (bi * len as usize + f * step as usize + t) * c + k;
                        fr[((bi * frames + f) * frame + t) * c + k] = v[src] * w.get(t).copied().unwrap_or(0.0);
                    }
                }
            }
        }
        let framed = Array::float(DType::Double, vec![b, frames, frame, c], fr);
        let y = dft(&framed, 2, Some(frame as i64), false, self.onesided() != 0)?;
        Ok(vec![Array::float(x.dtype, y.shape.clone(), y.to_f64()?)])
    }

    /// STFT frames the signal, weights each frame by the window and transforms it: per frame
    /// `y = A·(w ⊙ frame)` with `A` the frame's DFT as a real map (by [`dft`] on the unit
    /// lines, as DFT's gradient takes it). So `d(w ⊙ frame) = dY·A`; the signal's gradient
    /// is that times the window, added back where each frame came from (ScatterElements
    /// add: frames overlap), and the window's is its product with the frames (gathered by
    /// constant positions) summed over batch, frames and the complex dim.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            if !cx.want(0) && !cx.want(2) {
                return Ok(());
            }
            let x = cx.x(0)?;
            let (xd, yd) = (cx.dims(x)?, cx.dims(dy)?);
            let step = cx.const_ints(cx.x_opt(1)).and_then(|v| v.first().copied());
            let step = step.ok_or("STFT's gradient needs a constant frame step")?;
            let window = cx.x_opt(2);
            let frame = match (cx.x_opt(3), window) {
                (Some(f), _) => cx.const_ints(Some(f)).and_then(|v| v.first().copied()),
                (None, Some(w)) => cx.dims(w)?.first().copied(),
                (None, None) => xd.get(1).copied(),
            };
            let frame = frame.ok_or("STFT's gradient needs a constant frame length")?;
            if xd.len() != 3 || yd.len() != 4 || step <= 0 || frame <= 0 {
                return Err(format!("STFT's gradient: signal {xd:?}, output {yd:?}, frame {frame}, step {step}"));
            }
            if let Some(w) = window
                && cx.dims(w)? != [frame]
            {
                return Err(format!("STFT's gradient: a window of {:?} for frames of {frame}", cx.dims(w)?));
            }
            let (b, len, c) = (xd[0], xd[1], xd[2] as usize);
            let (frames, bins) = (yd[1], yd[2] as usize);
            let fl = frame as usize;
            // The frame's transform as a real map `[bins · 2, frame · c]`.
            let (rows, cols) = (bins * 2, fl * c);
            let map = dft_map(fl, c, rows, Some(frame), false, self.onesided() != 0)?;
            let flat = cx.reshape(dy, &[b, frames, rows as i64])?;
            let dtype = cx.dtype(dy);
            let dw_frames = cx.contract_axes(flat, dtype, vec![(2, rows, cols, map)])?;
            let dw_frames = cx.reshape(dw_frames, &[b, frames, frame, c as i64])?;
            // Where each frame's samples come from.
            let at: Vec<i64> = (0..frames).flat_map(|f| (0..frame).map(move |t| f * step + t)).collect();
            if at.last().is_some_and(|&l| l >= len) {
                return Err(format!("STFT's gradient: frames reach past a signal of {len}"));
            }
            if cx.want(0) {
                let d = match window {
                    Some(w) => {
                        let w = cx.reshape(w, &[frame, 1])?;
                        cx.mul(dw_frames, w)?
                    }
                    None => dw_frames,
                };
                let d = cx.reshape(d, &[b, frames * frame, c as i64])?;
                let idx = cx.constant(Array::i64(vec![1, at.len(), 1], at.clone()));
                let idx = cx.expand(idx, &[b, frames * frame, c as i64])?;
                let zeros = cx.zeros_like(x)?;
                let add = Op::ScatterElements(op::ScatterElements { axis: Some(1), reduction: Some("add".into()) });
                let d = cx.add1(add, &[zeros, idx, d])?;
                cx.set(0, d);
            }
            if let (true, Some(_)) = (cx.want(2), window) {
                let idx = cx.constant(Array::i64(vec![frames as usize, fl], at));
                let framed = cx.add1(Op::Gather(op::Gather { axis: Some(1) }), &[x, idx])?;
                let prod = cx.mul(framed, dw_frames)?;
                let d = cx.reduce_sum(prod, &[0, 1, 3], false)?;
                cx.set(2, d);
            }
            Ok(())
        })())
    }
}

/// The window's length (its `size` input) and the output type.
fn window_infer(cx: &InferCx<'_>, output_datatype: i64) -> Types {
    let dtype =
        DType::from_code(output_datatype).ok_or_else(|| format!("unknown output_datatype {output_datatype}"))?;
    cx.needs_values(&[0]);
    let n = cx.ints(0).and_then(|v| v.first().copied()).map_or(Dim::Unknown, Dim::Fixed);
    Ok(vec![Some(TensorType::new(dtype, vec![n]))])
}

fn window(cx: &EvalCx<'_>, output_datatype: i64, periodic: bool, f: impl Fn(f64, f64) -> f64) -> Arrays {
    let n = cx.req(0)?.to_i64()?.first().copied().unwrap_or(0).max(0) as usize;
    let dtype = DType::from_code(output_datatype)
        .ok_or_else(|| EvalError::Invalid(format!("unknown output_datatype {output_datatype}")))?;
    let denom = if periodic { n as f64 } else { n as f64 - 1.0 };
    let v: Vec<f64> = (0..n).map(|i| f(i as f64, denom)).collect();
    Ok(vec![if dtype.is_float() {
        Array::float(dtype, vec![n], v)
    } else {
        Array::int(dtype, vec![n], v.into_iter().map(|x| x as i64).collect())
    }])
}

macro_rules! windows {
    ($($name:ident: |$i:ident, $n:ident| $f:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(1)
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                window_infer(cx, self.output_datatype())
            }

            no_work_whole!();

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                window(cx, self.output_datatype(), self.periodic() != 0, |$i, $n| $f)
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                cx.constant_outputs();
                Some(())
            }
        }
    )*};
}

windows! {
    HannWindow: |i, n| (std::f64::consts::PI * i / n).sin().powi(2);
    HammingWindow: |i, n| 25.0 / 46.0 - (1.0 - 25.0 / 46.0) * (2.0 * std::f64::consts::PI * i / n).cos();
    BlackmanWindow: |i, n| 0.42 - 0.5 * (2.0 * std::f64::consts::PI * i / n).cos() + 0.08 * (4.0 * std::f64::consts::PI * i / n).cos();
}

impl OpRules for op::MelWeightMatrix {
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.constant_outputs();
        Some(())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(5)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dtype = DType::from_code(self.output_datatype()).ok_or("unknown output_datatype")?;
        cx.needs_values(&[0, 1]);
        let mel = cx.ints(0).and_then(|v| v.first().copied()).map_or(Dim::Unknown, Dim::Fixed);
        let bins = cx.ints(1).and_then(|v| v.first().copied()).map_or(Dim::Unknown, |n| Dim::Fixed(n / 2 + 1));
        Ok(vec![Some(TensorType::new(dtype, vec![bins, mel]))])
    }

    no_work_whole!();

    /// Triangular filters evenly spaced on the mel scale between the edge frequencies,
    /// mapped to DFT bins, as ONNX's reference computes them.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let scalar = |i: usize| -> Result<f64> { Ok(cx.req(i)?.to_f64()?.first().copied().unwrap_or(0.0)) };
        let (mel, dft_len, rate) = (scalar(0)? as i64, scalar(1)? as i64, scalar(2)? as i64);
        let (lo, hi) = (scalar(3)?, scalar(4)?);
        if mel <= 0 || dft_len <= 0 || rate <= 0 {
            return Err(EvalError::Invalid(format!("MelWeightMatrix of {mel} bins, length {dft_len}, rate {rate}")));
        }
        let bins = (dft_len / 2 + 1) as usize;
        let to_mel = |f: f64| 2595.0 * (f / 700.0).ln_1p() / std::f64::consts::LN_10;
        let (lm, hm) = (to_mel(lo), to_mel(hi));
        let step = (hm - lm) / (mel + 2) as f64;
        let points: Vec<i64> = (0..mel + 2)
            .map(|k| {
                let m = k as f64 * step + lm;
                let hz = 700.0 * (m / 2595.0 * std::f64::consts::LN_10).exp_m1();
                (((dft_len + 1) as f64 * hz) / rate as f64).floor() as i64
            })
            .collect();
        let mel = mel as usize;
        let mut out = vec![0.0; bins * mel];
        let mut set = |j: i64, i: usize, v: f64| -> Result<()> {
            let j = usize::try_from(j)
                .ok()
                .filter(|&j| j < bins)
                .ok_or_else(|| EvalError::Invalid(format!("mel filter bin {j} outside {bins}")))?;
            out[j * mel + i] = v;
            Ok(())
        };
        for i in 0..mel {
            let (l, c, h) = (points[i], points[i + 1], points[i + 2]);
            if c == l {
                set(c, i, 1.0)?;
            } else {
                for j in l..=c {
                    set(j, i, (j - l) as f64 / (c - l) as f64)?;
                }
            }
            if h > c {
                for j in c..h {
                    set(j, i, (h - j) as f64 / (h - c) as f64)?;
                }
            }
        }
        let dtype = DType::from_code(self.output_datatype()).unwrap_or(DType::Float);
        Ok(vec![Array::float(dtype, vec![bins, mel], out)])
    }
}
