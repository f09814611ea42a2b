//! Normalizations: batch, instance, layer and group normalization, LRN, Lp normalization and
//! mean-variance normalization.
//!
//! Their iteration space is the input's dims; the dims statistics are computed over are
//! `Statistic` dims (splitting one needs a small all-reduce of the statistics), LRN's window
//! over channels and group normalization's channels stay whole.

use super::flow::flow_positional;
use super::grad::GradCx;
use super::util::{broadcast_index, broadcast_shapes, broadcast_walk, norm_axes, norm_axis};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, Mono, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, EvalError, strides};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterSpace};
use crate::ops::space::pointwise;
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// Normalization work: 8 FLOPs per input element.
fn norm_work(cx: &NodeCx<'_>) -> Option<Work> {
    Work::flops(8.0 * cx.in_numel(0))
}

/// Batch-like normalizations (statistics over the spatial dims, parameters per channel).
fn per_channel_space(cx: &NodeCx<'_>, fixed_channels: bool) -> IterSpace {
    let r = cx.out_dims(0).len();
    let stat: Vec<usize> = (2..r).collect();
    let fixed: Vec<usize> = if fixed_channels { vec![1] } else { vec![] };
    let mut sp = pointwise(cx, &fixed, &stat, 2);
    // Per-channel parameters follow the channel dim.
    for k in 1..cx.n_in() {
        if let Some(Some(m)) = sp.inputs.get_mut(k) {
            *m = vec![(r > 1).then_some(1)];
        }
    }
    for s in 1..cx.n_out() {
        sp.outputs[s] = vec![(r > 1).then_some(1)];
    }
    if let Some(d) = sp.dims.get_mut(1) {
        d.role = DimRole::Other;
    }
    sp
}

impl OpRules for op::BatchNormalization {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(batch_norm_grad(self, cx))
    }

    /// The input, scale and bias; the running statistics (inputs 3, 4) are state, as in torch.
    fn differentiates(&self, i: usize) -> bool {
        i < 3
    }

    fn grad_kernel(&self) -> Option<&'static str> {
        Some("BatchNormGrad")
    }

    /// Inference mode normalizes with the stored running statistics; training mode computes
    /// them over the batch and spatial dims (synchronized across a split).
    fn sharded(&self) -> Sharded {
        if self.training_mode() == 0 { Sharded::StoredStatistics } else { Sharded::BatchNorm }
    }

    fn arity(&self) -> Arity {
        Arity::new(5, 5, 1, 3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let c = cx.dims(0).and_then(|d| d.get(1).cloned()).unwrap_or(Dim::Unknown);
        let mut out = vec![cx.input(0).cloned()];
        for _ in 1..cx.n_out {
            out.push(cx.with(cx.dtype(), Some(vec![c.clone()])));
        }
        Ok(out)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let mut sp = per_channel_space(cx, false);
        if self.training_mode() != 0
            && let Some(d) = sp.dims.first_mut()
        {
            d.kind = DimKind::Statistic { values: 2 };
        }
        Some(sp)
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        // Training mode: the batch's statistics per channel, then the normalization.
        let launches = if self.training_mode() != 0 { 2.0 } else { 1.0 };
        norm_work(cx).map(|w| Work { launches, ..w })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        batch_norm(self, cx, cx.n_out)
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let ins = cx.inputs();
        let out_old = cx.out_old();
        let m = cx.broadcast(&ins[..1.min(ins.len())], &out_old);
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::InstanceNormalization {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(grouped_norm_grad(cx, None, false, self.epsilon))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(per_channel_space(cx, false))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        norm_work(cx)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let c = *x.shape.get(1).ok_or_else(|| EvalError::Invalid(format!("{} needs X [N, C, …]", cx.name)))?;
        let s = channel_params(cx.req(1)?, c, "scale")?;
        let b = channel_params(cx.req(2)?, c, "bias")?;
        Ok(vec![group_like_norm(x, c, &s, &b, f64::from(self.epsilon()), false)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

impl OpRules for op::GroupNormalization {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        let groups = self.num_groups.unwrap_or(1);
        // Opset 18's scale and bias are per group; opset 21's per channel (as the evaluator reads them).
        let per_group = cx.x(1).and_then(|s| cx.dims(s)).map(|d| d.iter().product::<i64>() == groups).unwrap_or(false)
            && cx.x(0).and_then(|x| cx.dims(x)).map(|d| d.get(1) != Some(&groups)).unwrap_or(false);
        Some(grouped_norm_grad(cx, Some(groups), per_group, self.epsilon))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(per_channel_space(cx, true))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        norm_work(cx)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let groups = self.num_groups.unwrap_or(1) as usize;
        let s = cx.req(1)?.to_f64()?;
        let b = cx.req(2)?.to_f64()?;
        let per_group = s.len() == groups && groups != x.shape[1];
        Ok(vec![group_like_norm(x, groups, &s, &b, f64::from(self.epsilon()), per_group)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

impl OpRules for op::LayerNormalization {
    fn grad_kernel(&self) -> Option<&'static str> {
        Some("LayerNormGrad")
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(layer_norm_grad(self, cx))
    }

    fn sharded(&self) -> Sharded {
        Sharded::LayerNorm
    }

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let mut out = vec![cx.input(0).cloned()];
        if cx.n_out > 1 {
            let stat = cx
                .dims(0)
                .map(|d| -> std::result::Result<Vec<Dim>, String> {
                    let a = norm_axis(self.axis(), d.len())?;
                    Ok((0..d.len()).map(|i| if i < a { d[i].clone() } else { Dim::Fixed(1) }).collect())
                })
                .transpose()?;
            // The statistics are of the stash type (float unless it says otherwise).
            let dtype = DType::from_code(self.stash_type()).filter(|d| d.is_float()).unwrap_or(DType::Float);
            for _ in 1..cx.n_out {
                out.push(Some(TensorType { dtype, dims: stat.clone() }));
            }
        }
        Ok(out)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let out = cx.out_dims(0);
        let r = out.len();
        let Ok(a) = norm_axis(self.axis(), r) else { return Some(IterSpace::whole(cx)) };
        let mut sp = pointwise(cx, &[], &(a..r).collect::<Vec<_>>(), 2);
        // Mean and InvStdDev outputs keep dims before the axis.
        for s in 1..cx.n_out() {
            sp.outputs[s] = (0..r).map(|i| (i < a && out[i] != 1).then_some(i)).collect();
        }
        // Scale and bias cover the normalized dims.
        for k in 1..3 {
            if let Some(Some(m)) = sp.inputs.get_mut(k) {
                m.iter_mut().for_each(|x| *x = None);
            }
        }
        Some(sp)
    }

    /// One invocation per row (the dims before `axis`).
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let rows = cx.rows_before(0, self.axis());
        norm_work(cx).map(|w| Work { parallel: Some(rows), ..w })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        layer_norm(self, cx, cx.n_out)
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let ins = cx.inputs();
        let out_old = cx.out_old();
        let m = cx.broadcast(&ins[..1.min(ins.len())], &out_old);
        cx.set(0, m.clone());
        let r = m.len() as i64;
        let a = if self.axis() < 0 { self.axis() + r } else { self.axis() } as usize;
        let stat: Vec<Mono> = (0..m.len()).map(|i| if i < a { m[i].clone() } else { Mono::constant(1) }).collect();
        for s in 1..cx.n_out() {
            cx.set(s, stat.clone());
        }
        Some(())
    }
}

impl OpRules for op::LRN {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(pointwise(cx, &[1], &[], 0))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.in_numel(0) * (2.0 * self.size.unwrap_or(1) as f64 + crate::ops::TRANSCENDENTAL_FLOPS))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![lrn(self, cx.req(0)?)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }

    /// `Y = X · s^−β` with `s = bias + α/size · F·X²`, `F` the channel window (`[c − ⌊(size−1)/2⌋,
    /// c + ⌈(size−1)/2⌉]`, clipped) as a `[C, C]` 0/1 matrix: `dX = dY · s^−β − 2αβ/size · X ·
    /// Fᵀ·(dY · Y / s)`, `s` recomputed from `X`; the window sums are contractions of the
    /// channel axis with `F` ([`GradCx::contract_axes`]).
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let dims = cx.dims(x)?;
            if dims.len() < 2 || dims[1] < 0 {
                return Err(format!("LRN of shape {dims:?}: needs [N, C, …] with C known"));
            }
            let c = dims[1] as usize;
            let size = self.size.unwrap_or(1).max(1) as usize;
            let (alpha, beta, bias) = (f64::from(self.alpha()), f64::from(self.beta()), f64::from(self.bias()));
            let (lo, hi) = ((size - 1) / 2, size - 1 - (size - 1) / 2);
            // F[m][l] = 1 where channel l is in channel m's window, and its transpose.
            let f: Vec<f64> =
                (0..c * c).map(|i| if i % c + lo >= i / c && i % c <= i / c + hi { 1.0 } else { 0.0 }).collect();
            let ft: Vec<f64> = (0..c * c).map(|i| f[(i % c) * c + i / c]).collect();
            let dt = cx.dtype(x);
            let sq = cx.mul(x, x)?;
            let window = cx.contract_axes(sq, dt, vec![(1, c, c, ft)])?;
            let scaled = cx.scale(window, alpha / size as f64)?;
            let b = cx.scalar(dt, bias);
            let s = cx.add2(scaled, b)?;
            let nb = cx.scalar(dt, -beta);
            let pw = cx.add1(Op::Pow(op::Pow::default()), &[s, nb])?;
            let direct = cx.mul(dy, pw)?;
            let dyy = cx.mul(dy, cx.y(0))?;
            let u = cx.div(dyy, s)?;
            let back = cx.contract_axes(u, dt, vec![(1, c, c, f)])?;
            let xb = cx.mul(x, back)?;
            let through = cx.scale(xb, -2.0 * alpha * beta / size as f64)?;
            let dx = cx.add2(direct, through)?;
            cx.set(0, dx);
            Ok(())
        })())
    }
}

impl OpRules for op::LpNormalization {
    /// `Y = X / ‖X‖_p` along the axis: `dX = (dY − g·Σ(dY·Y)) / ‖X‖_p` with `g = Y` (p = 2)
    /// or `sign(X)` (p = 1); where the norm is 0 (and `Y` is 0) it is taken as 1.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let r = cx.dims(x)?.len();
            let axis = norm_axis(self.axis(), r)? as i64;
            let y = cx.y(0);
            let dyy = cx.mul(dy, y)?;
            let s = cx.reduce_sum(dyy, &[axis], true)?;
            let (g, norm) = if self.p() == 1 {
                let ax = cx.add1(Op::Abs(op::Abs::default()), &[x])?;
                (cx.add1(Op::Sign(op::Sign::default()), &[x])?, cx.reduce_sum(ax, &[axis], true)?)
            } else {
                let sq = cx.mul(x, x)?;
                let ss = cx.reduce_sum(sq, &[axis], true)?;
                (y, cx.add1(Op::Sqrt(op::Sqrt::default()), &[ss])?)
            };
            let zero = cx.scalar(cx.dtype(x), 0.0);
            let one = cx.scalar(cx.dtype(x), 1.0);
            let is_zero = cx.add1(Op::Equal(op::Equal::default()), &[norm, zero])?;
            let norm = cx.where_(is_zero, one, norm)?;
            let gs = cx.mul(g, s)?;
            let t = cx.sub(dy, gs)?;
            let dx = cx.div(t, norm)?;
            cx.set(0, dx);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.out_dims(0).len();
        let Ok(a) = norm_axis(self.axis(), r) else { return Some(IterSpace::whole(cx)) };
        Some(pointwise(cx, &[], &[a], 1))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        norm_work(cx)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let a = norm_axis(self.axis(), x.rank())?;
        let v = x.to_f64()?;
        let outer: usize = x.shape[..a].iter().product();
        let n = x.shape[a];
        let inner: usize = x.shape[a + 1..].iter().product();
        let mut out = v.clone();
        for o in 0..outer {
            for i in 0..inner {
                let norm: f64 = if self.p() == 1 {
                    (0..n).map(|j| v[(o * n + j) * inner + i].abs()).sum()
                } else {
                    (0..n).map(|j| v[(o * n + j) * inner + i].powi(2)).sum::<f64>().sqrt()
                };
                for j in 0..n {
                    out[(o * n + j) * inner + i] = if norm == 0.0 { 0.0 } else { v[(o * n + j) * inner + i] / norm };
                }
            }
        }
        Ok(vec![Array::float(x.dtype, x.shape.clone(), out)])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

impl OpRules for op::MeanVarianceNormalization {
    /// `Y = (X − μ) / (σ + ε)` over the axes (ε = 1e-9, as evaluated): with `N` elements per
    /// statistic, `dX = (dY − mean(dY)) / (σ + ε) − mean(dY·Y) · Y / σ`.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let dims = cx.dims(x)?;
            let axes: Vec<i64> = norm_axes(&self.axes.clone().unwrap_or_else(|| vec![0, 2, 3]), dims.len())?
                .into_iter()
                .map(|a| a as i64)
                .collect();
            let n: i64 = axes.iter().map(|&a| dims[a as usize]).product();
            let mean = |cx: &mut GradCx<'_>, v: Value| -> std::result::Result<Value, String> {
                let s = cx.reduce_sum(v, &axes, true)?;
                cx.scale(s, 1.0 / n.max(1) as f64)
            };
            let y = cx.y(0);
            let mu = mean(cx, x)?;
            let c = cx.sub(x, mu)?;
            let c2 = cx.mul(c, c)?;
            let var = mean(cx, c2)?;
            let sigma = cx.add1(Op::Sqrt(op::Sqrt::default()), &[var])?;
            let eps = cx.scalar(cx.dtype(x), 1e-9);
            let s = cx.add2(sigma, eps)?;
            let mdy = mean(cx, dy)?;
            let centered = cx.sub(dy, mdy)?;
            let first = cx.div(centered, s)?;
            let dyy = cx.mul(dy, y)?;
            let mdyy = mean(cx, dyy)?;
            let k = cx.mul(mdyy, y)?;
            let second = cx.div(k, sigma)?;
            let dx = cx.sub(first, second)?;
            cx.set(0, dx);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.out_dims(0).len();
        let Ok(axes) = norm_axes(&self.axes.clone().unwrap_or(vec![0, 2, 3]), r) else {
            return Some(IterSpace::whole(cx));
        };
        Some(pointwise(cx, &[], &axes, 2))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        norm_work(cx)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let axes = norm_axes(&self.axes.clone().unwrap_or_else(|| vec![0, 2, 3]), x.rank())?;
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
        Ok(vec![Array::float(x.dtype, x.shape.clone(), out)])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

fn channel_params(a: &Array, c: usize, what: &str) -> Result<Vec<f64>> {
    let v = a.to_f64()?;
    if v.len() != c {
        return Err(EvalError::Invalid(format!("{what} has {} values for {c} channels", v.len())));
    }
    Ok(v)
}

fn batch_norm(b: &op::BatchNormalization, cx: &EvalCx<'_>, n_out: usize) -> Result<Vec<Array>> {
    let x = cx.req(0)?;
    let c = *x.shape.get(1).unwrap_or(&1);
    let scale = channel_params(cx.req(1)?, c, "scale")?;
    let bias = channel_params(cx.req(2)?, c, "bias")?;
    let mut mean = channel_params(cx.req(3)?, c, "mean")?;
    let mut var = channel_params(cx.req(4)?, c, "var")?;
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

fn layer_norm(l: &op::LayerNormalization, cx: &EvalCx<'_>, n_out: usize) -> Result<Vec<Array>> {
    let x = cx.req(0)?;
    let a = norm_axis(l.axis(), x.rank())?;
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
    let scale = expand(cx.req(1)?)?;
    let bias = match cx.opt(2) {
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
    let stash = DType::from_code(l.stash_type()).filter(|d| d.is_float()).unwrap_or(DType::Float);
    if n_out > 1 {
        res.push(Array::float(stash, stat_shape.clone(), means));
    }
    if n_out > 2 {
        res.push(Array::float(stash, stat_shape, inv));
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
    if x.rank() < 2 {
        return Err(EvalError::Invalid(format!("normalization of rank {}: needs [N, C, …]", x.rank())));
    }
    let n = x.shape[0];
    let c = x.shape[1];
    let sp: usize = x.shape[2..].iter().product();
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(EvalError::Invalid(format!("{c} channels do not split into {groups} groups")));
    }
    let params = if per_group_params { groups } else { c };
    if scale.len() < params || bias.len() < params {
        return Err(EvalError::Invalid(format!(
            "{} scales and {} biases for {params} channels or groups",
            scale.len(),
            bias.len()
        )));
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
    if x.rank() < 2 {
        return Err(EvalError::Invalid(format!("LRN of rank {}: needs [N, C, …]", x.rank())));
    }
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

// ---- gradients ----

fn batch_norm_grad(b: &op::BatchNormalization, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    if cx.dy(1).is_some() || cx.dy(2).is_some() {
        return Err("a gradient through the running statistics is not supported".into());
    }
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let ins: Vec<Option<Value>> = vec![Some(cx.x(0)?), Some(cx.x(1)?), Some(cx.x(3)?), Some(cx.x(4)?), Some(dy)];
    let op = Op::BatchNormGrad(op::BatchNormGrad { epsilon: b.epsilon, training_mode: Some(b.training_mode()) });
    let d = cx.add(op, &ins, 3)?;
    cx.set(0, d[0]);
    cx.set(1, d[1]);
    cx.set(2, d[2]);
    Ok(())
}

fn layer_norm_grad(l: &op::LayerNormalization, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let x = cx.x(0)?;
    let dims = cx.dims(x)?;
    let r = dims.len();
    let axis = norm_axis(l.axis(), r)? as i64;
    let mut dx = None;
    if let Some(dy) = cx.dy(0) {
        let op = Op::LayerNormGrad(op::LayerNormGrad { axis: Some(axis), epsilon: l.epsilon });
        let d = cx.add(op, &[Some(x), Some(cx.x(1)?), Some(dy)], 3)?;
        dx = Some(d[0]);
        for (i, dv) in [(1, d[1]), (2, d[2])] {
            if cx.want(i) {
                let target = cx.dims(cx.x(i)?)?;
                let t = cx.sum_to(dv, &target)?;
                cx.set(i, t);
            }
        }
    }
    // Through the statistics outputs: d mean/dx = 1/N; d invstd/dx = −invstd³·(x − mean)/N.
    if cx.dy(1).is_some() || cx.dy(2).is_some() {
        let axes: Vec<i64> = (axis..r as i64).collect();
        let n: i64 = dims[axis as usize..].iter().product();
        let mut extra = None;
        if let Some(dm) = cx.dy(1) {
            let e = cx.scale(dm, 1.0 / n as f64)?;
            extra = Some(cx.expand(e, &dims)?);
        }
        if let Some(dr) = cx.dy(2) {
            let s = cx.reduce_sum(x, &axes, true)?;
            let mean = cx.scale(s, 1.0 / n as f64)?;
            let xc = cx.sub(x, mean)?;
            let inv = cx.y(2);
            let i2 = cx.mul(inv, inv)?;
            let i3 = cx.mul(i2, inv)?;
            let k = cx.mul(dr, i3)?;
            let k = cx.scale(k, -1.0 / n as f64)?;
            let e = cx.mul(k, xc)?;
            extra = Some(match extra {
                Some(a) => cx.add2(a, e)?,
                None => e,
            });
        }
        let e = extra.expect("one of the two");
        dx = Some(match dx {
            Some(a) => cx.add2(a, e)?,
            None => e,
        });
    }
    let Some(dx) = dx else { return Ok(()) };
    cx.set(0, dx);
    Ok(())
}

/// The gradient of instance normalization (`groups` `None`: one group per channel) and group
/// normalization: statistics over each group's channels and the spatial dims, per sample.
/// With `X` seen as `[N, G, R]` (`R` = channels per group × spatial elements) they are layer
/// normalization's over the last axis with a unit scale, so the input's gradient is
/// `LayerNormGrad(X_g, 1, (dY·scale)_g)` (`dY·scale` broadcast per channel, or per group);
/// the scale's and bias's are `Σ dY·X̂` and `Σ dY` over the samples and the spatial dims
/// (and a group's channels for per-group parameters), `X̂` the normalized input recomputed
/// by an instance normalization of `X_g` with unit scale and zero bias.
fn grouped_norm_grad(
    cx: &mut GradCx<'_>,
    groups: Option<i64>,
    per_group: bool,
    epsilon: Option<f32>,
) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let x = cx.x(0)?;
    let dims = cx.dims(x)?;
    if dims.len() < 2 {
        return Err(format!("normalization of rank {}: needs [N, C, …]", dims.len()));
    }
    let (n, c) = (dims[0], dims[1]);
    let g = groups.unwrap_or(c);
    if g <= 0 || c % g != 0 {
        return Err(format!("{c} channels do not split into {g} groups"));
    }
    let rest: i64 = dims[1..].iter().product::<i64>() / g;
    let grouped = [n, g, rest];
    let r = dims.len();
    let dt = cx.dtype(x);
    let scale = cx.x(1)?;
    let xg = cx.reshape(x, &grouped)?;
    // Constant tensors, not ops of constants: every pipeline stage holds an initializer.
    let filled =
        |cx: &mut GradCx<'_>, n: i64, v: f64| cx.constant(Array::float(dt, vec![n as usize], vec![v; n as usize]));
    if cx.want(0) {
        // The scale where the gradient meets it: per channel in X's shape, or per group.
        let dy_scaled = if per_group {
            let dyg = cx.reshape(dy, &grouped)?;
            let s = cx.reshape(scale, &[1, g, 1])?;
            cx.mul(dyg, s)?
        } else {
            let mut per_channel = vec![1; r];
            per_channel[1] = c;
            let s = cx.reshape(scale, &per_channel)?;
            let d = cx.mul(dy, s)?;
            cx.reshape(d, &grouped)?
        };
        let ones = filled(cx, rest, 1.0);
        let op = Op::LayerNormGrad(op::LayerNormGrad { axis: Some(2), epsilon });
        let d = cx.add(op, &[Some(xg), Some(ones), Some(dy_scaled)], 3)?;
        let dx = cx.reshape(d[0], &dims)?;
        cx.set(0, dx);
    }
    if cx.want(1) || cx.want(2) {
        // Summed over the samples and the spatial dims (per group: in `[N, G, R]`).
        let (dyp, axes): (Value, Vec<i64>) = if per_group {
            (cx.reshape(dy, &grouped)?, vec![0, 2])
        } else {
            (dy, std::iter::once(0).chain(2..r as i64).collect())
        };
        if cx.want(1) {
            let (ones_g, zeros_g) = (filled(cx, g, 1.0), filled(cx, g, 0.0));
            let inorm = Op::InstanceNormalization(op::InstanceNormalization { epsilon });
            let xhat = cx.add1(inorm, &[xg, ones_g, zeros_g])?;
            let xhat = if per_group { xhat } else { cx.reshape(xhat, &dims)? };
            let prod = cx.mul(dyp, xhat)?;
            let ds = cx.reduce_sum(prod, &axes, false)?;
            let target = cx.dims(scale)?;
            let ds = cx.reshape(ds, &target)?;
            cx.set(1, ds);
        }
        if cx.want(2) {
            let db = cx.reduce_sum(dyp, &axes, false)?;
            let target = cx.dims(cx.x(2)?)?;
            let db = cx.reshape(db, &target)?;
            cx.set(2, db);
        }
    }
    Ok(())
}

impl OpRules for op::BatchNormGrad {
    fn arity(&self) -> Arity {
        Arity::new(5, 5, 3, 3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let c = cx.dims(0).and_then(|d| d.get(1).cloned()).unwrap_or(Dim::Unknown);
        let ch = cx.with(cx.dtype(), Some(vec![c]));
        Ok(vec![cx.input(0).cloned(), ch.clone(), ch])
    }

    /// Its iteration space is the input's: `dx` follows it, the per-channel gradients the
    /// channel dim; the batch and spatial dims are summed over (inference mode: a split leaves
    /// partial sums) or statistic dims (training mode: synchronized).
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let mut sp = per_channel_space(cx, false);
        let r = cx.out_dims(0).len();
        let full: Vec<Option<usize>> = (0..r).map(|i| (cx.out_dims(0)[i] != 1).then_some(i)).collect();
        if let Some(m) = sp.inputs.get_mut(4) {
            *m = Some(full);
        }
        for (i, d) in sp.dims.iter_mut().enumerate() {
            if i != 1 {
                d.kind = if self.training_mode() != 0 { DimKind::Statistic { values: 2 } } else { DimKind::Reduction };
            }
        }
        Some(sp)
    }

    fn sharded(&self) -> Sharded {
        if self.training_mode() != 0 { Sharded::BatchNorm } else { Sharded::Local }
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        // The per-channel statistics and sums, then dx.
        Work::flops(10.0 * cx.in_numel(0)).map(|w| Work { launches: 2.0, ..w })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let c = *x.shape.get(1).unwrap_or(&1);
        let scale = channel_params(cx.req(1)?, c, "scale")?;
        let mut mean = channel_params(cx.req(2)?, c, "mean")?;
        let mut var = channel_params(cx.req(3)?, c, "var")?;
        let dy = cx.req(4)?;
        if dy.shape != x.shape || x.rank() < 2 {
            return Err(EvalError::Invalid(format!("BatchNormGrad: dy {:?} for x {:?}", dy.shape, x.shape)));
        }
        let (v, g) = (x.to_f64()?, dy.to_f64()?);
        let (n, sp) = (x.shape[0], x.shape[2..].iter().product::<usize>());
        let count = (n * sp) as f64;
        let eps = f64::from(self.epsilon());
        let training = self.training_mode() != 0;
        let mut dx = vec![0.0; v.len()];
        let (mut ds, mut db) = (vec![0.0; c], vec![0.0; c]);
        for ci in 0..c {
            let idx = |ni: usize, s: usize| (ni * c + ci) * sp + s;
            if training {
                let m = (0..n).flat_map(|ni| (0..sp).map(move |s| (ni, s))).map(|(ni, s)| v[idx(ni, s)]).sum::<f64>()
                    / count;
                let q = (0..n)
                    .flat_map(|ni| (0..sp).map(move |s| (ni, s)))
                    .map(|(ni, s)| (v[idx(ni, s)] - m).powi(2))
                    .sum::<f64>()
                    / count;
                mean[ci] = m;
                var[ci] = q;
            }
            let r = 1.0 / (var[ci] + eps).sqrt();
            for ni in 0..n {
                for s in 0..sp {
                    let i = idx(ni, s);
                    db[ci] += g[i];
                    ds[ci] += g[i] * (v[i] - mean[ci]) * r;
                }
            }
            for ni in 0..n {
                for s in 0..sp {
                    let i = idx(ni, s);
                    dx[i] = if training {
                        let xh = (v[i] - mean[ci]) * r;
                        scale[ci] * r / count * (count * g[i] - db[ci] - xh * ds[ci])
                    } else {
                        g[i] * scale[ci] * r
                    };
                }
            }
        }
        Ok(vec![
            Array::float(dy.dtype, x.shape.clone(), dx),
            Array::float(dy.dtype, vec![c], ds),
            Array::float(dy.dtype, vec![c], db),
        ])
    }
}

impl OpRules for op::LayerNormGrad {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 3, 3)
    }

    /// dX like X; dScale and dBias over the normalized dims.
    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return Ok(vec![cx.input(0).cloned(), None, None]) };
        let a = norm_axis(self.axis(), d.len())?;
        let p = cx.with(cx.dtype(), Some(d[a..].to_vec()));
        Ok(vec![cx.input(0).cloned(), p.clone(), p])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        // The batch (dim 0) splits when it is not normalized over.
        let r = cx.in_dims(0).len() as i64;
        let a = self.axis();
        if (if a < 0 { a + r } else { a }) >= 1 {
            Some(IterSpace::batch(cx, &[0, 2], &[0]))
        } else {
            Some(IterSpace::whole(cx))
        }
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        // Per row: the statistics and dx; then per column: the parameter gradients.
        let rows = cx.rows_before(0, self.axis());
        Work::flops(10.0 * cx.in_numel(0)).map(|w| Work { launches: 2.0, parallel: Some(rows), ..w })
    }

    /// Per row: `x̂ = (x − μ)·r`, `g = dY·scale`; `dX = r·(g − mean(g) − x̂·mean(g·x̂))`;
    /// dScale and dBias sum `dY·x̂` and `dY` over the rows.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, sc, dy) = (cx.req(0)?, cx.req(1)?, cx.req(2)?);
        if dy.shape != x.shape {
            return Err(EvalError::Invalid(format!("LayerNormGrad: dy {:?} for x {:?}", dy.shape, x.shape)));
        }
        let a = norm_axis(self.axis(), x.rank())?;
        let norm_shape = x.shape[a..].to_vec();
        let outer: usize = x.shape[..a].iter().product();
        let inner: usize = norm_shape.iter().product();
        let sv = sc.to_f64()?;
        if broadcast_shapes(&norm_shape, &sc.shape)? != norm_shape {
            return Err(EvalError::Invalid("LayerNormGrad scale does not fit".into()));
        }
        let scale: Vec<f64> = broadcast_index(&norm_shape, &sc.shape).iter().map(|&i| sv[i]).collect();
        let (v, g) = (x.to_f64()?, dy.to_f64()?);
        let eps = f64::from(self.epsilon());
        let mut dx = vec![0.0; v.len()];
        let (mut ds, mut db) = (vec![0.0; inner], vec![0.0; inner]);
        for o in 0..outer {
            let row = &v[o * inner..(o + 1) * inner];
            let grow = &g[o * inner..(o + 1) * inner];
            let m = row.iter().sum::<f64>() / inner as f64;
            let var = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / inner as f64;
            let r = 1.0 / (var + eps).sqrt();
            let xh: Vec<f64> = row.iter().map(|&a| (a - m) * r).collect();
            let gs: Vec<f64> = (0..inner).map(|j| grow[j] * scale[j]).collect();
            let mg = gs.iter().sum::<f64>() / inner as f64;
            let mgx = (0..inner).map(|j| gs[j] * xh[j]).sum::<f64>() / inner as f64;
            for j in 0..inner {
                dx[o * inner + j] = r * (gs[j] - mg - xh[j] * mgx);
                ds[j] += grow[j] * xh[j];
                db[j] += grow[j];
            }
        }
        Ok(vec![
            Array::float(dy.dtype, x.shape.clone(), dx),
            Array::float(dy.dtype, norm_shape.clone(), ds),
            Array::float(dy.dtype, norm_shape, db),
        ])
    }
}

impl OpRules for op::RMSNormalization {
    flow_positional!(0);

    /// With r = 1/√(mean(x²)+ε) over the normalized dims and g = dY·scale:
    /// dX = g·r − x·r³·mean(x·g), dScale = Σ dY·x·r over the other dims.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let (x, s) = (cx.x(0)?, cx.x(1)?);
            let xd = cx.dims(x)?;
            let a = norm_axis(self.axis(), xd.len())?;
            let axes: Vec<i64> = (a..xd.len()).map(|i| i as i64).collect();
            let dt = cx.dtype(x);
            let mean = |cx: &mut GradCx<'_>, v: Value| -> std::result::Result<Value, String> {
                let ax = cx.ints(&axes);
                cx.add1(Op::ReduceMean(op::ReduceMean { keepdims: Some(1), ..Default::default() }), &[v, ax])
            };
            let x2 = cx.mul(x, x)?;
            let m = mean(cx, x2)?;
            let eps = cx.scalar(dt, f64::from(self.epsilon()));
            let m = cx.add2(m, eps)?;
            let rms = cx.add1(Op::Sqrt(op::Sqrt::default()), &[m])?;
            let r = cx.add1(Op::Reciprocal(op::Reciprocal::default()), &[rms])?;
            if cx.want(0) {
                let g = cx.mul(dy, s)?;
                let t1 = cx.mul(g, r)?;
                let xg = cx.mul(x, g)?;
                let mxg = mean(cx, xg)?;
                let r2 = cx.mul(r, r)?;
                let r3 = cx.mul(r2, r)?;
                let t2 = cx.mul(x, r3)?;
                let t2 = cx.mul(t2, mxg)?;
                let dx = cx.sub(t1, t2)?;
                cx.set(0, dx);
            }
            if cx.want(1) {
                let xr = cx.mul(x, r)?;
                let ds = cx.mul(dy, xr)?;
                cx.set_broadcast(1, ds)?;
            }
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    /// Statistics over the normalized dims (which do not split); the scale covers them.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.out_dims(0).len();
        let Ok(a) = norm_axis(self.axis(), r) else { return Some(IterSpace::whole(cx)) };
        let mut sp = pointwise(cx, &[], &(a..r).collect::<Vec<_>>(), 1);
        if let Some(Some(m)) = sp.inputs.get_mut(1) {
            m.iter_mut().for_each(|x| *x = None);
        }
        Some(sp)
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(4.0 * cx.in_numel(0))
    }

    /// `x / sqrt(mean(x²) + ε) · scale`, the mean over the dims from `axis` on.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, s) = (cx.req(0)?, cx.req(1)?);
        let a = norm_axis(self.axis(), x.rank())?;
        let inner: usize = x.shape[a..].iter().product();
        let v = x.to_f64()?;
        let eps = f64::from(self.epsilon());
        let mut y = vec![0.0; v.len()];
        for (row_in, row_out) in v.chunks(inner.max(1)).zip(y.chunks_mut(inner.max(1))) {
            let ms = row_in.iter().map(|t| t * t).sum::<f64>() / inner.max(1) as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            for (o, i) in row_out.iter_mut().zip(row_in) {
                *o = i * inv;
            }
        }
        let shape = broadcast_shapes(&x.shape, &s.shape).map_err(EvalError::Invalid)?;
        if shape != x.shape {
            return Err(EvalError::Invalid(format!(
                "RMSNormalization: scale {:?} does not fit {:?}",
                s.shape, x.shape
            )));
        }
        let sv = s.to_f64()?;
        for (o, i) in y.iter_mut().zip(broadcast_walk(&x.shape, &s.shape)) {
            *o *= sv[i];
        }
        Ok(vec![Array::float(x.dtype, x.shape.clone(), y)])
    }
}
