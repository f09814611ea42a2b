//! What a training graph's loss is a mean over, where that is data: a cross-entropy or
//! negative log-likelihood with `reduction = mean` divides by the number of labels that are
//! not `ignore_index` (or by the sum of the class weights of the labels kept). Split into
//! micro-batches, each micro-batch's mean divides by its own count; the whole batch's mean is
//! the micro-batches' means weighted by their counts, not their plain mean — what gradient
//! accumulation must know ([`CountedLabels::counts`]).

use ir::eval::Array;
use ir::op::Op;
use ir::{Graph, Value};
use serde::Serialize;

/// A loss averaged over the labels it counts.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CountedLabels {
    /// The graph input holding the labels.
    pub input: String,
    /// The label not counted.
    pub ignore_index: Option<i64>,
    /// Per class, its weight in the count (absent: every label counts 1).
    pub class_weights: Option<Vec<f64>>,
    /// The loss is this mean alone (not a sum with other terms, nor several such means).
    pub alone: bool,
}

impl CountedLabels {
    /// The loss `loss` of `g` as a mean over counted labels, where it is one: `None` where
    /// the loss divides by no data-dependent count.
    pub fn of(g: &Graph, loss: Value) -> Option<CountedLabels> {
        let order = g.op_nodes().ok()?;
        let means: Vec<ir::NodeId> = order.into_iter().filter(|&n| counts_labels(&g.node(n).op, g, n)).collect();
        let &first = means.first()?;
        let node = g.node(first);
        let input = source_input(g, node.input(1)?)?;
        let class_weights = match node.input(2) {
            None => None,
            Some(w) => Some(Array::from_tensor(g.initializer(w)?).ok()?.to_f64().ok()?),
        };
        let ignore_index = match &node.op {
            Op::SoftmaxCrossEntropyLoss(l) => l.ignore_index,
            Op::NegativeLogLikelihoodLoss(l) => l.ignore_index,
            _ => None,
        };
        let alone = means.len() == 1 && reshaped_from(g, loss) == Value::new(first, 0);
        Some(CountedLabels { input, ignore_index, class_weights, alone })
    }

    /// Per block of `m` equal blocks of `labels` along `axis`, the count its mean divides
    /// by (the labels not ignored, or their classes' weights summed).
    pub fn counts(&self, labels: &Array, axis: usize, m: usize) -> Result<Vec<f64>, String> {
        let values = labels.to_f64().map_err(|e| e.to_string())?;
        let dims = &labels.shape;
        let n = dims.get(axis).copied().unwrap_or(1);
        let inner: usize = dims.iter().skip(axis + 1).product();
        if m == 0 || n % m != 0 {
            return Err(format!("labels of {n} along dim {axis} do not split into {m} micro-batches"));
        }
        let mut out = vec![0.0; m];
        for (i, &x) in values.iter().enumerate() {
            let label = x as i64;
            if Some(label) == self.ignore_index {
                continue;
            }
            let w = match &self.class_weights {
                Some(cw) => {
                    *cw.get(label.max(0) as usize).ok_or_else(|| format!("label {label} has no class weight"))?
                }
                None => 1.0,
            };
            out[(i / inner.max(1)) % n / (n / m)] += w;
        }
        Ok(out)
    }
}

/// A mean whose divisor depends on the labels: ignored labels or class weights.
fn counts_labels(op: &Op, g: &Graph, n: ir::NodeId) -> bool {
    let (reduction, ignore) = match op {
        Op::SoftmaxCrossEntropyLoss(l) => (&l.reduction, l.ignore_index),
        Op::NegativeLogLikelihoodLoss(l) => (&l.reduction, l.ignore_index),
        _ => return false,
    };
    reduction.as_deref().unwrap_or("mean") == "mean" && (ignore.is_some() || g.node(n).input(2).is_some())
}

/// The graph input `v` is `v` reshaped or cast from.
fn source_input(g: &Graph, v: Value) -> Option<String> {
    let v = reshaped_from(g, v);
    matches!(g.node(v.node).op, Op::Input { default: None }).then(|| g.value_name(v).to_string())
}

/// What `v` is a reshape, cast or copy of (itself where it is none).
fn reshaped_from(g: &Graph, mut v: Value) -> Value {
    while let Op::Identity(_) | Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_) | Op::Cast(_) =
        g.node(v.node).op
    {
        match g.node(v.node).input(0) {
            Some(u) => v = u,
            None => break,
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(shape: Vec<usize>, v: Vec<i64>) -> Array {
        Array::int(ir::DType::Int64, shape, v)
    }

    #[test]
    fn counts_per_block_skip_ignored_labels_and_weigh_classes() {
        let c = CountedLabels { input: "y".into(), ignore_index: Some(-1), class_weights: None, alone: true };
        // [4, 2] split along dim 0 into 2 blocks of 2 rows, and along dim 1 into 2 columns.
        let y = labels(vec![4, 2], vec![0, -1, -1, -1, 1, 1, 2, -1]);
        assert_eq!(c.counts(&y, 0, 2).unwrap(), vec![1.0, 3.0]);
        assert_eq!(c.counts(&y, 1, 2).unwrap(), vec![3.0, 1.0]);
        assert_eq!(c.counts(&y, 0, 4).unwrap(), vec![1.0, 0.0, 2.0, 1.0]);
        let w = CountedLabels { class_weights: Some(vec![0.5, 2.0, 1.0]), ..c.clone() };
        assert_eq!(w.counts(&y, 0, 2).unwrap(), vec![0.5, 5.0]);
        assert!(c.counts(&y, 0, 3).is_err(), "4 rows do not split into 3");
        let bad = labels(vec![2], vec![7, 0]);
        assert!(w.counts(&bad, 0, 2).is_err(), "label 7 has no class weight");
    }

    #[test]
    fn a_mean_over_labels_not_ignored_is_found_through_reshapes() {
        let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
             g (float[2,3,4] s, int64[2,3] y) => (float loss)\n\
             <int64[1] flat = {-1}, int64[2] rows = {-1, 4}>\n\
             { r = Reshape (s, rows)\n t = Reshape (y, flat)\n \
               l = SoftmaxCrossEntropyLoss <ignore_index: int = -100> (r, t)\n loss = Identity (l) }";
        let g = frontend::parse(text).expect("parses").model.graph;
        let loss = g.outputs()[0].value;
        let c = CountedLabels::of(&g, loss).expect("counted");
        assert_eq!((c.input.as_str(), c.ignore_index, c.alone), ("y", Some(-100), true));
    }
}
