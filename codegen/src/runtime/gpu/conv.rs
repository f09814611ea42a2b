//! Convolution and pooling kernels: N-d (N ≤ 3) convolution as im2col + one GEMM (the
//! columns of all images in one GEMM per group when each image has few output positions),
//! or direct; transposed convolution gathering per output; max, average and Lp pooling.

use ir::DType;
use ir::op::{self, Op};

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, groups, nested};
use super::gemm::{GemmSpec, gemm};
use super::wgsl::{Axis, Binding, MATH_FNS, remap, source, specialize, to3};

/// The conv parameter vector: `[count, N, C, M, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH,
/// SW, DD, DH, DW, PD, PH, PW]`.
#[allow(clippy::too_many_arguments)]
fn conv_params(
    x: &[usize],
    oshape: &[usize],
    kernel: &[usize],
    strides: &[usize],
    dil: &[usize],
    pads: &[usize],
    group: usize,
) -> Vec<u32> {
    let count: usize = oshape.iter().product();
    let mut p: Vec<u32> = vec![count as u32, x[0] as u32, x[1] as u32, oshape[1] as u32, group as u32];
    for v in [to3(&x[2..], 1), to3(&oshape[2..], 1), to3(kernel, 1), to3(strides, 1), to3(dil, 1), to3(pads, 0)] {
        p.extend(v.iter().map(|&x| x as u32));
    }
    p
}

fn usizes(v: &Option<Vec<i64>>, k: usize) -> Vec<usize> {
    v.as_ref().map_or(vec![1; k], |v| v.iter().map(|&s| s as usize).collect())
}

impl Kernel for op::Conv {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(w)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        let r = x.shape.len();
        if x.elem() != Elem::F32 || !(3..=5).contains(&r) {
            return Ok(None);
        }
        let k = r - 2;
        let kernel: Vec<usize> = w.shape[2..].to_vec();
        let (strides, dil) = (usizes(&self.strides, k), usizes(&self.dilations, k));
        let kshape: Vec<i64> = kernel.iter().map(|&v| v as i64).collect();
        let (ks, kd): (Vec<i64>, Vec<i64>) =
            (strides.iter().map(|&v| v as i64).collect(), dil.iter().map(|&v| v as i64).collect());
        let win = ir::eval::window(
            &x.shape[2..],
            &kshape,
            Some(&ks),
            Some(&kd),
            self.pads.as_deref(),
            self.auto_pad(),
            false,
        )?;
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let oshape = c.outputs[0].shape.clone();
        let p = conv_params(&x.shape, &oshape, &kernel, &strides, &dil, &win.pad_begin, self.group() as usize);
        let bias = cx.input(2).map(|_| Buf::In(2));
        if conv_im2col(&mut c, bias, &p, &oshape)? {
            return Ok(Some(c));
        }
        let mut bufs = vec![Buf::In(0), Buf::In(1)];
        bufs.extend(bias);
        bufs.push(Buf::Out(0));
        let count = p[0] as usize;
        if count > 0 {
            let trips = conv_trips(&p);
            c.launch_loop(specialize(&conv_src(bias.is_some()), &p), bufs, p, groups(count), trips);
        }
        Ok(Some(c))
    }
}

impl Kernel for op::ConvTranspose {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(w)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        let r = x.shape.len();
        if x.elem() != Elem::F32 || !(3..=5).contains(&r) {
            return Ok(None);
        }
        let k = r - 2;
        let kernel: Vec<usize> = w.shape[2..].to_vec();
        let (strides, dil) = (usizes(&self.strides, k), usizes(&self.dilations, k));
        // The leading pads as the reference computes them.
        let (_, pads) = ir::eval::conv_transpose_geometry(self, &x.shape[2..], &kernel)?;
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let oshape = c.outputs[0].shape.clone();
        let p = conv_params(&x.shape, &oshape, &kernel, &strides, &dil, &pads, self.group() as usize);
        let bias = cx.input(2).map(|_| Buf::In(2));
        let mut bufs = vec![Buf::In(0), Buf::In(1)];
        bufs.extend(bias);
        bufs.push(Buf::Out(0));
        let count = p[0] as usize;
        if count > 0 {
            let trips = conv_trips(&p);
            c.launch_loop(specialize(&conv_transpose_src(bias.is_some()), &p), bufs, p, groups(count), trips);
        }
        Ok(Some(c))
    }
}

/// Loop iterations of a (transposed) convolution invocation: the group's input channels,
/// then each kernel dim. `p` as [`conv_src`]'s.
fn conv_trips(p: &[u32]) -> u64 {
    nested(&[p[2] / p[4].max(1), p[11], p[12], p[13]].map(|v| v as usize))
}

/// Loop iterations of a pooling-gradient invocation: the kernel taps, and for each the
/// window's own walk (max: every tap; average: the three divisor loops).
fn pool_grad_trips(p: &[u32], max: bool) -> u64 {
    let k = [p[11], p[12], p[13]].map(|v| v as usize);
    let taps = k.iter().product::<usize>() as u64;
    let window = if max { nested(&k) } else { 3 + k.iter().sum::<usize>() as u64 };
    nested(&k).saturating_add(taps.saturating_mul(window))
}

fn vals(v: &Option<Vec<i64>>, k: usize, d: i64) -> Vec<usize> {
    v.clone().unwrap_or_else(|| vec![d; k]).iter().map(|&x| x.max(0) as usize).collect()
}

/// A convolution gradient's kernel shape, strides, dilations and pads, as its attributes hold
/// them.
type GradGeometry<'a> = (&'a Option<Vec<i64>>, &'a Option<Vec<i64>>, &'a Option<Vec<i64>>, &'a Option<Vec<i64>>);

/// [`conv_params`] of shapes `a` → `b` under a convolution gradient's attributes (the forward
/// convolution's with X → dY; its transposed view with dY → X).
fn grad_conv_params(
    a: &[usize],
    b: &[usize],
    (kernel, strides, dilations, pads): GradGeometry<'_>,
    group: i64,
) -> Vec<u32> {
    let k = a.len() - 2;
    let pads = vals(pads, 2 * k, 0);
    conv_params(
        a,
        b,
        &vals(kernel, k, 1),
        &vals(strides, k, 1),
        &vals(dilations, k, 1),
        &pads[..k],
        group.max(1) as usize,
    )
}

impl Kernel for op::ConvGradInput {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(dy), Some(_)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        let r = dy.shape.len();
        if dy.elem() != Elem::F32 || !(3..=5).contains(&r) {
            return Ok(None);
        }
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let xshape = c.outputs[0].shape.clone();
        let geometry = (&self.kernel_shape, &self.strides, &self.dilations, &self.pads);
        let fwd = grad_conv_params(&xshape, &dy.shape, geometry, self.group());
        if conv_grad_input_gemm(&mut c, &fwd)? {
            return Ok(Some(c));
        }
        let p = grad_conv_params(&dy.shape, &xshape, geometry, self.group());
        // dX is dY's transposed convolution with the same weights.
        if p[0] > 0 {
            c.launch_loop(
                specialize(&conv_transpose_src(false), &p),
                vec![Buf::In(0), Buf::In(1), Buf::Out(0)],
                p.clone(),
                groups(p[0] as usize),
                conv_trips(&p),
            );
        }
        Ok(Some(c))
    }
}

impl Kernel for op::ConvGradWeight {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(dy)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        let r = x.shape.len();
        if x.elem() != Elem::F32 || !(3..=5).contains(&r) {
            return Ok(None);
        }
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let geometry = (&self.kernel_shape, &self.strides, &self.dilations, &self.pads);
        let mut p = grad_conv_params(&x.shape, &dy.shape, geometry, self.group());
        if conv_grad_weight_gemm(&mut c, &p)? {
            return Ok(Some(c));
        }
        let count: usize = c.outputs[0].shape.iter().product();
        p[0] = count as u32;
        if count > 0 {
            // Every weight walks all images and output positions.
            let trips = nested(&[p[1], p[8], p[9], p[10]].map(|v| v as usize));
            c.launch_loop(
                specialize(&conv_grad_weight_src(), &p),
                vec![Buf::In(0), Buf::In(1), Buf::Out(0)],
                p,
                groups(count),
                trips,
            );
        }
        Ok(Some(c))
    }
}

/// The weight gradient of a convolution, one invocation per weight: `dW[m, c, k] =
/// Σ_{n, o} dY[n, m, o]·X[n, g·C/G + c, o·s + k·d − p]`. `P` as [`conv_src`]'s with the
/// weight count first.
pub fn conv_grad_weight_src() -> String {
    let body = "    let N = P[1]; let C = P[2]; let M = P[3]; let G = P[4];
    let D = P[5]; let H = P[6]; let W = P[7];
    let OD = P[8]; let OH = P[9]; let OW = P[10];
    let KD = P[11]; let KH = P[12]; let KW = P[13];
    let cg = C / G;
    var rem = i;
    let kw = rem % KW; rem = rem / KW;
    let kh = rem % KH; rem = rem / KH;
    let kd = rem % KD; rem = rem / KD;
    let c = rem % cg; let m = rem / cg;
    let ch = (m / (M / G)) * cg + c;
    var acc = 0.0;
    for (var n = 0u; n < N; n = n + 1u) {
        for (var od = 0u; od < OD; od = od + 1u) {
            let id = i32(od * P[14] + kd * P[17]) - i32(P[20]);
            if (id < 0 || id >= i32(D)) { continue; }
            for (var oh = 0u; oh < OH; oh = oh + 1u) {
                let ih = i32(oh * P[15] + kh * P[18]) - i32(P[21]);
                if (ih < 0 || ih >= i32(H)) { continue; }
                for (var ow = 0u; ow < OW; ow = ow + 1u) {
                    let iw = i32(ow * P[16] + kw * P[19]) - i32(P[22]);
                    if (iw < 0 || iw >= i32(W)) { continue; }
                    let xo = (((n * C + ch) * D + u32(id)) * H + u32(ih)) * W + u32(iw);
                    let yo = (((n * M + m) * OD + od) * OH + oh) * OW + ow;
                    acc = acc + DY[yo] * X[xo];
                }
            }
        }
    }
    Y[i] = acc;";
    source(&[("X", Elem::F32, false), ("DY", Elem::F32, false), ("Y", Elem::F32, true)], "", body)
}

/// A pool's kernel shape, strides, dilations and pads, as its attributes hold them.
type PoolGeometry<'a> = (&'a Option<Vec<i64>>, &'a Option<Vec<i64>>, &'a Option<Vec<i64>>, &'a Option<Vec<i64>>);

/// The pooling-gradient parameters: [`conv_params`] over X and dY (one group, as many
/// "filters" as channels), then the end pads.
fn pool_grad_params(x: &[usize], dy: &[usize], o: PoolGeometry<'_>) -> Vec<u32> {
    let k = x.len() - 2;
    let pads = vals(o.3, 2 * k, 0);
    let mut p = conv_params(x, dy, &vals(o.0, k, 1), &vals(o.1, k, 1), &vals(o.2, k, 1), &pads[..k], 1);
    p[0] = x.iter().product::<usize>() as u32;
    p.extend(to3(&pads[k..], 0).iter().map(|&v| v as u32));
    p
}

impl Kernel for op::MaxPoolGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(dy)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if x.elem() != Elem::F32 || !(3..=5).contains(&x.shape.len()) {
            return Ok(None);
        }
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let p = pool_grad_params(&x.shape, &dy.shape, (&self.kernel_shape, &self.strides, &self.dilations, &self.pads));
        if p[0] > 0 {
            c.launch_loop(
                specialize(&pool_grad_src(true), &p),
                vec![Buf::In(0), Buf::In(1), Buf::Out(0)],
                p.clone(),
                groups(p[0] as usize),
                pool_grad_trips(&p, true),
            );
        }
        Ok(Some(c))
    }
}

impl Kernel for op::AveragePoolGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(dy) = cx.input(0) else { return Ok(None) };
        if dy.elem() != Elem::F32 || !(3..=5).contains(&dy.shape.len()) {
            return Ok(None);
        }
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let xshape = c.outputs[0].shape.clone();
        let mut p =
            pool_grad_params(&xshape, &dy.shape, (&self.kernel_shape, &self.strides, &self.dilations, &self.pads));
        p.push(u32::from(self.count_include_pad() != 0));
        if p[0] > 0 {
            c.launch_loop(
                specialize(&pool_grad_src(false), &p),
                vec![Buf::In(0), Buf::Out(0)],
                p.clone(),
                groups(p[0] as usize),
                pool_grad_trips(&p, false),
            );
        }
        Ok(Some(c))
    }
}

/// Pooling gradients, one invocation per input element: the windows that cover it (those
/// whose taps land on it); max: the window's first maximum is this element; average: its
/// share of the window. `P` as [`pool_grad_params`] (+ count_include_pad for average).
pub fn pool_grad_src(max: bool) -> String {
    let window = if max {
        "                    // The first maximum of window (od, oh, ow).
                    var best = bitcast<f32>(0xff800000u);
                    var at = -1;
                    for (var a = 0u; a < KD; a = a + 1u) {
                        let zd = i32(od * P[14] + a * P[17]) - i32(P[20]);
                        if (zd < 0 || zd >= i32(D)) { continue; }
                        for (var b = 0u; b < KH; b = b + 1u) {
                            let zh = i32(oh * P[15] + b * P[18]) - i32(P[21]);
                            if (zh < 0 || zh >= i32(H)) { continue; }
                            for (var e = 0u; e < KW; e = e + 1u) {
                                let zw = i32(ow * P[16] + e * P[19]) - i32(P[22]);
                                if (zw < 0 || zw >= i32(W)) { continue; }
                                let v = X[plane * D * H * W + (u32(zd) * H + u32(zh)) * W + u32(zw)];
                                if (at < 0 || v > best) { best = v; at = i32((u32(zd) * H + u32(zh)) * W + u32(zw)); }
                            }
                        }
                    }
                    if (at == i32(pos)) { acc = acc + DY[yo]; }"
    } else {
        "                    // The window's divisor, as the forward counted it.
                    var div = 1.0;
                    for (var q = 0u; q < 3u; q = q + 1u) {
                        let o = select(select(ow, oh, q == 1u), od, q == 0u);
                        let ext = select(select(W, H, q == 1u), D, q == 0u);
                        var cnt = 0u;
                        for (var a = 0u; a < P[11u + q]; a = a + 1u) {
                            let z = i32(o * P[14u + q] + a * P[17u + q]) - i32(P[20u + q]);
                            let inside = z >= 0 && z < i32(ext);
                            let padded = z < i32(ext + P[23u + q]);
                            if ((P[26] == 1u && padded) || inside) { cnt = cnt + 1u; }
                        }
                        div = div * f32(cnt);
                    }
                    acc = acc + DY[yo] / max(div, 1.0);"
    };
    let body = format!(
        "    let D = P[5]; let H = P[6]; let W = P[7];
    let OD = P[8]; let OH = P[9]; let OW = P[10];
    let KD = P[11]; let KH = P[12]; let KW = P[13];
    let pos = i % (D * H * W);
    let plane = i / (D * H * W);
    let iw = pos % W; let ih = (pos / W) % H; let id = pos / (W * H);
    var acc = 0.0;
    for (var kd = 0u; kd < KD; kd = kd + 1u) {{
        let td = i32(id) + i32(P[20]) - i32(kd * P[17]);
        if (td < 0 || td % i32(P[14]) != 0 || td / i32(P[14]) >= i32(OD)) {{ continue; }}
        let od = u32(td / i32(P[14]));
        for (var kh = 0u; kh < KH; kh = kh + 1u) {{
            let th = i32(ih) + i32(P[21]) - i32(kh * P[18]);
            if (th < 0 || th % i32(P[15]) != 0 || th / i32(P[15]) >= i32(OH)) {{ continue; }}
            let oh = u32(th / i32(P[15]));
            for (var kw = 0u; kw < KW; kw = kw + 1u) {{
                let tw = i32(iw) + i32(P[22]) - i32(kw * P[19]);
                if (tw < 0 || tw % i32(P[16]) != 0 || tw / i32(P[16]) >= i32(OW)) {{ continue; }}
                let ow = u32(tw / i32(P[16]));
                let yo = plane * OD * OH * OW + (od * OH + oh) * OW + ow;
                {{
{window}
                }}
            }}
        }}
    }}
    DX[i] = acc;"
    );
    let mut b: Vec<Binding<'_>> = Vec::new();
    if max {
        b.push(("X", Elem::F32, false));
    }
    b.extend([("DY", Elem::F32, false), ("DX", Elem::F32, true)]);
    source(&b, "", &body)
}

use ir::ops::conv::{WIDE_BELOW, gemm_path};

/// Convolution as im2col + one batched GEMM over `(n, g)`: `Y[n, g·Mg + m, p] =
/// Σ_k W[g·Mg + m, k] · COL[n·G + g, k, p] (+ bias[g·Mg + m])`. `p` is the parameter vector
/// of [`conv_src`]. Adds nothing and returns false (direct kernel) for tiny reductions or
/// when the column buffer would be too large.
fn conv_im2col(c: &mut Compiled, bias: Option<Buf>, p: &[u32], oshape: &[usize]) -> Result<bool, String> {
    let [_, n, ch, m, g] = [p[0], p[1], p[2], p[3], p[4]].map(|v| v as usize);
    let npos = (p[8] * p[9] * p[10]) as usize;
    let kvol = (p[11] * p[12] * p[13]) as usize;
    let (cg, mg) = (ch / g, m / g);
    let kk = cg * kvol;
    let rows = n * g * kk;
    if !gemm_path(n, ch, m, g, kvol, npos) {
        return Ok(false);
    }
    let col = c.temp(vec![rows, npos], DType::Float);
    // [rows, C, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]
    let mut q: Vec<u32> = vec![rows as u32, ch as u32, g as u32];
    q.extend_from_slice(&p[5..]);
    // Few output positions per image make thin GEMMs; then one GEMM per group spans all
    // images (`wide`) and a permutation puts the images back in front.
    let wide = n > 1 && npos < WIDE_BELOW;
    let trips = nested(&[q[6], q[7], q[8]].map(|v| v as usize));
    c.launch_loop(specialize(&im2col_src(wide), &q), vec![Buf::In(0), col], q, groups(rows), trips);
    let (cols, b_bst) = if wide { (n * npos, vec![0, kk * n * npos]) } else { (npos, vec![g * kk * npos, kk * npos]) };
    let spec = GemmSpec {
        a: Buf::In(1),
        b: col,
        c: bias,
        m: mg,
        n: cols,
        k: kk,
        a_st: (kk, 1),
        b_st: (cols, 1),
        c_st: (1, 0),
        batch: vec![if wide { 1 } else { n }, g],
        a_bst: vec![0, mg * kk],
        b_bst,
        c_bst: vec![0, mg],
        bases: (0, 0, 0),
        alpha: 1.0,
        beta: 1.0,
    };
    if !wide {
        gemm(c, &spec, Buf::Out(0))?;
        return Ok(true);
    }
    // `T[g, m, n, p]` → `Y[n, g, m, p]`.
    let t = c.temp(vec![g, mg, n, npos], DType::Float);
    gemm(c, &spec, t)?;
    let axes = [Axis::Same(npos), Axis::Same(mg * n * npos), Axis::Same(n * npos), Axis::Same(1)];
    let _ = oshape;
    remap(c, t, Elem::F32, Buf::Out(0), &[n, g, mg, npos], &axes, 0.0);
    Ok(true)
}

/// The gradient GEMMs' shapes from a forward parameter vector `p` ([`conv_params`] of X and
/// dY): `[n, ch, g, npos, mg, kk]` (images, input channels, groups, output positions, output
/// channels per group, reduction per group), or `None` when the GEMM path does not pay (tiny
/// reductions or outputs) or its column buffer would be too large.
fn grad_gemm_shape(p: &[u32]) -> Option<[usize; 6]> {
    let [n, ch, m, g] = [p[1], p[2], p[3], p[4]].map(|v| v as usize);
    let npos = (p[8] * p[9] * p[10]) as usize;
    let kvol = (p[11] * p[12] * p[13]) as usize;
    let (cg, mg) = (ch / g.max(1), m / g.max(1));
    let kk = cg * kvol;
    gemm_path(n, ch, m, g, kvol, npos).then_some([n, ch, g, npos, mg, kk])
}

/// dY (input `dy`, `[n, g, mg, npos]`) as `[g, mg, n, npos]`, the images beside the positions so
/// that one GEMM per group spans all of them; dY itself when there is one image.
fn dy_by_group(c: &mut Compiled, dy: Buf, [n, g, mg, npos]: [usize; 4]) -> Buf {
    if n == 1 {
        return dy;
    }
    let t = c.temp(vec![g, mg, n, npos], DType::Float);
    let axes = [Axis::Same(mg * npos), Axis::Same(npos), Axis::Same(g * mg * npos), Axis::Same(1)];
    remap(c, dy, Elem::F32, t, &[g, mg, n, npos], &axes, 0.0);
    t
}

/// The weight gradient as im2col + one GEMM per group over all images and positions:
/// `dW[g·Mg + m, k] = Σ_{n,p} dY[n, g·Mg + m, p] · COL[g, k, n, p]` (inputs X, dY). `p` is the
/// forward parameter vector ([`conv_params`] of X and dY). False (direct kernel) when
/// [`grad_gemm_shape`] says no.
fn conv_grad_weight_gemm(c: &mut Compiled, p: &[u32]) -> Result<bool, String> {
    let Some([n, ch, g, npos, mg, kk]) = grad_gemm_shape(p) else { return Ok(false) };
    let col = c.temp(vec![g * kk, n * npos], DType::Float);
    let mut q: Vec<u32> = vec![(n * g * kk) as u32, ch as u32, g as u32];
    q.extend_from_slice(&p[5..]);
    let trips = nested(&[q[6], q[7], q[8]].map(|v| v as usize));
    c.launch_loop(specialize(&im2col_src(true), &q), vec![Buf::In(0), col], q, groups(n * g * kk), trips);
    let dy = dy_by_group(c, Buf::In(1), [n, g, mg, npos]);
    let cols = n * npos;
    let spec = GemmSpec {
        a: dy,
        b: col,
        c: None,
        m: mg,
        n: kk,
        k: cols,
        a_st: (cols, 1),
        b_st: (1, cols),
        c_st: (0, 0),
        batch: vec![g],
        a_bst: vec![mg * cols],
        b_bst: vec![kk * cols],
        c_bst: vec![0],
        bases: (0, 0, 0),
        alpha: 1.0,
        beta: 0.0,
    };
    gemm(c, &spec, Buf::Out(0))?;
    Ok(true)
}

/// The input gradient as one GEMM per group and a col2im: `COL[g, k, n, p] = Σ_m
/// W[g·Mg + m, k] · dY[n, g·Mg + m, p]`, then each input element sums the columns of the
/// kernel taps that read it (inputs dY, W). `p` is the forward parameter vector
/// ([`conv_params`] of X and dY). False (direct kernel) when [`grad_gemm_shape`] says no.
fn conv_grad_input_gemm(c: &mut Compiled, p: &[u32]) -> Result<bool, String> {
    let Some([n, ch, g, npos, mg, kk]) = grad_gemm_shape(p) else { return Ok(false) };
    let dy = dy_by_group(c, Buf::In(0), [n, g, mg, npos]);
    let cols = n * npos;
    let col = c.temp(vec![g * kk, cols], DType::Float);
    let spec = GemmSpec {
        a: Buf::In(1),
        b: dy,
        c: None,
        m: kk,
        n: cols,
        k: mg,
        a_st: (1, kk),
        b_st: (cols, 1),
        c_st: (0, 0),
        batch: vec![g],
        a_bst: vec![mg * kk],
        b_bst: vec![mg * cols],
        c_bst: vec![0],
        bases: (0, 0, 0),
        alpha: 1.0,
        beta: 0.0,
    };
    gemm(c, &spec, col)?;
    // [count, N, C, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]
    let count = n * ch * (p[5] * p[6] * p[7]) as usize;
    let mut q: Vec<u32> = vec![count as u32, n as u32, ch as u32, g as u32];
    q.extend_from_slice(&p[5..]);
    let trips = nested(&[q[10], q[11], q[12]].map(|v| v as usize));
    c.launch_loop(specialize(&col2im_src(), &q), vec![col, Buf::Out(0)], q, groups(count), trips);
    Ok(true)
}

/// col2im of a grouped N-d convolution (as 3-d), gathering: `DX[n, g·cg + c, d, h, w] =
/// Σ_{kd, kh, kw} COL[g, (c, kd, kh, kw), n, (od, oh, ow)]` over the taps with
/// `od·s + kd·dil − pad = d` (and so on) inside the output. One invocation per input element.
/// `P = [count, N, C, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]`.
pub fn col2im_src() -> String {
    let body = "    let N = P[1]; let C = P[2]; let G = P[3];
    let D = P[4]; let H = P[5]; let W = P[6];
    let OD = P[7]; let OH = P[8]; let OW = P[9];
    let KD = P[10]; let KH = P[11]; let KW = P[12];
    let cg = C / G;
    let npos = OD * OH * OW;
    let kk = cg * KD * KH * KW;
    var rem = i;
    let iw = rem % W; rem = rem / W;
    let ih = rem % H; rem = rem / H;
    let id = rem % D; rem = rem / D;
    let ch = rem % C; let n = rem / C;
    let g = ch / cg; let c = ch % cg;
    var acc = 0.0;
    for (var kd = 0u; kd < KD; kd = kd + 1u) {
        let td = i32(id) + i32(P[19]) - i32(kd * P[16]);
        if (td < 0 || td % i32(P[13]) != 0 || td / i32(P[13]) >= i32(OD)) { continue; }
        let od = u32(td / i32(P[13]));
        for (var kh = 0u; kh < KH; kh = kh + 1u) {
            let th = i32(ih) + i32(P[20]) - i32(kh * P[17]);
            if (th < 0 || th % i32(P[14]) != 0 || th / i32(P[14]) >= i32(OH)) { continue; }
            let oh = u32(th / i32(P[14]));
            for (var kw = 0u; kw < KW; kw = kw + 1u) {
                let tw = i32(iw) + i32(P[21]) - i32(kw * P[18]);
                if (tw < 0 || tw % i32(P[15]) != 0 || tw / i32(P[15]) >= i32(OW)) { continue; }
                let ow = u32(tw / i32(P[15]));
                let k = ((c * KD + kd) * KH + kh) * KW + kw;
                acc = acc + COL[((g * kk + k) * N + n) * npos + (od * OH + oh) * OW + ow];
            }
        }
    }
    DX[i] = acc;";
    source(&[("COL", Elem::F32, false), ("DX", Elem::F32, true)], "", body)
}

/// Windowed pools: `Name: kind`.
macro_rules! pool_kernels {
    ($($name:ident: $kind:literal;)*) => {$(
        impl Kernel for op::$name {
            fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
                let Some(x) = cx.input(0) else { return Ok(None) };
                if x.elem() != Elem::F32 || !(3..=5).contains(&x.shape.len()) || cx.extra_outputs() {
                    return Ok(None);
                }
                let op = Op::$name(self.clone());
                let a = op.pool_attrs().expect("a pooling op");
                let Some(kernel) = a.kernel_shape else { return Ok(None) };
                let spatial: Vec<usize> = x.shape[2..].to_vec();
                let w = ir::eval::window(&spatial, kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode)?;
                let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
                let count: usize = c.outputs[0].shape.iter().product();
                let nc = x.shape[0] * x.shape[1];
                // [count, NC, C, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH,
                //  PW, PED, PEH, PEW, count_include_pad, p]
                let mut p: Vec<u32> = vec![count as u32, nc as u32, x.shape[1] as u32];
                for v in [
                    to3(&spatial, 1),
                    to3(&w.out, 1),
                    to3(&w.kernel, 1),
                    to3(&w.strides, 1),
                    to3(&w.dilations, 1),
                    to3(&w.pad_begin, 0),
                    to3(&w.pad_end, 0),
                ] {
                    p.extend(v.iter().map(|&x| x as u32));
                }
                let (include_pad, lp) = match &op {
                    Op::AveragePool(ap) => (ap.count_include_pad(), 2),
                    Op::LpPool(lp) => (0, lp.p()),
                    _ => (0, 2),
                };
                p.push(include_pad as u32);
                p.push(lp as u32);
                if count > 0 {
                    let trips = nested(&[p[9], p[10], p[11]].map(|v| v as usize));
                    c.launch_loop(specialize(&pool_src($kind), &p), vec![Buf::In(0), Buf::Out(0)], p, groups(count), trips);
                }
                Ok(Some(c))
            }
        }
    )*};
}

pool_kernels! {
    MaxPool: "max";
    AveragePool: "avg";
    LpPool: "lp";
}

/// What a direct and a transposed convolution share: the bindings (X, Wt, the bias, Y),
/// the accumulator's start, and the decode of output element `i` into `n, m, od, oh, ow`
/// with the geometry read from `P` (laid out as [`conv_src`] says).
fn conv_prelude(bias: bool) -> (Vec<Binding<'static>>, &'static str, &'static str) {
    let mut b: Vec<Binding<'_>> = vec![("X", Elem::F32, false), ("Wt", Elem::F32, false)];
    if bias {
        b.push(("Bs", Elem::F32, false));
    }
    b.push(("Y", Elem::F32, true));
    let init = if bias { "Bs[m]" } else { "0.0" };
    let decode = "    let C = P[2]; let M = P[3]; let G = P[4];
    let D = P[5]; let H = P[6]; let W = P[7];
    let OD = P[8]; let OH = P[9]; let OW = P[10];
    let KD = P[11]; let KH = P[12]; let KW = P[13];
    var rem = i;
    let ow = rem % OW; rem = rem / OW;
    let oh = rem % OH; rem = rem / OH;
    let od = rem % OD; rem = rem / OD;
    let m = rem % M; let n = rem / M;
";
    (b, init, decode)
}

/// Direct N-d convolution (N ≤ 3, as 3-d). One invocation per output element.
/// `P = [count, N, C, M, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]`.
pub fn conv_src(bias: bool) -> String {
    let (b, init, decode) = conv_prelude(bias);
    let body = format!(
        "{decode}    let cg = C / G;
    let c0 = (m / (M / G)) * cg;
    var acc = {init};
    for (var c = 0u; c < cg; c = c + 1u) {{
        for (var kd = 0u; kd < KD; kd = kd + 1u) {{
            let id = i32(od * P[14] + kd * P[17]) - i32(P[20]);
            if (id < 0 || id >= i32(D)) {{ continue; }}
            for (var kh = 0u; kh < KH; kh = kh + 1u) {{
                let ih = i32(oh * P[15] + kh * P[18]) - i32(P[21]);
                if (ih < 0 || ih >= i32(H)) {{ continue; }}
                for (var kw = 0u; kw < KW; kw = kw + 1u) {{
                    let iw = i32(ow * P[16] + kw * P[19]) - i32(P[22]);
                    if (iw < 0 || iw >= i32(W)) {{ continue; }}
                    let xo = (((n * C + c0 + c) * D + u32(id)) * H + u32(ih)) * W + u32(iw);
                    let wo = (((m * cg + c) * KD + kd) * KH + kh) * KW + kw;
                    acc = acc + X[xo] * Wt[wo];
                }}
            }}
        }}
    }}
    Y[i] = acc;"
    );
    source(&b, "", &body)
}

/// im2col for a grouped N-d convolution (as 3-d): `COL[(b, k, p)]` with `b = n·G + g`,
/// or, `wide`, `COL[(g, k, n, p)]` (one GEMM per group over all images, for small outputs),
/// `k = (c, kd, kh, kw)` within the group, `p = (od, oh, ow)`; zero outside the input. One
/// invocation per row `(b, k)` walks the output positions (no divisions in the inner loop).
/// `P = [rows, C, G, D, H, W, OD, OH, OW, KD, KH, KW, SD, SH, SW, DD, DH, DW, PD, PH, PW]`.
pub fn im2col_src(wide: bool) -> String {
    let out = if wide { "((g * kk + k) * (P[0] / (G * kk)) + n) * npos" } else { "i * npos" };
    let body = format!(
        "    let C = P[1]; let G = P[2];
    let D = P[3]; let H = P[4]; let W = P[5];
    let OD = P[6]; let OH = P[7]; let OW = P[8];
    let KD = P[9]; let KH = P[10]; let KW = P[11];
    let cg = C / G;
    let npos = OD * OH * OW;
    let kk = cg * KD * KH * KW;
    let k = i % kk; let b = i / kk;
    let kw = k % KW; let kh = (k / KW) % KH; let kd = (k / (KW * KH)) % KD; let c = k / (KW * KH * KD);
    let n = b / G; let g = b % G;
    let plane = ((n * C + g * cg + c) * D) * H * W;
    var out = {out};
    for (var od = 0u; od < OD; od = od + 1u) {{
        let id = i32(od * P[12] + kd * P[15]) - i32(P[18]);
        let din = id >= 0 && id < i32(D);
        for (var oh = 0u; oh < OH; oh = oh + 1u) {{
            let ih = i32(oh * P[13] + kh * P[16]) - i32(P[19]);
            let hin = din && ih >= 0 && ih < i32(H);
            let rowbase = plane + (u32(max(id, 0)) * H + u32(max(ih, 0))) * W;
            var iw = i32(kw * P[17]) - i32(P[20]);
            for (var ow = 0u; ow < OW; ow = ow + 1u) {{
                var v = 0.0;
                if (hin && iw >= 0 && iw < i32(W)) {{ v = X[rowbase + u32(iw)]; }}
                COL[out] = v;
                out = out + 1u;
                iw = iw + i32(P[14]);
            }}
        }}
    }}"
    );
    source(&[("X", Elem::F32, false), ("COL", Elem::F32, true)], "", &body)
}

/// Transposed convolution, gathering for each output. Weights `[C, M/G, k…]`.
/// `P` as [`conv_src`].
pub fn conv_transpose_src(bias: bool) -> String {
    let (b, init, decode) = conv_prelude(bias);
    let body = format!(
        "{decode}    let mg = M / G;
    let cg = C / G;
    let g = m / mg;
    var acc = {init};
    for (var c = g * cg; c < (g + 1u) * cg; c = c + 1u) {{
        for (var kd = 0u; kd < KD; kd = kd + 1u) {{
            let td = i32(od) + i32(P[20]) - i32(kd * P[17]);
            if (td < 0 || td % i32(P[14]) != 0) {{ continue; }}
            let id = td / i32(P[14]);
            if (id >= i32(D)) {{ continue; }}
            for (var kh = 0u; kh < KH; kh = kh + 1u) {{
                let th = i32(oh) + i32(P[21]) - i32(kh * P[18]);
                if (th < 0 || th % i32(P[15]) != 0) {{ continue; }}
                let ih = th / i32(P[15]);
                if (ih >= i32(H)) {{ continue; }}
                for (var kw = 0u; kw < KW; kw = kw + 1u) {{
                    let tw = i32(ow) + i32(P[22]) - i32(kw * P[19]);
                    if (tw < 0 || tw % i32(P[16]) != 0) {{ continue; }}
                    let iw = tw / i32(P[16]);
                    if (iw >= i32(W)) {{ continue; }}
                    let xo = (((n * C + c) * D + u32(id)) * H + u32(ih)) * W + u32(iw);
                    let wo = (((c * mg + (m - g * mg)) * KD + kd) * KH + kh) * KW + kw;
                    acc = acc + X[xo] * Wt[wo];
                }}
            }}
        }}
    }}
    Y[i] = acc;"
    );
    source(&b, "", &body)
}

/// Pooling: `kind` is `max`, `avg` or `lp`. `P = [count, N·C, C, D, H, W, OD, OH, OW, KD, KH,
/// KW, SD, SH, SW, DD, DH, DW, PD, PH, PW, PED, PEH, PEW, count_include_pad, p]`.
pub fn pool_src(kind: &str) -> String {
    let (init, step, fin) = match kind {
        "max" => ("bitcast<f32>(0xff800000u)", "acc = fmax_(acc, v);", "acc"),
        "lp" => ("0.0", "acc = acc + pow(abs(v), f32(P[25]));", "pow(acc, 1.0 / f32(P[25]))"),
        _ => ("0.0", "acc = acc + v;", "acc / f32(select(cnt_valid, cnt_all, P[24] != 0u))"),
    };
    let body = format!(
        "    let D = P[3]; let H = P[4]; let W = P[5];
    let OD = P[6]; let OH = P[7]; let OW = P[8];
    var rem = i;
    let ow = rem % OW; rem = rem / OW;
    let oh = rem % OH; rem = rem / OH;
    let od = rem % OD; rem = rem / OD;
    let nc = rem;
    var acc = {init};
    var cnt_valid = 0u;
    var cnt_all = 0u;
    for (var kd = 0u; kd < P[9]; kd = kd + 1u) {{
        let id = i32(od * P[12] + kd * P[15]) - i32(P[18]);
        if (id >= i32(D) + i32(P[21])) {{ continue; }}
        for (var kh = 0u; kh < P[10]; kh = kh + 1u) {{
            let ih = i32(oh * P[13] + kh * P[16]) - i32(P[19]);
            if (ih >= i32(H) + i32(P[22])) {{ continue; }}
            for (var kw = 0u; kw < P[11]; kw = kw + 1u) {{
                let iw = i32(ow * P[14] + kw * P[17]) - i32(P[20]);
                if (iw >= i32(W) + i32(P[23])) {{ continue; }}
                cnt_all = cnt_all + 1u;
                if (id < 0 || ih < 0 || iw < 0 || id >= i32(D) || ih >= i32(H) || iw >= i32(W)) {{ continue; }}
                cnt_valid = cnt_valid + 1u;
                let v = X[((nc * D + u32(id)) * H + u32(ih)) * W + u32(iw)];
                {step}
            }}
        }}
    }}
    Y[i] = {fin};"
    );
    source(&[("X", Elem::F32, false), ("Y", Elem::F32, true)], MATH_FNS, &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn convolution_and_pooling_kernels_validate() {
        for c in [false, true] {
            validate("conv", &conv_src(c));
            validate("conv_transpose", &conv_transpose_src(c));
        }
        for kind in ["max", "avg", "lp"] {
            validate(&format!("pool {kind}"), &pool_src(kind));
        }
        for wide in [false, true] {
            validate("im2col", &im2col_src(wide));
        }
        validate("conv grad weight", &conv_grad_weight_src());
        validate("col2im", &col2im_src());
        for max in [false, true] {
            validate("pool grad", &pool_grad_src(max));
        }
        // With their parameters baked in, as launched.
        let mut p: Vec<u32> = vec![2 * 8 * 5 * 5, 2, 4, 8, 2];
        for v in [[1, 5, 5], [1, 5, 5], [1, 3, 3], [1, 1, 1], [1, 1, 1], [0, 1, 1]] {
            p.extend(v);
        }
        validate("conv specialised", &specialize(&conv_src(true), &p));
        validate("conv_transpose specialised", &specialize(&conv_transpose_src(false), &p));
        let mut q: Vec<u32> = vec![2 * 2 * 18, 4, 2];
        q.extend_from_slice(&p[5..]);
        validate("im2col specialised", &specialize(&im2col_src(true), &q));
        let pool: Vec<u32> =
            vec![2 * 4 * 4 * 4, 8, 4, 1, 8, 8, 1, 4, 4, 1, 3, 3, 1, 2, 2, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 2];
        for kind in ["max", "avg", "lp"] {
            validate("pool specialised", &specialize(&pool_src(kind), &pool));
        }
    }
}
