//! A lowered program: one graph per device with explicit communication, and how the host
//! feeds its inputs and collects its outputs.

use std::collections::{BTreeMap, HashMap, HashSet};

use ir::reshard::StepKind;
use ir::shard::{Mesh, OpStrategy, Sharding, sharding_to_string};
use ir::{DType, Graph, Model, NodeId, Value};
use serde::Serialize;

/// Where each op runs and how: the input of lowering.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The pipeline stages (one when the plan does not pipeline); under the interleaved
    /// schedule the virtual stages ([`virtual_stages`]), a device in several of them.
    pub stages: Vec<StagePlacement>,
    /// Per op, its strategy on its stage's mesh (absent: replicated).
    pub strategies: HashMap<NodeId, OpStrategy>,
    /// Per op, its stage (absent: 0).
    pub stage_of: HashMap<NodeId, usize>,
    /// Micro-batches per step (1 without pipelining).
    pub micro_batches: usize,
    /// The algebra's machine-dependent choices, as the plan priced them.
    pub policy: ir::reshard::Policy,
    /// The pipeline schedule of a training step's forward and backward parts.
    pub schedule: crate::schedule::Schedule,
    /// Per (virtual) stage: it recomputes its forward part before the backward part (absent: no).
    pub recompute: Vec<bool>,
    /// The ZeRO stage of a training step ([`ir::reshard::ZeroLayouts`]): 2 delivers each
    /// gradient reduce-scattered into its update's shard; 3 also holds each parameter as that
    /// shard, gathered for the forward pass and again for the backward. Below 2 the
    /// strategies say all (ZeRO-1 is an update's strategy).
    pub zero: u8,
}

/// One stage: its mesh and the global ids of its devices, in mesh order.
#[derive(Clone, Debug)]
pub struct StagePlacement {
    /// The stage's mesh.
    pub mesh: Mesh,
    /// Global device ids, one per mesh position (row-major over the axes).
    pub devices: Vec<usize>,
}

impl Placement {
    /// Every op replicated on one device.
    pub fn single() -> Placement {
        Placement {
            stages: vec![StagePlacement { mesh: Mesh::line(1, ir::shard::LinkLevel::Intra), devices: vec![0] }],
            strategies: HashMap::new(),
            stage_of: HashMap::new(),
            micro_batches: 1,
            policy: ir::reshard::Policy::default(),
            schedule: Default::default(),
            recompute: Vec::new(),
            zero: 0,
        }
    }

    /// All devices (a device holding several virtual stages counted once).
    pub fn device_count(&self) -> usize {
        self.stages.iter().flat_map(|s| &s.devices).collect::<HashSet<_>>().len()
    }
}

/// The virtual stages of `stages` under `chunks` model chunks per device: virtual stage
/// `c·S + s` runs on stage `s`'s devices and mesh (chunks 1: the stages as they are).
pub fn virtual_stages(stages: &[StagePlacement], chunks: usize) -> Vec<StagePlacement> {
    (0..chunks.max(1)).flat_map(|_| stages.iter().cloned()).collect()
}

/// A global graph input or output.
#[derive(Clone, Debug, Serialize)]
pub struct GlobalValue {
    /// Its name.
    pub name: String,
    /// Shape of the whole step (all micro-batches).
    pub shape: Vec<usize>,
    /// Element type.
    #[serde(serialize_with = "dtype_name")]
    pub dtype: DType,
    /// The dim that is split into micro-batches (none: every micro-batch sees it whole).
    pub batch_axis: Option<usize>,
}

fn dtype_name<S: serde::Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

/// How a device gets one of its graph inputs: a piece of a global input.
#[derive(Clone, Debug, Serialize)]
pub struct Feed {
    /// The local input's name.
    pub local: String,
    /// The global input.
    pub global: String,
    /// The piece, as a layout on the device's stage mesh.
    #[serde(serialize_with = "layout_text")]
    pub layout: Sharding,
}

/// Which piece of a global output a device's graph output is.
#[derive(Clone, Debug, Serialize)]
pub struct Result_ {
    /// The local output's name.
    pub local: String,
    /// The global output.
    pub global: String,
    /// The piece, as a layout on the device's stage mesh.
    #[serde(serialize_with = "layout_text")]
    pub layout: Sharding,
}

fn layout_text<S: serde::Serializer>(l: &Sharding, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&sharding_to_string(l))
}

/// One device's program.
#[derive(Clone, Debug)]
pub struct DeviceProgram {
    /// Global device id.
    pub device: usize,
    /// Its pipeline stage.
    pub stage: usize,
    /// Its rank in the stage's mesh.
    pub rank: usize,
    /// The local graph: local shapes, communication ops in the `shardc` domain.
    pub graph: Graph,
    /// Its inputs.
    pub feeds: Vec<Feed>,
    /// Its initializers cut from the graph's (parameters, optimizer state, literals): which
    /// piece of which (`local`, `global`, `layout`), the statement `codegen::verify` starts from.
    pub pieces: Vec<Feed>,
    /// Its pieces of the global outputs.
    pub results: Vec<Result_>,
    /// Under the interleaved schedule, per op of a later model chunk than the first: its
    /// chunk (absent: 0).
    pub chunk_of: HashMap<NodeId, usize>,
    /// Per op lowered from a training graph's op: the phase of the step that op is in
    /// ([`ir::reshard::step_phases`]); empty for a forward model's program.
    pub phase_of: HashMap<NodeId, ir::reshard::Phase>,
    /// The receives of a tensor from a later (virtual) stage: the gradient flowing back, where
    /// a backward part starts ([`crate::cut::Cut`]).
    pub from_later: HashSet<NodeId>,
}

impl DeviceProgram {
    /// Per kind (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `halo`), the
    /// bytes this device sends running its program once: `(p−1)/p` of the operand of a
    /// collective over `p` devices (twice that for an all-reduce; the output for an
    /// all-gather), the rows a halo exchange sends its neighbours. The measure the plan's
    /// `bytes_moved` uses, so the two can be compared.
    pub fn bytes_moved(&self) -> BTreeMap<String, f64> {
        let mut out: BTreeMap<String, f64> = BTreeMap::new();
        for kinds in self.bytes_moved_by_phase().into_values() {
            for (k, b) in kinds {
                *out.entry(k).or_insert(0.0) += b;
            }
        }
        out
    }

    /// [`DeviceProgram::bytes_moved`] per phase of the step: the phase the lowering tagged
    /// each communication op with ([`ir::reshard::PHASE`]; `forward` when untagged, as in a
    /// forward model's program).
    pub fn bytes_moved_by_phase(&self) -> BTreeMap<String, BTreeMap<String, f64>> {
        use ir::op::Op;
        let g = &self.graph;
        let mut all: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
        let bytes =
            |v: Option<Value>| v.and_then(|v| g.tensor_type(v)).and_then(|t| t.size_bytes()).unwrap_or(0) as f64;
        for n in g.op_nodes().unwrap_or_default() {
            let node = g.node(n);
            let phase = node.annotations.iter().find(|(k, _)| k == ir::reshard::PHASE).map_or("forward", |(_, p)| p);
            let out = all.entry(phase.to_string()).or_default();
            let group = |gr: &Option<Vec<i64>>| gr.as_ref().map_or(1, Vec::len);
            let (kind, moved) = match &node.op {
                Op::AllReduce(a) => (
                    StepKind::AllReduce,
                    ir::reshard::moved(&StepKind::AllReduce, group(&a.group), bytes(node.input(0))),
                ),
                Op::AllGather(a) => {
                    let k = StepKind::AllGather { dim: 0 };
                    let m = ir::reshard::moved(&k, group(&a.group), bytes(Some(Value::new(n, 0))));
                    (k, m)
                }
                Op::ReduceScatter(a) => {
                    let k = StepKind::ReduceScatter { dim: 0 };
                    let m = ir::reshard::moved(&k, group(&a.group), bytes(node.input(0)));
                    (k, m)
                }
                Op::AllToAll(a) => {
                    let k = StepKind::AllToAll { split: 0, concat: 0 };
                    let m = ir::reshard::moved(&k, group(&a.group), bytes(node.input(0)));
                    (k, m)
                }
                Op::HaloExchange(h) => {
                    let x =
                        node.input(0).and_then(|v| g.tensor_type(v)).and_then(|t| t.static_dims()).unwrap_or_default();
                    let axis = h.axis.unwrap_or(0).max(0) as usize;
                    let slab = bytes(node.input(0)) / x.get(axis).copied().unwrap_or(1).max(1) as f64;
                    let w = h.widths.clone().unwrap_or_default();
                    let rows = w.get(2).copied().unwrap_or(0) + w.get(3).copied().unwrap_or(0);
                    *out.entry("halo".into()).or_insert(0.0) += slab * rows as f64;
                    continue;
                }
                // Point to point: a pipeline's transfers, ring attention's passes.
                Op::Send(_) => {
                    *out.entry("p2p".into()).or_insert(0.0) += bytes(node.input(0));
                    continue;
                }
                _ => continue,
            };
            *out.entry(kind.name().into()).or_insert(0.0) += moved;
        }
        all.retain(|_, k| !k.is_empty());
        all
    }

    /// The program as a model in the ONNX textual syntax (parses back with the frontend).
    pub fn to_model(&self) -> Model {
        let opset = self.graph.opset;
        let mut m = Model::new(self.graph.clone(), opset);
        m.opset_import.push((ir::op::SHARDC_DOMAIN.to_string(), 1));
        m.metadata_props = Some(vec![
            ("shardc_device".into(), self.device.to_string()),
            ("shardc_stage".into(), self.stage.to_string()),
        ]);
        m
    }
}

/// A lowered program for every device.
#[derive(Clone, Debug)]
pub struct Program {
    /// Per device, by global id.
    pub devices: Vec<DeviceProgram>,
    /// The stages' meshes (per virtual stage under the interleaved schedule).
    pub meshes: Vec<Mesh>,
    /// Global device ids per stage (per virtual stage under the interleaved schedule).
    pub stage_devices: Vec<Vec<usize>>,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Global inputs.
    pub inputs: Vec<GlobalValue>,
    /// Global outputs.
    pub outputs: Vec<GlobalValue>,
    /// Ops that run replicated instead of their planned strategy, and why.
    pub fallbacks: Vec<String>,
    /// The pipeline schedule ([`crate::schedule`]).
    pub schedule: crate::schedule::Schedule,
    /// Per (virtual) stage: it recomputes its forward part before the backward part.
    pub recompute: Vec<bool>,
}

impl Program {
    /// The mesh and rank of a device.
    pub fn mesh_of(&self, device: usize) -> (&Mesh, usize) {
        let d = &self.devices[device];
        (&self.meshes[d.stage], d.rank)
    }

    /// Per phase and kind, the bytes the busiest device sends in one step (all micro-batches):
    /// the measure of the plan's `bytes_moved_per_device`. A forward model's program moves
    /// every byte in `forward`; a training graph's is split by the phase of the op each
    /// communication serves ([`DeviceProgram::bytes_moved_by_phase`]).
    pub fn bytes_moved_per_device(&self) -> BTreeMap<String, BTreeMap<String, f64>> {
        let mut out: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
        for d in &self.devices {
            for (phase, kinds) in d.bytes_moved_by_phase() {
                let o = out.entry(phase).or_default();
                for (k, b) in kinds {
                    let e = o.entry(k).or_insert(0.0);
                    *e = e.max(b * self.micro_batches as f64);
                }
            }
        }
        out
    }

    /// A summary for `--emit json`: per device its feeds, results, op counts and the bytes it
    /// sends.
    pub fn summary_json(&self) -> serde_json::Value {
        let devices: Vec<serde_json::Value> = self
            .devices
            .iter()
            .map(|d| {
                let mut comm: std::collections::BTreeMap<String, usize> = Default::default();
                let mut ops = 0usize;
                for n in d.graph.op_nodes().unwrap_or_default() {
                    let op = &d.graph.node(n).op;
                    if op.class() == ir::OpClass::Comm {
                        *comm.entry(op.op_type().to_string()).or_insert(0) += 1;
                    } else {
                        ops += 1;
                    }
                }
                serde_json::json!({
                    "device": d.device,
                    "stage": d.stage,
                    "rank": d.rank,
                    "ops": ops,
                    "communication": comm,
                    "bytes_moved": d.bytes_moved().into_iter().map(|(k, b)| (k, b * self.micro_batches as f64)).collect::<BTreeMap<_, _>>(),
                    "feeds": d.feeds,
                    "results": d.results,
                })
            })
            .collect();
        serde_json::json!({
            "micro_batches": self.micro_batches,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "fallbacks": self.fallbacks,
            "bytes_moved_per_device": self.bytes_moved_per_device(),
            "devices": devices,
        })
    }
}
