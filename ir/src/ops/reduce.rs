//! Reductions: `ReduceSum`, `ReduceMean`, `ReduceMax`, `ReduceMin`, `ReduceProd`,
//! `ReduceL1`, `ReduceL2`, `ReduceLogSum`, `ReduceLogSumExp`, `ReduceSumSquare` (axes as an
//! attribute or, in newer opsets, an input), and `ArgMax`/`ArgMin`.
//!
//! Kept dims are parallel; reduced dims of a sum or mean are reductions (a split leaves
//! partial sums), those of the others stay whole.

use super::grad::GradCx;
use super::util::{norm_axes, norm_axis};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, Mono, NodeCx, OpRules, Types, Work};
use crate::array::{Array, Data, EvalError, numel, strides};
use crate::graph::op;
use crate::layout::{DimKind, DimRole, IterDim, IterSpace};
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// The iteration space of a reduction of input 0 over `axes`.
/// Whether `op` is a reduction whose value over a single element is that element (sum, mean,
/// max, min, product).
pub fn keeps_single_elements(op: &crate::Op) -> bool {
    use crate::Op;
    matches!(op, Op::ReduceSum(_) | Op::ReduceMean(_) | Op::ReduceMax(_) | Op::ReduceMin(_) | Op::ReduceProd(_))
}

/// The axes node `n` reduces when it is a reduction that leaves a single element as it is
/// (sum, mean, max, min, product — not the norms, the sum of squares or the logarithms) and
/// its axes are known: over axes of extent 1 such a reduction is a view of its input, which the
/// runtime's kernels make it and the cost model prices it as (nothing). `None` otherwise.
pub fn single_element_axes(g: &crate::Graph, n: crate::NodeId) -> Option<Vec<usize>> {
    use crate::Op;
    let node = g.node(n);
    let (attr, noop) = match &node.op {
        Op::ReduceSum(r) => (&r.axes, r.noop_with_empty_axes()),
        Op::ReduceMean(r) => (&r.axes, r.noop_with_empty_axes()),
        Op::ReduceMax(r) => (&r.axes, r.noop_with_empty_axes()),
        Op::ReduceMin(r) => (&r.axes, r.noop_with_empty_axes()),
        Op::ReduceProd(r) => (&r.axes, r.noop_with_empty_axes()),
        _ => return None,
    };
    debug_assert!(keeps_single_elements(&node.op));
    let cx = NodeCx { g, n };
    let rank = cx.ty(cx.input(0))?.rank()?;
    let list = match node.input(1) {
        // An initializer, or a `Constant` holding the tensor.
        Some(v) => cx.const_ints(1).or_else(|| match &g.node(v.node).op {
            Op::Constant(c) => c.value.as_ref().and_then(|t| t.to_i64_vec()),
            _ => None,
        })?,
        None => attr.clone().unwrap_or_default(),
    };
    if list.is_empty() {
        return Some(if noop != 0 { vec![] } else { (0..rank).collect() });
    }
    list.iter().map(|&a| norm_axis(a, rank).ok()).collect()
}

fn reduce_space(cx: &NodeCx<'_>, axes: &[usize], keep: bool, sum_like: bool) -> IterSpace {
    let x = cx.in_dims(0);
    let sd: Vec<IterDim> = x
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let kind = if !axes.contains(&i) {
                DimKind::Parallel
            } else if sum_like {
                DimKind::Reduction
            } else {
                DimKind::Fixed
            };
            IterDim { name: format!("d{i}"), size: s, kind, role: DimRole::Other }
        })
        .collect();
    let xm: Vec<Option<usize>> = (0..x.len()).map(Some).collect();
    let om: Vec<Option<usize>> = if keep {
        (0..x.len()).map(|i| (!axes.contains(&i)).then_some(i)).collect()
    } else {
        (0..x.len()).filter(|i| !axes.contains(i)).map(Some).collect()
    };
    let g = cx.g.node(cx.n);
    IterSpace {
        dims: sd,
        inputs: g
            .inputs()
            .iter()
            .enumerate()
            .map(|(j, i)| i.map(|v| if j == 0 { xm.clone() } else { vec![None; cx.rank(v)] }))
            .collect(),
        outputs: vec![om],
    }
}

/// Changed dims through a reduction: kept axes follow the input (matched in order by old
/// size when the rank drops).
fn reduce_flow(cx: &mut FlowCx<'_>) -> Option<()> {
    let xm = cx.in_m(0)?;
    let out_old = cx.out_old();
    let keep_rank = out_old.len() == xm.len();
    let mut m = Vec::new();
    let xo = cx.in_old(0).unwrap_or_default();
    if keep_rank {
        for i in 0..xm.len() {
            m.push(if out_old[i] == xo[i] { xm[i].clone() } else { Mono::constant(out_old[i]) });
        }
    } else {
        let mut j = 0;
        for i in 0..xm.len() {
            if j < out_old.len() && xo[i] == out_old[j] && m.len() < out_old.len() {
                // Ambiguous when a reduced axis equals a kept one; prefer keeping.
                m.push(xm[i].clone());
                j += 1;
            }
        }
        if m.len() != out_old.len() {
            m = out_old.iter().map(|&v| Mono::constant(v)).collect();
        }
    }
    cx.set(0, m);
    Some(())
}

/// The `Reduce*` ops: `Name: kind, sum-like (splits into partial sums)`.
macro_rules! reductions {
    ($($name:ident: $kind:expr, $sum:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::new(1, 2, 1, 1)
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                let (keep, noop) = (self.keepdims() != 0, self.noop_with_empty_axes() != 0);
                let Some(d) = cx.dims(0) else { return cx.one(None) };
                let axes = if cx.has(1) {
                    match cx.ints(1) {
                        Some(a) => a,
                        // Axes unknown: the rank is known only with keepdims.
                        None => return cx.one(keep.then(|| vec![Dim::Unknown; d.len()])),
                    }
                } else {
                    self.axes.clone().unwrap_or_default()
                };
                if axes.is_empty() && noop {
                    return cx.same();
                }
                let axes: Vec<usize> = if axes.is_empty() { (0..d.len()).collect() } else { norm_axes(&axes, d.len())? };
                let out = if keep {
                    d.iter().enumerate().map(|(i, v)| if axes.contains(&i) { Dim::Fixed(1) } else { v.clone() }).collect()
                } else {
                    d.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, v)| v.clone()).collect()
                };
                cx.one(Some(out))
            }

            fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
                let r = cx.in_dims(0).len();
                let ax = match cx.const_ints(1) {
                    Some(v) if cx.input(1).is_some() => v,
                    _ => self.axes.clone().unwrap_or_default(),
                };
                let axes = if ax.is_empty() { Ok((0..r).collect()) } else { norm_axes(&ax, r) };
                let Ok(axes) = axes else { return Some(IterSpace::whole(cx)) };
                Some(reduce_space(cx, &axes, self.keepdims() != 0, $sum))
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops(cx.in_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let x = cx.req(0)?;
                let axes: Vec<i64> = match (cx.opt(1), &self.axes) {
                    (Some(a), _) => a.to_i64()?,
                    (None, Some(a)) => a.clone(),
                    (None, None) => vec![],
                };
                if axes.is_empty() && self.noop_with_empty_axes() != 0 {
                    return Ok(vec![x.clone()]);
                }
                let axes = if axes.is_empty() { (0..x.rank()).collect() } else { norm_axes(&axes, x.rank())? };
                Ok(vec![reduce(x, &axes, self.keepdims() != 0, $kind)?])
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                reduce_flow(cx)
            }

            fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
                let axes = self.axes.clone();
                let (keep, noop) = (self.keepdims() != 0, self.noop_with_empty_axes() != 0);
                Some(reduce_grad(cx, $kind, axes, keep, noop))
            }
        }
    )*};
}

reductions! {
    ReduceSum: Red::Sum, true;
    ReduceMean: Red::Mean, true;
    ReduceMax: Red::Max, false;
    ReduceMin: Red::Min, false;
    ReduceProd: Red::Prod, false;
    ReduceL1: Red::L1, false;
    ReduceL2: Red::L2, false;
    ReduceLogSum: Red::LogSum, false;
    ReduceLogSumExp: Red::LogSumExp, false;
    ReduceSumSquare: Red::SumSquare, false;
}

/// `ArgMax` and `ArgMin`: `Name: max?`.
macro_rules! arg {
    ($($name:ident: $max:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(1)
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                let keep = self.keepdims() != 0;
                let dims = cx
                    .dims(0)
                    .map(|d| -> std::result::Result<Vec<Dim>, String> {
                        let ax = norm_axis(self.axis(), d.len())?;
                        let mut o = d.clone();
                        if keep {
                            o[ax] = Dim::Fixed(1);
                        } else {
                            o.remove(ax);
                        }
                        Ok(o)
                    })
                    .transpose()?;
                Ok(vec![Some(TensorType { dtype: DType::Int64, dims })])
            }

            fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
                let Ok(a) = norm_axis(self.axis(), cx.in_dims(0).len()) else { return Some(IterSpace::whole(cx)) };
                Some(reduce_space(cx, &[a], self.keepdims() != 0, false))
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops(cx.in_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let x = cx.req(0)?;
                Ok(vec![arg_extreme(x, self.axis(), self.keepdims() != 0, self.select_last_index() != 0, $max)?])
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                reduce_flow(cx)
            }
        }
    )*};
}

arg! {
    ArgMax: true;
    ArgMin: false;
}

#[derive(Copy, Clone, PartialEq)]
enum Red {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    LogSum,
    LogSumExp,
    SumSquare,
}

/// Reduces `x` over `axes` (empty = all unless `noop`).
fn reduce(x: &Array, axes: &[usize], keepdims: bool, k: Red) -> Result<Array> {
    let rank = x.rank();
    let reduced: Vec<bool> = (0..rank).map(|d| axes.contains(&d)).collect();
    let out_full: Vec<usize> = (0..rank).map(|d| if reduced[d] { 1 } else { x.shape[d] }).collect();
    let out_shape: Vec<usize> =
        if keepdims { out_full.clone() } else { (0..rank).filter(|&d| !reduced[d]).map(|d| x.shape[d]).collect() };
    let n_out = numel(&out_full);
    let ostr = strides(&out_full);
    let istr = strides(&x.shape);
    let count = (0..rank).filter(|&d| reduced[d]).map(|d| x.shape[d]).product::<usize>();
    let target = |flat: usize| -> usize {
        let mut o = 0;
        for d in 0..rank {
            let i = (flat / istr[d]) % x.shape[d].max(1);
            if !reduced[d] {
                o += i * ostr[d];
            }
        }
        o
    };
    let is_int = matches!(x.data, Data::I64(_));
    let vals = x.to_f64()?;
    let init = match k {
        Red::Max => f64::NEG_INFINITY,
        Red::Min => f64::INFINITY,
        Red::Prod => 1.0,
        _ => 0.0,
    };
    let mut acc = vec![init; n_out];
    // LogSumExp needs the max for stability.
    let mut mx = vec![f64::NEG_INFINITY; n_out];
    if k == Red::LogSumExp {
        for (i, &v) in vals.iter().enumerate() {
            let t = target(i);
            mx[t] = mx[t].max(v);
        }
    }
    for (i, &v) in vals.iter().enumerate() {
        let t = target(i);
        let a = &mut acc[t];
        match k {
            Red::Sum | Red::Mean => *a += v,
            Red::Max => *a = if v.is_nan() || a.is_nan() { f64::NAN } else { a.max(v) },
            Red::Min => *a = if v.is_nan() || a.is_nan() { f64::NAN } else { a.min(v) },
            Red::Prod => *a *= v,
            Red::L1 => *a += v.abs(),
            Red::L2 | Red::SumSquare => *a += v * v,
            Red::LogSum => *a += v,
            Red::LogSumExp => *a += (v - mx[t]).exp(),
        }
    }
    for (t, a) in acc.iter_mut().enumerate() {
        *a = match k {
            Red::Mean => *a / count.max(1) as f64,
            Red::L2 => a.sqrt(),
            Red::LogSum => a.ln(),
            Red::LogSumExp => a.ln() + mx[t],
            _ => *a,
        };
    }
    if x.dtype == DType::Bool {
        // An empty max is false, an empty min true (the infinities the reduction starts from).
        Ok(Array::bool(out_shape, acc.iter().map(|&a| a > 0.5).collect()))
    } else if is_int {
        // An empty max or min is the type's least or greatest value.
        let (lo, hi) = int_range(x.dtype);
        Ok(Array::int(x.dtype, out_shape, acc.iter().map(|&a| a.clamp(lo as f64, hi as f64) as i64).collect()))
    } else {
        Ok(Array::float(x.dtype, out_shape, acc))
    }
}

/// The least and greatest values of an integer type.
fn int_range(d: DType) -> (i64, i64) {
    match d {
        DType::Int8 => (i8::MIN.into(), i8::MAX.into()),
        DType::Uint8 => (0, u8::MAX.into()),
        DType::Int16 => (i16::MIN.into(), i16::MAX.into()),
        DType::Uint16 => (0, u16::MAX.into()),
        DType::Int32 => (i32::MIN.into(), i32::MAX.into()),
        DType::Uint32 => (0, u32::MAX.into()),
        DType::Uint64 => (0, i64::MAX),
        _ => (i64::MIN, i64::MAX),
    }
}

fn arg_extreme(x: &Array, ax: i64, keepdims: bool, last: bool, max: bool) -> Result<Array> {
    let ax = norm_axis(ax, x.rank())?;
    let vals = x.to_f64()?;
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut best = 0usize;
            for j in 0..n {
                let v = vals[(o * n + j) * inner + i];
                let b = vals[(o * n + best) * inner + i];
                let better = if max { v > b || (last && v == b) } else { v < b || (last && v == b) };
                if better {
                    best = j;
                }
            }
            out.push(best as i64);
        }
    }
    let mut shape = x.shape.clone();
    if keepdims {
        shape[ax] = 1;
    } else {
        shape.remove(ax);
    }
    Ok(Array::i64(shape, out))
}

/// The gradient of a reduction: dY with the reduced axes restored (as 1s) and broadcast
/// back, times the derivative of the reduction at each element.
fn reduce_grad(
    cx: &mut GradCx<'_>,
    kind: Red,
    attr_axes: Option<Vec<i64>>,
    keep: bool,
    noop: bool,
) -> std::result::Result<(), String> {
    use crate::graph::op::Op;
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let xd = cx.dims(x)?;
    let axes = match cx.x_opt(1) {
        Some(v) => cx.const_ints(Some(v)).ok_or("a reduction over computed axes")?,
        None => attr_axes.unwrap_or_default(),
    };
    if axes.is_empty() && noop {
        cx.set(0, dy);
        return Ok(());
    }
    let axes = if axes.is_empty() { (0..xd.len()).collect() } else { norm_axes(&axes, xd.len())? };
    let kept: Vec<i64> = xd.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let dyk = cx.reshape(dy, &kept)?;
    let y = cx.y(0);
    let yk = if keep { y } else { cx.reshape(y, &kept)? };
    let count: i64 = axes.iter().map(|&a| xd[a]).product();
    let d = match kind {
        Red::Sum => cx.expand(dyk, &xd)?,
        Red::Mean => {
            let e = cx.expand(dyk, &xd)?;
            cx.scale(e, 1.0 / count.max(1) as f64)?
        }
        Red::Max | Red::Min => {
            // To the elements equal to the extremum.
            let eq = cx.add1(Op::Equal(op::Equal::default()), &[x, yk])?;
            let e = cx.expand(dyk, &xd)?;
            let z = cx.scalar(cx.dtype(dy), 0.0);
            cx.where_(eq, e, z)?
        }
        Red::LogSumExp => {
            // exp(x − y).
            let t = cx.sub(x, yk)?;
            let t = cx.add1(Op::Exp(op::Exp::default()), &[t])?;
            cx.mul(t, dyk)?
        }
        Red::SumSquare => {
            let t = cx.scale(x, 2.0)?;
            cx.mul(t, dyk)?
        }
        Red::L2 => {
            let t = cx.div(x, yk)?;
            cx.mul(t, dyk)?
        }
        Red::L1 => {
            let t = cx.add1(Op::Sign(op::Sign::default()), &[x])?;
            cx.mul(t, dyk)?
        }
        Red::LogSum => {
            // 1 / Σx.
            let s = cx.add1(Op::Exp(op::Exp::default()), &[yk])?;
            let t = cx.div(dyk, s)?;
            cx.expand(t, &xd)?
        }
        Red::Prod => {
            let t = cx.div(yk, x)?;
            cx.mul(t, dyk)?
        }
    };
    let d = cx.expand(d, &xd)?;
    cx.set(0, d);
    Ok(())
}
