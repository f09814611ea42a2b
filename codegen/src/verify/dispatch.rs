//! The all-to-all token dispatcher (`SplitMode::Dispatch`, codegen/src/lower/experts.rs),
//! stated from the definitions of its ops, independently of the lowering:
//! - `MoERoute` on rows `a..b` of the graph's ids `I` is the routing of those rows: its
//!   positions and the experts of its buffer's rows are terms of their own (`route`), named by
//!   the rows and the routing's parameters (`parts` devices of `experts` experts each,
//!   `capacity` rows per device).
//! - `MoEDispatch` of rows `a..b` of a graph value by that routing is the send buffer of
//!   those rows (`rows`).
//! - An all-to-all of such buffers (or of the experts' outputs on them) gives member `j` the
//!   `j`-th blocks of every member's, in group order (`stack`): data-dependent rows, a term
//!   of their own.
//! - The mixture (or its gradient) on stacks, with the experts `j·experts ..` of the graph's
//!   weights, is a term of its own (`experts`), but for the gradient's weight gradients.
//! - `MoECombine` of the stacked outputs by the routing of rows `a..b`: when the routings of
//!   the stacks' members are those of disjoint rows of one ids tensor, the members of every
//!   stack are built from those routings in order, and device `j` of the stacks ran the
//!   experts `j·experts ..` of the graph's weights, every pair of those rows went to the device
//!   holding its expert (the routing is exactly `id / experts`: ir/src/ops/experts.rs) and came
//!   back to its row: the combine holds rows `a..b` of the graph's mixture (or of its
//!   gradient's `dX` and `dw`). The weight gradients `dW1`, `dW2` of device `j` are the
//!   graph's for experts `j·experts ..`, partial over the tokens when the routed rows are not
//!   all of them. A run that overflows a buffer stops (`MoERoute` refuses it), so no pair is
//!   dropped in a run that completes.

use ir::NodeId;
use ir::op::Op;

use super::rules::{Cx, Out, op_key, wrong};
use super::term::{Fact, Head, Share, TermId, Terms, whole};

const ROUTE: &str = "dispatch.route";
const ROWS: &str = "dispatch.rows";
const STACK: &str = "dispatch.stack";
const EXPERTS: &str = "dispatch.experts";

/// A term's key when it is an op term of the dispatcher's kind `kind`: the fields after it.
fn fields<'t>(terms: &'t Terms, t: TermId, kind: &str) -> Option<(u16, Vec<&'t str>)> {
    match terms.head(t) {
        Head::Op { key, slot } => {
            let rest = key.strip_prefix(kind)?.strip_prefix('|')?;
            Some((*slot, rest.splitn(5, '|').collect()))
        }
        _ => None,
    }
}

fn num(s: Option<&&str>) -> Option<i64> {
    s?.parse().ok()
}

/// A routing: the ids it routes, its rows of them and its parameters.
#[derive(Clone, Debug, PartialEq)]
struct Route {
    ids: TermId,
    rows: (i64, i64),
    /// Experts per device, devices, rows per device.
    per: i64,
    parts: i64,
    capacity: i64,
}

/// The routing term `t` (slot 0: positions; slot 1: the buffer rows' experts) stands for.
fn route_of(terms: &Terms, t: TermId, slot: u16) -> Option<Route> {
    let (s, f) = fields(terms, t, ROUTE)?;
    (s == slot).then_some(())?;
    Some(Route {
        ids: *terms.inputs(t).first()?,
        per: num(f.first())?,
        parts: num(f.get(1))?,
        capacity: num(f.get(2))?,
        rows: (num(f.get(3))?, num(f.get(4))?),
    })
}

fn route_key(r: &Route) -> String {
    format!("{ROUTE}|{}|{}|{}|{}|{}", r.per, r.parts, r.capacity, r.rows.0, r.rows.1)
}

/// `MoERoute` on rows of the graph's ids, whole along the pairs.
pub fn route(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let Op::MoERoute(m) = &cx.g.node(n).op else { return wrong("not a routing") };
    let Some(ids) = ins.first().cloned().flatten() else { return wrong("a routing without ids") };
    let shape = cx.terms.shape(ids.term).to_vec();
    if !ids.is_exact() || shape.len() != 2 || ids.region[1] != (0, shape[1]) {
        return wrong(format!("a routing of ids held as {:?}: not rows whole along the pairs", ids.region));
    }
    let r = Route {
        ids: ids.term,
        rows: ids.region[0],
        per: m.experts.unwrap_or(0),
        parts: m.parts.unwrap_or(0),
        capacity: m.capacity.unwrap_or(0),
    };
    let key = route_key(&r);
    let pos = cx.terms.op(&key, 0, &[ids.term], &[r.rows.1 - r.rows.0, shape[1]]);
    let experts = cx.terms.op(&key, 1, &[ids.term], &[r.parts * r.capacity, 1]);
    Ok(vec![Some(Fact::whole(cx.terms, pos)), Some(Fact::whole(cx.terms, experts))])
}

/// `MoEDispatch` of rows of a graph value by the routing of the same rows.
pub fn scatter(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let Op::MoEDispatch(m) = &cx.g.node(n).op else { return wrong("not a dispatch") };
    let (Some(x), Some(pos)) = (ins.first().cloned().flatten(), ins.get(1).cloned().flatten()) else {
        return wrong("a dispatch without its operands");
    };
    let Some(r) = route_of(cx.terms, pos.term, 0) else {
        return wrong("a dispatch by positions no routing of the graph's ids made");
    };
    let shape = cx.terms.shape(x.term).to_vec();
    let tokens = cx.terms.shape(r.ids)[0];
    let rest_whole = (1..shape.len()).all(|d| x.region[d] == (0, shape[d]));
    if !x.is_exact() || shape.len() != 2 || shape[0] != tokens || x.region[0] != r.rows || !rest_whole {
        return wrong(format!(
            "a dispatch of {:?} of a value by the routing of rows {:?}: not those rows whole",
            x.region, r.rows
        ));
    }
    let per_pair = m.per_pair.unwrap_or(0);
    let w = if per_pair != 0 { 1 } else { shape[1] };
    let t = cx.terms.op(&format!("{ROWS}|{per_pair}"), 0, &[x.term, pos.term], &[r.parts * r.capacity, w]);
    Ok(vec![Some(Fact::whole(cx.terms, t))])
}

/// An all-to-all of the dispatcher's buffers (split and concatenated along rows): member `j`
/// gets the stack of the `j`-th blocks; `None` when the members' values are not all the
/// dispatcher's.
pub fn stack(terms: &mut Terms, facts: &[Fact], split: usize, concat: usize) -> Option<Vec<Fact>> {
    let ours = |t: TermId| fields(terms, t, ROWS).is_some() || fields(terms, t, EXPERTS).is_some();
    let routed = |t: TermId| route_of(terms, t, 1).is_some();
    let all = facts.iter().all(|f| f.is_exact() && f.region == whole(terms.shape(f.term)));
    if split != 0 || concat != 0 || !all || !facts.iter().all(|f| ours(f.term) || routed(f.term)) {
        return None;
    }
    let members: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let shape = terms.shape(members[0]).to_vec();
    let p = facts.len();
    Some(
        (0..p)
            .map(|j| {
                let t = terms_stack(terms, &members, j, &shape);
                Fact::whole(terms, t)
            })
            .collect(),
    )
}

fn terms_stack(terms: &mut Terms, members: &[TermId], j: usize, shape: &[i64]) -> TermId {
    terms.op(&format!("{STACK}|{j}|{}", members.len()), 0, members, shape)
}

/// The stack term `t`: its part and its members.
fn stack_of(terms: &Terms, t: TermId) -> Option<(usize, Vec<TermId>)> {
    let (_, f) = fields(terms, t, STACK)?;
    let j = num(f.first())? as usize;
    (num(f.get(1))? as usize == terms.inputs(t).len()).then(|| (j, terms.inputs(t).to_vec()))
}

/// The routings a stack of send buffers (`rows`, of `per_pair` kind) was built from, in
/// order, with the value they send.
fn sent(terms: &Terms, t: TermId, per_pair: bool) -> Option<(usize, Vec<TermId>, TermId)> {
    let (j, members) = stack_of(terms, t)?;
    let mut pos = Vec::new();
    let mut value = None;
    for &m in &members {
        let (_, f) = fields(terms, m, ROWS)?;
        (num(f.first())? == i64::from(per_pair)).then_some(())?;
        let (x, p) = (terms.inputs(m)[0], terms.inputs(m)[1]);
        (value.is_none_or(|v| v == x)).then_some(())?;
        value = Some(x);
        pos.push(p);
    }
    Some((j, pos, value?))
}

/// The routings `pos` route disjoint rows of one ids tensor with one set of parameters, one
/// device each: the first routing and the rows each covers; else which member differs.
fn tiled(terms: &Terms, pos: &[TermId]) -> Result<(Route, Vec<(i64, i64)>), String> {
    let routes: Vec<Route> = pos
        .iter()
        .enumerate()
        .map(|(i, &p)| route_of(terms, p, 0).ok_or(format!("member {i}'s rows were sent by no routing")))
        .collect::<Result<_, _>>()?;
    let first = routes.first().ok_or("no members")?.clone();
    for (i, r) in routes.iter().enumerate() {
        if (r.ids, r.per, r.parts, r.capacity) != (first.ids, first.per, first.parts, first.capacity) {
            return Err(format!(
                "member {i} routed {} experts a device over {} devices ({} rows each), member 0 {} over {} ({})",
                r.per, r.parts, r.capacity, first.per, first.parts, first.capacity
            ));
        }
        if let Some(j) = routes[..i].iter().position(|q| q.rows.0 < r.rows.1 && r.rows.0 < q.rows.1) {
            return Err(format!(
                "member {i} routed rows {:?}, which member {j} routed too ({:?})",
                r.rows, routes[j].rows
            ));
        }
    }
    if routes.len() as i64 != first.parts {
        return Err(format!("{} members for a routing over {} devices", routes.len(), first.parts));
    }
    Ok((first, routes.iter().map(|r| r.rows).collect()))
}

/// Whether `t` is one of the dispatcher's own terms (no graph value, by design).
pub fn is_own(terms: &Terms, t: TermId) -> bool {
    [ROUTE, ROWS, STACK, EXPERTS].iter().any(|k| fields(terms, t, k).is_some())
}

/// What a mixture on stacks ran on: the graph's operands `[dY,] X, I, w`, the part `j`, the
/// routing and the rows each member's routing covers.
type Stacked = (Vec<TermId>, usize, Route, Vec<(i64, i64)>);

/// The graph's inputs of a mixture (or its gradient) run on stacks: `[dY,] X, I, w` from the
/// stacks of `xs` (`dy` first for the gradient), checked to be built from one tiling of
/// routings, and device `j`'s part.
fn stacked_inputs(terms: &Terms, facts: &[&Fact], grad: bool) -> Result<Stacked, String> {
    let x0 = usize::from(grad);
    let bad = || "a mixture on rows received that are not the dispatcher's stacks of one routing".to_string();
    let (j, pos, x) = sent(terms, facts[x0].term, false).ok_or_else(bad)?;
    let (route, spans) = tiled(terms, &pos).map_err(|why| format!("{}: {why}", bad()))?;
    let (jw, pos_w, w) = sent(terms, facts[x0 + 2].term, true).ok_or_else(bad)?;
    let (je, experts) = stack_of(terms, facts[x0 + 1].term).ok_or_else(bad)?;
    let experts_ok = experts.len() == pos.len()
        && experts.iter().zip(&pos).all(|(&e, &p)| {
            route_of(terms, e, 1).is_some_and(|r| Some(r) == route_of(terms, p, 0))
                && terms.inputs(e) == terms.inputs(p)
        });
    if jw != j || je != j || pos_w != pos || !experts_ok {
        return Err(bad());
    }
    let mut global = vec![x, route.ids, w];
    if grad {
        let (jd, pos_d, dy) = sent(terms, facts[0].term, false).ok_or_else(bad)?;
        if jd != j || pos_d != pos {
            return Err(bad());
        }
        global.insert(0, dy);
    }
    Ok((global, j, route, spans))
}

/// A mixture (or its gradient) on the dispatcher's stacks; `None` when its tokens are not a
/// stack (the other rules apply).
pub fn experts(cx: &mut Cx<'_>, n: NodeId, grad: bool, ins: &[Option<Fact>]) -> Option<Out> {
    let facts: Vec<&Fact> = ins.iter().flatten().collect();
    let x0 = usize::from(grad);
    stack_of(cx.terms, facts.get(x0)?.term)?;
    Some(on_stacks(cx, n, grad, &facts))
}

fn on_stacks(cx: &mut Cx<'_>, n: NodeId, grad: bool, facts: &[&Fact]) -> Out {
    let x0 = usize::from(grad);
    if facts.len() != x0 + 5 {
        return wrong("a mixture without its operands");
    }
    let (global, j, route, spans) = stacked_inputs(cx.terms, facts, grad).map_err(super::rules::Why::Wrong)?;
    let (w1, w2) = (facts[x0 + 3], facts[x0 + 4]);
    let held = (j as i64 * route.per, (j as i64 + 1) * route.per);
    let experts = cx.terms.shape(w1.term)[0];
    let whole_rest = |f: &Fact| f.region[1..] == whole(cx.terms.shape(f.term))[1..];
    if !w1.is_exact()
        || !w2.is_exact()
        || w1.region[0] != held
        || w2.region[0] != held
        || !whole_rest(w1)
        || !whole_rest(w2)
    {
        return wrong(format!(
            "device {j} of the dispatcher runs experts {:?}, where its rows were routed for experts {held:?}",
            w1.region[0]
        ));
    }
    if route.per * route.parts != experts {
        return wrong(format!("a routing over {} experts for weights of {experts}", route.per * route.parts));
    }
    let key = op_key(&cx.g.node(n).op);
    let ins: Vec<TermId> = facts.iter().map(|f| f.term).collect();
    let mut out = Vec::new();
    for slot in 0..cx.g.node(n).num_outputs() {
        let Some(local) = cx.out_dims(n, slot) else { return wrong("a mixture's output of unknown shape") };
        if grad && slot >= 2 {
            // dW1, dW2: the graph's gradient of these experts, over the routed tokens.
            let mut terms = global.clone();
            terms.extend([w1.term, w2.term]);
            let full = cx.terms.shape(terms[slot + 2]).to_vec();
            let t = cx.terms.op(&key, slot as u16, &terms, &full);
            let mut region = whole(&full);
            region[0] = held;
            let tokens = cx.terms.shape(route.ids)[0];
            let covered: i64 = spans.iter().map(|(a, b)| b - a).sum();
            let shares = if covered == tokens {
                Vec::new()
            } else {
                let mut held: Vec<_> = spans.iter().map(|&r| vec![r]).collect();
                held.sort();
                vec![Share { site: t, space: vec![tokens], held, max: false }]
            };
            out.push(Some(Fact { term: t, region, shares, alts: Vec::new() }));
            continue;
        }
        let t = cx.terms.op(&format!("{EXPERTS}|{j}|{key}"), slot as u16, &ins, &local);
        out.push(Some(Fact::whole(cx.terms, t)));
    }
    Ok(out)
}

/// `MoECombine` of the stacked outputs by the routing of rows `a..b`: rows `a..b` of the
/// graph's mixture output (or its gradient's `dX`, `dw`).
pub fn combine(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Out {
    let Op::MoECombine(m) = &cx.g.node(n).op else { return wrong("not a combine") };
    let (Some(back), Some(pos)) = (ins.first().cloned().flatten(), ins.get(1).cloned().flatten()) else {
        return wrong("a combine without its operands");
    };
    let bad = |why: &str| wrong(format!("a combine of rows that are not the dispatcher's experts' outputs: {why}"));
    let Some(r) = route_of(cx.terms, pos.term, 0) else { return bad("positions of no routing") };
    let Some((s, members)) = stack_of(cx.terms, back.term) else { return bad("not a stack") };
    // Every member: device j's experts on stacks of one tiling of routings, of which this
    // combine's routing is member s.
    let mut found: Option<(String, u16, Vec<TermId>, Vec<TermId>)> = None;
    for (j, &t) in members.iter().enumerate() {
        let Some((slot, f)) = fields(cx.terms, t, EXPERTS) else { return bad("a member not an experts' output") };
        if num(f.first()) != Some(j as i64) {
            return bad("a member from another device's experts");
        }
        let key = f[1..].join("|");
        let ins = cx.terms.inputs(t).to_vec();
        let grad = ins.len() == 6;
        let x0 = usize::from(grad);
        let Some((_, pos_list, _)) = sent(cx.terms, ins[x0], false) else { return bad("tokens not sent") };
        let w = ins[x0 + 3..].to_vec();
        match &found {
            None => found = Some((key, slot, pos_list, w)),
            Some((k, sl, p, ww)) if *k == key && *sl == slot && *p == pos_list && *ww == w => {}
            Some(_) => return bad("the members ran different mixtures"),
        }
    }
    let Some((key, slot, pos_list, w)) = found else { return bad("no members") };
    if pos_list.get(s) != Some(&pos.term) || pos_list.len() != members.len() {
        return bad("this device's routing is not the one its rows were sent by");
    }
    // The members' inputs were checked when they ran (`on_stacks`); the graph's operands.
    let first = cx.terms.inputs(members[0]).to_vec();
    let grad = first.len() == 6;
    let x0 = usize::from(grad);
    let (Some((_, _, x)), Some((_, _, wr))) = (sent(cx.terms, first[x0], false), sent(cx.terms, first[x0 + 2], true))
    else {
        return bad("tokens not sent");
    };
    let mut global = vec![x, r.ids, wr];
    if grad {
        let Some((_, _, dy)) = sent(cx.terms, first[0], false) else { return bad("dY not sent") };
        global.insert(0, dy);
    }
    global.extend(w);
    let (tokens, k) = (cx.terms.shape(r.ids)[0], cx.terms.shape(r.ids)[1]);
    let per_pair = m.per_pair.unwrap_or(0) != 0;
    let width = if per_pair { k } else { cx.terms.shape(back.term)[1] };
    let t = cx.terms.op(&key, slot, &global, &[tokens, width]);
    Ok(vec![Some(Fact::exact(t, vec![r.rows, (0, width)]))])
}
