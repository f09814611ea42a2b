//! Element-wise fusion: groups of element-wise ops that run as one kernel on executors that
//! can ([`Executor::fusible`]), so a chain such as a bias add, an activation and a residual
//! add — or a gradient's product and its accumulation — reads its operands once, keeps its
//! intermediate values in registers and runs as one dispatch.
//!
//! A group's members have one output each, all of one shape, and run in the same part of the
//! step (forward or backward, one model chunk). The group runs when its last member's (its
//! root's) turn comes; the values its other members read stay alive until then. A member's
//! value leaves the group — the kernel writes it — when something outside the group reads it
//! or the run keeps it (a result, a value the backward part or another chunk reads); every
//! such reader comes after the root in the program's order, so it finds the value written.
//! Where the executor has no single kernel for a group (an element type or attribute its
//! kernels do not cover) the members run one by one, as without fusion: the values are the
//! same either way.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use ir::{Graph, NodeId, Value};

use super::{Executor, Live, NodeRun};

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

/// The groups of one device's program.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    /// By root.
    groups: HashMap<NodeId, Group>,
    /// Members that run with their group's root.
    inner: HashSet<NodeId>,
}

/// What [`Fusion::plan`] asks of a program.
pub struct Rules<'a> {
    /// Ops that may be members.
    pub fusible: &'a dyn Fn(NodeId) -> bool,
    /// Values the run keeps past their readers (written by a group's kernel).
    pub held: &'a dyn Fn(&Value) -> bool,
    /// Whether two ops always run in the same part of the step.
    pub together: &'a dyn Fn(NodeId, NodeId) -> bool,
}

impl Fusion {
    /// Groups the ops of `g` (`order`: topologically) that `rules` allow: an op joins the
    /// group of an op reading its output when both run in the same part of the step, their
    /// output shapes are equal, every reader outside the group comes after that op, and the
    /// group binds at most [`MAX_BINDINGS`] values.
    pub fn plan(g: &Graph, order: &[NodeId], rules: &Rules<'_>) -> Fusion {
        let at: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        // Members of the group rooted at each fusible op, before it joins a later one.
        let mut members: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        let mut inner: HashSet<NodeId> = HashSet::new();
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
            inner.extend(nodes.iter().copied());
            nodes.push(n);
            members.insert(n, nodes);
        }
        let groups: HashMap<NodeId, Group> = members
            .into_iter()
            .filter(|(_, m)| m.len() > 1)
            .map(|(root, m)| (root, group(g, &at, m, rules.held)))
            .collect();
        let inner = inner.into_iter().filter(|n| !groups.contains_key(n)).collect();
        Fusion { groups, inner }
    }

    /// The group rooted at `n`, if any.
    pub fn root(&self, n: NodeId) -> Option<&Group> {
        self.groups.get(&n)
    }

    /// Whether `n` runs with a later op's group rather than at its own turn.
    pub fn deferred(&self, n: NodeId) -> bool {
        self.inner.contains(&n)
    }

    /// The groups, by root.
    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.values()
    }

    /// The values read when `n`'s turn comes: its inputs, a group root's every member's
    /// outside values, nothing for a deferred member.
    pub fn reads(&self, g: &Graph, n: NodeId) -> Vec<Value> {
        if self.inner.contains(&n) {
            return Vec::new();
        }
        match self.groups.get(&n) {
            Some(grp) => grp.outside.clone(),
            None => g.node(n).inputs().iter().flatten().copied().collect(),
        }
    }

    /// Moves the last use (`order` positions) of what a deferred member reads to its root.
    pub fn delay_last_uses(&self, order: &[NodeId], last_use: &mut HashMap<Value, usize>) {
        let at: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        for (root, grp) in &self.groups {
            for v in &grp.outside {
                let e = last_use.entry(*v).or_insert(at[root]);
                *e = (*e).max(at[root]);
            }
        }
    }
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

impl<E: Executor> NodeRun<'_, '_, E> {
    /// Runs group `grp` of micro-batch `micro`: the values it writes ([`Group::outputs`]),
    /// computed by one kernel, or by the members one by one where the executor has none.
    pub(super) fn fused(
        &mut self,
        grp: &Group,
        env: &mut HashMap<Value, E::Tensor>,
        fixed: &HashMap<Value, E::Tensor>,
        inputs: &HashMap<String, E::Tensor>,
        micro: usize,
        live: &mut Live,
    ) -> Result<Vec<(Value, E::Tensor)>, String> {
        let g = self.g;
        let root = *grp.nodes.last().expect("a member");
        let outside: Vec<&E::Tensor> = grp
            .outside
            .iter()
            .map(|v| {
                env.get(v)
                    .or_else(|| fixed.get(v))
                    .ok_or_else(|| format!("{}: its input `{}` was not computed", g.describe(root), g.value_name(*v)))
            })
            .collect::<Result<_, _>>()?;
        let t0 = Instant::now();
        let written = |j: &usize| Value::new(grp.nodes[*j], 0);
        if let Some(ts) = self.e.run_fused(g, grp, &outside).map_err(|m| format!("{}: {m}", g.describe(root)))? {
            self.e.sync();
            let dt = t0.elapsed().as_secs_f64();
            *self.report.by_op.entry("Fused".to_string()).or_insert(0.0) += dt;
            let phase = self.phase.get(&root).copied().unwrap_or("forward");
            *self.report.by_phase.entry(phase.to_string()).or_insert(0.0) += dt;
            return Ok(grp.outputs.iter().map(written).zip(ts).collect());
        }
        // No kernel for the group: its members one by one.
        for &m in &grp.nodes {
            let produced = self.node(m, env, fixed, inputs, micro)?;
            self.store(produced, env, live);
        }
        let mut out = Vec::new();
        for j in 0..grp.nodes.len() {
            if let Some(t) = env.remove(&Value::new(grp.nodes[j], 0)) {
                live.remove(self.e.storage(&t));
                if grp.outputs.contains(&j) {
                    out.push((written(&j), t));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Graph {
        let mut m = frontend::parse(text).unwrap_or_else(|d| panic!("{d:?}")).model;
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).expect("infers");
        m.graph
    }

    fn elementwise(g: &Graph) -> impl Fn(NodeId) -> bool + '_ {
        |n| matches!(g.node(n).op.class(), ir::OpClass::Unary | ir::OpClass::Binary)
    }

    fn names<'g>(g: &'g Graph, grp: &Group) -> Vec<&'g str> {
        grp.nodes.iter().map(|&n| g.node(n).op.op_type()).collect()
    }

    #[test]
    fn a_chain_and_the_values_it_reads_twice_are_one_group() {
        let g = parse(
            "<ir_version: 8, opset_import: [\"\" : 18]>\nm (float[2,3] x, float[3] b, float[2,3] r) => (y) {\n  \
             t = Add (x, b)\n  s = Sigmoid (t)\n  u = Mul (t, s)\n  v = Add (u, r)\n  y = Relu (v)\n}",
        );
        let order = g.topo_order().expect("acyclic");
        let rules = Rules { fusible: &elementwise(&g), held: &|_| false, together: &|_, _| true };
        let f = Fusion::plan(&g, &order, &rules);
        let groups: Vec<&Group> = f.groups().collect();
        assert_eq!(groups.len(), 1, "{groups:?}");
        assert_eq!(names(&g, groups[0]), ["Add", "Sigmoid", "Mul", "Add", "Relu"]);
        let outside: Vec<&str> = groups[0].outside.iter().map(|&v| g.value_name(v)).collect();
        assert_eq!(outside, ["x", "b", "r"]);
        // `t`, read by the Sigmoid and the Mul, stays in registers: only the root is written.
        assert_eq!(groups[0].sources[2], vec![Some(Source::Member(0)), Some(Source::Member(1))]);
        assert_eq!(groups[0].outputs, [4]);
        let add = groups[0].nodes[0];
        assert!(f.deferred(add) && f.reads(&g, add).is_empty());
        assert_eq!(f.reads(&g, groups[0].nodes[4]).len(), 3);
    }

    #[test]
    fn kept_values_are_written_and_earlier_readers_broadcasts_and_other_parts_end_a_group() {
        let g = parse(
            "<ir_version: 8, opset_import: [\"\" : 18]>\nm (float[2,3] x, float[2,1] c) => (y, z, k) {\n  \
             a = Neg (c)\n  t = Add (x, a)\n  u = Exp (t)\n  y = Relu (u)\n  w = Abs (x)\n  z = Sigmoid (w)\n  \
             p = Exp (x)\n  s = ReduceSum (p)\n  q = Mul (p, p)\n  k = Add (q, s)\n}",
        );
        let order = g.topo_order().expect("acyclic");
        let name = |n: NodeId| g.node(n).op.op_type();
        let at = |v: &str| order.iter().position(|&n| n == g.lookup(v).expect("a value").node).expect("ordered");
        assert!(at("s") < at("q"), "the test wants the ReduceSum between the Exp and the Mul");
        // `a` is [2,1], read broadcast: not in the Add's group; `u` is kept: written.
        let held = |v: &Value| g.value_name(*v) == "u";
        let apart = |a: NodeId, b: NodeId| !(name(a) == "Abs" && name(b) == "Sigmoid");
        let f = Fusion::plan(&g, &order, &Rules { fusible: &elementwise(&g), held: &held, together: &apart });
        let mut groups: Vec<(Vec<&str>, Vec<usize>)> =
            f.groups().map(|grp| (names(&g, grp), grp.outputs.clone())).collect();
        groups.sort();
        // `p` is read by the ReduceSum before the Mul runs: it stays out of the Mul's group.
        assert_eq!(groups, vec![(vec!["Add", "Exp", "Relu"], vec![1, 2]), (vec!["Mul", "Add"], vec![1])]);
        let mut last = g.last_uses(&order);
        let before = last.clone();
        f.delay_last_uses(&order, &mut last);
        let a = g.lookup("a").expect("a");
        assert_eq!((before[&a], last[&a]), (at("t"), at("y")));
    }
}
