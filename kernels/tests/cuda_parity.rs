//! Every CUDA kernel against the CPU kernel of the same name, on random inputs, per dtype.
//! Outputs the kernels overwrite start as NaN, so an element a kernel skips fails the test.
//! Without a CUDA driver each test prints "skipped: no CUDA driver found: …" and passes, unless
//! `ZEROTRAIN_REQUIRE_GPU=1` (set by `scripts/gpu-check`): then it fails, so a GPU run cannot
//! skip silently.
#![cfg(feature = "cuda")]

use crate::attention_reference;
use crate::common;

use std::io::Write;
use std::sync::OnceLock;

use attention_reference::{AttentionCase, OUTPUTS, pack, tolerances, unpack};
use common::*;
use cudarc::driver::CudaSlice;
use kernels::attention::AttentionDims;
use kernels::cuda::{self, DeviceFloat, Error, Gpu, layers};
use kernels::matmul::{self, DinpMode, Layout};
use kernels::optim::{self, Adafactor, AdamW, Lion, Momentum};
use kernels::rope::{RopeDims, rope_backward, rope_forward};
use kernels::{
    Float, crossentropy, encoder, gelu, grad_norm, layernorm, nf4, residual, rmsnorm, swiglu,
};

/// The GPU, opened once per test binary; `None` (after saying so) without a driver.
fn device() -> Option<&'static Gpu> {
    static DEVICE: OnceLock<Result<Gpu, Error>> = OnceLock::new();
    match DEVICE.get_or_init(|| Gpu::new(0)) {
        Ok(d) => Some(d),
        Err(e @ Error::NoDriver) => {
            if std::env::var_os("ZEROTRAIN_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("ZEROTRAIN_REQUIRE_GPU=1 but {e}");
            }
            let _ = writeln!(std::io::stderr(), "skipped: {e}");
            None
        }
        Err(e) => panic!("the GPU is there but did not open: {e}"),
    }
}

fn up<T: cudarc::driver::DeviceRepr>(d: &Gpu, host: &[T]) -> CudaSlice<T> {
    d.upload(host).expect("upload")
}

fn down<T: cudarc::driver::DeviceRepr>(d: &Gpu, dev: &CudaSlice<T>) -> Vec<T> {
    d.download(dev).expect("download")
}

fn close<X: Float>(what: &str, gpu: &[X], cpu: &[X], rtol: f64) {
    assert_close(
        &format!("{what} ({})", X::NAME),
        &to_f64(gpu),
        &to_f64(cpu),
        rtol,
    );
}

fn casts_match_half_bit_for_bit<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let src = cast_inputs();
    let mut x = up(d, &nan::<X>(src.len()));
    layers::cast_from_f32(d, &mut x.as_view_mut(), &up(d, &src).as_view()).unwrap();
    let got: Vec<u32> = down(d, &x).iter().map(|v| v.to_f32().to_bits()).collect();
    let want: Vec<u32> = src
        .iter()
        .map(|&v| X::from_f32(v).to_f32().to_bits())
        .collect();
    assert_eq!(got, want, "cast_from_f32 ({})", X::NAME);
    let mut back = up(d, &vec![f32::NAN; src.len()]);
    layers::cast_to_f32(d, &mut back.as_view_mut(), &x.as_view()).unwrap();
    let got: Vec<u32> = down(d, &back).iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "cast_to_f32 ({})", X::NAME);
}

fn encoder_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let (b, t, c, v) = (3, 17, 40, 11);
    let mut rng = Rng::new(2);
    let tokens = rng.tokens(b * t, v);
    let (wte, wpe) = (
        random::<X>(&mut rng, v * c, 1.0),
        random::<X>(&mut rng, t * c, 1.0),
    );
    let mut out = up(d, &nan::<X>(b * t * c));
    layers::encoder_forward(
        d,
        &mut out.as_view_mut(),
        &up(d, &tokens).as_view(),
        &up(d, &wte).as_view(),
        Some(&up(d, &wpe).as_view()),
        t,
        c,
    )
    .unwrap();
    let mut want = vec![X::ZERO; b * t * c];
    encoder::encoder_forward(&mut want, &tokens, &wte, Some(&wpe), t, c);
    close("encoder_forward", &down(d, &out), &want, rtol::<X>());
    let mut out = up(d, &nan::<X>(b * t * c));
    layers::encoder_forward(
        d,
        &mut out.as_view_mut(),
        &up(d, &tokens).as_view(),
        &up(d, &wte).as_view(),
        None,
        t,
        c,
    )
    .unwrap();
    encoder::encoder_forward(&mut want, &tokens, &wte, None, t, c);
    close(
        "encoder_forward without wpe",
        &down(d, &out),
        &want,
        rtol::<X>(),
    );

    let dout = random::<X>(&mut rng, b * t * c, 1.0);
    let (dwte0, dwpe0) = (
        random::<X>(&mut rng, v * c, 1.0),
        random::<X>(&mut rng, t * c, 1.0),
    );
    let (mut dwte, mut dwpe) = (up(d, &dwte0), up(d, &dwpe0));
    layers::encoder_backward(
        d,
        &mut dwte.as_view_mut(),
        Some(&mut dwpe.as_view_mut()),
        &up(d, &dout).as_view(),
        &tokens,
        t,
        c,
    )
    .unwrap();
    let (mut want_te, mut want_pe) = (dwte0, dwpe0);
    encoder::encoder_backward(&mut want_te, Some(&mut want_pe), &dout, &tokens, t, c);
    close(
        "encoder_backward dwte",
        &down(d, &dwte),
        &want_te,
        rtol::<X>(),
    );
    close(
        "encoder_backward dwpe",
        &down(d, &dwpe),
        &want_pe,
        rtol::<X>(),
    );
}

fn layernorm_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let (n, c) = (37, 300); // C not a multiple of the block: the tail loops run
    let mut rng = Rng::new(3);
    let inp = random::<X>(&mut rng, n * c, 2.0);
    let (w, bias) = (random::<X>(&mut rng, c, 1.0), random::<X>(&mut rng, c, 1.0));
    let (mut out, mut mean, mut rstd) = (
        up(d, &nan::<X>(n * c)),
        up(d, &nan::<f32>(n)),
        up(d, &nan::<f32>(n)),
    );
    let (di, dw_, db_) = (up(d, &inp), up(d, &w), up(d, &bias));
    layers::layernorm_forward(
        d,
        &mut out.as_view_mut(),
        &mut mean.as_view_mut(),
        &mut rstd.as_view_mut(),
        &di.as_view(),
        &dw_.as_view(),
        &db_.as_view(),
    )
    .unwrap();
    let (mut o, mut m, mut r) = (vec![X::ZERO; n * c], vec![0f32; n], vec![0f32; n]);
    layernorm::layernorm_forward(&mut o, &mut m, &mut r, &inp, &w, &bias);
    close("layernorm_forward out", &down(d, &out), &o, rtol::<X>());
    close("layernorm_forward mean", &down(d, &mean), &m, 1e-5);
    close("layernorm_forward rstd", &down(d, &rstd), &r, 1e-5);

    let dout = random::<X>(&mut rng, n * c, 1.0);
    let (dinp0, dw0, db0) = (
        random::<X>(&mut rng, n * c, 1.0),
        random::<X>(&mut rng, c, 1.0),
        random::<X>(&mut rng, c, 1.0),
    );
    let (mut dinp, mut dw, mut db) = (up(d, &dinp0), up(d, &dw0), up(d, &db0));
    let mut frozen = up(d, &dinp0);
    layers::layernorm_backward_input(
        d,
        &mut frozen.as_view_mut(),
        &up(d, &dout).as_view(),
        &di.as_view(),
        &dw_.as_view(),
        &mean.as_view(),
        &rstd.as_view(),
    )
    .unwrap();
    layers::layernorm_backward(
        d,
        &mut dinp.as_view_mut(),
        &mut dw.as_view_mut(),
        &mut db.as_view_mut(),
        &up(d, &dout).as_view(),
        &di.as_view(),
        &dw_.as_view(),
        &mean.as_view(),
        &rstd.as_view(),
    )
    .unwrap();
    let (mut wi, mut ww, mut wb) = (dinp0, dw0, db0);
    layernorm::layernorm_backward(&mut wi, &mut ww, &mut wb, &dout, &inp, &w, &m, &r);
    close("layernorm_backward dinp", &down(d, &dinp), &wi, rtol::<X>());
    close(
        "layernorm_backward_input dinp",
        &down(d, &frozen),
        &wi,
        rtol::<X>(),
    );
    close(
        "layernorm_backward dweight",
        &down(d, &dw),
        &ww,
        rtol::<X>(),
    );
    close("layernorm_backward dbias", &down(d, &db), &wb, rtol::<X>());
}

/// One dense layer forward and backward on cuBLASLt and on the CPU: `out` and `dinp` start as
/// NaN (overwritten), `dweight` and `dbias` as random values (accumulated into). `Y` is the
/// dtype of `out` and `dout` (X, or f32 for logits); `out_rtol` the tolerance of `out`.
fn dense_matches_cpu<X: DeviceFloat, Y: DeviceFloat>(
    d: &Gpu,
    seed: u64,
    (m, k, n): (usize, usize, usize),
    layout: Layout,
    with_bias: bool,
    out_rtol: f64,
) {
    let what = format!("({m}, {k}, {n}) {layout:?} out {}", Y::NAME);
    let mut rng = Rng::new(seed);
    let inp = random::<X>(&mut rng, m * k, 1.0);
    let w = random::<X>(&mut rng, k * n, 0.5);
    let bias = random::<X>(&mut rng, n, 1.0);
    let bias_y: Vec<Y> = bias.iter().map(|b| Y::from_f32(b.to_f32())).collect();
    let mut scratch = vec![0f32; matmul::scratch_len(m, k, n)];

    let mut out = up(d, &nan::<Y>(m * n));
    let bias_dev = up(d, &bias_y);
    let (inp_dev, w_dev) = (up(d, &inp), up(d, &w));
    cuda::matmul::matmul_forward(
        d,
        &mut out.as_view_mut(),
        &inp_dev.as_view(),
        &w_dev.as_view(),
        with_bias.then_some(&bias_dev.as_view()),
        layout,
        (m, k, n),
    )
    .unwrap();
    let mut want = vec![Y::ZERO; m * n];
    let cpu_bias = with_bias.then_some(&bias[..]);
    matmul::matmul_forward(
        &mut want,
        &inp,
        &w,
        cpu_bias,
        layout,
        (m, k, n),
        &mut scratch,
    );
    close(
        &format!("matmul_forward {what}"),
        &down(d, &out),
        &want,
        out_rtol,
    );

    let dout = random::<Y>(&mut rng, m * n, 1.0);
    let (dw0, db0) = (
        random::<X>(&mut rng, k * n, 1.0),
        random::<X>(&mut rng, n, 1.0),
    );
    let (mut dinp, mut dw, mut db) = (up(d, &nan::<X>(m * k)), up(d, &dw0), up(d, &db0));
    cuda::matmul::matmul_backward(
        d,
        &mut dinp.as_view_mut(),
        &mut dw.as_view_mut(),
        with_bias.then_some(&mut db.as_view_mut()),
        &up(d, &dout).as_view(),
        &inp_dev.as_view(),
        &w_dev.as_view(),
        layout,
        (m, k, n),
        DinpMode::Overwrite,
    )
    .unwrap();
    let (mut want_dx, mut want_dw, mut want_db) = (vec![X::ZERO; m * k], dw0, db0.clone());
    matmul::matmul_backward(
        &mut want_dx,
        &mut want_dw,
        with_bias.then_some(&mut want_db[..]),
        &dout,
        &inp,
        &w,
        layout,
        (m, k, n),
        DinpMode::Overwrite,
        &mut scratch,
    );
    close(
        &format!("matmul_backward dinp {what}"),
        &down(d, &dinp),
        &want_dx,
        rtol::<X>(),
    );
    close(
        &format!("matmul_backward dweight {what}"),
        &down(d, &dw),
        &want_dw,
        rtol::<X>(),
    );
    let db = down(d, &db);
    if with_bias {
        close(
            &format!("matmul_backward dbias {what}"),
            &db,
            &want_db,
            rtol::<X>(),
        );
    } else {
        assert_eq!(to_f64(&db), to_f64(&db0), "dbias untouched without a bias");
    }
    // Through a frozen weight: dinp alone, as the full backward's.
    let mut frozen = up(d, &nan::<X>(m * k));
    cuda::matmul::matmul_backward_input(
        d,
        &mut frozen.as_view_mut(),
        &up(d, &dout).as_view(),
        &w_dev.as_view(),
        layout,
        (m, k, n),
        DinpMode::Overwrite,
    )
    .unwrap();
    close(
        &format!("matmul_backward_input {what}"),
        &down(d, &frozen),
        &want_dx,
        rtol::<X>(),
    );
    // The weight's gradient alone (LoRA's A under dropout), as the CPU's.
    let mut dw_only = up(d, &vec![X::ZERO; k * n]);
    cuda::matmul::matmul_backward_weight(
        d,
        &mut dw_only.as_view_mut(),
        &up(d, &dout).as_view(),
        &inp_dev.as_view(),
        layout,
        (m, k, n),
    )
    .unwrap();
    let mut want_dw_only = vec![X::ZERO; k * n];
    matmul::matmul_backward_weight(
        &mut want_dw_only,
        &dout,
        &inp,
        layout,
        (m, k, n),
        &mut scratch,
    );
    close(
        &format!("matmul_backward_weight {what}"),
        &down(d, &dw_only),
        &want_dw_only,
        rtol::<X>(),
    );

    // dinp added to (cuBLASLt's beta = 1), as a second layer reading the same input does.
    let dinp0 = random::<X>(&mut rng, m * k, 1.0);
    let (mut dinp, mut dw) = (up(d, &dinp0), up(d, &want_dw));
    cuda::matmul::matmul_backward(
        d,
        &mut dinp.as_view_mut(),
        &mut dw.as_view_mut(),
        None,
        &up(d, &dout).as_view(),
        &inp_dev.as_view(),
        &w_dev.as_view(),
        layout,
        (m, k, n),
        DinpMode::Accumulate,
    )
    .unwrap();
    let mut want_dx = dinp0;
    matmul::matmul_backward(
        &mut want_dx,
        &mut want_dw,
        None,
        &dout,
        &inp,
        &w,
        layout,
        (m, k, n),
        DinpMode::Accumulate,
        &mut scratch,
    );
    close(
        &format!("matmul_backward dinp += {what}"),
        &down(d, &dinp),
        &want_dx,
        rtol::<X>(),
    );
}

/// The trainer's layer shapes scaled down, plus depths and widths that are no multiple of 8
/// (leading dimensions cuBLASLt's fastest kernels do not take): both layouts, with and
/// without a bias, 16-bit and f32 outputs.
fn dense_layers_match_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    for (i, (shape, layout, bias)) in [
        ((64, 48, 144), Layout::KN, true), // c_attn: C → 3C
        ((64, 192, 48), Layout::KN, true), // mlp proj: 4C → C
        ((37, 33, 101), Layout::KN, true), // odd everything
        ((5, 7, 3), Layout::KN, false),
        ((64, 48, 1000), Layout::NK, false), // LM head x·Wᵀ
        ((37, 33, 101), Layout::NK, true),
    ]
    .into_iter()
    .enumerate()
    {
        dense_matches_cpu::<X, X>(d, 20 + i as u64, shape, layout, bias, rtol::<X>());
        // f32 out and dout (logits, dlogits): products of X values are exact in f32.
        dense_matches_cpu::<X, f32>(d, 40 + i as u64, shape, layout, bias, rtol::<f32>());
    }
}

/// The LM head's shape with a real vocabulary: f32 dlogits against 16-bit weights are cast in
/// row blocks of the staging buffer, three of them here (the last one short).
fn lm_head_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let (m, k, v): (usize, usize, usize) = (700, 64, 50257);
    let rows_per_block = cuda::matmul::STAGING_BYTES / (v * size_of::<X>()) / 8 * 8;
    assert!(
        X::NAME == "f32" || m.div_ceil(rows_per_block) == 3,
        "three staging blocks"
    );
    dense_matches_cpu::<X, f32>(d, 60, (m, k, v), Layout::NK, false, rtol::<f32>());
}

/// The attention launchers of one layout (packed GPT-2 qkv, else separate q, k, v) against
/// the f64 reference (each output starts as NaN). Returns the outputs, for comparing runs and
/// layouts bit for bit.
fn attention_case<X: DeviceFloat>(
    dev: &Gpu,
    d: AttentionDims,
    packed: bool,
    seed: u64,
) -> Vec<Vec<f64>> {
    let case = AttentionCase::new::<X>(d, seed);
    let (qn, kn, rows) = (case.q.len(), case.k.len(), d.b * d.nh * d.t);
    let [xq, xk, xv, xdout] = [&case.q, &case.k, &case.v, &case.dout].map(|x| to_x::<X>(x));
    let dout = up(dev, &xdout);
    let (mut out, mut lse, mut delta) = (
        up(dev, &nan::<X>(qn)),
        up(dev, &nan::<f32>(rows)),
        up(dev, &nan::<f32>(rows)),
    );
    let (dq, dk, dv) = if packed {
        let c = d.q_width();
        let qkv = up(dev, &pack(&xq, &xk, &xv, c));
        layers::attention_forward(
            dev,
            &mut out.as_view_mut(),
            &mut lse.as_view_mut(),
            &qkv.as_view(),
            d,
        )
        .unwrap();
        let mut dqkv = up(dev, &nan::<X>(3 * qn));
        layers::attention_backward(
            dev,
            &mut dqkv.as_view_mut(),
            &mut delta.as_view_mut(),
            &dout.as_view(),
            &qkv.as_view(),
            &out.as_view(),
            &lse.as_view(),
            d,
        )
        .unwrap();
        let [dq, dk, dv] = unpack(&down(dev, &dqkv), c);
        (dq, dk, dv)
    } else {
        let (q, k, v) = (up(dev, &xq), up(dev, &xk), up(dev, &xv));
        layers::gqa_attention_forward(
            dev,
            &mut out.as_view_mut(),
            &mut lse.as_view_mut(),
            &q.as_view(),
            &k.as_view(),
            &v.as_view(),
            d,
        )
        .unwrap();
        let (mut dq, mut dk, mut dv) = (
            up(dev, &nan::<X>(qn)),
            up(dev, &nan::<X>(kn)),
            up(dev, &nan::<X>(kn)),
        );
        layers::gqa_attention_backward(
            dev,
            &mut dq.as_view_mut(),
            &mut dk.as_view_mut(),
            &mut dv.as_view_mut(),
            &mut delta.as_view_mut(),
            &dout.as_view(),
            &q.as_view(),
            &k.as_view(),
            &v.as_view(),
            &out.as_view(),
            &lse.as_view(),
            d,
        )
        .unwrap();
        (down(dev, &dq), down(dev, &dk), down(dev, &dv))
    };
    let got = vec![
        to_f64(&down(dev, &out)),
        to_f64(&down(dev, &lse)),
        to_f64(&down(dev, &delta)),
        to_f64(&dq),
        to_f64(&dk),
        to_f64(&dv),
    ];
    let want = case.expected(&got[0]);
    for (i, what) in OUTPUTS.iter().enumerate() {
        let label = format!("attention {what} {d:?} packed {packed} ({})", X::NAME);
        assert_close(&label, &got[i], &want[i], tolerances::<X>()[i]);
    }
    got
}

/// The packed (GPT-2) layout: T past the tiles, the same bits run to run and as the separate
/// layout; T past 1024 (issue 28); T = 1.
fn attention_matches_reference<X: DeviceFloat>() {
    let Some(dev) = device() else { return };
    let d = AttentionDims::mha(2, 333, 192, 3);
    let first = attention_case::<X>(dev, d, true, 4);
    assert!(
        first == attention_case::<X>(dev, d, true, 4),
        "attention differs run to run ({})",
        X::NAME
    );
    assert!(
        first == attention_case::<X>(dev, d, false, 4),
        "packed and separate attention differ ({})",
        X::NAME
    );
    attention_case::<X>(dev, AttentionDims::mha(1, 1100, 128, 2), true, 5);
    attention_case::<X>(dev, AttentionDims::mha(1, 1, 96, 1), true, 6);
}

/// Grouped-query attention: 4 and 2 query heads per key/value head, heads of 128, 256 and 80
/// (the three tile sizes), T = 2048.
fn gqa_attention_matches_reference<X: DeviceFloat>() {
    let Some(dev) = device() else { return };
    attention_case::<X>(dev, AttentionDims::gqa(2, 257, 8, 2, 128), false, 8);
    attention_case::<X>(dev, AttentionDims::gqa(1, 100, 4, 2, 256), false, 9);
    attention_case::<X>(dev, AttentionDims::gqa(1, 2048, 2, 1, 80), false, 10);
}

/// RMSNorm as a block norm and as Qwen3's per-head norm (width 128, many rows).
fn rmsnorm_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let mut rng = Rng::new(9);
    for (n, c) in [(37, 300), (4000, 128)] {
        let x = random::<X>(&mut rng, n * c, 2.0);
        let w = random::<X>(&mut rng, c, 1.0);
        let (dx, dw_) = (up(d, &x), up(d, &w));
        let (mut out, mut rstd) = (up(d, &nan::<X>(n * c)), up(d, &nan::<f32>(n)));
        layers::rmsnorm_forward(
            d,
            &mut out.as_view_mut(),
            &mut rstd.as_view_mut(),
            &dx.as_view(),
            &dw_.as_view(),
            1e-6,
        )
        .unwrap();
        let (mut wo, mut wr) = (vec![X::ZERO; n * c], vec![0f32; n]);
        rmsnorm::rmsnorm_forward(&mut wo, &mut wr, &x, &w, 1e-6);
        close(
            &format!("rmsnorm_forward out C {c}"),
            &down(d, &out),
            &wo,
            rtol::<X>(),
        );
        close(
            &format!("rmsnorm_forward rstd C {c}"),
            &down(d, &rstd),
            &wr,
            1e-5,
        );

        let dout = random::<X>(&mut rng, n * c, 1.0);
        let (dinp0, dweight0) = (
            random::<X>(&mut rng, n * c, 1.0),
            random::<X>(&mut rng, c, 1.0),
        );
        let (mut dinp, mut dweight) = (up(d, &dinp0), up(d, &dweight0));
        layers::rmsnorm_backward(
            d,
            &mut dinp.as_view_mut(),
            &mut dweight.as_view_mut(),
            &up(d, &dout).as_view(),
            &dx.as_view(),
            &dw_.as_view(),
            &up(d, &wr).as_view(),
        )
        .unwrap();
        // Through a frozen weight: the same dinp, no weight gradient.
        let mut frozen = up(d, &dinp0);
        layers::rmsnorm_backward_input(
            d,
            &mut frozen.as_view_mut(),
            &up(d, &dout).as_view(),
            &dx.as_view(),
            &dw_.as_view(),
            &up(d, &wr).as_view(),
        )
        .unwrap();
        let (mut wi, mut ww) = (dinp0, dweight0);
        rmsnorm::rmsnorm_backward(&mut wi, &mut ww, &dout, &x, &w, &wr);
        close(
            &format!("rmsnorm_backward_input dinp C {c}"),
            &down(d, &frozen),
            &wi,
            rtol::<X>(),
        );
        close(
            &format!("rmsnorm_backward dinp C {c}"),
            &down(d, &dinp),
            &wi,
            rtol::<X>(),
        );
        close(
            &format!("rmsnorm_backward dweight C {c}"),
            &down(d, &dweight),
            &ww,
            rtol::<X>(),
        );
    }
}

fn rope_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let dims = RopeDims {
        t: 33,
        heads: 4,
        head_dim: 64,
    };
    let n = 2 * dims.t * dims.heads * dims.head_dim;
    let (cos, sin) = rope_tables(dims.t + 7, dims.head_dim);
    let x = random::<X>(&mut Rng::new(10), n, 1.0);
    let (dc, ds) = (up(d, &cos), up(d, &sin));
    let mut got = up(d, &x);
    layers::rope_forward(
        d,
        &mut got.as_view_mut(),
        &dc.as_view(),
        &ds.as_view(),
        dims,
    )
    .unwrap();
    let mut want = x.clone();
    rope_forward(&mut want, &cos, &sin, dims);
    close("rope_forward", &down(d, &got), &want, rtol::<X>());
    let mut got = up(d, &x);
    layers::rope_backward(
        d,
        &mut got.as_view_mut(),
        &dc.as_view(),
        &ds.as_view(),
        dims,
    )
    .unwrap();
    let mut want = x;
    rope_backward(&mut want, &cos, &sin, dims);
    close("rope_backward", &down(d, &got), &want, rtol::<X>());
}

fn elementwise_layers_match_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let n = 70_001; // several grid-stride rounds are not needed, but a ragged last block is
    let mut rng = Rng::new(5);
    let (a, b) = (random::<X>(&mut rng, n, 4.0), random::<X>(&mut rng, n, 4.0));
    let (da, db) = (up(d, &a), up(d, &b));
    let mut out = up(d, &nan::<X>(n));
    layers::gelu_forward(d, &mut out.as_view_mut(), &da.as_view()).unwrap();
    let mut want = vec![X::ZERO; n];
    gelu::gelu_forward(&mut want, &a);
    close("gelu_forward", &down(d, &out), &want, rtol::<X>());
    let mut g = up(d, &b);
    layers::gelu_backward(d, &mut g.as_view_mut(), &da.as_view()).unwrap();
    let mut want = b.clone();
    gelu::gelu_backward(&mut want, &a);
    close("gelu_backward", &down(d, &g), &want, rtol::<X>());
    let mut out = up(d, &nan::<X>(n));
    layers::residual_forward(d, &mut out.as_view_mut(), &da.as_view(), &db.as_view()).unwrap();
    let mut want = vec![X::ZERO; n];
    residual::residual_forward(&mut want, &a, &b);
    close("residual_forward", &down(d, &out), &want, rtol::<X>());
    let mut acc = up(d, &a);
    layers::residual_accumulate(d, &mut acc.as_view_mut(), &db.as_view()).unwrap();
    let mut want = a.clone();
    residual::residual_accumulate(&mut want, &b);
    close("residual_accumulate", &down(d, &acc), &want, rtol::<X>());
    let mut scaled = up(d, &a);
    layers::scale(d, &mut scaled.as_view_mut(), 0.375).unwrap();
    let mut want = a.clone();
    residual::scale(&mut want, 0.375);
    close("scale", &down(d, &scaled), &want, 0.0);

    let mut out = up(d, &nan::<X>(n));
    layers::swiglu_forward(d, &mut out.as_view_mut(), &da.as_view(), &db.as_view()).unwrap();
    let mut want = vec![X::ZERO; n];
    swiglu::swiglu_forward(&mut want, &a, &b);
    close("swiglu_forward", &down(d, &out), &want, rtol::<X>());
    let dout = random::<X>(&mut rng, n, 1.0);
    let (mut dg, mut du) = (up(d, &nan::<X>(n)), up(d, &dout));
    layers::swiglu_backward(
        d,
        &mut dg.as_view_mut(),
        &mut du.as_view_mut(),
        &da.as_view(),
        &db.as_view(),
    )
    .unwrap();
    let (mut wg, mut wu) = (vec![X::ZERO; n], dout.clone());
    swiglu::swiglu_backward(&mut wg, &mut wu, &a, &b);
    close("swiglu_backward dgate", &down(d, &dg), &wg, rtol::<X>());
    close("swiglu_backward dup", &down(d, &du), &wu, rtol::<X>());
}

/// NF4 is bitsandbytes' format on both back ends: codes, absmax and values bit for bit.
fn nf4_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let n = 64 * 4096 + 37;
    let mut rng = Rng::new(12);
    let mut x = random::<X>(&mut rng, n, 0.05);
    x[64..128].fill(X::ZERO);
    let (bytes, blocks) = (nf4::code_bytes(n), nf4::blocks(n));
    let (mut codes, mut absmax) = (up(d, &vec![0xa5u8; bytes]), up(d, &vec![f32::NAN; blocks]));
    let dx = up(d, &x);
    cuda::nf4::quantize(
        d,
        &mut codes.as_view_mut(),
        &mut absmax.as_view_mut(),
        &dx.as_view(),
    )
    .unwrap();
    let (mut want_codes, mut want_absmax) = (vec![0u8; bytes], vec![0f32; blocks]);
    nf4::quantize(&x, &mut want_codes, &mut want_absmax);
    assert_eq!(down(d, &codes), want_codes, "nf4 codes ({})", X::NAME);
    let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&down(d, &absmax)),
        bits(&want_absmax),
        "nf4 absmax ({})",
        X::NAME
    );
    let mut back = up(d, &nan::<X>(n));
    cuda::nf4::dequantize(
        d,
        &mut back.as_view_mut(),
        &codes.as_view(),
        &absmax.as_view(),
    )
    .unwrap();
    let mut want = vec![X::ZERO; n];
    nf4::dequantize(&want_codes, &want_absmax, &mut want);
    close("nf4_dequantize", &down(d, &back), &want, 0.0);
}

/// Dropout's masks on the GPU are the CPU's, bit for bit.
fn dropout_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let n = 1 << 20;
    let c = dropout_case::<X>(n);
    let (dx, mut out) = (up(d, &c.x), up(d, &nan::<X>(n)));
    cuda::dropout::dropout_forward(d, &mut out.as_view_mut(), &dx.as_view(), c.mask).unwrap();
    close("dropout_forward", &down(d, &out), &c.forward, 0.0);
    let mut dinp = up(d, &c.acc);
    cuda::dropout::dropout_backward(d, &mut dinp.as_view_mut(), &dx.as_view(), c.mask).unwrap();
    close("dropout_backward", &down(d, &dinp), &c.backward, 0.0);
}

#[test]
fn crossentropy_matches_cpu_with_and_without_dlogits() {
    let Some(d) = device() else { return };
    let (n, v) = (9, 5003);
    let mut rng = Rng::new(6);
    let logits: Vec<f32> = rng.vec(n * v, 8.0).iter().map(|&x| x as f32).collect();
    let targets = rng.tokens(n, v);
    let dt = up(d, &targets);
    for dloss in [None, Some(0.25f32)] {
        let (mut losses, mut lg) = (up(d, &nan::<f32>(n)), up(d, &logits));
        layers::crossentropy_forward(
            d,
            &mut losses.as_view_mut(),
            &mut lg.as_view_mut(),
            &dt.as_view(),
            v,
            dloss,
        )
        .unwrap();
        let (mut wl, mut wg) = (vec![0f32; n], logits.clone());
        crossentropy::crossentropy_forward(&mut wl, &mut wg, &targets, v, dloss);
        close(
            &format!("crossentropy losses {dloss:?}"),
            &down(d, &losses),
            &wl,
            1e-5,
        );
        close(
            &format!("crossentropy logits {dloss:?}"),
            &down(d, &lg),
            &wg,
            1e-5,
        );
    }
}

fn norms_match_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let n = 100_003;
    let mut rng = Rng::new(7);
    let g = random::<X>(&mut rng, n, 3.0);
    let (mut total, mut parts) = (
        up(d, &[f64::NAN]),
        up(d, &vec![f64::NAN; cuda::grad_norm::sum_squares_parts_len()]),
    );
    let dg = up(d, &g);
    cuda::grad_norm::sum_squares(
        d,
        &mut total.as_view_mut(),
        &mut parts.as_view_mut(),
        &dg.as_view(),
    )
    .unwrap();
    let (got, want) = (down(d, &total)[0], grad_norm::sum_squares(&g));
    assert!(
        (got - want).abs() <= 1e-12 * want,
        "sum_squares ({}): {got} vs {want}",
        X::NAME
    );

    let (mut flag, mut dg) = (up(d, &[0i32]), up(d, &g));
    cuda::grad_norm::unscale(d, &mut dg.as_view_mut(), 0.5, &mut flag.as_view_mut()).unwrap();
    let want: Vec<X> = g.iter().map(|x| X::from_f32(x.to_f32() * 0.5)).collect();
    close("unscale", &down(d, &dg), &want, 0.0);
    assert_eq!(down(d, &flag), [0], "finite gradients raise no flag");
    let mut with_inf = g.clone();
    with_inf[n / 2] = X::from_f32(f32::INFINITY);
    let mut dg = up(d, &with_inf);
    cuda::grad_norm::unscale(d, &mut dg.as_view_mut(), 0.5, &mut flag.as_view_mut()).unwrap();
    assert_eq!(
        down(d, &flag),
        [1],
        "an inf gradient raises the flag ({})",
        X::NAME
    );
}

fn elementwise_optimizers_match_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let n = 10_007;
    let Case {
        master,
        grad,
        state,
    } = case::<X>(8, n);
    let dg = up(d, &grad);
    let check = |what: &str,
                 gpu_master: &CudaSlice<f32>,
                 out: &CudaSlice<X>,
                 cpu_master: &[f32],
                 cpu_out: &[X]| {
        close(
            &format!("{what} master"),
            &down(d, gpu_master),
            cpu_master,
            1e-6,
        );
        close(
            &format!("{what} param_out"),
            &down(d, out),
            cpu_out,
            rtol::<X>(),
        );
    };
    let (mut m, mut out) = (up(d, &master), up(d, &nan::<X>(n)));
    cuda::optim::sgd_step(
        d,
        &mut m.as_view_mut(),
        &dg.as_view(),
        Some(&mut out.as_view_mut()),
        0.1,
        0.5,
        0.999,
    )
    .unwrap();
    let (mut wm, mut wo) = (master.clone(), vec![X::ZERO; n]);
    optim::sgd_step(&mut wm, &grad, Some(&mut wo), 0.1, 0.5, 0.999);
    check("sgd", &m, &out, &wm, &wo);

    let hp = Momentum {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
    };
    let (mut m, mut buf, mut out) = (up(d, &master), up(d, &state), up(d, &nan::<X>(n)));
    cuda::optim::momentum_step(
        d,
        &mut m.as_view_mut(),
        &dg.as_view(),
        &mut buf.as_view_mut(),
        Some(&mut out.as_view_mut()),
        &hp,
        0.5,
        0.999,
    )
    .unwrap();
    let (mut wm, mut wb, mut wo) = (master.clone(), state.clone(), vec![X::ZERO; n]);
    optim::momentum_step(&mut wm, &grad, &mut wb, Some(&mut wo), &hp, 0.5, 0.999);
    check("momentum", &m, &out, &wm, &wo);
    close("momentum buf", &down(d, &buf), &wb, 1e-6);

    let hp = AdamW {
        lr: 1e-2,
        ..AdamW::default()
    };
    let v0: Vec<f32> = state.iter().map(|s| s * s).collect();
    let (mut m, mut s1, mut s2, mut out) = (
        up(d, &master),
        up(d, &state),
        up(d, &v0),
        up(d, &nan::<X>(n)),
    );
    cuda::optim::adamw_step(
        d,
        &mut m.as_view_mut(),
        &dg.as_view(),
        &mut s1.as_view_mut(),
        &mut s2.as_view_mut(),
        Some(&mut out.as_view_mut()),
        &hp,
        3,
        0.5,
        0.999,
    )
    .unwrap();
    let (mut wm, mut w1, mut w2, mut wo) =
        (master.clone(), state.clone(), v0.clone(), vec![X::ZERO; n]);
    optim::adamw_step(
        &mut wm,
        &grad,
        &mut w1,
        &mut w2,
        Some(&mut wo),
        &hp,
        3,
        0.5,
        0.999,
    );
    check("adamw", &m, &out, &wm, &wo);
    close("adamw m", &down(d, &s1), &w1, 1e-6);
    close("adamw v", &down(d, &s2), &w2, 1e-6);

    let hp = Lion {
        lr: 1e-2,
        ..Lion::default()
    };
    let (mut m, mut s1) = (up(d, &master), up(d, &state));
    cuda::optim::lion_step::<X, X>(
        d,
        &mut m.as_view_mut(),
        &dg.as_view(),
        &mut s1.as_view_mut(),
        None,
        &hp,
        0.5,
        0.999,
    )
    .unwrap();
    let (mut wm, mut w1) = (master.clone(), state.clone());
    optim::lion_step::<X, X>(&mut wm, &grad, &mut w1, None, &hp, 0.5, 0.999);
    close("lion master", &down(d, &m), &wm, 1e-6);
    close("lion m", &down(d, &s1), &w1, 1e-6);

    let mut m = up(d, &master);
    cuda::optim::decay(d, &mut m.as_view_mut(), 0.99).unwrap();
    let mut wm = master.clone();
    optim::decay(&mut wm, 0.99);
    close("decay", &down(d, &m), &wm, 0.0);
}

fn adam8bit_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let (n, block) = (5000, 2048); // a partial last block
    let Case { master, grad, .. } = case::<X>(9, n);
    let hp = AdamW {
        lr: 1e-2,
        ..AdamW::default()
    };
    let codes = cuda::optim::Adam8bitCodes::new(d).unwrap();
    let blocks = optim::adam8bit_blocks(n, block);
    let (mut m, mut qm, mut qv) = (
        up(d, &master),
        d.zeros::<u8>(n).unwrap(),
        d.zeros::<u8>(n).unwrap(),
    );
    let (mut am, mut av, mut out) = (
        d.zeros::<f32>(blocks).unwrap(),
        d.zeros::<f32>(blocks).unwrap(),
        up(d, &nan::<X>(n)),
    );
    let (mut wm, mut wqm, mut wqv) = (master.clone(), vec![0u8; n], vec![0u8; n]);
    let (mut wam, mut wav, mut wo) = (vec![0f32; blocks], vec![0f32; blocks], vec![X::ZERO; n]);
    let dg = up(d, &grad);
    for step in 1..=3 {
        cuda::optim::adam8bit_step(
            d,
            &mut m.as_view_mut(),
            &dg.as_view(),
            &mut qm.as_view_mut(),
            &mut qv.as_view_mut(),
            &mut am.as_view_mut(),
            &mut av.as_view_mut(),
            Some(&mut out.as_view_mut()),
            &codes,
            &hp,
            step,
            0.5,
            block,
        )
        .unwrap();
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
    close("adam8bit master", &down(d, &m), &wm, 1e-6);
    close("adam8bit param_out", &down(d, &out), &wo, rtol::<X>());
    close("adam8bit absmax_m", &down(d, &am), &wam, 1e-6);
    close("adam8bit absmax_v", &down(d, &av), &wav, 1e-6);
    // The same f32 operations in the same order: the codes chosen are the same.
    assert_eq!(down(d, &qm), wqm, "adam8bit m codes ({})", X::NAME);
    assert_eq!(down(d, &qv), wqv, "adam8bit v codes ({})", X::NAME);
}

fn adafactor_matches_cpu<X: DeviceFloat>() {
    let Some(d) = device() else { return };
    let (rows, cols) = (37, 53);
    let n = rows * cols;
    let Case { master, grad, .. } = case::<X>(10, n);
    let hp = Adafactor {
        lr: 1e-2,
        beta1: Some(0.9),
        ..Adafactor::default()
    };
    let step = 2;
    // Matrix, as two shards cut mid-row: each adds its partial exact sums.
    let (mut rs, mut cs) = (
        d.zeros::<f64>(rows * optim::LIMBS).unwrap(),
        d.zeros::<f64>(cols * optim::LIMBS).unwrap(),
    );
    let cut = n / 2 + 7;
    let (g0, g1) = (up(d, &grad[..cut]), up(d, &grad[cut..]));
    cuda::optim::adafactor_sq_sums(
        d,
        &g0.as_view(),
        0,
        0.5,
        &hp,
        &mut rs.as_view_mut(),
        &mut cs.as_view_mut(),
    )
    .unwrap();
    cuda::optim::adafactor_sq_sums(
        d,
        &g1.as_view(),
        cut,
        0.5,
        &hp,
        &mut rs.as_view_mut(),
        &mut cs.as_view_mut(),
    )
    .unwrap();
    let (mut row, mut col) = (up(d, &vec![0.01f32; rows]), up(d, &vec![0.02f32; cols]));
    cuda::optim::adafactor_update_stats(
        d,
        &mut row.as_view_mut(),
        &mut col.as_view_mut(),
        &rs.as_view(),
        &cs.as_view(),
        &hp,
        step,
    )
    .unwrap();
    let (mut rms, mut mean) = (d.zeros::<f64>(optim::LIMBS).unwrap(), up(d, &[f32::NAN]));
    let dg = up(d, &grad);
    cuda::optim::adafactor_rms_sum(
        d,
        &dg.as_view(),
        0.5,
        &row.as_view(),
        &col.as_view(),
        &mut mean.as_view_mut(),
        0,
        &mut rms.as_view_mut(),
    )
    .unwrap();
    let (mut m, mut ea, mut out) = (
        up(d, &master),
        d.zeros::<f32>(n).unwrap(),
        up(d, &nan::<X>(n)),
    );
    let moment = cuda::optim::Moment::Factored {
        row: &row.as_view(),
        col: &col.as_view(),
        row_mean: &mut mean.as_view_mut(),
        start: 0,
    };
    cuda::optim::adafactor_apply(
        d,
        &mut m.as_view_mut(),
        &dg.as_view(),
        Some(&mut ea.as_view_mut()),
        Some(&mut out.as_view_mut()),
        moment,
        &rms.as_view(),
        &hp,
        0.5,
    )
    .unwrap();
    let (mut wm, mut wr, mut wc, mut wea, mut wo) = (
        master.clone(),
        vec![0.01f32; rows],
        vec![0.02f32; cols],
        vec![0f32; n],
        vec![X::ZERO; n],
    );
    optim::adafactor_step_matrix(
        &mut wm,
        &grad,
        &mut wr,
        &mut wc,
        Some(&mut wea),
        Some(&mut wo),
        &hp,
        step,
        0.5,
    );
    // Exact sums and the CPU's summation order: the same bits.
    close("adafactor row", &down(d, &row), &wr, 0.0);
    close("adafactor col", &down(d, &col), &wc, 0.0);
    close("adafactor matrix master", &down(d, &m), &wm, 1e-6);
    close(
        "adafactor matrix param_out",
        &down(d, &out),
        &wo,
        rtol::<X>(),
    );

    // Vector.
    let hp = Adafactor {
        lr: 1e-2,
        ..Adafactor::default()
    };
    let (mut v, mut rms, mut m) = (
        up(d, &vec![0.01f32; n]),
        d.zeros::<f64>(optim::LIMBS).unwrap(),
        up(d, &master),
    );
    cuda::optim::adafactor_vector_ema(
        d,
        &mut v.as_view_mut(),
        &dg.as_view(),
        0.5,
        &hp,
        step,
        &mut rms.as_view_mut(),
    )
    .unwrap();
    let moment = cuda::optim::Moment::Full {
        v: &v.as_view(),
        numel: n,
    };
    cuda::optim::adafactor_apply::<X, X>(
        d,
        &mut m.as_view_mut(),
        &dg.as_view(),
        None,
        None,
        moment,
        &rms.as_view(),
        &hp,
        0.5,
    )
    .unwrap();
    let (mut wm, mut wv) = (master.clone(), vec![0.01f32; n]);
    optim::adafactor_step_vector::<X, X>(&mut wm, &grad, &mut wv, None, None, &hp, step, 0.5);
    close("adafactor v", &down(d, &v), &wv, 0.0);
    close("adafactor vector master", &down(d, &m), &wm, 1e-6);
}

mod casts {
    use super::*;
    #[test]
    fn bf16() {
        casts_match_half_bit_for_bit::<half::bf16>()
    }
    #[test]
    fn f16() {
        casts_match_half_bit_for_bit::<half::f16>()
    }
}

per_dtype! {
    encoder_parity => encoder_matches_cpu;
    layernorm_parity => layernorm_matches_cpu;
    attention_parity => attention_matches_reference;
    gqa_attention_parity => gqa_attention_matches_reference;
    rmsnorm_parity => rmsnorm_matches_cpu;
    rope_parity => rope_matches_cpu;
    dense_layer_parity => dense_layers_match_cpu;
    lm_head_parity => lm_head_matches_cpu;
    elementwise_layer_parity => elementwise_layers_match_cpu;
    norm_parity => norms_match_cpu;
    elementwise_optimizer_parity => elementwise_optimizers_match_cpu;
    adam8bit_parity => adam8bit_matches_cpu;
    adafactor_parity => adafactor_matches_cpu;
    nf4_parity => nf4_matches_cpu;
    dropout_parity => dropout_matches_cpu;
}
