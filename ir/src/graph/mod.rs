//! The graph: SSA values produced by nodes, petgraph inside.
//!
//! With [`op`] (the closed op enum and its typed attributes) and [`attr`] (attribute values)
//! this is the IR's core layer: one recursive data type — a graph holds nodes whose ops and
//! attributes hold graphs — that depends only on [`crate::tensor`] and [`crate::types`]. The
//! ops' rules ([`crate::ops`]) and the engines (evaluation, inference, layouts, costs) sit
//! above it.
//!
//! Invariants kept by every method here (and checked by [`crate::verify`]):
//! - each node's ordered inputs are mirrored by one petgraph edge per present input, from the
//!   producer to the consumer, carrying the slots; a subgraph capture is an edge with
//!   `dst_slot == CAPTURE`;
//! - every non-empty output name is unique in the graph and indexed for [`Graph::lookup`];
//! - graph inputs are [`Op::Input`] nodes, initializers are [`Op::Initializer`] nodes (or
//!   inputs with a default), values of enclosing graphs are [`Op::OuterRef`] nodes.
//!
//! Callers never see petgraph: nodes are named by [`NodeId`], values by [`Value`].

pub mod attr;
pub mod op;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;

use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};

use crate::graph::op::Op;
use crate::tensor::Tensor;
use crate::types::{TensorType, Type};

/// A node of a [`Graph`]; stable across removals of other nodes.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(NodeIndex<u32>);

impl NodeId {
    /// The index, for tables keyed by node.
    pub fn index(self) -> usize {
        self.0.index()
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0.index())
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0.index())
    }
}

impl Serialize for NodeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(self.0.index() as u32)
    }
}

/// A tensor-valued wire: output `slot` of `node`. Displays as `%12` or `%12#1`.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Value {
    /// The producing node.
    pub node: NodeId,
    /// Which of its outputs.
    pub slot: u16,
}

impl Value {
    /// Output `slot` of `node`.
    pub fn new(node: NodeId, slot: u16) -> Value {
        Value { node, slot }
    }
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.slot == 0 { write!(f, "{}", self.node) } else { write!(f, "{}#{}", self.node, self.slot) }
    }
}

/// Edge weight: which output feeds which input.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Port {
    src_slot: u16,
    dst_slot: u16,
}

/// `dst_slot` of an edge that stands for a value captured by a subgraph.
const CAPTURE: u16 = u16::MAX;

/// A byte range in the source text a graph was parsed from.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Span {
    /// First byte.
    pub start: u32,
    /// One past the last byte.
    pub end: u32,
}

impl Span {
    /// A span of bytes `start..end`.
    pub fn new(start: usize, end: usize) -> Span {
        Span { start: start as u32, end: end as u32 }
    }

    /// As a range of byte offsets.
    pub fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// One output of a node: its name (empty for an omitted optional output) and its type, when
/// declared or inferred.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    /// The value's name; `""` marks an omitted optional output.
    pub name: String,
    /// The type, when known.
    pub ty: Option<Type>,
}

impl Output {
    /// A named output of unknown type.
    pub fn named(name: impl Into<String>) -> Output {
        Output { name: name.into(), ty: None }
    }
}

/// A node: an op, its ordered inputs and its outputs.
#[derive(Clone, Debug)]
pub struct Node {
    /// The operator.
    pub op: Op,
    /// The node's label (`[name]` in the text syntax, ONNX `NodeProto.name`).
    pub label: Option<String>,
    /// The order its attributes were written in, when that was not name order (exporters do
    /// not always sort); the printer keeps it so that text round-trips exactly.
    pub attr_order: Vec<String>,
    /// Compiler annotations: string attributes named `shardc_*` (a sharding plan's per-op
    /// strategy and tensor layouts). They are not part of the op; they print after its
    /// attributes and parse back into this list.
    pub annotations: Vec<(String, String)>,
    inputs: Vec<Option<Value>>,
    outputs: Vec<Output>,
    captures: Vec<Value>,
}

impl Node {
    /// Ordered inputs; `None` is an omitted optional input (`""`).
    pub fn inputs(&self) -> &[Option<Value>] {
        &self.inputs
    }

    /// Input `i`, when present.
    pub fn input(&self, i: usize) -> Option<Value> {
        self.inputs.get(i).copied().flatten()
    }

    /// Ordered outputs.
    pub fn outputs(&self) -> &[Output] {
        &self.outputs
    }

    /// Values of enclosing graphs that this node's subgraphs read.
    pub fn captures(&self) -> &[Value] {
        &self.captures
    }

    /// Number of outputs.
    pub fn num_outputs(&self) -> usize {
        self.outputs.len()
    }
}

/// A graph output: a value and the type its declaration gives, if any.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphOutput {
    /// The value.
    pub value: Value,
    /// The type written in the graph's signature.
    pub ty: Option<Type>,
}

/// Error of [`Graph::topo_order`]: these nodes lie on or after a cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cycle(pub Vec<NodeId>);

/// A typed SSA graph.
#[derive(Clone, Debug)]
pub struct Graph {
    /// The graph's name (`main_graph`).
    pub name: String,
    /// The default-domain opset the graph was written for (semantics of a few ops, such as
    /// Softmax, changed across opsets); 0 when unknown.
    pub opset: i64,
    g: StableDiGraph<Node, Port, u32>,
    inputs: Vec<NodeId>,
    outputs: Vec<GraphOutput>,
    initializers: Vec<NodeId>,
    names: FastMap<String, Value>,
    spans: FastMap<NodeId, Span>,
    value_info_order: Vec<String>,
    value_info_extra: FastMap<String, Option<Type>>,
}

/// The maps a graph keeps by name and node: foldhash (seeded per process, so still not
/// predictable by an input) hashes names several times faster than SipHash.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

impl PartialEq for Graph {
    /// Graphs are equal when their structure is (see [`Graph::difference`]).
    fn eq(&self, other: &Graph) -> bool {
        self.difference(other).is_none()
    }
}

impl Graph {
    /// The first structural difference from `other`, or `None`: name, opset, nodes in order
    /// (op, attributes, label, annotations, inputs and captures by name, outputs with their
    /// types), graph inputs, outputs and initializers in order. Floats compare bit for bit;
    /// source spans and the order value_info was written in (presentation) do not count.
    pub fn difference(&self, other: &Graph) -> Option<String> {
        let names =
            |g: &Graph, vs: &[Value]| -> Vec<String> { vs.iter().map(|&v| g.value_name(v).to_string()).collect() };
        let opt_names = |g: &Graph, vs: &[Option<Value>]| -> Vec<Option<String>> {
            vs.iter().map(|v| v.map(|v| g.value_name(v).to_string())).collect()
        };
        let node_diff = |a: &Node, b: &Node| -> Option<String> {
            let (aa, ba) = (a.op.attributes(), b.op.attributes());
            let same_op = match (&a.op, &b.op) {
                (Op::Initializer(x), Op::Initializer(y)) => x.same(y),
                (Op::Input { default: x }, Op::Input { default: y }) => match (x, y) {
                    (Some(x), Some(y)) => x.same(y),
                    (x, y) => x.is_none() && y.is_none(),
                },
                (x, y) => {
                    x.op_type() == y.op_type()
                        && x.domain() == y.domain()
                        && aa.len() == ba.len()
                        && aa.iter().zip(&ba).all(|(p, q)| p.name == q.name && p.value.same(&q.value))
                }
            };
            let types = |g: &Graph, n: &Node| -> Vec<Option<Type>> {
                n.outputs.iter().map(|o| g.lookup(&o.name).and_then(|v| g.declared(v))).collect()
            };
            if !same_op {
                Some("op or attributes".into())
            } else if a.label != b.label {
                Some("label".into())
            } else if a.attr_order != b.attr_order {
                Some("attribute order".into())
            } else if a.annotations != b.annotations {
                Some("annotations".into())
            } else if opt_names(self, &a.inputs) != opt_names(other, &b.inputs) {
                Some("inputs".into())
            } else if names(self, &a.captures) != names(other, &b.captures) {
                Some("captures".into())
            } else if a.outputs.iter().map(|o| &o.name).ne(b.outputs.iter().map(|o| &o.name)) {
                Some("output names".into())
            } else if types(self, a) != types(other, b) {
                Some(format!("output types ({:?} vs {:?})", types(self, a), types(other, b)))
            } else {
                None
            }
        };
        let ids = |g: &Graph, v: &[NodeId]| -> Vec<String> {
            v.iter().map(|&n| g.value_name(Value::new(n, 0)).to_string()).collect()
        };
        if self.name != other.name || self.opset != other.opset {
            return Some(format!("name or opset: {}/{} vs {}/{}", self.name, self.opset, other.name, other.opset));
        }
        if self.node_count() != other.node_count() {
            return Some(format!("{} nodes vs {}", self.node_count(), other.node_count()));
        }
        for (a, b) in self.node_ids().zip(other.node_ids()) {
            if let Some(what) = node_diff(self.node(a), other.node(b)) {
                return Some(format!("{}: {what} differ from {}", self.describe(a), other.describe(b)));
            }
        }
        if ids(self, &self.inputs) != ids(other, &other.inputs) {
            return Some("graph inputs".into());
        }
        if ids(self, &self.initializers) != ids(other, &other.initializers) {
            return Some("initializers".into());
        }
        let outs = |g: &Graph| -> Vec<(String, Option<Type>)> {
            g.outputs.iter().map(|o| (g.value_name(o.value).to_string(), g.declared(o.value))).collect()
        };
        if outs(self) != outs(other) {
            return Some("graph outputs".into());
        }
        None
    }

    /// The type written for a value: its graph-output signature's, else its own (the text
    /// syntax writes the type of a graph output in the signature only).
    fn declared(&self, v: Value) -> Option<Type> {
        self.outputs
            .iter()
            .find(|o| o.value == v && o.ty.is_some())
            .and_then(|o| o.ty.clone())
            .or_else(|| self.value_type(v).cloned())
    }

    /// A name for an op node: its label, or its first output's name.
    pub fn op_name(&self, n: NodeId) -> String {
        let node = self.node(n);
        node.label.clone().unwrap_or_else(|| node.outputs().first().map(|o| o.name.clone()).unwrap_or_default())
    }

    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            opset: 0,
            g: StableDiGraph::default(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            initializers: Vec::new(),
            names: FastMap::default(),
            spans: FastMap::default(),
            value_info_order: Vec::new(),
            value_info_extra: FastMap::default(),
        }
    }

    // ---------------------------------------------------------------- building

    /// Adds a graph input of type `ty`.
    pub fn add_input(&mut self, name: impl Into<String>, ty: Option<Type>) -> Value {
        let id = self.add_node(Op::Input { default: None }, vec![], vec![Output { name: name.into(), ty }]);
        self.inputs.push(id);
        Value::new(id, 0)
    }

    /// Adds an initializer (a constant parameter) named `name`.
    pub fn add_initializer(&mut self, name: impl Into<String>, tensor: Tensor) -> Value {
        let ty = Some(Type::Tensor(tensor.tensor_type()));
        let id = self.add_node(Op::Initializer(tensor), vec![], vec![Output { name: name.into(), ty }]);
        self.initializers.push(id);
        Value::new(id, 0)
    }

    /// Gives graph input `input` a default value (an initializer of the same name).
    pub fn set_input_default(&mut self, input: Value, tensor: Tensor) {
        if let Op::Input { default } = &mut self.g[input.node.0].op {
            let had = default.is_some();
            *default = Some(tensor);
            if !had {
                self.initializers.push(input.node);
            }
        }
    }

    /// Adds a node; every present input must already exist. Returns its id.
    pub fn add_node(&mut self, op: Op, inputs: Vec<Option<Value>>, outputs: Vec<Output>) -> NodeId {
        let id = NodeId(self.g.add_node(Node {
            op,
            label: None,
            attr_order: Vec::new(),
            annotations: Vec::new(),
            inputs: Vec::new(),
            outputs,
            captures: Vec::new(),
        }));
        for (slot, out) in self.g[id.0].outputs.iter().enumerate() {
            if !out.name.is_empty() {
                self.names.entry(out.name.clone()).or_insert(Value::new(id, slot as u16));
            }
        }
        self.set_inputs(id, inputs);
        id
    }

    /// Adds a node with a label; see [`Graph::add_node`].
    pub fn add_labeled_node(
        &mut self,
        label: Option<String>,
        op: Op,
        inputs: Vec<Option<Value>>,
        outputs: Vec<Output>,
    ) -> NodeId {
        let id = self.add_node(op, inputs, outputs);
        self.g[id.0].label = label;
        id
    }

    /// Adds a node with one output named `name` and returns that value.
    pub fn add_simple(&mut self, op: Op, inputs: &[Value], name: impl Into<String>) -> Value {
        let id = self.add_node(op, inputs.iter().map(|v| Some(*v)).collect(), vec![Output::named(name)]);
        Value::new(id, 0)
    }

    /// Adds an [`Op::OuterRef`] standing for the enclosing graph's value `name`.
    pub fn add_outer_ref(&mut self, name: impl Into<String>, ty: Option<Type>) -> Value {
        let id = self.add_node(Op::OuterRef, vec![], vec![Output { name: name.into(), ty }]);
        Value::new(id, 0)
    }

    /// Appends a graph output.
    pub fn add_output(&mut self, value: Value, ty: Option<Type>) {
        self.outputs.push(GraphOutput { value, ty });
    }

    /// Replaces the list of graph outputs.
    pub fn set_outputs(&mut self, outputs: Vec<GraphOutput>) {
        self.outputs = outputs;
    }

    /// Replaces a node's inputs (keeping edges in step).
    pub fn set_inputs(&mut self, node: NodeId, inputs: Vec<Option<Value>>) {
        let old: Vec<_> = self
            .g
            .edges_directed(node.0, Direction::Incoming)
            .filter(|e| e.weight().dst_slot != CAPTURE)
            .map(|e| e.id())
            .collect();
        for e in old {
            self.g.remove_edge(e);
        }
        for (i, v) in inputs.iter().enumerate() {
            if let Some(v) = v {
                self.g.add_edge(v.node.0, node.0, Port { src_slot: v.slot, dst_slot: i as u16 });
            }
        }
        self.g[node.0].inputs = inputs;
    }

    /// Sets input `i` of `node` (growing the input list with omitted inputs if needed).
    pub fn set_input(&mut self, node: NodeId, i: usize, value: Option<Value>) {
        let mut inputs = self.g[node.0].inputs.clone();
        if inputs.len() <= i {
            inputs.resize(i + 1, None);
        }
        inputs[i] = value;
        self.set_inputs(node, inputs);
    }

    /// Records the outer values a node's subgraphs read.
    pub fn set_captures(&mut self, node: NodeId, captures: Vec<Value>) {
        let old: Vec<_> = self
            .g
            .edges_directed(node.0, Direction::Incoming)
            .filter(|e| e.weight().dst_slot == CAPTURE)
            .map(|e| e.id())
            .collect();
        for e in old {
            self.g.remove_edge(e);
        }
        for v in &captures {
            self.g.add_edge(v.node.0, node.0, Port { src_slot: v.slot, dst_slot: CAPTURE });
        }
        self.g[node.0].captures = captures;
    }

    /// Makes every use of `old` (node inputs, captures and graph outputs) use `new`.
    pub fn replace_all_uses(&mut self, old: Value, new: Value) {
        for (user, _) in self.users(old) {
            let inputs = self.g[user.0].inputs.iter().map(|i| if *i == Some(old) { Some(new) } else { *i }).collect();
            self.set_inputs(user, inputs);
            if self.g[user.0].captures.contains(&old) {
                let caps = self.g[user.0].captures.iter().map(|c| if *c == old { new } else { *c }).collect();
                self.set_captures(user, caps);
            }
        }
        for o in &mut self.outputs {
            if o.value == old {
                o.value = new;
            }
        }
    }

    /// The same graph with its nodes numbered in `order` (every node once, producers before
    /// readers), so that [`Graph::topo_order`] (oldest ready node first) runs them in that
    /// order; `None` when `order` is not such an order of this graph's nodes. Node ids
    /// change; names, types, annotations, spans and the signature stay.
    pub fn reordered(&self, order: &[NodeId]) -> Option<Graph> {
        if order.len() != self.node_count() {
            return None;
        }
        let mut out = Graph {
            opset: self.opset,
            value_info_order: self.value_info_order.clone(),
            value_info_extra: self.value_info_extra.clone(),
            ..Graph::new(self.name.clone())
        };
        let mut id: HashMap<NodeId, NodeId> = HashMap::with_capacity(order.len());
        let map = |id: &HashMap<NodeId, NodeId>, v: &Value| id.get(&v.node).map(|n| Value::new(*n, v.slot));
        for &n in order {
            if !self.contains(n) || id.contains_key(&n) {
                return None;
            }
            let node = &self.g[n.0];
            let inputs: Option<Vec<Option<Value>>> =
                node.inputs.iter().map(|i| i.as_ref().map_or(Some(None), |v| map(&id, v).map(Some))).collect();
            let captures: Option<Vec<Value>> = node.captures.iter().map(|v| map(&id, v)).collect();
            let (inputs, captures) = (inputs?, captures?);
            let new = out.add_node(node.op.clone(), inputs, node.outputs.clone());
            let copy = &mut out.g[new.0];
            copy.label = node.label.clone();
            copy.attr_order = node.attr_order.clone();
            copy.annotations = node.annotations.clone();
            if !captures.is_empty() {
                out.set_captures(new, captures);
            }
            if let Some(sp) = self.spans.get(&n) {
                out.spans.insert(new, *sp);
            }
            id.insert(n, new);
        }
        out.inputs = self.inputs.iter().map(|n| id[n]).collect();
        out.initializers = self.initializers.iter().map(|n| id[n]).collect();
        out.outputs = self
            .outputs
            .iter()
            .map(|o| GraphOutput { value: map(&id, &o.value).expect("every node kept"), ty: o.ty.clone() })
            .collect();
        // Names resolve as they did (a name written twice keeps its first holder).
        out.names = self.names.iter().filter_map(|(k, v)| Some((k.clone(), map(&id, v)?))).collect();
        Some(out)
    }

    /// Removes a node. Its outputs must be unused (see [`Graph::users`]); graph outputs and
    /// inputs referring to it must have been moved first.
    pub fn remove_node(&mut self, node: NodeId) {
        debug_assert!(
            self.g.edges_directed(node.0, Direction::Outgoing).next().is_none(),
            "removing {node} while it is still used"
        );
        if let Some(n) = self.g.remove_node(node.0) {
            for (slot, out) in n.outputs.iter().enumerate() {
                if self.names.get(&out.name) == Some(&Value::new(node, slot as u16)) {
                    self.names.remove(&out.name);
                }
            }
        }
        self.inputs.retain(|&i| i != node);
        self.initializers.retain(|&i| i != node);
        self.spans.remove(&node);
    }

    /// Turns graph input `input` into an initializer holding `tensor` (a value known before
    /// the graph runs, such as a shape given at run time): it leaves the graph's inputs.
    pub fn bind_input(&mut self, input: Value, tensor: Tensor) {
        if !matches!(self.g[input.node.0].op, Op::Input { .. }) {
            return;
        }
        let ty = Some(Type::Tensor(tensor.tensor_type()));
        self.inputs.retain(|&i| i != input.node);
        self.initializers.retain(|&i| i != input.node);
        self.g[input.node.0].op = Op::Initializer(tensor);
        self.g[input.node.0].outputs[0].ty = ty;
        self.initializers.push(input.node);
    }

    /// Replaces a node's op (the caller keeps inputs, outputs and types consistent).
    pub fn set_op(&mut self, node: NodeId, op: Op) {
        let was_init = matches!(self.g[node.0].op, Op::Initializer(_));
        let is_init = matches!(op, Op::Initializer(_));
        self.g[node.0].op = op;
        if is_init && !was_init {
            self.initializers.push(node);
        } else if was_init && !is_init {
            self.initializers.retain(|&i| i != node);
        }
    }

    /// Makes node `n` an initializer holding `tensor` (a value computed and folded): its inputs
    /// and captures are dropped and its label cleared; its output keeps its name and type.
    pub fn make_initializer(&mut self, n: NodeId, tensor: Tensor) {
        self.set_inputs(n, vec![]);
        self.set_captures(n, vec![]);
        self.set_op(n, Op::Initializer(tensor));
        self.set_label(n, None);
    }

    /// Records the order a node's attributes were written in (see [`Node::attr_order`]).
    pub fn set_attr_order(&mut self, node: NodeId, order: Vec<String>) {
        self.g[node.0].attr_order = order;
    }

    /// Sets (or replaces) the annotation `key` of a node; keys should start with `shardc_`.
    pub fn set_annotation(&mut self, node: NodeId, key: impl Into<String>, value: impl Into<String>) {
        let key = key.into();
        let value = value.into();
        let anns = &mut self.g[node.0].annotations;
        match anns.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => anns.push((key, value)),
        }
    }

    /// Removes the annotations named `keys` from every node.
    pub fn remove_annotations(&mut self, keys: &[&str]) {
        for n in self.g.node_weights_mut() {
            n.annotations.retain(|(k, _)| !keys.contains(&k.as_str()));
        }
    }

    /// Sets the label of a node.
    pub fn set_label(&mut self, node: NodeId, label: Option<String>) {
        self.g[node.0].label = label;
    }

    /// Sets the type of a value.
    pub fn set_type(&mut self, value: Value, ty: Option<Type>) {
        self.g[value.node.0].outputs[value.slot as usize].ty = ty;
    }

    /// Renames a value. Fails (returning false) when the name is taken.
    pub fn rename(&mut self, value: Value, name: impl Into<String>) -> bool {
        let name = name.into();
        if self.names.contains_key(&name) {
            return false;
        }
        let old = std::mem::replace(&mut self.g[value.node.0].outputs[value.slot as usize].name, name.clone());
        if self.names.get(&old) == Some(&value) {
            self.names.remove(&old);
        }
        if !name.is_empty() {
            self.names.insert(name, value);
        }
        true
    }

    /// Renames the values this graph's subgraphs read from enclosing graphs (its `OuterRef`s,
    /// and theirs in nested subgraphs) by `map`: when the enclosing value is known by another
    /// name (a device's local copy of a value). Returns whether anything changed.
    pub fn rename_outer_refs(&mut self, map: &HashMap<String, String>) -> bool {
        let mut changed = false;
        for n in self.node_ids().collect::<Vec<_>>() {
            if matches!(self.g[n.0].op, Op::OuterRef) {
                let old = self.g[n.0].outputs[0].name.clone();
                if let Some(new) = map.get(&old) {
                    changed |= self.rename(Value::new(n, 0), new.clone());
                }
            } else if self.g[n.0].op.has_subgraphs() {
                let mut op = self.g[n.0].op.clone();
                if op.rename_outer_refs(map) {
                    self.g[n.0].op = op;
                    changed = true;
                }
            }
        }
        changed
    }

    /// A name not used in this graph, `base` or `base_N`.
    pub fn fresh_name(&self, base: &str) -> String {
        if !self.names.contains_key(base) {
            return base.to_string();
        }
        (1..).map(|i| format!("{base}_{i}")).find(|n| !self.names.contains_key(n)).expect("unbounded")
    }

    /// Records where a node came from in the source text.
    pub fn set_span(&mut self, node: NodeId, span: Span) {
        self.spans.insert(node, span);
    }

    /// Records that `name` had a `value_info` entry, in text order, so that the printer
    /// writes value infos in the order they were read.
    pub fn note_value_info(&mut self, name: String) {
        self.value_info_order.push(name);
    }

    /// Records a `value_info` entry for a name that is not an operator's output (a graph input,
    /// an initializer, an outer value), so it prints back.
    pub fn set_extra_value_info(&mut self, name: String, ty: Option<Type>) {
        self.value_info_extra.insert(name, ty);
    }

    // ---------------------------------------------------------------- reading

    /// The node `id`. Panics when it was removed (a broken invariant of the caller).
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id.0]
    }

    /// True when `id` names a live node.
    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(id.0)
    }

    /// All node ids, in creation order (which is the text order for parsed graphs).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.g.node_indices().map(NodeId)
    }

    /// Number of nodes, sources (inputs, initializers) included.
    pub fn node_count(&self) -> usize {
        self.g.node_count()
    }

    /// Number of operator nodes: everything except inputs, initializers and outer references.
    pub fn op_count(&self) -> usize {
        self.g.node_weights().filter(|n| !matches!(n.op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef)).count()
    }

    /// Graph input nodes, in order.
    pub fn inputs(&self) -> &[NodeId] {
        &self.inputs
    }

    /// Graph input values, in order.
    pub fn input_values(&self) -> Vec<Value> {
        self.inputs.iter().map(|&n| Value::new(n, 0)).collect()
    }

    /// Graph outputs, in order.
    pub fn outputs(&self) -> &[GraphOutput] {
        &self.outputs
    }

    /// Initializer entries (initializers and inputs with defaults) in print order.
    pub fn initializers(&self) -> &[NodeId] {
        &self.initializers
    }

    /// Names that had `value_info` entries, in the order they were read.
    pub fn value_info_order(&self) -> &[String] {
        &self.value_info_order
    }

    /// The type of a `value_info` entry that names no operator output.
    pub fn extra_value_info(&self, name: &str) -> Option<&Option<Type>> {
        self.value_info_extra.get(name)
    }

    /// The value called `name`, if any.
    pub fn lookup(&self, name: &str) -> Option<Value> {
        self.names.get(name).copied()
    }

    /// The name of a value.
    pub fn value_name(&self, v: Value) -> &str {
        &self.g[v.node.0].outputs[v.slot as usize].name
    }

    /// The type of a value, when known.
    pub fn value_type(&self, v: Value) -> Option<&Type> {
        self.g[v.node.0].outputs.get(v.slot as usize)?.ty.as_ref()
    }

    /// The tensor type of a value, when known and a tensor.
    pub fn tensor_type(&self, v: Value) -> Option<&TensorType> {
        self.value_type(v)?.as_tensor()
    }

    /// The constant behind a value, when it is an initializer (or an input's default).
    pub fn initializer(&self, v: Value) -> Option<&Tensor> {
        match &self.g[v.node.0].op {
            Op::Initializer(t) => Some(t),
            _ => None,
        }
    }

    /// Where a node came from in the source text.
    pub fn span(&self, node: NodeId) -> Option<Span> {
        self.spans.get(&node).copied()
    }

    /// The last op (position in `order`) reading each value, as an input or a capture: where
    /// a run frees it, and where a memory estimate stops counting it.
    pub fn last_uses(&self, order: &[NodeId]) -> HashMap<Value, usize> {
        let mut last_use = HashMap::new();
        for (i, &n) in order.iter().enumerate() {
            for v in self.node(n).inputs().iter().flatten().chain(self.node(n).captures()) {
                last_use.insert(*v, i);
            }
        }
        last_use
    }

    /// The nodes that use `value`, with the input index (or `usize::MAX` for a capture).
    pub fn users(&self, value: Value) -> Vec<(NodeId, usize)> {
        let mut out: Vec<_> = self
            .g
            .edges_directed(value.node.0, Direction::Outgoing)
            .filter(|e| e.weight().src_slot == value.slot)
            .map(|e| {
                let d = e.weight().dst_slot;
                (NodeId(e.target()), if d == CAPTURE { usize::MAX } else { usize::from(d) })
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// True when `value` is a graph output.
    pub fn is_output(&self, value: Value) -> bool {
        self.outputs.iter().any(|o| o.value == value)
    }

    /// True when any node or graph output reads `value`.
    pub fn is_used(&self, value: Value) -> bool {
        self.is_output(value)
            || self.g.edges_directed(value.node.0, Direction::Outgoing).any(|e| e.weight().src_slot == value.slot)
    }

    /// The distinct nodes that read any output of `node`.
    pub fn successors(&self, node: NodeId) -> Vec<NodeId> {
        let mut s: Vec<_> = self.g.neighbors_directed(node.0, Direction::Outgoing).map(NodeId).collect();
        s.sort();
        s.dedup();
        s
    }

    /// The distinct nodes whose outputs `node` reads (captures included).
    pub fn predecessors(&self, node: NodeId) -> Vec<NodeId> {
        let mut s: Vec<_> = self.g.neighbors_directed(node.0, Direction::Incoming).map(NodeId).collect();
        s.sort();
        s.dedup();
        s
    }

    /// A topological order of all nodes; among ready nodes the oldest comes first, so a
    /// graph parsed from topologically sorted text keeps its text order.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, Cycle> {
        let mut indeg: HashMap<NodeIndex<u32>, usize> = HashMap::with_capacity(self.g.node_count());
        for n in self.g.node_indices() {
            indeg.insert(n, 0);
        }
        for e in self.g.edge_indices() {
            let (_, t) = self.g.edge_endpoints(e).expect("live edge");
            *indeg.get_mut(&t).expect("live node") += 1;
        }
        let mut heap: BinaryHeap<Reverse<NodeIndex<u32>>> =
            indeg.iter().filter(|(_, d)| **d == 0).map(|(n, _)| Reverse(*n)).collect();
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse(n)) = heap.pop() {
            order.push(NodeId(n));
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let d = indeg.get_mut(&e.target()).expect("live node");
                *d -= 1;
                if *d == 0 {
                    heap.push(Reverse(e.target()));
                }
            }
        }
        if order.len() == self.g.node_count() {
            Ok(order)
        } else {
            let mut rest: Vec<_> = indeg.into_iter().filter(|(_, d)| *d > 0).map(|(n, _)| NodeId(n)).collect();
            rest.sort();
            Err(Cycle(rest))
        }
    }

    /// Operator nodes (no inputs, initializers or outer references) in topological order.
    pub fn op_nodes(&self) -> Result<Vec<NodeId>, Cycle> {
        Ok(self
            .topo_order()?
            .into_iter()
            .filter(|&n| !matches!(self.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef))
            .collect())
    }

    /// A short description of a node for messages: its label, or its first output's name, and
    /// its op type.
    pub fn describe(&self, node: NodeId) -> String {
        let n = self.node(node);
        let op = n.op.op_type();
        match (&n.label, n.outputs.first()) {
            (Some(l), _) => format!("{op} node `{l}`"),
            (None, Some(o)) if !o.name.is_empty() => format!("{op} node producing `{}`", o.name),
            _ => format!("{op} node {node}"),
        }
    }
}

/// A function defined in a model (ONNX `FunctionProto`). Its body is a graph whose inputs
/// are the formal parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Domain the function is called by.
    pub domain: String,
    /// Overload name, usually empty.
    pub overload: String,
    /// Opsets the body uses.
    pub opset_import: Vec<(String, i64)>,
    /// Documentation string.
    pub doc_string: Option<String>,
    /// Names of the attribute parameters.
    pub attr_params: Vec<String>,
    /// Attribute parameters written with a default (the ONNX printer does not print these).
    pub attr_defaults: Vec<crate::graph::attr::Attribute>,
    /// The body; its name is the function's name.
    pub body: Graph,
}

/// A model: header, main graph, functions.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// ONNX IR version.
    pub ir_version: i64,
    /// `(domain, version)` pairs; `""` is the default domain.
    pub opset_import: Vec<(String, i64)>,
    /// Producer name.
    pub producer_name: Option<String>,
    /// Producer version.
    pub producer_version: Option<String>,
    /// Model domain.
    pub domain: Option<String>,
    /// Model version.
    pub model_version: Option<i64>,
    /// Documentation string.
    pub doc_string: Option<String>,
    /// Metadata key/value pairs.
    pub metadata_props: Option<Vec<(String, String)>>,
    /// The main graph.
    pub graph: Graph,
    /// Functions defined by the model.
    pub functions: Vec<Function>,
}

impl Model {
    /// A model around `graph` with the default opset `opset`.
    pub fn new(graph: Graph, opset: i64) -> Model {
        let mut graph = graph;
        graph.opset = opset;
        Model {
            ir_version: 8,
            opset_import: vec![(String::new(), opset)],
            producer_name: Some("shardc".into()),
            producer_version: None,
            domain: None,
            model_version: None,
            doc_string: None,
            metadata_props: None,
            graph,
            functions: Vec::new(),
        }
    }

    /// The imported version of the default ONNX domain (`""` or `ai.onnx`), if any.
    pub fn default_opset(&self) -> Option<i64> {
        self.opset_import.iter().find(|(d, _)| d.is_empty() || d == "ai.onnx").map(|(_, v)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::op;
    use crate::types::DType;

    #[test]
    fn edges_follow_inputs() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[2]).into()));
        let y = g.add_simple(Op::Relu(op::Relu::default()), &[x], "y");
        let z = g.add_simple(Op::Add(op::Add::default()), &[y, x], "z");
        g.add_output(z, None);
        assert_eq!(g.users(x), vec![(y.node, 0), (z.node, 1)]);
        assert_eq!(g.lookup("z"), Some(z));
        g.replace_all_uses(y, x);
        assert_eq!(g.node(z.node).inputs(), &[Some(x), Some(x)]);
        assert!(!g.is_used(y));
        g.remove_node(y.node);
        assert_eq!(g.lookup("y"), None);
        let order = g.topo_order().unwrap();
        assert_eq!(order, vec![x.node, z.node]);
        assert_eq!(g.fresh_name("z"), "z_1");
    }

    #[test]
    fn cycles_are_reported() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", None);
        let a = g.add_simple(Op::Relu(op::Relu::default()), &[x], "a");
        let b = g.add_simple(Op::Relu(op::Relu::default()), &[a], "b");
        g.set_input(a.node, 0, Some(b));
        let Cycle(nodes) = g.topo_order().unwrap_err();
        assert_eq!(nodes, vec![a.node, b.node]);
    }
}
