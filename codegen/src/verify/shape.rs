//! Ops that reshape data dim by dim (Pad, Tile, Resize): a dim the op leaves as it is keeps
//! the box its input holds; a dim it pads, repeats or rescales must be held whole.

use ir::NodeId;
use ir::op::Op;

use super::rules::{Cx, Out, Why, op_key, wrong};
use super::term::{Fact, Region, TermId};

/// Per dim: the op changes it (from the literal operands it reads: their facts' values, or
/// the graph's constants).
fn changed(cx: &Cx<'_>, n: NodeId, rank: usize, ins: &[Option<Fact>]) -> Result<Vec<bool>, Why> {
    let node = cx.g.node(n);
    let ints = |k: usize| {
        let whole = ins.get(k).and_then(Option::as_ref).and_then(|f| cx.terms.value(f.term).cloned());
        whole
            .or_else(|| node.input(k).and_then(|v| ir::ops::constant_value(cx.g, v, 16)))
            .and_then(|a| a.to_f64().ok())
            .map(|x| x.into_iter().map(|v| v as i64).collect::<Vec<_>>())
    };
    let literal = |what: &str| Why::Uncovered(format!("{} with {what} that are not literals", node.op.op_type()));
    Ok(match &node.op {
        Op::Pad(p) => {
            let pads = match &p.pads {
                Some(x) => x.clone(),
                None => ints(1).ok_or_else(|| literal("pads"))?,
            };
            let axes: Vec<usize> = match node.input(3) {
                Some(_) => ints(3)
                    .ok_or_else(|| literal("axes"))?
                    .iter()
                    .map(|&a| if a < 0 { a + rank as i64 } else { a } as usize)
                    .collect(),
                None => (0..rank).collect(),
            };
            let k = axes.len();
            let mut c = vec![false; rank];
            for (i, &a) in axes.iter().enumerate() {
                if a < rank {
                    c[a] = pads.get(i).copied().unwrap_or(0) != 0 || pads.get(i + k).copied().unwrap_or(0) != 0;
                }
            }
            c
        }
        Op::Tile(_) => ints(1)
            .ok_or_else(|| literal("repeats"))?
            .iter()
            .map(|&r| r != 1)
            .chain(std::iter::repeat(false))
            .take(rank)
            .collect(),
        // Resize: a dim whose extent stays is not rescaled (but under a crop).
        Op::Resize(r) if r.coordinate_transformation_mode.as_deref() != Some("tf_crop_and_resize") => {
            let lin = cx.g.tensor_type(node.input(0).unwrap_or(ir::Value::new(n, 0))).and_then(|t| t.static_dims());
            let lout = cx.out_dims(n, 0);
            match (lin, lout) {
                (Some(a), Some(b)) if a.len() == rank && b.len() == rank => (0..rank).map(|d| a[d] != b[d]).collect(),
                _ => vec![true; rank],
            }
        }
        _ => vec![true; rank],
    })
}

/// Pad, Tile and Resize on pieces.
pub fn apply(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let node = cx.g.node(n);
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("no input") };
    if !x.is_exact() {
        return wrong(format!("a partial sum reaches {}", node.op.op_type()));
    }
    let Some(local) = cx.out_dims(n, 0) else { return Err(Why::Uncovered("an output of unknown shape".into())) };
    let xs = cx.terms.shape(x.term).to_vec();
    // Only a dim held in part needs to know whether the op changes it.
    let all_whole = (0..xs.len()).all(|d| x.region[d] == (0, xs[d]));
    let changed = if all_whole { vec![true; xs.len()] } else { changed(cx, n, xs.len(), ins)? };
    let mut shape = xs.clone();
    let mut region: Region = Vec::new();
    for d in 0..xs.len() {
        let held_whole = x.region[d] == (0, xs[d]);
        let same = local.get(d) == Some(&(x.region[d].1 - x.region[d].0));
        if held_whole {
            shape[d] = local[d];
            region.push((0, local[d]));
        } else if !changed[d] && same {
            region.push(x.region[d]);
        } else {
            return Err(Why::Uncovered(format!(
                "{} changes dim {d}, held in part {:?}",
                node.op.op_type(),
                x.region[d]
            )));
        }
    }
    // Resize's target sizes are a device's own: the term reads its other operands.
    let terms: Vec<TermId> = ins
        .iter()
        .enumerate()
        .filter(|(k, _)| !(matches!(node.op, Op::Resize(_)) && *k == 3))
        .filter_map(|(_, f)| f.as_ref().map(|f| f.term))
        .collect();
    let t = cx.terms.op(&op_key(&node.op), 0, &terms, &shape);
    Ok(vec![Some(Fact::exact(t, region))])
}
