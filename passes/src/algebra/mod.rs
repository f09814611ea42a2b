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
//! - [`experts::fuse_experts`]: `Σⱼ w[t, j] · W2[ids[t, j]]·silu-gate(W1[ids[t, j]]·X[t])`, written
//!   with the experts' weights gathered per routed pair, `= MoE(X, ids, w, W1, W2)`.
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

pub mod attention;
pub mod experts;
mod fuse_gemms;
mod origin;

pub use fuse_gemms::{fuse_gemms, fuse_gemms_where};
pub use origin::{ORIGIN, Origin, Piece, model_tensors, origin};
use origin::{origin_concat, origin_slice, part_name, set_origin, slice_tensor};

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

pub(crate) fn static_dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
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
        "fuse-attention" => attention::fuse_attention(g).map_err(|e| e.msg)?,
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
        let experts = experts::fuse_experts(g).map_err(fail)?;
        for n in experts::unfused(g) {
            cx.warnings.push(experts::unfused_warning(g, n));
        }
        if fused + folded + untransposed + moved + composed + experts == 0 {
            return Ok(Changed::No);
        }
        cx.stats.add("fused GEMMs split", fused);
        cx.stats.add("GEMMs made", made);
        cx.stats.add("reshape-transpose-reshape folded", folded);
        cx.stats.add("transposed weights read by a GEMM", untransposed);
        cx.stats.add("transposes moved before a GEMM's rows", moved);
        cx.stats.add("transposes of transposes composed", composed);
        cx.stats.add("mixtures of experts fused", experts);
        ir::infer::infer_shapes(g, ir::infer::Mode::Check).map_err(|errs| PassError::shapes(self.name(), errs))?;
        Ok(Changed::Yes)
    }
}

#[cfg(test)]
mod tests;
