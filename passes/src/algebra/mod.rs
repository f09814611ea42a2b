//! Algebraic rewrites: the graph computes the same values with ops whose layouts line up
//! with parallelism. Each rule is an identity, written in its doc comment.
//!
//! - [`unfuse_split_gemm`]: `Split(X·[W₀|W₁|…] + [c₀|c₁|…], last axis) = (X·W₀ + c₀, X·W₁ + c₁, …)`.
//! - [`fuse_gemms`] (chosen by the search): `(X·W₀ + c₀, X·W₁ + c₁, …) = Split(X·[W₀|W₁|…] + [c₀|c₁|…])`.
//! - [`conv_as_matmul`] (chosen by the search): a pointwise convolution as a batched GEMM.
//! - [`fold_reshape_transpose`]: `Reshape(Transpose(Reshape(x, merge groups), π), unmerge) =
//!   Transpose(x, π expanded over the groups)`.
//! - [`transpose_into_gemm`]: `X · Transpose(W) = Reshape(Gemm(Reshape(X, [R, K]), W, transB = 1), [.., N])`
//!   for a parameter `W` (a tied output projection reads the parameter itself).
//! - [`transpose_before_gemm`]: `Transpose(Reshape(Gemm(Reshape(X, [R, K]), W), [r.., N]), π) =
//!   Reshape(Gemm(Reshape(Transpose(X, π ⊕ id), [R, K]), W), [π(r).., N])` (rows permuted first).
//! - [`compose_transposes`]: `Transpose(Transpose(x, p), q) = Transpose(x, p∘q)`.
//!
//! **Un-fusing.** Exporters fuse the query, key and value projections of attention into one GEMM (GPT-2's
//! `c_attn`: 768 → 2304 columns, then `Split` into three 768-column tensors). A column split
//! of the fused GEMM does not line up with the heads (2304/8 = 288 columns mix query and key
//! columns), so no plan can run attention head-parallel through it. After this pass each part
//! is its own GEMM with its own weight (the columns of the fused weight, and of the bias), and
//! a column split of each lines up with the heads as in Megatron-LM.
//!
//! Matched: a `Gemm` (`transA = 0`) or 2-D-weight `MatMul` whose weight and bias are
//! initializers (or a `MatMul` whose one reader adds a bias initializer), whose output's one
//! reader is a `Split` along the last axis, directly or through
//! a `Reshape` to a constant shape that keeps the last dim. The new weights keep the model's
//! values: inline data is sliced; external data is described as the columns of the fused
//! tensor (`shardc_slice_of`, `shardc_slice`, `shardc_full_dims` entries), which
//! `shardc::exec::materialize` and the reference evaluator read back. Parameter count and
//! FLOPs are unchanged; parameters are renamed by the columns they hold (`…c_attn.weight` →
//! `…c_attn.weight[:,0:768]`, `…[:,768:1536]`, …).

use ir::eval::Array;
use ir::{Graph, NodeId, Op, Output, Tensor, TensorData, Value};

use crate::manager::{Changed, Located, Pass, PassCx, PassError};

/// The pass; see the module documentation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Algebra;

/// One match: the GEMM, the reshape between it and the split (if any), the split.
struct Fused {
    gemm: NodeId,
    /// The bias `Add` after a `MatMul` (with the bias), if any.
    add: Option<(NodeId, Value)>,
    reshape: Option<NodeId>,
    split: NodeId,
    /// Axis of the weight that holds the output columns (1, or 0 under `transB`).
    weight_axis: usize,
    /// Columns of each part.
    sizes: Vec<i64>,
}

/// The one reader of `v`, reading it as its first input (`None` when it has none, several,
/// reads it elsewhere, or `v` is a graph output).
fn only_reader(g: &Graph, v: Value) -> Option<NodeId> {
    let n = lone_reader(g, v)?;
    (g.users(v)[0].1 == 0).then_some(n)
}

/// The one node reading `v`, at any input (`None` when several read it or it is an output).
fn lone_reader(g: &Graph, v: Value) -> Option<NodeId> {
    if g.is_output(v) {
        return None;
    }
    match g.users(v).as_slice() {
        [(n, _)] => Some(*n),
        _ => None,
    }
}

/// The `Add` that alone reads `y` and keeps `y`'s shape, and its other input.
fn added_to(g: &Graph, y: Value) -> Option<(NodeId, Value)> {
    let a = lone_reader(g, y)?;
    let Op::Add(_) = &g.node(a).op else { return None };
    let c = g.node(a).inputs().iter().flatten().copied().find(|&c| c != y)?;
    (static_dims(g, Value::new(a, 0)) == static_dims(g, y)).then_some((a, c))
}

/// The bias added to a GEMM's output `y` of `cols` columns: [`added_to`]'s `Add` and its
/// other input, an initializer of `cols` values that add alone reads (and not a graph output).
fn bias_add(g: &Graph, y: Value, cols: i64) -> Option<(NodeId, Value)> {
    let (a, c) = added_to(g, y)?;
    let ok = g.initializer(c).is_some_and(|t| t.dims == [cols])
        && g.users(c).iter().all(|&(u, _)| u == a)
        && !g.is_output(c);
    ok.then_some((a, c))
}

/// Nothing reads `v` and it is not a graph output.
fn unread(g: &Graph, v: Value) -> bool {
    g.users(v).is_empty() && !g.is_output(v)
}

fn static_dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(|t| t.static_dims())
}

fn find(g: &Graph, n: NodeId) -> Option<Fused> {
    let node = g.node(n);
    let weight_axis = match &node.op {
        Op::Gemm(gm) if gm.trans_a() == 0 => usize::from(gm.trans_b() == 0),
        Op::MatMul(_) => 1,
        _ => return None,
    };
    let w = node.input(1)?;
    let wt = g.initializer(w)?;
    if wt.dims.len() != 2 || !g.users(w).iter().all(|&(u, _)| u == n) {
        return None;
    }
    let cols = wt.dims[weight_axis];
    // A bias, if any: an initializer of `cols` values read by this GEMM only.
    if let Some(c) = node.input(2) {
        let ct = g.initializer(c)?;
        if ct.dims != [cols] || !g.users(c).iter().all(|&(u, _)| u == n) {
            return None;
        }
    }
    let y = Value::new(n, 0);
    let y_dims = static_dims(g, y)?;
    if y_dims.last() != Some(&cols) {
        return None;
    }
    // A bias added to a MatMul's output.
    let add = if node.input(2).is_none() { bias_add(g, y, cols) } else { None };
    let mut reader = match add {
        Some((a, _)) => only_reader(g, Value::new(a, 0))?,
        None => lone_reader(g, y)?,
    };
    let mut reshape = None;
    if let Op::Reshape(_) = &g.node(reader).op {
        let r = g.node(reader);
        let shape = g.initializer(r.input(1)?)?.to_i64_vec()?;
        let out = static_dims(g, Value::new(reader, 0))?;
        if out.last() != Some(&cols) || !matches!(shape.last(), Some(&l) if l == cols || l == -1) {
            return None;
        }
        if shape.last() == Some(&-1) && shape.iter().filter(|&&d| d == -1).count() != 1 {
            return None;
        }
        reshape = Some(reader);
        reader = only_reader(g, Value::new(reader, 0))?;
    }
    let split = g.node(reader);
    let Op::Split(sp) = &split.op else { return None };
    let x = Value::new(reshape.unwrap_or(n), 0);
    let rank = static_dims(g, x)?.len() as i64;
    let axis = sp.axis();
    if axis != rank - 1 && axis != -1 {
        return None;
    }
    let sizes: Vec<i64> = (0..split.num_outputs())
        .map(|s| static_dims(g, Value::new(reader, s as u16)).and_then(|d| d.last().copied()))
        .collect::<Option<_>>()?;
    if sizes.len() < 2 || sizes.iter().sum::<i64>() != cols || sizes.contains(&0) {
        return None;
    }
    // A weight (or bias) that joins others splits only at its parts' boundaries.
    let splits_at = |t: &Tensor, axis: usize| {
        let mut start = 0;
        // Inline data always slices (checked without copying it).
        !t.is_external()
            || sizes.iter().all(|&k| {
                let ok = slice_tensor(t, "", axis, start, start + k).is_ok();
                start += k;
                ok
            })
    };
    let bias = node.input(2).or(add.map(|(_, c)| c));
    if !splits_at(wt, weight_axis) || bias.is_some_and(|c| !splits_at(g.initializer(c).expect("checked"), 0)) {
        return None;
    }
    Some(Fused { gemm: n, add, reshape, split: reader, weight_axis, sizes })
}

/// The annotation of a rewritten initializer that says where its values are in the model as
/// written (an [`Origin`] as JSON; empty when not known), so that trained tensors go back
/// under the model's names ([`model_tensors`]). An initializer without it is its own name's
/// tensor of the model (in another shape where a rewrite reshaped it in place).
pub const ORIGIN: &str = "shardc_origin";

/// Where a rewritten initializer's values are in the model: the pieces it joins along
/// `axis`, in order.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Origin {
    /// The axis the pieces are joined along.
    pub axis: usize,
    /// The pieces, in order along `axis`.
    pub pieces: Vec<Piece>,
}

/// `len` entries along an [`Origin`]'s axis that hold the model's tensor `tensor`: all of
/// it (`slice: None`), or its elements `start..end` along an axis (`Some((axis, start, end))`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Piece {
    /// The model's tensor.
    pub tensor: String,
    /// Its extent along the joining axis.
    pub len: i64,
    /// The part of `tensor` it is, when not all of it.
    pub slice: Option<(usize, i64, i64)>,
}

/// The origin of initializer `v` of `g` (`None` when a rewrite could not say).
pub fn origin(g: &Graph, v: Value) -> Option<Origin> {
    match g.node(v.node).annotations.iter().find(|(k, _)| k == ORIGIN) {
        Some((_, s)) => serde_json::from_str(s).ok(),
        None => {
            let len = g.initializer(v).and_then(|t| t.dims.first().copied()).unwrap_or(1);
            Some(Origin { axis: 0, pieces: vec![Piece { tensor: g.value_name(v).to_string(), len, slice: None }] })
        }
    }
}

/// Records `o` as the origin of initializer `v` (nothing when `v` is all of the model's
/// tensor of its own name).
fn set_origin(g: &mut Graph, v: Value, o: Option<Origin>) {
    let whole = o.as_ref().is_some_and(|o| match &o.pieces[..] {
        [p] => {
            let extent = g.initializer(v).and_then(|t| t.dims.get(o.axis).copied());
            p.tensor == g.value_name(v) && p.slice.is_none_or(|(a, s, e)| a == o.axis && s == 0 && Some(e) == extent)
        }
        _ => false,
    });
    if !whole {
        let text = o.map(|o| serde_json::to_string(&o).expect("JSON")).unwrap_or_default();
        g.set_annotation(v.node, ORIGIN, text);
    }
}

/// The origin of elements `start..end` along `axis` of a tensor whose origin is `o`.
fn origin_slice(o: Option<Origin>, axis: usize, start: i64, end: i64) -> Option<Origin> {
    let o = o?;
    if let [p] = &o.pieces[..] {
        // One piece is the whole tensor: its slice is a slice of the piece.
        let slice = match p.slice {
            None => (axis, start, end),
            Some((a, s, _)) if a == axis => (a, s + start, s + end),
            Some(_) => return None,
        };
        return Some(Origin {
            axis,
            pieces: vec![Piece { tensor: p.tensor.clone(), len: end - start, slice: Some(slice) }],
        });
    }
    if o.axis != axis {
        return None;
    }
    let mut pieces = Vec::new();
    let mut at = 0;
    for p in &o.pieces {
        let (lo, hi) = (start.max(at), end.min(at + p.len));
        if lo < hi {
            let slice = if (lo, hi) == (at, at + p.len) {
                p.slice
            } else {
                match p.slice {
                    None => Some((axis, lo - at, hi - at)),
                    Some((a, s, _)) if a == axis => Some((a, s + lo - at, s + hi - at)),
                    Some(_) => return None,
                }
            };
            pieces.push(Piece { tensor: p.tensor.clone(), len: hi - lo, slice });
        }
        at += p.len;
    }
    Some(Origin { axis, pieces })
}

/// The origin of tensors of origins `os` and extents `lens` along `axis`, joined along it.
fn origin_concat(os: Vec<Option<Origin>>, lens: &[i64], axis: usize) -> Option<Origin> {
    let mut pieces: Vec<Piece> = Vec::new();
    for (o, &len) in os.into_iter().zip(lens) {
        let o = o?;
        let parts = match o.pieces.len() {
            1 => vec![Piece { len, ..o.pieces[0].clone() }],
            _ if o.axis == axis => o.pieces,
            _ => return None,
        };
        for p in parts {
            // Consecutive slices of one tensor along the joining axis are one slice.
            if let Some(last) = pieces.last_mut()
                && last.tensor == p.tensor
                && let (Some((a, s, e)), Some((b, s2, e2))) = (last.slice, p.slice)
                && a == axis
                && b == axis
                && e == s2
            {
                last.slice = Some((a, s, e2));
                last.len += p.len;
                continue;
            }
            pieces.push(p);
        }
    }
    Some(Origin { axis, pieces })
}

/// Trained tensors of a rewritten graph `g` (keyed by its initializers' names) under the
/// model's names and in its shapes (`dims`, the model's initializers' dims): a split
/// weight's parts are joined back, a joined weight is split into the weights it joined, a
/// weight reshaped in place takes its shape back. A tensor whose origin is not known, or
/// whose model tensors cannot all be put back whole, keeps its own name.
pub fn model_tensors(
    g: &Graph,
    dims: &std::collections::HashMap<String, Vec<usize>>,
    tensors: std::collections::BTreeMap<String, Array>,
) -> std::collections::BTreeMap<String, Array> {
    use std::collections::BTreeMap;
    let mut out = BTreeMap::new();
    // The tensors cut into fragments, kept to fall back on.
    let mut cut: BTreeMap<String, Array> = BTreeMap::new();
    // Per model tensor: its pieces (axis, start, end, values) and the tensors they came from.
    type Fragments = (Vec<(usize, i64, i64, Array)>, Vec<String>);
    let mut frags: BTreeMap<String, Fragments> = BTreeMap::new();
    for (name, a) in tensors {
        let o = match g.lookup(&name) {
            Some(v) if g.initializer(v).is_some() => origin(g, v),
            _ => None,
        };
        let Some(o) = o.filter(|o| o.axis < a.shape.len().max(1)) else {
            out.insert(name, a);
            continue;
        };
        let mut at = 0usize;
        for p in &o.pieces {
            let len = p.len.max(0) as usize;
            let part =
                if o.pieces.len() == 1 { a.clone() } else { a.slice_axis(o.axis, at, (at + len).min(a.shape[o.axis])) };
            at += len;
            match p.slice {
                None => {
                    let shape = dims.get(&p.tensor).filter(|d| d.iter().product::<usize>() == part.numel());
                    out.insert(
                        p.tensor.clone(),
                        match shape {
                            Some(d) => part.reshaped(d.clone()),
                            None => part,
                        },
                    );
                }
                Some((axis, s, e)) => {
                    let f = frags.entry(p.tensor.clone()).or_default();
                    f.0.push((axis, s, e, part));
                    f.1.push(name.clone());
                }
            }
        }
        if o.pieces.iter().any(|p| p.slice.is_some()) {
            cut.insert(name, a);
        }
    }
    for (tensor, (mut parts, from)) in frags {
        parts.sort_by_key(|p| p.1);
        let whole = dims.get(&tensor).is_some_and(|d| {
            let axis = parts[0].0;
            let mut at = 0;
            let fits = parts.iter().all(|(a, s, e, v)| {
                let ok = *a == axis
                    && *s == at
                    && v.shape.len() == d.len()
                    && v.shape.iter().zip(d).enumerate().all(|(i, (x, y))| i == axis || x == y);
                at = *e;
                ok
            });
            fits && axis < d.len() && at == d[axis] as i64
        });
        if whole {
            let arrays: Vec<&Array> = parts.iter().map(|p| &p.3).collect();
            out.insert(tensor, Array::concat_axis(&arrays, parts[0].0));
        } else {
            for n in from {
                let a = cut.get(&n).cloned().expect("a fragmented tensor is kept");
                out.insert(n, a);
            }
        }
    }
    out
}

/// The name of columns `start..end` along `axis` of the rank-`rank` tensor `name`, as numpy
/// would index them (`c_attn.weight` → `c_attn.weight[:,0:768]`): the module path stays the
/// fused layer's, so reports and framework exports name the module the user wrote.
fn part_name(g: &Graph, name: &str, rank: usize, axis: usize, start: i64, end: i64) -> String {
    let idx: Vec<String> = (0..rank).map(|a| if a == axis { format!("{start}:{end}") } else { ":".into() }).collect();
    g.fresh_name(&format!("{name}[{}]", idx.join(",")))
}

/// The columns `start..end` along `axis` of initializer tensor `t` named `name`.
fn slice_tensor(t: &Tensor, name: &str, axis: usize, start: i64, end: i64) -> Result<Tensor, String> {
    let mut dims = t.dims.clone();
    dims[axis] = end - start;
    if let Some(c) = t.external_concat()? {
        // A joined weight's columns that are one of its parts are that part.
        let mut at = 0;
        for (_, p) in &c.parts {
            if c.axis == axis && at == start && at + p.dims[axis] == end {
                return Ok(p.clone());
            }
            at += p.dims[c.axis];
        }
        return Err(format!("`{name}` joins other tensors, and {axis}:{start}:{end} is not one of them"));
    }
    let data = match &t.data {
        TensorData::External(entries) => {
            if entries.iter().any(|(k, _)| k.starts_with("shardc_slice")) {
                // Columns of columns: the same tensor's, offset (along the same axis, of a
                // slice not reshaped since).
                let at = t
                    .external_slice()?
                    .filter(|s| {
                        let mut d = s.full_dims.clone();
                        d[s.axis] = (s.end - s.start) as i64;
                        s.axis == axis && d == t.dims
                    })
                    .ok_or_else(|| format!("`{name}` is a slice along another axis, or reshaped since"))?;
                let e: Vec<(String, String)> = entries
                    .iter()
                    .map(|(k, v)| match k.as_str() {
                        "shardc_slice" => {
                            (k.clone(), format!("{axis}:{}:{}", at.start as i64 + start, at.start as i64 + end))
                        }
                        _ => (k.clone(), v.clone()),
                    })
                    .collect();
                return Ok(Tensor { dtype: t.dtype, dims, name: None, data: TensorData::External(e) });
            }
            let mut e: Vec<(String, String)> = entries.clone();
            e.push(("shardc_slice_of".into(), name.to_string()));
            e.push(("shardc_slice".into(), format!("{axis}:{start}:{end}")));
            e.push(("shardc_full_dims".into(), t.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")));
            TensorData::External(e)
        }
        _ => {
            let a = Array::from_tensor(t).map_err(|e| format!("`{name}`: {e}"))?;
            a.slice_axis(axis, start as usize, end as usize).to_tensor().data
        }
    };
    Ok(Tensor { dtype: t.dtype, dims, name: None, data })
}

/// Rewrites one match; returns the number of GEMMs it made.
fn rewrite(g: &mut Graph, f: &Fused) -> Result<usize, String> {
    let gemm = g.node(f.gemm).clone();
    let w = gemm.input(1).expect("matched");
    let w_name = g.value_name(w).to_string();
    let wt = g.initializer(w).expect("matched").clone();
    let c = gemm.input(2).or(f.add.map(|(_, c)| c));
    let bias = c.map(|c| (g.value_name(c).to_string(), g.initializer(c).expect("matched").clone()));
    let add = f.add.map(|(a, c)| (g.node(a).clone(), g.node(a).input(0) == Some(c)));
    let w_origin = origin(g, w);
    let c_origin = c.and_then(|c| origin(g, c));
    let label = g.node(f.gemm).label.clone().unwrap_or_else(|| g.op_name(f.gemm));
    let reshape = f.reshape.map(|r| {
        let node = g.node(r).clone();
        let shape_v = node.input(1).expect("matched");
        let shape = g.initializer(shape_v).expect("matched").clone();
        let label = node.label.clone().unwrap_or_else(|| g.op_name(r));
        let out_name = g.value_name(Value::new(r, 0)).to_string();
        (node, g.value_name(shape_v).to_string(), shape, label, out_name)
    });
    let split_outs: Vec<Value> = (0..f.sizes.len()).map(|s| Value::new(f.split, s as u16)).collect();
    let mut start = 0i64;
    let mut made = Vec::new();
    for (j, &size) in f.sizes.iter().enumerate() {
        let end = start + size;
        // A joined weight's part takes its own name back.
        let named = |g: &Graph, t: &Tensor, name: &str, rank: usize, axis: usize| match t.external_concat() {
            Ok(Some(c)) => g.fresh_name(&c.parts[j].0),
            _ => part_name(g, name, rank, axis, start, end),
        };
        let wj = slice_tensor(&wt, &w_name, f.weight_axis, start, end)?;
        let wj = g.add_initializer(named(g, &wt, &w_name, 2, f.weight_axis), wj);
        set_origin(g, wj, origin_slice(w_origin.clone(), f.weight_axis, start, end));
        let cj = match &bias {
            Some((name, ct)) => {
                let cj = g.add_initializer(named(g, ct, name, 1, 0), slice_tensor(ct, name, 0, start, end)?);
                set_origin(g, cj, origin_slice(c_origin.clone(), 0, start, end));
                Some(cj)
            }
            None => None,
        };
        let mut inputs = vec![gemm.input(0), Some(wj)];
        if cj.is_some() && add.is_none() {
            inputs.push(cj);
        }
        let y_name = g.fresh_name(&format!("{}_part{j}", g.value_name(Value::new(f.gemm, 0))));
        let yj =
            g.add_labeled_node(Some(format!("{label}_part{j}")), gemm.op.clone(), inputs, vec![Output::named(y_name)]);
        let mut out = Value::new(yj, 0);
        if let Some((a, bias_first)) = &add {
            let name = g.fresh_name(&format!("{}_part{j}", g.value_name(Value::new(f.add.expect("matched").0, 0))));
            let ins = if *bias_first { vec![cj, Some(out)] } else { vec![Some(out), cj] };
            let alabel = a.label.clone().map(|l| format!("{l}_part{j}"));
            out = Value::new(g.add_labeled_node(alabel, a.op.clone(), ins, vec![Output::named(name)]), 0);
        }
        if let Some((node, shape_name, shape, rlabel, r_out)) = &reshape {
            let mut s = shape.clone();
            let vals: Vec<i64> = s.to_i64_vec().expect("matched");
            let last = vals.len() - 1;
            if vals[last] != -1 {
                let mut v = vals.clone();
                v[last] = size;
                s.data = ir::TensorData::Int64(v);
            }
            let sv = g.add_initializer(g.fresh_name(&format!("{shape_name}_part{j}")), s);
            let r_name = g.fresh_name(&format!("{r_out}_part{j}"));
            let r = g.add_labeled_node(
                Some(format!("{rlabel}_part{j}")),
                node.op.clone(),
                vec![Some(out), Some(sv)],
                vec![Output::named(r_name)],
            );
            out = Value::new(r, 0);
        }
        made.push(out);
        start = end;
    }
    for (old, new) in split_outs.iter().zip(&made) {
        g.replace_all_uses(*old, *new);
    }
    // The old nodes go; their output names pass to the parts so the graph reads the same.
    let old_names: Vec<String> = split_outs.iter().map(|&v| g.value_name(v).to_string()).collect();
    g.remove_node(f.split);
    if let Some(r) = f.reshape {
        g.remove_node(r);
    }
    if let Some((a, _)) = f.add {
        g.remove_node(a);
    }
    g.remove_node(f.gemm);
    for (name, v) in old_names.iter().zip(&made) {
        g.rename(*v, name.clone());
    }
    crate::canonicalize::eliminate_unused_initializers(g);
    Ok(made.len())
}

/// Un-fuses every GEMM whose output is split (see the module documentation); returns
/// (fused GEMMs split, GEMMs made).
pub fn unfuse_split_gemm(g: &mut Graph) -> Result<(u64, u64), Located> {
    unfuse_split_gemm_where(g, &mut |_| true)
}

/// [`unfuse_split_gemm`] on the matches `pick` accepts (given their index in topological
/// order): rewrites apply one by one, in any subset, to the same effect.
pub fn unfuse_split_gemm_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<(u64, u64), Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let found: Vec<Fused> =
        order.iter().filter_map(|&n| find(g, n)).enumerate().filter(|(i, _)| pick(*i)).map(|(_, f)| f).collect();
    let mut made = 0;
    for f in &found {
        made += rewrite(g, f).map_err(|e| Located::at(g, f.gemm, e))? as u64;
    }
    Ok((found.len() as u64, made))
}

/// How `to` merges consecutive dims of `from` (only merges, no splits, no size-1 games): the
/// groups of `from`'s dims, one per dim of `to`.
fn merge_groups(from: &[i64], to: &[i64]) -> Option<Vec<std::ops::Range<usize>>> {
    let mut groups = Vec::with_capacity(to.len());
    let mut i = 0;
    for &t in to {
        let start = i;
        let mut p = 1i64;
        while p < t && i < from.len() {
            p *= from[i];
            i += 1;
        }
        if p != t || i == start {
            return None;
        }
        groups.push(start..i);
    }
    (i == from.len()).then_some(groups)
}

/// The permutation of transpose `t` of a rank-`rank` tensor (reversed dims when it has none).
fn transpose_perm(t: &ir::op::Transpose, rank: usize) -> Vec<usize> {
    match &t.perm {
        Some(p) => p.iter().map(|&i| i as usize).collect(),
        None => (0..rank).rev().collect(),
    }
}

/// `Reshape(Transpose(Reshape(x, s₁), π), s₂) = Transpose(x, π')` when `s₁` merges groups of
/// `x`'s consecutive dims, `π` permutes whole groups and `s₂` splits each group back into its
/// dims; `π'` is `π` with each group expanded. Exporters write a transpose of the last two
/// dims of `[b, h, s, d]` as this detour through `[b·h, s, d]`, and the merged `b·h` dim
/// cannot be split by heads; the folded transpose can.
pub fn fold_reshape_transpose(g: &mut Graph) -> Result<u64, Located> {
    fold_reshape_transpose_where(g, &mut |_| true)
}

/// [`fold_reshape_transpose`] on the matches `pick` accepts (in topological order).
pub fn fold_reshape_transpose_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let mut folded = 0;
    let mut matched = 0;
    for r2 in order {
        if !g.contains(r2) || !matches!(g.node(r2).op, Op::Reshape(_)) {
            continue;
        }
        let Some(t) = g.node(r2).input(0) else { continue };
        let Op::Transpose(tp) = &g.node(t.node).op else { continue };
        let Some(r1) = g.node(t.node).input(0) else { continue };
        if !matches!(g.node(r1.node).op, Op::Reshape(_))
            || only_reader(g, t) != Some(r2)
            || only_reader(g, r1) != Some(t.node)
        {
            continue;
        }
        let Some(x) = g.node(r1.node).input(0) else { continue };
        let (Some(xd), Some(d1), Some(d2)) = (static_dims(g, x), static_dims(g, r1), static_dims(g, Value::new(r2, 0)))
        else {
            continue;
        };
        let perm = transpose_perm(tp, d1.len());
        let Some(groups) = merge_groups(&xd, &d1) else { continue };
        let expanded: Vec<usize> = perm.iter().flat_map(|&i| groups[i].clone()).collect();
        let back: Vec<i64> = expanded.iter().map(|&i| xd[i]).collect();
        if back != d2 || expanded.len() != xd.len() {
            continue;
        }
        matched += 1;
        if !pick(matched - 1) {
            continue;
        }
        let label = g.node(r2).label.clone();
        let name = g.value_name(Value::new(r2, 0)).to_string();
        let perm = Some(expanded.iter().map(|&i| i as i64).collect());
        let tmp = g.fresh_name(&format!("{name}_folded"));
        let n = g.add_labeled_node(
            label,
            Op::Transpose(ir::op::Transpose { perm }),
            vec![Some(x)],
            vec![Output::named(tmp)],
        );
        g.replace_all_uses(Value::new(r2, 0), Value::new(n, 0));
        g.remove_node(r2);
        g.remove_node(t.node);
        g.remove_node(r1.node);
        g.rename(Value::new(n, 0), name);
        folded += 1;
    }
    if folded > 0 {
        crate::canonicalize::eliminate_unused_initializers(g);
    }
    Ok(folded)
}

/// `Transpose(Transpose(x, p), q) = Transpose(x, r)` with `r[j] = p[q[j]]` (`x` itself when
/// `r` is the identity and the outer transpose's output is not a graph output), when the inner
/// transpose has no other reader. Exporters transpose the keys to heads (`[b, s, h, d] →
/// [b, h, s, d]`) and then their last two dims for the scores' product: one data movement
/// written as two kernels, forward and backward.
pub fn compose_transposes(g: &mut Graph) -> Result<u64, Located> {
    compose_transposes_where(g, &mut |_| true)
}

/// [`compose_transposes`] on the matches `pick` accepts (in topological order).
pub fn compose_transposes_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let (mut matched, mut done) = (0, 0);
    for outer in order {
        if !g.contains(outer) {
            continue;
        }
        let Op::Transpose(q) = &g.node(outer).op else { continue };
        let Some(y) = g.node(outer).input(0) else { continue };
        let Op::Transpose(p) = &g.node(y.node).op else { continue };
        let Some(x) = g.node(y.node).input(0) else { continue };
        let Some(rank) = static_dims(g, x).map(|d| d.len()) else { continue };
        let (p, q) = (transpose_perm(p, rank), transpose_perm(q, rank));
        if p.len() != rank || q.len() != rank || only_reader(g, y) != Some(outer) {
            continue;
        }
        matched += 1;
        if !pick(matched - 1) {
            continue;
        }
        let r: Vec<usize> = q.iter().map(|&j| p[j]).collect();
        let out = Value::new(outer, 0);
        let name = g.value_name(out).to_string();
        // The composed transpose, or `x` itself for the identity (unless `out` is a graph
        // output, which keeps its name).
        let composed = if r.iter().enumerate().all(|(j, &i)| i == j) && !g.is_output(out) {
            None
        } else {
            let label = g.node(outer).label.clone();
            let tmp = g.fresh_name(&format!("{name}_composed"));
            let perm = Some(r.iter().map(|&i| i as i64).collect());
            let op = Op::Transpose(ir::op::Transpose { perm });
            Some(Value::new(g.add_labeled_node(label, op, vec![Some(x)], vec![Output::named(tmp)]), 0))
        };
        g.replace_all_uses(out, composed.unwrap_or(x));
        g.remove_node(outer);
        g.remove_node(y.node);
        if let Some(c) = composed {
            g.rename(c, name);
        }
        done += 1;
    }
    Ok(done)
}

/// `Transpose(Reshape(Gemm(Reshape(X, [R, K]), W, c), [r₁, …, r_k, N]), π) =
/// Reshape(Gemm(Reshape(Transpose(X, π ⊕ id), [R, K]), W, c), [r_π(1), …, r_π(k), N])` when `X`
/// is `[r₁, …, r_k, k₁, …]` (its leading dims the GEMM's rows, `R` their product, `K` the
/// rest's), `π` permutes those row dims only, and `X` is itself a transpose only this reads
/// (so [`compose_transposes`] joins the two: one kernel fewer). A GEMM is row-wise, so
/// permuting its rows before or after it is the same. PyTorch's `nn.MultiheadAttention` with
/// `batch_first` writes its output projection this way: heads `[b, h, s, d]` transposed to
/// `[s, b, h, d]`, merged into rows `s·b`, projected, and transposed back to `[b, s, e]`; the
/// rows `s·b` cannot keep a split of the batch, so every data-parallel plan reshards twice
/// around it. After the rewrite the rows are `b·s`.
pub fn transpose_before_gemm(g: &mut Graph) -> Result<u64, Located> {
    transpose_before_gemm_where(g, &mut |_| true)
}

/// [`transpose_before_gemm`] on the matches `pick` accepts (in topological order).
pub fn transpose_before_gemm_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let (mut matched, mut done) = (0, 0);
    for t2 in order {
        if !g.contains(t2) {
            continue;
        }
        let Op::Transpose(tp) = &g.node(t2).op else { continue };
        let Some(v) = g.node(t2).input(0) else { continue };
        if !matches!(g.node(v.node).op, Op::Reshape(_)) || only_reader(g, v) != Some(t2) {
            continue;
        }
        let Some(y) = g.node(v.node).input(0) else { continue };
        // Each output row from its input row alone: no bias with a value per row.
        let row_wise = match &g.node(y.node).op {
            Op::Gemm(gm) => {
                gm.trans_a() == 0
                    && g.node(y.node)
                        .input(2)
                        .is_none_or(|c| static_dims(g, c).is_some_and(|d| d.len() < 2 || d[0] == 1))
            }
            Op::MatMul(_) => g.node(y.node).input(1).and_then(|w| static_dims(g, w)).is_some_and(|d| d.len() == 2),
            _ => false,
        };
        if !row_wise || only_reader(g, y) != Some(v.node) {
            continue;
        }
        let Some(xr) = g.node(y.node).input(0) else { continue };
        if !matches!(g.node(xr.node).op, Op::Reshape(_)) || only_reader(g, xr) != Some(y.node) {
            continue;
        }
        let Some(x) = g.node(xr.node).input(0) else { continue };
        if !matches!(g.node(x.node).op, Op::Transpose(_)) || only_reader(g, x) != Some(xr.node) || g.is_output(x) {
            continue;
        }
        let (Some(xd), Some(rd), Some(od), Some(td)) =
            (static_dims(g, x), static_dims(g, xr), static_dims(g, v), static_dims(g, Value::new(t2, 0)))
        else {
            continue;
        };
        let q = od.len();
        if q < 2 || xd.len() < q {
            continue;
        }
        let perm = transpose_perm(tp, q);
        let k: i64 = xd.iter().skip(q - 1).product();
        if rd.len() != 2
            || perm.len() != q
            || perm[q - 1] != q - 1
            || xd[..q - 1] != od[..q - 1]
            || rd != [od[..q - 1].iter().product::<i64>(), k]
        {
            continue;
        }
        matched += 1;
        if !pick(matched - 1) {
            continue;
        }
        let label = g.node(y.node).label.clone().unwrap_or_else(|| g.op_name(y.node));
        let names: Vec<String> = [x, xr, y, Value::new(t2, 0)].iter().map(|&u| g.value_name(u).to_string()).collect();
        let p: Vec<i64> =
            perm[..q - 1].iter().chain(&(q - 1..xd.len()).collect::<Vec<_>>()).map(|&i| i as i64).collect();
        let tmp = g.fresh_name(&format!("{}_rows", names[0]));
        let xt = g.add_labeled_node(
            Some(format!("{label}/rows")),
            Op::Transpose(ir::op::Transpose { perm: Some(p) }),
            vec![Some(x)],
            vec![Output::named(tmp)],
        );
        let xt = Value::new(xt, 0);
        let x2 = reshaped(g, xt, rd, &label, &names[3], "rows_2d");
        let mut inputs = g.node(y.node).inputs().to_vec();
        inputs[0] = Some(x2);
        let op = g.node(y.node).op.clone();
        let gemm_label = g.node(y.node).label.clone();
        let tmp = g.fresh_name(&format!("{}_rows", names[2]));
        let y2 = Value::new(g.add_labeled_node(gemm_label, op, inputs, vec![Output::named(tmp)]), 0);
        let out = reshaped(g, y2, td, &label, &names[3], "output");
        g.replace_all_uses(Value::new(t2, 0), out);
        g.remove_node(t2);
        g.remove_node(v.node);
        g.remove_node(y.node);
        g.remove_node(xr.node);
        g.rename(y2, names[2].clone());
        g.rename(x2, names[1].clone());
        g.rename(out, names[3].clone());
        done += 1;
    }
    if done > 0 {
        crate::canonicalize::eliminate_unused_initializers(g);
    }
    Ok(done)
}

/// `v` reshaped to the constant `shape` by a new `Reshape` labelled `{label}/{what}`, its
/// output and shape named after `y_name` (the rewritten op's output).
fn reshaped(g: &mut Graph, v: Value, shape: Vec<i64>, label: &str, y_name: &str, what: &str) -> Value {
    let sv = g.add_initializer(
        g.fresh_name(&format!("{y_name}_{what}_shape")),
        Tensor::from_i64(vec![shape.len() as i64], shape),
    );
    let out = g.fresh_name(&format!("{y_name}_{what}"));
    let r = g.add_labeled_node(
        Some(format!("{label}/{what}")),
        Op::Reshape(ir::op::Reshape::default()),
        vec![Some(v), Some(sv)],
        vec![Output::named(out)],
    );
    Value::new(r, 0)
}

/// `X · Transpose(W) = Reshape(Gemm(Reshape(X, [R, K]), W, transB = 1), [.., N])` for a 2-D
/// parameter `W` (`R` the product of `X`'s leading dims; no reshapes when `X` is 2-D). A model
/// that ties its output projection to its embedding table (GPT-2's `lm_head`) reads the table
/// through a `Transpose`: its gradient there is a computed value's, reduced across the devices
/// that split the batch in the backward pass and then summed into the table's, which is
/// synchronised again. Read by the `Gemm`, it is the parameter's own gradient, synchronised
/// once with the table's other reader's, and the transpose kernel is gone. The `Transpose` is
/// removed when nothing else reads it.
pub fn transpose_into_gemm(g: &mut Graph) -> Result<u64, Located> {
    transpose_into_gemm_where(g, &mut |_| true)
}

/// [`transpose_into_gemm`] on the matches `pick` accepts (in topological order).
pub fn transpose_into_gemm_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let (mut matched, mut done) = (0, 0);
    for n in order {
        if !g.contains(n) || !matches!(g.node(n).op, Op::MatMul(_)) {
            continue;
        }
        let (Some(x), Some(t)) = (g.node(n).input(0), g.node(n).input(1)) else { continue };
        let Op::Transpose(tp) = &g.node(t.node).op else { continue };
        if tp.perm.as_ref().is_some_and(|p| p[..] != [1, 0]) {
            continue;
        }
        let Some(w) = g.node(t.node).input(0) else { continue };
        let (Some(xd), Some(wd), Some(yd)) = (static_dims(g, x), static_dims(g, w), static_dims(g, Value::new(n, 0)))
        else {
            continue;
        };
        if !ir::cost::is_param(g, w) || wd.len() != 2 || xd.len() < 2 || xd[xd.len() - 1] != wd[1] {
            continue;
        }
        matched += 1;
        if !pick(matched - 1) {
            continue;
        }
        let label = g.node(n).label.clone().unwrap_or_else(|| g.op_name(n));
        let y_name = g.value_name(Value::new(n, 0)).to_string();
        let reshape =
            |g: &mut Graph, v: Value, shape: Vec<i64>, what: &str| reshaped(g, v, shape, &label, &y_name, what);
        let rows: i64 = xd[..xd.len() - 1].iter().product();
        let x2 = if xd.len() == 2 { x } else { reshape(g, x, vec![rows, wd[1]], "rows") };
        let gemm = ir::op::Gemm { trans_b: Some(1), ..Default::default() };
        let out = g.fresh_name(&format!("{y_name}_gemm"));
        let gm =
            g.add_labeled_node(Some(label.clone()), Op::Gemm(gemm), vec![Some(x2), Some(w)], vec![Output::named(out)]);
        let y = if xd.len() == 2 { Value::new(gm, 0) } else { reshape(g, Value::new(gm, 0), yd, "output") };
        g.replace_all_uses(Value::new(n, 0), y);
        g.remove_node(n);
        if unread(g, t) {
            g.remove_node(t.node);
        }
        g.rename(y, y_name);
        done += 1;
    }
    Ok(done)
}

/// `Conv(X, W, B) = Reshape(Reshape(W, [M, C]) · Reshape(X, [N, C, S]) + Reshape(B, [M, 1]), [N, M, s₁, …])`
/// for a convolution of one group whose kernel is 1 in every spatial dim, with unit strides and
/// no padding (dilations do not matter for a 1-wide kernel); `S = s₁·s₂·…`. A pointwise
/// convolution (ResNet's bottlenecks, MobileNet's and SqueezeNet's 1×1 layers) is then a
/// batched GEMM the search shards as one (`b0` samples, `m` filters, `k` channels as partial
/// sums, `n` the spatial positions) and the runtime runs with its GEMM kernels. Not in the
/// default [`Algebra`] pass: the GEMM and its bias `Add` are two kernels where the convolution
/// was one, which only pays where GEMMs run faster than convolutions; the search tries it
/// ([`SEARCH_CHOICES`], [`crate::autoshard::search_rewriting`]) and the `conv-as-matmul` pass
/// ([`ConvAsMatMul`]) applies it. The reshapes are views; the batch dim is copied (`0`),
/// so the rewritten graph still takes another batch. A weight or bias initializer only the
/// convolution reads keeps its name and bytes and takes the new shape (`[M, C]`, `[M, 1]`).
pub fn conv_as_matmul(g: &mut Graph) -> Result<u64, Located> {
    conv_as_matmul_where(g, &mut |_| true)
}

/// The shape of a pointwise convolution `n`: (channels `C`, filters `M`, output dims).
fn pointwise(g: &Graph, n: NodeId) -> Option<(i64, i64, Vec<i64>)> {
    let node = g.node(n);
    let Op::Conv(c) = &node.op else { return None };
    let x = node.input(0)?;
    let w = node.input(1)?;
    let xt = g.tensor_type(x)?;
    if !xt.dtype.is_float() {
        return None;
    }
    let xd = xt.dims.as_ref()?;
    let wd = static_dims(g, w)?;
    let yd = g.tensor_type(Value::new(n, 0))?.dims.clone()?;
    let rank = xd.len();
    let all = |v: &Option<Vec<i64>>, want: i64, len: usize| {
        v.as_ref().is_none_or(|v| v.len() == len && v.iter().all(|&d| d == want))
    };
    if c.group.unwrap_or(1) != 1 || rank < 3 || wd.len() != rank || wd[2..].iter().any(|&k| k != 1) {
        return None;
    }
    if !all(&c.kernel_shape, 1, rank - 2) || !all(&c.strides, 1, rank - 2) || !all(&c.pads, 0, 2 * (rank - 2)) {
        return None;
    }
    // Every dim but the batch known; the output's spatial dims are the input's.
    let known = |d: &[ir::Dim]| d[1..].iter().map(ir::Dim::value).collect::<Option<Vec<i64>>>();
    let (xs, ys) = (known(xd)?, known(&yd)?);
    if xs[0] != wd[1] || ys[0] != wd[0] || xs[1..] != ys[1..] {
        return None;
    }
    Some((wd[1], wd[0], ys))
}

/// [`conv_as_matmul`] on the matches `pick` accepts (in topological order).
pub fn conv_as_matmul_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let (mut matched, mut done) = (0, 0);
    for n in order {
        if !g.contains(n) {
            continue;
        }
        let Some((c, m, ys)) = pointwise(g, n) else { continue };
        matched += 1;
        if !pick(matched - 1) {
            continue;
        }
        let node = g.node(n).clone();
        let label = node.label.clone().unwrap_or_else(|| g.op_name(n));
        let y_name = g.value_name(Value::new(n, 0)).to_string();
        let s: i64 = ys[1..].iter().product();
        let reshape =
            |g: &mut Graph, v: Value, shape: Vec<i64>, what: &str| reshaped(g, v, shape, &label, &y_name, what);
        // A parameter read by this convolution alone takes its new shape itself (same values,
        // same bytes): the trainer and the cost model see a parameter, not a reshape of one.
        let mut renamed = Vec::new();
        let mut param = |g: &mut Graph, v: Value, dims: Vec<i64>, what: &str| -> Result<Value, Located> {
            let own = g.users(v).len() == 1 && !g.is_output(v);
            match g.initializer(v) {
                Some(t) if own && matches!(t.external_slice(), Ok(None)) && matches!(t.external_concat(), Ok(None)) => {
                    let name = g.value_name(v).to_string();
                    // External data is described as all of the original tensor (so drawn
                    // weights are drawn as the original's, then take the new shape).
                    let t = match &t.data {
                        TensorData::External(_) => slice_tensor(t, &name, 0, 0, t.dims[0]).map_err(Located::global)?,
                        _ => t.clone(),
                    };
                    let t = Tensor { dims, ..t };
                    let nv = g.add_initializer(g.fresh_name(&format!("{name}_{what}")), t);
                    renamed.push((v.node, nv, name));
                    Ok(nv)
                }
                _ => Ok(reshape(g, v, dims, what)),
            }
        };
        let (x, w) = (node.input(0).expect("matched"), node.input(1).expect("matched"));
        let wm = param(g, w, vec![m, c], "weight")?;
        let xm = reshape(g, x, vec![0, c, s], "columns");
        let prod = g.fresh_name(&format!("{y_name}_gemm"));
        let mm = g.add_labeled_node(
            Some(label.clone()),
            Op::MatMul(ir::op::MatMul::default()),
            vec![Some(wm), Some(xm)],
            vec![Output::named(prod)],
        );
        let mut out = Value::new(mm, 0);
        if let Some(b) = node.input(2) {
            let bm = param(g, b, vec![m, 1], "bias")?;
            let sum = g.fresh_name(&format!("{y_name}_biased"));
            let add = g.add_labeled_node(
                Some(format!("{label}/bias")),
                Op::Add(ir::op::Add::default()),
                vec![Some(out), Some(bm)],
                vec![Output::named(sum)],
            );
            out = Value::new(add, 0);
        }
        let back: Vec<i64> = std::iter::once(0).chain(ys.iter().copied()).collect();
        let y = reshape(g, out, back, "output");
        g.replace_all_uses(Value::new(n, 0), y);
        g.remove_node(n);
        g.rename(y, y_name);
        for (old, new, name) in renamed {
            g.remove_node(old);
            g.rename(new, name);
        }
        done += 1;
    }
    Ok(done)
}

/// One GEMM of a group that [`fuse_gemms`] joins: the node, the bias `Add` after a `MatMul`
/// (when the group's biases are joined too), its output columns.
struct Sharer {
    gemm: NodeId,
    add: Option<NodeId>,
    /// The bias: the `Gemm`'s `C` or the added initializer.
    bias: Option<Value>,
    cols: i64,
}

/// What a GEMM reading `x` looks like to [`fuse_gemms`]: its group key (op kind, transB, has
/// a bias) and the part; `None` when it is not a GEMM by a weight only it reads.
fn sharer(g: &Graph, n: NodeId, x: Value) -> Option<((u8, i64, bool), Sharer, usize)> {
    let node = g.node(n);
    if node.input(0) != Some(x) {
        return None;
    }
    let own = |v: Value, by: NodeId| {
        g.initializer(v).is_some() && g.users(v).iter().all(|&(u, _)| u == by) && !g.is_output(v)
    };
    let (kind, trans_b, weight_axis) = match &node.op {
        Op::MatMul(_) => (0u8, 0, 1),
        Op::Gemm(gm) if gm.trans_a() == 0 && gm.alpha() == 1.0 && gm.beta() == 1.0 => {
            (1, gm.trans_b(), usize::from(gm.trans_b() == 0))
        }
        _ => return None,
    };
    let w = node.input(1)?;
    let wt = g.initializer(w)?;
    if !own(w, n) || wt.dims.len() != 2 || !wt.dtype.is_float() || node.inputs().len() > 3 {
        return None;
    }
    let cols = wt.dims[weight_axis];
    let y = Value::new(n, 0);
    if static_dims(g, y)?.last() != Some(&cols) {
        return None;
    }
    // A bias: the `Gemm`'s `C` of `cols` values only it reads, or one added to a MatMul's
    // output alone.
    let (add, bias) = match node.input(2) {
        Some(c) if !(own(c, n) && g.initializer(c).is_some_and(|t| t.dims == [cols])) => return None,
        Some(c) => (None, Some(c)),
        None if kind == 0 => bias_add(g, y, cols).map_or((None, None), |(a, c)| (Some(a), Some(c))),
        None => (None, None),
    };
    Some(((kind, trans_b, bias.is_some()), Sharer { gemm: n, add, bias, cols }, weight_axis))
}

/// The groups [`fuse_gemms`] joins, in topological order of their first GEMM: GEMMs of one
/// kind reading the same input, at least two.
fn sharing_groups(g: &Graph, order: &[NodeId]) -> Vec<(Vec<Sharer>, usize)> {
    let mut groups = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for &n in order {
        let Some(x) = g.node(n).input(0) else { continue };
        if seen.contains(&n) || !matches!(g.node(n).op, Op::MatMul(_) | Op::Gemm(_)) {
            continue;
        }
        let Some((key, _, _)) = sharer(g, n, x) else { continue };
        // The readers of `x` in topological order that match `n`'s kind.
        let mut readers: Vec<NodeId> = g.users(x).iter().map(|&(u, _)| u).collect();
        readers.sort_by_key(|u| order.iter().position(|o| o == u));
        readers.dedup();
        let mut parts = Vec::new();
        let mut axis = 1;
        for u in readers {
            if let Some((k, part, a)) = sharer(g, u, x)
                && k == key
                && !seen.contains(&u)
            {
                seen.insert(u);
                axis = a;
                parts.push(part);
            }
        }
        let external = |v: Option<Value>| v.and_then(|v| g.initializer(v)).map(|t| t.is_external());
        // Weights (and biases) all inline or all external, of one dtype.
        let kinds: std::collections::HashSet<_> = parts
            .iter()
            .map(|p| {
                let w = g.node(p.gemm).input(1);
                (external(w), w.and_then(|w| g.initializer(w)).map(|t| t.dtype), external(p.bias))
            })
            .collect();
        if parts.len() >= 2 && kinds.len() == 1 {
            groups.push((parts, axis));
        }
    }
    groups
}

/// The name of a node that joins the nodes labelled `labels`: their common path, then the
/// rest of each (`…/self/{query/MatMul+key/MatMul+value/MatMul}`).
fn joined_label(labels: &[String]) -> String {
    let first = &labels[0];
    let mut cut = first.len();
    for l in &labels[1..] {
        cut = cut.min(first.bytes().zip(l.bytes()).take_while(|(a, b)| a == b).count());
    }
    let cut = first[..cut].rfind('/').map_or(0, |i| i + 1);
    format!("{}{{{}}}", &first[..cut], labels.iter().map(|l| &l[cut..]).collect::<Vec<_>>().join("+"))
}

/// The initializers `vs` joined along `axis` as one (inline values concatenated; external data
/// described as the parts, see [`ir::ExternalConcat`]), named after them.
fn join_initializers(g: &mut Graph, vs: &[Value], axis: usize) -> Result<Value, String> {
    let names: Vec<String> = vs.iter().map(|&v| g.value_name(v).to_string()).collect();
    let ts: Vec<Tensor> = vs.iter().map(|&v| g.initializer(v).expect("matched").clone()).collect();
    let (name, t) = if ts[0].is_external() {
        let parts: Vec<(String, Tensor)> = names.iter().cloned().zip(ts).collect();
        Tensor::concat_external(axis, &parts)?
    } else {
        let arrays = ts.iter().map(Array::from_tensor).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
        (None, Array::concat_axis(&arrays.iter().collect::<Vec<_>>(), axis).to_tensor())
    };
    let name = name.unwrap_or_else(|| names.join("+"));
    let lens: Vec<i64> = vs.iter().map(|&v| g.initializer(v).expect("matched").dims[axis]).collect();
    let o = origin_concat(vs.iter().map(|&v| origin(g, v)).collect(), &lens, axis);
    let v = g.add_initializer(g.fresh_name(&name), t);
    set_origin(g, v, o);
    Ok(v)
}

/// How a group's outputs are read when each is split into heads: through a chain of
/// `Reshape`s apiece (each the only reader of the one before), the last making
/// `prefix ++ [heads, width]` of a part of `heads · width` columns, with the same prefix and
/// head count for all.
struct HeadSplit {
    /// Per part, its chain of reshapes.
    reshapes: Vec<Vec<NodeId>>,
    /// Per part, a bias added before the reshapes that is not one of the group's (a value of
    /// the part's width that other ops may read too): the `Add` and the bias.
    biases: Vec<Option<(NodeId, Value)>>,
    heads: i64,
    widths: Vec<i64>,
    prefix: Vec<i64>,
}

fn head_split(g: &Graph, outs: &[Value], parts: &[Sharer]) -> Option<HeadSplit> {
    let mut hs =
        HeadSplit { reshapes: Vec::new(), biases: Vec::new(), heads: 0, widths: Vec::new(), prefix: Vec::new() };
    for (&o, p) in outs.iter().zip(parts) {
        let rows: i64 = static_dims(g, o)?.iter().rev().skip(1).product();
        let mut chain = Vec::new();
        let mut v = o;
        let bias = added_to(g, o).filter(|&(_, c)| static_dims(g, c) == Some(vec![p.cols]));
        if let Some((a, _)) = bias {
            v = Value::new(a, 0);
        }
        let dims = loop {
            let r = only_reader(g, v)?;
            if !matches!(g.node(r).op, Op::Reshape(_)) || chain.len() >= 4 {
                return None;
            }
            chain.push(r);
            v = Value::new(r, 0);
            let dims = static_dims(g, v)?;
            let n = dims.len();
            if n >= 3 && dims[n - 2] * dims[n - 1] == p.cols && dims[..n - 2].iter().product::<i64>() == rows {
                break dims;
            }
        };
        let n = dims.len();
        if (hs.heads != 0 && (hs.heads != dims[n - 2] || hs.prefix != dims[..n - 2])) || dims[n - 2] < 2 {
            return None;
        }
        hs.heads = dims[n - 2];
        hs.prefix = dims[..n - 2].to_vec();
        hs.reshapes.push(chain);
        hs.biases.push(bias);
        hs.widths.push(dims[n - 1]);
    }
    Some(hs)
}

/// The initializers `vs` joined along `axis` head by head: for each of `heads` heads, each
/// part's columns of that head (`widths[j]` of them) in turn. Named after the parts.
fn interleave_initializers(
    g: &mut Graph,
    vs: &[Value],
    axis: usize,
    heads: i64,
    widths: &[i64],
) -> Result<Value, String> {
    let names: Vec<String> = vs.iter().map(|&v| g.value_name(v).to_string()).collect();
    let mut pieces = Vec::new();
    for h in 0..heads {
        for (j, &v) in vs.iter().enumerate() {
            let t = g.initializer(v).expect("matched").clone();
            let (start, end) = (h * widths[j], (h + 1) * widths[j]);
            let piece = slice_tensor(&t, &names[j], axis, start, end)?;
            let name = part_name(g, &names[j], t.dims.len(), axis, start, end);
            let o = origin_slice(origin(g, v), axis, start, end);
            let pv = g.add_initializer(name, piece);
            set_origin(g, pv, o);
            pieces.push(pv);
        }
    }
    let joined = join_initializers(g, &pieces, axis)?;
    // Parts that are columns of one tensor (un-fused from it) name it once.
    let whole: Vec<&str> = names.iter().map(|n| n.split_once('[').map_or(n.as_str(), |(t, _)| t)).collect();
    let base = if whole.iter().all(|w| *w == whole[0]) { whole[0].to_string() } else { names.join("+") };
    g.rename(joined, g.fresh_name(&format!("{base} by heads")));
    Ok(joined)
}

/// Fuses one group; returns nothing (the group's outputs keep their names).
fn fuse_group(g: &mut Graph, parts: &[Sharer], weight_axis: usize) -> Result<(), String> {
    let first = g.node(parts[0].gemm).clone();
    let x = first.input(0).expect("matched");
    let weights: Vec<Value> = parts.iter().map(|p| g.node(p.gemm).input(1).expect("matched")).collect();
    let biases: Vec<Value> = parts.iter().filter_map(|p| p.bias).collect();
    let labels: Vec<String> =
        parts.iter().map(|p| g.node(p.gemm).label.clone().unwrap_or_else(|| g.op_name(p.gemm))).collect();
    let outs: Vec<Value> = parts.iter().map(|p| Value::new(p.add.unwrap_or(p.gemm), 0)).collect();
    let out_names: Vec<String> = outs.iter().map(|&v| g.value_name(v).to_string()).collect();
    let rank = static_dims(g, outs[0]).expect("matched").len();
    let label = joined_label(&labels);
    let heads = head_split(g, &outs, parts);
    let (wf, bf) = match &heads {
        Some(h) => (
            interleave_initializers(g, &weights, weight_axis, h.heads, &h.widths)?,
            (!biases.is_empty()).then(|| interleave_initializers(g, &biases, 0, h.heads, &h.widths)).transpose()?,
        ),
        None => (
            join_initializers(g, &weights, weight_axis)?,
            (!biases.is_empty()).then(|| join_initializers(g, &biases, 0)).transpose()?,
        ),
    };
    let mut inputs = vec![Some(x), Some(wf)];
    if first.input(2).is_some() {
        inputs.push(bf);
    }
    let yname = g.fresh_name(&format!("{}_fused", out_names[0]));
    let fused = g.add_labeled_node(Some(label.clone()), first.op.clone(), inputs, vec![Output::named(yname)]);
    let mut y = Value::new(fused, 0);
    if let (Some(a), Some(bf)) = (parts[0].add, bf) {
        let name = g.fresh_name(&format!("{}_biased", out_names[0]));
        let add = g.add_labeled_node(
            Some(format!("{label}/bias")),
            g.node(a).op.clone(),
            vec![Some(y), Some(bf)],
            vec![Output::named(name)],
        );
        y = Value::new(add, 0);
    }
    // Split into heads first when the parts are: `[.., H·Σd] → [.., H, Σd]`, then the parts
    // along the last axis, each `[.., H, d_j]` as its own reshape made it.
    let (plain, plain_names) = (outs.clone(), out_names.clone());
    let (mut outs, mut out_names, mut rank, mut sizes) =
        (outs, out_names, rank, parts.iter().map(|p| p.cols).collect::<Vec<i64>>());
    if let Some(h) = &heads {
        let mut shape = h.prefix.clone();
        shape.extend([h.heads, h.widths.iter().sum()]);
        y = reshaped(g, y, shape, &label, &out_names[0], "heads");
        outs = h.reshapes.iter().map(|c| Value::new(*c.last().expect("a reshape"), 0)).collect();
        out_names = outs.iter().map(|&v| g.value_name(v).to_string()).collect();
        rank = h.prefix.len() + 2;
        sizes = h.widths.clone();
    }
    let axis = rank as i64 - 1;
    let (split_op, split_inputs) = if g.opset >= 13 {
        let sv = g.add_initializer(
            g.fresh_name(&format!("{}_sizes", out_names[0])),
            Tensor::from_i64(vec![sizes.len() as i64], sizes.clone()),
        );
        (ir::op::Split { axis: Some(axis), ..Default::default() }, vec![Some(y), Some(sv)])
    } else {
        (ir::op::Split { axis: Some(axis), split: Some(sizes.clone()), ..Default::default() }, vec![Some(y)])
    };
    let split_outs: Vec<Output> = out_names.iter().map(|n| Output::named(g.fresh_name(&format!("{n}_part")))).collect();
    let split = g.add_labeled_node(Some(format!("{label}/split")), Op::Split(split_op), split_inputs, split_outs);
    let mut finals: Vec<Value> = (0..outs.len()).map(|j| Value::new(split, j as u16)).collect();
    // A part with a bias of its own added before its reshapes (a value other ops may read
    // too): the part reshaped back to its columns, `[.., H, d_j] → [.., H·d_j]`, is what the
    // part's GEMM made, so its bias add and reshapes stay as they were.
    if let Some(h) = &heads {
        for (j, b) in h.biases.iter().enumerate() {
            if b.is_some() {
                finals[j] = reshaped(
                    g,
                    finals[j],
                    static_dims(g, plain[j]).expect("matched"),
                    &label,
                    &plain_names[j],
                    &format!("cols{j}"),
                );
                outs[j] = plain[j];
                out_names[j] = plain_names[j].clone();
            }
        }
    }
    for (j, &o) in outs.iter().enumerate() {
        g.replace_all_uses(o, finals[j]);
    }
    // The reshapes into heads of the parts without such a bias are the split's now.
    let chains = heads.iter().flat_map(|h| h.reshapes.iter().zip(&h.biases)).filter(|(_, b)| b.is_none());
    for r in chains.flat_map(|(c, _)| c.iter().rev()).copied().collect::<Vec<_>>() {
        let shape = g.node(r).input(1);
        g.remove_node(r);
        // Its shape, when a `Constant` nothing else reads.
        if let Some(c) = shape
            && matches!(g.node(c.node).op, Op::Constant(_))
            && unread(g, c)
        {
            g.remove_node(c.node);
        }
    }
    for p in parts {
        if let Some(a) = p.add {
            g.remove_node(a);
        }
        g.remove_node(p.gemm);
    }
    for (j, name) in out_names.into_iter().enumerate() {
        g.rename(finals[j], name);
    }
    Ok(())
}

/// `(X·W₀ + c₀, X·W₁ + c₁, …) = Split(X·[W₀|W₁|…] + [c₀|c₁|…], last axis)`: GEMMs that read
/// the same input, each by a weight (and bias) only it reads, become one GEMM by the joined
/// weight and a `Split` of its columns — the inverse of [`unfuse_split_gemm`]. Where every
/// part is then split into heads (reshaped, through a chain of reshapes, to `[.., H, d_j]`,
/// the same `H` and leading dims for all), the joined weight holds the parts' columns head by
/// head and the GEMM's output is reshaped to `[.., H, Σd_j]` and split along its last axis:
/// `Reshape(X·W_j + c_j, [.., H, d_j]) = Split(Reshape(X·W' + c', [.., H, Σd]), last axis)`,
/// so that a column split of the one GEMM is a split by heads (GPT-2's attention keeps one
/// GEMM and splits by heads). Attention's
/// query, key and value projections (BERT's three `MatMul`s and bias `Add`s) become one
/// GEMM, one bias add and a split: fewer, larger kernels, the input read once; but a column
/// split of the joined weight mixes the parts, so it trades against head-parallel plans, and
/// the search chooses ([`SEARCH_CHOICES`]). Matched: `MatMul`s by a 2-D weight, or `Gemm`s
/// with `transA = 0`, `alpha = beta = 1` and one `transB`, all with biases (a `Gemm`'s 1-D
/// `C`, or an `Add` of a 1-D initializer to the `MatMul`'s output) or all without. Joined
/// weights are named after their parts (`a+b+c`), or after the tensor they were split from
/// when the parts are its slices in order (so fusing undoes un-fusing).
pub fn fuse_gemms(g: &mut Graph) -> Result<u64, Located> {
    fuse_gemms_where(g, &mut |_| true)
}

/// [`fuse_gemms`] on the groups `pick` accepts (in topological order of their first GEMM).
pub fn fuse_gemms_where(g: &mut Graph, pick: &mut dyn FnMut(usize) -> bool) -> Result<u64, Located> {
    let order = g.topo_order().map_err(|_| Located::global("the graph has a cycle"))?;
    let mut done = 0;
    for (i, (parts, axis)) in sharing_groups(g, &order).into_iter().enumerate() {
        if !pick(i) {
            continue;
        }
        let at = parts[0].gemm;
        fuse_group(g, &parts, axis).map_err(|e| Located::at(g, at, e))?;
        done += 1;
    }
    if done > 0 {
        crate::canonicalize::eliminate_unused_initializers(g);
    }
    Ok(done)
}

/// The rewrites the search chooses ([`crate::autoshard::search_rewriting`]): each is tried on
/// the whole graph and kept when the plan of the rewritten graph is priced faster.
pub const SEARCH_CHOICES: &[&str] = &["fuse-attention", "conv-as-matmul", "fuse-gemms"];

/// The places the rewrite `name` would rewrite in `g`, in the order its `_where` form counts
/// them, named by the label its rewritten ops keep (the node's label, else its op name);
/// `None` for a rule whose places are not one node (`fuse-gemms` joins several GEMMs,
/// `fuse-attention` the ops of an attention).
pub fn sites(g: &Graph, name: &str) -> Option<Vec<String>> {
    match name {
        "conv-as-matmul" => {
            let order = g.topo_order().ok()?;
            Some(
                order
                    .into_iter()
                    .filter(|&n| pointwise(g, n).is_some())
                    .map(|n| g.node(n).label.clone().unwrap_or_else(|| g.op_name(n)))
                    .collect(),
            )
        }
        _ => None,
    }
}

/// [`apply_named`] at the places of [`sites`] named in `at` only.
pub fn apply_named_at(g: &mut Graph, name: &str, at: &[String]) -> Result<u64, String> {
    let all = sites(g, name).ok_or_else(|| format!("`{name}` is not made place by place"))?;
    for l in at {
        if !all.contains(l) {
            return Err(format!("`{name}` does not apply at `{l}`"));
        }
    }
    let mut pick = |i: usize| at.contains(&all[i]);
    let n = match name {
        "conv-as-matmul" => conv_as_matmul_where(g, &mut pick).map_err(|e| e.msg)?,
        _ => unreachable!("sites() is None"),
    };
    reinfer(g, n)
}

/// `n` (the rewrites just made in `g`), after inferring `g`'s shapes again when there were any.
fn reinfer(g: &mut Graph, n: u64) -> Result<u64, String> {
    if n > 0 {
        ir::infer::infer_shapes(g, ir::infer::Mode::Check)
            .map_err(|e| e.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("; "))?;
    }
    Ok(n)
}

/// Applies the rewrite `name` (one of [`SEARCH_CHOICES`]) to every match and infers shapes
/// again; returns how many it rewrote.
pub fn apply_named(g: &mut Graph, name: &str) -> Result<u64, String> {
    let n = match name {
        "conv-as-matmul" => conv_as_matmul(g).map_err(|e| e.msg)?,
        "fuse-gemms" => fuse_gemms(g).map_err(|e| e.msg)?,
        "fuse-attention" => crate::fuse_attention::fuse_attention(g).map_err(|e| e.msg)?,
        _ => return Err(format!("`{name}` is not a rewrite the search chooses ({})", SEARCH_CHOICES.join(", "))),
    };
    reinfer(g, n)
}

/// Infers the types of `g`'s values when some are not known: the rewrites match on shapes,
/// so `--passes algebra` alone does what `--passes infer-shapes,algebra` does.
fn typed(g: &mut Graph, pass: &'static str) -> Result<(), PassError> {
    let order = g.topo_order().map_err(|_| PassError::new(pass, Located::global("the graph has a cycle")))?;
    let unknown = order.iter().any(|&n| g.node(n).outputs().iter().any(|o| !o.name.is_empty() && o.ty.is_none()));
    if unknown {
        ir::infer::infer_shapes(g, ir::infer::Mode::Check).map_err(|errs| PassError::shapes(pass, errs))?;
    }
    Ok(())
}

/// A pass that makes one rewrite everywhere: shapes inferred first where unknown, `rule`
/// made, the count added to the statistic `stat`, shapes inferred again after any rewrite.
pub(crate) fn run_rewrite(
    g: &mut Graph,
    cx: &mut PassCx<'_>,
    pass: &'static str,
    stat: &str,
    rule: fn(&mut Graph) -> Result<u64, Located>,
) -> Result<Changed, PassError> {
    typed(g, pass)?;
    let n = rule(g).map_err(|e| PassError::new(pass, e))?;
    if n == 0 {
        return Ok(Changed::No);
    }
    cx.stats.add(stat, n);
    ir::infer::infer_shapes(g, ir::infer::Mode::Check).map_err(|errs| PassError::shapes(pass, errs))?;
    Ok(Changed::Yes)
}

/// The `conv-as-matmul` pass: [`conv_as_matmul`] on every pointwise convolution.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConvAsMatMul;

impl Pass for ConvAsMatMul {
    fn name(&self) -> &'static str {
        "conv-as-matmul"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        run_rewrite(g, cx, self.name(), "pointwise convolutions made GEMMs", conv_as_matmul)
    }
}

/// The `fuse-gemms` pass: [`fuse_gemms`] on every group of GEMMs sharing an input.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseGemms;

impl Pass for FuseGemms {
    fn name(&self) -> &'static str {
        "fuse-gemms"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        run_rewrite(g, cx, self.name(), "GEMMs sharing an input joined", fuse_gemms)
    }
}

impl Pass for Algebra {
    fn name(&self) -> &'static str {
        "algebra"
    }

    fn run(&mut self, g: &mut Graph, cx: &mut PassCx<'_>) -> Result<Changed, PassError> {
        typed(g, self.name())?;
        let fail = |e: Located| PassError::new("algebra", e);
        let (fused, made) = unfuse_split_gemm(g).map_err(fail)?;
        let folded = fold_reshape_transpose(g).map_err(fail)?;
        let untransposed = transpose_into_gemm(g).map_err(fail)?;
        let moved = transpose_before_gemm(g).map_err(fail)?;
        let composed = compose_transposes(g).map_err(fail)?;
        if fused + folded + untransposed + moved + composed == 0 {
            return Ok(Changed::No);
        }
        cx.stats.add("fused GEMMs split", fused);
        cx.stats.add("GEMMs made", made);
        cx.stats.add("reshape-transpose-reshape folded", folded);
        cx.stats.add("transposed weights read by a GEMM", untransposed);
        cx.stats.add("transposes moved before a GEMM's rows", moved);
        cx.stats.add("transposes of transposes composed", composed);
        ir::infer::infer_shapes(g, ir::infer::Mode::Check).map_err(|errs| PassError::shapes(self.name(), errs))?;
        Ok(Changed::Yes)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use ir::eval::{Array, RunOptions};

    use super::*;
    use crate::manager::PassManager;

    fn model(text: &str) -> ir::Model {
        let mut m = frontend::parse(text).unwrap_or_else(|d| panic!("{}", frontend::render(&d, "t", text))).model;
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        m
    }

    fn ops(g: &Graph) -> Vec<String> {
        g.topo_order()
            .unwrap()
            .into_iter()
            .filter(|&n| !matches!(g.node(n).op, Op::Initializer(_) | Op::Input { .. }))
            .map(|n| g.node(n).op.op_type().to_string())
            .collect()
    }

    /// Random float inputs for every graph input (fixed seed).
    fn inputs(g: &Graph) -> HashMap<String, Array> {
        g.input_values()
            .into_iter()
            .map(|v| {
                let dims = g.tensor_type(v).unwrap().static_dims().unwrap();
                let name = g.value_name(v).to_string();
                (name.clone(), ir::eval::random_tensor(ir::DType::Float, &dims, "weight", 3, &name).unwrap())
            })
            .collect()
    }

    /// Runs the pass; checks the rewritten graph evaluates equal to the original (bit for bit:
    /// each part computes the same dot products in the same order). Returns the op types after.
    fn rewrite_equal(text: &str) -> Vec<String> {
        let mut m = model(text);
        let before = m.graph.clone();
        let mut pm = PassManager::new();
        pm.add(Algebra);
        pm.run(&mut m).unwrap();
        let opts = RunOptions { seed: Some(11) };
        let x = inputs(&before);
        let want = ir::eval::run(&before, &x, &opts).unwrap();
        let got = ir::eval::run(&m.graph, &x, &opts).unwrap();
        assert_eq!(want, got, "the rewritten graph computes something else");
        ops(&m.graph)
    }

    const QKV: &str = r#"<ir_version: 8, opset_import: ["" : 18]>
qkv (float[2,4,6] x) => (float[2,4,3] q, float[2,4,3] k, float[2,4,3] v)
   <float[6,9] w = ["location": "w.bin", "offset": "0", "length": "216"], float[9] c = ["location": "w.bin", "offset": "216", "length": "36"],
    int64[2] flat = {8, 6}, int64[3] back = {2, 4, 9}>
{
   x2 = Reshape (x, flat)
   y = Gemm (x2, w, c)
   y3 = Reshape (y, back)
   q, k, v = Split <axis: int = 2, num_outputs: int = 3> (y3)
}"#;

    // Split(X·[W₀|W₁|W₂] + [c₀|c₁|c₂]) = (X·W₀ + c₀, X·W₁ + c₁, X·W₂ + c₂), through a reshape.
    #[test]
    fn fused_qkv_gemm_becomes_three_gemms() {
        assert_eq!(rewrite_equal(QKV), ["Reshape", "Gemm", "Reshape", "Gemm", "Reshape", "Gemm", "Reshape"]);
        let mut m = model(QKV);
        let (fused, made) = unfuse_split_gemm(&mut m.graph).unwrap();
        assert_eq!((fused, made), (1, 3));
        let g = &m.graph;
        // The parts' weights are the fused weight's columns, named after it; outputs keep names.
        let w1 = g.initializer(g.lookup("w[:,3:6]").unwrap()).unwrap();
        assert_eq!(w1.dims, [6, 3]);
        assert_eq!(
            w1.external_slice().unwrap().unwrap(),
            ir::ExternalSlice { of: "w".into(), full_dims: vec![6, 9], axis: 1, start: 3, end: 6 }
        );
        assert!(g.lookup("w").is_none() && g.lookup("q").is_some());
    }

    // Split(X·Wᵀ) with W = [W₀; W₁] (transB): the parts are row blocks of W; unequal sizes.
    #[test]
    fn trans_b_and_unequal_split_sizes() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[5,6] x) => (float[5,2] a, float[5,4] b)
   <float[6,6] w = {0.1,0.2,0.3,0.4,0.5,0.6, 1,2,3,4,5,6, -1,-2,-3,-4,-5,-6, 0.5,0.25,0.125,1,2,4, 7,8,9,1,2,3, 3,1,4,1,5,9},
    int64[2] sizes = {2, 4}>
{
   y = Gemm <transB: int = 1> (x, w)
   a, b = Split <axis: int = -1> (y, sizes)
}"#;
        assert_eq!(rewrite_equal(text), ["Gemm", "Gemm"]);
    }

    // A MatMul of a 3-D activation by a 2-D weight, split on the last axis directly.
    #[test]
    fn matmul_split_directly() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4] x) => (float[2,3,4] a, float[2,3,4] b)
   <float[4,8] w = ["location": "w.bin", "offset": "0", "length": "128"]>
{
   y = MatMul (x, w)
   a, b = Split <axis: int = 2, num_outputs: int = 2> (y)
}"#;
        assert_eq!(rewrite_equal(text), ["MatMul", "MatMul"]);
    }

    // Not an identity to rewrite: the fused output is also read whole, or split on another axis.
    #[test]
    fn shared_or_other_axis_splits_stay_fused() {
        let read_twice = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[4,6] x) => (float[4,3] a, float[4,3] b, float[4,6] y)
   <float[6,6] w = ["location": "w.bin", "offset": "0", "length": "144"]>
{
   y = MatMul (x, w)
   a, b = Split <axis: int = 1, num_outputs: int = 2> (y)
}"#;
        assert_eq!(rewrite_equal(read_twice), ["MatMul", "Split"]);
        let rows = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[4,6] x) => (float[2,6] a, float[2,6] b)
   <float[6,6] w = ["location": "w.bin", "offset": "0", "length": "144"]>
{
   y = MatMul (x, w)
   a, b = Split <axis: int = 0, num_outputs: int = 2> (y)
}"#;
        assert_eq!(rewrite_equal(rows), ["MatMul", "Split"]);
    }

    // Reshape(Transpose(Reshape(x:[b,h,s,d] → [b·h,s,d]), [0,2,1]) → [b,h,d,s]) = Transpose(x, [0,1,3,2]).
    #[test]
    fn reshape_transpose_reshape_folds() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[2,3,5,4] y)
   <int64[3] merged = {-1, 4, 5}, int64[4] split = {2, 3, 5, 4}>
{
   m = Reshape (x, merged)
   t = Transpose <perm: ints = [0, 2, 1]> (m)
   y = Reshape (t, split)
}"#;
        assert_eq!(rewrite_equal(text), ["Transpose"]);
        let mut m = model(text);
        assert_eq!(fold_reshape_transpose(&mut m.graph).unwrap(), 1);
        let y = m.graph.outputs()[0].value;
        let Op::Transpose(t) = &m.graph.node(y.node).op else { panic!("expected a transpose") };
        assert_eq!(t.perm.as_deref(), Some(&[0, 1, 3, 2][..]));
    }

    // A reshape back to other factors ([3,2,…] from a merged 2·3) is not the transpose's inverse.
    #[test]
    fn reshape_to_other_factors_does_not_fold() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[3,2,5,4] y)
   <int64[3] merged = {6, 4, 5}, int64[4] split = {3, 2, 5, 4}>
{
   m = Reshape (x, merged)
   t = Transpose <perm: ints = [0, 2, 1]> (m)
   y = Reshape (t, split)
}"#;
        assert_eq!(rewrite_equal(text), ["Reshape", "Transpose", "Reshape"]);
    }

    /// Runs `conv-as-matmul`; checks the rewritten graph evaluates to the original's values
    /// (within float rounding: the GEMM adds the bias after the dot products) on random
    /// inputs; returns the op types after and the rewrites made.
    fn conv_rewrite_equal(text: &str) -> (Vec<String>, u64) {
        rule_equal(text, conv_as_matmul)
    }

    /// Runs `rule`; checks the rewritten graph evaluates to the original's values within float
    /// rounding on random inputs; returns the op types after and the rewrites made.
    fn rule_equal(text: &str, rule: fn(&mut Graph) -> Result<u64, Located>) -> (Vec<String>, u64) {
        let mut m = model(text);
        let before = m.graph.clone();
        let made = rule(&mut m.graph).unwrap();
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        ir::verify(&m.graph).unwrap();
        assert_eq!(m.graph.outputs()[0].ty, before.outputs()[0].ty, "the output's type changed");
        let opts = RunOptions { seed: Some(11) };
        let x = inputs(&before);
        let want = ir::eval::run(&before, &x, &opts).unwrap();
        let got = ir::eval::run(&m.graph, &x, &opts).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(a.shape, b.shape);
            for (p, q) in a.to_f64().unwrap().iter().zip(b.to_f64().unwrap()) {
                assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
            }
        }
        (ops(&m.graph), made)
    }

    // X·Transpose(W) = Reshape(Gemm(Reshape(X, [R, K]), W, transB = 1), [.., N]) for a
    // parameter W another op also reads (a tied table); a 2-D X needs no reshapes, and the
    // transpose goes once no reader is left. A transpose of a computed value stays.
    #[test]
    fn a_transposed_parameter_is_read_by_a_gemm() {
        let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4] h, float[6,4] h2) => (float[2,3,5] y, float[6,5] y2, float[5,4] e, float[6,5] y3)
   <float[5,4] w = ["location": "w.bin", "offset": "0", "length": "80"]>
{
   wt = Transpose <perm: ints = [1, 0]> (w)
   y = MatMul (h, wt)
   y2 = MatMul (h2, wt)
   e = Relu (w)
   et = Transpose <perm: ints = [1, 0]> (e)
   y3 = MatMul (h2, et)
}"#;
        let (mut ops, made) = rule_equal(text, transpose_into_gemm);
        ops.sort();
        assert_eq!(made, 2);
        assert_eq!(ops, ["Gemm", "Gemm", "MatMul", "Relu", "Reshape", "Reshape", "Transpose"]);
        let mut m = model(text);
        transpose_into_gemm(&mut m.graph).unwrap();
        let g = &m.graph;
        // The GEMMs read the parameter itself, transposed by the op; outputs keep their names.
        let w = g.lookup("w").unwrap();
        let gemms: Vec<NodeId> =
            g.users(w).iter().map(|&(u, _)| u).filter(|&u| matches!(g.node(u).op, Op::Gemm(_))).collect();
        assert_eq!(gemms.len(), 2);
        assert!(gemms.iter().all(|&u| matches!(&g.node(u).op, Op::Gemm(gm) if gm.trans_b() == 1)));
        assert!(g.lookup("wt").is_none() && g.lookup("y").is_some() && g.lookup("y2").is_some());
    }

    // Transpose(Transpose(x, p), q) = Transpose(x, r), r[j] = p[q[j]]; the identity is x itself.
    // An inner transpose another op reads stays; a default perm reverses the dims.
    const ROWS: &str = r#"<ir_version: 8, opset_import: ["" : 18]>
rows (float[2,3,4,5] a) => (float[2,4,6] z)
   <float[15,6] w = ["location": "w.bin", "offset": "0", "length": "360"], float[6] c = ["location": "w.bin", "offset": "360", "length": "24"],
    int64[2] r = {8, 15}, int64[3] o = {4, 2, 6}>
{
   t = Transpose <perm: ints = [2, 0, 1, 3]> (a)
   x2 = Reshape (t, r)
   y = Gemm (x2, w, c)
   y3 = Reshape (y, o)
   z = Transpose <perm: ints = [1, 0, 2]> (y3)
}"#;

    // Transpose(Reshape(Gemm(Reshape(X, [R, K]), W, c), [s, b, N]), [1, 0, 2]) =
    // Reshape(Gemm(Reshape(Transpose(X, [1, 0, 2, 3]), [R, K]), W, c), [b, s, N]), and the
    // two transposes of X compose into one: heads [b, h, s, d] to rows b·s.
    #[test]
    fn a_transpose_of_a_gemms_rows_moves_before_it() {
        assert_eq!(rewrite_equal(ROWS), ["Transpose", "Reshape", "Gemm", "Reshape"]);
        let mut m = model(ROWS);
        assert_eq!(transpose_before_gemm(&mut m.graph).unwrap(), 1);
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        compose_transposes(&mut m.graph).unwrap();
        let g = &m.graph;
        let t = g.op_nodes().unwrap().into_iter().find(|&n| matches!(g.node(n).op, Op::Transpose(_))).unwrap();
        let Op::Transpose(tp) = &g.node(t).op else { unreachable!() };
        assert_eq!(tp.perm.as_deref(), Some(&[0, 2, 1, 3][..]));
        // The rows are b·s now, and the GEMM keeps its name.
        assert_eq!(g.tensor_type(g.lookup("x2").unwrap()).unwrap().static_dims().unwrap(), [8, 15]);
        assert!(matches!(g.node(g.lookup("y").unwrap().node).op, Op::Gemm(_)));
    }

    // Not when the rows are not a transpose's (nothing composes), the outer transpose moves
    // the GEMM's columns, or the bias has a value per row.
    #[test]
    fn transposes_that_gain_nothing_stay_after_the_gemm() {
        let direct = ROWS
            .replace("float[2,3,4,5] a", "float[4,2,3,5] a")
            .replace("t = Transpose <perm: ints = [2, 0, 1, 3]> (a)", "t = Relu (a)");
        assert_eq!(rewrite_equal(&direct), ["Relu", "Reshape", "Gemm", "Reshape", "Transpose"]);
        let columns = ROWS
            .replace("float[2,4,6] z", "float[6,2,4] z")
            .replace("z = Transpose <perm: ints = [1, 0, 2]> (y3)", "z = Transpose <perm: ints = [2, 1, 0]> (y3)");
        assert_eq!(rewrite_equal(&columns), ["Transpose", "Reshape", "Gemm", "Reshape", "Transpose"]);
        // A bias with a value per row ties each row to its place.
        let per_row = ROWS.replace(
            "float[6] c = [\"location\": \"w.bin\", \"offset\": \"360\", \"length\": \"24\"]",
            "float[8,6] c = [\"location\": \"w.bin\", \"offset\": \"360\", \"length\": \"192\"]",
        );
        assert!(per_row.contains("float[8,6] c"));
        assert_eq!(rewrite_equal(&per_row), ["Transpose", "Reshape", "Gemm", "Reshape", "Transpose"]);
    }

    #[test]
    fn transposes_of_transposes_compose() {
        let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4,5] x, float[3,4] m) => (float[2,4,5,3] y, float[5,3,2,4] z, float[2,3,4,5] t2, float[3,4] mm, float[4,3] back)
{
   t1 = Transpose <perm: ints = [0, 2, 1, 3]> (x)
   y = Transpose <perm: ints = [0, 1, 3, 2]> (t1)
   t2 = Transpose <perm: ints = [3, 2, 1, 0]> (x)
   z = Transpose <perm: ints = [0, 2, 3, 1]> (t2)
   mt = Transpose (m)
   mtt = Transpose <perm: ints = [1, 0]> (mt)
   mm = Relu (mtt)
   back = Transpose <perm: ints = [1, 0]> (mm)
}"#;
        let (mut ops, made) = rule_equal(text, compose_transposes);
        ops.sort();
        // y composed; z not (t2 is also an output); m's two transposes are the identity.
        assert_eq!(made, 2);
        assert_eq!(ops, ["Relu", "Transpose", "Transpose", "Transpose", "Transpose"]);
        let mut m = model(text);
        compose_transposes(&mut m.graph).unwrap();
        let g = &m.graph;
        let y = g.lookup("y").unwrap();
        assert!(matches!(&g.node(y.node).op, Op::Transpose(t) if t.perm.as_deref() == Some(&[0, 2, 3, 1][..])));
        assert_eq!(g.node(y.node).input(0), g.lookup("x"));
        let relu = g.lookup("mm").unwrap();
        assert_eq!(g.node(relu.node).input(0), g.lookup("m"));
    }

    // Conv(X, W, B) = Reshape(Reshape(W, [M,C]) · Reshape(X, [N,C,H·W]) + Reshape(B, [M,1]), [N,M,H,W]).
    #[test]
    fn pointwise_conv_becomes_a_batched_gemm() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[2,6,4,5] y)
   <float[6,3,1,1] w = ["location": "w.bin", "offset": "0", "length": "72"], float[6] b = ["location": "w.bin", "offset": "72", "length": "24"]>
{
   y = Conv <kernel_shape: ints = [1, 1], strides: ints = [1, 1], pads: ints = [0, 0, 0, 0], dilations: ints = [2, 2]> (x, w, b)
}"#;
        let (mut ops, made) = conv_rewrite_equal(text);
        ops.sort();
        assert_eq!(made, 1);
        // X's columns and the output are reshaped; the weight and bias take their shapes.
        assert_eq!(ops, ["Add", "MatMul", "Reshape", "Reshape"]);
        let mut m = model(text);
        conv_as_matmul(&mut m.graph).unwrap();
        let w = m.graph.initializer(m.graph.lookup("w").unwrap()).unwrap();
        assert_eq!(w.dims, [6, 3]);
        assert_eq!(
            w.external_slice().unwrap().unwrap(),
            ir::ExternalSlice { of: "w".into(), full_dims: vec![6, 3, 1, 1], axis: 0, start: 0, end: 6 }
        );
        assert_eq!(m.graph.initializer(m.graph.lookup("b").unwrap()).unwrap().dims, [6, 1]);
    }

    // The places of a rule made one by one: two pointwise convolutions, one rewritten.
    #[test]
    fn pointwise_convs_rewrite_place_by_place() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3,4,5] x) => (float[2,2,4,5] z)
   <float[6,3,1,1] w = ["location": "w.bin", "offset": "0", "length": "72"], float[2,6,1,1] u = ["location": "w.bin", "offset": "72", "length": "48"]>
{
   [squeeze] y = Conv <kernel_shape: ints = [1, 1]> (x, w)
   [expand] z = Conv <kernel_shape: ints = [1, 1]> (y, u)
}"#;
        let m = model(text);
        assert_eq!(sites(&m.graph, "conv-as-matmul").unwrap(), ["squeeze", "expand"]);
        assert_eq!(sites(&m.graph, "fuse-gemms"), None);
        let mut g = m.graph.clone();
        assert_eq!(apply_named_at(&mut g, "conv-as-matmul", &["expand".into()]), Ok(1));
        let kinds: Vec<(String, String)> = g
            .op_nodes()
            .unwrap()
            .into_iter()
            .filter_map(|n| Some((g.node(n).label.clone()?, g.node(n).op.op_type().to_string())))
            .filter(|(l, _)| !l.contains('/'))
            .collect();
        assert_eq!(kinds, [("squeeze".to_string(), "Conv".to_string()), ("expand".into(), "MatMul".into())]);
        let x = inputs(&m.graph);
        let opts = RunOptions { seed: Some(11) };
        let (want, got) = (ir::eval::run(&m.graph, &x, &opts).unwrap(), ir::eval::run(&g, &x, &opts).unwrap());
        for (p, q) in got[0].to_f64().unwrap().iter().zip(want[0].to_f64().unwrap()) {
            assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
        }
        let mut g = m.graph.clone();
        assert!(apply_named_at(&mut g, "conv-as-matmul", &["other".into()]).unwrap_err().contains("`other`"));
    }

    // The same over a volume, no bias, any batch: Conv3d 1×1×1 of [N,4,2,3,3].
    #[test]
    fn pointwise_conv3d_without_bias_and_a_symbolic_batch() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[N,4,2,3,3] x) => (float[N,2,2,3,3] y)
   <float[2,4,1,1,1] w = ["location": "w.bin", "offset": "0", "length": "32"]>
{
   y = Conv (x, w)
}"#;
        let mut m = model(text);
        assert_eq!(conv_as_matmul(&mut m.graph).unwrap(), 1);
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        assert_eq!(ops(&m.graph), ["Reshape", "MatMul", "Reshape"]);
        // A fixed batch evaluates equal.
        let fixed = text
            .replace("float[N,4,2,3,3] x", "float[3,4,2,3,3] x")
            .replace("float[N,2,2,3,3] y", "float[3,2,2,3,3] y");
        assert_eq!(conv_rewrite_equal(&fixed).1, 1);
    }

    // Not pointwise: a 3×3 kernel, a stride, padding, groups.
    #[test]
    fn other_convolutions_stay() {
        for attrs in [
            "kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]",
            "strides: ints = [2, 2]",
            "pads: ints = [1, 1, 1, 1]",
            "group: int = 2",
        ] {
            let w = if attrs.contains("[3, 3]") {
                "float[4,4,3,3] w"
            } else if attrs.contains("group") {
                "float[4,2,1,1] w"
            } else {
                "float[4,4,1,1] w"
            };
            let out = match attrs {
                a if a.contains("strides") => "float[1,4,3,3] y",
                a if a.starts_with("pads") => "float[1,4,8,8] y",
                _ => "float[1,4,6,6] y",
            };
            let text = format!(
                "<ir_version: 8, opset_import: [\"\" : 18]>\ng (float[1,4,6,6] x) => ({out})\n   <{w} = [\"location\": \"w.bin\", \"offset\": \"0\", \"length\": \"576\"]>\n{{\n   y = Conv <{attrs}> (x, w)\n}}"
            );
            assert_eq!(conv_rewrite_equal(&text), (vec!["Conv".to_string()], 0), "{attrs}");
        }
    }

    const BERT_QKV: &str = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4] x) => (float[2,3,4] q, float[2,3,4] k, float[2,3,2] v)
   <float[4,4] wq = ["location": "w.bin", "offset": "0", "length": "64"], float[4,4] wk = ["location": "w.bin", "offset": "64", "length": "64"],
    float[4,2] wv = ["location": "w.bin", "offset": "128", "length": "32"],
    float[4] bq = ["location": "w.bin", "offset": "160", "length": "16"], float[4] bk = ["location": "w.bin", "offset": "176", "length": "16"],
    float[2] bv = ["location": "w.bin", "offset": "192", "length": "8"]>
{
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   mv = MatMul (x, wv)
   v = Add (bv, mv)
}"#;

    const BERT_HEADS: &str = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,8] x) => (float[2,3,2,4] qh, float[2,3,2,4] kh, float[2,3,2,2] vh)
   <float[8,8] wq = ["location": "w.bin", "offset": "0", "length": "256"], float[8,8] wk = ["location": "w.bin", "offset": "256", "length": "256"],
    float[8,4] wv = ["location": "w.bin", "offset": "512", "length": "128"],
    float[8] bq = ["location": "w.bin", "offset": "640", "length": "32"], float[8] bk = ["location": "w.bin", "offset": "672", "length": "32"],
    float[4] bv = ["location": "w.bin", "offset": "704", "length": "16"]>
{
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   sq = Constant <value: tensor = int64[4] {2, 3, 2, 4}> ()
   qh = Reshape (q, sq)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   sk = Constant <value: tensor = int64[4] {2, 3, -1, 4}> ()
   kh = Reshape (k, sk)
   mv = MatMul (x, wv)
   v = Add (bv, mv)
   sv = Constant <value: tensor = int64[4] {0, 0, 2, 2}> ()
   vh = Reshape (v, sv)
}"#;

    // Reshape(X·W_j + b_j, [.., H, d_j]) = Split(Reshape(X·W' + b', [.., H, Σd]), last axis)
    // where W' (and b') hold the parts' columns head by head.
    #[test]
    fn gemms_split_into_heads_fuse_head_by_head() {
        assert_eq!(
            rule_equal(BERT_HEADS, fuse_gemms),
            (vec!["MatMul".into(), "Add".into(), "Reshape".into(), "Split".into()], 1)
        );
        let mut m = model(BERT_HEADS);
        fuse_gemms(&mut m.graph).unwrap();
        let g = &m.graph;
        let w = g
            .initializers()
            .iter()
            .map(|&n| Value::new(n, 0))
            .find(|&v| g.value_name(v).starts_with("wq+wk+wv"))
            .unwrap();
        assert_eq!(g.value_name(w), "wq+wk+wv by heads");
        // Head 0's columns of each part, then head 1's.
        let o = origin(g, w).unwrap();
        let pieces: Vec<String> = o.pieces.iter().map(|p| format!("{}{:?}", p.tensor, p.slice)).collect();
        assert_eq!(
            pieces,
            [
                "wqSome((1, 0, 4))",
                "wkSome((1, 0, 4))",
                "wvSome((1, 0, 2))",
                "wqSome((1, 4, 8))",
                "wkSome((1, 4, 8))",
                "wvSome((1, 2, 4))"
            ]
        );
        // Trained tensors map back to the parts.
        let dims: HashMap<String, Vec<usize>> = [
            ("wq", vec![8, 8]),
            ("wk", vec![8, 8]),
            ("wv", vec![8, 4]),
            ("bq", vec![8]),
            ("bk", vec![8]),
            ("bv", vec![4]),
        ]
        .into_iter()
        .map(|(k, d)| (k.to_string(), d))
        .collect();
        let mut joined = std::collections::BTreeMap::new();
        let a = ir::eval::draw_external(g.initializer(w).unwrap(), "w", "weight", 3).unwrap();
        joined.insert(g.value_name(w).to_string(), a.clone());
        let back = model_tensors(g, &dims, joined.clone());
        assert_eq!(back["wv"].shape, [8, 4]);
        assert_eq!(back["wq"].slice_axis(1, 4, 8), a.slice_axis(1, 10, 14));
    }

    // X·W_j = Reshape(Split(Reshape(X·W', [.., H, Σd]), last axis)_j, [.., H·d_j]): a part
    // whose bias is not the group's own (here one tensor the three share, through
    // `Identity`s, as an export that deduplicated equal weights has it) is reshaped back to
    // its columns, and its bias add and reshapes into heads stay as they were (the bias read
    // as it is, so its gradient is synchronised with the parameter's).
    #[test]
    fn shared_biases_are_added_to_the_parts_columns() {
        let text = r#"<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,8] x) => (float[2,2,3,4] qt, float[2,3,2,4] kh, float[2,3,2,4] vh)
   <float[8,8] wq = ["location": "w.bin", "offset": "0", "length": "256"], float[8,8] wk = ["location": "w.bin", "offset": "256", "length": "256"],
    float[8,8] wv = ["location": "w.bin", "offset": "512", "length": "256"], float[8] b = ["location": "w.bin", "offset": "768", "length": "32"]>
{
   bq = Identity (b)
   bk = Identity (b)
   mq = MatMul (x, wq)
   q = Add (bq, mq)
   s = Constant <value: tensor = int64[4] {2, 3, 2, 4}> ()
   qh = Reshape (q, s)
   qt = Transpose <perm: ints = [0, 2, 1, 3]> (qh)
   mk = MatMul (x, wk)
   k = Add (mk, bk)
   kh = Reshape (k, s)
   mv = MatMul (x, wv)
   v = Add (mv, b)
   vh = Reshape (v, s)
}"#;
        let (mut ops, made) = rule_equal(text, fuse_gemms);
        ops.sort();
        assert_eq!(made, 1);
        // One GEMM, its split into heads and parts, each part reshaped back to its columns,
        // its bias added and its own reshape into heads.
        let count = |k: &str| ops.iter().filter(|o| *o == k).count();
        assert_eq!((count("MatMul"), count("Split"), count("Reshape"), count("Add")), (1, 1, 7, 3), "{ops:?}");
    }

    // (X·Wq + bq, X·Wk + bk, X·Wv + bv) = Split(X·[Wq|Wk|Wv] + [bq|bk|bv]), bias on either side.
    #[test]
    fn gemms_sharing_an_input_fuse() {
        assert_eq!(rule_equal(BERT_QKV, fuse_gemms), (vec!["MatMul".into(), "Add".into(), "Split".into()], 1));
        let mut m = model(BERT_QKV);
        fuse_gemms(&mut m.graph).unwrap();
        let g = &m.graph;
        // The joined weight describes its parts; outputs keep their names.
        let w = g.initializer(g.lookup("wq+wk+wv").unwrap()).unwrap();
        assert_eq!(w.dims, [4, 10]);
        let c = w.external_concat().unwrap().unwrap();
        assert_eq!(c.axis, 1);
        let parts: Vec<(&str, &[i64])> = c.parts.iter().map(|(n, t)| (n.as_str(), &t.dims[..])).collect();
        assert_eq!(parts, [("wq", &[4, 4][..]), ("wk", &[4, 4][..]), ("wv", &[4, 2][..])]);
        assert_eq!(g.initializer(g.lookup("bq+bk+bv").unwrap()).unwrap().dims, [10]);
        assert!(g.lookup("wq").is_none() && g.lookup("q").is_some());
        // Before opset 13 the sizes are an attribute.
        let old = BERT_QKV.replace("\"\" : 17", "\"\" : 11");
        assert_eq!(rule_equal(&old, fuse_gemms).1, 1);
    }

    // Gemm(X, W₀, c₀), Gemm(X, W₁, c₁) under transB: the weights join by rows.
    #[test]
    fn trans_b_gemms_fuse_by_rows_inline() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[3,2] x) => (float[3,2] a, float[3,1] b)
   <float[2,2] w = {1, 2, 3, 4}, float[1,2] u = {5, 6}, float[2] c = {0.5, -1}, float[1] d = {2}>
{
   a = Gemm <transB: int = 1> (x, w, c)
   b = Gemm <transB: int = 1> (x, u, d)
}"#;
        assert_eq!(rule_equal(text, fuse_gemms), (vec!["Gemm".into(), "Split".into()], 1));
        let mut m = model(text);
        fuse_gemms(&mut m.graph).unwrap();
        let w = m.graph.initializer(m.graph.lookup("w+u").unwrap()).unwrap();
        assert_eq!((w.dims.clone(), w.data.clone()), (vec![3, 2], TensorData::Float(vec![1., 2., 3., 4., 5., 6.])));
    }

    // Fusing undoes un-fusing: GPT-2's split c_attn joins back into the one weight it was.
    #[test]
    fn fusing_undoes_unfusing() {
        let mut m = model(QKV);
        let original = m.graph.initializer(m.graph.lookup("w").unwrap()).unwrap().clone();
        unfuse_split_gemm(&mut m.graph).unwrap();
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        assert_eq!(fuse_gemms(&mut m.graph).unwrap(), 1);
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let g = &m.graph;
        assert_eq!(g.initializer(g.lookup("w").unwrap()).unwrap(), &original);
        assert_eq!(g.initializer(g.lookup("c").unwrap()).unwrap().dims, [9]);
        // And un-fusing a fused weight gives its parts back, named as before.
        let mut m = model(BERT_QKV);
        fuse_gemms(&mut m.graph).unwrap();
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        assert_eq!(unfuse_split_gemm(&mut m.graph).unwrap(), (1, 3));
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let wv = m.graph.initializer(m.graph.lookup("wv").unwrap()).unwrap();
        assert_eq!(
            wv,
            &model(BERT_QKV).graph.initializer(model(BERT_QKV).graph.lookup("wv").unwrap()).unwrap().clone()
        );
    }

    /// The float initializers of `g` as arrays, by name.
    fn weights(g: &Graph) -> std::collections::BTreeMap<String, Array> {
        g.initializers()
            .iter()
            .map(|&n| Value::new(n, 0))
            .filter(|&v| g.initializer(v).unwrap().dtype == ir::DType::Float)
            .map(|v| (g.value_name(v).to_string(), Array::from_tensor(g.initializer(v).unwrap()).unwrap()))
            .collect()
    }

    // Trained tensors go back under the model's names: a split weight's columns join back, a
    // joined weight splits into its parts, through any sequence of the rewrites.
    #[test]
    fn trained_tensors_go_back_under_the_model_names() {
        let list = |n: usize, k: f32| (0..n).map(|i| format!("{}", i as f32 * k - 1.0)).collect::<Vec<_>>().join(", ");
        let text = format!(
            r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[3,4] x) => (float[3,2] a, float[3,4] b, float[3,3] d)
   <float[4,6] w = {{{}}}, float[6] c = {{{}}}, int64[2] sizes = {{2, 4}}, float[4,3] u = {{{}}}, float[3] e = {{{}}}>
{{
   y = Gemm (x, w, c)
   a, b = Split <axis: int = -1> (y, sizes)
   d = Gemm (x, u, e)
}}"#,
            list(24, 0.25),
            list(6, 0.5),
            list(12, -0.125),
            list(3, 2.0)
        );
        let mut m = model(&text);
        let want = weights(&m.graph);
        let dims: HashMap<String, Vec<usize>> = want.iter().map(|(k, a)| (k.clone(), a.shape.clone())).collect();
        assert_eq!(unfuse_split_gemm(&mut m.graph).unwrap(), (1, 2));
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let split = weights(&m.graph);
        assert!(split.contains_key("w[:,2:6]") && !split.contains_key("w"));
        assert_eq!(model_tensors(&m.graph, &dims, split.clone()), want);
        // All three GEMMs read `x`: they join, the columns of `w` as one piece.
        assert_eq!(fuse_gemms(&mut m.graph).unwrap(), 1);
        ir::infer::infer_shapes(&mut m.graph, ir::infer::Mode::Check).unwrap();
        let joined = weights(&m.graph);
        let w = m.graph.lookup("u+w[:,0:2]+w[:,2:6]").unwrap();
        assert_eq!(
            origin(&m.graph, w).unwrap(),
            Origin {
                axis: 1,
                pieces: vec![
                    Piece { tensor: "u".into(), len: 3, slice: None },
                    Piece { tensor: "w".into(), len: 6, slice: Some((1, 0, 6)) }
                ]
            }
        );
        assert_eq!(model_tensors(&m.graph, &dims, joined.clone()), want);
        // Un-fused again: the parts of the joined weight, still the model's columns.
        assert_eq!(unfuse_split_gemm(&mut m.graph).unwrap(), (1, 3));
        assert_eq!(model_tensors(&m.graph, &dims, weights(&m.graph)), want);
        // A tensor of no known origin, or missing a part, keeps its name.
        let mut some = split.clone();
        some.remove("w[:,0:2]");
        some.insert("other".into(), want["u"].clone());
        let back = model_tensors(&model_after_unfuse(&text), &dims, some.clone());
        assert!(back.contains_key("w[:,2:6]") && back.contains_key("other") && !back.contains_key("w"));
        assert_eq!(back["c"], want["c"]);
    }

    fn model_after_unfuse(text: &str) -> Graph {
        let mut m = model(text);
        unfuse_split_gemm(&mut m.graph).unwrap();
        m.graph
    }

    // Not joined: a lone GEMM, a weight read twice, biases on some parts only, another kind.
    #[test]
    fn gemms_that_do_not_fuse() {
        let text = r#"<ir_version: 8, opset_import: ["" : 18]>
g (float[3,2] x) => (float[3,2] a, float[3,2] b, float[3,2] c, float[3,2] d)
   <float[2,2] w = {1, 2, 3, 4}, float[2,2] u = {5, 6, 7, 8}, float[2] e = {1, 1}, float[2,2] t = {1, 0, 0, 1}>
{
   a = MatMul (x, w)
   b = MatMul (x, w)
   m = MatMul (x, u)
   c = Add (m, e)
   d = Gemm <transB: int = 1> (x, t)
}"#;
        assert_eq!(rule_equal(text, fuse_gemms).1, 0);
    }

    #[test]
    fn merge_groups_of_shapes() {
        assert_eq!(merge_groups(&[2, 3, 4, 5], &[6, 4, 5]), Some(vec![0..2, 2..3, 3..4]));
        assert_eq!(merge_groups(&[1, 12, 128, 64], &[12, 128, 64]), Some(vec![0..2, 2..3, 3..4]));
        assert_eq!(merge_groups(&[2, 3, 4], &[3, 2, 4]), None);
        assert_eq!(merge_groups(&[2, 3], &[6, 1]), None);
    }
}
