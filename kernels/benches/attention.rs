//! Causal attention, forward and backward, at long contexts: GPT-2 (B 4, NH 12, hs 64, packed
//! qkv) and SmolLM2 (B 4, NH 9, KV 3, hs 64, separate q, k, v), median of 5 runs per pass.
//! Run: `cargo bench -p kernels --bench attention [-- f32|bf16 T…]`.

use half::bf16;
use kernels::attention::{
    AttentionDims, attention_backward, attention_forward, gqa_attention_backward,
    gqa_attention_forward,
};
use kernels::{Float, cpu};

mod common;
use common::fill;

const B: usize = 4;
const RUNS: usize = 5;

fn median(f: impl FnMut()) -> f64 {
    common::median_seconds(RUNS, f)
}

/// Seconds of (forward, backward) of GPT-2's packed multi-head attention.
fn gpt2<X: Float>(t: usize) -> (f64, f64) {
    let d = AttentionDims::mha(B, t, 768, 12);
    let (qkv, dout) = (
        fill::<X>(B * t * 3 * 768, 1.0),
        fill::<X>(B * t * 768, 0.01),
    );
    let (mut out, mut lse) = (vec![X::ZERO; dout.len()], vec![0f32; B * 12 * t]);
    let fwd = median(|| attention_forward(&mut out, &mut lse, &qkv, d));
    let (mut dqkv, mut delta) = (vec![X::ZERO; qkv.len()], vec![0f32; lse.len()]);
    let bwd = median(|| attention_backward(&mut dqkv, &mut delta, &dout, &qkv, &out, &lse, d));
    (fwd, bwd)
}

/// Seconds of (forward, backward) of SmolLM2's grouped-query attention.
fn smollm2<X: Float>(t: usize) -> (f64, f64) {
    let d = AttentionDims::gqa(B, t, 9, 3, 64);
    let (qn, kn) = (B * t * d.q_width(), B * t * d.kv_width());
    let (q, k, v, dout) = (
        fill::<X>(qn, 1.0),
        fill::<X>(kn, 1.0),
        fill::<X>(kn, 1.0),
        fill::<X>(qn, 0.01),
    );
    let (mut out, mut lse) = (vec![X::ZERO; qn], vec![0f32; B * 9 * t]);
    let fwd = median(|| gqa_attention_forward(&mut out, &mut lse, &q, &k, &v, d));
    let (mut dq, mut dk, mut dv) = (vec![X::ZERO; qn], vec![X::ZERO; kn], vec![X::ZERO; kn]);
    let mut delta = vec![0f32; lse.len()];
    let bwd = median(|| {
        gqa_attention_backward(
            &mut dq, &mut dk, &mut dv, &mut delta, &dout, &q, &k, &v, &out, &lse, d,
        )
    });
    (fwd, bwd)
}

/// One table row per shape at each length.
fn rows<X: Float>(lengths: &[usize]) {
    for &t in lengths {
        for (shape, (fwd, bwd)) in [
            ("gpt2 NH 12", gpt2::<X>(t)),
            ("smollm2 NH 9 KV 3", smollm2::<X>(t)),
        ] {
            println!(
                "| {shape} | {} | {t} | {:.1} | {:.1} | {:.1} |",
                X::NAME,
                fwd * 1e3,
                bwd * 1e3,
                (fwd + bwd) * 1e3
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let mut lengths: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if lengths.is_empty() {
        lengths = vec![256, 1024, 4096];
    }
    let named = |d: &str| args.iter().any(|a| a == d);
    let all = !named("f32") && !named("bf16");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = cpu::thread_pool(threads).expect("a thread pool");
    println!("threads: {threads}, B = {B}, median of {RUNS}\n");
    println!("| shape | dtype | T | fwd ms | bwd ms | fwd+bwd ms |");
    println!("|---|---|---|---|---|---|");
    if all || named("f32") {
        pool.install(|| rows::<f32>(&lengths));
    }
    if all || named("bf16") {
        pool.install(|| rows::<bf16>(&lengths));
    }
}
