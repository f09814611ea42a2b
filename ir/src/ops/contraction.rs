//! Contractions: `MatMul` (batched, broadcast, 1-D operands promoted), `Gemm` and `Einsum`.
//!
//! Their iteration spaces are PaSE's: batch dims, rows `m`, columns `n` (output features) and
//! the summed `k` (input features) — splitting `k` leaves partial sums. Their backward pass
//! computes a data gradient and a weight gradient, each as many FLOPs as the forward.

use std::borrow::Cow;
use std::collections::HashMap;

use super::flow::flow_positional;
use super::grad::GradCx;
use super::util::{bcast_shapes, broadcast_index, broadcast_shapes, broadcast_walk, join};
use super::{Arity, Arrays, Backward, EvalCx, FlowCx, InferCx, MANY, NodeCx, OpRules, TypeRule, Types, Work};
use crate::array::{Array, Data, EvalError, numel, strides};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace, par};
use crate::ops::shape::transpose;
use crate::types::Dim;

type Result<T> = std::result::Result<T, EvalError>;

fn contraction(fwd: f64, inputs: Vec<usize>, bias: Option<usize>) -> Option<Work> {
    Some(Work { fwd_flops: fwd, backward: Backward::Contraction { inputs, bias }, launches: 1.0, parallel: None })
}

fn out_feature(name: &str, size: i64) -> IterDim {
    IterDim { name: name.into(), size, kind: DimKind::Parallel, role: DimRole::OutFeature }
}

fn in_feature(name: &str, size: i64) -> IterDim {
    IterDim { name: name.into(), size, kind: DimKind::Reduction, role: DimRole::InFeature }
}

/// Whether a MatMul's B (local dims `b`) has no batch of its own, so that A's batch folds
/// into the rows of one GEMM product.
pub fn shared_b<T: Copy + PartialEq + From<u8>>(b: &[T]) -> bool {
    b.len() <= 2 || b[..b.len() - 2].iter().all(|&d| d == T::from(1))
}

impl OpRules for op::MatMul {
    fn matrix_units(&self) -> bool {
        true
    }

    fn gemm(&self, x: &[f64], w: Option<&[f64]>, y: &[f64]) -> Option<(f64, f64, f64)> {
        let (m, n) = match y {
            [.., m, n] => (*m, *n),
            _ => (1.0, y.last().copied().unwrap_or(1.0)),
        };
        // A B without batch dims of its own is shared: the kernel folds A's batch into the
        // rows of one GEMM (`[64, 1, 512]·[512, 1536]` is 64 rows, not 64 GEMMs of one).
        let m = if w.is_some_and(shared_b::<f64>) && y.len() >= 2 { y[..y.len() - 1].iter().product() } else { m };
        Some((m, n, x.last().copied().unwrap_or(1.0)))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::Same(vec![0, 1])
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(a), Some(b)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        cx.one(Some(matmul_dims(a, b)?))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (a, b, out) = (cx.in_dims(0), cx.in_dims(1), cx.out_dims(0));
        if a.len() < 2 || b.len() < 2 {
            return Some(IterSpace::whole(cx));
        }
        let r = out.len();
        let batch = r - 2;
        let mut sd: Vec<IterDim> = (0..batch).map(|i| par(format!("b{i}"), out[i])).collect();
        sd.push(par("m", out[batch]));
        sd.push(out_feature("n", out[batch + 1]));
        sd.push(in_feature("k", a[a.len() - 1]));
        let (m, nn, k) = (batch, batch + 1, batch + 2);
        let map_batch = |d: &[i64]| -> Vec<Option<usize>> {
            let nb = d.len() - 2;
            (0..nb)
                .map(|t| {
                    let i = t + batch - nb;
                    (d[t] == out[i] && d[t] != 1).then_some(i)
                })
                .collect()
        };
        let mut am = map_batch(&a);
        am.extend([Some(m), Some(k)]);
        let mut bm = map_batch(&b);
        bm.extend([Some(k), Some(nn)]);
        let om: Vec<Option<usize>> = (0..r).map(|i| (out[i] != 1 || i >= batch).then_some(i)).collect();
        Some(IterSpace { dims: sd, inputs: vec![Some(am), Some(bm)], outputs: vec![om] })
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let k = cx.ty(cx.input(0)).and_then(|t| t.dims.as_ref()).and_then(|d| d.last()).and_then(Dim::value);
        contraction(2.0 * cx.out_numel(0) * k.unwrap_or(0) as f64, vec![0, 1], None)
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(matmul_grad(cx))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![matmul(cx.req(0)?, cx.req(1)?)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (a, b, ao, bo) = (cx.in_m(0)?, cx.in_m(1)?, cx.in_old(0)?, cx.in_old(1)?);
        let (ia, ib) = (cx.input(0)?, cx.input(1)?);
        if !ao.is_empty() && bo.len() >= 2 {
            cx.unify((ia, ao.len() - 1), (ib, bo.len() - 2));
        }
        let out_old = cx.out_old();
        let r = out_old.len();
        let mut m = vec![super::Mono::Opaque; r];
        // Batch dims broadcast; M from A, N from B.
        let batch = r.saturating_sub(2);
        if ao.len() >= 2 && bo.len() >= 2 {
            for i in 0..batch {
                let pick = |mm: &[super::Mono], oo: &[i64]| -> Option<super::Mono> {
                    let off = batch.checked_sub(oo.len() - 2)?;
                    (i >= off && oo[i - off] == out_old[i]).then(|| mm[i - off].clone())
                };
                m[i] = match (pick(&a, &ao), pick(&b, &bo)) {
                    (Some(x), _) if x.is_tracked() => x,
                    (_, Some(y)) if y.is_tracked() => y,
                    _ => super::Mono::constant(out_old[i]),
                };
            }
            m[r - 2] = a[ao.len() - 2].clone();
            m[r - 1] = b[bo.len() - 1].clone();
        } else if ao.len() == 1 && r >= 1 {
            m = (0..r).map(|i| if i + 2 <= bo.len() { b[i].clone() } else { b[bo.len() - 1].clone() }).collect();
            m.truncate(r);
        } else if bo.len() == 1 && r >= 1 {
            m = a[..r].to_vec();
        }
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::Gemm {
    fn matrix_units(&self) -> bool {
        true
    }

    fn gemm(&self, x: &[f64], _w: Option<&[f64]>, y: &[f64]) -> Option<(f64, f64, f64)> {
        let k = if self.trans_a() != 0 { x.first() } else { x.get(1) };
        Some((y.first().copied().unwrap_or(1.0), y.get(1).copied().unwrap_or(1.0), k.copied().unwrap_or(1.0)))
    }

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::Same(vec![0, 1, 2])
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(a), Some(b)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        if a.len() != 2 || b.len() != 2 {
            return Err(format!("Gemm needs 2-D inputs, got [{}] and [{}]", join(a), join(b)));
        }
        let (m, ka) = if self.trans_a() != 0 { (&a[1], &a[0]) } else { (&a[0], &a[1]) };
        let (kb, nn) = if self.trans_b() != 0 { (&b[1], &b[0]) } else { (&b[0], &b[1]) };
        if let (Some(p), Some(q)) = (ka.value(), kb.value())
            && p != q
        {
            return Err(format!("inner dims differ: A is [{}], B is [{}]", join(a), join(b)));
        }
        let out = vec![m.clone(), nn.clone()];
        if let Some(c) = cx.dims(2) {
            bcast_shapes(&out, c).map_err(|e| format!("C does not broadcast to the result: {e}"))?;
        }
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (a, out) = (cx.in_dims(0), cx.out_dims(0));
        if a.len() != 2 || out.len() != 2 {
            return Some(IterSpace::whole(cx));
        }
        let k_size = if self.trans_a() != 0 { a[0] } else { a[1] };
        let sd = vec![par("m", out[0]), out_feature("n", out[1]), in_feature("k", k_size)];
        let am = if self.trans_a() != 0 { vec![Some(2), Some(0)] } else { vec![Some(0), Some(2)] };
        let bm = if self.trans_b() != 0 { vec![Some(1), Some(2)] } else { vec![Some(2), Some(1)] };
        let cm = cx.input(2).map(|_| {
            let c = cx.in_dims(2);
            c.iter()
                .enumerate()
                .map(|(t, &sz)| {
                    let i = t + 2 - c.len();
                    (sz == out[i] && sz != 1).then_some(i)
                })
                .collect()
        });
        Some(IterSpace { dims: sd, inputs: vec![Some(am), Some(bm), cm], outputs: vec![vec![Some(0), Some(1)]] })
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let y = cx.out_numel(0);
        let k = cx
            .ty(cx.input(0))
            .and_then(|t| t.static_dims())
            .map(|d| if self.trans_a() != 0 { d[0] } else { d[d.len() - 1] })
            .unwrap_or(0) as f64;
        let bias = cx.input(2).is_some();
        contraction(2.0 * y * k + if bias { y } else { 0.0 }, vec![0, 1], bias.then_some(2))
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(gemm_grad(self, cx))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![gemm(self, cx)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (a, b) = (cx.in_m(0)?, cx.in_m(1)?);
        if a.len() != 2 || b.len() != 2 {
            return Some(());
        }
        let (mi, ka) = if self.trans_a() != 0 { (1, 0) } else { (0, 1) };
        let (kb, ni) = if self.trans_b() != 0 { (1, 0) } else { (0, 1) };
        let (ia, ib) = (cx.input(0)?, cx.input(1)?);
        cx.unify((ia, ka), (ib, kb));
        cx.set(0, vec![a[mi].clone(), b[ni].clone()]);
        Some(())
    }
}

impl OpRules for op::Einsum {
    fn matrix_units(&self) -> bool {
        true
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(einsum_grad(self.equation.as_deref().unwrap_or(""), cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, MANY, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dims: Option<Vec<&Vec<Dim>>> = (0..cx.ins.len()).map(|i| cx.dims(i)).collect();
        let Some(dims) = dims else { return cx.one(None) };
        let ranks: Vec<usize> = dims.iter().map(|d| d.len()).collect();
        let (terms, out) = einsum_terms(self.equation.as_deref().unwrap_or(""), &ranks)?;
        let mut size: HashMap<char, Dim> = HashMap::new();
        for (term, d) in terms.iter().zip(&dims) {
            if term.chars().count() != d.len() {
                return Err(format!("Einsum term `{term}` does not fit rank {}", d.len()));
            }
            for (c, dim) in term.chars().zip(d.iter()) {
                let e = size.entry(c).or_insert(dim.clone());
                if *e == Dim::Fixed(1) {
                    *e = dim.clone();
                }
            }
        }
        cx.one(Some(out.chars().map(|c| size.get(&c).cloned().unwrap_or(Dim::Unknown)).collect()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    /// An upper bound: 2 × the larger of the output and the largest input.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let biggest = (0..cx.n_in()).map(|i| cx.in_numel(i)).fold(0.0, f64::max);
        contraction(2.0 * biggest.max(cx.out_numel(0)), (0..cx.n_in()).collect(), None)
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![einsum(self.equation.as_deref().unwrap_or(""), &cx.all())?])
    }

    /// Each output dim follows its letter's dim in the operands (a tracked one where any is,
    /// the letter's dims unified across operands where they are not broadcast 1s).
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let n = cx.inputs().len();
        let monos: Vec<Vec<super::Mono>> = (0..n).map(|i| cx.in_m(i)).collect::<Option<_>>()?;
        let olds: Vec<Vec<i64>> = (0..n).map(|i| cx.in_old(i)).collect::<Option<_>>()?;
        let ranks: Vec<usize> = olds.iter().map(Vec::len).collect();
        let Ok((terms, out)) = einsum_terms(self.equation.as_deref().unwrap_or(""), &ranks) else {
            cx.opaque_outputs();
            return Some(());
        };
        // Per letter, the (operand, axis) places it has, broadcast 1s left out.
        let mut places: HashMap<char, Vec<(usize, usize)>> = HashMap::new();
        for (i, t) in terms.iter().enumerate() {
            for (a, c) in t.chars().enumerate() {
                if olds[i].get(a).is_some_and(|&d| d != 1) {
                    places.entry(c).or_default().push((i, a));
                }
            }
        }
        let inputs = cx.inputs();
        for ps in places.values() {
            for w in ps.windows(2) {
                cx.unify((inputs[w[0].0], w[0].1), (inputs[w[1].0], w[1].1));
            }
        }
        let m: Vec<super::Mono> = out
            .chars()
            .map(|c| {
                let ps = places.get(&c).map(Vec::as_slice).unwrap_or(&[]);
                ps.iter()
                    .map(|&(i, a)| monos[i][a].clone())
                    .find(super::Mono::is_tracked)
                    .or_else(|| ps.first().map(|&(i, a)| monos[i][a].clone()))
                    .unwrap_or(super::Mono::constant(1))
            })
            .collect();
        cx.set(0, m);
        Some(())
    }
}

/// Reduction lengths above which the runtime's GEMM kernel computes an unbatched GEMM (one
/// product, a batch folded into its rows) in chunks of at most [`SPLIT_K_LEN`] and sums their
/// partial products (split-K). It runs a workgroup's rows a SIMD batch at a time on a CPU
/// driver, each batch streaming the workgroup's strip of B (`K` × 32 columns) again: up to a
/// few MB the strip stays in the caches between batches, beyond it does not — on the
/// development machine (lavapipe, 2 cores) `[64×16384]·[16384×768]` ran at 4.0 GFLOP/s and
/// `[32×32768]·[32768×768]` (a language model's output-head gradient is that shape) at 2.0
/// against 5.4–5.8 for square and 4096-long reductions; split into chunks of 2048 at 4.5 and
/// 4.7 (chunks of 4096: 4.0 and 4.2). A barrier per chunk of the reduction instead (the
/// batches taking each chunk in turn while it is cached) ran at 1.7–1.9: barriers cost more
/// than the misses on that driver.
pub const SPLIT_K_FROM: usize = 8192;
/// The longest chunk of a split reduction (a workgroup's strip of B: 256 KB).
pub const SPLIT_K_LEN: usize = 2048;

/// The dispatches of one GEMM launch of `batch` products over reductions of `k`: two where
/// the reduction is split ([`SPLIT_K_FROM`]: the chunks' partial products, then their sum),
/// else one. The wgpu runtime compiles this (`codegen::runtime::gpu::gemm`); the cost model
/// prices it.
pub fn gemm_dispatches(batch: usize, k: usize) -> usize {
    if batch <= 1 && k > SPLIT_K_FROM { 2 } else { 1 }
}

/// `[m, k] · [k, n]` of float32, row by row.
fn matmul_f32(x: &[f32], y: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        let orow = &mut out[i * n..(i + 1) * n];
        for p in 0..k {
            let av = x[i * k + p];
            if av == 0.0 {
                continue;
            }
            let brow = &y[p * n..(p + 1) * n];
            for (o, &bv) in orow.iter_mut().zip(brow) {
                *o += av * bv;
            }
        }
    }
    out
}

/// Numpy matmul of float arrays, with 1-D promotion and batch broadcasting.
pub fn matmul(a: &Array, b: &Array) -> Result<Array> {
    if a.dtype != b.dtype {
        return Err(EvalError::Invalid(format!("MatMul of {} and {}", a.dtype, b.dtype)));
    }
    let (mut ash, mut bsh) = (a.shape.clone(), b.shape.clone());
    let (a1, b1) = (ash.len() == 1, bsh.len() == 1);
    if a1 {
        ash.insert(0, 1);
    }
    if b1 {
        bsh.push(1);
    }
    if ash.len() < 2 || bsh.len() < 2 {
        return Err(EvalError::Invalid("MatMul of scalars".into()));
    }
    let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
    let (k2, n) = (bsh[bsh.len() - 2], bsh[bsh.len() - 1]);
    if k != k2 {
        return Err(EvalError::Invalid(format!("MatMul of {:?} and {:?}: inner dims differ", a.shape, b.shape)));
    }
    let abatch = &ash[..ash.len() - 2];
    let bbatch = &bsh[..bsh.len() - 2];
    let batch = broadcast_shapes(abatch, bbatch)?;
    let ia = broadcast_index(&batch, abatch);
    let ib = broadcast_index(&batch, bbatch);
    let nb = numel(&batch);
    let mut out_shape = batch.clone();
    if !a1 {
        out_shape.push(m);
    }
    if !b1 {
        out_shape.push(n);
    }
    match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => {
            let mut out = Vec::with_capacity(nb * m * n);
            for bi in 0..nb {
                let (ao, bo) = (ia[bi] * m * k, ib[bi] * k * n);
                out.extend(matmul_f32(&x[ao..][..m * k], &y[bo..][..k * n], m, k, n));
            }
            Ok(Array { dtype: a.dtype, shape: out_shape, data: Data::F32(out) })
        }
        _ => {
            let (x, y) = (a.to_f64()?, b.to_f64()?);
            let mut out = vec![0f64; nb * m * n];
            for bi in 0..nb {
                let (ao, bo, oo) = (ia[bi] * m * k, ib[bi] * k * n, bi * m * n);
                for i in 0..m {
                    for p in 0..k {
                        let av = x[ao + i * k + p];
                        for j in 0..n {
                            out[oo + i * n + j] += av * y[bo + p * n + j];
                        }
                    }
                }
            }
            match a.data {
                Data::I64(_) => Ok(Array::int(a.dtype, out_shape, out.iter().map(|&v| v as i64).collect())),
                _ => Ok(Array::float(a.dtype, out_shape, out)),
            }
        }
    }
}

/// `op(A) · op(B)` of float32 `[m, k] · [k, n]`, reading the transposed operands where they
/// are (no transposed copies): each output sums its products in ascending `k`, as
/// [`matmul`] does.
fn gemm_f32(a: &[f32], b: &[f32], (m, k, n): (usize, usize, usize), (ta, tb): (bool, bool)) -> Vec<f32> {
    if !ta && !tb {
        return matmul_f32(a, b, m, k, n);
    }
    let mut out = vec![0f32; m * n];
    if !tb {
        // A is [k, m]: row p of B scaled by A's column entries, added to each output row.
        for p in 0..k {
            let brow = &b[p * n..][..n];
            for i in 0..m {
                let av = a[p * m + i];
                out[i * n..][..n].iter_mut().zip(brow).for_each(|(o, &bv)| *o += av * bv);
            }
        }
        return out;
    }
    // B is [n, k]: a block of its rows is turned at a time (a small copy, not all of B),
    // its columns of the output summed row by row as above.
    const BLOCK: usize = 64;
    let mut turned = vec![0f32; k * BLOCK];
    for j0 in (0..n).step_by(BLOCK) {
        let w = BLOCK.min(n - j0);
        for (jj, row) in b[j0 * k..(j0 + w) * k].chunks_exact(k).enumerate() {
            row.iter().enumerate().for_each(|(p, &bv)| turned[p * w + jj] = bv);
        }
        for i in 0..m {
            let orow = &mut out[i * n + j0..][..w];
            for p in 0..k {
                let av = if ta { a[p * m + i] } else { a[i * k + p] };
                orow.iter_mut().zip(&turned[p * w..][..w]).for_each(|(o, &bv)| *o += av * bv);
            }
        }
    }
    out
}

fn gemm(g: &op::Gemm, cx: &EvalCx<'_>) -> Result<Array> {
    let (a, b) = (cx.req(0)?, cx.req(1)?);
    if a.rank() != 2 || b.rank() != 2 {
        return Err(EvalError::Invalid(format!("Gemm needs 2-D inputs, got {:?} and {:?}", a.shape, b.shape)));
    }
    let y = match (&a.data, &b.data) {
        (Data::F32(x), Data::F32(w)) if a.dtype == b.dtype => {
            let (ta, tb) = (g.trans_a() != 0, g.trans_b() != 0);
            let (m, k) = if ta { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
            let (k2, n) = if tb { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
            if k != k2 {
                return Err(EvalError::Invalid(format!("Gemm of {:?} and {:?}: inner dims differ", a.shape, b.shape)));
            }
            Array { dtype: a.dtype, shape: vec![m, n], data: Data::F32(gemm_f32(x, w, (m, k, n), (ta, tb))) }
        }
        _ => {
            fn turned(x: &Array, t: i64) -> Cow<'_, Array> {
                if t != 0 { Cow::Owned(transpose(x, &[1, 0])) } else { Cow::Borrowed(x) }
            }
            matmul(&turned(a, g.trans_a()), &turned(b, g.trans_b()))?
        }
    };
    let (alpha, beta) = (f64::from(g.alpha()), f64::from(g.beta()));
    let c = cx.opt(2);
    if let Some(c) = c
        && broadcast_shapes(&y.shape, &c.shape)? != y.shape
    {
        return Err(EvalError::Invalid(format!("Gemm C {:?} does not broadcast to {:?}", c.shape, y.shape)));
    }
    let Array { dtype, shape, data } = y;
    if let Data::F32(mut v) = data {
        // float32 as the kernels compute it.
        let (alpha, beta) = (alpha as f32, beta as f32);
        if alpha != 1.0 {
            v.iter_mut().for_each(|x| *x *= alpha);
        }
        if let Some(c) = c {
            let cv = c.f32s()?;
            for (o, i) in v.iter_mut().zip(broadcast_walk(&shape, &c.shape)) {
                *o += beta * cv[i];
            }
        }
        return Ok(Array { dtype, shape, data: Data::F32(v) });
    }
    let mut v = Array { dtype, shape: Vec::new(), data }.to_f64()?;
    v.iter_mut().for_each(|x| *x *= alpha);
    if let Some(c) = c {
        let cv = c.to_f64()?;
        for (o, i) in v.iter_mut().zip(broadcast_walk(&shape, &c.shape)) {
            *o += beta * cv[i];
        }
    }
    Ok(Array::float(dtype, shape, v))
}

/// The gradient of an Einsum: for operand `i` with term `t`, `dX_i = Einsum(dY, X_j (j ≠ i) →
/// t)` — each product term of `Y` is linear in `X_i` — over the letters of `t` the output or
/// another operand has; a letter only `t` has was summed over, so its gradient is that
/// einsum broadcast along it; a letter `X_i` broadcasts (size 1 against a larger size
/// elsewhere) is summed back. A letter repeated within a term (a diagonal) has no rule.
fn einsum_grad(equation: &str, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let n = cx.g.node(cx.n).inputs().len();
    let xs: Vec<Value> = (0..n).map(|i| cx.x(i)).collect::<std::result::Result<_, _>>()?;
    let dims: Vec<Vec<i64>> = xs.iter().map(|&x| cx.dims(x)).collect::<std::result::Result<_, _>>()?;
    let ranks: Vec<usize> = dims.iter().map(Vec::len).collect();
    let (terms, out) = einsum_terms(equation, &ranks)?;
    let repeated = |t: &str| t.chars().enumerate().any(|(k, c)| t[..k].contains(c));
    if repeated(&out) || terms.iter().any(|t| repeated(t)) {
        return Err(format!("the gradient of Einsum `{equation}` with an index repeated in a term (a diagonal)"));
    }
    let mut size: HashMap<char, i64> = HashMap::new();
    for (t, d) in terms.iter().zip(&dims) {
        for (c, &e) in t.chars().zip(d) {
            let s = size.entry(c).or_insert(e);
            *s = (*s).max(e);
        }
    }
    for i in 0..n {
        if !cx.want(i) {
            continue;
        }
        let t = &terms[i];
        let elsewhere = |c: char| out.contains(c) || terms.iter().enumerate().any(|(j, u)| j != i && u.contains(c));
        let kept: String = t.chars().filter(|&c| elsewhere(c)).collect();
        let others: Vec<&String> = terms.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, u)| u).collect();
        let lhs: Vec<&str> = std::iter::once(out.as_str()).chain(others.iter().map(|u| u.as_str())).collect();
        let eq = format!("{}->{kept}", lhs.join(","));
        let operands: Vec<Value> = std::iter::once(dy).chain((0..n).filter(|&j| j != i).map(|j| xs[j])).collect();
        let mut g = cx.add1(Op::Einsum(op::Einsum { equation: Some(eq) }), &operands)?;
        // The letters summed over `X_i` alone come back as size-1 dims, broadcast to X_i's.
        if kept.len() != t.len() {
            let with_ones: Vec<i64> = t.chars().map(|c| if kept.contains(c) { size[&c] } else { 1 }).collect();
            g = cx.reshape(g, &with_ones)?;
            let full: Vec<i64> =
                t.chars().zip(&dims[i]).map(|(c, &d)| if kept.contains(c) { size[&c] } else { d }).collect();
            g = cx.expand(g, &full)?;
        }
        let g = cx.sum_to(g, &dims[i])?;
        cx.set(i, g);
    }
    Ok(())
}

/// An Einsum equation with its `...` expanded for inputs of these ranks (into upper-case
/// placeholder letters), and its output term (the implicit one when there is no `->`: the
/// letters used once, in order, after the ellipsis).
fn einsum_terms(equation: &str, ranks: &[usize]) -> std::result::Result<(Vec<String>, String), String> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ranks.len() {
        return Err(format!("Einsum `{equation}` has {} terms for {} inputs", terms.len(), ranks.len()));
    }
    let ell_rank = terms
        .iter()
        .zip(ranks)
        .filter(|(t, _)| t.contains("..."))
        .map(|(t, &r)| (r + 3).saturating_sub(t.len()))
        .max()
        .unwrap_or(0);
    let ell: String = (0..ell_rank).map(|i| (b'A' + i as u8) as char).collect();
    let expand = |t: &str, rank: usize| -> String {
        if let Some(pos) = t.find("...") {
            let k = (rank + 3).saturating_sub(t.len()).min(ell_rank);
            format!("{}{}{}", &t[..pos], &ell[ell_rank - k..], &t[pos + 3..])
        } else {
            t.to_string()
        }
    };
    let terms: Vec<String> = terms.iter().zip(ranks).map(|(t, &r)| expand(t, r)).collect();
    let out_term = match rhs {
        Some(r) => r.replace("...", &ell),
        None => {
            let mut counts = std::collections::BTreeMap::new();
            for t in &terms {
                for c in t.chars() {
                    *counts.entry(c).or_insert(0) += 1;
                }
            }
            let mut s: String = ell.clone();
            s.extend(counts.iter().filter(|(c, n)| **n == 1 && c.is_ascii_lowercase()).map(|(c, _)| *c));
            s
        }
    };
    Ok((terms, out_term))
}

fn einsum(equation: &str, inputs: &[&Array]) -> Result<Array> {
    let ranks: Vec<usize> = inputs.iter().map(|a| a.rank()).collect();
    let (terms, out_term) = einsum_terms(equation, &ranks)?;
    let mut size = std::collections::BTreeMap::new();
    for (t, a) in terms.iter().zip(inputs) {
        if t.len() != a.rank() {
            return Err(EvalError::Invalid(format!("Einsum term `{t}` does not fit rank {}", a.rank())));
        }
        for (c, &d) in t.chars().zip(&a.shape) {
            let e = size.entry(c).or_insert(d);
            if *e == 1 {
                *e = d;
            } else if d != 1 && *e != d {
                return Err(EvalError::Invalid(format!("Einsum index `{c}` has sizes {e} and {d}")));
            }
        }
    }
    let letters: Vec<char> = size.keys().copied().collect();
    let dims: Vec<usize> = letters.iter().map(|c| size[c]).collect();
    let pos = |c: char| letters.iter().position(|&l| l == c).expect("letter collected");
    let vals: Vec<Vec<f64>> = inputs.iter().map(|a| a.to_f64()).collect::<Result<_>>()?;
    let in_maps: Vec<Vec<(usize, usize)>> = terms
        .iter()
        .zip(inputs)
        .map(|(t, a)| {
            let st = strides(&a.shape);
            t.chars().enumerate().map(|(i, c)| (pos(c), if a.shape[i] == 1 { 0 } else { st[i] })).collect()
        })
        .collect();
    let out_shape: Vec<usize> = out_term.chars().map(|c| size[&c]).collect();
    let ost = strides(&out_shape);
    let out_map: Vec<(usize, usize)> = out_term.chars().enumerate().map(|(i, c)| (pos(c), ost[i])).collect();
    let mut out = vec![0.0; numel(&out_shape)];
    let total = numel(&dims);
    let mut counter = vec![0usize; dims.len()];
    for _ in 0..total {
        let mut prod = 1.0;
        for (v, m) in vals.iter().zip(&in_maps) {
            let off: usize = m.iter().map(|&(l, s)| counter[l] * s).sum();
            prod *= v[off];
        }
        let o: usize = out_map.iter().map(|&(l, s)| counter[l] * s).sum();
        out[o] += prod;
        for d in (0..dims.len()).rev() {
            counter[d] += 1;
            if counter[d] < dims[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(Array::float(inputs[0].dtype, out_shape, out))
}

/// The last two dims swapped.
fn swap_last(rank: usize) -> Vec<i64> {
    let mut p: Vec<i64> = (0..rank as i64).collect();
    p.swap(rank - 2, rank - 1);
    p
}

/// MatMul: `dA = dY·Bᵀ`, `dB = Aᵀ·dY`, summed over broadcast batch dims; 1-D operands are
/// promoted as the forward promotes them.
fn matmul_grad(cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (a, b) = (cx.x(0)?, cx.x(1)?);
    let (ad, bd) = (cx.dims(a)?, cx.dims(b)?);
    if ad.len() >= 2 && bd.len() == 2 {
        return shared_weight_matmul_grad(cx, dy, (a, &ad), (b, &bd));
    }
    let a2d = if ad.len() == 1 { vec![1, ad[0]] } else { ad.clone() };
    let b2d = if bd.len() == 1 { vec![bd[0], 1] } else { bd.clone() };
    let batch = bcast_shapes(
        &a2d[..a2d.len() - 2].iter().map(|&d| Dim::Fixed(d)).collect::<Vec<_>>(),
        &b2d[..b2d.len() - 2].iter().map(|&d| Dim::Fixed(d)).collect::<Vec<_>>(),
    )?;
    let mut y2d: Vec<i64> = batch.iter().map(|d| d.value().unwrap_or(1)).collect();
    y2d.push(a2d[a2d.len() - 2]);
    y2d.push(b2d[b2d.len() - 1]);
    let dy2 = cx.reshape(dy, &y2d)?;
    if cx.want(0) {
        let b2 = cx.reshape(b, &b2d)?;
        let bt = cx.transpose(b2, &swap_last(b2d.len()))?;
        let da = cx.add1(crate::graph::op::Op::MatMul(op::MatMul::default()), &[dy2, bt])?;
        let da = cx.sum_to(da, &a2d)?;
        let da = cx.reshape(da, &ad)?;
        cx.set(0, da);
    }
    if cx.want(1) {
        let a2 = cx.reshape(a, &a2d)?;
        let at = cx.transpose(a2, &swap_last(a2d.len()))?;
        let db = cx.add1(crate::graph::op::Op::MatMul(op::MatMul::default()), &[at, dy2])?;
        let db = cx.sum_to(db, &b2d)?;
        let db = cx.reshape(db, &bd)?;
        cx.set(1, db);
    }
    Ok(())
}

/// `Y = A·W` with a matrix `W` every row of `A`'s batch shares (a linear layer over a
/// sequence): A's batch is rows of one GEMM, so with `A` as `[R, K]` and dY as `[R, N]`,
/// `dA = dY·Wᵀ` and `dW = Aᵀ·dY` are two `Gemm`s reading their operands transposed — no
/// transpose kernels, and the weight's gradient summed over the rows by the GEMM's own
/// reduction rather than per batch entry and then reduced.
fn shared_weight_matmul_grad(
    cx: &mut GradCx<'_>,
    dy: Value,
    (a, ad): (Value, &[i64]),
    (b, bd): (Value, &[i64]),
) -> std::result::Result<(), String> {
    let rows: i64 = ad[..ad.len() - 1].iter().product();
    let (k, n) = (bd[0], bd[1]);
    let gemm =
        |t_a: i64, t_b: i64| Op::Gemm(op::Gemm { alpha: None, beta: None, trans_a: Some(t_a), trans_b: Some(t_b) });
    let dy2 = cx.reshape(dy, &[rows, n])?;
    if cx.want(0) {
        let da = cx.add1(gemm(0, 1), &[dy2, b])?;
        let da = cx.reshape(da, ad)?;
        cx.set(0, da);
    }
    if cx.want(1) {
        let a2 = cx.reshape(a, &[rows, k])?;
        let db = cx.add1(gemm(1, 0), &[a2, dy2])?;
        cx.set(1, db);
    }
    Ok(())
}

/// Gemm `Y = α·A'B' + β·C`: the gradients as Gemms with the transposes arranged so no
/// transpose op is needed.
fn gemm_grad(gm: &op::Gemm, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    use crate::graph::op::Op;
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (a, b) = (cx.x(0)?, cx.x(1)?);
    let (ta, tb, alpha) = (gm.trans_a(), gm.trans_b(), gm.alpha());
    let gemm = |t_a: i64, t_b: i64| {
        Op::Gemm(op::Gemm { alpha: Some(alpha), beta: None, trans_a: Some(t_a), trans_b: Some(t_b) })
    };
    if cx.want(0) {
        // A' = dY·B'ᵀ (transA = 0), A = (A')ᵀ = B'·dYᵀ (transA = 1).
        let da = if ta == 0 { cx.add1(gemm(0, 1 - tb), &[dy, b])? } else { cx.add1(gemm(tb, 1), &[b, dy])? };
        cx.set(0, da);
    }
    if cx.want(1) {
        // B' = A'ᵀ·dY (transB = 0), B = (B')ᵀ = dYᵀ·A' (transB = 1).
        let db = if tb == 0 { cx.add1(gemm(1 - ta, 0), &[a, dy])? } else { cx.add1(gemm(1, ta), &[dy, a])? };
        cx.set(1, db);
    }
    if cx.want(2) {
        let d = cx.scale(dy, f64::from(gm.beta()))?;
        cx.set_broadcast(2, d)?;
    }
    Ok(())
}

impl OpRules for op::Det {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        if d.len() < 2 {
            return Err(format!("Det needs square matrices [.., M, M], got rank {}", d.len()));
        }
        cx.one(Some(d[..d.len() - 2].to_vec()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let d = cx.in_dims(0);
        let m = *d.last()? as f64;
        Work::flops(cx.out_numel(0).max(1.0) * 2.0 / 3.0 * m * m * m)
    }

    /// By LU decomposition with partial pivoting, per matrix.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let r = x.rank();
        if r < 2 || x.shape[r - 1] != x.shape[r - 2] {
            return Err(EvalError::Invalid(format!("Det needs square matrices, got {:?}", x.shape)));
        }
        let m = x.shape[r - 1];
        let v = x.to_f64()?;
        let out: Vec<f64> = v
            .chunks(m * m)
            .map(|a| {
                let mut a = a.to_vec();
                let mut det = 1.0;
                for c in 0..m {
                    let p = (c..m).max_by(|&i, &j| a[i * m + c].abs().total_cmp(&a[j * m + c].abs())).unwrap_or(c);
                    if a[p * m + c] == 0.0 {
                        return 0.0;
                    }
                    if p != c {
                        for k in 0..m {
                            a.swap(p * m + k, c * m + k);
                        }
                        det = -det;
                    }
                    det *= a[c * m + c];
                    for i in c + 1..m {
                        let f = a[i * m + c] / a[c * m + c];
                        for k in c..m {
                            a[i * m + k] -= f * a[c * m + k];
                        }
                    }
                }
                det
            })
            .collect();
        Ok(vec![Array::float(x.dtype, x.shape[..r - 2].to_vec(), out)])
    }

    /// `∂det(A)/∂A[i, j]` is the cofactor `(−1)^(i+j) · det(A without row i and column j)`
    /// (`det(A) · A⁻ᵀ` where A is invertible, and right where it is not). The `M²` minors
    /// come from two Gathers of constant index lists (row `i` lists every row but `i`), a
    /// Transpose to `[.., i, j, M−1, M−1]` and one Det; `dA = dY · cofactors`.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let a = cx.x(0)?;
            let ad = cx.dims(a)?;
            let r = ad.len();
            if r < 2 || ad[r - 1] != ad[r - 2] || ad[r - 1] < 1 {
                return Err(format!("Det's gradient: an input of {ad:?}"));
            }
            let m = ad[r - 1];
            let mut unit = ad[..r - 2].to_vec();
            unit.extend([1, 1]);
            let dyu = cx.reshape(dy, &unit)?;
            if m == 1 {
                // The cofactor of a 1×1 matrix is the empty minor's determinant, 1.
                cx.set(0, dyu);
                return Ok(());
            }
            let others: Vec<i64> = (0..m).flat_map(|i| (0..m).filter(move |&k| k != i)).collect();
            let idx = cx.constant(Array::i64(vec![m as usize, m as usize - 1], others));
            let gather = |axis: usize| Op::Gather(op::Gather { axis: Some(axis as i64) });
            let rows = cx.add1(gather(r - 2), &[a, idx])?;
            let minors = cx.add1(gather(r), &[rows, idx])?;
            let mut perm: Vec<i64> = (0..r as i64 - 2).collect();
            perm.extend([r as i64 - 2, r as i64, r as i64 - 1, r as i64 + 1]);
            let minors = cx.transpose(minors, &perm)?;
            let dets = cx.add1(Op::Det(op::Det {}), &[minors])?;
            let m = m as usize;
            let sign: Vec<f64> =
                (0..m * m).map(|p| if (p / m + p % m).is_multiple_of(2) { 1.0 } else { -1.0 }).collect();
            let sign = cx.constant(Array::float(cx.dtype(dy), vec![m, m], sign));
            let cof = cx.mul(dets, sign)?;
            let d = cx.mul(cof, dyu)?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

/// The output dims of `A × B` (numpy matmul: vectors promoted, batch dims broadcast).
pub(crate) fn matmul_dims(a: &[Dim], b: &[Dim]) -> std::result::Result<Vec<Dim>, String> {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    let (a1, b1) = (a.len() == 1, b.len() == 1);
    if a1 {
        a.insert(0, Dim::Fixed(1));
    }
    if b1 {
        b.push(Dim::Fixed(1));
    }
    if a.len() < 2 || b.len() < 2 {
        return Err("MatMul needs inputs of rank ≥ 1".into());
    }
    let (ka, kb) = (&a[a.len() - 1], &b[b.len() - 2]);
    if let (Some(p), Some(q)) = (ka.value(), kb.value())
        && p != q
    {
        return Err(format!("inner dims differ: [{}] x [{}]", join(&a), join(&b)));
    }
    let mut out = bcast_shapes(&a[..a.len() - 2], &b[..b.len() - 2])?;
    if !a1 {
        out.push(a[a.len() - 2].clone());
    }
    if !b1 {
        out.push(b[b.len() - 1].clone());
    }
    Ok(out)
}
