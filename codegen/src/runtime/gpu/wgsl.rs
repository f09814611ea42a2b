//! WGSL source builders every kernel family shares: the 1-D kernel skeleton, math helpers,
//! literal floats, parameter baking, index arithmetic with literal sizes, element-wise
//! kernels over broadcast inputs, and data movement through index tables.

use super::Elem;
use super::compile::{Buf, Compiled, Pointwise, Step, WORKGROUP, groups};

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
    s.push_str(&format!(
        "\n@compute @workgroup_size({WORKGROUP})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    let i = gid.x + gid.y * nwg.x * {WORKGROUP}u;\n    if (i >= P[0]) {{ return; }}\n",
    ));
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
    // log(1 + e) loses e's digits when e is small: there its series e − e²/2 + e³/3.
    let e = exp(-abs(x));
    let l = select(log(1.0 + e), e * (1.0 - e * (0.5 - e / 3.0)), e < 1.0e-3);
    return max(x, 0.0) + l;
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
fn fmax_(a: f32, b: f32) -> f32 {
    // WGSL's max may drop a NaN; onnxruntime's keeps it.
    return select(max(a, b), a + b, isnan_(a) || isnan_(b));
}
fn fmin_(a: f32, b: f32) -> f32 {
    return select(min(a, b), a + b, isnan_(a) || isnan_(b));
}
fn fclamp_(x: f32, lo: f32, hi: f32) -> f32 {
    return select(clamp(x, lo, hi), x, isnan_(x));
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
    // |a| < |b| (an infinite divisor included): a itself, where b·0 would be NaN.
    let q = trunc(a / b);
    return select(a - b * q, a, q == 0.0);
}
"#;

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

/// Parameters of a tensor's row-major strides.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Data movement by per-dim index tables: `Y[i] = X[Σ_d in(c_d)·stride_d]` where `in(c)` is
/// `c` or a table entry (-1: out of bounds, the pad value). The output shape, strides, table
/// offsets (`None`: no table) and pad bits are baked into the source; `P = [count, tables…]`.
pub fn remap_src(e: Elem, shape: &[usize], strides: &[u32], tables: &[Option<u32>], pad_bits: u32) -> String {
    let keep: Vec<bool> = tables.iter().map(Option::is_some).collect();
    // Merge only dims without tables; keep table dims (and their offsets) in place.
    let (ms, mst, mtab) = {
        let mut ms = Vec::new();
        let mut mst = Vec::new();
        let mut mtab: Vec<Option<u32>> = Vec::new();
        for d in 0..shape.len() {
            let merge = !keep[d]
                && !ms.is_empty()
                && mtab.last() == Some(&None)
                && mst.last().copied() == Some(strides[d] * shape[d] as u32);
            if shape[d] == 1 && !keep[d] {
                continue;
            }
            if merge {
                *ms.last_mut().expect("a dim") *= shape[d];
                *mst.last_mut().expect("a dim") = strides[d];
            } else {
                ms.push(shape[d]);
                mst.push(strides[d]);
                mtab.push(tables[d]);
            }
        }
        (ms, mst, mtab)
    };
    let mut body = String::from("    var valid = true;\n");
    let coord = |d: usize, c: &str| -> String {
        match mtab[d] {
            None => c.to_string(),
            Some(off) => format!("tab(&valid, {off}u + {c})"),
        }
    };
    body.push_str(&unrolled_offsets(&ms, &[mst], &coord));
    let pad = if e == Elem::F32 { format!("bitcast<f32>({pad_bits}u)") } else { format!("bitcast<i32>({pad_bits}u)") };
    body.push_str(&format!("    Y[i] = select({pad}, X[o0], valid);"));
    let fns = "fn tab(valid: ptr<function, bool>, at: u32) -> u32 {
    let v = bitcast<i32>(P[at]);
    if (v < 0) { *valid = false; }
    return u32(max(v, 0));
}
";
    source(&[("X", e, false), ("Y", e, true)], fns, &body)
}

/// How each output dim of a remap reads its input.
pub enum Axis {
    /// Input coordinate = output coordinate, input stride.
    Same(usize),
    /// Input coordinate from a table (-1: pad), input stride.
    Table(Vec<i64>, usize),
}

/// Writes one input of a concat into its place: `P = [count, block, out_block, offset]`.
pub fn place_src(e: Elem) -> String {
    let body = "    let j = i % P[1];
    let o = i / P[1];
    Y[o * P[2] + P[3] + j] = X[i];";
    source(&[("X", e, false), ("Y", e, true)], "", body)
}

/// Window attributes as 3-d (leading 1s / 0s).
pub fn to3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut o = [fill; 3];
    let off = 3 - v.len().min(3);
    for (k, &x) in v.iter().take(3).enumerate() {
        o[off + k] = x;
    }
    o
}

/// A WGSL `f32` literal with the exact bits of `x` (NaN and infinities included).
pub fn f32_lit(x: f64) -> String {
    let v = x as f32;
    if v.is_nan() {
        "bitcast<f32>(0x7fc00000u)".into()
    } else if v.is_infinite() {
        if v > 0.0 { "bitcast<f32>(0x7f800000u)".into() } else { "bitcast<f32>(0xff800000u)".into() }
    } else {
        format!("bitcast<f32>({}u)", v.to_bits())
    }
}

/// Adds an element-wise launch: `out = expr(a, b, c)` over inputs `ins` (buffer, shape,
/// storage) broadcast to `shape`.
pub fn elementwise(c: &mut Compiled, ins: &[(Buf, &[usize], Elem)], out: (Buf, Elem), shape: &[usize], expr: &str) {
    let count: usize = shape.iter().product();
    if count == 0 {
        return;
    }
    let elems: Vec<Elem> = ins.iter().map(|t| t.2).collect();
    let access: Vec<Access> = ins.iter().map(|t| Access::of(t.1, shape)).collect();
    let strides: Vec<Vec<u32>> = ins.iter().map(|t| broadcast_strides(t.1, shape)).collect();
    let src = elementwise_src(&elems, &access, shape, &strides, out.1, expr);
    let mut bufs: Vec<Buf> = ins.iter().map(|t| t.0).collect();
    bufs.push(out.0);
    c.launch(src, bufs, vec![count as u32], groups(count));
    if let Some(Step::Launch(l)) = c.steps.last_mut() {
        l.pointwise = Some(Box::new(Pointwise {
            ins: ins.iter().map(|t| (t.0, t.1.to_vec(), t.2)).collect(),
            out,
            shape: shape.to_vec(),
            expr: expr.to_string(),
        }));
    }
}

/// Adds a remap launch: `out[c] = x[Σ in(c_d)·stride_d]` over the output `oshape` (see
/// [`remap_src`]); `pad` fills out-of-range reads.
pub fn remap(c: &mut Compiled, x: Buf, e: Elem, out: Buf, oshape: &[usize], axes: &[Axis], pad: f64) {
    let count: usize = oshape.iter().product();
    if count == 0 {
        return;
    }
    let mut p: Vec<u32> = vec![count as u32];
    let mut strides = Vec::with_capacity(axes.len());
    let mut offs = Vec::with_capacity(axes.len());
    for a in axes {
        match a {
            Axis::Same(st) => {
                strides.push(*st as u32);
                offs.push(None);
            }
            Axis::Table(t, st) => {
                strides.push(*st as u32);
                offs.push(Some(p.len() as u32));
                p.extend(t.iter().map(|&v| (v.clamp(-1, i32::MAX as i64) as i32) as u32));
            }
        }
    }
    let pad_bits = if e == Elem::F32 { (pad as f32).to_bits() } else { (pad as i32) as u32 };
    let src = remap_src(e, oshape, &strides, &offs, pad_bits);
    c.launch(src, vec![x, out], p, groups(count));
}

/// Adds a launch writing all of `x` into `out`; `[count, block, out_block, offset]`: `count`
/// elements in blocks of `block`, placed at offset `offset` of blocks `out_block` apart
/// (concat, stacking).
pub fn place(c: &mut Compiled, x: Buf, e: Elem, out: Buf, [count, block, out_block, offset]: [usize; 4]) {
    if count == 0 {
        return;
    }
    c.launch(
        place_src(e),
        vec![x, out],
        vec![count as u32, block as u32, out_block as u32, offset as u32],
        groups(count),
    );
}

/// Validates a WGSL source with naga (no GPU needed), panicking with the rendered error.
#[cfg(test)]
pub(crate) fn validate(what: &str, src: &str) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{what}: WGSL does not parse: {}\n{src}", e.emit_to_string(src)));
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::default() | naga::valid::Capabilities::SUBGROUP,
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{what}: WGSL does not validate: {}\n{src}", e.emit_to_string(src)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_parameter_reads_become_constants() {
        let src = "if (i >= P[0]) { return; } let a = P[1] + P[12]; let b = P[2u + d]; let c = TMP[1]; let d = P[40];";
        let p: Vec<u32> = (0..20).map(|k| 100 + k).collect();
        assert_eq!(
            specialize(src, &p),
            "if (i >= P[0]) { return; } let a = 101u + 112u; let b = P[2u + d]; let c = TMP[1]; let d = P[40];"
        );
    }

    #[test]
    fn dispatches_cover_every_invocation_with_less_than_a_group_per_row_to_spare() {
        // `i = gid.x + gid.y · nwg.x · WORKGROUP` must reach every `i < threads`, within the
        // 65535 groups a dimension allows, and past one row waste under one group per row
        // (full rows and an almost empty last one launched up to twice the groups needed).
        for threads in [1, 63, 64, 65, 65535 * 64, 65535 * 64 + 1, 65536 * 64, 4_194_305, 38_597_376, 1 << 31] {
            let [x, y, z] = groups(threads);
            assert_eq!(z, 1);
            assert!((1..=65535).contains(&x) && (1..=65535).contains(&y), "{threads}: {x}×{y}");
            let launched = x as usize * y as usize * WORKGROUP;
            assert!(launched >= threads, "{threads}: {x}×{y} groups miss invocations");
            assert!(launched - threads < WORKGROUP * y as usize, "{threads}: {x}×{y} groups, {launched} invocations");
        }
    }

    #[test]
    fn movement_kernels_validate() {
        for e in [Elem::F32, Elem::I32] {
            validate("place", &place_src(e));
            // A transpose, and a pad/slice through a table with an out-of-range pad value.
            validate("remap", &remap_src(e, &[4, 3, 2], &[1, 8, 4], &[None, None, None], 0));
            validate("remap table", &remap_src(e, &[5, 3], &[3, 1], &[Some(1), None], (-1i32) as u32));
        }
    }
}
