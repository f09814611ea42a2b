//! Losses: `SoftmaxCrossEntropyLoss` and `NegativeLogLikelihoodLoss` (ONNX), and their
//! gradients (the `shardc` domain).
//!
//! Scores or log-probabilities are `[N, C, d1..]` with the class dim 1; labels `[N, d1..]`
//! are int class ids; optional weights `[C]`. `reduction` is `mean` (divided by the sum of
//! the weights of the counted labels), `sum` or `none`; labels equal to `ignore_index` count
//! for nothing. The iteration space splits the samples (the batch): a split mean leaves
//! partial sums of the per-sample terms, divided by the global count.

use super::flow::flow_positional;
use super::grad::GradCx;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, Data, EvalError};
use crate::graph::op::{self, Op};
use crate::layout::IterSpace;
use crate::types::{DType, Dim, TensorType};

type Result<T> = std::result::Result<T, EvalError>;

/// A loss's attributes.
#[derive(Copy, Clone)]
struct Red<'a> {
    reduction: &'a str,
    ignore: Option<i64>,
}

/// `[N, C, d..]` → (N, C, D = Πd).
fn layout(shape: &[usize]) -> Result<(usize, usize, usize)> {
    if shape.len() < 2 {
        return Err(EvalError::Invalid(format!("loss scores of rank {} (need ≥ 2)", shape.len())));
    }
    Ok((shape[0], shape[1], shape[2..].iter().product()))
}

/// The samples of scores input `i` ([N, C, d…]: N·d; 0 when unknown): the loss kernels run
/// one invocation per sample.
fn samples(cx: &NodeCx<'_>, i: usize) -> f64 {
    match cx.in_dims(i).get(1) {
        Some(&c) if c > 0 => cx.in_numel(i) / c as f64,
        _ => 0.0,
    }
}

/// Classes per chunk of a softmax loss's log-sum-exp: over more classes than this, the
/// kernels find each chunk's max and sum of exponentials in parallel (one invocation per
/// sample and chunk) and a second kernel combines a sample's chunks; a vocabulary-sized row
/// is then neither one serial loop per sample nor past the loop limit of a software device.
pub const LSE_CHUNK: usize = 256;

/// The chunks of a log-sum-exp over `classes` ([`LSE_CHUNK`]): 1 when one loop does it.
pub fn lse_chunks(classes: usize) -> usize {
    if classes > LSE_CHUNK { classes.div_ceil(LSE_CHUNK) } else { 1 }
}

/// The kernels a softmax loss (or its gradient, `base` kernels without the log-sum-exp's
/// chunks) launches over scores of input `i`, and the invocations of its widest one.
fn softmax_work(cx: &NodeCx<'_>, i: usize, flops: f64, base: f64) -> Option<Work> {
    let chunks = lse_chunks(cx.in_dims(i).get(1).map_or(1, |&c| c.max(0) as usize)) as f64;
    let launches = base + if chunks > 1.0 { 1.0 } else { 0.0 };
    Work::flops(flops).map(|w| Work { launches, parallel: Some(samples(cx, i) * chunks), ..w })
}

/// Per sample (n, d): its class, its weight (0 when ignored).
fn targets(labels: &Array, weights: Option<&Array>, r: Red<'_>, c: usize) -> Result<(Vec<usize>, Vec<f64>)> {
    let l = labels.to_i64()?;
    let w = weights.map(Array::to_f64).transpose()?;
    if w.as_ref().is_some_and(|w| w.len() != c) {
        return Err(EvalError::Invalid(format!("{} class weights for {c} classes", w.map_or(0, |w| w.len()))));
    }
    let mut cls = Vec::with_capacity(l.len());
    let mut wt = Vec::with_capacity(l.len());
    for &k in &l {
        if Some(k) == r.ignore {
            cls.push(0);
            wt.push(0.0);
            continue;
        }
        if k < 0 || k as usize >= c {
            return Err(EvalError::Invalid(format!("label {k} outside 0..{c}")));
        }
        cls.push(k as usize);
        wt.push(w.as_ref().map_or(1.0, |w| w[k as usize]));
    }
    Ok((cls, wt))
}

/// One label per sample.
fn samples_fit(labels: usize, samples: usize) -> Result<()> {
    if labels == samples { Ok(()) } else { Err(EvalError::Invalid(format!("{labels} labels for {samples} samples"))) }
}

/// The reduced loss from per-sample terms (already weighted).
fn reduce(terms: Vec<f64>, wt: &[f64], r: Red<'_>, dtype: DType, sample_shape: Vec<usize>) -> Array {
    match r.reduction {
        "none" => Array::float(dtype, sample_shape, terms),
        "sum" => Array::float(dtype, vec![], vec![terms.iter().sum()]),
        _ => {
            let total: f64 = wt.iter().sum();
            Array::float(dtype, vec![], vec![terms.iter().sum::<f64>() / total])
        }
    }
}

/// Per-sample scale of the gradient: `dloss` (per sample for none), over the total weight
/// for mean.
fn dscale(dloss: &Array, wt: &[f64], r: Red<'_>) -> Result<Vec<f64>> {
    let d = dloss.to_f64()?;
    let want = if r.reduction == "none" { wt.len() } else { 1 };
    if d.len() != want {
        return Err(EvalError::Invalid(format!("{} loss gradients for {want} losses", d.len())));
    }
    Ok(match r.reduction {
        "none" => d,
        "sum" => vec![d[0]; wt.len()],
        _ => vec![d[0] / wt.iter().sum::<f64>(); wt.len()],
    })
}

/// Element `k` of a float array as f64, read where it is stored (no f64 copy of the scores,
/// which for a language model's vocabulary are the largest tensor of the step).
fn reader(x: &Array) -> Result<impl Fn(usize) -> f64 + '_> {
    match &x.data {
        Data::F32(_) | Data::F64(_) => Ok(move |k| match &x.data {
            Data::F32(v) => f64::from(v[k]),
            Data::F64(v) => v[k],
            _ => f64::NAN,
        }),
        _ => Err(EvalError::Unsupported(format!("{} scores", x.dtype))),
    }
}

/// The log-sum-exp over the classes of each sample `(i, j)` of scores `[n, c, dd]`.
fn log_sum_exp(x: &impl Fn(usize) -> f64, n: usize, c: usize, dd: usize) -> Vec<f64> {
    let mut lse = Vec::with_capacity(n * dd);
    for i in 0..n {
        for j in 0..dd {
            let at = |k: usize| (i * c + k) * dd + j;
            let m = (0..c).map(|k| x(at(k))).fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = (0..c).map(|k| (x(at(k)) - m).exp()).sum();
            lse.push(m + s.ln());
        }
    }
    lse
}

/// An array of `dtype` and `shape` whose element `k` is `f(k)`, made in its storage type.
fn float_array(dtype: DType, shape: Vec<usize>, f: impl Fn(usize) -> f64) -> Array {
    let n = shape.iter().product();
    if dtype == DType::Double {
        Array::float(dtype, shape, (0..n).map(f).collect())
    } else {
        Array::from_f32s(dtype, shape, (0..n).map(|k| f(k) as f32).collect())
    }
}

fn loss_infer(cx: &InferCx<'_>, reduction: &str, log_prob: bool) -> Types {
    let dt = cx.dtype();
    let loss_dims = match reduction {
        "none" => cx.dims(1).cloned(),
        "mean" | "sum" => Some(Vec::<Dim>::new()),
        r => return Err(format!("unknown reduction `{r}`")),
    };
    let mut out = vec![cx.with(dt, loss_dims)];
    if log_prob && cx.n_out > 1 {
        out.push(cx.input(0).cloned());
    }
    Ok(out)
}

/// Samples split, like a batch: the scores' dims 0 and 2.. follow the labels'.
/// The samples split (the batch, dim 0 of the scores and labels): a summed or averaged loss
/// becomes partial sums, a per-sample loss and the scores' gradient split with them.
/// Weighted losses run whole.
fn loss_space(cx: &NodeCx<'_>, reduction: &str, grad: bool) -> Option<IterSpace> {
    let none = reduction == "none";
    Some(match (grad, cx.g.node(cx.n).inputs().len()) {
        (false, 2) if none => IterSpace::batch(cx, &[0, 1], &[0, 1]),
        (false, 2) => IterSpace::batch(cx, &[0, 1], &[1]),
        (true, 3) if none => IterSpace::batch(cx, &[0, 1, 2], &[0]),
        (true, 3) => IterSpace::batch(cx, &[1, 2], &[0]),
        _ => IterSpace::whole(cx),
    })
}

/// A mean over split samples needs the count of the samples that count, all-reduced.
fn loss_sharded(reduction: &str) -> Sharded {
    if reduction == "mean" { Sharded::Loss } else { Sharded::Local }
}

impl OpRules for op::SoftmaxCrossEntropyLoss {
    fn grad_kernel(&self) -> Option<&'static str> {
        Some("SoftmaxCrossEntropyLossGrad")
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        loss_infer(cx, self.reduction(), true)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        loss_space(cx, self.reduction(), false)
    }

    fn sharded(&self) -> Sharded {
        loss_sharded(self.reduction())
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        // Two kernels: the per-sample terms (one invocation per sample), then their reduction;
        // over many classes the log-sum-exp's chunks first.
        softmax_work(cx, 0, 4.0 * cx.in_numel(0), 2.0)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let (n, c, dd) = layout(&x.shape)?;
        let r = Red { reduction: self.reduction(), ignore: self.ignore_index };
        let (cls, wt) = targets(cx.req(1)?, cx.opt(2), r, c)?;
        samples_fit(cls.len(), n * dd)?;
        let xv = reader(x)?;
        let lse = log_sum_exp(&xv, n, c, dd);
        let terms: Vec<f64> = (0..n * dd)
            .map(|s| if wt[s] == 0.0 { 0.0 } else { -wt[s] * (xv(((s / dd) * c + cls[s]) * dd + s % dd) - lse[s]) })
            .collect();
        let mut sample = vec![n];
        sample.extend(&x.shape[2..]);
        let mut out = vec![reduce(terms, &wt, r, x.dtype, sample)];
        if cx.n_out > 1 {
            out.push(float_array(x.dtype, x.shape.clone(), |k| xv(k) - lse[(k / (c * dd)) * dd + k % dd]));
        }
        Ok(out)
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(loss_grad(
            cx,
            Op::SoftmaxCrossEntropyLossGrad(op::SoftmaxCrossEntropyLossGrad {
                ignore_index: self.ignore_index,
                reduction: self.reduction.clone(),
            }),
        ))
    }
}

impl OpRules for op::NegativeLogLikelihoodLoss {
    fn grad_kernel(&self) -> Option<&'static str> {
        Some("NegativeLogLikelihoodLossGrad")
    }

    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        loss_infer(cx, self.reduction(), false)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        loss_space(cx, self.reduction(), false)
    }

    fn sharded(&self) -> Sharded {
        loss_sharded(self.reduction())
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        // Two kernels: the per-sample terms (one invocation per sample), then their reduction.
        Work::flops(cx.in_numel(1)).map(|w| Work { launches: 2.0, parallel: Some(samples(cx, 0)), ..w })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let (n, c, dd) = layout(&x.shape)?;
        let r = Red { reduction: self.reduction(), ignore: self.ignore_index };
        let (cls, wt) = targets(cx.req(1)?, cx.opt(2), r, c)?;
        samples_fit(cls.len(), n * dd)?;
        let xv = x.to_f64()?;
        let terms: Vec<f64> = (0..n * dd)
            .map(|s| if wt[s] == 0.0 { 0.0 } else { -wt[s] * xv[((s / dd) * c + cls[s]) * dd + s % dd] })
            .collect();
        let mut sample = vec![n];
        sample.extend(&x.shape[2..]);
        Ok(vec![reduce(terms, &wt, r, x.dtype, sample)])
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(loss_grad(
            cx,
            Op::NegativeLogLikelihoodLossGrad(op::NegativeLogLikelihoodLossGrad {
                ignore_index: self.ignore_index,
                reduction: self.reduction.clone(),
            }),
        ))
    }
}

/// Both losses: dScores from dLoss, the scores and the labels (and weights).
fn loss_grad(cx: &mut GradCx<'_>, grad_op: Op) -> std::result::Result<(), String> {
    if cx.dy(1).is_some() {
        return Err("a gradient through the log_prob output is not supported".into());
    }
    let (Some(dl), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let mut ins = vec![Some(dl), Some(cx.x(0)?), Some(cx.x(1)?)];
    if let Some(w) = cx.x_opt(2) {
        ins.push(Some(w));
    }
    let d = cx.add(grad_op, &ins, 1)?[0];
    cx.set(0, d);
    Ok(())
}

/// The gradients' evaluation: dScores `[N, C, d..]`.
fn loss_grad_eval(cx: &EvalCx<'_>, r: Red<'_>, softmax: bool) -> Arrays {
    let (dl, x) = (cx.req(0)?, cx.req(1)?);
    let (n, c, dd) = layout(&x.shape)?;
    let (cls, wt) = targets(cx.req(2)?, cx.opt(3), r, c)?;
    samples_fit(cls.len(), n * dd)?;
    let sc = dscale(dl, &wt, r)?;
    let xv = reader(x)?;
    if softmax {
        return Ok(vec![softmax_grad(&xv, x, (n, c, dd), &cls, &wt, &sc)]);
    }
    // Element `at` of sample `s = i·dd + j` (class `k`): −f · one-hot.
    Ok(vec![float_array(x.dtype, x.shape.clone(), |at| {
        let (i, k, j) = (at / (c * dd), (at / dd) % c, at % dd);
        let s = i * dd + j;
        let f = sc[s] * wt[s];
        let hot = if k == cls[s] && wt[s] != 0.0 { 1.0 } else { 0.0 };
        -f * hot
    })])
}

/// A softmax loss's dScores: per sample `s` (class `k`), `f · (softmax − one-hot)` with
/// `f = dloss_s · weight_s`; each exponential computed once (`e_k = exp(x_k − max)`, the
/// softmax `e_k / Σe`).
fn softmax_grad(
    xv: &impl Fn(usize) -> f64,
    x: &Array,
    (n, c, dd): (usize, usize, usize),
    cls: &[usize],
    wt: &[f64],
    sc: &[f64],
) -> Array {
    let mut out = vec![0f64; n * c * dd];
    for i in 0..n {
        for j in 0..dd {
            let (s, at) = (i * dd + j, |k: usize| (i * c + k) * dd + j);
            let m = (0..c).map(|k| xv(at(k))).fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0.0;
            for k in 0..c {
                let e = (xv(at(k)) - m).exp();
                out[at(k)] = e;
                sum += e;
            }
            let f = sc[s] * wt[s];
            for k in 0..c {
                let hot = if k == cls[s] && wt[s] != 0.0 { 1.0 } else { 0.0 };
                out[at(k)] = f * (out[at(k)] / sum - hot);
            }
        }
    }
    float_array(x.dtype, x.shape.clone(), |k| out[k])
}

fn loss_grad_infer(cx: &InferCx<'_>) -> Types {
    Ok(vec![cx.input(1).cloned()])
}

/// Kernels of a loss gradient: the per-sample terms, the mean's divisor (once), the gradient.
fn grad_launches(reduction: &str) -> f64 {
    if reduction == "mean" { 3.0 } else { 2.0 }
}

impl OpRules for op::SoftmaxCrossEntropyLossGrad {
    fn arity(&self) -> Arity {
        Arity::new(3, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        loss_grad_infer(cx)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        loss_space(cx, self.reduction(), true)
    }

    fn sharded(&self) -> Sharded {
        loss_sharded(self.reduction())
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        // The per-sample terms (one invocation per sample, after the log-sum-exp's chunks
        // over many classes), then the scores' gradient.
        softmax_work(cx, 1, 5.0 * cx.in_numel(1), grad_launches(self.reduction()))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        loss_grad_eval(cx, Red { reduction: self.reduction(), ignore: self.ignore_index }, true)
    }
}

impl OpRules for op::NegativeLogLikelihoodLossGrad {
    fn arity(&self) -> Arity {
        Arity::new(3, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        loss_grad_infer(cx)
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        loss_space(cx, self.reduction(), true)
    }

    fn sharded(&self) -> Sharded {
        loss_sharded(self.reduction())
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let launches = grad_launches(self.reduction());
        Work::flops(cx.in_numel(1)).map(|w| Work { launches, parallel: Some(samples(cx, 1)), ..w })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        loss_grad_eval(cx, Red { reduction: self.reduction(), ignore: self.ignore_index }, false)
    }
}

/// Checks labels are integers (for the verifier's sake).
pub fn is_label_type(t: &TensorType) -> bool {
    matches!(t.dtype, DType::Int64 | DType::Int32)
}
