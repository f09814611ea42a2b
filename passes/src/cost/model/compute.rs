//! Compute time: the roofline of each op's local share (GEMM shapes, waves, tiles), launches, halos and
//! statistics collectives, and the memoized per-op evaluation.

use super::*;

impl<'a> CostModel<'a> {
    /// How many devices share one device's compute and memory bandwidth: the mesh's size on
    /// a cluster of devices simulated on one host, else 1.
    pub(super) fn host_share(&self) -> f64 {
        self.cluster.device.host_share(self.busy())
    }

    /// The fixed cost of one kernel on one device: the device's launch overhead, more on
    /// devices simulated on one host the more of them dispatch at once
    /// ([`crate::cost::cluster::Device::launch_at`]).
    pub fn launch(&self) -> f64 {
        self.cluster.device.launch_at(self.busy())
    }

    /// How much slower a kernel of `parallel` independent invocations runs than one that
    /// fills the device ([`crate::cost::cluster::Device::parallel_width`]; 1 when unknown).
    pub fn underfill(&self, parallel: f64) -> f64 {
        let d = &self.cluster.device;
        if d.parallel_width <= 0.0 || parallel <= 0.0 {
            return 1.0;
        }
        (d.parallel_width / parallel).clamp(1.0, d.serial_slowdown.max(1.0))
    }

    /// Memory bandwidth of one device, bytes/s.
    pub(super) fn mem_bandwidth(&self) -> f64 {
        self.cluster.device.mem_bandwidth / self.host_share()
    }

    /// Roofline time of `flops` and `bytes` on one device, at the device's GEMM efficiency.
    pub fn roofline(&self, flops: f64, bytes: f64) -> f64 {
        self.roofline_at(flops, bytes, self.cluster.device.efficiency)
    }

    /// Roofline time at efficiency `eff` of the matrix units' peak.
    pub(super) fn roofline_at(&self, flops: f64, bytes: f64, eff: f64) -> f64 {
        self.roofline_with(self.peak(), flops, bytes, eff)
    }

    /// Roofline time at efficiency `eff` of `peak` FLOP/s.
    fn roofline_with(&self, peak: f64, flops: f64, bytes: f64, eff: f64) -> f64 {
        (flops / (peak * eff.max(1e-6))).max(bytes / self.mem_bandwidth())
    }

    /// The local GEMM problem (`m × n` output, reduction `k`) of a contraction or
    /// convolution under layouts `ins`/`outs`, for its shape-dependent efficiency, and how
    /// many such GEMMs one batched kernel runs.
    pub(super) fn gemm_shape(
        &self,
        n: NodeId,
        ins: &[Option<Sharding>],
        outs: &[Sharding],
    ) -> Option<(f64, f64, f64, f64)> {
        let (m, nn, k) = self.gemm_extents(n, ins, outs)?;
        let node = self.g.node(n);
        let batch = match &node.op {
            Op::MatMul(_) if !self.one_product(n, ins) => {
                let y = self.local_static_dims(Value::new(n, 0), outs.first())?;
                y.iter().rev().skip(2).product::<i64>() as f64
            }
            _ => 1.0,
        };
        Some((m, nn, k, batch))
    }

    /// The `(m, n, k)` of [`CostModel::gemm_shape`]: the op's own rule
    /// ([`ir::ops::OpRules::gemm`]) on its local pieces.
    pub(super) fn gemm_extents(
        &self,
        n: NodeId,
        ins: &[Option<Sharding>],
        outs: &[Sharding],
    ) -> Option<(f64, f64, f64)> {
        let g = self.g;
        let node = g.node(n);
        let local = |v: Value, l: Option<&Sharding>| -> Option<Vec<f64>> {
            Some(self.local_static_dims(v, l)?.into_iter().map(|x| x as f64).collect())
        };
        let x = local(node.input(0)?, ins.first().and_then(Option::as_ref))?;
        let w = node.input(1).and_then(|v| local(v, ins.get(1).and_then(Option::as_ref)));
        let y = local(Value::new(n, 0), outs.first())?;
        node.op.rules().gemm(&x, w.as_deref(), &y)
    }

    /// Whether a MatMul or Gemm runs as one GEMM product on the device: a Gemm always; a
    /// MatMul whose B has no batch of its own (A's batch folds into the rows).
    pub(super) fn one_product(&self, n: NodeId, ins: &[Option<Sharding>]) -> bool {
        let node = self.g.node(n);
        match &node.op {
            Op::Gemm(_) => true,
            Op::MatMul(_) => node
                .input(1)
                .and_then(|b| self.local_static_dims(b, ins.get(1).and_then(Option::as_ref)))
                .is_some_and(|b| ir::ops::contraction::shared_b(&b)),
            _ => false,
        }
    }

    /// The number of devices sharing an op's work under a strategy.
    pub fn strategy_factor(&self, n: NodeId, strategy: &[Option<usize>]) -> f64 {
        // A sum's extent-less dim divides no work: each device sums its partial sums.
        let sp = self.space(n);
        strategy
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some_and(|i| sp.dims[i].kind != DimKind::Linear))
            .map(|(a, _)| self.mesh.axes[a].size as f64)
            .product()
    }

    /// Compute, halo and statistics time of `n` under `strategy`.
    pub fn op_time(&self, n: NodeId, strategy: &[Option<usize>]) -> OpTime {
        self.op_eval(n, strategy).time
    }

    /// Forward and backward compute of `n` under `strategy`: the roofline of its local share.
    pub(super) fn compute_time(
        &self,
        n: NodeId,
        strategy: &[Option<usize>],
        mode: Option<&SplitMode>,
        ins: &[Option<Sharding>],
        outs: &[Sharding],
    ) -> (f64, f64) {
        let node = self.g.node(n);
        if is_view(&node.op) || is_host(&node.op) || self.local_view(n, ins) {
            return (0.0, 0.0);
        }
        let c = &self.costs[&n];
        let f = self.strategy_factor(n, strategy);
        let peak = self.op_peak(n);
        let pf = self.precision_factor();
        // Local bytes: activations divide by the op's split, weights by their own split.
        let mut param_local = 0.0;
        for (j, s) in ins.iter().enumerate() {
            if let (Some(v), Some(s)) = (node.input(j), s)
                && ir::cost::is_param(self.g, v)
            {
                param_local += self.value_bytes(v) * ir::cost::read_factor(self.g, n, j) / split_factor(s, &self.mesh);
            }
        }
        let act_bytes = (c.bytes_read - c.param_bytes + c.bytes_written) * pf / f;
        let d = &self.cluster.device;
        // A transpose that moves the innermost dim of a tensor too large for the cache reads or
        // writes with a stride.
        let strided = match (&node.op, node.input(0)) {
            (Op::Transpose(t), Some(x)) => {
                let rank = self.g.tensor_type(x).and_then(|t| t.rank()).unwrap_or(0);
                let last = t.perm.as_ref().map_or(0, |p| p.last().copied().unwrap_or(0) as usize);
                rank > 1 && last != rank - 1 && self.value_bytes(x) / f > d.transpose_cached_bytes
            }
            _ => false,
        };
        let stride_factor = if strided { 1.0 / d.transpose_efficiency.clamp(0.01, 1.0) } else { 1.0 };
        let bytes = (act_bytes + param_local) * stride_factor;
        // A convolution launches what the runtime's convolution kernels launch at this shape.
        let conv_launches = self.conv_launches(n, ins, outs);
        let launch = self.launch() * conv_launches.map_or(c.launches.max(1.0), |l| l[0]);
        // GEMMs and convolutions reach less of peak when small or skinny. The backward GEMMs
        // have the same three extents, permuted: of an `m × n` output over `k`, the input's
        // gradient is `m × k` over `n` (a convolution's runs transposed, `k × m`), the
        // weight's `k × n` over `m` — a convolution's each at its own shape's efficiency, as
        // the training program prices its gradient ops.
        let shape = self.gemm_shape(n, ins, outs);
        let eff = shape.map_or(d.efficiency, |(m, nn, k, b)| d.batched_gemm_efficiency(m, nn, k, b));
        // A MatMul or Gemm that is one product (a shared B folds A's batch into its rows)
        // splits a long reduction into a second dispatch, its forward and each gradient GEMM
        // by its own reduction (the input's over `n`, the weight's over the rows `m`).
        let split = |k: f64| ir::ops::contraction::gemm_dispatches(1, k as usize) as f64 - 1.0;
        let (fwd_split, bwd_split) = match (&node.op, shape) {
            (Op::MatMul(_) | Op::Gemm(_), Some((m, nn, k, _))) if self.one_product(n, ins) => {
                (split(k), split(nn) + split(m))
            }
            _ => (0.0, 0.0),
        };
        // A convolution's gradients run kernels of their own, at their own rate.
        let grad_rate = if matches!(node.op, Op::Conv(_)) { d.conv_grad_efficiency } else { 1.0 };
        let or_gemm = |e: f64| if e > 0.0 { e } else { eff };
        let (fwd_eff, bwd_eff) = match &node.op {
            Op::ConvGradInput(_) | Op::ConvGradWeight(_) => (eff * d.conv_grad_efficiency, eff),
            // A fused attention kernel at its own published rate.
            Op::Attention(_) | Op::AttentionBlock(_) => {
                (or_gemm(d.attention_efficiency[0]), or_gemm(d.attention_efficiency[1]))
            }
            // Flash attention's backward kernel, at the published backward rate.
            Op::AttentionGrad(_) => (or_gemm(d.attention_efficiency[1]), or_gemm(d.attention_efficiency[1])),
            _ => (eff, eff * grad_rate),
        };
        let bwd_flops = (c.bwd_data_flops + c.bwd_weight_flops) / f;
        // A statistic split the lowering expands into several kernels (synchronised batch
        // normalization) runs those kernels: their launches and their passes over the local
        // input, as the lowering emits them.
        let expansion = mode.and_then(|m| m.expansion(node));
        if let Some((e, grad)) = expansion {
            let x = node.input(SplitMode::main_input(node)).map_or(0.0, |v| self.value_bytes(v) / f);
            let run = |flops: f64, e: ir::ops::split::Expansion, eff: f64| {
                self.roofline_with(peak, flops, e.passes as f64 * x, eff) + self.launch() * e.launches as f64
            };
            let fwd = run(c.fwd_flops / f, e, fwd_eff);
            let bwd = grad.map_or(0.0, |ge| if bwd_flops > 0.0 { run(bwd_flops, ge, bwd_eff) } else { 0.0 });
            return (fwd, bwd);
        }
        // What this device's kernels for the op take against their roofline (measured; the
        // launches are priced on their own), by the kernel it runs in (a fused group's
        // members: the fused kernels'). A strided transpose has its own measured rate
        // (`transpose_efficiency`) instead: the factor is measured on transposes that stream.
        let kernel = if strided { 1.0 } else { d.kernel_factors.get(&self.kernel_kind(n)).copied().unwrap_or(1.0) };
        // A kernel with fewer invocations than fill the device runs at that share of it.
        let fill = self.underfill(c.parallel / f);
        let fwd = self.roofline_with(peak, c.fwd_flops / f, bytes, fwd_eff) * kernel * fill
            + launch
            + fwd_split * self.launch();
        let bwd = match shape {
            _ if bwd_flops <= 0.0 => 0.0,
            // The two gradient GEMMs, each reading and writing about what the op does (a
            // convolution's: the runtime's gradient kernels are GEMMs of exactly these shapes;
            // a MatMul's batched and broadcast gradients fold their batch dims into rows the
            // forward shape does not show, so they keep the forward's efficiency).
            // Each at its gradient kernel's measured rate, as the training program prices it.
            Some((m, nn, k, _)) if matches!(node.op, Op::Conv(_)) => {
                let factor = |k: &str| d.kernel_factors.get(k).copied().unwrap_or(1.0);
                self.roofline_with(peak, c.bwd_data_flops / f, bytes, d.gemm_efficiency(m, k, nn) * grad_rate)
                    * factor("ConvGradInput")
                    + self.roofline_with(peak, c.bwd_weight_flops / f, bytes, d.gemm_efficiency(k, nn, m) * grad_rate)
                        * factor("ConvGradWeight")
                    + conv_launches.map_or(2.0 * launch, |l| (l[1] + l[2]) * self.launch())
            }
            _ => {
                // An op whose gradient is a kernel of its own runs at that kernel's rate.
                let grad_kernel = node.op.rules().grad_kernel().and_then(|k| d.kernel_factors.get(k)).copied();
                self.roofline_with(peak, bwd_flops, 2.0 * bytes, bwd_eff) * grad_kernel.unwrap_or(1.0)
                    + 2.0 * launch
                    + bwd_split * self.launch()
            }
        };
        match mode {
            // Ring attention: the busiest device's share, and the gradient's recomputed blocks.
            Some(SplitMode::Ring { axis }) => {
                let imbalance = ring::ring_imbalance(&node.op, self.mesh.axes[*axis].size, self.ring_zigzag(n, *axis));
                let (d, dv) = self.head_sizes(n);
                let again = ring::ring_grad_factor(&node.op, d, dv);
                match node.op {
                    Op::AttentionGrad(_) => (fwd * imbalance * again, bwd),
                    _ => (fwd * imbalance, bwd * imbalance * again),
                }
            }
            _ => (fwd, bwd),
        }
    }

    /// The halo exchanges and statistics all-reduces `n` runs under `strategy`, forward then
    /// backward: exactly what the lowering emits for its [`SplitMode`].
    pub(super) fn op_comm(
        &self,
        n: NodeId,
        strategy: &[Option<usize>],
        mode: Option<&SplitMode>,
        ins: &[Option<Sharding>],
    ) -> Vec<(Phase, Step)> {
        let node = self.g.node(n);
        let Some(mode) = mode else { return Vec::new() };
        let Some(x) = node.input(0) else { return Vec::new() };
        let (dims, eb) = self.value_shape(x);
        let layout = ins.first().cloned().flatten().unwrap_or_else(|| vec![AxisShard::Replicate; self.mesh.axes.len()]);
        let local = ir::reshard::local_dims(&dims, &layout, &self.mesh);
        let mut out = Vec::new();
        match mode {
            SplitMode::Halo(splits) => {
                let steps = self.halo_steps(splits, &local, eb);
                out.extend(steps.iter().cloned().map(|s| (Phase::Forward, s)));
                out.extend(steps.into_iter().map(|s| (Phase::Backward, s)));
            }
            SplitMode::Softmax { .. } | SplitMode::LayerNorm { .. } | SplitMode::BatchNorm { .. } => {
                let stat: Vec<usize> = match mode {
                    SplitMode::Softmax { axes, .. } | SplitMode::BatchNorm { stat: axes, .. } => axes.clone(),
                    SplitMode::LayerNorm { axis } => (*axis..local.len()).collect(),
                    _ => unreachable!(),
                };
                let axes: Vec<usize> =
                    (0..strategy.len()).filter(|&a| strategy[a].is_some_and(|i| stat.contains(&i))).collect();
                let elems: i64 = local.iter().enumerate().filter(|(d, _)| !stat.contains(d)).map(|(_, &e)| e).product();
                let ar = CommStep { kind: StepKind::AllReduce, axes, bytes: elems as f64 * eb, to: layout };
                let Some(step) = price(&ar, 1.0, &self.mesh, self.cluster) else { return out };
                let (f, b) = mode.stat_all_reduces();
                out.extend(std::iter::repeat_n((Phase::Forward, step.clone()), f));
                out.extend(std::iter::repeat_n((Phase::Backward, step), b));
            }
            SplitMode::Loss { ignore_index: Some(_) } => {
                // The count of the samples that count: one scalar all-reduce.
                let axes: Vec<usize> = (0..strategy.len()).filter(|&a| strategy[a].is_some()).collect();
                let ar = CommStep { kind: StepKind::AllReduce, axes, bytes: eb, to: layout };
                if let Some(step) = price(&ar, 1.0, &self.mesh, self.cluster) {
                    let (f, b) = mode.stat_all_reduces();
                    out.extend(std::iter::repeat_n((Phase::Forward, step.clone()), f));
                    out.extend(std::iter::repeat_n((Phase::Backward, step), b));
                }
            }
            SplitMode::Ring { axis } => out.extend(self.ring_steps(n, *axis, self.strategy_factor(n, strategy), ins)),
            SplitMode::Dispatch { axis, capacity } => out.extend(self.dispatch_steps(n, *axis, *capacity, &layout)),
            SplitMode::Direct
            | SplitMode::VocabGather
            | SplitMode::Experts { .. }
            | SplitMode::Loss { ignore_index: None } => {}
        }
        out
    }

    /// One halo step per split spatial dim, as the lowering exchanges them in turn: every
    /// device sends its neighbours the rows their windows read (a slab of the tensor as it is
    /// after the earlier exchanges); the step takes as long as its busiest device.
    pub(super) fn halo_steps(&self, splits: &[ir::ops::split::SpatialSplit], local: &[i64], eb: f64) -> Vec<Step> {
        let devices = self.mesh.devices();
        let coords: Vec<Vec<usize>> = (0..devices).map(|d| self.mesh.coords(d)).collect();
        let mut cur: Vec<Vec<i64>> = vec![local.to_vec(); devices];
        let mut steps = Vec::new();
        for h in splits {
            let level = self.mesh.axes[h.axis].level;
            let mut by_device = vec![0.0; devices];
            // Through the host: the busiest device's tensor down and the widened one back.
            let mut staged: f64 = 0.0;
            for d in 0..devices {
                let hw = &h.halos[coords[d][h.axis]];
                let before = cur[d].iter().map(|&e| e as f64).product::<f64>() * eb;
                let slab: f64 = cur[d]
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != h.tensor_dim)
                    .map(|(_, &e)| e as f64)
                    .product::<f64>()
                    * eb;
                by_device[d] = (hw.to_prev + hw.to_next) as f64 * slab;
                let t = &mut cur[d][h.tensor_dim];
                *t += (hw.from_prev + hw.from_next) as i64 - (hw.trim_start + hw.trim_end) as i64;
                let after = cur[d].iter().map(|&e| e as f64).product::<f64>() * eb;
                staged = staged.max(collective::staging(self.cluster, before, after, self.busy()));
            }
            let moved = by_device.iter().copied().fold(0.0, f64::max);
            if moved <= 0.0 {
                continue;
            }
            let (alpha, beta) = alpha_beta(self.cluster, level, 2, self.busy(), moved);
            steps.push(Step {
                kind: CommKind::Halo,
                axes: vec![h.axis],
                group: self.mesh.axes[h.axis].size,
                bytes: moved,
                moved,
                moved_by_device: Some(by_device),
                latency: alpha + collective::staging(self.cluster, 0.0, 0.0, self.busy()),
                time: p2p(moved, alpha, beta) + staged,
            });
        }
        steps
    }

    /// The kind of kernel the runtime reports `n`'s time under: `Fused` for a member of a
    /// fusion group on a device that fuses ([`CostModel::fusion_saving`]), else its op type.
    pub fn kernel_kind(&self, n: NodeId) -> String {
        if self.cluster.device.fused_elementwise && self.fused.contains_key(&n) {
            ir::fusion::FUSED.into()
        } else {
            self.g.node(n).op.op_type().into()
        }
    }

    /// What running `n` inside its fusion group saves against running it alone, where the
    /// device fuses ([`super::super::cluster::Device::fused_elementwise`]): the launch of a
    /// member that is not the group's root, the write of a value the kernel keeps in
    /// registers and every read of it by another member.
    fn fusion_saving(&self, n: NodeId, s: &[Option<usize>]) -> f64 {
        let Some(m) = self.fused.get(&n).filter(|_| self.cluster.device.fused_elementwise) else { return 0.0 };
        let bytes = self.value_bytes(Value::new(n, 0)) / self.strategy_factor(n, s);
        let passes = usize::from(!m.written) + m.reads;
        let launch = if m.root { 0.0 } else { self.launch() };
        launch + passes as f64 * bytes / self.mem_bandwidth()
    }

    pub(super) fn op_eval(&self, n: NodeId, s: &[Option<usize>]) -> Rc<OpEval> {
        if let Some(e) = self.op_memo.borrow().get(&(n, s.to_vec())) {
            return e.clone();
        }
        let (ins, outs) = strategy_shardings(&self.spaces[&n], s);
        let mode = split_mode(self.g, n, &self.spaces[&n], s, &self.mesh).ok();
        let (fwd, mut bwd) = self.compute_time(n, s, mode.as_ref(), &ins, &outs);
        let fwd = (fwd - self.fusion_saving(n, s)).max(0.0);
        let mut comm = self.op_comm(n, s, mode.as_ref(), &ins);
        if self.phases.is_some() {
            // A training graph's op runs once: its own work and communication, in its phase.
            bwd = 0.0;
            let phase = self.phase(n);
            comm = comm.into_iter().filter(|(p, _)| *p == Phase::Forward).map(|(_, st)| (phase, st)).collect();
        }
        let mut time = OpTime { fwd, bwd, ..OpTime::default() };
        for (phase, st) in &comm {
            match st.kind {
                CommKind::Halo => time.halo += st.time,
                _ => time.stats += st.time,
            }
            if *phase != Phase::Backward || self.phases.is_some() {
                time.comm_fwd += st.time;
            }
        }
        let reduces_param_grads = matches!(mode, Some(ir::ops::split::SplitMode::BatchNorm { .. }));
        let e = Rc::new(OpEval { strategy: s.to_vec(), time, ins, outs, comm, reduces_param_grads });
        self.op_memo.borrow_mut().insert((n, s.to_vec()), e.clone());
        e
    }
}
