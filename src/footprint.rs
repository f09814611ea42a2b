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
    /// Of the total, the bytes the process already holds when the promise is made: the
    /// constants of the graphs it has loaded, and the part [`Footprint::measure_process`]
    /// measured. What the host must still give is the total less these.
    pub resident: u64,
}

impl Footprint {
    /// The whole promise, bytes (saturating).
    pub fn total(&self) -> u64 {
        self.parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b))
    }

    /// What the host must still give for the run: the total less what the process holds.
    pub fn to_come(&self) -> u64 {
        self.total().saturating_sub(self.resident)
    }

    /// Adds what the process itself holds beyond the graphs and tensors counted, measured now:
    /// its code, libraries and drivers (the resident set less the loaded constants, which a
    /// part already counts), and for a run on `gpu_devices` GPU devices, the host memory each
    /// device's driver takes (`per_device`, measured by opening one: see
    /// [`codegen::runtime::gpu_device_host_bytes`]). Nothing is added where the resident set
    /// cannot be read.
    pub fn measure_process(&mut self, gpu_devices: usize, per_device: Option<u64>) {
        let Some(now) = codegen::runtime::resident_bytes() else { return };
        let own = now.saturating_sub(self.resident);
        self.parts.push(("the process (code, libraries, drivers; measured)".into(), own));
        self.resident = self.resident.saturating_add(own);
        if let Some(each) = per_device.filter(|_| gpu_devices > 0) {
            let what = format!("GPU driver state of {gpu_devices} devices (measured on one)");
            self.parts.push((what, each.saturating_mul(gpu_devices as u64)));
        }
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
    // The graphs the driver holds are loaded when the promise is made.
    Some(Footprint { parts, resident: held_bytes })
}

/// The most memory this process has held so far (its peak resident set, Linux's `VmHWM`),
/// bytes; `None` where the system does not say.
pub fn peak_rss_bytes() -> Option<u64> {
    codegen::runtime::status_bytes("VmHWM:")
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
        let f = Footprint { parts: vec![("a".into(), 5), ("b".into(), 7)], resident: 3 };
        assert_eq!(f.total(), 12);
        assert_eq!(f.describe(|b| format!("{b} B")), "a 5 B, b 7 B");
        assert_eq!(f.to_come(), 9);
    }

    #[test]
    fn the_process_is_measured_beside_the_parts() {
        let mut f = Footprint { parts: vec![("constants".into(), 1 << 20)], resident: 1 << 20 };
        f.measure_process(2, Some(3 << 20));
        if cfg!(target_os = "linux") {
            let now = codegen::runtime::resident_bytes().unwrap();
            assert_eq!(f.parts.len(), 3, "{f:?}");
            // The measured part is the resident set less the constants already counted, and
            // all of it is held now; the GPU devices are still to come.
            assert!(f.parts[1].1 + (1 << 20) >= now - (1 << 20) && f.resident >= f.parts[1].1, "{f:?} {now}");
            assert_eq!(f.parts[2].1, 6 << 20);
            assert_eq!(f.to_come(), 6 << 20);
        }
    }

    #[test]
    fn the_peak_resident_set_is_measured_on_linux() {
        let peak = peak_rss_bytes();
        assert_eq!(peak.is_some(), cfg!(target_os = "linux"));
        assert!(peak.is_none_or(|b| b > 1 << 20), "{peak:?}");
    }
}
