//! Iteration spaces an op's rules build from its node ([`NodeCx`]): whole, batch-only and
//! element-wise-like ([`pointwise`]).

use crate::graph::Value;
use crate::layout::{DimKind, DimRole, IterDim, IterSpace, par};

use super::NodeCx;

impl IterSpace {
    /// A space with no splittable dims: the op runs whole on each device.
    pub fn whole(cx: &NodeCx<'_>) -> IterSpace {
        let node = cx.g.node(cx.n);
        IterSpace {
            dims: Vec::new(),
            inputs: node.inputs().iter().map(|i| i.map(|v| vec![None; cx.rank(v)])).collect(),
            outputs: (0..node.num_outputs()).map(|s| vec![None; cx.rank(cx.output(s))]).collect(),
        }
    }
}

impl IterSpace {
    /// A gradient op split along the batch only: one iteration dim `n`, dim 0 of the inputs
    /// in `batched` and of the outputs in `per_sample`. The other outputs (a weight's
    /// gradient) sum over the batch, so `n` is then a reduction dim (partial sums under a
    /// split); the other inputs are read whole. Whole when the batch is 1 or the inputs
    /// disagree on it.
    pub fn batch(cx: &NodeCx<'_>, batched: &[usize], per_sample: &[usize]) -> IterSpace {
        let node = cx.g.node(cx.n);
        let sizes: Vec<i64> = batched.iter().filter_map(|&i| cx.in_dims(i).first().copied()).collect();
        let per_sample_ok =
            per_sample.iter().filter(|&&s| s < node.num_outputs()).all(|&s| cx.out_dims(s).first() == sizes.first());
        let Some(&b) = sizes.first() else { return IterSpace::whole(cx) };
        if b <= 1 || sizes.len() != batched.len() || sizes.iter().any(|&x| x != b) || !per_sample_ok {
            return IterSpace::whole(cx);
        }
        let reduces = (0..node.num_outputs()).any(|s| !per_sample.contains(&s));
        let kind = if reduces { DimKind::Reduction } else { DimKind::Parallel };
        let lead =
            |rank: usize, on: bool| -> Vec<Option<usize>> { (0..rank).map(|t| (on && t == 0).then_some(0)).collect() };
        IterSpace {
            dims: vec![IterDim { name: "n".into(), size: b, kind, role: DimRole::Other }],
            inputs: node
                .inputs()
                .iter()
                .enumerate()
                .map(|(j, i)| i.map(|v| lead(cx.rank(v), batched.contains(&j))))
                .collect(),
            outputs: (0..node.num_outputs()).map(|s| lead(cx.rank(cx.output(s)), per_sample.contains(&s))).collect(),
        }
    }
}

/// Element-wise-like spaces: the iteration dims are the output's; inputs map where sizes
/// agree (right-aligned numpy broadcasting). `fixed` dims cannot split, `stat` dims are
/// statistics of `stat_values` values each.
pub fn pointwise(cx: &NodeCx<'_>, fixed: &[usize], stat: &[usize], stat_values: i64) -> IterSpace {
    let node = cx.g.node(cx.n);
    let out = cx.out_dims(0);
    let r = out.len();
    let mut space_dims: Vec<IterDim> = out.iter().enumerate().map(|(i, &s)| par(format!("d{i}"), s)).collect();
    for &f in fixed {
        if f < r {
            space_dims[f].kind = DimKind::Fixed;
        }
    }
    for &s in stat {
        if s < r {
            space_dims[s].kind = DimKind::Statistic { values: stat_values };
        }
    }
    let map = |v: Option<Value>| -> Option<Vec<Option<usize>>> {
        let v = v?;
        let d = cx.dims(Some(v));
        if d.len() > r {
            return Some(vec![None; d.len()]);
        }
        Some(
            d.iter()
                .enumerate()
                .map(|(t, &sz)| {
                    let i = t + r - d.len();
                    (sz == out[i] && sz != 1).then_some(i)
                })
                .collect(),
        )
    };
    let inputs = node.inputs().iter().map(|i| map(*i)).collect();
    let outputs = (0..node.num_outputs())
        .map(|s| {
            let d = cx.out_dims(s);
            if d.len() == r { (0..r).map(|i| (out[i] != 1).then_some(i)).collect() } else { vec![None; d.len()] }
        })
        .collect();
    IterSpace { dims: space_dims, inputs, outputs }
}
