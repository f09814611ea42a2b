//! `canonicalize` keeps every model's outputs, their types, and (on golden cases) their values.

use shardc_tests::*;

fn canonicalize(model: &mut ir::Model) -> passes::Report {
    let mut pm = passes::PassManager::new().with_verify(true);
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize);
    pm.run(model).unwrap_or_else(|e| panic!("{e}: {:?}", e.errors))
}

#[test]
fn canonicalize_keeps_output_names_and_types() {
    for path in data_files("models").into_iter().chain(data_files("golden")) {
        let mut model = load_model(&path);
        ir::infer::infer_shapes(&mut model.graph, ir::infer::Mode::Check).unwrap();
        let before: Vec<(String, Option<ir::Type>)> =
            model.graph.outputs().iter().map(|o| (model.graph.value_name(o.value).to_string(), o.ty.clone())).collect();
        let n_before = model.graph.op_count();
        canonicalize(&mut model);
        let after: Vec<(String, Option<ir::Type>)> =
            model.graph.outputs().iter().map(|o| (model.graph.value_name(o.value).to_string(), o.ty.clone())).collect();
        assert_eq!(before, after, "{}", path.display());
        assert!(model.graph.op_count() <= n_before, "{}", path.display());
        // Identities stay only where they rename one graph output to another.
        let g = &model.graph;
        for n in g.node_ids() {
            match &g.node(n).op {
                ir::Op::Constant(_) => panic!("{}: a Constant survived", path.display()),
                ir::Op::Identity(_) => {
                    assert!(g.outputs().iter().any(|o| o.value.node == n), "{}: an Identity survived", path.display())
                }
                _ => {}
            }
        }
        // The canonical form prints and parses back.
        let text = ir::print::model_to_string(&model);
        let again = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "canon", &text)));
        assert_eq!(ir::print::model_to_string(&again.model), text);
    }
}

#[test]
fn canonicalize_keeps_golden_values() {
    for path in data_files("golden") {
        let mut model = load_model(&path);
        let io = load_io(&path);
        let before = ir::eval::run(&model.graph, &io.inputs, &Default::default()).unwrap();
        canonicalize(&mut model);
        let after = ir::eval::run(&model.graph, &io.inputs, &Default::default()).unwrap();
        for (k, (a, b)) in after.iter().zip(&before).enumerate() {
            compare(&format!("{} output {k}", path.display()), a, b, 0.0, 0.0).unwrap();
        }
    }
}

#[test]
fn shape_subgraphs_fold_away() {
    // hf_bert_base builds its attention mask shape with Shape/Gather/Concat/ConstantOfShape.
    let path = data_files("models").into_iter().find(|p| p.ends_with("hf_bert_base.onnxtxt")).unwrap();
    let mut model = load_model(&path);
    let report = canonicalize(&mut model);
    assert!(report.stats.get("nodes folded") > 0);
    assert!(!model.graph.node_ids().any(|n| matches!(model.graph.node(n).op, ir::Op::Shape(_))));
}

/// A `Constant` made an initializer, and a value folded from constants, stay constants, and so
/// does an initializer holding `-inf` (a mask no step can train): the cost model prices no
/// gradient or update for them (`train`, which does not canonicalize, never trains a
/// `Constant` and freezes such buffers itself); the model's own initializers stay parameters.
#[test]
fn constants_made_initializers_are_not_parameters() {
    let text = r#"<
 ir_version: 8,
 opset_import: ["" : 17]
>
g (float[2,3] x) => (float[2,3] y)
<float[3] w = {1, 2, 3}, float[3] mask = {0, -inf, 0}>
{
  c = Constant <value: tensor = float[3] {0.5, 0.25, 2}> ()
  d = Mul (c, c)
  a = Mul (x, w)
  b = Add (a, c)
  e = Mul (b, d)
  y = Add (e, mask)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    canonicalize(&mut m);
    let params = |g: &ir::Graph| -> Vec<String> {
        let mut p: Vec<String> = g
            .initializers()
            .iter()
            .map(|&n| ir::Value::new(n, 0))
            .filter(|&v| ir::cost::is_param(g, v))
            .map(|v| g.value_name(v).to_string())
            .collect();
        p.sort();
        p
    };
    assert_eq!(params(&m.graph), vec!["w".to_string()]);
    assert_eq!(m.graph.initializers().len(), 4, "w, the mask, c and the folded c·c");
}

/// What is computed from a parameter is not folded: a class token expanded to the batch and a
/// bias reshaped for broadcasting keep their nodes, so the parameters keep their gradients.
#[test]
fn values_computed_from_parameters_are_not_folded() {
    let text = r#"<
 ir_version: 8,
 opset_import: ["" : 17]
>
g (float[2,3,4] x) => (float[2,4,4] y)
<float[1,1,4] cls = {1, 2, 3, 4}, float[4] b = {0.5, 0.25, 2, 1}, int64[3] shape = {2, 1, 1}, int64[3] bshape = {1, 1, 4}>
{
  e = Expand (cls, shape)
  c = Concat <axis: int = 1> (e, x)
  r = Reshape (b, bshape)
  y = Add (c, r)
}
"#;
    let mut m = frontend::parse(text).unwrap_or_else(|e| panic!("{e:?}")).model;
    canonicalize(&mut m);
    let ops: Vec<String> = m.graph.node_ids().map(|n| m.graph.node(n).op.op_type().to_string()).collect();
    for op in ["Expand", "Reshape", "Concat", "Add"] {
        assert!(ops.iter().any(|o| o == op), "{op} folded: {ops:?}");
    }
    let graph = &m.graph;
    let mut params: Vec<&str> = graph
        .initializers()
        .iter()
        .map(|&n| ir::Value::new(n, 0))
        .filter(|&v| ir::cost::is_param(graph, v))
        .map(|v| graph.value_name(v))
        .collect();
    params.sort();
    assert_eq!(params, ["b", "cls"]);
}
