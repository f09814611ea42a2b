//! The wall-clock safety net of the search.
//!
//! The search is bounded by work, not time: e-graph nodes and iterations, strategies per op,
//! dynamic-program states, plans priced by local search, pipeline configurations. Those
//! budgets alone decide the plan, so the same command gives the same plan on an idle and on a
//! loaded machine. The wall-clock limit (`--time-limit`) stays as a safety net: when it fires,
//! the phase that was running stops early, the plan says so and names the budgets it cut.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The deadline of one search, with a record of what it cut.
#[derive(Debug)]
pub struct SafetyNet {
    start: Instant,
    limit: Duration,
    /// Elapsed time is multiplied by this (tests simulate a slower machine with it).
    clock_scale: f64,
    fired: AtomicBool,
    cut: Mutex<BTreeSet<&'static str>>,
}

impl SafetyNet {
    /// A net that fires `limit` after now; `clock_scale` > 1 makes time pass faster (a machine
    /// that many times slower).
    pub fn new(limit: Duration, clock_scale: f64) -> SafetyNet {
        SafetyNet {
            start: Instant::now(),
            limit,
            clock_scale: if clock_scale.is_finite() && clock_scale > 0.0 { clock_scale } else { 1.0 },
            fired: AtomicBool::new(false),
            cut: Mutex::new(BTreeSet::new()),
        }
    }

    /// Time on the (possibly scaled) clock since the search started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed().mul_f64(self.clock_scale)
    }

    /// Time left before the net fires, in real time (for libraries that take a time limit).
    pub fn remaining(&self) -> Duration {
        self.limit.saturating_sub(self.elapsed()).div_f64(self.clock_scale)
    }

    /// True when the net has fired; the phase `what` then records that it was cut short.
    pub fn expired(&self, what: &'static str) -> bool {
        if self.fired.load(Ordering::Relaxed) || self.elapsed() > self.limit {
            self.fired.store(true, Ordering::Relaxed);
            self.record(what);
            true
        } else {
            false
        }
    }

    /// Records that `what` was cut short by the net (e.g. egg stopped on its time limit).
    pub fn record(&self, what: &'static str) {
        self.fired.store(true, Ordering::Relaxed);
        self.cut.lock().expect("the safety net's lock").insert(what);
    }

    /// The net fired.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::Relaxed)
    }

    /// The budgets it cut, sorted.
    pub fn cut(&self) -> Vec<String> {
        self.cut.lock().expect("the safety net's lock").iter().map(|s| s.to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scaled_clock_fires_early_and_names_the_phase() {
        let net = SafetyNet::new(Duration::from_secs(3600), 1.0);
        assert!(!net.expired("dp"));
        assert!(net.cut().is_empty());
        let net = SafetyNet::new(Duration::from_nanos(1), 1e12);
        std::thread::sleep(Duration::from_millis(1));
        assert!(net.expired("local-search"));
        assert!(net.expired("dp"));
        assert!(net.fired());
        assert_eq!(net.cut(), ["dp", "local-search"]);
        assert_eq!(net.remaining(), Duration::ZERO);
    }
}
