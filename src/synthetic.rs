//! Synthetic models in the ONNX textual syntax, for benchmarks and tests that need a model
//! of a given size: a GPT-style decoder stack of any width and depth (Megatron-LM's with a
//! fused GELU), a Llama-style one ([`Llama`]: RMSNorm, grouped-query attention, rotary
//! embeddings, SwiGLU), and a long chain.
//!
//! Weights are external (shape only), so the text stays small however large the model.

use std::fmt::Write;

mod llama;
pub use llama::Llama;

/// A GPT-style decoder: `layers` pre-norm blocks of multi-head causal self-attention (separate
/// Q, K and V projections) and a GELU MLP of width `4·hidden`, on `batch × seq × hidden`
/// activations.
#[derive(Clone, Copy, Debug)]
pub struct Gpt {
    /// Blocks.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Attention heads (must divide `hidden`).
    pub heads: usize,
    /// Batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// The MLP's GELU as one `Gelu` op (opset 20), as Megatron-LM fuses it, instead of the
    /// exporters' five ops around `Erf`.
    pub fused_gelu: bool,
    /// The vocabulary (0: none, the model maps `batch × seq × hidden` activations to
    /// activations). Otherwise the input is `batch × seq` token ids, embedded by a
    /// `vocab × hidden` table plus learned positions, and a final LayerNorm and a
    /// `hidden × vocab` output layer (untied) give the logits, as Megatron-LM's GPT.
    pub vocab: usize,
}

/// The additive causal mask (−10⁴ above the diagonal), computed in the graph from the
/// `mask_*` initializers: a constant, not an initializer the trainer would take for a
/// parameter (an `[s, s]` one would be priced with gradients and optimizer state).
pub(crate) const CAUSAL_MASK: &str = "   [\"causal_mask/ones\"] mask_ones = Expand (mask_one, mask_shape)
   [\"causal_mask/upper\"] mask_upper = Trilu <upper: int = 1> (mask_ones, mask_diagonal)
   [\"causal_mask\"] causal_mask = Mul (mask_upper, mask_fill)
";

pub(crate) fn ext(dtype: &str, dims: &[usize], name: &str) -> String {
    let len: usize = dims.iter().product::<usize>() * 4;
    let d: Vec<String> = dims.iter().map(|x| x.to_string()).collect();
    format!(
        "{dtype}[{}] \"{name}\" = [\"location\": \"synthetic.bin\", \"offset\": \"0\", \"length\": \"{len}\"]",
        d.join(",")
    )
}

impl Gpt {
    /// The model text.
    pub fn to_text(&self) -> String {
        let Gpt { layers, hidden: h, heads: nh, batch: b, seq: s, fused_gelu, vocab } = *self;
        assert!(nh > 0 && h % nh == 0, "heads must divide hidden");
        let hd = h / nh;
        let mut inits: Vec<String> = vec![
            format!("int64[4] heads_shape = {{{b},{s},{nh},{hd}}}"),
            format!("int64[3] model_shape = {{{b},{s},{h}}}"),
            format!("float scale = {{{}}}", 1.0 / (hd as f64).sqrt()),
            "float half = {0.5}".into(),
            "float one = {1}".into(),
            "float sqrt2 = {1.41421}".into(),
            format!("int64[2] mask_shape = {{{s},{s}}}"),
            "float mask_one = {1}, int64 mask_diagonal = {1}, float mask_fill = {-10000}".into(),
        ];
        for l in 0..layers {
            for (name, dims) in [
                ("ln1_g", vec![h]),
                ("ln1_b", vec![h]),
                ("wq", vec![h, h]),
                ("bq", vec![h]),
                ("wk", vec![h, h]),
                ("bk", vec![h]),
                ("wv", vec![h, h]),
                ("bv", vec![h]),
                ("wo", vec![h, h]),
                ("bo", vec![h]),
                ("ln2_g", vec![h]),
                ("ln2_b", vec![h]),
                ("w1", vec![h, 4 * h]),
                ("b1", vec![4 * h]),
                ("w2", vec![4 * h, h]),
                ("b2", vec![h]),
            ] {
                inits.push(ext("float", &dims, &format!("h{l}.{name}")));
            }
        }
        if vocab > 0 {
            inits.push(ext("float", &[vocab, h], "wte"));
            inits.push(ext("float", &[s, h], "wpe"));
            inits.push(ext("float", &[h], "ln_f_g"));
            inits.push(ext("float", &[h], "ln_f_b"));
            inits.push(ext("float", &[h, vocab], "lm_head"));
        }
        let (input, output) = if vocab > 0 {
            (format!("int64[{b},{s}] tokens"), format!("float[{b},{s},{vocab}] logits"))
        } else {
            (format!("float[{b},{s},{h}] x"), format!("float[{b},{s},{h}] y"))
        };
        let mut t = String::new();
        let _ = write!(
            t,
            "<\n   ir_version: 8,\n   opset_import: [\"\" : {}]\n>\ngpt ({input}) => ({output})\n   <{}>\n{{\n",
            if fused_gelu { 20 } else { 17 },
            inits.join(", ")
        );
        t.push_str(CAUSAL_MASK);
        if vocab > 0 {
            t.push_str("   [\"embedding\"] embedded = Gather (\"wte\", tokens)\n");
            t.push_str("   [\"positions\"] x = Add (embedded, \"wpe\")\n");
        }
        let mut x = "x".to_string();
        for l in 0..layers {
            let p = format!("h{l}");
            let mut line = |s: String| {
                t.push_str("   ");
                t.push_str(&s);
                t.push('\n');
            };
            line(format!(
                "[\"{p}/ln1\"] {p}_ln1 = LayerNormalization <axis: int = -1> ({x}, \"{p}.ln1_g\", \"{p}.ln1_b\")"
            ));
            for (n, perm) in [("q", "[0, 2, 1, 3]"), ("k", "[0, 2, 3, 1]"), ("v", "[0, 2, 1, 3]")] {
                line(format!("[\"{p}/{n}_proj\"] {p}_{n}m = MatMul ({p}_ln1, \"{p}.w{n}\")"));
                line(format!("[\"{p}/{n}_bias\"] {p}_{n} = Add ({p}_{n}m, \"{p}.b{n}\")"));
                line(format!("[\"{p}/{n}_split\"] {p}_{n}r = Reshape ({p}_{n}, heads_shape)"));
                line(format!("[\"{p}/{n}_heads\"] {p}_{n}t = Transpose <perm: ints = {perm}> ({p}_{n}r)"));
            }
            line(format!("[\"{p}/scores\"] {p}_sc = MatMul ({p}_qt, {p}_kt)"));
            line(format!("[\"{p}/scale\"] {p}_scs = Mul ({p}_sc, scale)"));
            line(format!("[\"{p}/mask\"] {p}_scm = Add ({p}_scs, causal_mask)"));
            line(format!("[\"{p}/softmax\"] {p}_pr = Softmax <axis: int = -1> ({p}_scm)"));
            line(format!("[\"{p}/context\"] {p}_ctx = MatMul ({p}_pr, {p}_vt)"));
            line(format!("[\"{p}/merge_heads\"] {p}_ctxt = Transpose <perm: ints = [0, 2, 1, 3]> ({p}_ctx)"));
            line(format!("[\"{p}/merge\"] {p}_ctxr = Reshape ({p}_ctxt, model_shape)"));
            line(format!("[\"{p}/out_proj\"] {p}_om = MatMul ({p}_ctxr, \"{p}.wo\")"));
            line(format!("[\"{p}/out_bias\"] {p}_o = Add ({p}_om, \"{p}.bo\")"));
            line(format!("[\"{p}/residual1\"] {p}_r1 = Add ({x}, {p}_o)"));
            line(format!(
                "[\"{p}/ln2\"] {p}_ln2 = LayerNormalization <axis: int = -1> ({p}_r1, \"{p}.ln2_g\", \"{p}.ln2_b\")"
            ));
            line(format!("[\"{p}/fc1\"] {p}_f1m = MatMul ({p}_ln2, \"{p}.w1\")"));
            line(format!("[\"{p}/fc1_bias\"] {p}_f1 = Add ({p}_f1m, \"{p}.b1\")"));
            if fused_gelu {
                line(format!("[\"{p}/gelu\"] {p}_g = Gelu ({p}_f1)"));
            } else {
                line(format!("[\"{p}/gelu_div\"] {p}_gd = Div ({p}_f1, sqrt2)"));
                line(format!("[\"{p}/gelu_erf\"] {p}_ge = Erf ({p}_gd)"));
                line(format!("[\"{p}/gelu_add\"] {p}_ga = Add ({p}_ge, one)"));
                line(format!("[\"{p}/gelu_mul\"] {p}_gm = Mul ({p}_f1, {p}_ga)"));
                line(format!("[\"{p}/gelu_half\"] {p}_g = Mul ({p}_gm, half)"));
            }
            line(format!("[\"{p}/fc2\"] {p}_f2m = MatMul ({p}_g, \"{p}.w2\")"));
            line(format!("[\"{p}/fc2_bias\"] {p}_f2 = Add ({p}_f2m, \"{p}.b2\")"));
            line(format!("[\"{p}/residual2\"] {p}_r2 = Add ({p}_r1, {p}_f2)"));
            x = format!("{p}_r2");
        }
        if vocab > 0 {
            let _ = writeln!(
                t,
                "   [\"ln_f\"] final_n = LayerNormalization <axis: int = -1> ({x}, \"ln_f_g\", \"ln_f_b\")"
            );
            let _ = writeln!(t, "   [\"lm_head\"] logits = MatMul (final_n, \"lm_head\")\n}}");
        } else {
            let _ = writeln!(t, "   [final] y = Identity ({x})\n}}");
        }
        t
    }
}

/// A chain of about `nodes` ops on `[8, 64, 256]` activations, repeating MatMul, Add,
/// LayerNormalization, Relu and a transpose pair: a large graph of transformer-like ops.
pub fn chain(nodes: usize) -> String {
    let mut s = String::from(
        "<\n   ir_version: 8,\n   opset_import: [\"\" : 17]\n>\nchain (float[8,64,256] x) => (float[8,64,256] y) \n   <",
    );
    let mut inits = vec!["int64[3] shape = {8,64,256}".to_string(), ext("float", &[256], "gamma")];
    let layers = nodes / 6 + 1;
    for l in 0..layers {
        inits.push(ext("float", &[256, 256], &format!("w{l}")));
    }
    s.push_str(&inits.join(", "));
    s.push_str(">\n{\n");
    let mut prev = "x".to_string();
    let mut count = 0;
    'outer: for l in 0..layers {
        let lines = [
            (format!("m{l}"), format!("   [mm{l}] m{l} = MatMul ({prev}, \"w{l}\")")),
            (format!("a{l}"), format!("   [add{l}] a{l} = Add (m{l}, {prev})")),
            (
                format!("n{l}"),
                format!(
                    "   [ln{l}] n{l} = LayerNormalization <axis: int = -1, epsilon: float = 1e-05> (a{l}, \"gamma\")"
                ),
            ),
            (format!("r{l}"), format!("   [relu{l}] r{l} = Relu (n{l})")),
            (format!("t{l}"), format!("   [t{l}] t{l} = Transpose <perm: ints = [0, 2, 1]> (r{l})")),
            (format!("u{l}"), format!("   [t2{l}] u{l} = Transpose <perm: ints = [0, 2, 1]> (t{l})")),
        ];
        for (name, line) in lines {
            if count + 1 >= nodes {
                break 'outer;
            }
            s.push_str(&line);
            s.push('\n');
            count += 1;
            prev = name;
        }
    }
    // The chain may end on a transposed value; Reshape brings it back to the output shape.
    s.push_str(&format!("   [out] y = Reshape ({prev}, shape)\n}}"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_models_parse_verify_and_infer() {
        let llama = Llama {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 96,
            vocab: 50,
            batch: 2,
            seq: 8,
            experts: 0,
            top_k: 0,
        };
        for text in [
            Gpt { layers: 2, hidden: 64, heads: 4, batch: 2, seq: 8, fused_gelu: false, vocab: 0 }.to_text(),
            Gpt { layers: 2, hidden: 64, heads: 4, batch: 2, seq: 8, fused_gelu: true, vocab: 0 }.to_text(),
            Gpt { layers: 2, hidden: 64, heads: 4, batch: 2, seq: 8, fused_gelu: true, vocab: 50 }.to_text(),
            llama.to_text(),
            Llama { kv_heads: 4, vocab: 0, ..llama }.to_text(),
            Llama { experts: 4, top_k: 2, ..llama }.to_text(),
            chain(100),
            chain(7),
        ] {
            let parsed =
                frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "synthetic", &text)));
            let mut g = parsed.model.graph;
            ir::verify(&g).unwrap();
            ir::infer::infer_shapes(&mut g, ir::infer::Mode::Check).unwrap();
            assert!(g.op_count() > 0);
        }
        let g = frontend::parse(&chain(600)).unwrap().model.graph;
        assert!((595..=605).contains(&g.op_count()), "{}", g.op_count());
    }
}
