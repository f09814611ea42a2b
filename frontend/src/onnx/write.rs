//! `ir::Model` → binary ONNX (`ModelProto`): what `shardc parse -o model.onnx` and a lowered
//! program saved as `.onnx` write. Nodes, attributes and value infos go in the order the text
//! printer prints them ([`ir::print`]), so a model written here reads back, and prints, as the
//! same text.

use ir::print::{node_attributes, output_type, print_order, value_infos};
use ir::{AttrValue, Attribute, Dim, Graph, Model, Op, Tensor, TensorData, Type};
use prost::Message;

use super::proto;

/// The model as binary ONNX.
pub fn to_bytes(m: &Model) -> Vec<u8> {
    model(m).encode_to_vec()
}

/// A tensor as a serialized `TensorProto` (the `input_K.pb` files of the ONNX test data),
/// named `name` when given; [`crate::onnx::read_tensor`] reads it back.
pub fn tensor_to_bytes(t: &Tensor, name: Option<&str>) -> Vec<u8> {
    tensor(t, name).encode_to_vec()
}

fn opsets(list: &[(String, i64)]) -> Vec<proto::OperatorSetIdProto> {
    list.iter().map(|(d, v)| proto::OperatorSetIdProto { domain: Some(d.clone()), version: Some(*v) }).collect()
}

fn entries(list: &[(String, String)]) -> Vec<proto::StringStringEntryProto> {
    list.iter().map(|(k, v)| proto::StringStringEntryProto { key: Some(k.clone()), value: Some(v.clone()) }).collect()
}

fn model(m: &Model) -> proto::ModelProto {
    proto::ModelProto {
        ir_version: Some(m.ir_version),
        opset_import: opsets(&m.opset_import),
        producer_name: m.producer_name.clone(),
        producer_version: m.producer_version.clone(),
        domain: m.domain.clone(),
        model_version: m.model_version,
        doc_string: m.doc_string.clone(),
        graph: Some(graph(&m.graph)),
        metadata_props: m.metadata_props.as_deref().map(entries).unwrap_or_default(),
        functions: m.functions.iter().map(function).collect(),
        ..Default::default()
    }
}

fn shape(dims: &[Dim]) -> proto::TensorShapeProto {
    use proto::tensor_shape_proto::{Dimension, dimension::Value};
    proto::TensorShapeProto {
        dim: dims
            .iter()
            .map(|d| Dimension {
                denotation: None,
                value: match d {
                    Dim::Fixed(v) => Some(Value::DimValue(*v)),
                    Dim::Sym(s) => Some(Value::DimParam(s.clone())),
                    Dim::Unknown => None,
                },
            })
            .collect(),
    }
}

fn type_proto(t: &Type) -> proto::TypeProto {
    use proto::type_proto::{self as tp, Value};
    let value = match t {
        Type::Tensor(tt) => {
            Value::TensorType(tp::Tensor { elem_type: Some(tt.dtype as i32), shape: tt.dims.as_deref().map(shape) })
        }
        Type::SparseTensor(tt) => Value::SparseTensorType(tp::SparseTensor {
            elem_type: Some(tt.dtype as i32),
            shape: tt.dims.as_deref().map(shape),
        }),
        Type::Seq(inner) => {
            Value::SequenceType(Box::new(tp::Sequence { elem_type: Some(Box::new(type_proto(inner))) }))
        }
        Type::Optional(inner) => {
            Value::OptionalType(Box::new(tp::Optional { elem_type: Some(Box::new(type_proto(inner))) }))
        }
        Type::Map(key, inner) => Value::MapType(Box::new(tp::Map {
            key_type: Some(*key as i32),
            value_type: Some(Box::new(type_proto(inner))),
        })),
        Type::Opaque { domain, name } => {
            Value::OpaqueType(tp::Opaque { domain: Some(domain.clone()), name: Some(name.clone()) })
        }
    };
    proto::TypeProto { denotation: None, value: Some(value) }
}

fn value_info(name: &str, ty: Option<&Type>) -> proto::ValueInfoProto {
    proto::ValueInfoProto { name: Some(name.to_string()), r#type: ty.map(type_proto), ..Default::default() }
}

fn tensor(t: &Tensor, name: Option<&str>) -> proto::TensorProto {
    // A fill is shardc's own description; ONNX files hold its values.
    if let Some(a) = t.fill().ok().flatten().and_then(|_| ir::eval::Array::materialized(t).ok()) {
        let mut inline = a.to_tensor();
        inline.name = t.name.clone();
        return tensor(&inline, name);
    }
    let mut p = proto::TensorProto {
        dims: t.dims.clone(),
        data_type: Some(t.dtype as i32),
        name: name.or(t.name.as_deref()).map(str::to_string),
        ..Default::default()
    };
    match &t.data {
        TensorData::Int32(v) => p.int32_data = v.clone(),
        TensorData::Int64(v) => p.int64_data = v.clone(),
        TensorData::Uint64(v) => p.uint64_data = v.clone(),
        TensorData::Float(v) => p.float_data = v.clone(),
        TensorData::Double(v) => p.double_data = v.clone(),
        TensorData::Strings(v) => p.string_data = v.iter().map(|s| s.as_bytes().to_vec()).collect(),
        TensorData::External(e) => {
            p.external_data = entries(e);
            p.data_location = Some(proto::tensor_proto::DataLocation::External as i32);
        }
    }
    p
}

fn attribute(a: &Attribute) -> proto::AttributeProto {
    use proto::attribute_proto::AttributeType as T;
    let mut p = proto::AttributeProto { name: Some(a.name.clone()), ..Default::default() };
    let kind = match &a.value {
        AttrValue::Int(i) => {
            p.i = Some(*i);
            T::Int
        }
        AttrValue::Float(f) => {
            p.f = Some(*f);
            T::Float
        }
        AttrValue::String(s) => {
            p.s = Some(s.as_bytes().to_vec());
            T::String
        }
        AttrValue::Tensor(t) => {
            p.t = Some(tensor(t, None));
            T::Tensor
        }
        AttrValue::Graph(g) => {
            p.g = Some(graph(g));
            T::Graph
        }
        AttrValue::TypeProto(t) => {
            p.tp = Some(type_proto(t));
            T::TypeProto
        }
        AttrValue::Ints(v) => {
            p.ints = v.clone();
            T::Ints
        }
        AttrValue::Floats(v) => {
            p.floats = v.clone();
            T::Floats
        }
        AttrValue::Strings(v) => {
            p.strings = v.iter().map(|s| s.as_bytes().to_vec()).collect();
            T::Strings
        }
        AttrValue::Tensors(v) => {
            p.tensors = v.iter().map(|t| tensor(t, None)).collect();
            T::Tensors
        }
        AttrValue::Graphs(v) => {
            p.graphs = v.iter().map(graph).collect();
            T::Graphs
        }
        AttrValue::TypeProtos(v) => {
            p.type_protos = v.iter().map(type_proto).collect();
            T::TypeProtos
        }
        AttrValue::Ref(kind, name) => {
            p.ref_attr_name = Some(name.clone());
            kind_code(*kind)
        }
    };
    p.r#type = Some(kind as i32);
    p
}

/// The `AttributeType` of a kind.
fn kind_code(k: ir::AttrKind) -> proto::attribute_proto::AttributeType {
    use ir::AttrKind as K;
    use proto::attribute_proto::AttributeType as T;
    match k {
        K::Int => T::Int,
        K::Float => T::Float,
        K::String => T::String,
        K::Tensor => T::Tensor,
        K::Graph => T::Graph,
        K::SparseTensor => T::SparseTensor,
        K::TypeProto => T::TypeProto,
        K::Ints => T::Ints,
        K::Floats => T::Floats,
        K::Strings => T::Strings,
        K::Tensors => T::Tensors,
        K::Graphs => T::Graphs,
        K::SparseTensors => T::SparseTensors,
        K::TypeProtos => T::TypeProtos,
    }
}

fn node(g: &Graph, n: ir::NodeId) -> proto::NodeProto {
    let node = g.node(n);
    let overload = match &node.op {
        Op::Opaque(o) if !o.overload.is_empty() => Some(o.overload.clone()),
        _ => None,
    };
    let domain = node.op.domain();
    proto::NodeProto {
        input: node.inputs().iter().map(|i| i.map_or(String::new(), |v| g.value_name(v).to_string())).collect(),
        output: node.outputs().iter().map(|o| o.name.clone()).collect(),
        name: node.label.clone(),
        op_type: Some(node.op.op_type().to_string()),
        domain: (!domain.is_empty()).then(|| domain.to_string()),
        overload,
        attribute: node_attributes(g, n).iter().filter(|a| a.name != ir::scope::MODULE).map(attribute).collect(),
        // The module a node came from is metadata, as the exporters write it (an attribute
        // the op does not define would fail other readers' checks).
        metadata_props: node
            .annotations
            .iter()
            .filter(|(k, _)| k == ir::scope::MODULE)
            .map(|(k, v)| proto::StringStringEntryProto { key: Some(k.clone()), value: Some(v.clone()) })
            .collect(),
        ..Default::default()
    }
}

fn graph(g: &Graph) -> proto::GraphProto {
    let mut p = proto::GraphProto { name: Some(g.name.clone()), ..Default::default() };
    for &n in g.inputs() {
        let o = &g.node(n).outputs()[0];
        p.input.push(value_info(&o.name, o.ty.as_ref()));
    }
    for o in g.outputs() {
        p.output.push(value_info(g.value_name(o.value), output_type(g, o)));
    }
    for &n in g.initializers() {
        let node = g.node(n);
        let t = match &node.op {
            Op::Initializer(t) | Op::Input { default: Some(t) } => t,
            _ => continue,
        };
        p.initializer.push(tensor(t, Some(&node.outputs()[0].name)));
    }
    p.value_info = value_infos(g).into_iter().map(|(ty, name)| value_info(name, ty)).collect();
    for n in print_order(g) {
        if matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef) {
            continue;
        }
        p.node.push(node(g, n));
    }
    p
}

fn function(f: &ir::Function) -> proto::FunctionProto {
    let b = &f.body;
    proto::FunctionProto {
        name: Some(b.name.clone()),
        input: b.inputs().iter().map(|&n| b.node(n).outputs()[0].name.clone()).collect(),
        output: b.outputs().iter().map(|o| b.value_name(o.value).to_string()).collect(),
        attribute: f.attr_params.clone(),
        attribute_proto: f.attr_defaults.iter().map(attribute).collect(),
        node: print_order(b)
            .into_iter()
            .filter(|&n| !matches!(b.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef))
            .map(|n| node(b, n))
            .collect(),
        doc_string: f.doc_string.clone(),
        opset_import: opsets(&f.opset_import),
        domain: Some(f.domain.clone()),
        overload: (!f.overload.is_empty()).then(|| f.overload.clone()),
        value_info: value_infos(b).into_iter().map(|(ty, name)| value_info(name, ty)).collect(),
        ..Default::default()
    }
}
