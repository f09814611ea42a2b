//! The softmax family: `Softmax`, `LogSoftmax` and `Hardmax` along an axis (opset 13+) or
//! over the flattened dims from the axis on (older opsets).
//!
//! The normalized axis is a `Statistic` dim (a split needs the row maximum and sum
//! all-reduced); Hardmax's axis stays whole.

use super::util::norm_axis;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::cost::TRANSCENDENTAL_FLOPS;
use crate::eval::{Array, EvalError};
use crate::op;
use crate::shard::{IterSpace, pointwise};

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

            fn infer(&self, cx: &InferCx<'_>) -> Types {
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

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops($flops * cx.out_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                Ok(vec![softmax_like($kind, self.axis, cx.req(0)?, cx.opset)?])
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                cx.same_as_input();
                Some(())
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
                let best = (0..n).find(|&j| v[at(j)] == mx).unwrap_or(0);
                out[at(best)] = 1.0;
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
