//! Sum of squares for gradient clipping (each rank's share of the global norm).

use crate::Float;
use crate::math::{BLOCK, view};
use crate::simd;
use rayon::prelude::*;

/// At most this many partial sums, combined in order on the calling thread.
const PARTS: usize = 256;

/// `Σ x²` accumulated in f64. Chunk bounds depend only on `x.len()`, so the bits do not
/// depend on the pool.
pub fn sum_squares<X: Float>(x: &[X]) -> f64 {
    let chunk = x.len().div_ceil(PARTS).max(4 * BLOCK);
    let mut parts = [0f64; PARTS];
    parts
        .par_iter_mut()
        .zip(x.par_chunks(chunk))
        .for_each(|(p, c)| *p = chunk_sum(c));
    parts.iter().sum()
}

/// Element `i` of each [`BLOCK`] goes to lane `i % 8`; lanes are summed in order at the end.
fn chunk_sum<X: Float>(c: &[X]) -> f64 {
    const L: usize = 8;
    simd::dispatch(
        #[inline(always)]
        || {
            let mut acc = [0f64; L];
            let mut buf = [0f32; BLOCK];
            for blk in c.chunks(BLOCK) {
                let b = view(blk, &mut buf);
                let lanes = b.chunks_exact(L);
                let tail = lanes.remainder();
                for v in lanes {
                    for l in 0..L {
                        acc[l] += v[l] as f64 * v[l] as f64;
                    }
                }
                for (a, &v) in acc.iter_mut().zip(tail) {
                    *a += v as f64 * v as f64;
                }
            }
            acc.iter().sum()
        },
    )
}
