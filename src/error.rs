//! Why a stage of the driver failed: the library's typed error for its entry points
//! ([`crate::session`], [`crate::exec`]'s programs), rendered once by the CLI.

/// A driver failure, by the stage it happened in.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The strategy, configuration or plan document does not apply to the model (a batch that
    /// does not divide, a plan for other ops, options the lowering does not emit).
    #[error("{0}")]
    Plan(String),
    /// The search failed.
    #[error("{0}")]
    Search(String),
    /// The devices' programs could not be made, with the node and device it concerns where
    /// known.
    #[error(transparent)]
    Lower(#[from] codegen::LowerError),
    /// A pass failed on the model (its errors located in it).
    #[error(transparent)]
    Pass(#[from] passes::PassError),
    /// The training graph could not be made as asked (autodiff, micro-batches, recomputation,
    /// ZeRO's early gradients).
    #[error("{0}")]
    Training(String),
}

/// Result of a driver stage.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::Error;
    use crate::session::{self, Choice};

    /// The driver says which stage failed: a strategy that does not apply is a plan error,
    /// not a string to parse.
    #[test]
    fn a_strategy_that_does_not_apply_is_a_plan_error() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/golden/tiny_mlp.onnxtxt");
        let mut m = crate::load_model(path.as_ref()).unwrap().model;
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let cluster = passes::cost::Cluster::load("local-wgpu").unwrap();
        let r = session::plan(&m.graph, Choice::Strategy("data"), &cluster, 3, &Default::default());
        match r {
            Err(Error::Plan(m)) => assert!(m.contains("does not divide"), "{m}"),
            Err(e) => panic!("another stage: {e:?}"),
            Ok(_) => panic!("data parallelism over 3 devices of a batch of 2 planned"),
        }
    }
}
