//! The CPU executor: one op at a time, matrix products and convolutions by a vectorised SGEMM
//! ([`gemm`], [`conv`]), every other op by the reference kernels of `ir::eval`.

mod conv;
mod gemm;

use ir::DType;
use ir::eval::{Array, Data, eval_node};
use std::sync::Arc;

use ir::{Graph, NodeId, Op};

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
    /// Shared: the driver's copies of a value (a feed, a carried state, an `Identity`) are
    /// the one array, as views of one buffer are on a GPU.
    type Tensor = Arc<Array>;

    fn name(&self) -> String {
        "cpu (reference kernels)".into()
    }

    fn upload(&mut self, a: &Array) -> Result<Arc<Array>, String> {
        Ok(Arc::new(a.clone()))
    }

    fn download(&mut self, t: &Arc<Array>) -> Result<Array, String> {
        Ok((**t).clone())
    }

    fn take(&mut self, t: Arc<Array>) -> Result<Array, String> {
        Ok(Arc::try_unwrap(t).unwrap_or_else(|shared| (*shared).clone()))
    }

    fn on_host<'t>(&self, t: &'t Arc<Array>) -> Option<&'t Array> {
        Some(t)
    }

    fn upload_owned(&mut self, a: Array) -> Result<Arc<Array>, String> {
        Ok(Arc::new(a))
    }

    fn add_in_place(&mut self, acc: &mut Arc<Array>, b: &Arc<Array>) -> bool {
        match (Arc::get_mut(acc), &b.data) {
            (Some(a), Data::F32(y)) if a.dtype == DType::Float && b.dtype == DType::Float && a.shape == b.shape => {
                let Data::F32(x) = &mut a.data else { return false };
                x.iter_mut().zip(y).for_each(|(p, &q)| *p += q);
                true
            }
            _ => false,
        }
    }

    fn scale_in_place(&mut self, acc: &mut Arc<Array>, k: f64) -> bool {
        match Arc::get_mut(acc) {
            Some(Array { dtype: DType::Float, data: Data::F32(x), .. }) => {
                let k = k as f32;
                x.iter_mut().for_each(|p| *p *= k);
                true
            }
            _ => false,
        }
    }

    fn storage(&self, t: &Arc<Array>) -> (usize, u64) {
        (Arc::as_ptr(t) as usize, t.numel() as u64 * t.dtype.size_bytes().max(1))
    }

    fn run(
        &mut self,
        g: &Graph,
        n: NodeId,
        inputs: &[Option<&Arc<Array>>],
        captures: &[Option<&Arc<Array>>],
    ) -> Result<(Vec<Arc<Array>>, bool), String> {
        // An identity is its input (no copy).
        if let (Op::Identity(_), [Some(x)]) = (&g.node(n).op, inputs) {
            return Ok((vec![Arc::clone(x)], false));
        }
        let ins: Vec<Option<&Array>> = inputs.iter().map(|t| t.map(|a| &**a)).collect();
        let fast = match (&g.node(n).op, ins.as_slice()) {
            (Op::MatMul(_), [Some(a), Some(b)]) => gemm::matmul(a, b),
            (Op::Gemm(op), [Some(a), Some(b)]) => gemm::gemm(op, a, b, None),
            (Op::Gemm(op), [Some(a), Some(b), c]) => gemm::gemm(op, a, b, *c),
            (Op::Conv(op), [Some(x), Some(w)]) => conv::conv(op, x, w, None),
            (Op::Conv(op), [Some(x), Some(w), b]) => conv::conv(op, x, w, *b),
            (Op::ConvGradInput(op), [Some(dy), Some(w)]) => conv::grad_input(op, dy, w),
            (Op::ConvGradWeight(op), [Some(x), Some(dy)]) => conv::grad_weight(op, x, dy),
            _ => None,
        };
        if let Some(y) = fast {
            return Ok((vec![Arc::new(y?)], false));
        }
        let caps: Vec<Option<&Array>> = captures.iter().map(|t| t.map(|a| &**a)).collect();
        let outs = eval_node(g, n, &ins, &caps).map_err(|e| e.to_string())?;
        Ok((outs.into_iter().map(Arc::new).collect(), false))
    }
}
