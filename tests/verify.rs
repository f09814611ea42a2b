//! `codegen::verify` proves the lowered training programs of named strategies, and refutes
//! programs mutated the ways real frameworks have gone wrong, located at the op at fault.

use shardc::codegen::{Program, RefutationKind, verify};
use shardc::ir::eval::Array;
use shardc::ir::op::Op;
use shardc::ir::{Graph, NodeId, Value};
use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::passes::cost::{Cluster, Options};
use shardc::train::training_model;

/// A reduced synthetic GPT's training graph (MSE of its output, Adam).
fn gpt_training() -> shardc::ir::Graph {
    let gpt = shardc::synthetic::Gpt { layers: 2, hidden: 64, heads: 4, batch: 4, seq: 32, fused_gelu: true, vocab: 0 };
    training_graph(&gpt.to_text())
}

fn training_graph(text: &str) -> shardc::ir::Graph {
    training_graph_with(text, false)
}

/// With `fuse`, the attention as ONNX `Attention` ops (`passes::FuseAttention`).
fn training_graph_with(text: &str, fuse: bool) -> shardc::ir::Graph {
    let mut model = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default());
    if fuse {
        pm.add(shardc::passes::Canonicalize).add(shardc::passes::FuseAttention);
    }
    pm.run(&mut model).expect("shapes");
    let (tm, _) = training_model(&model, &LossSpec::Mse(None), &OptimizerSpec::adam(1e-3)).expect("training graph");
    tm.graph
}

fn program(g: &shardc::ir::Graph, strategy: &str, devices: usize, opts: &Options) -> Program {
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let r =
        shardc::exec::named_result(g, &cluster, devices, strategy, opts).unwrap_or_else(|e| panic!("{strategy}: {e}"));
    shardc::exec::training_program(g, &r, devices, opts.zero).unwrap_or_else(|e| panic!("{strategy}: {e}"))
}

/// The plans `memory_saving_programs_move_what_they_price` lowers: tensor, data, sequence
/// parallelism, ZeRO 1–3, recomputation.
const PLANS: [(&str, usize, bool, u8); 9] = [
    ("data", 4, false, 0),
    ("megatron", 2, false, 0),
    ("megatron", 4, false, 0),
    ("megatron", 4, true, 0),
    ("hybrid:dp:2,tp:2", 4, false, 0),
    ("hybrid:dp:2,tp:2", 4, true, 1),
    ("hybrid:dp:2,tp:2", 4, true, 2),
    ("hybrid:dp:2,tp:2", 4, true, 3),
    ("data", 4, false, 3),
];

fn plan_program(g: &shardc::ir::Graph, plan: (&str, usize, bool, u8)) -> (shardc::ir::Graph, Program) {
    let (strategy, devices, sp, zero) = plan;
    let mut g = g.clone();
    if zero >= 2 {
        shardc::passes::zero::early_gradients(&mut g).expect("reordered");
    }
    let opts = Options { sequence_parallel: sp, zero, ..Options::default() };
    let p = program(&g, strategy, devices, &opts);
    (g, p)
}

#[test]
fn named_strategies_of_a_gpt_and_a_llama_verify() {
    let llama = shardc::synthetic::Llama::reduced(2, 4, 32);
    for (name, g) in [("gpt", gpt_training()), ("llama", training_graph(&llama.to_text()))] {
        for recompute in [shardc::passes::cost::Recompute::None, shardc::passes::cost::Recompute::Full] {
            let mut g = g.clone();
            shardc::passes::recompute::recompute(&mut g, recompute).expect("recomputed");
            for plan in PLANS {
                let (g, p) = plan_program(&g, plan);
                match verify(&g, &p) {
                    Ok(proof) => eprintln!("{name} {plan:?} {}: {proof:?}", recompute.name()),
                    Err(e) => panic!("{name} {plan:?} {}: {e}", recompute.name()),
                }
            }
        }
    }
}

/// Fused attention (`Attention` ops and their `AttentionGrad`, grouped query heads in the
/// Llama): split by batch, by heads (tensor parallelism) and under sequence parallelism,
/// forward and backward.
#[test]
fn plans_with_fused_attention_verify() {
    let gpt = shardc::synthetic::Gpt { layers: 2, hidden: 64, heads: 4, batch: 4, seq: 32, fused_gelu: true, vocab: 0 };
    let llama = shardc::synthetic::Llama::reduced(2, 4, 32);
    for (name, text) in [("gpt", gpt.to_text()), ("llama", llama.to_text())] {
        let g = training_graph_with(&text, true);
        let count = |t: &str| g.op_nodes().unwrap().into_iter().filter(|&n| g.node(n).op.op_type() == t).count();
        let (fwd, bwd) = (count("Attention"), count("AttentionGrad"));
        assert!(fwd >= 2 && bwd >= 2, "{name}: {fwd} Attention and {bwd} AttentionGrad ops");
        for plan in PLANS {
            let (g, p) = plan_program(&g, plan);
            if let Err(e) = verify(&g, &p) {
                panic!("{name} {plan:?}: {e}");
            }
        }
    }
}

/// A seeded lowering bug: the program of `plan` mutated by `mutate` on every device (given
/// the device index and its graph).
fn seeded(plan: (&str, usize, bool, u8), mutate: impl Fn(usize, &mut Graph)) -> (Graph, Program) {
    seeded_on(gpt_training(), plan, mutate)
}

fn seeded_on(g: Graph, plan: (&str, usize, bool, u8), mutate: impl Fn(usize, &mut Graph)) -> (Graph, Program) {
    let (g, mut p) = plan_program(&g, plan);
    for d in &mut p.devices {
        mutate(d.device, &mut d.graph);
    }
    (g, p)
}

fn node_of(g: &Graph, name: &str) -> NodeId {
    g.lookup(name).unwrap_or_else(|| panic!("no value `{name}`")).node
}

/// Inserts `op` on value `name` (its readers and results read the new value, named `name`).
fn insert_after(g: &mut Graph, name: &str, op: Op, extra: &[Value]) {
    let v = g.lookup(name).expect("value");
    assert!(g.rename(v, format!("{name}__before")));
    let mut ins = vec![v];
    ins.extend_from_slice(extra);
    let new = g.add_simple(op, &ins, name);
    g.replace_all_uses(v, new);
    g.set_input(new.node, 0, Some(v));
}

/// Sets the literal `name` to `f(value)`.
fn set_literal(g: &mut Graph, name: &str, f: impl Fn(f64) -> f64) {
    let n = node_of(g, name);
    let Op::Initializer(t) = &g.node(n).op else { panic!("`{name}` is no literal") };
    let a = Array::from_tensor(t).expect("data");
    let vals: Vec<f64> = a.to_f64().expect("numbers").into_iter().map(f).collect();
    let b = if a.dtype.is_int() {
        Array::int(a.dtype, a.shape.clone(), vals.iter().map(|&x| x as i64).collect())
    } else {
        Array::float(a.dtype, a.shape.clone(), vals)
    };
    g.make_initializer(n, b.to_tensor());
}

fn scalar(g: &mut Graph, name: &str, x: f64) -> Value {
    let t = Array::float(shardc::ir::DType::Float, vec![], vec![x]).to_tensor();
    g.add_initializer(name, t)
}

/// The refutation of a seeded bug: the program is wrong, at an op of a device.
fn refuted(what: &str, (g, p): (Graph, Program), expect: &str) {
    shardc::codegen::check(&p).unwrap_or_else(|e| panic!("{what}: the checker already rejects it: {e:?}"));
    match verify(&g, &p) {
        Ok(proof) => panic!("{what}: verified a wrong program: {proof:?}"),
        Err(e) => {
            eprintln!("{what}: {e}");
            assert_eq!(e.kind, RefutationKind::Wrong, "{what}: {e}");
            assert!(e.device.is_some() && e.op.is_some(), "{what}: not located to an op: {e}");
            assert!(e.to_string().contains(expect), "{what}: {e}\nexpected it to name `{expect}`");
        }
    }
}

const DATA: (&str, usize, bool, u8) = ("data", 4, false, 0);
const GRAD_AR: &str = "h0_qm__d214__ar";

#[test]
fn a_missing_all_reduce_of_a_partial_sum_is_caught() {
    let p = seeded(DATA, |_, g| {
        let n = node_of(g, GRAD_AR);
        g.set_op(n, Op::Identity(Default::default()));
    });
    refuted("missing all-reduce", p, "AdamUpdate");
}

#[test]
fn a_gradient_scaled_by_the_data_parallel_share_twice_or_never_is_caught() {
    let twice = seeded(DATA, |_, g| {
        let c = scalar(g, "extra_share", 0.25);
        insert_after(g, GRAD_AR, Op::Mul(Default::default()), &[c]);
    });
    refuted("gradient scaled twice", twice, "Mul");
    let never = seeded(DATA, |_, g| set_literal(g, "loss__share", |_| 1.0));
    refuted("loss never scaled", never, "loss");
}

#[test]
fn a_gradient_synchronised_twice_is_caught() {
    let p = seeded(DATA, |_, g| {
        let op = g.node(node_of(g, GRAD_AR)).op.clone();
        insert_after(g, GRAD_AR, op, &[]);
    });
    refuted("all-reduced twice", p, "AllReduce");
}

#[test]
fn a_bias_added_on_every_tensor_parallel_device_is_caught() {
    let p = seeded(("megatron", 2, false, 0), |_, g| set_literal(g, "h0.bo__keep", |_| 1.0));
    refuted("bias on every device", p, "counted twice");
}

#[test]
fn an_update_on_the_wrong_shard_is_caught() {
    // ZeRO-3: device 1 cuts the gradient block of device 2 for its update.
    let p = seeded(("data", 4, false, 3), |d, g| {
        if d == 1 {
            set_literal(g, "h0.wq__grad__starts", |x| x + 16.0);
        }
    });
    refuted("update on the wrong shard", p, "AdamUpdate");
}

#[test]
fn a_zero_gather_of_the_wrong_parameter_is_caught() {
    let p = seeded(("data", 4, false, 3), |_, g| {
        let (n, wk) = (node_of(g, "h0.wq__ag"), g.lookup("h0.wk").expect("h0.wk"));
        g.set_input(n, 0, Some(wk));
    });
    refuted("gather of the wrong parameter", p, "h0.wk");
}

#[test]
fn a_reduce_scatter_on_the_wrong_axis_is_caught() {
    let p = seeded(("hybrid:dp:2,tp:2", 4, true, 2), |_, g| {
        let n = node_of(g, "h0_r1__rs");
        let Op::ReduceScatter(mut rs) = g.node(n).op.clone() else { panic!("not a reduce-scatter") };
        rs.axis = Some(2);
        g.set_op(n, Op::ReduceScatter(rs));
    });
    refuted("reduce-scatter on the wrong axis", p, "LayerNormalization");
}

/// Megatron's scale of attention scores computed from a tensor-parallel device's share of
/// the hidden size instead of the head dim.
#[test]
fn an_attention_scaled_by_the_split_hidden_size_is_caught() {
    let gpt = shardc::synthetic::Gpt { layers: 2, hidden: 64, heads: 4, batch: 4, seq: 32, fused_gelu: true, vocab: 0 };
    let g = training_graph_with(&gpt.to_text(), true);
    let p = seeded_on(g, ("megatron", 2, false, 0), |_, g| {
        for n in g.op_nodes().unwrap() {
            if let Op::Attention(a) = &g.node(n).op {
                let mut a = a.clone();
                a.scale = Some(1.0 / (32f32).sqrt());
                g.set_op(n, Op::Attention(a));
            }
        }
    });
    refuted("attention scale of the split hidden size", p, "Attention");
}

fn golden(name: &str) -> std::path::PathBuf {
    shardc_tests::repo_root().join("../shared/golden-train").join(format!("{name}.onnxtxt"))
}

/// A golden training case's training graph (its own loss, SGD).
fn golden_training(name: &str) -> Graph {
    let mut loaded = shardc::load_model(&golden(name)).expect("loads");
    let case = shardc::train::TrainCase::load(&golden(name).with_extension("train.json")).expect("case");
    shardc::train::freeze(&mut loaded.model.graph, &[], Some(&case.trainable)).expect("frozen");
    let opt = OptimizerSpec::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    training_model(&loaded.model, &LossSpec::Model, &opt).expect("training graph").0.graph
}

#[test]
fn a_halo_one_row_short_is_caught() {
    // Spatial split over four devices: device 1 takes one row fewer from device 2 and pads
    // its window instead, as if that row were past the image's border.
    let g = golden_training("cnn_small");
    let mut p = program(&g, "spatial", 4, &Options::default());
    verify(&g, &p).unwrap_or_else(|e| panic!("the unmutated program: {e}"));
    let halo = |g: &Graph| {
        g.op_nodes()
            .unwrap()
            .into_iter()
            .find(|&n| matches!(g.node(n).op, Op::HaloExchange(_)))
            .expect("a halo exchange")
    };
    for d in [1, 2] {
        let lg = &mut p.devices[d].graph;
        let n = halo(lg);
        let Op::HaloExchange(mut h) = lg.node(n).op.clone() else { unreachable!() };
        let mut w = h.widths.clone().expect("widths");
        w[if d == 1 { 1 } else { 2 }] -= 1;
        h.widths = Some(w);
        lg.set_op(n, Op::HaloExchange(h));
        if d == 1 {
            let x = Value::new(n, 0);
            let (conv, _) =
                lg.users(x).into_iter().find(|(u, _)| matches!(lg.node(*u).op, Op::Conv(_))).expect("its conv");
            let Op::Conv(mut c) = lg.node(conv).op.clone() else { unreachable!() };
            let mut pads = c.pads.clone().expect("pads");
            let k = pads.len() / 2;
            pads[k] += 1;
            c.pads = Some(pads);
            lg.set_op(conv, Op::Conv(c));
        }
        shardc::ir::infer::infer_shapes(lg, shardc::ir::infer::Mode::Reset).expect("shapes");
    }
    refuted("halo one row short", (g, p), "Conv");
}

fn shardc(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_shardc")).args(args).output().expect("runs")
}

#[test]
fn verify_proves_a_training_plan_and_train_verify_runs_it() {
    let m = golden("tiny_gpt_train");
    let (m, case) = (m.to_str().unwrap(), m.with_extension("train.json"));
    let case = case.to_str().unwrap();
    let o = shardc(&["verify", m, "--data", case, "--strategy", "megatron", "--devices", "2", "-q"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.starts_with("verified: ") && out.contains("on 2 devices"), "{out}{o:?}");
    let o = shardc(&[
        "train",
        m,
        "--data",
        case,
        "--strategy",
        "data",
        "--devices",
        "2",
        "--steps",
        "1",
        "--verify",
        "--backend",
        "cpu",
        "-q",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("verified: "), "{out}{o:?}");
}

/// A depthwise convolution split along its groups (each device runs its channels' filters
/// with its own `group`), after a slice that takes everything with masked bounds (as jax2tf
/// exports write it), split along the batch or the channels.
#[test]
fn grouped_convolutions_split_by_groups_and_masked_slices_verify() {
    let w: Vec<String> = (0..72).map(|i| format!("{}", (i % 7) as f32 * 0.25 - 0.5)).collect();
    let text = format!(
        "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[4,8,6,6] x) => (float[4,8,6,6] y)\n\
         <float[8,1,3,3] w = {{{}}}, int64[4] st = {{0,0,0,0}}, \
          int64[4] en = {{9223372036854775807,9223372036854775807,9223372036854775807,9223372036854775807}}>\n\
         {{ s = Slice (x, st, en)\n y = Conv <group: int = 8, pads: ints = [1, 1, 1, 1]> (s, w) }}",
        w.join(",")
    );
    let mut model = shardc::frontend::parse(&text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default());
    pm.run(&mut model).expect("shapes");
    let g = &model.graph;
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let conv = node_of(g, "y");
    let mut split_groups = false;
    for (strategy, groups) in [("data", false), ("tensor", true), ("hybrid:dp:2,tp:2", true)] {
        let devices = if strategy.starts_with("hybrid") { 4 } else { 2 };
        let mut r = shardc::exec::named_result(g, &cluster, devices, strategy, &Options::default()).expect(strategy);
        if groups {
            // The depthwise convolution's groups (iteration dim 1 of n, g, rows, columns) over
            // the last mesh axis, as a searched plan may split them.
            let axes = r.mesh.axes.len();
            let st = r.assignment.strategies.entry(conv).or_insert_with(|| vec![None; axes]);
            st[axes - 1] = Some(1);
        }
        let p = shardc::exec::program_for_search(g, &r, devices).expect(strategy);
        split_groups |= p.devices.iter().any(|d| {
            d.graph
                .op_nodes()
                .unwrap()
                .into_iter()
                .any(|n| matches!(&d.graph.node(n).op, Op::Conv(c) if c.group < Some(8)))
        });
        if let Err(e) = verify(g, &p) {
            panic!("{strategy}: {e}");
        }
    }
    assert!(split_groups, "no plan split the convolution's groups");
}

/// `run --verify` and `lower --verify` prove forward programs: a tensor-parallel run, and a
/// pipeline with micro-batches (proved against one micro-batch of the model).
#[test]
fn run_and_lower_verify_forward_programs() {
    let m = golden("tiny_gpt_train");
    let m = m.to_str().unwrap();
    let o = shardc(&["run", m, "--strategy", "megatron", "--devices", "2", "--verify", "--backend", "cpu", "-q"]);
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.contains("verified: ") && out.contains("compute the model's"), "{out}");
    let dir = std::env::temp_dir().join(format!("shardc-verify-lower-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("p.json");
    let plan = plan.to_str().unwrap();
    let o = shardc(&["plan", m, "--cluster", "dgx-a100", "--devices", "2", "--pipeline", "2", "-o", plan, "-q"]);
    assert!(o.status.success(), "{o:?}");
    let progs = dir.join("progs");
    let o = shardc(&["lower", plan, "--verify", "-o", progs.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success() && err.contains("verified: ") && err.contains("one micro-batch (of "), "{err}");
}

#[test]
fn a_pipeline_stage_receiving_the_wrong_activation_is_caught_in_programs_as_written() {
    // The programs `train --emit-program` writes, with two receives of one shape on the last
    // stage swapping their tags: each gets the other's tensor.
    let m = golden("tiny_gpt_train");
    let (m, case) = (m.to_str().unwrap(), m.with_extension("train.json"));
    let case = case.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("shardc-verify-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let common = ["--data", case, "--pipeline", "2", "--devices", "2", "-q"];
    let o = shardc(&[&["train", m, "--steps", "1", "--backend", "cpu", "--emit-program", d][..], &common[..]].concat());
    assert!(o.status.success(), "{o:?}");
    let ok = shardc(&[&["verify", m, "--program", d][..], &common[..]].concat());
    assert!(ok.status.success(), "the programs as written: {ok:?}");
    let path = dir.join("device1.onnxtxt");
    let text = std::fs::read_to_string(&path).unwrap();
    let recvs: Vec<(usize, String, String)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("shardc.Recv"))
        .filter_map(|(i, l)| {
            let shape = l.split("shape: ints = ").nth(1)?.split(']').next()?.to_string();
            let tag = l.split("tag: int = ").nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.to_string();
            Some((i, shape, tag))
        })
        .collect();
    let (a, b) = recvs
        .iter()
        .enumerate()
        .find_map(|(k, a)| recvs[k + 1..].iter().find(|b| b.1 == a.1 && b.2 != a.2).map(|b| (a.clone(), b.clone())))
        .expect("two receives of one shape");
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    lines[a.0] = lines[a.0].replace(&format!("tag: int = {}", a.2), &format!("tag: int = {}", b.2));
    lines[b.0] = lines[b.0].replace(&format!("tag: int = {}", b.2), &format!("tag: int = {}", a.2));
    std::fs::write(&path, lines.join("\n")).unwrap();
    let bad = shardc(&[&["verify", m, "--program", d][..], &common[..]].concat());
    let err = String::from_utf8_lossy(&bad.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(bad.status.code(), Some(1), "{err}");
    assert!(err.contains("not verified: device 1: "), "{err}");
}

/// A slice for sequence parallelism cut at the previous device's block: device 1 keeps the
/// first eighth of the sequence of a layer norm's gradient instead of the second.
#[test]
fn a_shard_offset_off_by_one_block_is_caught() {
    let p = seeded(("megatron", 4, true, 0), |d, g| {
        if d != 1 {
            return;
        }
        let n = g
            .op_nodes()
            .unwrap()
            .into_iter()
            .find(|&n| {
                let name = g.value_name(Value::new(n, 0));
                matches!(g.node(n).op, Op::Slice(_)) && name.starts_with("h0_ln2__d") && name.ends_with("__slice")
            })
            .expect("the slice of a layer norm's gradient");
        let starts = g.value_name(g.node(n).input(1).expect("starts")).to_string();
        let ends = g.value_name(g.node(n).input(2).expect("ends")).to_string();
        let block = 8.0;
        set_literal(g, &starts, |x| x - block);
        set_literal(g, &ends, |x| x - block);
    });
    refuted("shard offset off by one block", p, "Sum");
}

/// A tied weight (the embedding table read again, transposed, by the output layer): the
/// embedding's share of its gradient all-reduced on its own, then again with the output
/// layer's share.
#[test]
fn a_tied_weights_gradient_synchronised_twice_is_caught() {
    let g = golden_training("embedding_lm");
    let mut p = program(&g, "data", 2, &Options::default());
    verify(&g, &p).unwrap_or_else(|e| panic!("the unmutated program: {e}"));
    for d in &mut p.devices {
        let lg = &mut d.graph;
        let grad = lg.lookup("emb.weight__grad").expect("the tied weight's gradient");
        let ar = lg.node(grad.node).input(0).expect("its all-reduce");
        let Op::AllReduce(_) = lg.node(ar.node).op else { panic!("not an all-reduce") };
        let sum = lg.node(ar.node).input(0).expect("the sum of both uses' shares");
        assert_eq!(lg.node(sum.node).op.op_type(), "Sum");
        let emb_share = lg.node(sum.node).input(1).expect("the embedding's share");
        let op = lg.node(ar.node).op.clone();
        let name = lg.value_name(emb_share).to_string();
        insert_after(lg, &name, op, &[]);
    }
    refuted("tied weight synchronised twice", (g, p), "AllReduce");
}

/// Every golden training case under every named strategy that applies to it, on 2 and 4
/// devices: the lowered training program verifies (a strategy that does not apply says why).
#[test]
fn every_named_strategy_of_every_golden_training_case_verifies() {
    let dir = shardc_tests::repo_root().join("../shared/golden-train");
    let mut cases: Vec<String> = std::fs::read_dir(&dir)
        .expect("golden-train")
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".train.json").map(String::from))
        .collect();
    cases.sort();
    assert!(cases.len() >= 8, "{cases:?}");
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let strategies = ["data", "model", "megatron", "owt", "spatial", "hybrid:dp:2,tp:2", "spatial-hybrid:2x2"];
    let mut proved = 0;
    for case in &cases {
        let g = golden_training(case);
        for s in strategies {
            for devices in [2, 4].into_iter().filter(|&n| n == 4 || !s.contains(':')) {
                let Ok(r) = shardc::exec::named_result(&g, &cluster, devices, s, &Options::default()) else { continue };
                let p = shardc::exec::training_program(&g, &r, devices, 0)
                    .unwrap_or_else(|e| panic!("{case} {s} on {devices}: {e}"));
                verify(&g, &p).unwrap_or_else(|e| panic!("{case} {s} on {devices}: {e}"));
                proved += 1;
            }
        }
    }
    assert!(proved >= 50, "only {proved} plans applied");
}

/// A batch normalization with running statistics (inference mode) whose scale and bias
/// train, as ONNX-zoo exports freeze them: split along the batch, its scale's and bias's
/// gradients are partial sums the program all-reduces.
#[test]
fn an_inference_mode_batch_normalization_trained_on_a_split_batch_verifies() {
    let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[4,3,4,4] x) => (float[4,3,4,4] y)\n\
         <float[3] s = {1.0, 0.5, 2.0}, float[3] b = {0.1, 0.2, 0.3}, float[3] m = {0.0, 0.1, -0.1}, \
          float[3] v = {1.0, 2.0, 0.5}>\n\
         { y = BatchNormalization <epsilon: float = 0.00001> (x, s, b, m, v) }";
    let g = training_graph(text);
    let grads = g.op_nodes().unwrap().into_iter().filter(|&n| g.node(n).op.op_type() == "BatchNormGrad").count();
    assert_eq!(grads, 1, "one BatchNormGrad");
    for devices in [2, 4] {
        let p = program(&g, "data", devices, &Options::default());
        verify(&g, &p).unwrap_or_else(|e| panic!("data on {devices}: {e}"));
    }
}
/// A data-parallel device's cross-entropy gradient as the mean over its own rows instead of
/// the sum over them divided by the whole batch's count (every device's gradient times the
/// data-parallel degree): with and without ignored labels.
#[test]
fn a_loss_averaged_over_a_devices_rows_only_is_caught() {
    let local_mean = |_: usize, g: &mut Graph| {
        let n = node_of(g, "loss__d1__sum");
        let Op::SoftmaxCrossEntropyLossGrad(mut l) = g.node(n).op.clone() else { panic!("not the loss gradient") };
        l.reduction = Some("mean".into());
        g.set_op(n, Op::SoftmaxCrossEntropyLossGrad(l));
        let div = node_of(g, "loss__d1");
        g.set_op(div, Op::Identity(Default::default()));
        g.set_inputs(div, vec![Some(Value::new(n, 0))]);
    };
    let g = golden_training("mlp_xent");
    let (g, p) = seeded_on(g, ("data", 2, false, 0), local_mean);
    refuted("local mean over labels not ignored", (g, p), "a mean over the labels not ignored, on part of them");
    let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[4,8] x, int64[4] labels) => (float loss)\n\
         <float[8,5] w = {0.1,-0.2,0.3,0.0,0.5,-0.1,0.2,0.4,0.3,-0.3,0.1,0.2,0.0,0.1,-0.4,0.2,0.5,0.1,-0.2,0.3, \
          0.1,0.0,0.2,-0.1,0.4,0.3,-0.2,0.1,0.2,0.0,0.1,0.1,-0.3,0.2,0.4,0.0,0.2,-0.1,0.1,0.3}>\n\
         { s = MatMul (x, w)\n loss = SoftmaxCrossEntropyLoss <reduction: string = \"mean\"> (s, labels) }";
    let mut model = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default());
    pm.run(&mut model).expect("shapes");
    let g = training_model(&model, &LossSpec::Model, &OptimizerSpec::adam(1e-3)).expect("training graph").0.graph;
    let p = program(&g, "data", 2, &Options::default());
    verify(&g, &p).unwrap_or_else(|e| panic!("the unmutated program: {e}"));
    let (g, p) = seeded_on(g, ("data", 2, false, 0), local_mean);
    refuted("local mean over all labels", (g, p), "SoftmaxCrossEntropyLossGrad");
}

/// A transposed convolution and an instance normalization (PyTorch's `GroupNorm` and
/// `InstanceNorm2d` export as it) on parts: split by images (data) and by channels
/// (megatron: the transposed convolution's output channels, the normalization's channels with
/// their scale and bias), the training programs verify; an instance normalization with another
/// epsilon on the devices is caught.
#[test]
fn transposed_convolutions_and_instance_norms_on_parts_verify() {
    let w: Vec<String> = (0..144).map(|i| format!("{:.2}", f64::from(i % 7 - 3) * 0.25)).collect();
    let text = format!(
        "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[4,4,3,3] x) => (float[4,4,5,5] y)\n\
         <float[4,4,3,3] w = {{{}}}, float[4] b = {{0.1, 0.2, 0.3, 0.4}}, float[4] s = {{1.0, 0.5, 2.0, 1.5}}, \
          float[4] t = {{0.0, 0.1, -0.1, 0.2}}>\n\
         {{ d = ConvTranspose (x, w, b)\n  y = InstanceNormalization <epsilon: float = 0.00001> (d, s, t) }}",
        w.join(", ")
    );
    let g = training_graph(&text);
    for (strategy, devices) in [("data", 2), ("data", 4), ("megatron", 2), ("megatron", 4)] {
        let p = program(&g, strategy, devices, &Options::default());
        verify(&g, &p).unwrap_or_else(|e| panic!("{strategy} on {devices}: {e}"));
    }
    let epsilon = |_: usize, d: &mut Graph| {
        let n = node_of(d, "y");
        let Op::InstanceNormalization(mut i) = d.node(n).op.clone() else { panic!("not the normalization") };
        i.epsilon = Some(1e-3);
        d.set_op(n, Op::InstanceNormalization(i));
    };
    refuted("an instance normalization with another epsilon", seeded_on(g, DATA, epsilon), "InstanceNormalization");
}

/// A recurrent layer's weights, input and states as text: `W [1, gates·H, I]`, `R [1,
/// gates·H, H]`, `B [1, 2·gates·H]`.
fn recurrent_text(op: &str, gates: usize, layout: i64) -> String {
    let (h, i) = (2usize, 3usize);
    let vals = |n: usize| (0..n).map(|k| format!("{:.2}", ((k % 5) as f64 - 2.0) * 0.2)).collect::<Vec<_>>().join(", ");
    // The batch first in the graph's input, as a language model's tokens are; with the
    // sequence first in the layer (layout 0), transposed to it.
    let y = if layout == 0 { "float[5,1,4,2] y" } else { "float[4,5,1,2] y" };
    let xt = if layout == 0 { "xt = Transpose <perm: ints = [1, 0, 2]> (x)\n  " } else { "" };
    let input = if layout == 0 { "xt" } else { "x" };
    format!(
        "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[4,5,3] x) => ({y})\n\
         <float[1,{gh},{i}] w = {{{}}}, float[1,{gh},{h}] r = {{{}}}, float[1,{bh}] b = {{{}}}>\n\
         {{ {xt}y = {op} <hidden_size: int = {h}, layout: int = {layout}> ({input}, w, r, b) }}",
        vals(gates * h * i),
        vals(gates * h * h),
        vals(2 * gates * h),
        gh = gates * h,
        bh = 2 * gates * h,
    )
}

/// Recurrent layers split by sequences (data parallel): an LSTM with the batch in dim 1 and
/// a GRU with it in dim 0 verify on 2 and 4 devices, each device's layer run on its own
/// sequences; an LSTM the devices run in the reverse direction is caught.
#[test]
fn recurrent_layers_split_by_sequences_verify() {
    for (op, gates, layout) in [("LSTM", 4, 0), ("GRU", 3, 1)] {
        let g = training_graph(&recurrent_text(op, gates, layout));
        for devices in [2, 4] {
            let p = program(&g, "data", devices, &Options::default());
            verify(&g, &p).unwrap_or_else(|e| panic!("{op} data on {devices}: {e}"));
        }
    }
    let g = training_graph(&recurrent_text("LSTM", 4, 0));
    let reversed = |_: usize, d: &mut Graph| {
        let n = node_of(d, "y");
        let Op::LSTM(mut l) = d.node(n).op.clone() else { panic!("not the LSTM") };
        l.direction = Some("reverse".into());
        d.set_op(n, Op::LSTM(l));
    };
    refuted("an LSTM run backwards on the devices", seeded_on(g, DATA, reversed), "LSTM");
}
