//! Sampling images at computed positions: `GridSample`, `AffineGrid`, `Col2Im` (the inverse of
//! im2col) and `RoiAlign`. They run whole on one device, evaluated by the reference kernels.

use super::flow::flow_positional;
use super::grad::GradCx;
use super::shape::no_work_whole;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::eval::{Array, EvalError, strides};
use crate::op::{self, Op};
use crate::shard::IterSpace;
use crate::types::Dim;

impl OpRules for op::GridSample {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(x), Some(g)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        if x.len() < 3 || g.len() != x.len() {
            return Err(format!(
                "GridSample needs X [N, C, ...] and a grid of the same rank, got {} and {}",
                x.len(),
                g.len()
            ));
        }
        let mut out = vec![x[0].clone(), x[1].clone()];
        out.extend(g[1..g.len() - 1].iter().cloned());
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let taps = match self.mode() {
            "cubic" | "bicubic" => 16.0,
            "nearest" => 1.0,
            _ => 4.0,
        };
        Work::flops(2.0 * taps * cx.out_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        grid_sample(self, cx.req(0)?, cx.req(1)?)
    }
}

/// Reflects `x` into [lo, hi] by the nearer border until it is inside.
fn reflect(x: f64, lo: f64, hi: f64) -> f64 {
    let range = hi - lo;
    if range <= 0.0 {
        return lo;
    }
    if x < lo {
        let d = lo - x;
        let n = (d / range) as i64;
        let r = d - n as f64 * range;
        if n % 2 == 0 { lo + r } else { hi - r }
    } else if x > hi {
        let d = x - hi;
        let n = (d / range) as i64;
        let r = d - n as f64 * range;
        if n % 2 == 0 { hi - r } else { lo + r }
    } else {
        x
    }
}

fn cubic(t: f64) -> [f64; 4] {
    let a = -0.75;
    let x = t.abs();
    [
        ((a * (x + 1.0) - 5.0 * a) * (x + 1.0) + 8.0 * a) * (x + 1.0) - 4.0 * a,
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
        ((a + 2.0) * (1.0 - x) - (a + 3.0)) * (1.0 - x) * (1.0 - x) + 1.0,
        ((a * (2.0 - x) - 5.0 * a) * (2.0 - x) + 8.0 * a) * (2.0 - x) - 4.0 * a,
    ]
}

/// Samples each channel of X at the grid's normalized positions ([-1, 1] over the image,
/// coordinates in reverse dim order), by nearest, (multi)linear or cubic interpolation, with
/// zeros, the border or reflection outside, as ONNX (and PyTorch's grid_sample) define it.
fn grid_sample(op: &op::GridSample, x: &Array, grid: &Array) -> Arrays {
    let r = x.rank();
    if r < 3 || grid.rank() != r || grid.shape[r - 1] != r - 2 || grid.shape[0] != x.shape[0] {
        return Err(EvalError::Invalid(format!("GridSample of X {:?} with grid {:?}", x.shape, grid.shape)));
    }
    let (n, c) = (x.shape[0], x.shape[1]);
    let dims: Vec<usize> = x.shape[2..].to_vec();
    let nd = dims.len();
    let outs: Vec<usize> = grid.shape[1..r - 1].to_vec();
    let npos: usize = outs.iter().product();
    let align = op.align_corners() != 0;
    let mode = match op.mode() {
        "bilinear" => "linear",
        "bicubic" => "cubic",
        m => m,
    };
    let pad = op.padding_mode();
    let xv = x.to_f64()?;
    let gv = grid.to_f64()?;
    let dst = strides(&dims);
    let plane: usize = dims.iter().product();
    let border: Vec<(f64, f64)> =
        dims.iter().map(|&d| if align { (0.0, d as f64 - 1.0) } else { (-0.5, d as f64 - 0.5) }).collect();
    // The pixel at integer coordinates `i` (per dim), by the padding mode.
    let pixel = |base: usize, i: &[i64]| -> f64 {
        let mut off = 0;
        for k in 0..nd {
            let d = dims[k] as i64;
            let j = match pad {
                "border" => i[k].clamp(0, d - 1),
                "reflection" => reflect(i[k] as f64, border[k].0, border[k].1) as i64,
                _ => {
                    if i[k] < 0 || i[k] >= d {
                        return 0.0;
                    }
                    i[k]
                }
            };
            off += j.clamp(0, d - 1) as usize * dst[k];
        }
        xv[base + off]
    };
    let mut y = vec![0.0; n * c * npos];
    for b in 0..n {
        for p in 0..npos {
            // The position, in X's dim order (the grid lists it reversed).
            let g = &gv[(b * npos + p) * nd..][..nd];
            let mut pos: Vec<f64> = (0..nd)
                .map(|k| {
                    let v = g[nd - 1 - k];
                    let len = dims[k] as f64;
                    if align { (v + 1.0) / 2.0 * (len - 1.0) } else { ((v + 1.0) * len - 1.0) / 2.0 }
                })
                .collect();
            if mode == "nearest" {
                pos.iter_mut().for_each(|v| *v = v.round_ties_even());
            }
            for k in 0..nd {
                let (lo, hi) = border[k];
                if pos[k] < lo || pos[k] > hi {
                    match pad {
                        "border" => pos[k] = pos[k].clamp(0.0, dims[k] as f64 - 1.0),
                        "reflection" => pos[k] = reflect(pos[k], lo, hi),
                        _ => {}
                    }
                }
            }
            // Taps per dim: (integer coordinate, weight).
            let taps: Vec<Vec<(i64, f64)>> = pos
                .iter()
                .map(|&v| match mode {
                    "nearest" => vec![(v as i64, 1.0)],
                    "cubic" => {
                        let f = v.floor();
                        let w = cubic(v - f);
                        (0..4).map(|t| (f as i64 - 1 + t as i64, w[t])).collect()
                    }
                    _ => {
                        let f = v.floor();
                        vec![(f as i64, 1.0 - (v - f)), (f as i64 + 1, v - f)]
                    }
                })
                .collect();
            let combos: usize = taps.iter().map(Vec::len).product();
            for ch in 0..c {
                let base = (b * c + ch) * plane;
                let mut acc = 0.0;
                let mut idx = vec![0i64; nd];
                for m in 0..combos {
                    let mut rem = m;
                    let mut w = 1.0;
                    for k in (0..nd).rev() {
                        let t = &taps[k][rem % taps[k].len()];
                        rem /= taps[k].len();
                        idx[k] = t.0;
                        w *= t.1;
                    }
                    if w != 0.0 {
                        acc += w * pixel(base, &idx);
                    }
                }
                y[(b * c + ch) * npos + p] = acc;
            }
        }
    }
    let mut shape = vec![n, c];
    shape.extend(outs);
    Ok(vec![Array::float(x.dtype, shape, y)])
}

impl OpRules for op::AffineGrid {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(size) = cx.ints(1) else {
            cx.needs_values(&[1]);
            return cx.one(None);
        };
        if !(size.len() == 4 || size.len() == 5) {
            return Err(format!("AffineGrid size has {} values; 4 (2-D) or 5 (3-D)", size.len()));
        }
        let mut out: Vec<Dim> = vec![Dim::Fixed(size[0])];
        out.extend(size[2..].iter().map(|&d| Dim::Fixed(d)));
        out.push(Dim::Fixed(size.len() as i64 - 2));
        cx.one(Some(out))
    }

    no_work_whole!();

    /// θ applied to the homogeneous normalized coordinates of every output position.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (theta, size) = (cx.req(0)?, cx.req(1)?.to_i64()?);
        let nd = size.len().saturating_sub(2);
        if !(nd == 2 || nd == 3) || theta.shape != [size[0] as usize, nd, nd + 1] {
            return Err(EvalError::Invalid(format!("AffineGrid θ {:?} for size {size:?}", theta.shape)));
        }
        let n = size[0] as usize;
        let dims: Vec<usize> = size[2..].iter().map(|&d| d.max(0) as usize).collect();
        let base = affine_base(&dims, self.align_corners() != 0);
        let t = theta.to_f64()?;
        let npos = base.len();
        let mut out = vec![0.0; n * npos * nd];
        for b in 0..n {
            for (p, h) in base.iter().enumerate() {
                for r in 0..nd {
                    out[(b * npos + p) * nd + r] = (0..=nd).map(|k| t[(b * nd + r) * (nd + 1) + k] * h[k]).sum();
                }
            }
        }
        let mut shape = vec![n];
        shape.extend(&dims);
        shape.push(nd);
        Ok(vec![Array::float(theta.dtype, shape, out)])
    }

    /// The grid is linear in θ: `grid[b, p, r] = Σ_k θ[b, r, k] · h[p, k]` with `h` the
    /// positions' homogeneous coordinates (a constant), so `dθ[b, r, k] = Σ_p dY[b, p, r] ·
    /// h[p, k]`: one MatMul of dY, `[N, P·nd]`, with the constant `[P·nd, nd·(nd+1)]` that
    /// holds `h[p, k]` at row `(p, r)` and column `(r, k)`.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let grid = cx.dims(cx.y(0))?;
            let nd = grid.len().saturating_sub(2);
            if !(nd == 2 || nd == 3) {
                return Err(format!("AffineGrid's gradient: a grid of {grid:?}"));
            }
            let dims: Vec<usize> = grid[1..grid.len() - 1].iter().map(|&d| d.max(0) as usize).collect();
            let base = affine_base(&dims, self.align_corners() != 0);
            let (rows, cols) = (base.len() * nd, nd * (nd + 1));
            let mut m = vec![0.0; rows * cols];
            for (p, h) in base.iter().enumerate() {
                for r in 0..nd {
                    for (k, &hk) in h.iter().enumerate() {
                        m[(p * nd + r) * cols + r * (nd + 1) + k] = hk;
                    }
                }
            }
            let dtype = cx.dtype(dy);
            let m = cx.constant(Array::float(dtype, vec![rows, cols], m));
            let flat = cx.reshape(dy, &[grid[0], rows as i64])?;
            let d = cx.add1(Op::MatMul(op::MatMul::default()), &[flat, m])?;
            let d = cx.reshape(d, &[grid[0], nd as i64, nd as i64 + 1])?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

/// The homogeneous normalized coordinates `(x, y[, z], 1)` of every position of an output of
/// `dims` (row-major; `x` runs along the last dim), as `AffineGrid` applies θ to them.
fn affine_base(dims: &[usize], align: bool) -> Vec<Vec<f64>> {
    let nd = dims.len();
    // Normalized coordinate of index i of a dim of length d.
    let coord = |i: usize, d: usize| -> f64 {
        if align {
            if d <= 1 { -1.0 } else { -1.0 + 2.0 * i as f64 / (d as f64 - 1.0) }
        } else {
            -1.0 + (2.0 * i as f64 + 1.0) / d as f64
        }
    };
    let st = strides(dims);
    (0..dims.iter().product::<usize>())
        .map(|p| {
            let idx: Vec<usize> = (0..nd).map(|k| (p / st[k]) % dims[k]).collect();
            let mut h: Vec<f64> = (0..nd).map(|k| coord(idx[nd - 1 - k], dims[nd - 1 - k])).collect();
            h.push(1.0);
            h
        })
        .collect()
}

impl OpRules for op::Col2Im {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(x), Some(img), Some(block)) = (cx.dims(0), cx.ints(1), cx.ints(2)) else {
            cx.needs_values(&[1, 2]);
            return cx.one(None);
        };
        let bl: i64 = block.iter().product();
        let c = match x.get(1) {
            Some(Dim::Fixed(v)) if bl > 0 => Dim::Fixed(v / bl),
            _ => Dim::Unknown,
        };
        let mut out = vec![x.first().cloned().unwrap_or(Dim::Unknown), c];
        out.extend(img.iter().map(|&d| Dim::Fixed(d)));
        cx.one(Some(out))
    }

    no_work_whole!();

    /// Sums each column back into the image positions its block covered.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, img, block) = (cx.req(0)?, cx.req(1)?.to_i64()?, cx.req(2)?.to_i64()?);
        let nd = img.len();
        if x.rank() != 3 || block.len() != nd || nd == 0 {
            return Err(EvalError::Invalid(format!("Col2Im of {:?} into {img:?} by {block:?}", x.shape)));
        }
        let dil = self.dilations.clone().unwrap_or_else(|| vec![1; nd]);
        let pads = self.pads.clone().unwrap_or_else(|| vec![0; 2 * nd]);
        let strd = self.strides.clone().unwrap_or_else(|| vec![1; nd]);
        let bl: usize = block.iter().map(|&b| b.max(1) as usize).product();
        let (n, cb, l) = (x.shape[0], x.shape[1], x.shape[2]);
        if cb % bl != 0 {
            return Err(EvalError::Invalid(format!("Col2Im: {cb} rows are not a multiple of the block's {bl}")));
        }
        let c = cb / bl;
        let cols: Vec<i64> =
            (0..nd).map(|i| (img[i] + pads[i] + pads[nd + i] - (dil[i] * (block[i] - 1) + 1)) / strd[i] + 1).collect();
        if cols.iter().product::<i64>() != l as i64 {
            return Err(EvalError::Invalid(format!("Col2Im: {l} columns, the geometry gives {cols:?}")));
        }
        let img_u: Vec<usize> = img.iter().map(|&d| d as usize).collect();
        let ist = strides(&img_u);
        let bsz: Vec<usize> = block.iter().map(|&d| d as usize).collect();
        let bst = strides(&bsz);
        let csz: Vec<usize> = cols.iter().map(|&d| d as usize).collect();
        let cst = strides(&csz);
        let plane: usize = img_u.iter().product();
        let xv = x.to_f64()?;
        let mut out = vec![0.0; n * c * plane];
        for b in 0..n {
            for ch in 0..c {
                for k in 0..bl {
                    for col in 0..l {
                        let mut off = 0usize;
                        let mut inside = true;
                        for d in 0..nd {
                            let ki = ((k / bst[d]) % bsz[d]) as i64;
                            let ci = ((col / cst[d]) % csz[d]) as i64;
                            let p = ci * strd[d] - pads[d] + ki * dil[d];
                            if p < 0 || p >= img[d] {
                                inside = false;
                                break;
                            }
                            off += p as usize * ist[d];
                        }
                        if inside {
                            out[(b * c + ch) * plane + off] += xv[(b * cb + ch * bl + k) * l + col];
                        }
                    }
                }
            }
        }
        let mut shape = vec![n, c];
        shape.extend(img_u);
        Ok(vec![Array::float(x.dtype, shape, out)])
    }

    /// The adjoint of summing columns into the image is taking them out of it (im2col): a
    /// convolution of dY grouped by channel whose `C · block` filters each pick one position
    /// of the block (one-hot), with Col2Im's geometry, its output's positions flattened.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let xd = cx.dims(x)?;
            let block = cx.const_ints(cx.x_opt(2)).ok_or("Col2Im's gradient needs a constant block shape")?;
            let bl: i64 = block.iter().product();
            if xd.len() != 3 || bl <= 0 || xd[1] % bl != 0 {
                return Err(format!("Col2Im's gradient: input {xd:?}, block {block:?}"));
            }
            let c = (xd[1] / bl) as usize;
            let k = bl as usize;
            let mut shape = vec![c * k, 1];
            shape.extend(block.iter().map(|&b| b as usize));
            let w: Vec<f64> = (0..c * k * k).map(|i| if (i / k) % k == i % k { 1.0 } else { 0.0 }).collect();
            let w = cx.constant(Array::float(cx.dtype(dy), shape, w));
            let conv = op::Conv {
                group: Some(c as i64),
                kernel_shape: Some(block),
                dilations: self.dilations.clone(),
                pads: self.pads.clone(),
                strides: self.strides.clone(),
                ..Default::default()
            };
            let cols = cx.add1(Op::Conv(conv), &[dy, w])?;
            let d = cx.reshape(cols, &xd)?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

impl OpRules for op::RoiAlign {
    // One output per region of interest: axis 0 follows the `rois` input's.
    flow_positional!(1);

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(x), Some(r)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        if x.len() != 4 || r.len() != 2 {
            return Err("RoiAlign needs X [N, C, H, W] and rois [R, 4]".into());
        }
        cx.one(Some(vec![
            r[0].clone(),
            x[1].clone(),
            Dim::Fixed(self.output_height()),
            Dim::Fixed(self.output_width()),
        ]))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(8.0 * cx.out_numel(0) * f64::from(self.sampling_ratio().max(1) as i32).powi(2))
    }

    /// Average (or max) of bilinear samples on a grid inside each output bin of each region.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, rois, bidx) = (cx.req(0)?, cx.req(1)?.to_f64()?, cx.req(2)?.to_i64()?);
        if x.rank() != 4 {
            return Err(EvalError::Invalid("RoiAlign needs X [N, C, H, W]".into()));
        }
        let (c, h, w) = (x.shape[1], x.shape[2], x.shape[3]);
        let (ph, pw) = (self.output_height().max(1) as usize, self.output_width().max(1) as usize);
        let scale = f64::from(self.spatial_scale());
        let half = self.coordinate_transformation_mode() == "half_pixel";
        let max = self.mode() == "max";
        let nroi = bidx.len();
        if rois.len() != nroi * 4 {
            return Err(EvalError::Invalid(format!("RoiAlign: {} roi values for {nroi} regions", rois.len())));
        }
        let xv = x.to_f64()?;
        let mut out = vec![0.0; nroi * c * ph * pw];
        for r in 0..nroi {
            let b = usize::try_from(bidx[r])
                .ok()
                .filter(|&b| b < x.shape[0])
                .ok_or_else(|| EvalError::Invalid(format!("batch index {}", bidx[r])))?;
            let off = if half { 0.5 } else { 0.0 };
            let (sw, sh) = (rois[r * 4] * scale - off, rois[r * 4 + 1] * scale - off);
            let (ew, eh) = (rois[r * 4 + 2] * scale - off, rois[r * 4 + 3] * scale - off);
            let (mut rw, mut rh) = (ew - sw, eh - sh);
            if !half {
                rw = rw.max(1.0);
                rh = rh.max(1.0);
            }
            let (bh, bw) = (rh / ph as f64, rw / pw as f64);
            let sr = self.sampling_ratio();
            let gh = if sr > 0 { sr as usize } else { (rh / ph as f64).ceil() as usize };
            let gw = if sr > 0 { sr as usize } else { (rw / pw as f64).ceil() as usize };
            let count = (gh * gw).max(1) as f64;
            for ch in 0..c {
                let base = (b * c + ch) * h * w;
                for py in 0..ph {
                    for px in 0..pw {
                        let mut acc: Option<f64> = None;
                        for iy in 0..gh {
                            let yy = sh + py as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                            for ix in 0..gw {
                                let xx = sw + px as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                                // Bilinear weights of the four neighbours (zero outside).
                                let terms: [f64; 4] = if yy < -1.0 || yy > h as f64 || xx < -1.0 || xx > w as f64 {
                                    [0.0; 4]
                                } else {
                                    let (mut y, mut xq) = (yy.max(0.0), xx.max(0.0));
                                    let (mut yl, mut xl) = (y as usize, xq as usize);
                                    let yh = if yl >= h - 1 {
                                        yl = h - 1;
                                        y = yl as f64;
                                        yl
                                    } else {
                                        yl + 1
                                    };
                                    let xh = if xl >= w - 1 {
                                        xl = w - 1;
                                        xq = xl as f64;
                                        xl
                                    } else {
                                        xl + 1
                                    };
                                    let (ly, lx) = (y - yl as f64, xq - xl as f64);
                                    let (hy, hx) = (1.0 - ly, 1.0 - lx);
                                    [
                                        hy * hx * xv[base + yl * w + xl],
                                        hy * lx * xv[base + yl * w + xh],
                                        ly * hx * xv[base + yh * w + xl],
                                        ly * lx * xv[base + yh * w + xh],
                                    ]
                                };
                                let v = if max {
                                    terms.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                                } else {
                                    terms.iter().sum()
                                };
                                acc = Some(match acc {
                                    None => v,
                                    Some(a) if max => a.max(v),
                                    Some(a) => a + v,
                                });
                            }
                        }
                        let v = acc.unwrap_or(0.0);
                        out[((r * c + ch) * ph + py) * pw + px] = if max { v } else { v / count };
                    }
                }
            }
        }
        Ok(vec![Array::float(x.dtype, vec![nroi, c, ph, pw], out)])
    }
}
