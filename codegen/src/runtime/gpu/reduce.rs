//! Reductions (`Reduce*`, `ArgMax`/`ArgMin`, global average and max pooling) — one
//! invocation per output element looping over the reduced sub-box (addressed directly when
//! the reduced axes are consecutive dims, else decoded element by element) — and the softmax
//! family over rows.

use ir::op;
use ir::ops::norm_axis;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, TensorDesc, groups, nested};
use super::wgsl::{MATH_FNS, source};

/// Adds a reduction of input 0 over `axes` into output 0.
fn reduce(cx: &CompileCx<'_>, x: &TensorDesc<'_>, axes: &[usize], red: Red, last: bool) -> CompileResult {
    let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
    let ye = Elem::of(c.outputs[0].dtype);
    if matches!(red, Red::L2 | Red::LogSum | Red::LogSumExp | Red::Mean) && x.elem() != Elem::F32 {
        return Ok(None);
    }
    // Booleans reduce on the host: an empty max is false there, not the least i32.
    if x.dtype == ir::DType::Bool {
        return Ok(None);
    }
    let count: usize = c.outputs[0].shape.iter().product();
    let r = x.shape.len();
    // Reduced axes in one run of consecutive dims: X is [outer, total, inner] and each
    // element's offset is direct (same elements, same order as the general walk).
    let mut sorted = axes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if let (Some(&a), Some(&b)) = (sorted.first(), sorted.last())
        && b + 1 - a == sorted.len()
    {
        let total: usize = x.shape[a..=b].iter().product();
        let inner: usize = x.shape[b + 1..].iter().product();
        if count > 0 {
            let walks = if red == Red::LogSumExp { 2 } else { 1 };
            let params = vec![count as u32, total as u32, inner as u32, last as u32];
            let src = reduce_src_with(red, x.elem(), ye, true);
            c.launch_loop(src, vec![Buf::In(0), Buf::Out(0)], params, groups(count), walks * total as u64);
        }
        return Ok(Some(c));
    }
    let mut params = vec![count as u32, r as u32];
    params.extend(x.shape.iter().map(|&d| d as u32));
    params.extend((0..r).map(|d| axes.contains(&d) as u32));
    params.push(last as u32);
    if count > 0 {
        // The base decode, then per reduced element its offset decode (twice for
        // log-sum-exp: the maximum first).
        let total: usize = axes.iter().map(|&a| x.shape[a]).product();
        let walks = if red == Red::LogSumExp { 2 } else { 1 };
        let trips = r as u64 + walks * nested(&[total, r]);
        c.launch_loop(reduce_src(red, x.elem(), ye), vec![Buf::In(0), Buf::Out(0)], params, groups(count), trips);
    }
    Ok(Some(c))
}

/// `Reduce*`: `Name: kind`. The axes come from the attribute or the second input.
macro_rules! reduce_kernels {
    ($($name:ident: $red:expr;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let Some(x) = cx.input(0) else { return Ok(None) };
                let r = x.shape.len();
                let list = match cx.input(1) {
                    Some(t) => Some(t.ints().ok_or("reduction axes unknown")?),
                    None => self.axes.clone(),
                };
                let axes: Vec<usize> = match list {
                    Some(l) if !l.is_empty() => l.iter().map(|&a| norm_axis(a, r)).collect::<Result<_, _>>()?,
                    _ if self.noop_with_empty_axes() != 0 => return Ok(Compiled::view(cx)),
                    _ => (0..r).collect(),
                };
                // Over axes of extent 1 a sum, mean, max, min or product is its input: a view
                // (`ir::ops::reduce::single_element_axes`, which the cost model prices as one).
                if ir::ops::reduce::keeps_single_elements(&ir::Op::$name(self.clone()))
                    && axes.iter().all(|&a| x.shape[a] == 1)
                {
                    return Ok(Compiled::view(cx));
                }
                reduce(cx, x, &axes, $red, false)
            }

            fn value_inputs(&self) -> &'static [usize] {
                &[1]
            }
        }
    )*};
}

reduce_kernels! {
    ReduceSum: Red::Sum;
    ReduceMean: Red::Mean;
    ReduceMax: Red::Max;
    ReduceMin: Red::Min;
    ReduceProd: Red::Prod;
    ReduceL1: Red::L1;
    ReduceL2: Red::L2;
    ReduceSumSquare: Red::SumSquare;
    ReduceLogSum: Red::LogSum;
    ReduceLogSumExp: Red::LogSumExp;
}

/// `ArgMax`/`ArgMin`: `Name: kind`.
macro_rules! arg_kernels {
    ($($name:ident: $red:expr;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let Some(x) = cx.input(0) else { return Ok(None) };
                let a = norm_axis(self.axis(), x.shape.len())?;
                reduce(cx, x, &[a], $red, self.select_last_index() != 0)
            }
        }
    )*};
}

arg_kernels! {
    ArgMax: Red::ArgMax;
    ArgMin: Red::ArgMin;
}

/// Global pools reduce every spatial dim: `Name: kind`.
macro_rules! global_kernels {
    ($($name:ident: $red:expr;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let Some(x) = cx.input(0) else { return Ok(None) };
                reduce(cx, x, &(2..x.shape.len()).collect::<Vec<_>>(), $red, false)
            }
        }
    )*};
}

global_kernels! {
    GlobalAveragePool: Red::Mean;
    GlobalMaxPool: Red::Max;
}

/// Softmax-family rows: `Name: kind`.
macro_rules! softmax_kernels {
    ($($name:ident: $kind:literal;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let Some(x) = cx.input(0) else { return Ok(None) };
                if x.elem() != Elem::F32 {
                    return Ok(None);
                }
                let r = x.shape.len();
                let legacy = cx.opset < 13;
                let a = norm_axis(self.axis.unwrap_or(if legacy { 1 } else { -1 }), r)?;
                let (len, inner) =
                    if legacy { (x.shape[a..].iter().product::<usize>(), 1) } else { (x.shape[a], x.shape[a + 1..].iter().product()) };
                let rows = x.numel() / len.max(1);
                let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
                if rows > 0 {
                    let p = vec![rows as u32, len as u32, inner as u32];
                    c.launch_loop(softmax_src($kind), vec![Buf::In(0), Buf::Out(0)], p, groups(rows), 3 * len as u64);
                }
                Ok(Some(c))
            }
        }
    )*};
}

softmax_kernels! {
    Softmax: "soft";
    LogSoftmax: "log";
    Hardmax: "hard";
}

impl Kernel for op::SoftmaxGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(y), Some(_)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if y.elem() != Elem::F32 {
            return Ok(None);
        }
        let r = y.shape.len();
        let axes: Vec<usize> =
            self.axes.clone().unwrap_or_else(|| vec![-1]).iter().map(|&a| norm_axis(a, r)).collect::<Result<_, _>>()?;
        let (lo, hi) = (*axes.iter().min().unwrap_or(&0), *axes.iter().max().unwrap_or(&0));
        if hi + 1 - lo != axes.len() {
            return Ok(None);
        }
        let n: usize = y.shape[lo..=hi].iter().product();
        let inner: usize = y.shape[hi + 1..].iter().product();
        let rows = y.numel() / n.max(1);
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        if rows > 0 {
            let p = vec![rows as u32, n as u32, inner as u32];
            let bufs = vec![Buf::In(0), Buf::In(1), Buf::Out(0)];
            c.launch_loop(softmax_grad_src(self.log() != 0), bufs, p, groups(rows), 2 * n as u64);
        }
        Ok(Some(c))
    }
}

/// The gradient of softmax rows (`dX = Y·(dY − Σ dY·Y)`) or log-softmax rows
/// (`dX = dY − exp(Y)·Σ dY`). `P = [rows, len, inner]`.
pub fn softmax_grad_src(log: bool) -> String {
    let (term, out) = if log { ("DY[o]", "DY[o] - exp(Y[o]) * s") } else { ("DY[o] * Y[o]", "Y[o] * (DY[o] - s)") };
    let body = format!(
        "    let n = P[1]; let inner = P[2];
    let base = (i / inner) * n * inner + i % inner;
    var s = 0.0;
    for (var k = 0u; k < n; k = k + 1u) {{ let o = base + k * inner; s = s + {term}; }}
    for (var k = 0u; k < n; k = k + 1u) {{ let o = base + k * inner; DX[o] = {out}; }}"
    );
    source(&[("Y", Elem::F32, false), ("DY", Elem::F32, false), ("DX", Elem::F32, true)], "", &body)
}

/// Reduction kinds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Red {
    /// Σ
    Sum,
    /// mean
    Mean,
    /// max
    Max,
    /// min
    Min,
    /// Π
    Prod,
    /// Σ|x|
    L1,
    /// √Σx²
    L2,
    /// Σx²
    SumSquare,
    /// log Σ
    LogSum,
    /// log Σ exp
    LogSumExp,
    /// index of the max
    ArgMax,
    /// index of the min
    ArgMin,
}

/// Source of a reduction kernel: one invocation per output element, looping over the reduced
/// sub-box. `P = [count, rank, in_shape[r], reduced[r] (0/1), last_index]`.
pub fn reduce_src(red: Red, xe: Elem, ye: Elem) -> String {
    reduce_src_with(red, xe, ye, false)
}

/// [`reduce_src`], or with `run` the kernel for reduced axes that are consecutive dims: X is
/// `[outer, total, inner]`, `P = [count, total, inner, last_index]`.
fn reduce_src_with(red: Red, xe: Elem, ye: Elem, run: bool) -> String {
    let t = xe.wgsl();
    let (init, step, fin) = match red {
        Red::Sum | Red::Mean => (format!("{t}(0)"), "acc = acc + v;".to_string(), "acc".to_string()),
        Red::Max | Red::ArgMax => (
            if xe == Elem::F32 { "bitcast<f32>(0xff800000u)".into() } else { "-2147483647 - 1".into() },
            if xe == Elem::F32 && red == Red::Max {
                "acc = fmax_(acc, v);".into()
            } else {
                "acc = max(acc, v);".into()
            },
            "acc".into(),
        ),
        Red::Min | Red::ArgMin => (
            if xe == Elem::F32 { "bitcast<f32>(0x7f800000u)".into() } else { "2147483647".into() },
            if xe == Elem::F32 && red == Red::Min {
                "acc = fmin_(acc, v);".into()
            } else {
                "acc = min(acc, v);".into()
            },
            "acc".into(),
        ),
        Red::Prod => (format!("{t}(1)"), "acc = acc * v;".into(), "acc".into()),
        Red::L1 => (format!("{t}(0)"), "acc = acc + abs(v);".into(), "acc".into()),
        Red::L2 => ("0.0".into(), "acc = acc + f32(v) * f32(v);".into(), "sqrt(acc)".into()),
        Red::SumSquare => (format!("{t}(0)"), "acc = acc + v * v;".into(), "acc".into()),
        Red::LogSum => ("0.0".into(), "acc = acc + f32(v);".into(), "log(acc)".into()),
        Red::LogSumExp => ("0.0".into(), "acc = acc + exp(f32(v) - m);".into(), "m + log(acc)".into()),
    };
    let arg = matches!(red, Red::ArgMax | Red::ArgMin);
    let cmp = if red == Red::ArgMax { ">" } else { "<" };
    let (mut body, offset, last) = if run {
        (
            "    let total = P[1];\n    let inner = P[2];\n    let o = i / inner;\n    let w = i % inner;\n"
                .to_string(),
            "        let off = (o * total + j) * inner + w;\n",
            "P[3]",
        )
    } else {
        (general_prelude(), GENERAL_OFFSET, "P[2u + 2u * r]")
    };
    if red == Red::LogSumExp {
        body.push_str(&format!("    var m = bitcast<f32>(0xff800000u);\n    for (var j = 0u; j < total; j = j + 1u) {{\n{offset}        m = max(m, f32(X[off]));\n    }}\n"));
    }
    body.push_str(&format!("    var acc = {init};\n"));
    if arg {
        body.push_str(&format!(
            "    var best = 0u;\n    for (var j = 0u; j < total; j = j + 1u) {{\n{offset}        let v = X[off];\n        if (j == 0u || v {cmp} acc || ({last} != 0u && v == acc)) {{ acc = v; best = j; }}\n    }}\n    Y[i] = i32(best);\n"
        ));
    } else {
        body.push_str(&format!(
            "    for (var j = 0u; j < total; j = j + 1u) {{\n{offset}        let v = X[off];\n        {step}\n    }}\n"
        ));
        let mean = if red == Red::Mean { format!(" / {t}(total)") } else { String::new() };
        let conv = if ye == Elem::F32 { format!("f32({fin}{mean})") } else { format!("i32({fin}{mean})") };
        body.push_str(&format!("    Y[i] = {conv};\n"));
    }
    source(&[("X", xe, false), ("Y", ye, true)], MATH_FNS, &body)
}

/// The general reduction's prelude: this output element's base offset and the reduced extent.
fn general_prelude() -> String {
    String::from(
        "    let r = P[1];
    // Base offset of this output element, and the reduced extent.
    var rem = i;
    var base = 0u;
    var stride = 1u;
    var total = 1u;
    for (var t = 0u; t < r; t = t + 1u) {
        let d = r - 1u - t;
        let dim = P[2u + d];
        if (P[2u + r + d] == 0u) {
            let c = rem % dim;
            rem = rem / dim;
            base = base + c * stride;
        } else {
            total = total * dim;
        }
        stride = stride * dim;
    }
",
    )
}

/// Offset of the j-th element of the general reduction's sub-box.
const GENERAL_OFFSET: &str = "        var jr = j;
        var off = base;
        var st = 1u;
        for (var t = 0u; t < r; t = t + 1u) {
            let d = r - 1u - t;
            let dim = P[2u + d];
            if (P[2u + r + d] != 0u) {
                off = off + (jr % dim) * st;
                jr = jr / dim;
            }
            st = st * dim;
        }
";

/// Source of a row kernel over `axis_len` elements `inner` apart: softmax, log-softmax,
/// hardmax. `P = [rows, axis_len, inner]`.
pub fn softmax_src(kind: &str) -> String {
    let write = match kind {
        "log" => "Y[idx] = (X[idx] - m) - log(s);",
        "hard" => "Y[idx] = select(0.0, 1.0, k == arg);",
        _ => "Y[idx] = exp(X[idx] - m) / s;",
    };
    let body = format!(
        "    let len = P[1];
    let inner = P[2];
    let base = (i / inner) * len * inner + i % inner;
    var m = bitcast<f32>(0xff800000u);
    var arg = 0u;
    for (var k = 0u; k < len; k = k + 1u) {{
        let v = X[base + k * inner];
        if (v > m) {{ m = v; arg = k; }}
    }}
    var s = 0.0;
    for (var k = 0u; k < len; k = k + 1u) {{
        s = s + exp(X[base + k * inner] - m);
    }}
    for (var k = 0u; k < len; k = k + 1u) {{
        let idx = base + k * inner;
        {write}
    }}"
    );
    source(&[("X", Elem::F32, false), ("Y", Elem::F32, true)], "", &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn reduction_and_softmax_kernels_validate() {
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
            for xe in [Elem::F32, Elem::I32] {
                let ye = if matches!(red, Red::ArgMax | Red::ArgMin) { Elem::I32 } else { xe };
                validate(&format!("reduce {red:?} {xe:?}"), &reduce_src(red, xe, ye));
                validate(&format!("reduce {red:?} {xe:?} (axes in a run)"), &reduce_src_with(red, xe, ye, true));
            }
        }
        for kind in ["soft", "log", "hard"] {
            validate(&format!("softmax {kind}"), &softmax_src(kind));
        }
        for log in [false, true] {
            validate("softmax grad", &softmax_grad_src(log));
        }
    }
}
