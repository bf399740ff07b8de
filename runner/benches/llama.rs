//! Llama-family training throughput on the CPU beside transformers': a SmolLM2-135M-shaped
//! model (30 layers, C 576, 9 heads over 3 KV heads, MLP 1536, tied 49,152-token head), AdamW,
//! micro-batch 4, seq 128, fp32 and bf16, on all cores; median step time and tokens/s, and the
//! first step's time (a job's start: its buffers mapped, its optimizer state first written).
//!
//! Each row also times the step's products alone (`common::roofline`: every linear layer and
//! the LM head's chunks, forward and backward, in the row's dtype) and sets the step beside
//! them: the time they take at the rate this machine gives those shapes, and what the step
//! spends beyond them.
//!
//! A second table splits each step by kernel group (`runner::step_timers`: products,
//! attention, norms and activations, loss, optimizer, collectives) and what ran outside
//! kernels.
//!
//! A third table trains LoRA adapters instead (rank 16, alpha 32, every linear projection, the
//! base frozen), beside PEFT on transformers with the same adapters, on a base in the compute
//! dtype and in NF4 (QLoRA; PEFT on bitsandbytes' CPU 4-bit).
//!
//! Run: `cargo bench -p runner --bench llama [-- FILTER…]` (`fp32` or `bf16` selects rows,
//! LoRA's among them, `=bf16` the full model's alone, `lora` the LoRA table's, `qlora` its
//! QLoRA rows).
//! With `ZEROTRAIN_TORCH_PYTHON` naming a Python that has torch and transformers, each row
//! also runs `scripts/bench_torch_cpu.py` (transformers' `LlamaForCausalLM`, eager attention,
//! the same shape, batch and thread count) in the same run and prints the ratio; the LoRA rows
//! need peft there too, the QLoRA rows bitsandbytes.

use common::roofline;
use runner::step_timers;
use scheduler::spec::{JobSpec, Purpose};

mod common;

const B: usize = 4;
const T: usize = 128;
const MODEL: &str = "smollm2-135M";
const WARMUP: usize = 2;
const MEASURED: usize = 5;
/// The LoRA rows' adapters: PEFT's `r` and `lora_alpha`, on every linear projection.
const LORA_RANK: usize = 16;

/// zerotrain's first step's seconds, median step seconds (and the spread) for `dtype`, and its
/// mean step.
fn ours(dtype: &str) -> (f64, (f64, f64, f64), common::MeanStep) {
    let model = format!(r#"{{"preset": "{MODEL}"}}"#);
    let spec = common::adamw_job(&model, dtype, (B, T), WARMUP + MEASURED);
    let steps = common::cpu_step_seconds(&spec, WARMUP, dtype);
    (
        steps.first,
        common::median_min_max(&steps.measured),
        common::mean_step(&steps.measured),
    )
}

/// transformers' median step seconds for `dtype`, when a Python with torch is named.
fn theirs(python: &str, dtype: &str, threads: usize) -> f64 {
    common::torch_step_seconds(python, &["--dtype", dtype], threads, (WARMUP, MEASURED))
        .unwrap_or_else(|e| panic!("bench_torch_cpu.py {e}"))
}

fn main() {
    common::setup();
    step_timers::enable();
    let filters = common::Filters::from_args();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let python = std::env::var("ZEROTRAIN_TORCH_PYTHON").ok();
    let pool = kernels::cpu::thread_pool(threads).expect("a thread pool");
    let peak = pool.install(kernels::matmul::measure_peak_gflops);
    let bf16_peak = pool.install(roofline::square_gflops::<half::bf16>);
    let json = format!(r#"{{"model": {{"preset": "{MODEL}"}}}}"#);
    let spec = JobSpec::parse(&json, Purpose::Train).expect("the preset is valid");
    let model = spec
        .spec
        .architecture()
        .model()
        .expect("a preset has a shape");
    let per_token = common::flops_per_token(&model, T);
    // Against the dtype's own 2048³ rate: a bf16 step's limit is the bf16 products'.
    let mfu = |step: f64, peak: f64| 100.0 * per_token * (B * T) as f64 / step / 1e9 / peak;
    let products = roofline::products(&model, B, T);
    println!(
        "{MODEL}, B {B}, T {T}, AdamW, {threads} threads, median of {MEASURED} steps after \
         {WARMUP}; peak (2048³ sgemm, median of 5): {peak:.0} GFLOP/s; 2048³ bf16 ({}): \
         {bf16_peak:.0} GFLOP/s",
        roofline::bf16_engine()
    );
    println!();
    println!(
        "| dtype | zerotrain s/step | min–max s | first step s | tokens/s | MFU | products s | products GFLOP/s | step ÷ products | transformers tokens/s | MFU | × transformers |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut breakdown = Vec::new();
    for dtype in ["fp32", "bf16"] {
        if !filters.keeps(dtype) {
            continue;
        }
        let (first, (step, lo, hi), mean_step) = ours(dtype);
        breakdown.push((dtype.to_string(), mean_step));
        let peak = if dtype == "bf16" { bf16_peak } else { peak };
        let (gemm, rate) = pool.install(|| match dtype {
            "bf16" => roofline::seconds::<half::bf16>(&products, 3),
            _ => roofline::seconds::<f32>(&products, 3),
        });
        let tokens = (B * T) as f64;
        let (torch, torch_mfu, ratio) = match &python {
            Some(py) => {
                let t = theirs(py, dtype, threads);
                (
                    format!("{:.1}", tokens / t),
                    format!("{:.1}%", mfu(t, peak)),
                    format!("{:.2}×", t / step),
                )
            }
            None => ("—".into(), "—".into(), "—".into()),
        };
        println!(
            "| {dtype} | {step:.3} | {lo:.3}–{hi:.3} | {first:.3} | {:.1} | {:.1}% | {gemm:.3} | {rate:.0} | {:.2}× | {torch} | {torch_mfu} | {ratio} |",
            tokens / step,
            mfu(step, peak),
            step / gemm
        );
    }
    if !breakdown.is_empty() {
        common::print_breakdown(breakdown);
    }
    lora_rows(&filters, python.as_deref(), threads);
}

/// The LoRA table: zerotrain's adapters on the frozen model beside PEFT's, per dtype, on a
/// base in the compute dtype (LoRA) and in NF4 (QLoRA, PEFT on bitsandbytes' 4-bit).
fn lora_rows(filters: &common::Filters, python: Option<&str>, threads: usize) {
    let rows: Vec<(&str, &str)> = ["fp32", "bf16"]
        .into_iter()
        .flat_map(|d| [(d, "lora"), (d, "qlora")])
        .filter(|(d, kind)| filters.keeps(&format!("{d} {kind}")))
        .collect();
    if rows.is_empty() {
        return;
    }
    println!();
    println!(
        "| r {LORA_RANK}, alpha {}, all-linear | zerotrain s/step | min–max s | tokens/s | PEFT tokens/s | × PEFT |",
        2 * LORA_RANK
    );
    println!("|---|---|---|---|---|---|");
    let model = format!(r#"{{"preset": "{MODEL}"}}"#);
    let tokens = (B * T) as f64;
    let mut breakdown = Vec::new();
    for (dtype, kind) in rows {
        let nf4 = kind == "qlora";
        let lora = format!(
            r#", "lora": {{"rank": {LORA_RANK}, "alpha": {}, "target_modules": "all-linear"{}}}"#,
            2 * LORA_RANK,
            if nf4 {
                r#", "quantize_base": "nf4""#
            } else {
                ""
            }
        );
        let spec = common::adamw_job_with(&model, dtype, (B, T), WARMUP + MEASURED, &lora);
        let what = format!("{dtype} {kind}");
        let seconds = common::cpu_step_seconds(&spec, WARMUP, &what).measured;
        let name = if nf4 { "QLoRA" } else { "LoRA" };
        breakdown.push((format!("{dtype} {name}"), common::mean_step(&seconds)));
        let (step, lo, hi) = common::median_min_max(&seconds);
        let (peft, ratio) = match python {
            Some(py) => {
                let rank = LORA_RANK.to_string();
                let mut args = vec!["--dtype", dtype, "--lora", &rank];
                if nf4 {
                    args.push("--qlora");
                }
                let t = common::torch_step_seconds(py, &args, threads, (WARMUP, MEASURED))
                    .unwrap_or_else(|e| panic!("bench_torch_cpu.py {args:?} {e}"));
                (format!("{:.1}", tokens / t), format!("{:.2}×", t / step))
            }
            None => ("—".into(), "—".into()),
        };
        println!(
            "| {dtype} {name} | {step:.3} | {lo:.3}–{hi:.3} | {:.1} | {peft} | {ratio} |",
            tokens / step
        );
    }
    common::print_breakdown(breakdown);
}
