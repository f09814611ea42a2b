//! Extraction: choosing one strategy per op from the e-graph's space.
//!
//! Each e-class is counted once: the objective is priced per op and per (tensor, consumer),
//! never per path, so shared subgraphs are not counted twice (egg's tree extractor would).
//!
//! - Small spaces are enumerated: every combination priced by the full cost model. Exact.
//! - Otherwise a PaSE-style dynamic program runs over the topological order. Its state is the
//!   layout of every *live* tensor (produced, not yet consumed by all its readers); the cost
//!   of a step is the op's own time (compute, halo, statistics, the gradient synchronisation
//!   and update of the parameters it owns, its share of the input transfer) plus
//!   `λ · memory`, plus the resharding of each live input from the layout in the state to
//!   the layout the strategy needs, forward and backward. When there are more states than
//!   the beam keeps, the cheapest are kept and the result is no longer guaranteed optimal.
//! - Memory is a hard constraint: λ is raised until the plan fits, then narrowed by
//!   bisection to the cheapest λ that fits.
//! - What the dynamic program cannot see (fan-out reshards shared by several readers,
//!   overlap of gradient synchronisation with the backward pass, the input preloaded behind
//!   the step) is settled by the full cost model: every plan is re-priced, and a local search
//!   with the full model improves the best one while the time budget lasts: one op at a
//!   time, then by chains (a split one op takes carried along the tensors it shares, for
//!   layouts that pay only when a whole chain adopts them, such as heads through attention).

use std::time::Instant;

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::cost::model::{InputPath, Precision};
use crate::cost::{Breakdown, CostModel};
use ir::shard::AxisShard;

use super::problem::{LayoutId, Origin, Problem, ValueId};

mod local;
use local::*;

/// How the plan was found and what is known of its optimality.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExtractStats {
    /// `exhaustive`, `dynamic-programming` or `dynamic-programming+beam`.
    pub method: String,
    /// Provably optimal for the cost model over the explored space.
    pub exact: bool,
    /// Combinations the explored space holds (log10).
    pub log10_combinations: f64,
    /// Plans priced with the full cost model.
    pub evaluations: usize,
    /// Dynamic-program runs (one per λ and gradient weight tried).
    pub dp_runs: usize,
    /// Most states the dynamic program held after one op.
    pub dp_max_states: usize,
    /// The beam dropped states.
    pub dp_pruned: bool,
    /// λ of the chosen dynamic-program plan (seconds per byte of memory).
    pub lambda: f64,
    /// When the beam dropped states: a lower bound on the dynamic program's objective (the
    /// cost model's time decomposed per op and edge, plus λ·memory) over every combination,
    /// from [`lower_bound`], and how far the chosen plan's objective is above it (a fraction
    /// of the plan's). Without pruning the dynamic program is exact for that objective.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_lower_bound: Option<f64>,
    /// See `proxy_lower_bound`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_gap: Option<f64>,
    /// Local-search moves that improved the plan.
    pub local_moves: usize,
    /// Local-search work done, in op-evaluations (plans priced × ops).
    pub local_search_work: usize,
    /// Seconds in the dynamic program (reported under the plan's `timings`).
    #[serde(skip)]
    pub dp_time_s: f64,
    /// Seconds computing the lower bound (reported under the plan's `timings`).
    #[serde(skip)]
    pub bound_time_s: f64,
    /// Seconds in local search (reported under the plan's `timings`).
    #[serde(skip)]
    pub local_search_time_s: f64,
    /// Seconds (reported under the plan's `timings`).
    #[serde(skip)]
    pub time_s: f64,
}

/// Search knobs for one mesh.
#[derive(Clone, Debug)]
pub(crate) struct Knobs<'a> {
    /// Enumerate when the space has at most this many combinations.
    pub exhaustive_limit: f64,
    /// Dynamic-program states kept per op.
    pub beam: usize,
    /// Run the local search.
    pub local_search: bool,
    /// Work the local search may do, in op-evaluations (plans priced × ops).
    pub local_search_work: usize,
    /// The wall-clock safety net.
    pub net: &'a super::SafetyNet,
}

/// One op's step of the dynamic program.
struct Step {
    cands: Vec<u32>,
    time: Vec<f64>,
    mem: Vec<f64>,
    /// Live inputs: position in the live vector, its layout count, `[cand][have]` costs.
    edges: Vec<(usize, usize, Vec<f64>)>,
    /// The tensor each edge reads, and per candidate the layout it reads it in.
    edge_values: Vec<ValueId>,
    edge_needs: Vec<Vec<Option<LayoutId>>>,
    /// Positions of the live vector that stay live after this op.
    keep: Vec<usize>,
    /// The tensors that become live after this op.
    entering: Vec<ValueId>,
    /// Per candidate: the layout index of each tensor that becomes live.
    enter: Vec<Vec<u8>>,
}

/// The decomposed objective.
pub(crate) struct Proxy {
    steps: Vec<Step>,
    /// Per tensor: the (step, edge) pairs that read it from the live vector.
    readers: Vec<Vec<(usize, usize)>>,
    /// Per tensor: the step at which it becomes live and its index in that step's
    /// `entering`.
    entered: Vec<Option<(usize, usize)>>,
    /// Per tensor: the layouts it can have while live (`enter` indexes these).
    layouts: Vec<Vec<LayoutId>>,
}

/// Cost model constants the proxy needs.
struct Consts {
    grad_weight: f64,
    opt_bytes_per_elem: f64,
    update_bytes_per_elem: f64,
    elem_bytes: f64,
    input_per_byte: f64,
}

fn consts(cm: &CostModel<'_>, grad_weight: f64) -> Consts {
    let o = &cm.opts;
    let pf = if o.precision == Precision::Fp16 { 0.5 } else { 1.0 };
    let p = cm.mesh.devices();
    let host = &cm.cluster.host;
    let input_per_byte = if o.preload {
        0.0
    } else {
        match o.input_path {
            InputPath::Scatter => host.shared_by.min(p) as f64 / host.bandwidth,
            InputPath::Staged => {
                let (_, beta) =
                    crate::cost::collective::alpha_beta(cm.cluster, ir::shard::LinkLevel::Intra, p, p, f64::INFINITY);
                (p as f64 - 1.0) / beta
            }
        }
    };
    Consts {
        grad_weight,
        opt_bytes_per_elem: crate::cost::model::sharded_bytes_per_elem(o),
        update_bytes_per_elem: crate::cost::model::update_bytes_per_elem(o),
        elem_bytes: 4.0 * pf,
        input_per_byte,
    }
}

/// Memoized resharding times, by value and layouts (the cost model's algebra).
struct Reshards<'a, 'g> {
    cm: &'a CostModel<'g>,
    memo: FxHashMap<(ValueId, LayoutId, LayoutId, u64), (f64, f64)>,
}

impl Reshards<'_, '_> {
    /// (seconds, latency seconds) of resharding value `v` from `from` to `to`, its bytes
    /// scaled by `scale`.
    fn price(&mut self, p: &Problem, v: ValueId, from: LayoutId, to: LayoutId, scale: f64) -> (f64, f64) {
        if from == to {
            return (0.0, 0.0);
        }
        *self.memo.entry((v, from, to, scale.to_bits())).or_insert_with(|| {
            let steps = self.cm.reshard(p.values[v.ix()].value, &p.layouts[from.ix()], &p.layouts[to.ix()], scale);
            (crate::cost::collective::total(&steps), steps.iter().map(|s| s.latency).sum())
        })
    }

    /// Seconds of resharding `v` (its collectives and its local slices, as the cost model
    /// prices an edge).
    fn time(&mut self, p: &Problem, v: ValueId, from: LayoutId, to: LayoutId) -> f64 {
        let local = self.cm.reshard_local(p.values[v.ix()].value, &p.layouts[from.ix()], &p.layouts[to.ix()]);
        self.price(p, v, from, to, 1.0).0 + local
    }

    /// The bandwidth part of a resharding (gradient synchronisation is bucketed, so its
    /// latency terms are shared by many tensors).
    fn bandwidth_time(&mut self, p: &Problem, v: ValueId, from: LayoutId, to: LayoutId, scale: f64) -> f64 {
        let (t, l) = self.price(p, v, from, to, scale);
        (t - l).max(0.0)
    }
}

/// When each tensor is live: from its producer (or first reader, for a source read by several
/// ops) to its last reader — per value, the op it enters at (`None`: never held) and its last
/// reader.
fn liveness(p: &Problem) -> (Vec<Option<usize>>, Vec<usize>) {
    let mut enters_at: Vec<Option<usize>> = vec![None; p.values.len()];
    let mut last_use: Vec<usize> = vec![0; p.values.len()];
    for (v, info) in p.values.iter().enumerate() {
        let Some(&(first, _)) = info.consumers.first() else { continue };
        let last = info.consumers.last().map_or(first, |c| c.0);
        last_use[v] = last;
        match info.origin {
            Origin::Op { op, .. } => enters_at[v] = Some(op),
            Origin::Source { .. } => {
                if info.float && last > first {
                    enters_at[v] = Some(first);
                }
            }
        }
    }
    (enters_at, last_use)
}

/// The layouts each live tensor can have under the candidate strategies `cands`: those its
/// maker's candidates make, or for a source, those its first reader's candidates need.
fn candidate_layouts(p: &Problem, cands: &[Vec<u32>], enters_at: &[Option<usize>]) -> Vec<Vec<LayoutId>> {
    let mut layouts: Vec<Vec<LayoutId>> = vec![Vec::new(); p.values.len()];
    for (v, info) in p.values.iter().enumerate() {
        let Some(at) = enters_at[v] else { continue };
        let mut set: Vec<LayoutId> = Vec::new();
        match info.origin {
            Origin::Op { op, slot } => {
                for &c in &cands[op] {
                    set.push(p.ops[op].makes[c as usize][slot]);
                }
            }
            Origin::Source { .. } => {
                let j = info.consumers[0].1;
                for &c in &cands[at] {
                    if let Some(l) = p.ops[at].needs[c as usize][j] {
                        set.push(l);
                    }
                }
            }
        }
        set.sort_unstable();
        set.dedup();
        assert!(set.len() <= 256, "more than 256 layouts for one tensor");
        layouts[v] = set;
    }
    layouts
}

impl Proxy {
    /// Tables of the decomposed objective over the candidates `cands` (per op).
    pub fn new(cm: &CostModel<'_>, p: &Problem, cands: &[Vec<u32>], grad_weight: f64) -> Proxy {
        let k = consts(cm, grad_weight);
        let mut rs = Reshards { cm, memo: FxHashMap::default() };
        let n = p.ops.len();
        let (enters_at, last_use) = liveness(p);
        let layouts = candidate_layouts(p, cands, &enters_at);
        let mut steps = Vec::with_capacity(n);
        let mut readers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); p.values.len()];
        let mut entered: Vec<Option<(usize, usize)>> = vec![None; p.values.len()];
        let outputs: rustc_hash::FxHashSet<ir::Value> = cm.g.outputs().iter().map(|o| o.value).collect();
        let mut live: Vec<ValueId> = Vec::new();
        for (t, cs) in cands.iter().enumerate().take(n) {
            let op = &p.ops[t];
            let mut time = Vec::with_capacity(cs.len());
            let mut mem = Vec::with_capacity(cs.len());
            // Inputs grouped by tensor (an op may read one tensor twice).
            let mut by_value: Vec<(ValueId, Vec<usize>)> = Vec::new();
            for (j, v) in op.inputs.iter().enumerate() {
                if let Some(v) = v {
                    match by_value.iter_mut().find(|(x, _)| x == v) {
                        Some((_, js)) => js.push(j),
                        None => by_value.push((*v, vec![j])),
                    }
                }
            }
            for &c in cs {
                let c = c as usize;
                let mut tm = op.time[c];
                let mut mm = 0.0;
                // Graph outputs brought to the layout the host reads (as the cost model does;
                // exact when no later op already materialized that layout).
                for (slot, &v) in op.outputs.iter().enumerate() {
                    let vi = &p.values[v.ix()];
                    if outputs.contains(&vi.value) {
                        let from = &p.layouts[op.makes[c][slot].ix()];
                        let to = ir::reshard::output_layout(
                            from,
                            cm.output_cuts().get(&vi.value).map_or(&[][..], Vec::as_slice),
                        );
                        tm += crate::cost::collective::total(&cm.reshard(vi.value, from, &to, 1.0))
                            + cm.reshard_local(vi.value, from, &to);
                    }
                }
                if op.keeps_outputs {
                    for (slot, &v) in op.outputs.iter().enumerate() {
                        let vi = &p.values[v.ix()];
                        if vi.named {
                            mm += vi.bytes / p.split_factor(cm, op.makes[c][slot]);
                        }
                    }
                }
                // Sources this op reads first own their storage here.
                for (v, js) in &by_value {
                    let vi = &p.values[v.ix()];
                    let Origin::Source { param, data_input } = vi.origin else { continue };
                    if !vi.float || vi.consumers[0].0 != t {
                        continue;
                    }
                    let Some(store) = op.needs[c][js[0]] else { continue };
                    let local = vi.bytes / p.split_factor(cm, store);
                    if param {
                        let elems = local / k.elem_bytes;
                        mm += 2.0 * local + elems * k.opt_bytes_per_elem;
                        tm += elems * k.update_bytes_per_elem / cm.cluster.device.mem_bandwidth;
                        let mut grad = op.grads[c][js[0]].unwrap_or(store);
                        if js.len() > 1 {
                            // Partial along every axis any of the reads makes it partial.
                            let mut sh = p.layouts[grad.ix()].clone();
                            for &j in &js[1..] {
                                if let Some(g) = op.grads[c][j] {
                                    for (a, x) in p.layouts[g.ix()].iter().enumerate() {
                                        if *x == AxisShard::Partial {
                                            sh[a] = AxisShard::Partial;
                                        }
                                    }
                                }
                            }
                            grad = p.layout_ids.get(&sh).copied().unwrap_or(grad);
                        }
                        tm += k.grad_weight
                            * rs.bandwidth_time(p, *v, grad, p.settled[store.ix()], cm.opts.grad_compression);
                    }
                    if data_input {
                        tm += local * k.input_per_byte;
                    }
                    // A second read in another layout.
                    let mut seen = vec![store];
                    for &j in &js[1..] {
                        if let Some(l) = op.needs[c][j]
                            && !seen.contains(&l)
                        {
                            seen.push(l);
                            tm += rs.time(p, *v, store, l);
                        }
                    }
                }
                time.push(tm);
                mem.push(mm);
            }
            // Live inputs.
            let mut edges = Vec::new();
            let mut edge_values = Vec::new();
            let mut edge_needs = Vec::new();
            for (v, js) in &by_value {
                let Some(pos) = live.iter().position(|x| x == v) else { continue };
                let vi = &p.values[v.ix()];
                let lay = &layouts[v.ix()];
                let kv = lay.len();
                let mut mat = vec![0.0; cs.len() * kv];
                for (ci, &c) in cs.iter().enumerate() {
                    let c = c as usize;
                    for (h, &have) in lay.iter().enumerate() {
                        let mut cost = 0.0;
                        let mut needs: Vec<LayoutId> = Vec::new();
                        let mut grads: Vec<LayoutId> = Vec::new();
                        for &j in js {
                            let Some(l) = op.needs[c][j] else { continue };
                            if l != have && !needs.contains(&l) {
                                needs.push(l);
                                cost += rs.time(p, *v, have, l);
                            }
                            if vi.needs_grad {
                                let g = op.grads[c][j].unwrap_or(l);
                                if !grads.contains(&g) {
                                    let w = if matches!(vi.origin, Origin::Source { param: true, .. }) {
                                        k.grad_weight
                                    } else {
                                        1.0
                                    };
                                    cost += w * rs.time(p, *v, g, p.settled[have.ix()]);
                                    grads.push(g);
                                }
                            }
                        }
                        mat[ci * kv + h] = cost;
                    }
                }
                readers[v.ix()].push((t, edges.len()));
                edges.push((pos, kv, mat));
                edge_values.push(*v);
                edge_needs.push(cs.iter().map(|&c| op.needs[c as usize][js[0]]).collect());
            }
            // The live vector after this op.
            let keep: Vec<usize> = (0..live.len()).filter(|&i| last_use[live[i].ix()] > t).collect();
            let mut entering: Vec<ValueId> = Vec::new();
            for &v in &op.outputs {
                if enters_at[v.ix()] == Some(t) && last_use[v.ix()] > t {
                    entering.push(v);
                }
            }
            for (v, _) in &by_value {
                if matches!(p.values[v.ix()].origin, Origin::Source { .. })
                    && enters_at[v.ix()] == Some(t)
                    && last_use[v.ix()] > t
                {
                    entering.push(*v);
                }
            }
            let enter: Vec<Vec<u8>> = cs
                .iter()
                .map(|&c| {
                    entering
                        .iter()
                        .map(|&v| {
                            let l = match p.values[v.ix()].origin {
                                Origin::Op { slot, .. } => op.makes[c as usize][slot],
                                Origin::Source { .. } => {
                                    op.needs[c as usize][p.values[v.ix()].consumers[0].1].expect("a read input")
                                }
                            };
                            layouts[v.ix()].binary_search(&l).expect("a candidate layout") as u8
                        })
                        .collect()
                })
                .collect();
            for (k, v) in entering.iter().enumerate() {
                entered[v.ix()] = Some((t, k));
            }
            live = keep.iter().map(|&i| live[i]).chain(entering.iter().copied()).collect();
            steps.push(Step { cands: cs.clone(), time, mem, edges, edge_values, edge_needs, keep, entering, enter });
        }
        Proxy { steps, readers, entered, layouts }
    }

    /// The proxy cost of a full choice (per op, a strategy index).
    #[cfg(test)]
    pub fn cost_of(&self, choice: &[u32], lambda: f64) -> f64 {
        self.try_cost_of(choice, lambda).expect("every choice a candidate")
    }

    /// The proxy cost of a full choice; `None` when a choice is not among the candidates.
    pub fn try_cost_of(&self, choice: &[u32], lambda: f64) -> Option<f64> {
        let mut live: Vec<u8> = Vec::new();
        let mut total = 0.0;
        for (st, &c) in self.steps.iter().zip(choice) {
            let ci = st.cands.iter().position(|&x| x == c)?;
            total += st.time[ci] + lambda * st.mem[ci];
            for (pos, kv, mat) in &st.edges {
                total += mat[ci * kv + live[*pos] as usize];
            }
            live = st.keep.iter().map(|&i| live[i]).chain(st.enter[ci].iter().copied()).collect();
        }
        Some(total)
    }
}

impl Proxy {
    /// The layout (an index into its `layouts`) live tensor `v` has under the candidate
    /// indices `x`: the one the op it became live at gives it.
    fn held(&self, v: ValueId, x: &[usize]) -> Option<usize> {
        let (u, k) = self.entered[v.ix()]?;
        Some(self.steps[u].enter[x[u]][k] as usize)
    }

    /// The terms of the objective that depend on op `t`'s choice, with its candidate index
    /// `a` and every other op's index from `ci`: its own cost, the reshardings of its inputs
    /// from their producers' layouts, those of its outputs to their readers'.
    fn local(&self, t: usize, a: usize, ci: &[usize], lambda: f64) -> f64 {
        let st = &self.steps[t];
        let mut e = st.time[a] + lambda * st.mem[a];
        for ((_, kv, mat), v) in st.edges.iter().zip(&st.edge_values) {
            if let Some(h) = self.held(*v, ci) {
                e += mat[a * kv + h];
            }
        }
        for (k, v) in st.entering.iter().enumerate() {
            let h = st.enter[a][k] as usize;
            for &(u, i) in &self.readers[v.ix()] {
                let (_, kv, mat) = &self.steps[u].edges[i];
                e += mat[ci[u] * kv + h];
            }
        }
        e
    }

    /// A chain move: op `t` takes candidate `alt`, and the split it introduces follows the
    /// tensors it shares: a neighbour that reads (or makes) a tensor `t` now splits where it
    /// did not takes, of its candidates that read (or make) it in exactly that layout, the
    /// one cheapest given the others, when that is no worse for it than its own, and passes
    /// the split on in turn, at most `spread` ops. A split stops where no candidate carries it
    /// (the head dim of attention stops at the projections, whose input has no head dim) and
    /// is not pushed where `t` only gives one up (a tensor now replicated or partial). Returns
    /// the new candidate indices and the ops that changed.
    pub(crate) fn chain(
        &self,
        p: &Problem,
        t: usize,
        alt: usize,
        ci: &[usize],
        lambda: f64,
        spread: usize,
    ) -> (Vec<usize>, Vec<usize>) {
        let splits_anew = |new: LayoutId, old: LayoutId| {
            let (n, o) = (&p.layouts[new.ix()], &p.layouts[old.ix()]);
            n.iter().zip(o.iter()).any(|(a, b)| matches!(a, AxisShard::Split(_)) && a != b)
        };
        let made = |u: usize, k: usize, a: usize| {
            let v = self.steps[u].entering[k];
            self.layouts[v.ix()][self.steps[u].enter[a][k] as usize]
        };
        let mut c = ci.to_vec();
        c[t] = alt;
        let mut changed = vec![t];
        let mut queue = std::collections::VecDeque::from([t]);
        // Re-chooses `u` among the candidates `fits` allows; true when it changed.
        let adopt = |u: usize, c: &mut Vec<usize>, changed: &mut Vec<usize>, fits: &dyn Fn(usize) -> bool| {
            if changed.contains(&u) || changed.len() >= spread {
                return false;
            }
            let best = (0..self.steps[u].cands.len())
                .filter(|&a| fits(a))
                .map(|a| (self.local(u, a, c, lambda), a))
                .min_by(|x, y| x.0.total_cmp(&y.0));
            let cur = self.local(u, c[u], c, lambda);
            match best {
                Some((e, a)) if a != c[u] && e <= cur + 1e-9 * cur.abs() => {
                    c[u] = a;
                    changed.push(u);
                    true
                }
                _ => false,
            }
        };
        while let Some(w) = queue.pop_front() {
            let st = &self.steps[w];
            for k in 0..st.entering.len() {
                let (new, old) = (made(w, k, c[w]), made(w, k, ci[w]));
                if new == old || !splits_anew(new, old) {
                    continue;
                }
                for &(u, e) in &self.readers[st.entering[k].ix()] {
                    let needs = &self.steps[u].edge_needs[e];
                    if adopt(u, &mut c, &mut changed, &|a| needs[a] == Some(new)) {
                        queue.push_back(u);
                    }
                }
            }
            for (e, v) in st.edge_values.iter().enumerate() {
                let (Some(new), Some(old)) = (st.edge_needs[e][c[w]], st.edge_needs[e][ci[w]]) else { continue };
                if new == old || !splits_anew(new, old) {
                    continue;
                }
                let Some((u, k)) = self.entered[v.ix()] else { continue };
                if adopt(u, &mut c, &mut changed, &|a| made(u, k, a) == new) {
                    queue.push_back(u);
                }
            }
        }
        (c, changed)
    }

    /// The change in the objective when the ops in `changed` go from `ci` to `c` (every
    /// other op the same in both): their own terms and every edge that touches one of them,
    /// each once.
    pub(crate) fn delta(&self, changed: &[usize], c: &[usize], ci: &[usize], lambda: f64) -> f64 {
        let edge = |u: usize, e: usize, x: &[usize]| {
            let (_, kv, mat) = &self.steps[u].edges[e];
            mat[x[u] * kv + self.held(self.steps[u].edge_values[e], x).expect("a live tensor entered")]
        };
        let mut edges: Vec<(usize, usize)> = Vec::new();
        let mut d = 0.0;
        for &u in changed {
            let st = &self.steps[u];
            d += st.time[c[u]] - st.time[ci[u]] + lambda * (st.mem[c[u]] - st.mem[ci[u]]);
            edges.extend((0..st.edges.len()).map(|e| (u, e)));
            for v in &st.entering {
                edges.extend(self.readers[v.ix()].iter().copied());
            }
        }
        edges.sort_unstable();
        edges.dedup();
        for (u, e) in edges {
            d += edge(u, e, c) - edge(u, e, ci);
        }
        d
    }
}

/// Improves a plan by chain moves ([`Proxy::chain`]): a layout that pays only when a whole
/// chain of ops adopts it (heads split through a block's projections, reshapes, transposes
/// and attention products) is out of reach of one-op moves, each of which alone would add
/// reshardings on both sides. Every op's every alternative starts a chain; the distinct
/// chains of more than one op that the proxy finds no worse are priced with the full model,
/// best first, and a better plan is kept. Returns the number of moves made.
fn chain_search(
    cm: &CostModel<'_>,
    p: &Problem,
    proxy: &Proxy,
    lambda: f64,
    best: &mut Priced,
    limit: Limit<'_>,
    evals: &mut usize,
) -> usize {
    const SPREAD: usize = 96;
    const TRIES: usize = 8;
    let n = proxy.steps.len();
    let start = *evals;
    let mut moves = 0;
    for _sweep in 0..3 {
        let ci: Vec<usize> =
            (0..n).map(|t| proxy.steps[t].cands.iter().position(|&x| x == best.choice[t]).unwrap_or(0)).collect();
        let Some(base) = proxy.try_cost_of(&best.choice, lambda) else { return moves };
        let tol = 1e-4 * base.abs();
        // Chains by the ops they change and how: many starts lead to one chain.
        let mut seen: rustc_hash::FxHashSet<Vec<(u32, u32)>> = rustc_hash::FxHashSet::default();
        let mut ranked: Vec<(f64, Vec<(u32, u32)>)> = Vec::new();
        for t in 0..n {
            if limit.net.expired("local-search") {
                return moves;
            }
            for alt in 0..proxy.steps[t].cands.len() {
                if alt == ci[t] {
                    continue;
                }
                let (c, mut changed) = proxy.chain(p, t, alt, &ci, lambda, SPREAD);
                if changed.len() < 2 {
                    continue;
                }
                let d = proxy.delta(&changed, &c, &ci, lambda);
                changed.sort_unstable();
                let key: Vec<(u32, u32)> = changed.iter().map(|&u| (u as u32, c[u] as u32)).collect();
                if d <= tol && seen.insert(key.clone()) {
                    ranked.push((d, key));
                }
            }
        }
        ranked.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut improved = false;
        for (_, key) in ranked.into_iter().take(TRIES) {
            if *evals - start >= limit.plans || limit.net.expired("local-search") {
                return moves;
            }
            let mut choice = best.choice.clone();
            for (u, a) in key {
                choice[u as usize] = proxy.steps[u as usize].cands[a as usize];
            }
            let cand = price(cm, p, &choice, evals);
            if better(&cand.breakdown, &best.breakdown) {
                *best = cand;
                moves += 1;
                improved = true;
                break;
            }
        }
        if !improved {
            break;
        }
    }
    moves
}

/// A dynamic-program result.
pub(crate) struct DpPlan {
    pub choice: Vec<u32>,
    pub pruned: bool,
    pub max_states: usize,
}

/// A state key: the layout indices of the live tensors.
trait StateKey: Eq + std::hash::Hash {
    fn from_bytes(b: &[u8]) -> Self;
}

impl StateKey for u128 {
    fn from_bytes(b: &[u8]) -> u128 {
        b.iter().enumerate().fold(0u128, |x, (i, &v)| x | (v as u128) << (8 * i))
    }
}

impl StateKey for Box<[u8]> {
    fn from_bytes(b: &[u8]) -> Box<[u8]> {
        b.into()
    }
}

/// The states after one op: flat keys (`width` bytes each), costs, back-pointers.
struct Layer {
    keys: Vec<u8>,
    costs: Vec<f64>,
    back: Vec<(u32, u16)>,
}

fn advance<K: StateKey>(st: &Step, prev: &Layer, width: usize, unary: &[f64]) -> Layer {
    let mut index: FxHashMap<K, u32> = FxHashMap::default();
    let mut next = Layer { keys: Vec::new(), costs: Vec::new(), back: Vec::new() };
    let mut buf: Vec<u8> = Vec::new();
    for (si, &base) in prev.costs.iter().enumerate() {
        let key = &prev.keys[si * width..(si + 1) * width];
        buf.clear();
        buf.extend(st.keep.iter().map(|&i| key[i]));
        let kept = buf.len();
        for ci in 0..st.cands.len() {
            let mut c = base + unary[ci];
            for (pos, kv, mat) in &st.edges {
                c += mat[ci * kv + key[*pos] as usize];
            }
            buf.truncate(kept);
            buf.extend_from_slice(&st.enter[ci]);
            match index.entry(K::from_bytes(&buf)) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    let i = *e.get() as usize;
                    if c < next.costs[i] {
                        next.costs[i] = c;
                        next.back[i] = (si as u32, ci as u16);
                    }
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(next.costs.len() as u32);
                    next.keys.extend_from_slice(&buf);
                    next.costs.push(c);
                    next.back.push((si as u32, ci as u16));
                }
            }
        }
    }
    next
}

/// Runs the dynamic program for one λ. `None` when the safety net fired.
pub(crate) fn dp(proxy: &Proxy, lambda: f64, beam: usize, net: Option<&super::SafetyNet>) -> Option<DpPlan> {
    let mut layer = Layer { keys: Vec::new(), costs: vec![0.0], back: Vec::new() };
    let mut width = 0usize;
    let mut back: Vec<Vec<(u32, u16)>> = Vec::with_capacity(proxy.steps.len());
    let mut pruned = false;
    let mut max_states = 1;
    for (t, st) in proxy.steps.iter().enumerate() {
        if t % 64 == 0 && net.is_some_and(|n| n.expired("dp")) {
            return None;
        }
        let new_width = st.keep.len() + st.enter.first().map_or(0, Vec::len);
        let unary: Vec<f64> = st.time.iter().zip(&st.mem).map(|(t, m)| t + lambda * m).collect();
        let mut next = if new_width <= 16 {
            advance::<u128>(st, &layer, width, &unary)
        } else {
            advance::<Box<[u8]>>(st, &layer, width, &unary)
        };
        max_states = max_states.max(next.costs.len());
        if next.costs.len() > beam {
            pruned = true;
            let mut order: Vec<usize> = (0..next.costs.len()).collect();
            order.sort_by(|&a, &b| next.costs[a].total_cmp(&next.costs[b]).then(a.cmp(&b)));
            order.truncate(beam);
            order.sort_unstable();
            let mut kept = Layer {
                keys: Vec::with_capacity(beam * new_width),
                costs: Vec::with_capacity(beam),
                back: Vec::with_capacity(beam),
            };
            for i in order {
                kept.keys.extend_from_slice(&next.keys[i * new_width..(i + 1) * new_width]);
                kept.costs.push(next.costs[i]);
                kept.back.push(next.back[i]);
            }
            next = kept;
        }
        back.push(std::mem::take(&mut next.back));
        layer = next;
        width = new_width;
    }
    // The cheapest final state, then back through the steps.
    let mut best = 0usize;
    for i in 1..layer.costs.len() {
        if layer.costs[i] < layer.costs[best] {
            best = i;
        }
    }
    let mut choice = vec![0u32; proxy.steps.len()];
    let mut s = best;
    for t in (0..proxy.steps.len()).rev() {
        let (parent, ci) = back[t][s];
        choice[t] = proxy.steps[t].cands[ci as usize];
        s = parent as usize;
    }
    Some(DpPlan { choice, pruned, max_states })
}

/// A key byte whose layout the relaxed dynamic program has forgotten.
const FORGOTTEN: u8 = u8::MAX;

/// A lower bound on the proxy objective over every combination of candidates: the dynamic
/// program of [`dp`] with state aggregation instead of a beam. When a step leaves more
/// than `beam` states, the live tensor with the most distinct layouts among them is
/// forgotten (its key byte becomes [`FORGOTTEN`]) and states that then agree are merged,
/// keeping the cheapest, until at most `beam` remain; a later reader of a forgotten tensor
/// pays the cheapest resharding from any of its layouts. Every plan's path maps onto a
/// relaxed path that costs no more, so the cheapest final state bounds the optimum from
/// below; with no state forgotten it equals the optimum. `None` when the safety net fired.
pub(crate) fn lower_bound(proxy: &Proxy, lambda: f64, beam: usize, net: Option<&super::SafetyNet>) -> Option<f64> {
    // Layout indices must leave room for the forgotten mark.
    if proxy.steps.iter().any(|st| st.edges.iter().any(|(_, kv, _)| *kv >= FORGOTTEN as usize)) {
        return None;
    }
    let mut keys: Vec<Box<[u8]>> = vec![Box::new([])];
    let mut costs: Vec<f64> = vec![0.0];
    for (t, st) in proxy.steps.iter().enumerate() {
        if t % 64 == 0 && net.is_some_and(|n| n.expired("bound")) {
            return None;
        }
        // Per edge and candidate: the cheapest resharding from any layout.
        let cheapest: Vec<Vec<f64>> = st
            .edges
            .iter()
            .map(|(_, kv, mat)| {
                (0..st.cands.len())
                    .map(|ci| mat[ci * kv..(ci + 1) * kv].iter().copied().fold(f64::INFINITY, f64::min))
                    .collect()
            })
            .collect();
        let mut next = Merged::default();
        for (key, &base) in keys.iter().zip(&costs) {
            for ci in 0..st.cands.len() {
                let mut c = base + st.time[ci] + lambda * st.mem[ci];
                for (e, (pos, kv, mat)) in st.edges.iter().enumerate() {
                    let have = key[*pos];
                    c += if have == FORGOTTEN { cheapest[e][ci] } else { mat[ci * kv + have as usize] };
                }
                next.add(st.keep.iter().map(|&i| key[i]).chain(st.enter[ci].iter().copied()).collect(), c);
            }
        }
        // Forget layouts until the states fit.
        while next.costs.len() > beam {
            let width = next.keys[0].len();
            let distinct: Vec<usize> = (0..width)
                .map(|p| {
                    let mut seen = [false; 256];
                    next.keys.iter().filter(|k| !std::mem::replace(&mut seen[k[p] as usize], true)).count()
                })
                .collect();
            let Some(p) = (0..width).filter(|&p| distinct[p] > 1).max_by_key(|&p| (distinct[p], p)) else { break };
            let mut merged = Merged::default();
            for (mut k, c) in next.keys.into_iter().zip(next.costs) {
                k[p] = FORGOTTEN;
                merged.add(k, c);
            }
            next = merged;
        }
        keys = next.keys;
        costs = next.costs;
    }
    Some(costs.into_iter().fold(f64::INFINITY, f64::min))
}

/// States of the relaxed dynamic program: equal keys merged, keeping the cheapest cost.
#[derive(Default)]
struct Merged {
    index: FxHashMap<Box<[u8]>, usize>,
    keys: Vec<Box<[u8]>>,
    costs: Vec<f64>,
}

impl Merged {
    fn add(&mut self, key: Box<[u8]>, cost: f64) {
        match self.index.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => {
                let i = *o.get();
                self.costs[i] = self.costs[i].min(cost);
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                self.keys.push(v.key().clone());
                v.insert(self.costs.len());
                self.costs.push(cost);
            }
        }
    }
}

/// True when `a` is a better plan than `b`: feasible beats infeasible; then faster; between
/// infeasible plans, smaller.
pub(crate) fn better(a: &Breakdown, b: &Breakdown) -> bool {
    match (a.feasible, b.feasible) {
        (true, false) => true,
        (false, true) => false,
        (true, true) => a.step_time_s < b.step_time_s * (1.0 - 1e-12),
        (false, false) => a.memory.total() < b.memory.total() * (1.0 - 1e-12),
    }
}

/// A priced plan: per op a strategy index.
#[derive(Clone)]
pub(crate) struct Priced {
    pub choice: Vec<u32>,
    pub breakdown: Breakdown,
}

pub(crate) struct Extracted {
    pub best: Priced,
    pub stats: ExtractStats,
}

fn price(cm: &CostModel<'_>, p: &Problem, choice: &[u32], evals: &mut usize) -> Priced {
    *evals += 1;
    Priced { choice: choice.to_vec(), breakdown: cm.price(&p.assignment(choice)) }
}

fn keep_better(best: &mut Option<Priced>, cand: Priced) {
    if best.as_ref().is_none_or(|b| better(&cand.breakdown, &b.breakdown)) {
        *best = Some(cand);
    }
}

/// Chooses the plan from the space: enumeration when small, else the dynamic program with
/// the memory constraint, then local search. `seeds` are always priced too.
pub(crate) fn extract(
    cm: &CostModel<'_>,
    p: &Problem,
    cands: &[Vec<u32>],
    seeds: &[Vec<u32>],
    knobs: &Knobs,
) -> Extracted {
    let start = Instant::now();
    let mut stats = ExtractStats {
        log10_combinations: cands.iter().map(|c| (c.len().max(1) as f64).log10()).sum(),
        ..Default::default()
    };
    let mut evals = 0usize;
    let mut best: Option<Priced> = None;
    for s in seeds {
        keep_better(&mut best, price(cm, p, s, &mut evals));
    }
    if stats.log10_combinations <= knobs.exhaustive_limit.log10() {
        stats.method = "exhaustive".into();
        let mut idx = vec![0usize; cands.len()];
        let mut complete = true;
        loop {
            let choice: Vec<u32> = idx.iter().zip(cands).map(|(&i, c)| c[i]).collect();
            keep_better(&mut best, price(cm, p, &choice, &mut evals));
            if !next_combination(&mut idx, cands) {
                break;
            }
            if evals.is_multiple_of(256) && knobs.net.expired("exhaustive") {
                complete = false;
                break;
            }
        }
        stats.exact = complete;
        stats.evaluations = evals;
        stats.time_s = start.elapsed().as_secs_f64();
        return Extracted { best: best.expect("at least one plan"), stats };
    }

    stats.method = "dynamic-programming".into();
    let o = &cm.opts;
    let w0 = if o.overlap_grad_sync { (o.overlap_slowdown - 1.0).clamp(0.0, 1.0) } else { 1.0 };
    let mut weights = vec![w0];
    if w0 < 1.0 {
        weights.push(1.0);
    }
    let mut best_lambda = 0.0;
    // The first weight's objective also guides the local search and is what the bound is of.
    let proxy0 = Proxy::new(cm, p, cands, w0);
    'weights: for &w in &weights {
        let other;
        let proxy = if w == w0 {
            &proxy0
        } else {
            other = Proxy::new(cm, p, cands, w);
            &other
        };
        // λ is explored with a narrower beam; the chosen λ is then re-run at full width.
        let mut run_with = |lambda: f64, beam: usize, stats: &mut ExtractStats| -> Option<Priced> {
            let t0 = Instant::now();
            let plan = dp(proxy, lambda, beam, Some(knobs.net))?;
            stats.dp_time_s += t0.elapsed().as_secs_f64();
            stats.dp_runs += 1;
            stats.dp_pruned |= plan.pruned;
            stats.dp_max_states = stats.dp_max_states.max(plan.max_states);
            Some(price(cm, p, &plan.choice, &mut evals))
        };
        let narrow = (knobs.beam / 4).max(16);
        let Some(first) = run_with(0.0, knobs.beam, &mut stats) else { break };
        let fits = first.breakdown.feasible;
        let scale = first.breakdown.step_time_s / first.breakdown.memory.total().max(1.0);
        let step0 = first.breakdown.step_time_s;
        if best.as_ref().is_none_or(|b| better(&first.breakdown, &b.breakdown)) {
            best_lambda = 0.0;
        }
        keep_better(&mut best, first);
        if !fits {
            // Raise λ until the plan fits (or memory stops falling).
            let mut lo = 0.0;
            let mut hi = None;
            let mut lambda = scale;
            let mut last_mem = f64::INFINITY;
            let mut stalls = 0;
            for _ in 0..12 {
                let Some(pl) = run_with(lambda, narrow, &mut stats) else { break 'weights };
                let m = pl.breakdown.memory.total();
                let ok = pl.breakdown.feasible;
                if best.as_ref().is_none_or(|b| better(&pl.breakdown, &b.breakdown)) {
                    best_lambda = lambda;
                }
                keep_better(&mut best, pl);
                if ok {
                    hi = Some(lambda);
                    break;
                }
                // Memory that no longer falls will not reach the capacity.
                stalls = if m >= last_mem * 0.99 { stalls + 1 } else { 0 };
                if stalls >= 2 {
                    break;
                }
                last_mem = last_mem.min(m);
                lo = lambda;
                lambda *= 8.0;
            }
            // Narrow to the cheapest λ that fits.
            if let Some(mut hi) = hi {
                for _ in 0..6 {
                    let mid = if lo == 0.0 { hi / 4.0 } else { (lo * hi).sqrt() };
                    let Some(pl) = run_with(mid, narrow, &mut stats) else { break 'weights };
                    if pl.breakdown.feasible {
                        hi = mid;
                    } else {
                        lo = mid;
                    }
                    if best.as_ref().is_none_or(|b| better(&pl.breakdown, &b.breakdown)) {
                        best_lambda = mid;
                    }
                    keep_better(&mut best, pl);
                }
            }
            if best_lambda > 0.0
                && let Some(pl) = run_with(best_lambda, knobs.beam, &mut stats)
            {
                keep_better(&mut best, pl);
            }
        }
        // A second gradient weight only when synchronisation was exposed.
        let b = &best.as_ref().expect("a plan").breakdown;
        if b.exposed_gradient_sync_s <= 0.05 * step0 {
            break;
        }
    }
    stats.lambda = best_lambda;
    if stats.dp_pruned {
        stats.method = "dynamic-programming+beam".into();
    }
    let mut best = best.expect("at least one plan");
    if knobs.local_search {
        let t0 = Instant::now();
        let proxy = &proxy0;
        // Guided moves get the configured work, then alternatives the proxy does not favour a
        // quarter of it; both count plans priced, so the result does not depend on the
        // machine's speed.
        let ops = p.ops.len().max(1);
        let guided = (knobs.local_search_work / ops).max(64);
        let before = evals;
        let limit = Limit { net: knobs.net, plans: guided };
        stats.local_moves = local_search(cm, p, proxy, best_lambda, &mut best, limit, &mut evals);
        let limit = Limit { net: knobs.net, plans: (knobs.local_search_work / 4 / ops).max(64) };
        stats.local_moves += wide_search(cm, p, proxy, &mut best, limit, &mut evals);
        let limit = Limit { net: knobs.net, plans: (knobs.local_search_work / 4 / ops).max(64) };
        stats.local_moves += chain_search(cm, p, proxy, best_lambda, &mut best, limit, &mut evals);
        stats.local_search_work = (evals - before) * ops;
        stats.local_search_time_s = t0.elapsed().as_secs_f64();
    }
    if stats.dp_pruned {
        // How far from the best plan the space can hold, for the objective the dynamic
        // program optimizes (the plan itself may have moved by local search).
        let t0 = Instant::now();
        let bound = lower_bound(&proxy0, best_lambda, knobs.beam, Some(knobs.net));
        stats.bound_time_s = t0.elapsed().as_secs_f64();
        if let Some(lb) = bound {
            stats.proxy_lower_bound = Some(lb);
            stats.proxy_gap = proxy0
                .try_cost_of(&best.choice, best_lambda)
                .map(|ub| ((ub - lb) / ub.max(f64::MIN_POSITIVE)).max(0.0));
        }
    }
    stats.evaluations = evals;
    stats.time_s = start.elapsed().as_secs_f64();
    Extracted { best, stats }
}

/// Steps `idx` (one candidate index per op) to the next combination of `cands` in mixed-radix
/// order, the first op fastest; false after the last one (`idx` is back at all zeros).
pub(crate) fn next_combination(idx: &mut [usize], cands: &[Vec<u32>]) -> bool {
    for (i, c) in idx.iter_mut().zip(cands) {
        *i += 1;
        if *i < c.len() {
            return true;
        }
        *i = 0;
    }
    false
}
