//! shardc's intermediate representation.
//!
//! A model is a [`Model`] around a [`Graph`]: an SSA graph whose nodes carry a closed
//! [`Op`] enum with typed attributes, whose values ([`Value`] = node + output slot) carry a
//! [`Type`] once known. The graph keeps petgraph private: callers use [`NodeId`] and
//! [`Value`] and the methods of [`Graph`], which keep the edge structure in step with each
//! node's ordered inputs.
//!
//! The crate also holds what every later stage needs to know about ops: the verifier
//! ([`verify()`]), shape inference ([`infer`]), FLOP and byte counts ([`cost`]), a CPU
//! reference evaluator ([`eval`]) and the text printer ([`print`]), which writes the ONNX
//! textual syntax exactly as ONNX's printer does.
//!
//! ```
//! use shardc_ir::{Graph, Op, TensorType, DType, op};
//! let mut g = Graph::new("mlp");
//! let x = g.add_input("x", Some(TensorType::fixed(DType::Float, &[2, 4]).into()));
//! let y = g.add_simple(Op::Relu(op::Relu::default()), &[x], "y");
//! g.add_output(y, None);
//! assert_eq!(shardc_ir::print::graph_to_string(&g), "mlp (float[2,4] x) => ( y) {\n   y = Relu (x)\n}");
//! ```
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr)]
// Numeric kernels index several arrays with one loop variable; iterators would obscure them.
#![allow(clippy::needless_range_loop)]
#![warn(missing_docs)]

pub mod array;
pub mod cost;
pub mod dims;
pub mod eval;
pub mod export;
pub mod fusion;
pub mod graph;
pub mod infer;
pub mod inline;
pub mod layout;
pub mod ops;
pub mod print;
pub mod reshard;
pub mod schedule;
pub mod scope;
pub mod shard;
pub mod tensor;
pub mod train;
pub mod types;
pub mod verify;

pub use graph::{attr, op};

pub use attr::{AttrKind, AttrValue, Attribute};
pub use graph::{Cycle, Function, Graph, GraphOutput, Model, Node, NodeId, Output, Span, Value};
pub use op::{Op, OpClass, Opaque};
pub use tensor::{ExternalConcat, ExternalSlice, FILL, Tensor, TensorData};
pub use types::{DType, Dim, TensorType, Type};
pub use verify::{VerifyError, VerifyErrors, verify};
