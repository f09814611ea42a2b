//! The CPU executor: the reference kernels of `ir::eval`, one op at a time.

use ir::eval::{Array, eval_node};
use ir::{Graph, NodeId};

use super::Executor;

/// Runs ops with the CPU reference kernels.
#[derive(Default)]
pub struct CpuExecutor;

impl CpuExecutor {
    /// A CPU executor.
    pub fn new() -> CpuExecutor {
        CpuExecutor
    }
}

impl Executor for CpuExecutor {
    type Tensor = Array;

    fn name(&self) -> String {
        "cpu (reference kernels)".into()
    }

    fn upload(&mut self, a: &Array) -> Result<Array, String> {
        Ok(a.clone())
    }

    fn download(&mut self, t: &Array) -> Result<Array, String> {
        Ok(t.clone())
    }

    fn storage(&self, t: &Array) -> (usize, u64) {
        // Each array owns its elements: the element buffer identifies it.
        let id = match &t.data {
            ir::eval::Data::F32(v) => v.as_ptr() as usize,
            ir::eval::Data::F64(v) => v.as_ptr() as usize,
            ir::eval::Data::I64(v) => v.as_ptr() as usize,
            ir::eval::Data::Bool(v) => v.as_ptr() as usize,
            ir::eval::Data::Str(v) => v.as_ptr() as usize,
        };
        (id, t.numel() as u64 * t.dtype.size_bytes().max(1))
    }

    fn run(
        &mut self,
        g: &Graph,
        n: NodeId,
        inputs: &[Option<&Array>],
        captures: &[Option<&Array>],
    ) -> Result<(Vec<Array>, bool), String> {
        eval_node(g, n, inputs, captures).map(|o| (o, false)).map_err(|e| e.to_string())
    }
}
