//! RMSNorm over the last dimension (Hugging Face's `LlamaRMSNorm`), statistics in f32: the
//! block norms of Llama-family models (rows B·T, width C) and Qwen3's per-head query/key norm
//! (rows B·T·heads, width head_dim).

use crate::Float;
use crate::normalization;

/// `out (N, C) = inp · rstd · weight` for each of the N rows, C = `weight.len()`; writes
/// `rstd (N) = 1/sqrt(mean(inp²) + eps)` for the backward.
pub fn rmsnorm_forward<X: Float>(
    out: &mut [X],
    rstd: &mut [f32],
    inp: &[X],
    weight: &[X],
    eps: f32,
) {
    normalization::forward(out, None, rstd, inp, weight, None, eps);
}

/// Backward: `dinp += ∂L/∂inp` (accumulates, as LayerNorm's), `dweight += Σ_rows dout · inp ·
/// rstd` (each block of columns summed over the rows in row order, added once).
pub fn rmsnorm_backward<X: Float>(
    dinp: &mut [X],
    dweight: &mut [X],
    dout: &[X],
    inp: &[X],
    weight: &[X],
    rstd: &[f32],
) {
    normalization::backward(dinp, Some(dweight), None, dout, inp, weight, None, rstd);
}

/// [`rmsnorm_backward`] through a frozen weight: `dinp += ∂L/∂inp` only.
pub fn rmsnorm_backward_input<X: Float>(
    dinp: &mut [X],
    dout: &[X],
    inp: &[X],
    weight: &[X],
    rstd: &[f32],
) {
    normalization::backward(dinp, None, None, dout, inp, weight, None, rstd);
}
