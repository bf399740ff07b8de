//! Residual additions, and scaling by a constant (a LoRA adapter's alpha/rank).

use crate::Float;
use crate::math::BLOCK;
use crate::par::{SharedMut, for_ranges};

const CHUNK: usize = 1 << 14;

/// `out = a + b`, any shape.
pub fn residual_forward<X: Float>(out: &mut [X], a: &[X], b: &[X]) {
    assert!(
        out.len() == a.len() && a.len() == b.len(),
        "out, a and b must have the same shape"
    );
    let out = SharedMut::new(out);
    for_ranges(a.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let out = unsafe { out.slice(r.clone()) };
        add_blocks(out, &a[r.clone()], &b[r]);
    });
}

/// `a += b`, any shape.
pub fn residual_accumulate<X: Float>(a: &mut [X], b: &[X]) {
    assert_eq!(a.len(), b.len(), "a and b must have the same shape");
    let a = SharedMut::new(a);
    for_ranges(b.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let a = unsafe { a.slice(r.clone()) };
        let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
        for (a, b) in a.chunks_mut(BLOCK).zip(b[r].chunks(BLOCK)) {
            let n = a.len();
            X::cast_to_f32(a, &mut x[..n]);
            X::cast_to_f32(b, &mut y[..n]);
            x[..n].iter_mut().zip(&y[..n]).for_each(|(x, y)| *x += y);
            X::cast_from_f32(&x[..n], a);
        }
    });
}

/// `x *= s`, any shape, rounded once per element.
pub fn scale<X: Float>(x: &mut [X], s: f32) {
    let len = x.len();
    let x = SharedMut::new(x);
    for_ranges(len, CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let x = unsafe { x.slice(r) };
        let mut v = [0f32; BLOCK];
        for x in x.chunks_mut(BLOCK) {
            let n = x.len();
            X::cast_to_f32(x, &mut v[..n]);
            v[..n].iter_mut().for_each(|v| *v *= s);
            X::cast_from_f32(&v[..n], x);
        }
    });
}

fn add_blocks<X: Float>(out: &mut [X], a: &[X], b: &[X]) {
    let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
    for ((o, a), b) in out
        .chunks_mut(BLOCK)
        .zip(a.chunks(BLOCK))
        .zip(b.chunks(BLOCK))
    {
        let n = o.len();
        X::cast_to_f32(a, &mut x[..n]);
        X::cast_to_f32(b, &mut y[..n]);
        x[..n].iter_mut().zip(&y[..n]).for_each(|(x, y)| *x += y);
        X::cast_from_f32(&x[..n], o);
    }
}
