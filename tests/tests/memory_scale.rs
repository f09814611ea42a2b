//! Memory at LLM scale: the activations a Megatron-style GPT keeps for its backward pass under
//! each recomputation granularity, with and without sequence parallelism, against the closed
//! forms of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
//! Models", §4, without the dropout masks the synthetic model does not have); and ZeRO's
//! model-state memory against the counts of its paper (Rajbhandari et al. 2020, §5).

use passes::autoshard::{self, config::Config};
use passes::cost::{self, Breakdown, Cluster, Options, Precision};

/// A Megatron-style GPT (fused GELU), parsed and prepared as the CLI does.
fn gpt(layers: usize, hidden: usize, heads: usize, batch: usize, seq: usize) -> ir::Graph {
    let text = shardc::synthetic::Gpt { layers, hidden, heads, batch, seq, fused_gelu: true, vocab: 0 }.to_text();
    let mut m = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "gpt", &text))).model;
    let mut pm = passes::PassManager::new();
    pm.add(passes::Verify).add(passes::InferShapes::default()).add(passes::Canonicalize).add(passes::Algebra);
    pm.run(&mut m).unwrap();
    m.graph
}

/// The price of configuration `config` on `devices` A100s, mixed precision with Adam.
fn priced(g: &ir::Graph, devices: usize, config: &str) -> Breakdown {
    let c = Cluster::preset("a100-cluster-8").unwrap();
    let opts = Options { precision: Precision::Fp16, ..Options::default() };
    let (named, opts) = Config::parse(config)
        .and_then(|cfg| cfg.resolve(devices, cost::pipeline::graph_batch(g), &opts))
        .unwrap_or_else(|e| panic!("{config}: {e}"));
    autoshard::named::price(g, &c, devices, &named, &opts).unwrap_or_else(|e| panic!("{config}: {e}")).breakdown
}

/// Ψ: the elements of `g`'s trained parameters.
fn parameters(g: &ir::Graph) -> f64 {
    g.initializers()
        .iter()
        .map(|&n| ir::Value::new(n, 0))
        .filter(|&v| ir::cost::is_param(g, v))
        .map(|v| g.tensor_type(v).and_then(|t| t.numel()).unwrap() as f64)
        .sum()
}

fn close(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got / want - 1.0).abs() <= tol,
        "{what}: shardc {got:.4e} B, closed form {want:.4e} B ({:+.2}%)",
        100.0 * (got / want - 1.0)
    );
}

#[test]
fn activations_match_the_closed_forms_of_korthikanti_et_al() {
    let (l, h, a, b, s) = (4usize, 512usize, 8usize, 2usize, 256usize);
    let g = gpt(l, h, a, b, s);
    let sbh = (s * b * h) as f64;
    let scores = (a * s * s * b) as f64;
    let lf = l as f64;
    for t in [1usize, 4] {
        let tf = t as f64;
        for sp in [false, true] {
            if sp && t == 1 {
                continue;
            }
            // The part outside the tensor-parallel regions: split by t under SP.
            let r = if sp { 1.0 / tf } else { 1.0 };
            // Per layer, in bytes at 2 bytes an element: 8sbh (layer norms' inputs, the
            // inputs of the QKV and first MLP GEMMs) + 24sbh/t (Q, K, V, the context, the MLP's
            // two 4h tensors) + 2as²b/t (the softmax's output).
            let none_layer = sbh * (8.0 * r + 24.0 / tf) + 2.0 * scores / tf;
            let selective_layer = sbh * (8.0 * r + 24.0 / tf);
            let full_layer = 2.0 * sbh * r;
            // Layer 0's input is the model's input, not an activation it computes.
            let first = 2.0 * sbh * r;
            let cases = [
                ("none", lf * none_layer - first),
                // One layer's probabilities again while its backward runs.
                ("selective", lf * selective_layer - first + 2.0 * scores / tf),
                // One layer's whole stash again while its backward runs.
                ("full", lf * full_layer - first + none_layer),
                // torchtitan's op-level policy keeps the layer's input and the outputs of its
                // first and third of six linear products (Q's, V's and the first MLP GEMM's,
                // before their biases: 12sbh/t); as under `full`, one layer's stash is made
                // again while its backward runs.
                ("op", lf * (full_layer + 12.0 * sbh / tf) - first + none_layer),
            ];
            for (recompute, want) in cases {
                let config = format!("tp={t},recompute={recompute}{}", if sp { ",sp" } else { "" });
                let got = priced(&g, t, &config).memory.activations;
                close(got, want, 0.02, &config);
            }
        }
    }
}

#[test]
fn recomputation_costs_compute_and_sequence_parallelism_trades_all_reduce_for_two_halves() {
    let g = gpt(4, 512, 8, 2, 256);
    let none = priced(&g, 4, "tp=4");
    let selective = priced(&g, 4, "tp=4,recompute=selective");
    let full = priced(&g, 4, "tp=4,recompute=full");
    // Full recomputation runs the forward again (its communication too); selective only the
    // attention core, a small part of it.
    // torchtitan's op-level policy recomputes the core and half the linear layers.
    let op = priced(&g, 4, "tp=4,recompute=op");
    assert!(full.backward_s > op.backward_s && op.backward_s > selective.backward_s);
    assert!(full.backward_s > selective.backward_s && selective.backward_s > none.backward_s);
    let again = full.backward_s - none.backward_s;
    assert!(again > 0.8 * none.forward_s && again < 1.2 * none.forward_s, "{again} vs forward {}", none.forward_s);
    assert!(selective.backward_s - none.backward_s < 0.25 * again);
    assert_eq!(full.forward_s, none.forward_s);
    let sp = priced(&g, 4, "tp=4,sp");
    let kind = |b: &Breakdown, k: &str| b.communication_by_kind.get(k).copied().unwrap_or(0.0);
    assert!(kind(&sp, "reduce_scatter") > 0.0 && kind(&sp, "all_gather") > 0.0);
    assert!(kind(&sp, "all_reduce") < 0.1 * kind(&none, "all_reduce"), "{:?}", sp.communication_by_kind);
}

#[test]
fn zero_stages_shard_model_state_as_the_zero_paper_counts() {
    // GPT-2 small's blocks, 8-way data parallel, mixed precision with Adam: per parameter
    // 2 bytes of weight, 2 of gradient, 12 of optimizer state (fp32 master, two moments).
    let g = gpt(12, 768, 12, 8, 128);
    let psi = parameters(&g);
    let n = 8.0;
    let largest: f64 = 768.0 * 3072.0;
    let zero0 = priced(&g, 8, "dp=8");
    for (stage, w, gr, o) in [
        (0, 2.0 * psi, 2.0 * psi, 12.0 * psi),
        (1, 2.0 * psi, 2.0 * psi, 12.0 * psi / n),
        (2, 2.0 * psi, 2.0 * psi / n, 12.0 * psi / n),
        (3, 2.0 * psi / n, 2.0 * psi / n, 12.0 * psi / n),
    ] {
        let b = priced(&g, 8, &format!("dp=8,zero={stage}"));
        let m = &b.memory;
        close(m.weights, w, 1e-9, &format!("zero={stage} weights"));
        close(m.gradients, gr, 1e-9, &format!("zero={stage} gradients"));
        close(m.optimizer, o, 1e-9, &format!("zero={stage} optimizer"));
        // Stage 3 gathers a parameter whole (with its gradient) before it is used.
        let buffer = if stage == 3 { 2.0 * 2.0 * largest } else { 0.0 };
        close(m.workspace, zero0.memory.workspace + buffer, 1e-9, &format!("zero={stage} workspace"));
        assert_eq!(m.activations, zero0.memory.activations);
        // The same bytes cross the links (reduce-scatter + all-gather is an all-reduce), and
        // stage 3 gathers twice more.
        let moved = b.gradient_sync_s;
        let factor = if stage == 3 { 1.5 } else { 1.0 };
        close(moved, factor * zero0.gradient_sync_s, 0.02, &format!("zero={stage} synchronisation"));
    }
}

/// With `fp32_grads` (DeepSpeed's mixed-precision optimizers), the model state is
/// DeepSpeed's estimators' count: ZeRO-1 `4Ψ + 16Ψ/N` (half-precision weights and gradients
/// whole, the optimizer state and an fp32 gradient copy sharded), ZeRO-3 `18Ψ/N` (the
/// gradients reduced straight into the copy's shard); ZeRO-2 keeps `2Ψ + 16Ψ/N` — the
/// estimator's `4Ψ + 16Ψ/N` counts the half-precision gradients whole, which its bucketed
/// reduce-scatter frees as it goes.
#[test]
fn fp32_gradient_copies_give_deepspeeds_model_state() {
    let g = gpt(12, 768, 12, 8, 128);
    let psi = parameters(&g);
    let n = 8.0;
    for (stage, want) in
        [(0, 20.0 * psi), (1, 4.0 * psi + 16.0 * psi / n), (2, 2.0 * psi + 16.0 * psi / n), (3, 18.0 * psi / n)]
    {
        let m = priced(&g, 8, &format!("dp=8,zero={stage},fp32_grads")).memory;
        close(m.weights + m.gradients + m.optimizer, want, 1e-9, &format!("zero={stage},fp32_grads model state"));
        let plain = priced(&g, 8, &format!("dp=8,zero={stage}")).memory;
        assert_eq!((m.optimizer, m.activations), (plain.optimizer, plain.activations), "zero={stage}");
    }
    // In float32 the gradients are float32 already: nothing more.
    let fp32 = |config: &str| {
        let c = Cluster::preset("a100-cluster-8").unwrap();
        let (named, opts) =
            Config::parse(config).unwrap().resolve(8, cost::pipeline::graph_batch(&g), &Options::default()).unwrap();
        autoshard::named::price(&g, &c, 8, &named, &opts).unwrap().breakdown.memory.gradients
    };
    assert_eq!(fp32("dp=8,zero=1,fp32_grads"), fp32("dp=8,zero=1"));
}

/// A pipeline's stage reports its model state by kind as a flat plan does: per parameter of
/// the stage 2 bytes of weight, 2 of gradient and 2 more for the accumulator over its
/// micro-batches, 12 of optimizer state (GPT-2 small's blocks, 2 stages, mixed precision, Adam).
#[test]
fn pipeline_stages_report_weights_gradients_and_optimizer_state() {
    let g = gpt(12, 768, 12, 8, 128);
    let m = priced(&g, 2, "pp=2,mbs=1").memory;
    assert!(m.weights > 0.0 && m.gradients > 0.0 && m.optimizer > 0.0, "{m:?}");
    close(m.gradients, 2.0 * m.weights, 1e-9, "gradients and their accumulator");
    close(m.optimizer, 6.0 * m.weights, 1e-9, "optimizer state");
}

#[test]
fn configurations_check_their_degrees_and_say_what_is_not_priced() {
    let opts = Options::default();
    let resolve = |s: &str, d: usize| Config::parse(s).and_then(|c| c.resolve(d, Some(8), &opts).map(|(n, _)| n));
    assert!(resolve("tp=4,dp=4", 8).unwrap_err().contains("16 devices"));
    assert!(resolve("tp=3", 8).unwrap_err().contains("does not divide"));
    assert_eq!(resolve("cp=2", 8).unwrap(), autoshard::named::Named::Context { dp: 4, tp: 1, ring: false });
    assert_eq!(resolve("cp=2,tp=2", 8).unwrap(), autoshard::named::Named::Context { dp: 2, tp: 2, ring: false });
    assert_eq!(resolve("cp=2,cp_comm=p2p", 8).unwrap(), autoshard::named::Named::Context { dp: 4, tp: 1, ring: true });
    assert!(resolve("cp_comm=p2p", 8).unwrap_err().contains("give cp > 1"));
    assert!(resolve("cp=2,cp_comm=x", 8).unwrap_err().contains("p2p (ring attention) or a2a"));
    assert!(resolve("cp=2,pp=2", 8).unwrap_err().contains("context parallelism"));
    assert!(resolve("cp=2,tp=2,sp", 8).unwrap_err().contains("leave out sp"));
    assert_eq!(resolve("cp=8", 8).unwrap(), autoshard::named::Named::Context { dp: 1, tp: 1, ring: false });
    assert_eq!(resolve("ep=2", 8).unwrap(), autoshard::Named::Expert { ep: 2, tp: 1 });
    assert_eq!(resolve("dp=8,ep=8", 8).unwrap(), autoshard::Named::Expert { ep: 8, tp: 1 });
    assert_eq!(resolve("tp=2,ep=2", 8).unwrap(), autoshard::Named::Expert { ep: 2, tp: 2 });
    assert!(resolve("ep=3", 8).unwrap_err().contains("carved from the 8 data-parallel ranks"));
    assert_eq!(
        resolve("ep=2,tp=2,pp=2,mbs=1", 8).unwrap(),
        autoshard::Named::Pipeline { stages: 2, micro: 4, schedule: cost::Schedule::OneFOneB, tensor: 2, expert: 2 }
    );
    assert!(resolve("ep=4,tp=2,pp=2", 8).unwrap_err().contains("carved from the 2 data-parallel ranks"));
    assert!(resolve("ep=2,ep_comm=a2a,capacity=x", 8).unwrap_err().contains("capacity factor"));
    assert!(resolve("ep=2,cp=2", 8).unwrap_err().contains("cp 1"));
    assert_eq!(
        resolve("ep=2,pp=2,mbs=1", 8).unwrap(),
        autoshard::Named::Pipeline { stages: 2, micro: 2, schedule: cost::Schedule::OneFOneB, tensor: 1, expert: 2 }
    );
    assert!(resolve("vp=2", 8).unwrap_err().contains("give pp > 1"));
    assert!(resolve("pp=2,vp=2,schedule=gpipe", 8).unwrap_err().contains("interleaved schedule"));
    // Batch 8 over dp = 2 in micro-batches of 2: 2 micro-batches, not a multiple of 4 stages.
    assert!(resolve("pp=4,vp=2,dp=2,mbs=2", 8).unwrap_err().contains("groups of pp"));
    assert!(resolve("sp", 8).unwrap_err().contains("tp > 1"));
    assert!(resolve("tp_overlap", 8).unwrap_err().contains("tp > 1"));
    assert!(Config::parse("tp=2,tp_overlap=maybe").unwrap_err().contains("tp_overlap=on"));
    let opts_of = |s: &str| Config::parse(s).and_then(|c| c.resolve(8, Some(8), &opts)).unwrap().1;
    assert!(opts_of("tp=2,tp_overlap").tp_comm_overlap && !opts_of("tp=2").tp_comm_overlap);
    assert!(Config::parse("zero=4").unwrap_err().contains("0, 1, 2 or 3"));
    assert!(Config::parse("tp=2,tp=4").unwrap_err().contains("twice"));
    assert!(Config::parse("foo=1").unwrap_err().contains("unknown field"));
    assert_eq!(resolve("tp=8", 8).unwrap(), autoshard::Named::Megatron);
    assert_eq!(resolve("tp=2", 8).unwrap(), autoshard::Named::Hybrid { dp: 4, tp: 2 });
    assert_eq!(resolve("dp=8", 8).unwrap(), autoshard::Named::Data);
    let pipeline =
        |stages, micro, schedule, tensor| autoshard::Named::Pipeline { stages, micro, schedule, tensor, expert: 1 };
    assert_eq!(resolve("pp=2,mbs=1", 8).unwrap(), pipeline(2, 2, cost::Schedule::OneFOneB, 1));
    assert_eq!(resolve("pp=2,tp=2", 8).unwrap(), pipeline(2, 4, cost::Schedule::OneFOneB, 2));
    assert_eq!(resolve("pp=2,tp=4,vp=3", 8).unwrap(), pipeline(2, 8, cost::Schedule::Interleaved(3), 4));
    assert_eq!(resolve("pp=2,schedule=interleaved", 8).unwrap(), pipeline(2, 2, cost::Schedule::Interleaved(2), 1));
}

#[test]
fn a_micro_batch_size_without_a_pipeline_accumulates_gradients() {
    // Batch 2 on a 4-way tensor-parallel mesh: mbs=1 runs two micro-batches per step.
    let g = gpt(4, 512, 8, 2, 256);
    let whole = priced(&g, 4, "tp=4");
    let micro = priced(&g, 4, "tp=4,mbs=1");
    close(micro.memory.activations, whole.memory.activations / 2.0, 1e-9, "activations of one micro-batch");
    assert_eq!(micro.memory.weights, whole.memory.weights);
    // The same work, each kernel launched twice (a large share of so small a model's step).
    assert!(micro.step_time_s > whole.step_time_s && micro.step_time_s < 2.0 * whole.step_time_s);
    assert!(
        Config::parse("tp=4,mbs=3").unwrap().resolve(4, Some(2), &Options::default()).unwrap_err().contains("mbs=3")
    );
}

#[test]
fn three_dimensional_configurations_price_tensor_parallel_stages_and_interleaving() {
    // 8 layers on 8 devices in 2 stages of 4, batch 8 in micro-batches of one per replica; a
    // long sequence, so that activations outweigh what the update holds.
    let g = gpt(8, 256, 4, 8, 1024);
    let data_stages = priced(&g, 8, "pp=2,mbs=1");
    let tensor_stages = priced(&g, 8, "pp=2,tp=2,mbs=1");
    let interleaved = priced(&g, 8, "pp=2,tp=2,vp=2,mbs=1");
    for b in [&data_stages, &tensor_stages, &interleaved] {
        assert!(b.feasible && b.step_time_s > 0.0, "{b:?}");
    }
    // Tensor parallelism over 2 of a stage's devices halves the weights of its matrices (the
    // norms' few stay whole).
    let ratio = tensor_stages.memory.weights / data_stages.memory.weights;
    assert!(ratio > 0.5 && ratio < 0.55, "weights tp=2 / tp=1 per device: {ratio}");
    // Interleaving over 2 chunks: half the bubble's slots, twice the sends, and stage 0
    // holds S + (S − 1)/V = 2.5 micro-batches' activations instead of S = 2.
    let slots = |b: &Breakdown, m: f64| b.bubble_s / ((b.step_time_s - b.bubble_s).max(1e-30) / m);
    let micro = 8.0 / 2.0;
    assert!((slots(&tensor_stages, micro) - 1.0).abs() < 0.2, "1F1B bubble slots {}", slots(&tensor_stages, micro));
    assert!(interleaved.bubble_s < 0.7 * tensor_stages.bubble_s);
    let p2p = |b: &Breakdown| b.communication_by_kind.get("p2p").copied().unwrap_or(0.0);
    assert!(p2p(&interleaved) > 1.4 * p2p(&tensor_stages), "{} vs {}", p2p(&interleaved), p2p(&tensor_stages));
    let acts = interleaved.memory.activations / tensor_stages.memory.activations;
    assert!(acts > 1.05 && acts <= 1.26, "activations interleaved / 1F1B: {acts}");
}

#[test]
fn zero_shards_over_every_data_parallel_device_across_nodes() {
    // 16 devices on two nodes: the gradients' all-reduce runs over the link hierarchy
    // (reduce-scatter in a node, all-reduce across, all-gather in a node) or as one ring;
    // either way ZeRO-3 keeps a sixteenth of the parameters, gradients and optimizer state.
    let g = gpt(2, 256, 4, 16, 128);
    let plain = priced(&g, 16, "dp=16");
    let zero = priced(&g, 16, "dp=16,zero=3");
    close(zero.memory.weights, plain.memory.weights / 16.0, 0.05, "ZeRO-3 parameters on 2 nodes");
    close(zero.memory.optimizer, plain.memory.optimizer / 16.0, 0.05, "ZeRO-3 optimizer state on 2 nodes");
}

#[test]
fn an_interleaved_plan_document_lowers_to_the_program_of_its_search_result() {
    // Tensor 2 × pipeline 2 × data 2 over two chunks per device: the plan document gives each
    // op its stage and chunk, and lowers to the program the search result lowers to, in
    // which every device holds ops of both chunks.
    let g = gpt(4, 32, 4, 8, 16);
    let c = Cluster::preset("a100-cluster-8").unwrap();
    let opts = Options { precision: Precision::Fp16, ..Options::default() };
    let (named, opts) =
        Config::parse("pp=2,tp=2,vp=2").unwrap().resolve(8, cost::pipeline::graph_batch(&g), &opts).unwrap();
    let r = shardc::exec::pipeline_result(&g, &c, 8, &named, &opts).unwrap();
    let info = passes::autoshard::plan::ModelInfo { path: "gpt".into(), ..Default::default() };
    let plan = passes::autoshard::Plan::new(&g, &c, 8, &opts, info, &r);
    let text = serde_json::to_string(&plan).unwrap();
    let plan = passes::autoshard::Plan::from_json(&text).unwrap();
    assert_eq!(plan.schedule, Some(passes::cost::Schedule::Interleaved(2)));
    assert_eq!(plan.chunks(), 2);
    for s in 0..2 {
        let chunks: std::collections::BTreeSet<usize> =
            plan.ops.iter().filter(|o| o.stage == s).map(|o| o.chunk).collect();
        assert_eq!(chunks, [0, 1].into(), "stage {s}");
    }
    let from_plan = shardc::exec::program_for_plan(&g, &plan).unwrap();
    let from_search = shardc::exec::program_for_search(&g, &r, 8).unwrap();
    let texts = |p: &codegen::Program| -> Vec<String> {
        p.devices.iter().map(|d| ir::print::model_to_string(&d.to_model())).collect()
    };
    assert_eq!(texts(&from_plan), texts(&from_search));
    assert_eq!(from_plan.devices.len(), 8);
    for d in &from_plan.devices {
        assert!(d.chunk_of.values().any(|&k| k == 1), "device {} holds one chunk", d.device);
    }
    codegen::check(&from_plan).unwrap();
    // Between stages of equal meshes each device sends its piece: the activations cross a
    // cut split over the data axis (half a micro-batch each), not whole.
    let (micro, mut received) = (plan.micro_batches, 0);
    for d in &from_plan.devices {
        for n in d.graph.op_nodes().unwrap() {
            let ir::Op::Recv(r) = &d.graph.node(n).op else { continue };
            let name = d.graph.value_name(ir::Value::new(n, 0)).to_string();
            let global = name.split("__recv").next().and_then(|x| g.lookup(x)).unwrap();
            let whole = g.tensor_type(global).unwrap().numel().unwrap() / micro as u64;
            let piece: i64 = r.shape.as_ref().unwrap().iter().product();
            assert_eq!(2 * piece as u64, whole, "device {}: {name} arrives as {:?}", d.device, r.shape);
            received += 1;
        }
    }
    assert!(received >= 8, "{received} receives");
    // A chunk the schedule does not have is refused when the document is read.
    let bad = text.replacen("\"chunk\":1", "\"chunk\":2", 1);
    assert!(passes::autoshard::Plan::from_json(&bad).unwrap_err().contains("model chunk 2"), "{bad}");
}

#[test]
fn stages_of_one_device_take_micro_batches_of_one_sample() {
    // Pipeline 4 on 4 devices at batch 4: micro-batches of one sample, in which no dim shows
    // the batch; each stage runs its ops whole.
    let g = gpt(4, 32, 4, 4, 16);
    let b = priced(&g, 4, "pp=4");
    assert!(b.feasible && b.step_time_s > 0.0 && b.bubble_s > 0.0, "{b:?}");
}

/// The grid passes over a rung whose model state alone overflows a device
/// (`cost::model::model_state_floor`): the floor is the model state the cost model prices
/// when nothing splits the parameters (data parallelism, each ZeRO stage) and never above it
/// when tensor and pipeline degrees do.
#[test]
fn the_model_state_floor_never_exceeds_the_priced_model_state() {
    let g = gpt(8, 512, 8, 16, 128);
    let elems = cost::model::parameter_elements(&g, &cost::model::Analysis::of(&g));
    let state = |b: &Breakdown| b.memory.weights + b.memory.gradients + b.memory.optimizer;
    for (zero, fp32_grads) in (0..=3u8).flat_map(|z| [(z, false), (z, true)]) {
        let o = Options { precision: Precision::Fp16, zero, fp32_grads, ..Options::default() };
        let grads = if fp32_grads { ",fp32_grads" } else { "" };
        let b = priced(&g, 8, &format!("dp=8,zero={zero}{grads}"));
        close(
            cost::model::model_state_floor(&o, elems, 1.0, 8.0),
            state(&b),
            1e-9,
            &format!("dp=8,zero={zero}{grads}"),
        );
        for (config, tp, pp, dp) in [("tp=4,dp=2", 4, 1, 2), ("tp=2,pp=2,dp=2", 2, 2, 2), ("pp=4,dp=2", 1, 4, 2)] {
            let config = format!("{config},zero={zero}{grads}");
            let floor = cost::model::model_state_floor(&o, elems, (tp * pp) as f64, dp as f64);
            let b = priced(&g, 8, &config);
            assert!(floor <= state(&b) * (1.0 + 1e-9), "{config}: floor {floor} above the priced {}", state(&b));
        }
    }
}
