//! Which dims of which values carry the batch: the IR's flow analysis
//! ([`ir::dims::batch_dims`]), shared with the lowering's micro-batching.

use std::collections::HashMap;

use ir::Value;

/// Per value (with a static shape), per dim: does it carry the batch?
pub type BatchDims = HashMap<Value, Vec<bool>>;

pub use ir::dims::batch_dims;
