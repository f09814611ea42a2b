//! Shapes and data movement: `Reshape`, `Flatten`, `Squeeze`, `Unsqueeze`, `Transpose`,
//! `Concat`, `Split`, `Slice`, `Pad`, `Expand`, `Tile`, and the ops that make values from
//! shapes or nothing: `Shape`, `Size`, `Constant`, `ConstantOfShape`, `Range`, `EyeLike`.
//!
//! Reshapes map input dims onto output dims group by group ([`crate::layout::reshape_map`]);
//! ops that leave some dims alone split along those; the rest run whole.

use super::flow::{factor_reshape, flow_positional};
use super::grad::GradCx;
use super::util::{bcast_shapes, broadcast_walk, inverse_perm, join, norm_axes, norm_axis, prod, prod_dim, prod_div};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, MANY, Mono, NodeCx, OpRules, TypeRule, Types, Work};
use crate::array::{Array, Data, EvalError, numel, strides};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace, par, reshape_map};
use crate::ops::elementwise::cast;
use crate::ops::space::pointwise;
use crate::ops::util::broadcast_shapes;
use crate::types::{DType, Dim, TensorType};

mod eval;
mod grad;
pub use eval::*;
pub use grad::*;

type Result<T> = std::result::Result<T, EvalError>;

/// Ops that compute no arithmetic and run whole (shape values, constants).
macro_rules! no_work_whole {
    () => {
        fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
            Some(IterSpace::whole(cx))
        }

        fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
            Work::none()
        }
    };
}
pub(crate) use no_work_whole;

/// The iteration space of a reshape: output dims that some input dim maps onto split; the
/// others cannot (their pieces would need the whole input).
fn reshape_space(cx: &NodeCx<'_>) -> IterSpace {
    let (x, out) = (cx.in_dims(0), cx.out_dims(0));
    let r = out.len();
    let xm = reshape_map(&x, &out);
    let sd: Vec<IterDim> = out
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let mut d = par(format!("d{i}"), s);
            if !xm.contains(&Some(i)) {
                d.kind = DimKind::Fixed;
            }
            d
        })
        .collect();
    let mut inputs = vec![Some(xm)];
    for i in cx.g.node(cx.n).inputs().iter().skip(1) {
        inputs.push(i.map(|v| vec![None; cx.rank(v)]));
    }
    let om: Vec<Option<usize>> = (0..r).map(|i| (out[i] != 1).then_some(i)).collect();
    IterSpace { dims: sd, inputs, outputs: vec![om] }
}

/// The iteration space of ops that change some dims of input 0 and leave the others alone
/// (right-aligned): the untouched dims map straight through, the changed ones are fixed.
pub(crate) fn passthrough_space(cx: &NodeCx<'_>) -> IterSpace {
    let (x, out) = (cx.in_dims(0), cx.out_dims(0));
    let r = out.len();
    let sd: Vec<IterDim> = out
        .iter()
        .enumerate()
        .map(|(i, &sz)| {
            let t = (i + x.len()).checked_sub(r);
            let same = t.is_some_and(|t| x[t] == sz);
            IterDim {
                name: format!("d{i}"),
                size: sz,
                kind: if same { DimKind::Parallel } else { DimKind::Fixed },
                role: DimRole::Other,
            }
        })
        .collect();
    let xm: Vec<Option<usize>> = (0..x.len())
        .map(|t| {
            let i = t + r - x.len().min(r);
            (i < r && x[t] == out[i] && x[t] != 1).then_some(i)
        })
        .collect();
    let mut inputs = vec![Some(xm)];
    for i in cx.g.node(cx.n).inputs().iter().skip(1) {
        inputs.push(i.map(|v| vec![None; cx.rank(v)]));
    }
    let same = |i: usize| (i + x.len()).checked_sub(r).is_some_and(|t| x[t] == out[i]);
    IterSpace { dims: sd, inputs, outputs: vec![(0..r).map(|i| (out[i] != 1 && same(i)).then_some(i)).collect()] }
}

impl OpRules for op::Reshape {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(reshape_grad(cx))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(spec) = cx.shape_operand(1) else {
            // Rank is known from the shape operand's length.
            let rank = cx.dims(1).and_then(|d| d.first()).and_then(Dim::value);
            return cx.one(rank.map(|r| vec![Dim::Unknown; r as usize]));
        };
        let input = cx.dims(0);
        let mut out = Vec::with_capacity(spec.len());
        let mut infer_at = None;
        for (i, s) in spec.iter().enumerate() {
            match s {
                Dim::Fixed(-1) => {
                    if infer_at.replace(i).is_some() {
                        return Err("the shape has more than one -1".into());
                    }
                    out.push(Dim::Unknown);
                }
                Dim::Fixed(0) if self.allowzero() == 0 => out.push(
                    input
                        .and_then(|d| d.get(i).cloned())
                        .ok_or(format!("shape entry {i} copies a dim the input does not have"))?,
                ),
                Dim::Fixed(v) if *v < -1 => return Err(format!("invalid shape entry {v}")),
                other => out.push(other.clone()),
            }
        }
        if let Some(d) = input {
            let total = prod(d);
            if let Some(i) = infer_at {
                let rest: Vec<Dim> = out.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, v)| v.clone()).collect();
                let r = prod(&rest);
                let numeric = |p: &super::util::Prod| !p.unknown && p.syms.is_empty();
                if numeric(&total) && numeric(&r) && (r.coef == 0 || total.coef % r.coef != 0) {
                    return Err(format!(
                        "cannot reshape [{}] ({} elements) to [{}]: the other dims hold {} elements",
                        join(d),
                        total.coef,
                        join(&spec),
                        r.coef
                    ));
                }
                out[i] = prod_div(&total, &r);
            } else {
                let p = prod(&out);
                if !total.unknown && !p.unknown && total.syms == p.syms && total.coef != p.coef {
                    return Err(format!("cannot reshape [{}] ({} elements) to [{}]", join(d), total.coef, join(&out)));
                }
            }
        }
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(reshape_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let spec = cx.req(1)?.to_i64()?;
        Ok(vec![x.clone().reshaped(reshape_target(&x.shape, &spec, self.allowzero() != 0)?)])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (xm, xo) = (cx.in_m(0)?, cx.in_old(0)?);
        if !xm.iter().any(Mono::is_tracked) {
            return Some(());
        }
        match factor_reshape(&xo, &xm, &cx.out_old(), cx.syms) {
            Ok(m) => cx.set(0, m),
            Err(e) => cx.error(e),
        }
        Some(())
    }
}

impl OpRules for op::Flatten {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(reshape_grad(cx))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(Some(vec![Dim::Unknown, Dim::Unknown])) };
        let a = if self.axis() < 0 { self.axis() + d.len() as i64 } else { self.axis() };
        if a < 0 || a > d.len() as i64 {
            return Err(format!("axis {} is out of range for rank {}", self.axis(), d.len()));
        }
        let a = a as usize;
        cx.one(Some(vec![prod_dim(&prod(&d[..a])), prod_dim(&prod(&d[a..]))]))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(reshape_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let r = x.rank();
        let a = if self.axis() < 0 { self.axis() + r as i64 } else { self.axis() };
        if a < 0 || a > r as i64 {
            return Err(EvalError::Invalid(format!("Flatten axis {} for rank {r}", self.axis())));
        }
        let a = a as usize;
        let outer = x.shape[..a].iter().product();
        let inner = x.shape[a..].iter().product();
        Ok(vec![x.clone().reshaped(vec![outer, inner])])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let xm = cx.in_m(0)?;
        let r = xm.len() as i64;
        let a = (if self.axis() < 0 { self.axis() + r } else { self.axis() }).clamp(0, r) as usize;
        let left = xm[..a].iter().fold(Mono::constant(1), |acc, m| acc.mul(m));
        let right = xm[a..].iter().fold(Mono::constant(1), |acc, m| acc.mul(m));
        cx.set(0, vec![left, right]);
        Some(())
    }
}

/// The axes of Squeeze/Unsqueeze: the input (opset 13+) or the attribute.
fn axes_operand(cx: &EvalCx<'_>, attr: &Option<Vec<i64>>) -> Result<Option<Vec<i64>>> {
    Ok(match cx.opt(1) {
        Some(a) => Some(a.to_i64()?),
        None => attr.clone(),
    })
}

impl OpRules for op::Squeeze {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(reshape_grad(cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let axes_input = cx.ins.len() > 1 && cx.input(1).is_some();
        let axes = if axes_input { cx.ints(1) } else { self.axes.clone() };
        let out = match axes {
            Some(axes) => {
                let axes = norm_axes(&axes, d.len())?;
                for &a in &axes {
                    if let Some(v) = d[a].value()
                        && v != 1
                    {
                        return Err(format!("cannot squeeze axis {a} of size {v}"));
                    }
                }
                d.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, v)| v.clone()).collect()
            }
            None => {
                if axes_input || d.iter().any(|v| !v.is_known()) {
                    return cx.one(None);
                }
                d.iter().filter(|v| **v != Dim::Fixed(1)).cloned().collect()
            }
        };
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(reshape_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let shape: Vec<usize> = match axes_operand(cx, &self.axes)? {
            Some(axes) => {
                let axes = norm_axes(&axes, x.rank())?;
                x.shape.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect()
            }
            None => x.shape.iter().copied().filter(|&d| d != 1).collect(),
        };
        Ok(vec![x.clone().reshaped(shape)])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (xm, xo) = (cx.in_m(0)?, cx.in_old(0)?);
        let removed: Vec<usize> = match cx.ints(1).or_else(|| self.axes.clone()) {
            Some(ax) => ax.iter().map(|&a| (if a < 0 { a + xm.len() as i64 } else { a }) as usize).collect(),
            None => (0..xo.len()).filter(|&i| xo[i] == 1).collect(),
        };
        for &r in &removed {
            if xm.get(r).is_some_and(Mono::is_tracked) {
                cx.error(format!("it squeezes away axis {r}, which changes size"));
                return Some(());
            }
        }
        cx.set(0, xm.iter().enumerate().filter(|(i, _)| !removed.contains(i)).map(|(_, m)| m.clone()).collect());
        Some(())
    }
}

impl OpRules for op::Unsqueeze {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(reshape_grad(cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let axes = if cx.ins.len() > 1 { cx.ints(1) } else { self.axes.clone() };
        let Some(axes) = axes else { return cx.one(None) };
        let mut axes = norm_axes(&axes, d.len() + axes.len())?;
        axes.sort();
        let mut out = d.clone();
        for a in axes {
            out.insert(a, Dim::Fixed(1));
        }
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(reshape_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let axes = axes_operand(cx, &self.axes)?.unwrap_or_default();
        let mut axes = norm_axes(&axes, x.rank() + axes.len())?;
        axes.sort();
        let mut shape = x.shape.clone();
        for a in axes {
            shape.insert(a, 1);
        }
        Ok(vec![x.clone().reshaped(shape)])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let xm = cx.in_m(0)?;
        let axes = cx.ints(1).or_else(|| self.axes.clone())?;
        let r = cx.out_old().len() as i64;
        let mut ax: Vec<usize> = axes.iter().map(|&a| (if a < 0 { a + r } else { a }) as usize).collect();
        ax.sort();
        let mut m = xm;
        for a in ax {
            m.insert(a.min(m.len()), Mono::constant(1));
        }
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::Transpose {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(transpose_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let perm: Vec<usize> = match &self.perm {
            Some(p) => {
                if p.len() != d.len() {
                    return Err(format!("perm {p:?} does not fit rank {}", d.len()));
                }
                norm_axes(p, d.len())?
            }
            None => (0..d.len()).rev().collect(),
        };
        cx.one(Some(perm.iter().map(|&p| d[p].clone()).collect()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let out = cx.out_dims(0);
        let r = out.len();
        let perm: Vec<usize> =
            self.perm.clone().map_or((0..r).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
        let sd: Vec<IterDim> = out.iter().enumerate().map(|(i, &s)| par(format!("d{i}"), s)).collect();
        let mut xm = vec![None; r];
        for (j, &p) in perm.iter().enumerate() {
            if p < r && out[j] != 1 {
                xm[p] = Some(j);
            }
        }
        Some(IterSpace {
            dims: sd,
            inputs: vec![Some(xm)],
            outputs: vec![(0..r).map(|i| (out[i] != 1).then_some(i)).collect()],
        })
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let perm: Vec<usize> = match &self.perm {
            Some(p) => norm_axes(p, x.rank())?,
            None => (0..x.rank()).rev().collect(),
        };
        Ok(vec![transpose(x, &perm)])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let xm = cx.in_m(0)?;
        let perm: Vec<usize> =
            self.perm.clone().map_or((0..xm.len()).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
        cx.set(0, perm.iter().map(|&p| xm[p].clone()).collect());
        Some(())
    }
}

impl OpRules for op::Concat {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(concat_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, MANY, 1, 1)
    }

    fn type_rule(&self) -> TypeRule {
        TypeRule::AllSame
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let ax = self.axis.ok_or("Concat needs `axis`")?;
        let all: Vec<&Vec<Dim>> = (0..cx.ins.len()).filter_map(|i| cx.dims(i)).collect();
        if all.len() != cx.ins.len() || all.is_empty() {
            return cx.one(None);
        }
        let r = all[0].len();
        let a = norm_axis(ax, r)?;
        let mut out = all[0].clone();
        let mut total = Some(0i64);
        for d in &all {
            if d.len() != r {
                return Err(format!("inputs of rank {r} and {} cannot be joined", d.len()));
            }
            for i in 0..r {
                if i != a {
                    if let (Some(p), Some(q)) = (out[i].value(), d[i].value())
                        && p != q
                    {
                        return Err(format!("inputs differ in dim {i} ({p} vs {q}) off the concat axis"));
                    }
                    if !out[i].is_known() && d[i].is_known() {
                        out[i] = d[i].clone();
                    }
                }
            }
            total = total.and_then(|t| d[a].value().map(|v| t + v));
        }
        out[a] = match total {
            Some(t) => Dim::Fixed(t),
            None if all.len() == 1 => all[0][a].clone(),
            None => Dim::Unknown,
        };
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let out = cx.out_dims(0);
        let r = out.len();
        let Ok(a) = norm_axis(self.axis.unwrap_or(0), r) else { return Some(IterSpace::whole(cx)) };
        let mut sp = pointwise(cx, &[a], &[], 0);
        for m in sp.inputs.iter_mut().flatten() {
            if a < m.len() {
                m[a] = None;
            }
        }
        for (i, v) in cx.g.node(cx.n).inputs().iter().enumerate() {
            // Inputs match the output off the axis even where sizes are 1 on it.
            if let (Some(v), Some(Some(m))) = (v, sp.inputs.get_mut(i)) {
                let d = cx.dims(Some(*v));
                for t in 0..d.len().min(r) {
                    if t != a && d[t] == out[t] && out[t] != 1 {
                        m[t] = Some(t);
                    }
                }
            }
        }
        Some(sp)
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![concat(&cx.all(), self.axis.ok_or_else(|| EvalError::Invalid("Concat without axis".into()))?)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let out_old = cx.out_old();
        let r = out_old.len() as i64;
        let a = self.axis.map(|x| (if x < 0 { x + r } else { x }) as usize).unwrap_or(0);
        let ins = cx.inputs();
        let mut m = cx.equal_axes(&ins, &out_old);
        let parts: Vec<Mono> = ins.iter().filter_map(|&v| cx.monos_of(v).and_then(|mm| mm.get(a).cloned())).collect();
        m[a] = if parts.iter().any(Mono::is_tracked) { Mono::Opaque } else { Mono::constant(out_old[a]) };
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::Split {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(split_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, MANY)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let n_out = cx.n_out;
        let Some(d) = cx.dims(0) else { return Ok(vec![cx.with(cx.dtype(), None); n_out]) };
        let a = norm_axis(self.axis(), d.len())?;
        let sizes: Option<Vec<i64>> = if cx.ins.len() > 1 && cx.input(1).is_some() {
            cx.ints(1)
        } else if let Some(sp) = &self.split {
            Some(sp.clone())
        } else {
            d[a].value().map(|total| {
                let parts = self.num_outputs.unwrap_or(n_out as i64).max(1);
                let chunk = (total + parts - 1) / parts;
                (0..parts).map(|i| chunk.min((total - i * chunk).max(0))).collect()
            })
        };
        let with_axis = |v: Dim| -> Option<TensorType> {
            cx.with(
                cx.dtype(),
                Some(d.iter().enumerate().map(|(i, x)| if i == a { v.clone() } else { x.clone() }).collect()),
            )
        };
        let Some(sizes) = sizes else { return Ok(vec![with_axis(Dim::Unknown); n_out]) };
        if sizes.len() != n_out {
            return Err(format!("{} split sizes for {n_out} outputs", sizes.len()));
        }
        if let Some(total) = d[a].value()
            && sizes.iter().sum::<i64>() != total
        {
            return Err(format!("split sizes {sizes:?} do not add up to {total}"));
        }
        Ok(sizes.iter().map(|&sz| with_axis(Dim::Fixed(sz))).collect())
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let x = cx.in_dims(0);
        let Ok(a) = norm_axis(self.axis(), x.len()) else { return Some(IterSpace::whole(cx)) };
        let sd: Vec<IterDim> = x
            .iter()
            .enumerate()
            .map(|(i, &sz)| IterDim {
                name: format!("d{i}"),
                size: sz,
                kind: if i == a { DimKind::Fixed } else { DimKind::Parallel },
                role: DimRole::Other,
            })
            .collect();
        let xm: Vec<Option<usize>> = (0..x.len()).map(|i| (i != a && x[i] != 1).then_some(i)).collect();
        let mut inputs = vec![Some(xm.clone())];
        for i in cx.g.node(cx.n).inputs().iter().skip(1) {
            inputs.push(i.map(|v| vec![None; cx.rank(v)]));
        }
        Some(IterSpace { dims: sd, inputs, outputs: vec![xm; cx.n_out()] })
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        split(self, cx, cx.n_out)
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let xm = cx.in_m(0)?;
        let r = xm.len() as i64;
        let a = (if self.axis() < 0 { self.axis() + r } else { self.axis() }) as usize;
        if xm.get(a).is_some_and(Mono::is_tracked) {
            cx.error(format!("it splits axis {a}, which changes size, into fixed parts"));
            return Some(());
        }
        for k in 0..cx.n_out() {
            let mut m = xm.clone();
            if let Some(d) = cx.out_old_at(k) {
                m[a] = Mono::constant(d[a]);
            }
            cx.set(k, m);
        }
        Some(())
    }
}

impl OpRules for op::Slice {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(slice_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 5, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let legacy = cx.ins.len() == 1 && self.starts.is_some();
        let given = |i: usize| cx.ins.len() > i && cx.ins[i].is_some();
        let (starts, ends, axes, steps) = if legacy {
            (self.starts.clone(), self.ends.clone(), self.axes.clone(), None)
        } else {
            (cx.ints(1), cx.ints(2), if given(3) { cx.ints(3) } else { None }, if given(4) { cx.ints(4) } else { None })
        };
        let unknown = || cx.one(Some(vec![Dim::Unknown; d.len()]));
        let (Some(starts), Some(ends)) = (starts, ends) else { return unknown() };
        if !legacy && given(3) && axes.is_none() {
            return unknown();
        }
        if starts.len() != ends.len() {
            return Err("starts and ends differ in length".into());
        }
        let axes: Vec<usize> = match axes {
            Some(a) => norm_axes(&a, d.len())?,
            None => (0..starts.len()).collect(),
        };
        let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
        let mut out = d.clone();
        for (k, &a) in axes.iter().enumerate() {
            if steps[k] == 0 {
                return Err("slice step 0".into());
            }
            out[a] = match d[a].value() {
                Some(dim) => Dim::Fixed(slice_params(dim, starts[k], ends[k], steps[k]).2 as i64),
                None if starts[k] == 0 && steps[k] == 1 && ends[k] >= i32::MAX as i64 => d[a].clone(),
                None => Dim::Unknown,
            };
        }
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(passthrough_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![slice(self, cx)?])
    }

    /// A full slice of a changing axis follows it; a partial one has a literal size.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (xm, xo) = (cx.in_m(0)?, cx.in_old(0)?);
        let out_old = cx.out_old();
        let m: Vec<Mono> = (0..out_old.len())
            .map(|i| if out_old[i] == xo[i] && xm[i].is_tracked() { xm[i].clone() } else { Mono::constant(out_old[i]) })
            .collect();
        if cx.tracked_in() {
            cx.set(0, m);
        }
        Some(())
    }
}

impl OpRules for op::Pad {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(pad_grad(self, cx))
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 4, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let r = d.len();
        let unknown = || cx.one(Some(vec![Dim::Unknown; r]));
        let pads = if cx.ins.len() > 1 && cx.ins[1].is_some() { cx.ints(1) } else { self.pads.clone() };
        let Some(pads) = pads else { return unknown() };
        let axes: Vec<usize> = match cx.ints(3) {
            Some(a) => norm_axes(&a, r)?,
            None if cx.ins.len() > 3 && cx.ins[3].is_some() => return unknown(),
            None => (0..r).collect(),
        };
        let k = axes.len();
        if pads.len() != 2 * k {
            return Err(format!("pads {pads:?} need {} values", 2 * k));
        }
        let mut out = d.clone();
        for (i, &a) in axes.iter().enumerate() {
            out[a] = d[a].value().map_or(Dim::Unknown, |v| Dim::Fixed(v + pads[i] + pads[i + k]));
        }
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(passthrough_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![pad(self, cx)?])
    }
}

impl OpRules for op::Expand {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            cx.set_broadcast(0, dy)
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(target), Some(d)) = (cx.shape_operand(1), cx.dims(0)) else { return cx.one(None) };
        cx.one(Some(bcast_shapes(d, &target)?))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(passthrough_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![expand(cx.req(0)?, &cx.req(1)?.to_i64()?)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (xm, xo) = (cx.in_m(0)?, cx.in_old(0)?);
        let out_old = cx.out_old();
        let r = out_old.len();
        let m: Vec<Mono> = (0..r)
            .map(|i| match (i + xo.len()).checked_sub(r) {
                Some(k) if xo[k] == out_old[i] => xm[k].clone(),
                _ => Mono::constant(out_old[i]),
            })
            .collect();
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::Tile {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(tile_grad(cx))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        let Some(rep) = cx.ints(1) else { return cx.one(Some(vec![Dim::Unknown; d.len()])) };
        if rep.len() != d.len() {
            return Err(format!("repeats {rep:?} do not fit rank {}", d.len()));
        }
        let tiled = |(v, &r): (&Dim, &i64)| {
            if r == 1 { v.clone() } else { v.value().map_or(Dim::Unknown, |v| Dim::Fixed(v * r)) }
        };
        cx.one(Some(d.iter().zip(&rep).map(tiled).collect()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(passthrough_space(cx))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![tile(cx.req(0)?, &cx.req(1)?.to_i64()?)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let xm = cx.in_m(0)?;
        if xm.iter().any(Mono::is_tracked) {
            let reps = cx.ints(1).unwrap_or_default();
            let m = xm.iter().enumerate().map(|(i, m)| m.mul(&Mono::constant(*reps.get(i).unwrap_or(&1)))).collect();
            cx.set(0, m);
        }
        Some(())
    }
}

impl OpRules for op::Shape {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let len = cx.dims(0).map(|d| {
            let (a, b) = self.range(d.len());
            (b - a) as i64
        });
        Ok(vec![Some(TensorType::new(DType::Int64, vec![len.map_or(Dim::Unknown, Dim::Fixed)]))])
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        let (a, b) = self.range(x.rank());
        let dims: Vec<i64> = x.shape[a..b].iter().map(|&d| d as i64).collect();
        Ok(vec![Array::i64(vec![dims.len()], dims)])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl op::Shape {
    /// The `start..end` of the dims it returns for a tensor of rank `r` (clamped, ONNX rules).
    pub fn range(&self, r: usize) -> (usize, usize) {
        let ri = r as i64;
        let clampi = |v: i64| (if v < 0 { v + ri } else { v }).clamp(0, ri) as usize;
        let (a, b) = (clampi(self.start()), clampi(self.end.unwrap_or(ri)));
        (a, b.max(a))
    }
}

impl OpRules for op::Size {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, _cx: &InferCx<'_>) -> Types {
        Ok(vec![Some(TensorType::scalar(DType::Int64))])
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![Array::scalar_i64(cx.req(0)?.numel() as i64)])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl OpRules for op::Constant {
    fn arity(&self) -> Arity {
        Arity::new(0, 0, 1, 1)
    }

    fn infer(&self, _cx: &InferCx<'_>) -> Types {
        let a = constant(self).map_err(|e| e.to_string())?;
        Ok(vec![Some(TensorType::fixed(a.dtype, &a.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()))])
    }

    no_work_whole!();

    fn eval(&self, _cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![constant(self)?])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl OpRules for op::ConstantOfShape {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dtype = self.value.as_ref().map_or(DType::Float, |t| t.dtype);
        let dims = cx.shape_operand(0).or_else(|| {
            cx.dims(0).and_then(|d| d.first()).and_then(Dim::value).map(|r| vec![Dim::Unknown; r as usize])
        });
        Ok(vec![Some(TensorType { dtype, dims })])
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let shape: Vec<usize> = cx.req(0)?.to_i64()?.iter().map(|&d| d.max(0) as usize).collect();
        let value = match &self.value {
            Some(t) => Array::from_tensor(t)?,
            None => Array::f32(vec![1], vec![0.0]),
        };
        let idx = vec![0usize; numel(&shape)];
        Ok(vec![value.gather_flat(shape, &idx)])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl OpRules for op::Range {
    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // The length is a function of the three values: max(⌈(limit − start) / delta⌉, 0),
        // known from constant bounds however long the range (folding stops at large values).
        if cx.needs_values(&[0, 1, 2]) {
            let at = |i: usize| cx.konst(i).and_then(|a| a.to_f64().ok()).and_then(|v| v.first().copied());
            if let (Some(start), Some(limit), Some(delta)) = (at(0), at(1), at(2))
                && delta != 0.0
            {
                let n = ((limit - start) / delta).ceil().max(0.0) as i64;
                return cx.one(Some(vec![Dim::Fixed(n)]));
            }
        }
        cx.one(Some(vec![Dim::Unknown]))
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![range(cx.req(0)?, cx.req(1)?, cx.req(2)?)?])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl OpRules for op::EyeLike {
    flow_positional!(0);

    fn grad(&self, _cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        // The output depends on the input's shape only: no gradient flows.
        Some(Ok(()))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        Ok(vec![cx.with(self.dtype.and_then(DType::from_code).or(cx.dtype()), cx.dims(0).cloned())])
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let x = cx.req(0)?;
        if x.rank() != 2 {
            return Err(EvalError::Invalid(format!("EyeLike needs a matrix, got {:?}", x.shape)));
        }
        let dtype = self.dtype.and_then(DType::from_code).unwrap_or(x.dtype);
        let (h, w) = (x.shape[0], x.shape.get(1).copied().unwrap_or(1));
        let k = self.k();
        let v: Vec<f64> = (0..h * w).map(|f| if (f % w) as i64 - (f / w) as i64 == k { 1.0 } else { 0.0 }).collect();
        Ok(vec![super::elementwise::cast(&Array::float(DType::Double, x.shape.clone(), v), dtype)?])
    }
}

impl OpRules for op::SliceGrad {
    fn arity(&self) -> Arity {
        Arity::new(3, 5, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let shape = self.shape.as_ref().ok_or("SliceGrad needs `shape`")?;
        cx.one(Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()))
    }

    /// Every dim the slice did not cut splits as an element-wise op's (dy's dim `i` is the
    /// output's dim `i`: a RoPE half's gradient stays split along the batch, the heads and
    /// the sequence); the sliced dims stay whole. Axes not known as constants: whole.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.in_dims(0).len();
        let sliced: Vec<usize> = match cx.g.node(cx.n).input(3) {
            Some(_) => match cx.const_ints(3) {
                Some(a) => a.iter().map(|&x| if x < 0 { x + r as i64 } else { x } as usize).collect(),
                None => return Some(IterSpace::whole(cx)),
            },
            None => (0..cx.const_ints(1).map_or(r, |s| s.len())).collect(),
        };
        let mut sp = passthrough_space(cx);
        for a in sliced.into_iter().filter(|&a| a < r) {
            sp.dims[a].kind = DimKind::Fixed;
            for m in sp.inputs.iter_mut().flatten().chain(sp.outputs.iter_mut()) {
                if m.len() == r {
                    m[a] = None;
                }
            }
        }
        Some(sp)
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.out_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let dy = cx.req(0)?;
        let shape: Vec<usize> = self
            .shape
            .as_ref()
            .ok_or_else(|| EvalError::Invalid("SliceGrad without shape".into()))?
            .iter()
            .map(|&d| d.max(0) as usize)
            .collect();
        let rank = shape.len();
        let starts = cx.req(1)?.to_i64()?;
        let ends = cx.req(2)?.to_i64()?;
        let axes: Vec<usize> = match cx.opt(3) {
            Some(a) => a.to_i64()?.iter().map(|&v| norm_axis(v, rank)).collect::<std::result::Result<_, String>>()?,
            None => (0..starts.len()).collect(),
        };
        let steps = cx.opt(4).map(|a| a.to_i64()).transpose()?.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() || dy.rank() != rank
        {
            return Err(EvalError::Invalid(format!(
                "SliceGrad: {} starts, {} ends, {} axes, {} steps; dy of rank {} for rank {rank}",
                starts.len(),
                ends.len(),
                axes.len(),
                steps.len(),
                dy.rank()
            )));
        }
        let mut start = vec![0i64; rank];
        let mut step = vec![1i64; rank];
        for (k, &ax) in axes.iter().enumerate() {
            let (s0, st, _) = slice_params(shape[ax] as i64, starts[k], ends[k], steps[k]);
            start[ax] = s0;
            step[ax] = st;
        }
        let dv = dy.to_f64()?;
        let (xs, ys) = (strides(&shape), strides(&dy.shape));
        let mut out = vec![0.0; numel(&shape)];
        for (i, &v) in dv.iter().enumerate() {
            let mut off = 0i64;
            for d in 0..rank {
                let c = (i / ys[d]) % dy.shape[d].max(1);
                off += (start[d] + c as i64 * step[d]) * xs[d] as i64;
            }
            out[off as usize] += v;
        }
        Ok(vec![Array::float(dy.dtype, shape, out)])
    }
}

impl OpRules for op::CenterCropPad {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(d), Some(sh)) = (cx.dims(0), cx.ints(1)) else {
            cx.needs_values(&[1]);
            return cx.one(cx.dims(0).map(|d| vec![Dim::Unknown; d.len()]));
        };
        let axes = center_axes(self, d.len())?;
        let mut out = d.clone();
        for (&a, &s) in axes.iter().zip(&sh) {
            out[a] = Dim::Fixed(s);
        }
        cx.one(Some(out))
    }

    no_work_whole!();

    /// Crops or pads each listed axis to the given length about its centre (the extra
    /// element of an odd difference at the end).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, sh) = (cx.req(0)?, cx.req(1)?.to_i64()?);
        let axes = center_axes(self, x.rank())?;
        let mut shape = x.shape.clone();
        // Per axis: (start in the input, start in the output, length copied).
        let mut copy: Vec<(usize, usize, usize)> = x.shape.iter().map(|&n| (0, 0, n)).collect();
        for (&a, &s) in axes.iter().zip(&sh) {
            let (n, s) = (x.shape[a], s.max(0) as usize);
            shape[a] = s;
            copy[a] = if s <= n { ((n - s) / 2, 0, s) } else { (0, (s - n) / 2, n) };
        }
        let xv = x.to_f64()?;
        let (ist, ost) = (strides(&x.shape), strides(&shape));
        let mut out = vec![0.0; numel(&shape)];
        let region: Vec<usize> = copy.iter().map(|c| c.2).collect();
        let rst = strides(&region);
        for i in 0..numel(&region) {
            let (mut src, mut dst) = (0, 0);
            for d in 0..region.len() {
                let k = (i / rst[d]) % region[d];
                src += (copy[d].0 + k) * ist[d];
                dst += (copy[d].1 + k) * ost[d];
            }
            out[dst] = xv[src];
        }
        Ok(vec![if x.dtype.is_float() {
            Array::float(x.dtype, shape, out)
        } else {
            Array::int(x.dtype, shape, out.into_iter().map(|v| v as i64).collect())
        }])
    }

    /// Cropping about the centre and padding with zeros about it are each other's adjoints,
    /// at the same offsets: `dX = CenterCropPad(dY, X's lengths)` on the same axes.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let dims = cx.dims(cx.x(0)?)?;
            let axes = center_axes(self, dims.len())?;
            if axes.iter().any(|&a| dims[a] < 0) {
                return Err(format!("CenterCropPad of {dims:?}: the cropped lengths must be known"));
            }
            let lens: Vec<i64> = axes.iter().map(|&a| dims[a]).collect();
            let shape = cx.ints(&lens);
            let d = cx.add1(Op::CenterCropPad(self.clone()), &[dy, shape])?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

fn center_axes(c: &op::CenterCropPad, rank: usize) -> std::result::Result<Vec<usize>, String> {
    match &c.axes {
        Some(a) => norm_axes(a, rank),
        None => Ok((0..rank).collect()),
    }
}
