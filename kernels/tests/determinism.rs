//! Every kernel gives bit-identical results on a 1-thread and a 2-thread pool (and twice in a
//! row), at sizes large enough for gemm and rayon to actually split the work, and the same
//! bits from its baseline, AVX2 and AVX-512 builds (those this CPU has).

use crate::common;

use common::{Rng, to_x};
use half::{bf16, f16};
use kernels::attention::{
    AttentionDims, attention_backward, attention_forward, gqa_attention_backward,
    gqa_attention_forward,
};
use kernels::matmul::{DinpMode, Layout, matmul_backward, matmul_forward, scratch_len};
use kernels::optim::*;
use kernels::rope::{RopeDims, rope_backward, rope_forward};
use kernels::{Float, cpu, crossentropy, encoder, grad_norm, layernorm, rmsnorm, swiglu};

/// Bits of every output `run` produces.
type Bits = Vec<Vec<u32>>;

fn bits<X: Float>(x: &[X]) -> Vec<u32> {
    x.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn same_on_1_and_2_threads(run: impl Fn() -> Bits + Send + Sync) {
    common::note_unexercised_cpu_paths();
    let one = cpu::thread_pool(1).unwrap().install(&run);
    let pool = cpu::thread_pool(2).unwrap();
    let two = pool.install(&run);
    assert!(one == two, "1 and 2 threads differ");
    assert!(pool.install(&run) == two, "two runs on 2 threads differ");
    // The best build of the inner loops this CPU has, against the AVX2 and baseline builds.
    for simd in [cpu::Simd::Avx2, cpu::Simd::Portable] {
        let capped = cpu::thread_pool_with(2, simd).unwrap();
        assert!(
            capped.install(&run) == two,
            "the {simd:?} and the detected builds differ"
        );
    }
}

fn matmul_bits<X: Float>(layout: Layout) -> Bits {
    let mut rng = Rng::new(41);
    let (m, k, n) = (128, 320, 600);
    let (x, w, b) = (
        to_x::<X>(&rng.vec(m * k, 1.0)),
        to_x::<X>(&rng.vec(k * n, 0.1)),
        to_x::<X>(&rng.vec(n, 0.1)),
    );
    let mut scratch = vec![0f32; scratch_len(m, k, n)];
    let mut out = vec![X::ZERO; m * n];
    matmul_forward(&mut out, &x, &w, Some(&b), layout, (m, k, n), &mut scratch);
    let mut logits = vec![0f32; m * n];
    matmul_forward(
        &mut logits,
        &x,
        &w,
        None,
        layout,
        (m, k, n),
        &mut scratch[..5000],
    );
    let dout = to_x::<X>(&rng.vec(m * n, 1.0));
    let (mut dx, mut dw, mut db) = (
        vec![X::ZERO; m * k],
        to_x::<X>(&rng.vec(k * n, 1.0)),
        vec![X::ZERO; n],
    );
    matmul_backward(
        &mut dx,
        &mut dw,
        Some(&mut db),
        &dout,
        &x,
        &w,
        layout,
        (m, k, n),
        DinpMode::Overwrite,
        &mut scratch,
    );
    vec![bits(&out), bits(&logits), bits(&dx), bits(&dw), bits(&db)]
}

#[test]
fn matmul_is_deterministic() {
    for layout in [Layout::KN, Layout::NK] {
        same_on_1_and_2_threads(|| matmul_bits::<f32>(layout));
        same_on_1_and_2_threads(|| matmul_bits::<bf16>(layout));
    }
}

fn layer_bits<X: Float>() -> Bits {
    let mut rng = Rng::new(42);
    let (b, t, c, v) = (4, 32, 96, 50);
    let d = AttentionDims::mha(b, t, c, 4);
    let tokens = rng.tokens(b * t, v);
    let (wte, wpe) = (
        to_x::<X>(&rng.vec(v * c, 1.0)),
        to_x::<X>(&rng.vec(t * c, 1.0)),
    );
    let mut x = vec![X::ZERO; b * t * c];
    encoder::encoder_forward(&mut x, &tokens, &wte, Some(&wpe), t, c);
    let (mut dwte, mut dwpe) = (vec![X::ZERO; v * c], vec![X::ZERO; t * c]);
    encoder::encoder_backward(&mut dwte, Some(&mut dwpe), &x, &tokens, t, c);

    let (w, bias) = (to_x::<X>(&rng.vec(c, 1.0)), to_x::<X>(&rng.vec(c, 1.0)));
    let (mut ln, mut mean, mut rstd) =
        (vec![X::ZERO; x.len()], vec![0f32; b * t], vec![0f32; b * t]);
    layernorm::layernorm_forward(&mut ln, &mut mean, &mut rstd, &x, &w, &bias);
    let (mut dx, mut dw, mut db) = (vec![X::ZERO; x.len()], vec![X::ZERO; c], vec![X::ZERO; c]);
    layernorm::layernorm_backward(&mut dx, &mut dw, &mut db, &x, &ln, &w, &mean, &rstd);

    let qkv = to_x::<X>(&rng.vec(b * t * 3 * c, 1.0));
    let (mut out, mut lse) = (vec![X::ZERO; b * t * c], vec![0f32; b * 4 * t]);
    attention_forward(&mut out, &mut lse, &qkv, d);
    let (mut dqkv, mut delta) = (vec![X::ZERO; qkv.len()], vec![0f32; lse.len()]);
    attention_backward(&mut dqkv, &mut delta, &out, &qkv, &out, &lse, d);

    let mut logits: Vec<f32> = rng
        .vec(b * t * 1000, 5.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let mut losses = vec![0f32; b * t];
    crossentropy::crossentropy_forward(
        &mut losses,
        &mut logits,
        &rng.tokens(b * t, 1000),
        1000,
        Some(0.01),
    );
    let ss = grad_norm::sum_squares(&logits).to_bits();
    let ss = vec![ss as u32, (ss >> 32) as u32];
    vec![
        bits(&dwte),
        bits(&dwpe),
        bits(&dx),
        bits(&dw),
        bits(&db),
        bits(&out),
        bits(&lse),
        bits(&dqkv),
        bits(&delta),
    ]
    .into_iter()
    .chain([bits(&losses), bits(&logits), ss])
    .collect()
}

#[test]
fn layer_kernels_are_deterministic() {
    same_on_1_and_2_threads(layer_bits::<f32>);
    same_on_1_and_2_threads(layer_bits::<bf16>);
    same_on_1_and_2_threads(layer_bits::<f16>);
}

/// The Llama family's kernels: RMSNorm (C over two column blocks), rotary embeddings, SwiGLU,
/// grouped-query attention (2 query heads per key/value head) and the encoder without wpe.
fn llama_bits<X: Float>() -> Bits {
    let mut rng = Rng::new(44);
    let (b, t, c, v) = (4, 32, 320, 50);
    let tokens = rng.tokens(b * t, v);
    let wte = to_x::<X>(&rng.vec(v * c, 1.0));
    let mut x = vec![X::ZERO; b * t * c];
    encoder::encoder_forward(&mut x, &tokens, &wte, None, t, c);
    let mut dwte = vec![X::ZERO; v * c];
    encoder::encoder_backward(&mut dwte, None, &x, &tokens, t, c);

    let w = to_x::<X>(&rng.vec(c, 1.0));
    let (mut y, mut rstd) = (vec![X::ZERO; x.len()], vec![0f32; b * t]);
    rmsnorm::rmsnorm_forward(&mut y, &mut rstd, &x, &w, 1e-6);
    let (mut dx, mut dw) = (vec![X::ZERO; x.len()], vec![X::ZERO; c]);
    rmsnorm::rmsnorm_backward(&mut dx, &mut dw, &y, &x, &w, &rstd);

    let d = AttentionDims::gqa(b, t, 4, 2, 40);
    let (qn, kn) = (b * t * d.q_width(), b * t * d.kv_width());
    let (mut q, mut k, vv) = (
        to_x::<X>(&rng.vec(qn, 1.0)),
        to_x::<X>(&rng.vec(kn, 1.0)),
        to_x::<X>(&rng.vec(kn, 1.0)),
    );
    let (cos, sin) = common::rope_tables(t, 40);
    rope_forward(
        &mut q,
        &cos,
        &sin,
        RopeDims {
            t,
            heads: 4,
            head_dim: 40,
        },
    );
    rope_forward(
        &mut k,
        &cos,
        &sin,
        RopeDims {
            t,
            heads: 2,
            head_dim: 40,
        },
    );
    let (mut out, mut lse) = (vec![X::ZERO; qn], vec![0f32; b * 4 * t]);
    gqa_attention_forward(&mut out, &mut lse, &q, &k, &vv, d);
    let (mut dq, mut dk, mut dv) = (vec![X::ZERO; qn], vec![X::ZERO; kn], vec![X::ZERO; kn]);
    let mut delta = vec![0f32; lse.len()];
    gqa_attention_backward(
        &mut dq, &mut dk, &mut dv, &mut delta, &out, &q, &k, &vv, &out, &lse, d,
    );
    rope_backward(
        &mut dq,
        &cos,
        &sin,
        RopeDims {
            t,
            heads: 4,
            head_dim: 40,
        },
    );

    let (g, u) = (to_x::<X>(&rng.vec(qn, 4.0)), to_x::<X>(&rng.vec(qn, 1.0)));
    let mut h = vec![X::ZERO; qn];
    swiglu::swiglu_forward(&mut h, &g, &u);
    let (mut dg, mut du) = (vec![X::ZERO; qn], out.clone());
    swiglu::swiglu_backward(&mut dg, &mut du, &g, &u);
    [
        bits(&x),
        bits(&dwte),
        bits(&y),
        bits(&rstd),
        bits(&dx),
        bits(&dw),
        bits(&q),
        bits(&out),
        bits(&lse),
        bits(&dq),
        bits(&dk),
        bits(&dv),
        bits(&delta),
        bits(&h),
        bits(&dg),
        bits(&du),
    ]
    .into()
}

#[test]
fn llama_kernels_are_deterministic() {
    same_on_1_and_2_threads(llama_bits::<f32>);
    same_on_1_and_2_threads(llama_bits::<bf16>);
    same_on_1_and_2_threads(llama_bits::<f16>);
}

/// Attention over several tiles (the last one partial): packed multi-head attention and
/// grouped-query attention with 4 query heads per key/value head, forward and backward.
fn attention_bits<X: Float>() -> Bits {
    let mut rng = Rng::new(45);
    let (b, t) = (2, 150);
    let d = AttentionDims::mha(b, t, 128, 2);
    let qkv = to_x::<X>(&rng.vec(b * t * 3 * 128, 1.0));
    let dout = to_x::<X>(&rng.vec(b * t * 128, 1.0));
    let (mut out, mut lse) = (vec![X::ZERO; dout.len()], vec![0f32; b * 2 * t]);
    attention_forward(&mut out, &mut lse, &qkv, d);
    let (mut dqkv, mut delta) = (vec![X::ZERO; qkv.len()], vec![0f32; lse.len()]);
    attention_backward(&mut dqkv, &mut delta, &dout, &qkv, &out, &lse, d);
    let mut all = vec![bits(&out), bits(&lse), bits(&dqkv), bits(&delta)];

    let d = AttentionDims::gqa(b, t, 8, 2, 40);
    let (qn, kn) = (b * t * d.q_width(), b * t * d.kv_width());
    let (q, k, v, dout) = (
        to_x::<X>(&rng.vec(qn, 1.0)),
        to_x::<X>(&rng.vec(kn, 1.0)),
        to_x::<X>(&rng.vec(kn, 1.0)),
        to_x::<X>(&rng.vec(qn, 1.0)),
    );
    let (mut out, mut lse) = (vec![X::ZERO; qn], vec![0f32; b * 8 * t]);
    gqa_attention_forward(&mut out, &mut lse, &q, &k, &v, d);
    let (mut dq, mut dk, mut dv) = (vec![X::ZERO; qn], vec![X::ZERO; kn], vec![X::ZERO; kn]);
    let mut delta = vec![0f32; lse.len()];
    gqa_attention_backward(
        &mut dq, &mut dk, &mut dv, &mut delta, &dout, &q, &k, &v, &out, &lse, d,
    );
    all.extend([&out, &dq, &dk, &dv].map(|x| bits(x)));
    all.extend([bits(&lse), bits(&delta)]);
    all
}

#[test]
fn attention_is_deterministic() {
    same_on_1_and_2_threads(attention_bits::<f32>);
    same_on_1_and_2_threads(attention_bits::<bf16>);
    same_on_1_and_2_threads(attention_bits::<f16>);
}

fn optimizer_bits<G: Float>() -> Bits {
    let mut rng = Rng::new(43);
    let (rows, cols) = (300, 257);
    let n = rows * cols;
    let g = to_x::<G>(&rng.vec(n, 1.0));
    let mut out = vec![bf16::ZERO; n];
    let (mut p, mut m, mut v) = (vec![1f32; n], vec![0f32; n], vec![0f32; n]);
    adamw_step(
        &mut p,
        &g,
        &mut m,
        &mut v,
        Some(&mut out),
        &AdamW::default(),
        3,
        0.5,
        0.999,
    );
    let (mut qm, mut qv, mut am, mut av) = (
        vec![0u8; n],
        vec![0u8; n],
        vec![0f32; n.div_ceil(2048)],
        vec![0f32; n.div_ceil(2048)],
    );
    let mut p8 = vec![1f32; n];
    adam8bit_step(
        &mut p8,
        &g,
        &mut qm,
        &mut qv,
        &mut am,
        &mut av,
        None::<&mut [f32]>,
        &AdamW::default(),
        1,
        0.5,
        DEFAULT_BLOCK,
    );
    let (mut pa, mut row, mut col) = (vec![1f32; n], vec![0f32; rows], vec![0f32; cols]);
    let hp = Adafactor {
        beta1: Some(0.9),
        ..Adafactor::default()
    };
    let mut ma = vec![0f32; n];
    adafactor_step_matrix(
        &mut pa,
        &g,
        &mut row,
        &mut col,
        Some(&mut ma),
        None::<&mut [f32]>,
        &hp,
        1,
        0.5,
    );
    vec![
        bits(&p),
        bits(&out),
        bits(&m),
        bits(&v),
        bits(&p8),
        qm.iter().map(|&q| q as u32).collect(),
        bits(&pa),
        bits(&row),
        bits(&col),
    ]
}

#[test]
fn optimizers_are_deterministic() {
    same_on_1_and_2_threads(optimizer_bits::<f32>);
    same_on_1_and_2_threads(optimizer_bits::<bf16>);
}
