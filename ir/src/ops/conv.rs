//! Convolutions — `Conv` (N-d, strides, pads, dilations, groups) and `ConvTranspose` — and the
//! window geometry they share with pooling ([`window`], [`window_dims`], [`spatial_dims`]).
//!
//! A convolution's iteration space is the batch `n`, filters `m` (output features), channels
//! `c` (input features, summed) and the output's spatial dims `s0..`, which split with a halo
//! of input rows from each neighbour; grouped convolutions keep their channels whole,
//! depthwise ones split them as one dim `g`.

use super::grad::GradCx;
use super::util::join;
use super::{Arity, Arrays, Backward, EvalCx, FlowCx, InferCx, Mono, NodeCx, OpRules, Sharded, TypeRule, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace, par};
use crate::types::Dim;

type Result<T> = std::result::Result<T, EvalError>;

/// Output spatial dims of a windowed op over possibly unknown input dims.
pub fn window_dims(
    spatial: &[Dim],
    kernel: &[i64],
    strides: Option<&[i64]>,
    dilations: Option<&[i64]>,
    pads: Option<&[i64]>,
    auto_pad: &str,
    ceil_mode: bool,
) -> std::result::Result<Vec<Dim>, String> {
    let k = spatial.len();
    if kernel.len() != k {
        return Err(format!("kernel_shape {kernel:?} does not fit {k} spatial dims"));
    }
    for (name, v, want) in [("strides", strides, k), ("dilations", dilations, k), ("pads", pads, 2 * k)] {
        if let Some(v) = v
            && v.len() != want
        {
            return Err(format!("{name} {v:?} needs {want} values for {k} spatial dims"));
        }
    }
    for (name, v) in [("kernel", Some(kernel)), ("strides", strides), ("dilations", dilations)] {
        if let Some(v) = v
            && v.iter().any(|&x| x <= 0)
        {
            return Err(format!("the {name} {v:?} must be positive"));
        }
    }
    let mut out = Vec::with_capacity(k);
    for i in 0..k {
        match spatial[i].value() {
            Some(d) => {
                let pick = |v: Option<&[i64]>| v.map(|v| vec![v[i]]);
                let pad = pads.map(|p| vec![p[i], p[i + k]]);
                let w = window(
                    &[d as usize],
                    &kernel[i..=i],
                    pick(strides).as_deref(),
                    pick(dilations).as_deref(),
                    pad.as_deref(),
                    auto_pad,
                    ceil_mode,
                )?;
                out.push(Dim::Fixed(w.out[0] as i64));
            }
            None => out.push(Dim::Unknown),
        }
    }
    Ok(out)
}

/// The spatial iteration dims `s0..` of a windowed op: each splits with the halo its window
/// needs from the neighbours (input rows beyond the block's own, before and after).
pub fn spatial_dims(w: &Window) -> Vec<IterDim> {
    (0..w.out.len())
        .map(|i| {
            let ext = (w.dilations[i] * (w.kernel[i] - 1)) as i64;
            let st = w.strides[i] as i64;
            // Output block [o0, o1) reads input [o0*st - pb, (o1-1)*st - pb + ext]: beyond the
            // block's own input rows it needs ext - (st - 1) more rows, split around it by the
            // padding.
            let before = (w.pad_begin[i] as i64).min(ext);
            let after = (ext - before - (st - 1)).max(0);
            IterDim {
                name: format!("s{i}"),
                size: w.out[i] as i64,
                kind: DimKind::Spatial { halo: (before, after), stride: st },
                role: DimRole::Spatial,
            }
        })
        .collect()
}

/// Windowed ops' changed dims: batch (and channels for pooling) follow the input; spatial
/// dims that change cannot be followed through the window.
pub fn window_flow(cx: &mut FlowCx<'_>, keep_channels: bool, global: bool) -> Option<()> {
    let x = cx.in_m(0)?;
    let mut m: Vec<Mono> = cx.out_old().iter().map(|&v| Mono::constant(v)).collect();
    m[0] = x[0].clone();
    if keep_channels {
        m[1] = x[1].clone();
    }
    if !global {
        for (i, mi) in m.iter_mut().enumerate().skip(2) {
            if x.get(i).is_some_and(Mono::is_tracked) {
                *mi = Mono::Opaque;
            }
        }
    }
    cx.set_all(m);
    Some(())
}

fn conv_window(c: &op::Conv, x: &[i64], w: &[i64]) -> Option<Window> {
    let spatial: Vec<usize> = x[2..].iter().map(|&d| d as usize).collect();
    let kernel = c.kernel_shape.clone().unwrap_or_else(|| w[2..].to_vec());
    window(&spatial, &kernel, c.strides.as_deref(), c.dilations.as_deref(), c.pads.as_deref(), c.auto_pad(), false).ok()
}

impl OpRules for op::Conv {
    fn matrix_units(&self) -> bool {
        true
    }

    /// Per group: the images' output positions by the filters, over a filter's inputs.
    fn gemm(&self, _x: &[f64], w: Option<&[f64]>, y: &[f64]) -> Option<(f64, f64, f64)> {
        let w = w?;
        let m = y.first().copied().unwrap_or(1.0) * y.iter().skip(2).product::<f64>();
        Some((m, w.first().copied().unwrap_or(1.0), w.iter().skip(1).product()))
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(conv_grad(self, cx))
    }

    fn sharded(&self) -> Sharded {
        Sharded::Window
    }

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::Same(vec![0, 1, 2])
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(xd), Some(wd)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        if xd.len() < 3 || wd.len() != xd.len() {
            return Err(format!(
                "Conv needs X of rank ≥ 3 and W of the same rank, got [{}] and [{}]",
                join(xd),
                join(wd)
            ));
        }
        if let (Some(ci), Some(wc)) = (xd[1].value(), wd[1].value())
            && wc * self.group() != ci
        {
            return Err(format!(
                "X has {ci} channels, but W [{}] with group {} expects {}",
                join(wd),
                self.group(),
                wc * self.group()
            ));
        }
        let kernel: Vec<i64> = match &self.kernel_shape {
            Some(k) => k.clone(),
            None => wd[2..]
                .iter()
                .map(|d| d.value().ok_or("W has unknown spatial dims"))
                .collect::<std::result::Result<_, _>>()?,
        };
        let sp = window_dims(
            &xd[2..],
            &kernel,
            self.strides.as_deref(),
            self.dilations.as_deref(),
            self.pads.as_deref(),
            self.auto_pad(),
            false,
        )?;
        let mut out = vec![xd[0].clone(), wd[0].clone()];
        out.extend(sp);
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (x, w, out) = (cx.in_dims(0), cx.in_dims(1), cx.out_dims(0));
        if x.len() < 3 || w.len() != x.len() {
            return Some(IterSpace::whole(cx));
        }
        let Some(win) = conv_window(self, &x, &w) else { return Some(IterSpace::whole(cx)) };
        let k = x.len() - 2;
        let group = self.group();
        let mut sd = vec![par("n", out[0])];
        let depthwise = group > 1 && group == x[1] && w[0] == group;
        if group == 1 {
            sd.push(IterDim { name: "m".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::OutFeature });
            sd.push(IterDim { name: "c".into(), size: x[1], kind: DimKind::Reduction, role: DimRole::InFeature });
        } else if depthwise {
            sd.push(IterDim { name: "g".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::Other });
        } else {
            sd.push(IterDim { name: "m".into(), size: out[1], kind: DimKind::Fixed, role: DimRole::Other });
        }
        let sp0 = sd.len();
        sd.extend(spatial_dims(&win));
        let mut xm = vec![
            Some(0),
            if group == 1 {
                Some(2)
            } else if depthwise {
                Some(1)
            } else {
                None
            },
        ];
        xm.extend((0..k).map(|i| Some(sp0 + i)));
        let mut wm =
            vec![if group == 1 || depthwise { Some(1) } else { None }, if group == 1 { Some(2) } else { None }];
        wm.extend(std::iter::repeat_n(None, k));
        let bm = cx.input(2).map(|_| vec![if group == 1 || depthwise { Some(1) } else { None }]);
        let mut om = vec![Some(0), if group == 1 || depthwise { Some(1) } else { None }];
        om.extend((0..k).map(|i| Some(sp0 + i)));
        Some(IterSpace { dims: sd, inputs: vec![Some(xm), Some(wm), bm], outputs: vec![om] })
    }

    /// Every output element is a dot product over C/group × kernel.
    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let y = cx.out_numel(0);
        let per = cx.ty(cx.input(1)).and_then(|t| t.static_dims()).map(|d| d[1..].iter().product::<i64>()).unwrap_or(0)
            as f64;
        let bias = cx.input(2).is_some();
        Some(Work {
            fwd_flops: 2.0 * y * per + if bias { y } else { 0.0 },
            backward: Backward::Contraction { inputs: vec![0, 1], bias: bias.then_some(2) },
            launches: 1.0,
            parallel: None,
        })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![conv(self, cx)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        window_flow(cx, false, false)
    }
}

impl OpRules for op::ConvTranspose {
    fn matrix_units(&self) -> bool {
        true
    }

    fn gemm(&self, _x: &[f64], w: Option<&[f64]>, y: &[f64]) -> Option<(f64, f64, f64)> {
        let w = w?;
        let m = y.first().copied().unwrap_or(1.0) * y.iter().skip(2).product::<f64>();
        Some((
            m,
            w.get(1).copied().unwrap_or(1.0),
            w.first().copied().unwrap_or(1.0) * w.iter().skip(2).product::<f64>(),
        ))
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(conv_transpose_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::Same(vec![0, 1, 2])
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(xd), Some(wd)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        if xd.len() < 3 || wd.len() != xd.len() {
            return Err("ConvTranspose needs X and W of equal rank ≥ 3".into());
        }
        let mut out = vec![xd[0].clone(), wd[1].value().map_or(Dim::Unknown, |m| Dim::Fixed(m * self.group()))];
        let spatial: Option<Vec<usize>> = xd[2..].iter().map(|d| d.value().map(|v| v as usize)).collect();
        let kernel: Option<Vec<usize>> = match &self.kernel_shape {
            Some(k) => Some(k.iter().map(|&v| v as usize).collect()),
            None => wd[2..].iter().map(|d| d.value().map(|v| v as usize)).collect(),
        };
        match (spatial, kernel) {
            (Some(s), Some(k)) => {
                let (o, _) = conv_transpose_geometry(self, &s, &k)?;
                out.extend(o.into_iter().map(|v| Dim::Fixed(v as i64)));
            }
            _ => out.extend(std::iter::repeat_n(Dim::Unknown, xd.len() - 2)),
        }
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (x, w, out) = (cx.in_dims(0), cx.in_dims(1), cx.out_dims(0));
        if x.len() < 3 || self.group() != 1 {
            return Some(IterSpace::whole(cx));
        }
        let k = x.len() - 2;
        let mut sd = vec![
            par("n", out[0]),
            IterDim { name: "m".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::OutFeature },
            IterDim { name: "c".into(), size: x[1], kind: DimKind::Reduction, role: DimRole::InFeature },
        ];
        sd.extend((0..k).map(|i| IterDim {
            name: format!("s{i}"),
            size: out[2 + i],
            kind: DimKind::Fixed,
            role: DimRole::Spatial,
        }));
        let mut xm = vec![Some(0), Some(2)];
        xm.extend(std::iter::repeat_n(None, k));
        let mut wm = vec![Some(2), Some(1)];
        wm.extend(std::iter::repeat_n(None, w.len() - 2));
        let mut om = vec![Some(0), Some(1)];
        om.extend(std::iter::repeat_n(None, k));
        Some(IterSpace {
            dims: sd,
            inputs: vec![Some(xm), Some(wm), cx.input(2).map(|_| vec![Some(1)])],
            outputs: vec![om],
        })
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let x = cx.in_numel(0);
        let per = cx.ty(cx.input(1)).and_then(|t| t.static_dims()).map(|d| d[1..].iter().product::<i64>()).unwrap_or(0)
            as f64;
        Some(Work {
            fwd_flops: 2.0 * x * per,
            backward: Backward::Contraction { inputs: vec![0, 1], bias: None },
            launches: 1.0,
            parallel: None,
        })
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![conv_transpose(self, cx)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        window_flow(cx, false, false)
    }
}

/// Output sizes and leading pads of a windowed op (conv or pool) over spatial dims.
///
/// `pads` holds begins then ends, as ONNX writes them; `auto_pad` overrides them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    /// Output spatial sizes.
    pub out: Vec<usize>,
    /// Padding before each spatial dim.
    pub pad_begin: Vec<usize>,
    /// Padding after each spatial dim.
    pub pad_end: Vec<usize>,
    /// Kernel sizes.
    pub kernel: Vec<usize>,
    /// Strides.
    pub strides: Vec<usize>,
    /// Dilations.
    pub dilations: Vec<usize>,
}

/// Computes the geometry of a conv/pool window (ONNX rules, including `SAME_UPPER`,
/// `SAME_LOWER`, `VALID` and `ceil_mode`).
pub fn window(
    input: &[usize],
    kernel: &[i64],
    strides: Option<&[i64]>,
    dilations: Option<&[i64]>,
    pads: Option<&[i64]>,
    auto_pad: &str,
    ceil_mode: bool,
) -> std::result::Result<Window, String> {
    let k = input.len();
    if kernel.len() != k {
        return Err(format!("kernel has {} dims, input has {k} spatial dims", kernel.len()));
    }
    let get = |v: Option<&[i64]>, what: &str, default: i64| -> std::result::Result<Vec<usize>, String> {
        match v {
            None => Ok(vec![default as usize; k]),
            Some(v) if v.len() != k => Err(format!("{what} {v:?} do not fit {k} spatial dims")),
            Some(v) if v.iter().any(|&x| x <= 0) => Err(format!("the {what} {v:?} must be positive")),
            Some(v) => Ok(v.iter().map(|&x| x as usize).collect()),
        }
    };
    let strides = get(strides, "strides", 1)?;
    let dilations = get(dilations, "dilations", 1)?;
    if kernel.iter().any(|&x| x <= 0) {
        return Err(format!("the kernel {kernel:?} must be positive"));
    }
    let kernel: Vec<usize> = kernel.iter().map(|&x| x as usize).collect();
    let mut pb = vec![0usize; k];
    let mut pe = vec![0usize; k];
    let mut out = vec![0usize; k];
    for i in 0..k {
        let ext = dilations[i] * (kernel[i] - 1) + 1;
        match auto_pad {
            "SAME_UPPER" | "SAME_LOWER" => {
                let o = input[i].div_ceil(strides[i]);
                let total = ((o.max(1) - 1) * strides[i] + ext).saturating_sub(input[i]);
                let (a, b) = if auto_pad == "SAME_UPPER" {
                    (total / 2, total - total / 2)
                } else {
                    (total - total / 2, total / 2)
                };
                pb[i] = a;
                pe[i] = b;
                out[i] = o;
            }
            "VALID" | "NOTSET" | "" => {
                if (auto_pad == "NOTSET" || auto_pad.is_empty())
                    && let Some(p) = pads
                {
                    if p.len() != 2 * k || p.iter().any(|&x| x < 0) {
                        return Err(format!("pads {p:?} do not fit {k} spatial dims"));
                    }
                    pb[i] = p[i] as usize;
                    pe[i] = p[i + k] as usize;
                }
                let span = input[i] + pb[i] + pe[i];
                if span < ext {
                    return Err(format!(
                        "the window ({ext}) is larger than the padded input ({span}) in spatial dim {i}"
                    ));
                }
                let num = span - ext;
                out[i] = if ceil_mode { num.div_ceil(strides[i]) + 1 } else { num / strides[i] + 1 };
                // A window may not start in the end padding.
                if ceil_mode && (out[i] - 1) * strides[i] >= input[i] + pb[i] {
                    out[i] -= 1;
                }
            }
            other => return Err(format!("unknown auto_pad `{other}`")),
        }
    }
    Ok(Window { out, pad_begin: pb, pad_end: pe, kernel, strides, dilations })
}

/// Expands spatial dims to 3 (leading 1s) so one loop nest serves 1-D, 2-D and 3-D.
pub fn to3(v: &[usize], fill: usize) -> [usize; 3] {
    let mut o = [fill; 3];
    let off = 3 - v.len().min(3);
    for (i, &x) in v.iter().enumerate().take(3) {
        o[off + i] = x;
    }
    o
}

fn conv(c: &op::Conv, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let w = cx.req(1)?;
    let b = cx.opt(2);
    if x.rank() < 3 || x.rank() > 5 || w.rank() != x.rank() {
        return Err(EvalError::Unsupported(format!("Conv of rank {} with weight rank {}", x.rank(), w.rank())));
    }
    let (xs, ws) = (x.to_f64()?, w.to_f64()?);
    let (n, cin) = (x.shape[0], x.shape[1]);
    let m = w.shape[0];
    let g = c.group() as usize;
    if g == 0 || cin % g != 0 || m % g != 0 || w.shape[1] != cin / g {
        return Err(EvalError::Invalid(format!(
            "Conv weight {:?} does not fit input {:?} with group {g}",
            w.shape, x.shape
        )));
    }
    let kernel: Vec<i64> = c.kernel_shape.clone().unwrap_or_else(|| w.shape[2..].iter().map(|&d| d as i64).collect());
    let win = window(
        &x.shape[2..],
        &kernel,
        c.strides.as_deref(),
        c.dilations.as_deref(),
        c.pads.as_deref(),
        c.auto_pad(),
        false,
    )
    .map_err(EvalError::Invalid)?;
    let [id, ih, iw] = to3(&x.shape[2..], 1);
    let [od, oh, ow] = to3(&win.out, 1);
    let [kd, kh, kw] = to3(&win.kernel, 1);
    let [sd, sh, sw] = to3(&win.strides, 1);
    let [dd, dh, dw] = to3(&win.dilations, 1);
    let [pd, ph, pw] = to3(&win.pad_begin, 0);
    let (cg, mg) = (cin / g, m / g);
    let bias: Vec<f64> = match b {
        Some(b) => b.to_f64()?,
        None => vec![0.0; m],
    };
    if bias.len() != m {
        return Err(EvalError::Invalid(format!("Conv: {} biases for {m} output channels", bias.len())));
    }
    let mut out = vec![0f64; n * m * od * oh * ow];
    let in_sp = id * ih * iw;
    let k_sp = kd * kh * kw;
    for ni in 0..n {
        for mi in 0..m {
            let gi = mi / mg;
            let obase = (ni * m + mi) * od * oh * ow;
            for z in 0..od {
                for y in 0..oh {
                    for xx in 0..ow {
                        let mut acc = bias[mi];
                        for ci in 0..cg {
                            let xbase = (ni * cin + gi * cg + ci) * in_sp;
                            let wbase = (mi * cg + ci) * k_sp;
                            for a in 0..kd {
                                let iz = (z * sd + a * dd) as isize - pd as isize;
                                if iz < 0 || iz >= id as isize {
                                    continue;
                                }
                                for bb in 0..kh {
                                    let iy = (y * sh + bb * dh) as isize - ph as isize;
                                    if iy < 0 || iy >= ih as isize {
                                        continue;
                                    }
                                    let row = xbase + (iz as usize * ih + iy as usize) * iw;
                                    let wrow = wbase + (a * kh + bb) * kw;
                                    for cc in 0..kw {
                                        let ix = (xx * sw + cc * dw) as isize - pw as isize;
                                        if ix < 0 || ix >= iw as isize {
                                            continue;
                                        }
                                        acc += xs[row + ix as usize] * ws[wrow + cc];
                                    }
                                }
                            }
                        }
                        out[obase + (z * oh + y) * ow + xx] = acc;
                    }
                }
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend(&win.out);
    Ok(Array::float(x.dtype, shape, out))
}

/// Output spatial sizes and begin pads of a ConvTranspose.
pub fn conv_transpose_geometry(
    c: &op::ConvTranspose,
    input: &[usize],
    kernel: &[usize],
) -> std::result::Result<(Vec<usize>, Vec<usize>), String> {
    let k = input.len();
    let ones = vec![1i64; k];
    let strides = c.strides.clone().unwrap_or_else(|| ones.clone());
    let dil = c.dilations.clone().unwrap_or_else(|| ones.clone());
    let outpad = c.output_padding.clone().unwrap_or_else(|| vec![0; k]);
    if strides.len() != k || dil.len() != k || outpad.len() != k {
        return Err("ConvTranspose attributes do not fit the input rank".into());
    }
    let mut pads = c.pads.clone().unwrap_or_else(|| vec![0; 2 * k]);
    if pads.len() != 2 * k {
        return Err(format!("pads {pads:?} do not fit {k} spatial dims"));
    }
    let mut out = vec![0usize; k];
    for i in 0..k {
        let full = strides[i] * (input[i] as i64 - 1) + outpad[i] + (kernel[i] as i64 - 1) * dil[i] + 1;
        if let Some(os) = &c.output_shape {
            let target = *os.get(os.len().wrapping_sub(k) + i).ok_or("output_shape does not fit")?;
            let total = (full - target).max(0);
            let (a, b) = if c.auto_pad() == "SAME_UPPER" {
                (total / 2, total - total / 2)
            } else {
                (total - total / 2, total / 2)
            };
            pads[i] = a;
            pads[i + k] = b;
            out[i] = target.max(0) as usize;
        } else if matches!(c.auto_pad(), "SAME_UPPER" | "SAME_LOWER") {
            let target = input[i] as i64 * strides[i];
            let total = (full - target).max(0);
            let (a, b) = if c.auto_pad() == "SAME_UPPER" {
                (total / 2, total - total / 2)
            } else {
                (total - total / 2, total / 2)
            };
            pads[i] = a;
            pads[i + k] = b;
            out[i] = target as usize;
        } else {
            let o = full - pads[i] - pads[i + k];
            if o <= 0 {
                return Err("ConvTranspose output would be empty".into());
            }
            out[i] = o as usize;
        }
    }
    Ok((out, pads[..k].iter().map(|&p| p as usize).collect()))
}

fn conv_transpose(c: &op::ConvTranspose, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let w = cx.req(1)?;
    if x.rank() < 3 || x.rank() > 5 || w.rank() != x.rank() {
        return Err(EvalError::Unsupported(format!("ConvTranspose of rank {}", x.rank())));
    }
    let (xs, ws) = (x.to_f64()?, w.to_f64()?);
    let (n, cin) = (x.shape[0], x.shape[1]);
    let g = c.group() as usize;
    let mg = w.shape[1];
    let m = mg * g;
    let cg = cin / g.max(1);
    let kernel: Vec<usize> = w.shape[2..].to_vec();
    let (out_sp, pb) = conv_transpose_geometry(c, &x.shape[2..], &kernel).map_err(EvalError::Invalid)?;
    let k = kernel.len();
    let strides = c.strides.clone().unwrap_or_else(|| vec![1; k]);
    let dil = c.dilations.clone().unwrap_or_else(|| vec![1; k]);
    let [id, ih, iw] = to3(&x.shape[2..], 1);
    let [od, oh, ow] = to3(&out_sp, 1);
    let [kd, kh, kw] = to3(&kernel, 1);
    let st: Vec<usize> = strides.iter().map(|&v| v as usize).collect();
    let dl: Vec<usize> = dil.iter().map(|&v| v as usize).collect();
    let [sd, sh, sw] = to3(&st, 1);
    let [dd, dh, dw] = to3(&dl, 1);
    let [pd, ph, pw] = to3(&pb, 0);
    let mut out = vec![0f64; n * m * od * oh * ow];
    if let Some(b) = cx.opt(2) {
        let b = b.to_f64()?;
        for ni in 0..n {
            for mi in 0..m {
                let base = (ni * m + mi) * od * oh * ow;
                out[base..base + od * oh * ow].iter_mut().for_each(|v| *v = b[mi]);
            }
        }
    }
    for ni in 0..n {
        for ci in 0..cin {
            let gi = ci / cg.max(1);
            for z in 0..id {
                for y in 0..ih {
                    for xx in 0..iw {
                        let v = xs[(((ni * cin + ci) * id + z) * ih + y) * iw + xx];
                        for mo in 0..mg {
                            let mi = gi * mg + mo;
                            for a in 0..kd {
                                let oz = (z * sd + a * dd) as isize - pd as isize;
                                if oz < 0 || oz >= od as isize {
                                    continue;
                                }
                                for bb in 0..kh {
                                    let oy = (y * sh + bb * dh) as isize - ph as isize;
                                    if oy < 0 || oy >= oh as isize {
                                        continue;
                                    }
                                    for cc in 0..kw {
                                        let ox = (xx * sw + cc * dw) as isize - pw as isize;
                                        if ox < 0 || ox >= ow as isize {
                                            continue;
                                        }
                                        let wv = ws[(((ci * mg + mo) * kd + a) * kh + bb) * kw + cc];
                                        out[(((ni * m + mi) * od + oz as usize) * oh + oy as usize) * ow
                                            + ox as usize] += v * wv;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend(out_sp);
    Ok(Array::float(x.dtype, shape, out))
}

// ---- gradients ----

/// The bias gradient of a convolution: dY summed over the batch and spatial dims.
fn bias_grad(cx: &mut GradCx<'_>, dy: Value) -> std::result::Result<(), String> {
    if cx.want(2) {
        let r = cx.dims(dy)?.len();
        let mut axes = vec![0i64];
        axes.extend(2..r as i64);
        let d = cx.reduce_sum(dy, &axes, false)?;
        cx.set(2, d);
    }
    Ok(())
}

fn conv_grad(c: &op::Conv, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (x, w) = (cx.x(0)?, cx.x(1)?);
    let (xd, wd) = (cx.dims(x)?, cx.dims(w)?);
    let win = conv_window(c, &xd, &wd).ok_or("the window geometry does not fit")?;
    let pads: Vec<i64> = win.pad_begin.iter().chain(&win.pad_end).map(|&p| p as i64).collect();
    let kernel: Vec<i64> = win.kernel.iter().map(|&k| k as i64).collect();
    let strides: Vec<i64> = win.strides.iter().map(|&k| k as i64).collect();
    let dil: Vec<i64> = win.dilations.iter().map(|&k| k as i64).collect();
    if cx.want(0) {
        let op = Op::ConvGradInput(op::ConvGradInput {
            dilations: Some(dil.clone()),
            group: c.group,
            input_shape: Some(xd.clone()),
            kernel_shape: Some(kernel.clone()),
            pads: Some(pads.clone()),
            strides: Some(strides.clone()),
        });
        let d = cx.add1(op, &[dy, w])?;
        cx.set(0, d);
    }
    if cx.want(1) {
        let op = Op::ConvGradWeight(op::ConvGradWeight {
            dilations: Some(dil),
            group: c.group,
            kernel_shape: Some(kernel),
            pads: Some(pads),
            strides: Some(strides),
        });
        let d = cx.add1(op, &[x, dy])?;
        cx.set(1, d);
    }
    bias_grad(cx, dy)
}

/// ConvTranspose's adjoint is a Conv with the same weights; its weight gradient is Conv's
/// with the roles of input and output swapped.
fn conv_transpose_grad(c: &op::ConvTranspose, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (x, w) = (cx.x(0)?, cx.x(1)?);
    let (xd, wd) = (cx.dims(x)?, cx.dims(w)?);
    let k = xd.len() - 2;
    let input: Vec<usize> = xd[2..].iter().map(|&d| d as usize).collect();
    let kernel: Vec<usize> = wd[2..].iter().map(|&d| d as usize).collect();
    let (out, pb) = conv_transpose_geometry(c, &input, &kernel)?;
    let strides = c.strides.clone().unwrap_or_else(|| vec![1; k]);
    let dil = c.dilations.clone().unwrap_or_else(|| vec![1; k]);
    let outpad = c.output_padding.clone().unwrap_or_else(|| vec![0; k]);
    let mut pads: Vec<i64> = pb.iter().map(|&p| p as i64).collect();
    for i in 0..k {
        let full = strides[i] * (input[i] as i64 - 1) + outpad[i] + (kernel[i] as i64 - 1) * dil[i] + 1;
        pads.push(full - pb[i] as i64 - out[i] as i64);
    }
    if pads.iter().any(|&p| p < 0) {
        return Err("a ConvTranspose cropped by output_shape beyond its padding".into());
    }
    let kernel: Vec<i64> = kernel.iter().map(|&d| d as i64).collect();
    if cx.want(0) {
        let conv = Op::Conv(op::Conv {
            dilations: Some(dil.clone()),
            group: c.group,
            kernel_shape: Some(kernel.clone()),
            pads: Some(pads.clone()),
            strides: Some(strides.clone()),
            auto_pad: None,
        });
        let d = cx.add1(conv, &[dy, w])?;
        cx.set(0, d);
    }
    if cx.want(1) {
        let op = Op::ConvGradWeight(op::ConvGradWeight {
            dilations: Some(dil),
            group: c.group,
            kernel_shape: Some(kernel),
            pads: Some(pads),
            strides: Some(strides),
        });
        let d = cx.add1(op, &[dy, x])?;
        cx.set(1, d);
    }
    bias_grad(cx, dy)
}

/// The geometry a gradient op carries: per spatial dim (kernel, stride, dilation, begin pad),
/// expanded to 3 dims ([`to3`]).
#[derive(Clone, Copy, Debug)]
pub struct Geo {
    /// Kernel sizes.
    pub k: [usize; 3],
    /// Strides.
    pub s: [usize; 3],
    /// Dilations.
    pub d: [usize; 3],
    /// Begin pads.
    pub p: [usize; 3],
}

/// A convolution gradient tensor's map onto its iteration dims: its two leading dims (images
/// or filters, channels) as `lead`, its `rank − 2` spatial or kernel dims on none.
fn channels_first(lead: [Option<usize>; 2], rank: usize) -> Vec<Option<usize>> {
    lead.into_iter().chain(std::iter::repeat_n(None, rank.saturating_sub(2))).collect()
}

/// A gradient op's [`Geo`] over `sp` spatial dims, from its attributes.
pub fn geo(
    kernel: &Option<Vec<i64>>,
    strides: &Option<Vec<i64>>,
    dil: &Option<Vec<i64>>,
    pads: &Option<Vec<i64>>,
    sp: usize,
) -> Result<Geo> {
    let get = |v: &Option<Vec<i64>>, n: usize, d: i64, what: &str| -> Result<Vec<usize>> {
        let v = v.clone().unwrap_or_else(|| vec![d; n]);
        if v.len() < n || v.iter().any(|&x| x < 0) {
            return Err(EvalError::Invalid(format!("{what} {v:?} does not fit {sp} spatial dims")));
        }
        Ok(v.iter().take(n).map(|&x| x as usize).collect())
    };
    let kv = kernel.clone().ok_or_else(|| EvalError::Invalid("a gradient op without kernel_shape".into()))?;
    if kv.len() != sp {
        return Err(EvalError::Invalid("kernel_shape does not fit the spatial dims".into()));
    }
    Ok(Geo {
        k: to3(&get(kernel, sp, 1, "kernel_shape")?, 1),
        s: to3(&get(strides, sp, 1, "strides")?, 1),
        d: to3(&get(dil, sp, 1, "dilations")?, 1),
        p: to3(&get(pads, sp, 0, "pads")?, 0),
    })
}

/// Calls `f(out_spatial_index, in_spatial_index, kernel_index)` for every output position
/// and kernel tap whose input lies inside the tensor.
pub fn taps(g: &Geo, inp: [usize; 3], out: [usize; 3], mut f: impl FnMut(usize, usize, usize)) {
    for z in 0..out[0] {
        for y in 0..out[1] {
            for x in 0..out[2] {
                let o = (z * out[1] + y) * out[2] + x;
                for a in 0..g.k[0] {
                    let iz = (z * g.s[0] + a * g.d[0]) as isize - g.p[0] as isize;
                    if iz < 0 || iz >= inp[0] as isize {
                        continue;
                    }
                    for b in 0..g.k[1] {
                        let iy = (y * g.s[1] + b * g.d[1]) as isize - g.p[1] as isize;
                        if iy < 0 || iy >= inp[1] as isize {
                            continue;
                        }
                        for c in 0..g.k[2] {
                            let ix = (x * g.s[2] + c * g.d[2]) as isize - g.p[2] as isize;
                            if ix < 0 || ix >= inp[2] as isize {
                                continue;
                            }
                            let i = (iz as usize * inp[1] + iy as usize) * inp[2] + ix as usize;
                            f(o, i, (a * g.k[1] + b) * g.k[2] + c);
                        }
                    }
                }
            }
        }
    }
}

/// Largest im2col scratch buffer (elements) the runtime's GEMM path of a convolution
/// allocates; larger convolutions run the direct kernels.
pub const IM2COL_MAX_ELEMS: usize = 1 << 25;

/// Output positions per image below which the runtime's forward GEMM spans all images (and a
/// permutation puts the images back in front).
pub const WIDE_BELOW: usize = 64;

/// True when the runtime runs a convolution of `n` images, `ch` channels, `m` filters, `g`
/// groups, kernel volume `kvol` and `npos` output positions per image — and its two gradients
/// — as im2col and GEMMs rather than as direct kernels: the reduction per group is 16 or more,
/// 4 filters per group or more, and the column buffer fits [`IM2COL_MAX_ELEMS`].
pub fn gemm_path(n: usize, ch: usize, m: usize, g: usize, kvol: usize, npos: usize) -> bool {
    let (cg, mg) = (ch / g.max(1), m / g.max(1));
    let kk = cg * kvol;
    kk >= 16 && mg >= 4 && npos > 0 && n * g * kk * npos <= IM2COL_MAX_ELEMS
}

/// The kernels the runtime launches for such a convolution's forward, input gradient and
/// weight gradient: one each on the direct kernels; on the GEMM path the forward is im2col and
/// a GEMM (and a permutation when it spans all images, [`WIDE_BELOW`]), the input gradient a
/// GEMM and col2im, the weight gradient im2col and a GEMM — each gradient with a regrouping of
/// dY when there are several images — and each GEMM's second dispatch where it splits its
/// reduction ([`super::contraction::gemm_dispatches`]: the forward's over `C/g · k` per image,
/// or per group when it spans all images; the input gradient's over `M/g`; the weight
/// gradient's over all images' positions). The cost model prices these launches
/// (`passes::cost`); the wgpu runtime compiles them (`codegen::runtime::gpu::conv`).
pub fn launches(n: usize, ch: usize, m: usize, g: usize, kvol: usize, npos: usize) -> [f64; 3] {
    if !gemm_path(n, ch, m, g, kvol, npos) {
        return [1.0; 3];
    }
    let wide = n > 1 && npos < WIDE_BELOW;
    let regroup = f64::from(u8::from(n > 1));
    let (cg, mg) = (ch / g.max(1), m / g.max(1));
    let split = |batch: usize, k: usize| super::contraction::gemm_dispatches(batch, k) as f64 - 1.0;
    let fwd_batch = if wide || n == 1 { g } else { n * g };
    [
        2.0 + f64::from(u8::from(wide)) + split(fwd_batch, cg * kvol),
        2.0 + regroup + split(g, mg),
        2.0 + regroup + split(g, n * npos),
    ]
}

/// [`launches`] from the shapes: `x` `[N, C, …]`, `w` `[M, C/group, k…]`, `y` `[N, M, o…]`.
pub fn launches_of(x: &[i64], w: &[i64], y: &[i64], group: i64) -> Option<[f64; 3]> {
    if x.len() < 3 || w.len() != x.len() || y.len() != x.len() {
        return None;
    }
    let u = |v: i64| v.max(0) as usize;
    let kvol = w[2..].iter().map(|&d| u(d)).product();
    let npos = y[2..].iter().map(|&d| u(d)).product();
    Some(launches(u(x[0]), u(x[1]), u(w[0]), u(group.max(1)), kvol, npos))
}

impl OpRules for op::ConvGradInput {
    fn matrix_units(&self) -> bool {
        true
    }

    /// The runtime's columns of dX, Wᵀ·dY (per group), over the filters.
    fn gemm(&self, dy: &[f64], w: Option<&[f64]>, _y: &[f64]) -> Option<(f64, f64, f64)> {
        let w = w?;
        let positions = dy.first().copied().unwrap_or(1.0) * dy.iter().skip(2).product::<f64>();
        Some((w.iter().skip(1).product(), positions, w.first().copied().unwrap_or(1.0)))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let shape = self.input_shape.as_ref().ok_or("ConvGradInput needs `input_shape`")?;
        cx.one(Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()))
    }

    /// Ungrouped: the images, dX's channels `c` (W's columns) and the reduction over dY's
    /// channels `m` (W's rows: split, each device holds partial sums of dX) — the duals of
    /// the convolution's batch, input-channel and output-channel splits. Grouped: the images.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (dy, w) = (cx.in_dims(0), cx.in_dims(1));
        if self.group() != 1 || dy.len() < 3 || w.len() != dy.len() {
            return Some(IterSpace::batch(cx, &[0], &[0]));
        }
        let rest = |lead: [Option<usize>; 2]| channels_first(lead, dy.len());
        Some(IterSpace {
            dims: vec![
                par("n", dy[0]),
                IterDim { name: "c".into(), size: w[1], kind: DimKind::Parallel, role: DimRole::OutFeature },
                IterDim { name: "m".into(), size: w[0], kind: DimKind::Reduction, role: DimRole::InFeature },
            ],
            inputs: vec![Some(rest([Some(0), Some(2)])), Some(rest([Some(2), Some(1)]))],
            outputs: vec![rest([Some(0), Some(1)])],
        })
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let k: f64 = cx.in_dims(1).iter().skip(1).product::<i64>() as f64;
        Work::flops(2.0 * cx.in_numel(0) * k)
    }

    /// `dX[n, c, i] = Σ dY[n, m, o]·W[m, c mod C/g, k]` over the taps with `i = o·s + k·d − p`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (dy, w) = (cx.req(0)?, cx.req(1)?);
        let xs: Vec<usize> = self.input_shape.clone().unwrap_or_default().iter().map(|&d| d.max(0) as usize).collect();
        if xs.len() < 3 || xs.len() > 5 || dy.rank() != xs.len() || w.rank() != xs.len() {
            return Err(EvalError::Invalid("ConvGradInput operands do not fit".into()));
        }
        let sp = xs.len() - 2;
        let g = geo(&self.kernel_shape, &self.strides, &self.dilations, &self.pads, sp)?;
        let (n, c, m) = (xs[0], xs[1], dy.shape[1]);
        let grp = self.group().max(1) as usize;
        let (cg, mg) = (c / grp, m / grp);
        let inp = to3(&xs[2..], 1);
        let out = to3(&dy.shape[2..], 1);
        let (isz, osz) = (inp.iter().product::<usize>(), out.iter().product::<usize>());
        let ksz = g.k.iter().product::<usize>();
        let (dv, wv) = (dy.to_f64()?, w.to_f64()?);
        let mut dx = vec![0.0; n * c * isz];
        for ni in 0..n {
            for mi in 0..m {
                let gi = mi / mg.max(1);
                let ob = (ni * m + mi) * osz;
                for ci in 0..cg {
                    let xb = (ni * c + gi * cg + ci) * isz;
                    let wb = (mi * cg + ci) * ksz;
                    taps(&g, inp, out, |o, i, k| dx[xb + i] += dv[ob + o] * wv[wb + k]);
                }
            }
        }
        Ok(vec![Array::float(dy.dtype, xs, dx)])
    }
}

impl OpRules for op::ConvGradWeight {
    fn matrix_units(&self) -> bool {
        true
    }

    /// The runtime's dW\[M, C·k\] (per group) over the images and output positions of dY.
    fn gemm(&self, _x: &[f64], dy: Option<&[f64]>, y: &[f64]) -> Option<(f64, f64, f64)> {
        let dy = dy?;
        let positions = dy.first().copied().unwrap_or(1.0) * dy.iter().skip(2).product::<f64>();
        Some((y.first().copied().unwrap_or(1.0), y.iter().skip(1).product(), positions))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(xd), Some(yd)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        let k = self.kernel_shape.as_ref().ok_or("ConvGradWeight needs `kernel_shape`")?;
        let cg = match xd.get(1).and_then(Dim::value) {
            Some(c) => Dim::Fixed(c / self.group().max(1)),
            None => Dim::Unknown,
        };
        let mut out = vec![yd.get(1).cloned().unwrap_or(Dim::Unknown), cg];
        out.extend(k.iter().map(|&d| Dim::Fixed(d)));
        cx.one(Some(out))
    }

    /// Ungrouped: dW's rows `m` (dY's channels), its columns `c` (x's channels) and the
    /// reduction over the images `n` (split, each device holds partial sums of dW) — the
    /// duals of the convolution's output-channel, input-channel and batch splits. Grouped:
    /// the images.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (x, dy) = (cx.in_dims(0), cx.in_dims(1));
        if self.group() != 1 || x.len() < 3 || dy.len() != x.len() || x[0] != dy[0] {
            return Some(IterSpace::batch(cx, &[0, 1], &[]));
        }
        let rest = |lead: [Option<usize>; 2]| channels_first(lead, x.len());
        Some(IterSpace {
            dims: vec![
                IterDim { name: "n".into(), size: x[0], kind: DimKind::Reduction, role: DimRole::Other },
                IterDim { name: "m".into(), size: dy[1], kind: DimKind::Parallel, role: DimRole::OutFeature },
                IterDim { name: "c".into(), size: x[1], kind: DimKind::Parallel, role: DimRole::InFeature },
            ],
            inputs: vec![Some(rest([Some(0), Some(2)])), Some(rest([Some(0), Some(1)]))],
            outputs: vec![rest([Some(1), Some(2)])],
        })
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        let k: f64 = cx.out_dims(0).iter().skip(1).product::<i64>() as f64;
        Work::flops(2.0 * cx.in_numel(1) * k)
    }

    /// `dW[m, c, k] = Σ dY[n, m, o]·X[n, g·C/g + c, o·s + k·d − p]`.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, dy) = (cx.req(0)?, cx.req(1)?);
        if x.rank() < 3 || x.rank() > 5 || dy.rank() != x.rank() {
            return Err(EvalError::Invalid("ConvGradWeight operands do not fit".into()));
        }
        let sp = x.rank() - 2;
        let g = geo(&self.kernel_shape, &self.strides, &self.dilations, &self.pads, sp)?;
        let (n, c, m) = (x.shape[0], x.shape[1], dy.shape[1]);
        let grp = self.group().max(1) as usize;
        let (cg, mg) = (c / grp, m / grp);
        let inp = to3(&x.shape[2..], 1);
        let out = to3(&dy.shape[2..], 1);
        let (isz, osz) = (inp.iter().product::<usize>(), out.iter().product::<usize>());
        let ksz = g.k.iter().product::<usize>();
        let (xv, dv) = (x.to_f64()?, dy.to_f64()?);
        let mut dw = vec![0.0; m * cg * ksz];
        for ni in 0..n {
            for mi in 0..m {
                let gi = mi / mg.max(1);
                let ob = (ni * m + mi) * osz;
                for ci in 0..cg {
                    let xb = (ni * c + gi * cg + ci) * isz;
                    let wb = (mi * cg + ci) * ksz;
                    taps(&g, inp, out, |o, i, k| dw[wb + k] += dv[ob + o] * xv[xb + i]);
                }
            }
        }
        let mut shape = vec![m, cg];
        shape.extend(self.kernel_shape.clone().unwrap_or_default().iter().map(|&d| d as usize));
        Ok(vec![Array::float(dy.dtype, shape, dw)])
    }
}
