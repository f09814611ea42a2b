//! Completeness of every op type the IR knows, on one sample graph each
//! (`shardc_tests::samples`): shape inference types its outputs; it has an iteration space
//! rule, a work rule and an evaluator; and it either compiles to GPU kernels (every source
//! validated by naga, and, with an adapter, run and compared with the reference) or is in
//! the commented `HOST_ONLY` list — never both, never neither.

use std::collections::{BTreeSet, HashMap};

use codegen::runtime::Executor;
use codegen::runtime::gpu::compile;
use ir::eval::Array;
use ir::ops::NodeCx;
use ir::{Graph, NodeId, Op, OpClass, Value};
use shardc_tests::samples::{Sample, samples};
use shardc_tests::*;

/// Ops whose evaluation needs more than one device: the runtime executes them.
const RUNTIME_EVAL: &[&str] = &["Send", "Recv"];

/// Ops without a reference evaluator yet, and why.
const NO_EVAL: &[(&str, &str)] = &[];

fn parse(s: &Sample) -> ir::Model {
    let mut m =
        frontend::parse(&s.text).unwrap_or_else(|d| panic!("{}: {}", s.op, frontend::render(&d, s.op, &s.text))).model;
    ir::verify(&m.graph).unwrap_or_else(|e| panic!("{}: {e}", s.op));
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap_or_else(|e| panic!("{}: {e:?}", s.op));
    m
}

/// Graph inputs drawn in [0.1, 0.9] (every sample's inputs are floats).
fn inputs(g: &Graph, seed: u64) -> HashMap<String, Array> {
    let mut rng = ir::eval::Rng::new(seed);
    g.input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, Op::Input { default: None }))
        .map(|v| {
            let t = g.tensor_type(v).expect("typed input");
            let shape: Vec<usize> = t.static_dims().expect("static").iter().map(|&d| d as usize).collect();
            let n = shape.iter().product();
            (g.value_name(v).to_string(), Array::float(t.dtype, shape, (0..n).map(|_| rng.uniform(0.1, 0.9)).collect()))
        })
        .collect()
}

/// The nodes of the sample's op type (in the top-level graph).
fn sampled(g: &Graph, op: &str) -> Vec<NodeId> {
    g.node_ids().filter(|&n| g.node(n).op.op_type() == op).collect()
}

fn validate(what: &str, src: &str) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{what}: WGSL does not parse: {}\n{src}", e.emit_to_string(src)));
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::default())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{what}: WGSL does not validate: {}\n{src}", e.emit_to_string(src)));
}

#[test]
fn every_op_type_has_a_sample() {
    let have: BTreeSet<&str> = samples().iter().map(|s| s.op).collect();
    let missing: Vec<&str> = Op::known_op_types().iter().map(|(_, t)| *t).filter(|t| !have.contains(t)).collect();
    assert!(missing.is_empty(), "ops without a sample in tests/src/samples.rs: {missing:?}");
}

/// Every op type has inference, an iteration space, a work rule, an evaluator, and a GPU
/// kernel or a place in `HOST_ONLY`.
#[test]
fn every_op_has_every_facet() {
    let mut problems = Vec::new();
    for s in samples() {
        let m = parse(&s);
        let g = &m.graph;
        let nodes = sampled(g, s.op);
        assert!(!nodes.is_empty(), "{}: the sample has no {} node", s.op, s.op);
        let consts = ir::infer::infer_shapes(&mut g.clone(), ir::infer::Mode::Check).unwrap().consts;
        for n in nodes {
            let node = g.node(n);
            let rules = node.op.rules();
            let cx = NodeCx { g, n };
            for slot in 0..node.num_outputs() {
                if !node.outputs()[slot].name.is_empty() && g.tensor_type(Value::new(n, slot as u16)).is_none() {
                    problems.push(format!("{}: inference leaves output {slot} untyped", s.op));
                }
            }
            if rules.space(&cx).is_none() {
                problems.push(format!("{}: no iteration space rule", s.op));
            }
            if rules.work(&cx).is_none() {
                problems.push(format!("{}: no work rule", s.op));
            }
            // Matrix products run on the matrix units (the cost model prices them at the
            // precision's tensor-core peak); element-wise, reduction and data-movement ops
            // do not. A determinant is an LU factorization, not a matrix product.
            let matrix = matches!(node.op.class(), OpClass::Contraction | OpClass::Recurrent) && s.op != "Det";
            let vector = matches!(
                node.op.class(),
                OpClass::Unary | OpClass::Binary | OpClass::Variadic | OpClass::Reduce | OpClass::Shape | OpClass::Comm
            );
            // A GEMM shape only for ops on the matrix units.
            let dims = |v: Option<Value>| -> Option<Vec<f64>> {
                Some(g.tensor_type(v?)?.static_dims()?.iter().map(|&d| d as f64).collect())
            };
            if let (Some(x), Some(y)) = (dims(node.input(0)), dims(Some(Value::new(n, 0))))
                && rules.gemm(&x, dims(node.input(1)).as_deref(), &y).is_some()
                && !rules.matrix_units()
            {
                problems.push(format!("{}: a GEMM shape but not on the matrix units", s.op));
            }
            // An element-wise derivative has its WGSL twin and the other way round.
            if rules.derivative(0.5, 0.5).is_some() != compile::derivative(&node.op).is_some() {
                problems.push(format!("{}: a derivative on one of the CPU and wgpu sides only", s.op));
            }
            if (matrix && !rules.matrix_units()) || (vector && rules.matrix_units()) {
                problems.push(format!(
                    "{}: matrix_units() is {} for a {:?} op",
                    s.op,
                    rules.matrix_units(),
                    node.op.class()
                ));
            }
            // The evaluator: the whole sample runs.
            let r = ir::eval::run(g, &inputs(g, 1), &Default::default());
            match (r, RUNTIME_EVAL.contains(&s.op), NO_EVAL.iter().any(|(t, _)| *t == s.op)) {
                (Ok(_), false, false) => {}
                (Err(e), false, false) => problems.push(format!("{}: evaluation fails: {e}", s.op)),
                (Ok(_), _, true) => problems.push(format!("{}: evaluates now; take it off NO_EVAL", s.op)),
                (_, true, _) | (Err(_), _, true) => {}
            }
            let compiled = compile::compile(&node.op, &compile_cx(g, n, &consts));
            let host_only = compile::host_only(s.op);
            match (compiled, host_only) {
                (Ok(Some(c)), false) => {
                    for l in c.launches() {
                        validate(s.op, &l.src);
                    }
                }
                (Ok(Some(_)), true) => problems.push(format!("{}: has a kernel; take it off HOST_ONLY", s.op)),
                (Ok(None), false) => problems.push(format!("{}: no GPU kernel and not in HOST_ONLY", s.op)),
                (Ok(None), true) => {}
                (Err(e), _) => problems.push(format!("{}: compiling fails: {e}", s.op)),
            }
        }
    }
    assert!(problems.is_empty(), "{} missing facet(s):\n{}", problems.len(), problems.join("\n"));
}

/// Every `HOST_ONLY` entry names an op the IR knows and gives a reason.
#[test]
fn host_only_entries_are_known_ops_with_reasons() {
    for (op, why) in compile::HOST_ONLY {
        assert!(Op::known_op_types().iter().any(|(_, t)| t == op), "HOST_ONLY names `{op}`, which is not an op");
        assert!(why.len() > 10, "HOST_ONLY entry `{op}` needs a reason");
    }
}

/// Ops whose WGSL built-ins Vulkan specifies with a looser error bound (inverse and
/// hyperbolic trigonometry: up to thousands of ULP, inherited from `atan2` and `exp`), and
/// the relative tolerance they get.
const LOOSE: &[(&str, f64)] = &[
    ("Acos", 1e-3),
    ("Asin", 1e-3),
    ("Atan", 1e-3),
    ("Acosh", 1e-3),
    ("Asinh", 1e-3),
    ("Atanh", 1e-3),
    ("Sinh", 1e-3),
    ("Cosh", 1e-3),
    ("Tan", 1e-3),
];

/// Runs a graph node by node on an executor; returns every named value.
fn run_on<E: Executor>(e: &mut E, g: &Graph, feeds: &HashMap<String, Array>) -> HashMap<String, Array> {
    let mut env: HashMap<Value, E::Tensor> = HashMap::new();
    let mut out = HashMap::new();
    for n in g.topo_order().unwrap() {
        let node = g.node(n);
        let v0 = Value::new(n, 0);
        let tensors: Vec<E::Tensor> = match &node.op {
            Op::Input { .. } => vec![e.upload(&feeds[g.value_name(v0)]).unwrap()],
            Op::Initializer(t) => vec![e.upload(&Array::from_tensor(t).unwrap()).unwrap()],
            _ => {
                let ins: Vec<Option<&E::Tensor>> = node.inputs().iter().map(|i| i.and_then(|v| env.get(&v))).collect();
                let caps: Vec<Option<&E::Tensor>> = node.captures().iter().map(|v| env.get(v)).collect();
                e.run(g, n, &ins, &caps).unwrap_or_else(|err| panic!("{}: {err}", g.describe(n))).0
            }
        };
        for (s, t) in tensors.into_iter().enumerate() {
            let v = Value::new(n, s as u16);
            if !node.outputs()[s].name.is_empty() {
                out.insert(g.value_name(v).to_string(), e.download(&t).unwrap());
            }
            env.insert(v, t);
        }
    }
    out
}

/// Every element-wise derivative's WGSL kernel (`ElementwiseGrad` of each op that has one)
/// matches the reference's, each op with its attributes at their defaults and, where it has
/// some, at other values.
#[test]
fn every_elementwise_derivative_kernel_matches_the_reference() {
    if !gpu_available() {
        return;
    }
    let mut gpu = codegen::runtime::gpu::GpuExecutor::new().unwrap();
    let mut ran = Vec::new();
    let mut failures = Vec::new();
    for &(domain, op) in Op::known_op_types() {
        let rules_op = Op::from_parts(domain, op, Vec::new()).unwrap();
        if rules_op.rules().derivative(0.5, 0.5).is_none() {
            continue;
        }
        for attrs in ["", "<alpha: float = 0.3, beta: float = 0.25, gamma: float = 1.5>"] {
            if !attrs.is_empty()
                && Op::known_attributes(domain, op).is_none_or(|a| !a.iter().any(|n| ["alpha", "lambd"].contains(n)))
            {
                continue;
            }
            // Acosh is defined from 1 up; the other inputs are drawn in [0.1, 0.9].
            let x = if op == "Acosh" { "   x1 = Add (x, one)\n" } else { "   x1 = Identity (x)\n" };
            let fwd = match op {
                "Shrink" if !attrs.is_empty() => format!("{op} <lambd: float = 0.3, bias: float = 0.25>"),
                _ if !attrs.is_empty() => {
                    format!("{op} {}", attrs.replace("beta: float = 0.25, ", "").replace(", gamma: float = 1.5", ""))
                }
                _ => op.to_string(),
            };
            let grad_attrs = if attrs.is_empty() {
                String::new()
            } else {
                attrs.trim_start_matches('<').trim_end_matches('>').to_string() + ", "
            };
            let text = format!(
                "<ir_version: 8, opset_import: [\"\" : 24, \"shardc\" : 1]>\nd (float[2,3] x, float[2,3] dy) => (float[2,3] dx) <float one = {{1.0}}> {{\n{x}   y = {fwd} (x1)\n   dx = shardc.ElementwiseGrad <{grad_attrs}op: string = \"{op}\"> (x1, y, dy)\n}}"
            );
            let m = parse(&Sample { op: "ElementwiseGrad", text });
            let feeds = inputs(&m.graph, 3);
            let want = ir::eval::run(&m.graph, &feeds, &Default::default()).unwrap_or_else(|e| panic!("{op}: {e}"));
            let got = run_on(&mut gpu, &m.graph, &feeds);
            let rtol = LOOSE.iter().find(|(t, _)| *t == op).map_or(1e-4, |l| l.1);
            if let Err(e) = compare(&format!("the derivative of {op} {attrs}"), &got["dx"], &want[0], rtol, 1e-5) {
                failures.push(e);
            }
            ran.push(op);
        }
    }
    eprintln!("ran {}", ran.len());
    assert!(ran.len() >= 30, "only {} derivatives ran: {ran:?}", ran.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every sample whose ops have kernels runs on one wgpu device and matches the reference.
#[test]
fn every_kernel_matches_the_reference_on_its_sample() {
    if !gpu_available() {
        return;
    }
    let mut gpu = codegen::runtime::gpu::GpuExecutor::new().unwrap();
    let mut ran = 0;
    let mut failures = Vec::new();
    for s in samples() {
        if compile::host_only(s.op) || RUNTIME_EVAL.contains(&s.op) || NO_EVAL.iter().any(|(t, _)| *t == s.op) {
            continue;
        }
        let m = parse(&s);
        let feeds = inputs(&m.graph, 2);
        let want = ir::eval::run_all(&m.graph, &feeds, &Default::default()).unwrap();
        let got = run_on(&mut gpu, &m.graph, &feeds);
        for (v, a) in want {
            let name = m.graph.value_name(v);
            let rtol = LOOSE.iter().find(|(t, _)| *t == s.op).map_or(1e-4, |l| l.1);
            if let Some(b) = got.get(name)
                && let Err(e) = compare(&format!("{} `{name}`", s.op), b, &a, rtol, 1e-5)
            {
                failures.push(e);
            }
        }
        ran += 1;
    }
    eprintln!("{ran} samples ran on the GPU");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `Scan` carries its state across the slices and stacks its scan outputs.
#[test]
fn scan_accumulates_over_its_slices() {
    let s = samples().into_iter().find(|s| s.op == "Scan").unwrap();
    let m = parse(&s);
    let feeds = inputs(&m.graph, 3);
    let out = ir::eval::run(&m.graph, &feeds, &Default::default()).unwrap();
    let (x, init) = (feeds["x"].to_f64().unwrap(), feeds["init"].to_f64().unwrap());
    let (last, ys) = (out[0].to_f64().unwrap(), out[1].to_f64().unwrap());
    assert_eq!(out[1].shape, vec![2, 3, 4]);
    for i in 0..12 {
        let first = init[i] + x[i];
        assert!((ys[i] - first).abs() < 1e-6);
        assert!((last[i] - (first + x[12 + i])).abs() < 1e-6);
        assert!((ys[12 + i] - last[i]).abs() < 1e-6);
    }
}

/// Every op's evaluation (and shape inference) answers degenerate operands — scalars, empty
/// tensors, a single element, in every input slot and element type the sample uses — with a
/// result or an error, never a panic.
#[test]
fn degenerate_operands_never_panic() {
    use ir::eval::Data;
    let mut panics = Vec::new();
    for s in samples() {
        let m = parse(&s);
        let g = &m.graph;
        // Every value of the sample (run_all frees values after their last use).
        let feeds = inputs(g, 1);
        let mut values: HashMap<Value, Array> = HashMap::new();
        for n in g.topo_order().unwrap() {
            let node = g.node(n);
            let outs: Vec<Array> = match &node.op {
                Op::Input { .. } => feeds.get(g.value_name(Value::new(n, 0))).cloned().into_iter().collect(),
                Op::Initializer(t) => Array::from_tensor(t).into_iter().collect(),
                _ => {
                    let ins: Vec<Option<&Array>> =
                        node.inputs().iter().map(|i| i.and_then(|v| values.get(&v))).collect();
                    let caps: Vec<Option<&Array>> = node.captures().iter().map(|v| values.get(v)).collect();
                    ir::eval::eval_node(g, n, &ins, &caps).unwrap_or_default()
                }
            };
            for (k, a) in outs.into_iter().enumerate() {
                values.insert(Value::new(n, k as u16), a);
            }
        }
        for n in sampled(g, s.op) {
            let node = g.node(n);
            let given: Vec<Option<Array>> =
                node.inputs().iter().map(|i| i.and_then(|v| values.get(&v).cloned())).collect();
            for slot in 0..given.len() {
                let Some(a) = &given[slot] else { continue };
                for shape in [vec![], vec![0], vec![1], vec![0, 3]] {
                    let k: usize = shape.iter().product();
                    let data = match &a.data {
                        Data::F32(_) => Data::F32(vec![1.0; k]),
                        Data::F64(_) => Data::F64(vec![1.0; k]),
                        Data::I64(_) => Data::I64(vec![1; k]),
                        Data::Bool(_) => Data::Bool(vec![true; k]),
                        Data::Str(_) => Data::Str(vec!["a".into(); k]),
                    };
                    let mut ins = given.clone();
                    ins[slot] = Some(Array { dtype: a.dtype, shape: shape.clone(), data });
                    let refs: Vec<Option<&Array>> = ins.iter().map(Option::as_ref).collect();
                    let types: Vec<Option<ir::TensorType>> = ins
                        .iter()
                        .map(|a| {
                            a.as_ref().map(|a| {
                                ir::TensorType::fixed(a.dtype, &a.shape.iter().map(|&d| d as i64).collect::<Vec<_>>())
                            })
                        })
                        .collect();
                    let trefs: Vec<Option<&ir::TensorType>> = types.iter().map(Option::as_ref).collect();
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let _ = ir::infer::infer_op(
                            &node.op,
                            &trefs,
                            &refs,
                            &vec![None; refs.len()],
                            node.num_outputs(),
                            g.opset,
                        );
                        let _ = ir::eval::eval_node(g, n, &refs, &[]);
                    }));
                    if r.is_err() {
                        panics.push(format!("{}: input {slot} of shape {shape:?}", s.op));
                    }
                }
            }
        }
    }
    assert!(panics.is_empty(), "{} panics on degenerate operands:\n{}", panics.len(), panics.join("\n"));
}

/// Ops without a rule for how changed dims flow through them (rebatching), and why.
const NO_FLOW: &[(&str, &str)] = &[
    ("AdamUpdate", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("AllGather", "communication: the lowering inserts it after rebatching"),
    ("AllReduce", "communication: the lowering inserts it after rebatching"),
    ("AllToAll", "communication: the lowering inserts it after rebatching"),
    ("MoECombine", "the all-to-all dispatcher's: the lowering inserts it after rebatching"),
    ("MoEDispatch", "the all-to-all dispatcher's: the lowering inserts it after rebatching"),
    ("MoERoute", "the all-to-all dispatcher's: the lowering inserts it after rebatching"),
    ("AveragePoolGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("BatchNormGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("Compress", "data-dependent output size: no batch can be followed through it"),
    ("ConvGradInput", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("ConvGradWeight", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("ElementwiseGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("GatherGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("HaloExchange", "communication: the lowering inserts it after rebatching"),
    ("If", "control flow: rebatching does not enter subgraphs (a batch baked into one is refused by re-inference)"),
    ("LayerNormGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("Loop", "control flow: rebatching does not enter subgraphs (a batch baked into one is refused by re-inference)"),
    ("MaxPoolGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("NegativeLogLikelihoodLossGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("NonMaxSuppression", "data-dependent output size: no batch can be followed through it"),
    ("RecurrentGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("Recv", "communication: the lowering inserts it after rebatching"),
    ("ReduceScatter", "communication: the lowering inserts it after rebatching"),
    ("Scan", "control flow: rebatching does not enter subgraphs (a batch baked into one is refused by re-inference)"),
    ("RoiAlignGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("SgdUpdate", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("SliceGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("SoftmaxCrossEntropyLossGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("SoftmaxGrad", "training: autodiff writes it after rebatching, at the rebatched shapes"),
    ("Unique", "data-dependent output size: no batch can be followed through it"),
];

/// Every op a changed batch reaches in its sample has a flow rule (rebatching follows the
/// batch through it), or a place in `NO_FLOW` with a reason.
#[test]
fn every_op_has_a_flow_rule_or_a_reason() {
    let mut missing = BTreeSet::new();
    for s in samples() {
        let m = parse(&s);
        let g = &m.graph;
        let old: HashMap<Value, Vec<i64>> = g
            .node_ids()
            .flat_map(|n| (0..g.node(n).num_outputs()).map(move |k| Value::new(n, k as u16)))
            .filter_map(|v| Some((v, g.tensor_type(v)?.static_dims()?)))
            .collect();
        // Dim 0 of every float graph input doubles, each a symbol of its own.
        let mut syms = Vec::new();
        let mut seeds = HashMap::new();
        for v in g.input_values() {
            let Some(d) = old.get(&v).filter(|d| !d.is_empty()) else { continue };
            if !matches!(g.node(v.node).op, ir::Op::Input { default: None }) {
                continue;
            }
            let mut m: Vec<ir::ops::Mono> = d.iter().map(|&x| ir::ops::Mono::constant(x)).collect();
            m[0] = ir::ops::Mono::sym(syms.len());
            syms.push((d[0], d[0] * 2));
            seeds.insert(v, m);
        }
        let consts = ir::infer::infer_shapes(&mut g.clone(), ir::infer::Mode::Check).unwrap().consts;
        let order = g.topo_order().unwrap();
        let fl = ir::ops::flow::flow_graph(g, &order, &syms, &old, &consts, &seeds, &HashMap::new());
        for n in fl.missing {
            if g.node(n).op.op_type() == s.op {
                missing.insert(s.op);
            }
        }
    }
    let listed: BTreeSet<&str> = NO_FLOW.iter().map(|(t, _)| *t).collect();
    assert!(
        missing == listed,
        "ops without a flow rule that NO_FLOW does not list: {:?}; listed but have one: {:?}",
        missing.difference(&listed).collect::<Vec<_>>(),
        listed.difference(&missing).collect::<Vec<_>>()
    );
    assert!(NO_FLOW.iter().all(|(_, why)| why.len() > 10));
}

/// `Pad` in edge, reflect and wrap modes reads the input's border, which an axis of length 0
/// does not have: padding one is an error that names the axis (it panicked before); a
/// constant pad fills it.
#[test]
fn padding_an_empty_axis_needs_a_constant() {
    for mode in ["edge", "reflect", "wrap", "constant"] {
        let text = format!(
            r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,0] x) => (y) {{
  pads = Constant <value = int64[4] {{0, 1, 0, 2}}> ()
  y = Pad <mode = "{mode}"> (x, pads)
}}
"#
        );
        let m = frontend::parse(&text).unwrap_or_else(|e| panic!("{mode}: {e:?}")).model;
        let x = Array::f32(vec![2, 0], vec![]);
        let r = ir::eval::run(&m.graph, &HashMap::from([("x".to_string(), x)]), &Default::default());
        match mode {
            "constant" => {
                let y = &r.unwrap_or_else(|e| panic!("{e}"))[0];
                assert_eq!(y.shape, vec![2, 3]);
                assert!(y.to_f64().unwrap().iter().all(|&v| v == 0.0));
            }
            _ => {
                let e = r.expect_err(mode).to_string();
                assert!(e.contains("axis 1") && e.contains("empty"), "{mode}: {e}");
            }
        }
    }
}
