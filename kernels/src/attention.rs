//! Causal self-attention (scale 1/sqrt(hs)), materialising the probabilities: GPT-2's
//! multi-head attention on a packed `qkv`, and grouped-query attention (Llama) on separate
//! q, k, v, where each key/value head serves a group of query heads. Both run one
//! implementation, which reads every operand by head rows (start and row stride).

use crate::Float;
use crate::math::{BLOCK, dot, exp, view};
use crate::par::{SharedMut, for_ranges};
use crate::simd;

/// Largest head size any back end runs (CPU stack rows, CUDA shared memory).
pub const MAX_HEAD_SIZE: usize = 256;

/// Shapes of one call: batch, sequence length, query heads, key/value heads and head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub b: usize,
    pub t: usize,
    pub nh: usize,
    pub kv_heads: usize,
    pub head_size: usize,
}

impl AttentionDims {
    /// Multi-head attention over C channels (GPT-2): NH heads of C/NH columns, each with its
    /// own keys and values.
    pub fn mha(b: usize, t: usize, c: usize, nh: usize) -> AttentionDims {
        assert!(
            nh > 0 && c.is_multiple_of(nh),
            "NH = {nh} heads must divide C = {c}"
        );
        AttentionDims {
            b,
            t,
            nh,
            kv_heads: nh,
            head_size: c / nh,
        }
    }

    /// Grouped-query attention: NH query heads share `kv_heads` key/value heads
    /// (`kv_heads == nh` is multi-head attention, 1 multi-query attention).
    pub fn gqa(b: usize, t: usize, nh: usize, kv_heads: usize, head_size: usize) -> AttentionDims {
        AttentionDims {
            b,
            t,
            nh,
            kv_heads,
            head_size,
        }
    }

    /// Query heads per key/value head: query head h reads key/value head h / group.
    pub fn group(&self) -> usize {
        self.nh / self.kv_heads
    }

    /// Channels of the queries and of the output, `NH·hs`.
    pub fn q_width(&self) -> usize {
        self.nh * self.head_size
    }

    /// Channels of the keys and of the values, `KV·hs`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_size
    }

    fn check(&self, lse: usize) {
        let AttentionDims {
            b,
            t,
            nh,
            kv_heads,
            head_size,
        } = *self;
        assert!(
            kv_heads > 0 && nh > 0 && nh.is_multiple_of(kv_heads),
            "KV = {kv_heads} key/value heads must divide NH = {nh}"
        );
        assert!(
            head_size > 0 && head_size <= MAX_HEAD_SIZE,
            "head size {head_size} must be in 1..={MAX_HEAD_SIZE}"
        );
        assert_eq!(lse, b * nh * t, "lse must be (B, NH, T)");
    }

    /// Heads of the packed `qkv (B, T, 3C)` (`[q | k | v]`) and of `out (B, T, C)`, after
    /// checking their lengths and that of `lse (B, NH, T)`.
    pub(crate) fn packed(&self, qkv: usize, out: usize, lse: usize) -> [Heads; 4] {
        self.check(lse);
        assert_eq!(
            self.kv_heads, self.nh,
            "packed qkv has a key/value head per query head"
        );
        let c = self.q_width();
        let tokens = self.b * self.t;
        assert!(
            qkv == tokens * 3 * c && out == tokens * c,
            "qkv must be (B, T, 3C), out (B, T, C)"
        );
        let part = |p| Heads {
            offset: p * c,
            stride: 3 * c,
        };
        [part(0), part(1), part(2), Heads::dense(c)]
    }

    /// Heads of `q (B, T, NH·hs)`, `k`, `v (B, T, KV·hs)` and `out (B, T, NH·hs)`, after
    /// checking their lengths and that of `lse (B, NH, T)`.
    pub(crate) fn separate(&self, [q, k, v, out]: [usize; 4], lse: usize) -> [Heads; 4] {
        self.check(lse);
        let tokens = self.b * self.t;
        let (qc, kc) = (self.q_width(), self.kv_width());
        assert!(
            q == tokens * qc && out == tokens * qc,
            "q and out must be (B, T, NH·hs)"
        );
        assert!(
            k == tokens * kc && v == tokens * kc,
            "k and v must be (B, T, KV·hs)"
        );
        let (qh, kh) = (Heads::dense(qc), Heads::dense(kc));
        [qh, kh, kh, qh]
    }
}

/// Where a tensor keeps its heads: row (b, t) of head h starts at element
/// `offset + (b·T + t)·stride + h·hs`.
#[derive(Clone, Copy)]
pub(crate) struct Heads {
    offset: usize,
    stride: usize,
}

impl Heads {
    /// A tensor of its own, `(B, T, width)`.
    fn dense(width: usize) -> Heads {
        Heads {
            offset: 0,
            stride: width,
        }
    }

    fn at(self, d: &AttentionDims, b: usize, t: usize, h: usize) -> usize {
        self.offset + (b * d.t + t) * self.stride + h * d.head_size
    }

    /// The rows of head h of batch b, as [`Rows::new`] takes them.
    fn rows(self, d: &AttentionDims, b: usize, h: usize) -> (usize, usize, usize) {
        (self.at(d, b, 0, h), self.stride, d.head_size)
    }
}

/// A tensor read by heads.
#[derive(Clone, Copy)]
struct Operand<'a, X> {
    data: &'a [X],
    heads: Heads,
}

/// A tensor written by heads from several tasks, each writing rows no other task writes.
#[derive(Clone, Copy)]
struct Output<X> {
    data: SharedMut<X>,
    heads: Heads,
}

impl<X> Output<X> {
    /// # Safety
    /// Row (b, t) of head h must be written by this task only.
    unsafe fn row<'a>(self, d: &AttentionDims, b: usize, t: usize, h: usize) -> &'a mut [X] {
        let at = self.heads.at(d, b, t, h);
        // SAFETY: the caller's.
        unsafe { self.data.slice(at..at + d.head_size) }
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

    /// Head h of batch b of `x`, widening into `buf` if needed.
    #[inline(always)]
    fn head<X: Float>(
        x: Operand<'a, X>,
        d: &AttentionDims,
        b: usize,
        h: usize,
        buf: &'a mut [f32],
    ) -> Rows<'a> {
        Rows::new(x.data, x.heads.rows(d, b, h), d.t, buf)
    }

    #[inline(always)]
    fn row(&self, i: usize) -> &'a [f32] {
        &self.data[self.start + i * self.stride..][..self.len]
    }
}

/// `parts` scratch buffers of one widened `(T, hs)` head slice each, empty when `X` is f32.
fn scratch<X: Float>(parts: usize, d: &AttentionDims) -> Vec<Vec<f32>> {
    let len = match X::as_f32(&[]) {
        Some(_) => 0,
        None => d.t * d.head_size,
    };
    vec![vec![0f32; len]; parts]
}

/// Forward: `out (B, T, C)` and `att (B, NH, T, T)`, the softmax probabilities (0 above the
/// diagonal), from `qkv (B, T, 3C)` laid out `[q | k | v]`, head h in columns `h·hs..(h+1)·hs`
/// of each part (`d.kv_heads == d.nh`).
///
/// One task per (b, h). Unless `X` is f32, each task widens its head's keys and values once
/// into `2·T·hs` f32 of heap scratch.
pub fn attention_forward<X: Float>(out: &mut [X], att: &mut [X], qkv: &[X], d: AttentionDims) {
    let [q, k, v, o] = d.packed(qkv.len(), out.len(), att.len());
    let read = |heads| Operand { data: qkv, heads };
    forward(
        Output {
            data: SharedMut::new(out),
            heads: o,
        },
        att,
        [read(q), read(k), read(v)],
        d,
    );
}

/// Grouped-query forward: `out (B, T, NH·hs)` and `att (B, NH, T, T)` from `q (B, T, NH·hs)`,
/// `k` and `v (B, T, KV·hs)`; query head h attends with key/value head `h / d.group()` (as
/// Hugging Face's `repeat_kv`).
///
/// One task per (b, key/value head). Unless `X` is f32, each task widens its keys and values
/// once into `2·T·hs` f32 of heap scratch.
pub fn gqa_attention_forward<X: Float>(
    out: &mut [X],
    att: &mut [X],
    q: &[X],
    k: &[X],
    v: &[X],
    d: AttentionDims,
) {
    let [qh, kh, vh, oh] = d.separate([q.len(), k.len(), v.len(), out.len()], att.len());
    forward(
        Output {
            data: SharedMut::new(out),
            heads: oh,
        },
        att,
        [
            Operand { data: q, heads: qh },
            Operand { data: k, heads: kh },
            Operand { data: v, heads: vh },
        ],
        d,
    );
}

/// The forward of both layouts, one task per (b, key/value head) and its group of query heads.
fn forward<X: Float>(
    out: Output<X>,
    att: &mut [X],
    [q, k, v]: [Operand<'_, X>; 3],
    d: AttentionDims,
) {
    let (t_len, hs, scale) = (d.t, d.head_size, 1.0 / (d.head_size as f32).sqrt());
    let att = SharedMut::new(att);
    for_ranges(d.b * d.kv_heads, 1, |groups| {
        let mut buf = scratch::<X>(2, &d);
        for bg in groups {
            let (b, g) = (bg / d.kv_heads, bg % d.kv_heads);
            let [kb, vb] = &mut buf[..] else {
                unreachable!("two buffers")
            };
            let (k, v) = (Rows::head(k, &d, b, g, kb), Rows::head(v, &d, b, g, vb));
            simd::dispatch(
                #[inline(always)]
                || {
                    let (mut qb, mut o) = ([0f32; BLOCK], [0f32; BLOCK]);
                    let mut s = vec![0f32; t_len];
                    for h in g * d.group()..(g + 1) * d.group() {
                        for t in 0..t_len {
                            let row = (b * d.nh + h) * t_len + t;
                            let q = view(&q.data[q.heads.at(&d, b, t, h)..][..hs], &mut qb);
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
                            // SAFETY: row (b, h, t) of att and head h of out at (b, t) belong
                            // to this task only.
                            let (a, y) = unsafe {
                                (
                                    att.slice(row * t_len..(row + 1) * t_len),
                                    out.row(&d, b, t, h),
                                )
                            };
                            X::cast_from_f32(&s[..t_len], a);
                            X::cast_from_f32(&o[..hs], y);
                        }
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
    let [q, k, v, o] = d.packed(qkv.len(), dout.len(), att.len());
    assert!(
        dqkv.len() == qkv.len() && datt.len() == att.len(),
        "dqkv must be (B, T, 3C), datt (B, NH, T, T)"
    );
    let read = |heads| Operand { data: qkv, heads };
    let data = SharedMut::new(dqkv);
    let write = |heads| Output { data, heads };
    backward(
        [write(q), write(k), write(v)],
        datt,
        Operand {
            data: dout,
            heads: o,
        },
        [read(q), read(k), read(v)],
        att,
        d,
    );
}

/// Grouped-query backward: `dq (B, T, NH·hs)`, `dk` and `dv (B, T, KV·hs)` (overwritten) from
/// `dout (B, T, NH·hs)`, the forward's inputs and `att`; a key/value head's gradients sum over
/// its group of query heads (in f32, in head order, stored once). `datt (B, NH, T, T)` is f32
/// scratch (left holding ∂L/∂scores).
///
/// One task per (b, key/value head). Unless `X` is f32, each task widens its keys and values
/// and its query heads' queries and output gradients once into `(2 + 2·NH/KV)·T·hs` f32 of
/// heap scratch.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_backward<X: Float>(
    dq: &mut [X],
    dk: &mut [X],
    dv: &mut [X],
    datt: &mut [f32],
    dout: &[X],
    q: &[X],
    k: &[X],
    v: &[X],
    att: &[X],
    d: AttentionDims,
) {
    let [qh, kh, vh, oh] = d.separate([q.len(), k.len(), v.len(), dout.len()], att.len());
    assert!(
        dq.len() == q.len() && dk.len() == k.len() && dv.len() == v.len(),
        "dq, dk, dv must have the shapes of q, k, v"
    );
    assert_eq!(datt.len(), att.len(), "datt must be (B, NH, T, T)");
    let write = |x: &mut [X], heads| Output {
        data: SharedMut::new(x),
        heads,
    };
    backward(
        [write(dq, qh), write(dk, kh), write(dv, vh)],
        datt,
        Operand {
            data: dout,
            heads: oh,
        },
        [
            Operand { data: q, heads: qh },
            Operand { data: k, heads: kh },
            Operand { data: v, heads: vh },
        ],
        att,
        d,
    );
}

/// The backward of both layouts, one task per (b, key/value head) and its group of query heads.
fn backward<X: Float>(
    [dq, dk, dv]: [Output<X>; 3],
    datt: &mut [f32],
    dout: Operand<'_, X>,
    [q, k, v]: [Operand<'_, X>; 3],
    att: &[X],
    d: AttentionDims,
) {
    let (t_len, hs, group) = (d.t, d.head_size, d.group());
    let scale = 1.0 / (hs as f32).sqrt();
    let ds = SharedMut::new(datt);
    for_ranges(d.b * d.kv_heads, 1, |groups| {
        let mut buf = scratch::<X>(2 + 2 * group, &d);
        for bg in groups {
            let (b, g) = (bg / d.kv_heads, bg % d.kv_heads);
            let [kb, vb, rest @ ..] = &mut buf[..] else {
                unreachable!("2 + 2·group buffers")
            };
            let (k, v) = (Rows::head(k, &d, b, g, kb), Rows::head(v, &d, b, g, vb));
            // The group's query heads: (h, queries, output gradients).
            let heads: Vec<_> = rest
                .chunks_exact_mut(2)
                .enumerate()
                .map(|(j, pair)| {
                    let h = g * group + j;
                    let [qb, yb] = pair else {
                        unreachable!("pairs")
                    };
                    (
                        h,
                        Rows::head(q, &d, b, h, qb),
                        Rows::head(dout, &d, b, h, yb),
                    )
                })
                .collect();
            let first = (b * d.nh + g * group) * t_len; // row of (b, first head of the group, 0)
            // SAFETY: rows (b, group heads, ·) of datt, the group's heads of dq and its
            // key/value head of dk and dv at (b, ·) belong to this task.
            let s_group = unsafe { ds.slice(first * t_len..(first + group * t_len) * t_len) };
            simd::dispatch(
                #[inline(always)]
                || {
                    let mut gq = [0f32; BLOCK];
                    let mut a = vec![0f32; t_len];
                    // Per query row t: ∂L/∂scores = att ⊙ (datt - Σ att·datt), dq = scale · Σ ds·k.
                    for (j, (h, _, dy)) in heads.iter().enumerate() {
                        let head = first + j * t_len;
                        let s_head = &mut s_group[j * t_len * t_len..][..t_len * t_len];
                        for t in 0..t_len {
                            let s = &mut s_head[t * t_len..(t + 1) * t_len];
                            let dyt = dy.row(t);
                            X::cast_to_f32(&att[(head + t) * t_len..][..=t], &mut a[..=t]);
                            let mut total = 0.0;
                            for t2 in 0..=t {
                                s[t2] = dot(dyt, v.row(t2));
                                total += a[t2] * s[t2];
                            }
                            gq[..hs].fill(0.0);
                            for t2 in 0..=t {
                                s[t2] = a[t2] * (s[t2] - total);
                                gq[..hs]
                                    .iter_mut()
                                    .zip(k.row(t2))
                                    .for_each(|(g, k)| *g += s[t2] * k);
                            }
                            s[t + 1..].fill(0.0);
                            gq[..hs].iter_mut().for_each(|g| *g *= scale);
                            // SAFETY: see s_group.
                            X::cast_from_f32(&gq[..hs], unsafe { dq.row(&d, b, t, *h) });
                        }
                    }
                    // Per key row t2, over the group's heads in order, then t:
                    // dk = scale · Σ ds[t, t2] · q[t], dv = Σ att[t, t2] · dout[t].
                    let (mut gk, mut gv) = ([0f32; BLOCK], [0f32; BLOCK]);
                    for t2 in 0..t_len {
                        gk[..hs].fill(0.0);
                        gv[..hs].fill(0.0);
                        for (j, (_, q, dy)) in heads.iter().enumerate() {
                            let head = first + j * t_len;
                            for t in t2..t_len {
                                let (w, p) = (
                                    s_group[(j * t_len + t) * t_len + t2],
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
                        }
                        gk[..hs].iter_mut().for_each(|g| *g *= scale);
                        // SAFETY: see s_group.
                        let (kr, vr) = unsafe { (dk.row(&d, b, t2, g), dv.row(&d, b, t2, g)) };
                        X::cast_from_f32(&gk[..hs], kr);
                        X::cast_from_f32(&gv[..hs], vr);
                    }
                },
            )
        }
    });
}
