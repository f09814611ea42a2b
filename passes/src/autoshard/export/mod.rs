//! A plan in the launch settings of the frameworks users train with, when the plan has their
//! shape: Megatron-LM's command-line arguments, a DeepSpeed configuration, and a PyTorch
//! `torch.distributed.tensor.parallel` plan (module path → `ColwiseParallel` /
//! `RowwiseParallel` / `SequenceParallel`).
//!
//! Those frameworks know data, tensor (Megatron's column/row GEMM splits, with sequence
//! parallelism for the norms between them) and pipeline parallelism, and Megatron-LM and
//! DeepSpeed context parallelism as Ulysses runs it (`--cp-comm-type a2a`; Megatron-LM's ring
//! attention, `--cp-comm-type p2p`, for a plan whose attention splits its sequence). A plan that splits
//! spatial dims, mixes kinds on one mesh axis, or splits ops no module names, has no such
//! settings; the error says which ops keep it from the template.

mod shape;
mod torch_tp;

use std::collections::BTreeMap;

use ir::Graph;
pub use shape::{ModelShape, model_shape};
pub use torch_tp::{Entry, Placement, Style, TorchTp, torch_tp};

use super::Plan;
use super::plan::{role_kind, split_kind};
use crate::cost::{Cluster, CostModel, Options};

/// The degrees of a plan that fits the frameworks' template.
#[derive(Clone, Debug, PartialEq)]
pub struct Degrees {
    /// Data-parallel degree (per pipeline stage).
    pub data: usize,
    /// Tensor-parallel degree.
    pub tensor: usize,
    /// Context-parallel degree (the sequence split; attention by heads, or as ring attention).
    pub context: usize,
    /// Context parallelism as ring attention (some attention splits its sequence:
    /// `SplitMode::Ring`) rather than Ulysses.
    pub ring: bool,
    /// Expert-parallel degree: the mixtures' experts split over groups of this many of the
    /// data-parallel ranks (Megatron's convention: within `data`).
    pub expert: usize,
    /// The mixtures' tokens dispatched by all-to-all (`SplitMode::Dispatch`), with this
    /// capacity factor (0: dropless buffers); `None`: all-gathered.
    pub dispatch: Option<f32>,
    /// Pipeline stages.
    pub pipeline: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The pipeline schedule (`None` without a pipeline).
    pub schedule: Option<crate::cost::Schedule>,
    /// Some stage recomputes its activations in backward.
    pub recompute: bool,
    /// Recomputation outside pipeline stages (the cost model's option).
    pub granularity: crate::cost::Recompute,
    /// ZeRO stage.
    pub zero: u8,
    /// Norms split along the sequence on the tensor axes (Megatron's sequence parallelism).
    pub sequence_parallel: bool,
    /// The global batch.
    pub global_batch: Option<i64>,
    /// Per-device micro-batch size.
    pub micro_batch_size: Option<i64>,
    /// The torch tensor-parallel plan of the tensor axis, or why there is none.
    pub torch: TorchTp,
    /// The model's attention runs fused (`Attention` ops: `fuse-attention`, or the model's
    /// own): the framework's fused attention kernel.
    pub flash_attention: bool,
    /// The model's shape as Megatron-LM names it.
    pub shape: ModelShape,
    /// Half-precision training (bf16/fp16 with fp32 master weights).
    pub half: bool,
    /// In half precision, the gradients accumulated and reduced in fp32
    /// ([`crate::cost::Options::fp32_grads`]).
    pub fp32_grads: bool,
    /// Layers (attention blocks) per pipeline stage, in stage order.
    pub stage_layers: Vec<usize>,
    /// Layers a pipeline cut falls inside of (their ops on two stages).
    pub cut_layers: Vec<String>,
}

/// The plan's degrees, or why it has none: the axes whose ops split what the template cannot
/// (spatial dims, other dims, kinds mixed on one axis), each with the ops that do it.
pub fn degrees(g: &Graph, cluster: &Cluster, opts: &Options, plan: &Plan) -> Result<Degrees, String> {
    let (asg, stage_of) = plan.stage_assignment(g)?;
    let meshes = plan.stage_meshes()?;
    let mesh = meshes.first().ok_or("the plan has no mesh")?;
    let cm = CostModel::new(g, cluster, mesh.clone(), opts.clone());
    let axes = &plan.summary.axes;
    let (mut data, mut tensor, mut context, mut expert) = (1, 1, 1, 1);
    let mut blockers = Vec::new();
    let mut tensor_axes = Vec::new();
    for (a, u) in axes.iter().enumerate() {
        match u.kind.as_str() {
            "data" => data *= u.size,
            "tensor" => {
                tensor *= u.size;
                tensor_axes.push(a);
            }
            "context" => context *= u.size,
            // The mixtures split their experts over the axis, every other op its batch: an
            // expert-parallel group of data-parallel ranks.
            "expert" if u.shares.keys().all(|k| matches!(k.as_str(), "expert" | "data" | "other")) => {
                data *= u.size;
                expert *= u.size;
            }
            "unused" => {}
            kind => {
                // Which ops split what on this axis, grouped by kind.
                let mut by: BTreeMap<&str, Vec<String>> = BTreeMap::new();
                for &n in cm.order() {
                    let Some(Some(i)) = asg.strategies.get(&n).and_then(|s| s.get(a)) else { continue };
                    let Some(d) = cm.space(n).dims.get(*i) else { continue };
                    let k = if role_kind(&d.role) == "other" { split_kind(&cm, n, *i) } else { role_kind(&d.role) };
                    if kind == "mixed" || k == kind {
                        by.entry(k).or_default().push(format!("{} ({})", g.op_name(n), g.node(n).op.op_type()));
                    }
                }
                let mut parts = Vec::new();
                for (k, ops) in &by {
                    let shown: Vec<&str> = ops.iter().take(4).map(|s| s.as_str()).collect();
                    parts.push(format!(
                        "{k} for {} ops ({}{})",
                        ops.len(),
                        shown.join(", "),
                        if ops.len() > shown.len() {
                            format!(" and {} more", ops.len() - shown.len())
                        } else {
                            String::new()
                        }
                    ));
                }
                blockers.push(format!(
                    "mesh axis {} ({} devices) is used for {kind} parallelism, which has no such setting: {}",
                    u.axis,
                    u.size,
                    parts.join("; ")
                ));
            }
        }
    }
    if !blockers.is_empty() {
        return Err(format!(
            "the plan does not fit the data × tensor × pipeline template:\n  {}",
            blockers.join("\n  ")
        ));
    }
    let ring = asg.strategies.iter().any(|(&n, s)| {
        let dims = &cm.space(n).dims;
        s.iter().flatten().any(|&i| dims.get(i).is_some_and(|d| d.role == ir::shard::DimRole::Sequence))
    });
    // The all-to-all dispatcher: a mixture whose dispatch dim (tokens and experts at once)
    // some strategy splits.
    let dispatch = asg.strategies.iter().find_map(|(&n, s)| {
        let dims = &cm.space(n).dims;
        let split = s.iter().flatten().any(|&i| dims.get(i).is_some_and(|d| d.role == ir::shard::DimRole::Dispatch));
        match &g.node(n).op {
            ir::Op::MoE(m) if split => Some(m.capacity_factor.unwrap_or(0.0)),
            ir::Op::MoEGrad(m) if split => Some(m.capacity_factor.unwrap_or(0.0)),
            _ => None,
        }
    });
    let torch = torch_tp(g, &cm, &asg, &tensor_axes);
    let sequence_parallel = torch.entries.iter().any(|e| e.style == Style::Sequence);
    let pipeline = plan.stages.len().max(1);
    let micro_batches = plan.micro_batches.max(1);
    let global_batch = plan.model.batch.or_else(|| crate::cost::pipeline::graph_batch(g));
    Ok(Degrees {
        data,
        tensor,
        context,
        ring,
        expert,
        dispatch,
        pipeline,
        micro_batches,
        schedule: plan.schedule,
        recompute: plan.stages.iter().any(|s| s.recompute),
        granularity: opts.recompute,
        zero: opts.zero,
        sequence_parallel: sequence_parallel || opts.sequence_parallel,
        global_batch,
        micro_batch_size: global_batch
            .filter(|b| *b % (data * micro_batches) as i64 == 0)
            .map(|b| b / (data * micro_batches) as i64),
        torch,
        flash_attention: cm.order().iter().any(|&n| matches!(g.node(n).op, ir::Op::Attention(_))),
        shape: model_shape(g),
        half: opts.precision == crate::cost::Precision::Fp16,
        fp32_grads: opts.precision == crate::cost::Precision::Fp16 && opts.fp32_grads,
        stage_layers: stage_layers(g, cm.order(), &stage_of, pipeline),
        cut_layers: cut_layers(g, cm.order(), &stage_of),
    })
}

/// Attention blocks per stage (`stages` entries).
fn stage_layers(
    g: &Graph,
    order: &[ir::NodeId],
    stage_of: &std::collections::HashMap<ir::NodeId, usize>,
    stages: usize,
) -> Vec<usize> {
    let mut per = vec![0; stages];
    for &n in order {
        if shape::attention_layer(g, n) {
            let s = stage_of.get(&n).copied().unwrap_or(0).min(stages - 1);
            per[s] += 1;
        }
    }
    per
}

/// The repeated blocks (`model.layers.7`) whose ops lie on more than one stage.
fn cut_layers(g: &Graph, order: &[ir::NodeId], stage_of: &std::collections::HashMap<ir::NodeId, usize>) -> Vec<String> {
    let paths = ir::scope::module_paths(g, order);
    let mut stages: BTreeMap<String, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for &n in order {
        let (Some(p), Some(&s)) = (paths.get(&n), stage_of.get(&n)) else { continue };
        let b = ir::scope::block_of(p);
        if b.split('.').any(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit())) {
            stages.entry(b).or_default().insert(s);
        }
    }
    stages.into_iter().filter(|(_, s)| s.len() > 1).map(|(b, _)| b).collect()
}

/// Megatron-LM's model arguments for shape `s`, and the ones it could not read.
fn megatron_model_args(s: &ModelShape, half: bool) -> (Vec<String>, Vec<&'static str>) {
    let mut args = Vec::new();
    let mut missing = Vec::new();
    let mut num = |flag: &'static str, v: Option<String>| match v {
        Some(v) => args.push(format!("{flag} {v}")),
        None => missing.push(flag),
    };
    num("--num-layers", s.layers.map(|v| v.to_string()));
    num("--hidden-size", s.hidden.map(|v| v.to_string()));
    num("--num-attention-heads", s.heads.map(|v| v.to_string()));
    num("--ffn-hidden-size", s.ffn.map(|v| v.to_string()));
    num("--seq-length", s.seq.map(|v| v.to_string()));
    num("--max-position-embeddings", s.learned_positions.or(s.seq).map(|v| v.to_string()));
    num("--vocab-size", s.vocab.map(|v| v.to_string()));
    num("--normalization", s.norm.map(str::to_string));
    if let Some(kv) = s.kv_heads {
        args.push(format!("--group-query-attention --num-query-groups {kv}"));
    }
    if s.swiglu {
        args.push("--swiglu".into());
    }
    if s.rope {
        args.push("--position-embedding-type rope".into());
    } else if s.learned_positions.is_some() {
        args.push("--position-embedding-type learned_absolute".into());
    } else {
        args.push("--position-embedding-type none".into());
    }
    if !s.linear_bias {
        args.push("--disable-bias-linear".into());
    } else if s.qkv_bias_only {
        args.push("--disable-bias-linear --add-qkv-bias".into());
    }
    if !s.tied {
        args.push("--untie-embeddings-and-output-weights".into());
    }
    if half {
        args.push("--bf16".into());
    }
    (args, missing)
}

/// Megatron-LM's arguments for the plan (`torchrun … pretrain_gpt.py <these>`).
pub fn megatron_args(d: &Degrees, devices: usize) -> String {
    let mut context = if d.context > 1 { format!(" × context {}", d.context) } else { String::new() };
    if d.expert > 1 {
        context.push_str(&format!(" (expert {} within data)", d.expert));
    }
    let mut t = format!(
        "# shardc plan as Megatron-LM arguments: data {} × tensor {} × pipeline {}{context} = {devices} devices\n",
        d.data, d.tensor, d.pipeline
    );
    t.push_str("# launch: torchrun --nproc_per_node <devices per node> --nnodes <nodes> pretrain_gpt.py \\\n");
    let (mut args, missing) = megatron_model_args(&d.shape, d.half);
    if d.fp32_grads {
        args.push("--accumulate-allreduce-grads-in-fp32".into());
    }
    args.push(format!("--tensor-model-parallel-size {}", d.tensor));
    args.push(format!("--pipeline-model-parallel-size {}", d.pipeline));
    if d.context > 1 {
        // Ring attention: keys and values passed point to point; Ulysses: all-to-all between
        // sequence and head shards.
        let comm = if d.ring { "p2p" } else { "a2a" };
        args.push(format!("--context-parallel-size {} --cp-comm-type {comm}", d.context));
    }
    let mut notes = Vec::new();
    if let (Some(e), Some(k)) = (d.shape.experts, d.shape.top_k) {
        args.push(format!("--num-experts {e} --moe-router-topk {k} --moe-grouped-gemm"));
        if d.expert > 1 {
            // The dispatcher the plan was priced and lowered with.
            let kind = if d.dispatch.is_some() { "alltoall" } else { "allgather" };
            args.push(format!("--expert-model-parallel-size {} --moe-token-dispatcher-type {kind}", d.expert));
            if let Some(f) = d.dispatch.filter(|&f| f > 0.0) {
                // Buffers padded to the capacity, as the plan's programs hold them.
                args.push(format!("--moe-expert-capacity-factor {f} --moe-pad-expert-input-to-capacity"));
                notes.push(format!("# note: the plan's all-to-all buffers hold {f} times an even share of the routed pairs; Megatron-LM drops the pairs beyond it where shardc's run stops with an error (the model trains dropless either way while no expert overflows)"));
            }
        }
        notes.push("# note: the router's load balancing is the model's: add --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff <its coefficient> when it trains with one".into());
    }
    if let [first, middle @ .., last] = &d.stage_layers[..]
        && d.pipeline > 1
        && !(first == last && middle.iter().all(|m| m == first))
    {
        if middle.windows(2).all(|w| w[0] == w[1]) {
            args.push(format!("--decoder-first-pipeline-num-layers {first} --decoder-last-pipeline-num-layers {last}"));
        } else {
            notes.push(format!(
                "# note: the plan's stages hold {:?} layers; Megatron-LM takes an even split with an uneven first and last stage only: the launched split is not the priced one",
                d.stage_layers
            ));
        }
    }
    if !d.cut_layers.is_empty() {
        notes.push(format!(
            "# note: the plan cuts inside {} (ops of one layer on two stages); Megatron-LM cuts between layers: the launched run is not the priced one",
            d.cut_layers.join(", ")
        ));
    }
    if !missing.is_empty() {
        notes.push(format!("# note: not read from the graph, add them: {}", missing.join(", ")));
    }
    if let Some(m) = d.micro_batch_size {
        args.push(format!("--micro-batch-size {m}"));
    }
    if let Some(b) = d.global_batch {
        args.push(format!("--global-batch-size {b}"));
    }
    if d.sequence_parallel && d.tensor > 1 {
        args.push("--sequence-parallel".into());
    }
    match d.granularity {
        crate::cost::Recompute::Selective if !d.recompute => args.push("--recompute-granularity selective".into()),
        crate::cost::Recompute::None if !d.recompute => {}
        g => {
            if g == crate::cost::Recompute::Op && !d.recompute {
                notes.push("# note: the plan recomputes by torchtitan's op-level policy, which Megatron-LM has not: the layers are recomputed whole (less memory, more compute than priced)".into());
            }
            args.push("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".into());
        }
    }
    if d.flash_attention {
        args.push("--attention-backend flash".into());
    }
    if d.zero >= 1 {
        args.push("--use-distributed-optimizer".into());
    }
    if let Some(crate::cost::Schedule::Interleaved(v)) = d.schedule {
        args.push(format!("--num-virtual-stages-per-pipeline-rank {v}"));
    }
    t.push_str(&args.iter().map(|a| format!("  {a}")).collect::<Vec<_>>().join(" \\\n"));
    t.push('\n');
    for n in notes {
        t.push_str(&n);
        t.push('\n');
    }
    if d.half {
        t.push_str("# note: the plan was priced in half precision; --bf16 (or --fp16 with loss scaling)\n");
    }
    if d.schedule == Some(crate::cost::Schedule::GPipe) {
        t.push_str(
            "# note: the plan was priced with GPipe; Megatron-LM runs 1F1B (at most the same bubble, less memory)\n",
        );
    }
    if d.micro_batch_size.is_none() {
        t.push_str(
            "# note: the global batch does not divide into data × micro-batches; set --micro-batch-size yourself\n",
        );
    }
    if d.zero >= 2 {
        t.push_str(&format!(
            "# note: the plan shards gradients{} over the data-parallel devices (ZeRO-{}); Megatron-LM's distributed optimizer shards the optimizer state (and reduce-scatters gradients) only: use the DeepSpeed export or FSDP for the rest\n",
            if d.zero >= 3 { " and parameters" } else { "" },
            d.zero
        ));
    }
    t
}

/// A DeepSpeed configuration for the plan (JSON), with the parallel degrees it needs from
/// the launcher beside it under `shardc`.
pub fn deepspeed_config(d: &Degrees, devices: usize) -> String {
    let mut cfg = serde_json::json!({
        "train_micro_batch_size_per_gpu": d.micro_batch_size,
        "gradient_accumulation_steps": d.micro_batches,
        "zero_optimization": { "stage": d.zero },
        "shardc": {
            "devices": devices,
            "data_parallel_size": d.data,
            "tensor_parallel_size": d.tensor,
            "pipeline_parallel_size": d.pipeline,
            "sequence_parallel_size": d.context,
            "expert_parallel_size": d.expert,
            "notes": [
                zero_note(d.zero),
                "the tensor-parallel degree is tensor_parallel.autotp_size (DeepSpeed's automatic tensor parallelism, deepspeed.tp_model_init)",
                "pipeline stages: deepspeed.pipe.PipelineModule(num_stages = pipeline_parallel_size)"
            ]
        }
    });
    if let Some(b) = d.global_batch {
        cfg["train_batch_size"] = serde_json::json!(b);
    }
    if d.tensor > 1 {
        cfg["tensor_parallel"] = serde_json::json!({ "autotp_size": d.tensor });
    }
    if d.half {
        cfg["bf16"] = serde_json::json!({ "enabled": true });
    }
    if d.fp32_grads {
        cfg["data_types"] = serde_json::json!({ "grad_accum_dtype": "fp32" });
    }
    if matches!(d.schedule, Some(crate::cost::Schedule::Interleaved(_))) {
        cfg["shardc"]["notes"].as_array_mut().expect("notes").push(serde_json::json!(
            "the plan was priced with the interleaved 1F1B schedule; DeepSpeed's pipeline engine runs 1F1B (a larger bubble)"
        ));
    }
    if d.context > 1 {
        cfg["shardc"]["notes"].as_array_mut().expect("notes").push(serde_json::json!(
            "context parallelism is DeepSpeed-Ulysses: wrap each attention in deepspeed.sequence.layer.DistributedAttention over sequence-parallel groups of sequence_parallel_size ranks (Megatron-DeepSpeed: --ds-sequence-parallel-size); the data-parallel groups are the rest"
        ));
        if d.ring {
            cfg["shardc"]["notes"].as_array_mut().expect("notes").push(serde_json::json!(
                "the plan was priced with ring attention (keys and values passed point to point); DeepSpeed's sequence parallelism runs Ulysses' all-to-alls instead (another price: the Megatron-LM export runs ring attention, --cp-comm-type p2p)"
            ));
        }
    }
    if d.expert > 1 {
        cfg["shardc"]["notes"].as_array_mut().expect("notes").push(serde_json::json!(format!(
            "expert parallelism: each mixture of experts as deepspeed.moe.layer.MoE(num_experts = {}, ep_size = expert_parallel_size, k = {}{}), its expert-parallel groups carved from the data-parallel ranks",
            d.shape.experts.unwrap_or(0),
            d.shape.top_k.unwrap_or(0),
            match d.dispatch {
                // DeepSpeed's MoE dispatches by all-to-all; its capacity drops overflowing tokens.
                Some(f) if f > 0.0 => format!(", capacity_factor = {f}, drop_tokens = True: the plan's all-to-all buffers; shardc's run stops where DeepSpeed drops"),
                _ => ", drop_tokens = False: dropless, as the plan".to_string(),
            }
        )));
    }
    if d.recompute || d.granularity != crate::cost::Recompute::None {
        cfg["activation_checkpointing"] =
            serde_json::json!({ "partition_activations": false, "contiguous_memory_optimization": false });
    }
    serde_json::to_string_pretty(&cfg).expect("JSON") + "\n"
}

fn zero_note(stage: u8) -> &'static str {
    match stage {
        0 => "ZeRO stage 0: the plan keeps a full copy of each data-parallel replica's optimizer state",
        1 => "ZeRO stage 1: the optimizer state is sharded over the data-parallel devices",
        2 => "ZeRO stage 2: the optimizer state and gradients are sharded over the data-parallel devices",
        _ => "ZeRO stage 3: parameters, gradients and optimizer state are sharded over the data-parallel devices",
    }
}

/// A PyTorch tensor-parallel plan (`parallelize_module(model, tp_mesh, plan)`) with the
/// layouts at each module's boundary, module paths as the export named them, and the lines
/// that apply it; or why torch cannot run the plan's layouts.
pub fn torch_tp_plan(d: &Degrees) -> Result<String, String> {
    if d.expert > 1 {
        return Err(format!(
            "the plan is expert parallel ({} ways): torch.distributed.tensor.parallel has no expert-parallel style (torchtitan runs it with its own MoE modules); use the Megatron-LM or DeepSpeed export",
            d.expert
        ));
    }
    if d.context > 1 {
        return Err(format!(
            "the plan is context parallel ({}, {} ways): torch.distributed.tensor.parallel splits no sequence of attention (torch.distributed.tensor.experimental.context_parallel runs ring attention beside it, not part of this export); use the Megatron-LM or DeepSpeed export",
            if d.ring { "ring attention" } else { "Ulysses" },
            d.context
        ));
    }
    if d.tensor <= 1 {
        return Err("the plan has no tensor parallelism: nothing for torch.distributed.tensor.parallel to do (data parallelism is DDP/FSDP)".into());
    }
    if !d.torch.blockers.is_empty() {
        let shown: Vec<&str> = d.torch.blockers.iter().take(6).map(|s| s.as_str()).collect();
        return Err(format!(
            "torch.distributed.tensor.parallel cannot run this plan's layouts ({} reasons):\n  {}{}",
            d.torch.blockers.len(),
            shown.join("\n  "),
            if d.torch.blockers.len() > shown.len() { "\n  …" } else { "" }
        ));
    }
    let mut t = String::from("# shardc plan as a torch.distributed.tensor.parallel plan\n");
    t.push_str(&format!(
        "# tensor {} (tp_mesh), data {}, pipeline {}; module paths as the export named them\n",
        d.tensor, d.data, d.pipeline
    ));
    t.push_str("from torch.distributed.tensor import Replicate, Shard\n");
    t.push_str("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module\n\n");
    t.push_str("plan = {\n");
    for e in &d.torch.entries {
        t.push_str(&format!("    \"{}\": {},\n", e.path, e.python()));
    }
    t.push_str("}\n\n");
    t.push_str(&format!(
        "# Apply to the module that was exported, on each of the {} ranks of its tensor-parallel group:\n",
        d.tensor
    ));
    t.push_str("#   from torch.distributed.device_mesh import init_device_mesh\n");
    t.push_str(&format!("#   tp_mesh = init_device_mesh(\"cuda\", ({},))\n", d.tensor));
    t.push_str("#   parallelize_module(model, tp_mesh, plan)\n");
    if d.torch.entries.iter().any(|e| e.style == Style::Sequence) {
        t.push_str(
            "# Sequence parallelism: the layers between the modules see their local part of the sequence, so the\n",
        );
        t.push_str("# model must take positions (rotary tables, masks) for the whole sequence from outside them, as\n");
        t.push_str(
            "# torchtitan's Llama does; transformers' models derive them from the local hidden state and fail.\n",
        );
    }
    Ok(t)
}
