//! `shardc stats`: size and work of a model for one step.

use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use super::common::*;

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// The model (ONNX textual syntax).
    pub model: PathBuf,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub shapes: ShapeArgs,
}

pub fn run(args: &StatsArgs) -> CliResult {
    let loaded = load(&args.model, &args.shapes)?;
    let g = &loaded.model.graph;
    let s = ir::cost::compute_stats(g).map_err(CliError::msg)?;
    let io = |vals: Vec<(String, Option<ir::Type>)>| -> Vec<serde_json::Value> {
        vals.into_iter().map(|(n, t)| json!({ "name": n, "type": t.map(|t| t.to_string()) })).collect()
    };
    let inputs: Vec<(String, Option<ir::Type>)> = g
        .input_values()
        .into_iter()
        .filter(|v| matches!(g.node(v.node).op, ir::Op::Input { default: None }))
        .map(|v| (g.value_name(v).to_string(), g.value_type(v).cloned()))
        .collect();
    let outputs: Vec<(String, Option<ir::Type>)> = g
        .outputs()
        .iter()
        .map(|o| (g.value_name(o.value).to_string(), o.ty.clone().or_else(|| g.value_type(o.value).cloned())))
        .collect();
    let known = s.unknown_shapes == 0;
    let unknown_why = format!("unknown ({} values have unknown shapes: {})", s.unknown_shapes, symbolic_hint(g));
    if args.json {
        let doc = json!({
            "model": args.model.display().to_string(),
            "nodes": s.nodes,
            "op_counts": s.op_counts.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "params": s.params,
            "float_params": s.float_params,
            "param_bytes": s.param_bytes,
            // Counts over values of unknown shape would be partial sums: null, "unknown".
            "forward_flops": known.then_some(s.forward_flops),
            "backward_flops": known.then_some(s.backward_flops),
            "activation_bytes": known.then_some(s.activation_bytes),
            "unknown_shapes": s.unknown_shapes,
            "inputs": io(inputs),
            "outputs": io(outputs),
        });
        return write_output(&serde_json::to_string_pretty(&doc).expect("JSON"), None, &args.model);
    }
    let mut t = String::new();
    t.push_str(&format!("model            {}\n", args.model.display()));
    for (n, ty) in &inputs {
        t.push_str(&format!("input            {n}: {}\n", ty.as_ref().map_or("?".into(), |t| t.to_string())));
    }
    for (n, ty) in &outputs {
        t.push_str(&format!("output           {n}: {}\n", ty.as_ref().map_or("?".into(), |t| t.to_string())));
    }
    t.push_str(&format!("nodes            {}\n", s.nodes));
    t.push_str(&format!(
        "params           {} float ({} with integer constants), {}\n",
        thousands(s.float_params),
        thousands(s.params),
        bytes(s.param_bytes as f64)
    ));
    if known {
        t.push_str(&format!("forward FLOPs    {}FLOP\n", si(s.forward_flops)));
        t.push_str(&format!("backward FLOPs   {}FLOP\n", si(s.backward_flops)));
        t.push_str(&format!(
            "activations      {} (all operator outputs of one forward pass)\n",
            bytes(s.activation_bytes as f64)
        ));
    } else {
        t.push_str(&format!("forward FLOPs    {unknown_why}\n"));
        t.push_str(&format!("backward FLOPs   {unknown_why}\n"));
        t.push_str(&format!("activations      {unknown_why}\n"));
    }
    t.push_str("ops\n");
    for (k, v) in &s.op_counts {
        t.push_str(&format!("  {k:<24} {v}\n"));
    }
    write_output(&t, None, &args.model)
}

/// What would make a model's shapes known: `--dim` for its symbolic input dims, else
/// `--input-shape`, and the unsupported ops if any.
fn symbolic_hint(g: &ir::Graph) -> String {
    let mut syms: Vec<String> = Vec::new();
    for v in g.input_values() {
        for d in g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default() {
            if let ir::Dim::Sym(s) = d
                && !syms.contains(&s)
            {
                syms.push(s);
            }
        }
    }
    let unsupported: Vec<String> = passes::verify::static_findings(g)
        .into_iter()
        .filter(|l| l.msg.starts_with("unsupported op"))
        .map(|l| l.msg.split(" at ").next().unwrap_or_default().trim_start_matches("unsupported op ").to_string())
        .collect();
    let mut parts = Vec::new();
    if !syms.is_empty() {
        parts.push(format!("give {}", syms.iter().map(|s| format!("--dim {s}=N")).collect::<Vec<_>>().join(" ")));
    } else {
        parts.push("give --batch or --input-shape".to_string());
    }
    if !unsupported.is_empty() {
        parts.push(format!("unsupported ops: {}", unsupported.join(", ")));
    }
    parts.join("; ")
}
