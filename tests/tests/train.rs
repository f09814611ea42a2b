//! Training against torch: every golden training case (tests/data/golden-train, and
//! ../shared/golden-train when present) — the loss, every gradient, the parameters after one
//! SGD and one Adam step, and the 10-step loss trajectories of both — on the reference
//! evaluator.

use passes::autodiff::LossSpec;
use passes::train::Trainer;
use shardc::train::{TrainCase, close, training_model, within};
use shardc_tests::*;

/// Checks one case on the reference evaluator; the first disagreement.
fn check(path: &std::path::Path, counts: &mut [usize; 3]) -> Result<(), String> {
    let case = TrainCase::load(&path.with_extension("train.json"))?;
    let mut m = load_model(path);
    // What the case does not list is a constant (the rotary tables of `rope_llama`).
    shardc::train::freeze(&mut m.graph, &[], Some(&case.trainable))?;
    let tol = case.tolerance;
    for (k, (opt, after)) in case.steps.iter().enumerate() {
        let (t, info) = training_model(&m, &LossSpec::Model, opt)?;
        let mut want: Vec<&String> = case.trainable.iter().collect();
        want.sort();
        let mut got: Vec<&String> = info.trainable.iter().collect();
        got.sort();
        if got != want {
            return Err(format!("trainable {got:?}, expected {want:?}"));
        }
        let mut tr = Trainer::new(t.graph.clone())?;
        let out = tr.step(&case.inputs)?;
        if !close(out.loss, case.loss, tol) {
            return Err(format!("loss {}, expected {}", out.loss, case.loss));
        }
        if k == 0 {
            for (p, g) in &case.gradients {
                within(&format!("gradient of {p}"), &out.gradients[p], g, tol)?;
                counts[0] += g.numel();
            }
        }
        for (p, v) in after {
            within(&format!("{p} after one step of {opt:?}"), &tr.get(p).ok_or("no parameter")?, v, tol)?;
            counts[1] += v.numel();
        }
        // The trajectory, from the initial parameters.
        let kind = match opt {
            passes::autodiff::OptimizerSpec::Sgd { .. } => "sgd",
            _ => "adam",
        };
        if let Some(losses) = case.losses_over_steps.get(kind) {
            let mut tr = Trainer::new(t.graph.clone())?;
            for (i, &l) in losses.iter().enumerate() {
                let got = if i + 1 < losses.len() { tr.step(&case.inputs)?.loss } else { tr.loss(&case.inputs)? };
                if !close(got, l, tol) {
                    return Err(format!("{kind} loss {i}: {got}, expected {l}"));
                }
                counts[2] += 1;
            }
        }
    }
    Ok(())
}

#[test]
fn golden_training_cases_match_torch_on_the_reference() {
    let mut failures = Vec::new();
    let mut counts = [0usize; 3];
    let n = golden_train_cases().len();
    for p in golden_train_cases() {
        if let Err(e) = check(&p, &mut counts) {
            failures.push(format!("{}: {e}", p.file_stem().unwrap().to_string_lossy()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Every case compared its gradients, both steps' parameters and both trajectories.
    eprintln!(
        "{n} cases: {} gradient entries, {} parameter entries, {} trajectory losses",
        counts[0], counts[1], counts[2]
    );
    assert!(counts[2] >= 20 * n, "{counts:?}");
    assert!(counts[0] >= 8 * n && counts[1] >= 2 * counts[0], "{counts:?}");
}
