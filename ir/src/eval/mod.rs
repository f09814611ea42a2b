//! The CPU reference evaluator: op kernels in plain Rust and an interpreter for whole graphs.
//!
//! This is the single-device truth every sharded execution is compared against, and the
//! constant folder that shape inference and canonicalization use. It favours clarity over
//! speed: tensors in tests are small.

use std::collections::HashMap;

pub use crate::array::{Array, Data, EvalError, Walk, f32_to_f16, numel, round_to, strides, wrap_int};
pub use crate::ops::contraction::matmul;
pub use crate::ops::conv::{Window, conv_transpose_geometry, window};
pub use crate::ops::elementwise::{cast, where_};
pub use crate::ops::eval_op;
pub use crate::ops::resize::resize_sizes;
pub use crate::ops::shape::{reshape_target, slice_axis, slice_params, transpose};
pub use crate::ops::util::{broadcast_index, broadcast_shapes};

use crate::graph::attr::AttrValue;
use crate::graph::op::Op;
use crate::graph::{Graph, NodeId, Value};
use crate::types::DType;

/// Result of evaluation.
pub type Result<T> = std::result::Result<T, EvalError>;

/// A small deterministic generator (SplitMix64) for seeded weights and inputs.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// A generator from a seed and a name (a tensor's own stream: different tensors draw
    /// different values from one seed).
    pub fn named(seed: u64, name: &str) -> Rng {
        let mut h = seed;
        for b in name.bytes() {
            h = h.rotate_left(5) ^ u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        Rng::new(h)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// The role an external initializer's drawn values take from how it is used: `variance` and
/// `scale` for normalization statistics and scales, `weight` otherwise.
pub fn weight_role(g: &Graph, v: Value) -> &'static str {
    for (user, idx) in g.users(v) {
        match (&g.node(user).op, idx) {
            (Op::BatchNormalization(_), 4) => return "variance",
            (
                Op::BatchNormalization(_)
                | Op::LayerNormalization(_)
                | Op::InstanceNormalization(_)
                | Op::GroupNormalization(_),
                1,
            ) => {
                return "scale";
            }
            _ => {}
        }
    }
    "weight"
}

/// Slice `s` of its whole tensor `full`, in the shape `dims` of the tensor it describes (the
/// slice's own dims, or others of the same count: `passes::algebra::conv_as_matmul` reshapes
/// a weight as all of itself).
pub fn take_slice(full: Array, s: &crate::ExternalSlice, dims: &[i64]) -> Array {
    full.slice_axis(s.axis, s.start, s.end).reshaped(dims.iter().map(|&d| d.max(0) as usize).collect())
}

/// The values the evaluator draws for the external initializer `v` of `g` (see
/// [`random_tensor`]; the role comes from how the weight is used).
pub fn seeded_initializer(g: &Graph, v: Value, seed: u64) -> Result<Array> {
    let Op::Initializer(t) = &g.node(v.node).op else {
        return Err(EvalError::Invalid(format!("`{}` is not an initializer", g.value_name(v))));
    };
    draw_external(t, g.value_name(v), weight_role(g, v), seed)
}

/// The values drawn for external tensor `t` named `name` in the role `role` (see
/// [`random_tensor`]). A slice of another external tensor draws that tensor's values and
/// slices them, and a concatenation draws each part as itself, so a model whose weights were
/// split or fused (`passes::algebra`) computes what the original did.
pub fn draw_external(t: &crate::Tensor, name: &str, role: &str, seed: u64) -> Result<Array> {
    if let Some(c) = t.external_concat().map_err(EvalError::Invalid)? {
        let parts = c.parts.iter().map(|(n, p)| draw_external(p, n, role, seed)).collect::<Result<Vec<Array>>>()?;
        return Ok(Array::concat_axis(&parts.iter().collect::<Vec<_>>(), c.axis));
    }
    if let Some(s) = t.external_slice().map_err(EvalError::Invalid)? {
        let full = random_tensor(t.dtype, &s.full_dims, role, seed, &s.of)?;
        return Ok(take_slice(full, &s, &t.dims));
    }
    random_tensor(t.dtype, &t.dims, role, seed, name)
}

/// Draws values for a tensor whose data is not in the model (external data): floats uniform
/// in ±1/√fan_in (positive near 1 for normalization scales and variances), integers zero,
/// bools true. Deterministic in `seed` and the tensor's name.
pub fn random_tensor(dtype: DType, dims: &[i64], role: &str, seed: u64, name: &str) -> Result<Array> {
    let shape: Vec<usize> = dims.iter().map(|&d| d.max(0) as usize).collect();
    let n = numel(&shape);
    let mut rng = Rng::named(seed, name);
    Ok(match dtype {
        d if d.is_float() => {
            let fan_in = if shape.len() > 1 {
                shape[1..].iter().product::<usize>().max(1)
            } else {
                shape.first().copied().unwrap_or(1).max(1)
            };
            let (lo, hi) = match role {
                "variance" | "scale" => (0.5, 1.5),
                _ => {
                    let s = 1.0 / (fan_in as f64).sqrt();
                    (-s, s)
                }
            };
            Array::float(d, shape, (0..n).map(|_| rng.uniform(lo, hi)).collect())
        }
        DType::Bool => Array::bool(shape, vec![true; n]),
        d if d.is_int() => Array::int(d, shape, vec![0; n]),
        d => return Err(EvalError::Unsupported(format!("random values of type {d}"))),
    })
}

/// Options of [`run`].
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Seed for initializers whose data is external (not loaded): with `None` such a model is
    /// an error; with a seed, values are drawn by [`random_tensor`].
    pub seed: Option<u64>,
}

/// Runs a graph on named inputs; returns its outputs in order.
pub fn run(g: &Graph, inputs: &HashMap<String, Array>, opts: &RunOptions) -> Result<Vec<Array>> {
    let env = run_env(g, inputs, opts, &|_| None)?;
    g.outputs()
        .iter()
        .map(|o| {
            env.get(&o.value)
                .cloned()
                .ok_or_else(|| EvalError::Invalid(format!("output `{}` was not computed", g.value_name(o.value))))
        })
        .collect()
}

/// Runs a graph and returns every computed value (for checks of intermediate results).
pub fn run_all(g: &Graph, inputs: &HashMap<String, Array>, opts: &RunOptions) -> Result<HashMap<Value, Array>> {
    run_env(g, inputs, opts, &|_| None)
}

fn run_env(
    g: &Graph,
    inputs: &HashMap<String, Array>,
    opts: &RunOptions,
    outer: &dyn Fn(&str) -> Option<Array>,
) -> Result<HashMap<Value, Array>> {
    let order = g.topo_order().map_err(|_| EvalError::Invalid("the graph has a cycle".into()))?;
    let mut env: HashMap<Value, Array> = HashMap::new();
    // Free values after their last use to keep memory flat on larger graphs.
    let mut remaining: HashMap<Value, usize> = HashMap::new();
    for &n in &order {
        for v in g.node(n).inputs().iter().flatten() {
            *remaining.entry(*v).or_insert(0) += 1;
        }
    }
    let keep: std::collections::HashSet<Value> = g.outputs().iter().map(|o| o.value).collect();
    for &n in &order {
        let node = g.node(n);
        let at = |e: EvalError| EvalError::AtNode { node: g.describe(n), source: Box::new(e) };
        let outs: Vec<Array> = match &node.op {
            Op::Input { default } => {
                let name = &node.outputs()[0].name;
                match (inputs.get(name), default) {
                    (Some(a), _) => vec![a.clone()],
                    (None, Some(t)) => vec![Array::from_tensor(t).map_err(at)?],
                    (None, None) => return Err(EvalError::MissingInput(name.clone())),
                }
            }
            Op::Initializer(t) => {
                // A fill is made by `materialized` (a malformed one refused there).
                if t.is_external() && t.fill() == Ok(None) {
                    let Some(seed) = opts.seed else {
                        return Err(at(EvalError::Unsupported(format!(
                            "initializer `{}` has external data that is not loaded; give a seed to draw random weights",
                            node.outputs()[0].name
                        ))));
                    };
                    vec![seeded_initializer(g, Value::new(n, 0), seed).map_err(at)?]
                } else {
                    vec![Array::materialized(t).map_err(at)?]
                }
            }
            Op::OuterRef => {
                let name = &node.outputs()[0].name;
                vec![
                    outer(name)
                        .ok_or_else(|| at(EvalError::Invalid(format!("outer value `{name}` is not available"))))?,
                ]
            }
            Op::If(_) | Op::Loop(_) | Op::Scan(_) => {
                let ins: Vec<Option<&Array>> = node.inputs().iter().map(|i| i.and_then(|v| env.get(&v))).collect();
                if node.inputs().iter().zip(&ins).any(|(i, a)| i.is_some() && a.is_none()) {
                    return Err(at(EvalError::Invalid("an input was not computed".into())));
                }
                let lookup = |name: &str| g.lookup(name).and_then(|v| env.get(&v).cloned()).or_else(|| outer(name));
                control(&node.op, &ins, g.opset, opts, &lookup).map_err(at)?
            }
            op => {
                let ins: Vec<Option<&Array>> = node.inputs().iter().map(|i| i.and_then(|v| env.get(&v))).collect();
                if node.inputs().iter().zip(&ins).any(|(i, a)| i.is_some() && a.is_none()) {
                    return Err(at(EvalError::Invalid("an input was not computed".into())));
                }
                eval_op(op, &ins, node.num_outputs(), g.opset).map_err(at)?
            }
        };
        for (slot, a) in outs.into_iter().enumerate() {
            if slot < node.num_outputs() && !node.outputs()[slot].name.is_empty() {
                env.insert(Value::new(n, slot as u16), a);
            }
        }
        for v in node.inputs().iter().flatten() {
            if let Some(c) = remaining.get_mut(v) {
                *c -= 1;
                if *c == 0 && !keep.contains(v) && !subgraph_reads(g, *v) {
                    env.remove(v);
                }
            }
        }
    }
    Ok(env)
}

/// Evaluates node `n` of `g` on its input values and the values its subgraphs read from `g`
/// (`captures`, in the order of [`crate::Node::captures`]): what an executor runs for an op on
/// the host, control flow (`If`, `Loop`, `Scan`) included.
pub fn eval_node(g: &Graph, n: NodeId, inputs: &[Option<&Array>], captures: &[Option<&Array>]) -> Result<Vec<Array>> {
    let node = g.node(n);
    match &node.op {
        Op::If(_) | Op::Loop(_) | Op::Scan(_) => {
            let by_name: HashMap<&str, &Array> =
                node.captures().iter().zip(captures).filter_map(|(v, a)| a.map(|a| (g.value_name(*v), a))).collect();
            let lookup = |name: &str| by_name.get(name).map(|a| (*a).clone());
            control(&node.op, inputs, g.opset, &RunOptions::default(), &lookup)
        }
        op => eval_op(op, inputs, node.num_outputs(), g.opset),
    }
}

/// Runs a control-flow op: `If` takes a branch, `Loop` iterates its body (carried values and
/// stacked scan outputs), `Scan` runs its body per slice. `outer` finds values of enclosing
/// graphs by name.
fn control(
    op: &Op,
    ins: &[Option<&Array>],
    opset: i64,
    opts: &RunOptions,
    outer: &dyn Fn(&str) -> Option<Array>,
) -> Result<Vec<Array>> {
    let output = |sub: &HashMap<Value, Array>, body: &Graph, o: &crate::graph::GraphOutput| {
        sub.get(&o.value).cloned().ok_or_else(|| {
            EvalError::Invalid(format!("subgraph output `{}` was not computed", body.value_name(o.value)))
        })
    };
    match op {
        Op::If(i) => {
            let cond = ins.first().copied().flatten().ok_or_else(|| EvalError::Invalid("condition missing".into()))?;
            let c = cond.to_f64()?.first().copied().unwrap_or(0.0) != 0.0;
            let branch = if c { &i.then_branch } else { &i.else_branch };
            let branch = branch.as_ref().ok_or_else(|| EvalError::Invalid("If without a branch".into()))?;
            let sub_env = run_env(branch, &HashMap::new(), opts, outer)?;
            branch.outputs().iter().map(|o| output(&sub_env, branch, o)).collect()
        }
        Op::Loop(l) => {
            let body = l.body.as_ref().ok_or_else(|| EvalError::Invalid("Loop without a body".into()))?;
            let get = |i: usize| ins.get(i).copied().flatten();
            let max_trip =
                get(0).map(|a| a.to_i64().map(|v| v.first().copied().unwrap_or(0))).transpose()?.unwrap_or(i64::MAX);
            let mut cond = get(1)
                .map(|a| a.to_f64().map(|v| v.first().copied().unwrap_or(0.0) != 0.0))
                .transpose()?
                .unwrap_or(true);
            let mut carried: Vec<Array> = (2..ins.len())
                .map(|i| get(i).cloned().ok_or_else(|| EvalError::Invalid(format!("Loop input {i} is missing"))))
                .collect::<Result<_>>()?;
            let n_carried = carried.len();
            if body.outputs().len() < 1 + n_carried {
                return Err(EvalError::Invalid(format!(
                    "the Loop body has {} outputs for {n_carried} carried values",
                    body.outputs().len()
                )));
            }
            let mut scans: Vec<Vec<Array>> = vec![Vec::new(); body.outputs().len() - 1 - n_carried];
            let names: Vec<String> = body.inputs().iter().map(|&n| body.node(n).outputs()[0].name.clone()).collect();
            let mut it = 0i64;
            while it < max_trip && cond {
                let mut feed = HashMap::new();
                if let Some(nm) = names.first() {
                    feed.insert(nm.clone(), Array::scalar_i64(it));
                }
                if let Some(nm) = names.get(1) {
                    feed.insert(nm.clone(), Array::bool(vec![], vec![cond]));
                }
                for (k, a) in carried.iter().enumerate() {
                    if let Some(nm) = names.get(2 + k) {
                        feed.insert(nm.clone(), a.clone());
                    }
                }
                let sub = run_env(body, &feed, opts, outer)?;
                let outs: Vec<Array> = body.outputs().iter().map(|o| output(&sub, body, o)).collect::<Result<_>>()?;
                cond = outs[0].to_f64()?.first().copied().unwrap_or(0.0) != 0.0;
                carried = outs[1..1 + n_carried].to_vec();
                for (k, s) in outs[1 + n_carried..].iter().enumerate() {
                    scans[k].push(s.clone());
                }
                it += 1;
            }
            let mut result = carried;
            for (k, s) in scans.into_iter().enumerate() {
                match s.first() {
                    Some(first) => {
                        let mut shape = vec![s.len()];
                        shape.extend(&first.shape);
                        let refs: Vec<&Array> = s.iter().collect();
                        result.push(Array { dtype: first.dtype, shape, data: Array::concat_data(&refs) });
                    }
                    None => {
                        // No iteration ran: an empty stack of the body output's declared type.
                        let o = &body.outputs()[1 + n_carried + k];
                        let t =
                            o.ty.as_ref().and_then(crate::types::Type::as_tensor).or_else(|| body.tensor_type(o.value));
                        let dtype = t.map_or(crate::types::DType::Float, |t| t.dtype);
                        let mut shape = vec![0];
                        shape.extend(t.and_then(|t| t.static_dims()).unwrap_or_default().iter().map(|&d| d as usize));
                        result.push(Array::zeros(dtype, shape)?);
                    }
                }
            }
            Ok(result)
        }
        Op::Scan(sc) if opset > 0 && opset < 9 => {
            // Scan-8: an optional `sequence_lens` first, and a batch dim leading every other
            // input and output; the body runs per batch entry.
            if ins.first().copied().flatten().is_some() {
                return Err(EvalError::Unsupported("Scan-8 with sequence_lens".into()));
            }
            let ins: Vec<&Array> = ins[1..]
                .iter()
                .map(|a| a.ok_or_else(|| EvalError::Invalid("a Scan input is missing".into())))
                .collect::<Result<_>>()?;
            let batch = ins.first().map_or(0, |a| a.shape.first().copied().unwrap_or(0));
            let mut per: Vec<Vec<Array>> = Vec::new();
            for b in 0..batch {
                let parts: Vec<Array> = ins
                    .iter()
                    .map(|a| {
                        let shape = a.shape[1..].to_vec();
                        slice_axis(a, 0, b, 1).reshaped(shape)
                    })
                    .collect();
                let refs: Vec<&Array> = parts.iter().collect();
                per.push(scan(sc, &refs, opts, outer)?);
            }
            let n_out = per.first().map_or(0, Vec::len);
            Ok((0..n_out)
                .map(|k| {
                    let parts: Vec<&Array> = per.iter().map(|p| &p[k]).collect();
                    let mut shape = vec![parts.len()];
                    shape.extend(&parts[0].shape);
                    Array { dtype: parts[0].dtype, shape, data: Array::concat_data(&parts) }
                })
                .collect())
        }
        Op::Scan(sc) => {
            let ins: Vec<&Array> = ins
                .iter()
                .map(|a| a.ok_or_else(|| EvalError::Invalid("a Scan input is missing".into())))
                .collect::<Result<_>>()?;
            scan(sc, &ins, opts, outer)
        }
        _ => Err(EvalError::Invalid("not a control-flow op".into())),
    }
}

/// Runs a `Scan`: the body once per slice of the scan inputs along their axes (reversed where
/// a direction says so), carrying the state values; scan outputs are stacked along their
/// axes.
fn scan(
    sc: &crate::graph::op::Scan,
    ins: &[&Array],
    opts: &RunOptions,
    outer: &dyn Fn(&str) -> Option<Array>,
) -> Result<Vec<Array>> {
    let body = sc.body.as_ref().ok_or_else(|| EvalError::Invalid("Scan without a body".into()))?;
    let m = sc.num_scan_inputs.unwrap_or(0).max(0) as usize;
    if m > ins.len() {
        return Err(EvalError::Invalid(format!("Scan has {} inputs for {m} scan inputs", ins.len())));
    }
    let n_state = ins.len() - m;
    let attr = |v: &Option<Vec<i64>>, k: usize| v.as_ref().and_then(|v| v.get(k).copied()).unwrap_or(0);
    if ins[n_state..].iter().any(|a| a.rank() == 0) {
        return Err(EvalError::Invalid("a Scan input to scan over is a scalar".into()));
    }
    let in_axes: Vec<usize> = (0..m)
        .map(|k| crate::ops::norm_axis(attr(&sc.scan_input_axes, k), ins[n_state + k].rank()))
        .collect::<std::result::Result<_, String>>()?;
    if (1..m).any(|k| ins[n_state + k].shape[in_axes[k]] != ins[n_state].shape[in_axes[0]]) {
        return Err(EvalError::Invalid("the Scan inputs differ in length along their scan axes".into()));
    }
    let len = match m {
        0 => 0,
        _ => ins[n_state].shape[in_axes[0]],
    };
    let names: Vec<String> = body.inputs().iter().map(|&n| body.node(n).outputs()[0].name.clone()).collect();
    let mut state: Vec<Array> = ins[..n_state].iter().map(|a| (*a).clone()).collect();
    let n_scan_out = body.outputs().len().saturating_sub(n_state);
    let mut outs: Vec<Vec<Array>> = vec![Vec::new(); n_scan_out];
    for step in 0..len {
        let mut feed = HashMap::new();
        for (k, a) in state.iter().enumerate() {
            feed.insert(names.get(k).cloned().unwrap_or_default(), a.clone());
        }
        for k in 0..m {
            let x = ins[n_state + k];
            let t = if attr(&sc.scan_input_directions, k) != 0 { len - 1 - step } else { step };
            let mut shape = x.shape.clone();
            shape.remove(in_axes[k]);
            let slice = slice_axis(x, in_axes[k], t, 1).reshaped(shape);
            feed.insert(names.get(n_state + k).cloned().unwrap_or_default(), slice);
        }
        let env = run_env(body, &feed, opts, outer)?;
        let res: Vec<Array> = body.outputs().iter().map(|o| env[&o.value].clone()).collect();
        state = res[..n_state].to_vec();
        for (k, a) in res[n_state..].iter().enumerate() {
            outs[k].push(a.clone());
        }
    }
    let mut result = state;
    for (k, mut parts) in outs.into_iter().enumerate() {
        if attr(&sc.scan_output_directions, k) != 0 {
            parts.reverse();
        }
        let Some(first) = parts.first() else { continue };
        let axis = crate::ops::norm_axis(attr(&sc.scan_output_axes, k), first.rank() + 1)?;
        let mut shape = first.shape.clone();
        shape.insert(0, parts.len());
        let refs: Vec<&Array> = parts.iter().collect();
        let stacked = Array { dtype: first.dtype, shape, data: Array::concat_data(&refs) };
        // Stacked along axis 0; move it into place.
        let r = stacked.rank();
        let mut perm: Vec<usize> = (1..r).collect();
        perm.insert(axis, 0);
        result.push(if axis == 0 { stacked } else { transpose(&stacked, &perm) });
    }
    Ok(result)
}

/// True when a subgraph of the graph reads `v` by name (then it must stay available).
fn subgraph_reads(g: &Graph, v: Value) -> bool {
    g.users(v).iter().any(|(_, i)| *i == usize::MAX)
}

/// Evaluates a node whose inputs are all constants, for folding. Returns `None` when the op
/// cannot be evaluated here (control flow, communication, opaque ops, unsupported cases).
pub fn fold_node(g: &Graph, n: NodeId, inputs: &[Option<&Array>]) -> Option<Vec<Array>> {
    let node = g.node(n);
    if matches!(node.op, Op::If(_) | Op::Loop(_) | Op::Scan(_) | Op::Opaque(_))
        || node.op.class() == crate::graph::op::OpClass::Comm
    {
        return None;
    }
    if node.op.attributes().iter().any(|a| matches!(a.value, AttrValue::Graph(_) | AttrValue::Graphs(_))) {
        return None;
    }
    eval_op(&node.op, inputs, node.num_outputs(), g.opset).ok()
}
