//! The closed set of operators.
//!
//! Every ONNX operator shardc understands is a variant of [`Op`] holding a struct of typed
//! attributes. A field is `None` when the attribute was not written; the accessor method of
//! the same name returns the ONNX default. Attributes print back in name order, as the
//! exporters write them, so printing is canonical.
//!
//! Operators outside this set are kept as [`Op::Opaque`] with their attributes, so a model
//! with them still parses and prints; passes that need to understand them name them in
//! their errors.

use serde::Serialize;

use crate::graph::Graph;
use crate::graph::attr::{AttrField, AttrKind, AttrValue, Attribute};
use crate::tensor::Tensor;

/// Broad families of operators, for passes that treat a family alike.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum OpClass {
    /// Produces a value without computing: graph inputs, initializers, outer-scope captures.
    Source,
    /// One tensor in, one tensor of the same shape out, elementwise.
    Unary,
    /// Two tensors in, numpy-broadcast, elementwise.
    Binary,
    /// Any number of tensors in, numpy-broadcast, elementwise.
    Variadic,
    /// A reduction over some axes.
    Reduce,
    /// Matrix products and convolutions: the ops with weights and most of the FLOPs.
    Contraction,
    /// Pooling and normalization: windowed or statistics over axes.
    Window,
    /// Data movement and shape manipulation.
    Shape,
    /// Recurrent layers.
    Recurrent,
    /// Ops with subgraphs.
    Control,
    /// Explicit communication between devices (the `shardc` domain).
    Comm,
    /// Anything else.
    Other,
}

/// The domain of the communication ops that lowering inserts.
pub const SHARDC_DOMAIN: &str = "shardc";

macro_rules! attr_ty {
    (int) => { i64 };
    (float) => { f32 };
    (string) => { String };
    (ints) => { Vec<i64> };
    (floats) => { Vec<f32> };
    (strings) => { Vec<String> };
    (tensor) => { Tensor };
    (graph) => { Box<Graph> };
}

macro_rules! attr_getter {
    ($f:ident, int, $d:expr) => {
        #[doc = concat!("`", stringify!($f), "`, or its default `", stringify!($d), "`.")]
        pub fn $f(&self) -> i64 {
            self.$f.unwrap_or($d)
        }
    };
    ($f:ident, float, $d:expr) => {
        #[doc = concat!("`", stringify!($f), "`, or its default `", stringify!($d), "`.")]
        pub fn $f(&self) -> f32 {
            self.$f.unwrap_or($d)
        }
    };
    ($f:ident, string, $d:expr) => {
        #[doc = concat!("`", stringify!($f), "`, or its default ", stringify!($d), ".")]
        pub fn $f(&self) -> &str {
            self.$f.as_deref().unwrap_or($d)
        }
    };
    ($f:ident, $k:ident) => {};
}

macro_rules! attr_name {
    ($f:ident) => {
        stringify!($f)
    };
    ($f:ident, $n:literal) => {
        $n
    };
}

macro_rules! domain_of {
    () => {
        ""
    };
    ($d:literal) => {
        $d
    };
}

macro_rules! define_ops {
    ($d:tt $(
        $(#[$doc:meta])*
        $name:ident = $onnx:literal $(in $domain:literal)?, $class:ident {
            $($field:ident $(($fname:literal))? : $kind:ident $(= $def:expr)?),* $(,)?
        };
    )*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Debug, Default, PartialEq)]
            pub struct $name {
                $(
                    #[doc = concat!("Attribute `", attr_name!($field $(, $fname)?), "` (", stringify!($kind), ").")]
                    pub $field: Option<attr_ty!($kind)>,
                )*
            }

            impl $name {
                /// The attribute names this op accepts.
                pub const ATTRIBUTES: &'static [&'static str] = &[$(attr_name!($field $(, $fname)?)),*];
                $( attr_getter!($field, $kind $(, $def)?); )*

                #[allow(unused_mut)]
                fn attributes(&self) -> Vec<Attribute> {
                    let mut out = Vec::new();
                    $(
                        if let Some(v) = &self.$field {
                            out.push(Attribute::new(attr_name!($field $(, $fname)?), v.to_value()));
                        }
                    )*
                    out
                }

                #[allow(unused_mut, unused_variables)]
                fn from_attributes(attrs: Vec<Attribute>) -> Result<Self, OpError> {
                    let mut s = Self::default();
                    for a in attrs {
                        match a.name.as_str() {
                            $(
                                attr_name!($field $(, $fname)?) => {
                                    let found = a.value.kind();
                                    s.$field = Some(AttrField::from_value(a.value).map_err(|_| OpError::WrongKind {
                                        op: $onnx,
                                        attribute: a.name.clone(),
                                        expected: <attr_ty!($kind) as AttrField>::KIND,
                                        found,
                                    })?);
                                }
                            )*
                            _ => return Err(OpError::UnknownAttribute { op: $onnx, attribute: a.name }),
                        }
                    }
                    Ok(s)
                }
            }
        )*

        /// An operator with its typed attributes.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Op {
            /// A graph input. Typing: the declared type. `default` is the initializer an input
            /// may carry (ONNX "input with a default value").
            Input {
                /// Data used when the caller supplies none.
                default: Option<Tensor>,
            },
            /// A constant parameter (ONNX initializer). Typing: the tensor's type.
            Initializer(Tensor),
            /// A value of an enclosing graph used inside a subgraph. Typing: the outer value's.
            OuterRef,
            $( $(#[$doc])* $name($name), )*
            /// An operator shardc does not model; kept with its attributes for printing.
            Opaque(Opaque),
        }

        impl Op {
            /// The ONNX op type (`Conv`), or `Input`/`Initializer`/`OuterRef` for sources.
            pub fn op_type(&self) -> &str {
                match self {
                    Op::Input { .. } => "Input",
                    Op::Initializer(_) => "Initializer",
                    Op::OuterRef => "OuterRef",
                    $( Op::$name(_) => $onnx, )*
                    Op::Opaque(o) => &o.op_type,
                }
            }

            /// The operator's domain; `""` is the default ONNX domain.
            pub fn domain(&self) -> &str {
                match self {
                    $( Op::$name(_) => domain_of!($($domain)?), )*
                    Op::Opaque(o) => &o.domain,
                    _ => "",
                }
            }

            /// The family this operator belongs to.
            pub fn class(&self) -> OpClass {
                match self {
                    Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => OpClass::Source,
                    $( Op::$name(_) => OpClass::$class, )*
                    Op::Opaque(_) => OpClass::Other,
                }
            }

            /// The attributes to print, sorted by name.
            pub fn attributes(&self) -> Vec<Attribute> {
                let mut attrs = match self {
                    $( Op::$name(x) => x.attributes(), )*
                    Op::Opaque(o) => return o.attrs.clone(),
                    _ => Vec::new(),
                };
                attrs.sort_by(|a, b| a.name.cmp(&b.name));
                attrs
            }

            /// The attribute names a known op accepts, or `None` for an op type shardc does
            /// not model.
            pub fn known_attributes(domain: &str, op_type: &str) -> Option<&'static [&'static str]> {
                match (domain, op_type) {
                    $( (domain_of!($($domain)?), $onnx) => Some($name::ATTRIBUTES), )*
                    _ => None,
                }
            }

            /// Builds an op from its domain, type and attributes as written. Unknown op types
            /// become [`Op::Opaque`]; a known op with an attribute of the wrong kind or an
            /// attribute it does not have is an error (callers may choose to keep such a node
            /// opaque instead).
            pub fn from_parts(domain: &str, op_type: &str, attrs: Vec<Attribute>) -> Result<Op, OpError> {
                let has_ref = attrs.iter().any(|a| matches!(a.value, AttrValue::Ref(..)));
                if !has_ref {
                    match (domain, op_type) {
                        $( (domain_of!($($domain)?), $onnx) => return $name::from_attributes(attrs).map(Op::$name), )*
                        _ => {}
                    }
                }
                Ok(Op::Opaque(Opaque {
                    domain: domain.to_string(),
                    op_type: op_type.to_string(),
                    overload: String::new(),
                    attrs,
                }))
            }

            /// Every op type shardc models, as `(domain, op_type)`.
            pub fn known_op_types() -> &'static [(&'static str, &'static str)] {
                &[$( (domain_of!($($domain)?), $onnx), )*]
            }
        }

        /// Calls `$m!(Name, ...)` with the variant name of every op of [`Op`] (sources and
        /// `Opaque` excluded), so that another crate can build its own exhaustive dispatch
        /// (e.g. codegen's kernels) without a catch-all arm.
        #[macro_export]
        macro_rules! for_all_ops {
            ($d m:ident) => {
                $d m!($($name),*);
            };
        }

        /// [`for_all_ops`] for this crate's own modules (an exported macro made by a macro
        /// cannot be named by path inside its crate).
        macro_rules! with_all_ops {
            ($d m:ident) => {
                $d m!($($name),*);
            };
        }
        pub(crate) use with_all_ops;
    };
}

/// An operator shardc does not model, with everything needed to print it back.
#[derive(Clone, Debug, PartialEq)]
pub struct Opaque {
    /// Domain (`com.microsoft`), `""` for the default.
    pub domain: String,
    /// Op type.
    pub op_type: String,
    /// Function overload (`name:overload`), usually empty.
    pub overload: String,
    /// Attributes, in the order written.
    pub attrs: Vec<Attribute>,
}

/// Why attributes do not fit an op.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum OpError {
    /// The attribute exists but holds another kind.
    #[error("attribute `{attribute}` of {op} must be of kind `{expected}`, found `{found}`")]
    WrongKind {
        /// The op type.
        op: &'static str,
        /// The attribute.
        attribute: String,
        /// Kind the op wants.
        expected: AttrKind,
        /// Kind written.
        found: AttrKind,
    },
    /// The op has no attribute of that name.
    #[error("{op} has no attribute `{attribute}`")]
    UnknownAttribute {
        /// The op type.
        op: &'static str,
        /// The attribute.
        attribute: String,
    },
}

define_ops! {
    $
    // ---- elementwise unary: one input X, output Y with X's shape ----
    /// `|x|`. Typing: Y has X's type.
    Abs = "Abs", Unary {};
    /// `acos(x)`. Typing: Y has X's type.
    Acos = "Acos", Unary {};
    /// `acosh(x)`. Typing: Y has X's type.
    Acosh = "Acosh", Unary {};
    /// `asin(x)`. Typing: Y has X's type.
    Asin = "Asin", Unary {};
    /// `asinh(x)`. Typing: Y has X's type.
    Asinh = "Asinh", Unary {};
    /// `atan(x)`. Typing: Y has X's type.
    Atan = "Atan", Unary {};
    /// `atanh(x)`. Typing: Y has X's type.
    Atanh = "Atanh", Unary {};
    /// Bitwise not of integers. Typing: Y has X's type.
    BitwiseNot = "BitwiseNot", Unary {};
    /// `ceil(x)`. Typing: Y has X's type.
    Ceil = "Ceil", Unary {};
    /// `max(0,x) + min(0, alpha*(exp(x/alpha)-1))`. Typing: Y has X's type.
    Celu = "Celu", Unary { alpha: float = 1.0 };
    /// `cos(x)`. Typing: Y has X's type.
    Cos = "Cos", Unary {};
    /// `cosh(x)`. Typing: Y has X's type.
    Cosh = "Cosh", Unary {};
    /// `x` if `x >= 0` else `alpha*(exp(x)-1)`. Typing: Y has X's type.
    Elu = "Elu", Unary { alpha: float = 1.0 };
    /// The error function. Typing: Y has X's type.
    Erf = "Erf", Unary {};
    /// `exp(x)`. Typing: Y has X's type.
    Exp = "Exp", Unary {};
    /// `floor(x)`. Typing: Y has X's type.
    Floor = "Floor", Unary {};
    /// Gaussian error linear unit, exact (`none`) or `tanh` approximation. Typing: Y has X's type.
    Gelu = "Gelu", Unary { approximate: string = "none" };
    /// `max(0, min(1, alpha*x + beta))`. Typing: Y has X's type.
    HardSigmoid = "HardSigmoid", Unary { alpha: float = 0.2, beta: float = 0.5 };
    /// `x * max(0, min(1, x/6 + 1/2))`. Typing: Y has X's type.
    HardSwish = "HardSwish", Unary {};
    /// Identity. Typing: Y has X's type.
    Identity = "Identity", Unary {};
    /// `isinf(x)`. Typing: Y is bool with X's shape.
    IsInf = "IsInf", Unary { detect_negative: int = 1, detect_positive: int = 1 };
    /// `isnan(x)`. Typing: Y is bool with X's shape.
    IsNaN = "IsNaN", Unary {};
    /// `x` if `x >= 0` else `alpha*x`. Typing: Y has X's type.
    LeakyRelu = "LeakyRelu", Unary { alpha: float = 0.01 };
    /// `ln(x)`. Typing: Y has X's type.
    Log = "Log", Unary {};
    /// `x * tanh(softplus(x))`. Typing: Y has X's type.
    Mish = "Mish", Unary {};
    /// `x · σ(αx)`.
    Swish = "Swish", Unary { alpha: float = 1.0 };
    /// `-x`. Typing: Y has X's type.
    Neg = "Neg", Unary {};
    /// Logical not. Typing: X and Y are bool.
    Not = "Not", Unary {};
    /// `1/x`. Typing: Y has X's type.
    Reciprocal = "Reciprocal", Unary {};
    /// `max(0, x)`. Typing: Y has X's type.
    Relu = "Relu", Unary {};
    /// Round half to even. Typing: Y has X's type.
    Round = "Round", Unary {};
    /// Scaled exponential linear unit. Typing: Y has X's type.
    Selu = "Selu", Unary { alpha: float = 1.673_263_2, gamma: float = 1.050_701 };
    /// Shrinkage: `x-bias` if `x > lambd`, `x+bias` if `x < -lambd`, else 0. Typing: Y has X's type.
    Shrink = "Shrink", Unary { bias: float = 0.0, lambd: float = 0.5 };
    /// `1/(1+exp(-x))`. Typing: Y has X's type.
    Sigmoid = "Sigmoid", Unary {};
    /// Sign, -1, 0 or 1. Typing: Y has X's type.
    Sign = "Sign", Unary {};
    /// `sin(x)`. Typing: Y has X's type.
    Sin = "Sin", Unary {};
    /// `sinh(x)`. Typing: Y has X's type.
    Sinh = "Sinh", Unary {};
    /// `ln(exp(x)+1)`. Typing: Y has X's type.
    Softplus = "Softplus", Unary {};
    /// `x/(1+|x|)`. Typing: Y has X's type.
    Softsign = "Softsign", Unary {};
    /// `sqrt(x)`. Typing: Y has X's type.
    Sqrt = "Sqrt", Unary {};
    /// `tan(x)`. Typing: Y has X's type.
    Tan = "Tan", Unary {};
    /// `tanh(x)`. Typing: Y has X's type.
    Tanh = "Tanh", Unary {};
    /// `x` if `x > alpha` else 0. Typing: Y has X's type.
    ThresholdedRelu = "ThresholdedRelu", Unary { alpha: float = 1.0 };
    /// Element type conversion. Typing: Y has X's shape and element type `to`.
    Cast = "Cast", Unary { saturate: int = 1, to: int };
    /// Converts X to the element type of the second input. Typing: Y has X's shape.
    CastLike = "CastLike", Unary { saturate: int = 1 };
    /// `min(max(x, min), max)`; bounds are optional inputs (opset 11+) or attributes (older).
    /// Typing: Y has X's type.
    Clip = "Clip", Unary { max: float, min: float };
    /// Inference-mode dropout is the identity; the optional mask output is all true.
    /// Typing: Y has X's type, mask is bool with X's shape.
    Dropout = "Dropout", Unary { ratio: float, seed: int };
    /// The same bits as another type of the same width.
    BitCast = "BitCast", Other { to: int };
    /// `Swish_α(A) · B` (A and B of one shape).
    SwiGLU = "SwiGLU", Other { alpha: float = 1.0 };

    // ---- elementwise binary: A, B broadcast (numpy rules) to C ----
    /// `a + b`. Typing: A and B of one element type; C has their broadcast shape.
    Add = "Add", Binary {};
    /// `a - b`. Typing: as Add.
    Sub = "Sub", Binary {};
    /// `a * b`. Typing: as Add.
    Mul = "Mul", Binary {};
    /// `a / b` (truncating for integers). Typing: as Add.
    Div = "Div", Binary {};
    /// `a ^ b`. Typing: C has A's element type and the broadcast shape.
    Pow = "Pow", Binary {};
    /// Remainder, sign of the divisor unless `fmod`. Typing: as Add.
    Mod = "Mod", Binary { fmod: int = 0 };
    /// `x` if `x >= 0` else `slope*x`, slope broadcast to X. Typing: as Add.
    PRelu = "PRelu", Binary {};
    /// Logical and. Typing: bool inputs, bool output.
    And = "And", Binary {};
    /// Logical or. Typing: bool inputs, bool output.
    Or = "Or", Binary {};
    /// Logical xor. Typing: bool inputs, bool output.
    Xor = "Xor", Binary {};
    /// `a == b`. Typing: C is bool.
    Equal = "Equal", Binary {};
    /// `a > b`. Typing: C is bool.
    Greater = "Greater", Binary {};
    /// `a >= b`. Typing: C is bool.
    GreaterOrEqual = "GreaterOrEqual", Binary {};
    /// `a < b`. Typing: C is bool.
    Less = "Less", Binary {};
    /// `a <= b`. Typing: C is bool.
    LessOrEqual = "LessOrEqual", Binary {};
    /// Bitwise and. Typing: as Add.
    BitwiseAnd = "BitwiseAnd", Binary {};
    /// Bitwise or. Typing: as Add.
    BitwiseOr = "BitwiseOr", Binary {};
    /// Bitwise xor. Typing: as Add.
    BitwiseXor = "BitwiseXor", Binary {};
    /// Bit shift of unsigned integers, `LEFT` or `RIGHT`. Typing: as Add.
    BitShift = "BitShift", Binary { direction: string };

    // ---- elementwise, any number of inputs ----
    /// Elementwise maximum of all inputs. Typing: broadcast shape of all inputs.
    Max = "Max", Variadic {};
    /// Elementwise minimum of all inputs. Typing: broadcast shape of all inputs.
    Min = "Min", Variadic {};
    /// Elementwise sum of all inputs. Typing: broadcast shape of all inputs.
    Sum = "Sum", Variadic {};
    /// Elementwise mean of all inputs. Typing: broadcast shape of all inputs.
    Mean = "Mean", Variadic {};
    /// `cond ? x : y`. Typing: cond is bool; X and Y share an element type; output is the
    /// broadcast of all three shapes.
    Where = "Where", Variadic {};

    // ---- contractions ----
    /// Numpy matmul: batched, broadcast over leading dims, 1-D operands promoted.
    /// Typing: `[..., M, K] x [..., K, N] -> [..., M, N]`.
    MatMul = "MatMul", Contraction {};
    /// `alpha * A' B' + beta * C`, A' = A or Aᵀ (transA), B' likewise; C broadcasts to [M, N].
    /// Typing: A is [M,K] (or [K,M]), B is [K,N] (or [N,K]); Y is [M,N].
    Gemm = "Gemm", Contraction { alpha: float = 1.0, beta: float = 1.0, trans_a("transA"): int = 0, trans_b("transB"): int = 0 };
    /// Einstein summation. Typing: given by the equation.
    Einsum = "Einsum", Contraction { equation: string };
    /// Determinants of square matrices.
    Det = "Det", Contraction {};
    /// N-d convolution, X [N, C, D1..Dk], W [M, C/group, k1..kk], optional bias B [M].
    /// Typing: Y is [N, M, O1..Ok] with `Oi = floor((Di + pads - dil*(ki-1) - 1)/stride) + 1`.
    Conv = "Conv", Contraction { auto_pad: string = "NOTSET", dilations: ints, group: int = 1, kernel_shape: ints, pads: ints, strides: ints };
    /// Transposed convolution, W [C, M/group, k1..kk]. Typing: Y is [N, M, O1..Ok] with
    /// `Oi = stride*(Di-1) + output_padding + dil*(ki-1) + 1 - pads`, or `output_shape`.
    ConvTranspose = "ConvTranspose", Contraction { auto_pad: string = "NOTSET", dilations: ints, group: int = 1, kernel_shape: ints, output_padding: ints, output_shape: ints, pads: ints, strides: ints };

    // ---- pooling and normalization ----
    /// Max pooling over windows. Typing: Y is [N, C, O1..Ok] (floor, or ceil with ceil_mode);
    /// optional Indices is int64 of Y's shape.
    MaxPool = "MaxPool", Window { auto_pad: string = "NOTSET", ceil_mode: int = 0, dilations: ints, kernel_shape: ints, pads: ints, storage_order: int = 0, strides: ints };
    /// Average pooling over windows. Typing: as MaxPool.
    AveragePool = "AveragePool", Window { auto_pad: string = "NOTSET", ceil_mode: int = 0, count_include_pad: int = 0, dilations: ints, kernel_shape: ints, pads: ints, strides: ints };
    /// Lp pooling over windows. Typing: as MaxPool.
    LpPool = "LpPool", Window { auto_pad: string = "NOTSET", ceil_mode: int = 0, dilations: ints, kernel_shape: ints, p: int = 2, pads: ints, strides: ints };
    /// Mean over all spatial dims. Typing: [N, C, D1..Dk] -> [N, C, 1..1].
    GlobalAveragePool = "GlobalAveragePool", Window {};
    /// Max over all spatial dims. Typing: as GlobalAveragePool.
    GlobalMaxPool = "GlobalMaxPool", Window {};
    /// Lp norm over all spatial dims. Typing: as GlobalAveragePool.
    GlobalLpPool = "GlobalLpPool", Window { p: int = 2 };
    /// Batch normalization with scale, bias, mean, var [C]. Typing: Y has X's type; in
    /// training mode the running mean and var are extra outputs.
    BatchNormalization = "BatchNormalization", Window { epsilon: float = 1e-5, momentum: float = 0.9, spatial: int, training_mode: int = 0 };
    /// Normalization over spatial dims per sample and channel. Typing: Y has X's type.
    InstanceNormalization = "InstanceNormalization", Window { epsilon: float = 1e-5 };
    /// Normalization over dims `axis..`; scale and bias broadcast over them. Typing: Y has
    /// X's type; optional Mean and InvStdDev keep dims `..axis` and are 1 after.
    LayerNormalization = "LayerNormalization", Window { axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1 };
    /// Normalization over groups of channels. Typing: Y has X's type.
    GroupNormalization = "GroupNormalization", Window { epsilon: float = 1e-5, num_groups: int, stash_type: int = 1 };
    /// Local response normalization across channels. Typing: Y has X's type.
    LRN = "LRN", Window { alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0, size: int };
    /// Lp normalization along an axis. Typing: Y has X's type.
    LpNormalization = "LpNormalization", Window { axis: int = -1, p: int = 2 };
    /// `(x - mean) / sqrt(var)` over axes. Typing: Y has X's type.
    MeanVarianceNormalization = "MeanVarianceNormalization", Window { axes: ints };
    /// Softmax along `axis` (opset 13+: one axis, default -1; before: flattened from `axis`,
    /// default 1). Typing: Y has X's type.
    Softmax = "Softmax", Window { axis: int };
    /// Log of Softmax. Typing: Y has X's type.
    LogSoftmax = "LogSoftmax", Window { axis: int };
    /// One-hot of the argmax along `axis`. Typing: Y has X's type.
    Hardmax = "Hardmax", Window { axis: int };
    /// `x / sqrt(mean(x²) + ε) · scale` over the dims from `axis` on.
    RMSNormalization = "RMSNormalization", Window { axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1 };
    /// MaxPool's values back to the positions of its indices, zeros elsewhere.
    MaxUnpool = "MaxUnpool", Window { kernel_shape: ints, pads: ints, strides: ints };

    // ---- transformer blocks ----
    /// Scaled dot-product attention: masks, causal and sliding windows, grouped heads, a cache.
    Attention = "Attention", Other { is_causal: int = 0, kv_num_heads: int, left_window_size: int = -1, q_num_heads: int, qk_matmul_output_mode: int = 0, right_window_size: int = -1, scale: float, softcap: float = 0.0, softmax_precision: int };
    /// Rotary position embedding of each head's features.
    RotaryEmbedding = "RotaryEmbedding", Other { interleaved: int = 0, num_heads: int, rotary_embedding_dim: int = 0 };
    /// The experts of a sparse mixture of experts: X [T, H], ids [T, k], w [T, k],
    /// W1 [E, 2I, H], W2 [E, H, I] → Y [T, H], each token through the SiLU-gated MLPs of the
    /// experts it was routed to, weighted and summed (ir/src/ops/experts.rs). A
    /// `capacity_factor` asks for the all-to-all token dispatcher when the experts split
    /// (0: buffers for every pair that can be routed to a device, dropless).
    MoE = "MoE" in "shardc", Other { activation: string = "silu", capacity_factor: float };
    /// The all-to-all dispatcher's routing: ids [T, k] → the row of each routed pair in a
    /// buffer of `parts` blocks of `capacity` rows (block `d` for the pairs of experts
    /// `d·experts ..`), in order of the pairs, and each row's expert within its block (−1: an
    /// empty row). A block that overflows is an error: no pair is dropped (ir/src/ops/experts.rs).
    MoERoute = "MoERoute" in "shardc", Other { capacity: int, experts: int, parts: int };
    /// The all-to-all dispatcher's send buffer: X [T, w] (`per_pair` 0: each token's row to
    /// the rows of its pairs) or [T, k] (`per_pair` 1: each pair's value to its row), pos
    /// [T, k] → B [rows, w] (w = 1 per pair), the rows no pair takes zero.
    MoEDispatch = "MoEDispatch" in "shardc", Other { per_pair: int = 0, rows: int };
    /// The dispatcher's combine: B [R, w], pos [T, k] → per token the sum of its pairs' rows
    /// [T, w] (`per_pair` 0), or each pair's value [T, k] (`per_pair` 1, w = 1).
    MoECombine = "MoECombine" in "shardc", Other { per_pair: int = 0 };
    /// Attention of Q over one block of keys merged into a running output (ring attention's
    /// step): Q, K, V[, Y, LSE] → Y', LSE' — the softmax over the union of the keys seen so
    /// far, kept stable by each row's log-sum-exp. `q_offset` and `k_offset` place the
    /// queries and keys in the sequence for the causal mask (ir/src/ops/flash.rs).
    AttentionBlock = "AttentionBlock" in "shardc", Other { is_causal: int = 0, k_offset: int = 0, q_offset: int = 0, scale: float };

    // ---- quantized arithmetic ----
    /// `saturate(round(x / scale) + zero_point)`.
    QuantizeLinear = "QuantizeLinear", Other { axis: int = 1, block_size: int = 0, output_dtype: int = 0, precision: int = 0, saturate: int = 1 };
    /// `(x − zero_point) · scale`.
    DequantizeLinear = "DequantizeLinear", Other { axis: int = 1, block_size: int = 0, output_dtype: int = 0 };
    /// uint8 quantization with the scale and zero point of the data's range.
    DynamicQuantizeLinear = "DynamicQuantizeLinear", Other {};
    /// Integer matrix product with zero points, to int32.
    MatMulInteger = "MatMulInteger", Contraction {};
    /// Quantized matrix product, requantized.
    QLinearMatMul = "QLinearMatMul", Contraction {};
    /// Integer convolution with zero points, to int32.
    ConvInteger = "ConvInteger", Contraction { auto_pad: string = "NOTSET", dilations: ints, group: int = 1, kernel_shape: ints, pads: ints, strides: ints };
    /// Quantized convolution, requantized.
    QLinearConv = "QLinearConv", Contraction { auto_pad: string = "NOTSET", dilations: ints, group: int = 1, kernel_shape: ints, pads: ints, strides: ints };

    // ---- signal processing ----
    /// Discrete Fourier transform along an axis (complex as a trailing dim of 2).
    DFT = "DFT", Other { axis: int, inverse: int = 0, onesided: int = 0 };
    /// Short-time Fourier transform of a signal.
    STFT = "STFT", Other { onesided: int = 1 };
    /// A Hann window.
    HannWindow = "HannWindow", Other { output_datatype: int = 1, periodic: int = 1 };
    /// A Hamming window.
    HammingWindow = "HammingWindow", Other { output_datatype: int = 1, periodic: int = 1 };
    /// A Blackman window.
    BlackmanWindow = "BlackmanWindow", Other { output_datatype: int = 1, periodic: int = 1 };
    /// Mel filter bank weights for DFT bins.
    MelWeightMatrix = "MelWeightMatrix", Other { output_datatype: int = 1 };

    // ---- sampling images ----
    /// Samples an image at a grid of normalized positions.
    GridSample = "GridSample", Other { align_corners: int = 0, mode: string = "linear", padding_mode: string = "zeros" };
    /// The sampling grid of affine transforms.
    AffineGrid = "AffineGrid", Other { align_corners: int = 0 };
    /// Sums column blocks back into an image (the inverse of im2col).
    Col2Im = "Col2Im", Other { dilations: ints, pads: ints, strides: ints };
    /// Pools regions of interest by bilinear sampling.
    RoiAlign = "RoiAlign", Other { coordinate_transformation_mode: string = "half_pixel", mode: string = "avg", output_height: int = 1, output_width: int = 1, sampling_ratio: int = 0, spatial_scale: float = 1.0 };
    /// Boxes kept after suppressing overlaps, per batch and class.
    NonMaxSuppression = "NonMaxSuppression", Other { center_point_box: int = 0 };

    // ---- strings ----
    /// Element-wise concatenation of strings.
    StringConcat = "StringConcat", Other {};
    /// Splits strings into padded pieces and counts them.
    StringSplit = "StringSplit", Other { delimiter: string, maxsplit: int };
    /// Removes stop words and changes case.
    StringNormalizer = "StringNormalizer", Other { case_change_action: string = "NONE", is_case_sensitive: int = 0, locale: string, stopwords: strings };
    /// Whether each string fully matches a regular expression.
    RegexFullMatch = "RegexFullMatch", Other { pattern: string };

    // ---- losses ----
    /// Softmax cross-entropy of scores [N, C, d1..] against int labels [N, d1..] (class dim
    /// 1), optional class weights [C]; `reduction` mean (weighted mean), sum or none; labels
    /// equal to `ignore_index` count for nothing. Typing: loss is rank 0 (or [N, d1..] for
    /// none); optional log_prob has the scores' type.
    SoftmaxCrossEntropyLoss = "SoftmaxCrossEntropyLoss", Other { ignore_index: int, reduction: string = "mean" };
    /// Negative log-likelihood of log-probabilities [N, C, d1..] at int targets [N, d1..].
    /// Typing: as SoftmaxCrossEntropyLoss's loss.
    NegativeLogLikelihoodLoss = "NegativeLogLikelihoodLoss", Other { ignore_index: int, reduction: string = "mean" };

    // ---- reductions: axes as attribute or (newer opsets) as second input ----
    /// Sum of absolute values. Typing: X's dims with the reduced axes removed or kept as 1.
    ReduceL1 = "ReduceL1", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Euclidean norm. Typing: as ReduceL1.
    ReduceL2 = "ReduceL2", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Log of the sum. Typing: as ReduceL1.
    ReduceLogSum = "ReduceLogSum", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Log of the sum of exponentials. Typing: as ReduceL1.
    ReduceLogSumExp = "ReduceLogSumExp", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Maximum. Typing: as ReduceL1.
    ReduceMax = "ReduceMax", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Mean. Typing: as ReduceL1.
    ReduceMean = "ReduceMean", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Minimum. Typing: as ReduceL1.
    ReduceMin = "ReduceMin", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Product. Typing: as ReduceL1.
    ReduceProd = "ReduceProd", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Sum. Typing: as ReduceL1.
    ReduceSum = "ReduceSum", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Sum of squares. Typing: as ReduceL1.
    ReduceSumSquare = "ReduceSumSquare", Reduce { axes: ints, keepdims: int = 1, noop_with_empty_axes: int = 0 };
    /// Index of the maximum along `axis`. Typing: int64, X's dims with `axis` removed or 1.
    ArgMax = "ArgMax", Reduce { axis: int = 0, keepdims: int = 1, select_last_index: int = 0 };
    /// Index of the minimum along `axis`. Typing: as ArgMax.
    ArgMin = "ArgMin", Reduce { axis: int = 0, keepdims: int = 1, select_last_index: int = 0 };

    // ---- shape and data movement ----
    /// Reshape to the int64 `shape` input; 0 copies the input dim (unless allowzero), -1 is
    /// inferred. Typing: same element count.
    Reshape = "Reshape", Shape { allowzero: int = 0 };
    /// Reshape to 2-D at `axis`. Typing: [prod(dims[..axis]), prod(dims[axis..])].
    Flatten = "Flatten", Shape { axis: int = 1 };
    /// Permutes dims (`perm`, default reversed). Typing: dims permuted.
    Transpose = "Transpose", Shape { perm: ints };
    /// Removes size-1 dims (`axes` attribute before opset 13, input after; all if absent).
    Squeeze = "Squeeze", Shape { axes: ints };
    /// Inserts size-1 dims at `axes` (attribute before opset 13, input after).
    Unsqueeze = "Unsqueeze", Shape { axes: ints };
    /// Joins inputs along `axis`. Typing: dims equal except `axis`, which adds up.
    Concat = "Concat", Shape { axis: int };
    /// Splits along `axis` by `split` sizes (attribute, or input from opset 13) or into
    /// `num_outputs` near-equal parts. Typing: one output per part.
    Split = "Split", Shape { axis: int = 0, num_outputs: int, split: ints };
    /// Strided slice; starts/ends/axes/steps are inputs (attributes before opset 10).
    Slice = "Slice", Shape { axes: ints, ends: ints, starts: ints };
    /// Takes entries of `data` along `axis` at `indices`. Typing: data dims with `axis`
    /// replaced by the indices' dims.
    Gather = "Gather", Shape { axis: int = 0 };
    /// Gathers with an index tensor of data's rank. Typing: indices' shape.
    GatherElements = "GatherElements", Shape { axis: int = 0 };
    /// Gathers slices by index tuples. Typing: `batch + indices[..-1] + data[batch+last..]`.
    GatherND = "GatherND", Shape { batch_dims: int = 0 };
    /// Writes `updates` at index tuples. Typing: data's type.
    ScatterND = "ScatterND", Shape { reduction: string = "none" };
    /// Writes `updates` at per-element indices along `axis`. Typing: data's type.
    ScatterElements = "ScatterElements", Shape { axis: int = 0, reduction: string = "none" };
    /// Broadcasts to the int64 `shape` input. Typing: broadcast of input and shape.
    Expand = "Expand", Shape {};
    /// Repeats along each dim by the int64 `repeats` input. Typing: dims multiplied.
    Tile = "Tile", Shape {};
    /// Pads by the int64 `pads` input (attribute before opset 11). Typing: dims grown.
    Pad = "Pad", Shape { mode: string = "constant", pads: ints, value: float };
    /// Resizes by scales or sizes inputs. Typing: dims scaled.
    Resize = "Resize", Shape { antialias: int = 0, axes: ints, coordinate_transformation_mode: string = "half_pixel", cubic_coeff_a: float = -0.75, exclude_outside: int = 0, extrapolation_value: float = 0.0, keep_aspect_ratio_policy: string = "stretch", mode: string = "nearest", nearest_mode: string = "round_prefer_floor" };
    /// Deprecated resize by scales. Typing: dims scaled.
    Upsample = "Upsample", Shape { mode: string = "nearest", scales: floats };
    /// Moves depth into spatial blocks. Typing: [N, C/b², H*b, W*b].
    DepthToSpace = "DepthToSpace", Shape { blocksize: int, mode: string = "DCR" };
    /// Moves spatial blocks into depth. Typing: [N, C*b², H/b, W/b].
    SpaceToDepth = "SpaceToDepth", Shape { blocksize: int, mode: string = "DCR" };
    /// The input's shape as int64 [rank] (or a `start..end` part of it).
    Shape = "Shape", Shape { end: int, start: int = 0 };
    /// The number of elements as an int64 scalar.
    Size = "Size", Shape {};
    /// A constant from exactly one `value*` attribute. Typing: that value's type.
    Constant = "Constant", Shape { value: tensor, value_float: float, value_floats: floats, value_int: int, value_ints: ints, value_string: string, value_strings: strings };
    /// A tensor of the int64 `shape` input filled with `value` (default float 0).
    ConstantOfShape = "ConstantOfShape", Shape { value: tensor };
    /// `start, start+delta, … < limit` of scalars. Typing: 1-D of the inputs' type.
    Range = "Range", Shape {};
    /// Upper (or lower) triangle of the last two dims, offset by the optional k input.
    /// Typing: Y has X's type.
    Trilu = "Trilu", Shape { upper: int = 1 };
    /// The k largest (or smallest) along `axis`. Typing: Values has X's type with `axis` of
    /// size k; Indices is int64 of that shape.
    TopK = "TopK", Shape { axis: int = -1, k: int, largest: int = 1, sorted: int = 1 };
    /// Indices of non-zero elements. Typing: int64 [rank, nnz].
    NonZero = "NonZero", Shape {};
    /// One-hot encoding of indices with the given depth along `axis`.
    OneHot = "OneHot", Shape { axis: int = -1 };
    /// Cumulative sum along the axis input. Typing: Y has X's type.
    CumSum = "CumSum", Shape { exclusive: int = 0, reverse: int = 0 };
    /// Identity matrix shaped like the input, diagonal offset k. Typing: X's shape.
    EyeLike = "EyeLike", Shape { dtype: int, k: int = 0 };
    /// Running product along an axis.
    CumProd = "CumProd", Shape { exclusive: int = 0, reverse: int = 0 };
    /// `ScatterElements` without reduction (its deprecated name).
    Scatter = "Scatter", Shape { axis: int = 0 };
    /// The slices along an axis where a condition holds.
    Compress = "Compress", Shape { axis: int };
    /// Each batch entry's first `len` time steps reversed.
    ReverseSequence = "ReverseSequence", Shape { batch_axis: int = 1, time_axis: int = 0 };
    /// A cache with updates written at per-batch positions.
    TensorScatter = "TensorScatter", Shape { axis: int = -2, mode: string = "linear" };
    /// The distinct values (or slices), with indices, inverse indices and counts.
    Unique = "Unique", Shape { axis: int, sorted: int = 1 };
    /// Crops or pads axes to a length about their centre.
    CenterCropPad = "CenterCropPad", Shape { axes: ints };

    // ---- recurrent layers: X [seq, batch, input] (layout 0) ----
    /// Long short-term memory. Typing: Y [seq, dirs, batch, hidden], Y_h and Y_c
    /// [dirs, batch, hidden] (layout 0).
    LSTM = "LSTM", Recurrent { activation_alpha: floats, activation_beta: floats, activations: strings, clip: float, direction: string = "forward", hidden_size: int, input_forget: int = 0, layout: int = 0 };
    /// Gated recurrent unit. Typing: Y [seq, dirs, batch, hidden], Y_h [dirs, batch, hidden].
    GRU = "GRU", Recurrent { activation_alpha: floats, activation_beta: floats, activations: strings, clip: float, direction: string = "forward", hidden_size: int, layout: int = 0, linear_before_reset: int = 0 };
    /// Elman recurrent network. Typing: as GRU.
    RNN = "RNN", Recurrent { activation_alpha: floats, activation_beta: floats, activations: strings, clip: float, direction: string = "forward", hidden_size: int, layout: int = 0 };

    // ---- control flow ----
    /// Runs one of two subgraphs on a bool scalar. Typing: outputs of the branches (which
    /// must agree in element type and rank).
    If = "If", Control { else_branch: graph, then_branch: graph };
    /// Runs `body` while the condition holds, up to the trip count.
    Loop = "Loop", Control { body: graph };
    /// Runs `body` over slices of the scan inputs.
    Scan = "Scan", Control { body: graph, num_scan_inputs: int, scan_input_axes: ints, scan_input_directions: ints, scan_output_axes: ints, scan_output_directions: ints };

    // ---- gradients and optimizer updates (inserted by autodiff; the `shardc` domain) ----
    /// The gradient of an element-wise op `op` (its ONNX type, with its `alpha`, `beta`,
    /// `gamma`, `approximate` attributes): inputs X, Y (the forward output) and dY; dX =
    /// dY · op'(X). Typing: dY's type.
    ElementwiseGrad = "ElementwiseGrad" in "shardc", Unary { alpha: float, approximate: string, beta: float, gamma: float, op: string };
    /// The gradient of Conv with respect to its input: dY [N, M, O..], W [M, C/g, k..] →
    /// dX [N, C, I..] of `input_shape`; explicit `pads` (begin then end).
    ConvGradInput = "ConvGradInput" in "shardc", Contraction { dilations: ints, group: int = 1, input_shape: ints, kernel_shape: ints, pads: ints, strides: ints };
    /// The gradient of Conv with respect to its weight: X [N, C, I..], dY [N, M, O..] →
    /// dW [M, C/g, k..]; explicit `pads`.
    ConvGradWeight = "ConvGradWeight" in "shardc", Contraction { dilations: ints, group: int = 1, kernel_shape: ints, pads: ints, strides: ints };
    /// The gradient of MaxPool: X, dY → dX; each output's gradient goes to the first
    /// maximum of its window. Explicit `pads`.
    MaxPoolGrad = "MaxPoolGrad" in "shardc", Window { dilations: ints, kernel_shape: ints, pads: ints, strides: ints };
    /// The gradient of AveragePool: dY → dX of `input_shape`, each output's gradient
    /// shared by its window's elements (counted as the forward counted them). Explicit
    /// `pads`; `ceil_mode` as the forward's.
    AveragePoolGrad = "AveragePoolGrad" in "shardc", Window { ceil_mode: int = 0, count_include_pad: int = 0, dilations: ints, input_shape: ints, kernel_shape: ints, pads: ints, strides: ints };
    /// The gradient of BatchNormalization: X, scale, mean, var, dY → dX, dscale, dbias; in
    /// training mode the batch statistics (and their dependence on X) replace mean and var.
    BatchNormGrad = "BatchNormGrad" in "shardc", Window { epsilon: float = 1e-5, training_mode: int = 0 };
    /// The gradient of LayerNormalization over dims `axis..`: X, scale, dY → dX, dscale,
    /// dbias.
    LayerNormGrad = "LayerNormGrad" in "shardc", Window { axis: int = -1, epsilon: float = 1e-5 };
    /// The gradient of Softmax (or LogSoftmax when `log` = 1) over `axes`: Y, dY → dX.
    SoftmaxGrad = "SoftmaxGrad" in "shardc", Window { axes: ints, log: int = 0 };
    /// The gradient of SoftmaxCrossEntropyLoss: dLoss, scores, labels[, weights] → dScores.
    SoftmaxCrossEntropyLossGrad = "SoftmaxCrossEntropyLossGrad" in "shardc", Other { ignore_index: int, reduction: string = "mean" };
    /// The gradient of NegativeLogLikelihoodLoss: dLoss, input, target[, weights] → dInput.
    NegativeLogLikelihoodLossGrad = "NegativeLogLikelihoodLossGrad" in "shardc", Other { ignore_index: int, reduction: string = "mean" };
    /// The gradient of MoE: dY, X, ids, w, W1, W2 → dX, dw, dW1, dW2 (the products
    /// recomputed).
    MoEGrad = "MoEGrad" in "shardc", Other { activation: string = "silu", capacity_factor: float };
    /// The gradient of a plain 4-D Attention (no mask, cache, window or soft cap) as flash
    /// attention computes it: Q, K, V, dY, Y[, LSE] → dQ, dK, dV, the probabilities
    /// recomputed from each query row's log-sum-exp (`LSE [b, hq, sq]`: given, or computed
    /// here), no `s × s` tensor kept. `q_offset` and `k_offset` place the queries and keys in
    /// the sequence for the causal mask (ring attention's blocks: ir/src/ops/flash.rs).
    AttentionGrad = "AttentionGrad" in "shardc", Other { is_causal: int = 0, k_offset: int = 0, q_offset: int = 0, scale: float };
    /// The gradient of Gather with respect to its data: indices, dY → dData of `shape`,
    /// rows that several indices pick summed.
    GatherGrad = "GatherGrad" in "shardc", Shape { axis: int = 0, shape: ints };
    /// The gradient of RoiAlign with respect to X: dY, X, rois, batch_indices → dX; each
    /// output's gradient goes to the four neighbours of each of its samples by their
    /// bilinear weights (averaged), or in `max` mode to the term the forward took.
    RoiAlignGrad = "RoiAlignGrad" in "shardc", Other { coordinate_transformation_mode: string = "half_pixel", mode: string = "avg", output_height: int = 1, output_width: int = 1, sampling_ratio: int = 0, spatial_scale: float = 1.0 };
    /// The gradient of Slice: dY, starts, ends[, axes, steps] → dX of `shape` (zeros off the
    /// slice).
    SliceGrad = "SliceGrad" in "shardc", Shape { shape: ints };
    /// The gradient of a recurrent layer (`cell` LSTM, GRU or RNN, with its attributes):
    /// X, W, R, B, sequence_lens, initial_h, initial_c, P, dY, dY_h, dY_c → dX, dW, dR, dB,
    /// dinitial_h, dinitial_c, dP (back-propagation through time, the forward recomputed).
    RecurrentGrad = "RecurrentGrad" in "shardc", Recurrent { activation_alpha: floats, activation_beta: floats, activations: strings, cell: string, clip: float, direction: string = "forward", hidden_size: int, input_forget: int = 0, layout: int = 0, linear_before_reset: int = 0 };
    /// One momentum-SGD step as torch.optim.SGD: P, G, buffer, step (int64, from 1) → P',
    /// buffer'.
    SgdUpdate = "SgdUpdate" in "shardc", Other { dampening: float = 0.0, lr: float, momentum: float = 0.0, nesterov: int = 0, weight_decay: float = 0.0 };
    /// One Adam (AdamW when `decoupled` = 1) step as torch.optim: P, G, m, v, step (int64,
    /// from 1) → P', m', v'.
    AdamUpdate = "AdamUpdate" in "shardc", Other { beta1: float = 0.9, beta2: float = 0.999, decoupled: int = 0, epsilon: float = 1e-8, lr: float, weight_decay: float = 0.0 };

    // ---- communication between devices (inserted by lowering; the `shardc` domain) ----
    /// Sums (or reduces) X across the devices of `group`. Typing: Y has X's type.
    AllReduce = "AllReduce" in "shardc", Comm { group: ints, op: string = "sum" };
    /// Concatenates X from the devices of `group` along `axis`, in group order.
    /// Typing: dim `axis` multiplied by the group size.
    AllGather = "AllGather" in "shardc", Comm { axis: int, group: ints };
    /// Reduces X across `group` and keeps this device's part along `axis`.
    /// Typing: dim `axis` divided by the group size.
    ReduceScatter = "ReduceScatter" in "shardc", Comm { axis: int, group: ints, op: string = "sum" };
    /// Splits X along `split_axis` and concatenates the parts received along `concat_axis`.
    AllToAll = "AllToAll" in "shardc", Comm { concat_axis: int, group: ints, split_axis: int };
    /// Sends X to device `peer`; no outputs.
    Send = "Send" in "shardc", Comm { peer: int, tag: int = 0 };
    /// Receives a tensor of type `dtype` and `shape` from device `peer`.
    Recv = "Recv" in "shardc", Comm { dtype: int = 1, peer: int, shape: ints, tag: int = 0 };
    /// Extends X along `axis` with rows from its neighbours in `group`: `widths` =
    /// `[from_prev, from_next, to_prev, to_next]` (rows received from the previous and next
    /// member, rows sent to them). The ends of the group receive nothing from outside.
    HaloExchange = "HaloExchange" in "shardc", Comm { axis: int, group: ints, widths: ints };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_attributes_round_trip() {
        let attrs = vec![Attribute::new("transB", AttrValue::Int(1)), Attribute::new("alpha", AttrValue::Int(2))];
        let op = Op::from_parts("", "Gemm", attrs).unwrap();
        let Op::Gemm(g) = &op else { panic!("expected Gemm") };
        assert_eq!(g.alpha(), 2.0);
        assert_eq!(g.beta(), 1.0);
        assert_eq!(g.trans_b(), 1);
        let names: Vec<_> = op.attributes().into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["alpha", "transB"]);
    }

    #[test]
    fn wrong_kind_and_unknown_attribute_are_errors() {
        let err = Op::from_parts("", "Conv", vec![Attribute::new("group", AttrValue::Float(1.5))]);
        assert!(matches!(err, Err(OpError::WrongKind { .. })));
        let err = Op::from_parts("", "Relu", vec![Attribute::new("alpha", AttrValue::Float(1.5))]);
        assert!(matches!(err, Err(OpError::UnknownAttribute { .. })));
    }

    #[test]
    fn unknown_ops_are_opaque() {
        let op = Op::from_parts("com.microsoft", "FusedGemm", vec![]).unwrap();
        assert_eq!(op.op_type(), "FusedGemm");
        assert_eq!(op.domain(), "com.microsoft");
        assert_eq!(op.class(), OpClass::Other);
        let comm = Op::from_parts(SHARDC_DOMAIN, "AllReduce", vec![]).unwrap();
        assert_eq!(comm.class(), OpClass::Comm);
    }
}

/// Attributes shared by the `Reduce*` ops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReduceAttrs {
    /// Axes attribute (older opsets; newer ones take an input).
    pub axes: Option<Vec<i64>>,
    /// Keep reduced dims as 1.
    pub keepdims: bool,
    /// With no axes, do nothing instead of reducing all.
    pub noop_with_empty_axes: bool,
}

/// Window attributes shared by `MaxPool`, `AveragePool` and `LpPool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolAttrs<'a> {
    /// Kernel shape (required by ONNX; `None` when a file leaves it out).
    pub kernel_shape: Option<&'a [i64]>,
    /// Strides per spatial dim.
    pub strides: Option<&'a [i64]>,
    /// Dilations per spatial dim.
    pub dilations: Option<&'a [i64]>,
    /// Begin and end pads per spatial dim.
    pub pads: Option<&'a [i64]>,
    /// `NOTSET`, `VALID`, `SAME_UPPER` or `SAME_LOWER`.
    pub auto_pad: &'a str,
    /// Round output sizes up.
    pub ceil_mode: bool,
}

impl Op {
    /// True for the optimizer updates of a training graph (`SgdUpdate`, `AdamUpdate`): the ops
    /// that read a parameter and its gradient and make the parameter's next value.
    pub fn is_update(&self) -> bool {
        matches!(self, Op::SgdUpdate(_) | Op::AdamUpdate(_))
    }

    /// True for the ops that hold subgraphs (`If`, `Loop`, `Scan`).
    pub fn has_subgraphs(&self) -> bool {
        matches!(self, Op::If(_) | Op::Loop(_) | Op::Scan(_))
    }

    /// The subgraphs this op holds (`If`'s branches, a `Loop`'s or `Scan`'s body).
    pub fn subgraphs(&self) -> Vec<&Graph> {
        match self {
            Op::If(i) => i.then_branch.iter().chain(i.else_branch.iter()).map(|g| &**g).collect(),
            Op::Loop(l) => l.body.iter().map(|g| &**g).collect(),
            Op::Scan(s) => s.body.iter().map(|g| &**g).collect(),
            _ => Vec::new(),
        }
    }

    /// Renames, in this op's subgraphs, the values they read from enclosing graphs (see
    /// [`Graph::rename_outer_refs`]).
    pub fn rename_outer_refs(&mut self, map: &std::collections::HashMap<String, String>) -> bool {
        let graphs: Vec<&mut Box<Graph>> = match self {
            Op::If(i) => i.then_branch.iter_mut().chain(i.else_branch.iter_mut()).collect(),
            Op::Loop(l) => l.body.iter_mut().collect(),
            Op::Scan(s) => s.body.iter_mut().collect(),
            _ => Vec::new(),
        };
        let mut changed = false;
        for g in graphs {
            changed |= g.rename_outer_refs(map);
        }
        changed
    }

    /// The shared window attributes of a pooling op with a kernel.
    pub fn pool_attrs(&self) -> Option<PoolAttrs<'_>> {
        macro_rules! arms {
            ($($v:ident),*) => {
                match self {
                    $(Op::$v(p) => Some(PoolAttrs {
                        kernel_shape: p.kernel_shape.as_deref(),
                        strides: p.strides.as_deref(),
                        dilations: p.dilations.as_deref(),
                        pads: p.pads.as_deref(),
                        auto_pad: p.auto_pad(),
                        ceil_mode: p.ceil_mode() != 0,
                    }),)*
                    _ => None,
                }
            };
        }
        arms!(MaxPool, AveragePool, LpPool)
    }

    /// The shared attributes of a `Reduce*` op.
    pub fn reduce_attrs(&self) -> Option<ReduceAttrs> {
        macro_rules! arms {
            ($($v:ident),*) => {
                match self {
                    $(Op::$v(a) => Some(ReduceAttrs {
                        axes: a.axes.clone(),
                        keepdims: a.keepdims() != 0,
                        noop_with_empty_axes: a.noop_with_empty_axes() != 0,
                    }),)*
                    _ => None,
                }
            };
        }
        arms!(
            ReduceL1,
            ReduceL2,
            ReduceLogSum,
            ReduceLogSumExp,
            ReduceMax,
            ReduceMean,
            ReduceMin,
            ReduceProd,
            ReduceSum,
            ReduceSumSquare
        )
    }

    /// `(axis, keepdims, select_last_index)` of ArgMax/ArgMin.
    pub fn arg_attrs(&self) -> Option<(i64, bool, bool)> {
        match self {
            Op::ArgMax(a) => Some((a.axis(), a.keepdims() != 0, a.select_last_index() != 0)),
            Op::ArgMin(a) => Some((a.axis(), a.keepdims() != 0, a.select_last_index() != 0)),
            _ => None,
        }
    }
}
