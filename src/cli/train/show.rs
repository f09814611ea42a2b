//! What `train` prints: the step table, memory, predictions and checks, as text or JSON.

use super::*;

/// What the report shows.
pub(super) struct Shown<'a> {
    pub(super) args: &'a TrainArgs,
    pub(super) s: &'a Setup,
    pub(super) chosen: &'a Chosen,
    pub(super) info: &'a passes::autodiff::TrainInfo,
    pub(super) micro: usize,
    pub(super) be: Backend,
    pub(super) t: &'a Trained,
    pub(super) predicted: Option<(f64, u64)>,
    pub(super) promise: &'a shardc::footprint::Footprint,
    pub(super) checks: &'a [Check],
    pub(super) notes: &'a [String],
}

impl Shown<'_> {
    /// Step time: the slowest device per step, and the median over the warm steps (the first
    /// compiles kernels).
    pub(super) fn step_times(&self) -> (Vec<f64>, f64) {
        let report = &self.t.report;
        let per_step: Vec<f64> = (0..self.args.steps)
            .map(|i| report.devices.iter().filter_map(|d| d.step_wall_s.get(i).copied()).fold(0.0, f64::max))
            .collect();
        let mut warm: Vec<f64> = if per_step.len() > 1 { per_step[1..].to_vec() } else { per_step.clone() };
        warm.sort_by(f64::total_cmp);
        let step_s = warm.get(warm.len() / 2).copied().unwrap_or(0.0);
        (per_step, step_s)
    }

    pub(super) fn plan_desc(&self) -> String {
        let (chosen, devices, micro) = (self.chosen, self.chosen.devices, self.micro);
        format!(
            "{} on {} device{} of {}{}",
            chosen.desc,
            devices,
            if devices == 1 { "" } else { "s" },
            self.s.cluster.name,
            if micro > 1 && matches!(chosen.lowering, Lowering::Flat(_)) {
                format!(", {micro} micro-batches (gradient accumulation)")
            } else {
                String::new()
            }
        )
    }

    pub(super) fn json(&self) -> serde_json::Value {
        let (args, cluster, be, opt, info, promise, checks, notes, predicted, chosen) = (
            self.args,
            &self.s.cluster,
            self.be,
            &self.s.opt,
            self.info,
            self.promise,
            self.checks,
            self.notes,
            self.predicted,
            self.chosen,
        );
        let (report, losses) = (&self.t.report, &self.t.losses);
        let (per_step, step_s) = self.step_times();
        let plan_desc = self.plan_desc();
        let like = cluster.name.starts_with("local") && be == Backend::Wgpu;
        serde_json::json!({
            "model": args.model.display().to_string(),
            "plan": plan_desc,
            "summary": chosen.summary,
            "backend": format!("{be:?}").to_lowercase(),
            "optimizer": opt,
            "trainable": info.trainable.len(),
            "losses": losses,
            "step_s": step_s,
            "step_times_s": per_step,
            "devices": report.devices.iter().map(|d| serde_json::json!({
                "device": d.device,
                "adapter": d.adapter,
                "wall_s": d.step_wall_s.get(args.steps.saturating_sub(1)).copied().unwrap_or(0.0),
                "compute_s": d.compute_s,
                "communication_s": d.communication_s,
                "phases_s": d.by_phase,
                "memory_allocated_bytes": d.memory_allocated_bytes,
                "activation_peak_bytes": d.activation_peak_bytes,
                "host_ops": d.host_ops,
                "dispatches": d.dispatches,
            })).collect::<Vec<_>>(),
            "memory_predicted_bytes": predicted.map(|p| p.1),
            "host_memory": host_memory_json(promise),
            "predicted": predicted.map(|(t, _)| serde_json::json!({
                "cluster": cluster.name,
                "step_s": t,
                "error": like.then(|| (t - step_s) / step_s),
            })),
            "check": checks.iter().map(|c| serde_json::json!({"what": c.what, "ok": c.ok, "detail": c.detail})).collect::<Vec<_>>(),
            "notes": notes,
        })
    }

    pub(super) fn text(&self) -> String {
        let (args, cluster, opt, info, promise, checks, notes, predicted, chosen) = (
            self.args,
            &self.s.cluster,
            &self.s.opt,
            self.info,
            self.promise,
            self.checks,
            self.notes,
            self.predicted,
            self.chosen,
        );
        let (report, losses, loaded) = (&self.t.report, &self.t.losses, &self.s.loaded);
        let (per_step, step_s) = self.step_times();
        let plan_desc = self.plan_desc();
        let memory = report.devices.iter().map(|d| d.memory_allocated_bytes).max().unwrap_or(0);
        let mut t = String::new();
        t.push_str(&format!("model        {}\n", args.model.display()));
        t.push_str(&format!("plan         {plan_desc}\n"));
        if let Some(s) = &chosen.summary {
            t.push_str(&s.lines().replace("throughput  ", "predicted   "));
        }
        t.push_str(&format!(
            "training     {} trainable tensors, loss `{}`, {}\n",
            info.trainable.len(),
            info.loss,
            serde_json::to_string(&opt).expect("JSON")
        ));
        for n in notes {
            t.push_str(&format!("note         {n}\n"));
        }
        t.push_str("  step        loss       time    forward   backward     update\n");
        for (i, l) in losses.iter().enumerate() {
            if i < args.steps {
                let ph = |k: &str| {
                    if i + 1 == args.steps {
                        secs(report.devices.iter().filter_map(|d| d.by_phase.get(k)).fold(0.0, |a: f64, &b| a.max(b)))
                    } else {
                        String::new()
                    }
                };
                t.push_str(&format!(
                    "  {:>4}  {:>10.6} {:>10} {:>10} {:>10} {:>10}\n",
                    i + 1,
                    l,
                    secs(per_step[i]),
                    ph("forward"),
                    ph("backward"),
                    ph("update")
                ));
            } else {
                t.push_str(&format!("  after {:>10.6}\n", l));
            }
        }
        t.push_str(&format!("step         {} (median of the warm steps, slowest device)", secs(step_s)));
        if let Some(batch) = passes::cost::pipeline::graph_batch(&loaded.model.graph).filter(|_| step_s > 0.0) {
            t.push_str(&format!(", {:.1} samples/s measured", batch as f64 / step_s));
        }
        t.push('\n');
        if let Some(n) = report.devices.iter().map(|d| d.dispatches).max().filter(|&n| n > 0) {
            t.push_str(&format!("dispatches   {n} kernels in the last step (busiest device)\n"));
        }
        t.push_str(&format!("memory       {:.1} MB allocated (peak, largest device)", memory as f64 / 1e6));
        if let Some((_, m)) = predicted {
            t.push_str(&format!("; {:.1} MB predicted on {}", m as f64 / 1e6, cluster.name));
        }
        t.push('\n');
        t.push_str(&host_memory_line(promise));
        if let Some((p, _)) = predicted {
            t.push_str(&format!("predicted    {} per step on {}\n", secs(p), cluster.name));
        }
        if crate::cli::ui::verbose()
            && let Lowering::Flat(r) = &chosen.lowering
        {
            t.push_str(&op_kind_table(&r.breakdown, &report.devices, &cluster.name));
        }
        // Ops the devices left to the host (no kernel for them, or, on lavapipe, loops longer
        // than it runs), per op kind over all devices.
        let mut host: std::collections::BTreeMap<&str, usize> = Default::default();
        for d in &report.devices {
            for (k, v) in &d.host_ops {
                *host.entry(k.as_str()).or_insert(0) += v;
            }
        }
        if !host.is_empty() {
            let list: Vec<String> = host.iter().map(|(k, v)| format!("{k} ×{v}")).collect();
            t.push_str(&format!("host ops     {}\n", list.join(", ")));
        }
        for c in checks {
            t.push_str(&format!("check        {:<36} {}  {}\n", c.what, if c.ok { "ok" } else { "FAILED" }, c.detail));
        }
        t
    }
}
