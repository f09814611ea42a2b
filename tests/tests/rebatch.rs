//! Re-batching: batch sizes and sequence lengths baked into real exports are rewritten, and
//! every shape re-infers consistently.

use passes::rebatch::{RebatchSpec, rebatch};
use shardc_tests::*;

fn model(name: &str) -> ir::Model {
    let path =
        data_files("models").into_iter().find(|p| p.file_name().unwrap() == name).unwrap_or_else(|| panic!("{name}"));
    load_model(&path)
}

fn run(name: &str, mut spec: RebatchSpec) -> ir::Model {
    let mut m = model(name);
    // External constants read beside the model (here absent: their values are drawn).
    if spec.external == passes::ExternalData::Refuse {
        spec.external =
            passes::ExternalData::Read(shardc::exec::external_reader(&repo_root().join("tests/data/models")));
    }
    match rebatch(&mut m.graph, &spec) {
        Ok(_) => m,
        Err(e) => panic!("{name}: {:#?}", e.errors),
    }
}

fn out_type(m: &ir::Model, k: usize) -> String {
    let o = &m.graph.outputs()[k];
    o.ty.as_ref().map(|t| t.to_string()).unwrap_or_default()
}

fn all_static(m: &ir::Model) {
    let g = &m.graph;
    for n in g.op_nodes().unwrap() {
        for s in 0..g.node(n).num_outputs() {
            let v = ir::Value::new(n, s as u16);
            if g.value_name(v).is_empty() {
                continue;
            }
            assert!(
                g.tensor_type(v).is_some_and(|t| t.is_static()),
                "`{}` is {:?}",
                g.value_name(v),
                g.tensor_type(v).map(|t| t.to_string())
            );
        }
    }
}

#[test]
fn resnet50_batch_1_to_256() {
    let m = run("tv_resnet50.onnxtxt", RebatchSpec { batch: Some(256), ..Default::default() });
    assert_eq!(out_type(&m, 0), "float[256,1000]");
    all_static(&m);
}

#[test]
fn gpt2_batch_and_sequence() {
    let m = run("hf_gpt2_124m.onnxtxt", RebatchSpec { batch: Some(8), ..Default::default() });
    assert_eq!(out_type(&m, 0), "float[8,128,50257]");
    all_static(&m);
    let m = run(
        "hf_gpt2_124m.onnxtxt",
        RebatchSpec { batch: None, input_shapes: vec![("input_ids".into(), vec![8, 1024])], ..Default::default() },
    );
    assert_eq!(out_type(&m, 0), "float[8,1024,50257]");
    all_static(&m);
}

#[test]
fn bert_batch_and_sequence() {
    let m = run("hf_bert_base.onnxtxt", RebatchSpec { batch: Some(16), ..Default::default() });
    all_static(&m);
    let m0 = model("hf_bert_base.onnxtxt");
    let names: Vec<String> = m0.graph.input_values().iter().map(|&v| m0.graph.value_name(v).to_string()).collect();
    let spec = RebatchSpec {
        batch: None,
        input_shapes: names.iter().map(|n| (n.clone(), vec![4, 256])).collect(),
        ..Default::default()
    };
    let m = run("hf_bert_base.onnxtxt", spec);
    all_static(&m);
    assert!(out_type(&m, 0).starts_with("float[4,256,"), "{}", out_type(&m, 0));
}

#[test]
fn every_model_rebatches_to_batch_4() {
    let mut failures = Vec::new();
    for path in data_files("models") {
        let mut m = load_model(&path);
        let float_params = |g: &ir::Graph| -> u64 {
            g.input_values()
                .into_iter()
                .filter_map(|v| match &g.node(v.node).op {
                    ir::Op::Initializer(t) if t.dtype.is_float() => Some(t.numel()),
                    _ => None,
                })
                .sum()
        };
        let before = float_params(&m.graph);
        match rebatch(&mut m.graph, &RebatchSpec { batch: Some(4), ..Default::default() }) {
            // Parameters never change.
            Ok(_) => assert_eq!(float_params(&m.graph), before, "{}", path.display()),
            Err(e) => {
                failures.push(format!("{}: {:?}", path.display(), e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>()))
            }
        }
    }
    // Every shared model rebatches (pt_nn_transformer's sequence-first attention included).
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Runs a golden network with its inputs repeated along the batch, after rebatching, and
/// checks that each copy gives the original output.
#[test]
fn rebatched_golden_networks_compute_the_same_rows() {
    for name in ["tiny_gpt.onnxtxt", "tiny_mlp.onnxtxt", "tiny_resnet.onnxtxt", "tiny_lstm_lm.onnxtxt"] {
        let path = data_files("golden").into_iter().find(|p| p.file_name().unwrap() == name).unwrap();
        let mut m = load_model(&path);
        let io = load_io(&path);
        let reference = ir::eval::run(&m.graph, &io.inputs, &Default::default()).unwrap();
        rebatch(&mut m.graph, &RebatchSpec { batch: Some(4), ..Default::default() })
            .unwrap_or_else(|e| panic!("{name}: {:?}", e.errors));
        // Inputs: the batch axis of each changed input, doubled (2 → 4).
        let mut inputs = std::collections::HashMap::new();
        for v in m.graph.input_values() {
            let nm = m.graph.value_name(v).to_string();
            let new_shape: Vec<usize> =
                m.graph.tensor_type(v).unwrap().static_dims().unwrap().iter().map(|&d| d as usize).collect();
            let a = &io.inputs[&nm];
            let axis = (0..a.shape.len()).find(|&i| a.shape[i] != new_shape[i]);
            let arr = match axis {
                None => a.clone(),
                Some(ax) => {
                    let outer: usize = a.shape[..ax].iter().product();
                    let inner: usize = a.shape[ax..].iter().product();
                    let mut idx = Vec::new();
                    for o in 0..outer {
                        for _rep in 0..2 {
                            idx.extend(o * inner..(o + 1) * inner);
                        }
                    }
                    a.gather_flat(new_shape.clone(), &idx)
                }
            };
            inputs.insert(nm, arr);
        }
        let out = ir::eval::run(&m.graph, &inputs, &Default::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (k, (o, r)) in out.iter().zip(&reference).enumerate() {
            let ax = (0..r.shape.len()).find(|&i| r.shape[i] != o.shape[i]).expect("an output axis grew");
            let outer: usize = r.shape[..ax].iter().product();
            let inner: usize = r.shape[ax..].iter().product();
            let mut idx = Vec::new();
            for oo in 0..outer {
                idx.extend(2 * oo * inner..(2 * oo + 1) * inner);
            }
            let first_copy = o.gather_flat(r.shape.clone(), &idx);
            compare(&format!("{name} output {k}"), &first_copy, r, 1e-5, 1e-6).unwrap();
        }
    }
}

#[test]
fn shorter_sequence_keeps_the_causal_prefix() {
    // A causal decoder on the first 5 of 8 tokens gives the first 5 positions' logits.
    let path = data_files("golden").into_iter().find(|p| p.file_name().unwrap() == "tiny_gpt.onnxtxt").unwrap();
    let mut m = load_model(&path);
    let io = load_io(&path);
    let reference = ir::eval::run(&m.graph, &io.inputs, &Default::default()).unwrap();
    rebatch(
        &mut m.graph,
        &RebatchSpec { batch: None, input_shapes: vec![("input_ids".into(), vec![2, 5])], ..Default::default() },
    )
    .unwrap_or_else(|e| panic!("{:?}", e.errors));
    let ids = &io.inputs["input_ids"];
    let prefix = ir::eval::slice_axis(ids, 1, 0, 5);
    let out = ir::eval::run(
        &m.graph,
        &std::collections::HashMap::from([("input_ids".to_string(), prefix)]),
        &Default::default(),
    )
    .unwrap();
    let expected = ir::eval::slice_axis(&reference[0], 1, 0, 5);
    compare("logits", &out[0], &expected, 1e-4, 1e-5).unwrap();
}

/// Real architectures exported by torch at batch 1 with every size baked in
/// (scripts/gen-rebatch-cases.py): ViT (class token `Expand` + `Concat`), Swin (window
/// partition and merge reshapes, shifted-window masks), a Mixtral-style MoE (top-2 routing,
/// `GatherND` over `arange(tokens)`, `Split` of the tokens into fixed halves) and torch.nn's
/// sequence-first attention. Each is rebatched to the batch of its inputs and must give
/// torch's outputs at that batch, without any parameter changing.
#[test]
fn torch_exports_rebatch_to_torchs_outputs() {
    let mut cases: Vec<_> =
        data_files("rebatch").into_iter().filter(|p| p.extension().is_some_and(|x| x == "onnx")).collect();
    cases.sort();
    assert!(cases.len() >= 4, "{cases:?}");
    for path in cases {
        let mut m = load_model(&path);
        let io = load_io(&path);
        let batch = io.inputs.values().next().unwrap().shape[0] as i64;
        let params = |g: &ir::Graph| -> Vec<(String, Vec<i64>)> {
            let mut v: Vec<_> = g
                .input_values()
                .into_iter()
                .filter_map(|v| match &g.node(v.node).op {
                    ir::Op::Initializer(t) if t.dtype.is_float() => Some((g.value_name(v).to_string(), t.dims.clone())),
                    _ => None,
                })
                .collect();
            v.sort();
            v
        };
        let before = params(&m.graph);
        rebatch(&mut m.graph, &RebatchSpec { batch: Some(batch), ..Default::default() }).unwrap_or_else(|e| {
            panic!("{}: {:#?}", path.display(), e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>())
        });
        assert_eq!(params(&m.graph), before, "{}: a parameter changed", path.display());
        all_static(&m);
        let out = ir::eval::run(&m.graph, &io.inputs, &Default::default())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for ((name, want), got) in io.outputs.iter().zip(&out) {
            compare(name, got, want, io.rtol, io.atol).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}

/// A scatter into zeros the tracer wrote as a `Constant` with the batch baked in (top-k
/// gating's `zeros_like(p).scatter(-1, idx, w)`): the scatter's output follows the batch, so
/// its data is regenerated at the new batch, and every row computes what it computed before.
#[test]
fn scatters_into_traced_zeros_rebatch() {
    let text = r#"<
 ir_version: 8,
 opset_import: ["" : 17]
>
g (float[2,4] x) => (float[2,4] y)
<int64 k = {2}>
{
  zeros = Constant <value: tensor = float[2,4] {0,0,0,0,0,0,0,0}> ()
  p = Softmax <axis: int = -1> (x)
  top, idx = TopK <axis: int = -1> (p, k)
  w = ScatterElements <axis: int = -1> (zeros, idx, top)
  y = Mul (w, x)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    let x = ir::eval::Array::f32(vec![2, 4], vec![0.5, -1.0, 2.0, 0.1, 1.5, 0.3, -0.2, 0.9]);
    let before = ir::eval::run(&m.graph, &[("x".to_string(), x.clone())].into(), &Default::default()).unwrap();
    let before = before[0].to_f64().unwrap();
    rebatch(&mut m.graph, &RebatchSpec { batch: Some(4), ..Default::default() })
        .unwrap_or_else(|e| panic!("{:?}", e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>()));
    assert_eq!(out_type(&m, 0), "float[4,4]");
    let x4 = ir::eval::Array::concat_axis(&[&x, &x], 0);
    let after = ir::eval::run(&m.graph, &[("x".to_string(), x4)].into(), &Default::default()).unwrap();
    assert_eq!(after[0].to_f64().unwrap(), [before.clone(), before].concat());
}

/// torch's `cls.expand(x.shape[0], -1, -1)` exported with a traced batch: the -1s are replaced
/// through `Where(Equal(s, ConstantOfShape(Shape(s)) · -1), ones, s)`, whose `Shape` measures
/// a constant; the batch literal inside `s` follows, with or without canonicalize first.
#[test]
fn torch_expand_of_a_traced_batch_rebatches() {
    let text = r#"<
 ir_version: 8,
 opset_import: ["" : 17]
>
g (float[2,3,4] x) => (float[2,4,4] y)
<float[1,1,4] cls = {1, 2, 3, 4}>
{
  s = Constant <value: tensor = int64[3] {2, -1, -1}> ()
  n = Shape (s)
  ones = ConstantOfShape <value: tensor = int64[1] {1}> (n)
  minus = Constant <value: tensor = int64 {-1}> ()
  neg = Mul (ones, minus)
  eq = Equal (s, neg)
  shape = Where (eq, ones, s)
  e = Expand (cls, shape)
  y = Concat <axis: int = 1> (e, x)
}
"#;
    for canonical in [false, true] {
        let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
        if canonical {
            let mut pm = passes::PassManager::new().with_verify(true);
            pm.add(passes::InferShapes::default()).add(passes::Canonicalize);
            pm.run(&mut m).unwrap_or_else(|e| panic!("{e}: {:?}", e.errors));
        }
        let x: Vec<f32> = (0..24).map(|i| i as f32 * 0.5).collect();
        let x = ir::eval::Array::f32(vec![2, 3, 4], x);
        let before = ir::eval::run(&m.graph, &[("x".to_string(), x.clone())].into(), &Default::default()).unwrap();
        let before = before[0].to_f64().unwrap();
        rebatch(&mut m.graph, &RebatchSpec { batch: Some(4), ..Default::default() })
            .unwrap_or_else(|e| panic!("{:?}", e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>()));
        assert_eq!(out_type(&m, 0), "float[4,4,4]", "canonicalized: {canonical}");
        let x4 = ir::eval::Array::concat_axis(&[&x, &x], 0);
        let after = ir::eval::run(&m.graph, &[("x".to_string(), x4)].into(), &Default::default()).unwrap();
        assert_eq!(after[0].to_f64().unwrap(), [before.clone(), before].concat(), "canonicalized: {canonical}");
    }
}

/// A float constant along the batch: zeros for a recurrent state (the same for every sample)
/// follow any new batch, micro-batches included, and stay constants (never trained); one that
/// is a function of the sample's index (`arange(B) · 10`) extends to a larger batch but is
/// refused for micro-batches, which would restart it.
#[test]
fn constants_along_the_batch_follow_it_or_are_refused_for_micro_batches() {
    let text = |c: &str| {
        format!(
            r#"<
 ir_version: 8,
 opset_import: ["" : 17]
>
g (float[2,3] x) => (float[2,3] y)
{{
  c = Constant <value: tensor = float[2,1] {c}> ()
  y = Add (x, c)
}}
"#
        )
    };
    let x: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let run = |m: &ir::Model, b: usize| {
        let x: Vec<f32> = (0..b * 3).map(|i| x[i % 6]).collect();
        let x = ir::eval::Array::f32(vec![b, 3], x);
        ir::eval::run(&m.graph, &[("x".to_string(), x)].into(), &Default::default()).unwrap()[0].to_f64().unwrap()
    };
    let constants = |m: &ir::Model| {
        m.graph.node_ids().map(|n| ir::Value::new(n, 0)).filter(|&v| ir::cost::is_param(&m.graph, v)).count()
    };
    // Zeros: batch 4, and micro-batches of 1.
    for (b, micro) in [(4, false), (1, true)] {
        let mut m = frontend::parse(&text("{0, 0}")).unwrap_or_else(|e| panic!("{e:?}")).model;
        rebatch(&mut m.graph, &RebatchSpec { batch: Some(b), micro_batch: micro, ..Default::default() })
            .unwrap_or_else(|e| panic!("{:?}", e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>()));
        assert_eq!(out_type(&m, 0), format!("float[{b},3]"));
        assert_eq!(run(&m, b as usize), (0..b * 3).map(|i| (i % 6) as f64).collect::<Vec<_>>());
        assert_eq!(constants(&m), 0, "the regenerated zeros are not a parameter");
    }
    // The sample's index: extended for a batch of 4, refused for micro-batches of 1.
    let mut m = frontend::parse(&text("{0, 10}")).unwrap_or_else(|e| panic!("{e:?}")).model;
    rebatch(&mut m.graph, &RebatchSpec { batch: Some(4), ..Default::default() })
        .unwrap_or_else(|e| panic!("{:?}", e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>()));
    let want: Vec<f64> = (0..12).map(|i| (i % 6) as f64 + 10.0 * (i / 3) as f64).collect();
    assert_eq!(run(&m, 4), want);
    let mut m = frontend::parse(&text("{0, 10}")).unwrap_or_else(|e| panic!("{e:?}")).model;
    let err = rebatch(&mut m.graph, &RebatchSpec { batch: Some(1), micro_batch: true, ..Default::default() })
        .expect_err("a micro-batch would restart the index");
    let msg: String = err.errors.iter().map(|e| e.msg.clone()).collect();
    assert!(msg.contains("micro-batches") && msg.contains("holds different values along axis 0"), "{msg}");
}

/// Position ids as torch traces OPT's: a cumulative sum of a mask of ones made for the
/// traced batch (`Constant` → `CumSum` → `Sub`), not an initializer. Any op of constants is
/// taken by its value and follows the batch like a constant: to 4 and to micro-batches of 1
/// (it was refused: "not computed from constants in a way that can be rewritten").
#[test]
fn ops_of_constants_along_the_batch_follow_it() {
    let text = r#"<
 ir_version: 8,
 opset_import: ["" : 17]
>
g (float[2,3] x) => (float[2,3,2] y)
<float[4,2] pos = {0.5, -1, 2, 0.25, -0.5, 1.5, 3, -2}>
{
  mask = Constant <value: tensor = int64[2,3] {1, 1, 1, 1, 1, 1}> ()
  one = Constant <value: tensor = int64 {1}> ()
  axis = Constant <value: tensor = int64 {1}> ()
  c = CumSum (mask, axis)
  ids = Sub (c, one)
  p = Gather (pos, ids)
  last = Constant <value: tensor = int64[1] {-1}> ()
  xs = Unsqueeze (x, last)
  y = Mul (p, xs)
}
"#;
    for (batch, micro) in [(4, false), (1, true)] {
        let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
        let x: Vec<f32> = (0..6).map(|i| i as f32 - 1.5).collect();
        let x = ir::eval::Array::f32(vec![2, 3], x);
        let before = ir::eval::run(&m.graph, &[("x".to_string(), x.clone())].into(), &Default::default()).unwrap();
        let before = before[0].to_f64().unwrap();
        rebatch(&mut m.graph, &RebatchSpec { batch: Some(batch), micro_batch: micro, ..Default::default() })
            .unwrap_or_else(|e| panic!("{:?}", e.errors.iter().map(|e| &e.msg).collect::<Vec<_>>()));
        assert_eq!(out_type(&m, 0), format!("float[{batch},3,2]"));
        let xb =
            if batch == 4 { ir::eval::Array::concat_axis(&[&x, &x], 0) } else { ir::eval::slice_axis(&x, 0, 0, 1) };
        let after = ir::eval::run(&m.graph, &[("x".to_string(), xb)].into(), &Default::default()).unwrap();
        let want = if batch == 4 { [before.clone(), before.clone()].concat() } else { before[..6].to_vec() };
        assert_eq!(after[0].to_f64().unwrap(), want, "batch {batch}");
        // Nothing of it became a parameter.
        assert!(
            m.graph
                .node_ids()
                .filter(|&n| ir::cost::is_param(&m.graph, ir::Value::new(n, 0)))
                .all(|n| { m.graph.value_name(ir::Value::new(n, 0)) == "pos" })
        );
    }
}

/// A causal mask the exporter folded into external data ([1,1,4,4]: 0 on and below the
/// diagonal, -1e9 above), added to the scores of a sequence of 4; the sequence becomes 2.
const EXTERNAL_MASK: &str = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[1,1,4,4] scores) => (float[1,1,4,4] y) <float[1,1,4,4] mask = ["location": "mask.bin", "offset": "0", "length": "64"]> {
   y = Add (scores, mask)
}"#;

fn mask_values(n: usize) -> Vec<f32> {
    (0..n * n).map(|k| if k % n > k / n { -1e9 } else { 0.0 }).collect()
}

fn mask_of(g: &ir::Graph) -> ir::eval::Array {
    let add = g.op_nodes().unwrap().into_iter().find(|&n| matches!(g.node(n).op, ir::Op::Add(_))).unwrap();
    let v = g.node(add).input(1).unwrap();
    let ir::Op::Initializer(t) = &g.node(v.node).op else { panic!("the mask is no initializer") };
    ir::eval::Array::from_tensor(t).unwrap()
}

/// External constants that must change with a new dim are read and regenerated (the [2,2]
/// corner of the mask, not the file's first 16 bytes read as [2,2]); without a reader they are
/// refused with advice; with their file absent (values drawn anyway) they change shape, said.
#[test]
fn external_constants_are_read_before_they_change_shape() {
    let dir = std::env::temp_dir().join(format!("shardc-rebatch-ext-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes: Vec<u8> = mask_values(4).iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join("mask.bin"), &bytes).unwrap();
    let spec = |external: Option<passes::rebatch::ExternalValues>| RebatchSpec {
        input_shapes: vec![("scores".into(), vec![1, 1, 2, 2])],
        external: external.map_or(passes::ExternalData::Refuse, passes::ExternalData::Read),
        ..Default::default()
    };
    let mut m = frontend::parse(EXTERNAL_MASK).unwrap().model;
    rebatch(&mut m.graph, &spec(Some(shardc::exec::external_reader(&dir)))).unwrap();
    let mask = mask_of(&m.graph);
    assert_eq!(mask.shape, vec![1, 1, 2, 2]);
    assert_eq!(mask.to_f64().unwrap(), mask_values(2).iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    // Growing a triangular mask regenerates it from its pattern.
    let mut m = frontend::parse(EXTERNAL_MASK).unwrap().model;
    let grow = RebatchSpec {
        input_shapes: vec![("scores".into(), vec![1, 1, 6, 6])],
        external: passes::ExternalData::Read(shardc::exec::external_reader(&dir)),
        ..Default::default()
    };
    rebatch(&mut m.graph, &grow).unwrap();
    assert_eq!(mask_of(&m.graph).to_f64().unwrap(), mask_values(6).iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    // No reader: refused, naming the constant, with advice.
    let mut m = frontend::parse(EXTERNAL_MASK).unwrap().model;
    let e = rebatch(&mut m.graph, &spec(None)).unwrap_err();
    let msg = &e.errors[0].msg;
    assert!(msg.contains("constant `mask`") && msg.contains("re-export"), "{msg}");
    // The file absent: the shape changes (its values are drawn from the seed at any shape).
    std::fs::remove_file(dir.join("mask.bin")).unwrap();
    let mut m = frontend::parse(EXTERNAL_MASK).unwrap().model;
    let r = rebatch(&mut m.graph, &spec(Some(shardc::exec::external_reader(&dir)))).unwrap();
    assert!(r.notes.iter().any(|n| n.msg.contains("whose file is not there")), "{:?}", r.notes);
    std::fs::remove_dir_all(&dir).ok();
}
