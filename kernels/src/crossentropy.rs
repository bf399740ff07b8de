//! Fused softmax + cross-entropy over f32 logits.

use crate::math::{exp, sum};
use crate::simd;
use rayon::prelude::*;

/// A target whose position is not trained on (a fine-tuning prompt's): its loss and its row's
/// gradient are zero.
pub const IGNORE: u32 = u32::MAX;

/// `losses (N) = logsumexp(logits[i]) - logits[i, targets[i]]` for `logits (N, V)`; 0 where
/// the target is [`IGNORE`].
///
/// With `dloss = Some(s)` the logits are overwritten by their gradient
/// `(softmax - onehot(target)) · s` (`s` is ∂L/∂loss_i, e.g. `loss_scale / N`).
pub fn crossentropy_forward(
    losses: &mut [f32],
    logits: &mut [f32],
    targets: &[u32],
    v: usize,
    dloss: Option<f32>,
) {
    assert!(
        v > 0 && logits.len() == losses.len() * v,
        "logits must be (N, V), losses (N)"
    );
    assert_eq!(targets.len(), losses.len(), "targets must be (N)");
    logits
        .par_chunks_mut(v)
        .zip(losses.par_iter_mut())
        .zip(targets)
        .for_each(|((row, loss), &target)| {
            if target == IGNORE {
                *loss = 0.0;
                if dloss.is_some() {
                    row.fill(0.0);
                }
                return;
            }
            let target = target as usize;
            assert!(target < v, "target {target} outside the vocabulary of {v}");
            simd::dispatch(
                #[inline(always)]
                || {
                    let max = max(row);
                    let picked = row[target];
                    let total = match dloss {
                        Some(_) => exp_sum(row, max),
                        None => sum_exp(row, max),
                    };
                    *loss = max + total.ln() - picked;
                    if let Some(s) = dloss {
                        let scale = s / total;
                        row.iter_mut().for_each(|x| *x *= scale);
                        row[target] -= s;
                    }
                },
            )
        });
}

/// The largest element (NaNs ignored, -inf for an empty row), in 16 lanes: the maximum does
/// not depend on the order it is taken in.
#[inline(always)]
fn max(row: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [f32::NEG_INFINITY; L];
    let chunks = row.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            acc[l] = acc[l].max(c[l]);
        }
    }
    tail.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// `x = exp(x - max)` for the row, returning `Σ x` in 16 lanes (the order of
/// [`crate::math::sum`]) in the same pass.
#[inline(always)]
fn exp_sum(row: &mut [f32], max: f32) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let mut chunks = row.chunks_exact_mut(L);
    for c in &mut chunks {
        for l in 0..L {
            c[l] = exp(c[l] - max);
            acc[l] += c[l];
        }
    }
    for (l, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x = exp(*x - max);
        acc[l] += *x;
    }
    sum(&acc)
}

/// `Σ exp(x - max)` in 16 lanes (the order of [`crate::math::sum`]) without storing the terms.
#[inline(always)]
fn sum_exp(row: &[f32], max: f32) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let chunks = row.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..L {
            acc[l] += exp(c[l] - max);
        }
    }
    for (l, x) in tail.iter().enumerate() {
        acc[l] += exp(x - max);
    }
    sum(&acc)
}
