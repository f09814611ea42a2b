//! WGSL kernels, generated per op from templates:
//!
//! - element-wise (unary, binary, ternary) with NumPy broadcasting, from an expression table;
//! - reductions over any axes, arg-max/min, softmax-family rows, layer/instance/batch norm;
//! - tiled GEMM (batched, broadcast, transposed operands, bias) for MatMul, Gemm and the
//!   input projections of recurrent layers;
//! - direct N-d convolution (strides, pads, dilations, groups), transposed convolution,
//!   max/average/Lp pooling;
//! - data movement by index tables (transpose, slice, pad, expand, tile, nearest resize,
//!   split), gather, concat;
//! - LSTM, GRU and RNN as composed kernels: one GEMM for the inputs, then one step kernel per
//!   time step.
//!
//! Every generated source is validated by naga in the unit tests (no GPU needed).

use std::sync::Arc;

use ir::attr::AttrValue;
use ir::{DType, Graph, NodeId, Op, TensorType, Value};

use super::{Elem, GpuExecutor, GpuTensor};

/// A binding of a kernel: name, element type, writable.
pub type Binding<'a> = (&'a str, Elem, bool);

/// The WGSL source of a 1-D kernel: `bindings`, then the `P: array<u32>` parameters, helper
/// `fns`, and `body` run for every `i < P[0]`.
pub fn source(bindings: &[Binding<'_>], fns: &str, body: &str) -> String {
    let mut s = String::new();
    for (k, (name, elem, write)) in bindings.iter().enumerate() {
        let access = if *write { "read_write" } else { "read" };
        s.push_str(&format!("@group(0) @binding({k}) var<storage, {access}> {name}: array<{}>;\n", elem.wgsl()));
    }
    s.push_str(&format!("@group(0) @binding({}) var<storage, read> P: array<u32>;\n", bindings.len()));
    s.push_str(fns);
    s.push_str(
        "\n@compute @workgroup_size(64)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {\n    let i = gid.x + gid.y * nwg.x * 64u;\n    if (i >= P[0]) { return; }\n",
    );
    s.push_str(body);
    s.push_str("\n}\n");
    s
}

/// Helper functions shared by the expression kernels.
pub const MATH_FNS: &str = r#"
fn erf_(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-x * x);
    return select(-y, y, x >= 0.0);
}
fn tanh_(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x));
    let t = (1.0 - e) / (1.0 + e);
    return select(-t, t, x >= 0.0);
}
fn sigmoid_(x: f32) -> f32 {
    if (x >= 0.0) { return 1.0 / (1.0 + exp(-x)); }
    let e = exp(x);
    return e / (1.0 + e);
}
fn softplus_(x: f32) -> f32 {
    return max(x, 0.0) + log(1.0 + exp(-abs(x)));
}
fn pow_(a: f32, b: f32) -> f32 {
    if (b == 0.0) { return 1.0; }
    if (a == 0.0) { return select(0.0, bitcast<f32>(0x7f800000u), b < 0.0); }
    if (a > 0.0) { return exp2(b * log2(a)); }
    if (fract(b) == 0.0) {
        let r = exp2(b * log2(-a));
        return select(r, -r, (i32(b) & 1) != 0);
    }
    return bitcast<f32>(0x7fc00000u);
}
fn isnan_(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn isinf_(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u;
}
fn round_even_(x: f32) -> f32 {
    let r = floor(x + 0.5);
    if (r - x == 0.5 && (i32(r) & 1) != 0) { return r - 1.0; }
    return r;
}
fn imod_(a: i32, b: i32) -> i32 {
    let r = a % b;
    return select(r, r + b, r != 0 && ((r < 0) != (b < 0)));
}
fn fmod_(a: f32, b: f32) -> f32 {
    return a - b * trunc(a / b);
}
"#;

pub(crate) fn f32_lit(x: f64) -> String {
    let v = x as f32;
    if v.is_nan() {
        "bitcast<f32>(0x7fc00000u)".into()
    } else if v.is_infinite() {
        if v > 0.0 { "bitcast<f32>(0x7f800000u)".into() } else { "bitcast<f32>(0xff800000u)".into() }
    } else {
        format!("bitcast<f32>({}u)", v.to_bits())
    }
}

pub(crate) fn attr_f(op: &Op, name: &str, default: f64) -> f64 {
    op.attributes()
        .into_iter()
        .find(|a| a.name == name)
        .and_then(|a| match a.value {
            AttrValue::Float(v) => Some(v as f64),
            AttrValue::Int(v) => Some(v as f64),
            _ => None,
        })
        .unwrap_or(default)
}

pub(crate) fn attr_i(op: &Op, name: &str, default: i64) -> i64 {
    op.attributes()
        .into_iter()
        .find(|a| a.name == name)
        .and_then(|a| if let AttrValue::Int(v) = a.value { Some(v) } else { None })
        .unwrap_or(default)
}

pub(crate) fn attr_is(op: &Op, name: &str) -> Option<Vec<i64>> {
    op.attributes()
        .into_iter()
        .find(|a| a.name == name)
        .and_then(|a| if let AttrValue::Ints(v) = a.value { Some(v) } else { None })
}

pub(crate) fn attr_s(op: &Op, name: &str, default: &str) -> String {
    op.attributes()
        .into_iter()
        .find(|a| a.name == name)
        .and_then(|a| if let AttrValue::String(v) = a.value { Some(v) } else { None })
        .unwrap_or_else(|| default.to_string())
}

/// Element-wise expression of a unary op on `a` (elem `e`), producing elem `out`.
pub fn unary_expr(op: &Op, e: Elem) -> Option<String> {
    let f = e == Elem::F32;
    let x = "a";
    Some(match (op, f) {
        (Op::Relu(_), true) => format!("max({x}, 0.0)"),
        (Op::Relu(_), false) => format!("max({x}, 0)"),
        (Op::Sigmoid(_), true) => format!("sigmoid_({x})"),
        (Op::Tanh(_), true) => format!("tanh_({x})"),
        (Op::Exp(_), true) => format!("exp({x})"),
        (Op::Log(_), true) => format!("log({x})"),
        (Op::Sqrt(_), true) => format!("sqrt({x})"),
        (Op::Abs(_), _) => format!("abs({x})"),
        (Op::Neg(_), _) => format!("-{x}"),
        (Op::Reciprocal(_), true) => format!("1.0 / {x}"),
        (Op::Floor(_), true) => format!("floor({x})"),
        (Op::Ceil(_), true) => format!("ceil({x})"),
        (Op::Round(_), true) => format!("round_even_({x})"),
        (Op::Sin(_), true) => format!("sin({x})"),
        (Op::Cos(_), true) => format!("cos({x})"),
        (Op::Tan(_), true) => format!("tan({x})"),
        (Op::Asin(_), true) => format!("asin({x})"),
        (Op::Acos(_), true) => format!("acos({x})"),
        (Op::Atan(_), true) => format!("atan({x})"),
        (Op::Sinh(_), true) => format!("sinh({x})"),
        (Op::Cosh(_), true) => format!("cosh({x})"),
        (Op::Asinh(_), true) => format!("asinh({x})"),
        (Op::Acosh(_), true) => format!("acosh({x})"),
        (Op::Atanh(_), true) => format!("atanh({x})"),
        (Op::Erf(_), true) => format!("erf_({x})"),
        (Op::Sign(_), true) => format!("sign({x})"),
        (Op::Sign(_), false) => format!("sign({x})"),
        (Op::Softplus(_), true) => format!("softplus_({x})"),
        (Op::Softsign(_), true) => format!("{x} / (1.0 + abs({x}))"),
        (Op::Elu(_), true) => {
            let al = f32_lit(attr_f(op, "alpha", 1.0));
            format!("select({al} * (exp({x}) - 1.0), {x}, {x} >= 0.0)")
        }
        (Op::Celu(_), true) => {
            let al = attr_f(op, "alpha", 1.0);
            format!("max(0.0, {x}) + min(0.0, {} * (exp({x} / {}) - 1.0))", f32_lit(al), f32_lit(al))
        }
        (Op::Selu(_), true) => {
            let al = f32_lit(attr_f(op, "alpha", 1.673_263_192_176_818_8));
            let ga = f32_lit(attr_f(op, "gamma", 1.050_701_022_148_132_3));
            format!("{ga} * select({al} * (exp({x}) - 1.0), {x}, {x} > 0.0)")
        }
        (Op::LeakyRelu(_), true) => format!("select({} * {x}, {x}, {x} >= 0.0)", f32_lit(attr_f(op, "alpha", 0.01))),
        (Op::ThresholdedRelu(_), true) => format!("select(0.0, {x}, {x} > {})", f32_lit(attr_f(op, "alpha", 1.0))),
        (Op::HardSigmoid(_), true) => format!(
            "clamp({} * {x} + {}, 0.0, 1.0)",
            f32_lit(attr_f(op, "alpha", 0.2)),
            f32_lit(attr_f(op, "beta", 0.5))
        ),
        (Op::HardSwish(_), true) => format!("{x} * clamp({x} / 6.0 + 0.5, 0.0, 1.0)"),
        (Op::Mish(_), true) => format!("{x} * tanh_(softplus_({x}))"),
        (Op::IsNaN(_), true) => format!("select(0, 1, isnan_({x}))"),
        (Op::IsInf(_), true) => {
            let pos = attr_i(op, "detect_positive", 1) != 0;
            let neg = attr_i(op, "detect_negative", 1) != 0;
            format!("select(0, 1, isinf_({x}) && (({x} > 0.0 && {pos}) || ({x} < 0.0 && {neg})))")
        }
        (Op::Not(_), false) => format!("1 - {x}"),
        (Op::Identity(_) | Op::Dropout(_), _) => x.to_string(),
        _ => return None,
    })
}

/// Element-wise expression of a binary op on `a`, `b` (elem `e`).
pub fn binary_expr(op: &Op, e: Elem) -> Option<String> {
    let f = e == Elem::F32;
    let cmp = |c: &str| format!("select(0, 1, a {c} b)");
    Some(match op {
        Op::Add(_) | Op::Sum(_) => "a + b".into(),
        Op::Sub(_) => "a - b".into(),
        Op::Mul(_) => "a * b".into(),
        Op::Div(_) => "a / b".into(),
        Op::Pow(_) if f => "pow_(a, b)".into(),
        Op::Max(_) => "max(a, b)".into(),
        Op::Min(_) => "min(a, b)".into(),
        Op::Mod(_) => {
            if attr_i(op, "fmod", 0) != 0 {
                if f { "fmod_(a, b)".into() } else { "a % b".into() }
            } else if f {
                "a - b * floor(a / b)".into()
            } else {
                "imod_(a, b)".into()
            }
        }
        Op::PRelu(_) if f => "select(a * b, a, a >= 0.0)".into(),
        Op::Equal(_) => cmp("=="),
        Op::Less(_) => cmp("<"),
        Op::LessOrEqual(_) => cmp("<="),
        Op::Greater(_) => cmp(">"),
        Op::GreaterOrEqual(_) => cmp(">="),
        Op::And(_) if !f => "a & b".into(),
        Op::Or(_) if !f => "a | b".into(),
        Op::Xor(_) if !f => "a ^ b".into(),
        _ => return None,
    })
}

/// Broadcast strides of `shape` against `out` (right-aligned; 0 where broadcast).
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<u32> {
    let r = out.len();
    let mut st = vec![0u32; r];
    let mut acc = 1usize;
    for t in (0..shape.len()).rev() {
        let d = t + r - shape.len();
        st[d] = if shape[t] == 1 && out[d] != 1 { 0 } else { acc as u32 };
        acc *= shape[t];
    }
    st
}

/// Bakes the parameters of one launch into a kernel's source: every `P[k]` with a literal
/// `k ≥ 1` becomes the literal `params[k]` (the driver then divides by constants). `P[0]`,
/// the invocation count, stays a read so the binding stays in use. Each distinct shape then
/// compiles its own pipeline, once per executor.
pub fn specialize(src: &str, params: &[u32]) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let mut last = 0;
    while i + 2 < b.len() {
        if b[i] == b'P' && b[i + 1] == b'[' && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) {
            let mut j = i + 2;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            if j > i + 2 && j < b.len() && b[j] == b']' {
                let k: usize = src[i + 2..j].parse().unwrap_or(0);
                if k >= 1 && k < params.len() {
                    out.push_str(&src[last..i]);
                    out.push_str(&format!("{}u", params[k]));
                    i = j + 1;
                    last = i;
                    continue;
                }
            }
        }
        i += 1;
    }
    out.push_str(&src[last..]);
    out
}

/// Merges adjacent dims of an index space that every operand walks contiguously
/// (`stride[d] == stride[d+1] · shape[d+1]` for all operands, or `keep[d]` false for none),
/// dropping size-1 dims. Returns the merged shape and per-operand strides.
pub fn merge_dims(shape: &[usize], strides: &[Vec<u32>], keep: &[bool]) -> (Vec<usize>, Vec<Vec<u32>>) {
    let mut ms: Vec<usize> = Vec::new();
    let mut mst: Vec<Vec<u32>> = vec![Vec::new(); strides.len()];
    let mut last_kept = false;
    for d in 0..shape.len() {
        if shape[d] == 1 && !keep[d] {
            continue;
        }
        let mergeable = !ms.is_empty()
            && !keep[d]
            && !last_kept
            && strides.iter().enumerate().all(|(k, st)| mst[k].last().copied() == Some(st[d] * shape[d] as u32));
        if mergeable {
            *ms.last_mut().expect("a dim") *= shape[d];
            for (k, st) in strides.iter().enumerate() {
                *mst[k].last_mut().expect("a dim") = st[d];
            }
        } else {
            ms.push(shape[d]);
            for (k, st) in strides.iter().enumerate() {
                mst[k].push(st[d]);
            }
        }
        last_kept = keep[d];
    }
    (ms, mst)
}

/// WGSL that splits the flat index `i` into the coordinates of `shape` with literal sizes
/// (divisions by constants compile to multiplications) and sums `o{k} += c · strides[k][d]`
/// for each operand `k`; `coord(d, c)` may replace a coordinate expression (for tables).
pub fn unrolled_offsets(shape: &[usize], strides: &[Vec<u32>], coord: &dyn Fn(usize, &str) -> String) -> String {
    let mut b = String::from("    var rem = i;\n");
    for k in 0..strides.len() {
        b.push_str(&format!("    var o{k} = 0u;\n"));
    }
    for d in (0..shape.len()).rev() {
        let c = format!("c{d}");
        if d == 0 {
            b.push_str(&format!("    let {c} = rem;\n"));
        } else {
            b.push_str(&format!("    let {c} = rem % {}u; rem = rem / {}u;\n", shape[d], shape[d]));
        }
        let ce = coord(d, &c);
        for (k, st) in strides.iter().enumerate() {
            match st[d] {
                0 => {}
                1 => b.push_str(&format!("    o{k} = o{k} + {ce};\n")),
                v => b.push_str(&format!("    o{k} = o{k} + {ce} * {v}u;\n")),
            }
        }
    }
    b
}

/// How an element-wise kernel reads one input.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// The input has the output's shape: element `i`.
    Flat,
    /// One element, broadcast.
    Scalar,
    /// Broadcast through per-dim strides in `P`.
    Strided,
}

impl Access {
    /// How an input of `shape` is read for an output of `out`.
    pub fn of(shape: &[usize], out: &[usize]) -> Access {
        if shape == out {
            Access::Flat
        } else if shape.iter().product::<usize>() == 1 {
            Access::Scalar
        } else {
            Access::Strided
        }
    }
}

/// Source of an element-wise kernel over inputs of elems `ins` read as `access`, writing
/// `out`; strided inputs walk `strides[k]` over the output `shape`, baked into the source.
/// `P = [count]`.
pub fn elementwise_src(
    ins: &[Elem],
    access: &[Access],
    shape: &[usize],
    strides: &[Vec<u32>],
    out: Elem,
    expr: &str,
) -> String {
    let names = ["A", "B", "C"];
    let vars = ["a", "b", "c"];
    let mut bindings: Vec<Binding<'_>> = ins.iter().enumerate().map(|(k, e)| (names[k], *e, false)).collect();
    bindings.push(("Y", out, true));
    let n = ins.len();
    let strided: Vec<usize> = (0..n).filter(|&k| access[k] == Access::Strided).collect();
    let mut body = String::new();
    if !strided.is_empty() {
        let st: Vec<Vec<u32>> = strided.iter().map(|&k| strides[k].clone()).collect();
        let (ms, mst) = merge_dims(shape, &st, &vec![false; shape.len()]);
        body.push_str(&unrolled_offsets(&ms, &mst, &|_, c| c.to_string()));
    }
    for k in 0..n {
        let index = match access[k] {
            Access::Flat => "i".to_string(),
            Access::Scalar => "0u".to_string(),
            Access::Strided => format!("o{}", strided.iter().position(|&j| j == k).expect("strided")),
        };
        body.push_str(&format!("    let {} = {}[{index}];\n", vars[k], names[k]));
    }
    body.push_str(&format!("    Y[i] = {expr};\n"));
    source(&bindings, MATH_FNS, &body)
}

fn out_of(g: &Graph, n: NodeId, slot: usize) -> Option<(Vec<usize>, DType)> {
    let t = g.tensor_type(Value::new(n, slot as u16))?;
    let d = t.static_dims()?;
    Some((d.into_iter().map(|x| x as usize).collect(), t.dtype))
}

fn elementwise(
    e: &mut GpuExecutor,
    ins: &[&GpuTensor],
    shape: Vec<usize>,
    dtype: DType,
    expr: &str,
) -> Result<GpuTensor, String> {
    let out = e.output(shape.clone(), dtype);
    let count = out.numel();
    let elems: Vec<Elem> = ins.iter().map(|t| t.elem()).collect();
    let access: Vec<Access> = ins.iter().map(|t| Access::of(&t.shape, &shape)).collect();
    let strides: Vec<Vec<u32>> = ins.iter().map(|t| broadcast_strides(&t.shape, &shape)).collect();
    let src = elementwise_src(&elems, &access, &shape, &strides, out.elem(), expr);
    let params = vec![count as u32];
    let mut bufs: Vec<&wgpu::Buffer> = ins.iter().map(|t| t.buf.as_ref()).collect();
    bufs.push(out.buf.as_ref());
    e.launch(&src, &bufs, &params, GpuExecutor::groups(count))?;
    Ok(out)
}

/// `Where` over the bindings A (condition), B (x), C (y).
const WHERE_EXPR: &str = "select(c, b, a != 0)";

/// `Clip` of `a` (elem `e`) to `[lo, hi]`.
fn clip_expr(e: Elem, lo: f64, hi: f64) -> String {
    if e == Elem::F32 {
        format!("min(max(a, {}), {})", f32_lit(lo), f32_lit(hi))
    } else {
        format!("min(max(a, {}), {})", lo.max(i32::MIN as f64) as i32, hi.min(i32::MAX as f64) as i32)
    }
}

/// A cast between element types as an expression on `a`.
fn cast_expr(from: DType, to: DType) -> String {
    match (Elem::of(from), Elem::of(to), to == DType::Bool) {
        (Elem::F32, Elem::F32, _) => "a".into(),
        (Elem::F32, Elem::I32, true) => "select(0, 1, a != 0.0)".into(),
        (Elem::F32, Elem::I32, false) => "i32(clamp(trunc(a), -2147483648.0, 2147483520.0))".into(),
        (Elem::I32, Elem::F32, _) => "f32(a)".into(),
        (Elem::I32, Elem::I32, true) => "select(0, 1, a != 0)".into(),
        (Elem::I32, Elem::I32, false) => "a".into(),
    }
}

/// Runs `n` on the device, or `None` when no kernel covers it (the caller runs it on the host).
pub fn run(
    e: &mut GpuExecutor,
    g: &Graph,
    n: NodeId,
    ins: &[Option<&GpuTensor>],
) -> Result<Option<Vec<GpuTensor>>, String> {
    let node = g.node(n);
    let op = &node.op;
    let Some((oshape, odt)) = out_of(g, n, 0) else { return Ok(None) };
    let inp = |k: usize| ins.get(k).copied().flatten();
    let x = inp(0);
    // Views: no kernel at all.
    if matches!(op, Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_) | Op::Identity(_))
        || matches!(op, Op::Dropout(_) if node.num_outputs() == 1 || node.outputs()[1..].iter().all(|o| o.name.is_empty()))
    {
        let Some(x) = x else { return Ok(None) };
        return Ok(Some(vec![GpuExecutor::view(x, oshape)]));
    }
    // Inference dropout with its mask: the input, and a mask of ones.
    if let Op::Dropout(_) = op
        && let Some(x) = x
    {
        let training = match inp(2) {
            Some(t) => e.ints(t)?.first().copied().unwrap_or(0) != 0,
            None => false,
        };
        if training {
            return Ok(None);
        }
        let mut outs = vec![GpuExecutor::view(x, oshape.clone())];
        if node.num_outputs() > 1 {
            let (mshape, mdt) = out_of(g, n, 1).unwrap_or((oshape.clone(), DType::Bool));
            let ones = e.output(mshape.clone(), mdt);
            let filled = elementwise(e, &[x], mshape, mdt, "1")?;
            let _ = ones;
            outs.push(filled);
        }
        return Ok(Some(outs));
    }
    // Element-wise.
    if let Some(x) = x
        && ins.len() == 1
        && let Some(expr) = unary_expr(op, x.elem())
        && Elem::of(odt)
            == match op {
                Op::IsNaN(_) | Op::IsInf(_) => Elem::I32,
                _ => x.elem(),
            }
    {
        return Ok(Some(vec![elementwise(e, &[x], oshape, odt, &expr)?]));
    }
    match op {
        Op::Cast(_) | Op::CastLike(_) => {
            let Some(x) = x else { return Ok(None) };
            if matches!(odt, DType::String) || matches!(x.dtype, DType::String) {
                return Ok(None);
            }
            let expr = cast_expr(x.dtype, odt);
            return Ok(Some(vec![elementwise(e, &[x], oshape, odt, &expr)?]));
        }
        Op::Clip(_) => {
            let Some(x) = x else { return Ok(None) };
            let (mut lo, mut hi) = (attr_f(op, "min", f64::NEG_INFINITY), attr_f(op, "max", f64::INFINITY));
            if let Some(t) = inp(1) {
                lo = e.floats(t)?.first().copied().unwrap_or(lo);
            }
            if let Some(t) = inp(2) {
                hi = e.floats(t)?.first().copied().unwrap_or(hi);
            }
            let expr = clip_expr(x.elem(), lo, hi);
            return Ok(Some(vec![elementwise(e, &[x], oshape, odt, &expr)?]));
        }
        Op::Where(_) => {
            let (Some(c), Some(a), Some(b)) = (inp(0), inp(1), inp(2)) else { return Ok(None) };
            // Bindings are A (cond), B (x), C (y): select(y, x, cond).
            let out = elementwise(e, &[c, a, b], oshape, odt, WHERE_EXPR)?;
            return Ok(Some(vec![out]));
        }
        Op::Add(_)
        | Op::Sub(_)
        | Op::Mul(_)
        | Op::Div(_)
        | Op::Pow(_)
        | Op::Mod(_)
        | Op::PRelu(_)
        | Op::Equal(_)
        | Op::Less(_)
        | Op::LessOrEqual(_)
        | Op::Greater(_)
        | Op::GreaterOrEqual(_)
        | Op::And(_)
        | Op::Or(_)
        | Op::Xor(_) => {
            let (Some(a), Some(b)) = (inp(0), inp(1)) else { return Ok(None) };
            if a.elem() != b.elem() {
                return Ok(None);
            }
            let Some(expr) = binary_expr(op, a.elem()) else { return Ok(None) };
            return Ok(Some(vec![elementwise(e, &[a, b], oshape, odt, &expr)?]));
        }
        Op::Sum(_) | Op::Max(_) | Op::Min(_) | Op::Mean(_) => {
            let all: Vec<&GpuTensor> = ins.iter().flatten().copied().collect();
            let Some(first) = all.first() else { return Ok(None) };
            if all.iter().any(|t| t.elem() != first.elem()) {
                return Ok(None);
            }
            let fold = if matches!(op, Op::Mean(_)) { Op::Sum(Default::default()) } else { op.clone() };
            let Some(expr) = binary_expr(&fold, first.elem()) else { return Ok(None) };
            let mut acc = if all.len() == 1 {
                elementwise(e, &[all[0]], oshape.clone(), odt, "a")?
            } else {
                elementwise(e, &[all[0], all[1]], oshape.clone(), odt, &expr)?
            };
            for t in &all[2.min(all.len())..] {
                acc = elementwise(e, &[&acc, t], oshape.clone(), odt, &expr)?;
            }
            if matches!(op, Op::Mean(_)) {
                let k = f32_lit(1.0 / all.len() as f64);
                acc = elementwise(e, &[&acc], oshape, odt, &format!("a * {k}"))?;
            }
            return Ok(Some(vec![acc]));
        }
        _ => {}
    }
    super::kernels_nn::run_nn(e, g, n, ins, oshape, odt)
}

/// Parameters of a tensor's row-major strides.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Keeps `Arc` in use for views created by the nn kernels.
pub fn share(b: &Arc<wgpu::Buffer>) -> Arc<wgpu::Buffer> {
    b.clone()
}

/// Static dims of a value in the local graph.
pub fn dims(g: &Graph, v: Value) -> Option<Vec<usize>> {
    g.tensor_type(v).and_then(TensorType::static_dims).map(|d| d.into_iter().map(|x| x as usize).collect())
}

pub(crate) use {attr_f as float_attr, attr_i as int_attr, attr_is as ints_attr, attr_s as str_attr};

#[cfg(test)]
mod specialize_tests {
    #[test]
    fn literal_parameter_reads_become_constants() {
        let src = "if (i >= P[0]) { return; } let a = P[1] + P[12]; let b = P[2u + d]; let c = TMP[1]; let d = P[40];";
        let p: Vec<u32> = (0..20).map(|k| 100 + k).collect();
        assert_eq!(
            super::specialize(src, &p),
            "if (i >= P[0]) { return; } let a = 101u + 112u; let b = P[2u + d]; let c = TMP[1]; let d = P[40];"
        );
    }
}

/// Every kernel source the runtime can generate, compiled and validated by naga (no GPU
/// needed): element-wise kernels for every op type with every element type and broadcast,
/// and every fixed kernel with its variants and specialised parameters.
#[cfg(test)]
mod naga_validation {
    use super::super::kernels_nn::*;
    use super::*;

    fn validate(what: &str, src: &str) {
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{what}: WGSL does not parse: {}\n{src}", e.emit_to_string(src)));
        naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::default())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{what}: WGSL does not validate: {}\n{src}", e.emit_to_string(src)));
    }

    const ELEMS: [Elem; 2] = [Elem::F32, Elem::I32];

    /// Output `[2, 3, 4]` with inputs read flat, as a scalar, and broadcast from `[3, 1]`.
    fn accesses() -> Vec<(Access, Vec<u32>)> {
        let shape = [2, 3, 4];
        vec![
            (Access::Flat, broadcast_strides(&shape, &shape)),
            (Access::Scalar, broadcast_strides(&[1], &shape)),
            (Access::Strided, broadcast_strides(&[3, 1], &shape)),
        ]
    }

    fn ops() -> Vec<Op> {
        let mut v: Vec<Op> =
            Op::known_op_types().iter().filter_map(|(d, t)| Op::from_parts(d, t, Vec::new()).ok()).collect();
        let int = |name: &str, i: i64| ir::Attribute { name: name.into(), value: ir::AttrValue::Int(i) };
        v.push(Op::from_parts("", "Mod", vec![int("fmod", 1)]).expect("Mod"));
        v.push(Op::from_parts("", "IsInf", vec![int("detect_negative", 0)]).expect("IsInf"));
        v
    }

    #[test]
    fn every_elementwise_kernel_validates() {
        let shape = [2, 3, 4];
        let mut n = 0;
        for op in ops() {
            for e in ELEMS {
                if let Some(expr) = unary_expr(&op, e) {
                    let out = if matches!(op, Op::IsNaN(_) | Op::IsInf(_)) { Elem::I32 } else { e };
                    for (acc, st) in accesses() {
                        validate(&format!("{op:?} {e:?}"), &elementwise_src(&[e], &[acc], &shape, &[st], out, &expr));
                        n += 1;
                    }
                }
                if let Some(expr) = binary_expr(&op, e) {
                    let cmp = matches!(
                        op,
                        Op::Equal(_) | Op::Less(_) | Op::LessOrEqual(_) | Op::Greater(_) | Op::GreaterOrEqual(_)
                    );
                    let out = if cmp { Elem::I32 } else { e };
                    for (a, sa) in accesses() {
                        for (b, sb) in accesses() {
                            let src = elementwise_src(&[e, e], &[a, b], &shape, &[sa.clone(), sb], out, &expr);
                            validate(&format!("{op:?} {e:?} {a:?}·{b:?}"), &src);
                            n += 1;
                        }
                    }
                }
            }
        }
        for from in [ir::DType::Float, ir::DType::Int64, ir::DType::Int32, ir::DType::Bool] {
            for to in [ir::DType::Float, ir::DType::Int64, ir::DType::Int32, ir::DType::Bool] {
                let (fe, te) = (Elem::of(from), Elem::of(to));
                let src = elementwise_src(&[fe], &[Access::Flat], &shape, &[vec![]], te, &cast_expr(from, to));
                validate(&format!("Cast {from:?}→{to:?}"), &src);
                n += 1;
            }
        }
        for e in ELEMS {
            validate("Clip", &elementwise_src(&[e], &[Access::Flat], &shape, &[vec![]], e, &clip_expr(e, -1.5, 6.0)));
            let (acc, st): (Vec<Access>, Vec<Vec<u32>>) = accesses().into_iter().unzip();
            validate("Where", &elementwise_src(&[Elem::I32, e, e], &acc, &shape, &st, e, WHERE_EXPR));
            n += 2;
        }
        assert!(n > 300, "{n} element-wise kernels");
    }

    #[test]
    fn every_fixed_kernel_validates() {
        let reds = [
            Red::Sum,
            Red::Mean,
            Red::Max,
            Red::Min,
            Red::Prod,
            Red::L1,
            Red::L2,
            Red::SumSquare,
            Red::LogSum,
            Red::LogSumExp,
            Red::ArgMax,
            Red::ArgMin,
        ];
        for red in reds {
            for xe in ELEMS {
                let ye = if matches!(red, Red::ArgMax | Red::ArgMin) { Elem::I32 } else { xe };
                validate(&format!("reduce {red:?} {xe:?}"), &reduce_src(red, xe, ye));
            }
        }
        for kind in ["", "log", "hard"] {
            validate(&format!("softmax {kind}"), &softmax_src(kind));
        }
        for (bias, stats) in [(false, false), (true, false), (false, true), (true, true)] {
            validate("layernorm", &layernorm_src(bias, stats));
        }
        validate("batchnorm", &batchnorm_src());
        validate("instancenorm", &instancenorm_src());
        for c in [false, true] {
            validate("gemm", &gemm_src(c));
            validate("gemm_rt", &gemm_rt_src(c));
            validate("conv", &conv_src(c));
            validate("conv_transpose", &conv_transpose_src(c));
        }
        for kind in ["max", "avg", "lp"] {
            validate(&format!("pool {kind}"), &pool_src(kind));
        }
        for wide in [false, true] {
            validate("im2col", &im2col_src(wide));
        }
        for e in ELEMS {
            validate("gather", &gather_src(e));
            validate("place", &place_src(e));
            // A transpose, and a pad/slice through a table with an out-of-range pad value.
            validate("remap", &remap_src(e, &[4, 3, 2], &[1, 8, 4], &[None, None, None], 0));
            validate("remap table", &remap_src(e, &[5, 3], &[3, 1], &[Some(1), None], (-1i32) as u32));
        }
        validate("lstm", &lstm_step_src());
        validate("gru gates", &gru_gates_src());
        validate("gru state", &gru_state_src());
        validate("rnn", &rnn_step_src());
    }

    #[test]
    fn specialised_kernels_validate() {
        // Conv / ConvTranspose / im2col / pooling with their parameters baked in, as launched.
        let mut p: Vec<u32> = vec![2 * 8 * 5 * 5, 2, 4, 8, 2];
        for v in [[1, 5, 5], [1, 5, 5], [1, 3, 3], [1, 1, 1], [1, 1, 1], [0, 1, 1]] {
            p.extend(v);
        }
        validate("conv specialised", &specialize(&conv_src(true), &p));
        validate("conv_transpose specialised", &specialize(&conv_transpose_src(false), &p));
        let mut q: Vec<u32> = vec![2 * 2 * 18, 4, 2];
        q.extend_from_slice(&p[5..]);
        validate("im2col specialised", &specialize(&im2col_src(true), &q));
        // [count, NC, C, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW,
        //  PED, PEH, PEW, count_include_pad, p]
        let pool: Vec<u32> =
            vec![2 * 4 * 4 * 4, 8, 4, 1, 8, 8, 1, 4, 4, 1, 3, 3, 1, 2, 2, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 2];
        for kind in ["max", "avg", "lp"] {
            validate("pool specialised", &specialize(&pool_src(kind), &pool));
        }
    }
}
