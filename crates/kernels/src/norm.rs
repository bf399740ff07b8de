//! Sum of squares for gradient clipping (each rank's share of the global norm).

use crate::Float;
use crate::math::BLOCK;
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

fn chunk_sum<X: Float>(c: &[X]) -> f64 {
    const L: usize = 8;
    let mut acc = [0f64; L];
    let mut buf = [0f32; BLOCK];
    for blk in c.chunks(BLOCK) {
        let b = &mut buf[..blk.len()];
        X::cast_to_f32(blk, b);
        for (i, &v) in b.iter().enumerate() {
            acc[i % L] += v as f64 * v as f64;
        }
    }
    acc.iter().sum()
}
