//! What the runner's benchmarks share: llm.c's FLOP count, the AdamW job they time, a timed
//! training run, order statistics of step times, PyTorch's side, row filters, and the roofline
//! of a step's products (`roofline`).
#![allow(dead_code)] // each bench uses its own part

use runner::step_timers;
use runner::train::{Options, Progress, run};
use scheduler::model::ModelShape;
use scheduler::plan::{Plan, plan_local};
use scheduler::spec::{JobSpec, Purpose};

// The benches run as the `zerotrain` binary does: its allocator, and its start-up's heap setting
// and kernel pool (`setup`).
#[global_allocator]
static ALLOCATOR: kernels::matmul::Allocator = kernels::matmul::Allocator;

#[path = "../../../cli/src/process.rs"]
mod process;
pub mod roofline;

/// Sets this bench's process up as `zerotrain train` sets itself up (all cores); first thing.
pub fn setup() {
    process::for_training(None);
}

/// Training FLOPs per token as llm.c counts them: 6 per parameter (forward and backward) and
/// 6·L·H·D·T for the attention scores and their weighted sum at sequence length `t`.
pub fn flops_per_token(model: &ModelShape, t: usize) -> f64 {
    let s = model.summary();
    let attention = s.layers * s.attention_heads * s.head_dim * t;
    6.0 * model.parameter_count() as f64 + 6.0 * attention as f64
}

/// A run's step times in seconds.
pub struct Steps {
    /// The first step, which also pays for what a job does once (its first optimizer step
    /// writes the optimizer state for the first time).
    pub first: f64,
    /// Each step after the warm-up.
    pub measured: Vec<f64>,
}

/// Trains `spec` by `plan` and returns its first step's seconds and each step's after the
/// first `warmup` (at least 1); fails naming `what` if the loss is not finite.
pub fn step_seconds(
    spec: &JobSpec,
    plan: &Plan,
    opts: &Options,
    warmup: usize,
    what: &str,
) -> Steps {
    let mut seconds = Vec::new();
    let mut progress = |p: Progress| {
        seconds.push(p.step_seconds);
        if seconds.len() == warmup {
            // The kernel groups' time (when timed) of the measured steps only.
            step_timers::take();
        }
    };
    let summary = run(spec, plan, opts, &mut progress).expect("training runs");
    assert!(
        summary.final_loss.is_finite(),
        "{what}: loss {}",
        summary.final_loss
    );
    let first = seconds[0];
    seconds.drain(..warmup);
    Steps {
        first,
        measured: seconds,
    }
}

/// A mean step: its seconds, and those in each kernel group.
pub type MeanStep = (f64, Vec<(step_timers::Group, f64)>);

/// The mean of the measured step `seconds` the last [`step_seconds`] returned, and of the
/// seconds each kernel group took in them (`runner::step_timers`, enabled by the bench).
pub fn mean_step(seconds: &[f64]) -> MeanStep {
    let steps = seconds.len() as f64;
    let groups = step_timers::take()
        .into_iter()
        .map(|(g, d)| (g, d.as_secs_f64() / steps))
        .collect();
    (seconds.iter().sum::<f64>() / steps, groups)
}

/// The kernel-group split of each row's mean step.
pub fn print_breakdown(breakdown: Vec<(String, MeanStep)>) {
    println!();
    let names: Vec<&str> = step_timers::Group::ALL.iter().map(|g| g.name()).collect();
    println!(
        "| row | mean s/step | {} | outside kernels |",
        names.join(" | ")
    );
    println!("|---|---|{}---|", "---|".repeat(names.len()));
    for (row, (mean, groups)) in breakdown {
        let cell = |s: f64| format!("{s:.3} ({:.0}%)", 100.0 * s / mean);
        let cells: Vec<String> = groups.iter().map(|&(_, s)| cell(s)).collect();
        let outside = mean - groups.iter().map(|&(_, s)| s).sum::<f64>();
        println!(
            "| {row} | {mean:.3} | {} | {} |",
            cells.join(" | "),
            cell(outside)
        );
    }
}

/// The job the CPU benches compare with PyTorch's: `model` (a spec's model block) in `dtype`,
/// AdamW (betas 0.9/0.95, weight decay 0.1, as `scripts/bench_torch_cpu.py`), `b` sequences of
/// `t` tokens, `steps` steps, stage 0, no checkpointing.
pub fn adamw_job(model: &str, dtype: &str, (b, t): (usize, usize), steps: usize) -> JobSpec {
    adamw_job_with(model, dtype, (b, t), steps, "")
}

/// [`adamw_job`] with more top-level fields (`, "lora": {…}`).
pub fn adamw_job_with(
    model: &str,
    dtype: &str,
    (b, t): (usize, usize),
    steps: usize,
    extra: &str,
) -> JobSpec {
    let json = format!(
        r#"{{"model": {model}, "precision": {{"dtype": "{dtype}"}}{extra},
            "optimizer": {{"type": "adamw", "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "training": {{"micro_batch_size": {b}, "seq_len": {t}, "steps": {steps}}},
            "zero": {{"stage": 0}}, "activation_checkpointing": false}}"#
    );
    JobSpec::parse(&json, Purpose::Train)
        .expect("the benchmark spec is valid")
        .spec
}

/// [`step_seconds`] of `spec` planned on this machine's CPU and run on the kernel pool.
pub fn cpu_step_seconds(spec: &JobSpec, warmup: usize, what: &str) -> Steps {
    let plan = plan_local(spec, None).expect("the bench's specs fit");
    step_seconds(spec, &plan, &Options::default(), warmup, what)
}

/// The row filters given on the command line (`cargo bench … -- FILTER…`): a row runs when
/// there are none or its name contains one, or equals one given as `=NAME` (`=bf16` runs the
/// `bf16` row without `bf16 lora`).
pub struct Filters(Vec<String>);

impl Filters {
    pub fn from_args() -> Filters {
        Filters(
            std::env::args()
                .skip(1)
                .filter(|a| !a.starts_with("--"))
                .collect(),
        )
    }

    pub fn keeps(&self, row: &str) -> bool {
        self.0.is_empty()
            || self.0.iter().any(|f| match f.strip_prefix('=') {
                Some(name) => row == name,
                None => row.contains(f.as_str()),
            })
    }
}

/// Median, and the smallest and largest value, of `xs` (not empty).
pub fn median_min_max(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// The median of `measured` step seconds after `warmup` that `scripts/bench_torch_cpu.py`
/// prints when run by `python` on `threads` threads with `args` (the model, batch, dtype…):
/// PyTorch's side of a CPU bench, on the same cores; or how it failed: a bench row reports a
/// reference that runs out of memory rather than stopping.
pub fn torch_step_seconds(
    python: &str,
    args: &[&str],
    threads: usize,
    (warmup, measured): (usize, usize),
) -> Result<f64, String> {
    use std::os::unix::process::ExitStatusExt;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_torch_cpu.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .args(["--threads", &threads.to_string()])
        .args(["--warmup", &warmup.to_string()])
        .args(["--steps", &measured.to_string()])
        .output()
        .expect("ZEROTRAIN_TORCH_PYTHON runs");
    if out.status.signal() == Some(9) {
        return Err("killed (out of memory)".into());
    }
    if !out.status.success() {
        return Err(format!(
            "failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    Ok(row["median_step_s"].as_f64().expect("a step time"))
}
