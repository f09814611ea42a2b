//! `shardc run`: compile a model to a plan (or take one), lower it and run it on simulated
//! devices; with `--check`, compare every output with the single-device reference.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use codegen::{Backend, RunOptions};
use ir::eval::Array;
use passes::autoshard::{self, PipelineMode, SearchOptions};
use shardc::exec;
use shardc::footprint::Reference;
use shardc::session::{self, CheckRow, Choice, How, Planned};

use super::common::*;
use super::cost::{ModelArgs, load_cluster, secs};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The model (ONNX textual syntax).
    pub model: PathBuf,
    /// Run this plan (from `shardc plan -o`).
    #[arg(long, value_name = "PLAN.json", conflicts_with = "strategy")]
    pub plan: Option<PathBuf>,
    /// Run a named strategy (data, model, megatron, spatial, hybrid:dp:D,tp:T, spatial-hybrid:DxS, owt, context, context:dp:D,tp:T, context:ring[:dp:D,tp:T], expert, expert:ep:E) instead of a searched plan; or a configuration of key=value fields (tp=2,dp=2,sp; docs/memory.md) — recompute, zero=3, flash and mbs are training's or pricing's and refused here.
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
    /// cpu (vectorised SGEMM for matrix products and convolutions, the reference kernels for
    /// the rest).
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
    /// First prove that the devices' programs compute the model (docs/verify.md); exit 1,
    /// running nothing, when the proof fails.
    #[arg(long)]
    pub verify: bool,
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

/// The model prepared for the run: loaded at the shapes asked for (or a plan's, or the given
/// inputs'), the plan's rewrites applied, weights materialized.
struct Prepared {
    loaded: shardc::Loaded,
    /// Values from `--inputs`.
    given: Option<HashMap<String, Array>>,
    plan: Option<passes::autoshard::Plan>,
    /// The shapes were changed from the model as written.
    reshaped: bool,
    notes: Vec<String>,
}

fn prepare(args: &RunArgs) -> CliResult<Prepared> {
    // A plan runs at the input shapes it was made for, unless they are given.
    let plan = args.plan.as_deref().map(read_plan).transpose()?;
    let shapes = match &plan {
        Some(p) if args.shapes.is_empty() => ShapeArgs::of_plan(p),
        _ => args.shapes.clone(),
    };
    // Given inputs type the graph's inputs (and bind its shape parameters) unless the
    // shapes come from flags or the plan.
    let (mut loaded, given) = match &args.inputs {
        Some(p) if plan.is_none() && shapes.is_empty() => {
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
    if let Some(p) = &plan {
        apply_plan_rewrites(&mut loaded.model.graph, p)?;
    }
    args.model_args.freeze(&mut loaded.model.graph)?;
    let weights = exec::materialize(&mut loaded.model, &model_dir(args), args.seed).map_err(CliError::msg)?;
    let mut notes: Vec<String> =
        seeded_weights(&weights, args.seed, args.require_weights, " (the reference uses the same values)")?
            .into_iter()
            .collect();
    if weights.loaded > 0 {
        notes.push(format!("weights: {} tensors read from external data files", weights.loaded));
    }
    if let (Some(path), Some(p)) = (&args.plan, &plan) {
        notes.extend(check_plan_model(p, path, &args.model, args.force)?);
    }
    Ok(Prepared { loaded, given, plan, reshaped: !shapes.is_empty(), notes })
}

fn model_dir(args: &RunArgs) -> PathBuf {
    args.model.parent().map(PathBuf::from).unwrap_or_default()
}

/// The program for `g`: the plan file's, the named strategy's or the search's
/// ([`session::plan`]), with the notes the search leaves (rewrites applied, why it pipelines).
fn plan_program(
    args: &RunArgs,
    g: &ir::Graph,
    plan: Option<&passes::autoshard::Plan>,
    notes: &mut Vec<String>,
) -> CliResult<Planned> {
    let mut opts = args.model_args.options()?;
    // A configuration (`tp=2,dp=2,sp,zero=3`) runs as the named strategy it is, with its options.
    let configured = match args.strategy.as_deref().filter(|s| autoshard::config::is_config(s)) {
        Some(s) => {
            let err = |e: String| CliError::msg(format!("--strategy `{s}`: {e}"));
            let c = autoshard::config::Config::parse(s).map_err(err)?;
            let batch = passes::cost::pipeline::graph_batch(g);
            let r = shardc::session::configured(&c, args.devices, batch, &opts).map_err(|e| err(e.to_string()))?;
            if r.capacity.is_some() {
                return Err(
                    err("capacity: `run` dispatches no tokens by all-to-all yet; `train` and `cost` do".into()),
                );
            }
            opts = r.options;
            match opts.zero {
                0 => {}
                1 | 2 => notes.push(format!(
                    "zero={}: shards the optimizer state and gradients, which a forward run does not have",
                    opts.zero
                )),
                z => return Err(err(format!("zero={z}: `run` holds the parameters whole; `train` runs ZeRO-3"))),
            }
            opts.zero = 0;
            Some(r.strategy)
        }
        None => None,
    };
    if opts.recompute != passes::cost::Recompute::None {
        return Err(CliError::msg(
            "recompute: `run` executes the forward pass, which recomputes nothing; recomputation is priced by `cost` and `plan` and run by `train`",
        ));
    }
    let cluster = load_cluster(&args.cluster)?;
    let (choice, bar) = match (&args.plan, plan, &args.strategy) {
        (Some(path), Some(plan), _) => (Choice::Plan { plan, name: path.display().to_string() }, None),
        (_, _, Some(s)) => (Choice::Strategy(configured.as_deref().unwrap_or(s)), None),
        _ => {
            let pipeline = PipelineMode::parse(&args.pipeline).map_err(CliError::msg)?;
            let (progress, bar) = super::ui::search_progress(60.0);
            // The plan is run as found: no memory-saving options the lowering does not emit.
            let so = SearchOptions {
                pipeline,
                time_limit: Duration::from_secs(60),
                progress,
                memory_ladder: false,
                ..Default::default()
            };
            (Choice::Search(so), bar)
        }
    };
    let planned = session::plan(g, choice, &cluster, args.devices, &opts);
    super::ui::finish(bar);
    let mut planned = planned.map_err(CliError::msg)?;
    // A configuration is reported as given, with the named strategy it ran as.
    if let (Some(named), Some(given), How::Strategy { name, .. }) = (&configured, &args.strategy, &mut planned.how) {
        *name = format!("{given}` as `{named}");
    }
    if let How::Search { result: r, .. } = &planned.how {
        notes.extend(r.rewrites.iter().filter(|c| c.applied).map(super::plan::rewrite_note));
        if let Some(pp) = &r.pipeline {
            // Why it pipelines (faster, or the only way to fit), as `plan` says it.
            notes.push(format!("pipelined because {}", autoshard::plan::pipeline_reason(r, pp)));
        }
    }
    Ok(planned)
}

/// What was run, for the report: `plan P (4 devices)`, `strategy `data` on 4 devices of C`,
/// `searched plan on 4 devices of C (…, mesh …)`.
fn describe(how: &How) -> String {
    match how {
        How::Plan { name, devices } => format!("plan {name} ({devices} devices)"),
        How::Strategy { name, devices, cluster } => format!("strategy `{name}` on {devices} devices of {cluster}"),
        How::Search { result: r, devices, cluster } => {
            let what = match &r.pipeline {
                Some(p) => format!("{} stages × {} micro-batches", p.stages.len(), p.micro_batches),
                None => r.same_as.clone().map_or("per-layer strategies".into(), |s| format!("the `{s}` plan")),
            };
            format!(
                "searched plan on {devices} devices of {cluster} ({what}, mesh {})",
                autoshard::mesh_string(&r.mesh)
            )
        }
    }
}

/// `--check`: every output against the single-device reference, and for a re-shaped model
/// against the model as written where one can be built (else a note says why not).
fn check(
    args: &RunArgs,
    g: &ir::Graph,
    got: &[(String, Array)],
    inputs: &HashMap<String, Array>,
    reshaped: bool,
    notes: &mut Vec<String>,
) -> CliResult<Vec<CheckRow>> {
    let tol = (args.rtol, args.atol);
    // The model as written checks the rewriting of its shapes itself.
    let written = reshaped.then(|| load_written(args));
    let model = written.as_ref().and_then(|w| w.as_ref().ok());
    let (rows, why) = session::check(g, got, inputs, model.map(|m| &m.graph), tol).map_err(CliError::msg)?;
    // Why there is no reference from the model as written: it did not load, or it has none.
    if let Some(why) = why.or(written.and_then(Result::err)) {
        notes.push(format!(
            "the check's reference runs the re-shaped model, so it cannot catch a wrong rewriting of its shapes; no reference from the model as written: {why}"
        ));
    }
    Ok(rows)
}

/// The model as written, its weights materialized as the run's are.
fn load_written(args: &RunArgs) -> Result<ir::Model, String> {
    let mut written =
        load_canonical(&args.model, &ShapeArgs::default()).map_err(|e| e.message.trim_end().to_string())?;
    exec::materialize(&mut written.model, &model_dir(args), args.seed)?;
    Ok(written.model)
}

pub fn run(args: &RunArgs) -> CliResult {
    // Under mpirun each process runs one device (see `train --transport`).
    let mpi = args.transport.start()?;
    guard_outputs(
        &[("--save-outputs", args.save_outputs.as_ref())],
        &[Some(&args.model), args.inputs.as_deref(), args.plan.as_deref()],
    )?;
    let Prepared { loaded, given, plan, reshaped, mut notes } = prepare(args)?;
    let g = &loaded.model.graph;
    let planned = plan_program(args, g, plan.as_ref(), &mut notes)?;
    let program = &planned.program;
    check_program(program)?;
    if args.verify {
        notes.push(proved_forward(planned.rewritten.as_ref().unwrap_or(g), program)?);
    }
    for f in &program.fallbacks {
        notes.push(format!("runs replicated instead of as planned: {f}"));
    }
    let (be, warn_be) = backend(args)?;
    let promise =
        preflight(program, &[("model", g)], g, args.check.then_some(Reference { graph: g, built_anew: false }), be)?;
    let inputs = exec::inputs_for(g, given.as_ref(), args.seed).map_err(CliError::msg)?;
    if let Some(w) = warn_be {
        notes.push(format!("warning: {w}"));
    }
    let distributed = args.transport.distributed(mpi.as_ref(), program.devices.len(), program)?;
    let rank = distributed.as_ref().map_or(0, |d| d.rank);
    let report = codegen::run(
        program,
        &inputs,
        &RunOptions { backend: be, steps: args.steps, distributed, ..Default::default() },
    )
    .map_err(|e| CliError::msg(format!("the run failed: {e}")))?;
    if rank != 0 {
        // Device 0's process checks and reports for the job.
        return Ok(());
    }
    let checks = if args.check { check(args, g, &report.outputs, &inputs, reshaped, &mut notes)? } else { Vec::new() };
    if let Some(out) = &args.save_outputs {
        save_outputs(args, g, &inputs, &report.outputs, out)?;
    }
    let shown = Shown {
        args,
        plan: describe(&planned.how),
        predicted: planned.predicted.clone(),
        micro_batches: program.micro_batches,
        be,
        report: &report,
        promise: &promise,
        notes: &notes,
        checks: &checks,
    };
    let text = if args.json { serde_json::to_string_pretty(&shown.json()).expect("JSON") } else { shown.text() };
    write_output(&text, None, &args.model)?;
    if checks.iter().any(|c| !c.ok) {
        return Err(CliError::new("error: outputs differ from the reference beyond the tolerance"));
    }
    Ok(())
}

/// `--save-outputs`: the inputs and outputs in the golden `.io.json` format.
fn save_outputs(
    args: &RunArgs,
    g: &ir::Graph,
    inputs: &HashMap<String, Array>,
    outputs: &[(String, Array)],
    out: &PathBuf,
) -> CliResult {
    let ins: serde_json::Map<String, serde_json::Value> = g
        .input_values()
        .iter()
        .filter_map(|v| {
            let n = g.value_name(*v).to_string();
            inputs.get(&n).map(|a| (n, exec::array_to_json(a)))
        })
        .collect();
    let outs: serde_json::Map<String, serde_json::Value> =
        outputs.iter().map(|(n, a)| (n.clone(), exec::array_to_json(a))).collect();
    let doc = serde_json::json!({"inputs": ins, "outputs": outs, "tolerance": {"rtol": args.rtol, "atol": args.atol}});
    write_output(&serde_json::to_string(&doc).expect("JSON"), Some(out), &args.model)
}

/// What the report shows.
struct Shown<'a> {
    args: &'a RunArgs,
    plan: String,
    predicted: Option<(String, f64)>,
    micro_batches: usize,
    be: Backend,
    report: &'a codegen::RunReport,
    promise: &'a shardc::footprint::Footprint,
    notes: &'a [String],
    checks: &'a [CheckRow],
}

impl Shown<'_> {
    fn backend(&self) -> String {
        format!("{:?}", self.be).to_lowercase()
    }

    /// The local clusters model the wgpu devices; against the CPU executor, or for another
    /// cluster, the prediction is not a like-for-like figure.
    fn like_for_like(&self, cluster: &str) -> bool {
        cluster.starts_with("local") && self.be == Backend::Wgpu
    }

    fn json(&self) -> serde_json::Value {
        let (args, report) = (self.args, self.report);
        serde_json::json!({
            "model": args.model.display().to_string(),
            "plan": self.plan,
            "backend": self.backend(),
            "devices": report.devices,
            "wall_s": report.wall_s,
            "steps": args.steps,
            "step_s": report.step_s(),
            "predicted": self.predicted.as_ref().map(|(c, f)| {
                let error = self.like_for_like(c).then(|| (f - report.step_s()) / report.step_s());
                serde_json::json!({"cluster": c, "forward_s": f, "error": error})
            }),
            "micro_batches": self.micro_batches,
            "host_memory": host_memory_json(self.promise),
            "notes": self.notes,
            "check": self.checks.iter().map(|c| serde_json::json!({"output": c.output, "max_abs_error": c.max_abs_error, "max_rel_error": c.max_rel_error, "ok": c.ok})).collect::<Vec<_>>(),
        })
    }

    fn text(&self) -> String {
        let (args, report) = (self.args, self.report);
        let mut t = String::new();
        t.push_str(&format!("model        {}\n", args.model.display()));
        t.push_str(&format!("plan         {}\n", self.plan));
        for n in self.notes {
            t.push_str(&format!("note         {n}\n"));
        }
        t.push_str(&format!(
            "ran          {} devices, {} micro-batch{}, {} backend, {:.3} s wall\n",
            report.devices.len(),
            self.micro_batches,
            if self.micro_batches == 1 { "" } else { "es" },
            self.backend(),
            report.wall_s
        ));
        t.push_str(&host_memory_line(self.promise));
        t.push_str(&format!(
            "step         {} (slowest device{}){}\n",
            secs(report.step_s()),
            if args.steps > 1 { format!(", step {} of {}", args.steps, args.steps) } else { String::new() },
            if args.steps == 1 && self.be == Backend::Wgpu {
                "; the first step also compiles kernels: --steps 2 times a warm one"
            } else {
                ""
            }
        ));
        t.push_str(&self.predicted_line());
        t.push_str(&self.device_table());
        if args.check {
            t.push_str(&format!(
                "check        against the single-device CPU reference (rtol {}, atol {})\n",
                args.rtol, args.atol
            ));
            for c in self.checks {
                t.push_str(&format!(
                    "  {:<32} max abs error {:.3e}  max rel error {:.3e}  {}\n",
                    c.output,
                    c.max_abs_error,
                    c.max_rel_error,
                    check_verdict(c.ok, c.max_rel_error, args.rtol)
                ));
            }
        }
        t
    }

    /// The cost model's forward time beside the measured step, where they compare.
    fn predicted_line(&self) -> String {
        let Some((c, f)) = &self.predicted else { return String::new() };
        let step = self.report.step_s();
        if self.like_for_like(c) && self.args.steps == 1 {
            // One step also compiles every kernel: comparing with it says nothing.
            format!(
                "predicted    {} forward on {c} (not compared: the only step also compiled the kernels; --steps 2 times a warm one)\n",
                secs(*f)
            )
        } else if self.like_for_like(c) {
            format!("predicted    {} forward on {c} ({:+.0}% vs measured)\n", secs(*f), (f - step) / step * 100.0)
        } else {
            format!(
                "predicted    {} forward on {c} (not comparable with this run: {})\n",
                secs(*f),
                if self.be == Backend::Wgpu {
                    "calibrate the local devices with `shardc calibrate`"
                } else {
                    "the cpu backend"
                }
            )
        }
    }

    /// Per device: adapter, wall, compute, communication, host ops and kernel dispatches (of
    /// the last step); then the time per op
    /// kind and per collective over all devices.
    fn device_table(&self) -> String {
        let report = self.report;
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
                    d.dispatches.to_string(),
                ]
            })
            .collect();
        let mut t = passes::table::table(
            &["  device", "adapter", "wall", "compute", "communication", "host ops", "dispatches"],
            &rows,
            &[true, false, true, true, true, true, true],
        );
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
        let sorted = |m: HashMap<&str, f64>| {
            let mut v: Vec<(String, f64)> = m.into_iter().map(|(k, s)| (k.to_string(), s)).collect();
            v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            v
        };
        t.push_str("time per op kind (all devices)\n");
        for (k, v) in sorted(by_op).iter().take(12) {
            t.push_str(&format!("  {k:<24} {:>10}\n", secs(*v)));
        }
        if !by_comm.is_empty() {
            t.push_str("time per collective (all devices)\n");
            for (k, v) in sorted(by_comm) {
                t.push_str(&format!("  {k:<24} {:>10}\n", secs(v)));
            }
        }
        t
    }
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
