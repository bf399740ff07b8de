//! The row normalisation LayerNorm and RMSNorm share: `out = (x - m)·rstd·weight (+ bias)`
//! with `rstd = 1/sqrt(mean((x - m)²) + eps)`, where LayerNorm centres each row (m its mean)
//! and RMSNorm does not (m = 0, no bias). Statistics in f32.

use crate::Float;
use crate::math::{BLOCK, for_blocks, sum, view};
use crate::par::SharedMut;
use crate::simd;
use rayon::prelude::*;

/// Forward over the N rows of `inp (N, C)`, C = `weight.len()`: centred when `mean` is given
/// (it receives the means), `rstd (N)` always written.
pub(crate) fn forward<X: Float>(
    out: &mut [X],
    mean: Option<&mut [f32]>,
    rstd: &mut [f32],
    inp: &[X],
    weight: &[X],
    bias: Option<&[X]>,
    eps: f32,
) {
    let c = weight.len();
    let n = rows(inp.len(), c);
    assert_eq!(rstd.len(), n, "rstd must be (N)");
    assert_eq!(out.len(), inp.len(), "out must be (N, C)");
    if let Some(m) = &mean {
        assert_eq!(m.len(), n, "mean must be (N)");
    }
    if let Some(b) = bias {
        assert_eq!(b.len(), c, "bias must be (C)");
    }
    let means = mean.map(SharedMut::new);
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(rstd.par_iter_mut())
        .enumerate()
        .for_each(|(row, ((o, x), rs))| {
            simd::dispatch(
                #[inline(always)]
                || {
                    let m = match means {
                        Some(_) => {
                            let mut s = 0.0;
                            for_blocks(x, |_, b| s += sum(b));
                            s / c as f32
                        }
                        None => 0.0,
                    };
                    let mut v = 0.0;
                    let mut d = [0f32; BLOCK];
                    for_blocks(x, |_, b| {
                        d[..b.len()]
                            .iter_mut()
                            .zip(b)
                            .for_each(|(d, x)| *d = (x - m) * (x - m));
                        v += sum(&d[..b.len()]);
                    });
                    let r = 1.0 / (v / c as f32 + eps).sqrt();
                    let (mut wb, mut bb) = ([0f32; BLOCK], [0f32; BLOCK]);
                    for_blocks(x, |j, b| {
                        let n = b.len();
                        let w = view(&weight[j..j + n], &mut wb);
                        for i in 0..n {
                            d[i] = (b[i] - m) * r * w[i];
                        }
                        if let Some(bias) = bias {
                            let bias = view(&bias[j..j + n], &mut bb);
                            d[..n].iter_mut().zip(bias).for_each(|(d, b)| *d += b);
                        }
                        X::cast_from_f32(&d[..n], &mut o[j..j + n]);
                    });
                    if let Some(means) = means {
                        // SAFETY: each row's mean is written by its own task only.
                        let mean = unsafe { means.slice(row..row + 1) };
                        mean[0] = m;
                    }
                    *rs = r;
                },
            )
        });
}

/// Backward: `dinp += ∂L/∂inp` and, unless the weight is frozen (`None`), `dweight += Σ_rows
/// dout · norm` and, when given, `dbias += Σ_rows dout`; centred when `mean` is given (as in
/// the forward).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<X: Float>(
    dinp: &mut [X],
    dweight: Option<&mut [X]>,
    dbias: Option<&mut [X]>,
    dout: &[X],
    inp: &[X],
    weight: &[X],
    mean: Option<&[f32]>,
    rstd: &[f32],
) {
    let c = weight.len();
    let n = rows(inp.len(), c);
    assert_eq!(rstd.len(), n, "rstd must be (N)");
    if let Some(m) = mean {
        assert_eq!(m.len(), n, "mean must be (N)");
    }
    assert!(
        dinp.len() == inp.len() && dout.len() == inp.len(),
        "dinp, dout must be (N, C)"
    );
    if let Some(dw) = &dweight {
        assert_eq!(dw.len(), c, "dweight must be (C)");
    }
    if let Some(db) = &dbias {
        assert_eq!(db.len(), c, "dbias must be (C)");
    }
    let mean_of = |row: usize| mean.map_or(0.0, |m| m[row]);
    // Rows: dinp += (w·dout - mean(w·dout) - norm · mean(w·dout·norm)) · rstd, without the
    // second term when not centred.
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(rstd.par_iter())
        .enumerate()
        .for_each(|(row, (((di, dy), x), &r))| {
            let m = mean_of(row);
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
                        if mean.is_some() {
                            s1 += sum(&wd[..n]);
                        }
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
    let Some(dweight) = dweight else {
        return;
    };
    let dbias = dbias.map(SharedMut::new);
    dweight
        .par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(blk, dw)| {
            simd::dispatch(
                #[inline(always)]
                || {
                    let (j0, n) = (blk * BLOCK, dw.len());
                    let (mut aw, mut ab, mut yb, mut xb) =
                        ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
                    for (row, &r) in rstd.iter().enumerate() {
                        let m = mean_of(row);
                        let dy = view(&dout[row * c + j0..][..n], &mut yb);
                        let xs = view(&inp[row * c + j0..][..n], &mut xb);
                        for i in 0..n {
                            aw[i] += dy[i] * ((xs[i] - m) * r);
                        }
                        if dbias.is_some() {
                            ab[..n].iter_mut().zip(dy).for_each(|(a, y)| *a += y);
                        }
                    }
                    add(dw, &aw[..n]);
                    if let Some(db) = dbias {
                        // SAFETY: each block of columns is summed by its own task only.
                        add(unsafe { db.slice(j0..j0 + n) }, &ab[..n]);
                    }
                },
            )
        });
}

fn add<X: Float>(d: &mut [X], s: &[f32]) {
    d.iter_mut()
        .zip(s)
        .for_each(|(d, s)| *d = X::from_f32(d.to_f32() + s));
}

/// Row count of `inp (N, C)`.
fn rows(len: usize, c: usize) -> usize {
    assert!(
        c > 0 && len.is_multiple_of(c),
        "inp must be (N, C) with C = weight.len()"
    );
    len / c
}
