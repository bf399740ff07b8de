//! Shared test helpers: a seeded generator, dtype round trips and tolerances.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::Write;
use std::sync::Once;

use kernels::Float;

/// Says, once per test binary and past the harness's capture (straight to stderr), which of
/// the kernels' optional CPU paths this machine cannot exercise: the tests then checked only
/// the baseline build against itself.
pub fn note_unexercised_cpu_paths() {
    static NOTE: Once = Once::new();
    NOTE.call_once(|| {
        let mut missing = Vec::new();
        if !kernels::cpu::has_avx2() {
            missing.push("AVX2 (the AVX2 build of the inner loops and bf16 casts)");
        }
        if !kernels::cpu::has_avx512() {
            missing.push("AVX-512 (the AVX-512 build of the inner loops and casts)");
        }
        if !kernels::matmul::has_bf16_dot_product() {
            missing.push("AVX512-BF16 (the vdpbf16ps bf16 matmul)");
        }
        if !kernels::matmul::has_bf16_tiles() {
            missing.push("AMX-BF16 (the bf16 matmul on AMX tiles)");
        }
        for path in missing {
            let _ = writeln!(
                std::io::stderr(),
                "note: this CPU lacks {path}: that path was not exercised"
            );
        }
    });
}

/// SplitMix64: small, seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    pub fn tokens(&mut self, n: usize, v: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_u64() % v as u64) as u32)
            .collect()
    }
}

/// Round to `X` (via f32, as the trainer stores values).
pub fn to_x<X: Float>(v: &[f64]) -> Vec<X> {
    v.iter().map(|&x| X::from_f32(x as f32)).collect()
}

pub fn to_f64<X: Float>(v: &[X]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

/// `n` NaNs: the start of an output a kernel overwrites, so an element it skips fails.
pub fn nan<X: Float>(n: usize) -> Vec<X> {
    vec![X::from_f32(f32::NAN); n]
}

/// Llama's tables: position p, pair i at angle p · 10000^(-2i/D), for more positions than T.
pub fn rope_tables(positions: usize, dim: usize) -> (Vec<f32>, Vec<f32>) {
    let h = dim / 2;
    let angle = |p: usize, i: usize| p as f64 * 10000f64.powf(-2.0 * i as f64 / dim as f64);
    let table = |f: fn(f64) -> f64| -> Vec<f32> {
        (0..positions * h)
            .map(|j| f(angle(j / h, j % h)) as f32)
            .collect()
    };
    (table(f64::cos), table(f64::sin))
}

/// Random `X` values of scale `s`.
pub fn random<X: Float>(rng: &mut Rng, n: usize, s: f64) -> Vec<X> {
    to_x::<X>(&rng.vec(n, s))
}

/// Inputs of the cast kernels' bit-for-bit tests: random values, then NaNs (a signalling one:
/// quieted, payload kept), infinities, subnormals of f32, the f16 subnormal range and its
/// ties, and the f16 overflow edge.
pub fn cast_inputs() -> Vec<f32> {
    let mut rng = Rng::new(1);
    let mut src: Vec<f32> = rng.vec(4096, 10.0).iter().map(|&x| x as f32).collect();
    src.extend([
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -1e-42,
        0.0,
        -0.0,
        6e-8,
        3e-8,
        2.980_232_2e-8,
        1e-5,
        -6.1e-5,
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        1.0 + 1.0 / 512.0,
        1.0 + 3.0 / 256.0,
        3.4e38,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc0_1234),
    ]);
    src.extend((0..2000u32).map(|i| f32::from_bits(0x3300_0000 + i * 0x1_1111)));
    src
}

/// Master weights, gradients and states of one optimizer test.
pub struct Case<G> {
    pub master: Vec<f32>,
    pub grad: Vec<G>,
    pub state: Vec<f32>,
}

pub fn case<G: Float>(seed: u64, n: usize) -> Case<G> {
    let mut rng = Rng::new(seed);
    let f = |v: Vec<f64>| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    Case {
        master: f(rng.vec(n, 1.0)),
        grad: random::<G>(&mut rng, n, 1.0),
        state: f(rng.vec(n, 0.1)),
    }
}

/// Values of `v` after rounding to `X`, as f64: the exact inputs a kernel sees.
pub fn rounded<X: Float>(v: &[f64]) -> Vec<f64> {
    to_f64(&to_x::<X>(v))
}

/// Relative tolerance for a kernel that computes in f32 and stores `X`: twice the unit
/// roundoff of the store (f16 2^-11, bf16 2^-8), and for f32 the error of f32 accumulation
/// over ~1000 terms with margin (~1e-5).
pub fn rtol<X: Float>() -> f64 {
    match X::NAME {
        "f32" => 1e-5,
        "f16" => 1e-3,
        "bf16" => 8e-3,
        other => panic!("no tolerance for {other}"),
    }
}

/// `|got - want| <= rtol · (|want| + rms(want))` elementwise: relative to each value, plus
/// the scale of the whole output for entries that cancel towards zero.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rms = (want.iter().map(|x| x * x).sum::<f64>() / want.len().max(1) as f64).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rtol * (w.abs() + rms);
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tol {tol:e}, rms {rms:e})"
        );
    }
}

/// Run a generic test body once per dtype.
#[macro_export]
macro_rules! per_dtype {
    ($($name:ident => $body:ident;)*) => {
        $(mod $name {
            use super::*;
            #[test]
            fn f32() { $body::<f32>() }
            #[test]
            fn f16() { $body::<half::f16>() }
            #[test]
            fn bf16() { $body::<half::bf16>() }
        })*
    };
}

/// What the GPU's dropout kernels are checked on: `n` inputs `x`, the gradient `acc` backward
/// adds to, a mask from an offset past 2³² (so the counter's high half is used), and the CPU's
/// forward and backward of them.
pub struct DropoutCase<X> {
    pub x: Vec<X>,
    pub acc: Vec<X>,
    pub mask: kernels::dropout::Mask,
    pub forward: Vec<X>,
    pub backward: Vec<X>,
}

pub fn dropout_case<X: Float>(n: usize) -> DropoutCase<X> {
    let mut rng = Rng::new(13);
    let (x, acc) = (random::<X>(&mut rng, n, 1.0), random::<X>(&mut rng, n, 1.0));
    let mask = kernels::dropout::Mask {
        p: 0.3,
        key: 0x1234_5678_9abc_def0,
        offset: (1 << 33) + 7,
    };
    let mut forward = vec![X::ZERO; n];
    kernels::dropout::dropout_forward(&mut forward, &x, mask);
    let mut backward = acc.clone();
    kernels::dropout::dropout_backward(&mut backward, &x, mask);
    DropoutCase {
        x,
        acc,
        mask,
        forward,
        backward,
    }
}
