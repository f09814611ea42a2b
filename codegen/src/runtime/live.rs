//! The device storage a run holds, counted once per allocation: its peak is the run's
//! measured memory.

use std::collections::HashMap;

/// Live device storage, counted once per allocation.
pub(super) struct Live {
    pub(super) by_storage: HashMap<usize, (u64, usize)>,
    pub(super) bytes: u64,
    pub(super) peak: u64,
    /// What was live when the step's micro-batches began (`u64::MAX` outside them).
    pub(super) base: u64,
    /// The most bytes above `base`.
    pub(super) act_peak: u64,
}

impl Live {
    pub(super) fn add(&mut self, (id, b): (usize, u64)) {
        let e = self.by_storage.entry(id).or_insert((b, 0));
        if e.1 == 0 {
            self.bytes += b;
        }
        e.1 += 1;
        self.peak = self.peak.max(self.bytes);
        self.act_peak = self.act_peak.max(self.bytes.saturating_sub(self.base));
    }

    pub(super) fn remove(&mut self, (id, _): (usize, u64)) {
        if let Some(e) = self.by_storage.get_mut(&id) {
            e.1 -= 1;
            if e.1 == 0 {
                self.bytes -= e.0;
                self.by_storage.remove(&id);
            }
        }
    }
}
