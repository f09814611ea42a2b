//! Element-wise evaluation: the error function, GELU's tanh form, rounding, casts, binary arithmetic, comparisons, logic and `Where`.

use super::*;

/// The error function, to double precision.
pub fn erf64(x: f64) -> f64 {
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

pub(super) fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

pub(super) fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 { 2.0 * (x / 2.0).round() } else { r }
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
                Array { dtype: to, shape, data: Data::F32(v.iter().map(|&a| round_to(to, a)).collect()) }
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

#[derive(Copy, Clone, PartialEq)]
pub(super) enum Bin {
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
pub(super) enum Cmp {
    Eq,
    Lt,
    Le,
    Gt,
    Ge,
}

pub(super) fn zip_map<A: Copy, B: Copy, C>(
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
    let pairs = broadcast_walk(&shape, ash).zip(broadcast_walk(&shape, bsh));
    Ok((shape, pairs.map(|(i, j)| f(a[i], b[j])).collect()))
}

pub(super) fn float_bin(k: Bin, x: f64, y: f64) -> f64 {
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

pub(super) fn f32_bin(k: Bin, x: f32, y: f32) -> f32 {
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

pub(super) fn int_bin(k: Bin, x: i64, y: i64) -> Result<i64> {
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
        Bin::ShiftL | Bin::ShiftR => return Err(EvalError::Invalid("shifts need the element type".into())),
    })
}

/// `x << y` or `x >> y` in `dtype`'s width, as numpy computes it: bits shifted out are lost
/// (the result wraps to the type), a right shift of a signed value is arithmetic, and a shift
/// by a negative amount or by the width or more gives 0 (−1 for a right shift of a negative
/// value), where C and most hardware would mask the amount.
pub(super) fn shift(k: Bin, dtype: DType, x: i64, y: i64) -> i64 {
    let bits = i64::from(dtype.bits());
    let signed = matches!(dtype, DType::Int8 | DType::Int16 | DType::Int32 | DType::Int64 | DType::Int4 | DType::Int2);
    if y < 0 || y >= bits {
        return if k == Bin::ShiftR && signed && x < 0 { -1 } else { 0 };
    }
    match k {
        Bin::ShiftL => wrap_int(dtype, ((x as u64) << y) as i64),
        _ if signed => x >> y,
        // Unsigned values are held as their non-negative value (uint64 as its bits).
        _ => ((x as u64) >> y) as i64,
    }
}

pub(super) fn binary(k: Bin, a: &Array, b: &Array) -> Result<Array> {
    let (shape, data) = match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            let (s, v) = zip_map(x, &a.shape, y, &b.shape, |p, q| f32_bin(k, p, q))?;
            (s, Data::F32(v.into_iter().map(|r| round_to(a.dtype, r)).collect()))
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
        (Data::I64(x), Data::I64(y)) if matches!(k, Bin::ShiftL | Bin::ShiftR) => {
            let (s, v) = zip_map(x, &a.shape, y, &b.shape, |p, q| shift(k, a.dtype, p, q))?;
            (s, Data::I64(v))
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

pub(super) fn compare(k: Cmp, a: &Array, b: &Array) -> Result<Array> {
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
            let pairs = broadcast_walk(&shape, &a.shape).zip(broadcast_walk(&shape, &b.shape));
            let v = pairs.map(|(i, j)| x[i] == y[j]).collect();
            (shape, v)
        }
        _ => {
            let (x, y) = (a.to_f64()?, b.to_f64()?);
            zip_map(&x, &a.shape, &y, &b.shape, |p, q| f(k, p, q))?
        }
    };
    Ok(Array::bool(shape, v))
}

pub(super) fn logical(a: &Array, b: &Array, f: impl Fn(bool, bool) -> bool) -> Result<Array> {
    let (Data::Bool(x), Data::Bool(y)) = (&a.data, &b.data) else {
        return Err(unsupported("a logical op", a.dtype));
    };
    let (shape, v) = zip_map(x, &a.shape, y, &b.shape, f)?;
    Ok(Array::bool(shape, v))
}

/// `cond ? x : y` with broadcasting.
pub fn where_(c: &Array, x: &Array, y: &Array) -> Result<Array> {
    let Data::Bool(cv) = &c.data else { return Err(unsupported("Where condition", c.dtype)) };
    let shape = broadcast_shapes(&broadcast_shapes(&c.shape, &x.shape)?, &y.shape)?;
    // Gather from the concatenation of x and y.
    let both = Array { dtype: x.dtype, shape: vec![x.numel() + y.numel()], data: Array::concat_data(&[x, y]) };
    if x.dtype != y.dtype {
        return Err(EvalError::Invalid(format!("Where branches are {} and {}", x.dtype, y.dtype)));
    }
    let walks =
        broadcast_walk(&shape, &c.shape).zip(broadcast_walk(&shape, &x.shape)).zip(broadcast_walk(&shape, &y.shape));
    let idx = walks.map(|((ic, ix), iy)| if cv[ic] { ix } else { x.numel() + iy });
    Ok(both.gather(shape, idx))
}

// ---- gradients ----
