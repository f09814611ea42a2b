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
//! The steps themselves come from the one resharding algebra ([`ir::reshard`]), which the
//! lowering emits too; this module prices them. An all-reduce over a group is one ring at the
//! group's slowest link; on meshes with intra- and inter-node axes the algebra can run it as
//! reduce-scatter inside the nodes, all-reduce across them, all-gather inside them — the cost
//! model picks the cheaper ([`choose_policy`]) and the plan records the choice.

use serde::Serialize;

use ir::reshard::{CommStep, Policy, StepKind};
use ir::shard::{AxisShard, LinkLevel, Mesh};

use super::cluster::{Cluster, Link, Topology};

/// Kinds of communication, for breakdowns.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize)]
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
    /// A local slice: each device copies its piece of a tensor it holds whole along the
    /// sliced axes (no data leaves the device; a kernel the lowering emits all the same).
    Slice,
}

impl CommKind {
    /// Every kind, in report order.
    pub const ALL: [CommKind; 8] = [
        CommKind::AllReduce,
        CommKind::AllGather,
        CommKind::ReduceScatter,
        CommKind::AllToAll,
        CommKind::Broadcast,
        CommKind::P2p,
        CommKind::Halo,
        CommKind::Slice,
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
            CommKind::Slice => "slice",
        }
    }

    /// Whether data moves between devices (a local slice moves none).
    pub fn communicates(self) -> bool {
        self != CommKind::Slice
    }
}

/// Effective (α, β) of a group of `p` devices along a mesh axis of the given level moving a
/// tensor of `bytes` per device while `at_once` devices communicate (a plan's groups run
/// their collectives together: every device of its mesh): the slowest link the group uses,
/// at its bandwidth for that size ([`super::cluster::BySize`]), with shared uplinks dividing
/// it, and on devices simulated on one host the host's cores shared between them
/// ([`super::cluster::Device::comm_share`]).
pub fn alpha_beta(cluster: &Cluster, level: LinkLevel, p: usize, at_once: usize, bytes: f64) -> (f64, f64) {
    let link: &Link = cluster.link(level);
    let mut beta = link.bandwidth_at(bytes);
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
    // Devices sharing a host: a ring step waits for its receiver's thread, longer the more
    // devices beyond its cores hold them, and the copies between host buffers share them.
    let d = &cluster.device;
    let at_once = at_once.max(p);
    let beyond = if d.shared_host && d.host_cores > 0 { at_once.saturating_sub(d.host_cores) } else { 0 };
    let alpha = link.latency * (1.0 + d.ring_contention * beyond as f64);
    (alpha, beta / d.comm_share(at_once))
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

/// One copy of `bytes` between a device and the host on devices that reach each other only
/// through it ([`super::cluster::Device::host_staged`]) while `at_once` devices communicate:
/// a transfer on the host link (its bandwidth shared as [`alpha_beta`] shares the ring's);
/// 0 elsewhere.
pub fn host_copy(cluster: &Cluster, bytes: f64, at_once: usize) -> f64 {
    if !cluster.device.host_staged {
        return 0.0;
    }
    cluster.host.latency + bytes * cluster.device.comm_share(at_once) / cluster.host.bandwidth_at(bytes)
}

/// The copies around a communication on such devices: its operand of `bytes_in` down to the
/// host and its result of `bytes_out` back.
pub fn staging(cluster: &Cluster, bytes_in: f64, bytes_out: f64, at_once: usize) -> f64 {
    host_copy(cluster, bytes_in, at_once) + host_copy(cluster, bytes_out, at_once)
}

/// A point-to-point send of `n` bytes between two devices over the link of `level`, with
/// its staging copies, while `at_once` devices communicate.
pub fn send(cluster: &Cluster, level: LinkLevel, n: f64, at_once: usize) -> f64 {
    if n <= 0.0 {
        return 0.0;
    }
    message(cluster, level, n, at_once) + staging(cluster, n, n, at_once)
}

/// A point-to-point message of `n` bytes between the staging copies: on the link of `level`
/// (`α + n/β`), or, between devices sharing one host, a copy from the sender's host buffer
/// into the receiver's (the runtime hands messages over in host memory: no link, no ring
/// steps to wait for), read and written at the memory bandwidth the devices at once share.
pub fn message(cluster: &Cluster, level: LinkLevel, n: f64, at_once: usize) -> f64 {
    if n <= 0.0 {
        return 0.0;
    }
    let d = &cluster.device;
    if in_host_memory(cluster) {
        return 2.0 * n * d.comm_share(at_once) / d.mem_bandwidth;
    }
    let (alpha, beta) = alpha_beta(cluster, level, 2, at_once, n);
    p2p(n, alpha, beta)
}

/// Whether a point-to-point message between devices is a copy in host memory made by the
/// sender ([`message`]): devices sharing one host. Elsewhere it travels a link.
pub fn in_host_memory(cluster: &Cluster) -> bool {
    cluster.device.shared_host && cluster.device.mem_bandwidth > 0.0
}

/// Point-to-point: `α + n/β`.
pub fn p2p(n: f64, alpha: f64, beta: f64) -> f64 {
    if n <= 0.0 {
        return 0.0;
    }
    alpha + n / beta
}

/// One priced communication step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    /// What it is.
    pub kind: CommKind,
    /// Mesh axes of its group.
    pub axes: Vec<usize>,
    /// Devices in its group (for a halo exchange: along its axis).
    pub group: usize,
    /// Bytes per device of the tensor it operates on (see [`ir::reshard::CommStep::bytes`]).
    pub bytes: f64,
    /// Bytes each device sends (the busiest member's, for a halo exchange).
    pub moved: f64,
    /// Per device of the mesh, what it sends, when devices differ (the ends of a halo
    /// exchange send to one neighbour only).
    #[serde(skip)]
    pub moved_by_device: Option<Vec<f64>>,
    /// The latency (α) part of `time`, seconds.
    pub latency: f64,
    /// Seconds.
    pub time: f64,
}

impl CommKind {
    /// The kind of a step of the resharding algebra; `None` for local steps.
    pub fn of(kind: &StepKind) -> Option<CommKind> {
        Some(match kind {
            StepKind::AllReduce => CommKind::AllReduce,
            StepKind::ReduceScatter { .. } => CommKind::ReduceScatter,
            StepKind::AllGather { .. } => CommKind::AllGather,
            StepKind::AllToAll { .. } => CommKind::AllToAll,
            StepKind::Slice => CommKind::Slice,
            StepKind::Zero => return None,
        })
    }
}

/// The price of one step of the algebra, its bytes scaled by `scale` (gradient compression);
/// `None` for a local step. A group spanning nodes runs at the inter-node link's (α, β).
/// Every device of the mesh is taken to communicate or compute at once ([`price_at`]).
pub fn price(step: &CommStep, scale: f64, mesh: &Mesh, cluster: &Cluster) -> Option<Step> {
    price_at(step, scale, mesh, cluster, mesh.devices())
}

/// [`price`] with `at_once` devices communicating or computing at once (on devices sharing a
/// host they share its cores: a pipeline stage's collectives run beside the other stages).
pub fn price_at(step: &CommStep, scale: f64, mesh: &Mesh, cluster: &Cluster, at_once: usize) -> Option<Step> {
    let kind = CommKind::of(&step.kind)?;
    let p = step.group_size(mesh);
    let bytes = step.bytes * scale;
    if kind == CommKind::Slice {
        let (time, latency) = local_copy(cluster, at_once, bytes);
        return Some(Step {
            kind,
            axes: step.axes.clone(),
            group: p,
            bytes,
            moved: 0.0,
            moved_by_device: None,
            latency,
            time,
        });
    }
    let (alpha, beta) = alpha_beta(cluster, step.level(mesh), p, at_once, bytes);
    let (time, latency) = match kind {
        CommKind::AllReduce => (all_reduce(bytes, p, alpha, beta), all_reduce(f64::MIN_POSITIVE, p, alpha, beta)),
        _ => (all_gather(bytes, p, alpha, beta), all_gather(f64::MIN_POSITIVE, p, alpha, beta)),
    };
    // Through the host: what each member copies down and back (see `CommStep::bytes`).
    let (bytes_in, bytes_out) = match kind {
        CommKind::AllGather => (bytes / p as f64, bytes),
        CommKind::ReduceScatter => (bytes, bytes / p as f64),
        _ => (bytes, bytes),
    };
    let (staged, staged_latency) = if p > 1 {
        (staging(cluster, bytes_in, bytes_out, at_once), staging(cluster, 0.0, 0.0, at_once))
    } else {
        (0.0, 0.0)
    };
    let (time, latency) = (time + staged, latency + staged_latency);
    Some(Step {
        kind,
        axes: step.axes.clone(),
        group: p,
        bytes,
        moved: ir::reshard::moved(&step.kind, p, bytes),
        moved_by_device: None,
        latency,
        time,
    })
}

/// Seconds (and the dispatch's part of them) of a kernel copying `bytes` out of a tensor on
/// each device: a dispatch and the bytes read and written, at the device's memory bandwidth —
/// shared, where devices share a host, as the cost model shares it between the `busy`
/// devices running at once.
pub fn local_copy(cluster: &Cluster, busy: usize, bytes: f64) -> (f64, f64) {
    if bytes <= 0.0 {
        return (0.0, 0.0);
    }
    let d = &cluster.device;
    let launch = d.launch_at(busy);
    (launch + 2.0 * bytes * d.host_share(busy) / d.mem_bandwidth, launch)
}

/// The priced communication steps of a resharding (see [`ir::reshard::reshard`]).
#[allow(clippy::too_many_arguments)]
pub fn reshard(
    dims: &[i64],
    elem_bytes: f64,
    from: &[AxisShard],
    to: &[AxisShard],
    scale: f64,
    mesh: &Mesh,
    cluster: &Cluster,
    policy: Policy,
) -> Vec<Step> {
    price_steps(&ir::reshard::reshard(dims, elem_bytes, from, to, mesh, policy), scale, mesh, cluster, mesh.devices())
}

/// The algebra's steps priced ([`price_at`]), its local ones left out.
pub fn price_steps(steps: &[CommStep], scale: f64, mesh: &Mesh, cluster: &Cluster, at_once: usize) -> Vec<Step> {
    steps.iter().filter_map(|s| price_at(s, scale, mesh, cluster, at_once)).collect()
}

/// An all-reduce of `bytes` per device over mesh axes `axes`, as the algebra runs it under
/// `policy` (for sums of many tensors, priced as one flat buffer), with `at_once` devices
/// communicating or computing at once (see [`price_at`]).
pub fn all_reduce_over(
    bytes: f64,
    axes: &[usize],
    mesh: &Mesh,
    cluster: &Cluster,
    policy: Policy,
    at_once: usize,
) -> Vec<Step> {
    if bytes <= 0.0 || axes.is_empty() {
        return Vec::new();
    }
    // A flat buffer of 4-byte words that every group size divides.
    let q: i64 = mesh.axes.iter().map(|a| a.size as i64).product::<i64>().max(1);
    let words = ((bytes / 4.0).ceil() as i64 + q - 1) / q * q;
    let from: Vec<AxisShard> = (0..mesh.axes.len())
        .map(|a| if axes.contains(&a) { AxisShard::Partial } else { AxisShard::Replicate })
        .collect();
    let to = vec![AxisShard::Replicate; mesh.axes.len()];
    let scale = bytes / (words as f64 * 4.0);
    price_steps(&ir::reshard::reshard(&[words], 4.0, &from, &to, mesh, policy), scale, mesh, cluster, at_once)
}

/// Total seconds of priced steps.
pub fn total(steps: &[Step]) -> f64 {
    steps.iter().map(|s| s.time).sum()
}

/// The algebra's choices for a mesh, made by pricing: an all-reduce over all axes of a
/// 25 MB buffer (a gradient bucket) as one ring and over the link hierarchy; the cheaper
/// wins. Only meshes with both intra- and inter-node axes have a choice.
pub fn choose_policy(mesh: &Mesh, cluster: &Cluster) -> Policy {
    let axes: Vec<usize> = (0..mesh.axes.len()).collect();
    let flat = total(&all_reduce_over(25e6, &axes, mesh, cluster, Policy::default(), mesh.devices()));
    let hier = Policy { hierarchical_all_reduce: true };
    let tree = total(&all_reduce_over(25e6, &axes, mesh, cluster, hier, mesh.devices()));
    if tree < flat { hier } else { Policy::default() }
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
        let hier = Policy { hierarchical_all_reduce: true };
        let t = total(&all_reduce_over(N, &[0, 1], &mesh, &c, hier, mesh.devices()));
        // By hand: intra RS of 1e8 over 8 at 240 GB/s: 7·3e-6 + 7/8·1e8/2.4e11 = 3.8458e-4;
        // inter AR of 1.25e7 over 8 at 22 GB/s shared by 8 groups over 8 NICs: 14·5e-6 +
        // 14/8·1.25e7/2.2e10 = 1.0643e-3; intra AG back: 3.8458e-4. Total 1.8335e-3.
        let by_hand = (7.0 * 3e-6 + 7.0 / 8.0 * 1e8 / 240e9) * 2.0 + (14.0 * 5e-6 + 14.0 / 8.0 * 1.25e7 / 22e9);
        assert!((t - by_hand).abs() < 1e-9, "{t} vs {by_hand}");
        // One ring over all 64 devices runs at the inter-node link: 2·63·5e-6 + 2·63/64·1e8/2.2e10.
        let flat = total(&all_reduce_over(N, &[0, 1], &mesh, &c, Policy::default(), mesh.devices()));
        assert!((flat - all_reduce(N, 64, 5e-6, 22e9)).abs() < 1e-9, "{flat}");
        assert!(t < flat);
        assert_eq!(choose_policy(&mesh, &c), hier);
        // One level: nothing to choose.
        let one = Cluster::preset("dgx-a100").unwrap();
        assert_eq!(choose_policy(&one.mesh(8).unwrap(), &one), Policy::default());
    }

    #[test]
    fn resharding_picks_the_right_collectives() {
        let c = Cluster::preset("dgx-a100").unwrap();
        let mesh = Mesh { axes: vec![MeshAxis { name: "gpus".into(), size: 8, level: LinkLevel::Intra }] };
        use AxisShard::*;
        let dims = [N as i64 / 4 / 8, 8];
        let steps = |f: &[AxisShard], t: &[AxisShard]| reshard(&dims, 4.0, f, t, 1.0, &mesh, &c, Policy::default());
        let kinds = |f: &[AxisShard], t: &[AxisShard]| steps(f, t).iter().map(|s| s.kind).collect::<Vec<_>>();
        // Splitting a replicated tensor moves nothing: each device copies its piece out, a
        // kernel priced as its bytes read and written (1/8 of 100 MB, twice, at 1.6 TB/s).
        assert_eq!(kinds(&[Replicate], &[Split(0)]), vec![CommKind::Slice]);
        let slice = &steps(&[Replicate], &[Split(0)])[0];
        assert_eq!(slice.moved, 0.0);
        let d = &c.device;
        assert!((slice.time - (d.launch_overhead + 2.0 * N / 8.0 / d.mem_bandwidth)).abs() < 1e-12, "{slice:?}");
        assert_eq!(kinds(&[Split(0)], &[Replicate]), vec![CommKind::AllGather]);
        assert_eq!(kinds(&[Partial], &[Replicate]), vec![CommKind::AllReduce]);
        assert_eq!(kinds(&[Partial], &[Split(1)]), vec![CommKind::ReduceScatter]);
        assert_eq!(kinds(&[Split(0)], &[Split(1)]), vec![CommKind::AllToAll]);
        // An all-gather of a tensor split 8 ways moves 7/8 of it: 7·3e-6 + 7/8·1e8/2.4e11.
        let ag = steps(&[Split(0)], &[Replicate]);
        assert!((total(&ag) - (21e-6 + 0.875 * 1e8 / 240e9)).abs() < 1e-12);
        assert!((ag[0].moved - 0.875 * N).abs() < 1e-3);
        assert!((ag[0].latency - 21e-6).abs() < 1e-15);
        // An all-reduce sends twice that.
        assert!((steps(&[Partial], &[Replicate])[0].moved - 1.75 * N).abs() < 1e-3);
    }

    #[test]
    fn host_staged_collectives_pay_their_copies_and_busy_rings() {
        // The runtime's simulated devices: every collective copies its operand down and its
        // result back over the host link, around the ring between host buffers.
        let mut c = Cluster::preset("local-wgpu").unwrap();
        let (d, h) = (&mut c.device, c.host.clone());
        assert!(d.host_staged && d.shared_host);
        d.ring_contention = 0.5;
        d.host_cores = 2;
        let n = 4.0e6;
        let (a, b) = (c.intra.latency, c.intra.bandwidth_at(n));
        let mesh = |p: usize| Mesh { axes: vec![MeshAxis { name: "gpus".into(), size: p, level: LinkLevel::Intra }] };
        // Copies at a `share` of the host's rate.
        let shared = |share: f64, bytes_in: f64, bytes_out: f64| {
            2.0 * h.latency + share * (bytes_in / h.bandwidth_at(bytes_in) + bytes_out / h.bandwidth_at(bytes_out))
        };
        let copies = |bytes_in: f64, bytes_out: f64| shared(1.0, bytes_in, bytes_out);
        use AxisShard::*;
        let dims = [(n / 4.0) as i64];
        let steps = |p: usize, f: &[AxisShard], t: &[AxisShard]| {
            reshard(&dims, 4.0, f, t, 1.0, &mesh(p), &c, Policy::default())
        };
        // Two devices (no more than the cores): the idle ring's α.
        let ar = steps(2, &[Partial], &[Replicate]);
        assert!((ar[0].time - (all_reduce(n, 2, a, b) + copies(n, n))).abs() < 1e-12, "{:?}", ar[0]);
        assert!((ar[0].latency - (2.0 * a + 2.0 * h.latency)).abs() < 1e-15);
        // Four devices on two cores: each ring step takes 1 + 0.5·2 times α, and the ring's
        // and the copies' bytes move at half the rate (two devices per core). An all-gather
        // copies down a quarter and back the whole; a reduce-scatter the other way round.
        let (busy, half) = (a * 2.0, b / 2.0);
        let ag = steps(4, &[Split(0)], &[Replicate]);
        let want = all_gather(n, 4, busy, half) + shared(2.0, n / 4.0, n);
        assert!((ag[0].time - want).abs() < 1e-12, "{:?}", ag[0]);
        let rs = steps(4, &[Partial], &[Split(0)]);
        let want = reduce_scatter(n, 4, busy, half) + shared(2.0, n, n / 4.0);
        assert!((rs[0].time - want).abs() < 1e-12, "{:?}", rs[0]);
        // Groups of two on a 2×2 mesh: their rings run at once, four devices on two cores.
        let square = Mesh {
            axes: vec![
                MeshAxis { name: "a".into(), size: 2, level: LinkLevel::Intra },
                MeshAxis { name: "b".into(), size: 2, level: LinkLevel::Intra },
            ],
        };
        let ar = reshard(
            &[(n / 4.0) as i64],
            4.0,
            &[Replicate, Partial],
            &[Replicate, Replicate],
            1.0,
            &square,
            &c,
            Policy::default(),
        );
        assert_eq!((ar.len(), ar[0].group), (1, 2));
        assert!((ar[0].time - (all_reduce(n, 2, busy, half) + shared(2.0, n, n))).abs() < 1e-12, "{:?}", ar[0]);
        // A stage-to-stage send pays both copies too, and between devices of one host a copy
        // between host buffers (read and written at the memory bandwidth, shared by the
        // devices at once) instead of the link; GPUs with a device path pay no copies.
        let mem = c.device.mem_bandwidth;
        assert!((send(&c, LinkLevel::Intra, n, 2) - (2.0 * n / mem + copies(n, n))).abs() < 1e-12);
        assert!((send(&c, LinkLevel::Intra, n, 4) - (4.0 * n / mem + shared(2.0, n, n))).abs() < 1e-12);
        let gpus = Cluster::preset("dgx-a100").unwrap();
        assert_eq!(staging(&gpus, n, n, 8), 0.0);
        assert_eq!(send(&gpus, LinkLevel::Intra, n, 8), p2p(n, 3e-6, 240e9));
    }

    #[test]
    fn shared_pcie_uplinks_halve_bandwidth() {
        let c = Cluster::preset("pcie-v100x8").unwrap();
        let (_, b) = alpha_beta(&c, LinkLevel::Intra, 8, 8, 1e6);
        assert_eq!(b, 11e9 / 2.0);
        let (_, b2) = alpha_beta(&c, LinkLevel::Intra, 2, 8, 1e6);
        assert_eq!(b2, 11e9);
    }
}
