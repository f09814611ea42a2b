//! The prover: the devices' programs, composed by their collectives and transfers, compute
//! the graph they were lowered from.
//!
//! **The statement.** For every result a device program delivers (a piece of a graph output:
//! a loss, a gradient, an updated parameter or optimizer state, a model output), the value it
//! computes is exactly the piece its layout names of the graph's value — given that each
//! device's inputs are the pieces their layouts name of the graph's inputs and its literal
//! tensors are the pieces of the graph's parameters whose data they hold; and the devices'
//! results together cover every graph output. "Exactly" is up to floating-point
//! reassociation: a sum split over devices and added by an all-reduce is the same sum, a mean
//! scaled by shares is the same mean. Not proved: values of reassociated sums, the order in
//! which the runtime runs the programs (the checker, [`crate::check`], proves they cannot
//! deadlock), and accumulation over micro-batches (the program proved is one micro-batch's).
//!
//! **The proof.** The graph is interpreted once on symbolic whole tensors, giving each value a
//! term ([`term`]); each device's program is interpreted on symbolic pieces — a term, the box
//! of it held, and the reductions still partial — by rules stated once per op family
//! ([`rules`], [`composite`]) and per collective ([`comm`]), independently of the lowering's
//! split rules. The programs run in step: a collective resolves when every member has reached
//! it, a receive when its send has run. A device's op on pieces that determine no piece of any
//! value, or a result that is not the piece it claims, refutes the plan, located at the first
//! op of that device that computed a value the graph never computes.

mod attention;
mod comm;
mod composite;
mod conv;
mod dispatch;
mod experts;
mod flash;
mod recurrent;
mod rules;
mod term;
mod vocab;

use std::collections::{BTreeMap, HashMap, HashSet};

use ir::eval::Array;
use ir::op::Op;
use ir::{Graph, NodeId, OpClass, Value};

use crate::layout::{crop, dim_range};
use crate::program::{DeviceProgram, Program};
pub use rules::view_region;
use rules::{Cx, Why};
use term::{Fact, Region, TermId, Terms, whole};

/// What a proof established.
#[derive(Clone, Debug, PartialEq)]
pub struct Proof {
    /// Values of the device programs given a piece of the graph's values.
    pub values: usize,
    /// Devices.
    pub devices: usize,
    /// Results checked against the graph's outputs.
    pub results: usize,
    /// Distinct terms built.
    pub terms: usize,
}

/// Whether a refutation found the program wrong or the prover without a rule.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RefutationKind {
    /// The program does not compute what it claims (or the prover cannot see that it does).
    Wrong,
    /// The program uses an op on pieces the prover has no rule for: nothing is claimed.
    Uncovered,
}

/// Where and why a proof fails.
#[derive(Clone, Debug, PartialEq)]
pub struct Refutation {
    pub kind: RefutationKind,
    /// The device whose program is at fault.
    pub device: Option<usize>,
    /// Its op at fault, described.
    pub op: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for Refutation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.kind {
            RefutationKind::Wrong => "not verified",
            RefutationKind::Uncovered => "not proved (no rule)",
        };
        write!(f, "{what}: ")?;
        if let Some(d) = self.device {
            write!(f, "device {d}: ")?;
        }
        if let Some(op) = &self.op {
            write!(f, "{op}: ")?;
        }
        f.write_str(&self.message)
    }
}

fn refute(kind: RefutationKind, device: Option<usize>, op: Option<String>, message: String) -> Refutation {
    Refutation { kind, device, op, message }
}

fn from_why(w: Why, device: Option<usize>, op: String) -> Refutation {
    match w {
        Why::Wrong(m) => refute(RefutationKind::Wrong, device, Some(op), m),
        Why::Uncovered(m) => refute(RefutationKind::Uncovered, device, Some(op), m),
    }
}

/// Proves that `p`'s device programs compute `g` (the graph `p` was lowered from: full
/// shapes, weights as in the program), or says where the proof fails.
pub fn verify(g: &Graph, p: &Program) -> Result<Proof, Refutation> {
    let mut terms = Terms::default();
    let global = Global::interpret(g, &mut terms)?;
    let known = terms.len();
    let mut run = Run::new(g, p, &global, known);
    run.sources(&mut terms)?;
    run.interpret(&mut terms)?;
    let results = run.results(&terms)?;
    Ok(Proof {
        values: run.facts.iter().map(HashMap::len).sum(),
        devices: p.devices.len(),
        results,
        terms: terms.len(),
    })
}

/// The graph's values as terms, and its parameters.
struct Global {
    facts: HashMap<Value, Fact>,
    /// Parameters by name: their term and data (absent for external data).
    params: HashMap<String, (TermId, Option<Array>)>,
    /// The graph's literal initializers by name (a device may hold a piece of one).
    literals: HashMap<String, (TermId, Array)>,
}

/// Initializers larger than this are parameters by name, not literals by value.
const LITERAL_MAX: usize = 4096;

/// Pieces larger than this are taken as the program names them, their data not compared (a
/// premise, as the feeds' layouts are).
const COMPARE_MAX: usize = 1 << 20;

impl Global {
    fn interpret(g: &Graph, terms: &mut Terms) -> Result<Global, Refutation> {
        let state: HashSet<Value> = ir::train::carried_state(g).into_iter().map(|(_, s)| s).collect();
        let mut facts = HashMap::new();
        let mut params = HashMap::new();
        let mut literals = HashMap::new();
        for v in sources(g) {
            let name = g.value_name(v).to_string();
            let shape = dims(g, v).ok_or_else(|| global_err(format!("input `{name}` has no static shape")))?;
            let t = match &g.node(v.node).op {
                Op::Initializer(tensor) | Op::Input { default: Some(tensor) } => {
                    let data = (!tensor.is_external()).then(|| Array::from_tensor(tensor).ok()).flatten();
                    let numel: i64 = shape.iter().product();
                    match data {
                        Some(a) if !state.contains(&v) && numel as usize <= LITERAL_MAX => {
                            let t = Cx { terms, g, global: true }.literal(&a);
                            literals.insert(name.clone(), (t, a));
                            t
                        }
                        data => {
                            let t = terms.leaf(&name, &shape);
                            params.insert(name.clone(), (t, data));
                            t
                        }
                    }
                }
                _ => terms.leaf(&name, &shape),
            };
            facts.insert(v, Fact::whole(terms, t));
        }
        let order = g.op_nodes().map_err(|_| global_err("the graph has a cycle".into()))?;
        for n in order {
            let ins = inputs_of(g, n, &facts).map_err(|m| global_err(m.to_string()))?;
            // A rule that refuses the graph's own op leaves the prover without a statement.
            let outs = apply(&mut Cx { terms, g, global: true }, n, &ins).map_err(|w| {
                let (Why::Wrong(m) | Why::Uncovered(m)) = w;
                refute(RefutationKind::Uncovered, None, Some(g.describe(n)), format!("the graph itself: {m}"))
            })?;
            record(&mut facts, n, outs);
        }
        Ok(Global { facts, params, literals })
    }
}

/// A graph's inputs and initializers.
fn sources(g: &Graph) -> Vec<Value> {
    let mut out = g.input_values();
    out.extend(g.initializers().iter().map(|&n| Value::new(n, 0)));
    out.dedup();
    out
}

fn global_err(m: String) -> Refutation {
    refute(RefutationKind::Uncovered, None, None, format!("the graph itself: {m}"))
}

fn dims(g: &Graph, v: Value) -> Option<Vec<i64>> {
    g.tensor_type(v).and_then(|t| t.static_dims())
}

fn inputs_of(g: &Graph, n: NodeId, facts: &HashMap<Value, Fact>) -> Result<Vec<Option<Fact>>, String> {
    g.node(n)
        .inputs()
        .iter()
        .map(|v| match v {
            None => Ok(None),
            Some(v) => facts
                .get(v)
                .cloned()
                .map(Some)
                .ok_or_else(|| format!("`{}` is read before it is known", g.value_name(*v))),
        })
        .collect()
}

fn record(facts: &mut HashMap<Value, Fact>, n: NodeId, outs: Vec<Option<Fact>>) {
    for (slot, f) in outs.into_iter().enumerate() {
        if let Some(f) = f {
            facts.insert(Value::new(n, slot as u16), f);
        }
    }
}

/// Literals are terms by value; composite ops by their definitions ([`composite`]); the rest
/// by their rule ([`rules`]).
fn apply(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Result<Vec<Option<Fact>>, Why> {
    if let Op::Constant(_) = cx.g.node(n).op {
        let a = ir::ops::constant_value(cx.g, Value::new(n, 0), 1)
            .ok_or_else(|| Why::Uncovered("a Constant the prover cannot read".into()))?;
        let t = cx.literal(&a);
        return Ok(vec![Some(Fact::whole(cx.terms, t))]);
    }
    if let Some(folded) = folded(cx, n, ins) {
        return Ok(folded);
    }
    match &cx.g.node(n).op {
        Op::LayerNormalization(ln) => composite::layer_norm(cx, n, ln, ins),
        Op::LayerNormGrad(lg) => composite::layer_norm_grad(cx, &cx.g.node(n).op, lg.axis, ins),
        Op::SoftmaxCrossEntropyLoss(_)
        | Op::SoftmaxCrossEntropyLossGrad(_)
        | Op::NegativeLogLikelihoodLoss(_)
        | Op::NegativeLogLikelihoodLossGrad(_) => composite::loss(cx, n, ins),
        Op::BatchNormalization(_) | Op::BatchNormGrad(_) => composite::batch_norm(cx, n, ins),
        Op::GatherGrad(gg) => composite::gather_grad(cx, n, gg.axis.unwrap_or(0), ins),
        _ => rules::apply(cx, n, ins),
    }
}

/// An op on whole literals is the literal it evaluates to (both the graph and a device may
/// have folded some constants before the other did).
fn folded(cx: &mut Cx<'_>, n: NodeId, ins: &[Option<Fact>]) -> Option<Vec<Option<Fact>>> {
    let node = cx.g.node(n);
    // Not data movement (a slice of a literal is a piece of it) nor a scaling (a product with
    // zero keeps the value as a sum's term held by no device; other scales fold in `rules`).
    // (Shape arithmetic on integer literals folds: a pad computed from a shape.)
    let ints = ins.iter().flatten().all(|f| cx.terms.value(f.term).is_some_and(|a| a.dtype.is_int()));
    let moves =
        matches!(node.op.class(), OpClass::Comm | OpClass::Source) || node.op.class() == OpClass::Shape && !ints;
    let scales = matches!(node.op, Op::Mul(_) | Op::Div(_));
    if moves || scales || node.op.has_subgraphs() || ins.iter().all(Option::is_none) {
        return None;
    }
    let mut arrays = Vec::with_capacity(ins.len());
    for f in ins {
        match f {
            None => arrays.push(None),
            Some(f) if f.is_exact() && f.region == whole(cx.terms.shape(f.term)) => {
                arrays.push(Some(cx.terms.value(f.term)?.clone()));
            }
            Some(_) => return None,
        }
    }
    let refs: Vec<Option<&Array>> = arrays.iter().map(Option::as_ref).collect();
    let outs = ir::eval::eval_op(&node.op, &refs, node.num_outputs(), cx.g.opset).ok()?;
    if outs.iter().any(|a| a.shape.iter().product::<usize>() > LITERAL_MAX) {
        return None;
    }
    Some(
        outs.iter()
            .map(|a| {
                let t = cx.literal(a);
                Some(Fact::whole(cx.terms, t))
            })
            .collect(),
    )
}

/// The mesh coordinates of rank `r` (row-major, outermost axis first).
fn coords(mesh: &ir::shard::Mesh, mut r: usize) -> Vec<usize> {
    let mut c = vec![0; mesh.axes.len()];
    for a in (0..mesh.axes.len()).rev() {
        c[a] = r % mesh.axes[a].size;
        r /= mesh.axes[a].size;
    }
    c
}

/// The box of a tensor of `shape` that layout `layout` gives the device at `c`.
fn layout_region(layout: &[ir::shard::AxisShard], mesh: &ir::shard::Mesh, c: &[usize], shape: &[i64]) -> Region {
    (0..shape.len())
        .map(|d| {
            let (a, b) = dim_range(layout, mesh, c, d, shape[d].max(0) as usize);
            (a as i64, b as i64)
        })
        .collect()
}

/// One collective instance: the members' arrivals (device, node, fact), in group order.
type Arrivals = Vec<Option<(usize, NodeId, Fact)>>;

/// The interpretation of the devices' programs.
struct Run<'a> {
    g: &'a Graph,
    p: &'a Program,
    global: &'a Global,
    known: usize,
    facts: Vec<HashMap<Value, Fact>>,
    orders: Vec<Vec<NodeId>>,
    pos: Vec<usize>,
    /// Per device, the first op that computed each term the graph never computes.
    novel: HashMap<TermId, (usize, String)>,
    mailbox: HashMap<(usize, usize, i64), Fact>,
    /// Per group, per device: how many of the group's collectives it has joined.
    joined: HashMap<(Vec<i64>, usize), usize>,
    pending: HashMap<(Vec<i64>, usize), Arrivals>,
    ready: HashMap<(usize, NodeId), Fact>,
    arrived: HashSet<(usize, NodeId)>,
}

impl<'a> Run<'a> {
    fn new(g: &'a Graph, p: &'a Program, global: &'a Global, known: usize) -> Run<'a> {
        let orders: Vec<Vec<NodeId>> = p.devices.iter().map(|d| d.graph.op_nodes().unwrap_or_default()).collect();
        Run {
            g,
            p,
            global,
            known,
            facts: vec![HashMap::new(); p.devices.len()],
            pos: vec![0; orders.len()],
            orders,
            novel: HashMap::new(),
            mailbox: HashMap::new(),
            joined: HashMap::new(),
            pending: HashMap::new(),
            ready: HashMap::new(),
            arrived: HashSet::new(),
        }
    }

    fn mesh_of(&self, d: &DeviceProgram) -> (&'a ir::shard::Mesh, Vec<usize>) {
        let mesh = &self.p.meshes[d.stage.min(self.p.meshes.len() - 1)];
        (mesh, coords(mesh, d.rank))
    }

    /// The facts of every device's inputs and initializers.
    fn sources(&mut self, terms: &mut Terms) -> Result<(), Refutation> {
        for (i, d) in self.p.devices.iter().enumerate() {
            let (mesh, c) = self.mesh_of(d);
            let lg = &d.graph;
            for feed in &d.feeds {
                let v = lg.lookup(&feed.local).ok_or_else(|| {
                    refute(RefutationKind::Wrong, Some(i), None, format!("feed `{}` is no input", feed.local))
                })?;
                let gv = self.g.lookup(&feed.global).and_then(|gv| self.global.facts.get(&gv)).ok_or_else(|| {
                    refute(
                        RefutationKind::Wrong,
                        Some(i),
                        None,
                        format!("feed of `{}`, no input of the graph", feed.global),
                    )
                })?;
                let region = layout_region(&feed.layout, mesh, &c, terms.shape(gv.term));
                self.facts[i].insert(v, Fact::exact(gv.term, region));
            }
            for piece in &d.pieces {
                let Some(v) = lg.lookup(&piece.local) else { continue };
                let f = self
                    .named_piece(terms, lg, v, piece, mesh, &c)
                    .map_err(|m| refute(RefutationKind::Wrong, Some(i), Some(format!("`{}`", piece.local)), m))?;
                self.facts[i].insert(v, f);
            }
            for v in sources(lg) {
                if self.facts[i].contains_key(&v) {
                    continue;
                }
                let f = self
                    .local_source(terms, lg, v, mesh, &c)
                    .map_err(|m| refute(RefutationKind::Wrong, Some(i), Some(format!("`{}`", lg.value_name(v))), m))?;
                self.facts[i].insert(v, f);
            }
        }
        Ok(())
    }

    /// An initializer the program names as a piece of one of the graph's: that piece, its
    /// data (where both are present and small enough to compare) checked against it.
    fn named_piece(
        &self,
        terms: &Terms,
        lg: &Graph,
        v: Value,
        piece: &crate::program::Feed,
        mesh: &ir::shard::Mesh,
        c: &[usize],
    ) -> Result<Fact, String> {
        let (t, gdata) = match (self.global.params.get(&piece.global), self.global.literals.get(&piece.global)) {
            (Some((t, d)), _) => (*t, d.as_ref()),
            (None, Some((t, d))) => (*t, Some(d)),
            _ => return Err(format!("names a piece of `{}`, which is no initializer of the graph", piece.global)),
        };
        let region = layout_region(&piece.layout, mesh, c, terms.shape(t));
        let tensor = match &lg.node(v.node).op {
            Op::Initializer(x) | Op::Input { default: Some(x) } => x,
            _ => return Err("a piece that is no initializer".into()),
        };
        if tensor.dims != region.iter().map(|(a, b)| b - a).collect::<Vec<_>>() {
            return Err(format!("holds {:?}, not the piece {region:?} of `{}` it names", tensor.dims, piece.global));
        }
        let small = tensor.dims.iter().product::<i64>() as usize <= COMPARE_MAX;
        if let (Some(ga), true, false) = (gdata, small, tensor.is_external()) {
            let a = Array::from_tensor(tensor).map_err(|e| e.to_string())?;
            if crop(ga, &to_usize(&region)) != a {
                return Err(format!("holds data that is not the piece {region:?} of `{}` it names", piece.global));
            }
        }
        Ok(Fact::exact(t, region))
    }

    /// A device's initializer: a piece of the parameter it is named after (the piece whose
    /// data it holds, or for external data the piece it names), else a literal.
    fn local_source(
        &self,
        terms: &mut Terms,
        lg: &Graph,
        v: Value,
        mesh: &ir::shard::Mesh,
        c: &[usize],
    ) -> Result<Fact, String> {
        let name = lg.value_name(v);
        let tensor = match &lg.node(v.node).op {
            Op::Initializer(t) | Op::Input { default: Some(t) } => t,
            _ => return Err("an input with no feed".into()),
        };
        let local: Vec<i64> = tensor.dims.clone();
        let param = base_names(name).into_iter().find_map(|b| self.global.params.get(b));
        let data = (!tensor.is_external()).then(|| Array::from_tensor(tensor).ok()).flatten();
        let Some((t, gdata)) = param else {
            let a = data.ok_or_else(|| "external data that is no parameter's".to_string())?;
            // A piece of one of the graph's literals (an operand the lowering cut), or a
            // literal of its own.
            let lit = base_names(name).into_iter().find_map(|b| self.global.literals.get(b));
            if let Some((t, ga)) = lit.filter(|(_, ga)| ga.shape != a.shape) {
                let gshape = terms.shape(*t).to_vec();
                let found: Vec<Region> =
                    candidate_boxes(&gshape, &local).into_iter().filter(|b| crop(ga, &to_usize(b)) == a).collect();
                if let Some(first) = found.first() {
                    return Ok(Fact { alts: found[1..].to_vec(), ..Fact::exact(*t, first.clone()) });
                }
            }
            let t = Cx { terms, g: lg, global: false }.literal(&a);
            return Ok(Fact::whole(terms, t));
        };
        let gshape = terms.shape(*t).to_vec();
        if let (Some(a), Some(ga)) = (&data, gdata) {
            let boxes = candidate_boxes(&gshape, &local);
            let found: Vec<Region> = boxes.into_iter().filter(|b| &crop(ga, &to_usize(b)) == a).collect();
            let Some(first) = found.first() else {
                return Err(format!("holds data that is no piece of `{}`", terms.describe(*t)));
            };
            return Ok(Fact { alts: found[1..].to_vec(), ..Fact::exact(*t, first.clone()) });
        }
        // External data: the piece the program names.
        let piece = match &tensor.data {
            ir::TensorData::External(e) => e.iter().find(|(k, _)| k == "shardc_piece").map(|(_, v)| v.clone()),
            _ => None,
        };
        let region = match piece.as_deref().and_then(parse_piece) {
            Some((layout, at)) if at.len() == mesh.axes.len() => layout_region(&layout, mesh, &at, &gshape),
            _ if local == gshape => whole(&gshape),
            _ => return Err("a piece of an external parameter that does not say which".into()),
        };
        if region.iter().map(|(a, b)| b - a).collect::<Vec<_>>() != local {
            return Err(format!("holds {local:?}, not the piece {region:?} it names"));
        }
        let _ = c;
        Ok(Fact::exact(*t, region))
    }
}

fn to_usize(r: &Region) -> Vec<(usize, usize)> {
    r.iter().map(|&(a, b)| (a as usize, b as usize)).collect()
}

/// A local name and the names it may have been made fresh from (`w__2` from `w`).
fn base_names(name: &str) -> Vec<&str> {
    let mut out = vec![name];
    if let Some((b, k)) = name.rsplit_once("__")
        && !k.is_empty()
        && k.chars().all(|c| c.is_ascii_digit())
    {
        out.push(b);
    }
    out
}

/// `"[S(0), R] at [1, 0]"`: a layout and mesh coordinates.
fn parse_piece(s: &str) -> Option<(ir::shard::Sharding, Vec<usize>)> {
    let (l, at) = s.split_once(" at ")?;
    let layout = ir::shard::parse_sharding(l)?;
    let inner = at.trim().strip_prefix('[')?.strip_suffix(']')?;
    let c = if inner.trim().is_empty() {
        Vec::new()
    } else {
        inner.split(',').map(|x| x.trim().parse().ok()).collect::<Option<Vec<usize>>>()?
    };
    Some((layout, c))
}

/// The boxes of extents `local` aligned to multiples of them in `global` (at most 4,096).
fn candidate_boxes(global: &[i64], local: &[i64]) -> Vec<Region> {
    let mut out: Vec<Region> = vec![Vec::new()];
    for (&g, &l) in global.iter().zip(local) {
        if l <= 0 || g % l != 0 {
            return Vec::new();
        }
        let mut next = Vec::new();
        for b in &out {
            for k in 0..g / l {
                let mut x = b.clone();
                x.push((k * l, k * l + l));
                next.push(x);
            }
        }
        out = next;
        if out.len() > 4096 {
            return Vec::new();
        }
    }
    if global.len() != local.len() {
        return Vec::new();
    }
    out
}

mod run;
mod shape;

/// The first value (by creation) in `t`'s cone that the graph never computes, with the device
/// and op that computed it: where a wrong result went wrong.
fn first_novel(terms: &Terms, novel: &HashMap<TermId, (usize, String)>, t: TermId) -> Option<(TermId, usize, String)> {
    let mut stack = vec![t];
    let mut seen = HashSet::new();
    let mut best: Option<TermId> = None;
    while let Some(x) = stack.pop() {
        if !seen.insert(x) {
            continue;
        }
        if novel.contains_key(&x) && best.is_none_or(|b| x < b) {
            best = Some(x);
        }
        stack.extend(terms.inputs(x).iter().copied());
    }
    best.map(|b| {
        let (d, op) = novel[&b].clone();
        (b, d, op)
    })
}

/// Communication ops by class, for the run.
fn is_comm(op: &Op) -> bool {
    op.class() == OpClass::Comm
}

/// Results grouped per global output: (device, box).
type Delivered = BTreeMap<String, Vec<(usize, Region)>>;
