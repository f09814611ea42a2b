//! shardc's passes.
//!
//! A [`Pass`] transforms or checks an `ir::Graph`; the [`PassManager`] runs a pipeline of
//! them, timing each, verifying between them when asked and keeping text dumps after the
//! passes named by `--dump-after`. Passes are found by their kebab-case names with
//! [`create`].
//!
//! Passes here: `verify`, `infer-shapes`, `canonicalize`, `rebatch`, `autodiff`.
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod algebra;
pub mod autodiff;
pub mod autoshard;
pub mod canonicalize;
pub mod cost;
pub mod counted;
pub mod infer_shapes;
pub mod manager;
pub mod rebatch;
pub mod recompute;
pub mod table;
pub mod train;
pub mod verify;
pub mod zero;

pub use algebra::attention::FuseAttention;
pub use algebra::experts::{FuseExperts, MoeCapacity};
pub use algebra::{Algebra, ConvAsMatMul, FuseGemms};
pub use autodiff::Autodiff;
pub use canonicalize::Canonicalize;
pub use infer_shapes::InferShapes;
pub use manager::{Changed, Located, Pass, PassCx, PassError, PassManager, Report, Stats};
pub use rebatch::{ExternalData, Rebatch, RebatchSpec};

pub use verify::{RequireStatic, Verify};

/// Options for passes created by name.
#[derive(Clone, Debug, Default)]
pub struct PassOptions {
    /// Input changes for `rebatch`.
    pub rebatch: RebatchSpec,
    /// Loss and optimizer for `autodiff`.
    pub autodiff: Autodiff,
}

/// The names [`create`] knows, in a sensible pipeline order.
pub const PASS_NAMES: &[&str] = &[
    "verify",
    "infer-shapes",
    "canonicalize",
    "algebra",
    "conv-as-matmul",
    "fuse-gemms",
    "fuse-attention",
    "fuse-experts",
    "require-static",
    "rebatch",
    "autodiff",
];

/// Creates a pass by name.
pub fn create(name: &str, opts: &PassOptions) -> Option<Box<dyn Pass>> {
    Some(match name {
        "rebatch" => Box::new(Rebatch { spec: opts.rebatch.clone() }),
        "verify" => Box::new(Verify),
        "infer-shapes" => Box::new(InferShapes::default()),
        "canonicalize" => Box::new(Canonicalize),
        "algebra" => Box::new(Algebra),
        "conv-as-matmul" => Box::new(ConvAsMatMul),
        "fuse-gemms" => Box::new(FuseGemms),
        "fuse-attention" => Box::new(FuseAttention),
        "fuse-experts" => Box::new(FuseExperts),
        "require-static" => Box::new(RequireStatic),
        "autodiff" => Box::new(opts.autodiff.clone()),
        _ => return None,
    })
}
