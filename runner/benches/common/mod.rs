//! What the runner's benchmarks share: llm.c's FLOP count, a timed training run, and order
//! statistics of step times.
#![allow(dead_code)] // each bench uses its own part

use runner::train::{Options, Progress, run};
use scheduler::model::ModelShape;
use scheduler::plan::Plan;
use scheduler::spec::JobSpec;

/// Training FLOPs per token as llm.c counts them: 6 per parameter (forward and backward) and
/// 6·L·H·D·T for the attention scores and their weighted sum at sequence length `t`.
pub fn flops_per_token(model: &ModelShape, t: usize) -> f64 {
    let s = model.summary();
    let attention = s.layers * s.attention_heads * s.head_dim * t;
    6.0 * model.parameter_count() as f64 + 6.0 * attention as f64
}

/// Trains `spec` by `plan` and returns each step's seconds after the first `warmup`; fails
/// naming `what` if the loss is not finite.
pub fn step_seconds(
    spec: &JobSpec,
    plan: &Plan,
    opts: &Options,
    warmup: usize,
    what: &str,
) -> Vec<f64> {
    let mut seconds = Vec::new();
    let mut progress = |p: Progress| seconds.push(p.step_seconds);
    let summary = run(spec, plan, opts, &mut progress).expect("training runs");
    assert!(
        summary.final_loss.is_finite(),
        "{what}: loss {}",
        summary.final_loss
    );
    seconds.drain(..warmup);
    seconds
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

/// The median step seconds `scripts/bench_torch_cpu.py` prints when run by `python` with `args`
/// (PyTorch's side of a CPU bench, on the same cores), or how it failed: a bench row reports a
/// reference that runs out of memory rather than stopping.
pub fn torch_step_seconds(python: &str, args: &[String]) -> Result<f64, String> {
    use std::os::unix::process::ExitStatusExt;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/bench_torch_cpu.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .args(args)
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
