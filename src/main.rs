//! The `shardc` command line; see `shardc --help`.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "shardc", version, about = "An automatic-parallelization compiler for DNN training", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Read a model, verify it, run passes, print it (text, JSON or DOT).
    Parse(cli::parse::ParseArgs),
    /// Node count, op histogram, parameters, FLOPs and activation bytes of one step.
    Stats(cli::stats::StatsArgs),
}

fn main() {
    // A panic is a bug in shardc, never the input's fault: say so plainly.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("internal error: shardc panicked: {info}");
        eprintln!("this is a bug in shardc; please report it with the command and input that caused it");
    }));
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Parse(a) => cli::parse::run(a),
        Command::Stats(a) => cli::stats::run(a),
    };
    if let Err(e) = result {
        eprint!("{}", e.message);
        std::process::exit(e.code);
    }
}
