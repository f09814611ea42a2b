//! Prints a synthetic Llama-style decoder (`shardc::synthetic::Llama`: RMSNorm, grouped-query
//! attention with rotary embeddings, SwiGLU; weights external and shape only) in the ONNX
//! textual syntax, at Llama 3's published sizes or any other:
//!
//! ```text
//! cargo run --release --example synthetic_llama -- 70b 512 4096 > llama70b.onnxtxt
//! shardc plan llama70b.onnxtxt --cluster a100-cluster-8 --precision bf16
//! ```
//!
//! Arguments: `8b`, `70b`, `405b`, `mixtral-8x7b` or `mixtral-8x22b` then batch and sequence
//! (defaults 8 and 4096); or `custom LAYERS HIDDEN HEADS KV_HEADS FFN VOCAB BATCH SEQ
//! [EXPERTS TOP_K]` (VOCAB 0: no output head; EXPERTS 0 or absent: a dense MLP).

use shardc::synthetic::Llama;

fn fail(msg: &str) -> ! {
    eprintln!(
        "error: {msg}; usage: synthetic_llama 8b|70b|405b|mixtral-8x7b|mixtral-8x22b [BATCH SEQ] | custom L H HEADS KV FFN VOCAB BATCH SEQ [EXPERTS TOP_K]"
    );
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: usize| -> usize {
        args.get(i).map_or(d, |a| a.parse().unwrap_or_else(|_| fail(&format!("`{a}` is not a count"))))
    };
    let m = match args.first().map(String::as_str) {
        Some("8b") | None => Llama::llama3_8b(num(1, 8), num(2, 4096)),
        Some("70b") => Llama::llama3_70b(num(1, 8), num(2, 4096)),
        Some("405b") => Llama::llama3_405b(num(1, 8), num(2, 4096)),
        Some("mixtral-8x7b") => Llama::mixtral_8x7b(num(1, 8), num(2, 4096)),
        Some("mixtral-8x22b") => Llama::mixtral_8x22b(num(1, 8), num(2, 4096)),
        Some("custom") => {
            if args.len() != 9 && args.len() != 11 {
                fail("custom takes 8 numbers, or 10 with EXPERTS TOP_K");
            }
            Llama {
                layers: num(1, 0),
                hidden: num(2, 0),
                heads: num(3, 0),
                kv_heads: num(4, 0),
                ffn: num(5, 0),
                vocab: num(6, 0),
                batch: num(7, 0),
                seq: num(8, 0),
                experts: num(9, 0),
                top_k: num(10, 0),
            }
        }
        Some(o) => fail(&format!("unknown size `{o}`")),
    };
    if m.heads == 0 || m.hidden % m.heads != 0 || m.kv_heads == 0 || m.heads % m.kv_heads != 0 {
        fail("heads must divide hidden and key/value heads must divide heads");
    }
    if m.experts > 0 && (m.top_k == 0 || m.top_k > m.experts) {
        fail("TOP_K must be between 1 and EXPERTS");
    }
    print!("{}", m.to_text());
}
