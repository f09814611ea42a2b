//! `verify`: checks the graph's structural invariants (see `ir::verify`). Changes nothing.

use ir::Graph;

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// The verifier as a pass.
pub struct Verify;

impl Pass for Verify {
    fn name(&self) -> &'static str {
        "verify"
    }

    fn run(&mut self, g: &mut Graph, _cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        ir::verify(g).map_err(|errs| PassError {
            pass: self.name().into(),
            errors: errs
                .0
                .into_iter()
                .map(|e| Located { node: e.at, span: e.at.and_then(|n| g.span(n)), msg: e.msg })
                .collect(),
        })?;
        Ok(Changed::No)
    }
}
