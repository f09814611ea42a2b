//! Device meshes, shardings and the iteration spaces of ops: the layout algebra's types.
//!
//! A [`Mesh`] is an n-dimensional array of devices whose axes carry a link level (inside a
//! node, across nodes). A tensor's [`Sharding`] says, per mesh axis, whether it is split along
//! one of its dims ([`AxisShard::Split`]), replicated, or held as partial sums awaiting a
//! reduction. An op's [`IterSpace`] names its iteration dims (PaSE's view: a GEMM has m, n, k)
//! and maps each tensor dim of its inputs and outputs onto them; an [`OpStrategy`] picks, per
//! mesh axis, the iteration dim split over it. From those two follow the shardings the op
//! needs on its inputs and produces on its outputs ([`strategy_shardings`]), and a windowed
//! op's exchange with its neighbours under a spatial split ([`halo`]).
//!
//! This module knows no op and no graph: the ops' rules ([`crate::ops`]) build iteration
//! spaces from it, and [`crate::shard`] applies them to a graph's nodes.

use serde::{Deserialize, Serialize};

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

/// Per mesh axis, the iteration dim split over it (`None`: not split, computed redundantly).
pub type OpStrategy = Vec<Option<usize>>;

/// The extent-less dim of an op that sums its inputs ([`DimKind::Linear`]), named `sum`.
pub fn linear() -> IterDim {
    IterDim { name: "sum".into(), size: 1, kind: DimKind::Linear, role: DimRole::Other }
}

/// A parallel iteration dim with no particular meaning.
pub fn par(name: impl Into<String>, size: i64) -> IterDim {
    IterDim { name: name.into(), size, kind: DimKind::Parallel, role: DimRole::Other }
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

/// What one device exchanges for one spatially split dim of a windowed op (rows along the
/// dim), and how its window is then adjusted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Halo {
    /// Rows received from the previous member.
    pub from_prev: usize,
    /// Rows received from the next member.
    pub from_next: usize,
    /// Rows sent to the previous member.
    pub to_prev: usize,
    /// Rows sent to the next member.
    pub to_next: usize,
    /// Rows of its own block it does not need, at the start.
    pub trim_start: usize,
    /// Rows of its own block it does not need, at the end.
    pub trim_end: usize,
    /// Padding its window needs before (the tensor's border).
    pub pad_before: usize,
    /// Padding its window needs after.
    pub pad_after: usize,
}

/// The halo of member `c` of `p` for a windowed op over a dim of input extent `input` and
/// output extent `output` (both split evenly `p` ways), with `stride`, effective kernel
/// extent `span` (`(k − 1)·dilation + 1`) and leading padding `pad_begin`. An error when
/// the split is uneven or a halo would reach past a neighbour's block.
pub fn halo(
    input: usize,
    output: usize,
    p: usize,
    c: usize,
    stride: usize,
    span: usize,
    pad_begin: usize,
) -> Result<Halo, String> {
    if p == 0 || !output.is_multiple_of(p) || !input.is_multiple_of(p) {
        return Err("uneven spatial split".into());
    }
    let (ol, b) = (output / p, input / p);
    let pb = pad_begin as i64;
    // Input rows member `c`'s outputs read, clipped to the tensor.
    let geom = |c: usize| -> (i64, i64, i64, i64) {
        let need_start = (c * ol * stride) as i64 - pb;
        let need_end = ((c * ol + ol - 1) * stride + span) as i64 - pb;
        (need_start, need_end, need_start.max(0), need_end.min(input as i64))
    };
    let (need_start, need_end, ns, ne) = geom(c);
    let (bs, be) = ((c * b) as i64, (c * b + b) as i64);
    let to_prev = if c > 0 { (geom(c - 1).3 - ((c - 1) * b + b) as i64).max(0) as usize } else { 0 };
    let to_next = if c + 1 < p { (((c + 1) * b) as i64 - geom(c + 1).2).max(0) as usize } else { 0 };
    let h = Halo {
        from_prev: (bs - ns).max(0) as usize,
        from_next: (ne - be).max(0) as usize,
        to_prev,
        to_next,
        trim_start: (ns - bs).max(0) as usize,
        trim_end: (be - ne).max(0) as usize,
        pad_before: (ns - need_start) as usize,
        pad_after: (need_end - ne) as usize,
    };
    if [h.from_prev, h.from_next, h.to_prev, h.to_next].iter().any(|&w| w > b) {
        return Err(format!("halo wider than a neighbour's block ({b})"));
    }
    Ok(h)
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
