//! Mixtures of experts as transformers exports them (tests/data/moe: Mixtral from a small
//! config, 8 experts, top-2, exported by torch's dynamo and TorchScript exporters;
//! scripts/gen-moe.py): fused into `MoE` ops, equal to torch forward, and trained under
//! expert parallelism (`--strategy expert`) equal to one device, the plan pricing the bytes
//! its program moves.

mod common;

use std::path::{Path, PathBuf};

use shardc::ir::{Graph, Op};
use shardc::passes::cost::{Cluster, Options};

const EXPORTS: [&str; 2] = ["mixtral_tiny_dynamo", "mixtral_tiny_ts"];

fn data(name: &str, ext: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/moe/{name}.{ext}"))
}

fn shardc(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_shardc")).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

/// Trains `model` (softmax cross-entropy of its logits) for `steps` steps under `strategy` on
/// `devices` devices of `backend` with `--check`, asserts every check passed, and returns the
/// report.
fn train_checked(model: &Path, strategy: &str, devices: &str, backend: &str, steps: &str) -> String {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(["train", model.to_str().unwrap(), "--loss", "softmax-cross-entropy", "--devices", devices])
        .args(["--strategy", strategy, "--steps", steps, "--backend", backend, "--check"])
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .output()
        .unwrap();
    let out = text(&o.stdout);
    let label = format!("{} {strategy} ×{devices} on {backend}", model.display());
    assert!(o.status.success(), "{label}: {}{out}", text(&o.stderr));
    for what in ["losses", "gradients", "parameters", "state"] {
        assert!(
            out.lines().any(|l| l.starts_with("check") && l.contains(what) && l.contains(" ok ")),
            "{label}: {what} not checked ok\n{out}"
        );
    }
    out
}

/// The export `name` as `plan` prepares it: verified, shapes inferred, canonicalized, the
/// algebra pass (which fuses the experts) run.
fn prepared(name: &str) -> shardc::ir::Model {
    let bytes = std::fs::read(data(name, "onnx")).unwrap();
    let mut m = shardc::frontend::parse_binary(&bytes).map_err(|e| format!("{:?}", e.0)).unwrap().0.model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify)
        .add(shardc::passes::InferShapes::default())
        .add(shardc::passes::Canonicalize)
        .add(shardc::passes::Algebra);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{name}: {e}"));
    m
}

/// Model text after `infer-shapes,canonicalize,algebra`, and the warnings the passes gave.
fn algebra_of(text: &str) -> (shardc::ir::Model, Vec<String>) {
    let mut m = shardc::frontend::parse(text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::InferShapes::default()).add(shardc::passes::Canonicalize).add(shardc::passes::Algebra);
    let report = pm.run(&mut m).unwrap_or_else(|e| panic!("{e}"));
    (m, report.warnings.iter().map(|w| w.msg.clone()).collect())
}

fn count(g: &Graph, pick: impl Fn(&Op) -> bool) -> usize {
    g.op_nodes().unwrap().into_iter().filter(|&n| pick(&g.node(n).op)).count()
}

/// Both exports' two mixtures become two `MoE` ops; no expert weight is gathered per token
/// any more (the exports gathered `[T·k, 2I, H]` and `[T·k, H, I]` per layer).
#[test]
fn exported_mixtures_fuse_into_moe_ops() {
    for name in EXPORTS {
        let m = prepared(name);
        let g = &m.graph;
        assert_eq!(count(g, |o| matches!(o, Op::MoE(_))), 2, "{name}");
        let gathers_3d = g
            .op_nodes()
            .unwrap()
            .into_iter()
            .filter(|&n| matches!(g.node(n).op, Op::Gather(_) | Op::GatherND(_)))
            .filter(|&n| g.tensor_type(g.node(n).input(0).unwrap()).and_then(|t| t.rank()) == Some(3))
            .count();
        assert_eq!(gathers_3d, 0, "{name}: expert weights still gathered");
    }
}

/// A graph whose weighted sum is not a gated mixture keeps its ops: the pass fuses only what
/// it proves is the pattern (here the down projection's gather reads other ids than the gate's),
/// and warns where expert weights are still gathered per routed token.
#[test]
fn a_mixture_routed_by_other_ids_is_left_alone() {
    let src = include_str!("filetests/lower/moe_expert_2.onnxtxt");
    // The unfused form of that mixture, with the second gather reading a shifted copy of the ids.
    let unfused = src.replace("y = shardc.MoE (x, ids, w, w1, w2)", UNFUSED_BODY);
    let (fused, _) = algebra_of(&unfused);
    assert_eq!(count(&fused.graph, |o| matches!(o, Op::MoE(_))), 1, "the faithful copy fuses");
    let shifted = unfused.replace("g2 = Gather <axis: int = 0> (w2, flat)", "g2 = Gather <axis: int = 0> (w2, other)");
    let (left, said) = algebra_of(&shifted);
    assert_eq!(count(&left.graph, |o| matches!(o, Op::MoE(_))), 0, "routed by other ids: not a mixture");
    // And it says so, at the gather of the gate-and-up weights.
    assert!(said.iter().any(|w| w.contains("g1") && w.contains("was not fused into one MoE op")), "{said:?}");
}

/// transformers' `batched_mm` experts written out (what both exporters trace), for the tokens
/// `x [4, 8]`, ids and weights `[4, 2]`, `w1 [4, 6, 8]`, `w2 [4, 8, 3]`.
const UNFUSED_BODY: &str = "one = Constant <value: tensor = int64[1] {1}> ()
   minus = Constant <value: tensor = int64[1] {-1}> ()
   rows = Constant <value: tensor = int64[2] {8, 8}> ()
   tkh = Constant <value: tensor = int64[3] {4, 2, 8}> ()
   reps = Constant <value: tensor = int64[3] {1, 2, 1}> ()
   last = Constant <value: tensor = int64[1] {-1}> ()
   xu = Unsqueeze (x, one)
   xt = Tile (xu, reps)
   xr = Reshape (xt, rows)
   flat = Reshape (ids, minus)
   other = Sub (flat, one)
   g1 = Gather <axis: int = 0> (w1, flat)
   xc = Unsqueeze (xr, last)
   h3 = MatMul (g1, xc)
   h = Squeeze (h3, last)
   gate, up = Split <axis: int = 1, num_outputs: int = 2> (h)
   sg = Sigmoid (gate)
   silu = Mul (gate, sg)
   a = Mul (silu, up)
   g2 = Gather <axis: int = 0> (w2, flat)
   ac = Unsqueeze (a, last)
   o3 = MatMul (g2, ac)
   o = Squeeze (o3, last)
   wf = Reshape (w, minus)
   wc = Unsqueeze (wf, last)
   pw = Mul (o, wc)
   z = Reshape (pw, tkh)
   y = ReduceSum <keepdims: int = 0> (z, one)";

/// Forward on one device and under expert parallelism on 8 equals torch's logits.
#[test]
fn exported_mixtures_run_like_torch() {
    let dir = std::env::temp_dir().join(format!("shardc-moe-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in EXPORTS {
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(data(name, "io.json")).unwrap()).unwrap();
        let ins = dir.join(format!("{name}.in.json"));
        std::fs::write(&ins, serde_json::json!({"inputs": doc["inputs"]}).to_string()).unwrap();
        let want: Vec<f64> =
            doc["outputs"]["logits"]["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        for (devices, strategy) in [("1", "data"), ("8", "expert")] {
            let out = dir.join(format!("{name}.{devices}.out.json"));
            let o = shardc(&[
                "run",
                data(name, "onnx").to_str().unwrap(),
                "--inputs",
                ins.to_str().unwrap(),
                "--backend",
                "cpu",
                "--devices",
                devices,
                "--strategy",
                strategy,
                "--check",
                "--save-outputs",
                out.to_str().unwrap(),
            ]);
            assert!(o.status.success(), "{name} {strategy}: {}", text(&o.stderr));
            let got: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
            let got = got.get("outputs").unwrap_or(&got)["logits"].clone();
            let got: Vec<f64> =
                got.get("data").unwrap_or(&got).as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            assert_eq!(got.len(), want.len(), "{name}");
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / (1e-4 + 1e-4 * b.abs())).fold(0.0, f64::max);
            assert!(worst <= 1.0, "{name} {strategy}: {worst:.2}× torch's tolerance");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Five training steps under expert parallelism on 8 devices equal one device's (the check's
/// reference is the model as written, experts unfused), with each device holding an eighth of
/// the experts: less memory than data parallelism's replicas.
#[test]
fn expert_parallel_training_equals_one_device() {
    for name in EXPORTS {
        let model = data(name, "onnx");
        let mut peak = Vec::new();
        for strategy in ["data", "expert"] {
            let out = train_checked(&model, strategy, "8", "cpu", "5");
            let mem = out.lines().find(|l| l.starts_with("memory")).unwrap_or_default().to_string();
            let mb: f64 = mem.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(f64::NAN);
            peak.push(mb);
        }
        assert!(peak[1] < 0.5 * peak[0], "{name}: expert {} MB against data {} MB", peak[1], peak[0]);
    }
}

/// One truth for the expert plan's collectives: the plan prices, per kind, the bytes its
/// lowered forward program moves (the tokens, ids and weights all-gathered, the partial
/// outputs reduced).
#[test]
fn expert_plans_move_the_bytes_their_programs_move() {
    let m = prepared("mixtral_tiny_dynamo");
    let (g, cluster, opts) = (&m.graph, Cluster::preset("local-wgpu").expect("preset"), Options::default());
    for devices in [2, 4, 8] {
        let r = shardc::exec::named_result(g, &cluster, devices, "expert", &opts).unwrap();
        let plan = shardc::passes::autoshard::Plan::new(g, &cluster, devices, &opts, Default::default(), &r);
        let p = shardc::exec::program_for_search(g, &r, devices).unwrap();
        common::assert_forward_bytes_as_lowered(&plan, &p, "all_gather", &format!("expert ×{devices}"));
    }
}

/// The same for the all-to-all dispatcher: the plan prices the all-to-alls its programs run —
/// the forward program's four per mixture, and every phase of the training program (the
/// gradient's six) — at buffers of the capacity the mode states.
#[test]
fn all_to_all_dispatch_moves_the_bytes_its_programs_move() {
    let (cluster, opts) = (Cluster::preset("local-wgpu").expect("preset"), Options::default());
    for factor in [0.0, 2.0] {
        let mut m = prepared("mixtral_tiny_dynamo");
        assert_eq!(shardc::ir::ops::experts::set_capacity(&mut m.graph, factor), Ok(2));
        let g = &m.graph;
        for devices in [2, 4, 8] {
            let label = format!("a2a capacity {factor} ×{devices}");
            let r = shardc::exec::named_result(g, &cluster, devices, "expert", &opts).unwrap();
            let plan = shardc::passes::autoshard::Plan::new(g, &cluster, devices, &opts, Default::default(), &r);
            let p = shardc::exec::program_for_search(g, &r, devices).unwrap();
            let ops = |name: &str| {
                p.devices[0].graph.node_ids().filter(|&n| p.devices[0].graph.node(n).op.op_type() == name).count()
            };
            assert_eq!((ops("MoERoute"), ops("AllToAll")), (2, 8), "{label}");
            common::assert_forward_bytes_as_lowered(&plan, &p, "all_to_all", &label);
        }
        let mut tm = m.clone();
        let (t, _) = shardc::train::training_model(
            &tm,
            &shardc::passes::autodiff::LossSpec::SoftmaxCrossEntropy(None),
            &shardc::passes::autodiff::OptimizerSpec::adam(1e-3),
        )
        .expect("training graph");
        tm = t;
        let r = shardc::exec::named_result(&tm.graph, &cluster, 8, "expert", &opts).unwrap();
        let plan = shardc::passes::autoshard::Plan::new(&tm.graph, &cluster, 8, &opts, Default::default(), &r);
        let p = shardc::exec::training_program(&tm.graph, &r, 8, 0).unwrap();
        let (priced, lowered) = (&plan.bytes_moved_per_device, p.bytes_moved_per_device());
        for phase in ["forward", "backward"] {
            let a = priced.get(phase).and_then(|k| k.get("all_to_all")).copied().unwrap_or(0.0);
            let b = lowered.get(phase).and_then(|k| k.get("all_to_all")).copied().unwrap_or(0.0);
            assert!(
                a > 0.0 && (a - b).abs() <= 1e-9 * a.max(b),
                "training {phase} all_to_all: plan {a} B, program {b} B"
            );
        }
    }
}

/// `expert` needs mixtures whose experts the devices divide, and a batch they divide, and says so.
#[test]
fn expert_parallelism_says_where_it_does_not_apply() {
    let cluster = Cluster::preset("dgx-a100").expect("preset");
    let opts = Options::default();
    let m = prepared("mixtral_tiny_dynamo");
    let e = shardc::exec::named_result(&m.graph, &cluster, 3, "expert", &opts).map(|_| ()).unwrap_err();
    assert!(e.contains("batch (8) does not divide"), "{e}");
    // Four experts, eight tokens, eight devices.
    let src = include_str!("filetests/lower/moe_expert_2.onnxtxt")
        .replace("float[4,8] x", "float[8,8] x")
        .replace("float[4,8] y", "float[8,8] y");
    let mut four = shardc::frontend::parse(&src).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default());
    pm.run(&mut four).unwrap_or_else(|e| panic!("{e}"));
    let e = shardc::exec::named_result(&four.graph, &cluster, 8, "expert", &opts).map(|_| ()).unwrap_err();
    assert!(e.contains("has 4 experts, which 8 devices do not divide"), "{e}");
    shardc::exec::named_result(&four.graph, &cluster, 4, "expert", &opts).expect("4 devices");
    let dense = {
        let mut m = shardc::frontend::parse(&shardc::synthetic::Llama::reduced(2, 8, 8).to_text()).unwrap().model;
        let mut pm = shardc::passes::PassManager::new();
        pm.add(shardc::passes::Verify).add(shardc::passes::InferShapes::default());
        pm.run(&mut m).unwrap();
        m.graph
    };
    let e = shardc::exec::named_result(&dense, &cluster, 8, "expert", &opts).map(|_| ()).unwrap_err();
    assert!(e.contains("no mixture of experts"), "{e}");
}

/// The training graph of export `name` (softmax cross-entropy of its logits, Adam).
fn training(name: &str) -> Graph {
    let m = prepared(name);
    let (tm, _) = shardc::train::training_model(
        &m,
        &shardc::passes::autodiff::LossSpec::SoftmaxCrossEntropy(None),
        &shardc::passes::autodiff::OptimizerSpec::adam(1e-3),
    )
    .expect("training graph");
    tm.graph
}

fn training_program(g: &Graph, strategy: &str, devices: usize) -> shardc::codegen::Program {
    let cluster = Cluster::preset("local-wgpu").expect("preset");
    let r = shardc::exec::named_result(g, &cluster, devices, strategy, &Options::default()).unwrap();
    shardc::exec::training_program(g, &r, devices, 0).unwrap()
}

/// The prover covers expert parallelism: the expert plans' training programs verify, and one
/// whose devices read their experts' ids shifted by the wrong first expert is refuted at the
/// mixture of the first device that reads them so.
#[test]
fn expert_plans_verify_and_a_wrong_expert_offset_is_refuted() {
    for name in EXPORTS {
        let g = training(name);
        for (strategy, devices) in
            [("expert", 8), ("expert:ep:4", 8), ("expert:ep:2:tp:2", 8), ("expert", 2), ("data", 4)]
        {
            let p = training_program(&g, strategy, devices);
            shardc::codegen::verify(&g, &p).unwrap_or_else(|e| panic!("{name} {strategy} ×{devices}: {e}"));
        }
    }
    let g = training("mixtral_tiny_dynamo");
    let mut p = training_program(&g, "expert", 8);
    let mut seeded = 0;
    for d in &mut p.devices {
        let firsts: Vec<shardc::ir::Value> = d
            .graph
            .node_ids()
            .filter(|&n| matches!(d.graph.node(n).op, Op::Initializer(_)))
            .map(|n| shardc::ir::Value::new(n, 0))
            .filter(|&v| d.graph.value_name(v).ends_with("__first_expert"))
            .collect();
        for v in firsts {
            let Op::Initializer(t) = &d.graph.node(v.node).op else { unreachable!() };
            let first = shardc::ir::eval::Array::from_tensor(t).unwrap().to_i64().unwrap()[0];
            let wrong = shardc::ir::eval::Array::i64(vec![], vec![(first + 1) % 8]);
            d.graph.make_initializer(v.node, wrong.to_tensor());
            seeded += 1;
        }
    }
    assert!(seeded >= 8, "{seeded} offsets");
    let e = shardc::codegen::verify(&g, &p).expect_err("a wrong offset verified");
    assert_eq!(e.kind, shardc::codegen::RefutationKind::Wrong, "{e}");
    assert!(e.to_string().contains("reads ids that are not the graph's shifted"), "{e}");
}

/// The prover covers the all-to-all dispatcher: its training programs (`ep=8` over all the
/// devices, dropless; `ep=4` beside a data axis, at a capacity) verify, and seeded bugs are
/// refuted — one device routing for another split of the experts, every all-to-all's group
/// in reverse order, one device's combine reading its pairs' own rows unsent.
#[test]
fn dispatched_plans_verify_and_seeded_bugs_are_refuted() {
    let dispatched = |factor: f32, devices: usize, strategy: &str| {
        let mut g = training("mixtral_tiny_dynamo");
        shardc::ir::ops::experts::set_capacity(&mut g, factor).unwrap();
        let p = training_program(&g, strategy, devices);
        (g, p)
    };
    for (factor, strategy) in [(0.0, "expert"), (2.0, "expert:ep:4")] {
        let (g, p) = dispatched(factor, 8, strategy);
        let routes =
            p.devices[0].graph.node_ids().filter(|&n| matches!(p.devices[0].graph.node(n).op, Op::MoERoute(_)));
        assert_eq!(routes.count(), 4, "{strategy}: two mixtures, each routed forward and backward");
        shardc::codegen::verify(&g, &p).unwrap_or_else(|e| panic!("{strategy} capacity {factor}: {e}"));
    }
    type Seed = fn(&mut shardc::codegen::Program);
    let seeds: [(&str, &str, Seed); 3] = [
        ("a device routing for another split of the experts", "member 3 routed 2 experts a device", |p| {
            let g = &mut p.devices[3].graph;
            let n = g.node_ids().find(|&n| matches!(g.node(n).op, Op::MoERoute(_))).unwrap();
            let Op::MoERoute(r) = g.node(n).op.clone() else { unreachable!() };
            g.set_op(n, Op::MoERoute(shardc::ir::op::MoERoute { experts: Some(2), parts: Some(4), ..r }));
        }),
        ("all-to-alls in reverse group order", "of the dispatcher runs experts", |p| {
            for d in &mut p.devices {
                let g = &mut d.graph;
                for n in g.node_ids().collect::<Vec<_>>() {
                    if let Op::AllToAll(a) = g.node(n).op.clone() {
                        let group = a.group.clone().map(|v| v.into_iter().rev().collect());
                        g.set_op(n, Op::AllToAll(shardc::ir::op::AllToAll { group, ..a }));
                    }
                }
            }
        }),
        ("a combine of rows never sent", "not the dispatcher's experts' outputs: not a stack", |p| {
            let g = &mut p.devices[5].graph;
            let n = g.node_ids().find(|&n| matches!(g.node(n).op, Op::MoECombine(_))).unwrap();
            let back = g.node(n).input(0).unwrap();
            let sent = g.node(back.node).input(0).unwrap();
            g.set_input(n, 0, Some(sent));
        }),
    ];
    for (what, says, seed) in seeds {
        let (g, mut p) = dispatched(0.0, 8, "expert");
        seed(&mut p);
        let e = shardc::codegen::verify(&g, &p).expect_err(what);
        assert_eq!(e.kind, shardc::codegen::RefutationKind::Wrong, "{what}: {e}");
        assert!(e.to_string().contains(says), "{what}: {e}");
    }
}

/// Mixtral-8×7B (the synthetic generator's, as transformers exports its experts) on 64 H100s
/// at 64 sequences of 4,096 tokens in bf16: the experts fuse, and the search plans expert
/// parallelism (the grid's `ep` points), faster than the data-parallel replicas that cannot
/// hold the model.
#[test]
fn mixtral_8x7b_on_64_h100_plans_expert_parallelism() {
    use shardc::passes::autoshard;
    use shardc::passes::cost::Precision;
    let text = shardc::synthetic::Llama::mixtral_8x7b(64, 4096).to_text();
    let mut m = shardc::frontend::parse(&text).expect("parses").model;
    let mut pm = shardc::passes::PassManager::new();
    pm.add(shardc::passes::Verify)
        .add(shardc::passes::InferShapes::default())
        .add(shardc::passes::Canonicalize)
        .add(shardc::passes::Algebra)
        .add(shardc::passes::FuseAttention);
    pm.run(&mut m).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(count(&m.graph, |o| matches!(o, Op::MoE(_))), 32);
    let cluster = Cluster::preset("h100-cluster-8").expect("preset");
    let opts = Options { precision: Precision::Fp16, ..Options::default() };
    let r = autoshard::search(&m.graph, &cluster, 64, &opts, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    let plan = r.same_as.clone().unwrap_or_default();
    assert!(r.breakdown.feasible && plan.contains("ep="), "{plan}: {:?}", r.breakdown.memory);
    // The mixtures' backward kernels hold five f32 values of the expert width per routed pair
    // they read: every pair of the tokens gathered over the expert axis (one sequence of 4,096
    // tokens a device, `ep` of them gathered, top-2), priced as workspace (`ep=8`: 17.5 GiB).
    let ep: f64 = plan.split(',').find_map(|f| f.strip_prefix("ep=")).and_then(|e| e.parse().ok()).unwrap();
    assert!(!plan.contains("pp=") && !plan.contains("tp=2"), "{plan}: the check below assumes one sequence a device");
    let scratch = ep * 4096.0 * 2.0 * 14336.0 * 5.0 * 4.0;
    let w = r.breakdown.memory.workspace;
    assert!((w - scratch).abs() <= 0.05 * scratch, "workspace {w:.3e} B, the kernels' scratch {scratch:.3e} B");
    let data = shardc::exec::named_result(&m.graph, &cluster, 64, "data", &opts).unwrap();
    assert!(!data.breakdown.feasible, "data parallel fits: {:?}", data.breakdown.memory);
    // Mixtures that allow the all-to-all dispatcher: the search prices both dispatchers at
    // each expert point and keeps the faster — all-gather against dropless buffers (as large
    // as the gather, more operations), all-to-all at a capacity of 1.25.
    for (factor, a2a) in [(0.0, false), (1.25, true)] {
        let mut g = m.graph.clone();
        shardc::ir::ops::experts::set_capacity(&mut g, factor).unwrap();
        let d = autoshard::search(&g, &cluster, 64, &opts, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
        let config = d.same_as.clone().unwrap_or_default();
        assert_eq!(config.contains("ep_comm=a2a"), a2a, "capacity {factor}: {config}");
        let faster = d.breakdown.step_time_s < r.breakdown.step_time_s;
        assert_eq!(
            faster, a2a,
            "capacity {factor}: {} s against {} s",
            d.breakdown.step_time_s, r.breakdown.step_time_s
        );
        if a2a {
            assert!(config.ends_with("capacity=1.25"), "{config}");
        }
    }
}

/// A hand configuration with expert parallelism prices and exports: Megatron-LM's MoE
/// arguments (experts, top-k, the expert-parallel size within the data-parallel ranks, the
/// all-gather dispatcher the plan was priced with), DeepSpeed's expert-parallel size, and a
/// refusal from torch's tensor-parallel plan, which has no expert style.
#[test]
fn expert_configurations_export_to_megatron_and_deepspeed() {
    let dir = std::env::temp_dir().join(format!("shardc-moe-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("mixtral.onnxtxt");
    std::fs::write(&model, shardc::synthetic::Llama::mixtral_8x7b(64, 4096).to_text()).unwrap();
    let cost_of = |strategy: &str, export: &str| {
        shardc(&[
            "cost",
            model.to_str().unwrap(),
            "--cluster",
            "h100-cluster-8",
            "--devices",
            "64",
            "--precision",
            "bf16",
            "--strategy",
            strategy,
            "--export",
            export,
        ])
    };
    let cost = |export: &str| cost_of("dp=64,ep=8,zero=1", export);
    let o = cost("megatron");
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let pinned =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/megatron-options.txt")).unwrap();
    let known: std::collections::HashSet<&str> = pinned.lines().filter(|l| l.starts_with("--")).collect();
    for flag in
        out.lines().filter(|l| l.starts_with("  ")).flat_map(str::split_whitespace).filter(|w| w.starts_with("--"))
    {
        assert!(known.contains(flag), "{flag} is not a Megatron-LM option (tests/data/megatron-options.txt)");
    }
    for want in [
        "--num-layers 32",
        "--num-query-groups 8",
        "--ffn-hidden-size 14336",
        "--num-experts 8 --moe-router-topk 2",
        "--expert-model-parallel-size 8 --moe-token-dispatcher-type allgather",
        "--tensor-model-parallel-size 1",
        "--use-distributed-optimizer",
    ] {
        assert!(out.contains(want), "no `{want}` in\n{out}");
    }
    let o = cost("deepspeed");
    assert!(o.status.success() && text(&o.stdout).contains("\"expert_parallel_size\": 8"), "{}", text(&o.stdout));
    let o = cost("torch-tp");
    assert!(!o.status.success() && text(&o.stderr).contains("expert parallel"), "{}", text(&o.stderr));
    // The all-to-all dispatcher exports as Megatron-core's, with its capacity factor.
    let a2a = "dp=64,ep=8,zero=1,ep_comm=a2a,capacity=1.25";
    let o = cost_of(a2a, "megatron");
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for flag in
        out.lines().filter(|l| l.starts_with("  ")).flat_map(str::split_whitespace).filter(|w| w.starts_with("--"))
    {
        assert!(known.contains(flag), "{flag} is not a Megatron-LM option (tests/data/megatron-options.txt)");
    }
    for want in ["--moe-token-dispatcher-type alltoall", "--moe-expert-capacity-factor 1.25", "drops the pairs"] {
        assert!(out.contains(want), "no `{want}` in\n{out}");
    }
    let o = cost_of(a2a, "deepspeed");
    assert!(o.status.success() && text(&o.stdout).contains("capacity_factor = 1.25"), "{}", text(&o.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Expert parallelism beside Megatron (`tp=2,ep=2` on 8 devices: data 2 × expert 2 × tensor
/// 2, the mixtures' tokens split over the tensor axis) trains equal to one device.
#[test]
fn expert_and_tensor_parallelism_train_like_one_device() {
    for name in EXPORTS {
        let out = train_checked(&data(name, "onnx"), "tp=2,ep=2", "8", "cpu", "3");
        assert!(out.contains("data 2 × expert 2 × tensor 2"), "{name}\n{out}");
    }
}

/// The all-to-all token dispatcher trains equal to one device: dropless buffers over all 8
/// devices, a capacity factor on a `data × expert` mesh (both exports), and on wgpu kernels;
/// the plan is summarised as expert parallelism.
#[test]
fn all_to_all_dispatch_trains_like_one_device() {
    for name in EXPORTS {
        let model = data(name, "onnx");
        let out = train_checked(&model, "ep=8,ep_comm=a2a", "8", "cpu", "5");
        assert!(out.contains("parallelism  expert 8"), "{name}\n{out}");
        let out = train_checked(&model, "ep=4,ep_comm=a2a,capacity=2", "8", "cpu", "3");
        assert!(out.contains("data 2 × expert 4"), "{name}\n{out}");
    }
    // Beside a tensor axis, and in tensor-parallel pipeline stages (the tokens' blocks of an
    // expert group then not consecutive rows), proved too.
    let model = data("mixtral_tiny_dynamo", "onnx");
    for (strategy, says) in [
        ("tp=2,ep=2,ep_comm=a2a", "data 2 × expert 2 × tensor 2"),
        ("pp=2,tp=2,ep=2,ep_comm=a2a", "stage 0: expert 2 × tensor 2"),
        ("pp=2,tp=2,ep=2", "stage 0: expert 2 × tensor 2"),
    ] {
        let out = train_checked(&model, strategy, "8", "cpu", "3");
        assert!(out.contains(says), "{strategy}\n{out}");
        let o = shardc(
            &["verify", model.to_str().unwrap(), "--loss", "softmax-cross-entropy", "--devices", "8"]
                .into_iter()
                .chain(["--strategy", strategy, "--backend", "cpu"])
                .collect::<Vec<_>>(),
        );
        assert!(o.status.success(), "{strategy}: {}{}", text(&o.stdout), text(&o.stderr));
    }
    if shardc_tests::gpu_available() {
        train_checked(&model, "ep=4,ep_comm=a2a", "4", "wgpu", "3");
    }
}

/// A step that routes more pairs to a device than the dispatcher's capacity holds stops with
/// an error naming the capacity, rather than dropping pairs; the fields say what they need.
#[test]
fn all_to_all_dispatch_refuses_an_overflow() {
    let model = data("mixtral_tiny_dynamo", "onnx");
    let m = model.to_str().unwrap();
    let base = ["train", m, "--loss", "softmax-cross-entropy", "--devices", "8", "--steps", "2", "--strategy"];
    let run = |strategy: &str| {
        let args: Vec<&str> = base.iter().copied().chain([strategy]).collect();
        shardc(&args)
    };
    let o = run("ep=8,ep_comm=a2a,capacity=0.5");
    let err = text(&o.stderr);
    assert!(!o.status.success() && err.contains("routed pairs") && err.contains("capacity"), "{err}");
    let o = run("ep=8,capacity=2");
    assert!(!o.status.success() && text(&o.stderr).contains("give ep_comm=a2a"), "{}", text(&o.stderr));
    let o = run("dp=8,ep_comm=a2a");
    assert!(!o.status.success() && text(&o.stderr).contains("give ep > 1"), "{}", text(&o.stderr));
    let o = run("ep=8,ep_comm=a2a,capacity=-1");
    assert!(!o.status.success() && text(&o.stderr).contains("capacity factor"), "{}", text(&o.stderr));
}

/// `plan --moe-capacity` records the capacity factor in the plan, and `train --plan` asks the
/// mixtures for it again before applying the plan (whose strategies may split the dispatch
/// dim), then trains like one device.
#[test]
fn plans_carry_the_dispatchers_capacity() {
    let model = data("mixtral_tiny_dynamo", "onnx");
    let m = model.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("shardc-moe-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let o = shardc(&[
        "plan",
        m,
        "--cluster",
        "local-wgpu",
        "--devices",
        "8",
        "--moe-capacity",
        "2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(doc["moe_capacity"], 2.0);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(["train", m, "--plan", plan.to_str().unwrap(), "--loss", "softmax-cross-entropy", "--steps", "2"])
        .args(["--backend", "cpu", "--check"])
        .output()
        .unwrap();
    let out = text(&o.stdout);
    assert!(o.status.success() && out.lines().filter(|l| l.contains(" ok ")).count() == 4, "{out}{}", text(&o.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// On wgpu devices the mixtures run on their own kernels (not on the host) and training under
/// `ep=4` equals one device's.
#[test]
fn expert_parallel_training_runs_on_wgpu_kernels() {
    if !shardc_tests::gpu_available() {
        return;
    }
    let out = train_checked(&data("mixtral_tiny_dynamo", "onnx"), "ep=4", "4", "wgpu", "3");
    let host = out.lines().find(|l| l.starts_with("host ops")).unwrap_or_default();
    assert!(!host.contains("MoE"), "the mixtures ran on the host: {host}");
}

/// Pipelines of expert-parallel stages (`pipeline:S:M:…:ep:E`, `pp=2,ep=2`): trained equal to
/// one device (both exports), proved, and summarised as expert parallelism.
#[test]
fn pipelines_of_expert_parallel_stages_train_like_one_device() {
    for name in EXPORTS {
        let model = data(name, "onnx");
        for strategy in ["pipeline:2:4:1f1b:ep:2", "pp=2,ep=2"] {
            let out = train_checked(&model, strategy, "4", "cpu", "3");
            assert!(
                out.contains("pipeline 2 × 4 micro-batches") && out.contains("expert 2"),
                "{name} {strategy}\n{out}"
            );
        }
    }
    let o = shardc(&[
        "verify",
        data("mixtral_tiny_dynamo", "onnx").to_str().unwrap(),
        "--loss",
        "softmax-cross-entropy",
        "--devices",
        "4",
        "--strategy",
        "pipeline:2:4:1f1b:ep:2",
    ]);
    assert!(o.status.success() && text(&o.stdout).contains("verified"), "{}{}", text(&o.stdout), text(&o.stderr));
}
