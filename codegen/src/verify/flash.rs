//! Attention block by block on pieces (`AttentionBlock`, `AttentionGrad`; ir/src/ops/flash.rs):
//! the rules ring attention's programs are proved by.
//!
//! A device holds part of the batch and of the heads (a key/value head with its group of
//! query heads), a box of query rows `Rq` and a box of key rows `Rk`; the head dims whole.
//!
//! - `AttentionBlock` on queries `Rq` and keys `Rk` computes the attention of those rows
//!   over the keys of `Rk` they may see: a term of its own, naming the visible keys covered
//!   so far; merged with a running block it covers the union (overlapping blocks would count
//!   keys twice: refused). When the covered keys are every key the rows may see (all, or
//!   under a causal mask those before the rows' end), it is the rows `Rq` of the attention's
//!   output — the graph's `Attention` term — and of its log-sum-exp (a term of its own).
//! - `AttentionGrad` on queries `Rq` and keys `Rk`, given the rows' output and log-sum-exp
//!   over all keys, computes the part of `dQ` summed over the keys of `Rk` (a [`Share`] of
//!   the visible keys), and the parts of `dK`, `dV` summed over the query rows of `Rq` (a
//!   share of the queries that may see those keys). On whole rows and keys: the gradient.
//!
//! The mask's offsets must place the pieces where they are (`q_offset = Rq`'s start,
//! `k_offset = Rk`'s).

use ir::NodeId;
use ir::op::{self as o, Op};

use super::rules::{Cx, Out, Why, op_key, wrong};
use super::term::{Fact, Head, Region, Share, TermId};

/// The key of the graph's `Attention` with this mask and scale (as [`super::attention`]
/// names it).
fn attention_key(causal: bool, scale: Option<f32>) -> String {
    let a = o::Attention { is_causal: causal.then_some(1), scale, ..Default::default() };
    format!("{}|inputs={:?}", op_key(&Op::Attention(a)), [0usize, 1, 2])
}

/// The key of the gradient op, offsets left out (they place pieces; the op is one).
fn grad_key(a: &o::AttentionGrad) -> String {
    let g = o::AttentionGrad { is_causal: a.is_causal.filter(|&c| c != 0), scale: a.scale, ..Default::default() };
    op_key(&Op::AttentionGrad(g))
}

/// The pieces: Q, K, V exact, batch and heads matching, head dims whole. Returns the
/// shapes of Q, K, V and the query rows and key rows held.
struct Pieces {
    shapes: [Vec<i64>; 3],
    terms: [TermId; 3],
    rq: (i64, i64),
    rk: (i64, i64),
    /// Batch, query heads and key heads held.
    b: (i64, i64),
    qh: (i64, i64),
    kh: (i64, i64),
}

fn pieces(cx: &Cx<'_>, ins: &[Option<Fact>], what: &str) -> Result<Pieces, Why> {
    let fact = |j: usize| {
        ins.get(j).and_then(Option::as_ref).ok_or_else(|| Why::Uncovered(format!("{what} without input {j}")))
    };
    let (q, k, v) = (fact(0)?, fact(1)?, fact(2)?);
    if [q, k, v].iter().any(|f| !f.is_exact()) {
        return wrong(format!("a partial sum reaches {what}, which is not linear"));
    }
    let shapes = [q, k, v].map(|f| cx.terms.shape(f.term).to_vec());
    if shapes.iter().any(|s| s.len() != 4) {
        return Err(Why::Uncovered(format!("{what} of rank other than 4")));
    }
    let (hq, hk) = (shapes[0][1], shapes[1][1]);
    if hk <= 0 || hq % hk != 0 {
        return Err(Why::Uncovered(format!("{what}: {hq} query heads do not group over {hk} key heads")));
    }
    for (f, s, name) in [(q, &shapes[0], "queries"), (k, &shapes[1], "keys"), (v, &shapes[2], "values")] {
        if f.region[3] != (0, s[3]) {
            return Err(Why::Uncovered(format!("{what} on a part {:?} of the {name}' head dim", f.region)));
        }
        if f.region[0] != q.region[0] {
            return wrong(format!("{what}'s {name} hold batch {:?}, the queries {:?}", f.region[0], q.region[0]));
        }
    }
    if v.region[1..3] != k.region[1..3] {
        return wrong(format!("{what}'s keys and values hold different parts: {:?}, {:?}", k.region, v.region));
    }
    let g = hq / hk;
    let (qh, kh) = (q.region[1], k.region[1]);
    if qh.0 != kh.0 * g || qh.1 - qh.0 != (kh.1 - kh.0) * g {
        return wrong(format!("{what}'s query heads {qh:?} are not those of key/value heads {kh:?}"));
    }
    Ok(Pieces { shapes, terms: [q.term, k.term, v.term], rq: q.region[2], rk: k.region[2], b: q.region[0], qh, kh })
}

impl Pieces {
    /// The op's mask offsets place its query rows and key rows where they are.
    fn placed(&self, what: &str, q_offset: Option<i64>, k_offset: Option<i64>) -> Result<(), Why> {
        if q_offset.unwrap_or(0) != self.rq.0 || k_offset.unwrap_or(0) != self.rk.0 {
            return wrong(format!(
                "{what}'s offsets ({q_offset:?}, {k_offset:?}) do not place its queries {:?} and keys {:?}",
                self.rq, self.rk
            ));
        }
        Ok(())
    }
}

/// The key rows query rows `rq` may see of `total`: all, or under a causal mask those before
/// the rows' end.
fn visible_keys(causal: bool, rq: (i64, i64), total: i64) -> (i64, i64) {
    if causal { (0, rq.1.min(total)) } else { (0, total) }
}

/// The query rows of `total` that may see some key of `rk`: all, or under a causal mask
/// those from the keys' start.
fn seeing_queries(causal: bool, rk: (i64, i64), total: i64) -> (i64, i64) {
    if causal { (rk.0.min(total), total) } else { (0, total) }
}

fn intersect(a: (i64, i64), b: (i64, i64)) -> Option<(i64, i64)> {
    let r = (a.0.max(b.0), a.1.min(b.1));
    (r.0 < r.1).then_some(r)
}

/// Sorted, adjacent ranges merged; `None` where two overlap.
fn union(mut rs: Vec<(i64, i64)>) -> Option<Vec<(i64, i64)>> {
    rs.sort_unstable();
    let mut out: Vec<(i64, i64)> = Vec::new();
    for r in rs {
        match out.last_mut() {
            Some(last) if r.0 < last.1 => return None,
            Some(last) if r.0 == last.1 => last.1 = r.1,
            _ => out.push(r),
        }
    }
    Some(out)
}

const COVERED: &str = "|ring-keys=";

/// The keys a running block's term covers (its key's tail), when it is a block of `base`.
fn covered(cx: &Cx<'_>, t: TermId, base: &str, terms: &[TermId; 3]) -> Option<Vec<(i64, i64)>> {
    let Head::Op { key, .. } = cx.terms.head(t) else { return None };
    let tail = key.strip_prefix(base)?.strip_prefix(COVERED)?;
    if cx.terms.inputs(t) != terms {
        return None;
    }
    tail.split(',')
        .filter(|s| !s.is_empty())
        .map(|r| {
            let (a, b) = r.split_once('-')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect()
}

/// `AttentionBlock` on pieces.
pub fn block(cx: &mut Cx<'_>, op: &o::AttentionBlock, ins: &[Option<Fact>]) -> Out {
    let p = pieces(cx, ins, "AttentionBlock")?;
    p.placed("AttentionBlock", op.q_offset, op.k_offset)?;
    let causal = op.is_causal.unwrap_or(0) != 0;
    let total = p.shapes[1][2];
    let base = attention_key(causal, op.scale);
    let seen = visible_keys(causal, p.rq, total);
    let mut keys: Vec<(i64, i64)> = intersect(p.rk, seen).into_iter().collect();
    let rows: Region = vec![p.b, p.qh, p.rq];
    match (ins.get(3).and_then(Option::as_ref), ins.get(4).and_then(Option::as_ref)) {
        (Some(y), Some(l)) => {
            let (cy, cl) = (covered(cx, y.term, &base, &p.terms), covered(cx, l.term, &base, &p.terms));
            let (Some(cy), Some(cl)) = (cy, cl) else {
                return wrong("AttentionBlock merges into a running output that is not a block of its attention");
            };
            if cy != cl || y.region[..3] != rows[..] || l.region != rows {
                return wrong("AttentionBlock's running output and log-sum-exp are not of its rows' blocks");
            }
            keys.extend(cy);
        }
        (None, None) => {}
        _ => return wrong("AttentionBlock with a running output but no log-sum-exp"),
    }
    let Some(keys) = union(keys) else {
        return wrong(format!("AttentionBlock merges keys {:?} twice", p.rk));
    };
    let (b, hq, sq, dv) = (p.shapes[0][0], p.shapes[0][1], p.shapes[0][2], p.shapes[2][3]);
    let (ys, ls) = ([b, hq, sq, dv], [b, hq, sq]);
    let (y, l) = if keys == [seen] || keys.is_empty() && seen.0 == seen.1 {
        let y = cx.terms.op(&base, 0, &p.terms, &ys);
        (y, lse_term(cx, &base, &p.terms, &ls))
    } else {
        let tail: Vec<String> = keys.iter().map(|(a, b)| format!("{a}-{b}")).collect();
        let key = format!("{base}{COVERED}{}", tail.join(","));
        (cx.terms.op(&key, 0, &p.terms, &ys), cx.terms.op(&key, 1, &p.terms, &ls))
    };
    let mut yr = rows.clone();
    yr.push((0, dv));
    Ok(vec![Some(Fact::exact(y, yr)), Some(Fact::exact(l, rows))])
}

/// The log-sum-exp of each query row of the attention `base` over all its keys.
fn lse_term(cx: &mut Cx<'_>, base: &str, terms: &[TermId; 3], shape: &[i64]) -> TermId {
    cx.terms.op(&format!("{base}|lse"), 0, terms, shape)
}

/// `AttentionGrad` on pieces.
pub fn grad(cx: &mut Cx<'_>, n: NodeId, op: &o::AttentionGrad, ins: &[Option<Fact>]) -> Out {
    let p = pieces(cx, ins, "AttentionGrad")?;
    p.placed("AttentionGrad", op.q_offset, op.k_offset)?;
    let causal = op.is_causal.unwrap_or(0) != 0;
    let (sq, sk) = (p.shapes[0][2], p.shapes[1][2]);
    let rows: Region = vec![p.b, p.qh, p.rq];
    let fact = |j: usize| ins.get(j).and_then(Option::as_ref);
    let (Some(dy), Some(y)) = (fact(3), fact(4)) else {
        return Err(Why::Uncovered("AttentionGrad without dY or Y".into()));
    };
    for (f, what) in [(dy, "dY"), (y, "Y")] {
        if !f.is_exact() || f.region[..3] != rows[..] || f.region[3] != (0, cx.terms.shape(f.term)[3]) {
            return wrong(format!("AttentionGrad's {what} holds {:?}, its queries' rows {rows:?}", f.region));
        }
    }
    // Over part of the keys the rows' log-sum-exp over all of them comes in.
    let whole_keys = p.rk == (0, sk);
    match fact(5) {
        Some(l) => {
            let base = attention_key(causal, op.scale);
            let want = lse_term(cx, &base, &p.terms, &[p.shapes[0][0], p.shapes[0][1], sq]);
            if !l.is_exact() || l.term != want || l.region != rows {
                return wrong("AttentionGrad's log-sum-exp is not its rows' over all their keys");
            }
        }
        None if !whole_keys => return wrong("AttentionGrad on part of the keys without the rows' log-sum-exp"),
        None => {}
    }
    let key = grad_key(op);
    let terms = [p.terms[0], p.terms[1], p.terms[2], dy.term, y.term];
    let mut out = Vec::new();
    for slot in 0..cx.g.node(n).num_outputs().min(3) {
        let shape = p.shapes[slot].clone();
        let t = cx.terms.op(&key, slot as u16, &terms, &shape);
        let (region, share) = if slot == 0 {
            // dQ: the rows' sum over the keys they see, this block's part of it.
            let seen = visible_keys(causal, p.rq, sk);
            let part = intersect(p.rk, seen);
            (vec![p.b, p.qh, p.rq, (0, shape[3])], partial(t, seen, part))
        } else {
            // dK, dV: the keys' sum over the query rows that see them, this block's part.
            let seeing = seeing_queries(causal, p.rk, sq);
            let part = intersect(p.rq, seeing);
            (vec![p.b, p.kh, p.rk, (0, shape[3])], partial(t, seeing, part))
        };
        out.push(Some(Fact { term: t, region, shares: share.into_iter().collect(), alts: Vec::new() }));
    }
    Ok(out)
}

/// The share of a sum over the index range `space` of which `part` is held (`None`: all of
/// it, exact).
fn partial(site: TermId, space: (i64, i64), part: Option<(i64, i64)>) -> Option<Share> {
    if part == Some(space) || space.0 >= space.1 {
        return None;
    }
    let held = part.map(|(a, b)| vec![vec![(a - space.0, b - space.0)]]).unwrap_or_default();
    Some(Share { site, space: vec![space.1 - space.0], held, max: false })
}
