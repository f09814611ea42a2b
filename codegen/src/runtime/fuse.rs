//! Element-wise fusion: groups of element-wise ops that run as one kernel on executors that
//! can ([`Executor::fusible`]), so a chain such as a bias add, an activation and a residual
//! add — or a gradient's product and its accumulation — reads its operands once and writes
//! only its last value, in one dispatch.
//!
//! A group is a tree of ops over one output shape: every member but the root has one output,
//! read by one op only, a member of the same group, in the same part of the step (forward,
//! backward, the same model chunk); nothing else wants that value (a result, a carried state,
//! a value another chunk or the once-per-step ops read). The group runs when its root's turn
//! comes; the values its other members read stay alive until then. Where the executor finds
//! no single kernel for a group (an element type or attribute its kernels do not cover) the
//! members run one by one, as without fusion: the values are the same either way.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use ir::{Graph, NodeId, Value};

use super::{Executor, Live, NodeRun};

/// The most distinct values outside a group its members may read (a kernel binds them all,
/// its output and its parameters; adapters guarantee 8 storage buffers per shader).
pub const MAX_OUTSIDE: usize = 6;

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
    /// The members in the order they ran unfused; the root (whose output leaves the group)
    /// last.
    pub nodes: Vec<NodeId>,
    /// The values the members read that no member computes, in first-read order.
    pub outside: Vec<Value>,
    /// Per member, per input slot: where it comes from (`None`: an omitted input).
    pub sources: Vec<Vec<Option<Source>>>,
}

/// The groups of one device's program.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    /// By root.
    groups: HashMap<NodeId, Group>,
    /// Members that run with their group's root.
    inner: HashSet<NodeId>,
}

impl Fusion {
    /// Groups the ops of `g` (`order`: topologically) for which `fusible` holds: an op joins
    /// the group of the op reading its only output when nothing else reads it, `held` does
    /// not keep it, `together` says the two run in the same part of the step and their
    /// output shapes are equal; a group reads at most [`MAX_OUTSIDE`] outside values.
    pub fn plan(
        g: &Graph,
        order: &[NodeId],
        fusible: &dyn Fn(NodeId) -> bool,
        held: &dyn Fn(&Value) -> bool,
        together: &dyn Fn(NodeId, NodeId) -> bool,
    ) -> Fusion {
        // Members of the group rooted at each fusible op, before it joins a later one.
        let mut members: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        let mut inner: HashSet<NodeId> = HashSet::new();
        for &n in order {
            if !fusible(n) {
                continue;
            }
            let mut nodes: Vec<NodeId> = Vec::new();
            for v in g.node(n).inputs().iter().flatten() {
                let u = v.node;
                if nodes.contains(&u) || !members.contains_key(&u) || !joins(g, *v, n, held, together) {
                    continue;
                }
                let mut candidate = nodes.clone();
                candidate.extend(members[&u].iter().copied());
                candidate.push(n);
                if outside_of(g, &candidate).len() <= MAX_OUTSIDE {
                    nodes.extend(members.remove(&u).expect("a group"));
                }
            }
            inner.extend(nodes.iter().copied());
            nodes.push(n);
            members.insert(n, nodes);
        }
        let groups: HashMap<NodeId, Group> =
            members.into_iter().filter(|(_, m)| m.len() > 1).map(|(root, m)| (root, group(g, order, m))).collect();
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

/// Whether `v`, an output of a fusible op, may stay inside the group of its reader `n`.
fn joins(
    g: &Graph,
    v: Value,
    n: NodeId,
    held: &dyn Fn(&Value) -> bool,
    together: &dyn Fn(NodeId, NodeId) -> bool,
) -> bool {
    let u = g.node(v.node);
    let named = u.outputs().iter().filter(|o| !o.name.is_empty()).count();
    named == 1
        && !held(&v)
        && g.users(v).iter().all(|&(m, slot)| m == n && slot != usize::MAX)
        && together(v.node, n)
        && static_dims(g, v).is_some_and(|d| Some(d) == static_dims(g, Value::new(n, 0)))
}

fn static_dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(|t| t.static_dims())
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

/// The group of `members`, ordered as `order` runs them.
fn group(g: &Graph, order: &[NodeId], mut nodes: Vec<NodeId>) -> Group {
    let at: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
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
    Group { nodes, outside, sources }
}

impl<E: Executor> NodeRun<'_, '_, E> {
    /// Runs group `grp` of micro-batch `micro`: its root's output, computed by one kernel, or
    /// by the members one by one where the executor has none for the group.
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
        if let Some(t) = self.e.run_fused(g, grp, &outside).map_err(|m| format!("{}: {m}", g.describe(root)))? {
            self.e.sync();
            let dt = t0.elapsed().as_secs_f64();
            *self.report.by_op.entry("Fused".to_string()).or_insert(0.0) += dt;
            let phase = self.phase.get(&root).copied().unwrap_or("forward");
            *self.report.by_phase.entry(phase.to_string()).or_insert(0.0) += dt;
            return Ok(vec![(Value::new(root, 0), t)]);
        }
        // No kernel for the group: its members one by one.
        let (&root, members) = grp.nodes.split_last().expect("a member");
        for &m in members {
            let produced = self.node(m, env, fixed, inputs, micro)?;
            self.store(produced, env, live);
        }
        let out = self.node(root, env, fixed, inputs, micro)?;
        for &m in members {
            if let Some(t) = env.remove(&Value::new(m, 0)) {
                live.remove(self.e.storage(&t));
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

    #[test]
    fn a_chain_of_single_reader_values_is_one_group() {
        let g = parse(
            "<ir_version: 8, opset_import: [\"\" : 18]>\nm (float[2,3] x, float[3] b, float[2,3] r) => (y) {\n  \
             t = Add (x, b)\n  s = Sigmoid (t)\n  u = Mul (t, s)\n  v = Add (u, r)\n  y = Relu (v)\n}",
        );
        let order = g.topo_order().expect("acyclic");
        let f = Fusion::plan(&g, &order, &elementwise(&g), &|_| false, &|_, _| true);
        // `t` has two readers: it stays a value of its own; the rest joins the Relu's group.
        let groups: Vec<&Group> = f.groups().collect();
        assert_eq!(groups.len(), 1, "{groups:?}");
        let names: Vec<&str> = groups[0].nodes.iter().map(|&n| g.node(n).op.op_type()).collect();
        assert_eq!(names, ["Sigmoid", "Mul", "Add", "Relu"]);
        let outside: Vec<&str> = groups[0].outside.iter().map(|&v| g.value_name(v)).collect();
        assert_eq!(outside, ["t", "r"]);
        assert_eq!(groups[0].sources[1], vec![Some(Source::Outside(0)), Some(Source::Member(0))]);
        let add = groups[0].nodes[0];
        assert!(f.deferred(add) && f.reads(&g, add).is_empty());
        let root = groups[0].nodes[3];
        assert_eq!(f.reads(&g, root).len(), 2);
    }

    #[test]
    fn held_values_broadcast_results_and_other_parts_end_a_group() {
        let g = parse(
            "<ir_version: 8, opset_import: [\"\" : 18]>\nm (float[2,3] x, float[2,1] c) => (y, z) {\n  \
             a = Neg (c)\n  t = Add (x, a)\n  u = Exp (t)\n  y = Relu (u)\n  w = Abs (x)\n  z = Sigmoid (w)\n}",
        );
        let order = g.topo_order().expect("acyclic");
        let name = |n: NodeId| g.node(n).op.op_type();
        // `a` is [2,1] and read broadcast: not inside the Add's group; `u` is held.
        let held = |v: &Value| g.value_name(*v) == "u";
        let apart = |a: NodeId, b: NodeId| !(name(a) == "Abs" && name(b) == "Sigmoid");
        let f = Fusion::plan(&g, &order, &elementwise(&g), &held, &apart);
        let groups: Vec<Vec<&str>> = f.groups().map(|grp| grp.nodes.iter().map(|&n| name(n)).collect()).collect();
        assert_eq!(groups, vec![vec!["Add", "Exp"]]);
        let mut last = g.last_uses(&order);
        let before = last.clone();
        f.delay_last_uses(&order, &mut last);
        let exp = order.iter().position(|&n| name(n) == "Exp").expect("Exp");
        let a = g.lookup("a").expect("a");
        assert_eq!((before[&a], last[&a]), (order.iter().position(|&n| name(n) == "Add").expect("Add"), exp));
    }
}
