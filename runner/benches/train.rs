//! Training throughput of the in-process trainer: median step time, tokens/s, achieved
//! GFLOP/s and model-FLOPs utilisation (MFU) for gpt2-tiny and gpt2-124M at micro-batch 4,
//! seq 64, fp32 and bf16, AdamW, on all cores; then each row's mean step by kernel group
//! (`runner::step_timers`).
//!
//! Run: `cargo bench -p runner --bench train [-- FILTER…]` (a filter such as `124M` or
//! `tiny/bf16` selects rows). FLOPs per step use llm.c's count, `6·N + 6·L·C·T` per token;
//! the MFU denominator is the machine's 2048³ sgemm rate measured at start-up
//! (`kernels::matmul::measure_peak_gflops`). With `LLMC_STEP_SECONDS` set to a step time of
//! llm.c's `train_gpt2.c` measured on the same machine (gpt2-124M fp32, B=4, T=64), the
//! gpt2-124M rows also print the speed-up over it; with `ZEROTRAIN_TORCH_PYTHON` naming a
//! Python that has torch and transformers, they also run PyTorch eager on the same shape
//! (`scripts/bench_torch_cpu.py --model gpt2-124M`: `GPT2LMHeadModel`, eager attention, fp32
//! or bf16 autocast, the same batch, length and threads) in the same run and print the ratio.

use runner::step_timers;
use scheduler::spec::{JobSpec, Purpose};

mod common;

const B: usize = 4;
const T: usize = 64;

/// A configuration to time: preset, dtype, warm-up steps, measured steps.
struct Case {
    model: &'static str,
    dtype: &'static str,
    warmup: usize,
    measured: usize,
}

const CASES: [Case; 4] = [
    Case {
        model: "gpt2-tiny",
        dtype: "fp32",
        warmup: 5,
        measured: 50,
    },
    Case {
        model: "gpt2-tiny",
        dtype: "bf16",
        warmup: 5,
        measured: 50,
    },
    Case {
        model: "gpt2-124M",
        dtype: "fp32",
        warmup: 2,
        measured: 10,
    },
    Case {
        model: "gpt2-124M",
        dtype: "bf16",
        warmup: 2,
        measured: 10,
    },
];

/// Step times of one case, warm-up steps dropped.
struct Timing {
    seconds: Vec<f64>,
    flops_per_step: f64,
    tokens_per_step: f64,
}

fn time_case(case: &Case) -> Timing {
    let steps = case.warmup + case.measured;
    let json = format!(
        r#"{{"model": {{"preset": "{}"}}, "precision": {{"dtype": "{}"}},
            "training": {{"micro_batch_size": {B}, "seq_len": {T}, "steps": {steps}}},
            "zero": {{"stage": 0}}, "activation_checkpointing": false}}"#,
        case.model, case.dtype
    );
    let spec = JobSpec::parse(&json, Purpose::Train)
        .expect("the benchmark spec is valid")
        .spec;
    let model = spec.architecture().model().expect("a preset has a shape");
    let tokens_per_step = (B * T) as f64;
    let what = format!("{}/{}", case.model, case.dtype);
    Timing {
        seconds: common::cpu_step_seconds(&spec, case.warmup, &what).measured,
        flops_per_step: common::flops_per_token(&model, T) * tokens_per_step,
        tokens_per_step,
    }
}

fn main() {
    common::setup();
    step_timers::enable();
    let filters = common::Filters::from_args();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let python = std::env::var("ZEROTRAIN_TORCH_PYTHON").ok();
    let llmc: Option<f64> = std::env::var("LLMC_STEP_SECONDS")
        .ok()
        .map(|s| s.parse().expect("LLMC_STEP_SECONDS is a number of seconds"));
    let peak = kernels::cpu::thread_pool(threads)
        .expect("a thread pool")
        .install(kernels::matmul::measure_peak_gflops);
    println!("threads: {threads}; peak (2048³ sgemm, median of 5): {peak:.0} GFLOP/s");
    if let Some(s) = llmc {
        println!(
            "llm.c train_gpt2.c gpt2-124M fp32 B={B} T={T}: {s:.3} s/step ({:.1} tokens/s)",
            (B * T) as f64 / s
        );
    }
    println!();
    println!(
        "| model | dtype | steps | median step s | min–max s | tokens/s | GFLOP/s | MFU | × llm.c | PyTorch tokens/s | × PyTorch |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut breakdown = Vec::new();
    for case in &CASES {
        let name = format!("{}/{}", case.model, case.dtype);
        if !filters.keeps(&name) {
            continue;
        }
        let t = time_case(case);
        breakdown.push((name, common::mean_step(&t.seconds)));
        let (step, lo, hi) = common::median_min_max(&t.seconds);
        let gflops = t.flops_per_step / step / 1e9;
        let versus = match llmc {
            Some(s) if case.model == "gpt2-124M" => format!("{:.2}×", s / step),
            _ => "—".into(),
        };
        let (torch, ratio) = match &python {
            Some(py) if case.model == "gpt2-124M" => {
                let (batch, seq) = (B.to_string(), T.to_string());
                let args = [
                    "--model", case.model, "--dtype", case.dtype, "--batch", &batch, "--seq", &seq,
                ];
                let s =
                    common::torch_step_seconds(py, &args, threads, (case.warmup, case.measured))
                        .unwrap_or_else(|e| panic!("bench_torch_cpu.py {args:?} {e}"));
                (
                    format!("{:.0}", t.tokens_per_step / s),
                    format!("{:.2}×", s / step),
                )
            }
            _ => ("—".into(), "—".into()),
        };
        println!(
            "| {} | {} | {} | {step:.4} | {lo:.4}–{hi:.4} | {:.0} | {gflops:.1} | {:.1}% | {versus} | {torch} | {ratio} |",
            case.model,
            case.dtype,
            t.seconds.len(),
            t.tokens_per_step / step,
            100.0 * gflops / peak,
        );
    }
    if !breakdown.is_empty() {
        common::print_breakdown(breakdown);
    }
}
