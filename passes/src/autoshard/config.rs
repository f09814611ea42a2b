//! Hand configurations in the fields frameworks name them by: `--strategy
//! tp=8,dp=8,zero=3,recompute=full,sp` — the degrees of data (`dp`), tensor (`tp`), pipeline
//! (`pp`, with `vp` virtual stages), context (`cp`; `cp_comm=p2p` for ring attention, `a2a`
//! for Ulysses, the default) and expert (`ep`) parallelism, the
//! micro-batch size (`mbs`), sequence parallelism (`sp`), activation recomputation
//! (`recompute=none|selective|op|full`), the ZeRO stage (`zero=0|1|2|3`), the pipeline
//! schedule (`schedule=gpipe|1f1b|interleaved`) and flash attention (`flash`: the model's
//! attentions fused into one op each before pricing, [`crate::algebra::attention`]).
//!
//! Every field is optional: the degrees default to 1 except `dp`, which takes the devices
//! the others leave; `mbs` to 1 in a pipeline and, without one, to the whole batch of a
//! data-parallel replica (no gradient accumulation); `sp` off; `recompute` none; `zero` 0;
//! `schedule` 1f1b; `flash` off (attention as the model writes it). The
//! product of the degrees must be the devices used. A configuration resolves to a named
//! strategy ([`Named`]: `data`, `megatron`, `hybrid:dp:D,tp:T`,
//! `pipeline:S:M[:interleaved:V][:tp:T]`, `context[:ring][:dp:D,tp:T]` for `cp` with or without `dp`
//! and `tp`, `expert:ep:E` for `ep`) and the cost-model options it sets; what the cost model
//! cannot price yet (`ep` with `cp`; `cp` with `pp`) is refused with the reason.
//! `pp` with `tp` is a pipeline of Megatron (or data × Megatron) stages; `vp` > 1 the
//! interleaved schedule. As in Megatron-LM, `ep` takes no devices of its own: the
//! expert-parallel groups are carved from the data-parallel ranks (`ep` divides `dp`), each
//! mixture of experts splitting its experts over a group and the groups data parallel.

use super::named::Named;
use crate::cost::{Options, Recompute, Schedule};

/// A parsed hand configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Data-parallel degree (`None`: the devices the other degrees leave).
    pub dp: Option<usize>,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Virtual stages per device (interleaving).
    pub vp: usize,
    /// Context-parallel degree.
    pub cp: usize,
    /// Expert-parallel degree.
    pub ep: usize,
    /// Micro-batch size per data-parallel replica (`None`: 1 in a pipeline, else the
    /// replica's whole batch). Without a pipeline, a smaller one accumulates gradients over
    /// batch / (dp × mbs) micro-batches per step.
    pub mbs: Option<usize>,
    /// Sequence parallelism.
    pub sp: bool,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// ZeRO stage (0–3).
    pub zero: u8,
    /// Pipeline schedule (`None`: 1F1B).
    pub schedule: Option<Schedule>,
    /// Flash attention: the model's attentions fused into one op each (`fuse-attention`)
    /// before pricing, as frameworks that call a fused attention kernel run them.
    pub flash: bool,
    /// Context parallelism as ring attention (`cp_comm=p2p`, Megatron-LM's
    /// `--cp-comm-type p2p`) rather than Ulysses' all-to-alls (`cp_comm=a2a`, the default).
    pub ring: bool,
    /// Expert parallelism's tokens dispatched by all-to-all (`ep_comm=a2a`, Megatron-core's
    /// `alltoall` token dispatcher) rather than all-gathered (`ep_comm=allgather`, the
    /// default).
    pub ep_a2a: bool,
    /// The all-to-all dispatcher's capacity factor in thousandths (`capacity=1.25`; `None`
    /// or 0: dropless buffers). A pair beyond a device's buffer is an error when the step
    /// runs, never dropped.
    pub capacity_milli: Option<u32>,
    /// Tensor-parallel communication overlapped with the GEMMs
    /// ([`super::Options::tp_comm_overlap`], Megatron-LM's `--tp-comm-overlap`).
    pub tp_overlap: bool,
    /// An fp32 copy of each gradient beside the optimizer state (`fp32_grads`,
    /// [`super::Options::fp32_grads`], DeepSpeed's mixed-precision optimizers).
    pub fp32_grads: bool,
}

/// True when `s` is written as a configuration (`key=value` fields or the `sp` and `flash` flags) rather
/// than a strategy name.
pub fn is_config(s: &str) -> bool {
    s.contains('=') || s.split(',').any(|f| matches!(f.trim(), "sp" | "flash" | "tp_overlap" | "fp32_grads"))
}

fn count(key: &str, v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{key}={v}`: {key} must be a whole number of at least 1")),
    }
}

impl Config {
    /// Parses `key=value` fields separated by commas (and the flags `sp` and `flash`).
    pub fn parse(s: &str) -> Result<Config, String> {
        let mut c = Config { tp: 1, pp: 1, vp: 1, cp: 1, ep: 1, ..Config::default() };
        let mut seen: Vec<&str> = Vec::new();
        for field in s.split(',').map(str::trim).filter(|f| !f.is_empty()) {
            let (key, value) = field.split_once('=').map_or((field, None), |(k, v)| (k.trim(), Some(v.trim())));
            if seen.contains(&key) {
                return Err(format!("`{key}` is given twice"));
            }
            seen.push(key);
            let v = || value.ok_or_else(|| format!("`{key}` needs a value: write {key}=…"));
            match key {
                "dp" => c.dp = Some(count(key, v()?)?),
                "tp" => c.tp = count(key, v()?)?,
                "pp" => c.pp = count(key, v()?)?,
                "vp" => c.vp = count(key, v()?)?,
                "cp" => c.cp = count(key, v()?)?,
                "ep" => c.ep = count(key, v()?)?,
                "mbs" => c.mbs = Some(count(key, v()?)?),
                "sp" | "flash" | "tp_overlap" | "fp32_grads" => {
                    let on = match value {
                        None | Some("1" | "true" | "on") => true,
                        Some("0" | "false" | "off") => false,
                        Some(o) => return Err(format!("`{key}={o}`: write {key}, {key}=on or {key}=off")),
                    };
                    match key {
                        "sp" => c.sp = on,
                        "flash" => c.flash = on,
                        "fp32_grads" => c.fp32_grads = on,
                        _ => c.tp_overlap = on,
                    }
                }
                "recompute" => c.recompute = Recompute::parse(v()?)?,
                "cp_comm" => {
                    c.ring = match v()? {
                        "p2p" | "ring" => true,
                        "a2a" | "ulysses" => false,
                        o => {
                            return Err(format!(
                                "`cp_comm={o}`: context parallelism communicates by p2p (ring attention) or a2a (Ulysses)"
                            ));
                        }
                    }
                }
                "ep_comm" => {
                    c.ep_a2a = match v()? {
                        "a2a" | "alltoall" => true,
                        "allgather" => false,
                        o => {
                            return Err(format!(
                                "`ep_comm={o}`: expert parallelism dispatches tokens by a2a (all-to-all) or allgather"
                            ));
                        }
                    }
                }
                "capacity" => {
                    let f = v()?;
                    c.capacity_milli = match f.parse::<f64>() {
                        Ok(x) if x.is_finite() && x >= 0.0 => Some((x * 1000.0).round() as u32),
                        _ => return Err(format!("`capacity={f}`: the capacity factor is a number ≥ 0 (0: dropless)")),
                    };
                }
                "zero" => {
                    c.zero = match v()? {
                        "0" => 0,
                        "1" => 1,
                        "2" => 2,
                        "3" => 3,
                        o => return Err(format!("`zero={o}`: the ZeRO stage is 0, 1, 2 or 3")),
                    }
                }
                "schedule" => {
                    c.schedule = Some(match v()? {
                        "gpipe" => Schedule::GPipe,
                        "1f1b" => Schedule::OneFOneB,
                        // The virtual stages come from `vp` (2 when it is not given).
                        "interleaved" => Schedule::Interleaved(2),
                        o => return Err(format!("`schedule={o}`: the schedule is gpipe, 1f1b or interleaved")),
                    });
                }
                other => {
                    return Err(format!(
                        "unknown field `{other}`; a configuration has dp, tp, pp, vp, cp, cp_comm, ep, ep_comm, capacity, mbs, sp, recompute, zero, schedule, flash, tp_overlap, fp32_grads"
                    ));
                }
            }
        }
        Ok(c)
    }

    /// Makes in `g` the rewrites the configuration asks for before pricing (`flash`:
    /// `fuse-attention`, [`crate::algebra::apply_named`]); an error when one finds nothing
    /// to rewrite.
    pub fn rewrite(&self, g: &mut ir::Graph) -> Result<(), String> {
        if self.flash && crate::algebra::apply_named(g, "fuse-attention")? == 0 {
            return Err("flash: the model has no attention `fuse-attention` recognizes (docs/memory.md)".into());
        }
        if let Some(f) = self.capacity_factor()
            && ir::ops::experts::set_capacity(g, f)? == 0
        {
            return Err("ep_comm=a2a: the model has no mixture of experts (`fuse-experts`; docs/user-guide.md)".into());
        }
        Ok(())
    }

    /// The all-to-all dispatcher's capacity factor when `ep_comm=a2a` (0: dropless).
    pub fn capacity_factor(&self) -> Option<f32> {
        self.ep_a2a.then(|| self.capacity_milli.unwrap_or(0) as f32 / 1000.0)
    }

    /// The pipeline schedule: `vp` > 1 is the interleaved one (`schedule` may say so or be
    /// left out).
    fn schedule(&self) -> Result<Schedule, String> {
        match (self.schedule, self.vp) {
            (None | Some(Schedule::OneFOneB), 1) => Ok(Schedule::OneFOneB),
            (Some(Schedule::GPipe), 1) => Ok(Schedule::GPipe),
            (Some(Schedule::Interleaved(v)), 1) => Ok(Schedule::Interleaved(v)),
            (_, v) if self.pp == 1 => Err(format!("vp={v}: virtual stages interleave a pipeline; give pp > 1")),
            (None | Some(Schedule::Interleaved(_)), v) => Ok(Schedule::Interleaved(v)),
            (Some(s), v) => Err(format!("vp={v}: virtual stages take the interleaved schedule, not {}", s.name())),
        }
    }

    /// The data-parallel degree on `devices` devices, checking that the degrees multiply to
    /// them.
    pub fn data_degree(&self, devices: usize) -> Result<usize, String> {
        let others = self.tp * self.pp * self.cp;
        let dp = match self.dp {
            Some(d) => d,
            None if devices.is_multiple_of(others) => devices / others,
            None => return Err(format!("tp × pp × cp = {others} does not divide the {devices} devices")),
        };
        if dp * others != devices {
            return Err(format!(
                "dp × tp × pp × cp = {dp} × {} × {} × {} = {} devices, but {devices} are used (--devices)",
                self.tp,
                self.pp,
                self.cp,
                dp * others
            ));
        }
        if !dp.is_multiple_of(self.ep) {
            return Err(format!(
                "ep={}: the expert-parallel groups are carved from the {dp} data-parallel ranks, which {} does not divide",
                self.ep, self.ep
            ));
        }
        Ok(dp)
    }

    /// The named strategy this configuration is, on `devices` devices, for a global `batch`
    /// (pipelines: micro-batches = batch / (dp × mbs)), and the options it sets on `opts`.
    pub fn resolve(&self, devices: usize, batch: Option<i64>, opts: &Options) -> Result<(Named, Options), String> {
        let dp = self.data_degree(devices)?;
        if self.ep > 1 && self.cp > 1 {
            return Err(format!(
                "ep={}: expert parallelism runs beside data, tensor and pipeline parallelism only for now (cp 1; got cp={})",
                self.ep, self.cp
            ));
        }
        if self.cp > 1 && self.pp != 1 {
            return Err(format!(
                "cp={}: context parallelism (Ulysses) runs beside data and tensor parallelism, not yet in pipeline stages: give pp=1 (got pp={})",
                self.cp, self.pp
            ));
        }
        let schedule = self.schedule()?;
        if self.sp && self.tp == 1 {
            return Err("sp: sequence parallelism splits the tensor-parallel axis; give tp > 1".into());
        }
        if self.sp && self.cp > 1 {
            // Megatron splits a context rank's sequence chunk over its tensor ranks
            // (context-major) and Ulysses splits a tensor rank's heads over its context ranks
            // (tensor-major); a layout here splits a dim over several mesh axes in one order.
            return Err(format!(
                "sp with cp={}: sequence parallelism would split the sequence context-major while Ulysses splits the heads tensor-major, and a layout splits a dim over several axes in the mesh's one order; leave out sp (the context axis already splits every activation by the sequence)",
                self.cp
            ));
        }
        if self.ep_a2a && self.ep == 1 {
            return Err("ep_comm: says how expert parallelism dispatches tokens; give ep > 1".into());
        }
        if self.capacity_milli.is_some() && !self.ep_a2a {
            return Err("capacity: sizes the all-to-all dispatcher's buffers; give ep_comm=a2a".into());
        }
        if self.ring && self.cp == 1 {
            return Err("cp_comm: says how context parallelism communicates; give cp > 1".into());
        }
        if self.tp_overlap && self.tp == 1 {
            return Err("tp_overlap: overlaps the tensor-parallel collectives; give tp > 1".into());
        }
        let mut o = opts.clone();
        o.recompute = self.recompute;
        o.sequence_parallel = self.sp;
        o.zero = self.zero;
        o.tp_comm_overlap = self.tp_overlap;
        o.fp32_grads |= self.fp32_grads;
        let batch = batch.map(|b| b as usize);
        if self.pp == 1
            && let Some(mbs) = self.mbs
        {
            let b = batch.ok_or("mbs: the model's batch size is not known; give --batch")?;
            if !b.is_multiple_of(dp * mbs) {
                return Err(format!("mbs={mbs}: the batch {b} is not a multiple of dp × mbs = {}", dp * mbs));
            }
            o.accumulation = b / (dp * mbs);
        }
        let named = match (self.pp, self.tp, dp) {
            (1, tp, _) if self.ep > 1 => Named::Expert { ep: self.ep, tp },
            _ if self.cp > 1 => Named::Context { dp, tp: self.tp, ring: self.ring },
            (1, 1, _) => Named::Data,
            (1, t, 1) if t > 1 => Named::Megatron,
            (1, tp, dp) => Named::Hybrid { dp, tp },
            (stages, tensor, dp) => {
                // Each stage's data-parallel replicas split every micro-batch: micro-batches of
                // mbs samples per replica.
                let b = batch.ok_or("pp: the model's batch size is not known; give --batch")?;
                let mbs = self.mbs.unwrap_or(1);
                if !b.is_multiple_of(dp * mbs) {
                    return Err(format!("pp: the batch {b} is not a multiple of dp × mbs = {}", dp * mbs));
                }
                let micro = b / (dp * mbs);
                if schedule.chunks() > 1 && !micro.is_multiple_of(stages) {
                    return Err(format!(
                        "vp={}: the interleaved schedule runs micro-batches in groups of pp = {stages}; {micro} micro-batches (batch / (dp × mbs)) are not a multiple",
                        schedule.chunks()
                    ));
                }
                Named::Pipeline { stages, micro, schedule, tensor, expert: self.ep }
            }
        };
        Ok((named, o))
    }
}
