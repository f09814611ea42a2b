//! The index family's evaluation kernels: gathers, scatters, top-k, one-hot, cumulative sums, non-zero and triangles.

use super::*;

pub(super) fn gather(x: &Array, indices: &Array, ax: i64) -> Result<Array> {
    let ax = norm_axis(ax, x.rank())?;
    let idx = indices.to_i64()?;
    let n = x.shape[ax] as i64;
    let outer: usize = x.shape[..ax].iter().product();
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut flat = Vec::with_capacity(outer * idx.len() * inner);
    for o in 0..outer {
        for &i in &idx {
            let j = if i < 0 { i + n } else { i };
            if j < 0 || j >= n {
                return Err(EvalError::Invalid(format!("Gather index {i} out of range for size {n}")));
            }
            let base = (o * n as usize + j as usize) * inner;
            flat.extend(base..base + inner);
        }
    }
    let mut shape = x.shape[..ax].to_vec();
    shape.extend(&indices.shape);
    shape.extend(&x.shape[ax + 1..]);
    Ok(x.gather_flat(shape, &flat))
}

pub(super) fn gather_elements(x: &Array, indices: &Array, ax: i64) -> Result<Array> {
    if indices.rank() != x.rank() {
        return Err(EvalError::Invalid(format!("GatherElements indices {:?} for data {:?}", indices.shape, x.shape)));
    }
    let ax = norm_axis(ax, x.rank())?;
    let idx = indices.to_i64()?;
    let istr = strides(&indices.shape);
    let xstr = strides(&x.shape);
    let mut flat = Vec::with_capacity(idx.len());
    for (k, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for d in 0..x.rank() {
            let c = (k / istr[d]) % indices.shape[d];
            let c = if d == ax {
                let n = x.shape[ax] as i64;
                let j = if i < 0 { i + n } else { i };
                if j < 0 || j >= n {
                    return Err(EvalError::Invalid(format!("GatherElements index {i} out of range")));
                }
                j as usize
            } else {
                c
            };
            off += c * xstr[d];
        }
        flat.push(off);
    }
    Ok(x.gather_flat(indices.shape.clone(), &flat))
}

pub(super) fn gather_nd(x: &Array, indices: &Array, batch: usize) -> Result<Array> {
    let idx = indices.to_i64()?;
    let k = *indices.shape.last().ok_or_else(|| EvalError::Invalid("GatherND indices of rank 0".into()))?;
    if batch + k > x.rank() || batch > indices.rank().saturating_sub(1) {
        return Err(EvalError::Invalid(format!(
            "GatherND indices {:?} (batch dims {batch}) for data {:?}",
            indices.shape, x.shape
        )));
    }
    let xstr = strides(&x.shape);
    let batch_n: usize = x.shape[..batch].iter().product();
    let slice: usize = x.shape[batch + k..].iter().product();
    let tuples = idx.len() / k.max(1);
    let per_batch = tuples / batch_n.max(1);
    let mut flat = Vec::with_capacity(tuples * slice);
    for t in 0..tuples {
        let b = t / per_batch.max(1);
        let mut off = if batch > 0 { b * xstr[batch - 1] } else { 0 };
        for j in 0..k {
            let d = batch + j;
            let n = x.shape[d] as i64;
            let i = idx[t * k + j];
            let i = if i < 0 { i + n } else { i };
            if i < 0 || i >= n {
                return Err(EvalError::Invalid("GatherND index out of range".into()));
            }
            off += i as usize * xstr[d];
        }
        flat.extend(off..off + slice);
    }
    let mut shape = indices.shape[..indices.rank() - 1].to_vec();
    shape.extend(&x.shape[batch + k..]);
    Ok(x.gather_flat(shape, &flat))
}

pub(super) fn scatter_values(data: &Array, updates: &Array, targets: &[usize], reduction: &str) -> Result<Array> {
    if updates.numel() != targets.len() || data.dtype != updates.dtype {
        return Err(EvalError::Invalid(format!(
            "{} {} updates for {} positions of {} data",
            updates.numel(),
            updates.dtype,
            targets.len(),
            data.dtype
        )));
    }
    let mut out = data.clone();
    // One reduction for every numeric storage (`max`/`min` are each type's own).
    macro_rules! reduce_into {
        ($o:expr, $u:expr) => {
            for (k, &t) in targets.iter().enumerate() {
                $o[t] = match reduction {
                    "add" => $o[t] + $u[k],
                    "mul" => $o[t] * $u[k],
                    "max" => $o[t].max($u[k]),
                    "min" => $o[t].min($u[k]),
                    _ => $u[k],
                };
            }
        };
    }
    match (&mut out.data, &updates.data) {
        (Data::F32(o), Data::F32(u)) => reduce_into!(o, u),
        (Data::F64(o), Data::F64(u)) => reduce_into!(o, u),
        (Data::I64(o), Data::I64(u)) => reduce_into!(o, u),
        (Data::Bool(o), Data::Bool(u)) => {
            for (k, &t) in targets.iter().enumerate() {
                o[t] = u[k];
            }
        }
        _ => return Err(EvalError::Unsupported(format!("scatter on {}", data.dtype))),
    }
    Ok(out)
}

pub(super) fn scatter_nd(data: &Array, indices: &Array, updates: &Array, reduction: &str) -> Result<Array> {
    let idx = indices.to_i64()?;
    let k = *indices.shape.last().unwrap_or(&0);
    if indices.rank() == 0 || k > data.rank() {
        return Err(EvalError::Invalid(format!("ScatterND indices {:?} for data {:?}", indices.shape, data.shape)));
    }
    let dstr = strides(&data.shape);
    let slice: usize = data.shape[k..].iter().product();
    let mut targets = Vec::with_capacity(updates.numel());
    for t in 0..idx.len() / k.max(1) {
        let mut off = 0;
        for j in 0..k {
            let n = data.shape[j] as i64;
            let i = idx[t * k + j];
            let i = if i < 0 { i + n } else { i };
            if i < 0 || i >= n {
                return Err(EvalError::Invalid("ScatterND index out of range".into()));
            }
            off += i as usize * dstr[j];
        }
        targets.extend(off..off + slice);
    }
    scatter_values(data, updates, &targets, reduction)
}

pub(super) fn scatter_elements(
    data: &Array,
    indices: &Array,
    updates: &Array,
    ax: i64,
    reduction: &str,
) -> Result<Array> {
    let ax = norm_axis(ax, data.rank())?;
    if indices.rank() != data.rank() || indices.shape != updates.shape {
        return Err(EvalError::Invalid(format!(
            "ScatterElements indices {:?} and updates {:?} for data {:?}",
            indices.shape, updates.shape, data.shape
        )));
    }
    let idx = indices.to_i64()?;
    let istr = strides(&indices.shape);
    let dstr = strides(&data.shape);
    let mut targets = Vec::with_capacity(idx.len());
    for (k, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for d in 0..data.rank() {
            let mut c = (k / istr[d]) % indices.shape[d];
            if d == ax {
                let n = data.shape[ax] as i64;
                let j = if i < 0 { i + n } else { i };
                if j < 0 || j >= n {
                    return Err(EvalError::Invalid("ScatterElements index out of range".into()));
                }
                c = j as usize;
            }
            off += c * dstr[d];
        }
        targets.push(off);
    }
    scatter_values(data, updates, &targets, reduction)
}

pub(super) fn topk(x: &Array, k: usize, ax: i64, largest: bool) -> Result<Vec<Array>> {
    let ax = norm_axis(ax, x.rank())?;
    let v = x.to_f64()?;
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    if k > n {
        return Err(EvalError::Invalid(format!("TopK k = {k} exceeds the axis size {n}")));
    }
    let mut flat = Vec::with_capacity(outer * k * inner);
    let mut ids = vec![0i64; outer * k * inner];
    for o in 0..outer {
        for i in 0..inner {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| {
                let (va, vb) = (v[(o * n + a) * inner + i], v[(o * n + b) * inner + i]);
                let c = if largest { vb.partial_cmp(&va) } else { va.partial_cmp(&vb) };
                c.unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
            });
            for (j, &src) in order.iter().take(k).enumerate() {
                ids[(o * k + j) * inner + i] = src as i64;
            }
        }
    }
    for o in 0..outer {
        for j in 0..k {
            for i in 0..inner {
                flat.push((o * n + ids[(o * k + j) * inner + i] as usize) * inner + i);
            }
        }
    }
    let mut shape = x.shape.clone();
    shape[ax] = k;
    Ok(vec![x.gather_flat(shape.clone(), &flat), Array::i64(shape, ids)])
}

pub(super) fn one_hot(indices: &Array, depth: &Array, values: &Array, ax: i64) -> Result<Array> {
    let depth = depth.first_f64()? as i64;
    if values.numel() != 2 {
        return Err(EvalError::Invalid(format!("OneHot values need [off, on], got {} values", values.numel())));
    }
    let rank = indices.rank() + 1;
    let ax = norm_axis(ax, rank)?;
    let idx = indices.to_i64()?;
    let outer: usize = indices.shape[..ax].iter().product();
    let inner: usize = indices.shape[ax..].iter().product();
    let mut shape = indices.shape.clone();
    shape.insert(ax, depth.max(0) as usize);
    let both = values;
    let mut sel = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for d in 0..depth {
            for i in 0..inner {
                let mut t = idx[o * inner + i];
                if t < 0 {
                    t += depth;
                }
                sel.push(if t == d { 1 } else { 0 });
            }
        }
    }
    Ok(both.gather_flat(shape, &sel))
}

pub(super) fn cumsum(x: &Array, ax: &Array, exclusive: bool, reverse: bool) -> Result<Array> {
    cumulative(x, ax, exclusive, reverse, false)
}

/// A running sum (or product, `prod`) along the axis `ax` holds, optionally exclusive of the
/// element itself and from the end.
pub(super) fn cumulative(x: &Array, ax: &Array, exclusive: bool, reverse: bool, prod: bool) -> Result<Array> {
    let ax = norm_axis(ax.to_i64()?.first().copied().ok_or_else(|| EvalError::Invalid("no axis".into()))?, x.rank())?;
    let v = x.to_f64()?;
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut out = vec![0.0; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = if prod { 1.0 } else { 0.0 };
            for jj in 0..n {
                let j = if reverse { n - 1 - jj } else { jj };
                let at = (o * n + j) * inner + i;
                let next = if prod { acc * v[at] } else { acc + v[at] };
                out[at] = if exclusive { acc } else { next };
                acc = next;
            }
        }
    }
    match x.data {
        Data::I64(_) => Ok(Array::int(x.dtype, x.shape.clone(), out.iter().map(|&a| a as i64).collect())),
        _ => Ok(Array::float(x.dtype, x.shape.clone(), out)),
    }
}

pub(super) fn nonzero(x: &Array) -> Result<Array> {
    let v = x.to_f64()?;
    let str_ = strides(&x.shape);
    let hits: Vec<usize> = (0..v.len()).filter(|&i| v[i] != 0.0).collect();
    let r = x.rank();
    let mut out = vec![0i64; r * hits.len()];
    for (k, &f) in hits.iter().enumerate() {
        for d in 0..r {
            out[d * hits.len() + k] = ((f / str_[d]) % x.shape[d]) as i64;
        }
    }
    Ok(Array::i64(vec![r, hits.len()], out))
}

pub(super) fn trilu(x: &Array, k: i64, upper: bool) -> Result<Array> {
    let r = x.rank();
    if r < 2 {
        return Err(EvalError::Invalid("Trilu needs rank ≥ 2".into()));
    }
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let zero = cast(&Array::f32(vec![1], vec![0.0]), x.dtype)?;
    let both = Array { dtype: x.dtype, shape: vec![], data: Array::concat_data(&[x, &zero]) };
    let idx: Vec<usize> = (0..x.numel())
        .map(|f| {
            let i = ((f / w) % h) as i64;
            let j = (f % w) as i64;
            let keep = if upper { j - i >= k } else { j - i <= k };
            if keep { f } else { x.numel() }
        })
        .collect();
    Ok(both.gather_flat(x.shape.clone(), &idx))
}

/// Gather: dY's rows scattered back to the rows the indices picked, summed where several
/// picked the same (GatherGrad).
pub(super) fn gather_grad(gt: &op::Gather, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let data = cx.x(0)?;
    let shape = cx.dims(data)?;
    let axis = norm_axis(gt.axis(), shape.len())? as i64;
    let idx = cx.x(1)?;
    let d = cx.add1(Op::GatherGrad(op::GatherGrad { axis: Some(axis), shape: Some(shape) }), &[idx, dy])?;
    cx.set(0, d);
    Ok(())
}
