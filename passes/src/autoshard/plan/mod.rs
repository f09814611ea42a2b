//! The plan: what the search chose, as a versioned JSON document (the contract with codegen
//! and other tools), a per-layer report, and IR annotations that parse back.
//!
//! The JSON schema (`format: "shardc-plan"`, `version: 1`) is documented in the README.

use std::collections::{BTreeMap, HashMap};

use ir::shard::{LinkLevel, Mesh, MeshAxis, Sharding, parse_sharding, sharding_to_string, strategy_shardings};
use ir::{Graph, NodeId, Op, Value};
use serde::{Deserialize, Serialize};

use super::{MeshSearch, SearchResult};
use crate::cost::collective::CommKind;
use crate::cost::model::is_host;
use crate::cost::{Assignment, Breakdown, Cluster, CostModel, Options};

mod annotations;
mod report;
mod summary;
pub use annotations::*;
pub use report::*;
pub use summary::*;

/// The plan format's name.
pub const FORMAT: &str = "shardc-plan";
/// The plan format's version.
pub const VERSION: u32 = 2;

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
    pub level: LinkLevel,
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
    /// The pipeline stage it runs in (0 when the plan does not pipeline).
    pub stage: usize,
    /// Under the interleaved schedule, its model chunk on that stage: it runs in virtual
    /// stage `chunk × stages + stage` ([`super::interleave`]). 0 otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// One pipeline stage (a plan that does not pipeline has one, with every device and op).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanStage {
    /// Global device ids.
    pub devices: Vec<usize>,
    /// The stage's mesh.
    pub mesh: Vec<PlanAxis>,
    /// Its ops (first output names), in order.
    pub ops: Vec<String>,
    /// Forward time per micro-batch (with its sends), seconds.
    pub forward_s: f64,
    /// Backward time per micro-batch (with recomputation and sends), seconds.
    pub backward_s: f64,
    /// `forward_s + backward_s`.
    pub time_s: f64,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Recomputes its activations in the backward pass.
    pub recompute: bool,
    /// Bytes per device sent to the next stage per micro-batch.
    pub send_bytes: f64,
}

/// How the pipeline was chosen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanPipeline {
    /// Slowest over fastest stage time.
    pub imbalance: f64,
    /// What keeps the stages from balancing within 10%, when they do not.
    pub blocker: Option<String>,
    /// What drove the choice (memory or speed).
    pub reason: String,
    /// Configurations priced: stages, micro-batches, schedule, devices per stage, step time.
    pub tried: serde_json::Value,
}

/// One tensor's layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanTensor {
    /// Its name.
    pub name: String,
    /// What it is.
    pub kind: TensorKind,
    /// Its shape.
    pub shape: Vec<i64>,
    /// The layout it is produced (or stored) in.
    pub layout: String,
    /// Each device's piece.
    pub local_shape: Vec<i64>,
}

/// What a tensor of the plan is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorKind {
    /// A graph input.
    Input,
    /// A trained weight.
    Parameter,
    /// A weight held constant (not trained).
    Constant,
    /// A value an op computes.
    Activation,
}

/// One communication the plan inserts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanCollective {
    /// The part of the step it runs in.
    pub phase: ir::reshard::Phase,
    /// What it is.
    pub kind: CommKind,
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
    /// Bytes per device of the tensor the step operates on: the input of an all-reduce,
    /// reduce-scatter or all-to-all, the output of an all-gather, the slab of a halo.
    pub bytes: f64,
    /// Devices in its group.
    #[serde(default)]
    pub group_size: usize,
    /// Bytes each device sends: `(p−1)/p · bytes`, twice that for an all-reduce, the slab
    /// for a halo exchange (its busiest member's).
    #[serde(default)]
    pub bytes_moved: f64,
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
    /// The wall-clock safety net cut the search short.
    pub time_limit_hit: bool,
    /// The work budgets the safety net cut (`egraph`, `dp`, `local-search`, `pipeline` …),
    /// empty when the search ran to its budgets.
    #[serde(default)]
    pub budget_cut: Vec<String>,
    /// The repeated blocks the search folded (see [`super::fold`]), if it folded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub folded: Option<String>,
    /// The memory ladder's rungs when no plan fit with the options given
    /// ([`super::memory_ladder`]): each one's best plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_ladder: Vec<super::LadderRung>,
}

/// Where the search's time went. Everything that depends on the machine's speed lives here,
/// so two runs of the same command give the same plan document outside this object.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanTimings {
    /// The whole search, seconds.
    pub search_s: f64,
    /// Per mesh tried, in the order of `search.meshes`.
    pub meshes: Vec<MeshTimings>,
    /// The pipeline search, seconds (null when it did not run).
    pub pipeline_search_s: Option<f64>,
}

/// Where one mesh's search spent its time, seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MeshTimings {
    /// The mesh.
    pub mesh: String,
    /// Everything on this mesh.
    pub total_s: f64,
    /// Growing the e-graph.
    pub egraph_s: f64,
    /// The extraction (dynamic program and local search included).
    pub extraction_s: f64,
    /// The dynamic program.
    pub dp_s: f64,
    /// The local search.
    pub local_search_s: f64,
    /// The lower bound of the dynamic program's objective (only when its beam pruned).
    #[serde(default)]
    pub bound_s: f64,
}

impl PlanTimings {
    /// The timings of a search result.
    pub fn of(r: &SearchResult) -> PlanTimings {
        PlanTimings {
            search_s: r.search_time_s,
            meshes: r
                .meshes
                .iter()
                .map(|m| MeshTimings {
                    mesh: m.mesh.clone(),
                    total_s: m.time_s,
                    egraph_s: m.egraph.time_s,
                    extraction_s: m.extraction.time_s,
                    dp_s: m.extraction.dp_time_s,
                    local_search_s: m.extraction.local_search_time_s,
                    bound_s: m.extraction.bound_time_s,
                })
                .collect(),
            pipeline_search_s: r.pipeline_considered.as_ref().map(|p| p.search_time_s),
        }
    }
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
    pub options: Options,
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
    /// Memory per device by what holds it (the fullest device).
    #[serde(default)]
    pub memory_breakdown: crate::cost::model::MemoryBreakdown,
    /// The step's breakdown (the `shardc cost --json` keys).
    pub breakdown: serde_json::Value,
    /// Per op (topological order).
    pub ops: Vec<PlanOp>,
    /// Per tensor that has a layout.
    pub tensors: Vec<PlanTensor>,
    /// Inserted communication, in step order.
    pub collectives: Vec<PlanCollective>,
    /// Per phase and kind, the bytes the busiest device sends (`{phase: {kind: bytes}}`);
    /// the lowered program moves the same (`shardc lower --emit json`).
    #[serde(default)]
    pub bytes_moved_per_device: BTreeMap<String, BTreeMap<String, f64>>,
    /// Search statistics.
    pub search: PlanSearch,
    /// Pipeline stages (one when the plan does not pipeline).
    pub stages: Vec<PlanStage>,
    /// Micro-batches per step (1 without pipelining).
    pub micro_batches: usize,
    /// Pipeline schedule (`1f1b`, `gpipe`, `interleaved:V`), or null.
    pub schedule: Option<crate::cost::Schedule>,
    /// How the pipeline was chosen, when the plan pipelines (null otherwise).
    pub pipeline: Option<PlanPipeline>,
    /// The resharding algebra's machine-dependent choices the plan was priced with (the
    /// lowering follows them).
    #[serde(default)]
    pub policy: ir::reshard::Policy,
    /// Where the search's time went (the only part that differs between runs).
    #[serde(default)]
    pub timings: PlanTimings,
    /// The plan in the terms ML engineers use: degrees of parallelism and throughput.
    #[serde(default)]
    pub summary: PlanSummary,
    /// The algebraic rewrites the search tried on the whole graph, with the step time with
    /// and without each; the plan's ops are those of the model with the `applied` ones made
    /// (`lower`, `run` and `train` make them again before applying the plan).
    #[serde(default)]
    pub rewrites: Vec<super::RewriteChoice>,
    /// The capacity factor of the mixtures' all-to-all token dispatcher (`plan
    /// --moe-capacity`; 0: dropless), null when they all-gather their tokens; `lower`, `run`
    /// and `train` ask the mixtures for it again before applying the plan.
    #[serde(default)]
    pub moe_capacity: Option<f32>,
}

fn level_name(l: LinkLevel) -> &'static str {
    match l {
        LinkLevel::Intra => "intra",
        LinkLevel::Inter => "inter",
    }
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
        // The options the plan needs, where the search changed them to make it fit.
        let opts = r.options.as_ref().unwrap_or(opts);
        let b = &r.breakdown;
        let dp = r.data_parallel.as_ref().filter(|d| d.feasible).map(|d| d.step_time_s);
        let axes = |m: &Mesh| -> Vec<PlanAxis> {
            m.axes.iter().map(|a| PlanAxis { name: a.name.clone(), size: a.size, level: a.level }).collect()
        };
        // The mesh of each op: its stage's.
        let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
        let stage_meshes: Vec<Mesh> = match &r.pipeline {
            Some(p) => {
                for (i, st) in p.stages.iter().enumerate() {
                    for &n in &st.nodes {
                        stage_of.insert(n, i);
                    }
                }
                p.stages.iter().map(|s| s.sub_mesh.clone()).collect()
            }
            None => vec![r.mesh.clone()],
        };
        // Under the interleaved schedule each stage's ops are those of its model chunks.
        let chunks = r.pipeline.as_ref().map_or(1, |p| p.schedule.chunks());
        let virt = super::interleave::virtual_stages(g, &stage_of, stage_meshes.len(), chunks).unwrap_or_default();
        for (n, j) in &virt {
            stage_of.insert(*n, j % stage_meshes.len());
        }
        let cms: Vec<CostModel<'_>> =
            stage_meshes.iter().map(|m| CostModel::new(g, cluster, m.clone(), opts.clone())).collect();
        let (mut ops, tensors) = layouts(&cms, &stage_of, &r.assignment, b);
        if chunks > 1 {
            for op in &mut ops {
                let n = op.outputs.first().and_then(|o| g.lookup(o)).map(|v| v.node);
                op.chunk = n.and_then(|n| virt.get(&n)).map_or(0, |j| j / stage_meshes.len());
            }
        }
        let summary = PlanSummary::of(&cms, cluster, opts, devices, r);
        let stages = match &r.pipeline {
            Some(p) => p
                .stages
                .iter()
                .enumerate()
                .map(|(i, s)| PlanStage {
                    devices: s.devices.clone(),
                    mesh: axes(&s.sub_mesh),
                    ops: if chunks > 1 {
                        ops.iter().filter(|o| o.stage == i).filter_map(|o| o.outputs.first().cloned()).collect()
                    } else {
                        s.ops.clone()
                    },
                    forward_s: s.forward_s,
                    backward_s: s.backward_s,
                    time_s: s.time_s,
                    memory_bytes: s.memory_bytes,
                    recompute: s.recompute,
                    send_bytes: s.send_bytes,
                })
                .collect(),
            None => vec![PlanStage {
                devices: (0..devices).collect(),
                mesh: axes(&r.mesh),
                ops: ops.iter().filter_map(|o| o.outputs.first().cloned()).collect(),
                forward_s: b.forward_s,
                backward_s: b.backward_s,
                time_s: b.forward_s + b.backward_s,
                memory_bytes: b.memory_per_device_bytes.iter().copied().max().unwrap_or(0),
                recompute: false,
                send_bytes: 0.0,
            }],
        };
        let pipeline = r.pipeline.as_ref().map(|p| PlanPipeline {
            imbalance: p.imbalance,
            blocker: p.blocker.clone(),
            reason: pipeline_reason(r, p),
            tried: serde_json::to_value(&p.tried).expect("configurations serialize"),
        });
        Plan {
            format: FORMAT.into(),
            version: VERSION,
            model,
            cluster: cluster.name.clone(),
            devices,
            mesh: axes(&r.mesh),
            options: opts.clone(),
            step_time_s: b.step_time_s,
            data_parallel_step_time_s: dp,
            speedup_over_data_parallel: dp.filter(|_| b.feasible).map(|d| d / b.step_time_s),
            feasible: b.feasible,
            infeasible_reason: b.infeasible_reason.clone(),
            memory_per_device_bytes: b.memory_per_device_bytes.iter().copied().max().unwrap_or(0),
            memory_capacity_bytes: b.memory_capacity_bytes,
            memory_breakdown: b.memory.breakdown(),
            breakdown: breakdown_json(b),
            ops,
            tensors,
            collectives: collectives(g, &stage_meshes, &stage_of, b),
            bytes_moved_per_device: b.bytes_moved_per_device.clone(),
            search: PlanSearch {
                meshes: serde_json::to_value::<&[MeshSearch]>(&r.meshes).expect("stats serialize"),
                same_as: r.same_as.clone(),
                time_limit_hit: r.time_limit_hit,
                budget_cut: r.budget_cut.clone(),
                folded: r.folded.clone(),
                memory_ladder: r.ladder.clone(),
            },
            micro_batches: r.pipeline.as_ref().map_or(1, |p| p.micro_batches),
            schedule: r.pipeline.as_ref().map(|p| p.schedule),
            stages,
            pipeline,
            policy: r.breakdown.policy,
            timings: PlanTimings::of(r),
            summary,
            rewrites: r.rewrites.clone(),
            moe_capacity: ir::ops::experts::capacity_of(g),
        }
    }

    /// The plan's mesh (the first stage's, when it pipelines).
    pub fn mesh(&self) -> Result<Mesh, String> {
        mesh_of(&self.mesh)
    }

    /// Each stage's mesh.
    pub fn stage_meshes(&self) -> Result<Vec<Mesh>, String> {
        self.stages.iter().map(|s| mesh_of(&s.mesh)).collect()
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
        let plan: Plan = serde_json::from_value(v).map_err(|e| format!("malformed plan: {e}"))?;
        plan.validate().map_err(|e| format!("malformed plan: {e}"))?;
        Ok(plan)
    }

    /// Checks what the document says of itself: devices, stages, meshes, micro-batches and
    /// op stages agree (a hand-edited plan is read only when it still describes a placement).
    pub fn validate(&self) -> Result<(), String> {
        const MOST: usize = 1 << 20;
        if self.devices == 0 || self.devices > MOST {
            return Err(format!("`devices` is {}; it must be from 1 to {MOST}", self.devices));
        }
        if self.micro_batches > MOST {
            return Err(format!("`micro_batches` is {}; it must be at most {MOST}", self.micro_batches));
        }
        if self.stages.is_empty() {
            return Err("no stages".into());
        }
        let mut seen = vec![false; self.devices];
        for (i, s) in self.stages.iter().enumerate() {
            let mesh = mesh_of(&s.mesh)?;
            let size = s.mesh.iter().try_fold(1usize, |a, x| a.checked_mul(x.size));
            if s.mesh.iter().any(|a| a.size == 0) || size != Some(s.devices.len()) {
                return Err(format!(
                    "stage {i}: the mesh {} does not cover its {} devices",
                    super::mesh_string(&mesh),
                    s.devices.len()
                ));
            }
            for &d in &s.devices {
                match seen.get_mut(d) {
                    None => return Err(format!("stage {i}: device {d} is not below `devices` ({})", self.devices)),
                    Some(true) => return Err(format!("stage {i}: device {d} is in two places")),
                    Some(x) => *x = true,
                }
            }
        }
        if let Some(d) = seen.iter().position(|x| !x) {
            return Err(format!("device {d} of the plan's {} is in no stage", self.devices));
        }
        if self.stages.len() == 1 && self.mesh != self.stages[0].mesh {
            return Err("the plan's mesh is not its stage's".into());
        }
        if let Some(op) = self.ops.iter().find(|o| o.stage >= self.stages.len()) {
            return Err(format!("op `{}` is in stage {}; the plan has {}", op.name, op.stage, self.stages.len()));
        }
        if let Some(op) = self.ops.iter().find(|o| o.chunk >= self.chunks()) {
            return Err(format!(
                "op `{}` is in model chunk {}; the schedule ({}) has {}",
                op.name,
                op.chunk,
                self.schedule.map_or("none".into(), |s| s.name()),
                self.chunks()
            ));
        }
        Ok(())
    }

    /// The virtual stage op `op` runs in: `chunk × stages + stage` (its stage without
    /// interleaving).
    pub fn virtual_stage(&self, op: &PlanOp) -> usize {
        op.chunk * self.stages.len() + op.stage
    }

    /// Model chunks per device: `V` under the interleaved schedule (`interleaved:V`), else 1.
    pub fn chunks(&self) -> usize {
        self.schedule.map_or(1, |s| s.chunks())
    }

    /// The plan's strategies as an assignment of `g`'s ops, matching ops by their first
    /// output's name. Errors name ops the plan does not cover or whose strategy does not fit.
    pub fn assignment(&self, g: &Graph) -> Result<Assignment, String> {
        self.stage_assignment(g).map(|(a, _)| a)
    }

    /// [`Plan::assignment`] with each op's pipeline stage (its virtual stage
    /// `chunk × stages + stage` under the interleaved schedule): the one step from the plan's
    /// names to a graph's nodes.
    pub fn stage_assignment(&self, g: &Graph) -> Result<(Assignment, HashMap<NodeId, usize>), String> {
        self.stage_assignment_with(g, false)
    }

    /// [`Plan::stage_assignment`] of a graph that is not canonicalized (what `train` runs: its
    /// parameters must stay the model's own): ops computed from constants alone, which
    /// canonicalization folds into the constants the plan was made with, need no strategy
    /// and get none; every other op must have one that fits.
    pub fn stage_assignment_uncanonical(&self, g: &Graph) -> Result<(Assignment, HashMap<NodeId, usize>), String> {
        self.stage_assignment_with(g, true)
    }

    fn stage_assignment_with(
        &self,
        g: &Graph,
        constants_folded: bool,
    ) -> Result<(Assignment, HashMap<NodeId, usize>), String> {
        let diffs = self.differences(g, constants_folded);
        if !diffs.is_empty() {
            return Err(differences_message(&diffs));
        }
        let meshes: Vec<Mesh> = self.stages.iter().map(|s| mesh_of(&s.mesh)).collect::<Result<Vec<_>, String>>()?;
        let by_output: BTreeMap<&str, &PlanOp> =
            self.ops.iter().filter_map(|o| Some((o.outputs.first()?.as_str(), o))).collect();
        let mut asg = Assignment::default();
        let mut stage_of = HashMap::new();
        // The values shape inference folds to constants (a Shape of a static shape, ops of
        // constants): canonicalization made them constants of the plan's graph.
        let folded = if constants_folded {
            ir::infer::infer_shapes(&mut g.clone(), ir::infer::Mode::Check).map(|r| r.consts).unwrap_or_default()
        } else {
            Default::default()
        };
        for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
            let key = g.node(n).outputs().first().map(|o| o.name.as_str()).unwrap_or("");
            let Some(op) = by_output.get(key) else {
                let outputs = g.node(n).num_outputs();
                if (0..outputs).all(|s| folded.contains_key(&Value::new(n, s as u16))) {
                    continue;
                }
                return Err(format!("the plan has no strategy for {}", g.describe(n)));
            };
            let mesh = meshes.get(op.stage).ok_or_else(|| format!("{}: no stage {}", g.describe(n), op.stage))?;
            check_strategy(g, n, &op.split, mesh)?;
            asg.strategies.insert(n, op.split.clone());
            stage_of.insert(n, self.virtual_stage(op));
        }
        Ok((asg, stage_of))
    }
}

impl Plan {
    /// What differs between this plan and `g`, the graph it is applied to: ops of the plan
    /// that `g` lacks (unless `partial`: a plan of the forward model applied to its training
    /// graph), ops whose type differs, tensors whose shape differs. Ops and tensors are
    /// matched by name (an op by its first output). Empty when the plan fits `g`.
    pub fn differences(&self, g: &Graph, partial: bool) -> Vec<String> {
        let mut out = Vec::new();
        let mut ops: HashMap<&str, NodeId> = HashMap::new();
        let mut values: HashMap<&str, Value> = HashMap::new();
        for n in g.node_ids() {
            let node = g.node(n);
            for (slot, o) in node.outputs().iter().enumerate() {
                if !o.name.is_empty() {
                    values.insert(o.name.as_str(), Value::new(n, slot as u16));
                }
            }
            if !matches!(node.op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef)
                && let Some(o) = node.outputs().first()
            {
                ops.insert(o.name.as_str(), n);
            }
        }
        for op in &self.ops {
            let Some(key) = op.outputs.first() else {
                out.push(format!("plan op `{}` has no outputs", op.name));
                continue;
            };
            match ops.get(key.as_str()) {
                None if !partial => {
                    out.push(format!("plan op `{}` ({}, output `{key}`) is not in the model", op.name, op.op))
                }
                None => {}
                Some(&n) => {
                    let ty = g.node(n).op.op_type();
                    if ty != op.op {
                        out.push(format!("op with output `{key}` is {} in the plan, {ty} in the model", op.op));
                    }
                }
            }
        }
        for t in &self.tensors {
            if let Some(&v) = values.get(t.name.as_str()) {
                let have = g.tensor_type(v).and_then(|t| t.static_dims());
                if have.as_deref() != Some(t.shape.as_slice()) {
                    let have = have.map_or("an unknown shape".into(), |d| format!("{d:?}"));
                    out.push(format!("tensor `{}` is {:?} in the plan, {have} in the model", t.name, t.shape));
                }
            } else if !partial {
                out.push(format!("plan tensor `{}` is not in the model", t.name));
            }
        }
        out
    }
}

/// The error for a plan that does not fit a graph: the first differences and how many more.
pub fn differences_message(diffs: &[String]) -> String {
    let mut m = String::from("the plan does not fit this model:");
    for d in diffs.iter().take(8) {
        m.push_str("\n  ");
        m.push_str(d);
    }
    if diffs.len() > 8 {
        m.push_str(&format!("\n  ... and {} more differences", diffs.len() - 8));
    }
    m
}

fn mesh_of(axes: &[PlanAxis]) -> Result<Mesh, String> {
    Ok(Mesh { axes: axes.iter().map(|a| MeshAxis { name: a.name.clone(), size: a.size, level: a.level }).collect() })
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

fn layouts(
    cms: &[CostModel<'_>],
    stage_of: &HashMap<NodeId, usize>,
    asg: &Assignment,
    b: &Breakdown,
) -> (Vec<PlanOp>, Vec<PlanTensor>) {
    let g = cms[0].g;
    let mut ops = Vec::new();
    let mut tensors: Vec<PlanTensor> = Vec::new();
    let mut seen: std::collections::HashSet<Value> = std::collections::HashSet::new();
    let shape = |v: Value| g.tensor_type(v).and_then(|t| t.static_dims()).unwrap_or_default();
    let mut tensor = |v: Value, kind: TensorKind, l: &Sharding, mesh: &Mesh, tensors: &mut Vec<PlanTensor>| {
        if seen.insert(v) && !g.value_name(v).is_empty() {
            let s = shape(v);
            tensors.push(PlanTensor {
                name: value_name(g, v),
                kind,
                local_shape: ir::shard::local_dims(&s, l, mesh),
                shape: s,
                layout: sharding_to_string(l),
            });
        }
    };
    for (i, &n) in cms[0].order().iter().enumerate() {
        let stage = stage_of.get(&n).copied().unwrap_or(0);
        let cm = &cms[stage.min(cms.len() - 1)];
        let node = g.node(n);
        let s = cm.strategy_of(asg, n);
        let sp = cm.space(n);
        let (ins, outs) = strategy_shardings(sp, &s);
        for (j, v) in node.inputs().iter().enumerate() {
            let (Some(v), Some(Some(l))) = (v, ins.get(j)) else { continue };
            let kind = match &g.node(v.node).op {
                Op::Input { default: None } => TensorKind::Input,
                Op::Input { .. } | Op::Initializer(_) if ir::cost::is_param(g, *v) => TensorKind::Parameter,
                Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => TensorKind::Constant,
                _ => continue,
            };
            tensor(*v, kind, l, &cm.mesh, &mut tensors);
        }
        for (slot, l) in outs.iter().enumerate() {
            let kind = if is_host(&node.op) { TensorKind::Constant } else { TensorKind::Activation };
            tensor(Value::new(n, slot as u16), kind, l, &cm.mesh, &mut tensors);
        }
        let row = b.ops.get(i);
        ops.push(PlanOp {
            name: g.op_name(n),
            op: node.op.op_type().to_string(),
            outputs: node.outputs().iter().map(|o| o.name.clone()).collect(),
            split: s.to_vec(),
            split_names: s.iter().map(|x| x.map(|d| sp.dims[d].name.clone())).collect(),
            strategy: cm.describe_strategy(n, &s),
            inputs: ins.iter().map(|l| l.as_ref().map(|l| sharding_to_string(l))).collect(),
            output_layouts: outs.iter().map(|l| sharding_to_string(l)).collect(),
            compute_s: row.map_or(0.0, |r| r.compute_s),
            communication_s: row.map_or(0.0, |r| r.communication_s),
            memory_bytes: row.map_or(0.0, |r| r.memory_bytes),
            stage,
            chunk: 0,
        });
    }
    (ops, tensors)
}

/// Why the plan pipelines: memory (nothing else fits) or speed.
pub fn pipeline_reason(r: &SearchResult, p: &super::pipeline::PipelinePlan) -> String {
    // The fastest plan without stages that fits: the per-op search's meshes' or the grid's.
    let grid = r.grid_flat.as_ref().map_or(f64::INFINITY, |(_, s)| *s);
    let intra = r.meshes.iter().filter(|m| m.feasible).map(|m| m.step_time_s).fold(grid, f64::min);
    // (A mesh the search did not price has no memory: not a plan that needs none.)
    let smallest = r.meshes.iter().map(|m| m.memory_per_device_bytes).filter(|&b| b > 0).min();
    let gib = |x: f64| x / 1073741824.0;
    let whole = p.whole_batch.as_ref().map_or(String::new(), |why| format!("; one whole batch at a time: {why}"));
    let why = if p.requested {
        format!(
            "requested: {} stages (--pipeline); {:.3} ms per step against {:.3} ms without pipelining",
            p.stages.len(),
            p.breakdown.step_time_s * 1e3,
            intra * 1e3
        )
    } else if !intra.is_finite() {
        let without = match smallest {
            Some(b) => format!("the smallest plan needs {:.2} GiB per device", gib(b as f64)),
            None => "no plan was priced that fits".into(),
        };
        format!(
            "memory: without pipelining {without}, {:.2} GiB usable; {} stages with {} micro-batches ({}{}) need {:.2} GiB",
            gib(p.breakdown.memory_capacity_bytes as f64),
            p.stages.len(),
            p.micro_batches,
            p.schedule.name(),
            if p.stages.iter().any(|s| s.recompute) { ", recomputing activations" } else { "" },
            gib(p.stages.iter().map(|s| s.memory_bytes).max().unwrap_or(0) as f64)
        )
    } else {
        format!(
            "speed: {:.3} ms per step pipelined against {:.3} ms for the best plan without pipelining",
            p.breakdown.step_time_s * 1e3,
            intra * 1e3
        )
    };
    let replanned = p.replanned.map_or(String::new(), |(k, reference)| {
        format!(
            "; {k} of {} stages on their own ops' plan ({:.3} ms with every stage on its sub-mesh's whole-graph plan)",
            p.stages.len(),
            reference * 1e3
        )
    });
    why + &whole + &replanned
}

fn collectives(g: &Graph, meshes: &[Mesh], stage_of: &HashMap<NodeId, usize>, b: &Breakdown) -> Vec<PlanCollective> {
    let mut out = Vec::new();
    for e in &b.events {
        if !g.contains(e.value.node) {
            continue;
        }
        let mesh = &meshes[e.op.and_then(|o| stage_of.get(&o).copied()).unwrap_or(0).min(meshes.len() - 1)];
        for st in e.steps.iter().filter(|s| s.kind.communicates()) {
            out.push(PlanCollective {
                phase: e.phase,
                kind: st.kind,
                tensor: value_name(g, e.value),
                op: e.op.filter(|o| g.contains(*o)).map(|n| g.op_name(n)),
                from: sharding_to_string(&e.from),
                to: sharding_to_string(&e.to),
                axes: st
                    .axes
                    .iter()
                    .map(|&a| mesh.axes.get(a).map_or(format!("axis{a}"), |x| x.name.clone()))
                    .collect(),
                bytes: st.bytes,
                group_size: st.group,
                bytes_moved: st.moved,
                time_s: st.time,
            });
        }
    }
    out
}
