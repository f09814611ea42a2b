//! `shardc lower`: a plan's per-device programs, with explicit communication.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::common::*;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LowerEmit {
    /// Each device's graph in the ONNX textual syntax (communication ops in the `shardc`
    /// domain; parses back).
    Text,
    /// A summary: per device its feeds, results, op and communication counts.
    Json,
    /// Each device's graph for Graphviz.
    Dot,
    /// Each device's graph as binary ONNX (`-o DIR` writes `deviceK.onnx`; the default for
    /// `-o NAME.onnx` with one device).
    Onnx,
}

#[derive(Args, Debug)]
pub struct LowerArgs {
    /// The plan (from `shardc plan -o`).
    pub plan: PathBuf,
    /// The model (default: the path the plan records).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Only this device.
    #[arg(long, value_parser = parse_index, allow_negative_numbers = true)]
    pub device: Option<usize>,
    /// Apply the plan even though it was made for another file (a re-export): its ops must
    /// still match the model's by name and shape.
    #[arg(long)]
    pub force: bool,
    /// Output format [default: onnx for `-o NAME.onnx`, else text].
    #[arg(long, value_enum)]
    pub emit: Option<LowerEmit>,
    /// Write here: a file for one device or JSON, a directory (one file per device) otherwise.
    #[arg(short = 'o', long = "output", value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// First prove that the programs compute the model (docs/verify.md); exit 1, writing
    /// nothing, when the proof fails.
    #[arg(long)]
    pub verify: bool,
}

pub fn run(args: &LowerArgs) -> CliResult {
    guard_outputs(&[("-o", args.output.as_ref())], &[Some(&args.plan), args.model.as_deref()])?;
    let plan = read_plan(&args.plan)?;
    let model_path = args.model.clone().unwrap_or_else(|| PathBuf::from(&plan.model.path));
    let mut loaded = load_canonical(&model_path, &ShapeArgs::of_plan(&plan))?;
    apply_plan_rewrites(&mut loaded.model.graph, &plan)?;
    if let Some(note) = check_plan_model(&plan, &args.plan, &model_path, args.force)? {
        eprintln!("note: {note}");
    }
    let program = shardc::exec::program_for_plan(&loaded.model.graph, &plan)
        .map_err(|e| CliError::msg(format!("the plan does not lower: {e}")))?;
    check_program(&program)?;
    if args.verify {
        eprintln!("{}", proved_forward(&loaded.model.graph, &program)?);
    }
    if let Some(k) = args.device
        && k >= program.devices.len()
    {
        return Err(CliError::msg(format!("--device {k}: the plan has {} devices", program.devices.len())));
    }
    let devices: Vec<&codegen::DeviceProgram> =
        program.devices.iter().filter(|d| args.device.is_none_or(|k| k == d.device)).collect();
    for f in &program.fallbacks {
        eprintln!("note: runs replicated instead of as planned: {f}");
    }
    let emit = args.emit.unwrap_or_else(|| {
        if args.output.as_ref().is_some_and(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx"))) {
            LowerEmit::Onnx
        } else {
            LowerEmit::Text
        }
    });
    if emit == LowerEmit::Onnx {
        let bytes = |d: &codegen::DeviceProgram| shardc::frontend::onnx::to_bytes(&d.to_model());
        return match (&args.output, devices.len()) {
            (Some(out), 1) if out.extension().is_some_and(|e| e.eq_ignore_ascii_case("onnx")) => {
                write_output_bytes(&bytes(devices[0]), Some(out), &model_path)
            }
            (Some(dir), _) => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| CliError::msg(format!("cannot create `{}`: {e}", dir.display())))?;
                for d in devices {
                    write_output_bytes(&bytes(d), Some(&dir.join(format!("device{}.onnx", d.device))), &model_path)?;
                }
                Ok(())
            }
            (None, _) => {
                Err(CliError::msg("--emit onnx writes binary files: give -o DIR (or -o NAME.onnx with --device K)"))
            }
        };
    }
    match emit {
        LowerEmit::Onnx => unreachable!("written above"),
        LowerEmit::Json => {
            let doc = serde_json::to_string_pretty(&program.summary_json()).expect("JSON");
            write_output(&doc, args.output.as_ref(), &model_path)
        }
        LowerEmit::Text | LowerEmit::Dot => {
            let render = |d: &codegen::DeviceProgram| -> String {
                match emit {
                    LowerEmit::Dot => ir::export::graph_dot(&d.graph),
                    _ => ir::print::model_to_string(&d.to_model()),
                }
            };
            let ext = if emit == LowerEmit::Dot { "dot" } else { "onnxtxt" };
            match (&args.output, devices.len()) {
                (Some(out), 1) => write_output(&render(devices[0]), Some(out), &model_path),
                (Some(dir), _) => {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| CliError::msg(format!("cannot create `{}`: {e}", dir.display())))?;
                    for d in devices {
                        write_output(&render(d), Some(&dir.join(format!("device{}.{ext}", d.device))), &model_path)?;
                    }
                    Ok(())
                }
                (None, _) => {
                    let mut t = String::new();
                    for d in devices {
                        if args.device.is_none() {
                            t.push_str(&format!(
                                "# ---- device {} (stage {}, rank {}) ----\n",
                                d.device, d.stage, d.rank
                            ));
                        }
                        t.push_str(&render(d));
                        if !t.ends_with('\n') {
                            t.push('\n');
                        }
                    }
                    write_output(&t, None, &model_path)
                }
            }
        }
    }
}
