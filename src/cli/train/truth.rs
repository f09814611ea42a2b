//! The checks against the truth: a golden case's torch figures, or the reference evaluator's single-device step.

use super::*;

/// The checks against the case's torch truth: the first loss, the gradients, the parameters
/// after one step and the loss trajectory where the case has them for this optimizer.
pub(super) fn torch_checks(
    args: &TrainArgs,
    case: Option<&TrainCase>,
    opt: &OptimizerSpec,
    t: &Trained,
    tol: (f64, f64),
) -> Vec<Check> {
    let (losses, gradients, parameters, opt) = (&t.losses, &t.gradients, &t.parameters, opt.clone());
    let mut checks = Vec::new();
    if let Some(c) = case {
        checks.push(check_losses("loss (torch)", &losses[..1], &[c.loss], tol));
        checks.push(check_all("gradients (torch)", gradients, &c.gradients, tol));
        if args.steps == 1
            && let Some((_, after)) = c.steps.iter().find(|(o, _)| *o == opt)
        {
            let what = "parameters after one step (torch)";
            checks.push(match opt {
                OptimizerSpec::Adam { lr, .. } => {
                    check_adam(what, (parameters, after), (gradients, &c.gradients), tol, lr)
                }
                _ => check_all(what, parameters, after, tol),
            });
        }
        let kind = match opt {
            OptimizerSpec::Sgd { .. } => "sgd",
            OptimizerSpec::Adam { .. } => "adam",
        };
        if c.optimizer(kind) == Some(&opt)
            && let Some(want) = c.losses_over_steps.get(kind)
        {
            checks.push(check_losses("loss trajectory (torch)", losses, want, tol));
        }
    }
    checks
}

/// `--check`: the losses, gradients, parameters and other state against the single-device
/// reference (training the model as written when the program trains a rewritten one).
#[allow(clippy::too_many_arguments)]
pub(super) fn reference_checks(
    args: &TrainArgs,
    s: &Setup,
    written: Option<ir::Model>,
    g: &ir::Graph,
    inputs: &HashMap<String, Array>,
    t: &mut Trained,
    tol: (f64, f64),
    notes: &mut Vec<String>,
) -> CliResult<Vec<Check>> {
    let (loss, opt, dir) = (&s.loss, s.opt.clone(), model_dir(args));
    // The run's other state is compared here and not kept after.
    let state = std::mem::take(&mut t.state);
    let Trained { losses, gradients, parameters, diverged, .. } = &*t;
    let mut checks = Vec::new();
    // The reference trains the model as written when the program runs a rewritten one.
    let reference = match written {
        Some(mut w) => {
            exec::materialize(&mut w, &dir, args.seed).map_err(CliError::msg)?;
            notes.push("the reference trains the model as written; the program runs it rewritten".into());
            Some(training_model(&w, loss, &opt).map_err(CliError::msg)?.0)
        }
        None => None,
    };
    if !args.shapes.is_empty() {
        notes.push(
            "the check's reference trains the re-shaped model, so it cannot catch a wrong rewriting of its shapes \
             (`run --check` compares the forward pass with the model as written where only the batch, or the \
             sequence of a causal model, changed)"
                .into(),
        );
    }
    let rg = reference.as_ref().map_or(g, |t| &t.graph);
    let (want, want_grads, ref_params, ref_state) =
        shardc::train::reference_run(rg, inputs, args.steps).map_err(CliError::msg)?;
    let reference_diverged = shardc::train::divergence(&want, &ref_params, &want_grads);
    notes.extend(shardc::train::reference_divergence_note(diverged.is_some(), reference_diverged));
    checks.push(check_losses("losses (reference)", losses, &want, tol));
    checks.push(check_all("gradients (reference)", gradients, &want_grads, tol));
    checks.push(match opt {
        OptimizerSpec::Adam { lr, .. } => {
            let lr_steps = lr * args.steps as f64;
            check_adam("parameters (reference)", (parameters, &ref_params), (gradients, &want_grads), tol, lr_steps)
        }
        _ => check_all("parameters (reference)", parameters, &ref_params, tol),
    });
    // The other state (BatchNorm's running statistics, the optimizer's moments and step),
    // under the names both runs give it (a weight rewritten in place, reshaped, keeps its
    // values in order; a split or joined one's moments have the program's names). After
    // more than one Adam step it follows parameters `within_adam` lets drift, so it is
    // compared after SGD's steps and Adam's first.
    let adam = matches!(opt, OptimizerSpec::Adam { .. });
    let run_state: BTreeMap<String, Array> = state
        .into_iter()
        .filter_map(|(n, a)| {
            let w = ref_state.get(&n)?;
            let a = if a.shape != w.shape && a.numel() == w.numel() { a.reshaped(w.shape.clone()) } else { a };
            Some((n, a))
        })
        .collect();
    let want_state: BTreeMap<String, Array> =
        ref_state.into_iter().filter(|(n, _)| run_state.contains_key(n)).collect();
    if !want_state.is_empty() && (!adam || args.steps == 1) {
        checks.push(check_all("state (reference)", &run_state, &want_state, tol));
    }
    Ok(checks)
}
