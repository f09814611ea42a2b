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
use crate::op::{Op, OpClass};
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
    pub fn whole(g: &Graph, n: NodeId) -> IterSpace {
        let node = g.node(n);
        IterSpace {
            dims: Vec::new(),
            inputs: node.inputs().iter().map(|i| i.map(|v| vec![None; rank(g, v)])).collect(),
            outputs: (0..node.num_outputs()).map(|s| vec![None; rank(g, Value::new(n, s as u16))]).collect(),
        }
    }
}

/// Per mesh axis, the iteration dim split over it (`None`: not split, computed redundantly).
pub type OpStrategy = Vec<Option<usize>>;

fn rank(g: &Graph, v: Value) -> usize {
    g.tensor_type(v).and_then(TensorType::rank).unwrap_or(0)
}

fn dims(g: &Graph, v: Option<Value>) -> Vec<i64> {
    v.and_then(|v| g.tensor_type(v)).and_then(TensorType::static_dims).unwrap_or_default()
}

fn par(name: impl Into<String>, size: i64) -> IterDim {
    IterDim { name: name.into(), size, kind: DimKind::Parallel, role: DimRole::Other }
}

/// Elementwise-like: iteration dims are the output's; inputs map where sizes agree
/// (right-aligned numpy broadcasting).
fn pointwise(g: &Graph, n: NodeId, fixed: &[usize], stat: &[usize], stat_values: i64) -> IterSpace {
    let node = g.node(n);
    let out = dims(g, Some(Value::new(n, 0)));
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
        let d = dims(g, Some(v));
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
            let d = dims(g, Some(Value::new(n, s as u16)));
            if d.len() == r { (0..r).map(|i| (out[i] != 1).then_some(i)).collect() } else { vec![None; d.len()] }
        })
        .collect();
    IterSpace { dims: space_dims, inputs, outputs }
}

fn norm_axis(a: i64, r: usize) -> usize {
    (if a < 0 { a + r as i64 } else { a }).clamp(0, r.max(1) as i64 - 1) as usize
}

/// The iteration space of node `n`; shapes must be inferred and static (otherwise the op is
/// treated as whole).
pub fn iter_space(g: &Graph, n: NodeId) -> IterSpace {
    let node = g.node(n);
    let out_static = (0..node.num_outputs()).all(|s| {
        g.tensor_type(Value::new(n, s as u16)).is_some_and(TensorType::is_static) || node.outputs()[s].name.is_empty()
    });
    let in_static = node.inputs().iter().flatten().all(|&v| g.tensor_type(v).is_some_and(TensorType::is_static));
    if !out_static || !in_static || node.num_outputs() == 0 {
        return IterSpace::whole(g, n);
    }
    let input = |i: usize| node.input(i);
    let out = dims(g, Some(Value::new(n, 0)));
    let r = out.len();
    match &node.op {
        Op::Input { .. }
        | Op::Initializer(_)
        | Op::OuterRef
        | Op::Constant(_)
        | Op::Shape(_)
        | Op::Size(_)
        | Op::ConstantOfShape(_)
        | Op::Range(_)
        | Op::NonZero(_) => IterSpace::whole(g, n),
        Op::Softmax(_) | Op::LogSoftmax(_) => {
            let legacy = g.opset > 0 && g.opset < 13;
            let axis = match &node.op {
                Op::Softmax(s) => s.axis,
                Op::LogSoftmax(s) => s.axis,
                _ => None,
            };
            let a = norm_axis(axis.unwrap_or(if legacy { 1 } else { -1 }), r);
            let stat: Vec<usize> = if legacy { (a..r).collect() } else { vec![a] };
            pointwise(g, n, &[], &stat, 2)
        }
        Op::Hardmax(s) => pointwise(g, n, &[norm_axis(s.axis.unwrap_or(-1), r)], &[], 0),
        Op::LayerNormalization(l) => {
            let a = norm_axis(l.axis(), r);
            let mut sp = pointwise(g, n, &[], &(a..r).collect::<Vec<_>>(), 2);
            // Mean and InvStdDev outputs keep dims before the axis.
            for s in 1..node.num_outputs() {
                sp.outputs[s] = (0..r).map(|i| (i < a && out[i] != 1).then_some(i)).collect();
            }
            // Scale and bias cover the normalized dims.
            for k in 1..3 {
                if let Some(Some(m)) = sp.inputs.get_mut(k) {
                    m.iter_mut().for_each(|x| *x = None);
                }
            }
            sp
        }
        Op::BatchNormalization(_) | Op::InstanceNormalization(_) | Op::GroupNormalization(_) => {
            let stat: Vec<usize> = (2..r).collect();
            let fixed: Vec<usize> = if matches!(node.op, Op::GroupNormalization(_)) { vec![1] } else { vec![] };
            let mut sp = pointwise(g, n, &fixed, &stat, 2);
            // Per-channel parameters follow the channel dim.
            for k in 1..node.inputs().len() {
                if let Some(Some(m)) = sp.inputs.get_mut(k) {
                    *m = vec![(r > 1).then_some(1)];
                }
            }
            for s in 1..node.num_outputs() {
                sp.outputs[s] = vec![(r > 1).then_some(1)];
            }
            if let Some(d) = sp.dims.get_mut(1) {
                d.role = DimRole::Other;
            }
            sp
        }
        Op::LRN(_) => pointwise(g, n, &[1], &[], 0),
        Op::LpNormalization(l) => pointwise(g, n, &[], &[norm_axis(l.axis(), r)], 1),
        Op::MeanVarianceNormalization(m) => {
            let axes: Vec<usize> = m.axes.clone().unwrap_or(vec![0, 2, 3]).iter().map(|&a| norm_axis(a, r)).collect();
            pointwise(g, n, &[], &axes, 2)
        }
        Op::Trilu(_) => pointwise(g, n, &[r.saturating_sub(2), r.saturating_sub(1)], &[], 0),
        Op::CumSum(_) => pointwise(g, n, &(0..r).collect::<Vec<_>>(), &[], 0),
        _ if matches!(node.op.class(), OpClass::Unary | OpClass::Binary | OpClass::Variadic)
            || matches!(node.op, Op::Where(_)) =>
        {
            pointwise(g, n, &[], &[], 0)
        }
        Op::MatMul(_) => {
            let (a, b) = (dims(g, input(0)), dims(g, input(1)));
            if a.len() < 2 || b.len() < 2 {
                return IterSpace::whole(g, n);
            }
            let batch = r - 2;
            let mut sd: Vec<IterDim> = (0..batch).map(|i| par(format!("b{i}"), out[i])).collect();
            sd.push(par("m", out[batch]));
            sd.push(IterDim {
                name: "n".into(),
                size: out[batch + 1],
                kind: DimKind::Parallel,
                role: DimRole::OutFeature,
            });
            sd.push(IterDim {
                name: "k".into(),
                size: a[a.len() - 1],
                kind: DimKind::Reduction,
                role: DimRole::InFeature,
            });
            let (m, nn, k) = (batch, batch + 1, batch + 2);
            let map_batch = |d: &[i64]| -> Vec<Option<usize>> {
                let nb = d.len() - 2;
                (0..nb)
                    .map(|t| {
                        let i = t + batch - nb;
                        (d[t] == out[i] && d[t] != 1).then_some(i)
                    })
                    .collect()
            };
            let mut am = map_batch(&a);
            am.extend([Some(m), Some(k)]);
            let mut bm = map_batch(&b);
            bm.extend([Some(k), Some(nn)]);
            let om: Vec<Option<usize>> = (0..r).map(|i| (out[i] != 1 || i >= batch).then_some(i)).collect();
            IterSpace { dims: sd, inputs: vec![Some(am), Some(bm)], outputs: vec![om] }
        }
        Op::Gemm(gm) => {
            let a = dims(g, input(0));
            if a.len() != 2 || r != 2 {
                return IterSpace::whole(g, n);
            }
            let k_size = if gm.trans_a() != 0 { a[0] } else { a[1] };
            let sd = vec![
                par("m", out[0]),
                IterDim { name: "n".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::OutFeature },
                IterDim { name: "k".into(), size: k_size, kind: DimKind::Reduction, role: DimRole::InFeature },
            ];
            let am = if gm.trans_a() != 0 { vec![Some(2), Some(0)] } else { vec![Some(0), Some(2)] };
            let bm = if gm.trans_b() != 0 { vec![Some(1), Some(2)] } else { vec![Some(2), Some(1)] };
            let cm = input(2).map(|_| {
                let c = dims(g, input(2));
                c.iter()
                    .enumerate()
                    .map(|(t, &sz)| {
                        let i = t + 2 - c.len();
                        (sz == out[i] && sz != 1).then_some(i)
                    })
                    .collect()
            });
            IterSpace { dims: sd, inputs: vec![Some(am), Some(bm), cm], outputs: vec![vec![Some(0), Some(1)]] }
        }
        Op::Conv(c) => {
            let (x, w) = (dims(g, input(0)), dims(g, input(1)));
            if x.len() < 3 || w.len() != x.len() {
                return IterSpace::whole(g, n);
            }
            let k = x.len() - 2;
            let group = c.group();
            let kernel: Vec<i64> = c.kernel_shape.clone().unwrap_or_else(|| w[2..].to_vec());
            let strides = c.strides.clone().unwrap_or(vec![1; k]);
            let dil = c.dilations.clone().unwrap_or(vec![1; k]);
            let mut sd = vec![par("n", out[0])];
            let depthwise = group > 1 && group == x[1] && w[0] == group;
            if group == 1 {
                sd.push(IterDim { name: "m".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::OutFeature });
                sd.push(IterDim { name: "c".into(), size: x[1], kind: DimKind::Reduction, role: DimRole::InFeature });
            } else if depthwise {
                sd.push(IterDim { name: "g".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::Other });
            } else {
                sd.push(IterDim { name: "m".into(), size: out[1], kind: DimKind::Fixed, role: DimRole::Other });
            }
            let sp0 = sd.len();
            for i in 0..k {
                let ext = dil.get(i).copied().unwrap_or(1) * (kernel.get(i).copied().unwrap_or(1) - 1);
                let st = strides.get(i).copied().unwrap_or(1);
                // Output block [o0, o1) reads input [o0*st - pb, (o1-1)*st - pb + ext]:
                // beyond the block's own input rows it needs ext - (st - 1) more rows, split
                // around it by the padding.
                let pb = c.pads.as_ref().map_or(ext / 2, |p| p.get(i).copied().unwrap_or(0));
                let before = pb.min(ext);
                let after = (ext - before - (st - 1)).max(0);
                sd.push(IterDim {
                    name: format!("s{i}"),
                    size: out[2 + i],
                    kind: DimKind::Spatial { halo: (before, after), stride: st },
                    role: DimRole::Spatial,
                });
            }
            let mut xm = vec![
                Some(0),
                if group == 1 {
                    Some(2)
                } else if depthwise {
                    Some(1)
                } else {
                    None
                },
            ];
            xm.extend((0..k).map(|i| Some(sp0 + i)));
            let mut wm =
                vec![if group == 1 || depthwise { Some(1) } else { None }, if group == 1 { Some(2) } else { None }];
            wm.extend(std::iter::repeat_n(None, k));
            let bm = input(2).map(|_| vec![if group == 1 || depthwise { Some(1) } else { None }]);
            let mut om = vec![Some(0), if group == 1 || depthwise { Some(1) } else { None }];
            om.extend((0..k).map(|i| Some(sp0 + i)));
            IterSpace { dims: sd, inputs: vec![Some(xm), Some(wm), bm], outputs: vec![om] }
        }
        Op::ConvTranspose(c) => {
            let (x, w) = (dims(g, input(0)), dims(g, input(1)));
            if x.len() < 3 || c.group() != 1 {
                return IterSpace::whole(g, n);
            }
            let k = x.len() - 2;
            let mut sd = vec![
                par("n", out[0]),
                IterDim { name: "m".into(), size: out[1], kind: DimKind::Parallel, role: DimRole::OutFeature },
                IterDim { name: "c".into(), size: x[1], kind: DimKind::Reduction, role: DimRole::InFeature },
            ];
            sd.extend((0..k).map(|i| IterDim {
                name: format!("s{i}"),
                size: out[2 + i],
                kind: DimKind::Fixed,
                role: DimRole::Spatial,
            }));
            let mut xm = vec![Some(0), Some(2)];
            xm.extend(std::iter::repeat_n(None, k));
            let mut wm = vec![Some(2), Some(1)];
            wm.extend(std::iter::repeat_n(None, w.len() - 2));
            let mut om = vec![Some(0), Some(1)];
            om.extend(std::iter::repeat_n(None, k));
            IterSpace { dims: sd, inputs: vec![Some(xm), Some(wm), input(2).map(|_| vec![Some(1)])], outputs: vec![om] }
        }
        Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_) => {
            let x = dims(g, input(0));
            if x.len() < 3 {
                return IterSpace::whole(g, n);
            }
            let k = x.len() - 2;
            let (kernel, strides, pads, dil) = match &node.op {
                Op::MaxPool(p) => (p.kernel_shape.clone(), p.strides.clone(), p.pads.clone(), p.dilations.clone()),
                Op::AveragePool(p) => (p.kernel_shape.clone(), p.strides.clone(), p.pads.clone(), p.dilations.clone()),
                Op::LpPool(p) => (p.kernel_shape.clone(), p.strides.clone(), p.pads.clone(), p.dilations.clone()),
                _ => unreachable!(),
            };
            let kernel = kernel.unwrap_or(vec![1; k]);
            let strides = strides.unwrap_or(vec![1; k]);
            let dil = dil.unwrap_or(vec![1; k]);
            let mut sd = vec![par("n", out[0]), par("c", out[1])];
            for i in 0..k {
                let ext = dil.get(i).copied().unwrap_or(1) * (kernel.get(i).copied().unwrap_or(1) - 1);
                let st = strides.get(i).copied().unwrap_or(1);
                let pb = pads.as_ref().map_or(0, |p| p.get(i).copied().unwrap_or(0));
                let before = pb.min(ext);
                let after = (ext - before - (st - 1)).max(0);
                sd.push(IterDim {
                    name: format!("s{i}"),
                    size: out[2 + i],
                    kind: DimKind::Spatial { halo: (before, after), stride: st },
                    role: DimRole::Spatial,
                });
            }
            let m: Vec<Option<usize>> = (0..x.len()).map(Some).collect();
            IterSpace { dims: sd, inputs: vec![Some(m.clone())], outputs: vec![m; node.num_outputs()] }
        }
        Op::GlobalAveragePool(_) | Op::GlobalMaxPool(_) | Op::GlobalLpPool(_) => {
            let x = dims(g, input(0));
            let kind = if matches!(node.op, Op::GlobalAveragePool(_)) { DimKind::Reduction } else { DimKind::Fixed };
            let mut sd = vec![par("n", out[0]), par("c", out[1])];
            sd.extend((2..x.len()).map(|i| IterDim {
                name: format!("s{}", i - 2),
                size: x[i],
                kind: kind.clone(),
                role: DimRole::Spatial,
            }));
            let xm: Vec<Option<usize>> = (0..x.len()).map(Some).collect();
            let mut om = vec![Some(0), Some(1)];
            om.extend(std::iter::repeat_n(None, x.len().saturating_sub(2)));
            IterSpace { dims: sd, inputs: vec![Some(xm)], outputs: vec![om] }
        }
        _ if node.op.class() == OpClass::Reduce => {
            let x = dims(g, input(0));
            let (axes, keep, sum_like): (Vec<usize>, bool, bool) = match node.op.reduce_attrs() {
                Some(ra) => {
                    let ax = match g.initializer(input(1).unwrap_or(Value::new(n, 0))).and_then(|t| t.to_i64_vec()) {
                        Some(v) if input(1).is_some() => v,
                        _ => ra.axes.unwrap_or_default(),
                    };
                    let ax: Vec<usize> = if ax.is_empty() {
                        (0..x.len()).collect()
                    } else {
                        ax.iter().map(|&a| norm_axis(a, x.len())).collect()
                    };
                    (ax, ra.keepdims, matches!(node.op, Op::ReduceSum(_) | Op::ReduceMean(_)))
                }
                None => {
                    let (a, keep, _) = node.op.arg_attrs().unwrap_or((0, true, false));
                    (vec![norm_axis(a, x.len())], keep, false)
                }
            };
            let sd: Vec<IterDim> = x
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    let kind = if !axes.contains(&i) {
                        DimKind::Parallel
                    } else if sum_like {
                        DimKind::Reduction
                    } else {
                        DimKind::Fixed
                    };
                    IterDim { name: format!("d{i}"), size: s, kind, role: DimRole::Other }
                })
                .collect();
            let xm: Vec<Option<usize>> = (0..x.len()).map(Some).collect();
            let om: Vec<Option<usize>> = if keep {
                (0..x.len()).map(|i| (!axes.contains(&i)).then_some(i)).collect()
            } else {
                (0..x.len()).filter(|i| !axes.contains(i)).map(Some).collect()
            };
            IterSpace {
                dims: sd,
                inputs: node
                    .inputs()
                    .iter()
                    .enumerate()
                    .map(|(j, i)| i.map(|v| if j == 0 { xm.clone() } else { vec![None; rank(g, v)] }))
                    .collect(),
                outputs: vec![om],
            }
        }
        Op::Transpose(t) => {
            let perm: Vec<usize> =
                t.perm.clone().map_or((0..r).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
            let sd: Vec<IterDim> = out.iter().enumerate().map(|(i, &s)| par(format!("d{i}"), s)).collect();
            let mut xm = vec![None; r];
            for (j, &p) in perm.iter().enumerate() {
                if p < r && out[j] != 1 {
                    xm[p] = Some(j);
                }
            }
            IterSpace {
                dims: sd,
                inputs: vec![Some(xm)],
                outputs: vec![(0..r).map(|i| (out[i] != 1).then_some(i)).collect()],
            }
        }
        Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_) => {
            let x = dims(g, input(0));
            let xm = reshape_map(&x, &out);
            // An output dim no input dim follows cannot be split: its pieces would need the
            // whole input.
            let sd: Vec<IterDim> = out
                .iter()
                .enumerate()
                .map(|(i, &s)| {
                    let mut d = par(format!("d{i}"), s);
                    if !xm.contains(&Some(i)) {
                        d.kind = DimKind::Fixed;
                    }
                    d
                })
                .collect();
            let mut inputs = vec![Some(xm)];
            for i in node.inputs().iter().skip(1) {
                inputs.push(i.map(|v| vec![None; rank(g, v)]));
            }
            let om: Vec<Option<usize>> = (0..r).map(|i| (out[i] != 1).then_some(i)).collect();
            IterSpace { dims: sd, inputs, outputs: vec![om] }
        }
        Op::Concat(cc) => {
            let a = norm_axis(cc.axis.unwrap_or(0), r);
            let mut sp = pointwise(g, n, &[a], &[], 0);
            for m in sp.inputs.iter_mut().flatten() {
                if a < m.len() {
                    m[a] = None;
                }
            }
            for (i, v) in node.inputs().iter().enumerate() {
                // Inputs match the output off the axis even where sizes are 1 on it.
                if let (Some(v), Some(Some(m))) = (v, sp.inputs.get_mut(i)) {
                    let d = dims(g, Some(*v));
                    for t in 0..d.len().min(r) {
                        if t != a && d[t] == out[t] && out[t] != 1 {
                            m[t] = Some(t);
                        }
                    }
                }
            }
            sp
        }
        Op::Split(s) => {
            let x = dims(g, input(0));
            let a = norm_axis(s.axis(), x.len());
            let sd: Vec<IterDim> = x
                .iter()
                .enumerate()
                .map(|(i, &sz)| IterDim {
                    name: format!("d{i}"),
                    size: sz,
                    kind: if i == a { DimKind::Fixed } else { DimKind::Parallel },
                    role: DimRole::Other,
                })
                .collect();
            let xm: Vec<Option<usize>> = (0..x.len()).map(|i| (i != a && x[i] != 1).then_some(i)).collect();
            let mut inputs = vec![Some(xm.clone())];
            for i in node.inputs().iter().skip(1) {
                inputs.push(i.map(|v| vec![None; rank(g, v)]));
            }
            IterSpace { dims: sd, inputs, outputs: vec![xm; node.num_outputs()] }
        }
        Op::Slice(_) | Op::Pad(_) | Op::Tile(_) | Op::Resize(_) | Op::Upsample(_) | Op::Expand(_) => {
            // Dims the op leaves alone map straight through; the others are fixed.
            let x = dims(g, input(0));
            let sd: Vec<IterDim> = out
                .iter()
                .enumerate()
                .map(|(i, &sz)| {
                    let t = (i + x.len()).checked_sub(r);
                    let same = t.is_some_and(|t| x[t] == sz);
                    IterDim {
                        name: format!("d{i}"),
                        size: sz,
                        kind: if same { DimKind::Parallel } else { DimKind::Fixed },
                        role: DimRole::Other,
                    }
                })
                .collect();
            let xm: Vec<Option<usize>> = (0..x.len())
                .map(|t| {
                    let i = t + r - x.len().min(r);
                    (i < r && x[t] == out[i] && x[t] != 1).then_some(i)
                })
                .collect();
            let mut inputs = vec![Some(xm)];
            for i in node.inputs().iter().skip(1) {
                inputs.push(i.map(|v| vec![None; rank(g, v)]));
            }
            IterSpace {
                dims: sd,
                inputs,
                outputs: vec![(0..r).map(|i| (out[i] != 1 && sd_parallel(&out, &x, i, r)).then_some(i)).collect()],
            }
        }
        Op::Gather(gt) => {
            let (d, idx) = (dims(g, input(0)), dims(g, input(1)));
            if d.is_empty() {
                return IterSpace::whole(g, n);
            }
            let a = norm_axis(gt.axis(), d.len());
            if a != 0 {
                return IterSpace::whole(g, n);
            }
            // Dims: the indices' dims, the table rows (vocab: split leaves partial sums of a
            // masked gather), then the table's remaining dims.
            let mut sd: Vec<IterDim> = idx.iter().enumerate().map(|(i, &s)| par(format!("i{i}"), s)).collect();
            let vocab = sd.len();
            sd.push(IterDim { name: "v".into(), size: d[0], kind: DimKind::Reduction, role: DimRole::Vocab });
            let rest0 = sd.len();
            sd.extend(d[1..].iter().enumerate().map(|(i, &s)| IterDim {
                name: format!("e{i}"),
                size: s,
                kind: DimKind::Parallel,
                role: DimRole::Other,
            }));
            let mut dm = vec![Some(vocab)];
            dm.extend((0..d.len() - 1).map(|i| Some(rest0 + i)));
            let im: Vec<Option<usize>> = (0..idx.len()).map(|i| (idx[i] != 1).then_some(i)).collect();
            let mut om: Vec<Option<usize>> = (0..idx.len()).map(|i| (idx[i] != 1).then_some(i)).collect();
            om.extend((0..d.len() - 1).map(|i| Some(rest0 + i)));
            IterSpace { dims: sd, inputs: vec![Some(dm), Some(im)], outputs: vec![om] }
        }
        Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) => {
            let x = dims(g, input(0));
            let layout = match &node.op {
                Op::LSTM(l) => l.layout(),
                Op::GRU(l) => l.layout(),
                Op::RNN(l) => l.layout(),
                _ => 0,
            };
            if x.len() != 3 {
                return IterSpace::whole(g, n);
            }
            let (bx, sx) = if layout == 0 { (1, 0) } else { (0, 1) };
            let sd = vec![
                IterDim { name: "b".into(), size: x[bx], kind: DimKind::Parallel, role: DimRole::Other },
                IterDim { name: "t".into(), size: x[sx], kind: DimKind::Fixed, role: DimRole::Other },
            ];
            let mut xm = vec![None; 3];
            xm[bx] = Some(0);
            xm[sx] = Some(1);
            let inputs = node
                .inputs()
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.map(|v| {
                        let rk = rank(g, v);
                        match i {
                            0 => xm.clone(),
                            5 | 6 => (0..rk).map(|t| (t == if layout == 0 { 1 } else { 0 }).then_some(0)).collect(),
                            _ => vec![None; rk],
                        }
                    })
                })
                .collect();
            let outputs = (0..node.num_outputs())
                .map(|s| {
                    let rk = rank(g, Value::new(n, s as u16));
                    if s == 0 {
                        if layout == 0 {
                            vec![Some(1), None, Some(0), None]
                        } else {
                            vec![Some(0), Some(1), None, None]
                        }
                    } else {
                        (0..rk).map(|t| (t == if layout == 0 { 1 } else { 0 }).then_some(0)).collect()
                    }
                })
                .collect();
            IterSpace { dims: sd, inputs, outputs }
        }
        _ => IterSpace::whole(g, n),
    }
}

fn sd_parallel(out: &[i64], x: &[i64], i: usize, r: usize) -> bool {
    (i + x.len()).checked_sub(r).is_some_and(|t| x[t] == out[i])
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

/// The shardings an op strategy needs on each input (per mesh axis) and produces on each
/// output. `None` for an omitted input.
pub fn strategy_shardings(space: &IterSpace, strategy: &[Option<usize>]) -> (Vec<Option<Sharding>>, Vec<Sharding>) {
    let shard_of = |map: &[Option<usize>], on_missing: AxisShard| -> Sharding {
        strategy
            .iter()
            .map(|s| match s {
                None => AxisShard::Replicate,
                Some(i) => match map.iter().position(|m| *m == Some(*i)) {
                    Some(t) => AxisShard::Split(t as u8),
                    None => on_missing,
                },
            })
            .collect()
    };
    let inputs = space.inputs.iter().map(|m| m.as_ref().map(|m| shard_of(m, AxisShard::Replicate))).collect();
    let outputs = space
        .outputs
        .iter()
        .map(|m| {
            strategy
                .iter()
                .map(|s| match s {
                    None => AxisShard::Replicate,
                    Some(i) => match m.iter().position(|x| *x == Some(*i)) {
                        Some(t) => AxisShard::Split(t as u8),
                        None if space.dims[*i].kind == DimKind::Reduction => AxisShard::Partial,
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
            if d.kind == DimKind::Fixed {
                return false;
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
    true
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

    #[test]
    fn shardings_print_and_parse() {
        let s = vec![AxisShard::Split(0), AxisShard::Replicate, AxisShard::Partial];
        assert_eq!(sharding_to_string(&s), "[S(0), R, P]");
        assert_eq!(parse_sharding("[S(0), R, P]"), Some(s));
    }
}
