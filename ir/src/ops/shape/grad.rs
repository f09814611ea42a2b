//! The shape family's gradient rules: reshape, transpose, concatenation, split, slice, pad and tile.

use super::*;

/// Reshape, Flatten, Squeeze, Unsqueeze: the gradient is dY reshaped to X's shape.
pub(super) fn reshape_grad(cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let d = cx.dims(x)?;
    let r = cx.reshape(dy, &d)?;
    cx.set(0, r);
    Ok(())
}

pub(super) fn transpose_grad(t: &op::Transpose, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let r = cx.dims(cx.x(0)?)?.len();
    let perm: Vec<i64> = t.perm.clone().unwrap_or_else(|| (0..r as i64).rev().collect());
    let d = cx.transpose(dy, &inverse_perm(&perm)?)?;
    cx.set(0, d);
    Ok(())
}

/// Concat: each input's part of dY, by a Split with the inputs' sizes.
pub(super) fn concat_grad(c: &op::Concat, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let k = cx.g.node(cx.n).inputs().len();
    let yd = cx.dims(dy)?;
    let a = norm_axis(c.axis.unwrap_or(0), yd.len())?;
    let mut sizes = Vec::with_capacity(k);
    for i in 0..k {
        sizes.push(cx.dims(cx.x(i)?)?[a]);
    }
    let parts = split_values(cx, dy, a, &sizes)?;
    for (i, p) in parts.into_iter().enumerate() {
        cx.set(i, p);
    }
    Ok(())
}

/// `x` split along `axis` into parts of `sizes` (the Split form of the graph's opset).
pub fn split_values(
    cx: &mut GradCx<'_>,
    x: Value,
    axis: usize,
    sizes: &[i64],
) -> std::result::Result<Vec<Value>, String> {
    if sizes.len() == 1 {
        return Ok(vec![x]);
    }
    let axis = Some(axis as i64);
    if cx.g.opset >= 13 {
        let s = cx.ints(sizes);
        cx.add(Op::Split(op::Split { axis, ..Default::default() }), &[Some(x), Some(s)], sizes.len())
    } else {
        cx.add(
            Op::Split(op::Split { axis, split: Some(sizes.to_vec()), ..Default::default() }),
            &[Some(x)],
            sizes.len(),
        )
    }
}

/// Split: the outputs' gradients (zeros where none flows) concatenated.
pub(super) fn split_grad(sp: &op::Split, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    if !cx.want(0) {
        return Ok(());
    }
    let n = cx.g.node(cx.n).num_outputs();
    let mut parts = Vec::with_capacity(n);
    for s in 0..n {
        parts.push(cx.dy_or_zeros(s)?);
    }
    let r = cx.dims(cx.x(0)?)?.len();
    let a = norm_axis(sp.axis(), r)? as i64;
    let d = if parts.len() == 1 { parts[0] } else { cx.add1(Op::Concat(op::Concat { axis: Some(a) }), &parts)? };
    cx.set(0, d);
    Ok(())
}

/// Slice: dY placed where the slice took it, zeros elsewhere (SliceGrad).
pub(super) fn slice_grad(sl: &op::Slice, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let shape = cx.dims(x)?;
    let mut ins = vec![Some(dy)];
    if cx.x_opt(1).is_some() {
        for i in 1..5 {
            ins.push(cx.x_opt(i));
        }
    } else {
        let starts = sl.starts.clone().ok_or("Slice without starts")?;
        let ends = sl.ends.clone().ok_or("Slice without ends")?;
        ins.push(Some(cx.ints(&starts)));
        ins.push(Some(cx.ints(&ends)));
        ins.push(sl.axes.as_ref().map(|a| cx.ints(a)));
    }
    while ins.last() == Some(&None) {
        ins.pop();
    }
    let d = cx.add(Op::SliceGrad(op::SliceGrad { shape: Some(shape) }), &ins, 1)?[0];
    cx.set(0, d);
    Ok(())
}

/// Pad: in constant mode with no negative pads, dY with the padding sliced off; otherwise
/// (reflect, edge, wrap, cropping) dY contracted per padded axis with the 0/1 map of which
/// input position each output position reads ([`pad_source`], as the evaluator reads them).
pub(super) fn pad_grad(p: &op::Pad, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let xd = cx.dims(x)?;
    let r = xd.len();
    let pads = match cx.x_opt(1) {
        Some(v) => cx.const_ints(Some(v)).ok_or("Pad with computed pads")?,
        None => p.pads.clone().ok_or("Pad without pads")?,
    };
    let axes: Vec<usize> = match cx.x_opt(3) {
        Some(v) => norm_axes(&cx.const_ints(Some(v)).ok_or("Pad with computed axes")?, r)?,
        None => (0..r).collect(),
    };
    let k = axes.len();
    if pads.len() != 2 * k {
        return Err(format!("pads {pads:?} need {} values", 2 * k));
    }
    if p.mode() != "constant" || pads.iter().any(|&v| v < 0) {
        // Every output position reads one input position (or the fill value): per padded
        // axis a 0/1 matrix, and dX is dY contracted with them.
        let mode = p.mode();
        let mut mats = Vec::new();
        for (i, &a) in axes.iter().enumerate() {
            let (b, e, l) = (pads[i], pads[i + k], xd[a]);
            let m = (l + b + e).max(0);
            if b == 0 && e == 0 {
                continue;
            }
            let mut mat = vec![0.0; (m * l) as usize];
            for j in 0..m {
                if let Some(src) = pad_source(mode, j - b, l) {
                    mat[(j * l + src) as usize] += 1.0;
                }
            }
            mats.push((a, m as usize, l as usize, mat));
        }
        let dx = cx.contract_axes(dy, cx.dtype(x), mats)?;
        cx.set(0, dx);
        return Ok(());
    }
    let starts: Vec<i64> = (0..k).map(|i| pads[i]).collect();
    let ends: Vec<i64> = axes.iter().enumerate().map(|(i, &a)| pads[i] + xd[a]).collect();
    let axv: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let (s, e, a) = (cx.ints(&starts), cx.ints(&ends), cx.ints(&axv));
    let d = cx.add1(Op::Slice(op::Slice::default()), &[dy, s, e, a])?;
    cx.set(0, d);
    Ok(())
}

/// Tile: dY viewed as `[r0, d0, r1, d1, …]` and summed over the repeats.
pub(super) fn tile_grad(cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let xd = cx.dims(cx.x(0)?)?;
    let yd = cx.dims(dy)?;
    let mut view = Vec::with_capacity(2 * xd.len());
    for (i, &d) in xd.iter().enumerate() {
        view.push(yd[i] / d.max(1));
        view.push(d);
    }
    let v = cx.reshape(dy, &view)?;
    let axes: Vec<i64> = (0..xd.len() as i64).map(|i| 2 * i).collect();
    let s = cx.reduce_sum(v, &axes, false)?;
    let s = cx.reshape(s, &xd)?;
    cx.set(0, s);
    Ok(())
}
