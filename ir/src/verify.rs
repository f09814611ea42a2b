//! The verifier: structural invariants of a graph, with errors keyed by node.
//!
//! Checks: every input names a live value; one definition per name; no cycles; graph outputs
//! exist; each known op has an admissible number of inputs and outputs; element types agree
//! where an op requires it; initializers hold as many values as their shape says.
//! Shapes are checked by shape inference, not here.

use std::collections::HashMap;
use std::fmt;

use crate::attr::AttrValue;
use crate::graph::{Graph, NodeId};
use crate::op::{Op, OpClass};
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

/// Admissible input and output counts of an op: `(min_in, max_in, min_out, max_out)`.
pub fn arity(op: &Op) -> (usize, usize, usize, usize) {
    const MANY: usize = usize::MAX;
    match op {
        Op::Input { .. } | Op::Initializer(_) | Op::OuterRef => (0, 0, 1, 1),
        Op::Cast(_) => (1, 1, 1, 1),
        Op::CastLike(_) => (2, 2, 1, 1),
        Op::Clip(_) => (1, 3, 1, 1),
        Op::Dropout(_) => (1, 3, 1, 2),
        Op::PRelu(_) => (2, 2, 1, 1),
        Op::Where(_) => (3, 3, 1, 1),
        _ if op.class() == OpClass::Unary => (1, 1, 1, 1),
        _ if op.class() == OpClass::Binary => (2, 2, 1, 1),
        _ if op.class() == OpClass::Variadic => (1, MANY, 1, 1),
        Op::MatMul(_) => (2, 2, 1, 1),
        Op::Gemm(_) => (2, 3, 1, 1),
        Op::Einsum(_) => (1, MANY, 1, 1),
        Op::Conv(_) => (2, 3, 1, 1),
        Op::ConvTranspose(_) => (2, 3, 1, 1),
        Op::MaxPool(_) => (1, 1, 1, 2),
        Op::AveragePool(_) | Op::LpPool(_) => (1, 1, 1, 1),
        Op::GlobalAveragePool(_) | Op::GlobalMaxPool(_) | Op::GlobalLpPool(_) => (1, 1, 1, 1),
        Op::BatchNormalization(_) => (5, 5, 1, 3),
        Op::InstanceNormalization(_) => (3, 3, 1, 1),
        Op::LayerNormalization(_) => (2, 3, 1, 3),
        Op::GroupNormalization(_) => (3, 3, 1, 1),
        Op::LRN(_) | Op::LpNormalization(_) | Op::MeanVarianceNormalization(_) => (1, 1, 1, 1),
        Op::Softmax(_) | Op::LogSoftmax(_) | Op::Hardmax(_) => (1, 1, 1, 1),
        Op::ArgMax(_) | Op::ArgMin(_) => (1, 1, 1, 1),
        _ if op.class() == OpClass::Reduce => (1, 2, 1, 1),
        Op::Reshape(_) => (2, 2, 1, 1),
        Op::Flatten(_) | Op::Transpose(_) => (1, 1, 1, 1),
        Op::Squeeze(_) | Op::Unsqueeze(_) => (1, 2, 1, 1),
        Op::Concat(_) => (1, MANY, 1, 1),
        Op::Split(_) => (1, 2, 1, MANY),
        Op::Slice(_) => (1, 5, 1, 1),
        Op::Gather(_) | Op::GatherElements(_) | Op::GatherND(_) => (2, 2, 1, 1),
        Op::ScatterND(_) | Op::ScatterElements(_) => (3, 3, 1, 1),
        Op::Expand(_) | Op::Tile(_) => (2, 2, 1, 1),
        Op::Pad(_) => (1, 4, 1, 1),
        Op::Resize(_) => (1, 4, 1, 1),
        Op::Upsample(_) => (1, 2, 1, 1),
        Op::DepthToSpace(_) | Op::SpaceToDepth(_) => (1, 1, 1, 1),
        Op::Shape(_) | Op::Size(_) => (1, 1, 1, 1),
        Op::Constant(_) => (0, 0, 1, 1),
        Op::ConstantOfShape(_) => (1, 1, 1, 1),
        Op::Range(_) => (3, 3, 1, 1),
        Op::Trilu(_) => (1, 2, 1, 1),
        Op::TopK(_) => (1, 2, 2, 2),
        Op::NonZero(_) => (1, 1, 1, 1),
        Op::OneHot(_) => (3, 3, 1, 1),
        Op::CumSum(_) => (2, 2, 1, 1),
        Op::EyeLike(_) => (1, 1, 1, 1),
        Op::LSTM(_) => (3, 8, 0, 3),
        Op::GRU(_) | Op::RNN(_) => (3, 6, 0, 2),
        Op::If(_) => (1, 1, 1, MANY),
        Op::Loop(_) => (2, MANY, 1, MANY),
        Op::Scan(_) => (1, MANY, 1, MANY),
        Op::Send(_) => (1, 1, 0, 0),
        Op::Recv(_) => (0, 0, 1, 1),
        Op::AllReduce(_) | Op::AllGather(_) | Op::ReduceScatter(_) | Op::AllToAll(_) | Op::HaloExchange(_) => {
            (1, 1, 1, 1)
        }
        _ => (0, MANY, 0, MANY),
    }
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
    let same: &[usize] = match &node.op {
        Op::Add(_)
        | Op::Sub(_)
        | Op::Mul(_)
        | Op::Div(_)
        | Op::Mod(_)
        | Op::Equal(_)
        | Op::Less(_)
        | Op::Greater(_)
        | Op::LessOrEqual(_)
        | Op::GreaterOrEqual(_)
        | Op::MatMul(_)
        | Op::PRelu(_) => &[0, 1],
        Op::Gemm(_) => &[0, 1, 2],
        Op::Conv(_) | Op::ConvTranspose(_) => &[0, 1, 2],
        Op::Where(_) => &[1, 2],
        Op::Max(_) | Op::Min(_) | Op::Sum(_) | Op::Mean(_) | Op::Concat(_) => {
            let k: Vec<usize> = (0..node.inputs().len()).collect();
            return check_same(g, n, &k, errs);
        }
        Op::And(_) | Op::Or(_) | Op::Xor(_) | Op::Not(_) => {
            for i in 0..node.inputs().len() {
                if let Some(d) = dtype_of(g, n, i)
                    && d != DType::Bool
                {
                    errs.push(VerifyError {
                        at: Some(n),
                        msg: format!("{} needs bool inputs, input {i} is {d}", node.op.op_type()),
                    });
                }
            }
            return;
        }
        _ => return,
    };
    check_same(g, n, same, errs);
    if let Op::Where(_) = node.op
        && let Some(d) = dtype_of(g, n, 0)
        && d != DType::Bool
    {
        errs.push(VerifyError { at: Some(n), msg: format!("Where needs a bool condition, got {d}") });
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
