//! The softmax family: `Softmax`, `LogSoftmax` and `Hardmax` along an axis (opset 13+) or
//! over the flattened dims from the axis on (older opsets).
//!
//! The normalized axis is a `Statistic` dim (a split needs the row maximum and sum
//! all-reduced); Hardmax's axis stays whole.

use super::grad::GradCx;
use super::util::norm_axis;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::op::{self, Op};
use crate::layout::IterSpace;
use crate::ops::TRANSCENDENTAL_FLOPS;
use crate::ops::space::pointwise;

/// What the op computes from a row.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Kind {
    Softmax,
    LogSoftmax,
    Hardmax,
}

/// The normalized axis: the attribute, or -1 (opset 13+) / 1 (older).
fn axis(attr: Option<i64>, opset: i64) -> (bool, i64) {
    let legacy = opset > 0 && opset < 13;
    (legacy, attr.unwrap_or(if legacy { 1 } else { -1 }))
}

macro_rules! softmax {
    ($($name:ident: $kind:expr, $flops:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(1)
            }

            fn grad_kernel(&self) -> Option<&'static str> {
                (stringify!($name) != "Hardmax").then_some("SoftmaxGrad")
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                // (Before opset 13 the axis cuts the dims into two groups, and may be the rank.)
                let (legacy, a) = axis(self.axis, cx.opset);
                if let Some(r) = cx.input(0).and_then(|t| t.rank())
                    && !(legacy && a == r as i64)
                {
                    norm_axis(a, r)?;
                }
                cx.same()
            }

            fn sharded(&self) -> Sharded {
                match $kind {
                    Kind::Softmax => Sharded::Softmax { log: false },
                    Kind::LogSoftmax => Sharded::Softmax { log: true },
                    Kind::Hardmax => Sharded::Local,
                }
            }

            fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
                let r = cx.out_dims(0).len();
                let (legacy, a) = axis(self.axis, cx.opset());
                let Ok(a) = norm_axis(a, r) else { return Some(IterSpace::whole(cx)) };
                Some(if $kind == Kind::Hardmax {
                    pointwise(cx, &[a], &[], 0)
                } else {
                    let stat: Vec<usize> = if legacy { (a..r).collect() } else { vec![a] };
                    pointwise(cx, &[], &stat, 2)
                })
            }

            /// One invocation per row.
            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                let (legacy, a) = axis(self.axis, cx.opset());
                let d = cx.in_dims(0);
                let rows = match norm_axis(a, d.len()) {
                    Ok(_) if legacy => cx.rows_before(0, a),
                    Ok(k) if d.get(k).is_some_and(|&n| n > 0) => cx.in_numel(0) / d[k] as f64,
                    _ => 0.0,
                };
                Work::flops($flops * cx.out_numel(0)).map(|w| Work { parallel: Some(rows), ..w })
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                Ok(vec![softmax_like($kind, self.axis, cx.req(0)?, cx.opset)?])
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                cx.same_as_input();
                Some(())
            }

            fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
                match $kind {
                    Kind::Hardmax => Some(Ok(())),
                    k => Some(softmax_grad(cx, self.axis, k == Kind::LogSoftmax)),
                }
            }
        }
    )*};
}

softmax! {
    Softmax: Kind::Softmax, 3.0 + TRANSCENDENTAL_FLOPS;
    LogSoftmax: Kind::LogSoftmax, 3.0 + TRANSCENDENTAL_FLOPS;
    Hardmax: Kind::Hardmax, 0.0;
}

/// Softmax, LogSoftmax, Hardmax along `axis` (opset ≥ 13), or over the flattened dims from
/// `axis` on (older opsets).
fn softmax_like(kind: Kind, attr: Option<i64>, x: &Array, opset: i64) -> Result<Array, EvalError> {
    let (legacy, a) = axis(attr, opset);
    let ax = norm_axis(a, x.rank())?;
    let (outer, n, inner) = if legacy {
        (x.shape[..ax].iter().product::<usize>(), x.shape[ax..].iter().product::<usize>(), 1)
    } else {
        (x.shape[..ax].iter().product(), x.shape[ax], x.shape[ax + 1..].iter().product())
    };
    let v = x.to_f64()?;
    let mut out = vec![0.0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            let mx = (0..n).map(|j| v[at(j)]).fold(f64::NEG_INFINITY, f64::max);
            if kind == Kind::Hardmax {
                if let Some(best) = (0..n).find(|&j| v[at(j)] == mx) {
                    out[at(best)] = 1.0;
                }
                continue;
            }
            let sum: f64 = (0..n).map(|j| (v[at(j)] - mx).exp()).sum();
            for j in 0..n {
                out[at(j)] =
                    if kind == Kind::LogSoftmax { v[at(j)] - mx - sum.ln() } else { (v[at(j)] - mx).exp() / sum };
            }
        }
    }
    Ok(Array::float(x.dtype, x.shape.clone(), out))
}

/// The normalized axes of a softmax over a rank-`r` tensor.
fn stat_axes(attr: Option<i64>, opset: i64, r: usize) -> Result<Vec<usize>, String> {
    let (legacy, a) = axis(attr, opset);
    let a = norm_axis(a, r)?;
    Ok(if legacy { (a..r).collect() } else { vec![a] })
}

fn softmax_grad(cx: &mut GradCx<'_>, attr: Option<i64>, log: bool) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let y = cx.y(0);
    let r = cx.dims(y)?.len();
    let axes: Vec<i64> = stat_axes(attr, cx.g.opset, r)?.into_iter().map(|a| a as i64).collect();
    let d = cx.add1(Op::SoftmaxGrad(op::SoftmaxGrad { axes: Some(axes), log: Some(i64::from(log)) }), &[y, dy])?;
    cx.set(0, d);
    Ok(())
}

impl OpRules for op::SoftmaxGrad {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![cx.input(1).cloned()])
    }

    fn sharded(&self) -> Sharded {
        Sharded::Local
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.out_dims(0).len();
        let axes: Vec<usize> =
            self.axes.clone().unwrap_or_default().iter().filter_map(|&a| norm_axis(a, r).ok()).collect();
        Some(pointwise(cx, &axes, &[], 0))
    }

    /// One invocation per row (the elements outside the normalized axes).
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let d = cx.out_dims(0);
        let axes: Vec<usize> =
            self.axes.clone().unwrap_or_default().iter().filter_map(|&a| norm_axis(a, d.len()).ok()).collect();
        let len: i64 = axes.iter().filter_map(|&a| d.get(a)).product();
        let rows = if len > 0 { cx.out_numel(0) / len as f64 } else { 0.0 };
        Work::flops(4.0 * cx.out_numel(0)).map(|w| Work { parallel: Some(rows), ..w })
    }

    /// Softmax: `dX = Y·(dY − Σ dY·Y)`; log-softmax: `dX = dY − exp(Y)·Σ dY`, sums over the
    /// normalized axes.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (y, dy) = (cx.req(0)?, cx.req(1)?);
        if dy.shape != y.shape {
            return Err(EvalError::Invalid(format!("SoftmaxGrad: dy {:?} for y {:?}", dy.shape, y.shape)));
        }
        let r = y.rank();
        let axes: Vec<usize> = self
            .axes
            .clone()
            .unwrap_or_else(|| vec![-1])
            .iter()
            .map(|&a| norm_axis(a, r))
            .collect::<Result<_, String>>()?;
        let (lo, hi) = (*axes.iter().min().unwrap_or(&0), *axes.iter().max().unwrap_or(&0));
        if hi + 1 - lo != axes.len() {
            return Err(EvalError::Unsupported("SoftmaxGrad over non-adjacent axes".into()));
        }
        let outer: usize = y.shape[..lo].iter().product();
        let n: usize = y.shape[lo..=hi].iter().product();
        let inner: usize = y.shape[hi + 1..].iter().product();
        let (yv, dv) = (y.to_f64()?, dy.to_f64()?);
        let log = self.log() != 0;
        let mut out = vec![0.0; yv.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: usize| (o * n + j) * inner + i;
                let s: f64 = (0..n).map(|j| if log { dv[at(j)] } else { dv[at(j)] * yv[at(j)] }).sum();
                for j in 0..n {
                    out[at(j)] = if log { dv[at(j)] - yv[at(j)].exp() * s } else { yv[at(j)] * (dv[at(j)] - s) };
                }
            }
        }
        Ok(vec![Array::float(dy.dtype, dy.shape.clone(), out)])
    }
}
