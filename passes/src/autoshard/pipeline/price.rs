//! Pricing pipelines: every cut of the units into stages priced on the stage tables, and a named configuration or given stages priced as the search prices its own.

use super::*;

/// Units the uniform dynamic program works on (ops are grouped beyond this).
pub(super) const FINE_UNITS: usize = 512;
/// Units the dynamic program over stage sizes works on.
pub(super) const COARSE_UNITS: usize = 96;
/// Units a configuration's stages are cut from (`price_configuration`: `cost --strategy` and
/// the configuration grid): about two per block of the largest models planned (GPT 1T's 128
/// layers), a quarter of the uniform program's work at [`FINE_UNITS`]; and at least four per
/// model chunk (stages × virtual stages), up to [`FINE_UNITS`], so chunks still balance.
pub(super) const CONFIG_UNITS: usize = 256;

/// Unit boundaries: every op its own unit when there are at most `max` ops, else runs of
/// consecutive ops of about equal time.
pub(super) fn unit_bounds(t: &Table, max: usize) -> Vec<usize> {
    let n = t.fwd.len();
    if n <= max {
        return (0..=n).collect();
    }
    let time: Vec<f64> = (0..n).map(|i| t.fwd[i] + t.bwd[i]).collect();
    let total: f64 = time.iter().sum();
    let target = total / max as f64;
    let mut bounds = vec![0];
    let mut acc = 0.0;
    for (i, x) in time.iter().enumerate() {
        acc += x;
        if acc >= target && i + 1 < n && bounds.len() < max {
            bounds.push(i + 1);
            acc = 0.0;
        }
    }
    bounds.push(n);
    bounds
}

/// Bytes per device each stage (ops `ranges[s]` of `order`) holds for the parameters it
/// shares with other stages (tied weights, as a language model's embedding and output
/// projection): a later reader holds its own copy of the weight and of its gradient (and the
/// gradient's accumulator with several micro-batches); the first reader receives each later
/// reader's gradient and sums it into its own in the backward (the received gradient and the
/// sum beside its own). Returns what each stage holds for the whole step and what it holds
/// while it sums in its backward.
pub(super) fn shared_params(
    gm: &Graph,
    order: &[NodeId],
    ranges: &[(usize, usize)],
    micro: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut readers: HashMap<Value, Vec<usize>> = HashMap::new();
    for (st, &(a, b)) in ranges.iter().enumerate() {
        for &n in &order[a.min(order.len())..b.min(order.len())] {
            for v in gm.node(n).inputs().iter().flatten().filter(|v| ir::cost::is_param(gm, **v)) {
                let r = readers.entry(*v).or_default();
                if !r.contains(&st) {
                    r.push(st);
                }
            }
        }
    }
    let (mut held, mut summing) = (vec![0.0; ranges.len()], vec![0.0; ranges.len()]);
    for (v, stages) in readers.iter().filter(|(_, s)| s.len() > 1) {
        let bytes = gm.tensor_type(*v).and_then(|t| t.size_bytes()).unwrap_or(0) as f64;
        summing[stages[0]] += 2.0 * bytes;
        for &st in &stages[1..] {
            held[st] += bytes * if micro > 1 { 3.0 } else { 2.0 };
        }
    }
    (held, summing)
}

/// Prices a partition (stages of units `cuts`, sizes `sizes[cut.size]`) as a whole step.
#[allow(clippy::too_many_arguments)]
pub(super) fn price_cuts(
    gm: &Graph,
    g: &Graph,
    cluster: &Cluster,
    opts: &Options,
    tables: &HashMap<(usize, i64), Table>,
    sizes: &[usize],
    cuts: &[Cut],
    bounds: &[usize],
    mb: i64,
    s: usize,
    m: usize,
    schedule: Schedule,
    capacity: f64,
    meshes: &HashMap<usize, Mesh>,
    recompute: bool,
) -> Option<PipelinePlan> {
    let order = g.op_nodes().ok()?;
    let names: HashMap<String, NodeId> =
        order.iter().filter_map(|&n| Some((g.node(n).outputs().first()?.name.clone(), n))).collect();
    let gm_order = gm.op_nodes().ok()?;
    let devices: usize = cuts.iter().map(|c| sizes[c.size]).sum();
    let link = |a: usize, b: usize, n: f64| send_between(cluster, devices, a.min(b), a.max(b), n);
    let align = |_: usize, _: usize| true;
    let mut stages = Vec::with_capacity(s);
    let (mut fwd, mut bwd) = (Vec::with_capacity(s), Vec::with_capacity(s));
    let mut mem_per_device = Vec::new();
    let mut worst = Memory::default();
    let mut worst_total = 0.0;
    let (mut syncs, mut updates) = (Vec::new(), Vec::new());
    let mut p2p_total = 0.0;
    let mut rows_all = Vec::new();
    let mut events = Vec::new();
    let mut op_cuts = Vec::with_capacity(s);
    let ranges: Vec<(usize, usize)> = cuts.iter().map(|c| (bounds[c.start], bounds[c.end])).collect();
    let (shared, summing) = shared_params(gm, &gm_order, &ranges, m);
    // Between stages of equal meshes each device sends its piece (`codegen::lower`).
    let pieces = cuts.iter().all(|c| sizes[c.size] == sizes[cuts[0].size]);
    for (st, cut) in cuts.iter().enumerate() {
        let d = sizes[cut.size];
        let t = &tables[&(d, mb)];
        let (a, b) = (bounds[cut.start], bounds[cut.end]);
        op_cuts.push((a, b));
        let all: Vec<usize> = (0..=t.fwd.len()).collect();
        let units = Units::new(t, &all, pieces);
        let pin = PartitionInput {
            tables: vec![&units],
            sizes: vec![d],
            devices,
            stages: s,
            micro: m,
            schedule,
            capacity,
            link: &link,
            aligned: &align,
            recompute,
        };
        let (f, bw, rc) = stage_cost(&pin, 0, st, a, b, cut.offset)?;
        let flight = schedule.in_flight(st, s, m);
        let params = units.params(a, b, m);
        let act_one = units.act[b] - units.act[a];
        let input = if a > 0 { units.cross[a] } else { 0.0 };
        let act = if rc { input * flight + act_one } else { (act_one + input) * flight };
        // The update, after the last backward, makes each weight's and optimizer state's next
        // value while the current ones are held (the micro-batch's own gradients freed by
        // then), unless the device's optimizer updates in place.
        let (param, grad) = (units.param[b] - units.param[a], units.grad[b] - units.grad[a]);
        let update = if cluster.device.in_place_update { 0.0 } else { param - grad * if m > 1 { 2.0 } else { 1.0 } };
        let act = (act + summing[st]).max(update);
        // The parameters' bytes by kind: weights (and the shared weights' copies), gradients
        // (with their accumulator over micro-batches), the optimizer state the rest.
        let weights = units.weight[b] - units.weight[a];
        let gradients = grad + params - param;
        let mem = Memory {
            weights: weights + shared[st],
            gradients,
            optimizer: (params - weights - gradients).max(0.0),
            activations: act,
            workspace: t.workspace,
        };
        let total = mem.total();
        if total > worst_total {
            worst_total = total;
            worst = mem;
        }
        let send = if b < t.fwd.len() { units.cross[b] } else { 0.0 };
        if send > 0.0 {
            let (time, latency) = link(cut.offset + d - 1, cut.offset + d, send);
            events.extend(t.crossing[b].iter().map(|&v| crossing_event(v, send, time, latency)));
        }
        let (sends_fwd, sends_bwd) = stage_sends(&pin, &units, a, b, cut.offset, d);
        p2p_total += (sends_fwd + sends_bwd) * m as f64;
        let mut asg = Assignment::default();
        let mut nodes = Vec::with_capacity(b - a);
        for (k, &n) in gm_order[a..b].iter().enumerate() {
            if let Some(&orig) = gm.node(n).outputs().first().and_then(|o| names.get(o.name.as_str())) {
                asg.strategies.insert(orig, t.strategies[a + k].clone());
                nodes.push(orig);
            }
        }
        let in_stage: std::collections::HashSet<NodeId> = gm_order[a..b].iter().copied().collect();
        events.extend(t.events.iter().filter(|e| e.op.is_some_and(|o| in_stage.contains(&o))).cloned());
        rows_all.extend(t.rows[a..b].iter().cloned());
        let sync: f64 = t.sync[a..b].iter().sum();
        syncs.push(sync);
        updates.push(t.update[a..b].iter().sum::<f64>());
        fwd.push(f);
        bwd.push(bw);
        mem_per_device.extend(std::iter::repeat_n(total as u64, d));
        let name = |n: NodeId| gm.op_name(n);
        stages.push(StagePlan {
            devices: (cut.offset..cut.offset + d).collect(),
            mesh: mesh_string(&meshes[&d]),
            sub_mesh: meshes[&d].clone(),
            ops: gm_order[a..b]
                .iter()
                .map(|&n| gm.node(n).outputs().first().map(|o| o.name.clone()).unwrap_or_default())
                .collect(),
            nodes,
            first_op: name(gm_order[a]),
            last_op: name(gm_order[b - 1]),
            forward_s: f,
            backward_s: bw,
            time_s: f + bw,
            recompute: rc,
            memory_bytes: total as u64,
            send_bytes: send,
            grad_sync_s: sync,
            assignment: asg,
            rows: t.rows[a..b].to_vec(),
            events: Vec::new(),
        });
    }
    let makespan = schedule.makespan(&fwd, &bwd, m);
    let slot_b = bwd.iter().copied().fold(0.0, f64::max);
    // Stage s finishes its last backward about s slots before stage 0; its synchronisation
    // hides behind that (when overlap is on), the rest is exposed.
    let exposed = syncs
        .iter()
        .enumerate()
        .map(|(st, &x)| if opts.overlap_grad_sync { (x - st as f64 * slot_b).max(0.0) } else { x })
        .fold(0.0, f64::max);
    let update = updates.iter().copied().fold(0.0, f64::max);
    let before_input = makespan + exposed + update;
    let input_transfer = tables[&(sizes[cuts[0].size], mb)].input_transfer * m as f64;
    let input = if opts.preload { (input_transfer - before_input).max(0.0) } else { input_transfer };
    let times: Vec<f64> = fwd.iter().zip(&bwd).map(|(f, b)| f + b).collect();
    let tmax = times.iter().copied().fold(0.0, f64::max);
    let tmin = times.iter().copied().fold(f64::INFINITY, f64::min);
    let imbalance = tmax / tmin.max(1e-30);
    let reference = &tables[&(sizes[cuts[0].size], mb)];
    let blocker = (imbalance > 1.10).then(|| blocker(gm, reference, &op_cuts, &times, s));
    let feasible = worst_total <= capacity;
    let slots = schedule.slots(s, m);
    let mut by_kind = std::collections::BTreeMap::new();
    by_kind.insert("p2p".to_string(), p2p_total);
    let breakdown = Breakdown {
        step_time_s: before_input + input,
        compute_s: m as f64 * tmax,
        forward_s: m as f64 * fwd.iter().copied().fold(0.0, f64::max),
        backward_s: m as f64 * slot_b,
        update_s: update,
        communication_s: p2p_total + syncs.iter().sum::<f64>(),
        communication_by_kind: by_kind,
        gradient_sync_s: syncs.iter().sum(),
        exposed_gradient_sync_s: exposed,
        bubble_s: makespan / slots * (slots - m as f64),
        input_s: input,
        input_transfer_s: input_transfer,
        input_bytes: 0.0,
        memory_per_device_bytes: mem_per_device,
        memory: worst,
        memory_capacity_bytes: capacity as u64,
        feasible,
        infeasible_reason: (!feasible).then(|| "a pipeline stage does not fit".into()),
        ops: rows_all,
        events,
        // Stages have their own meshes; per-device bytes are reported for one mesh only.
        bytes_moved_per_device: Default::default(),
        policy: Default::default(),
    };
    Some(PipelinePlan {
        stages,
        micro_batches: m,
        schedule,
        breakdown,
        imbalance,
        blocker,
        tried: Vec::new(),
        search_time_s: 0.0,
        requested: false,
        whole_batch: None,
        replanned: None,
    })
}

/// The send of a value crossing a stage cut to the next stage (`bytes` in `time`).
pub(super) fn crossing_event(value: ir::Value, bytes: f64, time: f64, latency: f64) -> CommEvent {
    let step = crate::cost::collective::Step {
        kind: crate::cost::collective::CommKind::P2p,
        axes: vec![],
        group: 2,
        bytes,
        moved: bytes,
        moved_by_device: None,
        latency,
        time,
    };
    CommEvent { phase: Phase::Forward, value, op: None, from: vec![], to: vec![], steps: vec![step] }
}

/// Why stages are not balanced: the heaviest single op, when it alone is more than a fair
/// share; else the op the fastest stage would have to take from a neighbour, when that would
/// make it the slowest; else memory (recomputation) or the tensors crossing the cuts.
pub(super) fn blocker(g: &Graph, t: &Table, cuts: &[(usize, usize)], times: &[f64], s: usize) -> String {
    let total: f64 = times.iter().sum();
    let share = total / s as f64;
    let op_time = |i: usize| t.fwd[i] + t.bwd[i];
    let order = g.op_nodes().unwrap_or_default();
    let name = |i: usize| order.get(i).map(|&n| g.op_name(n)).unwrap_or_default();
    let (heavy, ht) = (0..t.fwd.len()).map(|i| (i, op_time(i))).fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    if ht > 0.5 * share {
        return format!(
            "op `{}` alone takes {:.1}% of a fair stage share ({:.3} ms of {:.3} ms per micro-batch); cuts between ops cannot balance finer",
            name(heavy),
            100.0 * ht / share,
            ht * 1e3,
            share * 1e3
        );
    }
    let slowest = times.iter().copied().fold(0.0, f64::max);
    let fastest = (0..times.len()).fold(0, |a, b| if times[b] < times[a] { b } else { a });
    let (a, b) = cuts[fastest];
    let mut neighbours = Vec::new();
    if fastest + 1 < cuts.len() && b < t.fwd.len() {
        neighbours.push(b);
    }
    if fastest > 0 && a > 0 {
        neighbours.push(a - 1);
    }
    if let Some(&i) = neighbours.iter().min_by(|&&x, &&y| op_time(x).total_cmp(&op_time(y)))
        && times[fastest] + op_time(i) > slowest
    {
        return format!(
            "the fastest stage {fastest} ({:.3} ms) cannot take op `{}` ({:.3} ms) from its neighbour without becoming slower than the slowest ({:.3} ms): the ops are too coarse to balance finer",
            times[fastest] * 1e3,
            name(i),
            op_time(i) * 1e3,
            slowest * 1e3
        );
    }
    format!(
        "stage {fastest} cannot grow: moving a boundary would exceed memory or add a costly transfer of the tensors crossing the cut"
    )
}

/// Prices a hand pipeline configuration — `stages` stages of `devices / stages` devices,
/// each sharded data-parallel or, with `tensor` > 1, Megatron-style over `tensor` of them
/// (the rest data-parallel), `micro` micro-batches under `schedule` — with the tables,
/// partition and step price the search uses for the pipelines it makes. The layers are
/// balanced over the stages as the search balances them; recomputation is what `opts` says
/// (no stage recomputes on its own). A configuration that does not fit is priced on the
/// time-balanced cut and marked so, with what its fullest stage needs.
/// `shape` is (stages, micro-batches, schedule, tensor, expert) — expert parallelism (`expert`
/// > 1, `tensor` 1) over groups of each stage's data-parallel devices.
pub fn price_configuration(
    g: &Graph,
    cluster: &Cluster,
    devices: usize,
    shape: (usize, usize, Schedule, usize, usize),
    opts: &Options,
) -> Result<PipelinePlan, String> {
    let batch = graph_batch(g).ok_or("pipeline: the model has no input with a batch dim")?;
    price_configuration_in(&mut MicroGraphs::new(g, batch), cluster, devices, shape, opts, true)
}

/// The stage table of a configuration: each op priced on a stage of `per_stage` devices
/// (tensor `tensor`, or expert `expert`, within) at micro-batch size `mb`, made once per
/// [`MicroGraphs`].
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_table(
    graphs: &mut MicroGraphs<'_>,
    cluster: &Cluster,
    devices: usize,
    (tensor, expert): (usize, usize),
    per_stage: usize,
    mb: i64,
    opts: &Options,
) -> Result<Arc<StageTable>, String> {
    let key: StageKey = (tensor, expert, per_stage, mb, format!("{opts:?}"), devices);
    if let Some(t) = graphs.stage_tables.get(&key) {
        return Ok(t.clone());
    }
    let inner = crate::autoshard::Named::stage_strategy(tensor, expert, per_stage)?;
    let mesh = inner.mesh(cluster, per_stage)?;
    let (gm, analysis) = graphs.analyzed(mb).ok_or_else(|| {
        let why = graphs.refused.as_ref().map_or(String::new(), |(_, e)| format!(": {e}"));
        format!("pipeline: the model takes no micro-batch of {mb}{why}")
    })?;
    let cm = CostModel::with_analysis(&gm, &analysis, cluster, mesh.clone(), opts.clone()).with_busy(devices);
    let asg = match crate::autoshard::named::assign(&cm, &inner) {
        Ok(a) => a,
        // A stage of one device runs every op whole, whatever carries the batch (a micro-batch
        // of one sample has no dim that shows it).
        Err(_) if per_stage == 1 => Assignment::default(),
        Err(e) => return Err(e),
    };
    let strategies: HashMap<String, OpStrategy> = asg
        .strategies
        .iter()
        .filter_map(|(n, s)| Some((gm.node(*n).outputs().first()?.name.clone(), s.clone())))
        .collect();
    let t = table_on(&cm, &strategies);
    let st = Arc::new(StageTable { tables: HashMap::from([((per_stage, mb), t)]), gm, mesh });
    graphs.stage_tables.insert(key, st.clone());
    Ok(st)
}

/// What [`price_configuration_in`] answers, told not to price a configuration whose stages
/// fit no split, when none does.
pub(in crate::autoshard) const UNFIT: &str = "pipeline: no split into stages fits in device memory";

/// [`price_configuration`] with the micro-batch graphs of `graphs` (re-batched once per
/// size over many configurations); `shape` is (stages, micro-batches, schedule, tensor,
/// expert).
/// With `report_unfit`, a configuration no split of which fits is priced at the split that
/// needs least (infeasible); without, it is the error [`UNFIT`] (the grid walks on without
/// the second partition).
pub(in crate::autoshard) fn price_configuration_in(
    graphs: &mut MicroGraphs<'_>,
    cluster: &Cluster,
    devices: usize,
    shape: (usize, usize, Schedule, usize, usize),
    opts: &Options,
    report_unfit: bool,
) -> Result<PipelinePlan, String> {
    let (stages, micro, schedule, tensor, expert) = shape;
    let (g, batch) = (graphs.g, graphs.batch);
    if stages == 0 || !devices.is_multiple_of(stages) {
        return Err(format!("pipeline: {stages} stages do not divide {devices} devices"));
    }
    if micro == 0 || micro as i64 > batch || batch % micro as i64 != 0 {
        return Err(format!("pipeline: {micro} micro-batches do not divide the batch of {batch}"));
    }
    if schedule.chunks() > 1 && !micro.is_multiple_of(stages) {
        return Err(format!(
            "pipeline: the interleaved schedule runs micro-batches in groups of the {stages} stages; {micro} is not a multiple"
        ));
    }
    let per_stage = devices / stages;
    let mb = batch / micro as i64;
    let st = stage_table(graphs, cluster, devices, (tensor, expert), per_stage, mb, opts)?;
    let chunks = stages * schedule.chunks();
    let (gm, tables) = (&st.gm, &st.tables);
    let table = &tables[&(per_stage, mb)];
    let bounds = &unit_bounds(table, (4 * chunks).clamp(CONFIG_UNITS, FINE_UNITS));
    let units = &Units::new(table, bounds, true);
    let cuttable = bounds.len() - 1;
    if chunks > cuttable {
        return Err(format!(
            "pipeline: {chunks} model chunks for {cuttable} places to cut (runs of ops of about equal time)"
        ));
    }
    let meshes = HashMap::from([(per_stage, st.mesh.clone())]);
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    let price = |cap: f64| {
        let cuts = partition_on(cluster, devices, &[units], &[per_stage], stages, micro, schedule, cap, false)?;
        let (s, m) = (stages, micro);
        price_cuts(gm, g, cluster, opts, tables, &[per_stage], &cuts, bounds, mb, s, m, schedule, cap, &meshes, false)
    };
    if let Some(p) = price(capacity) {
        return Ok(p);
    }
    if !report_unfit {
        return Err(UNFIT.into());
    }
    let mut p = price(f64::INFINITY).ok_or("pipeline: no split into stages")?;
    let b = &mut p.breakdown;
    b.memory_capacity_bytes = capacity as u64;
    b.feasible = false;
    b.infeasible_reason = Some(format!(
        "the fullest stage needs {:.2} GiB per device, {:.2} GiB usable",
        b.memory.total() / 1073741824.0,
        capacity / 1073741824.0
    ));
    Ok(p)
}

impl PipelinePlan {
    /// Every stage's strategies together (each on its stage's mesh), keyed by the whole
    /// graph's nodes.
    pub fn assignment(&self) -> Assignment {
        let mut asg = Assignment::default();
        for st in &self.stages {
            asg.strategies.extend(st.assignment.strategies.iter().map(|(k, v)| (*k, v.clone())));
        }
        asg
    }

    /// The stages as `shardc cost` reports a priced pipeline.
    pub fn report(&self) -> crate::cost::PipelineReport {
        use crate::cost::pipeline::StageReport;
        crate::cost::PipelineReport {
            stages: self
                .stages
                .iter()
                .map(|s| StageReport {
                    devices: s.devices.clone(),
                    op_count: s.ops.len(),
                    first_op: s.first_op.clone(),
                    last_op: s.last_op.clone(),
                    time_s: s.time_s,
                    forward_s: s.forward_s,
                    backward_s: s.backward_s,
                    send_bytes: s.send_bytes,
                    memory_bytes: s.memory_bytes,
                })
                .collect(),
            micro_batches: self.micro_batches,
            schedule: self.schedule,
            breakdown: self.breakdown.clone(),
            imbalance: self.imbalance,
        }
    }
}

/// One stage of a pipeline given whole (a plan file's): its ops (first output names), its
/// mesh and its first global device.
pub struct GivenStage<'a> {
    pub ops: &'a [String],
    pub mesh: &'a Mesh,
    pub offset: usize,
}

/// Prices the pipeline of `stages` over `g` (its ops' `strategies` by first output name) with
/// `micro` micro-batches under `schedule`, as the search prices the partitions it makes
/// (per-stage time and memory, the step): a plan read from a file is priced again rather than
/// trusted. Stages of one size share that size's first mesh, as the search's tables do. An
/// error when the graph takes no such micro-batch, a stage names ops the graph lacks or not
/// after the previous stage's, or the stages do not fit in memory.
pub fn price_stages(
    g: &Graph,
    cluster: &Cluster,
    opts: &Options,
    stages: &[GivenStage<'_>],
    strategies: &HashMap<String, OpStrategy>,
    micro: usize,
    schedule: Schedule,
) -> Result<PipelinePlan, String> {
    let batch = graph_batch(g).ok_or("the model has no input with a batch dim to split into micro-batches")?;
    if micro == 0 || batch % micro as i64 != 0 {
        return Err(format!("{micro} micro-batches do not divide the batch of {batch}"));
    }
    let mb = batch / micro as i64;
    let mut graphs = MicroGraphs::new(g, batch);
    let gm = graphs.get(mb).ok_or_else(|| {
        let why = graphs.refused.as_ref().map_or(String::new(), |(_, e)| format!(": {e}"));
        format!("the model takes no micro-batch of {mb}{why}")
    })?;
    let order = gm.op_nodes().map_err(|_| "the graph has a cycle".to_string())?;
    let pos: HashMap<&str, usize> =
        order.iter().enumerate().filter_map(|(i, &n)| Some((gm.node(n).outputs().first()?.name.as_str(), i))).collect();
    let devices: usize = stages.iter().map(|s| s.mesh.devices()).sum();
    let mut sizes: Vec<usize> = stages.iter().map(|s| s.mesh.devices()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut meshes: HashMap<usize, Mesh> = HashMap::new();
    // Each stage runs from its first named op to the next stage's first; ops no stage names
    // (constants the micro-batch graph adds) go with the stage whose run holds them.
    let mut runs: Vec<(usize, usize)> = Vec::with_capacity(stages.len());
    for (i, s) in stages.iter().enumerate() {
        let d = s.mesh.devices();
        meshes.entry(d).or_insert_with(|| s.mesh.clone());
        let at: Vec<usize> = s.ops.iter().filter_map(|o| pos.get(o.as_str()).copied()).collect();
        let (Some(&first), Some(&last)) = (at.iter().min(), at.iter().max()) else {
            return Err(format!("stage {i} names no op of the model"));
        };
        if at.len() != s.ops.len() {
            return Err(format!("stage {i} names ops the model does not have"));
        }
        if runs.last().is_some_and(|&(_, prev_last)| prev_last >= first) {
            return Err(format!("stage {i}'s ops are not after stage {}'s in the model's order", i - 1));
        }
        runs.push((first, last));
    }
    let cuts: Vec<Cut> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| Cut {
            start: if i == 0 { 0 } else { runs[i].0 },
            end: runs.get(i + 1).map_or(order.len(), |r| r.0),
            size: sizes.iter().position(|&x| x == s.mesh.devices()).unwrap_or(0),
            offset: s.offset,
        })
        .collect();
    let tables: HashMap<(usize, i64), Table> =
        sizes.iter().map(|&d| ((d, mb), table(&gm, cluster, &meshes[&d], devices, opts, strategies))).collect();
    let bounds: Vec<usize> = (0..=order.len()).collect();
    let capacity = cluster.device.mem_capacity * cluster.device.mem_usable;
    price_cuts(
        &gm,
        g,
        cluster,
        opts,
        &tables,
        &sizes,
        &cuts,
        &bounds,
        mb,
        stages.len(),
        micro,
        schedule,
        capacity,
        &meshes,
        true,
    )
    .ok_or_else(|| "the stages do not fit in memory on this cluster".into())
}
