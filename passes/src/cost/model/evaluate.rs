//! Pricing an assignment: reshards between layouts, the forward model's step and the training
//! graph's step (time, memory, communication events).

use super::*;

impl<'a> CostModel<'a> {
    /// The global dims of a value and the bytes of one element in training precision (a
    /// value without a static shape counts as a flat buffer).
    pub(super) fn value_shape(&self, v: Value) -> (Vec<i64>, f64) {
        let Some(t) = self.g.tensor_type(v) else { return (vec![0], 1.0) };
        let eb = t.dtype.size_bytes() as f64 * if t.dtype.is_float() { self.precision_factor() } else { 1.0 };
        match t.static_dims() {
            Some(d) => (d, eb),
            None => (vec![(self.value_bytes(v) / eb.max(1e-30)).round() as i64], eb),
        }
    }

    /// The priced steps that reshard `v` from `from` to `to`, bytes scaled by `scale`.
    pub fn reshard(&self, v: Value, from: &Sharding, to: &Sharding, scale: f64) -> Rc<[Step]> {
        self.reshard_both(v, from, to, scale).0
    }

    /// The seconds of the local steps of a resharding (the algebra's slices and zeroings):
    /// no bytes cross a link, but the device runs a kernel for each, reading and writing its
    /// piece — a launch and a memory-bound pass, as the lowering's `Slice` and `Mul` run.
    pub fn reshard_local(&self, v: Value, from: &Sharding, to: &Sharding) -> f64 {
        self.reshard_both(v, from, to, 1.0).1
    }

    /// Whether bringing a value from layout `from` to `to` makes a new array: the layouts
    /// differ on an axis of more than one device (on an axis of one, a split or a partial sum
    /// is the whole value, which the runtime hands on).
    pub(super) fn copies_on(&self, from: &Sharding, to: &Sharding) -> bool {
        self.mesh.axes.iter().zip(from.iter().zip(to)).any(|(a, (f, t))| a.size > 1 && f != t)
    }

    /// [`CostModel::reshard`] and [`CostModel::reshard_local`], memoised together.
    pub(super) fn reshard_both(&self, v: Value, from: &Sharding, to: &Sharding, scale: f64) -> Resharded {
        if from == to {
            return (Rc::from(Vec::new()), 0.0);
        }
        let key = pack(from).zip(pack(to)).map(|(f, t)| (v, f, t, scale.to_bits()));
        if let Some(st) = key.as_ref().and_then(|k| self.reshard_memo.borrow().get(k).cloned()) {
            return st;
        }
        let (dims, eb) = self.value_shape(v);
        let algebra = ir::reshard::reshard(&dims, eb, from, to, &self.mesh, self.policy);
        let steps: Rc<[Step]> =
            super::collective::price_steps(&algebra, scale, &self.mesh, self.cluster, self.busy()).into();
        let whole = dims.iter().map(|&d| d.max(0) as f64).product::<f64>() * eb;
        let local: f64 = algebra
            .iter()
            .filter(|s| !s.kind.communicates())
            .map(|s| self.launch() + 2.0 * whole / split_factor(&s.to, &self.mesh) / self.mem_bandwidth())
            .sum();
        let both = (steps, local);
        if let Some(key) = key {
            self.reshard_memo.borrow_mut().insert(key, both.clone());
        }
        both
    }

    /// The strategy of `n` in an assignment (replicated when absent).
    pub fn strategy_of<'s>(&self, asg: &'s Assignment, n: NodeId) -> std::borrow::Cow<'s, [Option<usize>]> {
        match asg.strategies.get(&n) {
            Some(s) => std::borrow::Cow::Borrowed(s.as_slice()),
            None => std::borrow::Cow::Owned(vec![None; self.mesh.axes.len()]),
        }
    }

    /// Prices a whole assignment.
    pub fn evaluate(&self, asg: &Assignment) -> Breakdown {
        self.evaluate_with(asg, true)
    }

    /// Prices an assignment without the per-op rows and the communication events (for
    /// searches that price many plans): every other field is as [`CostModel::evaluate`]'s.
    pub fn price(&self, asg: &Assignment) -> Breakdown {
        self.evaluate_with(asg, false)
    }

    pub(super) fn evaluate_with(&self, asg: &Assignment, detail: bool) -> Breakdown {
        if self.phases.is_some() {
            return self.evaluate_training(asg, detail);
        }
        let g = self.g;
        let mesh = &self.mesh;
        let evals: Vec<Rc<OpEval>> = self.order.iter().map(|&n| self.op_eval(n, &self.strategy_of(asg, n))).collect();
        let (out_sh, storage) = self.layouts(&evals, &ir::reshard::ZeroLayouts::default());
        let replicated: Sharding = vec![AxisShard::Replicate; mesh.axes.len()];
        let have =
            |v: Value| -> &Sharding { out_sh.get(&v).copied().or_else(|| storage.get(&v)).unwrap_or(&replicated) };

        let mut w = Walk::new(detail, self.order.len());
        let mut edges = Edges::default();
        let (mut fwd_total, mut compute_total, mut comm_total, mut activations) = (0.0, 0.0, 0.0, 0.0);
        let mut bwd_items: Vec<(NodeId, f64)> = Vec::with_capacity(self.order.len());
        // Gradient accumulation: a micro-batch's values are 1/k of the batch's.
        let k = self.opts.accumulation.max(1) as f64;
        let micro_local = |v: Value| self.value_bytes(v) / split_factor(have(v), mesh) / k;
        for (pos, (&n, e)) in self.order.iter().zip(&evals).enumerate() {
            let node = g.node(n);
            let t = e.time;
            let (fwd_comm, bwd_comm, grad_sum) =
                self.op_edges(&mut w, &mut edges, pos, n, e, &have, &|v| out_sh.contains_key(&v));
            let (fwd_comm, bwd_comm) =
                self.tp_overlapped(n, fwd_comm, bwd_comm, &|m| self.op_eval(m, &self.strategy_of(asg, m)).time);
            self.record_op_comm(&mut w, n, e, &have);
            // Accumulating over k micro-batches launches each kernel k times.
            let relaunch = if is_view(&node.op) || is_host(&node.op) { 0.0 } else { (k - 1.0) * self.launch() };
            fwd_total += t.fwd + fwd_comm + t.comm_fwd + relaunch;
            // A recomputed op runs its forward (and its forward communication) again inside
            // the backward pass.
            let again = if self.stash.as_ref().is_some_and(|s| s.recomputed.contains(&n)) { t.fwd } else { 0.0 };
            let again_comm = if again > 0.0 { fwd_comm + t.comm_fwd } else { 0.0 };
            let bwd_compute = t.bwd + grad_sum + again;
            compute_total += t.fwd + bwd_compute;
            let op_comm = fwd_comm + bwd_comm + t.halo + t.stats + again_comm;
            comm_total += op_comm;
            bwd_items.push((n, bwd_compute + bwd_comm + t.comm_bwd() + again_comm + relaunch));
            let kept = self.kept_by(n, &micro_local, &mut w.workspace);
            // (A mixture's step includes its backward, whose kernels hold the most.)
            w.workspace = w.workspace.max(self.scratch(n, &e.strategy, true, k));
            activations += kept;
            if detail {
                w.rows.push(OpRow {
                    name: row_name(node),
                    op: node.op.op_type().to_string(),
                    strategy: self.describe_strategy(n, &e.strategy),
                    compute_s: t.fwd + bwd_compute,
                    communication_s: op_comm,
                    memory_bytes: kept,
                    forward_s: t.fwd + fwd_comm + t.comm_fwd,
                    backward_s: bwd_compute + bwd_comm + t.comm_bwd(),
                    param_memory_bytes: 0.0,
                    grad_memory_bytes: 0.0,
                    weight_memory_bytes: 0.0,
                    grad_sync_s: 0.0,
                    update_s: 0.0,
                });
            }
        }
        // Graph outputs end reduced and cut only along their batch and sequence dims (what a
        // loss or the host reads); the collectives that make them so are part of the forward
        // pass.
        let deliveries = self.deliveries(&have, &storage, &ir::reshard::ZeroLayouts::default());
        let out_comm: f64 = self.output_comm(&mut w, &edges, &have, &deliveries).iter().sum();
        fwd_total += out_comm;
        comm_total += out_comm;

        if let Some(st) = &self.stash {
            activations += st.transient_bytes(&micro_local);
        }
        let mut grads = self.gradient_sync(&mut w, &edges, &storage);
        let (ways, gather) = self.zero_sync(&mut w, &mut grads);
        let params = self.parameters(&mut w, &edges, &storage, &ways);
        w.workspace += params.gathered;
        w.bwd_events.reverse();
        let mut events = std::mem::take(&mut w.events);
        events.append(&mut w.bwd_events);
        let mut sync_events = std::mem::take(&mut w.sync_events);
        sync_events.sort_by_key(|e| e.value);
        events.extend(sync_events);
        // Synchronisation overlaps the last micro-batch's backward pass only.
        let last: Vec<(NodeId, f64)> = bwd_items.iter().map(|&(n, t)| (n, t / k)).collect();
        let (last_bwd, grad_sync, exposed) = self.backward_timeline(&mut w, &last, &grads);
        let bwd_total = last_bwd * k;
        comm_total += grad_sync;
        // ZeRO-3 gathers the parameters for every micro-batch.
        let gather = if self.opts.zero >= 3 { gather * k } else { gather };
        let gather_exposed = self.zero_gather_exposed(gather, fwd_total, bwd_total, fwd_total / k);
        let gathers = if self.opts.zero >= 3 { 2.0 * gather } else { gather };
        comm_total += gathers;

        // Optimizer update: memory-bound traffic over the local parameters, one kernel per
        // parameter (the runtime's `SgdUpdate`/`AdamUpdate` per parameter, as the training
        // program prices them).
        let update =
            params.elems * self.update_bytes_per_elem() / self.mem_bandwidth() + self.launch() * params.count as f64;

        // Host→device input.
        let (input_transfer, input_bytes) = self.input_time(&storage, mesh);
        let before_input = fwd_total + bwd_total + exposed + gather_exposed + update;
        let input_exposed = if self.opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };

        let memory = Memory {
            weights: params.bytes,
            gradients: params.trained_bytes,
            optimizer: params.elems * self.optimizer_bytes_per_elem(),
            activations,
            workspace: w.workspace,
        };
        let capacity = self.capacity();
        let total = memory.total();
        let feasible = total <= capacity;
        let infeasible_reason = (!feasible).then(|| overflow_reason(&memory, capacity));
        let bytes_moved_per_device = if detail { bytes_moved_per_device(&events, mesh) } else { BTreeMap::new() };
        Breakdown {
            step_time_s: before_input + input_exposed,
            compute_s: compute_total,
            forward_s: fwd_total,
            backward_s: bwd_total,
            update_s: update,
            communication_s: comm_total,
            communication_by_kind: w.by_kind(),
            gradient_sync_s: grad_sync + gathers,
            exposed_gradient_sync_s: exposed + gather_exposed,
            bubble_s: 0.0,
            input_s: input_exposed,
            input_transfer_s: input_transfer,
            input_bytes,
            memory_per_device_bytes: vec![total as u64; mesh.devices()],
            memory,
            memory_capacity_bytes: capacity as u64,
            feasible,
            infeasible_reason,
            ops: w.rows,
            events,
            bytes_moved_per_device,
            policy: self.policy,
        }
    }

    /// The activation bytes op `n` keeps for the backward pass on one device, with `local`
    /// the bytes of a value there: the outputs the stash keeps ([`crate::cost::stash`]), or, for a
    /// model that cannot be differentiated, every output of an op that computes something.
    /// Raises `workspace` to the largest computed output.
    pub(super) fn kept_by(&self, n: NodeId, local: &dyn Fn(Value) -> f64, workspace: &mut f64) -> f64 {
        let node = self.g.node(n);
        if is_view(&node.op) || is_host(&node.op) {
            return 0.0;
        }
        let mut kept = 0.0;
        for slot in 0..node.num_outputs() {
            let v = Value::new(n, slot as u16);
            if self.g.value_name(v).is_empty() {
                continue;
            }
            let b = local(v);
            *workspace = workspace.max(b);
            if self.stash.as_ref().is_none_or(|s| s.kept.contains(&v)) {
                kept += b;
            }
        }
        kept
    }

    /// The transient storage op `n`'s kernels allocate beyond its outputs under `strategy`,
    /// bytes on one device for a micro-batch of `1/k` of the batch: a mixture of experts' per
    /// routed pair it reads (every gathered pair, those routed to other devices' experts too),
    /// as the WGSL kernels hold it in f32 — the gate and up halves (`MoE`); those, the down
    /// gradient and the gate-and-up gradient (`MoEGrad`, or `MoE` with `backward`); ring
    /// attention's blocks in flight ([`CostModel::ring_scratch`]).
    pub(super) fn scratch(&self, n: NodeId, strategy: &[Option<usize>], backward: bool, k: f64) -> f64 {
        let node = self.g.node(n);
        let (slot, w2, per_pair) = match node.op {
            Op::MoE(_) => (1, node.input(4), if backward { 5.0 } else { 2.0 }),
            Op::MoEGrad(_) => (2, node.input(5), 5.0),
            _ => return self.ring_scratch(n, strategy, backward, k),
        };
        let (Some(ids), Some(w2)) = (node.input(slot), w2) else { return 0.0 };
        let (ins, _) = ir::shard::strategy_shardings(self.space(n), strategy);
        let parts = ins.get(slot).cloned().flatten().map_or(1.0, |l| split_factor(&l, &self.mesh));
        let (_, eb) = self.value_shape(ids);
        let inner = self.value_shape(w2).0.get(2).copied().unwrap_or(0) as f64;
        // Under the all-to-all dispatcher the experts run on the buffer's rows received, and
        // the buffers are held beside them.
        let (pairs, buffers) = match split_mode(self.g, n, self.space(n), strategy, &self.mesh) {
            Ok(SplitMode::Dispatch { axis, capacity }) => (
                (self.mesh.axes[axis].size * capacity) as f64 / k.max(1.0),
                self.dispatch_scratch(n, (axis, capacity), backward, k),
            ),
            _ => (self.value_bytes(ids) / parts / k.max(1.0) / eb.max(1.0), 0.0),
        };
        pairs * inner * per_pair * 4.0 + buffers
    }

    /// Prices a training graph as it runs: each op once, in its phase
    /// ([`ir::reshard::step_phases`]); the collectives its layouts need, tagged with the phase
    /// of the op that reads them (what the lowering emits, tagged the same); no backward pass
    /// or optimizer update added, since the graph has them. Gradient synchronisation is the
    /// resharding of the gradients into the updates, exposed whole (the runtime runs it where
    /// the update reads it). Memory by liveness over the op order: initializers (parameters,
    /// optimizer state) for the whole step, every other value from its op to its last reader
    /// (graph outputs to the end); the peak is what the step needs.
    pub(super) fn evaluate_training(&self, asg: &Assignment, detail: bool) -> Breakdown {
        let g = self.g;
        let mesh = &self.mesh;
        let evals: Vec<Rc<OpEval>> = self.order.iter().map(|&n| self.op_eval(n, &self.strategy_of(asg, n))).collect();
        let zero = self.zero_layouts(&evals);
        let (out_sh, storage) = self.layouts(&evals, &zero);
        let replicated: Sharding = vec![AxisShard::Replicate; mesh.axes.len()];
        let have =
            |v: Value| -> &Sharding { out_sh.get(&v).copied().or_else(|| storage.get(&v)).unwrap_or(&replicated) };
        let local = |v: Value| self.value_bytes(v) / split_factor(have(v), mesh);
        let fixed = |v: Value| matches!(g.node(v.node).op, Op::Input { .. } | Op::Initializer(_) | Op::OuterRef);
        let deliveries = self.deliveries(&have, &storage, &zero);
        let copies = self.copies(&evals, &have, &|v| out_sh.contains_key(&v), &deliveries, &zero);
        // Outputs are held to the end, but for those delivered in a layout a reader made
        // before (a ZeRO gradient's shard): that copy is, the value itself only to its reader.
        let outputs: FxHashSet<Value> =
            g.outputs().iter().map(|o| o.value).filter(|v| !copies.delivered_early.contains(v)).collect();

        let mut w = Walk::new(detail, self.order.len());
        let mut edges = Edges::default();
        // Per phase (forward, backward, gradient): compute and communication seconds.
        let (mut compute, mut comm) = ([0.0f64; 3], [0.0f64; 3]);
        let (mut live, mut peak) = (0.0f64, 0.0f64);
        let mut prev = None;
        for (pos, (&n, e)) in self.order.iter().zip(&evals).enumerate() {
            let node = g.node(n);
            let phase = self.phase(n);
            // ZeRO-3 parameters gathered for the forward pass are gathered again after it.
            if ir::reshard::ZeroLayouts::ends_forward(prev, Some(phase)) {
                edges.materialized.retain(|(v, l)| !zero.regathered(*v) || storage.get(v) == Some(*l));
            }
            prev = Some(phase);
            live += copies.made[pos];
            let (edge_comm, _, _) = self.op_edges(&mut w, &mut edges, pos, n, e, &have, &|v| out_sh.contains_key(&v));
            self.record_op_comm(&mut w, n, e, &have);
            let op_comm = edge_comm + e.time.comm_fwd;
            compute[phase as usize] += e.time.fwd;
            comm[phase as usize] += op_comm;
            let mut made = 0.0;
            for slot in 0..node.num_outputs() {
                let v = Value::new(n, slot as u16);
                if !g.value_name(v).is_empty() {
                    made += local(v);
                }
            }
            w.workspace = w.workspace.max(made + self.scratch(n, &e.strategy, false, 1.0));
            live += made;
            peak = peak.max(live);
            for v in &copies.frees[pos] {
                if !fixed(*v) && !outputs.contains(v) {
                    live -= local(*v);
                }
            }
            for slot in 0..node.num_outputs() {
                let v = Value::new(n, slot as u16);
                if !g.value_name(v).is_empty() && !copies.read.contains(&v) && !outputs.contains(&v) {
                    live -= local(v);
                }
            }
            live -= copies.freed[pos];
            if detail {
                w.rows.push(OpRow {
                    name: row_name(node),
                    op: self.kernel_kind(n),
                    strategy: self.describe_strategy(n, &e.strategy),
                    compute_s: e.time.fwd,
                    communication_s: op_comm,
                    memory_bytes: made,
                    forward_s: if phase == Phase::Forward { e.time.fwd + op_comm } else { 0.0 },
                    backward_s: if phase == Phase::Backward { e.time.fwd + op_comm } else { 0.0 },
                    param_memory_bytes: 0.0,
                    grad_memory_bytes: 0.0,
                    weight_memory_bytes: 0.0,
                    grad_sync_s: if phase == Phase::Gradient { op_comm } else { 0.0 },
                    update_s: if phase == Phase::Gradient { e.time.fwd } else { 0.0 },
                });
            }
        }
        let out_comm = self.output_comm(&mut w, &edges, &have, &deliveries);
        for (c, o) in comm.iter_mut().zip(out_comm) {
            *c += o;
        }
        // The outputs delivered in another layout at the end, beside what is held then.
        peak = peak.max(live + copies.at_end);
        w.events.append(&mut w.bwd_events);

        // Held for the whole step: parameters (trainable initializers), the optimizer's and
        // the normalizations' state, and the graph's inputs.
        let trainable: FxHashSet<Value> = ir::train::gradient_outputs(g).into_iter().map(|(_, p)| p).collect();
        let (mut weights, mut state, mut inputs) = (0.0, 0.0, 0.0);
        for v in storage.keys().copied().filter(|&v| fixed(v)) {
            match g.node(v.node).op {
                Op::Initializer(_) if trainable.contains(&v) => weights += local(v),
                Op::Initializer(_) => state += local(v),
                _ => inputs += local(v),
            }
        }
        let (input_transfer, input_bytes) = self.input_time(&storage, mesh);
        let [fwd, bwd, grad] = [0, 1, 2].map(|p| compute[p] + comm[p]);
        let before_input = fwd + bwd + grad;
        let input_exposed = if self.opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };
        let memory =
            Memory { weights, gradients: 0.0, optimizer: state, activations: peak + inputs, workspace: w.workspace };
        let capacity = self.capacity();
        let total = memory.total();
        let feasible = total <= capacity;
        let bytes_moved_per_device = if detail { bytes_moved_per_device(&w.events, mesh) } else { BTreeMap::new() };
        Breakdown {
            step_time_s: before_input + input_exposed,
            compute_s: compute[0] + compute[1],
            forward_s: fwd,
            backward_s: bwd,
            update_s: compute[2],
            communication_s: comm.iter().sum(),
            communication_by_kind: w.by_kind(),
            gradient_sync_s: comm[2],
            exposed_gradient_sync_s: comm[2],
            bubble_s: 0.0,
            input_s: input_exposed,
            input_transfer_s: input_transfer,
            input_bytes,
            memory_per_device_bytes: vec![total as u64; mesh.devices()],
            infeasible_reason: (!feasible).then(|| overflow_reason(&memory, capacity)),
            memory,
            memory_capacity_bytes: capacity as u64,
            feasible,
            ops: w.rows,
            events: w.events,
            bytes_moved_per_device,
            policy: self.policy,
        }
    }
}
