//! Helpers shared by integration tests that need the `shardc` crate (a dev-dependency, so
//! not in `shardc_tests`). Included with `mod common;`.

use shardc::passes::autodiff::{LossSpec, OptimizerSpec};
use shardc::train::Tensors;

/// Losses, gradients and parameters of 3 SGD steps (learning rate 0.1) of `m` under `loss` on
/// the reference trainer, inputs drawn from seed 3.
pub fn sgd_steps(m: &ir::Model, loss: &LossSpec) -> (Vec<f64>, Tensors, Tensors) {
    let opt = OptimizerSpec::sgd(0.1, 0.0);
    let (t, info) = shardc::train::training_model(m, loss, &opt).unwrap();
    let inputs = shardc::train::seeded_inputs(&t.graph, &info, 3).unwrap();
    shardc::train::reference_steps(&t.graph, &inputs, 3).unwrap()
}
