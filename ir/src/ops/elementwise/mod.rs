//! Element-wise ops: unary maths and activations, binary arithmetic, comparisons and logic
//! with numpy broadcasting, `Where`, `Cast`/`CastLike`, `Clip`, `Dropout`, and the variadic
//! `Max`/`Min`/`Sum`/`Mean`.
//!
//! Every op here has the output's dims as its iteration space (inputs map where they are not
//! broadcast), a FLOP per output element (transcendentals count
//! [`TRANSCENDENTAL_FLOPS`]), and passes changed dims straight through.

use super::grad::GradCx;
use super::util::{bcast_all, bcast_shapes, broadcast_shapes, broadcast_walk};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, MANY, NodeCx, OpRules, TypeRule, Types, Work};
use crate::array::{Array, Data, EvalError, round_to, wrap_int};
use crate::graph::attr::AttrValue;
use crate::graph::op;
use crate::graph::op::Op;
use crate::layout::{IterSpace, linear};
use crate::ops::TRANSCENDENTAL_FLOPS;
use crate::ops::space::pointwise;
use crate::types::{DType, TensorType};

mod eval;
pub use eval::*;

type Result<T> = std::result::Result<T, EvalError>;

const T: f64 = TRANSCENDENTAL_FLOPS;

fn unsupported(what: &str, dtype: DType) -> EvalError {
    EvalError::Unsupported(format!("{what} on {dtype}"))
}

/// Applies `f` to every element of a float array, computing in f64 (and rounding to the
/// array's element type).
pub fn map_float(x: &Array, what: &str, f: impl Fn(f64) -> f64) -> Result<Array> {
    let data = match &x.data {
        Data::F32(v) => Data::F32(v.iter().map(|&a| round_to(x.dtype, f(f64::from(a)) as f32)).collect()),
        Data::F64(v) => Data::F64(v.iter().map(|&a| f(a)).collect()),
        _ => return Err(unsupported(what, x.dtype)),
    };
    Ok(Array { dtype: x.dtype, shape: x.shape.clone(), data })
}

/// Applies `f` to every element of an integer array (wrapping to its element type).
fn map_int(x: &Array, f: impl Fn(i64) -> i64) -> Option<Array> {
    let Data::I64(v) = &x.data else { return None };
    let out = v.iter().map(|&a| wrap_int(x.dtype, f(a))).collect();
    Some(Array { dtype: x.dtype, shape: x.shape.clone(), data: Data::I64(out) })
}

/// The rules every element-wise op shares: the output's dims are the iteration space, and
/// changed dims broadcast through.
macro_rules! pointwise_rules {
    () => {
        fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
            Some(with_sum_dim(cx, pointwise(cx, &[], &[], 0)))
        }

        fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
            cx.broadcast_all();
            Some(())
        }

        fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
            pointwise_grad(cx)
        }
    };
}

/// `sp` with [`linear`]'s extent-less dim last when the op is a float sum of its inputs
/// (`Add`, `Sub`, `Sum`): `Σᵢ aᵢ + Σᵢ bᵢ = Σᵢ (aᵢ + bᵢ)`, so partial sums in give partial
/// sums out (a parameter's gradients from several readers add up before one
/// synchronisation).
fn with_sum_dim(cx: &NodeCx<'_>, mut sp: IterSpace) -> IterSpace {
    let node = cx.g.node(cx.n);
    let float = cx.ty(Some(cx.output(0))).is_some_and(|t| t.dtype.is_float());
    if float && matches!(node.op, Op::Add(_) | Op::Sub(_) | Op::Sum(_)) {
        sp.dims.push(linear());
    }
    sp
}

/// Unary ops on floats (and, where an `int` rule is given, integers): one line each,
/// `Name[flops per element] int |i| rule, |self, v| rule, d |self, x, y| derivative` (the
/// derivative `y'(x)` given the output `y`; none for an op without a gradient).
macro_rules! unary {
    ($($name:ident [$flops:expr] $(int |$i:ident| $int:expr,)? |$s:ident, $v:ident| $body:expr
        $(, d |$ds:ident, $x:ident, $y:ident| $d:expr)?;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(1)
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                cx.same()
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops($flops * cx.out_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let $s = self;
                let x = cx.req(0)?;
                $(if let Some(a) = map_int(x, |$i| $int) {
                    return Ok(vec![a]);
                })?
                Ok(vec![map_float(x, cx.name, |$v| $body)?])
            }

            $(
                #[allow(unused_variables)]
                fn derivative(&self, $x: f64, $y: f64) -> Option<f64> {
                    let $ds = self;
                    Some($d)
                }
            )?

            pointwise_rules!();
        }
    )*};
}

unary! {
    Abs[1.0] int |a| a.wrapping_abs(), |_s, v| v.abs(),
        d |_s, x, y| x.signum() * f64::from(u8::from(x != 0.0));
    Neg[1.0] int |a| a.wrapping_neg(), |_s, v| -v,
        d |_s, x, y| -1.0;
    Sign[1.0] int |a| a.signum(), |_s, v| if v > 0.0 { 1.0 } else if v < 0.0 { -1.0 } else { v * 0.0 };
    Relu[1.0] int |a| a.max(0), |_s, v| if v > 0.0 || v.is_nan() { v } else { 0.0 },
        d |_s, x, y| f64::from(u8::from(x > 0.0));
    Acos[1.0] |_s, v| v.acos(),
        d |_s, x, y| -1.0 / (1.0 - x * x).sqrt();
    Acosh[1.0] |_s, v| v.acosh(),
        d |_s, x, y| 1.0 / (x * x - 1.0).sqrt();
    Asin[1.0] |_s, v| v.asin(),
        d |_s, x, y| 1.0 / (1.0 - x * x).sqrt();
    Asinh[1.0] |_s, v| v.asinh(),
        d |_s, x, y| 1.0 / (x * x + 1.0).sqrt();
    Atan[1.0] |_s, v| v.atan(),
        d |_s, x, y| 1.0 / (1.0 + x * x);
    Atanh[1.0] |_s, v| v.atanh(),
        d |_s, x, y| 1.0 / (1.0 - x * x);
    Ceil[1.0] |_s, v| v.ceil();
    Floor[1.0] |_s, v| v.floor();
    Round[1.0] |_s, v| round_half_even(v);
    Cos[T] |_s, v| v.cos(),
        d |_s, x, y| -x.sin();
    Cosh[1.0] |_s, v| v.cosh(),
        d |_s, x, y| x.sinh();
    Sin[T] |_s, v| v.sin(),
        d |_s, x, y| x.cos();
    Sinh[1.0] |_s, v| v.sinh(),
        d |_s, x, y| x.cosh();
    Tan[T] |_s, v| v.tan(),
        d |_s, x, y| 1.0 + y * y;
    Tanh[T] |_s, v| v.tanh(),
        d |_s, x, y| 1.0 - y * y;
    Exp[T] |_s, v| v.exp(),
        d |_s, x, y| y;
    Log[T] |_s, v| v.ln(),
        d |_s, x, y| 1.0 / x;
    Sqrt[T] |_s, v| v.sqrt(),
        d |_s, x, y| 0.5 / y;
    Reciprocal[1.0] |_s, v| 1.0 / v,
        d |_s, x, y| -y * y;
    Sigmoid[T] |_s, v| 1.0 / (1.0 + (-v).exp()),
        d |_s, x, y| y * (1.0 - y);
    Softplus[T] |_s, v| v.exp().ln_1p(),
        d |_s, x, y| sigmoid(x);
    Softsign[1.0] |_s, v| v / (1.0 + v.abs()),
        d |_s, x, y| 1.0 / ((1.0 + x.abs()) * (1.0 + x.abs()));
    Erf[T] |_s, v| erf64(v),
        d |_s, x, y| 2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp();
    Mish[T] |_s, v| v * v.exp().ln_1p().tanh(),
        d |_s, x, y| {
            let t = x.exp().ln_1p().tanh();
            t + x * (1.0 - t * t) * sigmoid(x)
        };
    Swish[T] |s, v| v / (1.0 + (-f64::from(s.alpha()) * v).exp()),
        d |s, x, y| {
            // d/dx x·σ(αx) = σ(αx) + αx·σ(αx)(1 − σ(αx)).
            let (a, sg) = (f64::from(s.alpha()), sigmoid(f64::from(s.alpha()) * x));
            sg + a * x * sg * (1.0 - sg)
        };
    HardSwish[1.0] |_s, v| v * (v / 6.0 + 0.5).clamp(0.0, 1.0),
        d |_s, x, y| if x < -3.0 { 0.0 } else if x > 3.0 { 1.0 } else { x / 3.0 + 0.5 };
    HardSigmoid[1.0] |s, v| (f64::from(s.alpha()) * v + f64::from(s.beta())).clamp(0.0, 1.0),
        d |s, x, y| {
            let v = f64::from(s.alpha()) * x + f64::from(s.beta());
            if v > 0.0 && v < 1.0 { f64::from(s.alpha()) } else { 0.0 }
        };
    LeakyRelu[1.0] |s, v| if v >= 0.0 { v } else { f64::from(s.alpha()) * v },
        d |s, x, y| if x > 0.0 { 1.0 } else { f64::from(s.alpha()) };
    Elu[T] |s, v| if v >= 0.0 { v } else { f64::from(s.alpha()) * (v.exp() - 1.0) },
        d |s, x, y| if x > 0.0 { 1.0 } else { y + f64::from(s.alpha()) };
    Celu[T] |s, v| {
        let al = f64::from(s.alpha());
        v.max(0.0) + (al * ((v / al).exp() - 1.0)).min(0.0)
    },
        d |s, x, y| if x > 0.0 { 1.0 } else { (x / f64::from(s.alpha())).exp() };
    Selu[T] |s, v| {
        let (al, ga) = (f64::from(s.alpha()), f64::from(s.gamma()));
        if v > 0.0 { ga * v } else { ga * (al * v.exp() - al) }
    },
        d |s, x, y| if x > 0.0 { f64::from(s.gamma()) } else { f64::from(s.gamma()) * f64::from(s.alpha()) * x.exp() };
    ThresholdedRelu[1.0] |s, v| if v > f64::from(s.alpha()) { v } else { 0.0 },
        d |s, x, y| f64::from(u8::from(x > f64::from(s.alpha())));
    Shrink[1.0] |s, v| {
        let (b, l) = (f64::from(s.bias()), f64::from(s.lambd()));
        if v < -l { v + b } else if v > l { v - b } else { 0.0 }
    },
        d |s, x, y| f64::from(u8::from(x.abs() > f64::from(s.lambd())));
    Gelu[T] |s, v| if s.approximate() == "tanh" { gelu_tanh(v) } else { 0.5 * v * (1.0 + erf64(v / std::f64::consts::SQRT_2)) },
        d |s, x, y| gelu_derivative(s.approximate() == "tanh", x);
}

/// Unary ops whose output is bool or whose input is not float: `Name[flops] (output dtype
/// rule) |self, x| evaluation`.
macro_rules! unary_other {
    ($($name:ident: $rule:expr, $out:expr, |$s:ident, $x:ident| $eval:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(1)
            }

            fn type_rule(&self) -> TypeRule {
                $rule
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                let out: Option<DType> = $out;
                Ok(vec![cx.with(out.or(cx.dtype()), cx.dims(0).cloned())])
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops(cx.out_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let $s = self;
                let $x = cx.req(0)?;
                Ok(vec![$eval?])
            }

            pointwise_rules!();
        }
    )*};
}

unary_other! {
    IsNaN: TypeRule::Free, Some(DType::Bool), |_s, x| x.to_f64().map(|v| Array::bool(x.shape.clone(), v.iter().map(|a| a.is_nan()).collect()));
    IsInf: TypeRule::Free, Some(DType::Bool), |s, x| {
        let (neg, pos) = (s.detect_negative() != 0, s.detect_positive() != 0);
        x.to_f64().map(|v| {
            Array::bool(x.shape.clone(), v.iter().map(|&a| a.is_infinite() && ((a > 0.0 && pos) || (a < 0.0 && neg))).collect())
        })
    };
    Not: TypeRule::AllBool, None, |_s, x| match &x.data {
        Data::Bool(v) => Ok(Array::bool(x.shape.clone(), v.iter().map(|b| !b).collect())),
        _ => Err(unsupported("Not", x.dtype)),
    };
    BitwiseNot: TypeRule::Free, None, |_s, x| match &x.data {
        Data::I64(v) => Ok(Array::int(x.dtype, x.shape.clone(), v.iter().map(|a| !a).collect())),
        _ => Err(unsupported("BitwiseNot", x.dtype)),
    };
}

impl OpRules for op::Identity {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![cx.req(0)?.clone()])
    }

    pointwise_rules!();
}

impl OpRules for op::Dropout {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let mut out = vec![cx.input(0).cloned()];
        if cx.n_out > 1 {
            out.push(cx.with(Some(DType::Bool), cx.dims(0).cloned()));
        }
        Ok(out)
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    /// Inference mode: the identity, with a mask of ones.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let mut out = vec![x.clone()];
        if cx.n_out > 1 {
            out.push(Array::bool(x.shape.clone(), vec![true; x.numel()]));
        }
        Ok(out)
    }

    pointwise_rules!();
}

impl OpRules for op::Cast {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let to = self.to.and_then(DType::from_code).ok_or("Cast needs a valid `to`")?;
        Ok(vec![Some(TensorType { dtype: to, dims: cx.dims(0).cloned() })])
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let to =
            self.to.and_then(DType::from_code).ok_or_else(|| EvalError::Invalid("Cast without a valid `to`".into()))?;
        Ok(vec![cast(cx.req(0)?, to)?])
    }

    pointwise_rules!();
}

impl OpRules for op::CastLike {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![cx.with(cx.input(1).map(|t| t.dtype), cx.dims(0).cloned())])
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![cast(cx.req(0)?, cx.req(1)?.dtype)?])
    }

    pointwise_rules!();
}

impl OpRules for op::Clip {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.out_numel(0) * cx.n_in().saturating_sub(1).max(1) as f64)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let lo = match cx.opt(1) {
            Some(a) => Some(a.first_f64()?),
            None => self.min.map(f64::from),
        };
        let hi = match cx.opt(2) {
            Some(a) => Some(a.first_f64()?),
            None => self.max.map(f64::from),
        };
        let f = move |v: f64| {
            let v = match lo {
                Some(l) if v < l => l,
                _ => v,
            };
            match hi {
                Some(h) if v > h => h,
                _ => v,
            }
        };
        match &x.data {
            Data::I64(v) => {
                Ok(vec![Array::int(x.dtype, x.shape.clone(), v.iter().map(|&a| f(a as f64) as i64).collect())])
            }
            _ => Ok(vec![map_float(x, cx.name, f)?]),
        }
    }

    pointwise_rules!();
}

/// Binary ops with numpy broadcasting: `Name: element-type rule, bool output?, |self, a, b|
/// evaluation`.
macro_rules! binary {
    ($($name:ident: $rule:expr, $pred:expr, |$s:ident, $a:ident, $b:ident| $eval:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::fixed(2)
            }

            fn type_rule(&self) -> TypeRule {
                $rule
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                let dims = match (cx.dims(0), cx.dims(1)) {
                    (Some(a), Some(b)) => Some(bcast_shapes(a, b)?),
                    _ => None,
                };
                if $pred {
                    Ok(vec![Some(TensorType { dtype: DType::Bool, dims })])
                } else {
                    cx.one(dims)
                }
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                let per = if matches!(stringify!($name), "Pow") { T } else { 1.0 };
                Work::flops(per * cx.out_numel(0))
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let $s = self;
                let ($a, $b) = (cx.req(0)?, cx.req(1)?);
                Ok(vec![$eval?])
            }

            pointwise_rules!();
        }
    )*};
}

const SAME: fn() -> TypeRule = || TypeRule::Same(vec![0, 1]);

binary! {
    Add: SAME(), false, |_s, a, b| binary(Bin::Add, a, b);
    Sub: SAME(), false, |_s, a, b| binary(Bin::Sub, a, b);
    Mul: SAME(), false, |_s, a, b| binary(Bin::Mul, a, b);
    Div: SAME(), false, |_s, a, b| binary(Bin::Div, a, b);
    Pow: TypeRule::Free, false, |_s, a, b| binary(Bin::Pow, a, b);
    Mod: SAME(), false, |s, a, b| binary(Bin::Mod(s.fmod() != 0), a, b);
    PRelu: SAME(), false, |_s, a, b| binary(Bin::PRelu, a, b);
    BitwiseAnd: TypeRule::Free, false, |_s, a, b| binary(Bin::BitAnd, a, b);
    BitwiseOr: TypeRule::Free, false, |_s, a, b| binary(Bin::BitOr, a, b);
    BitwiseXor: TypeRule::Free, false, |_s, a, b| binary(Bin::BitXor, a, b);
    BitShift: TypeRule::Free, false, |s, a, b| {
        binary(if s.direction.as_deref() == Some("LEFT") { Bin::ShiftL } else { Bin::ShiftR }, a, b)
    };
    Equal: SAME(), true, |_s, a, b| compare(Cmp::Eq, a, b);
    Less: SAME(), true, |_s, a, b| compare(Cmp::Lt, a, b);
    LessOrEqual: SAME(), true, |_s, a, b| compare(Cmp::Le, a, b);
    Greater: SAME(), true, |_s, a, b| compare(Cmp::Gt, a, b);
    GreaterOrEqual: SAME(), true, |_s, a, b| compare(Cmp::Ge, a, b);
    And: TypeRule::AllBool, true, |_s, a, b| logical(a, b, |p, q| p && q);
    Or: TypeRule::AllBool, true, |_s, a, b| logical(a, b, |p, q| p || q);
    Xor: TypeRule::AllBool, true, |_s, a, b| logical(a, b, |p, q| p ^ q);
}

/// Variadic ops: the broadcast of every input, folded with a binary rule.
macro_rules! variadic {
    ($($name:ident: $bin:expr, $mean:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                Arity::new(1, MANY, 1, 1)
            }

            fn type_rule(&self) -> TypeRule {
                TypeRule::AllSame
            }

            fn infer(&self, cx: &InferCx<'_>) -> Types {
                cx.one(bcast_all(cx.ins.iter().map(|t| t.and_then(|t| t.dims.as_ref())))?)
            }

            fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
                Work::flops(cx.out_numel(0) * cx.n_in().saturating_sub(1).max(1) as f64)
            }

            fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
                let all = cx.all();
                let mut acc = all.first().copied().cloned().ok_or_else(|| EvalError::Invalid(format!("{} without inputs", cx.name)))?;
                for a in &all[1..] {
                    acc = binary($bin, &acc, a)?;
                }
                if $mean {
                    let n = Array::float(acc.dtype, vec![], vec![all.len() as f64]);
                    acc = binary(Bin::Div, &acc, &cast(&n, acc.dtype)?)?;
                }
                Ok(vec![acc])
            }

            pointwise_rules!();
        }
    )*};
}

variadic! {
    Max: Bin::Max, false;
    Min: Bin::Min, false;
    Sum: Bin::Add, false;
    Mean: Bin::Add, true;
}

impl OpRules for op::Where {
    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::BoolAndSame(vec![1, 2])
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dims = bcast_all(cx.ins.iter().map(|t| t.and_then(|t| t.dims.as_ref())))?;
        Ok(vec![cx.with(cx.input(1).map(|t| t.dtype), dims)])
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![where_(cx.req(0)?, cx.req(1)?, cx.req(2)?)?])
    }

    pointwise_rules!();
}

/// The attributes an element-wise op's derivative needs, read from the op: `alpha`
/// (`lambd` for Shrink), `beta` (`bias`), `gamma`, `approximate`.
fn derivative_attrs(op: &Op) -> op::ElementwiseGrad {
    let mut g = op::ElementwiseGrad { op: Some(op.op_type().to_string()), ..Default::default() };
    for a in op.attributes() {
        match (a.name.as_str(), &a.value) {
            ("alpha" | "lambd", AttrValue::Float(v)) => g.alpha = Some(*v),
            ("beta" | "bias", AttrValue::Float(v)) => g.beta = Some(*v),
            ("gamma", AttrValue::Float(v)) => g.gamma = Some(*v),
            ("approximate", AttrValue::String(v)) => g.approximate = Some(v.clone()),
            _ => {}
        }
    }
    g
}

/// `op'(x)` for the element-wise op whose gradient `g` computes, with output `y` (both in
/// f64): that op's own rule ([`OpRules::derivative`]); `None` when it has none.
pub fn derivative(g: &op::ElementwiseGrad, x: f64, y: f64) -> Option<f64> {
    g.forward()?.rules().derivative(x, y)
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// GELU's derivative, exact (erf) or of the tanh approximation.
fn gelu_derivative(tanh: bool, x: f64) -> f64 {
    if tanh {
        let sqrt_2_pi = (2.0 / std::f64::consts::PI).sqrt();
        let u = sqrt_2_pi * (x + 0.044_715 * x * x * x);
        let t = u.tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * sqrt_2_pi * (1.0 + 3.0 * 0.044_715 * x * x)
    } else {
        0.5 * (1.0 + erf64(x / std::f64::consts::SQRT_2))
            + x * (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt()
    }
}

impl op::ElementwiseGrad {
    /// The forward op whose derivative this computes, with its attributes (`alpha` is
    /// Shrink's `lambd`, `beta` its `bias`); `None` for an op shardc does not model.
    pub fn forward(&self) -> Option<Op> {
        let name = self.op.as_deref()?;
        let known = Op::known_attributes("", name)?;
        let (alpha, beta) = if name == "Shrink" { ("lambd", "bias") } else { ("alpha", "beta") };
        let mut attrs = Vec::new();
        let mut put = |n: &str, v: Option<AttrValue>| {
            if let Some(v) = v.filter(|_| known.contains(&n)) {
                attrs.push(crate::graph::attr::Attribute { name: n.to_string(), value: v });
            }
        };
        put(alpha, self.alpha.map(AttrValue::Float));
        put(beta, self.beta.map(AttrValue::Float));
        put("gamma", self.gamma.map(AttrValue::Float));
        put("approximate", self.approximate.clone().map(AttrValue::String));
        Op::from_parts("", name, attrs).ok().filter(|o| !matches!(o, Op::Opaque(_)))
    }
}

/// Ops whose derivative is zero almost everywhere: no gradient flows through them.
const FLAT: &[&str] = &["Floor", "Ceil", "Round", "Sign"];

/// The gradient rules of the element-wise ops.
fn pointwise_grad(cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
    let op = cx.op().clone();
    let name = op.op_type().to_string();
    let r = match &op {
        Op::Add(_) | Op::Sub(_) | Op::Mul(_) | Op::Div(_) | Op::Pow(_) | Op::PRelu(_) => binary_grad(cx, &op),
        Op::Sum(_) | Op::Mean(_) | Op::Max(_) | Op::Min(_) => variadic_grad(cx, &op),
        Op::Where(_) => where_grad(cx),
        Op::SwiGLU(sg) => swiglu_grad(cx, sg),
        Op::BitCast(_) => Ok(()),
        Op::Identity(_) | Op::Dropout(_) => dropout_grad(cx, &op),
        Op::Cast(_) => (|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            if !cx.dtype(x).is_float() {
                return Ok(());
            }
            let d = cx.cast(dy, cx.dtype(x))?;
            cx.set(0, d);
            Ok(())
        })(),
        Op::Clip(c) => clip_grad(cx, c),
        Op::Mod(m) => (|| {
            // y = a − b·q with q = (a − y)/b constant almost everywhere (trunc for fmod,
            // floor otherwise): dA = dY, dB = −dY·q.
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            if !cx.dtype(dy).is_float() || m.fmod() == 0 && !cx.dtype(cx.x(0)?).is_float() {
                return Ok(());
            }
            let (a, b, y) = (cx.x(0)?, cx.x(1)?, cx.y(0));
            cx.set_broadcast(0, dy)?;
            if cx.want(1) {
                let r = cx.sub(a, y)?;
                let q = cx.div(r, b)?;
                let q = cx.add1(Op::Round(op::Round::default()), &[q])?;
                let d = cx.mul(dy, q)?;
                let d = cx.neg(d)?;
                cx.set_broadcast(1, d)?;
            }
            Ok(())
        })(),
        _ if FLAT.contains(&name.as_str()) => Ok(()),
        _ => {
            op.rules().derivative(0.5, 0.5)?;
            let g = derivative_attrs(&op);
            (|| {
                let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
                let (x, y) = (cx.x(0)?, cx.y(0));
                let d = cx.add1(Op::ElementwiseGrad(g), &[x, y, dy])?;
                cx.set(0, d);
                Ok(())
            })()
        }
    };
    Some(r)
}

fn binary_grad(cx: &mut GradCx<'_>, op: &Op) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (a, b, y) = (cx.x(0)?, cx.x(1)?, cx.y(0));
    let (da, db) = match op {
        Op::Add(_) => (Some(dy), Some(dy)),
        Op::Sub(_) => (Some(dy), if cx.want(1) { Some(cx.neg(dy)?) } else { None }),
        Op::Mul(_) => {
            (if cx.want(0) { Some(cx.mul(dy, b)?) } else { None }, if cx.want(1) { Some(cx.mul(dy, a)?) } else { None })
        }
        Op::Div(_) => {
            let da = if cx.want(0) { Some(cx.div(dy, b)?) } else { None };
            // d(a/b)/db = −y/b.
            let db = if cx.want(1) {
                let t = cx.div(y, b)?;
                let t = cx.mul(dy, t)?;
                Some(cx.neg(t)?)
            } else {
                None
            };
            (da, db)
        }
        Op::Pow(_) => {
            // d/da = b·a^(b−1); d/db = y·ln a.
            let da = if cx.want(0) {
                let one = cx.scalar(cx.dtype(b), 1.0);
                let bm1 = cx.sub(b, one)?;
                let p = cx.add1(Op::Pow(op::Pow::default()), &[a, bm1])?;
                let p = cx.cast(p, cx.dtype(a))?;
                let bb = cx.cast(b, cx.dtype(a))?;
                let t = cx.mul(p, bb)?;
                Some(cx.mul(dy, t)?)
            } else {
                None
            };
            let db = if cx.want(1) {
                let ln = cx.add1(Op::Log(op::Log::default()), &[a])?;
                let t = cx.mul(y, ln)?;
                let t = cx.mul(dy, t)?;
                Some(cx.cast(t, cx.dtype(b))?)
            } else {
                None
            };
            (da, db)
        }
        Op::PRelu(_) => {
            // y = a > 0 ? a : slope·a.
            let zero = cx.scalar(cx.dtype(a), 0.0);
            let pos = cx.add1(Op::Greater(op::Greater::default()), &[a, zero])?;
            let da = if cx.want(0) {
                let t = cx.mul(dy, b)?;
                Some(cx.where_(pos, dy, t)?)
            } else {
                None
            };
            let db = if cx.want(1) {
                let t = cx.mul(dy, a)?;
                let z = cx.scalar(cx.dtype(a), 0.0);
                Some(cx.where_(pos, z, t)?)
            } else {
                None
            };
            (da, db)
        }
        _ => return Err(format!("no gradient rule for {}", op.op_type())),
    };
    if let Some(d) = da {
        cx.set_broadcast(0, d)?;
    }
    if let Some(d) = db {
        cx.set_broadcast(1, d)?;
    }
    Ok(())
}

fn variadic_grad(cx: &mut GradCx<'_>, op: &Op) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let y = cx.y(0);
    let k = cx.g.node(cx.n).inputs().len();
    // Max/Min: the gradient goes where an input attains the result, split evenly among
    // the inputs that tie (as torch splits it).
    let minmax = !matches!(op, Op::Sum(_) | Op::Mean(_));
    let mut share = dy;
    let mut eqs = Vec::new();
    if minmax {
        let mut count: Option<crate::Value> = None;
        for i in 0..k {
            let xi = cx.x(i)?;
            let eq = cx.add1(Op::Equal(op::Equal::default()), &[xi, y])?;
            let c = cx.cast(eq, cx.dtype(dy))?;
            count = Some(match count {
                Some(s) => cx.add2(s, c)?,
                None => c,
            });
            eqs.push(eq);
        }
        if k > 1 {
            share = cx.div(dy, count.expect("k ≥ 1"))?;
        }
    }
    for i in 0..k {
        if !cx.want(i) {
            continue;
        }
        let d = match op {
            Op::Sum(_) => dy,
            Op::Mean(_) => cx.scale(dy, 1.0 / k as f64)?,
            _ => {
                let z = cx.scalar(cx.dtype(dy), 0.0);
                cx.where_(eqs[i], share, z)?
            }
        };
        cx.set_broadcast(i, d)?;
    }
    Ok(())
}

fn where_grad(cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let c = cx.x(0)?;
    let z = cx.scalar(cx.dtype(dy), 0.0);
    if cx.want(1) {
        let d = cx.where_(c, dy, z)?;
        cx.set_broadcast(1, d)?;
    }
    if cx.want(2) {
        let d = cx.where_(c, z, dy)?;
        cx.set_broadcast(2, d)?;
    }
    Ok(())
}

/// Identity, and Dropout: the identity in inference; in training mode (the
/// `training_mode` input true) the gradient is masked and scaled as the forward was.
fn dropout_grad(cx: &mut GradCx<'_>, op: &Op) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let training = matches!(op, Op::Dropout(_))
        && cx
            .x_opt(2)
            .and_then(|v| cx.g.initializer(v))
            .and_then(|t| Array::from_tensor(t).ok())
            .and_then(|a| a.to_f64().ok())
            .is_some_and(|v| v.first().is_some_and(|&x| x != 0.0));
    if !training {
        cx.set(0, dy);
        return Ok(());
    }
    let ratio = cx
        .x_opt(1)
        .and_then(|v| cx.g.initializer(v))
        .and_then(|t| Array::from_tensor(t).ok())
        .and_then(|a| a.to_f64().ok())
        .and_then(|v| v.first().copied())
        .unwrap_or(0.5);
    if cx.g.node(cx.n).num_outputs() < 2 || cx.g.value_name(cx.y(1)).is_empty() {
        return Err("Dropout in training mode needs its mask output to be differentiated".into());
    }
    let mask = cx.cast(cx.y(1), cx.dtype(dy))?;
    let t = cx.mul(dy, mask)?;
    let d = cx.scale(t, 1.0 / (1.0 - ratio))?;
    cx.set(0, d);
    Ok(())
}

fn clip_grad(cx: &mut GradCx<'_>, c: &op::Clip) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let dt = cx.dtype(x);
    let lo = match cx.x_opt(1) {
        Some(v) => Some(v),
        None => c.min.map(|m| cx.scalar(dt, f64::from(m))),
    };
    let hi = match cx.x_opt(2) {
        Some(v) => Some(v),
        None => c.max.map(|m| cx.scalar(dt, f64::from(m))),
    };
    let mut d = dy;
    let z = cx.scalar(dt, 0.0);
    if let Some(lo) = lo {
        let ok = cx.add1(Op::GreaterOrEqual(op::GreaterOrEqual::default()), &[x, lo])?;
        d = cx.where_(ok, d, z)?;
    }
    if let Some(hi) = hi {
        let ok = cx.add1(Op::LessOrEqual(op::LessOrEqual::default()), &[x, hi])?;
        d = cx.where_(ok, d, z)?;
    }
    cx.set(0, d);
    Ok(())
}

impl OpRules for op::ElementwiseGrad {
    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::Same(vec![0, 1, 2])
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        if derivative(self, 0.5, 0.5).is_none() {
            return Err(format!("ElementwiseGrad: no derivative of `{}`", self.op.as_deref().unwrap_or("?")));
        }
        Ok(vec![cx.input(2).cloned()])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(pointwise(cx, &[], &[], 0))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(T * cx.out_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, y, dy) = (cx.req(0)?, cx.req(1)?, cx.req(2)?);
        let (xv, yv, dv) = (x.to_f64()?, y.to_f64()?, dy.to_f64()?);
        if xv.len() != dv.len() || yv.len() != dv.len() {
            return Err(EvalError::Invalid("ElementwiseGrad: operand sizes differ".into()));
        }
        let unsupported = || EvalError::Unsupported(format!("the derivative of {}", self.op.as_deref().unwrap_or("?")));
        let forward = self.forward().ok_or_else(unsupported)?;
        let rules = forward.rules();
        let mut out = Vec::with_capacity(dv.len());
        for i in 0..dv.len() {
            out.push(dv[i] * rules.derivative(xv[i], yv[i]).ok_or_else(unsupported)?);
        }
        Ok(vec![Array::float(dy.dtype, dy.shape.clone(), out)])
    }
}

impl OpRules for op::SwiGLU {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::AllSame
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        if let (Some(a), Some(b)) = (cx.dims(0), cx.dims(1))
            && a.len() == b.len()
            && a.iter().zip(b).any(|(x, y)| x.is_known() && y.is_known() && x != y)
        {
            return Err(format!("SwiGLU needs A and B of one shape (no broadcasting), got {a:?} and {b:?}"));
        }
        cx.same()
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(T * cx.out_numel(0))
    }

    /// `Swish_α(A) · B`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (a, b) = (cx.req(0)?, cx.req(1)?);
        if a.shape != b.shape {
            return Err(EvalError::Invalid(format!("SwiGLU: A {:?} and B {:?} differ", a.shape, b.shape)));
        }
        let al = f64::from(self.alpha());
        let (x, y) = (a.to_f64()?, b.to_f64()?);
        let out = x.iter().zip(&y).map(|(&p, &q)| p / (1.0 + (-al * p).exp()) * q).collect();
        Ok(vec![Array::float(a.dtype, a.shape.clone(), out)])
    }

    pointwise_rules!();
}

impl OpRules for op::BitCast {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let to = self.to.and_then(DType::from_code).ok_or("BitCast needs `to`")?;
        if let Some(t) = cx.input(0)
            && t.dtype.bits() != to.bits()
        {
            return Err(format!("BitCast from {} ({} bits) to {to} ({} bits)", t.dtype, t.dtype.bits(), to.bits()));
        }
        Ok(vec![cx.with(Some(to), cx.dims(0).cloned())])
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    /// The same bits read as another type of the same width.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let to = self.to.and_then(DType::from_code).ok_or_else(|| EvalError::Invalid("BitCast needs `to`".into()))?;
        if x.dtype.bits() != to.bits() || to == DType::String || x.dtype == DType::String {
            return Err(EvalError::Invalid(format!("BitCast from {} to {to}", x.dtype)));
        }
        let bytes = bits_of(x)?;
        let t = crate::tensor::Tensor {
            dtype: to,
            dims: x.shape.iter().map(|&d| d as i64).collect(),
            name: None,
            data: raw_to_data(&bytes, to)?,
        };
        Ok(vec![Array::from_tensor(&t)?])
    }

    pointwise_rules!();
}

/// The little-endian bytes of `x` in its own type.
fn bits_of(x: &Array) -> Result<Vec<u8>> {
    let w = (x.dtype.bits() / 8) as usize;
    let t = x.to_tensor();
    use crate::tensor::TensorData as T;
    Ok(match (&t.data, x.dtype) {
        (T::Float(v), _) => v.iter().flat_map(|f| f.to_le_bytes()).collect(),
        (T::Double(v), _) => v.iter().flat_map(|f| f.to_le_bytes()).collect(),
        (T::Int64(v), _) => v.iter().flat_map(|f| f.to_le_bytes()).collect(),
        (T::Uint64(v), _) => v.iter().flat_map(|f| f.to_le_bytes()[..w].to_vec()).collect(),
        (T::Int32(v), _) => v.iter().flat_map(|f| f.to_le_bytes()[..w].to_vec()).collect(),
        _ => return Err(EvalError::Unsupported(format!("BitCast of {}", x.dtype))),
    })
}

/// Little-endian bytes as the storage of a `dtype` tensor.
fn raw_to_data(raw: &[u8], dtype: DType) -> Result<crate::tensor::TensorData> {
    use crate::tensor::{Storage, TensorData as T};
    let w = (dtype.bits() / 8).max(1) as usize;
    let chunks = raw.chunks_exact(w);
    let le = |c: &[u8]| -> u64 { c.iter().rev().fold(0u64, |a, &b| (a << 8) | u64::from(b)) };
    let signed = |c: &[u8]| -> i64 {
        let v = le(c);
        let shift = 64 - 8 * c.len() as u32;
        ((v << shift) as i64) >> shift
    };
    Ok(match Storage::of(dtype) {
        Some(Storage::Float) => T::Float(chunks.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
        Some(Storage::Double) => T::Double(chunks.map(|c| f64::from_bits(le(c))).collect()),
        Some(Storage::Int64) => T::Int64(chunks.map(|c| le(c) as i64).collect()),
        Some(Storage::Uint64) => T::Uint64(chunks.map(le).collect()),
        Some(Storage::Int32) => match dtype {
            DType::Int8 | DType::Int16 | DType::Int32 => T::Int32(chunks.map(|c| signed(c) as i32).collect()),
            DType::Bool => T::Int32(chunks.map(|c| i32::from(c[0] != 0)).collect()),
            _ => T::Int32(chunks.map(|c| le(c) as i32).collect()),
        },
        _ => return Err(EvalError::Unsupported(format!("BitCast to {dtype}"))),
    })
}

/// SwiGLU: dA = dY·B·Swish′(A), dB = dY·Swish(A).
fn swiglu_grad(cx: &mut GradCx<'_>, sg: &op::SwiGLU) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (a, b) = (cx.x(0)?, cx.x(1)?);
    let sw = cx.add1(Op::Swish(op::Swish { alpha: sg.alpha }), &[a])?;
    if cx.want(0) {
        let g = cx.mul(dy, b)?;
        let d = op::ElementwiseGrad { op: Some("Swish".into()), alpha: sg.alpha, ..Default::default() };
        let da = cx.add1(Op::ElementwiseGrad(d), &[a, sw, g])?;
        cx.set(0, da);
    }
    if cx.want(1) {
        let db = cx.mul(dy, sw)?;
        cx.set(1, db);
    }
    Ok(())
}
