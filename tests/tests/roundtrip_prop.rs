//! Random graphs built through the API print, parse and print again to the same text, with
//! the same structure.

use ir::{AttrValue, Attribute, DType, Dim, Graph, Model, Op, Output, Tensor, TensorData, TensorType, Type, Value, op};
use proptest::prelude::*;

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z_][a-z0-9_]{0,6}",
        "[a-z/._:-]{1,8}",
        Just("with \"quote\"".to_string()),
        Just("back\\slash".to_string()),
        Just("ünïcode".to_string()),
    ]
}

fn float() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<f32>(),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(-0.0f32),
        Just(1e-45f32),
        -1e6f32..1e6f32,
    ]
}

fn dim() -> impl Strategy<Value = Dim> {
    prop_oneof![4 => (1i64..6).prop_map(Dim::Fixed), 1 => Just(Dim::Sym("N".into())), 1 => Just(Dim::Sym("a.b".into())), 1 => Just(Dim::Unknown)]
}

fn tensor_type() -> impl Strategy<Value = TensorType> {
    (
        prop::sample::select(vec![DType::Float, DType::Int64, DType::Bool, DType::Double]),
        prop::collection::vec(dim(), 0..4),
    )
        .prop_map(|(d, dims)| TensorType::new(d, dims))
}

fn tensor() -> impl Strategy<Value = Tensor> {
    let dims = prop::collection::vec(0i64..4, 0..3);
    (dims, 0u8..7).prop_flat_map(|(dims, kind)| {
        let n: usize = dims.iter().map(|&d| d as usize).product();
        let dims2 = dims.clone();
        match kind {
            0 => prop::collection::vec(float(), n).prop_map(move |v| Tensor::from_f32(dims2.clone(), v)).boxed(),
            1 => prop::collection::vec(any::<i64>(), n).prop_map(move |v| Tensor::from_i64(dims2.clone(), v)).boxed(),
            2 => prop::collection::vec(any::<bool>(), n)
                .prop_map(move |v| Tensor {
                    dtype: DType::Bool,
                    dims: dims2.clone(),
                    name: None,
                    data: TensorData::Int32(v.into_iter().map(i32::from).collect()),
                })
                .boxed(),
            3 => prop::collection::vec(any::<f64>(), n)
                .prop_map(move |v| Tensor {
                    dtype: DType::Double,
                    dims: dims2.clone(),
                    name: None,
                    data: TensorData::Double(v),
                })
                .boxed(),
            4 => prop::collection::vec(0i32..65536, n)
                .prop_map(move |v| Tensor {
                    dtype: DType::Float16,
                    dims: dims2.clone(),
                    name: None,
                    data: TensorData::Int32(v),
                })
                .boxed(),
            5 => prop::collection::vec(name(), n)
                .prop_map(move |v| Tensor {
                    dtype: DType::String,
                    dims: dims2.clone(),
                    name: None,
                    data: TensorData::Strings(v),
                })
                .boxed(),
            _ => Just(Tensor {
                dtype: DType::Float,
                dims: dims.clone(),
                name: None,
                data: TensorData::External(vec![("location".into(), "w.bin".into()), ("offset".into(), "0".into())]),
            })
            .boxed(),
        }
    })
}

fn attr_value() -> impl Strategy<Value = AttrValue> {
    prop_oneof![
        any::<i64>().prop_map(AttrValue::Int),
        float().prop_map(AttrValue::Float),
        name().prop_map(AttrValue::String),
        prop::collection::vec(any::<i64>(), 0..4).prop_map(AttrValue::Ints),
        prop::collection::vec(float(), 0..4).prop_map(AttrValue::Floats),
        prop::collection::vec(name(), 0..3).prop_map(AttrValue::Strings),
        tensor().prop_map(AttrValue::Tensor),
        tensor_type().prop_map(|t| AttrValue::TypeProto(Type::Tensor(t))),
    ]
}

/// One node: an op choice, input picks and attribute material.
#[derive(Clone, Debug)]
struct NodeSpec {
    kind: u8,
    picks: Vec<usize>,
    label: Option<String>,
    alpha: f32,
    perm: Vec<i64>,
    attrs: Vec<(String, AttrValue)>,
    ty: Option<TensorType>,
}

fn node_spec() -> impl Strategy<Value = NodeSpec> {
    (
        0u8..7,
        prop::collection::vec(any::<usize>(), 3),
        prop::option::of(name()),
        float(),
        prop::collection::vec(-3i64..4, 0..4),
        // Attribute names are unique within a node (a repeated one is rightly a parse error).
        prop::collection::btree_map("[a-z][a-z_]{0,5}", attr_value(), 0..3).prop_map(|m| m.into_iter().collect()),
        prop::option::of(tensor_type()),
    )
        .prop_map(|(kind, picks, label, alpha, perm, attrs, ty)| NodeSpec {
            kind,
            picks,
            label,
            alpha,
            perm,
            attrs,
            ty,
        })
}

fn build(
    inputs: Vec<(String, Option<TensorType>)>,
    inits: Vec<(String, Tensor)>,
    nodes: Vec<NodeSpec>,
    outs: Vec<usize>,
) -> Model {
    let mut g = Graph::new("random graph");
    let mut values: Vec<Value> = Vec::new();
    let mut used = std::collections::HashSet::new();
    let fresh = |base: &str, used: &mut std::collections::HashSet<String>| {
        let mut n = base.to_string();
        let mut k = 0;
        while !used.insert(n.clone()) {
            k += 1;
            n = format!("{base}_{k}");
        }
        n
    };
    for (n, t) in inputs {
        let n = fresh(&n, &mut used);
        values.push(g.add_input(n, t.map(Type::Tensor)));
    }
    for (n, t) in inits {
        let n = fresh(&n, &mut used);
        values.push(g.add_initializer(n, t));
    }
    for (i, spec) in nodes.into_iter().enumerate() {
        let pick = |k: usize| values[spec.picks[k] % values.len()];
        let (op, inputs): (Op, Vec<Option<Value>>) = match spec.kind {
            0 => (Op::Relu(op::Relu::default()), vec![Some(pick(0))]),
            1 => (Op::Add(op::Add::default()), vec![Some(pick(0)), Some(pick(1))]),
            2 => (Op::LeakyRelu(op::LeakyRelu { alpha: Some(spec.alpha) }), vec![Some(pick(0))]),
            3 => (Op::Transpose(op::Transpose { perm: Some(spec.perm.clone()) }), vec![Some(pick(0))]),
            4 => (Op::Clip(op::Clip::default()), vec![Some(pick(0)), None, Some(pick(2))]),
            5 => (
                Op::Opaque(ir::Opaque {
                    domain: "com.example".into(),
                    op_type: "Custom".into(),
                    overload: String::new(),
                    attrs: spec.attrs.iter().map(|(k, v)| Attribute::new(k.clone(), v.clone())).collect(),
                }),
                vec![Some(pick(0)), Some(pick(1))],
            ),
            _ => (
                Op::Conv(op::Conv { pads: Some(vec![1, 1, 1, 1]), group: Some(1), ..Default::default() }),
                vec![Some(pick(0)), Some(pick(1)), None],
            ),
        };
        let out = fresh(&format!("v{i}"), &mut used);
        let id = g.add_labeled_node(
            spec.label.clone(),
            op,
            inputs,
            vec![Output { name: out, ty: spec.ty.clone().map(Type::Tensor) }],
        );
        values.push(Value::new(id, 0));
    }
    let mut seen = std::collections::HashSet::new();
    for o in outs {
        let v = values[o % values.len()];
        if seen.insert(v) {
            g.add_output(v, None);
        }
    }
    Model::new(g, 17)
}

proptest! {
    #![proptest_config(shardc_tests::proptest_config(256))]

    #[test]
    fn random_graphs_print_and_parse_back(
        inputs in prop::collection::vec((name(), prop::option::of(tensor_type())), 1..4),
        inits in prop::collection::vec((name(), tensor()), 0..4),
        nodes in prop::collection::vec(node_spec(), 1..8),
        outs in prop::collection::vec(any::<usize>(), 1..3),
    ) {
        let model = build(inputs, inits, nodes, outs);
        let text = ir::print::model_to_string(&model);
        let parsed = frontend::parse(&text).map_err(|d| TestCaseError::fail(frontend::render(&d, "generated", &text)))?;
        let again = ir::print::model_to_string(&parsed.model);
        prop_assert_eq!(&again, &text);
        prop_assert_eq!(parsed.model.graph.op_count(), model.graph.op_count());
        prop_assert_eq!(parsed.model.graph.initializers().len(), model.graph.initializers().len());
        prop_assert_eq!(parsed.model.graph.outputs().len(), model.graph.outputs().len());
        prop_assert_eq!(parsed.model.graph.difference(&model.graph), None, "{}", text);
    }
}
