//! Dense arrays for evaluation.
//!
//! Integer types of every width are held as `i64` and wrapped to their width after each
//! operation; float16 and bfloat16 are held as `f32` rounded to their precision.

use crate::tensor::{Tensor, TensorData, bf16_to_f32, f16_to_f32};
use crate::types::DType;

mod walk;

pub use walk::Walk;

/// Why evaluation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EvalError {
    /// The op, attribute or element type is not implemented by the reference evaluator.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The inputs break the op's rules.
    #[error("{0}")]
    Invalid(String),
    /// A failure inside a node.
    #[error("{node}: {source}")]
    AtNode {
        /// The node, described.
        node: String,
        /// What went wrong.
        source: Box<EvalError>,
    },
    /// A graph input was not supplied.
    #[error("no value given for graph input `{0}`")]
    MissingInput(String),
}

impl From<String> for EvalError {
    /// A rule broken by the inputs (a shape that does not broadcast, an axis out of range).
    fn from(msg: String) -> EvalError {
        EvalError::Invalid(msg)
    }
}

/// Element storage.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    /// float, float16, bfloat16.
    F32(Vec<f32>),
    /// double.
    F64(Vec<f64>),
    /// Every integer type.
    I64(Vec<i64>),
    /// bool.
    Bool(Vec<bool>),
    /// string.
    Str(Vec<String>),
}

impl Data {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::Bool(v) => v.len(),
            Data::Str(v) => v.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// No elements, of this storage.
    pub fn empty_like(&self) -> Data {
        match self {
            Data::F32(_) => Data::F32(Vec::new()),
            Data::F64(_) => Data::F64(Vec::new()),
            Data::I64(_) => Data::I64(Vec::new()),
            Data::Bool(_) => Data::Bool(Vec::new()),
            Data::Str(_) => Data::Str(Vec::new()),
        }
    }
}

/// A dense, row-major array.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Elements.
    pub data: Data,
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Number of elements of a shape.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Wraps an integer to the range of `dtype` (two's complement), as a cast would.
pub fn wrap_int(dtype: DType, v: i64) -> i64 {
    match dtype {
        DType::Int8 => v as i8 as i64,
        DType::Uint8 => v as u8 as i64,
        DType::Int16 => v as i16 as i64,
        DType::Uint16 => v as u16 as i64,
        DType::Int32 => v as i32 as i64,
        DType::Uint32 => v as u32 as i64,
        DType::Int4 => (v << 60) >> 60,
        DType::Uint4 => v & 0xf,
        _ => v,
    }
}

/// Rounds to the precision of a 16-bit float type (round to nearest even).
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::Float16 => f16_to_f32(f32_to_f16(x)),
        DType::Bfloat16 => {
            if x.is_nan() {
                return x;
            }
            let b = x.to_bits();
            let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
            bf16_to_f32((rounded >> 16) as u16)
        }
        _ => x,
    }
}

/// Encodes an f32 as IEEE half precision (round to nearest even).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let mut frac = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if frac != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        frac |= 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let mut v = frac >> shift;
        let rem = frac & ((1 << shift) - 1);
        if rem > half || (rem == half && v & 1 == 1) {
            v += 1;
        }
        return sign | v as u16;
    }
    let mut v = ((e as u32) << 10) | (frac >> 13);
    let rem = frac & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && v & 1 == 1) {
        v += 1;
    }
    sign | v as u16
}

/// Which storage a dtype evaluates in.
pub fn storage_of(dtype: DType) -> Option<fn(usize) -> Data> {
    Some(match dtype {
        DType::Float | DType::Float16 | DType::Bfloat16 => |n| Data::F32(vec![0.0; n]),
        DType::Double => |n| Data::F64(vec![0.0; n]),
        DType::Bool => |n| Data::Bool(vec![false; n]),
        DType::String => |n| Data::Str(vec![String::new(); n]),
        d if d.is_int() => |n| Data::I64(vec![0; n]),
        _ => return None,
    })
}

impl Array {
    /// A float array.
    pub fn f32(shape: Vec<usize>, v: Vec<f32>) -> Array {
        debug_assert_eq!(numel(&shape), v.len());
        Array { dtype: DType::Float, shape, data: Data::F32(v) }
    }

    /// An int64 array.
    pub fn i64(shape: Vec<usize>, v: Vec<i64>) -> Array {
        debug_assert_eq!(numel(&shape), v.len());
        Array { dtype: DType::Int64, shape, data: Data::I64(v) }
    }

    /// A bool array.
    pub fn bool(shape: Vec<usize>, v: Vec<bool>) -> Array {
        Array { dtype: DType::Bool, shape, data: Data::Bool(v) }
    }

    /// An integer array of type `dtype`, wrapping values to its width.
    pub fn int(dtype: DType, shape: Vec<usize>, v: Vec<i64>) -> Array {
        Array { dtype, shape, data: Data::I64(v.into_iter().map(|x| wrap_int(dtype, x)).collect()) }
    }

    /// A float array of type `dtype` (float, float16, bfloat16, double).
    pub fn float(dtype: DType, shape: Vec<usize>, v: Vec<f64>) -> Array {
        if dtype == DType::Double {
            Array { dtype, shape, data: Data::F64(v) }
        } else {
            Array { dtype, shape, data: Data::F32(v.into_iter().map(|x| round_to(dtype, x as f32)).collect()) }
        }
    }

    /// A zero-filled array.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<Array, EvalError> {
        let make = storage_of(dtype).ok_or_else(|| EvalError::Unsupported(format!("element type {dtype}")))?;
        Ok(Array { dtype, data: make(numel(&shape)), shape })
    }

    /// An array whose every element is `x` (a tensor stored as its fill,
    /// [`Tensor::filled`]).
    pub fn filled(dtype: DType, shape: Vec<usize>, x: f64) -> Result<Array, EvalError> {
        let n = numel(&shape);
        Ok(match dtype {
            DType::Bool => Array::bool(shape, vec![x != 0.0; n]),
            d if d.is_int() => Array::int(d, shape, vec![x as i64; n]),
            d if d.is_float() => Array::float(d, shape, vec![x; n]),
            d => return Err(EvalError::Unsupported(format!("a fill of element type {d}"))),
        })
    }

    /// A rank-0 int64.
    pub fn scalar_i64(v: i64) -> Array {
        Array::i64(vec![], vec![v])
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Decodes a constant tensor, making a fill's values ([`Tensor::filled`]; analyses that
    /// decode small constants with [`Array::from_tensor`] leave fills, as external data, alone).
    pub fn materialized(t: &Tensor) -> Result<Array, EvalError> {
        match t.fill().map_err(EvalError::Unsupported)? {
            Some(x) => Array::filled(t.dtype, t.dims.iter().map(|&d| d.max(0) as usize).collect(), x),
            None => Array::from_tensor(t),
        }
    }

    /// Decodes a constant tensor.
    pub fn from_tensor(t: &Tensor) -> Result<Array, EvalError> {
        let shape: Vec<usize> = t.dims.iter().map(|&d| d.max(0) as usize).collect();
        let n = numel(&shape);
        let data = match (&t.data, t.dtype) {
            (TensorData::External(_), _) => {
                return Err(EvalError::Unsupported("a tensor with external data (its bytes are not loaded)".into()));
            }
            (TensorData::Float(v), DType::Float) => Data::F32(v.clone()),
            (TensorData::Double(v), DType::Double) => Data::F64(v.clone()),
            (TensorData::Int32(v), DType::Float16) => Data::F32(v.iter().map(|&b| f16_to_f32(b as u16)).collect()),
            (TensorData::Int32(v), DType::Bfloat16) => Data::F32(v.iter().map(|&b| bf16_to_f32(b as u16)).collect()),
            (TensorData::Int32(v), DType::Bool) => Data::Bool(v.iter().map(|&b| b != 0).collect()),
            (TensorData::Int32(v), d) if d.is_int() => {
                Data::I64(v.iter().map(|&x| wrap_int(d, i64::from(x))).collect())
            }
            (TensorData::Int64(v), _) => Data::I64(v.clone()),
            (TensorData::Uint64(v), _) => Data::I64(v.iter().map(|&x| x as i64).collect()),
            (TensorData::Strings(v), _) => Data::Str(v.clone()),
            (_, d) => return Err(EvalError::Unsupported(format!("constants of type {d}"))),
        };
        if data.len() != n {
            return Err(EvalError::Invalid(format!("constant {} has {} value(s)", t.tensor_type(), data.len())));
        }
        Ok(Array { dtype: t.dtype, shape, data })
    }

    /// Encodes as a constant tensor (inline data).
    pub fn to_tensor(&self) -> Tensor {
        let dims = self.shape.iter().map(|&d| d as i64).collect();
        let data = match (&self.data, self.dtype) {
            (Data::F32(v), DType::Float16) => TensorData::Int32(v.iter().map(|&x| i32::from(f32_to_f16(x))).collect()),
            (Data::F32(v), DType::Bfloat16) => {
                TensorData::Int32(v.iter().map(|&x| (x.to_bits() >> 16) as i32).collect())
            }
            (Data::F32(v), _) => TensorData::Float(v.clone()),
            (Data::F64(v), _) => TensorData::Double(v.clone()),
            (Data::I64(v), DType::Int64) => TensorData::Int64(v.clone()),
            (Data::I64(v), DType::Uint32 | DType::Uint64) => TensorData::Uint64(v.iter().map(|&x| x as u64).collect()),
            (Data::I64(v), _) => TensorData::Int32(v.iter().map(|&x| x as i32).collect()),
            (Data::Bool(v), _) => TensorData::Int32(v.iter().map(|&b| i32::from(b)).collect()),
            (Data::Str(v), _) => TensorData::Strings(v.clone()),
        };
        Tensor { dtype: self.dtype, dims, name: None, data }
    }

    /// [`Array::to_tensor`], moving the elements where the tensor stores them as they are.
    pub fn into_tensor(self) -> Tensor {
        let dims = self.shape.iter().map(|&d| d as i64).collect();
        let data = match (self.data, self.dtype) {
            (Data::F32(v), DType::Float) => TensorData::Float(v),
            (Data::F64(v), _) => TensorData::Double(v),
            (Data::I64(v), DType::Int64) => TensorData::Int64(v),
            (data, dtype) => return Array { dtype, shape: self.shape, data }.to_tensor(),
        };
        Tensor { dtype: self.dtype, dims, name: None, data }
    }

    /// Values as f64 (bools as 0/1); strings are an error.
    pub fn to_f64(&self) -> Result<Vec<f64>, EvalError> {
        Ok(match &self.data {
            Data::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Data::F64(v) => v.clone(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect(),
            Data::Str(_) => return Err(EvalError::Unsupported("numeric use of strings".into())),
        })
    }

    /// The first value as f64 (a scalar operand); an error when the array is empty.
    pub fn first_f64(&self) -> Result<f64, EvalError> {
        self.to_f64()?
            .first()
            .copied()
            .ok_or_else(|| EvalError::Invalid("expected a value, got an empty tensor".into()))
    }

    /// The first value as i64 (a scalar operand); an error when the array is empty.
    pub fn first_i64(&self) -> Result<i64, EvalError> {
        self.to_i64()?
            .first()
            .copied()
            .ok_or_else(|| EvalError::Invalid("expected a value, got an empty tensor".into()))
    }

    /// Values as f32.
    pub fn to_f32(&self) -> Result<Vec<f32>, EvalError> {
        Ok(match &self.data {
            Data::F32(v) => v.clone(),
            _ => self.to_f64()?.into_iter().map(|x| x as f32).collect(),
        })
    }

    /// Values as f32, borrowed where they are stored as f32.
    pub fn f32s(&self) -> Result<std::borrow::Cow<'_, [f32]>, EvalError> {
        Ok(match &self.data {
            Data::F32(v) => std::borrow::Cow::Borrowed(v),
            _ => std::borrow::Cow::Owned(self.to_f32()?),
        })
    }

    /// A float array of type `dtype` from f32 values (rounded to `dtype`'s precision).
    pub fn from_f32s(dtype: DType, shape: Vec<usize>, mut v: Vec<f32>) -> Array {
        match dtype {
            DType::Double => Array { dtype, shape, data: Data::F64(v.into_iter().map(f64::from).collect()) },
            DType::Float => Array { dtype, shape, data: Data::F32(v) },
            _ => {
                v.iter_mut().for_each(|x| *x = round_to(dtype, *x));
                Array { dtype, shape, data: Data::F32(v) }
            }
        }
    }

    /// Values as i64 (floats truncated).
    pub fn to_i64(&self) -> Result<Vec<i64>, EvalError> {
        Ok(match &self.data {
            Data::I64(v) => v.clone(),
            Data::Bool(v) => v.iter().map(|&b| i64::from(b)).collect(),
            _ => self.to_f64()?.into_iter().map(|x| x as i64).collect(),
        })
    }

    /// The float data, or an error naming `what`.
    pub fn as_f32(&self) -> Result<&[f32], EvalError> {
        match &self.data {
            Data::F32(v) => Ok(v),
            _ => Err(EvalError::Unsupported(format!("{} input where float is needed", self.dtype))),
        }
    }

    /// Reinterprets with a new shape of the same size.
    pub fn reshaped(mut self, shape: Vec<usize>) -> Array {
        debug_assert_eq!(numel(&shape), self.numel());
        self.shape = shape;
        self
    }

    /// Picks elements by flat index (used by every data-movement op).
    pub fn gather_flat(&self, shape: Vec<usize>, idx: &[usize]) -> Array {
        self.gather(shape, idx.iter().copied())
    }

    /// Appends `other`'s elements (flat; the shape becomes 1-D), freeing `other`.
    pub fn append_flat(&mut self, other: Array) -> Result<(), EvalError> {
        match (&mut self.data, other.data) {
            (Data::F32(a), Data::F32(b)) => a.extend(b),
            (Data::F64(a), Data::F64(b)) => a.extend(b),
            (Data::I64(a), Data::I64(b)) => a.extend(b),
            (Data::Bool(a), Data::Bool(b)) => a.extend(b),
            (Data::Str(a), Data::Str(b)) => a.extend(b),
            _ => return Err(EvalError::Invalid(format!("appending {} to {}", other.dtype, self.dtype))),
        }
        self.shape = vec![self.data.len()];
        Ok(())
    }

    /// [`Array::gather_flat`] from offsets made as they are read (a [`Walk`]).
    pub fn gather(&self, shape: Vec<usize>, idx: impl ExactSizeIterator<Item = usize>) -> Array {
        let data = match &self.data {
            Data::F32(v) => Data::F32(idx.map(|i| v[i]).collect()),
            Data::F64(v) => Data::F64(idx.map(|i| v[i]).collect()),
            Data::I64(v) => Data::I64(idx.map(|i| v[i]).collect()),
            Data::Bool(v) => Data::Bool(idx.map(|i| v[i]).collect()),
            Data::Str(v) => Data::Str(idx.map(|i| v[i].clone()).collect()),
        };
        Array { dtype: self.dtype, shape, data }
    }

    /// Elements `start..end` of axis `axis`.
    pub fn slice_axis(&self, axis: usize, start: usize, end: usize) -> Array {
        let ranges: Vec<(usize, usize)> =
            self.shape.iter().enumerate().map(|(d, &n)| if d == axis { (start, end) } else { (0, n) }).collect();
        let mut shape = self.shape.clone();
        shape[axis] = end - start;
        self.gather(shape, Walk::boxed(&self.shape, &ranges))
    }

    /// Joins arrays of one dtype and rank along `axis` (their other dims equal).
    pub fn concat_axis(parts: &[&Array], axis: usize) -> Array {
        let mut shape = parts[0].shape.clone();
        shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
        let outer: usize = shape[..axis].iter().product();
        let all = Array { dtype: parts[0].dtype, shape: vec![0], data: Array::concat_data(parts) };
        let mut idx = Vec::with_capacity(numel(&shape));
        for o in 0..outer {
            let mut offset = 0;
            for p in parts {
                let block = p.numel().checked_div(outer).unwrap_or(0);
                idx.extend(offset + o * block..offset + (o + 1) * block);
                offset += p.numel();
            }
        }
        all.gather_flat(shape, &idx)
    }

    /// Concatenates the data of arrays of one dtype (shape to be set by the caller).
    pub fn concat_data(parts: &[&Array]) -> Data {
        match &parts[0].data {
            Data::F32(_) => {
                Data::F32(parts.iter().flat_map(|p| p.as_f32().expect("same dtype").iter().copied()).collect())
            }
            Data::F64(_) => Data::F64(
                parts.iter().flat_map(|p| if let Data::F64(v) = &p.data { v.clone() } else { vec![] }).collect(),
            ),
            Data::I64(_) => Data::I64(
                parts.iter().flat_map(|p| if let Data::I64(v) = &p.data { v.clone() } else { vec![] }).collect(),
            ),
            Data::Bool(_) => Data::Bool(
                parts.iter().flat_map(|p| if let Data::Bool(v) = &p.data { v.clone() } else { vec![] }).collect(),
            ),
            Data::Str(_) => Data::Str(
                parts.iter().flat_map(|p| if let Data::Str(v) = &p.data { v.clone() } else { vec![] }).collect(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concatenation_along_an_axis() {
        let a = Array::f32(vec![2, 2], vec![1., 2., 3., 4.]);
        let b = Array::f32(vec![2, 1], vec![5., 6.]);
        let c = Array::concat_axis(&[&a, &b], 1);
        assert_eq!((c.shape.clone(), c.to_f32().unwrap()), (vec![2, 3], vec![1., 2., 5., 3., 4., 6.]));
        let d = Array::concat_axis(&[&a, &a], 0);
        assert_eq!((d.shape.clone(), d.to_f32().unwrap()), (vec![4, 2], vec![1., 2., 3., 4., 1., 2., 3., 4.]));
        assert_eq!(c.slice_axis(1, 2, 3), b);
    }

    #[test]
    fn half_round_trip() {
        for x in [0.0f32, 1.0, -2.5, 65504.0, 1e-5, 0.1, 3.25] {
            let h = f32_to_f16(x);
            let back = f16_to_f32(h);
            assert!((back - x).abs() <= x.abs() * 1e-3 + 1e-7, "{x} -> {back}");
        }
        assert_eq!(f32_to_f16(1.0), 15360);
        assert_eq!(f32_to_f16(1e9), 0x7c00);
    }

    #[test]
    fn ints_wrap() {
        assert_eq!(wrap_int(DType::Int8, 200), -56);
        assert_eq!(wrap_int(DType::Uint8, -1), 255);
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
    }
}
