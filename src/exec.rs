//! From a plan to a running program: loading weights, building the placement codegen lowers,
//! micro-batching pipelines, and the inputs to run on.

use std::collections::HashMap;
use std::path::Path;

use codegen::{Placement, Program, StagePlacement};
use ir::eval::Array;
use ir::shard::{Mesh, MeshAxis, OpStrategy};
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

fn read_external(entries: &[(String, String)], dtype: DType, dims: &[i64], dir: &Path) -> Option<Array> {
    let get = |k: &str| entries.iter().find(|(a, _)| a == k).map(|(_, v)| v.as_str());
    let path = dir.join(get("location")?);
    let bytes = std::fs::read(path).ok()?;
    let offset: usize = get("offset").unwrap_or("0").parse().ok()?;
    let shape: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
    let n: usize = shape.iter().product();
    let width = match dtype {
        DType::Float | DType::Int32 => 4,
        DType::Int64 | DType::Double => 8,
        DType::Bool | DType::Uint8 | DType::Int8 => 1,
        _ => return None,
    };
    let raw = bytes.get(offset..offset + n * width)?;
    Some(match dtype {
        DType::Float => {
            Array::f32(shape, raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        }
        DType::Double => Array::float(
            DType::Double,
            shape,
            raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
        ),
        DType::Int64 => {
            Array::i64(shape, raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
        }
        DType::Int32 => Array::int(
            DType::Int32,
            shape,
            raw.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
        ),
        DType::Bool => Array::bool(shape, raw.iter().map(|&b| b != 0).collect()),
        DType::Uint8 => Array::int(DType::Uint8, shape, raw.iter().map(|&b| b as i64).collect()),
        DType::Int8 => Array::int(DType::Int8, shape, raw.iter().map(|&b| b as i8 as i64).collect()),
        _ => return None,
    })
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
        let TensorData::External(entries) = &t.data else { continue };
        let name = g.value_name(Value::new(n, 0)).to_string();
        let a = match read_external(entries, t.dtype, &t.dims, dir) {
            Some(a) => {
                w.loaded += 1;
                a
            }
            None => {
                w.seeded += 1;
                ir::eval::seeded_initializer(g, Value::new(n, 0), seed).map_err(|e| format!("`{name}`: {e}"))?
            }
        };
        let mut tensor = a.to_tensor();
        tensor.name = t.name.clone();
        g.set_op(n, Op::Initializer(tensor));
    }
    Ok(w)
}

fn mesh_of(axes: &[passes::autoshard::plan::PlanAxis]) -> Result<Mesh, String> {
    axes.iter()
        .map(|a| {
            let level = match a.level.as_str() {
                "intra" => ir::shard::LinkLevel::Intra,
                "inter" => ir::shard::LinkLevel::Inter,
                l => return Err(format!("mesh axis `{}`: unknown level `{l}`", a.name)),
            };
            Ok(MeshAxis { name: a.name.clone(), size: a.size, level })
        })
        .collect::<Result<Vec<_>, String>>()
        .map(|axes| Mesh { axes })
}

/// The dim along which `full` and `micro` shapes differ by `m` (the micro-batch axis).
fn batch_axis(full: &[usize], micro: &[usize], m: usize) -> Option<usize> {
    (0..full.len().min(micro.len())).find(|&d| full[d] != micro[d] && micro[d] * m == full[d])
}

/// Re-batches a copy of `g` (batch `batch`) to micro-batches of `batch / m`.
fn micro_graph(g: &Graph, m: usize) -> Result<Graph, String> {
    if m <= 1 {
        return Ok(g.clone());
    }
    let batch =
        passes::cost::pipeline::graph_batch(g).ok_or("the model has no batch dim to split into micro-batches")?;
    if batch % m as i64 != 0 {
        return Err(format!("{m} micro-batches do not divide the batch of {batch}"));
    }
    let mut gm = g.clone();
    passes::rebatch::rebatch(&mut gm, &passes::RebatchSpec { batch: Some(batch / m as i64), ..Default::default() })
        .map_err(|e| {
            format!("cannot re-batch to micro-batches: {}", e.errors.first().map(|x| x.msg.clone()).unwrap_or_default())
        })?;
    Ok(gm)
}

/// Lowers `g` (full batch, shapes inferred, weights inline) under per-op strategies keyed by
/// first output name, with stages and micro-batches.
fn lower_named(
    g: &Graph,
    meshes: Vec<Mesh>,
    devices: Vec<Vec<usize>>,
    by_name: &HashMap<String, (OpStrategy, usize)>,
    micro: usize,
) -> Result<Program, String> {
    let gm = micro_graph(g, micro)?;
    let mut strategies = HashMap::new();
    let mut stage_of = HashMap::new();
    for n in gm.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
        let key = gm.node(n).outputs().first().map(|o| o.name.as_str()).unwrap_or("");
        if let Some((s, st)) = by_name.get(key) {
            strategies.insert(n, s.clone());
            stage_of.insert(n, *st);
        }
    }
    let placement = Placement {
        stages: meshes.into_iter().zip(devices).map(|(mesh, devices)| StagePlacement { mesh, devices }).collect(),
        strategies,
        stage_of,
        micro_batches: micro.max(1),
    };
    let mut p = codegen::lower(&gm, &placement).map_err(|e| e.to_string())?;
    // Micro-batch axes of the inputs and outputs.
    for io in p.inputs.iter_mut().chain(p.outputs.iter_mut()) {
        let v = g.lookup(&io.name).ok_or_else(|| format!("`{}` is not in the model", io.name))?;
        let full: Vec<usize> = g
            .tensor_type(v)
            .and_then(|t| t.static_dims())
            .ok_or_else(|| format!("`{}` has no static shape", io.name))?
            .into_iter()
            .map(|d| d as usize)
            .collect();
        io.batch_axis = batch_axis(&full, &io.shape, micro);
        io.shape = full;
    }
    Ok(p)
}

/// The program of a plan document for `g` (the model the plan was made for, full batch,
/// shapes inferred, weights inline).
pub fn program_for_plan(g: &Graph, plan: &Plan) -> Result<Program, String> {
    let mut by_name = HashMap::new();
    for o in &plan.ops {
        if let Some(first) = o.outputs.first() {
            by_name.insert(first.clone(), (o.split.clone(), o.stage));
        }
    }
    let meshes = plan.stages.iter().map(|s| mesh_of(&s.mesh)).collect::<Result<Vec<_>, _>>()?;
    let devices = plan.stages.iter().map(|s| s.devices.clone()).collect();
    lower_named(g, meshes, devices, &by_name, plan.micro_batches)
}

/// The program of a search result for `g`.
pub fn program_for_search(g: &Graph, r: &SearchResult, devices: usize) -> Result<Program, String> {
    let (meshes, stage_of) = passes::autoshard::plan::stage_meshes(r);
    let mut by_name = HashMap::new();
    for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
        let Some(first) = g.node(n).outputs().first() else { continue };
        let st = stage_of.get(&n).copied().unwrap_or(0);
        let s = r.assignment.strategies.get(&n).cloned().unwrap_or_else(|| vec![None; meshes[st].axes.len()]);
        by_name.insert(first.name.clone(), (s, st));
    }
    let device_lists: Vec<Vec<usize>> = match &r.pipeline {
        Some(p) => p.stages.iter().map(|s| s.devices.clone()).collect(),
        None => vec![(0..devices).collect()],
    };
    let micro = r.pipeline.as_ref().map_or(1, |p| p.micro_batches);
    lower_named(g, meshes, device_lists, &by_name, micro)
}

/// A named strategy (`data`, `model`, `spatial`, `hybrid:DxS`, `owt`) priced on `devices`
/// devices of `cluster`, as a search result that [`program_for_search`] lowers. Pipelines
/// go through a plan instead.
pub fn named_result(
    g: &Graph,
    cluster: &passes::cost::Cluster,
    devices: usize,
    strategy: &str,
    opts: &passes::cost::Options,
) -> Result<SearchResult, String> {
    use passes::cost::{CostModel, Named};
    let named = Named::parse(strategy)?;
    if matches!(named, Named::Pipeline(..)) {
        return Err(
            "run a pipeline through a plan: shardc plan --pipeline S -o plan.json, then --plan plan.json".into()
        );
    }
    let mesh = named.mesh(cluster, devices)?;
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let asg = passes::cost::strategy::assign(&cm, &named)
        .map_err(|e| format!("strategy `{strategy}` does not apply: {e}"))?;
    Ok(SearchResult {
        breakdown: cm.evaluate(&asg),
        mesh,
        assignment: asg,
        same_as: Some(strategy.to_string()),
        data_parallel: None,
        meshes: Vec::new(),
        search_time_s: 0.0,
        time_limit_hit: false,
        budget_cut: Vec::new(),
        pipeline: None,
        pipeline_considered: None,
        single_device_memory_bytes: 0.0,
    })
}

/// Inputs for a run: the golden `.io.json` format (`{"inputs": {name: {dtype, shape,
/// data}}}`), or values drawn from `seed`.
pub fn inputs_for(g: &Graph, io: Option<&serde_json::Value>, seed: u64) -> Result<HashMap<String, Array>, String> {
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
        let a = match io.and_then(|j| j.get("inputs")).and_then(|j| j.get(&name)) {
            Some(j) => array_from_json(j).map_err(|e| format!("input `{name}`: {e}"))?,
            None if io.is_some() => return Err(format!("the inputs file has no `{name}`")),
            None => ir::eval::random_tensor(t.dtype, &dims, "input", seed, &name).map_err(|e| e.to_string())?,
        };
        let want: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        if a.shape != want {
            return Err(format!("input `{name}` has shape {:?}, the model expects {want:?}", a.shape));
        }
        out.insert(name, a);
    }
    Ok(out)
}

/// One array of the golden JSON format.
pub fn array_from_json(v: &serde_json::Value) -> Result<Array, String> {
    let dtype = match v["dtype"].as_str().ok_or("no dtype")? {
        "float32" => DType::Float,
        "float64" => DType::Double,
        "int64" => DType::Int64,
        "int32" => DType::Int32,
        "bool" => DType::Bool,
        other => return Err(format!("unsupported dtype `{other}`")),
    };
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .ok_or("no shape")?
        .iter()
        .map(|d| d.as_u64().map(|x| x as usize).ok_or("a dim is not a number"))
        .collect::<Result<_, _>>()?;
    let data = v["data"].as_array().ok_or("no data")?;
    let n: usize = shape.iter().product();
    if data.len() != n {
        return Err(format!("{} values for shape {shape:?}", data.len()));
    }
    Ok(match dtype {
        DType::Float => Array::f32(shape, data.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()),
        DType::Double => {
            Array::float(DType::Double, shape, data.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
        }
        DType::Bool => Array::bool(shape, data.iter().map(|x| x.as_bool().unwrap_or(false)).collect()),
        d => Array::int(d, shape, data.iter().map(|x| x.as_i64().unwrap_or(0)).collect()),
    })
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
        ir::eval::Data::F32(v) => v.iter().map(|&x| serde_json::json!(x)).collect(),
        ir::eval::Data::F64(v) => v.iter().map(|&x| serde_json::json!(x)).collect(),
        ir::eval::Data::I64(v) => v.iter().map(|&x| serde_json::json!(x)).collect(),
        ir::eval::Data::Bool(v) => v.iter().map(|&x| serde_json::json!(x)).collect(),
        ir::eval::Data::Str(v) => v.iter().map(|x| serde_json::json!(x)).collect(),
    };
    serde_json::json!({"dtype": dtype, "shape": a.shape, "data": data})
}

/// The largest absolute and relative errors of `got` against `want`, and whether every
/// element passes `|got − want| ≤ atol + rtol·|want|` (integers and booleans: exactly).
pub fn compare(got: &Array, want: &Array, rtol: f64, atol: f64) -> (f64, f64, bool) {
    if got.shape != want.shape {
        return (f64::INFINITY, f64::INFINITY, false);
    }
    let (Ok(x), Ok(y)) = (got.to_f64(), want.to_f64()) else { return (f64::INFINITY, f64::INFINITY, false) };
    let exact = !want.dtype.is_float();
    let (mut max_abs, mut max_rel, mut ok) = (0.0f64, 0.0f64, true);
    for (a, b) in x.iter().zip(&y) {
        let d = (a - b).abs();
        if d.is_nan() && !(a.is_nan() && b.is_nan()) {
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
