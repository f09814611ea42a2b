//! Pooling: max, average and Lp pooling over windows (the window geometry of
//! [`super::conv`]), and global pooling over all spatial dims.
//!
//! Windowed pools split batch, channels and spatial dims (with halos); global average pooling
//! sums over its spatial dims (a split leaves partial sums), global max and Lp keep them whole.

use super::conv::{spatial_dims, to3, window, window_dims, window_flow};
use super::flow::flow_positional;
use super::grad::GradCx;
use super::util::join;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, Data, EvalError};
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace, par};
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// Windowed pools: `Name: FLOPs per window element, outputs, |self| kind, indices wanted`.
macro_rules! windowed {
    ($($name:ident: $per:expr, $outs:expr, |$s:ident, $cx:ident| $kind:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::new(1, 1, 1, $outs)
            }

            fn sharded(&self) -> Sharded {
                Sharded::Window
            }

            fn grad_kernel(&self) -> Option<&'static str> {
                match stringify!($name) {
                    "MaxPool" => Some("MaxPoolGrad"),
                    "AveragePool" => Some("AveragePoolGrad"),
                    _ => None,
                }
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                let Some(xd) = cx.dims(0) else { return Ok(vec![cx.with(cx.dtype(), None); cx.n_out]) };
                if xd.len() < 3 {
                    return Err(format!("pooling needs rank ≥ 3, got [{}]", join(xd)));
                }
                let op = Op::$name(self.clone());
                let a = op.pool_attrs().expect("a pooling op");
                let kernel = a.kernel_shape.ok_or("pooling needs kernel_shape")?;
                let sp = window_dims(&xd[2..], kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode)?;
                let mut out = vec![xd[0].clone(), xd[1].clone()];
                out.extend(sp);
                let mut res = vec![cx.with(cx.dtype(), Some(out.clone()))];
                if cx.n_out > 1 {
                    res.push(Some(TensorType::new(DType::Int64, out)));
                }
                Ok(res)
            }

            fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
                let (x, out) = (cx.in_dims(0), cx.out_dims(0));
                let op = Op::$name(self.clone());
                let a = op.pool_attrs().expect("a pooling op");
                let spatial: Vec<usize> = x.iter().skip(2).map(|&d| d as usize).collect();
                let win = a.kernel_shape.and_then(|k| {
                    window(&spatial, k, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode).ok()
                });
                let (true, Some(win)) = (x.len() >= 3, win) else { return Some(IterSpace::whole(cx)) };
                let mut sd = vec![par("n", out[0]), par("c", out[1])];
                sd.extend(spatial_dims(&win));
                let m: Vec<Option<usize>> = (0..x.len()).map(Some).collect();
                Some(IterSpace { dims: sd, inputs: vec![Some(m.clone())], outputs: vec![m; cx.n_out()] })
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                let k = self.kernel_shape.as_ref().map_or(1, |k| k.iter().product::<i64>()) as f64;
                Work::flops($per * cx.out_numel(0) * k)
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let x = cx.req(0)?;
                let op = Op::$name(self.clone());
                let a = op.pool_attrs().expect("a pooling op");
                let kernel = a.kernel_shape.ok_or_else(|| EvalError::Invalid(format!("{} without kernel_shape", cx.name)))?;
                let ($s, $cx) = (self, cx);
                let (kind, indices): (PoolKind, bool) = $kind;
                let mut outs = pool(x, kind, kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode, indices)?;
                if let (Op::MaxPool(m), Some(ix)) = (&op, outs.get_mut(1))
                    && m.storage_order() == 1
                {
                    // Column-major indices: within each (n, c) plane, the last spatial dim
                    // varies slowest.
                    let spatial = &x.shape[2..];
                    let plane: usize = spatial.iter().product();
                    if let Data::I64(v) = &mut ix.data {
                        for i in v.iter_mut() {
                            let (base, mut off) = ((*i as usize / plane) * plane, *i as usize % plane);
                            let mut coords = vec![0; spatial.len()];
                            for d in (0..spatial.len()).rev() {
                                coords[d] = off % spatial[d];
                                off /= spatial[d];
                            }
                            let mut col = 0;
                            for d in (0..spatial.len()).rev() {
                                col = col * spatial[d] + coords[d];
                            }
                            *i = (base + col) as i64;
                        }
                    }
                }
                Ok(outs)
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                window_flow(cx, true, false)
            }

            fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
                pool_grad(&Op::$name(self.clone()), cx)
            }
        }
    )*};
}

windowed! {
    MaxPool: 1.0, 2, |_s, cx| (PoolKind::Max, cx.n_out > 1);
    AveragePool: 1.0, 1, |s, _cx| (PoolKind::Avg { include_pad: s.count_include_pad() != 0 }, false);
    LpPool: 2.0, 1, |s, _cx| (PoolKind::Lp(s.p()), false);
}

/// Global pools: `Name: summed over space?, |self| kind`.
macro_rules! global {
    ($($name:ident: $sum:expr, |$s:ident| $kind:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(1)
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                let Some(xd) = cx.dims(0) else { return cx.one(None) };
                if xd.len() < 3 {
                    return Err(format!("global pooling needs rank ≥ 3, got [{}]", join(xd)));
                }
                let mut out = vec![xd[0].clone(), xd[1].clone()];
                out.extend(std::iter::repeat_n(Dim::Fixed(1), xd.len() - 2));
                cx.one(Some(out))
            }

            fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
                let (x, out) = (cx.in_dims(0), cx.out_dims(0));
                if x.len() < 2 {
                    return Some(IterSpace::whole(cx));
                }
                let kind = if $sum { DimKind::Reduction } else { DimKind::Fixed };
                let mut sd = vec![par("n", out[0]), par("c", out[1])];
                sd.extend((2..x.len()).map(|i| IterDim {
                    name: format!("s{}", i - 2),
                    size: x[i],
                    kind: kind.clone(),
                    role: DimRole::Spatial,
                }));
                let xm: Vec<Option<usize>> = (0..x.len()).map(Some).collect();
                let mut om = vec![Some(0), Some(1)];
                om.extend(std::iter::repeat_n(None, x.len().saturating_sub(2)));
                Some(IterSpace { dims: sd, inputs: vec![Some(xm)], outputs: vec![om] })
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops(cx.in_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let $s = self;
                Ok(vec![global_pool(cx.req(0)?, $kind)?])
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                window_flow(cx, true, true)
            }

            fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
                global_grad(&Op::$name(self.clone()), cx)
            }
        }
    )*};
}

global! {
    GlobalAveragePool: true, |_s| PoolKind::Avg { include_pad: false };
    GlobalMaxPool: false, |_s| PoolKind::Max;
    GlobalLpPool: false, |s| PoolKind::Lp(s.p());
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
    let xs = x.to_f64()?;
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
                    let mut best = f64::NEG_INFINITY;
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
                                        // NaN wins and stays (as onnxruntime and torch have it).
                                        if !best.is_nan() && (v > best || v.is_nan()) {
                                            best = v;
                                            best_i = base + off;
                                        }
                                    }
                                    PoolKind::Avg { .. } => sum += v,
                                    PoolKind::Lp(p) => sum += v.abs().powi(p as i32),
                                }
                            }
                        }
                    }
                    out.push(match kind {
                        PoolKind::Max => best,
                        PoolKind::Avg { include_pad } => {
                            let d = if include_pad { padded_count } else { count };
                            sum / d.max(1) as f64
                        }
                        PoolKind::Lp(p) => sum.powf(1.0 / p as f64),
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
    let values = if x.dtype.is_float() {
        Array::float(x.dtype, shape.clone(), out)
    } else {
        Array::int(x.dtype, shape.clone(), out.into_iter().map(|v| v as i64).collect())
    };
    let mut res = vec![values];
    if want_indices {
        res.push(Array::i64(shape, idx));
    }
    Ok(res)
}

fn global_pool(x: &Array, kind: PoolKind) -> Result<Array> {
    let kernel: Vec<i64> = x.shape[2..].iter().map(|&d| d as i64).collect();
    Ok(pool(x, kind, &kernel, None, None, None, "NOTSET", false, false)?.remove(0))
}

// ---- gradients ----

/// MaxPool and AveragePool: MaxPoolGrad / AveragePoolGrad with the window's pads made
/// explicit. LpPool, `Y = (Σ_w |X|^p)^(1/p)`: `dX = Σᵀ(dY · Y^(1−p)) · |X|^(p−1) · sign(X)`,
/// `Σᵀ` the window sum's adjoint — an AveragePoolGrad counting only the elements inside the
/// input of `dY` times each window's count (an LpPool with `p = 1` of ones) — and a window
/// of zeros (`Y` = 0) passing no gradient.
fn pool_grad(op: &Op, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
    Some((|| {
        if cx.dy(1).is_some() {
            return Err("a gradient through MaxPool's indices".into());
        }
        let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
        let x = cx.x(0)?;
        let xd = cx.dims(x)?;
        let a = op.pool_attrs().ok_or("not a pooling op")?;
        let kernel = a.kernel_shape.ok_or("pooling without kernel_shape")?;
        let spatial: Vec<usize> = xd[2..].iter().map(|&d| d as usize).collect();
        let win = window(&spatial, kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode)?;
        let pads: Vec<i64> = win.pad_begin.iter().chain(&win.pad_end).map(|&p| p as i64).collect();
        let strides: Vec<i64> = win.strides.iter().map(|&v| v as i64).collect();
        let dil: Vec<i64> = win.dilations.iter().map(|&v| v as i64).collect();
        // The average pool's gradient over this window, counting the pads or not.
        let avg_grad = |count_include_pad: i64| {
            Op::AveragePoolGrad(op::AveragePoolGrad {
                ceil_mode: Some(i64::from(a.ceil_mode)),
                count_include_pad: Some(count_include_pad),
                dilations: Some(dil.clone()),
                input_shape: Some(xd.clone()),
                kernel_shape: Some(kernel.to_vec()),
                pads: Some(pads.clone()),
                strides: Some(strides.clone()),
            })
        };
        let d = match op {
            Op::MaxPool(_) => cx.add1(
                Op::MaxPoolGrad(op::MaxPoolGrad {
                    dilations: Some(dil.clone()),
                    kernel_shape: Some(kernel.to_vec()),
                    pads: Some(pads.clone()),
                    strides: Some(strides.clone()),
                }),
                &[x, dy],
            )?,
            Op::AveragePool(p) => cx.add1(avg_grad(p.count_include_pad()), &[dy])?,
            Op::LpPool(lp) => {
                let p = lp.p();
                let dt = cx.dtype(x);
                let one = cx.scalar(dt, 1.0);
                let ones = cx.expand(one, &xd)?;
                let counts = cx.add1(
                    Op::LpPool(op::LpPool {
                        auto_pad: None,
                        ceil_mode: Some(i64::from(a.ceil_mode)),
                        dilations: Some(dil.clone()),
                        kernel_shape: Some(kernel.to_vec()),
                        p: Some(1),
                        pads: Some(pads.clone()),
                        strides: Some(strides.clone()),
                    }),
                    &[ones],
                )?;
                let g = lp_outer(cx, dy, p)?;
                let summed = cx.mul(g, counts)?;
                let s = cx.add1(avg_grad(0), &[summed])?;
                lp_inner(cx, s, x, p)?
            }
            _ => return Err("no gradient rule".into()),
        };
        cx.set(0, d);
        Ok(())
    })())
}

/// `dY · Y^(1−p)` of an Lp pool, 0 where `Y` is 0 (a window of zeros).
fn lp_outer(cx: &mut GradCx<'_>, dy: crate::Value, p: i64) -> std::result::Result<crate::Value, String> {
    if p == 1 {
        return Ok(dy);
    }
    let y = cx.y(0);
    let dt = cx.dtype(y);
    let (zero, e) = (cx.scalar(dt, 0.0), cx.scalar(dt, 1.0 - p as f64));
    let is_zero = cx.add1(Op::Equal(op::Equal::default()), &[y, zero])?;
    let pw = cx.add1(Op::Pow(op::Pow::default()), &[y, e])?;
    let pw = cx.where_(is_zero, zero, pw)?;
    cx.mul(dy, pw)
}

/// `S · |X|^(p−1) · sign(X)`: the window sums `S` of an Lp pool's gradient back through `|X|^p`.
fn lp_inner(
    cx: &mut GradCx<'_>,
    s: crate::Value,
    x: crate::Value,
    p: i64,
) -> std::result::Result<crate::Value, String> {
    let sign = cx.add1(Op::Sign(op::Sign::default()), &[x])?;
    let g = match p {
        1 => sign,
        2 => x,
        _ => {
            let ax = cx.add1(Op::Abs(op::Abs::default()), &[x])?;
            let e = cx.scalar(cx.dtype(x), (p - 1) as f64);
            let pw = cx.add1(Op::Pow(op::Pow::default()), &[ax, e])?;
            cx.mul(pw, sign)?
        }
    };
    cx.mul(s, g)
}

/// Global average pooling spreads dY evenly; global max pooling sends it to the maxima;
/// global Lp pooling as [`pool_grad`]'s LpPool over one window.
fn global_grad(op: &Op, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
    Some((|| {
        let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
        let x = cx.x(0)?;
        let xd = cx.dims(x)?;
        if let Op::GlobalLpPool(lp) = op {
            let g = lp_outer(cx, dy, lp.p())?;
            let s = cx.expand(g, &xd)?;
            let d = lp_inner(cx, s, x, lp.p())?;
            cx.set(0, d);
            return Ok(());
        }
        let e = cx.expand(dy, &xd)?;
        let d = match op {
            Op::GlobalAveragePool(_) => cx.scale(e, 1.0 / xd[2..].iter().product::<i64>().max(1) as f64)?,
            _ => {
                let y = cx.y(0);
                let eq = cx.add1(Op::Equal(op::Equal::default()), &[x, y])?;
                let z = cx.scalar(cx.dtype(dy), 0.0);
                cx.where_(eq, e, z)?
            }
        };
        cx.set(0, d);
        Ok(())
    })())
}

/// The pooling geometry a gradient op carries, padded to 3-D.
struct PoolGeo {
    k: [usize; 3],
    s: [usize; 3],
    d: [usize; 3],
    pb: [usize; 3],
    pe: [usize; 3],
}

fn pool_geo(
    kernel: &Option<Vec<i64>>,
    strides: &Option<Vec<i64>>,
    dil: &Option<Vec<i64>>,
    pads: &Option<Vec<i64>>,
    sp: usize,
) -> Result<PoolGeo> {
    let kv: Vec<usize> = kernel
        .clone()
        .ok_or_else(|| EvalError::Invalid("a pooling gradient without kernel_shape".into()))?
        .iter()
        .map(|&v| v.max(1) as usize)
        .collect();
    if kv.len() != sp {
        return Err(EvalError::Invalid("kernel_shape does not fit the spatial dims".into()));
    }
    let get = |v: &Option<Vec<i64>>, n: usize, d: i64| -> Vec<usize> {
        v.clone().unwrap_or_else(|| vec![d; n]).iter().map(|&x| x.max(0) as usize).collect()
    };
    let p = get(pads, 2 * sp, 0);
    if p.len() != 2 * sp {
        return Err(EvalError::Invalid("pads do not fit the spatial dims".into()));
    }
    Ok(PoolGeo {
        k: to3(&kv, 1),
        s: to3(&get(strides, sp, 1), 1),
        d: to3(&get(dil, sp, 1), 1),
        pb: to3(&p[..sp], 0),
        pe: to3(&p[sp..], 0),
    })
}

/// For each output position of every plane: the in-bounds inputs of its window, and how
/// many window taps fall inside the padded extent.
fn pool_windows(g: &PoolGeo, inp: [usize; 3], out: [usize; 3], mut f: impl FnMut(usize, &[usize], usize)) {
    let mut idx = Vec::new();
    for z in 0..out[0] {
        for y in 0..out[1] {
            for x in 0..out[2] {
                idx.clear();
                let mut padded = 0;
                for a in 0..g.k[0] {
                    let iz = (z * g.s[0] + a * g.d[0]) as isize - g.pb[0] as isize;
                    for b in 0..g.k[1] {
                        let iy = (y * g.s[1] + b * g.d[1]) as isize - g.pb[1] as isize;
                        for c in 0..g.k[2] {
                            let ix = (x * g.s[2] + c * g.d[2]) as isize - g.pb[2] as isize;
                            let in_pad = iz < (inp[0] + g.pe[0]) as isize
                                && iy < (inp[1] + g.pe[1]) as isize
                                && ix < (inp[2] + g.pe[2]) as isize;
                            if in_pad {
                                padded += 1;
                            }
                            if iz < 0
                                || iy < 0
                                || ix < 0
                                || iz >= inp[0] as isize
                                || iy >= inp[1] as isize
                                || ix >= inp[2] as isize
                            {
                                continue;
                            }
                            idx.push((iz as usize * inp[1] + iy as usize) * inp[2] + ix as usize);
                        }
                    }
                }
                f((z * out[1] + y) * out[2] + x, &idx, padded);
            }
        }
    }
}

impl OpRules for op::MaxPoolGrad {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::batch(cx, &[0, 1], &[0]))
    }

    /// What runs: a data-parallel kernel cannot scatter each window's gradient to its
    /// maximum without atomics, so the GPU kernel gathers — each input element visits every
    /// window that covers it and scans that window for its maximum: each window is scanned
    /// once per tap, `k²` comparisons per output gradient (the scatter would take `k`).
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let k = self.kernel_shape.as_ref().map_or(1, |k| k.iter().product::<i64>()) as f64;
        Work::flops(cx.in_numel(1) * k * k)
    }

    /// Each output's gradient goes to the first maximum of its window.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, dy) = (cx.req(0)?, cx.req(1)?);
        if x.rank() < 3 || x.rank() > 5 || dy.rank() != x.rank() {
            return Err(EvalError::Invalid("MaxPoolGrad operands do not fit".into()));
        }
        let g = pool_geo(&self.kernel_shape, &self.strides, &self.dilations, &self.pads, x.rank() - 2)?;
        let (inp, out) = (to3(&x.shape[2..], 1), to3(&dy.shape[2..], 1));
        let (isz, osz) = (inp.iter().product::<usize>(), out.iter().product::<usize>());
        let (xv, dv) = (x.to_f64()?, dy.to_f64()?);
        let mut dx = vec![0.0; xv.len()];
        for plane in 0..x.shape[0] * x.shape[1] {
            let (xb, ob) = (plane * isz, plane * osz);
            pool_windows(&g, inp, out, |o, idx, _| {
                let mut best: Option<usize> = None;
                for &i in idx {
                    if best.is_none_or(|b| xv[xb + i] > xv[xb + b]) {
                        best = Some(i);
                    }
                }
                if let Some(b) = best {
                    dx[xb + b] += dv[ob + o];
                }
            });
        }
        Ok(vec![Array::float(dy.dtype, x.shape.clone(), dx)])
    }
}

impl OpRules for op::AveragePoolGrad {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let shape = self.input_shape.as_ref().ok_or("AveragePoolGrad needs `input_shape`")?;
        cx.one(Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::batch(cx, &[0], &[0]))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let k = self.kernel_shape.as_ref().map_or(1, |k| k.iter().product::<i64>()) as f64;
        Work::flops(cx.in_numel(0) * k)
    }

    /// Each output's gradient shared by the elements of its window, divided as the forward
    /// divided (the in-bounds count, or the taps inside the padded extent).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let dy = cx.req(0)?;
        let xs: Vec<usize> = self.input_shape.clone().unwrap_or_default().iter().map(|&d| d.max(0) as usize).collect();
        if xs.len() < 3 || xs.len() > 5 || dy.rank() != xs.len() {
            return Err(EvalError::Invalid("AveragePoolGrad operands do not fit".into()));
        }
        let g = pool_geo(&self.kernel_shape, &self.strides, &self.dilations, &self.pads, xs.len() - 2)?;
        let (inp, out) = (to3(&xs[2..], 1), to3(&dy.shape[2..], 1));
        let (isz, osz) = (inp.iter().product::<usize>(), out.iter().product::<usize>());
        let dv = dy.to_f64()?;
        let include_pad = self.count_include_pad() != 0;
        let mut dx = vec![0.0; xs[0] * xs[1] * isz];
        for plane in 0..xs[0] * xs[1] {
            let (xb, ob) = (plane * isz, plane * osz);
            pool_windows(&g, inp, out, |o, idx, padded| {
                let div = if include_pad { padded } else { idx.len() }.max(1) as f64;
                for &i in idx {
                    dx[xb + i] += dv[ob + o] / div;
                }
            });
        }
        Ok(vec![Array::float(dy.dtype, xs, dx)])
    }
}

impl OpRules for op::MaxUnpool {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(max_unpool_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        if cx.has(2) {
            if let Some(s) = cx.ints(2) {
                return cx.one(Some(s.into_iter().map(Dim::Fixed).collect()));
            }
            cx.needs_values(&[2]);
            return cx.one(None);
        }
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        cx.one(Some(unpool_shape(self, d)?))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    /// Scatters each value to the flat index MaxPool recorded, into zeros of the pooled
    /// input's shape (then placed at the start of `output_shape` when given).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, ix) = (cx.req(0)?, cx.req(1)?.to_i64()?);
        let dims: Vec<Dim> = x.shape.iter().map(|&d| Dim::Fixed(d as i64)).collect();
        let inferred: Vec<usize> = unpool_shape(self, &dims)
            .map_err(EvalError::Invalid)?
            .iter()
            .map(|d| d.value().unwrap_or(0) as usize)
            .collect();
        let n: usize = inferred.iter().product();
        let xv = x.to_f64()?;
        let mut y = vec![0.0; n];
        for (k, &i) in ix.iter().enumerate().take(xv.len()) {
            let i = usize::try_from(i)
                .ok()
                .filter(|&i| i < n)
                .ok_or_else(|| EvalError::Invalid(format!("MaxUnpool index {i} outside {n}")))?;
            y[i] = xv[k];
        }
        let y = Array::float(x.dtype, inferred.clone(), y);
        let Some(os) = cx.opt(2) else { return Ok(vec![y]) };
        let shape: Vec<usize> = os.to_i64()?.iter().map(|&d| d.max(0) as usize).collect();
        if shape.len() != inferred.len() || shape.iter().zip(&inferred).any(|(a, b)| a < b) {
            return Err(EvalError::Invalid(format!("MaxUnpool output_shape {shape:?} is smaller than {inferred:?}")));
        }
        let st = crate::array::strides(&inferred);
        let ost = crate::array::strides(&shape);
        let mut out = vec![0.0; shape.iter().product()];
        let yv = y.to_f64()?;
        for (i, v) in yv.iter().enumerate() {
            let o: usize = (0..inferred.len()).map(|d| ((i / st[d]) % inferred[d]) * ost[d]).sum();
            out[o] = *v;
        }
        Ok(vec![Array::float(x.dtype, shape, out)])
    }
}

/// `dX[k] = dY[I[k]]` (`dY` cut to the unpooled shape where `output_shape` widened it) for
/// each value that kept its place: where two share an index the forward keeps the last, so an
/// earlier one gets no gradient — told by unpooling `k + 1` the same way and reading back who
/// holds each index.
fn max_unpool_grad(u: &op::MaxUnpool, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let (x, ix) = (cx.x(0)?, cx.x(1)?);
    let xd = cx.dims(x)?;
    let dims: Vec<Dim> = xd.iter().map(|&d| Dim::Fixed(d)).collect();
    let inferred: Vec<i64> = unpool_shape(u, &dims)?.iter().map(|d| d.value().unwrap_or(-1)).collect();
    if xd.iter().chain(&inferred).any(|&d| d < 0) {
        return Err(format!("MaxUnpool of {xd:?}: needs known lengths"));
    }
    let dt = cx.dtype(x);
    let dy = if cx.x_opt(2).is_some() {
        let zeros = cx.ints(&vec![0; inferred.len()]);
        let ends = cx.ints(&inferred);
        cx.add1(Op::Slice(op::Slice::default()), &[dy, zeros, ends])?
    } else {
        dy
    };
    let flat = cx.reshape(dy, &[-1])?;
    let got = cx.add1(Op::Gather(op::Gather::default()), &[flat, ix])?;
    let n: usize = xd.iter().product::<i64>() as usize;
    let ks =
        cx.constant(Array::float(dt, xd.iter().map(|&d| d as usize).collect(), (1..=n).map(|k| k as f64).collect()));
    let plain =
        op::MaxUnpool { kernel_shape: u.kernel_shape.clone(), pads: u.pads.clone(), strides: u.strides.clone() };
    let holders = cx.add1(Op::MaxUnpool(plain), &[ks, ix])?;
    let holders = cx.reshape(holders, &[-1])?;
    let holder = cx.add1(Op::Gather(op::Gather::default()), &[holders, ix])?;
    let kept = cx.add1(Op::Equal(op::Equal::default()), &[holder, ks])?;
    let zero = cx.scalar(dt, 0.0);
    let d = cx.where_(kept, got, zero)?;
    cx.set(0, d);
    Ok(())
}

/// `(in − 1)·stride − pads + kernel` per spatial dim.
fn unpool_shape(u: &op::MaxUnpool, d: &[Dim]) -> std::result::Result<Vec<Dim>, String> {
    let k = u.kernel_shape.as_ref().ok_or("MaxUnpool needs kernel_shape")?;
    let n = k.len();
    if d.len() != n + 2 {
        return Err(format!("MaxUnpool of rank {} with a {n}-d kernel", d.len()));
    }
    let strides = u.strides.clone().unwrap_or_else(|| vec![1; n]);
    let pads = u.pads.clone().unwrap_or_else(|| vec![0; 2 * n]);
    let mut out = d[..2].to_vec();
    for i in 0..n {
        out.push(match d[i + 2] {
            Dim::Fixed(v) => Dim::Fixed(
                (v - 1) * strides.get(i).copied().unwrap_or(1)
                    - (pads.get(i).copied().unwrap_or(0) + pads.get(n + i).copied().unwrap_or(0))
                    + k[i],
            ),
            _ => Dim::Unknown,
        });
    }
    Ok(out)
}
