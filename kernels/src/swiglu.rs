//! SwiGLU, the gated MLP activation of Llama-family models: `silu(gate) · up`, with
//! `silu(g) = g·σ(g)`.

use crate::Float;
use crate::math::{BLOCK, exp, view};
use crate::par::{SharedMut, for_ranges};
use crate::simd;

/// Elements per task.
const CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + exp(-g))
}

/// `out = silu(gate) · up`, any shape.
pub fn swiglu_forward<X: Float>(out: &mut [X], gate: &[X], up: &[X]) {
    assert!(
        out.len() == gate.len() && gate.len() == up.len(),
        "out, gate and up must have the same shape"
    );
    let out = SharedMut::new(out);
    for_ranges(gate.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let out = unsafe { out.slice(r.clone()) };
        simd::dispatch(
            #[inline(always)]
            || {
                let (mut gb, mut ub, mut y) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
                let blocks = gate[r.clone()].chunks(BLOCK).zip(up[r].chunks(BLOCK));
                for (o, (g, u)) in out.chunks_mut(BLOCK).zip(blocks) {
                    let (g, u, y) = (view(g, &mut gb), view(u, &mut ub), &mut y[..o.len()]);
                    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                        *y = g * sigmoid(g) * u;
                    }
                    X::cast_from_f32(y, o);
                }
            },
        )
    });
}

/// Backward, in place: `dup` holds ∂loss/∂out on entry (where the down projection's backward
/// wrote it, beside `dgate`, sparing a buffer of its size) and `dup = dout · silu(gate)` on
/// exit; `dgate = dout · up · σ(gate)·(1 + gate·(1 − σ(gate)))` is overwritten.
pub fn swiglu_backward<X: Float>(dgate: &mut [X], dup: &mut [X], gate: &[X], up: &[X]) {
    let n = gate.len();
    assert!(
        dgate.len() == n && dup.len() == n && up.len() == n,
        "dgate, dup, gate and up must have the same shape"
    );
    let (dgate, dup) = (SharedMut::new(dgate), SharedMut::new(dup));
    for_ranges(n, CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let (dg, du) = unsafe { (dgate.slice(r.clone()), dup.slice(r.clone())) };
        simd::dispatch(
            #[inline(always)]
            || {
                let (mut gb, mut ub, mut y) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
                let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
                let inputs = gate[r.clone()].chunks(BLOCK).zip(up[r].chunks(BLOCK));
                for ((dg, du), (g, u)) in dg.chunks_mut(BLOCK).zip(du.chunks_mut(BLOCK)).zip(inputs)
                {
                    let m = dg.len();
                    let (g, u) = (view(g, &mut gb), view(u, &mut ub));
                    X::cast_to_f32(du, &mut y[..m]);
                    for i in 0..m {
                        let s = sigmoid(g[i]);
                        a[i] = y[i] * u[i] * (s * (1.0 + g[i] * (1.0 - s)));
                        b[i] = y[i] * (g[i] * s);
                    }
                    X::cast_from_f32(&a[..m], dg);
                    X::cast_from_f32(&b[..m], du);
                }
            },
        )
    });
}
