//! Optimizer updates of fp32 master weights.
//!
//! Every step reads gradients of any [`Float`] dtype times `grad_scale` (the trainer folds
//! 1/loss_scale, the clipping coefficient and averaging into it), updates `master` and the
//! states over the same slice (a whole buffer or a ZeRO shard) and, when `param_out` is given,
//! writes the rounded compute copy of the new master. Decoupled weight decay (PyTorch's
//! `p.mul_(1 - lr·wd)` before the update) is the elementwise steps' `decay` factor, applied in
//! the same pass (1 for none), so master is read and written once a step; the block-wise and
//! factored optimizers (8-bit Adam, Adafactor) take [`decay`] first. All updates are
//! elementwise or use fixed blocks, so they are deterministic.

mod adafactor;
mod adam8bit;

pub use adafactor::*;
pub use adam8bit::*;

use crate::Float;
use crate::math::BLOCK;
use crate::par::{SharedMut, for_ranges};
use crate::simd;

/// Elements per task.
const CHUNK: usize = 1 << 14;

/// Decoupled weight decay: `master *= factor` (typically `1 - lr·weight_decay`).
pub fn decay(master: &mut [f32], factor: f32) {
    let n = master.len();
    let m = SharedMut::new(master);
    for_ranges(n, CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let p = unsafe { m.slice(r) };
        simd::dispatch(
            #[inline(always)]
            || p.iter_mut().for_each(|p| *p *= factor),
        );
    });
}

/// Plain SGD: `p = p·decay - lr · g`.
pub fn sgd_step<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    param_out: Option<&mut [X]>,
    lr: f32,
    grad_scale: f32,
    decay: f32,
) {
    elementwise(
        master,
        grad,
        (grad_scale, decay),
        [],
        param_out,
        #[inline(always)]
        |_, p, g, _| {
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
        },
    );
}

/// SGD with momentum, PyTorch semantics with dampening 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Momentum {
    pub lr: f32,
    pub momentum: f32,
    pub nesterov: bool,
}

/// `buf = μ·buf + g`; `p = p·decay - lr · (nesterov ? g + μ·buf : buf)`. `buf` starts at
/// zero, which makes the first step `buf = g` exactly as PyTorch's.
pub fn momentum_step<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    buf: &mut [f32],
    param_out: Option<&mut [X]>,
    hp: &Momentum,
    grad_scale: f32,
    decay: f32,
) {
    let Momentum {
        lr,
        momentum: mu,
        nesterov,
    } = *hp;
    elementwise(
        master,
        grad,
        (grad_scale, decay),
        [buf],
        param_out,
        #[inline(always)]
        |_, p, g, [b]| {
            for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                *b = mu * *b + g;
                *p -= lr * if nesterov { g + mu * *b } else { *b };
            }
        },
    );
}

/// AdamW hyperparameters (PyTorch defaults apart from lr); weight decay is [`decay`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// Adam step `t ≥ 1` as PyTorch computes it: `m = β1·m + (1-β1)·g`,
/// `v = β2·v + (1-β2)·g²`, `p = p·decay - (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)` with
/// `bc_i = 1 - β_i^t` evaluated in f64 and rounded once.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    param_out: Option<&mut [X]>,
    hp: &AdamW,
    step: u64,
    grad_scale: f32,
    decay: f32,
) {
    let AdamW {
        lr,
        beta1,
        beta2,
        eps,
    } = *hp;
    let (step_size, bc2_sqrt) = bias_correction(lr, beta1, beta2, step);
    elementwise(
        master,
        grad,
        (grad_scale, decay),
        [m, v],
        param_out,
        #[inline(always)]
        |_, p, g, [m, v]| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *p -= step_size * *m / (v.sqrt() / bc2_sqrt + eps);
            }
        },
    );
}

/// `(lr / (1 - β1^t), sqrt(1 - β2^t))`, computed in f64.
pub(crate) fn bias_correction(lr: f32, beta1: f32, beta2: f32, step: u64) -> (f32, f32) {
    assert!(step >= 1, "Adam steps count from 1");
    let t = step.min(i32::MAX as u64) as i32;
    let bc1 = 1.0 - (beta1 as f64).powi(t);
    let bc2 = 1.0 - (beta2 as f64).powi(t);
    ((lr as f64 / bc1) as f32, bc2.sqrt() as f32)
}

/// Lion hyperparameters (Chen et al. 2023 defaults apart from lr).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lion {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
}

impl Default for Lion {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
        }
    }
}

/// `p = p·decay - lr · sign(β1·m + (1-β1)·g)` (sign 0 at 0), then `m = β2·m + (1-β2)·g`.
pub fn lion_step<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    m: &mut [f32],
    param_out: Option<&mut [X]>,
    hp: &Lion,
    grad_scale: f32,
    decay: f32,
) {
    let Lion { lr, beta1, beta2 } = *hp;
    elementwise(
        master,
        grad,
        (grad_scale, decay),
        [m],
        param_out,
        #[inline(always)]
        |_, p, g, [m]| {
            for ((p, &g), m) in p.iter_mut().zip(g).zip(m.iter_mut()) {
                let c = beta1 * *m + (1.0 - beta1) * g;
                let sign = if c > 0.0 {
                    1.0
                } else if c < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                *p -= lr * sign;
                *m = beta2 * *m + (1.0 - beta2) * g;
            }
        },
    );
}

/// Drive an elementwise update over fixed chunks: per block of at most [`BLOCK`] elements,
/// `master *= decay`, then `f(offset, master, grad · grad_scale, states)`, then round the new
/// master into `param_out`.
pub(crate) fn elementwise<G: Float, X: Float, const S: usize>(
    master: &mut [f32],
    grad: &[G],
    (grad_scale, decay): (f32, f32),
    states: [&mut [f32]; S],
    param_out: Option<&mut [X]>,
    f: impl Fn(usize, &mut [f32], &[f32], [&mut [f32]; S]) + Sync + Send,
) {
    let n = master.len();
    assert_eq!(grad.len(), n, "grad must match master");
    assert!(
        states.iter().all(|s| s.len() == n),
        "optimizer states must match master"
    );
    let master = SharedMut::new(master);
    let states = states.map(SharedMut::new);
    let out = param_out.map(|p| {
        assert_eq!(p.len(), n, "param_out must match master");
        SharedMut::new(p)
    });
    for_ranges(n, CHUNK, |r| {
        simd::dispatch(
            #[inline(always)]
            || {
                let mut g = [0f32; BLOCK];
                for b in r.clone().step_by(BLOCK) {
                    let blk = b..(b + BLOCK).min(r.end);
                    let g = &mut g[..blk.len()];
                    G::cast_to_f32(&grad[blk.clone()], g);
                    g.iter_mut().for_each(|g| *g *= grad_scale);
                    // SAFETY: blocks of different tasks are disjoint; each state is its own slice.
                    let p = unsafe { master.slice(blk.clone()) };
                    p.iter_mut().for_each(|p| *p *= decay);
                    f(b, p, g, states.map(|s| unsafe { s.slice(blk.clone()) }));
                    if let Some(out) = &out {
                        // SAFETY: as above.
                        X::cast_from_f32(p, unsafe { out.slice(blk.clone()) });
                    }
                }
            },
        )
    });
}
