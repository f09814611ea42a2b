//! Where a rewritten initializer's values are in the model as written, and the trained
//! tensors put back under the model's names.

use ir::{Graph, Tensor, TensorData, Value};

use super::*;

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
pub(super) fn set_origin(g: &mut Graph, v: Value, o: Option<Origin>) {
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
pub(super) fn origin_slice(o: Option<Origin>, axis: usize, start: i64, end: i64) -> Option<Origin> {
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
pub(super) fn origin_concat(os: Vec<Option<Origin>>, lens: &[i64], axis: usize) -> Option<Origin> {
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
pub(super) fn part_name(g: &Graph, name: &str, rank: usize, axis: usize, start: i64, end: i64) -> String {
    let idx: Vec<String> = (0..rank).map(|a| if a == axis { format!("{start}:{end}") } else { ":".into() }).collect();
    g.fresh_name(&format!("{name}[{}]", idx.join(",")))
}

/// The columns `start..end` along `axis` of initializer tensor `t` named `name`.
pub(super) fn slice_tensor(t: &Tensor, name: &str, axis: usize, start: i64, end: i64) -> Result<Tensor, String> {
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
