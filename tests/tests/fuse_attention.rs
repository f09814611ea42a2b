//! `fuse-attention` (the exporters' scaled dot-product attention as one `Attention` op) on
//! the shared transformer exports and the synthetic GPT and Llama: every attention is found,
//! the rewritten model prints and parses back, computes the original's outputs, and trains
//! the same (losses, every parameter's gradient and value over three SGD steps); and the
//! training step no longer keeps the `s × s` probabilities.

use shardc::synthetic::{Gpt, Llama};
use shardc::train::Tensors;
use shardc_tests::*;

mod common;

fn prepared(mut model: ir::Model) -> ir::Model {
    let mut pm = passes::PassManager::new().with_verify(true);
    pm.add(passes::InferShapes::default()).add(passes::Canonicalize);
    pm.run(&mut model).unwrap_or_else(|e| panic!("{e}: {:?}", e.errors));
    model
}

fn fused(model: &ir::Model) -> (ir::Model, u64) {
    let mut f = model.clone();
    let mut pm = passes::PassManager::new().with_verify(true);
    pm.add(passes::FuseAttention);
    let report = pm.run(&mut f).unwrap_or_else(|e| panic!("{e}: {:?}", e.errors));
    let n = report.stats.get("attentions fused");
    (f, n)
}

fn op_count(g: &ir::Graph, op: &str) -> usize {
    g.op_nodes().unwrap().into_iter().filter(|&n| g.node(n).op.op_type() == op).count()
}

fn round_trips(m: &ir::Model, what: &str) {
    let text = ir::print::model_to_string(m);
    let again = frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, what, &text)));
    assert_eq!(ir::print::model_to_string(&again.model), text, "{what}");
}

/// A synthetic model with its weights drawn from a seed.
fn drawn(text: &str) -> ir::Model {
    let mut m = frontend::parse(text).unwrap().model;
    shardc::exec::materialize(&mut m, std::path::Path::new("/nonexistent"), 3).unwrap();
    prepared(m)
}

/// Sequence 16 over heads of 8: the scores' `[b, h, 16, 16]` is no other value's shape.
fn small_gpt() -> ir::Model {
    drawn(&Gpt { layers: 2, hidden: 32, heads: 4, batch: 2, seq: 16, fused_gelu: true, vocab: 0 }.to_text())
}

fn small_llama() -> ir::Model {
    drawn(&Llama::reduced(2, 2, 8).to_text())
}

/// Every attention of the shared exports (GPT-2's and BERT's decomposed
/// `scaled_dot_product_attention` with its guard of fully masked rows, nn.Transformer's
/// encoder, decoder and cross attention) and of the synthetic models is fused, and the fused
/// models compute the originals' outputs.
#[test]
fn every_attention_is_fused_and_computes_the_same() {
    let shared = |name: &str| {
        let path = data_files("models").into_iter().find(|p| p.ends_with(name)).unwrap();
        prepared(load_model(&path))
    };
    let cases = [
        ("hf_gpt2_small4", shared("hf_gpt2_small4.onnxtxt"), 4, true),
        ("hf_bert_base", shared("hf_bert_base.onnxtxt"), 12, false),
        ("pt_nn_transformer", shared("pt_nn_transformer.onnxtxt"), 18, true),
        ("synthetic gpt", small_gpt(), 2, true),
        ("synthetic llama", small_llama(), 2, true),
    ];
    for (name, model, attentions, evaluate) in cases {
        let softmaxes = op_count(&model.graph, "Softmax");
        let (f, n) = fused(&model);
        assert_eq!((n as usize, op_count(&f.graph, "Attention")), (attentions, attentions), "{name}");
        assert_eq!(op_count(&f.graph, "Softmax"), softmaxes - attentions, "{name}");
        round_trips(&f, name);
        if !evaluate {
            continue;
        }
        let inputs = if name.starts_with("hf_") {
            token_inputs(&model.graph)
        } else {
            let first = model.graph.value_name(model.graph.input_values()[0]).to_string();
            float_inputs(&model.graph, &first, 7)
        };
        let opts = ir::eval::RunOptions { seed: Some(5) };
        let want = ir::eval::run(&model.graph, &inputs, &opts).unwrap();
        let got = ir::eval::run(&f.graph, &inputs, &opts).unwrap();
        for (k, (a, b)) in got.iter().zip(&want).enumerate() {
            compare(&format!("{name} output {k}"), a, b, 1e-4, 1e-5).unwrap();
        }
    }
}

/// Gradients and parameters of 3 SGD steps of `base` and of `rewritten` on the reference
/// trainer (inputs drawn from one seed), after checking they take the same losses.
fn train_both(base: &ir::Model, rewritten: &ir::Model) -> ((Tensors, Tensors), (Tensors, Tensors)) {
    let loss = passes::autodiff::LossSpec::Mean(None);
    let (l0, g0, p0) = common::sgd_steps(base, &loss);
    let (l1, g1, p1) = common::sgd_steps(rewritten, &loss);
    assert_eq!(l0.len(), l1.len());
    for (a, b) in l1.iter().zip(&l0) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "loss {a} vs {b}");
    }
    ((g0, p0), (g1, p1))
}

/// The fused GPT and Llama train as the originals do: the same losses, gradients and
/// parameters for every weight (the op's gradient recomputes the probabilities).
#[test]
fn fused_attention_trains_the_same() {
    for (name, model) in [("gpt", small_gpt()), ("llama", small_llama())] {
        let (f, _) = fused(&model);
        let ((g0, p0), (g1, p1)) = train_both(&model, &f);
        for (want, got, what) in [(&g0, &g1, "gradient"), (&p0, &p1, "parameter")] {
            assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}");
            assert!(!want.is_empty());
            for (k, w) in want {
                compare(&format!("{name} {what} {k}"), &got[k], w, 1e-4, 1e-6).unwrap();
            }
        }
    }
}

/// The training step of the fused model keeps no `[b, h, s, s]` value for its backward pass;
/// the original keeps the probabilities of every layer.
#[test]
fn the_fused_step_keeps_no_scores() {
    let model = small_gpt();
    let (f, _) = fused(&model);
    let square = |m: &ir::Model| {
        let saved = passes::cost::stash::saved_values(&m.graph).unwrap();
        saved
            .iter()
            .filter(|v| {
                let d = m.graph.tensor_type(**v).and_then(|t| t.static_dims()).unwrap_or_default();
                d.len() == 4 && d[2] == 16 && d[3] == 16
            })
            .count()
    };
    assert!(square(&model) >= 2, "the unfused step keeps the probabilities");
    assert_eq!(square(&f), 0);
}

/// The fused GPT and Llama train on wgpu — attention on its kernel, the forward's and the
/// backward's recomputation of the probabilities, no `Attention` run on the host — as the
/// unfused models train on the reference trainer: the same losses over 3 SGD steps, the
/// first step's gradients and the last step's parameters.
#[test]
fn fused_attention_trains_on_wgpu_like_the_unfused_model() {
    use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
    if !gpu_available() {
        return;
    }
    let loss = LossSpec::Mean(None);
    for (name, model) in [("gpt", small_gpt()), ("llama", small_llama())] {
        let (f, _) = fused(&model);
        let (l0, g0, p0) = common::sgd_steps(&model, &loss);
        let (t, info) = shardc::train::training_model(&f, &loss, &OptimizerSpec::sgd(0.1, 0.0)).unwrap();
        let inputs = shardc::train::seeded_inputs(&t.graph, &info, 3).unwrap();
        let prog = codegen::lower(&t.graph, &codegen::Placement::single()).unwrap();
        let run = shardc::train::run_steps(&prog, &info, &inputs, codegen::Backend::Wgpu, 3)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let host = &run.report.devices[0].host_ops;
        assert!(!host.contains_key("Attention"), "{name}: attention ran on the host: {host:?}");
        assert!(!host.contains_key("AttentionGrad"), "{name}: its gradient ran on the host: {host:?}");
        assert_eq!(run.losses.len(), l0.len(), "{name}");
        for (a, b) in run.losses.iter().zip(&l0) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{name}: loss {a} vs {b}");
        }
        for (want, got, what) in [(&g0, &run.gradients, "gradient"), (&p0, &run.parameters, "parameter")] {
            assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}");
            for (k, w) in want {
                compare(&format!("{name} {what} {k} on wgpu"), &got[k], w, 1e-3, 1e-5).unwrap();
            }
        }
    }
}

/// The synthetic Llama's causal mask (`Trilu(upper, k = 1)` of ones times −10⁴) becomes the
/// fused op's `is_causal` (folded to a constant at this size, or as written at a length
/// folding stops at): no `s × s` value is left in the graph, and the outputs are the
/// original's (the first test). A mask that adds too little to zero a weight (−1), or keeps
/// the diagonal (`k = 0`), stays a tensor input.
#[test]
fn a_causal_mask_becomes_is_causal() {
    let square = |g: &ir::Graph| {
        g.node_ids().flat_map(|n| (0..g.node(n).num_outputs()).map(move |s| ir::Value::new(n, s as u16))).any(|v| {
            let d = g.tensor_type(v).and_then(|t| t.static_dims()).unwrap_or_default();
            d.len() >= 2 && d[d.len() - 1] == 12 && d[d.len() - 2] == 12
        })
    };
    let text = Llama::reduced(2, 2, 12).to_text();
    let causal = |g: &ir::Graph| {
        let attention = g.op_nodes().unwrap().into_iter().filter(|&n| g.node(n).op.op_type() == "Attention");
        attention
            .map(|n| match &g.node(n).op {
                ir::Op::Attention(a) => (a.is_causal == Some(1), g.node(n).input(3).is_some()),
                _ => unreachable!(),
            })
            .collect::<Vec<_>>()
    };
    let (f, _) = fused(&drawn(&text));
    assert_eq!(causal(&f.graph), vec![(true, false); 2]);
    assert!(!square(&f.graph), "a 12 × 12 value is left");
    for (from, to) in [("mask_fill = {-10000}", "mask_fill = {-1}"), ("mask_diagonal = {1}", "mask_diagonal = {0}")] {
        assert!(text.contains(from));
        let model = drawn(&text.replace(from, to));
        let (f, _) = fused(&model);
        assert_eq!(causal(&f.graph), vec![(false, true); 2], "{to}");
        let first = model.graph.value_name(model.graph.input_values()[0]).to_string();
        let inputs = float_inputs(&model.graph, &first, 7);
        let opts = ir::eval::RunOptions { seed: Some(5) };
        let want = ir::eval::run(&model.graph, &inputs, &opts).unwrap();
        let got = ir::eval::run(&f.graph, &inputs, &opts).unwrap();
        compare(to, &got[0], &want[0], 1e-4, 1e-5).unwrap();
    }
}

/// A causal attention's work is the scores its mask keeps, `(s + 1)/2s` of a full one's (the
/// same attention with its mask as a tensor counts all of them); on an H100 the fused kernel
/// runs at its published rate (cuDNN's, `attention_efficiency`), not the GEMMs'.
#[test]
fn causal_attention_prices_the_scores_it_keeps_at_the_kernels_rate() {
    let s = 512;
    let text = Llama::reduced(1, 2, s).to_text();
    let attention = |text: &str| {
        let (f, _) = fused(&drawn(text));
        let n = f.graph.op_nodes().unwrap().into_iter().find(|&n| f.graph.node(n).op.op_type() == "Attention").unwrap();
        (f, n)
    };
    let (causal, nc) = attention(&text);
    let (masked, nm) = attention(&text.replace("mask_fill = {-10000}", "mask_fill = {-1}"));
    let flops = |m: &ir::Model, n| {
        let cluster = passes::cost::Cluster::preset("dgx-h100").unwrap();
        let mesh = ir::shard::Mesh::line(1, ir::shard::LinkLevel::Intra);
        let opts = passes::cost::Options { precision: passes::cost::Precision::Fp16, ..Default::default() };
        let cm = passes::cost::CostModel::new(&m.graph, &cluster, mesh, opts);
        let t = cm.op_time(n, &[None]);
        (cm.node_cost(n).fwd_flops, t.fwd, t.bwd)
    };
    let ((fc, tc, bc), (fm, tm, _)) = (flops(&causal, nc), flops(&masked, nm));
    let want = (s + 1) as f64 / (2 * s) as f64;
    assert!((fc / fm - want).abs() < 1e-9, "causal/full FLOPs {} vs {want}", fc / fm);
    // Large enough to run at the kernel's rate (launches aside), forward and backward.
    let (peak, [fwd_eff, bwd_eff]) = (989e12, [595.0 / 989.0, 516.0 / 989.0]);
    assert!(tc > fc / (peak * fwd_eff) && tc < 1.05 * fc / (peak * fwd_eff) + 1e-5, "{tc} s for {fc} FLOPs");
    assert!(bc > 2.5 * fc / (peak * bwd_eff), "{bc} s backward");
    assert!(tm > tc, "the full attention takes longer");
}
