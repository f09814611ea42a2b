//! Constant tensors: initializers and tensor-valued attributes.
//!
//! Storage mirrors ONNX's `TensorProto` fields so that a tensor prints back exactly as it was
//! written: small integer types and the 16/8-bit float types live in `int32_data` (as raw bit
//! patterns for the float types), `int64` in `int64_data`, `uint32`/`uint64` in `uint64_data`,
//! `float`/`complex64` in `float_data`, `double`/`complex128` in `double_data`.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::types::{DType, TensorType, write_quoted};

/// The values of a constant tensor, in the `TensorProto` field that holds them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TensorData {
    /// `int32_data`: int8/16/32, uint8/16, bool, and the bit patterns of float16, bfloat16, float8*.
    Int32(Vec<i32>),
    /// `int64_data`.
    Int64(Vec<i64>),
    /// `uint64_data`: uint32 and uint64.
    Uint64(Vec<u64>),
    /// `float_data`: float, and complex64 as (re, im) pairs.
    Float(Vec<f32>),
    /// `double_data`: double, and complex128 as (re, im) pairs.
    Double(Vec<f64>),
    /// `string_data`.
    Strings(Vec<String>),
    /// Data stored outside the model (`["location": "w.bin", "offset": "0", "length": "64"]`);
    /// the key/value entries are kept as written.
    External(Vec<(String, String)>),
}

impl TensorData {
    /// The same values, floats compared bit for bit.
    pub fn same(&self, other: &TensorData) -> bool {
        match (self, other) {
            (TensorData::Float(a), TensorData::Float(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            (TensorData::Double(a), TensorData::Double(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            (a, b) => a == b,
        }
    }
}

/// Which `TensorData` variant holds inline values of a dtype.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Storage {
    /// [`TensorData::Int32`].
    Int32,
    /// [`TensorData::Int64`].
    Int64,
    /// [`TensorData::Uint64`].
    Uint64,
    /// [`TensorData::Float`].
    Float,
    /// [`TensorData::Double`].
    Double,
    /// [`TensorData::Strings`].
    Strings,
}

impl Storage {
    /// The field ONNX stores inline values of `dtype` in; `None` for packed sub-byte types,
    /// which the text syntax cannot hold.
    pub fn of(dtype: DType) -> Option<Storage> {
        use DType::*;
        Some(match dtype {
            Int8 | Int16 | Int32 | Uint8 | Uint16 | Bool | Float16 | Bfloat16 | Float8e4m3fn | Float8e4m3fnuz
            | Float8e5m2 | Float8e5m2fnuz | Float8e8m0 | Int4 | Uint4 | Float4e2m1 => Storage::Int32,
            Int64 => Storage::Int64,
            Uint32 | Uint64 => Storage::Uint64,
            Float | Complex64 => Storage::Float,
            Double | Complex128 => Storage::Double,
            String => Storage::Strings,
            Int2 | Uint2 => return None,
        })
    }
}

/// A constant tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Shape; always concrete.
    pub dims: Vec<i64>,
    /// The name written on a tensor-valued attribute (`float[2] name {…}`); initializers take
    /// their name from the graph instead.
    pub name: Option<String>,
    /// The values.
    pub data: TensorData,
}

/// The external-data entry of a tensor whose elements all have one value ([`Tensor::filled`]).
pub const FILL: &str = "shardc_fill";

/// External data that is elements `start..end` along `axis` of the external tensor `of` (of
/// shape `full_dims`, whose file entries the slice keeps): what a rewrite that splits a weight
/// writes when the weight's values are not loaded yet. The tensor's dims are the slice's, or
/// others of the same element count (a rewrite that reshapes a weight describes it as all of
/// the original, reshaped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalSlice {
    /// The tensor sliced (its name, which seeds its drawn values when the file is absent).
    pub of: String,
    /// Its shape.
    pub full_dims: Vec<i64>,
    /// The axis sliced.
    pub axis: usize,
    /// First element.
    pub start: usize,
    /// One past the last element.
    pub end: usize,
}

/// External data that is the concatenation along `axis` of other external tensors (`parts`:
/// each part's name, which seeds its drawn values when its file is absent, and the part as a
/// tensor of its own: its dims and its entries, a file region or a slice of another): what a
/// rewrite that fuses weights writes when their values are not loaded yet. Written as the
/// entries `shardc_concat_axis`, then per part `shardc_part` (its name), `shardc_part_dims`
/// and the part's own entries.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalConcat {
    /// The axis the parts are joined along.
    pub axis: usize,
    /// The parts in order: name and tensor.
    pub parts: Vec<(String, Tensor)>,
}

impl Tensor {
    /// The same tensor: type, shape, name and values, floats compared bit for bit (NaN is the
    /// same NaN; -0 is not 0), as a round trip must preserve them.
    pub fn same(&self, other: &Tensor) -> bool {
        self.dtype == other.dtype && self.dims == other.dims && self.name == other.name && self.data.same(&other.data)
    }

    /// A float tensor.
    pub fn from_f32(dims: Vec<i64>, values: Vec<f32>) -> Tensor {
        Tensor { dtype: DType::Float, dims, name: None, data: TensorData::Float(values) }
    }

    /// An int64 tensor.
    pub fn from_i64(dims: Vec<i64>, values: Vec<i64>) -> Tensor {
        Tensor { dtype: DType::Int64, dims, name: None, data: TensorData::Int64(values) }
    }

    /// Number of elements the shape calls for (saturating at `u64::MAX`: a file that claims
    /// more cannot hold its data, which the frontend reports).
    pub fn numel(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d.max(0) as u64))
    }

    /// Number of values stored inline (complex values count twice); `None` for external data.
    pub fn stored_len(&self) -> Option<usize> {
        Some(match &self.data {
            TensorData::Int32(v) => v.len(),
            TensorData::Int64(v) => v.len(),
            TensorData::Uint64(v) => v.len(),
            TensorData::Float(v) => v.len(),
            TensorData::Double(v) => v.len(),
            TensorData::Strings(v) => v.len(),
            TensorData::External(_) => return None,
        })
    }

    /// Values per element in storage (2 for complex types).
    pub fn values_per_element(&self) -> u64 {
        if matches!(self.dtype, DType::Complex64 | DType::Complex128) { 2 } else { 1 }
    }

    /// For external data that is a slice of another external tensor (see
    /// [`ExternalSlice`]): where it comes from; `Err` when the entries are malformed.
    pub fn external_slice(&self) -> Result<Option<ExternalSlice>, String> {
        let TensorData::External(entries) = &self.data else { return Ok(None) };
        if entries.first().is_some_and(|(k, _)| k == "shardc_concat_axis") {
            return Ok(None);
        }
        let get = |k: &str| entries.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str());
        let (Some(of), Some(range), Some(full)) =
            (get("shardc_slice_of"), get("shardc_slice"), get("shardc_full_dims"))
        else {
            return Ok(None);
        };
        let bad = || format!("`shardc_slice` is `{range}` and `shardc_full_dims` `{full}`: not a slice of those dims");
        let nums: Vec<i64> = range.split(':').map(|x| x.parse::<i64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
        let full_dims: Vec<i64> =
            full.split('x').map(|x| x.parse::<i64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
        let [axis, start, end] = nums[..] else { return Err(bad()) };
        if axis < 0 || axis as usize >= full_dims.len() || start < 0 || end <= start || end > full_dims[axis as usize] {
            return Err(bad());
        }
        // The slice's elements, in this tensor's shape (the same dims, or others of the same
        // count: a reshaped slice).
        let mut want = full_dims.clone();
        want[axis as usize] = end - start;
        if want != self.dims && want.iter().product::<i64>() != self.dims.iter().product::<i64>() {
            return Err(bad());
        }
        Ok(Some(ExternalSlice {
            of: of.to_string(),
            full_dims,
            axis: axis as usize,
            start: start as usize,
            end: end as usize,
        }))
    }

    /// For external data that joins other external tensors (see [`ExternalConcat`]): its
    /// parts; `Err` when the entries are malformed.
    pub fn external_concat(&self) -> Result<Option<ExternalConcat>, String> {
        let TensorData::External(entries) = &self.data else { return Ok(None) };
        let Some((k, axis)) = entries.first() else { return Ok(None) };
        if k != "shardc_concat_axis" {
            return Ok(None);
        }
        let axis: usize = axis.parse().ok().filter(|&a: &usize| a < self.dims.len()).ok_or_else(|| {
            format!("`shardc_concat_axis` is `{axis}`: not an axis of a rank-{} tensor", self.dims.len())
        })?;
        let mut parts: Vec<(String, Tensor)> = Vec::new();
        for (k, v) in &entries[1..] {
            match k.as_str() {
                "shardc_part" => parts.push((
                    v.clone(),
                    Tensor { dtype: self.dtype, dims: Vec::new(), name: None, data: TensorData::External(Vec::new()) },
                )),
                "shardc_concat_axis" => return Err("a concatenation's part is a concatenation".into()),
                _ => {
                    let Some((_, part)) = parts.last_mut() else {
                        return Err(format!("entry `{k}` before the first `shardc_part`"));
                    };
                    if k == "shardc_part_dims" {
                        part.dims = v
                            .split('x')
                            .map(|x| x.parse::<i64>())
                            .collect::<Result<_, _>>()
                            .map_err(|_| format!("`shardc_part_dims` is `{v}`, not dims"))?;
                    } else if let TensorData::External(e) = &mut part.data {
                        e.push((k.clone(), v.clone()));
                    }
                }
            }
        }
        let mut total = 0;
        for (name, p) in &parts {
            let fits = p.dims.len() == self.dims.len()
                && p.dims.iter().zip(&self.dims).enumerate().all(|(a, (x, y))| a == axis || x == y);
            if !fits {
                return Err(format!("part `{name}` is {:?}: not a part of {:?} along axis {axis}", p.dims, self.dims));
            }
            p.external_slice().map_err(|e| format!("part `{name}`: {e}"))?;
            total += p.dims[axis];
        }
        if parts.len() < 2 || total != self.dims[axis] {
            return Err(format!("{} parts of {total} along axis {axis} do not make {:?}", parts.len(), self.dims));
        }
        Ok(Some(ExternalConcat { axis, parts }))
    }

    /// External data joining `parts` (name and tensor, each external data of its own) along
    /// `axis` (see [`ExternalConcat`]). Parts that are consecutive slices covering all of one
    /// tensor along that axis give that tensor back.
    pub fn concat_external(axis: usize, parts: &[(String, Tensor)]) -> Result<(Option<String>, Tensor), String> {
        let first = &parts.first().ok_or("no parts")?.1;
        let mut dims = first.dims.clone();
        dims[axis] = parts.iter().map(|(_, p)| p.dims.get(axis).copied().unwrap_or(0)).sum();
        let slices: Vec<Option<ExternalSlice>> = parts.iter().map(|(_, p)| p.external_slice().ok().flatten()).collect();
        if let Some(Some(s0)) = slices.first() {
            let mut at = 0;
            let whole = slices.iter().zip(parts).all(|(s, (_, p))| {
                let ok = s.as_ref().is_some_and(|s| {
                    s.of == s0.of
                        && s.axis == axis
                        && s.start == at
                        && s.full_dims == dims
                        && p.dims.len() == dims.len()
                });
                if let Some(s) = s {
                    at = s.end;
                }
                ok
            });
            if whole && at as i64 == dims[axis] {
                let TensorData::External(e) = &first.data else { unreachable!("a slice is external") };
                let e = e.iter().filter(|(k, _)| !k.starts_with("shardc_slice") && k != "shardc_full_dims").cloned();
                let t = Tensor { dtype: first.dtype, dims, name: None, data: TensorData::External(e.collect()) };
                return Ok((Some(s0.of.clone()), t));
            }
        }
        let mut entries = vec![("shardc_concat_axis".to_string(), axis.to_string())];
        for (name, p) in parts {
            let TensorData::External(e) = &p.data else { return Err(format!("part `{name}` is not external data")) };
            if p.external_concat()?.is_some() {
                return Err(format!("part `{name}` is a concatenation"));
            }
            entries.push(("shardc_part".into(), name.clone()));
            entries
                .push(("shardc_part_dims".into(), p.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")));
            entries.extend(e.iter().cloned());
        }
        let t = Tensor { dtype: first.dtype, dims, name: None, data: TensorData::External(entries) };
        t.external_concat()?;
        Ok((None, t))
    }

    /// A tensor of `dims` whose every element is `value`, stored as that value alone (the
    /// external-data entry `shardc_fill`, [`FILL`]): optimizer state of a model whose weights
    /// are not loaded takes no memory until a run materializes it.
    pub fn filled(dtype: DType, dims: Vec<i64>, value: f64) -> Tensor {
        Tensor { dtype, dims, name: None, data: TensorData::External(vec![(FILL.to_string(), value.to_string())]) }
    }

    /// For a tensor made by [`Tensor::filled`]: the value of every element. `Err` when the
    /// entry is not a number.
    pub fn fill(&self) -> Result<Option<f64>, String> {
        let TensorData::External(entries) = &self.data else { return Ok(None) };
        let Some((_, v)) = entries.iter().find(|(k, _)| k == FILL) else { return Ok(None) };
        v.parse::<f64>().map(Some).map_err(|_| format!("`{FILL}` is `{v}`, not a number"))
    }

    /// True when the data lives in an external file (or is a fill, [`Tensor::filled`]): not
    /// stored here.
    pub fn is_external(&self) -> bool {
        matches!(self.data, TensorData::External(_))
    }

    /// The value type of this tensor.
    pub fn tensor_type(&self) -> TensorType {
        TensorType::fixed(self.dtype, &self.dims)
    }

    /// Size in bytes of the elements (what the tensor costs in device memory).
    pub fn size_bytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size_bytes())
    }

    /// Bytes its values take in host memory as stored here (nothing for external data not
    /// loaded).
    pub fn host_bytes(&self) -> u64 {
        let n = |len: usize, each: usize| (len as u64).saturating_mul(each as u64);
        match &self.data {
            TensorData::Int32(v) => n(v.len(), 4),
            TensorData::Int64(v) => n(v.len(), 8),
            TensorData::Uint64(v) => n(v.len(), 8),
            TensorData::Float(v) => n(v.len(), 4),
            TensorData::Double(v) => n(v.len(), 8),
            TensorData::Strings(v) => v.iter().map(|s| s.len() as u64 + 24).sum(),
            TensorData::External(_) => 0,
        }
    }

    /// The values as `f64`, decoding float16/bfloat16 bit patterns; `None` for external data,
    /// strings and complex numbers.
    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        Some(match &self.data {
            TensorData::Int32(v) => match self.dtype {
                DType::Float16 => v.iter().map(|&b| f64::from(f16_to_f32(b as u16))).collect(),
                DType::Bfloat16 => v.iter().map(|&b| f64::from(bf16_to_f32(b as u16))).collect(),
                DType::Bool => v.iter().map(|&b| if b != 0 { 1.0 } else { 0.0 }).collect(),
                d if d.is_float() => return None,
                _ => v.iter().map(|&x| f64::from(x)).collect(),
            },
            TensorData::Int64(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::Uint64(v) => v.iter().map(|&x| x as f64).collect(),
            TensorData::Float(v) if self.dtype == DType::Float => v.iter().map(|&x| f64::from(x)).collect(),
            TensorData::Double(v) if self.dtype == DType::Double => v.clone(),
            _ => return None,
        })
    }

    /// The values as `i64` (floats truncated toward zero); `None` where [`Tensor::to_f64_vec`]
    /// gives none.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        match &self.data {
            TensorData::Int64(v) => Some(v.clone()),
            TensorData::Int32(v) if self.dtype.is_int() || self.dtype == DType::Bool => {
                Some(v.iter().map(|&x| i64::from(x)).collect())
            }
            TensorData::Uint64(v) => Some(v.iter().map(|&x| x as i64).collect()),
            _ => self.to_f64_vec().map(|v| v.into_iter().map(|x| x as i64).collect()),
        }
    }
}

/// Decodes an IEEE half-precision bit pattern.
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exp = u32::from((bits >> 10) & 0x1f);
    let frac = u32::from(bits & 0x3ff);
    let out = if exp == 0 {
        if frac == 0 {
            sign
        } else {
            // Subnormal: renormalise.
            let mut e = 127 - 15 + 1;
            let mut f = frac;
            while f & 0x400 == 0 {
                f <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((f & 0x3ff) << 13)
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (frac << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (frac << 13)
    };
    f32::from_bits(out)
}

/// Decodes a bfloat16 bit pattern.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Writes a float the way ONNX's printer does (`std::to_chars` shortest form: the shorter of
/// fixed and scientific notation, fixed on a tie, at least two exponent digits).
pub fn write_f32(out: &mut impl fmt::Write, x: f32) -> fmt::Result {
    if x.is_nan() {
        return out.write_str(if x.is_sign_negative() { "-nan" } else { "nan" });
    }
    if x.is_infinite() {
        return out.write_str(if x < 0.0 { "-inf" } else { "inf" });
    }
    write_shortest(out, &format!("{x:e}"))
}

/// Writes a double the way ONNX's printer does; see [`write_f32`].
pub fn write_f64(out: &mut impl fmt::Write, x: f64) -> fmt::Result {
    if x.is_nan() {
        return out.write_str(if x.is_sign_negative() { "-nan" } else { "nan" });
    }
    if x.is_infinite() {
        return out.write_str(if x < 0.0 { "-inf" } else { "inf" });
    }
    write_shortest(out, &format!("{x:e}"))
}

/// `sci` is Rust's shortest round-trip scientific form, e.g. `-1.25e-3`.
fn write_shortest(out: &mut impl fmt::Write, sci: &str) -> fmt::Result {
    let (neg, rest) = match sci.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, sci),
    };
    let (mantissa, exp) = rest.split_once('e').expect("`{:e}` always writes an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` writes a decimal exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let digits = if digits.chars().all(|c| c == '0') { "0".to_string() } else { digits };
    let n = digits.len() as i32;

    let mut scientific = String::new();
    scientific.push_str(&digits[..1]);
    if n > 1 {
        scientific.push('.');
        scientific.push_str(&digits[1..]);
    }
    scientific.push('e');
    scientific.push(if exp < 0 { '-' } else { '+' });
    scientific.push_str(&format!("{:02}", exp.abs()));

    let fixed = if digits == "0" {
        "0".to_string()
    } else if exp >= 0 {
        if n > exp + 1 {
            format!("{}.{}", &digits[..(exp + 1) as usize], &digits[(exp + 1) as usize..])
        } else {
            format!("{digits}{}", "0".repeat((exp + 1 - n) as usize))
        }
    } else {
        format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
    };

    if neg {
        out.write_char('-')?;
    }
    out.write_str(if scientific.len() < fixed.len() { &scientific } else { &fixed })
}

/// Writes the data part of a tensor (` {1,2,3}` or ` ["location": …]`) exactly as the ONNX
/// printer does; the leading space is included except for strings (which the printer omits).
pub fn write_tensor_data(out: &mut impl fmt::Write, data: &TensorData) -> fmt::Result {
    fn list<T>(
        out: &mut impl fmt::Write,
        v: &[T],
        mut item: impl FnMut(&mut dyn fmt::Write, &T) -> fmt::Result,
    ) -> fmt::Result {
        out.write_str(" {")?;
        for (i, x) in v.iter().enumerate() {
            if i > 0 {
                out.write_char(',')?;
            }
            let mut s = String::new();
            item(&mut s, x)?;
            out.write_str(&s)?;
        }
        out.write_char('}')
    }
    match data {
        TensorData::Int32(v) => list(out, v, |o, x| write!(o, "{x}")),
        TensorData::Int64(v) => list(out, v, |o, x| write!(o, "{x}")),
        TensorData::Uint64(v) => list(out, v, |o, x| write!(o, "{x}")),
        TensorData::Float(v) => list(out, v, |o, x| {
            let mut s = String::new();
            write_f32(&mut s, *x)?;
            o.write_str(&s)
        }),
        TensorData::Double(v) => list(out, v, |o, x| {
            let mut s = String::new();
            write_f64(&mut s, *x)?;
            o.write_str(&s)
        }),
        TensorData::Strings(v) => {
            let mut sep = "{";
            for s in v {
                out.write_str(sep)?;
                write_quoted(out, s)?;
                sep = ", ";
            }
            if v.is_empty() {
                out.write_char('{')?;
            }
            out.write_char('}')
        }
        TensorData::External(entries) => {
            out.write_char('[')?;
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.write_str(", ")?;
                }
                write_quoted(out, k)?;
                out.write_str(": ")?;
                write_quoted(out, v)?;
            }
            out.write_char(']')
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(dims: Vec<i64>, entries: &[(&str, &str)]) -> Tensor {
        Tensor {
            dtype: DType::Float,
            dims,
            name: None,
            data: TensorData::External(entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
        }
    }

    // A concatenation lists its parts with their own entries, and reads back as them.
    #[test]
    fn external_concatenations_describe_their_parts() {
        let a = ext(vec![4, 3], &[("location", "w.bin"), ("offset", "0")]);
        let b = ext(vec![4, 2], &[("location", "v.bin"), ("offset", "48")]);
        let (name, t) = Tensor::concat_external(1, &[("a".into(), a.clone()), ("b".into(), b.clone())]).unwrap();
        assert_eq!((name, t.dims.clone()), (None, vec![4, 5]));
        let c = t.external_concat().unwrap().unwrap();
        assert_eq!(c, ExternalConcat { axis: 1, parts: vec![("a".into(), a.clone()), ("b".into(), b)] });
        assert_eq!(t.external_slice(), Ok(None), "a concatenation is not a slice");
        // Parts that are consecutive slices of all of one tensor give it back.
        let slice = |start: &str, end: &str| {
            ext(
                vec![4, 3],
                &[
                    ("location", "w.bin"),
                    ("shardc_slice_of", "w"),
                    ("shardc_slice", &format!("1:{start}:{end}")),
                    ("shardc_full_dims", "4x6"),
                ],
            )
        };
        let (name, t) =
            Tensor::concat_external(1, &[("p".into(), slice("0", "3")), ("q".into(), slice("3", "6"))]).unwrap();
        assert_eq!((name.as_deref(), t), (Some("w"), ext(vec![4, 6], &[("location", "w.bin")])));
        // Out of order, they stay parts.
        let (name, _) =
            Tensor::concat_external(1, &[("q".into(), slice("3", "6")), ("p".into(), slice("0", "3"))]).unwrap();
        assert_eq!(name, None);
        // Malformed: parts that do not add up, entries before the first part.
        let bad = ext(vec![4, 9], &[("shardc_concat_axis", "1"), ("shardc_part", "a"), ("shardc_part_dims", "4x3")]);
        assert!(bad.external_concat().unwrap_err().contains("do not make"));
        let bad = ext(vec![4, 3], &[("shardc_concat_axis", "1"), ("location", "w.bin")]);
        assert!(bad.external_concat().unwrap_err().contains("before the first"));
        let bad = ext(vec![4, 3], &[("shardc_concat_axis", "2")]);
        assert!(bad.external_concat().unwrap_err().contains("not an axis"));
    }

    // A fill holds one value for every element: printed as its entry, read back the same,
    // nothing held here, its values made only when asked for.
    #[test]
    fn fills_hold_one_value() {
        let t = Tensor::filled(DType::Float, vec![1024, 1024], 0.0);
        assert_eq!((t.fill(), t.is_external(), t.host_bytes()), (Ok(Some(0.0)), true, 0));
        let mut s = String::new();
        write_tensor_data(&mut s, &t.data).unwrap();
        assert_eq!(s, r#"["shardc_fill": "0"]"#);
        assert!(crate::eval::Array::from_tensor(&t).is_err(), "analyses leave a fill alone");
        let a = crate::eval::Array::materialized(&Tensor::filled(DType::Int64, vec![2, 3], 7.0)).unwrap();
        assert_eq!(a, crate::eval::Array::i64(vec![2, 3], vec![7; 6]));
        let bad = ext(vec![2], &[(FILL, "zero")]);
        assert!(bad.fill().unwrap_err().contains("not a number"));
        assert_eq!(ext(vec![2], &[("location", "w.bin")]).fill(), Ok(None));
    }

    fn f(x: f32) -> String {
        let mut s = String::new();
        write_f32(&mut s, x).unwrap();
        s
    }

    #[test]
    fn floats_print_like_to_chars() {
        assert_eq!(f(1.0), "1");
        assert_eq!(f(1e-5), "1e-05");
        assert_eq!(f(1.000_000_1e-5), "1.0000001e-05");
        assert_eq!(f(0.166_666_67), "0.16666667");
        assert_eq!(f(0.001), "0.001");
        assert_eq!(f(-3.402_823_5e38), "-3.4028235e+38");
        assert_eq!(f(100.0), "100");
        assert_eq!(f(1_000_000.0), "1e+06");
        assert_eq!(f(123_456.0), "123456");
        assert_eq!(f(0.0), "0");
        assert_eq!(f(-0.0), "-0");
        assert_eq!(f(f32::NEG_INFINITY), "-inf");
        assert_eq!(f(1e-12), "1e-12");
        assert_eq!(f(2.5), "2.5");
    }

    #[test]
    fn half_floats_decode() {
        assert_eq!(f16_to_f32(15360), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(1), 5.960_464_5e-8);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }
}
