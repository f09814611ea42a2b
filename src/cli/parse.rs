//! `shardc parse`: read, verify, optionally run passes, print (text, JSON or DOT).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::common::*;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Emit {
    /// The ONNX textual syntax (parses back).
    Text,
    /// The graph as JSON.
    Json,
    /// A Graphviz graph.
    Dot,
    /// Binary ONNX (`ModelProto`), what `onnx.load` reads; the default for `-o NAME.onnx`.
    Onnx,
}

/// What to write: `--emit` when given, else binary ONNX for an output file named `*.onnx`,
/// else text.
pub fn emit_for(emit: Option<Emit>, output: Option<&PathBuf>) -> Emit {
    emit.unwrap_or_else(|| {
        if output.is_some_and(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx"))) {
            Emit::Onnx
        } else {
            Emit::Text
        }
    })
}

#[derive(Args, Debug)]
pub struct ParseArgs {
    /// The model (ONNX textual syntax or binary .onnx).
    pub model: PathBuf,
    /// Output format [default: onnx for `-o NAME.onnx`, else text].
    #[arg(long, value_enum)]
    pub emit: Option<Emit>,
    /// Write the output here instead of stdout.
    #[arg(short = 'o', long = "output", value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// Passes to run after verification, comma-separated (verify, infer-shapes, canonicalize,
    /// algebra, conv-as-matmul, fuse-gemms, fuse-attention, fuse-experts, require-static, rebatch,
    /// autodiff).
    #[arg(long, value_delimiter = ',', value_name = "a,b,c")]
    pub passes: Vec<String>,
    /// Print the model to stderr after these passes (comma-separated, or `all`).
    #[arg(long = "dump-after", value_delimiter = ',', value_name = "PASS")]
    pub dump_after: Vec<String>,
    /// Run the verifier after every pass.
    #[arg(long = "verify-each")]
    pub verify_each: bool,
    /// Print how long each pass took to stderr.
    #[arg(long)]
    pub timings: bool,
    #[command(flatten)]
    pub shapes: ShapeArgs,
}

pub fn run(args: &ParseArgs) -> CliResult {
    guard_outputs(&[("-o", args.output.as_ref())], &[Some(&args.model)])?;
    let (mut loaded, warnings) = shardc::load_and_check(&args.model).map_err(CliError::new)?;
    note_external_data(&loaded.model.graph, &args.model);
    eprint!("{warnings}");
    let spec = args.shapes.spec(&args.model)?;
    let opts = passes::PassOptions { rebatch: spec.clone(), ..Default::default() };
    for d in &args.dump_after {
        if d != "all" && !passes::PASS_NAMES.contains(&d.as_str()) {
            return Err(CliError::msg(format!(
                "--dump-after: unknown pass `{d}`; passes are {}",
                passes::PASS_NAMES.join(", ")
            )));
        }
        let runs = d == "all" || d == "verify" || args.passes.contains(d) || (d == "rebatch" && !spec.is_empty());
        if !runs {
            return Err(CliError::msg(format!("--dump-after {d}: the pass `{d}` does not run; add it with --passes")));
        }
    }
    let mut pm = passes::PassManager::new().with_verify(args.verify_each).with_dump_after(args.dump_after.clone());
    pm.add(passes::Verify);
    if !spec.is_empty() && !args.passes.iter().any(|p| p == "rebatch") {
        pm.add(passes::Rebatch { spec });
    }
    for name in &args.passes {
        let pass = passes::create(name, &opts).ok_or_else(|| {
            CliError::msg(format!("unknown pass `{name}`; passes are {}", passes::PASS_NAMES.join(", ")))
        })?;
        pm.add_boxed(pass);
    }
    let report = pm.run(&mut loaded.model).map_err(|e| pass_error(&e, &loaded.source))?;
    super::ui::pass_timings(&report);
    warn(&report.warnings, &loaded.source);
    for (pass, text) in &report.dumps {
        eprintln!("# ---- after {pass} ----");
        eprintln!("{text}");
    }
    if args.timings {
        for t in &report.timings {
            eprintln!(
                "{:>14}  {:>10.3} ms  {}",
                t.pass,
                t.time.as_secs_f64() * 1e3,
                if t.changed == passes::Changed::Yes { "changed" } else { "" }
            );
        }
        for (k, v) in report.stats.iter() {
            eprintln!("{k}: {v}");
        }
    }
    let text = match emit_for(args.emit, args.output.as_ref()) {
        Emit::Onnx => {
            if args.output.is_none() && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                return Err(CliError::msg("--emit onnx writes binary; give -o FILE.onnx or redirect stdout to a file"));
            }
            // Weights a rewrite split or joined are written inline: other tools read only
            // plain external data.
            let dir = args.model.parent().map(std::path::PathBuf::from).unwrap_or_default();
            let left = shardc::exec::inline_rewritten_weights(&mut loaded.model, &dir).map_err(CliError::msg)?;
            if !left.is_empty() {
                eprintln!(
                    "warning: {} weight{} split or joined by a rewrite keep shardc's description of their external data (`{}`{}): the data files are not beside the model, so only shardc reads the output",
                    left.len(),
                    if left.len() == 1 { "" } else { "s" },
                    left[0],
                    if left.len() > 1 { ", …" } else { "" }
                );
            }
            let bytes = shardc::frontend::onnx::to_bytes(&loaded.model);
            return write_output_bytes(&bytes, args.output.as_ref(), &args.model);
        }
        Emit::Text => ir::print::model_to_string(&loaded.model),
        Emit::Json => {
            serde_json::to_string_pretty(&ir::export::model_json(&loaded.model)).expect("JSON values serialize")
        }
        Emit::Dot => ir::export::graph_dot(&loaded.model.graph),
    };
    write_output(&text, args.output.as_ref(), &args.model)
}
