//! [`fuse_gemms`]: GEMMs that read the same activation joined into one (the search chooses
//! where).

use ir::{Graph, NodeId, Op, Output, Value};

use super::*;

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
    let modules: Vec<Vec<ir::scope::ModuleRef>> = parts.iter().map(|p| ir::scope::modules_or_path(g, p.gemm)).collect();
    let fused = g.add_labeled_node(Some(label.clone()), first.op.clone(), inputs, vec![Output::named(yname)]);
    // The fused GEMM computes what the parts' modules did: it names them all (an export
    // speaks of the model's modules, a report of their common parent).
    if modules.iter().all(|m| !m.is_empty()) {
        g.set_annotation(fused, ir::scope::MODULE, ir::scope::format_modules(&modules.concat()));
    }
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
