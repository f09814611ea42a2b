//! `shardc cost`: price a named strategy on a cluster, with its breakdown.

use std::path::PathBuf;

use clap::Args;
use passes::autoshard::{self, Named};
use passes::cost::{self, Cluster, InputPath, Optimizer, Options, Precision};
use serde_json::json;

use super::common::*;

/// Options of the cost model, shared by `cost`, `sweep` and `plan`.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Arithmetic precision: fp32, tf32, or fp16/bf16 (mixed precision).
    #[arg(long, default_value = "fp32")]
    pub precision: String,
    /// Optimizer: sgd (momentum) or adam.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Activation recomputation: none, selective (the attention core), op (torchtitan's
    /// op-level policy: each block keeps its input and every other linear layer's output) or
    /// full (each repeated block keeps only its input).
    #[arg(long, default_value = "none")]
    pub recompute: String,
    /// Megatron's sequence parallelism in the tensor-parallel strategies (`megatron`,
    /// `hybrid`): normalizations and residual adds split along the sequence.
    #[arg(long = "sequence-parallel")]
    pub sequence_parallel: bool,
    /// In mixed precision, an fp32 copy of each gradient beside the optimizer state, sharded
    /// with it under ZeRO, as DeepSpeed's mixed-precision optimizers keep (configuration field
    /// `fp32_grads`).
    #[arg(long = "fp32-grads")]
    pub fp32_grads: bool,
    /// Do not overlap gradient synchronisation with the backward pass.
    #[arg(long = "no-overlap")]
    pub no_overlap: bool,
    /// How input batches reach the devices: scatter (from host memory to each device) or
    /// staged (through device 0).
    #[arg(long = "input-path", default_value = "scatter")]
    pub input_path: String,
    /// Do not preload the next batch while this one computes.
    #[arg(long = "no-preload")]
    pub no_preload: bool,
    /// Factor on gradient bytes communicated (0.5 for fp16 compression).
    #[arg(long = "grad-compression", default_value_t = 1.0, value_parser = parse_factor, allow_negative_numbers = true)]
    pub grad_compression: f64,
    /// Price these float initializers as constants (no gradient, no update), as `train
    /// --freeze` trains them: a name, or a prefix ending in `*`; repeatable.
    #[arg(long, value_name = "NAME")]
    pub freeze: Vec<String>,
}

impl ModelArgs {
    /// Makes constant what `--freeze` names ([`shardc::train::freeze`]).
    pub fn freeze(&self, g: &mut ir::Graph) -> CliResult<()> {
        shardc::train::freeze(g, &self.freeze, None).map(|_| ()).map_err(CliError::msg)
    }

    pub fn options(&self) -> CliResult<Options> {
        let precision = Precision::parse(&self.precision).ok_or_else(|| {
            CliError::msg(format!("--precision: `{}` is not fp32, tf32, fp16 or bf16", self.precision))
        })?;
        let optimizer = match self.optimizer.as_str() {
            "sgd" => Optimizer::Sgd,
            "adam" => Optimizer::Adam,
            o => return Err(CliError::msg(format!("--optimizer: `{o}` is not sgd or adam"))),
        };
        let input_path = match self.input_path.as_str() {
            "scatter" => InputPath::Scatter,
            "staged" => InputPath::Staged,
            o => return Err(CliError::msg(format!("--input-path: `{o}` is not scatter or staged"))),
        };
        let recompute =
            cost::Recompute::parse(&self.recompute).map_err(|e| CliError::msg(format!("--recompute: {e}")))?;
        if !(self.grad_compression > 0.0 && self.grad_compression <= 1.0) {
            return Err(CliError::msg("--grad-compression must be in (0, 1]"));
        }
        Ok(Options {
            precision,
            optimizer,
            overlap_grad_sync: !self.no_overlap,
            input_path,
            preload: !self.no_preload,
            grad_compression: self.grad_compression,
            recompute,
            sequence_parallel: self.sequence_parallel,
            fp32_grads: self.fp32_grads,
            ..Options::default()
        })
    }
}

#[derive(Args, Debug)]
pub struct CostArgs {
    /// The model (ONNX textual syntax).
    pub model: PathBuf,
    /// A preset (dgx-a100, dgx-h100, dgx1-v100, pcie-v100x8, a100-cluster-N, h100-cluster-N, local-wgpu) or a TOML file.
    #[arg(long)]
    pub cluster: String,
    /// data, model, megatron (tensor), spatial, hybrid:dp:D,tp:T, spatial-hybrid:DxS, owt, context (ulysses), context:dp:D,tp:T, context:ring[:dp:D,tp:T] (ring), expert (ep), expert:ep:E, pipeline:S:M[:gpipe|:1f1b]; or a
    /// configuration of key=value fields: dp, tp, pp, vp, cp, cp_comm=a2a|p2p (Ulysses or ring attention), ep, ep_comm=allgather|a2a (tokens all-gathered or dispatched by all-to-all), capacity=F (the all-to-all buffers; 0: dropless), mbs, sp, recompute=none|selective|op|full,
    /// zero=0|1|2|3, schedule=gpipe|1f1b|interleaved, flash (attention fused before pricing),
    /// tp_overlap (tensor-parallel collectives overlapped with their GEMMs, Megatron-LM's
    /// --tp-comm-overlap), fp32_grads (an fp32 copy of each gradient, as DeepSpeed keeps) (e.g.
    /// tp=8,dp=8,zero=3,recompute=full,sp).
    #[arg(long)]
    pub strategy: String,
    /// Devices to use (default: all of the cluster).
    #[arg(long, value_parser = parse_devices, allow_negative_numbers = true)]
    pub devices: Option<usize>,
    /// Print one JSON document.
    #[arg(long)]
    pub json: bool,
    /// Print the strategy (or configuration) as a framework's launch settings instead of the
    /// breakdown: Megatron-LM arguments, a DeepSpeed configuration, a torch tensor-parallel plan.
    #[arg(long, value_enum, conflicts_with = "json")]
    pub export: Option<super::plan::ExportKind>,
    #[command(flatten)]
    pub shapes: ShapeArgs,
    #[command(flatten)]
    pub model_args: ModelArgs,
}

pub fn load_cluster(spec: &str) -> CliResult<Cluster> {
    if std::path::Path::new(spec).is_file() {
        note_input(std::path::Path::new(spec));
    }
    Cluster::load(spec).map_err(CliError::msg)
}

/// A strategy name, or a configuration (`tp=8,dp=8,zero=3,recompute=full`) resolved to the
/// named strategy it is and the options it sets over `opts`, `g` rewritten as it asks
/// (`flash`).
pub fn strategy_and_options(s: &str, devices: usize, g: &mut ir::Graph, opts: Options) -> CliResult<(Named, Options)> {
    if !autoshard::config::is_config(s) {
        return Ok((Named::parse(s).map_err(CliError::msg)?, opts));
    }
    configuration(s, devices, g, opts).map_err(|e| CliError::msg(format!("--strategy `{s}`: {e}")))
}

/// Configuration `s` resolved on `devices` ([`strategy_and_options`] without the flag's name).
pub fn configuration(s: &str, devices: usize, g: &mut ir::Graph, opts: Options) -> Result<(Named, Options), String> {
    let c = autoshard::config::Config::parse(s)?;
    c.rewrite(g)?;
    c.resolve(devices, cost::pipeline::graph_batch(g), &opts)
}

/// The launch settings of `named` (with `opts`' recomputation, sequence parallelism and ZeRO)
/// for the framework `kind`, from the plan document of that strategy.
fn export(
    g: &ir::Graph,
    cluster: &Cluster,
    devices: usize,
    named: &Named,
    opts: &Options,
    kind: super::plan::ExportKind,
) -> CliResult<String> {
    use passes::autoshard::{Plan, export};
    let r = match named {
        Named::Pipeline { .. } => shardc::exec::pipeline_result(g, cluster, devices, named, opts),
        _ => shardc::exec::named_result(g, cluster, devices, &named.name(), opts),
    }
    .map_err(CliError::msg)?;
    let plan = Plan::new(g, cluster, devices, opts, Default::default(), &r);
    let mut d = export::degrees(g, cluster, opts, &plan).map_err(CliError::msg)?;
    // Gradient accumulation (a configuration's `mbs` without a pipeline).
    if opts.accumulation > 1 {
        d.micro_batches = opts.accumulation;
        d.micro_batch_size = d.global_batch.map(|b| b / (d.data * opts.accumulation) as i64);
    }
    Ok(match kind {
        super::plan::ExportKind::Megatron => export::megatron_args(&d, devices),
        super::plan::ExportKind::Deepspeed => export::deepspeed_config(&d, devices),
        super::plan::ExportKind::TorchTp => export::torch_tp_plan(&d).map_err(CliError::msg)?,
    })
}

pub fn run(args: &CostArgs) -> CliResult {
    let mut loaded = load_canonical(&args.model, &args.shapes)?;
    args.model_args.freeze(&mut loaded.model.graph)?;
    let cluster = load_cluster(&args.cluster)?;
    let devices = args.devices.unwrap_or(cluster.devices());
    let (named, opts) =
        strategy_and_options(&args.strategy, devices, &mut loaded.model.graph, args.model_args.options()?)?;
    let g = &loaded.model.graph;
    let priced = autoshard::named::price(g, &cluster, devices, &named, &opts).map_err(|e| {
        CliError::msg(format!("strategy `{}` does not apply to `{}`: {e}", args.strategy, args.model.display()))
    })?;
    if let Some(kind) = args.export {
        return write_output(&export(g, &cluster, devices, &named, &opts, kind)?, None, &args.model);
    }
    let b = &priced.breakdown;
    let batch = cost::pipeline::graph_batch(g);
    let summary = {
        let cm = cost::CostModel::new(g, &cluster, priced.mesh.clone(), opts.clone());
        let pipe = priced.pipeline.as_ref().map(|p| (p.stages.len(), p.micro_batches, p.schedule.name()));
        passes::autoshard::plan::PlanSummary::new(
            &cm,
            &priced.assignment,
            &cluster,
            &opts,
            devices,
            b.step_time_s,
            pipe,
        )
    };
    if args.json {
        let mut doc = serde_json::to_value(b).expect("breakdown serializes");
        let obj = doc.as_object_mut().expect("object");
        obj.insert("model".into(), json!(args.model.display().to_string()));
        obj.insert("cluster".into(), json!(cluster.name));
        obj.insert("strategy".into(), json!(args.strategy));
        obj.insert("devices".into(), json!(devices));
        obj.insert("batch".into(), json!(batch));
        obj.insert("mesh".into(), serde_json::to_value(&priced.mesh).expect("mesh"));
        obj.insert("options".into(), serde_json::to_value(&opts).expect("options"));
        obj.insert("memory_breakdown".into(), serde_json::to_value(b.memory.breakdown()).expect("memory"));
        obj.insert("summary".into(), serde_json::to_value(&summary).expect("summary"));
        if let Some(p) = &priced.pipeline {
            obj.insert("stages".into(), serde_json::to_value(&p.stages).expect("stages"));
            obj.insert("micro_batches".into(), json!(p.micro_batches));
            obj.insert("schedule".into(), json!(p.schedule.name()));
            obj.insert("imbalance".into(), json!(p.imbalance));
        }
        return write_output(&serde_json::to_string_pretty(&doc).expect("JSON"), None, &args.model);
    }
    let mut t = String::new();
    t.push_str(&format!(
        "model        {} (batch {})\n",
        args.model.display(),
        batch.map_or("?".into(), |b| b.to_string())
    ));
    t.push_str(&format!("cluster      {}\n", cluster.describe()));
    t.push_str(&format!("strategy     {} on {devices} devices, mesh {}\n", args.strategy, mesh_string(&priced.mesh)));
    t.push_str(&summary.lines());
    t.push_str(&report_text(b));
    if let Some(p) = &priced.pipeline {
        t.push_str(&format!(
            "\npipeline     {} stages, {} micro-batches, {} schedule, imbalance {:.3}\n",
            p.stages.len(),
            p.micro_batches,
            p.schedule.name(),
            p.imbalance
        ));
        t.push_str("  stage  devices      ops   time/µb     memory     first .. last\n");
        for (i, s) in p.stages.iter().enumerate() {
            t.push_str(&format!(
                "  {i:>5}  {:<10} {:>5}  {:>8}  {:>10}     {} .. {}\n",
                format!("{}-{}", s.devices[0], s.devices[s.devices.len() - 1]),
                s.op_count,
                secs(s.time_s),
                bytes(s.memory_bytes as f64),
                s.first_op,
                s.last_op
            ));
        }
    } else {
        let mut ops: Vec<_> = b.ops.iter().collect();
        ops.sort_by(|a, b| (b.compute_s + b.communication_s).total_cmp(&(a.compute_s + a.communication_s)));
        t.push_str("\nslowest ops      compute     comm   strategy\n");
        for r in ops.iter().take(8) {
            t.push_str(&format!(
                "  {:<28} {:>8} {:>8}   {}\n",
                truncate(&r.name, 28),
                secs(r.compute_s),
                secs(r.communication_s),
                r.strategy
            ));
        }
    }
    write_output(&t, None, &args.model)
}

pub fn mesh_string(m: &ir::shard::Mesh) -> String {
    let parts: Vec<String> = m
        .axes
        .iter()
        .map(|a| {
            format!(
                "{}={} ({})",
                a.name,
                a.size,
                if a.level == ir::shard::LinkLevel::Intra { "intra" } else { "inter" }
            )
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

pub fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("…{}", s.chars().rev().take(n - 1).collect::<Vec<_>>().into_iter().rev().collect::<String>())
    }
}

pub use shardc::report::secs;

/// The breakdown as text.
pub fn report_text(b: &cost::Breakdown) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "step time    {}{}\n",
        secs(b.step_time_s),
        if b.feasible { "" } else { "  (does not fit in memory)" }
    ));
    t.push_str(&format!(
        "  forward    {}\n  backward   {}\n  update     {}\n",
        secs(b.forward_s),
        secs(b.backward_s),
        secs(b.update_s)
    ));
    t.push_str(&format!(
        "  gradient sync {} exposed of {}\n",
        secs(b.exposed_gradient_sync_s),
        secs(b.gradient_sync_s)
    ));
    if b.bubble_s > 0.0 {
        t.push_str(&format!("  bubble     {}\n", secs(b.bubble_s)));
    }
    t.push_str(&format!(
        "  input      {} exposed of {} ({} per step)\n",
        secs(b.input_s),
        secs(b.input_transfer_s),
        bytes(b.input_bytes)
    ));
    t.push_str(&format!(
        "compute      {}\ncommunication {} (before overlap)\n",
        secs(b.compute_s),
        secs(b.communication_s)
    ));
    for (k, v) in &b.communication_by_kind {
        t.push_str(&format!("  {k:<14} {}\n", secs(*v)));
    }
    let m = &b.memory;
    t.push_str(&format!(
        "memory/device {} of {} usable: weights {}, gradients {}, optimizer {}, activations {}, workspace {}\n",
        bytes(m.total()),
        bytes(b.memory_capacity_bytes as f64),
        bytes(m.weights),
        bytes(m.gradients),
        bytes(m.optimizer),
        bytes(m.activations),
        bytes(m.workspace)
    ));
    if let Some(r) = &b.infeasible_reason {
        t.push_str(&format!("infeasible   {r}\n"));
    }
    t
}
