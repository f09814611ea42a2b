//! The plan as text: per-op report, per-stage report and the pipeline timeline.

use super::*;

/// A per-layer table with data parallelism beside it, grouped by the repeated block each op
/// lies in ([`ir::scope`]): a total row per block, then its ops. `order` is the op order the
/// breakdowns' rows follow; columns fit their widest cell.
pub fn report(g: &Graph, order: &[NodeId], plan: &Breakdown, dp: Option<&Breakdown>) -> String {
    let us = |s: f64| format!("{:.1}", s * 1e6);
    let mib = |b: f64| format!("{:.1}", b / (1024.0 * 1024.0));
    let paths = if order.len() == plan.ops.len() { ir::scope::module_paths(g, order) } else { HashMap::new() };
    let dp = dp.filter(|d| d.ops.len() == plan.ops.len());
    let dash = || "-".to_string();
    // Blocks in order of first appearance, each with its rows.
    let mut blocks: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, r) in plan.ops.iter().enumerate() {
        if r.compute_s == 0.0 && r.communication_s == 0.0 && r.memory_bytes == 0.0 {
            continue;
        }
        let block = order.get(i).and_then(|n| paths.get(n)).map(|p| ir::scope::block_of(p)).unwrap_or_default();
        match blocks.iter_mut().find(|(b, _)| *b == block) {
            Some((_, rows)) => rows.push(i),
            None => blocks.push((block, vec![i])),
        }
    }
    let sums = |b: &Breakdown, rows: &[usize]| {
        let f = |k: &dyn Fn(&crate::cost::OpRow) -> f64| rows.iter().filter_map(|&i| b.ops.get(i)).map(k).sum::<f64>();
        (f(&|r| r.compute_s), f(&|r| r.communication_s), f(&|r| r.memory_bytes))
    };
    let mut rows: Vec<[String; 9]> = Vec::new();
    let grouped = blocks.len() > 1;
    for (block, idx) in &blocks {
        if grouped {
            let (c, m, a) = sums(plan, idx);
            let (dc, dm) = dp.map(|d| sums(d, idx)).map_or((dash(), dash()), |(c, m, _)| (us(c), us(m)));
            let name = if block.is_empty() { "(unnamed)".to_string() } else { block.clone() };
            rows.push([
                format!("{name}/"),
                format!("{} ops", idx.len()),
                String::new(),
                us(c),
                us(m),
                mib(a),
                String::new(),
                dc,
                dm,
            ]);
        }
        for &i in idx {
            let r = &plan.ops[i];
            let (ds, dc, dm) = match dp.map(|d| &d.ops[i]) {
                Some(d) => (d.strategy.clone(), us(d.compute_s), us(d.communication_s)),
                None => (dash(), dash(), dash()),
            };
            let indent = if grouped { "  " } else { "" };
            rows.push([
                format!("{indent}{}", r.name),
                r.op.clone(),
                r.strategy.clone(),
                us(r.compute_s),
                us(r.communication_s),
                mib(r.memory_bytes),
                ds,
                dc,
                dm,
            ]);
        }
    }
    let all: Vec<usize> = blocks.iter().flat_map(|(_, i)| i.iter().copied()).collect();
    let (c, m, a) = sums(plan, &all);
    let (dc, dm) = dp.map(|d| sums(d, &all)).map_or((dash(), dash()), |(c, m, _)| (us(c), us(m)));
    rows.push(["total (per-op)".into(), String::new(), String::new(), us(c), us(m), mib(a), String::new(), dc, dm]);
    crate::table::table(
        &["layer", "op", "strategy", "comp µs", "comm µs", "mem MiB", "data parallel", "comp µs", "comm µs"],
        &rows,
        &[false, false, false, true, true, true, false, true, true],
    )
}

/// A per-stage table of a pipelined plan.
pub fn stage_report(plan: &Plan) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "pipeline: {} stages, {} micro-batches, {}\n",
        plan.stages.len(),
        plan.micro_batches,
        plan.schedule.map_or("-".into(), |s| s.name())
    ));
    t.push_str(&format!(
        "{:>5} {:>9} {:<28} {:>6} {:>11} {:>11} {:>11} {:>10} {:>9}   {}\n",
        "stage",
        "devices",
        "mesh",
        "ops",
        "fwd µs/µb",
        "bwd µs/µb",
        "total µs",
        "mem MiB",
        "recompute",
        "first .. last op"
    ));
    for (i, s) in plan.stages.iter().enumerate() {
        let mesh: Vec<String> = s.mesh.iter().map(|a| format!("{}={}", a.name, a.size)).collect();
        let first = s.ops.first().cloned().unwrap_or_default();
        let last = s.ops.last().cloned().unwrap_or_default();
        t.push_str(&format!(
            "{:>5} {:>9} {:<28} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>10.1} {:>9}   {first} .. {last}\n",
            i,
            format!("{}-{}", s.devices.first().unwrap_or(&0), s.devices.last().unwrap_or(&0)),
            mesh.join(" × "),
            s.ops.len(),
            s.forward_s * 1e6,
            s.backward_s * 1e6,
            s.time_s * 1e6,
            s.memory_bytes as f64 / 1048576.0,
            if s.recompute { "yes" } else { "no" },
        ));
    }
    t
}

/// One stage's forward or backward of one micro-batch in a simulated schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimelineBlock {
    /// The stage.
    pub stage: usize,
    /// The micro-batch.
    pub micro_batch: usize,
    /// Backward (else forward).
    pub backward: bool,
    /// Start, seconds from the step's start.
    pub start_s: f64,
    /// End, seconds.
    pub end_s: f64,
}

/// A plan's schedule simulated from its stages' per-micro-batch times: each stage runs its
/// forwards and backwards in the schedule's order (GPipe, or 1F1B's warm-up, alternation and
/// drain), each starting when its stage is free and its dependency (the previous stage's
/// forward, the next stage's backward) has ended. Returns the blocks and the span, seconds.
pub fn timeline(plan: &Plan) -> (Vec<TimelineBlock>, f64) {
    let s = plan.stages.len();
    let m = plan.micro_batches.max(1);
    let f: Vec<f64> = plan.stages.iter().map(|x| x.forward_s).collect();
    let b: Vec<f64> = plan.stages.iter().map(|x| x.backward_s).collect();
    // Simulate the schedule: each stage runs its ops in schedule order, each op starts when its
    // stage is free and its dependency (previous stage's forward, next stage's backward) ends.
    let mut fwd_end = vec![vec![0.0f64; m]; s];
    let mut bwd_end = vec![vec![0.0f64; m]; s];
    let mut blocks: Vec<TimelineBlock> = Vec::new();
    let order: Vec<Vec<(bool, usize)>> = (0..s)
        .map(|st| {
            let mut ops = Vec::new();
            if plan.schedule == Some(crate::cost::Schedule::GPipe) || s == 1 {
                ops.extend((0..m).map(|i| (false, i)));
                ops.extend((0..m).rev().map(|i| (true, i)));
            } else {
                // 1F1B: warm-up forwards, then alternate, then drain backwards.
                let warm = (s - st).min(m);
                ops.extend((0..warm).map(|i| (false, i)));
                let (mut nf, mut nb) = (warm, 0);
                while nb < m {
                    ops.push((true, nb));
                    nb += 1;
                    if nf < m {
                        ops.push((false, nf));
                        nf += 1;
                    }
                }
            }
            ops
        })
        .collect();
    let mut pos = vec![0usize; s];
    let mut free = vec![0.0f64; s];
    let total_ops = s * m * 2;
    let mut done = 0;
    let mut guard = 0;
    while done < total_ops && guard < total_ops * (s + 2) {
        guard += 1;
        for st in 0..s {
            let Some(&(back, i)) = order[st].get(pos[st]) else { continue };
            let ready = if !back {
                if st == 0 { Some(0.0) } else { (fwd_end[st - 1][i] > 0.0).then_some(fwd_end[st - 1][i]) }
            } else if st + 1 == s {
                (fwd_end[st][i] > 0.0).then_some(fwd_end[st][i])
            } else {
                (bwd_end[st + 1][i] > 0.0).then_some(bwd_end[st + 1][i])
            };
            let Some(ready) = ready else { continue };
            let start = ready.max(free[st]);
            let end = start + if back { b[st] } else { f[st] };
            if back {
                bwd_end[st][i] = end;
            } else {
                fwd_end[st][i] = end;
            }
            free[st] = end;
            blocks.push(TimelineBlock { stage: st, micro_batch: i, backward: back, start_s: start, end_s: end });
            pos[st] += 1;
            done += 1;
        }
    }
    (blocks, free.iter().copied().fold(0.0, f64::max))
}
