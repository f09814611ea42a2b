//! Element-wise fusion in the runtime: the groups of [`ir::fusion`] over a device's program
//! run as one kernel on executors that can ([`Executor::fusible`]), so a chain such as a bias
//! add, an activation and a residual add — or a gradient's product and its accumulation —
//! reads its operands once, keeps its intermediate values in registers and runs as one
//! dispatch. Parts of the step are the runtime's (forward or backward, one model chunk; not
//! the once-per-step ops); held values are results, carried values and what another chunk
//! reads. A group runs at its root's turn; the values its other members read stay alive until
//! then. Where the executor has no single kernel for a group (an element type or attribute
//! its kernels do not cover) the members run one by one, as without fusion: the values are
//! the same either way.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

pub use ir::fusion::{Group, MAX_BINDINGS, Rules, Source};
use ir::{Graph, NodeId, Value};

use super::{Executor, Live, NodeRun};

/// The groups of one device's program.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    /// By root.
    groups: HashMap<NodeId, Group>,
    /// Members that run with their group's root.
    inner: HashSet<NodeId>,
}

impl Fusion {
    /// The groups of `g` ([`ir::fusion::groups`]) as the runtime runs them.
    pub fn plan(g: &Graph, order: &[NodeId], rules: &Rules<'_>) -> Fusion {
        let groups: HashMap<NodeId, Group> = ir::fusion::groups(g, order, rules)
            .into_iter()
            .map(|grp| (*grp.nodes.last().expect("a root"), grp))
            .collect();
        let inner = groups.values().flat_map(|grp| grp.nodes[..grp.nodes.len() - 1].iter().copied()).collect();
        Fusion { groups, inner }
    }

    /// The groups of a device's program `g` (`order`) that run fused on `e` (none unless
    /// `on`): a group stays in one part of the step as `cut` runs it, and writes the values
    /// the run keeps (`held`).
    pub(super) fn of_device<E: Executor>(
        e: &E,
        g: &Graph,
        order: &[NodeId],
        cut: &crate::cut::Cut,
        on: bool,
        held: &dyn Fn(&Value) -> bool,
    ) -> Fusion {
        let rules = Rules { fusible: &|n| on && e.fusible(g, n), held, together: &|a, b| cut.same_part(a, b) };
        Fusion::plan(g, order, &rules)
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
            self.timed(ir::fusion::FUSED, root, t0.elapsed().as_secs_f64());
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
