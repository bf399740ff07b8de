//! Scalar f32 helpers written so that LLVM vectorises the loops that call them: no libm calls,
//! and reductions over fixed lane arrays summed in a fixed order (bit-reproducible).

use crate::Float;

/// Elements converted per stack block by the row kernels (1 KiB of f32).
pub(crate) const BLOCK: usize = 256;
const LANES: usize = 16;

/// `e^x` with ~1 ulp error: Cody-Waite reduction by ln 2 and a degree-6 polynomial.
/// Returns 0 below -87.3 (the softmax masking case) and infinity from about 88.38 (2^128).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer (RNE)
    let xc = x.clamp(-87.3, 88.7);
    let rounded = xc * std::f32::consts::LOG2_E + ROUND;
    let k = rounded - ROUND;
    let r = xc - k * 0.693_359_4 - k * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^k from the integer in `rounded`'s low mantissa bits, where `k as i32` (a saturating
    // cast) would leave the loops scalar.
    let scale = f32::from_bits(rounded.to_bits().wrapping_sub(ROUND.to_bits() - 127) << 23);
    if x < -87.3 { 0.0 } else { y * scale }
}

/// `tanh(x) = 1 - 2 / (e^{2x} + 1)`; absolute error ~1e-7, enough for GELU's `1 + tanh`.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

/// Sum in 16 lanes, then the lanes pairwise: a fixed order the compiler can vectorise.
#[inline(always)]
pub(crate) fn sum(a: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    for (l, x) in tail.iter().enumerate() {
        acc[l] += x;
    }
    reduce(acc)
}

/// Dot product with the same fixed order as [`sum`].
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ta.iter().zip(tb).enumerate() {
        acc[l] += x * y;
    }
    reduce(acc)
}

#[inline(always)]
fn reduce(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Call `f(offset, block)` for consecutive `f32` views of `src` of at most [`BLOCK`] elements
/// (copies unless `X` is f32).
#[inline(always)]
pub(crate) fn for_blocks<X: Float>(src: &[X], mut f: impl FnMut(usize, &[f32])) {
    let mut buf = [0f32; BLOCK];
    for (i, c) in src.chunks(BLOCK).enumerate() {
        f(i * BLOCK, view(c, &mut buf));
    }
}

/// `src` as f32: itself when `X` is f32, else widened into the front of `buf`.
#[inline(always)]
pub(crate) fn view<'a, X: Float>(src: &'a [X], buf: &'a mut [f32]) -> &'a [f32] {
    match X::as_f32(src) {
        Some(s) => s,
        None => {
            let b = &mut buf[..src.len()];
            X::cast_to_f32(src, b);
            b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within 1 ulp of the f64 exponential over the range it computes, 0 below it.
    #[test]
    fn exp_is_within_one_ulp() {
        for i in -90_000..=88_370 {
            let x = i as f32 * 1e-3;
            let got = exp(x);
            if x < -87.3 {
                assert_eq!(got, 0.0, "exp({x})");
                continue;
            }
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                ((got as f64) - want).abs() <= ulp as f64,
                "exp({x}) = {got}, want {want}"
            );
        }
    }
}
