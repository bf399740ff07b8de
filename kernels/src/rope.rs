//! Rotary position embedding (Hugging Face's rotate-half convention over the whole head), in
//! place on queries or keys laid out `(B, T, heads, D)`.

use crate::Float;
use crate::math::BLOCK;
use crate::par::{SharedMut, for_ranges};
use crate::simd;

/// Rows (of one head at one position) per task.
const CHUNK: usize = 64;

/// Shapes of one call: sequence length, heads and head size D (even, at most 256).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    pub t: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// In place on `x (B, T, heads, D)`: with h = D/2, `(x[i], x[i+h])` becomes
/// `(x[i]·cos − x[i+h]·sin, x[i+h]·cos + x[i]·sin)` at the row's position p (its index in the
/// sequence), where `cos`, `sin` are `(T', D/2)` f32 tables, row p for position p, T' ≥ T.
pub fn rope_forward<X: Float>(x: &mut [X], cos: &[f32], sin: &[f32], d: RopeDims) {
    rotate(x, cos, sin, d, false);
}

/// Backward, in place on `dx (B, T, heads, D)`: the transposed rotation,
/// `(dy1·cos + dy2·sin, dy2·cos − dy1·sin)`.
pub fn rope_backward<X: Float>(dx: &mut [X], cos: &[f32], sin: &[f32], d: RopeDims) {
    rotate(dx, cos, sin, d, true);
}

/// Rows (of one head at one position) of an `x` of `len` elements, after checking the shapes.
pub(crate) fn check(len: usize, cos: usize, sin: usize, d: &RopeDims) -> usize {
    let RopeDims { t, heads, head_dim } = *d;
    assert!(
        head_dim > 0 && head_dim.is_multiple_of(2) && head_dim <= BLOCK,
        "head_dim {head_dim} must be even and at most {BLOCK}"
    );
    assert!(
        t > 0 && heads > 0 && len.is_multiple_of(t * heads * head_dim),
        "x must be (B, T, heads, D)"
    );
    assert!(
        cos == sin && cos >= t * head_dim / 2,
        "cos and sin must be (T, D/2) tables"
    );
    len / head_dim
}

/// Rotates every row by its position's angle, or by its negative (`back`).
fn rotate<X: Float>(x: &mut [X], cos: &[f32], sin: &[f32], d: RopeDims, back: bool) {
    let RopeDims { t, heads, head_dim } = d;
    let (rows, h) = (check(x.len(), cos.len(), sin.len(), &d), head_dim / 2);
    let x = SharedMut::new(x);
    for_ranges(rows, CHUNK, |r| {
        // SAFETY: ranges of rows are disjoint.
        let x = unsafe { x.slice(r.start * head_dim..r.end * head_dim) };
        simd::dispatch(
            #[inline(always)]
            || {
                let (mut a, mut b) = ([0f32; BLOCK / 2], [0f32; BLOCK / 2]);
                for (row, x) in r.clone().zip(x.chunks_exact_mut(head_dim)) {
                    let p = (row / heads) % t;
                    let (c, s) = (&cos[p * h..][..h], &sin[p * h..][..h]);
                    let (x1, x2) = x.split_at_mut(h);
                    X::cast_to_f32(x1, &mut a[..h]);
                    X::cast_to_f32(x2, &mut b[..h]);
                    for i in 0..h {
                        let (u, v, s) = (a[i], b[i], if back { -s[i] } else { s[i] });
                        a[i] = u * c[i] - v * s;
                        b[i] = v * c[i] + u * s;
                    }
                    X::cast_from_f32(&a[..h], x1);
                    X::cast_from_f32(&b[..h], x2);
                }
            },
        )
    });
}
