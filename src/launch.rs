//! A searched plan as the launch settings of a framework, with torch's fallback: when the
//! searched plan's layouts are not ones `torch.distributed.tensor.parallel` can run, the
//! export is Megatron's tensor-parallel layout on the same devices (which it can), priced
//! beside the searched plan and marked as such.

use ir::Graph;
use passes::autoshard::{Plan, SearchResult, export};
use passes::cost::{Cluster, Options};

/// The torch tensor-parallel plan of `plan` (the search's `searched`, over `g`), or, when
/// torch cannot run its layouts, of Megatron's layout on `devices` over `plain` (the model
/// without the search's rewrites: torch shards the modules as written), with both prices and
/// the searched plan's first reason in its header. Errs when neither fits torch.
pub fn torch_tp(
    g: &Graph,
    plain: &Graph,
    cluster: &Cluster,
    devices: usize,
    opts: &Options,
    plan: &Plan,
    searched: &SearchResult,
) -> Result<String, String> {
    let why = match export::degrees(g, cluster, opts, plan).and_then(|d| export::torch_tp_plan(&d)) {
        Ok(text) => return Ok(text),
        Err(e) => e,
    };
    let megatron = crate::exec::named_result(plain, cluster, devices, "megatron", opts)
        .map_err(|e| format!("{why}\n(and Megatron's layout does not apply: {e})"))?;
    let mplan = Plan::new(plain, cluster, devices, opts, Default::default(), &megatron);
    let text = export::degrees(plain, cluster, opts, &mplan)
        .and_then(|d| export::torch_tp_plan(&d))
        .map_err(|e| format!("{why}\n(nor Megatron's layout: {e})"))?;
    let first = why.lines().nth(1).unwrap_or(&why).trim();
    Ok(format!(
        "# The searched plan ({:.3} ms per step) has layouts torch cannot run, e.g. {first}.\n\
         # This is Megatron's tensor-parallel layout on the same {devices} devices instead: {:.3} ms per step.\n{text}",
        searched.breakdown.step_time_s * 1e3,
        megatron.breakdown.step_time_s * 1e3,
    ))
}
