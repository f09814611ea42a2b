//! The resharding algebra: the steps that turn one layout of a tensor into another, for the
//! cost model to price and the lowering to emit — the same steps, so a plan's priced
//! communication is its program's communication.
//!
//! A layout gives, per mesh axis, `R`, `S(d)` or `P` ([`crate::shard::AxisShard`]). When
//! several axes split one tensor dim, the axes nest in mesh order: the first (outer) axis
//! cuts the dim into blocks, the next cuts each block, and so on, so the device at
//! coordinates `c` holds block `((c[a₁]·p₂ + c[a₂])·p₃ + …)`. [`reshard`] returns, for any pair
//! of layouts, nested splits included, a correct sequence of [`CommStep`]s on device groups:
//!
//! 1. local slices that only refine a dim's split (an axis free in the source taking the
//!    next inner cut of the target) — first, so the collectives after them move less;
//! 2. pending sums: a reduce-scatter when the summing axes become the next inner cuts of one
//!    dim, else an all-reduce over all of them (as reduce-scatter / all-reduce / all-gather
//!    over the link hierarchy when the [`Policy`] says so);
//! 3. an all-to-all for an axis that moves from the innermost cut of one dim to the next
//!    inner cut of another;
//! 4. all-gathers of the cuts a dim must lose (one collective over the group of those axes,
//!    groups over slower links first, on the smaller data);
//! 5. the remaining local slices, and zeroing for partial sums made from a whole value.
//!
//! The gradient of a resharding flows through the same function: the backward pass reshards
//! a gradient from its consumer's layout (where a replicated input of a split op becomes a
//! partial sum) back to its producer's.

use serde::{Deserialize, Serialize};

use crate::shard::{AxisShard, LinkLevel, Mesh, Sharding};

pub use crate::layout::{Halo, halo};

/// What a step does.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// Sums the partial values of the group; every member gets the sum.
    AllReduce,
    /// Sums the partial values of the group and keeps this member's part of dim `dim`.
    ReduceScatter {
        /// The tensor dim cut.
        dim: usize,
    },
    /// Concatenates the members' pieces along dim `dim`, in group order.
    AllGather {
        /// The tensor dim joined.
        dim: usize,
    },
    /// Cuts dim `split` into one part per member, sends part `j` to member `j`, and joins
    /// what arrives along dim `concat`.
    AllToAll {
        /// The dim cut and sent.
        split: usize,
        /// The dim the received parts are joined along.
        concat: usize,
    },
    /// Takes this device's piece of the dims the step's axes newly split (no communication).
    Slice,
    /// Partial sums from a whole value: the devices off coordinate 0 of the step's axes hold
    /// zeros (no communication).
    Zero,
}

impl StepKind {
    /// The `snake_case` kind used in reports (`all_reduce`, `slice` …).
    pub fn name(&self) -> &'static str {
        match self {
            StepKind::AllReduce => "all_reduce",
            StepKind::ReduceScatter { .. } => "reduce_scatter",
            StepKind::AllGather { .. } => "all_gather",
            StepKind::AllToAll { .. } => "all_to_all",
            StepKind::Slice => "slice",
            StepKind::Zero => "zero",
        }
    }

    /// The step moves data between devices.
    pub fn communicates(&self) -> bool {
        !matches!(self, StepKind::Slice | StepKind::Zero)
    }
}

/// One step of a resharding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommStep {
    /// What it does.
    pub kind: StepKind,
    /// The mesh axes of its group (ascending), or the axes a local step slices or zeroes.
    pub axes: Vec<usize>,
    /// Bytes per device of the tensor it operates on: the input of an all-reduce,
    /// reduce-scatter or all-to-all, the output of an all-gather, the piece a local slice
    /// copies out; 0 for a zeroing.
    pub bytes: f64,
    /// The layout after the step (intermediate steps of a hierarchical all-reduce keep the
    /// layout before it).
    pub to: Sharding,
}

impl CommStep {
    /// Devices in its group.
    pub fn group_size(&self, mesh: &Mesh) -> usize {
        self.axes.iter().map(|&a| mesh.axes[a].size).product()
    }

    /// Bytes each device sends: `(p−1)/p · bytes`, twice that for an all-reduce (ring
    /// algorithms); 0 for local steps.
    pub fn bytes_moved(&self, mesh: &Mesh) -> f64 {
        moved(&self.kind, self.group_size(mesh), self.bytes)
    }

    /// The link level its group spans: the slowest of its axes.
    pub fn level(&self, mesh: &Mesh) -> LinkLevel {
        if self.axes.iter().any(|&a| mesh.axes[a].level == LinkLevel::Inter) {
            LinkLevel::Inter
        } else {
            LinkLevel::Intra
        }
    }
}

/// Bytes each device sends in a step of `kind` over a group of `p` on `bytes` (see
/// [`CommStep::bytes`]).
pub fn moved(kind: &StepKind, p: usize, bytes: f64) -> f64 {
    if p <= 1 || !kind.communicates() {
        return 0.0;
    }
    let f = (p - 1) as f64 / p as f64;
    match kind {
        StepKind::AllReduce => 2.0 * f * bytes,
        _ => f * bytes,
    }
}

/// Choices the algebra leaves to the machine: they are made once per mesh (by the cost
/// model) and recorded in the plan, so pricing and lowering agree.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// An all-reduce whose group spans nodes runs as reduce-scatter inside the nodes,
    /// all-reduce of the shards across them, all-gather inside them (else: one ring).
    pub hierarchical_all_reduce: bool,
}

/// For each tensor dim, the mesh axes that split it, outer (lower axis index) first.
pub fn split_axes(layout: &[AxisShard], rank: usize) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); rank];
    for (a, s) in layout.iter().enumerate() {
        if let AxisShard::Split(d) = s
            && (*d as usize) < rank
        {
            out[*d as usize].push(a);
        }
    }
    out
}

/// Bytes per device of a tensor of `total` bytes under `layout`.
pub fn local_bytes(total: f64, layout: &[AxisShard], mesh: &Mesh) -> f64 {
    let f: f64 = layout
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, AxisShard::Split(_)))
        .map(|(a, _)| mesh.axes[a].size as f64)
        .product();
    total / f
}

/// Dims of the local piece of a tensor of `dims` under `layout`.
pub fn local_dims(dims: &[i64], layout: &[AxisShard], mesh: &Mesh) -> Vec<i64> {
    crate::shard::local_dims(dims, layout, mesh)
}

/// A value devices hold in one layout, getting any other by resharding (priced and emitted):
/// every computed value, and float graph inputs and parameters (fed, or stored with their
/// optimizer state, in the layout their first reader needs). Integer inputs and constants
/// (token ids, indices, shape literals) are instead provided by the host in every layout a
/// reader needs, at no communication.
pub fn held_once(g: &crate::Graph, v: crate::Value) -> bool {
    use crate::Op;
    match &g.node(v.node).op {
        Op::Input { default: Some(t) } | Op::Initializer(t) => t.dtype.is_float(),
        Op::Input { default: None } => g.tensor_type(v).is_some_and(|t| t.dtype.is_float()),
        _ => true,
    }
}

/// The layout a source ([`held_once`]) is held in when its first reader needs it in `need`:
/// whole on the axes `need` wants partial sums on (its readers get them by zeroing the copies
/// off coordinate 0). A parameter held as partial sums would be updated on each device as if
/// that device held it.
pub fn held_layout(need: &[AxisShard]) -> Sharding {
    need.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect()
}

/// The layout value `v` of `g` crosses a pipeline cut in when the two stages have equal
/// meshes of `axes` axes, its op planned as `strategy`: the layout it was computed in, partial
/// sums reduced. Each device sends its piece to the device at its place in the next stage,
/// which reshards it to what its readers need (Megatron's point-to-point transfers of a
/// shard; between unequal meshes the value goes whole).
pub fn send_layout(g: &crate::Graph, v: crate::Value, strategy: &[Option<usize>], axes: usize) -> Sharding {
    let (_, outs) = crate::shard::strategy_shardings(&crate::shard::iter_space(g, v.node), strategy);
    outs.get(v.slot as usize).map_or_else(|| vec![AxisShard::Replicate; axes], |l| held_layout(l))
}

use crate::train::carried_state;

/// The ops a pipeline stage computes for itself instead of receiving: those computed from
/// constants alone (initializers, defaulted inputs, other such ops). Carried state counts as
/// a constant only when its next value is itself computed so (a training step's counter,
/// which every stage then advances on its own); a parameter does not, since only the stage
/// that updates it would see the new value. Communication ops never count.
pub fn computed_everywhere(g: &crate::Graph, order: &[crate::NodeId]) -> std::collections::HashSet<crate::NodeId> {
    computed_everywhere_except(g, order, &|_| false)
}

/// [`computed_everywhere`] of the training step of forward graph `g`: its float initializers
/// are the parameters the step updates (the training graph carries them as state), so what
/// is computed from them (a transposed weight) is sent between stages, not recomputed; what
/// is computed from constants, defaulted inputs and integer initializers (shapes, masks) is
/// computed in every stage. The pipeline's price counts only the values crossing a cut that
/// are not.
pub fn computed_everywhere_in_training(
    g: &crate::Graph,
    order: &[crate::NodeId],
) -> std::collections::HashSet<crate::NodeId> {
    computed_everywhere_except(g, order, &|v| {
        matches!(g.node(v.node).op, crate::Op::Initializer(_)) && g.tensor_type(v).is_some_and(|t| t.dtype.is_float())
    })
}

/// [`computed_everywhere`] with the values `varies` says are not constants.
fn computed_everywhere_except(
    g: &crate::Graph,
    order: &[crate::NodeId],
    varies: &dyn Fn(crate::Value) -> bool,
) -> std::collections::HashSet<crate::NodeId> {
    use crate::Op;
    let carried = carried_state(g);
    let mut varying: std::collections::HashSet<crate::Value> = Default::default();
    loop {
        let mut out: std::collections::HashSet<crate::NodeId> = Default::default();
        for &n in order {
            let node = g.node(n);
            let constant = node.inputs().iter().flatten().all(|v| {
                out.contains(&v.node)
                    || (matches!(g.node(v.node).op, Op::Initializer(_) | Op::Input { default: Some(_) })
                        && !varying.contains(v)
                        && !varies(*v))
            });
            if constant && node.op.class() != crate::OpClass::Comm {
                out.insert(n);
            }
        }
        let before = varying.len();
        varying.extend(carried.iter().filter(|(next, _)| !out.contains(&next.node)).map(|&(_, state)| state));
        if varying.len() == before {
            return out;
        }
    }
}

use crate::train::is_gradient_output;

/// ZeRO's layouts in a training graph, read off its optimizer updates (`reads(u, j)`: the
/// layout update `u` reads its input `j` in, from its strategy). The cost model prices and
/// the lowering emits them alike:
/// - stage 2 and up: a parameter's gradient output (read by its update) is
///   delivered in the layout its update reads it in — reduce-scattered into the shard the
///   update runs on — so no device holds the whole gradient once its update has run;
/// - stage 3: a parameter is held as its update reads it (each device keeps its shard); its
///   readers get it gathered, in the forward pass and again in the backward pass
///   ([`ZeroLayouts::regathered`]: a copy made for the forward pass is not kept for the
///   backward).
#[derive(Clone, Debug, Default)]
pub struct ZeroLayouts {
    /// Stage 3: per parameter, the layout it is held in.
    pub params: std::collections::HashMap<crate::Value, Sharding>,
    /// Stage 2 and up: per gradient output, the layout it is delivered in.
    pub gradients: std::collections::HashMap<crate::Value, Sharding>,
}

impl ZeroLayouts {
    /// The layouts of ZeRO stage `stage` in training graph `g` (none below stage 2).
    pub fn new(g: &crate::Graph, stage: u8, reads: impl Fn(crate::NodeId, usize) -> Option<Sharding>) -> ZeroLayouts {
        let mut z = ZeroLayouts::default();
        if stage < 2 {
            return z;
        }
        for n in g.node_ids() {
            let node = g.node(n);
            if !node.op.is_update() {
                continue;
            }
            if let Some(gr) = node.input(1).filter(|&v| is_gradient_output(g, v))
                && let Some(l) = reads(n, 1)
            {
                z.gradients.insert(gr, l);
            }
            if stage >= 3
                && let Some(p) = node.input(0).filter(|&v| matches!(g.node(v.node).op, crate::Op::Initializer(_)))
                && let Some(l) = reads(n, 0)
            {
                z.params.insert(p, held_layout(&l));
            }
        }
        z
    }

    /// The layout graph output `v` of `g` is delivered in: a ZeRO gradient's shard, else
    /// [`delivered_layout`]'s (the arguments are its).
    pub fn delivered(
        &self,
        g: &crate::Graph,
        carried: &[(crate::Value, crate::Value)],
        v: crate::Value,
        from: &[AxisShard],
        cuts: &[bool],
        held: impl Fn(crate::Value) -> Option<Sharding>,
    ) -> Sharding {
        match self.gradients.get(&v) {
            Some(l) => l.clone(),
            None => delivered_layout(g, carried, v, from, cuts, held),
        }
    }

    /// Whether going from an op in phase `prev` to one in `next` ends a forward pass: where
    /// the copies of [`ZeroLayouts::regathered`] values made for it are dropped.
    pub fn ends_forward(prev: Option<Phase>, next: Option<Phase>) -> bool {
        prev == Some(Phase::Forward) && next.is_some_and(|p| p != Phase::Forward)
    }

    /// Whether a copy of `v` in another layout than its held one, made in the forward pass,
    /// is dropped when the forward pass ends (a ZeRO-3 parameter: gathered again for the
    /// backward pass).
    pub fn regathered(&self, v: crate::Value) -> bool {
        self.params.contains_key(&v)
    }
}

/// The layout graph output `v` of `g`, held in `from`, is delivered in: carried state in the
/// layout its state is held in (`held`, when the state is read at all); a gradient output
/// ([`is_gradient_output`]) as it is (its pieces, partial sums included, are assembled on
/// the host when they are asked for: a training step moves no bytes for them); any other
/// output per [`output_layout`] (`cuts`: its [`output_cuts`]).
pub fn delivered_layout(
    g: &crate::Graph,
    carried: &[(crate::Value, crate::Value)],
    v: crate::Value,
    from: &[AxisShard],
    cuts: &[bool],
    held: impl Fn(crate::Value) -> Option<Sharding>,
) -> Sharding {
    if is_gradient_output(g, v) {
        return from.to_vec();
    }
    carried
        .iter()
        .find(|(n, _)| *n == v)
        .and_then(|&(_, s)| held(s))
        .map(|l| held_layout(&l))
        .unwrap_or_else(|| output_layout(from, cuts))
}

/// Work state of [`reshard`].
struct Cx<'a> {
    dims: &'a [i64],
    total: f64,
    mesh: &'a Mesh,
    cur: Sharding,
    steps: Vec<CommStep>,
}

impl Cx<'_> {
    fn local(&self) -> f64 {
        local_bytes(self.total, &self.cur, self.mesh)
    }

    fn push(&mut self, kind: StepKind, axes: Vec<usize>, bytes: f64) {
        self.steps.push(CommStep { kind, axes, bytes, to: self.cur.clone() });
    }

    /// Local slices that extend a dim's split with axes free (`R`) now, in nesting order.
    fn refine(&mut self, to: &[AxisShard]) {
        let rank = self.dims.len();
        let mut sliced = Vec::new();
        for d in 0..rank {
            let (c, t) = (split_axes(&self.cur, rank)[d].clone(), split_axes(to, rank)[d].clone());
            if !t.starts_with(&c) {
                continue;
            }
            for &b in &t[c.len()..] {
                if self.cur[b] != AxisShard::Replicate {
                    break;
                }
                self.cur[b] = AxisShard::Split(d as u8);
                sliced.push(b);
            }
        }
        if !sliced.is_empty() {
            sliced.sort_unstable();
            let bytes = self.local();
            self.push(StepKind::Slice, sliced, bytes);
        }
    }

    /// Pending sums the target does not keep: reduce-scatters where the summing axes are the
    /// target's next inner cuts of a dim, one all-reduce over the rest.
    fn reduce(&mut self, to: &[AxisShard], policy: Policy) {
        let rank = self.dims.len();
        let pending: Vec<usize> =
            (0..self.cur.len()).filter(|&a| self.cur[a] == AxisShard::Partial && to[a] != AxisShard::Partial).collect();
        if pending.is_empty() {
            return;
        }
        let mut rest = Vec::new();
        for d in 0..rank {
            let group: Vec<usize> = pending.iter().copied().filter(|&a| to[a] == AxisShard::Split(d as u8)).collect();
            if group.is_empty() {
                continue;
            }
            let c = split_axes(&self.cur, rank)[d].clone();
            let t = split_axes(to, rank)[d].clone();
            let mut want = c.clone();
            want.extend(&group);
            let parts: i64 = group.iter().map(|&a| self.mesh.axes[a].size as i64).product();
            let local_d = local_dims(self.dims, &self.cur, self.mesh)[d];
            if t.starts_with(&want) && local_d % parts == 0 {
                let bytes = self.local();
                for &a in &group {
                    self.cur[a] = AxisShard::Split(d as u8);
                }
                self.push(StepKind::ReduceScatter { dim: d }, group, bytes);
            } else {
                rest.extend(group);
            }
        }
        rest.extend(pending.iter().copied().filter(|&a| !matches!(to[a], AxisShard::Split(_))));
        rest.sort_unstable();
        rest.dedup();
        if rest.is_empty() {
            return;
        }
        self.all_reduce(rest, policy);
    }

    /// An all-reduce over `axes`: one ring, or reduce-scatter / all-reduce / all-gather over
    /// the link hierarchy.
    fn all_reduce(&mut self, axes: Vec<usize>, policy: Policy) {
        let bytes = self.local();
        let intra: Vec<usize> = axes.iter().copied().filter(|&a| self.mesh.axes[a].level == LinkLevel::Intra).collect();
        let inter: Vec<usize> = axes.iter().copied().filter(|&a| self.mesh.axes[a].level == LinkLevel::Inter).collect();
        let q: i64 = intra.iter().map(|&a| self.mesh.axes[a].size as i64).product();
        let local = local_dims(self.dims, &self.cur, self.mesh);
        // The hierarchy cuts the largest local dim the intra-node group divides.
        let cut = (0..local.len()).filter(|&d| local[d] % q.max(1) == 0).max_by_key(|&d| (local[d], usize::MAX - d));
        match (policy.hierarchical_all_reduce && !intra.is_empty() && !inter.is_empty(), cut) {
            (true, Some(h)) => {
                self.push(StepKind::ReduceScatter { dim: h }, intra.clone(), bytes);
                self.push(StepKind::AllReduce, inter.clone(), bytes / q as f64);
                for &a in &axes {
                    self.cur[a] = AxisShard::Replicate;
                }
                self.push(StepKind::AllGather { dim: h }, intra, bytes);
            }
            _ => {
                for &a in &axes {
                    self.cur[a] = AxisShard::Replicate;
                }
                self.push(StepKind::AllReduce, axes, bytes);
            }
        }
    }

    /// All-to-alls for axes that move from the innermost cut of one dim to the next inner
    /// cut of another in the target.
    fn exchange(&mut self, to: &[AxisShard]) {
        let rank = self.dims.len();
        for a in 0..self.cur.len() {
            let (AxisShard::Split(d), AxisShard::Split(e)) = (self.cur[a], to[a]) else { continue };
            if d == e {
                continue;
            }
            let (d, e) = (d as usize, e as usize);
            let split = split_axes(&self.cur, rank);
            let mut grown = split[e].clone();
            grown.push(a);
            let p = self.mesh.axes[a].size as i64;
            let local_e = local_dims(self.dims, &self.cur, self.mesh)[e];
            if split[d].last() == Some(&a) && split_axes(to, rank)[e].starts_with(&grown) && local_e % p == 0 {
                let bytes = self.local();
                self.cur[a] = AxisShard::Split(e as u8);
                self.push(StepKind::AllToAll { split: e, concat: d }, vec![a], bytes);
            }
        }
    }

    /// All-gathers of the cuts each dim must lose: over the group of those axes, groups that
    /// span nodes first (while the data is smaller).
    fn gather(&mut self, to: &[AxisShard]) {
        let rank = self.dims.len();
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        let (cur_d, to_d) = (split_axes(&self.cur, rank), split_axes(to, rank));
        for d in 0..rank {
            let common = cur_d[d].iter().zip(&to_d[d]).take_while(|(x, y)| x == y).count();
            if common < cur_d[d].len() {
                groups.push((d, cur_d[d][common..].to_vec()));
            }
        }
        let inter = |g: &[usize]| g.iter().any(|&a| self.mesh.axes[a].level == LinkLevel::Inter);
        groups.sort_by_key(|(d, g)| (!inter(g), *d));
        for (d, g) in groups {
            for &a in &g {
                self.cur[a] = AxisShard::Replicate;
            }
            let bytes = self.local();
            self.push(StepKind::AllGather { dim: d }, g, bytes);
        }
    }

    /// Partial sums the target wants on axes where the value is whole.
    fn zero(&mut self, to: &[AxisShard]) {
        let axes: Vec<usize> =
            (0..self.cur.len()).filter(|&a| to[a] == AxisShard::Partial && self.cur[a] != AxisShard::Partial).collect();
        if !axes.is_empty() {
            for &a in &axes {
                self.cur[a] = AxisShard::Partial;
            }
            self.push(StepKind::Zero, axes, 0.0);
        }
    }
}

/// The steps that turn layout `from` of a tensor of global `dims` (of `elem_bytes` bytes per
/// element) into layout `to` on `mesh` (see the module documentation). Empty when the
/// layouts are equal.
pub fn reshard(
    dims: &[i64],
    elem_bytes: f64,
    from: &[AxisShard],
    to: &[AxisShard],
    mesh: &Mesh,
    policy: Policy,
) -> Vec<CommStep> {
    if from == to {
        return Vec::new();
    }
    let total = dims.iter().map(|&d| d.max(0) as f64).product::<f64>() * elem_bytes;
    let mut cx = Cx { dims, total, mesh, cur: from.to_vec(), steps: Vec::new() };
    cx.refine(to);
    cx.reduce(to, policy);
    cx.exchange(to);
    cx.gather(to);
    cx.refine(to);
    cx.zero(to);
    debug_assert_eq!(cx.cur, to, "resharding {from:?} → {to:?} ended in {:?}", cx.cur);
    cx.steps
}

/// The dims of each graph output its delivered layout keeps cuts of ([`output_layout`]):
/// every dim of an output per sample or per token — one with a dim carrying the batch
/// (`batch`: [`crate::dims::batch_dims`]) or the sequence
/// ([`crate::dims::sequence_dims`]) — none of any other (state, a scalar). A loss over
/// samples and tokens reads its predictions where they are, as Megatron's vocab-parallel
/// cross-entropy reads logits cut along the vocabulary (its per-token max and sum
/// all-reductions, B·S values each, are not priced), and the host assembles the pieces: a
/// long sequence's logits are not gathered onto every device of a context-parallel group,
/// nor a vocabulary-parallel head's onto every device of its tensor group.
pub fn output_cuts(
    g: &crate::Graph,
    batch: &std::collections::HashMap<crate::Value, Vec<bool>>,
) -> std::collections::HashMap<crate::Value, Vec<bool>> {
    let sequence = crate::dims::sequence_dims(g);
    let mut cuts = std::collections::HashMap::new();
    for v in g.outputs().iter().map(|o| o.value) {
        let (b, s) = (batch.get(&v), sequence.get(&v));
        let Some(n) = b.or(s).map(Vec::len) else { continue };
        let flag = |f: Option<&Vec<bool>>, d: usize| f.and_then(|f| f.get(d)).copied().unwrap_or(false);
        let per_token = (0..n).any(|d| flag(b, d) || flag(s, d));
        cuts.insert(v, vec![per_token; n]);
    }
    cuts
}

/// The layout a graph output is delivered in from `layout`: pending sums reduced, and only
/// cuts of the dims `cuts` marks kept ([`output_cuts`]: every dim of a per-sample or
/// per-token output) — what a loss or the host reads.
pub fn output_layout(layout: &[AxisShard], cuts: &[bool]) -> Sharding {
    layout
        .iter()
        .map(|s| match s {
            AxisShard::Split(d) if cuts.get(*d as usize).copied().unwrap_or(false) => *s,
            _ => AxisShard::Replicate,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::MeshAxis;
    use AxisShard::*;

    fn mesh(sizes: &[(usize, LinkLevel)]) -> Mesh {
        Mesh {
            axes: sizes
                .iter()
                .enumerate()
                .map(|(i, &(size, level))| MeshAxis { name: format!("m{i}"), size, level })
                .collect(),
        }
    }

    fn kinds(steps: &[CommStep]) -> Vec<(&'static str, Vec<usize>)> {
        steps.iter().map(|s| (s.kind.name(), s.axes.clone())).collect()
    }

    #[test]
    fn one_axis_collectives() {
        let m = mesh(&[(8, LinkLevel::Intra)]);
        let d = [64, 32];
        assert_eq!(
            kinds(&reshard(&d, 4.0, &[Replicate], &[Split(0)], &m, Policy::default())),
            vec![("slice", vec![0])]
        );
        assert_eq!(
            kinds(&reshard(&d, 4.0, &[Split(0)], &[Replicate], &m, Policy::default())),
            vec![("all_gather", vec![0])]
        );
        assert_eq!(
            kinds(&reshard(&d, 4.0, &[Partial], &[Replicate], &m, Policy::default())),
            vec![("all_reduce", vec![0])]
        );
        assert_eq!(
            kinds(&reshard(&d, 4.0, &[Partial], &[Split(1)], &m, Policy::default())),
            vec![("reduce_scatter", vec![0])]
        );
        assert_eq!(
            kinds(&reshard(&d, 4.0, &[Split(0)], &[Split(1)], &m, Policy::default())),
            vec![("all_to_all", vec![0])]
        );
        assert_eq!(kinds(&reshard(&d, 4.0, &[Replicate], &[Partial], &m, Policy::default())), vec![("zero", vec![0])]);
        // An all-gather to the whole 64×32×4 bytes moves 7/8 of it.
        let s = reshard(&d, 4.0, &[Split(0)], &[Replicate], &m, Policy::default());
        assert_eq!(s[0].bytes, 8192.0);
        assert_eq!(s[0].bytes_moved(&m), 8192.0 * 7.0 / 8.0);
    }

    #[test]
    fn nested_splits_gather_only_the_cuts_they_lose() {
        let m = mesh(&[(2, LinkLevel::Intra), (4, LinkLevel::Intra)]);
        let d = [64, 8];
        // Losing the inner cut: one all-gather over the inner axis, on pieces of 1/8.
        let s = reshard(&d, 4.0, &[Split(0), Split(0)], &[Split(0), Replicate], &m, Policy::default());
        assert_eq!(kinds(&s), vec![("all_gather", vec![1])]);
        assert_eq!(s[0].bytes, 2048.0 / 2.0);
        // Losing the outer cut: both cuts go (one gather over both axes), then the inner axis
        // cuts again.
        let s = reshard(&d, 4.0, &[Split(0), Split(0)], &[Replicate, Split(0)], &m, Policy::default());
        assert_eq!(kinds(&s), vec![("all_gather", vec![0, 1]), ("slice", vec![1])]);
        // A slice on a free axis first makes the gather smaller.
        let s = reshard(&d, 4.0, &[Split(0), Replicate], &[Replicate, Split(1)], &m, Policy::default());
        assert_eq!(kinds(&s), vec![("slice", vec![1]), ("all_gather", vec![0])]);
        assert_eq!(s[1].bytes, 2048.0 / 4.0);
    }

    #[test]
    fn pending_sums_reduce_scatter_only_onto_the_next_inner_cut() {
        let m = mesh(&[(2, LinkLevel::Intra), (4, LinkLevel::Intra)]);
        let d = [64, 8];
        let s = reshard(&d, 4.0, &[Split(0), Partial], &[Split(0), Split(0)], &m, Policy::default());
        assert_eq!(kinds(&s), vec![("reduce_scatter", vec![1])]);
        // Onto an outer cut it cannot: all-reduce, then slice.
        let s = reshard(&d, 4.0, &[Partial, Split(0)], &[Split(0), Split(0)], &m, Policy::default());
        assert_eq!(kinds(&s)[0], ("all_reduce", vec![0]));
        // Two pending axes of one level: one all-reduce over both (one ring of 8).
        let s = reshard(&d, 4.0, &[Partial, Partial], &[Replicate, Replicate], &m, Policy::default());
        assert_eq!(kinds(&s), vec![("all_reduce", vec![0, 1])]);
        assert_eq!(s[0].group_size(&m), 8);
    }

    #[test]
    fn hierarchical_all_reduce_spans_the_levels() {
        let m = mesh(&[(4, LinkLevel::Inter), (8, LinkLevel::Intra)]);
        let d = [64, 16];
        let p = Policy { hierarchical_all_reduce: true };
        let s = reshard(&d, 4.0, &[Partial, Partial], &[Replicate, Replicate], &m, p);
        assert_eq!(kinds(&s), vec![("reduce_scatter", vec![1]), ("all_reduce", vec![0]), ("all_gather", vec![1])]);
        assert_eq!(s[1].bytes, 4096.0 / 8.0);
        let s = reshard(&d, 4.0, &[Partial, Partial], &[Replicate, Replicate], &m, Policy::default());
        assert_eq!(kinds(&s), vec![("all_reduce", vec![0, 1])]);
    }
}

/// The annotation the lowering puts on each communication op: the [`Phase`] of the step it
/// serves.
pub const PHASE: &str = "shardc_phase";

/// The part of a training step a computation or communication belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Forward pass: an input resharded for its consumer, a halo, statistics.
    Forward,
    /// Backward pass: an activation gradient brought back to its producer's layout.
    Backward,
    /// Gradient synchronisation of a parameter before the update (and, in a training
    /// graph, the update itself).
    Gradient,
}

impl Phase {
    /// `forward`, `backward` or `gradient`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Gradient => "gradient",
        }
    }

    /// Parses [`Phase::name`].
    pub fn parse(s: &str) -> Option<Phase> {
        Some(match s {
            "forward" => Phase::Forward,
            "backward" => Phase::Backward,
            "gradient" => Phase::Gradient,
            _ => return None,
        })
    }
}

/// The phase of every op of a training graph (`None` when `g` is not one: no carried
/// state): an optimizer update is [`Phase::Gradient`] (what brings its gradient to the
/// parameter's layout is gradient synchronisation); an op annotated [`crate::train::grad_of`], or one
/// reading a backward op's output (the sum of gradients of a value read several times), is
/// [`Phase::Backward`], unless it is unannotated and only gradient-phase ops read it (it
/// hands a finished gradient to its update); an op reading an update's output is
/// [`Phase::Gradient`] too; every other op is [`Phase::Forward`]. The cost model prices a training
/// graph's communication under these phases and the lowering tags its communication with
/// them, so the two can be compared phase by phase.
pub fn step_phases(
    g: &crate::Graph,
    order: &[crate::NodeId],
) -> Option<std::collections::HashMap<crate::NodeId, Phase>> {
    if carried_state(g).is_empty() {
        return None;
    }
    let mut out = std::collections::HashMap::with_capacity(order.len());
    for &n in order {
        let node = g.node(n);
        let p = if node.op.is_update() {
            Phase::Gradient
        } else if crate::train::grad_of(g, n).is_some()
            || node.inputs().iter().flatten().any(|v| out.get(&v.node) == Some(&Phase::Backward))
        {
            Phase::Backward
        } else if node.inputs().iter().flatten().any(|v| out.get(&v.node) == Some(&Phase::Gradient)) {
            Phase::Gradient
        } else {
            Phase::Forward
        };
        out.insert(n, p);
    }
    // What hands a finished gradient to its update (the sum of a weight's gradients, the
    // gradient output) is gradient synchronisation's part: an unannotated
    // backward op read only by gradient-phase ops.
    for &n in order.iter().rev() {
        let node = g.node(n);
        if out[&n] != Phase::Backward || crate::train::grad_of(g, n).is_some() {
            continue;
        }
        let mut readers = (0..node.num_outputs()).flat_map(|s| g.users(crate::Value::new(n, s as u16))).peekable();
        if readers.peek().is_some() && readers.all(|(r, _)| out.get(&r) == Some(&Phase::Gradient)) {
            out.insert(n, Phase::Gradient);
        }
    }
    Some(out)
}
