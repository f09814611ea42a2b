//! Binary ONNX: the protobuf `ModelProto` read into the same syntax tree the text frontend
//! builds (so one lowering serves both), and `ir::Model` written back as `ModelProto`.

#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto;
mod read;
mod write;

pub use read::{Locations, Read, is_binary, raw_tensor_data, read, read_tensor};
pub use write::{tensor_to_bytes, to_bytes};
