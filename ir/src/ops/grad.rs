//! The context of a gradient rule ([`super::OpRules::grad`]): the forward node, the
//! gradients of its outputs, and a builder that adds the backward ops to the training graph
//! as ordinary, typed IR nodes.
//!
//! A rule reads `x(i)`, `y(s)` and `dy(s)`, asks `want(i)` for each input, builds the
//! gradient with the helpers (which pick the operand forms of the graph's opset: axes as
//! inputs from opset 13, as attributes before) and hands it over with `set(i, dx)`.
//! Gradients of broadcast operands are summed back to their shape with [`GradCx::sum_to`].

use crate::array::Array;
use crate::graph::op::{self, Op};
use crate::graph::{Graph, NodeId, Output, Value};
use crate::types::{DType, Dim, TensorType, Type};

/// The gradient rule's view of one forward node.
pub struct GradCx<'a> {
    /// The training graph being built (the forward nodes are in it).
    pub g: &'a mut Graph,
    /// The forward node.
    pub n: NodeId,
    dys: Vec<Option<Value>>,
    wants: Vec<bool>,
    dxs: Vec<Option<Value>>,
    counter: &'a mut usize,
    /// The nodes the rule added, in order.
    pub added: Vec<NodeId>,
}

type R<T> = Result<T, String>;

impl<'a> GradCx<'a> {
    /// A context for node `n` with output gradients `dys` and the inputs `wants` marks.
    pub fn new(g: &'a mut Graph, n: NodeId, dys: Vec<Option<Value>>, wants: Vec<bool>, counter: &'a mut usize) -> Self {
        let k = wants.len();
        GradCx { g, n, dys, wants, dxs: vec![None; k], counter, added: Vec::new() }
    }

    /// The input gradients the rule set.
    pub fn into_grads(self) -> (Vec<Option<Value>>, Vec<NodeId>) {
        (self.dxs, self.added)
    }

    /// The forward op.
    pub fn op(&self) -> &Op {
        &self.g.node(self.n).op
    }

    /// Forward input `i` (which must be present).
    pub fn x(&self, i: usize) -> R<Value> {
        self.g.node(self.n).input(i).ok_or_else(|| format!("input {i} is missing"))
    }

    /// Forward input `i`, if present.
    pub fn x_opt(&self, i: usize) -> Option<Value> {
        self.g.node(self.n).input(i)
    }

    /// Forward output `s`.
    pub fn y(&self, s: usize) -> Value {
        Value::new(self.n, s as u16)
    }

    /// The gradient of output `s`, when one flows back.
    pub fn dy(&self, s: usize) -> Option<Value> {
        self.dys.get(s).copied().flatten()
    }

    /// The gradient of output `s`, or zeros of its shape.
    pub fn dy_or_zeros(&mut self, s: usize) -> R<Value> {
        match self.dy(s) {
            Some(v) => Ok(v),
            None => {
                let y = self.y(s);
                self.zeros_like(y)
            }
        }
    }

    /// Input `i` needs a gradient.
    pub fn want(&self, i: usize) -> bool {
        self.wants.get(i).copied().unwrap_or(false)
    }

    /// Sets the gradient of input `i`.
    pub fn set(&mut self, i: usize, dx: Value) {
        if i < self.dxs.len() && self.want(i) {
            self.dxs[i] = Some(dx);
        }
    }

    /// A value's static dims.
    pub fn dims(&self, v: Value) -> R<Vec<i64>> {
        self.g
            .tensor_type(v)
            .and_then(TensorType::static_dims)
            .ok_or_else(|| format!("`{}` has no static shape", self.g.value_name(v)))
    }

    /// The graph's opset.
    pub fn opset(&self) -> i64 {
        self.g.opset
    }

    /// A value's element type.
    pub fn dtype(&self, v: Value) -> DType {
        self.g.tensor_type(v).map_or(DType::Float, |t| t.dtype)
    }

    /// An input's value when it is constant ([`GradCx::const_array`]), as integers.
    pub fn const_ints(&self, v: Option<Value>) -> Option<Vec<i64>> {
        v.and_then(|v| self.const_array(v)).and_then(|a| a.to_i64().ok())
    }

    /// A value's constant value: an initializer, or an op of constants (a few levels deep:
    /// exporters write operands such as a resize's scales as `Concat`s of `Constant`s, and a
    /// training graph is built before or without canonicalization).
    pub fn const_array(&self, v: Value) -> Option<Array> {
        super::constant_value(self.g, v, 16)
    }

    fn fresh(&mut self) -> String {
        let base = self.g.node(self.n).outputs().first().map(|o| o.name.clone()).unwrap_or_default();
        loop {
            *self.counter += 1;
            let name = format!("{base}__d{}", *self.counter);
            if self.g.lookup(&name).is_none() {
                return name;
            }
        }
    }

    /// Adds `op` on `inputs` with `n_out` outputs and infers their types.
    pub fn add(&mut self, op: Op, inputs: &[Option<Value>], n_out: usize) -> R<Vec<Value>> {
        let names: Vec<String> = (0..n_out).map(|_| self.fresh()).collect();
        let id = self.g.add_node(op, inputs.to_vec(), names.into_iter().map(Output::named).collect());
        self.added.push(id);
        infer_node(self.g, id)?;
        Ok((0..n_out).map(|s| Value::new(id, s as u16)).collect())
    }

    /// Adds a one-output op.
    pub fn add1(&mut self, op: Op, inputs: &[Value]) -> R<Value> {
        let ins: Vec<Option<Value>> = inputs.iter().map(|v| Some(*v)).collect();
        Ok(self.add(op, &ins, 1)?[0])
    }

    /// An int64 vector constant.
    pub fn ints(&mut self, v: &[i64]) -> Value {
        let name = self.fresh();
        self.g.add_initializer(name, Array::i64(vec![v.len()], v.to_vec()).to_tensor())
    }

    /// A constant tensor.
    pub fn constant(&mut self, a: Array) -> Value {
        let name = self.fresh();
        self.g.add_initializer(name, a.to_tensor())
    }

    /// A scalar constant of `dtype`.
    pub fn scalar(&mut self, dtype: DType, x: f64) -> Value {
        let name = self.fresh();
        let a = match dtype {
            DType::Int64 | DType::Int32 => Array::int(dtype, vec![], vec![x as i64]),
            _ => Array::float(dtype, vec![], vec![x]),
        };
        self.g.add_initializer(name, a.to_tensor())
    }

    /// `a · b` (broadcasting).
    pub fn mul(&mut self, a: Value, b: Value) -> R<Value> {
        self.add1(Op::Mul(op::Mul::default()), &[a, b])
    }

    /// `a + b`.
    pub fn add2(&mut self, a: Value, b: Value) -> R<Value> {
        self.add1(Op::Add(op::Add::default()), &[a, b])
    }

    /// `a − b`.
    pub fn sub(&mut self, a: Value, b: Value) -> R<Value> {
        self.add1(Op::Sub(op::Sub::default()), &[a, b])
    }

    /// `a / b`.
    pub fn div(&mut self, a: Value, b: Value) -> R<Value> {
        self.add1(Op::Div(op::Div::default()), &[a, b])
    }

    /// `−a`.
    pub fn neg(&mut self, a: Value) -> R<Value> {
        self.add1(Op::Neg(op::Neg::default()), &[a])
    }

    /// `a · k` for a scalar `k` (of `a`'s element type).
    pub fn scale(&mut self, a: Value, k: f64) -> R<Value> {
        if k == 1.0 {
            return Ok(a);
        }
        let s = self.scalar(self.dtype(a), k);
        self.mul(a, s)
    }

    /// `cond ? a : b`.
    pub fn where_(&mut self, cond: Value, a: Value, b: Value) -> R<Value> {
        self.add1(Op::Where(op::Where::default()), &[cond, a, b])
    }

    /// `x` cast to `to`.
    pub fn cast(&mut self, x: Value, to: DType) -> R<Value> {
        if self.dtype(x) == to {
            return Ok(x);
        }
        self.add1(Op::Cast(op::Cast { to: Some(to.code()), ..Default::default() }), &[x])
    }

    /// `x` reshaped to `shape`.
    pub fn reshape(&mut self, x: Value, shape: &[i64]) -> R<Value> {
        if self.dims(x)? == shape {
            return Ok(x);
        }
        let s = self.ints(shape);
        self.add1(Op::Reshape(op::Reshape::default()), &[x, s])
    }

    /// `x` with dims permuted.
    pub fn transpose(&mut self, x: Value, perm: &[i64]) -> R<Value> {
        if perm.iter().enumerate().all(|(i, &p)| p == i as i64) {
            return Ok(x);
        }
        self.add1(Op::Transpose(op::Transpose { perm: Some(perm.to_vec()) }), &[x])
    }

    /// `x` broadcast to `shape`.
    pub fn expand(&mut self, x: Value, shape: &[i64]) -> R<Value> {
        if self.dims(x)? == shape {
            return Ok(x);
        }
        let s = self.ints(shape);
        self.add1(Op::Expand(op::Expand::default()), &[x, s])
    }

    /// Zeros of `v`'s shape and element type.
    pub fn zeros_like(&mut self, v: Value) -> R<Value> {
        let d = self.dims(v)?;
        let z = self.scalar(self.dtype(v), 0.0);
        self.expand(z, &d)
    }

    /// The sum of `x` over `axes` (kept as 1 when `keep`).
    pub fn reduce_sum(&mut self, x: Value, axes: &[i64], keep: bool) -> R<Value> {
        if axes.is_empty() {
            return Ok(x);
        }
        let keepdims = Some(i64::from(keep));
        if self.g.opset >= 13 {
            let a = self.ints(axes);
            self.add1(Op::ReduceSum(op::ReduceSum { keepdims, ..Default::default() }), &[x, a])
        } else {
            self.add1(Op::ReduceSum(op::ReduceSum { axes: Some(axes.to_vec()), keepdims, ..Default::default() }), &[x])
        }
    }

    /// The gradient of an op that maps `x` to `y` axis by axis with constant matrices (each
    /// `(axis, A)`, `A` row-major `[M, L]`: `y`'s `M` positions along the axis from `x`'s `L`,
    /// as a resize or a reflecting pad does): `dY` with each axis contracted with its `A`
    /// (moved last, `MatMul(dY, A)`, moved back). `A` is a constant of `dtype`.
    pub fn contract_axes(&mut self, dy: Value, dtype: DType, mats: Vec<(usize, usize, usize, Vec<f64>)>) -> R<Value> {
        let rank = self.dims(dy)?.len();
        let mut g = dy;
        for (axis, m, l, a) in mats {
            if axis >= rank || a.len() != m * l {
                return Err(format!("a [{m}, {l}] map of axis {axis} for a tensor of rank {rank}"));
            }
            let av = self.constant(Array::float(dtype, vec![m, l], a));
            let last = rank - 1;
            let mut perm: Vec<i64> = (0..rank as i64).collect();
            perm.swap(axis, last);
            let moved = if axis == last { g } else { self.transpose(g, &perm)? };
            let contracted = self.add1(Op::MatMul(op::MatMul {}), &[moved, av])?;
            g = if axis == last { contracted } else { self.transpose(contracted, &perm)? };
        }
        Ok(g)
    }

    /// `x` summed down to `shape` (the gradient of a broadcast from `shape`).
    pub fn sum_to(&mut self, x: Value, shape: &[i64]) -> R<Value> {
        let d = self.dims(x)?;
        if d == shape {
            return Ok(x);
        }
        if d.len() < shape.len() {
            return Err(format!("cannot sum {d:?} down to {shape:?}"));
        }
        let r = d.len() - shape.len();
        let mut axes: Vec<i64> = (0..r as i64).collect();
        for (i, &s) in shape.iter().enumerate() {
            if s == 1 && d[r + i] != 1 {
                axes.push((r + i) as i64);
            }
        }
        let summed = self.reduce_sum(x, &axes, true)?;
        self.reshape(summed, shape)
    }

    /// The gradient for input `i` of a broadcasting element-wise op: `dx` summed to the
    /// input's shape.
    pub fn set_broadcast(&mut self, i: usize, dx: Value) -> R<()> {
        if !self.want(i) {
            return Ok(());
        }
        let xi = self.x(i)?;
        let shape = self.dims(xi)?;
        let d = self.sum_to(dx, &shape)?;
        let d = self.cast(d, self.dtype(xi))?;
        self.set(i, d);
        Ok(())
    }
}

/// Infers the output types of node `n` from its inputs' types and constant values, and
/// sets them.
pub fn infer_node(g: &mut Graph, n: NodeId) -> R<()> {
    let node = g.node(n);
    let consts: Vec<Option<Array>> = node
        .inputs()
        .iter()
        .map(|v| v.and_then(|v| g.initializer(v)).and_then(|t| Array::from_tensor(t).ok()))
        .collect();
    let types: Vec<Option<&TensorType>> = node.inputs().iter().map(|v| v.and_then(|v| g.tensor_type(v))).collect();
    let const_refs: Vec<Option<&Array>> = consts.iter().map(Option::as_ref).collect();
    let syms: Vec<Option<&Vec<Dim>>> = vec![None; types.len()];
    let n_out = node.num_outputs();
    let out = super::infer_op(&node.op, &types, &const_refs, &syms, n_out, g.opset)
        .map_err(|e| format!("{}: {e}", g.describe(n)))?;
    for (s, t) in out.into_iter().enumerate().take(n_out) {
        if let Some(t) = t {
            g.set_type(Value::new(n, s as u16), Some(Type::Tensor(t)));
        }
    }
    Ok(())
}
