//! Element-wise kernels: one WGSL expression per op over broadcast inputs (unary maths and
//! activations, binary arithmetic, comparisons, logic), `Where`, casts, `Clip`, the variadic
//! folds, and the ops that are views (`Identity`, inference `Dropout`).

use ir::DType;
use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, TensorDesc};
use super::wgsl::{elementwise, f32_lit};

/// Runs `expr` of `a` over input 0 into output 0, when the output storage is `out_elem`.
fn unary(cx: &CompileCx<'_>, x: &TensorDesc<'_>, expr: Option<String>, out_elem: Elem) -> CompileResult {
    let (Some(expr), Some(mut c)) = (expr, Compiled::like_out0(cx)) else { return Ok(None) };
    let shape = c.outputs[0].shape.clone();
    if Elem::of(c.outputs[0].dtype) != out_elem {
        return Ok(None);
    }
    elementwise(&mut c, &[(Buf::In(0), &x.shape, x.elem())], (Buf::Out(0), out_elem), &shape, &expr);
    Ok(Some(c))
}

/// Unary ops: `Name: |self, a, float?| expression of a` (`None`: no kernel for that storage),
/// and for an op with a gradient `d |self| its derivative times dY` over `a` (X), `b` (Y) and
/// `c` (dY).
macro_rules! unary_kernels {
    ($($name:ident $(-> $out:ident)?: |$s:ident, $a:ident, $f:ident| $expr:expr $(, d |$ds:ident| $d:expr)?;)*) => {$(
        impl Kernel for op::$name {
            #[allow(unused_variables)]
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let $s = self;
                let Some(x) = cx.input(0) else { return Ok(None) };
                let $f = x.elem() == Elem::F32;
                let $a = "a";
                let out = x.elem();
                $(let out = Elem::$out;)?
                let expr: Option<String> = $expr;
                unary(cx, x, expr, out)
            }

            $(
                fn derivative(&self) -> Option<String> {
                    let $ds = self;
                    $d
                }
            )?
        }
    )*};
}

/// Only for float storage.
fn float(f: bool, e: String) -> Option<String> {
    f.then_some(e)
}

unary_kernels! {
    Relu: |_s, a, f| Some(if f { format!("select(0.0, {a}, {a} > 0.0 || isnan_({a}))") } else { format!("max({a}, 0)") }),
        d |_s| Some("select(0.0, c, a > 0.0)".into());
    Abs: |_s, a, f| Some(format!("abs({a})")),
        d |_s| Some("c * sign(a)".into());
    Neg: |_s, a, f| Some(format!("-{a}")),
        d |_s| Some("-c".into());
    Sign: |_s, a, f| Some(if f { format!("select(sign({a}), {a}, isnan_({a}))") } else { format!("sign({a})") });
    Sigmoid: |_s, a, f| float(f, format!("sigmoid_({a})")),
        d |_s| Some("c * b * (1.0 - b)".into());
    Tanh: |_s, a, f| float(f, format!("tanh_({a})")),
        d |_s| Some("c * (1.0 - b * b)".into());
    Exp: |_s, a, f| float(f, format!("exp({a})")),
        d |_s| Some("c * b".into());
    Log: |_s, a, f| float(f, format!("log({a})")),
        d |_s| Some("c / a".into());
    Sqrt: |_s, a, f| float(f, format!("sqrt({a})")),
        d |_s| Some("c * 0.5 / b".into());
    Reciprocal: |_s, a, f| float(f, format!("1.0 / {a}")),
        d |_s| Some("-c * b * b".into());
    Floor: |_s, a, f| float(f, format!("floor({a})"));
    Ceil: |_s, a, f| float(f, format!("ceil({a})"));
    Round: |_s, a, f| float(f, format!("round_even_({a})"));
    Sin: |_s, a, f| float(f, format!("sin({a})")),
        d |_s| Some("c * cos(a)".into());
    Cos: |_s, a, f| float(f, format!("cos({a})")),
        d |_s| Some("-c * sin(a)".into());
    Tan: |_s, a, f| float(f, format!("tan({a})")),
        d |_s| Some("c * (1.0 + b * b)".into());
    Asin: |_s, a, f| float(f, format!("asin({a})")),
        d |_s| Some("c / sqrt(1.0 - a * a)".into());
    Acos: |_s, a, f| float(f, format!("acos({a})")),
        d |_s| Some("-c / sqrt(1.0 - a * a)".into());
    Atan: |_s, a, f| float(f, format!("atan({a})")),
        d |_s| Some("c / (1.0 + a * a)".into());
    Sinh: |_s, a, f| float(f, format!("sinh({a})")),
        d |_s| Some("c * cosh(a)".into());
    Cosh: |_s, a, f| float(f, format!("cosh({a})")),
        d |_s| Some("c * sinh(a)".into());
    Asinh: |_s, a, f| float(f, format!("asinh({a})")),
        d |_s| Some("c / sqrt(a * a + 1.0)".into());
    Acosh: |_s, a, f| float(f, format!("acosh({a})")),
        d |_s| Some("c / sqrt(a * a - 1.0)".into());
    Atanh: |_s, a, f| float(f, format!("atanh({a})")),
        d |_s| Some("c / (1.0 - a * a)".into());
    Erf: |_s, a, f| float(f, format!("erf_({a})")),
        d |_s| Some("c * 1.1283791670955126 * exp(-a * a)".into());
    Softplus: |_s, a, f| float(f, format!("softplus_({a})")),
        d |_s| Some("c * sigmoid_(a)".into());
    Softsign: |_s, a, f| float(f, format!("{a} / (1.0 + abs({a}))")),
        d |_s| Some("c / ((1.0 + abs(a)) * (1.0 + abs(a)))".into());
    Elu: |s, a, f| float(f, format!("select({} * (exp({a}) - 1.0), {a}, {a} >= 0.0)", f32_lit(f64::from(s.alpha())))),
        d |s| Some(format!("select(c * (b + {}), c, a > 0.0)", f32_lit(f64::from(s.alpha()))));
    Celu: |s, a, f| {
        let al = f32_lit(f64::from(s.alpha()));
        float(f, format!("max(0.0, {a}) + min(0.0, {al} * (exp({a} / {al}) - 1.0))"))
    },
        d |s| Some(format!("select(c * exp(a / {}), c, a > 0.0)", f32_lit(f64::from(s.alpha()))));
    Selu: |s, a, f| {
        let (al, ga) = (f32_lit(f64::from(s.alpha())), f32_lit(f64::from(s.gamma())));
        float(f, format!("{ga} * select({al} * (exp({a}) - 1.0), {a}, {a} > 0.0)"))
    },
        d |s| Some({
            let ga = f32_lit(f64::from(s.gamma()));
            format!("select(c * {ga} * {} * exp(a), c * {ga}, a > 0.0)", f32_lit(f64::from(s.alpha())))
        });
    LeakyRelu: |s, a, f| float(f, format!("select({} * {a}, {a}, {a} >= 0.0)", f32_lit(f64::from(s.alpha())))),
        d |s| Some(format!("select({} * c, c, a > 0.0)", f32_lit(f64::from(s.alpha()))));
    ThresholdedRelu: |s, a, f| float(f, format!("select(0.0, {a}, {a} > {})", f32_lit(f64::from(s.alpha())))),
        d |s| Some(format!("select(0.0, c, a > {})", f32_lit(f64::from(s.alpha()))));
    HardSigmoid: |s, a, f| {
        float(f, format!("fclamp_({} * {a} + {}, 0.0, 1.0)", f32_lit(f64::from(s.alpha())), f32_lit(f64::from(s.beta()))))
    },
        d |s| Some({
            let v = format!("({} * a + {})", f32_lit(f64::from(s.alpha())), f32_lit(f64::from(s.beta())));
            format!("select(0.0, c * {}, {v} > 0.0 && {v} < 1.0)", f32_lit(f64::from(s.alpha())))
        });
    HardSwish: |_s, a, f| float(f, format!("{a} * clamp({a} / 6.0 + 0.5, 0.0, 1.0)")),
        d |_s| Some("select(select(c * (a / 3.0 + 0.5), c, a > 3.0), 0.0, a < -3.0)".into());
    Mish: |_s, a, f| float(f, format!("{a} * tanh_(softplus_({a}))")),
        d |_s| Some("c * (tanh_(softplus_(a)) + a * (1.0 - tanh_(softplus_(a)) * tanh_(softplus_(a))) * sigmoid_(a))".into());
    Swish: |s, a, f| float(f, format!("{a} * sigmoid_({} * {a})", f32_lit(f64::from(s.alpha())))),
        d |s| {
            let al = f32_lit(f64::from(s.alpha()));
            let sg = format!("sigmoid_({al} * a)");
            Some(format!("c * ({sg} + {al} * a * {sg} * (1.0 - {sg}))"))
        };
    Shrink: |s, a, f| {
        let (b, l) = (f32_lit(f64::from(s.bias())), f32_lit(f64::from(s.lambd())));
        float(f, format!("select(select(0.0, {a} - {b}, {a} > {l}), {a} + {b}, {a} < -{l})"))
    },
        d |s| Some(format!("select(0.0, c, abs(a) > {})", f32_lit(f64::from(s.lambd()))));
    Gelu: |s, a, f| float(
        f,
        if s.approximate() == "tanh" {
            format!("0.5 * {a} * (1.0 + tanh_(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a})))")
        } else {
            format!("0.5 * {a} * (1.0 + erf_({a} * 0.7071067811865476))")
        },
    ),
        d |s| Some({
            if s.approximate() == "tanh" {
                "c * (0.5 * (1.0 + tanh_(0.7978845608028654 * (a + 0.044715 * a * a * a))) + 0.5 * a * (1.0 - tanh_(0.7978845608028654 * (a + 0.044715 * a * a * a)) * tanh_(0.7978845608028654 * (a + 0.044715 * a * a * a))) * 0.7978845608028654 * (1.0 + 0.134145 * a * a))".into()
            } else {
                "c * (0.5 * (1.0 + erf_(a * 0.7071067811865476)) + a * exp(-0.5 * a * a) * 0.3989422804014327)".into()
            }
        });
    IsNaN -> I32: |_s, a, f| float(f, format!("select(0, 1, isnan_({a}))"));
    IsInf -> I32: |s, a, f| {
        let (pos, neg) = (s.detect_positive() != 0, s.detect_negative() != 0);
        float(f, format!("select(0, 1, isinf_({a}) && (({a} > 0.0 && {pos}) || ({a} < 0.0 && {neg})))"))
    };
    Not: |_s, a, f| (!f).then(|| format!("1 - {a}"));
}

/// A cast between element storages as an expression on `a`.
pub fn cast_expr(from: DType, to: DType) -> String {
    match (Elem::of(from), Elem::of(to), to == DType::Bool) {
        (Elem::F32, Elem::F32, _) => "a".into(),
        (Elem::F32, Elem::I32, true) => "select(0, 1, a != 0.0)".into(),
        (Elem::F32, Elem::I32, false) => "i32(clamp(trunc(a), -2147483648.0, 2147483520.0))".into(),
        (Elem::I32, Elem::F32, _) => "f32(a)".into(),
        (Elem::I32, Elem::I32, true) => "select(0, 1, a != 0)".into(),
        (Elem::I32, Elem::I32, false) => "a".into(),
    }
}

fn cast(cx: &CompileCx<'_>) -> CompileResult {
    let (Some(x), Some((_, to))) = (cx.input(0), cx.out0()) else { return Ok(None) };
    if x.dtype == DType::String || *to == DType::String {
        return Ok(None);
    }
    unary(cx, x, Some(cast_expr(x.dtype, *to)), Elem::of(*to))
}

impl Kernel for op::Cast {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        cast(cx)
    }
}

impl Kernel for op::CastLike {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        cast(cx)
    }
}

/// `Clip` of `a` (storage `e`) to `[lo, hi]`.
pub fn clip_expr(e: Elem, lo: f64, hi: f64) -> String {
    if e == Elem::F32 {
        // NaN stays NaN (WGSL's min and max may drop it).
        format!("select(min(max(a, {}), {}), a, isnan_(a))", f32_lit(lo), f32_lit(hi))
    } else {
        format!("min(max(a, {}), {})", lo.max(i32::MIN as f64) as i32, hi.min(i32::MAX as f64) as i32)
    }
}

impl Kernel for op::Clip {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        let bound = |k: usize, attr: Option<f32>, default: f64| -> Result<f64, String> {
            match cx.input(k) {
                Some(t) => t.floats().and_then(|v| v.first().copied()).ok_or_else(|| "Clip bound unknown".to_string()),
                None => Ok(attr.map_or(default, f64::from)),
            }
        };
        let (lo, hi) = (bound(1, self.min, f64::NEG_INFINITY)?, bound(2, self.max, f64::INFINITY)?);
        unary(cx, x, Some(clip_expr(x.elem(), lo, hi)), x.elem())
    }

    fn value_inputs(&self) -> &'static [usize] {
        &[1, 2]
    }
}

/// Views: the output is the input's buffer with the output's shape.
macro_rules! view_kernels {
    ($($name:ident),*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                if cx.input(0).is_none() {
                    return Ok(None);
                }
                Ok(Compiled::view(cx))
            }
        }
    )*};
}

view_kernels!(Identity, Reshape, Flatten, Squeeze, Unsqueeze);

/// Inference dropout: the input, and a mask of ones; training mode runs on the host.
impl Kernel for op::Dropout {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        if let Some(t) = cx.input(2) {
            match t.ints() {
                Some(v) if v.first().copied().unwrap_or(0) == 0 => {}
                _ => return Ok(None),
            }
        }
        let Some(mut c) = Compiled::view(cx) else { return Ok(None) };
        if let Some(Some((shape, dtype))) = cx.outs.get(1) {
            c.outputs.push(super::compile::OutSpec { shape: shape.clone(), dtype: *dtype, view_of: None });
            elementwise(&mut c, &[(Buf::In(0), &x.shape, x.elem())], (Buf::Out(1), Elem::of(*dtype)), shape, "1");
        }
        Ok(Some(c))
    }

    fn value_inputs(&self) -> &'static [usize] {
        &[2]
    }
}

/// Binary ops: `Name (bool output?): |self, float?| expression of a, b`.
macro_rules! binary_kernels {
    ($($name:ident $($pred:ident)?: |$s:ident, $f:ident| $expr:expr;)*) => {$(
        impl Kernel for op::$name {
            #[allow(unused_variables)]
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let $s = self;
                let (Some(a), Some(b)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
                if a.elem() != b.elem() {
                    return Ok(None);
                }
                let $f = a.elem() == Elem::F32;
                let expr: Option<String> = $expr;
                let (Some(expr), Some(mut c)) = (expr, Compiled::like_out0(cx)) else { return Ok(None) };
                let (shape, dtype) = (c.outputs[0].shape.clone(), c.outputs[0].dtype);
                let out = if false $(|| stringify!($pred) == "bool")? { Elem::I32 } else { a.elem() };
                if Elem::of(dtype) != out {
                    return Ok(None);
                }
                let ins = [(Buf::In(0), a.shape.as_slice(), a.elem()), (Buf::In(1), b.shape.as_slice(), b.elem())];
                elementwise(&mut c, &ins, (Buf::Out(0), out), &shape, &expr);
                Ok(Some(c))
            }
        }
    )*};
}

fn cmp(c: &str) -> Option<String> {
    Some(format!("select(0, 1, a {c} b)"))
}

binary_kernels! {
    Add: |_s, f| Some("a + b".into());
    Sub: |_s, f| Some("a - b".into());
    Mul: |_s, f| Some("a * b".into());
    Div: |_s, f| Some("a / b".into());
    Pow: |_s, f| float(f, "pow_(a, b)".into());
    Mod: |s, f| Some(match (s.fmod() != 0, f) {
        (true, true) => "fmod_(a, b)".into(),
        (true, false) => "a % b".into(),
        // The remainder with the divisor's sign (as numpy's mod: an infinite divisor keeps a
        // finite dividend, where a − b·floor(a/b) would give NaN).
        (false, true) => "select(fmod_(a, b), fmod_(a, b) + b, fmod_(a, b) != 0.0 && ((fmod_(a, b) < 0.0) != (b < 0.0)))".into(),
        (false, false) => "imod_(a, b)".into(),
    });
    PRelu: |_s, f| float(f, "select(a * b, a, a >= 0.0)".into());
    Equal bool: |_s, f| cmp("==");
    Less bool: |_s, f| cmp("<");
    LessOrEqual bool: |_s, f| cmp("<=");
    Greater bool: |_s, f| cmp(">");
    GreaterOrEqual bool: |_s, f| cmp(">=");
    And bool: |_s, f| (!f).then(|| "a & b".into());
    Or bool: |_s, f| (!f).then(|| "a | b".into());
    Xor bool: |_s, f| (!f).then(|| "a ^ b".into());
}

/// Variadic folds: `Name: binary expression, the same for floats, mean?`; the inputs fold pairwise through
/// scratch buffers.
macro_rules! variadic_kernels {
    ($($name:ident: $expr:expr, $fexpr:expr, $mean:expr;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let all: Vec<(usize, &TensorDesc<'_>)> = cx.ins.iter().enumerate().filter_map(|(k, t)| t.as_ref().map(|t| (k, t))).collect();
                let Some(&(_, first)) = all.first() else { return Ok(None) };
                if all.iter().any(|(_, t)| t.elem() != first.elem()) {
                    return Ok(None);
                }
                let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
                let (shape, dtype) = (c.outputs[0].shape.clone(), c.outputs[0].dtype);
                let e = first.elem();
                let mean = $mean && all.len() > 1;
                let steps = all.len().max(2) - 1 + usize::from(mean);
                let mut acc: (Buf, Vec<usize>) = (Buf::In(all[0].0), all[0].1.shape.clone());
                for s in 0..steps {
                    let dst = if s + 1 == steps { Buf::Out(0) } else { c.temp(shape.clone(), dtype) };
                    if all.len() == 1 {
                        elementwise(&mut c, &[(acc.0, &acc.1, e)], (dst, e), &shape, "a");
                    } else if s + 1 < all.len() {
                        let (k, t) = all[s + 1];
                        let expr: &str = if e == Elem::F32 { $fexpr } else { $expr };
                        elementwise(&mut c, &[(acc.0, &acc.1, e), (Buf::In(k), &t.shape, e)], (dst, e), &shape, expr);
                    } else {
                        let scale = f32_lit(1.0 / all.len() as f64);
                        elementwise(&mut c, &[(acc.0, &acc.1, e)], (dst, e), &shape, &format!("a * {scale}"));
                    }
                    acc = (dst, shape.clone());
                }
                Ok(Some(c))
            }
        }
    )*};
}

variadic_kernels! {
    Sum: "a + b", "a + b", false;
    Mean: "a + b", "a + b", true;
    Max: "max(a, b)", "fmax_(a, b)", false;
    Min: "min(a, b)", "fmin_(a, b)", false;
}

/// `Where` over the bindings A (condition), B (x), C (y).
pub const WHERE_EXPR: &str = "select(c, b, a != 0)";

impl Kernel for op::Where {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(cond), Some(a), Some(b)) = (cx.input(0), cx.input(1), cx.input(2)) else { return Ok(None) };
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let (shape, dtype) = (c.outputs[0].shape.clone(), c.outputs[0].dtype);
        if a.elem() != b.elem() {
            return Ok(None);
        }
        let ins = [
            (Buf::In(0), cond.shape.as_slice(), cond.elem()),
            (Buf::In(1), a.shape.as_slice(), a.elem()),
            (Buf::In(2), b.shape.as_slice(), b.elem()),
        ];
        elementwise(&mut c, &ins, (Buf::Out(0), Elem::of(dtype)), &shape, WHERE_EXPR);
        Ok(Some(c))
    }
}

/// The derivative of the element-wise op whose gradient `g` computes, times dY, over the
/// bindings `a` (X), `b` (Y) and `c` (dY): that op's own kernel's ([`Kernel::derivative`]),
/// as its rule ([`ir::ops::OpRules::derivative`]) computes it; `None` for an op without one.
pub fn derivative_expr(g: &op::ElementwiseGrad) -> Option<String> {
    super::compile::derivative(&g.forward()?)
}

impl Kernel for op::ElementwiseGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(y), Some(dy)) = (cx.input(0), cx.input(1), cx.input(2)) else { return Ok(None) };
        if [x, y, dy].iter().any(|t| t.elem() != Elem::F32) {
            return Ok(None);
        }
        let (Some(expr), Some(mut c)) = (derivative_expr(self), Compiled::like_out0(cx)) else { return Ok(None) };
        let shape = c.outputs[0].shape.clone();
        let ins = [
            (Buf::In(0), &x.shape[..], Elem::F32),
            (Buf::In(1), &y.shape[..], Elem::F32),
            (Buf::In(2), &dy.shape[..], Elem::F32),
        ];
        elementwise(&mut c, &ins, (Buf::Out(0), Elem::F32), &shape, &expr);
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use ir::{DType, Op};

    use super::*;
    use crate::runtime::gpu::compile::compile;
    use crate::runtime::gpu::wgsl::validate;

    /// Every element-wise op on both storages, with inputs read flat, as a scalar and
    /// broadcast from `[3, 1]` against a `[2, 3, 4]` output.
    #[test]
    fn every_elementwise_kernel_validates() {
        let shapes: [&[usize]; 3] = [&[2, 3, 4], &[1], &[3, 1]];
        let mut n = 0;
        for (domain, ty) in Op::known_op_types() {
            let Ok(op) = Op::from_parts(domain, ty, Vec::new()) else { continue };
            if !matches!(op.class(), ir::OpClass::Unary | ir::OpClass::Binary | ir::OpClass::Variadic) {
                continue;
            }
            let arity = op.arity().min_in.max(1);
            for dtype in [DType::Float, DType::Int32] {
                for &sa in &shapes {
                    for &sb in &shapes {
                        let desc = |shape: &[usize]| Some(TensorDesc { shape: shape.to_vec(), dtype, value: None });
                        let cond = Some(TensorDesc { shape: sb.to_vec(), dtype: DType::Bool, value: None });
                        let ins = match (ty, arity) {
                            (&"Where", _) => vec![cond, desc(sa), desc(sb)],
                            (_, 1) => vec![desc(sa)],
                            _ => vec![desc(sa), desc(sb)],
                        };
                        let out = if matches!(op, Op::IsNaN(_) | Op::IsInf(_)) { DType::Bool } else { dtype };
                        let cx = CompileCx { ins, outs: vec![Some((vec![2, 3, 4], out))], opset: 18, subgroup: None };
                        if let Ok(Some(c)) = compile(&op, &cx) {
                            for l in c.launches() {
                                validate(&format!("{ty} {dtype:?}"), &l.src);
                                n += 1;
                            }
                        }
                    }
                }
            }
        }
        for from in [DType::Float, DType::Int64, DType::Int32, DType::Bool] {
            for to in [DType::Float, DType::Int64, DType::Int32, DType::Bool] {
                let src = crate::runtime::gpu::wgsl::elementwise_src(
                    &[Elem::of(from)],
                    &[crate::runtime::gpu::wgsl::Access::Flat],
                    &[2, 3, 4],
                    &[vec![]],
                    Elem::of(to),
                    &cast_expr(from, to),
                );
                validate(&format!("Cast {from:?}→{to:?}"), &src);
                n += 1;
            }
        }
        assert!(n > 300, "{n} element-wise kernels");
    }
}
