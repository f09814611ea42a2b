//! Sharded execution equals the single-device reference: every golden network and reduced
//! shared models, lowered under named strategies and searched plans on 2, 4 and 8 simulated
//! devices, run on the CPU executor (and on wgpu where an adapter exists).

use std::collections::HashMap;

use codegen::{Backend, Placement, RunOptions, StagePlacement};
use ir::eval::Array;
use passes::autoshard::Named;
use passes::cost::{Cluster, CostModel, Options};
use shardc_tests::*;

fn prepared(path: &std::path::Path) -> ir::Model {
    let mut m = load_model(path);
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default()).add(passes::Canonicalize).add(passes::Algebra);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m
}

fn placement_for(g: &ir::Graph, devices: usize, named: &Named) -> Option<Placement> {
    let c = Cluster::preset("dgx-a100").unwrap();
    let mesh = named.mesh(&c, devices).ok()?;
    let cm = CostModel::new(g, &c, mesh.clone(), Options::default());
    let asg = passes::autoshard::named::assign(&cm, named).ok()?;
    Some(Placement { policy: cm.policy, ..one_stage(&mesh, asg.strategies) })
}

/// One stage of every device of `mesh`, one micro-batch, ops under `strategies`.
fn one_stage(mesh: &ir::shard::Mesh, strategies: HashMap<ir::NodeId, Vec<Option<usize>>>) -> Placement {
    Placement {
        stages: vec![StagePlacement { mesh: mesh.clone(), devices: (0..mesh.devices()).collect() }],
        strategies,
        stage_of: HashMap::new(),
        micro_batches: 1,
        policy: Default::default(),
        schedule: Default::default(),
        recompute: Vec::new(),
        zero: 0,
    }
}

fn close(a: &Array, b: &Array, rtol: f64, atol: f64) -> Result<(), String> {
    if a.shape != b.shape {
        return Err(format!("shape {:?} vs {:?}", a.shape, b.shape));
    }
    let (x, y) = (a.to_f64().map_err(|e| e.to_string())?, b.to_f64().map_err(|e| e.to_string())?);
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        if (p - q).abs() > atol + rtol * q.abs() {
            return Err(format!("element {i}: {p} vs {q}"));
        }
    }
    Ok(())
}

/// The prover proves every program the test runs: a refutation or an op on pieces it has no
/// rule for fails the test.
fn proved(g: &ir::Graph, prog: &codegen::Program, what: &str) {
    if let Err(e) = codegen::verify(g, prog) {
        panic!("{what}: not proved ({:?}): {e}", e.kind);
    }
}

#[test]
fn named_strategies_run_sharded_on_the_cpu_executor_and_match_the_reference() {
    let mut ran = 0;
    for path in data_files("golden") {
        let m = prepared(&path);
        let g = &m.graph;
        let inputs = load_io(&path).inputs;
        let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
        for (named, devices) in [
            ("data", 2),
            ("model", 2),
            ("model", 4),
            ("spatial", 2),
            ("megatron", 2),
            ("megatron", 4),
            ("hybrid:dp:2,tp:2", 4),
            ("spatial-hybrid:2x2", 4),
            ("owt", 2),
            ("data", 8),
        ] {
            let Some(pl) = placement_for(g, devices, &Named::parse(named).unwrap()) else { continue };
            let prog =
                codegen::lower(g, &pl).unwrap_or_else(|e| panic!("{}: {named} on {devices}: {e}", path.display()));
            codegen::check(&prog).unwrap_or_else(|e| panic!("{}: {named}: {e:?}", path.display()));
            proved(g, &prog, &format!("{}: {named} on {devices}", path.display()));
            let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() })
                .unwrap_or_else(|e| panic!("{}: {named} on {devices}: {e}", path.display()));
            for ((name, got), want) in r.outputs.iter().zip(&reference) {
                close(got, want, 1e-4, 1e-5)
                    .unwrap_or_else(|e| panic!("{}: {named} on {devices}, `{name}`: {e}", path.display()));
            }
            ran += 1;
        }
    }
    assert!(ran > 40, "{ran}");
}

/// A random admissible strategy for every op.
fn random_placement(g: &ir::Graph, mesh: &ir::shard::Mesh, seed: u64) -> Placement {
    use ir::shard::{DimKind, iter_space, strategy_valid};
    let mut rng = ir::eval::Rng::new(seed);
    let mut strategies = HashMap::new();
    for n in g.op_nodes().unwrap() {
        let sp = iter_space(g, n);
        let dims: Vec<usize> = (0..sp.dims.len()).filter(|&i| sp.dims[i].kind != DimKind::Fixed).collect();
        let mut s = vec![None; mesh.axes.len()];
        for _ in 0..8 {
            let cand: Vec<Option<usize>> = (0..mesh.axes.len())
                .map(|_| {
                    let k = (rng.next_u64() % (dims.len() as u64 + 1)) as usize;
                    if k == 0 { None } else { Some(dims[k - 1]) }
                })
                .collect();
            if strategy_valid(&sp, &cand, mesh, g, n) {
                s = cand;
                break;
            }
        }
        strategies.insert(n, s);
    }
    one_stage(mesh, strategies)
}

fn grid(sizes: &[usize]) -> ir::shard::Mesh {
    ir::shard::Mesh {
        axes: sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| ir::shard::MeshAxis { name: format!("a{i}"), size: s, level: ir::shard::LinkLevel::Intra })
            .collect(),
    }
}

#[test]
fn random_strategies_run_sharded_and_match_the_reference() {
    let mut ran = 0;
    let mut fallbacks = 0;
    for path in data_files("golden") {
        let m = prepared(&path);
        let g = &m.graph;
        let inputs = load_io(&path).inputs;
        let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
        for (k, sizes) in [vec![2], vec![4], vec![2, 2], vec![2, 4], vec![8]].iter().enumerate() {
            for seed in 0..3u64 {
                let mesh = grid(sizes);
                let pl = random_placement(g, &mesh, seed * 31 + k as u64);
                let what = format!("{} on {sizes:?}, seed {seed}", path.file_name().unwrap().to_string_lossy());
                let prog = codegen::lower(g, &pl).unwrap_or_else(|e| panic!("{what}: {e}"));
                codegen::check(&prog).unwrap_or_else(|e| panic!("{what}: {e:?}"));
                fallbacks += prog.fallbacks.len();
                proved(g, &prog, &what);
                let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() })
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                for ((name, got), want) in r.outputs.iter().zip(&reference) {
                    close(got, want, 1e-4, 1e-5).unwrap_or_else(|e| panic!("{what}, `{name}`: {e}"));
                }
                ran += 1;
            }
        }
    }
    assert!(ran >= 200, "{ran}");
    eprintln!("{ran} random plans ran and were proved; {fallbacks} ops fell back to replicated");
}

#[test]
#[ignore]
fn debug_dump() {
    let name = std::env::var("DBG_MODEL").unwrap();
    let strat = std::env::var("DBG_STRAT").unwrap();
    let devices: usize = std::env::var("DBG_DEV").unwrap().parse().unwrap();
    let path = data_files("golden")
        .into_iter()
        .chain(data_files("models"))
        .find(|p| p.file_name().unwrap().to_string_lossy() == name)
        .unwrap();
    let m = prepared(&path);
    let pl = match strat.strip_prefix("random:") {
        Some(seed) => random_placement(&m.graph, &grid(&[devices]), seed.parse().unwrap()),
        None => placement_for(&m.graph, devices, &Named::parse(&strat).unwrap()).unwrap(),
    };
    for (n, s) in &pl.strategies {
        if s.iter().any(|x| x.is_some()) {
            eprintln!("{} {:?}", m.graph.describe(*n), s);
        }
    }
    match codegen::lower(&m.graph, &pl) {
        Ok(p) => {
            eprintln!("check: {:?}", codegen::check(&p));
            for d in &p.devices {
                eprintln!("== device {}", d.device);
                for n in d.graph.op_nodes().unwrap() {
                    let node = d.graph.node(n);
                    if node.op.class() == ir::OpClass::Comm {
                        eprintln!("    attrs {:?}", node.op.attributes());
                    }
                    eprintln!(
                        "  {} {:?} <- {:?}",
                        node.op.op_type(),
                        node.outputs().iter().map(|o| o.name.clone()).collect::<Vec<_>>(),
                        node.inputs().iter().map(|i| i.map(|v| d.graph.value_name(v).to_string())).collect::<Vec<_>>()
                    );
                }
            }
        }
        Err(e) => eprintln!("{e}"),
    }
}

/// A mean loss whose samples are split counts only the samples it does not ignore, whether
/// `reduction` is written or left to its default (mean): two of four labels ignored, data
/// parallel on 2 devices, equals the reference (sum over the two counted samples / 2). Before
/// the fix the default-reduction case divided by all 4 samples.
#[test]
fn split_mean_losses_count_the_samples_not_ignored() {
    for (op, attrs) in [
        ("SoftmaxCrossEntropyLoss", "<ignore_index: int = 1>"),
        ("SoftmaxCrossEntropyLoss", "<ignore_index: int = 1, reduction: string = \"mean\">"),
        ("NegativeLogLikelihoodLoss", "<ignore_index: int = 1>"),
    ] {
        let text = format!(
            "<ir_version: 8, opset_import: [\"\" : 17]>\nagraph (float[4,3] x, int64[4] labels) => (float loss) {{\n   loss = {op} {attrs} (x, labels)\n}}\n"
        );
        let mut m = frontend::parse(&text).unwrap_or_else(|d| panic!("{d:?}")).model;
        let mut pm = passes::PassManager::new();
        pm.add(passes::Verify).add(passes::InferShapes::default());
        pm.run(&mut m).unwrap();
        let g = &m.graph;
        let x = Array::float(
            ir::DType::Float,
            vec![4, 3],
            vec![0.1, -0.4, 0.3, 1.2, 0.5, -0.7, -0.2, 0.9, 0.4, 0.6, -1.1, 0.8],
        );
        let labels = Array::int(ir::DType::Int64, vec![4], vec![1, 0, 1, 2]);
        let inputs: HashMap<String, Array> = [("x".to_string(), x), ("labels".to_string(), labels)].into();
        let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
        // The loss's samples (iteration dim 0) split over 2 devices.
        let n = g.op_nodes().unwrap()[0];
        let sp = ir::shard::iter_space(g, n);
        assert!(ir::shard::strategy_valid(&sp, &[Some(0)], &grid(&[2]), g, n), "{op}: samples split");
        let pl = Placement {
            stages: vec![StagePlacement { mesh: grid(&[2]), devices: vec![0, 1] }],
            strategies: [(n, vec![Some(0)])].into(),
            stage_of: HashMap::new(),
            micro_batches: 1,
            policy: Default::default(),
            schedule: Default::default(),
            recompute: Vec::new(),
            zero: 0,
        };
        let prog = codegen::lower(g, &pl).unwrap();
        let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() }).unwrap();
        close(&r.outputs[0].1, &reference[0], 1e-5, 1e-6).unwrap_or_else(|e| panic!("{op} {attrs}: {e}"));
    }
}

/// A model of attention ops: grouped-query 4-D attention with an additive mask (splits by
/// batch, heads and query rows), causal 4-D attention (batch, heads, and the sequence as ring
/// attention), 3-D attention with packed heads (batch and rows).
const ATTENTION: &str = "<
   ir_version: 8,
   opset_import: [\"\" : 23]
>
attn (float[4,4,6,8] q, float[4,2,6,8] k, float[4,2,6,8] v, float[6,6] m, float[4,6,16] q3, float[4,6,8] k3, float[4,6,8] v3) => (float[4,4,6,8] y, float[4,4,6,8] z, float[4,6,16] w, float[4,4,6,6] s)
{
   y, pk, pv, s = Attention <qk_matmul_output_mode: int = 1> (q, k, v, m)
   z = Attention <is_causal: int = 1, scale: float = 0.3> (q, k, v)
   w = Attention <q_num_heads: int = 4, kv_num_heads: int = 2> (q3, k3, v3)
}";

#[test]
fn attention_splits_by_batch_heads_and_query_rows_and_matches_the_reference() {
    use ir::shard::{iter_space, strategy_valid};
    let mut m =
        frontend::parse(ATTENTION).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "attn", ATTENTION))).model;
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default());
    pm.run(&mut m).unwrap();
    let g = &m.graph;
    let mut rng = ir::eval::Rng::new(7);
    let inputs: HashMap<String, Array> = g
        .input_values()
        .into_iter()
        .map(|v| {
            let dims: Vec<usize> =
                g.tensor_type(v).unwrap().static_dims().unwrap().iter().map(|&d| d as usize).collect();
            let n = dims.iter().product();
            let x: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
            (g.value_name(v).to_string(), Array::f32(dims, x))
        })
        .collect();
    let reference = ir::eval::run(g, &inputs, &Default::default()).unwrap();
    let nodes = g.op_nodes().unwrap();
    // Each op's splittable dims, by name.
    let names: Vec<Vec<String>> =
        nodes.iter().map(|&n| iter_space(g, n).dims.iter().map(|d| d.name.clone()).collect()).collect();
    assert_eq!(names, [vec!["b", "h", "q"], vec!["b", "h", "s"], vec!["b", "q"]]);
    let mut ran = 0;
    for sizes in [vec![2], vec![2, 2]] {
        let mesh = grid(&sizes);
        // Every op under the same choice of its i-th and j-th dims per axis, where valid.
        for pick in 0..9usize {
            let mut strategies = HashMap::new();
            for &n in &nodes {
                let sp = iter_space(g, n);
                let s: Vec<Option<usize>> = (0..sizes.len())
                    .map(|a| {
                        let k = if a == 0 { pick % 3 } else { pick / 3 };
                        (k < sp.dims.len()).then_some(k)
                    })
                    .collect();
                let s = if strategy_valid(&sp, &s, &mesh, g, n) { s } else { vec![None; sizes.len()] };
                strategies.insert(n, s);
            }
            let pl = one_stage(&mesh, strategies);
            let what = format!("{sizes:?}, pick {pick}");
            let prog = codegen::lower(g, &pl).unwrap_or_else(|e| panic!("{what}: {e}"));
            codegen::check(&prog).unwrap_or_else(|e| panic!("{what}: {e:?}"));
            assert!(prog.fallbacks.is_empty(), "{what}: {:?}", prog.fallbacks);
            let r = codegen::run(&prog, &inputs, &RunOptions { backend: Backend::Cpu, ..Default::default() })
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for ((name, got), want) in r.outputs.iter().zip(&reference) {
                close(got, want, 1e-4, 1e-5).unwrap_or_else(|e| panic!("{what}, `{name}`: {e}"));
            }
            ran += 1;
        }
    }
    assert_eq!(ran, 18);
}
