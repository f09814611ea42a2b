//! Helpers every op family uses: one axis normaliser, one broadcasting rule (for dims and
//! for concrete shapes), and dims printing.

use crate::array::strides;
use crate::types::Dim;

/// Normalises a possibly negative axis of a tensor of rank `rank`: `-rank <= a < rank`
/// (a scalar has no axis).
pub fn norm_axis(a: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let x = if a < 0 { a + r } else { a };
    if x < 0 || x >= r {
        return Err(format!("axis {a} is out of range for rank {rank}"));
    }
    Ok(x as usize)
}

/// The permutation that undoes `perm` (a Transpose's `perm`, negative axes allowed): the
/// transpose of a transposed tensor's gradient.
pub fn inverse_perm(perm: &[i64]) -> Result<Vec<i64>, String> {
    let r = perm.len();
    let mut inv = vec![0i64; r];
    for (i, &p) in perm.iter().enumerate() {
        inv[norm_axis(p, r)?] = i as i64;
    }
    Ok(inv)
}

/// Normalises every axis of a list (see [`norm_axis`]).
pub fn norm_axes(axes: &[i64], rank: usize) -> Result<Vec<usize>, String> {
    axes.iter().map(|&a| norm_axis(a, rank)).collect()
}

/// Numpy broadcast of two concrete shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let y = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = if x == y || y == 1 {
            x
        } else if x == 1 {
            y
        } else {
            return Err(format!("shapes {a:?} and {b:?} do not broadcast"));
        };
    }
    Ok(out)
}

/// For each element of `out`, the flat index of the element of an input of shape `inp`
/// that broadcasts to it.
pub fn broadcast_index(out: &[usize], inp: &[usize]) -> Vec<usize> {
    broadcast_walk(out, inp).collect()
}

/// [`broadcast_index`] made as it is read: the flat offset in `inp` of each element of `out`.
pub fn broadcast_walk(out: &[usize], inp: &[usize]) -> crate::array::Walk {
    let off = out.len() - inp.len();
    let istr = strides(inp);
    let mut steps = vec![0usize; out.len()];
    for (i, &d) in inp.iter().enumerate() {
        steps[i + off] = if d == 1 { 0 } else { istr[i] };
    }
    crate::array::Walk::new(out.to_vec(), steps, 0)
}

/// Numpy broadcast of one dim pair, symbolic dims included.
pub fn bcast(a: &Dim, b: &Dim) -> Result<Dim, String> {
    Ok(match (a, b) {
        (Dim::Fixed(1), x) | (x, Dim::Fixed(1)) => x.clone(),
        (Dim::Fixed(x), Dim::Fixed(y)) if x == y => Dim::Fixed(*x),
        (Dim::Fixed(x), Dim::Fixed(y)) if *x >= 0 && *y >= 0 => {
            return Err(format!("dims {x} and {y} do not broadcast"));
        }
        (Dim::Fixed(x), _) | (_, Dim::Fixed(x)) if *x > 1 => Dim::Fixed(*x),
        (Dim::Sym(x), Dim::Sym(y)) if x == y => Dim::Sym(x.clone()),
        _ => Dim::Unknown,
    })
}

/// Numpy broadcast of two shapes of dims.
pub fn bcast_shapes(a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, String> {
    let n = a.len().max(b.len());
    let one = Dim::Fixed(1);
    (0..n)
        .map(|i| {
            let x = if i + a.len() >= n { &a[i + a.len() - n] } else { &one };
            let y = if i + b.len() >= n { &b[i + b.len() - n] } else { &one };
            bcast(x, y).map_err(|e| format!("shapes [{}] and [{}] do not broadcast: {e}", join(a), join(b)))
        })
        .collect()
}

/// Broadcast of any number of shapes; `None` when one is unknown.
pub fn bcast_all<'a>(shapes: impl IntoIterator<Item = Option<&'a Vec<Dim>>>) -> Result<Option<Vec<Dim>>, String> {
    let mut dims = Some(vec![]);
    for s in shapes {
        dims = match (dims, s) {
            (Some(a), Some(b)) => Some(bcast_shapes(&a, b)?),
            _ => None,
        };
    }
    Ok(dims)
}

/// Dims as `2,N,?`.
pub fn join(d: &[Dim]) -> String {
    d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

/// The product of a number and named dims, for reasoning about reshapes with symbolic dims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prod {
    /// The numeric factor.
    pub coef: i64,
    /// The named factors, sorted.
    pub syms: Vec<String>,
    /// Some factor is unknown.
    pub unknown: bool,
}

/// The product of `dims`.
pub fn prod(dims: &[Dim]) -> Prod {
    let mut p = Prod { coef: 1, syms: Vec::new(), unknown: false };
    for d in dims {
        match d {
            Dim::Fixed(v) if *v >= 0 => p.coef = p.coef.saturating_mul(*v),
            Dim::Sym(s) => p.syms.push(s.clone()),
            _ => p.unknown = true,
        }
    }
    p.syms.sort();
    p
}

/// A product as one dim, when it is a single number or name.
pub fn prod_dim(p: &Prod) -> Dim {
    match (p.unknown, p.syms.len()) {
        (true, _) => Dim::Unknown,
        (false, 0) => Dim::Fixed(p.coef),
        (false, 1) if p.coef == 1 => Dim::Sym(p.syms[0].clone()),
        _ => Dim::Unknown,
    }
}

/// `a / b` when it is a single number or name.
pub fn prod_div(a: &Prod, b: &Prod) -> Dim {
    if a.unknown || b.unknown || b.coef == 0 || a.coef % b.coef != 0 {
        return Dim::Unknown;
    }
    let mut rest = a.syms.clone();
    for s in &b.syms {
        match rest.iter().position(|x| x == s) {
            Some(i) => {
                rest.remove(i);
            }
            None => return Dim::Unknown,
        }
    }
    prod_dim(&Prod { coef: a.coef / b.coef, syms: rest, unknown: false })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_normalise_or_fail() {
        assert_eq!(norm_axis(-1, 3), Ok(2));
        // A scalar has no axis (a Squeeze of axis 0 on one indexed an empty shape).
        assert!(norm_axis(0, 0).is_err());
        assert!(norm_axis(3, 3).is_err());
        assert!(norm_axis(-4, 3).is_err());
    }

    #[test]
    fn symbolic_reshape_divides_out_the_batch() {
        let input = vec![Dim::Sym("N".into()), Dim::Fixed(3), Dim::Fixed(4)];
        let total = prod(&input);
        assert_eq!(prod_div(&total, &prod(&[Dim::Fixed(12)])), Dim::Sym("N".into()));
        assert_eq!(prod_div(&total, &prod(&[Dim::Sym("N".into())])), Dim::Fixed(12));
        assert_eq!(prod_div(&total, &prod(&[Dim::Fixed(5)])), Dim::Unknown);
    }

    #[test]
    fn broadcasting_rules() {
        let a = vec![Dim::Fixed(2), Dim::Fixed(1), Dim::Sym("s".into())];
        let b = vec![Dim::Fixed(3), Dim::Sym("s".into())];
        assert_eq!(bcast_shapes(&a, &b).unwrap(), vec![Dim::Fixed(2), Dim::Fixed(3), Dim::Sym("s".into())]);
        assert!(bcast_shapes(&[Dim::Fixed(2)], &[Dim::Fixed(3)]).is_err());
        assert_eq!(broadcast_shapes(&[2, 1], &[3]).unwrap(), vec![2, 3]);
        assert_eq!(broadcast_index(&[2, 2], &[2]), vec![0, 1, 0, 1]);
    }
}
