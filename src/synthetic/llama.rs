//! A Llama-style decoder as the exporters write it: RMSNorm (`RMSNormalization`, opset 23),
//! grouped-query attention with rotary position embeddings (`q·cos + rotate_half(q)·sin`, the
//! tables computed in the graph from the positions, as the model computes them; the
//! key/value heads repeated by `Unsqueeze`/`Expand`/`Reshape`), a causal mask, and a SwiGLU
//! MLP (`down(silu(gate(x)) · up(x))`), or a sparse mixture of such MLPs (Mixtral: a router
//! GEMM, softmax and top-k renormalised, the experts' weights gathered per routed token as
//! transformers' `batched_mm` experts export them; `fuse-experts` makes them one `MoE` op);
//! optionally the final norm and the output head.

use std::fmt::Write;

use super::ext;

/// The rotary base Llama 3 uses.
const ROPE_THETA: f64 = 500000.0;

/// The rotary tables `rope_cos`, `rope_sin` (`[seq, head_dim]`), computed as the model does
/// (`θ^(-2i/d)` per position): buffers, not parameters, so no training step updates them and
/// the backward pass needs none of the activations they multiply.
const ROPE_TABLES: &str = "   [\"rope/positions\"] rope_pos = Range (rope_zero, rope_seq, rope_one)
   [\"rope/index\"] rope_i = Range (rope_zero, rope_dim, rope_two)
   [\"rope/exponent\"] rope_e = Div (rope_i, rope_dim)
   [\"rope/negate\"] rope_ne = Neg (rope_e)
   [\"rope/inv_freq\"] rope_inv = Pow (rope_theta, rope_ne)
   [\"rope/positions_col\"] rope_pc = Unsqueeze (rope_pos, rope_col)
   [\"rope/inv_freq_row\"] rope_ir = Unsqueeze (rope_inv, rope_row)
   [\"rope/freqs\"] rope_f = Mul (rope_pc, rope_ir)
   [\"rope/emb\"] rope_emb = Concat <axis: int = -1> (rope_f, rope_f)
   [\"rope/cos\"] rope_cos = Cos (rope_emb)
   [\"rope/sin\"] rope_sin = Sin (rope_emb)
";

/// A Llama-style decoder of `layers` blocks on `batch × seq × hidden` activations.
#[derive(Clone, Copy, Debug)]
pub struct Llama {
    /// Blocks.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Query heads (must divide `hidden`).
    pub heads: usize,
    /// Key/value heads (must divide `heads`).
    pub kv_heads: usize,
    /// The MLP's inner width.
    pub ffn: usize,
    /// The output head's vocabulary (0: no final norm and head; the output is the last
    /// block's).
    pub vocab: usize,
    /// Batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Experts per mixture (0: a dense MLP).
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
}

impl Llama {
    /// Llama-3-8B's shape (32 × 4096, 32 heads, 8 key/value heads, MLP 14336, vocabulary
    /// 128256) at a batch and sequence.
    pub fn llama3_8b(batch: usize, seq: usize) -> Llama {
        Llama {
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            ffn: 14336,
            vocab: 128256,
            batch,
            seq,
            experts: 0,
            top_k: 0,
        }
    }

    /// Llama-3-70B's shape (80 × 8192, 64 heads, 8 key/value heads, MLP 28672).
    pub fn llama3_70b(batch: usize, seq: usize) -> Llama {
        Llama {
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            vocab: 128256,
            batch,
            seq,
            experts: 0,
            top_k: 0,
        }
    }

    /// Llama-3-405B's shape (126 × 16384, 128 heads, 8 key/value heads, MLP 53248).
    pub fn llama3_405b(batch: usize, seq: usize) -> Llama {
        Llama {
            layers: 126,
            hidden: 16384,
            heads: 128,
            kv_heads: 8,
            ffn: 53248,
            vocab: 128256,
            batch,
            seq,
            experts: 0,
            top_k: 0,
        }
    }

    /// Mixtral-8×7B's shape (32 × 4096, 32 heads, 8 key/value heads, 8 experts of MLP 14336,
    /// top-2, vocabulary 32000).
    pub fn mixtral_8x7b(batch: usize, seq: usize) -> Llama {
        Llama {
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            ffn: 14336,
            vocab: 32000,
            batch,
            seq,
            experts: 8,
            top_k: 2,
        }
    }

    /// Mixtral-8×22B's shape (56 × 6144, 48 heads, 8 key/value heads, 8 experts of MLP
    /// 16384, top-2, vocabulary 32768).
    pub fn mixtral_8x22b(batch: usize, seq: usize) -> Llama {
        Llama {
            layers: 56,
            hidden: 6144,
            heads: 48,
            kv_heads: 8,
            ffn: 16384,
            vocab: 32768,
            batch,
            seq,
            experts: 8,
            top_k: 2,
        }
    }

    /// A Llama small enough to train on the CPU in tests: width 64, 4 query heads over 2
    /// key/value heads, MLP 128, no output head.
    pub fn reduced(layers: usize, batch: usize, seq: usize) -> Llama {
        Llama { layers, hidden: 64, heads: 4, kv_heads: 2, ffn: 128, vocab: 0, batch, seq, experts: 0, top_k: 0 }
    }

    /// The model text.
    pub fn to_text(&self) -> String {
        let Llama { layers, hidden: h, heads: nh, kv_heads: kv, ffn, vocab, batch: b, seq: s, experts, top_k } = *self;
        assert!(experts == 0 || (top_k > 0 && top_k <= experts), "top-k must be within the experts");
        assert!(nh > 0 && h % nh == 0, "heads must divide hidden");
        assert!(kv > 0 && nh % kv == 0, "key/value heads must divide heads");
        let hd = h / nh;
        let rep = nh / kv;
        let mut inits: Vec<String> = vec![
            format!("int64[4] q_shape = {{{b},{s},{nh},{hd}}}"),
            format!("int64[4] kv_shape = {{{b},{s},{kv},{hd}}}"),
            format!("int64[5] rep_shape = {{{b},{kv},{rep},{s},{hd}}}"),
            format!("int64[4] full_shape = {{{b},{nh},{s},{hd}}}"),
            format!("int64[3] model_shape = {{{b},{s},{h}}}"),
            "int64[1] rep_axis = {2}".into(),
            "int64[1] last = {3}".into(),
            format!("int64[1] zero = {{0}}, int64[1] half = {{{}}}, int64[1] end = {{{hd}}}", hd / 2),
            format!("float scale = {{{}}}", 1.0 / (hd as f64).sqrt()),
            format!("int64[2] mask_shape = {{{s},{s}}}"),
            "float mask_one = {1}, int64 mask_diagonal = {1}, float mask_fill = {-10000}".into(),
            format!(
                "float rope_zero = {{0}}, float rope_seq = {{{s}}}, float rope_one = {{1}}, float rope_two = {{2}}"
            ),
            format!("float rope_dim = {{{hd}}}, float rope_theta = {{{ROPE_THETA}}}, int64[1] rope_col = {{1}}"),
            "int64[1] rope_row = {0}".into(),
        ];
        if experts > 0 {
            let t = b * s;
            inits.push(format!("int64[2] moe_tokens = {{{t},{h}}}, int64[1] moe_k = {{{top_k}}}, int64[3] moe_tkh = {{{t},{top_k},{h}}}"));
            inits.push(format!("int64[2] moe_rows = {{{},{h}}}, int64[1] moe_flat = {{-1}}, int64[1] moe_one = {{1}}, int64[1] moe_last = {{-1}}", t * top_k));
        }
        for l in 0..layers {
            for (name, dims) in [
                ("input_norm", vec![h]),
                ("wq", vec![h, h]),
                ("wk", vec![h, kv * hd]),
                ("wv", vec![h, kv * hd]),
                ("wo", vec![h, h]),
                ("post_norm", vec![h]),
            ] {
                inits.push(ext("float", &dims, &format!("layers.{l}.{name}")));
            }
            let mlp: Vec<(&str, Vec<usize>)> = if experts > 0 {
                vec![
                    ("router", vec![h, experts]),
                    ("experts_gate_up", vec![experts, 2 * ffn, h]),
                    ("experts_down", vec![experts, h, ffn]),
                ]
            } else {
                vec![("w_gate", vec![h, ffn]), ("w_up", vec![h, ffn]), ("w_down", vec![ffn, h])]
            };
            for (name, dims) in mlp {
                inits.push(ext("float", &dims, &format!("layers.{l}.{name}")));
            }
        }
        if vocab > 0 {
            inits.push(ext("float", &[h], "norm"));
            inits.push(ext("float", &[h, vocab], "lm_head"));
        }
        let out = if vocab > 0 { format!("float[{b},{s},{vocab}] logits") } else { format!("float[{b},{s},{h}] y") };
        let mut t = String::new();
        let _ = write!(
            t,
            "<\n   ir_version: 10,\n   opset_import: [\"\" : 23]\n>\nllama (float[{b},{s},{h}] x) => ({out})\n   <{}>\n{{\n",
            inits.join(", ")
        );
        t.push_str(super::CAUSAL_MASK);
        t.push_str(ROPE_TABLES);
        let mut x = "x".to_string();
        for l in 0..layers {
            block(&mut t, l, &x, experts > 0);
            x = format!("l{l}_r2");
        }
        if vocab > 0 {
            let _ = writeln!(t, "   [\"norm\"] final_n = RMSNormalization <axis: int = -1> ({x}, norm)");
            let _ = writeln!(t, "   [\"lm_head\"] logits = MatMul (final_n, lm_head)\n}}");
        } else {
            let _ = writeln!(t, "   [final] y = Identity ({x})\n}}");
        }
        t
    }
}

/// One decoder block `l` reading `x`, its output `l{l}_r2`; its MLP a mixture of experts
/// when `moe`.
fn block(t: &mut String, l: usize, x: &str, moe: bool) {
    let p = format!("l{l}");
    let w = |n: &str| format!("\"layers.{l}.{n}\"");
    let mut line = |s: String| {
        t.push_str("   ");
        t.push_str(&s);
        t.push('\n');
    };
    line(format!("[\"{p}/input_norm\"] {p}_n1 = RMSNormalization <axis: int = -1> ({x}, {})", w("input_norm")));
    for (n, shape) in [("q", "q_shape"), ("k", "kv_shape"), ("v", "kv_shape")] {
        line(format!("[\"{p}/{n}_proj\"] {p}_{n}m = MatMul ({p}_n1, {})", w(&format!("w{n}"))));
        line(format!("[\"{p}/{n}_split\"] {p}_{n}r = Reshape ({p}_{n}m, {shape})"));
        line(format!("[\"{p}/{n}_heads\"] {p}_{n}t = Transpose <perm: ints = [0, 2, 1, 3]> ({p}_{n}r)"));
    }
    // Rotary embeddings on Q and K: x·cos + rotate_half(x)·sin.
    for n in ["q", "k"] {
        line(format!("[\"{p}/{n}_lo\"] {p}_{n}lo = Slice ({p}_{n}t, zero, half, last)"));
        line(format!("[\"{p}/{n}_hi\"] {p}_{n}hi = Slice ({p}_{n}t, half, end, last)"));
        line(format!("[\"{p}/{n}_neg\"] {p}_{n}ng = Neg ({p}_{n}hi)"));
        line(format!("[\"{p}/{n}_rot\"] {p}_{n}rh = Concat <axis: int = -1> ({p}_{n}ng, {p}_{n}lo)"));
        line(format!("[\"{p}/{n}_cos\"] {p}_{n}c = Mul ({p}_{n}t, rope_cos)"));
        line(format!("[\"{p}/{n}_sin\"] {p}_{n}s = Mul ({p}_{n}rh, rope_sin)"));
        line(format!("[\"{p}/{n}_rope\"] {p}_{n}e = Add ({p}_{n}c, {p}_{n}s)"));
    }
    // Grouped-query attention: each key/value head serves `rep` query heads.
    for n in ["k", "v"] {
        let src = if n == "k" { format!("{p}_ke") } else { format!("{p}_vt") };
        line(format!("[\"{p}/{n}_unsq\"] {p}_{n}u = Unsqueeze ({src}, rep_axis)"));
        line(format!("[\"{p}/{n}_expand\"] {p}_{n}x = Expand ({p}_{n}u, rep_shape)"));
        line(format!("[\"{p}/{n}_repeat\"] {p}_{n}f = Reshape ({p}_{n}x, full_shape)"));
    }
    line(format!("[\"{p}/k_transpose\"] {p}_kT = Transpose <perm: ints = [0, 1, 3, 2]> ({p}_kf)"));
    line(format!("[\"{p}/scores\"] {p}_sc = MatMul ({p}_qe, {p}_kT)"));
    line(format!("[\"{p}/scale\"] {p}_scs = Mul ({p}_sc, scale)"));
    line(format!("[\"{p}/mask\"] {p}_scm = Add ({p}_scs, causal_mask)"));
    line(format!("[\"{p}/softmax\"] {p}_pr = Softmax <axis: int = -1> ({p}_scm)"));
    line(format!("[\"{p}/context\"] {p}_ctx = MatMul ({p}_pr, {p}_vf)"));
    line(format!("[\"{p}/merge_heads\"] {p}_ctxt = Transpose <perm: ints = [0, 2, 1, 3]> ({p}_ctx)"));
    line(format!("[\"{p}/merge\"] {p}_ctxr = Reshape ({p}_ctxt, model_shape)"));
    line(format!("[\"{p}/o_proj\"] {p}_o = MatMul ({p}_ctxr, {})", w("wo")));
    line(format!("[\"{p}/residual1\"] {p}_r1 = Add ({x}, {p}_o)"));
    line(format!("[\"{p}/post_norm\"] {p}_n2 = RMSNormalization <axis: int = -1> ({p}_r1, {})", w("post_norm")));
    if moe {
        experts(&mut line, &p, &w);
        return;
    }
    line(format!("[\"{p}/gate_proj\"] {p}_g = MatMul ({p}_n2, {})", w("w_gate")));
    line(format!("[\"{p}/gate_sigmoid\"] {p}_gs = Sigmoid ({p}_g)"));
    line(format!("[\"{p}/gate_silu\"] {p}_ga = Mul ({p}_g, {p}_gs)"));
    line(format!("[\"{p}/up_proj\"] {p}_u = MatMul ({p}_n2, {})", w("w_up")));
    line(format!("[\"{p}/gate_up\"] {p}_gu = Mul ({p}_ga, {p}_u)"));
    line(format!("[\"{p}/down_proj\"] {p}_d = MatMul ({p}_gu, {})", w("w_down")));
    line(format!("[\"{p}/residual2\"] {p}_r2 = Add ({p}_r1, {p}_d)"));
}

/// Block `p`'s mixture of experts on `{p}_n2` (`[b, s, h]`), its output `{p}_r2`: the router
/// (GEMM, softmax, top-k, renormalised), then transformers' `batched_mm` experts as exported —
/// each token repeated `k` times, the gate-and-up and down weights gathered per routed pair,
/// batched products, SiLU gate, weighted sum over the `k`.
fn experts(line: &mut impl FnMut(String), p: &str, w: &dyn Fn(&str) -> String) {
    line(format!("[\"{p}/moe/tokens\"] {p}_mx = Reshape ({p}_n2, moe_tokens)"));
    line(format!("[\"{p}/moe/router\"] {p}_ml = MatMul ({p}_mx, {})", w("router")));
    line(format!("[\"{p}/moe/probs\"] {p}_mp = Softmax <axis: int = -1> ({p}_ml)"));
    line(format!("[\"{p}/moe/top_k\"] {p}_mv, {p}_mi = TopK <axis: int = -1> ({p}_mp, moe_k)"));
    line(format!("[\"{p}/moe/top_sum\"] {p}_ms = ReduceSum <keepdims: int = 1> ({p}_mv, moe_last)"));
    line(format!("[\"{p}/moe/weights\"] {p}_mw = Div ({p}_mv, {p}_ms)"));
    line(format!("[\"{p}/moe/repeat_unsq\"] {p}_mxu = Unsqueeze ({p}_mx, moe_one)"));
    line(format!("[\"{p}/moe/repeat\"] {p}_mxe = Expand ({p}_mxu, moe_tkh)"));
    line(format!("[\"{p}/moe/repeat_flat\"] {p}_mxr = Reshape ({p}_mxe, moe_rows)"));
    line(format!("[\"{p}/moe/ids\"] {p}_mif = Reshape ({p}_mi, moe_flat)"));
    line(format!("[\"{p}/moe/gather_gate_up\"] {p}_mg1 = Gather <axis: int = 0> ({}, {p}_mif)", w("experts_gate_up")));
    line(format!("[\"{p}/moe/col\"] {p}_mxc = Unsqueeze ({p}_mxr, moe_last)"));
    line(format!("[\"{p}/moe/gate_up\"] {p}_mh3 = MatMul ({p}_mg1, {p}_mxc)"));
    line(format!("[\"{p}/moe/gate_up_sq\"] {p}_mh = Squeeze ({p}_mh3, moe_last)"));
    line(format!("[\"{p}/moe/chunk\"] {p}_mga, {p}_mup = Split <axis: int = 1, num_outputs: int = 2> ({p}_mh)"));
    line(format!("[\"{p}/moe/sigmoid\"] {p}_msg = Sigmoid ({p}_mga)"));
    line(format!("[\"{p}/moe/silu\"] {p}_msi = Mul ({p}_mga, {p}_msg)"));
    line(format!("[\"{p}/moe/gated\"] {p}_ma = Mul ({p}_msi, {p}_mup)"));
    line(format!("[\"{p}/moe/gather_down\"] {p}_mg2 = Gather <axis: int = 0> ({}, {p}_mif)", w("experts_down")));
    line(format!("[\"{p}/moe/acol\"] {p}_mac = Unsqueeze ({p}_ma, moe_last)"));
    line(format!("[\"{p}/moe/down\"] {p}_mo3 = MatMul ({p}_mg2, {p}_mac)"));
    line(format!("[\"{p}/moe/down_sq\"] {p}_mo = Squeeze ({p}_mo3, moe_last)"));
    line(format!("[\"{p}/moe/wflat\"] {p}_mwf = Reshape ({p}_mw, moe_flat)"));
    line(format!("[\"{p}/moe/wcol\"] {p}_mwc = Unsqueeze ({p}_mwf, moe_last)"));
    line(format!("[\"{p}/moe/weighted\"] {p}_mpw = Mul ({p}_mo, {p}_mwc)"));
    line(format!("[\"{p}/moe/pairs\"] {p}_mz = Reshape ({p}_mpw, moe_tkh)"));
    line(format!("[\"{p}/moe/sum\"] {p}_my = ReduceSum <keepdims: int = 0> ({p}_mz, moe_one)"));
    line(format!("[\"{p}/moe/back\"] {p}_d = Reshape ({p}_my, model_shape)"));
    line(format!("[\"{p}/residual2\"] {p}_r2 = Add ({p}_r1, {p}_d)"));
}
