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
//! Zig-zag load balancing (causal, even rows: [`ir::ops::flash::zigzag`]): the sequence is
//! cut into `2c` chunks and device `d` runs the ring on chunks `d` and `2c − 1 − d`, which it
//! gathers from the devices holding them first (its own rows are chunks `2d`, `2d + 1`) and
//! sends back after; every block is then a pair of chunks, each device computing the same
//! share of the causal blocks where a plain ring's last device computes `2c − 1` halves.
//!
//! Every pass is a `Send` to the next device and a `Recv` from the previous one, tagged per
//! op, pass and tensor; the cost model prices these passes and the zig-zag's moves
//! (passes/src/cost/model/ring.rs).

use ir::op::{self as o, Op};
use ir::shard::{IterSpace, strategy_shardings};
use ir::{NodeId, Value};

use super::local::Local;
use super::{LowerError, LowerErrorKind};

/// The tags of ring messages start here (pipeline tags are value indices, far below).
const TAG_BASE: i64 = 1 << 40;

/// The tags' pass numbers of the zig-zag's moves in and out.
const MOVE_IN: usize = 3;
const MOVE_OUT: usize = 4;

/// One device's place on the ring.
struct Ring {
    /// This device's index on the axis, and the axis' size.
    d: usize,
    c: usize,
    /// Global ids of the axis' devices, in order.
    group: Vec<i64>,
    /// Positions per device.
    n: usize,
    causal: bool,
    scale: Option<f32>,
    /// Zig-zag load balancing.
    zigzag: bool,
    /// The op's node (for tags and names).
    node: NodeId,
    /// One chunk of the local keys and values.
    k: Piece,
    v: Piece,
}

impl Ring {
    /// The device whose block this one holds in step `r`.
    fn src(&self, r: usize) -> usize {
        (self.d + self.c - r % self.c) % self.c
    }

    fn next(&self) -> i64 {
        self.group[(self.d + 1) % self.c]
    }

    fn prev(&self) -> i64 {
        self.group[(self.d + self.c - 1) % self.c]
    }

    /// Positions per chunk.
    fn rows(&self) -> usize {
        if self.zigzag { self.n / 2 } else { self.n }
    }

    /// The first positions of the chunks device `dev` runs the ring on.
    fn chunks(&self, dev: usize) -> Vec<usize> {
        if self.zigzag {
            ir::ops::flash::zigzag_chunks(dev, self.c).iter().map(|g| g * self.rows()).collect()
        } else {
            vec![dev * self.n]
        }
    }

    /// Whether query chunk at `q` sees any key of the key chunk at `k` (equal chunks on a
    /// chunk grid).
    fn sees(&self, q: usize, k: usize) -> bool {
        !self.causal || k <= q
    }

    /// The mask attributes of the block of query chunk `q` and key chunk `k`.
    fn mask(&self, q: usize, k: usize) -> (Option<i64>, Option<i64>, Option<i64>, Option<f32>) {
        (Some(i64::from(self.causal)), Some(q as i64), Some(k as i64), self.scale)
    }

    fn tag(&self, pass: usize, r: usize, what: usize) -> i64 {
        TAG_BASE + ((self.node.index() as i64 * 8 + pass as i64) * 4096 + r as i64) * 16 + what as i64
    }
}

/// A tensor that travels the ring: its local shape and element type.
#[derive(Clone)]
struct Piece {
    shape: Vec<i64>,
    dtype: i64,
}

impl Piece {
    /// The piece of `rows` positions (dim 2).
    fn with_rows(&self, rows: usize) -> Piece {
        let mut shape = self.shape.clone();
        shape[2] = rows as i64;
        Piece { shape, dtype: self.dtype }
    }
}

/// `x` sent to device `to` with `tag`.
fn send(l: &mut Local<'_>, to: i64, x: Value, tag: i64) {
    l.emit(Op::Send(o::Send { peer: Some(to), tag: Some(tag) }), vec![Some(x)], &[]);
}

/// What device `from` sent with `tag`.
fn recv(l: &mut Local<'_>, from: i64, piece: &Piece, tag: i64, base: &str) -> Value {
    let name = l.fresh(base);
    let recv = o::Recv { dtype: Some(piece.dtype), peer: Some(from), shape: Some(piece.shape.clone()), tag: Some(tag) };
    l.emit(Op::Recv(recv), vec![], &[name])[0]
}

/// `x` sent to the next device and its counterpart received from the previous one.
fn pass(l: &mut Local<'_>, ring: &Ring, x: Value, piece: &Piece, tag: i64, base: &str) -> Value {
    send(l, ring.next(), x, tag);
    recv(l, ring.prev(), piece, tag, base)
}

/// Step `r` of ring `pass_no`: the keys' and values' chunks held, passed on and the next
/// received (none after the last step).
fn rotate(
    l: &mut Local<'_>,
    ring: &Ring,
    (k, v): (&[Value], &[Value]),
    pass_no: usize,
    r: usize,
    base: &str,
) -> Option<(Vec<Value>, Vec<Value>)> {
    (r + 1 < ring.c).then(|| {
        let kn = k
            .iter()
            .enumerate()
            .map(|(i, &x)| pass(l, ring, x, &ring.k, ring.tag(pass_no, r, i), &format!("{base}__ring_k")))
            .collect();
        let vn = v
            .iter()
            .enumerate()
            .map(|(i, &x)| pass(l, ring, x, &ring.v, ring.tag(pass_no, r, 2 + i), &format!("{base}__ring_v")))
            .collect();
        (kn, vn)
    })
}

/// Positions `a..b` (dim 2) of `x`.
fn rows_of(l: &mut Local<'_>, x: Value, (a, b): (usize, usize), base: &str) -> Value {
    let st = l.const_i64(&format!("{base}__starts"), &[a as i64]);
    let en = l.const_i64(&format!("{base}__ends"), &[b as i64]);
    let ax = l.const_i64(&format!("{base}__axes"), &[2]);
    l.op1(Op::Slice(o::Slice::default()), &[x, st, en, ax], &format!("{base}__chunk"))
}

/// The zig-zag's move in of local tensor `x` (rows `d·n ..`, chunks `2d`, `2d + 1`): the
/// ring's chunks `d`, `2c − 1 − d`, each from the device that holds it (`what` numbers the
/// tensor within the op).
fn move_in(l: &mut Local<'_>, ring: &Ring, x: Value, piece: &Piece, what: usize, base: &str) -> Vec<Value> {
    let (d, c, h) = (ring.d, ring.c, ring.rows());
    let halves = [rows_of(l, x, (0, h), base), rows_of(l, x, (h, 2 * h), base)];
    for (i, g) in [2 * d, 2 * d + 1].into_iter().enumerate() {
        let to = ir::ops::flash::zigzag_owner(g, c);
        if to != d {
            send(l, ring.group[to], halves[i], ring.tag(MOVE_IN, g, what));
        }
    }
    let chunk = piece.with_rows(h);
    ir::ops::flash::zigzag_chunks(d, c)
        .into_iter()
        .map(|t| match t / 2 {
            from if from == d => halves[t % 2],
            from => recv(l, ring.group[from], &chunk, ring.tag(MOVE_IN, t, what), &format!("{base}__zigzag")),
        })
        .collect()
}

/// The zig-zag's move out: the ring's chunks `ys` of a result sent back to the devices whose
/// rows they are, and this device's rows, chunks `2d`, `2d + 1`, concatenated, named `name`.
fn move_out(l: &mut Local<'_>, ring: &Ring, ys: &[Value], piece: &Piece, what: usize, name: &str) -> Value {
    let (d, c, h) = (ring.d, ring.c, ring.rows());
    let mine = ir::ops::flash::zigzag_chunks(d, c);
    for (i, &t) in mine.iter().enumerate() {
        if t / 2 != d {
            send(l, ring.group[t / 2], ys[i], ring.tag(MOVE_OUT, t, what));
        }
    }
    let chunk = piece.with_rows(h);
    let parts: Vec<Value> = [2 * d, 2 * d + 1]
        .into_iter()
        .map(|g| match ir::ops::flash::zigzag_owner(g, c) {
            from if from == d => ys[mine.iter().position(|&t| t == g).unwrap_or(0)],
            from => recv(l, ring.group[from], &chunk, ring.tag(MOVE_OUT, g, what), &format!("{name}__zigzag")),
        })
        .collect();
    let op = Op::Concat(o::Concat { axis: Some(2) });
    if name.is_empty() { l.op1(op, &parts, "zigzag_out") } else { l.op_named(op, &parts, name) }
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
    let (d, c, rows) = (l.coords[axis], group.len(), end - start);
    if start != d * rows {
        return Err(l.err(Some(n), LowerErrorKind::Placement, "ring attention's rows are not the axis' even split"));
    }
    let zigzag = ir::ops::flash::zigzag(causal, rows, c);
    let chunk = if zigzag { rows / 2 } else { rows };
    Ok(Ring {
        d,
        c,
        group,
        n: rows,
        causal,
        scale,
        zigzag,
        node: n,
        k: piece(l, n, sp, s, 1)?.with_rows(chunk),
        v: piece(l, n, sp, s, 2)?.with_rows(chunk),
    })
}

/// Each query chunk's running output and log-sum-exp over every block of the ring (`pass`
/// numbers the ring within the op).
fn forward_ring(
    l: &mut Local<'_>,
    ring: &Ring,
    qs: &[Value],
    (k, v): (Vec<Value>, Vec<Value>),
    pass_no: usize,
    base: &str,
) -> Result<Vec<(Value, Value)>, LowerError> {
    let (mut kc, mut vc) = (k, v);
    let mut acc: Vec<Option<(Value, Value)>> = vec![None; qs.len()];
    let mine = ring.chunks(ring.d);
    for r in 0..ring.c {
        let theirs = ring.chunks(ring.src(r));
        let next = rotate(l, ring, (&kc, &vc), pass_no, r, base);
        for (qi, &q) in qs.iter().enumerate() {
            for (ki, &ko) in theirs.iter().enumerate() {
                if !ring.sees(mine[qi], ko) {
                    continue;
                }
                let (is_causal, q_offset, k_offset, scale) = ring.mask(mine[qi], ko);
                let op = o::AttentionBlock { is_causal, q_offset, k_offset, scale };
                let mut ins = vec![Some(q), Some(kc[ki]), Some(vc[ki])];
                if let Some((y, lse)) = acc[qi] {
                    ins.extend([Some(y), Some(lse)]);
                }
                let names = [l.fresh(&format!("{base}__block_y")), l.fresh(&format!("{base}__block_lse"))];
                let out = l.emit(Op::AttentionBlock(op), ins, &names);
                acc[qi] = Some((out[0], out[1]));
            }
        }
        if let Some((kn, vn)) = next {
            (kc, vc) = (kn, vn);
        }
    }
    // The first step's blocks include each chunk's own: every query sees at least itself.
    acc.into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| l.err(Some(ring.node), LowerErrorKind::Graph, "ring attention computed no block"))
}

/// The chunks the ring runs on of local tensor `x` (`what` numbers it within the op): the
/// zig-zag's, or `x` itself.
fn chunked(l: &mut Local<'_>, ring: &Ring, x: Value, piece: &Piece, what: usize, base: &str) -> Vec<Value> {
    if ring.zigzag { move_in(l, ring, x, piece, what, base) } else { vec![x] }
}

/// A result from its chunks, named `name`.
fn unchunked(l: &mut Local<'_>, ring: &Ring, ys: &[Value], piece: &Piece, what: usize, name: &str) -> Value {
    if ring.zigzag { move_out(l, ring, ys, piece, what, name) } else { named(l, ys[0], name) }
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
    let pq = piece(l, n, sp, s, 0)?;
    let full = |p: &Piece| p.with_rows(ring.n);
    // The output's (and dY's) piece: the queries' rows, the values' head dim.
    let mut py = pq.clone();
    py.shape[3] = ring.v.shape[3];
    let (qs, ks, vs) = (
        chunked(l, &ring, q, &pq, 0, &base),
        chunked(l, &ring, k, &full(&ring.k), 1, &base),
        chunked(l, &ring, v, &full(&ring.v), 2, &base),
    );
    if !matches!(l.g.node(n).op, Op::AttentionGrad(_)) {
        let out = forward_ring(l, &ring, &qs, (ks, vs), 0, &base)?;
        let ys: Vec<Value> = out.iter().map(|o| o.0).collect();
        let y = unchunked(l, &ring, &ys, &py, 0, &out_names[0]);
        // The present keys and values (no cache): the inputs.
        let mut outs = vec![y, k, v];
        outs.truncate(out_names.len().max(1));
        return Ok(outs);
    }
    let (Some(dy), Some(y)) = (x(3), x(4)) else { return Err(missing(l)) };
    let (dys, ys) = (chunked(l, &ring, dy, &py, 3, &base), chunked(l, &ring, y, &py, 4, &base));
    let lses: Vec<Value> =
        forward_ring(l, &ring, &qs, (ks.clone(), vs.clone()), 1, &base)?.into_iter().map(|o| o.1).collect();
    let (mut kc, mut vc) = (ks, vs);
    let mut dq: Vec<Option<Value>> = vec![None; qs.len()];
    let mut sums: Vec<Option<(Value, Value)>> = vec![None; kc.len()];
    let mine = ring.chunks(ring.d);
    let add = |l: &mut Local<'_>, a: Option<Value>, b: Value, what: &str| match a {
        Some(a) => l.op1(Op::Add(o::Add {}), &[a, b], &format!("{base}__{what}")),
        None => b,
    };
    for r in 0..ring.c {
        let theirs = ring.chunks(ring.src(r));
        let next = rotate(l, &ring, (&kc, &vc), 2, r, &base);
        for (qi, &qo) in mine.iter().enumerate() {
            for (ki, &ko) in theirs.iter().enumerate() {
                if !ring.sees(qo, ko) {
                    continue;
                }
                let (is_causal, q_offset, k_offset, scale) = ring.mask(qo, ko);
                let op = o::AttentionGrad { is_causal, q_offset, k_offset, scale };
                let names = ["dq", "dk", "dv"].map(|w| l.fresh(&format!("{base}__block_{w}")));
                let ins = [qs[qi], kc[ki], vc[ki], dys[qi], ys[qi], lses[qi]].map(Some).to_vec();
                let g = l.emit(Op::AttentionGrad(op), ins, &names);
                dq[qi] = Some(add(l, dq[qi], g[0], "dq"));
                let (a, b) = sums[ki].unzip();
                sums[ki] = Some((add(l, a, g[1], "dk"), add(l, b, g[2], "dv")));
            }
        }
        for (ki, sum) in sums.iter_mut().enumerate() {
            let (a, b) = sum.ok_or_else(|| l.err(Some(n), LowerErrorKind::Graph, "ring gradient without a block"))?;
            let dk = pass(l, &ring, a, &ring.k, ring.tag(2, r, 4 + ki), &format!("{base}__ring_dk"));
            let dv = pass(l, &ring, b, &ring.v, ring.tag(2, r, 6 + ki), &format!("{base}__ring_dv"));
            *sum = Some((dk, dv));
        }
        if let Some((kn, vn)) = next {
            (kc, vc) = (kn, vn);
        }
    }
    let dq: Option<Vec<Value>> = dq.into_iter().collect();
    let sums: Option<Vec<(Value, Value)>> = sums.into_iter().collect();
    let (Some(dq), Some(sums)) = (dq, sums) else { return Err(missing(l)) };
    let (dk, dv): (Vec<Value>, Vec<Value>) = sums.into_iter().unzip();
    let pieces = [pq, full(&ring.k), full(&ring.v)];
    let grads = [dq, dk, dv];
    Ok(grads
        .iter()
        .zip(&pieces)
        .zip(out_names)
        .enumerate()
        .map(|(i, ((g, p), name))| unchunked(l, &ring, g, p, i, name))
        .collect())
}

/// `v` under the output's name (an unnamed output: as it is).
fn named(l: &mut Local<'_>, v: Value, name: &str) -> Value {
    if name.is_empty() { v } else { l.op_named(Op::Identity(o::Identity {}), &[v], name) }
}
