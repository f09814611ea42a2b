//! From a plan to a running program: loading weights, building the placement codegen lowers,
//! micro-batching pipelines, and the inputs to run on.

use std::collections::HashMap;
use std::path::Path;

use codegen::{Placement, Program, StagePlacement};
use ir::eval::Array;
use ir::{DType, Graph, Model, NodeId, Op, TensorData, Value};
use passes::autoshard::{Plan, SearchResult};

/// How the weights of a model were obtained.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Weights {
    /// Read from external data files beside the model.
    pub loaded: usize,
    /// Drawn from the seed because their external data is not there.
    pub seeded: usize,
}

/// An external-data tensor read from its file beside the model: `Ok(None)` when the file is
/// not there. Only the tensor's bytes are read (`offset`, then `length` or the tensor's size),
/// so a model whose weights file is larger than memory loads what it needs.
fn read_external(
    entries: &[(String, String)],
    dtype: DType,
    dims: &[i64],
    dir: &Path,
) -> Result<Option<Array>, String> {
    use std::io::{Read, Seek, SeekFrom};
    let get = |k: &str| entries.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str());
    let location = get("location").ok_or("no `location` entry")?;
    let path = dir.join(location);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read `{}`: {e}", path.display())),
    };
    // A FIFO or device would block or never end; data must be a file.
    if !meta.is_file() {
        return Err(format!("`{}` is not a regular file", path.display()));
    }
    // A symlink may not lead out of the model's directory (as `..` in the location may not).
    let (real, home) = (
        std::fs::canonicalize(&path),
        std::fs::canonicalize(if dir.as_os_str().is_empty() { Path::new(".") } else { dir }),
    );
    if let (Ok(real), Ok(home)) = (&real, &home)
        && !real.starts_with(home)
    {
        return Err(format!(
            "`{}` leads to `{}`, outside the model's directory `{}`",
            path.display(),
            real.display(),
            home.display()
        ));
    }
    let mut file = std::fs::File::open(&path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let number = |k: &str| -> Result<Option<u64>, String> {
        get(k).map(|v| v.parse::<u64>().map_err(|_| format!("`{k}` is `{v}`, not a byte count"))).transpose()
    };
    let offset = number("offset")?.unwrap_or(0);
    let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d.max(0) as u64)).ok_or("the tensor is too large")?;
    let want = n.checked_mul(u64::from(dtype.bits() / 8)).ok_or("the tensor is too large")?;
    let length = number("length")?.unwrap_or(want);
    if length != want {
        return Err(format!("`length` is {length} bytes; a {dtype}{dims:?} tensor needs {want}"));
    }
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    match offset.checked_add(length) {
        Some(end) if end <= size => {}
        Some(end) => {
            return Err(format!("bytes {offset}..{end} are past the end of `{}` ({size} bytes)", path.display()));
        }
        None => {
            return Err(format!(
                "`offset` {offset} and `length` {length} overflow 64 bits; `{}` has {size} bytes",
                path.display()
            ));
        }
    }
    let mut raw = vec![0u8; usize::try_from(length).map_err(|_| "the tensor is too large")?];
    file.seek(SeekFrom::Start(offset)).and_then(|_| file.read_exact(&mut raw)).map_err(|e| e.to_string())?;
    let data = frontend::onnx::raw_tensor_data(&raw, dtype)?;
    let t = ir::Tensor { dtype, dims: dims.to_vec(), name: None, data };
    Array::from_tensor(&t).map(Some).map_err(|e| e.to_string())
}

/// The values of external tensor `t` named `name`, and whether any were read from a file:
/// read beside the model (`dir`) where its file is there, drawn from `seed` in the role `role`
/// where not, exactly as the reference evaluator draws them. A slice (a weight split by
/// `passes::algebra`) reads the whole tensor and slices it; a concatenation (weights fused)
/// reads or draws each part.
fn external_values(t: &ir::Tensor, name: &str, role: &str, dir: &Path, seed: u64) -> Result<(Array, bool), String> {
    if let Some(c) = t.external_concat()? {
        let mut read = false;
        let mut parts = Vec::with_capacity(c.parts.len());
        for (n, p) in &c.parts {
            let (a, r) = external_values(p, n, role, dir, seed).map_err(|e| format!("part `{n}`: {e}"))?;
            read |= r;
            parts.push(a);
        }
        return Ok((Array::concat_axis(&parts.iter().collect::<Vec<_>>(), c.axis), read));
    }
    match read_values(t, dir)? {
        Some(a) => Ok((a, true)),
        None => Ok((ir::eval::draw_external(t, name, role, seed).map_err(|e| e.to_string())?, false)),
    }
}

/// The values of external tensor `t` read from the files beside the model (`dir`); `None`
/// when a file it needs is not there. A slice reads the whole tensor and slices it; a
/// concatenation reads each part.
fn read_values(t: &ir::Tensor, dir: &Path) -> Result<Option<Array>, String> {
    if t.fill()?.is_some() {
        return Array::materialized(t).map(Some).map_err(|e| e.to_string());
    }
    if let Some(c) = t.external_concat()? {
        let mut parts = Vec::with_capacity(c.parts.len());
        for (n, p) in &c.parts {
            match read_values(p, dir).map_err(|e| format!("part `{n}`: {e}"))? {
                Some(a) => parts.push(a),
                None => return Ok(None),
            }
        }
        return Ok(Some(Array::concat_axis(&parts.iter().collect::<Vec<_>>(), c.axis)));
    }
    let TensorData::External(entries) = &t.data else { return Err("not external data".into()) };
    let slice = t.external_slice()?;
    let dims = slice.as_ref().map_or(&t.dims, |s| &s.full_dims);
    Ok(read_external(entries, t.dtype, dims, dir)?.map(|a| match &slice {
        Some(s) => ir::eval::take_slice(a, s, &t.dims),
        None => a,
    }))
}

/// Reads external-data tensors from the files beside the model (`dir`), for rebatching to
/// regenerate constants at new dims ([`passes::rebatch::RebatchSpec::external`]).
pub fn external_reader(dir: &Path) -> passes::rebatch::ExternalValues {
    let dir = dir.to_path_buf();
    passes::rebatch::ExternalValues(std::sync::Arc::new(move |t: &ir::Tensor| {
        Ok(read_values(t, &dir)?.map(|a| a.to_tensor()))
    }))
}

/// Makes inline the weights of `model` whose external data is shardc's description of
/// another tensor's columns or of joined tensors (what `passes::algebra`'s rewrites write;
/// other tools read only plain external data), reading them from the files beside the model
/// (`dir`). Returns the names of those whose files are not there (left as they are).
pub fn inline_rewritten_weights(model: &mut Model, dir: &Path) -> Result<Vec<String>, String> {
    let g = &mut model.graph;
    let mut left = Vec::new();
    let described = |t: &ir::Tensor| -> Result<bool, String> {
        Ok(t.is_external() && (t.external_slice()?.is_some() || t.external_concat()?.is_some()))
    };
    for n in g.initializers().to_vec() {
        let Op::Initializer(t) = &g.node(n).op else { continue };
        let name = g.value_name(Value::new(n, 0)).to_string();
        if !described(t).map_err(|e| format!("external data of `{name}`: {e}"))? {
            continue;
        }
        match read_values(t, dir).map_err(|e| format!("external data of `{name}`: {e}"))? {
            Some(a) => {
                let mut tensor = a.to_tensor();
                tensor.name = t.name.clone();
                g.set_op(n, Op::Initializer(tensor));
            }
            None => left.push(name),
        }
    }
    Ok(left)
}

/// Makes every weight of `model` inline: external data is read from the files beside the
/// model (`dir`) when they are there, otherwise drawn from `seed` exactly as the reference
/// evaluator draws it.
pub fn materialize(model: &mut Model, dir: &Path, seed: u64) -> Result<Weights, String> {
    let g = &mut model.graph;
    let mut w = Weights::default();
    let nodes: Vec<NodeId> = g.topo_order().map_err(|_| "the graph has a cycle".to_string())?;
    for n in nodes {
        let Op::Initializer(t) = &g.node(n).op else { continue };
        if !t.is_external() {
            continue;
        }
        let v = Value::new(n, 0);
        let name = g.value_name(v).to_string();
        // A fill (optimizer state of absent weights) is neither read nor drawn.
        let a = if t.fill().map_err(|e| format!("`{name}`: {e}"))?.is_some() {
            Array::materialized(t).map_err(|e| format!("`{name}`: {e}"))?
        } else {
            let (a, read) = external_values(t, &name, ir::eval::weight_role(g, v), dir, seed)
                .map_err(|e| format!("external data of `{name}`: {e}"))?;
            *if read { &mut w.loaded } else { &mut w.seeded } += 1;
            a
        };
        let mut tensor = a.to_tensor();
        tensor.name = t.name.clone();
        g.set_op(n, Op::Initializer(tensor));
    }
    Ok(w)
}

/// The virtual stages of a pipeline's stages (`(mesh, devices)` each) under `schedule`, and
/// whether each recomputes (its stage's `recompute`).
fn stage_placements(
    stages: Vec<(ir::shard::Mesh, Vec<usize>)>,
    recompute: &[bool],
    schedule: codegen::Schedule,
) -> (Vec<StagePlacement>, Vec<bool>) {
    let v = schedule.chunks();
    let placed: Vec<StagePlacement> =
        stages.into_iter().map(|(mesh, devices)| StagePlacement { mesh, devices }).collect();
    let rc = (0..v).flat_map(|_| recompute.iter().copied()).collect();
    (codegen::program::virtual_stages(&placed, v), rc)
}

/// The program of a plan document for `g` (the model the plan was made for, full batch,
/// shapes inferred, weights inline): the one crossing from a plan to a program. The plan's
/// ops are matched to `g`'s by [`Plan::stage_assignment`]; codegen lowers the full-batch
/// graph and cuts it into the plan's micro-batches itself.
pub fn program_for_plan(g: &Graph, plan: &Plan) -> crate::error::Result<Program> {
    use crate::error::Error;
    let (asg, stage_of) = plan.stage_assignment(g).map_err(Error::Plan)?;
    let schedule = plan.schedule.unwrap_or_default();
    let stages = plan
        .stage_meshes()
        .map_err(Error::Plan)?
        .into_iter()
        .zip(&plan.stages)
        .map(|(m, s)| (m, s.devices.clone()))
        .collect();
    let recompute: Vec<bool> = plan.stages.iter().map(|s| s.recompute).collect();
    let (stages, recompute) = stage_placements(stages, &recompute, schedule);
    let placement = Placement {
        stages,
        strategies: asg.strategies,
        stage_of,
        micro_batches: plan.micro_batches.max(1),
        policy: plan.policy,
        schedule,
        recompute,
        zero: 0,
    };
    Ok(codegen::lower(g, &placement)?)
}

/// The program of a search result for `g` (the graph the search ran on: its strategies are
/// keyed by `g`'s nodes).
pub fn program_for_search(g: &Graph, r: &SearchResult, devices: usize) -> crate::error::Result<Program> {
    if let Some(o) = &r.options
        && (o.recompute != passes::cost::Recompute::None || o.zero > 0)
    {
        return Err(crate::error::Error::Plan(format!(
            "the plan fits only with {}, which the cost model prices but the lowering does not emit yet",
            o.memory_fields()
        )));
    }
    lower_result(g, r, devices, 0)
}

/// The program of a search result for training graph `g` (its recomputation, if any, written
/// into the graph by [`passes::recompute`]) under ZeRO stage `zero`
/// ([`codegen::Placement::zero`]).
pub fn training_program(g: &Graph, r: &SearchResult, devices: usize, zero: u8) -> crate::error::Result<Program> {
    lower_result(g, r, devices, zero)
}

fn lower_result(g: &Graph, r: &SearchResult, devices: usize, zero: u8) -> crate::error::Result<Program> {
    let (meshes, stage_of) = passes::autoshard::plan::stage_meshes(r);
    let device_lists: Vec<Vec<usize>> = match &r.pipeline {
        Some(p) => p.stages.iter().map(|s| s.devices.clone()).collect(),
        None => vec![(0..devices).collect()],
    };
    let schedule = match &r.pipeline {
        Some(p) => p.schedule,
        None => codegen::Schedule::default(),
    };
    let stage_of = passes::autoshard::interleave::virtual_stages(g, &stage_of, meshes.len(), schedule.chunks())
        .map_err(crate::error::Error::Plan)?;
    let recompute: Vec<bool> =
        r.pipeline.as_ref().map_or(Vec::new(), |p| p.stages.iter().map(|s| s.recompute).collect());
    let (stages, recompute) = stage_placements(meshes.into_iter().zip(device_lists).collect(), &recompute, schedule);
    let placement = Placement {
        stages,
        strategies: r.assignment.strategies.clone(),
        stage_of,
        micro_batches: r.pipeline.as_ref().map_or(1, |p| p.micro_batches),
        policy: r.breakdown.policy,
        schedule,
        recompute,
        zero,
    };
    Ok(codegen::lower(g, &placement)?)
}

/// One of `m` micro-batches of `g`: `g` re-batched to 1/m of its batch, wherever each input
/// carries it ([`passes::rebatch`]; a recurrent layer's sequence is never cut: re-batching
/// refuses a batch that reaches it).
pub fn one_micro_batch(g: &Graph, m: usize) -> Result<Graph, String> {
    let batch = passes::cost::pipeline::graph_batch(g).ok_or("the model has no input with a batch dim")?;
    if m == 0 || batch % m as i64 != 0 {
        return Err(format!("the batch ({batch}) does not divide into {m} micro-batches"));
    }
    let mut micro = g.clone();
    let spec = passes::rebatch::RebatchSpec { batch: Some(batch / m as i64), micro_batch: true, ..Default::default() };
    passes::rebatch::rebatch(&mut micro, &spec).map_err(|e| e.to_string())?;
    Ok(micro)
}

/// The graph a forward program `p` of `g` computes, what the prover compares it with: `g`,
/// or with micro-batches [`one_micro_batch`] of it, keeping the full batch's constants the
/// re-batching rewrote (the lowering cuts the devices' pieces from those, and the proof fails
/// where a device computes with one where the micro-batch needs another).
pub fn proof_graph(g: &Graph, p: &Program) -> Result<Graph, String> {
    let m = p.micro_batches.max(1);
    if m == 1 {
        return Ok(g.clone());
    }
    let mut micro = one_micro_batch(g, m).map_err(|e| format!("one micro-batch (of {m}): {e}"))?;
    for &n in g.initializers() {
        let v = ir::Value::new(n, 0);
        let name = g.value_name(v);
        if micro.lookup(name).is_none()
            && let Some(t) = g.initializer(v)
        {
            micro.add_initializer(name, t.clone());
        }
    }
    Ok(micro)
}

/// Runs `p`, lowered for one micro-batch of `full` (the same graph re-batched to 1/m of its
/// batch), as `m` micro-batches of `full`'s batch: an input one of whose dims (its batch:
/// dim 0, or dim 1 of a recurrent state) is `m` times the program's is cut into
/// micro-batches along it; inputs of equal shape go to every
/// micro-batch. For a training graph the runtime then accumulates gradients over the
/// micro-batches.
pub fn as_micro_batches(mut p: Program, full: &Graph, m: usize) -> Result<Program, String> {
    if m <= 1 {
        return Ok(p);
    }
    for gi in &mut p.inputs {
        let v = full.lookup(&gi.name).ok_or_else(|| format!("the full-batch graph has no input `{}`", gi.name))?;
        let dims: Vec<usize> = full
            .tensor_type(v)
            .and_then(ir::TensorType::static_dims)
            .ok_or_else(|| format!("input `{}` has no static shape", gi.name))?
            .into_iter()
            .map(|d| d.max(0) as usize)
            .collect();
        if dims == gi.shape {
            continue;
        }
        // The one dim the micro-batch graph has 1/m of (dim 0 for most inputs; dim 1 of a
        // recurrent state `[layers, batch, hidden]`); every other dim is the same.
        let differ: Vec<usize> = (0..dims.len().min(gi.shape.len())).filter(|&k| dims[k] != gi.shape[k]).collect();
        let axis = match differ.as_slice() {
            [k] if dims.len() == gi.shape.len() && dims[*k] == gi.shape[*k] * m => *k,
            _ => {
                return Err(format!(
                    "input `{}`: {:?} is not {m} micro-batches of {:?} along one dim",
                    gi.name, dims, gi.shape
                ));
            }
        };
        gi.shape = dims;
        gi.batch_axis = Some(axis);
    }
    p.micro_batches = m;
    Ok(p)
}

/// A named strategy (`data`, `model`, `megatron`, `spatial`, `hybrid:dp:D,tp:T`, `spatial-hybrid:DxS`, `owt`) priced on `devices`
/// devices of `cluster`, as a search result that [`program_for_search`] lowers. Pipelines
/// go through a plan instead.
pub fn named_result(
    g: &Graph,
    cluster: &passes::cost::Cluster,
    devices: usize,
    strategy: &str,
    opts: &passes::cost::Options,
) -> Result<SearchResult, String> {
    use passes::{autoshard::Named, cost::CostModel};
    let named = Named::parse(strategy)?;
    if matches!(named, Named::Pipeline { .. }) {
        return Err(
            "run a pipeline through a plan: shardc plan --pipeline S -o plan.json, then --plan plan.json".into()
        );
    }
    let mesh = named.mesh(cluster, devices)?;
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let asg = passes::autoshard::named::assign(&cm, &named)
        .map_err(|e| format!("strategy `{strategy}` does not apply: {e}"))?;
    Ok(given_result(&cm, asg, Some(strategy.to_string())))
}

/// A pipeline strategy (`pipeline:S:M[:interleaved:V][:tp:T][:ep:E]`, or a configuration with `pp`)
/// priced on `devices` devices of `cluster` as the search prices its pipelines, as a search
/// result: what `cost --export` hands to a framework.
pub fn pipeline_result(
    g: &Graph,
    cluster: &passes::cost::Cluster,
    devices: usize,
    named: &passes::autoshard::Named,
    opts: &passes::cost::Options,
) -> Result<SearchResult, String> {
    use passes::autoshard::Named;
    let Named::Pipeline { stages, micro, schedule, tensor, expert } = *named else {
        return Err(format!("`{}` is not a pipeline", named.name()));
    };
    let shape = (stages, micro, schedule, tensor, expert);
    let p = passes::autoshard::pipeline::price_configuration(g, cluster, devices, shape, opts)?;
    let mesh = p.stages.first().ok_or("a pipeline without stages")?.sub_mesh.clone();
    let mut r = SearchResult::unsearched(mesh, p.assignment(), p.breakdown.clone(), Some(named.name()));
    r.pipeline = Some(p);
    Ok(r)
}

/// An assignment made without a search, priced on `cm`'s mesh, as the search result
/// [`program_for_search`] lowers.
fn given_result(
    cm: &passes::cost::CostModel<'_>,
    assignment: passes::cost::Assignment,
    same_as: Option<String>,
) -> SearchResult {
    let breakdown = cm.evaluate(&assignment);
    SearchResult::unsearched(cm.mesh.clone(), assignment, breakdown, same_as)
}

/// Inputs for a run: the `given` values (from [`given_inputs`]; every graph input must be
/// there, in the shape the graph expects), or values drawn from `seed`.
pub fn inputs_for(
    g: &Graph,
    given: Option<&HashMap<String, Array>>,
    seed: u64,
) -> Result<HashMap<String, Array>, String> {
    let mut out = HashMap::new();
    for v in g.input_values() {
        if !matches!(g.node(v.node).op, Op::Input { default: None }) {
            continue;
        }
        let name = g.value_name(v).to_string();
        let t = g.tensor_type(v).ok_or_else(|| format!("input `{name}` has no type"))?;
        let dims = t
            .static_dims()
            .ok_or_else(|| format!("input `{name}` has symbolic dims; give --batch or --input-shape"))?;
        let a = match given.map(|m| m.get(&name)) {
            Some(Some(a)) => a.clone(),
            Some(None) => return Err(format!("the inputs file has no `{name}`")),
            None if t.dtype.is_int() => seeded_ints(g, v, t.dtype, &dims, seed, &name),
            None => ir::eval::random_tensor(t.dtype, &dims, "input", seed, &name).map_err(|e| e.to_string())?,
        };
        let want: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        if a.shape != want {
            return Err(format!("input `{name}` has shape {:?}, the model expects {want:?}", a.shape));
        }
        if a.dtype != t.dtype {
            return Err(format!("input `{name}` is {}, the model expects {}", a.dtype, t.dtype));
        }
        out.insert(name, a);
    }
    Ok(out)
}

/// Seeded values of integer input `v`: uniform below the smallest size it indexes (token ids
/// below the embedding's rows, labels below the classes), or ones where nothing indexes with
/// it (an attention mask: all zeros would mask every position, a degenerate step whose
/// gradients can be NaN).
fn seeded_ints(g: &Graph, v: Value, dtype: DType, dims: &[i64], seed: u64, name: &str) -> Array {
    let shape: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
    let n: usize = shape.iter().product();
    match index_bound(g, v) {
        Some(b) if b > 0 => {
            let mut rng = ir::eval::Rng::named(seed ^ 0x1d5, name);
            Array::int(dtype, shape, (0..n).map(|_| ((rng.uniform(0.0, 1.0) * b as f64) as i64).min(b - 1)).collect())
        }
        _ => Array::int(dtype, shape, vec![1; n]),
    }
}

/// The smallest size integer value `v` indexes — a gather's axis, a loss's classes —
/// followed through the ops that keep its values (casts, reshapes, expands); `None` when
/// nothing indexes with it.
fn index_bound(g: &Graph, v: Value) -> Option<i64> {
    let mut bound: Option<i64> = None;
    let mut stack = vec![(v, 0usize)];
    let mut seen = std::collections::HashSet::new();
    while let Some((x, depth)) = stack.pop() {
        if depth > 8 || !seen.insert(x) {
            continue;
        }
        for (u, slot) in g.users(x) {
            let node = g.node(u);
            let dims = |i: usize| node.input(i).and_then(|d| g.tensor_type(d)).and_then(ir::TensorType::static_dims);
            let along = |axis: i64| {
                dims(0).and_then(|d| ir::ops::norm_axis(axis, d.len()).ok().and_then(|a| d.get(a).copied()))
            };
            let b = match (&node.op, slot) {
                (Op::Gather(o), 1) => along(o.axis()),
                (Op::GatherElements(o), 1) => along(o.axis()),
                (Op::SoftmaxCrossEntropyLoss(_) | Op::NegativeLogLikelihoodLoss(_), 1) => along(1),
                (
                    Op::Cast(_)
                    | Op::Identity(_)
                    | Op::Unsqueeze(_)
                    | Op::Squeeze(_)
                    | Op::Reshape(_)
                    | Op::Flatten(_)
                    | Op::Expand(_)
                    | Op::Transpose(_),
                    0,
                ) => {
                    stack.extend((0..node.num_outputs()).map(|s| (Value::new(u, s as u16), depth + 1)));
                    None
                }
                _ => None,
            };
            if let Some(b) = b {
                bound = Some(bound.map_or(b, |x: i64| x.min(b)));
            }
        }
    }
    bound
}

/// The given inputs of a run, by graph input name: the golden `.io.json` format
/// (`{"inputs": {name: {dtype, shape, data}}}`), or a directory of ONNX test data
/// (`input_K.pb` for the K-th graph input, as the ONNX test suite lays them out).
pub fn given_inputs(g: &Graph, path: &Path) -> Result<HashMap<String, Array>, String> {
    let names: Vec<String> = g
        .input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .map(|v| g.value_name(v).to_string())
        .collect();
    let mut out = HashMap::new();
    if path.is_dir() {
        for (k, name) in names.iter().enumerate() {
            let f = path.join(format!("input_{k}.pb"));
            if !f.exists() {
                continue;
            }
            let bytes = std::fs::read(&f).map_err(|e| format!("cannot read `{}`: {e}", f.display()))?;
            let t = frontend::onnx::read_tensor(&bytes).map_err(|e| format!("`{}`: {e}", f.display()))?;
            out.insert(name.clone(), Array::from_tensor(&t).map_err(|e| format!("`{}`: {e}", f.display()))?);
        }
        return Ok(out);
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let io: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("`{}` is not JSON: {e}", path.display()))?;
    let ins =
        io.get("inputs").and_then(|v| v.as_object()).ok_or_else(|| format!("`{}` has no `inputs`", path.display()))?;
    for (name, v) in ins {
        if !names.contains(name) {
            return Err(format!(
                "the inputs file has `{name}`, which is not a graph input; inputs are: {}",
                names.join(", ")
            ));
        }
        out.insert(name.clone(), array_from_json(v, &format!("inputs.{name}"))?);
    }
    Ok(out)
}

/// One array of the golden JSON format; `at` names it in errors (`inputs.ids`), which say
/// where (`inputs.ids.data[3]: 3.7 is not an int64`).
pub fn array_from_json(v: &serde_json::Value, at: &str) -> Result<Array, String> {
    let fail = |why: &str| format!("{at}: {why}");
    let dtype = match v["dtype"].as_str().ok_or_else(|| fail("no dtype"))? {
        "float32" => DType::Float,
        "float64" => DType::Double,
        "int64" => DType::Int64,
        "int32" => DType::Int32,
        "bool" => DType::Bool,
        other => return Err(fail(&format!("unsupported dtype `{other}`"))),
    };
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .ok_or_else(|| fail("no shape"))?
        .iter()
        .map(|d| d.as_u64().map(|x| x as usize).ok_or_else(|| fail("a dim is not a number")))
        .collect::<Result<_, _>>()?;
    let data = v["data"].as_array().ok_or_else(|| fail("no data"))?;
    let n: usize = shape.iter().product();
    if data.len() != n {
        return Err(fail(&format!("{} values for shape {shape:?}", data.len())));
    }
    let bad = |k: usize, what: &str| format!("{at}.data[{k}]: {} is not {what}", data[k]);
    let floats = || -> Result<Vec<f64>, String> {
        data.iter()
            .enumerate()
            .map(|(k, x)| json_float(x).ok_or_else(|| bad(k, "a number (or \"nan\", \"inf\", \"-inf\")")))
            .collect()
    };
    Ok(match dtype {
        DType::Float => {
            let v = floats()?;
            if let Some(k) = v.iter().position(|x| x.is_finite() && (*x as f32).is_infinite()) {
                return Err(bad(k, "a float32 (it overflows to infinity)"));
            }
            Array::f32(shape, v.into_iter().map(|x| x as f32).collect())
        }
        DType::Double => Array::float(DType::Double, shape, floats()?),
        DType::Bool => Array::bool(
            shape,
            data.iter()
                .enumerate()
                .map(|(k, x)| x.as_bool().ok_or_else(|| bad(k, "true or false")))
                .collect::<Result<_, _>>()?,
        ),
        d => {
            let (lo, hi) =
                if d == DType::Int32 { (i64::from(i32::MIN), i64::from(i32::MAX)) } else { (i64::MIN, i64::MAX) };
            let ints = data
                .iter()
                .enumerate()
                .map(|(k, x)| x.as_i64().filter(|v| (lo..=hi).contains(v)).ok_or_else(|| bad(k, &format!("an {d}"))))
                .collect::<Result<_, _>>()?;
            Array::int(d, shape, ints)
        }
    })
}

/// A float of the JSON format: a number, or `"nan"`, `"inf"`, `"-inf"` (JSON has no others).
fn json_float(x: &serde_json::Value) -> Option<f64> {
    match x {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "nan" => Some(f64::NAN),
            "inf" | "+inf" | "infinity" => Some(f64::INFINITY),
            "-inf" | "-infinity" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        _ => None,
    }
}

/// A float as JSON: a number, or `"nan"`, `"inf"`, `"-inf"`.
fn float_json(x: f64) -> serde_json::Value {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        serde_json::json!(x)
    }
}

/// An array in the golden JSON format.
pub fn array_to_json(a: &Array) -> serde_json::Value {
    let dtype = match a.dtype {
        DType::Double => "float64",
        DType::Int64 => "int64",
        DType::Int32 => "int32",
        DType::Bool => "bool",
        d if d.is_float() => "float32",
        _ => "int64",
    };
    let data: Vec<serde_json::Value> = match &a.data {
        // f32 printed as itself (1.1f32, not 1.100000023841858).
        ir::eval::Data::F32(v) => {
            v.iter().map(|&x| if x.is_finite() { serde_json::json!(x) } else { float_json(f64::from(x)) }).collect()
        }
        ir::eval::Data::F64(v) => v.iter().map(|&x| float_json(x)).collect(),
        ir::eval::Data::I64(v) => v.iter().map(|&x| serde_json::json!(x)).collect(),
        ir::eval::Data::Bool(v) => v.iter().map(|&x| serde_json::json!(x)).collect(),
        ir::eval::Data::Str(v) => v.iter().map(|x| serde_json::json!(x)).collect(),
    };
    serde_json::json!({"dtype": dtype, "shape": a.shape, "data": data})
}

/// The largest absolute and relative errors of `got` against `want`, and whether every
/// element passes `|got − want| ≤ atol + rtol·|want|` (integers and booleans: exactly; the
/// same infinity, and NaN where NaN is expected, pass).
pub fn compare(got: &Array, want: &Array, rtol: f64, atol: f64) -> (f64, f64, bool) {
    if got.shape != want.shape {
        return (f64::INFINITY, f64::INFINITY, false);
    }
    let (Ok(x), Ok(y)) = (got.to_f64(), want.to_f64()) else { return (f64::INFINITY, f64::INFINITY, false) };
    let exact = !want.dtype.is_float();
    let (mut max_abs, mut max_rel, mut ok) = (0.0f64, 0.0f64, true);
    for (a, b) in x.iter().zip(&y) {
        // The same value, infinities included, and NaN where NaN is expected: no error.
        if a == b || (a.is_nan() && b.is_nan()) {
            continue;
        }
        let d = (a - b).abs();
        // Any other value against an infinity (or NaN) is wrong, however loose the tolerance.
        if d.is_nan() || !b.is_finite() {
            ok = false;
            max_abs = f64::INFINITY;
            continue;
        }
        if d > 0.0 {
            max_abs = max_abs.max(d);
            max_rel = max_rel.max(d / b.abs().max(1e-30));
        }
        if exact { ok &= d == 0.0 } else { ok &= d <= atol + rtol * b.abs() }
    }
    (max_abs, max_rel, ok)
}

/// The strategies of `fwd` (an assignment of `forward`'s ops) by each op's first output name:
/// how a training graph's forward ops find their plan.
fn strategies_by_name<'a>(
    forward: &'a Graph,
    fwd: &'a passes::cost::Assignment,
) -> HashMap<&'a str, &'a Vec<Option<usize>>> {
    fwd.strategies
        .iter()
        .filter_map(|(n, s)| Some((forward.node(*n).outputs().first()?.name.as_str(), s)))
        .filter(|(name, _)| !name.is_empty())
        .collect()
}

/// The training graph's program plan from a plan of its forward model: `forward` is the
/// forward graph (the model the search or the plan priced), `fwd` its strategies on `mesh`,
/// `train` the training graph (or one micro-batch of it). Forward ops of `train` are matched
/// to `forward`'s by their first output's name and keep their strategy; the backward, loss
/// and update ops get theirs from [`passes::autoshard::training::derive`]. Returns the
/// result [`program_for_search`] lowers and the number of `train`'s forward ops that took
/// the plan's strategy.
pub fn training_result(
    train: &Graph,
    forward: &Graph,
    fwd: &passes::cost::Assignment,
    mesh: &ir::shard::Mesh,
    cluster: &passes::cost::Cluster,
    opts: &passes::cost::Options,
) -> Result<(SearchResult, usize), String> {
    use passes::cost::CostModel;
    let by_name = strategies_by_name(forward, fwd);
    let mut pinned = HashMap::new();
    for n in train.op_nodes().map_err(|_| "the training graph has a cycle".to_string())? {
        if let Some(s) = train.node(n).outputs().first().and_then(|o| by_name.get(o.name.as_str())) {
            pinned.insert(n, (*s).clone());
        }
    }
    let cm = CostModel::new(train, cluster, mesh.clone(), opts.clone());
    let (assignment, rederived) = passes::autoshard::training::derive(&cm, &pinned);
    let kept = pinned.len() - rederived.len();
    Ok((given_result(&cm, assignment, None), kept))
}

/// A pipelined plan of a forward model, as training lowers it.
#[derive(Clone, Debug)]
pub struct TrainPipeline {
    /// Per stage: its mesh, its global devices (in mesh order), whether it recomputes.
    pub stages: Vec<(ir::shard::Mesh, Vec<usize>, bool)>,
    /// The stage of each forward op, by its first output's name (its virtual stage
    /// `chunk × stages + stage` under the interleaved schedule).
    pub stage_of: HashMap<String, usize>,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The schedule.
    pub schedule: codegen::Schedule,
}

impl TrainPipeline {
    /// The pipeline of a plan document (`None` when it has one stage).
    pub fn of_plan(plan: &Plan) -> Result<Option<TrainPipeline>, String> {
        if plan.stages.len() <= 1 {
            return Ok(None);
        }
        let meshes = plan.stage_meshes()?;
        let schedule = plan.schedule.unwrap_or_default();
        Ok(Some(TrainPipeline {
            stages: meshes.into_iter().zip(&plan.stages).map(|(m, s)| (m, s.devices.clone(), s.recompute)).collect(),
            stage_of: plan
                .ops
                .iter()
                .filter_map(|o| Some((o.outputs.first()?.clone(), plan.virtual_stage(o))))
                .collect(),
            micro_batches: plan.micro_batches.max(1),
            schedule,
        }))
    }

    /// Prices this pipeline of `forward` (its ops' strategies `fwd`) as the search prices
    /// the pipelines it makes: the stages' time and memory from the model, not from what a
    /// plan file says.
    pub fn price(
        &self,
        forward: &Graph,
        fwd: &passes::cost::Assignment,
        cluster: &passes::cost::Cluster,
        opts: &passes::cost::Options,
    ) -> Result<passes::autoshard::pipeline::PipelinePlan, String> {
        use passes::autoshard::pipeline::{GivenStage, price_stages};
        let name = |n: NodeId| forward.node(n).outputs().first().map(|o| o.name.clone());
        let strategies: HashMap<String, ir::shard::OpStrategy> =
            fwd.strategies.iter().filter_map(|(&n, s)| Some((name(n)?, s.clone()))).collect();
        let mut ops: Vec<Vec<String>> = vec![Vec::new(); self.stages.len()];
        for n in forward.op_nodes().map_err(|_| "the model has a cycle".to_string())? {
            if let Some((o, &st)) = name(n).and_then(|o| self.stage_of.get(&o).map(|st| (o, st)))
                && let Some(list) = ops.get_mut(st % self.stages.len().max(1))
            {
                list.push(o);
            }
        }
        let stages: Vec<GivenStage<'_>> = self
            .stages
            .iter()
            .zip(&ops)
            .map(|((mesh, devices, _), ops)| GivenStage { ops, mesh, offset: devices.first().copied().unwrap_or(0) })
            .collect();
        price_stages(forward, cluster, opts, &stages, &strategies, self.micro_batches, self.schedule)
    }

    /// The pipeline of a search result on `g` (`None` when it does not pipeline; an error
    /// when its ops cannot be cut into the interleaved schedule's model chunks).
    pub fn of_search(g: &Graph, r: &SearchResult) -> Result<Option<TrainPipeline>, String> {
        let Some(p) = r.pipeline.as_ref() else { return Ok(None) };
        let name = |n: NodeId| g.node(n).outputs().first().map(|o| o.name.clone()).unwrap_or_default();
        let schedule = p.schedule;
        let (_, stage_of) = passes::autoshard::plan::stage_meshes(r);
        let stage_of = passes::autoshard::interleave::virtual_stages(g, &stage_of, p.stages.len(), schedule.chunks())?;
        Ok(Some(TrainPipeline {
            stages: p.stages.iter().map(|s| (s.sub_mesh.clone(), s.devices.clone(), s.recompute)).collect(),
            stage_of: stage_of.into_iter().map(|(n, j)| (name(n), j)).collect(),
            micro_batches: p.micro_batches,
            schedule,
        }))
    }
}

/// The pipelined training program: `train` is the training graph of one micro-batch,
/// `forward` the forward model the plan priced (`fwd` its strategies, each on its stage's
/// mesh). Every op of `train` gets a stage ([`passes::autoshard::training::stages`]: a
/// backward op runs in its forward op's stage) and each stage's ops their strategies on that
/// stage's mesh ([`passes::autoshard::training::derive_stage`]). The program computes one
/// micro-batch; [`as_micro_batches`] makes it a step of `micro_batches`. Returns it and the
/// number of forward ops that kept the plan's strategy.
pub fn training_pipeline_program(
    train: &Graph,
    forward: &Graph,
    fwd: &passes::cost::Assignment,
    pipe: &TrainPipeline,
    cluster: &passes::cost::Cluster,
    opts: &passes::cost::Options,
) -> Result<(Program, usize), String> {
    use passes::cost::CostModel;
    let by_name = strategies_by_name(forward, fwd);
    let stage_of = passes::autoshard::training::stages(train, &pipe.stage_of)?;
    let mut strategies = HashMap::new();
    let mut kept = 0;
    let mut policy = ir::reshard::Policy::default();
    let (stages, recompute) = stage_placements(
        pipe.stages.iter().map(|(m, d, _)| (m.clone(), d.clone())).collect(),
        &pipe.stages.iter().map(|s| s.2).collect::<Vec<_>>(),
        pipe.schedule,
    );
    for (i, StagePlacement { mesh, .. }) in stages.iter().enumerate() {
        let ops: std::collections::HashSet<NodeId> =
            stage_of.iter().filter(|(_, s)| **s == i).map(|(n, _)| *n).collect();
        let pinned: HashMap<NodeId, Vec<Option<usize>>> = ops
            .iter()
            .filter_map(|&n| {
                let s = by_name.get(train.node(n).outputs().first()?.name.as_str())?;
                Some((n, (*s).clone()))
            })
            .collect();
        let cm = CostModel::new(train, cluster, mesh.clone(), opts.clone());
        policy = cm.policy;
        let (asg, rederived) = passes::autoshard::training::derive_stage(&cm, &pinned, &ops);
        kept += pinned.len() - rederived.len();
        strategies.extend(asg.strategies);
    }
    let placement = Placement {
        stages,
        strategies,
        stage_of,
        micro_batches: 1,
        policy,
        schedule: pipe.schedule,
        recompute,
        zero: 0,
    };
    let p = codegen::lower(train, &placement).map_err(|e| e.to_string())?;
    Ok((p, kept))
}

/// Prepares `m` to run on these input values, as `shardc run --inputs` does: verifies it,
/// types each graph input as its value is, binds the inputs whose values shape inference asks
/// for (shape parameters given at run time: `Reshape`'s shape, `Slice`'s starts, `TopK`'s K …)
/// as constants, infers shapes and canonicalizes. Returns the names of the inputs bound; the
/// program no longer reads them.
pub fn prepare_with_values(m: &mut Model, inputs: &HashMap<String, Array>) -> Result<Vec<String>, String> {
    let flat = |e: passes::PassError| e.errors.iter().map(|l| l.msg.clone()).collect::<Vec<_>>().join("; ");
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify);
    pm.run(m).map_err(flat)?;
    let g = &mut m.graph;
    for v in g.input_values() {
        let name = g.value_name(v).to_string();
        let Some(a) = inputs.get(&name) else { continue };
        if let Some(t) = g.tensor_type(v)
            && t.dtype != a.dtype
        {
            return Err(format!("input `{name}` is {}, but its value is {}", t.dtype, a.dtype));
        }
        let dims: Vec<i64> = a.shape.iter().map(|&d| d as i64).collect();
        g.set_type(v, Some(ir::Type::Tensor(ir::TensorType::fixed(a.dtype, &dims))));
    }
    let mut bound = Vec::new();
    loop {
        let report = ir::infer::infer_shapes(g, ir::infer::Mode::Check)
            .map_err(|e| e.iter().map(|e| e.msg.clone()).collect::<Vec<_>>().join("; "))?;
        let mut any = false;
        // The graph inputs each asked-for value is computed from.
        let mut sources: Vec<Value> = Vec::new();
        let mut stack: Vec<Value> = report.params.clone();
        let mut seen = std::collections::HashSet::new();
        while let Some(v) = stack.pop() {
            if !seen.insert(v) {
                continue;
            }
            let node = g.node(v.node);
            if matches!(node.op, Op::Input { .. }) {
                sources.push(v);
            }
            stack.extend(node.inputs().iter().flatten().chain(node.captures()).copied());
        }
        for v in sources {
            if !matches!(g.node(v.node).op, Op::Input { .. }) {
                continue;
            }
            let name = g.value_name(v).to_string();
            if let Some(a) = inputs.get(&name) {
                g.bind_input(v, a.to_tensor());
                bound.push(name);
                any = true;
            }
        }
        if !any {
            break;
        }
    }
    // As a model loaded at given shapes is prepared (`run`, `plan`): canonicalized, and the
    // algebra pass's rewrites (split fused GEMMs, fused experts) made.
    let mut pm = passes::PassManager::new();
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize).add(passes::Algebra);
    pm.run(m).map_err(flat)?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use ir::eval::Array;

    /// The same infinity is no error (a mask's `-inf` against itself), nor NaN where NaN is
    /// expected; an infinity against a number, or NaN against a number, fails.
    #[test]
    fn equal_infinities_compare_equal() {
        let f = |v: Vec<f32>| Array::f32(vec![v.len()], v);
        let inf = f32::INFINITY;
        assert_eq!(
            super::compare(&f(vec![-inf, 1.0, f32::NAN]), &f(vec![-inf, 1.0, f32::NAN]), 1e-5, 1e-6),
            (0.0, 0.0, true)
        );
        assert!(!super::compare(&f(vec![-inf]), &f(vec![1.0]), 1e-5, 1e-6).2);
        assert!(!super::compare(&f(vec![f32::NAN]), &f(vec![1.0]), 1e-5, 1e-6).2);
        assert!(!super::compare(&f(vec![inf]), &f(vec![-inf]), 1e-5, 1e-6).2);
        assert!(!super::compare(&f(vec![5.0]), &f(vec![inf]), 1e-5, 1e-6).2);
        assert!(crate::train::close(f64::NEG_INFINITY, f64::NEG_INFINITY, (1e-4, 1e-5)));
        // Both runs diverged alike: equal (the divergence itself is reported apart).
        assert!(crate::train::close(f64::NAN, f64::NAN, (1e-4, 1e-5)));
        assert!(!crate::train::close(f64::NAN, 1.0, (1e-4, 1e-5)));
        assert!(!crate::train::close(1.0, f64::NAN, (1e-4, 1e-5)));
        assert!(!crate::train::close(5.0, f64::INFINITY, (1e-4, 1e-5)));
    }
}
