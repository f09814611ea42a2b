//! Convolutions and pooling on pieces split along their batch and channel dims: the images
//! and output channels a device holds give those of the output; input channels held in part
//! give a partial sum (with the bias as one more term, as for `Gemm`). Spatial dims must be
//! held whole: a split image needs its neighbours' rows (halo exchange), which the prover
//! does not cover yet.

use ir::NodeId;
use ir::op::Op;

use super::rules::{Cx, Out, Why, op_key, wrong};
use super::term::{Fact, Head, Region, Share, TermId};

fn spatial_whole(cx: &Cx<'_>, f: &Fact, what: &str) -> Result<(), Why> {
    let s = cx.terms.shape(f.term);
    if (2..s.len()).any(|d| f.region[d] != (0, s[d])) {
        return Err(Why::Uncovered(format!("{what} on a spatial part {:?} (halo exchange is not covered)", f.region)));
    }
    Ok(())
}

fn group(op: &Op) -> i64 {
    match op {
        Op::Conv(c) => c.group.unwrap_or(1),
        Op::ConvGradInput(c) => c.group.unwrap_or(1),
        Op::ConvGradWeight(c) => c.group.unwrap_or(1),
        Op::ConvTranspose(c) => c.group.unwrap_or(1),
        _ => 1,
    }
}

fn input(ins: &[Option<Fact>], k: usize) -> Result<&Fact, Why> {
    ins.get(k).and_then(Option::as_ref).ok_or_else(|| Why::Uncovered(format!("a convolution without input {k}")))
}

/// The global op of `key` on `a`, `b` and a third input (a bias this device leaves out).
fn with_bias(cx: &Cx<'_>, key: &str, a: TermId, b: TermId) -> Option<TermId> {
    cx.terms.users(a).iter().copied().find(|&u| {
        matches!(cx.terms.head(u), Head::Op { key: k, slot: 0 } if k == key)
            && cx.terms.inputs(u).len() == 3
            && cx.terms.inputs(u)[..2] == [a, b]
    })
}

/// A partial sum over `k` elements held in `held` (and the bias slot where the sum has one).
fn partial(t: TermId, k: i64, held: (i64, i64), bias_global: bool, bias_here: bool) -> Vec<Share> {
    let mut h = vec![vec![held]];
    if bias_here {
        h.push(vec![(k, k + 1)]);
    }
    let s = Share { site: t, space: vec![k + i64::from(bias_global)], held: h, max: false };
    if s.complete() { Vec::new() } else { vec![s] }
}

/// Conv, ConvTranspose, ConvGradInput and ConvGradWeight.
pub fn apply(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
    if let Op::Conv(_) = op {
        return conv(cx, n, ins);
    }
    let (a, b) = (input(ins, 0)?, input(ins, 1)?);
    if ins.iter().flatten().any(|f| !f.is_exact()) {
        return wrong(format!("a partial sum reaches {}", op.op_type()));
    }
    spatial_whole(cx, a, op.op_type())?;
    spatial_whole(cx, b, op.op_type())?;
    let key = op_key(&op);
    let Some(local) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("a convolution of unknown shape".into())) };
    let (sa, sb) = (cx.terms.shape(a.term).to_vec(), cx.terms.shape(b.term).to_vec());
    let g = group(&op);
    // (output dim 0 from, output dim 1 from, the contracted dims of the two inputs).
    let (d0, d1, ka, kb, shape) = match op {
        // X [N, C, ..], W [M, C/g, ..] → [N, M, ..]; sums over C.
        Op::Conv(_) => (a.region[0], b.region[0], a.region[1], b.region[1], [sa[0], sb[0]]),
        // dY [N, M, ..], W [M, C/g, ..] → dX [N, C, ..]; sums over M. ConvTranspose is the
        // same product: X [N, C, ..], W [C, M/g, ..] → Y [N, M, ..], summed over C.
        Op::ConvGradInput(_) | Op::ConvTranspose(_) => {
            (a.region[0], b.region[1], a.region[1], b.region[0], [sa[0], sb[1] * g])
        }
        // X [N, C, ..], dY [N, M, ..] → dW [M, C/g, ..]; sums over N.
        _ => (b.region[1], a.region[1], a.region[0], b.region[0], [sb[1], sa[1] / g]),
    };
    let (mut d1, mut ka, mut kb) = (d1, ka, kb);
    if g != 1 {
        // Grouped: the channels of every operand held whole (a device may hold some images).
        let whole_ch = |f: &Fact, s: &[i64], dims: &[usize]| dims.iter().all(|&d| f.region[d] == (0, s[d]));
        let ok = match op {
            Op::ConvGradInput(_) | Op::ConvTranspose(_) => whole_ch(a, &sa, &[1]) && whole_ch(b, &sb, &[0, 1]),
            _ => whole_ch(a, &sa, &[1]) && whole_ch(b, &sb, &[1]),
        };
        if !ok {
            return Err(Why::Uncovered(format!("a grouped {} split along its channels", op.op_type())));
        }
        d1 = (0, shape[1]);
        if matches!(op, Op::ConvGradInput(_) | Op::ConvTranspose(_)) {
            (ka, kb) = ((0, 1), (0, 1));
        }
    }
    if ka != kb {
        return wrong(format!("{} operands hold different parts of the summed dim: {ka:?} and {kb:?}", op.op_type()));
    }
    let mut gshape = shape.to_vec();
    gshape.extend(&local[2..]);
    let mut region: Region = vec![d0, d1];
    region.extend(local[2..].iter().map(|&d| (0, d)));
    let k = match op {
        Op::ConvGradWeight(_) => sa[0],
        _ if g != 1 => 1,
        _ => sa[1],
    };
    let c = ins.get(2).and_then(Option::as_ref);
    let (t, bias_global, bias_here) = match c {
        Some(c) => {
            if c.region != vec![region[1]] {
                return wrong(format!("the bias holds {:?}, the output channels {:?}", c.region, region[1]));
            }
            (cx.terms.op(&key, 0, &[a.term, b.term, c.term], &gshape), true, true)
        }
        None => match with_bias(cx, &key, a.term, b.term) {
            Some(t) => (t, true, false),
            None => (cx.terms.op(&key, 0, &[a.term, b.term], &gshape), false, false),
        },
    };
    let shares = partial(t, k, ka, bias_global, bias_here);
    Ok(vec![Some(Fact { term: t, region, shares, alts: Vec::new() })])
}

/// Pooling and its gradients: each image's channel on its own, spatial dims held whole (or,
/// for a pooling window, rows with their halo).
pub fn per_channel(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
    if matches!(op, Op::MaxPool(_) | Op::AveragePool(_)) {
        return pool(cx, n, ins);
    }
    if matches!(op, Op::GlobalAveragePool(_)) {
        return global_average(cx, &op, ins);
    }
    let facts: Vec<&Fact> = ins.iter().flatten().collect();
    let Some(first) = facts.first() else { return wrong("no input") };
    for f in &facts {
        if !f.is_exact() {
            return wrong(format!("a partial sum reaches {}", op.op_type()));
        }
        spatial_whole(cx, f, op.op_type())?;
        if f.region[..2] != first.region[..2] {
            return wrong(format!("{} operands hold {:?} and {:?}", op.op_type(), first.region, f.region));
        }
    }
    let s = cx.terms.shape(first.term).to_vec();
    let key = op_key(&op);
    let terms: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let mut out = Vec::new();
    for slot in 0..cx.g.node(n).num_outputs() {
        let Some(local) = cx.out_dims(n, slot) else {
            out.push(None);
            continue;
        };
        let mut shape = vec![s[0], s[1]];
        shape.extend(&local[2..]);
        let mut region: Region = first.region[..2].to_vec();
        region.extend(local[2..].iter().map(|&d| (0, d)));
        let t = cx.terms.op(&key, slot as u16, &terms, &shape);
        out.push(Some(Fact::exact(t, region)));
    }
    Ok(out)
}

/// InstanceNormalization: each image's channel normalized over its spatial dims. On a part
/// whole along them, the part of the op on the whole input, its scale and bias (per channel)
/// held at the part's channels.
pub fn instance_norm(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
    let x = input(ins, 0)?;
    if ins.iter().flatten().any(|f| !f.is_exact()) {
        return wrong("a partial sum reaches InstanceNormalization");
    }
    let shape = cx.terms.shape(x.term).to_vec();
    if shape.len() < 3 {
        return Err(Why::Uncovered(format!("InstanceNormalization of rank {}", shape.len())));
    }
    if (2..shape.len()).any(|d| x.region[d] != (0, shape[d])) {
        return wrong(format!("InstanceNormalization over the spatial dims, held in part: {:?}", x.region));
    }
    let mut terms = vec![x.term];
    for (k, what) in [(1, "scale"), (2, "bias")] {
        let f = input(ins, k)?;
        if f.region != vec![x.region[1]] {
            return wrong(format!(
                "InstanceNormalization's {what} holds {:?}, X the channels {:?}",
                f.region, x.region[1]
            ));
        }
        terms.push(f.term);
    }
    let t = cx.terms.op(&op_key(&op), 0, &terms, &shape);
    Ok(vec![Some(Fact::exact(t, x.region.clone()))])
}

/// The op without its padding (which a device's piece makes its own): the part of a
/// windowed op's key the devices share; the global padding goes after it.
fn window_base(op: &Op) -> String {
    let mut op = op.clone();
    match &mut op {
        Op::Conv(c) => (c.pads, c.auto_pad) = (None, None),
        Op::MaxPool(p) => (p.pads, p.auto_pad, p.ceil_mode) = (None, None, None),
        Op::AveragePool(p) => (p.pads, p.auto_pad, p.ceil_mode) = (None, None, None),
        _ => {}
    }
    op_key(&op)
}

fn pads_key(base: &str, pads: &[(i64, i64)]) -> String {
    format!("{base}|pads={pads:?}")
}

fn parse_pads(key: &str, base: &str) -> Option<Vec<(i64, i64)>> {
    let rest = key.strip_prefix(base)?.strip_prefix("|pads=")?;
    let nums: Vec<i64> = rest
        .split(|c: char| !c.is_ascii_digit() && c != '-')
        .filter(|x| !x.is_empty())
        .filter_map(|x| x.parse().ok())
        .collect();
    nums.len().is_multiple_of(2).then(|| nums.chunks(2).map(|c| (c[0], c[1])).collect())
}

/// The local window's geometry: per spatial dim (pad before, pad after, stride, extent).
fn local_window(cx: &Cx<'_>, n: NodeId) -> Result<Vec<(i64, i64, i64, i64)>, Why> {
    let (_, w, _) =
        ir::ops::split::window_of(cx.g, n).ok_or_else(|| Why::Uncovered("a window of unknown geometry".into()))?;
    Ok((0..w.kernel.len())
        .map(|i| {
            let eff = (w.kernel[i] as i64 - 1) * w.dilations[i] as i64 + 1;
            (w.pad_begin[i] as i64, w.pad_end[i] as i64, w.strides[i] as i64, eff)
        })
        .collect())
}

/// The output rows a device's window computes from input rows `(a, b)` of a dim of extent
/// `h`, under its own padding and the graph's (`global`), `n_l` rows out of `o`.
fn window_rows(
    x: (i64, i64),
    h: i64,
    local: (i64, i64, i64, i64),
    global: (i64, i64),
    n_l: i64,
    o: i64,
) -> Result<(i64, i64), String> {
    let ((a, b), (pb, pe, s, eff), (gb, ge)) = (x, local, global);
    if pb > 0 && a != 0 {
        return Err(format!("pads {pb} before rows {a}.., which are not the first"));
    }
    let start = a - pb + gb;
    if start < 0 || start % s != 0 {
        return Err(format!("its first window starts at row {} of the graph's window grid", a - pb));
    }
    let end = a - pb + (n_l - 1) * s + eff;
    // Past the last row, the window reads the op's own end padding (with `ceil_mode`, beyond
    // the pads): the same on a device that holds the last rows as on the graph.
    let _ = ge;
    if b != h && (end > b || pe > 0) {
        return Err(format!("its last window reads to row {end}, past the rows {a}..{b} it holds"));
    }
    let o0 = start / s;
    if o0 + n_l > o {
        return Err(format!("computes output rows {o0}..{} of {o}", o0 + n_l));
    }
    Ok((o0, o0 + n_l))
}

/// A windowed op of the graph a device's op may stand for (none: on the graph itself), and
/// its padding.
type Candidate = (Option<TermId>, Vec<(i64, i64)>);

/// The graph's windowed ops of `base` reading `ins` (first the terms of this op on whole
/// inputs): their terms, global padding and shapes.
fn window_candidates(cx: &Cx<'_>, n: NodeId, base: &str, ins: &[TermId]) -> Result<Vec<Candidate>, Why> {
    if cx.global {
        let w = local_window(cx, n)?;
        return Ok(vec![(None, w.iter().map(|x| (x.0, x.1)).collect())]);
    }
    Ok(cx
        .terms
        .users(ins[0])
        .iter()
        .copied()
        .filter(|&u| cx.terms.inputs(u).len() >= ins.len() && cx.terms.inputs(u)[..ins.len()] == ins[..])
        .filter_map(|u| match cx.terms.head(u) {
            Head::Op { key, slot: 0 } => parse_pads(key, base).map(|p| (Some(u), p)),
            _ => None,
        })
        .collect())
}

/// The spatial boxes of the output of a windowed op on `x` for one candidate.
fn spatial_out(cx: &Cx<'_>, n: NodeId, x: &Fact, pads: &[(i64, i64)], gshape: &[i64]) -> Result<Region, String> {
    let local = local_window(cx, n).map_err(|_| "a window of unknown geometry".to_string())?;
    let lout = cx.out_dims(n, 0).ok_or("an output of unknown shape")?;
    let xs = cx.terms.shape(x.term);
    (0..local.len())
        .map(|i| window_rows(x.region[2 + i], xs[2 + i], local[i], pads[i], lout[2 + i], gshape[2 + i]))
        .collect()
}

/// Conv on pieces of its input split along batch, input channels and spatial rows (with
/// halos), and of its weight along output channels.
fn conv(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
    let (x, w) = (input(ins, 0)?, input(ins, 1)?);
    if ins.iter().flatten().any(|f| !f.is_exact()) {
        return wrong("a partial sum reaches Conv");
    }
    spatial_whole(cx, w, "Conv's weight")?;
    let (sx, sw) = (cx.terms.shape(x.term).to_vec(), cx.terms.shape(w.term).to_vec());
    let (ka, kb) = (x.region[1], w.region[1]);
    // The graph's group count, from the whole operands: input channels over a filter's.
    let groups = if sw[1] > 0 && sx[1] % sw[1] == 0 { sx[1] / sw[1] } else { 1 };
    let op = if groups > 1 {
        held_groups(&op, groups, x, w, &sw)?
    } else if ka != kb {
        return wrong(format!("Conv operands hold different parts of the input channels: {ka:?} and {kb:?}"));
    } else {
        op
    };
    let g = groups;
    let Some(lout) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("a Conv of unknown shape".into())) };
    let base = window_base(&op);
    let mut why = String::from("no convolution of the graph reads these operands");
    for (cand, pads) in window_candidates(cx, n, &base, &[x.term, w.term])? {
        let gshape: Vec<i64> = match cand {
            Some(t) => cx.terms.shape(t).to_vec(),
            None => [sx[0], sw[0]].into_iter().chain(lout[2..].iter().copied()).collect(),
        };
        let spatial = match spatial_out(cx, n, x, &pads, &gshape) {
            Ok(r) => r,
            Err(e) => {
                why = e;
                continue;
            }
        };
        let key = pads_key(&base, &pads);
        let mut region: Region = vec![x.region[0], w.region[0]];
        region.extend(spatial);
        let c = ins.get(2).and_then(Option::as_ref);
        let (t, bias_global, bias_here) = match c {
            Some(c) => {
                let Some(c) = c.at(&vec![region[1]]) else {
                    return wrong(format!("the bias holds {:?}, the output channels {:?}", c.region, region[1]));
                };
                (cx.terms.op(&key, 0, &[x.term, w.term, c.term], &gshape), true, true)
            }
            None => match cand.filter(|&t| cx.terms.inputs(t).len() == 3) {
                Some(t) => (t, true, false),
                None => (cx.terms.op(&key, 0, &[x.term, w.term], &gshape), false, false),
            },
        };
        let k = if g == 1 { sx[1] } else { 1 };
        let held = if g == 1 { ka } else { (0, 1) };
        let shares = partial(t, k, held, bias_global, bias_here);
        return Ok(vec![Some(Fact { term: t, region, shares, alts: Vec::new() })]);
    }
    wrong(format!("Conv on rows {:?}: {why}", x.region))
}

/// A grouped convolution of `groups` groups on whole groups: the device holds the input
/// channels of groups g0..g1 with their filters (every filter's channels whole), and runs the
/// op with `group` g1 − g0. Returns the graph's op (its `group` the graph's).
fn held_groups(op: &Op, groups: i64, x: &Fact, w: &Fact, sw: &[i64]) -> Result<Op, Why> {
    let (ka, kb, cin) = (x.region[1], w.region[1], sw[1]);
    let cout = sw[0] / groups;
    let (g0, g1) = (ka.0 / cin, ka.1 / cin);
    if kb != (0, cin) || ka.0 % cin != 0 || ka.1 % cin != 0 {
        return wrong(format!("a grouped Conv on input channels {ka:?}, not whole groups of {cin}"));
    }
    if w.region[0] != (g0 * cout, g1 * cout) || group(op) != g1 - g0 {
        return wrong(format!(
            "a grouped Conv holding the input channels of groups {g0}..{g1} runs filters {:?} in {} groups",
            w.region[0],
            group(op)
        ));
    }
    let mut op = op.clone();
    if let Op::Conv(c) = &mut op {
        c.group = Some(groups);
    }
    Ok(op)
}

/// MaxPool and AveragePool on pieces split along batch, channels and spatial rows.
fn pool(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
    let x = input(ins, 0)?;
    if !x.is_exact() {
        return wrong(format!("a partial sum reaches {}", op.op_type()));
    }
    let Some(lout) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("a pool of unknown shape".into())) };
    let sx = cx.terms.shape(x.term).to_vec();
    let base = window_base(&op);
    let mut why = String::from("no pooling of the graph reads this value");
    for (cand, pads) in window_candidates(cx, n, &base, &[x.term])? {
        let gshape: Vec<i64> = match cand {
            Some(t) => cx.terms.shape(t).to_vec(),
            None => [sx[0], sx[1]].into_iter().chain(lout[2..].iter().copied()).collect(),
        };
        let spatial = match spatial_out(cx, n, x, &pads, &gshape) {
            Ok(r) => r,
            Err(e) => {
                why = e;
                continue;
            }
        };
        let mut region: Region = x.region[..2].to_vec();
        region.extend(spatial);
        let mut out = Vec::new();
        for slot in 0..cx.g.node(n).num_outputs() {
            let t = cx.terms.op(&pads_key(&base, &pads), slot as u16, &[x.term], &gshape);
            out.push(Some(Fact::exact(t, region.clone())));
        }
        return Ok(out);
    }
    wrong(format!("{} on rows {:?}: {why}", op.op_type(), x.region))
}

/// GlobalAveragePool: the mean over the spatial dims; over the rows a device holds, a partial
/// sum of the mean times (all rows / rows held), as for ReduceMean.
fn global_average(cx: &mut Cx<'_>, op: &Op, ins: &[Option<Fact>]) -> Out {
    let x = input(ins, 0)?;
    if !x.is_exact() {
        return wrong("a partial sum reaches GlobalAveragePool");
    }
    let s = cx.terms.shape(x.term).to_vec();
    let mut shape = s[..2].to_vec();
    shape.extend(std::iter::repeat_n(1, s.len() - 2));
    let t = cx.terms.op(&op_key(op), 0, &[x.term], &shape);
    let mut region: Region = x.region[..2].to_vec();
    region.extend(std::iter::repeat_n((0, 1), s.len() - 2));
    let held: Region = x.region[2..].to_vec();
    let space: Vec<i64> = s[2..].to_vec();
    if held.iter().zip(&space).all(|(r, &d)| *r == (0, d)) {
        return Ok(vec![Some(Fact::exact(t, region))]);
    }
    let all: i64 = space.iter().product();
    let part: i64 = held.iter().map(|(a, b)| b - a).product();
    let term = cx.terms.scaled(t, all as f64 / part as f64);
    let shares = vec![Share { site: t, space, held: vec![held], max: false }];
    Ok(vec![Some(Fact { term, region, shares, alts: Vec::new() })])
}
