//! References from the model as written, for `--check` of a re-shaped model.
//!
//! The check's own reference runs the re-shaped graph, so it shares any mistake the reshaping
//! made (a constant whose bytes no longer fit its new shape). These references run the model
//! *as written*, at its own shapes, on the same inputs: for a batch change, batch by batch
//! ([`reference_at_written_batch`]); for a sequence change of a causal model, on the positions
//! both lengths share ([`reference_on_causal_prefix`]). Each says why it cannot be built
//! instead of building a reference that would be wrong.

use std::collections::HashMap;

use ir::eval::{Array, Data};
use ir::{Graph, Op, Value};

/// The outputs of the model as written, and for each the part of the re-shaped program's output
/// it covers: all of it, or the first `len` positions along `axis`.
#[derive(Clone, Debug)]
pub struct Written {
    /// One per output of the graph, in order.
    pub outputs: Vec<Array>,
    /// Per output: `Some((axis, len))` when it covers only the first `len` positions.
    pub prefix: Vec<Option<(usize, usize)>>,
}

impl Written {
    /// The part of `got`, the program's output `i`, that output `i` of the reference covers.
    pub fn covered<'a>(&self, i: usize, got: &'a Array) -> std::borrow::Cow<'a, Array> {
        match self.prefix.get(i).copied().flatten() {
            Some((axis, len)) if got.shape.get(axis).is_some_and(|&n| n >= len) => {
                std::borrow::Cow::Owned(got.slice_axis(axis, 0, len))
            }
            _ => std::borrow::Cow::Borrowed(got),
        }
    }

    /// How a check against output `i` is labelled after the output's name.
    pub fn label(&self, i: usize) -> String {
        match self.prefix.get(i).copied().flatten() {
            Some((_, len)) => format!("model as written, first {len} positions"),
            None => "model as written".into(),
        }
    }
}

/// The reference from the model as written for the inputs of the re-shaped graph `g`: at the
/// written batch where only the batch changed, else on the causal prefix where one sequence
/// axis changed. `tol` (rtol, atol) decides the causality probe. `Err` says why neither exists.
pub fn reference(
    g: &Graph,
    original: &Graph,
    inputs: &HashMap<String, Array>,
    tol: (f64, f64),
) -> Result<Written, String> {
    match reference_at_written_batch(g, original, inputs) {
        Ok(outputs) => Ok(Written { prefix: vec![None; outputs.len()], outputs }),
        // Not a batch change: one axis changed (a sequence) or the batch's reason says what did.
        Err(batch) => match sequence_change(g, original) {
            Ok(change) => on_causal_prefix(change, g, original, inputs, tol),
            Err(_) => Err(batch),
        },
    }
}

/// Static dims of `v`.
fn dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(ir::TensorType::static_dims)
}

/// The graph inputs (without defaults) whose shape differs between `original`, the model as
/// written, and the re-shaped `g`: name, dims as written, dims now. `Err` names an input
/// without a static shape.
#[allow(clippy::type_complexity)]
fn changed_inputs(g: &Graph, original: &Graph) -> Result<Vec<(String, Vec<i64>, Vec<i64>)>, String> {
    let mut changed = Vec::new();
    for v in original.input_values() {
        if !matches!(original.node(v.node).op, Op::Input { default: None }) {
            continue;
        }
        let name = original.value_name(v);
        let (Some(old), Some(new)) = (dims(original, v), g.lookup(name).and_then(|w| dims(g, w))) else {
            return Err(format!("input `{name}` has no static shape in the model as written"));
        };
        if old != new {
            changed.push((name.to_string(), old, new));
        }
    }
    Ok(changed)
}

/// The outputs of `original` — the model as written, before its batch was changed — for the
/// `inputs` of the re-batched graph `g`: the inputs cut along dim 0 into runs at the original
/// batch, each run through `original`, the outputs joined along the axis that grew. This
/// reference is independent of the rewriting (its constants regenerated, its shape operands
/// rewritten). `Err` says why there is none: a dim other than the batch changed, the new batch
/// is not a multiple of the old, or an output does not grow along one axis (a mean over the
/// batch).
pub fn reference_at_written_batch(
    g: &Graph,
    original: &Graph,
    inputs: &HashMap<String, Array>,
) -> Result<Vec<Array>, String> {
    let mut runs = None;
    let mut cut: Vec<String> = Vec::new();
    for (name, old, new) in changed_inputs(g, original)? {
        let batch_only = old.len() == new.len() && old[1..] == new[1..] && old[0] > 0 && new[0] % old[0] == 0;
        if !batch_only {
            return Err(format!("input `{name}` changed from {old:?} to {new:?}, not only in its batch"));
        }
        let k = (new[0] / old[0]) as usize;
        if runs.is_some_and(|r| r != k) {
            return Err("the inputs' batches grew by different factors".into());
        }
        runs = Some(k);
        cut.push(name);
    }
    let Some(k) = runs else { return Err("no input's batch changed".into()) };
    let mut parts: Vec<Vec<Array>> = Vec::with_capacity(k);
    for r in 0..k {
        let mut feed = inputs.clone();
        for name in &cut {
            let a = &inputs[name];
            let b = a.shape[0] / k;
            feed.insert(name.clone(), a.slice_axis(0, r * b, (r + 1) * b));
        }
        parts.push(ir::eval::run(original, &feed, &Default::default()).map_err(|e| e.to_string())?);
    }
    let mut joined = Vec::new();
    for (i, o) in original.outputs().iter().enumerate() {
        let name = original.value_name(o.value);
        let new = g.outputs().get(i).and_then(|p| dims(g, p.value));
        let old = &parts[0][i].shape;
        // The one axis that is k times as long (k > 1: some input's batch grew).
        let axis = new.filter(|n| n.len() == old.len()).and_then(|n| {
            let grown: Vec<usize> = (0..n.len()).filter(|&a| n[a] as usize == old[a] * k).collect();
            (grown.len() == 1).then(|| grown[0])
        });
        let Some(axis) = axis else {
            return Err(format!("output `{name}` does not grow along one axis with the batch"));
        };
        joined.push(Array::concat_axis(&parts.iter().map(|p| &p[i]).collect::<Vec<_>>(), axis));
    }
    Ok(joined)
}

/// The inputs whose shape changed along one axis, that axis, and the lengths it had and has.
struct SequenceChange {
    inputs: Vec<(String, usize)>,
    old: usize,
    new: usize,
}

fn sequence_change(g: &Graph, original: &Graph) -> Result<SequenceChange, String> {
    let mut inputs = Vec::new();
    let mut lengths: Option<(usize, usize)> = None;
    for (name, old, new) in changed_inputs(g, original)? {
        let axes: Vec<usize> = (0..old.len().min(new.len())).filter(|&a| old[a] != new[a]).collect();
        if old.len() != new.len() || axes.len() != 1 {
            return Err(format!("input `{name}` changed from {old:?} to {new:?}, not along one axis"));
        }
        let a = axes[0];
        let pair = (old[a] as usize, new[a] as usize);
        if lengths.is_some_and(|l| l != pair) {
            return Err("the inputs' sequences changed to different lengths".into());
        }
        lengths = Some(pair);
        inputs.push((name, a));
    }
    let Some((old, new)) = lengths else { return Err("no input's shape changed".into()) };
    Ok(SequenceChange { inputs, old, new })
}

/// The outputs of `original`, the model as written, on the positions a sequence change keeps:
/// where an input's sequence axis went from `L` to `L'`, the first `min(L, L')` positions of
/// every output. The model as written runs at its own length `L`: on the given inputs' first
/// `L` positions when they are longer, or on them repeated out to `L` when shorter. That equals
/// the re-shaped program's first positions only if the model is causal — no position depends on
/// a later one — so the model is first probed: run again with every input changed after a cut
/// (at `L'`, or half of `L` when the sequence grew), its outputs before the cut must not move
/// (within `tol`). `Err` says why there is no such reference: more than one axis changed, an
/// output that does not follow the sequence, or a model that is not causal (an encoder).
pub fn reference_on_causal_prefix(
    g: &Graph,
    original: &Graph,
    inputs: &HashMap<String, Array>,
    tol: (f64, f64),
) -> Result<Written, String> {
    on_causal_prefix(sequence_change(g, original)?, g, original, inputs, tol)
}

/// [`reference_on_causal_prefix`] for the sequence `change` found.
fn on_causal_prefix(
    change: SequenceChange,
    g: &Graph,
    original: &Graph,
    inputs: &HashMap<String, Array>,
    tol: (f64, f64),
) -> Result<Written, String> {
    let keep = change.old.min(change.new);
    let cut = if change.old > keep { keep } else { change.old / 2 };
    if cut == 0 {
        return Err(format!("a sequence of {} positions is too short to probe for causality", change.old));
    }
    let mut feed = inputs.clone();
    let mut probe = inputs.clone();
    for (name, axis) in &change.inputs {
        let a = inputs.get(name).ok_or_else(|| format!("no value for input `{name}`"))?;
        let at_old = repeated_to(a, *axis, change.old);
        probe.insert(name.clone(), changed_after(&at_old, *axis, cut));
        feed.insert(name.clone(), at_old);
    }
    let run = |f: &HashMap<String, Array>| {
        ir::eval::run(original, f, &Default::default()).map_err(|e| format!("the model as written failed: {e}"))
    };
    let (outputs, probed) = (run(&feed)?, run(&probe)?);
    let mut written = Written { outputs: Vec::new(), prefix: Vec::new() };
    for (i, (out, moved)) in outputs.into_iter().zip(probed).enumerate() {
        let name = original.value_name(original.outputs()[i].value);
        let new = g.outputs().get(i).and_then(|p| dims(g, p.value));
        let axis = new.filter(|n| n.len() == out.rank()).and_then(|n| {
            let changed: Vec<usize> = (0..n.len()).filter(|&a| n[a] as usize != out.shape[a]).collect();
            let follows = |a: usize| out.shape[a] == change.old && n[a] as usize == change.new;
            (changed.len() == 1 && follows(changed[0])).then(|| changed[0])
        });
        let Some(axis) = axis else {
            return Err(format!("output `{name}` does not follow the sequence along one axis"));
        };
        let (err, _, same) =
            crate::exec::compare(&moved.slice_axis(axis, 0, cut), &out.slice_axis(axis, 0, cut), tol.0, tol.1);
        if !same {
            return Err(format!(
                "the model as written is not causal: output `{name}`'s first {cut} positions change (by up to {err:.3e}) when the inputs after them do"
            ));
        }
        written.outputs.push(out.slice_axis(axis, 0, keep));
        written.prefix.push(Some((axis, keep)));
    }
    Ok(written)
}

/// `a` cut or repeated (from its start, as often as needed) to `len` positions along `axis`.
fn repeated_to(a: &Array, axis: usize, len: usize) -> Array {
    let n = a.shape[axis];
    if len <= n || n == 0 {
        return a.slice_axis(axis, 0, len.min(n));
    }
    let parts: Vec<Array> = (0..len).step_by(n).map(|s| a.slice_axis(axis, 0, n.min(len - s))).collect();
    Array::concat_axis(&parts.iter().collect::<Vec<_>>(), axis)
}

/// `a` with every element at positions `from..` of `axis` replaced by another value of the
/// kind it holds: a float plus one, a boolean negated, an integer by the next of the distinct
/// integers `a` holds (ids stay ids the model can look up), or 0 or 1 when it holds one.
fn changed_after(a: &Array, axis: usize, from: usize) -> Array {
    let head = a.slice_axis(axis, 0, from);
    let mut tail = a.slice_axis(axis, from, a.shape[axis]);
    tail.data = match std::mem::replace(&mut tail.data, Data::Bool(Vec::new())) {
        Data::F32(v) => Data::F32(v.into_iter().map(|x| x + 1.0).collect()),
        Data::F64(v) => Data::F64(v.into_iter().map(|x| x + 1.0).collect()),
        Data::Bool(v) => Data::Bool(v.into_iter().map(|b| !b).collect()),
        Data::I64(v) => {
            let mut held = match &a.data {
                Data::I64(all) => all.clone(),
                _ => Vec::new(),
            };
            held.sort_unstable();
            held.dedup();
            let next = |x: i64| match held.as_slice() {
                [only] => i64::from(*only == 0),
                _ => held.iter().copied().find(|&y| y > x).unwrap_or(held[0]),
            };
            Data::I64(v.into_iter().map(next).collect())
        }
        other => other,
    };
    Array::concat_axis(&[&head, &tail], axis)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `y = body(x)` over `x: float[rows, len]`.
    fn model(rows: usize, len: usize, body: &str) -> Graph {
        let text = format!(
            "<ir_version: 8, opset_import: [\"\" : 17]>\ng (float[{rows},{len}] x) => (float[{rows},{len}] y) {{\n{body}\n}}"
        );
        let mut g =
            frontend::parse(&text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "test", &text))).model.graph;
        ir::infer::infer_shapes(&mut g, Default::default()).unwrap();
        g
    }

    /// Running sums along the sequence: position i reads positions 0..=i (causal).
    const RUNNING_SUM: &str = "ax = Constant <value: tensor = int64 {1}> ()\ny = CumSum (x, ax)";
    /// The same sums taken from the end: what a rewriting that scrambled a mask might compute.
    const REVERSED_SUM: &str = "ax = Constant <value: tensor = int64 {1}> ()\ny = CumSum <reverse: int = 1> (x, ax)";
    /// Each position less the sequence's mean: every position reads every other (an encoder).
    const CENTRED: &str = "m = ReduceMean <axes: ints = [1], keepdims: int = 1> (x)\ny = Sub (x, m)";

    fn inputs(rows: usize, len: usize) -> HashMap<String, Array> {
        let v: Vec<f32> = (0..rows * len).map(|i| ((i * 7 % 11) as f32) * 0.25 - 1.0).collect();
        HashMap::from([("x".to_string(), Array::f32(vec![rows, len], v))])
    }

    /// The program's outputs checked against a reference, as `run --check` does.
    fn agrees(g: &Graph, w: &Written, ins: &HashMap<String, Array>) -> bool {
        let got = ir::eval::run(g, ins, &Default::default()).unwrap();
        got.iter().enumerate().all(|(i, a)| crate::exec::compare(&w.covered(i, a), &w.outputs[i], 1e-5, 1e-6).2)
    }

    #[test]
    fn a_causal_model_is_checked_on_the_positions_both_lengths_share() {
        let written = model(2, 8, RUNNING_SUM);
        for len in [3, 12] {
            let (g, ins) = (model(2, len, RUNNING_SUM), inputs(2, len));
            let w = reference(&g, &written, &ins, (1e-5, 1e-6)).unwrap();
            assert_eq!(w.prefix, vec![Some((1, len.min(8)))]);
            assert_eq!(w.label(0), format!("model as written, first {} positions", len.min(8)));
            assert!(agrees(&g, &w, &ins), "at {len}");
            // A rewriting that computes something else at the new length is caught.
            assert!(!agrees(&model(2, len, REVERSED_SUM), &w, &ins), "at {len}");
        }
    }

    #[test]
    fn a_model_that_is_not_causal_has_no_prefix_reference() {
        let (g, ins) = (model(2, 4, CENTRED), inputs(2, 4));
        let why = reference(&g, &model(2, 8, CENTRED), &ins, (1e-5, 1e-6)).unwrap_err();
        assert!(why.contains("not causal") && why.contains("output `y`"), "{why}");
    }

    #[test]
    fn a_batch_change_is_checked_whole_at_the_written_batch() {
        let (g, ins) = (model(6, 8, CENTRED), inputs(6, 8));
        let w = reference(&g, &model(2, 8, CENTRED), &ins, (1e-5, 1e-6)).unwrap();
        assert_eq!(w.prefix, vec![None]);
        assert_eq!(w.label(0), "model as written");
        assert!(agrees(&g, &w, &ins));
    }

    #[test]
    fn inputs_are_repeated_and_changed_past_a_cut() {
        let a = Array::i64(vec![1, 3], vec![5, 9, 5]);
        assert_eq!(repeated_to(&a, 1, 7).data, Data::I64(vec![5, 9, 5, 5, 9, 5, 5]));
        assert_eq!(repeated_to(&a, 1, 2).data, Data::I64(vec![5, 9]));
        // Integers move to the next value the input holds (ids stay ids).
        assert_eq!(changed_after(&a, 1, 1).data, Data::I64(vec![5, 5, 9]));
        let ones = Array::i64(vec![1, 2], vec![1, 1]);
        assert_eq!(changed_after(&ones, 1, 1).data, Data::I64(vec![1, 0]));
        let f = Array::f32(vec![2, 2], vec![0.5, 1.5, 2.5, 3.5]);
        assert_eq!(changed_after(&f, 1, 1).data, Data::F32(vec![0.5, 2.5, 2.5, 4.5]));
    }
}
