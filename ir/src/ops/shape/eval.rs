//! The shape family's evaluation kernels: transpose, reshape targets, concatenation, slices, splits, expand, tile, pad, constants and ranges.

use super::*;

/// Permutes dimensions.
pub fn transpose(x: &Array, perm: &[usize]) -> Array {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let istr = strides(&x.shape);
    x.gather(shape.clone(), crate::array::Walk::new(shape, perm.iter().map(|&p| istr[p]).collect(), 0))
}

/// Target shape of a Reshape (0 copies, -1 infers).
pub fn reshape_target(input: &[usize], spec: &[i64], allowzero: bool) -> Result<Vec<usize>> {
    let total = numel(input);
    let mut out = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &s) in spec.iter().enumerate() {
        match s {
            -1 => {
                if infer.replace(i).is_some() {
                    return Err(EvalError::Invalid("Reshape has more than one -1".into()));
                }
                out.push(1);
            }
            0 if !allowzero => out.push(*input.get(i).ok_or_else(|| {
                EvalError::Invalid(format!("Reshape copies dim {i} of a rank-{} input", input.len()))
            })?),
            s if s < 0 => return Err(EvalError::Invalid(format!("Reshape dim {s}"))),
            s => out.push(s as usize),
        }
    }
    if let Some(i) = infer {
        let known: usize = out.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, d)| *d).product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(EvalError::Invalid(format!("cannot reshape {input:?} to {spec:?}")));
        }
        out[i] = total / known;
    }
    if numel(&out) != total {
        return Err(EvalError::Invalid(format!("cannot reshape {input:?} ({total} elements) to {spec:?}")));
    }
    Ok(out)
}

pub(super) fn concat(parts: &[&Array], ax: i64) -> Result<Array> {
    let first = parts[0];
    let ax = norm_axis(ax, first.rank())?;
    let mut shape = first.shape.clone();
    shape[ax] = parts.iter().map(|p| p.shape[ax]).sum();
    for p in parts {
        if p.rank() != first.rank() || (0..first.rank()).any(|d| d != ax && p.shape[d] != first.shape[d]) {
            return Err(EvalError::Invalid(format!("Concat of {:?} and {:?} along {ax}", first.shape, p.shape)));
        }
        if p.dtype != first.dtype {
            return Err(EvalError::Invalid("Concat of different element types".into()));
        }
    }
    let outer: usize = shape[..ax].iter().product();
    let inner: usize = shape[ax + 1..].iter().product();
    let all = Array { dtype: first.dtype, shape: vec![], data: Array::concat_data(parts) };
    let mut offsets = Vec::with_capacity(parts.len());
    let mut acc = 0;
    for p in parts {
        offsets.push(acc);
        acc += p.numel();
    }
    let mut idx = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for (p, off) in parts.iter().zip(&offsets) {
            let block = p.shape[ax] * inner;
            idx.extend((0..block).map(|k| off + o * block + k));
        }
    }
    Ok(all.gather_flat(shape, &idx))
}

/// Slices `x` along `ax` from `start` for `len` elements.
pub fn slice_axis(x: &Array, ax: usize, start: usize, len: usize) -> Array {
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut idx = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        for j in start..start + len {
            let base = (o * n + j) * inner;
            idx.extend(base..base + inner);
        }
    }
    let mut shape = x.shape.clone();
    shape[ax] = len;
    x.gather_flat(shape, &idx)
}

pub(super) fn split(op: &op::Split, cx: &EvalCx<'_>, n_out: usize) -> Result<Vec<Array>> {
    let x = cx.req(0)?;
    let ax = norm_axis(op.axis(), x.rank())?;
    let total = x.shape[ax];
    let sizes: Vec<usize> = match (cx.opt(1), &op.split) {
        (Some(s), _) => s.to_i64()?.iter().map(|&v| v as usize).collect(),
        (None, Some(s)) => s.iter().map(|&v| v as usize).collect(),
        _ => {
            let parts = op.num_outputs.map(|n| n as usize).unwrap_or(n_out).max(1);
            let chunk = total.div_ceil(parts);
            (0..parts).map(|i| chunk.min(total.saturating_sub(i * chunk))).collect()
        }
    };
    if sizes.iter().sum::<usize>() != total {
        return Err(EvalError::Invalid(format!("Split sizes {sizes:?} do not add up to {total}")));
    }
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&s| {
            let a = slice_axis(x, ax, start, s);
            start += s;
            a
        })
        .collect())
}

/// Normalised slice parameters of one axis: (start, step, count).
pub fn slice_params(dim: i64, start: i64, end: i64, step: i64) -> (i64, i64, usize) {
    let clampi = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
    let norm = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
    if step > 0 {
        let s = clampi(norm(start), 0, dim);
        let e = clampi(norm(end), 0, dim);
        let count = if e > s { ((e - s) + step - 1) / step } else { 0 };
        (s, step, count as usize)
    } else {
        let s = clampi(norm(start), -1, dim - 1);
        let e = clampi(norm(end), -1, dim - 1);
        let count = if s > e { ((s - e) + (-step) - 1) / (-step) } else { 0 };
        (s, step, count as usize)
    }
}

pub(super) fn slice(op: &op::Slice, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let (starts, ends, axes, steps) = if cx.opt(1).is_some() || op.starts.is_none() {
        (
            cx.req(1)?.to_i64()?,
            cx.req(2)?.to_i64()?,
            cx.opt(3).map(|a| a.to_i64()).transpose()?,
            cx.opt(4).map(|a| a.to_i64()).transpose()?,
        )
    } else {
        (op.starts.clone().unwrap_or_default(), op.ends.clone().unwrap_or_default(), op.axes.clone(), None)
    };
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| norm_axis(v, x.rank())).collect::<std::result::Result<_, String>>()?,
        None => (0..starts.len()).collect(),
    };
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    let rank = x.rank();
    let mut start = vec![0i64; rank];
    let mut step = vec![1i64; rank];
    let mut count: Vec<usize> = x.shape.clone();
    for (k, &ax) in axes.iter().enumerate() {
        if steps[k] == 0 {
            return Err(EvalError::Invalid("Slice step 0".into()));
        }
        let (s, st, c) = slice_params(x.shape[ax] as i64, starts[k], ends[k], steps[k]);
        start[ax] = s;
        step[ax] = st;
        count[ax] = c;
    }
    let istr = strides(&x.shape);
    let n = numel(&count);
    let mut idx = Vec::with_capacity(n);
    let mut counter = vec![0usize; rank];
    for _ in 0..n {
        let mut flat = 0i64;
        for d in 0..rank {
            flat += (start[d] + counter[d] as i64 * step[d]) * istr[d] as i64;
        }
        idx.push(flat as usize);
        for d in (0..rank).rev() {
            counter[d] += 1;
            if counter[d] < count[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(x.gather_flat(count, &idx))
}

pub(super) fn expand(x: &Array, shape: &[i64]) -> Result<Array> {
    let target: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let out = broadcast_shapes(&x.shape, &target)?;
    Ok(x.gather(out.clone(), broadcast_walk(&out, &x.shape)))
}

pub(super) fn tile(x: &Array, repeats: &[i64]) -> Result<Array> {
    if repeats.len() != x.rank() {
        return Err(EvalError::Invalid("Tile repeats must match the rank".into()));
    }
    let shape: Vec<usize> = x.shape.iter().zip(repeats).map(|(&d, &r)| d * r.max(0) as usize).collect();
    let istr = strides(&x.shape);
    let ostr = strides(&shape);
    let idx: Vec<usize> = (0..numel(&shape))
        .map(|k| (0..shape.len()).map(|d| ((k / ostr[d]) % shape[d] % x.shape[d].max(1)) * istr[d]).sum())
        .collect();
    Ok(x.gather_flat(shape, &idx))
}

/// The input position a padded output position `o` (input coordinates: `o` in `0..len` is
/// inside) reads in `mode` — `edge` clamps, `reflect` mirrors without repeating the edge,
/// `wrap` wraps — or `None` for the fill value (`constant`).
pub(super) fn pad_source(mode: &str, o: i64, len: i64) -> Option<i64> {
    if (0..len).contains(&o) {
        return Some(o);
    }
    if len <= 0 {
        // Nothing to read from an empty axis (`pad` refuses to pad one but with a constant).
        return None;
    }
    match mode {
        "edge" => Some(o.clamp(0, len - 1)),
        "reflect" if len == 1 => Some(0),
        "reflect" => {
            let period = 2 * (len - 1);
            let m = o.rem_euclid(period);
            Some(if m < len { m } else { period - m })
        }
        "wrap" => Some(o.rem_euclid(len.max(1))),
        _ => None,
    }
}

pub(super) fn pad(op: &op::Pad, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let rank = x.rank();
    let pads_raw: Vec<i64> = match (cx.opt(1), &op.pads) {
        (Some(p), _) => p.to_i64()?,
        (None, Some(p)) => p.clone(),
        _ => vec![0; 2 * rank],
    };
    let axes: Vec<usize> = match cx.opt(3) {
        Some(a) => a.to_i64()?.iter().map(|&v| norm_axis(v, rank)).collect::<std::result::Result<_, String>>()?,
        None => (0..rank).collect(),
    };
    let mut pads = vec![0i64; 2 * rank];
    let k = axes.len();
    if pads_raw.len() != 2 * k {
        return Err(EvalError::Invalid(format!("Pad needs {} pads, got {}", 2 * k, pads_raw.len())));
    }
    for (i, &a) in axes.iter().enumerate() {
        pads[a] = pads_raw[i];
        pads[a + rank] = pads_raw[i + k];
    }
    let value = match cx.opt(2) {
        Some(v) => v.to_f64()?.first().copied().unwrap_or(0.0),
        None => f64::from(op.value.unwrap_or(0.0)),
    };
    let shape: Vec<usize> = (0..rank).map(|d| (x.shape[d] as i64 + pads[d] + pads[d + rank]).max(0) as usize).collect();
    let mode = op.mode();
    if mode != "constant"
        && let Some(d) = (0..rank).find(|&d| x.shape[d] == 0 && shape[d] > 0)
    {
        return Err(EvalError::Invalid(format!(
            "Pad in {mode} mode cannot pad axis {d}: the input is empty along it (only a constant fills it)"
        )));
    }
    let istr = strides(&x.shape);
    let ostr = strides(&shape);
    let n = numel(&shape);
    // Map each output element to an input index or to "fill".
    let mut src: Vec<Option<usize>> = Vec::with_capacity(n);
    for k in 0..n {
        let mut off = 0usize;
        let mut fill = false;
        for d in 0..rank {
            let o = ((k / ostr[d]) % shape[d]) as i64 - pads[d];
            let i = pad_source(mode, o, x.shape[d] as i64).unwrap_or_else(|| {
                fill = true;
                0
            });
            off += i.max(0) as usize * istr[d];
        }
        src.push(if fill { None } else { Some(off) });
    }
    let fill_arr = Array::float(DType::Double, vec![1], vec![value]);
    let fill_arr = cast(&fill_arr, x.dtype)?;
    let both = Array { dtype: x.dtype, shape: vec![], data: Array::concat_data(&[x, &fill_arr]) };
    let idx: Vec<usize> = src.iter().map(|s| s.unwrap_or(x.numel())).collect();
    Ok(both.gather_flat(shape, &idx))
}

pub(super) fn constant(c: &op::Constant) -> Result<Array> {
    if let Some(t) = &c.value {
        return Array::from_tensor(t);
    }
    if let Some(v) = c.value_float {
        return Ok(Array::f32(vec![], vec![v]));
    }
    if let Some(v) = &c.value_floats {
        return Ok(Array::f32(vec![v.len()], v.clone()));
    }
    if let Some(v) = c.value_int {
        return Ok(Array::scalar_i64(v));
    }
    if let Some(v) = &c.value_ints {
        return Ok(Array::i64(vec![v.len()], v.clone()));
    }
    if let Some(v) = &c.value_string {
        return Ok(Array { dtype: DType::String, shape: vec![], data: Data::Str(vec![v.clone()]) });
    }
    if let Some(v) = &c.value_strings {
        return Ok(Array { dtype: DType::String, shape: vec![v.len()], data: Data::Str(v.clone()) });
    }
    Err(EvalError::Invalid("Constant without a value".into()))
}

pub(super) fn range(start: &Array, limit: &Array, delta: &Array) -> Result<Array> {
    match start.data {
        Data::I64(_) => {
            let (s, l, d) = (start.first_i64()?, limit.first_i64()?, delta.first_i64()?);
            if d == 0 {
                return Err(EvalError::Invalid("Range delta 0".into()));
            }
            let n = ((l - s) as f64 / d as f64).ceil().max(0.0) as usize;
            Ok(Array::int(start.dtype, vec![n], (0..n as i64).map(|i| s + i * d).collect()))
        }
        _ => {
            let (s, l, d) = (start.first_f64()?, limit.first_f64()?, delta.first_f64()?);
            let n = ((l - s) / d).ceil().max(0.0) as usize;
            Ok(Array::float(start.dtype, vec![n], (0..n).map(|i| s + i as f64 * d).collect()))
        }
    }
}

// ---- gradients ----
