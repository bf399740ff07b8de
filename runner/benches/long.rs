//! Training throughput at long sequences on the CPU beside PyTorch's
//! `scaled_dot_product_attention`: gpt2-124M and a SmolLM2-135M shape at T 256, 1024 and 4096
//! (2,048 tokens a micro-batch, 4,096 at T 4096), fp32 AdamW, stage 0, on all cores; median
//! step time and tokens/s.
//!
//! Run: `cargo bench -p runner --bench long [-- FILTER…]` (a filter selects rows by model name
//! or `T=…`). With `ZEROTRAIN_TORCH_PYTHON` naming a Python that has torch and transformers,
//! each row also runs `scripts/bench_torch_cpu.py --attn sdpa` (the same model, batch and
//! thread count) in the same run and prints the ratio.

use scheduler::spec::JobSpec;

mod common;

const WARMUP: usize = 1;
const MEASURED: usize = 2;
const ROWS: [(&str, usize, usize); 6] = [
    ("gpt2-124M", 8, 256),
    ("gpt2-124M", 2, 1024),
    ("gpt2-124M", 1, 4096),
    ("smollm2-135M", 8, 256),
    ("smollm2-135M", 2, 1024),
    ("smollm2-135M", 1, 4096),
];

fn spec(model: &str, b: usize, t: usize) -> JobSpec {
    // gpt2-124M's shape with 4,096 positions, so T 4096 fits.
    let model = match model {
        "gpt2-124M" => r#"{"vocab_size": 50257, "context_length": 4096, "n_layer": 12, "n_head": 12, "n_embd": 768}"#.to_string(),
        preset => format!(r#"{{"preset": "{preset}"}}"#),
    };
    common::adamw_job(&model, "fp32", (b, t), WARMUP + MEASURED)
}

/// PyTorch's median step seconds with SDPA attention, or how it failed.
fn theirs(python: &str, model: &str, b: usize, t: usize, threads: usize) -> Result<f64, String> {
    let (b, t) = (b.to_string(), t.to_string());
    let args = [
        "--dtype", "fp32", "--attn", "sdpa", "--model", model, "--batch", &b, "--seq", &t,
    ];
    common::torch_step_seconds(python, &args, threads, (WARMUP, MEASURED))
}

fn main() {
    common::setup();
    let filters = common::Filters::from_args();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let python = std::env::var("ZEROTRAIN_TORCH_PYTHON").ok();
    println!(
        "fp32 AdamW, {threads} threads, median of {MEASURED} steps after {WARMUP}; PyTorch: \
         transformers with attn_implementation=\"sdpa\""
    );
    println!();
    println!("| model | B × T | zerotrain s/step | tokens/s | PyTorch SDPA tokens/s | × PyTorch |");
    println!("|---|---|---|---|---|---|");
    for (model, b, t) in ROWS {
        if !filters.keeps(&format!("{model} T={t}")) {
            continue;
        }
        let seconds = common::cpu_step_seconds(&spec(model, b, t), WARMUP, model).measured;
        let (step, _, _) = common::median_min_max(&seconds);
        let tokens = (b * t) as f64;
        let (torch, ratio) = match &python {
            Some(py) => match theirs(py, model, b, t, threads) {
                Ok(s) => (format!("{:.1}", tokens / s), format!("{:.2}×", s / step)),
                Err(e) => (e, "—".into()),
            },
            None => ("—".into(), "—".into()),
        };
        println!(
            "| {model} | {b} × {t} | {step:.2} | {:.1} | {torch} | {ratio} |",
            tokens / step,
        );
    }
}
