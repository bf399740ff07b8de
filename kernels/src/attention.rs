//! Causal self-attention (scale 1/sqrt(hs)), tiled as FlashAttention-2: GPT-2's multi-head
//! attention on a packed `qkv`, and grouped-query attention (Llama) on separate q, k, v, where
//! each key/value head serves a group of query heads. Both run one implementation, which reads
//! every operand by head rows (start and row stride).
//!
//! Nothing of size T² is kept: the forward stores each query row's log-sum-exp of scores
//! (`lse`), from which the backward recomputes the probabilities tile by tile. A task works on
//! `TILE × TILE` blocks of scores in f32 scratch (a few tiles, in L2), computed as small
//! matrix products whose vector lanes run along a tile, so no sum is horizontal; every sum
//! runs in one fixed order within one task, so the bits do not depend on the thread count.
//! bf16 on a CPU with AVX512-BF16 runs those products on `matmul`'s bf16 dot-product kernels
//! (`vdpbf16ps`, or AMX tiles) instead, with f32 accumulation ([`Dot`]).

use crate::Float;
use crate::math::{dot, exp, view};
#[cfg(target_arch = "x86_64")]
use crate::matmul::{self, Panels, Residual, Small};
use crate::par::{SharedMut, for_ranges};
use crate::simd;
#[cfg(target_arch = "x86_64")]
use half::bf16;

/// Largest head size any back end runs (CPU stack rows, CUDA shared memory).
///
/// The memory model copies this (`scheduler::kernel_figures`; `tests/figures.rs` holds the two
/// equal): change both.
pub const MAX_HEAD_SIZE: usize = 256;

/// Query rows and key rows of one tile: a tile of f32 scores is 16 KiB, and the 5 to 8 tiles
/// of one task (at hs 64) stay in L2.
const TILE: usize = 64;
/// Rows a micro-kernel computes at once: 4 rows of 64 lanes are 16 AVX-512 accumulators.
const ROWS: usize = 4;
/// Head columns a micro-kernel computes at once, then the 16-column steps a head's rows are
/// padded to.
const WIDE: usize = 64;
const NARROW: usize = 16;

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
    /// checking their lengths.
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
    /// checking their lengths.
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

/// A head's row length in scratch: the head size rounded up to whole 16-lane steps.
fn padded(hs: usize) -> usize {
    hs.next_multiple_of(NARROW)
}

/// First row and number of rows of tile `i`.
fn span(d: &AttentionDims, i: usize) -> (usize, usize) {
    (i * TILE, TILE.min(d.t - i * TILE))
}

/// A zeroed scratch tile of one task, `TILE` rows of a padded head or of `TILE` scores.
fn tile(d: &AttentionDims) -> Vec<f32> {
    vec![0f32; TILE * padded(d.head_size).max(TILE)]
}

/// `N` of them.
fn tiles<const N: usize>(d: &AttentionDims) -> [Vec<f32>; N] {
    std::array::from_fn(|_| tile(d))
}

/// `src` widened into `dst`; f32 and bf16 (a shift) inline, so that a row of a tile costs
/// no call and no run-time dispatch.
#[inline(always)]
fn widen<X: Float>(src: &[X], dst: &mut [f32]) {
    if X::as_f32(src).is_some() || X::as_bf16(src).is_some() {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    } else {
        X::cast_to_f32(src, dst);
    }
}

impl<'a, X> Operand<'a, X> {
    /// Rows `span` = `(t0, n)` of head h of batch b.
    #[inline(always)]
    fn block<'o>(
        &'o self,
        d: &'o AttentionDims,
        bh: (usize, usize),
        span: (usize, usize),
    ) -> Block<'o, 'a, X> {
        Block {
            op: self,
            d,
            bh,
            span,
        }
    }
}

/// Rows `t0..t0 + n` (`span`) of head h of batch b (`bh`) of an operand: what a task loads.
struct Block<'o, 'a, X> {
    op: &'o Operand<'a, X>,
    d: &'o AttentionDims,
    bh: (usize, usize),
    span: (usize, usize),
}

impl<X: Float> Block<'_, '_, X> {
    /// Row t0 + i, widened into `dst` (head-size long).
    #[inline(always)]
    fn widen_row(&self, i: usize, dst: &mut [f32]) {
        let ((b, h), d) = (self.bh, self.d);
        let at = self.op.heads.at(d, b, self.span.0 + i, h);
        widen(&self.op.data[at..at + d.head_size], dst);
    }

    /// The rows, widened into rows of `dst (TILE, padded hs)` with zero padding; rows from n on
    /// keep what they held (no result read depends on them).
    #[inline(always)]
    fn widen(&self, dst: &mut [f32]) {
        let hs = self.d.head_size;
        for (i, row) in dst
            .chunks_exact_mut(padded(hs))
            .take(self.span.1)
            .enumerate()
        {
            self.widen_row(i, &mut row[..hs]);
            row[hs..].fill(0.0);
        }
    }

    /// The rows transposed into `dst (hs, TILE)`: column i is row t0 + i, columns from n on
    /// are zero.
    #[inline(always)]
    fn widen_transposed(&self, dst: &mut [f32]) {
        let (hs, n) = (self.d.head_size, self.span.1);
        let mut buf = [0f32; MAX_HEAD_SIZE];
        for i in 0..n {
            self.widen_row(i, &mut buf[..hs]);
            for (j, &x) in buf[..hs].iter().enumerate() {
                dst[j * TILE + i] = x;
            }
        }
        for column in dst[..hs * TILE].chunks_exact_mut(TILE) {
            column[n..].fill(0.0);
        }
    }
}

/// `out[r][m] = Σ_j a[r][j] · bt[j][m]` over `j < hs` in order, for rows `r < n` rounded up to
/// [`ROWS`]: `a (TILE, padded hs)`, `bt (hs, TILE)` (a tile transposed), `out (TILE, TILE)`.
#[inline(always)]
fn scores(out: &mut [f32], a: &[f32], bt: &[f32], n: usize, hs: usize) {
    let hsp = padded(hs);
    for r0 in (0..n).step_by(ROWS) {
        let mut acc = [[0f32; TILE]; ROWS];
        for (j, b) in bt[..hs * TILE].chunks_exact(TILE).enumerate() {
            let b: &[f32; TILE] = b.try_into().expect("a tile row");
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = a[(r0 + r) * hsp + j];
                for m in 0..TILE {
                    acc[m] += x * b[m];
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[(r0 + r) * TILE..][..TILE].copy_from_slice(acc);
        }
    }
}

/// `acc[m][c] += Σ_r w[r][m] · src[r][c]` over `r < n` in order, for rows `m < rows` rounded
/// up to [`ROWS`]: `acc`, `src (TILE, hsp)`, `w (TILE, TILE)`.
#[inline(always)]
fn accumulate(acc: &mut [f32], w: &[f32], src: &[f32], n: usize, rows: usize, hsp: usize) {
    for m0 in (0..rows).step_by(ROWS) {
        let mut c0 = 0;
        while c0 < hsp {
            let at = (m0, c0, hsp);
            c0 += if hsp - c0 >= WIDE {
                accumulate_block::<WIDE>(acc, w, src, n, at)
            } else {
                accumulate_block::<NARROW>(acc, w, src, n, at)
            };
        }
    }
}

/// [`accumulate`] on rows `m0..m0 + ROWS`, columns `c0..c0 + W`; returns W.
#[inline(always)]
fn accumulate_block<const W: usize>(
    acc: &mut [f32],
    w: &[f32],
    src: &[f32],
    n: usize,
    (m0, c0, hsp): (usize, usize, usize),
) -> usize {
    let mut a = [[0f32; W]; ROWS];
    for (r, a) in a.iter_mut().enumerate() {
        a.copy_from_slice(&acc[(m0 + r) * hsp + c0..][..W]);
    }
    for k in 0..n {
        let s: &[f32; W] = src[k * hsp + c0..][..W].try_into().expect("W columns");
        let wk: &[f32; ROWS] = w[k * TILE + m0..][..ROWS].try_into().expect("ROWS weights");
        for (a, &wk) in a.iter_mut().zip(wk) {
            for c in 0..W {
                a[c] += wk * s[c];
            }
        }
    }
    for (r, a) in a.iter().enumerate() {
        acc[(m0 + r) * hsp + c0..][..W].copy_from_slice(a);
    }
    W
}

/// How a task multiplies its tiles: f32 FMA tiles for any X ([`Fma`]), or bf16 dot products
/// on AVX512-BF16 or AMX ([`Dot`], bf16 only). `'a` is the operands' lifetime.
trait Products<'a, X: Float> {
    /// Rows `t0..t0 + n` of a head: the left factor of [`Products::scores`] and the right one
    /// of [`Products::accumulate`].
    type Rows;
    /// The same rows transposed: the right factor of [`Products::scores`], loaded once and used
    /// against every tile of the other side.
    type Columns;

    /// The products of one task, on its thread.
    fn new() -> Self;
    fn rows_tile(d: &AttentionDims) -> Self::Rows;
    fn columns_tile(d: &AttentionDims) -> Self::Columns;
    /// A block of rows into `dst`.
    fn rows(&self, rows: Block<'_, 'a, X>, dst: &mut Self::Rows);
    /// A block of rows into `dst`, transposed.
    fn columns(&self, rows: Block<'_, 'a, X>, dst: &mut Self::Columns);
    /// `out[r][m] = Σ_j a[r][j] · b[j][m]` over `j < hs` for rows `r < n`, lanes `m < TILE`
    /// (zero past b's columns).
    fn scores(&mut self, out: &mut [f32], a: &Self::Rows, b: &Self::Columns, n: usize, hs: usize);
    /// `acc[m][c] += Σ_r w[r][m] · src[r][c]` over `r < n`, for rows `m < rows`: `acc (TILE,
    /// padded hs)`, `w (TILE, TILE)`.
    fn accumulate(
        &mut self,
        acc: &mut [f32],
        w: &[f32],
        src: &Self::Rows,
        n: usize,
        rows: usize,
        hs: usize,
    );
}

/// f32 FMA tiles: operands widened into f32 tiles, vector lanes along a tile.
struct Fma;

impl<'a, X: Float> Products<'a, X> for Fma {
    type Rows = Vec<f32>;
    type Columns = Vec<f32>;

    fn new() -> Self {
        Fma
    }

    fn rows_tile(d: &AttentionDims) -> Vec<f32> {
        tile(d)
    }

    fn columns_tile(d: &AttentionDims) -> Vec<f32> {
        tile(d)
    }

    #[inline(always)]
    fn rows(&self, rows: Block<'_, 'a, X>, dst: &mut Vec<f32>) {
        rows.widen(dst);
    }

    #[inline(always)]
    fn columns(&self, rows: Block<'_, 'a, X>, dst: &mut Vec<f32>) {
        rows.widen_transposed(dst);
    }

    #[inline(always)]
    fn scores(&mut self, out: &mut [f32], a: &Vec<f32>, b: &Vec<f32>, n: usize, hs: usize) {
        scores(out, a, b, n, hs);
    }

    #[inline(always)]
    fn accumulate(
        &mut self,
        acc: &mut [f32],
        w: &[f32],
        src: &Vec<f32>,
        n: usize,
        rows: usize,
        hs: usize,
    ) {
        accumulate(acc, w, src, n, rows, padded(hs));
    }
}

/// bf16 dot products (`matmul::Small`): rows read where they lie, columns packed once. The
/// probabilities and their gradients, f32 tiles, go in twice, as their bf16 rounding and as
/// its [`Residual`], which keeps 16 of their bits: rounded once (as FlashAttention-2 rounds
/// them), their sums over a column of queries, which cancel, missed the bf16 tests' bound.
#[cfg(target_arch = "x86_64")]
struct Dot {
    small: Small,
    /// The right factor of `accumulate`, packed per call.
    b: Panels,
}

#[cfg(target_arch = "x86_64")]
impl<'a, X: Float> Products<'a, X> for Dot {
    type Rows = matmul::Operand<'a, bf16>;
    type Columns = Panels;

    fn new() -> Self {
        Dot {
            small: Small::new().expect("chosen where the CPU has AVX512-BF16"),
            b: Panels::default(),
        }
    }

    fn rows_tile(_: &AttentionDims) -> Self::Rows {
        matmul::Operand::new(&[], 0, false)
    }

    fn columns_tile(_: &AttentionDims) -> Panels {
        Panels::default()
    }

    #[inline(always)]
    fn rows(&self, rows: Block<'_, 'a, X>, dst: &mut Self::Rows) {
        *dst = rows.view(false);
    }

    #[inline(always)]
    fn columns(&self, rows: Block<'_, 'a, X>, dst: &mut Panels) {
        let (k, n) = (rows.d.head_size, rows.span.1);
        self.small.pack(rows.view(true), (k, n), dst);
    }

    #[inline(always)]
    fn scores(&mut self, out: &mut [f32], a: &Self::Rows, b: &Panels, n: usize, _: usize) {
        self.small.product(out, TILE, *a, n, b, false);
        for row in out.chunks_exact_mut(TILE).take(n) {
            row[b.width()..].fill(0.0);
        }
    }

    #[inline(always)]
    fn accumulate(
        &mut self,
        acc: &mut [f32],
        w: &[f32],
        src: &Self::Rows,
        n: usize,
        rows: usize,
        hs: usize,
    ) {
        self.small.pack(*src, (n, hs), &mut self.b);
        let (hi, lo) = (
            matmul::Operand::new(w, TILE, true),
            matmul::Operand::new(Residual::of(w), TILE, true),
        );
        self.small.product(acc, padded(hs), hi, rows, &self.b, true);
        self.small.product(acc, padded(hs), lo, rows, &self.b, true);
    }
}

#[cfg(target_arch = "x86_64")]
impl<'a, X: Float> Block<'_, 'a, X> {
    /// The rows as a bf16 matrix in place (or transposed), for [`Dot`].
    fn view(&self, trans: bool) -> matmul::Operand<'a, bf16> {
        let ((b, h), heads) = (self.bh, self.op.heads);
        let data = X::as_bf16(self.op.data).expect("dot products run on bf16");
        let at = heads.at(self.d, b, self.span.0, h);
        matmul::Operand::new(&data[at..], heads.stride, trans)
    }
}

/// Whether X's tiles run on bf16 dot products on this CPU.
#[cfg(target_arch = "x86_64")]
fn dot_products<X: Float>() -> bool {
    X::as_bf16(&[]).is_some() && matmul::has_bf16_dot_product()
}

/// Forward: `out (B, T, C)` and `lse (B, NH, T)`, each query row's log-sum-exp of its scaled
/// scores, from `qkv (B, T, 3C)` laid out `[q | k | v]`, head h in columns `h·hs..(h+1)·hs` of
/// each part (`d.kv_heads == d.nh`).
pub fn attention_forward<X: Float>(out: &mut [X], lse: &mut [f32], qkv: &[X], d: AttentionDims) {
    let [q, k, v, o] = d.packed(qkv.len(), out.len(), lse.len());
    let read = |heads| Operand { data: qkv, heads };
    forward(
        Output {
            data: SharedMut::new(out),
            heads: o,
        },
        lse,
        [read(q), read(k), read(v)],
        d,
    );
}

/// Grouped-query forward: `out (B, T, NH·hs)` and `lse (B, NH, T)` from `q (B, T, NH·hs)`, `k`
/// and `v (B, T, KV·hs)`; query head h attends with key/value head `h / d.group()` (as Hugging
/// Face's `repeat_kv`).
pub fn gqa_attention_forward<X: Float>(
    out: &mut [X],
    lse: &mut [f32],
    q: &[X],
    k: &[X],
    v: &[X],
    d: AttentionDims,
) {
    let [qh, kh, vh, oh] = d.separate([q.len(), k.len(), v.len(), out.len()], lse.len());
    forward(
        Output {
            data: SharedMut::new(out),
            heads: oh,
        },
        lse,
        [
            Operand { data: q, heads: qh },
            Operand { data: k, heads: kh },
            Operand { data: v, heads: vh },
        ],
        d,
    );
}

/// The forward of both layouts, one task per (b, query head, query tile): over the key tiles up
/// to the diagonal, a running maximum and sum per query row, and the output rescaled by them.
fn forward<X: Float>(
    out: Output<X>,
    lse: &mut [f32],
    operands: [Operand<'_, X>; 3],
    d: AttentionDims,
) {
    #[cfg(target_arch = "x86_64")]
    if dot_products::<X>() {
        return forward_on::<X, Dot>(out, lse, operands, d);
    }
    forward_on::<X, Fma>(out, lse, operands, d);
}

/// [`forward`] with its tile products on `P`.
fn forward_on<'a, X: Float, P: Products<'a, X>>(
    out: Output<X>,
    lse: &mut [f32],
    [q, k, v]: [Operand<'a, X>; 3],
    d: AttentionDims,
) {
    let (hs, n_tiles) = (d.head_size, d.t.div_ceil(TILE));
    let (hsp, scale) = (padded(hs), 1.0 / (hs as f32).sqrt());
    let lse = SharedMut::new(lse);
    for_ranges(d.b * d.nh * n_tiles, 1, |tasks| {
        let (mut p, qt) = (P::new(), &mut P::columns_tile(&d));
        let (kr, vr) = (&mut P::rows_tile(&d), &mut P::rows_tile(&d));
        let [s, o] = &mut tiles::<2>(&d);
        for task in tasks {
            let (bh, qi) = (task / n_tiles, task % n_tiles);
            let (b, h) = (bh / d.nh, bh % d.nh);
            let kv = (b, h / d.group());
            let (t0, nq) = span(&d, qi);
            let rows = nq.next_multiple_of(ROWS);
            simd::dispatch(
                #[inline(always)]
                || {
                    p.columns(q.block(&d, (b, h), (t0, nq)), qt);
                    // Per query row (lane i): the running maximum and sum of exp(score - max).
                    let (mut max, mut sum) = ([f32::NEG_INFINITY; TILE], [0f32; TILE]);
                    o.fill(0.0);
                    for kj in 0..=qi {
                        let keys = span(&d, kj);
                        p.rows(k.block(&d, kv, keys), kr);
                        p.rows(v.block(&d, kv, keys), vr);
                        // sᵀ: row j holds key j's scores against the tile's query rows.
                        p.scores(s, kr, qt, keys.1, hs);
                        let mut new = max;
                        for (j, s) in s.chunks_exact_mut(TILE).take(keys.1).enumerate() {
                            s.iter_mut().for_each(|s| *s *= scale);
                            if kj == qi {
                                // Key t0 + j comes after query rows t0 + i, i < j.
                                s[..j].fill(f32::NEG_INFINITY);
                            }
                            new.iter_mut().zip(&*s).for_each(|(m, s)| *m = m.max(*s));
                        }
                        let mut alpha = [0f32; TILE];
                        for i in 0..TILE {
                            alpha[i] = exp(max[i] - new[i]);
                            sum[i] *= alpha[i];
                        }
                        max = new;
                        for s in s.chunks_exact_mut(TILE).take(keys.1) {
                            for i in 0..TILE {
                                s[i] = exp(s[i] - max[i]);
                                sum[i] += s[i];
                            }
                        }
                        for (o, a) in o.chunks_exact_mut(hsp).zip(alpha).take(rows) {
                            o.iter_mut().for_each(|o| *o *= a);
                        }
                        p.accumulate(o, s, vr, keys.1, rows, hs);
                    }
                    let at = (bh * d.t) + t0;
                    // SAFETY: rows t0..t0 + nq of head h of batch b, in out and in lse, belong to
                    // this task only.
                    let lse = unsafe { lse.slice(at..at + nq) };
                    for (i, o) in o.chunks_exact_mut(hsp).take(nq).enumerate() {
                        let inv = 1.0 / sum[i];
                        o[..hs].iter_mut().for_each(|o| *o *= inv);
                        X::cast_from_f32(&o[..hs], unsafe { out.row(&d, b, t0 + i, h) });
                        lse[i] = max[i] + sum[i].ln();
                    }
                },
            )
        }
    });
}

/// Backward: `dqkv (B, T, 3C)` (overwritten) from `dout (B, T, C)` and the forward's `qkv`,
/// `out` and `lse`; `delta (B, NH, T)` is f32 scratch, left holding `rowsum(dout ∘ out)`.
pub fn attention_backward<X: Float>(
    dqkv: &mut [X],
    delta: &mut [f32],
    dout: &[X],
    qkv: &[X],
    out: &[X],
    lse: &[f32],
    d: AttentionDims,
) {
    let [q, k, v, o] = d.packed(qkv.len(), dout.len(), lse.len());
    assert!(
        dqkv.len() == qkv.len() && out.len() == dout.len() && delta.len() == lse.len(),
        "dqkv must be (B, T, 3C), out (B, T, C), delta (B, NH, T)"
    );
    let read = |heads| Operand { data: qkv, heads };
    let data = SharedMut::new(dqkv);
    let write = |heads| Output { data, heads };
    backward(
        [write(q), write(k), write(v)],
        delta,
        [dout, out].map(|data| Operand { data, heads: o }),
        [read(q), read(k), read(v)],
        lse,
        d,
    );
}

/// Grouped-query backward: `dq (B, T, NH·hs)`, `dk` and `dv (B, T, KV·hs)` (overwritten) from
/// `dout (B, T, NH·hs)` and the forward's inputs, `out` and `lse`; a key/value head's gradients
/// sum over its group of query heads (in f32, in head order, stored once). `delta (B, NH, T)`
/// is f32 scratch, left holding `rowsum(dout ∘ out)`.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_backward<X: Float>(
    dq: &mut [X],
    dk: &mut [X],
    dv: &mut [X],
    delta: &mut [f32],
    dout: &[X],
    q: &[X],
    k: &[X],
    v: &[X],
    out: &[X],
    lse: &[f32],
    d: AttentionDims,
) {
    let [qh, kh, vh, oh] = d.separate([q.len(), k.len(), v.len(), dout.len()], lse.len());
    assert!(
        dq.len() == q.len() && dk.len() == k.len() && dv.len() == v.len(),
        "dq, dk, dv must have the shapes of q, k, v"
    );
    assert!(
        out.len() == dout.len() && delta.len() == lse.len(),
        "out must be (B, T, NH·hs), delta (B, NH, T)"
    );
    let write = |x: &mut [X], heads| Output {
        data: SharedMut::new(x),
        heads,
    };
    backward(
        [write(dq, qh), write(dk, kh), write(dv, vh)],
        delta,
        [dout, out].map(|data| Operand { data, heads: oh }),
        [
            Operand { data: q, heads: qh },
            Operand { data: k, heads: kh },
            Operand { data: v, heads: vh },
        ],
        lse,
        d,
    );
}

/// The backward of both layouts, in two passes that recompute the probabilities
/// `P = exp(scale·q·kᵀ - lse)` tile by tile and write each gradient row once: dq (and delta)
/// per (b, query head, query tile), then dk and dv per (b, key/value head, key tile).
fn backward<X: Float>(
    outputs: [Output<X>; 3],
    delta: &mut [f32],
    dout_out: [Operand<'_, X>; 2],
    inputs: [Operand<'_, X>; 3],
    lse: &[f32],
    d: AttentionDims,
) {
    #[cfg(target_arch = "x86_64")]
    if dot_products::<X>() {
        return backward_on::<X, Dot>(outputs, delta, dout_out, inputs, lse, d);
    }
    backward_on::<X, Fma>(outputs, delta, dout_out, inputs, lse, d);
}

/// [`backward`] with its tile products on `P`.
fn backward_on<'a, X: Float, P: Products<'a, X>>(
    [dq, dk, dv]: [Output<X>; 3],
    delta: &mut [f32],
    [dout, out]: [Operand<'a, X>; 2],
    [q, k, v]: [Operand<'a, X>; 3],
    lse: &[f32],
    d: AttentionDims,
) {
    let (hs, n_tiles, group) = (d.head_size, d.t.div_ceil(TILE), d.group());
    let (hsp, scale) = (padded(hs), 1.0 / (hs as f32).sqrt());
    let shared = SharedMut::new(delta);
    // dS = P ∘ (dout·vᵀ - delta), dq = scale · dS·k, over the key tiles up to the diagonal.
    for_ranges(d.b * d.nh * n_tiles, 1, |tasks| {
        let (mut p, qt, yt) = (P::new(), &mut P::columns_tile(&d), &mut P::columns_tile(&d));
        let (kr, vr) = (&mut P::rows_tile(&d), &mut P::rows_tile(&d));
        let [s, dp, gq] = &mut tiles::<3>(&d);
        for task in tasks {
            let (bh, qi) = (task / n_tiles, task % n_tiles);
            let (b, h) = (bh / d.nh, bh % d.nh);
            let kv = (b, h / group);
            let (t0, nq) = span(&d, qi);
            let at = bh * d.t + t0;
            // SAFETY: rows t0..t0 + nq of head h of batch b, in delta and in dq, belong to this
            // task only.
            let delta = unsafe { shared.slice(at..at + nq) };
            simd::dispatch(
                #[inline(always)]
                || {
                    p.columns(q.block(&d, (b, h), (t0, nq)), qt);
                    p.columns(dout.block(&d, (b, h), (t0, nq)), yt);
                    let (mut lse_i, mut delta_i) = ([0f32; TILE], [0f32; TILE]);
                    let (mut yb, mut ob) = ([0f32; MAX_HEAD_SIZE], [0f32; MAX_HEAD_SIZE]);
                    for i in 0..nq {
                        let (y, o) = (
                            dout.heads.at(&d, b, t0 + i, h),
                            out.heads.at(&d, b, t0 + i, h),
                        );
                        let (y, o) = (
                            view(&dout.data[y..y + hs], &mut yb),
                            view(&out.data[o..o + hs], &mut ob),
                        );
                        delta_i[i] = dot(y, o);
                        lse_i[i] = lse[at + i];
                    }
                    delta.copy_from_slice(&delta_i[..nq]);
                    gq.fill(0.0);
                    for kj in 0..=qi {
                        let keys = span(&d, kj);
                        p.rows(k.block(&d, kv, keys), kr);
                        p.rows(v.block(&d, kv, keys), vr);
                        // Transposed, as in the forward: row j for key j, lane i for query row i.
                        p.scores(s, kr, qt, keys.1, hs);
                        p.scores(dp, vr, yt, keys.1, hs);
                        for (j, (s, dp)) in s
                            .chunks_exact_mut(TILE)
                            .zip(dp.chunks_exact(TILE))
                            .take(keys.1)
                            .enumerate()
                        {
                            for i in 0..TILE {
                                let p = exp(s[i] * scale - lse_i[i]);
                                s[i] = p * (dp[i] - delta_i[i]);
                            }
                            if kj == qi {
                                s[..j].fill(0.0);
                            }
                        }
                        p.accumulate(gq, s, kr, keys.1, nq, hs);
                    }
                    for (i, g) in gq.chunks_exact_mut(hsp).take(nq).enumerate() {
                        g[..hs].iter_mut().for_each(|g| *g *= scale);
                        // SAFETY: see delta.
                        X::cast_from_f32(&g[..hs], unsafe { dq.row(&d, b, t0 + i, h) });
                    }
                },
            )
        }
    });
    let delta = &*delta;
    // dv = Pᵀ·dout, dk = scale · dSᵀ·q, over the group's query heads in order, then the query
    // tiles from the diagonal on.
    for_ranges(d.b * d.kv_heads * n_tiles, 1, |tasks| {
        let (mut p, kt, vt) = (P::new(), &mut P::columns_tile(&d), &mut P::columns_tile(&d));
        let (qr, yr) = (&mut P::rows_tile(&d), &mut P::rows_tile(&d));
        let [s, ds, gk, gv] = &mut tiles::<4>(&d);
        for task in tasks {
            let (bg, kj) = (task / n_tiles, task % n_tiles);
            let (b, g) = (bg / d.kv_heads, bg % d.kv_heads);
            let (k0, nk) = span(&d, kj);
            simd::dispatch(
                #[inline(always)]
                || {
                    p.columns(k.block(&d, (b, g), (k0, nk)), kt);
                    p.columns(v.block(&d, (b, g), (k0, nk)), vt);
                    gk.fill(0.0);
                    gv.fill(0.0);
                    for h in g * group..(g + 1) * group {
                        for qi in kj..n_tiles {
                            let (t0, nq) = span(&d, qi);
                            p.rows(q.block(&d, (b, h), (t0, nq)), qr);
                            p.rows(dout.block(&d, (b, h), (t0, nq)), yr);
                            // Row i for query row i, lane j for key j.
                            p.scores(s, qr, kt, nq, hs);
                            p.scores(ds, yr, vt, nq, hs);
                            let at = (b * d.nh + h) * d.t + t0;
                            for (i, (s, ds)) in s
                                .chunks_exact_mut(TILE)
                                .zip(ds.chunks_exact_mut(TILE))
                                .take(nq)
                                .enumerate()
                            {
                                let (lse, delta) = (lse[at + i], delta[at + i]);
                                for j in 0..TILE {
                                    s[j] = exp(s[j] * scale - lse);
                                    ds[j] = s[j] * (ds[j] - delta);
                                }
                                if qi == kj {
                                    s[i + 1..].fill(0.0);
                                    ds[i + 1..].fill(0.0);
                                }
                            }
                            p.accumulate(gv, s, yr, nq, nk, hs);
                            p.accumulate(gk, ds, qr, nq, nk, hs);
                        }
                    }
                    for (i, (gk, gv)) in gk
                        .chunks_exact_mut(hsp)
                        .zip(gv.chunks_exact(hsp))
                        .take(nk)
                        .enumerate()
                    {
                        gk[..hs].iter_mut().for_each(|g| *g *= scale);
                        // SAFETY: rows k0..k0 + nk of key/value head g of batch b, in dk and dv,
                        // belong to this task only.
                        let (kr, vr) =
                            unsafe { (dk.row(&d, b, k0 + i, g), dv.row(&d, b, k0 + i, g)) };
                        X::cast_from_f32(&gk[..hs], kr);
                        X::cast_from_f32(&gv[..hs], vr);
                    }
                },
            )
        }
    });
}
