//! Model-local functions (ONNX `FunctionProto`s) are inlined when a model loads: a call with
//! an attribute, one taking the function's default for it, a function calling another, and
//! a call with two outputs, one of them unused; the loaded graph holds only ONNX ops, keeps
//! the call's output names, and computes what the functions say. A function calling itself
//! is refused at the call.

use std::collections::HashMap;

use ir::eval::Array;
use shardc_tests::repo_root;

#[test]
fn calls_of_model_functions_are_inlined_and_compute_the_bodies() {
    let path = repo_root().join("tests/data/functions/calls.onnxtxt");
    let loaded = shardc::load_model(&path).unwrap_or_else(|e| panic!("{}", e.render()));
    let g = &loaded.model.graph;
    let ops: Vec<String> = g.op_nodes().unwrap().iter().map(|&n| g.node(n).op.op_type().to_string()).collect();
    assert!(g.op_nodes().unwrap().iter().all(|&n| !matches!(g.node(n).op, ir::Op::Opaque(_))), "calls left: {ops:?}");
    let names: Vec<&str> = g.outputs().iter().map(|o| g.value_name(o.value)).collect();
    assert_eq!(names, ["y1", "y2", "y3", "y4"]);
    // Four Mul/Constant pairs are not expected: three Scale bodies (two direct, one in Outer).
    assert_eq!(ops.iter().filter(|o| *o == "Mul").count(), 3, "{ops:?}");
    let x: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
    let inputs = HashMap::from([("x".to_string(), Array::f32(vec![2, 3], x.clone()))]);
    let out = ir::eval::run(g, &inputs, &Default::default()).unwrap();
    let expect = [
        x.iter().map(|v| v * 2.0).collect::<Vec<f32>>(),
        x.iter().map(|v| v * 3.0).collect(),
        x.iter().map(|v| -(v * 0.5)).collect(),
        x.iter().map(|v| v.max(0.0)).collect(),
    ];
    for (k, (got, want)) in out.iter().zip(&expect).enumerate() {
        assert_eq!(got.shape, [2, 3], "output {k}");
        let got = got.to_f64().unwrap();
        for (a, b) in got.iter().zip(want) {
            assert!((a - f64::from(*b)).abs() < 1e-6, "output {}: {got:?} vs {want:?}", names[k]);
        }
    }
    // The inlined model checks (shapes and types) like any other.
    shardc::check(&loaded.model).unwrap_or_else(|e| panic!("{:?}", e.errors));
}

#[test]
fn a_function_calling_itself_is_refused_at_the_call() {
    let path = repo_root().join("tests/data/functions/recursive.onnxtxt");
    let Err(e) = shardc::load_model(&path) else { panic!("a recursive function loaded") };
    let text = e.render();
    assert!(text.contains("function `Again` calls itself"), "{text}");
    assert!(text.contains("recursive.onnxtxt:6:"), "not located at the call: {text}");
}
