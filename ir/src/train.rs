//! The interface of a training graph (the graph the autodiff pass writes: forward, loss,
//! backward, optimizer update) and the one place that knows how it is written in the IR.
//!
//! A training graph must print as ONNX text and parse back into the same training graph, so
//! its roles are carried by what ONNX keeps — value names and node metadata — and read and
//! written only through the functions here:
//! - output 0 is the loss;
//! - the gradient of trainable initializer `P` is the output named `P__grad`
//!   ([`gradient_name`], [`gradient_outputs`]);
//! - the value initializer `S` (a parameter, optimizer state, the step counter) takes for the
//!   next step is the output named `S__next` ([`next_name`], [`carried_state`]);
//! - the loss gradient's seed is the initializer `L__seed` ([`seed_name`]);
//! - a backward op names the forward op it differentiates by its first output's name
//!   ([`grad_of`], [`set_grad_of`]).

use crate::graph::op::Op;
use crate::graph::{Graph, NodeId, Value};

const GRADIENT: &str = "__grad";
const NEXT: &str = "__next";
const SEED: &str = "__seed";

/// The node annotation naming the forward op a backward op differentiates.
const GRAD_OF: &str = "shardc_grad_of";

/// The name of the gradient output of parameter `param`.
pub fn gradient_name(param: &str) -> String {
    format!("{param}{GRADIENT}")
}

/// The name of the output holding `state`'s value for the next step.
pub fn next_name(state: &str) -> String {
    format!("{state}{NEXT}")
}

/// The name of the loss gradient's seed for loss `loss`.
pub fn seed_name(loss: &str) -> String {
    format!("{loss}{SEED}")
}

/// The initializer `v` of `g` is an initializer (not an input, not computed).
fn initializer(g: &Graph, name: &str) -> Option<Value> {
    g.lookup(name).filter(|x| matches!(g.node(x.node).op, Op::Initializer(_)))
}

/// The gradient outputs of training graph `g`: per output that is the gradient of an
/// initializer, `(that output, the initializer)`, in output order.
pub fn gradient_outputs(g: &Graph) -> Vec<(Value, Value)> {
    g.outputs()
        .iter()
        .filter_map(|o| {
            let p = g.value_name(o.value).strip_suffix(GRADIENT)?;
            Some((o.value, initializer(g, p)?))
        })
        .collect()
}

/// Whether `v` is a gradient output of training graph `g`.
pub fn is_gradient_output(g: &Graph, v: Value) -> bool {
    g.value_name(v).strip_suffix(GRADIENT).and_then(|p| initializer(g, p)).is_some()
}

/// The carried state of a training graph: per output that holds an initializer's value for
/// the next step, `(that output, the initializer)`, each output once, in output order. Empty
/// when `g` is not a training graph.
pub fn carried_state(g: &Graph) -> Vec<(Value, Value)> {
    let mut out: Vec<(Value, Value)> = Vec::new();
    for o in g.outputs() {
        let Some(s) = g.value_name(o.value).strip_suffix(NEXT).and_then(|x| initializer(g, x)) else { continue };
        if !out.iter().any(|&(v, _)| v == o.value) {
            out.push((o.value, s));
        }
    }
    out
}

/// The forward op (its first output's name) that backward op `n` differentiates; `None` for
/// an op the autodiff pass did not write as a gradient.
pub fn grad_of(g: &Graph, n: NodeId) -> Option<&str> {
    g.node(n).annotations.iter().find(|(k, _)| k == GRAD_OF).map(|(_, f)| f.as_str())
}

/// Records that backward op `n` differentiates the forward op whose first output is `forward`.
pub fn set_grad_of(g: &mut Graph, n: NodeId, forward: &str) {
    g.set_annotation(n, GRAD_OF, forward);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::op;

    #[test]
    fn roles_are_read_back_as_written() {
        let mut g = Graph::new("g");
        let w = g.add_initializer("w", crate::Tensor::from_f32(vec![2], vec![1.0, 2.0]));
        let x = g.add_input("x", None);
        let y = g.add_node(op::Op::Mul(op::Mul::default()), vec![Some(x), Some(w)], vec![crate::Output::named("y")]);
        let d = g.add_node(
            op::Op::Identity(Default::default()),
            vec![Some(x)],
            vec![crate::Output::named(gradient_name("w"))],
        );
        let n =
            g.add_node(op::Op::Identity(Default::default()), vec![Some(w)], vec![crate::Output::named(next_name("w"))]);
        // An output named like a gradient of something that is not an initializer has no role.
        let z = g.add_node(
            op::Op::Identity(Default::default()),
            vec![Some(x)],
            vec![crate::Output::named(gradient_name("x"))],
        );
        for v in [Value::new(y, 0), Value::new(d, 0), Value::new(n, 0), Value::new(z, 0)] {
            g.add_output(v, None);
        }
        set_grad_of(&mut g, d, "y");
        assert_eq!(gradient_outputs(&g), vec![(Value::new(d, 0), w)]);
        assert!(is_gradient_output(&g, Value::new(d, 0)) && !is_gradient_output(&g, Value::new(z, 0)));
        assert_eq!(carried_state(&g), vec![(Value::new(n, 0), w)]);
        assert_eq!((grad_of(&g, d), grad_of(&g, y)), (Some("y"), None));
        assert_eq!(seed_name("loss"), "loss__seed");
    }
}
