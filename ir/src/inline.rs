//! Calls of the model's own functions (ONNX `FunctionProto`s, what exporters write for a
//! module kept whole) replaced by the functions' bodies, so every later stage sees ONNX ops.
//!
//! A call `y = local.F<a = v>(x)` becomes the body of `F` with its formal inputs bound to the
//! call's inputs, every attribute reference `@a` bound to the call's attribute `a` (or the
//! function's default for it; an attribute referenced and given neither is left out, as ONNX
//! says), and the body's values renamed `y/…` so they do not clash with the graph's. The
//! call's outputs keep their names. A function that calls another is inlined again until no
//! call is left; one that calls itself is an error.

use std::collections::HashMap;

use crate::graph::attr::{AttrValue, Attribute};
use crate::graph::op::{Op, Opaque};
use crate::graph::{Function, Graph, Model, NodeId, Output, Value};

/// How many nodes inlining may make (a chain of functions each calling the next twice
/// doubles the graph per level).
const MAX_NODES: usize = 10_000_000;

/// Whether function `from` calls `to`, directly or through others.
fn reaches(callees: &[Vec<usize>], from: usize, to: usize) -> bool {
    let mut seen = vec![false; callees.len()];
    let mut stack = callees[from].clone();
    while let Some(f) = stack.pop() {
        if f == to {
            return true;
        }
        if !std::mem::replace(&mut seen[f], true) {
            stack.extend(&callees[f]);
        }
    }
    false
}

/// Inlines every call of `m`'s functions in its main graph. Returns how many calls were
/// inlined, or the calls that could not be, each with the reason.
pub fn inline_functions(m: &mut Model) -> Result<usize, Vec<(NodeId, String)>> {
    if m.functions.is_empty() {
        return Ok(0);
    }
    let Model { graph, functions, .. } = m;
    // The functions each calls, and those that reach themselves.
    let callees: Vec<Vec<usize>> = functions
        .iter()
        .map(|f| {
            f.body
                .node_ids()
                .filter_map(|n| match &f.body.node(n).op {
                    Op::Opaque(o) => called(functions, o),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let recursive: Vec<bool> = (0..functions.len()).map(|f| reaches(&callees, f, f)).collect();
    let calls_in = |graph: &Graph| -> Vec<(NodeId, usize)> {
        graph
            .node_ids()
            .filter_map(|n| match &graph.node(n).op {
                Op::Opaque(o) => called(functions, o).map(|f| (n, f)),
                _ => None,
            })
            .collect()
    };
    let mut calls = calls_in(graph);
    // Every function a later round inlines is reached from these calls: checked once.
    let looping: Vec<(NodeId, String)> = calls
        .iter()
        .filter_map(|&(n, f)| {
            let r = (0..functions.len()).find(|&c| recursive[c] && (c == f || reaches(&callees, f, c)))?;
            let via = if r == f { String::new() } else { format!(" (through `{}`)", functions[f].body.name) };
            Some((n, format!("function `{}` calls itself{via}: it cannot be inlined", functions[r].body.name)))
        })
        .collect();
    if !looping.is_empty() {
        return Err(looping);
    }
    // Without cycles each round inlines one level deeper: at most as many rounds as functions.
    let mut count = 0;
    while !calls.is_empty() {
        if graph.node_count() > MAX_NODES {
            return Err(calls
                .into_iter()
                .map(|(n, f)| {
                    (n, format!("function `{}`: inlining it makes more than {MAX_NODES} nodes", functions[f].body.name))
                })
                .collect());
        }
        let mut errors = Vec::new();
        for (n, f) in calls {
            match inline_call(graph, n, &functions[f]) {
                Ok(()) => count += 1,
                Err(e) => errors.push((n, format!("inlining function `{}`: {e}", functions[f].body.name))),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        calls = calls_in(graph);
    }
    Ok(count)
}

/// The function an opaque op calls.
fn called(functions: &[Function], o: &Opaque) -> Option<usize> {
    functions.iter().position(|f| f.domain == o.domain && f.body.name == o.op_type && f.overload == o.overload)
}

/// The attributes of a body node with its references bound: to the call's attribute of
/// that name, else the function's default, else left out.
fn bind_attributes(attrs: Vec<Attribute>, call: &[Attribute], f: &Function) -> Vec<Attribute> {
    attrs
        .into_iter()
        .filter_map(|a| match &a.value {
            AttrValue::Ref(_, name) => call
                .iter()
                .chain(&f.attr_defaults)
                .find(|c| &c.name == name)
                .map(|c| Attribute { name: a.name.clone(), value: c.value.clone() }),
            _ => Some(a),
        })
        .collect()
}

fn inline_call(g: &mut Graph, call: NodeId, f: &Function) -> Result<(), String> {
    let node = g.node(call).clone();
    let Op::Opaque(o) = &node.op else { return Err("not a call".into()) };
    let body = &f.body;
    let formals = body.inputs();
    if node.inputs().len() > formals.len() {
        return Err(format!("{} inputs given, the function takes {}", node.inputs().len(), formals.len()));
    }
    if node.num_outputs() > body.outputs().len() {
        return Err(format!("{} outputs asked for, the function has {}", node.num_outputs(), body.outputs().len()));
    }
    let span = g.span(call);
    // The name the body's values are put under: the call's first named output.
    let prefix = node.outputs().iter().map(|o| o.name.clone()).find(|n| !n.is_empty()).unwrap_or_else(|| "call".into());
    let mut map: HashMap<Value, Option<Value>> = HashMap::new();
    for (i, &p) in formals.iter().enumerate() {
        map.insert(Value::new(p, 0), node.inputs().get(i).copied().flatten());
    }
    let order = body.topo_order().map_err(|_| "its body has a cycle".to_string())?;
    for n in order {
        let bn = body.node(n);
        let fresh = |g: &Graph, name: &str| g.fresh_name(&format!("{prefix}/{name}"));
        match &bn.op {
            Op::Input { .. } => continue,
            Op::OuterRef => return Err("its body reads a value from outside the function".into()),
            Op::Initializer(t) => {
                let name = fresh(g, body.value_name(Value::new(n, 0)));
                let v = g.add_initializer(name, t.clone());
                map.insert(Value::new(n, 0), Some(v));
                continue;
            }
            _ => {}
        }
        let op = match &bn.op {
            Op::Opaque(b) if b.attrs.iter().any(|a| matches!(a.value, AttrValue::Ref(..))) => {
                let attrs = bind_attributes(b.attrs.clone(), &o.attrs, f);
                let mut op = Op::from_parts(&b.domain, &b.op_type, attrs).map_err(|e| e.to_string())?;
                if let Op::Opaque(x) = &mut op {
                    x.overload = b.overload.clone();
                }
                op
            }
            other => other.clone(),
        };
        let mut inputs = Vec::with_capacity(bn.inputs().len());
        for (i, v) in bn.inputs().iter().enumerate() {
            inputs.push(match v {
                None => None,
                Some(v) => match map.get(v) {
                    Some(m) => *m,
                    None => {
                        return Err(format!("input {i} of {} is defined nowhere in the body", body.describe(n)));
                    }
                },
            });
        }
        if !bn.captures().is_empty() {
            return Err(format!("{} in its body reads values from a subgraph's scope", body.describe(n)));
        }
        let outputs: Vec<Output> = bn
            .outputs()
            .iter()
            .map(|out| Output { name: if out.name.is_empty() { String::new() } else { fresh(g, &out.name) }, ty: None })
            .collect();
        // Names must be unique before the next one is drawn: add the node, then record.
        let id = g.add_node(op, inputs, outputs);
        if let Some(s) = span {
            g.set_span(id, s);
        }
        for slot in 0..bn.num_outputs() {
            map.insert(Value::new(n, slot as u16), Some(Value::new(id, slot as u16)));
        }
    }
    // The call's outputs: its users and the graph's outputs read the body's results, under
    // the call's names.
    for (k, out) in node.outputs().iter().enumerate() {
        let old = Value::new(call, k as u16);
        if out.name.is_empty() && g.users(old).is_empty() {
            continue;
        }
        let result = map.get(&body.outputs()[k].value).copied().flatten();
        let Some(result) = result else {
            if g.users(old).is_empty() && !g.is_output(old) {
                continue;
            }
            return Err(format!("output {k} (`{}`) is an input the call leaves out", out.name));
        };
        // A result made by the body under a fresh name takes the call's name; one that is
        // an input of the call (or another output too) is copied by an Identity that does.
        let own = result.node != call
            && !node.inputs().contains(&Some(result))
            && !(0..k).any(|j| map.get(&body.outputs()[j].value).copied().flatten() == Some(result));
        let tmp = g.fresh_name(&format!("{}__call", out.name));
        g.rename(old, tmp);
        let new = if own && !out.name.is_empty() && g.rename(result, out.name.clone()) {
            result
        } else {
            let id = g.add_node(
                Op::Identity(crate::graph::op::Identity::default()),
                vec![Some(result)],
                vec![Output { name: out.name.clone(), ty: None }],
            );
            if let Some(s) = span {
                g.set_span(id, s);
            }
            Value::new(id, 0)
        };
        g.set_type(new, out.ty.clone());
        g.replace_all_uses(old, new);
    }
    g.remove_node(call);
    Ok(())
}
