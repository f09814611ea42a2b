//! GEMM for `MatMul` (batched, broadcast, 1-d operands promoted, a shared B folded into
//! rows), `Gemm`, and the projections inside convolutions and recurrent layers. On adapters
//! with a fixed subgroup size (CPU adapters such as lavapipe) one kernel on subgroups
//! ([`gemm_sg_src`]: each lane's row of A reaches the others by broadcast); elsewhere a
//! register-tiled kernel (4×4 blocks per invocation, no workgroup memory — barriers are costly
//! on CPU-backed drivers). A tiled variant with workgroup memory is kept for devices where it
//! is faster.

use ir::op;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel};
use super::wgsl::{broadcast_strides, source, strides};

/// A GEMM launch: `Y[b, m, n] = alpha · Σ_k A[..] · B[..] (+ beta · C[..])` with per-operand
/// row/column strides, batch dims with per-operand batch strides, and base offsets.
pub struct GemmSpec {
    /// A, B and the optional C.
    pub a: Buf,
    /// B.
    pub b: Buf,
    /// C (broadcast through `c_st`, `c_bst`).
    pub c: Option<Buf>,
    /// Rows.
    pub m: usize,
    /// Columns.
    pub n: usize,
    /// Reduction length.
    pub k: usize,
    /// (row stride, col stride) of A.
    pub a_st: (usize, usize),
    /// Of B.
    pub b_st: (usize, usize),
    /// Of C.
    pub c_st: (usize, usize),
    /// Batch dims (at most 4).
    pub batch: Vec<usize>,
    /// A's batch strides.
    pub a_bst: Vec<usize>,
    /// B's batch strides.
    pub b_bst: Vec<usize>,
    /// C's batch strides.
    pub c_bst: Vec<usize>,
    /// Base offsets of A, B, C.
    pub bases: (usize, usize, usize),
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C.
    pub beta: f32,
}

/// Adds a GEMM writing `out` (dense `[batch…, m, n]`).
pub fn gemm(c: &mut Compiled, g: &GemmSpec, out: Buf) -> Result<(), String> {
    if g.batch.len() > 4 {
        return Err("more than 4 batch dims".into());
    }
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        return Err("empty reduction".into());
    }
    let pad4 = |v: &[usize], fill: u32| -> Vec<u32> {
        let mut o: Vec<u32> = v.iter().map(|&x| x as u32).collect();
        o.resize(4, fill);
        o
    };
    let mut p: Vec<u32> = vec![
        g.m as u32,
        g.n as u32,
        g.k as u32,
        g.a_st.0 as u32,
        g.a_st.1 as u32,
        g.b_st.0 as u32,
        g.b_st.1 as u32,
        g.c_st.0 as u32,
        g.c_st.1 as u32,
        g.batch.len() as u32,
    ];
    p.extend(pad4(&g.batch, 1));
    p.extend(pad4(&g.a_bst, 0));
    p.extend(pad4(&g.b_bst, 0));
    p.extend(pad4(&g.c_bst, 0));
    p.extend([g.bases.0 as u32, g.bases.1 as u32, g.bases.2 as u32, g.alpha.to_bits(), g.beta.to_bits()]);
    let nbatch: usize = g.batch.iter().product::<usize>().max(1);
    let groups = [g.n.div_ceil(32) as u32, g.m.div_ceil(32) as u32, nbatch as u32];
    // On subgroups (see `gemm_sg_src`): aligned operands in vec4s, any others element by element.
    let sg = c.subgroup;
    let v = if vec4_fits(g) {
        SgGemm { at: g.a_st.1 != 1, bt: g.b_st.1 != 1, ..SgGemm::default() }
    } else {
        SgGemm { scalar: true, ..SgGemm::default() }
    };
    let sg_groups =
        |s: u32, z: usize| [g.n.div_ceil(4).div_ceil(s as usize) as u32, g.m.div_ceil(SG_ROWS) as u32, z as u32];
    if ir::ops::contraction::gemm_dispatches(nbatch, g.k) == 2 {
        // A long reduction in chunks, each workgroup layer one chunk's partial product, then
        // their sum (and C): see `gemm_rt_src`.
        let parts = g.k.div_ceil(SPLIT_K_LEN);
        // Whole vec4s per chunk on the subgroup kernel.
        let len = if sg.is_some() { g.k.div_ceil(parts).next_multiple_of(4) } else { g.k.div_ceil(parts) };
        let parts = g.k.div_ceil(len);
        p[9] = 0;
        p.push(len as u32);
        let t = c.temp(vec![parts, g.m, g.n], ir::DType::Float);
        match sg {
            Some(s) => {
                let trips = (len / 4 + 4 * s as usize) as u64;
                c.launch_loop(
                    gemm_sg_src(s, SgGemm { split: true, ..v }),
                    vec![g.a, g.b, t],
                    p,
                    sg_groups(s, parts),
                    trips,
                );
            }
            None => {
                let groups = [groups[0], groups[1], parts as u32];
                c.launch_loop(gemm_rt_src(false, true), vec![g.a, g.b, t], p, groups, (len + 4 + 16) as u64);
            }
        }
        let mn = g.m * g.n;
        let sp = vec![
            mn as u32,
            g.n as u32,
            parts as u32,
            g.c_st.0 as u32,
            g.c_st.1 as u32,
            g.bases.2 as u32,
            g.beta.to_bits(),
        ];
        let (src, bufs) = match g.c {
            Some(cb) => (split_k_sum_src(true), vec![t, cb, out]),
            None => (split_k_sum_src(false), vec![t, out]),
        };
        c.launch_loop(src, bufs, sp, super::compile::groups(mn), parts as u64);
        return Ok(());
    }
    if let Some(s) = sg {
        let trips = (g.batch.len() + g.k.div_ceil(4) + 4 * s as usize) as u64;
        let (src, bufs) = match g.c {
            Some(cb) => (gemm_sg_src(s, SgGemm { with_c: true, ..v }), vec![g.a, g.b, cb, out]),
            None => (gemm_sg_src(s, v), vec![g.a, g.b, out]),
        };
        c.launch_loop(src, bufs, p, sg_groups(s, nbatch), trips);
        return Ok(());
    }
    // The batch decode, the reduction, the 4×4 write-back.
    let trips = (g.batch.len() + g.k + 4 + 16) as u64;
    match g.c {
        Some(cb) => c.launch_loop(gemm_rt_src(true, false), vec![g.a, g.b, cb, out], p, groups, trips),
        None => c.launch_loop(gemm_rt_src(false, false), vec![g.a, g.b, out], p, groups, trips),
    }
    Ok(())
}

/// WGSL: the element offsets `ab`, `bb`, `cb` of batch entry `wid.z` into A, B and C, from
/// the `P[9]` batch dims `P[10..14]` and the operands' batch strides `P[14..26]`.
const BATCH_OFFSETS: &str = "var rem = wid.z;
    var ab = 0u;
    var bb = 0u;
    var cb = 0u;
    let nb = P[9];
    for (var t = 0u; t < nb; t = t + 1u) {
        let d = nb - 1u - t;
        let dim = P[10u + d];
        let c = rem % dim;
        rem = rem / dim;
        ab = ab + c * P[14u + d];
        bb = bb + c * P[18u + d];
        cb = cb + c * P[22u + d];
    }";

/// Where the reduction is split ([`ir::ops::contraction::SPLIT_K_FROM`], the rule the cost
/// model prices too).
pub use ir::ops::contraction::{SPLIT_K_FROM, SPLIT_K_LEN};

/// The sum of a split-K GEMM's `P[2]` partial products `T[s, i]` over `P[0]` = M·N outputs
/// (`P[1]` = N), plus `bitcast(P[6])` × C at base `P[5]` with row and column strides `P[3]`,
/// `P[4]` when there is a C.
pub fn split_k_sum_src(with_c: bool) -> String {
    let mut b: Vec<super::wgsl::Binding<'_>> = vec![("T", Elem::F32, false)];
    if with_c {
        b.push(("C", Elem::F32, false));
    }
    b.push(("Y", Elem::F32, true));
    let c_term =
        if with_c { "    v = v + bitcast<f32>(P[6]) * C[P[5] + (i / P[1]) * P[3] + (i % P[1]) * P[4]];\n" } else { "" };
    source(
        &b,
        "",
        &format!(
            "    var v = 0.0;
    for (var s = 0u; s < P[2]; s = s + 1u) {{ v = v + T[s * P[0] + i]; }}
{c_term}    Y[i] = v;"
        ),
    )
}

impl Kernel for op::MatMul {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(w)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if x.elem() != Elem::F32 || w.elem() != Elem::F32 {
            return Ok(None);
        }
        // 1-d operands become matrices.
        let ash: Vec<usize> = if x.shape.len() == 1 { vec![1, x.shape[0]] } else { x.shape.clone() };
        let bsh: Vec<usize> = if w.shape.len() == 1 { vec![w.shape[0], 1] } else { w.shape.clone() };
        let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
        let nn = bsh[bsh.len() - 1];
        let ab = &ash[..ash.len() - 2];
        let bb = &bsh[..bsh.len() - 2];
        let nb = ab.len().max(bb.len());
        if nb > 4 {
            return Ok(None);
        }
        let mut batch = vec![1usize; nb];
        for (d, slot) in batch.iter_mut().enumerate() {
            let a = ab.len().checked_sub(nb - d).map_or(1, |i| ab[i]);
            let b = bb.len().checked_sub(nb - d).map_or(1, |i| bb[i]);
            *slot = a.max(b);
        }
        // Batch strides of each operand (0 where it broadcasts).
        let bst = |b: &[usize], full: &[usize]| -> Vec<usize> {
            let st = strides(full);
            (0..nb)
                .map(|d| match b.len().checked_sub(nb - d) {
                    Some(i) if b[i] != 1 => st[i],
                    _ => 0,
                })
                .collect()
        };
        let a_full: Vec<usize> = ab.iter().copied().chain([m, k]).collect();
        let b_full: Vec<usize> = bb.iter().copied().chain([k, nn]).collect();
        let mut a_bst = bst(ab, &a_full);
        let b_bst = bst(bb, &b_full);
        let mut m = m;
        if bb.iter().all(|&d| d == 1) {
            // A shared B: A's batch folds into its rows (one GEMM, not many thin ones).
            m *= batch.iter().product::<usize>();
            batch.iter_mut().for_each(|d| *d = 1);
            a_bst.iter_mut().for_each(|s| *s = 0);
        }
        let spec = GemmSpec {
            a: Buf::In(0),
            b: Buf::In(1),
            c: None,
            m,
            n: nn,
            k,
            a_st: (k, 1),
            b_st: (nn, 1),
            c_st: (0, 0),
            batch,
            a_bst,
            b_bst,
            c_bst: vec![0; nb],
            bases: (0, 0, 0),
            alpha: 1.0,
            beta: 0.0,
        };
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        gemm(&mut c, &spec, Buf::Out(0))?;
        Ok(Some(c))
    }
}

impl Kernel for op::Gemm {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(w)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if x.elem() != Elem::F32 || w.elem() != Elem::F32 || x.shape.len() != 2 || w.shape.len() != 2 {
            return Ok(None);
        }
        let (ta, tb) = (self.trans_a() != 0, self.trans_b() != 0);
        let (m, k) = if ta { (x.shape[1], x.shape[0]) } else { (x.shape[0], x.shape[1]) };
        let nn = if tb { w.shape[0] } else { w.shape[1] };
        let c_st = match cx.input(2) {
            Some(c) => {
                let st = broadcast_strides(&c.shape, &[m, nn]);
                (st[0] as usize, st[1] as usize)
            }
            None => (0, 0),
        };
        let spec = GemmSpec {
            a: Buf::In(0),
            b: Buf::In(1),
            c: cx.input(2).map(|_| Buf::In(2)),
            m,
            n: nn,
            k,
            a_st: if ta { (1, x.shape[1]) } else { (x.shape[1], 1) },
            b_st: if tb { (1, w.shape[1]) } else { (w.shape[1], 1) },
            c_st,
            batch: vec![],
            a_bst: vec![],
            b_bst: vec![],
            c_bst: vec![],
            bases: (0, 0, 0),
            alpha: self.alpha(),
            beta: self.beta(),
        };
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        gemm(&mut c, &spec, Buf::Out(0))?;
        Ok(Some(c))
    }
}

/// Tiled GEMM: `Y[b, m, n] = alpha · Σ_k A[a_off(b) + m·ars + k·acs] · B[b_off(b) + k·brs + n·bcs]
/// (+ beta · C[c_off(b) + m·crs + n·ccs])`. 16×16 tiles in workgroup memory; one workgroup
/// per output tile and batch entry. `P = [M, N, K, ars, acs, brs, bcs, crs, ccs, nb,
/// batch dims[4], a batch strides[4], b batch strides[4], c batch strides[4], a_base, b_base,
/// c_base, alpha_bits, beta_bits]`.
pub fn gemm_src(with_c: bool) -> String {
    let c_binding = if with_c { "@group(0) @binding(2) var<storage, read> C: array<f32>;\n" } else { "" };
    let (yb, pb) = if with_c { (3, 4) } else { (2, 3) };
    let c_term = if with_c {
        "        let coff = P[28] + cb + row * P[7] + col * P[8];\n        v = v + bitcast<f32>(P[30]) * C[coff];\n"
    } else {
        ""
    };
    format!(
        "@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
{c_binding}@group(0) @binding({yb}) var<storage, read_write> Y: array<f32>;
@group(0) @binding({pb}) var<storage, read> P: array<u32>;
var<workgroup> TA: array<f32, 256>;
var<workgroup> TB: array<f32, 256>;
@compute @workgroup_size(16, 16)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {{
    let M = P[0];
    let N = P[1];
    let K = P[2];
    let row = wid.y * 16u + lid.y;
    let col = wid.x * 16u + lid.x;
    {BATCH_OFFSETS}
    var acc = 0.0;
    let tiles = (K + 15u) / 16u;
    for (var t = 0u; t < tiles; t = t + 1u) {{
        let ka = t * 16u + lid.x;
        let kb = t * 16u + lid.y;
        let va = A[P[26] + ab + min(row, M - 1u) * P[3] + min(ka, K - 1u) * P[4]];
        let vb = B[P[27] + bb + min(kb, K - 1u) * P[5] + min(col, N - 1u) * P[6]];
        TA[lid.y * 16u + lid.x] = select(0.0, va, row < M && ka < K);
        TB[lid.y * 16u + lid.x] = select(0.0, vb, kb < K && col < N);
        workgroupBarrier();
        for (var k = 0u; k < 16u; k = k + 1u) {{
            acc = acc + TA[lid.y * 16u + k] * TB[k * 16u + lid.x];
        }}
        workgroupBarrier();
    }}
    if (row < M && col < N) {{
        var v = bitcast<f32>(P[29]) * acc;
{c_term}        Y[wid.z * M * N + row * N + col] = v;
    }}
}}
"
    )
}

/// Register-tiled GEMM: each invocation computes a 4×4 block of `Y` with no workgroup memory
/// (barriers are costly on CPU-backed drivers such as lavapipe); an 8×8 workgroup covers a
/// 32×32 tile. Parameters as [`gemm_src`].
///
/// `split`: workgroup layer `z` computes the partial product over reduction steps
/// `[z·P[31], (z + 1)·P[31])` into layer `z` of Y (no batch dims, no C; see [`SPLIT_K_FROM`]).
pub fn gemm_rt_src(with_c: bool, split: bool) -> String {
    let c_binding = if with_c { "@group(0) @binding(2) var<storage, read> C: array<f32>;\n" } else { "" };
    let k_range = if split {
        "let kbeg = wid.z * P[31];\n    let kend = min(kbeg + P[31], K);"
    } else {
        "let kbeg = 0u;\n    let kend = K;"
    };
    let (yb, pb) = if with_c { (3, 4) } else { (2, 3) };
    let c_term = if with_c { "v = v + bitcast<f32>(P[30]) * C[P[28] + cb + row * P[7] + col * P[8]];" } else { "" };
    format!(
        "@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
{c_binding}@group(0) @binding({yb}) var<storage, read_write> Y: array<f32>;
@group(0) @binding({pb}) var<storage, read> P: array<u32>;
@compute @workgroup_size(8, 8)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {{
    let M = P[0];
    let N = P[1];
    let K = P[2];
    let row0 = wid.y * 32u + lid.y * 4u;
    let col0 = wid.x * 32u + lid.x * 4u;
    if (row0 >= M || col0 >= N) {{ return; }}
    {BATCH_OFFSETS}
    let abase = P[26] + ab;
    let bbase = P[27] + bb;
    let ars = P[3]; let acs = P[4]; let brs = P[5]; let bcs = P[6];
    let r0 = abase + min(row0, M - 1u) * ars;
    let r1 = abase + min(row0 + 1u, M - 1u) * ars;
    let r2 = abase + min(row0 + 2u, M - 1u) * ars;
    let r3 = abase + min(row0 + 3u, M - 1u) * ars;
    let c0 = bbase + min(col0, N - 1u) * bcs;
    let c1 = bbase + min(col0 + 1u, N - 1u) * bcs;
    let c2 = bbase + min(col0 + 2u, N - 1u) * bcs;
    let c3 = bbase + min(col0 + 3u, N - 1u) * bcs;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    {k_range}
    for (var k = kbeg; k < kend; k = k + 1u) {{
        let ka = k * acs;
        let kb = k * brs;
        let bv = vec4<f32>(B[c0 + kb], B[c1 + kb], B[c2 + kb], B[c3 + kb]);
        acc0 = acc0 + A[r0 + ka] * bv;
        acc1 = acc1 + A[r1 + ka] * bv;
        acc2 = acc2 + A[r2 + ka] * bv;
        acc3 = acc3 + A[r3 + ka] * bv;
    }}
    let alpha = bitcast<f32>(P[29]);
    var accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var r = 0u; r < 4u; r = r + 1u) {{
        let row = row0 + r;
        if (row >= M) {{ break; }}
        for (var q = 0u; q < 4u; q = q + 1u) {{
            let col = col0 + q;
            if (col >= N) {{ break; }}
            var v = alpha * accs[r][q];
            {c_term}
            Y[wid.z * M * N + row * N + col] = v;
        }}
    }}
}}
"
    )
}

/// The variant of [`gemm_sg_src`]: with C, one chunk of a split reduction, A or B stored
/// transposed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SgGemm {
    /// `+ beta · C`.
    pub with_c: bool,
    /// Workgroup layer `z` computes chunk `z` of the reduction.
    pub split: bool,
    /// A's rows lie along the reduction's stride, its reduction along rows of stride 1.
    pub at: bool,
    /// B's columns lie along the reduction.
    pub bt: bool,
    /// Both operands read element by element at any strides (`at`, `bt` unused), reduction
    /// steps past `K` read as 0.
    pub scalar: bool,
}

/// Rows of `Y` one workgroup of [`gemm_sg_src`] computes (its 64 invocations in subgroups).
const SG_ROWS: usize = 64;

/// Whether [`gemm_sg_src`] reads `g`'s operands in whole, aligned vec4s (else element by
/// element, [`SgGemm::scalar`]): A along the reduction or (transposed, with rows a multiple of
/// 4) along its rows, B along the columns (a multiple of 4 of them) or (transposed, any
/// number) along the reduction; the reduction a multiple of 4, every stride between vec4s,
/// batch stride and base offset too.
fn vec4_fits(g: &GemmSpec) -> bool {
    let aligned = |v: usize| v.is_multiple_of(4);
    ((g.a_st.1 == 1 && aligned(g.a_st.0)) || (g.a_st.0 == 1 && aligned(g.a_st.1) && aligned(g.m)))
        && ((g.b_st.1 == 1 && aligned(g.b_st.0) && aligned(g.n)) || (g.b_st.0 == 1 && aligned(g.b_st.1)))
        && aligned(g.k)
        && aligned(g.bases.0)
        && aligned(g.bases.1)
        && g.a_bst.iter().chain(&g.b_bst).copied().all(aligned)
}

/// GEMM for devices with a fixed subgroup size `s` (CPU adapters, where memory loads cost
/// per invocation and element while moving a value between the lanes of a subgroup is one
/// register shuffle). Lane `l` of a subgroup loads row `row0 + l` of A four reduction steps
/// at a time and one vec4 of B's row per step for its own four columns; each of the `s`
/// rows' A values reaches every lane by `subgroupBroadcast`, so a lane accumulates an
/// `s`×4 block of `Y` from five loads per step. A workgroup of 64 invocations covers
/// [`SG_ROWS`] rows and `4s` columns. Parameters as [`gemm_src`].
///
/// `split`: workgroup layer `z` computes the partial product over reduction steps
/// `[z·P[31], (z + 1)·P[31])` (`P[31]` a multiple of 4) into layer `z` of Y, as
/// [`gemm_rt_src`]'s. `bt`: B is stored transposed (its columns along the reduction): a lane
/// loads a vec4 of each of its four columns per step and transposes the 4×4 block. `at`: A
/// is stored transposed (its rows along the reduction): the subgroup's `s` lanes load the
/// four reduction steps' `s` rows as `s` vec4s, one each, and every lane assembles each
/// row's four values from their broadcasts.
pub fn gemm_sg_src(s: u32, v: SgGemm) -> String {
    let SgGemm { with_c, split, at, bt, scalar } = v;
    let b_loads = if scalar {
        "{accs}    {k_range}
    for (var k = kbeg; k < kend; k = k + 1u) {
        let k0 = k * 4u;
        let a = vec4<f32>(lda(ra, k0), lda(ra, k0 + 1u), lda(ra, k0 + 2u), lda(ra, k0 + 3u));
        let b0 = vec4<f32>(ldb(k0, 0u), ldb(k0, 1u), ldb(k0, 2u), ldb(k0, 3u));
        let b1 = vec4<f32>(ldb(k0 + 1u, 0u), ldb(k0 + 1u, 1u), ldb(k0 + 1u, 2u), ldb(k0 + 1u, 3u));
        let b2 = vec4<f32>(ldb(k0 + 2u, 0u), ldb(k0 + 2u, 1u), ldb(k0 + 2u, 2u), ldb(k0 + 2u, 3u));
        let b3 = vec4<f32>(ldb(k0 + 3u, 0u), ldb(k0 + 3u, 1u), ldb(k0 + 3u, 2u), ldb(k0 + 3u, 3u));"
    } else if bt {
        "let bcs = P[6] / 4u;
    let bbase = (P[27] + bb) / 4u;
    let c0 = bbase + min(col * 4u, P[1] - 1u) * bcs;
    let c1 = bbase + min(col * 4u + 1u, P[1] - 1u) * bcs;
    let c2 = bbase + min(col * 4u + 2u, P[1] - 1u) * bcs;
    let c3 = bbase + min(col * 4u + 3u, P[1] - 1u) * bcs;
{accs}    {k_range}
    for (var k = kbeg; k < kend; k = k + 1u) {
        {a_load}
        let q0 = B[c0 + k];
        let q1 = B[c1 + k];
        let q2 = B[c2 + k];
        let q3 = B[c3 + k];
        let b0 = vec4<f32>(q0.x, q1.x, q2.x, q3.x);
        let b1 = vec4<f32>(q0.y, q1.y, q2.y, q3.y);
        let b2 = vec4<f32>(q0.z, q1.z, q2.z, q3.z);
        let b3 = vec4<f32>(q0.w, q1.w, q2.w, q3.w);"
    } else {
        "let brs = P[5] / 4u;
    let cbase = (P[27] + bb) / 4u + min(col, P[1] / 4u - 1u);
{accs}    {k_range}
    for (var k = kbeg; k < kend; k = k + 1u) {
        {a_load}
        let kb = cbase + k * 4u * brs;
        let b0 = B[kb];
        let b1 = B[kb + brs];
        let b2 = B[kb + 2u * brs];
        let b3 = B[kb + 3u * brs];"
    };
    let k_range = if split {
        "let kbeg = wid.z * (P[31] / 4u);\n    let kend = min(kbeg + P[31] / 4u, K4);"
    } else {
        "let kbeg = 0u;\n    let kend = K4;"
    };
    let c_binding = if with_c { "@group(0) @binding(2) var<storage, read> C: array<f32>;\n" } else { "" };
    let (yb, pb) = if with_c { (3, 4) } else { (2, 3) };
    let mut accs = String::new();
    let mut body = String::new();
    let mut store = String::new();
    // Transposed A: lane `l` holds reduction step `l / q` of rows `(l % q)·4 …` (q vec4s per
    // step); row `r`'s step `j` is component `r % 4` of lane `j·q + r / 4`'s vec4.
    let q = s / 4;
    if at {
        for l in 0..s {
            body += &format!("        let v{l} = subgroupBroadcast(a, {l}u);\n");
        }
    }
    for r in 0..s {
        accs += &format!("    var acc{r} = vec4<f32>(0.0);\n");
        if at {
            let c = ["x", "y", "z", "w"][(r % 4) as usize];
            let lane = |j: u32| j * q + r / 4;
            body += &format!(
                "        let a{r} = vec4<f32>(v{}.{c}, v{}.{c}, v{}.{c}, v{}.{c});\n",
                lane(0),
                lane(1),
                lane(2),
                lane(3)
            );
        } else {
            body += &format!("        let a{r} = subgroupBroadcast(a, {r}u);\n");
        }
        body += &format!("        acc{r} = acc{r} + a{r}.x * b0 + a{r}.y * b1 + a{r}.z * b2 + a{r}.w * b3;\n");
        store += &format!("        put(row0 + {r}u, acc{r}, cb);\n");
    }
    let (a_base, a_load) = if scalar {
        ("bbase = P[27] + bb;\n    let ra = P[26] + ab + min(row0 + lane, M - 1u) * P[3];".to_string(), String::new())
    } else if at {
        (
            format!("let acs = P[4] / 4u;\n    let ra = (P[26] + ab + min(row0 + (lane % {q}u) * 4u, M - 4u)) / 4u;"),
            format!("let a = A[ra + (k * 4u + lane / {q}u) * acs];"),
        )
    } else {
        ("let ra = (P[26] + ab + min(row0 + lane, M - 1u) * P[3]) / 4u;".to_string(), "let a = A[ra + k];".to_string())
    };
    let c_term = if with_c { "v = v + bitcast<f32>(P[30]) * C[P[28] + cb + row * P[7] + c * P[8]];" } else { "" };
    let b_loads = b_loads.replace("{accs}", &accs).replace("{k_range}", k_range).replace("{a_load}", &a_load);
    let (operand, loads) = if scalar {
        (
            "f32",
            "var<private> bbase: u32;
// A's element `kk` of the row at `base`, B's of row `kk` and column `col·4 + q`; 0 past K.
fn lda(base: u32, kk: u32) -> f32 {
    return select(0.0, A[base + min(kk, P[2] - 1u) * P[4]], kk < P[2]);
}
fn ldb(kk: u32, q: u32) -> f32 {
    return select(0.0, B[bbase + min(kk, P[2] - 1u) * P[5] + min(col * 4u + q, P[1] - 1u) * P[6]], kk < P[2]);
}
",
        )
    } else {
        ("vec4<f32>", "")
    };
    format!(
        "@group(0) @binding(0) var<storage, read> A: array<{operand}>;
@group(0) @binding(1) var<storage, read> B: array<{operand}>;
{c_binding}@group(0) @binding({yb}) var<storage, read_write> Y: array<f32>;
@group(0) @binding({pb}) var<storage, read> P: array<u32>;
var<private> ybase: u32;
var<private> col: u32;
{loads}fn put(row: u32, acc: vec4<f32>, cb: u32) {{
    if (row >= P[0]) {{ return; }}
    for (var q = 0u; q < 4u; q = q + 1u) {{
        let c = col * 4u + q;
        if (c >= P[1]) {{ return; }}
        var v = bitcast<f32>(P[29]) * acc[q];
        {c_term}
        Y[ybase + row * P[1] + c] = v;
    }}
}}
@compute @workgroup_size(64)
fn main(@builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32,
        @builtin(workgroup_id) wid: vec3<u32>) {{
    let M = P[0];
    let K4 = (P[2] + 3u) / 4u;
    {BATCH_OFFSETS}
    let row0 = wid.y * {SG_ROWS}u + sg * {s}u;
    col = wid.x * {s}u + lane;
    ybase = wid.z * M * P[1];
    {a_base}
    {b_loads}
{body}    }}
{store}}}
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::compile::Step;
    use crate::runtime::gpu::wgsl::validate;

    fn spec(m: usize, n: usize, k: usize, a_st: (usize, usize)) -> GemmSpec {
        GemmSpec {
            a: Buf::In(0),
            b: Buf::In(1),
            c: None,
            m,
            n,
            k,
            a_st,
            b_st: (n, 1),
            c_st: (0, 0),
            batch: vec![],
            a_bst: vec![],
            b_bst: vec![],
            c_bst: vec![],
            bases: (0, 0, 0),
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// The kernel a GEMM compiles to: on a device with fixed subgroups the subgroup kernel,
    /// reading aligned operands in vec4s and any others element by element; else the
    /// register-tiled one.
    #[test]
    fn the_subgroup_kernel_takes_every_gemm_on_devices_with_fixed_subgroups() {
        // (on subgroups, element by element, workgroups)
        let kernel = |subgroup: Option<u32>, g: &GemmSpec| {
            let mut c = Compiled { subgroup, ..Compiled::new(vec![(vec![g.m, g.n], ir::DType::Float)]) };
            gemm(&mut c, g, Buf::Out(0)).unwrap();
            let [Step::Launch(l)] = &c.steps[..] else { panic!("{:?}", c.steps) };
            (l.src.contains("subgroupBroadcast"), l.src.contains("fn lda"), l.groups)
        };
        assert_eq!(kernel(Some(8), &spec(70, 36, 12, (12, 1))), (true, false, [2, 2, 1]));
        assert_eq!(kernel(Some(4), &spec(70, 36, 12, (12, 1))), (true, false, [3, 2, 1]));
        assert!(!kernel(None, &spec(70, 36, 12, (12, 1))).0);
        assert!(kernel(Some(8), &spec(70, 36, 10, (10, 1))).1, "reduction of no multiple of 4");
        assert!(kernel(Some(8), &spec(70, 34, 12, (12, 1))).1, "columns of no multiple of 4");
        assert!(!kernel(Some(8), &spec(72, 36, 12, (1, 72))).1, "transposed A");
        assert!(kernel(Some(8), &spec(70, 36, 12, (1, 70))).1, "transposed A of no multiple of 4 rows");
        let mut bt = spec(70, 36, 12, (12, 1));
        bt.b_st = (1, 12);
        assert!(!kernel(Some(8), &bt).1, "transposed B");
        bt.n = 34;
        assert_eq!(kernel(Some(8), &bt), (true, false, [2, 2, 1]), "transposed B of columns of no multiple of 4");
        bt.b_st = (1, 14);
        assert!(kernel(Some(8), &bt).1, "transposed B of unaligned columns");
        let mut offset = spec(70, 36, 12, (12, 1));
        offset.bases.0 = 6;
        assert!(kernel(Some(8), &offset).1, "A from an unaligned offset");
        // A long reduction: its chunks on the subgroup kernel (whole vec4s each), then their sum.
        let mut c = Compiled { subgroup: Some(8), ..Compiled::new(vec![(vec![66, 20], ir::DType::Float)]) };
        gemm(&mut c, &spec(66, 20, 8300, (8300, 1)), Buf::Out(0)).unwrap();
        let [Step::Launch(chunks), Step::Launch(_)] = &c.steps[..] else { panic!("{:?}", c.steps) };
        assert!(chunks.src.contains("subgroupBroadcast"));
        assert_eq!((chunks.groups, chunks.params[31]), ([1, 2, 5], 1660));
    }

    #[test]
    fn gemm_kernels_validate() {
        validate("gemm_rt_split", &gemm_rt_src(false, true));
        for c in [false, true] {
            validate("gemm", &gemm_src(c));
            validate("gemm_rt", &gemm_rt_src(c, false));
            validate("split_k_sum", &split_k_sum_src(c));
            for s in [4, 8, 16] {
                for (at, bt, scalar) in [
                    (false, false, false),
                    (true, false, false),
                    (false, true, false),
                    (true, true, false),
                    (false, false, true),
                ] {
                    for split in [false, true] {
                        validate("gemm_sg", &gemm_sg_src(s, SgGemm { with_c: c, split, at, bt, scalar }));
                    }
                }
            }
        }
    }
}
