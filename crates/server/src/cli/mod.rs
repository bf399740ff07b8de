//! The `zerotrain` command line: one subcommand per module.

mod agent;
mod estimate;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "zerotrain",
    version,
    about = "ZeRO-sharded mixed-precision training as a service"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per-rank memory for ZeRO stages 0-3, communication per step, and the plan for a job spec.
    Estimate(estimate::Args),
    /// Train a job in this process, without the service.
    Train(train::Args),
    /// Offer this machine's devices to a server and run the ranks it assigns.
    Agent(agent::Args),
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Estimate(args) => estimate::run(args),
        Command::Train(args) => train::run_cli(args),
        Command::Agent(args) => agent::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
