//! Optimizer updates (the `shardc` domain): `SgdUpdate` and `AdamUpdate`, element-wise over a
//! parameter (or its shard) and its state, exactly as torch.optim computes them
//! (`foreach=False`): float32 arithmetic in torch's order, bias corrections from the integer
//! step in float64.

use super::{Arity, Arrays, EvalCx, InferCx, NodeCx, OpRules, Types, Work};
use crate::array::{Array, EvalError};
use crate::graph::op;
use crate::layout::IterSpace;
use crate::ops::space::pointwise;

type Result<T> = std::result::Result<T, EvalError>;

/// The step counter input (int64 scalar, from 1).
fn step(cx: &EvalCx<'_>, i: usize) -> Result<i64> {
    let t = cx.req(i)?.to_i64()?;
    t.first().copied().filter(|&t| t >= 1).ok_or_else(|| EvalError::Invalid("optimizer step counter below 1".into()))
}

fn same_sizes(arrays: &[&Array]) -> Result<()> {
    if arrays.windows(2).any(|w| w[0].shape != w[1].shape) {
        return Err(EvalError::Invalid("optimizer operands of different shapes".into()));
    }
    Ok(())
}

/// The space of an update: the parameter's dims; it splits like the parameter (a sharded
/// parameter keeps its optimizer state sharded).
fn update_space(cx: &NodeCx<'_>) -> Option<IterSpace> {
    Some(pointwise(cx, &[], &[], 0))
}

/// Writes `out` as `like`'s element type.
fn like(like: &Array, v: Vec<f32>) -> Array {
    Array::from_f32s(like.dtype, like.shape.clone(), v)
}

impl OpRules for op::SgdUpdate {
    fn arity(&self) -> Arity {
        Arity::new(4, 4, 2, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![cx.input(0).cloned(), cx.input(2).cloned()])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        update_space(cx)
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(5.0 * cx.in_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (p, g, b) = (cx.req(0)?, cx.req(1)?, cx.req(2)?);
        same_sizes(&[p, g, b])?;
        let t = step(cx, 3)?;
        let (pv, gv, bv) = (p.f32s()?, g.f32s()?, b.f32s()?);
        let (lr, mu, damp, wd) = (self.lr.unwrap_or(0.01), self.momentum(), self.dampening(), self.weight_decay());
        let nesterov = self.nesterov() != 0;
        if mu == 0.0 {
            // No momentum: the buffer passes through; one vectorisable pass over the rest.
            let po: Vec<f32> = if wd == 0.0 {
                pv.iter().zip(gv.iter()).map(|(&p, &g)| p + -lr * g).collect()
            } else {
                pv.iter().zip(gv.iter()).map(|(&p, &g)| p + -lr * (g + wd * p)).collect()
            };
            return Ok(vec![like(p, po), like(b, bv.to_vec())]);
        }
        let mut po = Vec::with_capacity(pv.len());
        let mut bo = Vec::with_capacity(pv.len());
        for i in 0..pv.len() {
            let mut d = gv[i];
            if wd != 0.0 {
                d += wd * pv[i];
            }
            let mut buf = bv[i];
            if mu != 0.0 {
                buf = if t == 1 { d } else { mu * buf + (1.0 - damp) * d };
                d = if nesterov { d + mu * buf } else { buf };
            }
            po.push(pv[i] + -lr * d);
            bo.push(buf);
        }
        Ok(vec![like(p, po), like(b, bo)])
    }
}

impl OpRules for op::AdamUpdate {
    fn arity(&self) -> Arity {
        Arity::new(5, 5, 3, 3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![cx.input(0).cloned(), cx.input(2).cloned(), cx.input(3).cloned()])
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        update_space(cx)
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(12.0 * cx.in_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (p, g, m, v) = (cx.req(0)?, cx.req(1)?, cx.req(2)?, cx.req(3)?);
        same_sizes(&[p, g, m, v])?;
        let t = step(cx, 4)?;
        let (pv, gv, mv, vv) = (p.f32s()?, g.f32s()?, m.f32s()?, v.f32s()?);
        let (lr, b1, b2, eps, wd) =
            (self.lr.unwrap_or(1e-3), self.beta1(), self.beta2(), self.epsilon(), self.weight_decay());
        let decoupled = self.decoupled() != 0;
        let bc1 = 1.0 - f64::from(b1).powi(t as i32);
        let bc2 = 1.0 - f64::from(b2).powi(t as i32);
        let step_size = (f64::from(lr) / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let (mut po, mut mo, mut vo) =
            (Vec::with_capacity(pv.len()), Vec::with_capacity(pv.len()), Vec::with_capacity(pv.len()));
        for i in 0..pv.len() {
            let mut param = pv[i];
            let mut grad = gv[i];
            if wd != 0.0 {
                if decoupled {
                    param *= 1.0 - lr * wd;
                } else {
                    grad += wd * param;
                }
            }
            // m.lerp_(g, 1 − β1); v.mul_(β2).addcmul_(g, g, 1 − β2).
            let mm = mv[i] + (1.0 - b1) * (grad - mv[i]);
            let vn = vv[i] * b2 + (1.0 - b2) * grad * grad;
            let denom = vn.sqrt() / bc2_sqrt + eps;
            po.push(param + -step_size * (mm / denom));
            mo.push(mm);
            vo.push(vn);
        }
        Ok(vec![like(p, po), like(m, mo), like(v, vo)])
    }
}
