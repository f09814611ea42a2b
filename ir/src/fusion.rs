//! Element-wise fusion groups: which element-wise ops of a program can run as one kernel.
//! The wgpu runtime runs them so (`codegen::runtime::fuse`) and the cost model prices them as
//! it runs them; both take the groups from [`groups`].
//!
//! A group's members have one output each, all of one shape, and run in the same part of the
//! step (`Rules::together`). The group runs when its last member's (its root's) turn comes. A
//! member's value leaves the group — the kernel writes it — when something outside the group
//! reads it or the run keeps it (`Rules::held`); every such reader comes after the root in the
//! program's order, so it finds the value written. A value read only inside the group stays
//! in registers.

use std::collections::HashMap;

use crate::{Graph, NodeId, OpClass, Value};

/// The kernel family a group's time is reported and priced under (by the run reports, the
/// cost model's op rows and its kernel factors).
pub const FUSED: &str = "Fused";

/// The most buffers a group's kernel binds for the values it reads and writes (adapters
/// guarantee 8 storage buffers per shader; one holds its parameters).
pub const MAX_BINDINGS: usize = 7;

/// Where a member of a group reads an input from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The output of member `j` (earlier in [`Group::nodes`]).
    Member(usize),
    /// Value `k` of [`Group::outside`].
    Outside(usize),
}

/// Element-wise ops run as one kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    /// The members in the order they ran unfused; the root last.
    pub nodes: Vec<NodeId>,
    /// The values the members read that no member computes, in first-read order.
    pub outside: Vec<Value>,
    /// Per member, per input slot: where it comes from (`None`: an omitted input).
    pub sources: Vec<Vec<Option<Source>>>,
    /// The members whose values the kernel writes, in order; the root last.
    pub outputs: Vec<usize>,
}

/// What [`groups`] asks of a program.
pub struct Rules<'a> {
    /// Ops that may be members.
    pub fusible: &'a dyn Fn(NodeId) -> bool,
    /// Values the run keeps past their readers (written by a group's kernel).
    pub held: &'a dyn Fn(&Value) -> bool,
    /// Whether two ops always run in the same part of the step.
    pub together: &'a dyn Fn(NodeId, NodeId) -> bool,
}

/// Groups the ops of `g` (`order`: topologically) that `rules` allow: an op joins the
/// group of an op reading its output when both run in the same part of the step, their
/// output shapes are equal, every reader outside the group comes after that op, and the
/// group binds at most [`MAX_BINDINGS`] values.
pub fn groups(g: &Graph, order: &[NodeId], rules: &Rules<'_>) -> Vec<Group> {
    let at: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // Members of the group rooted at each fusible op, before it joins a later one.
    let mut members: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for &n in order {
        if !(rules.fusible)(n) {
            continue;
        }
        let mut nodes: Vec<NodeId> = Vec::new();
        for v in g.node(n).inputs().iter().flatten() {
            let u = v.node;
            if nodes.contains(&u) || !members.contains_key(&u) || !joins(g, u, n, rules) {
                continue;
            }
            let mut candidate = nodes.clone();
            candidate.extend(members[&u].iter().copied());
            candidate.push(n);
            if fits(g, &candidate, &at, rules.held) {
                nodes.extend(members.remove(&u).expect("a group"));
            }
        }
        nodes.push(n);
        members.insert(n, nodes);
    }
    let mut out: Vec<Group> =
        members.into_values().filter(|m| m.len() > 1).map(|m| group(g, &at, m, rules.held)).collect();
    out.sort_by_key(|grp| at[grp.nodes.last().expect("a root")]);
    out
}

/// The element-wise ops a fused kernel can compute: unary, binary and variadic element-wise
/// ops of at most three inputs (not views: `Identity`, `Dropout`; the variadic folds —
/// `Sum`, `Max`, … — of at most two, one expression each) with one output of a static shape
/// that is not a string.
pub fn elementwise(g: &Graph, n: NodeId) -> bool {
    let node = g.node(n);
    let op = &node.op;
    matches!(op.class(), OpClass::Unary | OpClass::Binary | OpClass::Variadic)
        && !matches!(op, crate::Op::Identity(_) | crate::Op::Dropout(_))
        && node.num_outputs() == 1
        && node.inputs().len()
            <= if op.class() == OpClass::Variadic && !matches!(op, crate::Op::Where(_)) { 2 } else { 3 }
        && g.tensor_type(Value::new(n, 0)).is_some_and(|t| t.dtype != crate::DType::String && t.static_dims().is_some())
}

/// Whether the fusible op `u` may join the group of its reader `n`.
fn joins(g: &Graph, u: NodeId, n: NodeId, rules: &Rules<'_>) -> bool {
    let node = g.node(u);
    node.outputs().iter().filter(|o| !o.name.is_empty()).count() == 1
        && !node.outputs()[0].name.is_empty()
        && (rules.together)(u, n)
        && static_dims(g, Value::new(u, 0)).is_some_and(|d| Some(d) == static_dims(g, Value::new(n, 0)))
}

fn static_dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(|t| t.static_dims())
}

/// Whether `nodes` (their root last) make a group: every reader of a member's value outside
/// the group comes after the root, and the values read and written fit the bindings.
fn fits(g: &Graph, nodes: &[NodeId], at: &HashMap<NodeId, usize>, held: &dyn Fn(&Value) -> bool) -> bool {
    let root = at[nodes.last().expect("a root")];
    let mut written = 1;
    for &m in &nodes[..nodes.len() - 1] {
        let readers = g.users(Value::new(m, 0));
        let outside: Vec<NodeId> = readers.iter().map(|r| r.0).filter(|r| !nodes.contains(r)).collect();
        if outside.iter().any(|r| at.get(r).is_none_or(|&p| p <= root)) {
            return false;
        }
        written += usize::from(!outside.is_empty() || held(&Value::new(m, 0)));
    }
    outside_of(g, nodes).len() + written <= MAX_BINDINGS
}

/// The values `nodes` read that none of them computes, in first-read order.
fn outside_of(g: &Graph, nodes: &[NodeId]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for &m in nodes {
        for v in g.node(m).inputs().iter().flatten() {
            if !nodes.contains(&v.node) && !out.contains(v) {
                out.push(*v);
            }
        }
    }
    out
}

/// The group of `nodes`, ordered as the program runs them (`at`).
fn group(g: &Graph, at: &HashMap<NodeId, usize>, mut nodes: Vec<NodeId>, held: &dyn Fn(&Value) -> bool) -> Group {
    nodes.sort_by_key(|n| at[n]);
    let outside = outside_of(g, &nodes);
    let sources = nodes
        .iter()
        .map(|&m| {
            g.node(m)
                .inputs()
                .iter()
                .map(|i| {
                    i.map(|v| match nodes.iter().position(|&x| x == v.node) {
                        Some(j) => Source::Member(j),
                        None => Source::Outside(outside.iter().position(|&o| o == v).expect("outside")),
                    })
                })
                .collect()
        })
        .collect();
    let last = nodes.len() - 1;
    let outputs = (0..nodes.len())
        .filter(|&j| {
            let v = Value::new(nodes[j], 0);
            j == last || held(&v) || g.users(v).iter().any(|r| !nodes.contains(&r.0))
        })
        .collect();
    Group { nodes, outside, sources, outputs }
}
