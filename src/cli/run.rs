//! `shardc run`: compile a model to a plan (or take one), lower it and run it on simulated
//! devices; with `--check`, compare every output with the single-device reference.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use codegen::{Backend, RunOptions};
use passes::autoshard::{self, PipelineMode, SearchOptions};
use shardc::exec;
use shardc::footprint::Reference;

use super::common::*;
use super::cost::{ModelArgs, load_cluster, secs};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The model (ONNX textual syntax).
    pub model: PathBuf,
    /// Run this plan (from `shardc plan -o`).
    #[arg(long, value_name = "PLAN.json", conflicts_with = "strategy")]
    pub plan: Option<PathBuf>,
    /// Run a named strategy (data, model, megatron, spatial, hybrid:dp:D,tp:T, spatial-hybrid:DxS, owt) instead of a searched plan.
    #[arg(long)]
    pub strategy: Option<String>,
    /// The cluster to plan for (default: local-wgpu, the simulated devices themselves).
    #[arg(long, default_value = "local-wgpu")]
    pub cluster: String,
    /// Simulated devices (default: 4).
    #[arg(long, default_value_t = 4, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: usize,
    /// Pipeline parallelism when searching a plan: off, auto or a stage count.
    #[arg(long, default_value = "auto")]
    pub pipeline: String,
    /// Executor: wgpu (default; falls back to cpu with a warning when no adapter opens) or
    /// cpu (the reference kernels).
    #[arg(long)]
    pub backend: Option<String>,
    /// Seed for weights whose external data is absent and for random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Refuse to run when a weight's external data file is absent (by default its values are
    /// drawn from --seed, with a warning).
    #[arg(long = "require-weights")]
    pub require_weights: bool,
    /// Inputs: a file in the golden `.io.json` format, or a directory of ONNX test data
    /// (`input_0.pb`, `input_1.pb` … in graph input order). Without --batch, --input-shape,
    /// --dim or --plan, the model runs at the shapes of these values (default: seeded random
    /// values at the declared shapes).
    #[arg(long, value_name = "IO.json|DIR")]
    pub inputs: Option<PathBuf>,
    /// Write the inputs and outputs in the golden `.io.json` format.
    #[arg(long = "save-outputs", value_name = "OUT.json")]
    pub save_outputs: Option<PathBuf>,
    /// Compare every output with the single-device CPU reference; exit 1 over tolerance.
    #[arg(long)]
    pub check: bool,
    /// Relative tolerance of `--check`.
    #[arg(long, default_value_t = 1e-4, value_parser = parse_nonneg, allow_negative_numbers = true)]
    pub rtol: f64,
    /// Absolute tolerance of `--check`.
    #[arg(long, default_value_t = 1e-5, value_parser = parse_nonneg, allow_negative_numbers = true)]
    pub atol: f64,
    /// Forward steps to run; timings are of the last (the first also compiles kernels).
    #[arg(long, default_value_t = 1, value_parser = parse_count, allow_negative_numbers = true)]
    pub steps: usize,
    /// Print one JSON document.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub transport: super::transport::TransportArgs,
    /// Apply `--plan` even though it was made for another file (a re-export): its ops must
    /// still match the model's by name and shape.
    #[arg(long, requires = "plan")]
    pub force: bool,
    #[command(flatten)]
    pub shapes: ShapeArgs,
    #[command(flatten)]
    pub model_args: ModelArgs,
}

fn backend(args: &RunArgs) -> CliResult<(Backend, Option<String>)> {
    match args.backend.as_deref() {
        Some("cpu") => Ok((Backend::Cpu, None)),
        Some("wgpu") => Ok((Backend::Wgpu, None)),
        Some(other) => Err(CliError::msg(format!("--backend: `{other}` is not wgpu or cpu"))),
        None => match codegen::runtime::gpu_adapter() {
            Ok(_) => Ok((Backend::Wgpu, None)),
            Err(e) => Ok((Backend::Cpu, Some(format!("no GPU adapter ({e}); running on the CPU executor")))),
        },
    }
}

/// The outputs of the model as written (at its own batch, or on a causal model's shared
/// positions: see [`shardc::written::reference`]) for the inputs of the re-shaped graph `g`.
fn written_reference(
    args: &RunArgs,
    g: &ir::Graph,
    inputs: &std::collections::HashMap<String, ir::eval::Array>,
) -> Result<shardc::written::Written, String> {
    let mut written =
        load_canonical(&args.model, &ShapeArgs::default()).map_err(|e| e.message.trim_end().to_string())?;
    let dir = args.model.parent().map(PathBuf::from).unwrap_or_default();
    exec::materialize(&mut written.model, &dir, args.seed)?;
    shardc::written::reference(g, &written.model.graph, inputs, (args.rtol, args.atol))
}

pub fn run(args: &RunArgs) -> CliResult {
    // Under mpirun each process runs one device (see `train --transport`).
    let mpi = args.transport.start()?;
    guard_outputs(
        &[("--save-outputs", args.save_outputs.as_ref())],
        &[Some(&args.model), args.inputs.as_deref(), args.plan.as_deref()],
    )?;
    // A plan runs at the input shapes it was made for, unless they are given.
    let plan_doc = args.plan.as_deref().map(read_plan).transpose()?;
    let shapes = match &plan_doc {
        Some(p) if args.shapes.is_empty() => ShapeArgs::of_plan(p),
        _ => args.shapes.clone(),
    };
    // Given inputs type the graph's inputs (and bind its shape parameters) unless the
    // shapes come from flags or the plan.
    let (mut loaded, given) = match &args.inputs {
        Some(p) if plan_doc.is_none() && shapes.is_empty() => {
            let (l, given) = load_with_values(&args.model, p)?;
            (l, Some(given))
        }
        Some(p) => {
            let l = load_canonical(&args.model, &shapes)?;
            let given = exec::given_inputs(&l.model.graph, p).map_err(CliError::msg)?;
            (l, Some(given))
        }
        None => (load_canonical(&args.model, &shapes)?, None),
    };
    if let Some(p) = &plan_doc {
        apply_plan_rewrites(&mut loaded.model.graph, p)?;
    }
    args.model_args.freeze(&mut loaded.model.graph)?;
    let dir = args.model.parent().map(PathBuf::from).unwrap_or_default();
    let weights = exec::materialize(&mut loaded.model, &dir, args.seed).map_err(CliError::msg)?;
    let g = &loaded.model.graph;
    let mut notes: Vec<String> = Vec::new();
    notes.extend(seeded_weights(&weights, args.seed, args.require_weights, " (the reference uses the same values)")?);
    if weights.loaded > 0 {
        notes.push(format!("weights: {} tensors read from external data files", weights.loaded));
    }
    let opts = args.model_args.options()?;
    // The plan.
    // The cost model's forward-pass prediction (cluster name, seconds), when there is one.
    let mut predicted: Option<(String, f64)> = None;
    let (program, plan_desc) = if let (Some(path), Some(plan)) = (&args.plan, &plan_doc) {
        notes.extend(check_plan_model(plan, path, &args.model, args.force)?);
        let p = exec::program_for_plan(g, plan).map_err(|e| CliError::msg(format!("the plan does not lower: {e}")))?;
        if plan.stages.len() <= 1
            && let Some(f) = plan.breakdown.get("forward_s").and_then(|v| v.as_f64())
        {
            predicted = Some((plan.cluster.clone(), f));
        }
        (p, format!("plan {} ({} devices)", path.display(), plan.devices))
    } else {
        let cluster = load_cluster(&args.cluster)?;
        if let Some(s) = &args.strategy {
            let r = exec::named_result(g, &cluster, args.devices, s, &opts).map_err(CliError::msg)?;
            let p = exec::program_for_search(g, &r, args.devices).map_err(CliError::msg)?;
            predicted = Some((cluster.name.clone(), r.breakdown.forward_s));
            (p, format!("strategy `{s}` on {} devices of {}", args.devices, cluster.name))
        } else {
            let pipeline = PipelineMode::parse(&args.pipeline).map_err(CliError::msg)?;
            let (progress, bar) = super::ui::search_progress(60.0);
            let so = SearchOptions { pipeline, time_limit: Duration::from_secs(60), progress, ..Default::default() };
            // The search `plan` makes, rewrites included: the program runs the rewritten
            // graph, checked against the model as written.
            let mut h = g.clone();
            let r = autoshard::search_rewriting(&mut h, &cluster, args.devices, &opts, &so);
            super::ui::finish(bar);
            let r = r.map_err(CliError::msg)?;
            notes.extend(r.rewrites.iter().filter(|c| c.applied).map(super::plan::rewrite_note));
            let what = match &r.pipeline {
                Some(p) => format!("{} stages × {} micro-batches", p.stages.len(), p.micro_batches),
                None => r.same_as.clone().map_or("per-layer strategies".into(), |s| format!("the `{s}` plan")),
            };
            let p = exec::program_for_search(&h, &r, args.devices).map_err(CliError::msg)?;
            match &r.pipeline {
                None => predicted = Some((cluster.name.clone(), r.breakdown.forward_s)),
                // Why it pipelines (faster, or the only way to fit), as `plan` says it.
                Some(pp) => notes.push(format!("pipelined because {}", autoshard::plan::pipeline_reason(&r, pp))),
            }
            (
                p,
                format!(
                    "searched plan on {} devices of {} ({what}, mesh {})",
                    args.devices,
                    cluster.name,
                    autoshard::mesh_string(&r.mesh)
                ),
            )
        }
    };
    check_program(&program)?;
    for f in &program.fallbacks {
        notes.push(format!("runs replicated instead of as planned: {f}"));
    }
    let (be, warn_be) = backend(args)?;
    let promise =
        preflight(&program, &[("model", g)], g, args.check.then_some(Reference { graph: g, built_anew: false }), be)?;
    let inputs = exec::inputs_for(g, given.as_ref(), args.seed).map_err(CliError::msg)?;
    if let Some(w) = warn_be {
        notes.push(format!("warning: {w}"));
    }
    let distributed = args.transport.distributed(mpi.as_ref(), program.devices.len(), &program)?;
    let rank = distributed.as_ref().map_or(0, |d| d.rank);
    let report = codegen::run(
        &program,
        &inputs,
        &RunOptions { backend: be, steps: args.steps, distributed, ..Default::default() },
    )
    .map_err(|e| CliError::msg(format!("the run failed: {e}")))?;
    if rank != 0 {
        // Device 0's process checks and reports for the job.
        return Ok(());
    }
    // Check against the reference.
    let mut checks: Vec<(String, f64, f64, bool)> = Vec::new();
    if args.check {
        let reference = ir::eval::run(g, &inputs, &Default::default())
            .map_err(|e| CliError::msg(format!("the reference run failed: {e}")))?;
        for ((name, got), want) in report.outputs.iter().zip(&reference) {
            let (a, r, ok) = exec::compare(got, want, args.rtol, args.atol);
            checks.push((name.clone(), a, r, ok));
        }
        // The reference above runs the re-shaped graph; where the shapes changed, the model as
        // written checks the rewriting itself.
        if !shapes.is_empty() {
            match written_reference(args, g, &inputs) {
                Ok(written) => {
                    for (i, ((name, got), want)) in report.outputs.iter().zip(&written.outputs).enumerate() {
                        let (a, r, ok) = exec::compare(&written.covered(i, got), want, args.rtol, args.atol);
                        checks.push((format!("{name} ({})", written.label(i)), a, r, ok));
                    }
                }
                Err(why) => notes.push(format!(
                    "the check's reference runs the re-shaped model, so it cannot catch a wrong rewriting of its shapes; no reference from the model as written: {why}"
                )),
            }
        }
    }
    if let Some(out) = &args.save_outputs {
        let ins: serde_json::Map<String, serde_json::Value> = g
            .input_values()
            .iter()
            .filter_map(|v| {
                let n = g.value_name(*v).to_string();
                inputs.get(&n).map(|a| (n, exec::array_to_json(a)))
            })
            .collect();
        let outs: serde_json::Map<String, serde_json::Value> =
            report.outputs.iter().map(|(n, a)| (n.clone(), exec::array_to_json(a))).collect();
        let doc =
            serde_json::json!({"inputs": ins, "outputs": outs, "tolerance": {"rtol": args.rtol, "atol": args.atol}});
        write_output(&serde_json::to_string(&doc).expect("JSON"), Some(out), &args.model)?;
    }
    let failed = checks.iter().any(|c| !c.3);
    if args.json {
        let doc = serde_json::json!({
            "model": args.model.display().to_string(),
            "plan": plan_desc,
            "backend": format!("{be:?}").to_lowercase(),
            "devices": report.devices,
            "wall_s": report.wall_s,
            "steps": args.steps,
            "step_s": report.step_s(),
            "predicted": predicted.as_ref().map(|(c, f)| {
                let error = (c.starts_with("local") && be == Backend::Wgpu).then(|| (f - report.step_s()) / report.step_s());
                serde_json::json!({"cluster": c, "forward_s": f, "error": error})
            }),
            "micro_batches": program.micro_batches,
            "host_memory": host_memory_json(&promise),
            "notes": notes,
            "check": checks.iter().map(|(n, a, r, ok)| serde_json::json!({"output": n, "max_abs_error": a, "max_rel_error": r, "ok": ok})).collect::<Vec<_>>(),
        });
        write_output(&serde_json::to_string_pretty(&doc).expect("JSON"), None, &args.model)?;
    } else {
        let mut t = String::new();
        t.push_str(&format!("model        {}\n", args.model.display()));
        t.push_str(&format!("plan         {plan_desc}\n"));
        for n in &notes {
            t.push_str(&format!("note         {n}\n"));
        }
        t.push_str(&format!(
            "ran          {} devices, {} micro-batch{}, {} backend, {:.3} s wall\n",
            report.devices.len(),
            program.micro_batches,
            if program.micro_batches == 1 { "" } else { "es" },
            format!("{be:?}").to_lowercase(),
            report.wall_s
        ));
        t.push_str(&host_memory_line(&promise));
        t.push_str(&format!(
            "step         {} (slowest device{}){}\n",
            secs(report.step_s()),
            if args.steps > 1 { format!(", step {} of {}", args.steps, args.steps) } else { String::new() },
            if args.steps == 1 && be == Backend::Wgpu {
                "; the first step also compiles kernels: --steps 2 times a warm one"
            } else {
                ""
            }
        ));
        if let Some((c, f)) = &predicted {
            // The local clusters model the wgpu devices; against the CPU executor, or for
            // another cluster, the prediction is not a like-for-like figure.
            let like_for_like = c.starts_with("local") && be == Backend::Wgpu;
            if like_for_like && args.steps == 1 {
                // One step also compiles every kernel: comparing with it says nothing.
                t.push_str(&format!(
                    "predicted    {} forward on {c} (not compared: the only step also compiled the kernels; --steps 2 times a warm one)\n",
                    secs(*f)
                ));
            } else if like_for_like {
                t.push_str(&format!(
                    "predicted    {} forward on {c} ({:+.0}% vs measured)\n",
                    secs(*f),
                    (f - report.step_s()) / report.step_s() * 100.0
                ));
            } else {
                t.push_str(&format!(
                    "predicted    {} forward on {c} (not comparable with this run: {})\n",
                    secs(*f),
                    if be == Backend::Wgpu {
                        "calibrate the local devices with `shardc calibrate`"
                    } else {
                        "the cpu backend"
                    }
                ));
            }
        }
        // Adapter names whole (a column as wide as the longest).
        let rows: Vec<Vec<String>> = report
            .devices
            .iter()
            .map(|d| {
                vec![
                    format!("  {}", d.device),
                    d.adapter.clone(),
                    secs(d.wall_s),
                    secs(d.compute_s),
                    secs(d.communication_s),
                    d.host_ops.values().sum::<usize>().to_string(),
                ]
            })
            .collect();
        t.push_str(&passes::table::table(
            &["  device", "adapter", "wall", "compute", "communication", "host ops"],
            &rows,
            &[true, false, true, true, true, true],
        ));
        let mut by_op: HashMap<&str, f64> = HashMap::new();
        let mut by_comm: HashMap<&str, f64> = HashMap::new();
        for d in &report.devices {
            for (k, v) in &d.by_op {
                *by_op.entry(k).or_insert(0.0) += v;
            }
            for (k, v) in &d.by_collective {
                *by_comm.entry(k).or_insert(0.0) += v;
            }
        }
        let mut ops: Vec<_> = by_op.into_iter().collect();
        ops.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        t.push_str("time per op kind (all devices)\n");
        for (k, v) in ops.iter().take(12) {
            t.push_str(&format!("  {k:<24} {:>10}\n", secs(*v)));
        }
        if !by_comm.is_empty() {
            let mut c: Vec<_> = by_comm.into_iter().collect();
            c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
            t.push_str("time per collective (all devices)\n");
            for (k, v) in c {
                t.push_str(&format!("  {k:<24} {:>10}\n", secs(v)));
            }
        }
        if args.check {
            t.push_str(&format!(
                "check        against the single-device CPU reference (rtol {}, atol {})\n",
                args.rtol, args.atol
            ));
            for (n, a, r, ok) in &checks {
                t.push_str(&format!(
                    "  {:<32} max abs error {a:.3e}  max rel error {r:.3e}  {}\n",
                    n,
                    check_verdict(*ok, *r, args.rtol)
                ));
            }
        }
        write_output(&t, None, &args.model)?;
    }
    if failed {
        return Err(CliError::new("error: outputs differ from the reference beyond the tolerance"));
    }
    Ok(())
}

/// `ok`, or `ok` with why when the relative error is over `rtol` (each element is within
/// `atol + rtol·|expected|`: the largest relative errors are on values near zero, where atol
/// decides), or `FAILED`.
pub fn check_verdict(ok: bool, max_rel: f64, rtol: f64) -> &'static str {
    match (ok, max_rel > rtol) {
        (false, _) => "FAILED",
        (true, false) => "ok",
        (true, true) => "ok (within atol: the largest relative errors are on values near zero)",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn verdicts_say_when_atol_decided() {
        assert_eq!(super::check_verdict(true, 1e-6, 1e-4), "ok");
        assert!(super::check_verdict(true, 4.6e-3, 1e-4).starts_with("ok (within atol"));
        assert_eq!(super::check_verdict(false, 4.6e-3, 1e-4), "FAILED");
    }
}
