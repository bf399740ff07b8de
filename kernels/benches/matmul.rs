//! GFLOP/s of the GPT-2 124M matmuls at B=4, T=64 (M = 256), per dtype, against the
//! machine's 2048³ sgemm peak. Run: `cargo bench -p kernels --bench matmul`.

use half::{bf16, f16};
use kernels::matmul::{
    DinpMode, Layout, matmul_backward, matmul_forward, measure_peak_gflops, scratch_len,
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

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = cpu::thread_pool(threads).expect("thread pool");
    pool.install(|| {
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
        println!("\nGFLOP/s; backward counts dinp + dweight (2 × 2MKN).");
    });
}
