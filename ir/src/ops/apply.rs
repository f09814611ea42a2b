//! Applying one op's rules to operands: its output types ([`infer_op`]) and its values
//! ([`eval_op`]). The engines (graph inference, the reference evaluator, constant folding)
//! call these; they sit with the rules so that the rules need no engine.

use crate::array::{Array, Data, EvalError, round_to};
use crate::graph::op::Op;
use crate::types::{DType, Dim, TensorType};

use super::{EvalCx, InferCx};

/// The type rule of each op: output types from input types and known input values (see
/// [`crate::ops::OpRules::infer`]).
pub fn infer_op(
    op: &Op,
    ins: &[Option<&TensorType>],
    consts: &[Option<&Array>],
    syms: &[Option<&Vec<Dim>>],
    n_out: usize,
    opset: i64,
) -> Result<Vec<Option<TensorType>>, String> {
    infer_op_asking(op, ins, consts, syms, n_out, opset).0
}

/// [`infer_op`], and the input slots whose constant values it asked for and did not have
/// (bit `i` for slot `i`).
pub fn infer_op_asking(
    op: &Op,
    ins: &[Option<&TensorType>],
    consts: &[Option<&Array>],
    syms: &[Option<&Vec<Dim>>],
    n_out: usize,
    opset: i64,
) -> (Result<Vec<Option<TensorType>>, String>, u64) {
    let cx = InferCx { ins, consts, syms, n_out, opset, missing: std::cell::Cell::new(0) };
    let r = op.rules().infer(&cx);
    (r, cx.missing.get())
}

/// Evaluates one op on its inputs (see [`crate::ops::OpRules::eval`]). 16-bit float outputs
/// are rounded to their type's precision, as a runtime holding them in 16 bits does: the rules
/// compute in f32.
pub fn eval_op(op: &Op, inputs: &[Option<&Array>], n_out: usize, opset: i64) -> Result<Vec<Array>, EvalError> {
    // The operands first meet the op's shape rule (constant folding evaluates before
    // inference has checked anything, and the kernels trust the shapes).
    let types: Vec<Option<TensorType>> = inputs
        .iter()
        .map(|a| a.map(|a| TensorType::fixed(a.dtype, &a.shape.iter().map(|&d| d as i64).collect::<Vec<_>>())))
        .collect();
    let trefs: Vec<Option<&TensorType>> = types.iter().map(Option::as_ref).collect();
    let no_syms: Vec<Option<&Vec<crate::types::Dim>>> = vec![None; inputs.len()];
    if let Err(e) = infer_op(op, &trefs, inputs, &no_syms, n_out, opset) {
        return Err(EvalError::Invalid(format!("{}: {e}", op.op_type())));
    }
    let mut outs = op.rules().eval(&EvalCx { inputs, n_out, opset, name: op.op_type() })?;
    for a in &mut outs {
        if matches!(a.dtype, DType::Float16 | DType::Bfloat16)
            && let Data::F32(v) = &mut a.data
        {
            for x in v.iter_mut() {
                *x = round_to(a.dtype, *x);
            }
        }
    }
    Ok(outs)
}
