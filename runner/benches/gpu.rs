//! zerotrain's side of the GPU benchmark (feature `cuda`): gpt2-124M and a SmolLM2-135M-shaped
//! Llama, bf16 over fp32 master weights, AdamW, T = 1024, ZeRO 0 on GPU 0, at B = 16 and at
//! the largest micro-batch the memory model says fits the GPU. Prints median step time,
//! tokens/s and MFU (llm.c's FLOP count, `6·N + 6·L·H·D·T` per token, against the bf16
//! cuBLASLt rate of 8192³ products measured first in the same run), and with
//! `ZEROTRAIN_BENCH_JSON=FILE` writes the rows there for `scripts/bench_torch.py`, which prints
//! the gpt2-124M rows beside PyTorch's on the same GPU.
//!
//! `cargo bench -p runner --bench gpu` (scripts/gpu-check runs it from the
//! bundle). Without a GPU it says so and exits 0.

use runner::device::Target;
use runner::train::Options;
use scheduler::memory::DeviceKind;
use scheduler::plan::plan_local_on;
use scheduler::spec::{JobSpec, Purpose};

mod common;

const T: usize = 1024;
const WARMUP: usize = 3;
const MEASURED: usize = 10;
/// Micro-batches tried for "largest that fits", largest first.
const BATCHES: [usize; 6] = [64, 48, 32, 24, 20, 16];
/// The models timed, one of each family.
const MODELS: [&str; 2] = ["gpt2-124M", "smollm2-135M"];

fn spec(model: &str, b: usize) -> JobSpec {
    let json = format!(
        r#"{{"model": {{"preset": "{model}"}}, "precision": {{"dtype": "bf16"}},
            "optimizer": {{"type": "adamw"}}, "zero": {{"stage": 0}},
            "activation_checkpointing": false,
            "training": {{"micro_batch_size": {b}, "seq_len": {T}, "steps": {}}}}}"#,
        WARMUP + MEASURED
    );
    JobSpec::parse(&json, Purpose::Train)
        .expect("the benchmark spec is valid")
        .spec
}

/// One measured configuration.
struct Row {
    model: &'static str,
    batch: usize,
    step: (f64, f64, f64),
    tokens_per_step: f64,
    flops_per_step: f64,
}

fn time(model: &'static str, b: usize, budget: u64) -> Row {
    let spec = spec(model, b);
    let shape = spec.architecture().model().expect("a preset has a shape");
    let tokens_per_step = (b * T) as f64;
    let plan = plan_local_on(&spec, Some(budget), DeviceKind::Cuda).expect("B fits the GPU");
    let opts = Options {
        device: Target::Cuda(0),
        device_memory: Some(budget),
        ..Options::default()
    };
    let what = format!("{model} B={b}");
    let seconds = common::step_seconds(&spec, &plan, &opts, WARMUP, &what).measured;
    Row {
        model,
        batch: b,
        step: common::median_min_max(&seconds),
        tokens_per_step,
        flops_per_step: common::flops_per_token(&shape, T) * tokens_per_step,
    }
}

fn main() {
    common::setup();
    let (peak, total) = match kernels::cuda::Gpu::new(0) {
        Ok(dev) => (
            kernels::cuda::matmul::measure_peak_gflops(&dev).expect("the peak GEMM runs"),
            dev.opening_memory().total as u64,
        ),
        Err(e) => {
            println!("bench gpu: no GPU present ({e})");
            return;
        }
    };
    println!(
        "GPU 0: {:.1} GiB; bf16 8192³ cuBLASLt: {:.0} TFLOP/s",
        total as f64 / f64::from(1 << 30),
        peak / 1e3,
    );
    println!();
    println!("| run | model | B | median step ms | min–max ms | tokens/s | MFU |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    // `ZEROTRAIN_BENCH_BATCHES=16,32` names the micro-batches (gpu-check runs 16 only, within
    // its budget); by default 16 and the largest that fits: the model is exact, so the
    // largest micro-batch it admits on this GPU is the one to run.
    let batches = |model: &str| -> Vec<usize> {
        match std::env::var("ZEROTRAIN_BENCH_BATCHES") {
            Ok(list) => list
                .split(',')
                .map(|b| {
                    b.trim()
                        .parse()
                        .expect("ZEROTRAIN_BENCH_BATCHES: micro-batches, a,b,…")
                })
                .collect(),
            Err(_) => {
                let largest = BATCHES.into_iter().find(|&b| {
                    plan_local_on(&spec(model, b), Some(total), DeviceKind::Cuda).is_ok()
                });
                std::iter::once(16)
                    .chain(largest.filter(|&b| b != 16))
                    .collect()
            }
        }
    };
    for (model, b) in MODELS
        .into_iter()
        .flat_map(|m| batches(m).into_iter().map(move |b| (m, b)))
    {
        let r = time(model, b, total);
        let (step, lo, hi) = r.step;
        let tps = r.tokens_per_step / step;
        let mfu = r.flops_per_step / step / 1e9 / peak;
        println!(
            "| zerotrain | {} | {} | {:.1} | {:.1}–{:.1} | {tps:.0} | {:.1}% |",
            r.model,
            r.batch,
            step * 1e3,
            lo * 1e3,
            hi * 1e3,
            100.0 * mfu
        );
        rows.push(serde_json::json!({
            "run": "zerotrain", "model": r.model, "batch": r.batch, "step_seconds": step,
            "tokens_per_second": tps, "mfu": mfu,
        }));
        // After every row, so a bench stopped by gpu-check's budget leaves what it measured.
        if let Some(path) = std::env::var_os("ZEROTRAIN_BENCH_JSON") {
            let out = serde_json::json!({"peak_gflops": peak, "rows": rows});
            std::fs::write(path, out.to_string()).expect("writing ZEROTRAIN_BENCH_JSON");
        }
    }
}
