//! How the devices of `train` and `run` exchange tensors: on threads of this process, or one
//! device per MPI process under `mpirun` (built with `--features mpi`); and `calibrate`'s
//! timing of the MPI transport.

use clap::Args;

use super::common::*;

/// `--transport`, `--mpi-all-reduce`, `--comm-timeout` (train and run).
#[derive(Args, Clone, Debug)]
pub struct TransportArgs {
    /// How devices exchange tensors: `threads` (every device in this process) or `mpi` (under
    /// `mpirun -np N`, one device per process; N must equal the plan's devices).
    #[arg(long, value_enum, default_value = "threads")]
    pub transport: TransportKind,
    /// Under `--transport mpi`: all-reduce, all-gather and reduce-scatter as the runtime's rings
    /// over point-to-point messages (`ring`, results bit-identical to `threads`) or as MPI's own
    /// collectives on each group's communicator (`native`: the library's tuned algorithms,
    /// equal within rounding).
    #[arg(long = "mpi-all-reduce", value_enum, default_value = "ring")]
    pub mpi_all_reduce: MpiAllReduce,
    /// Seconds a device waits for a message from another before the run is declared stuck.
    #[arg(long = "comm-timeout", value_name = "SECS", default_value_t = 300.0, value_parser = parse_seconds, allow_negative_numbers = true)]
    pub comm_timeout: f64,
}

impl TransportArgs {
    /// This process's MPI job under `--transport mpi` (`None` under threads); a rank other
    /// than 0 draws no progress (rank 0 reports for the job).
    pub fn start(&self) -> CliResult<Option<MpiJob>> {
        let mpi = match self.transport {
            TransportKind::Threads => None,
            TransportKind::Mpi => Some(start_mpi()?),
        };
        if mpi.as_ref().is_some_and(|m| m.rank != 0) {
            super::ui::set(true, super::ui::verbose());
            super::ui::mute_warnings();
        }
        Ok(mpi)
    }

    /// This process's part of running `program` on `devices` devices: under MPI its rank and
    /// transport ([`distributed`]); `None` runs every device here.
    pub fn distributed(
        &self,
        mpi: Option<&MpiJob>,
        devices: usize,
        program: &codegen::Program,
    ) -> CliResult<Option<codegen::Distributed>> {
        mpi.map(|m| distributed(m, devices, program, self.comm_timeout, self.mpi_all_reduce)).transpose()
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportKind {
    /// Every device on a thread of this process.
    Threads,
    /// One device per MPI process (built with `--features mpi`).
    Mpi,
}

/// How the MPI transport all-reduces.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MpiAllReduce {
    /// The runtime's ring over point-to-point messages.
    Ring,
    /// MPI_Allreduce on the group's communicator.
    Native,
}

/// The MPI job of this process.
#[cfg(feature = "mpi")]
pub type MpiJob = shardc::mpi::Mpi;
/// The MPI job of this process (none in a build without MPI).
#[cfg(not(feature = "mpi"))]
pub type MpiJob = NoMpi;

/// Stands for MPI in a shardc built without it (never constructed).
#[cfg(not(feature = "mpi"))]
pub struct NoMpi {
    rank: usize,
}

#[cfg(feature = "mpi")]
fn start_mpi() -> CliResult<MpiJob> {
    shardc::mpi::Mpi::init().map_err(CliError::msg)
}

#[cfg(not(feature = "mpi"))]
fn start_mpi() -> CliResult<MpiJob> {
    let _ = NoMpi { rank: 0 }.rank;
    Err(CliError::msg(
        "--transport mpi: this shardc was built without MPI; build it with `cargo build --release --features mpi` \
         (Debian: apt-get install libopenmpi-dev openmpi-bin libclang-dev) and start it with mpirun -np N",
    ))
}

/// This process's part of the job: its rank and the MPI transport, once the job's size is
/// checked against the program's devices and every rank's program is the same as rank 0's.
#[cfg(feature = "mpi")]
fn distributed(
    m: &MpiJob,
    devices: usize,
    program: &codegen::Program,
    timeout: f64,
    all_reduce: MpiAllReduce,
) -> CliResult<codegen::Distributed> {
    use codegen::Transport;
    use sha2::Digest;
    if m.size != devices {
        let msg = format!(
            "--transport mpi: the plan has {devices} devices but mpirun started {} processes; run mpirun -np {devices} (or --devices {})",
            m.size, m.size
        );
        m.abort(&msg, 1);
    }
    let t = std::sync::Arc::new(shardc::mpi::MpiTransport::new(
        m,
        std::time::Duration::from_secs_f64(timeout),
        all_reduce == MpiAllReduce::Native,
    ));
    // Every rank planned and lowered on its own: the programs must be the same.
    let text: String = program.devices.iter().map(|d| ir::print::model_to_string(&d.to_model())).collect();
    let digest = sha2::Sha256::digest(text.as_bytes());
    let word = i64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    let key = (u64::MAX - 2, 0, 0);
    if m.rank != 0 {
        t.put(m.rank, 0, key, ir::eval::Array::i64(vec![1], vec![word]));
    } else {
        for r in 1..m.size {
            let got = t.take(r, 0, key).map_err(CliError::msg)?;
            if !matches!(&got.data, ir::eval::Data::I64(v) if v.first() == Some(&word)) {
                m.abort(
                    &format!("rank {r} lowered another program than rank 0 (a plan search cut short by --time-limit on one rank?); give them a --plan"),
                    1,
                );
            }
        }
    }
    Ok(codegen::Distributed { rank: m.rank, size: m.size, transport: t })
}

#[cfg(not(feature = "mpi"))]
fn distributed(_: &MpiJob, _: usize, _: &codegen::Program, _: f64, _: MpiAllReduce) -> CliResult<codegen::Distributed> {
    unreachable!("start_mpi refuses without the mpi feature")
}

/// `(bytes, median seconds)` per size.
pub type Timings = Vec<(f64, f64)>;

/// Times the MPI transport's all-reduce over groups of the job's ranks
/// ([`shardc::calibrate::group_sizes`], [`shardc::calibrate::time_all_reduce`]): on rank 0 the
/// timings per group size (`None` on the others).
#[cfg(feature = "mpi")]
pub fn mpi_all_reduce(sizes: &[usize], reps: usize, native: bool) -> CliResult<Option<Vec<(usize, Timings)>>> {
    let m = start_mpi()?;
    let t = shardc::mpi::MpiTransport::new(&m, std::time::Duration::from_secs(60), native);
    let mut all = Vec::new();
    for g in shardc::calibrate::group_sizes(m.size) {
        all.push((g, shardc::calibrate::time_all_reduce(&t, m.rank, g, sizes, reps).map_err(CliError::msg)?));
    }
    drop(t);
    Ok((m.rank == 0).then_some(all))
}

#[cfg(not(feature = "mpi"))]
pub fn mpi_all_reduce(_: &[usize], _: usize, _: bool) -> CliResult<Option<Vec<(usize, Timings)>>> {
    start_mpi().map(|_| None)
}
