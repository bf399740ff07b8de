//! GFLOP/s of the GPT-2 124M matmuls at B=4, T=64 (M = 256), per dtype, against the
//! machine's 2048³ sgemm peak; then LoRA's rank-16 adapter products at the SmolLM2-135M
//! projections (B=4, T=128), beside the frozen base's products they ride on.
//! Run: `cargo bench -p kernels --bench matmul` (`-- lora` for the second table alone).

use half::{bf16, f16};
use kernels::matmul::{
    DinpMode, Layout, matmul_backward, matmul_backward_input, matmul_forward, measure_peak_gflops,
    scratch_len,
};
use kernels::{Float, cpu};

mod common;
use common::fill;

const M: usize = 256;
const RUNS: usize = 7;

/// (name, K, N, layout); the LM head writes f32 logits and reads f32 dlogits.
const SHAPES: [(&str, usize, usize, Layout); 5] = [
    ("c_attn 768→2304", 768, 2304, Layout::KN),
    ("c_proj 768→768", 768, 768, Layout::KN),
    ("c_fc 768→3072", 768, 3072, Layout::KN),
    ("mlp proj 3072→768", 3072, 768, Layout::KN),
    ("lm head 768→50257 (x·Wᵀ)", 768, 50257, Layout::NK),
];

fn median(f: impl FnMut()) -> f64 {
    common::median_seconds(RUNS, f)
}

/// (forward, backward) GFLOP/s for one shape; the output/gradient of the LM head is f32.
fn bench<X: Float>(k: usize, n: usize, layout: Layout) -> (f64, f64) {
    let (x, w, b) = (
        fill::<X>(M * k, 1.0),
        fill::<X>(k * n, 0.05),
        fill::<X>(n, 0.1),
    );
    let mut scratch = vec![0f32; scratch_len(M, k, n)];
    let flops = 2.0 * (M * k * n) as f64;
    let (mut dx, mut dw, mut db) = (vec![X::ZERO; M * k], vec![X::ZERO; k * n], vec![X::ZERO; n]);
    let (fwd, bwd) = if layout == Layout::NK {
        let mut out = vec![0f32; M * n];
        let f = median(|| matmul_forward(&mut out, &x, &w, None, layout, (M, k, n), &mut scratch));
        let dout = fill::<f32>(M * n, 1e-3);
        let g = median(|| {
            matmul_backward(
                &mut dx,
                &mut dw,
                None,
                &dout,
                &x,
                &w,
                layout,
                (M, k, n),
                DinpMode::Overwrite,
                &mut scratch,
            )
        });
        (f, g)
    } else {
        let mut out = vec![X::ZERO; M * n];
        let f =
            median(|| matmul_forward(&mut out, &x, &w, Some(&b), layout, (M, k, n), &mut scratch));
        let dout = fill::<X>(M * n, 1e-2);
        let g = median(|| {
            matmul_backward(
                &mut dx,
                &mut dw,
                Some(&mut db),
                &dout,
                &x,
                &w,
                layout,
                (M, k, n),
                DinpMode::Overwrite,
                &mut scratch,
            )
        });
        (f, g)
    };
    (flops / fwd / 1e9, 2.0 * flops / bwd / 1e9)
}

/// LoRA's products run at the SmolLM2-135M shape: (name, in, out) of one layer's projections.
const LORA_SHAPES: [(&str, usize, usize); 4] = [
    ("q_proj, o_proj 576→576", 576, 576),
    ("k_proj, v_proj 576→192", 576, 192),
    ("gate_proj, up_proj 576→1536", 576, 1536),
    ("down_proj 1536→576", 1536, 576),
];
const LORA_M: usize = 512;
const LORA_RANK: usize = 16;

/// Seconds of one adapted projection's adapter products as `runner::lora` runs them (forward
/// `V = x·Aᵀ`, `y += V·Bᵀ`; backward `G = dy·B` with `dB += dyᵀ·V`, `dx += G·A` with
/// `dA += Gᵀ·x`), and of the frozen base's (forward and the input gradient).
fn lora<X: Float>(k: usize, n: usize) -> (f64, f64) {
    let (m, r) = (LORA_M, LORA_RANK);
    let (x, w, a, b) = (
        fill::<X>(m * k, 1.0),
        fill::<X>(n * k, 0.05),
        fill::<X>(r * k, 0.05),
        fill::<X>(n * r, 0.05),
    );
    let dy = fill::<X>(m * n, 1e-2);
    let mut scratch = vec![0f32; scratch_len(m, k, n)];
    let (mut y, mut v, mut g) = (
        vec![X::ZERO; m * n],
        vec![X::ZERO; m * r],
        vec![X::ZERO; m * r],
    );
    let (mut dx, mut da, mut db) = (
        vec![X::ZERO; m * k],
        vec![X::ZERO; r * k],
        vec![X::ZERO; n * r],
    );
    let nk = Layout::NK;
    let adapters = median(|| {
        matmul_forward(&mut v, &x, &a, None, nk, (m, k, r), &mut scratch);
        let acc = DinpMode::Accumulate;
        matmul_backward_input(&mut y, &v, &b, Layout::KN, (m, n, r), acc, &mut scratch);
        let over = DinpMode::Overwrite;
        matmul_backward(
            &mut g,
            &mut db,
            None,
            &dy,
            &v,
            &b,
            nk,
            (m, r, n),
            over,
            &mut scratch,
        );
        matmul_backward(
            &mut dx,
            &mut da,
            None,
            &g,
            &x,
            &a,
            nk,
            (m, k, r),
            acc,
            &mut scratch,
        );
    });
    let base = median(|| {
        matmul_forward(&mut y, &x, &w, None, nk, (m, k, n), &mut scratch);
        let over = DinpMode::Overwrite;
        matmul_backward_input(&mut dx, &dy, &w, nk, (m, k, n), over, &mut scratch);
    });
    (adapters, base)
}

/// The LoRA table: per projection and dtype, the adapters' milliseconds and GFLOP/s beside the
/// base's, and the step's sums (30 layers; the two projections a row names both counted).
fn lora_table() {
    println!("LoRA rank {LORA_RANK}, M = {LORA_M} (SmolLM2-135M, B 4, T 128); median of {RUNS}\n");
    println!(
        "| projection | dtype | adapters ms | adapters GFLOP/s | base ms | base GFLOP/s | adapters ÷ base |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut step = [(0.0, 0.0); 2];
    for (name, k, n) in LORA_SHAPES {
        let times = [lora::<f32>(k, n), lora::<bf16>(k, n)];
        let per_layer = if name.contains(',') { 2.0 } else { 1.0 };
        for ((dtype, (ad, base)), sum) in ["f32", "bf16"].into_iter().zip(times).zip(&mut step) {
            // Six products of 2·M·rank FLOPs times k or n: three as deep as the input, three
            // as the output.
            let ad_flops = 6.0 * (LORA_M * LORA_RANK * (k + n)) as f64;
            let base_flops = 4.0 * (LORA_M * k * n) as f64;
            println!(
                "| {name} | {dtype} | {:.3} | {:.0} | {:.3} | {:.0} | {:.2} |",
                ad * 1e3,
                ad_flops / ad / 1e9,
                base * 1e3,
                base_flops / base / 1e9,
                ad / base
            );
            sum.0 += 30.0 * per_layer * ad;
            sum.1 += 30.0 * per_layer * base;
        }
    }
    for (dtype, (ad, base)) in ["f32", "bf16"].into_iter().zip(step) {
        println!("\n{dtype} per step (30 layers): adapters {ad:.3} s, base {base:.3} s");
    }
}

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = cpu::thread_pool(threads).expect("thread pool");
    let only_lora = std::env::args().any(|a| a == "lora");
    pool.install(|| {
        if only_lora {
            return lora_table();
        }
        let peak = measure_peak_gflops();
        println!(
            "threads: {threads}; peak (2048³ sgemm): {peak:.0} GFLOP/s; M = {M}; median of {RUNS}\n"
        );
        println!("| shape | f32 fwd | f32 bwd | bf16 fwd | bf16 bwd | f16 fwd | f16 bwd |");
        println!("|---|---|---|---|---|---|---|");
        for (name, k, n, layout) in SHAPES {
            let r = [
                bench::<f32>(k, n, layout),
                bench::<bf16>(k, n, layout),
                bench::<f16>(k, n, layout),
            ];
            let cells: Vec<String> = r
                .iter()
                .flat_map(|(f, b)| [format!("{f:.0}"), format!("{b:.0}")])
                .collect();
            println!("| {name} | {} |", cells.join(" | "));
        }
        println!("\nGFLOP/s; backward counts dinp + dweight (2 × 2MKN).\n");
        lora_table();
    });
}
