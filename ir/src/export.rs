//! Other views of a graph: JSON (for tools) and Graphviz DOT (for people).

use serde_json::{Value as Json, json};

use crate::graph::attr::AttrValue;
use crate::graph::op::Op;
use crate::graph::{Graph, Model, Value};
use crate::tensor::{Tensor, TensorData};
use crate::types::Type;

/// Inline tensors up to this many elements are written out in JSON; larger ones only by size.
pub const JSON_DATA_LIMIT: u64 = 4096;

fn ty(t: Option<&Type>) -> Json {
    t.map_or(Json::Null, |t| Json::String(t.to_string()))
}

fn tensor_json(t: &Tensor) -> Json {
    let mut o = json!({ "type": t.tensor_type().to_string(), "elements": t.numel() });
    match &t.data {
        TensorData::External(entries) => {
            o["external"] = entries
                .iter()
                .map(|(k, v)| (k.clone(), Json::String(v.clone())))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        d if t.numel() <= JSON_DATA_LIMIT => {
            o["data"] = match d {
                TensorData::Int32(v) => json!(v),
                TensorData::Int64(v) => json!(v),
                TensorData::Uint64(v) => json!(v),
                TensorData::Float(v) => {
                    v.iter().map(|&x| if x.is_finite() { json!(x) } else { json!(x.to_string()) }).collect()
                }
                TensorData::Double(v) => {
                    v.iter().map(|&x| if x.is_finite() { json!(x) } else { json!(x.to_string()) }).collect()
                }
                TensorData::Strings(v) => json!(v),
                TensorData::External(_) => unreachable!("handled above"),
            };
        }
        _ => {}
    }
    o
}

fn attr_json(v: &AttrValue) -> Json {
    match v {
        AttrValue::Int(i) => json!(i),
        AttrValue::Float(f) => {
            if f.is_finite() {
                json!(f)
            } else {
                json!(f.to_string())
            }
        }
        AttrValue::String(s) => json!(s),
        AttrValue::Tensor(t) => tensor_json(t),
        AttrValue::Graph(g) => graph_json(g),
        AttrValue::TypeProto(t) => json!(t.to_string()),
        AttrValue::Ints(v) => json!(v),
        AttrValue::Floats(v) => json!(v),
        AttrValue::Strings(v) => json!(v),
        AttrValue::Tensors(v) => v.iter().map(tensor_json).collect(),
        AttrValue::Graphs(v) => v.iter().map(graph_json).collect(),
        AttrValue::TypeProtos(v) => v.iter().map(|t| json!(t.to_string())).collect(),
        AttrValue::Ref(k, n) => json!({ "ref": n, "kind": k.name() }),
    }
}

/// A graph as JSON: inputs, outputs, initializers, nodes in topological order.
pub fn graph_json(g: &Graph) -> Json {
    let name = |v: Value| g.value_name(v).to_string();
    let inputs: Vec<Json> =
        g.input_values().iter().map(|&v| json!({ "name": name(v), "type": ty(g.value_type(v)) })).collect();
    let outputs: Vec<Json> = g
        .outputs()
        .iter()
        .map(|o| json!({ "name": name(o.value), "type": ty(o.ty.as_ref().or(g.value_type(o.value))) }))
        .collect();
    let mut inits = Vec::new();
    for &n in g.initializers() {
        let t = match &g.node(n).op {
            Op::Initializer(t) | Op::Input { default: Some(t) } => t,
            _ => continue,
        };
        let mut j = tensor_json(t);
        j["name"] = json!(g.node(n).outputs()[0].name);
        inits.push(j);
    }
    let order = g.topo_order().unwrap_or_else(|_| g.node_ids().collect());
    let nodes: Vec<Json> = order
        .into_iter()
        .filter(|&n| !matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef))
        .map(|n| {
            let node = g.node(n);
            let attrs: serde_json::Map<String, Json> = node.op.attributes().iter().map(|a| (a.name.clone(), attr_json(&a.value))).collect();
            json!({
                "label": node.label,
                "op_type": node.op.op_type(),
                "domain": node.op.domain(),
                "inputs": node.inputs().iter().map(|i| i.map_or(String::new(), name)).collect::<Vec<_>>(),
                "outputs": node.outputs().iter().map(|o| json!({ "name": o.name, "type": ty(o.ty.as_ref()) })).collect::<Vec<_>>(),
                "attributes": attrs,
            })
        })
        .collect();
    json!({ "name": g.name, "inputs": inputs, "outputs": outputs, "initializers": inits, "nodes": nodes })
}

/// A model as JSON.
pub fn model_json(m: &Model) -> Json {
    json!({
        "format": "shardc-graph",
        "version": 1,
        "ir_version": m.ir_version,
        "opset_import": m.opset_import.iter().map(|(d, v)| json!({ "domain": d, "version": v })).collect::<Vec<_>>(),
        "producer_name": m.producer_name,
        "producer_version": m.producer_version,
        "graph": graph_json(&m.graph),
        "functions": m.functions.iter().map(|f| json!({ "domain": f.domain, "name": f.body.name, "body": graph_json(&f.body) })).collect::<Vec<_>>(),
    })
}

fn dot_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// A graph as Graphviz DOT: one box per op, edges labelled with tensor types; initializers are
/// left out (their shapes appear on the op's tooltip), graph inputs and outputs are ellipses.
pub fn graph_dot(g: &Graph) -> String {
    let mut out = String::new();
    out.push_str(&format!("digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n  edge [fontname=\"monospace\", fontsize=8];\n", dot_escape(&g.name)));
    for n in g.node_ids() {
        let node = g.node(n);
        match &node.op {
            Op::Initializer(_) | Op::OuterRef => continue,
            Op::Input { .. } => {
                out.push_str(&format!(
                    "  n{} [shape=ellipse, label=\"{}\"];\n",
                    n.index(),
                    dot_escape(&node.outputs()[0].name)
                ));
            }
            op => {
                let weights: Vec<String> = node
                    .inputs()
                    .iter()
                    .flatten()
                    .filter(|v| matches!(g.node(v.node).op, Op::Initializer(_)))
                    .map(|v| {
                        format!("{}: {}", g.value_name(*v), g.value_type(*v).map_or("?".into(), |t| t.to_string()))
                    })
                    .collect();
                let label = match &node.label {
                    Some(l) => format!("{}\\n{}", op.op_type(), dot_escape(l)),
                    None => op.op_type().to_string(),
                };
                out.push_str(&format!(
                    "  n{} [label=\"{label}\", tooltip=\"{}\"];\n",
                    n.index(),
                    dot_escape(&weights.join("\\n"))
                ));
            }
        }
    }
    for n in g.node_ids() {
        let node = g.node(n);
        for v in node.inputs().iter().flatten().chain(node.captures()) {
            if matches!(g.node(v.node).op, Op::Initializer(_) | Op::OuterRef) {
                continue;
            }
            let label = g.value_type(*v).map_or(String::new(), |t| t.to_string());
            out.push_str(&format!("  n{} -> n{} [label=\"{}\"];\n", v.node.index(), n.index(), dot_escape(&label)));
        }
    }
    for (i, o) in g.outputs().iter().enumerate() {
        out.push_str(&format!("  out{i} [shape=ellipse, label=\"{}\"];\n", dot_escape(g.value_name(o.value))));
        if !matches!(g.node(o.value.node).op, Op::Initializer(_)) {
            out.push_str(&format!("  n{} -> out{i};\n", o.value.node.index()));
        }
    }
    out.push_str("}\n");
    out
}
