//! A plan written into the model itself: per-op annotations (strategy, layouts, mesh, stage) and reading them back.

use super::*;

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

/// The op's pipeline stage, when the plan pipelines.
pub const ANN_STAGE: &str = "shardc_stage";

/// Writes the plan onto the graph: per op its strategy (`d0@nodes, 2@gpus` or `replicated`,
/// by iteration-dim index), input and output layouts, and its pipeline stage when there are
/// several; the meshes (one per stage, ` | `-separated) go in the model's `metadata_props`.
pub fn annotate(model: &mut ir::Model, r: &SearchResult) {
    let (meshes, stage_of) = stage_meshes(r);
    annotate_graph(&mut model.graph, &meshes, &stage_of, &r.assignment);
    set_mesh_metadata(&mut model.metadata_props, &meshes);
}

/// Each stage's mesh and each op's stage (one stage when the plan does not pipeline).
pub fn stage_meshes(r: &SearchResult) -> (Vec<Mesh>, HashMap<NodeId, usize>) {
    match &r.pipeline {
        Some(p) => (
            p.stages.iter().map(|s| s.sub_mesh.clone()).collect(),
            p.stages.iter().enumerate().flat_map(|(i, s)| s.nodes.iter().map(move |&n| (n, i))).collect(),
        ),
        None => (vec![r.mesh.clone()], HashMap::new()),
    }
}

/// Records the meshes in a model's `metadata_props`.
pub fn set_mesh_metadata(props: &mut Option<Vec<(String, String)>>, meshes: &[Mesh]) {
    let props = props.get_or_insert_with(Vec::new);
    props.retain(|(k, _)| k != ANN_MESH);
    let text: Vec<String> = meshes.iter().map(mesh_annotation).collect();
    props.push((ANN_MESH.into(), text.join(" | ")));
}

/// Writes per-op annotations (see [`annotate`]).
pub fn annotate_graph(g: &mut Graph, meshes: &[Mesh], stage_of: &HashMap<NodeId, usize>, asg: &Assignment) {
    // An earlier plan's annotations go; the others stay (a constant's `shardc_frozen`, a
    // rewritten weight's `shardc_origin`).
    g.remove_annotations(&[ANN_STRATEGY, ANN_INPUTS, ANN_OUTPUTS, ANN_STAGE]);
    let order = g.op_nodes().unwrap_or_default();
    for n in order {
        let stage = stage_of.get(&n).copied().unwrap_or(0);
        let mesh = &meshes[stage.min(meshes.len() - 1)];
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
        if meshes.len() > 1 {
            g.set_annotation(n, ANN_STAGE, stage.to_string());
        }
    }
}

/// A plan read back from annotations.
pub struct Annotated {
    /// One mesh per stage.
    pub meshes: Vec<Mesh>,
    /// Each op's stage (absent: 0).
    pub stages: HashMap<NodeId, usize>,
    /// Each op's strategy on its stage's mesh.
    pub assignment: Assignment,
}

/// Reads annotations written by [`annotate`] back (the graph's shapes inferred). Errors say
/// which op's annotation is missing or malformed.
pub fn read_annotations(model: &ir::Model) -> Result<Annotated, String> {
    let g = &model.graph;
    let mesh_text = model
        .metadata_props
        .iter()
        .flatten()
        .find(|(k, _)| k == ANN_MESH)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| format!("the model has no `{ANN_MESH}` in its metadata_props"))?;
    let meshes: Vec<Mesh> = mesh_text.split(" | ").map(parse_mesh_annotation).collect::<Result<_, _>>()?;
    let mut asg = Assignment::default();
    let mut stages = HashMap::new();
    for n in g.op_nodes().map_err(|_| "the graph has a cycle".to_string())? {
        let node = g.node(n);
        let ann = |key: &str| node.annotations.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        let text = ann(ANN_STRATEGY).ok_or_else(|| format!("{} has no `{ANN_STRATEGY}` annotation", g.describe(n)))?;
        let stage: usize = match ann(ANN_STAGE) {
            Some(x) => x.parse().map_err(|_| format!("{}: `{ANN_STAGE}` is not a number", g.describe(n)))?,
            None => 0,
        };
        let mesh = meshes.get(stage).ok_or_else(|| format!("{}: no stage {stage} in `{ANN_MESH}`", g.describe(n)))?;
        stages.insert(n, stage);
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
        check_strategy(g, n, &s, mesh)?;
        // Layout annotations, when present, must agree with the strategy.
        if let Some(outs) = ann(ANN_OUTPUTS) {
            let sp = ir::shard::iter_space(g, n);
            let (_, want) = strategy_shardings(&sp, &s);
            let got: Vec<Option<Sharding>> = outs.split(';').map(parse_sharding).collect();
            if got.len() != want.len() || got.iter().zip(&want).any(|(a, b)| a.as_ref() != Some(b)) {
                return Err(format!("{}: `{ANN_OUTPUTS}` disagrees with its strategy", g.describe(n)));
            }
        }
        asg.strategies.insert(n, s);
    }
    Ok(Annotated { meshes, stages, assignment: asg })
}
