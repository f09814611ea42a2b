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

use crate::eval::{self, Array};
use crate::graph::attr::AttrValue;
use crate::graph::op::Op;
use crate::graph::{Graph, NodeId, Span, Value};
use crate::types::{DType, Dim, TensorType, Type};

pub use crate::ops::{infer_op, infer_op_asking};

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
    /// Values whose constant value an op's inference asked for and did not have (shape
    /// parameters computed at run time, or given as graph inputs), in the order asked.
    pub params: Vec<Value>,
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
        params: Vec::new(),
        consts: HashMap::new(),
        syms: HashMap::new(),
        errors: Vec::new(),
        warnings: Vec::new(),
        unknown: Vec::new(),
    };
    cx.graph(g, mode, &HashMap::new());
    if cx.errors.is_empty() {
        Ok(InferReport { consts: cx.consts, unknown: cx.unknown, warnings: cx.warnings, params: cx.params })
    } else {
        Err(cx.errors)
    }
}

struct Infer {
    params: Vec<Value>,
    consts: HashMap<Value, Array>,
    syms: HashMap<Value, Vec<Dim>>,
    errors: Vec<ShapeError>,
    warnings: Vec<ShapeError>,
    unknown: Vec<NodeId>,
}

fn tensor(t: Option<&Type>) -> Option<&TensorType> {
    t.and_then(Type::as_tensor)
}

/// Dims from a shape-valued input: constant or symbolic.
fn shape_operand(c: Option<&Array>, s: Option<&Vec<Dim>>) -> Option<Vec<Dim>> {
    if let Some(a) = c {
        return a.to_i64().ok().map(|v| v.into_iter().map(Dim::Fixed).collect());
    }
    s.cloned()
}

/// The error for a value whose size overflows 64 bits: every size and FLOP count is
/// computed in 64 bits, so such a shape is refused where it first appears.
fn too_large(g: &Graph, v: Value, t: &TensorType) -> ShapeError {
    let elems: f64 = t.static_dims().unwrap_or_default().iter().map(|&d| d as f64).product();
    ShapeError {
        node: Some(v.node),
        span: g.span(v.node),
        msg: format!(
            "`{}` would be {t}: {elems:.3e} elements ({:.3e} bytes), more than 64-bit sizes can count; \
             reduce --batch or --input-shape",
            g.value_name(v),
            elems * t.dtype.size_bytes() as f64
        ),
    }
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
                    if let Some(t) = tensor(g.value_type(Value::new(n, 0))).filter(|t| t.too_large()) {
                        self.errors.push(too_large(g, Value::new(n, 0), t));
                        continue;
                    }
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
                inferred.clone().map(Type::Tensor).or(o.ty.clone())
            } else {
                match merge(o.ty.as_ref(), inferred.clone()) {
                    Ok(t) => t,
                    Err(e) => {
                        self.warnings.push(ShapeError {
                            node: Some(o.value.node),
                            span: g.span(o.value.node),
                            msg: format!("graph output `{}` is {e}; using the inferred type", g.value_name(o.value)),
                        });
                        inferred.clone().map(Type::Tensor)
                    }
                }
            };
            // A declaration more precise than inference (a loop's stacked length, a shape
            // computed at run time) types the operator output too.
            if mode == Mode::Check
                && !matches!(g.node(o.value.node).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef)
                && let (Some(Type::Tensor(decl)), Some(inf)) = (&ty, &inferred)
                && decl.is_static()
                && !inf.is_static()
            {
                g.set_type(o.value, ty.clone());
            }
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
        // A value too large to count is reported where it first appears, not again at
        // every op downstream.
        if ins.iter().flatten().any(TensorType::too_large) {
            return;
        }

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
                (Op::Size(_), Some(d)) => {
                    d.iter().try_fold(1i64, |a, &x| a.checked_mul(x)).map(|n| vec![Array::scalar_i64(n)])
                }
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
                let (r, missing) = infer_op_asking(&node.op, &ins_ref, &consts, &syms, n_out, g.opset);
                for (i, v) in node.inputs().iter().enumerate().take(64) {
                    if missing & (1 << i) != 0
                        && let Some(v) = v
                        && !self.params.contains(v)
                    {
                        self.params.push(*v);
                    }
                }
                r
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
                    if let Some(t) = t.as_ref().filter(|t| t.too_large()) {
                        self.errors.push(too_large(g, v, t));
                        continue;
                    }
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

    /// Infers a subgraph in a scope of its own: its node ids are its own, so what is known
    /// about this graph's values does not leak into it by id; the constants it reads from the
    /// enclosing graph are passed by name.
    fn subgraph(
        &mut self,
        b: &mut Graph,
        mode: Mode,
        outer: &HashMap<String, Type>,
        outer_consts: &HashMap<String, Array>,
    ) {
        let consts = std::mem::take(&mut self.consts);
        let syms = std::mem::take(&mut self.syms);
        let params = std::mem::take(&mut self.params);
        let unknown = std::mem::take(&mut self.unknown);
        for n in b.node_ids().collect::<Vec<_>>() {
            if matches!(b.node(n).op, Op::OuterRef)
                && let Some(a) = outer_consts.get(&b.node(n).outputs()[0].name)
            {
                self.consts.insert(Value::new(n, 0), a.clone());
            }
        }
        self.graph(b, mode, outer);
        self.consts = consts;
        self.syms = syms;
        self.params = params;
        self.unknown = unknown;
    }

    fn control(&mut self, g: &mut Graph, n: NodeId, mode: Mode, ins: &[Option<TensorType>]) {
        // Types of every value the subgraphs may read from this graph.
        let mut outer: HashMap<String, Type> = HashMap::new();
        for &c in g.node(n).captures() {
            if let Some(t) = g.value_type(c) {
                outer.insert(g.value_name(c).to_string(), t.clone());
            }
        }
        // Values of this graph the subgraphs read, when they are constants.
        let outer_consts: HashMap<String, Array> = g
            .node(n)
            .captures()
            .iter()
            .filter_map(|c| self.consts.get(c).map(|a| (g.value_name(*c).to_string(), a.clone())))
            .collect();
        let mut op = g.node(n).op.clone();
        let mut out_types: Vec<Option<TensorType>> = vec![None; g.node(n).num_outputs()];
        match &mut op {
            Op::If(i) => {
                // A known condition decides the branch: its types are the If's.
                let cond = g
                    .node(n)
                    .input(0)
                    .and_then(|v| self.consts.get(&v))
                    .and_then(|a| a.to_f64().ok())
                    .and_then(|v| v.first().copied());
                let mut branch_types = Vec::new();
                let branches: Vec<(&str, &mut Box<Graph>)> = match cond {
                    Some(c) if c != 0.0 => i.then_branch.iter_mut().map(|b| ("then", b)).collect(),
                    Some(_) => i.else_branch.iter_mut().map(|b| ("else", b)).collect(),
                    None => {
                        // The branch depends on a value: a given input of it is a parameter
                        // of the shapes, as a Reshape's shape is.
                        if let Some(c) = g.node(n).input(0)
                            && !self.params.contains(&c)
                        {
                            self.params.push(c);
                        }
                        [("then", &mut i.then_branch), ("else", &mut i.else_branch)]
                            .into_iter()
                            .filter_map(|(k, b)| b.as_mut().map(|b| (k, b)))
                            .collect()
                    }
                };
                let both = branches.len() > 1;
                let mut failed: Vec<(&str, Vec<ShapeError>)> = Vec::new();
                for (which, b) in branches {
                    let before = self.errors.len();
                    self.subgraph(b, mode, &outer, &outer_consts);
                    if both && self.errors.len() > before {
                        // A branch that does not check at these shapes cannot be the one
                        // taken (onnxruntime checks only the branch it runs): the other
                        // branch's types are the If's; running it here fails, clearly.
                        failed.push((which, self.errors.split_off(before)));
                        continue;
                    }
                    branch_types.push(
                        b.outputs()
                            .iter()
                            .map(|o| o.ty.as_ref().and_then(Type::as_tensor).cloned())
                            .collect::<Vec<_>>(),
                    );
                }
                if branch_types.is_empty() {
                    // Neither branch checks: both errors stand.
                    self.errors.extend(failed.into_iter().flat_map(|(_, e)| e));
                } else {
                    for (which, errors) in failed {
                        let first = errors.first().map(|e| e.msg.clone()).unwrap_or_default();
                        self.warnings.push(ShapeError {
                            node: Some(n),
                            span: g.span(n),
                            msg: format!(
                                "{}: the {which} branch does not check at these shapes ({first}); it is assumed not taken",
                                g.describe(n)
                            ),
                        });
                    }
                }
                join_branch_types(&branch_types, &mut out_types);
            }
            Op::Loop(l) => {
                if let Some(body) = &mut l.body {
                    self.loop_types(body, ins, mode, (&outer, &outer_consts), &mut out_types);
                }
            }
            Op::Scan(sc) if g.opset > 0 && g.opset < 9 => {
                // Scan-8: `sequence_lens` first, then inputs with a leading batch dim; the
                // scan axis is the one after it.
                if let Some(body) = &mut sc.body {
                    let ins = ins.get(1..).unwrap_or_default();
                    let m = sc.num_scan_inputs.unwrap_or(0).max(0) as usize;
                    let n_state = ins.len().saturating_sub(m);
                    let (mut batch, mut seq) = (Dim::Unknown, Dim::Unknown);
                    let names: Vec<Value> = body.inputs().iter().map(|&b| Value::new(b, 0)).collect();
                    for (k, v) in names.into_iter().enumerate() {
                        let t = ins.get(k).cloned().flatten().map(|t| {
                            let drop = if k < n_state { 1 } else { 2 };
                            let dims = t.dims.map(|d| {
                                if let Some(b) = d.first() {
                                    batch = b.clone();
                                }
                                if k == n_state
                                    && let Some(q) = d.get(1)
                                {
                                    seq = q.clone();
                                }
                                d.into_iter().skip(drop).collect()
                            });
                            TensorType { dtype: t.dtype, dims }
                        });
                        if body.value_type(v).is_none() {
                            body.set_type(v, t.map(Type::Tensor));
                        }
                    }
                    self.subgraph(body, mode, &outer, &outer_consts);
                    for (k, o) in body.outputs().iter().enumerate().take(out_types.len()) {
                        out_types[k] = o.ty.as_ref().and_then(Type::as_tensor).cloned().map(|t| {
                            let lead = if k < n_state { vec![batch.clone()] } else { vec![batch.clone(), seq.clone()] };
                            TensorType { dtype: t.dtype, dims: t.dims.map(|d| lead.into_iter().chain(d).collect()) }
                        });
                    }
                }
            }
            Op::Scan(sc) => {
                if let Some(body) = &mut sc.body {
                    let m = sc.num_scan_inputs.unwrap_or(0).max(0) as usize;
                    let n_state = ins.len().saturating_sub(m);
                    let attr = |v: &Option<Vec<i64>>, k: usize| v.as_ref().and_then(|v| v.get(k).copied()).unwrap_or(0);
                    let mut seq = Dim::Unknown;
                    let names: Vec<(Value, usize)> =
                        body.inputs().iter().enumerate().map(|(k, &b)| (Value::new(b, 0), k)).collect();
                    for (v, k) in names {
                        let t = ins.get(k).cloned().flatten().map(|t| {
                            if k < n_state {
                                return t;
                            }
                            // A scan input loses its scan axis inside the body.
                            let dims = t.dims.map(|mut d| {
                                let r = d.len() as i64;
                                let a = attr(&sc.scan_input_axes, k - n_state);
                                let a = if a < 0 { a + r } else { a };
                                if (0..r).contains(&a) {
                                    let dim = d.remove(a as usize);
                                    if k == n_state {
                                        seq = dim;
                                    }
                                }
                                d
                            });
                            TensorType { dtype: t.dtype, dims }
                        });
                        if body.value_type(v).is_none() {
                            body.set_type(v, t.map(Type::Tensor));
                        }
                    }
                    self.subgraph(body, mode, &outer, &outer_consts);
                    for (k, o) in body.outputs().iter().enumerate() {
                        let t = o.ty.as_ref().and_then(Type::as_tensor).cloned();
                        if k >= out_types.len() {
                            break;
                        }
                        out_types[k] = if k < n_state {
                            t
                        } else {
                            t.map(|t| {
                                let dims = t.dims.map(|mut d| {
                                    let r = d.len() as i64 + 1;
                                    let a = attr(&sc.scan_output_axes, k - n_state);
                                    let a = (if a < 0 { a + r } else { a }).clamp(0, r - 1) as usize;
                                    d.insert(a, seq.clone());
                                    d
                                });
                                TensorType { dtype: t.dtype, dims }
                            })
                        };
                    }
                }
            }
            _ => {}
        }
        g.set_op(n, op);
        self.fold_and_set(g, n, out_types);
    }

    /// A `Loop`'s body typed (the iteration count, the condition and the carried values as
    /// its inputs) and the types it gives the loop's outputs: the carried values as the body
    /// makes them, each scan output with a leading dim of unknown length.
    fn loop_types(
        &mut self,
        body: &mut Graph,
        ins: &[Option<TensorType>],
        mode: Mode,
        (outer, outer_consts): (&HashMap<String, Type>, &HashMap<String, Array>),
        out_types: &mut [Option<TensorType>],
    ) {
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
        self.subgraph(body, mode, outer, outer_consts);
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

    /// After a control-flow op's subgraphs are typed: the values deciding what runs (a
    /// condition, a trip count) become shape parameters, the op folds when every input and
    /// captured value is a known constant, and its outputs take `out_types` (merged with what
    /// the graph declares; a disagreement is a warning).
    fn fold_and_set(&mut self, g: &mut Graph, n: NodeId, mut out_types: Vec<Option<TensorType>>) {
        // The values deciding what runs (a condition, a trip count) shape the outputs:
        // ask for them. With every input and captured value known, the op folds.
        let node = g.node(n);
        let deciding: &[usize] = match node.op {
            Op::If(_) => &[0],
            Op::Loop(_) => &[0, 1],
            _ => &[],
        };
        for &i in deciding {
            if let Some(v) = node.input(i)
                && !self.consts.contains_key(&v)
                && !self.params.contains(&v)
            {
                self.params.push(v);
            }
        }
        let ins_c: Vec<Option<&Array>> = node.inputs().iter().map(|i| i.and_then(|v| self.consts.get(&v))).collect();
        let caps_c: Vec<Option<&Array>> = node.captures().iter().map(|v| self.consts.get(v)).collect();
        let all_known = node.inputs().iter().zip(&ins_c).all(|(i, c)| i.is_none() || c.is_some())
            && caps_c.iter().all(Option::is_some)
            && ins_c.iter().chain(&caps_c).flatten().map(|a| a.numel()).sum::<usize>() <= FOLD_LIMIT;
        let folded = if all_known { eval::eval_node(g, n, &ins_c, &caps_c).ok() } else { None };
        let folded =
            folded.filter(|outs| outs.len() == out_types.len() && outs.iter().all(|a| a.numel() <= FOLD_LIMIT));
        if let Some(arrays) = &folded {
            for (slot, a) in arrays.iter().enumerate() {
                let dims: Vec<i64> = a.shape.iter().map(|&d| d as i64).collect();
                out_types[slot] = Some(TensorType::fixed(a.dtype, &dims));
            }
        }
        if let Some(arrays) = folded {
            for (slot, a) in arrays.into_iter().enumerate() {
                self.consts.insert(Value::new(n, slot as u16), a);
            }
        }
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

/// The types an `If` gives its outputs from the types of the branches that check: the first
/// branch's, with each dim the branches disagree on unknown and a type they disagree on in
/// element type or rank unknown.
fn join_branch_types(branch_types: &[Vec<Option<TensorType>>], out_types: &mut [Option<TensorType>]) {
    if let Some(first) = branch_types.first() {
        for (k, t) in first.iter().enumerate().take(out_types.len()) {
            let mut t = t.clone();
            for other in &branch_types[1..] {
                t = match (t, other.get(k).cloned().flatten()) {
                    (Some(a), Some(b)) if a.dtype == b.dtype => {
                        let dims = match (&a.dims, &b.dims) {
                            (Some(x), Some(y)) if x.len() == y.len() => Some(
                                x.iter().zip(y).map(|(p, q)| if p == q { p.clone() } else { Dim::Unknown }).collect(),
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

/// True when any attribute of the op holds a subgraph.
pub fn has_subgraph(op: &Op) -> bool {
    op.attributes().iter().any(|a| matches!(a.value, AttrValue::Graph(_) | AttrValue::Graphs(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_detects_contradictions() {
        let decl = Type::Tensor(TensorType::fixed(DType::Float, &[1, 64]));
        assert!(merge(Some(&decl), Some(TensorType::fixed(DType::Float, &[1, 32]))).is_err());
        let sym = Type::Tensor(TensorType::new(DType::Float, vec![Dim::Sym("N".into()), Dim::Fixed(64)]));
        let m = merge(Some(&sym), Some(TensorType::new(DType::Float, vec![Dim::Unknown, Dim::Fixed(64)]))).unwrap();
        assert_eq!(m.unwrap().to_string(), "float[N,64]");
    }
}
