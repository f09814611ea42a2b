//! Data movement: transposes, broadcasts, tiles, slices, pads, nearest resizes and splits as
//! remaps through per-dim index tables; concat by placing each input; gather along an axis.

use ir::op;
use ir::ops::norm_axis;

use super::Elem;
use super::compile::{Buf, CompileCx, CompileResult, Compiled, Kernel, OutSpec, TensorDesc, groups};
use super::wgsl::{Axis, broadcast_strides, place, remap, source, strides};

/// A remap of input 0 into output 0 through `axes`.
fn remap_out(
    cx: &CompileCx<'_>,
    x: &TensorDesc<'_>,
    axes: impl FnOnce(&[usize]) -> Option<Vec<Axis>>,
    pad: f64,
) -> CompileResult {
    let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
    let oshape = c.outputs[0].shape.clone();
    let Some(axes) = axes(&oshape) else { return Ok(None) };
    remap(&mut c, Buf::In(0), x.elem(), Buf::Out(0), &oshape, &axes, pad);
    Ok(Some(c))
}

impl Kernel for op::Transpose {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        let r = x.shape.len();
        let perm: Vec<usize> = match &self.perm {
            Some(p) => p.iter().map(|&v| norm_axis(v, r)).collect::<Result<_, _>>()?,
            None => (0..r).rev().collect(),
        };
        let st = strides(&x.shape);
        remap_out(cx, x, |_| Some(perm.iter().map(|&p| Axis::Same(st[p])).collect()), 0.0)
    }
}

impl Kernel for op::Expand {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        remap_out(
            cx,
            x,
            |o| Some(broadcast_strides(&x.shape, o).iter().map(|&s| Axis::Same(s as usize)).collect()),
            0.0,
        )
    }
}

impl Kernel for op::Tile {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        let st = strides(&x.shape);
        remap_out(
            cx,
            x,
            |o| {
                Some(
                    (0..x.shape.len())
                        .map(|d| Axis::Table((0..o[d]).map(|c| (c % x.shape[d].max(1)) as i64).collect(), st[d]))
                        .collect(),
                )
            },
            0.0,
        )
    }
}

impl Kernel for op::Slice {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        let r = x.shape.len();
        let vals = |k: usize| -> Result<Option<Vec<i64>>, String> {
            cx.input(k).map(|t| t.ints().ok_or_else(|| format!("Slice input {k} unknown"))).transpose()
        };
        let (starts, ends, axes_l, steps) = if cx.opset >= 10 {
            (vals(1)?.unwrap_or_default(), vals(2)?.unwrap_or_default(), vals(3)?, vals(4)?)
        } else {
            (self.starts.clone().unwrap_or_default(), self.ends.clone().unwrap_or_default(), self.axes.clone(), None)
        };
        let axes_l: Vec<usize> = axes_l
            .unwrap_or_else(|| (0..starts.len() as i64).collect())
            .iter()
            .map(|&a| norm_axis(a, r))
            .collect::<Result<_, _>>()?;
        let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
        let st = strides(&x.shape);
        remap_out(
            cx,
            x,
            |o| {
                let mut axes: Vec<Axis> = (0..r).map(|d| Axis::Same(st[d])).collect();
                for (k, &a) in axes_l.iter().enumerate() {
                    let (start, _, len) = ir::eval::slice_params(x.shape[a] as i64, starts[k], ends[k], steps[k]);
                    if len != o[a] {
                        return None;
                    }
                    axes[a] = Axis::Table((0..len).map(|c| start + c as i64 * steps[k]).collect(), st[a]);
                }
                Some(axes)
            },
            0.0,
        )
    }

    fn value_inputs(&self) -> &'static [usize] {
        &[1, 2, 3, 4]
    }
}

/// The input coordinate an output coordinate `c` of a padded axis reads (-1: the pad value).
fn pad_source(mode: &str, c: i64, before: i64, n: i64) -> i64 {
    let i = c - before;
    if (0..n).contains(&i) {
        return i;
    }
    match mode {
        "edge" => i.clamp(0, n - 1),
        "reflect" => {
            if n == 1 {
                0
            } else {
                let p = 2 * (n - 1);
                let m = i.rem_euclid(p);
                if m < n { m } else { p - m }
            }
        }
        "wrap" => i.rem_euclid(n),
        _ => -1,
    }
}

impl Kernel for op::Pad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        let r = x.shape.len();
        let (pads, value) = if cx.opset >= 11 {
            let pads = cx.input(1).map(|t| t.ints().ok_or("Pad pads unknown")).transpose()?.unwrap_or_default();
            let value = match cx.input(2) {
                Some(t) => t.floats().ok_or("Pad value unknown")?.first().copied().unwrap_or(0.0),
                None => 0.0,
            };
            (pads, value)
        } else {
            (self.pads.clone().unwrap_or_default(), f64::from(self.value.unwrap_or(0.0)))
        };
        let axes_list: Vec<usize> = match cx.input(3) {
            Some(t) => {
                t.ints().ok_or("Pad axes unknown")?.iter().map(|&a| norm_axis(a, r)).collect::<Result<_, _>>()?
            }
            None => (0..r).collect(),
        };
        let na = axes_list.len();
        if pads.len() != 2 * na {
            return Ok(None);
        }
        let st = strides(&x.shape);
        let mode = self.mode();
        remap_out(
            cx,
            x,
            |o| {
                let mut axes: Vec<Axis> = (0..r).map(|d| Axis::Same(st[d])).collect();
                for (k, &a) in axes_list.iter().enumerate() {
                    let n = x.shape[a] as i64;
                    let table = (0..o[a] as i64).map(|c| pad_source(mode, c, pads[k], n)).collect();
                    axes[a] = Axis::Table(table, st[a]);
                }
                Some(axes)
            },
            value,
        )
    }

    fn value_inputs(&self) -> &'static [usize] {
        &[1, 2, 3]
    }
}

/// The input index nearest-resizing reads for output coordinate `c` of an axis.
fn nearest_source(ctm: &str, nearest: &str, c: usize, inn: usize, out: usize) -> i64 {
    let (c, inn_f, out_f) = (c as f64, inn as f64, out as f64);
    let scale = out_f / inn_f;
    let xo = match ctm {
        "asymmetric" => c / scale,
        "align_corners" => {
            if out_f > 1.0 {
                c * (inn_f - 1.0) / (out_f - 1.0)
            } else {
                0.0
            }
        }
        "pytorch_half_pixel" => {
            if out_f > 1.0 {
                (c + 0.5) / scale - 0.5
            } else {
                0.0
            }
        }
        "half_pixel_symmetric" => {
            let adj = out_f / (inn_f * scale);
            let center = inn_f / 2.0;
            center * (1.0 - adj) + (c + 0.5) / scale - 0.5
        }
        _ => (c + 0.5) / scale - 0.5,
    };
    let half = (xo - xo.floor() - 0.5).abs() < 1e-9;
    let i = match nearest {
        "floor" => xo.floor(),
        "ceil" => xo.ceil(),
        "round_prefer_ceil" if half => xo.ceil(),
        _ if half => xo.floor(),
        _ => xo.round(),
    };
    (i as i64).clamp(0, inn as i64 - 1)
}

/// Nearest resizing as a remap; other modes run on the host.
fn resize_nearest(cx: &CompileCx<'_>, mode: &str, ctm: &str, nearest: &str, antialias: bool) -> CompileResult {
    let Some(x) = cx.input(0) else { return Ok(None) };
    if mode != "nearest" || antialias || ctm == "tf_crop_and_resize" {
        return Ok(None);
    }
    let st = strides(&x.shape);
    remap_out(
        cx,
        x,
        |o| {
            Some(
                (0..x.shape.len())
                    .map(|d| {
                        let table = (0..o[d]).map(|c| nearest_source(ctm, nearest, c, x.shape[d], o[d])).collect();
                        Axis::Table(table, st[d])
                    })
                    .collect(),
            )
        },
        0.0,
    )
}

impl Kernel for op::Resize {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        resize_nearest(
            cx,
            self.mode(),
            self.coordinate_transformation_mode(),
            self.nearest_mode(),
            self.antialias() != 0,
        )
    }
}

impl Kernel for op::Upsample {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        // Upsample is asymmetric with floor rounding (as the reference evaluates it).
        resize_nearest(cx, self.mode(), "asymmetric", "floor", false)
    }
}

impl Kernel for op::Split {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(x) = cx.input(0) else { return Ok(None) };
        let r = x.shape.len();
        let a = norm_axis(self.axis(), r)?;
        let st = strides(&x.shape);
        let mut c = Compiled::default();
        let mut start = 0usize;
        for (slot, out) in cx.outs.iter().enumerate() {
            let Some((sh, dtype)) = out else { return Ok(None) };
            let len = sh[a];
            let axes: Vec<Axis> = (0..r)
                .map(|d| {
                    if d == a {
                        Axis::Table((start..start + len).map(|c| c as i64).collect(), st[d])
                    } else {
                        Axis::Same(st[d])
                    }
                })
                .collect();
            c.outputs.push(OutSpec { shape: sh.clone(), dtype: *dtype, view_of: None });
            remap(&mut c, Buf::In(0), x.elem(), Buf::Out(slot), sh, &axes, 0.0);
            start += len;
        }
        Ok(Some(c))
    }
}

impl Kernel for op::Concat {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let oshape = c.outputs[0].shape.clone();
        let oe = Elem::of(c.outputs[0].dtype);
        let a = norm_axis(self.axis.unwrap_or(0), oshape.len())?;
        let inner: usize = oshape[a + 1..].iter().product();
        let out_block = oshape[a] * inner;
        let mut off = 0usize;
        for (k, t) in cx.ins.iter().enumerate() {
            let Some(t) = t else { continue };
            if t.elem() != oe {
                return Ok(None);
            }
            let block = t.shape.get(a).copied().unwrap_or(1) * inner;
            place(&mut c, Buf::In(k), oe, Buf::Out(0), [t.numel(), block, out_block, off]);
            off += block;
        }
        Ok(Some(c))
    }
}

impl Kernel for op::Gather {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(x), Some(idx)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if idx.elem() != Elem::I32 {
            return Ok(None);
        }
        let a = norm_axis(self.axis(), x.shape.len())?;
        let inner: usize = x.shape[a + 1..].iter().product();
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let count: usize = c.outputs[0].shape.iter().product();
        let p = vec![count as u32, idx.numel() as u32, x.shape[a] as u32, inner as u32];
        if count > 0 {
            c.launch(gather_src(x.elem()), vec![Buf::In(0), Buf::In(1), Buf::Out(0)], p, groups(count));
        }
        Ok(Some(c))
    }
}

impl Kernel for op::GatherGrad {
    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let (Some(idx), Some(dy)) = (cx.input(0), cx.input(1)) else { return Ok(None) };
        if idx.elem() != Elem::I32 || dy.elem() != Elem::F32 {
            return Ok(None);
        }
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let shape = c.outputs[0].shape.clone();
        let a = norm_axis(self.axis(), shape.len())?;
        let inner: usize = shape[a + 1..].iter().product();
        let count: usize = shape.iter().product();
        let columns: usize = shape[..a].iter().product::<usize>() * inner;
        if count > 0 {
            // Zero the table, then one invocation per column (outer position × inner element)
            // walks the indices: count + columns × indices additions instead of count ×
            // indices (a 50257-row embedding's gradient: 44× faster on lavapipe).
            c.launch(zero_src(), vec![Buf::Out(0)], vec![count as u32], groups(count));
            let p = vec![columns as u32, idx.numel() as u32, shape[a] as u32, inner as u32];
            let trips = idx.numel() as u64;
            c.launch_loop(gather_grad_src(), vec![Buf::In(0), Buf::In(1), Buf::Out(0)], p, groups(columns), trips);
        }
        Ok(Some(c))
    }
}

/// The gradient of a gather, owner-computes (no float atomics): each invocation owns one
/// column of the (zeroed) table — an outer position and an inner element — and adds, in index
/// order, the dY elements of that column into the rows their indices pick; no two invocations
/// write one element, and each element sums its dY elements in the order the reference does.
/// `P = [columns, idx_count, axis_len, inner]`.
pub fn gather_grad_src() -> String {
    let body = "    let ic = P[1]; let al = P[2]; let inner = P[3];
    let within = i % inner;
    let o = i / inner;
    for (var j = 0u; j < ic; j = j + 1u) {
        var idx = I[j];
        if (idx < 0) { idx = idx + i32(al); }
        if (idx >= 0 && u32(idx) < al) {
            let y = (o * al + u32(idx)) * inner + within;
            Y[y] = Y[y] + DY[(o * ic + j) * inner + within];
        }
    }";
    source(&[("I", Elem::I32, false), ("DY", Elem::F32, false), ("Y", Elem::F32, true)], "", body)
}

/// Zeroes `Y`. `P = [count]`.
fn zero_src() -> String {
    source(&[("Y", Elem::F32, true)], "", "    Y[i] = 0.0;")
}

impl Kernel for op::SliceGrad {
    fn value_inputs(&self) -> &'static [usize] {
        &[1, 2, 3, 4]
    }

    fn compile(&self, cx: &CompileCx<'_>) -> CompileResult {
        let Some(dy) = cx.input(0) else { return Ok(None) };
        let (Some(starts), Some(ends)) = (cx.input(1).and_then(|t| t.ints()), cx.input(2).and_then(|t| t.ints()))
        else {
            return Ok(None);
        };
        let Some(mut c) = Compiled::like_out0(cx) else { return Ok(None) };
        let shape = c.outputs[0].shape.clone();
        let r = shape.len();
        let axes: Vec<usize> = match cx.input(3) {
            Some(t) => match t.ints() {
                Some(a) => a.iter().map(|&v| norm_axis(v, r)).collect::<Result<_, _>>()?,
                None => return Ok(None),
            },
            None => (0..starts.len()).collect(),
        };
        let steps = match cx.input(4) {
            Some(t) => match t.ints() {
                Some(s) => s,
                None => return Ok(None),
            },
            None => vec![1; starts.len()],
        };
        // Per output dim: the first index the slice took, its step, how many it took, and
        // dY's stride along it.
        let mut start = vec![0i64; r];
        let mut step = vec![1i64; r];
        for (k, &a) in axes.iter().enumerate() {
            let (s0, st, _) = ir::ops::shape::slice_params(shape[a] as i64, starts[k], ends[k], steps[k]);
            start[a] = s0;
            step[a] = st;
        }
        let ds = strides(&dy.shape);
        let count: usize = shape.iter().product();
        let mut p = vec![count as u32, r as u32];
        for d in 0..r {
            p.extend([
                shape[d] as u32,
                start[d] as i32 as u32,
                step[d] as i32 as u32,
                dy.shape[d] as u32,
                ds[d] as u32,
            ]);
        }
        if count > 0 {
            c.launch_loop(slice_grad_src(), vec![Buf::In(0), Buf::Out(0)], p, groups(count), r as u64);
        }
        Ok(Some(c))
    }
}

/// The gradient of a slice: each element reads dY where the slice took it, else 0.
/// `P = [count, rank, per dim (size, start, step, taken, dY stride)]`.
pub fn slice_grad_src() -> String {
    let body = "    let r = P[1];
    var rem = i;
    var off = 0u;
    var hit = true;
    for (var t = 0u; t < r; t = t + 1u) {
        let d = r - 1u - t;
        let b = 2u + 5u * d;
        let c = i32(rem % P[b]);
        rem = rem / P[b];
        let k = c - bitcast<i32>(P[b + 1u]);
        let st = bitcast<i32>(P[b + 2u]);
        if (k % st != 0) { hit = false; }
        let q = k / st;
        if (q < 0 || q >= i32(P[b + 3u])) { hit = false; }
        off = off + u32(max(q, 0)) * P[b + 4u];
    }
    Y[i] = select(0.0, DY[off], hit);";
    source(&[("DY", Elem::F32, false), ("Y", Elem::F32, true)], "", body)
}

/// Gather along an axis: `P = [count, idx_count, axis_len, inner]`.
pub fn gather_src(e: Elem) -> String {
    let body = "    let ic = P[1]; let al = P[2]; let inner = P[3];
    let within = i % inner;
    let rest = i / inner;
    let j = rest % ic;
    let o = rest / ic;
    var idx = I[j];
    if (idx < 0) { idx = idx + i32(al); }
    let k = u32(clamp(idx, 0, i32(al) - 1));
    Y[i] = X[(o * al + k) * inner + within];";
    source(&[("X", e, false), ("I", Elem::I32, false), ("Y", e, true)], "", body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::gpu::wgsl::validate;

    #[test]
    fn gather_kernels_validate() {
        for e in [Elem::F32, Elem::I32] {
            validate("gather", &gather_src(e));
        }
        validate("gather grad", &gather_grad_src());
        validate("slice grad", &slice_grad_src());
    }
}
