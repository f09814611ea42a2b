//! Shapes and data movement: `Reshape`, `Flatten`, `Squeeze`, `Unsqueeze`, `Transpose`,
//! `Concat`, `Split`, `Slice`, `Pad`, `Expand`, `Tile`, and the ops that make values from
//! shapes or nothing: `Shape`, `Size`, `Constant`, `ConstantOfShape`, `Range`, `EyeLike`.
//!
//! Reshapes map input dims onto output dims group by group ([`crate::shard::reshape_map`]);
//! ops that leave some dims alone split along those; the rest run whole.

use super::flow::{factor_reshape, flow_positional};
use super::grad::GradCx;
use super::util::{bcast_shapes, broadcast_walk, inverse_perm, join, norm_axes, norm_axis, prod, prod_dim, prod_div};
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, MANY, Mono, NodeCx, OpRules, TypeRule, Types, Work};
use crate::eval::{Array, Data, EvalError, broadcast_shapes, cast, numel, strides};
use crate::graph::Value;
use crate::op::{self, Op};
use crate::shard::{DimKind, DimRole, IterDim, IterSpace, par, pointwise, reshape_map};
use crate::types::{DType, Dim, TensorType};

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
        // The length is a function of the three values (folding computes it when known).
        cx.needs_values(&[0, 1, 2]);
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

/// Permutes dimensions.
pub fn transpose(x: &Array, perm: &[usize]) -> Array {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let istr = strides(&x.shape);
    x.gather(shape.clone(), crate::eval::Walk::new(shape, perm.iter().map(|&p| istr[p]).collect(), 0))
}

/// Target shape of a Reshape (0 copies, -1 infers).
pub fn reshape_target(input: &[usize], spec: &[i64], allowzero: bool) -> Result<Vec<usize>> {
    let total = numel(input);
    let mut out = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &s) in spec.iter().enumerate() {
        match s {
            -1 => {
                if infer.replace(i).is_some() {
                    return Err(EvalError::Invalid("Reshape has more than one -1".into()));
                }
                out.push(1);
            }
            0 if !allowzero => out.push(*input.get(i).ok_or_else(|| {
                EvalError::Invalid(format!("Reshape copies dim {i} of a rank-{} input", input.len()))
            })?),
            s if s < 0 => return Err(EvalError::Invalid(format!("Reshape dim {s}"))),
            s => out.push(s as usize),
        }
    }
    if let Some(i) = infer {
        let known: usize = out.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, d)| *d).product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(EvalError::Invalid(format!("cannot reshape {input:?} to {spec:?}")));
        }
        out[i] = total / known;
    }
    if numel(&out) != total {
        return Err(EvalError::Invalid(format!("cannot reshape {input:?} ({total} elements) to {spec:?}")));
    }
    Ok(out)
}

fn concat(parts: &[&Array], ax: i64) -> Result<Array> {
    let first = parts[0];
    let ax = norm_axis(ax, first.rank())?;
    let mut shape = first.shape.clone();
    shape[ax] = parts.iter().map(|p| p.shape[ax]).sum();
    for p in parts {
        if p.rank() != first.rank() || (0..first.rank()).any(|d| d != ax && p.shape[d] != first.shape[d]) {
            return Err(EvalError::Invalid(format!("Concat of {:?} and {:?} along {ax}", first.shape, p.shape)));
        }
        if p.dtype != first.dtype {
            return Err(EvalError::Invalid("Concat of different element types".into()));
        }
    }
    let outer: usize = shape[..ax].iter().product();
    let inner: usize = shape[ax + 1..].iter().product();
    let all = Array { dtype: first.dtype, shape: vec![], data: Array::concat_data(parts) };
    let mut offsets = Vec::with_capacity(parts.len());
    let mut acc = 0;
    for p in parts {
        offsets.push(acc);
        acc += p.numel();
    }
    let mut idx = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for (p, off) in parts.iter().zip(&offsets) {
            let block = p.shape[ax] * inner;
            idx.extend((0..block).map(|k| off + o * block + k));
        }
    }
    Ok(all.gather_flat(shape, &idx))
}

/// Slices `x` along `ax` from `start` for `len` elements.
pub fn slice_axis(x: &Array, ax: usize, start: usize, len: usize) -> Array {
    let outer: usize = x.shape[..ax].iter().product();
    let n = x.shape[ax];
    let inner: usize = x.shape[ax + 1..].iter().product();
    let mut idx = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        for j in start..start + len {
            let base = (o * n + j) * inner;
            idx.extend(base..base + inner);
        }
    }
    let mut shape = x.shape.clone();
    shape[ax] = len;
    x.gather_flat(shape, &idx)
}

fn split(op: &op::Split, cx: &EvalCx<'_>, n_out: usize) -> Result<Vec<Array>> {
    let x = cx.req(0)?;
    let ax = norm_axis(op.axis(), x.rank())?;
    let total = x.shape[ax];
    let sizes: Vec<usize> = match (cx.opt(1), &op.split) {
        (Some(s), _) => s.to_i64()?.iter().map(|&v| v as usize).collect(),
        (None, Some(s)) => s.iter().map(|&v| v as usize).collect(),
        _ => {
            let parts = op.num_outputs.map(|n| n as usize).unwrap_or(n_out).max(1);
            let chunk = total.div_ceil(parts);
            (0..parts).map(|i| chunk.min(total.saturating_sub(i * chunk))).collect()
        }
    };
    if sizes.iter().sum::<usize>() != total {
        return Err(EvalError::Invalid(format!("Split sizes {sizes:?} do not add up to {total}")));
    }
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&s| {
            let a = slice_axis(x, ax, start, s);
            start += s;
            a
        })
        .collect())
}

/// Normalised slice parameters of one axis: (start, step, count).
pub fn slice_params(dim: i64, start: i64, end: i64, step: i64) -> (i64, i64, usize) {
    let clampi = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
    let norm = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
    if step > 0 {
        let s = clampi(norm(start), 0, dim);
        let e = clampi(norm(end), 0, dim);
        let count = if e > s { ((e - s) + step - 1) / step } else { 0 };
        (s, step, count as usize)
    } else {
        let s = clampi(norm(start), -1, dim - 1);
        let e = clampi(norm(end), -1, dim - 1);
        let count = if s > e { ((s - e) + (-step) - 1) / (-step) } else { 0 };
        (s, step, count as usize)
    }
}

fn slice(op: &op::Slice, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let (starts, ends, axes, steps) = if cx.opt(1).is_some() || op.starts.is_none() {
        (
            cx.req(1)?.to_i64()?,
            cx.req(2)?.to_i64()?,
            cx.opt(3).map(|a| a.to_i64()).transpose()?,
            cx.opt(4).map(|a| a.to_i64()).transpose()?,
        )
    } else {
        (op.starts.clone().unwrap_or_default(), op.ends.clone().unwrap_or_default(), op.axes.clone(), None)
    };
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| norm_axis(v, x.rank())).collect::<std::result::Result<_, String>>()?,
        None => (0..starts.len()).collect(),
    };
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    let rank = x.rank();
    let mut start = vec![0i64; rank];
    let mut step = vec![1i64; rank];
    let mut count: Vec<usize> = x.shape.clone();
    for (k, &ax) in axes.iter().enumerate() {
        if steps[k] == 0 {
            return Err(EvalError::Invalid("Slice step 0".into()));
        }
        let (s, st, c) = slice_params(x.shape[ax] as i64, starts[k], ends[k], steps[k]);
        start[ax] = s;
        step[ax] = st;
        count[ax] = c;
    }
    let istr = strides(&x.shape);
    let n = numel(&count);
    let mut idx = Vec::with_capacity(n);
    let mut counter = vec![0usize; rank];
    for _ in 0..n {
        let mut flat = 0i64;
        for d in 0..rank {
            flat += (start[d] + counter[d] as i64 * step[d]) * istr[d] as i64;
        }
        idx.push(flat as usize);
        for d in (0..rank).rev() {
            counter[d] += 1;
            if counter[d] < count[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(x.gather_flat(count, &idx))
}

fn expand(x: &Array, shape: &[i64]) -> Result<Array> {
    let target: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let out = broadcast_shapes(&x.shape, &target)?;
    Ok(x.gather(out.clone(), broadcast_walk(&out, &x.shape)))
}

fn tile(x: &Array, repeats: &[i64]) -> Result<Array> {
    if repeats.len() != x.rank() {
        return Err(EvalError::Invalid("Tile repeats must match the rank".into()));
    }
    let shape: Vec<usize> = x.shape.iter().zip(repeats).map(|(&d, &r)| d * r.max(0) as usize).collect();
    let istr = strides(&x.shape);
    let ostr = strides(&shape);
    let idx: Vec<usize> = (0..numel(&shape))
        .map(|k| (0..shape.len()).map(|d| ((k / ostr[d]) % shape[d] % x.shape[d].max(1)) * istr[d]).sum())
        .collect();
    Ok(x.gather_flat(shape, &idx))
}

/// The input position a padded output position `o` (input coordinates: `o` in `0..len` is
/// inside) reads in `mode` — `edge` clamps, `reflect` mirrors without repeating the edge,
/// `wrap` wraps — or `None` for the fill value (`constant`).
fn pad_source(mode: &str, o: i64, len: i64) -> Option<i64> {
    if (0..len).contains(&o) {
        return Some(o);
    }
    if len <= 0 {
        // Nothing to read from an empty axis (`pad` refuses to pad one but with a constant).
        return None;
    }
    match mode {
        "edge" => Some(o.clamp(0, len - 1)),
        "reflect" if len == 1 => Some(0),
        "reflect" => {
            let period = 2 * (len - 1);
            let m = o.rem_euclid(period);
            Some(if m < len { m } else { period - m })
        }
        "wrap" => Some(o.rem_euclid(len.max(1))),
        _ => None,
    }
}

fn pad(op: &op::Pad, cx: &EvalCx<'_>) -> Result<Array> {
    let x = cx.req(0)?;
    let rank = x.rank();
    let pads_raw: Vec<i64> = match (cx.opt(1), &op.pads) {
        (Some(p), _) => p.to_i64()?,
        (None, Some(p)) => p.clone(),
        _ => vec![0; 2 * rank],
    };
    let axes: Vec<usize> = match cx.opt(3) {
        Some(a) => a.to_i64()?.iter().map(|&v| norm_axis(v, rank)).collect::<std::result::Result<_, String>>()?,
        None => (0..rank).collect(),
    };
    let mut pads = vec![0i64; 2 * rank];
    let k = axes.len();
    if pads_raw.len() != 2 * k {
        return Err(EvalError::Invalid(format!("Pad needs {} pads, got {}", 2 * k, pads_raw.len())));
    }
    for (i, &a) in axes.iter().enumerate() {
        pads[a] = pads_raw[i];
        pads[a + rank] = pads_raw[i + k];
    }
    let value = match cx.opt(2) {
        Some(v) => v.to_f64()?.first().copied().unwrap_or(0.0),
        None => f64::from(op.value.unwrap_or(0.0)),
    };
    let shape: Vec<usize> = (0..rank).map(|d| (x.shape[d] as i64 + pads[d] + pads[d + rank]).max(0) as usize).collect();
    let mode = op.mode();
    if mode != "constant"
        && let Some(d) = (0..rank).find(|&d| x.shape[d] == 0 && shape[d] > 0)
    {
        return Err(EvalError::Invalid(format!(
            "Pad in {mode} mode cannot pad axis {d}: the input is empty along it (only a constant fills it)"
        )));
    }
    let istr = strides(&x.shape);
    let ostr = strides(&shape);
    let n = numel(&shape);
    // Map each output element to an input index or to "fill".
    let mut src: Vec<Option<usize>> = Vec::with_capacity(n);
    for k in 0..n {
        let mut off = 0usize;
        let mut fill = false;
        for d in 0..rank {
            let o = ((k / ostr[d]) % shape[d]) as i64 - pads[d];
            let i = pad_source(mode, o, x.shape[d] as i64).unwrap_or_else(|| {
                fill = true;
                0
            });
            off += i.max(0) as usize * istr[d];
        }
        src.push(if fill { None } else { Some(off) });
    }
    let fill_arr = Array::float(DType::Double, vec![1], vec![value]);
    let fill_arr = cast(&fill_arr, x.dtype)?;
    let both = Array { dtype: x.dtype, shape: vec![], data: Array::concat_data(&[x, &fill_arr]) };
    let idx: Vec<usize> = src.iter().map(|s| s.unwrap_or(x.numel())).collect();
    Ok(both.gather_flat(shape, &idx))
}

fn constant(c: &op::Constant) -> Result<Array> {
    if let Some(t) = &c.value {
        return Array::from_tensor(t);
    }
    if let Some(v) = c.value_float {
        return Ok(Array::f32(vec![], vec![v]));
    }
    if let Some(v) = &c.value_floats {
        return Ok(Array::f32(vec![v.len()], v.clone()));
    }
    if let Some(v) = c.value_int {
        return Ok(Array::scalar_i64(v));
    }
    if let Some(v) = &c.value_ints {
        return Ok(Array::i64(vec![v.len()], v.clone()));
    }
    if let Some(v) = &c.value_string {
        return Ok(Array { dtype: DType::String, shape: vec![], data: Data::Str(vec![v.clone()]) });
    }
    if let Some(v) = &c.value_strings {
        return Ok(Array { dtype: DType::String, shape: vec![v.len()], data: Data::Str(v.clone()) });
    }
    Err(EvalError::Invalid("Constant without a value".into()))
}

fn range(start: &Array, limit: &Array, delta: &Array) -> Result<Array> {
    match start.data {
        Data::I64(_) => {
            let (s, l, d) = (start.first_i64()?, limit.first_i64()?, delta.first_i64()?);
            if d == 0 {
                return Err(EvalError::Invalid("Range delta 0".into()));
            }
            let n = ((l - s) as f64 / d as f64).ceil().max(0.0) as usize;
            Ok(Array::int(start.dtype, vec![n], (0..n as i64).map(|i| s + i * d).collect()))
        }
        _ => {
            let (s, l, d) = (start.first_f64()?, limit.first_f64()?, delta.first_f64()?);
            let n = ((l - s) / d).ceil().max(0.0) as usize;
            Ok(Array::float(start.dtype, vec![n], (0..n).map(|i| s + i as f64 * d).collect()))
        }
    }
}

// ---- gradients ----

/// Reshape, Flatten, Squeeze, Unsqueeze: the gradient is dY reshaped to X's shape.
fn reshape_grad(cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let d = cx.dims(x)?;
    let r = cx.reshape(dy, &d)?;
    cx.set(0, r);
    Ok(())
}

fn transpose_grad(t: &op::Transpose, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let r = cx.dims(cx.x(0)?)?.len();
    let perm: Vec<i64> = t.perm.clone().unwrap_or_else(|| (0..r as i64).rev().collect());
    let d = cx.transpose(dy, &inverse_perm(&perm)?)?;
    cx.set(0, d);
    Ok(())
}

/// Concat: each input's part of dY, by a Split with the inputs' sizes.
fn concat_grad(c: &op::Concat, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let k = cx.g.node(cx.n).inputs().len();
    let yd = cx.dims(dy)?;
    let a = norm_axis(c.axis.unwrap_or(0), yd.len())?;
    let mut sizes = Vec::with_capacity(k);
    for i in 0..k {
        sizes.push(cx.dims(cx.x(i)?)?[a]);
    }
    let parts = split_values(cx, dy, a, &sizes)?;
    for (i, p) in parts.into_iter().enumerate() {
        cx.set(i, p);
    }
    Ok(())
}

/// `x` split along `axis` into parts of `sizes` (the Split form of the graph's opset).
pub fn split_values(
    cx: &mut GradCx<'_>,
    x: Value,
    axis: usize,
    sizes: &[i64],
) -> std::result::Result<Vec<Value>, String> {
    if sizes.len() == 1 {
        return Ok(vec![x]);
    }
    let axis = Some(axis as i64);
    if cx.g.opset >= 13 {
        let s = cx.ints(sizes);
        cx.add(Op::Split(op::Split { axis, ..Default::default() }), &[Some(x), Some(s)], sizes.len())
    } else {
        cx.add(
            Op::Split(op::Split { axis, split: Some(sizes.to_vec()), ..Default::default() }),
            &[Some(x)],
            sizes.len(),
        )
    }
}

/// Split: the outputs' gradients (zeros where none flows) concatenated.
fn split_grad(sp: &op::Split, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    if !cx.want(0) {
        return Ok(());
    }
    let n = cx.g.node(cx.n).num_outputs();
    let mut parts = Vec::with_capacity(n);
    for s in 0..n {
        parts.push(cx.dy_or_zeros(s)?);
    }
    let r = cx.dims(cx.x(0)?)?.len();
    let a = norm_axis(sp.axis(), r)? as i64;
    let d = if parts.len() == 1 { parts[0] } else { cx.add1(Op::Concat(op::Concat { axis: Some(a) }), &parts)? };
    cx.set(0, d);
    Ok(())
}

/// Slice: dY placed where the slice took it, zeros elsewhere (SliceGrad).
fn slice_grad(sl: &op::Slice, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let shape = cx.dims(x)?;
    let mut ins = vec![Some(dy)];
    if cx.x_opt(1).is_some() {
        for i in 1..5 {
            ins.push(cx.x_opt(i));
        }
    } else {
        let starts = sl.starts.clone().ok_or("Slice without starts")?;
        let ends = sl.ends.clone().ok_or("Slice without ends")?;
        ins.push(Some(cx.ints(&starts)));
        ins.push(Some(cx.ints(&ends)));
        ins.push(sl.axes.as_ref().map(|a| cx.ints(a)));
    }
    while ins.last() == Some(&None) {
        ins.pop();
    }
    let d = cx.add(Op::SliceGrad(op::SliceGrad { shape: Some(shape) }), &ins, 1)?[0];
    cx.set(0, d);
    Ok(())
}

/// Pad: in constant mode with no negative pads, dY with the padding sliced off; otherwise
/// (reflect, edge, wrap, cropping) dY contracted per padded axis with the 0/1 map of which
/// input position each output position reads ([`pad_source`], as the evaluator reads them).
fn pad_grad(p: &op::Pad, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let x = cx.x(0)?;
    let xd = cx.dims(x)?;
    let r = xd.len();
    let pads = match cx.x_opt(1) {
        Some(v) => cx.const_ints(Some(v)).ok_or("Pad with computed pads")?,
        None => p.pads.clone().ok_or("Pad without pads")?,
    };
    let axes: Vec<usize> = match cx.x_opt(3) {
        Some(v) => norm_axes(&cx.const_ints(Some(v)).ok_or("Pad with computed axes")?, r)?,
        None => (0..r).collect(),
    };
    let k = axes.len();
    if pads.len() != 2 * k {
        return Err(format!("pads {pads:?} need {} values", 2 * k));
    }
    if p.mode() != "constant" || pads.iter().any(|&v| v < 0) {
        // Every output position reads one input position (or the fill value): per padded
        // axis a 0/1 matrix, and dX is dY contracted with them.
        let mode = p.mode();
        let mut mats = Vec::new();
        for (i, &a) in axes.iter().enumerate() {
            let (b, e, l) = (pads[i], pads[i + k], xd[a]);
            let m = (l + b + e).max(0);
            if b == 0 && e == 0 {
                continue;
            }
            let mut mat = vec![0.0; (m * l) as usize];
            for j in 0..m {
                if let Some(src) = pad_source(mode, j - b, l) {
                    mat[(j * l + src) as usize] += 1.0;
                }
            }
            mats.push((a, m as usize, l as usize, mat));
        }
        let dx = cx.contract_axes(dy, cx.dtype(x), mats)?;
        cx.set(0, dx);
        return Ok(());
    }
    let starts: Vec<i64> = (0..k).map(|i| pads[i]).collect();
    let ends: Vec<i64> = axes.iter().enumerate().map(|(i, &a)| pads[i] + xd[a]).collect();
    let axv: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let (s, e, a) = (cx.ints(&starts), cx.ints(&ends), cx.ints(&axv));
    let d = cx.add1(Op::Slice(op::Slice::default()), &[dy, s, e, a])?;
    cx.set(0, d);
    Ok(())
}

/// Tile: dY viewed as `[r0, d0, r1, d1, …]` and summed over the repeats.
fn tile_grad(cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
    let xd = cx.dims(cx.x(0)?)?;
    let yd = cx.dims(dy)?;
    let mut view = Vec::with_capacity(2 * xd.len());
    for (i, &d) in xd.iter().enumerate() {
        view.push(yd[i] / d.max(1));
        view.push(d);
    }
    let v = cx.reshape(dy, &view)?;
    let axes: Vec<i64> = (0..xd.len() as i64).map(|i| 2 * i).collect();
    let s = cx.reduce_sum(v, &axes, false)?;
    let s = cx.reshape(s, &xd)?;
    cx.set(0, s);
    Ok(())
}

impl OpRules for op::SliceGrad {
    fn arity(&self) -> Arity {
        Arity::new(3, 5, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let shape = self.shape.as_ref().ok_or("SliceGrad needs `shape`")?;
        cx.one(Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        // The batch (dim 0) splits when the slice does not cut it.
        let r = cx.in_dims(0).len() as i64;
        let cuts_batch = match cx.g.node(cx.n).input(3) {
            Some(_) => cx.const_ints(3).is_none_or(|a| a.iter().any(|&x| x == 0 || x + r == 0)),
            None => true,
        };
        if cuts_batch { Some(IterSpace::whole(cx)) } else { Some(IterSpace::batch(cx, &[0], &[0])) }
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
