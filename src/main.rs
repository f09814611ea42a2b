//! The `shardc` command line; see `shardc --help`.

mod cli;

use clap::{Parser, Subcommand};

/// mimalloc: the search allocates many small vectors, and glibc's malloc took a third of a
/// Llama-3-405B search (`cargo bench --bench llm`: 59.1 s → 45.1 s).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(name = "shardc", version, about = "An automatic-parallelization compiler for DNN training", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// No progress bars (they are drawn only when stderr is a terminal).
    #[arg(short, long, global = true)]
    quiet: bool,
    /// Also print each pass's time and the search's phases per mesh on stderr.
    #[arg(short, long, global = true)]
    verbose: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Read a model, verify it, run passes, print it (text, JSON or DOT).
    Parse(cli::parse::ParseArgs),
    /// Node count, op histogram, parameters, FLOPs and activation bytes of one step.
    Stats(cli::stats::StatsArgs),
    /// Price a named strategy on a cluster: step time, its breakdown, memory per device.
    Cost(cli::cost::CostArgs),
    /// Search for the best sharding plan on a cluster: per-op strategies, layouts,
    /// collectives, predicted step time and memory.
    Plan(cli::plan::PlanArgs),
    /// A plan's per-device programs with explicit communication (text, JSON or DOT).
    Lower(cli::lower::LowerArgs),
    /// Compile a model to a plan (or take one), run it on simulated devices, check it.
    Run(cli::run::RunArgs),
    /// Train a model: the training graph (forward, loss, backward, optimizer update) run for
    /// some steps with weights and optimizer state resident on the devices, checked.
    Train(cli::train::TrainArgs),
    /// Prove that a training plan's per-device programs compute the training step (nothing
    /// runs): takes `train`'s options; exit 1 when the proof fails, naming the device and op.
    Verify(cli::train::VerifyArgs),
    /// Measure the simulated devices (GEMM, memory, dispatch, copies) and print a cluster file.
    Calibrate(cli::calibrate::CalibrateArgs),
    /// Compare strategies along batch, FLOP/s, memory bandwidth, link bandwidth or devices.
    Sweep(cli::sweep::SweepArgs),
    /// Print a cluster preset as TOML (a start for your own file), or check a cluster file.
    Cluster {
        /// A preset name or a TOML file.
        cluster: String,
    },
}

fn main() {
    // A panic is a bug in shardc, never the input's fault: say so plainly.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("internal error: shardc panicked: {info}");
        eprintln!("this is a bug in shardc; please report it with the command and input that caused it");
    }));
    // Mesa's Vulkan loader complains on every instance when XDG_RUNTIME_DIR is unset (as in
    // containers and CI); any writable directory quiets it.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: the process is single-threaded here; nothing reads the environment concurrently.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    one_heap();
    let cli = Cli::parse();
    cli::ui::set(cli.quiet, cli.verbose);
    cli::signals::install();
    let result = match &cli.command {
        Command::Parse(a) => cli::parse::run(a),
        Command::Stats(a) => cli::stats::run(a),
        Command::Cost(a) => cli::cost::run(a),
        Command::Sweep(a) => cli::sweep::run(a),
        Command::Plan(a) => cli::plan::run(a),
        Command::Lower(a) => cli::lower::run(a),
        Command::Run(a) => cli::run::run(a),
        Command::Train(a) => cli::train::run(a),
        Command::Verify(a) => cli::train::verify(&a.train, a.program.as_deref()),
        Command::Calibrate(a) => cli::calibrate::run(a),
        Command::Cluster { cluster } => cli::cost::load_cluster(cluster).and_then(|c| {
            let text = format!("# {}\n# {}\n{}", c.describe(), c.source, c.to_toml());
            cli::common::write_output(&text, None, std::path::Path::new(""))
        }),
    };
    if let Err(e) = result {
        eprint!("{}", e.message);
        std::process::exit(e.code);
    }
}

/// One malloc arena for the whole process: glibc otherwise gives each device thread its own,
/// and each keeps the tensors it freed (a 4-device ResNet-18 step peaked at 720 MB of RSS
/// for 560 MB of live heap; 580 MB with one arena, in the same time).
fn one_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called before any thread starts; mallopt only sets an allocator parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
