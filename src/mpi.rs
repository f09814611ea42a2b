//! The MPI transport: under `mpirun -np N`, each process (rank) runs one device of the
//! program and the devices' messages travel as MPI messages.
//!
//! Every collective and pipeline message of a lowered program is built from the runtime's
//! `put`/`take` ([`codegen::Transport`]); here `put` hands the message to a sender thread that
//! sends it to the destination rank (so a device never blocks on a send, as with the
//! in-process mailboxes, and rings of sends cannot deadlock), and `take` receives from the
//! source rank, keeping messages of other keys until they are asked for. The collectives run
//! the same ring algorithms in the same order as in one process, so results are identical to
//! the `threads` transport. A failing rank prints its message and aborts the job
//! (`MPI_Abort`), and `take` gives up after a timeout, so a job never hangs.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use codegen::{Key, Transport};
use ir::DType;
use ir::eval::{Array, Data};
use mpi::point_to_point::MatchedReceiveVec;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;

/// MPI, initialized with full thread support; finalized when dropped.
pub struct Mpi {
    _universe: mpi::environment::Universe,
    /// This process's rank.
    pub rank: usize,
    /// Processes in the job.
    pub size: usize,
}

impl Drop for Mpi {
    fn drop(&mut self) {
        // The groups' communicators are freed before MPI is finalized (the universe, dropped
        // after this).
        GROUPS.with(|g| g.borrow_mut().clear());
    }
}

impl Mpi {
    /// Initializes MPI (once per process). An error when the library cannot give full
    /// thread support (the sender thread sends while the device thread receives).
    pub fn init() -> Result<Mpi, String> {
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or("MPI was already initialized in this process")?;
        if level != mpi::Threading::Multiple {
            return Err(format!(
                "the MPI library gives thread support {level:?}; shardc needs Multiple (OpenMPI built with MPI_THREAD_MULTIPLE)"
            ));
        }
        let world = universe.world();
        Ok(Mpi { rank: world.rank() as usize, size: world.size() as usize, _universe: universe })
    }

    /// Ends the whole job with `code` after printing `message` (with this rank) on stderr.
    pub fn abort(&self, message: &str, code: i32) -> ! {
        abort_job(self.rank, message, code)
    }
}

fn abort_job(rank: usize, message: &str, code: i32) -> ! {
    eprintln!("error: rank {rank}: {}", message.trim_end().trim_start_matches("error: "));
    SimpleCommunicator::world().abort(code)
}

/// A message for the sender thread: the destination rank and the bytes.
type Outgoing = (usize, Vec<u8>);

/// The tag of shardc's messages on the world communicator (others are MPI's own, such as
/// the creation of a group's communicator).
const DATA_TAG: i32 = 7;
/// The tag under which a group's communicator is created.
const GROUP_TAG: i32 = 11;

/// The transport of one rank.
pub struct MpiTransport {
    rank: usize,
    /// All-reduce with MPI's own collective on the group's communicator (else the ring).
    native: bool,
    timeout: Duration,
    outbox: Mutex<Option<mpsc::Sender<Outgoing>>>,
    sender: Mutex<Option<std::thread::JoinHandle<()>>>,
    inbox: Mutex<HashMap<(usize, Key), VecDeque<Array>>>,
}

impl MpiTransport {
    /// The transport of this rank of `mpi`; `take` gives up after `timeout`. With `native`,
    /// all-reduces of float and integer tensors run as `MPI_Allreduce` on a communicator of
    /// the group (`MPI_Comm_create_group`): the library's tuned algorithm, whose summation
    /// order differs from the ring's (results equal within rounding, not bit for bit).
    pub fn new(mpi: &Mpi, timeout: Duration, native: bool) -> MpiTransport {
        let (tx, rx) = mpsc::channel::<Outgoing>();
        let sender = std::thread::spawn(move || {
            let world = SimpleCommunicator::world();
            for (to, bytes) in rx {
                world.process_at_rank(to as i32).send_with_tag(&bytes[..], DATA_TAG);
            }
        });
        MpiTransport {
            rank: mpi.rank,
            native,
            timeout,
            outbox: Mutex::new(Some(tx)),
            sender: Mutex::new(Some(sender)),
            inbox: Mutex::new(HashMap::new()),
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // Every message handed over is sent before MPI is finalized.
        drop(self.outbox.lock().map(|mut o| o.take()));
        if let Ok(mut s) = self.sender.lock()
            && let Some(h) = s.take()
        {
            let _ = h.join();
        }
    }
}

impl Transport for MpiTransport {
    fn put(&self, from: usize, to: usize, key: Key, a: Array) {
        debug_assert_eq!(from, self.rank);
        let bytes = encode(key, &a);
        if let Some(tx) = self.outbox.lock().expect("outbox").as_ref() {
            let _ = tx.send((to, bytes));
        }
    }

    fn take(&self, from: usize, to: usize, key: Key) -> Result<Array, String> {
        debug_assert_eq!(to, self.rank);
        let start = Instant::now();
        let world = SimpleCommunicator::world();
        loop {
            if let Some(a) = self.inbox.lock().expect("inbox").get_mut(&(from, key)).and_then(|q| q.pop_front()) {
                return Ok(a);
            }
            // Every message waiting for this rank is received, from any rank, not only the one
            // asked for: a large message is sent only once its receiver takes it (MPI's
            // rendezvous), and the sender's later messages (an all-reduce's chunks for another
            // rank) queue behind it, so a rank that took from one source alone could wait on
            // a rank whose sender waits on it (a pipeline stage of several devices did).
            match world.any_process().immediate_matched_probe_with_tag(DATA_TAG) {
                Some(probed) => {
                    let (bytes, status) = probed.matched_receive_vec::<u8>();
                    let source = status.source_rank() as usize;
                    let (k, a) = decode(&bytes).map_err(|e| format!("a garbled message from rank {source}: {e}"))?;
                    self.inbox.lock().expect("inbox").entry((source, k)).or_default().push_back(a);
                }
                None => {
                    if start.elapsed() > self.timeout {
                        return Err(format!(
                            "rank {to} waited {:.0} s for data from rank {from}; the job is stuck",
                            self.timeout.as_secs_f64()
                        ));
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
    }

    fn fail(&self, why: String) {
        // The other ranks may be waiting on this one: end the job.
        abort_job(self.rank, &why, 1)
    }

    fn native_all_reduce(&self, me: usize, group: &[i64], x: &Array, op: &str) -> Option<Result<Array, String>> {
        let op = self.native_op(x, op)?;
        on_group(me, group, |sub| all_reduce_on(sub, x, op))
    }

    fn native_all_gather(&self, me: usize, group: &[i64], x: &Array, axis: usize) -> Option<Result<Array, String>> {
        if !self.native || !native_data(x) || axis >= x.shape.len() {
            return None;
        }
        on_group(me, group, |sub| all_gather_on(sub, x, axis))
    }

    fn native_reduce_scatter(
        &self,
        me: usize,
        group: &[i64],
        x: &Array,
        axis: usize,
        op: &str,
    ) -> Option<Result<Array, String>> {
        let op = self.native_op(x, op)?;
        let pieces = codegen::layout::split_even(x, axis, group.len());
        // MPI_Reduce_scatter_block wants equal pieces; uneven ones take the ring (every member
        // sees the same shapes, so all decide alike).
        if pieces.iter().any(|p| p.numel() != pieces[0].numel()) {
            return None;
        }
        let rank = group.iter().position(|&g| g as usize == me)?;
        let shape = pieces[rank].shape.clone();
        let flat = codegen::layout::concat(
            &pieces
                .into_iter()
                .map(|p| {
                    let n = p.numel();
                    p.reshaped(vec![n])
                })
                .collect::<Vec<_>>(),
            0,
        );
        on_group(me, group, |sub| reduce_scatter_on(sub, &flat, shape, op))
    }
}

impl MpiTransport {
    /// The MPI reduction for `op`, when this transport reduces natively and has one for `x`.
    fn native_op(&self, x: &Array, op: &str) -> Option<mpi::collective::SystemOperation> {
        use mpi::collective::SystemOperation;
        if !self.native || !native_data(x) {
            return None;
        }
        Some(match op {
            "sum" => SystemOperation::sum(),
            "max" => SystemOperation::max(),
            "min" => SystemOperation::min(),
            "prod" => SystemOperation::product(),
            _ => return None,
        })
    }
}

/// Element types MPI's collectives carry here.
fn native_data(x: &Array) -> bool {
    matches!(x.data, Data::F32(_) | Data::F64(_) | Data::I64(_))
}

/// Runs `f` on the communicator of `group` (device `me` among them), created once by its
/// members and reused.
fn on_group(
    me: usize,
    group: &[i64],
    f: impl FnOnce(&SimpleCommunicator) -> Option<Result<Array, String>>,
) -> Option<Result<Array, String>> {
    GROUPS.with(|groups| {
        let mut groups = groups.borrow_mut();
        if !groups.contains_key(group) {
            let world = SimpleCommunicator::world();
            let ranks: Vec<i32> = group.iter().map(|&g| g as i32).collect();
            let Some(sub) = world.split_by_subgroup_with_tag(&world.group().include(&ranks), GROUP_TAG) else {
                return Some(Err(format!("rank {me} is not in the group {group:?} it communicates in")));
            };
            groups.insert(group.to_vec(), sub);
        }
        f(&groups[group])
    })
}

thread_local! {
    /// The communicators of the groups this rank's device all-reduces over (a communicator
    /// belongs to the thread that made it: MPI handles are not shared between threads here).
    static GROUPS: std::cell::RefCell<HashMap<Vec<i64>, SimpleCommunicator>> = std::cell::RefCell::new(HashMap::new());
}

/// The collective `$call` (over the input elements `$v` into a zeroed output `$out` of `$n`
/// elements) for each element type MPI's collectives carry here, keeping the type; the
/// enclosing function returns `None` (the ring) for the others.
macro_rules! per_element {
    ($data:expr, $n:expr, |$v:ident, $out:ident| $call:expr) => {
        match $data {
            Data::F32($v) => {
                let mut $out = vec![0f32; $n];
                $call;
                Data::F32($out)
            }
            Data::F64($v) => {
                let mut $out = vec![0f64; $n];
                $call;
                Data::F64($out)
            }
            Data::I64($v) => {
                let mut $out = vec![0i64; $n];
                $call;
                Data::I64($out)
            }
            _ => return None,
        }
    };
}

/// `MPI_Allreduce` of `x` on `sub` (float and integer elements).
fn all_reduce_on(
    sub: &SimpleCommunicator,
    x: &Array,
    op: mpi::collective::SystemOperation,
) -> Option<Result<Array, String>> {
    let data = per_element!(&x.data, v.len(), |v, out| sub.all_reduce_into(&v[..], &mut out[..], op));
    Some(Ok(Array { dtype: x.dtype, shape: x.shape.clone(), data }))
}

/// `MPI_Allgatherv` of `x`'s elements, then the members' pieces (their length along `axis`
/// from their element counts) concatenated along `axis` in group order.
fn all_gather_on(sub: &SimpleCommunicator, x: &Array, axis: usize) -> Option<Result<Array, String>> {
    use mpi::datatype::PartitionMut;
    let inner: usize = x.shape.iter().enumerate().filter(|(d, _)| *d != axis).map(|(_, s)| *s).product();
    if inner == 0 {
        return None;
    }
    let n = x.numel() as i32;
    let mut counts = vec![0i32; sub.size() as usize];
    sub.all_gather_into(&n, &mut counts[..]);
    let displs: Vec<i32> = counts.iter().scan(0, |a, &c| Some(std::mem::replace(a, *a + c))).collect();
    let total = counts.iter().sum::<i32>() as usize;
    let flat = per_element!(&x.data, total, |v, out| sub
        .all_gather_varcount_into(&v[..], &mut PartitionMut::new(&mut out[..], &counts[..], &displs[..])));
    let whole = Array { dtype: x.dtype, shape: vec![total], data: flat };
    let pieces: Vec<Array> = counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| {
            let mut shape = x.shape.clone();
            shape[axis] = c as usize / inner;
            codegen::layout::crop(&whole, &[(d as usize, (d + c) as usize)]).reshaped(shape)
        })
        .collect();
    Some(Ok(codegen::layout::concat(&pieces, axis)))
}

/// `MPI_Reduce_scatter_block` of `flat` (the members' equal pieces one after another): this
/// member's piece, of `shape`.
fn reduce_scatter_on(
    sub: &SimpleCommunicator,
    flat: &Array,
    shape: Vec<usize>,
    op: mpi::collective::SystemOperation,
) -> Option<Result<Array, String>> {
    let n: usize = shape.iter().product();
    let data = per_element!(&flat.data, n, |v, out| sub.reduce_scatter_block_into(&v[..], &mut out[..], op));
    Some(Ok(Array { dtype: flat.dtype, shape, data }))
}

/// A message: its key, then the array (dtype code, rank, dims, element kind, elements).
fn encode(key: Key, a: &Array) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + a.numel() * 4);
    for x in [key.0, key.1, key.2] {
        b.extend(x.to_le_bytes());
    }
    b.extend(a.dtype.code().to_le_bytes());
    b.extend((a.shape.len() as u64).to_le_bytes());
    for &d in &a.shape {
        b.extend((d as u64).to_le_bytes());
    }
    match &a.data {
        Data::F32(v) => {
            b.push(0);
            v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
        Data::F64(v) => {
            b.push(1);
            v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
        Data::I64(v) => {
            b.push(2);
            v.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
        Data::Bool(v) => {
            b.push(3);
            b.extend(v.iter().map(|&x| x as u8));
        }
        Data::Str(v) => {
            b.push(4);
            b.extend((v.len() as u64).to_le_bytes());
            for s in v {
                b.extend((s.len() as u64).to_le_bytes());
                b.extend(s.as_bytes());
            }
        }
    }
    b
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("message too short".into());
        }
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

fn decode(bytes: &[u8]) -> Result<(Key, Array), String> {
    let mut r = Reader(bytes);
    let key = (r.u64()?, r.u64()?, r.u64()?);
    let code = r.u64()? as i64;
    let dtype = DType::from_code(code).ok_or_else(|| format!("unknown element type {code}"))?;
    let rank = r.u64()? as usize;
    let shape = (0..rank).map(|_| r.u64().map(|d| d as usize)).collect::<Result<Vec<_>, _>>()?;
    let n: usize = shape.iter().product();
    let kind = r.take(1)?[0];
    let data = match kind {
        0 => Data::F32(r.take(4 * n)?.chunks(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect()),
        1 => Data::F64(r.take(8 * n)?.chunks(8).map(|c| f64::from_le_bytes(c.try_into().expect("8"))).collect()),
        2 => Data::I64(r.take(8 * n)?.chunks(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect()),
        3 => Data::Bool(r.take(n)?.iter().map(|&x| x != 0).collect()),
        4 => {
            let count = r.u64()? as usize;
            let mut v = Vec::with_capacity(count.min(1 << 20));
            for _ in 0..count {
                let len = r.u64()? as usize;
                v.push(String::from_utf8(r.take(len)?.to_vec()).map_err(|e| e.to_string())?);
            }
            Data::Str(v)
        }
        k => return Err(format!("unknown element kind {k}")),
    };
    Ok((key, Array { dtype, shape, data }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_round_trip() {
        let arrays = [
            ir::eval::Array::f32(vec![2, 2], vec![1.0, -2.5, f32::NAN, 4.0]),
            ir::eval::Array::i64(vec![3], vec![i64::MIN, 0, 7]),
            ir::eval::Array::bool(vec![2], vec![true, false]),
            ir::eval::Array {
                dtype: ir::DType::String,
                shape: vec![2],
                data: ir::eval::Data::Str(vec!["a".into(), "éé".into()]),
            },
        ];
        for a in arrays {
            let key = (u64::MAX, 3, 9);
            let (k, b) = super::decode(&super::encode(key, &a)).unwrap();
            assert_eq!(k, key);
            assert_eq!(format!("{:?}", b), format!("{a:?}"));
        }
        assert!(super::decode(&[1, 2, 3]).is_err());
    }
}
