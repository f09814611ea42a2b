//! The text printer: writes models and graphs in the ONNX textual syntax, laid out exactly as
//! ONNX's own printer (`onnx.printer.to_text`) lays them out, so that a model printed by ONNX
//! and parsed by shardc prints back byte for byte.
//!
//! Printing is canonical: nodes in topological order (text order when the text was sorted),
//! attributes by name, value types in `value_info` in node order.

use std::collections::HashSet;
use std::fmt::Write;

use crate::graph::attr::{AttrValue, Attribute};
use crate::graph::op::Op;
use crate::graph::{Function, Graph, Model, NodeId, Value};
use crate::tensor::{Tensor, TensorData, write_f32, write_tensor_data};
use crate::types::{Type, write_id, write_quoted};

/// Prints a whole model.
pub fn model_to_string(m: &Model) -> String {
    let mut p = Printer { out: String::new(), indent: 3 };
    p.model(m);
    p.out
}

/// Prints a graph (as it would appear inside a model).
pub fn graph_to_string(g: &Graph) -> String {
    let mut p = Printer { out: String::new(), indent: 3 };
    p.graph(g);
    p.out
}

/// Prints one node of `g` as a line of the text syntax (without indentation or newline).
pub fn node_to_string(g: &Graph, node: NodeId) -> String {
    let mut p = Printer { out: String::new(), indent: 0 };
    p.node(g, node);
    p.out.trim().to_string()
}

/// Prints a type.
pub fn type_to_string(t: &Type) -> String {
    t.to_string()
}

/// The order nodes are printed (and written to a binary model) in: topological, text order
/// among independent nodes when the text was sorted.
pub fn print_order(g: &Graph) -> Vec<NodeId> {
    g.topo_order().unwrap_or_else(|_| g.node_ids().collect())
}

/// A node's attributes as printed (and written to a binary model): in the order they were
/// written when that was not by name, else by name; then the compiler annotations.
pub fn node_attributes(g: &Graph, n: NodeId) -> Vec<Attribute> {
    let node = g.node(n);
    let mut attrs = node.op.attributes();
    if !node.attr_order.is_empty() {
        let pos = |name: &str| node.attr_order.iter().position(|a| a == name).unwrap_or(usize::MAX);
        attrs.sort_by_key(|a| pos(&a.name));
    }
    attrs.extend(node.annotations.iter().map(|(k, v)| Attribute::new(k.clone(), AttrValue::String(v.clone()))));
    attrs
}

/// The graph's value infos as printed (and written to a binary model): first the names that
/// had entries, in text order; then every other typed operator output, in node order. Graph
/// outputs are left out (their type is in the signature).
pub fn value_infos(g: &Graph) -> Vec<(Option<&Type>, &str)> {
    let order = print_order(g);
    let outputs: HashSet<Value> = g.outputs().iter().map(|o| o.value).collect();
    let is_op = |n: NodeId| !matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef);
    let mut vi: Vec<(Option<&Type>, &str)> = Vec::new();
    let mut printed: HashSet<&str> = HashSet::new();
    for name in g.value_info_order() {
        if !printed.insert(name.as_str()) {
            continue;
        }
        match g.lookup(name) {
            Some(v) if is_op(v.node) => {
                if let Some(t) = g.value_type(v)
                    && !outputs.contains(&v)
                {
                    vi.push((Some(t), name));
                }
            }
            _ => {
                if let Some(t) = g.extra_value_info(name) {
                    vi.push((t.as_ref(), name));
                }
            }
        }
    }
    for &n in &order {
        if !is_op(n) {
            continue;
        }
        for (slot, o) in g.node(n).outputs().iter().enumerate() {
            if o.ty.is_some()
                && !o.name.is_empty()
                && !outputs.contains(&Value::new(n, slot as u16))
                && printed.insert(o.name.as_str())
            {
                vi.push((o.ty.as_ref(), &o.name));
            }
        }
    }
    vi
}

/// The type a graph output is printed (and written) with: its own, else its producer's.
pub fn output_type<'g>(g: &'g Graph, o: &'g crate::graph::GraphOutput) -> Option<&'g Type> {
    let own = match g.node(o.value.node).op {
        Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => None,
        _ => g.value_type(o.value),
    };
    o.ty.as_ref().or(own)
}

struct Printer {
    out: String,
    indent: usize,
}

impl Printer {
    fn pad(&mut self, n: usize) {
        for _ in 0..n.max(1) {
            self.out.push(' ');
        }
    }

    fn id(&mut self, s: &str) {
        write_id(&mut self.out, s).expect("writing to a String");
    }

    fn quoted(&mut self, s: &str) {
        write_quoted(&mut self.out, s).expect("writing to a String");
    }

    fn model(&mut self, m: &Model) {
        self.out.push_str("<\n");
        self.pad(self.indent);
        write!(self.out, "ir_version: {}", m.ir_version).expect("String");
        self.out.push_str(",\n");
        self.pad(self.indent);
        self.out.push_str("opset_import: ");
        self.opsets(&m.opset_import, ", ");
        let strings =
            [("producer_name", &m.producer_name), ("producer_version", &m.producer_version), ("domain", &m.domain)];
        for (key, val) in strings {
            if let Some(v) = val {
                self.out.push_str(",\n");
                self.pad(self.indent);
                write!(self.out, "{key}: ").expect("String");
                self.quoted(v);
            }
        }
        if let Some(v) = m.model_version {
            self.out.push_str(",\n");
            self.pad(self.indent);
            write!(self.out, "model_version: {v}").expect("String");
        }
        if let Some(v) = &m.doc_string {
            self.out.push_str(",\n");
            self.pad(self.indent);
            self.out.push_str("doc_string: ");
            self.quoted(v);
        }
        if let Some(props) = &m.metadata_props {
            self.out.push_str(",\n");
            self.pad(self.indent);
            self.out.push_str("metadata_props: [");
            for (i, (k, v)) in props.iter().enumerate() {
                if i > 0 {
                    self.out.push_str(", ");
                }
                self.quoted(k);
                self.out.push_str(": ");
                self.quoted(v);
            }
            self.out.push(']');
        }
        self.out.push_str("\n>\n");
        self.graph(&m.graph);
        for f in &m.functions {
            self.out.push('\n');
            self.function(f);
        }
    }

    fn opsets(&mut self, opsets: &[(String, i64)], sep: &str) {
        self.out.push('[');
        for (i, (d, v)) in opsets.iter().enumerate() {
            if i > 0 {
                self.out.push_str(sep);
            }
            self.quoted(d);
            write!(self.out, " : {v}").expect("String");
        }
        self.out.push(']');
    }

    fn value_info(&mut self, ty: Option<&Type>, name: &str) {
        if let Some(t) = ty {
            write!(self.out, "{t}").expect("String");
        }
        self.out.push(' ');
        self.id(name);
    }

    fn graph(&mut self, g: &Graph) {
        self.id(&g.name);
        self.out.push_str(" (");
        for (i, &n) in g.inputs().iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            let o = &g.node(n).outputs()[0];
            self.value_info(o.ty.as_ref(), &o.name);
        }
        self.out.push_str(") => (");
        for (i, o) in g.outputs().iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            let name = g.value_name(o.value).to_string();
            // An operator output's own type stands in for an untyped output signature (the
            // value_info below skips graph outputs).
            self.value_info(output_type(g, o), &name);
        }
        self.out.push_str(") ");

        let order = print_order(g);
        let vi = value_infos(g);
        if !g.initializers().is_empty() || !vi.is_empty() {
            self.out.push('\n');
            self.pad(self.indent);
            self.out.push('<');
            let mut first = true;
            for &n in g.initializers() {
                let node = g.node(n);
                let tensor = match &node.op {
                    Op::Initializer(t) => t,
                    Op::Input { default: Some(t) } => t,
                    _ => continue,
                };
                if !first {
                    self.out.push_str(", ");
                }
                first = false;
                let name = node.outputs()[0].name.clone();
                self.tensor(tensor, Some(&name));
            }
            for (ty, name) in vi {
                if !first {
                    self.out.push_str(", ");
                }
                first = false;
                self.value_info(ty, name);
            }
            self.out.push_str(">\n");
        }

        self.out.push_str("{\n");
        for &n in &order {
            if matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef) {
                continue;
            }
            self.pad(self.indent);
            self.node(g, n);
            self.out.push('\n');
        }
        if self.indent > 3 {
            self.pad(self.indent - 3);
        }
        self.out.push('}');
    }

    /// `initializer_name` is given for initializers (` = ` before the data).
    fn tensor(&mut self, t: &Tensor, initializer_name: Option<&str>) {
        self.out.push_str(t.dtype.name());
        if !t.dims.is_empty() {
            self.out.push('[');
            for (i, d) in t.dims.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                write!(self.out, "{d}").expect("String");
            }
            self.out.push(']');
        }
        let name = initializer_name.or(t.name.as_deref());
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            self.out.push(' ');
            self.id(n);
        }
        if initializer_name.is_some() {
            self.out.push_str(" = ");
        } else if matches!(t.data, TensorData::External(_)) {
            self.out.push(' ');
        }
        write_tensor_data(&mut self.out, &t.data).expect("String");
    }

    fn node(&mut self, g: &Graph, n: NodeId) {
        let node = g.node(n);
        if let Some(l) = &node.label {
            self.out.push('[');
            self.id(l);
            self.out.push_str("] ");
        }
        for (i, o) in node.outputs().iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            self.id(&o.name);
        }
        self.out.push_str(" = ");
        let domain = node.op.domain();
        if !domain.is_empty() {
            self.out.push_str(domain);
            self.out.push('.');
        }
        self.out.push_str(node.op.op_type());
        if let Op::Opaque(o) = &node.op
            && !o.overload.is_empty()
        {
            self.out.push(':');
            self.out.push_str(&o.overload);
        }
        let attrs = node_attributes(g, n);
        let has_subgraph = attrs.iter().any(|a| a.value.has_subgraph());
        if !has_subgraph && !attrs.is_empty() {
            self.attrs(&attrs);
        }
        self.out.push_str(" (");
        for (i, inp) in node.inputs().iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            match inp {
                Some(v) => {
                    let name = g.value_name(*v).to_string();
                    self.id(&name);
                }
                None => self.out.push_str("\"\""),
            }
        }
        self.out.push(')');
        if has_subgraph {
            self.attrs(&attrs);
        }
    }

    fn attrs(&mut self, attrs: &[Attribute]) {
        self.out.push_str(" <");
        for (i, a) in attrs.iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            self.attr(a);
        }
        self.out.push('>');
    }

    fn attr(&mut self, a: &Attribute) {
        self.out.push_str(&a.name);
        self.out.push_str(": ");
        self.out.push_str(a.value.kind().name());
        self.out.push_str(" = ");
        self.attr_value(&a.value);
    }

    fn attr_value(&mut self, v: &AttrValue) {
        fn list<T>(p: &mut Printer, items: &[T], mut f: impl FnMut(&mut Printer, &T)) {
            p.out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    p.out.push_str(", ");
                }
                f(p, x);
            }
            p.out.push(']');
        }
        match v {
            AttrValue::Int(i) => write!(self.out, "{i}").expect("String"),
            AttrValue::Float(x) => write_f32(&mut self.out, *x).expect("String"),
            AttrValue::String(s) => self.quoted(s),
            AttrValue::Tensor(t) => self.tensor(t, None),
            AttrValue::Graph(g) => {
                self.indent += 3;
                self.graph(g);
                self.indent -= 3;
            }
            AttrValue::TypeProto(t) => write!(self.out, "{t}").expect("String"),
            AttrValue::Ints(v) => list(self, v, |p, x| write!(p.out, "{x}").expect("String")),
            AttrValue::Floats(v) => list(self, v, |p, x| write_f32(&mut p.out, *x).expect("String")),
            AttrValue::Strings(v) => list(self, v, |p, x| p.quoted(x)),
            AttrValue::Tensors(v) => list(self, v, |p, x| p.tensor(x, None)),
            AttrValue::Graphs(v) => {
                self.indent += 3;
                list(self, v, |p, x| p.graph(x));
                self.indent -= 3;
            }
            AttrValue::TypeProtos(v) => list(self, v, |p, x| write!(p.out, "{x}").expect("String")),
            AttrValue::Ref(_, name) => {
                // The kind was already written; replace "= " value by "= @name".
                self.out.push('@');
                self.out.push_str(name);
            }
        }
    }

    fn function(&mut self, f: &Function) {
        self.out.push_str("<\n  domain: ");
        self.quoted(&f.domain);
        self.out.push_str(",\n");
        if !f.overload.is_empty() {
            self.out.push_str("  overload: ");
            self.quoted(&f.overload);
            self.out.push_str(",\n");
        }
        self.out.push_str("  opset_import: ");
        self.opsets(&f.opset_import, ",");
        self.out.push_str("\n>\n");
        self.id(&f.body.name);
        self.out.push(' ');
        if !f.attr_params.is_empty() || !f.attr_defaults.is_empty() {
            self.out.push('<');
            let mut first = true;
            for a in &f.attr_params {
                if !first {
                    self.out.push(',');
                }
                first = false;
                self.out.push_str(a);
            }
            for a in &f.attr_defaults {
                if !first {
                    self.out.push(',');
                }
                first = false;
                self.attr(a);
            }
            self.out.push('>');
        }
        self.out.push('(');
        for (i, &n) in f.body.inputs().iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            let o = &f.body.node(n).outputs()[0];
            if let Some(t) = &o.ty {
                write!(self.out, "{t} ").expect("String");
            }
            self.id(&o.name.clone());
        }
        self.out.push_str(") => (");
        for (i, o) in f.body.outputs().iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            if let Some(t) = &o.ty {
                write!(self.out, "{t} ").expect("String");
            }
            let name = f.body.value_name(o.value).to_string();
            self.id(&name);
        }
        self.out.push_str(")\n");
        let order = print_order(&f.body);
        self.out.push_str("{\n");
        for n in order {
            if matches!(f.body.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef) {
                continue;
            }
            self.pad(self.indent);
            self.node(&f.body, n);
            self.out.push('\n');
        }
        self.out.push('}');
    }
}
