//! Recurrent layers (`LSTM`, `GRU`, `RNN`) on a part of the batch: each sequence runs on its
//! own, so a device holding sequences `a..b` of every per-sequence operand (the input, the
//! sequence lengths, the initial states) and the weights whole holds sequences `a..b` of the
//! outputs. Time steps and hidden units held in part are not covered, nor is the gradient
//! (`RecurrentGrad`) on parts: the lowering gathers the sequences before it.

use ir::NodeId;
use ir::op::Op;

use super::rules::{Cx, Out, Why, op_key, wrong};
use super::term::{Fact, Region, TermId, whole};

/// The batch dims of a layer of `layout`: the input's and the states' (and the outputs' Y_h,
/// Y_c), and `Y`'s.
fn batch_dims(layout: i64) -> (usize, usize, usize) {
    if layout == 0 { (1, 1, 2) } else { (0, 0, 0) }
}

pub fn apply(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let op = cx.g.node(n).op.clone();
    let layout = match &op {
        Op::LSTM(o) => o.layout.unwrap_or(0),
        Op::GRU(o) => o.layout.unwrap_or(0),
        Op::RNN(o) => o.layout.unwrap_or(0),
        _ => return wrong("not a recurrent layer"),
    };
    if ins.iter().flatten().any(|f| !f.is_exact()) {
        return wrong(format!("a partial sum reaches {}", op.op_type()));
    }
    let (xb, state, yb) = batch_dims(layout);
    // Per operand slot (X, W, R, B, sequence_lens, initial_h, initial_c, P), its batch dim;
    // the weights are held whole.
    let dims = [Some(xb), None, None, None, Some(0), Some(state), Some(state), None];
    let Some(x) = ins.first().and_then(Option::as_ref) else { return wrong("no input") };
    let total = cx.terms.shape(x.term)[xb];
    let held = x.region[xb];
    let mut terms: Vec<TermId> = Vec::new();
    let mut present = String::new();
    for (k, f) in ins.iter().enumerate() {
        let Some(f) = f else {
            present.push('-');
            continue;
        };
        present.push('+');
        let shape = cx.terms.shape(f.term).to_vec();
        let mut want: Region = whole(&shape);
        if let Some(Some(d)) = dims.get(k) {
            want[*d] = held;
        }
        if f.region != want {
            return Err(Why::Uncovered(format!(
                "{} on a part {:?} of operand {k} (sequences {held:?} of {total} expected, the rest whole)",
                op.op_type(),
                f.region
            )));
        }
        terms.push(f.term);
    }
    // Which operands are present is part of the op: an absent bias and an absent sequence
    // length are different layers.
    let key = format!("{}|{present}", op_key(&op));
    let mut out = Vec::new();
    for slot in 0..cx.g.node(n).num_outputs() {
        let Some(local) = cx.out_dims(n, slot) else {
            out.push(None);
            continue;
        };
        // Y [seq, dirs, batch, H] (layout 1: [batch, seq, dirs, H]); Y_h, Y_c as the states.
        let d = if slot == 0 { yb } else { state };
        let (mut shape, mut region) = (local.clone(), whole(&local));
        (shape[d], region[d]) = (total, held);
        let t = cx.terms.op(&key, slot as u16, &terms, &shape);
        out.push(Some(Fact::exact(t, region)));
    }
    Ok(out)
}
