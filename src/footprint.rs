//! What a run will hold in host memory, part by part: the promise `run` and `train` check
//! against the memory the host has before they allocate, and report beside the process's
//! measured peak after.
//!
//! The parts are the graphs' constants the driver holds while the devices run (the model,
//! its training graph, the devices' programs, and under `--check` the reference's copies),
//! the inputs, the device programs at their peak when the devices are the host (the CPU
//! executor, or a GPU sharing host memory), and the single-device reference run.

use std::collections::HashSet;

use ir::Graph;

/// Bytes, part by part (`what`, bytes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Footprint {
    pub parts: Vec<(String, u64)>,
}

impl Footprint {
    /// The whole promise, bytes (saturating).
    pub fn total(&self) -> u64 {
        self.parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b))
    }

    /// `what size, what size, …` for messages.
    pub fn describe(&self, bytes: impl Fn(u64) -> String) -> String {
        self.parts.iter().map(|(w, b)| format!("{w} {}", bytes(*b))).collect::<Vec<_>>().join(", ")
    }
}

/// Bytes of the constants (initializers and input defaults) `g` holds in host memory, those
/// with external data at the size they take once loaded (a graph the driver loads later, the
/// model as written that `--check` trains, holds them then).
pub fn constant_bytes(g: &Graph) -> u64 {
    let bytes = |t: &ir::Tensor| match t.data {
        ir::TensorData::External(_) => t.tensor_type().size_bytes().unwrap_or(u64::MAX),
        _ => t.host_bytes(),
    };
    g.node_ids()
        .filter_map(|n| match &g.node(n).op {
            ir::Op::Initializer(t) | ir::Op::Input { default: Some(t) } => Some(bytes(t)),
            _ => None,
        })
        .fold(0u64, u64::saturating_add)
}

/// The single-device run `--check` compares with: its graph, and whether the driver builds
/// another like it (the training graph of the model as written, beside the program's).
#[derive(Clone, Copy, Debug)]
pub struct Reference<'a> {
    pub graph: &'a Graph,
    pub built_anew: bool,
}

/// What the run of `program` holds: `held`, the graphs the driver keeps while it runs (named
/// for the message); `global`, the graph whose inputs are fed; the devices' peaks when
/// `devices_on_host`; and `reference`, the graph a single-device check evaluates (its
/// evaluator holds a copy of its constants beside the graph's). `None` when a size is not
/// known or does not fit 64 bits.
pub fn footprint(
    program: &codegen::Program,
    held: &[(&str, &Graph)],
    global: &Graph,
    devices_on_host: bool,
    reference: Option<Reference<'_>>,
) -> Option<Footprint> {
    let inputs: u64 = global
        .input_values()
        .into_iter()
        .filter(|v| matches!(global.node(v.node).op, ir::Op::Input { default: None }))
        .map(|v| global.tensor_type(v).map_or(Some(0), |t| t.size_bytes()))
        .try_fold(0u64, |a, b| a.checked_add(b?))?;
    let mut parts = vec![("inputs".to_string(), inputs)];
    let programs = program.devices.iter().map(|d| constant_bytes(&d.graph)).fold(0u64, u64::saturating_add);
    let mut constants: Vec<String> = held.iter().map(|(w, _)| w.to_string()).collect();
    constants.push("device programs".into());
    let held_bytes = held.iter().map(|(_, g)| constant_bytes(g)).fold(programs, u64::saturating_add);
    parts.push((format!("constants of the {}", constants.join(", ")), held_bytes));
    let devices = if devices_on_host {
        let peaks: Vec<u64> = program.peak_bytes().into_iter().collect::<Option<_>>()?;
        Some((peaks.len(), peaks.iter().try_fold(0u64, |a, &b| a.checked_add(b))?))
    } else {
        None
    };
    // The reference runs after the devices are done: whichever is larger is the peak. Its
    // evaluator holds its constants beside the graph's, and the run's results (the size of
    // the state it trains) wait beside it, and a graph built anew holds its constants too.
    let reference = match reference {
        Some(Reference { graph: r, built_anew }) => {
            let copies = 2 + u64::from(built_anew);
            Some(codegen::memory::peak_bytes(r, &HashSet::new())?.checked_add(constant_bytes(r).checked_mul(copies)?)?)
        }
        None => None,
    };
    match (devices, reference) {
        (Some((n, d)), Some(r)) => parts.push((
            format!("the larger of {n} device programs at their peak and the single-device reference after them"),
            d.max(r),
        )),
        (Some((n, d)), None) => parts.push((format!("{n} device programs at their peak"), d)),
        (None, Some(r)) => parts.push(("the single-device reference".into(), r)),
        (None, None) => {}
    }
    Some(Footprint { parts })
}

/// The most memory this process has held so far (its peak resident set, Linux's `VmHWM`),
/// bytes; `None` where the system does not say.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_count_what_the_graph_stores() {
        let mut g = Graph::new("g");
        g.add_initializer("w", ir::Tensor::from_f32(vec![3, 4], vec![0.5; 12]));
        g.add_initializer("i", ir::Tensor::from_i64(vec![2], vec![1, 2]));
        assert_eq!(constant_bytes(&g), 12 * 4 + 2 * 8);
        let f = Footprint { parts: vec![("a".into(), 5), ("b".into(), 7)] };
        assert_eq!(f.total(), 12);
        assert_eq!(f.describe(|b| format!("{b} B")), "a 5 B, b 7 B");
    }

    #[test]
    fn the_peak_resident_set_is_measured_on_linux() {
        let peak = peak_rss_bytes();
        assert_eq!(peak.is_some(), cfg!(target_os = "linux"));
        assert!(peak.is_none_or(|b| b > 1 << 20), "{peak:?}");
    }
}
