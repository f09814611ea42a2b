//! Rule tests for the e-graph, and the decomposed objective against the cost model.

use std::sync::Arc;
use std::time::Duration;

use egg::Id;
use ir::shard::{LinkLevel, Mesh, parse_sharding};

use super::extract::{Proxy, dp, lower_bound, next_combination};
use super::problem::Problem;
use super::space::{Limits, ShardNode, grow_with};
use crate::cost::{Cluster, CostModel, Options};

fn graph(text: &str) -> ir::Graph {
    let mut m = frontend::parse(text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "t", text))).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    m.graph
}

const MATMUL: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
mm (float[8,16] x) => (float[8,32] y)
   <float[16,32] w = ["location": "w.bin", "offset": "0", "length": "2048"]>
{
   y = MatMul (x, w)
}"#;

const CONV: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
conv (float[2,4,16,16] x) => (float[2,8,16,16] y)
   <float[8,4,3,3] w = ["location": "w.bin", "offset": "0", "length": "1152"]>
{
   y = Conv <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (x, w)
}"#;

const CHAIN: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
chain (float[8,16] x) => (float[8,16] z)
   <float[16,64] w1 = ["location": "w.bin", "offset": "0", "length": "4096"], float[64,16] w2 = ["location": "w.bin", "offset": "0", "length": "4096"]>
{
   h = MatMul (x, w1)
   r = Relu (h)
   z = MatMul (r, w2)
}"#;

const RESIDUAL: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
residual (float[8,16] x) => (float[8,16] z)
   <float[16,16] w1 = ["location": "w.bin", "offset": "0", "length": "1024"], float[16,16] w2 = ["location": "w.bin", "offset": "0", "length": "1024"], float[16,16] w3 = ["location": "w.bin", "offset": "0", "length": "1024"]>
{
   h = MatMul (x, w1)
   a = Relu (h)
   b = MatMul (a, w2)
   c = Add (b, h)
   d = MatMul (c, w3)
   z = Add (d, c)
}"#;

fn limits() -> Limits {
    Limits { nodes: 100_000, time: Duration::from_secs(10), iterations: 10, per_op: 1000 }
}

struct Fixture {
    g: ir::Graph,
    cluster: Cluster,
    mesh: Mesh,
}

impl Fixture {
    fn new(text: &str, devices: usize) -> Fixture {
        Fixture {
            g: graph(text),
            cluster: Cluster::preset("dgx-a100").unwrap(),
            mesh: Mesh::line(devices, LinkLevel::Intra),
        }
    }

    fn cm(&self) -> CostModel<'_> {
        CostModel::new(&self.g, &self.cluster, self.mesh.clone(), Options::default())
    }
}

/// The class of (tensor named `name`, layout `layout`), if the e-graph has it.
fn class_of(
    eg: &egg::EGraph<ShardNode, super::space::Tables>,
    p: &Problem,
    g: &ir::Graph,
    name: &str,
    layout: &str,
) -> Option<Id> {
    let v = p.value_ids[&g.lookup(name).unwrap()];
    let l = *p.layout_ids.get(&parse_sharding(layout).unwrap())?;
    eg.classes().find(|c| c.data == (v, l)).map(|c| c.id)
}

/// The strategies (as dim names) of the `compute` nodes in a class.
fn computes(
    eg: &egg::EGraph<ShardNode, super::space::Tables>,
    p: &Problem,
    cm: &CostModel<'_>,
    class: Id,
) -> Vec<(Vec<Option<String>>, Vec<Id>)> {
    eg[class]
        .nodes
        .iter()
        .filter_map(|n| match n {
            ShardNode::Compute { op, strategy, children, .. } => {
                let info = &p.ops[*op as usize];
                let sp = cm.space(info.node);
                let s = &info.strategies[*strategy as usize];
                Some((
                    s.iter().map(|d| d.map(|i| sp.dims[i].name.clone())).collect(),
                    children.iter().map(|c| eg.find(*c)).collect(),
                ))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn split_in_features_makes_partial_sums_from_split_operands() {
    let f = Fixture::new(MATMUL, 4);
    let cm = f.cm();
    let p = Arc::new(Problem::new(&cm));
    let runner = grow_with(p.clone(), &[vec![0]], &limits(), &["split-in-features"]);
    let eg = &runner.egraph;
    let y = class_of(eg, &p, &f.g, "y", "[P]").expect("a class for y as partial sums");
    let x = class_of(eg, &p, &f.g, "x", "[S(1)]").expect("x split along its columns");
    let w = class_of(eg, &p, &f.g, "w", "[S(0)]").expect("w split along its rows");
    let got = computes(eg, &p, &cm, y);
    assert_eq!(got, vec![(vec![Some("k".to_string())], vec![eg.find(x), eg.find(w)])]);
    // Only that rule ran: no batch split.
    assert!(class_of(eg, &p, &f.g, "y", "[S(0)]").is_none());
}

#[test]
fn split_batch_and_out_features_and_unsplit() {
    let f = Fixture::new(MATMUL, 4);
    let cm = f.cm();
    let p = Arc::new(Problem::new(&cm));
    let runner = grow_with(p.clone(), &[vec![0]], &limits(), &["split-batch", "split-out-features"]);
    let eg = &runner.egraph;
    let rows = class_of(eg, &p, &f.g, "y", "[S(0)]").expect("batch split");
    assert_eq!(computes(eg, &p, &cm, rows)[0].0, vec![Some("m".to_string())]);
    let x_rows = class_of(eg, &p, &f.g, "x", "[S(0)]").unwrap();
    let w_whole = class_of(eg, &p, &f.g, "w", "[R]").unwrap();
    assert_eq!(computes(eg, &p, &cm, rows)[0].1, vec![eg.find(x_rows), eg.find(w_whole)]);
    let cols = class_of(eg, &p, &f.g, "y", "[S(1)]").expect("column split");
    assert_eq!(computes(eg, &p, &cm, cols)[0].0, vec![Some("n".to_string())]);
    // From a batch-split seed, `unsplit` brings back the replicated strategy.
    let m = p.ops[0].index[&vec![Some(0)]];
    let runner = grow_with(p.clone(), &[vec![m]], &limits(), &["unsplit"]);
    let eg = &runner.egraph;
    let whole = class_of(eg, &p, &f.g, "y", "[R]").expect("unsplit");
    assert_eq!(computes(eg, &p, &cm, whole)[0].0, vec![None]);
}

#[test]
fn split_spatial_splits_a_convolution_with_halo() {
    let f = Fixture::new(CONV, 4);
    let cm = f.cm();
    let p = Arc::new(Problem::new(&cm));
    let runner = grow_with(p.clone(), &[vec![0]], &limits(), &["split-spatial"]);
    let eg = &runner.egraph;
    let y = class_of(eg, &p, &f.g, "y", "[S(2)]").expect("split along H");
    let (s, children) = computes(eg, &p, &cm, y).remove(0);
    assert_eq!(s, vec![Some("s0".to_string())]);
    let x = class_of(eg, &p, &f.g, "x", "[S(2)]").unwrap();
    assert_eq!(children[0], eg.find(x));
    // The split costs a halo exchange.
    let n = p.ops[0].node;
    let i = cm.space(n).dims.iter().position(|d| d.name == "s0").unwrap();
    assert!(cm.op_time(n, &[Some(i)]).halo > 0.0);
}

#[test]
fn reshard_connects_every_layout_to_what_the_producer_makes() {
    let f = Fixture::new(CHAIN, 4);
    let cm = f.cm();
    let p = Arc::new(Problem::new(&cm));
    let runner = grow_with(p.clone(), &[vec![0; 3]], &limits(), super::space::RULES);
    let eg = &runner.egraph;
    let h = p.value_ids[&f.g.lookup("h").unwrap()];
    let layouts: Vec<u32> = eg.classes().filter(|c| c.data.0 == h).map(|c| c.data.1.0).collect();
    assert!(layouts.len() >= 3, "h has several layouts: {layouts:?}");
    let produced: Vec<u32> = eg
        .classes()
        .filter(|c| c.data.0 == h && c.nodes.iter().any(|n| matches!(n, ShardNode::Compute { .. })))
        .map(|c| c.data.1.0)
        .collect();
    for c in eg.classes().filter(|c| c.data.0 == h) {
        let from: Vec<u32> = c
            .nodes
            .iter()
            .filter_map(|n| match n {
                ShardNode::Reshard { child, .. } => Some(eg[child[0]].data.1.0),
                _ => None,
            })
            .collect();
        for &l in &produced {
            if l != c.data.1.0 {
                assert!(from.contains(&l), "layout {} of h has no reshard from {l}", c.data.1.0);
            }
        }
    }
    assert!(matches!(runner.stop_reason, Some(egg::StopReason::Saturated)));
}

#[test]
fn hitting_the_node_limit_is_reported_and_the_plan_is_still_valid() {
    let f = Fixture::new(CHAIN, 8);
    let so = super::SearchOptions { node_limit: 40, ..Default::default() };
    let r = super::search(&f.g, &f.cluster, 8, &Options::default(), &so).unwrap();
    assert!(r.meshes.iter().any(|m| m.egraph.stop_reason == "node limit"), "{:?}", r.meshes[0].egraph);
    let dp = r.data_parallel.as_ref().unwrap();
    assert!(r.breakdown.step_time_s <= dp.step_time_s);
}

#[test]
fn the_proxy_prices_a_chain_like_the_cost_model() {
    // No overlap, no preload, no latencies: the cost model's step time is a sum the proxy
    // reproduces exactly for every assignment (up to a constant: the update launches).
    let mut f = Fixture::new(CHAIN, 4);
    f.cluster.intra.latency = 0.0;
    f.cluster.host.latency = 0.0;
    f.cluster.device.launch_overhead = 0.0;
    let opts = Options { overlap_grad_sync: false, preload: false, ..Options::default() };
    let cm = CostModel::new(&f.g, &f.cluster, f.mesh.clone(), opts);
    let p = Problem::new(&cm);
    let cands: Vec<Vec<u32>> = p.ops.iter().map(|o| (0..o.strategies.len() as u32).collect()).collect();
    let proxy = Proxy::new(&cm, &p, &cands, 1.0);
    let mut n = 0;
    let mut choice = vec![0u32; 3];
    for a in 0..cands[0].len() as u32 {
        for b in 0..cands[1].len() as u32 {
            for c in 0..cands[2].len() as u32 {
                choice.copy_from_slice(&[a, b, c]);
                let truth = cm.price(&p.assignment(&choice)).step_time_s;
                let est = proxy.cost_of(&choice, 0.0);
                assert!((truth - est).abs() <= 1e-9 * truth, "{choice:?}: {est} vs {truth}");
                n += 1;
            }
        }
    }
    assert!(n > 20);
    // And the dynamic program finds the cheapest.
    let best = dp(&proxy, 0.0, 1 << 20, None).unwrap();
    let best_cost = proxy.cost_of(&best.choice, 0.0);
    for a in 0..cands[0].len() as u32 {
        for b in 0..cands[1].len() as u32 {
            for c in 0..cands[2].len() as u32 {
                assert!(proxy.cost_of(&[a, b, c], 0.0) >= best_cost - 1e-15);
            }
        }
    }
}

/// The relaxed dynamic program bounds the objective from below: with room for every state it
/// equals the optimum found by brute force, and with any beam it stays at or below it, while
/// the beam-pruned dynamic program stays at or above it. Tensors live across several ops
/// (a residual) so that pruning forgets real layouts.
#[test]
fn the_relaxation_bounds_the_optimum_from_below() {
    let f = Fixture::new(RESIDUAL, 4);
    let cm = CostModel::new(&f.g, &f.cluster, f.mesh.clone(), Options::default());
    let p = Problem::new(&cm);
    let cands: Vec<Vec<u32>> = p.ops.iter().map(|o| (0..o.strategies.len() as u32).collect()).collect();
    let total: usize = cands.iter().map(Vec::len).product();
    assert!(total > 100 && total < 2_000_000, "{total} combinations");
    for lambda in [0.0, 1e-9] {
        let proxy = Proxy::new(&cm, &p, &cands, 1.0);
        // Brute force.
        let mut idx = vec![0usize; cands.len()];
        let mut best = f64::INFINITY;
        loop {
            let choice: Vec<u32> = idx.iter().zip(&cands).map(|(&i, c)| c[i]).collect();
            best = best.min(proxy.cost_of(&choice, lambda));
            if !next_combination(&mut idx, &cands) {
                break;
            }
        }
        let exact = lower_bound(&proxy, lambda, 1 << 20, None).unwrap();
        assert!((exact - best).abs() <= 1e-9 * best, "λ={lambda}: unpruned bound {exact} vs optimum {best}");
        let mut pruned_somewhere = false;
        for beam in [1, 2, 3, 8] {
            let lb = lower_bound(&proxy, lambda, beam, None).unwrap();
            let plan = dp(&proxy, lambda, beam, None).unwrap();
            let ub = proxy.cost_of(&plan.choice, lambda);
            assert!(lb <= best * (1.0 + 1e-12), "λ={lambda} beam {beam}: bound {lb} above the optimum {best}");
            assert!(ub >= best * (1.0 - 1e-12), "λ={lambda} beam {beam}: plan {ub} below the optimum {best}");
            assert!(lb > 0.0, "λ={lambda} beam {beam}: a vacuous bound");
            pruned_somewhere |= plan.pruned;
        }
        assert!(pruned_somewhere, "no beam pruned");
    }
}

const POINTWISE: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
pw (float[4,64,32,32] x) => (float[4,64,32,32] y)
   <float[64,64,1,1] w1 = ["location": "w.bin", "offset": "0", "length": "16384"], float[64] b1 = ["location": "w.bin", "offset": "16384", "length": "256"],
    float[64,64,1,1] w2 = ["location": "w.bin", "offset": "16640", "length": "16384"]>
{
   h = Conv (x, w1, b1)
   r = Relu (h)
   y = Conv (r, w2)
}"#;

/// `search_rewriting` searches the graph with and without each rewrite of
/// `algebra::SEARCH_CHOICES` (and, where the two plans price one of the two convolutions
/// cheaper rewritten, the graph rewritten there only), keeps the fastest, and its plan is a
/// plan of the graph it leaves: priced again on that graph it costs what the search said. Off,
/// it is the plain search. On 2 local-wgpu devices a convolution as a GEMM is faster (the
/// runtime's GEMM outruns its convolution kernels).
#[test]
fn the_search_keeps_the_rewrite_whose_plan_is_faster() {
    for (cluster, devices) in [("dgx-a100", 8), ("local-wgpu", 2)] {
        let cluster = Cluster::preset(cluster).unwrap();
        let so = super::SearchOptions { pipeline: super::PipelineMode::Off, ..Default::default() };
        let mut g = graph(POINTWISE);
        let r = super::search_rewriting(&mut g, &cluster, devices, &Options::default(), &so).unwrap();
        let [c] = &r.rewrites[..] else { panic!("{:?}", r.rewrites) };
        assert_eq!((c.rule.as_str(), c.sites), ("conv-as-matmul", 2));
        let with = c.with_step_time_s.unwrap();
        // The fastest of: without, everywhere, and (when searched) at the places priced cheaper.
        let some = c.cheaper_at_step_time_s.unwrap_or(f64::INFINITY);
        let best = c.without_step_time_s.min(with).min(some);
        assert_eq!(r.breakdown.step_time_s, best, "{c:?}");
        assert_eq!(c.applied, best < c.without_step_time_s, "{c:?}");
        assert_eq!(c.applied_at_cheaper, best == some, "{c:?}");
        let ops: Vec<&str> = g.op_nodes().unwrap().iter().map(|&n| g.node(n).op.op_type()).collect();
        assert_eq!(ops.contains(&"MatMul"), c.applied, "{ops:?}");
        assert_eq!(ops.contains(&"Conv"), !c.applied || c.applied_at_cheaper, "{ops:?}");
        if let Some(at) = &c.cheaper_at {
            assert!(at.len() == 1, "{c:?}");
        }
        let again = CostModel::new(&g, &cluster, r.mesh.clone(), Options::default()).evaluate(&r.assignment);
        assert!((again.step_time_s - r.breakdown.step_time_s).abs() <= 1e-12 * again.step_time_s);

        let mut plain = graph(POINTWISE);
        let off = super::SearchOptions { rewrites: false, ..so };
        let local = cluster.name == "local-wgpu";
        assert!(!local || c.applied, "{c:?}");
        let r = super::search_rewriting(&mut plain, &cluster, devices, &Options::default(), &off).unwrap();
        assert!(r.rewrites.is_empty());
        assert_eq!(r.breakdown.step_time_s, c.without_step_time_s);
        assert_eq!(ir::print::graph_to_string(&plain), ir::print::graph_to_string(&graph(POINTWISE)));
    }
}

const ELEMENTWISE: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
ew (float[8,64] x) => (float[8,64] z)
   <float[64,64] w = ["location": "w.bin", "offset": "0", "length": "16384"]>
{
   a = Relu (x)
   b = Sigmoid (a)
   c = Tanh (b)
   z = MatMul (c, w)
}"#;

/// A chain move carries the split one op takes to the ops that share its tensors and can
/// take it too, no worse for each, and its change in the objective is the proxy's.
#[test]
fn chain_moves_carry_a_split_along_the_tensors() {
    let f = Fixture::new(ELEMENTWISE, 4);
    let cm = f.cm();
    let p = Problem::new(&cm);
    let cands: Vec<Vec<u32>> = p.ops.iter().map(|o| (0..o.strategies.len() as u32).collect()).collect();
    let proxy = Proxy::new(&cm, &p, &cands, 1.0);
    let name = |t: usize, a: usize| {
        let info = &p.ops[t];
        cm.describe_strategy(info.node, &info.strategies[cands[t][a] as usize])
    };
    let find = |t: usize, s: &str| (0..cands[t].len()).find(|&a| name(t, a) == s).unwrap_or_else(|| panic!("{s}"));
    // Data parallel: every op split by rows.
    let data: Vec<usize> = (0..3).map(|t| find(t, "d0→gpus")).chain([find(3, "m→gpus")]).collect();
    let cost = |c: &[usize]| {
        let choice: Vec<u32> = c.iter().enumerate().map(|(t, &a)| cands[t][a]).collect();
        proxy.cost_of(&choice, 0.0)
    };
    // Relu's columns split: Sigmoid and Tanh take it (elementwise, no worse), and the MatMul
    // reads columns as its reduction or keeps its rows, whichever is cheaper for it.
    let (c, changed) = proxy.chain(&p, 0, find(0, "d1→gpus"), &data, 0.0, 96);
    assert!(changed.len() >= 3, "{changed:?}");
    assert_eq!((name(1, c[1]), name(2, c[2])), ("d1→gpus".to_string(), "d1→gpus".to_string()));
    let d = proxy.delta(&changed, &c, &data, 0.0);
    assert!((d - (cost(&c) - cost(&data))).abs() <= 1e-12 * cost(&data), "{d}");
    // Giving a split up is not pushed on: Relu replicated changes Relu alone.
    let (c, changed) = proxy.chain(&p, 0, find(0, "replicated"), &data, 0.0, 96);
    assert_eq!(changed, vec![0]);
    assert_eq!(&c[1..], &data[1..]);
    // At most `spread` ops change.
    let (_, changed) = proxy.chain(&p, 0, find(0, "d1→gpus"), &data, 0.0, 2);
    assert_eq!(changed.len(), 2);
}

// A graph whose batch runs into a parameter takes no micro-batches: a requested pipeline
// runs one whole batch at a time, and says why.
#[test]
fn a_pipeline_the_batch_cannot_be_cut_for_says_why() {
    let g = graph(
        r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
b (float[4,8] x) => (float[4,8] y)
   <float[4,8] w = ["location": "w.bin", "offset": "0", "length": "128"], float[8,8] v = ["location": "w.bin", "offset": "0", "length": "256"]>
{
   h = MatMul (x, v)
   y = Add (h, w)
}"#,
    );
    let cluster = Cluster::preset("local-wgpu").unwrap();
    let so = super::SearchOptions { pipeline: super::PipelineMode::Stages(2), ..Default::default() };
    let r = super::search(&g, &cluster, 2, &Options::default(), &so).expect("a whole-batch pipeline");
    let p = r.pipeline.as_ref().expect("pipelined as requested");
    assert_eq!(p.micro_batches, 1);
    let why = super::plan::pipeline_reason(&r, p);
    assert!(why.contains("one whole batch at a time") && why.contains("`w`"), "{why}");
}

const STAGES: &str = r#"<
   ir_version: 8,
   opset_import: ["" : 17]
>
stages (float[8,16] x) => (float[8,16] z, float[8,16] h)
   <float[16,16] w1 = ["location": "w.bin", "offset": "0", "length": "1024"], float[16,16] w2 = ["location": "w.bin", "offset": "1024", "length": "1024"], int64[2] shp = {8, 16}>
{
   h = MatMul (x, w1)
   a = Relu (h)
   b = Reshape (a, shp)
   c = Add (b, h)
   z = MatMul (c, w2)
}"#;

/// A pipeline stage searched on its own: the ops of one stage as a graph whose inputs are
/// what it reads from the other stages (by their names), whose outputs are what the others
/// (or the model) read of it, with only its own parameters; it computes what the stage
/// computes in the whole graph.
#[test]
fn a_stage_is_a_graph_of_its_own() {
    let g = graph(STAGES);
    let order = g.op_nodes().unwrap();
    let names = |g: &ir::Graph, vs: Vec<ir::Value>| {
        let mut v: Vec<String> = vs.into_iter().map(|v| g.value_name(v).to_string()).collect();
        v.sort();
        v
    };
    let inits = |g: &ir::Graph| names(g, g.initializers().iter().map(|&i| ir::Value::new(i, 0)).collect());
    let (first, second) =
        (super::pipeline::stage_graph(&g, &order, &order[..2]), super::pipeline::stage_graph(&g, &order, &order[2..]));
    assert_eq!(names(&first, first.input_values()), ["x"]);
    assert_eq!(names(&first, first.outputs().iter().map(|o| o.value).collect()), ["a", "h"]);
    assert_eq!(inits(&first), ["w1"]);
    assert_eq!(first.op_count(), 2);
    assert_eq!(names(&second, second.input_values()), ["a", "h"]);
    assert_eq!(names(&second, second.outputs().iter().map(|o| o.value).collect()), ["z"]);
    assert_eq!(inits(&second), ["shp", "w2"]);
    assert_eq!(second.op_count(), 3);
    ir::verify(&second).unwrap();
    // The two stages one after the other compute the model's output.
    let opts = ir::eval::RunOptions { seed: Some(5) };
    let x: std::collections::HashMap<String, ir::eval::Array> =
        [("x".to_string(), ir::eval::random_tensor(ir::DType::Float, &[8, 16], "weight", 3, "x").unwrap())].into();
    let by_name = |g: &ir::Graph, xs: Vec<ir::eval::Array>| -> std::collections::HashMap<String, ir::eval::Array> {
        g.outputs().iter().map(|o| g.value_name(o.value).to_string()).zip(xs).collect()
    };
    let want = by_name(&g, ir::eval::run(&g, &x, &opts).unwrap());
    let mid = by_name(&first, ir::eval::run(&first, &x, &opts).unwrap());
    let got = by_name(&second, ir::eval::run(&second, &mid, &opts).unwrap());
    assert_eq!(got["z"], want["z"]);
}
