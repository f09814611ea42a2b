//! Device meshes, shardings and the iteration spaces of ops.
//!
//! A [`Mesh`] is an n-dimensional array of devices whose axes carry a link level (inside a
//! node, across nodes). A tensor's [`Sharding`] says, per mesh axis, whether it is split along
//! one of its dims ([`AxisShard::Split`]), replicated, or held as partial sums awaiting a
//! reduction. An op's [`IterSpace`] names its iteration dims (PaSE's view: a GEMM has m, n, k)
//! and maps each tensor dim of its inputs and outputs onto them; an [`OpStrategy`] picks, per
//! mesh axis, the iteration dim split over it. From those two follow the shardings the op
//! needs on its inputs and produces on its outputs.

use serde::{Deserialize, Serialize};

use crate::graph::{Graph, NodeId, Value};
use crate::ops::NodeCx;
use crate::types::TensorType;

/// Which level of the machine's link hierarchy a mesh axis spans.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkLevel {
    /// Devices of one node (NVLink, PCIe).
    Intra,
    /// Devices in different nodes (InfiniBand, Ethernet).
    Inter,
}

/// One axis of a device mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshAxis {
    /// Its name (`gpus`, `nodes`).
    pub name: String,
    /// Number of devices along it.
    pub size: usize,
    /// The links it spans.
    pub level: LinkLevel,
}

/// A logical array of devices. Device `k` has coordinates `k` in row-major order over the
/// axes (the last axis varies fastest and is the one inside a node).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    /// The axes, outermost first.
    pub axes: Vec<MeshAxis>,
}

impl Mesh {
    /// A one-axis mesh.
    pub fn line(size: usize, level: LinkLevel) -> Mesh {
        Mesh {
            axes: vec![MeshAxis {
                name: if level == LinkLevel::Intra { "gpus".into() } else { "nodes".into() },
                size,
                level,
            }],
        }
    }

    /// Number of devices.
    pub fn devices(&self) -> usize {
        self.axes.iter().map(|a| a.size).product()
    }

    /// Coordinates of device `k`.
    pub fn coords(&self, k: usize) -> Vec<usize> {
        let mut c = vec![0; self.axes.len()];
        let mut r = k;
        for (i, a) in self.axes.iter().enumerate().rev() {
            c[i] = r % a.size;
            r /= a.size;
        }
        c
    }

    /// The device at coordinates `c`.
    pub fn device(&self, c: &[usize]) -> usize {
        self.axes.iter().zip(c).fold(0, |acc, (a, &x)| acc * a.size + x)
    }

    /// The devices that differ from device `k` only along `axis` (its group on that axis), in
    /// axis order.
    pub fn group(&self, k: usize, axis: usize) -> Vec<usize> {
        let mut c = self.coords(k);
        (0..self.axes[axis].size)
            .map(|x| {
                c[axis] = x;
                self.device(&c)
            })
            .collect()
    }
}

/// How a tensor is laid out along one mesh axis.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AxisShard {
    /// Every device on the axis holds the whole (per other axes) tensor.
    #[serde(rename = "R")]
    Replicate,
    /// Split along tensor dim `d` into equal contiguous parts, in axis order.
    #[serde(rename = "S")]
    Split(u8),
    /// Every device holds a partial sum; the tensor is their sum.
    #[serde(rename = "P")]
    Partial,
}

impl std::fmt::Display for AxisShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AxisShard::Replicate => f.write_str("R"),
            AxisShard::Split(d) => write!(f, "S({d})"),
            AxisShard::Partial => f.write_str("P"),
        }
    }
}

/// A tensor's layout on a mesh: one entry per mesh axis.
pub type Sharding = Vec<AxisShard>;

/// Writes a sharding as `[S(0), R]`.
pub fn sharding_to_string(s: &[AxisShard]) -> String {
    let parts: Vec<String> = s.iter().map(|a| a.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// Parses `[S(0), R, P]` (as printed by [`sharding_to_string`]).
pub fn parse_sharding(s: &str) -> Option<Sharding> {
    let inner = s.trim().strip_prefix('[')?.strip_suffix(']')?;
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    inner
        .split(',')
        .map(|p| {
            let p = p.trim();
            match p {
                "R" => Some(AxisShard::Replicate),
                "P" => Some(AxisShard::Partial),
                _ => p.strip_prefix("S(")?.strip_suffix(')')?.trim().parse().ok().map(AxisShard::Split),
            }
        })
        .collect()
}

/// The size of the local piece of a tensor of dims `dims` under `s` on `mesh`.
pub fn local_dims(dims: &[i64], s: &[AxisShard], mesh: &Mesh) -> Vec<i64> {
    let mut out = dims.to_vec();
    for (a, sh) in s.iter().enumerate() {
        if let AxisShard::Split(d) = sh
            && let Some(x) = out.get_mut(*d as usize)
        {
            *x /= mesh.axes[a].size as i64;
        }
    }
    out
}

/// What an iteration dim is, for rules that need to know (halo, partial sums).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DimKind {
    /// Independent slices: splitting it needs no communication inside the op.
    Parallel,
    /// Summed over: splitting it leaves the outputs as partial sums.
    Reduction,
    /// An output spatial dim of a windowed op: splitting it needs `halo` input elements from
    /// each neighbour (forward), and as many gradient elements back (backward).
    Spatial {
        /// Input elements needed beyond the local block, (before, after).
        halo: (i64, i64),
        /// Input elements per output element along the dim (the stride).
        stride: i64,
    },
    /// A dim statistics are computed over (normalization, softmax): splitting it needs a small
    /// all-reduce of the statistics, forward and backward.
    Statistic {
        /// Statistic values per slice of the other dims (e.g. 2 for mean and variance).
        values: i64,
    },
    /// Cannot be split (a recurrence, a window over a kernel, a gathered axis).
    Fixed,
    /// No extent: the op is a sum of its inputs (`Add`, `Sub`, `Sum`), so on partial sums of
    /// every input it computes partial sums of the output. "Splitting" it over a mesh axis
    /// reads each input, and leaves each output, as partial sums on that axis; each device
    /// does the whole op's work. A gradient summed from several readers of a parameter then
    /// waits to be synchronised once, after the sum, rather than once per reader.
    Linear,
}

/// What an iteration dim means, for strategies that choose by meaning.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DimRole {
    /// Derived from the batch (set by the caller from a batch analysis).
    Batch,
    /// A spatial dim of a convolution or pooling.
    Spatial,
    /// The output features of a weighted op (GEMM columns, conv filters).
    OutFeature,
    /// The input features of a weighted op (GEMM rows, conv channels): a reduction.
    InFeature,
    /// The rows of an embedding table.
    Vocab,
    /// The experts of a mixture of experts.
    Expert,
    /// The sequence of an attention's queries, keys and values at once: a split runs as ring
    /// attention (the keys and values passed around the devices).
    Sequence,
    /// A mixture of experts' tokens and experts at once: a split divides both — each device
    /// holds its tokens and its experts — and runs as the all-to-all token dispatcher (the
    /// tokens sent to the devices holding their experts and their outputs sent back). Every
    /// tensor of the op that follows another iteration dim follows this one too
    /// ([`follows`]).
    Dispatch,
    /// Anything else.
    Other,
}

/// One iteration dim of an op.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IterDim {
    /// A short name (`m`, `n`, `k`, `b`, `h`, `d0`…).
    pub name: String,
    /// Extent.
    pub size: i64,
    /// How splitting it behaves.
    pub kind: DimKind,
    /// What it means.
    pub role: DimRole,
}

/// An op's iteration dims and how its tensors' dims map onto them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IterSpace {
    /// The iteration dims.
    pub dims: Vec<IterDim>,
    /// Per input (in op order, `None` for an omitted one), per tensor dim: the iteration dim
    /// it follows (`None`: the input is whole along that dim, e.g. a broadcast 1).
    pub inputs: Vec<Option<Vec<Option<usize>>>>,
    /// Per output, per tensor dim: the iteration dim it follows.
    pub outputs: Vec<Vec<Option<usize>>>,
}

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

/// Per mesh axis, the iteration dim split over it (`None`: not split, computed redundantly).
pub type OpStrategy = Vec<Option<usize>>;

fn dims(g: &Graph, v: Option<Value>) -> Vec<i64> {
    v.and_then(|v| g.tensor_type(v)).and_then(TensorType::static_dims).unwrap_or_default()
}

/// The extent-less dim of an op that sums its inputs ([`DimKind::Linear`]), named `sum`.
pub fn linear() -> IterDim {
    IterDim { name: "sum".into(), size: 1, kind: DimKind::Linear, role: DimRole::Other }
}

/// A parallel iteration dim with no particular meaning.
pub fn par(name: impl Into<String>, size: i64) -> IterDim {
    IterDim { name: name.into(), size, kind: DimKind::Parallel, role: DimRole::Other }
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

/// The iteration space of node `n` (see [`crate::ops::OpRules::space`]); shapes must be
/// inferred and static, otherwise the op is treated as whole, as is an op without a rule.
pub fn iter_space(g: &Graph, n: NodeId) -> IterSpace {
    let cx = NodeCx { g, n };
    if !crate::ops::static_node(g, n) {
        return IterSpace::whole(&cx);
    }
    g.node(n).op.rules().space(&cx).unwrap_or_else(|| IterSpace::whole(&cx))
}

/// Maps input dims of a reshape onto output dims: within each group of dims whose products
/// agree, the outermost input dim maps to the outermost output dim (a split of both into the
/// same number of contiguous blocks is the same split).
pub fn reshape_map(input: &[i64], output: &[i64]) -> Vec<Option<usize>> {
    let mut m = vec![None; input.len()];
    let (mut i, mut j) = (0, 0);
    while i < input.len() && j < output.len() {
        while i < input.len() && input[i] == 1 {
            i += 1;
        }
        while j < output.len() && output[j] == 1 {
            j += 1;
        }
        if i >= input.len() || j >= output.len() {
            break;
        }
        let (si, sj) = (i, j);
        let (mut pi, mut pj) = (input[i], output[j]);
        i += 1;
        j += 1;
        while pi != pj {
            if pi < pj && i < input.len() {
                pi *= input[i];
                i += 1;
            } else if pj < pi && j < output.len() {
                pj *= output[j];
                j += 1;
            } else {
                return m;
            }
        }
        m[si] = Some(sj);
    }
    m
}

/// Whether a tensor dim that follows iteration dim `m` is split by a split of iteration dim
/// `i`: `m` is `i`, or `i` is a [`DimRole::Dispatch`] dim, which splits every tensor dim that
/// follows another iteration dim of its op.
pub fn follows(space: &IterSpace, m: Option<usize>, i: usize) -> bool {
    m == Some(i)
        || space.dims.get(i).is_some_and(|d| d.role == DimRole::Dispatch)
            && m.is_some_and(|j| space.dims.get(j).is_some_and(|d| d.role != DimRole::Dispatch))
}

/// The shardings an op strategy needs on each input (per mesh axis) and produces on each
/// output. `None` for an omitted input.
pub fn strategy_shardings(space: &IterSpace, strategy: &[Option<usize>]) -> (Vec<Option<Sharding>>, Vec<Sharding>) {
    let shard_of = |map: &[Option<usize>], on_missing: AxisShard| -> Sharding {
        strategy
            .iter()
            .map(|s| match s {
                None => AxisShard::Replicate,
                Some(i) => match map.iter().position(|m| follows(space, *m, *i)) {
                    Some(t) => AxisShard::Split(t as u8),
                    None => on_missing,
                },
            })
            .collect()
    };
    let inputs = space
        .inputs
        .iter()
        .map(|m| {
            m.as_ref().map(|m| {
                let mut sh = shard_of(m, AxisShard::Replicate);
                for (a, s) in strategy.iter().enumerate() {
                    if s.is_some_and(|i| space.dims[i].kind == DimKind::Linear) {
                        sh[a] = AxisShard::Partial;
                    }
                }
                sh
            })
        })
        .collect();
    let outputs = space
        .outputs
        .iter()
        .map(|m| {
            strategy
                .iter()
                .map(|s| match s {
                    None => AxisShard::Replicate,
                    Some(i) => match m.iter().position(|x| follows(space, *x, *i)) {
                        Some(t) => AxisShard::Split(t as u8),
                        None if matches!(space.dims[*i].kind, DimKind::Reduction | DimKind::Linear) => {
                            AxisShard::Partial
                        }
                        // A dim the output does not have but is not summed over: every device
                        // computes the same output (e.g. a statistic).
                        None => AxisShard::Replicate,
                    },
                })
                .collect()
        })
        .collect();
    (inputs, outputs)
}

/// True when `strategy` is admissible for `space` on `mesh`: split dims are splittable,
/// distinct, and divide evenly (the iteration dim and every tensor dim that follows it).
pub fn strategy_valid(space: &IterSpace, strategy: &[Option<usize>], mesh: &Mesh, g: &Graph, n: NodeId) -> bool {
    let mut factor: std::collections::HashMap<usize, i64> = std::collections::HashMap::new();
    for (a, s) in strategy.iter().enumerate() {
        if let Some(i) = s {
            let Some(d) = space.dims.get(*i) else { return false };
            match d.kind {
                DimKind::Fixed => return false,
                // No extent to divide: partial sums on any axes.
                DimKind::Linear => continue,
                _ => {}
            }
            *factor.entry(*i).or_insert(1) *= mesh.axes[a].size as i64;
        }
    }
    for (&i, &f) in &factor {
        if space.dims[i].size % f != 0 {
            return false;
        }
        // A dim split over several axes must be split by each of them in order; keep one.
        if strategy.iter().filter(|s| **s == Some(i)).count() > 1
            && !matches!(space.dims[i].kind, DimKind::Parallel | DimKind::Reduction)
        {
            return false;
        }
    }
    // Tensor dims that follow a split iteration dim must divide too.
    let node = g.node(n);
    let check = |map: &[Option<usize>], d: &[i64]| {
        map.iter().zip(d).all(|(m, &sz)| m.is_none_or(|i| factor.get(&i).is_none_or(|&f| sz % f == 0)))
    };
    for (j, m) in space.inputs.iter().enumerate() {
        if let (Some(m), Some(v)) = (m, node.input(j))
            && !check(m, &dims(g, Some(v)))
        {
            return false;
        }
    }
    for (s, m) in space.outputs.iter().enumerate() {
        if !check(m, &dims(g, Some(Value::new(n, s as u16)))) {
            return false;
        }
    }
    // Only splits the lowering can express (the cost model prices the same mode).
    crate::ops::split::split_mode(g, n, space, strategy, mesh).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_coordinates() {
        let m = Mesh {
            axes: vec![
                MeshAxis { name: "nodes".into(), size: 2, level: LinkLevel::Inter },
                MeshAxis { name: "gpus".into(), size: 4, level: LinkLevel::Intra },
            ],
        };
        assert_eq!(m.devices(), 8);
        assert_eq!(m.coords(6), vec![1, 2]);
        assert_eq!(m.device(&[1, 2]), 6);
        assert_eq!(m.group(6, 1), vec![4, 5, 6, 7]);
        assert_eq!(m.group(6, 0), vec![2, 6]);
    }

    #[test]
    fn reshape_maps_outer_dims_of_groups() {
        assert_eq!(reshape_map(&[1, 128, 768], &[128, 768]), vec![None, Some(0), Some(1)]);
        assert_eq!(reshape_map(&[8, 128, 768], &[1024, 768]), vec![Some(0), None, Some(1)]);
        assert_eq!(reshape_map(&[8, 128, 768], &[8, 128, 12, 64]), vec![Some(0), Some(1), Some(2)]);
    }

    /// A sum's extent-less dim reads partial sums and leaves them (`Σᵢ aᵢ + Σᵢ bᵢ = Σᵢ (aᵢ + bᵢ)`),
    /// beside a split of its dims on another axis, on any axis size.
    #[test]
    fn a_sums_linear_dim_keeps_partial_sums() {
        // `y[4, 6] = a[4, 6] + b[6]`: dims d0, d1, then the linear dim.
        let space = IterSpace {
            dims: vec![par("d0", 4), par("d1", 6), linear()],
            inputs: vec![Some(vec![Some(0), Some(1)]), Some(vec![Some(1)])],
            outputs: vec![vec![Some(0), Some(1)]],
        };
        let (ins, outs) = strategy_shardings(&space, &[Some(2), Some(0)]);
        use AxisShard::{Partial as P, Replicate as R, Split as S};
        assert_eq!(ins, vec![Some(vec![P, S(0)]), Some(vec![P, R])]);
        assert_eq!(outs, vec![vec![P, S(0)]]);
        let (ins, outs) = strategy_shardings(&space, &[Some(2), Some(2)]);
        assert_eq!((ins[0].clone(), outs[0].clone()), (Some(vec![P, P]), vec![P, P]));
    }

    #[test]
    fn shardings_print_and_parse() {
        let s = vec![AxisShard::Split(0), AxisShard::Replicate, AxisShard::Partial];
        assert_eq!(sharding_to_string(&s), "[S(0), R, P]");
        assert_eq!(parse_sharding("[S(0), R, P]"), Some(s));
    }
}
