//! Communication between devices (the `shardc` domain), inserted by lowering: `AllReduce`,
//! `AllGather`, `ReduceScatter`, `AllToAll`, `HaloExchange`, `Send`, `Recv`.
//!
//! The runtime executes them across devices; the reference evaluator runs them only on a
//! group of one device, where each is the identity (a `Send`/`Recv` needs the runtime).

use super::shape::no_work_whole;
use super::util::norm_axis;
use super::{Arity, Arrays, EvalCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::EvalError;
use crate::graph::op;
use crate::layout::IterSpace;
use crate::types::{DType, Dim, TensorType};

/// The devices of a collective's group.
fn group_size(group: &Option<Vec<i64>>) -> i64 {
    group.as_ref().map_or(1, |g| g.len() as i64).max(1)
}

/// A collective on a group of one is the identity; larger groups need the runtime.
fn single_device(cx: &EvalCx<'_>, group: &Option<Vec<i64>>) -> Arrays {
    if group_size(group) == 1 {
        Ok(vec![cx.req(0)?.clone()])
    } else {
        Err(EvalError::Unsupported(format!(
            "{} across {} devices (the runtime executes it)",
            cx.name,
            group_size(group)
        )))
    }
}

/// `X`'s dims with dim `axis` changed by `f` (unknown stays unknown).
fn with_axis(cx: &InferCx<'_>, axis: Option<i64>, f: impl Fn(i64) -> Result<i64, String>) -> Types {
    let Some(d) = cx.dims(0) else { return cx.one(None) };
    if d.is_empty() {
        return Err("a collective along an axis needs a tensor of rank 1 or more".into());
    }
    let ax = norm_axis(axis.unwrap_or(0), d.len())?;
    let mut out = d.clone();
    out[ax] = match d[ax].value() {
        Some(v) => Dim::Fixed(f(v)?),
        None => Dim::Unknown,
    };
    cx.one(Some(out))
}

impl OpRules for op::AllReduce {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        single_device(cx, &self.group)
    }
}

impl OpRules for op::AllGather {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let p = group_size(&self.group);
        with_axis(cx, self.axis, |v| Ok(v * p))
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        single_device(cx, &self.group)
    }
}

impl OpRules for op::ReduceScatter {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let p = group_size(&self.group);
        with_axis(cx, self.axis, |v| {
            if v % p == 0 { Ok(v / p) } else { Err(format!("dim {v} does not split into {p} parts")) }
        })
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        single_device(cx, &self.group)
    }
}

impl OpRules for op::AllToAll {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let p = group_size(&self.group);
        let (s, c) =
            (norm_axis(self.split_axis.unwrap_or(0), d.len())?, norm_axis(self.concat_axis.unwrap_or(0), d.len())?);
        let mut out = d.clone();
        out[s] = d[s].value().map_or(Dim::Unknown, |v| Dim::Fixed(v / p));
        out[c] = out[c].value().map_or(Dim::Unknown, |v| Dim::Fixed(v * p));
        cx.one(Some(out))
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        single_device(cx, &self.group)
    }
}

impl OpRules for op::HaloExchange {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    /// `widths` = `[from_prev, from_next, to_prev, to_next]`: the output grows by what comes
    /// in.
    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let grow: i64 = self.widths.clone().unwrap_or_default().iter().take(2).sum();
        with_axis(cx, self.axis, |v| Ok(v + grow))
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    /// On one device nothing comes in (the ends of a group receive nothing from outside).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        single_device(cx, &self.group)
    }
}

impl OpRules for op::Send {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 0, 0)
    }

    fn infer(&self, _cx: &InferCx<'_>) -> Types {
        Ok(vec![])
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Err(EvalError::Unsupported(format!(
            "{} to device {} (the runtime executes it)",
            cx.name,
            self.peer.unwrap_or(0)
        )))
    }
}

impl OpRules for op::Recv {
    fn arity(&self) -> Arity {
        Arity::new(0, 0, 1, 1)
    }

    fn infer(&self, _cx: &InferCx<'_>) -> Types {
        Ok(vec![Some(TensorType::fixed(
            self.dtype.and_then(DType::from_code).unwrap_or(DType::Float),
            self.shape.as_deref().unwrap_or(&[]),
        ))])
    }

    no_work_whole!();

    fn sharded(&self) -> Sharded {
        Sharded::Whole
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Err(EvalError::Unsupported(format!(
            "{} from device {} (the runtime executes it)",
            cx.name,
            self.peer.unwrap_or(0)
        )))
    }
}
