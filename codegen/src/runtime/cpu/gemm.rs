//! The CPU executor's matrix products: `MatMul` and `Gemm` of float32 arrays by
//! `matrixmultiply`'s packed, vectorised SGEMM (the instruction set detected at run time),
//! instead of the reference evaluator's row-by-row loops (`ir::eval`), which stay the truth
//! they are checked against. Other types, and a `Gemm` whose `C` broadcasts in another way
//! than a row, a column or a scalar, run the reference kernel.
//!
//! Each output sums its products in ascending `k` in packed blocks, whatever the operands'
//! strides: the results differ from the reference's in rounding only.

use ir::eval::{Array, Data, broadcast_index, broadcast_shapes};

/// A row-major float32 matrix view: `rows × cols` at `offset`, transposed when `t` (stored
/// `cols × rows`).
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub t: bool,
}

impl Mat<'_> {
    /// Row and column strides.
    fn strides(&self) -> (isize, isize) {
        if self.t { (1, self.rows as isize) } else { (self.cols as isize, 1) }
    }
}

/// `out[..m·n] = alpha · A · B` (A `m × k`, B `k × n`).
fn sgemm(alpha: f32, a: Mat<'_>, b: Mat<'_>, out: &mut [f32]) {
    sgemm_acc(alpha, a, b, 0.0, out);
}

/// `out[..m·n] = alpha · A · B + beta · out` (A `m × k`, B `k × n`; `beta` 0 ignores what
/// `out` held).
pub(super) fn sgemm_acc(alpha: f32, a: Mat<'_>, b: Mat<'_>, beta: f32, out: &mut [f32]) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(b.rows == k && out.len() == m * n, "sgemm shapes");
    assert!(a.offset + m * k <= a.data.len() && b.offset + k * n <= b.data.len(), "sgemm operands");
    if m == 0 || n == 0 {
        return;
    }
    let ((rsa, csa), (rsb, csb)) = (a.strides(), b.strides());
    // SAFETY: A's elements are read at `a.offset + i·rsa + p·csa` for `i < m`, `p < k`: below
    // `a.offset + m·k`, which is in bounds (asserted); likewise B's below `b.offset + k·n`;
    // `out` holds `m·n` elements, written at `i·n + j`. `out` is a unique borrow: no aliasing.
    #[allow(unsafe_code)]
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr().add(a.offset),
            rsa,
            csa,
            b.data.as_ptr().add(b.offset),
            rsb,
            csb,
            beta,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Numpy `MatMul` of two float32 arrays (batch dims broadcast, 1-D operands promoted);
/// `None` for other types.
pub fn matmul(a: &Array, b: &Array) -> Option<Result<Array, String>> {
    let (Data::F32(x), Data::F32(y)) = (&a.data, &b.data) else { return None };
    if a.dtype != b.dtype || a.rank() == 0 || b.rank() == 0 {
        return None;
    }
    let (mut ash, mut bsh) = (a.shape.clone(), b.shape.clone());
    let (a1, b1) = (ash.len() == 1, bsh.len() == 1);
    if a1 {
        ash.insert(0, 1);
    }
    if b1 {
        bsh.push(1);
    }
    let (m, k) = (ash[ash.len() - 2], ash[ash.len() - 1]);
    let (k2, n) = (bsh[bsh.len() - 2], bsh[bsh.len() - 1]);
    if k != k2 {
        return Some(Err(format!("MatMul of {:?} and {:?}: inner dims differ", a.shape, b.shape)));
    }
    let (abatch, bbatch) = (&ash[..ash.len() - 2], &bsh[..bsh.len() - 2]);
    let batch = match broadcast_shapes(abatch, bbatch) {
        Ok(s) => s,
        Err(e) => return Some(Err(e.to_string())),
    };
    let (ia, ib) = (broadcast_index(&batch, abatch), broadcast_index(&batch, bbatch));
    let mut out = vec![0f32; ia.len() * m * n];
    if bbatch.iter().product::<usize>() == 1 && !a1 {
        // One weight for every batch: one product of all the rows.
        let rows = ia.len() * m;
        if abatch.iter().product::<usize>() == ia.len() {
            sgemm(1.0, mat(x, 0, rows, k), mat(y, 0, k, n), &mut out);
            return Some(Ok(shaped(batch, a1, b1, m, n, out)));
        }
    }
    for (i, o) in out.chunks_exact_mut((m * n).max(1)).enumerate().take(ia.len()) {
        sgemm(1.0, mat(x, ia[i] * m * k, m, k), mat(y, ib[i] * k * n, k, n), o);
    }
    Some(Ok(shaped(batch, a1, b1, m, n, out)))
}

pub(super) fn mat(data: &[f32], offset: usize, rows: usize, cols: usize) -> Mat<'_> {
    Mat { data, offset, rows, cols, t: false }
}

/// The output array of a `MatMul` over batch dims `batch` (promoted dims dropped).
fn shaped(mut shape: Vec<usize>, a1: bool, b1: bool, m: usize, n: usize, out: Vec<f32>) -> Array {
    if !a1 {
        shape.push(m);
    }
    if !b1 {
        shape.push(n);
    }
    Array::f32(shape, out)
}

/// `Gemm` of float32 `A`, `B` and optional `C`; `None` for other types or a `C` that is not
/// a scalar, a row of `n`, a column of `m` or `m × n`.
pub fn gemm(g: &ir::op::Gemm, a: &Array, b: &Array, c: Option<&Array>) -> Option<Result<Array, String>> {
    let (Data::F32(x), Data::F32(y)) = (&a.data, &b.data) else { return None };
    if a.dtype != b.dtype || a.rank() != 2 || b.rank() != 2 {
        return None;
    }
    let (ta, tb) = (g.trans_a() != 0, g.trans_b() != 0);
    let (m, k) = if ta { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
    let (k2, n) = if tb { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
    if k != k2 {
        return Some(Err(format!("Gemm of {:?} and {:?}: inner dims differ", a.shape, b.shape)));
    }
    let c = match c {
        None => None,
        Some(Array { data: Data::F32(v), shape, dtype }) if *dtype == a.dtype => Some((v, bias_kind(shape, m, n)?)),
        Some(_) => return None,
    };
    let mut out = vec![0f32; m * n];
    let am = Mat { data: x, offset: 0, rows: m, cols: k, t: ta };
    let bm = Mat { data: y, offset: 0, rows: k, cols: n, t: tb };
    sgemm(g.alpha(), am, bm, &mut out);
    if let Some((v, kind)) = c {
        let beta = g.beta();
        for (idx, o) in out.iter_mut().enumerate() {
            let (i, j) = (idx / n.max(1), idx % n.max(1));
            let cv = match kind {
                Bias::Scalar => v[0],
                Bias::Row => v[j],
                Bias::Column => v[i],
                Bias::Full => v[idx],
            };
            *o += beta * cv;
        }
    }
    Some(Ok(Array::f32(vec![m, n], out)))
}

/// How a `Gemm`'s `C` broadcasts to `m × n`.
#[derive(Clone, Copy)]
enum Bias {
    Scalar,
    Row,
    Column,
    Full,
}

fn bias_kind(shape: &[usize], m: usize, n: usize) -> Option<Bias> {
    let numel: usize = shape.iter().product();
    match shape {
        _ if numel == 1 && shape.len() <= 2 => Some(Bias::Scalar),
        [c] | [1, c] if *c == n => Some(Bias::Row),
        [r, 1] if *r == m => Some(Bias::Column),
        [r, c] if *r == m && *c == n => Some(Bias::Full),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(shape: &[usize], seed: usize) -> Array {
        let n: usize = shape.iter().product();
        Array::f32(shape.to_vec(), (0..n).map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) * 0.07).collect())
    }

    fn close(x: &Array, y: &Array) {
        assert_eq!(x.shape, y.shape);
        let (Data::F32(a), Data::F32(b)) = (&x.data, &y.data) else { panic!("float32") };
        for (p, q) in a.iter().zip(b) {
            assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{p} vs {q}");
        }
    }

    #[test]
    fn matmul_equals_the_reference_for_every_shape_kind() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[5, 7], &[7, 3]),
            (&[2, 3, 5, 7], &[7, 4]),
            (&[2, 3, 5, 7], &[2, 3, 7, 4]),
            (&[3, 1, 5, 7], &[1, 4, 7, 2]),
            (&[1, 5, 7], &[6, 7, 3]),
            (&[7], &[7, 3]),
            (&[4, 5, 7], &[7]),
            (&[7], &[7]),
            (&[0, 7], &[7, 3]),
            (&[64, 300], &[300, 129]),
        ];
        for (i, (sa, sb)) in cases.iter().enumerate() {
            let (a, b) = (filled(sa, i), filled(sb, i + 1));
            let fast = matmul(&a, &b).unwrap().unwrap();
            close(&fast, &ir::eval::matmul(&a, &b).unwrap());
        }
        assert!(matmul(&filled(&[2, 3], 0), &filled(&[4, 5], 0)).unwrap().is_err());
        let ints = Array::i64(vec![2, 2], vec![1, 2, 3, 4]);
        assert!(matmul(&ints, &ints).is_none());
    }

    #[test]
    fn gemm_equals_the_reference_under_transposes_and_biases() {
        let (m, k, n) = (6, 9, 5);
        for (ta, tb) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
            for c in [None, Some(vec![1]), Some(vec![n]), Some(vec![1, n]), Some(vec![m, 1]), Some(vec![m, n])] {
                let g = ir::op::Gemm { alpha: Some(0.5), beta: Some(2.0), trans_a: Some(ta), trans_b: Some(tb) };
                let a = filled(&if ta == 1 { [k, m] } else { [m, k] }, 1);
                let b = filled(&if tb == 1 { [n, k] } else { [k, n] }, 2);
                let cv = c.as_ref().map(|s| filled(s, 3));
                let fast = gemm(&g, &a, &b, cv.as_ref()).unwrap().unwrap();
                let mut graph = ir::Graph::new("g");
                let ins: Vec<Option<ir::Value>> = [Some(&a), Some(&b), cv.as_ref()]
                    .iter()
                    .enumerate()
                    .filter_map(|(i, x)| x.map(|x| Some(graph.add_initializer(format!("i{i}"), x.to_tensor()))))
                    .collect();
                let node = graph.add_node(ir::Op::Gemm(g.clone()), ins, vec![ir::Output::named("y")]);
                let refs: Vec<Option<&Array>> =
                    [Some(&a), Some(&b), cv.as_ref()].into_iter().flatten().map(Some).collect();
                let want = ir::eval::eval_node(&graph, node, &refs, &[]).unwrap().remove(0);
                close(&fast, &want);
            }
        }
        let g = ir::op::Gemm::default();
        assert!(gemm(&g, &filled(&[2, 3], 0), &filled(&[3, 4], 0), Some(&filled(&[3, 4], 0))).is_none());
    }
}
