//! The shape of a transformer as Megatron-LM's arguments name it, read from the graph:
//! layers, hidden size, heads and key-value groups, FFN size, sequence, vocabulary,
//! normalization, activation, position embedding, biases, tied embeddings.
//!
//! Read from what every exporter keeps: the embedding tables (`Gather` of a parameter by
//! integer ids), the attention's scores (`Softmax` over `[batch, heads, query, key]`, or an
//! `Attention` op), the GEMMs' weights, and the op types of the norms and activations. What
//! cannot be read is listed, so that the export says which arguments the user must add.

use std::collections::BTreeSet;

use ir::cost::is_param;
use ir::{Graph, NodeId, Op, Value};

/// A transformer's shape, each field when the graph says it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelShape {
    /// Transformer layers (attention blocks).
    pub layers: Option<usize>,
    /// Hidden size (the token embedding's width).
    pub hidden: Option<i64>,
    /// Attention heads.
    pub heads: Option<i64>,
    /// Key-value heads, when fewer than `heads` (grouped-query attention).
    pub kv_heads: Option<i64>,
    /// The MLP's inner width.
    pub ffn: Option<i64>,
    /// Tokens per sample.
    pub seq: Option<i64>,
    /// Token-embedding rows.
    pub vocab: Option<i64>,
    /// The rows of a learned position embedding (`None`: rotary or none).
    pub learned_positions: Option<i64>,
    /// Rotary position embedding (the `rotate_half` pattern: `Neg` feeding a `Concat`, or `Sin`/`Cos`).
    pub rope: bool,
    /// `LayerNorm` or `RMSNorm`.
    pub norm: Option<&'static str>,
    /// A gated SiLU MLP (`x·σ(x) ⊙ up`), else GELU when seen.
    pub swiglu: bool,
    /// GELU seen (`Gelu`, or `Erf`/`Tanh` of the MLP).
    pub gelu: bool,
    /// Some GEMM of the layers adds a bias.
    pub linear_bias: bool,
    /// Only the attention's input projections (q, k, v) add one (Qwen2).
    pub qkv_bias_only: bool,
    /// The output projection reads the token embedding's table.
    pub tied: bool,
    /// Experts per mixture of experts (`MoE` ops), when the MLPs are mixtures.
    pub experts: Option<i64>,
    /// Experts each token is routed to.
    pub top_k: Option<i64>,
}

fn dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(|t| t.static_dims())
}

/// Whether op `n` is a layer's attention: a fused `Attention`, or a `Softmax` that is not a
/// mixture's router (which normalises its `[tokens, experts]` logits for a `TopK`).
pub fn attention_layer(g: &Graph, n: NodeId) -> bool {
    match g.node(n).op {
        Op::Attention(_) => true,
        Op::Softmax(_) => !g.users(Value::new(n, 0)).iter().any(|(u, _)| matches!(g.node(*u).op, Op::TopK(_))),
        _ => false,
    }
}

/// A GEMM reading a parameter weight: `(node, [in, out], bias)`.
fn gemm(g: &Graph, n: NodeId) -> Option<(i64, i64, bool)> {
    let node = g.node(n);
    let w = node.input(1).filter(|w| is_param(g, *w))?;
    let d = dims(g, w)?;
    let [a, b] = d[..] else { return None };
    match &node.op {
        Op::MatMul(_) => {
            let bias = g.users(Value::new(n, 0)).iter().any(|(u, _)| {
                matches!(g.node(*u).op, Op::Add(_)) && g.node(*u).inputs().iter().flatten().any(|v| is_param(g, *v))
            });
            Some((a, b, bias))
        }
        Op::Gemm(gm) if gm.trans_b() == 0 => Some((a, b, node.input(2).is_some())),
        Op::Gemm(_) => Some((b, a, node.input(2).is_some())),
        _ => None,
    }
}

/// The shape of graph `g`'s transformer.
pub fn model_shape(g: &Graph) -> ModelShape {
    let mut s = ModelShape::default();
    let order = g.topo_order().unwrap_or_default();
    // Embedding tables, in model order: the first is the tokens', a second the positions'.
    let mut tables: Vec<(Value, i64, i64, Option<i64>)> = Vec::new();
    let mut attention: Vec<NodeId> = Vec::new();
    let mut gemms: Vec<(NodeId, i64, i64, bool)> = Vec::new();
    let mut ops: BTreeSet<&str> = BTreeSet::new();
    for &n in &order {
        let node = g.node(n);
        ops.insert(node.op.op_type());
        match &node.op {
            Op::Gather(_) => {
                if let (Some(t), Some(ids)) = (node.input(0), node.input(1))
                    && is_param(g, t)
                    && let Some([rows, width]) = dims(g, t).as_deref().and_then(|d| <[i64; 2]>::try_from(d).ok())
                {
                    let seq = dims(g, ids).and_then(|d| d.last().copied());
                    tables.push((t, rows, width, seq));
                }
            }
            _ if attention_layer(g, n) => attention.push(n),
            Op::MoE(_) => {
                // X, ids [T, k], w, W1 [E, 2I, H], W2 [E, H, I].
                let d = |i: usize| node.input(i).and_then(|v| dims(g, v)).unwrap_or_default();
                s.experts = d(3).first().copied();
                s.top_k = d(1).get(1).copied();
                s.ffn = d(4).get(2).copied();
            }
            _ => {
                if let Some((i, o, b)) = gemm(g, n) {
                    gemms.push((n, i, o, b));
                }
            }
        }
    }
    if let Some(&(table, rows, width, seq)) = tables.first() {
        s.vocab = Some(rows);
        s.hidden = Some(width);
        s.seq = seq;
        s.tied = g.users(table).iter().any(|(u, _)| !matches!(g.node(*u).op, Op::Gather(_)));
        s.learned_positions = tables.get(1).filter(|t| t.2 == width).map(|t| t.1);
    }
    if tables.is_empty() {
        // A graph that starts from the hidden state (`[batch, sequence, hidden]`) and ends in
        // logits (`[batch, sequence, vocabulary]`).
        let first = g.inputs().iter().find_map(|&n| dims(g, Value::new(n, 0)).filter(|d| d.len() == 3));
        if let Some(d) = first {
            s.seq = Some(d[1]);
            s.hidden = Some(d[2]);
        }
        s.vocab = g
            .outputs()
            .first()
            .and_then(|o| dims(g, o.value))
            .filter(|d| d.len() == 3)
            .map(|d| d[2])
            .filter(|v| Some(*v) != s.hidden);
        s.tied = false;
    }
    s.layers = (!attention.is_empty()).then_some(attention.len());
    s.heads = attention.first().and_then(|&n| heads_of(g, n));
    if let (Some(h), Some(heads)) = (s.hidden, s.heads) {
        let d = h / heads.max(1);
        // Down projection: [F, H]. The narrowest GEMM out of the hidden state other than the
        // MLP's is k_proj/v_proj (KV·d); a fused QKV is H + 2·KV·d wide.
        if s.experts.is_none() {
            s.ffn = gemms.iter().filter(|g| g.2 == h && g.1 != h).map(|g| g.1).max();
        }
        let widths: Vec<i64> = gemms
            .iter()
            .filter(|g| g.1 == h && Some(g.2) != s.ffn && g.2 != 2 * s.ffn.unwrap_or(0) && g.2 != s.vocab.unwrap_or(0))
            // (Nor a mixture's router, `[H, experts]`.)
            .filter(|g| Some(g.2) != s.experts)
            .map(|g| g.2)
            .collect();
        let kv = match widths.iter().min() {
            Some(&w) if w < h && w % d == 0 => Some(w / d),
            Some(&w) if w > h && (w - h) % (2 * d) == 0 => Some((w - h) / (2 * d)),
            _ => None,
        };
        s.kv_heads = kv.filter(|&kv| kv < heads && kv > 0);
    }
    s.linear_bias = gemms.iter().any(|g| g.3);
    // The attention's input projections: GEMMs whose input a key/value projection (KV·d
    // wide) also reads, or a fused QKV (H + 2·KV·d wide).
    if let (Some(h), Some(heads), Some(kv)) = (s.hidden, s.heads, s.kv_heads) {
        let kvw = kv * (h / heads.max(1));
        let is_qkv = |gm: &(NodeId, i64, i64, bool)| {
            gm.2 == h + 2 * kvw
                || g.node(gm.0)
                    .input(0)
                    .is_some_and(|x| gemms.iter().any(|o| o.2 == kvw && g.node(o.0).input(0) == Some(x)))
        };
        s.qkv_bias_only = s.linear_bias && gemms.iter().filter(|gm| gm.3).all(is_qkv);
    }
    s.rope = ops.contains("Sin") && ops.contains("Cos") || rotate_half(g, &order);
    s.norm = if ops.contains("LayerNormalization") {
        Some("LayerNorm")
    } else if ops.contains("RMSNormalization") || ops.contains("SimplifiedLayerNormalization") || rms_pattern(g, &order)
    {
        Some("RMSNorm")
    } else {
        None
    };
    // (A mixture's experts are SiLU-gated: the `MoE` op.)
    s.swiglu = ops.contains("Sigmoid") && !ops.contains("Gelu") || ops.contains("Swish") || ops.contains("MoE");
    s.gelu = ops.contains("Gelu") || ops.contains("Erf") || ops.contains("Tanh") && !s.swiglu;
    s
}

/// Heads of an attention: an `Attention` op's `q_num_heads`, else dim 1 of the scores a
/// `Softmax` normalises (`[batch, heads, query, key]`).
fn heads_of(g: &Graph, n: NodeId) -> Option<i64> {
    match &g.node(n).op {
        Op::Attention(a) => a.q_num_heads.filter(|h| *h > 0).or_else(|| {
            let d = dims(g, g.node(n).input(0)?)?;
            (d.len() == 4).then(|| d[1])
        }),
        _ => {
            let d = dims(g, Value::new(n, 0))?;
            (d.len() == 4).then(|| d[1])
        }
    }
}

/// `rotate_half`: a `Neg` whose output a `Concat` joins (`cat(-x2, x1)`).
fn rotate_half(g: &Graph, order: &[NodeId]) -> bool {
    order.iter().any(|&n| {
        matches!(g.node(n).op, Op::Neg(_))
            && g.users(Value::new(n, 0)).iter().any(|(u, _)| matches!(g.node(*u).op, Op::Concat(_)))
    })
}

/// RMSNorm written out: a `ReduceMean` of a square (`Pow(x, 2)` or `x·x`) whose input no mean
/// was subtracted from.
fn rms_pattern(g: &Graph, order: &[NodeId]) -> bool {
    order.iter().any(|&n| {
        let node = g.node(n);
        if !matches!(node.op, Op::ReduceMean(_)) {
            return false;
        }
        let Some(sq) = node.input(0) else { return false };
        let sqn = g.node(sq.node);
        let x = match &sqn.op {
            Op::Pow(_) => sqn.input(0),
            Op::Mul(_) if sqn.input(0) == sqn.input(1) => sqn.input(0),
            _ => None,
        };
        x.is_some_and(|x| !matches!(g.node(x.node).op, Op::Sub(_)))
    })
}
