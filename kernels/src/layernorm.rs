//! LayerNorm over the last dimension (eps 1e-5), statistics in f32.

use crate::Float;
use crate::normalization;

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
    normalization::forward(out, Some(mean), rstd, inp, weight, Some(bias), EPS);
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
    normalization::backward(
        dinp,
        Some(dweight),
        Some(dbias),
        dout,
        inp,
        weight,
        Some(mean),
        rstd,
    );
}

/// [`layernorm_backward`] through a frozen weight and bias: `dinp += ∂L/∂inp` only.
pub fn layernorm_backward_input<X: Float>(
    dinp: &mut [X],
    dout: &[X],
    inp: &[X],
    weight: &[X],
    mean: &[f32],
    rstd: &[f32],
) {
    normalization::backward(dinp, None, None, dout, inp, weight, Some(mean), rstd);
}
