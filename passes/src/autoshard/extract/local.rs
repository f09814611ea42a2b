//! Local and wide search over the layouts the dynamic program left open, within a limit of priced plans and the safety net.

use super::*;

/// How much a local search may do: plans it may price, and the safety net.
#[derive(Clone, Copy)]
pub(super) struct Limit<'a> {
    pub(super) net: &'a crate::autoshard::SafetyNet,
    pub(super) plans: usize,
}

/// Improves a plan one op at a time with the full cost model. For each op, the proxy's
/// change in cost of every alternative strategy is computed exactly (its own cost, its input
/// reshardings, and its readers' reshardings); alternatives the proxy finds no worse (within
/// a small tolerance, for what it cannot see) are priced with the full model, best first,
/// and a better plan is kept. Sweeps until nothing improves or the budget runs out. Returns
/// the number of moves made.
pub(super) fn local_search(
    cm: &CostModel<'_>,
    p: &Problem,
    proxy: &Proxy,
    lambda: f64,
    best: &mut Priced,
    limit: Limit<'_>,
    evals: &mut usize,
) -> usize {
    const TRIES: usize = 2;
    let n = proxy.steps.len();
    let start = *evals;
    let mut moves = 0;
    let index_of = |t: usize, c: u32| proxy.steps[t].cands.iter().position(|&x| x == c).unwrap_or(0);
    for _sweep in 0..3 {
        let mut improved = false;
        let mut ci: Vec<usize> = (0..n).map(|t| index_of(t, best.choice[t])).collect();
        let mut states = live_layouts(proxy, &best.choice);
        for t in 0..n {
            let st = &proxy.steps[t];
            if st.cands.len() < 2 {
                continue;
            }
            if *evals - start >= limit.plans || limit.net.expired("local-search") {
                return moves;
            }
            let cur = ci[t];
            let state = &states[t];
            let unary = |c: usize| st.time[c] + lambda * st.mem[c];
            let tol = 1e-3 * (unary(cur).abs() + 1e-9);
            let mut ranked: Vec<(f64, usize)> = Vec::new();
            for alt in 0..st.cands.len() {
                if alt == cur {
                    continue;
                }
                let mut delta = unary(alt) - unary(cur);
                for (pos, kv, mat) in &st.edges {
                    let h = state[*pos] as usize;
                    delta += mat[alt * kv + h] - mat[cur * kv + h];
                }
                for (k, &v) in st.entering.iter().enumerate() {
                    let (h0, h1) = (st.enter[cur][k] as usize, st.enter[alt][k] as usize);
                    if h0 == h1 {
                        continue;
                    }
                    for &(u, e) in &proxy.readers[v.ix()] {
                        let (_, kv, mat) = &proxy.steps[u].edges[e];
                        delta += mat[ci[u] * kv + h1] - mat[ci[u] * kv + h0];
                    }
                }
                if delta <= tol {
                    ranked.push((delta, alt));
                }
            }
            ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for &(_, alt) in ranked.iter().take(TRIES) {
                let mut choice = best.choice.clone();
                choice[t] = st.cands[alt];
                let cand = price(cm, p, &choice, evals);
                if better(&cand.breakdown, &best.breakdown) {
                    *best = cand;
                    ci[t] = alt;
                    states = live_layouts(proxy, &best.choice);
                    moves += 1;
                    improved = true;
                    break;
                }
            }
        }
        if !improved {
            break;
        }
    }
    moves
}

/// Local search without the proxy's guidance: for each op, its two alternatives cheapest on
/// their own (with their input reshardings) are priced with the full model. At most `limit.plans`
/// plans are priced. Returns the number of moves made.
pub(super) fn wide_search(
    cm: &CostModel<'_>,
    p: &Problem,
    proxy: &Proxy,
    best: &mut Priced,
    limit: Limit<'_>,
    evals: &mut usize,
) -> usize {
    const TRIES: usize = 2;
    let mut moves = 0;
    let mut spent = 0;
    for _sweep in 0..3 {
        let mut improved = false;
        let states = live_layouts(proxy, &best.choice);
        for (t, st) in proxy.steps.iter().enumerate() {
            if st.cands.len() < 2 {
                continue;
            }
            if spent >= limit.plans || limit.net.expired("local-search") {
                return moves;
            }
            let state = &states[t];
            let mut ranked: Vec<(f64, u32)> = st
                .cands
                .iter()
                .enumerate()
                .filter(|(_, c)| **c != best.choice[t])
                .map(|(ci, &c)| {
                    let mut cost = st.time[ci];
                    for (pos, kv, mat) in &st.edges {
                        cost += mat[ci * kv + state[*pos] as usize];
                    }
                    (cost, c)
                })
                .collect();
            ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for &(_, c) in ranked.iter().take(TRIES) {
                let mut choice = best.choice.clone();
                choice[t] = c;
                let cand = price(cm, p, &choice, evals);
                spent += 1;
                if better(&cand.breakdown, &best.breakdown) {
                    *best = cand;
                    moves += 1;
                    improved = true;
                }
            }
        }
        if !improved {
            break;
        }
    }
    moves
}

/// The live-layout vector before each op under a choice.
pub(super) fn live_layouts(proxy: &Proxy, choice: &[u32]) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(choice.len());
    let mut live: Vec<u8> = Vec::new();
    for (st, &c) in proxy.steps.iter().zip(choice) {
        out.push(live.clone());
        let ci = st.cands.iter().position(|&x| x == c).unwrap_or(0);
        live = st.keep.iter().map(|&i| live[i]).chain(st.enter[ci].iter().copied()).collect();
    }
    out
}
