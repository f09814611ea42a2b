//! Sampling images at computed positions: `GridSample`, `AffineGrid`, `Col2Im` (the inverse of
//! im2col) and `RoiAlign`. They run whole on one device, evaluated by the reference kernels.

use super::flow::flow_positional;
use super::grad::GradCx;
use super::shape::no_work_whole;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::array::{Array, EvalError, strides};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::IterSpace;
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

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(grid_sample_grad(self, cx))
    }
}

/// The tap offsets from the position's floor and the tap weights as cubics in the fraction
/// `f` (coefficients of `1, f, f², f³` per tap) of each interpolation mode, as
/// [`grid_sample`] takes them.
fn taps_of(mode: &str) -> Option<(Vec<f64>, Vec<[f64; 4]>)> {
    // p(a0 + a1·x) for a cubic p.
    fn compose(p: [f64; 4], a0: f64, a1: f64) -> [f64; 4] {
        let mut out = [0.0; 4];
        let mut pow = [1.0, 0.0, 0.0, 0.0]; // (a0 + a1·x)^i
        for &c in &p {
            for k in 0..4 {
                out[k] += c * pow[k];
            }
            let mut next = [0.0; 4];
            for k in 0..4 {
                next[k] += a0 * pow[k];
                if k + 1 < 4 {
                    next[k + 1] += a1 * pow[k];
                }
            }
            pow = next;
        }
        out
    }
    match mode {
        "nearest" => Some((vec![0.0], vec![[1.0, 0.0, 0.0, 0.0]])),
        "linear" | "bilinear" => Some((vec![0.0, 1.0], vec![[1.0, -1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])),
        "cubic" | "bicubic" => {
            // Keys' kernel (a = −0.75): |s| ≤ 1 and 1 < |s| < 2, as `cubic` evaluates it.
            let a = -0.75;
            let near = [1.0, 0.0, -(a + 3.0), a + 2.0];
            let far = [-4.0 * a, 8.0 * a, -5.0 * a, a];
            let w = vec![compose(far, 1.0, 1.0), near, compose(near, 1.0, -1.0), compose(far, 2.0, -1.0)];
            Some((vec![-1.0, 0.0, 1.0, 2.0], w))
        }
        _ => None,
    }
}

/// [`reflect`] in the graph, and its slope (±1): with `u = |x − lo|`, `f = ⌊u / range⌋` and
/// `e = u − f · range`, `x` reflects to `lo + e` when `f` is even and `hi − e` when odd.
fn reflect_in_graph(cx: &mut GradCx<'_>, x: Value, lo: f64, hi: f64) -> std::result::Result<(Value, Value), String> {
    let dt = cx.dtype(x);
    let range = hi - lo;
    let lo_c = cx.scalar(dt, lo);
    let u0 = cx.sub(x, lo_c)?;
    let u = cx.add1(Op::Abs(op::Abs::default()), &[u0])?;
    let range_c = cx.scalar(dt, range);
    let q = cx.div(u, range_c)?;
    let f = cx.add1(Op::Floor(op::Floor::default()), &[q])?;
    let fr = cx.scale(f, range)?;
    let e = cx.sub(u, fr)?;
    let half = cx.scale(f, 0.5)?;
    let half = cx.add1(Op::Floor(op::Floor::default()), &[half])?;
    let twice = cx.scale(half, 2.0)?;
    let odd = cx.sub(f, twice)?;
    // lo + e + odd · (range − 2e)
    let two_e = cx.scale(e, -2.0)?;
    let span = cx.add2(two_e, range_c)?;
    let flip = cx.mul(odd, span)?;
    let v = cx.add2(e, flip)?;
    let v = cx.add2(v, lo_c)?;
    // slope: sign(x − lo) · (1 − 2·odd), the sign +1 at x = lo.
    let zero = cx.scalar(dt, 0.0);
    let below = cx.add1(Op::Less(op::Less::default()), &[u0, zero])?;
    let (neg, pos) = (cx.scalar(dt, -1.0), cx.scalar(dt, 1.0));
    let sign = cx.where_(below, neg, pos)?;
    let m2 = cx.scale(odd, -2.0)?;
    let flip = cx.add2(m2, pos)?;
    let slope = cx.mul(sign, flip)?;
    Ok((v, slope))
}

/// Where `v` lies outside `[lo, hi]` (a boolean tensor).
fn outside(cx: &mut GradCx<'_>, v: Value, lo: f64, hi: f64) -> std::result::Result<Value, String> {
    let dt = cx.dtype(v);
    let (lo, hi) = (cx.scalar(dt, lo), cx.scalar(dt, hi));
    let below = cx.add1(Op::Less(op::Less::default()), &[v, lo])?;
    let above = cx.add1(Op::Greater(op::Greater::default()), &[v, hi])?;
    cx.add1(Op::Or(op::Or::default()), &[below, above])
}

/// The gradients of `GridSample`, built from the forward's own arithmetic: per spatial dim,
/// the grid coordinate is unnormalized (`pos = g · s + (L − 1)/2`), rounded (nearest),
/// moved inside by the padding mode as [`grid_sample`] does (its slope kept: 0 where the
/// border clamps, ±1 by reflection), and its taps get integer positions (the floor plus
/// each tap's offset, mapped by the padding mode; outside the image under `zeros` a tap's
/// weight is 0) and weights `w(f)` with derivatives `w'(f)` in the fraction `f`. The taps of
/// all dims combine as an outer product into flat pixel indices and weights, so
/// `dX = ScatterElements(add)` of `w · dY` and `∂L/∂pos_d = Σ_taps (Σ_c dY · X[tap]) · w'_d ·
/// Π_{e≠d} w_e`, times the slope and `s`. Nearest sampling passes no gradient to the grid.
fn grid_sample_grad(op: &op::GridSample, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    if !cx.want(0) && !cx.want(1) {
        return Ok(());
    }
    let (x, grid) = (cx.x(0)?, cx.x(1)?);
    let (xd, gd) = (cx.dims(x)?, cx.dims(grid)?);
    let r = xd.len();
    if r < 3 || gd.len() != r || gd[r - 1] != r as i64 - 2 || gd[0] != xd[0] {
        return Err(format!("GridSample's gradient: X {xd:?} with a grid of {gd:?}"));
    }
    let (n, c) = (xd[0], xd[1]);
    let dims = xd[2..].to_vec();
    let k = dims.len();
    let p: i64 = gd[1..r - 1].iter().product();
    let plane: i64 = dims.iter().product();
    let align = op.align_corners() != 0;
    let pad = op.padding_mode();
    let nearest = op.mode() == "nearest";
    let (offsets, coef) = taps_of(op.mode()).ok_or_else(|| format!("GridSample's gradient: mode {}", op.mode()))?;
    let t = offsets.len();
    let dt = cx.dtype(x);
    let clamp = |cx: &mut GradCx<'_>, v: Value, lo: f64, hi: f64| -> std::result::Result<Value, String> {
        let (l, h) = (cx.scalar(dt, lo), cx.scalar(dt, hi));
        let v = cx.add1(Op::Min(op::Min::default()), &[v, h])?;
        cx.add1(Op::Max(op::Max::default()), &[v, l])
    };
    let g3 = cx.reshape(grid, &[n, p, k as i64])?;
    // The per-tap constants: a [T] vector of coefficient i, and of its derivative's.
    let coef_vec =
        |cx: &mut GradCx<'_>, i: usize| cx.constant(Array::float(dt, vec![t], coef.iter().map(|w| w[i]).collect()));
    let dcoef_vec = |cx: &mut GradCx<'_>, i: usize| {
        cx.constant(Array::float(dt, vec![t], coef.iter().map(|w| (i + 1) as f64 * w[i + 1]).collect()))
    };
    // Per dim: weights, weight derivatives (times the position's slope), flat index part.
    let mut ws = Vec::with_capacity(k);
    let mut dws = Vec::with_capacity(k);
    let mut lin: Option<Value> = None;
    let stride = |d: usize| dims[d + 1..].iter().product::<i64>();
    for d in 0..k {
        let len = dims[d] as f64;
        let idx = cx.constant(Array::i64(vec![1], vec![(k - 1 - d) as i64]));
        let gdim = cx.add1(Op::Gather(op::Gather { axis: Some(2) }), &[g3, idx])?; // [N, P, 1]
        let s = if align { (len - 1.0) / 2.0 } else { len / 2.0 };
        let pos = cx.scale(gdim, s)?;
        let mid = cx.scalar(dt, (len - 1.0) / 2.0);
        let mut pos = cx.add2(pos, mid)?;
        if nearest {
            pos = cx.add1(Op::Round(op::Round::default()), &[pos])?;
        }
        let (lo, hi) = if align { (0.0, len - 1.0) } else { (-0.5, len - 0.5) };
        let mut slope: Option<Value> = None;
        match pad {
            "border" => {
                let out = outside(cx, pos, lo, hi)?;
                let clamped = clamp(cx, pos, 0.0, len - 1.0)?;
                pos = cx.where_(out, clamped, pos)?;
                let (zero, one) = (cx.scalar(dt, 0.0), cx.scalar(dt, 1.0));
                slope = Some(cx.where_(out, zero, one)?);
            }
            "reflection" if hi > lo => {
                let (v, sl) = reflect_in_graph(cx, pos, lo, hi)?;
                pos = v;
                slope = Some(sl);
            }
            "reflection" => {
                // One pixel, corners aligned: every position reflects to it.
                pos = cx.zeros_like(pos)?;
                slope = Some(cx.zeros_like(pos)?);
            }
            _ => {}
        }
        let base = cx.add1(Op::Floor(op::Floor::default()), &[pos])?;
        let f = cx.sub(pos, base)?;
        // Horner: w = c0 + f(c1 + f(c2 + f c3)); w' = c1 + f(2c2 + f 3c3).
        let mut w = coef_vec(cx, 3);
        for i in (0..3).rev() {
            let m = cx.mul(w, f)?;
            let ci = coef_vec(cx, i);
            w = cx.add2(m, ci)?;
        }
        let mut dw = dcoef_vec(cx, 2);
        for i in (0..2).rev() {
            let m = cx.mul(dw, f)?;
            let ci = dcoef_vec(cx, i);
            dw = cx.add2(m, ci)?;
        }
        let dw_scale = cx.scalar(dt, s);
        let mut dw = cx.mul(dw, dw_scale)?;
        if let Some(sl) = slope {
            dw = cx.mul(dw, sl)?;
        }
        let offs = cx.constant(Array::float(dt, vec![t], offsets.clone()));
        let mut at = cx.add2(base, offs)?; // [N, P, T]
        match pad {
            "border" => at = clamp(cx, at, 0.0, len - 1.0)?,
            "reflection" => {
                if hi > lo {
                    at = reflect_in_graph(cx, at, lo, hi)?.0;
                }
                at = clamp(cx, at, 0.0, len - 1.0)?;
                at = cx.add1(Op::Floor(op::Floor::default()), &[at])?;
            }
            _ => {
                let out = outside(cx, at, 0.0, len - 1.0)?;
                let (zero, one) = (cx.scalar(dt, 0.0), cx.scalar(dt, 1.0));
                let valid = cx.where_(out, zero, one)?;
                at = clamp(cx, at, 0.0, len - 1.0)?;
                w = cx.mul(w, valid)?;
                dw = cx.mul(dw, valid)?;
            }
        }
        // Taps of dim d on axis 2 + d of [N, P, T, .., T].
        let mut shape = vec![n, p];
        shape.extend((0..k).map(|e| if e == d { t as i64 } else { 1 }));
        let w_full = cx.expand(w, &[n, p, t as i64])?;
        ws.push(cx.reshape(w_full, &shape)?);
        let dw_full = cx.expand(dw, &[n, p, t as i64])?;
        dws.push(cx.reshape(dw_full, &shape)?);
        let part = cx.scale(at, stride(d) as f64)?;
        let part = cx.reshape(part, &shape)?;
        lin = Some(match lin {
            Some(l) => cx.add2(l, part)?,
            None => part,
        });
    }
    let combos = (t as i64).pow(k as u32);
    let q = p * combos;
    let mut taps_shape = vec![n, p];
    taps_shape.extend(vec![t as i64; k]);
    let lin = cx.expand(lin.ok_or("GridSample's gradient: no spatial dims")?, &taps_shape)?;
    let lin = cx.reshape(lin, &[n, 1, q])?;
    let idx = cx.cast(lin, crate::types::DType::Int64)?;
    let idx = cx.expand(idx, &[n, c, q])?;
    let dy4 = cx.reshape(dy, &[n, c, p, 1])?;
    let product = |cx: &mut GradCx<'_>, vs: &[Value]| -> std::result::Result<Value, String> {
        let mut acc = vs[0];
        for &v in &vs[1..] {
            acc = cx.mul(acc, v)?;
        }
        cx.expand(acc, &taps_shape)
    };
    if cx.want(0) {
        let wall = product(cx, &ws)?;
        let wall = cx.reshape(wall, &[n, 1, p, combos])?;
        let contrib = cx.mul(dy4, wall)?;
        let contrib = cx.reshape(contrib, &[n, c, q])?;
        let zeros = cx.zeros_like(x)?;
        let zeros = cx.reshape(zeros, &[n, c, plane])?;
        let add = Op::ScatterElements(op::ScatterElements { axis: Some(2), reduction: Some("add".into()) });
        let dx = cx.add1(add, &[zeros, idx, contrib])?;
        let dx = cx.reshape(dx, &xd)?;
        cx.set(0, dx);
    }
    if cx.want(1) {
        if nearest {
            let z = cx.zeros_like(grid)?;
            cx.set(1, z);
            return Ok(());
        }
        let xf = cx.reshape(x, &[n, c, plane])?;
        let px = cx.add1(Op::GatherElements(op::GatherElements { axis: Some(2) }), &[xf, idx])?;
        let px = cx.reshape(px, &[n, c, p, combos])?;
        let a = cx.mul(px, dy4)?;
        let a = cx.reduce_sum(a, &[1], false)?;
        let a = cx.reshape(a, &taps_shape)?;
        let tap_axes: Vec<i64> = (2..2 + k as i64).collect();
        let mut parts = vec![None; k];
        for d in 0..k {
            let mut vs: Vec<Value> = ws.clone();
            vs[d] = dws[d];
            let prod = product(cx, &vs)?;
            let m = cx.mul(prod, a)?;
            let sum = cx.reduce_sum(m, &tap_axes, false)?;
            // The grid lists coordinates in reverse dim order.
            parts[k - 1 - d] = Some(cx.reshape(sum, &[n, p, 1])?);
        }
        let parts: Vec<Value> = parts.into_iter().flatten().collect();
        let dg = if k == 1 { parts[0] } else { cx.add1(Op::Concat(op::Concat { axis: Some(2) }), &parts)? };
        let dg = cx.reshape(dg, &gd)?;
        cx.set(1, dg);
    }
    Ok(())
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

/// The [`RoiGeometry`] of a `RoiAlign` or `RoiAlignGrad` (the same attributes).
macro_rules! roi_geometry {
    ($op:expr) => {
        RoiGeometry::of(
            $op.output_height(),
            $op.output_width(),
            $op.spatial_scale(),
            $op.coordinate_transformation_mode(),
            $op.sampling_ratio(),
        )
    };
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
        let geo = roi_geometry!(self);
        let max = self.mode() == "max";
        let xv = x.to_f64()?;
        let (nroi, c) = (bidx.len(), x.shape.get(1).copied().unwrap_or(0));
        let mut out = vec![0.0f64; nroi * c * geo.ph * geo.pw];
        let mut seen = vec![false; out.len()];
        roi_samples(&geo, &x.shape, &rois, &bidx, |o, taps, count| {
            let terms = taps.map(|(i, w)| w * xv[i]);
            if max {
                let v = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                out[o] = if seen[o] { out[o].max(v) } else { v };
                seen[o] = true;
            } else {
                out[o] += terms.iter().sum::<f64>() / count;
            }
        })?;
        Ok(vec![Array::float(x.dtype, vec![nroi, c, geo.ph, geo.pw], out)])
    }

    /// X's gradient by `RoiAlignGrad` (the sampling positions are data-dependent: adaptive
    /// sampling counts follow each region's size); the regions get none (as in torchvision).
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let (x, rois, bidx) = (cx.x(0)?, cx.x(1)?, cx.x(2)?);
            let o = self;
            let grad = op::RoiAlignGrad {
                coordinate_transformation_mode: o.coordinate_transformation_mode.clone(),
                mode: o.mode.clone(),
                output_height: o.output_height,
                output_width: o.output_width,
                sampling_ratio: o.sampling_ratio,
                spatial_scale: o.spatial_scale,
            };
            let d = cx.add1(Op::RoiAlignGrad(grad), &[dy, x, rois, bidx])?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

/// The sampling geometry of `RoiAlign` (and its gradient).
struct RoiGeometry {
    ph: usize,
    pw: usize,
    scale: f64,
    half: bool,
    sampling_ratio: i64,
}

impl RoiGeometry {
    fn of(ph: i64, pw: i64, scale: f32, transform: &str, sampling_ratio: i64) -> Self {
        RoiGeometry {
            ph: ph.max(1) as usize,
            pw: pw.max(1) as usize,
            scale: f64::from(scale),
            half: transform == "half_pixel",
            sampling_ratio,
        }
    }
}

/// Visits every sample of every output of RoiAlign on X of `xs` [N, C, H, W]: `visit(o, taps,
/// count)` with `o` the output's flat index, `taps` the sample's four bilinear neighbours
/// (flat index into X, weight; weights 0 for a sample outside the image) and `count` the
/// samples per output bin. Outputs are visited in order, each one's samples in a row.
fn roi_samples(
    geo: &RoiGeometry,
    xs: &[usize],
    rois: &[f64],
    bidx: &[i64],
    mut visit: impl FnMut(usize, [(usize, f64); 4], f64),
) -> std::result::Result<(), EvalError> {
    if xs.len() != 4 || xs[2] == 0 || xs[3] == 0 {
        return Err(EvalError::Invalid(format!("RoiAlign needs X [N, C, H, W], got {xs:?}")));
    }
    let (c, h, w) = (xs[1], xs[2], xs[3]);
    let (ph, pw) = (geo.ph, geo.pw);
    let nroi = bidx.len();
    if rois.len() != nroi * 4 {
        return Err(EvalError::Invalid(format!("RoiAlign: {} roi values for {nroi} regions", rois.len())));
    }
    for r in 0..nroi {
        let b = usize::try_from(bidx[r])
            .ok()
            .filter(|&b| b < xs[0])
            .ok_or_else(|| EvalError::Invalid(format!("batch index {}", bidx[r])))?;
        let off = if geo.half { 0.5 } else { 0.0 };
        let (sw, sh) = (rois[r * 4] * geo.scale - off, rois[r * 4 + 1] * geo.scale - off);
        let (ew, eh) = (rois[r * 4 + 2] * geo.scale - off, rois[r * 4 + 3] * geo.scale - off);
        let (mut rw, mut rh) = (ew - sw, eh - sh);
        if !geo.half {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let (bh, bw) = (rh / ph as f64, rw / pw as f64);
        let sr = geo.sampling_ratio;
        let gh = if sr > 0 { sr as usize } else { (rh / ph as f64).ceil() as usize };
        let gw = if sr > 0 { sr as usize } else { (rw / pw as f64).ceil() as usize };
        let count = (gh * gw).max(1) as f64;
        for ch in 0..c {
            let base = (b * c + ch) * h * w;
            for py in 0..ph {
                for px in 0..pw {
                    let o = ((r * c + ch) * ph + py) * pw + px;
                    for iy in 0..gh {
                        let yy = sh + py as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                        for ix in 0..gw {
                            let xx = sw + px as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                            // Bilinear weights of the four neighbours (zero outside).
                            let taps = if yy < -1.0 || yy > h as f64 || xx < -1.0 || xx > w as f64 {
                                [(base, 0.0); 4]
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
                                    (base + yl * w + xl, hy * hx),
                                    (base + yl * w + xh, hy * lx),
                                    (base + yh * w + xl, ly * hx),
                                    (base + yh * w + xh, ly * lx),
                                ]
                            };
                            visit(o, taps, count);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

impl OpRules for op::RoiAlignGrad {
    fn arity(&self) -> Arity {
        Arity::fixed(4)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.one(cx.dims(1).cloned())
    }

    no_work_whole!();

    /// Each output's gradient spread over its samples' neighbours by their weights, divided
    /// by the sample count; in `max` mode all of it to the first largest term, as the
    /// forward took it (terms of samples outside the image are zeros of no position).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (dy, x, rois, bidx) = (cx.req(0)?, cx.req(1)?, cx.req(2)?.to_f64()?, cx.req(3)?.to_i64()?);
        let geo = roi_geometry!(self);
        let (dv, xv) = (dy.to_f64()?, x.to_f64()?);
        let c = x.shape.get(1).copied().unwrap_or(0);
        if dv.len() != bidx.len() * c * geo.ph * geo.pw {
            return Err(EvalError::Invalid(format!("RoiAlignGrad: dY of {:?} for {} regions", dy.shape, bidx.len())));
        }
        let mut dx = vec![0.0; xv.len()];
        if self.mode() == "max" {
            // Per output: the largest term so far, and where it came from (its X index and
            // weight; none for a sample outside the image).
            type Best = Option<(f64, Option<(usize, f64)>)>;
            let mut best: Vec<Best> = vec![None; dv.len()];
            roi_samples(&geo, &x.shape, &rois, &bidx, |o, taps, _| {
                for (i, w) in taps {
                    let v = w * xv[i];
                    let at = (w != 0.0).then_some((i, w));
                    if best[o].is_none_or(|(b, _)| v > b) {
                        best[o] = Some((v, at));
                    }
                }
            })?;
            for (o, b) in best.into_iter().enumerate() {
                if let Some((_, Some((i, w)))) = b {
                    dx[i] += w * dv[o];
                }
            }
        } else {
            roi_samples(&geo, &x.shape, &rois, &bidx, |o, taps, count| {
                for (i, w) in taps {
                    dx[i] += w * dv[o] / count;
                }
            })?;
        }
        Ok(vec![Array::float(dy.dtype, x.shape.clone(), dx)])
    }
}
