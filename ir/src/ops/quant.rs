//! Quantized arithmetic: `QuantizeLinear`, `DequantizeLinear` (per tensor, per axis and
//! blocked), `DynamicQuantizeLinear`, and the integer contractions `MatMulInteger`,
//! `ConvInteger`, `QLinearMatMul`, `QLinearConv`.
//!
//! They run whole on one device and are evaluated by the reference kernels: shardc plans the
//! training of float models; quantized graphs are read, priced as their float equivalents'
//! work, and run.

use std::cell::Cell;

use super::contraction::matmul_dims;
use super::flow::flow_positional;
use super::shape::no_work_whole;
use super::util::norm_axis;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::op;
use crate::layout::IterSpace;
use crate::ops::contraction::matmul;
use crate::types::{DType, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// The least and greatest values of an integer type that quantized values take.
fn q_range(d: DType) -> Result<(f64, f64)> {
    Ok(match d {
        DType::Uint8 => (0.0, 255.0),
        DType::Int8 => (-128.0, 127.0),
        DType::Uint16 => (0.0, 65535.0),
        DType::Int16 => (-32768.0, 32767.0),
        DType::Int32 => (f64::from(i32::MIN), f64::from(i32::MAX)),
        DType::Uint4 => (0.0, 15.0),
        DType::Int4 => (-8.0, 7.0),
        other => return Err(EvalError::Unsupported(format!("quantization to {other}"))),
    })
}

/// A scale or zero point spread over `shape`: one value, one per index of `axis`, or one per
/// block of `block` indices along it.
fn spread(v: &Array, shape: &[usize], axis: i64, block: i64) -> Result<Vec<f64>> {
    let vals = v.to_f64()?;
    let n: usize = shape.iter().product();
    if vals.len() == 1 || v.rank() == 0 {
        return Ok(vec![vals.first().copied().unwrap_or(0.0); n]);
    }
    let ax = norm_axis(axis, shape.len())?;
    let st = crate::array::strides(shape);
    if block <= 0 {
        if vals.len() != shape[ax] {
            return Err(EvalError::Invalid(format!("{} scales for axis {ax} of {:?}", vals.len(), shape)));
        }
        return Ok((0..n).map(|i| vals[(i / st[ax]) % shape[ax]]).collect());
    }
    // Blocked: the scale has the input's shape with axis `ax` divided into blocks.
    let vst = crate::array::strides(&v.shape);
    if v.rank() != shape.len() {
        return Err(EvalError::Invalid(format!("blocked scale {:?} for {:?}", v.shape, shape)));
    }
    Ok((0..n)
        .map(|i| {
            let off: usize = (0..shape.len())
                .map(|d| {
                    let k = (i / st[d]) % shape[d];
                    let k = if d == ax { k / block as usize } else { k };
                    k.min(v.shape[d] - 1) * vst[d]
                })
                .sum();
            vals[off]
        })
        .collect())
}

/// Round half to even, as `np.rint`.
fn rint(x: f64) -> f64 {
    x.round_ties_even()
}

fn quantized(dtype: DType, shape: Vec<usize>, v: impl Iterator<Item = f64>) -> Result<Array> {
    let (lo, hi) = q_range(dtype)?;
    Ok(Array::int(dtype, shape, v.map(|x| rint(x).clamp(lo, hi) as i64).collect()))
}

impl OpRules for op::QuantizeLinear {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dtype = cx
            .input(2)
            .map(|t| t.dtype)
            .or_else(|| self.output_dtype.and_then(DType::from_code).filter(|_| self.output_dtype != Some(0)))
            .unwrap_or(DType::Uint8);
        Ok(vec![cx.with(Some(dtype), cx.dims(0).cloned())])
    }

    no_work_whole!();

    /// `saturate(round(x / scale) + zero_point)`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let dtype = cx
            .opt(2)
            .map(|z| z.dtype)
            .or_else(|| self.output_dtype.and_then(DType::from_code).filter(|_| self.output_dtype != Some(0)))
            .unwrap_or(DType::Uint8);
        let (axis, block) = (self.axis(), self.block_size());
        let scale = spread(cx.req(1)?, &x.shape, axis, block)?;
        let zero = match cx.opt(2) {
            Some(z) => spread(z, &x.shape, axis, block)?,
            None => vec![0.0; x.numel()],
        };
        let xv = x.to_f64()?;
        // In the input's precision, as the reference divides (f32 for 32- and 16-bit floats).
        let single = x.dtype != DType::Double;
        let q = xv.iter().zip(&scale).zip(&zero).map(|((v, s), z)| {
            let r = if single { f64::from(*v as f32 / *s as f32) } else { v / s };
            rint(r) + z
        });
        Ok(vec![quantized(dtype, x.shape.clone(), q)?])
    }
}

impl OpRules for op::DequantizeLinear {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dtype = self.output_dtype.filter(|&c| c != 0).and_then(DType::from_code).or(cx.input(1).map(|t| t.dtype));
        Ok(vec![cx.with(dtype, cx.dims(0).cloned())])
    }

    no_work_whole!();

    /// `(x − zero_point) · scale`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, s) = (cx.req(0)?, cx.req(1)?);
        let dtype = self.output_dtype.filter(|&c| c != 0).and_then(DType::from_code).unwrap_or(s.dtype);
        let (axis, block) = (self.axis(), self.block_size());
        let scale = spread(s, &x.shape, axis, block)?;
        let zero = match cx.opt(2) {
            Some(z) => spread(z, &x.shape, axis, block)?,
            None => vec![0.0; x.numel()],
        };
        let xv = x.to_f64()?;
        // The product in f32, as the reference computes it.
        let y = xv.iter().zip(&scale).zip(&zero).map(|((v, s), z)| f64::from((v - z) as f32 * *s as f32)).collect();
        Ok(vec![Array::float(dtype, x.shape.clone(), y)])
    }
}

impl OpRules for op::DynamicQuantizeLinear {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(1, 1, 3, 3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![
            cx.with(Some(DType::Uint8), cx.dims(0).cloned()),
            Some(TensorType::scalar(DType::Float)),
            Some(TensorType::scalar(DType::Uint8)),
        ])
    }

    no_work_whole!();

    /// The scale and zero point that map [min(x, 0), max(x, 0)] onto [0, 255], and x
    /// quantized by them (in f32, as the reference computes).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let v = x.to_f32()?;
        let maxx = v.iter().copied().fold(0f32, f32::max);
        let minx = v.iter().copied().fold(0f32, f32::min);
        let scale = if maxx == minx { 1.0 } else { maxx - minx } / 255.0;
        let zp = (0.0 - minx / scale).clamp(0.0, 255.0).round_ties_even();
        let y = v.iter().map(|&a| f64::from(((a / scale).round_ties_even() + zp).clamp(0.0, 255.0)));
        Ok(vec![
            quantized(DType::Uint8, x.shape.clone(), y)?,
            Array::float(DType::Float, vec![], vec![f64::from(scale)]),
            Array::int(DType::Uint8, vec![], vec![zp as i64]),
        ])
    }
}

/// `x − zero_point` as f64, the zero point per tensor or (for the matrices' rows or columns)
/// per index of `axis`.
fn shifted(x: &Array, zero: Option<&Array>, axis: usize) -> Result<Array> {
    let mut v = x.to_f64()?;
    if let Some(z) = zero {
        let zs = z.to_f64()?;
        if zs.is_empty() {
            return Err(EvalError::Invalid("an empty zero point".into()));
        }
        if zs.len() == 1 {
            v.iter_mut().for_each(|a| *a -= zs[0]);
        } else if x.rank() > axis {
            let st = crate::array::strides(&x.shape);
            for (i, a) in v.iter_mut().enumerate() {
                *a -= zs[(i / st[axis]) % x.shape[axis].max(1) % zs.len()];
            }
        }
    }
    Ok(Array::float(DType::Double, x.shape.clone(), v))
}

/// A quantized matrix product's work: a multiply-add per output element per contracted term.
fn matmul_work(cx: &NodeCx<'_>) -> Option<Work> {
    let k = *cx.in_dims(0).last()? as f64;
    Work::flops(2.0 * k * cx.out_numel(0))
}

impl OpRules for op::MatMulInteger {
    fn matrix_units(&self) -> bool {
        true
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(a), Some(b)) = (cx.dims(0), cx.dims(1)) else { return Ok(vec![None]) };
        Ok(vec![Some(TensorType::new(DType::Int32, matmul_dims(a, b)?))])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        matmul_work(cx)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (a, b) = (cx.req(0)?, cx.req(1)?);
        // A's zero point per row (its second-to-last dim), B's per column (its last).
        let a = shifted(a, cx.opt(2), a.rank().saturating_sub(2))?;
        let b = shifted(b, cx.opt(3), b.rank().saturating_sub(1))?;
        let y = matmul(&a, &b)?;
        Ok(vec![Array::int(DType::Int32, y.shape.clone(), y.to_f64()?.iter().map(|&v| v as i64).collect())])
    }
}

impl OpRules for op::QLinearMatMul {
    fn matrix_units(&self) -> bool {
        true
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(8)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(a), Some(b)) = (cx.dims(0), cx.dims(3)) else { return Ok(vec![None]) };
        let dtype = cx.input(7).map(|t| t.dtype).or(cx.dtype());
        Ok(vec![cx.with(dtype, Some(matmul_dims(a, b)?))])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        matmul_work(cx)
    }

    /// `saturate(round((a − za)(b − zb) · sa·sb/sy) + zy)`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (a, b) = (cx.req(0)?, cx.req(3)?);
        let an = shifted(a, cx.opt(2), a.rank().saturating_sub(2))?;
        let bn = shifted(b, cx.opt(5), b.rank().saturating_sub(1))?;
        let c = matmul(&an, &bn)?;
        let out_dtype = cx.opt(7).map_or(a.dtype, |z| z.dtype);
        let (sa, sb, sy) = (cx.req(1)?.to_f64()?, cx.req(4)?.to_f64()?, cx.req(6)?.to_f64()?);
        if sa.is_empty() || sb.is_empty() || sy.is_empty() {
            return Err(EvalError::Invalid("QLinearMatMul: an empty scale".into()));
        }
        let zy = cx.opt(7).map(|z| z.to_f64()).transpose()?.and_then(|v| v.first().copied()).unwrap_or(0.0);
        // Per-column scales of B (and of the output) apply along the last dim.
        let n = *c.shape.last().unwrap_or(&1);
        let pick = |v: &[f64], j: usize| if v.len() == 1 { v[0] } else { v[j % v.len()] };
        let cv = c.to_f64()?;
        // The multiplier in the inputs' precision (f32), as the reference computes it.
        let y = cv.iter().enumerate().map(|(i, &x)| {
            let j = i % n.max(1);
            let m = (pick(&sa, 0) as f32 * pick(&sb, j) as f32 / pick(&sy, j) as f32) as f64;
            rint(x * m) + zy
        });
        Ok(vec![quantized(out_dtype, c.shape.clone(), y)?])
    }
}

/// The float convolution of the same geometry, on f64 operands.
fn conv_of(c: &ConvAttrs) -> op::Conv {
    op::Conv {
        auto_pad: c.auto_pad.clone(),
        dilations: c.dilations.clone(),
        group: c.group,
        kernel_shape: c.kernel_shape.clone(),
        pads: c.pads.clone(),
        strides: c.strides.clone(),
    }
}

struct ConvAttrs {
    auto_pad: Option<String>,
    dilations: Option<Vec<i64>>,
    group: Option<i64>,
    kernel_shape: Option<Vec<i64>>,
    pads: Option<Vec<i64>>,
    strides: Option<Vec<i64>>,
}

macro_rules! conv_attrs {
    ($c:expr) => {
        ConvAttrs {
            auto_pad: $c.auto_pad.clone(),
            dilations: $c.dilations.clone(),
            group: $c.group,
            kernel_shape: $c.kernel_shape.clone(),
            pads: $c.pads.clone(),
            strides: $c.strides.clone(),
        }
    };
}

/// The convolution's output type on inputs `x` and `w` of `cx`, of element type `dtype`.
fn conv_infer(c: &ConvAttrs, cx: &InferCx<'_>, x: usize, w: usize, dtype: Option<DType>) -> Types {
    let (Some(xt), Some(wt)) = (cx.input(x), cx.input(w)) else { return Ok(vec![None]) };
    let as_f = |t: &TensorType| TensorType { dtype: DType::Float, dims: t.dims.clone() };
    let (xf, wf) = (as_f(xt), as_f(wt));
    let ins = [Some(&xf), Some(&wf)];
    let sub = InferCx {
        ins: &ins,
        consts: &[None, None],
        syms: &[None, None],
        n_out: 1,
        opset: cx.opset,
        missing: Cell::new(0),
    };
    let t = conv_of(c).infer(&sub)?;
    Ok(vec![t.into_iter().next().flatten().and_then(|t| dtype.map(|d| TensorType { dtype: d, dims: t.dims }))])
}

fn conv_eval(c: &ConvAttrs, x: &Array, w: &Array, b: Option<&Array>, opset: i64) -> Result<Array> {
    let ins = [Some(x), Some(w), b];
    let n = if b.is_some() { 3 } else { 2 };
    let cx = EvalCx { inputs: &ins[..n], n_out: 1, opset, name: "Conv" };
    Ok(conv_of(c).eval(&cx)?.remove(0))
}

fn conv_work(cx: &NodeCx<'_>, w: usize) -> Option<Work> {
    let wd = cx.in_dims(w);
    let per: i64 = wd.iter().skip(1).product();
    Work::flops(2.0 * per as f64 * cx.out_numel(0))
}

impl OpRules for op::ConvInteger {
    fn matrix_units(&self) -> bool {
        true
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        conv_infer(&conv_attrs!(self), cx, 0, 1, Some(DType::Int32))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        conv_work(cx, 1)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, w) = (cx.req(0)?, cx.req(1)?);
        let xs = shifted(x, cx.opt(2), 1)?;
        let ws = shifted(w, cx.opt(3), 0)?;
        let y = conv_eval(&conv_attrs!(self), &xs, &ws, None, cx.opset)?;
        Ok(vec![Array::int(DType::Int32, y.shape.clone(), y.to_f64()?.iter().map(|&v| v.round() as i64).collect())])
    }
}

impl OpRules for op::QLinearConv {
    fn matrix_units(&self) -> bool {
        true
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(8, 9, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dtype = cx.input(7).map(|t| t.dtype).or(cx.dtype());
        conv_infer(&conv_attrs!(self), cx, 0, 3, dtype)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        conv_work(cx, 3)
    }

    /// `saturate(round(((x − zx) ⊛ (w − zw) + b) · sx·sw/sy) + zy)`, the weight's scale and
    /// zero point per output channel.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, w) = (cx.req(0)?, cx.req(3)?);
        let xs = shifted(x, cx.opt(2), 1)?;
        let ws = shifted(w, cx.opt(5), 0)?;
        let b = cx
            .opt(8)
            .map(|b| -> Result<Array> { Ok(Array::float(DType::Double, b.shape.clone(), b.to_f64()?)) })
            .transpose()?;
        let y = conv_eval(&conv_attrs!(self), &xs, &ws, b.as_ref(), cx.opset)?;
        let (sx, sw, sy) = (cx.req(1)?.to_f64()?, cx.req(4)?.to_f64()?, cx.req(6)?.to_f64()?);
        if sx.is_empty() || sw.is_empty() || sy.is_empty() {
            return Err(EvalError::Invalid("QLinearConv: an empty scale".into()));
        }
        let zy = cx.opt(7).map(|z| z.to_f64()).transpose()?.and_then(|v| v.first().copied()).unwrap_or(0.0);
        let out_dtype = cx.opt(7).map_or(x.dtype, |z| z.dtype);
        let m = y.shape.get(1).copied().unwrap_or(1);
        let plane: usize = y.shape.iter().skip(2).product();
        let pick = |v: &[f64], j: usize| if v.len() == 1 { v[0] } else { v[j % v.len()] };
        let yv = y.to_f64()?;
        let q = yv.iter().enumerate().map(|(i, &v)| {
            let ch = (i / plane.max(1)) % m.max(1);
            let mult = (pick(&sx, 0) as f32 * pick(&sw, ch) as f32 / pick(&sy, 0) as f32) as f64;
            rint(v * mult) + zy
        });
        Ok(vec![quantized(out_dtype, y.shape.clone(), q)?])
    }
}
