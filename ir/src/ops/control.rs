//! Control flow: `If`, `Loop`, `Scan`.
//!
//! Their subgraphs are typed and evaluated by the engines themselves
//! ([`crate::infer`] and [`crate::eval`] walk into them); here are the rules that do not
//! need the subgraphs. They run whole on every device.

use super::shape::no_work_whole;
use super::{Arity, InferCx, MANY, NodeCx, OpRules, Sharded, Types, Work};
use crate::graph::op;
use crate::layout::IterSpace;

macro_rules! control {
    ($($name:ident: $arity:expr;)*) => {$(
        impl OpRules for op::$name {
            fn arity(&self) -> Arity {
                $arity
            }

            /// Typed by the engine from the subgraphs; unknown here.
            fn infer(&self, cx: &InferCx<'_>) -> Types {
                Ok(vec![None; cx.n_out])
            }

            no_work_whole!();

            fn sharded(&self) -> Sharded {
                Sharded::Whole
            }
        }
    )*};
}

control! {
    If: Arity::new(1, 1, 1, MANY);
    Loop: Arity::new(2, MANY, 1, MANY);
    Scan: Arity::new(1, MANY, 1, MANY);
}
