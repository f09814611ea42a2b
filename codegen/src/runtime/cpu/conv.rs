//! The CPU executor's convolutions of float32 arrays — `Conv` and its two gradients
//! (`ConvGradInput`, `ConvGradWeight`) — as im2col and SGEMM ([`super::gemm`]), per image
//! and group: the forward `Y = W · cols(X)`, the weight gradient `dW += dY · cols(X)ᵀ`, the
//! input gradient `dX = col2im(Wᵀ · dY)`. The reference evaluator's direct loops
//! (`ir::eval`) stay the truth they are checked against; other types, ranks and `auto_pad`
//! modes run them.

use ir::eval::{Array, Data};
use ir::op;
use ir::ops::conv::{self, to3};

use super::gemm::{Mat, mat, sgemm_acc};

/// The geometry of a convolution over 1 to 3 spatial dims, expanded to 3 (leading 1s).
struct Geo {
    /// Input spatial sizes.
    inp: [usize; 3],
    /// Output spatial sizes.
    out: [usize; 3],
    /// Kernel, strides, dilations and begin pads, as the reference kernels read them.
    win: conv::Geo,
}

impl Geo {
    fn kvol(&self) -> usize {
        self.win.k.iter().product()
    }

    fn npos(&self) -> usize {
        self.out.iter().product()
    }

    fn isize_(&self) -> usize {
        self.inp.iter().product()
    }

    /// Per kernel tap `k` and output position `o`, the input position it reads
    /// (`u32::MAX` in the padding), at `k · npos + o` ([`conv::taps`]).
    fn taps(&self) -> Vec<u32> {
        let npos = self.npos();
        let mut t = vec![u32::MAX; self.kvol() * npos];
        conv::taps(&self.win, self.inp, self.out, |o, i, k| t[k * npos + o] = i as u32);
        t
    }
}

/// A gradient op's geometry ([`conv::geo`]) between the convolution's input and output
/// spatial sizes; `None` where the attributes do not fit.
fn gradient_geo(
    kernel: &Option<Vec<i64>>,
    strides: &Option<Vec<i64>>,
    dil: &Option<Vec<i64>>,
    pads: &Option<Vec<i64>>,
    inp: &[usize],
    out: &[usize],
) -> Option<Geo> {
    if out.len() != inp.len() {
        return None;
    }
    let win = conv::geo(kernel, strides, dil, pads, inp.len()).ok()?;
    Some(Geo { inp: to3(inp, 1), out: to3(out, 1), win })
}

/// Column-buffer elements a convolution fills at once: images are batched into one GEMM up to
/// this many (at least one image at a time).
const COLS_MAX: usize = 1 << 24;

/// The layout of a batch of images' columns: `rows = cg · kvol` rows of `width = nb · npos`
/// (image `j`'s output positions at `j · npos`).
#[derive(Clone, Copy)]
struct Cols {
    cg: usize,
    kvol: usize,
    npos: usize,
    isz: usize,
    width: usize,
}

impl Cols {
    /// Fills image `j`'s columns from its `cg` channels (`x`, channel-major, each `isz` long):
    /// row `c · kvol + k`, column `j · npos + o` holds what tap `k` of output position `o`
    /// reads.
    fn im2col(&self, x: &[f32], j: usize, taps: &[u32], cols: &mut [f32]) {
        let Cols { cg, kvol, npos, isz, width } = *self;
        for c in 0..cg {
            let xc = &x[c * isz..][..isz];
            for k in 0..kvol {
                let row = &mut cols[(c * kvol + k) * width + j * npos..][..npos];
                for (r, &i) in row.iter_mut().zip(&taps[k * npos..][..npos]) {
                    *r = if i == u32::MAX { 0.0 } else { xc[i as usize] };
                }
            }
        }
    }

    /// Adds image `j`'s columns back into its `cg` channels of the input gradient (`dx`).
    fn col2im(&self, cols: &[f32], j: usize, taps: &[u32], dx: &mut [f32]) {
        let Cols { cg, kvol, npos, isz, width } = *self;
        for c in 0..cg {
            let dc = &mut dx[c * isz..][..isz];
            for k in 0..kvol {
                let row = &cols[(c * kvol + k) * width + j * npos..][..npos];
                for (&v, &i) in row.iter().zip(&taps[k * npos..][..npos]) {
                    if i != u32::MAX {
                        dc[i as usize] += v;
                    }
                }
            }
        }
    }
}

/// The image ranges batched together: as many as fit `cap` column elements ([`COLS_MAX`]).
fn batches(n: usize, per_image: usize, cap: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let nb = (cap / per_image.max(1)).clamp(1, n.max(1));
    (0..n).step_by(nb).map(move |i| i..(i + nb).min(n))
}

/// The `mg` channels of group `gi` of images `imgs` of `t` (`[N, M, npos]`) as
/// `mg × (|imgs| · npos)` (image `j`'s positions at `j · npos`), into `out`.
fn gather(t: &[f32], out: &mut [f32], imgs: &std::ops::Range<usize>, (m, mg, gi, npos): (usize, usize, usize, usize)) {
    let width = imgs.len() * npos;
    for (j, ni) in imgs.clone().enumerate() {
        for r in 0..mg {
            let src = (ni * m + gi * mg + r) * npos;
            out[r * width + j * npos..][..npos].copy_from_slice(&t[src..src + npos]);
        }
    }
}

/// [`gather`]'s inverse: `out`'s rows back into `t`.
fn scatter(out: &[f32], t: &mut [f32], imgs: &std::ops::Range<usize>, (m, mg, gi, npos): (usize, usize, usize, usize)) {
    let width = imgs.len() * npos;
    for (j, ni) in imgs.clone().enumerate() {
        for r in 0..mg {
            let dst = (ni * m + gi * mg + r) * npos;
            t[dst..dst + npos].copy_from_slice(&out[r * width + j * npos..][..npos]);
        }
    }
}

fn f32s(a: &Array) -> Option<&[f32]> {
    match &a.data {
        Data::F32(v) => Some(v),
        _ => None,
    }
}

/// `Conv` of float32 `x` `[N, C, …]`, `w` `[M, C/g, k…]` and bias `b`; `None` where the
/// reference kernel runs.
pub fn conv(c: &op::Conv, x: &Array, w: &Array, b: Option<&Array>) -> Option<Result<Array, String>> {
    conv_in(c, x, w, b, COLS_MAX)
}

fn conv_in(c: &op::Conv, x: &Array, w: &Array, b: Option<&Array>, cap: usize) -> Option<Result<Array, String>> {
    let (xv, wv) = (f32s(x)?, f32s(w)?);
    let bv = match b {
        Some(b) => Some(f32s(b)?),
        None => None,
    };
    if x.rank() < 3 || x.rank() > 5 || w.rank() != x.rank() || x.dtype != w.dtype {
        return None;
    }
    let (n, ch, m, grp) = (x.shape[0], x.shape[1], w.shape[0], c.group().max(1) as usize);
    if ch % grp != 0 || m % grp != 0 || w.shape[1] != ch / grp || bv.is_some_and(|b| b.len() != m) {
        return None;
    }
    let kernel: Vec<i64> = c.kernel_shape.clone().unwrap_or_else(|| w.shape[2..].iter().map(|&d| d as i64).collect());
    let win = ir::eval::window(
        &x.shape[2..],
        &kernel,
        c.strides.as_deref(),
        c.dilations.as_deref(),
        c.pads.as_deref(),
        c.auto_pad(),
        false,
    )
    .ok()?;
    let geo = Geo {
        inp: to3(&x.shape[2..], 1),
        out: to3(&win.out, 1),
        win: conv::Geo {
            k: to3(&win.kernel, 1),
            s: to3(&win.strides, 1),
            d: to3(&win.dilations, 1),
            p: to3(&win.pad_begin, 0),
        },
    };
    let (cg, mg, kvol, npos, isz) = (ch / grp, m / grp, geo.kvol(), geo.npos(), geo.isize_());
    if w.shape[2..].iter().product::<usize>() != kvol {
        return None;
    }
    let taps = geo.taps();
    let mut y = vec![0f32; n * m * npos];
    for imgs in batches(n, cg * kvol * npos, cap) {
        let l = Cols { cg, kvol, npos, isz, width: imgs.len() * npos };
        let mut cols = vec![0f32; cg * kvol * l.width];
        let mut out = vec![0f32; mg * l.width];
        for gi in 0..grp {
            for (j, ni) in imgs.clone().enumerate() {
                l.im2col(&xv[(ni * ch + gi * cg) * isz..], j, &taps, &mut cols);
            }
            let wg = mat(wv, gi * mg * cg * kvol, mg, cg * kvol);
            sgemm_acc(1.0, wg, mat(&cols, 0, cg * kvol, l.width), 0.0, &mut out);
            if let Some(b) = bv {
                for (row, &bias) in out.chunks_exact_mut(l.width.max(1)).zip(&b[gi * mg..][..mg]) {
                    row.iter_mut().for_each(|v| *v += bias);
                }
            }
            scatter(&out, &mut y, &imgs, (m, mg, gi, npos));
        }
    }
    let mut shape = vec![n, m];
    shape.extend(&win.out);
    Some(Ok(Array::f32(shape, y)))
}

/// `ConvGradInput`: `dX` of shape `input_shape` from `dY` `[N, M, o…]` and `W`; `None` where
/// the reference kernel runs.
pub fn grad_input(c: &op::ConvGradInput, dy: &Array, w: &Array) -> Option<Result<Array, String>> {
    grad_input_in(c, dy, w, COLS_MAX)
}

fn grad_input_in(c: &op::ConvGradInput, dy: &Array, w: &Array, cap: usize) -> Option<Result<Array, String>> {
    let (dv, wv) = (f32s(dy)?, f32s(w)?);
    let xs: Vec<usize> = c.input_shape.as_ref()?.iter().map(|&d| usize::try_from(d).ok()).collect::<Option<_>>()?;
    if xs.len() < 3 || xs.len() > 5 || dy.rank() != xs.len() || w.rank() != xs.len() || dy.dtype != w.dtype {
        return None;
    }
    let geo = gradient_geo(&c.kernel_shape, &c.strides, &c.dilations, &c.pads, &xs[2..], &dy.shape[2..])?;
    let (n, ch, m, grp) = (xs[0], xs[1], dy.shape[1], c.group().max(1) as usize);
    let (cg, kvol, npos, isz) = (ch / grp, geo.kvol(), geo.npos(), geo.isize_());
    if dy.shape[0] != n
        || ch % grp != 0
        || m % grp != 0
        || w.shape[0] != m
        || w.shape[1] != cg
        || w.numel() != m * cg * kvol
    {
        return None;
    }
    let mg = m / grp;
    let taps = geo.taps();
    let mut dx = vec![0f32; n * ch * isz];
    for imgs in batches(n, cg * kvol * npos, cap) {
        let l = Cols { cg, kvol, npos, isz, width: imgs.len() * npos };
        let mut cols = vec![0f32; cg * kvol * l.width];
        let mut dyg = vec![0f32; mg * l.width];
        for gi in 0..grp {
            gather(dv, &mut dyg, &imgs, (m, mg, gi, npos));
            let wg = Mat { data: wv, offset: gi * mg * cg * kvol, rows: cg * kvol, cols: mg, t: true };
            sgemm_acc(1.0, wg, mat(&dyg, 0, mg, l.width), 0.0, &mut cols);
            for (j, ni) in imgs.clone().enumerate() {
                l.col2im(&cols, j, &taps, &mut dx[(ni * ch + gi * cg) * isz..]);
            }
        }
    }
    Some(Ok(Array::f32(xs, dx)))
}

/// `ConvGradWeight`: `dW` `[M, C/g, k…]` from `X` `[N, C, …]` and `dY` `[N, M, o…]`; `None`
/// where the reference kernel runs.
pub fn grad_weight(c: &op::ConvGradWeight, x: &Array, dy: &Array) -> Option<Result<Array, String>> {
    grad_weight_in(c, x, dy, COLS_MAX)
}

fn grad_weight_in(c: &op::ConvGradWeight, x: &Array, dy: &Array, cap: usize) -> Option<Result<Array, String>> {
    let (xv, dv) = (f32s(x)?, f32s(dy)?);
    if x.rank() < 3 || x.rank() > 5 || dy.rank() != x.rank() || x.dtype != dy.dtype || x.shape[0] != dy.shape[0] {
        return None;
    }
    let geo = gradient_geo(&c.kernel_shape, &c.strides, &c.dilations, &c.pads, &x.shape[2..], &dy.shape[2..])?;
    let (n, ch, m, grp) = (x.shape[0], x.shape[1], dy.shape[1], c.group().max(1) as usize);
    if ch % grp != 0 || m % grp != 0 {
        return None;
    }
    let (cg, mg, kvol, npos, isz) = (ch / grp, m / grp, geo.kvol(), geo.npos(), geo.isize_());
    let taps = geo.taps();
    let mut dw = vec![0f32; m * cg * kvol];
    for (bi, imgs) in batches(n, cg * kvol * npos, cap).enumerate() {
        let l = Cols { cg, kvol, npos, isz, width: imgs.len() * npos };
        let mut cols = vec![0f32; cg * kvol * l.width];
        let mut dyg = vec![0f32; mg * l.width];
        for gi in 0..grp {
            for (j, ni) in imgs.clone().enumerate() {
                l.im2col(&xv[(ni * ch + gi * cg) * isz..], j, &taps, &mut cols);
            }
            gather(dv, &mut dyg, &imgs, (m, mg, gi, npos));
            let colst = Mat { data: &cols, offset: 0, rows: l.width, cols: cg * kvol, t: true };
            let out = &mut dw[gi * mg * cg * kvol..][..mg * cg * kvol];
            sgemm_acc(1.0, mat(&dyg, 0, mg, l.width), colst, if bi == 0 { 0.0 } else { 1.0 }, out);
        }
    }
    let mut shape = vec![m, cg];
    shape.extend(geo.win.k[3 - (x.rank() - 2)..].iter());
    Some(Ok(Array::f32(shape, dw)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(shape: &[usize], seed: usize) -> Array {
        let n: usize = shape.iter().product();
        Array::f32(shape.to_vec(), (0..n).map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) * 0.05).collect())
    }

    fn close(x: &Array, y: &Array) {
        assert_eq!(x.shape, y.shape);
        let (Data::F32(a), Data::F32(b)) = (&x.data, &y.data) else { panic!("float32") };
        for (p, q) in a.iter().zip(b) {
            assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{p} vs {q}");
        }
    }

    /// The reference evaluator's output of `op` on `inputs`.
    fn reference(op: ir::Op, inputs: &[&Array]) -> Array {
        let mut g = ir::Graph::new("g");
        let ins =
            inputs.iter().enumerate().map(|(i, a)| Some(g.add_initializer(format!("i{i}"), a.to_tensor()))).collect();
        let node = g.add_node(op, ins, vec![ir::Output::named("y")]);
        let refs: Vec<Option<&Array>> = inputs.iter().map(|a| Some(*a)).collect();
        ir::eval::eval_node(&g, node, &refs, &[]).unwrap().remove(0)
    }

    #[test]
    fn convolutions_and_their_gradients_equal_the_reference() {
        // (x, w, strides, pads, dilations, group)
        type Case = (Vec<usize>, Vec<usize>, Vec<i64>, Vec<i64>, Vec<i64>, i64);
        let cases: Vec<Case> = vec![
            (vec![2, 3, 9, 8], vec![4, 3, 3, 3], vec![1, 1], vec![1, 1, 1, 1], vec![1, 1], 1),
            (vec![2, 4, 11, 10], vec![6, 2, 3, 2], vec![2, 1], vec![1, 0, 2, 1], vec![1, 2], 2),
            (vec![1, 6, 7, 7], vec![6, 1, 3, 3], vec![1, 1], vec![1, 1, 1, 1], vec![1, 1], 6),
            (vec![2, 3, 12], vec![5, 3, 4], vec![3], vec![2, 1], vec![1], 1),
            (vec![1, 2, 5, 6, 4], vec![3, 2, 2, 3, 2], vec![1, 2, 1], vec![0, 1, 1, 1, 0, 0], vec![2, 1, 1], 1),
        ];
        for (xs, ws, s, p, d, group) in cases {
            let (x, w) = (filled(&xs, 1), filled(&ws, 2));
            let b = filled(&[ws[0]], 3);
            let c = op::Conv {
                strides: Some(s.clone()),
                pads: Some(p.clone()),
                dilations: Some(d.clone()),
                group: Some(group),
                ..Default::default()
            };
            let y = conv(&c, &x, &w, Some(&b)).unwrap().unwrap();
            let want = reference(ir::Op::Conv(c.clone()), &[&x, &w, &b]);
            close(&y, &want);
            // One image per GEMM (the column buffer's cap) computes the same.
            close(&conv_in(&c, &x, &w, Some(&b), 1).unwrap().unwrap(), &want);
            close(&conv(&c, &x, &w, None).unwrap().unwrap(), &reference(ir::Op::Conv(c), &[&x, &w]));
            let dy = filled(&y.shape, 4);
            let kernel: Vec<i64> = ws[2..].iter().map(|&k| k as i64).collect();
            let gi = op::ConvGradInput {
                input_shape: Some(xs.iter().map(|&v| v as i64).collect()),
                kernel_shape: Some(kernel.clone()),
                strides: Some(s.clone()),
                pads: Some(p.clone()),
                dilations: Some(d.clone()),
                group: Some(group),
            };
            let want = reference(ir::Op::ConvGradInput(gi.clone()), &[&dy, &w]);
            close(&grad_input(&gi, &dy, &w).unwrap().unwrap(), &want);
            close(&grad_input_in(&gi, &dy, &w, 1).unwrap().unwrap(), &want);
            let gw = op::ConvGradWeight {
                kernel_shape: Some(kernel),
                strides: Some(s),
                pads: Some(p),
                dilations: Some(d),
                group: Some(group),
            };
            let want = reference(ir::Op::ConvGradWeight(gw.clone()), &[&x, &dy]);
            close(&grad_weight(&gw, &x, &dy).unwrap().unwrap(), &want);
            close(&grad_weight_in(&gw, &x, &dy, 1).unwrap().unwrap(), &want);
        }
    }
}
