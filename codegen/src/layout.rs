//! Layouts on the host: a device's piece of a tensor, and a tensor assembled from its pieces.
//!
//! A layout gives, per mesh axis, `R` (replicated), `S(d)` (split along tensor dim `d`) or `P`
//! (partial sums). When several axes split one dim, the first axis is the outer one: the piece
//! index along the dim is `c[a₁]·size[a₂] + c[a₂]`.

use ir::DType;
use ir::eval::{Array, Data, Walk, strides};
use ir::shard::{AxisShard, Mesh};

/// For each tensor dim, the mesh axes that split it, outer first.
pub fn split_axes(layout: &[AxisShard], rank: usize) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); rank];
    for (a, s) in layout.iter().enumerate() {
        if let AxisShard::Split(d) = s
            && (*d as usize) < rank
        {
            out[*d as usize].push(a);
        }
    }
    out
}

/// The `[start, end)` range of tensor dim `d` (of global extent `n`) that the device at mesh
/// coordinates `coords` holds.
pub fn dim_range(layout: &[AxisShard], mesh: &Mesh, coords: &[usize], d: usize, n: usize) -> (usize, usize) {
    let axes: Vec<usize> = (0..layout.len()).filter(|&a| layout[a] == AxisShard::Split(d as u8)).collect();
    let mut parts = 1usize;
    let mut index = 0usize;
    for &a in &axes {
        parts *= mesh.axes[a].size;
        index = index * mesh.axes[a].size + coords[a];
    }
    let len = n / parts;
    (index * len, index * len + len)
}

/// The local shape of a tensor of `shape` under `layout`.
pub fn local_shape(shape: &[usize], layout: &[AxisShard], mesh: &Mesh) -> Vec<usize> {
    let mut out = shape.to_vec();
    for (a, s) in layout.iter().enumerate() {
        if let AxisShard::Split(d) = s
            && let Some(x) = out.get_mut(*d as usize)
        {
            *x /= mesh.axes[a].size;
        }
    }
    out
}

fn elem_count(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Copies the box `ranges` (per dim `[start, end)`) of `a`.
pub fn crop(a: &Array, ranges: &[(usize, usize)]) -> Array {
    let shape: Vec<usize> = ranges.iter().map(|(s, e)| e - s).collect();
    a.gather(shape, Walk::boxed(&a.shape, ranges))
}

/// Writes `piece` into `out` at the box starting at `origin`, adding when `add`.
fn paste(out: &mut Array, piece: &Array, origin: &[usize], add: bool) {
    let st = strides(&out.shape);
    let r = piece.shape.len();
    let n = elem_count(&piece.shape);
    let mut coord = vec![0usize; r];
    for i in 0..n {
        let mut off = 0;
        for d in 0..r {
            off += (coord[d] + origin[d]) * st[d];
        }
        match (&mut out.data, &piece.data) {
            (Data::F32(o), Data::F32(p)) => {
                if add {
                    o[off] += p[i]
                } else {
                    o[off] = p[i]
                }
            }
            (Data::F64(o), Data::F64(p)) => {
                if add {
                    o[off] += p[i]
                } else {
                    o[off] = p[i]
                }
            }
            (Data::I64(o), Data::I64(p)) => {
                if add {
                    o[off] += p[i]
                } else {
                    o[off] = p[i]
                }
            }
            (Data::Bool(o), Data::Bool(p)) => o[off] = p[i] || (add && o[off]),
            (Data::Str(o), Data::Str(p)) => o[off] = p[i].clone(),
            _ => {}
        }
        for d in (0..r).rev() {
            coord[d] += 1;
            if coord[d] < piece.shape[d] {
                break;
            }
            coord[d] = 0;
        }
    }
}

/// A zero array of a shape and element type.
pub fn zeros_like(dtype: DType, shape: Vec<usize>) -> Array {
    Array::zeros(dtype, shape.clone()).unwrap_or(Array { dtype, shape, data: Data::F32(Vec::new()) })
}

/// The piece of `a` that the device at `coords` holds under `layout`. Partial sums: the
/// device at coordinate 0 of every `P` axis holds the whole value, the others zeros.
pub fn piece(a: &Array, layout: &[AxisShard], mesh: &Mesh, coords: &[usize]) -> Array {
    let ranges: Vec<(usize, usize)> =
        (0..a.shape.len()).map(|d| dim_range(layout, mesh, coords, d, a.shape[d])).collect();
    let p = crop(a, &ranges);
    let zero = layout.iter().enumerate().any(|(ax, s)| *s == AxisShard::Partial && coords[ax] != 0);
    if zero { zeros_like(p.dtype, p.shape.clone()) } else { p }
}

/// Assembles a tensor of `shape` from the pieces every device of `mesh` holds (indexed by
/// device rank in the mesh), under `layout`: split pieces are placed, replicas taken once,
/// partial sums added.
pub fn assemble(pieces: Vec<Array>, layout: &[AxisShard], mesh: &Mesh, shape: &[usize]) -> Array {
    let dtype = pieces.first().map_or(DType::Float, |p| p.dtype);
    // One copy per replica group: coordinate 0 on replicated axes.
    let mut held: Vec<(Vec<usize>, Array)> = pieces
        .into_iter()
        .enumerate()
        .map(|(rank, p)| (mesh.coords(rank), p))
        .filter(|(c, _)| !layout.iter().enumerate().any(|(a, s)| *s == AxisShard::Replicate && c[a] != 0))
        .collect();
    // A piece that is the whole value is the value (no copy).
    if held.len() == 1 && held[0].1.shape == shape {
        return held.pop().expect("one piece").1;
    }
    let mut out = zeros_like(dtype, shape.to_vec());
    let add = layout.contains(&AxisShard::Partial);
    for (c, p) in &held {
        let origin: Vec<usize> = (0..shape.len()).map(|d| dim_range(layout, mesh, c, d, shape[d]).0).collect();
        paste(&mut out, p, &origin, add);
    }
    out
}

/// Splits `a` along `axis` into `parts` equal pieces.
pub fn split_even(a: &Array, axis: usize, parts: usize) -> Vec<Array> {
    (0..parts).map(|i| even_piece(a, axis, parts, i)).collect()
}

/// Piece `i` of [`split_even`], cut alone.
pub fn even_piece(a: &Array, axis: usize, parts: usize, i: usize) -> Array {
    let n = a.shape[axis] / parts.max(1);
    let ranges: Vec<(usize, usize)> =
        (0..a.shape.len()).map(|d| if d == axis { (i * n, i * n + n) } else { (0, a.shape[d]) }).collect();
    crop(a, &ranges)
}

/// Concatenates arrays along `axis`.
pub fn concat(parts: &[Array], axis: usize) -> Array {
    let first = &parts[0];
    let mut shape = first.shape.clone();
    shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
    let mut out = zeros_like(first.dtype, shape.clone());
    let mut at = 0;
    for p in parts {
        let mut origin = vec![0; shape.len()];
        origin[axis] = at;
        paste(&mut out, p, &origin, false);
        at += p.shape[axis];
    }
    out
}

/// Element-wise `a ⊕ b` for the reductions collectives use (`sum`, `max`, `min`, `prod`).
pub fn combine(a: &mut Array, b: &Array, op: &str) {
    fn f<T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T>>(x: &mut [T], y: &[T], op: &str) {
        for (x, y) in x.iter_mut().zip(y) {
            *x = match op {
                "max" => {
                    if *y > *x {
                        *y
                    } else {
                        *x
                    }
                }
                "min" => {
                    if *y < *x {
                        *y
                    } else {
                        *x
                    }
                }
                "prod" => *x * *y,
                _ => *x + *y,
            };
        }
    }
    match (&mut a.data, &b.data) {
        (Data::F32(x), Data::F32(y)) => f(x, y, op),
        (Data::F64(x), Data::F64(y)) => f(x, y, op),
        (Data::I64(x), Data::I64(y)) => f(x, y, op),
        (Data::Bool(x), Data::Bool(y)) => {
            for (x, y) in x.iter_mut().zip(y) {
                *x = if op == "min" || op == "prod" { *x && *y } else { *x || *y };
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::shard::{LinkLevel, MeshAxis};

    fn mesh() -> Mesh {
        Mesh {
            axes: vec![
                MeshAxis { name: "x".into(), size: 2, level: LinkLevel::Intra },
                MeshAxis { name: "y".into(), size: 2, level: LinkLevel::Intra },
            ],
        }
    }

    #[test]
    fn pieces_assemble_back() {
        let a = Array::f32(vec![4, 6], (0..24).map(|x| x as f32).collect());
        let m = mesh();
        for layout in [
            vec![AxisShard::Split(0), AxisShard::Split(1)],
            vec![AxisShard::Split(0), AxisShard::Split(0)],
            vec![AxisShard::Replicate, AxisShard::Split(1)],
            vec![AxisShard::Partial, AxisShard::Split(0)],
            vec![AxisShard::Replicate, AxisShard::Replicate],
        ] {
            let pieces: Vec<Array> = (0..4).map(|r| piece(&a, &layout, &m, &m.coords(r))).collect();
            assert_eq!(assemble(pieces, &layout, &m, &a.shape), a, "{layout:?}");
        }
        // Outer axis first: with S(0) on both axes, device (1, 0) holds rows 2..3.
        let p = piece(&a, &[AxisShard::Split(0), AxisShard::Split(0)], &m, &[1, 0]);
        assert_eq!(p.as_f32().unwrap(), &[12.0, 13.0, 14.0, 15.0, 16.0, 17.0]);
    }

    #[test]
    fn split_and_concat() {
        let a = Array::f32(vec![2, 6], (0..12).map(|x| x as f32).collect());
        let parts = split_even(&a, 1, 3);
        assert_eq!(parts[1].as_f32().unwrap(), &[2.0, 3.0, 8.0, 9.0]);
        assert_eq!(concat(&parts, 1), a);
    }
}
