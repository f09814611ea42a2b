//! Named strategies, so they can be compared: each is a rule that gives every op a strategy.
//!
//! - `data`: every op splits its batch dim over all devices (parameters replicated).
//! - `model`: weighted ops split their output features (GEMM columns, conv filters) over all
//!   devices; other ops follow the layout of their input (Castelló et al.'s model parallelism).
//! - `spatial`: convolutions and pooling split their spatial dims, with halo exchange
//!   (Dryden et al.); other ops follow.
//! - `megatron` (alias `tensor`): Megatron-LM tensor parallelism over all devices — a
//!   weighted GEMM whose activation arrives split along its input features runs row-parallel
//!   (split reduction, partial sums all-reduced after it), any other column-parallel (split
//!   output features): MLPs become column→row pairs, attention splits by heads where the
//!   heads are separate tensors in the graph (the Q/K/V projections column-parallel, the
//!   per-head matmuls and softmax follow, the output projection row-parallel); embeddings
//!   split by vocabulary rows; the output head column-parallel (by vocabulary), its softmax
//!   over the split vocabulary with all-reduced statistics.
//! - `hybrid:dp:D,tp:T`: a `D × T` mesh, data parallel over the first axis and Megatron over
//!   the second (inside a node where it fits).
//! - `spatial-hybrid:DxS`: a `D × S` mesh, batch over the first axis and spatial over the
//!   second (Dryden et al.'s sample × spatial).
//! - `owt`: convolutions data parallel, fully connected layers model parallel (Krizhevsky's
//!   "one weird trick").
//! - `context` (alias `ulysses`): DeepSpeed-Ulysses context parallelism over all devices —
//!   every op splits the sequence, attention its heads, all-to-alls between
//!   ([`super::context`]). `context:ring` (alias `ring`; `cp_comm=p2p`): ring attention —
//!   attention keeps the sequence split and passes its keys and values around the devices.
//! - `expert` (alias `ep`): expert parallelism over all devices — each mixture of experts
//!   (`MoE`: `passes::FuseExperts` makes them from exported ones) splits its experts over the
//!   devices, every other op is data parallel: the tokens are all-gathered before a mixture
//!   and its partial outputs reduce-scattered back to the batch after it (Megatron-core's
//!   all-gather token dispatcher), the experts' weights never replicated. `expert:ep:E`: on a
//!   `data × expert` mesh (`E` innermost), expert parallelism inside each group of `E`
//!   devices and the groups data parallel (Megatron's expert-parallel groups carved from the
//!   data-parallel ones): the mixtures split their tokens over the data axis and their
//!   experts over the expert axis, every other op its batch over both. `expert:ep:E:tp:T`:
//!   on a `data × expert × tensor` mesh, Megatron over the tensor axis (data parallel over
//!   the others) and the mixtures' tokens split over the tensor axis too.
//! - `pipeline:S:M[:gpipe|:1f1b]`: S balanced stages, M micro-batches (see `pipeline`).

use ir::shard::{AxisShard, DimKind, DimRole, LinkLevel, Mesh, MeshAxis, strategy_shardings, strategy_valid};
use ir::{NodeId, Op, Value};

use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options, PipelineReport, Schedule};
use ir::Graph;

/// A parsed strategy name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Named {
    /// Data parallel.
    Data,
    /// Output-feature model parallelism (Castelló et al.).
    Model,
    /// Megatron tensor parallelism.
    Megatron,
    /// Spatial parallel.
    Spatial,
    /// Data × Megatron on a `dp × tp` mesh.
    Hybrid {
        /// Data-parallel ways.
        dp: usize,
        /// Tensor-parallel ways.
        tp: usize,
    },
    /// Sample × spatial on a `D × S` mesh.
    SpatialHybrid(usize, usize),
    /// Data-parallel convolutions, model-parallel fully connected layers.
    Owt,
    /// Ulysses context parallelism: the sequence split, attention by heads — over every
    /// device (`dp` and `tp` 1), or over the context axis of a `dp × tp × cp` mesh whose data
    /// axis splits the batch and whose tensor axis runs Megatron (attention heads split over
    /// both the context and the tensor axis).
    Context {
        /// Data-parallel ways.
        dp: usize,
        /// Tensor-parallel ways.
        tp: usize,
        /// Ring attention instead: attention splits its sequence, the keys and values passed
        /// around the context devices (`SplitMode::Ring`).
        ring: bool,
    },
    /// Expert parallelism: mixtures of experts split by experts (over `ep` devices, 0: all of
    /// them), the rest data parallel.
    Expert {
        /// Expert-parallel ways (0: every device).
        ep: usize,
        /// Tensor-parallel ways (Megatron over the innermost axis; the mixtures split their
        /// tokens over it), 1 for none.
        tp: usize,
    },
    /// Pipeline: stages of equal device groups, each sharded data-parallel, or Megatron-style
    /// over `tensor` of its devices (the rest data-parallel).
    Pipeline {
        /// Stages.
        stages: usize,
        /// Micro-batches per step.
        micro: usize,
        /// Schedule.
        schedule: Schedule,
        /// Tensor-parallel degree inside a stage (1: data-parallel stages).
        tensor: usize,
        /// Expert-parallel degree inside a stage (1: none; `tensor` 1): the stage's mixtures
        /// of experts split their experts over groups of this many of its data-parallel
        /// devices.
        expert: usize,
    },
}

impl Named {
    /// Parses a strategy name.
    pub fn parse(s: &str) -> Result<Named, String> {
        if super::config::is_config(s) {
            return Err(format!(
                "`{s}` is a configuration (key=value fields): `shardc cost` prices it; this command takes a strategy name (data, megatron, hybrid:dp:D,tp:T, pipeline:S:M …) for now"
            ));
        }
        let parts: Vec<&str> = s.split(':').collect();
        Ok(match parts.as_slice() {
            ["data"] => Named::Data,
            ["model"] => Named::Model,
            ["spatial"] => Named::Spatial,
            ["owt"] => Named::Owt,
            ["context"] | ["ulysses"] => Named::Context { dp: 1, tp: 1, ring: false },
            ["ring"] => Named::Context { dp: 1, tp: 1, ring: true },
            ["context" | "ulysses", ..] => Named::parse_context(s)?,
            ["megatron"] | ["tensor"] => Named::Megatron,
            ["expert"] | ["ep"] => Named::Expert { ep: 0, tp: 1 },
            ["expert" | "ep", "ep", e, rest @ ..] => {
                let ep = e.parse::<usize>().ok().filter(|&x| x >= 1);
                let tp = match rest {
                    [] => Some(1),
                    ["tp", t] => t.parse::<usize>().ok().filter(|&x| x >= 1),
                    _ => None,
                };
                match (ep, tp) {
                    (Some(ep), Some(tp)) => Named::Expert { ep, tp },
                    _ => {
                        return Err(format!(
                            "`{s}`: write expert:ep:E[:tp:T] with E the expert-parallel ways, e.g. expert:ep:8 or expert:ep:8:tp:2"
                        ));
                    }
                }
            }
            ["spatial-hybrid", ds] => {
                let (d, sp) = ds
                    .split_once(['x', 'X'])
                    .ok_or_else(|| format!("`{s}`: write spatial-hybrid:DxS, e.g. spatial-hybrid:2x4"))?;
                let d = d.parse().map_err(|_| format!("`{s}`: D must be a number"))?;
                let sp = sp.parse().map_err(|_| format!("`{s}`: S must be a number"))?;
                if d == 0 || sp == 0 {
                    return Err(format!("`{s}`: D and S must be at least 1"));
                }
                Named::SpatialHybrid(d, sp)
            }
            ["hybrid", ..] => {
                let rest = &s["hybrid:".len().min(s.len())..];
                let mut dp = None;
                let mut tp = None;
                for part in rest.split(',') {
                    let (k, v) = part.split_once(':').unwrap_or((part, ""));
                    let n: usize = v.trim().parse().map_err(|_| {
                        format!("`{s}`: write hybrid:dp:D,tp:T (data × tensor), e.g. hybrid:dp:2,tp:4; data × spatial is spatial-hybrid:DxS")
                    })?;
                    match k.trim() {
                        "dp" => dp = Some(n),
                        "tp" => tp = Some(n),
                        other => return Err(format!("`{s}`: unknown part `{other}`; write hybrid:dp:D,tp:T")),
                    }
                }
                let (Some(dp), Some(tp)) = (dp, tp) else {
                    return Err(format!("`{s}`: write hybrid:dp:D,tp:T, e.g. hybrid:dp:2,tp:4"));
                };
                if dp == 0 || tp == 0 {
                    return Err(format!("`{s}`: D and T must be at least 1"));
                }
                Named::Hybrid { dp, tp }
            }
            ["pipeline", st, m, rest @ ..] => Named::parse_pipeline(s, st, m, rest)?,
            _ => {
                return Err(format!(
                    "unknown strategy `{s}`; strategies are data, model, megatron (tensor), spatial, hybrid:dp:D,tp:T, spatial-hybrid:DxS, owt, context (ulysses), context:dp:D,tp:T, context:ring[:dp:D,tp:T] (ring), pipeline:S:M[:gpipe|:1f1b|:interleaved:V][:tp:T]; or a configuration such as tp=8,pp=8,vp=3"
                ));
            }
        })
    }

    /// `context[:ring][:dp:D,tp:T]` (either degree may be left out: 1).
    fn parse_context(s: &str) -> Result<Named, String> {
        let usage = || {
            format!("`{s}`: write context[:ring][:dp:D,tp:T] (data × context × tensor; either degree may be left out)")
        };
        let mut rest = s.split_once(':').map_or("", |(_, r)| r);
        let ring = rest == "ring" || rest.starts_with("ring:");
        if ring {
            rest = rest.strip_prefix("ring").unwrap_or(rest).trim_start_matches(':');
        }
        let (mut dp, mut tp) = (1, 1);
        for part in rest.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once(':').ok_or_else(usage)?;
            let n = v.trim().parse::<usize>().ok().filter(|n| *n >= 1).ok_or_else(usage)?;
            match k.trim() {
                "dp" => dp = n,
                "tp" => tp = n,
                _ => return Err(usage()),
            }
        }
        Ok(Named::Context { dp, tp, ring })
    }

    /// `pipeline:S:M[:gpipe|:1f1b|:interleaved:V][:tp:T]` after its first word (`s` whole, for
    /// messages).
    fn parse_pipeline(s: &str, st: &str, m: &str, rest: &[&str]) -> Result<Named, String> {
        let stages: usize = st.parse().map_err(|_| format!("`{s}`: the stage count must be a number"))?;
        let micro: usize = m.parse().map_err(|_| format!("`{s}`: the micro-batch count must be a number"))?;
        if stages == 0 || micro == 0 {
            return Err(format!("`{s}`: stages and micro-batches must be at least 1"));
        }
        let (rest, expert) = match rest {
            [head @ .., "ep", e] => match e.parse::<usize>() {
                Ok(e) if e >= 1 => (head, e),
                _ => return Err(format!("`{s}`: ep:E takes an expert-parallel degree of at least 1")),
            },
            _ => (rest, 1),
        };
        let (rest, tensor) = match rest {
            [head @ .., "tp", t] => match t.parse::<usize>() {
                Ok(t) if t >= 1 => (head, t),
                _ => return Err(format!("`{s}`: tp:T takes a tensor-parallel degree of at least 1")),
            },
            _ => (rest, 1),
        };
        let schedule = match rest {
            [] | ["1f1b"] => Schedule::OneFOneB,
            ["gpipe"] => Schedule::GPipe,
            ["interleaved", v] => match v.parse::<usize>() {
                Ok(v) if v >= 2 => Schedule::Interleaved(v),
                _ => return Err(format!("`{s}`: interleaved:V takes V ≥ 2 virtual stages per device")),
            },
            _ => {
                return Err(format!(
                    "`{s}`: write pipeline:S:M[:gpipe|:1f1b|:interleaved:V][:tp:T][:ep:E], e.g. pipeline:8:64:interleaved:3:tp:8"
                ));
            }
        };
        Ok(Named::Pipeline { stages, micro, schedule, tensor, expert })
    }

    /// The strategy inside each stage of a pipeline of `per_stage` devices: data parallel,
    /// Megatron, data × Megatron, or (`expert` > 1) data × expert.
    pub fn stage_strategy(tensor: usize, expert: usize, per_stage: usize) -> Result<Named, String> {
        if tensor == 0 || !per_stage.is_multiple_of(tensor) {
            return Err(format!("tensor parallelism over {tensor} does not divide a stage's {per_stage} devices"));
        }
        if expert > 1 {
            if !per_stage.is_multiple_of(expert * tensor) {
                return Err(format!(
                    "expert parallelism over {expert} beside tensor parallelism over {tensor} does not divide a stage's {per_stage} devices"
                ));
            }
            return Ok(Named::Expert { ep: expert, tp: tensor });
        }
        Ok(match (tensor, per_stage / tensor) {
            (1, _) => Named::Data,
            (t, 1) if t > 1 => Named::Megatron,
            (tp, dp) => Named::Hybrid { dp, tp },
        })
    }

    /// The name [`Named::parse`] reads back.
    pub fn name(&self) -> String {
        match self {
            Named::Data => "data".into(),
            Named::Model => "model".into(),
            Named::Megatron => "megatron".into(),
            Named::Spatial => "spatial".into(),
            Named::Hybrid { dp, tp } => format!("hybrid:dp:{dp},tp:{tp}"),
            Named::SpatialHybrid(d, s) => format!("spatial-hybrid:{d}x{s}"),
            Named::Owt => "owt".into(),
            Named::Expert { ep: 0, .. } => "expert".into(),
            Named::Expert { ep, tp: 1 } => format!("expert:ep:{ep}"),
            Named::Expert { ep, tp } => format!("expert:ep:{ep}:tp:{tp}"),
            Named::Context { dp, tp, ring } => {
                let parts: Vec<String> = [("dp", *dp), ("tp", *tp)]
                    .iter()
                    .filter(|(_, n)| *n > 1)
                    .map(|(k, n)| format!("{k}:{n}"))
                    .collect();
                let head = if *ring { "context:ring" } else { "context" };
                if parts.is_empty() { head.into() } else { format!("{head}:{}", parts.join(",")) }
            }
            Named::Pipeline { stages, micro, schedule, tensor, expert } => {
                let mut s = format!("pipeline:{stages}:{micro}:{}", schedule.name());
                if *tensor > 1 {
                    s.push_str(&format!(":tp:{tensor}"));
                }
                if *expert > 1 {
                    s.push_str(&format!(":ep:{expert}"));
                }
                s
            }
        }
    }

    /// The mesh the strategy runs on, for `devices` devices of `cluster`.
    pub fn mesh(&self, cluster: &Cluster, devices: usize) -> Result<Mesh, String> {
        let two = |(d, s): (usize, usize), what: String, names: (&str, &str)| -> Result<Mesh, String> {
            if d * s != devices {
                return Err(format!("{what} needs {} devices, {devices} given", d * s));
            }
            cluster.mesh(devices)?;
            let dpn = cluster.devices_per_node;
            // The second axis stays inside a node when it fits.
            let (l0, l1) = if devices <= dpn {
                (LinkLevel::Intra, LinkLevel::Intra)
            } else if s <= dpn && dpn.is_multiple_of(s) {
                (LinkLevel::Inter, LinkLevel::Intra)
            } else {
                (LinkLevel::Inter, LinkLevel::Inter)
            };
            Ok(Mesh {
                axes: vec![
                    MeshAxis { name: names.0.into(), size: d, level: l0 },
                    MeshAxis { name: names.1.into(), size: s, level: l1 },
                ],
            })
        };
        match self {
            Named::SpatialHybrid(d, s) => two((*d, *s), format!("spatial-hybrid:{d}x{s}"), ("samples", "space")),
            Named::Hybrid { dp, tp } => two((*dp, *tp), format!("hybrid:dp:{dp},tp:{tp}"), ("data", "tensor")),
            Named::Context { dp, tp, .. } if dp * tp > 1 => context_mesh(cluster, devices, (*dp, *tp), &self.name()),
            Named::Expert { ep, tp } if *tp > 1 => expert_mesh(cluster, devices, (*ep, *tp), &self.name()),
            Named::Expert { ep, .. } if *ep > 0 && *ep < devices => {
                if !devices.is_multiple_of(*ep) {
                    return Err(format!("{}: {ep} does not divide {devices} devices", self.name()));
                }
                two((devices / ep, *ep), self.name(), ("data", "expert"))
            }
            _ => cluster.mesh(devices),
        }
    }
}

/// The `data × tensor × context` mesh of `devices` devices (`dp`, `tp` ways; a data or tensor
/// axis of one device left out). The tensor axis comes before the context axis so an
/// attention's heads split tensor-major: each tensor rank's heads (what its column-parallel
/// projections made) spread over its context group, and Ulysses' exchange is one all-to-all
/// within that group (with the context axis first the heads would regroup across the tensor
/// axis too: gathered). Devices are numbered along the mesh, the context axis innermost:
/// inside a node where the context group fits, the tensor axis inside it where both fit.
fn context_mesh(cluster: &Cluster, devices: usize, (dp, tp): (usize, usize), what: &str) -> Result<Mesh, String> {
    if !devices.is_multiple_of(dp * tp) || devices / (dp * tp) < 2 {
        return Err(format!(
            "{what}: dp × tp = {} leaves no context-parallel group of 2 or more of {devices} devices",
            dp * tp
        ));
    }
    cluster.mesh(devices)?;
    let cp = devices / (dp * tp);
    Ok(nested_mesh(cluster, &[("data", dp), ("tensor", tp), ("context", cp)]))
}

/// A mesh of `axes` (name and size, outermost first; devices are numbered along it): an axis
/// is inside a node where it and the axes inside it fit one, else between nodes. Axes of one
/// device are left out, but the innermost.
fn nested_mesh(cluster: &Cluster, axes: &[(&str, usize)]) -> Mesh {
    let dpn = cluster.devices_per_node;
    let level = |within: usize| {
        if within <= dpn && dpn.is_multiple_of(within) { LinkLevel::Intra } else { LinkLevel::Inter }
    };
    let mut out = Vec::new();
    for (i, &(name, size)) in axes.iter().enumerate() {
        if size > 1 || i + 1 == axes.len() {
            let within: usize = axes[i..].iter().map(|a| a.1).product();
            out.push(MeshAxis { name: name.into(), size, level: level(within) });
        }
    }
    Mesh { axes: out }
}

/// The `data × expert × tensor` mesh of `devices` devices (`ep`, `tp` ways; a data axis of one
/// device left out): the tensor axis innermost, inside a node where it fits, the expert axis
/// next.
fn expert_mesh(cluster: &Cluster, devices: usize, (ep, tp): (usize, usize), what: &str) -> Result<Mesh, String> {
    if ep == 0 || !devices.is_multiple_of(ep * tp) {
        return Err(format!("{what}: ep × tp = {} does not divide {devices} devices", ep * tp));
    }
    cluster.mesh(devices)?;
    Ok(nested_mesh(cluster, &[("data", devices / (ep * tp)), ("expert", ep), ("tensor", tp)]))
}

/// True for ops whose weight input is a parameter: the layers that model parallelism splits.
pub fn is_weighted(cm: &CostModel<'_>, n: NodeId) -> bool {
    let g = cm.g;
    let node = g.node(n);
    match node.op {
        Op::Conv(_) | Op::ConvTranspose(_) | Op::Gemm(_) | Op::MatMul(_) => {
            node.input(1).is_some_and(|v| is_param_like(g, v))
        }
        _ => false,
    }
}

/// A parameter, or a parameter seen through a transpose/cast (tied embeddings).
fn is_param_like(g: &ir::Graph, v: Value) -> bool {
    if ir::cost::is_param(g, v) {
        return true;
    }
    match &g.node(v.node).op {
        Op::Transpose(_) | Op::Cast(_) | Op::Identity(_) => {
            g.node(v.node).input(0).is_some_and(|x| is_param_like(g, x))
        }
        _ => false,
    }
}

/// The largest splittable iteration dim with `role`, if any.
fn dim_with(cm: &CostModel<'_>, n: NodeId, role: DimRole) -> Option<usize> {
    let sp = cm.space(n);
    sp.dims.iter().position(|d| d.role == role && d.kind != DimKind::Fixed)
}

/// Splits iteration dim `i` over as many mesh axes as divide it (preferring more devices).
fn split_over_axes(cm: &CostModel<'_>, n: NodeId, i: usize, axes: &[usize]) -> Option<Vec<Option<usize>>> {
    let k = cm.mesh.axes.len();
    let mut best: Option<(usize, Vec<Option<usize>>)> = None;
    for mask in 1u32..(1 << axes.len()) {
        let mut s = vec![None; k];
        let mut devs = 1;
        for (b, &a) in axes.iter().enumerate() {
            if mask & (1 << b) != 0 {
                s[a] = Some(i);
                devs *= cm.mesh.axes[a].size;
            }
        }
        if strategy_valid(cm.space(n), &s, &cm.mesh, cm.g, n) && best.as_ref().is_none_or(|(d, _)| devs > *d) {
            best = Some((devs, s));
        }
    }
    best.map(|(_, s)| s)
}

/// The strategy that keeps an op's main input as its producer laid it out, where the op can.
fn follow(cm: &CostModel<'_>, asg: &Assignment, n: NodeId) -> Vec<Option<usize>> {
    let g = cm.g;
    let node = g.node(n);
    let k = cm.mesh.axes.len();
    let sp = cm.space(n);
    // The main input: the largest one computed by an op.
    let main = node
        .inputs()
        .iter()
        .enumerate()
        .filter_map(|(j, v)| v.map(|v| (j, v)))
        .filter(|(_, v)| asg.strategies.contains_key(&v.node))
        .max_by_key(|(_, v)| g.tensor_type(*v).and_then(|t| t.numel()).unwrap_or(0));
    let Some((j, v)) = main else { return vec![None; k] };
    let producer = &asg.strategies[&v.node];
    let (_, outs) = strategy_shardings(cm.space(v.node), producer);
    let have = &outs[v.slot as usize];
    let Some(Some(map)) = sp.inputs.get(j) else { return vec![None; k] };
    let mut s: Vec<Option<usize>> = (0..k)
        .map(|a| match have[a] {
            AxisShard::Split(t) => {
                map.get(t as usize).copied().flatten().filter(|&i| sp.dims[i].kind != DimKind::Fixed)
            }
            // Partial sums into a sum stay partial (a parameter's gradients from several readers).
            AxisShard::Partial => cm.linear_dim(n),
            _ => None,
        })
        .collect();
    // Drop axes until the strategy is admissible.
    for a in 0..k {
        if strategy_valid(sp, &s, &cm.mesh, g, n) {
            break;
        }
        s[a] = None;
    }
    if strategy_valid(sp, &s, &cm.mesh, g, n) { s } else { vec![None; k] }
}

/// The batch size of the graph's data inputs (the first dim the batch analysis marks), if
/// it has one.
fn batch_size(cm: &CostModel<'_>) -> Option<i64> {
    let g = cm.g;
    g.input_values().into_iter().filter(|v| matches!(g.node(v.node).op, Op::Input { default: None })).find_map(|v| {
        let flags = cm.batch().get(&v)?;
        let dims = g.tensor_type(v)?.static_dims()?;
        flags.iter().position(|&b| b).map(|i| dims[i])
    })
}

/// Why a named strategy does not apply to the graph on the cost model's mesh, if it does not.
/// (`sequence`: the graph's sequence dims, for `context`.)
fn applies(cm: &CostModel<'_>, named: &Named, sequence: &super::context::SequenceDims) -> Result<(), String> {
    let order = cm.order();
    let has_batch = order.iter().any(|&n| dim_with(cm, n, DimRole::Batch).is_some());
    let has_spatial = order.iter().any(|&n| {
        dim_with(cm, n, DimRole::Spatial).is_some()
            && matches!(cm.g.node(n).op, Op::Conv(_) | Op::MaxPool(_) | Op::AveragePool(_))
    });
    let weighted: Vec<NodeId> = order.iter().copied().filter(|&n| is_weighted(cm, n)).collect();
    let is_fc = |n: NodeId| matches!(cm.g.node(n).op, Op::Gemm(_) | Op::MatMul(_));
    let name = match named {
        Named::Data => "data",
        Named::Model => "model",
        Named::Megatron => "megatron",
        Named::Hybrid { .. } => "hybrid",
        Named::Spatial => "spatial",
        Named::SpatialHybrid(..) => "spatial-hybrid",
        Named::Owt => "owt",
        Named::Context { .. } => "context",
        Named::Expert { .. } => "expert",
        Named::Pipeline { .. } => return Err("pipeline strategies are priced by the pipeline model".into()),
    };
    if matches!(named, Named::Hybrid { .. } | Named::SpatialHybrid(..)) && cm.mesh.axes.len() < 2 {
        return Err(format!("{name}: needs a mesh of two axes"));
    }
    let (data_axes, _, tensor_axes) = context_axes(cm, named);
    let batch_split =
        matches!(named, Named::Data | Named::Expert { .. } | Named::Hybrid { .. } | Named::SpatialHybrid(..));
    if batch_split || !data_axes.is_empty() {
        if !has_batch {
            return Err(format!("{name}: no op has a dim that carries the batch"));
        }
        // Data parallelism over the batch axis's devices needs a batch they divide.
        let ways = match named {
            Named::Data | Named::Expert { tp: 1, .. } => cm.mesh.devices(),
            Named::Expert { tp, .. } => cm.mesh.devices() / tp,
            Named::Context { .. } => data_axes.iter().map(|&a| cm.mesh.axes[a].size).product(),
            _ => cm.mesh.axes[0].size,
        };
        if let Some(b) = batch_size(cm)
            && b % ways as i64 != 0
        {
            let divisors: Vec<String> =
                (2..ways).rev().filter(|d| b % *d as i64 == 0).take(3).map(|d| d.to_string()).collect();
            return Err(format!(
                "{name}: the batch ({b}) does not divide over {ways} devices; use a batch that {ways} divides{}",
                if divisors.is_empty() {
                    String::new()
                } else {
                    format!(", or {} data-parallel devices", divisors.join(", "))
                }
            ));
        }
    }
    match named {
        Named::Model | Named::Megatron | Named::Hybrid { .. } if weighted.is_empty() => {
            Err(format!("{name}: the model has no layer with weights to split"))
        }
        Named::Context { .. } if !tensor_axes.is_empty() && weighted.is_empty() => {
            Err(format!("{name}: the model has no layer with weights to split"))
        }
        Named::Spatial | Named::SpatialHybrid(..) if !has_spatial => {
            Err(format!("{name}: the model has no convolution or pooling with spatial dims to split"))
        }
        Named::Owt if !weighted.iter().any(|&n| is_fc(n)) || !weighted.iter().any(|&n| !is_fc(n)) => {
            Err("owt: needs both convolutions (data parallel) and fully connected layers (model parallel)".into())
        }
        Named::Context { .. } => context_applies(cm, named, sequence),
        Named::Expert { .. } => expert_applies(cm, &expert_axes(cm, named)?),
        _ => Ok(()),
    }
}

/// The mesh axes a context-parallel strategy splits the batch over, the sequence over, and
/// runs Megatron over: all context for `context` over every device, else on
/// [`context_mesh`]'s axes the first data (with `dp` > 1), the next tensor (with `tp` > 1)
/// and the rest context; none for other strategies.
fn context_axes(cm: &CostModel<'_>, named: &Named) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let k = cm.mesh.axes.len();
    let Named::Context { dp, tp, .. } = *named else { return (Vec::new(), Vec::new(), Vec::new()) };
    let data: Vec<usize> = if dp > 1 && k > 1 { vec![0] } else { Vec::new() };
    let tensor: Vec<usize> = if tp > 1 && k > data.len() + 1 { vec![data.len()] } else { Vec::new() };
    let context = (data.len() + tensor.len()..k).collect();
    (data, context, tensor)
}

/// Context parallelism needs a sequence the context axes' devices divide and attention ops
/// whose heads they divide (fused `Attention`, 4-D: `passes::FuseAttention` makes them from
/// exported attention).
fn context_applies(cm: &CostModel<'_>, named: &Named, sequence: &super::context::SequenceDims) -> Result<(), String> {
    let (_, axes, tensor) = context_axes(cm, named);
    let ways = axes.iter().map(|&a| cm.mesh.axes[a].size).product::<usize>() as i64;
    let seq =
        super::context::sequence_len(cm, sequence).ok_or("context: the model has no input with a sequence dim")?;
    if seq % ways != 0 {
        return Err(format!("context: the sequence ({seq}) does not divide over {ways} devices"));
    }
    let attention: Vec<NodeId> = cm.order().iter().copied().filter(|&n| super::context::is_attention(cm, n)).collect();
    if attention.is_empty() {
        return Err("context: no fused attention with heads to split (run canonicalize and fuse-attention)".into());
    }
    // (With tensor parallelism the heads split over both axes.)
    let both: Vec<usize> = axes.iter().chain(&tensor).copied().collect();
    if let Named::Context { ring: true, .. } = named
        && let Some(&n) = attention.iter().find(|&&n| super::context::ring_dim(cm, n).is_none())
    {
        return Err(format!(
            "context:ring: {} is not a plain causal self-attention (4-D, no mask, cache, window or soft cap), which ring attention needs",
            cm.g.describe(n)
        ));
    }
    let ring = matches!(named, Named::Context { ring: true, .. });
    if let Some(&n) = attention.iter().find(|&&n| !ring && super::context::ulysses(cm, n, sequence, &both).is_none()) {
        let ways: usize = both.iter().map(|&a| cm.mesh.axes[a].size).product();
        return Err(format!("context: {} does not split its heads over {ways} devices", cm.g.describe(n)));
    }
    Ok(())
}

/// The mesh axes an expert-parallel strategy splits the experts over: all of them for
/// `expert`, the mesh's `expert` axis for `expert:ep:E[:tp:T]` with `E` fewer than the devices.
fn expert_axes(cm: &CostModel<'_>, named: &Named) -> Result<Vec<usize>, String> {
    let k = cm.mesh.axes.len();
    match *named {
        Named::Expert { ep, tp } if ep > 0 && ep * tp < cm.mesh.devices() || tp > 1 => {
            match cm.mesh.axes.iter().position(|a| a.name == "expert") {
                Some(a) if cm.mesh.axes[a].size == ep => Ok(vec![a]),
                _ => Err(format!("{}: the mesh has no expert axis of {ep} devices", named.name())),
            }
        }
        _ => Ok((0..k).collect()),
    }
}

/// The tensor axis of `expert:ep:E:tp:T` (the mesh's `tensor` axis), if any.
fn expert_tensor_axis(cm: &CostModel<'_>, named: &Named) -> Option<usize> {
    match *named {
        Named::Expert { tp, .. } if tp > 1 => cm.mesh.axes.iter().position(|a| a.name == "tensor"),
        _ => None,
    }
}

/// Expert parallelism needs mixtures of experts whose experts the expert axes divide.
fn expert_applies(cm: &CostModel<'_>, axes: &[usize]) -> Result<(), String> {
    let ways: usize = axes.iter().map(|&a| cm.mesh.axes[a].size).product();
    let experts: Vec<(NodeId, i64)> = cm
        .order()
        .iter()
        .filter(|&&n| matches!(cm.g.node(n).op, Op::MoE(_)))
        .filter_map(|&n| Some((n, cm.space(n).dims.iter().find(|d| d.role == DimRole::Expert)?.size)))
        .collect();
    if experts.is_empty() {
        return Err("expert: the model has no mixture of experts (`fuse-experts` recognizes transformers' static-shape experts; docs/user-guide.md)".into());
    }
    if let Some((n, e)) = experts.iter().find(|(_, e)| *e % ways as i64 != 0) {
        return Err(format!("expert: {} has {e} experts, which {ways} devices do not divide", cm.g.describe(*n)));
    }
    Ok(())
}

/// Op `n` under expert parallelism over `experts` (axes): a mixture (or its gradient) splits
/// its experts over `experts` and its tokens over the other axes; any other op its batch over
/// all the axes or, with a `tensor` axis, its batch over the others and Megatron over it.
fn expert_split(
    cm: &CostModel<'_>,
    asg: &Assignment,
    n: NodeId,
    (experts, dispatch): (&[usize], bool),
    tensor: Option<usize>,
) -> Option<Vec<Option<usize>>> {
    let k = cm.mesh.axes.len();
    let all: Vec<usize> = (0..k).collect();
    let batch = || dim_with(cm, n, DimRole::Batch).and_then(|i| split_over_axes(cm, n, i, &all));
    let megatron = |t: usize| {
        let dp: Vec<usize> = (0..k).filter(|&a| a != t).collect();
        data_then_megatron(cm, asg, n, &dp, t)
    };
    if let Some(e) = dim_with(cm, n, DimRole::Expert) {
        let sp = cm.space(n);
        let t = sp.dims.iter().position(|d| d.name == "t");
        // A mixture that asks for the all-to-all dispatcher (a capacity factor) gets it over
        // the expert axis, its tokens split over that axis too.
        if let (true, Some(x), [axis]) = (dispatch, dim_with(cm, n, DimRole::Dispatch), experts) {
            let s: Vec<Option<usize>> = (0..k).map(|a| if a == *axis { Some(x) } else { t }).collect();
            if strategy_valid(sp, &s, &cm.mesh, cm.g, n) {
                return Some(s);
            }
        }
        let s: Vec<Option<usize>> = (0..k).map(|a| if experts.contains(&a) { Some(e) } else { t }).collect();
        if strategy_valid(sp, &s, &cm.mesh, cm.g, n) {
            return Some(s);
        }
        return batch().or_else(|| tensor.map(megatron));
    }
    match tensor {
        Some(t) => Some(megatron(t)),
        None => batch(),
    }
}

/// The expert-parallel plan over mesh axis `axis` (its devices the expert-parallel group, the
/// other axes data parallel), a seed of the search.
pub fn expert_over(cm: &CostModel<'_>, axis: usize) -> Result<Assignment, String> {
    let k = cm.mesh.axes.len();
    if axis >= k {
        return Err(format!("no mesh axis {axis}"));
    }
    expert_applies(cm, &[axis])?;
    let mut asg = Assignment::default();
    for &n in cm.order() {
        let s = expert_split(cm, &asg, n, (&[axis], true), None).unwrap_or_else(|| follow(cm, &asg, n));
        asg.strategies.insert(n, s);
    }
    Ok(asg)
}

/// Megatron's split of op `n` over `axes`: embeddings by vocabulary rows; a weighted GEMM
/// row-parallel when its activation arrives split along its input features over `axes`
/// (from a column-parallel GEMM before it), else column-parallel; `None` for other ops.
fn megatron(cm: &CostModel<'_>, asg: &Assignment, n: NodeId, axes: &[usize]) -> Option<Vec<Option<usize>>> {
    let g = cm.g;
    let node = g.node(n);
    let pick = |role: DimRole| dim_with(cm, n, role).and_then(|i| split_over_axes(cm, n, i, axes));
    if matches!(node.op, Op::Gather(_)) && node.input(0).is_some_and(|v| is_param_like(g, v)) {
        return pick(DimRole::Vocab);
    }
    if !is_weighted(cm, n) {
        return None;
    }
    // The activation's layout: split along its last dim over all of `axes`?
    let x = node.input(0)?;
    let arrives_split = asg.strategies.get(&x.node).is_some_and(|ps| {
        let (_, outs) = strategy_shardings(cm.space(x.node), ps);
        let rank = g.tensor_type(x).and_then(|t| t.rank()).unwrap_or(0);
        let have = &outs[x.slot as usize];
        rank > 0 && axes.iter().all(|&a| have.get(a) == Some(&AxisShard::Split((rank - 1) as u8)))
    });
    if arrives_split && let Some(s) = pick(DimRole::InFeature) {
        return Some(s);
    }
    // Column-parallel; where the devices do not divide the output features (a 50257-word
    // vocabulary on 8 devices: Megatron would pad it, a compiler may not change the model),
    // row-parallel on a replicated input (each device slices its rows locally).
    pick(DimRole::OutFeature).or_else(|| pick(DimRole::InFeature))
}

/// Builds the assignment of a named (non-pipeline) strategy, or says why it does not apply.
pub fn assign(cm: &CostModel<'_>, named: &Named) -> Result<Assignment, String> {
    assign_with(cm, named, true)
}

/// Whether some mixture of experts in the model asks for the all-to-all dispatcher.
pub fn has_dispatch(cm: &CostModel<'_>) -> bool {
    cm.order().iter().any(|&n| dim_with(cm, n, DimRole::Dispatch).is_some())
}

/// [`assign`], with `dispatch` false: an expert-parallel strategy's mixtures all-gather their
/// tokens even where they ask for the all-to-all dispatcher (the search prices both).
pub fn assign_with(cm: &CostModel<'_>, named: &Named, dispatch: bool) -> Result<Assignment, String> {
    // (The sequence dims, a flow over the whole graph, once: `context` checks and splits by them.)
    let is_context = matches!(named, Named::Context { .. });
    let sequence = if is_context { ir::dims::sequence_dims(cm.g) } else { Default::default() };
    let axes = context_axes(cm, named);
    applies(cm, named, &sequence)?;
    // (An expert-parallel strategy's expert and tensor axes.)
    let experts_on = if matches!(named, Named::Expert { .. }) { expert_axes(cm, named)? } else { Vec::new() };
    let expert_tensor = expert_tensor_axis(cm, named);
    let k = cm.mesh.axes.len();
    let all_axes: Vec<usize> = (0..k).collect();
    let mut asg = Assignment::default();
    let order: Vec<NodeId> = cm.order().to_vec();
    let is_fc = |n: NodeId| matches!(cm.g.node(n).op, Op::Gemm(_) | Op::MatMul(_));
    let windowed =
        |n: NodeId| matches!(cm.g.node(n).op, Op::Conv(_) | Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_));
    for &n in &order {
        let pick = |role: DimRole, axes: &[usize]| dim_with(cm, n, role).and_then(|i| split_over_axes(cm, n, i, axes));
        let s: Option<Vec<Option<usize>>> = match named {
            Named::Data => pick(DimRole::Batch, &all_axes),
            Named::Model => is_weighted(cm, n).then(|| pick(DimRole::OutFeature, &all_axes)).flatten(),
            Named::Megatron => megatron(cm, &asg, n, &all_axes).or_else(|| sequence_parallel(cm, &asg, n, &all_axes)),
            Named::Owt => {
                if is_weighted(cm, n) && is_fc(n) {
                    pick(DimRole::OutFeature, &all_axes)
                } else if !is_fc(n) && matches!(cm.g.node(n).op, Op::Conv(_)) {
                    pick(DimRole::Batch, &all_axes)
                } else {
                    None
                }
            }
            Named::Spatial => windowed(n).then(|| spatial_split(cm, n, &all_axes)).flatten(),
            Named::Context { ring, .. } => context_split(cm, &asg, n, &sequence, &axes, *ring),
            Named::Expert { .. } => expert_split(cm, &asg, n, (&experts_on, dispatch), expert_tensor),
            // Batch over axis 0, Megatron over axis 1, the rest following the input.
            Named::Hybrid { .. } => Some(data_then_megatron(cm, &asg, n, &[0], 1)),
            Named::SpatialHybrid(..) => {
                let mut s = vec![None; k];
                if let Some(b) = dim_with(cm, n, DimRole::Batch) {
                    s[0] = Some(b);
                    if !strategy_valid(cm.space(n), &s, &cm.mesh, cm.g, n) {
                        s[0] = None;
                    }
                }
                if windowed(n)
                    && let Some(sp) = spatial_split(cm, n, &[1])
                {
                    s[1] = sp[1];
                }
                (s.iter().any(Option::is_some)).then_some(s)
            }
            Named::Pipeline { .. } => unreachable!("refused by `applies`"),
        };
        let s = match s {
            Some(s) => {
                // Spatial hybrid: fill the second axis by following where the rule left it open.
                if let Named::SpatialHybrid(..) = named
                    && s[1].is_none()
                {
                    let f = follow(cm, &asg, n);
                    let mut merged = s.clone();
                    if f[1].is_some() && Some(f[1]) != Some(s[0]) {
                        merged[1] = f[1];
                    }
                    if strategy_valid(cm.space(n), &merged, &cm.mesh, cm.g, n) { merged } else { s }
                } else {
                    s
                }
            }
            None => follow(cm, &asg, n),
        };
        let s = at_home(cm, &asg, n).unwrap_or(s);
        asg.strategies.insert(n, s);
    }
    Ok(asg)
}

/// For an optimizer update (`SgdUpdate`, `AdamUpdate`) of a training graph, a strategy that
/// reads its parameter (input 0) in the layout the parameter is held in — its first reader's,
/// whole where that reader wants partial sums ([`ir::reshard::held_layout`]) — so the update
/// runs on the parameter's shard and the gradient is synchronised into it, as the training
/// derivation runs updates (`autoshard::training`): following the gradient instead updated a
/// split parameter replicated, gathering it every step.
fn at_home(cm: &CostModel<'_>, asg: &Assignment, n: NodeId) -> Option<Vec<Option<usize>>> {
    let g = cm.g;
    let node = g.node(n);
    if !node.op.is_update() {
        return None;
    }
    let p = node.input(0)?;
    let held = cm.order().iter().find_map(|&r| {
        let s = asg.strategies.get(&r).filter(|_| r != n)?;
        let j = g.node(r).inputs().iter().position(|v| *v == Some(p))?;
        let need = strategy_shardings(cm.space(r), s).0.get(j).cloned().flatten()?;
        Some(ir::reshard::held_layout(&need))
    })?;
    let candidates = crate::autoshard::problem::enumerate(cm, n);
    if cm.opts.zero >= 1
        && let Some(s) = candidates.iter().find(|s| zero_shard(cm, n, s, &held))
    {
        return Some(s.clone());
    }
    candidates.into_iter().find(|s| crate::autoshard::training::reads_parameter_as(cm, n, s, &held))
}

/// ZeRO-1 for update `n` (strategy `s`) of a parameter held as `held`: it reads the
/// parameter as held except on the axes that hold it whole, where it splits it — each device
/// updates its shard, with its shard of the optimizer state (the state is stored as its
/// update reads it), the gradient is reduce-scattered into the shard and the new value
/// all-gathered back into the parameter.
pub(crate) fn zero_shard(cm: &CostModel<'_>, n: NodeId, s: &[Option<usize>], held: &[AxisShard]) -> bool {
    let Some(Some(reads)) = strategy_shardings(cm.space(n), s).0.first().cloned() else { return false };
    let mut sharded = false;
    for (r, h) in reads.iter().zip(held) {
        match (h, r) {
            (AxisShard::Replicate, AxisShard::Split(_)) => sharded = true,
            _ if r == h => {}
            _ => return false,
        }
    }
    sharded
}

/// Data parallel over every mesh axis but `tp`, Megatron over `tp` (heads, MLP columns then
/// rows, the vocabulary), the rest following the input. The `hybrid` named strategy is this
/// with data on the first axis and Megatron on the second only; the search seeds its space
/// with one of these per axis, so plans that split attention by heads over any one axis,
/// with the batch over the others, are in it from the start.
pub fn hybrid_over(cm: &CostModel<'_>, tp: usize) -> Result<Assignment, String> {
    let k = cm.mesh.axes.len();
    if k < 2 || tp >= k {
        return Err(format!("a hybrid over axis {tp} needs a mesh of at least two axes that has it"));
    }
    let dp: Vec<usize> = (0..k).filter(|&a| a != tp).collect();
    let mut asg = Assignment::default();
    for &n in cm.order() {
        let s = data_then_megatron(cm, &asg, n, &dp, tp);
        asg.strategies.insert(n, s);
    }
    Ok(asg)
}

/// Op `n`'s strategy under data × context × tensor parallelism over `axes`
/// ([`context_axes`]): without a tensor axis [`data_then_context`]; with one, data and
/// Megatron ([`data_then_megatron`]), then Ulysses' split on the context axes where that is
/// valid beside them (attention: its heads over the context and the tensor axes).
fn context_split(
    cm: &CostModel<'_>,
    asg: &Assignment,
    n: NodeId,
    sequence: &super::context::SequenceDims,
    (dp, cp, tp): &(Vec<usize>, Vec<usize>, Vec<usize>),
    ring: bool,
) -> Option<Vec<Option<usize>>> {
    let Some(&t) = tp.first() else { return data_then_context(cm, n, sequence, dp, cp, ring) };
    let mut s = data_then_megatron(cm, asg, n, dp, t);
    if let Some(u) = super::context::context(cm, n, sequence, cp, ring) {
        let mut m = s.clone();
        for &a in cp {
            m[a] = u[a];
        }
        if strategy_valid(cm.space(n), &m, &cm.mesh, cm.g, n) {
            s = m;
        }
    }
    Some(s)
}

/// Op `n`'s strategy under data parallel over the axes `dp` and Ulysses over `cp`
/// ([`super::context::ulysses`]): the batch over `dp` where that is valid beside the op's
/// sequence (or heads) split; `None` where neither applies (the op follows its input).
fn data_then_context(
    cm: &CostModel<'_>,
    n: NodeId,
    sequence: &super::context::SequenceDims,
    dp: &[usize],
    cp: &[usize],
    ring: bool,
) -> Option<Vec<Option<usize>>> {
    let s = super::context::context(cm, n, sequence, cp, ring);
    let Some(b) = dim_with(cm, n, DimRole::Batch).filter(|_| !dp.is_empty()) else { return s };
    let mut t = s.clone().unwrap_or_else(|| vec![None; cm.mesh.axes.len()]);
    if cp.iter().any(|&a| t[a] == Some(b)) {
        return s;
    }
    for &a in dp {
        t[a] = Some(b);
    }
    if strategy_valid(cm.space(n), &t, &cm.mesh, cm.g, n) { Some(t) } else { s }
}

/// Op `n`'s strategy under data parallel over the axes `dp` and Megatron over axis `tp`,
/// the other axes following the input: the batch over `dp` (and off `tp`) where that is
/// valid, then Megatron's split on `tp` where that is.
fn data_then_megatron(cm: &CostModel<'_>, asg: &Assignment, n: NodeId, dp: &[usize], tp: usize) -> Vec<Option<usize>> {
    let mut s = follow(cm, asg, n);
    if let Some(b) = dim_with(cm, n, DimRole::Batch) {
        let mut t = s.clone();
        for &a in dp {
            t[a] = Some(b);
        }
        if t[tp] == Some(b) {
            t[tp] = None;
        }
        if strategy_valid(cm.space(n), &t, &cm.mesh, cm.g, n) {
            s = t;
        }
    }
    if let Some(m) = megatron(cm, asg, n, &[tp]).or_else(|| sequence_parallel(cm, asg, n, &[tp])) {
        let mut t = s.clone();
        t[tp] = m[tp];
        if strategy_valid(cm.space(n), &t, &cm.mesh, cm.g, n) {
            s = t;
        }
    }
    s
}

/// With [`super::model::Options::sequence_parallel`], Megatron's sequence parallelism for an
/// op between tensor-parallel regions (a normalization, a residual add, a bias add after a
/// row-parallel GEMM: one that would otherwise run whole or on partial sums over `axes`): its
/// sequence dim — of its output, after the first (the batch) and before the last (the
/// features) — split over `axes`. The row-parallel GEMM's all-reduce before it becomes a
/// reduce-scatter, the column-parallel GEMM after it all-gathers, and what it keeps shrinks
/// by the tensor degree (Korthikanti et al. 2022, §4.2.2).
fn sequence_parallel(cm: &CostModel<'_>, asg: &Assignment, n: NodeId, axes: &[usize]) -> Option<Vec<Option<usize>>> {
    if !cm.opts.sequence_parallel || is_weighted(cm, n) || crate::cost::model::is_view(&cm.g.node(n).op) {
        return None;
    }
    let sp = cm.space(n);
    let f = follow(cm, asg, n);
    let inside = axes.iter().any(|&a| f[a].is_some_and(|i| sp.dims[i].kind != DimKind::Reduction));
    if inside {
        return None;
    }
    let out = sp.outputs.first()?;
    if out.len() < 3 {
        return None;
    }
    let seq = out[1..out.len() - 1]
        .iter()
        .flatten()
        .copied()
        .find(|&i| sp.dims[i].role != DimRole::Batch && sp.dims[i].kind == DimKind::Parallel)?;
    let mut s = f;
    for &a in axes {
        s[a] = None;
    }
    let split = split_over_axes(cm, n, seq, axes)?;
    for &a in axes {
        s[a] = split[a];
    }
    strategy_valid(sp, &s, &cm.mesh, cm.g, n).then_some(s)
}

/// Splits the spatial dims of a windowed op over `axes`: the first spatial dim over all of
/// them when it divides, else one spatial dim per axis.
fn spatial_split(cm: &CostModel<'_>, n: NodeId, axes: &[usize]) -> Option<Vec<Option<usize>>> {
    let sp = cm.space(n);
    let spatial: Vec<usize> = (0..sp.dims.len())
        .filter(|&i| sp.dims[i].role == DimRole::Spatial && sp.dims[i].kind != DimKind::Fixed)
        .collect();
    let first = *spatial.first()?;
    if let Some(s) = split_over_axes(cm, n, first, axes)
        && axes.iter().all(|&a| s[a].is_some())
    {
        return Some(s);
    }
    let mut s = vec![None; cm.mesh.axes.len()];
    for (k, &a) in axes.iter().enumerate() {
        if let Some(&d) = spatial.get(k) {
            s[a] = Some(d);
        }
    }
    if strategy_valid(sp, &s, &cm.mesh, cm.g, n) { Some(s) } else { split_over_axes(cm, n, first, axes) }
}

/// A priced named strategy.
pub struct Priced {
    /// The mesh it ran on (a pipeline's: its first stage's).
    pub mesh: Mesh,
    /// The price.
    pub breakdown: Breakdown,
    /// Pipeline details, for `pipeline:S:M`.
    pub pipeline: Option<PipelineReport>,
    /// The strategies priced (a pipeline's first stage's, on its mesh).
    pub assignment: Assignment,
}

/// Prices a named strategy on `devices` devices of `cluster`. Errors say why the strategy does
/// not apply.
pub fn price(g: &Graph, cluster: &Cluster, devices: usize, named: &Named, opts: &Options) -> Result<Priced, String> {
    if let Named::Pipeline { stages, micro, schedule, tensor, expert } = named {
        // Priced as the search prices the pipelines it makes: one function for both.
        let shape = (*stages, *micro, *schedule, *tensor, *expert);
        let p = super::pipeline::price_configuration(g, cluster, devices, shape, opts)?;
        let first = p.stages.first().ok_or("a pipeline without stages")?;
        return Ok(Priced {
            mesh: first.sub_mesh.clone(),
            assignment: first.assignment.clone(),
            breakdown: p.breakdown.clone(),
            pipeline: Some(p.report()),
        });
    }
    let mesh = named.mesh(cluster, devices)?;
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let asg = assign(&cm, named)?;
    Ok(Priced { mesh, breakdown: cm.evaluate(&asg), pipeline: None, assignment: asg })
}
