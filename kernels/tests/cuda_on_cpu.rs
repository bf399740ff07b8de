//! Every CUDA kernel of `kernels/cuda/*.cu`, run on the CPU through the thread-per-CUDA-thread
//! shim (`kernels/shim/cuda_shim.h`, built by `tests/shim`), against the CPU kernel of the same
//! name, at the tolerances of the GPU parity tests (`cuda_parity.rs`), with the launch
//! geometry of the Rust launchers (`kernels::cuda::{layers, grad_norm, optim}`). Outputs the kernels
//! overwrite start as NaN, so an element a kernel skips fails.
//!
//! One test: it prints each kernel it ran with its largest error (as a fraction of the
//! tolerance) and fails if any `extern "C" __global__` kernel of the sources was not run.
//! Needs a C++20 compiler (`c++`, or `$CXX`); no GPU, no CUDA.
#![cfg(feature = "cuda")]

use crate::attention_reference;
use crate::common;
use crate::shim;

use std::collections::BTreeMap;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Instant;

use attention_reference::{AttentionCase, OUTPUTS, pack, tolerances, unpack};
use common::*;
use cudarc::driver::LaunchConfig;
use kernels::Float;
use kernels::attention::AttentionDims;
use kernels::cuda::layers;
use kernels::matmul::{self, DinpMode, Layout};
use kernels::optim::{self, Adafactor, AdamW, LIMBS, Lion, Momentum};
use kernels::rope::{RopeDims, rope_backward, rope_forward};
use kernels::{crossentropy, encoder, gelu, grad_norm, layernorm, nf4, residual, rmsnorm, swiglu};
use shim::{Arg, Shim, inp, null, out, val};

type Bf16 = half::bf16;
type F16 = half::f16;

/// Largest error per checked output, as a fraction of its tolerance (0 = exact).
static WORST: Mutex<BTreeMap<String, f64>> = Mutex::new(BTreeMap::new());

fn run(name: &str, cfg: LaunchConfig, args: &[Arg]) {
    Shim::get().launch(name, cfg.grid_dim, cfg.block_dim, args);
}

/// `common::assert_close`, recording how close it came.
fn close_f64(what: &str, got: &[f64], want: &[f64], rtol: f64) {
    assert_close(what, got, want, rtol);
    let rms = (want.iter().map(|x| x * x).sum::<f64>() / want.len().max(1) as f64).sqrt();
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| {
            let err = (g - w).abs();
            if err == 0.0 {
                0.0
            } else {
                err / (rtol * (w.abs() + rms))
            }
        })
        .fold(0.0, f64::max);
    WORST.lock().unwrap().insert(what.into(), worst);
}

fn close<X: Float>(what: &str, got: &[X], want: &[X], rtol: f64) {
    close_f64(
        &format!("{what} ({})", X::NAME),
        &to_f64(got),
        &to_f64(want),
        rtol,
    );
}

fn len(n: usize) -> i64 {
    n as i64
}

fn casts<X: Float>() {
    let src = cast_inputs();
    let n = src.len();
    let mut x = nan::<X>(n);
    run(
        &format!("cast_from_f32_{}", X::NAME),
        kernels::cuda::elementwise(n),
        &[out(&mut x), inp(&src), val(len(n))],
    );
    let got: Vec<u32> = x.iter().map(|v| v.to_f32().to_bits()).collect();
    let want: Vec<u32> = src
        .iter()
        .map(|&v| X::from_f32(v).to_f32().to_bits())
        .collect();
    assert_eq!(got, want, "cast_from_f32 ({})", X::NAME);
    let mut back = vec![f32::NAN; n];
    run(
        &format!("cast_to_f32_{}", X::NAME),
        kernels::cuda::elementwise(n),
        &[out(&mut back), inp(&x), val(len(n))],
    );
    let got: Vec<u32> = back.iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "cast_to_f32 ({})", X::NAME);
    WORST
        .lock()
        .unwrap()
        .insert(format!("casts, bit for bit ({})", X::NAME), 0.0);
}

fn encoder_matches_cpu<X: Float>() {
    let (b, t, c, v) = (3, 17, 40, 11);
    let mut rng = Rng::new(2);
    let mut tokens = rng.tokens(b * t, v);
    tokens[3..40].fill(5); // one long run: positions summed 8 ways at once
    let (wte, wpe) = (
        random::<X>(&mut rng, v * c, 1.0),
        random::<X>(&mut rng, t * c, 1.0),
    );
    let bt = b * t;
    let mut got = nan::<X>(bt * c);
    run(
        &format!("encoder_forward_{}", X::NAME),
        kernels::cuda::elementwise(bt * c),
        &[
            out(&mut got),
            inp(&tokens),
            inp(&wte),
            inp(&wpe),
            val(len(bt)),
            val(len(t)),
            val(len(c)),
            val(len(v)),
        ],
    );
    let mut want = vec![X::ZERO; bt * c];
    encoder::encoder_forward(&mut want, &tokens, &wte, Some(&wpe), t, c);
    close("encoder_forward", &got, &want, rtol::<X>());
    // Without learned positions (a null wpe).
    let mut got = nan::<X>(bt * c);
    run(
        &format!("encoder_forward_{}", X::NAME),
        kernels::cuda::elementwise(bt * c),
        &[
            out(&mut got),
            inp(&tokens),
            inp(&wte),
            null(),
            val(len(bt)),
            val(len(t)),
            val(len(c)),
            val(len(v)),
        ],
    );
    encoder::encoder_forward(&mut want, &tokens, &wte, None, t, c);
    close("encoder_forward without wpe", &got, &want, rtol::<X>());

    let dout = random::<X>(&mut rng, bt * c, 1.0);
    let (dwte0, dwpe0) = (
        random::<X>(&mut rng, v * c, 1.0),
        random::<X>(&mut rng, t * c, 1.0),
    );
    let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
    let (order, starts) = layers::group_by_token(&tokens);
    let runs = starts.len() - 1;
    run(
        &format!("encoder_backward_wpe_{}", X::NAME),
        kernels::cuda::elementwise(t * c),
        &[
            out(&mut dwpe),
            inp(&dout),
            val(len(bt)),
            val(len(t)),
            val(len(c)),
        ],
    );
    run(
        &format!("encoder_backward_wte_{}", X::NAME),
        // Fewer block rows than runs: the kernel strides over them, as past 65,535 runs.
        LaunchConfig {
            grid_dim: (c.div_ceil(32) as u32, 4, 1),
            ..layers::encoder_wte_config(c, runs)
        },
        &[
            out(&mut dwte),
            inp(&dout),
            inp(&tokens),
            inp(&order),
            inp(&starts),
            val(len(runs)),
            val(len(c)),
        ],
    );
    let (mut want_te, mut want_pe) = (dwte0, dwpe0);
    encoder::encoder_backward(&mut want_te, Some(&mut want_pe), &dout, &tokens, t, c);
    close("encoder_backward dwte", &dwte, &want_te, rtol::<X>());
    close("encoder_backward dwpe", &dwpe, &want_pe, rtol::<X>());
}

fn layernorm_matches_cpu<X: Float>() {
    let (n, c) = (37, 300); // C not a multiple of the block: the tail loops run
    let mut rng = Rng::new(3);
    let x = random::<X>(&mut rng, n * c, 2.0);
    let (w, bias) = (random::<X>(&mut rng, c, 1.0), random::<X>(&mut rng, c, 1.0));
    let (mut o, mut mean, mut rstd) = (nan::<X>(n * c), nan::<f32>(n), nan::<f32>(n));
    run(
        &format!("layernorm_forward_{}", X::NAME),
        layers::layernorm_rows_config(n),
        &[
            out(&mut o),
            out(&mut mean),
            out(&mut rstd),
            inp(&x),
            inp(&w),
            inp(&bias),
            val(len(c)),
            val(len(n)),
            val(layernorm::EPS),
        ],
    );
    let (mut wo, mut wm, mut wr) = (vec![X::ZERO; n * c], vec![0f32; n], vec![0f32; n]);
    layernorm::layernorm_forward(&mut wo, &mut wm, &mut wr, &x, &w, &bias);
    close("layernorm_forward out", &o, &wo, rtol::<X>());
    close("layernorm_forward mean", &mean, &wm, 1e-5);
    close("layernorm_forward rstd", &rstd, &wr, 1e-5);

    let dout = random::<X>(&mut rng, n * c, 1.0);
    let (dinp0, dw0, db0) = (
        random::<X>(&mut rng, n * c, 1.0),
        random::<X>(&mut rng, c, 1.0),
        random::<X>(&mut rng, c, 1.0),
    );
    let (mut dinp, mut dw, mut db) = (dinp0.clone(), dw0.clone(), db0.clone());
    run(
        &format!("layernorm_backward_rows_{}", X::NAME),
        layers::layernorm_rows_config(n),
        &[
            out(&mut dinp),
            inp(&dout),
            inp(&x),
            inp(&w),
            inp(&mean),
            inp(&rstd),
            val(len(c)),
            val(len(n)),
        ],
    );
    let cols = layers::ColumnSums::new(n, c, 2);
    let mut scratch = nan::<f32>(cols.scratch);
    let chunk = len(cols.chunk);
    run(
        &format!("layernorm_backward_column_parts_{}", X::NAME),
        cols.parts,
        &[
            out(&mut scratch),
            inp(&dout),
            inp(&x),
            inp(&mean),
            inp(&rstd),
            val(len(n)),
            val(len(c)),
            val(chunk),
        ],
    );
    run(
        &format!("layernorm_backward_column_sums_{}", X::NAME),
        cols.sums,
        &[
            out(&mut dw),
            out(&mut db),
            inp(&scratch),
            val(len(n)),
            val(len(c)),
            val(chunk),
        ],
    );
    let (mut wi, mut ww, mut wb) = (dinp0, dw0, db0);
    layernorm::layernorm_backward(&mut wi, &mut ww, &mut wb, &dout, &x, &w, &wm, &wr);
    close("layernorm_backward dinp", &dinp, &wi, rtol::<X>());
    close("layernorm_backward dweight", &dw, &ww, rtol::<X>());
    close("layernorm_backward dbias", &db, &wb, rtol::<X>());
}

/// The attention kernels of one layout (packed GPT-2 qkv, else separate q, k, v) through the
/// shim with the launchers' tiles and grids, against the f64 reference (each output starts as
/// NaN). Returns the outputs, for comparing layouts bit for bit.
fn attention_case<X: Float>(d: AttentionDims, packed: bool, seed: u64) -> Vec<Vec<f64>> {
    let case = AttentionCase::new::<X>(d, seed);
    let (qn, kn, rows) = (case.q.len(), case.k.len(), d.b * d.nh * d.t);
    let [xq, xk, xv, xdout] = [&case.q, &case.k, &case.v, &case.dout].map(|x| to_x::<X>(x));
    let (fwd, bwd) = (
        layers::AttentionTiles::forward(d.head_size),
        layers::AttentionTiles::backward(d.head_size),
    );
    let dims = if packed {
        vec![d.t, d.q_width(), d.nh]
    } else {
        vec![d.t, d.nh, d.kv_heads, d.head_size]
    };
    let shape = |tiles: layers::AttentionTiles| {
        dims.iter()
            .copied()
            .chain([tiles.q, tiles.k])
            .map(|n| val(n as i32))
    };
    let (query, keys) = (
        layers::attention_config(&d, bwd),
        layers::attention_key_config(&d, bwd),
    );
    let layout = if packed { "attention" } else { "gqa_attention" };
    let name = |k: &str| format!("{layout}_{k}_{}", X::NAME);
    let (mut o, mut lse, mut delta) = (nan::<X>(qn), nan::<f32>(rows), nan::<f32>(rows));
    let (dq, dk, dv) = if packed {
        let c = d.q_width();
        let qkv = pack(&xq, &xk, &xv, c);
        let mut args = vec![out(&mut o), out(&mut lse), inp(&qkv)];
        args.extend(shape(fwd));
        run(&name("forward"), layers::attention_config(&d, fwd), &args);
        let mut dqkv = nan::<X>(qkv.len());
        let mut args = vec![
            out(&mut dqkv),
            out(&mut delta),
            inp(&xdout),
            inp(&qkv),
            inp(&o),
            inp(&lse),
        ];
        args.extend(shape(bwd));
        run(&name("backward_query"), query, &args);
        let mut args = vec![
            out(&mut dqkv),
            inp(&xdout),
            inp(&qkv),
            inp(&lse),
            inp(&delta),
        ];
        args.extend(shape(bwd));
        run(&name("backward_key"), keys, &args);
        let [dq, dk, dv] = unpack(&dqkv, c);
        (dq, dk, dv)
    } else {
        let mut args = vec![out(&mut o), out(&mut lse), inp(&xq), inp(&xk), inp(&xv)];
        args.extend(shape(fwd));
        run(&name("forward"), layers::attention_config(&d, fwd), &args);
        let (mut dq, mut dk, mut dv) = (nan::<X>(qn), nan::<X>(kn), nan::<X>(kn));
        let mut args = vec![
            out(&mut dq),
            out(&mut delta),
            inp(&xdout),
            inp(&xq),
            inp(&xk),
            inp(&xv),
            inp(&o),
            inp(&lse),
        ];
        args.extend(shape(bwd));
        run(&name("backward_query"), query, &args);
        let mut args = vec![
            out(&mut dk),
            out(&mut dv),
            inp(&xdout),
            inp(&xq),
            inp(&xk),
            inp(&xv),
            inp(&lse),
            inp(&delta),
        ];
        args.extend(shape(bwd));
        run(&name("backward_key"), keys, &args);
        (dq, dk, dv)
    };
    let got = vec![
        to_f64(&o),
        to_f64(&lse),
        to_f64(&delta),
        to_f64(&dq),
        to_f64(&dk),
        to_f64(&dv),
    ];
    let want = case.expected(&got[0]);
    for (i, what) in OUTPUTS.iter().enumerate() {
        let label = format!(
            "{layout} {what} (B {}, T {}, NH {}, KV {}, hs {}) ({})",
            d.b,
            d.t,
            d.nh,
            d.kv_heads,
            d.head_size,
            X::NAME
        );
        close_f64(&label, &got[i], &want[i], tolerances::<X>()[i]);
    }
    got
}

/// The packed (GPT-2) layout: T past a tile (and two batches), T = 1, a head of 100 columns
/// (padded to 128: 32 × 16 forward tiles) and T past 1024. With KV = NH the separate layout
/// gives the same bits.
fn attention_matches_reference<X: Float>() {
    let d = AttentionDims::mha(2, 70, 80, 2); // hs 40: forward 64 × 32, backward 32 × 32 tiles
    assert!(
        attention_case::<X>(d, true, 4) == attention_case::<X>(d, false, 4),
        "packed and separate attention differ ({})",
        X::NAME
    );
    attention_case::<X>(AttentionDims::mha(1, 1, 6, 2), true, 5);
    attention_case::<X>(AttentionDims::mha(1, 40, 200, 2), true, 6);
    attention_case::<X>(AttentionDims::mha(1, 1100, 16, 1), true, 7);
}

/// Grouped-query attention: 2 and 4 query heads per key/value head, heads of 64, 24 and 256
/// (16 × 8 forward and 8 × 8 backward tiles), and T past 1024.
fn gqa_attention_matches_reference<X: Float>() {
    attention_case::<X>(AttentionDims::gqa(1, 37, 4, 2, 64), false, 12);
    attention_case::<X>(AttentionDims::gqa(2, 19, 8, 2, 24), false, 13);
    attention_case::<X>(AttentionDims::gqa(1, 20, 2, 1, 256), false, 14);
    attention_case::<X>(AttentionDims::gqa(1, 1030, 2, 1, 8), false, 15);
}

/// RMSNorm as the block norm (C not a multiple of the block) and as a per-head norm.
fn rmsnorm_matches_cpu<X: Float>() {
    let mut rng = Rng::new(13);
    for (n, c) in [(37, 300), (40, 64)] {
        let x = random::<X>(&mut rng, n * c, 2.0);
        let w = random::<X>(&mut rng, c, 1.0);
        let (mut o, mut rstd) = (nan::<X>(n * c), nan::<f32>(n));
        let what = |k: &str| format!("rmsnorm_{k} C {c}");
        let name = |k: &str| format!("rmsnorm_{k}_{}", X::NAME);
        run(
            &name("forward"),
            layers::layernorm_rows_config(n),
            &[
                out(&mut o),
                out(&mut rstd),
                inp(&x),
                inp(&w),
                val(len(c)),
                val(len(n)),
                val(1e-6f32),
            ],
        );
        let (mut wo, mut wr) = (vec![X::ZERO; n * c], vec![0f32; n]);
        rmsnorm::rmsnorm_forward(&mut wo, &mut wr, &x, &w, 1e-6);
        close(&what("forward out"), &o, &wo, rtol::<X>());
        close(&what("forward rstd"), &rstd, &wr, 1e-5);

        let dout = random::<X>(&mut rng, n * c, 1.0);
        let (dinp0, dw0) = (
            random::<X>(&mut rng, n * c, 1.0),
            random::<X>(&mut rng, c, 1.0),
        );
        let (mut dinp, mut dw) = (dinp0.clone(), dw0.clone());
        run(
            &name("backward_rows"),
            layers::layernorm_rows_config(n),
            &[
                out(&mut dinp),
                inp(&dout),
                inp(&x),
                inp(&w),
                inp(&rstd),
                val(len(c)),
                val(len(n)),
            ],
        );
        let cols = layers::ColumnSums::new(n, c, 1);
        let mut scratch = nan::<f32>(cols.scratch);
        let chunk = len(cols.chunk);
        run(
            &name("backward_column_parts"),
            cols.parts,
            &[
                out(&mut scratch),
                inp(&dout),
                inp(&x),
                inp(&rstd),
                val(len(n)),
                val(len(c)),
                val(chunk),
            ],
        );
        run(
            &name("backward_column_sums"),
            cols.sums,
            &[
                out(&mut dw),
                inp(&scratch),
                val(len(n)),
                val(len(c)),
                val(chunk),
            ],
        );
        let (mut wi, mut ww) = (dinp0, dw0);
        rmsnorm::rmsnorm_backward(&mut wi, &mut ww, &dout, &x, &w, &wr);
        close(&what("backward dinp"), &dinp, &wi, rtol::<X>());
        close(&what("backward dweight"), &dw, &ww, rtol::<X>());
    }
}

fn rope_matches_cpu<X: Float>() {
    let d = RopeDims {
        t: 7,
        heads: 3,
        head_dim: 20,
    };
    let rows = 2 * d.t * d.heads;
    let (cos, sin) = rope_tables(d.t + 2, d.head_dim);
    let x = random::<X>(&mut Rng::new(14), rows * d.head_dim, 1.0);
    let cfg = kernels::cuda::elementwise(rows * d.head_dim / 2);
    for (kernel, cpu) in [
        (
            "rope_forward",
            rope_forward::<X> as fn(&mut [X], &[f32], &[f32], RopeDims),
        ),
        ("rope_backward", rope_backward::<X>),
    ] {
        let mut got = x.clone();
        run(
            &format!("{kernel}_{}", X::NAME),
            cfg,
            &[
                out(&mut got),
                inp(&cos),
                inp(&sin),
                val(len(rows)),
                val(len(d.t)),
                val(len(d.heads)),
                val(len(d.head_dim / 2)),
            ],
        );
        let mut want = x.clone();
        cpu(&mut want, &cos, &sin, d);
        close(kernel, &got, &want, rtol::<X>());
    }
}

fn elementwise_layers_match_cpu<X: Float>() {
    let n = 3001; // a ragged last block
    let cfg = kernels::cuda::elementwise(n);
    let mut rng = Rng::new(5);
    let (a, b) = (random::<X>(&mut rng, n, 4.0), random::<X>(&mut rng, n, 4.0));
    let mut o = nan::<X>(n);
    let name = |k: &str| format!("{k}_{}", X::NAME);
    run(
        &name("gelu_forward"),
        cfg,
        &[out(&mut o), inp(&a), val(len(n))],
    );
    let mut want = vec![X::ZERO; n];
    gelu::gelu_forward(&mut want, &a);
    close("gelu_forward", &o, &want, rtol::<X>());
    let mut g = b.clone();
    run(
        &name("gelu_backward"),
        cfg,
        &[out(&mut g), inp(&a), val(len(n))],
    );
    let mut want = b.clone();
    gelu::gelu_backward(&mut want, &a);
    close("gelu_backward", &g, &want, rtol::<X>());
    let mut o = nan::<X>(n);
    run(
        &name("residual_forward"),
        cfg,
        &[out(&mut o), inp(&a), inp(&b), val(len(n))],
    );
    let mut want = vec![X::ZERO; n];
    residual::residual_forward(&mut want, &a, &b);
    close("residual_forward", &o, &want, rtol::<X>());
    let mut acc = a.clone();
    run(
        &name("residual_accumulate"),
        cfg,
        &[out(&mut acc), inp(&b), val(len(n))],
    );
    let mut want = a.clone();
    residual::residual_accumulate(&mut want, &b);
    close("residual_accumulate", &acc, &want, rtol::<X>());
    let mut scaled = a.clone();
    run(
        &name("scale"),
        cfg,
        &[out(&mut scaled), val(0.375f32), val(len(n))],
    );
    let mut want = a.clone();
    residual::scale(&mut want, 0.375);
    close("scale", &scaled, &want, 0.0);

    let mut o = nan::<X>(n);
    run(
        &name("swiglu_forward"),
        cfg,
        &[out(&mut o), inp(&a), inp(&b), val(len(n))],
    );
    let mut want = vec![X::ZERO; n];
    swiglu::swiglu_forward(&mut want, &a, &b);
    close("swiglu_forward", &o, &want, rtol::<X>());
    let dout = random::<X>(&mut rng, n, 1.0);
    let (mut dg, mut du) = (nan::<X>(n), dout.clone());
    run(
        &name("swiglu_backward"),
        cfg,
        &[out(&mut dg), out(&mut du), inp(&a), inp(&b), val(len(n))],
    );
    let (mut wg, mut wu) = (vec![X::ZERO; n], dout.clone());
    swiglu::swiglu_backward(&mut wg, &mut wu, &a, &b);
    close("swiglu_backward dgate", &dg, &wg, rtol::<X>());
    close("swiglu_backward dup", &du, &wu, rtol::<X>());
}

/// NF4 quantization is exact on both back ends (bitsandbytes' bits), so the shim must match the
/// CPU bit for bit: codes, absmax (a zero block and a short odd last block included) and the
/// dequantized values.
fn nf4_matches_cpu<X: Float>() {
    let n = 64 * 40 + 37;
    let mut rng = Rng::new(12);
    let mut x = random::<X>(&mut rng, n, 0.05);
    x[64..128].fill(X::ZERO);
    let (bytes, blocks) = (nf4::code_bytes(n), nf4::blocks(n));
    let (mut codes, mut absmax) = (vec![0xa5u8; bytes], vec![f32::NAN; blocks]);
    run(
        &format!("nf4_quantize_{}", X::NAME),
        kernels::cuda::nf4::quantize_config(n),
        &[out(&mut codes), out(&mut absmax), inp(&x), val(len(n))],
    );
    let (mut want_codes, mut want_absmax) = (vec![0u8; bytes], vec![0f32; blocks]);
    nf4::quantize(&x, &mut want_codes, &mut want_absmax);
    assert_eq!(codes, want_codes, "nf4_quantize codes");
    let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&absmax), bits(&want_absmax), "nf4_quantize absmax");
    let mut back = nan::<X>(n);
    run(
        &format!("nf4_dequantize_{}", X::NAME),
        kernels::cuda::elementwise(n),
        &[out(&mut back), inp(&codes), inp(&absmax), val(len(n))],
    );
    let mut want = vec![X::ZERO; n];
    nf4::dequantize(&want_codes, &want_absmax, &mut want);
    close("nf4_dequantize", &back, &want, 0.0);
}

/// Dropout draws the CPU's masks on the GPU: forward and backward bit for bit.
fn dropout_matches_cpu<X: Float>() {
    let n = 5000;
    let DropoutCase {
        x,
        acc,
        mask,
        forward,
        backward,
    } = dropout_case::<X>(n);
    let (p, key, offset) = (mask.p, mask.key, mask.offset);
    let mut got = nan::<X>(n);
    run(
        &format!("dropout_forward_{}", X::NAME),
        kernels::cuda::elementwise(n),
        &[
            out(&mut got),
            inp(&x),
            val(p),
            val(key),
            val(offset),
            val(len(n)),
        ],
    );
    close("dropout_forward", &got, &forward, 0.0);
    let mut dinp = acc;
    run(
        &format!("dropout_backward_{}", X::NAME),
        kernels::cuda::elementwise(n),
        &[
            out(&mut dinp),
            inp(&x),
            val(p),
            val(key),
            val(offset),
            val(len(n)),
        ],
    );
    close("dropout_backward", &dinp, &backward, 0.0);
}

fn crossentropy_matches_cpu() {
    let (n, v) = (3, 5003);
    let mut rng = Rng::new(6);
    let logits: Vec<f32> = rng.vec(n * v, 8.0).iter().map(|&x| x as f32).collect();
    let mut targets = rng.tokens(n, v);
    // Row 2's target ignored (both kernels: zero loss, zero row). Row 1's outside the
    // vocabulary: a NaN loss and the row left as it was (the CPU kernel refuses such a target,
    // so it sees a valid one there and row 1 is checked alone).
    targets[2] = crossentropy::IGNORE;
    let mut bad = targets.clone();
    bad[1] = v as u32 + 2;
    for dloss in [None, Some(0.25f32)] {
        let (mut losses, mut lg) = (nan::<f32>(n), logits.clone());
        run(
            "crossentropy_forward",
            layers::crossentropy_config(n),
            &[
                out(&mut losses),
                out(&mut lg),
                inp(&bad),
                val(len(v)),
                val(dloss.is_some() as i32),
                val(dloss.unwrap_or(0.0)),
            ],
        );
        let (mut wl, mut wg) = (vec![0f32; n], logits.clone());
        crossentropy::crossentropy_forward(&mut wl, &mut wg, &targets, v, dloss);
        assert!(losses[1].is_nan(), "a target outside V gives a NaN loss");
        assert_eq!(
            lg[v..2 * v],
            logits[v..2 * v],
            "and leaves its row as it was"
        );
        let (rows, keep) = ([0, 2], |x: &[f32], r: &[usize]| -> Vec<f32> {
            r.iter()
                .flat_map(|&i| x[i * v..(i + 1) * v].to_vec())
                .collect()
        });
        let pick = |x: &[f32]| -> Vec<f32> { rows.iter().map(|&i| x[i]).collect() };
        close(
            &format!("crossentropy losses {dloss:?}"),
            &pick(&losses),
            &pick(&wl),
            1e-5,
        );
        close(
            &format!("crossentropy logits {dloss:?}"),
            &keep(&lg, &rows),
            &keep(&wg, &rows),
            1e-5,
        );
    }
}

/// `matmul_bias_backward_<X>_<G>`: the bias gradient of a dense layer against the CPU's
/// matmul_backward, dout of dtype G (X, or f32 for logits).
fn bias_backward_matches_cpu<X: Float, G: Float>() {
    let (m, k, n) = (77, 5, 101); // three chunks of rows, the last one short
    let mut rng = Rng::new(11);
    let (x, w) = (
        random::<X>(&mut rng, m * k, 1.0),
        random::<X>(&mut rng, k * n, 0.5),
    );
    let dout = random::<G>(&mut rng, m * n, 1.0);
    let db0 = random::<X>(&mut rng, n, 1.0);
    let mut db = db0.clone();
    let cols = kernels::cuda::matmul::bias_backward_config(m, n);
    let mut parts = nan::<f32>(cols.scratch);
    let (ml, nl, chunk) = (val(len(m)), val(len(n)), len(cols.chunk));
    run(
        &format!("matmul_bias_backward_parts_{}", G::NAME),
        cols.parts,
        &[out(&mut parts), inp(&dout), ml, nl, val(chunk)],
    );
    run(
        &format!("matmul_bias_backward_sums_{}", X::NAME),
        cols.sums,
        &[
            out(&mut db),
            inp(&parts),
            val(len(m)),
            val(len(n)),
            val(chunk),
        ],
    );
    let (mut dx, mut dw, mut want) = (vec![X::ZERO; m * k], vec![X::ZERO; k * n], db0);
    let mut scratch = vec![0f32; matmul::scratch_len(m, k, n)];
    matmul::matmul_backward(
        &mut dx,
        &mut dw,
        Some(&mut want),
        &dout,
        &x,
        &w,
        Layout::KN,
        (m, k, n),
        DinpMode::Overwrite,
        &mut scratch,
    );
    close(
        &format!("matmul_bias_backward dout {}", G::NAME),
        &db,
        &want,
        rtol::<X>(),
    );
}

fn norms_match_cpu<X: Float>() {
    let n = 10_003;
    let mut rng = Rng::new(7);
    let g = random::<X>(&mut rng, n, 3.0);
    // 16 partial sums rather than the launcher's 256 (sum_squares_parts_len): the kernels
    // take any count, and 256 blocks of 256 OS threads would take seconds here.
    let parts_len = 16;
    let (mut total, mut parts) = ([f64::NAN], vec![f64::NAN; parts_len]);
    let chunk = len(n.div_ceil(parts_len).max(1));
    let (mut parts_cfg, one) = kernels::cuda::grad_norm::sum_squares_configs();
    parts_cfg.grid_dim.0 = parts_len as u32;
    run(
        &format!("sum_squares_parts_{}", X::NAME),
        parts_cfg,
        &[out(&mut parts), inp(&g), val(len(n)), val(chunk)],
    );
    run(
        "sum_parts",
        one,
        &[out(&mut total), inp(&parts), val(parts_len as i32)],
    );
    let want = grad_norm::sum_squares(&g);
    assert!(
        (total[0] - want).abs() <= 1e-12 * want,
        "sum_squares ({}): {} vs {want}",
        X::NAME,
        total[0]
    );
    WORST.lock().unwrap().insert(
        format!("sum_squares ({}), |err| / 1e-12·want", X::NAME),
        (total[0] - want).abs() / (1e-12 * want),
    );

    let mut flag = [0i32];
    let mut dg = g.clone();
    let cfg = kernels::cuda::elementwise(n);
    let name = format!("unscale_{}", X::NAME);
    run(
        &name,
        cfg,
        &[out(&mut dg), val(0.5f32), val(len(n)), out(&mut flag)],
    );
    let want: Vec<X> = g.iter().map(|x| X::from_f32(x.to_f32() * 0.5)).collect();
    close("unscale", &dg, &want, 0.0);
    assert_eq!(flag, [0], "finite gradients raise no flag");
    let mut dg = g.clone();
    dg[n / 2] = X::from_f32(f32::INFINITY);
    run(
        &name,
        cfg,
        &[out(&mut dg), val(0.5f32), val(len(n)), out(&mut flag)],
    );
    assert_eq!(flag, [1], "an inf gradient raises the flag ({})", X::NAME);
}

/// `(lr / (1 - β1^t), sqrt(1 - β2^t))` in f64, as the launchers compute them on the host
/// (`kernels::optim::bias_correction`, private to the crate).
fn bias_correction(lr: f32, beta1: f32, beta2: f32, step: u64) -> (f32, f32) {
    let t = step as i32;
    let (bc1, bc2) = (1.0 - (beta1 as f64).powi(t), 1.0 - (beta2 as f64).powi(t));
    ((lr as f64 / bc1) as f32, bc2.sqrt() as f32)
}

/// The elementwise updates' weight-decay factor in these checks (1 - lr·wd for lr 1e-2, wd 0.1).
const DECAY: f32 = 0.999;

fn pair<G: Float, X: Float>(kernel: &str) -> String {
    format!("{kernel}_{}_{}", G::NAME, X::NAME)
}

/// SGD, momentum, AdamW and Lion for gradients of dtype G and compute copies of dtype X.
fn elementwise_optimizers_match_cpu<G: Float, X: Float>() {
    let n = 1_007;
    let Case {
        master,
        grad,
        state,
    } = case::<G>(8, n);
    let cfg = kernels::cuda::elementwise(n);
    let what = |k: &str| format!("{k}_{}_{}", G::NAME, X::NAME);
    let check = |k: &str, m: &[f32], o: &[X], wm: &[f32], wo: &[X]| {
        close(&format!("{} master", what(k)), m, wm, 1e-6);
        close(&format!("{} param_out", what(k)), o, wo, rtol::<X>());
    };

    let (mut m, mut o) = (master.clone(), nan::<X>(n));
    run(
        &pair::<G, X>("sgd_step"),
        cfg,
        &[
            out(&mut m),
            inp(&grad),
            out(&mut o),
            val(len(n)),
            val(0.1f32),
            val(0.5f32),
            val(DECAY),
        ],
    );
    let (mut wm, mut wo) = (master.clone(), vec![X::ZERO; n]);
    optim::sgd_step(&mut wm, &grad, Some(&mut wo), 0.1, 0.5, DECAY);
    check("sgd", &m, &o, &wm, &wo);

    let hp = Momentum {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
    };
    let (mut m, mut buf, mut o) = (master.clone(), state.clone(), nan::<X>(n));
    run(
        &pair::<G, X>("momentum_step"),
        cfg,
        &[
            out(&mut m),
            inp(&grad),
            out(&mut buf),
            out(&mut o),
            val(len(n)),
            val(hp.lr),
            val(hp.momentum),
            val(hp.nesterov as i32),
            val(0.5f32),
            val(DECAY),
        ],
    );
    let (mut wm, mut wb, mut wo) = (master.clone(), state.clone(), vec![X::ZERO; n]);
    optim::momentum_step(&mut wm, &grad, &mut wb, Some(&mut wo), &hp, 0.5, DECAY);
    check("momentum", &m, &o, &wm, &wo);
    close(&format!("{} buf", what("momentum")), &buf, &wb, 1e-6);

    let hp = AdamW {
        lr: 1e-2,
        ..AdamW::default()
    };
    let step = 3;
    let (step_size, bc2_sqrt) = bias_correction(hp.lr, hp.beta1, hp.beta2, step);
    let v0: Vec<f32> = state.iter().map(|s| s * s).collect();
    let (mut m, mut s1, mut s2, mut o) = (master.clone(), state.clone(), v0.clone(), nan::<X>(n));
    run(
        &pair::<G, X>("adamw_step"),
        cfg,
        &[
            out(&mut m),
            inp(&grad),
            out(&mut s1),
            out(&mut s2),
            out(&mut o),
            val(len(n)),
            val(hp.beta1),
            val(hp.beta2),
            val(hp.eps),
            val(step_size),
            val(bc2_sqrt),
            val(0.5f32),
            val(DECAY),
        ],
    );
    let (mut wm, mut w1, mut w2, mut wo) =
        (master.clone(), state.clone(), v0.clone(), vec![X::ZERO; n]);
    optim::adamw_step(
        &mut wm,
        &grad,
        &mut w1,
        &mut w2,
        Some(&mut wo),
        &hp,
        step,
        0.5,
        DECAY,
    );
    check("adamw", &m, &o, &wm, &wo);
    close(&format!("{} m", what("adamw")), &s1, &w1, 1e-6);
    close(&format!("{} v", what("adamw")), &s2, &w2, 1e-6);

    let hp = Lion {
        lr: 1e-2,
        ..Lion::default()
    };
    // Without param_out (a null pointer), as an f32 trainer calls it.
    let (mut m, mut s1) = (master.clone(), state.clone());
    run(
        &pair::<G, X>("lion_step"),
        cfg,
        &[
            out(&mut m),
            inp(&grad),
            out(&mut s1),
            null(),
            val(len(n)),
            val(hp.lr),
            val(hp.beta1),
            val(hp.beta2),
            val(0.5f32),
            val(DECAY),
        ],
    );
    let (mut wm, mut w1) = (master.clone(), state.clone());
    optim::lion_step::<G, X>(&mut wm, &grad, &mut w1, None, &hp, 0.5, DECAY);
    close(&format!("{} master", what("lion")), &m, &wm, 1e-6);
    close(&format!("{} m", what("lion")), &s1, &w1, 1e-6);
}

fn decay_matches_cpu() {
    let Case { master, .. } = case::<f32>(12, 999);
    let mut m = master.clone();
    run(
        "decay",
        kernels::cuda::elementwise(m.len()),
        &[out(&mut m), val(0.99f32), val(len(master.len()))],
    );
    let mut wm = master;
    optim::decay(&mut wm, 0.99);
    close("decay", &m, &wm, 0.0);
}

fn adam8bit_matches_cpu<G: Float, X: Float>() {
    let (n, block) = (700, 256); // a partial last block
    let Case { master, grad, .. } = case::<G>(9, n);
    let hp = AdamW {
        lr: 1e-2,
        ..AdamW::default()
    };
    let (code_m, code_v) = (optim::dynamic_map(true), optim::dynamic_map(false));
    let blocks = optim::adam8bit_blocks(n, block);
    let (mut m, mut qm, mut qv) = (master.clone(), vec![0u8; n], vec![0u8; n]);
    let (mut am, mut av, mut o) = (vec![0f32; blocks], vec![0f32; blocks], nan::<X>(n));
    let (mut wm, mut wqm, mut wqv) = (master.clone(), vec![0u8; n], vec![0u8; n]);
    let (mut wam, mut wav, mut wo) = (vec![0f32; blocks], vec![0f32; blocks], vec![X::ZERO; n]);
    for step in 1..=3 {
        let (step_size, bc2_sqrt) = bias_correction(hp.lr, hp.beta1, hp.beta2, step);
        let (eps_hat, step_size) = (hp.eps * bc2_sqrt, step_size * bc2_sqrt);
        run(
            &pair::<G, X>("adam8bit_step"),
            kernels::cuda::optim::adam8bit_config(n, block),
            &[
                out(&mut m),
                inp(&grad),
                out(&mut qm),
                out(&mut qv),
                out(&mut am),
                out(&mut av),
                out(&mut o),
                inp(&code_m),
                inp(&code_v),
                val(len(n)),
                val(len(block)),
                val(hp.beta1),
                val(hp.beta2),
                val(eps_hat),
                val(step_size),
                val(0.5f32),
            ],
        );
        optim::adam8bit_step(
            &mut wm,
            &grad,
            &mut wqm,
            &mut wqv,
            &mut wam,
            &mut wav,
            Some(&mut wo),
            &hp,
            step,
            0.5,
            block,
        );
    }
    let what = pair::<G, X>("adam8bit_step");
    close(&format!("{what} master"), &m, &wm, 1e-6);
    close(&format!("{what} param_out"), &o, &wo, rtol::<X>());
    close(&format!("{what} absmax_m"), &am, &wam, 1e-6);
    close(&format!("{what} absmax_v"), &av, &wav, 1e-6);
    assert_eq!(qm, wqm, "{what} m codes ({})", X::NAME);
    assert_eq!(qv, wqv, "{what} v codes ({})", X::NAME);
}

/// Adafactor's phases with gradients of dtype G: the matrix statistics (two shards cut
/// mid-row), the row mean, Σu², and the vector EMA; the same bits as the CPU's exact sums.
/// Returns what `adafactor_apply` needs.
fn adafactor_phases_match_cpu<G: Float>() {
    let (rows, cols) = (9, 13);
    let n = rows * cols;
    let Case { grad, .. } = case::<G>(10, n);
    let hp = Adafactor {
        lr: 1e-2,
        beta1: Some(0.9),
        ..Adafactor::default()
    };
    let step = 2;
    let gname = G::NAME;
    let (mut rs, mut cs) = (vec![0f64; rows * LIMBS], vec![0f64; cols * LIMBS]);
    let (mut wrs, mut wcs) = (rs.clone(), cs.clone());
    let cut = n / 2 + 3;
    for (lo, hi) in [(0, cut), (cut, n)] {
        let g = &grad[lo..hi];
        run(
            &format!("adafactor_sq_sums_{gname}"),
            kernels::cuda::elementwise(g.len()),
            &[
                inp(g),
                val(len(lo)),
                val(len(g.len())),
                val(len(cols)),
                val(0.5f32),
                val(hp.eps1),
                out(&mut rs),
                out(&mut cs),
            ],
        );
        optim::adafactor_sq_sums(g, lo, 0.5, &hp, &mut wrs, &mut wcs);
    }
    close_f64(&format!("adafactor_sq_sums rows ({gname})"), &rs, &wrs, 0.0);
    close_f64(&format!("adafactor_sq_sums cols ({gname})"), &cs, &wcs, 0.0);

    let (mut row, mut col) = (vec![0.01f32; rows], vec![0.02f32; cols]);
    let b = hp.beta2t(step);
    for (s, sums, count, per) in [(&mut row, &rs, rows, cols), (&mut col, &cs, cols, rows)] {
        run(
            "adafactor_update_stats",
            kernels::cuda::elementwise(count),
            &[out(s), inp(sums), val(len(count)), val(per as f32), val(b)],
        );
    }
    let (mut wr, mut wc) = (vec![0.01f32; rows], vec![0.02f32; cols]);
    optim::adafactor_update_stats(&mut wr, &mut wc, &wrs, &wcs, &hp, step);
    close("adafactor_update_stats row", &row, &wr, 0.0);
    close("adafactor_update_stats col", &col, &wc, 0.0);

    let mut mean = [f32::NAN];
    run(
        "adafactor_row_mean",
        kernels::cuda::optim::row_mean_config(),
        &[out(&mut mean), inp(&row), val(len(rows))],
    );
    let mut rms = vec![0f64; LIMBS];
    run(
        &format!("adafactor_rms_sum_{gname}"),
        kernels::cuda::elementwise(n),
        &[
            inp(&grad),
            val(0i64),
            val(len(n)),
            val(len(cols)),
            val(0.5f32),
            inp(&row),
            inp(&col),
            inp(&mean),
            out(&mut rms),
        ],
    );
    let mut wrms = vec![0f64; LIMBS];
    let moment = optim::Moment::Factored {
        row: &wr,
        col: &wc,
        start: 0,
    };
    optim::adafactor_rms_sum(&grad, 0.5, moment, &mut wrms);
    close_f64(&format!("adafactor_rms_sum ({gname})"), &rms, &wrms, 0.0);

    let (mut v, mut vrms) = (vec![0.01f32; n], vec![0f64; LIMBS]);
    run(
        &format!("adafactor_vector_ema_{gname}"),
        kernels::cuda::elementwise(n),
        &[
            out(&mut v),
            inp(&grad),
            val(len(n)),
            val(0.5f32),
            val(hp.eps1),
            val(b),
            out(&mut vrms),
        ],
    );
    let (mut wv, mut wvrms) = (vec![0.01f32; n], vec![0f64; LIMBS]);
    optim::adafactor_vector_ema(&mut wv, &grad, 0.5, &hp, step, &mut wvrms);
    close(
        &format!("adafactor_vector_ema v grad {gname}"),
        &v,
        &wv,
        0.0,
    );
    close_f64(
        &format!("adafactor_vector_ema Σu² ({gname})"),
        &vrms,
        &wvrms,
        0.0,
    );
}

/// `adafactor_apply_<G>_<X>`: factored with the first moment and param_out, then full
/// without either.
fn adafactor_apply_matches_cpu<G: Float, X: Float>() {
    let (rows, cols) = (9, 13);
    let n = rows * cols;
    let Case { master, grad, .. } = case::<G>(13, n);
    let mut rng = Rng::new(14);
    let pos = |rng: &mut Rng, k| -> Vec<f32> {
        rng.vec(k, 0.5).iter().map(|&x| 0.6 + x as f32).collect()
    };
    let (row, col, v) = (pos(&mut rng, rows), pos(&mut rng, cols), pos(&mut rng, n));
    let mut rms = vec![0f64; LIMBS];
    optim::adafactor_rms_sum(
        &grad,
        0.5,
        optim::Moment::Full { v: &v, numel: n },
        &mut rms,
    );
    let hp = Adafactor {
        lr: 1e-2,
        beta1: Some(0.9),
        ..Adafactor::default()
    };
    let name = pair::<G, X>("adafactor_apply");
    let what = name.clone();
    let (mut m, mut ea, mut o) = (master.clone(), vec![0f32; n], nan::<X>(n));
    let (mut wm, mut wea, mut wo) = (master.clone(), vec![0f32; n], vec![X::ZERO; n]);
    let mut wmean = [0f32];
    run(
        "adafactor_row_mean",
        kernels::cuda::optim::row_mean_config(),
        &[out(&mut wmean), inp(&row), val(len(rows))],
    );
    run(
        &name,
        kernels::cuda::elementwise(n),
        &[
            out(&mut m),
            inp(&grad),
            out(&mut ea),
            out(&mut o),
            val(0i64),
            val(len(n)),
            val(len(cols)),
            inp(&row),
            inp(&col),
            inp(&wmean),
            null(),
            inp(&rms),
            val(n as f32),
            val(hp.lr),
            val(hp.clip_threshold),
            val(hp.beta1.unwrap()),
            val(0.5f32),
        ],
    );
    let moment = optim::Moment::Factored {
        row: &row,
        col: &col,
        start: 0,
    };
    optim::adafactor_apply(
        &mut wm,
        &grad,
        Some(&mut wea),
        Some(&mut wo),
        moment,
        &rms,
        &hp,
        0.5,
    );
    close(&format!("{what} factored master"), &m, &wm, 1e-6);
    close(&format!("{what} factored exp_avg"), &ea, &wea, 1e-6);
    close(&format!("{what} factored param_out"), &o, &wo, rtol::<X>());

    let hp = Adafactor {
        lr: 1e-2,
        ..Adafactor::default()
    };
    let mut m = master.clone();
    run(
        &name,
        kernels::cuda::elementwise(n),
        &[
            out(&mut m),
            inp(&grad),
            null(),
            null(),
            val(0i64),
            val(len(n)),
            val(1i64),
            null(),
            null(),
            null(),
            inp(&v),
            inp(&rms),
            val(n as f32),
            val(hp.lr),
            val(hp.clip_threshold),
            val(0f32),
            val(0.5f32),
        ],
    );
    let mut wm = master.clone();
    optim::adafactor_apply::<G, X>(
        &mut wm,
        &grad,
        None,
        None,
        optim::Moment::Full { v: &v, numel: n },
        &rms,
        &hp,
        0.5,
    );
    close(&format!("{what} full master"), &m, &wm, 1e-6);
}

/// `f::<G, X>()` for every gradient dtype G and compute dtype X.
macro_rules! every_pair {
    ($f:ident) => {
        vec![
            (concat!(stringify!($f), " f32 f32"), $f::<f32, f32> as fn()),
            (concat!(stringify!($f), " f32 bf16"), $f::<f32, Bf16>),
            (concat!(stringify!($f), " f32 f16"), $f::<f32, F16>),
            (concat!(stringify!($f), " bf16 f32"), $f::<Bf16, f32>),
            (concat!(stringify!($f), " bf16 bf16"), $f::<Bf16, Bf16>),
            (concat!(stringify!($f), " bf16 f16"), $f::<Bf16, F16>),
            (concat!(stringify!($f), " f16 f32"), $f::<F16, f32>),
            (concat!(stringify!($f), " f16 bf16"), $f::<F16, Bf16>),
            (concat!(stringify!($f), " f16 f16"), $f::<F16, F16>),
        ]
    };
}

macro_rules! every_dtype {
    ($f:ident) => {
        vec![
            (concat!(stringify!($f), " f32"), $f::<f32> as fn()),
            (concat!(stringify!($f), " bf16"), $f::<Bf16>),
            (concat!(stringify!($f), " f16"), $f::<F16>),
        ]
    };
}

#[test]
fn every_cuda_kernel_matches_the_cpu_kernels_on_the_cpu_shim() {
    let t0 = Instant::now();
    let shim = Shim::get();
    let built = t0.elapsed();
    let mut cases: Vec<(&str, fn())> = vec![
        ("casts bf16", casts::<Bf16>),
        ("casts f16", casts::<F16>),
        ("crossentropy", crossentropy_matches_cpu),
        ("decay", decay_matches_cpu),
        (
            "bias_backward f32 f32",
            bias_backward_matches_cpu::<f32, f32>,
        ),
        (
            "bias_backward bf16 bf16",
            bias_backward_matches_cpu::<Bf16, Bf16>,
        ),
        (
            "bias_backward f16 f16",
            bias_backward_matches_cpu::<F16, F16>,
        ),
        (
            "bias_backward bf16 f32",
            bias_backward_matches_cpu::<Bf16, f32>,
        ),
        (
            "bias_backward f16 f32",
            bias_backward_matches_cpu::<F16, f32>,
        ),
    ];
    cases.extend(every_dtype!(encoder_matches_cpu));
    cases.extend(every_dtype!(layernorm_matches_cpu));
    cases.extend(every_dtype!(attention_matches_reference));
    cases.extend(every_dtype!(gqa_attention_matches_reference));
    cases.extend(every_dtype!(rmsnorm_matches_cpu));
    cases.extend(every_dtype!(rope_matches_cpu));
    cases.extend(every_dtype!(elementwise_layers_match_cpu));
    cases.extend(every_dtype!(norms_match_cpu));
    cases.extend(every_dtype!(nf4_matches_cpu));
    cases.extend(every_dtype!(dropout_matches_cpu));
    cases.extend(every_dtype!(adafactor_phases_match_cpu));
    cases.extend(every_pair!(elementwise_optimizers_match_cpu));
    cases.extend(every_pair!(adam8bit_matches_cpu));
    cases.extend(every_pair!(adafactor_apply_matches_cpu));

    let mut failed = Vec::new();
    let mut err = std::io::stderr().lock();
    for (what, case) in cases {
        let t = Instant::now();
        if let Err(e) = catch_unwind(AssertUnwindSafe(case)) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failed.push(format!("{what}: {msg}"));
        }
        let _ = writeln!(err, "  {what}: {:.2} s", t.elapsed().as_secs_f64());
    }
    let _ = writeln!(
        err,
        "largest error of each output, as a fraction of its tolerance:"
    );
    for (what, worst) in WORST.lock().unwrap().iter() {
        let _ = writeln!(err, "  {worst:>8.4}  {what}");
    }
    let launches = shim.launches();
    let _ = writeln!(
        err,
        "ran {} of the {} kernels of kernels/cuda on the CPU shim ({} launches; shim ready in {:.1} s, all in {:.1} s):",
        shim.kernels.len() - shim.not_launched().len(),
        shim.kernels.len(),
        shim.kernels
            .iter()
            .filter_map(|k| launches.get(&k.name))
            .sum::<usize>(),
        built.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    for k in &shim.kernels {
        let n = launches.get(&k.name).copied().unwrap_or(0);
        let _ = writeln!(err, "  {:<14} {:<40} {n} launches", k.program, k.name);
    }
    let missing: Vec<String> = shim
        .not_launched()
        .iter()
        .map(|k| format!("{} ({})", k.name, k.program))
        .collect();
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
    assert!(
        missing.is_empty(),
        "kernels no case ran (add them to cuda_on_cpu.rs): {}",
        missing.join(", ")
    );
}

/// attention.cu's static shared memory per block: forward 42,496 bytes, backward_query 37,760,
/// backward_key 41,984 (the largest tiles' arrays).
const ATTENTION_SHARED: [usize; 3] = [42_496, 37_760, 41_984];

/// The three attention launches of `d` are within the GPU's limits.
fn attention_fits(d: &AttentionDims) {
    use kernels::cuda::check_launch;
    let (fwd, bwd) = (
        layers::AttentionTiles::forward(d.head_size),
        layers::AttentionTiles::backward(d.head_size),
    );
    let launches = [
        layers::attention_config(d, fwd),
        layers::attention_config(d, bwd),
        layers::attention_key_config(d, bwd),
    ];
    for (cfg, shared) in launches.iter().zip(ATTENTION_SHARED) {
        check_launch("attention", cfg, shared, 1024).unwrap_or_else(|e| panic!("{d:?}: {e}"));
    }
}

/// The launch geometries of the trainer's largest steps (B 64, T 1024, GPT-2 small to XL
/// widths, V 50257) are within the GPU's limits; past them `check_launch` names the kernel
/// and the limit (`Error::Launch`) instead of the driver's "invalid argument", and the shim
/// refuses the same launches.
#[test]
fn launch_geometries_fit_the_limits_and_what_does_not_is_refused_by_name() {
    use kernels::cuda::{Error, check_launch, elementwise, grad_norm, matmul, optim};
    let ok = |kernel: &str, cfg: LaunchConfig, shared: usize| {
        check_launch(kernel, &cfg, shared, 1024).unwrap_or_else(|e| panic!("{e}"))
    };
    for (c, nh) in [(768, 12), (1024, 16), (1280, 20), (1600, 25)] {
        let (bt, v) = (64 * 1024, 50_257);
        let d = AttentionDims::mha(64, 1024, c, nh);
        attention_fits(&d);
        ok("layernorm rows", layers::layernorm_rows_config(bt), 0);
        let cols = layers::ColumnSums::new(bt, c, 2);
        ok("layernorm column parts", cols.parts, 2 * 8 * 33 * 4);
        ok("layernorm column sums", cols.sums, 0);
        for n in [3 * c, 4 * c, c, v] {
            let cols = matmul::bias_backward_config(bt, n);
            assert!(
                cols.scratch * 4 <= matmul::STAGING_BYTES,
                "bias partials fit staging"
            );
            ok("bias parts", cols.parts, 8 * 33 * 4);
            ok("bias sums", cols.sums, 0);
        }
        ok("crossentropy", layers::crossentropy_config(bt), 128);
        ok(
            "encoder dwte",
            layers::encoder_wte_config(c, bt),
            8 * 33 * 4,
        );
        ok("elementwise", elementwise(bt * 4 * c), 0);
        ok("sum_squares", grad_norm::sum_squares_configs().0, 256);
        ok(
            "adam8bit",
            optim::adam8bit_config(1_600_000_000, 2048),
            2 * 1024 + 128,
        );
    }
    // Llama-family shapes at B 16, T 1024: Llama-3-8B (32 query heads, 8 key/value heads of
    // 128) and Qwen3's per-head norms over B·T·32 rows of 128.
    let (bt, nh, kv, hs) = (16 * 1024, 32, 8, 128);
    attention_fits(&AttentionDims::gqa(16, 1024, nh, kv, hs));
    // Long sequences and the largest head: the grid grows in x only.
    attention_fits(&AttentionDims::gqa(1, 131_072, nh, kv, hs));
    attention_fits(&AttentionDims::gqa(16, 4096, 16, 4, 256));
    for rows in [bt, bt * nh] {
        ok("rmsnorm rows", layers::layernorm_rows_config(rows), 0);
        let cols = layers::ColumnSums::new(rows, hs, 1);
        ok("rmsnorm column parts", cols.parts, 2 * 8 * 33 * 4);
    }
    ok("rope", elementwise(bt * nh * hs / 2), 0);

    let many_heads = AttentionDims::mha(4096, 8, 512, 32); // B·NH = 131,072 blocks in grid y
    let cfg = layers::attention_config(&many_heads, layers::AttentionTiles::forward(16));
    let err = check_launch("attention_forward_bf16", &cfg, 0, 1024).unwrap_err();
    assert!(
        matches!(&err, Error::Launch { kernel, .. } if kernel == "attention_forward_bf16")
            && err.to_string().contains("grid"),
        "{err}"
    );
    let err = check_launch(
        "crossentropy_forward",
        &layers::crossentropy_config(4),
        0,
        768,
    )
    .unwrap_err();
    assert!(err.to_string().contains("at most 768"), "{err}");
    let err = check_launch("k", &elementwise(10), 40 << 10, 1024).map(|_| ());
    assert!(err.is_ok(), "40 KiB of shared memory is within 48 KiB");
    let mut cfg = elementwise(10);
    cfg.shared_mem_bytes = 16 << 10;
    let err = check_launch("k", &cfg, 40 << 10, 1024).unwrap_err();
    assert!(err.to_string().contains("shared memory"), "{err}");

    let shim = Shim::get();
    let mut m = vec![1f32; 4];
    let refused = shim.try_launch(
        "decay",
        (1, 70_000, 1),
        (256, 1, 1),
        &[out(&mut m), val(0.5f32), val(4i64)],
    );
    assert!(
        refused.is_err_and(|e| e.contains("grid")),
        "the shim refuses grid y > 65,535"
    );
    let refused = shim.try_launch(
        "decay",
        (1, 1, 1),
        (1025, 1, 1),
        &[out(&mut m), val(0.5f32), val(4i64)],
    );
    assert!(
        refused.is_err_and(|e| e.contains("1024")),
        "and blocks over 1024 threads"
    );
    let refused = shim.try_launch("decay", (1, 1, 1), (32, 1, 1), &[out(&mut m), val(0.5f32)]);
    assert!(
        refused.is_err_and(|e| e.contains("parameters")),
        "and a missing parameter"
    );
    let refused = shim.try_launch(
        "decay",
        (1, 1, 1),
        (32, 1, 1),
        &[out(&mut m), val(0.5f32), val(4i32)],
    );
    assert!(
        refused.is_err_and(|e| e.contains("bytes")),
        "and an int where a long is due"
    );
    assert_eq!(m, [1.0; 4], "nothing ran");
}

/// The shim's primitives the kernels do not use yet (kernels/tests/shim/selftest.cu): the
/// values CUDA defines for each lane, in two blocks of two warps.
#[test]
fn the_shim_shuffles_votes_atomics_and_early_exits_as_cuda_does() {
    const OUT: usize = 12;
    let (blocks, threads) = (2, 64);
    let mut o = vec![-1i32; blocks * threads * OUT];
    Shim::get().launch(
        "shim_selftest",
        (blocks as u32, 1, 1),
        (threads as u32, 1, 1),
        &[out(&mut o)],
    );
    for (i, got) in o.chunks(OUT).enumerate() {
        let (b, t) = (i / threads, i % threads);
        let lane = (t % 32) as i32;
        let in16 = |src: i32| if src / 16 == lane / 16 { src } else { lane };
        let want = [
            lane ^ 5,
            if lane + 3 < 32 { lane + 3 } else { lane },
            if lane >= 3 { lane - 3 } else { lane },
            7,
            0xaaaa_aaaau32 as i32,
            1,
            in16(lane + 4),
            if lane >= 16 { lane - 16 } else { lane }, // earlier groups only
            threads as i32,
            threads as i32 - 1,
            (F16::from_f32(1.0 / 3.0).to_bits() as i32) << 16
                | Bf16::from_f32(1.0 / 3.0).to_bits() as i32,
            if (t / 32) % 2 == 1 {
                -1
            } else {
                (b * 1000 + threads) as i32
            },
        ];
        assert_eq!(got, want, "block {b} thread {t}");
    }
}
