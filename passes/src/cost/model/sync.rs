//! Gradient synchronisation and the optimizer: buckets, ZeRO reduce-scatters and gathers, the
//! backward timeline they overlap, tensor-parallel overlap and the input path.

use super::*;

impl<'a> CostModel<'a> {
    /// Per parameter, the synchronisation of its gradient: from the layout its readers leave
    /// it in to its storage layout, partial sums reduced.
    pub(super) fn gradient_sync(
        &self,
        w: &mut Walk,
        edges: &Edges<'_>,
        storage: &BTreeMap<Value, Sharding>,
    ) -> Vec<GradEvent> {
        let axes = self.mesh.axes.len();
        let mut out = Vec::new();
        for (v, grad) in &edges.param_grad {
            let st = storage.get(v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; axes]);
            let target: Sharding =
                st.iter().map(|x| if *x == AxisShard::Partial { AxisShard::Replicate } else { *x }).collect();
            let steps = self.reshard(*v, grad, &target, self.opts.grad_compression);
            if steps.is_empty() {
                continue;
            }
            let local_bytes = self.value_bytes(*v) * self.opts.grad_compression / split_factor(&target, &self.mesh);
            let t = super::collective::total(&steps);
            let latency: f64 = steps.iter().map(|s| s.latency).sum();
            // Bandwidth terms are paid per tensor; latency terms per bucket (below).
            for s in steps.iter() {
                *w.comm_kind.entry(s.kind.name()).or_insert(0.0) += s.time - s.latency;
            }
            if w.detail {
                w.rows[edges.param_first_use[v]].grad_sync_s += t;
                w.sync_events.push(CommEvent {
                    phase: Phase::Gradient,
                    value: *v,
                    op: None,
                    from: grad.clone(),
                    to: target,
                    steps: steps.to_vec(),
                });
            }
            out.push(GradEvent {
                value: *v,
                pos: edges.param_first_use[v],
                bytes: local_bytes,
                bandwidth: t - latency,
                latency,
                sig: steps.iter().map(|s| (s.kind, s.axes.clone())).collect(),
                step_bandwidth: steps.iter().map(|s| s.time - s.latency).collect(),
            });
        }
        out
    }

    /// Optimizer state bytes per parameter element.
    pub(super) fn optimizer_bytes_per_elem(&self) -> f64 {
        optimizer_bytes_per_elem(&self.opts)
    }

    /// Memory traffic of the update per parameter element.
    pub(super) fn update_bytes_per_elem(&self) -> f64 {
        update_bytes_per_elem(&self.opts)
    }

    /// The parameters each device stores, and their rows' memory and update time.
    pub(super) fn parameters(
        &self,
        w: &mut Walk,
        edges: &Edges<'_>,
        storage: &BTreeMap<Value, Sharding>,
        ways: &FxHashMap<Value, f64>,
    ) -> Params {
        let pf = self.precision_factor();
        let zero = self.opts.zero;
        let mut p = Params::default();
        for (v, st) in storage {
            if !ir::cost::is_param(self.g, *v) {
                continue;
            }
            let local = self.value_bytes(*v) / split_factor(st, &self.mesh);
            let n = ways.get(v).copied().unwrap_or(1.0);
            let at = |stage: u8| if zero >= stage { n } else { 1.0 };
            let elems = local / (4.0 * pf) / at(1);
            p.bytes += local / at(3);
            if !edges.param_first_use.contains_key(v) {
                continue; // stored, never trained
            }
            if zero >= 3 && n > 1.0 {
                p.gathered = p.gathered.max(2.0 * local);
            }
            let half = local / at(2) * half_grads_kept(&self.opts);
            let copy = elems * grad_copy_bytes_per_elem(&self.opts);
            p.trained_bytes += half + copy;
            p.elems += elems;
            p.count += 1;
            if w.detail
                && let Some(&first) = edges.param_first_use.get(v)
            {
                w.rows[first].param_memory_bytes +=
                    local / at(3) + half + copy + elems * self.optimizer_bytes_per_elem();
                w.rows[first].grad_memory_bytes += half + copy;
                w.rows[first].weight_memory_bytes += local / at(3);
                w.rows[first].update_s += elems * self.update_bytes_per_elem() / self.mem_bandwidth();
            }
        }
        p
    }

    /// ZeRO's synchronisation (`opts.zero` ≥ 1): a gradient all-reduced over its parameter's
    /// data-parallel devices is reduce-scattered instead (half the all-reduce's time, in the
    /// backward pass's buckets as before) and the updated shards all-gathered after the update
    /// (the other half; stage 3 gathers before the forward and again before the backward
    /// instead). Returns each such parameter's data-parallel ways and the seconds of one
    /// all-gather of them all.
    pub(super) fn zero_sync(&self, w: &mut Walk, grads: &mut [GradEvent]) -> (FxHashMap<Value, f64>, f64) {
        let mut ways = FxHashMap::default();
        let (mut gather, mut bytes, mut latency) = (0.0f64, 0.0f64, 0.0f64);
        if self.opts.zero == 0 {
            return (ways, 0.0);
        }
        for e in grads.iter_mut() {
            // An all-reduce: one, or the link hierarchy's reduce-scatter, all-reduce and
            // all-gather (multi-node meshes under the hierarchical policy).
            let reduces =
                |k: &CommKind| matches!(k, CommKind::AllReduce | CommKind::ReduceScatter | CommKind::AllGather);
            if e.sig.is_empty()
                || !e.sig.iter().all(|(k, _)| reduces(k))
                || e.sig.iter().all(|(k, _)| *k == CommKind::AllGather)
            {
                continue;
            }
            let mut axes: Vec<usize> = e.sig.iter().flat_map(|(_, a)| a.iter().copied()).collect();
            axes.sort_unstable();
            axes.dedup();
            let n: usize = axes.iter().map(|&a| self.mesh.axes[a].size).product();
            for ((k, _), bw) in e.sig.iter().zip(&e.step_bandwidth) {
                *w.comm_kind.entry(k.name()).or_insert(0.0) -= bw;
            }
            e.bandwidth /= 2.0;
            e.latency /= 2.0;
            e.sig = vec![(CommKind::ReduceScatter, axes)];
            e.step_bandwidth = vec![e.bandwidth];
            gather += e.bandwidth;
            bytes += e.bytes;
            latency = latency.max(e.latency);
            *w.comm_kind.entry(CommKind::ReduceScatter.name()).or_insert(0.0) += e.bandwidth;
            ways.insert(e.value, n as f64);
        }
        // The gathers are bucketed as the gradients are: latency per bucket.
        gather += latency * (bytes / self.opts.bucket_bytes).ceil();
        let gathers = if self.opts.zero >= 3 { 2.0 } else { 1.0 };
        *w.comm_kind.entry(CommKind::AllGather.name()).or_insert(0.0) += gathers * gather;
        (ways, gather)
    }

    /// The exposed seconds of ZeRO's parameter all-gathers (`gather`: one of all the
    /// parameters). Where gradient synchronisation overlaps ([`Options::overlap_grad_sync`],
    /// not on host-staged devices) they are prefetched beside compute, which runs
    /// `overlap_slowdown` times slower meanwhile: stages 1 and 2 gather the updated shards
    /// beside the next step's first micro-batch forward (`first_fwd`; Megatron-LM's
    /// `--overlap-param-gather`), stage 3 before the forward and the backward pass, each beside
    /// that pass. Without overlap they are exposed whole.
    pub(super) fn zero_gather_exposed(&self, gather: f64, fwd: f64, bwd: f64, first_fwd: f64) -> f64 {
        if gather == 0.0 {
            return 0.0;
        }
        let overlaps = self.opts.overlap_grad_sync && !self.cluster.device.host_staged;
        let passes: &[f64] = match (self.opts.zero >= 3, overlaps) {
            (false, false) => return gather,
            (true, false) => return 2.0 * gather,
            (false, true) => &[first_fwd],
            (true, true) => &[fwd, bwd],
        };
        let slow = (self.opts.overlap_slowdown - 1.0).max(0.0);
        passes.iter().map(|&c| (gather - c).max(0.0) + gather.min(c) * slow).sum()
    }

    /// The backward pass with gradient synchronisation in buckets, as DDP does: gradients
    /// with the same collectives share a bucket, in readiness order, until it holds
    /// `bucket_bytes` (the first bucket `first_bucket_bytes`); latency terms are paid per
    /// bucket. Overlapped, a bucket leaves when its last gradient is ready and the link is
    /// free; what outlasts the backward pass is exposed, and compute beside communication
    /// runs `overlap_slowdown` times slower. Returns (backward, synchronisation, exposed).
    pub(super) fn backward_timeline(
        &self,
        w: &mut Walk,
        bwd_items: &[(NodeId, f64)],
        grads: &[GradEvent],
    ) -> (f64, f64, f64) {
        let mut done_at: FxHashMap<NodeId, f64> = FxHashMap::default();
        let mut bwd_total = 0.0;
        for &(n, dt) in bwd_items.iter().rev() {
            bwd_total += dt;
            done_at.insert(n, bwd_total);
        }
        let mut ready: Vec<(f64, usize)> =
            grads.iter().enumerate().map(|(i, e)| (done_at[&self.order[e.pos]], i)).collect();
        ready.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut open: BTreeMap<&[(CommKind, Vec<usize>)], OpenBucket> = BTreeMap::new();
        let mut buckets: Vec<(f64, f64, &str)> = Vec::new(); // (ready, seconds, kind)
        for &(r, i) in &ready {
            let e = &grads[i];
            let b = open.entry(&e.sig).or_insert((0.0, 0.0, 0.0, 0.0));
            b.0 += e.bytes;
            b.1 += e.bandwidth;
            b.2 = b.2.max(e.latency);
            b.3 = r;
            let cap = if buckets.is_empty() {
                self.opts.first_bucket_bytes.min(self.opts.bucket_bytes)
            } else {
                self.opts.bucket_bytes
            };
            if b.0 >= cap {
                let (_, bw, lat, r) = open.remove(e.sig.as_slice()).expect("open bucket");
                buckets.push((r, bw + lat, e.sig[0].0.name()));
                *w.comm_kind.entry(e.sig[0].0.name()).or_insert(0.0) += lat;
            }
        }
        for (sig, (_, bw, lat, r)) in open {
            buckets.push((r, bw + lat, sig[0].0.name()));
            *w.comm_kind.entry(sig[0].0.name()).or_insert(0.0) += lat;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let grad_sync = buckets.iter().map(|b| b.1).sum::<f64>();
        let mut exposed = grad_sync;
        // Host-staged collectives (the runtime's simulated devices, its MPI transport) run on
        // the device's own thread between its kernels, as the training program prices them:
        // nothing of them overlaps the backward pass.
        let overlaps = self.opts.overlap_grad_sync && !self.cluster.device.host_staged;
        if overlaps && !buckets.is_empty() {
            let mut comm_free: f64 = 0.0;
            for &(r, dt, _) in &buckets {
                comm_free = comm_free.max(r) + dt;
            }
            let tail = (comm_free - bwd_total).max(0.0);
            let overlapped = (grad_sync - tail).max(0.0);
            exposed = tail + overlapped * (self.opts.overlap_slowdown - 1.0).max(0.0);
            debug_assert!(tail <= grad_sync * (1.0 + 1e-9) + 1e-15, "tail {tail} > total {grad_sync}");
            exposed = exposed.min(grad_sync);
        }
        (bwd_total, grad_sync, exposed)
    }

    /// The exposed part of an op's activation collectives (`fwd`, `bwd` seconds) under
    /// [`Options::tp_comm_overlap`]: each pass's collectives hide behind the GEMM beside them
    /// (the op itself when it is a contraction, else the contraction producing one of its
    /// inputs, `time_of` giving that op's times), the GEMM `overlap_slowdown` slower
    /// meanwhile. Unchanged without the option.
    pub(super) fn tp_overlapped(
        &self,
        n: NodeId,
        fwd: f64,
        bwd: f64,
        time_of: &dyn Fn(NodeId) -> OpTime,
    ) -> (f64, f64) {
        if !self.opts.tp_comm_overlap || fwd + bwd <= 0.0 {
            return (fwd, bwd);
        }
        let gemm = |m: NodeId| matches!(self.g.node(m).op, Op::MatMul(_) | Op::Gemm(_));
        let beside =
            if gemm(n) { Some(n) } else { self.g.node(n).inputs().iter().flatten().map(|v| v.node).find(|&m| gemm(m)) };
        let Some(t) = beside.map(time_of) else { return (fwd, bwd) };
        let slow = (self.opts.overlap_slowdown - 1.0).max(0.0);
        let exposed = |c: f64, budget: f64| (c - budget).max(0.0) + c.min(budget) * slow;
        (exposed(fwd, t.fwd), exposed(bwd, t.bwd))
    }

    /// Host→device input time (before overlap) and bytes per step.
    pub(super) fn input_time(&self, storage: &BTreeMap<Value, Sharding>, mesh: &Mesh) -> (f64, f64) {
        let host = &self.cluster.host;
        let mut full = 0.0;
        let mut local = 0.0;
        for v in self.g.input_values() {
            if !matches!(self.g.node(v.node).op, Op::Input { default: None }) {
                continue;
            }
            let b = self.g.tensor_type(v).and_then(TensorType::size_bytes).unwrap_or(0) as f64;
            full += b;
            let sh = storage.get(&v).cloned().unwrap_or_else(|| vec![AxisShard::Replicate; mesh.axes.len()]);
            local += b / split_factor(&sh, mesh);
        }
        if full == 0.0 {
            return (0.0, 0.0);
        }
        let p = mesh.devices();
        let t = match self.opts.input_path {
            // Every device pulls its own slice; devices under one host link share it.
            InputPath::Scatter => host.latency + local * host.shared_by.min(p) as f64 / host.bandwidth,
            // The batch lands on device 0, which then sends every other device its slice over
            // its own device link, one after another. (At the links' bandwidth for large
            // transfers, as the search's extraction prices a byte of input.)
            InputPath::Staged => {
                let (alpha, beta) = alpha_beta(self.cluster, ir::shard::LinkLevel::Intra, p, p, f64::INFINITY);
                host.latency + full / host.bandwidth + (p as f64 - 1.0) * (alpha + local / beta)
            }
        };
        (t, local * p as f64)
    }
}
