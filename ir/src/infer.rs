//! Shape inference: element types and dimensions of every value, from the graph inputs.
//!
//! Alongside types it tracks two kinds of knowledge about values: constants (small tensors
//! computed by folding, e.g. `Shape → Gather → Concat` chains over static shapes) and
//! symbolic shape vectors (a 1-D int64 value known to hold dims such as `[batch, 128, 768]`),
//! so that reshapes in dynamic-batch exports still get precise shapes.
//!
//! Declared types (`value_info`, graph output signatures) are checked against what is
//! inferred: a contradiction is an error naming the node.

use std::collections::HashMap;

use crate::attr::AttrValue;
use crate::eval::{self, Array};
use crate::graph::{Graph, NodeId, Span, Value};
use crate::op::{Op, OpClass};
use crate::types::{DType, Dim, TensorType, Type};

/// A shape inference failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeError {
    /// The node at fault, when one is.
    pub node: Option<NodeId>,
    /// Its source location, when known.
    pub span: Option<Span>,
    /// What is wrong.
    pub msg: String,
}

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

/// What inference found beyond the types written into the graph.
#[derive(Clone, Debug, Default)]
pub struct InferReport {
    /// Values computed by constant folding (small tensors only).
    pub consts: HashMap<Value, Array>,
    /// Operator nodes whose outputs could not be inferred (opaque ops, unknown inputs).
    pub unknown: Vec<NodeId>,
    /// Declared types (value_info, output signatures) that contradict what the ops produce;
    /// the inferred type replaces them. Exporters sometimes write stale declarations.
    pub warnings: Vec<ShapeError>,
}

/// How declared types are treated.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// Check inferred types against declared ones (value_info, output signatures); keep
    /// declared details where inference knows less.
    #[default]
    Check,
    /// Forget the types of operator outputs and graph outputs first (after inputs changed,
    /// e.g. re-batching), then infer them afresh.
    Reset,
}

/// Largest tensor (elements) that folding materialises.
const FOLD_LIMIT: usize = 1 << 16;

/// Infers all types of `g` (and its subgraphs).
pub fn infer_shapes(g: &mut Graph, mode: Mode) -> Result<InferReport, Vec<ShapeError>> {
    let mut cx = Infer {
        consts: HashMap::new(),
        syms: HashMap::new(),
        errors: Vec::new(),
        warnings: Vec::new(),
        unknown: Vec::new(),
    };
    cx.graph(g, mode, &HashMap::new());
    if cx.errors.is_empty() {
        Ok(InferReport { consts: cx.consts, unknown: cx.unknown, warnings: cx.warnings })
    } else {
        Err(cx.errors)
    }
}

struct Infer {
    consts: HashMap<Value, Array>,
    syms: HashMap<Value, Vec<Dim>>,
    errors: Vec<ShapeError>,
    warnings: Vec<ShapeError>,
    unknown: Vec<NodeId>,
}

fn tensor(t: Option<&Type>) -> Option<&TensorType> {
    t.and_then(Type::as_tensor)
}

// ---------------------------------------------------------------- dim arithmetic

/// A product of a number and named dims, for reasoning about reshapes with symbolic dims.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Prod {
    coef: i64,
    syms: Vec<String>,
    unknown: bool,
}

fn prod(dims: &[Dim]) -> Prod {
    let mut p = Prod { coef: 1, syms: Vec::new(), unknown: false };
    for d in dims {
        match d {
            Dim::Fixed(v) if *v >= 0 => p.coef = p.coef.saturating_mul(*v),
            Dim::Sym(s) => p.syms.push(s.clone()),
            _ => p.unknown = true,
        }
    }
    p.syms.sort();
    p
}

fn prod_dim(p: &Prod) -> Dim {
    match (p.unknown, p.syms.len()) {
        (true, _) => Dim::Unknown,
        (false, 0) => Dim::Fixed(p.coef),
        (false, 1) if p.coef == 1 => Dim::Sym(p.syms[0].clone()),
        _ => Dim::Unknown,
    }
}

/// `a / b` when it is a single number or name.
fn prod_div(a: &Prod, b: &Prod) -> Dim {
    if a.unknown || b.unknown || b.coef == 0 || a.coef % b.coef != 0 {
        return Dim::Unknown;
    }
    let mut rest = a.syms.clone();
    for s in &b.syms {
        match rest.iter().position(|x| x == s) {
            Some(i) => {
                rest.remove(i);
            }
            None => return Dim::Unknown,
        }
    }
    prod_dim(&Prod { coef: a.coef / b.coef, syms: rest, unknown: false })
}

fn bcast(a: &Dim, b: &Dim) -> Result<Dim, String> {
    Ok(match (a, b) {
        (Dim::Fixed(1), x) | (x, Dim::Fixed(1)) => x.clone(),
        (Dim::Fixed(x), Dim::Fixed(y)) if x == y => Dim::Fixed(*x),
        (Dim::Fixed(x), Dim::Fixed(y)) if *x >= 0 && *y >= 0 => {
            return Err(format!("dims {x} and {y} do not broadcast"));
        }
        (Dim::Fixed(x), _) | (_, Dim::Fixed(x)) if *x > 1 => Dim::Fixed(*x),
        (Dim::Sym(x), Dim::Sym(y)) if x == y => Dim::Sym(x.clone()),
        _ => Dim::Unknown,
    })
}

fn bcast_shapes(a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, String> {
    let n = a.len().max(b.len());
    let one = Dim::Fixed(1);
    (0..n)
        .map(|i| {
            let x = if i + a.len() >= n { &a[i + a.len() - n] } else { &one };
            let y = if i + b.len() >= n { &b[i + b.len() - n] } else { &one };
            bcast(x, y).map_err(|e| format!("shapes [{}] and [{}] do not broadcast: {e}", join(a), join(b)))
        })
        .collect()
}

fn join(d: &[Dim]) -> String {
    d.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

fn norm_axis(a: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let x = if a < 0 { a + r } else { a };
    if x < 0 || x >= r {
        return Err(format!("axis {a} is out of range for rank {rank}"));
    }
    Ok(x as usize)
}

/// Dims from a shape-valued input: constant or symbolic.
fn shape_operand(c: Option<&Array>, s: Option<&Vec<Dim>>) -> Option<Vec<Dim>> {
    if let Some(a) = c {
        return a.to_i64().ok().map(|v| v.into_iter().map(Dim::Fixed).collect());
    }
    s.cloned()
}

/// Merges an inferred type into a declared one. Errors on contradictions.
fn merge(declared: Option<&Type>, inferred: Option<TensorType>) -> Result<Option<Type>, String> {
    let Some(inf) = inferred else { return Ok(declared.cloned()) };
    let Some(decl) = declared else { return Ok(Some(Type::Tensor(inf))) };
    let Type::Tensor(d) = decl else { return Ok(Some(decl.clone())) };
    if d.dtype != inf.dtype {
        return Err(format!("declared as {d}, but the op produces {}", inf.dtype));
    }
    let dims = match (&d.dims, &inf.dims) {
        (None, x) | (x, None) => x.clone(),
        (Some(a), Some(b)) => {
            if a.len() != b.len() {
                return Err(format!("declared as {d}, but inferred {inf} (rank {} vs {})", a.len(), b.len()));
            }
            let mut out = Vec::with_capacity(a.len());
            for (x, y) in a.iter().zip(b) {
                out.push(match (x, y) {
                    (Dim::Fixed(p), Dim::Fixed(q)) if p != q && *p >= 0 && *q >= 0 => {
                        return Err(format!("declared as {d}, but inferred {inf}"));
                    }
                    (Dim::Fixed(p), _) if *p >= 0 => x.clone(),
                    (_, Dim::Fixed(q)) if *q >= 0 => y.clone(),
                    (Dim::Sym(_), _) => x.clone(),
                    _ => y.clone(),
                });
            }
            Some(out)
        }
    };
    Ok(Some(Type::Tensor(TensorType { dtype: d.dtype, dims })))
}

impl Infer {
    fn graph(&mut self, g: &mut Graph, mode: Mode, outer: &HashMap<String, Type>) {
        let order = match g.topo_order() {
            Ok(o) => o,
            Err(c) => {
                self.errors.push(ShapeError {
                    node: c.0.first().copied(),
                    span: None,
                    msg: "the graph has a cycle".into(),
                });
                return;
            }
        };
        if mode == Mode::Reset {
            for &n in &order {
                if matches!(g.node(n).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef) {
                    continue;
                }
                for slot in 0..g.node(n).num_outputs() {
                    g.set_type(Value::new(n, slot as u16), None);
                }
            }
        }
        for n in order {
            match &g.node(n).op {
                Op::Initializer(t) => {
                    if !t.is_external()
                        && t.numel() as usize <= FOLD_LIMIT
                        && let Ok(a) = Array::from_tensor(t)
                    {
                        self.consts.insert(Value::new(n, 0), a);
                    }
                    continue;
                }
                Op::Input { default } => {
                    // Old exports list initializers as inputs too: their values are the model's.
                    if let Some(t) = default
                        && !t.is_external()
                        && t.numel() as usize <= FOLD_LIMIT
                        && let Ok(a) = Array::from_tensor(t)
                    {
                        self.consts.insert(Value::new(n, 0), a);
                    }
                    continue;
                }
                Op::OuterRef => {
                    let name = g.node(n).outputs()[0].name.clone();
                    if g.node(n).outputs()[0].ty.is_none()
                        && let Some(t) = outer.get(&name)
                    {
                        g.set_type(Value::new(n, 0), Some(t.clone()));
                    }
                    continue;
                }
                _ => {}
            }
            self.node(g, n, mode);
        }
        // Graph outputs: check or take the inferred types.
        let outs: Vec<_> = g.outputs().to_vec();
        let mut new_outs = Vec::with_capacity(outs.len());
        for o in outs {
            let inferred = g.value_type(o.value).and_then(Type::as_tensor).cloned();
            let ty = if mode == Mode::Reset {
                inferred.map(Type::Tensor).or(o.ty.clone())
            } else {
                match merge(o.ty.as_ref(), inferred.clone()) {
                    Ok(t) => t,
                    Err(e) => {
                        self.warnings.push(ShapeError {
                            node: Some(o.value.node),
                            span: g.span(o.value.node),
                            msg: format!("graph output `{}` is {e}; using the inferred type", g.value_name(o.value)),
                        });
                        inferred.map(Type::Tensor)
                    }
                }
            };
            new_outs.push(crate::graph::GraphOutput { value: o.value, ty });
        }
        g.set_outputs(new_outs);
    }

    fn node(&mut self, g: &mut Graph, n: NodeId, mode: Mode) {
        let node = g.node(n);
        let ins: Vec<Option<TensorType>> =
            node.inputs().iter().map(|i| i.and_then(|v| tensor(g.value_type(v)).cloned())).collect();
        let consts: Vec<Option<&Array>> = node.inputs().iter().map(|i| i.and_then(|v| self.consts.get(&v))).collect();
        let syms: Vec<Option<&Vec<Dim>>> = node.inputs().iter().map(|i| i.and_then(|v| self.syms.get(&v))).collect();
        let n_out = node.num_outputs();

        // Subgraphs first: their outputs type If/Loop.
        if matches!(node.op, Op::If(_) | Op::Loop(_) | Op::Scan(_)) {
            self.control(g, n, mode, &ins);
            return;
        }

        // Constant folding when every input is known.
        let all_const = node.inputs().iter().zip(&consts).all(|(i, c)| i.is_none() || c.is_some());
        let folded = if all_const && small_enough(&node.op, &consts) {
            eval::fold_node(g, n, &consts)
        } else {
            // The shape and size of a statically shaped value are constants too.
            match (&node.op, ins.first().and_then(|t| t.as_ref()).and_then(TensorType::static_dims)) {
                (Op::Shape(s), Some(d)) => {
                    let r = d.len() as i64;
                    let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
                    let (a, b) = (clampi(s.start()), clampi(s.end.unwrap_or(r)));
                    let part: Vec<i64> = d[a..b.max(a)].to_vec();
                    Some(vec![Array::i64(vec![part.len()], part)])
                }
                (Op::Size(_), Some(d)) => Some(vec![Array::scalar_i64(d.iter().product())]),
                _ => None,
            }
        };
        let result: Result<Vec<Option<TensorType>>, String> = match &folded {
            Some(arrays) => Ok(arrays
                .iter()
                .map(|a| Some(TensorType::fixed(a.dtype, &a.shape.iter().map(|&d| d as i64).collect::<Vec<_>>())))
                .collect()),
            None => {
                let ins_ref: Vec<Option<&TensorType>> = ins.iter().map(Option::as_ref).collect();
                infer_op(&node.op, &ins_ref, &consts, &syms, n_out, g.opset)
            }
        };
        let sym_out = if folded.is_none() { symbolic_value(&node.op, &ins, &consts, &syms) } else { None };
        match result {
            Ok(types) => {
                if types.iter().all(Option::is_none) && n_out > 0 {
                    self.unknown.push(n);
                }
                for (slot, t) in types.into_iter().enumerate().take(n_out) {
                    let v = Value::new(n, slot as u16);
                    let declared = g.value_type(v).cloned();
                    match merge(declared.as_ref(), t.clone()) {
                        Ok(ty) => g.set_type(v, ty),
                        Err(e) => {
                            self.warnings.push(ShapeError {
                                node: Some(n),
                                span: g.span(n),
                                msg: format!(
                                    "`{}` (output of {}) is {e}; using the inferred type",
                                    g.value_name(v),
                                    g.describe(n)
                                ),
                            });
                            g.set_type(v, t.map(Type::Tensor));
                        }
                    }
                }
                if let Some(arrays) = folded {
                    for (slot, a) in arrays.into_iter().enumerate().take(n_out) {
                        self.consts.insert(Value::new(n, slot as u16), a);
                    }
                }
                if let Some(s) = sym_out {
                    self.syms.insert(Value::new(n, 0), s);
                }
            }
            Err(e) => {
                self.errors.push(ShapeError { node: Some(n), span: g.span(n), msg: format!("{}: {e}", g.describe(n)) })
            }
        }
    }

    fn control(&mut self, g: &mut Graph, n: NodeId, mode: Mode, ins: &[Option<TensorType>]) {
        // Types of every value the subgraphs may read from this graph.
        let mut outer: HashMap<String, Type> = HashMap::new();
        for &c in g.node(n).captures() {
            if let Some(t) = g.value_type(c) {
                outer.insert(g.value_name(c).to_string(), t.clone());
            }
        }
        let mut op = g.node(n).op.clone();
        let mut out_types: Vec<Option<TensorType>> = vec![None; g.node(n).num_outputs()];
        match &mut op {
            Op::If(i) => {
                let mut branch_types = Vec::new();
                for b in [&mut i.then_branch, &mut i.else_branch].into_iter().flatten() {
                    self.graph(b, mode, &outer);
                    branch_types.push(
                        b.outputs()
                            .iter()
                            .map(|o| o.ty.as_ref().and_then(Type::as_tensor).cloned())
                            .collect::<Vec<_>>(),
                    );
                }
                if let Some(first) = branch_types.first() {
                    for (k, t) in first.iter().enumerate().take(out_types.len()) {
                        let mut t = t.clone();
                        for other in &branch_types[1..] {
                            t = match (t, other.get(k).cloned().flatten()) {
                                (Some(a), Some(b)) if a.dtype == b.dtype => {
                                    let dims = match (&a.dims, &b.dims) {
                                        (Some(x), Some(y)) if x.len() == y.len() => Some(
                                            x.iter()
                                                .zip(y)
                                                .map(|(p, q)| if p == q { p.clone() } else { Dim::Unknown })
                                                .collect(),
                                        ),
                                        _ => None,
                                    };
                                    Some(TensorType { dtype: a.dtype, dims })
                                }
                                _ => None,
                            };
                        }
                        out_types[k] = t;
                    }
                }
            }
            Op::Loop(l) => {
                if let Some(body) = &mut l.body {
                    // Body inputs: iteration count, condition, carried values.
                    let names: Vec<(Value, usize)> =
                        body.inputs().iter().enumerate().map(|(k, &b)| (Value::new(b, 0), k)).collect();
                    for (v, k) in names {
                        if body.value_type(v).is_none() {
                            let t = match k {
                                0 => Some(TensorType::scalar(DType::Int64)),
                                1 => Some(TensorType::scalar(DType::Bool)),
                                k => ins.get(k).cloned().flatten(),
                            };
                            body.set_type(v, t.map(Type::Tensor));
                        }
                    }
                    self.graph(body, mode, &outer);
                    let n_carried = ins.len().saturating_sub(2);
                    for (k, o) in body.outputs().iter().enumerate().skip(1) {
                        let t = o.ty.as_ref().and_then(Type::as_tensor).cloned();
                        let slot = k - 1;
                        if slot >= out_types.len() {
                            break;
                        }
                        out_types[slot] = if slot < n_carried {
                            t
                        } else {
                            t.map(|t| TensorType {
                                dtype: t.dtype,
                                dims: t.dims.map(|d| std::iter::once(Dim::Unknown).chain(d).collect()),
                            })
                        };
                    }
                }
            }
            _ => {}
        }
        g.set_op(n, op);
        for (slot, t) in out_types.into_iter().enumerate() {
            let v = Value::new(n, slot as u16);
            let declared = g.value_type(v).cloned();
            match merge(declared.as_ref(), t.clone()) {
                Ok(ty) => g.set_type(v, ty),
                Err(e) => {
                    self.warnings.push(ShapeError {
                        node: Some(n),
                        span: g.span(n),
                        msg: format!("{}: {e}", g.describe(n)),
                    });
                    g.set_type(v, t.map(Type::Tensor));
                }
            }
        }
    }
}

fn small_enough(op: &Op, consts: &[Option<&Array>]) -> bool {
    if consts.iter().flatten().any(|a| a.numel() > FOLD_LIMIT) {
        return false;
    }
    match op {
        // Outputs sized by input values: guard against huge results.
        Op::ConstantOfShape(_) | Op::Expand(_) | Op::Tile(_) | Op::Range(_) => {
            let est: f64 = match op {
                Op::ConstantOfShape(_) => {
                    consts[0].and_then(|a| a.to_f64().ok()).map_or(f64::INFINITY, |v| v.iter().product())
                }
                Op::Expand(_) => {
                    consts
                        .get(1)
                        .copied()
                        .flatten()
                        .and_then(|a| a.to_f64().ok())
                        .map_or(f64::INFINITY, |v| v.iter().map(|x| x.max(1.0)).product::<f64>())
                        * consts[0].map_or(1.0, |a| a.numel().max(1) as f64)
                }
                Op::Tile(_) => {
                    consts
                        .get(1)
                        .copied()
                        .flatten()
                        .and_then(|a| a.to_f64().ok())
                        .map_or(f64::INFINITY, |v| v.iter().product::<f64>())
                        * consts[0].map_or(1.0, |a| a.numel() as f64)
                }
                _ => {
                    let get = |i: usize| {
                        consts.get(i).copied().flatten().and_then(|a| a.to_f64().ok()).and_then(|v| v.first().copied())
                    };
                    match (get(0), get(1), get(2)) {
                        (Some(s), Some(l), Some(d)) if d != 0.0 => ((l - s) / d).abs(),
                        _ => f64::INFINITY,
                    }
                }
            };
            est <= FOLD_LIMIT as f64
        }
        _ => true,
    }
}

/// Symbolic dims carried by shape-valued ops (`Shape`, `Gather`, `Concat`, …).
fn symbolic_value(
    op: &Op,
    ins: &[Option<TensorType>],
    consts: &[Option<&Array>],
    syms: &[Option<&Vec<Dim>>],
) -> Option<Vec<Dim>> {
    let vals = |i: usize| -> Option<Vec<Dim>> {
        shape_operand(consts.get(i).copied().flatten(), syms.get(i).copied().flatten())
    };
    match op {
        Op::Shape(s) => {
            let dims = ins.first()?.as_ref()?.dims.clone()?;
            let r = dims.len() as i64;
            let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let (a, b) = (clampi(s.start()), clampi(s.end.unwrap_or(r)));
            Some(dims[a..b.max(a)].to_vec())
        }
        Op::Identity(_) => vals(0),
        Op::Cast(c) if c.to == Some(DType::Int64.code()) || c.to == Some(DType::Int32.code()) => vals(0),
        Op::Gather(gat) => {
            let data = vals(0)?;
            let idx = consts.get(1).copied().flatten()?.to_i64().ok()?;
            if gat.axis() != 0 {
                return None;
            }
            let n = data.len() as i64;
            idx.iter().map(|&i| data.get((if i < 0 { i + n } else { i }) as usize).cloned()).collect()
        }
        Op::Concat(_) => {
            let mut out = Vec::new();
            for i in 0..ins.len() {
                out.extend(vals(i)?);
            }
            Some(out)
        }
        Op::Unsqueeze(_) | Op::Squeeze(_) | Op::Reshape(_) => {
            let v = vals(0)?;
            (v.len() <= 1).then_some(v)
        }
        Op::Slice(_) => {
            let v = vals(0)?;
            let get = |i: usize| consts.get(i).copied().flatten().and_then(|a| a.to_i64().ok());
            let (s, e) = (get(1)?, get(2)?);
            let step = get(4).map(|x| x[0]).unwrap_or(1);
            if step != 1 {
                return None;
            }
            let (start, _, count) = eval::slice_params(v.len() as i64, s[0], e[0], 1);
            Some(v[start as usize..start as usize + count].to_vec())
        }
        Op::Mul(_) | Op::Add(_) | Op::Sub(_) | Op::Div(_) => {
            // Keep the value only where one side is all ones/zeros (identity); else unknown.
            let (a, b) = (vals(0)?, vals(1)?);
            let neutral = match op {
                Op::Mul(_) | Op::Div(_) => 1,
                _ => 0,
            };
            if b.iter().all(|d| *d == Dim::Fixed(neutral)) && b.len() <= a.len().max(1) {
                Some(a)
            } else if !matches!(op, Op::Sub(_) | Op::Div(_)) && a.iter().all(|d| *d == Dim::Fixed(neutral)) {
                Some(b)
            } else {
                None
            }
        }
        _ => None,
    }
}

fn same(t: Option<&TensorType>) -> Result<Vec<Option<TensorType>>, String> {
    Ok(vec![t.cloned()])
}

fn dims_of(t: Option<&TensorType>) -> Option<&Vec<Dim>> {
    t.and_then(|t| t.dims.as_ref())
}

fn ints_input(c: &[Option<&Array>], i: usize) -> Option<Vec<i64>> {
    c.get(i).copied().flatten().and_then(|a| a.to_i64().ok())
}

/// Windowed output dims with possibly unknown inputs.
#[allow(clippy::too_many_arguments)]
fn window_dims(
    spatial: &[Dim],
    kernel: &[i64],
    strides: Option<&[i64]>,
    dilations: Option<&[i64]>,
    pads: Option<&[i64]>,
    auto_pad: &str,
    ceil_mode: bool,
) -> Result<Vec<Dim>, String> {
    let k = spatial.len();
    if kernel.len() != k {
        return Err(format!("kernel_shape {kernel:?} does not fit {k} spatial dims"));
    }
    let mut out = Vec::with_capacity(k);
    for i in 0..k {
        match spatial[i].value() {
            Some(d) => {
                let pick = |v: Option<&[i64]>| v.map(|v| vec![v[i]]);
                let pad = pads.map(|p| vec![p[i], p[i + k]]);
                let w = eval::window(
                    &[d as usize],
                    &kernel[i..=i],
                    pick(strides).as_deref(),
                    pick(dilations).as_deref(),
                    pad.as_deref(),
                    auto_pad,
                    ceil_mode,
                )?;
                out.push(Dim::Fixed(w.out[0] as i64));
            }
            None => out.push(Dim::Unknown),
        }
    }
    Ok(out)
}

fn check_window_attrs(
    k: usize,
    strides: Option<&[i64]>,
    dilations: Option<&[i64]>,
    pads: Option<&[i64]>,
) -> Result<(), String> {
    for (name, v, want) in [("strides", strides, k), ("dilations", dilations, k), ("pads", pads, 2 * k)] {
        if let Some(v) = v
            && v.len() != want
        {
            return Err(format!("{name} {v:?} needs {want} values for {k} spatial dims"));
        }
    }
    Ok(())
}

/// The type rule of each op: output types from input types and known input values.
pub fn infer_op(
    op: &Op,
    ins: &[Option<&TensorType>],
    consts: &[Option<&Array>],
    syms: &[Option<&Vec<Dim>>],
    n_out: usize,
    opset: i64,
) -> Result<Vec<Option<TensorType>>, String> {
    let x = ins.first().copied().flatten();
    let dt = x.map(|t| t.dtype);
    let with = |dtype: Option<DType>, dims: Option<Vec<Dim>>| dtype.map(|d| TensorType { dtype: d, dims });
    match op {
        Op::Constant(c) => {
            let a = eval::eval_op(op, &[], 1, opset).map_err(|e| e.to_string())?;
            let _ = c;
            Ok(vec![Some(TensorType::fixed(a[0].dtype, &a[0].shape.iter().map(|&d| d as i64).collect::<Vec<_>>()))])
        }
        Op::Cast(c) => {
            let to = c.to.and_then(DType::from_code).ok_or("Cast needs a valid `to`")?;
            Ok(vec![Some(TensorType { dtype: to, dims: x.and_then(|t| t.dims.clone()) })])
        }
        Op::CastLike(_) => {
            Ok(vec![with(ins.get(1).copied().flatten().map(|t| t.dtype), x.and_then(|t| t.dims.clone()))])
        }
        Op::IsNaN(_) | Op::IsInf(_) => Ok(vec![with(Some(DType::Bool), x.and_then(|t| t.dims.clone()))]),
        Op::Dropout(_) => {
            let mut out = vec![x.cloned()];
            if n_out > 1 {
                out.push(with(Some(DType::Bool), x.and_then(|t| t.dims.clone())));
            }
            Ok(out)
        }
        _ if op.class() == OpClass::Unary => same(x),
        Op::Equal(_)
        | Op::Less(_)
        | Op::LessOrEqual(_)
        | Op::Greater(_)
        | Op::GreaterOrEqual(_)
        | Op::And(_)
        | Op::Or(_)
        | Op::Xor(_) => {
            let dims = match (dims_of(ins[0]), dims_of(ins.get(1).copied().flatten())) {
                (Some(a), Some(b)) => Some(bcast_shapes(a, b)?),
                _ => None,
            };
            Ok(vec![Some(TensorType { dtype: DType::Bool, dims })])
        }
        _ if op.class() == OpClass::Binary => {
            let dims = match (dims_of(ins[0]), dims_of(ins.get(1).copied().flatten())) {
                (Some(a), Some(b)) => Some(bcast_shapes(a, b)?),
                _ => None,
            };
            Ok(vec![with(dt, dims)])
        }
        Op::Where(_) => {
            let mut dims = Some(vec![]);
            for t in ins {
                dims = match (dims, dims_of(*t)) {
                    (Some(a), Some(b)) => Some(bcast_shapes(&a, b)?),
                    _ => None,
                };
            }
            Ok(vec![with(ins.get(1).copied().flatten().map(|t| t.dtype), dims)])
        }
        _ if op.class() == OpClass::Variadic => {
            let mut dims = Some(vec![]);
            for t in ins {
                dims = match (dims, dims_of(*t)) {
                    (Some(a), Some(b)) => Some(bcast_shapes(&a, b)?),
                    _ => None,
                };
            }
            Ok(vec![with(dt, dims)])
        }
        Op::MatMul(_) => {
            let (Some(a), Some(b)) = (dims_of(ins[0]), dims_of(ins.get(1).copied().flatten())) else {
                return Ok(vec![with(dt, None)]);
            };
            let (mut a, mut b) = (a.clone(), b.clone());
            let (a1, b1) = (a.len() == 1, b.len() == 1);
            if a1 {
                a.insert(0, Dim::Fixed(1));
            }
            if b1 {
                b.push(Dim::Fixed(1));
            }
            if a.len() < 2 || b.len() < 2 {
                return Err("MatMul needs inputs of rank ≥ 1".into());
            }
            let (ka, kb) = (&a[a.len() - 1], &b[b.len() - 2]);
            if let (Some(p), Some(q)) = (ka.value(), kb.value())
                && p != q
            {
                return Err(format!("inner dims differ: [{}] x [{}]", join(&a), join(&b)));
            }
            let mut out = bcast_shapes(&a[..a.len() - 2], &b[..b.len() - 2])?;
            if !a1 {
                out.push(a[a.len() - 2].clone());
            }
            if !b1 {
                out.push(b[b.len() - 1].clone());
            }
            Ok(vec![with(dt, Some(out))])
        }
        Op::Gemm(gm) => {
            let (Some(a), Some(b)) = (dims_of(ins[0]), dims_of(ins.get(1).copied().flatten())) else {
                return Ok(vec![with(dt, None)]);
            };
            if a.len() != 2 || b.len() != 2 {
                return Err(format!("Gemm needs 2-D inputs, got [{}] and [{}]", join(a), join(b)));
            }
            let (m, ka) = if gm.trans_a() != 0 { (&a[1], &a[0]) } else { (&a[0], &a[1]) };
            let (kb, nn) = if gm.trans_b() != 0 { (&b[1], &b[0]) } else { (&b[0], &b[1]) };
            if let (Some(p), Some(q)) = (ka.value(), kb.value())
                && p != q
            {
                return Err(format!("inner dims differ: A is [{}], B is [{}]", join(a), join(b)));
            }
            let out = vec![m.clone(), nn.clone()];
            if let Some(c) = dims_of(ins.get(2).copied().flatten()) {
                bcast_shapes(&out, c).map_err(|e| format!("C does not broadcast to the result: {e}"))?;
            }
            Ok(vec![with(dt, Some(out))])
        }
        Op::Einsum(e) => {
            let eq: String = e.equation.clone().unwrap_or_default().chars().filter(|c| !c.is_whitespace()).collect();
            let Some((lhs, rhs)) = eq.split_once("->") else { return Ok(vec![with(dt, None)]) };
            if eq.contains("...") {
                return Ok(vec![with(dt, None)]);
            }
            let mut size: HashMap<char, Dim> = HashMap::new();
            for (term, t) in lhs.split(',').zip(ins) {
                if let Some(d) = dims_of(*t) {
                    for (c, dim) in term.chars().zip(d) {
                        let e = size.entry(c).or_insert(dim.clone());
                        if *e == Dim::Fixed(1) {
                            *e = dim.clone();
                        }
                    }
                }
            }
            let dims = rhs.chars().map(|c| size.get(&c).cloned().unwrap_or(Dim::Unknown)).collect();
            Ok(vec![with(dt, Some(dims))])
        }
        Op::Conv(c) => {
            let (Some(xd), Some(wd)) = (dims_of(x), dims_of(ins.get(1).copied().flatten())) else {
                return Ok(vec![with(dt, None)]);
            };
            if xd.len() < 3 || wd.len() != xd.len() {
                return Err(format!(
                    "Conv needs X of rank ≥ 3 and W of the same rank, got [{}] and [{}]",
                    join(xd),
                    join(wd)
                ));
            }
            if let (Some(ci), Some(wc)) = (xd[1].value(), wd[1].value())
                && wc * c.group() != ci
            {
                return Err(format!(
                    "X has {ci} channels, but W [{}] with group {} expects {}",
                    join(wd),
                    c.group(),
                    wc * c.group()
                ));
            }
            let kernel: Vec<i64> = match &c.kernel_shape {
                Some(k) => k.clone(),
                None => {
                    wd[2..].iter().map(|d| d.value().ok_or("W has unknown spatial dims")).collect::<Result<_, _>>()?
                }
            };
            check_window_attrs(xd.len() - 2, c.strides.as_deref(), c.dilations.as_deref(), c.pads.as_deref())?;
            let sp = window_dims(
                &xd[2..],
                &kernel,
                c.strides.as_deref(),
                c.dilations.as_deref(),
                c.pads.as_deref(),
                c.auto_pad(),
                false,
            )?;
            let mut out = vec![xd[0].clone(), wd[0].clone()];
            out.extend(sp);
            Ok(vec![with(dt, Some(out))])
        }
        Op::ConvTranspose(c) => {
            let (Some(xd), Some(wd)) = (dims_of(x), dims_of(ins.get(1).copied().flatten())) else {
                return Ok(vec![with(dt, None)]);
            };
            if xd.len() < 3 || wd.len() != xd.len() {
                return Err("ConvTranspose needs X and W of equal rank ≥ 3".into());
            }
            let mut out = vec![xd[0].clone(), wd[1].value().map_or(Dim::Unknown, |m| Dim::Fixed(m * c.group()))];
            let spatial: Option<Vec<usize>> = xd[2..].iter().map(|d| d.value().map(|v| v as usize)).collect();
            let kernel: Option<Vec<usize>> = match &c.kernel_shape {
                Some(k) => Some(k.iter().map(|&v| v as usize).collect()),
                None => wd[2..].iter().map(|d| d.value().map(|v| v as usize)).collect(),
            };
            match (spatial, kernel) {
                (Some(s), Some(k)) => {
                    let (o, _) = eval::conv_transpose_geometry(c, &s, &k)?;
                    out.extend(o.into_iter().map(|v| Dim::Fixed(v as i64)));
                }
                _ => out.extend(std::iter::repeat_n(Dim::Unknown, xd.len() - 2)),
            }
            Ok(vec![with(dt, Some(out))])
        }
        Op::MaxPool(_) | Op::AveragePool(_) | Op::LpPool(_) => {
            let Some(xd) = dims_of(x) else { return Ok(vec![with(dt, None); n_out]) };
            if xd.len() < 3 {
                return Err(format!("pooling needs rank ≥ 3, got [{}]", join(xd)));
            }
            let a = op.pool_attrs().expect("a pooling op");
            let kernel = a.kernel_shape.ok_or("pooling needs kernel_shape")?;
            check_window_attrs(xd.len() - 2, a.strides, a.dilations, a.pads)?;
            let sp = window_dims(&xd[2..], kernel, a.strides, a.dilations, a.pads, a.auto_pad, a.ceil_mode)?;
            let mut out = vec![xd[0].clone(), xd[1].clone()];
            out.extend(sp);
            let mut res = vec![with(dt, Some(out.clone()))];
            if n_out > 1 {
                res.push(Some(TensorType::new(DType::Int64, out)));
            }
            Ok(res)
        }
        Op::GlobalAveragePool(_) | Op::GlobalMaxPool(_) | Op::GlobalLpPool(_) => {
            let Some(xd) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            if xd.len() < 3 {
                return Err(format!("global pooling needs rank ≥ 3, got [{}]", join(xd)));
            }
            let mut out = vec![xd[0].clone(), xd[1].clone()];
            out.extend(std::iter::repeat_n(Dim::Fixed(1), xd.len() - 2));
            Ok(vec![with(dt, Some(out))])
        }
        Op::BatchNormalization(_) => {
            let c = dims_of(x).and_then(|d| d.get(1).cloned()).unwrap_or(Dim::Unknown);
            let mut out = vec![x.cloned()];
            for _ in 1..n_out {
                out.push(with(dt, Some(vec![c.clone()])));
            }
            Ok(out)
        }
        Op::LayerNormalization(l) => {
            let mut out = vec![x.cloned()];
            if n_out > 1 {
                let stat = dims_of(x)
                    .map(|d| -> Result<Vec<Dim>, String> {
                        let a = norm_axis(l.axis(), d.len())?;
                        Ok((0..d.len()).map(|i| if i < a { d[i].clone() } else { Dim::Fixed(1) }).collect())
                    })
                    .transpose()?;
                for _ in 1..n_out {
                    out.push(Some(TensorType { dtype: DType::Float, dims: stat.clone() }));
                }
            }
            Ok(out)
        }
        Op::InstanceNormalization(_)
        | Op::GroupNormalization(_)
        | Op::LRN(_)
        | Op::LpNormalization(_)
        | Op::MeanVarianceNormalization(_) => same(x),
        Op::Softmax(_) | Op::LogSoftmax(_) | Op::Hardmax(_) => same(x),
        Op::ArgMax(_) | Op::ArgMin(_) => {
            let (axis, keepdims, _) = op.arg_attrs().expect("arg op");
            let dims = dims_of(x)
                .map(|d| -> Result<Vec<Dim>, String> {
                    let ax = norm_axis(axis, d.len())?;
                    let mut o = d.clone();
                    if keepdims {
                        o[ax] = Dim::Fixed(1);
                    } else {
                        o.remove(ax);
                    }
                    Ok(o)
                })
                .transpose()?;
            Ok(vec![Some(TensorType { dtype: DType::Int64, dims })])
        }
        _ if op.class() == OpClass::Reduce => {
            let r = op.reduce_attrs().expect("reduce op");
            let (attr_axes, keep, noop) = (r.axes, r.keepdims, r.noop_with_empty_axes);
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let axes = if ins.get(1).copied().flatten().is_some() || consts.get(1).copied().flatten().is_some() {
                match ints_input(consts, 1) {
                    Some(a) => a,
                    None => {
                        // Axes unknown: the rank is known only with keepdims.
                        return Ok(vec![with(dt, keep.then(|| vec![Dim::Unknown; d.len()]))]);
                    }
                }
            } else {
                attr_axes.unwrap_or_default()
            };
            if axes.is_empty() && noop {
                return same(x);
            }
            let axes: Vec<usize> = if axes.is_empty() {
                (0..d.len()).collect()
            } else {
                axes.iter().map(|&a| norm_axis(a, d.len())).collect::<Result<_, _>>()?
            };
            let out = if keep {
                d.iter().enumerate().map(|(i, v)| if axes.contains(&i) { Dim::Fixed(1) } else { v.clone() }).collect()
            } else {
                d.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, v)| v.clone()).collect()
            };
            Ok(vec![with(dt, Some(out))])
        }
        Op::Reshape(r) => {
            let Some(spec) = shape_operand(consts.get(1).copied().flatten(), syms.get(1).copied().flatten()) else {
                // Rank is known from the shape operand's length.
                let rank = dims_of(ins.get(1).copied().flatten()).and_then(|d| d.first()).and_then(Dim::value);
                return Ok(vec![with(dt, rank.map(|r| vec![Dim::Unknown; r as usize]))]);
            };
            let input = dims_of(x);
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
                    Dim::Fixed(0) if r.allowzero() == 0 => out.push(
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
                    let rest: Vec<Dim> =
                        out.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, v)| v.clone()).collect();
                    out[i] = prod_div(&total, &prod(&rest));
                } else {
                    let p = prod(&out);
                    if !total.unknown && !p.unknown && total.syms == p.syms && total.coef != p.coef {
                        return Err(format!(
                            "cannot reshape [{}] ({} elements) to [{}]",
                            join(d),
                            total.coef,
                            join(&out)
                        ));
                    }
                }
            }
            Ok(vec![with(dt, Some(out))])
        }
        Op::Flatten(f) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, Some(vec![Dim::Unknown, Dim::Unknown]))]) };
            let a = if f.axis() < 0 { f.axis() + d.len() as i64 } else { f.axis() };
            if a < 0 || a > d.len() as i64 {
                return Err(format!("axis {} is out of range for rank {}", f.axis(), d.len()));
            }
            let a = a as usize;
            Ok(vec![with(dt, Some(vec![prod_dim(&prod(&d[..a])), prod_dim(&prod(&d[a..]))]))])
        }
        Op::Transpose(t) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let perm: Vec<usize> = match &t.perm {
                Some(p) => {
                    if p.len() != d.len() {
                        return Err(format!("perm {p:?} does not fit rank {}", d.len()));
                    }
                    p.iter().map(|&v| norm_axis(v, d.len())).collect::<Result<_, _>>()?
                }
                None => (0..d.len()).rev().collect(),
            };
            Ok(vec![with(dt, Some(perm.iter().map(|&p| d[p].clone()).collect()))])
        }
        Op::Squeeze(s) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let axes = if ins.len() > 1 && ins.get(1).copied().flatten().is_some() {
                Some(ints_input(consts, 1).ok_or("")).transpose().ok().flatten()
            } else {
                s.axes.clone()
            };
            let out = match axes {
                Some(axes) => {
                    let axes: Vec<usize> = axes.iter().map(|&a| norm_axis(a, d.len())).collect::<Result<_, _>>()?;
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
                    if ins.len() > 1 && ins.get(1).copied().flatten().is_some() {
                        return Ok(vec![with(dt, None)]);
                    }
                    if d.iter().any(|v| !v.is_known()) {
                        return Ok(vec![with(dt, None)]);
                    }
                    d.iter().filter(|v| **v != Dim::Fixed(1)).cloned().collect()
                }
            };
            Ok(vec![with(dt, Some(out))])
        }
        Op::Unsqueeze(u) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let axes = if ins.len() > 1 { ints_input(consts, 1) } else { u.axes.clone() };
            let Some(axes) = axes else { return Ok(vec![with(dt, None)]) };
            let r = d.len() + axes.len();
            let mut axes: Vec<usize> = axes.iter().map(|&a| norm_axis(a, r)).collect::<Result<_, _>>()?;
            axes.sort();
            let mut out = d.clone();
            for a in axes {
                out.insert(a, Dim::Fixed(1));
            }
            Ok(vec![with(dt, Some(out))])
        }
        Op::Concat(c) => {
            let ax = c.axis.ok_or("Concat needs `axis`")?;
            let all: Vec<&Vec<Dim>> = ins.iter().filter_map(|t| dims_of(*t)).collect();
            if all.len() != ins.len() || all.is_empty() {
                return Ok(vec![with(dt, None)]);
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
            Ok(vec![with(dt, Some(out))])
        }
        Op::Split(s) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None); n_out]) };
            let a = norm_axis(s.axis(), d.len())?;
            let sizes: Option<Vec<i64>> = if ins.len() > 1 && ins.get(1).copied().flatten().is_some() {
                ints_input(consts, 1)
            } else if let Some(sp) = &s.split {
                Some(sp.clone())
            } else {
                d[a].value().map(|total| {
                    let parts = s.num_outputs.unwrap_or(n_out as i64).max(1);
                    let chunk = (total + parts - 1) / parts;
                    (0..parts).map(|i| chunk.min((total - i * chunk).max(0))).collect()
                })
            };
            let Some(sizes) = sizes else {
                return Ok(vec![
                    with(
                        dt,
                        Some(
                            d.iter().enumerate().map(|(i, v)| if i == a { Dim::Unknown } else { v.clone() }).collect()
                        )
                    );
                    n_out
                ]);
            };
            if sizes.len() != n_out {
                return Err(format!("{} split sizes for {n_out} outputs", sizes.len()));
            }
            if let Some(total) = d[a].value()
                && sizes.iter().sum::<i64>() != total
            {
                return Err(format!("split sizes {sizes:?} do not add up to {total}"));
            }
            Ok(sizes
                .iter()
                .map(|&sz| {
                    with(
                        dt,
                        Some(
                            d.iter()
                                .enumerate()
                                .map(|(i, v)| if i == a { Dim::Fixed(sz) } else { v.clone() })
                                .collect(),
                        ),
                    )
                })
                .collect())
        }
        Op::Slice(s) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let legacy = ins.len() == 1 && s.starts.is_some();
            let (starts, ends, axes, steps) = if legacy {
                (s.starts.clone(), s.ends.clone(), s.axes.clone(), None)
            } else {
                (
                    ints_input(consts, 1),
                    ints_input(consts, 2),
                    if ins.len() > 3 && ins[3].is_some() {
                        ints_input(consts, 3).map(Some).unwrap_or(None)
                    } else {
                        None
                    },
                    if ins.len() > 4 && ins[4].is_some() { ints_input(consts, 4) } else { None },
                )
            };
            let axes_unknown = !legacy && ins.len() > 3 && ins[3].is_some() && axes.is_none();
            let (Some(starts), Some(ends)) = (starts, ends) else {
                return Ok(vec![with(dt, Some(vec![Dim::Unknown; d.len()]))]);
            };
            if axes_unknown {
                return Ok(vec![with(dt, Some(vec![Dim::Unknown; d.len()]))]);
            }
            if starts.len() != ends.len() {
                return Err("starts and ends differ in length".into());
            }
            let axes: Vec<usize> = match axes {
                Some(a) => a.iter().map(|&v| norm_axis(v, d.len())).collect::<Result<_, _>>()?,
                None => (0..starts.len()).collect(),
            };
            let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
            let mut out = d.clone();
            for (k, &a) in axes.iter().enumerate() {
                if steps[k] == 0 {
                    return Err("slice step 0".into());
                }
                out[a] = match d[a].value() {
                    Some(dim) => Dim::Fixed(eval::slice_params(dim, starts[k], ends[k], steps[k]).2 as i64),
                    None if starts[k] == 0 && steps[k] == 1 && ends[k] >= i32::MAX as i64 => d[a].clone(),
                    None => Dim::Unknown,
                };
            }
            Ok(vec![with(dt, Some(out))])
        }
        Op::Gather(gt) => {
            let (Some(d), Some(i)) = (dims_of(x), dims_of(ins.get(1).copied().flatten())) else {
                return Ok(vec![with(dt, None)]);
            };
            let a = norm_axis(gt.axis(), d.len())?;
            let mut out = d[..a].to_vec();
            out.extend(i.iter().cloned());
            out.extend(d[a + 1..].iter().cloned());
            Ok(vec![with(dt, Some(out))])
        }
        Op::GatherElements(_) => Ok(vec![with(dt, dims_of(ins.get(1).copied().flatten()).cloned())]),
        Op::GatherND(gn) => {
            let (Some(d), Some(i)) = (dims_of(x), dims_of(ins.get(1).copied().flatten())) else {
                return Ok(vec![with(dt, None)]);
            };
            let Some(k) = i.last().and_then(Dim::value) else { return Ok(vec![with(dt, None)]) };
            let b = gn.batch_dims() as usize;
            let mut out = i[..i.len() - 1].to_vec();
            out.extend(d.iter().skip(b + k as usize).cloned());
            Ok(vec![with(dt, Some(out))])
        }
        Op::ScatterND(_) | Op::ScatterElements(_) => same(x),
        Op::Expand(_) => {
            let Some(target) = shape_operand(consts.get(1).copied().flatten(), syms.get(1).copied().flatten()) else {
                return Ok(vec![with(dt, None)]);
            };
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            Ok(vec![with(dt, Some(bcast_shapes(d, &target)?))])
        }
        Op::Tile(_) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let Some(rep) = ints_input(consts, 1) else { return Ok(vec![with(dt, Some(vec![Dim::Unknown; d.len()]))]) };
            if rep.len() != d.len() {
                return Err(format!("repeats {rep:?} do not fit rank {}", d.len()));
            }
            Ok(vec![with(
                dt,
                Some(
                    d.iter()
                        .zip(&rep)
                        .map(
                            |(v, &r)| {
                                if r == 1 { v.clone() } else { v.value().map_or(Dim::Unknown, |v| Dim::Fixed(v * r)) }
                            },
                        )
                        .collect(),
                ),
            )])
        }
        Op::Pad(p) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let pads = if ins.len() > 1 && ins[1].is_some() { ints_input(consts, 1) } else { p.pads.clone() };
            let Some(pads) = pads else { return Ok(vec![with(dt, Some(vec![Dim::Unknown; d.len()]))]) };
            let r = d.len();
            let axes: Vec<usize> = match ints_input(consts, 3) {
                Some(a) => a.iter().map(|&v| norm_axis(v, r)).collect::<Result<_, _>>()?,
                None if ins.len() > 3 && ins[3].is_some() => return Ok(vec![with(dt, Some(vec![Dim::Unknown; r]))]),
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
            Ok(vec![with(dt, Some(out))])
        }
        Op::Resize(r) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let (scales, sizes) = if ins.len() == 2 {
                (consts.get(1).copied().flatten().and_then(|a| a.to_f64().ok()), None)
            } else {
                (consts.get(2).copied().flatten().and_then(|a| a.to_f64().ok()), ints_input(consts, 3))
            };
            let static_in: Option<Vec<usize>> = d.iter().map(|v| v.value().map(|v| v as usize)).collect();
            match static_in {
                Some(si)
                    if scales.as_ref().is_some_and(|s| !s.is_empty())
                        || sizes.as_ref().is_some_and(|s| !s.is_empty()) =>
                {
                    let (o, _) = eval::resize_sizes(r, &si, scales.as_deref(), sizes.as_deref())?;
                    Ok(vec![with(dt, Some(o.iter().map(|&v| Dim::Fixed(v as i64)).collect()))])
                }
                _ => Ok(vec![with(dt, Some(vec![Dim::Unknown; d.len()]))]),
            }
        }
        Op::Upsample(u) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let scales: Option<Vec<f64>> = match consts.get(1).copied().flatten() {
                Some(a) => a.to_f64().ok(),
                None => u.scales.as_ref().map(|s| s.iter().map(|&v| f64::from(v)).collect()),
            };
            let Some(scales) = scales else { return Ok(vec![with(dt, Some(vec![Dim::Unknown; d.len()]))]) };
            Ok(vec![with(
                dt,
                Some(
                    d.iter()
                        .zip(&scales)
                        .map(|(v, &s)| v.value().map_or(Dim::Unknown, |v| Dim::Fixed((v as f64 * s).floor() as i64)))
                        .collect(),
                ),
            )])
        }
        Op::DepthToSpace(ds) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let b = ds.blocksize.ok_or("DepthToSpace needs blocksize")?;
            if d.len() != 4 {
                return Err("DepthToSpace needs rank 4".into());
            }
            let f = |v: &Dim, k: i64, mul: bool| {
                v.value().map_or(Dim::Unknown, |v| Dim::Fixed(if mul { v * k } else { v / k }))
            };
            Ok(vec![with(dt, Some(vec![d[0].clone(), f(&d[1], b * b, false), f(&d[2], b, true), f(&d[3], b, true)]))])
        }
        Op::SpaceToDepth(sd) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let b = sd.blocksize.ok_or("SpaceToDepth needs blocksize")?;
            if d.len() != 4 {
                return Err("SpaceToDepth needs rank 4".into());
            }
            let f = |v: &Dim, k: i64, mul: bool| {
                v.value().map_or(Dim::Unknown, |v| Dim::Fixed(if mul { v * k } else { v / k }))
            };
            Ok(vec![with(dt, Some(vec![d[0].clone(), f(&d[1], b * b, true), f(&d[2], b, false), f(&d[3], b, false)]))])
        }
        Op::Shape(s) => {
            let len = dims_of(x).map(|d| {
                let r = d.len() as i64;
                let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r);
                (clampi(s.end.unwrap_or(r)) - clampi(s.start())).max(0)
            });
            Ok(vec![Some(TensorType::new(DType::Int64, vec![len.map_or(Dim::Unknown, Dim::Fixed)]))])
        }
        Op::Size(_) => Ok(vec![Some(TensorType::scalar(DType::Int64))]),
        Op::ConstantOfShape(c) => {
            let dtype = c.value.as_ref().map_or(DType::Float, |t| t.dtype);
            let dims =
                shape_operand(consts.first().copied().flatten(), syms.first().copied().flatten()).or_else(|| {
                    dims_of(x).and_then(|d| d.first()).and_then(Dim::value).map(|r| vec![Dim::Unknown; r as usize])
                });
            Ok(vec![Some(TensorType { dtype, dims })])
        }
        Op::Range(_) => Ok(vec![with(dt, Some(vec![Dim::Unknown]))]),
        Op::Trilu(_) | Op::CumSum(_) => same(x),
        Op::TopK(t) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None), Some(TensorType::unranked(DType::Int64))]) };
            let a = norm_axis(t.axis(), d.len())?;
            let k = if ins.len() > 1 { ints_input(consts, 1).map(|v| v[0]) } else { t.k };
            let mut out = d.clone();
            out[a] = k.map_or(Dim::Unknown, Dim::Fixed);
            Ok(vec![with(dt, Some(out.clone())), Some(TensorType::new(DType::Int64, out))])
        }
        Op::NonZero(_) => Ok(vec![Some(TensorType::new(
            DType::Int64,
            vec![dims_of(x).map_or(Dim::Unknown, |d| Dim::Fixed(d.len() as i64)), Dim::Unknown],
        ))]),
        Op::OneHot(o) => {
            let Some(d) = dims_of(x) else {
                return Ok(vec![with(ins.get(2).copied().flatten().map(|t| t.dtype), None)]);
            };
            let depth = consts
                .get(1)
                .copied()
                .flatten()
                .and_then(|a| a.to_f64().ok())
                .map(|v| Dim::Fixed(v[0] as i64))
                .unwrap_or(Dim::Unknown);
            let a = norm_axis(o.axis(), d.len() + 1)?;
            let mut out = d.clone();
            out.insert(a, depth);
            Ok(vec![with(ins.get(2).copied().flatten().map(|t| t.dtype), Some(out))])
        }
        Op::EyeLike(e) => Ok(vec![with(e.dtype.and_then(DType::from_code).or(dt), x.and_then(|t| t.dims.clone()))]),
        Op::LSTM(_) | Op::GRU(_) | Op::RNN(_) => {
            let (hidden, dirs, layout) = match op {
                Op::LSTM(l) => (l.hidden_size, if l.direction() == "bidirectional" { 2 } else { 1 }, l.layout()),
                Op::GRU(l) => (l.hidden_size, if l.direction() == "bidirectional" { 2 } else { 1 }, l.layout()),
                Op::RNN(l) => (l.hidden_size, if l.direction() == "bidirectional" { 2 } else { 1 }, l.layout()),
                _ => unreachable!(),
            };
            let h = hidden.map_or(Dim::Unknown, Dim::Fixed);
            let dirs = Dim::Fixed(dirs);
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None); n_out]) };
            if d.len() != 3 {
                return Err(format!("X must be rank 3, got [{}]", join(d)));
            }
            let (seq, batch) = if layout == 0 { (d[0].clone(), d[1].clone()) } else { (d[1].clone(), d[0].clone()) };
            let y = if layout == 0 {
                vec![seq, dirs.clone(), batch.clone(), h.clone()]
            } else {
                vec![batch.clone(), seq, dirs.clone(), h.clone()]
            };
            let st = if layout == 0 { vec![dirs, batch, h] } else { vec![batch, dirs, h] };
            let mut out = vec![with(dt, Some(y))];
            for _ in 1..n_out {
                out.push(with(dt, Some(st.clone())));
            }
            Ok(out)
        }
        Op::AllReduce(_) => same(x),
        Op::AllGather(a) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let ax = norm_axis(a.axis.unwrap_or(0), d.len())?;
            let p = a.group.as_ref().map_or(1, |g| g.len() as i64);
            let mut out = d.clone();
            out[ax] = d[ax].value().map_or(Dim::Unknown, |v| Dim::Fixed(v * p));
            Ok(vec![with(dt, Some(out))])
        }
        Op::ReduceScatter(a) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let ax = norm_axis(a.axis.unwrap_or(0), d.len())?;
            let p = a.group.as_ref().map_or(1, |g| g.len() as i64).max(1);
            let mut out = d.clone();
            out[ax] = match d[ax].value() {
                Some(v) if v % p == 0 => Dim::Fixed(v / p),
                Some(v) => return Err(format!("dim {v} does not split into {p} parts")),
                None => Dim::Unknown,
            };
            Ok(vec![with(dt, Some(out))])
        }
        Op::AllToAll(a) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let p = a.group.as_ref().map_or(1, |g| g.len() as i64).max(1);
            let (s, c) =
                (norm_axis(a.split_axis.unwrap_or(0), d.len())?, norm_axis(a.concat_axis.unwrap_or(0), d.len())?);
            let mut out = d.clone();
            out[s] = d[s].value().map_or(Dim::Unknown, |v| Dim::Fixed(v / p));
            out[c] = out[c].value().map_or(Dim::Unknown, |v| Dim::Fixed(v * p));
            Ok(vec![with(dt, Some(out))])
        }
        Op::HaloExchange(h) => {
            let Some(d) = dims_of(x) else { return Ok(vec![with(dt, None)]) };
            let ax = norm_axis(h.axis.unwrap_or(0), d.len())?;
            let w = h.widths.clone().unwrap_or_default();
            let mut out = d.clone();
            // `widths` = [from_prev, from_next, to_prev, to_next]: the output grows by what
            // comes in.
            let grow: i64 = w.iter().take(2).sum();
            out[ax] = d[ax].value().map_or(Dim::Unknown, |v| Dim::Fixed(v + grow));
            Ok(vec![with(dt, Some(out))])
        }
        Op::Recv(r) => Ok(vec![Some(TensorType::fixed(
            r.dtype.and_then(DType::from_code).unwrap_or(DType::Float),
            r.shape.as_deref().unwrap_or(&[]),
        ))]),
        Op::Send(_) => Ok(vec![]),
        _ => Ok(vec![None; n_out]),
    }
}

/// True when any attribute of the op holds a subgraph.
pub fn has_subgraph(op: &Op) -> bool {
    op.attributes().iter().any(|a| matches!(a.value, AttrValue::Graph(_) | AttrValue::Graphs(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbolic_reshape_divides_out_the_batch() {
        let input = vec![Dim::Sym("N".into()), Dim::Fixed(3), Dim::Fixed(4)];
        let total = prod(&input);
        assert_eq!(prod_div(&total, &prod(&[Dim::Fixed(12)])), Dim::Sym("N".into()));
        assert_eq!(prod_div(&total, &prod(&[Dim::Sym("N".into())])), Dim::Fixed(12));
        assert_eq!(prod_div(&total, &prod(&[Dim::Fixed(5)])), Dim::Unknown);
    }

    #[test]
    fn broadcasting_rules() {
        let a = vec![Dim::Fixed(2), Dim::Fixed(1), Dim::Sym("s".into())];
        let b = vec![Dim::Fixed(3), Dim::Sym("s".into())];
        assert_eq!(bcast_shapes(&a, &b).unwrap(), vec![Dim::Fixed(2), Dim::Fixed(3), Dim::Sym("s".into())]);
        assert!(bcast_shapes(&[Dim::Fixed(2)], &[Dim::Fixed(3)]).is_err());
    }

    #[test]
    fn merge_detects_contradictions() {
        let decl = Type::Tensor(TensorType::fixed(DType::Float, &[1, 64]));
        assert!(merge(Some(&decl), Some(TensorType::fixed(DType::Float, &[1, 32]))).is_err());
        let sym = Type::Tensor(TensorType::new(DType::Float, vec![Dim::Sym("N".into()), Dim::Fixed(64)]));
        let m = merge(Some(&sym), Some(TensorType::new(DType::Float, vec![Dim::Unknown, Dim::Fixed(64)]))).unwrap();
        assert_eq!(m.unwrap().to_string(), "float[N,64]");
    }
}
