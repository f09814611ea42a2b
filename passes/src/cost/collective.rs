//! Communication costs: α–β models of collectives, and the cheapest sequence of collectives
//! that turns one sharding of a tensor into another.
//!
//! `n` is always a number of bytes and `p` the number of devices in the group; a link has
//! latency `α` (seconds) and bandwidth `β` (bytes/s):
//!
//! | collective | time |
//! |---|---|
//! | ring all-reduce of n bytes | `2(p−1)α + 2(p−1)/p · n/β` |
//! | all-gather to n bytes per device | `(p−1)α + (p−1)/p · n/β` |
//! | reduce-scatter of n bytes per device | `(p−1)α + (p−1)/p · n/β` |
//! | all-to-all of n bytes per device | `(p−1)α + (p−1)/p · n/β` |
//! | broadcast of n bytes (pipelined) | `⌈log₂ p⌉α + n/β` |
//! | point-to-point of n bytes | `α + n/β` |
//!
//! A hierarchical all-reduce over intra-node and inter-node axes (reduce-scatter inside the
//! node, all-reduce across nodes on the shards, all-gather inside the node) is used when it is
//! cheaper than reducing along each axis in turn.

use serde::Serialize;

use ir::shard::{AxisShard, LinkLevel, Mesh};

use super::cluster::{Cluster, Link, Topology};

/// Kinds of communication, for breakdowns.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommKind {
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all.
    AllToAll,
    /// Broadcast.
    Broadcast,
    /// Point-to-point (pipeline stage boundaries).
    P2p,
    /// Halo exchange with spatial neighbours.
    Halo,
}

impl CommKind {
    /// Every kind, in report order.
    pub const ALL: [CommKind; 7] = [
        CommKind::AllReduce,
        CommKind::AllGather,
        CommKind::ReduceScatter,
        CommKind::AllToAll,
        CommKind::Broadcast,
        CommKind::P2p,
        CommKind::Halo,
    ];

    /// snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            CommKind::AllReduce => "all_reduce",
            CommKind::AllGather => "all_gather",
            CommKind::ReduceScatter => "reduce_scatter",
            CommKind::AllToAll => "all_to_all",
            CommKind::Broadcast => "broadcast",
            CommKind::P2p => "p2p",
            CommKind::Halo => "halo",
        }
    }
}

/// Effective (α, β) of a group of `p` devices along a mesh axis of the given level: the
/// slowest link the group uses, with shared uplinks dividing their bandwidth.
pub fn alpha_beta(cluster: &Cluster, level: LinkLevel, p: usize) -> (f64, f64) {
    let link: &Link = cluster.link(level);
    let mut beta = link.bandwidth;
    match level {
        LinkLevel::Intra => {
            // Devices under one PCIe switch share its uplink when the ring leaves the switch.
            if link.topology == Topology::Tree && p > link.shared_by {
                beta /= link.shared_by as f64;
            }
        }
        LinkLevel::Inter => {
            // Concurrent groups (one per device of a node) share the node's NICs.
            let per_node_groups = cluster.devices_per_node as f64;
            let nics = cluster.nics_per_node.max(1) as f64;
            if nics < per_node_groups {
                beta *= nics / per_node_groups;
            }
        }
    }
    (link.latency, beta)
}

/// Ring all-reduce: `2(p−1)α + 2(p−1)/p · n/β`.
pub fn all_reduce(n: f64, p: usize, alpha: f64, beta: f64) -> f64 {
    if p <= 1 || n <= 0.0 {
        return 0.0;
    }
    let p = p as f64;
    2.0 * (p - 1.0) * alpha + 2.0 * (p - 1.0) / p * n / beta
}

/// All-gather producing `n` bytes per device: `(p−1)α + (p−1)/p · n/β`.
pub fn all_gather(n: f64, p: usize, alpha: f64, beta: f64) -> f64 {
    if p <= 1 || n <= 0.0 {
        return 0.0;
    }
    let p = p as f64;
    (p - 1.0) * alpha + (p - 1.0) / p * n / beta
}

/// Reduce-scatter of `n` bytes per device: `(p−1)α + (p−1)/p · n/β`.
pub fn reduce_scatter(n: f64, p: usize, alpha: f64, beta: f64) -> f64 {
    all_gather(n, p, alpha, beta)
}

/// All-to-all of `n` bytes per device: `(p−1)α + (p−1)/p · n/β`.
pub fn all_to_all(n: f64, p: usize, alpha: f64, beta: f64) -> f64 {
    all_gather(n, p, alpha, beta)
}

/// Pipelined broadcast of `n` bytes: `⌈log₂ p⌉α + n/β`.
pub fn broadcast(n: f64, p: usize, alpha: f64, beta: f64) -> f64 {
    if p <= 1 || n <= 0.0 {
        return 0.0;
    }
    (p as f64).log2().ceil() * alpha + n / beta
}

/// Point-to-point: `α + n/β`.
pub fn p2p(n: f64, alpha: f64, beta: f64) -> f64 {
    if n <= 0.0 {
        return 0.0;
    }
    alpha + n / beta
}

/// One collective of a resharding.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    /// What it is.
    pub kind: CommKind,
    /// Mesh axes it runs over.
    pub axes: Vec<usize>,
    /// Bytes per device it moves (its buffer).
    pub bytes: f64,
    /// Seconds.
    pub time: f64,
}

/// All-reduce of `n` bytes per device over several mesh axes at once: the cheaper of reducing
/// along each axis in turn and the hierarchical scheme (reduce-scatter over the intra-node
/// axes, all-reduce of the shards over the others, all-gather back).
pub fn multi_axis_all_reduce(n: f64, axes: &[usize], mesh: &Mesh, cluster: &Cluster) -> f64 {
    let ab = |a: usize| alpha_beta(cluster, mesh.axes[a].level, mesh.axes[a].size);
    let sequential: f64 = axes
        .iter()
        .map(|&a| {
            let (al, be) = ab(a);
            all_reduce(n, mesh.axes[a].size, al, be)
        })
        .sum();
    let intra: Vec<usize> = axes.iter().copied().filter(|&a| mesh.axes[a].level == LinkLevel::Intra).collect();
    let inter: Vec<usize> = axes.iter().copied().filter(|&a| mesh.axes[a].level == LinkLevel::Inter).collect();
    if intra.is_empty() || inter.is_empty() {
        return sequential;
    }
    let q: usize = intra.iter().map(|&a| mesh.axes[a].size).product();
    let mut t = 0.0;
    let mut piece = n;
    for &a in &intra {
        let (al, be) = ab(a);
        t += reduce_scatter(piece, mesh.axes[a].size, al, be);
        piece /= mesh.axes[a].size as f64;
    }
    for &a in &inter {
        let (al, be) = ab(a);
        t += all_reduce(n / q as f64, mesh.axes[a].size, al, be);
    }
    for &a in intra.iter().rev() {
        let (al, be) = ab(a);
        piece *= mesh.axes[a].size as f64;
        t += all_gather(piece, mesh.axes[a].size, al, be);
    }
    t.min(sequential)
}

/// The collectives that turn sharding `from` of a tensor of `bytes` (logical size) into
/// `to`, and their costs. Reductions run first (on the smallest pieces), gathers last.
pub fn reshard(from: &[AxisShard], to: &[AxisShard], bytes: f64, mesh: &Mesh, cluster: &Cluster) -> Vec<Step> {
    let mut steps = Vec::new();
    if from == to || bytes <= 0.0 {
        return steps;
    }
    let mut cur: Vec<AxisShard> = from.to_vec();
    let piece = |s: &[AxisShard]| {
        bytes
            / s.iter()
                .enumerate()
                .filter(|(_, x)| matches!(x, AxisShard::Split(_)))
                .map(|(a, _)| mesh.axes[a].size as f64)
                .product::<f64>()
    };
    let ab = |a: usize| alpha_beta(cluster, mesh.axes[a].level, mesh.axes[a].size);

    // 1. Pending sums to replicated: one (hierarchical) all-reduce.
    let ar: Vec<usize> =
        (0..cur.len()).filter(|&a| cur[a] == AxisShard::Partial && to[a] == AxisShard::Replicate).collect();
    if !ar.is_empty() {
        let n = piece(&cur);
        steps.push(Step {
            kind: CommKind::AllReduce,
            axes: ar.clone(),
            bytes: n,
            time: multi_axis_all_reduce(n, &ar, mesh, cluster),
        });
        for a in ar {
            cur[a] = AxisShard::Replicate;
        }
    }
    // 2. Pending sums to split: reduce-scatter.
    for a in 0..cur.len() {
        if cur[a] == AxisShard::Partial {
            if let AxisShard::Split(_) = to[a] {
                let n = piece(&cur);
                let (al, be) = ab(a);
                steps.push(Step {
                    kind: CommKind::ReduceScatter,
                    axes: vec![a],
                    bytes: n,
                    time: reduce_scatter(n, mesh.axes[a].size, al, be),
                });
                cur[a] = to[a];
            } else if to[a] == AxisShard::Partial {
                // stays partial
            }
        }
    }
    // 3. Split along another dim: all-to-all.
    for a in 0..cur.len() {
        if let (AxisShard::Split(d), AxisShard::Split(e)) = (cur[a], to[a])
            && d != e
        {
            let n = piece(&cur);
            let (al, be) = ab(a);
            steps.push(Step {
                kind: CommKind::AllToAll,
                axes: vec![a],
                bytes: n,
                time: all_to_all(n, mesh.axes[a].size, al, be),
            });
            cur[a] = to[a];
        }
    }
    // 4. Split to replicated: all-gather (inner axes first, so outer gathers move fewer bytes
    //    over slower links is not guaranteed; take the cheaper order).
    let ag: Vec<usize> =
        (0..cur.len()).filter(|&a| matches!(cur[a], AxisShard::Split(_)) && to[a] == AxisShard::Replicate).collect();
    if !ag.is_empty() {
        let order_cost = |order: &[usize]| -> (f64, Vec<Step>) {
            let mut c = cur.clone();
            let mut total = 0.0;
            let mut out = Vec::new();
            for &a in order {
                c[a] = AxisShard::Replicate;
                let n = piece(&c);
                let (al, be) = ab(a);
                let t = all_gather(n, mesh.axes[a].size, al, be);
                total += t;
                out.push(Step { kind: CommKind::AllGather, axes: vec![a], bytes: n, time: t });
            }
            (total, out)
        };
        let fwd = order_cost(&ag);
        let rev: Vec<usize> = ag.iter().rev().copied().collect();
        let back = order_cost(&rev);
        let (_, best) = if back.0 < fwd.0 { back } else { fwd };
        steps.extend(best);
    }
    steps
}

/// Total time of a resharding.
pub fn reshard_time(from: &[AxisShard], to: &[AxisShard], bytes: f64, mesh: &Mesh, cluster: &Cluster) -> f64 {
    reshard(from, to, bytes, mesh, cluster).iter().map(|s| s.time).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::shard::MeshAxis;

    // Hand calculations: α = 5 µs, β = 25 GB/s, n = 100 MB, p = 8.
    const A: f64 = 5e-6;
    const B: f64 = 25e9;
    const N: f64 = 100e6;

    #[test]
    fn ring_all_reduce() {
        // 2·7·5e-6 + 2·7/8·1e8/2.5e10 = 7e-5 + 7e-3 = 0.00707 s
        assert!((all_reduce(N, 8, A, B) - 0.00707).abs() < 1e-12);
        assert_eq!(all_reduce(N, 1, A, B), 0.0);
    }

    #[test]
    fn gather_scatter_alltoall() {
        // 7·5e-6 + 7/8·1e8/2.5e10 = 3.5e-5 + 3.5e-3 = 0.003535 s
        for f in [all_gather, reduce_scatter, all_to_all] {
            assert!((f(N, 8, A, B) - 0.003535).abs() < 1e-12);
        }
    }

    #[test]
    fn broadcast_and_p2p() {
        // ⌈log2 8⌉·5e-6 + 1e8/2.5e10 = 1.5e-5 + 4e-3
        assert!((broadcast(N, 8, A, B) - 0.004015).abs() < 1e-12);
        // 5e-6 + 4e-3
        assert!((p2p(N, A, B) - 0.004005).abs() < 1e-12);
    }

    #[test]
    fn hierarchical_all_reduce_beats_flat_over_slow_links() {
        let c = Cluster::preset("a100-cluster-8").unwrap();
        let mesh = c.mesh(64).unwrap();
        let t = multi_axis_all_reduce(N, &[0, 1], &mesh, &c);
        // By hand: intra RS of 1e8 over 8 at 240 GB/s: 7·3e-6 + 7/8·1e8/2.4e11 = 3.8458e-4;
        // inter AR of 1.25e7 over 8 at 22 GB/s: 14·5e-6 + 14/8·1.25e7/2.2e10 = 1.0643e-3;
        // intra AG back: 3.8458e-4. Total 1.8335e-3.
        let by_hand = (7.0 * 3e-6 + 7.0 / 8.0 * 1e8 / 240e9) * 2.0 + (14.0 * 5e-6 + 14.0 / 8.0 * 1.25e7 / 22e9);
        assert!((t - by_hand).abs() < 1e-9, "{t} vs {by_hand}");
        let flat = all_reduce(N, 8, 5e-6, 22e9) + all_reduce(N, 8, 3e-6, 240e9);
        assert!(t < flat);
    }

    #[test]
    fn resharding_picks_the_right_collectives() {
        let c = Cluster::preset("dgx-a100").unwrap();
        let mesh = Mesh { axes: vec![MeshAxis { name: "gpus".into(), size: 8, level: LinkLevel::Intra }] };
        use AxisShard::*;
        let kinds =
            |f: &[AxisShard], t: &[AxisShard]| reshard(f, t, N, &mesh, &c).iter().map(|s| s.kind).collect::<Vec<_>>();
        assert_eq!(kinds(&[Replicate], &[Split(0)]), vec![]);
        assert_eq!(kinds(&[Split(0)], &[Replicate]), vec![CommKind::AllGather]);
        assert_eq!(kinds(&[Partial], &[Replicate]), vec![CommKind::AllReduce]);
        assert_eq!(kinds(&[Partial], &[Split(1)]), vec![CommKind::ReduceScatter]);
        assert_eq!(kinds(&[Split(0)], &[Split(1)]), vec![CommKind::AllToAll]);
        // An all-gather of a tensor split 8 ways moves 7/8 of it: 7·3e-6 + 7/8·1e8/2.4e11.
        let t = reshard_time(&[Split(0)], &[Replicate], N, &mesh, &c);
        assert!((t - (21e-6 + 0.875 * 1e8 / 240e9)).abs() < 1e-12);
    }

    #[test]
    fn shared_pcie_uplinks_halve_bandwidth() {
        let c = Cluster::preset("pcie-v100x8").unwrap();
        let (_, b) = alpha_beta(&c, LinkLevel::Intra, 8);
        assert_eq!(b, 11e9 / 2.0);
        let (_, b2) = alpha_beta(&c, LinkLevel::Intra, 2);
        assert_eq!(b2, 11e9);
    }
}
