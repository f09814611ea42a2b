//! Ring attention (`SplitMode::Ring`): attention, or its gradient, with the sequence of its
//! queries, keys and values split over one mesh axis of `c` devices.
//!
//! Forward: device `d` holds queries and keys `d·n..(d+1)·n`. In step `r` it holds the keys
//! and values of device `d − r` (mod `c`): it sends them on to `d + 1`, merges the block into
//! its running output (`AttentionBlock`; a block entirely after its queries under a causal
//! mask is skipped) and receives the next from `d − 1`.
//!
//! Gradient: the same ring first gives each query row its log-sum-exp over all keys; then
//! the keys and values go round again with their gradients' running sums beside them: in
//! step `r` the device adds its block's `dK`, `dV` (`AttentionGrad` with the log-sum-exp
//! given) to the sums it received for that block and sends them on; after `c` passes each
//! block's sums are home. `dQ` sums locally.
//!
//! Every pass is a `Send` to the next device and a `Recv` from the previous one, tagged per
//! op, pass and tensor; the cost model prices these passes (passes/src/cost/model/ring.rs).

use ir::op::{self as o, Op};
use ir::shard::{IterSpace, strategy_shardings};
use ir::{NodeId, Value};

use super::local::Local;
use super::{LowerError, LowerErrorKind};

/// The tags of ring messages start here (pipeline tags are value indices, far below).
const TAG_BASE: i64 = 1 << 40;

/// One device's place on the ring.
struct Ring {
    /// This device's index on the axis, and the axis' size.
    d: usize,
    c: usize,
    /// Global ids of the next and previous devices.
    next: i64,
    prev: i64,
    /// Positions per device, and this device's first.
    n: usize,
    start: usize,
    causal: bool,
    scale: Option<f32>,
    /// The op's node (for tags and names).
    node: NodeId,
    /// The local keys and values.
    k: Piece,
    v: Piece,
}

impl Ring {
    /// The device whose block this one holds in step `r`.
    fn src(&self, r: usize) -> usize {
        (self.d + self.c - r % self.c) % self.c
    }

    /// Whether this device's queries see any key of `src`'s block.
    fn sees(&self, src: usize) -> bool {
        !self.causal || src <= self.d
    }

    /// The mask attributes of the block of `src`'s keys: causal, the offsets, the scale.
    fn mask(&self, src: usize) -> (Option<i64>, Option<i64>, Option<i64>, Option<f32>) {
        (Some(i64::from(self.causal)), Some(self.start as i64), Some((src * self.n) as i64), self.scale)
    }

    fn tag(&self, pass: usize, r: usize, what: usize) -> i64 {
        TAG_BASE + ((self.node.index() as i64 * 4 + pass as i64) * 4096 + r as i64) * 4 + what as i64
    }
}

/// A tensor that travels the ring: its local shape and element type.
struct Piece {
    shape: Vec<i64>,
    dtype: i64,
}

/// `x` sent to the next device and its counterpart received from the previous one.
fn pass(l: &mut Local<'_>, ring: &Ring, x: Value, piece: &Piece, tag: i64, base: &str) -> Value {
    l.emit(Op::Send(o::Send { peer: Some(ring.next), tag: Some(tag) }), vec![Some(x)], &[]);
    let name = l.fresh(base);
    let recv =
        o::Recv { dtype: Some(piece.dtype), peer: Some(ring.prev), shape: Some(piece.shape.clone()), tag: Some(tag) };
    l.emit(Op::Recv(recv), vec![], &[name])[0]
}

/// Step `r` of ring `pass_no`: the keys and values held, `kv`, passed on and the next
/// received (none after the last step).
fn rotate(
    l: &mut Local<'_>,
    ring: &Ring,
    (k, v): (Value, Value),
    pass_no: usize,
    r: usize,
    base: &str,
) -> Option<(Value, Value)> {
    (r + 1 < ring.c).then(|| {
        let kn = pass(l, ring, k, &ring.k, ring.tag(pass_no, r, 0), &format!("{base}__ring_k"));
        let vn = pass(l, ring, v, &ring.v, ring.tag(pass_no, r, 1), &format!("{base}__ring_v"));
        (kn, vn)
    })
}

/// The local piece of input `j` of `n` under strategy `s`.
fn piece(l: &Local<'_>, n: NodeId, sp: &IterSpace, s: &[Option<usize>], j: usize) -> Result<Piece, LowerError> {
    let v =
        l.g.node(n)
            .input(j)
            .ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "attention without keys or values"))?;
    let (layouts, _) = strategy_shardings(sp, s);
    let layout = layouts.get(j).cloned().flatten().unwrap_or_default();
    let shape = l.local_dims(v, &layout)?.iter().map(|&d| d as i64).collect();
    Ok(Piece { shape, dtype: l.dtype(v).code() })
}

fn place(l: &Local<'_>, n: NodeId, sp: &IterSpace, s: &[Option<usize>], axis: usize) -> Result<Ring, LowerError> {
    let g = l.g;
    let node = g.node(n);
    let (causal, scale) = ir::ops::flash::ring_mask(&node.op)
        .ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "ring attention of an op that is not attention"))?;
    let q = node.input(0).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "attention without queries"))?;
    let seq = *l.micro_dims(q)?.get(2).ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "attention not 4-D"))?;
    let (layouts, _) = strategy_shardings(sp, s);
    let layout = layouts.first().cloned().flatten().unwrap_or_default();
    let (start, end) = crate::layout::dim_range(&layout, l.mesh, &l.coords, 2, seq);
    let group = l.group(&[axis]);
    let (d, c) = (l.coords[axis], group.len());
    Ok(Ring {
        d,
        c,
        next: group[(d + 1) % c],
        prev: group[(d + c - 1) % c],
        n: end - start,
        start,
        causal,
        scale,
        node: n,
        k: piece(l, n, sp, s, 1)?,
        v: piece(l, n, sp, s, 2)?,
    })
}

/// The running output and log-sum-exp of queries `q` over every block of the ring (`pass`
/// numbers the ring within the op).
fn forward_ring(
    l: &mut Local<'_>,
    ring: &Ring,
    (q, k, v): (Value, Value, Value),
    pass_no: usize,
    base: &str,
) -> Result<(Value, Value), LowerError> {
    let (mut kc, mut vc) = (k, v);
    let mut acc: Option<(Value, Value)> = None;
    for r in 0..ring.c {
        let src = ring.src(r);
        let next = rotate(l, ring, (kc, vc), pass_no, r, base);
        if ring.sees(src) {
            let (is_causal, q_offset, k_offset, scale) = ring.mask(src);
            let op = o::AttentionBlock { is_causal, q_offset, k_offset, scale };
            let mut ins = vec![Some(q), Some(kc), Some(vc)];
            if let Some((y, lse)) = acc {
                ins.extend([Some(y), Some(lse)]);
            }
            let names = [l.fresh(&format!("{base}__block_y")), l.fresh(&format!("{base}__block_lse"))];
            let out = l.emit(Op::AttentionBlock(op), ins, &names);
            acc = Some((out[0], out[1]));
        }
        if let Some((kn, vn)) = next {
            (kc, vc) = (kn, vn);
        }
    }
    // The first step's block is the device's own: every query sees at least itself.
    acc.ok_or_else(|| l.err(Some(ring.node), LowerErrorKind::Graph, "ring attention computed no block"))
}

/// The op's outputs computed over the ring on axis `axis`.
pub(super) fn emit(
    l: &mut Local<'_>,
    n: NodeId,
    sp: &IterSpace,
    s: &[Option<usize>],
    axis: usize,
    ins: &[Option<Value>],
    out_names: &[String],
) -> Result<Vec<Value>, LowerError> {
    let ring = place(l, n, sp, s, axis)?;
    let missing = |l: &Local<'_>| l.err(Some(n), LowerErrorKind::Graph, "ring attention without its operands");
    let x = |j: usize| ins.get(j).copied().flatten();
    let (Some(q), Some(k), Some(v)) = (x(0), x(1), x(2)) else { return Err(missing(l)) };
    let base = l.g.value_name(Value::new(n, 0)).to_string();
    if !matches!(l.g.node(n).op, Op::AttentionGrad(_)) {
        let (y, _) = forward_ring(l, &ring, (q, k, v), 0, &base)?;
        let y = named(l, y, &out_names[0]);
        // The present keys and values (no cache): the inputs.
        let mut outs = vec![y, k, v];
        outs.truncate(out_names.len().max(1));
        return Ok(outs);
    }
    let (Some(dy), Some(y)) = (x(3), x(4)) else { return Err(missing(l)) };
    let (_, lse) = forward_ring(l, &ring, (q, k, v), 1, &base)?;
    let (mut kc, mut vc) = (k, v);
    let mut dq: Option<Value> = None;
    let mut sums: Option<(Value, Value)> = None;
    for r in 0..ring.c {
        let src = ring.src(r);
        let next = rotate(l, &ring, (kc, vc), 2, r, &base);
        if ring.sees(src) {
            let (is_causal, q_offset, k_offset, scale) = ring.mask(src);
            let op = o::AttentionGrad { is_causal, q_offset, k_offset, scale };
            let names = ["dq", "dk", "dv"].map(|w| l.fresh(&format!("{base}__block_{w}")));
            let ins = [q, kc, vc, dy, y, lse].map(Some).to_vec();
            let g = l.emit(Op::AttentionGrad(op), ins, &names);
            dq = Some(match dq {
                Some(a) => l.op1(Op::Add(o::Add {}), &[a, g[0]], &format!("{base}__dq")),
                None => g[0],
            });
            sums = Some(match sums {
                Some((a, b)) => (
                    l.op1(Op::Add(o::Add {}), &[a, g[1]], &format!("{base}__dk")),
                    l.op1(Op::Add(o::Add {}), &[b, g[2]], &format!("{base}__dv")),
                ),
                None => (g[1], g[2]),
            });
        }
        let (a, b) = sums.ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "ring gradient without a block"))?;
        let dk = pass(l, &ring, a, &ring.k, ring.tag(2, r, 2), &format!("{base}__ring_dk"));
        let dv = pass(l, &ring, b, &ring.v, ring.tag(2, r, 3), &format!("{base}__ring_dv"));
        sums = Some((dk, dv));
        if let Some((kn, vn)) = next {
            (kc, vc) = (kn, vn);
        }
    }
    let (Some((dk, dv)), Some(dq)) = (sums, dq) else { return Err(missing(l)) };
    Ok([dq, dk, dv].iter().zip(out_names).map(|(&v, name)| named(l, v, name)).collect())
}

/// `v` under the output's name (an unnamed output: as it is).
fn named(l: &mut Local<'_>, v: Value, name: &str) -> Value {
    if name.is_empty() { v } else { l.op_named(Op::Identity(o::Identity {}), &[v], name) }
}
