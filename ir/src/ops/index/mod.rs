//! Indexing: `Gather` (embeddings), `GatherElements`, `GatherND`, `ScatterND`,
//! `ScatterElements`, and the ops that select or count: `TopK`, `OneHot`, `NonZero`,
//! `CumSum`, `Trilu`.
//!
//! `Gather` along axis 0 splits by the indices' dims, the table's other dims, or the table's
//! rows (vocabulary parallelism: each device gathers the rows it holds, leaving partial
//! sums); the others run whole or keep their indexed dims whole.

use super::flow::{Mono, flow_positional};
use super::grad::GradCx;
use super::shape::no_work_whole;
use super::util::norm_axis;
use super::{Arity, Arrays, EvalCx, FlowCx, InferCx, NodeCx, OpRules, Sharded, Types, Work};
use crate::array::{Array, Data, EvalError, numel, strides};
use crate::graph::Value;
use crate::graph::op::{self, Op};
use crate::layout::{DimKind, DimRole, IterDim, IterSpace, par};
use crate::ops::elementwise::cast;
use crate::ops::space::pointwise;
use crate::types::{DType, Dim, TensorType};

mod eval;
use eval::*;

type Result<T> = std::result::Result<T, EvalError>;

impl OpRules for op::Gather {
    fn grad_kernel(&self) -> Option<&'static str> {
        Some("GatherGrad")
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(gather_grad(self, cx))
    }

    fn sharded(&self) -> Sharded {
        Sharded::VocabGather
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(d), Some(i)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        if d.is_empty() {
            return Err("Gather needs data of rank 1 or more".into());
        }
        let a = norm_axis(self.axis(), d.len())?;
        let mut out = d[..a].to_vec();
        out.extend(i.iter().cloned());
        out.extend(d[a + 1..].iter().cloned());
        cx.one(Some(out))
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let (d, idx) = (cx.in_dims(0), cx.in_dims(1));
        if d.is_empty() || norm_axis(self.axis(), d.len()) != Ok(0) {
            return Some(IterSpace::whole(cx));
        }
        // Dims: the indices' dims, the table rows (vocab: a split leaves partial sums of a
        // masked gather), then the table's remaining dims.
        let mut sd: Vec<IterDim> = idx.iter().enumerate().map(|(i, &s)| par(format!("i{i}"), s)).collect();
        let vocab = sd.len();
        sd.push(IterDim { name: "v".into(), size: d[0], kind: DimKind::Reduction, role: DimRole::Vocab });
        let rest0 = sd.len();
        sd.extend(d[1..].iter().enumerate().map(|(i, &s)| IterDim {
            name: format!("e{i}"),
            size: s,
            kind: DimKind::Parallel,
            role: DimRole::Other,
        }));
        let mut dm = vec![Some(vocab)];
        dm.extend((0..d.len() - 1).map(|i| Some(rest0 + i)));
        let im: Vec<Option<usize>> = (0..idx.len()).map(|i| (idx[i] != 1).then_some(i)).collect();
        let mut om: Vec<Option<usize>> = (0..idx.len()).map(|i| (idx[i] != 1).then_some(i)).collect();
        om.extend((0..d.len() - 1).map(|i| Some(rest0 + i)));
        Some(IterSpace { dims: sd, inputs: vec![Some(dm), Some(im)], outputs: vec![om] })
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![gather(cx.req(0)?, cx.req(1)?, self.axis())?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (dm, im) = (cx.in_m(0)?, cx.in_m(1)?);
        let r = dm.len() as i64;
        let a = (if self.axis() < 0 { self.axis() + r } else { self.axis() }) as usize;
        let mut m = dm[..a].to_vec();
        m.extend(im);
        m.extend(dm[a + 1..].iter().cloned());
        cx.set(0, m);
        Some(())
    }
}

impl OpRules for op::GatherElements {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        // Scatter-add of dY into zeros of the data's shape at the gathered positions.
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let (x, idx) = (cx.x(0)?, cx.x(1)?);
            let z = cx.zeros_like(x)?;
            let op = Op::ScatterElements(op::ScatterElements { axis: self.axis, reduction: Some("add".into()) });
            let d = cx.add1(op, &[z, idx, dy])?;
            cx.set(0, d);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.one(cx.dims(1).cloned())
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![gather_elements(cx.req(0)?, cx.req(1)?, self.axis())?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let im = cx.in_m(1)?;
        cx.set(0, im);
        Some(())
    }
}

impl OpRules for op::GatherND {
    /// `indices[..-1] ++ data[batch_dims + k..]`: the index rows (and the batch dims they
    /// share with the data) and the data's trailing axes.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let (dm, im, iold) = (cx.in_m(0)?, cx.in_m(1)?, cx.in_old(1)?);
        let k = *iold.last()? as usize;
        let mut m = im[..im.len() - 1].to_vec();
        m.extend(dm.iter().skip(self.batch_dims() as usize + k).cloned());
        cx.set(0, m);
        Some(())
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        if self.batch_dims() != 0 {
            return Some(Err("the gradient of GatherND with batch_dims is not supported".into()));
        }
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let (x, idx) = (cx.x(0)?, cx.x(1)?);
            let z = cx.zeros_like(x)?;
            let d = cx.add1(Op::ScatterND(op::ScatterND { reduction: Some("add".into()) }), &[z, idx, dy])?;
            cx.set(0, d);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let (Some(d), Some(i)) = (cx.dims(0), cx.dims(1)) else { return cx.one(None) };
        let Some(k) = i.last().and_then(Dim::value) else { return cx.one(None) };
        let b = self.batch_dims() as usize;
        let mut out = i[..i.len() - 1].to_vec();
        out.extend(d.iter().skip(b + k as usize).cloned());
        cx.one(Some(out))
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![gather_nd(cx.req(0)?, cx.req(1)?, self.batch_dims() as usize)?])
    }
}

impl OpRules for op::ScatterND {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        if self.reduction() != "none" {
            return None;
        }
        // The data keeps dY where nothing was written; the updates read dY where they went.
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let (idx, u) = (cx.x(1)?, cx.x(2)?);
            if cx.want(0) {
                let z = cx.zeros_like(u)?;
                let d = cx.add1(Op::ScatterND(op::ScatterND::default()), &[dy, idx, z])?;
                cx.set(0, d);
            }
            if cx.want(2) {
                let d = cx.add1(Op::GatherND(op::GatherND::default()), &[dy, idx])?;
                cx.set(2, d);
            }
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![scatter_nd(cx.req(0)?, cx.req(1)?, cx.req(2)?, self.reduction())?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

/// The gradient of a scatter that overwrites (`ScatterElements` without a reduction, and the
/// deprecated `Scatter`): the data's is dY with the written positions zeroed, the updates'
/// dY gathered from them.
fn overwrite_grad(axis: Option<i64>, cx: &mut GradCx<'_>) -> std::result::Result<(), String> {
    let Some(dy) = cx.dy(0) else { return Ok(()) };
    let (idx, u) = (cx.x(1)?, cx.x(2)?);
    if cx.want(0) {
        let z = cx.zeros_like(u)?;
        let op = Op::ScatterElements(op::ScatterElements { axis, reduction: None });
        let d = cx.add1(op, &[dy, idx, z])?;
        cx.set(0, d);
    }
    if cx.want(2) {
        let d = cx.add1(Op::GatherElements(op::GatherElements { axis }), &[dy, idx])?;
        cx.set(2, d);
    }
    Ok(())
}

impl OpRules for op::ScatterElements {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        if self.reduction() != "none" {
            return None;
        }
        Some(overwrite_grad(self.axis, cx))
    }

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![scatter_elements(cx.req(0)?, cx.req(1)?, cx.req(2)?, self.axis(), self.reduction())?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

impl OpRules for op::TopK {
    flow_positional!(0);

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        // The values' gradient scattered back to where they were taken from.
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let x = cx.x(0)?;
            let z = cx.zeros_like(x)?;
            let idx = cx.y(1);
            let op = Op::ScatterElements(op::ScatterElements { axis: self.axis, reduction: Some("add".into()) });
            let d = cx.add1(op, &[z, idx, dy])?;
            cx.set(0, d);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 2, 2, 2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let Some(d) = cx.dims(0) else {
            return Ok(vec![cx.with(cx.dtype(), None), Some(TensorType::unranked(DType::Int64))]);
        };
        let a = norm_axis(self.axis(), d.len())?;
        let k = if cx.ins.len() > 1 { cx.ints(1).and_then(|v| v.first().copied()) } else { self.k };
        if let Some(k) = k
            && (k < 0 || d[a].value().is_some_and(|n| k > n))
        {
            return Err(format!("TopK's k ({k}) is not within the axis' size ({})", d[a]));
        }
        let mut out = d.clone();
        out[a] = k.map_or(Dim::Unknown, Dim::Fixed);
        Ok(vec![cx.with(cx.dtype(), Some(out.clone())), Some(TensorType::new(DType::Int64, out))])
    }

    /// Each slice along the other dims picks its own `k` (a router's top experts per token):
    /// those dims split freely; the axis is whole.
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let out = cx.out_dims(0);
        let Ok(a) = norm_axis(self.axis(), out.len()) else { return Some(IterSpace::whole(cx)) };
        let dims: Vec<IterDim> = out
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                if i == a {
                    IterDim { name: "k".into(), size: n, kind: DimKind::Fixed, role: DimRole::Other }
                } else {
                    par(format!("d{i}"), n)
                }
            })
            .collect();
        let x: Vec<Option<usize>> = (0..out.len()).map(|i| (i != a).then_some(i)).collect();
        let all: Vec<Option<usize>> = (0..out.len()).map(Some).collect();
        let mut inputs = vec![Some(x)];
        if let Some(k) = cx.input(1) {
            inputs.push(Some(vec![None; cx.rank(k)]));
        }
        Some(IterSpace { dims, inputs, outputs: vec![all.clone(), all] })
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.in_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let k = match cx.opt(1) {
            Some(a) => a.first_i64()?,
            None => self.k.unwrap_or(1),
        };
        topk(cx.req(0)?, k.max(0) as usize, self.axis(), self.largest() != 0)
    }
}

impl OpRules for op::OneHot {
    /// The indices' axes, with the depth inserted at `axis`.
    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        let mut m = cx.in_m(0)?;
        let out = cx.out_old();
        let a = norm_axis(self.axis(), m.len() + 1).ok()?;
        m.insert(a, Mono::constant(*out.get(a)?));
        cx.set(0, m);
        Some(())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let dtype = cx.input(2).map(|t| t.dtype);
        let Some(d) = cx.dims(0) else { return Ok(vec![cx.with(dtype, None)]) };
        let depth = cx
            .konst(1)
            .and_then(|a| a.to_f64().ok())
            .and_then(|v| v.first().copied())
            .map_or(Dim::Unknown, |d| Dim::Fixed(d as i64));
        let a = norm_axis(self.axis(), d.len() + 1)?;
        let mut out = d.clone();
        out.insert(a, depth);
        Ok(vec![cx.with(dtype, Some(out))])
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![one_hot(cx.req(0)?, cx.req(1)?, cx.req(2)?, self.axis())?])
    }
}

impl OpRules for op::NonZero {
    fn arity(&self) -> Arity {
        Arity::fixed(1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // How many elements are non-zero is known only from the data.
        cx.needs_values(&[0]);
        let rank = cx.dims(0).map_or(Dim::Unknown, |d| Dim::Fixed(d.len() as i64));
        Ok(vec![Some(TensorType::new(DType::Int64, vec![rank, Dim::Unknown]))])
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![nonzero(cx.req(0)?)?])
    }

    fn flow(&self, _cx: &mut FlowCx<'_>) -> Option<()> {
        Some(())
    }
}

impl OpRules for op::CumSum {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        // A running sum's gradient is the running sum the other way.
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let axis = cx.x(1)?;
            let op = Op::CumSum(op::CumSum { exclusive: self.exclusive, reverse: Some(1 - self.reverse()) });
            let d = cx.add1(op, &[dy, axis])?;
            cx.set(0, d);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.out_dims(0).len();
        Some(pointwise(cx, &(0..r).collect::<Vec<_>>(), &[], 0))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![cumsum(cx.req(0)?, cx.req(1)?, self.exclusive() != 0, self.reverse() != 0)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

impl OpRules for op::Trilu {
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        // A mask: the gradient is masked the same way.
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let ins: Vec<Option<crate::Value>> = vec![Some(dy), cx.x_opt(1)];
            let d = cx.add(Op::Trilu(self.clone()), &ins, 1)?[0];
            cx.set(0, d);
            Ok(())
        })())
    }

    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        let r = cx.out_dims(0).len();
        Some(pointwise(cx, &[r.saturating_sub(2), r.saturating_sub(1)], &[], 0))
    }

    fn work(&self, _cx: &NodeCx<'_>) -> Option<Work> {
        Work::none()
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let k = match cx.opt(1) {
            Some(a) => a.first_i64()?,
            None => 0,
        };
        Ok(vec![trilu(cx.req(0)?, k, self.upper() != 0)?])
    }

    fn flow(&self, cx: &mut FlowCx<'_>) -> Option<()> {
        cx.same_as_input();
        Some(())
    }
}

impl OpRules for op::GatherGrad {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        let shape = self.shape.as_ref().ok_or("GatherGrad needs `shape`")?;
        Ok(vec![cx.with(cx.input(1).map(|t| t.dtype), Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()))])
    }

    /// Rows are owned: the table's dims are the space, each row summing the dY rows whose
    /// index picks it (a split of the rows needs no communication).
    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        // Along axis 0, dY's leading dims are the indices': the batch of the lookups splits,
        // each device scattering its rows' gradients (partial sums of the table's).
        if self.axis() == 0 && !cx.in_dims(0).is_empty() {
            Some(IterSpace::batch(cx, &[0, 1], &[]))
        } else {
            Some(IterSpace::whole(cx))
        }
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.in_numel(1))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (idx, dy) = (cx.req(0)?, cx.req(1)?);
        let shape: Vec<usize> = self
            .shape
            .as_ref()
            .ok_or_else(|| EvalError::Invalid("GatherGrad without shape".into()))?
            .iter()
            .map(|&d| d.max(0) as usize)
            .collect();
        let a = norm_axis(self.axis(), shape.len())?;
        let outer: usize = shape[..a].iter().product();
        let rows = shape[a];
        let inner: usize = shape[a + 1..].iter().product();
        let iv = idx.to_i64()?;
        let dv = dy.to_f64()?;
        let k = iv.len();
        if dv.len() != outer * k * inner {
            return Err(EvalError::Invalid(format!("GatherGrad: {} gradients for {k} indices", dv.len())));
        }
        // The rows the indices pick are summed in f64, in the indices' order; the table is
        // zeros elsewhere (a large embedding's gradient touches a few rows, and a dense f64
        // accumulator would hold twice the table).
        let mut slot_of = std::collections::HashMap::new();
        let mut sums: Vec<f64> = Vec::new();
        let mut picked = Vec::new();
        for o in 0..outer {
            for (j, &r) in iv.iter().enumerate() {
                let r = if r < 0 { r + rows as i64 } else { r };
                if r < 0 || r as usize >= rows {
                    return Err(EvalError::Invalid(format!("GatherGrad: index {r} outside 0..{rows}")));
                }
                let row = o * rows + r as usize;
                let slot = *slot_of.entry(row).or_insert_with(|| {
                    picked.push(row);
                    sums.resize(sums.len() + inner, 0.0);
                    picked.len() - 1
                });
                let src = &dv[(o * k + j) * inner..][..inner];
                sums[slot * inner..][..inner].iter_mut().zip(src).for_each(|(s, &d)| *s += d);
            }
        }
        let n = numel(&shape);
        Ok(vec![if dy.dtype == DType::Double {
            Array::float(dy.dtype, shape, rows_placed(n, inner, &picked, &sums, |x| x))
        } else {
            Array::from_f32s(dy.dtype, shape, rows_placed(n, inner, &picked, &sums, |x| x as f32))
        }])
    }
}

/// `n` zeros with row `picked[s]` (`inner` wide) set to `sums`' row `s`.
fn rows_placed<T: Copy + Default>(n: usize, inner: usize, picked: &[usize], sums: &[f64], to: fn(f64) -> T) -> Vec<T> {
    let mut out = vec![T::default(); n];
    for (slot, &row) in picked.iter().enumerate() {
        let dst = &mut out[row * inner..][..inner];
        dst.iter_mut().zip(&sums[slot * inner..][..inner]).for_each(|(d, &s)| *d = to(s));
    }
    out
}

impl OpRules for op::CumProd {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    fn space(&self, cx: &NodeCx<'_>) -> Option<IterSpace> {
        Some(IterSpace::whole(cx))
    }

    fn work(&self, cx: &NodeCx<'_>) -> Option<Work> {
        Work::flops(cx.out_numel(0))
    }

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![cumulative(cx.req(0)?, cx.req(1)?, self.exclusive() != 0, self.reverse() != 0, true)?])
    }

    /// `∂y_j/∂x_i` is the product `y_j` takes without `x_i` where `x_i` is one of its factors,
    /// else 0. Without dividing by `x_i` (which may be 0): for each `i`, the running product of
    /// `x` with `x_i` replaced by 1 — `n` running products along a new axis, `O(n²)` in the
    /// axis's length — masked by the positions `j` whose product takes `x_i` (the same running
    /// direction and exclusivity, a constant), times dY, summed over `j`.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let shape = cx.dims(x)?;
            let axis = cx.const_ints(Some(cx.x(1)?)).and_then(|v| v.first().copied());
            let axis = norm_axis(axis.ok_or("CumProd's gradient needs a constant axis")?, shape.len())?;
            let n = shape[axis].max(0) as usize;
            let dtype = cx.dtype(x);
            // `[.., i, j, ..]`: x along j, the same for every i.
            let mut wide = shape[..axis].to_vec();
            wide.push(1);
            wide.extend(&shape[axis..]);
            let xj = cx.reshape(x, &wide)?;
            let dyj = cx.reshape(dy, &wide)?;
            // The diagonal (`x_i` itself) and the mask, as `[n, n, 1, …]` constants.
            let trailing = shape.len() - axis - 1;
            let mut square = vec![n, n];
            square.extend(std::iter::repeat_n(1, trailing));
            let (exclusive, reverse) = (self.exclusive() != 0, self.reverse() != 0);
            let takes = |i: usize, j: usize| match (reverse, exclusive) {
                (false, false) => i <= j,
                (false, true) => i < j,
                (true, false) => i >= j,
                (true, true) => i > j,
            };
            let diag = cx.constant(Array::bool(square.clone(), (0..n * n).map(|k| k / n == k % n).collect()));
            let taken: Vec<f64> = (0..n * n).map(|k| f64::from(u8::from(takes(k / n, k % n)))).collect();
            let mask = cx.constant(Array::float(dtype, square, taken));
            let one = cx.scalar(dtype, 1.0);
            let without = cx.where_(diag, one, xj)?;
            let axis_j = cx.ints(&[axis as i64 + 1]);
            let runs = cx.add1(Op::CumProd(self.clone()), &[without, axis_j])?;
            let taken = cx.mul(runs, mask)?;
            let weighted = cx.mul(taken, dyj)?;
            let d = cx.reduce_sum(weighted, &[axis as i64 + 1], false)?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

impl OpRules for op::Scatter {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(3)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    /// The deprecated name of `ScatterElements` without a reduction.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        Ok(vec![scatter_elements(cx.req(0)?, cx.req(1)?, cx.req(2)?, self.axis(), "none")?])
    }

    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some(overwrite_grad(self.axis, cx))
    }
}

impl OpRules for op::Compress {
    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // The output's length is the number of true conditions.
        let Some(c) = cx.ints(1) else {
            cx.needs_values(&[1]);
            let rank = match (self.axis, cx.dims(0)) {
                (None, _) => Some(vec![Dim::Unknown]),
                (Some(a), Some(d)) => {
                    let a = norm_axis(a, d.len())?;
                    let mut d = d.clone();
                    d[a] = Dim::Unknown;
                    Some(d)
                }
                _ => None,
            };
            return cx.one(rank);
        };
        let kept = c.iter().filter(|&&v| v != 0).count() as i64;
        let Some(d) = cx.dims(0) else { return cx.one(None) };
        match self.axis {
            None => cx.one(Some(vec![Dim::Fixed(kept)])),
            Some(a) => {
                let a = norm_axis(a, d.len())?;
                let mut d = d.clone();
                d[a] = Dim::Fixed(kept);
                cx.one(Some(d))
            }
        }
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, c) = (cx.req(0)?, cx.req(1)?.to_i64()?);
        let (x, ax) = match self.axis {
            None => (x.clone().reshaped(vec![x.numel()]), 0),
            Some(a) => (x.clone(), norm_axis(a, x.rank())?),
        };
        let n = x.shape[ax];
        let keep: Vec<usize> = (0..n.min(c.len())).filter(|&i| c[i] != 0).collect();
        let outer: usize = x.shape[..ax].iter().product();
        let inner: usize = x.shape[ax + 1..].iter().product();
        let mut idx = Vec::with_capacity(outer * keep.len() * inner);
        for o in 0..outer {
            for &k in &keep {
                idx.extend((0..inner).map(|i| (o * n + k) * inner + i));
            }
        }
        let mut shape = x.shape.clone();
        shape[ax] = keep.len();
        Ok(vec![x.gather_flat(shape, &idx)])
    }

    /// `Gather` of the true conditions' positions (`NonZero` of the condition cut to the
    /// axis's length): dX is dY scattered back to them, zeros elsewhere.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let (x, cond) = (cx.x(0)?, cx.x(1)?);
            let shape = cx.dims(x)?;
            let (table, axis) = as_table(self.axis, &shape)?;
            let (start, end, axes) = (cx.ints(&[0]), cx.ints(&[table[axis]]), cx.ints(&[0]));
            let cut = cx.add1(Op::Slice(op::Slice::default()), &[cond, start, end, axes])?;
            let kept = cx.add1(Op::NonZero(op::NonZero::default()), &[cut])?;
            let flat = cx.ints(&[-1]);
            let kept = cx.add1(Op::Reshape(op::Reshape::default()), &[kept, flat])?;
            let d = scatter_back(cx, kept, dy, self.axis, &shape)?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

/// A tensor of `shape` as the table `Compress` and `Unique` select from: its slices along
/// `axis`, or its elements (flattened) without one; the table's dims and the axis.
fn as_table(axis: Option<i64>, shape: &[i64]) -> std::result::Result<(Vec<i64>, usize), String> {
    Ok(match axis {
        None => (vec![shape.iter().product::<i64>()], 0),
        Some(a) => (shape.to_vec(), norm_axis(a, shape.len())?),
    })
}

/// dY of a selection of the table's slices at `positions` ([`as_table`]) scattered back into
/// zeros of `shape`.
fn scatter_back(
    cx: &mut GradCx<'_>,
    positions: Value,
    dy: Value,
    axis: Option<i64>,
    shape: &[i64],
) -> std::result::Result<Value, String> {
    let (table, a) = as_table(axis, shape)?;
    let gather_grad = op::GatherGrad { axis: Some(a as i64), shape: Some(table.clone()) };
    let d = cx.add1(Op::GatherGrad(gather_grad), &[positions, dy])?;
    if table != shape { cx.reshape(d, shape) } else { Ok(d) }
}

impl OpRules for op::ReverseSequence {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::fixed(2)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (x, lens) = (cx.req(0)?, cx.req(1)?.to_i64()?);
        if x.rank() < 2 {
            return Err(EvalError::Invalid("ReverseSequence needs rank 2 or more".into()));
        }
        let (ba, ta) = (norm_axis(self.batch_axis(), x.rank())?, norm_axis(self.time_axis(), x.rank())?);
        let st = strides(&x.shape);
        let mut idx: Vec<usize> = (0..x.numel()).collect();
        for (flat, slot) in idx.iter_mut().enumerate() {
            let b = (flat / st[ba]) % x.shape[ba];
            let t = (flat / st[ta]) % x.shape[ta];
            let len = lens.get(b).copied().unwrap_or(0).clamp(0, x.shape[ta] as i64) as usize;
            if t < len {
                *slot = flat - t * st[ta] + (len - 1 - t) * st[ta];
            }
        }
        Ok(vec![x.gather_flat(x.shape.clone(), &idx)])
    }

    /// A permutation that is its own inverse: `dX = ReverseSequence(dY)` with the same lengths.
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let lens = cx.x(1)?;
            let d = cx.add1(Op::ReverseSequence(self.clone()), &[dy, lens])?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

impl OpRules for op::TensorScatter {
    flow_positional!(0);

    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        cx.same()
    }

    no_work_whole!();

    /// The cache's gradient is dY with the written positions zeroed (the same write of
    /// zeros); the update's is dY gathered along the axis at each entry's write positions
    /// (`write_index[b] + t`, wrapped around the cache's length in circular mode).
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let Some(dy) = cx.dy(0) else { return Ok(()) };
            let (cache, upd) = (cx.x(0)?, cx.x(1)?);
            let at = cx.x_opt(2);
            if cx.want(0) {
                let z = cx.zeros_like(upd)?;
                let d = cx.add(Op::TensorScatter(self.clone()), &[Some(dy), Some(z), at], 1)?[0];
                cx.set(0, d);
            }
            if cx.want(1) {
                let (cd, ud) = (cx.dims(cache)?, cx.dims(upd)?);
                let r = ud.len();
                let ax = norm_axis(self.axis(), r)?;
                if r < 2 || ax == 0 || cd.len() != r {
                    return Err(format!("TensorScatter's gradient: cache {cd:?}, update {ud:?}, axis {ax}"));
                }
                // Positions `t` along the axis, `[1, …, T, …, 1]`.
                let mut steps = vec![1; r];
                steps[ax] = ud[ax] as usize;
                let t = cx.constant(Array::i64(steps, (0..ud[ax]).collect()));
                let mut pos = match at {
                    Some(w) => {
                        let mut per_batch = vec![1; r];
                        per_batch[0] = ud[0];
                        let w = cx.reshape(w, &per_batch)?;
                        cx.add2(w, t)?
                    }
                    None => t,
                };
                if self.mode() == "circular" {
                    let n = cx.scalar(DType::Int64, cd[ax] as f64);
                    pos = cx.add1(Op::Mod(op::Mod::default()), &[pos, n])?;
                }
                let idx = cx.expand(pos, &ud)?;
                let d = cx.add1(Op::GatherElements(op::GatherElements { axis: Some(ax as i64) }), &[dy, idx])?;
                cx.set(1, d);
            }
            Ok(())
        })())
    }

    /// Writes `update` into the cache along `axis` at each batch entry's write index (wrapping
    /// around the cache's length in `circular` mode).
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (cache, upd) = (cx.req(0)?, cx.req(1)?);
        let r = cache.rank();
        let ax = norm_axis(self.axis(), r)?;
        if upd.rank() != r
            || (0..r).any(|d| d != ax && upd.shape[d] != cache.shape[d])
            || upd.shape[ax] > cache.shape[ax]
        {
            return Err(EvalError::Invalid(format!(
                "TensorScatter: update {:?} does not fit cache {:?}",
                upd.shape, cache.shape
            )));
        }
        let at: Vec<i64> = match cx.opt(2) {
            Some(w) => w.to_i64()?,
            None => vec![0; cache.shape.first().copied().unwrap_or(1)],
        };
        let circular = self.mode() == "circular";
        let (cst, ust) = (strides(&cache.shape), strides(&upd.shape));
        let mut idx: Vec<usize> = (0..cache.numel()).collect();
        let mut from_update = vec![false; cache.numel()];
        let n = cache.shape[ax];
        for u in 0..upd.numel() {
            let b = if r > 0 { (u / ust[0]) % upd.shape[0] } else { 0 };
            let t = (u / ust[ax]) % upd.shape[ax];
            let mut pos = at.get(b).copied().unwrap_or(0) + t as i64;
            if circular {
                pos = pos.rem_euclid(n as i64);
            }
            if pos < 0 || pos >= n as i64 {
                return Err(EvalError::Invalid(format!("TensorScatter: write position {pos} outside {n}")));
            }
            let target: usize = (0..r)
                .map(|d| if d == ax { pos as usize * cst[d] } else { ((u / ust[d]) % upd.shape[d]) * cst[d] })
                .sum();
            idx[target] = u;
            from_update[target] = true;
        }
        // Gather from the cache, or from the update where written.
        let both = Array {
            dtype: cache.dtype,
            shape: vec![cache.numel() + upd.numel()],
            data: Array::concat_data(&[cache, upd]),
        };
        let flat: Vec<usize> =
            (0..cache.numel()).map(|i| if from_update[i] { cache.numel() + idx[i] } else { i }).collect();
        Ok(vec![both.gather_flat(cache.shape.clone(), &flat)])
    }
}

impl OpRules for op::Unique {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 4)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // How many values are distinct is known only from the data.
        cx.needs_values(&[0]);
        let y = match (self.axis, cx.dims(0)) {
            (None, _) => Some(vec![Dim::Unknown]),
            (Some(a), Some(d)) => {
                let a = norm_axis(a, d.len())?;
                let mut d = d.clone();
                d[a] = Dim::Unknown;
                Some(d)
            }
            _ => None,
        };
        let ix = Some(TensorType::new(DType::Int64, vec![Dim::Unknown]));
        let mut out = vec![cx.with(cx.dtype(), y), ix.clone(), ix.clone(), ix];
        out.truncate(cx.n_out);
        Ok(out)
    }

    no_work_whole!();

    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        unique(cx.req(0)?, self.axis, self.sorted() != 0, cx.n_out)
    }

    /// The distinct values are the input's at their first occurrences (the second output):
    /// dX is dY scattered back there, zeros at the repeats (a repeat moved apart from its
    /// first occurrence would be a value of its own; the values change only through those).
    fn grad(&self, cx: &mut GradCx<'_>) -> Option<std::result::Result<(), String>> {
        Some((|| {
            let (Some(dy), true) = (cx.dy(0), cx.want(0)) else { return Ok(()) };
            let x = cx.x(0)?;
            let shape = cx.dims(x)?;
            let first = cx.add(Op::Unique(self.clone()), &[Some(x)], 2)?[1];
            let d = scatter_back(cx, first, dy, self.axis, &shape)?;
            cx.set(0, d);
            Ok(())
        })())
    }
}

/// The distinct values (or slices along `axis`) of `x`: sorted, or in order of first
/// occurrence; with the first occurrence of each, each element's distinct value, and counts.
fn unique(x: &Array, axis: Option<i64>, sorted: bool, n_out: usize) -> Arrays {
    let (x, ax) = match axis {
        None => (x.clone().reshaped(vec![x.numel()]), 0),
        Some(a) => (x.clone(), norm_axis(a, x.rank())?),
    };
    let n = x.shape[ax];
    let outer: usize = x.shape[..ax].iter().product();
    let inner: usize = x.shape[ax + 1..].iter().product();
    let flat_of = |j: usize| -> Vec<usize> {
        (0..outer).flat_map(|o| (0..inner).map(move |i| (o * n + j) * inner + i)).collect()
    };
    // A slice's key: its values, compared as numbers (or strings).
    let keys: Vec<Vec<KeyVal>> = (0..n)
        .map(|j| {
            let idx = flat_of(j);
            match &x.data {
                Data::Str(v) => idx.iter().map(|&i| KeyVal::S(v[i].clone())).collect(),
                _ => {
                    let f = x.to_f64().unwrap_or_default();
                    idx.iter().map(|&i| KeyVal::F(f[i])).collect()
                }
            }
        })
        .collect();
    let mut first: Vec<usize> = Vec::new();
    for j in 0..n {
        if !first.iter().any(|&f| keys[f] == keys[j]) {
            first.push(j);
        }
    }
    if sorted {
        first.sort_by(|&a, &b| keys[a].partial_cmp(&keys[b]).unwrap_or(std::cmp::Ordering::Equal));
    }
    let inverse: Vec<i64> =
        (0..n).map(|j| first.iter().position(|&f| keys[f] == keys[j]).unwrap_or(0) as i64).collect();
    let counts: Vec<i64> =
        (0..first.len()).map(|u| inverse.iter().filter(|&&v| v as usize == u).count() as i64).collect();
    let mut idx = Vec::new();
    for o in 0..outer {
        for &j in &first {
            idx.extend((0..inner).map(|i| (o * n + j) * inner + i));
        }
    }
    let mut shape = x.shape.clone();
    shape[ax] = first.len();
    let mut outs = vec![
        x.gather_flat(shape, &idx),
        Array::i64(vec![first.len()], first.iter().map(|&f| f as i64).collect()),
        Array::i64(vec![n], inverse),
        Array::i64(vec![counts.len()], counts),
    ];
    outs.truncate(n_out.max(1));
    Ok(outs)
}

#[derive(Clone, Debug, PartialEq, PartialOrd)]
enum KeyVal {
    F(f64),
    S(String),
}

impl OpRules for op::NonMaxSuppression {
    fn arity(&self) -> Arity {
        Arity::new(2, 5, 1, 1)
    }

    fn infer(&self, cx: &InferCx<'_>) -> Types {
        // How many boxes survive is known only from the data.
        cx.needs_values(&[0, 1]);
        Ok(vec![Some(TensorType::new(DType::Int64, vec![Dim::Unknown, Dim::Fixed(3)]))])
    }

    no_work_whole!();

    /// Per batch and class: boxes by descending score (above the threshold), each kept unless
    /// it overlaps a kept one by more than the IoU threshold, up to the maximum per class.
    fn eval(&self, cx: &EvalCx<'_>) -> Arrays {
        let (boxes, scores) = (cx.req(0)?, cx.req(1)?);
        if boxes.rank() != 3
            || boxes.shape[2] != 4
            || scores.rank() != 3
            || scores.shape[0] != boxes.shape[0]
            || scores.shape[2] != boxes.shape[1]
        {
            return Err(EvalError::Invalid(format!(
                "NonMaxSuppression of boxes {:?} and scores {:?}",
                boxes.shape, scores.shape
            )));
        }
        let first = |i: usize| -> Result<Option<f64>> {
            Ok(match cx.opt(i) {
                Some(a) if a.numel() > 0 => a.to_f64()?.first().copied(),
                _ => None,
            })
        };
        let max_out = first(2)?.map_or(0, |v| v.max(0.0) as usize);
        let iou = first(3)?.unwrap_or(0.0);
        let score_min = first(4)?;
        let center = self.center_point_box() != 0;
        let (bv, sv) = (boxes.to_f64()?, scores.to_f64()?);
        let (nb, nc, n) = (boxes.shape[0], scores.shape[1], boxes.shape[1]);
        let corners = |b: usize, i: usize| -> [f64; 4] {
            let v = &bv[(b * n + i) * 4..][..4];
            if center {
                [v[1] - v[3] / 2.0, v[0] - v[2] / 2.0, v[1] + v[3] / 2.0, v[0] + v[2] / 2.0]
            } else {
                [v[0].min(v[2]), v[1].min(v[3]), v[0].max(v[2]), v[1].max(v[3])]
            }
        };
        let overlaps = |a: [f64; 4], b: [f64; 4]| -> bool {
            let (y0, x0) = (a[0].max(b[0]), a[1].max(b[1]));
            let (y1, x1) = (a[2].min(b[2]), a[3].min(b[3]));
            if x1 <= x0 || y1 <= y0 {
                return false;
            }
            let inter = (x1 - x0) * (y1 - y0);
            let (aa, ab) = ((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]));
            let union = aa + ab - inter;
            inter > 0.0 && aa > 0.0 && ab > 0.0 && union > 0.0 && inter / union > iou
        };
        let mut out: Vec<i64> = Vec::new();
        for b in 0..nb {
            for c in 0..nc {
                let sc = &sv[(b * nc + c) * n..][..n];
                let mut cand: Vec<usize> = (0..n).filter(|&i| score_min.is_none_or(|m| sc[i] > m)).collect();
                // Highest score first; among equal scores, the lower index.
                cand.sort_by(|&i, &j| sc[j].total_cmp(&sc[i]).then(i.cmp(&j)));
                let mut kept: Vec<usize> = Vec::new();
                for i in cand {
                    if kept.len() >= max_out {
                        break;
                    }
                    if kept.iter().all(|&k| !overlaps(corners(b, i), corners(b, k))) {
                        kept.push(i);
                        out.extend([b as i64, c as i64, i as i64]);
                    }
                }
            }
        }
        Ok(vec![Array::i64(vec![out.len() / 3, 3], out)])
    }
}
