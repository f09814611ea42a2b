//! Named strategies, so they can be compared: each is a rule that gives every op a strategy.
//!
//! - `data`: every op splits its batch dim over all devices (parameters replicated).
//! - `model`: weighted ops split their output features (GEMM columns, conv filters) over all
//!   devices; other ops follow the layout of their input (Castelló et al.'s model parallelism).
//! - `spatial`: convolutions and pooling split their spatial dims, with halo exchange
//!   (Dryden et al.); other ops follow.
//! - `hybrid:DxS`: a `D × S` mesh, batch over the first axis and spatial over the second.
//! - `owt`: convolutions data parallel, fully connected layers model parallel (Krizhevsky's
//!   "one weird trick").
//! - `pipeline:S:M[:gpipe|:1f1b]`: S balanced stages, M micro-batches (see `pipeline`).

use ir::shard::{AxisShard, DimKind, DimRole, LinkLevel, Mesh, MeshAxis, strategy_shardings, strategy_valid};
use ir::{NodeId, Op, Value};

use super::model::{Assignment, CostModel};

/// A pipeline schedule.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Schedule {
    /// All micro-batch forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward, in steady state.
    #[serde(rename = "1f1b")]
    OneFOneB,
}

/// A parsed strategy name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Named {
    /// Data parallel.
    Data,
    /// Tensor (model) parallel.
    Model,
    /// Spatial parallel.
    Spatial,
    /// Sample × spatial on a `D × S` mesh.
    Hybrid(usize, usize),
    /// Data-parallel convolutions, model-parallel fully connected layers.
    Owt,
    /// Pipeline: stages, micro-batches, schedule.
    Pipeline(usize, usize, Schedule),
}

impl Named {
    /// Parses a strategy name.
    pub fn parse(s: &str) -> Result<Named, String> {
        let parts: Vec<&str> = s.split(':').collect();
        Ok(match parts.as_slice() {
            ["data"] => Named::Data,
            ["model"] => Named::Model,
            ["spatial"] => Named::Spatial,
            ["owt"] => Named::Owt,
            ["hybrid", ds] => {
                let (d, sp) =
                    ds.split_once(['x', 'X']).ok_or_else(|| format!("`{s}`: write hybrid:DxS, e.g. hybrid:2x4"))?;
                let d = d.parse().map_err(|_| format!("`{s}`: D must be a number"))?;
                let sp = sp.parse().map_err(|_| format!("`{s}`: S must be a number"))?;
                if d == 0 || sp == 0 {
                    return Err(format!("`{s}`: D and S must be at least 1"));
                }
                Named::Hybrid(d, sp)
            }
            ["pipeline", st, m, rest @ ..] => {
                let st: usize = st.parse().map_err(|_| format!("`{s}`: the stage count must be a number"))?;
                let m: usize = m.parse().map_err(|_| format!("`{s}`: the micro-batch count must be a number"))?;
                if st == 0 || m == 0 {
                    return Err(format!("`{s}`: stages and micro-batches must be at least 1"));
                }
                let sched = match rest {
                    [] | ["1f1b"] => Schedule::OneFOneB,
                    ["gpipe"] => Schedule::GPipe,
                    _ => return Err(format!("`{s}`: the schedule is gpipe or 1f1b")),
                };
                Named::Pipeline(st, m, sched)
            }
            _ => {
                return Err(format!(
                    "unknown strategy `{s}`; strategies are data, model, spatial, hybrid:DxS, owt, pipeline:S:M[:gpipe|:1f1b]"
                ));
            }
        })
    }

    /// The mesh the strategy runs on, for `devices` devices of `cluster`.
    pub fn mesh(&self, cluster: &super::cluster::Cluster, devices: usize) -> Result<Mesh, String> {
        match self {
            Named::Hybrid(d, s) => {
                if d * s != devices {
                    return Err(format!("hybrid:{d}x{s} needs {} devices, {devices} given", d * s));
                }
                cluster.mesh(devices)?;
                let dpn = cluster.devices_per_node;
                let (l0, l1) = if devices <= dpn {
                    (LinkLevel::Intra, LinkLevel::Intra)
                } else if *s <= dpn && dpn.is_multiple_of(*s) {
                    (LinkLevel::Inter, LinkLevel::Intra)
                } else {
                    (LinkLevel::Inter, LinkLevel::Inter)
                };
                Ok(Mesh {
                    axes: vec![
                        MeshAxis { name: "samples".into(), size: *d, level: l0 },
                        MeshAxis { name: "space".into(), size: *s, level: l1 },
                    ],
                })
            }
            _ => cluster.mesh(devices),
        }
    }
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

/// Builds the assignment of a named (non-pipeline) strategy, or says why it does not apply.
pub fn assign(cm: &CostModel<'_>, named: &Named) -> Result<Assignment, String> {
    let k = cm.mesh.axes.len();
    let all_axes: Vec<usize> = (0..k).collect();
    let mut asg = Assignment::default();
    let order: Vec<NodeId> = cm.order().to_vec();
    let has_batch = order.iter().any(|&n| dim_with(cm, n, DimRole::Batch).is_some());
    let has_spatial = order.iter().any(|&n| {
        dim_with(cm, n, DimRole::Spatial).is_some()
            && matches!(cm.g.node(n).op, Op::Conv(_) | Op::MaxPool(_) | Op::AveragePool(_))
    });
    let weighted: Vec<NodeId> = order.iter().copied().filter(|&n| is_weighted(cm, n)).collect();
    let is_fc = |n: NodeId| matches!(cm.g.node(n).op, Op::Gemm(_) | Op::MatMul(_));
    match named {
        Named::Data if !has_batch => return Err("data: no op has a dim that carries the batch".into()),
        Named::Model if weighted.is_empty() => return Err("model: the model has no layer with weights to split".into()),
        Named::Spatial | Named::Hybrid(..) if !has_spatial => {
            return Err(format!(
                "{}: the model has no convolution or pooling with spatial dims to split",
                if matches!(named, Named::Spatial) { "spatial" } else { "hybrid" }
            ));
        }
        Named::Owt if !weighted.iter().any(|&n| is_fc(n)) || !weighted.iter().any(|&n| !is_fc(n)) => {
            return Err(
                "owt: needs both convolutions (data parallel) and fully connected layers (model parallel)".into()
            );
        }
        Named::Pipeline(..) => return Err("pipeline strategies are priced by the pipeline model".into()),
        _ => {}
    }
    for &n in &order {
        let pick = |role: DimRole, axes: &[usize]| dim_with(cm, n, role).and_then(|i| split_over_axes(cm, n, i, axes));
        let s: Option<Vec<Option<usize>>> = match named {
            Named::Data => pick(DimRole::Batch, &all_axes),
            Named::Model => {
                if is_weighted(cm, n) {
                    pick(DimRole::OutFeature, &all_axes)
                } else {
                    None
                }
            }
            Named::Owt => {
                if is_weighted(cm, n) && is_fc(n) {
                    pick(DimRole::OutFeature, &all_axes)
                } else if !is_fc(n) && matches!(cm.g.node(n).op, Op::Conv(_)) {
                    pick(DimRole::Batch, &all_axes)
                } else {
                    None
                }
            }
            Named::Spatial => {
                if matches!(cm.g.node(n).op, Op::Conv(_) | Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_)) {
                    spatial_split(cm, n, &all_axes)
                } else {
                    None
                }
            }
            Named::Hybrid(..) => {
                let mut s = vec![None; k];
                if let Some(b) = dim_with(cm, n, DimRole::Batch) {
                    s[0] = Some(b);
                    if !strategy_valid(cm.space(n), &s, &cm.mesh, cm.g, n) {
                        s[0] = None;
                    }
                }
                if matches!(cm.g.node(n).op, Op::Conv(_) | Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_))
                    && let Some(sp) = spatial_split(cm, n, &[1])
                {
                    s[1] = sp[1];
                }
                (s.iter().any(Option::is_some)).then_some(s)
            }
            Named::Pipeline(..) => unreachable!(),
        };
        let s = match s {
            Some(s) => {
                // Hybrid: fill the batch axis by following where the rule left it open.
                if let Named::Hybrid(..) = named
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
        asg.strategies.insert(n, s);
    }
    Ok(asg)
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
