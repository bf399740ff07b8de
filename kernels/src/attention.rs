//! Causal multi-head self-attention (scale 1/sqrt(hs)), materialising the probabilities.

use crate::Float;
use crate::math::{BLOCK, dot, exp, view};
use crate::par::{SharedMut, for_ranges};
use crate::simd;

/// Longest sequence supported (GPT-2's context): one row of scores lives on the stack.
pub const MAX_T: usize = 1024;

/// Shapes of one call: batch, sequence length, channels and heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

impl AttentionDims {
    fn hs(&self) -> usize {
        self.c / self.nh
    }
    fn check(&self, qkv: usize, out: usize, att: usize) {
        let AttentionDims { b, t, c, nh } = *self;
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

/// Rows `i` of one head's part of a tensor, as f32: strided views of the tensor itself when
/// it is f32, else rows widened once into a scratch buffer.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    start: usize,
    stride: usize,
    len: usize,
}

impl<'a> Rows<'a> {
    /// Rows `start + i·stride .. + len` of `src` for `i < n`, widening into `buf` if needed.
    #[inline(always)]
    fn new<X: Float>(
        src: &'a [X],
        (start, stride, len): (usize, usize, usize),
        n: usize,
        buf: &'a mut [f32],
    ) -> Rows<'a> {
        match X::as_f32(src) {
            Some(data) => Rows {
                data,
                start,
                stride,
                len,
            },
            None => {
                for (i, dst) in buf[..n * len].chunks_exact_mut(len).enumerate() {
                    X::cast_to_f32(&src[start + i * stride..][..len], dst);
                }
                Rows {
                    data: &buf[..n * len],
                    start: 0,
                    stride: len,
                    len,
                }
            }
        }
    }

    #[inline(always)]
    fn row(&self, i: usize) -> &'a [f32] {
        &self.data[self.start + i * self.stride..][..self.len]
    }
}

/// Scratch for `parts` widened `(T, hs)` head slices, empty when `X` is f32.
fn scratch<X: Float>(parts: usize, d: &AttentionDims) -> Vec<f32> {
    match X::as_f32(&[]) {
        Some(_) => Vec::new(),
        None => vec![0f32; parts * d.t * d.hs()],
    }
}

/// Forward: `out (B, T, C)` and `att (B, NH, T, T)`, the softmax probabilities (0 above the
/// diagonal), from `qkv (B, T, 3C)` laid out `[q | k | v]`, head h in columns `h·hs..(h+1)·hs`.
///
/// One task per (b, h). Unless `X` is f32, each task widens its head's keys and values once
/// into `2·T·hs` f32 of heap scratch.
pub fn attention_forward<X: Float>(out: &mut [X], att: &mut [X], qkv: &[X], d: AttentionDims) {
    d.check(qkv.len(), out.len(), att.len());
    let (t_len, hs, scale) = (d.t, d.hs(), 1.0 / (d.hs() as f32).sqrt());
    let (out, att) = (SharedMut::new(out), SharedMut::new(att));
    for_ranges(d.b * d.nh, 1, |heads| {
        let mut buf = scratch::<X>(2, &d);
        for bh in heads {
            let (b, h) = (bh / d.nh, bh % d.nh);
            let half = buf.len() / 2;
            let (kb, vb) = buf.split_at_mut(half);
            let rows = |p| (d.at(b, 0, p, h), 3 * d.c, hs);
            let (k, v) = (
                Rows::new(qkv, rows(1), t_len, kb),
                Rows::new(qkv, rows(2), t_len, vb),
            );
            simd::dispatch(
                #[inline(always)]
                || {
                    let (mut qb, mut o) = ([0f32; BLOCK], [0f32; BLOCK]);
                    let mut s = [0f32; MAX_T];
                    for t in 0..t_len {
                        let row = bh * t_len + t;
                        let q = view(&qkv[d.at(b, t, 0, h)..][..hs], &mut qb);
                        let mut max = f32::NEG_INFINITY;
                        for (t2, s) in s[..=t].iter_mut().enumerate() {
                            *s = dot(q, k.row(t2)) * scale;
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
                            o[..hs]
                                .iter_mut()
                                .zip(v.row(t2))
                                .for_each(|(o, v)| *o += *s * v);
                        }
                        s[t + 1..t_len].fill(0.0);
                        // SAFETY: row (b, h, t) of att and head h of out at (b, t) belong to
                        // this task only.
                        let (a, y) = unsafe {
                            (
                                att.slice(row * t_len..(row + 1) * t_len),
                                out.slice(span(d.out_at(b, t, h), hs)),
                            )
                        };
                        X::cast_from_f32(&s[..t_len], a);
                        X::cast_from_f32(&o[..hs], y);
                    }
                },
            )
        }
    });
}

/// Backward: `dqkv (B, T, 3C)` (overwritten) from `dout (B, T, C)`, the forward's `qkv` and
/// `att`; `datt (B, NH, T, T)` is f32 scratch (left holding ∂L/∂scores).
///
/// One task per (b, h). Unless `X` is f32, each task widens its head's queries, keys, values
/// and output gradients once into `4·T·hs` f32 of heap scratch.
pub fn attention_backward<X: Float>(
    dqkv: &mut [X],
    datt: &mut [f32],
    dout: &[X],
    qkv: &[X],
    att: &[X],
    d: AttentionDims,
) {
    d.check(qkv.len(), dout.len(), att.len());
    assert!(
        dqkv.len() == qkv.len() && datt.len() == att.len(),
        "dqkv must be (B, T, 3C), datt (B, NH, T, T)"
    );
    let (t_len, hs, scale) = (d.t, d.hs(), 1.0 / (d.hs() as f32).sqrt());
    let (dq, ds) = (SharedMut::new(dqkv), SharedMut::new(datt));
    for_ranges(d.b * d.nh, 1, |heads| {
        let mut buf = scratch::<X>(4, &d);
        for bh in heads {
            let (b, h) = (bh / d.nh, bh % d.nh);
            let part = buf.len() / 4;
            let (qb, rest) = buf.split_at_mut(part);
            let (kb, rest) = rest.split_at_mut(part);
            let (vb, yb) = rest.split_at_mut(part);
            let rows = |p| (d.at(b, 0, p, h), 3 * d.c, hs);
            let (q, k, v) = (
                Rows::new(qkv, rows(0), t_len, qb),
                Rows::new(qkv, rows(1), t_len, kb),
                Rows::new(qkv, rows(2), t_len, vb),
            );
            let dy = Rows::new(dout, (d.out_at(b, 0, h), d.c, hs), t_len, yb);
            let head = bh * t_len; // row index of (b, h, 0)
            // SAFETY: rows (b, h, ·) of datt and head h of dqkv at (b, ·) belong to this task.
            let s_head = unsafe { ds.slice(head * t_len..(head + t_len) * t_len) };
            let grad = |t: usize, p: usize| unsafe { dq.slice(span(d.at(b, t, p, h), hs)) };
            simd::dispatch(
                #[inline(always)]
                || {
                    let mut g = [0f32; BLOCK];
                    let mut a = [0f32; MAX_T];
                    // Per query row t: ∂L/∂scores = att ⊙ (datt - Σ att·datt), dq = scale · Σ ds·k.
                    for t in 0..t_len {
                        let s = &mut s_head[t * t_len..(t + 1) * t_len];
                        let dyt = dy.row(t);
                        X::cast_to_f32(&att[(head + t) * t_len..][..=t], &mut a[..=t]);
                        let mut total = 0.0;
                        for t2 in 0..=t {
                            s[t2] = dot(dyt, v.row(t2));
                            total += a[t2] * s[t2];
                        }
                        g[..hs].fill(0.0);
                        for t2 in 0..=t {
                            s[t2] = a[t2] * (s[t2] - total);
                            g[..hs]
                                .iter_mut()
                                .zip(k.row(t2))
                                .for_each(|(g, k)| *g += s[t2] * k);
                        }
                        s[t + 1..].fill(0.0);
                        g[..hs].iter_mut().for_each(|g| *g *= scale);
                        X::cast_from_f32(&g[..hs], grad(t, 0));
                    }
                    // Per key row t2: dk = scale · Σ_t ds[t, t2] · q[t], dv = Σ_t att[t, t2] · dout[t].
                    let (mut gk, mut gv) = ([0f32; BLOCK], [0f32; BLOCK]);
                    for t2 in 0..t_len {
                        gk[..hs].fill(0.0);
                        gv[..hs].fill(0.0);
                        for t in t2..t_len {
                            let (w, p) = (
                                s_head[t * t_len + t2],
                                att[(head + t) * t_len + t2].to_f32(),
                            );
                            gk[..hs]
                                .iter_mut()
                                .zip(q.row(t))
                                .for_each(|(g, q)| *g += w * q);
                            gv[..hs]
                                .iter_mut()
                                .zip(dy.row(t))
                                .for_each(|(g, y)| *g += p * y);
                        }
                        gk[..hs].iter_mut().for_each(|g| *g *= scale);
                        X::cast_from_f32(&gk[..hs], grad(t2, 1));
                        X::cast_from_f32(&gv[..hs], grad(t2, 2));
                    }
                },
            )
        }
    });
}

fn span(start: usize, len: usize) -> std::ops::Range<usize> {
    start..start + len
}
