//! `algebra` (un-fused split GEMMs, folded reshape–transpose–reshape detours) on the shared
//! models and golden cases: same outputs, types and values; same parameter count; the
//! rewritten model prints and parses back; and the rewrite is what lets attention run
//! head-parallel in GPT-2. `conv-as-matmul` (pointwise convolutions as batched GEMMs) on the
//! shared CNNs and `fuse-gemms` (GEMMs sharing an input joined) on the transformers: same
//! outputs, and the same training steps.

use shardc::train::Tensors;
use shardc_tests::*;

mod common;

fn canonical(model: &mut ir::Model, algebra: bool) -> passes::Report {
    let mut pm = passes::PassManager::new().with_verify(true);
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize);
    if algebra {
        pm.add(passes::Algebra);
    }
    pm.run(model).unwrap_or_else(|e| panic!("{e}: {:?}", e.errors))
}

/// Elements of the float initializers (the parameters).
fn parameters(g: &ir::Graph) -> i64 {
    g.initializers()
        .iter()
        .filter_map(|&n| match &g.node(n).op {
            ir::Op::Initializer(t) if t.dtype.is_float() => Some(t.dims.iter().product::<i64>()),
            _ => None,
        })
        .sum()
}

#[test]
fn algebra_keeps_outputs_and_parameters_and_round_trips() {
    let mut changed = Vec::new();
    for path in data_files("models").into_iter().chain(data_files("golden")) {
        let mut model = load_model(&path);
        canonical(&mut model, false);
        let outs = |m: &ir::Model| -> Vec<(String, Option<ir::Type>)> {
            m.graph.outputs().iter().map(|o| (m.graph.value_name(o.value).to_string(), o.ty.clone())).collect()
        };
        let (before, params) = (outs(&model), parameters(&model.graph));
        let mut pm = passes::PassManager::new().with_verify(true);
        pm.add(passes::Algebra);
        let report = pm.run(&mut model).unwrap();
        assert_eq!(outs(&model), before, "{}", path.display());
        assert_eq!(parameters(&model.graph), params, "{}: the parameter count changed", path.display());
        if report.timings.iter().any(|t| t.changed == passes::Changed::Yes) {
            changed.push(path.file_name().unwrap().to_string_lossy().to_string());
        }
        let text = ir::print::model_to_string(&model);
        let again = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "algebra", &text)));
        assert_eq!(ir::print::model_to_string(&again.model), text);
    }
    // The two GPT-2 exports fuse Q, K and V into one GEMM, and the tiny GPT golden case into
    // one MatMul and bias Add; nn.Transformer's attention transposes its output projection's
    // rows back to batch-first after the projection; nothing else in the corpus does.
    changed.sort();
    assert_eq!(
        changed,
        ["hf_gpt2_124m.onnxtxt", "hf_gpt2_small4.onnxtxt", "pt_nn_transformer.onnxtxt", "tiny_gpt.onnxtxt"]
    );
}

#[test]
fn algebra_keeps_golden_values() {
    for path in data_files("golden") {
        let mut model = load_model(&path);
        let io = load_io(&path);
        canonical(&mut model, false);
        let before = ir::eval::run(&model.graph, &io.inputs, &Default::default()).unwrap();
        canonical(&mut model, true);
        let after = ir::eval::run(&model.graph, &io.inputs, &Default::default()).unwrap();
        for (k, (a, b)) in after.iter().zip(&before).enumerate() {
            compare(&format!("{} output {k}", path.display()), a, b, 0.0, 0.0).unwrap();
        }
    }
}

/// nn.Transformer (batch-first, 6 + 6 layers) with its weights drawn from a seed: each
/// attention's output projection takes its rows batch-first (`transpose_before_gemm`, 18
/// places) and the model's output equals the original's bit for bit (the same dot products,
/// rows permuted).
#[test]
fn transformer_outputs_are_unchanged_by_moving_transposes_before_gemms() {
    let path = data_files("models").into_iter().find(|p| p.ends_with("pt_nn_transformer.onnxtxt")).unwrap();
    let mut model = load_model(&path);
    canonical(&mut model, false);
    let inputs = float_inputs(&model.graph, "weight", 3);
    let opts = ir::eval::RunOptions { seed: Some(5) };
    let before = ir::eval::run(&model.graph, &inputs, &opts).unwrap();
    let transposes = |g: &ir::Graph| {
        g.op_nodes().unwrap().into_iter().filter(|&n| matches!(g.node(n).op, ir::Op::Transpose(_))).count()
    };
    let mut rewritten = model.clone();
    assert_eq!(passes::algebra::transpose_before_gemm(&mut rewritten.graph).unwrap(), 18);
    ir::infer::infer_shapes(&mut rewritten.graph, ir::infer::Mode::Check).unwrap();
    passes::algebra::compose_transposes(&mut rewritten.graph).unwrap();
    // One transpose kernel fewer per place than composing alone leaves.
    let mut composed = model.clone();
    passes::algebra::compose_transposes(&mut composed.graph).unwrap();
    assert_eq!(transposes(&rewritten.graph) + 18, transposes(&composed.graph));
    let after = ir::eval::run(&rewritten.graph, &inputs, &opts).unwrap();
    compare("output", &after[0], &before[0], 0.0, 0.0).unwrap();
}

/// GPT-2 (4 layers) with its weights drawn from a seed: the rewritten model's logits equal the
/// original's bit for bit (each part is the same dot products in the same order), whether the
/// parts' weights are sliced while external (drawn) or after being made inline.
#[test]
fn gpt2_logits_are_unchanged_by_unfusing_qkv() {
    let path = data_files("models").into_iter().find(|p| p.ends_with("hf_gpt2_small4.onnxtxt")).unwrap();
    let mut model = load_model(&path);
    canonical(&mut model, false);
    let inputs = token_inputs(&model.graph);
    let opts = ir::eval::RunOptions { seed: Some(5) };
    let before = ir::eval::run(&model.graph, &inputs, &opts).unwrap();
    let mut rewritten = model.clone();
    let mut pm = passes::PassManager::new();
    pm.add(passes::Algebra);
    let report = pm.run(&mut rewritten).unwrap();
    assert!(report.timings.iter().any(|t| t.changed == passes::Changed::Yes));
    let after = ir::eval::run(&rewritten.graph, &inputs, &opts).unwrap();
    compare("logits (external weights sliced)", &after[0], &before[0], 0.0, 0.0).unwrap();
}

proptest::proptest! {
    #![proptest_config(proptest_config(6))]
    /// Random sequences of the rewrites (un-fusing, fusing — each the other's inverse —, the
    /// tied output projection's transpose into its GEMM, composing transposes, moving a
    /// transpose before a GEMM's rows, and folding), each on a random subset
    /// of its matches, leave GPT-2's logits bit-identical
    /// (weights drawn from a seed, sliced and joined while external).
    #[test]
    fn random_rewrite_sequences_keep_gpt2_logits(
        rules in proptest::collection::vec(0u8..6, 1..6),
        picks in proptest::collection::vec(proptest::bool::ANY, 64),
    ) {
        let (base, inputs, want) = &*GPT2;
        let mut m = base.clone();
        let mut k = 0usize;
        let mut pick = |_: usize| { k += 1; picks[k % picks.len()] };
        for r in &rules {
            match r {
                0 => { passes::algebra::unfuse_split_gemm_where(&mut m.graph, &mut pick).unwrap(); }
                1 => { passes::algebra::fuse_gemms_where(&mut m.graph, &mut pick).unwrap(); }
                2 => { passes::algebra::transpose_into_gemm_where(&mut m.graph, &mut pick).unwrap(); }
                3 => { passes::algebra::compose_transposes_where(&mut m.graph, &mut pick).unwrap(); }
                4 => { passes::algebra::transpose_before_gemm_where(&mut m.graph, &mut pick).unwrap(); }
                _ => { passes::algebra::fold_reshape_transpose_where(&mut m.graph, &mut pick).unwrap(); }
            }
            ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
            ir::verify(&m.graph).unwrap();
        }
        let got = ir::eval::run(&m.graph, inputs, &ir::eval::RunOptions { seed: Some(5) }).unwrap();
        compare("logits", &got[0], &want[0], 0.0, 0.0).unwrap();
    }
}

/// GPT-2 small4 canonical, its token inputs, and its logits with weights drawn from seed 5.
static GPT2: std::sync::LazyLock<(
    ir::Model,
    std::collections::HashMap<String, ir::eval::Array>,
    Vec<ir::eval::Array>,
)> = std::sync::LazyLock::new(|| {
    let path = data_files("models").into_iter().find(|p| p.ends_with("hf_gpt2_small4.onnxtxt")).unwrap();
    let mut model = load_model(&path);
    canonical(&mut model, false);
    let inputs = token_inputs(&model.graph);
    let want = ir::eval::run(&model.graph, &inputs, &ir::eval::RunOptions { seed: Some(5) }).unwrap();
    (model, inputs, want)
});

/// A shared CNN at batch 2 and 48×48 pixels, canonical.
fn small_cnn(name: &str) -> ir::Model {
    let path = data_files("models").into_iter().find(|p| p.ends_with(name)).unwrap();
    let mut model = load_model(&path);
    let spec = passes::RebatchSpec { input_shapes: vec![("input".into(), vec![2, 3, 48, 48])], ..Default::default() };
    let mut pm = passes::PassManager::new().with_verify(true);
    pm.add(passes::Rebatch { spec }).add(passes::InferShapes::default()).add(passes::Canonicalize);
    pm.run(&mut model).unwrap_or_else(|e| panic!("{e}: {:?}", e.errors));
    model
}

proptest::proptest! {
    #![proptest_config(proptest_config(4))]
    /// `conv-as-matmul` on a random subset of the pointwise convolutions of SqueezeNet and
    /// MobileNetV2 (weights drawn from a seed) keeps their logits (to float rounding: the
    /// GEMM adds the bias after its dot products, the convolution before).
    #[test]
    fn pointwise_convs_as_gemms_keep_cnn_logits(
        model in proptest::sample::select(vec!["tv_squeezenet1_1.onnxtxt", "tv_mobilenet_v2.onnxtxt"]),
        picks in proptest::collection::vec(proptest::bool::ANY, 64),
    ) {
        let (base, inputs, want) = CNNS.iter().find(|c| c.0 == model).map(|c| (&c.1, &c.2, &c.3)).unwrap();
        let mut m = base.clone();
        let mut k = 0usize;
        let mut pick = |_: usize| { k += 1; picks[k % picks.len()] };
        passes::algebra::conv_as_matmul_where(&mut m.graph, &mut pick).unwrap();
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        ir::verify(&m.graph).unwrap();
        let got = ir::eval::run(&m.graph, inputs, &ir::eval::RunOptions { seed: Some(5) }).unwrap();
        compare("logits", &got[0], &want[0], 1e-4, 1e-5).unwrap();
    }
}

/// The CNNs of the property test with their inputs and logits.
#[allow(clippy::type_complexity)]
static CNNS: std::sync::LazyLock<
    Vec<(&'static str, ir::Model, std::collections::HashMap<String, ir::eval::Array>, Vec<ir::eval::Array>)>,
> = std::sync::LazyLock::new(|| {
    ["tv_squeezenet1_1.onnxtxt", "tv_mobilenet_v2.onnxtxt"]
        .into_iter()
        .map(|name| {
            let model = small_cnn(name);
            let x = ir::eval::random_tensor(ir::DType::Float, &[2, 3, 48, 48], "input", 7, "input").unwrap();
            let inputs: std::collections::HashMap<_, _> = [("input".to_string(), x)].into();
            let want = ir::eval::run(&model.graph, &inputs, &ir::eval::RunOptions { seed: Some(5) }).unwrap();
            (name, model, inputs, want)
        })
        .collect()
});

/// Trained on the reference trainer, a network of pointwise convolutions and its rewrite
/// take the same steps: the same losses over three SGD steps, the same gradients (the
/// rewritten weights are the same values in `[M, C]` instead of `[M, C, 1, 1]`).
#[test]
fn pointwise_convs_as_gemms_train_the_same() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,4] x) => (float loss)
   <float[4,3,1,1] w1 = {0.1,-0.2,0.3, 0.4,0.5,-0.6, -0.7,0.8,0.9, 0.15,-0.25,0.35},
    float[4] b1 = {0.05,-0.1,0.2,0.0}, float[2,4,1,1] w2 = {0.3,-0.1,0.2,0.4, -0.5,0.6,0.1,-0.2}>
{
   h = Conv (x, w1, b1)
   r = Relu (h)
   y = Conv (r, w2)
   sq = Mul (y, y)
   loss = ReduceMean <keepdims: int = 0> (sq)
}"#;
    let base = frontend::parse(text).unwrap().model;
    let mut rewritten = base.clone();
    ir::infer::infer_shapes(&mut rewritten.graph, ir::infer::Mode::Check).unwrap();
    assert_eq!(passes::algebra::conv_as_matmul(&mut rewritten.graph).unwrap(), 2);
    let ((g0, p0), (g1, p1)) = train_both(&base, &rewritten);
    for (want, got) in [(&g0, &g1), (&p0, &p1)] {
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
        for (name, w) in want {
            let (a, b) = (got[name].to_f64().unwrap(), w.to_f64().unwrap());
            assert_eq!(a.len(), b.len(), "{name}");
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{name}: {x} vs {y}");
            }
        }
    }
}

/// `fuse-gemms` on the transformers with GEMMs sharing an input (nn.Transformer's and BERT's
/// separate projections, GPT-2's un-fused ones): the rewritten model prints and parses back
/// (the joined weights' descriptions of their parts survive) and, where small enough to
/// evaluate here, computes the original's outputs bit for bit.
#[test]
fn fused_gemms_keep_transformer_outputs_and_round_trip() {
    for (name, evaluate) in
        [("pt_nn_transformer.onnxtxt", true), ("hf_gpt2_small4.onnxtxt", true), ("hf_bert_base.onnxtxt", false)]
    {
        let path = data_files("models").into_iter().find(|p| p.ends_with(name)).unwrap();
        let mut model = load_model(&path);
        canonical(&mut model, true);
        let params = parameters(&model.graph);
        let mut fused = model.clone();
        let n = passes::algebra::fuse_gemms(&mut fused.graph).unwrap();
        ir::infer::infer_shapes(&mut fused.graph, ir::infer::Mode::Check).unwrap();
        ir::verify(&fused.graph).unwrap();
        assert!(n > 0, "{name}: nothing joined");
        assert_eq!(parameters(&fused.graph), params, "{name}: the parameter count changed");
        let text = ir::print::model_to_string(&fused);
        let again = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, name, &text)));
        assert_eq!(ir::print::model_to_string(&again.model), text);
        if evaluate {
            let inputs = if name.starts_with("hf_") {
                token_inputs(&model.graph)
            } else {
                float_inputs(&model.graph, "input", 7)
            };
            let opts = ir::eval::RunOptions { seed: Some(5) };
            let want = ir::eval::run(&model.graph, &inputs, &opts).unwrap();
            let mut reparsed = again.model;
            ir::infer::infer_shapes(&mut reparsed.graph, ir::infer::Mode::Check).unwrap();
            let got = ir::eval::run(&reparsed.graph, &inputs, &opts).unwrap();
            compare(&format!("{name} output"), &got[0], &want[0], 0.0, 0.0).unwrap();
        }
    }
}

/// Trained on the reference trainer, attention-style projections (three GEMMs and bias adds
/// reading one input) and their fused rewrite take the same steps: the same losses over
/// three SGD steps, and the fused weight's and bias's gradients and parameters are the
/// parts' side by side.
#[test]
fn fused_gemms_train_the_same() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4] x) => (float loss)
   <float[4,4] wq = {0.1,-0.2,0.3,0.4, 0.5,-0.6,-0.7,0.8, 0.9,0.15,-0.25,0.35, 0.2,0.1,-0.1,0.3},
    float[4,4] wk = {-0.3,0.2,0.1,0.05, 0.4,-0.1,0.6,-0.2, 0.3,0.3,-0.4,0.1, -0.5,0.2,0.25,0.15},
    float[4,2] wv = {0.3,-0.1, 0.2,0.4, -0.5,0.6, 0.1,-0.2},
    float[4] bq = {0.05,-0.1,0.2,0.0}, float[4] bk = {0.1,0.1,-0.2,0.3}, float[2] bv = {-0.05,0.15}>
{
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   mv = MatMul (x, wv)
   v = Add (bv, mv)
   kt = Transpose <perm: ints = [0, 2, 1]> (k)
   s = MatMul (q, kt)
   p = Softmax <axis: int = -1> (s)
   o = MatMul (p, v)
   sq = Mul (o, o)
   loss = ReduceMean <keepdims: int = 0> (sq)
}"#;
    let base = frontend::parse(text).unwrap().model;
    let mut fused = base.clone();
    ir::infer::infer_shapes(&mut fused.graph, ir::infer::Mode::Check).unwrap();
    assert_eq!(passes::algebra::fuse_gemms(&mut fused.graph).unwrap(), 1);
    ir::infer::infer_shapes(&mut fused.graph, ir::infer::Mode::Check).unwrap();
    let ((g0, p0), (g1, p1)) = train_both(&base, &fused);
    for (want, got) in [(&g0, &g1), (&p0, &p1)] {
        assert_eq!(got.keys().collect::<Vec<_>>(), ["bq+bk+bv", "wq+wk+wv"]);
        for (joined, parts, axis) in [("wq+wk+wv", ["wq", "wk", "wv"], 1), ("bq+bk+bv", ["bq", "bk", "bv"], 0)] {
            let sides: Vec<&ir::eval::Array> = parts.iter().map(|p| &want[*p]).collect();
            let expected = ir::eval::Array::concat_axis(&sides, axis);
            compare(joined, &got[joined], &expected, 1e-6, 1e-7).unwrap();
        }
    }
}

/// A joined weight whose parts' files are there reads each part from its file (and draws the
/// part whose file is not), so the fused model loads the values the original loads.
#[test]
fn joined_weights_load_their_parts_from_files() {
    let dir = std::env::temp_dir().join(format!("shardc-joined-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let values: Vec<f32> = (0..40).map(|i| i as f32 * 0.25 - 3.0).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.join("w.bin"), &bytes).unwrap();
    // `wv` and `bv` name a file that is not there: drawn from the seed.
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,4] x) => (float[2,4] q, float[2,4] k, float[2,2] v)
   <float[4,4] wq = ["location": "w.bin", "offset": "0", "length": "64"], float[4,4] wk = ["location": "w.bin", "offset": "64", "length": "64"],
    float[4,2] wv = ["location": "absent.bin", "offset": "0", "length": "32"],
    float[4] bq = ["location": "w.bin", "offset": "128", "length": "16"], float[4] bk = ["location": "w.bin", "offset": "144", "length": "16"],
    float[2] bv = ["location": "absent.bin", "offset": "32", "length": "8"]>
{
   mq = MatMul (x, wq)
   q = Add (mq, bq)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   mv = MatMul (x, wv)
   v = Add (mv, bv)
}"#;
    let mut original = frontend::parse(text).unwrap().model;
    ir::infer::infer_shapes(&mut original.graph, ir::infer::Mode::Check).unwrap();
    let mut fused = original.clone();
    assert_eq!(passes::algebra::fuse_gemms(&mut fused.graph).unwrap(), 1);
    ir::infer::infer_shapes(&mut fused.graph, ir::infer::Mode::Check).unwrap();
    let w0 = shardc::exec::materialize(&mut original, &dir, 3).unwrap();
    let w1 = shardc::exec::materialize(&mut fused, &dir, 3).unwrap();
    assert_eq!((w0.loaded, w0.seeded), (4, 2));
    assert_eq!((w1.loaded, w1.seeded), (2, 0), "each joined tensor has a part read from its file");
    let x = ir::eval::random_tensor(ir::DType::Float, &[2, 4], "input", 1, "x").unwrap();
    let inputs: std::collections::HashMap<_, _> = [("x".to_string(), x)].into();
    let want = ir::eval::run(&original.graph, &inputs, &Default::default()).unwrap();
    let got = ir::eval::run(&fused.graph, &inputs, &Default::default()).unwrap();
    for (k, (a, b)) in got.iter().zip(&want).enumerate() {
        compare(&format!("output {k}"), a, b, 0.0, 0.0).unwrap();
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Gradients and parameters of 3 SGD steps of `base` and of `rewritten` on the reference
/// trainer (inputs drawn from one seed), after checking they take the same losses.
fn train_both(base: &ir::Model, rewritten: &ir::Model) -> ((Tensors, Tensors), (Tensors, Tensors)) {
    let loss = passes::autodiff::LossSpec::Model;
    let (l0, g0, p0) = common::sgd_steps(base, &loss);
    let (l1, g1, p1) = common::sgd_steps(rewritten, &loss);
    for (a, b) in l1.iter().zip(&l0) {
        assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "loss {a} vs {b}");
    }
    ((g0, p0), (g1, p1))
}
