//! `verify`: checks the graph's structural invariants (see `ir::verify`). Changes nothing.

use ir::Graph;

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// The verifier as a pass.
pub struct Verify;

impl Pass for Verify {
    fn name(&self) -> &'static str {
        "verify"
    }

    fn run(&mut self, g: &mut Graph, _cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        ir::verify(g).map_err(|errs| PassError {
            pass: self.name().into(),
            errors: errs
                .0
                .into_iter()
                .map(|e| Located { node: e.at, span: e.at.and_then(|n| g.span(n)), msg: e.msg })
                .collect(),
        })?;
        Ok(Changed::No)
    }
}

/// Refuses what planning, pricing, lowering and running cannot work on, each finding naming
/// what to do: ops outside shardc's op table (by op type, domain and node, also inside
/// subgraphs), graph inputs with unknown or symbolic dims (and the `--dim`, `--batch` or
/// `--input-shape` that fixes them), shape parameters given as graph inputs (their values
/// are needed to know the shapes), and values whose shapes depend on the data. Changes
/// nothing; run it after shape inference.
pub struct RequireStatic;

/// The findings of [`RequireStatic`], without running it as a pass.
pub fn static_findings(g: &Graph) -> Vec<Located> {
    let mut out = Vec::new();
    unsupported_ops(g, g, None, "", &mut out);
    if !out.is_empty() {
        return out;
    }
    let report = ir::infer::infer_shapes(&mut g.clone(), ir::infer::Mode::Check);
    // Inputs with dims that are not numbers.
    let mut syms: Vec<String> = Vec::new();
    for v in g.input_values() {
        if !matches!(g.node(v.node).op, ir::Op::Input { default: None }) {
            continue;
        }
        let Some(t) = g.tensor_type(v) else { continue };
        if t.is_static() {
            continue;
        }
        let names: Vec<String> = t
            .dims
            .iter()
            .flatten()
            .filter_map(|d| match d {
                ir::Dim::Sym(s) => Some(s.clone()),
                _ => None,
            })
            .collect();
        for s in &names {
            if !syms.contains(s) {
                syms.push(s.clone());
            }
        }
        let fix = if names.is_empty() {
            format!("give --input-shape {}=D0xD1x…", g.value_name(v))
        } else {
            format!(
                "give {} (or --batch / --input-shape {}=D0xD1x…)",
                names.iter().map(|s| format!("--dim {s}=N")).collect::<Vec<_>>().join(" "),
                g.value_name(v)
            )
        };
        out.push(Located::at(g, v.node, format!("input `{}` is {t}, whose size is not known: {fix}", g.value_name(v))));
    }
    if !out.is_empty() {
        return out;
    }
    // Shape parameters given as graph inputs: their values decide the shapes.
    if let Ok(r) = &report {
        for &p in &r.params {
            if matches!(g.node(p.node).op, ir::Op::Input { default: None }) {
                let mut users: Vec<String> = Vec::new();
                for (n, _) in g.users(p) {
                    let d = g.describe(n);
                    if !users.contains(&d) {
                        users.push(d);
                    }
                }
                out.push(Located::at(
                    g,
                    p.node,
                    format!(
                        "input `{}` is a shape parameter ({}): shapes depend on its value, which is given only at run time; make it an initializer (or run with `shardc run --inputs`)",
                        g.value_name(p),
                        users.join(", ")
                    ),
                ));
            }
        }
    }
    if !out.is_empty() {
        return out;
    }
    // Values whose shapes are still unknown: the first few, at their producers.
    let mut unknown = 0;
    for n in g.topo_order().unwrap_or_default() {
        let node = g.node(n);
        if matches!(node.op, ir::Op::Input { .. } | ir::Op::Initializer(_) | ir::Op::OuterRef) {
            continue;
        }
        for s in 0..node.num_outputs() {
            let v = ir::Value::new(n, s as u16);
            if node.outputs()[s].name.is_empty() || g.tensor_type(v).is_some_and(ir::TensorType::is_static) {
                continue;
            }
            unknown += 1;
            if unknown <= 3 {
                out.push(Located::at(
                    g,
                    n,
                    format!(
                        "the shape of `{}` ({}) is not known before running: it depends on values computed from the data",
                        g.value_name(v),
                        g.describe(n)
                    ),
                ));
            }
        }
    }
    if unknown > 3 {
        out.push(Located::global(format!("… and {} more values of unknown shape", unknown - 3)));
    }
    out
}

/// Reports every opaque op of `g` (and of its subgraphs: those at `at`, the node of `top`
/// that holds them).
fn unsupported_ops(top: &Graph, g: &Graph, at: Option<ir::NodeId>, within: &str, out: &mut Vec<Located>) {
    for n in g.node_ids() {
        let op = &g.node(n).op;
        if let ir::Op::Opaque(o) = op {
            let domain = if o.domain.is_empty() { "ai.onnx".to_string() } else { o.domain.clone() };
            let msg = format!(
                "unsupported op `{}` (domain `{domain}`) at {}{within}: shardc cannot compute it",
                o.op_type,
                g.describe(n)
            );
            // A subgraph's node is reported at the top-level node that holds it.
            out.push(match at {
                None => Located::at(g, n, msg),
                Some(t) => Located::at(top, t, msg),
            });
        }
        for a in op.attributes() {
            let subs: Vec<&Graph> = match &a.value {
                ir::AttrValue::Graph(sg) => vec![sg.as_ref()],
                ir::AttrValue::Graphs(gs) => gs.iter().collect(),
                _ => Vec::new(),
            };
            for sg in subs {
                let holder = at.or(Some(n));
                unsupported_ops(
                    top,
                    sg,
                    holder,
                    &format!(" in the `{}` subgraph of {}{within}", a.name, g.describe(n)),
                    out,
                );
            }
        }
    }
}

impl Pass for RequireStatic {
    fn name(&self) -> &'static str {
        "require-static"
    }

    fn run(&mut self, g: &mut Graph, _cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let errors = static_findings(g);
        if errors.is_empty() { Ok(Changed::No) } else { Err(PassError { pass: self.name().into(), errors }) }
    }
}
