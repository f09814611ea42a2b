//! The CPU executor's convolutions of float32 arrays — `Conv` and its two gradients
//! (`ConvGradInput`, `ConvGradWeight`) — as im2col and SGEMM ([`super::gemm`]), per image
//! and group: the forward `Y = W · cols(X)`, the weight gradient `dW += dY · cols(X)ᵀ`, the
//! input gradient `dX = col2im(Wᵀ · dY)`. The reference evaluator's direct loops
//! (`ir::eval`) stay the truth they are checked against; other types, ranks and `auto_pad`
//! modes run them.

use ir::eval::{Array, Data};
use ir::op;

use super::gemm::{Mat, mat, sgemm_acc};

/// The geometry of a convolution over 1 to 3 spatial dims, expanded to 3 (leading 1s).
struct Geo {
    /// Input spatial sizes.
    inp: [usize; 3],
    /// Output spatial sizes.
    out: [usize; 3],
    kernel: [usize; 3],
    strides: [usize; 3],
    dilations: [usize; 3],
    pads: [usize; 3],
}

/// `v` (1 to 3 values) expanded to 3 with `fill` in front.
fn to3(v: &[usize], fill: usize) -> Option<[usize; 3]> {
    if v.is_empty() || v.len() > 3 {
        return None;
    }
    let mut o = [fill; 3];
    o[3 - v.len()..].copy_from_slice(v);
    Some(o)
}

/// `v`'s first `n` values (`default` each when absent) as sizes; `None` when fewer or
/// negative.
fn sizes(v: Option<&[i64]>, n: usize, default: usize) -> Option<Vec<usize>> {
    match v {
        None => Some(vec![default; n]),
        Some(v) if v.len() >= n && v[..n].iter().all(|&x| x >= 0) => Some(v[..n].iter().map(|&x| x as usize).collect()),
        Some(_) => None,
    }
}

impl Geo {
    /// The geometry of a gradient op from its attributes and the spatial sizes of the
    /// convolution's input and output.
    fn of(
        kernel: Option<&[i64]>,
        strides: Option<&[i64]>,
        dil: Option<&[i64]>,
        pads: Option<&[i64]>,
        inp: &[usize],
        out: &[usize],
    ) -> Option<Geo> {
        let sp = inp.len();
        if out.len() != sp {
            return None;
        }
        Some(Geo {
            inp: to3(inp, 1)?,
            out: to3(out, 1)?,
            kernel: to3(&sizes(Some(kernel?), sp, 1)?, 1)?,
            strides: to3(&sizes(strides, sp, 1)?, 1)?,
            dilations: to3(&sizes(dil, sp, 1)?, 1)?,
            pads: to3(&sizes(pads, sp, 0)?, 0)?,
        })
    }

    fn kvol(&self) -> usize {
        self.kernel.iter().product()
    }

    fn npos(&self) -> usize {
        self.out.iter().product()
    }

    fn isize_(&self) -> usize {
        self.inp.iter().product()
    }

    /// Per kernel tap `k` and output position `o`, the input position it reads
    /// (`u32::MAX` in the padding), at `k · npos + o`.
    fn taps(&self) -> Vec<u32> {
        let (g, npos) = (self, self.npos());
        let mut t = vec![u32::MAX; g.kvol() * npos];
        let [kd, kh, kw] = g.kernel;
        let at = |o: usize, k: usize, d: usize| (o * g.strides[d] + k * g.dilations[d]) as isize - g.pads[d] as isize;
        for a in 0..kd {
            for b in 0..kh {
                for c in 0..kw {
                    let k = (a * kh + b) * kw + c;
                    for z in 0..g.out[0] {
                        let iz = at(z, a, 0);
                        for y in 0..g.out[1] {
                            let iy = at(y, b, 1);
                            for x in 0..g.out[2] {
                                let ix = at(x, c, 2);
                                let inside =
                                    [(iz, 0), (iy, 1), (ix, 2)].iter().all(|&(i, d)| i >= 0 && (i as usize) < g.inp[d]);
                                if inside {
                                    let i = (iz as usize * g.inp[1] + iy as usize) * g.inp[2] + ix as usize;
                                    t[k * npos + (z * g.out[1] + y) * g.out[2] + x] = i as u32;
                                }
                            }
                        }
                    }
                }
            }
        }
        t
    }
}

/// The columns of `cg` channels of one image (`x`, channel-major, each `isz` long): row
/// `c · kvol + k`, column `o` holds the input tap `k` of output position `o` reads.
fn im2col(x: &[f32], cg: usize, isz: usize, taps: &[u32], kvol: usize, npos: usize, cols: &mut [f32]) {
    for c in 0..cg {
        let xc = &x[c * isz..][..isz];
        for k in 0..kvol {
            let row = &mut cols[(c * kvol + k) * npos..][..npos];
            for (r, &i) in row.iter_mut().zip(&taps[k * npos..][..npos]) {
                *r = if i == u32::MAX { 0.0 } else { xc[i as usize] };
            }
        }
    }
}

/// Adds the columns back into the `cg` channels of one image's input gradient (`dx`).
fn col2im(cols: &[f32], cg: usize, isz: usize, taps: &[u32], kvol: usize, npos: usize, dx: &mut [f32]) {
    for c in 0..cg {
        let dc = &mut dx[c * isz..][..isz];
        for k in 0..kvol {
            let row = &cols[(c * kvol + k) * npos..][..npos];
            for (&v, &i) in row.iter().zip(&taps[k * npos..][..npos]) {
                if i != u32::MAX {
                    dc[i as usize] += v;
                }
            }
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
        inp: to3(&x.shape[2..], 1)?,
        out: to3(&win.out, 1)?,
        kernel: to3(&win.kernel, 1)?,
        strides: to3(&win.strides, 1)?,
        dilations: to3(&win.dilations, 1)?,
        pads: to3(&win.pad_begin, 0)?,
    };
    let (cg, mg, kvol, npos, isz) = (ch / grp, m / grp, geo.kvol(), geo.npos(), geo.isize_());
    if w.shape[2..].iter().product::<usize>() != kvol {
        return None;
    }
    let taps = geo.taps();
    let mut y = vec![0f32; n * m * npos];
    let mut cols = vec![0f32; cg * kvol * npos];
    for ni in 0..n {
        for gi in 0..grp {
            im2col(&xv[(ni * ch + gi * cg) * isz..], cg, isz, &taps, kvol, npos, &mut cols);
            let out = &mut y[(ni * m + gi * mg) * npos..][..mg * npos];
            if let Some(b) = bv {
                for (row, &bias) in out.chunks_exact_mut(npos.max(1)).zip(&b[gi * mg..][..mg]) {
                    row.fill(bias);
                }
            }
            let wg = mat(wv, gi * mg * cg * kvol, mg, cg * kvol);
            sgemm_acc(1.0, wg, mat(&cols, 0, cg * kvol, npos), if bv.is_some() { 1.0 } else { 0.0 }, out);
        }
    }
    let mut shape = vec![n, m];
    shape.extend(&win.out);
    Some(Ok(Array::f32(shape, y)))
}

/// `ConvGradInput`: `dX` of shape `input_shape` from `dY` `[N, M, o…]` and `W`; `None` where
/// the reference kernel runs.
pub fn grad_input(c: &op::ConvGradInput, dy: &Array, w: &Array) -> Option<Result<Array, String>> {
    let (dv, wv) = (f32s(dy)?, f32s(w)?);
    let xs: Vec<usize> = c.input_shape.as_ref()?.iter().map(|&d| usize::try_from(d).ok()).collect::<Option<_>>()?;
    if xs.len() < 3 || xs.len() > 5 || dy.rank() != xs.len() || w.rank() != xs.len() || dy.dtype != w.dtype {
        return None;
    }
    let geo = Geo::of(
        c.kernel_shape.as_deref(),
        c.strides.as_deref(),
        c.dilations.as_deref(),
        c.pads.as_deref(),
        &xs[2..],
        &dy.shape[2..],
    )?;
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
    let mut cols = vec![0f32; cg * kvol * npos];
    for ni in 0..n {
        for gi in 0..grp {
            let wg = Mat { data: wv, offset: gi * mg * cg * kvol, rows: cg * kvol, cols: mg, t: true };
            sgemm_acc(1.0, wg, mat(dv, (ni * m + gi * mg) * npos, mg, npos), 0.0, &mut cols);
            col2im(&cols, cg, isz, &taps, kvol, npos, &mut dx[(ni * ch + gi * cg) * isz..]);
        }
    }
    Some(Ok(Array::f32(xs, dx)))
}

/// `ConvGradWeight`: `dW` `[M, C/g, k…]` from `X` `[N, C, …]` and `dY` `[N, M, o…]`; `None`
/// where the reference kernel runs.
pub fn grad_weight(c: &op::ConvGradWeight, x: &Array, dy: &Array) -> Option<Result<Array, String>> {
    let (xv, dv) = (f32s(x)?, f32s(dy)?);
    if x.rank() < 3 || x.rank() > 5 || dy.rank() != x.rank() || x.dtype != dy.dtype || x.shape[0] != dy.shape[0] {
        return None;
    }
    let geo = Geo::of(
        c.kernel_shape.as_deref(),
        c.strides.as_deref(),
        c.dilations.as_deref(),
        c.pads.as_deref(),
        &x.shape[2..],
        &dy.shape[2..],
    )?;
    let (n, ch, m, grp) = (x.shape[0], x.shape[1], dy.shape[1], c.group().max(1) as usize);
    if ch % grp != 0 || m % grp != 0 {
        return None;
    }
    let (cg, mg, kvol, npos, isz) = (ch / grp, m / grp, geo.kvol(), geo.npos(), geo.isize_());
    let taps = geo.taps();
    let mut dw = vec![0f32; m * cg * kvol];
    let mut cols = vec![0f32; cg * kvol * npos];
    for ni in 0..n {
        for gi in 0..grp {
            im2col(&xv[(ni * ch + gi * cg) * isz..], cg, isz, &taps, kvol, npos, &mut cols);
            let colst = Mat { data: &cols, offset: 0, rows: npos, cols: cg * kvol, t: true };
            let out = &mut dw[gi * mg * cg * kvol..][..mg * cg * kvol];
            sgemm_acc(1.0, mat(dv, (ni * m + gi * mg) * npos, mg, npos), colst, if ni == 0 { 0.0 } else { 1.0 }, out);
        }
    }
    let mut shape = vec![m, cg];
    shape.extend(geo.kernel[3 - (x.rank() - 2)..].iter());
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
            close(&y, &reference(ir::Op::Conv(c.clone()), &[&x, &w, &b]));
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
            close(&grad_input(&gi, &dy, &w).unwrap().unwrap(), &reference(ir::Op::ConvGradInput(gi), &[&dy, &w]));
            let gw = op::ConvGradWeight {
                kernel_shape: Some(kernel),
                strides: Some(s),
                pads: Some(p),
                dilations: Some(d),
                group: Some(group),
            };
            close(&grad_weight(&gw, &x, &dy).unwrap().unwrap(), &reference(ir::Op::ConvGradWeight(gw), &[&x, &dy]));
        }
    }
}
