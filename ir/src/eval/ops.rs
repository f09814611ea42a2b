//! Reference kernels for elementwise, reduction and data-movement ops.

use super::array::{Array, Data, numel, strides, wrap_int};
use super::{EvalError, Result};
use crate::op::{self, Op};
use crate::types::DType;

pub(crate) fn req<'a>(inputs: &[Option<&'a Array>], i: usize, what: &str) -> Result<&'a Array> {
    inputs.get(i).copied().flatten().ok_or_else(|| EvalError::Invalid(format!("{what}: input {i} is missing")))
}

pub(crate) fn opt<'a>(inputs: &[Option<&'a Array>], i: usize) -> Option<&'a Array> {
    inputs.get(i).copied().flatten()
}

/// Normalises a possibly negative axis.
pub(crate) fn axis(a: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let x = if a < 0 { a + r } else { a };
    if x < 0 || x >= r.max(1) && !(r == 0 && x == 0) {
        return Err(EvalError::Invalid(format!("axis {a} out of range for rank {rank}")));
    }
    Ok(x as usize)
}

/// Numpy broadcast of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let y = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = if x == y || y == 1 {
            x
        } else if x == 1 {
            y
        } else {
            return Err(EvalError::Invalid(format!("shapes {a:?} and {b:?} do not broadcast")));
        };
    }
    Ok(out)
}

/// For each element of `out`, the flat index of the element of an input of shape `inp`
/// that broadcasts to it.
pub fn broadcast_index(out: &[usize], inp: &[usize]) -> Vec<usize> {
    let n = numel(out);
    if out == inp {
        return (0..n).collect();
    }
    let off = out.len() - inp.len();
    let istr = strides(inp);
    let mut bstr = vec![0usize; out.len()];
    for (i, &d) in inp.iter().enumerate() {
        bstr[i + off] = if d == 1 { 0 } else { istr[i] };
    }
    let mut idx = Vec::with_capacity(n);
    let mut counter = vec![0usize; out.len()];
    let mut flat = 0usize;
    for _ in 0..n {
        idx.push(flat);
        for d in (0..out.len()).rev() {
            counter[d] += 1;
            flat += bstr[d];
            if counter[d] < out[d] {
                break;
            }
            flat -= bstr[d] * counter[d];
            counter[d] = 0;
        }
    }
    idx
}

fn unsupported(what: &str, dtype: DType) -> EvalError {
    EvalError::Unsupported(format!("{what} on {dtype}"))
}

// ---------------------------------------------------------------- unary

fn map_float(x: &Array, f32f: impl Fn(f32) -> f32, f64f: impl Fn(f64) -> f64, what: &str) -> Result<Array> {
    let data = match &x.data {
        Data::F32(v) => Data::F32(v.iter().map(|&a| super::array::round_to(x.dtype, f32f(a))).collect()),
        Data::F64(v) => Data::F64(v.iter().map(|&a| f64f(a)).collect()),
        _ => return Err(unsupported(what, x.dtype)),
    };
    Ok(Array { dtype: x.dtype, shape: x.shape.clone(), data })
}

macro_rules! float_unary {
    ($x:expr, $name:expr, |$v:ident| $body:expr) => {
        map_float($x, |$v: f32| $body, |$v: f64| $body, $name)
    };
}

fn erf64(x: f64) -> f64 {
    // Abramowitz–Stegun 7.1.26 is too coarse for 1e-4; use a series / continued fraction.
    if x.abs() < 2.5 {
        // Maclaurin series.
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        let mut n = 0.0;
        loop {
            n += 1.0;
            term *= -x2 / n;
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() < 1e-17 * sum.abs().max(1e-300) {
                break;
            }
            if n > 200.0 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // Continued fraction for erfc.
        let ax = x.abs();
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (ax + f);
        }
        let erfc = (-ax * ax).exp() / (std::f64::consts::PI.sqrt() * (ax + f));
        (1.0 - erfc).copysign(x)
    }
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 { 2.0 * (x / 2.0).round() } else { r }
}

fn unary(op: &Op, x: &Array) -> Result<Array> {
    let name = op.op_type();
    match op {
        Op::Abs(_) | Op::Neg(_) | Op::Sign(_) if matches!(x.data, Data::I64(_)) => {
            let Data::I64(v) = &x.data else { unreachable!() };
            let out = v
                .iter()
                .map(|&a| {
                    let r = match op {
                        Op::Abs(_) => a.wrapping_abs(),
                        Op::Neg(_) => a.wrapping_neg(),
                        _ => a.signum(),
                    };
                    wrap_int(x.dtype, r)
                })
                .collect();
            Ok(Array { dtype: x.dtype, shape: x.shape.clone(), data: Data::I64(out) })
        }
        Op::Abs(_) => float_unary!(x, name, |v| v.abs()),
        Op::Neg(_) => float_unary!(x, name, |v| -v),
        Op::Sign(_) => float_unary!(x, name, |v| if v > 0.0 {
            1.0
        } else if v < 0.0 {
            -1.0
        } else {
            0.0
        }),
        Op::Acos(_) => float_unary!(x, name, |v| v.acos()),
        Op::Acosh(_) => float_unary!(x, name, |v| v.acosh()),
        Op::Asin(_) => float_unary!(x, name, |v| v.asin()),
        Op::Asinh(_) => float_unary!(x, name, |v| v.asinh()),
        Op::Atan(_) => float_unary!(x, name, |v| v.atan()),
        Op::Atanh(_) => float_unary!(x, name, |v| v.atanh()),
        Op::Ceil(_) => float_unary!(x, name, |v| v.ceil()),
        Op::Floor(_) => float_unary!(x, name, |v| v.floor()),
        Op::Round(_) => map_float(x, |v| round_half_even(f64::from(v)) as f32, round_half_even, name),
        Op::Cos(_) => float_unary!(x, name, |v| v.cos()),
        Op::Cosh(_) => float_unary!(x, name, |v| v.cosh()),
        Op::Sin(_) => float_unary!(x, name, |v| v.sin()),
        Op::Sinh(_) => float_unary!(x, name, |v| v.sinh()),
        Op::Tan(_) => float_unary!(x, name, |v| v.tan()),
        Op::Tanh(_) => float_unary!(x, name, |v| v.tanh()),
        Op::Exp(_) => float_unary!(x, name, |v| v.exp()),
        Op::Log(_) => float_unary!(x, name, |v| v.ln()),
        Op::Sqrt(_) => float_unary!(x, name, |v| v.sqrt()),
        Op::Reciprocal(_) => float_unary!(x, name, |v| 1.0 / v),
        Op::Relu(_) if matches!(x.data, Data::I64(_)) => {
            let Data::I64(v) = &x.data else { unreachable!() };
            Ok(Array { dtype: x.dtype, shape: x.shape.clone(), data: Data::I64(v.iter().map(|&a| a.max(0)).collect()) })
        }
        Op::Relu(_) => float_unary!(x, name, |v| if v > 0.0 { v } else { 0.0 }),
        Op::Sigmoid(_) => {
            map_float(x, |v| (1.0 / (1.0 + (-f64::from(v)).exp())) as f32, |v| 1.0 / (1.0 + (-v).exp()), name)
        }
        Op::Softplus(_) => map_float(x, |v| f64::from(v).exp().ln_1p() as f32, |v| v.exp().ln_1p(), name),
        Op::Softsign(_) => float_unary!(x, name, |v| v / (1.0 + v.abs())),
        Op::Erf(_) => map_float(x, |v| erf64(f64::from(v)) as f32, erf64, name),
        Op::Mish(_) => map_float(
            x,
            |v| {
                let v = f64::from(v);
                (v * v.exp().ln_1p().tanh()) as f32
            },
            |v| v * v.exp().ln_1p().tanh(),
            name,
        ),
        Op::HardSwish(_) => float_unary!(x, name, |v| v * (v / 6.0 + 0.5).clamp(0.0, 1.0)),
        Op::HardSigmoid(a) => {
            let (al, be) = (a.alpha(), a.beta());
            map_float(
                x,
                |v| (al * v + be).clamp(0.0, 1.0),
                |v| (f64::from(al) * v + f64::from(be)).clamp(0.0, 1.0),
                name,
            )
        }
        Op::LeakyRelu(a) => {
            let al = a.alpha();
            map_float(x, |v| if v >= 0.0 { v } else { al * v }, |v| if v >= 0.0 { v } else { f64::from(al) * v }, name)
        }
        Op::Elu(a) => {
            let al = f64::from(a.alpha());
            map_float(
                x,
                |v| if v >= 0.0 { v } else { (al * (f64::from(v).exp() - 1.0)) as f32 },
                |v| if v >= 0.0 { v } else { al * (v.exp() - 1.0) },
                name,
            )
        }
        Op::Celu(a) => {
            let al = f64::from(a.alpha());
            let f = move |v: f64| v.max(0.0) + (al * ((v / al).exp() - 1.0)).min(0.0);
            map_float(x, |v| f(f64::from(v)) as f32, f, name)
        }
        Op::Selu(a) => {
            let (al, ga) = (f64::from(a.alpha()), f64::from(a.gamma()));
            let f = move |v: f64| if v > 0.0 { ga * v } else { ga * (al * v.exp() - al) };
            map_float(x, |v| f(f64::from(v)) as f32, f, name)
        }
        Op::ThresholdedRelu(a) => {
            let al = a.alpha();
            map_float(x, |v| if v > al { v } else { 0.0 }, |v| if v > f64::from(al) { v } else { 0.0 }, name)
        }
        Op::Shrink(a) => {
            let (b, l) = (f64::from(a.bias()), f64::from(a.lambd()));
            let f = move |v: f64| {
                if v < -l {
                    v + b
                } else if v > l {
                    v - b
                } else {
                    0.0
                }
            };
            map_float(x, |v| f(f64::from(v)) as f32, f, name)
        }
        Op::Gelu(a) => {
            if a.approximate() == "tanh" {
                map_float(x, |v| gelu_tanh(f64::from(v)) as f32, gelu_tanh, name)
            } else {
                let f = |v: f64| 0.5 * v * (1.0 + erf64(v / std::f64::consts::SQRT_2));
                map_float(x, |v| f(f64::from(v)) as f32, f, name)
            }
        }
        Op::IsNaN(_) => {
            let v = x.to_f64()?;
            Ok(Array::bool(x.shape.clone(), v.iter().map(|a| a.is_nan()).collect()))
        }
        Op::IsInf(a) => {
            let (neg, pos) = (a.detect_negative() != 0, a.detect_positive() != 0);
            let v = x.to_f64()?;
            Ok(Array::bool(
                x.shape.clone(),
                v.iter().map(|&a| a.is_infinite() && ((a > 0.0 && pos) || (a < 0.0 && neg))).collect(),
            ))
        }
        Op::Not(_) => match &x.data {
            Data::Bool(v) => Ok(Array::bool(x.shape.clone(), v.iter().map(|b| !b).collect())),
            _ => Err(unsupported("Not", x.dtype)),
        },
        Op::BitwiseNot(_) => match &x.data {
            Data::I64(v) => Ok(Array::int(x.dtype, x.shape.clone(), v.iter().map(|a| !a).collect())),
            _ => Err(unsupported("BitwiseNot", x.dtype)),
        },
        Op::Identity(_) | Op::Dropout(_) => Ok(x.clone()),
        _ => Err(EvalError::Unsupported(format!("{name} as a unary op"))),
    }
}

/// Converts an array to another element type, as Cast does.
pub fn cast(x: &Array, to: DType) -> Result<Array> {
    if to == x.dtype {
        return Ok(x.clone());
    }
    let n = x.numel();
    let shape = x.shape.clone();
    Ok(match to {
        DType::Float | DType::Float16 | DType::Bfloat16 | DType::Double => match &x.data {
            Data::Str(v) => {
                Array::float(to, shape, v.iter().map(|s| s.trim().parse::<f64>().unwrap_or(f64::NAN)).collect())
            }
            Data::F32(v) if to != DType::Double => {
                Array { dtype: to, shape, data: Data::F32(v.iter().map(|&a| super::array::round_to(to, a)).collect()) }
            }
            _ => Array::float(to, shape, x.to_f64()?),
        },
        DType::Bool => match &x.data {
            Data::Str(v) => Array::bool(shape, v.iter().map(|s| !s.is_empty()).collect()),
            _ => Array::bool(shape, x.to_f64()?.iter().map(|&a| a != 0.0).collect()),
        },
        DType::String => {
            let v: Vec<String> = match &x.data {
                Data::F32(v) => v.iter().map(|a| a.to_string()).collect(),
                Data::F64(v) => v.iter().map(|a| a.to_string()).collect(),
                Data::I64(v) => v.iter().map(|a| a.to_string()).collect(),
                Data::Bool(v) => v.iter().map(|a| if *a { "1".into() } else { "0".into() }).collect(),
                Data::Str(v) => v.clone(),
            };
            Array { dtype: to, shape, data: Data::Str(v) }
        }
        d if d.is_int() => {
            let v: Vec<i64> = match &x.data {
                Data::I64(v) => v.clone(),
                Data::Bool(v) => v.iter().map(|&b| i64::from(b)).collect(),
                Data::Str(v) => v.iter().map(|s| s.trim().parse::<i64>().unwrap_or(0)).collect(),
                _ => x
                    .to_f64()?
                    .iter()
                    .map(|&a| if a.is_nan() { 0 } else { a.trunc().clamp(i64::MIN as f64, i64::MAX as f64) as i64 })
                    .collect(),
            };
            debug_assert_eq!(v.len(), n);
            Array::int(d, shape, v)
        }
        d => return Err(EvalError::Unsupported(format!("Cast to {d}"))),
    })
}

// ---------------------------------------------------------------- binary

#[derive(Copy, Clone, PartialEq)]
enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Mod(bool),
    Max,
    Min,
    PRelu,
    BitAnd,
    BitOr,
    BitXor,
    ShiftL,
    ShiftR,
}

#[derive(Copy, Clone, PartialEq)]
enum Cmp {
    Eq,
    Lt,
    Le,
    Gt,
    Ge,
}

fn zip_map<A: Copy, B: Copy, C>(
    a: &[A],
    ash: &[usize],
    b: &[B],
    bsh: &[usize],
    f: impl Fn(A, B) -> C,
) -> Result<(Vec<usize>, Vec<C>)> {
    let shape = broadcast_shapes(ash, bsh)?;
    if ash == bsh {
        return Ok((shape, a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()));
    }
    let ia = broadcast_index(&shape, ash);
    let ib = broadcast_index(&shape, bsh);
    Ok((shape, ia.iter().zip(&ib).map(|(&i, &j)| f(a[i], b[j])).collect()))
}

fn float_bin(k: Bin, x: f64, y: f64) -> f64 {
    match k {
        Bin::Add => x + y,
        Bin::Sub => x - y,
        Bin::Mul => x * y,
        Bin::Div => x / y,
        Bin::Pow => x.powf(y),
        Bin::Mod(true) => x % y,
        Bin::Mod(false) => {
            let r = x % y;
            if r != 0.0 && (r < 0.0) != (y < 0.0) { r + y } else { r }
        }
        Bin::Max => {
            if x.is_nan() || y.is_nan() {
                f64::NAN
            } else {
                x.max(y)
            }
        }
        Bin::Min => {
            if x.is_nan() || y.is_nan() {
                f64::NAN
            } else {
                x.min(y)
            }
        }
        Bin::PRelu => {
            if x < 0.0 {
                x * y
            } else {
                x
            }
        }
        _ => f64::NAN,
    }
}

fn f32_bin(k: Bin, x: f32, y: f32) -> f32 {
    match k {
        Bin::Add => x + y,
        Bin::Sub => x - y,
        Bin::Mul => x * y,
        Bin::Div => x / y,
        Bin::Pow => {
            if y == 2.0 {
                x * x
            } else {
                f64::from(x).powf(f64::from(y)) as f32
            }
        }
        Bin::PRelu => {
            if x < 0.0 {
                x * y
            } else {
                x
            }
        }
        _ => float_bin(k, f64::from(x), f64::from(y)) as f32,
    }
}

fn int_bin(k: Bin, x: i64, y: i64) -> Result<i64> {
    Ok(match k {
        Bin::Add => x.wrapping_add(y),
        Bin::Sub => x.wrapping_sub(y),
        Bin::Mul => x.wrapping_mul(y),
        Bin::Div => {
            if y == 0 {
                return Err(EvalError::Invalid("integer division by zero".into()));
            }
            x.wrapping_div(y)
        }
        Bin::Pow => {
            if y < 0 {
                0
            } else {
                x.wrapping_pow(y.min(u32::MAX as i64) as u32)
            }
        }
        Bin::Mod(fmod) => {
            if y == 0 {
                return Err(EvalError::Invalid("integer modulo by zero".into()));
            }
            let r = x.wrapping_rem(y);
            if !fmod && r != 0 && (r < 0) != (y < 0) { r + y } else { r }
        }
        Bin::Max => x.max(y),
        Bin::Min => x.min(y),
        Bin::PRelu => {
            if x < 0 {
                x.wrapping_mul(y)
            } else {
                x
            }
        }
        Bin::BitAnd => x & y,
        Bin::BitOr => x | y,
        Bin::BitXor => x ^ y,
        Bin::ShiftL => {
            if y >= 64 {
                0
            } else {
                ((x as u64) << y) as i64
            }
        }
        Bin::ShiftR => {
            if y >= 64 {
                0
            } else {
                ((x as u64) >> y) as i64
            }
        }
    })
}

fn binary(k: Bin, a: &Array, b: &Array) -> Result<Array> {
    let (shape, data) = match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            let (s, v) = zip_map(x, &a.shape, y, &b.shape, |p, q| f32_bin(k, p, q))?;
            (s, Data::F32(v.into_iter().map(|r| super::array::round_to(a.dtype, r)).collect()))
        }
        (Data::F64(x), Data::F64(y)) => {
            let (s, v) = zip_map(x, &a.shape, y, &b.shape, |p, q| float_bin(k, p, q))?;
            (s, Data::F64(v))
        }
        (Data::F32(x), _) if k == Bin::Pow => {
            let y = b.to_f32()?;
            let (s, v) = zip_map(x, &a.shape, &y, &b.shape, |p, q| f32_bin(k, p, q))?;
            (s, Data::F32(v))
        }
        (Data::F64(x), _) if k == Bin::Pow => {
            let y = b.to_f64()?;
            let (s, v) = zip_map(x, &a.shape, &y, &b.shape, |p, q| float_bin(k, p, q))?;
            (s, Data::F64(v))
        }
        (Data::I64(x), Data::I64(y)) => {
            let (s, v) = zip_map(x, &a.shape, y, &b.shape, |p, q| int_bin(k, p, q))?;
            (s, Data::I64(v.into_iter().map(|r| r.map(|r| wrap_int(a.dtype, r))).collect::<Result<_>>()?))
        }
        (Data::I64(x), _) if k == Bin::Pow => {
            let y = b.to_f64()?;
            let (s, v) = zip_map(x, &a.shape, &y, &b.shape, |p, q| (p as f64).powf(q) as i64)?;
            (s, Data::I64(v.into_iter().map(|r| wrap_int(a.dtype, r)).collect()))
        }
        _ => {
            return Err(EvalError::Invalid(format!("element types {} and {} do not match", a.dtype, b.dtype)));
        }
    };
    Ok(Array { dtype: a.dtype, shape, data })
}

fn compare(k: Cmp, a: &Array, b: &Array) -> Result<Array> {
    fn f<T: PartialOrd>(k: Cmp, x: T, y: T) -> bool {
        match k {
            Cmp::Eq => x == y,
            Cmp::Lt => x < y,
            Cmp::Le => x <= y,
            Cmp::Gt => x > y,
            Cmp::Ge => x >= y,
        }
    }
    let (shape, v) = match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => zip_map(x, &a.shape, y, &b.shape, |p, q| f(k, p, q))?,
        (Data::I64(x), Data::I64(y)) => zip_map(x, &a.shape, y, &b.shape, |p, q| f(k, p, q))?,
        (Data::Bool(x), Data::Bool(y)) => zip_map(x, &a.shape, y, &b.shape, |p, q| f(k, p, q))?,
        (Data::Str(x), Data::Str(y)) if k == Cmp::Eq => {
            let shape = broadcast_shapes(&a.shape, &b.shape)?;
            let ia = broadcast_index(&shape, &a.shape);
            let ib = broadcast_index(&shape, &b.shape);
            let v = ia.iter().zip(&ib).map(|(&i, &j)| x[i] == y[j]).collect();
            (shape, v)
        }
        _ => {
            let (x, y) = (a.to_f64()?, b.to_f64()?);
            zip_map(&x, &a.shape, &y, &b.shape, |p, q| f(k, p, q))?
        }
    };
    Ok(Array::bool(shape, v))
}

fn logical(op: &Op, a: &Array, b: &Array) -> Result<Array> {
    let (Data::Bool(x), Data::Bool(y)) = (&a.data, &b.data) else {
        return Err(unsupported(op.op_type(), a.dtype));
    };
    let (shape, v) = zip_map(x, &a.shape, y, &b.shape, |p, q| match op {
        Op::And(_) => p && q,
        Op::Or(_) => p || q,
        _ => p ^ q,
    })?;
    Ok(Array::bool(shape, v))
}

/// `cond ? x : y` with broadcasting.
pub fn where_(c: &Array, x: &Array, y: &Array) -> Result<Array> {
    let Data::Bool(cv) = &c.data else { return Err(unsupported("Where condition", c.dtype)) };
    let shape = broadcast_shapes(&broadcast_shapes(&c.shape, &x.shape)?, &y.shape)?;
    let ic = broadcast_index(&shape, &c.shape);
    let ix = broadcast_index(&shape, &x.shape);
    let iy = broadcast_index(&shape, &y.shape);
    // Gather from the concatenation of x and y.
    let both = Array { dtype: x.dtype, shape: vec![x.numel() + y.numel()], data: Array::concat_data(&[x, y]) };
    if x.dtype != y.dtype {
        return Err(EvalError::Invalid(format!("Where branches are {} and {}", x.dtype, y.dtype)));
    }
    let idx: Vec<usize> = (0..numel(&shape)).map(|k| if cv[ic[k]] { ix[k] } else { x.numel() + iy[k] }).collect();
    Ok(both.gather_flat(shape, &idx))
}

// ---------------------------------------------------------------- reductions

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
    if is_int {
        Ok(Array::int(x.dtype, out_shape, acc.iter().map(|&a| a as i64).collect()))
    } else {
        Ok(Array::float(x.dtype, out_shape, acc))
    }
}

fn reduce_op(op: &Op, inputs: &[Option<&Array>], opset: i64) -> Result<Array> {
    let x = req(inputs, 0, op.op_type())?;
    macro_rules! attrs {
        ($a:expr) => {
            ($a.axes.clone(), $a.keepdims() != 0, $a.noop_with_empty_axes() != 0)
        };
    }
    let (k, (attr_axes, keep, noop)) = match op {
        Op::ReduceSum(a) => (Red::Sum, attrs!(a)),
        Op::ReduceMean(a) => (Red::Mean, attrs!(a)),
        Op::ReduceMax(a) => (Red::Max, attrs!(a)),
        Op::ReduceMin(a) => (Red::Min, attrs!(a)),
        Op::ReduceProd(a) => (Red::Prod, attrs!(a)),
        Op::ReduceL1(a) => (Red::L1, attrs!(a)),
        Op::ReduceL2(a) => (Red::L2, attrs!(a)),
        Op::ReduceLogSum(a) => (Red::LogSum, attrs!(a)),
        Op::ReduceLogSumExp(a) => (Red::LogSumExp, attrs!(a)),
        Op::ReduceSumSquare(a) => (Red::SumSquare, attrs!(a)),
        _ => unreachable!("not a reduction"),
    };
    let _ = opset;
    let axes: Vec<i64> = match (opt(inputs, 1), attr_axes) {
        (Some(a), _) => a.to_i64()?,
        (None, Some(a)) => a,
        (None, None) => vec![],
    };
    if axes.is_empty() && noop {
        return Ok(x.clone());
    }
    let axes: Vec<usize> = if axes.is_empty() {
        (0..x.rank()).collect()
    } else {
        axes.iter().map(|&a| axis(a, x.rank())).collect::<Result<_>>()?
    };
    reduce(x, &axes, keep, k)
}

fn arg_extreme(x: &Array, ax: i64, keepdims: bool, last: bool, max: bool) -> Result<Array> {
    let ax = axis(ax, x.rank())?;
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

/// Softmax, LogSoftmax, Hardmax along `axis` (opset ≥ 13), or over the flattened dims from
/// `axis` on (older opsets).
fn softmax_like(op: &Op, x: &Array, opset: i64) -> Result<Array> {
    let legacy = opset > 0 && opset < 13;
    let attr = match op {
        Op::Softmax(a) => a.axis,
        Op::LogSoftmax(a) => a.axis,
        Op::Hardmax(a) => a.axis,
        _ => unreachable!(),
    };
    let ax = axis(attr.unwrap_or(if legacy { 1 } else { -1 }), x.rank())?;
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
            match op {
                Op::Hardmax(_) => {
                    let best = (0..n).find(|&j| v[at(j)] == mx).unwrap_or(0);
                    out[at(best)] = 1.0;
                }
                _ => {
                    let sum: f64 = (0..n).map(|j| (v[at(j)] - mx).exp()).sum();
                    for j in 0..n {
                        out[at(j)] = if matches!(op, Op::LogSoftmax(_)) {
                            v[at(j)] - mx - sum.ln()
                        } else {
                            (v[at(j)] - mx).exp() / sum
                        };
                    }
                }
            }
        }
    }
    Ok(Array::float(x.dtype, x.shape.clone(), out))
}

// ---------------------------------------------------------------- data movement

/// Permutes dimensions.
pub fn transpose(x: &Array, perm: &[usize]) -> Array {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let istr = strides(&x.shape);
    let n = x.numel();
    let mut idx = Vec::with_capacity(n);
    let mut counter = vec![0usize; shape.len()];
    let pstr: Vec<usize> = perm.iter().map(|&p| istr[p]).collect();
    let mut flat = 0usize;
    for _ in 0..n {
        idx.push(flat);
        for d in (0..shape.len()).rev() {
            counter[d] += 1;
            flat += pstr[d];
            if counter[d] < shape[d] {
                break;
            }
            flat -= pstr[d] * counter[d];
            counter[d] = 0;
        }
    }
    x.gather_flat(shape, &idx)
}

/// Target shape of a Reshape (0 copies, -1 infers).
pub fn reshape_target(input: &[usize], spec: &[i64], allowzero: bool) -> Result<Vec<usize>> {
    let total = numel(input);
    let mut out = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &s) in spec.iter().enumerate() {
        match s {
            -1 => {
                if infer.replace(i).is_some() {
                    return Err(EvalError::Invalid("Reshape has more than one -1".into()));
                }
                out.push(1);
            }
            0 if !allowzero => out.push(*input.get(i).ok_or_else(|| {
                EvalError::Invalid(format!("Reshape copies dim {i} of a rank-{} input", input.len()))
            })?),
            s if s < 0 => return Err(EvalError::Invalid(format!("Reshape dim {s}"))),
            s => out.push(s as usize),
        }
    }
    if let Some(i) = infer {
        let known: usize = out.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, d)| *d).product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(EvalError::Invalid(format!("cannot reshape {input:?} to {spec:?}")));
        }
        out[i] = total / known;
    }
    if numel(&out) != total {
        return Err(EvalError::Invalid(format!("cannot reshape {input:?} ({total} elements) to {spec:?}")));
    }
    Ok(out)
}

fn concat(parts: &[&Array], ax: i64) -> Result<Array> {
    let first = parts[0];
    let ax = axis(ax, first.rank())?;
    let mut shape = first.shape.clone();
    shape[ax] = parts.iter().map(|p| p.shape[ax]).sum();
    for p in parts {
        if p.rank() != first.rank() || (0..first.rank()).any(|d| d != ax && p.shape[d] != first.shape[d]) {
            return Err(EvalError::Invalid(format!("Concat of {:?} and {:?} along {ax}", first.shape, p.shape)));
        }
        if p.dtype != first.dtype {
            return Err(EvalError::Invalid("Concat of different element types".into()));
        }
    }
    let outer: usize = shape[..ax].iter().product();
    let inner: usize = shape[ax + 1..].iter().product();
    let all = Array { dtype: first.dtype, shape: vec![], data: Array::concat_data(parts) };
    let mut offsets = Vec::with_capacity(parts.len());
    let mut acc = 0;
    for p in parts {
        offsets.push(acc);
        acc += p.numel();
    }
    let mut idx = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for (p, off) in parts.iter().zip(&offsets) {
            let block = p.shape[ax] * inner;
            idx.extend((0..block).map(|k| off + o * block + k));
        }
    }
    Ok(all.gather_flat(shape, &idx))
}

/// Slices `x` along `ax` from `start` for `len` elements.
pub fn slice_axis(x: &Array, ax: usize, start: usize, len: usize) -> Array {
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut idx = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        for j in start..start + len {
            let base = (o * n + j) * inner;
            idx.extend(base..base + inner);
        }
    }
    let mut shape = x.shape.clone();
    shape[ax] = len;
    x.gather_flat(shape, &idx)
}

fn split(op: &op::Split, inputs: &[Option<&Array>], n_out: usize) -> Result<Vec<Array>> {
    let x = req(inputs, 0, "Split")?;
    let ax = axis(op.axis(), x.rank())?;
    let total = x.shape[ax];
    let sizes: Vec<usize> = match (opt(inputs, 1), &op.split) {
        (Some(s), _) => s.to_i64()?.iter().map(|&v| v as usize).collect(),
        (None, Some(s)) => s.iter().map(|&v| v as usize).collect(),
        _ => {
            let parts = op.num_outputs.map(|n| n as usize).unwrap_or(n_out).max(1);
            let chunk = total.div_ceil(parts);
            (0..parts).map(|i| chunk.min(total.saturating_sub(i * chunk))).collect()
        }
    };
    if sizes.iter().sum::<usize>() != total {
        return Err(EvalError::Invalid(format!("Split sizes {sizes:?} do not add up to {total}")));
    }
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&s| {
            let a = slice_axis(x, ax, start, s);
            start += s;
            a
        })
        .collect())
}

/// Normalised slice parameters of one axis: (start, step, count).
pub fn slice_params(dim: i64, start: i64, end: i64, step: i64) -> (i64, i64, usize) {
    let clampi = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
    let norm = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
    if step > 0 {
        let s = clampi(norm(start), 0, dim);
        let e = clampi(norm(end), 0, dim);
        let count = if e > s { ((e - s) + step - 1) / step } else { 0 };
        (s, step, count as usize)
    } else {
        let s = clampi(norm(start), -1, dim - 1);
        let e = clampi(norm(end), -1, dim - 1);
        let count = if s > e { ((s - e) + (-step) - 1) / (-step) } else { 0 };
        (s, step, count as usize)
    }
}

fn slice(op: &op::Slice, inputs: &[Option<&Array>]) -> Result<Array> {
    let x = req(inputs, 0, "Slice")?;
    let (starts, ends, axes, steps) = if opt(inputs, 1).is_some() || op.starts.is_none() {
        (
            req(inputs, 1, "Slice starts")?.to_i64()?,
            req(inputs, 2, "Slice ends")?.to_i64()?,
            opt(inputs, 3).map(|a| a.to_i64()).transpose()?,
            opt(inputs, 4).map(|a| a.to_i64()).transpose()?,
        )
    } else {
        (op.starts.clone().unwrap_or_default(), op.ends.clone().unwrap_or_default(), op.axes.clone(), None)
    };
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| axis(v, x.rank())).collect::<Result<_>>()?,
        None => (0..starts.len()).collect(),
    };
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    let rank = x.rank();
    let mut start = vec![0i64; rank];
    let mut step = vec![1i64; rank];
    let mut count: Vec<usize> = x.shape.clone();
    for (k, &ax) in axes.iter().enumerate() {
        if steps[k] == 0 {
            return Err(EvalError::Invalid("Slice step 0".into()));
        }
        let (s, st, c) = slice_params(x.shape[ax] as i64, starts[k], ends[k], steps[k]);
        start[ax] = s;
        step[ax] = st;
        count[ax] = c;
    }
    let istr = strides(&x.shape);
    let n = numel(&count);
    let mut idx = Vec::with_capacity(n);
    let mut counter = vec![0usize; rank];
    for _ in 0..n {
        let mut flat = 0i64;
        for d in 0..rank {
            flat += (start[d] + counter[d] as i64 * step[d]) * istr[d] as i64;
        }
        idx.push(flat as usize);
        for d in (0..rank).rev() {
            counter[d] += 1;
            if counter[d] < count[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(x.gather_flat(count, &idx))
}

fn gather(x: &Array, indices: &Array, ax: i64) -> Result<Array> {
    let ax = axis(ax, x.rank())?;
    let idx = indices.to_i64()?;
    let n = x.shape[ax] as i64;
    let outer: usize = x.shape[..ax].iter().product();
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut flat = Vec::with_capacity(outer * idx.len() * inner);
    for o in 0..outer {
        for &i in &idx {
            let j = if i < 0 { i + n } else { i };
            if j < 0 || j >= n {
                return Err(EvalError::Invalid(format!("Gather index {i} out of range for size {n}")));
            }
            let base = (o * n as usize + j as usize) * inner;
            flat.extend(base..base + inner);
        }
    }
    let mut shape = x.shape[..ax].to_vec();
    shape.extend(&indices.shape);
    shape.extend(&x.shape[ax + 1..]);
    Ok(x.gather_flat(shape, &flat))
}

fn gather_elements(x: &Array, indices: &Array, ax: i64) -> Result<Array> {
    let ax = axis(ax, x.rank())?;
    let idx = indices.to_i64()?;
    let istr = strides(&indices.shape);
    let xstr = strides(&x.shape);
    let mut flat = Vec::with_capacity(idx.len());
    for (k, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for d in 0..x.rank() {
            let c = (k / istr[d]) % indices.shape[d];
            let c = if d == ax {
                let n = x.shape[ax] as i64;
                let j = if i < 0 { i + n } else { i };
                if j < 0 || j >= n {
                    return Err(EvalError::Invalid(format!("GatherElements index {i} out of range")));
                }
                j as usize
            } else {
                c
            };
            off += c * xstr[d];
        }
        flat.push(off);
    }
    Ok(x.gather_flat(indices.shape.clone(), &flat))
}

fn gather_nd(x: &Array, indices: &Array, batch: usize) -> Result<Array> {
    let idx = indices.to_i64()?;
    let k = *indices.shape.last().ok_or_else(|| EvalError::Invalid("GatherND indices of rank 0".into()))?;
    let xstr = strides(&x.shape);
    let batch_n: usize = x.shape[..batch].iter().product();
    let slice: usize = x.shape[batch + k..].iter().product();
    let tuples = idx.len() / k.max(1);
    let per_batch = tuples / batch_n.max(1);
    let mut flat = Vec::with_capacity(tuples * slice);
    for t in 0..tuples {
        let b = t / per_batch.max(1);
        let mut off = if batch > 0 { b * xstr[batch - 1] } else { 0 };
        for j in 0..k {
            let d = batch + j;
            let n = x.shape[d] as i64;
            let i = idx[t * k + j];
            let i = if i < 0 { i + n } else { i };
            if i < 0 || i >= n {
                return Err(EvalError::Invalid("GatherND index out of range".into()));
            }
            off += i as usize * xstr[d];
        }
        flat.extend(off..off + slice);
    }
    let mut shape = indices.shape[..indices.rank() - 1].to_vec();
    shape.extend(&x.shape[batch + k..]);
    Ok(x.gather_flat(shape, &flat))
}

fn scatter_values(data: &Array, updates: &Array, targets: &[usize], reduction: &str) -> Result<Array> {
    let mut out = data.clone();
    match (&mut out.data, &updates.data) {
        (Data::F32(o), Data::F32(u)) => {
            for (k, &t) in targets.iter().enumerate() {
                o[t] = match reduction {
                    "add" => o[t] + u[k],
                    "mul" => o[t] * u[k],
                    "max" => o[t].max(u[k]),
                    "min" => o[t].min(u[k]),
                    _ => u[k],
                };
            }
        }
        (Data::I64(o), Data::I64(u)) => {
            for (k, &t) in targets.iter().enumerate() {
                o[t] = match reduction {
                    "add" => o[t] + u[k],
                    "mul" => o[t] * u[k],
                    "max" => o[t].max(u[k]),
                    "min" => o[t].min(u[k]),
                    _ => u[k],
                };
            }
        }
        (Data::Bool(o), Data::Bool(u)) => {
            for (k, &t) in targets.iter().enumerate() {
                o[t] = u[k];
            }
        }
        _ => return Err(EvalError::Unsupported(format!("scatter on {}", data.dtype))),
    }
    Ok(out)
}

fn scatter_nd(data: &Array, indices: &Array, updates: &Array, reduction: &str) -> Result<Array> {
    let idx = indices.to_i64()?;
    let k = *indices.shape.last().unwrap_or(&0);
    let dstr = strides(&data.shape);
    let slice: usize = data.shape[k..].iter().product();
    let mut targets = Vec::with_capacity(updates.numel());
    for t in 0..idx.len() / k.max(1) {
        let mut off = 0;
        for j in 0..k {
            let n = data.shape[j] as i64;
            let i = idx[t * k + j];
            let i = if i < 0 { i + n } else { i };
            if i < 0 || i >= n {
                return Err(EvalError::Invalid("ScatterND index out of range".into()));
            }
            off += i as usize * dstr[j];
        }
        targets.extend(off..off + slice);
    }
    scatter_values(data, updates, &targets, reduction)
}

fn scatter_elements(data: &Array, indices: &Array, updates: &Array, ax: i64, reduction: &str) -> Result<Array> {
    let ax = axis(ax, data.rank())?;
    let idx = indices.to_i64()?;
    let istr = strides(&indices.shape);
    let dstr = strides(&data.shape);
    let mut targets = Vec::with_capacity(idx.len());
    for (k, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for d in 0..data.rank() {
            let mut c = (k / istr[d]) % indices.shape[d];
            if d == ax {
                let n = data.shape[ax] as i64;
                let j = if i < 0 { i + n } else { i };
                if j < 0 || j >= n {
                    return Err(EvalError::Invalid("ScatterElements index out of range".into()));
                }
                c = j as usize;
            }
            off += c * dstr[d];
        }
        targets.push(off);
    }
    scatter_values(data, updates, &targets, reduction)
}

fn expand(x: &Array, shape: &[i64]) -> Result<Array> {
    let target: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let out = broadcast_shapes(&x.shape, &target)?;
    let idx = broadcast_index(&out, &x.shape);
    Ok(x.gather_flat(out, &idx))
}

fn tile(x: &Array, repeats: &[i64]) -> Result<Array> {
    if repeats.len() != x.rank() {
        return Err(EvalError::Invalid("Tile repeats must match the rank".into()));
    }
    let shape: Vec<usize> = x.shape.iter().zip(repeats).map(|(&d, &r)| d * r.max(0) as usize).collect();
    let istr = strides(&x.shape);
    let ostr = strides(&shape);
    let idx: Vec<usize> = (0..numel(&shape))
        .map(|k| (0..shape.len()).map(|d| ((k / ostr[d]) % shape[d] % x.shape[d].max(1)) * istr[d]).sum())
        .collect();
    Ok(x.gather_flat(shape, &idx))
}

fn pad(op: &op::Pad, inputs: &[Option<&Array>]) -> Result<Array> {
    let x = req(inputs, 0, "Pad")?;
    let rank = x.rank();
    let pads_raw: Vec<i64> = match (opt(inputs, 1), &op.pads) {
        (Some(p), _) => p.to_i64()?,
        (None, Some(p)) => p.clone(),
        _ => vec![0; 2 * rank],
    };
    let axes: Vec<usize> = match opt(inputs, 3) {
        Some(a) => a.to_i64()?.iter().map(|&v| axis(v, rank)).collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    let mut pads = vec![0i64; 2 * rank];
    let k = axes.len();
    if pads_raw.len() != 2 * k {
        return Err(EvalError::Invalid(format!("Pad needs {} pads, got {}", 2 * k, pads_raw.len())));
    }
    for (i, &a) in axes.iter().enumerate() {
        pads[a] = pads_raw[i];
        pads[a + rank] = pads_raw[i + k];
    }
    let value = match opt(inputs, 2) {
        Some(v) => v.to_f64()?.first().copied().unwrap_or(0.0),
        None => f64::from(op.value.unwrap_or(0.0)),
    };
    let shape: Vec<usize> = (0..rank).map(|d| (x.shape[d] as i64 + pads[d] + pads[d + rank]).max(0) as usize).collect();
    let mode = op.mode();
    let istr = strides(&x.shape);
    let ostr = strides(&shape);
    let n = numel(&shape);
    // Map each output element to an input index or to "fill".
    let mut src: Vec<Option<usize>> = Vec::with_capacity(n);
    for k in 0..n {
        let mut off = 0usize;
        let mut fill = false;
        for d in 0..rank {
            let o = ((k / ostr[d]) % shape[d]) as i64 - pads[d];
            let len = x.shape[d] as i64;
            let i = if (0..len).contains(&o) {
                o
            } else {
                match mode {
                    "edge" => o.clamp(0, len - 1),
                    "reflect" => {
                        if len == 1 {
                            0
                        } else {
                            let period = 2 * (len - 1);
                            let m = o.rem_euclid(period);
                            if m < len { m } else { period - m }
                        }
                    }
                    "wrap" => o.rem_euclid(len.max(1)),
                    _ => {
                        fill = true;
                        0
                    }
                }
            };
            off += i.max(0) as usize * istr[d];
        }
        src.push(if fill { None } else { Some(off) });
    }
    let fill_arr = Array::float(DType::Double, vec![1], vec![value]);
    let fill_arr = cast(&fill_arr, x.dtype)?;
    let both = Array { dtype: x.dtype, shape: vec![], data: Array::concat_data(&[x, &fill_arr]) };
    let idx: Vec<usize> = src.iter().map(|s| s.unwrap_or(x.numel())).collect();
    Ok(both.gather_flat(shape, &idx))
}

fn depth_to_space(x: &Array, b: usize, mode: &str) -> Result<Array> {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let cc = c / (b * b);
    let tmp = if mode == "CRD" {
        transpose(&x.clone().reshaped(vec![n, cc, b, b, h, w]), &[0, 1, 4, 2, 5, 3])
    } else {
        transpose(&x.clone().reshaped(vec![n, b, b, cc, h, w]), &[0, 3, 4, 1, 5, 2])
    };
    Ok(tmp.reshaped(vec![n, cc, h * b, w * b]))
}

fn space_to_depth(x: &Array, b: usize) -> Result<Array> {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let tmp = transpose(&x.clone().reshaped(vec![n, c, h / b, b, w / b, b]), &[0, 3, 5, 1, 2, 4]);
    Ok(tmp.reshaped(vec![n, c * b * b, h / b, w / b]))
}

fn constant(c: &op::Constant) -> Result<Array> {
    if let Some(t) = &c.value {
        return Array::from_tensor(t);
    }
    if let Some(v) = c.value_float {
        return Ok(Array::f32(vec![], vec![v]));
    }
    if let Some(v) = &c.value_floats {
        return Ok(Array::f32(vec![v.len()], v.clone()));
    }
    if let Some(v) = c.value_int {
        return Ok(Array::scalar_i64(v));
    }
    if let Some(v) = &c.value_ints {
        return Ok(Array::i64(vec![v.len()], v.clone()));
    }
    if let Some(v) = &c.value_string {
        return Ok(Array { dtype: DType::String, shape: vec![], data: Data::Str(vec![v.clone()]) });
    }
    if let Some(v) = &c.value_strings {
        return Ok(Array { dtype: DType::String, shape: vec![v.len()], data: Data::Str(v.clone()) });
    }
    Err(EvalError::Invalid("Constant without a value".into()))
}

fn range(start: &Array, limit: &Array, delta: &Array) -> Result<Array> {
    match start.data {
        Data::I64(_) => {
            let (s, l, d) = (start.to_i64()?[0], limit.to_i64()?[0], delta.to_i64()?[0]);
            if d == 0 {
                return Err(EvalError::Invalid("Range delta 0".into()));
            }
            let n = ((l - s) as f64 / d as f64).ceil().max(0.0) as usize;
            Ok(Array::int(start.dtype, vec![n], (0..n as i64).map(|i| s + i * d).collect()))
        }
        _ => {
            let (s, l, d) = (start.to_f64()?[0], limit.to_f64()?[0], delta.to_f64()?[0]);
            let n = ((l - s) / d).ceil().max(0.0) as usize;
            Ok(Array::float(start.dtype, vec![n], (0..n).map(|i| s + i as f64 * d).collect()))
        }
    }
}

fn trilu(x: &Array, k: i64, upper: bool) -> Result<Array> {
    let r = x.rank();
    if r < 2 {
        return Err(EvalError::Invalid("Trilu needs rank ≥ 2".into()));
    }
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let zero = cast(&Array::f32(vec![1], vec![0.0]), x.dtype)?;
    let both = Array { dtype: x.dtype, shape: vec![], data: Array::concat_data(&[x, &zero]) };
    let idx: Vec<usize> = (0..x.numel())
        .map(|f| {
            let i = ((f / w) % h) as i64;
            let j = (f % w) as i64;
            let keep = if upper { j - i >= k } else { j - i <= k };
            if keep { f } else { x.numel() }
        })
        .collect();
    Ok(both.gather_flat(x.shape.clone(), &idx))
}

fn topk(x: &Array, k: usize, ax: i64, largest: bool) -> Result<Vec<Array>> {
    let ax = axis(ax, x.rank())?;
    let v = x.to_f64()?;
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    if k > n {
        return Err(EvalError::Invalid(format!("TopK k = {k} exceeds the axis size {n}")));
    }
    let mut flat = Vec::with_capacity(outer * k * inner);
    let mut ids = vec![0i64; outer * k * inner];
    for o in 0..outer {
        for i in 0..inner {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| {
                let (va, vb) = (v[(o * n + a) * inner + i], v[(o * n + b) * inner + i]);
                let c = if largest { vb.partial_cmp(&va) } else { va.partial_cmp(&vb) };
                c.unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
            });
            for (j, &src) in order.iter().take(k).enumerate() {
                ids[(o * k + j) * inner + i] = src as i64;
            }
        }
    }
    for o in 0..outer {
        for j in 0..k {
            for i in 0..inner {
                flat.push((o * n + ids[(o * k + j) * inner + i] as usize) * inner + i);
            }
        }
    }
    let mut shape = x.shape.clone();
    shape[ax] = k;
    Ok(vec![x.gather_flat(shape.clone(), &flat), Array::i64(shape, ids)])
}

fn one_hot(indices: &Array, depth: &Array, values: &Array, ax: i64) -> Result<Array> {
    let depth = depth.to_f64()?[0] as i64;
    let rank = indices.rank() + 1;
    let ax = axis(ax, rank)?;
    let idx = indices.to_i64()?;
    let outer: usize = indices.shape[..ax].iter().product();
    let inner: usize = indices.shape[ax..].iter().product();
    let mut shape = indices.shape.clone();
    shape.insert(ax, depth.max(0) as usize);
    let both = values;
    let mut sel = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for d in 0..depth {
            for i in 0..inner {
                let mut t = idx[o * inner + i];
                if t < 0 {
                    t += depth;
                }
                sel.push(if t == d { 1 } else { 0 });
            }
        }
    }
    Ok(both.gather_flat(shape, &sel))
}

fn cumsum(x: &Array, ax: &Array, exclusive: bool, reverse: bool) -> Result<Array> {
    let ax = axis(ax.to_i64()?[0], x.rank())?;
    let v = x.to_f64()?;
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut out = vec![0.0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0.0;
            for jj in 0..n {
                let j = if reverse { n - 1 - jj } else { jj };
                let at = (o * n + j) * inner + i;
                if exclusive {
                    out[at] = acc;
                    acc += v[at];
                } else {
                    acc += v[at];
                    out[at] = acc;
                }
            }
        }
    }
    match x.data {
        Data::I64(_) => Ok(Array::int(x.dtype, x.shape.clone(), out.iter().map(|&a| a as i64).collect())),
        _ => Ok(Array::float(x.dtype, x.shape.clone(), out)),
    }
}

fn nonzero(x: &Array) -> Result<Array> {
    let v = x.to_f64()?;
    let str_ = strides(&x.shape);
    let hits: Vec<usize> = (0..v.len()).filter(|&i| v[i] != 0.0).collect();
    let r = x.rank();
    let mut out = vec![0i64; r * hits.len()];
    for (k, &f) in hits.iter().enumerate() {
        for d in 0..r {
            out[d * hits.len() + k] = ((f / str_[d]) % x.shape[d]) as i64;
        }
    }
    Ok(Array::i64(vec![r, hits.len()], out))
}

/// Evaluates one op on concrete inputs. `n_out` is the number of outputs the node declares.
pub fn eval_op(op: &Op, inputs: &[Option<&Array>], n_out: usize, opset: i64) -> Result<Vec<Array>> {
    let name = op.op_type();
    let x0 = || req(inputs, 0, name);
    let one = |a: Array| Ok(vec![a]);
    match op {
        Op::Cast(c) => {
            let to =
                c.to.and_then(DType::from_code)
                    .ok_or_else(|| EvalError::Invalid("Cast without a valid `to`".into()))?;
            one(cast(x0()?, to)?)
        }
        Op::CastLike(_) => one(cast(x0()?, req(inputs, 1, name)?.dtype)?),
        Op::Clip(c) => {
            let x = x0()?;
            let lo = match opt(inputs, 1) {
                Some(a) => Some(a.to_f64()?[0]),
                None => c.min.map(f64::from),
            };
            let hi = match opt(inputs, 2) {
                Some(a) => Some(a.to_f64()?[0]),
                None => c.max.map(f64::from),
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
                    one(Array::int(x.dtype, x.shape.clone(), v.iter().map(|&a| f(a as f64) as i64).collect()))
                }
                _ => one(map_float(x, |v| f(f64::from(v)) as f32, f, name)?),
            }
        }
        Op::Dropout(_) => {
            let x = x0()?;
            let mut out = vec![x.clone()];
            if n_out > 1 {
                out.push(Array::bool(x.shape.clone(), vec![true; x.numel()]));
            }
            Ok(out)
        }
        _ if op.class() == crate::op::OpClass::Unary => one(unary(op, x0()?)?),
        Op::Add(_) => one(binary(Bin::Add, x0()?, req(inputs, 1, name)?)?),
        Op::Sub(_) => one(binary(Bin::Sub, x0()?, req(inputs, 1, name)?)?),
        Op::Mul(_) => one(binary(Bin::Mul, x0()?, req(inputs, 1, name)?)?),
        Op::Div(_) => one(binary(Bin::Div, x0()?, req(inputs, 1, name)?)?),
        Op::Pow(_) => one(binary(Bin::Pow, x0()?, req(inputs, 1, name)?)?),
        Op::Mod(m) => one(binary(Bin::Mod(m.fmod() != 0), x0()?, req(inputs, 1, name)?)?),
        Op::PRelu(_) => one(binary(Bin::PRelu, x0()?, req(inputs, 1, name)?)?),
        Op::BitwiseAnd(_) => one(binary(Bin::BitAnd, x0()?, req(inputs, 1, name)?)?),
        Op::BitwiseOr(_) => one(binary(Bin::BitOr, x0()?, req(inputs, 1, name)?)?),
        Op::BitwiseXor(_) => one(binary(Bin::BitXor, x0()?, req(inputs, 1, name)?)?),
        Op::BitShift(b) => {
            let k = if b.direction.as_deref() == Some("LEFT") { Bin::ShiftL } else { Bin::ShiftR };
            one(binary(k, x0()?, req(inputs, 1, name)?)?)
        }
        Op::Equal(_) => one(compare(Cmp::Eq, x0()?, req(inputs, 1, name)?)?),
        Op::Less(_) => one(compare(Cmp::Lt, x0()?, req(inputs, 1, name)?)?),
        Op::LessOrEqual(_) => one(compare(Cmp::Le, x0()?, req(inputs, 1, name)?)?),
        Op::Greater(_) => one(compare(Cmp::Gt, x0()?, req(inputs, 1, name)?)?),
        Op::GreaterOrEqual(_) => one(compare(Cmp::Ge, x0()?, req(inputs, 1, name)?)?),
        Op::And(_) | Op::Or(_) | Op::Xor(_) => one(logical(op, x0()?, req(inputs, 1, name)?)?),
        Op::Where(_) => one(where_(x0()?, req(inputs, 1, name)?, req(inputs, 2, name)?)?),
        Op::Max(_) | Op::Min(_) | Op::Sum(_) | Op::Mean(_) => {
            let all: Vec<&Array> = inputs.iter().flatten().copied().collect();
            let mut acc =
                all.first().copied().cloned().ok_or_else(|| EvalError::Invalid(format!("{name} without inputs")))?;
            let k = match op {
                Op::Max(_) => Bin::Max,
                Op::Min(_) => Bin::Min,
                _ => Bin::Add,
            };
            for a in &all[1..] {
                acc = binary(k, &acc, a)?;
            }
            if let Op::Mean(_) = op {
                let n = Array::float(acc.dtype, vec![], vec![all.len() as f64]);
                acc = binary(Bin::Div, &acc, &cast(&n, acc.dtype)?)?;
            }
            one(acc)
        }
        Op::ReduceSum(_)
        | Op::ReduceMean(_)
        | Op::ReduceMax(_)
        | Op::ReduceMin(_)
        | Op::ReduceProd(_)
        | Op::ReduceL1(_)
        | Op::ReduceL2(_)
        | Op::ReduceLogSum(_)
        | Op::ReduceLogSumExp(_)
        | Op::ReduceSumSquare(_) => one(reduce_op(op, inputs, opset)?),
        Op::ArgMax(a) => one(arg_extreme(x0()?, a.axis(), a.keepdims() != 0, a.select_last_index() != 0, true)?),
        Op::ArgMin(a) => one(arg_extreme(x0()?, a.axis(), a.keepdims() != 0, a.select_last_index() != 0, false)?),
        Op::Softmax(_) | Op::LogSoftmax(_) | Op::Hardmax(_) => one(softmax_like(op, x0()?, opset)?),
        Op::Reshape(r) => {
            let x = x0()?;
            let spec = req(inputs, 1, name)?.to_i64()?;
            one(x.clone().reshaped(reshape_target(&x.shape, &spec, r.allowzero() != 0)?))
        }
        Op::Flatten(f) => {
            let x = x0()?;
            let r = x.rank();
            let a = if f.axis() < 0 { f.axis() + r as i64 } else { f.axis() };
            if a < 0 || a > r as i64 {
                return Err(EvalError::Invalid(format!("Flatten axis {} for rank {r}", f.axis())));
            }
            let a = a as usize;
            let outer = x.shape[..a].iter().product();
            let inner = x.shape[a..].iter().product();
            one(x.clone().reshaped(vec![outer, inner]))
        }
        Op::Transpose(t) => {
            let x = x0()?;
            let perm: Vec<usize> = match &t.perm {
                Some(p) => p.iter().map(|&v| axis(v, x.rank())).collect::<Result<_>>()?,
                None => (0..x.rank()).rev().collect(),
            };
            one(transpose(x, &perm))
        }
        Op::Squeeze(s) => {
            let x = x0()?;
            let axes: Option<Vec<i64>> = match opt(inputs, 1) {
                Some(a) => Some(a.to_i64()?),
                None => s.axes.clone(),
            };
            let shape: Vec<usize> = match axes {
                Some(axes) => {
                    let axes: Vec<usize> = axes.iter().map(|&a| axis(a, x.rank())).collect::<Result<_>>()?;
                    x.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect()
                }
                None => x.shape.iter().copied().filter(|&d| d != 1).collect(),
            };
            one(x.clone().reshaped(shape))
        }
        Op::Unsqueeze(u) => {
            let x = x0()?;
            let axes: Vec<i64> = match opt(inputs, 1) {
                Some(a) => a.to_i64()?,
                None => u.axes.clone().unwrap_or_default(),
            };
            let r = x.rank() + axes.len();
            let mut axes: Vec<usize> = axes.iter().map(|&a| axis(a, r)).collect::<Result<_>>()?;
            axes.sort();
            let mut shape = x.shape.clone();
            for a in axes {
                shape.insert(a, 1);
            }
            one(x.clone().reshaped(shape))
        }
        Op::Concat(c) => {
            let parts: Vec<&Array> = inputs.iter().flatten().copied().collect();
            one(concat(&parts, c.axis.ok_or_else(|| EvalError::Invalid("Concat without axis".into()))?)?)
        }
        Op::Split(s) => split(s, inputs, n_out),
        Op::Slice(s) => one(slice(s, inputs)?),
        Op::Gather(g) => one(gather(x0()?, req(inputs, 1, name)?, g.axis())?),
        Op::GatherElements(g) => one(gather_elements(x0()?, req(inputs, 1, name)?, g.axis())?),
        Op::GatherND(g) => one(gather_nd(x0()?, req(inputs, 1, name)?, g.batch_dims() as usize)?),
        Op::ScatterND(s) => one(scatter_nd(x0()?, req(inputs, 1, name)?, req(inputs, 2, name)?, s.reduction())?),
        Op::ScatterElements(s) => {
            one(scatter_elements(x0()?, req(inputs, 1, name)?, req(inputs, 2, name)?, s.axis(), s.reduction())?)
        }
        Op::Expand(_) => one(expand(x0()?, &req(inputs, 1, name)?.to_i64()?)?),
        Op::Tile(_) => one(tile(x0()?, &req(inputs, 1, name)?.to_i64()?)?),
        Op::Pad(p) => one(pad(p, inputs)?),
        Op::DepthToSpace(d) => one(depth_to_space(x0()?, d.blocksize.unwrap_or(1) as usize, d.mode())?),
        Op::SpaceToDepth(d) => one(space_to_depth(x0()?, d.blocksize.unwrap_or(1) as usize)?),
        Op::Shape(s) => {
            let x = x0()?;
            let r = x.rank() as i64;
            let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let (a, b) = (clampi(s.start()), clampi(s.end.unwrap_or(r)));
            let dims: Vec<i64> = x.shape[a..b.max(a)].iter().map(|&d| d as i64).collect();
            one(Array::i64(vec![dims.len()], dims))
        }
        Op::Size(_) => one(Array::scalar_i64(x0()?.numel() as i64)),
        Op::Constant(c) => one(constant(c)?),
        Op::ConstantOfShape(c) => {
            let shape: Vec<usize> = x0()?.to_i64()?.iter().map(|&d| d.max(0) as usize).collect();
            let value = match &c.value {
                Some(t) => Array::from_tensor(t)?,
                None => Array::f32(vec![1], vec![0.0]),
            };
            let idx = vec![0usize; numel(&shape)];
            one(value.gather_flat(shape, &idx))
        }
        Op::Range(_) => one(range(x0()?, req(inputs, 1, name)?, req(inputs, 2, name)?)?),
        Op::Trilu(t) => {
            let k = match opt(inputs, 1) {
                Some(a) => a.to_i64()?[0],
                None => 0,
            };
            one(trilu(x0()?, k, t.upper() != 0)?)
        }
        Op::TopK(t) => {
            let k = match opt(inputs, 1) {
                Some(a) => a.to_i64()?[0],
                None => t.k.unwrap_or(1),
            };
            topk(x0()?, k.max(0) as usize, t.axis(), t.largest() != 0)
        }
        Op::NonZero(_) => one(nonzero(x0()?)?),
        Op::OneHot(o) => one(one_hot(x0()?, req(inputs, 1, name)?, req(inputs, 2, name)?, o.axis())?),
        Op::CumSum(c) => one(cumsum(x0()?, req(inputs, 1, name)?, c.exclusive() != 0, c.reverse() != 0)?),
        Op::EyeLike(e) => {
            let x = x0()?;
            let dtype = e.dtype.and_then(DType::from_code).unwrap_or(x.dtype);
            let (h, w) = (x.shape[0], x.shape.get(1).copied().unwrap_or(1));
            let k = e.k();
            let v: Vec<f64> =
                (0..h * w).map(|f| if (f % w) as i64 - (f / w) as i64 == k { 1.0 } else { 0.0 }).collect();
            one(cast(&Array::float(DType::Double, x.shape.clone(), v), dtype)?)
        }
        _ => super::nn::eval_nn(op, inputs, n_out),
    }
}
