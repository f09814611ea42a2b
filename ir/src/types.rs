//! Element types, dimensions and value types.
//!
//! These mirror ONNX's `TensorProto.DataType`, `TensorShapeProto.Dimension` and `TypeProto`.
//! Their `Display` is the ONNX text syntax (`float[N,3,224,224]`), so the printer and error
//! messages share one spelling.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! dtypes {
    ($($(#[$doc:meta])* $var:ident = $code:literal, $name:literal, $bits:literal;)*) => {
        /// A tensor element type; the discriminant is ONNX's `TensorProto.DataType` code.
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum DType { $($(#[$doc])* $var = $code,)* }

        impl DType {
            /// Every element type, in code order.
            pub const ALL: &'static [DType] = &[$(DType::$var,)*];

            /// The keyword of the text syntax (`float`, `int64`, …).
            pub fn name(self) -> &'static str {
                match self { $(DType::$var => $name,)* }
            }

            /// Looks up a keyword of the text syntax.
            pub fn from_name(name: &str) -> Option<DType> {
                match name { $($name => Some(DType::$var),)* _ => None }
            }

            /// Looks up an ONNX `DataType` code (as used by `Cast <to: int = 1>`).
            pub fn from_code(code: i64) -> Option<DType> {
                match code { $($code => Some(DType::$var),)* _ => None }
            }

            /// Size of one element in bits (strings count as 64, a pointer).
            pub fn bits(self) -> u32 {
                match self { $(DType::$var => $bits,)* }
            }
        }
    };
}

dtypes! {
    /// 32-bit IEEE float.
    Float = 1, "float", 32;
    /// Unsigned 8-bit integer.
    Uint8 = 2, "uint8", 8;
    /// Signed 8-bit integer.
    Int8 = 3, "int8", 8;
    /// Unsigned 16-bit integer.
    Uint16 = 4, "uint16", 16;
    /// Signed 16-bit integer.
    Int16 = 5, "int16", 16;
    /// Signed 32-bit integer.
    Int32 = 6, "int32", 32;
    /// Signed 64-bit integer.
    Int64 = 7, "int64", 64;
    /// UTF-8 string.
    String = 8, "string", 64;
    /// Boolean, one byte.
    Bool = 9, "bool", 8;
    /// IEEE half precision.
    Float16 = 10, "float16", 16;
    /// 64-bit IEEE float.
    Double = 11, "double", 64;
    /// Unsigned 32-bit integer.
    Uint32 = 12, "uint32", 32;
    /// Unsigned 64-bit integer.
    Uint64 = 13, "uint64", 64;
    /// Complex of two 32-bit floats.
    Complex64 = 14, "complex64", 64;
    /// Complex of two 64-bit floats.
    Complex128 = 15, "complex128", 128;
    /// Brain float 16.
    Bfloat16 = 16, "bfloat16", 16;
    /// 8-bit float E4M3, finite only.
    Float8e4m3fn = 17, "float8e4m3fn", 8;
    /// 8-bit float E4M3, finite only, no negative zero.
    Float8e4m3fnuz = 18, "float8e4m3fnuz", 8;
    /// 8-bit float E5M2.
    Float8e5m2 = 19, "float8e5m2", 8;
    /// 8-bit float E5M2, no negative zero.
    Float8e5m2fnuz = 20, "float8e5m2fnuz", 8;
    /// Unsigned 4-bit integer.
    Uint4 = 21, "uint4", 4;
    /// Signed 4-bit integer.
    Int4 = 22, "int4", 4;
    /// 4-bit float E2M1.
    Float4e2m1 = 23, "float4e2m1", 4;
    /// 8-bit exponent-only float.
    Float8e8m0 = 24, "float8e8m0", 8;
    /// Unsigned 2-bit integer.
    Uint2 = 25, "uint2", 2;
    /// Signed 2-bit integer.
    Int2 = 26, "int2", 2;
}

impl DType {
    /// Bytes per element, rounded up (sub-byte types count as one byte).
    pub fn size_bytes(self) -> u64 {
        u64::from(self.bits().div_ceil(8))
    }

    /// Floating-point types (the ones whose values are trained).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float
                | DType::Double
                | DType::Float16
                | DType::Bfloat16
                | DType::Float8e4m3fn
                | DType::Float8e4m3fnuz
                | DType::Float8e5m2
                | DType::Float8e5m2fnuz
                | DType::Float8e8m0
                | DType::Float4e2m1
        )
    }

    /// Integer types (signed or unsigned), not bool.
    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::Uint8
                | DType::Int8
                | DType::Uint16
                | DType::Int16
                | DType::Int32
                | DType::Int64
                | DType::Uint32
                | DType::Uint64
                | DType::Uint4
                | DType::Int4
                | DType::Uint2
                | DType::Int2
        )
    }

    /// The ONNX `DataType` code.
    pub fn code(self) -> i64 {
        self as i64
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One dimension of a shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Dim {
    /// A number. Exporters sometimes write `-1` for "unknown"; it is kept as written.
    Fixed(i64),
    /// A named symbolic dimension (`N`, `batch`, `"DynamicDimension.0"`).
    Sym(String),
    /// `?`: neither value nor name.
    Unknown,
}

impl Dim {
    /// The value when it is a known, non-negative number.
    pub fn value(&self) -> Option<i64> {
        match self {
            Dim::Fixed(v) if *v >= 0 => Some(*v),
            _ => None,
        }
    }

    /// True when the dimension is a known number.
    pub fn is_known(&self) -> bool {
        self.value().is_some()
    }
}

impl From<i64> for Dim {
    fn from(v: i64) -> Dim {
        Dim::Fixed(v)
    }
}

/// True when `s` is a plain identifier of the text syntax (`[A-Za-z_][A-Za-z0-9_]*`).
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.bytes();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == b'_' => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// Writes `s` as a string literal of the text syntax (`"` and `\` escaped with `\`).
pub fn write_quoted(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    out.write_char('"')?;
    for ch in s.chars() {
        if ch == '"' || ch == '\\' {
            out.write_char('\\')?;
        }
        out.write_char(ch)?;
    }
    out.write_char('"')
}

/// Writes a name: bare when it is an identifier, quoted otherwise (the printer's `printId`).
pub fn write_id(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    if is_identifier(s) { out.write_str(s) } else { write_quoted(out, s) }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(v) => write!(f, "{v}"),
            Dim::Sym(s) => write_id(f, s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// The type of a tensor value: element type and, when known, its shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// `None` for unknown rank (`float[]`); `Some(vec![])` for a scalar (`float`).
    pub dims: Option<Vec<Dim>>,
}

impl TensorType {
    /// A tensor of known rank.
    pub fn new(dtype: DType, dims: Vec<Dim>) -> TensorType {
        TensorType { dtype, dims: Some(dims) }
    }

    /// A tensor with all dimensions known.
    pub fn fixed(dtype: DType, dims: &[i64]) -> TensorType {
        TensorType::new(dtype, dims.iter().map(|&d| Dim::Fixed(d)).collect())
    }

    /// A scalar (rank 0).
    pub fn scalar(dtype: DType) -> TensorType {
        TensorType::new(dtype, vec![])
    }

    /// A tensor of unknown rank.
    pub fn unranked(dtype: DType) -> TensorType {
        TensorType { dtype, dims: None }
    }

    /// Rank, when known.
    pub fn rank(&self) -> Option<usize> {
        self.dims.as_ref().map(Vec::len)
    }

    /// All dimensions as numbers, when every one is known.
    pub fn static_dims(&self) -> Option<Vec<i64>> {
        self.dims.as_ref()?.iter().map(Dim::value).collect()
    }

    /// Number of elements, when the shape is fully known and the count fits in 64 bits
    /// (shape inference rejects shapes whose size does not: [`TensorType::too_large`]).
    pub fn numel(&self) -> Option<u64> {
        self.static_dims()?.iter().try_fold(1u64, |acc, &x| acc.checked_mul(x.max(0) as u64))
    }

    /// Size in bytes, when the shape is fully known and the size fits in 64 bits.
    pub fn size_bytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size_bytes())
    }

    /// True when every dim is known but the element count or byte size overflows 64 bits.
    pub fn too_large(&self) -> bool {
        self.is_static() && self.size_bytes().is_none()
    }

    /// True when every dimension is a known number.
    pub fn is_static(&self) -> bool {
        self.static_dims().is_some()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.dtype.name())?;
        match &self.dims {
            None => f.write_str("[]"),
            Some(d) if d.is_empty() => Ok(()),
            Some(d) => {
                f.write_str("[")?;
                for (i, dim) in d.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{dim}")?;
                }
                f.write_str("]")
            }
        }
    }
}

/// The type of a value (ONNX `TypeProto`). Almost every value is a [`Type::Tensor`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Type {
    /// A dense tensor.
    Tensor(TensorType),
    /// `sparse_tensor(float[2,3])`.
    SparseTensor(TensorType),
    /// `seq(type)`.
    Seq(Box<Type>),
    /// `map(key, type)`.
    Map(DType, Box<Type>),
    /// `optional(type)`.
    Optional(Box<Type>),
    /// `opaque(domain,name)`.
    Opaque {
        /// Domain, may be empty.
        domain: String,
        /// Name, may be empty.
        name: String,
    },
}

impl Type {
    /// The tensor type, when this is a dense tensor.
    pub fn as_tensor(&self) -> Option<&TensorType> {
        match self {
            Type::Tensor(t) => Some(t),
            _ => None,
        }
    }
}

impl From<TensorType> for Type {
    fn from(t: TensorType) -> Type {
        Type::Tensor(t)
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Tensor(t) => write!(f, "{t}"),
            Type::SparseTensor(t) => write!(f, "sparse_tensor({t})"),
            Type::Seq(t) => write!(f, "seq({t})"),
            Type::Map(k, v) => write!(f, "map({k}, {v})"),
            Type::Optional(t) => write!(f, "optional({t})"),
            Type::Opaque { domain, name } => {
                f.write_str("opaque(")?;
                if !domain.is_empty() {
                    write!(f, "{domain},")?;
                }
                write!(f, "{name})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_matches_text_syntax() {
        let t = TensorType::new(
            DType::Float,
            vec![Dim::Sym("N".into()), Dim::Fixed(3), Dim::Unknown, Dim::Sym("a.b".into())],
        );
        assert_eq!(t.to_string(), "float[N,3,?,\"a.b\"]");
        assert_eq!(TensorType::scalar(DType::Int64).to_string(), "int64");
        assert_eq!(TensorType::unranked(DType::Bool).to_string(), "bool[]");
        let m = Type::Map(DType::String, Box::new(Type::Seq(Box::new(TensorType::scalar(DType::Float).into()))));
        assert_eq!(m.to_string(), "map(string, seq(float))");
    }

    #[test]
    fn dtype_codes_round_trip() {
        for &d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::Float.size_bytes(), 4);
        assert_eq!(DType::Int4.size_bytes(), 1);
    }
}
