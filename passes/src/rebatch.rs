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

/// What resolving constant axes reads and records: the symbol values, the old dims, the
/// folded constants, the monomials the flow found, the report and, per value, the axes made
/// to follow.
struct Resolver<'a> {
    syms: &'a [(i64, i64)],
    old: &'a HashMap<Value, Vec<i64>>,
    consts: &'a HashMap<Value, Array>,
    monos: &'a HashMap<Value, Vec<Mono>>,
    report: &'a mut RebatchReport,
    overrides: &'a mut HashMap<Value, Vec<(usize, Mono)>>,
    /// [`RebatchSpec::micro_batch`].
    micro: bool,
    /// [`RebatchSpec::external`].
    external: &'a ExternalData,
}

impl Resolver<'_> {
    /// Makes the given axes of value `v` (a constant, or computed from constants) follow changed
    /// dims.
    fn resolve(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        self.overrides.entry(v).or_default().extend(axes.iter().cloned());
        if let Op::Input { default: None } = g.node(n).op {
            // Another graph input carries the changed dim: it changes with the others.
            return Ok(());
        }
        let op = g.node(n).op.clone();
        match &op {
            Op::Initializer(_) | Op::Constant(_) => {
                let t = tensor_of(g, v).ok_or_else(|| Located::at(g, n, "not a constant"))?;
                let batch: Vec<usize> = axes
                    .iter()
                    .filter(|(_, m)| self.report.batch_syms.iter().any(|&b| m.uses(b)))
                    .map(|(a, _)| *a)
                    .collect();
                if t.dtype.is_float() && !batch.is_empty() {
                    if ir::cost::is_param(g, v) {
                        return Err(self.parameter(g, v, &t.dims, axes));
                    }
                    // Made in an earlier round (the constant is its own copy): done.
                    if axes.iter().all(|(a, m)| m.eval(self.syms, true).is_some_and(|d| t.dims.get(*a) == Some(&d))) {
                        return Ok(());
                    }
                    // A constant along the batch is the same for every sample (an exporter's
                    // zeros for a recurrent state), or a function of the sample's index that a
                    // new batch extends (`arange(B)`, uniform or arithmetic: `regenerate`) but a
                    // micro-batch would restart.
                    if self.micro
                        && let Some(&a) = batch.iter().find(|&&a| !uniform_along(&t, a))
                    {
                        return Err(Located::at(
                            g,
                            n,
                            format!(
                                "cannot cut the batch into micro-batches: constant `{}` {:?} holds different values along axis {a}, which follows the batch (the samples' index or data traced into the export), so a micro-batch would not compute what its samples compute in the whole batch",
                                g.value_name(v),
                                t.dims
                            ),
                        ));
                    }
                }
                self.regenerate(g, v, axes)
            }
            _ if matches!(op.class(), OpClass::Unary | OpClass::Binary | OpClass::Variadic)
                || matches!(op, Op::Where(_) | Op::Cast(_) | Op::Not(_)) =>
            {
                self.elementwise(g, v, axes)
            }
            Op::Unsqueeze(_)
            | Op::Squeeze(_)
            | Op::Transpose(_)
            | Op::Reshape(_)
            | Op::Expand(_)
            | Op::Slice(_)
            | Op::Gather(_)
            | Op::Range(_)
            | Op::ConstantOfShape(_) => self.shape_op(g, v, &op, axes),
            Op::Concat(c) => self.concat(g, v, c.axis.unwrap_or(0), axes),
            Op::MatMul(_) | Op::Gemm(_) => self.contraction(g, v, &op, axes),
            // A scatter's output is its data with some elements replaced: where the updates
            // follow the batch, the data (zeros of a traced shape, say) must too.
            Op::ScatterElements(_) | Op::ScatterND(_) | Op::Scatter(_) => match g.node(n).input(0) {
                Some(data) => self.resolve(g, data, axes),
                None => Err(Located::at(g, n, format!("cannot rebatch {}: it has no data", g.describe(n)))),
            },
            // Any other op of constants (a cumulative sum of a traced mask of ones: position
            // ids): its value, known, becomes a constant made to follow like the others.
            _ if g.node(n).num_outputs() == 1 && self.consts.contains_key(&v) => self.fold(g, v, axes),
            _ => Err(Located::at(
                g,
                n,
                format!(
                    "cannot rebatch {}: its output `{}` must follow a changed dim, but it is not computed from constants in a way that can be rewritten",
                    g.describe(n),
                    g.value_name(v)
                ),
            )),
        }
    }

    /// Value `v` of a one-output op of constants (the callers' condition), its value known,
    /// made a constant that follows the changed dims as the others do.
    fn fold(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let a = self.consts[&v].clone();
        if let Some(o) = self.overrides.get_mut(&v) {
            o.truncate(o.len().saturating_sub(axes.len()));
        }
        g.make_initializer(v.node, a.to_tensor());
        // A value computed from constants is not a parameter.
        ir::cost::freeze(g, v);
        self.resolve(g, v, axes)
    }

    /// The error for a parameter the batch would change.
    fn parameter(&self, g: &Graph, v: Value, dims: &[i64], axes: &[(usize, Mono)]) -> Located {
        let syms = self.syms;
        // A parameter: rebatching must never change the network it defines.
        let readers: Vec<String> = g.users(v).into_iter().map(|(u, _)| g.describe(u)).take(2).collect();
        let want: Vec<String> =
            axes.iter().map(|(a, m)| format!("axis {a} → {}", m.eval(syms, true).unwrap_or(-1))).collect();
        Located::at(
            g,
            v.node,
            format!(
                "cannot rebatch: parameter `{}` {:?} (read by {}) would have to change ({}): following the batch through this export leads into a parameter (a batch traced into reshapes, often a batch of 1, cannot be told apart from the features) — re-export with a dynamic batch axis (torch.onnx.export(..., dynamic_axes=...)) or keep the exported batch",
                g.value_name(v),
                dims,
                if readers.is_empty() { "no op".to_string() } else { readers.join(", ") },
                want.join(", ")
            ),
        )
    }

    /// Rewrites a constant (or non-parameter initializer) with the new sizes.
    fn regenerate(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let (syms, span) = (self.syms, g.span(n));
        let new_of = |m: &Mono| {
            m.eval(syms, true).ok_or_else(|| Located { node: Some(n), span, msg: "cannot compute a new size".into() })
        };
        let mut t = tensor_of(g, v).ok_or_else(|| Located::at(g, n, "not a constant"))?;
        let describe = format!("constant `{}`", g.value_name(v));
        // External data: its values, read, are regenerated like any others; the bytes at its
        // offset are never read as another shape (a [8,1,128,128] mask's first 2·64·64 bytes
        // are not a [2,1,64,64] mask).
        let absent = t.is_external() && self.external_values(g, v, &mut t, &describe)?;
        if axes.len() == 2 && axes[0].1 == axes[1].1 {
            t = regenerate_square(&t, (axes[0].0.min(axes[1].0), axes[0].0.max(axes[1].0)), new_of(&axes[0].1)?)
                .map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))?;
        } else {
            for (a, m) in axes {
                t = regenerate(&t, *a, new_of(m)?)
                    .map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))?;
            }
        }
        if absent {
            self.report.notes.push(Located::at(
                g,
                n,
                format!("{describe} has external data whose file is not there: its values are drawn, at the new shape"),
            ));
        }
        t.name = None;
        // A private copy for the users that need the new size (all of them here), a constant
        // as the one it replaces (a `Constant` made initializer is not a parameter).
        let frozen = !ir::cost::is_param(g, v);
        g.set_inputs(n, vec![]);
        let ty = Type::Tensor(t.tensor_type());
        g.set_op(n, Op::Initializer(t));
        g.set_label(n, None);
        g.set_type(v, Some(ty));
        if frozen && ir::cost::is_param(g, v) {
            ir::cost::freeze(g, v);
        }
        self.report.constants_regenerated += 1;
        Ok(())
    }

    /// Replaces external tensor `t` (of value `v`) by its values, read; returns true when its
    /// file is not there (its values are drawn from a seed at whatever shape it has). Refused
    /// when [`ExternalData::Refuse`]; left as it is (its shape to change) when
    /// [`ExternalData::ShapesOnly`].
    fn external_values(&self, g: &Graph, v: Value, t: &mut Tensor, describe: &str) -> Result<bool, Located> {
        let n = v.node;
        let read = match self.external {
            ExternalData::ShapesOnly => return Ok(false),
            ExternalData::Read(r) => r,
            ExternalData::Refuse => {
                return Err(Located::at(
                    g,
                    n,
                    format!(
                        "cannot rebatch {describe}: its values (external data) must change with the new dims and are not loaded here; load the model with its data, or re-export with dynamic axes (torch.onnx.export(..., dynamic_axes=...) or dynamic_shapes=...) so the exporter does not fold it"
                    ),
                ));
            }
        };
        match (read.0)(t).map_err(|e| Located::at(g, n, format!("cannot rebatch {describe}: {e}")))? {
            Some(mut values) => {
                values.name = t.name.clone();
                *t = values;
                Ok(false)
            }
            None => Ok(true),
        }
    }

    /// An element-wise op: the inputs that carry an axis (not broadcast into it) follow.
    fn elementwise(&mut self, g: &mut Graph, v: Value, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let syms = self.syms;
        let out_rank = self.old.get(&v).map_or(0, Vec::len);
        let inputs: Vec<Value> = g.node(n).inputs().iter().flatten().copied().collect();
        let mut any = false;
        for inp in inputs {
            let Some(d) = self.old.get(&inp) else { continue };
            let mut sub = Vec::new();
            for (a, m) in axes {
                if d.len() + a < out_rank {
                    continue;
                }
                let ia = d.len() + a - out_rank;
                if (d[ia] != 1 || m.eval(syms, false) == Some(1)) && d[ia] == self.old[&v][*a] {
                    sub.push((ia, m.clone()));
                }
            }
            if !sub.is_empty() {
                any = true;
                self.resolve(g, inp, &sub)?;
            }
        }
        if any {
            Ok(())
        } else {
            Err(Located::at(g, n, format!("cannot rebatch {}: no input carries the axis", g.describe(n))))
        }
    }

    /// A concatenation: off the concat axis every input follows; along it, the parts follow
    /// in proportion to their old sizes (`[3,16] ++ [3,16]` as `[6·b,16]` is `[3·b] ++ [3·b]`:
    /// the halves of a split whose sizes carried the batch).
    fn concat(&mut self, g: &mut Graph, v: Value, axis: i64, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let out_old = self.old.get(&v).cloned().unwrap_or_default();
        let r = out_old.len() as i64;
        let ax = (if axis < 0 { axis + r } else { axis }) as usize;
        let inputs: Vec<Value> = g.node(n).inputs().iter().flatten().copied().collect();
        for inp in inputs {
            let Some(d) = self.old.get(&inp).cloned() else { continue };
            let mut sub = Vec::new();
            for (a, m) in axes {
                if *a != ax {
                    sub.push((*a, m.clone()));
                    continue;
                }
                let part = match m {
                    Mono::Known { coef, pows } if (coef * d[ax]) % out_old[ax] == 0 => {
                        Mono::Known { coef: coef * d[ax] / out_old[ax], pows: pows.clone() }
                    }
                    _ => {
                        return Err(Located::at(
                            g,
                            n,
                            format!(
                                "cannot rebatch {}: its axis {ax} must follow a changed dim, and its parts cannot be divided in proportion",
                                g.describe(n)
                            ),
                        ));
                    }
                };
                if d[ax] > 0 {
                    sub.push((*a, part));
                }
            }
            if !sub.is_empty() {
                self.resolve(g, inp, &sub)?;
            }
        }
        Ok(())
    }

    /// A matrix product: its row axis follows the left operand's, its column axis the
    /// right's, its batch axes whichever operand has them at that size.
    fn contraction(&mut self, g: &mut Graph, v: Value, op: &Op, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let out_rank = self.old.get(&v).map_or(0, Vec::len);
        let (a, b) = (g.node(n).input(0).expect("A"), g.node(n).input(1).expect("B"));
        let (ra, rb) = (self.old.get(&a).map_or(0, Vec::len), self.old.get(&b).map_or(0, Vec::len));
        let (mut to_a, mut to_b) = (Vec::new(), Vec::new());
        for (ax, m) in axes {
            match op {
                Op::Gemm(gm) => {
                    if *ax == 0 {
                        to_a.push((usize::from(gm.trans_a() != 0), m.clone()));
                    } else {
                        to_b.push((usize::from(gm.trans_b() == 0), m.clone()));
                    }
                }
                _ if ra >= 2 && *ax == out_rank - 2 => to_a.push((ra - 2, m.clone())),
                _ if rb >= 2 && *ax == out_rank - 1 => to_b.push((rb - 1, m.clone())),
                _ if ra == 1 && *ax == out_rank - 1 => to_b.push((rb - 1, m.clone())),
                _ if rb == 1 && *ax == out_rank - 1 => to_a.push((ra - 2, m.clone())),
                _ => {
                    // A batch axis: the operands that have it at the output's size.
                    let want = self.old[&v][*ax];
                    for (x, rx, to) in [(a, ra, &mut to_a), (b, rb, &mut to_b)] {
                        if rx >= 2 && out_rank - ax <= rx && self.old[&x][rx - (out_rank - ax)] == want {
                            to.push((rx - (out_rank - ax), m.clone()));
                        }
                    }
                }
            }
        }
        if !to_a.is_empty() {
            self.resolve(g, a, &to_a)?;
        }
        if !to_b.is_empty() {
            self.resolve(g, b, &to_b)?;
        }
        Ok(())
    }

    /// A shape op: map the axes to its input's, or rewrite its literal operands.
    fn shape_op(&mut self, g: &mut Graph, v: Value, op: &Op, axes: &[(usize, Mono)]) -> Result<(), Located> {
        let n = v.node;
        let (syms, span) = (self.syms, g.span(n));
        let new_of = |m: &Mono| {
            m.eval(syms, true).ok_or_else(|| Located { node: Some(n), span, msg: "cannot compute a new size".into() })
        };
        let in_dims = g.node(n).input(0).and_then(|i| self.old.get(&i)).cloned().unwrap_or_default();
        let out_dims = self.old.get(&v).cloned().unwrap_or_default();
        match op {
            Op::Transpose(t) => {
                let perm: Vec<usize> = t
                    .perm
                    .clone()
                    .map_or((0..out_dims.len()).rev().collect(), |p| p.iter().map(|&x| x as usize).collect());
                let sub: Vec<(usize, Mono)> = axes.iter().map(|(a, m)| (perm[*a], m.clone())).collect();
                self.resolve(g, g.node(n).input(0).expect("input"), &sub)
            }
            Op::Unsqueeze(_) | Op::Squeeze(_) | Op::Reshape(_) => {
                // Map axes by dropping/adding size-1 dims in order.
                let non1_in: Vec<usize> = (0..in_dims.len()).filter(|&i| in_dims[i] != 1).collect();
                let non1_out: Vec<usize> = (0..out_dims.len()).filter(|&i| out_dims[i] != 1).collect();
                if non1_in.len() != non1_out.len()
                    || non1_in.iter().zip(&non1_out).any(|(&i, &o)| in_dims[i] != out_dims[o])
                {
                    if self.consts.contains_key(&v) {
                        return self.fold(g, v, axes);
                    }
                    return Err(Located::at(
                        g,
                        n,
                        format!("cannot rebatch {}: a reshape that regroups a changing axis", g.describe(n)),
                    ));
                }
                let sub: Vec<(usize, Mono)> = axes
                    .iter()
                    .filter_map(|(a, m)| non1_out.iter().position(|&o| o == *a).map(|k| (non1_in[k], m.clone())))
                    .collect();
                if sub.len() != axes.len() {
                    return Err(Located::at(
                        g,
                        n,
                        format!("cannot rebatch {}: a size-1 axis would have to grow", g.describe(n)),
                    ));
                }
                self.resolve(g, g.node(n).input(0).expect("input"), &sub)
            }
            Op::Gather(gt) => {
                let data = g.node(n).input(0).expect("data");
                let idx = g.node(n).input(1).expect("indices");
                let r = self.old.get(&data).map_or(0, Vec::len);
                let ax = if gt.axis() < 0 { (gt.axis() + r as i64) as usize } else { gt.axis() as usize };
                let q = self.old.get(&idx).map_or(0, Vec::len);
                let (mut to_idx, mut to_data) = (Vec::new(), Vec::new());
                for (a, m) in axes {
                    if *a < ax {
                        to_data.push((*a, m.clone()));
                    } else if *a < ax + q {
                        to_idx.push((*a - ax, m.clone()));
                    } else {
                        to_data.push((*a - q + 1, m.clone()));
                    }
                }
                if !to_idx.is_empty() {
                    self.resolve(g, idx, &to_idx)?;
                }
                if !to_data.is_empty() {
                    self.resolve(g, data, &to_data)?;
                }
                Ok(())
            }
            Op::Slice(_) => {
                // A slice of an axis that itself follows a changed dim, in proportion to it
                // (`[0:3]` and `[3:6]` of `6·b` rows are the halves `[0:3·b]`, `[3·b:6·b]`):
                // both bounds scale. Otherwise grow the slice of a constant: end = start + new
                // size (step 1, literal bounds). Axes that are not sliced pass the
                // requirement to the input.
                let input = g.node(n).input(0).expect("input");
                let in_m = self.monos.get(&input).cloned();
                let starts = consts_i64(self.consts, g.node(n).input(1)).unwrap_or_default();
                let ends = consts_i64(self.consts, g.node(n).input(2)).unwrap_or_default();
                let ax_list =
                    consts_i64(self.consts, g.node(n).input(3)).unwrap_or_else(|| (0..starts.len() as i64).collect());
                let steps = consts_i64(self.consts, g.node(n).input(4)).unwrap_or_default();
                let r = in_dims.len() as i64;
                let mut through = Vec::new();
                for (a, m) in axes {
                    let Some(k) = ax_list.iter().position(|&x| (if x < 0 { x + r } else { x }) as usize == *a) else {
                        through.push((*a, m.clone()));
                        continue;
                    };
                    if let Some(im) = in_m.as_ref().and_then(|im| im.get(*a)).filter(|im| im.is_tracked())
                        && let (Some(new_in), Some(new_out)) = (im.eval(syms, true), m.eval(syms, true))
                        && let (Some(&d_in), Some(&d_out)) = (in_dims.get(*a), out_dims.get(*a))
                        && d_in > 0
                        && new_out * d_in == new_in * d_out
                    {
                        let scale = |x: i64| -> Option<i64> {
                            let x = if x < 0 { x + d_in } else { x }.clamp(0, d_in);
                            ((x * new_in) % d_in == 0).then(|| x * new_in / d_in)
                        };
                        let (Some(s0), Some(e0)) = (scale(starts[k]), ends.get(k).and_then(|&e| scale(e))) else {
                            return Err(Located::at(
                                g,
                                n,
                                format!(
                                    "cannot rebatch {}: its bounds do not divide the axis in proportion",
                                    g.describe(n)
                                ),
                            ));
                        };
                        if steps.get(k).is_some_and(|&st| st != 1) {
                            return Err(Located::at(
                                g,
                                n,
                                format!("cannot rebatch {}: a strided slice of a changing axis", g.describe(n)),
                            ));
                        }
                        let mut count = rewrite_operand(g, n, 1, &[(k, s0)], self.old, self.consts)
                            .map_err(|e| Located::at(g, n, e))?;
                        count += rewrite_operand(g, n, 2, &[(k, e0)], self.old, self.consts)
                            .map_err(|e| Located::at(g, n, e))?;
                        self.report.literals_rewritten += count;
                        continue;
                    }
                    let new_end = starts[k] + new_of(m)?;
                    if let Some(&dim) = in_dims.get(*a)
                        && new_end > dim
                    {
                        return Err(Located::at(
                            g,
                            n,
                            format!(
                                "cannot rebatch {}: the slice would need {new_end} of the {dim} entries its input has",
                                g.describe(n)
                            ),
                        ));
                    }
                    let count = rewrite_operand(g, n, 2, &[(k, new_end)], self.old, self.consts)
                        .map_err(|e| Located::at(g, n, e))?;
                    self.report.literals_rewritten += count;
                }
                if !through.is_empty() {
                    self.resolve(g, input, &through)?;
                }
                Ok(())
            }
            Op::Range(_) => {
                let start = consts_i64(self.consts, g.node(n).input(0)).and_then(|v| v.first().copied());
                let delta = consts_i64(self.consts, g.node(n).input(2)).and_then(|v| v.first().copied());
                let (Some(s), Some(d)) = (start, delta) else {
                    return Err(Located::at(
                        g,
                        n,
                        format!("cannot rebatch {}: its bounds are not literals", g.describe(n)),
                    ));
                };
                let new_limit = s + d * new_of(&axes[0].1)?;
                self.report.literals_rewritten += rewrite_operand(g, n, 1, &[(0, new_limit)], self.old, self.consts)
                    .map_err(|e| Located::at(g, n, e))?;
                Ok(())
            }
            Op::Expand(_) | Op::ConstantOfShape(_) => {
                let slot = if matches!(op, Op::Expand(_)) { 1 } else { 0 };
                if let Op::Expand(_) = op {
                    // Input axes of the same old size (not broadcast) must follow too.
                    let x = g.node(n).input(0).expect("input");
                    let r = out_dims.len();
                    let sub: Vec<(usize, Mono)> = axes
                        .iter()
                        .filter_map(|(a, m)| {
                            let k = (a + in_dims.len()).checked_sub(r)?;
                            (in_dims[k] == out_dims[*a] && in_dims[k] != 1).then(|| (k, m.clone()))
                        })
                        .collect();
                    if !sub.is_empty() {
                        self.resolve(g, x, &sub)?;
                    }
                }
                let spec_len = g
                    .node(n)
                    .input(slot)
                    .and_then(|v| self.old.get(&v))
                    .and_then(|d| d.first().copied())
                    .unwrap_or(out_dims.len() as i64) as usize;
                let ups: Vec<(usize, i64)> = axes
                    .iter()
                    .map(|(a, m)| Ok((*a + spec_len.saturating_sub(out_dims.len()), new_of(m)?)))
                    .collect::<Result<_, Located>>()?;
                self.report.literals_rewritten +=
                    rewrite_operand(g, n, slot, &ups, self.old, self.consts).map_err(|e| Located::at(g, n, e))?;
                Ok(())
            }
            _ => unreachable!(),
        }
    }
}

/// Writes the new sizes of tracked axes into the literal shape operands that produce them.
fn rewrite_literals(
    g: &mut Graph,
    order: &[NodeId],
    monos: &HashMap<Value, Vec<Mono>>,
    old: &HashMap<Value, Vec<i64>>,
    syms: &[(i64, i64)],
    consts: &HashMap<Value, Array>,
) -> Result<usize, Vec<Located>> {
    let mut count = 0;
    let mut errors = Vec::new();
    for &n in order {
        if !g.contains(n) {
            continue;
        }
        let out = Value::new(n, 0);
        let Some(m) = monos.get(&out).cloned() else { continue };
        if !m.iter().any(Mono::is_tracked) {
            continue;
        }
        let op = g.node(n).op.clone();
        let (slot, spec) = match &op {
            Op::Reshape(_) | Op::Expand(_) => (1, consts_i64(consts, g.node(n).input(1))),
            Op::Tile(_) => (1, consts_i64(consts, g.node(n).input(1))),
            _ => continue,
        };
        // Elements of the operand to update: (index, new value).
        let mut ups = Vec::new();
        for (i, mm) in m.iter().enumerate() {
            if !mm.is_tracked() {
                continue;
            }
            let Some(new) = mm.eval(syms, true) else {
                // Opaque: fine when the literal is -1/0/1 (derived from the input).
                if let Some(s) = &spec
                    && let Some(&lit) = s.get(i)
                    && !matches!(lit, -1..=1)
                    && !matches!(op, Op::Tile(_))
                {
                    errors.push(Located::at(g, n, format!("cannot rebatch {}: axis {i} changes in a way that cannot be computed, but its size is the literal {lit}", g.describe(n))));
                }
                continue;
            };
            match &op {
                Op::Reshape(r) => {
                    if let Some(s) = &spec
                        && let Some(&lit) = s.get(i)
                        && (lit == -1 || (lit == 0 && r.allowzero() == 0))
                    {
                        continue;
                    }
                    ups.push((i, new));
                }
                Op::Expand(_) => {
                    let r = m.len();
                    let xo = g.node(n).input(0).and_then(|v| old.get(&v)).cloned().unwrap_or_default();
                    let k = (i + xo.len()).checked_sub(r);
                    let lit = spec.as_ref().and_then(|s| s.get(i + s.len().saturating_sub(r))).copied();
                    if lit == Some(1)
                        && k.is_some_and(|k| {
                            xo[k] != 1
                                || monos.get(&g.node(n).input(0).expect("x")).is_some_and(|xm| xm[k].is_tracked())
                        })
                    {
                        continue;
                    }
                    let sl = spec.as_ref().map_or(0, Vec::len);
                    ups.push((i + sl.saturating_sub(r), new));
                }
                Op::Tile(_) => {
                    let xo = g
                        .node(n)
                        .input(0)
                        .and_then(|v| monos.get(&v))
                        .and_then(|xm| xm.get(i).and_then(|x| x.eval(syms, true)));
                    let rep = match xo {
                        Some(x) if x > 0 && new % x == 0 => new / x,
                        _ => continue,
                    };
                    ups.push((i, rep));
                }
                _ => {}
            }
        }
        if ups.is_empty() {
            continue;
        }
        match rewrite_operand(g, n, slot, &ups, old, consts) {
            Ok(c) => count += c,
            Err(e) => errors.push(Located::at(g, n, format!("cannot rebatch {}: {e}", g.describe(n)))),
        }
    }
    // Literals orphaned by private copies are dead now.
    if errors.is_empty() {
        crate::canonicalize::eliminate_unused_initializers(g);
        Ok(count)
    } else {
        Err(errors)
    }
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
