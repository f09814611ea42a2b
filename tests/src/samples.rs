//! One small graph per op type the IR knows: the samples the completeness test, the kernel
//! checks and the gradient checks run every op on.
//!
//! Each sample is an ONNX text model; graph inputs are floats (the tests draw them in
//! `[0.1, 0.9]`), integer and boolean operands are initializers so indices stay in range.

/// Unary element-wise ops sampled as `y = Op (x)` on `float[2,3,4] x`.
const UNARY: &[&str] = &[
    "Abs",
    "Swish",
    "Acos",
    "Asin",
    "Asinh",
    "Atan",
    "Atanh",
    "Ceil",
    "Celu",
    "Cos",
    "Cosh",
    "Elu",
    "Erf",
    "Exp",
    "Floor",
    "Gelu",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "IsInf",
    "IsNaN",
    "LeakyRelu",
    "Log",
    "Mish",
    "Neg",
    "Reciprocal",
    "Relu",
    "Round",
    "Selu",
    "Shrink",
    "Sigmoid",
    "Sign",
    "Sin",
    "Sinh",
    "Softplus",
    "Softsign",
    "Sqrt",
    "Tan",
    "Tanh",
    "ThresholdedRelu",
];

/// Binary float ops sampled as `y = Op (a, b)` on `float[2,3,4] a`, `float[3,4] b`.
const BINARY: &[&str] =
    &["Add", "Sub", "Mul", "Div", "Pow", "PRelu", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"];

/// Reductions sampled over axis 1 given as an input.
const REDUCE: &[&str] = &[
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
];

/// One sample: the op type it is for, and the model text.
pub struct Sample {
    /// The op type sampled.
    pub op: &'static str,
    /// The model, in ONNX text.
    pub text: String,
}

fn model(inputs: &str, outputs: &str, inits: &str, body: &str) -> String {
    let inits = if inits.is_empty() { String::new() } else { format!("\n<{inits}>") };
    format!(
        "<\n   ir_version: 8,\n   opset_import: [\"\" : 18, \"shardc\" : 1]\n>\nsample ({inputs}) => ({outputs}){inits}\n{{\n{body}\n}}"
    )
}

fn s(op: &'static str, inputs: &str, outputs: &str, inits: &str, body: &str) -> Sample {
    Sample { op, text: model(inputs, outputs, inits, body) }
}

const X: &str = "float[2,3,4] x";

/// Every sample, one or more per op type.
pub fn samples() -> Vec<Sample> {
    let mut v = Vec::new();
    for &op in UNARY {
        v.push(s(op, X, "y", "", &format!("   y = {op} (x)")));
    }
    for &op in BINARY {
        v.push(s(op, "float[2,3,4] a, float[3,4] b", "y", "", &format!("   y = {op} (a, b)")));
    }
    for &op in REDUCE {
        v.push(s(op, X, "y", "int64[1] axes = {1}", &format!("   y = {op} <keepdims: int = 1> (x, axes)")));
    }
    v.extend([
        s("Acosh", X, "y", "float one = {1.5}", "   x1 = Add (x, one)\n   y = Acosh (x1)"),
        s("BitwiseNot", X, "y", "int64[3] a = {1, 2, 3}", "   y = BitwiseNot (a)"),
        s("Not", X, "y", "bool[3] a = {1, 0, 1}", "   y = Not (a)"),
        s("Cast", X, "y", "", "   y = Cast <to: int = 7> (x)"),
        s("CastLike", X, "y", "int64[1] like = {1}", "   y = CastLike (x, like)"),
        s("Clip", X, "y", "float lo = {0.25}, float hi = {0.75}", "   y = Clip (x, lo, hi)"),
        s("Dropout", X, "y, m", "", "   y, m = Dropout (x)"),
        s("Mod", "float[2,3,4] a, float[3,4] b", "y", "", "   y = Mod <fmod: int = 1> (a, b)"),
        s("And", X, "y", "bool[4] p = {1, 0, 1, 0}, bool[4] q = {1, 1, 0, 0}", "   y = And (p, q)"),
        s("Or", X, "y", "bool[4] p = {1, 0, 1, 0}, bool[4] q = {1, 1, 0, 0}", "   y = Or (p, q)"),
        s("Xor", X, "y", "bool[4] p = {1, 0, 1, 0}, bool[4] q = {1, 1, 0, 0}", "   y = Xor (p, q)"),
        s("BitwiseAnd", X, "y", "int64[3] p = {5, 6, 7}, int64[3] q = {3, 3, 3}", "   y = BitwiseAnd (p, q)"),
        s("BitwiseOr", X, "y", "int64[3] p = {5, 6, 7}, int64[3] q = {3, 3, 3}", "   y = BitwiseOr (p, q)"),
        s("BitwiseXor", X, "y", "int64[3] p = {5, 6, 7}, int64[3] q = {3, 3, 3}", "   y = BitwiseXor (p, q)"),
        s(
            "BitShift",
            X,
            "y",
            "int64[3] p = {5, 6, 7}, int64[3] q = {1, 2, 3}",
            "   y = BitShift <direction: string = \"LEFT\"> (p, q)",
        ),
        s("Max", "float[2,3,4] a, float[3,4] b", "y", "", "   y = Max (a, b, a)"),
        s("Min", "float[2,3,4] a, float[3,4] b", "y", "", "   y = Min (a, b, a)"),
        s("Sum", "float[2,3,4] a, float[3,4] b", "y", "", "   y = Sum (a, b, a)"),
        s("Mean", "float[2,3,4] a, float[3,4] b", "y", "", "   y = Mean (a, b, a)"),
        s("Where", "float[2,3,4] a, float[3,4] b", "y", "float half = {0.5}", "   c = Greater (a, half)\n   y = Where (c, a, b)"),
        s("MatMul", "float[2,3,4] a, float[4,5] w", "y", "", "   y = MatMul (a, w)"),
        s("Gemm", "float[3,4] a, float[5,4] w, float[5] c", "y", "", "   y = Gemm <transB: int = 1> (a, w, c)"),
        s("Einsum", "float[3,4] a, float[4,5] b", "y", "", "   y = Einsum <equation: string = \"ij,jk->ik\"> (a, b)"),
        s(
            "Conv",
            "float[2,3,8,8] x, float[4,3,3,3] w, float[4] b",
            "y",
            "",
            "   y = Conv <pads: ints = [1, 1, 1, 1], strides: ints = [2, 2]> (x, w, b)",
        ),
        s(
            "ConvTranspose",
            "float[2,3,5,5] x, float[3,2,3,3] w",
            "y",
            "",
            "   y = ConvTranspose <strides: ints = [2, 2], pads: ints = [1, 1, 1, 1]> (x, w)",
        ),
        s("MaxPool", "float[2,3,6,6] x", "y", "", "   y = MaxPool <kernel_shape: ints = [2, 2], strides: ints = [2, 2]> (x)"),
        s(
            "AveragePool",
            "float[2,3,6,6] x",
            "y",
            "",
            "   y = AveragePool <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (x)",
        ),
        s("LpPool", "float[2,3,6,6] x", "y", "", "   y = LpPool <kernel_shape: ints = [2, 2]> (x)"),
        s("GlobalAveragePool", "float[2,3,4,4] x", "y", "", "   y = GlobalAveragePool (x)"),
        s("GlobalMaxPool", "float[2,3,4,4] x", "y", "", "   y = GlobalMaxPool (x)"),
        s("GlobalLpPool", "float[2,3,4,4] x", "y", "", "   y = GlobalLpPool (x)"),
        s(
            "BatchNormalization",
            "float[2,3,4,4] x, float[3] s, float[3] b, float[3] m, float[3] var",
            "y",
            "",
            "   y = BatchNormalization (x, s, b, m, var)",
        ),
        s(
            "InstanceNormalization",
            "float[2,3,4,4] x, float[3] s, float[3] b",
            "y",
            "",
            "   y = InstanceNormalization (x, s, b)",
        ),
        s(
            "LayerNormalization",
            "float[2,3,4] x, float[4] s, float[4] b",
            "y, mean, inv",
            "",
            "   y, mean, inv = LayerNormalization <axis: int = -1> (x, s, b)",
        ),
        s(
            "GroupNormalization",
            "float[2,4,3,3] x, float[4] s, float[4] b",
            "y",
            "",
            "   y = GroupNormalization <num_groups: int = 2> (x, s, b)",
        ),
        s("LRN", "float[2,5,3,3] x", "y", "", "   y = LRN <size: int = 3> (x)"),
        s("LpNormalization", X, "y", "", "   y = LpNormalization <axis: int = 1> (x)"),
        s("MeanVarianceNormalization", "float[2,3,4,4] x", "y", "", "   y = MeanVarianceNormalization (x)"),
        s("Softmax", X, "y", "", "   y = Softmax <axis: int = 1> (x)"),
        s("LogSoftmax", X, "y", "", "   y = LogSoftmax (x)"),
        s("Hardmax", X, "y", "", "   y = Hardmax (x)"),
        s("ArgMax", X, "y", "", "   y = ArgMax <axis: int = 1> (x)"),
        s("ArgMin", X, "y", "", "   y = ArgMin <axis: int = 2, keepdims: int = 0> (x)"),
        s("Reshape", X, "y", "int64[2] shape = {6, 4}", "   y = Reshape (x, shape)"),
        s("Flatten", X, "y", "", "   y = Flatten <axis: int = 2> (x)"),
        s("Transpose", X, "y", "", "   y = Transpose <perm: ints = [2, 0, 1]> (x)"),
        s("Squeeze", "float[2,1,4] x", "y", "int64[1] axes = {1}", "   y = Squeeze (x, axes)"),
        s("Unsqueeze", X, "y", "int64[1] axes = {0}", "   y = Unsqueeze (x, axes)"),
        s("Concat", "float[2,3,4] a, float[2,2,4] b", "y", "", "   y = Concat <axis: int = 1> (a, b)"),
        s("Split", X, "p, q", "int64[2] split = {1, 2}", "   p, q = Split <axis: int = 1> (x, split)"),
        s(
            "Slice",
            X,
            "y",
            "int64[2] starts = {0, 1}, int64[2] ends = {2, 4}, int64[2] axes = {1, 2}",
            "   y = Slice (x, starts, ends, axes)",
        ),
        s("Gather", "float[5,4] table", "y", "int64[2,3] idx = {0, 4, 2, 1, 1, 3}", "   y = Gather (table, idx)"),
        s(
            "GatherElements",
            "float[3,4] x",
            "y",
            "int64[2,4] idx = {0, 1, 2, 0, 2, 1, 0, 1}",
            "   y = GatherElements <axis: int = 0> (x, idx)",
        ),
        s("GatherND", "float[3,4] x", "y", "int64[2,2] idx = {0, 1, 2, 3}", "   y = GatherND (x, idx)"),
        s(
            "ScatterND",
            "float[3,4] x, float[2] upd",
            "y",
            "int64[2,2] idx = {0, 1, 2, 3}",
            "   y = ScatterND (x, idx, upd)",
        ),
        s(
            "ScatterElements",
            "float[3,4] x, float[1,4] upd",
            "y",
            "int64[1,4] idx = {2, 0, 1, 2}",
            "   y = ScatterElements <axis: int = 0> (x, idx, upd)",
        ),
        s("Expand", "float[3,1] x", "y", "int64[3] shape = {2, 3, 4}", "   y = Expand (x, shape)"),
        s("Tile", X, "y", "int64[3] reps = {1, 2, 2}", "   y = Tile (x, reps)"),
        s("Pad", X, "y", "int64[6] pads = {0, 1, 0, 0, 1, 2}", "   y = Pad <mode: string = \"reflect\"> (x, pads)"),
        s(
            "Resize",
            "float[1,2,3,3] x",
            "y",
            "float[4] scales = {1, 1, 2, 2}",
            "   y = Resize <mode: string = \"nearest\"> (x, , scales)",
        ),
        s("Upsample", "float[1,2,3,3] x", "y", "float[4] scales = {1, 1, 2, 2}", "   y = Upsample (x, scales)"),
        s("DepthToSpace", "float[1,8,2,2] x", "y", "", "   y = DepthToSpace <blocksize: int = 2> (x)"),
        s("SpaceToDepth", "float[1,2,4,4] x", "y", "", "   y = SpaceToDepth <blocksize: int = 2> (x)"),
        s("Shape", X, "y", "", "   y = Shape (x)"),
        s("Size", X, "y", "", "   y = Size (x)"),
        s("Constant", X, "y", "", "   y = Constant <value: tensor = float[2] {1.5, 2.5}> ()"),
        s("ConstantOfShape", X, "y", "int64[2] shape = {2, 3}", "   y = ConstantOfShape (shape)"),
        s("Range", X, "y", "int64 a = {1}, int64 b = {9}, int64 d = {2}", "   y = Range (a, b, d)"),
        s("Trilu", "float[3,4] x", "y", "", "   y = Trilu (x)"),
        s("TopK", X, "v, i", "int64[1] k = {2}", "   v, i = TopK <axis: int = 2> (x, k)"),
        s("NonZero", X, "y", "float[5] a = {0, 1, 0, 2, 3}", "   y = NonZero (a)"),
        s(
            "OneHot",
            X,
            "y",
            "int64[3] idx = {0, 2, 1}, int64 depth = {4}, float[2] vals = {0, 1}",
            "   y = OneHot (idx, depth, vals)",
        ),
        s("CumSum", X, "y", "int64 axis = {1}", "   y = CumSum (x, axis)"),
        s("EyeLike", "float[3,4] x", "y", "", "   y = EyeLike (x)"),
        s("BitCast", X, "y", "int32[3] a = {1065353216, -1, 7}", "   y = BitCast <to: int = 1> (a)"),
        s("SwiGLU", "float[2,3,4] a, float[2,3,4] b", "y", "", "   y = SwiGLU <alpha = 1.5> (a, b)"),
        s("Det", "float[2,3,3] x", "y", "", "   y = Det (x)"),
        s("RMSNormalization", "float[2,3,4] x, float[4] sc", "y", "", "   y = RMSNormalization (x, sc)"),
        s(
            "MaxUnpool",
            "float[1,1,2,2] x",
            "y",
            "int64[1,1,2,2] i = {0, 3, 10, 13}",
            "   y = MaxUnpool <kernel_shape: ints = [2, 2], strides: ints = [2, 2]> (x, i)",
        ),
        s(
            "Attention",
            "float[2,2,3,4] q, float[2,1,5,4] k, float[2,1,5,4] v",
            "y, pk, pv, qk",
            "",
            "   y, pk, pv, qk = Attention <is_causal: int = 1, qk_matmul_output_mode: int = 3> (q, k, v)",
        ),
        s(
            "RotaryEmbedding",
            "float[2,3,2,4] x, float[3,2] c, float[3,2] sn",
            "y",
            "int64[2,3] pos = {0, 1, 2, 2, 1, 0}",
            "   y = RotaryEmbedding (x, c, sn, pos)",
        ),
        s("CumProd", X, "y", "int64 axis = {2}", "   y = CumProd <exclusive: int = 1> (x, axis)"),
        s(
            "Scatter",
            "float[3,4] x, float[1,4] upd",
            "y",
            "int64[1,4] idx = {2, 0, 1, 2}",
            "   y = Scatter <axis: int = 0> (x, idx, upd)",
        ),
        s("Compress", X, "y", "bool[3] c = {1, 0, 1}", "   y = Compress <axis: int = 1> (x, c)"),
        s("ReverseSequence", X, "y", "int64[3] lens = {2, 1, 0}", "   y = ReverseSequence <batch_axis: int = 1, time_axis: int = 0> (x, lens)"),
        s(
            "TensorScatter",
            "float[2,5,3] cache, float[2,2,3] upd",
            "y",
            "int64[2] at = {1, 3}",
            "   y = TensorScatter <axis: int = 1> (cache, upd, at)",
        ),
        s("Unique", "float[6] x", "y, i, inv, n", "float[6] a = {3, 1, 3, 2, 1, 3}", "   y, i, inv, n = Unique <sorted: int = 0> (a)"),
        s("CenterCropPad", X, "y", "int64[2] shape = {5, 2}", "   y = CenterCropPad <axes: ints = [1, 2]> (x, shape)"),
        s(
            "LSTM",
            "float[5,2,3] x, float[1,16,3] w, float[1,16,4] r, float[1,32] b",
            "y, yh, yc",
            "",
            "   y, yh, yc = LSTM <hidden_size: int = 4> (x, w, r, b)",
        ),
        s(
            "GRU",
            "float[5,2,3] x, float[1,12,3] w, float[1,12,4] r, float[1,24] b",
            "y, yh",
            "",
            "   y, yh = GRU <hidden_size: int = 4> (x, w, r, b)",
        ),
        s(
            "RNN",
            "float[5,2,3] x, float[2,4,3] w, float[2,4,4] r",
            "y, yh",
            "",
            "   y, yh = RNN <hidden_size: int = 4, direction: string = \"bidirectional\"> (x, w, r)",
        ),
        s(
            "If",
            X,
            "y",
            "bool c = {1}",
            "   y = If (c) <then_branch: graph = then () => (float[2,3,4] t) {\n      t = Relu (x)\n   }, else_branch: graph = else () => (float[2,3,4] e) {\n      e = Neg (x)\n   }>",
        ),
        s(
            "Loop",
            X,
            "y",
            "int64 n = {3}, bool c = {1}",
            "   y = Loop (n, c, x) <body: graph = body (int64 i, bool cin, float[2,3,4] acc) => (bool cout, float[2,3,4] next) {\n      cout = Identity (cin)\n      next = Add (acc, x)\n   }>",
        ),
        s(
            "Scan",
            "float[2,3,4] x, float[3,4] init",
            "last, ys",
            "",
            "   last, ys = Scan <num_scan_inputs: int = 1, body: graph = step (float[3,4] s, float[3,4] xi) => (float[3,4] sn, float[3,4] yi) {\n      sn = Add (s, xi)\n      yi = Identity (sn)\n   }> (init, x)",
        ),
        s("SoftmaxCrossEntropyLoss", "float[3,5] x", "y", "int64[3] lab = {0, 4, 2}", "   y = SoftmaxCrossEntropyLoss (x, lab)"),
        s(
            "NegativeLogLikelihoodLoss",
            "float[3,5] x",
            "y",
            "int64[3] lab = {0, 4, 2}",
            "   y = NegativeLogLikelihoodLoss <reduction: string = \"sum\"> (x, lab)",
        ),
        s(
            "ElementwiseGrad",
            "float[2,3,4] x, float[2,3,4] dy",
            "dx",
            "",
            "   y = Tanh (x)\n   dx = shardc.ElementwiseGrad <op: string = \"Tanh\"> (x, y, dy)",
        ),
        s(
            "ConvGradInput",
            "float[2,4,4,4] dy, float[4,3,3,3] w",
            "dx",
            "",
            "   dx = shardc.ConvGradInput <input_shape: ints = [2, 3, 8, 8], kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1], strides: ints = [2, 2]> (dy, w)",
        ),
        s(
            "ConvGradWeight",
            "float[2,3,8,8] x, float[2,4,4,4] dy",
            "dw",
            "",
            "   dw = shardc.ConvGradWeight <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1], strides: ints = [2, 2]> (x, dy)",
        ),
        s(
            "MaxPoolGrad",
            "float[2,3,6,6] x, float[2,3,3,3] dy",
            "dx",
            "",
            "   dx = shardc.MaxPoolGrad <kernel_shape: ints = [2, 2], strides: ints = [2, 2], pads: ints = [0, 0, 0, 0]> (x, dy)",
        ),
        s(
            "AveragePoolGrad",
            "float[2,3,6,6] dy",
            "dx",
            "",
            "   dx = shardc.AveragePoolGrad <input_shape: ints = [2, 3, 6, 6], kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (dy)",
        ),
        s(
            "BatchNormGrad",
            "float[2,3,4,4] x, float[3] s, float[3] m, float[3] var, float[2,3,4,4] dy",
            "dx, ds, db",
            "",
            "   dx, ds, db = shardc.BatchNormGrad <training_mode: int = 1> (x, s, m, var, dy)",
        ),
        s(
            "LayerNormGrad",
            "float[2,3,4] x, float[4] s, float[2,3,4] dy",
            "dx, ds, db",
            "",
            "   dx, ds, db = shardc.LayerNormGrad <axis: int = -1> (x, s, dy)",
        ),
        s(
            "SoftmaxGrad",
            "float[2,3,4] x, float[2,3,4] dy",
            "dx",
            "",
            "   y = Softmax (x)\n   dx = shardc.SoftmaxGrad <axes: ints = [2]> (y, dy)",
        ),
        s(
            "SoftmaxCrossEntropyLossGrad",
            "float dl, float[3,5] x",
            "dx",
            "int64[3] lab = {0, 4, 2}",
            "   dx = shardc.SoftmaxCrossEntropyLossGrad (dl, x, lab)",
        ),
        s(
            "NegativeLogLikelihoodLossGrad",
            "float dl, float[3,5] x",
            "dx",
            "int64[3] lab = {0, 4, 2}",
            "   dx = shardc.NegativeLogLikelihoodLossGrad (dl, x, lab)",
        ),
        s(
            "GatherGrad",
            "float[2,3,4] dy",
            "dt",
            "int64[2,3] idx = {0, 4, 2, 1, 1, 3}",
            "   dt = shardc.GatherGrad <axis: int = 0, shape: ints = [5, 4]> (idx, dy)",
        ),
        s(
            "SliceGrad",
            "float[2,2,3] dy",
            "dx",
            "int64[2] starts = {0, 1}, int64[2] ends = {2, 4}, int64[2] axes = {1, 2}",
            "   dx = shardc.SliceGrad <shape: ints = [2, 3, 4]> (dy, starts, ends, axes)",
        ),
        s(
            "RecurrentGrad",
            "float[5,2,3] x, float[1,16,3] w, float[1,16,4] r, float[1,32] b, float[5,1,2,4] dy",
            "dx, dw, dr, db, dh, dc, dp",
            "",
            "   dx, dw, dr, db, dh, dc, dp = shardc.RecurrentGrad <cell: string = \"LSTM\", hidden_size: int = 4> (x, w, r, b, , , , , dy)",
        ),
        s(
            "SgdUpdate",
            "float[2,3] p, float[2,3] g, float[2,3] buf",
            "p2, b2",
            "int64 t = {2}",
            "   p2, b2 = shardc.SgdUpdate <lr: float = 0.1, momentum: float = 0.9> (p, g, buf, t)",
        ),
        s(
            "AdamUpdate",
            "float[2,3] p, float[2,3] g, float[2,3] m, float[2,3] v",
            "p2, m2, v2",
            "int64 t = {2}",
            "   p2, m2, v2 = shardc.AdamUpdate <lr: float = 0.01> (p, g, m, v, t)",
        ),
        s("AllReduce", X, "y", "", "   y = shardc.AllReduce <group: ints = [0]> (x)"),
        s("AllGather", X, "y", "", "   y = shardc.AllGather <axis: int = 0, group: ints = [0]> (x)"),
        s("ReduceScatter", X, "y", "", "   y = shardc.ReduceScatter <axis: int = 0, group: ints = [0]> (x)"),
        s(
            "AllToAll",
            X,
            "y",
            "",
            "   y = shardc.AllToAll <concat_axis: int = 0, group: ints = [0], split_axis: int = 1> (x)",
        ),
        s(
            "HaloExchange",
            X,
            "y",
            "",
            "   y = shardc.HaloExchange <axis: int = 2, group: ints = [0], widths: ints = [0, 0, 0, 0]> (x)",
        ),
        s("Send", X, "", "", "   = shardc.Send <peer: int = 0> (x)"),
        s("Recv", X, "y", "", "   y = shardc.Recv <peer: int = 0, shape: ints = [2, 3]> ()"),
    ]);
    v
}
