//! `canonicalize`: the normal form later passes expect.
//!
//! - `Constant` nodes become initializers (constants, never trained: [`ir::cost::FROZEN`]),
//!   and so do initializers holding an infinity or NaN (an additive mask);
//! - an `If` whose condition is known is replaced by the nodes of the branch it takes (its
//!   nested control flow too, when that becomes known);
//! - `Identity` and inference-mode `Dropout` (mask unused) are bypassed;
//! - values computable from constants (`Shape → Gather → Concat → Reshape` chains over
//!   static shapes, arithmetic on constants) are folded into initializers, up to
//!   [`FOLD_LIMIT`](ir::infer) elements each;
//! - dead nodes and unused initializers are removed (graph inputs stay: they are the
//!   interface);
//! - equal constants and equal computations are merged (common subexpressions);
//! - shapes are inferred again.
//!
//! Graph outputs keep their names and types. Precondition: the graph verifies.

use std::collections::HashMap;

use ir::eval::Array;
use ir::infer::{Mode, infer_shapes};
use ir::{Graph, NodeId, Op, OpClass, Output, Value};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// An initializer this pass made from a `Constant` or by folding stays a constant: never a
/// parameter ([`ir::cost::FROZEN`]), as the `Constant` it was is never trained.
fn constant(g: &mut Graph, v: Value) {
    if ir::cost::is_param(g, v) {
        ir::cost::freeze(g, v);
    }
}

/// The canonicalization pass.
#[derive(Default)]
pub struct Canonicalize;

fn is_source(op: &Op) -> bool {
    matches!(op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef)
}

/// Replaces every use of output 0 of `n` by `from` and removes `n`, keeping the name of a
/// graph output. Returns false (and changes nothing) when that is not possible.
fn bypass(g: &mut Graph, n: NodeId, from: Value) -> bool {
    let out = Value::new(n, 0);
    if g.is_output(out) {
        // The graph output's name must survive: give it to `from`, if `from` is an op's
        // private value.
        let from_is_private = !is_source(&g.node(from.node).op) && !g.is_output(from) && g.users(from).len() == 1;
        if !from_is_private {
            return false;
        }
        let name = g.value_name(out).to_string();
        let tmp = g.fresh_name(&format!("{name}.bypassed"));
        g.rename(out, tmp);
        g.rename(from, name);
        let ty = g.outputs().iter().find(|o| o.value == out).and_then(|o| o.ty.clone());
        if g.value_type(from).is_none() {
            g.set_type(from, ty);
        }
    }
    g.replace_all_uses(out, from);
    for slot in 0..g.node(n).num_outputs() {
        if g.is_used(Value::new(n, slot as u16)) {
            return true;
        }
    }
    g.remove_node(n);
    true
}

/// Bypasses every `Identity` of `g` as [`Canonicalize`] does (a graph output keeps its name,
/// taken over by the op computing it; a parameter is never renamed), and nothing else: for
/// graphs that must keep their parameters as written (`train`) yet match a plan made of the
/// canonical form. Returns how many were bypassed.
pub fn bypass_identities(g: &mut Graph) -> u64 {
    let Ok(order) = g.topo_order() else { return 0 };
    bypass_each(g, &order, identity_input)
}

/// Bypasses ([`bypass`]), in `order`, each node of `g` for which `pick` names the value it
/// passes on; returns how many.
fn bypass_each(g: &mut Graph, order: &[NodeId], pick: impl Fn(&Graph, NodeId) -> Option<Value>) -> u64 {
    let mut bypassed = 0;
    for &n in order {
        if g.contains(n)
            && let Some(from) = pick(g, n)
            && bypass(g, n, from)
        {
            bypassed += 1;
        }
    }
    bypassed
}

/// An `Identity`'s input.
fn identity_input(g: &Graph, n: NodeId) -> Option<Value> {
    let node = g.node(n);
    if matches!(node.op, Op::Identity(_)) { node.input(0) } else { None }
}

/// An inference-mode `Dropout`'s input (training off or absent, its mask unused).
fn inference_dropout_input(g: &Graph, n: NodeId) -> Option<Value> {
    let node = g.node(n);
    if !matches!(node.op, Op::Dropout(_)) {
        return None;
    }
    let training = node.input(2);
    let mask_used = node.num_outputs() > 1 && g.is_used(Value::new(n, 1));
    let inference = training.is_none()
        || g.initializer(training.expect("checked"))
            .and_then(|t| t.to_i64_vec())
            .is_some_and(|v| v.iter().all(|&x| x == 0));
    if inference && !mask_used { node.input(0) } else { None }
}

/// Replaces the `If` node `n` by the nodes of its `then` (or `else`) branch: the branch's
/// references to this graph become the values they name, its initializers and ops are added
/// under fresh names (nested subgraphs follow the renaming), and each output of `n` becomes
/// an `Identity` of the branch's output under the same name. Returns false (and changes
/// nothing) when the branch is absent or refers to a value `n` does not capture.
pub fn inline_if(g: &mut Graph, n: NodeId, then: bool) -> bool {
    let Op::If(i) = &g.node(n).op else { return false };
    let Some(b) = (if then { i.then_branch.clone() } else { i.else_branch.clone() }) else { return false };
    let Ok(order) = b.topo_order() else { return false };
    let captured: HashMap<String, Value> =
        g.node(n).captures().iter().map(|&c| (g.value_name(c).to_string(), c)).collect();
    if order
        .iter()
        .any(|&m| matches!(b.node(m).op, Op::OuterRef) && !captured.contains_key(b.value_name(Value::new(m, 0))))
        || b.outputs().len() < g.node(n).num_outputs()
    {
        return false;
    }
    let span = g.span(n);
    let mut map: HashMap<Value, Value> = HashMap::new();
    let mut renamed: HashMap<String, String> = HashMap::new();
    for &m in &order {
        let node = b.node(m);
        match &node.op {
            Op::OuterRef => {
                let v = Value::new(m, 0);
                map.insert(v, captured[b.value_name(v)]);
            }
            Op::Initializer(t) => {
                let v = Value::new(m, 0);
                let name = g.fresh_name(b.value_name(v));
                if name != b.value_name(v) {
                    renamed.insert(b.value_name(v).to_string(), name.clone());
                }
                let w = g.add_initializer(name, t.clone());
                g.set_type(w, b.value_type(v).cloned());
                map.insert(v, w);
            }
            op => {
                let mut op = op.clone();
                let outputs: Vec<Output> = node
                    .outputs()
                    .iter()
                    .map(|o| {
                        if o.name.is_empty() {
                            return o.clone();
                        }
                        let name = g.fresh_name(&o.name);
                        if name != o.name {
                            renamed.insert(o.name.clone(), name.clone());
                        }
                        Output { name, ty: o.ty.clone() }
                    })
                    .collect();
                if op.has_subgraphs() && !renamed.is_empty() {
                    op.rename_outer_refs(&renamed);
                }
                let inputs = node.inputs().iter().map(|v| v.map(|v| map[&v])).collect();
                let captures: Vec<Value> = node.captures().iter().map(|v| map[v]).collect();
                let k = node.outputs().len();
                let id = g.add_labeled_node(node.label.clone(), op, inputs, outputs);
                if !captures.is_empty() {
                    g.set_captures(id, captures);
                }
                if let Some(sp) = b.span(m).or(span) {
                    g.set_span(id, sp);
                }
                for slot in 0..k as u16 {
                    map.insert(Value::new(m, slot), Value::new(id, slot));
                }
            }
        }
    }
    for (k, o) in b.outputs().iter().enumerate().take(g.node(n).num_outputs()) {
        let out = Value::new(n, k as u16);
        let name = g.value_name(out).to_string();
        let ty = g.value_type(out).cloned();
        if name.is_empty() {
            continue;
        }
        let tmp = g.fresh_name(&format!("{name}.inlined"));
        g.rename(out, tmp);
        let id = g.add_node(Op::Identity(Default::default()), vec![Some(map[&o.value])], vec![Output { name, ty }]);
        if let Some(sp) = span {
            g.set_span(id, sp);
        }
        g.replace_all_uses(out, Value::new(id, 0));
    }
    g.set_inputs(n, vec![]);
    g.set_captures(n, vec![]);
    for slot in 0..g.node(n).num_outputs() {
        if g.is_used(Value::new(n, slot as u16)) {
            return true;
        }
    }
    g.remove_node(n);
    true
}

/// Inlines every `If` whose condition shape inference can compute, until none is left.
/// Returns how many were inlined.
fn inline_known_ifs(g: &mut Graph) -> Result<u64, Vec<ir::infer::ShapeError>> {
    let mut inlined = 0;
    loop {
        if !g.node_ids().any(|n| matches!(g.node(n).op, Op::If(_))) {
            return Ok(inlined);
        }
        let report = infer_shapes(g, Mode::Check)?;
        let known: Vec<(NodeId, bool)> = g
            .node_ids()
            .filter(|&n| matches!(g.node(n).op, Op::If(_)))
            .filter_map(|n| {
                let c = report.consts.get(&g.node(n).input(0)?)?;
                let c = c.to_f64().ok()?.first().copied()?;
                Some((n, c != 0.0))
            })
            .collect();
        let mut any = false;
        for (n, then) in known {
            if inline_if(g, n, then) {
                inlined += 1;
                any = true;
            }
        }
        if !any {
            return Ok(inlined);
        }
    }
}

/// Removes operator nodes none of whose outputs is used, and unused initializers, until
/// nothing changes. Communication ops are kept (they have effects on other devices).
pub fn eliminate_dead_code(g: &mut Graph) -> u64 {
    let mut removed = 0;
    loop {
        let Ok(order) = g.topo_order() else { return removed };
        let mut any = false;
        for &n in order.iter().rev() {
            let node = g.node(n);
            if matches!(node.op, Op::Input { .. } | Op::OuterRef) || node.op.class() == OpClass::Comm {
                continue;
            }
            let used = (0..node.num_outputs()).any(|s| g.is_used(Value::new(n, s as u16)));
            if !used {
                g.remove_node(n);
                removed += 1;
                any = true;
            }
        }
        if !any {
            return removed;
        }
    }
}

/// Removes initializers nothing reads (graph inputs stay).
pub fn eliminate_unused_initializers(g: &mut Graph) -> u64 {
    let dead: Vec<NodeId> = g
        .initializers()
        .iter()
        .copied()
        .filter(|&n| matches!(g.node(n).op, Op::Initializer(_)) && !g.is_used(Value::new(n, 0)))
        .collect();
    for &n in &dead {
        g.remove_node(n);
    }
    dead.len() as u64
}

/// Constants of at most this many elements are compared by value to be merged.
const MERGE_CONSTANTS_UP_TO: u64 = 4096;

/// Merges equal computations (hash-consing, as an e-graph holds each term once): inline
/// constants that are not parameters ([`ir::cost::is_param`]: trained tensors stay apart even
/// when their values agree) with the same type and values, of at most
/// [`MERGE_CONSTANTS_UP_TO`] elements; then, in topological order, ops equal to an earlier op
/// (same operator and attributes) reading the same values. Exporters repeat per layer what
/// every layer computes alike (BERT writes each layer's attention mask `Where(mask, 0, -inf)`
/// with its own two constants). Left apart: ops with subgraphs or captures, `Dropout` (its
/// mask is drawn), communication, values a subgraph captures, and ops whose outputs are graph
/// outputs (the outputs keep their names). Returns (constants merged, ops merged).
pub fn eliminate_common_subexpressions(g: &mut Graph) -> (u64, u64) {
    let captured = |g: &Graph, v: Value| g.users(v).iter().any(|&(_, i)| i == usize::MAX);
    let mut constants = 0;
    let mut seen: HashMap<String, Value> = HashMap::new();
    for n in g.initializers().to_vec() {
        let v = Value::new(n, 0);
        let Op::Initializer(t) = &g.node(n).op else { continue };
        if t.is_external() || t.numel() > MERGE_CONSTANTS_UP_TO || ir::cost::is_param(g, v) {
            continue;
        }
        if captured(g, v) || g.is_output(v) {
            continue;
        }
        let key = format!("{:?}|{:?}|{:?}", t.dtype, t.dims, t.data);
        match seen.get(&key) {
            Some(&first) => {
                g.replace_all_uses(v, first);
                g.remove_node(n);
                constants += 1;
            }
            None => {
                seen.insert(key, v);
            }
        }
    }
    let mut ops = 0;
    let Ok(order) = g.topo_order() else { return (constants, 0) };
    let mut seen: HashMap<String, Vec<NodeId>> = HashMap::new();
    for n in order {
        let node = g.node(n);
        if is_source(&node.op)
            || node.op.class() == OpClass::Comm
            || node.op.has_subgraphs()
            || matches!(node.op, Op::Dropout(_))
            || !node.captures().is_empty()
        {
            continue;
        }
        let outs: Vec<Value> = (0..node.num_outputs()).map(|s| Value::new(n, s as u16)).collect();
        if outs.iter().any(|&v| g.is_output(v) || captured(g, v)) {
            continue;
        }
        let key = format!("{}|{:?}", node.op.op_type(), node.inputs());
        let same = seen.get(&key).and_then(|earlier| {
            earlier.iter().copied().find(|&e| {
                g.node(e).op == node.op
                    && g.node(e).num_outputs() == outs.len()
                    // Every output this op's readers use is one the earlier op names.
                    && outs.iter().all(|&v| !g.is_used(v) || !g.value_name(Value::new(e, v.slot)).is_empty())
            })
        });
        match same {
            Some(e) => {
                for v in outs {
                    if g.is_used(v) {
                        g.replace_all_uses(v, Value::new(e, v.slot));
                    }
                }
                g.remove_node(n);
                ops += 1;
            }
            None => seen.entry(key).or_default().push(n),
        }
    }
    (constants, ops)
}

impl Pass for Canonicalize {
    fn name(&self) -> &'static str {
        "canonicalize"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let order =
            g.topo_order().map_err(|_| PassError::new(self.name(), Located::global("the graph has a cycle")))?;

        // Control flow whose condition is known.
        let inlined = inline_known_ifs(g).map_err(|errs| PassError::shapes(self.name(), errs))?;
        cx.stats.add("if nodes inlined", inlined);
        let order = if inlined > 0 { g.topo_order().expect("inlining keeps the graph acyclic") } else { order };

        // Constants become initializers.
        for &n in &order {
            if let Op::Constant(_) = &g.node(n).op {
                let op = g.node(n).op.clone();
                match ir::eval::eval_op(&op, &[], 1, g.opset) {
                    Ok(mut a) => {
                        g.set_op(n, Op::Initializer(a.remove(0).to_tensor()));
                        g.set_label(n, None);
                        constant(g, Value::new(n, 0));
                        cx.stats.add("constants made initializers", 1);
                    }
                    Err(e) => cx.warnings.push(Located::at(g, n, format!("cannot evaluate {}: {e}", g.describe(n)))),
                }
            }
        }

        // Buffers no step can train (an additive mask's `-inf`) are constants, as for `train`:
        // the search prices no gradient or update for them.
        let frozen = ir::cost::freeze_non_finite(g);
        cx.stats.add("non-finite buffers made constants", frozen.len() as u64);

        // Identity and inference-mode Dropout.
        let removed = bypass_each(g, &order, |g, n| identity_input(g, n).or_else(|| inference_dropout_input(g, n)));
        if removed > 0 {
            cx.stats.add("identities removed", removed);
        }

        // Fold what shape inference could compute.
        let report = infer_shapes(g, Mode::Check).map_err(|errs| PassError::shapes(self.name(), errs))?;
        let order = g.topo_order().expect("still acyclic");
        // What is computed from a parameter stays computed: folded, the parameter would get no
        // gradient (a class token expanded to the batch, a bias reshaped for broadcasting).
        let trained = ir::cost::grad_flow(g, &order);
        for n in order {
            if !g.contains(n) || is_source(&g.node(n).op) || g.node(n).op.class() == OpClass::Comm {
                continue;
            }
            if (0..g.node(n).num_outputs()).any(|s| trained.contains(&Value::new(n, s as u16))) {
                continue;
            }
            let k = g.node(n).num_outputs();
            let outs: Vec<Option<&Array>> = (0..k).map(|s| report.consts.get(&Value::new(n, s as u16))).collect();
            if outs.iter().any(Option::is_none) || k == 0 {
                continue;
            }
            let arrays: Vec<Array> = outs.into_iter().map(|a| a.expect("checked").clone()).collect();
            if k == 1 {
                g.make_initializer(n, arrays[0].to_tensor());
                constant(g, Value::new(n, 0));
            } else {
                for (slot, a) in arrays.into_iter().enumerate() {
                    let v = Value::new(n, slot as u16);
                    if g.value_name(v).is_empty() || !g.is_used(v) {
                        continue;
                    }
                    let name = g.value_name(v).to_string();
                    let tmp = g.fresh_name(&format!("{name}.folded"));
                    g.rename(v, tmp);
                    let init = g.add_initializer(name, a.to_tensor());
                    constant(g, init);
                    g.replace_all_uses(v, init);
                }
            }
            cx.stats.add("nodes folded", 1);
        }

        let removed = eliminate_dead_code(g);
        cx.stats.add("dead nodes removed", removed);

        let (constants, ops) = eliminate_common_subexpressions(g);
        cx.stats.add("equal constants merged", constants);
        cx.stats.add("equal computations merged", ops);

        let report = infer_shapes(g, Mode::Check).map_err(|errs| PassError::shapes(self.name(), errs))?;
        cx.warnings.extend(report.warnings.into_iter().map(Located::from));
        Ok(Changed::Yes)
    }
}
