//! What an op computes from pieces of its inputs, stated once per op family for the prover
//! (independently of how the lowering chose to split it).
//!
//! Each rule builds its output terms from its input terms alone (never from their boxes), so
//! a device's op and the global op meet in one term; it derives the boxes the outputs hold
//! from the boxes the inputs hold, and refuses inputs whose boxes do not determine the op's
//! output (a softmax over part of its axis, a product whose operands hold different parts of
//! the contracted dim). A reduction over part of its range gives a partial value
//! ([`Share`]), which only linear ops may carry on.

use ir::eval::Array;
use ir::op::{self as o, Op};
use ir::{DType, Graph, NodeId, Value};

use super::term::{Fact, Head, Region, Share, TermId, Terms, add_shares, extents, whole};

/// Why a rule gives no fact.
#[derive(Clone, Debug, PartialEq)]
pub enum Why {
    /// The inputs' pieces do not make the op's output any piece of the value it stands for:
    /// the program is wrong (or the prover cannot see why it is right).
    Wrong(String),
    /// The prover has no rule for this op on these pieces.
    Uncovered(String),
}

pub(super) type Out = Result<Vec<Option<Fact>>, Why>;

pub(super) fn wrong<T>(m: impl Into<String>) -> Result<T, Why> {
    Err(Why::Wrong(m.into()))
}

/// The key of an op in terms: its domain, type and attributes, without the attributes that
/// hold a device's local shapes.
pub fn op_key(op: &Op) -> String {
    let mut op = op.clone();
    if let Some(a) = ir::ops::split::output_shape_attr(&mut op) {
        *a = None;
    }
    format!("{}.{}|{:?}", op.domain(), op.op_type(), op.attributes())
}

/// The key of a literal: type, shape and values.
pub fn const_key(a: &Array) -> String {
    use std::hash::{Hash, Hasher};
    let vals = a.to_f64().unwrap_or_default();
    let body = if vals.len() <= 16 {
        format!("{vals:?}")
    } else {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for v in &vals {
            v.to_bits().hash(&mut h);
        }
        format!("#{:016x}", h.finish())
    };
    format!("{:?}{:?}{body}", a.dtype, a.shape)
}

/// The rule context: the terms, and the graph being interpreted.
pub struct Cx<'a> {
    pub terms: &'a mut Terms,
    pub g: &'a Graph,
    /// Interpreting the graph itself (whole values), not a device's program.
    pub global: bool,
}

impl Cx<'_> {
    pub(super) fn out_dims(&self, n: NodeId, slot: usize) -> Option<Vec<i64>> {
        self.g.tensor_type(Value::new(n, slot as u16)).and_then(|t| t.static_dims())
    }

    fn constant(&self, v: Option<Value>) -> Option<Array> {
        ir::ops::constant_value(self.g, v?, 8)
    }

    fn ints(&self, v: Option<Value>) -> Option<Vec<i64>> {
        let a = self.constant(v)?;
        Some(a.to_f64().ok()?.into_iter().map(|x| x as i64).collect())
    }

    /// The term of a literal.
    pub fn literal(&mut self, a: &Array) -> TermId {
        let shape: Vec<i64> = a.shape.iter().map(|&d| d as i64).collect();
        let small = a.shape.iter().product::<usize>() <= 4096;
        self.terms.constant(const_key(a), &shape, small.then_some(a))
    }

    fn pointwise_term(&mut self, op: &Op, slot: u16, ins: &[TermId]) -> TermId {
        let shape = broadcast(&ins.iter().map(|&t| self.terms.shape(t).to_vec()).collect::<Vec<_>>());
        self.terms.op(&op_key(op), slot, ins, &shape)
    }

    fn reduce_term(&mut self, kind: &str, x: TermId, axes: &[usize], keep: bool) -> TermId {
        let shape = reduced_shape(self.terms.shape(x), axes, keep);
        self.terms.op(&reduce_key(kind, axes, keep), 0, &[x], &shape)
    }
}

fn reduce_key(kind: &str, axes: &[usize], keep: bool) -> String {
    format!(".{kind}|axes={axes:?}|keep={keep}")
}

fn reduced_shape(s: &[i64], axes: &[usize], keep: bool) -> Vec<i64> {
    s.iter().enumerate().filter_map(|(i, &d)| if axes.contains(&i) { keep.then_some(1) } else { Some(d) }).collect()
}

/// Numpy broadcasting of shapes.
pub fn broadcast(shapes: &[Vec<i64>]) -> Vec<i64> {
    let r = shapes.iter().map(Vec::len).max().unwrap_or(0);
    (0..r)
        .map(|i| {
            shapes
                .iter()
                .filter_map(|s| (i + s.len()).checked_sub(r).map(|j| s[j]))
                .fold(1, |a, d| if d != 1 { d } else { a })
        })
        .collect()
}

/// The box of a broadcast output held by pieces of its inputs; `None` where the inputs hold
/// different parts of one output dim.
fn broadcast_region(terms: &Terms, facts: &[&Fact], out: &[i64]) -> Result<Region, Why> {
    let r = out.len();
    let mut region: Vec<Option<(i64, i64)>> = vec![None; r];
    // Pieces with one box first; a literal piece that equals several boxes then takes the
    // one the others hold.
    let mut order: Vec<&&Fact> = facts.iter().collect();
    order.sort_by_key(|f| !f.alts.is_empty());
    for f in order {
        let s = terms.shape(f.term);
        let off = r - s.len();
        let fixed: Vec<Option<(i64, i64)>> = region.clone();
        let choice = std::iter::once(&f.region)
            .chain(&f.alts)
            .find(|reg| (0..s.len()).all(|j| s[j] != out[off + j] || fixed[off + j].is_none_or(|x| x == reg[j])));
        let Some(reg) = choice else {
            return wrong(format!(
                "operands hold different parts: {} holds {:?}, the others {:?}",
                terms.describe(f.term),
                f.region,
                fixed.iter().map(|x| x.unwrap_or((0, 0))).collect::<Vec<_>>()
            ));
        };
        for j in 0..s.len() {
            if s[j] == out[off + j] {
                region[off + j] = Some(reg[j]);
            } else if reg[j] != (0, 1) {
                return wrong(format!("a broadcast operand {} holds {:?}", terms.describe(f.term), reg));
            }
        }
    }
    Ok(region.into_iter().zip(out).map(|(x, &d)| x.unwrap_or((0, d.min(1)))).collect())
}

/// Applies op `n` of `cx.g` to its input facts.
pub fn apply(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let op = &node.op;
    match op {
        Op::Identity(_) => Ok(vec![ins.first().cloned().flatten()]),
        Op::MatMul(_) => matmul(cx, n, ins),
        Op::Attention(a) => super::attention::apply(cx, n, a, ins),
        Op::AttentionBlock(a) => super::flash::block(cx, a, ins),
        Op::AttentionGrad(a) => super::flash::grad(cx, n, a, ins),
        Op::Add(_) if disjoint_sum(ins).is_some() => Ok(vec![disjoint_sum(ins)]),
        Op::Gemm(gm) => gemm(cx, gm, ins),
        _ if op.class() == ir::OpClass::Reduce => reduce(cx, n, ins),
        Op::Conv(_) | Op::ConvTranspose(_) | Op::ConvGradInput(_) | Op::ConvGradWeight(_) => {
            super::conv::apply(cx, n, ins)
        }
        Op::InstanceNormalization(_) => super::conv::instance_norm(cx, n, ins),
        Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) => super::recurrent::apply(cx, n, ins),
        Op::MaxPool(_)
        | Op::AveragePool(_)
        | Op::GlobalAveragePool(_)
        | Op::GlobalMaxPool(_)
        | Op::MaxPoolGrad(_)
        | Op::AveragePoolGrad(_) => super::conv::per_channel(cx, n, ins),
        Op::Transpose(t) => transpose(cx, op, t.perm.clone(), ins),
        Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze(_) | Op::Unsqueeze(_) => view(cx, n, ins),
        Op::Softmax(s) => softmax(cx, n, s.axis, false, ins),
        Op::LogSoftmax(s) => softmax(cx, n, s.axis, true, ins),
        Op::Expand(_) => expand(cx, n, ins),
        Op::Pad(_) | Op::Tile(_) | Op::Resize(_) => super::shape::apply(cx, n, ins),
        Op::SliceGrad(_) => slice_grad(cx, n, ins),
        Op::Split(sp) => split(cx, n, sp.axis.unwrap_or(0), ins),
        Op::RMSNormalization(r) => trailing_rows(cx, n, r.axis.unwrap_or(-1), ins),
        Op::SoftmaxGrad(s) => rowwise(cx, op, &s.axes.clone().unwrap_or_default(), ins),
        Op::Gather(gt) => gather(cx, n, op, gt.axis.unwrap_or(0), ins),
        Op::TopK(t) => super::experts::topk(cx, n, t.axis.unwrap_or(-1), ins),
        Op::MoERoute(_) => super::dispatch::route(cx, n, ins),
        Op::MoEDispatch(_) => super::dispatch::scatter(cx, n, ins),
        Op::MoECombine(_) => super::dispatch::combine(cx, n, ins),
        Op::MoE(_) => super::experts::apply(cx, n, false, ins),
        Op::MoEGrad(_) => super::experts::apply(cx, n, true, ins),
        Op::Where(_) => match ins {
            [Some(c), Some(x), Some(z)] if x.is_exact() => match super::vocab::completed(cx, c, x, z) {
                Some(f) => Ok(vec![Some(f)]),
                None => pointwise_rule(cx, n, ins),
            },
            _ => pointwise_rule(cx, n, ins),
        },
        Op::Slice(_) => slice(cx, n, ins),
        Op::Concat(c) => concat(cx, op, c.axis.unwrap_or(0), ins),
        Op::Mul(_) | Op::Div(_) if scalar_operand(cx, n, ins).is_some() => {
            let (j, c) = scalar_operand(cx, n, ins).expect("checked");
            let f = ins[1 - j].clone().expect("an operand");
            let c = if matches!(op, Op::Div(_)) { 1.0 / c } else { c };
            if c == 0.0 {
                // Zero times a value: the value as a site of a sum, held by none; zero times a
                // partial sum of one reduction: none of that reduction held (as the devices
                // that keep theirs name it).
                let mut shares = f.shares.clone();
                match shares.as_mut_slice() {
                    [one] => one.held.clear(),
                    _ => shares.push(Share { held: Vec::new(), ..held_whole(f.term) }),
                }
                return Ok(vec![Some(Fact { shares, ..f })]);
            }
            // A scaled literal is the literal of the scaled values.
            if f.is_exact()
                && f.region == whole(cx.terms.shape(f.term))
                && let Some(a) = cx.terms.value(f.term).cloned()
                && let Ok(v) = a.to_f64()
            {
                let b = Array::float(a.dtype, a.shape.clone(), v.iter().map(|x| x * c).collect());
                if !a.dtype.is_int() {
                    let t = cx.literal(&b);
                    return Ok(vec![Some(Fact::whole(cx.terms, t))]);
                }
            }
            Ok(vec![Some(Fact { term: cx.terms.scaled(f.term, c), ..f })])
        }
        _ if pointwise(op) => pointwise_rule(cx, n, ins),
        _ => whole_rule(cx, n, ins),
    }
}

/// Ops that compute each output element from the same element of their (broadcast) inputs.
pub fn pointwise(op: &Op) -> bool {
    use ir::OpClass::*;
    matches!(op.class(), Unary | Binary | Variadic)
        || matches!(op, Op::SgdUpdate(_) | Op::AdamUpdate(_) | Op::ElementwiseGrad(_) | Op::Where(_))
}

/// A product with (or quotient by) a scalar literal: the literal's operand and value.
fn scalar_operand(cx: &Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Option<(usize, f64)> {
    let node = cx.g.node(n);
    let div = matches!(node.op, Op::Div(_));
    let cands: &[usize] = if div { &[1] } else { &[1, 0] };
    for &j in cands {
        let (Some(f), Some(other)) = (ins.get(j).and_then(Option::as_ref), ins.get(1 - j).and_then(Option::as_ref))
        else {
            continue;
        };
        // A whole literal of one element (not a one-element piece of a larger one).
        let shape = cx.terms.shape(f.term);
        if !f.is_exact() || f.region != whole(shape) || shape.iter().product::<i64>() != 1 {
            continue;
        }
        let Some(a) = cx.terms.value(f.term) else { continue };
        if a.dtype.is_int() || a.dtype == DType::Bool {
            continue;
        }
        let Some(&c) = a.to_f64().ok().as_ref().and_then(|v| v.first()) else { continue };
        // The product keeps the other operand's shape.
        if cx.out_dims(n, 0).as_deref() == Some(&extents(&other.region)[..]) {
            return Some((j, c));
        }
    }
    None
}

/// Linear ops carry partial sums: a sum of partial values, or a partial value times (or over)
/// exact ones.
fn linear_shares(op: &Op, ins: &[&Fact]) -> Result<Vec<Share>, Why> {
    let partial: Vec<usize> = (0..ins.len()).filter(|&i| !ins[i].is_exact()).collect();
    if partial.is_empty() {
        return Ok(Vec::new());
    }
    let name = op.op_type();
    match op {
        Op::Add(_) | Op::Sub(_) | Op::Sum(_) => {
            // An exact operand of a partial sum is its own site, held whole: the devices that
            // are to add it once hold it, the others hold it times zero.
            let mut s = Vec::new();
            for f in ins {
                let own = if f.is_exact() { vec![held_whole(f.term)] } else { f.shares.clone() };
                s = add_shares(&s, &own).map_err(Why::Wrong)?;
            }
            Ok(s)
        }
        Op::Mul(_) if partial.len() == 1 => Ok(ins[partial[0]].shares.clone()),
        Op::Div(_) if partial == [0] => Ok(ins[0].shares.clone()),
        Op::Neg(_) | Op::Cast(_) => Ok(ins[0].shares.clone()),
        _ => wrong(format!("a partial sum reaches {name}, which is not linear: a reduction is missing before it")),
    }
}

/// `t` as a site of a sum, held whole.
fn held_whole(t: TermId) -> Share {
    Share { site: t, space: vec![1], held: vec![vec![(0, 1)]], max: false }
}

fn present(ins: &[Option<Fact>]) -> Vec<&Fact> {
    ins.iter().flatten().collect()
}

fn pointwise_rule(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let facts = present(ins);
    let terms: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let shares = linear_shares(&node.op, &facts)?;
    let shape = broadcast(&terms.iter().map(|&t| cx.terms.shape(t).to_vec()).collect::<Vec<_>>());
    let region = broadcast_region(cx.terms, &facts, &shape)?;
    let mut out = Vec::new();
    for slot in 0..node.num_outputs() {
        let t = cx.pointwise_term(&node.op, slot as u16, &terms);
        out.push(Some(Fact { term: t, region: region.clone(), shares: shares.clone(), alts: Vec::new() }));
    }
    Ok(out)
}

/// `a + b` of two partial sums of one value over disjoint parts of one reduction (each held
/// the same way on any other): the sum over both parts — the value itself when they complete
/// it (ring attention's gradients, summed block by block).
fn disjoint_sum(ins: &[Option<Fact>]) -> Option<Fact> {
    let [Some(a), Some(b)] = ins else { return None };
    if a.term != b.term || a.region != b.region || a.shares.len() != b.shares.len() || a.is_exact() {
        return None;
    }
    let mut shares = a.shares.clone();
    let mut joined = false;
    for (x, y) in shares.iter_mut().zip(&b.shares) {
        if x.site != y.site || x.space != y.space || x.max || y.max {
            return None;
        }
        if x.held == y.held {
            continue;
        }
        if joined || x.held.iter().any(|h| y.held.iter().any(|k| super::term::overlap(h, k))) {
            return None;
        }
        x.held.extend(y.held.iter().cloned());
        joined = true;
    }
    shares.retain(|s| !s.complete());
    joined.then(|| Fact { term: a.term, region: a.region.clone(), shares, alts: Vec::new() })
}

/// Any op on whole, exact inputs computes its whole output.
pub fn whole_rule(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let mut terms = Vec::new();
    for f in ins.iter().flatten() {
        if !f.is_exact() {
            return wrong(format!("a partial sum reaches {}, which is not linear", node.op.op_type()));
        }
        let Some(w) = f.at(&whole(cx.terms.shape(f.term))) else {
            return Err(Why::Uncovered(format!(
                "{} on a part {:?} of {}: no rule for this op on parts",
                node.op.op_type(),
                f.region,
                cx.terms.describe(f.term)
            )));
        };
        terms.push(w.term);
    }
    let key = op_key(&node.op);
    let mut out = Vec::new();
    for slot in 0..node.num_outputs() {
        let Some(shape) = cx.out_dims(n, slot) else {
            out.push(None);
            continue;
        };
        let t = cx.terms.op(&key, slot as u16, &terms, &shape);
        out.push(Some(Fact::whole(cx.terms, t)));
    }
    Ok(out)
}

fn two<'a>(ins: &'a [Option<Fact>], what: &str) -> Result<(&'a Fact, &'a Fact), Why> {
    match (ins.first().and_then(Option::as_ref), ins.get(1).and_then(Option::as_ref)) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(Why::Uncovered(format!("{what} without its two operands"))),
    }
}

/// `[.., M, K] × [.., K, N]`: batch dims broadcast, K held alike by both operands; a part of K
/// gives a partial sum.
fn matmul(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let (a, b) = two(ins, "MatMul")?;
    let (sa, sb) = (cx.terms.shape(a.term).to_vec(), cx.terms.shape(b.term).to_vec());
    if sa.len() < 2 || sb.len() < 2 {
        return whole_rule(cx, n, ins);
    }
    if !a.is_exact() && !b.is_exact() {
        return wrong("a product of two partial sums");
    }
    let batch = broadcast(&[sa[..sa.len() - 2].to_vec(), sb[..sb.len() - 2].to_vec()]);
    let (ka, kb) = (a.region[sa.len() - 1], b.region[sb.len() - 2]);
    if ka != kb {
        return wrong(format!("MatMul operands hold different parts of the contracted dim: {ka:?} and {kb:?}"));
    }
    let batch_region =
        broadcast_region_shapes(&[(&sa[..sa.len() - 2], &a.region), (&sb[..sb.len() - 2], &b.region)], &batch)?;
    let mut shape = batch.clone();
    shape.extend([sa[sa.len() - 2], sb[sb.len() - 1]]);
    let t = cx.terms.op(&op_key(&Op::MatMul(o::MatMul::default())), 0, &[a.term, b.term], &shape);
    let mut region = batch_region;
    region.extend([a.region[sa.len() - 2], b.region[sb.len() - 1]]);
    let mut shares = if a.is_exact() { b.shares.clone() } else { a.shares.clone() };
    let k = sa[sa.len() - 1];
    if ka != (0, k) {
        shares.push(Share { site: t, space: vec![k], held: vec![vec![ka]], max: false });
    }
    Ok(vec![Some(Fact { term: t, region, shares, alts: Vec::new() })])
}

fn broadcast_region_shapes(parts: &[(&[i64], &Region)], out: &[i64]) -> Result<Region, Why> {
    let r = out.len();
    let mut region: Vec<Option<(i64, i64)>> = vec![None; r];
    for (s, reg) in parts {
        let off = r - s.len();
        for j in 0..s.len() {
            if s[j] == out[off + j] {
                if region[off + j].is_some_and(|x| x != reg[j]) {
                    return wrong("MatMul operands hold different parts of a batch dim");
                }
                region[off + j] = Some(reg[j]);
            }
        }
    }
    Ok(region.into_iter().zip(out).map(|(x, &d)| x.unwrap_or((0, d.min(1)))).collect())
}

/// `alpha·A'·B' + beta·C`: M from A, N from B, K alike; the bias is one more term of the
/// sum (a device that leaves it out holds a partial sum without it).
fn gemm(cx: &mut Cx<'_>, gm: &o::Gemm, ins: &[Option<Fact>]) -> Out {
    let (a, b) = two(ins, "Gemm")?;
    if !a.is_exact() || !b.is_exact() {
        return wrong("a partial sum reaches Gemm");
    }
    let (ta, tb) = (gm.trans_a.unwrap_or(0) != 0, gm.trans_b.unwrap_or(0) != 0);
    let (sa, sb) = (cx.terms.shape(a.term).to_vec(), cx.terms.shape(b.term).to_vec());
    let (m_dim, ka_dim) = if ta { (1, 0) } else { (0, 1) };
    let (kb_dim, n_dim) = if tb { (1, 0) } else { (0, 1) };
    if a.region[ka_dim] != b.region[kb_dim] {
        return wrong(format!(
            "Gemm operands hold different parts of the contracted dim: {:?} and {:?}",
            a.region[ka_dim], b.region[kb_dim]
        ));
    }
    let shape = vec![sa[m_dim], sb[n_dim]];
    let region: Region = vec![a.region[m_dim], b.region[n_dim]];
    let key = op_key(&Op::Gemm(gm.clone()));
    let c = ins.get(2).and_then(Option::as_ref);
    let k = sa[ka_dim];
    let with_bias = |cx: &Cx<'_>| {
        // The global Gemm these operands belong to has a bias this device leaves out.
        cx.terms.users(a.term).iter().copied().find(|&u| {
            matches!(cx.terms.head(u), Head::Op { key: kk, slot: 0 } if *kk == key)
                && cx.terms.inputs(u).len() == 3
                && cx.terms.inputs(u)[..2] == [a.term, b.term]
        })
    };
    let (t, bias_global, bias_here) = match c {
        Some(c) => {
            if !c.is_exact() {
                return wrong("a partial sum as Gemm's bias");
            }
            let cs = cx.terms.shape(c.term).to_vec();
            let creg = broadcast_region(cx.terms, &[c], &shape)
                .map_err(|_| Why::Wrong(format!("Gemm's bias holds {:?}", c.region)))?;
            // Each dim the bias has at full size holds the product's part; a broadcast one (a
            // `[M, 1]` or `[1]` bias) holds its single row, which `broadcast_region` checks.
            let off = shape.len().saturating_sub(cs.len());
            if (0..cs.len()).any(|j| cs[j] == shape[off + j] && creg[off + j] != region[off + j]) {
                return wrong(format!("Gemm's bias holds {:?}, the product {region:?}", c.region));
            }
            (cx.terms.op(&key, 0, &[a.term, b.term, c.term], &shape), true, true)
        }
        None => match with_bias(cx) {
            Some(t) => (t, true, false),
            None => (cx.terms.op(&key, 0, &[a.term, b.term], &shape), false, false),
        },
    };
    let mut held = vec![vec![a.region[ka_dim]]];
    if bias_here {
        held.push(vec![(k, k + 1)]);
    }
    let space = vec![k + i64::from(bias_global)];
    let share = Share { site: t, space, held, max: false };
    let shares = if share.complete() { Vec::new() } else { vec![share] };
    Ok(vec![Some(Fact { term: t, region, shares, alts: Vec::new() })])
}

/// The axes a reduction node reduces (attribute or input), normalized; and keepdims.
fn reduce_axes(cx: &Cx<'_>, n: NodeId, rank: usize) -> Option<(Vec<usize>, bool)> {
    let node = cx.g.node(n);
    let attrs = node.op.attributes();
    let int = |name: &str| {
        attrs
            .iter()
            .find(|a| a.name == name)
            .and_then(|a| if let ir::attr::AttrValue::Int(v) = a.value { Some(v) } else { None })
    };
    let attr = attrs
        .iter()
        .find(|a| a.name == "axes")
        .and_then(|a| if let ir::attr::AttrValue::Ints(v) = &a.value { Some(v.clone()) } else { None });
    let given = match attr {
        Some(a) => Some(a),
        None if node.input(1).is_some() => Some(cx.ints(node.input(1))?),
        None => None,
    };
    let axes: Vec<usize> = match given {
        Some(a) if !a.is_empty() => a.iter().map(|&x| if x < 0 { x + rank as i64 } else { x } as usize).collect(),
        _ if int("noop_with_empty_axes").unwrap_or(0) != 0 => Vec::new(),
        _ => (0..rank).collect(),
    };
    let mut axes = axes;
    axes.sort_unstable();
    axes.dedup();
    Some((axes, int("keepdims").unwrap_or(1) != 0))
}

fn reduce(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let Some(x) = ins.first().and_then(Option::as_ref) else { return whole_rule(cx, n, ins) };
    let shape = cx.terms.shape(x.term).to_vec();
    let Some((axes, keep)) = reduce_axes(cx, n, shape.len()) else {
        return Err(Why::Uncovered("a reduction whose axes are not literals".into()));
    };
    let kind = node.op.op_type().to_string();
    let max = matches!(node.op, Op::ReduceMax(_) | Op::ReduceMin(_));
    if !x.is_exact() && !matches!(node.op, Op::ReduceSum(_) | Op::ReduceMean(_)) {
        return wrong(format!("a partial sum reaches {kind}"));
    }
    let t = cx.reduce_term(&kind, x.term, &axes, keep);
    let region: Region = x
        .region
        .iter()
        .enumerate()
        .filter_map(|(i, &r)| if axes.contains(&i) { keep.then_some((0, 1)) } else { Some(r) })
        .collect();
    let held: Region = axes.iter().map(|&i| x.region[i]).collect();
    let space: Vec<i64> = axes.iter().map(|&i| shape[i]).collect();
    let mut shares = x.shares.clone();
    let mut term = t;
    if held != whole(&space) {
        if !matches!(node.op, Op::ReduceSum(_) | Op::ReduceMean(_) | Op::ReduceMax(_)) {
            return Err(Why::Uncovered(format!("{kind} over part of its axes")));
        }
        shares.push(Share { site: t, space: space.clone(), held: vec![held.clone()], max });
        if matches!(node.op, Op::ReduceMean(_)) {
            // A mean over the part held: the partial sum times (all / held).
            let all: i64 = space.iter().product();
            let part: i64 = extents(&held).iter().product();
            term = cx.terms.scaled(t, all as f64 / part as f64);
        }
    }
    Ok(vec![Some(Fact { term, region, shares, alts: Vec::new() })])
}

fn transpose(cx: &mut Cx<'_>, op: &Op, perm: Option<Vec<i64>>, ins: &[Option<Fact>]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("Transpose without input") };
    let r = x.region.len();
    let perm: Vec<usize> = perm.map_or_else(|| (0..r).rev().collect(), |p| p.iter().map(|&i| i as usize).collect());
    let shape: Vec<i64> = perm.iter().map(|&i| cx.terms.shape(x.term)[i]).collect();
    let t = cx.terms.op(&op_key(op), 0, &[x.term], &shape);
    let region = perm.iter().map(|&i| x.region[i]).collect();
    Ok(vec![Some(Fact { term: t, region, shares: x.shares.clone(), alts: Vec::new() })])
}

/// Reshape, Flatten, Squeeze, Unsqueeze: one `View` term per target shape. A device's piece
/// maps to a box of the target where the held elements stay contiguous in each group of
/// dims the reshape merges or splits.
fn view(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("a reshape without input") };
    let Some(local) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("a reshape of unknown shape".into())) };
    let src = cx.terms.shape(x.term).to_vec();
    let mut targets: Vec<Vec<i64>> = Vec::new();
    if x.region == whole(&src) {
        targets.push(local.clone());
    }
    for &u in cx.terms.users(x.term) {
        if let Head::Op { key, .. } = cx.terms.head(u)
            && key == ".View|"
        {
            targets.push(cx.terms.shape(u).to_vec());
        }
    }
    for target in targets {
        if let Some(region) = view_region(&src, &target, &x.region)
            && extents(&region) == local
        {
            let t = cx.terms.op(".View|", 0, &[x.term], &target);
            let alts = x.alts.iter().filter_map(|r| view_region(&src, &target, r)).collect();
            return Ok(vec![Some(Fact { term: t, region, shares: x.shares.clone(), alts })]);
        }
    }
    if let Some(f) = unsqueezed(cx, n, x) {
        return Ok(vec![Some(f)]);
    }
    wrong(format!(
        "a reshape of part {:?} of {} to {local:?} is no part of any reshape of it",
        x.region,
        cx.terms.describe(x.term)
    ))
}

/// Unsqueeze with literal axes of a value the graph never reshapes (a mask the lowering
/// broadcasts): size-1 dims inserted, in the value's global shape as in its box.
fn unsqueezed(cx: &mut Cx<'_>, n: NodeId, x: &Fact) -> Option<Fact> {
    let node = cx.g.node(n);
    let Op::Unsqueeze(u) = &node.op else { return None };
    let axes = match &u.axes {
        Some(a) => a.clone(),
        None => cx.ints(node.input(1))?,
    };
    let rank = (x.region.len() + axes.len()) as i64;
    let mut axes: Vec<usize> = axes.iter().map(|&a| (if a < 0 { a + rank } else { a }) as usize).collect();
    axes.sort_unstable();
    let mut shape = cx.terms.shape(x.term).to_vec();
    let mut region = x.region.clone();
    for &a in &axes {
        if a > shape.len() {
            return None;
        }
        shape.insert(a, 1);
        region.insert(a, (0, 1));
    }
    let t = cx.terms.op(".View|", 0, &[x.term], &shape);
    Some(Fact { term: t, region, shares: x.shares.clone(), alts: Vec::new() })
}

/// The box of `to` that box `r` of `from` becomes under a reshape, if it is one.
pub fn view_region(from: &[i64], to: &[i64], r: &Region) -> Option<Region> {
    if from.iter().product::<i64>() != to.iter().product::<i64>() {
        return None;
    }
    // Dims of extent 1 hold (0, 1) on both sides.
    let fi: Vec<usize> = (0..from.len()).filter(|&i| from[i] != 1).collect();
    let ti: Vec<usize> = (0..to.len()).filter(|&i| to[i] != 1).collect();
    let mut out: Region = to.iter().map(|&d| (0, d)).collect();
    let (mut a, mut b) = (0, 0);
    while a < fi.len() || b < ti.len() {
        // One group: the shortest runs of dims with equal products.
        let (a0, b0) = (a, b);
        let (mut pa, mut pb) = (1i64, 1i64);
        loop {
            if pa <= pb && a < fi.len() {
                pa *= from[fi[a]];
                a += 1;
            } else if b < ti.len() {
                pb *= to[ti[b]];
                b += 1;
            } else {
                break;
            }
            if pa == pb {
                break;
            }
        }
        if pa != pb {
            return None;
        }
        let (lo, hi) = linear_range(&fi[a0..a].iter().map(|&i| (from[i], r[i])).collect::<Vec<_>>())?;
        let dims: Vec<i64> = ti[b0..b].iter().map(|&i| to[i]).collect();
        let boxed = box_of_range(&dims, lo, hi)?;
        for (k, &i) in ti[b0..b].iter().enumerate() {
            out[i] = boxed[k];
        }
    }
    Some(out)
}

/// The linear `[lo, hi)` a box covers in a row-major group of dims, if contiguous.
fn linear_range(dims: &[(i64, (i64, i64))]) -> Option<(i64, i64)> {
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1].0;
    }
    let first = dims.iter().position(|(_, (s, e))| e - s > 1).unwrap_or(dims.len());
    if dims[first.min(dims.len())..].iter().skip(1).any(|(d, r)| *r != (0, *d)) {
        return None;
    }
    let lo: i64 = dims.iter().zip(&strides).map(|((_, r), s)| r.0 * s).sum();
    let len = if first < dims.len() { (dims[first].1.1 - dims[first].1.0) * strides[first] } else { 1 };
    Some((lo, lo + len))
}

/// The box of row-major dims `dims` that the linear range `[lo, hi)` is, if it is one.
fn box_of_range(dims: &[i64], lo: i64, hi: i64) -> Option<Region> {
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let len = hi - lo;
    for k in 0..dims.len() {
        let s = strides[k];
        if lo % s != 0 || len % s != 0 {
            continue;
        }
        let e = len / s;
        let start = (lo / s) % dims[k];
        if start + e > dims[k] {
            continue;
        }
        let mut out = Vec::new();
        for j in 0..k {
            let i = (lo / strides[j]) % dims[j];
            out.push((i, i + 1));
        }
        out.push((start, start + e));
        for &d in &dims[k + 1..] {
            out.push((0, d));
        }
        return Some(out);
    }
    None
}

/// Softmax and log-softmax: rows held whole along the axis; the term is the definition
/// (`exp(x − max) / Σ exp(x − max)`, or `x − max − log Σ exp(x − max)`).
fn softmax(cx: &mut Cx<'_>, n: NodeId, axis: Option<i64>, log: bool, ins: &[Option<Fact>]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("Softmax without input") };
    let shape = cx.terms.shape(x.term).to_vec();
    let r = shape.len() as i64;
    let a = axis.unwrap_or(if cx.g.opset >= 13 { -1 } else { 1 });
    let a = (if a < 0 { a + r } else { a }) as usize;
    let stat: Vec<usize> = if cx.g.opset >= 13 { vec![a] } else { (a..r as usize).collect() };
    if !x.is_exact() {
        return wrong("a partial sum reaches Softmax");
    }
    for &d in &stat {
        if x.region[d] != (0, shape[d]) {
            return wrong(format!("Softmax over dim {d}, of which this device holds only {:?}", x.region[d]));
        }
    }
    let t = softmax_term(cx, x.term, &stat, log);
    let _ = n;
    Ok(vec![Some(Fact::exact(t, x.region.clone()))])
}

/// The definition of softmax over `stat` as terms.
pub fn softmax_term(cx: &mut Cx<'_>, x: TermId, stat: &[usize], log: bool) -> TermId {
    let m = cx.reduce_term("ReduceMax", x, stat, true);
    let shifted = cx.pointwise_term(&Op::Sub(o::Sub::default()), 0, &[x, m]);
    let e = cx.pointwise_term(&Op::Exp(o::Exp::default()), 0, &[shifted]);
    let s = cx.reduce_term("ReduceSum", e, stat, true);
    if log {
        let l = cx.pointwise_term(&Op::Log(o::Log::default()), 0, &[s]);
        cx.pointwise_term(&Op::Sub(o::Sub::default()), 0, &[shifted, l])
    } else {
        cx.pointwise_term(&Op::Div(o::Div::default()), 0, &[e, s])
    }
}

/// Ops whose inputs share one shape and whose rows along `axes` are independent: each row
/// held whole gives that row of the output.
fn rowwise(cx: &mut Cx<'_>, op: &Op, axes: &[i64], ins: &[Option<Fact>]) -> Out {
    let facts = present(ins);
    let Some(first) = facts.first() else { return wrong("no input") };
    let shape = cx.terms.shape(first.term).to_vec();
    let r = shape.len() as i64;
    for f in &facts {
        if !f.is_exact() {
            return wrong(format!("a partial sum reaches {}", op.op_type()));
        }
        if f.region != first.region {
            return wrong(format!("{} operands hold {:?} and {:?}", op.op_type(), first.region, f.region));
        }
    }
    for &a in axes {
        let d = (if a < 0 { a + r } else { a }) as usize;
        if first.region[d] != (0, shape[d]) {
            return wrong(format!(
                "{} over dim {d}, of which this device holds only {:?}",
                op.op_type(),
                first.region[d]
            ));
        }
    }
    let terms: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let t = cx.terms.op(&op_key(op), 0, &terms, &shape);
    Ok(vec![Some(Fact::exact(t, first.region.clone()))])
}

/// SliceGrad (dY, bounds → dX, zeros off the slice): the sliced dims held whole, the others
/// as dY holds them.
fn slice_grad(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let Some(dy) = ins.first().and_then(Option::as_ref) else { return wrong("SliceGrad without dY") };
    let Some(local) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("SliceGrad of unknown shape".into())) };
    let ds = cx.terms.shape(dy.term).to_vec();
    let r = ds.len();
    let starts = cx.ints(node.input(1)).unwrap_or_default();
    let axes: Vec<usize> = match node.input(3) {
        Some(v) => match cx.ints(Some(v)) {
            Some(a) => a.iter().map(|&x| if x < 0 { x + r as i64 } else { x } as usize).collect(),
            None => return Err(Why::Uncovered("SliceGrad with axes that are not literals".into())),
        },
        None => (0..starts.len()).collect(),
    };
    let mut shape = ds.clone();
    let mut region = dy.region.clone();
    for &a in &axes {
        if a >= r || dy.region[a] != (0, ds[a]) {
            return Err(Why::Uncovered(format!("SliceGrad of dim {a}, held in part")));
        }
        shape[a] = local[a];
        region[a] = (0, local[a]);
    }
    let terms: Vec<TermId> = ins.iter().flatten().map(|f| f.term).collect();
    let t = cx.terms.op(&op_key(&node.op), 0, &terms, &shape);
    Ok(vec![Some(Fact { term: t, region, shares: dy.shares.clone(), alts: Vec::new() })])
}

/// Split along a dim held whole: output `k` is the slice of its extent after the others.
fn split(cx: &mut Cx<'_>, n: NodeId, axis: i64, ins: &[Option<Fact>]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("Split without input") };
    let shape = cx.terms.shape(x.term).to_vec();
    let a = (if axis < 0 { axis + shape.len() as i64 } else { axis }) as usize;
    if x.region[a] != (0, shape[a]) {
        return Err(Why::Uncovered(format!("Split along dim {a}, held in part {:?}", x.region[a])));
    }
    let mut out = Vec::new();
    let mut at = 0;
    for slot in 0..cx.g.node(n).num_outputs() {
        let Some(d) = cx.out_dims(n, slot) else { return Err(Why::Uncovered("Split of unknown shape".into())) };
        let mut abs = x.region.clone();
        abs[a] = (at, at + d[a]);
        at += d[a];
        out.push(Some(cut(cx, x, &[a], abs)));
    }
    Ok(out)
}

/// Expand: one `Expand` term per target shape (the graph's; a device's local target names
/// the global one by the dims it keeps). A dim broadcast from 1 holds the same values at
/// every position, so a device's part of it is every part of that length.
fn expand(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("Expand without input") };
    let Some(local) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("Expand of unknown shape".into())) };
    let xs = cx.terms.shape(x.term).to_vec();
    let mut targets: Vec<Vec<i64>> = Vec::new();
    if cx.global {
        targets.push(local.clone());
    }
    for &u in cx.terms.users(x.term) {
        if matches!(cx.terms.head(u), Head::Op { key, .. } if key == ".Expand|") {
            targets.push(cx.terms.shape(u).to_vec());
        }
    }
    for target in targets {
        if target.len() != local.len() || target.len() < xs.len() {
            continue;
        }
        let off = target.len() - xs.len();
        let mut region: Region = Vec::new();
        let mut spread: Vec<usize> = Vec::new();
        for (d, (&t, &l)) in target.iter().zip(&local).enumerate() {
            let src = d.checked_sub(off).map(|j| (xs[j], x.region[j]));
            match src {
                Some((e, r)) if e == t => region.push(r),
                _ if l == t => region.push((0, t)),
                _ if l > 0 && t % l == 0 => {
                    region.push((0, l));
                    spread.push(d);
                }
                _ => break,
            }
        }
        if region.len() != target.len() || extents(&region) != local {
            continue;
        }
        let t = cx.terms.op(".Expand|", 0, &[x.term], &target);
        let mut alts: Vec<Region> = vec![region.clone()];
        for &d in &spread {
            let l = local[d];
            alts = alts
                .iter()
                .flat_map(|r| {
                    (0..target[d] / l).map(move |k| {
                        let mut r = r.clone();
                        r[d] = (k * l, k * l + l);
                        r
                    })
                })
                .take(64)
                .collect();
        }
        alts.retain(|r| *r != region);
        return Ok(vec![Some(Fact { term: t, region, shares: x.shares.clone(), alts })]);
    }
    wrong(format!(
        "an Expand of part {:?} of {} to {local:?} is no part of any expand of it",
        x.region,
        cx.terms.describe(x.term)
    ))
}

/// An op over the trailing dims `axis..` of its first input, row by row, its other inputs
/// (parameters over those dims) whole: RMS normalization.
fn trailing_rows(cx: &mut Cx<'_>, n: NodeId, axis: i64, ins: &[Option<Fact>]) -> Out {
    let op = &cx.g.node(n).op;
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("no input") };
    let shape = cx.terms.shape(x.term).to_vec();
    let a = (if axis < 0 { axis + shape.len() as i64 } else { axis }) as usize;
    if ins.iter().flatten().any(|f| !f.is_exact()) {
        return wrong(format!("a partial sum reaches {}", op.op_type()));
    }
    if (a..shape.len()).any(|d| x.region[d] != (0, shape[d])) {
        return wrong(format!("{} over dims {a}.., held in part: {:?}", op.op_type(), x.region));
    }
    let mut terms = vec![x.term];
    for f in ins.iter().skip(1).flatten() {
        let Some(w) = f.at(&whole(cx.terms.shape(f.term))) else {
            return wrong(format!("{}'s parameter held in part {:?}", op.op_type(), f.region));
        };
        terms.push(w.term);
    }
    let key = op_key(op);
    let t = cx.terms.op(&key, 0, &terms, &shape);
    Ok(vec![Some(Fact::exact(t, x.region.clone()))])
}

/// Gather along `axis` of a table held whole along it: the indices' box and the table's
/// other dims.
fn gather(cx: &mut Cx<'_>, n: NodeId, op: &Op, axis: i64, ins: &[Option<Fact>]) -> Out {
    let (d, i) = two(ins, "Gather")?;
    if !d.is_exact() || !i.is_exact() {
        return wrong("a partial sum reaches Gather");
    }
    let ds = cx.terms.shape(d.term).to_vec();
    let is = cx.terms.shape(i.term).to_vec();
    let a = (if axis < 0 { axis + ds.len() as i64 } else { axis }) as usize;
    if d.region[a] != (0, ds[a]) {
        let dtype = cx.g.node(n).input(1).and_then(|v| cx.g.tensor_type(v)).map_or(DType::Int64, |t| t.dtype);
        if let Some(f) = super::vocab::gather(cx, d, i, a, dtype) {
            return Ok(vec![Some(f)]);
        }
        return Err(Why::Uncovered(format!(
            "Gather from part {:?} of its table's dim {a} (a vocabulary-split embedding)",
            d.region[a]
        )));
    }
    let mut shape = ds[..a].to_vec();
    shape.extend(&is);
    shape.extend(&ds[a + 1..]);
    let mut region = d.region[..a].to_vec();
    region.extend(&i.region);
    region.extend(&d.region[a + 1..]);
    let t = cx.terms.op(&op_key(op), 0, &[d.term, i.term], &shape);
    Ok(vec![Some(Fact::exact(t, region))])
}

/// Slice with literal bounds and unit steps. On the graph, a `Slice` term of the bounds in
/// its input's coordinates; on a device, that term where the graph computes it, else the
/// piece of the input the bounds select (the lowering cutting a device's piece out of a
/// whole value).
fn slice(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("Slice without input") };
    let shape = cx.terms.shape(x.term).to_vec();
    let r = shape.len();
    let (Some(starts), Some(ends)) = (cx.ints(node.input(1)), cx.ints(node.input(2))) else {
        return Err(Why::Uncovered("Slice with bounds that are not literals".into()));
    };
    let axes: Vec<usize> = match node.input(3) {
        Some(v) => match cx.ints(Some(v)) {
            Some(a) => a.iter().map(|&x| if x < 0 { x + r as i64 } else { x } as usize).collect(),
            None => return Err(Why::Uncovered("Slice with axes that are not literals".into())),
        },
        None => (0..starts.len()).collect(),
    };
    let steps = node.input(4).map(|v| cx.ints(Some(v)));
    if steps.as_ref().is_some_and(|s| s.as_ref().is_none_or(|s| s.iter().any(|&k| k != 1))) {
        return stepped_slice(cx, n, ins, &axes);
    }
    // Bounds that take all of the value, and all of the piece held (a begin and end masked
    // as exporters write them): the identity, on the graph and on the device.
    let all = |len: i64, k: usize| {
        let norm = |v: i64| (if v < 0 { v + len } else { v }).clamp(0, len);
        norm(starts[k]) == 0 && norm(ends[k]) == len
    };
    let identity = axes.iter().enumerate().all(|(k, &a)| {
        a < r && k < starts.len() && k < ends.len() && all(shape[a], k) && all(x.region[a].1 - x.region[a].0, k)
    });
    if identity {
        return Ok(vec![Some(x.clone())]);
    }
    let mut abs = x.region.clone();
    for (k, &a) in axes.iter().enumerate() {
        if a >= r {
            return wrong(format!("Slice of dim {a} of a rank-{r} value"));
        }
        let (lo, hi) = x.region[a];
        let len = hi - lo;
        let norm = |v: i64| (if v < 0 { v + len } else { v }).clamp(0, len);
        let (s, e) = (norm(starts[k]), norm(ends[k]));
        abs[a] = (lo + s, lo + e.max(s));
    }
    Ok(vec![Some(cut(cx, x, &axes, abs))])
}

/// Slice with steps other than 1 along `axes`, which the piece holds whole: the op on the
/// whole value (as [`whole_rule`] writes it), its other dims' parts passing through. Along a
/// sliced axis held in part, the rule of a whole op.
fn stepped_slice(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>], axes: &[usize]) -> Out {
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("Slice without input") };
    let shape = cx.terms.shape(x.term).to_vec();
    let local = cx.out_dims(n, 0);
    let held_whole = axes.iter().all(|&a| a < shape.len() && x.region[a] == (0, shape[a]));
    let (Some(local), true) = (local, held_whole && ins.iter().flatten().all(Fact::is_exact)) else {
        return whole_rule(cx, n, ins);
    };
    let mut terms = vec![x.term];
    for f in ins.iter().skip(1).flatten() {
        let Some(w) = f.at(&whole(cx.terms.shape(f.term))) else { return whole_rule(cx, n, ins) };
        terms.push(w.term);
    }
    let (mut global, mut region) = (local.clone(), whole(&local));
    for d in (0..shape.len()).filter(|d| !axes.contains(d)) {
        (global[d], region[d]) = (shape[d], x.region[d]);
    }
    let t = cx.terms.op(&op_key(&cx.g.node(n).op), 0, &terms, &global);
    Ok(vec![Some(Fact::exact(t, region))])
}

/// The part `abs` (along `axes`, in `x`'s term coordinates) of `x`: the graph's `Slice`
/// term of those bounds where it has one (or, on the graph, a new one), else that piece of
/// `x`'s term.
fn cut(cx: &mut Cx<'_>, x: &Fact, axes: &[usize], abs: Region) -> Fact {
    let shape = cx.terms.shape(x.term).to_vec();
    let key = format!(".Slice|{:?}", axes.iter().map(|&a| (a, abs[a])).collect::<Vec<_>>());
    let mut sliced: Vec<i64> = shape.clone();
    for &a in axes {
        sliced[a] = abs[a].1 - abs[a].0;
    }
    let global_term = cx.terms.users(x.term).iter().copied().find(|&u| {
        matches!(cx.terms.head(u), Head::Op { key: k, .. } if *k == key) && cx.terms.shape(u) == &sliced[..]
    });
    let whole_on_axes = axes.iter().all(|&a| x.region[a] == (0, shape[a]));
    let t = match global_term {
        Some(t) => Some(t),
        None if cx.global && whole_on_axes => Some(cx.terms.op(&key, 0, &[x.term], &sliced)),
        None => None,
    };
    match t {
        Some(t) if whole_on_axes => {
            let mut region = x.region.clone();
            for &a in axes {
                region[a] = (0, sliced[a]);
            }
            Fact { term: t, region, shares: x.shares.clone(), alts: Vec::new() }
        }
        _ => Fact { term: x.term, region: abs, shares: x.shares.clone(), alts: Vec::new() },
    }
}

/// Concat along a dim every input holds whole; the other dims held alike.
fn concat(cx: &mut Cx<'_>, op: &Op, axis: i64, ins: &[Option<Fact>]) -> Out {
    let facts = present(ins);
    let Some(first) = facts.first() else { return wrong("Concat of nothing") };
    let r = first.region.len();
    let a = (if axis < 0 { axis + r as i64 } else { axis }) as usize;
    // Pieces of one value adjacent in order along the axis: the piece they make together.
    let same = facts.iter().all(|f| f.term == first.term && f.is_exact());
    let adjacent = facts
        .windows(2)
        .all(|w| w[0].region[a].1 == w[1].region[a].0 && (0..r).all(|d| d == a || w[0].region[d] == w[1].region[d]));
    if facts.len() > 1 && same && adjacent {
        let mut region = first.region.clone();
        region[a].1 = facts[facts.len() - 1].region[a].1;
        return Ok(vec![Some(Fact::exact(first.term, region))]);
    }
    let mut shape = cx.terms.shape(first.term).to_vec();
    shape[a] = 0;
    for f in &facts {
        let s = cx.terms.shape(f.term);
        if !f.is_exact() || f.region[a] != (0, s[a]) {
            return Err(Why::Uncovered("Concat of parts along its axis, or of partial sums".into()));
        }
        if (0..r).any(|d| d != a && f.region[d] != first.region[d]) {
            return wrong(format!("Concat operands hold {:?} and {:?}", first.region, f.region));
        }
        shape[a] += s[a];
    }
    let mut region = first.region.clone();
    region[a] = (0, shape[a]);
    let terms: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let t = cx.terms.op(&op_key(op), 0, &terms, &shape);
    Ok(vec![Some(Fact::exact(t, region))])
}

/// The reduce term helper for the composite definitions.
pub fn reduce_term(cx: &mut Cx<'_>, kind: &str, x: TermId, axes: &[usize], keep: bool) -> TermId {
    cx.reduce_term(kind, x, axes, keep)
}

/// The pointwise term helper for the composite definitions.
pub fn pointwise_term(cx: &mut Cx<'_>, op: &Op, ins: &[TermId]) -> TermId {
    cx.pointwise_term(op, 0, ins)
}

/// An output's static dims, for the composite definitions.
pub fn out_dims_of(cx: &Cx<'_>, n: NodeId, slot: usize) -> Option<Vec<i64>> {
    cx.out_dims(n, slot)
}
