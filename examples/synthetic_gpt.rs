//! Prints a synthetic GPT-style decoder (`shardc::synthetic::Gpt`, weights external and shape
//! only) in the ONNX textual syntax, for trying the planner on models of any depth:
//!
//! ```text
//! cargo run --release --example synthetic_gpt -- 48 1600 25 8 1024 > gpt48.onnxtxt
//! shardc plan gpt48.onnxtxt --cluster a100-cluster-8
//! ```
//!
//! Arguments: layers, hidden width, heads, batch, sequence (defaults 12 768 12 8 128), then
//! `--fused-gelu` for one `Gelu` op per MLP (Megatron-LM's fused kernel) instead of five, and
//! `--vocab N` for token ids in, an embedding and an output layer of `N` logits (Megatron-LM's
//! GPT; without it the model maps activations to activations).

fn main() {
    let mut raw: Vec<String> = std::env::args().skip(1).collect();
    let fused_gelu = raw.iter().any(|a| a == "--fused-gelu");
    raw.retain(|a| a != "--fused-gelu");
    let mut vocab = 0;
    if let Some(i) = raw.iter().position(|a| a == "--vocab") {
        vocab = raw.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or_else(|| {
            eprintln!("error: --vocab needs a count");
            std::process::exit(2)
        });
        raw.drain(i..i + 2);
    }
    let args: Vec<usize> = raw
        .iter()
        .map(|a| {
            a.parse().unwrap_or_else(|_| {
                eprintln!("error: `{a}` is not a count; usage: synthetic_gpt [LAYERS HIDDEN HEADS BATCH SEQ]");
                std::process::exit(2)
            })
        })
        .collect();
    let at = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (hidden, heads) = (at(1, 768), at(2, 12));
    if heads == 0 || hidden % heads != 0 {
        eprintln!("error: {heads} heads do not divide the width {hidden}");
        std::process::exit(2);
    }
    let gpt = shardc::synthetic::Gpt {
        layers: at(0, 12),
        hidden,
        heads,
        batch: at(3, 8),
        seq: at(4, 128),
        fused_gelu,
        vocab,
    };
    print!("{}", gpt.to_text());
}
