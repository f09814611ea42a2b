//! Helpers shared by the root-level integration tests (`mod common;`).

use shardc::codegen::Program;
use shardc::passes::autoshard::Plan;

/// One truth for a plan's collectives: per kind, the bytes `plan` prices a device to move in
/// the forward pass equal what its lowered `program` moves (no op fell back to running
/// replicated), and some bytes go by collective `kind`. `label` names the case in failures.
pub fn assert_forward_bytes_as_lowered(plan: &Plan, program: &Program, kind: &str, label: &str) {
    assert!(program.fallbacks.is_empty(), "{label}: {:?}", program.fallbacks);
    let (priced, lowered) = (plan.bytes_moved_per_device.get("forward"), program.bytes_moved_per_device());
    let (priced, lowered) = (priced.cloned().unwrap_or_default(), lowered.get("forward").cloned().unwrap_or_default());
    assert!(priced.get(kind).is_some_and(|&b| b > 0.0), "{label}: {priced:?}");
    let kinds: std::collections::BTreeSet<&String> = priced.keys().chain(lowered.keys()).collect();
    for k in kinds {
        let (a, b) = (priced.get(k).copied().unwrap_or(0.0), lowered.get(k).copied().unwrap_or(0.0));
        assert!((a - b).abs() <= 1e-9 * a.max(b) + 1e-3, "{label} {k}: plan {a:.0} B, program {b:.0} B");
    }
}
