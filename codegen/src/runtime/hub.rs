//! In-process communication between simulated devices: mailboxes on the host, and the
//! collectives built from them with ring algorithms (as NCCL runs them over links):
//! reduce-scatter and all-gather pass one chunk per step to the next device of the ring;
//! all-reduce is the two in turn; all-to-all and halo exchange are direct sends.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use ir::eval::{Array, Data};

use crate::layout::{combine, concat, crop, even_piece};

/// What a mailbox message is keyed by: a channel (a group's collective or a send tag), a
/// sequence number and a step.
pub type Key = (u64, u64, u64);

/// How devices hand each other tensors: every collective and pipeline message of a program
/// is built from `put` (never blocks: the message waits in the receiver's mailbox) and
/// `take` (waits for the message with that key from that device). [`Hub`] serves the devices
/// of one process; another process-spanning implementation (MPI) gives the same results,
/// since the collectives' arithmetic and order are the same.
pub trait Transport: Sync {
    /// Sends `a` from device `from` to device `to` under `key`.
    fn put(&self, from: usize, to: usize, key: Key, a: Array);
    /// The message from `from` to `to` under `key`, waiting for it; an error when the run
    /// failed elsewhere or the wait times out.
    fn take(&self, from: usize, to: usize, key: Key) -> Result<Array, String>;
    /// Marks the run failed so that waiting devices stop.
    fn fail(&self, why: String);
    /// The transport's own all-reduce of `x` over `group` (device `me` among them), when it
    /// has one for this element type and reduction (MPI's, on the group's communicator);
    /// `None`: the ring algorithm over `put`/`take`. Every member must get the same answer.
    fn native_all_reduce(&self, me: usize, group: &[i64], x: &Array, op: &str) -> Option<Result<Array, String>> {
        let _ = (me, group, x, op);
        None
    }
    /// The transport's own all-gather (pieces along `axis` concatenated in group order), as
    /// [`Transport::native_all_reduce`].
    fn native_all_gather(&self, me: usize, group: &[i64], x: &Array, axis: usize) -> Option<Result<Array, String>> {
        let _ = (me, group, x, axis);
        None
    }
    /// The transport's own reduce-scatter (member `r` gets piece `r` along `axis` of the
    /// reduction, the pieces as [`crate::layout::split_even`] cuts them), as
    /// [`Transport::native_all_reduce`].
    fn native_reduce_scatter(
        &self,
        me: usize,
        group: &[i64],
        x: &Array,
        axis: usize,
        op: &str,
    ) -> Option<Result<Array, String>> {
        let _ = (me, group, x, axis, op);
        None
    }
}

/// A device's view of a transport: its id, and its collective counters per group.
pub struct Port<'h> {
    hub: &'h dyn Transport,
    me: usize,
    seq: HashMap<Vec<i64>, u64>,
}

impl<'h> Port<'h> {
    /// Device `me`'s port on `t`.
    pub fn new(t: &'h dyn Transport, me: usize) -> Port<'h> {
        Port { hub: t, me, seq: HashMap::new() }
    }
}

/// Mailboxes between the devices of one process.
pub struct Hub {
    boxes: Mutex<HashMap<(usize, usize, Key), VecDeque<Array>>>,
    ready: Condvar,
    timeout: Duration,
    failed: Mutex<Option<String>>,
}

fn group_key(group: &[i64]) -> u64 {
    // FNV-1a over the ids: stable across devices.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in group {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

impl Hub {
    /// Mailboxes whose `take` gives up after `timeout`.
    pub fn new(timeout: Duration) -> Hub {
        Hub { boxes: Mutex::new(HashMap::new()), ready: Condvar::new(), timeout, failed: Mutex::new(None) }
    }

    /// Device `me`'s port.
    pub fn port(&self, me: usize) -> Port<'_> {
        Port::new(self, me)
    }
}

impl Transport for Hub {
    fn fail(&self, why: String) {
        let mut f = self.failed.lock().expect("hub lock");
        if f.is_none() {
            *f = Some(why);
        }
        self.ready.notify_all();
    }

    fn put(&self, from: usize, to: usize, key: Key, a: Array) {
        let mut b = self.boxes.lock().expect("hub lock");
        b.entry((from, to, key)).or_default().push_back(a);
        self.ready.notify_all();
    }

    fn take(&self, from: usize, to: usize, key: Key) -> Result<Array, String> {
        let start = Instant::now();
        let mut b = self.boxes.lock().expect("hub lock");
        loop {
            if let Some(q) = b.get_mut(&(from, to, key))
                && let Some(a) = q.pop_front()
            {
                return Ok(a);
            }
            if let Some(why) = self.failed.lock().expect("hub lock").clone() {
                return Err(format!("stopped: {why}"));
            }
            let left = self.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(format!(
                    "device {to} waited {:.0} s for data from device {from}; the program is stuck",
                    self.timeout.as_secs_f64()
                ));
            }
            b = self.ready.wait_timeout(b, left.min(Duration::from_millis(200))).expect("hub lock").0;
        }
    }
}

/// Chunk `j` of `parts` of `a`'s elements in flat order.
fn flat_chunk(a: &Array, parts: usize, j: usize) -> Array {
    let n = a.numel();
    let (start, end) = (j * n / parts, (j + 1) * n / parts);
    a.gather(vec![end - start], start..end)
}

/// The chunks of [`flat_chunk`] joined as an array of `shape`, each freed once appended.
fn join_flat(chunks: Vec<Array>, shape: &[usize]) -> Result<Array, String> {
    let mut it = chunks.into_iter();
    let mut out = it.next().ok_or("a collective over no devices")?;
    for c in it {
        out.append_flat(c).map_err(|e| e.to_string())?;
    }
    Ok(out.reshaped(shape.to_vec()))
}

impl Port<'_> {
    fn next_seq(&mut self, group: &[i64]) -> u64 {
        let s = self.seq.entry(group.to_vec()).or_insert(0);
        *s += 1;
        *s
    }

    fn rank(&self, group: &[i64]) -> Result<usize, String> {
        group
            .iter()
            .position(|&x| x as usize == self.me)
            .ok_or_else(|| format!("device {} is not in group {group:?}", self.me))
    }

    /// Ring reduce-scatter of the `p` pieces `piece(j)` cuts from the operand: the member at
    /// `rank` gets the reduction of piece `rank`. A piece is cut when the ring reaches it and
    /// moved on once sent, so a member holds about two pieces at a time, not a copy of its
    /// whole operand.
    fn ring_reduce_scatter(
        &mut self,
        group: &[i64],
        seq: u64,
        piece: impl Fn(usize) -> Array,
        op: &str,
    ) -> Result<Array, String> {
        let p = group.len();
        let rank = self.rank(group)?;
        let (next, prev) = (group[(rank + 1) % p] as usize, group[(rank + p - 1) % p] as usize);
        let ch = group_key(group);
        // The piece summed at the previous step, which this step sends on.
        let mut summed: Option<Array> = None;
        for s in 0..p.saturating_sub(1) {
            let send = (rank + 2 * p - s - 1) % p;
            let recv = (rank + 2 * p - s - 2) % p;
            let out = summed.take().unwrap_or_else(|| piece(send));
            self.hub.put(self.me, next, (ch, seq, s as u64), out);
            let got = self.hub.take(prev, self.me, (ch, seq, s as u64))?;
            let mut mine = piece(recv);
            combine(&mut mine, &got, op);
            summed = Some(mine);
        }
        Ok(summed.unwrap_or_else(|| piece(rank)))
    }

    /// Ring all-gather: on entry the member at `rank` holds piece `rank`; on exit all.
    fn ring_all_gather(&mut self, group: &[i64], seq: u64, pieces: &mut [Array], step0: u64) -> Result<(), String> {
        let p = group.len();
        let rank = self.rank(group)?;
        let (next, prev) = (group[(rank + 1) % p] as usize, group[(rank + p - 1) % p] as usize);
        let ch = group_key(group);
        for s in 0..p.saturating_sub(1) {
            let send = (rank + p - s) % p;
            let recv = (rank + 2 * p - s - 1) % p;
            let key = (ch, seq, step0 + s as u64);
            self.hub.put(self.me, next, key, pieces[send].clone());
            pieces[recv] = self.hub.take(prev, self.me, key)?;
        }
        Ok(())
    }

    /// Sum (or max, min, prod) over the group, every member gets the result.
    pub fn all_reduce(&mut self, group: &[i64], x: &Array, op: &str) -> Result<Array, String> {
        if group.len() <= 1 {
            return Ok(x.clone());
        }
        if let Some(r) = self.hub.native_all_reduce(self.me, group, x, op) {
            return r;
        }
        let seq = self.next_seq(group);
        let p = group.len();
        let rank = self.rank(group)?;
        let mine = self.ring_reduce_scatter(group, seq, |j| flat_chunk(x, p, j), op)?;
        let mut chunks: Vec<Array> = (0..p).map(|_| nothing(x)).collect();
        chunks[rank] = mine;
        self.ring_all_gather(group, seq, &mut chunks, p as u64)?;
        join_flat(chunks, &x.shape)
    }

    /// Every member's piece, concatenated along `axis` in group order.
    pub fn all_gather(&mut self, group: &[i64], x: &Array, axis: usize) -> Result<Array, String> {
        if group.len() <= 1 {
            return Ok(x.clone());
        }
        if let Some(r) = self.hub.native_all_gather(self.me, group, x, axis) {
            return r;
        }
        let seq = self.next_seq(group);
        let rank = self.rank(group)?;
        let mut pieces: Vec<Array> = (0..group.len()).map(|_| nothing(x)).collect();
        pieces[rank] = x.clone();
        self.ring_all_gather(group, seq, &mut pieces, 0)?;
        Ok(concat(&pieces, axis))
    }

    /// The member's piece (along `axis`) of the reduction over the group.
    pub fn reduce_scatter(&mut self, group: &[i64], x: &Array, axis: usize, op: &str) -> Result<Array, String> {
        if group.len() <= 1 {
            return Ok(x.clone());
        }
        if let Some(r) = self.hub.native_reduce_scatter(self.me, group, x, axis, op) {
            return r;
        }
        let seq = self.next_seq(group);
        self.ring_reduce_scatter(group, seq, |j| even_piece(x, axis, group.len(), j), op)
    }

    /// Piece `j` (along `split_axis`) to member `j`; received pieces concatenated along
    /// `concat_axis` in group order.
    pub fn all_to_all(
        &mut self,
        group: &[i64],
        x: &Array,
        split_axis: usize,
        concat_axis: usize,
    ) -> Result<Array, String> {
        if group.len() <= 1 {
            return Ok(x.clone());
        }
        let seq = self.next_seq(group);
        let rank = self.rank(group)?;
        let ch = group_key(group);
        for j in (0..group.len()).filter(|&j| j != rank) {
            let piece = even_piece(x, split_axis, group.len(), j);
            self.hub.put(self.me, group[j] as usize, (ch, seq, 0), piece);
        }
        let mut got = Vec::with_capacity(group.len());
        for (j, &m) in group.iter().enumerate() {
            got.push(if j == rank {
                even_piece(x, split_axis, group.len(), j)
            } else {
                self.hub.take(m as usize, self.me, (ch, seq, 0))?
            });
        }
        Ok(concat(&got, concat_axis))
    }

    /// Halo exchange along `axis`: `widths = [from_prev, from_next, to_prev, to_next]` rows.
    pub fn halo(&mut self, group: &[i64], x: &Array, axis: usize, widths: &[i64]) -> Result<Array, String> {
        let seq = self.next_seq(group);
        let rank = self.rank(group)?;
        let ch = group_key(group);
        let w = |i: usize| widths.get(i).copied().unwrap_or(0).max(0) as usize;
        let (from_prev, from_next, to_prev, to_next) = (w(0), w(1), w(2), w(3));
        let n = x.shape[axis];
        let rows = |s: usize, e: usize| -> Array {
            let ranges: Vec<(usize, usize)> =
                (0..x.shape.len()).map(|d| if d == axis { (s, e) } else { (0, x.shape[d]) }).collect();
            crop(x, &ranges)
        };
        if to_prev > 0 && rank > 0 {
            self.hub.put(self.me, group[rank - 1] as usize, (ch, seq, 1), rows(0, to_prev.min(n)));
        }
        if to_next > 0 && rank + 1 < group.len() {
            self.hub.put(self.me, group[rank + 1] as usize, (ch, seq, 0), rows(n - to_next.min(n), n));
        }
        let mut parts = Vec::new();
        if from_prev > 0 && rank > 0 {
            parts.push(self.hub.take(group[rank - 1] as usize, self.me, (ch, seq, 0))?);
        }
        parts.push(x.clone());
        if from_next > 0 && rank + 1 < group.len() {
            parts.push(self.hub.take(group[rank + 1] as usize, self.me, (ch, seq, 1))?);
        }
        Ok(if parts.len() == 1 { x.clone() } else { concat(&parts, axis) })
    }

    /// Point-to-point send (never blocks).
    pub fn send(&mut self, peer: usize, tag: i64, micro: usize, x: &Array) {
        self.hub.put(self.me, peer, (u64::MAX, tag as u64, micro as u64), x.clone());
    }

    /// Point-to-point receive.
    pub fn recv(&mut self, peer: usize, tag: i64, micro: usize) -> Result<Array, String> {
        self.hub.take(peer, self.me, (u64::MAX, tag as u64, micro as u64))
    }
}

/// An empty array of `x`'s type: a place a ring fills.
fn nothing(x: &Array) -> Array {
    Array { dtype: x.dtype, shape: vec![0], data: x.data.empty_like() }
}

/// Zeros of `x`'s shape and type.
#[allow(dead_code)]
pub(crate) fn zeros_of(x: &Array) -> Array {
    let data = match &x.data {
        Data::F32(v) => Data::F32(vec![0.0; v.len()]),
        Data::F64(v) => Data::F64(vec![0.0; v.len()]),
        Data::I64(v) => Data::I64(vec![0; v.len()]),
        Data::Bool(v) => Data::Bool(vec![false; v.len()]),
        Data::Str(v) => Data::Str(vec![String::new(); v.len()]),
    };
    Array { dtype: x.dtype, shape: x.shape.clone(), data }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::split_even;

    fn run<F: Fn(&mut Port<'_>, usize) -> Array + Sync>(p: usize, f: F) -> Vec<Array> {
        let hub = Hub::new(Duration::from_secs(10));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..p)
                .map(|i| {
                    let hub = &hub;
                    let f = &f;
                    s.spawn(move || f(&mut hub.port(i), i))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ring_collectives_compute_what_they_should() {
        for p in [2usize, 3, 4] {
            let group: Vec<i64> = (0..p as i64).collect();
            let x = |i: usize| Array::f32(vec![2, 6], (0..12).map(|k| (k + 100 * i) as f32).collect());
            let sum: Vec<f32> = (0..12).map(|k| (0..p).map(|i| (k + 100 * i) as f32).sum()).collect();
            for r in run(p, |port, i| port.all_reduce(&group, &x(i), "sum").unwrap()) {
                assert_eq!(r.as_f32().unwrap(), sum.as_slice());
            }
            let outs = run(p, |port, i| port.all_gather(&group, &x(i), 0).unwrap());
            let want = concat(&(0..p).map(x).collect::<Vec<_>>(), 0);
            assert!(outs.iter().all(|o| *o == want));
            if 6 % p == 0 {
                let outs = run(p, |port, i| port.reduce_scatter(&group, &x(i), 1, "sum").unwrap());
                let full = Array::f32(vec![2, 6], sum.clone());
                let want = split_even(&full, 1, p);
                assert_eq!(outs, want);
                // All-to-all: split along dim 1, concatenate along dim 0.
                let outs = run(p, |port, i| port.all_to_all(&group, &x(i), 1, 0).unwrap());
                for (j, o) in outs.iter().enumerate() {
                    let want = concat(&(0..p).map(|i| split_even(&x(i), 1, p)[j].clone()).collect::<Vec<_>>(), 0);
                    assert_eq!(*o, want);
                }
            }
        }
    }

    #[test]
    fn halo_exchange_brings_neighbour_rows() {
        let group = vec![0i64, 1, 2];
        let x = |i: usize| Array::f32(vec![3, 1], (0..3).map(|k| (10 * i + k) as f32).collect());
        let outs = run(3, |port, i| {
            let w = [
                if i > 0 { 1 } else { 0 },
                if i < 2 { 1 } else { 0 },
                if i > 0 { 1 } else { 0 },
                if i < 2 { 1 } else { 0 },
            ];
            port.halo(&group, &x(i), 0, &w).unwrap()
        });
        assert_eq!(outs[0].as_f32().unwrap(), &[0.0, 1.0, 2.0, 10.0]);
        assert_eq!(outs[1].as_f32().unwrap(), &[2.0, 10.0, 11.0, 12.0, 20.0]);
        assert_eq!(outs[2].as_f32().unwrap(), &[12.0, 20.0, 21.0, 22.0]);
    }
}
