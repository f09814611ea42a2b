//! Optimizer kernels: momentum SGD and Adam/AdamW, one invocation per parameter element,
//! float32 arithmetic in torch's order; the step counter is read from its int buffer on the
//! device (so the same program serves every step), the hyper-parameters are constants.

use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, groups};
use super::wgsl::{Binding, f32_lit, source};

impl Kernel for op::SgdUpdate {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(p), Some(_), Some(b), Some(_)) = (cx.input(0), cx.input(1), cx.input(2), cx.input(3)) else {
            return Ok(None);
        };
        if p.elem() != Elem::F32 {
            return Ok(None);
        }
        let mut c = Compiled::new(vec![(p.shape.clone(), p.dtype), (b.shape.clone(), b.dtype)]);
        let momentum = self.momentum() != 0.0;
        if !momentum {
            // Without momentum the buffer passes through unchanged: no copy of it.
            c.outputs[1].view_of = Some(2);
        }
        let n = p.numel();
        if n > 0 {
            let bufs = if momentum {
                vec![Buf::In(0), Buf::In(1), Buf::In(2), Buf::In(3), Buf::Out(0), Buf::Out(1)]
            } else {
                vec![Buf::In(0), Buf::In(1), Buf::Out(0)]
            };
            c.launch(sgd_src(self), bufs, vec![n as u32], groups(n));
        }
        Ok(Some(c))
    }
}

/// `P = [count]`; bindings P0, G, B, T (int step), P1, B1 — without momentum only P0, G, P1
/// (the buffer's next value is the buffer itself).
pub fn sgd_src(o: &op::SgdUpdate) -> String {
    let momentum = o.momentum() != 0.0;
    let b: Vec<Binding<'_>> = if momentum {
        vec![
            ("Pa", Elem::F32, false),
            ("G", Elem::F32, false),
            ("B", Elem::F32, false),
            ("T", Elem::I32, false),
            ("Pn", Elem::F32, true),
            ("Bn", Elem::F32, true),
        ]
    } else {
        vec![("Pa", Elem::F32, false), ("G", Elem::F32, false), ("Pn", Elem::F32, true)]
    };
    let (lr, mu, damp, wd) = (
        f32_lit(f64::from(o.lr.unwrap_or(0.01))),
        f32_lit(f64::from(o.momentum())),
        f32_lit(f64::from(o.dampening())),
        f32_lit(f64::from(o.weight_decay())),
    );
    let nesterov = o.nesterov() != 0;
    let mut body = format!("    var d = G[i];\n    let p = Pa[i];\n    d = d + {wd} * p;\n");
    if momentum {
        body.push_str(&format!(
            "    var buf = B[i];\n    if (T[0] == 1) {{ buf = d; }} else {{ buf = {mu} * buf + (1.0 - {damp}) * d; }}\n"
        ));
        body.push_str(&if nesterov { format!("    d = d + {mu} * buf;\n") } else { "    d = buf;\n".to_string() });
        body.push_str("    Bn[i] = buf;\n");
    }
    body.push_str(&format!("    Pn[i] = p + -{lr} * d;"));
    source(&b, "", &body)
}

impl Kernel for op::AdamUpdate {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let ins: Vec<_> = (0..5).map(|k| cx.input(k)).collect();
        let (Some(p), Some(m), Some(v)) = (ins[0], ins[2], ins[3]) else { return Ok(None) };
        if ins.iter().any(Option::is_none) || p.elem() != Elem::F32 {
            return Ok(None);
        }
        let mut c =
            Compiled::new(vec![(p.shape.clone(), p.dtype), (m.shape.clone(), m.dtype), (v.shape.clone(), v.dtype)]);
        let n = p.numel();
        if n > 0 {
            let bufs =
                vec![Buf::In(0), Buf::In(1), Buf::In(2), Buf::In(3), Buf::In(4), Buf::Out(0), Buf::Out(1), Buf::Out(2)];
            c.launch(adam_src(self), bufs, vec![n as u32], groups(n));
        }
        Ok(Some(c))
    }
}

/// `P = [count]`; bindings P0, G, M, V, T (int step), P1, M1, V1. The bias corrections
/// `1 − βᵗ` from the step on the device (float32).
pub fn adam_src(o: &op::AdamUpdate) -> String {
    let b: Vec<Binding<'_>> = vec![
        ("Pa", Elem::F32, false),
        ("G", Elem::F32, false),
        ("M", Elem::F32, false),
        ("V", Elem::F32, false),
        ("T", Elem::I32, false),
        ("Pn", Elem::F32, true),
        ("Mn", Elem::F32, true),
        ("Vn", Elem::F32, true),
    ];
    let lit = |x: f32| f32_lit(f64::from(x));
    let (lr, b1, b2, eps, wd) =
        (lit(o.lr.unwrap_or(1e-3)), lit(o.beta1()), lit(o.beta2()), lit(o.epsilon()), lit(o.weight_decay()));
    // 1 − βᵗ = −expm1(t·ln β), by its series where it is small: `1.0 − pow(β, t)` in float32
    // loses most digits of 1 − 0.999ᵗ in the first steps, which Adam's update then divides by.
    let (lb1, lb2) = (f32_lit(f64::from(o.beta1()).ln()), f32_lit(f64::from(o.beta2()).ln()));
    let decay = if o.decoupled() != 0 {
        format!("    p = p * (1.0 - {lr} * {wd});\n")
    } else {
        format!("    g = g + {wd} * p;\n")
    };
    let body = format!(
        "    var p = Pa[i];
    var g = G[i];
{decay}    let t = f32(T[0]);
    let bc1 = one_minus_exp(t * {lb1});
    let bc2 = one_minus_exp(t * {lb2});
    let m = M[i] + (1.0 - {b1}) * (g - M[i]);
    let v = V[i] * {b2} + (1.0 - {b2}) * g * g;
    let denom = sqrt(v) / sqrt(bc2) + {eps};
    Pn[i] = p + -({lr} / bc1) * (m / denom);
    Mn[i] = m;
    Vn[i] = v;"
    );
    let helper = "fn one_minus_exp(x: f32) -> f32 {
    if (x > -0.1) {
        return -(x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0))))));
    }
    return 1.0 - exp(x);
}
";
    source(&b, helper, &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn optimizer_kernels_validate() {
        for (mu, nest) in [(0.0, 0), (0.9, 0), (0.9, 1)] {
            validate(
                "sgd",
                &sgd_src(&op::SgdUpdate {
                    momentum: Some(mu),
                    nesterov: Some(nest),
                    lr: Some(0.1),
                    ..Default::default()
                }),
            );
        }
        for dec in [0, 1] {
            validate("adam", &adam_src(&op::AdamUpdate { decoupled: Some(dec), lr: Some(0.01), ..Default::default() }));
        }
    }
}
