//! GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.

use crate::Float;
use crate::math::{BLOCK, tanh, view};
use crate::par::{SharedMut, for_ranges};
use crate::simd;

const K: f32 = 0.797_884_6; // sqrt(2 / pi)
const A: f32 = 0.044_715;
/// Elements per task.
const CHUNK: usize = 1 << 14;

/// `out = gelu(inp)`, any shape.
pub fn gelu_forward<X: Float>(out: &mut [X], inp: &[X]) {
    assert_eq!(out.len(), inp.len(), "out and inp must have the same shape");
    let out = SharedMut::new(out);
    for_ranges(inp.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let out = unsafe { out.slice(r.clone()) };
        simd::dispatch(
            #[inline(always)]
            || {
                let (mut buf, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
                for (o, i) in out.chunks_mut(BLOCK).zip(inp[r].chunks(BLOCK)) {
                    let (x, y) = (view(i, &mut buf), &mut y[..i.len()]);
                    y.iter_mut()
                        .zip(x)
                        .for_each(|(y, &x)| *y = 0.5 * x * (1.0 + tanh(K * (x + A * x * x * x))));
                    X::cast_from_f32(y, o);
                }
            },
        )
    });
}

/// In place: `grad = grad · gelu'(inp)`, with `inp` the forward's input.
pub fn gelu_backward<X: Float>(grad: &mut [X], inp: &[X]) {
    assert_eq!(
        grad.len(),
        inp.len(),
        "grad and inp must have the same shape"
    );
    let grad = SharedMut::new(grad);
    for_ranges(inp.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let grad = unsafe { grad.slice(r.clone()) };
        simd::dispatch(
            #[inline(always)]
            || {
                let (mut buf, mut g) = ([0f32; BLOCK], [0f32; BLOCK]);
                for (gr, i) in grad.chunks_mut(BLOCK).zip(inp[r].chunks(BLOCK)) {
                    let (x, g) = (view(i, &mut buf), &mut g[..i.len()]);
                    X::cast_to_f32(gr, g);
                    for (g, &x) in g.iter_mut().zip(x) {
                        let th = tanh(K * (x + A * x * x * x));
                        let sech2 = 1.0 - th * th;
                        *g *= 0.5 * (1.0 + th) + 0.5 * x * sech2 * K * (1.0 + 3.0 * A * x * x);
                    }
                    X::cast_from_f32(g, gr);
                }
            },
        )
    });
}
