//! A plan's tensor-parallel axis as a `torch.distributed.tensor.parallel` plan that runs the
//! plan's forward layouts exactly, or the reasons it cannot.
//!
//! `parallelize_module` shards the parameters of `nn.Linear` and `nn.Embedding` modules
//! (`ColwiseParallel`, `RowwiseParallel`) and converts their inputs and outputs between local
//! tensors and the layouts named (`input_layouts`, `output_layouts`); every other op of the
//! model runs on the local tensors as they are, with replicated parameters (`SequenceParallel`
//! makes a module's replicated parameters' gradients whole when its input is split along the
//! sequence). So the export checks, op by op, that what torch will do is what the plan does:
//! each split GEMM belongs to a module torch can shard, the layouts at each module's boundary
//! are the ones the plan reads and writes there, and no op between modules needs a collective
//! (a layout change, a partial sum, a split parameter).

use std::collections::{HashMap, HashSet};

use ir::shard::{AxisShard, DimRole, strategy_shardings};
use ir::{Graph, NodeId, Op, Value};

use crate::cost::{Assignment, CostModel};
use ir::cost::is_param;

/// How torch shards a module.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Style {
    /// `ColwiseParallel`: the weight split by output features.
    Colwise,
    /// `RowwiseParallel`: the weight split by input features (an embedding by rows).
    Rowwise,
    /// `SequenceParallel`: replicated parameters, input and output split along the sequence.
    Sequence,
}

impl Style {
    fn class(self) -> &'static str {
        match self {
            Style::Colwise => "ColwiseParallel",
            Style::Rowwise => "RowwiseParallel",
            Style::Sequence => "SequenceParallel",
        }
    }
}

/// A layout of a local tensor on the tensor-parallel mesh, as torch names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// `Replicate()`.
    Replicate,
    /// `Shard(d)` (`-1` for the last dim).
    Shard(i64),
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Replicate => f.write_str("Replicate()"),
            Placement::Shard(d) => write!(f, "Shard({d})"),
        }
    }
}

/// One module of the torch plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Its path in the model as exported (`model.layers.0.self_attn.q_proj`).
    pub path: String,
    /// How torch shards it.
    pub style: Style,
    /// The layout its input has when it arrives (what the plan's producer wrote).
    pub input: Placement,
    /// The layout its consumers read (what the plan converts its output to).
    pub output: Placement,
}

impl Entry {
    /// The Python expression for the style (`ColwiseParallel(input_layouts=…, …)`).
    pub fn python(&self) -> String {
        match self.style {
            Style::Sequence => format!("{}(sequence_dim={})", self.style.class(), sequence_dim(self.input)),
            s => format!("{}(input_layouts={}, output_layouts={})", s.class(), self.input, self.output),
        }
    }
}

fn sequence_dim(p: Placement) -> i64 {
    match p {
        Placement::Shard(d) => d,
        Placement::Replicate => 1,
    }
}

/// The torch plan of a plan's tensor axis: its modules in model order, or why torch cannot
/// run the plan's layouts (`blockers`, each naming the op and the layouts).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TorchTp {
    /// The modules to shard.
    pub entries: Vec<Entry>,
    /// What keeps the plan from torch.
    pub blockers: Vec<String>,
}

/// The layouts of the plan on mesh axis `axis`, op by op.
struct Layouts<'a> {
    g: &'a Graph,
    cm: &'a CostModel<'a>,
    asg: &'a Assignment,
    axis: usize,
    /// Each op's input and output layouts on the axis (ops without a strategy: none).
    on_axis: HashMap<NodeId, (Vec<AxisShard>, Vec<AxisShard>)>,
}

impl<'a> Layouts<'a> {
    fn new(g: &'a Graph, cm: &'a CostModel<'a>, asg: &'a Assignment, axis: usize) -> Self {
        let at = |s: &ir::shard::Sharding| s.get(axis).copied().unwrap_or(AxisShard::Replicate);
        let on_axis = asg
            .strategies
            .iter()
            .map(|(&n, s)| {
                let (ins, outs) = strategy_shardings(cm.space(n), s);
                let ins = ins.iter().map(|i| i.as_ref().map_or(AxisShard::Replicate, at)).collect();
                (n, (ins, outs.iter().map(at).collect()))
            })
            .collect();
        Layouts { g, cm, asg, axis, on_axis }
    }

    /// What op `n` reads as input `i` and writes as output `j`, on the axis.
    fn reads(&self, n: NodeId, i: usize) -> AxisShard {
        self.on_axis.get(&n).and_then(|(ins, _)| ins.get(i).copied()).unwrap_or(AxisShard::Replicate)
    }

    fn writes(&self, n: NodeId, j: usize) -> AxisShard {
        self.on_axis.get(&n).and_then(|(_, outs)| outs.get(j).copied()).unwrap_or(AxisShard::Replicate)
    }

    /// The role of the iteration dim op `n` splits on the axis.
    fn role(&self, n: NodeId) -> Option<DimRole> {
        let i = (*self.asg.strategies.get(&n)?.get(self.axis)?)?;
        Some(self.cm.space(n).dims.get(i)?.role)
    }

    fn rank(&self, v: Value) -> Option<usize> {
        self.g.tensor_type(v).and_then(|t| t.rank())
    }

    /// `s` as torch names it for value `v` (a split of the last dim is `Shard(-1)`); `None`
    /// for a partial sum (a local tensor cannot hold one).
    fn placement(&self, v: Value, s: AxisShard) -> Option<Placement> {
        match s {
            AxisShard::Replicate => Some(Placement::Replicate),
            AxisShard::Split(d) if self.rank(v) == Some(d as usize + 1) => Some(Placement::Shard(-1)),
            AxisShard::Split(d) => Some(Placement::Shard(d as i64)),
            AxisShard::Partial => None,
        }
    }
}

fn is_constant(g: &Graph, v: Value) -> bool {
    matches!(g.node(v.node).op, Op::Initializer(_) | Op::Input { default: Some(_) })
}

/// The layout torch's local tensor of `v` holds (values no op wrote: replicated).
fn held_at(held: &HashMap<Value, AxisShard>, v: Value) -> AxisShard {
    held.get(&v).copied().unwrap_or(AxisShard::Replicate)
}

/// The layouts in which the ops that `inside` does not admit read `v`.
fn outside_reads(l: &Layouts, v: Value, inside: impl Fn(NodeId) -> bool) -> Vec<AxisShard> {
    l.g.users(v).into_iter().filter(|(u, _)| !inside(*u)).map(|(u, i)| l.reads(u, i)).collect()
}

/// The torch plan of the plan's tensor axes (`axes`; torch's `tp_mesh` is one of them).
pub fn torch_tp(g: &Graph, cm: &CostModel, asg: &Assignment, axes: &[usize]) -> TorchTp {
    let mut out = TorchTp::default();
    let &[axis] = axes else {
        if axes.len() > 1 {
            out.blockers.push(format!("tensor parallelism on {} mesh axes; a torch tp_mesh is one axis", axes.len()));
        }
        return out;
    };
    let l = Layouts::new(g, cm, asg, axis);
    let order = cm.order();
    // Each op's module(s), once: ops of one module form its group.
    let keys: HashMap<NodeId, String> = order
        .iter()
        .map(|&n| {
            let m = ir::scope::modules_or_path(g, n);
            (n, m.iter().map(|m| m.path.as_str()).collect::<Vec<_>>().join("+"))
        })
        .collect();
    let key = |n: NodeId| keys.get(&n).map_or("", String::as_str);
    // The modules torch shards: those of ops that read a parameter split on the axis.
    let mut sharded: Vec<NodeId> = Vec::new();
    for &n in order {
        let split_param = g
            .node(n)
            .inputs()
            .iter()
            .enumerate()
            .any(|(i, v)| v.is_some_and(|v| is_param(g, v)) && matches!(l.reads(n, i), AxisShard::Split(_)));
        if split_param {
            sharded.push(n);
        }
    }
    let groups: HashSet<&str> = sharded.iter().map(|&n| key(n)).filter(|k| !k.is_empty()).collect();
    for &n in &sharded {
        if key(n).is_empty() {
            out.blockers.push(format!(
                "{} ({}) reads a split parameter but the export names no module for it",
                g.op_name(n),
                g.node(n).op.op_type()
            ));
        }
    }
    // The layout torch's local tensors hold, value by value.
    let mut held: HashMap<Value, AxisShard> = HashMap::new();
    let mut done: HashSet<&str> = HashSet::new();
    let mut sequence: Vec<String> = Vec::new();
    for (at, &n) in order.iter().enumerate() {
        let k = key(n);
        if groups.contains(k) {
            if done.insert(k) {
                let members: Vec<NodeId> = order[at..].iter().copied().filter(|&m| key(m) == k).collect();
                module_entries(&l, &members, &held, &mut out);
            }
            // What the module's consumers read is what torch converts its output to.
            for j in 0..g.node(n).outputs().len() {
                let v = Value::new(n, j as u16);
                let read = outside_reads(&l, v, |u| key(u) == k).first().copied();
                held.insert(v, read.unwrap_or(AxisShard::Replicate));
            }
            continue;
        }
        between_modules(&l, n, &held, &mut out, &mut sequence);
        for j in 0..g.node(n).outputs().len() {
            held.insert(Value::new(n, j as u16), l.writes(n, j));
        }
    }
    let p = Placement::Shard(1);
    for path in sequence {
        if !out.entries.iter().any(|e| e.path == path) {
            out.entries.push(Entry { path, style: Style::Sequence, input: p, output: p });
        }
    }
    out
}

/// Checks op `n` between modules: torch runs it on the local tensors with replicated
/// parameters, so it must read what is held, write no partial sum, and read no split
/// parameter or constant; a named parameter (`….weight`: a module's, not a buffer the exporter
/// folded) read with a sequence-split input makes its module `SequenceParallel` (its gradient
/// is a sum over the sequence shards).
fn between_modules(
    l: &Layouts,
    n: NodeId,
    held: &HashMap<Value, AxisShard>,
    out: &mut TorchTp,
    sequence: &mut Vec<String>,
) {
    let g = l.g;
    let name = || format!("{} ({})", g.op_name(n), g.node(n).op.op_type());
    let mut reads_param = false;
    let mut seq_split = false;
    for (i, v) in g.node(n).inputs().iter().enumerate() {
        let Some(v) = *v else { continue };
        let want = l.reads(n, i);
        if is_constant(g, v) {
            // Torch holds every parameter and buffer outside the sharded modules whole.
            if want != AxisShard::Replicate {
                out.blockers.push(format!(
                    "{} reads {} split ({want}) outside a module torch shards",
                    name(),
                    g.value_name(v)
                ));
            }
            reads_param |= is_param(g, v) && ir::scope::parameter_module(g.value_name(v)).is_some();
            continue;
        }
        let have = held_at(held, v);
        if have != want {
            out.blockers.push(format!(
                "{} reads {} as {want} but it is {have} there: a layout change between modules, which parallelize_module does not make",
                name(),
                g.value_name(v)
            ));
        }
        // A hidden state `[batch, sequence, features]` split along the sequence.
        seq_split |= want == AxisShard::Split(1) && l.rank(v) == Some(3);
    }
    for j in 0..g.node(n).outputs().len() {
        if l.writes(n, j) == AxisShard::Partial {
            out.blockers.push(format!("{} leaves partial sums outside a module torch shards", name()));
        }
    }
    if reads_param && seq_split {
        match ir::scope::own_module_path(g, n) {
            Some(path) => {
                if !sequence.contains(&path) {
                    sequence.push(path);
                }
            }
            None => out.blockers.push(format!(
                "{} reads a replicated parameter with its input split (Shard(1)): its gradient needs a sum over the shards, which only SequenceParallel (sequence dim 1 of a named module) makes",
                name()
            )),
        }
    }
}

/// The entries of one module group (`members`: its ops in order; several modules when a
/// rewrite fused them), or the blockers that keep it from torch.
fn module_entries(l: &Layouts, members: &[NodeId], held: &HashMap<Value, AxisShard>, out: &mut TorchTp) {
    let g = l.g;
    let Some(&gemm) = members.iter().find(|&&n| {
        matches!(l.role(n), Some(DimRole::OutFeature | DimRole::InFeature | DimRole::Vocab))
            && g.node(n).inputs().iter().flatten().any(|v| is_param(g, *v))
    }) else {
        let n = members[0];
        out.blockers.push(format!(
            "{} ({}) splits a parameter of {} along a dim that is not a GEMM's or an embedding's features",
            g.op_name(n),
            g.node(n).op.op_type(),
            ir::scope::own_module_path(g, n).unwrap_or_default()
        ));
        return;
    };
    let node = g.node(gemm);
    let name = format!("{} ({})", g.op_name(gemm), node.op.op_type());
    let is_gather = matches!(node.op, Op::Gather(_));
    let style = match (l.role(gemm), is_gather) {
        (Some(DimRole::Vocab), true) => Style::Rowwise,
        (Some(DimRole::OutFeature | DimRole::Vocab), false) => Style::Colwise,
        (Some(DimRole::InFeature), false) => Style::Rowwise,
        _ => {
            out.blockers.push(format!("{name} splits an embedding by its features, which torch does not shard"));
            return;
        }
    };
    let modules = ir::scope::modules_or_path(g, gemm);
    if let Some(why) = not_torch_module(g, gemm, &modules, is_gather) {
        out.blockers.push(format!("{name}: {why}"));
        return;
    }
    if modules.len() > 1 && style == Style::Colwise && !columns_align(g, gemm, l) {
        out.blockers.push(format!(
            "{name} fuses {} and its split does not give each device the same share of each (ColwiseParallel on each would compute other columns)",
            modules.iter().map(|m| m.path.as_str()).collect::<Vec<_>>().join(", ")
        ));
        return;
    }
    // The activation the module reads (an embedding's ids).
    let slot = if is_gather { 1 } else { 0 };
    let Some(x) = node.input(slot) else { return };
    let want = l.reads(gemm, slot);
    let desired = match style {
        Style::Rowwise if !is_gather => {
            l.placement(x, AxisShard::Split(l.rank(x).unwrap_or(1).saturating_sub(1) as u8))
        }
        _ => Some(Placement::Replicate),
    };
    if l.placement(x, want) != desired {
        out.blockers.push(format!("{name} reads its input as {want}, not as {} does", style.class()));
        return;
    }
    let have = held_at(held, x);
    let Some(input) = l.placement(x, have) else {
        out.blockers.push(format!("{name} reads partial sums from outside the module"));
        return;
    };
    // The layout its consumers read: what torch converts the module's last output to.
    let last = *members.last().expect("a member");
    let v = Value::new(last, 0);
    let group: HashSet<NodeId> = members.iter().copied().collect();
    let readers = outside_reads(l, v, |u| group.contains(&u));
    let read = readers.first().copied().unwrap_or(AxisShard::Replicate);
    if readers.iter().any(|r| *r != read) {
        out.blockers.push(format!("{name}: the module's consumers read its output in different layouts"));
        return;
    }
    let Some(output) = l.placement(v, read) else {
        out.blockers.push(format!("{name}: its consumers read partial sums"));
        return;
    };
    for m in modules {
        if !out.entries.iter().any(|e| e.path == m.path) {
            out.entries.push(Entry { path: m.path, style, input, output });
        }
    }
}

/// Why torch cannot shard the module(s) of op `n`, if it cannot: a class other than
/// `nn.Linear`/`nn.Embedding` when the export names it, else a weight stored `[in, out]`
/// (transformers' `Conv1D`: a MatMul or Gemm reading `….weight` untransposed).
fn not_torch_module(g: &Graph, n: NodeId, modules: &[ir::scope::ModuleRef], is_gather: bool) -> Option<String> {
    for m in modules {
        if let Some(c) = &m.class
            && c != "torch.nn.modules.linear.Linear"
            && c != "torch.nn.modules.sparse.Embedding"
        {
            return Some(format!(
                "module {} is a {c}; torch's ColwiseParallel and RowwiseParallel shard nn.Linear and nn.Embedding only",
                m.path
            ));
        }
    }
    if is_gather {
        return None;
    }
    let node = g.node(n);
    if !matches!(node.op, Op::MatMul(_) | Op::Gemm(_)) {
        return Some(format!(
            "a {} op: torch's ColwiseParallel and RowwiseParallel shard nn.Linear and nn.Embedding only",
            node.op.op_type()
        ));
    }
    let w = node.input(1)?;
    let untransposed = match &node.op {
        Op::MatMul(_) => true,
        Op::Gemm(gm) => gm.trans_b() == 0,
        _ => false,
    };
    let name = g.value_name(w);
    (untransposed && is_param(g, w) && name.ends_with(".weight") && !name.contains("::")).then(|| {
        format!(
            "its weight {name} is stored [in, out] (transformers' Conv1D, as in GPT-2), which torch's ColwiseParallel and RowwiseParallel do not shard (they take nn.Linear, [out, in]); convert those modules to nn.Linear first"
        )
    })
}

/// A fused GEMM split by columns gives each device, for each model tensor it joins, the same
/// contiguous share that `ColwiseParallel` on that tensor's module would: device `c` of `k`
/// holds the `c`-th of `k` equal parts of each (heads interleaved by the fusion do).
fn columns_align(g: &Graph, n: NodeId, l: &Layouts) -> bool {
    let Some(w) = g.node(n).input(1) else { return false };
    let Some(o) = crate::algebra::origin(g, w) else { return false };
    let AxisShard::Split(d) = l.reads(n, 1) else { return false };
    if d as usize != o.axis {
        return false;
    }
    let k = l.cm.mesh.axes.get(l.axis).map_or(1, |a| a.size) as i64;
    let total: i64 = o.pieces.iter().map(|p| p.len).sum();
    if k <= 0 || total % k != 0 {
        return false;
    }
    let chunk = total / k;
    // Each tensor's extent, and, per device, the ranges of it that device holds.
    let mut extent: HashMap<&str, i64> = HashMap::new();
    for p in &o.pieces {
        *extent.entry(p.tensor.as_str()).or_default() += p.len;
    }
    let mut held: HashMap<(i64, &str), Vec<(i64, i64)>> = HashMap::new();
    let mut at = 0;
    for p in &o.pieces {
        let (c, end_c) = (at / chunk, (at + p.len - 1) / chunk);
        if c != end_c {
            return false;
        }
        let (s, e) = p.slice.map_or((0, p.len), |(_, s, e)| (s, e));
        held.entry((c, p.tensor.as_str())).or_default().push((s, e));
        at += p.len;
    }
    extent.iter().all(|(t, &len)| {
        len % k == 0
            && (0..k).all(|c| {
                let mut r = held.get(&(c, *t)).cloned().unwrap_or_default();
                r.sort();
                let mut next = c * len / k;
                r.iter().all(|&(s, e)| {
                    let ok = s == next;
                    next = e;
                    ok
                }) && next == (c + 1) * len / k
            })
    })
}
