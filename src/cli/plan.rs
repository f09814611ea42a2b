//! `shardc plan`: search for the best sharding plan of a model on a cluster.

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use passes::autoshard::{self, Autoshard, Plan, SearchOptions, plan::ModelInfo};
use sha2::Digest;

use super::common::*;
use super::cost::{ModelArgs, load_cluster, secs};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlanEmit {
    /// The model in the ONNX textual syntax, each op annotated with its strategy and
    /// layouts (`shardc_*` attributes; parses back).
    Text,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportKind {
    /// Megatron-LM's command-line arguments (tensor, pipeline, micro-batch sizes,
    /// sequence parallelism, recomputation).
    Megatron,
    /// A DeepSpeed configuration (JSON) with the parallel degrees beside it.
    Deepspeed,
    /// A PyTorch `torch.distributed.tensor.parallel` plan: module path → ColwiseParallel /
    /// RowwiseParallel / SequenceParallel.
    TorchTp,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The model (ONNX textual syntax).
    pub model: PathBuf,
    /// A preset (dgx-a100, dgx-h100, dgx1-v100, pcie-v100x8, a100-cluster-N, h100-cluster-N, local-wgpu) or a TOML file.
    #[arg(long)]
    pub cluster: String,
    /// Devices to use (default: all of the cluster).
    #[arg(long, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: Option<usize>,
    /// Write the plan (JSON) here.
    #[arg(short = 'o', long = "output", value_name = "PLAN.json")]
    pub output: Option<PathBuf>,
    /// Print the plan (JSON) on stdout.
    #[arg(long)]
    pub json: bool,
    /// Print a per-layer table with data parallelism beside it.
    #[arg(long)]
    pub report: bool,
    /// Name the layers where the plan differs from data parallelism, with the time and
    /// memory each difference saves or costs, largest first (and a pipeline's reasons).
    #[arg(long)]
    pub explain: bool,
    /// Lower the plan and prove its programs compute the model (docs/verify.md); exit 1,
    /// writing nothing, when the proof fails.
    #[arg(long)]
    pub verify: bool,
    /// Print the plan as a framework's launch settings instead of a summary; an error naming
    /// the ops that keep it from the framework's template when it does not fit one.
    #[arg(long, value_enum)]
    pub export: Option<ExportKind>,
    /// Print the annotated model instead of a summary.
    #[arg(long, value_enum)]
    pub emit: Option<PlanEmit>,
    /// Search budget in seconds; the best plan found so far is returned when it runs out.
    #[arg(long = "time-limit", value_name = "SECS", default_value_t = 60.0, value_parser = parse_seconds, allow_negative_numbers = true)]
    pub time_limit: f64,
    /// E-graph node limit per mesh.
    #[arg(long = "node-limit", value_name = "N", value_parser = parse_count, allow_negative_numbers = true)]
    pub node_limit: Option<usize>,
    /// Pipeline parallelism: off, auto (when it is faster or the only way to fit) or a
    /// stage count.
    #[arg(long, default_value = "auto", value_name = "off|auto|S", value_parser = parse_pipeline)]
    pub pipeline: String,
    /// Repeated-layer folding: search a stack of identical blocks as three of them and copy
    /// the plan to every block (auto: for graphs of 1,000 ops or more).
    #[arg(long, default_value = "auto", value_name = "auto|always|never", value_parser = parse_fold)]
    pub fold: autoshard::FoldMode,
    /// Do not try the algebraic rewrites the search chooses between (fuse-attention, conv-as-matmul,
    /// fuse-gemms: each is searched on the whole graph and kept when its plan is faster)
    #[arg(long)]
    pub no_rewrites: bool,
    /// When no plan fits, do not search again with recomputation, sequence parallelism and
    /// ZeRO (the memory ladder, docs/memory.md): the plan stays one `lower`, `run` and
    /// `train --plan` can run
    #[arg(long = "no-memory-saving")]
    pub no_memory_saving: bool,
    /// Let expert parallelism dispatch each mixture of experts' tokens by all-to-all, with
    /// buffers of this factor times an even share of the routed pairs per device (0:
    /// dropless; a run that overflows them stops with an error): the search prices it beside
    /// the all-gather dispatcher and keeps the faster. Without it, the tokens are
    /// all-gathered over the expert axis.
    #[arg(long = "moe-capacity", value_name = "FACTOR")]
    pub moe_capacity: Option<f32>,
    /// Draw the step (a pipeline's schedule, stages × time) as an SVG timeline.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Write a self-contained HTML report: the summary, the model coloured by strategy,
    /// memory per device, communication per block, the timeline and the explanation.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Print the model to stderr after these passes (comma-separated: verify, rebatch,
    /// infer-shapes, canonicalize, autoshard, or `all`).
    #[arg(long = "dump-after", value_delimiter = ',', value_name = "PASS")]
    pub dump_after: Vec<String>,
    #[command(flatten)]
    pub shapes: ShapeArgs,
    #[command(flatten)]
    pub model_args: ModelArgs,
}

/// What the strategies' letters mean, printed under them.
pub const NOTATION: &str = "\
notation     `dim→axis`: an op's loop dim split over a mesh axis (`replicated`: none split)
             MatMul/Gemm: m rows, n columns, k the reduction (partial sums), b0… batch dims
             Conv: n samples, m filters, c channels (a reduction), s0… spatial (with halos)
             Gather: i0… indices, v vocabulary rows, e0… embedding dims; other ops: d0… output dims
";

fn parse_fold(s: &str) -> Result<autoshard::FoldMode, String> {
    match s {
        "auto" => Ok(autoshard::FoldMode::Auto),
        "always" => Ok(autoshard::FoldMode::Always),
        "never" => Ok(autoshard::FoldMode::Never),
        _ => Err(format!("`{s}` is not auto, always or never")),
    }
}

const PLAN_PASSES: &[&str] = &["verify", "rebatch", "infer-shapes", "canonicalize", "algebra", "autoshard"];

/// What the plan document records of the model it was made for.
fn model_info(args: &PlanArgs, g: &ir::Graph, bytes: &[u8]) -> ModelInfo {
    ModelInfo {
        path: args.model.display().to_string(),
        sha256: format!("{:x}", sha2::Sha256::digest(bytes)),
        graph: g.name.clone(),
        batch: passes::cost::pipeline::graph_batch(g),
        input_shapes: g
            .input_values()
            .into_iter()
            .filter(|v| matches!(g.node(v.node).op, ir::Op::Input { default: None }))
            .filter_map(|v| Some((g.value_name(v).to_string(), g.tensor_type(v)?.static_dims()?)))
            .collect(),
    }
}

/// The passes `plan` runs before the search: verify, rebatch (when asked), shape inference,
/// canonicalization, the algebra, the dispatcher's capacity (when asked), static shapes.
fn prepare_passes(args: &PlanArgs, spec: passes::RebatchSpec) -> passes::PassManager {
    let mut pm = passes::PassManager::new().with_dump_after(args.dump_after.clone());
    pm.add(passes::Verify);
    if !spec.is_empty() {
        pm.add(passes::Rebatch { spec });
    }
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize).add(passes::Algebra);
    if let Some(f) = args.moe_capacity {
        pm.add(passes::MoeCapacity(f));
    }
    pm.add(passes::RequireStatic);
    pm
}

pub fn run(args: &PlanArgs) -> CliResult {
    for d in &args.dump_after {
        if d != "all" && !PLAN_PASSES.contains(&d.as_str()) {
            return Err(CliError::msg(format!(
                "--dump-after: unknown pass `{d}`; plan runs {}",
                PLAN_PASSES.join(", ")
            )));
        }
    }
    guard_outputs(
        &[("-o", args.output.as_ref()), ("--svg", args.svg.as_ref()), ("--html", args.html.as_ref())],
        &[Some(&args.model)],
    )?;
    let cluster = load_cluster(&args.cluster)?;
    let devices = args.devices.unwrap_or(cluster.devices());
    cluster.mesh(devices).map_err(CliError::msg)?;
    let opts = args.model_args.options()?;
    let bytes = std::fs::read(&args.model)
        .map_err(|e| CliError::msg(format!("cannot read `{}`: {e}", args.model.display())))?;
    let (mut loaded, warnings) = shardc::load_and_check(&args.model).map_err(CliError::new)?;
    note_external_data(&loaded.model.graph, &args.model);
    eprint!("{warnings}");
    args.model_args.freeze(&mut loaded.model.graph)?;
    let spec = args.shapes.spec(&args.model)?;
    let pipeline = autoshard::PipelineMode::parse(&args.pipeline).map_err(CliError::msg)?;
    let mut search = SearchOptions {
        time_limit: Duration::from_secs_f64(args.time_limit),
        pipeline,
        fold: args.fold,
        rewrites: !args.no_rewrites,
        memory_ladder: !args.no_memory_saving,
        ..Default::default()
    };
    if let Some(n) = args.node_limit {
        search.node_limit = n;
    }
    let (progress, bar) = super::ui::search_progress(args.time_limit);
    search.progress = progress;
    let result = Rc::new(RefCell::new(None));
    let mut pm = prepare_passes(args, spec);
    pm.add(Autoshard { cluster: cluster.clone(), devices, options: opts.clone(), search, result: result.clone() });
    let report = pm.run(&mut loaded.model);
    super::ui::finish(bar);
    let report = report.map_err(|e| pass_error(&e, &loaded.source))?;
    super::ui::pass_timings(&report);
    warn(&report.warnings, &loaded.source);
    for (pass, text) in &report.dumps {
        eprintln!("# ---- after {pass} ----");
        eprintln!("{text}");
    }
    let r = result.borrow_mut().take().expect("autoshard ran");
    // The options the plan needs, where the search changed them to make it fit.
    let opts = r.options.clone().unwrap_or(opts);
    let g = &loaded.model.graph;
    let info = model_info(args, g, &bytes);
    let plan = Plan::new(g, &cluster, devices, &opts, info, &r);
    if args.verify {
        let p = shardc::exec::program_for_plan(g, &plan).map_err(|e| CliError::msg(format!("--verify: {e}")))?;
        eprintln!("{}", proved_forward(g, &p)?);
    }
    super::ui::search_timings(&plan.timings);
    let json = serde_json::to_string_pretty(&plan).expect("plan serializes");
    if let Some(out) = &args.output {
        write_output(&json, Some(out), &args.model)?;
    }
    if let Some(svg) = &args.svg {
        write_output(&shardc::report::timeline_svg(&plan), Some(svg), &args.model)?;
    }
    let text = summary(args, &cluster.describe(), devices, &plan, &r);
    let cm = passes::cost::CostModel::new(g, &cluster, r.mesh.clone(), opts.clone());
    let order = cm.order();
    let explained = r.data_parallel.as_ref().map(|dp| autoshard::explain::explain(g, order, &r.breakdown, dp));
    if let Some(html) = &args.html {
        let page = shardc::report::plan_html(&shardc::report::PlanPage {
            graph: g,
            order,
            plan: &plan,
            breakdown: &r.breakdown,
            data_parallel: r.data_parallel.as_ref(),
            summary: &text,
            explanation: explained.as_ref().and_then(|e| e.as_ref().ok()),
            kinds: r.pipeline.is_none().then(|| autoshard::plan::op_kinds(&cm, &r.assignment, &plan.summary.axes)),
        });
        write_output(&page, Some(html), &args.model)?;
    }
    if args.json {
        return write_output(&json, None, &args.model);
    }
    if let Some(kind) = args.export {
        let text = export(args, kind, g, &cluster, devices, &opts, &plan, &r)?;
        return write_output(&text, None, &args.model);
    }
    if args.emit == Some(PlanEmit::Text) {
        return write_output(&ir::print::model_to_string(&loaded.model), None, &args.model);
    }
    let mut t = text;
    if args.explain {
        t.push('\n');
        t.push_str(&explanation(&plan, &r, explained.as_ref()));
    }
    if args.report {
        t.push('\n');
        if plan.stages.len() > 1 {
            t.push_str(&autoshard::plan::stage_report(&plan));
            t.push('\n');
        }
        t.push_str(&autoshard::plan::report(g, order, &r.breakdown, r.data_parallel.as_ref()));
    }
    write_output(&t, None, &args.model)
}

fn summary(args: &PlanArgs, cluster: &str, devices: usize, plan: &Plan, r: &autoshard::SearchResult) -> String {
    let mut t = String::new();
    let b = &r.breakdown;
    t.push_str(&format!(
        "model        {} (batch {})\n",
        args.model.display(),
        plan.model.batch.map_or("?".into(), |b| b.to_string())
    ));
    t.push_str(&format!("cluster      {cluster}\n"));
    t.push_str(&format!("devices      {devices}, mesh {}\n", autoshard::mesh_string(&r.mesh)));
    t.push_str(&format!(
        "plan         {}\n",
        match (&r.pipeline, &r.same_as) {
            (Some(p), None) => format!(
                "{} pipeline stages × {} micro-batches ({}), each stage sharded (see --report)",
                p.stages.len(),
                p.micro_batches,
                p.schedule.name()
            ),
            (Some(p), Some(n)) => format!(
                "{} pipeline stages × {} micro-batches ({}): the configuration `{n}`",
                p.stages.len(),
                p.micro_batches,
                p.schedule.name()
            ),
            (None, Some(n)) => format!("the `{n}` plan"),
            (None, None) => "per-layer strategies (see --report)".into(),
        }
    ));
    t.push_str(&plan.summary.lines());
    if let Some(p) = &plan.pipeline {
        t.push_str(&format!("why          {}\n", p.reason));
        t.push_str(&format!("balance      slowest / fastest stage {:.3}\n", p.imbalance));
        if let Some(b) = &p.blocker {
            t.push_str(&format!("             {b}\n"));
        }
    } else if let Some(pc) = &r.pipeline_considered {
        t.push_str(&format!(
            "pipelining   best pipeline {} (not faster; {} configurations priced)\n",
            secs(pc.best_step_time_s),
            pc.tried.len()
        ));
    }
    for (i, rung) in r.ladder.iter().enumerate() {
        t.push_str(&format!(
            "{}{:<28} {} needs {}{}\n",
            if i == 0 { "memory ladder " } else { "              " },
            rung.options,
            secs(rung.step_time_s),
            shardc::report::bytes(rung.memory_per_device_bytes as f64),
            if rung.feasible { "" } else { " (no fit)" }
        ));
    }
    t.push_str(&format!(
        "step time    {}{}\n",
        secs(b.step_time_s),
        if b.feasible { String::new() } else { "  (does not fit)".into() }
    ));
    match (&r.data_parallel, plan.speedup_over_data_parallel) {
        (Some(d), Some(s)) => {
            t.push_str(&format!(
                "data parallel {}, {} per device  → speedup {s:.2}×, memory ÷{:.2}\n",
                secs(d.step_time_s),
                bytes(d.memory.total()),
                d.memory.total() / b.memory.total().max(1.0)
            ));
        }
        (Some(d), None) => t.push_str(&format!(
            "data parallel {}, {} per device{}\n",
            secs(d.step_time_s),
            bytes(d.memory.total()),
            if d.feasible { "" } else { "  (does not fit)" }
        )),
        (None, _) => t.push_str(&format!(
            "data parallel: n/a ({})\n",
            r.data_parallel_unavailable.as_deref().unwrap_or("it does not apply to this model")
        )),
    }
    if r.single_device_memory_bytes > b.memory_capacity_bytes as f64 {
        t.push_str(&format!(
            "constraint   memory: one device would need {} ({} usable){}\n",
            bytes(r.single_device_memory_bytes),
            bytes(b.memory_capacity_bytes as f64),
            if b.feasible { "; the plan spreads it to fit" } else { "" }
        ));
    }
    t.push_str(&format!(
        "memory       {} per device of {} usable\n",
        bytes(b.memory.total()),
        bytes(b.memory_capacity_bytes as f64)
    ));
    if let Some(reason) = &b.infeasible_reason {
        t.push_str(&format!("             no plan fits; the smallest found {reason}\n"));
    }
    t.push_str(&format!(
        "compute      {}   communication {}   exposed grad sync {}\n",
        secs(b.compute_s),
        secs(b.communication_s),
        secs(b.exposed_gradient_sync_s)
    ));
    t.push_str(&search_lines(r));
    t.push_str(&strategy_histogram(plan));
    t.push_str(NOTATION);
    t
}

/// The plan as a framework's launch settings (`--export`).
#[allow(clippy::too_many_arguments)]
fn export(
    args: &PlanArgs,
    kind: ExportKind,
    g: &ir::Graph,
    cluster: &passes::cost::Cluster,
    devices: usize,
    opts: &passes::cost::Options,
    plan: &Plan,
    r: &autoshard::SearchResult,
) -> CliResult<String> {
    let degrees = || autoshard::export::degrees(g, cluster, opts, plan).map_err(CliError::msg);
    Ok(match kind {
        ExportKind::Megatron => autoshard::export::megatron_args(&degrees()?, devices),
        ExportKind::Deepspeed => autoshard::export::deepspeed_config(&degrees()?, devices),
        ExportKind::TorchTp => {
            // The model as written, for torch's fallback layout (no rewrites applied).
            let mut plain = load_canonical(&args.model, &args.shapes)?;
            args.model_args.freeze(&mut plain.model.graph)?;
            shardc::launch::torch_tp(g, &plain.model.graph, cluster, devices, opts, plan, r).map_err(CliError::msg)?
        }
    })
}

/// How the search went: its time (and what the safety net cut), each rewrite it priced, and
/// each mesh it searched.
fn search_lines(r: &autoshard::SearchResult) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "search       {:.2} s{}{}\n",
        r.search_time_s,
        r.folded.as_ref().map_or(String::new(), |f| format!(" ({f}; --fold never searches every block)")),
        if r.time_limit_hit {
            format!(" (the --time-limit safety net fired and cut: {}; best plan so far)", r.budget_cut.join(", "))
        } else {
            String::new()
        }
    ));
    for c in &r.rewrites {
        let with = c.with_step_time_s.map_or("not searched (no time left)".to_string(), secs);
        let partial = match (&c.cheaper_at, c.cheaper_at_step_time_s) {
            (Some(at), Some(s)) => format!("; at the {} priced cheaper there, {}", places(at.len() as u64), secs(s)),
            _ => String::new(),
        };
        t.push_str(&format!(
            "rewrite      {} at {}: {} with, {} without{partial}: {}\n",
            c.rule,
            places(c.sites),
            with,
            secs(c.without_step_time_s),
            match (c.applied, c.applied_at_cheaper) {
                (true, true) => "applied there (the plan's ops are that graph's)",
                (true, false) => "applied (the plan's ops are the rewritten graph's)",
                _ => "not applied",
            }
        ));
    }
    for m in &r.meshes {
        t.push_str(&format!(
            "  mesh {:<34} {:>12}{}  e-graph {} classes / {} nodes ({}), {} of {} strategies, {}{}\n",
            m.mesh,
            secs(m.step_time_s),
            if m.feasible { "" } else { " (no fit)" },
            m.egraph.classes,
            m.egraph.nodes,
            m.egraph.stop_reason,
            m.egraph.strategies,
            m.egraph.admissible_strategies,
            m.extraction.method,
            match (m.extraction.exact, m.extraction.proxy_gap) {
                (true, _) => ", exact".to_string(),
                (false, Some(g)) => format!(" (its objective within {:.1}% of a lower bound)", g * 100.0),
                _ => String::new(),
            }
        ));
    }
    t
}

/// How many ops of each type took each strategy (ops that compute).
fn strategy_histogram(plan: &Plan) -> String {
    let mut t = String::new();
    // Strategy histogram per op type.
    let mut hist: std::collections::BTreeMap<(String, String), usize> = Default::default();
    for o in &plan.ops {
        if o.compute_s > 0.0 {
            *hist.entry((o.op.clone(), o.strategy.clone())).or_insert(0) += 1;
        }
    }
    t.push_str("strategies\n");
    for ((op, s), n) in hist {
        t.push_str(&format!("  {op:<22} {n:>5} × {s}\n"));
    }
    t
}

/// `--explain`: the layers where the plan differs from data parallelism (the top 15), and for
/// a pipeline why it pipelines.
fn explanation(
    plan: &Plan,
    r: &autoshard::SearchResult,
    explained: Option<&Result<autoshard::explain::Explanation, String>>,
) -> String {
    let mut t = String::from("why this plan\n");
    if let Some(p) = &plan.pipeline {
        t.push_str(&format!("  pipeline: {}\n", p.reason));
        if let Some(pc) = &r.pipeline_considered {
            t.push_str(&format!("  {} pipeline configurations priced\n", pc.tried.len()));
        }
    }
    if let Some(c) = &r.context_reason {
        t.push_str(&format!("  context parallelism: {c}\n"));
    }
    match explained {
        None => t.push_str(&format!(
            "  no data-parallel plan to compare with: {}\n",
            r.data_parallel_unavailable.as_deref().unwrap_or("it does not apply")
        )),
        Some(e) => match e {
            Ok(e) => t.push_str(&e.text(Some(15), &secs, &bytes)),
            Err(e) if plan.pipeline.is_some() => t.push_str(&format!("  per stage: see --report ({e})\n")),
            Err(e) => t.push_str(&format!("  {e}\n")),
        },
    }
    t
}

/// `1 place`, `12 places`.
pub fn places(n: u64) -> String {
    if n == 1 { "1 place".into() } else { format!("{n} places") }
}

/// The note `run` and `train` give for a rewrite their search made.
pub fn rewrite_note(c: &passes::autoshard::RewriteChoice) -> String {
    match (&c.cheaper_at, c.cheaper_at_step_time_s) {
        (Some(at), Some(s)) if c.applied_at_cheaper => format!(
            "rewrite {} at {} of its {}: the search priced its plan faster ({} there, {} everywhere, {} without)",
            c.rule,
            places(at.len() as u64),
            places(c.sites),
            secs(s),
            c.with_step_time_s.map_or("?".into(), secs),
            secs(c.without_step_time_s)
        ),
        _ => format!(
            "rewrite {} at {}: the search priced its plan faster ({} with, {} without)",
            c.rule,
            places(c.sites),
            c.with_step_time_s.map_or("?".into(), secs),
            secs(c.without_step_time_s)
        ),
    }
}
