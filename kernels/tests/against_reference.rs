//! Every optimised kernel against the f64 reference, one body per dtype. Inputs are rounded
//! to `X` first and the reference sees the same rounded values, so the only differences are
//! f32 arithmetic and the final rounding, bounded by `rtol::<X>()`.

use crate::common;

use common::*;
use kernels::attention::{
    AttentionDims, MAX_HEAD_SIZE, attention_backward, attention_forward, gqa_attention_backward,
    gqa_attention_forward,
};
use kernels::matmul::{
    DinpMode, Layout, MIN_SCRATCH, matmul_backward, matmul_forward, scratch_len,
};
use kernels::rope::{RopeDims, rope_backward, rope_forward};
use kernels::{Float, crossentropy, encoder, gelu, grad_norm, layernorm, reference, residual};
use kernels::{rmsnorm, swiglu};

fn plus(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

const LAYOUTS: [Layout; 2] = [Layout::KN, Layout::NK];

fn matmul_forward_matches<X: Float>() {
    common::note_unexercised_cpu_paths();
    let mut rng = Rng::new(1);
    // Odd sizes; the short scratch forces 16-wide tiles in every dimension. The second shape
    // spans several column panels and row blocks of the bf16 dot-product kernel.
    for ((m, k, n), layout) in [(37, 70, 45), (70, 33, 150)]
        .into_iter()
        .flat_map(|s| LAYOUTS.map(|l| (s, l)))
    {
        for short in [false, true] {
            let inp = rounded::<X>(&rng.vec(m * k, 1.0));
            let w = rounded::<X>(&rng.vec(k * n, 0.2));
            let b = rounded::<X>(&rng.vec(n, 0.5));
            let want = reference::matmul_forward(&inp, &w, Some(&b), layout, (m, k, n));
            let mut scratch = vec![
                0f32;
                if short {
                    MIN_SCRATCH
                } else {
                    scratch_len(m, k, n)
                }
            ];
            let (xi, xw, xb) = (to_x::<X>(&inp), to_x::<X>(&w), to_x::<X>(&b));
            let mut out = vec![X::ZERO; m * n];
            matmul_forward(
                &mut out,
                &xi,
                &xw,
                Some(&xb),
                layout,
                (m, k, n),
                &mut scratch,
            );
            assert_close("out", &to_f64(&out), &want, rtol::<X>());
            // f32 output (logits), no bias.
            let want = reference::matmul_forward(&inp, &w, None, layout, (m, k, n));
            let mut out = vec![0f32; m * n];
            matmul_forward(&mut out, &xi, &xw, None, layout, (m, k, n), &mut scratch);
            assert_close("logits", &to_f64(&out), &want, rtol::<f32>());
        }
    }
}

fn matmul_backward_matches<X: Float>() {
    common::note_unexercised_cpu_paths();
    let mut rng = Rng::new(2);
    for ((m, k, n), layout) in [(33, 40, 51), (61, 100, 130)]
        .into_iter()
        .flat_map(|s| LAYOUTS.map(|l| (s, l)))
    {
        for short in [false, true] {
            let inp = rounded::<X>(&rng.vec(m * k, 1.0));
            let w = rounded::<X>(&rng.vec(k * n, 0.2));
            let dout = rounded::<X>(&rng.vec(m * n, 1.0));
            let (dw0, db0) = (
                rounded::<X>(&rng.vec(k * n, 1.0)),
                rounded::<X>(&rng.vec(n, 1.0)),
            );
            let (di, dw, db) = reference::matmul_backward(&dout, &inp, &w, layout, (m, k, n));
            let want_dw: Vec<f64> = dw.iter().zip(&dw0).map(|(a, b)| a + b).collect();
            let want_db: Vec<f64> = db.iter().zip(&db0).map(|(a, b)| a + b).collect();
            let mut scratch = vec![
                0f32;
                if short {
                    MIN_SCRATCH
                } else {
                    scratch_len(m, k, n)
                }
            ];
            let (xi, xw) = (to_x::<X>(&inp), to_x::<X>(&w));
            // dout in X, then in f32 (the dlogits path).
            let (mut gi, mut gw, mut gb) = (vec![X::ZERO; m * k], to_x::<X>(&dw0), to_x::<X>(&db0));
            let dy = to_x::<X>(&dout);
            matmul_backward(
                &mut gi,
                &mut gw,
                Some(&mut gb),
                &dy,
                &xi,
                &xw,
                layout,
                (m, k, n),
                DinpMode::Overwrite,
                &mut scratch,
            );
            assert_close("dinp", &to_f64(&gi), &di, rtol::<X>());
            assert_close("dweight", &to_f64(&gw), &want_dw, rtol::<X>());
            assert_close("dbias", &to_f64(&gb), &want_db, rtol::<X>());
            // dinp accumulated: a second layer reading the same input adds its gradient.
            let di0 = rounded::<X>(&rng.vec(m * k, 1.0));
            let (mut gi, mut gw) = (to_x::<X>(&di0), to_x::<X>(&dw0));
            matmul_backward(
                &mut gi,
                &mut gw,
                None,
                &dy,
                &xi,
                &xw,
                layout,
                (m, k, n),
                DinpMode::Accumulate,
                &mut scratch,
            );
            assert_close("dinp +=", &to_f64(&gi), &plus(&di, &di0), rtol::<X>());
            assert_close("dweight (dinp +=)", &to_f64(&gw), &want_dw, rtol::<X>());
            let (mut gi, mut gw) = (vec![X::ZERO; m * k], to_x::<X>(&dw0));
            let dy = to_x::<f32>(&dout);
            matmul_backward(
                &mut gi,
                &mut gw,
                None,
                &dy,
                &xi,
                &xw,
                layout,
                (m, k, n),
                DinpMode::Overwrite,
                &mut scratch,
            );
            assert_close("dinp (f32 dout)", &to_f64(&gi), &di, rtol::<X>());
            assert_close("dweight (f32 dout)", &to_f64(&gw), &want_dw, rtol::<X>());
        }
    }
}

fn encoder_matches<X: Float>() {
    let mut rng = Rng::new(3);
    let (b, t, c, v) = (3, 5, 300, 7); // few tokens: many repeats
    let tokens = rng.tokens(b * t, v);
    let (wte, wpe) = (
        rounded::<X>(&rng.vec(v * c, 1.0)),
        rounded::<X>(&rng.vec(t * c, 1.0)),
    );
    let mut out = vec![X::ZERO; b * t * c];
    encoder::encoder_forward(&mut out, &tokens, &to_x(&wte), Some(&to_x(&wpe)), t, c);
    let want = reference::encoder_forward(&tokens, &wte, &wpe, t, c);
    assert_close("out", &to_f64(&out), &want, rtol::<X>());

    let dout = rounded::<X>(&rng.vec(b * t * c, 1.0));
    let (d0, p0) = (
        rounded::<X>(&rng.vec(v * c, 1.0)),
        rounded::<X>(&rng.vec(t * c, 1.0)),
    );
    let (dwte, dwpe) = reference::encoder_backward(&dout, &tokens, v, t, c);
    let (mut gte, mut gpe) = (to_x::<X>(&d0), to_x::<X>(&p0));
    encoder::encoder_backward(&mut gte, Some(&mut gpe), &to_x(&dout), &tokens, t, c);
    assert_close("dwte", &to_f64(&gte), &plus(&dwte, &d0), rtol::<X>());
    assert_close("dwpe", &to_f64(&gpe), &plus(&dwpe, &p0), rtol::<X>());

    // No learned positions (Llama): the reference with wpe = 0.
    let mut out = vec![X::from_f32(f32::NAN); b * t * c];
    encoder::encoder_forward(&mut out, &tokens, &to_x(&wte), None, t, c);
    let want = reference::encoder_forward(&tokens, &wte, &vec![0.0; t * c], t, c);
    assert_close("out without wpe", &to_f64(&out), &want, rtol::<X>());
    let mut gte = to_x::<X>(&d0);
    encoder::encoder_backward(&mut gte, None, &to_x(&dout), &tokens, t, c);
    assert_close(
        "dwte without wpe",
        &to_f64(&gte),
        &plus(&dwte, &d0),
        rtol::<X>(),
    );
}

fn layernorm_matches<X: Float>() {
    let mut rng = Rng::new(4);
    let (rows, c) = (9, 300); // C crosses the 256-element block
    let inp: Vec<f64> = rounded::<X>(
        &rng.vec(rows * c, 2.0)
            .iter()
            .map(|x| x + 0.5)
            .collect::<Vec<_>>(),
    );
    let (w, b) = (
        rounded::<X>(&rng.vec(c, 1.0)),
        rounded::<X>(&rng.vec(c, 1.0)),
    );
    let (want, wmean, wrstd) = reference::layernorm_forward(&inp, &w, &b);
    let (mut out, mut mean, mut rstd) =
        (vec![X::ZERO; rows * c], vec![0f32; rows], vec![0f32; rows]);
    let (xi, xw, xb) = (to_x::<X>(&inp), to_x::<X>(&w), to_x::<X>(&b));
    layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &xi, &xw, &xb);
    assert_close("out", &to_f64(&out), &want, rtol::<X>());
    assert_close("mean", &to_f64(&mean), &wmean, 1e-6);
    assert_close("rstd", &to_f64(&rstd), &wrstd, 1e-6);

    let dout = rounded::<X>(&rng.vec(rows * c, 1.0));
    let (di0, dw0, db0) = (
        rounded::<X>(&rng.vec(rows * c, 1.0)),
        rounded::<X>(&rng.vec(c, 1.0)),
        rounded::<X>(&rng.vec(c, 1.0)),
    );
    // The kernel's f32 statistics are the reference's input, so both differentiate the same point.
    let (m64, r64) = (to_f64(&mean), to_f64(&rstd));
    let (di, dw, db) = reference::layernorm_backward(&dout, &inp, &w, &m64, &r64);
    let (mut gi, mut gw, mut gb) = (to_x::<X>(&di0), to_x::<X>(&dw0), to_x::<X>(&db0));
    layernorm::layernorm_backward(
        &mut gi,
        &mut gw,
        &mut gb,
        &to_x(&dout),
        &xi,
        &xw,
        &mean,
        &rstd,
    );
    assert_close("dinp", &to_f64(&gi), &plus(&di, &di0), rtol::<X>());
    assert_close("dweight", &to_f64(&gw), &plus(&dw, &dw0), rtol::<X>());
    assert_close("dbias", &to_f64(&gb), &plus(&db, &db0), rtol::<X>());
}

/// Rows of `dout ∘ out` summed per (b, head, t): the `delta (B, NH, T)` the backward leaves.
fn rowsums(dout: &[f64], out: &[f64], d: AttentionDims) -> Vec<f64> {
    let hs = d.head_size;
    let mut delta = vec![0.0; d.b * d.nh * d.t];
    for (row, (y, o)) in dout.chunks(hs).zip(out.chunks(hs)).enumerate() {
        let (bt, h) = (row / d.nh, row % d.nh);
        let (b, t) = (bt / d.t, bt % d.t);
        delta[(b * d.nh + h) * d.t + t] = y.iter().zip(o).map(|(y, o)| y * o).sum();
    }
    delta
}

/// Multi-head attention on the packed layout: T within one tile, T = 1, T across a partial
/// tile, T past 1024 (tiny heads), and the largest head size.
fn attention_matches<X: Float>() {
    let mut rng = Rng::new(5);
    for (b, t, nh, hs) in [
        (2, 19, 3, 20),
        (1, 1, 2, 64),
        (2, 70, 2, 64),
        (1, 1100, 2, 3),
        (1, 130, 1, MAX_HEAD_SIZE),
    ] {
        let (c, d) = (nh * hs, AttentionDims::mha(b, t, nh * hs, nh));
        let qkv = rounded::<X>(&rng.vec(d.b * d.t * 3 * c, 1.0));
        let (want, att) = reference::attention_forward(&qkv, d);
        let (mut out, mut lse) = (nan::<X>(d.b * d.t * c), vec![f32::NAN; d.b * d.nh * d.t]);
        let xq = to_x::<X>(&qkv);
        attention_forward(&mut out, &mut lse, &xq, d);
        assert_close("out", &to_f64(&out), &want, rtol::<X>());
        let want = reference::attention_lse(&qkv, d);
        assert_close("lse", &to_f64(&lse), &want, rtol::<f32>());

        let dout = rounded::<X>(&rng.vec(d.b * d.t * c, 1.0));
        let want = reference::attention_backward(&dout, &qkv, &att, &to_f64(&out), d);
        let (mut dqkv, mut delta) = (nan::<X>(qkv.len()), vec![f32::NAN; lse.len()]);
        attention_backward(&mut dqkv, &mut delta, &to_x(&dout), &xq, &out, &lse, d);
        assert_close("dqkv", &to_f64(&dqkv), &want, rtol::<X>());
        let want = rowsums(&dout, &to_f64(&out), d);
        assert_close("delta", &to_f64(&delta), &want, rtol::<f32>());
    }
}

fn gelu_and_residual_match<X: Float>() {
    let mut rng = Rng::new(6);
    let n = 1000;
    let x = rounded::<X>(&rng.vec(n, 4.0));
    let mut out = vec![X::ZERO; n];
    gelu::gelu_forward(&mut out, &to_x(&x));
    assert_close(
        "gelu",
        &to_f64(&out),
        &reference::gelu_forward(&x),
        rtol::<X>(),
    );
    let g = rounded::<X>(&rng.vec(n, 1.0));
    let mut gx = to_x::<X>(&g);
    gelu::gelu_backward(&mut gx, &to_x(&x));
    assert_close(
        "dgelu",
        &to_f64(&gx),
        &reference::gelu_backward(&g, &x),
        rtol::<X>(),
    );

    let y = rounded::<X>(&rng.vec(n, 1.0));
    let want = reference::residual_forward(&x, &y);
    let mut out = vec![X::ZERO; n];
    residual::residual_forward(&mut out, &to_x(&x), &to_x(&y));
    assert_close("residual", &to_f64(&out), &want, rtol::<X>());
    let mut a = to_x::<X>(&x);
    residual::residual_accumulate(&mut a, &to_x(&y));
    assert_close("residual +=", &to_f64(&a), &want, rtol::<X>());
}

fn norm_and_overflow_match<X: Float>() {
    let mut rng = Rng::new(7);
    let x = rounded::<X>(&rng.vec(100_003, 3.0));
    let want: f64 = x.iter().map(|x| x * x).sum();
    let got = grad_norm::sum_squares(&to_x::<X>(&x));
    assert!(
        (got - want).abs() <= 1e-12 * want,
        "sum_squares {got} vs {want}"
    );
    // The trainer finds fp16 overflow by the norm: one inf or NaN must make it non-finite.
    let mut xs = to_x::<X>(&x);
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        xs[77_777] = X::from_f32(bad);
        let n = grad_norm::sum_squares(&xs);
        assert!(!n.is_finite(), "missed {bad}: {n}");
    }
}

/// Grouped-query attention with 2 and 4 query heads per key/value head, head sizes that are
/// not C/NH of any C the test has, T within one tile, across three and past 1024; and, with
/// KV = NH, the same bits as the packed layout.
fn gqa_attention_matches<X: Float>() {
    let mut rng = Rng::new(9);
    for d in [
        AttentionDims::gqa(2, 17, 4, 2, 24),
        AttentionDims::gqa(2, 17, 4, 1, 24),
        AttentionDims::gqa(1, 150, 8, 2, 64),
        AttentionDims::gqa(1, 1030, 2, 1, 5),
    ] {
        let (qn, kn) = (d.b * d.t * d.q_width(), d.b * d.t * d.kv_width());
        let (q, k, v) = (
            rounded::<X>(&rng.vec(qn, 1.0)),
            rounded::<X>(&rng.vec(kn, 1.0)),
            rounded::<X>(&rng.vec(kn, 1.0)),
        );
        let (xq, xk, xv) = (to_x::<X>(&q), to_x::<X>(&k), to_x::<X>(&v));
        let (want, att) = reference::gqa_attention_forward(&q, &k, &v, d);
        let (mut out, mut lse) = (nan::<X>(qn), vec![f32::NAN; d.b * d.nh * d.t]);
        gqa_attention_forward(&mut out, &mut lse, &xq, &xk, &xv, d);
        assert_close("gqa out", &to_f64(&out), &want, rtol::<X>());
        let want = reference::gqa_attention_lse(&q, &k, d);
        assert_close("gqa lse", &to_f64(&lse), &want, rtol::<f32>());

        let dout = rounded::<X>(&rng.vec(qn, 1.0));
        let (wq, wk, wv) =
            reference::gqa_attention_backward(&dout, &q, &k, &v, &att, &to_f64(&out), d);
        let (mut dq, mut dk, mut dv) = (nan::<X>(qn), nan::<X>(kn), nan::<X>(kn));
        let mut delta = vec![f32::NAN; lse.len()];
        gqa_attention_backward(
            &mut dq,
            &mut dk,
            &mut dv,
            &mut delta,
            &to_x(&dout),
            &xq,
            &xk,
            &xv,
            &out,
            &lse,
            d,
        );
        assert_close("gqa dq", &to_f64(&dq), &wq, rtol::<X>());
        assert_close("gqa dk", &to_f64(&dk), &wk, rtol::<X>());
        assert_close("gqa dv", &to_f64(&dv), &wv, rtol::<X>());
    }

    let (c, d) = (48, AttentionDims::mha(2, 90, 48, 4));
    let qkv = to_x::<X>(&rng.vec(d.b * d.t * 3 * c, 1.0));
    let part = |p: usize| -> Vec<X> {
        qkv.chunks(3 * c)
            .flat_map(|row| row[p * c..(p + 1) * c].to_vec())
            .collect()
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let n = d.b * d.nh * d.t;
    let (mut po, mut pl, mut go, mut gl) = (
        vec![X::ZERO; d.b * d.t * c],
        vec![0f32; n],
        vec![X::ZERO; d.b * d.t * c],
        vec![0f32; n],
    );
    attention_forward(&mut po, &mut pl, &qkv, d);
    gqa_attention_forward(&mut go, &mut gl, &q, &k, &v, d);
    assert!(po == go && pl == gl, "packed and separate forward differ");
    let dout = to_x::<X>(&rng.vec(d.b * d.t * c, 1.0));
    let (mut dqkv, mut delta) = (vec![X::ZERO; qkv.len()], vec![0f32; n]);
    attention_backward(&mut dqkv, &mut delta, &dout, &qkv, &po, &pl, d);
    let (mut dq, mut dk, mut dv) = (q.clone(), k.clone(), v.clone());
    gqa_attention_backward(
        &mut dq, &mut dk, &mut dv, &mut delta, &dout, &q, &k, &v, &po, &pl, d,
    );
    let packed: Vec<X> = (0..d.b * d.t)
        .flat_map(|r| {
            [&dq, &dk, &dv]
                .map(|g| g[r * c..(r + 1) * c].to_vec())
                .concat()
        })
        .collect();
    assert!(packed == dqkv, "packed and separate backward differ");
}

/// RMSNorm as the block norm (C crosses the 256-element block) and as Qwen3's per-head norm.
fn rmsnorm_matches<X: Float>() {
    let mut rng = Rng::new(10);
    let eps = 1e-6;
    for (rows, c) in [(9, 300), (24, 64)] {
        let inp = rounded::<X>(&rng.vec(rows * c, 2.0));
        let w = rounded::<X>(&rng.vec(c, 1.0));
        let (want, wrstd) = reference::rmsnorm_forward(&inp, &w, eps as f64);
        let (mut out, mut rstd) = (nan::<X>(rows * c), vec![f32::NAN; rows]);
        let (xi, xw) = (to_x::<X>(&inp), to_x::<X>(&w));
        rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &xi, &xw, eps);
        assert_close("rmsnorm out", &to_f64(&out), &want, rtol::<X>());
        assert_close("rmsnorm rstd", &to_f64(&rstd), &wrstd, 1e-6);

        let dout = rounded::<X>(&rng.vec(rows * c, 1.0));
        let (di0, dw0) = (
            rounded::<X>(&rng.vec(rows * c, 1.0)),
            rounded::<X>(&rng.vec(c, 1.0)),
        );
        let (di, dw) = reference::rmsnorm_backward(&dout, &inp, &w, &to_f64(&rstd));
        let (mut gi, mut gw) = (to_x::<X>(&di0), to_x::<X>(&dw0));
        rmsnorm::rmsnorm_backward(&mut gi, &mut gw, &to_x(&dout), &xi, &xw, &rstd);
        assert_close("rmsnorm dinp", &to_f64(&gi), &plus(&di, &di0), rtol::<X>());
        assert_close(
            "rmsnorm dweight",
            &to_f64(&gw),
            &plus(&dw, &dw0),
            rtol::<X>(),
        );
    }
}

/// Also at the widest head (256).
fn rope_matches<X: Float>() {
    let mut rng = Rng::new(11);
    for (t, heads, head_dim) in [(7, 3, 20), (9, 5, 256)] {
        let d = RopeDims { t, heads, head_dim };
        rope_matches_at::<X>(&mut rng, d);
    }
}

fn rope_matches_at<X: Float>(rng: &mut Rng, d: RopeDims) {
    let n = 2 * d.t * d.heads * d.head_dim;
    let (cos, sin) = rope_tables(d.t + 2, d.head_dim);
    let (c64, s64) = (to_f64(&cos), to_f64(&sin));
    let x = rounded::<X>(&rng.vec(n, 1.0));
    for back in [false, true] {
        let mut got = to_x::<X>(&x);
        if back {
            rope_backward(&mut got, &cos, &sin, d);
        } else {
            rope_forward(&mut got, &cos, &sin, d);
        }
        let want = reference::rope(&x, &c64, &s64, d, back);
        assert_close(
            &format!("rope (back {back})"),
            &to_f64(&got),
            &want,
            rtol::<X>(),
        );
    }
}

fn swiglu_matches<X: Float>() {
    let mut rng = Rng::new(12);
    let n = 1000;
    let (g, u, dy) = (
        rounded::<X>(&rng.vec(n, 6.0)),
        rounded::<X>(&rng.vec(n, 2.0)),
        rounded::<X>(&rng.vec(n, 1.0)),
    );
    let (xg, xu) = (to_x::<X>(&g), to_x::<X>(&u));
    let mut out = nan::<X>(n);
    swiglu::swiglu_forward(&mut out, &xg, &xu);
    let want = reference::swiglu_forward(&g, &u);
    assert_close("swiglu", &to_f64(&out), &want, rtol::<X>());
    // dgate overwritten whatever it held; dup holds ∂loss/∂out on entry.
    let (mut dg, mut du) = (nan::<X>(n), to_x::<X>(&dy));
    swiglu::swiglu_backward(&mut dg, &mut du, &xg, &xu);
    let (wg, wu) = reference::swiglu_backward(&dy, &g, &u);
    assert_close("swiglu dgate", &to_f64(&dg), &wg, rtol::<X>());
    assert_close("swiglu dup", &to_f64(&du), &wu, rtol::<X>());
}

/// A product without depth is its bias, or zero: on every path, the bf16 dot-product
/// kernel's included (whose packs have no depth to hold).
fn matmul_without_depth_is_its_init<X: Float>() {
    let (m, n) = (5, 50);
    let bias = to_x::<X>(&Rng::new(3).vec(n, 1.0));
    let mut scratch = vec![0f32; MIN_SCRATCH];
    let mut out = vec![X::from_f32(7.0); m * n];
    matmul_forward::<X, X>(
        &mut out,
        &[],
        &[],
        Some(&bias),
        Layout::KN,
        (m, 0, n),
        &mut scratch,
    );
    assert!(out.chunks(n).all(|row| row == bias), "bias rows");
    matmul_forward::<X, X>(
        &mut out,
        &[],
        &[],
        None,
        Layout::NK,
        (m, 0, n),
        &mut scratch,
    );
    assert!(out.iter().all(|&x| x == X::ZERO), "zeros");
}

per_dtype! {
    matmul_without_depth_agrees_with_its_init => matmul_without_depth_is_its_init;
    gqa_attention_agrees_with_reference => gqa_attention_matches;
    rmsnorm_agrees_with_reference => rmsnorm_matches;
    rope_agrees_with_reference => rope_matches;
    swiglu_agrees_with_reference => swiglu_matches;
    matmul_forward_agrees_with_reference => matmul_forward_matches;
    matmul_backward_agrees_with_reference => matmul_backward_matches;
    encoder_agrees_with_reference => encoder_matches;
    layernorm_agrees_with_reference => layernorm_matches;
    attention_agrees_with_reference => attention_matches;
    gelu_and_residual_agree_with_reference => gelu_and_residual_match;
    sum_squares_and_overflow_check_agree_with_reference => norm_and_overflow_match;
}

#[test]
fn crossentropy_agrees_with_reference() {
    let mut rng = Rng::new(8);
    let (n, v) = (6, 1003);
    let logits = rounded::<f32>(&rng.vec(n * v, 8.0));
    let mut targets = rng.tokens(n, v);
    // A prompt's position: no loss, no gradient.
    targets[2] = crossentropy::IGNORE;
    let want = reference::crossentropy_forward(&logits, &targets, v);
    assert_eq!(want[2], 0.0);
    let mut l = to_x::<f32>(&logits);
    let mut losses = vec![0f32; n];
    crossentropy::crossentropy_forward(&mut losses, &mut l, &targets, v, None);
    assert_close("losses", &to_f64(&losses), &want, 1e-5);
    assert_eq!(l, to_x::<f32>(&logits), "logits untouched without dloss");
    crossentropy::crossentropy_forward(&mut losses, &mut l, &targets, v, Some(0.25));
    assert_close("losses", &to_f64(&losses), &want, 1e-5);
    let dl = reference::crossentropy_backward(&logits, &targets, v, 0.25);
    assert_close("dlogits", &to_f64(&l), &dl, 1e-5);
    assert!(
        l[2 * v..3 * v].iter().all(|&g| g == 0.0),
        "an ignored row's gradient"
    );
}

#[test]
#[should_panic(expected = "matmul scratch")]
fn matmul_rejects_scratch_below_minimum() {
    let (m, k, n) = (20, 20, 20);
    let (x, w) = (vec![half::bf16::ZERO; m * k], vec![half::bf16::ZERO; k * n]);
    let mut out = vec![half::bf16::ZERO; m * n];
    matmul_forward(
        &mut out,
        &x,
        &w,
        None,
        Layout::KN,
        (m, k, n),
        &mut vec![0f32; MIN_SCRATCH - 1],
    );
}
