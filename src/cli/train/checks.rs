//! The checks `train` prints: one line per comparison, Adam's own, losses against a trajectory.

use super::*;

/// One line of the check.
pub(super) struct Check {
    pub(super) what: String,
    pub(super) ok: bool,
    pub(super) detail: String,
}

pub(super) fn check_all(
    what: &str,
    got: &BTreeMap<String, Array>,
    want: &BTreeMap<String, Array>,
    tol: (f64, f64),
) -> Check {
    check_each(what, got, want, |name, g, w| within(name, g, w, tol).map(|()| 0))
}

/// [`check_all`] for parameters Adam trained: each element within the tolerance plus what its
/// step-1 gradients' rounding can move it through Adam's normalization
/// ([`shardc::train::within_adam`]); the detail says how many needed that.
pub(super) fn check_adam(
    what: &str,
    (got, want): (&BTreeMap<String, Array>, &BTreeMap<String, Array>),
    (got_grads, want_grads): (&BTreeMap<String, Array>, &BTreeMap<String, Array>),
    tol: (f64, f64),
    lr_steps: f64,
) -> Check {
    check_each(what, got, want, |name, g, w| {
        shardc::train::within_adam(name, g, w, tol, (got_grads.get(name), want_grads.get(name)), lr_steps)
    })
}

/// Every tensor of `want` against `got` by `cmp` (`Ok(n)`: within, `n` elements only by a
/// looser bound it allows); the first failure, else how many tensors and loose elements.
pub(super) fn check_each(
    what: &str,
    got: &BTreeMap<String, Array>,
    want: &BTreeMap<String, Array>,
    cmp: impl Fn(&str, &Array, &Array) -> Result<usize, String>,
) -> Check {
    let mut loose = 0;
    for (name, w) in want {
        let r = match got.get(name) {
            Some(g) => cmp(name, g, w),
            None => Err(format!("{name}: not computed")),
        };
        match r {
            Ok(n) => loose += n,
            Err(e) => return Check { what: what.into(), ok: false, detail: e },
        }
    }
    let detail = match loose {
        0 => format!("{} tensors", want.len()),
        n => format!(
            "{} tensors ({n} elements beyond the tolerance by no more than Adam's steps make of their gradients' rounding)",
            want.len()
        ),
    };
    Check { what: what.into(), ok: true, detail }
}

pub(super) fn check_losses(what: &str, got: &[f64], want: &[f64], tol: (f64, f64)) -> Check {
    let n = got.len().min(want.len());
    let bad = (0..n).find(|&i| !close(got[i], want[i], tol));
    Check {
        what: what.into(),
        ok: bad.is_none() && n > 0,
        detail: match bad {
            Some(i) => format!("step {i}: {}, expected {}", got[i], want[i]),
            None => format!("{n} losses"),
        },
    }
}
