//! Time per training step spent in each kernel family at the gpt2-124M shapes (B=4, T=64,
//! C=768, NH=12, L=12, V=50257), per dtype: each kernel is timed alone (median of 7 runs)
//! and multiplied by how many times one training step calls it. Run:
//! `cargo bench -p kernels --bench layers [-- FILTER…]`.

use half::bf16;
use kernels::attention::{AttentionDims, attention_backward, attention_forward};
use kernels::crossentropy::crossentropy_forward;
use kernels::encoder::{encoder_backward, encoder_forward};
use kernels::gelu::{gelu_backward, gelu_forward};
use kernels::grad_norm::sum_squares;
use kernels::layernorm::{layernorm_backward, layernorm_forward};
use kernels::matmul::{DinpMode, Layout, matmul_backward, matmul_forward, scratch_len};
use kernels::optim::{AdamW, adamw_step, decay};
use kernels::residual::residual_accumulate;
use kernels::{Float, cpu};

mod common;
use common::fill;

const B: usize = 4;
const T: usize = 64;
const C: usize = 768;
const NH: usize = 12;
const L: usize = 12;
const V: usize = 50257;
const N: usize = B * T;
/// gpt2-124M's parameter count (tied LM head).
const PARAMS: usize = 124_439_808;
const RUNS: usize = 7;

fn median(f: impl FnMut()) -> f64 {
    common::median_seconds(RUNS, f)
}

/// A heap vector of `n` copies (model-sized: never an array on the stack).
fn zeros<T: Clone>(value: T, n: usize) -> Vec<T> {
    vec![value; n]
}

struct Row {
    name: &'static str,
    calls: usize,
    seconds: f64,
}

fn layers<X: Float>() -> Vec<Row> {
    let mut rows = Vec::new();
    let mut row = |name, calls, seconds| {
        rows.push(Row {
            name,
            calls,
            seconds,
        })
    };
    let (x, w, b) = (fill::<X>(N * C, 1.0), fill::<X>(C, 1.0), fill::<X>(C, 0.1));
    let (mut out, mut mean, mut rstd) = (vec![X::ZERO; N * C], vec![0f32; N], vec![0f32; N]);
    row(
        "layernorm fwd",
        2 * L + 1,
        median(|| layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &b)),
    );
    let (mut dx, mut dw, mut db) = (vec![X::ZERO; N * C], vec![X::ZERO; C], vec![X::ZERO; C]);
    let dy = fill::<X>(N * C, 0.01);
    row(
        "layernorm bwd",
        2 * L + 1,
        median(|| layernorm_backward(&mut dx, &mut dw, &mut db, &dy, &x, &w, &mean, &rstd)),
    );
    let d = AttentionDims::mha(B, T, C, NH);
    let qkv = fill::<X>(N * 3 * C, 1.0);
    let mut lse = vec![0f32; B * NH * T];
    row(
        "attention fwd",
        L,
        median(|| attention_forward(&mut out, &mut lse, &qkv, d)),
    );
    let (mut dqkv, mut delta) = (vec![X::ZERO; N * 3 * C], vec![0f32; B * NH * T]);
    row(
        "attention bwd",
        L,
        median(|| attention_backward(&mut dqkv, &mut delta, &dy, &qkv, &out, &lse, d)),
    );
    let pre = fill::<X>(N * 4 * C, 2.0);
    let mut post = vec![X::ZERO; N * 4 * C];
    row("gelu fwd", L, median(|| gelu_forward(&mut post, &pre)));
    row("gelu bwd", L, median(|| gelu_backward(&mut post, &pre)));
    row(
        "residual",
        2 * L,
        median(|| residual_accumulate(&mut out, &x)),
    );
    let tokens: Vec<u32> = (0..N).map(|i| (i * 7919 % V) as u32).collect();
    let (wte, wpe) = (fill::<X>(V * C, 0.02), fill::<X>(1024 * C, 0.02));
    row(
        "encoder fwd",
        1,
        median(|| encoder_forward(&mut out, &tokens, &wte, Some(&wpe), T, C)),
    );
    let (mut dwte, mut dwpe) = (vec![X::ZERO; V * C], vec![X::ZERO; 1024 * C]);
    row(
        "encoder bwd",
        1,
        median(|| encoder_backward(&mut dwte, Some(&mut dwpe), &dy, &tokens, T, C)),
    );
    let logits0 = fill::<f32>(N * V, 3.0);
    let mut logits = logits0.clone();
    let mut losses = vec![0f32; N];
    row(
        "crossentropy",
        1,
        median(|| {
            logits.copy_from_slice(&logits0);
            crossentropy_forward(&mut losses, &mut logits, &tokens, V, Some(1.0 / N as f32))
        }),
    );
    // Matmuls, forward + backward, per layer and the LM head.
    let mut scratch = vec![0f32; scratch_len(N, 4 * C, 4 * C).max(scratch_len(N, C, V))];
    let mut mm = |name, k: usize, n: usize, layout: Layout, calls| {
        let (x, w, bias) = (
            fill::<X>(N * k, 1.0),
            fill::<X>(k * n, 0.05),
            fill::<X>(n, 0.1),
        );
        let (mut dx, mut dw, mut db) =
            (vec![X::ZERO; N * k], vec![X::ZERO; k * n], vec![X::ZERO; n]);
        let s = if layout == Layout::NK {
            let mut out = vec![0f32; N * n];
            let dout = fill::<f32>(N * n, 1e-3);
            median(|| matmul_forward(&mut out, &x, &w, None, layout, (N, k, n), &mut scratch))
                + median(|| {
                    matmul_backward(
                        &mut dx,
                        &mut dw,
                        None,
                        &dout,
                        &x,
                        &w,
                        layout,
                        (N, k, n),
                        DinpMode::Overwrite,
                        &mut scratch,
                    )
                })
        } else {
            let mut out = vec![X::ZERO; N * n];
            let dout = fill::<X>(N * n, 1e-3);
            median(|| {
                matmul_forward(
                    &mut out,
                    &x,
                    &w,
                    Some(&bias),
                    layout,
                    (N, k, n),
                    &mut scratch,
                )
            }) + median(|| {
                matmul_backward(
                    &mut dx,
                    &mut dw,
                    Some(&mut db),
                    &dout,
                    &x,
                    &w,
                    layout,
                    (N, k, n),
                    DinpMode::Overwrite,
                    &mut scratch,
                )
            })
        };
        (name, calls, s)
    };
    let mms = [
        mm("matmul c_attn", C, 3 * C, Layout::KN, L),
        mm("matmul c_proj", C, C, Layout::KN, L),
        mm("matmul c_fc", C, 4 * C, Layout::KN, L),
        mm("matmul mlp proj", 4 * C, C, Layout::KN, L),
        mm("matmul lm head", C, V, Layout::NK, 1),
    ];
    for (name, calls, s) in mms {
        row(name, calls, s);
    }
    // Whole-model passes of the optimizer step.
    let mut grads = zeros(X::ZERO, PARAMS);
    row("zero grads", 1, median(|| grads.fill(X::ZERO)));
    let g = fill::<X>(PARAMS, 1e-3);
    row(
        "sum squares",
        1,
        median(|| {
            std::hint::black_box(sum_squares(&g));
        }),
    );
    let mut master = fill::<f32>(PARAMS, 0.02);
    row("decay", 1, median(|| decay(&mut master, 0.999_99)));
    let (mut m, mut v) = (vec![0f32; PARAMS], vec![0f32; PARAMS]);
    let mut p = zeros(X::ZERO, PARAMS);
    let out = X::as_f32(&[]).is_none().then_some(&mut p[..]);
    let hp = AdamW {
        lr: 1e-4,
        ..AdamW::default()
    };
    let mut step = 0;
    let mut out = out;
    row(
        "adamw",
        1,
        median(|| {
            step += 1;
            adamw_step(
                &mut master,
                &g,
                &mut m,
                &mut v,
                out.as_deref_mut(),
                &hp,
                step,
                1.0,
                1.0,
            )
        }),
    );
    rows
}

fn print(dtype: &str, rows: &[Row]) {
    println!("\n{dtype}:\n");
    println!("| kernel | ms per call | calls per step | ms per step |");
    println!("|---|---|---|---|");
    let mut total = 0.0;
    for r in rows {
        let per_step = r.seconds * r.calls as f64 * 1e3;
        total += per_step;
        println!(
            "| {} | {:.3} | {} | {per_step:.1} |",
            r.name,
            r.seconds * 1e3,
            r.calls
        );
    }
    println!("| total | | | {total:.1} |");
}

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |d: &str| filters.is_empty() || filters.iter().any(|f| f == d);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = cpu::thread_pool(threads).expect("a thread pool");
    println!("threads: {threads}; gpt2-124M shapes, B={B} T={T}");
    if wanted("f32") {
        print("f32", &pool.install(layers::<f32>));
    }
    if wanted("bf16") {
        print("bf16", &pool.install(layers::<bf16>));
    }
}
