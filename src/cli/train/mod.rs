//! `shardc train`: build the training graph (forward, loss, backward, optimizer update),
//! lower it and run training steps with the weights and optimizer state resident on the
//! devices; check against a golden training case (`--data`) or the reference trainer.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use clap::Args;
use codegen::Backend;
use ir::eval::Array;
use passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::exec;
use shardc::footprint::Reference;
use shardc::session::train::{self as driver, Lowering, TrainChoice, TrainPlan as Chosen};
use shardc::train::{TrainCase, close, training_model, within};

use super::common::*;
use super::cost::{load_cluster, secs};

mod checks;
mod show;
mod truth;
use checks::*;
use show::*;
use truth::*;

/// `shardc verify`: `train`'s options, and optionally the programs as written.
#[derive(Args, Clone, Debug)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Prove the device programs in this directory (`deviceK.onnxtxt`, as `train
    /// --emit-program` writes them) instead of the ones the lowering makes now.
    #[arg(long, value_name = "DIR")]
    pub program: Option<PathBuf>,
}

#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// The model (ONNX textual or binary).
    pub model: PathBuf,
    /// Executor: wgpu (default; cpu with a warning when no adapter opens) or cpu.
    #[arg(long)]
    pub backend: Option<String>,
    /// A golden training case (`*.train.json`): inputs, and the expected loss, gradients,
    /// parameters and loss trajectory to check against.
    #[arg(long, value_name = "CASE.train.json")]
    pub data: Option<PathBuf>,
    /// Seed for weights whose external data is absent, and for inputs and labels.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Refuse to run when a weight's external data file is absent (by default its values are
    /// drawn from --seed, with a warning).
    #[arg(long = "require-weights")]
    pub require_weights: bool,
    /// Append a loss: softmax-cross-entropy[:OUTPUT] | mse[:OUTPUT] | mean[:OUTPUT].
    #[arg(long)]
    pub loss: Option<String>,
    /// Train this output (a rank-0 float) as the loss.
    #[arg(long = "loss-output", conflicts_with = "loss")]
    pub loss_output: Option<String>,
    /// sgd, adam or adamw (with --data and no hyper-parameters: the case's).
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Learning rate.
    #[arg(long, value_parser = parse_positive, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// SGD momentum.
    #[arg(long, value_parser = parse_fraction, allow_negative_numbers = true)]
    pub momentum: Option<f64>,
    /// Weight decay (AdamW: decoupled).
    #[arg(long = "weight-decay", value_parser = parse_nonneg, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Keep these float initializers constant (not trained): a name, or a prefix ending in
    /// `*` (`--freeze 'rope.*'`); repeatable. Tensors holding an infinity or NaN (an additive
    /// mask) are always constant; with `--data`, so is every one the case does not list as
    /// trainable.
    #[arg(long, value_name = "NAME")]
    pub freeze: Vec<String>,
    /// Training steps.
    #[arg(long, default_value_t = 10, value_parser = parse_count, allow_negative_numbers = true)]
    pub steps: usize,
    /// Devices (one program per device; default: the plan's with --plan, else 1).
    #[arg(long, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: Option<usize>,
    /// A named strategy (data, megatron, spatial, hybrid:dp:D,tp:T, ...) instead of the
    /// searched plan (`auto`, the default on several devices); or a configuration of
    /// key=value fields (tp=2,dp=2,sp,recompute=full,zero=1; docs/memory.md).
    #[arg(long, conflicts_with = "plan")]
    pub strategy: Option<String>,
    /// Train with this plan (`shardc plan -o PLAN.json`) of the model's forward pass: its
    /// ops keep their strategies, the backward and update ops follow them.
    #[arg(long, value_name = "PLAN.json")]
    pub plan: Option<PathBuf>,
    /// Pipeline the searched plan: off (default), auto (when the search finds it faster) or
    /// a stage count; the stages train with their plan's micro-batches and schedule.
    #[arg(long, conflicts_with_all = ["plan", "strategy"], value_name = "off|auto|S", value_parser = parse_pipeline)]
    pub pipeline: Option<String>,
    /// Safety net of the plan search, seconds.
    #[arg(long = "time-limit", default_value_t = 60.0, value_parser = parse_seconds, allow_negative_numbers = true)]
    pub time_limit: f64,
    /// Micro-batches per step: each device runs forward and backward on 1/M of its batch at
    /// a time and the optimizer steps once on the mean gradient (gradient accumulation).
    #[arg(long, default_value_t = 1, value_parser = parse_count, allow_negative_numbers = true)]
    pub micro_batches: usize,
    /// Activation recomputation: none, selective (the attention cores), op (torchtitan's
    /// op-level policy: each block keeps its input and every other linear layer's output) or
    /// full (each repeated block keeps only its input); the backward pass runs those forward
    /// ops again.
    #[arg(long, default_value = "none")]
    pub recompute: String,
    /// Megatron's sequence parallelism in the tensor-parallel strategies (`megatron`,
    /// `hybrid`): norms and residual adds split along the sequence between the tensor-parallel
    /// regions.
    #[arg(long = "sequence-parallel")]
    pub sequence_parallel: bool,
    /// ZeRO stage. 1: each optimizer update runs on its shard of a parameter held whole, with
    /// that shard of the optimizer state (gradients reduce-scattered into it, the new value
    /// all-gathered). 2: also each gradient is reduce-scattered into that shard as soon as it
    /// is complete, and the whole gradient is not kept. 3: also each parameter is held as
    /// its shard, gathered before the forward pass reads it and again before the backward
    /// pass does. ZeRO runs on plans without pipelines; stages 2 and 3 also without
    /// micro-batches.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// Expert parallelism's tokens dispatched by all-to-all: each device routes its tokens'
    /// pairs into buffers of this factor times an even share per device of the expert axis
    /// (0: buffers every routing fits — dropless). A step that routes more pairs to a device
    /// than its buffer holds stops with an error; no pair is dropped. Without it, tokens are
    /// all-gathered over the expert axis.
    #[arg(long = "moe-capacity", value_name = "FACTOR")]
    pub moe_capacity: Option<f32>,
    #[command(flatten)]
    pub transport: super::transport::TransportArgs,
    /// The cluster the prediction is for.
    #[arg(long, default_value = "local-wgpu")]
    pub cluster: String,
    /// Write `{"losses", "gradients" (step 1), "parameters" (after the last step)}`.
    #[arg(long = "save-state", value_name = "OUT.json")]
    pub save_state: Option<PathBuf>,
    /// Report a diverged run (a NaN or infinite loss, gradient or parameter) and exit 0; by
    /// default divergence is an error (exit 1) after the report.
    #[arg(long = "allow-divergence")]
    pub allow_divergence: bool,
    /// Also compare every step with the reference trainer (CPU, one device).
    #[arg(long)]
    pub check: bool,
    /// Apply `--plan` even though it was made for another file (a re-export): its ops must
    /// still match the model's by name and shape.
    #[arg(long, requires = "plan")]
    pub force: bool,
    /// Relative tolerance of the checks (default: the case's, else 1e-4).
    #[arg(long, value_parser = parse_nonneg, allow_negative_numbers = true)]
    pub rtol: Option<f64>,
    /// Absolute tolerance of the checks (default: the case's, else 1e-5).
    #[arg(long, value_parser = parse_nonneg, allow_negative_numbers = true)]
    pub atol: Option<f64>,
    /// Before running, prove that the devices' programs compute the training step
    /// (`codegen::verify`); a refuted or unproved program is an error.
    #[arg(long)]
    pub verify: bool,
    /// Also write each device's lowered training program (ONNX text) into this directory.
    #[arg(long = "emit-program", value_name = "DIR")]
    pub emit_program: Option<PathBuf>,
    /// Print one JSON document.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub shapes: ShapeArgs,
}

fn backend(name: Option<&str>) -> CliResult<(Backend, Option<String>)> {
    match name {
        Some("cpu") => Ok((Backend::Cpu, None)),
        Some("wgpu") => Ok((Backend::Wgpu, None)),
        Some(other) => Err(CliError::msg(format!("--backend: `{other}` is not wgpu or cpu"))),
        None => match codegen::runtime::gpu_adapter() {
            Ok(_) => Ok((Backend::Wgpu, None)),
            Err(e) => Ok((Backend::Cpu, Some(format!("no GPU adapter ({e}); training on the CPU executor")))),
        },
    }
}

/// What `args` ask of the training plan (`plan`: the plan document `--plan` names, read).
fn choice<'a>(args: &'a TrainArgs, plan: Option<&'a passes::autoshard::Plan>) -> TrainChoice<'a> {
    TrainChoice {
        devices: args.devices,
        strategy: args.strategy.as_deref(),
        plan: args.plan.as_ref().zip(plan).map(|(p, d)| (d, p.display().to_string())),
        micro_batches: args.micro_batches,
    }
}

/// The optimizer from the flags, or from the case.
fn optimizer(args: &TrainArgs, case: Option<&TrainCase>) -> CliResult<OptimizerSpec> {
    let explicit = args.lr.is_some() || args.momentum.is_some() || args.weight_decay.is_some();
    let kind = args.optimizer.as_deref();
    if let (Some(c), false) = (case, explicit) {
        let k = kind.unwrap_or("sgd");
        if let Some(o) = c.optimizer(k) {
            return Ok(o.clone());
        }
    }
    let lr = args.lr;
    Ok(match kind.unwrap_or("sgd") {
        "sgd" => OptimizerSpec::Sgd {
            lr: lr.unwrap_or(0.01),
            momentum: args.momentum.unwrap_or(0.0),
            dampening: 0.0,
            nesterov: false,
            weight_decay: args.weight_decay.unwrap_or(0.0),
        },
        k @ ("adam" | "adamw") => {
            if args.momentum.is_some() {
                return Err(CliError::msg("--momentum is for sgd; Adam's betas are 0.9 and 0.999"));
            }
            OptimizerSpec::Adam {
                lr: lr.unwrap_or(1e-3),
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: args.weight_decay.unwrap_or(if k == "adamw" { 1e-2 } else { 0.0 }),
                decoupled: k == "adamw",
            }
        }
        other => return Err(CliError::msg(format!("--optimizer: `{other}` is not sgd, adam or adamw"))),
    })
}

/// The search `train` runs without a plan: `plan`'s, the plan trained as found (no
/// memory-saving options the lowering does not emit), with a progress bar.
/// Without `searches`, the defaults and no bar.
fn search_options(
    args: &TrainArgs,
    searches: bool,
) -> CliResult<(passes::autoshard::SearchOptions, Option<indicatif::ProgressBar>)> {
    if !searches {
        return Ok((Default::default(), None));
    }
    let pipeline = match &args.pipeline {
        Some(p) => passes::autoshard::PipelineMode::parse(p).map_err(CliError::msg)?,
        None => passes::autoshard::PipelineMode::Off,
    };
    let (progress, bar) = super::ui::search_progress(args.time_limit);
    let so = passes::autoshard::SearchOptions {
        pipeline,
        time_limit: std::time::Duration::from_secs_f64(args.time_limit),
        progress,
        memory_ladder: false,
        ..Default::default()
    };
    Ok((so, bar))
}

/// A driver error as the CLI prints it (a pass's located in the model's source).
fn driver_error(e: shardc::error::Error, source: &shardc::Source) -> CliError {
    match e {
        shardc::error::Error::Pass(p) => pass_error(&p, source),
        e => CliError::msg(e),
    }
}

/// With `-v`: compute time per op kind of the last step, measured (the mean over the devices)
/// beside the cost model's price of the same ops, largest first — where a prediction misses.
fn op_kind_table(
    b: &passes::cost::Breakdown,
    devices: &[shardc::codegen::runtime::DeviceReport],
    cluster: &str,
) -> String {
    use std::collections::BTreeMap;
    let mut kinds: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for row in &b.ops {
        kinds.entry(row.op.as_str()).or_default().1 += row.compute_s;
    }
    let n = devices.len().max(1) as f64;
    for d in devices {
        for (k, v) in &d.by_op {
            kinds.entry(k.as_str()).or_default().0 += v / n;
        }
    }
    let mut rows: Vec<(&str, f64, f64)> = kinds.into_iter().map(|(k, (m, p))| (k, m, p)).collect();
    rows.sort_by(|a, b| b.1.max(b.2).total_cmp(&a.1.max(a.2)).then(a.0.cmp(b.0)));
    let cells: Vec<Vec<String>> = rows
        .iter()
        .take(15)
        .map(|&(k, m, p)| {
            let ratio = if p > 0.0 { format!("{:.2}×", m / p) } else { "-".into() };
            vec![format!("  {k}"), secs(m), secs(p), ratio]
        })
        .collect();
    format!(
        "compute per op kind (last step, mean per device) against the cost model on {cluster}\n{}",
        passes::table::table(&["  op", "measured", "predicted", "ratio"], &cells, &[false, true, true, true])
    )
}

/// What `run` sets up before the training graph: the case, the model (the `algebra` pass run,
/// a plan's rewrites or the search's applied, weights materialized), the loss and optimizer,
/// the cluster and the cost model's options.
struct Setup {
    case: Option<TrainCase>,
    loaded: shardc::Loaded,
    plan_doc: Option<passes::autoshard::Plan>,
    loss: LossSpec,
    opt: OptimizerSpec,
    cluster: passes::cost::Cluster,
    opts: passes::cost::Options,
    /// The model as written's parameter shapes: what the results are reported in.
    written_dims: HashMap<String, Vec<usize>>,
    /// Under `--check`, the model as written when the program trains a rewritten one.
    written: Option<ir::Model>,
    searched: Option<passes::autoshard::SearchResult>,
    notes: Vec<String>,
}

/// `materialize`: external data is read (or drawn from the seed) into the model, as running
/// needs; without it, absent weights stay shapes (what proving needs).
fn prepare(args: &TrainArgs, plan_doc: Option<passes::autoshard::Plan>, materialize: bool) -> CliResult<Setup> {
    let case = match &args.data {
        Some(p) => Some(TrainCase::load(p).map_err(CliError::msg)?),
        None => None,
    };
    // Not canonicalized: folding would rename or transform parameters, and the trained
    // tensors must stay the model's own.
    let mut loaded = load_computable(&args.model, &args.shapes)?;
    let trainable = case.as_ref().map(|c| &c.trainable[..]);
    let frozen = driver::freeze(&mut loaded.model.graph, &args.freeze, trainable, plan_doc.as_ref())
        .map_err(|e| driver_error(e, &loaded.source))?;
    let loss = match (&args.loss, &args.loss_output) {
        (Some(l), _) => LossSpec::parse(l).map_err(|e| CliError::msg(format!("--loss: {e}")))?,
        (None, Some(o)) => LossSpec::Output(o.clone()),
        (None, None) => LossSpec::Model,
    };
    let opt = optimizer(args, case.as_ref())?;
    let cluster = load_cluster(&args.cluster)?;
    // The cost model prices the optimizer that runs.
    let opts = passes::cost::Options {
        optimizer: match opt {
            OptimizerSpec::Sgd { .. } => passes::cost::Optimizer::Sgd,
            OptimizerSpec::Adam { .. } => passes::cost::Optimizer::Adam,
        },
        sequence_parallel: args.sequence_parallel,
        zero: args.zero,
        recompute: passes::cost::Recompute::parse(&args.recompute)
            .map_err(|e| CliError::msg(format!("--recompute: {e}")))?,
        ..Default::default()
    };
    // The model as written: its tensors' shapes name what is trained, and `--check` runs it.
    let written_dims: HashMap<String, Vec<usize>> = loaded
        .model
        .graph
        .initializers()
        .iter()
        .filter_map(|&n| {
            let v = ir::Value::new(n, 0);
            let t = loaded.model.graph.initializer(v)?;
            Some((loaded.model.graph.value_name(v).to_string(), t.dims.iter().map(|&d| d.max(0) as usize).collect()))
        })
        .collect();
    let mut written = args.check.then(|| loaded.model.clone());
    let mut notes: Vec<String> = frozen.into_iter().collect();
    // The model as `plan` and `cost` price it, rewritten as the plan or the search chose; the
    // trained tensors are reported under the model's names.
    let c = choice(args, plan_doc.as_ref());
    let (so, bar) = search_options(args, c.plan.is_none() && driver::named_strategy(&c).is_none())?;
    let searched = driver::rewrite(&mut loaded.model, &c, args.moe_capacity, so, (&cluster, &opts));
    super::ui::finish(bar);
    let searched = searched.map_err(|e| driver_error(e, &loaded.source))?;
    if let Some(r) = &searched {
        notes.extend(r.rewrites.iter().filter(|c| c.applied).map(super::plan::rewrite_note));
    }
    if written.as_ref().is_some_and(|w| w.graph == loaded.model.graph) {
        written = None;
    }
    if materialize {
        let dir = args.model.parent().map(PathBuf::from).unwrap_or_default();
        let weights = exec::materialize(&mut loaded.model, &dir, args.seed).map_err(CliError::msg)?;
        notes.extend(seeded_weights(&weights, args.seed, args.require_weights, "")?);
    }
    Ok(Setup { case, loaded, plan_doc, loss, opt, cluster, opts, written_dims, written, searched, notes })
}

fn model_dir(args: &TrainArgs) -> PathBuf {
    args.model.parent().map(PathBuf::from).unwrap_or_default()
}

/// Inputs: the case's, or drawn from the seed (class labels within the classes).
fn training_inputs(
    case: Option<&TrainCase>,
    g: &ir::Graph,
    info: &passes::autodiff::TrainInfo,
    seed: u64,
) -> CliResult<HashMap<String, Array>> {
    let inputs: HashMap<String, Array> = match case {
        Some(c) => {
            let mut ins = c.inputs.clone();
            for v in g.input_values() {
                let n = g.value_name(v);
                if matches!(g.node(v.node).op, ir::Op::Input { default: None }) && !ins.contains_key(n) {
                    return Err(CliError::msg(format!("the case has no value for input `{n}`")));
                }
            }
            ins.retain(|k, _| g.lookup(k).is_some());
            ins
        }
        None => shardc::train::seeded_inputs(g, info, seed).map_err(CliError::msg)?,
    };
    Ok(inputs)
}

/// What the program's steps gave, under the model's names and shapes (a split weight's parts
/// joined, a joined weight split).
struct Trained {
    losses: Vec<f64>,
    gradients: BTreeMap<String, Array>,
    parameters: BTreeMap<String, Array>,
    state: BTreeMap<String, Array>,
    report: codegen::RunReport,
    /// Where the run diverged (a non-finite loss, gradient or parameter), if it did.
    diverged: Option<shardc::train::Divergence>,
}

impl Trained {
    fn of(run: shardc::train::TrainRun, s: &Setup) -> Trained {
        let rewritten = &s.loaded.model.graph;
        let gradients = passes::algebra::model_tensors(rewritten, &s.written_dims, run.gradients);
        let parameters = passes::algebra::model_tensors(rewritten, &s.written_dims, run.parameters);
        let diverged = shardc::train::divergence(&run.losses, &parameters, &gradients);
        Trained { losses: run.losses, gradients, parameters, state: run.state, report: run.report, diverged }
    }
}

/// `--save-state`: the losses, first gradients and final parameters.
fn save_state(args: &TrainArgs, out: &PathBuf, t: &Trained) -> CliResult {
    let (losses, gradients, parameters) = (&t.losses, &t.gradients, &t.parameters);
    let tensors = |m: &BTreeMap<String, Array>| -> serde_json::Map<String, serde_json::Value> {
        m.iter().map(|(k, a)| (k.clone(), exec::array_to_json(a))).collect()
    };
    let doc = serde_json::json!({
        "losses": losses,
        "gradients": tensors(gradients),
        "parameters": tensors(parameters),
    });
    write_output(&serde_json::to_string(&doc).expect("JSON"), Some(out), &args.model)?;
    Ok(())
}

/// `args` with the memory options plan document `plan` was priced with (its `options`:
/// recomputation, sequence parallelism, ZeRO stage) where the command line leaves them at
/// their defaults, so the program runs what the plan priced; and a note saying so, or saying
/// that the command line's options differ from the plan's.
fn with_plan_memory(
    mut args: TrainArgs,
    plan: Option<&passes::autoshard::Plan>,
) -> CliResult<(TrainArgs, Option<String>)> {
    let Some(o) = plan.map(|p| &p.options) else { return Ok((args, None)) };
    let planned = o.memory_fields();
    let recompute =
        passes::cost::Recompute::parse(&args.recompute).map_err(|e| CliError::msg(format!("--recompute: {e}")))?;
    let given = passes::cost::Options {
        recompute,
        sequence_parallel: args.sequence_parallel,
        zero: args.zero,
        ..Default::default()
    }
    .memory_fields();
    if planned == given {
        return Ok((args, None));
    }
    if given == "none" {
        (args.recompute, args.sequence_parallel, args.zero) =
            (o.recompute.name().to_string(), o.sequence_parallel, o.zero.min(3));
        return Ok((args, Some(format!("memory options of the plan: {planned}"))));
    }
    let note = format!("the plan was priced with the memory options {planned}; running with {given} as given");
    Ok((args, Some(note)))
}

/// `args` with a configuration `--strategy` (`tp=2,dp=2,sp,recompute=full,zero=1`) turned
/// into the named strategy it is and the options it sets; a name stays as it is.
fn configured(args: &TrainArgs) -> CliResult<TrainArgs> {
    let mut a = args.clone();
    let Some(s) = args.strategy.as_deref().filter(|s| passes::autoshard::config::is_config(s)) else { return Ok(a) };
    let err = |e: String| CliError::msg(format!("--strategy `{s}`: {e}"));
    let c = passes::autoshard::config::Config::parse(s).map_err(err)?;
    let devices = args.devices.unwrap_or(1);
    // A pipeline's micro-batches follow from the batch: `--batch`, else the model's.
    let batch = match args.shapes.batch {
        None if c.pp > 1 => {
            passes::cost::pipeline::graph_batch(&load_computable(&args.model, &args.shapes)?.model.graph)
        }
        b => b,
    };
    let r = shardc::session::configured(&c, devices, batch, &passes::cost::Options::default())
        .map_err(|e| err(e.to_string()))?;
    a.strategy = Some(r.strategy);
    a.recompute = r.options.recompute.name().to_string();
    a.sequence_parallel = r.options.sequence_parallel;
    a.zero = r.options.zero;
    if let Some(f) = r.capacity {
        a.moe_capacity = Some(f);
    }
    Ok(a)
}

/// `--emit-program`: each device's lowered training program into the directory.
fn emit_program(args: &TrainArgs, program: &codegen::Program) -> CliResult {
    let Some(dir) = &args.emit_program else { return Ok(()) };
    std::fs::create_dir_all(dir).map_err(|e| CliError::msg(format!("cannot create `{}`: {e}", dir.display())))?;
    for d in &program.devices {
        let text = ir::print::model_to_string(&d.to_model());
        write_output(&text, Some(&dir.join(format!("device{}.onnxtxt", d.device))), &args.model)?;
    }
    Ok(())
}

/// What `train` and `verify` share: the setup, the training graph, the chosen plan and the
/// program it lowers to, with the graph it was lowered from.
struct Prepared {
    s: Setup,
    tm: ir::Model,
    info: passes::autodiff::TrainInfo,
    micro_tm: Option<ir::Model>,
    chosen: Chosen,
    program: codegen::Program,
    micro: usize,
    /// The graph the program was lowered from (one micro-batch's training graph, recomputed
    /// and reordered as run): what `--verify` proves the program computes.
    lowered: ir::Graph,
    notes: Vec<String>,
}

fn prepare_program(
    args: &TrainArgs,
    plan_doc: Option<passes::autoshard::Plan>,
    planned: Option<String>,
    materialize: bool,
) -> CliResult<Prepared> {
    let mut s = prepare(args, plan_doc, materialize)?;
    let mut notes = std::mem::take(&mut s.notes);
    notes.extend(planned);
    if let (Some(path), Some(plan)) = (&args.plan, &s.plan_doc) {
        notes.extend(check_plan_model(plan, path, &args.model, args.force)?);
    }
    let c = choice(args, s.plan_doc.as_ref());
    let compiled = driver::compile(&s.loaded.model, &c, s.searched.take(), (&s.loss, &s.opt), (&s.cluster, &s.opts))
        .map_err(|e| driver_error(e, &s.loaded.source))?;
    let driver::Compiled { tm, info, micro_tm, chosen, program, micro, lowered, notes: said } = compiled;
    notes.extend(said);
    check_program(&program)?;
    emit_program(args, &program)?;
    Ok(Prepared { s, tm, info, micro_tm, chosen, program, micro, lowered, notes })
}

/// `shardc verify`: the training program `train` would run, proved (nothing runs). With
/// `program`, each device's graph is read from `DIR/deviceK.onnxtxt` (as `--emit-program`
/// writes them) instead, so a program edited by hand is proved as written.
pub fn verify(args: &TrainArgs, program_dir: Option<&std::path::Path>) -> CliResult {
    let plan_doc = args.plan.as_deref().map(read_plan).transpose()?;
    let (resolved, planned) = with_plan_memory(configured(args)?, plan_doc.as_ref())?;
    let Prepared { mut program, lowered, .. } = prepare_program(&resolved, plan_doc, planned, false)?;
    if let Some(dir) = program_dir {
        for d in &mut program.devices {
            d.graph = read_device_program(&dir.join(format!("device{}.onnxtxt", d.device)))?;
        }
    }
    let line = proved(&lowered, &program, "the training step's")?;
    write_output(&format!("{line}\n"), None, &args.model)
}

fn read_device_program(path: &std::path::Path) -> CliResult<ir::Graph> {
    let text =
        std::fs::read_to_string(path).map_err(|e| CliError::msg(format!("cannot read `{}`: {e}", path.display())))?;
    let parsed = frontend::parse(&text).map_err(|d| {
        CliError::msg(format!(
            "`{}`: {}",
            path.display(),
            shardc::Source::text(path.display().to_string(), text.clone()).render(&d)
        ))
    })?;
    let mut m = parsed.model;
    ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check)
        .map_err(|e| CliError::msg(format!("`{}`: {e:?}", path.display())))?;
    Ok(m.graph)
}

pub fn run(args: &TrainArgs) -> CliResult {
    let plan_doc = args.plan.as_deref().map(read_plan).transpose()?;
    let (resolved, planned) = with_plan_memory(configured(args)?, plan_doc.as_ref())?;
    let args = &resolved;
    // Under mpirun each process runs one device; every process plans and lowers the same
    // program (the search is deterministic; the programs are compared before running).
    let mpi = args.transport.start()?;
    guard_outputs(
        &[("--save-state", args.save_state.as_ref()), ("--emit-program", args.emit_program.as_ref())],
        &[Some(&args.model), args.data.as_deref(), args.plan.as_deref()],
    )?;
    let Prepared { mut s, tm, info, micro_tm, chosen, program, micro, lowered, mut notes } =
        prepare_program(args, plan_doc, planned, true)?;
    let g = &tm.graph;
    if args.verify {
        notes.push(proved(&lowered, &program, "the training step's")?);
    }
    let predicted = driver::price(&program, &chosen, (&s.cluster, &s.opts), &mut notes);
    let (be, warn) = backend(args.backend.as_deref())?;
    if let Some(w) = warn {
        notes.push(format!("warning: {w}"));
    }
    let written = s.written.take();
    let mut held = vec![("model", &s.loaded.model.graph), ("training graph", g)];
    held.extend(micro_tm.as_ref().map(|t| ("micro-batch training graph", &t.graph)));
    held.extend(written.as_ref().map(|w| ("model as written", &w.graph)));
    let reference = Reference { graph: g, built_anew: written.is_some() };
    let promise = preflight(&program, &held, g, args.check.then_some(reference), be)?;
    let inputs = training_inputs(s.case.as_ref(), g, &info, args.seed)?;
    let distributed = args.transport.distributed(mpi.as_ref(), chosen.devices, &program)?;
    let rank = distributed.as_ref().map_or(0, |d| d.rank);
    let bar = super::ui::step_bar(args.steps + 1, "training step");
    let run = shardc::train::run_steps_with(
        &program,
        &info,
        &inputs,
        be,
        args.steps,
        super::ui::step_hook(&bar),
        distributed.clone(),
    );
    super::ui::finish(bar);
    let run = run.map_err(CliError::msg)?;
    if rank != 0 {
        // Device 0's process checks and reports for the job.
        return Ok(());
    }
    let mut trained = Trained::of(run, &s);
    if let Some(d) = &trained.diverged {
        notes.push(format!("diverged: {d}"));
    }
    let case = s.case.as_ref();
    let tol = (
        args.rtol.or(case.map(|c| c.tolerance.0)).unwrap_or(1e-4),
        args.atol.or(case.map(|c| c.tolerance.1)).unwrap_or(1e-5),
    );
    let mut checks = torch_checks(args, s.case.as_ref(), &s.opt, &trained, tol);
    if args.check {
        checks.extend(reference_checks(args, &s, written, g, &inputs, &mut trained, tol, &mut notes)?);
    }
    if let Some(out) = &args.save_state {
        save_state(args, out, &trained)?;
    }
    let shown = Shown {
        args,
        s: &s,
        chosen: &chosen,
        info: &info,
        micro,
        be,
        t: &trained,
        predicted,
        promise: &promise,
        checks: &checks,
        notes: &notes,
    };
    let text = if args.json { serde_json::to_string_pretty(&shown.json()).expect("JSON") } else { shown.text() };
    write_output(&text, None, &args.model)?;
    if checks.iter().any(|c| !c.ok) {
        return Err(CliError::new("error: training differs from the expected values beyond the tolerance\n"));
    }
    if let Some(d) = &trained.diverged
        && !args.allow_divergence
    {
        return Err(CliError::msg(format!(
            "training diverged: {d} — lower --lr, or pass --allow-divergence to report it and exit 0"
        )));
    }
    Ok(())
}
