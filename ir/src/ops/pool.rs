//! Pooling: max, average and Lp pooling over windows (the window geometry of
//! [`super::conv`]), and global pooling over all spatial dims.
//!
//! Windowed pools split batch, channels and spatial dims (with halos); global average pooling
//! sums over its spatial dims (a split leaves partial sums), global max and Lp keep them whole.

use super::conv::{f32s, spatial_dims, to3, window, window_dims, window_flow};
use super::util::join;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::eval::{Array, EvalError};
use crate::op::{self, Op};
use crate::shard::{DimKind, DimRole, IterDim, IterSpace, par};
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
                pool(x, kind, kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode, indices)
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                window_flow(cx, true, false)
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
