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

/// Conv, ConvGradInput and ConvGradWeight.
pub fn apply(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
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
        // dY [N, M, ..], W [M, C/g, ..] → dX [N, C, ..]; sums over M.
        Op::ConvGradInput(_) => (a.region[0], b.region[1], a.region[1], b.region[0], [sa[0], sb[1] * g]),
        // X [N, C, ..], dY [N, M, ..] → dW [M, C/g, ..]; sums over N.
        _ => (b.region[1], a.region[1], a.region[0], b.region[0], [sb[1], sa[1] / g]),
    };
    if g != 1 && (ka != (0, if matches!(op, Op::ConvGradWeight(_)) { sa[0] } else { sa[1] }) || d1.1 - d1.0 != shape[1])
    {
        return Err(Why::Uncovered(format!("a grouped {} split along its channels", op.op_type())));
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

/// Pooling and its gradients: each image's channel on its own, spatial dims held whole.
pub fn per_channel(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
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
