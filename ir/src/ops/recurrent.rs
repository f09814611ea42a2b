//! Recurrent layers: `LSTM`, `GRU` and `RNN` (forward, reverse, bidirectional; layout 0 or
//! 1; initial states, sequence lengths, peepholes, clipping, custom activations).
//!
//! Their iteration space is the batch (parallel) and the time steps (a recurrence: whole).
//! Their kernels run once per time step, and re-read the recurrent weights each step.

use super::util::join;
use super::{Arity, Arrays, Backward, EvalCx, FlowCx, InferCx, Mono, NodeCx, OpRules, Types, Work};
use crate::cost::TRANSCENDENTAL_FLOPS;
use crate::eval::{Array, EvalError, transpose};
use crate::op;
use crate::shard::{DimKind, DimRole, IterDim, IterSpace};
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
    let h0 = cx.opt(5).map(|a| a.to_f64()).transpose()?;
    let c0 = if r.kind == "LSTM" { cx.opt(6).map(|a| a.to_f64()).transpose()? } else { None };
    let peep = if r.kind == "LSTM" { cx.opt(7).map(|a| a.to_f64()).transpose()? } else { None };
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
