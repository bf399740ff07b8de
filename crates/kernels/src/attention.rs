//! Causal multi-head self-attention (scale 1/sqrt(hs)), materialising the probabilities.

use crate::Float;
use crate::math::{BLOCK, dot, exp};
use crate::par::{SharedMut, for_ranges};

/// Longest sequence supported (GPT-2's context): one row of scores lives on the stack.
pub const MAX_T: usize = 1024;
/// Rows of (b, h, t) per task.
const ROWS: usize = 8;

/// Shapes of one call: batch, sequence length, channels and heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

impl Dims {
    fn hs(&self) -> usize {
        self.c / self.nh
    }
    fn check(&self, qkv: usize, out: usize, att: usize) {
        let Dims { b, t, c, nh } = *self;
        assert!(
            nh > 0 && c.is_multiple_of(nh) && c / nh <= BLOCK,
            "head size C/NH must divide C and be <= {BLOCK}"
        );
        assert!(t <= MAX_T, "T = {t} exceeds MAX_T = {MAX_T}");
        assert!(
            qkv == b * t * 3 * c && out == b * t * c,
            "qkv must be (B, T, 3C), out (B, T, C)"
        );
        assert_eq!(att, b * nh * t * t, "att must be (B, NH, T, T)");
    }
    /// Offset in qkv of part `p` (0 q, 1 k, 2 v) of head `h` at (b, t).
    fn at(&self, b: usize, t: usize, p: usize, h: usize) -> usize {
        (b * self.t + t) * 3 * self.c + p * self.c + h * self.hs()
    }
    /// Offset in out/dout `(B, T, C)` of head `h` at (b, t).
    fn out_at(&self, b: usize, t: usize, h: usize) -> usize {
        (b * self.t + t) * self.c + h * self.hs()
    }
}

/// Forward: `out (B, T, C)` and `att (B, NH, T, T)`, the softmax probabilities (0 above the
/// diagonal), from `qkv (B, T, 3C)` laid out `[q | k | v]`, head h in columns `h·hs..(h+1)·hs`.
pub fn attention_forward<X: Float>(out: &mut [X], att: &mut [X], qkv: &[X], d: Dims) {
    d.check(qkv.len(), out.len(), att.len());
    let (t_len, hs, scale) = (d.t, d.hs(), 1.0 / (d.hs() as f32).sqrt());
    let (out, att) = (SharedMut::new(out), SharedMut::new(att));
    for_ranges(d.b * d.nh * t_len, ROWS, |rows| {
        let (mut q, mut kv, mut o) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        let mut s = [0f32; MAX_T];
        for row in rows {
            let (b, h, t) = (row / (d.nh * t_len), row / t_len % d.nh, row % t_len);
            X::cast_to_f32(&qkv[d.at(b, t, 0, h)..][..hs], &mut q[..hs]);
            let mut max = f32::NEG_INFINITY;
            for (t2, s) in s[..=t].iter_mut().enumerate() {
                X::cast_to_f32(&qkv[d.at(b, t2, 1, h)..][..hs], &mut kv[..hs]);
                *s = dot(&q[..hs], &kv[..hs]) * scale;
                max = max.max(*s);
            }
            let mut sum = 0.0;
            for s in &mut s[..=t] {
                *s = exp(*s - max);
                sum += *s;
            }
            let inv = 1.0 / sum;
            o[..hs].fill(0.0);
            for (t2, s) in s[..=t].iter_mut().enumerate() {
                *s *= inv;
                X::cast_to_f32(&qkv[d.at(b, t2, 2, h)..][..hs], &mut kv[..hs]);
                o[..hs]
                    .iter_mut()
                    .zip(&kv[..hs])
                    .for_each(|(o, v)| *o += *s * v);
            }
            s[t + 1..t_len].fill(0.0);
            // SAFETY: row (b, h, t) of att and head h of out at (b, t) belong to this row only.
            let (a, y) = unsafe {
                (
                    att.slice(row * t_len..(row + 1) * t_len),
                    out.slice(span(d.out_at(b, t, h), hs)),
                )
            };
            X::cast_from_f32(&s[..t_len], a);
            X::cast_from_f32(&o[..hs], y);
        }
    });
}

/// Backward: `dqkv (B, T, 3C)` (overwritten) from `dout (B, T, C)`, the forward's `qkv` and
/// `att`; `datt (B, NH, T, T)` is f32 scratch (left holding ∂L/∂scores).
pub fn attention_backward<X: Float>(
    dqkv: &mut [X],
    datt: &mut [f32],
    dout: &[X],
    qkv: &[X],
    att: &[X],
    d: Dims,
) {
    d.check(qkv.len(), dout.len(), att.len());
    assert!(
        dqkv.len() == qkv.len() && datt.len() == att.len(),
        "dqkv must be (B, T, 3C), datt (B, NH, T, T)"
    );
    let (t_len, hs, scale) = (d.t, d.hs(), 1.0 / (d.hs() as f32).sqrt());
    let (dq, ds) = (SharedMut::new(dqkv), SharedMut::new(datt));
    // Phase 1, per query row t: ∂L/∂scores = att ⊙ (datt - Σ att·datt) and dq = scale · Σ ds·k.
    for_ranges(d.b * d.nh * t_len, ROWS, |rows| {
        let (mut dy, mut kv, mut g) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        let mut a = [0f32; MAX_T];
        for row in rows {
            let (b, h, t) = (row / (d.nh * t_len), row / t_len % d.nh, row % t_len);
            // SAFETY: row (b, h, t) of datt and dq of head h at (b, t) belong to this row only.
            let (s, dqr) = unsafe {
                (
                    ds.slice(row * t_len..(row + 1) * t_len),
                    dq.slice(span(d.at(b, t, 0, h), hs)),
                )
            };
            X::cast_to_f32(&dout[d.out_at(b, t, h)..][..hs], &mut dy[..hs]);
            X::cast_to_f32(&att[row * t_len..][..=t], &mut a[..=t]);
            let mut total = 0.0;
            for t2 in 0..=t {
                X::cast_to_f32(&qkv[d.at(b, t2, 2, h)..][..hs], &mut kv[..hs]);
                s[t2] = dot(&dy[..hs], &kv[..hs]);
                total += a[t2] * s[t2];
            }
            g[..hs].fill(0.0);
            for t2 in 0..=t {
                s[t2] = a[t2] * (s[t2] - total);
                X::cast_to_f32(&qkv[d.at(b, t2, 1, h)..][..hs], &mut kv[..hs]);
                g[..hs]
                    .iter_mut()
                    .zip(&kv[..hs])
                    .for_each(|(g, k)| *g += s[t2] * k);
            }
            s[t + 1..].fill(0.0);
            g[..hs].iter_mut().for_each(|g| *g *= scale);
            X::cast_from_f32(&g[..hs], dqr);
        }
    });
    let ds: &[f32] = datt;
    // Phase 2, per key row t2: dk = scale · Σ_t ds[t, t2] · q[t], dv = Σ_t att[t, t2] · dout[t].
    for_ranges(d.b * d.nh * t_len, ROWS, |rows| {
        let (mut x, mut gk, mut gv) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        for row in rows {
            let (b, h, t2) = (row / (d.nh * t_len), row / t_len % d.nh, row % t_len);
            let head = row - t2; // row index of (b, h, 0)
            gk[..hs].fill(0.0);
            gv[..hs].fill(0.0);
            for t in t2..t_len {
                let (w, p) = (
                    ds[(head + t) * t_len + t2],
                    att[(head + t) * t_len + t2].to_f32(),
                );
                X::cast_to_f32(&qkv[d.at(b, t, 0, h)..][..hs], &mut x[..hs]);
                gk[..hs]
                    .iter_mut()
                    .zip(&x[..hs])
                    .for_each(|(g, q)| *g += w * q);
                X::cast_to_f32(&dout[d.out_at(b, t, h)..][..hs], &mut x[..hs]);
                gv[..hs]
                    .iter_mut()
                    .zip(&x[..hs])
                    .for_each(|(g, y)| *g += p * y);
            }
            gk[..hs].iter_mut().for_each(|g| *g *= scale);
            // SAFETY: dk and dv of head h at (b, t2) belong to this row only.
            let (dk, dv) = unsafe {
                (
                    dq.slice(span(d.at(b, t2, 1, h), hs)),
                    dq.slice(span(d.at(b, t2, 2, h), hs)),
                )
            };
            X::cast_from_f32(&gk[..hs], dk);
            X::cast_from_f32(&gv[..hs], dv);
        }
    });
}

fn span(start: usize, len: usize) -> std::ops::Range<usize> {
    start..start + len
}
