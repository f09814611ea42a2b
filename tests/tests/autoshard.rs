//! The search (`autoshard`): optimality against brute force on small graphs, the papers'
//! findings on real models, every shared model planning, determinism, the plan document and
//! annotations.

use ir::shard::{DimKind, LinkLevel, Mesh, MeshAxis, strategy_valid};
use passes::autoshard::{self, PipelineMode, SearchOptions, SearchResult};
use passes::cost::{Assignment, Breakdown, Cluster, CostModel, Options};
use shardc_tests::*;

/// A model prepared as the CLI does (re-batched, shapes inferred, canonicalized).
fn prepare(mut m: ir::Model, spec: passes::RebatchSpec) -> ir::Model {
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify);
    if !spec.is_empty() {
        pm.add(passes::Rebatch { spec });
    }
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize).add(passes::Algebra);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{e}"));
    m
}

fn shared(name: &str, spec: passes::RebatchSpec) -> ir::Model {
    let path =
        data_files("models").into_iter().find(|p| p.file_name().unwrap() == name).unwrap_or_else(|| panic!("{name}"));
    prepare(load_model(&path), spec)
}

fn from_text(text: &str) -> ir::Model {
    let parsed = frontend::parse(text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "test", text)));
    prepare(parsed.model, Default::default())
}

fn batch(b: i64) -> passes::RebatchSpec {
    passes::RebatchSpec { batch: Some(b), ..Default::default() }
}

/// A cluster with round numbers and real latencies.
fn toy(latency: f64) -> Cluster {
    let mut c = Cluster::preset("dgx-a100").unwrap();
    c.name = "toy".into();
    c.device.peak_flops.fp32 = 1e12;
    c.device.efficiency = 1.0;
    // Flat efficiency (no tile quantization): the toy's 16-wide GEMMs would otherwise all run
    // at 1/8 of peak.
    c.device.gemm_tile = 1;
    c.device.gemm_k_overhead = 0.0;
    c.device.mem_bandwidth = 1e11;
    c.device.launch_overhead = latency;
    c.intra.bandwidth = 1e10;
    c.intra.latency = latency;
    c.host.latency = latency;
    c
}

fn line(n: usize) -> Mesh {
    Mesh::line(n, LinkLevel::Intra)
}

fn grid(a: usize, b: usize) -> Mesh {
    Mesh {
        axes: vec![
            MeshAxis { name: "x".into(), size: a, level: LinkLevel::Intra },
            MeshAxis { name: "y".into(), size: b, level: LinkLevel::Intra },
        ],
    }
}

/// Every admissible strategy of every op, enumerated independently of the search.
fn all_strategies(cm: &CostModel<'_>) -> Vec<Vec<Vec<Option<usize>>>> {
    let k = cm.mesh.axes.len();
    cm.order()
        .iter()
        .map(|&n| {
            let sp = cm.space(n);
            let dims: Vec<Option<usize>> = std::iter::once(None)
                .chain((0..sp.dims.len()).filter(|&i| sp.dims[i].kind != DimKind::Fixed).map(Some))
                .collect();
            let mut out = Vec::new();
            let mut idx = vec![0usize; k];
            loop {
                let s: Vec<Option<usize>> = idx.iter().map(|&i| dims[i]).collect();
                if s.iter().all(Option::is_none) || strategy_valid(sp, &s, &cm.mesh, cm.g, n) {
                    out.push(s);
                }
                let mut a = 0;
                while a < k {
                    idx[a] += 1;
                    if idx[a] < dims.len() {
                        break;
                    }
                    idx[a] = 0;
                    a += 1;
                }
                if a == k {
                    break;
                }
            }
            out
        })
        .collect()
}

fn better(a: &Breakdown, b: &Breakdown) -> bool {
    match (a.feasible, b.feasible) {
        (true, false) => true,
        (false, true) => false,
        (true, true) => a.step_time_s < b.step_time_s,
        (false, false) => a.memory.total() < b.memory.total(),
    }
}

/// The best plan by enumerating every assignment. Panics past `limit` assignments.
fn brute_force(g: &ir::Graph, cluster: &Cluster, mesh: &Mesh, opts: &Options, limit: usize) -> (Breakdown, usize) {
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let all = all_strategies(&cm);
    let total: usize = all.iter().map(Vec::len).product();
    assert!(total <= limit, "{total} assignments");
    let order = cm.order().to_vec();
    let mut idx = vec![0usize; all.len()];
    let mut best: Option<Breakdown> = None;
    loop {
        let asg =
            Assignment { strategies: order.iter().enumerate().map(|(t, &n)| (n, all[t][idx[t]].clone())).collect() };
        let b = cm.price(&asg);
        if best.as_ref().is_none_or(|x| better(&b, x)) {
            best = Some(b);
        }
        let mut t = 0;
        while t < idx.len() {
            idx[t] += 1;
            if idx[t] < all[t].len() {
                break;
            }
            idx[t] = 0;
            t += 1;
        }
        if t == idx.len() {
            break;
        }
    }
    (best.unwrap(), total)
}

fn search_on(g: &ir::Graph, cluster: &Cluster, mesh: &Mesh, opts: &Options, so: SearchOptions) -> SearchResult {
    let so = SearchOptions { meshes: Some(vec![mesh.clone()]), threads: 1, pipeline: PipelineMode::Off, ..so };
    autoshard::search(g, cluster, mesh.devices(), opts, &so).unwrap()
}

/// A random small graph over `[B, S, H]` activations: projections with weights, element-wise
/// ops, residual adds (fan-out), softmax and layer norm (statistics), transposes and
/// reductions (partial sums).
fn random_graph(seed: u64, ops: usize) -> String {
    let mut rng = ir::eval::Rng::new(seed);
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    let (b, s) = (8, 8);
    let widths = [16usize, 32];
    let mut inits: Vec<String> = Vec::new();
    let mut lines: Vec<String> = Vec::new();
    // Live values: (name, dims).
    let mut vals: Vec<(String, Vec<usize>)> = vec![("x".into(), vec![b, s, 16])];
    for i in 0..ops {
        let cur = vals[vals.len() - 1 - pick(vals.len().min(2))].clone();
        let name = format!("v{i}");
        let dims = cur.1.clone();
        let h = *dims.last().unwrap();
        let kind = pick(8);
        let (line, out): (String, Vec<usize>) = match kind {
            0 | 1 if dims.len() == 3 => {
                let w = widths[pick(2)];
                inits.push(format!(
                    "float[{h},{w}] w{i} = [\"location\": \"x.bin\", \"offset\": \"0\", \"length\": \"{}\"]",
                    h * w * 4
                ));
                (format!("{name} = MatMul ({}, w{i})", cur.0), vec![dims[0], dims[1], w])
            }
            2 => (format!("{name} = Relu ({})", cur.0), dims.clone()),
            3 => {
                let other = vals.iter().rev().find(|v| v.1 == dims && v.0 != cur.0).cloned();
                match other {
                    Some(o) => (format!("{name} = Add ({}, {})", cur.0, o.0), dims.clone()),
                    None => (format!("{name} = Tanh ({})", cur.0), dims.clone()),
                }
            }
            4 => (format!("{name} = Softmax <axis: int = -1> ({})", cur.0), dims.clone()),
            5 if dims.len() == 3 => {
                inits.push(format!(
                    "float[{h}] g{i} = [\"location\": \"x.bin\", \"offset\": \"0\", \"length\": \"{}\"]",
                    h * 4
                ));
                (format!("{name} = LayerNormalization <axis: int = -1> ({}, g{i})", cur.0), dims.clone())
            }
            6 if dims.len() == 3 => {
                (format!("{name} = Transpose <perm: ints = [0, 2, 1]> ({})", cur.0), vec![dims[0], dims[2], dims[1]])
            }
            _ => (format!("{name} = Sigmoid ({})", cur.0), dims.clone()),
        };
        lines.push(format!("   {line}"));
        vals.push((name, out));
    }
    let (last, ldims) = vals.last().unwrap().clone();
    let d: Vec<String> = ldims.iter().map(|x| x.to_string()).collect();
    let init_text = if inits.is_empty() { String::new() } else { format!("\n   <{}>", inits.join(", ")) };
    format!(
        "<\n   ir_version: 8,\n   opset_import: [\"\" : 17]\n>\nrandom (float[{b},{s},16] x) => (float[{}] {last}){init_text}\n{{\n{}\n}}",
        d.join(","),
        lines.join("\n")
    )
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs()
}

#[test]
fn the_search_finds_the_brute_force_optimum_on_small_graphs() {
    // Default cost options (overlapped, bucketed gradient synchronisation, preloaded input),
    // real latencies, the dynamic program and local search forced (no enumeration).
    let cluster = toy(5e-6);
    let opts = Options::default();
    let mut checked = 0;
    for seed in 0..40u64 {
        let m = from_text(&random_graph(seed, 4 + (seed % 4) as usize));
        for mesh in [line(8), grid(2, 4)] {
            let cm = CostModel::new(&m.graph, &cluster, mesh.clone(), opts.clone());
            let total: usize = all_strategies(&cm).iter().map(Vec::len).product();
            if total > 60_000 {
                continue;
            }
            let (best, _) = brute_force(&m.graph, &cluster, &mesh, &opts, 60_000);
            let so = SearchOptions { exhaustive_limit: 0.0, ..Default::default() };
            let r = search_on(&m.graph, &cluster, &mesh, &opts, so);
            assert_eq!(r.breakdown.feasible, best.feasible);
            assert!(
                close(r.breakdown.step_time_s, best.step_time_s),
                "seed {seed}, mesh {}: search {} vs optimum {}\n{}",
                autoshard::mesh_string(&mesh),
                r.breakdown.step_time_s,
                best.step_time_s,
                random_graph(seed, 4 + (seed % 4) as usize)
            );
            checked += 1;
        }
    }
    eprintln!("checked {checked}");
    assert!(checked >= 30, "only {checked} cases were small enough");
}

#[test]
fn the_dynamic_program_alone_is_exact_where_the_objective_decomposes() {
    // No overlap, no preload, zero latencies: the step time is a sum over ops and edges, which
    // is what the dynamic program minimises; without the beam dropping states its plan is the
    // optimum (no enumeration, no local search to help it).
    let cluster = toy(0.0);
    let opts = Options { overlap_grad_sync: false, preload: false, ..Options::default() };
    let mut checked = 0;
    for seed in 100..130u64 {
        let m = from_text(&random_graph(seed, 3 + (seed % 5) as usize));
        for mesh in [line(8), grid(2, 4)] {
            let cm = CostModel::new(&m.graph, &cluster, mesh.clone(), opts.clone());
            let total: usize = all_strategies(&cm).iter().map(Vec::len).product();
            if total > 60_000 {
                continue;
            }
            let (best, _) = brute_force(&m.graph, &cluster, &mesh, &opts, 60_000);
            let so = SearchOptions { exhaustive_limit: 0.0, local_search: false, ..Default::default() };
            let r = search_on(&m.graph, &cluster, &mesh, &opts, so);
            assert!(!r.meshes[0].extraction.dp_pruned);
            assert!(
                close(r.breakdown.step_time_s, best.step_time_s),
                "seed {seed}, mesh {}: dynamic program {} vs optimum {}\n{}",
                autoshard::mesh_string(&mesh),
                r.breakdown.step_time_s,
                best.step_time_s,
                random_graph(seed, 3 + (seed % 5) as usize)
            );
            checked += 1;
        }
    }
    eprintln!("checked {checked}");
    assert!(checked >= 20, "only {checked} cases were small enough");
}

/// Sub-graphs of real models, written out: a transformer MLP, attention scores, a conv block.
const REAL_SUBGRAPHS: &[&str] = &[
    // GPT-2 MLP: c_fc, GELU (tanh form), c_proj, residual.
    r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
mlp (float[8,16,32] x) => (float[8,16,32] y)
   <float[32,128] w1 = ["location": "x.bin", "offset": "0", "length": "16384"], float[128] b1 = ["location": "x.bin", "offset": "0", "length": "512"], float[128,32] w2 = ["location": "x.bin", "offset": "0", "length": "16384"], float[32] b2 = ["location": "x.bin", "offset": "0", "length": "128"]>
{
   h = MatMul (x, w1)
   hb = Add (h, b1)
   t = Tanh (hb)
   g = Mul (hb, t)
   o = MatMul (g, w2)
   ob = Add (o, b2)
   y = Add (x, ob)
}"#,
    // Attention core: scores, scale, softmax, context.
    r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
attn (float[8,4,16,8] q, float[8,4,8,16] k, float[8,4,16,8] v) => (float[8,4,16,8] y)
   <float s = {0.35}>
{
   sc = MatMul (q, k)
   ss = Mul (sc, s)
   p = Softmax <axis: int = -1> (ss)
   y = MatMul (p, v)
}"#,
    // ResNet basic block stem: conv, batch norm, relu, max pool.
    r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
conv (float[8,4,16,16] x) => (float[8,8,8,8] y)
   <float[8,4,3,3] w = ["location": "x.bin", "offset": "0", "length": "1152"], float[8] sc = ["location": "x.bin", "offset": "0", "length": "32"], float[8] bi = ["location": "x.bin", "offset": "0", "length": "32"], float[8] mn = ["location": "x.bin", "offset": "0", "length": "32"], float[8] vr = ["location": "x.bin", "offset": "0", "length": "32"]>
{
   c = Conv <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (x, w)
   b = BatchNormalization (c, sc, bi, mn, vr)
   r = Relu (b)
   y = MaxPool <kernel_shape: ints = [2, 2], strides: ints = [2, 2]> (r)
}"#,
];

#[test]
fn the_search_finds_the_brute_force_optimum_on_real_subgraphs() {
    let cluster = toy(5e-6);
    let opts = Options::default();
    for text in REAL_SUBGRAPHS {
        let m = from_text(text);
        for mesh in [line(8), grid(2, 4), line(4)] {
            let cm = CostModel::new(&m.graph, &cluster, mesh.clone(), opts.clone());
            let total: usize = all_strategies(&cm).iter().map(Vec::len).product();
            if total > 200_000 {
                continue;
            }
            let (best, _) = brute_force(&m.graph, &cluster, &mesh, &opts, 200_000);
            for so in [SearchOptions::default(), SearchOptions { exhaustive_limit: 0.0, ..Default::default() }] {
                let r = search_on(&m.graph, &cluster, &mesh, &opts, so);
                assert!(
                    close(r.breakdown.step_time_s, best.step_time_s),
                    "{}: {} vs optimum {} on {}",
                    m.graph.name,
                    r.breakdown.step_time_s,
                    best.step_time_s,
                    autoshard::mesh_string(&mesh)
                );
            }
        }
    }
}

/// The strategy of every op whose label or first output name contains `pat`, described.
fn strategies_of(g: &ir::Graph, r: &SearchResult, cluster: &Cluster, pat: &str) -> Vec<(String, Vec<Option<String>>)> {
    let cm = CostModel::new(g, cluster, r.mesh.clone(), Options::default());
    cm.order()
        .iter()
        .filter(|&&n| g.op_name(n) == pat)
        .map(|&n| {
            let s = cm.strategy_of(&r.assignment, n);
            let sp = cm.space(n);
            (g.op_name(n), s.iter().map(|d| d.map(|i| sp.dims[i].name.clone())).collect())
        })
        .collect()
}

/// Per op of type `op`: the roles of the dims it splits (one per mesh axis, `None` if not
/// split).
fn roles_of(g: &ir::Graph, r: &SearchResult, cluster: &Cluster, op: &str) -> Vec<Vec<Option<ir::shard::DimRole>>> {
    let cm = CostModel::new(g, cluster, r.mesh.clone(), Options::default());
    cm.order()
        .iter()
        .filter(|&&n| g.node(n).op.op_type() == op)
        .map(|&n| {
            let s = cm.strategy_of(&r.assignment, n);
            s.iter().map(|d| d.map(|i| cm.space(n).dims[i].role)).collect()
        })
        .collect()
}

fn plan(g: &ir::Graph, cluster: &Cluster, devices: usize, opts: &Options) -> SearchResult {
    autoshard::search(g, cluster, devices, opts, &SearchOptions::default()).unwrap()
}

#[test]
fn finding_a_convolutions_data_parallel_fully_connected_layers_model_parallel() {
    // PaSE and "one weird trick" on 8 PCIe V100s at batch 256. PaSE's cost model does not
    // overlap gradient synchronisation with the backward pass; neither does this test.
    use ir::shard::DimRole;
    let cluster = Cluster::preset("pcie-v100x8").unwrap();
    let opts = Options { overlap_grad_sync: false, ..Options::default() };
    for name in ["tv_alexnet.onnxtxt", "tv_vgg16.onnxtxt"] {
        let m = shared(name, batch(256));
        let r = plan(&m.graph, &cluster, 8, &opts);
        let dp = r.data_parallel.as_ref().unwrap();
        let speedup = dp.step_time_s / r.breakdown.step_time_s;
        assert!(speedup >= 1.3, "{name}: {speedup:.2}× over data parallel");
        for roles in roles_of(&m.graph, &r, &cluster, "Conv") {
            assert!(roles.iter().all(|x| *x == Some(DimRole::Batch)), "{name}: a convolution splits {roles:?}");
        }
        for roles in roles_of(&m.graph, &r, &cluster, "Gemm") {
            assert!(
                roles.iter().any(|x| matches!(x, Some(DimRole::OutFeature | DimRole::InFeature))),
                "{name}: a fully connected layer splits {roles:?}"
            );
        }
    }
}

#[test]
fn finding_b_megatron_tensor_parallelism_for_a_wide_gpt_block() {
    let text =
        shardc::synthetic::Gpt { layers: 2, hidden: 4096, heads: 32, batch: 8, seq: 1024, fused_gelu: false, vocab: 0 }
            .to_text();
    let m = from_text(&text);
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let r = plan(&m.graph, &cluster, 8, &Options::default());
    if std::env::var_os("SHARDC_DEBUG_TEST").is_some() {
        let cm = CostModel::new(&m.graph, &cluster, r.mesh.clone(), Options::default());
        for &n in cm.order() {
            let s = cm.strategy_of(&r.assignment, n);
            eprintln!("{} {} {}", m.graph.op_name(n), m.graph.node(n).op.op_type(), cm.describe_strategy(n, &s));
        }
        eprintln!("same_as {:?} mesh {:?} step {}", r.same_as, r.mesh, r.breakdown.step_time_s);
    }
    let axes = r.mesh.axes.len();
    let split_on = |pat: &str, dim: &str| -> Vec<usize> {
        (0..axes)
            .filter(|&a| {
                let s = strategies_of(&m.graph, &r, &cluster, pat);
                !s.is_empty() && s.iter().all(|(_, x)| x[a].as_deref() == Some(dim))
            })
            .collect()
    };
    for l in 0..2 {
        let p = |x: &str| format!("h{l}/{x}");
        // MLP: fc1 column-parallel, fc2 row-parallel on the same axis.
        let col = split_on(&p("fc1"), "n");
        let row = split_on(&p("fc2"), "k");
        assert!(col.iter().any(|a| row.contains(a)), "layer {l}: fc1 {col:?} / fc2 {row:?}");
        // Attention: Q, K, V column-parallel (by heads), the scores per head, and the output
        // projection split on the same axis — row-parallel (Megatron: an all-reduce after
        // it), or column-parallel with the residual stream kept split along the hidden dim
        // (the layer norms all-reduce their statistics; the collectives around the block are
        // all-gathers and a reduce-scatter instead of all-reduces, as in Megatron's sequence
        // parallelism) — whichever the cost model prices lower.
        // Q, K and V by heads: column-parallel, or row-parallel on a residual stream kept
        // split along the hidden dim (their partial sums reduce-scattered into the heads: the
        // same traffic), whichever is priced lower.
        let qkv = |x: &str| -> Vec<usize> { split_on(&p(x), "n").into_iter().chain(split_on(&p(x), "k")).collect() };
        let (q, k, v) = (qkv("q_proj"), qkv("k_proj"), qkv("v_proj"));
        let heads = split_on(&p("scores"), "b1");
        let o: Vec<usize> = split_on(&p("out_proj"), "k").into_iter().chain(split_on(&p("out_proj"), "n")).collect();
        assert!(
            q.iter().any(|a| k.contains(a) && v.contains(a) && heads.contains(a) && o.contains(a)),
            "layer {l}: q {q:?} k {k:?} v {v:?} heads {heads:?} out {o:?}"
        );
    }
    let dp = r.data_parallel.as_ref().unwrap();
    assert!(r.breakdown.step_time_s <= dp.step_time_s);
}

#[test]
fn finding_c_resnet50_stays_within_two_percent_of_data_parallel() {
    let m = shared("tv_resnet50.onnxtxt", batch(256));
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let r = plan(&m.graph, &cluster, 8, &Options::default());
    let dp = r.data_parallel.as_ref().unwrap().step_time_s;
    let t = r.breakdown.step_time_s;
    assert!(t <= dp, "never worse than data parallel: {t} vs {dp}");
    assert!((dp - t) / dp <= 0.02, "{t} vs data parallel {dp}");
}

#[test]
fn finding_d_one_huge_3d_sample_is_split_spatially_and_fits() {
    use ir::shard::DimRole;
    let spec = passes::RebatchSpec {
        batch: None,
        input_shapes: vec![passes::rebatch::parse_input_shape("input=1x3x128x1024x1024").unwrap()],
        ..Default::default()
    };
    let m = shared("tv_r3d_18.onnxtxt", spec);
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let r = plan(&m.graph, &cluster, 8, &Options::default());
    assert!(r.data_parallel.is_none(), "one sample cannot be split by batch");
    assert!(r.data_parallel_unavailable.as_deref().unwrap().contains("the batch (1)"));
    assert!(r.breakdown.feasible, "{:?}", r.breakdown.infeasible_reason);
    let convs = roles_of(&m.graph, &r, &cluster, "Conv");
    let spatial = convs.iter().filter(|roles| roles.contains(&Some(DimRole::Spatial))).count();
    assert!(spatial * 2 > convs.len(), "{spatial} of {} convolutions split spatially", convs.len());
}

/// Shapes for a model's symbolic input dims: 8 for the leading (batch) dim, 64 for others.
fn concrete(m: &ir::Model) -> passes::RebatchSpec {
    let g = &m.graph;
    let mut spec = passes::RebatchSpec::default();
    for v in g.input_values() {
        if !matches!(g.node(v.node).op, ir::Op::Input { default: None }) {
            continue;
        }
        let Some(t) = g.tensor_type(v) else { continue };
        if t.is_static() {
            continue;
        }
        let Some(dims) = &t.dims else { continue };
        let s: Vec<String> = dims
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                ir::Dim::Fixed(x) => x.to_string(),
                _ if i == 0 => "8".into(),
                _ => "64".into(),
            })
            .collect();
        spec.input_shapes
            .push(passes::rebatch::parse_input_shape(&format!("{}={}", g.value_name(v), s.join("x"))).unwrap());
    }
    spec
}

#[test]
fn every_shared_model_plans_on_8_and_64_devices() {
    for path in data_files("models") {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let raw = load_model(&path);
        let spec = concrete(&raw);
        let m = prepare(raw, spec);
        for (cluster, devices) in [("dgx-a100", 8), ("a100-cluster-8", 64)] {
            let c = Cluster::preset(cluster).unwrap();
            let so = SearchOptions { time_limit: std::time::Duration::from_secs(30), ..Default::default() };
            let r = autoshard::search(&m.graph, &c, devices, &Options::default(), &so)
                .unwrap_or_else(|e| panic!("{name} on {devices}: {e}"));
            let (meshes, stage_of) = autoshard::plan::stage_meshes(&r);
            assert_eq!(meshes.iter().map(Mesh::devices).sum::<usize>(), devices, "{name}");
            assert!(r.breakdown.step_time_s.is_finite() && r.breakdown.step_time_s > 0.0, "{name}");
            if let Some(dp) = r.data_parallel.as_ref().filter(|d| d.feasible) {
                assert!(r.breakdown.feasible, "{name}: data parallel fits but the plan does not");
                assert!(r.breakdown.step_time_s <= dp.step_time_s * (1.0 + 1e-12), "{name}: worse than data parallel");
            }
            // Every op has a strategy that fits its iteration space on its stage's mesh.
            for (stage, mesh) in meshes.iter().enumerate() {
                let cm = CostModel::new(&m.graph, &c, mesh.clone(), Options::default());
                for &n in cm.order() {
                    if stage_of.get(&n).copied().unwrap_or(0) != stage {
                        continue;
                    }
                    let s = cm.strategy_of(&r.assignment, n);
                    assert!(
                        s.iter().all(Option::is_none) || strategy_valid(cm.space(n), &s, mesh, &m.graph, n),
                        "{name}: {}",
                        m.graph.describe(n)
                    );
                }
            }
        }
    }
}

#[test]
fn the_search_is_deterministic_and_the_plan_document_round_trips() {
    let m = shared("hf_gpt2_small4.onnxtxt", Default::default());
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    let info = autoshard::plan::ModelInfo { path: "gpt2".into(), ..Default::default() };
    let mut docs = Vec::new();
    for threads in [1, 2] {
        let so = SearchOptions { threads, ..Default::default() };
        let r = autoshard::search(&m.graph, &cluster, 8, &opts, &so).unwrap();
        let mut p = autoshard::Plan::new(&m.graph, &cluster, 8, &opts, info.clone(), &r);
        // Timings differ from run to run (and live only under `timings`); nothing else may.
        assert!(p.timings.search_s > 0.0);
        p.timings = Default::default();
        docs.push(serde_json::to_string_pretty(&p).unwrap());
    }
    if docs[0] != docs[1] {
        std::fs::write("/tmp/doc0.json", &docs[0]).unwrap();
        std::fs::write("/tmp/doc1.json", &docs[1]).unwrap();
        panic!("the plans differ");
    }
    let back = autoshard::Plan::from_json(&docs[0]).unwrap();
    let again = serde_json::to_string_pretty(&back).unwrap();
    if again != docs[0] {
        std::fs::write("/tmp/doc0.json", &docs[0]).unwrap();
        std::fs::write("/tmp/doc1.json", &again).unwrap();
        panic!("the plan does not round-trip");
    }
    // A flat plan's strategies, read back, re-price to its step time (a pipeline's step is
    // its stages' schedule, not one flat price).
    let so = SearchOptions { pipeline: PipelineMode::Off, ..Default::default() };
    let r = autoshard::search(&m.graph, &cluster, 8, &opts, &so).unwrap();
    let flat = autoshard::Plan::new(&m.graph, &cluster, 8, &opts, info.clone(), &r);
    let back = autoshard::Plan::from_json(&serde_json::to_string_pretty(&flat).unwrap()).unwrap();
    let asg = back.assignment(&m.graph).unwrap();
    let cm = CostModel::new(&m.graph, &cluster, back.mesh().unwrap(), opts.clone());
    assert!(close(cm.evaluate(&asg).step_time_s, back.step_time_s));
    // Bad documents are refused with a reason.
    assert!(autoshard::Plan::from_json("{}").unwrap_err().contains("format"));
    let v1 = docs[0].replacen("\"version\": 2", "\"version\": 1", 1);
    assert!(autoshard::Plan::from_json(&v1).unwrap_err().contains("version 1"));
}

#[test]
fn annotations_print_and_parse_back_to_the_same_plan() {
    let mut m = shared("tv_resnet18.onnxtxt", batch(16));
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let r = plan(&m.graph, &cluster, 8, &Options::default());
    autoshard::plan::annotate(&mut m, &r);
    let text = ir::print::model_to_string(&m);
    assert!(text.contains("shardc_strategy: string = "), "annotations are printed");
    let mut parsed = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "annotated", &text)));
    assert!(parsed.warnings.is_empty(), "annotations are not unknown attributes");
    ir::infer::infer_shapes(&mut parsed.model.graph, ir::infer::Mode::Check).unwrap();
    let back = autoshard::plan::read_annotations(&parsed.model).unwrap();
    let (mesh, asg) = (back.meshes[0].clone(), back.assignment);
    assert_eq!(mesh, r.mesh);
    let g = &parsed.model.graph;
    let order = g.op_nodes().unwrap();
    let orig = m.graph.op_nodes().unwrap();
    for (a, b) in order.iter().zip(&orig) {
        let x = asg.strategies.get(a).cloned().unwrap_or_default();
        let y = r.assignment.strategies.get(b).cloned().unwrap_or_else(|| vec![None; mesh.axes.len()]);
        assert_eq!(x, y, "{}", g.describe(*a));
    }
    // Printing again gives the same text.
    assert_eq!(ir::print::model_to_string(&parsed.model), text);
}

/// The plan document without its timings, for comparing runs.
fn plan_without_timings(m: &ir::Model, r: &SearchResult, cluster: &Cluster, devices: usize) -> String {
    let info = autoshard::plan::ModelInfo { path: "model".into(), ..Default::default() };
    let mut p = autoshard::Plan::new(&m.graph, cluster, devices, &Options::default(), info, r);
    p.timings = Default::default();
    serde_json::to_string_pretty(&p).unwrap()
}

#[test]
fn the_plan_depends_on_work_budgets_not_on_the_clock() {
    // GPT-2's search runs the dynamic program, local search and the pipeline search: every
    // budgeted phase.
    let m = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let search = |so: &SearchOptions| autoshard::search(&m.graph, &cluster, 8, &Options::default(), so).unwrap();
    let base = search(&SearchOptions::default());
    assert!(!base.time_limit_hit && base.budget_cut.is_empty(), "{:?}", base.budget_cut);
    let reference = plan_without_timings(&m, &base, &cluster, 8);
    // A machine 20× slower (the clock runs 20× faster) with a limit it stays within, and a
    // machine whose cores are busy: the same plan.
    let slow = search(&SearchOptions {
        clock_scale: 20.0,
        time_limit: std::time::Duration::from_secs(3600),
        ..Default::default()
    });
    assert!(!slow.time_limit_hit);
    assert_eq!(plan_without_timings(&m, &slow, &cluster, 8), reference, "a slower clock changed the plan");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let loaded = std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            });
        }
        let r = search(&SearchOptions::default());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    });
    assert_eq!(plan_without_timings(&m, &loaded, &cluster, 8), reference, "load changed the plan");
    // When the safety net fires it says so and names the budgets it cut; the plan is still
    // a valid plan (never worse than data parallel: the seeds are priced first).
    let cut = search(&SearchOptions { clock_scale: 1e9, ..Default::default() });
    assert!(cut.time_limit_hit);
    assert!(!cut.budget_cut.is_empty());
    let info = autoshard::plan::ModelInfo { path: "model".into(), ..Default::default() };
    let p = autoshard::Plan::new(&m.graph, &cluster, 8, &Options::default(), info, &cut);
    assert!(p.search.time_limit_hit && p.search.budget_cut == cut.budget_cut);
}

/// The plan in ML engineers' terms: a named strategy's degrees come out as such (data
/// parallelism as `data 8`, Megatron as `tensor 8`, data × Megatron as both), with samples
/// and tokens per second and a model FLOPs utilisation within (0, 1].
#[test]
fn plan_summaries_name_the_degrees_of_parallelism() {
    let m = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    for (strategy, want) in
        [("data", "data 8, pipeline 1"), ("megatron", "tensor 8"), ("hybrid:dp:2,tp:4", "data 2 × tensor 4")]
    {
        let r = shardc::exec::named_result(&m.graph, &cluster, 8, strategy, &opts).unwrap();
        let p = autoshard::Plan::new(&m.graph, &cluster, 8, &opts, Default::default(), &r);
        let s = &p.summary;
        assert!(s.text.starts_with(want), "{strategy}: `{}`, want `{want}…`", s.text);
        let tokens = s.tokens_per_s.expect("a sequence model has tokens per second");
        let samples = s.samples_per_s.expect("samples per second");
        assert!(
            (tokens / samples
                - m.graph.input_values().iter().find_map(|&v| m.graph.tensor_type(v)?.static_dims()).unwrap()[1]
                    as f64)
                .abs()
                < 1e-6
        );
        let mfu = s.mfu.expect("utilisation");
        assert!(mfu > 0.0 && mfu <= 1.0, "{strategy}: MFU {mfu}");
        let back: autoshard::Plan = autoshard::Plan::from_json(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back.summary, p.summary);
    }
}

/// `--explain`: Megatron against data parallelism on GPT-2 small4 names the transformer's
/// layers by the module paths the export left in its parameter names, folds the repeated
/// blocks (`h.*`), sorts by effect, and its layers and remainder add up to the step-time
/// difference. Data parallelism against itself differs nowhere.
#[test]
fn explanations_name_the_layers_that_differ_from_data_parallelism() {
    let m = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let g = &m.graph;
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    let tp = shardc::exec::named_result(g, &cluster, 8, "megatron", &opts).unwrap();
    let dp = shardc::exec::named_result(g, &cluster, 8, "data", &opts).unwrap().breakdown;
    let order = CostModel::new(g, &cluster, tp.mesh.clone(), opts.clone()).order().to_vec();
    let e = autoshard::explain::explain(g, &order, &tp.breakdown, &dp).unwrap();
    assert!(!e.layers.is_empty());
    let mlp = e.layers.iter().find(|l| l.layer.ends_with("h.*.mlp.c_fc")).expect("the MLP's first GEMM, folded");
    assert_eq!(mlp.repeats, 4, "{mlp:?}");
    assert!(mlp.strategies.iter().any(|s| s.starts_with("Gemm n→")), "{mlp:?}");
    for w in e.layers.windows(2) {
        assert!(w[0].time_saved_s.abs() >= w[1].time_saved_s.abs(), "not sorted: {:?}", e.layers);
    }
    let sum: f64 = e.layers.iter().map(|l| l.time_saved_s).sum::<f64>() + e.unattributed_s;
    assert!((sum - (dp.step_time_s - tp.breakdown.step_time_s)).abs() < 1e-12);
    let text = e.text(Some(3), &|s| format!("{s:.6}"), &|b| format!("{b:.0}"));
    assert!(text.contains("(×4)") && text.contains("more layers"), "{text}");
    let same = autoshard::explain::explain(g, &order, &dp, &dp).unwrap();
    assert!(same.layers.is_empty() && same.same_ops == order.len());
}

/// `--report` groups ops by block with a total row each; its columns line up whatever the
/// names' lengths.
#[test]
fn reports_group_ops_by_block_with_totals() {
    let m = shared("tv_resnet18.onnxtxt", batch(8));
    let g = &m.graph;
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    let r = shardc::exec::named_result(g, &cluster, 4, "spatial", &opts).unwrap();
    let dp = shardc::exec::named_result(g, &cluster, 4, "data", &opts).unwrap().breakdown;
    let order = CostModel::new(g, &cluster, r.mesh.clone(), opts.clone()).order().to_vec();
    let t = autoshard::plan::report(g, &order, &r.breakdown, Some(&dp));
    for block in ["layer1.0/", "layer4.1/", "fc/"] {
        assert!(t.lines().any(|l| l.starts_with(block)), "no `{block}` total row:\n{t}");
    }
    // Right-aligned numbers: every row ends in the same column.
    let widths: std::collections::BTreeSet<usize> = t.lines().map(|l| l.chars().count()).collect();
    assert_eq!(widths.len(), 1, "{t}");
    // A block's total is the sum of its rows (data parallelism's compute column).
    let lines: Vec<&str> = t.lines().collect();
    let at = lines.iter().position(|l| l.starts_with("layer1.0/")).unwrap();
    let col = |l: &str| l.split_whitespace().rev().nth(1).unwrap().parse::<f64>().unwrap();
    let rows: f64 = lines[at + 1..].iter().take_while(|l| l.starts_with("  ")).map(|l| col(l)).sum();
    assert!((rows - col(lines[at])).abs() < 0.2, "{rows} vs {}", lines[at]);
}

/// `plan --export`: a data × tensor plan of GPT-2 small4 becomes Megatron-LM arguments and a
/// DeepSpeed configuration, but no torch tensor-parallel plan (its Conv1D modules); a spatial
/// plan of ResNet-18 has no such settings and the error names its Convs.
#[test]
fn plans_export_to_megatron_deepspeed_and_torch_when_they_fit() {
    let m = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let g = &m.graph;
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    let r = shardc::exec::named_result(g, &cluster, 8, "hybrid:dp:2,tp:4", &opts).unwrap();
    let plan = autoshard::Plan::new(g, &cluster, 8, &opts, Default::default(), &r);
    let d = autoshard::export::degrees(g, &cluster, &opts, &plan).unwrap();
    assert_eq!((d.data, d.tensor, d.pipeline), (2, 4, 1), "{d:?}");
    let args = autoshard::export::megatron_args(&d, 8);
    for want in [
        "--tensor-model-parallel-size 4",
        "--pipeline-model-parallel-size 1",
        "--micro-batch-size 4",
        "--global-batch-size 8",
    ] {
        assert!(args.contains(want), "no `{want}` in {args}");
    }
    let ds: serde_json::Value = serde_json::from_str(&autoshard::export::deepspeed_config(&d, 8)).unwrap();
    assert_eq!(ds["train_batch_size"], 8);
    assert_eq!(ds["train_micro_batch_size_per_gpu"], 4);
    assert_eq!(ds["shardc"]["tensor_parallel_size"], 4);
    // GPT-2's GEMMs are transformers' Conv1D (weights stored [in, out]), which torch's
    // tensor-parallel styles do not shard: the export says so.
    let e = autoshard::export::torch_tp_plan(&d).unwrap_err();
    assert!(e.contains("h.0.mlp.c_fc") && e.contains("Conv1D"), "{e}");
    // Data parallelism alone: degrees, but no tensor plan.
    let r = shardc::exec::named_result(g, &cluster, 8, "data", &opts).unwrap();
    let plan = autoshard::Plan::new(g, &cluster, 8, &opts, Default::default(), &r);
    let d = autoshard::export::degrees(g, &cluster, &opts, &plan).unwrap();
    assert_eq!((d.data, d.tensor), (8, 1));
    assert!(autoshard::export::torch_tp_plan(&d).unwrap_err().contains("no tensor parallelism"));
    // Spatial parallelism has no framework setting: the error names the axis and its Convs.
    let m = shared("tv_resnet18.onnxtxt", batch(8));
    let r = shardc::exec::named_result(&m.graph, &cluster, 4, "spatial", &opts).unwrap();
    let plan = autoshard::Plan::new(&m.graph, &cluster, 4, &opts, Default::default(), &r);
    let e = autoshard::export::degrees(&m.graph, &cluster, &opts, &plan).unwrap_err();
    assert!(e.contains("spatial") && e.contains("(Conv)"), "{e}");
}

/// The torch tensor-parallel plan of Megatron's layout on a Llama exported by torch's dynamo
/// exporter: modules named from the nodes' metadata (the linear weights are anonymous folded
/// transposes), q/k/v and gate/up column-parallel from replicated inputs to head-split
/// outputs, o_proj and down_proj row-parallel back to replicated, the embedding by rows; with
/// sequence parallelism the norms are `SequenceParallel` and the GEMMs' boundaries are split
/// along the sequence. (scripts/torch-tp-launch.py runs these in torch: tests/launch.rs.)
#[test]
fn megatron_layouts_export_to_torch_with_their_boundaries() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/dynamo/llama_tiny.onnx");
    let m = prepare(load_model(&path), Default::default());
    let g = &m.graph;
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let plan_of = |strategy: &str, opts: &Options| {
        let r = shardc::exec::named_result(g, &cluster, 2, strategy, opts).unwrap();
        let plan = autoshard::Plan::new(g, &cluster, 2, opts, Default::default(), &r);
        let d = autoshard::export::degrees(g, &cluster, opts, &plan).unwrap();
        autoshard::export::torch_tp_plan(&d).unwrap_or_else(|e| panic!("{strategy}: {e}"))
    };
    let tp = plan_of("megatron", &Options::default());
    for (module, style) in [
        ("m.model.embed_tokens", "RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())"),
        ("m.model.layers.0.self_attn.q_proj", "ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))"),
        ("m.model.layers.1.self_attn.v_proj", "ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))"),
        ("m.model.layers.0.self_attn.o_proj", "RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())"),
        ("m.model.layers.1.mlp.up_proj", "ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1))"),
        ("m.model.layers.1.mlp.down_proj", "RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())"),
    ] {
        assert!(tp.contains(&format!("\"{module}\": {style},")), "no {module}: {style} in\n{tp}");
    }
    assert!(!tp.contains("SequenceParallel("), "{tp}");
    let sp = Options { sequence_parallel: true, ..Options::default() };
    let tp = plan_of("megatron", &sp);
    for (module, style) in [
        ("m.model.layers.0.input_layernorm", "SequenceParallel(sequence_dim=1)"),
        ("m.model.norm", "SequenceParallel(sequence_dim=1)"),
        ("m.model.layers.0.self_attn.q_proj", "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1))"),
        ("m.model.layers.0.mlp.down_proj", "RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1))"),
    ] {
        assert!(tp.contains(&format!("\"{module}\": {style},")), "no {module}: {style} in\n{tp}");
    }
}

/// `--export megatron` launches: the model's shape in Megatron-LM's own flags, read from the
/// graph (a dynamo-exported Llama with grouped-query attention, a TorchScript-era GPT-2 with
/// learned positions), every flag among the options Megatron-LM defines (a pinned list, with
/// its source); DeepSpeed gets the tensor degree in `tensor_parallel.autotp_size`.
#[test]
fn megatron_exports_the_model_shape_in_its_own_flags() {
    let pinned =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/megatron-options.txt"))
            .unwrap();
    let known: std::collections::HashSet<&str> = pinned.lines().filter(|l| l.starts_with("--")).collect();
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let export = |m: &ir::Model, strategy: &str, devices: usize, opts: &Options| {
        let r = shardc::exec::named_result(&m.graph, &cluster, devices, strategy, opts).unwrap();
        let plan = autoshard::Plan::new(&m.graph, &cluster, devices, opts, Default::default(), &r);
        autoshard::export::degrees(&m.graph, &cluster, opts, &plan).unwrap()
    };
    let half = Options { precision: passes::cost::Precision::Fp16, ..Options::default() };
    let llama = prepare(
        load_model(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/dynamo/llama_tiny.onnx")),
        Default::default(),
    );
    let d = export(&llama, "megatron", 2, &half);
    let args = autoshard::export::megatron_args(&d, 2);
    for want in [
        "--num-layers 2",
        "--hidden-size 64",
        "--num-attention-heads 4",
        "--group-query-attention --num-query-groups 2",
        "--ffn-hidden-size 128",
        "--seq-length 16",
        "--vocab-size 128",
        "--normalization RMSNorm",
        "--swiglu",
        "--position-embedding-type rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--bf16",
        "--tensor-model-parallel-size 2",
    ] {
        assert!(args.contains(want), "no `{want}` in {args}");
    }
    assert!(!args.contains("not read from the graph"), "{args}");
    let ds: serde_json::Value = serde_json::from_str(&autoshard::export::deepspeed_config(&d, 2)).unwrap();
    assert_eq!(ds["tensor_parallel"]["autotp_size"], 2, "{ds}");
    assert_eq!(ds["bf16"]["enabled"], true, "{ds}");
    assert!(!args.contains("--accumulate-allreduce-grads-in-fp32") && ds.get("data_types").is_none(), "{args}");
    // The fp32 gradient copy priced (`fp32_grads`) is asked of the frameworks.
    let d = export(&llama, "megatron", 2, &Options { fp32_grads: true, ..half.clone() });
    assert!(autoshard::export::megatron_args(&d, 2).contains("--accumulate-allreduce-grads-in-fp32"));
    let ds: serde_json::Value = serde_json::from_str(&autoshard::export::deepspeed_config(&d, 2)).unwrap();
    assert_eq!(ds["data_types"]["grad_accum_dtype"], "fp32", "{ds}");
    let gpt2 = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let d = export(&gpt2, "hybrid:dp:2,tp:4", 8, &Options::default());
    let gargs = autoshard::export::megatron_args(&d, 8);
    for want in [
        "--num-layers 4",
        "--hidden-size 256",
        "--ffn-hidden-size 1024",
        "--max-position-embeddings 1024",
        "--normalization LayerNorm",
        "--position-embedding-type learned_absolute",
    ] {
        assert!(gargs.contains(want), "no `{want}` in {gargs}");
    }
    assert!(!gargs.contains("--swiglu") && !gargs.contains("--untie"), "{gargs}");
    for text in [&args, &gargs] {
        // The argument lines (the comments name torchrun's own flags).
        let lines = text.lines().filter(|l| l.starts_with("  "));
        for flag in lines.flat_map(str::split_whitespace).filter(|w| w.starts_with("--")) {
            assert!(known.contains(flag), "{flag} is not a Megatron-LM option (tests/data/megatron-options.txt)");
        }
    }
}

/// A plan that parallelises regions of the model differently is summarised region by region:
/// ResNet-18 data-parallel except layer4's convolutions split by filters reads
/// `mixed: data 4 in conv1 … layer3.1; … tensor 4 in layer4.0 …`.
#[test]
fn mixed_plans_are_summarised_by_region() {
    let m = shared("tv_resnet18.onnxtxt", batch(8));
    let g = &m.graph;
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    let r = shardc::exec::named_result(g, &cluster, 4, "data", &opts).unwrap();
    let cm = CostModel::new(g, &cluster, r.mesh.clone(), opts.clone());
    let mut asg = r.assignment.clone();
    for &n in cm.order() {
        let node = g.node(n);
        if node.label.as_deref().is_some_and(|l| l.starts_with("/layer4/")) && node.op.op_type() == "Conv" {
            let filters = cm.space(n).dims.iter().position(|d| d.name == "m").unwrap();
            asg.strategies.insert(n, vec![Some(filters)]);
        }
    }
    let s = autoshard::plan::PlanSummary::new(&cm, &asg, &cluster, &opts, 4, 1e-3, None);
    assert!(s.text.starts_with("mixed: data 4 in conv1 … layer3.1; "), "{}", s.text);
    assert!(s.regions.iter().any(|r| r.first == "layer4.0" && r.degrees.starts_with("tensor 4")), "{:?}", s.regions);
    let share: f64 = s.regions.iter().map(|r| r.flops_share).sum();
    assert!((share - 1.0).abs() < 1e-9, "{share}");
    // Uniform plans keep the plain form.
    let s = autoshard::plan::PlanSummary::new(&cm, &r.assignment, &cluster, &opts, 4, 1e-3, None);
    assert_eq!(s.text, "data 4, pipeline 1");
    assert_eq!(s.regions.len(), 1, "{:?}", s.regions);
}

/// The report's graph colours: each op of a data × tensor plan reads in the summary's terms;
/// the element-wise ops between the tensor-parallel GEMMs take their axis's kind.
#[test]
fn op_kinds_read_in_the_summarys_terms() {
    let m = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let g = &m.graph;
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    let r = shardc::exec::named_result(g, &cluster, 8, "hybrid:dp:2,tp:4", &opts).unwrap();
    let plan = autoshard::Plan::new(g, &cluster, 8, &opts, Default::default(), &r);
    let cm = CostModel::new(g, &cluster, r.mesh.clone(), opts.clone());
    let kinds = autoshard::plan::op_kinds(&cm, &r.assignment, &plan.summary.axes);
    assert_eq!(kinds.len(), cm.order().len());
    for (k, &n) in kinds.iter().zip(cm.order()) {
        assert!(!k.contains("other"), "{}: {k}", g.op_name(n));
        if g.node(n).op.op_type() == "Gemm" {
            assert!(k.contains("tensor 4") && k.contains("data 2"), "{}: {k}", g.op_name(n));
        }
    }
}

/// Repeated-layer folding: a 10-layer GPT is searched as 3 layers; every interior layer gets
/// the same strategies; the plan is within 1% of the search over every layer (here GPT-2's
/// and BERT's real exports too, whose layers the exporters name `h.N` and `layer.N`).
#[test]
fn repeated_layers_fold_to_three_within_one_percent() {
    let text =
        shardc::synthetic::Gpt { layers: 10, hidden: 256, heads: 8, batch: 8, seq: 128, fused_gelu: false, vocab: 0 }
            .to_text();
    let synthetic = prepare(frontend::parse(&text).unwrap().model, Default::default());
    let gpt2 = shared("hf_gpt2_124m.onnxtxt", batch(8));
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let opts = Options::default();
    for (name, m, blocks) in [("synthetic", &synthetic, 10), ("gpt2", &gpt2, 10)] {
        let g = &m.graph;
        let run = |fold| {
            let so = SearchOptions { fold, pipeline: PipelineMode::Off, ..Default::default() };
            autoshard::search(g, &cluster, 8, &opts, &so).unwrap()
        };
        let all = run(autoshard::FoldMode::Never);
        let folded = run(autoshard::FoldMode::Always);
        assert!(all.folded.is_none());
        let said = folded.folded.as_deref().unwrap_or_else(|| panic!("{name}: nothing folded"));
        assert!(said.starts_with(&format!("{blocks} repeated blocks")), "{name}: {said}");
        let (a, f) = (all.breakdown.step_time_s, folded.breakdown.step_time_s);
        assert!(f <= a * 1.01, "{name}: folded {f} s vs {a} s searching every block");
        // Interior blocks share their strategies op for op.
        let order = g.op_nodes().unwrap();
        let fold = autoshard::fold::find(g, &order, autoshard::FOLD_MIN_BLOCKS).unwrap();
        assert_eq!(fold.len(), blocks);
        for b in &fold.ops[2..fold.len() - 1] {
            for (i, n) in b.iter().enumerate() {
                assert_eq!(
                    folded.assignment.strategies.get(n),
                    folded.assignment.strategies.get(&fold.ops[1][i]),
                    "{name}: {}",
                    g.describe(*n)
                );
            }
        }
        // The reduced graph keeps three blocks and computes the same output types.
        let reduced = autoshard::fold::reduce(g, &fold);
        assert_eq!(reduced.op_nodes().unwrap().len(), order.len() - (blocks - 3) * fold.ops[1].len());
        ir::verify(&reduced).unwrap();
    }
}

/// A search that ran past its limit says so, whichever phase overran it: `time_limit_hit`
/// and what was cut are never false and empty then (searches that ran past
/// `--time-limit 600` said neither).
#[test]
fn a_search_past_its_limit_says_so() {
    let m = shared("hf_gpt2_small4.onnxtxt", batch(8));
    let cluster = Cluster::preset("dgx-a100").unwrap();
    let mut g = m.graph.clone();
    let so = SearchOptions { time_limit: std::time::Duration::from_millis(1), rewrites: true, ..Default::default() };
    let r = autoshard::search_rewriting(&mut g, &cluster, 8, &Options::default(), &so).unwrap();
    assert!(r.search_time_s > 0.001, "{}", r.search_time_s);
    assert!(r.time_limit_hit && !r.budget_cut.is_empty(), "{} {:?}", r.time_limit_hit, r.budget_cut);
}
