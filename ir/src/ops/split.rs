//! How an op runs under a strategy: what the lowering emits around it and what the cost
//! model prices for it — one decision for both.
//!
//! [`split_mode`] reads the op's [`Sharded`] rule and the split iteration dims and returns
//! the [`SplitMode`], or why the split cannot be expressed (the search then never proposes
//! it: [`crate::shard::strategy_valid`] rejects it).

use crate::graph::op::Op;
use crate::graph::{Graph, Node, NodeId};
use crate::layout::Halo;
use crate::layout::{DimKind, DimRole, IterSpace, Mesh};
use crate::types::TensorType;

use super::Sharded;
use super::conv::Window;

/// One spatial dim of a windowed op split over a mesh axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpatialSplit {
    /// The input tensor dim (2.. for NCHW).
    pub tensor_dim: usize,
    /// The mesh axis.
    pub axis: usize,
    /// The spatial index (`tensor_dim − 2`).
    pub spatial: usize,
    /// The halo of each member along the axis, by coordinate.
    pub halos: Vec<Halo>,
}

/// How an op computes its piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SplitMode {
    /// From its inputs' pieces (shape literals made local; a split reduction leaves partial
    /// sums, its bias kept once, means rescaled).
    Direct,
    /// A split window: rows exchanged with the neighbours first.
    Halo(Vec<SpatialSplit>),
    /// Softmax over split dims: the row maximum and the row sum are all-reduced (forward);
    /// the row sum of `dy·y` (backward).
    Softmax {
        /// Log-softmax.
        log: bool,
        /// The statistic iteration dims.
        axes: Vec<usize>,
    },
    /// Layer normalization over split dims: the sum and the sum of squares are all-reduced
    /// (forward); two row sums (backward).
    LayerNorm {
        /// The first normalized dim.
        axis: usize,
    },
    /// An embedding split by rows: each device gathers the rows it holds, as partial sums.
    VocabGather,
    /// A mixture of experts split by experts: the ids (input `ids`) shifted by the device's
    /// first expert, read from the layout of input `weight` (experts in its dim 0).
    Experts {
        /// The ids' input slot.
        ids: usize,
        /// An expert weight's input slot.
        weight: usize,
    },
    /// A mixture of experts (or its gradient) with its tokens and experts at once (role
    /// `Dispatch`) split over mesh axis `axis`: the all-to-all token dispatcher. Each device
    /// routes its tokens' pairs into buffers of `capacity` rows per device of the axis
    /// (`MoERoute`), sends each device its rows by one all-to-all, runs its experts on the
    /// rows it receives and sends the outputs back by another; codegen/src/lower/experts.rs.
    Dispatch {
        /// The mesh axis of the all-to-alls.
        axis: usize,
        /// Buffer rows per device of the axis ([`super::experts::dispatch_capacity`]).
        capacity: usize,
    },
    /// Attention or its gradient with its sequence (role `Sequence`) split over mesh axis
    /// `axis`: ring attention. The keys and values pass around the axis's devices block by
    /// block (`AttentionBlock` merges each into the running output); the gradient first
    /// rings the keys and values for each row's log-sum-exp, then again with the keys' and
    /// values' gradients travelling beside them (`AttentionGrad` per block), back to their
    /// owner.
    Ring {
        /// The mesh axis of the ring.
        axis: usize,
    },
    /// Training-mode batch normalization over split statistic dims: the per-channel sum and
    /// sum of squares are all-reduced (forward); the gradient recomputes them and all-reduces
    /// the two sums of `dy` and `dy·x̂` too.
    BatchNorm {
        /// The statistic iteration dims (the batch and spatial dims).
        stat: Vec<usize>,
        /// The gradient op (`BatchNormGrad`).
        grad: bool,
    },
    /// A mean loss over split samples (or its gradient): the local sum of the terms over the
    /// count of the samples not ignored (partial sums of the mean) — all-reduced (one scalar)
    /// when the op has an `ignore_index`, else the labels' global size.
    Loss {
        /// The op's `ignore_index`.
        ignore_index: Option<i64>,
    },
}

impl SplitMode {
    /// All-reduces of statistics, forward and backward, for the statistic modes.
    pub fn stat_all_reduces(&self) -> (usize, usize) {
        match self {
            SplitMode::Softmax { .. } => (2, 1),
            SplitMode::LayerNorm { .. } => (2, 2),
            SplitMode::BatchNorm { grad: false, .. } => (2, 4),
            SplitMode::BatchNorm { grad: true, .. } => (4, 0),
            SplitMode::Loss { ignore_index: Some(_) } => (1, 1),
            _ => (0, 0),
        }
    }
}

/// The kernels a mode's local computation runs (the lowering's expansion of a statistic
/// split into reductions, all-reduces and element-wise ops, the op itself included), for the
/// cost model: launches, and the bytes they move in units of the local size of the op's main
/// tensor (the batch normalization's input, the loss's scores; kernels over per-channel
/// vectors, labels and scalars count as launches only). The lowering test
/// `split_statistics_run_the_kernels_their_modes_state` counts the lowered ops against it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Expansion {
    /// Ops launched (views and communication not counted).
    pub launches: usize,
    /// Reads and writes of tensors of the main tensor's local size, in multiples of it.
    pub passes: usize,
}

impl SplitMode {
    /// The expansion of node `node` in this mode and of its gradient in the same mode (for
    /// a forward op), for the modes that run as several ops where one device runs one:
    /// training-mode batch normalization over split statistics (sums, all-reduces, centring,
    /// normalization and the running statistics each as their own op) and a mean loss over
    /// split samples (the op summing, the count of the samples not ignored, the division).
    pub fn expansion(&self, node: &Node) -> Option<(Expansion, Option<Expansion>)> {
        let named = |k: usize| node.outputs().get(k).is_some_and(|o| !o.name.is_empty());
        match self {
            SplitMode::BatchNorm { grad, .. } => {
                // BatchNormGrad: recompute the mean and deviation (ReduceSum, Sub, Mul,
                // ReduceSum, Div over x; Mul, Mul, Add, Sqrt per channel), the sums of dy and
                // dy·x̂ (ReduceSum, Mul, ReduceSum), then dx (Mul, Sub, Sub, Mul over x; Mul,
                // Mul, Div per channel) unless nothing reads it.
                let bn_grad = |dx: bool| {
                    if dx {
                        Expansion { launches: 5 + 4 + 3 + 4 + 3, passes: 8 + 5 + 9 }
                    } else {
                        Expansion { launches: 5 + 4 + 3, passes: 8 + 5 }
                    }
                };
                if *grad {
                    return Some((bn_grad(named(0)), None));
                }
                // Mean and deviation as above, then scale and bias (Mul, Add over x), and per
                // running statistic kept: Mul, Mul, Add per channel.
                let running = (1..3).filter(|&k| named(k)).count();
                Some((Expansion { launches: 5 + 4 + 2 + 3 * running, passes: 8 + 4 }, Some(bn_grad(true))))
            }
            SplitMode::Loss { ignore_index } => {
                // The count of the samples not ignored: Equal, Not, Cast, ReduceSum over the
                // labels (a constant without an ignore_index).
                let count = if ignore_index.is_some() { 4 } else { 0 };
                // The op (reading the scores; the gradient writes dScores too), then the
                // division by the count (of the loss: a scalar; of dScores: a pass over it).
                let grad = Expansion { launches: count + 2, passes: 2 + 2 };
                match &node.op {
                    Op::SoftmaxCrossEntropyLossGrad(_) | Op::NegativeLogLikelihoodLossGrad(_) => Some((grad, None)),
                    _ => Some((Expansion { launches: count + 2, passes: 1 + usize::from(named(1)) }, Some(grad))),
                }
            }
            _ => None,
        }
    }

    /// The input whose local size [`Expansion::passes`] counts in.
    pub fn main_input(node: &Node) -> usize {
        match &node.op {
            Op::SoftmaxCrossEntropyLossGrad(_) | Op::NegativeLogLikelihoodLossGrad(_) => 1,
            _ => 0,
        }
    }
}

/// The input of an op that holds a shape literal (Reshape/Expand shape, Resize sizes).
pub fn shape_input(node: &Node) -> Option<usize> {
    match node.op {
        Op::Reshape(_) | Op::Expand(_) => Some(1),
        Op::Resize(_) if node.input(3).is_some() => Some(3),
        _ => None,
    }
}

/// The attribute in which an op bakes its output's shape (a gradient op's `input_shape` or
/// `shape`), which lowering sets to the shape of the device's piece.
pub fn output_shape_attr(op: &mut Op) -> Option<&mut Option<Vec<i64>>> {
    match op {
        Op::ConvGradInput(o) => Some(&mut o.input_shape),
        Op::AveragePoolGrad(o) => Some(&mut o.input_shape),
        Op::SliceGrad(o) => Some(&mut o.shape),
        Op::GatherGrad(o) => Some(&mut o.shape),
        _ => None,
    }
}

/// The window of a convolution or pooling node: the input's spatial extents, the geometry
/// and `ceil_mode`.
pub fn window_of(g: &Graph, n: NodeId) -> Option<(Vec<usize>, Window, bool)> {
    let node = g.node(n);
    let x = g.tensor_type(node.input(0)?)?.static_dims()?;
    let spatial: Vec<usize> = x.get(2..)?.iter().map(|&d| d.max(0) as usize).collect();
    let (kernel, strides, dil, pads, auto_pad, ceil) = match &node.op {
        Op::Conv(c) => {
            let w = g.tensor_type(node.input(1)?).and_then(TensorType::static_dims)?;
            (
                c.kernel_shape.clone().unwrap_or_else(|| w[2..].to_vec()),
                c.strides.clone(),
                c.dilations.clone(),
                c.pads.clone(),
                c.auto_pad().to_string(),
                false,
            )
        }
        op => {
            let a = op.pool_attrs()?;
            (
                a.kernel_shape?.to_vec(),
                a.strides.map(<[i64]>::to_vec),
                a.dilations.map(<[i64]>::to_vec),
                a.pads.map(<[i64]>::to_vec),
                a.auto_pad.to_string(),
                a.ceil_mode,
            )
        }
    };
    let w =
        super::conv::window(&spatial, &kernel, strides.as_deref(), dil.as_deref(), pads.as_deref(), &auto_pad, ceil)
            .ok()?;
    Some((spatial, w, ceil))
}

/// The halos of a windowed op under strategy `s`, per split spatial dim.
fn spatial_splits(
    g: &Graph,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    mesh: &Mesh,
) -> Result<Vec<SpatialSplit>, String> {
    let node = g.node(n);
    let (spatial, w, ceil) = window_of(g, n).ok_or("window geometry unknown")?;
    if ceil && matches!(&node.op, Op::AveragePool(p) if p.count_include_pad() != 0) {
        return Err("ceil_mode with count_include_pad".into());
    }
    let xmap = sp.inputs.first().and_then(Option::as_ref).ok_or("no input map")?;
    let mut out = Vec::new();
    for (a, d) in s.iter().enumerate() {
        let Some(i) = d else { continue };
        let DimKind::Spatial { .. } = sp.dims[*i].kind else { continue };
        let t = xmap.iter().position(|m| *m == Some(*i)).ok_or("split spatial dim not in the input")?;
        let k = t.checked_sub(2).ok_or("a spatial dim before the channels")?;
        let span = (w.kernel[k] - 1) * w.dilations[k] + 1;
        let p = mesh.axes[a].size;
        let halos = (0..p)
            .map(|c| crate::layout::halo(spatial[k], w.out[k], p, c, w.strides[k], span, w.pad_begin[k]))
            .collect::<Result<Vec<_>, _>>()?;
        out.push(SpatialSplit { tensor_dim: t, axis: a, spatial: k, halos });
    }
    Ok(out)
}

/// How node `n` computes under strategy `s` on `mesh`, or why it cannot run split so.
pub fn split_mode(g: &Graph, n: NodeId, sp: &IterSpace, s: &[Option<usize>], mesh: &Mesh) -> Result<SplitMode, String> {
    let node = g.node(n);
    // An axis of one device splits nothing: the op runs as on one device.
    let split: Vec<usize> = s
        .iter()
        .enumerate()
        .filter(|(a, _)| mesh.axes.get(*a).is_none_or(|x| x.size > 1))
        .filter_map(|(_, d)| *d)
        .collect();
    if split.is_empty() {
        return Ok(SplitMode::Direct);
    }
    let has = |f: &dyn Fn(&DimKind) -> bool| split.iter().any(|&i| sp.dims.get(i).is_some_and(|d| f(&d.kind)));
    let sharded = node.op.rules().sharded();
    if sharded == Sharded::Whole {
        return Err("control flow and communication ops run whole".into());
    }
    if has(&|k| matches!(k, DimKind::Spatial { .. })) {
        return match sharded {
            Sharded::Window => spatial_splits(g, n, sp, s, mesh).map(SplitMode::Halo),
            _ => Err("this op's window cannot split".into()),
        };
    }
    if has(&|k| matches!(k, DimKind::Statistic { .. })) {
        let stats_wanted = node.outputs().get(1..).is_some_and(|o| o.iter().any(|o| !o.name.is_empty()));
        return match sharded {
            Sharded::Softmax { log } => Ok(SplitMode::Softmax {
                log,
                axes: (0..sp.dims.len()).filter(|&i| matches!(sp.dims[i].kind, DimKind::Statistic { .. })).collect(),
            }),
            Sharded::LayerNorm if !stats_wanted => {
                let Op::LayerNormalization(l) = &node.op else { return Err("not a layer normalization".into()) };
                let r = sp.dims.len() as i64;
                let a = l.axis();
                Ok(SplitMode::LayerNorm { axis: (if a < 0 { a + r } else { a }) as usize })
            }
            Sharded::StoredStatistics if !stats_wanted => Ok(SplitMode::Direct),
            Sharded::BatchNorm => Ok(SplitMode::BatchNorm {
                stat: (0..sp.dims.len()).filter(|&i| matches!(sp.dims[i].kind, DimKind::Statistic { .. })).collect(),
                grad: matches!(node.op, Op::BatchNormGrad(_)),
            }),
            _ => Err("its statistics cannot split".into()),
        };
    }
    if sharded == Sharded::Loss {
        let ignore_index = match &node.op {
            Op::SoftmaxCrossEntropyLoss(o) => o.ignore_index,
            Op::NegativeLogLikelihoodLoss(o) => o.ignore_index,
            Op::SoftmaxCrossEntropyLossGrad(o) => o.ignore_index,
            Op::NegativeLogLikelihoodLossGrad(o) => o.ignore_index,
            _ => return Err("not a loss".into()),
        };
        return Ok(SplitMode::Loss { ignore_index });
    }
    if sharded == Sharded::VocabGather && split.iter().any(|&i| sp.dims[i].role == DimRole::Vocab) {
        return Ok(SplitMode::VocabGather);
    }
    if sharded == Sharded::Experts
        && let Some(x) = sp.dims.iter().position(|d| d.role == DimRole::Dispatch)
        && split.contains(&x)
    {
        return super::experts::dispatch_mode(g, n, sp, s, mesh, x);
    }
    if sharded == Sharded::Experts && split.iter().any(|&i| sp.dims[i].role == DimRole::Expert) {
        return Ok(match node.op {
            Op::MoEGrad(_) => SplitMode::Experts { ids: 2, weight: 4 },
            _ => SplitMode::Experts { ids: 1, weight: 3 },
        });
    }
    if sharded == Sharded::Ring
        && let Some(seq) = sp.dims.iter().position(|d| d.role == DimRole::Sequence)
        && split.contains(&seq)
    {
        let axes: Vec<usize> = (0..s.len()).filter(|&a| s[a] == Some(seq) && mesh.axes[a].size > 1).collect();
        return match axes[..] {
            [axis] => Ok(SplitMode::Ring { axis }),
            _ => Err("ring attention runs over one mesh axis".into()),
        };
    }
    if let Some(j) = shape_input(node)
        && node.input(j).is_some_and(|v| !matches!(g.node(v.node).op, Op::Initializer(_) | Op::Constant(_)))
    {
        return Err("its shape input is not a constant".into());
    }
    Ok(SplitMode::Direct)
}
