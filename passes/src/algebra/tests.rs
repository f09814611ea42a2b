use std::collections::HashMap;

use ir::eval::{Array, RunOptions};

use super::*;
use crate::manager::PassManager;

fn model(text: &str) -> ir::Model {
    let mut m = frontend::parse(text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "t", text))).model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    m
}

fn ops(g: &Graph) -> Vec<String> {
    g.topo_order()
        .unwrap()
        .into_iter()
        .filter(|&n| !matches!(g.node(n).op, Op::Initializer(_) | Op::Input { .. }))
        .map(|n| g.node(n).op.op_type().to_string())
        .collect()
}

/// Random float inputs for every graph input (fixed seed).
fn inputs(g: &Graph) -> HashMap<String, Array> {
    g.input_values()
        .into_iter()
        .map(|v| {
            let dims = g.tensor_type(v).unwrap().static_dims().unwrap();
            let name = g.value_name(v).to_string();
            (name.clone(), ir::eval::random_tensor(ir::DType::Float, &dims, "weight", 3, &name).unwrap())
        })
        .collect()
}

/// Runs the pass; checks the rewritten graph evaluates equal to the original (bit for bit:
/// each part computes the same dot products in the same order). Returns the op types after.
fn rewrite_equal(text: &str) -> Vec<String> {
    let mut m = model(text);
    let before = m.graph.clone();
    let mut pm = PassManager::new();
    pm.add(Algebra);
    pm.run(&mut m).unwrap();
    let opts = RunOptions { seed: Some(11) };
    let x = inputs(&before);
    let want = ir::eval::run(&before, &x, &opts).unwrap();
    let got = ir::eval::run(&m.graph, &x, &opts).unwrap();
    assert_eq!(want, got, "the rewritten graph computes something else");
    ops(&m.graph)
}

const QKV: &str = r#"<ir_version: 8, opset_import: ["" : 18]>
qkv (float[2,4,6] x) => (float[2,4,3] q, float[2,4,3] k, float[2,4,3] v)
   <float[6,9] w = ["location": "w.bin", "offset": "0", "length": "216"], float[9] c = ["location": "w.bin", "offset": "216", "length": "36"],
int64[2] flat = {8, 6}, int64[3] back = {2, 4, 9}>
{
   x2 = Reshape (x, flat)
   y = Gemm (x2, w, c)
   y3 = Reshape (y, back)
   q, k, v = Split <axis: int = 2, num_outputs: int = 3> (y3)
}"#;

// Split(X·[W₀|W₁|W₂] + [c₀|c₁|c₂]) = (X·W₀ + c₀, X·W₁ + c₁, X·W₂ + c₂), through a reshape.
#[test]
fn fused_qkv_gemm_becomes_three_gemms() {
    assert_eq!(rewrite_equal(QKV), ["Reshape", "Gemm", "Reshape", "Gemm", "Reshape", "Gemm", "Reshape"]);
    let mut m = model(QKV);
    let (fused, made) = unfuse_split_gemm(&mut m.graph).unwrap();
    assert_eq!((fused, made), (1, 3));
    let g = &m.graph;
    // The parts' weights are the fused weight's columns, named after it; outputs keep names.
    let w1 = g.initializer(g.lookup("w[:,3:6]").unwrap()).unwrap();
    assert_eq!(w1.dims, [6, 3]);
    assert_eq!(
        w1.external_slice().unwrap().unwrap(),
        ir::ExternalSlice { of: "w".into(), full_dims: vec![6, 9], axis: 1, start: 3, end: 6 }
    );
    assert!(g.lookup("w").is_none() && g.lookup("q").is_some());
}

// Split(X·Wᵀ) with W = [W₀; W₁] (transB): the parts are row blocks of W; unequal sizes.
#[test]
fn trans_b_and_unequal_split_sizes() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[5,6] x) => (float[5,2] a, float[5,4] b)
   <float[6,6] w = {0.1,0.2,0.3,0.4,0.5,0.6, 1,2,3,4,5,6, -1,-2,-3,-4,-5,-6, 0.5,0.25,0.125,1,2,4, 7,8,9,1,2,3, 3,1,4,1,5,9},
int64[2] sizes = {2, 4}>
{
   y = Gemm <transB: int = 1> (x, w)
   a, b = Split <axis: int = -1> (y, sizes)
}"#;
    assert_eq!(rewrite_equal(text), ["Gemm", "Gemm"]);
}

// A MatMul of a 3-D activation by a 2-D weight, split on the last axis directly.
#[test]
fn matmul_split_directly() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4] x) => (float[2,3,4] a, float[2,3,4] b)
   <float[4,8] w = ["location": "w.bin", "offset": "0", "length": "128"]>
{
   y = MatMul (x, w)
   a, b = Split <axis: int = 2, num_outputs: int = 2> (y)
}"#;
    assert_eq!(rewrite_equal(text), ["MatMul", "MatMul"]);
}

// Not an identity to rewrite: the fused output is also read whole, or split on another axis.
#[test]
fn shared_or_other_axis_splits_stay_fused() {
    let read_twice = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[4,6] x) => (float[4,3] a, float[4,3] b, float[4,6] y)
   <float[6,6] w = ["location": "w.bin", "offset": "0", "length": "144"]>
{
   y = MatMul (x, w)
   a, b = Split <axis: int = 1, num_outputs: int = 2> (y)
}"#;
    assert_eq!(rewrite_equal(read_twice), ["MatMul", "Split"]);
    let rows = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[4,6] x) => (float[2,6] a, float[2,6] b)
   <float[6,6] w = ["location": "w.bin", "offset": "0", "length": "144"]>
{
   y = MatMul (x, w)
   a, b = Split <axis: int = 0, num_outputs: int = 2> (y)
}"#;
    assert_eq!(rewrite_equal(rows), ["MatMul", "Split"]);
}

// Reshape(Transpose(Reshape(x:[b,h,s,d] → [b·h,s,d]), [0,2,1]) → [b,h,d,s]) = Transpose(x, [0,1,3,2]).
#[test]
fn reshape_transpose_reshape_folds() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[2,3,5,4] y)
   <int64[3] merged = {-1, 4, 5}, int64[4] split = {2, 3, 5, 4}>
{
   m = Reshape (x, merged)
   t = Transpose <perm: ints = [0, 2, 1]> (m)
   y = Reshape (t, split)
}"#;
    assert_eq!(rewrite_equal(text), ["Transpose"]);
    let mut m = model(text);
    assert_eq!(fold_reshape_transpose(&mut m.graph).unwrap(), 1);
    let y = m.graph.outputs()[0].value;
    let Op::Transpose(t) = &m.graph.node(y.node).op else { panic!("expected a transpose") };
    assert_eq!(t.perm.as_deref(), Some(&[0, 1, 3, 2][..]));
}

// A reshape back to other factors ([3,2,…] from a merged 2·3) is not the transpose's inverse.
#[test]
fn reshape_to_other_factors_does_not_fold() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[3,2,5,4] y)
   <int64[3] merged = {6, 4, 5}, int64[4] split = {3, 2, 5, 4}>
{
   m = Reshape (x, merged)
   t = Transpose <perm: ints = [0, 2, 1]> (m)
   y = Reshape (t, split)
}"#;
    assert_eq!(rewrite_equal(text), ["Reshape", "Transpose", "Reshape"]);
}

/// Runs `conv-as-matmul`; checks the rewritten graph evaluates to the original's values
/// (within float rounding: the GEMM adds the bias after the dot products) on random
/// inputs; returns the op types after and the rewrites made.
fn conv_rewrite_equal(text: &str) -> (Vec<String>, u64) {
    rule_equal(text, conv_as_matmul)
}

/// Runs `rule`; checks the rewritten graph evaluates to the original's values within float
/// rounding on random inputs; returns the op types after and the rewrites made.
fn rule_equal(text: &str, rule: fn(&mut Graph) -> Result<u64, Located>) -> (Vec<String>, u64) {
    let mut m = model(text);
    let before = m.graph.clone();
    let made = rule(&mut m.graph).unwrap();
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    ir::verify(&m.graph).unwrap();
    assert_eq!(m.graph.outputs()[0].ty, before.outputs()[0].ty, "the output's type changed");
    let opts = RunOptions { seed: Some(11) };
    let x = inputs(&before);
    let want = ir::eval::run(&before, &x, &opts).unwrap();
    let got = ir::eval::run(&m.graph, &x, &opts).unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.shape, b.shape);
        for (p, q) in a.to_f64().unwrap().iter().zip(b.to_f64().unwrap()) {
            assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
        }
    }
    (ops(&m.graph), made)
}

// X·Transpose(W) = Reshape(Gemm(Reshape(X, [R, K]), W, transB = 1), [.., N]) for a
// parameter W another op also reads (a tied table); a 2-D X needs no reshapes, and the
// transpose goes once no reader is left. A transpose of a computed value stays.
#[test]
fn a_transposed_parameter_is_read_by_a_gemm() {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4] h, float[6,4] h2) => (float[2,3,5] y, float[6,5] y2, float[5,4] e, float[6,5] y3)
   <float[5,4] w = ["location": "w.bin", "offset": "0", "length": "80"]>
{
   wt = Transpose <perm: ints = [1, 0]> (w)
   y = MatMul (h, wt)
   y2 = MatMul (h2, wt)
   e = Relu (w)
   et = Transpose <perm: ints = [1, 0]> (e)
   y3 = MatMul (h2, et)
}"#;
    let (mut ops, made) = rule_equal(text, transpose_into_gemm);
    ops.sort();
    assert_eq!(made, 2);
    assert_eq!(ops, ["Gemm", "Gemm", "MatMul", "Relu", "Reshape", "Reshape", "Transpose"]);
    let mut m = model(text);
    transpose_into_gemm(&mut m.graph).unwrap();
    let g = &m.graph;
    // The GEMMs read the parameter itself, transposed by the op; outputs keep their names.
    let w = g.lookup("w").unwrap();
    let gemms: Vec<NodeId> =
        g.users(w).iter().map(|&(u, _)| u).filter(|&u| matches!(g.node(u).op, Op::Gemm(_))).collect();
    assert_eq!(gemms.len(), 2);
    assert!(gemms.iter().all(|&u| matches!(&g.node(u).op, Op::Gemm(gm) if gm.trans_b() == 1)));
    assert!(g.lookup("wt").is_none() && g.lookup("y").is_some() && g.lookup("y2").is_some());
}

// Transpose(Transpose(x, p), q) = Transpose(x, r), r[j] = p[q[j]]; the identity is x itself.
// An inner transpose another op reads stays; a default perm reverses the dims.
const ROWS: &str = r#"<ir_version: 8, opset_import: ["" : 18]>
rows (float[2,3,4,5] a) => (float[2,4,6] z)
   <float[15,6] w = ["location": "w.bin", "offset": "0", "length": "360"], float[6] c = ["location": "w.bin", "offset": "360", "length": "24"],
int64[2] r = {8, 15}, int64[3] o = {4, 2, 6}>
{
   t = Transpose <perm: ints = [2, 0, 1, 3]> (a)
   x2 = Reshape (t, r)
   y = Gemm (x2, w, c)
   y3 = Reshape (y, o)
   z = Transpose <perm: ints = [1, 0, 2]> (y3)
}"#;

// Transpose(Reshape(Gemm(Reshape(X, [R, K]), W, c), [s, b, N]), [1, 0, 2]) =
// Reshape(Gemm(Reshape(Transpose(X, [1, 0, 2, 3]), [R, K]), W, c), [b, s, N]), and the
// two transposes of X compose into one: heads [b, h, s, d] to rows b·s.
#[test]
fn a_transpose_of_a_gemms_rows_moves_before_it() {
    assert_eq!(rewrite_equal(ROWS), ["Transpose", "Reshape", "Gemm", "Reshape"]);
    let mut m = model(ROWS);
    assert_eq!(transpose_before_gemm(&mut m.graph).unwrap(), 1);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    compose_transposes(&mut m.graph).unwrap();
    let g = &m.graph;
    let t = g.op_nodes().unwrap().into_iter().find(|&n| matches!(g.node(n).op, Op::Transpose(_))).unwrap();
    let Op::Transpose(tp) = &g.node(t).op else { unreachable!() };
    assert_eq!(tp.perm.as_deref(), Some(&[0, 2, 1, 3][..]));
    // The rows are b·s now, and the GEMM keeps its name.
    assert_eq!(g.tensor_type(g.lookup("x2").unwrap()).unwrap().static_dims().unwrap(), [8, 15]);
    assert!(matches!(g.node(g.lookup("y").unwrap().node).op, Op::Gemm(_)));
}

// Not when the rows are not a transpose's (nothing composes), the outer transpose moves
// the GEMM's columns, or the bias has a value per row.
#[test]
fn transposes_that_gain_nothing_stay_after_the_gemm() {
    let direct = ROWS
        .replace("float[2,3,4,5] a", "float[4,2,3,5] a")
        .replace("t = Transpose <perm: ints = [2, 0, 1, 3]> (a)", "t = Relu (a)");
    assert_eq!(rewrite_equal(&direct), ["Relu", "Reshape", "Gemm", "Reshape", "Transpose"]);
    let columns = ROWS
        .replace("float[2,4,6] z", "float[6,2,4] z")
        .replace("z = Transpose <perm: ints = [1, 0, 2]> (y3)", "z = Transpose <perm: ints = [2, 1, 0]> (y3)");
    assert_eq!(rewrite_equal(&columns), ["Transpose", "Reshape", "Gemm", "Reshape", "Transpose"]);
    // A bias with a value per row ties each row to its place.
    let per_row = ROWS.replace(
        "float[6] c = [\"location\": \"w.bin\", \"offset\": \"360\", \"length\": \"24\"]",
        "float[8,6] c = [\"location\": \"w.bin\", \"offset\": \"360\", \"length\": \"192\"]",
    );
    assert!(per_row.contains("float[8,6] c"));
    assert_eq!(rewrite_equal(&per_row), ["Transpose", "Reshape", "Gemm", "Reshape", "Transpose"]);
}

#[test]
fn transposes_of_transposes_compose() {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4,5] x, float[3,4] m) => (float[2,4,5,3] y, float[5,3,2,4] z, float[2,3,4,5] t2, float[3,4] mm, float[4,3] back)
{
   t1 = Transpose <perm: ints = [0, 2, 1, 3]> (x)
   y = Transpose <perm: ints = [0, 1, 3, 2]> (t1)
   t2 = Transpose <perm: ints = [3, 2, 1, 0]> (x)
   z = Transpose <perm: ints = [0, 2, 3, 1]> (t2)
   mt = Transpose (m)
   mtt = Transpose <perm: ints = [1, 0]> (mt)
   mm = Relu (mtt)
   back = Transpose <perm: ints = [1, 0]> (mm)
}"#;
    let (mut ops, made) = rule_equal(text, compose_transposes);
    ops.sort();
    // y composed; z not (t2 is also an output); m's two transposes are the identity.
    assert_eq!(made, 2);
    assert_eq!(ops, ["Relu", "Transpose", "Transpose", "Transpose", "Transpose"]);
    let mut m = model(text);
    compose_transposes(&mut m.graph).unwrap();
    let g = &m.graph;
    let y = g.lookup("y").unwrap();
    assert!(matches!(&g.node(y.node).op, Op::Transpose(t) if t.perm.as_deref() == Some(&[0, 2, 3, 1][..])));
    assert_eq!(g.node(y.node).input(0), g.lookup("x"));
    let relu = g.lookup("mm").unwrap();
    assert_eq!(g.node(relu.node).input(0), g.lookup("m"));
}

// Conv(X, W, B) = Reshape(Reshape(W, [M,C]) · Reshape(X, [N,C,H·W]) + Reshape(B, [M,1]), [N,M,H,W]).
#[test]
fn pointwise_conv_becomes_a_batched_gemm() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[2,6,4,5] y)
   <float[6,3,1,1] w = ["location": "w.bin", "offset": "0", "length": "72"], float[6] b = ["location": "w.bin", "offset": "72", "length": "24"]>
{
   y = Conv <kernel_shape: ints = [1, 1], strides: ints = [1, 1], pads: ints = [0, 0, 0, 0], dilations: ints = [2, 2]> (x, w, b)
}"#;
    let (mut ops, made) = conv_rewrite_equal(text);
    ops.sort();
    assert_eq!(made, 1);
    // X's columns and the output are reshaped; the weight and bias take their shapes.
    assert_eq!(ops, ["Add", "MatMul", "Reshape", "Reshape"]);
    let mut m = model(text);
    conv_as_matmul(&mut m.graph).unwrap();
    let w = m.graph.initializer(m.graph.lookup("w").unwrap()).unwrap();
    assert_eq!(w.dims, [6, 3]);
    assert_eq!(
        w.external_slice().unwrap().unwrap(),
        ir::ExternalSlice { of: "w".into(), full_dims: vec![6, 3, 1, 1], axis: 0, start: 0, end: 6 }
    );
    assert_eq!(m.graph.initializer(m.graph.lookup("b").unwrap()).unwrap().dims, [6, 1]);
}

// The places of a rule made one by one: two pointwise convolutions, one rewritten.
#[test]
fn pointwise_convs_rewrite_place_by_place() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[2,2,4,5] z)
   <float[6,3,1,1] w = ["location": "w.bin", "offset": "0", "length": "72"], float[2,6,1,1] u = ["location": "w.bin", "offset": "72", "length": "48"]>
{
   [squeeze] y = Conv <kernel_shape: ints = [1, 1]> (x, w)
   [expand] z = Conv <kernel_shape: ints = [1, 1]> (y, u)
}"#;
    let m = model(text);
    assert_eq!(sites(&m.graph, "conv-as-matmul").unwrap(), ["squeeze", "expand"]);
    assert_eq!(sites(&m.graph, "fuse-gemms"), None);
    let mut g = m.graph.clone();
    assert_eq!(apply_named_at(&mut g, "conv-as-matmul", &["expand".into()]), Ok(1));
    let kinds: Vec<(String, String)> = g
        .op_nodes()
        .unwrap()
        .into_iter()
        .filter_map(|n| Some((g.node(n).label.clone()?, g.node(n).op.op_type().to_string())))
        .filter(|(l, _)| !l.contains('/'))
        .collect();
    assert_eq!(kinds, [("squeeze".to_string(), "Conv".to_string()), ("expand".into(), "MatMul".into())]);
    let x = inputs(&m.graph);
    let opts = RunOptions { seed: Some(11) };
    let (want, got) = (ir::eval::run(&m.graph, &x, &opts).unwrap(), ir::eval::run(&g, &x, &opts).unwrap());
    for (p, q) in got[0].to_f64().unwrap().iter().zip(want[0].to_f64().unwrap()) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
    let mut g = m.graph.clone();
    assert!(apply_named_at(&mut g, "conv-as-matmul", &["other".into()]).unwrap_err().contains("`other`"));
}

// The same over a volume, no bias, any batch: Conv3d 1×1×1 of [N,4,2,3,3].
#[test]
fn pointwise_conv3d_without_bias_and_a_symbolic_batch() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[N,4,2,3,3] x) => (float[N,2,2,3,3] y)
   <float[2,4,1,1,1] w = ["location": "w.bin", "offset": "0", "length": "32"]>
{
   y = Conv (x, w)
}"#;
    let mut m = model(text);
    assert_eq!(conv_as_matmul(&mut m.graph).unwrap(), 1);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    assert_eq!(ops(&m.graph), ["Reshape", "MatMul", "Reshape"]);
    // A fixed batch evaluates equal.
    let fixed =
        text.replace("float[N,4,2,3,3] x", "float[3,4,2,3,3] x").replace("float[N,2,2,3,3] y", "float[3,2,2,3,3] y");
    assert_eq!(conv_rewrite_equal(&fixed).1, 1);
}

// Not pointwise: a 3×3 kernel, a stride, padding, groups.
#[test]
fn other_convolutions_stay() {
    for attrs in [
        "kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]",
        "strides: ints = [2, 2]",
        "pads: ints = [1, 1, 1, 1]",
        "group: int = 2",
    ] {
        let w = if attrs.contains("[3, 3]") {
            "float[4,4,3,3] w"
        } else if attrs.contains("group") {
            "float[4,2,1,1] w"
        } else {
            "float[4,4,1,1] w"
        };
        let out = match attrs {
            a if a.contains("strides") => "float[1,4,3,3] y",
            a if a.starts_with("pads") => "float[1,4,8,8] y",
            _ => "float[1,4,6,6] y",
        };
        let text = format!(
            "<ir_version: 8, opset_import: [\"\" : 18]>\ng (float[1,4,6,6] x) => ({out})\n   <{w} = [\"location\": \"w.bin\", \"offset\": \"0\", \"length\": \"576\"]>\n{{\n   y = Conv <{attrs}> (x, w)\n}}"
        );
        assert_eq!(conv_rewrite_equal(&text), (vec!["Conv".to_string()], 0), "{attrs}");
    }
}

const BERT_QKV: &str = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4] x) => (float[2,3,4] q, float[2,3,4] k, float[2,3,2] v)
   <float[4,4] wq = ["location": "w.bin", "offset": "0", "length": "64"], float[4,4] wk = ["location": "w.bin", "offset": "64", "length": "64"],
float[4,2] wv = ["location": "w.bin", "offset": "128", "length": "32"],
float[4] bq = ["location": "w.bin", "offset": "160", "length": "16"], float[4] bk = ["location": "w.bin", "offset": "176", "length": "16"],
float[2] bv = ["location": "w.bin", "offset": "192", "length": "8"]>
{
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   mv = MatMul (x, wv)
   v = Add (bv, mv)
}"#;

const BERT_HEADS: &str = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,8] x) => (float[2,3,2,4] qh, float[2,3,2,4] kh, float[2,3,2,2] vh)
   <float[8,8] wq = ["location": "w.bin", "offset": "0", "length": "256"], float[8,8] wk = ["location": "w.bin", "offset": "256", "length": "256"],
float[8,4] wv = ["location": "w.bin", "offset": "512", "length": "128"],
float[8] bq = ["location": "w.bin", "offset": "640", "length": "32"], float[8] bk = ["location": "w.bin", "offset": "672", "length": "32"],
float[4] bv = ["location": "w.bin", "offset": "704", "length": "16"]>
{
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   sq = Constant <value: tensor = int64[4] {2, 3, 2, 4}> ()
   qh = Reshape (q, sq)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   sk = Constant <value: tensor = int64[4] {2, 3, -1, 4}> ()
   kh = Reshape (k, sk)
   mv = MatMul (x, wv)
   v = Add (bv, mv)
   sv = Constant <value: tensor = int64[4] {0, 0, 2, 2}> ()
   vh = Reshape (v, sv)
}"#;

// Reshape(X·W_j + b_j, [.., H, d_j]) = Split(Reshape(X·W' + b', [.., H, Σd]), last axis)
// where W' (and b') hold the parts' columns head by head.
#[test]
fn gemms_split_into_heads_fuse_head_by_head() {
    assert_eq!(
        rule_equal(BERT_HEADS, fuse_gemms),
        (vec!["MatMul".into(), "Add".into(), "Reshape".into(), "Split".into()], 1)
    );
    let mut m = model(BERT_HEADS);
    fuse_gemms(&mut m.graph).unwrap();
    let g = &m.graph;
    let w =
        g.initializers().iter().map(|&n| Value::new(n, 0)).find(|&v| g.value_name(v).starts_with("wq+wk+wv")).unwrap();
    assert_eq!(g.value_name(w), "wq+wk+wv by heads");
    // Head 0's columns of each part, then head 1's.
    let o = origin(g, w).unwrap();
    let pieces: Vec<String> = o.pieces.iter().map(|p| format!("{}{:?}", p.tensor, p.slice)).collect();
    assert_eq!(
        pieces,
        [
            "wqSome((1, 0, 4))",
            "wkSome((1, 0, 4))",
            "wvSome((1, 0, 2))",
            "wqSome((1, 4, 8))",
            "wkSome((1, 4, 8))",
            "wvSome((1, 2, 4))"
        ]
    );
    // Trained tensors map back to the parts.
    let dims: HashMap<String, Vec<usize>> =
        [("wq", vec![8, 8]), ("wk", vec![8, 8]), ("wv", vec![8, 4]), ("bq", vec![8]), ("bk", vec![8]), ("bv", vec![4])]
            .into_iter()
            .map(|(k, d)| (k.to_string(), d))
            .collect();
    let mut joined = std::collections::BTreeMap::new();
    let a = ir::eval::draw_external(g.initializer(w).unwrap(), "w", "weight", 3).unwrap();
    joined.insert(g.value_name(w).to_string(), a.clone());
    let back = model_tensors(g, &dims, joined.clone());
    assert_eq!(back["wv"].shape, [8, 4]);
    assert_eq!(back["wq"].slice_axis(1, 4, 8), a.slice_axis(1, 10, 14));
}

// X·W_j = Reshape(Split(Reshape(X·W', [.., H, Σd]), last axis)_j, [.., H·d_j]): a part
// whose bias is not the group's own (here one tensor the three share, through
// `Identity`s, as an export that deduplicated equal weights has it) is reshaped back to
// its columns, and its bias add and reshapes into heads stay as they were (the bias read
// as it is, so its gradient is synchronised with the parameter's).
#[test]
fn shared_biases_are_added_to_the_parts_columns() {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,8] x) => (float[2,2,3,4] qt, float[2,3,2,4] kh, float[2,3,2,4] vh)
   <float[8,8] wq = ["location": "w.bin", "offset": "0", "length": "256"], float[8,8] wk = ["location": "w.bin", "offset": "256", "length": "256"],
float[8,8] wv = ["location": "w.bin", "offset": "512", "length": "256"], float[8] b = ["location": "w.bin", "offset": "768", "length": "32"]>
{
   bq = Identity (b)
   bk = Identity (b)
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   s = Constant <value: tensor = int64[4] {2, 3, 2, 4}> ()
   qh = Reshape (q, s)
   qt = Transpose <perm: ints = [0, 2, 1, 3]> (qh)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   kh = Reshape (k, s)
   mv = MatMul (x, wv)
   v = Add (mv, b)
   vh = Reshape (v, s)
}"#;
    let (mut ops, made) = rule_equal(text, fuse_gemms);
    ops.sort();
    assert_eq!(made, 1);
    // One GEMM, its split into heads and parts, each part reshaped back to its columns,
    // its bias added and its own reshape into heads.
    let count = |k: &str| ops.iter().filter(|o| *o == k).count();
    assert_eq!((count("MatMul"), count("Split"), count("Reshape"), count("Add")), (1, 1, 7, 3), "{ops:?}");
}

// (X·Wq + bq, X·Wk + bk, X·Wv + bv) = Split(X·[Wq|Wk|Wv] + [bq|bk|bv]), bias on either side.
#[test]
fn gemms_sharing_an_input_fuse() {
    assert_eq!(rule_equal(BERT_QKV, fuse_gemms), (vec!["MatMul".into(), "Add".into(), "Split".into()], 1));
    let mut m = model(BERT_QKV);
    fuse_gemms(&mut m.graph).unwrap();
    let g = &m.graph;
    // The joined weight describes its parts; outputs keep their names.
    let w = g.initializer(g.lookup("wq+wk+wv").unwrap()).unwrap();
    assert_eq!(w.dims, [4, 10]);
    let c = w.external_concat().unwrap().unwrap();
    assert_eq!(c.axis, 1);
    let parts: Vec<(&str, &[i64])> = c.parts.iter().map(|(n, t)| (n.as_str(), &t.dims[..])).collect();
    assert_eq!(parts, [("wq", &[4, 4][..]), ("wk", &[4, 4][..]), ("wv", &[4, 2][..])]);
    assert_eq!(g.initializer(g.lookup("bq+bk+bv").unwrap()).unwrap().dims, [10]);
    assert!(g.lookup("wq").is_none() && g.lookup("q").is_some());
    // Before opset 13 the sizes are an attribute.
    let old = BERT_QKV.replace("\"\" : 17", "\"\" : 11");
    assert_eq!(rule_equal(&old, fuse_gemms).1, 1);
}

// Gemm(X, W₀, c₀), Gemm(X, W₁, c₁) under transB: the weights join by rows.
#[test]
fn trans_b_gemms_fuse_by_rows_inline() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[3,2] x) => (float[3,2] a, float[3,1] b)
   <float[2,2] w = {1, 2, 3, 4}, float[1,2] u = {5, 6}, float[2] c = {0.5, -1}, float[1] d = {2}>
{
   a = Gemm <transB: int = 1> (x, w, c)
   b = Gemm <transB: int = 1> (x, u, d)
}"#;
    assert_eq!(rule_equal(text, fuse_gemms), (vec!["Gemm".into(), "Split".into()], 1));
    let mut m = model(text);
    fuse_gemms(&mut m.graph).unwrap();
    let w = m.graph.initializer(m.graph.lookup("w+u").unwrap()).unwrap();
    assert_eq!((w.dims.clone(), w.data.clone()), (vec![3, 2], TensorData::Float(vec![1., 2., 3., 4., 5., 6.])));
}

// Fusing undoes un-fusing: GPT-2's split c_attn joins back into the one weight it was.
#[test]
fn fusing_undoes_unfusing() {
    let mut m = model(QKV);
    let original = m.graph.initializer(m.graph.lookup("w").unwrap()).unwrap().clone();
    unfuse_split_gemm(&mut m.graph).unwrap();
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    assert_eq!(fuse_gemms(&mut m.graph).unwrap(), 1);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let g = &m.graph;
    assert_eq!(g.initializer(g.lookup("w").unwrap()).unwrap(), &original);
    assert_eq!(g.initializer(g.lookup("c").unwrap()).unwrap().dims, [9]);
    // And un-fusing a fused weight gives its parts back, named as before.
    let mut m = model(BERT_QKV);
    fuse_gemms(&mut m.graph).unwrap();
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    assert_eq!(unfuse_split_gemm(&mut m.graph).unwrap(), (1, 3));
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let wv = m.graph.initializer(m.graph.lookup("wv").unwrap()).unwrap();
    assert_eq!(wv, &model(BERT_QKV).graph.initializer(model(BERT_QKV).graph.lookup("wv").unwrap()).unwrap().clone());
}

/// The float initializers of `g` as arrays, by name.
fn weights(g: &Graph) -> std::collections::BTreeMap<String, Array> {
    g.initializers()
        .iter()
        .map(|&n| Value::new(n, 0))
        .filter(|&v| g.initializer(v).unwrap().dtype == ir::DType::Float)
        .map(|v| (g.value_name(v).to_string(), Array::from_tensor(g.initializer(v).unwrap()).unwrap()))
        .collect()
}

// Trained tensors go back under the model's names: a split weight's columns join back, a
// joined weight splits into its parts, through any sequence of the rewrites.
#[test]
fn trained_tensors_go_back_under_the_model_names() {
    let list = |n: usize, k: f32| (0..n).map(|i| format!("{}", i as f32 * k - 1.0)).collect::<Vec<_>>().join(", ");
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[3,4] x) => (float[3,2] a, float[3,4] b, float[3,3] d)
   <float[4,6] w = {{{}}}, float[6] c = {{{}}}, int64[2] sizes = {{2, 4}}, float[4,3] u = {{{}}}, float[3] e = {{{}}}>
{{
   y = Gemm (x, w, c)
   a, b = Split <axis: int = -1> (y, sizes)
   d = Gemm (x, u, e)
}}"#,
        list(24, 0.25),
        list(6, 0.5),
        list(12, -0.125),
        list(3, 2.0)
    );
    let mut m = model(&text);
    let want = weights(&m.graph);
    let dims: HashMap<String, Vec<usize>> = want.iter().map(|(k, a)| (k.clone(), a.shape.clone())).collect();
    assert_eq!(unfuse_split_gemm(&mut m.graph).unwrap(), (1, 2));
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let split = weights(&m.graph);
    assert!(split.contains_key("w[:,2:6]") && !split.contains_key("w"));
    assert_eq!(model_tensors(&m.graph, &dims, split.clone()), want);
    // All three GEMMs read `x`: they join, the columns of `w` as one piece.
    assert_eq!(fuse_gemms(&mut m.graph).unwrap(), 1);
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
    let joined = weights(&m.graph);
    let w = m.graph.lookup("u+w[:,0:2]+w[:,2:6]").unwrap();
    assert_eq!(
        origin(&m.graph, w).unwrap(),
        Origin {
            axis: 1,
            pieces: vec![
                Piece { tensor: "u".into(), len: 3, slice: None },
                Piece { tensor: "w".into(), len: 6, slice: Some((1, 0, 6)) }
            ]
        }
    );
    assert_eq!(model_tensors(&m.graph, &dims, joined.clone()), want);
    // Un-fused again: the parts of the joined weight, still the model's columns.
    assert_eq!(unfuse_split_gemm(&mut m.graph).unwrap(), (1, 3));
    assert_eq!(model_tensors(&m.graph, &dims, weights(&m.graph)), want);
    // A tensor of no known origin, or missing a part, keeps its name.
    let mut some = split.clone();
    some.remove("w[:,0:2]");
    some.insert("other".into(), want["u"].clone());
    let back = model_tensors(&model_after_unfuse(&text), &dims, some.clone());
    assert!(back.contains_key("w[:,2:6]") && back.contains_key("other") && !back.contains_key("w"));
    assert_eq!(back["c"], want["c"]);
}

fn model_after_unfuse(text: &str) -> Graph {
    let mut m = model(text);
    unfuse_split_gemm(&mut m.graph).unwrap();
    m.graph
}

// Not joined: a lone GEMM, a weight read twice, biases on some parts only, another kind.
#[test]
fn gemms_that_do_not_fuse() {
    let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[3,2] x) => (float[3,2] a, float[3,2] b, float[3,2] c, float[3,2] d)
   <float[2,2] w = {1, 2, 3, 4}, float[2,2] u = {5, 6, 7, 8}, float[2] e = {1, 1}, float[2,2] t = {1, 0, 0, 1}>
{
   a = MatMul (x, w)
   b = MatMul (x, w)
   m = MatMul (x, u)
   c = Add (m, e)
   d = Gemm <transB: int = 1> (x, t)
}"#;
    assert_eq!(rule_equal(text, fuse_gemms).1, 0);
}

#[test]
fn merge_groups_of_shapes() {
    assert_eq!(merge_groups(&[2, 3, 4, 5], &[6, 4, 5]), Some(vec![0..2, 2..3, 3..4]));
    assert_eq!(merge_groups(&[1, 12, 128, 64], &[12, 128, 64]), Some(vec![0..2, 2..3, 3..4]));
    assert_eq!(merge_groups(&[2, 3, 4], &[3, 2, 4]), None);
    assert_eq!(merge_groups(&[2, 3], &[6, 1]), None);
}
