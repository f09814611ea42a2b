//! `rebatch`: changes the batch size (and, with `--input-shape`, other input dims such as
//! sequence length or resolution) of a model whose export baked them into constants.
//!
//! Exporters write shape operands as literals: a GPT-2 export reshapes to `{1,128,2304}`.
//! Changing an input's dims therefore means finding every constant that carries a changed dim
//! and rewriting it. This pass does that by tracking, for every axis of every value, its size
//! as a *monomial* `coef × Π tᵢ^eᵢ` over the changed input dims `tᵢ` (old value → new value):
//!
//! - forward through the graph, each op's rule gives its outputs' monomials from its inputs'
//!   (reshapes are factored by aligning old sizes; a size-1 batch is matched by position);
//! - where an op combines a tracked axis with a constant axis of the same old size (a causal
//!   mask `[1,1,128,128]` added to scores `[b,h,s,s]`), the constant side must follow: the
//!   requirement travels back through elementwise producers to a literal, which is rewritten
//!   (shape operands, slice bounds) or regenerated (growing: constants that are uniform,
//!   arithmetic progressions such as position ids, or triangular masks along the axis;
//!   shrinking: the prefix of position-indexed data; external data only changes shape);
//! - shape operands (Reshape, Expand, ConstantOfShape, Tile, Range, Slice) get the new values
//!   of the tracked axes they produce;
//! - shapes are inferred afresh and checked against the monomials.
//!
//! Anything that cannot be rewritten with certainty is an error naming the node. Inputs whose
//! changed dims are symbolic (`batch`) need no tracking: they are substituted and inferred.

use std::collections::{BTreeMap, HashMap};

use ir::eval::Array;
use ir::infer::{Mode, infer_shapes};
use ir::ops::Mono;
use ir::{Dim, Graph, NodeId, Op, OpClass, Tensor, TensorData, TensorType, Type, Value};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

const NAME: &str = "rebatch";

/// What to change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RebatchSpec {
    /// New batch size: dim 0 of every graph input (without a default) of rank ≥ 1.
    pub batch: Option<i64>,
    /// Full new shapes of named inputs (take precedence over `batch`).
    pub input_shapes: Vec<(String, Vec<i64>)>,
    /// Values for symbolic dims by name (`--dim batch=8`), in every input that has them.
    pub dims: Vec<(String, i64)>,
    /// The new batch is a micro-batch, a slice of the batch each step runs in turn: a constant
    /// along the batch must then be the same for every sample (`arange(B)` traced into the
    /// export would restart in every micro-batch), where a new batch extends it.
    pub micro_batch: bool,
    /// What to do with constants held as external data that must change with the new dims
    /// (a causal mask or rotary table the exporter folded).
    pub external: ExternalData,
}

/// Constants held as external data that must change with the new dims: their bytes at their
/// offset are never read as another shape (a [8,1,128,128] mask's first 2·64·64 bytes are not
/// a [2,1,64,64] mask).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ExternalData {
    /// Refused, naming the constant (the default: nothing here can read them).
    #[default]
    Refuse,
    /// Read, then regenerated like inline constants; one whose file is absent (its values
    /// drawn from a seed at whatever shape it has) changes shape, with a note.
    Read(ExternalValues),
    /// Only their shapes change: for callers that never read the values (planning, pricing).
    ShapesOnly,
}

/// A function reading an external-data tensor's values: `Ok(None)` when its file is not there.
pub type ReadExternal = dyn Fn(&Tensor) -> Result<Option<Tensor>, String> + Send + Sync;

/// Reads an external-data tensor's values ([`ReadExternal`]).
#[derive(Clone)]
pub struct ExternalValues(pub std::sync::Arc<ReadExternal>);

impl std::fmt::Debug for ExternalValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExternalValues(..)")
    }
}

impl PartialEq for ExternalValues {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ExternalValues {}

impl RebatchSpec {
    /// Micro-batches of `mb` samples of a graph that is only priced (a pipeline's stages):
    /// constants held as external data change shape without being read.
    pub fn priced_micro_batch(mb: i64) -> RebatchSpec {
        RebatchSpec { batch: Some(mb), micro_batch: true, external: ExternalData::ShapesOnly, ..Default::default() }
    }

    /// True when nothing is asked.
    pub fn is_empty(&self) -> bool {
        self.batch.is_none() && self.input_shapes.is_empty() && self.dims.is_empty()
    }
}

/// Parses `NAME=VALUE` (as `--dim` takes it).
pub fn parse_dim(s: &str) -> Result<(String, i64), String> {
    let (name, v) = s.rsplit_once('=').ok_or_else(|| format!("`{s}`: expected NAME=VALUE, e.g. batch=8"))?;
    if name.is_empty() {
        return Err(format!("`{s}`: the dim's name is empty"));
    }
    let v: i64 = v.trim().parse().map_err(|_| format!("`{s}`: `{v}` is not a whole number"))?;
    if v <= 0 {
        return Err(format!("`{s}`: a dim must be positive"));
    }
    Ok((name.to_string(), v))
}

/// Parses `NAME=D0xD1x…` (as `--input-shape` takes it).
pub fn parse_input_shape(s: &str) -> Result<(String, Vec<i64>), String> {
    let (name, dims) =
        s.rsplit_once('=').ok_or_else(|| format!("`{s}`: expected NAME=D0xD1x…, e.g. input_ids=8x1024"))?;
    if name.is_empty() {
        return Err(format!("`{s}`: the input name is empty"));
    }
    let dims: Result<Vec<i64>, _> = dims.split(['x', 'X', ',']).map(|d| d.trim().parse::<i64>()).collect();
    match dims {
        Ok(d) if d.iter().all(|&x| x > 0) => Ok((name.to_string(), d)),
        _ => Err(format!("`{s}`: dims must be positive integers separated by `x`, e.g. {name}=8x1024")),
    }
}

/// The pass.
pub struct Rebatch {
    /// What to change.
    pub spec: RebatchSpec,
}

impl Pass for Rebatch {
    fn name(&self) -> &'static str {
        NAME
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        if self.spec.is_empty() {
            return Ok(Changed::No);
        }
        let report = rebatch(g, &self.spec)?;
        cx.stats.add("shape literals rewritten", report.literals_rewritten as u64);
        cx.stats.add("constants regenerated", report.constants_regenerated as u64);
        cx.warnings.extend(report.notes);
        Ok(Changed::Yes)
    }
}

/// What a rebatch did.
#[derive(Clone, Debug, Default)]
pub struct RebatchReport {
    /// Shape operands changed.
    pub literals_rewritten: usize,
    /// Constant tensors regenerated along a changed axis.
    pub constants_regenerated: usize,
    /// Things worth telling the user.
    pub notes: Vec<Located>,
    /// Symbols that stand for the batch (a parameter may never follow them).
    batch_syms: Vec<usize>,
}

/// The literal that supplies element `k` of a 1-D shape-like value: `(initializer value,
/// index, multiplier)`, the element being the literal's entry times the multiplier. Follows
/// Concat/Cast/Identity/Unsqueeze/Squeeze/Reshape of 1-element pieces, and products of a
/// literal with values that fold to constants (`1 × (H/7 · W/7)`: a batch of 1 baked into a
/// window count computed from the spatial shape, whose factor does not change). `None`: the
/// element is computed (from `Shape`), nothing to rewrite.
fn literal_source(
    g: &Graph,
    v: Value,
    k: usize,
    old: &HashMap<Value, Vec<i64>>,
    consts: &HashMap<Value, Array>,
) -> Option<(Value, usize, i64)> {
    match &g.node(v.node).op {
        Op::Initializer(_) | Op::Input { default: Some(_) } => Some((v, k, 1)),
        Op::Constant(_) => Some((v, k, 1)),
        Op::Identity(_) | Op::Cast(_) | Op::Unsqueeze(_) | Op::Squeeze(_) | Op::Reshape(_) => {
            literal_source(g, g.node(v.node).input(0)?, k, old, consts)
        }
        Op::Concat(_) => {
            let mut off = 0usize;
            for inp in g.node(v.node).inputs().iter().flatten() {
                let len = old.get(inp).map_or(1, |d| d.iter().product::<i64>().max(0) as usize);
                if k < off + len {
                    return literal_source(g, *inp, k - off, old, consts);
                }
                off += len;
            }
            None
        }
        Op::Mul(_) => {
            let (a, b) = (g.node(v.node).input(0)?, g.node(v.node).input(1)?);
            let element = |x: Value| -> Option<(usize, i64)> {
                let vals = consts.get(&x)?.to_i64().ok()?;
                let i = if vals.len() == 1 { 0 } else { k };
                Some((i, *vals.get(i)?))
            };
            for (x, y) in [(a, b), (b, a)] {
                let (Some((kx, _)), Some((_, f))) = (element(x), element(y)) else { continue };
                if f == 0 {
                    continue;
                }
                if let Some((lit, idx, m)) = literal_source(g, x, kx, old, consts) {
                    return Some((lit, idx, m * f));
                }
            }
            None
        }
        _ => None,
    }
}

fn tensor_of(g: &Graph, v: Value) -> Option<Tensor> {
    match &g.node(v.node).op {
        Op::Initializer(t) | Op::Input { default: Some(t) } => Some(t.clone()),
        Op::Constant(c) => {
            ir::eval::eval_op(&Op::Constant(c.clone()), &[], 1, g.opset).ok().map(|mut a| a.remove(0).to_tensor())
        }
        _ => None,
    }
}

/// The current value of `v` when it is computed from constants only (evaluated now).
fn const_value(g: &Graph, v: Value, depth: usize) -> Option<Array> {
    if depth > 32 {
        return None;
    }
    if let Some(t) = tensor_of(g, v) {
        return Array::from_tensor(&t).ok();
    }
    // A `Shape` or `Size` is constant when what it measures is (the shape of a constant does
    // not change with the batch): torch's `expand(x.shape[0], -1, -1)` with a traced batch
    // replaces its -1s through `Where(Equal(s, ConstantOfShape(Shape(s)) · -1), …)`.
    let node = g.node(v.node);
    if matches!(node.op, Op::Input { .. } | Op::OuterRef) || ir::infer::has_subgraph(&node.op) {
        return None;
    }
    let mut arrays = Vec::with_capacity(node.inputs().len());
    for inp in node.inputs() {
        arrays.push(match inp {
            Some(x) => Some(const_value(g, *x, depth + 1)?),
            None => None,
        });
    }
    let refs: Vec<Option<&Array>> = arrays.iter().map(Option::as_ref).collect();
    ir::eval::fold_node(g, v.node, &refs)
        .and_then(|mut o| (usize::from(v.slot) < o.len()).then(|| o.swap_remove(v.slot as usize)))
}

/// Writes `updates` (flat index → value) into the literal feeding input `slot` of `user`,
/// through a private copy so other users keep the old value. Returns how many literals
/// changed.
fn rewrite_operand(
    g: &mut Graph,
    user: NodeId,
    slot: usize,
    updates: &[(usize, i64)],
    old: &HashMap<Value, Vec<i64>>,
    consts: &HashMap<Value, Array>,
) -> Result<usize, String> {
    let Some(current) = g.node(user).input(slot) else { return Ok(0) };
    // Group the updates by the literal that supplies each element.
    let mut by_lit: BTreeMap<Value, Vec<(usize, i64)>> = BTreeMap::new();
    let mut computed: Vec<(usize, i64)> = Vec::new();
    for &(k, new) in updates {
        match literal_source(g, current, k, old, consts) {
            Some((lit, idx, 1)) => by_lit.entry(lit).or_default().push((idx, new)),
            Some((lit, idx, m)) if new % m == 0 => by_lit.entry(lit).or_default().push((idx, new / m)),
            Some((_, _, m)) => {
                return Err(format!("element {k} must become {new}, a literal times {m} that does not divide it"));
            }
            None => computed.push((k, new)),
        }
    }
    let mut count = 0;
    if !computed.is_empty() {
        // Not a plain literal: if the whole operand is computed from constants, replace it by
        // a literal of its new value; otherwise it is computed from shapes and follows by
        // itself.
        if let Some(a) = const_value(g, current, 0) {
            let mut vals = a.to_i64().map_err(|e| e.to_string())?;
            let mut changed = false;
            for (k, new) in computed {
                if k < vals.len() && vals[k] != new {
                    vals[k] = new;
                    changed = true;
                }
            }
            if changed {
                let name = g.fresh_name(&format!("{}.rebatched", g.value_name(current)));
                let copy = g.add_initializer(name, Tensor::from_i64(vec![vals.len() as i64], vals));
                g.set_input(user, slot, Some(copy));
                return Ok(1);
            }
        }
    }
    for (lit, ups) in by_lit {
        let Some(mut t) = tensor_of(g, lit) else { continue };
        let mut vals = t.to_i64_vec().ok_or("the shape literal is not an integer tensor")?;
        let mut changed = false;
        for (idx, new) in ups {
            if idx >= vals.len() {
                return Err("the shape literal is shorter than the shape it describes".into());
            }
            if vals[idx] != new {
                vals[idx] = new;
                changed = true;
            }
        }
        if !changed {
            continue;
        }
        t.data = match t.dtype {
            ir::DType::Int64 => TensorData::Int64(vals),
            _ => TensorData::Int32(vals.iter().map(|&x| x as i32).collect()),
        };
        t.name = None;
        let name = g.fresh_name(&format!("{}.rebatched", g.value_name(lit)));
        let copy = g.add_initializer(name, t);
        let operand = g.node(user).input(slot).expect("present");
        let new_operand = clone_chain(g, operand, lit, copy);
        g.set_input(user, slot, Some(new_operand));
        count += 1;
    }
    Ok(count)
}

/// Copies the nodes on the path from `top` down to `lit`, with `lit` replaced by `copy`.
fn clone_chain(g: &mut Graph, top: Value, lit: Value, copy: Value) -> Value {
    if top == lit {
        return copy;
    }
    let node = g.node(top.node).clone();
    let inputs: Vec<Option<Value>> = node
        .inputs()
        .iter()
        .map(|i| i.map(|v| if reaches(g, v, lit) { clone_chain(g, v, lit, copy) } else { v }))
        .collect();
    let outs: Vec<ir::Output> = node
        .outputs()
        .iter()
        .map(|o| ir::Output {
            name: if o.name.is_empty() { String::new() } else { g.fresh_name(&format!("{}.rebatched", o.name)) },
            ty: None,
        })
        .collect();
    let id = g.add_node(node.op.clone(), inputs, outs);
    Value::new(id, top.slot)
}

fn reaches(g: &Graph, from: Value, target: Value) -> bool {
    if from == target {
        return true;
    }
    g.node(from.node).inputs().iter().flatten().any(|&v| reaches(g, v, target))
}

/// Regenerates constant `t` so that axis `axis` grows from `old` to `new` elements, when the
/// data follows a pattern along that axis.
fn regenerate(t: &Tensor, axis: usize, new: i64) -> Result<Tensor, String> {
    if t.is_external() {
        let mut dims = t.dims.clone();
        dims[axis] = new;
        return Ok(external_reshaped(t, dims));
    }
    let a = Array::from_tensor(t).map_err(|e| e.to_string())?;
    let v = a.to_f64().map_err(|e| e.to_string())?;
    let dims: Vec<usize> = a.shape.clone();
    let n_old = dims[axis];
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let at = |o: usize, j: usize, i: usize| v[(o * n_old + j) * inner + i];
    let new_n = new as usize;
    let mut res = vec![0.0; outer * new_n * inner];
    if new_n <= n_old {
        // Shrinking keeps the prefix: position-indexed data (embeddings, masks) of the
        // first `new` positions.
        let sliced = ir::eval::slice_axis(&a, axis, 0, new_n);
        return Ok(sliced.to_tensor());
    }
    let uniform = (0..outer).all(|o| (0..n_old).all(|j| (0..inner).all(|i| at(o, j, i) == at(o, 0, i))));
    let arithmetic = n_old >= 2 && {
        let d = |o, i| at(o, 1, i) - at(o, 0, i);
        (0..outer).all(|o| (1..n_old).all(|j| (0..inner).all(|i| at(o, j, i) - at(o, j - 1, i) == d(o, i))))
    };
    if uniform {
        for o in 0..outer {
            for j in 0..new_n {
                for i in 0..inner {
                    res[(o * new_n + j) * inner + i] = at(o, 0, i);
                }
            }
        }
    } else if arithmetic {
        for o in 0..outer {
            for j in 0..new_n {
                for i in 0..inner {
                    let d = at(o, 1, i) - at(o, 0, i);
                    res[(o * new_n + j) * inner + i] = at(o, 0, i) + d * j as f64;
                }
            }
        }
    } else {
        return Err(format!(
            "its values along axis {axis} follow no pattern that can be extended (uniform or arithmetic)"
        ));
    }
    let arr = match a.data {
        ir::eval::Data::F32(_) | ir::eval::Data::F64(_) => Array::float(a.dtype, vec![], vec![]),
        _ => Array::int(a.dtype, vec![], vec![]),
    };
    let mut shape = dims.clone();
    shape[axis] = new_n;
    let arr = match arr.data {
        ir::eval::Data::F32(_) | ir::eval::Data::F64(_) => Array::float(a.dtype, shape, res),
        _ if a.dtype == ir::DType::Bool => Array::bool(shape, res.iter().map(|&x| x != 0.0).collect()),
        _ => Array::int(a.dtype, shape, res.iter().map(|&x| x as i64).collect()),
    };
    Ok(arr.to_tensor())
}

/// External tensor `t` at `dims`, its values left unread ([`ExternalData::ShapesOnly`], or a
/// file that is not there: drawn from a seed at any shape); its `length` follows the dims.
fn external_reshaped(t: &Tensor, dims: Vec<i64>) -> Tensor {
    let mut out = t.clone();
    out.dims = dims;
    let bytes = out.numel() * t.dtype.size_bytes();
    if let TensorData::External(entries) = &mut out.data {
        for (k, v) in entries.iter_mut() {
            if k == "length" {
                *v = bytes.to_string();
            }
        }
    }
    out
}

/// Whether every slice of `t` along `axis` holds the same values (external data: unknown, so
/// no).
fn uniform_along(t: &Tensor, axis: usize) -> bool {
    let Ok(a) = Array::from_tensor(t) else { return false };
    let Ok(v) = a.to_f64() else { return false };
    let Some(&n) = a.shape.get(axis) else { return false };
    let inner: usize = a.shape[axis + 1..].iter().product();
    let outer: usize = a.shape[..axis].iter().product();
    (0..outer).all(|o| (1..n).all(|j| (0..inner).all(|i| v[(o * n + j) * inner + i] == v[o * n * inner + i])))
}

/// Regenerates a square mask over two axes that both grow (causal masks): values must depend
/// only on the sign of `col - row`.
fn regenerate_square(t: &Tensor, ax: (usize, usize), new: i64) -> Result<Tensor, String> {
    if t.is_external() {
        let mut dims = t.dims.clone();
        dims[ax.0] = new;
        dims[ax.1] = new;
        return Ok(external_reshaped(t, dims));
    }
    if ax.1 != ax.0 + 1 || ax.1 != t.dims.len() - 1 {
        return Err("a mask over two changed axes must have them last".into());
    }
    let a = Array::from_tensor(t).map_err(|e| e.to_string())?;
    if (new as usize) <= a.shape[ax.0] {
        let sliced = ir::eval::slice_axis(&ir::eval::slice_axis(&a, ax.0, 0, new as usize), ax.1, 0, new as usize);
        return Ok(sliced.to_tensor());
    }
    let v = a.to_f64().map_err(|e| e.to_string())?;
    let n = a.shape[ax.0];
    let outer: usize = a.shape[..ax.0].iter().product();
    let mut by_sign: [Option<f64>; 3] = [None; 3];
    for o in 0..outer {
        for i in 0..n {
            for j in 0..n {
                let s = (j as i64 - i as i64).signum() + 1;
                let x = v[(o * n + i) * n + j];
                match by_sign[s as usize] {
                    None => by_sign[s as usize] = Some(x),
                    Some(y) if y == x => {}
                    _ => return Err("its values depend on more than the position relative to the diagonal".into()),
                }
            }
        }
    }
    let nn = new as usize;
    let mut res = Vec::with_capacity(outer * nn * nn);
    for _ in 0..outer {
        for i in 0..nn {
            for j in 0..nn {
                res.push(by_sign[((j as i64 - i as i64).signum() + 1) as usize].unwrap_or(0.0));
            }
        }
    }
    let mut shape = a.shape.clone();
    shape[ax.0] = nn;
    shape[ax.1] = nn;
    Ok(match a.data {
        ir::eval::Data::F32(_) | ir::eval::Data::F64(_) => Array::float(a.dtype, shape, res),
        ir::eval::Data::Bool(_) => Array::bool(shape, res.iter().map(|&x| x != 0.0).collect()),
        _ => Array::int(a.dtype, shape, res.iter().map(|&x| x as i64).collect()),
    }
    .to_tensor())
}

use ir::ops::recurrent::feeds_recurrent_state;

mod resolver;
use resolver::*;

fn consts_i64(consts: &HashMap<Value, Array>, v: Option<Value>) -> Option<Vec<i64>> {
    consts.get(&v?).and_then(|a| a.to_i64().ok())
}

/// Monomials per value.
type Monos = HashMap<Value, Vec<Mono>>;

/// An input to change: its value, old dims and new dims.
type Change = (Value, Vec<Dim>, Vec<Dim>);

/// The graph inputs `spec` changes, with their old and new dims.
fn changed_inputs(g: &Graph, spec: &RebatchSpec) -> Result<Vec<Change>, Located> {
    let real_inputs: Vec<Value> =
        g.input_values().into_iter().filter(|v| matches!(g.node(v.node).op, Op::Input { default: None })).collect();
    let names: Vec<String> = real_inputs.iter().map(|&v| g.value_name(v).to_string()).collect();
    let mut new_dims: Vec<Change> = Vec::new();
    for (name, dims) in &spec.input_shapes {
        let Some(&v) = real_inputs.iter().find(|&&v| g.value_name(v) == name) else {
            return Err(Located::global(format!("there is no graph input `{name}`; inputs are: {}", names.join(", "))));
        };
        let old = g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default();
        if old.len() != dims.len() {
            return Err(Located::at(
                g,
                v.node,
                format!("input `{name}` has rank {}, but the new shape {dims:?} has rank {}", old.len(), dims.len()),
            ));
        }
        new_dims.push((v, old, dims.iter().map(|&d| Dim::Fixed(d)).collect()));
    }
    if let Some(b) = spec.batch {
        if b <= 0 {
            return Err(Located::global(format!("the batch size must be positive, got {b}")));
        }
        // The batch is dim 0 of the first input and of the inputs that share its size there;
        // recurrent state inputs (batch on axis 1) and inputs the analysis reaches later are
        // found by following the graph.
        let first = real_inputs
            .iter()
            .find_map(|&v| g.tensor_type(v).and_then(|t| t.dims.as_ref()).and_then(|d| d.first().cloned()));
        for &v in &real_inputs {
            if new_dims.iter().any(|(x, _, _)| *x == v) || feeds_recurrent_state(g, v) {
                continue;
            }
            let old = g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default();
            if old.is_empty() || Some(&old[0]) != first.as_ref() {
                continue;
            }
            let mut nd = old.clone();
            nd[0] = Dim::Fixed(b);
            new_dims.push((v, old, nd));
        }
    }
    // Symbolic dims bound by name, in every input that has them.
    if !spec.dims.is_empty() {
        let bind = |d: &Dim| match d {
            Dim::Sym(s) => spec.dims.iter().find(|(n, _)| n == s).map_or_else(|| d.clone(), |(_, v)| Dim::Fixed(*v)),
            _ => d.clone(),
        };
        for (name, _) in &spec.dims {
            let used = real_inputs.iter().any(|&v| {
                g.tensor_type(v).and_then(|t| t.dims.as_ref()).is_some_and(|d| d.contains(&Dim::Sym(name.clone())))
            });
            if !used {
                let mut have: Vec<String> = Vec::new();
                for &v in &real_inputs {
                    for d in g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default() {
                        if let Dim::Sym(s) = d
                            && !have.contains(&s)
                        {
                            have.push(s);
                        }
                    }
                }
                return Err(Located::global(format!(
                    "--dim {name}: no input has a dim named `{name}`; {}",
                    if have.is_empty() {
                        "the inputs have no symbolic dims".to_string()
                    } else {
                        format!("they have {}", have.join(", "))
                    }
                )));
            }
        }
        for &v in &real_inputs {
            let old = g.tensor_type(v).and_then(|t| t.dims.clone()).unwrap_or_default();
            match new_dims.iter_mut().find(|(x, _, _)| *x == v) {
                Some((_, _, nd)) => {
                    for d in nd.iter_mut() {
                        *d = bind(d);
                    }
                }
                None => {
                    let nd: Vec<Dim> = old.iter().map(bind).collect();
                    if nd != old {
                        new_dims.push((v, old, nd));
                    }
                }
            }
        }
    }
    Ok(new_dims)
}

/// Symbols for the changed fixed dims, keyed by (old, new), and the inputs' monomials;
/// symbolic dims are substituted, not tracked.
fn symbols(new_dims: &[Change]) -> (Vec<(i64, i64)>, Monos) {
    let mut syms: Vec<(i64, i64)> = Vec::new();
    let mut input_monos: HashMap<Value, Vec<Mono>> = HashMap::new();
    for (v, old, new) in new_dims {
        let mut monos = Vec::new();
        for (o, n) in old.iter().zip(new) {
            let Some(nv) = n.value() else {
                monos.push(Mono::Opaque);
                continue;
            };
            match o.value() {
                Some(ov) if ov != nv => {
                    let s = syms.iter().position(|&p| p == (ov, nv)).unwrap_or_else(|| {
                        syms.push((ov, nv));
                        syms.len() - 1
                    });
                    monos.push(Mono::sym(s));
                }
                Some(ov) => monos.push(Mono::constant(ov)),
                None => monos.push(Mono::Opaque),
            }
        }
        input_monos.insert(*v, monos);
    }
    (syms, input_monos)
}

/// Rewrites the shape operands, gives the inputs their new types, infers shapes afresh and
/// checks every tracked axis has the size its monomial predicts.
#[allow(clippy::too_many_arguments)]
fn finish(
    g: &mut Graph,
    order: &[NodeId],
    monos: &HashMap<Value, Vec<Mono>>,
    old: &HashMap<Value, Vec<i64>>,
    syms: &[(i64, i64)],
    consts: &HashMap<Value, Array>,
    new_dims: &[Change],
    report: &mut RebatchReport,
) -> Result<(), Vec<Located>> {
    report.literals_rewritten += rewrite_literals(g, order, monos, old, syms, consts)?;
    for (v, _, new) in new_dims {
        let dtype = g.tensor_type(*v).map_or(ir::DType::Float, |t| t.dtype);
        g.set_type(*v, Some(Type::Tensor(TensorType::new(dtype, new.clone()))));
    }
    let inferred = infer_shapes(g, Mode::Reset).map_err(|e| {
        e.into_iter()
            .map(|e| Located { node: e.node, span: e.span, msg: format!("after changing the inputs: {}", e.msg) })
            .collect::<Vec<_>>()
    })?;
    report.notes.extend(inferred.warnings.into_iter().map(Located::from));
    let mut errors = Vec::new();
    for (v, ms) in monos {
        if !g.contains(v.node) {
            continue;
        }
        let Some(dims) = g.tensor_type(*v).and_then(|t| t.dims.clone()) else { continue };
        for (a, m) in ms.iter().enumerate() {
            if let (Some(want), Some(got)) = (m.eval(syms, true), dims.get(a).and_then(Dim::value))
                && want != got
            {
                errors.push(Located::at(
                    g,
                    v.node,
                    format!("after rebatching, `{}` has size {got} on axis {a} where {want} was expected; a constant in its computation still carries the old size", g.value_name(*v)),
                ));
                break;
            }
        }
    }
    errors.truncate(5);
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// Changes the graph's inputs as `spec` says and rewrites every constant that carries a
/// changed dim (see the module documentation).
pub fn rebatch(g: &mut Graph, spec: &RebatchSpec) -> Result<RebatchReport, PassError> {
    let fail = |errors: Vec<Located>| PassError { pass: NAME.into(), errors };
    // What the rewriting could not do (not what the user asked wrongly) comes with advice.
    let cannot = |errors: Vec<Located>| fail(errors.into_iter().map(advised).collect());
    let located = |e: Vec<ir::infer::ShapeError>| e.into_iter().map(Located::from).collect();
    let mut report = RebatchReport::default();
    // Statistics of the batch (BatchNormalization in training mode normalizes by them and
    // updates its running statistics from them) differ from a micro-batch's.
    if spec.micro_batch
        && let Some(n) =
            g.node_ids().find(|&n| matches!(&g.node(n).op, Op::BatchNormalization(b) if b.training_mode() != 0))
    {
        return Err(fail(vec![Located::at(
            g,
            n,
            format!(
                "cannot cut the batch into micro-batches: {} normalizes by the batch's statistics (training mode) and updates its running statistics from them, so micro-batches would not compute what the whole batch computes",
                g.describe(n)
            ),
        )]));
    }
    infer_shapes(g, Mode::Check).map_err(|e| fail(located(e)))?;
    let mut new_dims = changed_inputs(g, spec).map_err(|e| fail(vec![e]))?;
    let (syms, mut input_monos) = symbols(&new_dims);
    // The batch's symbol: dim 0 of the inputs `--batch` changed.
    if let Some(b) = spec.batch {
        for (_, old_d, _) in &new_dims {
            if let Some(ov) = old_d.first().and_then(Dim::value)
                && let Some(i) = syms.iter().position(|&p| p == (ov, b))
                && !report.batch_syms.contains(&i)
            {
                report.batch_syms.push(i);
            }
        }
    }
    // Old shapes and folded constants, from the model as it was.
    let consts = infer_shapes(g, Mode::Check).map_err(|e| fail(located(e)))?.consts;
    let mut old: HashMap<Value, Vec<i64>> = HashMap::new();
    for n in g.node_ids() {
        for s in 0..g.node(n).num_outputs() {
            let v = Value::new(n, s as u16);
            if let Some(d) = g.tensor_type(v).and_then(TensorType::static_dims) {
                old.insert(v, d);
            }
        }
    }
    // Axes made to follow a changed dim by rewriting (regenerated constants, grown slices,
    // graph inputs found to carry the batch).
    let mut overrides: HashMap<Value, Vec<(usize, Mono)>> = HashMap::new();
    for _round in 0..8 {
        let order = g.topo_order().map_err(|_| fail(vec![Located::global("the graph has a cycle")]))?;
        let mut fl = ir::ops::flow::flow_graph(g, &order, &syms, &old, &consts, &input_monos, &overrides);
        if !fl.errors.is_empty() {
            let errors = fl
                .errors
                .iter()
                .map(|(n, msg)| Located::at(g, *n, format!("cannot rebatch {}: {msg}", g.describe(*n))))
                .collect();
            return Err(cannot(errors));
        }
        // Requirements already met by an override are not new.
        fl.reqs.retain(|(v, a, _)| !overrides.get(v).is_some_and(|o| o.iter().any(|(x, _)| x == a)));
        if fl.reqs.is_empty() {
            batch_not_sequence(g, &order, &fl.monos, &report.batch_syms).map_err(|e| fail(vec![e]))?;
            finish(g, &order, &fl.monos, &old, &syms, &consts, &new_dims, &mut report).map_err(cannot)?;
            return Ok(report);
        }
        // Resolve requirements: make constant axes follow a changed dim.
        let mut by_value: BTreeMap<Value, Vec<(usize, Mono)>> = BTreeMap::new();
        for (v, a, m) in fl.reqs {
            let e = by_value.entry(v).or_default();
            if !e.iter().any(|(x, _)| *x == a) {
                e.push((a, m));
            }
        }
        for (v, axes) in by_value {
            let mut r = Resolver {
                syms: &syms,
                old: &old,
                consts: &consts,
                monos: &fl.monos,
                report: &mut report,
                overrides: &mut overrides,
                micro: spec.micro_batch,
                external: &spec.external,
            };
            r.resolve(g, v, &axes).map_err(|e| cannot(vec![e]))?;
        }
        // Graph inputs reached: they change too.
        for (v, axes) in &overrides {
            if !matches!(g.node(v.node).op, Op::Input { default: None }) {
                continue;
            }
            let old_d = g.tensor_type(*v).and_then(|t| t.dims.clone()).unwrap_or_default();
            let entry = match new_dims.iter().position(|(x, _, _)| x == v) {
                Some(i) => i,
                None => {
                    new_dims.push((*v, old_d.clone(), old_d.clone()));
                    new_dims.len() - 1
                }
            };
            let monos = input_monos
                .entry(*v)
                .or_insert_with(|| old_d.iter().map(|d| d.value().map_or(Mono::Opaque, Mono::constant)).collect());
            for (a, m) in axes {
                if let Some(nv) = m.eval(&syms, true)
                    && *a < monos.len()
                {
                    monos[*a] = m.clone();
                    new_dims[entry].2[*a] = Dim::Fixed(nv);
                }
            }
        }
    }
    Err(cannot(vec![Located::global("rebatching did not settle after 8 rounds of rewriting constants")]))
}

/// An error where the batch (dim 0 of the inputs `--batch` or micro-batches change) reaches a
/// recurrent layer's sequence axis: in layout 0 its input is `[sequence, batch, features]`, so
/// "dim 0" is time, and cutting or growing it is not a change of batch.
fn batch_not_sequence(g: &Graph, order: &[NodeId], monos: &Monos, batch_syms: &[usize]) -> Result<(), Located> {
    for &n in order {
        let layout = match &g.node(n).op {
            Op::GRU(r) => r.layout(),
            Op::LSTM(r) => r.layout(),
            Op::RNN(r) => r.layout(),
            _ => continue,
        };
        let Some(x) = g.node(n).input(0) else { continue };
        let seq_axis = usize::from(layout != 0);
        if monos.get(&x).and_then(|m| m.get(seq_axis)).is_some_and(|m| batch_syms.iter().any(|&b| m.uses(b))) {
            return Err(Located::at(
                g,
                n,
                format!(
                    "cannot change the batch: dim 0 of the inputs reaches axis {seq_axis} of {}'s input `{}`, its sequence (layout {layout}: [{}]); give the new shape with --input-shape instead",
                    g.describe(n),
                    g.value_name(x),
                    if layout == 0 { "sequence, batch, features" } else { "batch, sequence, features" }
                ),
            ));
        }
    }
    Ok(())
}

/// Advice every refusal ends with (where it does not give its own): what the user can do.
const ADVICE: &str = "re-export the model with dynamic axes for the dims to change (torch.onnx.export(..., dynamic_axes=...) or dynamic_shapes=...), or keep the exported shapes";

/// `e` with [`ADVICE`] unless it advises already.
fn advised(mut e: Located) -> Located {
    if !e.msg.contains("re-export") {
        e.msg = format!("{} — {ADVICE}", e.msg);
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_regenerate_along_an_axis() {
        let pos = Tensor::from_i64(vec![1, 4], vec![0, 1, 2, 3]);
        let t = regenerate(&pos, 1, 6).unwrap();
        assert_eq!(t.to_i64_vec().unwrap(), vec![0, 1, 2, 3, 4, 5]);
        let ones = Tensor::from_f32(vec![2, 2], vec![1.0, 2.0, 1.0, 2.0]);
        assert_eq!(regenerate(&ones, 0, 3).unwrap().to_f64_vec().unwrap(), vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
        let noise = Tensor::from_f32(vec![3], vec![1.0, 5.0, 2.0]);
        assert!(regenerate(&noise, 0, 4).is_err());
        let causal = Tensor {
            dtype: ir::DType::Bool,
            dims: vec![1, 3, 3],
            name: None,
            data: TensorData::Int32(vec![1, 0, 0, 1, 1, 0, 1, 1, 1]),
        };
        let t = regenerate_square(&causal, (1, 2), 4).unwrap();
        assert_eq!(t.to_i64_vec().unwrap(), vec![1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1]);
    }

    #[test]
    fn input_shapes_parse() {
        assert_eq!(parse_input_shape("input_ids=8x1024").unwrap(), ("input_ids".into(), vec![8, 1024]));
        assert!(parse_input_shape("x=8xq").is_err());
        assert!(parse_input_shape("nothing").is_err());
    }
}
