//! What a plan uses each mesh axis for, per region of the model: the summary `plan` prints and the plan document carries.

use super::*;

/// What one mesh axis does in a plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AxisUse {
    /// The axis.
    pub axis: String,
    /// Devices along it.
    pub size: usize,
    /// `data` (batch dims), `tensor` (weights' feature or vocabulary dims), `spatial`,
    /// `other`, `mixed` (no kind splits 80% of what the axis splits), `unused`.
    pub kind: String,
    /// Share of the step's FLOPs that ops split over this axis, per kind (`{kind: share}`).
    pub shares: BTreeMap<String, f64>,
}

/// A plan in the terms ML engineers use.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanSummary {
    /// E.g. `data 2 × tensor 4, pipeline 1` or `pipeline 2 × 4 micro-batches (1f1b), stage 0: data 4`.
    pub text: String,
    /// Per axis of the (first stage's) mesh.
    pub axes: Vec<AxisUse>,
    /// Samples per second at the predicted step time.
    pub samples_per_s: Option<f64>,
    /// Tokens per second (sequence models: an integer input of rank 2, `[batch, sequence]`).
    pub tokens_per_s: Option<f64>,
    /// Model FLOPs utilisation: the training step's FLOPs (forward and backward) over the
    /// predicted step time times the devices' peak in the training precision.
    pub mfu: Option<f64>,
    /// Consecutive blocks of the model (by the exporter's module paths, [`ir::scope`]) that
    /// the plan parallelises alike, with their degrees; one region when it is uniform.
    #[serde(default)]
    pub regions: Vec<Region>,
    /// What the plan does to save memory, as a configuration's fields
    /// (`recompute=selective,sp,zero=1`; `none`).
    #[serde(default)]
    pub memory: String,
}

/// Consecutive blocks of a model parallelised alike.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Region {
    /// Its first block.
    pub first: String,
    /// Its last block.
    pub last: String,
    /// Its degrees, e.g. `data 2 × tensor 4`.
    pub degrees: String,
    /// Its share of the step's FLOPs.
    pub flops_share: f64,
}

/// The kind of parallelism splitting a dim of this role is: `data` (batch), `spatial`,
/// `tensor` (a weight's feature or vocabulary dim), `expert` (a mixture's experts), `context`
/// (an attention's sequence, as ring attention) or `other`.
pub fn role_kind(r: &ir::shard::DimRole) -> &'static str {
    match r {
        ir::shard::DimRole::Batch => "data",
        ir::shard::DimRole::Spatial => "spatial",
        ir::shard::DimRole::OutFeature | ir::shard::DimRole::InFeature | ir::shard::DimRole::Vocab => "tensor",
        ir::shard::DimRole::Expert | ir::shard::DimRole::Dispatch => "expert",
        ir::shard::DimRole::Sequence => "context",
        ir::shard::DimRole::Other => "other",
    }
}

/// The kind of parallelism splitting iteration dim `i` of op `n` is: its role's
/// ([`role_kind`]), but `context` for a weighted layer's rows that are not the batch (the
/// sequence: context parallelism splits the tokens of one sequence).
pub fn split_kind(cm: &CostModel<'_>, n: NodeId, i: usize) -> &'static str {
    let row = |d: &ir::shard::IterDim| d.role == ir::shard::DimRole::Other && d.kind == ir::shard::DimKind::Parallel;
    let sp = cm.space(n);
    // A mixture's tokens split over an axis ride along that axis' kind (data parallel beside
    // the experts' split, or the tensor axis' sequence split): not a kind of their own.
    let mixture = sp.dims.iter().any(|d| d.role == ir::shard::DimRole::Expert);
    match sp.dims.get(i) {
        Some(d) if mixture && !matches!(d.role, ir::shard::DimRole::Expert | ir::shard::DimRole::Dispatch) => "other",
        Some(d) if row(d) && crate::autoshard::named::is_weighted(cm, n) => "context",
        Some(d) => role_kind(&d.role),
        None => "other",
    }
}

/// `kind`, or for a split of a dim without a role of its own (`other`) the kind of its axis in
/// the whole plan (`whole`), when that axis has one kind: the element-wise ops between two
/// tensor-parallel GEMMs are tensor parallel too.
pub(super) fn inherit_kind<'a>(kind: &'a str, whole: Option<&'a AxisUse>) -> &'a str {
    match whole {
        Some(w) if kind == "other" && !matches!(w.kind.as_str(), "mixed" | "unused") => w.kind.as_str(),
        _ => kind,
    }
}

/// Classifies each mesh axis by the roles of the iteration dims the ops split over it,
/// weighted by each op's training FLOPs.
pub(super) fn axis_uses(cm: &CostModel<'_>, asg: &Assignment) -> Vec<AxisUse> {
    axis_uses_of(cm, asg, cm.order())
}

/// [`axis_uses`] over the ops of `ops` only.
pub(super) fn axis_uses_of(cm: &CostModel<'_>, asg: &Assignment, ops: &[NodeId]) -> Vec<AxisUse> {
    let mesh = &cm.mesh;
    let mut total = 0.0;
    let mut per: Vec<BTreeMap<String, f64>> = vec![BTreeMap::new(); mesh.axes.len()];
    for &n in ops {
        let flops = cm.node_cost(n).total_flops();
        total += flops;
        let Some(s) = asg.strategies.get(&n) else { continue };
        for (a, d) in s.iter().enumerate() {
            let Some(i) = d else { continue };
            let kind = split_kind(cm, n, *i);
            if let Some(m) = per.get_mut(a) {
                *m.entry(kind.to_string()).or_insert(0.0) += flops;
            }
        }
    }
    mesh.axes
        .iter()
        .zip(per)
        .map(|(ax, m)| {
            let split: f64 = m.values().sum();
            let shares: BTreeMap<String, f64> = m.into_iter().map(|(k, v)| (k, v / total.max(1e-300))).collect();
            let top = shares.iter().max_by(|a, b| a.1.total_cmp(b.1));
            // (Under context parallelism the attention between the layers splits heads, a
            // dim without a role — at long sequences most of the FLOPs: an axis whose weighted
            // layers split their sequence rows and whose other splits have no role is context.)
            let context = shares.get("context").copied().unwrap_or(0.0);
            let roleless = shares.get("other").copied().unwrap_or(0.0);
            // (Splits without a role ride along the axis' one role: under tensor parallelism
            // at a long sequence the attention between the GEMMs, heads split, can be most of
            // the axis' FLOPs.)
            let role = shares.iter().filter(|(k, _)| k.as_str() != "other").max_by(|a, b| a.1.total_cmp(b.1));
            // (Expert parallelism is carved from the data-parallel ranks: an axis over which the
            // mixtures split their experts and every other op its batch is an expert axis.)
            let expert = shares.get("expert").is_some_and(|&v| v > 0.0)
                && shares.keys().all(|k| matches!(k.as_str(), "expert" | "data" | "other"));
            let kind = match top {
                _ if ax.size <= 1 || split <= 0.0 => "unused".to_string(),
                _ if expert => "expert".to_string(),
                _ if context > 0.0 && (context + roleless) * total >= 0.999 * split => "context".to_string(),
                _ if role.is_some_and(|(_, v)| (v + roleless) * total >= 0.8 * split) => role.unwrap().0.clone(),
                Some((k, v)) if *v * total >= 0.8 * split => k.clone(),
                _ => "mixed".to_string(),
            };
            AxisUse { axis: ax.name.clone(), size: ax.size, kind, shares }
        })
        .collect()
}

/// What each op of `cm`'s order does under `asg`, in the summary's terms: `data 2 × tensor 4`
/// from the roles of the dims it splits over each mesh axis, `replicated` when it splits none.
/// A dim without a role of its own (an element-wise op's) takes the kind of its axis in
/// `axes` (the plan's [`AxisUse`]s), so the ops between two tensor-parallel GEMMs read as
/// tensor parallel.
pub fn op_kinds(cm: &CostModel<'_>, asg: &Assignment, axes: &[AxisUse]) -> Vec<String> {
    cm.order()
        .iter()
        .map(|&n| {
            let mut by: Vec<(&str, usize)> = Vec::new();
            if let Some(s) = asg.strategies.get(&n) {
                for (a, d) in s.iter().enumerate() {
                    let Some(i) = d else { continue };
                    let own = split_kind(cm, n, *i);
                    let kind = inherit_kind(own, axes.get(a));
                    let size = cm.mesh.axes.get(a).map_or(1, |x| x.size);
                    match by.iter_mut().find(|(k, _)| *k == kind) {
                        Some(e) => e.1 *= size,
                        None => by.push((kind, size)),
                    }
                }
            }
            if by.is_empty() {
                "replicated".to_string()
            } else {
                by.iter().map(|(k, s)| format!("{k} {s}")).collect::<Vec<_>>().join(" × ")
            }
        })
        .collect()
}

/// The regions of a plan: its blocks in model order ([`ir::scope::block_of`] of each op's
/// module path), each with the degrees of its own ops (FLOP-weighted as for the whole plan),
/// consecutive blocks with the same degrees merged; blocks without FLOPs, and glue blocks
/// that split only role-less dims, join the region before them.
pub(super) fn regions(g: &Graph, cm: &CostModel<'_>, asg: &Assignment, whole: &[AxisUse]) -> Vec<Region> {
    let order = cm.order();
    let paths = ir::scope::module_paths(g, order);
    let mut blocks: Vec<(String, Vec<NodeId>)> = Vec::new();
    for &n in order {
        let b = paths.get(&n).map(|p| ir::scope::block_of(p)).unwrap_or_default();
        match blocks.last_mut() {
            Some((last, ops)) if *last == b => ops.push(n),
            _ => blocks.push((b, vec![n])),
        }
    }
    let flops = |ops: &[NodeId]| ops.iter().map(|&n| cm.node_cost(n).total_flops()).sum::<f64>();
    let total = flops(order).max(1e-300);
    let mut out: Vec<Region> = Vec::new();
    for (b, ops) in blocks {
        let f = flops(&ops);
        let name = if b.is_empty() { "(unnamed)".to_string() } else { b };
        // Dims without a role of their own (an activation's, a pooling's channels) take their
        // axis's kind in the whole plan; a block that splits nothing else (`relu`, `maxpool`
        // between two layers) is glue and joins the region before it.
        let mut uses = axis_uses_of(cm, asg, &ops);
        for (u, w) in uses.iter_mut().zip(whole) {
            u.kind = inherit_kind(&u.kind, Some(w)).to_string();
        }
        let glue = uses.iter().all(|u| matches!(u.kind.as_str(), "other" | "unused"));
        if let Some(r) = out.last_mut()
            && (f <= 0.0 || glue)
        {
            r.last = name;
            r.flops_share += f / total;
            continue;
        }
        if f <= 0.0 {
            continue;
        }
        let d = degrees(&uses);
        match out.last_mut() {
            Some(r) if r.degrees == d => {
                r.last = name;
                r.flops_share += f / total;
            }
            _ => out.push(Region { first: name.clone(), last: name, degrees: d, flops_share: f / total }),
        }
    }
    out
}

/// `data 2 × tensor 4` from axis uses (axes of one kind multiply; `mixed` lists its kinds).
pub(super) fn degrees(axes: &[AxisUse]) -> String {
    // (kind, detail for a mixed axis, devices)
    let mut by_kind: Vec<(String, String, usize)> = Vec::new();
    for a in axes.iter().filter(|a| a.kind != "unused") {
        let detail = if a.kind == "mixed" {
            let kinds: Vec<String> =
                a.shares.iter().filter(|(_, v)| **v >= 0.005).map(|(k, v)| format!("{k} {:.0}%", v * 100.0)).collect();
            format!(" ({} of the FLOPs)", kinds.join(", "))
        } else {
            String::new()
        };
        match by_kind.iter_mut().find(|(k, d, _)| *k == a.kind && *d == detail) {
            Some(e) => e.2 *= a.size,
            None => by_kind.push((a.kind.clone(), detail, a.size)),
        }
    }
    if by_kind.is_empty() {
        return "replicated (no op split)".into();
    }
    by_kind.iter().map(|(k, d, n)| format!("{k} {n}{d}")).collect::<Vec<_>>().join(" × ")
}

impl PlanSummary {
    pub(super) fn of(
        cms: &[CostModel<'_>],
        cluster: &Cluster,
        opts: &Options,
        devices: usize,
        r: &SearchResult,
    ) -> PlanSummary {
        let pipeline = r.pipeline.as_ref().map(|p| (p.stages.len(), p.micro_batches, p.schedule.name()));
        match cms.first() {
            Some(cm) => PlanSummary::new(cm, &r.assignment, cluster, opts, devices, r.breakdown.step_time_s, pipeline),
            None => PlanSummary::default(),
        }
    }

    /// The summary of `asg` on `cm`'s mesh (the first stage's, for a pipeline of `stages ×
    /// micro-batches (schedule)`), at step time `step` on `devices` devices.
    pub fn new(
        cm: &CostModel<'_>,
        asg: &Assignment,
        cluster: &Cluster,
        opts: &Options,
        devices: usize,
        step: f64,
        pipeline: Option<(usize, usize, String)>,
    ) -> PlanSummary {
        let g = cm.g;
        let axes = axis_uses(cm, asg);
        let regions = regions(g, cm, asg, &axes);
        // A plan that parallelises regions of the model differently says so region by
        // region.
        let whole = if axes.iter().any(|a| a.kind == "mixed") && regions.len() > 1 {
            let parts: Vec<String> = regions
                .iter()
                .map(|r| {
                    let span = if r.first == r.last { r.first.clone() } else { format!("{} … {}", r.first, r.last) };
                    format!("{} in {span}", r.degrees)
                })
                .collect();
            format!("mixed: {}", parts.join("; "))
        } else {
            degrees(&axes)
        };
        let text = match pipeline {
            Some((stages, micro, schedule)) if asg.strategies.is_empty() => {
                format!("pipeline {stages} × {micro} micro-batches ({schedule})")
            }
            Some((stages, micro, schedule)) => {
                format!("pipeline {stages} × {micro} micro-batches ({schedule}); stage 0: {whole}")
            }
            None => format!("{whole}, pipeline 1"),
        };
        let batch = crate::cost::pipeline::graph_batch(g).map(|b| b as f64);
        let tokens = g.input_values().into_iter().find_map(|v| {
            let t = g.tensor_type(v)?;
            let d = t.static_dims()?;
            (!t.dtype.is_float() && d.len() == 2).then(|| (d[0] * d[1]) as f64)
        });
        let flops: f64 = cm.order().iter().map(|&n| cm.node_cost(n).total_flops()).sum();
        let peak = cluster.device.peak_flops.at(opts.precision);
        let ok = step > 0.0 && step.is_finite();
        // Sequence parallelism only changes plans with tensor parallelism.
        let tensor = axes.iter().any(|a| a.shares.get("tensor").is_some_and(|&x| x > 0.0));
        let memory = Options { sequence_parallel: opts.sequence_parallel && tensor, ..opts.clone() }.memory_fields();
        PlanSummary {
            text,
            axes,
            samples_per_s: batch.filter(|_| ok).map(|b| b / step),
            tokens_per_s: tokens.filter(|_| ok).map(|t| t / step),
            mfu: (ok && flops > 0.0 && peak > 0.0).then(|| flops / (step * devices as f64 * peak)),
            regions,
            memory,
        }
    }

    /// The `parallelism` and `throughput` lines `plan` and `cost` print.
    pub fn lines(&self) -> String {
        let mut t = format!("parallelism  {}\n", self.text);
        if !self.memory.is_empty() && self.memory != "none" {
            t.push_str(&format!("memory saved {}\n", self.memory));
        }
        let mut rates = Vec::new();
        if let Some(x) = self.samples_per_s {
            rates.push(format!("{x:.1} samples/s"));
        }
        if let Some(x) = self.tokens_per_s {
            rates.push(format!("{x:.0} tokens/s"));
        }
        if let Some(x) = self.mfu {
            rates.push(format!("model FLOPs utilisation {:.1}%", x * 100.0));
        }
        if !rates.is_empty() {
            t.push_str(&format!("throughput   {}\n", rates.join(", ")));
        }
        t
    }
}
