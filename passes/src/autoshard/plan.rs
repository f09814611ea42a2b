//! The plan: what the search chose, as a versioned JSON document (the contract with codegen
//! and other tools), a per-layer report, and IR annotations that parse back.
//!
//! The JSON schema (`format: "shardc-plan"`, `version: 1`) is documented in the README.

use std::collections::BTreeMap;

use ir::shard::{LinkLevel, Mesh, MeshAxis, Sharding, parse_sharding, sharding_to_string, strategy_shardings};
use ir::{Graph, NodeId, Op, Value};
use serde::{Deserialize, Serialize};

use super::{MeshSearch, SearchResult};
use crate::cost::model::{Phase, is_host};
use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options};

/// The plan format's name.
pub const FORMAT: &str = "shardc-plan";
/// The plan format's version.
pub const VERSION: u32 = 1;

/// Where the model came from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// The file, as given.
    pub path: String,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
    /// The graph's name.
    pub graph: String,
    /// The batch size planned for (the first graph input's leading dim), if known.
    pub batch: Option<i64>,
    /// Graph inputs' shapes as planned (after `--batch` / `--input-shape`).
    pub input_shapes: BTreeMap<String, Vec<i64>>,
}

/// One mesh axis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanAxis {
    /// Name.
    pub name: String,
    /// Devices along it.
    pub size: usize,
    /// `intra` (inside a node) or `inter` (across nodes).
    pub level: String,
}

/// One op's strategy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanOp {
    /// The node's label, or its first output's name.
    pub name: String,
    /// The ONNX op type.
    pub op: String,
    /// Its outputs' names (the first one identifies the op).
    pub outputs: Vec<String>,
    /// Per mesh axis: the index of the iteration dim split over it, or null.
    pub split: Vec<Option<usize>>,
    /// Per mesh axis: that dim's name, or null.
    pub split_names: Vec<Option<String>>,
    /// Readable strategy (`b→nodes, n→gpus` or `replicated`).
    pub strategy: String,
    /// Per input: the layout it needs (`[S(0), R]`), or null for an input it reads whole
    /// from the host (shapes, indices) or an omitted one.
    pub inputs: Vec<Option<String>>,
    /// Per output: the layout it produces.
    pub output_layouts: Vec<String>,
    /// Forward + backward compute, seconds.
    pub compute_s: f64,
    /// Communication attributed to it, seconds.
    pub communication_s: f64,
    /// Activation bytes it keeps per device.
    pub memory_bytes: f64,
}

/// One tensor's layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanTensor {
    /// Its name.
    pub name: String,
    /// `input`, `parameter`, `constant` or `activation`.
    pub kind: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// The layout it is produced (or stored) in.
    pub layout: String,
    /// Each device's piece.
    pub local_shape: Vec<i64>,
}

/// One communication the plan inserts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanCollective {
    /// `forward`, `backward` or `gradient`.
    pub phase: String,
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `halo` …
    pub kind: String,
    /// The tensor moved.
    pub tensor: String,
    /// The op it is for, if any.
    pub op: Option<String>,
    /// Layout before and after.
    pub from: String,
    /// Layout after.
    pub to: String,
    /// Mesh axes it runs over.
    pub axes: Vec<String>,
    /// Bytes per device.
    pub bytes: f64,
    /// Seconds.
    pub time_s: f64,
}

/// Search statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanSearch {
    /// Per mesh tried: the e-graph, the extraction, the best plan on it.
    pub meshes: serde_json::Value,
    /// The chosen plan equals this named plan (`data`, `owt`…), if it does.
    pub same_as: Option<String>,
    /// The time limit cut the search short.
    pub time_limit_hit: bool,
    /// Seconds.
    pub time_s: f64,
}

/// A sharding plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Always `shardc-plan`.
    pub format: String,
    /// Format version.
    pub version: u32,
    /// The model.
    pub model: ModelInfo,
    /// The cluster's name.
    pub cluster: String,
    /// Devices used.
    pub devices: usize,
    /// The device mesh.
    pub mesh: Vec<PlanAxis>,
    /// Cost-model options.
    pub options: serde_json::Value,
    /// Predicted step time of this plan, seconds.
    pub step_time_s: f64,
    /// The same model as pure data parallelism on the cluster's natural mesh, seconds; null
    /// when that does not fit or does not apply.
    pub data_parallel_step_time_s: Option<f64>,
    /// `data_parallel_step_time_s / step_time_s`.
    pub speedup_over_data_parallel: Option<f64>,
    /// The plan fits in device memory.
    pub feasible: bool,
    /// Why not, when it does not.
    pub infeasible_reason: Option<String>,
    /// Memory per device, bytes (the fullest device).
    pub memory_per_device_bytes: u64,
    /// Usable memory per device, bytes.
    pub memory_capacity_bytes: u64,
    /// Seconds the search took.
    pub search_time_s: f64,
    /// The step's breakdown (the `shardc cost --json` keys).
    pub breakdown: serde_json::Value,
    /// Per op (topological order).
    pub ops: Vec<PlanOp>,
    /// Per tensor that has a layout.
    pub tensors: Vec<PlanTensor>,
    /// Inserted communication, in step order.
    pub collectives: Vec<PlanCollective>,
    /// Search statistics.
    pub search: PlanSearch,
    /// Pipeline stages, when the plan pipelines (null otherwise).
    pub pipeline: Option<serde_json::Value>,
}

fn level_name(l: LinkLevel) -> &'static str {
    match l {
        LinkLevel::Intra => "intra",
        LinkLevel::Inter => "inter",
    }
}

/// A name for an op: its label, or its first output's name.
pub fn op_name(g: &Graph, n: NodeId) -> String {
    let node = g.node(n);
    node.label.clone().unwrap_or_else(|| node.outputs().first().map(|o| o.name.clone()).unwrap_or_default())
}

fn value_name(g: &Graph, v: Value) -> String {
    g.value_name(v).to_string()
}

impl Plan {
    /// Builds the plan document of a search result.
    pub fn new(
        g: &Graph,
        cluster: &Cluster,
        devices: usize,
        opts: &Options,
        model: ModelInfo,
        r: &SearchResult,
    ) -> Plan {
        let cm = CostModel::new(g, cluster, r.mesh.clone(), opts.clone());
        let b = &r.breakdown;
        let dp = r.data_parallel.as_ref().filter(|d| d.feasible).map(|d| d.step_time_s);
        let (ops, tensors) = layouts(&cm, &r.assignment, b);
        Plan {
            format: FORMAT.into(),
            version: VERSION,
            model,
            cluster: cluster.name.clone(),
            devices,
            mesh: r
                .mesh
                .axes
                .iter()
                .map(|a| PlanAxis { name: a.name.clone(), size: a.size, level: level_name(a.level).into() })
                .collect(),
            options: serde_json::to_value(opts).expect("options serialize"),
            step_time_s: b.step_time_s,
            data_parallel_step_time_s: dp,
            speedup_over_data_parallel: dp.filter(|_| b.feasible).map(|d| d / b.step_time_s),
            feasible: b.feasible,
            infeasible_reason: b.infeasible_reason.clone(),
            memory_per_device_bytes: b.memory_per_device_bytes.iter().copied().max().unwrap_or(0),
            memory_capacity_bytes: b.memory_capacity_bytes,
            search_time_s: r.search_time_s,
            breakdown: breakdown_json(b),
            ops,
            tensors,
            collectives: collectives(g, &r.mesh, b),
            search: PlanSearch {
                meshes: serde_json::to_value::<&[MeshSearch]>(&r.meshes).expect("stats serialize"),
                same_as: r.same_as.clone(),
                time_limit_hit: r.time_limit_hit,
                time_s: r.search_time_s,
            },
            pipeline: None,
        }
    }

    /// The plan's mesh.
    pub fn mesh(&self) -> Result<Mesh, String> {
        let axes = self
            .mesh
            .iter()
            .map(|a| {
                let level = match a.level.as_str() {
                    "intra" => LinkLevel::Intra,
                    "inter" => LinkLevel::Inter,
                    l => return Err(format!("mesh axis `{}`: unknown level `{l}`", a.name)),
                };
                Ok(MeshAxis { name: a.name.clone(), size: a.size, level })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Mesh { axes })
    }

    /// Reads a plan document, checking its format and version.
    pub fn from_json(text: &str) -> Result<Plan, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        match v.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            Some(f) => return Err(format!("format `{f}` is not `{FORMAT}`")),
            None => return Err(format!("no `format` key; not a {FORMAT} document")),
        }
        match v.get("version").and_then(|f| f.as_u64()) {
            Some(x) if x == VERSION as u64 => {}
            Some(x) => return Err(format!("plan version {x}; this shardc reads version {VERSION}")),
            None => return Err("no `version` key".into()),
        }
        serde_json::from_value(v).map_err(|e| format!("malformed plan: {e}"))
    }

    /// The plan's strategies as an assignment of `g`'s ops, matching ops by their first
    /// output's name. Errors name ops the plan does not cover or whose strategy does not fit.
    pub fn assignment(&self, g: &Graph) -> Result<Assignment, String> {
        let mesh = self.mesh()?;
        let by_output: BTreeMap<&str, &PlanOp> =
            self.ops.iter().filter_map(|o| Some((o.outputs.first()?.as_str(), o))).collect();
        let mut asg = Assignment::default();
        for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
            let key = g.node(n).outputs().first().map(|o| o.name.as_str()).unwrap_or("");
            let Some(op) = by_output.get(key) else {
                return Err(format!("the plan has no strategy for {}", g.describe(n)));
            };
            check_strategy(g, n, &op.split, &mesh)?;
            asg.strategies.insert(n, op.split.clone());
        }
        Ok(asg)
    }
}

fn check_strategy(g: &Graph, n: NodeId, split: &[Option<usize>], mesh: &Mesh) -> Result<(), String> {
    if split.len() != mesh.axes.len() {
        return Err(format!("{}: the strategy has {} axes, the mesh {}", g.describe(n), split.len(), mesh.axes.len()));
    }
    if split.iter().all(Option::is_none) {
        return Ok(());
    }
    let sp = ir::shard::iter_space(g, n);
    if !ir::shard::strategy_valid(&sp, split, mesh, g, n) {
        return Err(format!("{}: the strategy {split:?} does not fit its iteration space", g.describe(n)));
    }
    Ok(())
}

fn breakdown_json(b: &Breakdown) -> serde_json::Value {
    let mut v = serde_json::to_value(b).expect("breakdown serializes");
    if let Some(o) = v.as_object_mut() {
        o.remove("ops");
    }
    v
}

fn layouts(cm: &CostModel<'_>, asg: &Assignment, b: &Breakdown) -> (Vec<PlanOp>, Vec<PlanTensor>) {
    let g = cm.g;
    let mesh = &cm.mesh;
    let mut ops = Vec::new();
    let mut tensors: Vec<PlanTensor> = Vec::new();
    let mut seen: std::collections::HashSet<Value> = std::collections::HashSet::new();
    let shape = |v: Value| g.tensor_type(v).and_then(|t| t.static_dims()).unwrap_or_default();
    let mut tensor = |v: Value, kind: &str, l: &Sharding, tensors: &mut Vec<PlanTensor>| {
        if seen.insert(v) && !g.value_name(v).is_empty() {
            let s = shape(v);
            tensors.push(PlanTensor {
                name: value_name(g, v),
                kind: kind.into(),
                local_shape: ir::shard::local_dims(&s, l, mesh),
                shape: s,
                layout: sharding_to_string(l),
            });
        }
    };
    for (i, &n) in cm.order().iter().enumerate() {
        let node = g.node(n);
        let s = cm.strategy_of(asg, n);
        let sp = cm.space(n);
        let (ins, outs) = strategy_shardings(sp, &s);
        for (j, v) in node.inputs().iter().enumerate() {
            let (Some(v), Some(Some(l))) = (v, ins.get(j)) else { continue };
            let kind = match &g.node(v.node).op {
                Op::Input { default: None } => "input",
                Op::Input { .. } | Op::Initializer(_) if ir::cost::is_param(g, *v) => "parameter",
                Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => "constant",
                _ => continue,
            };
            tensor(*v, kind, l, &mut tensors);
        }
        for (slot, l) in outs.iter().enumerate() {
            let kind = if is_host(&node.op) { "constant" } else { "activation" };
            tensor(Value::new(n, slot as u16), kind, l, &mut tensors);
        }
        let row = &b.ops[i];
        ops.push(PlanOp {
            name: op_name(g, n),
            op: node.op.op_type().to_string(),
            outputs: node.outputs().iter().map(|o| o.name.clone()).collect(),
            split: s.to_vec(),
            split_names: s.iter().map(|x| x.map(|d| sp.dims[d].name.clone())).collect(),
            strategy: row.strategy.clone(),
            inputs: ins.iter().map(|l| l.as_ref().map(|l| sharding_to_string(l))).collect(),
            output_layouts: outs.iter().map(|l| sharding_to_string(l)).collect(),
            compute_s: row.compute_s,
            communication_s: row.communication_s,
            memory_bytes: row.memory_bytes,
        });
    }
    (ops, tensors)
}

fn collectives(g: &Graph, mesh: &Mesh, b: &Breakdown) -> Vec<PlanCollective> {
    let mut out = Vec::new();
    for e in &b.events {
        for st in &e.steps {
            out.push(PlanCollective {
                phase: match e.phase {
                    Phase::Forward => "forward",
                    Phase::Backward => "backward",
                    Phase::Gradient => "gradient",
                }
                .into(),
                kind: st.kind.name().into(),
                tensor: value_name(g, e.value),
                op: e.op.map(|n| op_name(g, n)),
                from: sharding_to_string(&e.from),
                to: sharding_to_string(&e.to),
                axes: st.axes.iter().map(|&a| mesh.axes[a].name.clone()).collect(),
                bytes: st.bytes,
                time_s: st.time,
            });
        }
    }
    out
}

/// The annotation keys written on each op.
pub const ANN_STRATEGY: &str = "shardc_strategy";
/// Input layouts, `;`-separated (`-` for none).
pub const ANN_INPUTS: &str = "shardc_inputs";
/// Output layouts, `;`-separated.
pub const ANN_OUTPUTS: &str = "shardc_outputs";
/// The model-level mesh, in `metadata_props`.
pub const ANN_MESH: &str = "shardc_mesh";

/// The mesh as an annotation: `nodes=8:inter x gpus=8:intra`.
pub fn mesh_annotation(m: &Mesh) -> String {
    m.axes.iter().map(|a| format!("{}={}:{}", a.name, a.size, level_name(a.level))).collect::<Vec<_>>().join(" x ")
}

/// Parses [`mesh_annotation`]'s form.
pub fn parse_mesh_annotation(s: &str) -> Result<Mesh, String> {
    let axes = s
        .split(" x ")
        .map(|part| {
            let (name, rest) =
                part.trim().split_once('=').ok_or_else(|| format!("mesh axis `{part}`: expected name=size:level"))?;
            let (size, level) =
                rest.split_once(':').ok_or_else(|| format!("mesh axis `{part}`: expected name=size:level"))?;
            let size: usize = size.parse().map_err(|_| format!("mesh axis `{part}`: `{size}` is not a size"))?;
            let level = match level {
                "intra" => LinkLevel::Intra,
                "inter" => LinkLevel::Inter,
                _ => return Err(format!("mesh axis `{part}`: the level is intra or inter")),
            };
            Ok(MeshAxis { name: name.to_string(), size, level })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Mesh { axes })
}

/// Writes the plan onto the graph: per op its strategy (`d0@nodes, n@gpus` or `replicated`,
/// by iteration-dim index), input and output layouts; the mesh goes in the model's
/// `metadata_props`.
pub fn annotate(model: &mut ir::Model, mesh: &Mesh, asg: &Assignment) {
    annotate_graph(&mut model.graph, mesh, asg);
    set_mesh_metadata(&mut model.metadata_props, mesh);
}

/// Records the mesh in a model's `metadata_props`.
pub fn set_mesh_metadata(props: &mut Option<Vec<(String, String)>>, mesh: &Mesh) {
    let props = props.get_or_insert_with(Vec::new);
    props.retain(|(k, _)| k != ANN_MESH);
    props.push((ANN_MESH.into(), mesh_annotation(mesh)));
}

/// Writes per-op annotations (see [`annotate`]).
pub fn annotate_graph(g: &mut Graph, mesh: &Mesh, asg: &Assignment) {
    g.clear_annotations();
    let order = g.op_nodes().unwrap_or_default();
    for n in order {
        let s = asg.strategies.get(&n).cloned().unwrap_or_else(|| vec![None; mesh.axes.len()]);
        let sp = ir::shard::iter_space(g, n);
        let (ins, outs) = strategy_shardings(&sp, &s);
        let strat: Vec<String> =
            s.iter().enumerate().filter_map(|(a, d)| d.map(|d| format!("{d}@{}", mesh.axes[a].name))).collect();
        let strat = if strat.is_empty() { "replicated".to_string() } else { strat.join(", ") };
        let ins: Vec<String> =
            ins.iter().map(|l| l.as_ref().map_or("-".to_string(), |l| sharding_to_string(l))).collect();
        let outs: Vec<String> = outs.iter().map(|l| sharding_to_string(l)).collect();
        g.set_annotation(n, ANN_STRATEGY, strat);
        g.set_annotation(n, ANN_INPUTS, ins.join("; "));
        g.set_annotation(n, ANN_OUTPUTS, outs.join("; "));
    }
}

/// Reads annotations written by [`annotate`] back: the mesh and the assignment. Errors say
/// which op's annotation is missing or malformed.
pub fn read_annotations(model: &ir::Model) -> Result<(Mesh, Assignment), String> {
    let g = &model.graph;
    let mesh_text = model
        .metadata_props
        .iter()
        .flatten()
        .find(|(k, _)| k == ANN_MESH)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| format!("the model has no `{ANN_MESH}` in its metadata_props"))?;
    let mesh = parse_mesh_annotation(&mesh_text)?;
    let mut asg = Assignment::default();
    for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
        let node = g.node(n);
        let text = node
            .annotations
            .iter()
            .find(|(k, _)| k == ANN_STRATEGY)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| format!("{} has no `{ANN_STRATEGY}` annotation", g.describe(n)))?;
        let mut s = vec![None; mesh.axes.len()];
        if text != "replicated" {
            for part in text.split(',') {
                let (d, axis) = part
                    .trim()
                    .split_once('@')
                    .ok_or_else(|| format!("{}: `{part}` is not dim@axis", g.describe(n)))?;
                let d: usize = d.parse().map_err(|_| format!("{}: `{d}` is not a dim index", g.describe(n)))?;
                let a = mesh
                    .axes
                    .iter()
                    .position(|x| x.name == axis)
                    .ok_or_else(|| format!("{}: no mesh axis `{axis}`", g.describe(n)))?;
                s[a] = Some(d);
            }
        }
        check_strategy(g, n, &s, &mesh)?;
        // Layout annotations, when present, must agree with the strategy.
        if let Some((_, outs)) = node.annotations.iter().find(|(k, _)| k == ANN_OUTPUTS) {
            let sp = ir::shard::iter_space(g, n);
            let (_, want) = strategy_shardings(&sp, &s);
            let got: Vec<Option<Sharding>> = outs.split(';').map(parse_sharding).collect();
            if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.as_ref() != Some(b)) {
                return Err(format!("{}: `{ANN_OUTPUTS}` disagrees with its strategy", g.describe(n)));
            }
        }
        asg.strategies.insert(n, s);
    }
    Ok((mesh, asg))
}

/// A per-layer table: strategy, compute, communication, memory; data parallel beside it.
pub fn report(plan: &Breakdown, dp: Option<&Breakdown>) -> String {
    let us = |s: f64| format!("{:.1}", s * 1e6);
    let mib = |b: f64| format!("{:.1}", b / (1024.0 * 1024.0));
    let mut t = String::new();
    t.push_str(&format!(
        "{:<40} {:<12} {:<28} {:>10} {:>10} {:>9}   {:<20} {:>10} {:>10}\n",
        "layer", "op", "strategy", "comp µs", "comm µs", "mem MiB", "data parallel", "comp µs", "comm µs"
    ));
    for (i, r) in plan.ops.iter().enumerate() {
        if r.compute_s == 0.0 && r.communication_s == 0.0 && r.memory_bytes == 0.0 {
            continue;
        }
        let name: String = if r.name.chars().count() > 40 {
            let tail: String = r.name.chars().rev().take(39).collect::<Vec<_>>().into_iter().rev().collect();
            format!("…{tail}")
        } else {
            r.name.clone()
        };
        let strat: String = r.strategy.chars().take(28).collect();
        let (ds, dc, dm) = match dp.and_then(|d| d.ops.get(i)) {
            Some(d) => (d.strategy.chars().take(20).collect::<String>(), us(d.compute_s), us(d.communication_s)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        t.push_str(&format!(
            "{:<40} {:<12} {:<28} {:>10} {:>10} {:>9}   {:<20} {:>10} {:>10}\n",
            name,
            r.op,
            strat,
            us(r.compute_s),
            us(r.communication_s),
            mib(r.memory_bytes),
            ds,
            dc,
            dm
        ));
    }
    let total = |b: &Breakdown| {
        (
            b.ops.iter().map(|r| r.compute_s).sum::<f64>(),
            b.ops.iter().map(|r| r.communication_s).sum::<f64>(),
            b.ops.iter().map(|r| r.memory_bytes).sum::<f64>(),
        )
    };
    let (c, m, a) = total(plan);
    let (dc, dm) = dp.map(|d| (us(total(d).0), us(total(d).1))).unwrap_or(("-".into(), "-".into()));
    t.push_str(&format!(
        "{:<40} {:<12} {:<28} {:>10} {:>10} {:>9}   {:<20} {:>10} {:>10}\n",
        "total (per-op)",
        "",
        "",
        us(c),
        us(m),
        mib(a),
        "",
        dc,
        dm
    ));
    t
}
