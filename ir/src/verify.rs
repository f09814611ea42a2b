//! The verifier: structural invariants of a graph, with errors keyed by node.
//!
//! Checks: every input names a live value; one definition per name; no cycles; graph outputs
//! exist; each known op has an admissible number of inputs and outputs; element types agree
//! where an op requires it; initializers hold as many values as their shape says.
//! Shapes are checked by shape inference, not here.

use std::collections::HashMap;
use std::fmt;

use crate::graph::attr::AttrValue;
use crate::graph::op::Op;
use crate::graph::{Graph, NodeId};
use crate::ops::TypeRule;
use crate::types::{DType, Type};

/// One verifier finding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// The node at fault, when one is.
    pub at: Option<NodeId>,
    /// What is wrong.
    pub msg: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

/// All findings of one run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} verifier error(s); first: {}", .0.len(), .0.first().map(|e| e.msg.as_str()).unwrap_or(""))]
pub struct VerifyErrors(pub Vec<VerifyError>);

/// Admissible input and output counts of an op: `(min_in, max_in, min_out, max_out)` (see
/// [`crate::ops::OpRules::arity`]).
pub fn arity(op: &Op) -> (usize, usize, usize, usize) {
    let a = op.arity();
    (a.min_in, a.max_in, a.min_out, a.max_out)
}

fn count(n: usize) -> String {
    if n == usize::MAX { "any number of".into() } else { n.to_string() }
}

/// Checks `g` (and its subgraphs). `Ok(())` or every finding.
pub fn verify(g: &Graph) -> Result<(), VerifyErrors> {
    let mut errs = Vec::new();
    verify_into(g, &mut errs);
    if errs.is_empty() { Ok(()) } else { Err(VerifyErrors(errs)) }
}

fn verify_into(g: &Graph, errs: &mut Vec<VerifyError>) {
    let mut defined: HashMap<&str, NodeId> = HashMap::new();
    for n in g.node_ids() {
        let node = g.node(n);
        for o in node.outputs() {
            if o.name.is_empty() {
                continue;
            }
            if let Some(prev) = defined.insert(o.name.as_str(), n)
                && (prev != n || node.outputs().iter().filter(|x| x.name == o.name).count() > 1)
            {
                errs.push(VerifyError {
                    at: Some(n),
                    msg: format!("value `{}` is defined twice (also by {})", o.name, g.describe(prev)),
                });
            }
        }
    }

    for n in g.node_ids() {
        let node = g.node(n);
        for (i, inp) in node.inputs().iter().enumerate() {
            if let Some(v) = inp {
                if !g.contains(v.node) || usize::from(v.slot) >= g.node(v.node).num_outputs() {
                    errs.push(VerifyError { at: Some(n), msg: format!("input {i} of {} is undefined", g.describe(n)) });
                } else if g.value_name(*v).is_empty() {
                    errs.push(VerifyError {
                        at: Some(n),
                        msg: format!("input {i} of {} reads an omitted output", g.describe(n)),
                    });
                }
            }
        }
        let (min_in, max_in, min_out, max_out) = arity(&node.op);
        let n_in = node.inputs().len();
        let n_out = node.num_outputs();
        if !matches!(node.op, Op::Opaque(_)) {
            if n_in < min_in || n_in > max_in {
                let want = if min_in == max_in {
                    count(min_in)
                } else if max_in == usize::MAX {
                    format!("at least {min_in}")
                } else {
                    format!("{min_in} to {max_in}")
                };
                errs.push(VerifyError {
                    at: Some(n),
                    msg: format!("{} takes {want} input(s), got {n_in}", node.op.op_type()),
                });
            }
            if n_out < min_out || n_out > max_out {
                let want = if min_out == max_out {
                    count(min_out)
                } else if max_out == usize::MAX {
                    format!("at least {min_out}")
                } else {
                    format!("{min_out} to {max_out}")
                };
                errs.push(VerifyError {
                    at: Some(n),
                    msg: format!("{} has {want} output(s), got {n_out}", node.op.op_type()),
                });
            }
            check_types(g, n, errs);
        }
        if let Op::Initializer(t) = &node.op {
            check_tensor_len(g, n, t, errs);
        }
        if let Op::Input { default: Some(t) } = &node.op {
            check_tensor_len(g, n, t, errs);
        }
        for a in node.op.attributes() {
            match &a.value {
                AttrValue::Graph(sub) => verify_into(sub, errs),
                AttrValue::Graphs(subs) => subs.iter().for_each(|s| verify_into(s, errs)),
                _ => {}
            }
        }
    }

    for (i, o) in g.outputs().iter().enumerate() {
        if !g.contains(o.value.node) || usize::from(o.value.slot) >= g.node(o.value.node).num_outputs() {
            errs.push(VerifyError { at: None, msg: format!("graph output {i} is undefined") });
        }
    }

    if let Err(cycle) = g.topo_order() {
        let first = cycle.0.first().copied();
        let names: Vec<String> = cycle.0.iter().take(4).map(|&n| g.describe(n)).collect();
        errs.push(VerifyError { at: first, msg: format!("the graph has a cycle through {}", names.join(", ")) });
    }
}

fn check_tensor_len(g: &Graph, n: NodeId, t: &crate::tensor::Tensor, errs: &mut Vec<VerifyError>) {
    if let Some(len) = t.stored_len() {
        let want = t.numel() * t.values_per_element();
        if len as u64 != want {
            errs.push(VerifyError {
                at: Some(n),
                msg: format!(
                    "initializer `{}` of type {} needs {want} value(s), has {len}",
                    g.node(n).outputs()[0].name,
                    t.tensor_type()
                ),
            });
        }
    }
}

fn dtype_of(g: &Graph, n: NodeId, i: usize) -> Option<DType> {
    let v = g.node(n).input(i)?;
    if !g.contains(v.node) || usize::from(v.slot) >= g.node(v.node).num_outputs() {
        return None;
    }
    match g.value_type(v)? {
        Type::Tensor(t) => Some(t.dtype),
        _ => None,
    }
}

fn check_types(g: &Graph, n: NodeId, errs: &mut Vec<VerifyError>) {
    let node = g.node(n);
    let all: Vec<usize> = (0..node.inputs().len()).collect();
    match node.op.rules().type_rule() {
        TypeRule::Free => {}
        TypeRule::Same(idx) => check_same(g, n, &idx, errs),
        TypeRule::AllSame => check_same(g, n, &all, errs),
        TypeRule::AllBool => {
            for i in all {
                if let Some(d) = dtype_of(g, n, i)
                    && d != DType::Bool
                {
                    errs.push(VerifyError {
                        at: Some(n),
                        msg: format!("{} needs bool inputs, input {i} is {d}", node.op.op_type()),
                    });
                }
            }
        }
        TypeRule::BoolAndSame(idx) => {
            check_same(g, n, &idx, errs);
            if let Some(d) = dtype_of(g, n, 0)
                && d != DType::Bool
            {
                errs.push(VerifyError {
                    at: Some(n),
                    msg: format!("{} needs a bool condition, got {d}", node.op.op_type()),
                });
            }
        }
    }
}

fn check_same(g: &Graph, n: NodeId, idx: &[usize], errs: &mut Vec<VerifyError>) {
    let mut first: Option<(usize, DType)> = None;
    for &i in idx {
        if let Some(d) = dtype_of(g, n, i) {
            match first {
                None => first = Some((i, d)),
                Some((j, e)) if e != d => {
                    errs.push(VerifyError {
                        at: Some(n),
                        msg: format!(
                            "{} needs inputs of one element type; input {j} is {e}, input {i} is {d}",
                            g.node(n).op.op_type()
                        ),
                    });
                    return;
                }
                _ => {}
            }
        }
    }
}
