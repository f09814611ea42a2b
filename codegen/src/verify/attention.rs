//! `Attention` (ONNX's fused attention) on pieces: each query row of each head of each batch
//! element is computed from that row, the whole keys and values of its key/value head, and
//! that row of the mask. So a device may hold part of the batch, part of the query heads
//! (with the key/value heads they read, grouped as the op groups them), and part of the query
//! sequence where the op's masking does not depend on a row's position (no `is_causal`, no
//! sliding window). Keys, values and the head dims are held whole. A cache (`past_key`,
//! `past_value`) or padding lengths: only on whole values.

use ir::NodeId;
use ir::op::{self as o, Op};

use super::rules::{Cx, Out, Why, op_key, whole_rule, wrong};
use super::term::{Fact, Region, TermId};

/// The op's inputs (by slot) that a rule on parts covers: Q, K, V and the mask.
const PARTS: [usize; 4] = [0, 1, 2, 3];

pub fn apply(cx: &mut Cx<'_>, n: NodeId, a: &o::Attention, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let given: Vec<usize> = (0..node.inputs().len()).filter(|&i| node.input(i).is_some()).collect();
    if given.iter().any(|i| !PARTS.contains(i)) || !(0..3).all(|i| given.contains(&i)) {
        return whole_rule(cx, n, ins);
    }
    let facts: Vec<&Fact> = given
        .iter()
        .map(|&i| {
            ins.get(i).and_then(Option::as_ref).ok_or_else(|| Why::Uncovered(format!("Attention without input {i}")))
        })
        .collect::<Result<_, _>>()?;
    if facts.iter().any(|f| !f.is_exact()) {
        return wrong("a partial sum reaches Attention, which is not linear");
    }
    let shapes: Vec<Vec<i64>> = facts.iter().map(|f| cx.terms.shape(f.term).to_vec()).collect();
    let key = format!("{}|inputs={given:?}", op_key(&Op::Attention(a.clone())));
    let terms: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let outs = if shapes[..3].iter().all(|s| s.len() == 4) {
        rank4(cx, a, &facts, &shapes)?
    } else if shapes[..3].iter().all(|s| s.len() == 3) {
        rank3(cx, a, &facts, &shapes)?
    } else {
        return whole_rule(cx, n, ins);
    };
    // The outputs the op has (a 3-D op's caches are 4-D rearrangements: not covered on parts).
    Ok((0..node.num_outputs())
        .map(|slot| {
            let (shape, region) = outs.get(slot).filter(|(s, _)| !s.is_empty())?.clone();
            Some(Fact::exact(cx.terms.op(&key, slot as u16, &terms, &shape), region))
        })
        .collect())
}

/// Per output slot (Y, present key, present value, the scores), its global shape and the box
/// held; an empty shape where the slot is not covered.
type Outputs = Vec<(Vec<i64>, Region)>;

/// 4-D Attention (`[batch, heads, sequence, dim]`).
fn rank4(cx: &Cx<'_>, a: &o::Attention, facts: &[&Fact], shapes: &[Vec<i64>]) -> Result<Outputs, Why> {
    let (q, k, v) = (facts[0], facts[1], facts[2]);
    let (hq, hk) = (shapes[0][1], shapes[1][1]);
    if hk <= 0 || hq % hk != 0 {
        return Err(Why::Uncovered(format!("Attention: {hq} query heads do not group over {hk} key heads")));
    }
    let g = hq / hk;
    let (qb, qh, qs) = (q.region[0], q.region[1], q.region[2]);
    whole_dims(q, &shapes[0], &[3], "the queries' head dim")?;
    for (f, s, what) in [(k, &shapes[1], "keys"), (v, &shapes[2], "values")] {
        whole_dims(f, s, &[2, 3], what)?;
        if f.region[0] != qb {
            return wrong(format!("Attention's {what} hold batch {:?}, the queries {qb:?}", f.region[0]));
        }
        if f.region[1] != k.region[1] {
            return wrong(format!(
                "Attention's keys and values hold different heads: {:?}, {:?}",
                k.region[1], f.region[1]
            ));
        }
    }
    let (k0, k1) = k.region[1];
    if qh.0 != k0 * g || qh.1 - qh.0 != (k1 - k0) * g {
        return wrong(format!(
            "Attention's query heads {qh:?} are not those of key/value heads {:?} ({g} query heads per key head)",
            k.region[1]
        ));
    }
    positional(a, qs, shapes[0][2])?;
    let total = shapes[1][2];
    let out_box: Region = vec![qb, qh, qs, (0, total)];
    if let Some(m) = facts.get(3) {
        mask_fits(cx, m, &out_box)?;
    }
    let (b, sq, dv) = (shapes[0][0], shapes[0][2], shapes[2][3]);
    Ok(vec![
        (vec![b, hq, sq, dv], vec![qb, qh, qs, (0, dv)]),
        (shapes[1].clone(), k.region.clone()),
        (shapes[2].clone(), v.region.clone()),
        (vec![b, hq, sq, total], out_box),
    ])
}

/// 3-D Attention (`[batch, sequence, heads·dim]`): parts of the batch and, where masking does
/// not depend on position, of the query sequence; the hidden dims whole (the heads are an
/// attribute there, so a part of them would be another op).
fn rank3(cx: &Cx<'_>, a: &o::Attention, facts: &[&Fact], shapes: &[Vec<i64>]) -> Result<Outputs, Why> {
    let q = facts[0];
    whole_dims(q, &shapes[0], &[2], "the queries' hidden dim")?;
    for (f, s, what) in [(facts[1], &shapes[1], "keys"), (facts[2], &shapes[2], "values")] {
        whole_dims(f, s, &[1, 2], what)?;
        if f.region[0] != q.region[0] {
            return wrong(format!("Attention's {what} hold batch {:?}, the queries {:?}", f.region[0], q.region[0]));
        }
    }
    positional(a, q.region[1], shapes[0][1])?;
    let (Some(hq), Some(_)) = (a.q_num_heads, a.kv_num_heads) else {
        return Err(Why::Uncovered("3-D Attention without its head counts".into()));
    };
    let (b, sq, total, dv) = (shapes[0][0], shapes[0][1], shapes[1][1], shapes[2][2]);
    let out_box: Region = vec![q.region[0], (0, hq), q.region[1], (0, total)];
    if let Some(m) = facts.get(3) {
        mask_fits(cx, m, &out_box)?;
    }
    Ok(vec![
        (vec![b, sq, dv], vec![q.region[0], q.region[1], (0, dv)]),
        (vec![], vec![]),
        (vec![], vec![]),
        (vec![b, hq, sq, total], out_box),
    ])
}

fn whole_dims(f: &Fact, shape: &[i64], dims: &[usize], what: &str) -> Result<(), Why> {
    match dims.iter().find(|&&d| f.region[d] != (0, shape[d])) {
        Some(&d) => Err(Why::Uncovered(format!("Attention on a part {:?} of {what} (dim {d})", f.region))),
        None => Ok(()),
    }
}

/// Masking that depends on a query row's position (causal, a window) needs the rows whole.
fn positional(a: &o::Attention, rows: (i64, i64), all: i64) -> Result<(), Why> {
    let window = a.left_window_size.unwrap_or(-1) >= 0 || a.right_window_size.unwrap_or(-1) >= 0;
    if rows != (0, all) && (a.is_causal.unwrap_or(0) != 0 || window) {
        return Err(Why::Uncovered(format!(
            "causal or windowed Attention on query rows {rows:?} of {all} (the mask depends on the rows' positions)"
        )));
    }
    Ok(())
}

/// The mask (broadcast to `[batch, heads, rows, keys]`) is held where the output is.
fn mask_fits(cx: &Cx<'_>, m: &Fact, out: &Region) -> Result<(), Why> {
    let s = cx.terms.shape(m.term);
    if s.len() > out.len() {
        return Err(Why::Uncovered(format!("an Attention mask of rank {}", s.len())));
    }
    let off = out.len() - s.len();
    for (j, &d) in s.iter().enumerate() {
        let want = if d == 1 { (0, 1) } else { out[off + j] };
        if m.region[j] != want {
            return wrong(format!("Attention's mask holds {:?}, the output {out:?}", m.region));
        }
    }
    Ok(())
}
