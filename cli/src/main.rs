//! The `zerotrain` command line: one subcommand per module. The one crate that links the
//! service (`server`) and the trainer (`runner`): `train`, `agent` and `up` run ranks here.

mod agent;
mod cancel;
mod client;
mod estimate;
mod jobs;
mod logs;
mod process;
mod pull;
mod serve;
mod spec_file;
mod submit;
mod token;
mod train;
mod up;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

// The process's allocator: the system's, but gemm's packing buffer stays with the rank threads
// that keep a `kernels::matmul::Workspace` (a process that never trains never lends it).
#[global_allocator]
static ALLOCATOR: kernels::matmul::Allocator = kernels::matmul::Allocator;

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
    /// Run the whole service here: the server with SQLite under the data directory and one
    /// local agent with virtual CPU devices.
    Up(up::Args),
    /// Per-rank memory for ZeRO stages 0-3, communication per step, and the plan for a job spec.
    Estimate(estimate::Args),
    /// Train a job in this process, without the service.
    Train(train::Args),
    /// Offer this machine's devices to a server and run the ranks it assigns.
    Agent(agent::Args),
    /// Run the server (API, store, scheduler) without a local agent.
    Serve(serve::Args),
    /// Submit a job spec to the server; --wait follows it to the end.
    Submit(submit::Args),
    /// List jobs, newest first.
    Jobs(jobs::Args),
    /// Print a job's log; -f follows it.
    Logs(logs::Args),
    /// Cancel a job.
    Cancel(cancel::Args),
    /// Download a finished job's model (config.json + model.safetensors) into a folder
    /// `transformers`' from_pretrained loads.
    Pull(pull::Args),
    /// Create, list or revoke bearer tokens (admin).
    Token(token::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(args) => up::run(args),
        Command::Estimate(args) => estimate::run(args),
        Command::Train(args) => train::run_cli(args),
        Command::Agent(args) => agent::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Submit(args) => submit::run(args),
        Command::Jobs(args) => jobs::run(args),
        Command::Logs(args) => logs::run(args),
        Command::Cancel(args) => cancel::run(args),
        Command::Pull(args) => pull::run(args),
        Command::Token(args) => token::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<scheduler::Error>() {
                // One line per mistake of a spec.
                Some(scheduler::Error::InvalidSpec(errors)) => {
                    for m in errors {
                        eprintln!("error: {m}");
                    }
                }
                _ => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// clap checks a command line's definition only when parsing it, in debug builds: check
    /// every subcommand here rather than in a user's first run.
    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
