//! Adafactor (Hugging Face semantics with `relative_step=False, scale_parameter=False`),
//! split into phases that work on any element range of a matrix, because ZeRO shards cut
//! matrices at arbitrary points.
//!
//! A matrix `(rows, cols)` keeps row and column EMAs of `g² + eps1`; a vector keeps a full
//! `v`. The sums that cross a shard boundary (row/column sums of `g² + eps1`, the `Σ u²` of
//! the RMS clip) are accumulated *exactly* as integer-valued f64 limbs ([`LIMBS`] per sum):
//! partial sums from any split, added in any order (the caller's all-reduce), give the same
//! bits, so a sharded step equals the whole-matrix step bit for bit.
//!
//! Matrix step: [`adafactor_sq_sums`] on each range → all-reduce → [`adafactor_update_stats`]
//! → [`adafactor_rms_sum`] → all-reduce → [`adafactor_apply`]. Vector step:
//! [`adafactor_vector_ema`] → all-reduce → [`adafactor_apply`].

use super::elementwise;
use crate::Float;
use crate::math::sum;
use crate::par::{SharedMut, for_ranges};
use rayon::prelude::*;

/// f64 limbs per exact sum. Limb j holds a multiple of `2^(24j - 149)`; every f32 term adds
/// less than 2^24 to at most two limbs, so sums of up to 2^29 terms stay exact.
///
/// The memory model copies this (`scheduler::kernel_figures`; `tests/figures.rs` holds the two
/// equal): change both.
pub const LIMBS: usize = 12;
const CHUNK: usize = 1 << 14;

/// Hyperparameters; `Default` is Hugging Face's apart from `lr` (which it requires).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adafactor {
    pub lr: f32,
    /// Added to g² (HF `eps[0]`).
    pub eps1: f32,
    pub clip_threshold: f32,
    /// `beta2t = 1 - t^decay_rate`.
    pub decay_rate: f32,
    /// First-moment EMA of the update, if any.
    pub beta1: Option<f32>,
}

impl Default for Adafactor {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            eps1: 1e-30,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
        }
    }
}

impl Adafactor {
    /// `1 - t^decay_rate` for step `t ≥ 1` (f64, rounded once).
    pub fn beta2t(&self, step: u64) -> f32 {
        assert!(step >= 1, "Adafactor steps count from 1");
        (1.0 - (step as f64).powf(self.decay_rate as f64)) as f32
    }
}

/// The second-moment statistics an update is scaled by.
#[derive(Clone, Copy, Debug)]
pub enum Moment<'a> {
    /// Row `(rows)` and column `(cols)` EMAs of a matrix; the range starts at element `start`.
    Factored {
        row: &'a [f32],
        col: &'a [f32],
        start: usize,
    },
    /// The range's slice of a vector's full EMA; `numel` is the whole vector's length.
    Full { v: &'a [f32], numel: usize },
}

/// Phase 1 (matrix): add the exact row and column sums of `g² + eps1` over the range
/// `[start, start + grad.len())` of a `(rows, cols)` matrix to `row_sums (rows · LIMBS)` and
/// `col_sums (cols · LIMBS)` (zero them before the first range).
pub fn adafactor_sq_sums<G: Float>(
    grad: &[G],
    start: usize,
    grad_scale: f32,
    hp: &Adafactor,
    row_sums: &mut [f64],
    col_sums: &mut [f64],
) {
    let (rows, cols) = (row_sums.len() / LIMBS, col_sums.len() / LIMBS);
    assert!(
        start + grad.len() <= rows * cols,
        "range outside the matrix"
    );
    assert!(
        rows.max(cols) < 1 << 29,
        "exact sums hold at most 2^29 terms"
    );
    let end = start + grad.len();
    let sq = |i: usize| {
        let g = grad[i - start].to_f32() * grad_scale;
        g * g + hp.eps1
    };
    let (rs, cs) = (SharedMut::new(row_sums), SharedMut::new(col_sums));
    // Rows: one task per group of whole rows.
    let (r0, r1) = (start / cols, end.div_ceil(cols));
    for_ranges(r1 - r0, CHUNK.div_ceil(cols), |rr| {
        for r in rr.start + r0..rr.end + r0 {
            // SAFETY: each row's limbs belong to one task.
            let acc = unsafe { rs.slice(r * LIMBS..(r + 1) * LIMBS) };
            (start.max(r * cols)..end.min((r + 1) * cols)).for_each(|i| exact_add(acc, sq(i)));
        }
    });
    // Columns: one task per block of columns, scanning the range's rows in order.
    for_ranges(cols, 64, |cc| {
        // SAFETY: each column's limbs belong to one task.
        let acc = unsafe { cs.slice(cc.start * LIMBS..cc.end * LIMBS) };
        for r in r0..r1 {
            let lo = start.max(r * cols + cc.start);
            let hi = end.min(r * cols + cc.end);
            (lo..hi).for_each(|i| exact_add(&mut acc[(i % cols - cc.start) * LIMBS..], sq(i)));
        }
    });
}

/// Phase 2 (matrix): `row = β2t·row + (1-β2t)·mean_cols`, likewise `col` with the mean over
/// rows, from the all-reduced sums of phase 1. `row (rows)`, `col (cols)`.
pub fn adafactor_update_stats(
    row: &mut [f32],
    col: &mut [f32],
    row_sums: &[f64],
    col_sums: &[f64],
    hp: &Adafactor,
    step: u64,
) {
    let (rows, cols) = (row.len(), col.len());
    assert!(
        row_sums.len() == rows * LIMBS && col_sums.len() == cols * LIMBS,
        "sums must hold LIMBS per row/col"
    );
    let b = hp.beta2t(step);
    let ema = |s: &mut [f32], sums: &[f64], n: usize| {
        s.par_iter_mut()
            .zip(sums.par_chunks(LIMBS))
            .for_each(|(s, l)| {
                *s = b * *s + (1.0 - b) * (exact_value(l) / n as f32);
            });
    };
    ema(row, row_sums, cols);
    ema(col, col_sums, rows);
}

/// Phase 1 (vector): `v = β2t·v + (1-β2t)·(g² + eps1)` over the range, and add the exact
/// `Σ u²` of the unclipped update `u = g / sqrt(v)` to `rms_sum (LIMBS)`.
pub fn adafactor_vector_ema<G: Float>(
    v: &mut [f32],
    grad: &[G],
    grad_scale: f32,
    hp: &Adafactor,
    step: u64,
    rms_sum: &mut [f64],
) {
    assert_eq!(rms_sum.len(), LIMBS, "rms_sum holds LIMBS limbs");
    let b = hp.beta2t(step);
    let vs = SharedMut::new(v);
    let sums = par_exact(grad.len(), |r, acc| {
        // SAFETY: ranges are disjoint.
        let v = unsafe { vs.slice(r.clone()) };
        for (v, g) in v.iter_mut().zip(&grad[r]) {
            let g = g.to_f32() * grad_scale;
            *v = b * *v + (1.0 - b) * (g * g + hp.eps1);
            let u = (1.0 / v.sqrt()) * g;
            exact_add(acc, u * u);
        }
    });
    add_limbs(rms_sum, &sums);
}

/// Phase 3 (matrix): add the exact `Σ u²` over the range to `rms_sum (LIMBS)`, where
/// `u = rsqrt(row_i / mean(row)) · rsqrt(col_j) · g`.
pub fn adafactor_rms_sum<G: Float>(
    grad: &[G],
    grad_scale: f32,
    moment: Moment<'_>,
    rms_sum: &mut [f64],
) {
    assert_eq!(rms_sum.len(), LIMBS, "rms_sum holds LIMBS limbs");
    let scale = Scale::new(moment, grad.len());
    let sums = par_exact(grad.len(), |r, acc| {
        for i in r {
            let u = scale.at(i) * (grad[i].to_f32() * grad_scale);
            exact_add(acc, u * u);
        }
    });
    add_limbs(rms_sum, &sums);
}

/// Last phase: `u /= max(rms(u) / clip_threshold, 1)`, `u *= lr`, optionally
/// `m = β1·m + (1-β1)·u; u = m`, then `master -= u`; `rms_sum` is the all-reduced `Σ u²`.
#[allow(clippy::too_many_arguments)]
pub fn adafactor_apply<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    exp_avg: Option<&mut [f32]>,
    param_out: Option<&mut [X]>,
    moment: Moment<'_>,
    rms_sum: &[f64],
    hp: &Adafactor,
    grad_scale: f32,
) {
    let scale = Scale::new(moment, grad.len());
    let rms = exact_value(rms_sum).sqrt() / (scale.numel as f32).sqrt();
    let denom = (rms / hp.clip_threshold).max(1.0);
    let u = |i: usize, g: f32| scale.at(i) * g / denom * hp.lr;
    match (exp_avg, hp.beta1) {
        (Some(m), Some(b1)) => elementwise(
            master,
            grad,
            (grad_scale, 1.0),
            [m],
            param_out,
            |off, p, g, [m]| {
                for (i, ((p, &g), m)) in p.iter_mut().zip(g).zip(m.iter_mut()).enumerate() {
                    *m = b1 * *m + (1.0 - b1) * u(off + i, g);
                    *p -= *m;
                }
            },
        ),
        (None, None) => elementwise(
            master,
            grad,
            (grad_scale, 1.0),
            [],
            param_out,
            |off, p, g, []| {
                for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                    *p -= u(off + i, g);
                }
            },
        ),
        _ => panic!("exp_avg must be given exactly when beta1 is set"),
    }
}

/// Per-element second-moment scale `rsqrt` of the statistics, by index within the range.
struct Scale<'a> {
    moment: Moment<'a>,
    row_mean: f32,
    numel: usize,
}

impl<'a> Scale<'a> {
    fn new(moment: Moment<'a>, len: usize) -> Self {
        match moment {
            Moment::Factored { row, col, start } => {
                assert!(
                    start + len <= row.len() * col.len(),
                    "range outside the matrix"
                );
                let row_mean = sum(row) / row.len() as f32;
                Self {
                    moment,
                    row_mean,
                    numel: row.len() * col.len(),
                }
            }
            Moment::Full { v, numel } => {
                assert_eq!(v.len(), len, "v must cover the range");
                Self {
                    moment,
                    row_mean: 0.0,
                    numel,
                }
            }
        }
    }

    #[inline]
    fn at(&self, i: usize) -> f32 {
        match self.moment {
            Moment::Factored { row, col, start } => {
                let (r, c) = ((start + i) / col.len(), (start + i) % col.len());
                (1.0 / (row[r] / self.row_mean).sqrt()) * (1.0 / col[c].sqrt())
            }
            Moment::Full { v, .. } => 1.0 / v[i].sqrt(),
        }
    }
}

/// Whole-matrix step on one rank: the phases above with local sums, bit-identical to any
/// sharded run. `master, grad (rows, cols)`, `row (rows)`, `col (cols)`; allocates
/// `(rows + cols + 1) · LIMBS` f64.
#[allow(clippy::too_many_arguments)]
pub fn adafactor_step_matrix<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    row: &mut [f32],
    col: &mut [f32],
    exp_avg: Option<&mut [f32]>,
    param_out: Option<&mut [X]>,
    hp: &Adafactor,
    step: u64,
    grad_scale: f32,
) {
    let (mut rs, mut cs) = (vec![0f64; row.len() * LIMBS], vec![0f64; col.len() * LIMBS]);
    adafactor_sq_sums(grad, 0, grad_scale, hp, &mut rs, &mut cs);
    adafactor_update_stats(row, col, &rs, &cs, hp, step);
    let moment = Moment::Factored { row, col, start: 0 };
    let mut rms = [0f64; LIMBS];
    adafactor_rms_sum(grad, grad_scale, moment, &mut rms);
    adafactor_apply(
        master, grad, exp_avg, param_out, moment, &rms, hp, grad_scale,
    );
}

/// Whole-vector step on one rank (biases, LayerNorm weights).
#[allow(clippy::too_many_arguments)]
pub fn adafactor_step_vector<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    v: &mut [f32],
    exp_avg: Option<&mut [f32]>,
    param_out: Option<&mut [X]>,
    hp: &Adafactor,
    step: u64,
    grad_scale: f32,
) {
    let mut rms = [0f64; LIMBS];
    adafactor_vector_ema(v, grad, grad_scale, hp, step, &mut rms);
    let moment = Moment::Full {
        v,
        numel: master.len(),
    };
    adafactor_apply(
        master, grad, exp_avg, param_out, moment, &rms, hp, grad_scale,
    );
}

/// Exact sum over `[0, n)`: `f(range, limbs)` per fixed chunk, limbs added in any order.
fn par_exact(
    n: usize,
    f: impl Fn(std::ops::Range<usize>, &mut [f64]) + Sync + Send,
) -> [f64; LIMBS] {
    (0..n.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let mut acc = [0f64; LIMBS];
            f(c * CHUNK..((c + 1) * CHUNK).min(n), &mut acc);
            acc
        })
        .reduce(
            || [0f64; LIMBS],
            |mut a, b| {
                add_limbs(&mut a, &b);
                a
            },
        )
}

fn add_limbs(a: &mut [f64], b: &[f64]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}

/// Add a non-negative f32 exactly: its 24-bit significand lands in two 24-bit limbs.
#[inline]
fn exact_add(acc: &mut [f64], x: f32) {
    if !x.is_finite() {
        acc[0] += x as f64; // poisons the sum with inf/NaN, as a float sum would
        return;
    }
    let bits = x.to_bits() & 0x7fff_ffff;
    let (e, m) = (bits >> 23, bits & 0x7f_ffff);
    // x = sig · 2^(s - 149)
    let (sig, s) = if e == 0 {
        (m, 0)
    } else {
        (m | 0x80_0000, e - 1)
    };
    let v = (sig as u64) << (s % 24);
    let j = (s / 24) as usize;
    acc[j] += (v & 0xff_ffff) as f64;
    acc[j + 1] += (v >> 24) as f64;
}

/// The f32 nearest (up to double rounding) to an exact sum; a pure function of the value.
fn exact_value(acc: &[f64]) -> f32 {
    if acc.iter().any(|x| !x.is_finite()) {
        return acc.iter().sum::<f64>() as f32;
    }
    // Normalise carries so equal values have equal limbs, then add from the top.
    let (mut digits, mut carry) = ([0u64; LIMBS + 2], 0u64);
    for (d, &a) in digits.iter_mut().zip(acc.iter().chain([0.0, 0.0].iter())) {
        let t = a as u64 + carry;
        *d = t & 0xff_ffff;
        carry = t >> 24;
    }
    let mut v = 0f64;
    for (j, &d) in digits.iter().enumerate().rev() {
        v += d as f64 * 2f64.powi(24 * j as i32 - 149);
    }
    v as f32
}
