//! `zerotrain train [SPEC.json] [--model-dir DIR] [--out DIR] [--export-shard-bytes SIZE]
//! [--device cuda[:N]] [--json]`: runs a job in this process, without the service, with a
//! progress bar (step, loss, loss scale, tokens/s) on stderr.

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use runner::data::DataRoots;
use runner::train::{Distributed, LogSink, Options, run};
use scheduler::bytes::{human, parse_size};
use scheduler::memory::Category;
use scheduler::plan::plan_local_on;
use scheduler::spec::{JobSpec, Purpose};

use crate::spec_file::SpecArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    spec: SpecArgs,
    /// Where checkpoints and the final Hugging Face export go.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    export: Export,
    /// Each rank's memory budget, e.g. 2GiB: the plan must fit it and the trainer enforces it.
    #[arg(long, value_parser = parse_size)]
    device_memory: Option<u64>,
    /// Where the ranks train: cpu, or cuda[:N] (GPU N; needs a build with feature cuda).
    #[arg(long, default_value = "cpu")]
    device: runner::device::Target,
    /// Kernel threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON summary at the end instead of a human one.
    #[arg(long)]
    json: bool,
    /// Run only this rank of the job, joining the others over TCP (needs --master).
    #[arg(long, requires = "master")]
    rank: Option<usize>,
    /// The number of ranks [default: the spec's world_size].
    #[arg(long)]
    world_size: Option<NonZeroU32>,
    /// Rank 0's rendezvous address, e.g. 10.0.0.1:29500 (rank 0 listens on it).
    #[arg(long, requires = "rank")]
    master: Option<SocketAddr>,
    /// Seconds a rank waits for a neighbour before failing.
    #[arg(long, default_value_t = 60)]
    comm_timeout: u64,
}

/// How the export is written, shared by `train`, `agent` and `up`'s local agent.
#[derive(clap::Args)]
pub(super) struct Export {
    /// The largest file of a job's Hugging Face export, e.g. 2GB or 500MiB: a larger export is
    /// written as transformers shards it (`model-KKKKK-of-NNNNN.safetensors` files of at most
    /// this size, unless one tensor alone is larger, and `model.safetensors.index.json`).
    #[arg(
        long,
        env = "ZEROTRAIN_EXPORT_SHARD_BYTES",
        value_name = "SIZE",
        default_value = "2GB",
        value_parser = parse_size
    )]
    pub(super) export_shard_bytes: u64,
}

/// A line above the progress bar, or on stderr where there is no bar (not a terminal).
fn above(bar: &ProgressBar, line: &str) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

pub fn run_cli(args: Args) -> anyhow::Result<()> {
    crate::process::for_training(args.threads);
    let text = args.spec.text()?;
    let parsed = JobSpec::parse(&text, Purpose::Train)?;
    for key in &parsed.unsupported_keys {
        eprintln!("warning: ignoring unsupported DeepSpeed key {key}");
    }
    let mut spec = parsed.spec;
    if let Some(n) = args.world_size {
        spec.world_size = n;
        spec.validate(Purpose::Train)?;
    }
    let bar = ProgressBar::new(u64::from(spec.training.steps.get())).with_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed}<{eta}]")
            .expect("a valid template"),
    );
    let opts = Options {
        device_memory: args.device_memory,
        device: args.device,
        out_dir: args.out,
        export_shard_bytes: Some(args.export.export_shard_bytes),
        comm_timeout: Some(Duration::from_secs(args.comm_timeout)),
        distributed: args
            .rank
            .zip(args.master)
            .map(|(rank, master)| Distributed { rank, master }),
        // The user's own process reads what the user can.
        data_roots: DataRoots::anywhere(),
        // Tokenizing's progress, above the step bar.
        log: Some(LogSink(Arc::new({
            let bar = bar.clone();
            move |line: &str| above(&bar, line)
        }))),
        ..Options::default()
    };
    // No service: the plan is made here, for `world_size` devices of the budget and kind.
    let plan = plan_local_on(&spec, args.device_memory, opts.device.kind())?;
    let summary = run(&spec, &plan, &opts, &mut |p| {
        bar.set_position(u64::from(p.step));
        bar.set_message(format!(
            "loss {:.4}  scale {}  {:.0} tok/s{}",
            p.loss,
            p.loss_scale,
            p.tokens_per_second,
            if p.skipped { "  (skipped)" } else { "" }
        ));
        if let Some(loss) = p.validation_loss {
            above(&bar, &format!("step {}: validation loss {loss:.4}", p.step));
        }
    })?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    println!(
        "{} steps: final loss {:.4}, {:.0} tokens/s (median step {:.3} s), {} skipped, loss scale {}",
        summary.steps,
        summary.final_loss,
        summary.tokens_per_second,
        summary.step_seconds_median,
        summary.skipped_steps,
        summary.loss_scale
    );
    if let Some(last) = summary.validation.last() {
        println!("validation loss {:.4} after step {}", last.loss, last.step);
    }
    for r in &summary.ranks {
        println!("rank {} peak memory (measured / predicted):", r.rank);
        for &c in Category::ALL {
            let (m, p) = (r.measured_peak_bytes.get(c), r.predicted_bytes.get(c));
            println!("  {:<12}{:>12} / {}", c.name(), human(m), human(p));
        }
    }
    let p = &summary.process;
    println!(
        "process peak resident set {} / predicted {} (the ranks and {} of process overhead for {} threads)",
        p.peak_rss_bytes.map_or("unknown".into(), human),
        human(p.predicted_bytes),
        human(p.overhead_bytes),
        p.threads
    );
    Ok(())
}
