//! Optimizer updates: exact hand-computed vectors (dyadic inputs, so every intermediate is
//! exact in f32), Adafactor sharding invariance and 8-bit Adam tracking fp32 AdamW.

use crate::common;

use common::Rng;
use half::bf16;
use kernels::optim::*;

const NO_OUT: Option<&mut [f32]> = None;

#[test]
fn sgd_step_matches_hand_computation() {
    let mut p = vec![1.0f32, -2.0, 0.5];
    let mut out = vec![bf16::ZERO; 3];
    // g = grad · 2 = [1, 0.5, -2]; p -= 0.5 · g
    sgd_step(&mut p, &[0.5f32, 0.25, -1.0], Some(&mut out), 0.5, 2.0, 1.0);
    assert_eq!(p, [0.5, -2.25, 1.5]);
    assert_eq!(out, [0.5, -2.25, 1.5].map(bf16::from_f32));
}

#[test]
fn momentum_step_matches_hand_computation() {
    let g = [
        bf16::from_f32(1.0),
        bf16::from_f32(0.5),
        bf16::from_f32(-2.0),
    ];
    let hp = Momentum {
        lr: 0.25,
        momentum: 0.5,
        nesterov: false,
    };
    let (mut p, mut buf) = (vec![1.0f32, -2.0, 0.5], vec![0f32; 3]);
    momentum_step(&mut p, &g, &mut buf, NO_OUT, &hp, 1.0, 1.0);
    assert_eq!(buf, [1.0, 0.5, -2.0]); // first step: buf = g
    assert_eq!(p, [0.75, -2.125, 1.0]);
    momentum_step(&mut p, &g, &mut buf, NO_OUT, &hp, 1.0, 1.0);
    assert_eq!(buf, [1.5, 0.75, -3.0]); // 0.5·buf + g
    assert_eq!(p, [0.375, -2.3125, 1.75]);

    let hp = Momentum {
        nesterov: true,
        ..hp
    };
    let (mut p, mut buf) = (vec![1.0f32, -2.0, 0.5], vec![0f32; 3]);
    momentum_step(&mut p, &g, &mut buf, NO_OUT, &hp, 1.0, 1.0);
    assert_eq!(p, [0.625, -2.1875, 1.25]); // p -= lr · (g + 0.5·buf) = lr · 1.5g
}

#[test]
fn adamw_step_matches_hand_computation() {
    let hp = AdamW {
        lr: 0.25,
        beta1: 0.5,
        beta2: 0.75,
        eps: 0.0,
    };
    let (mut p, mut m, mut v) = (vec![1.0f32, -2.0, 0.5, 3.0], vec![0f32; 4], vec![0f32; 4]);
    // Step 1: m = g/2, v = g²/4, bc1 = 1/2, sqrt(bc2) = 1/2, so the update is lr · sign(g).
    adamw_step(
        &mut p,
        &[1.0f32, 0.5, -2.0, 0.25],
        &mut m,
        &mut v,
        NO_OUT,
        &hp,
        1,
        1.0,
        1.0,
    );
    assert_eq!(m, [0.5, 0.25, -1.0, 0.125]);
    assert_eq!(v, [0.25, 0.0625, 1.0, 0.015625]);
    assert_eq!(p, [0.75, -2.25, 0.75, 2.75]);
    // Step 2 with g = [1, -0.5, 0, 0.25]: m = [0.75, -0.125, -0.5, 0.1875],
    // v = [0.4375, 0.109375, 0.75, 0.02734375], bc1 = 0.75, bc2 = 0.4375.
    let mut out = vec![0f32; 4];
    adamw_step(
        &mut p,
        &[1.0f32, -0.5, 0.0, 0.25],
        &mut m,
        &mut v,
        Some(&mut out[..]),
        &hp,
        2,
        1.0,
        1.0,
    );
    assert_eq!(m, [0.75, -0.125, -0.5, 0.1875]);
    assert_eq!(v, [0.4375, 0.109375, 0.75, 0.02734375]);
    let (step_size, bc2) = ((0.25f64 / 0.75) as f32, 0.4375f64.sqrt() as f32);
    let want = [
        (0.75f32, 0.75f32, 0.4375f32),
        (-2.25, -0.125, 0.109375),
        (0.75, -0.5, 0.75),
        (2.75, 0.1875, 0.02734375),
    ]
    .map(|(p, m, v)| p - step_size * m / (v.sqrt() / bc2));
    assert_eq!(p, want);
    assert_eq!(out, want);
}

#[test]
fn lion_step_matches_hand_computation() {
    let hp = Lion {
        lr: 0.125,
        beta1: 0.5,
        beta2: 0.75,
    };
    let (mut p, mut m) = (vec![1.0f32, -2.0, 0.5, 3.0], vec![0f32; 4]);
    lion_step(
        &mut p,
        &[1.0f32, 0.5, -2.0, 0.0],
        &mut m,
        NO_OUT,
        &hp,
        1.0,
        1.0,
    );
    assert_eq!(p, [0.875, -2.125, 0.625, 3.0]); // sign(0) = 0 leaves p[3]
    assert_eq!(m, [0.25, 0.125, -0.5, 0.0]);
    // c = 0.5·m + 0.5·g = [0, -0.1875, 0.25, 0]
    lion_step(
        &mut p,
        &[-0.25f32, -0.5, 1.0, 0.0],
        &mut m,
        NO_OUT,
        &hp,
        1.0,
        1.0,
    );
    assert_eq!(p, [0.875, -2.0, 0.5, 3.0]);
    assert_eq!(m, [0.125, -0.03125, -0.125, 0.0]);
}

#[test]
fn decay_scales_master() {
    let mut p = vec![1.0f32, -2.0, 0.5];
    decay(&mut p, 0.75);
    assert_eq!(p, [0.75, -1.5, 0.375]);
}

/// Each elementwise update's `decay` factor gives the bits of [`decay`] followed by the update
/// without it (what the trainer ran before the two were fused), in master, states and
/// `param_out`, on random values across several blocks and tasks.
#[test]
fn fused_decay_matches_decay_then_update() {
    let mut rng = Rng::new(17);
    let n = 40_000;
    let master: Vec<f32> = common::to_x(&rng.vec(n, 1.0));
    let grad: Vec<bf16> = common::to_x(&rng.vec(n, 1e-2));
    let state: Vec<f32> = common::to_x(&rng.vec(n, 1e-2));
    let sq: Vec<f32> = state.iter().map(|s| s * s).collect();
    let factor = 1.0 - 3e-4f32 * 0.1;
    type Update<'a> = dyn Fn(&mut [f32], &mut [f32], &mut [f32], &mut [bf16], f32) + 'a;
    let momentum = Momentum {
        lr: 1e-3,
        momentum: 0.9,
        nesterov: true,
    };
    let adamw = AdamW {
        lr: 3e-4,
        ..AdamW::default()
    };
    let lion = Lion::default();
    let updates: [(&str, &Update<'_>); 4] = [
        ("sgd", &|p, _, _, o, d| {
            sgd_step(p, &grad, Some(o), 1e-3, 0.5, d)
        }),
        ("momentum", &|p, b, _, o, d| {
            momentum_step(p, &grad, b, Some(o), &momentum, 0.5, d)
        }),
        ("adamw", &|p, m, v, o, d| {
            adamw_step(p, &grad, m, v, Some(o), &adamw, 7, 0.5, d)
        }),
        ("lion", &|p, m, _, o, d| {
            lion_step(p, &grad, m, Some(o), &lion, 0.5, d)
        }),
    ];
    for (name, update) in updates {
        // `factor` fused into the update, applied first by `decay`, or not at all.
        let run = |fused: f32, first: f32| {
            let (mut p, mut s1, mut s2) = (master.clone(), state.clone(), sq.clone());
            let mut out = vec![bf16::ZERO; n];
            decay(&mut p, first);
            update(&mut p, &mut s1, &mut s2, &mut out, fused);
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&p), bits(&s1), bits(&s2), out)
        };
        let fused = run(factor, 1.0);
        assert!(
            fused == run(1.0, factor),
            "{name}: fused decay changed the result"
        );
        assert_ne!(fused.0, run(1.0, 1.0).0, "{name}: decay had no effect");
    }
}

/// Run `steps` Adafactor steps on a (rows, cols) matrix, either whole or cut into ranges at
/// `cuts`, simulating the all-reduce by adding each range's partial sums.
fn adafactor_run(
    hp: &Adafactor,
    rows: usize,
    cols: usize,
    cuts: &[usize],
    steps: u64,
) -> (Vec<f32>, Vec<bf16>) {
    let mut rng = Rng::new(31);
    let n = rows * cols;
    let mut p: Vec<f32> = rng.vec(n, 1.0).iter().map(|&x| x as f32).collect();
    let (mut row, mut col) = (vec![0f32; rows], vec![0f32; cols]);
    let mut m = hp.beta1.map(|_| vec![0f32; n]);
    let mut out = vec![bf16::ZERO; n];
    for step in 1..=steps {
        let g: Vec<bf16> = rng
            .vec(n, 0.1)
            .iter()
            .map(|&x| bf16::from_f64(x * (step as f64)))
            .collect();
        if cuts.is_empty() {
            adafactor_step_matrix(
                &mut p,
                &g,
                &mut row,
                &mut col,
                m.as_deref_mut(),
                Some(&mut out),
                hp,
                step,
                0.5,
            );
            continue;
        }
        let bounds: Vec<(usize, usize)> = std::iter::once(0)
            .chain(cuts.iter().copied())
            .zip(cuts.iter().copied().chain([n]))
            .collect();
        let (mut rs, mut cs) = (vec![0f64; rows * LIMBS], vec![0f64; cols * LIMBS]);
        for &(a, b) in &bounds {
            let (mut r1, mut c1) = (vec![0f64; rows * LIMBS], vec![0f64; cols * LIMBS]);
            adafactor_sq_sums(&g[a..b], a, 0.5, hp, &mut r1, &mut c1);
            rs.iter_mut().zip(&r1).for_each(|(x, y)| *x += y);
            cs.iter_mut().zip(&c1).for_each(|(x, y)| *x += y);
        }
        adafactor_update_stats(&mut row, &mut col, &rs, &cs, hp, step);
        let mut rms = [0f64; LIMBS];
        for &(a, b) in bounds.iter().rev() {
            let moment = Moment::Factored {
                row: &row,
                col: &col,
                start: a,
            };
            adafactor_rms_sum(&g[a..b], 0.5, moment, &mut rms);
        }
        for &(a, b) in &bounds {
            let moment = Moment::Factored {
                row: &row,
                col: &col,
                start: a,
            };
            let ms = m.as_mut().map(|m| &mut m[a..b]);
            adafactor_apply(
                &mut p[a..b],
                &g[a..b],
                ms,
                Some(&mut out[a..b]),
                moment,
                &rms,
                hp,
                0.5,
            );
        }
    }
    (p, out)
}

#[test]
fn adafactor_sharded_step_equals_whole_matrix_bit_for_bit() {
    let (rows, cols) = (13, 37);
    for beta1 in [None, Some(0.9)] {
        let hp = Adafactor {
            lr: 1e-2,
            beta1,
            ..Adafactor::default()
        };
        let whole = adafactor_run(&hp, rows, cols, &[], 4);
        for cuts in [&[100usize, 101, 350][..], &[1], &[37, 74], &[5, 200, 480]] {
            assert!(
                adafactor_run(&hp, rows, cols, cuts, 4) == whole,
                "cuts {cuts:?}, beta1 {beta1:?}"
            );
        }
    }
}

#[test]
fn adafactor_matrix_step_matches_hugging_face_formula() {
    // One step from zero stats in f64: row/col EMAs equal the means of g² + eps1 (beta2t = 0
    // at t = 1), u = g / sqrt(row_i · col_j / mean(row)), then RMS clipping.
    let (rows, cols) = (5, 7);
    let mut rng = Rng::new(32);
    let g: Vec<f32> = rng
        .vec(rows * cols, 1.0)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let hp = Adafactor {
        lr: 0.1,
        ..Adafactor::default()
    };
    let mut p = vec![0f32; rows * cols];
    let (mut row, mut col) = (vec![0f32; rows], vec![0f32; cols]);
    adafactor_step_matrix(&mut p, &g, &mut row, &mut col, None, NO_OUT, &hp, 1, 1.0);
    let sq = |i: usize, j: usize| (g[i * cols + j] as f64).powi(2) + 1e-30;
    let r: Vec<f64> = (0..rows)
        .map(|i| (0..cols).map(|j| sq(i, j)).sum::<f64>() / cols as f64)
        .collect();
    let c: Vec<f64> = (0..cols)
        .map(|j| (0..rows).map(|i| sq(i, j)).sum::<f64>() / rows as f64)
        .collect();
    let rmean = r.iter().sum::<f64>() / rows as f64;
    let u: Vec<f64> = (0..rows * cols)
        .map(|k| g[k] as f64 / (r[k / cols] * c[k % cols] / rmean).sqrt())
        .collect();
    let rms = (u.iter().map(|u| u * u).sum::<f64>() / u.len() as f64).sqrt();
    for (k, &pk) in p.iter().enumerate() {
        let want = -0.1 * u[k] / rms.max(1.0);
        assert!(
            (pk as f64 - want).abs() <= 1e-5 * want.abs().max(1e-3),
            "p[{k}] = {pk}, want {want}"
        );
    }
}

#[test]
fn adafactor_sharded_vector_equals_whole_vector_bit_for_bit() {
    let n = 1000;
    let mut rng = Rng::new(33);
    let g: Vec<f32> = rng.vec(n, 1.0).iter().map(|&x| x as f32).collect();
    let hp = Adafactor {
        lr: 1e-2,
        ..Adafactor::default()
    };
    let (mut p, mut v) = (vec![1f32; n], vec![0f32; n]);
    adafactor_step_vector(&mut p, &g, &mut v, None, NO_OUT, &hp, 3, 1.0);
    let (mut ps, mut vs) = (vec![1f32; n], vec![0f32; n]);
    let cuts = [(0, 333), (333, 334), (334, n)];
    let mut rms = [0f64; LIMBS];
    for &(a, b) in &cuts {
        adafactor_vector_ema(&mut vs[a..b], &g[a..b], 1.0, &hp, 3, &mut rms);
    }
    for &(a, b) in &cuts {
        let moment = Moment::Full {
            v: &vs[a..b],
            numel: n,
        };
        adafactor_apply(
            &mut ps[a..b],
            &g[a..b],
            None,
            NO_OUT,
            moment,
            &rms,
            &hp,
            1.0,
        );
    }
    assert!(ps == p && vs == v);
}

#[test]
fn dynamic_maps_have_bitsandbytes_shape() {
    for signed in [true, false] {
        let code = dynamic_map(signed);
        assert!(code.windows(2).all(|w| w[0] <= w[1]), "sorted");
        assert_eq!(code[255], 1.0);
        assert!(code.contains(&0.0));
        // Smallest non-zero magnitude: midpoint of the first decade's first interval · 1e-6.
        let smallest = code
            .iter()
            .filter(|c| **c > 0.0)
            .fold(1f32, |a, &b| a.min(b));
        let want = if signed { 0.55e-6 } else { 0.325e-6 };
        assert!((smallest - want).abs() < 1e-12, "{smallest}");
    }
    assert!(dynamic_map(true)[0] < -0.99 && dynamic_map(false)[0] == 0.0);
}

/// Minimise Σ a_i (p_i - t_i)² / 2 with fp32 AdamW and 8-bit Adam from the same start.
#[test]
fn adam8bit_tracks_fp32_adamw() {
    let (n, steps) = (5000, 300);
    let mut rng = Rng::new(34);
    let a: Vec<f32> = rng
        .vec(n, 1.0)
        .iter()
        .map(|x| 1.0 + x.abs() as f32 * 4.0)
        .collect();
    let target: Vec<f32> = rng.vec(n, 1.0).iter().map(|&x| x as f32).collect();
    let p0: Vec<f32> = rng.vec(n, 1.0).iter().map(|&x| x as f32).collect();
    let hp = AdamW {
        lr: 1e-2,
        ..AdamW::default()
    };
    let (mut p32, mut m, mut v) = (p0.clone(), vec![0f32; n], vec![0f32; n]);
    let mut p8 = p0.clone();
    let blocks = adam8bit_blocks(n, DEFAULT_BLOCK);
    let (mut qm, mut qv, mut am, mut av) = (
        vec![0u8; n],
        vec![0u8; n],
        vec![0f32; blocks],
        vec![0f32; blocks],
    );
    let grad = |p: &[f32]| -> Vec<f32> {
        p.iter()
            .zip(&a)
            .zip(&target)
            .map(|((p, a), t)| a * (p - t))
            .collect()
    };
    let mut worst = 0f32;
    for t in 1..=steps {
        let (g32, g8) = (grad(&p32), grad(&p8));
        adamw_step(&mut p32, &g32, &mut m, &mut v, NO_OUT, &hp, t, 1.0, 1.0);
        adam8bit_step(
            &mut p8,
            &g8,
            &mut qm,
            &mut qv,
            &mut am,
            &mut av,
            NO_OUT,
            &hp,
            t,
            1.0,
            DEFAULT_BLOCK,
        );
        worst = p32
            .iter()
            .zip(&p8)
            .fold(worst, |w, (a, b)| w.max((a - b).abs()));
    }
    // Parameters travel up to 3 (≈ lr per step). Quantised m is within ~1% of its block's
    // absmax and v of tiny-gradient elements is coarse, so a step may differ by up to ~lr:
    // trajectories drift by a few lr (measured: worst 0.11, mean 0.012), and the loss stays
    // on the fp32 curve (measured: 0.75-1.0x).
    let loss = |p: &[f32]| -> f64 {
        p.iter()
            .zip(&target)
            .zip(&a)
            .map(|((p, t), a)| (a * (p - t) * (p - t)) as f64)
            .sum()
    };
    let mean = p32.iter().zip(&p8).map(|(a, b)| (a - b).abs()).sum::<f32>() / n as f32;
    assert!(
        worst < 0.15 && mean < 0.015,
        "8-bit Adam drifted from fp32 AdamW: worst {worst}, mean {mean}"
    );
    let (l32, l8) = (loss(&p32), loss(&p8));
    assert!(
        l8 < 1.5 * l32 && l32 < 0.01 * loss(&p0),
        "losses: fp32 {l32}, 8-bit {l8}"
    );
}

#[test]
fn adam8bit_shards_on_block_boundaries_equal_whole_buffer() {
    let (n, block) = (700, 128);
    let mut rng = Rng::new(35);
    let g: Vec<f32> = rng.vec(n, 1.0).iter().map(|&x| x as f32).collect();
    let hp = AdamW::default();
    let run = |parts: &[(usize, usize)]| {
        let (mut p, mut qm, mut qv) = (vec![0.5f32; n], vec![0u8; n], vec![0u8; n]);
        let (mut am, mut av) = (vec![0f32; n.div_ceil(block)], vec![0f32; n.div_ceil(block)]);
        for t in 1..=3 {
            for &(a, b) in parts {
                let (ba, bb) = (a / block, b.div_ceil(block));
                let (am, av) = (&mut am[ba..bb], &mut av[ba..bb]);
                adam8bit_step(
                    &mut p[a..b],
                    &g[a..b],
                    &mut qm[a..b],
                    &mut qv[a..b],
                    am,
                    av,
                    NO_OUT,
                    &hp,
                    t,
                    1.0,
                    block,
                );
            }
        }
        (p, qm, qv, am, av)
    };
    assert!(run(&[(0, n)]) == run(&[(0, 256), (256, 384), (384, n)]));
}
