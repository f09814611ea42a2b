//! `infer-shapes`: gives every value its type (see `ir::infer`). Declared types that
//! contradict the ops become warnings and are replaced; ops whose rules fail (a matmul of
//! mismatched shapes, a reshape to the wrong size) are errors.

use ir::Graph;
use ir::infer::{Mode, infer_shapes};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// Shape inference as a pass.
#[derive(Default)]
pub struct InferShapes {
    /// Forget inferred types first (after inputs changed).
    pub reset: bool,
}

impl Pass for InferShapes {
    fn name(&self) -> &'static str {
        "infer-shapes"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        let mode = if self.reset { Mode::Reset } else { Mode::Check };
        match infer_shapes(g, mode) {
            Ok(report) => {
                cx.warnings.extend(report.warnings.into_iter().map(Located::from));
                cx.stats.add("ops with unknown output types", report.unknown.len() as u64);
                Ok(Changed::Yes)
            }
            Err(errs) => Err(PassError::shapes(self.name(), errs)),
        }
    }
}
