//! Recurrent layers: `LSTM`, `GRU` and `RNN` (forward, reverse, bidirectional; layout 0 or
//! 1; initial states, sequence lengths, peepholes, clipping, custom activations).
//!
//! Their iteration space is the batch (parallel) and the time steps (a recurrence: whole).
//! Their kernels run once per time step, and re-read the recurrent weights each step.

use super::grad::GradCx;
use super::util::join;
use super::{Arity, Arrays, Backward, EvalCx, FlowCx, InferCx, Mono, NodeCx, OpRules, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace};
use crate::ops::TRANSCENDENTAL_FLOPS;
use crate::ops::shape::transpose;
use crate::types::Dim;

type Result<T> = std::result::Result<T, EvalError>;

/// The recurrent space: `b` (the batch) and `t` (time steps, whole).
fn recurrent_space(cx: &NodeCx<'_>, layout: i64) -> IterSpace {
    let x = cx.in_dims(0);
    if x.len() != 3 {
        return IterSpace::whole(cx);
    }
    let (bx, sx) = if layout == 0 { (1, 0) } else { (0, 1) };
    let sd = vec![
        IterDim { name: "b".into(), size: x[bx], kind: DimKind::Parallel, role: DimRole::Other },
        IterDim { name: "t".into(), size: x[sx], kind: DimKind::Fixed, role: DimRole::Other },
    ];
    let mut xm = vec![None; 3];
    xm[bx] = Some(0);
    xm[sx] = Some(1);
    let batch_axis = if layout == 0 { 1 } else { 0 };
    let inputs =
        cx.g.node(cx.n)
            .inputs()
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.map(|v| {
                    let rk = cx.rank(v);
                    match i {
                        0 => xm.clone(),
                        5 | 6 => (0..rk).map(|t| (t == batch_axis).then_some(0)).collect(),
                        _ => vec![None; rk],
                    }
                })
            })
            .collect();
    let outputs = (0..cx.n_out())
        .map(|s| {
            let rk = cx.rank(cx.output(s));
            if s == 0 {
                if layout == 0 { vec![Some(1), None, Some(0), None] } else { vec![Some(0), Some(1), None, None] }
            } else {
                (0..rk).map(|t| (t == batch_axis).then_some(0)).collect()
            }
        })
        .collect();
    IterSpace { dims: sd, inputs, outputs }
}

fn recurrent_infer(cx: &InferCx<'_>, hidden: Option<i64>, bidirectional: bool, layout: i64) -> Types {
    let h = hidden.map_or(Dim::Unknown, Dim::Fixed);
    let dirs = Dim::Fixed(if bidirectional { 2 } else { 1 });
    let Some(d) = cx.dims(0) else { return Ok(vec![cx.with(cx.dtype(), None); cx.n_out]) };
    if d.len() != 3 {
        return Err(format!("X must be rank 3, got [{}]", join(d)));
    }
    let (seq, batch) = if layout == 0 { (d[0].clone(), d[1].clone()) } else { (d[1].clone(), d[0].clone()) };
    let y = if layout == 0 {
        vec![seq, dirs.clone(), batch.clone(), h.clone()]
    } else {
        vec![batch.clone(), seq, dirs.clone(), h.clone()]
    };
    let st = if layout == 0 { vec![dirs, batch, h] } else { vec![batch, dirs, h] };
    let mut out = vec![cx.with(cx.dtype(), Some(y))];
    for _ in 1..cx.n_out {
        out.push(cx.with(cx.dtype(), Some(st.clone())));
    }
    Ok(out)
}

fn recurrent_work(cx: &NodeCx<'_>, gates: f64) -> Option<Work> {
    let xd = cx.ty(cx.input(0)).and_then(|t| t.static_dims()).unwrap_or_default();
    let wd = cx.ty(cx.input(1)).and_then(|t| t.static_dims()).unwrap_or_default();
    if xd.len() != 3 || wd.len() != 3 {
        return Work::none();
    }
    let (dirs, gh, isz) = (wd[0] as f64, wd[1] as f64, wd[2] as f64);
    let h = gh / gates;
    let steps_batch = (xd[0] * xd[1]) as f64;
    let mm = 2.0 * dirs * steps_batch * gh * (isz + h);
    let pointwise = dirs * steps_batch * h * (gates * TRANSCENDENTAL_FLOPS + 6.0);
    Some(Work {
        fwd_flops: mm + pointwise,
        backward: Backward::Recurrent { matmul: mm, pointwise },
        // Per step and direction: the recurrent GEMM and the gate kernel.
        launches: 2.0 * dirs * xd[0] as f64,
        parallel: None,
    })
}

fn recurrent_flow(cx: &mut FlowCx<'_>, layout: i64) -> Option<()> {
    let xm = cx.in_m(0)?;
    let (seq, batch) = if layout == 0 { (xm[0].clone(), xm[1].clone()) } else { (xm[1].clone(), xm[0].clone()) };
    for s in 0..cx.n_out() {
        let Some(d) = cx.out_old_at(s) else { continue };
        let m: Vec<Mono> = if s == 0 {
            if layout == 0 {
                vec![seq.clone(), Mono::constant(d[1]), batch.clone(), Mono::constant(d[3])]
            } else {
                vec![batch.clone(), seq.clone(), Mono::constant(d[2]), Mono::constant(d[3])]
            }
        } else if layout == 0 {
            vec![Mono::constant(d[0]), batch.clone(), Mono::constant(d[2])]
        } else {
            vec![batch.clone(), Mono::constant(d[1]), Mono::constant(d[2])]
        };
        cx.set(s, m);
    }
    // Initial states carry the batch too.
    for slot in [5usize, 6] {
        if let (Some(v), Some(d)) = (cx.input(slot), cx.in_old(slot))
            && batch.is_tracked()
        {
            let a = if layout == 0 { 1 } else { 0 };
            let hm = cx.monos_of(v).unwrap_or_default();
            if !hm.get(a).is_some_and(Mono::is_tracked) && d.get(a).is_some() {
                cx.reqs.push((v, a, batch.clone()));
            }
        }
    }
    Some(())
}

/// `Name: kind, gates, max inputs, max outputs, linear_before_reset, input_forget`.
macro_rules! recurrent {
    ($($name:ident: $kind:literal, $gates:expr, $max_in:expr, $max_out:expr, |$s:ident| $lbr:expr, $forget:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::new(3, $max_in, 0, $max_out)
            }

            fn matrix_units(&self) -> bool {
                true
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                recurrent_infer(cx, self.hidden_size, self.direction() == "bidirectional", self.layout())
            }

            fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
                Some(recurrent_space(cx, self.layout()))
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                recurrent_work(cx, $gates as f64)
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let $s = self;
                let r = Rnn {
                    kind: $kind,
                    gates: $gates,
                    hidden: self.hidden_size.unwrap_or(0) as usize,
                    direction: self.direction().to_string(),
                    layout: self.layout(),
                    clip: self.clip.map(f64::from),
                    activations: self.activations.clone().unwrap_or_default(),
                    alphas: self.activation_alpha.clone().unwrap_or_default(),
                    betas: self.activation_beta.clone().unwrap_or_default(),
                    linear_before_reset: $lbr,
                    input_forget: $forget,
                };
                recurrent(&r, cx, cx.n_out)
            }

            fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
                recurrent_flow(cx, self.layout())
            }

            fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
                let $s = self;
                let (lbr, forget) = ($lbr, $forget);
                let g = op::RecurrentGrad {
                    activation_alpha: self.activation_alpha.clone(),
                    activation_beta: self.activation_beta.clone(),
                    activations: self.activations.clone(),
                    cell: Some($kind.to_string()),
                    clip: self.clip,
                    direction: self.direction.clone(),
                    hidden_size: self.hidden_size,
                    input_forget: Some(i64::from(forget)),
                    layout: self.layout,
                    linear_before_reset: Some(i64::from(lbr)),
                };
                Some(recurrent_grad_rule(g, cx))
            }
        }
    )*};
}

recurrent! {
    LSTM: "LSTM", 4, 8, 3, |s| false, s.input_forget() != 0;
    GRU: "GRU", 3, 6, 2, |s| s.linear_before_reset() != 0, false;
    RNN: "RNN", 1, 6, 2, |_s| false, false;
}

fn activation(name: &str, alpha: Option<f64>, beta: Option<f64>) -> Result<Box<dyn Fn(f64) -> f64>> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "sigmoid" => Box::new(|x: f64| 1.0 / (1.0 + (-x).exp())),
        "tanh" => Box::new(|x: f64| x.tanh()),
        "relu" => Box::new(|x: f64| x.max(0.0)),
        "affine" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(0.0));
            Box::new(move |x| a * x + b)
        }
        "leakyrelu" => {
            let a = alpha.unwrap_or(0.01);
            Box::new(move |x| if x >= 0.0 { x } else { a * x })
        }
        "thresholdedrelu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x| if x > a { x } else { 0.0 })
        }
        "scaledtanh" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(1.0));
            Box::new(move |x| a * (b * x).tanh())
        }
        "hardsigmoid" => {
            let (a, b) = (alpha.unwrap_or(0.2), beta.unwrap_or(0.5));
            Box::new(move |x| (a * x + b).clamp(0.0, 1.0))
        }
        "elu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x| if x >= 0.0 { x } else { a * (x.exp() - 1.0) })
        }
        "softsign" => Box::new(|x: f64| x / (1.0 + x.abs())),
        "softplus" => Box::new(|x: f64| x.exp().ln_1p()),
        other => return Err(EvalError::Unsupported(format!("recurrent activation `{other}`"))),
    })
}

/// The optional operands of a recurrent layer fit its geometry: bias `[dirs, 2·g·h]`, one
/// length per batch entry (at most the sequence), initial states `[dirs, batch, h]`, peepholes
/// `[dirs, 3h]`.
#[allow(clippy::too_many_arguments)]
fn check_operands(
    what: &str,
    dirs: usize,
    g: usize,
    h: usize,
    batch: usize,
    bias: &[f64],
    lens: &[usize],
    h0: Option<&[f64]>,
    c0: Option<&[f64]>,
    peep: Option<&[f64]>,
) -> Result<()> {
    let bad = bias.len() != dirs * 2 * g * h
        || lens.len() != batch
        || h0.is_some_and(|v| v.len() != dirs * batch * h)
        || c0.is_some_and(|v| v.len() != dirs * batch * h)
        || peep.is_some_and(|v| v.len() != dirs * 3 * h);
    if bad {
        return Err(EvalError::Invalid(format!(
            "{what}: bias, sequence lengths, initial states or peepholes do not fit {dirs} direction(s), batch {batch}, hidden size {h}"
        )));
    }
    Ok(())
}

struct Rnn<'a> {
    kind: &'a str,
    gates: usize,
    hidden: usize,
    direction: String,
    layout: i64,
    clip: Option<f64>,
    activations: Vec<String>,
    alphas: Vec<f32>,
    betas: Vec<f32>,
    linear_before_reset: bool,
    input_forget: bool,
}

fn recurrent(r: &Rnn<'_>, cx: &EvalCx<'_>, n_out: usize) -> Result<Vec<Array>> {
    let what = r.kind;
    if cx.req(0)?.rank() != 3 {
        return Err(EvalError::Invalid(format!("{what} needs X of rank 3, got {:?}", cx.req(0)?.shape)));
    }
    let mut x = cx.req(0)?.clone();
    if r.layout == 1 {
        x = transpose(&x, &[1, 0, 2]);
    }
    let xv = x.to_f64()?;
    let (seq, batch, isz) = (x.shape[0], x.shape[1], x.shape[2]);
    let w = cx.req(1)?.to_f64()?;
    let rr = cx.req(2)?.to_f64()?;
    let dirs = if r.direction == "bidirectional" { 2 } else { 1 };
    let h = r.hidden;
    let g = r.gates;
    if w.len() != dirs * g * h * isz || rr.len() != dirs * g * h * h {
        return Err(EvalError::Invalid(format!("{what} weights do not fit hidden_size {h} and input size {isz}")));
    }
    let bias = cx.opt(3).map(|b| b.to_f64()).transpose()?.unwrap_or_else(|| vec![0.0; dirs * 2 * g * h]);
    let lens: Vec<usize> = match cx.opt(4) {
        Some(l) => l.to_i64()?.iter().map(|&v| v.max(0) as usize).collect(),
        None => vec![seq; batch],
    };
    // Initial states are [dirs, batch, hidden], or [batch, dirs, hidden] in layout 1.
    let state = |a: &Array| if r.layout == 1 && a.rank() == 3 { transpose(a, &[1, 0, 2]) } else { a.clone() };
    let h0 = cx.opt(5).map(|a| state(a).to_f64()).transpose()?;
    let c0 = if r.kind == "LSTM" { cx.opt(6).map(|a| state(a).to_f64()).transpose()? } else { None };
    let peep = if r.kind == "LSTM" { cx.opt(7).map(|a| a.to_f64()).transpose()? } else { None };
    check_operands(what, dirs, g, h, batch, &bias, &lens, h0.as_deref(), c0.as_deref(), peep.as_deref())?;
    // Activations: f, g, h for LSTM; f, g for GRU; f for RNN; per direction.
    let per_dir = match r.kind {
        "LSTM" => 3,
        "GRU" => 2,
        _ => 1,
    };
    let defaults: &[&str] = match r.kind {
        "LSTM" => &["Sigmoid", "Tanh", "Tanh"],
        "GRU" => &["Sigmoid", "Tanh"],
        _ => &["Tanh"],
    };
    let mut acts = Vec::new();
    let mut ai = 0;
    for d in 0..dirs {
        let mut set = Vec::new();
        for k in 0..per_dir {
            let name = r.activations.get(d * per_dir + k).map(String::as_str).unwrap_or(defaults[k]);
            let needs = matches!(
                name.to_ascii_lowercase().as_str(),
                "affine" | "leakyrelu" | "thresholdedrelu" | "scaledtanh" | "hardsigmoid" | "elu"
            );
            let (a, b) = if needs {
                let a = r.alphas.get(ai).map(|&v| f64::from(v));
                let b = r.betas.get(ai).map(|&v| f64::from(v));
                ai += 1;
                (a, b)
            } else {
                (None, None)
            };
            set.push(activation(name, a, b)?);
        }
        acts.push(set);
    }
    let clip = |v: f64| match r.clip {
        Some(c) => v.clamp(-c, c),
        None => v,
    };
    let mut y = vec![0.0; seq * dirs * batch * h];
    let mut yh = vec![0.0; dirs * batch * h];
    let mut yc = vec![0.0; dirs * batch * h];
    for d in 0..dirs {
        let reverse = r.direction == "reverse" || d == 1;
        let wd = &w[d * g * h * isz..(d + 1) * g * h * isz];
        let rd = &rr[d * g * h * h..(d + 1) * g * h * h];
        let wb = &bias[d * 2 * g * h..d * 2 * g * h + g * h];
        let rb = &bias[d * 2 * g * h + g * h..(d + 1) * 2 * g * h];
        let act = &acts[d];
        for b in 0..batch {
            let mut hs: Vec<f64> = match &h0 {
                Some(v) => v[(d * batch + b) * h..(d * batch + b + 1) * h].to_vec(),
                None => vec![0.0; h],
            };
            let mut cs: Vec<f64> = match &c0 {
                Some(v) => v[(d * batch + b) * h..(d * batch + b + 1) * h].to_vec(),
                None => vec![0.0; h],
            };
            let len = lens[b].min(seq);
            for step in 0..len {
                let t = if reverse { len - 1 - step } else { step };
                let xt = &xv[(t * batch + b) * isz..(t * batch + b + 1) * isz];
                // gx[j] = W_j·x + Wb_j, gh[j] = R_j·h + Rb_j
                let mut gx = vec![0.0; g * h];
                let mut gh = vec![0.0; g * h];
                for j in 0..g * h {
                    gx[j] = wb[j] + wd[j * isz..(j + 1) * isz].iter().zip(xt).map(|(a, b)| a * b).sum::<f64>();
                    gh[j] = rb[j] + rd[j * h..(j + 1) * h].iter().zip(&hs).map(|(a, b)| a * b).sum::<f64>();
                }
                let mut hn = vec![0.0; h];
                match r.kind {
                    "LSTM" => {
                        // Gate order i, o, f, c.
                        let p = peep.as_ref().map(|p| &p[d * 3 * h..(d + 1) * 3 * h]);
                        for k in 0..h {
                            let pi = p.map_or(0.0, |p| p[k] * cs[k]);
                            let pf = p.map_or(0.0, |p| p[2 * h + k] * cs[k]);
                            let i = act[0](clip(gx[k] + gh[k] + pi));
                            let mut f = act[0](clip(gx[2 * h + k] + gh[2 * h + k] + pf));
                            if r.input_forget {
                                f = 1.0 - i;
                            }
                            let c = act[1](clip(gx[3 * h + k] + gh[3 * h + k]));
                            let cn = f * cs[k] + i * c;
                            let po = p.map_or(0.0, |p| p[h + k] * cn);
                            let o = act[0](clip(gx[h + k] + gh[h + k] + po));
                            cs[k] = cn;
                            hn[k] = o * act[2](cn);
                        }
                    }
                    "GRU" => {
                        // Gate order z, r, h.
                        let mut rgate = vec![0.0; h];
                        let mut z = vec![0.0; h];
                        for k in 0..h {
                            z[k] = act[0](clip(gx[k] + gh[k]));
                            rgate[k] = act[0](clip(gx[h + k] + gh[h + k]));
                        }
                        for k in 0..h {
                            let hh = if r.linear_before_reset {
                                gx[2 * h + k] + rgate[k] * gh[2 * h + k]
                            } else {
                                let rh: f64 = (0..h).map(|q| rd[(2 * h + k) * h + q] * rgate[q] * hs[q]).sum();
                                gx[2 * h + k] + rh + rb[2 * h + k]
                            };
                            let ht = act[1](clip(hh));
                            hn[k] = (1.0 - z[k]) * ht + z[k] * hs[k];
                        }
                    }
                    _ => {
                        for k in 0..h {
                            hn[k] = act[0](clip(gx[k] + gh[k]));
                        }
                    }
                }
                hs = hn;
                y[((t * dirs + d) * batch + b) * h..((t * dirs + d) * batch + b + 1) * h].copy_from_slice(&hs);
            }
            yh[(d * batch + b) * h..(d * batch + b + 1) * h].copy_from_slice(&hs);
            yc[(d * batch + b) * h..(d * batch + b + 1) * h].copy_from_slice(&cs);
        }
    }
    let dt = x.dtype;
    let mut ya = Array::float(dt, vec![seq, dirs, batch, h], y);
    let mut yha = Array::float(dt, vec![dirs, batch, h], yh);
    let mut yca = Array::float(dt, vec![dirs, batch, h], yc);
    if r.layout == 1 {
        ya = transpose(&ya, &[2, 0, 1, 3]);
        yha = transpose(&yha, &[1, 0, 2]);
        yca = transpose(&yca, &[1, 0, 2]);
    }
    let mut out = vec![ya, yha];
    if r.kind == "LSTM" {
        out.push(yca);
    }
    out.truncate(n_out.max(1));
    Ok(out)
}

/// True when graph input `v` reaches the initial state of a recurrent op (through slices,
/// squeezes, casts, gathers): its batch dim is axis 1 (or 0 in layout 1), not its first.
pub fn feeds_recurrent_state(g: &crate::Graph, v: crate::Value) -> bool {
    use crate::Op;
    let mut stack = vec![v];
    let mut seen = std::collections::HashSet::new();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        for (user, slot) in g.users(x) {
            match &g.node(user).op {
                Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) if slot >= 5 => return true,
                Op::Slice(_) | Op::Squeeze(_) | Op::Unsqueeze(_) | Op::Identity(_) | Op::Cast(_) | Op::Gather(_)
                    if slot == 0 =>
                {
                    stack.extend((0..g.node(user).num_outputs()).map(|s| crate::Value::new(user, s as u16)));
                }
                _ => {}
            }
        }
    }
    false
}

// ---- gradients: back-propagation through time ----

/// An activation's derivative with respect to its input.
fn activation_d(name: &str, alpha: Option<f64>, beta: Option<f64>) -> Result<Box<dyn Fn(f64) -> f64>> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "sigmoid" => Box::new(|x: f64| {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 - s)
        }),
        "tanh" => Box::new(|x: f64| 1.0 - x.tanh().powi(2)),
        "relu" => Box::new(|x: f64| f64::from(u8::from(x > 0.0))),
        "affine" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |_| a)
        }
        "leakyrelu" => {
            let a = alpha.unwrap_or(0.01);
            Box::new(move |x| if x > 0.0 { 1.0 } else { a })
        }
        "thresholdedrelu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x| f64::from(u8::from(x > a)))
        }
        "scaledtanh" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(1.0));
            Box::new(move |x| a * b * (1.0 - (b * x).tanh().powi(2)))
        }
        "hardsigmoid" => {
            let (a, b) = (alpha.unwrap_or(0.2), beta.unwrap_or(0.5));
            Box::new(move |x| if a * x + b > 0.0 && a * x + b < 1.0 { a } else { 0.0 })
        }
        "elu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x| if x >= 0.0 { 1.0 } else { a * x.exp() })
        }
        "softsign" => Box::new(|x: f64| 1.0 / (1.0 + x.abs()).powi(2)),
        "softplus" => Box::new(|x: f64| 1.0 / (1.0 + (-x).exp())),
        other => return Err(EvalError::Unsupported(format!("the derivative of recurrent activation `{other}`"))),
    })
}

/// The rule: one RecurrentGrad node from the forward inputs and the outputs' gradients.
fn recurrent_grad_rule(g: op::RecurrentGrad, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let mut ins: Vec<Option<Value>> = (0..8).map(|i| cx.x_opt(i)).collect();
    for s in 0..3 {
        ins.push(cx.dy(s));
    }
    let d = cx.add(Op::RecurrentGrad(g), &ins, 7)?;
    for (i, k) in [(0, 0), (1, 1), (2, 2), (3, 3), (5, 4), (6, 5), (7, 6)] {
        if cx.x_opt(i).is_some() {
            cx.set(i, d[k]);
        }
    }
    Ok(())
}

/// What one time step of one sequence keeps for its backward step.
struct Tape {
    t: usize,
    h_prev: Vec<f64>,
    c_prev: Vec<f64>,
    /// Gate pre-activations (after clipping) in the op's gate order.
    pre: Vec<f64>,
    /// Whether each pre-activation was inside the clip range.
    live: Vec<bool>,
    /// Gate outputs in gate order (LSTM: i, o, f, c; GRU: z, r, h̃; RNN: h).
    gate: Vec<f64>,
    /// GRU: R_h·h + Rb_h (linear before reset) or r∘h (otherwise).
    extra: Vec<f64>,
    c_new: Vec<f64>,
}

type ActPair = (Box<dyn Fn(f64) -> f64>, Box<dyn Fn(f64) -> f64>);

impl Tape {
    /// One LSTM step backward from the gradients of its h and c (`dh`, `dc`): the gate
    /// pre-activation gradients `da` (gate order i, o, f, c), the cell state's gradient into
    /// the previous step, and, with peepholes `p`, this direction's peephole gradients `dp`.
    #[allow(clippy::too_many_arguments)]
    fn lstm_grad(
        &self,
        act: &[ActPair],
        p: Option<&[f64]>,
        input_forget: bool,
        (dh, dc): (&[f64], &[f64]),
        da: &mut [f64],
        dc_prev: &mut [f64],
        dp: &mut [f64],
    ) {
        let (st, hh) = (self, dh.len());
        for k in 0..hh {
            let (i, o_, f, c) = (st.gate[k], st.gate[hh + k], st.gate[2 * hh + k], st.gate[3 * hh + k]);
            let cn = st.c_new[k];
            let hc = (act[2].0)(cn);
            let dao = dh[k] * hc * (act[0].1)(st.pre[hh + k]) * f64::from(u8::from(st.live[hh + k]));
            let dcn = dc[k] + dh[k] * o_ * (act[2].1)(cn) + dao * p.as_ref().map_or(0.0, |p| p[hh + k]);
            let mut di = dcn * c;
            let dcc = dcn * i;
            let dfg = dcn * st.c_prev[k];
            let daf = if input_forget {
                di -= dfg;
                0.0
            } else {
                dfg * (act[0].1)(st.pre[2 * hh + k]) * f64::from(u8::from(st.live[2 * hh + k]))
            };
            let dai = di * (act[0].1)(st.pre[k]) * f64::from(u8::from(st.live[k]));
            let dac = dcc * (act[1].1)(st.pre[3 * hh + k]) * f64::from(u8::from(st.live[3 * hh + k]));
            dc_prev[k] = dcn * f + p.as_ref().map_or(0.0, |p| dai * p[k] + daf * p[2 * hh + k]);
            if p.is_some() {
                dp[k] += dai * st.c_prev[k];
                dp[hh + k] += dao * cn;
                dp[2 * hh + k] += daf * st.c_prev[k];
            }
            da[k] = dai;
            da[hh + k] = dao;
            da[2 * hh + k] = daf;
            da[3 * hh + k] = dac;
        }
    }

    /// One GRU step backward from the gradient of its h: the gate pre-activation gradients
    /// `da` (z, r, h̃), the part of the previous h's gradient through the gates, and the
    /// candidate's recurrent weight and bias gradients (this direction's `dr`, and `drb`, the
    /// candidate's h entries of the recurrent bias).
    #[allow(clippy::too_many_arguments)]
    fn gru_grad(
        &self,
        act: &[ActPair],
        rd: &[f64],
        lbr: bool,
        dh: &[f64],
        (da, dh_prev): (&mut [f64], &mut [f64]),
        dr: &mut [f64],
        drb: &mut [f64],
    ) {
        let (st, hh) = (self, dh.len());
        let mut dextra = vec![0.0; hh];
        for k in 0..hh {
            let (z, ht) = (st.gate[k], st.gate[2 * hh + k]);
            let dz = dh[k] * (st.h_prev[k] - ht);
            let dhh = dh[k] * (1.0 - z) * (act[1].1)(st.pre[2 * hh + k]) * f64::from(u8::from(st.live[2 * hh + k]));
            dh_prev[k] += dh[k] * z;
            da[k] = dz * (act[0].1)(st.pre[k]) * f64::from(u8::from(st.live[k]));
            da[2 * hh + k] = dhh;
        }
        if lbr {
            // hh = gx_h + r·(R_h·h + Rb_h).
            for k in 0..hh {
                let dr_ = da[2 * hh + k] * st.extra[k];
                da[hh + k] = dr_ * (act[0].1)(st.pre[hh + k]) * f64::from(u8::from(st.live[hh + k]));
                dextra[k] = da[2 * hh + k] * st.gate[hh + k];
            }
        } else {
            // hh = gx_h + R_h·(r∘h) + Rb_h.
            let mut drh = vec![0.0; hh];
            for k in 0..hh {
                for q in 0..hh {
                    drh[q] += rd[(2 * hh + k) * hh + q] * da[2 * hh + k];
                }
            }
            for q in 0..hh {
                let dr_ = drh[q] * st.h_prev[q];
                da[hh + q] = dr_ * (act[0].1)(st.pre[hh + q]) * f64::from(u8::from(st.live[hh + q]));
                dh_prev[q] += drh[q] * st.gate[hh + q];
            }
        }
        // Weight gradients of the candidate's recurrent part.
        for k in 0..hh {
            if lbr {
                drb[k] += dextra[k];
                for q in 0..hh {
                    dr[(2 * hh + k) * hh + q] += dextra[k] * st.h_prev[q];
                    dh_prev[q] += rd[(2 * hh + k) * hh + q] * dextra[k];
                }
            } else {
                drb[k] += da[2 * hh + k];
                for q in 0..hh {
                    dr[(2 * hh + k) * hh + q] += da[2 * hh + k] * st.extra[q];
                }
            }
        }
    }
}

/// The inputs and attributes one RecurrentGrad evaluation works on.
struct Bptt<'a> {
    kind: &'a str,
    g: usize,
    h: usize,
    isz: usize,
    seq: usize,
    batch: usize,
    x: Vec<f64>,
    w: Vec<f64>,
    r: Vec<f64>,
    bias: Vec<f64>,
    lens: Vec<usize>,
    h0: Option<Vec<f64>>,
    c0: Option<Vec<f64>>,
    peep: Option<Vec<f64>>,
    clip: Option<f64>,
    lbr: bool,
    input_forget: bool,
}

#[allow(clippy::type_complexity)]
fn activations_of(
    o: &op::RecurrentGrad,
    kind: &str,
    dirs: usize,
) -> Result<Vec<Vec<(Box<dyn Fn(f64) -> f64>, Box<dyn Fn(f64) -> f64>)>>> {
    let per_dir = match kind {
        "LSTM" => 3,
        "GRU" => 2,
        _ => 1,
    };
    let defaults: &[&str] = match kind {
        "LSTM" => &["Sigmoid", "Tanh", "Tanh"],
        "GRU" => &["Sigmoid", "Tanh"],
        _ => &["Tanh"],
    };
    let names = o.activations.clone().unwrap_or_default();
    let (alphas, betas) =
        (o.activation_alpha.clone().unwrap_or_default(), o.activation_beta.clone().unwrap_or_default());
    let mut ai = 0;
    let mut out = Vec::new();
    for d in 0..dirs {
        let mut set = Vec::new();
        for k in 0..per_dir {
            let name = names.get(d * per_dir + k).map(String::as_str).unwrap_or(defaults[k]);
            let needs = matches!(
                name.to_ascii_lowercase().as_str(),
                "affine" | "leakyrelu" | "thresholdedrelu" | "scaledtanh" | "hardsigmoid" | "elu"
            );
            let (a, b) = if needs {
                let v = (alphas.get(ai).map(|&v| f64::from(v)), betas.get(ai).map(|&v| f64::from(v)));
                ai += 1;
                v
            } else {
                (None, None)
            };
            set.push((activation(name, a, b)?, activation_d(name, a, b)?));
        }
        out.push(set);
    }
    Ok(out)
}

impl Bptt<'_> {
    fn clip(&self, v: f64) -> (f64, bool) {
        match self.clip {
            Some(c) if v.abs() > c => (v.clamp(-c, c), false),
            _ => (v, true),
        }
    }

    /// The forward pass of sequence `b` in direction `d`, step by step (time order of the
    /// direction), and the final (h, c).
    #[allow(clippy::type_complexity)]
    fn forward(
        &self,
        d: usize,
        b: usize,
        act: &[(Box<dyn Fn(f64) -> f64>, Box<dyn Fn(f64) -> f64>)],
        reverse: bool,
    ) -> Vec<Tape> {
        let (g, h, isz) = (self.g, self.h, self.isz);
        let wd = &self.w[d * g * h * isz..(d + 1) * g * h * isz];
        let rd = &self.r[d * g * h * h..(d + 1) * g * h * h];
        let wb = &self.bias[d * 2 * g * h..d * 2 * g * h + g * h];
        let rb = &self.bias[d * 2 * g * h + g * h..(d + 1) * 2 * g * h];
        let mut hs = self
            .h0
            .as_ref()
            .map_or(vec![0.0; h], |v| v[(d * self.batch + b) * h..(d * self.batch + b + 1) * h].to_vec());
        let mut cs = self
            .c0
            .as_ref()
            .map_or(vec![0.0; h], |v| v[(d * self.batch + b) * h..(d * self.batch + b + 1) * h].to_vec());
        let len = self.lens[b].min(self.seq);
        let mut tape = Vec::with_capacity(len);
        for step in 0..len {
            let t = if reverse { len - 1 - step } else { step };
            let xt = &self.x[(t * self.batch + b) * isz..(t * self.batch + b + 1) * isz];
            let gx: Vec<f64> = (0..g * h)
                .map(|j| wb[j] + wd[j * isz..(j + 1) * isz].iter().zip(xt).map(|(a, c)| a * c).sum::<f64>())
                .collect();
            let gh: Vec<f64> = (0..g * h)
                .map(|j| rb[j] + rd[j * h..(j + 1) * h].iter().zip(&hs).map(|(a, c)| a * c).sum::<f64>())
                .collect();
            let mut pre = vec![0.0; g * h];
            let mut live = vec![true; g * h];
            let mut gate = vec![0.0; g * h];
            let mut extra = vec![0.0; h];
            let mut hn = vec![0.0; h];
            let mut cn = cs.clone();
            match self.kind {
                "LSTM" => {
                    let p = self.peep.as_ref().map(|p| &p[d * 3 * h..(d + 1) * 3 * h]);
                    for k in 0..h {
                        let (ai, li) = self.clip(gx[k] + gh[k] + p.map_or(0.0, |p| p[k] * cs[k]));
                        let (af, lf) =
                            self.clip(gx[2 * h + k] + gh[2 * h + k] + p.map_or(0.0, |p| p[2 * h + k] * cs[k]));
                        let (ac, lc) = self.clip(gx[3 * h + k] + gh[3 * h + k]);
                        let i = (act[0].0)(ai);
                        let f = if self.input_forget { 1.0 - i } else { (act[0].0)(af) };
                        let c = (act[1].0)(ac);
                        cn[k] = f * cs[k] + i * c;
                        let (ao, lo) = self.clip(gx[h + k] + gh[h + k] + p.map_or(0.0, |p| p[h + k] * cn[k]));
                        let o = (act[0].0)(ao);
                        hn[k] = o * (act[2].0)(cn[k]);
                        for (j, v, l, gv) in
                            [(k, ai, li, i), (h + k, ao, lo, o), (2 * h + k, af, lf, f), (3 * h + k, ac, lc, c)]
                        {
                            pre[j] = v;
                            live[j] = l;
                            gate[j] = gv;
                        }
                    }
                }
                "GRU" => {
                    for k in 0..2 * h {
                        let (a, l) = self.clip(gx[k] + gh[k]);
                        pre[k] = a;
                        live[k] = l;
                        gate[k] = (act[0].0)(a);
                    }
                    for k in 0..h {
                        let hh = if self.lbr {
                            extra[k] = gh[2 * h + k];
                            gx[2 * h + k] + gate[h + k] * gh[2 * h + k]
                        } else {
                            extra[k] = gate[h + k] * hs[k];
                            0.0
                        };
                        pre[2 * h + k] = hh;
                    }
                    if !self.lbr {
                        for k in 0..h {
                            let rh: f64 = (0..h).map(|q| rd[(2 * h + k) * h + q] * extra[q]).sum();
                            pre[2 * h + k] = gx[2 * h + k] + rh + rb[2 * h + k];
                        }
                    }
                    for k in 0..h {
                        let (a, l) = self.clip(pre[2 * h + k]);
                        pre[2 * h + k] = a;
                        live[2 * h + k] = l;
                        gate[2 * h + k] = (act[1].0)(a);
                        hn[k] = (1.0 - gate[k]) * gate[2 * h + k] + gate[k] * hs[k];
                    }
                }
                _ => {
                    for k in 0..h {
                        let (a, l) = self.clip(gx[k] + gh[k]);
                        pre[k] = a;
                        live[k] = l;
                        gate[k] = (act[0].0)(a);
                        hn[k] = gate[k];
                    }
                }
            }
            tape.push(Tape { t, h_prev: hs.clone(), c_prev: cs.clone(), pre, live, gate, extra, c_new: cn.clone() });
            hs = hn;
            cs = cn;
        }
        tape
    }
}

/// The gradients of a recurrent layer: dX, dW, dR, dB, dinitial_h, dinitial_c, dP.
fn recurrent_grad(o: &op::RecurrentGrad, cx: &EvalCx<'_>) -> Result<Vec<Array>> {
    let kind = o.cell.as_deref().unwrap_or("LSTM");
    let gates = match kind {
        "LSTM" => 4,
        "GRU" => 3,
        "RNN" => 1,
        other => return Err(EvalError::Invalid(format!("RecurrentGrad of cell `{other}`"))),
    };
    let layout = o.layout();
    if cx.req(0)?.rank() != 3 {
        return Err(EvalError::Invalid(format!("RecurrentGrad needs X of rank 3, got {:?}", cx.req(0)?.shape)));
    }
    let mut x = cx.req(0)?.clone();
    if layout == 1 {
        x = transpose(&x, &[1, 0, 2]);
    }
    let (seq, batch, isz) = (x.shape[0], x.shape[1], x.shape[2]);
    let dirs = if o.direction() == "bidirectional" { 2 } else { 1 };
    let h = o.hidden_size.unwrap_or(0) as usize;
    let state = |i: usize| -> Result<Option<Vec<f64>>> {
        cx.opt(i).map(|a| if layout == 1 { transpose(a, &[1, 0, 2]).to_f64() } else { a.to_f64() }).transpose()
    };
    let bp = Bptt {
        kind,
        g: gates,
        h,
        isz,
        seq,
        batch,

        x: x.to_f64()?,
        w: cx.req(1)?.to_f64()?,
        r: cx.req(2)?.to_f64()?,
        bias: cx.opt(3).map(|b| b.to_f64()).transpose()?.unwrap_or_else(|| vec![0.0; dirs * 2 * gates * h]),
        lens: match cx.opt(4) {
            Some(l) => l.to_i64()?.iter().map(|&v| v.max(0) as usize).collect(),
            None => vec![seq; batch],
        },
        h0: state(5)?,
        c0: if kind == "LSTM" { state(6)? } else { None },
        peep: if kind == "LSTM" { cx.opt(7).map(|a| a.to_f64()).transpose()? } else { None },
        clip: o.clip.map(f64::from),
        lbr: o.linear_before_reset() != 0,
        input_forget: o.input_forget() != 0,
    };
    if bp.w.len() != dirs * gates * h * isz || bp.r.len() != dirs * gates * h * h {
        return Err(EvalError::Invalid("RecurrentGrad weights do not fit".into()));
    }
    check_operands(
        "RecurrentGrad",
        dirs,
        gates,
        h,
        batch,
        &bp.bias,
        &bp.lens,
        bp.h0.as_deref(),
        bp.c0.as_deref(),
        bp.peep.as_deref(),
    )?;
    let out_len = |i: usize| cx.opt(i).map(|a| a.numel());
    if out_len(8).is_some_and(|n| n != seq * dirs * batch * h)
        || out_len(9).is_some_and(|n| n != dirs * batch * h)
        || out_len(10).is_some_and(|n| n != dirs * batch * h)
    {
        return Err(EvalError::Invalid("RecurrentGrad: output gradients of other shapes than the outputs".into()));
    }
    let acts = activations_of(o, kind, dirs)?;
    // Output gradients, as [seq, dirs, batch, h] and [dirs, batch, h].
    let dy = match cx.opt(8) {
        Some(a) => Some(if layout == 1 { transpose(a, &[1, 2, 0, 3]) } else { a.clone() }.to_f64()?),
        None => None,
    };
    let dyh =
        cx.opt(9).map(|a| if layout == 1 { transpose(a, &[1, 0, 2]).to_f64() } else { a.to_f64() }).transpose()?;
    let dyc =
        cx.opt(10).map(|a| if layout == 1 { transpose(a, &[1, 0, 2]).to_f64() } else { a.to_f64() }).transpose()?;
    let (g, hh) = (gates, h);
    let mut dx = vec![0.0; seq * batch * isz];
    let mut dw = vec![0.0; bp.w.len()];
    let mut dr = vec![0.0; bp.r.len()];
    let mut db = vec![0.0; dirs * 2 * g * hh];
    let mut dh0 = vec![0.0; dirs * batch * hh];
    let mut dc0 = vec![0.0; dirs * batch * hh];
    let mut dp = vec![0.0; dirs * 3 * hh];
    for d in 0..dirs {
        let reverse = o.direction() == "reverse" || d == 1;
        let act = &acts[d];
        let wd = &bp.w[d * g * hh * isz..(d + 1) * g * hh * isz];
        let rd = &bp.r[d * g * hh * hh..(d + 1) * g * hh * hh];
        let p = bp.peep.as_ref().map(|p| p[d * 3 * hh..(d + 1) * 3 * hh].to_vec());
        for b in 0..batch {
            let tape = bp.forward(d, b, act, reverse);
            let idx = (d * batch + b) * hh;
            let mut dh: Vec<f64> = dyh.as_ref().map_or(vec![0.0; hh], |v| v[idx..idx + hh].to_vec());
            let mut dc: Vec<f64> = dyc.as_ref().map_or(vec![0.0; hh], |v| v[idx..idx + hh].to_vec());
            for st in tape.iter().rev() {
                if let Some(dy) = &dy {
                    let yo = ((st.t * dirs + d) * batch + b) * hh;
                    for k in 0..hh {
                        dh[k] += dy[yo + k];
                    }
                }
                // Gradients of the gate pre-activations (gate order), and of the state.
                let mut da = vec![0.0; g * hh];
                let mut dh_prev = vec![0.0; hh];
                let mut dc_prev = vec![0.0; hh];
                match kind {
                    "LSTM" => st.lstm_grad(
                        act,
                        p.as_deref(),
                        bp.input_forget,
                        (&dh, &dc),
                        &mut da,
                        &mut dc_prev,
                        &mut dp[d * 3 * hh..(d + 1) * 3 * hh],
                    ),
                    "GRU" => {
                        let rb_at = d * 2 * g * hh + g * hh + 2 * hh;
                        let dr_d = &mut dr[d * g * hh * hh..(d + 1) * g * hh * hh];
                        st.gru_grad(act, rd, bp.lbr, &dh, (&mut da, &mut dh_prev), dr_d, &mut db[rb_at..rb_at + hh]);
                    }
                    _ => {
                        for k in 0..hh {
                            da[k] = dh[k] * (act[0].1)(st.pre[k]) * f64::from(u8::from(st.live[k]));
                        }
                    }
                }
                // Input and recurrent GEMMs (for GRU's candidate, only the input part and,
                // with linear_before_reset, nothing more: its recurrent part is done above).
                let xo = (st.t * batch + b) * isz;
                for j in 0..g * hh {
                    let a = da[j];
                    if a == 0.0 {
                        continue;
                    }
                    db[d * 2 * g * hh + j] += a;
                    for q in 0..isz {
                        dw[d * g * hh * isz + j * isz + q] += a * bp.x[xo + q];
                        dx[xo + q] += a * wd[j * isz + q];
                    }
                    let candidate = kind == "GRU" && j >= 2 * hh;
                    if !candidate {
                        db[d * 2 * g * hh + g * hh + j] += a;
                        for q in 0..hh {
                            dr[d * g * hh * hh + j * hh + q] += a * st.h_prev[q];
                            dh_prev[q] += a * rd[j * hh + q];
                        }
                    }
                }
                dh = dh_prev;
                if kind == "LSTM" {
                    dc = dc_prev;
                }
            }
            dh0[idx..idx + hh].copy_from_slice(&dh);
            if kind == "LSTM" {
                dc0[idx..idx + hh].copy_from_slice(&dc);
            }
        }
    }
    let dt = cx.req(0)?.dtype;
    let mut dxa = Array::float(dt, vec![seq, batch, isz], dx);
    let mut dh0a = Array::float(dt, vec![dirs, batch, hh], dh0);
    let mut dc0a = Array::float(dt, vec![dirs, batch, hh], dc0);
    if layout == 1 {
        dxa = transpose(&dxa, &[1, 0, 2]);
        dh0a = transpose(&dh0a, &[1, 0, 2]);
        dc0a = transpose(&dc0a, &[1, 0, 2]);
    }
    Ok(vec![
        dxa,
        Array::float(dt, cx.req(1)?.shape.clone(), dw),
        Array::float(dt, cx.req(2)?.shape.clone(), dr),
        Array::float(dt, vec![dirs, 2 * g * hh], db),
        dh0a,
        dc0a,
        Array::float(dt, vec![dirs, 3 * hh], dp),
    ])
}

impl OpRules for op::RecurrentGrad {
    fn matrix_units(&self) -> bool {
        true
    }

    fn arity(&self) -> Arity {
        Arity::new(3, 11, 7, 7)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dt = cx.dtype();
        let wd = cx.dims(1).cloned();
        let dirs = Dim::Fixed(if self.direction() == "bidirectional" { 2 } else { 1 });
        let gates: i64 = match self.cell.as_deref() {
            Some("LSTM") | None => 4,
            Some("GRU") => 3,
            _ => 1,
        };
        let h = self.hidden_size.unwrap_or(0);
        let batch =
            cx.dims(0).and_then(|d| d.get(if self.layout() == 0 { 1 } else { 0 }).cloned()).unwrap_or(Dim::Unknown);
        let st = if self.layout() == 0 {
            vec![dirs.clone(), batch, Dim::Fixed(h)]
        } else {
            vec![batch, dirs.clone(), Dim::Fixed(h)]
        };
        Ok(vec![
            cx.input(0).cloned(),
            cx.with(dt, wd),
            cx.input(2).cloned(),
            cx.with(dt, Some(vec![dirs.clone(), Dim::Fixed(2 * gates * h)])),
            cx.with(dt, Some(st.clone())),
            cx.with(dt, Some(st)),
            cx.with(dt, Some(vec![dirs, Dim::Fixed(3 * h)])),
        ])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let xd = cx.in_dims(0);
        let wd = cx.in_dims(1);
        if xd.len() != 3 || wd.len() != 3 {
            return Work::none();
        }
        let (dirs, gh, isz) = (wd[0] as f64, wd[1] as f64, wd[2] as f64);
        let h = self.hidden_size.unwrap_or(1) as f64;
        // Forward recomputed, then the data and weight GEMMs.
        Work::flops(3.0 * 2.0 * dirs * (xd[0] * xd[1]) as f64 * gh * (isz + h))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        recurrent_grad(self, cx)
    }
}
