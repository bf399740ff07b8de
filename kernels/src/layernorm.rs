//! LayerNorm over the last dimension (eps 1e-5), statistics in f32.

use crate::Float;
use crate::math::{BLOCK, for_blocks, sum, view};
use crate::simd;
use rayon::prelude::*;

/// GPT-2's LayerNorm epsilon.
pub const EPS: f32 = 1e-5;

/// `out (N, C) = (inp - mean) · rstd · weight + bias` for each of the N = B·T rows; writes
/// `mean (N)` and `rstd (N) = 1/sqrt(var + eps)` (biased variance) for the backward.
pub fn layernorm_forward<X: Float>(
    out: &mut [X],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[X],
    weight: &[X],
    bias: &[X],
) {
    let c = weight.len();
    check(inp.len(), c, mean.len(), rstd.len());
    assert!(
        out.len() == inp.len() && bias.len() == c,
        "out must be (N, C), bias (C)"
    );
    let stats = mean.par_iter_mut().zip(rstd.par_iter_mut());
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(stats)
        .for_each(|((o, x), (mu, rs))| {
            simd::dispatch(
                #[inline(always)]
                || {
                    let mut s = 0.0;
                    for_blocks(x, |_, b| s += sum(b));
                    let m = s / c as f32;
                    let mut v = 0.0;
                    let mut d = [0f32; BLOCK];
                    for_blocks(x, |_, b| {
                        d[..b.len()]
                            .iter_mut()
                            .zip(b)
                            .for_each(|(d, x)| *d = (x - m) * (x - m));
                        v += sum(&d[..b.len()]);
                    });
                    let r = 1.0 / (v / c as f32 + EPS).sqrt();
                    let (mut wb, mut bb) = ([0f32; BLOCK], [0f32; BLOCK]);
                    for_blocks(x, |j, b| {
                        let n = b.len();
                        let w = view(&weight[j..j + n], &mut wb);
                        let bias = view(&bias[j..j + n], &mut bb);
                        for i in 0..n {
                            d[i] = (b[i] - m) * r * w[i] + bias[i];
                        }
                        X::cast_from_f32(&d[..n], &mut o[j..j + n]);
                    });
                    (*mu, *rs) = (m, r);
                },
            )
        });
}

/// Backward: `dinp += ∂L/∂inp` (accumulates: it is the residual-stream gradient),
/// `dweight += Σ_rows dout · norm`, `dbias += Σ_rows dout`; shapes as in the forward.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<X: Float>(
    dinp: &mut [X],
    dweight: &mut [X],
    dbias: &mut [X],
    dout: &[X],
    inp: &[X],
    weight: &[X],
    mean: &[f32],
    rstd: &[f32],
) {
    let c = weight.len();
    check(inp.len(), c, mean.len(), rstd.len());
    assert!(
        dinp.len() == inp.len() && dout.len() == inp.len(),
        "dinp, dout must be (N, C)"
    );
    assert!(
        dweight.len() == c && dbias.len() == c,
        "dweight, dbias must be (C)"
    );
    // Rows: dinp += (w·dout - mean(w·dout) - norm · mean(w·dout·norm)) · rstd.
    let rows = dinp
        .par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c));
    rows.zip(mean.par_iter().zip(rstd))
        .for_each(|(((di, dy), x), (&m, &r))| {
            simd::dispatch(
                #[inline(always)]
                || {
                    let (mut gb, mut xb, mut wd, mut t) =
                        ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
                    let (mut s1, mut s2) = (0.0, 0.0);
                    for_blocks(dy, |j, dy| {
                        let n = dy.len();
                        let g = view(&weight[j..j + n], &mut gb);
                        let xs = view(&x[j..j + n], &mut xb);
                        for i in 0..n {
                            wd[i] = g[i] * dy[i];
                            t[i] = wd[i] * (xs[i] - m) * r;
                        }
                        s1 += sum(&wd[..n]);
                        s2 += sum(&t[..n]);
                    });
                    let (s1, s2) = (s1 / c as f32, s2 / c as f32);
                    for_blocks(dy, |j, dy| {
                        let n = dy.len();
                        let g = view(&weight[j..j + n], &mut gb);
                        let xs = view(&x[j..j + n], &mut xb);
                        X::cast_to_f32(&di[j..j + n], &mut t[..n]);
                        for i in 0..n {
                            t[i] += (g[i] * dy[i] - s1 - (xs[i] - m) * r * s2) * r;
                        }
                        X::cast_from_f32(&t[..n], &mut di[j..j + n]);
                    });
                },
            )
        });
    // Columns: each block of C sums over all rows in row order, then adds once.
    dweight
        .par_chunks_mut(BLOCK)
        .zip(dbias.par_chunks_mut(BLOCK))
        .enumerate()
        .for_each(|(blk, (dw, db))| {
            simd::dispatch(
                #[inline(always)]
                || {
                    let (j0, n) = (blk * BLOCK, dw.len());
                    let (mut aw, mut ab, mut yb, mut xb) =
                        ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
                    for (row, (&m, &r)) in mean.iter().zip(rstd).enumerate() {
                        let dy = view(&dout[row * c + j0..][..n], &mut yb);
                        let xs = view(&inp[row * c + j0..][..n], &mut xb);
                        for i in 0..n {
                            aw[i] += dy[i] * ((xs[i] - m) * r);
                            ab[i] += dy[i];
                        }
                    }
                    add(dw, &aw[..n]);
                    add(db, &ab[..n]);
                },
            )
        });
}

fn add<X: Float>(d: &mut [X], s: &[f32]) {
    d.iter_mut()
        .zip(s)
        .for_each(|(d, s)| *d = X::from_f32(d.to_f32() + s));
}

/// Row count, after checking `inp (N, C)`, `mean (N)`, `rstd (N)`.
fn check(len: usize, c: usize, nm: usize, nr: usize) -> usize {
    assert!(
        c > 0 && len.is_multiple_of(c),
        "inp must be (N, C) with C = weight.len()"
    );
    assert!(nm == len / c && nr == len / c, "mean and rstd must be (N)");
    len / c
}
