//! Dense layers: `out = inp · W + bias` and its backward, on the `gemm` crate's f32 kernels
//! (AVX-512 with the `x86-v4` feature, chosen at run time).
//!
//! f32 operands go to `sgemm` in place through strides. f16/bf16 operands are widened tile by
//! tile into the caller's `scratch` and multiplied by the same `sgemm`; results that are not
//! f32 accumulate in an f32 tile and are rounded once. Each output element is produced by one
//! thread with a fixed k order (gemm splits only rows/columns across threads, its k blocking
//! depends on the shapes alone), so results do not depend on the pool size. On CPUs with
//! AVX512-BF16, products of two bf16 operands run on `vdpbf16ps` instead (`dpbf16`): the
//! same f32 multiply-add chain in k order at twice the rate (bit-identical to the sgemm path
//! when the depth fits one of gemm's depth blocks, ≤ 512); on CPUs with AMX, on its tiles
//! (`amx`: the same products, summed per 32 of depth before they reach the accumulator). There
//! an f32 A beside a bf16 B (the LM head's dlogits, in both of its backward products) is
//! rounded to bf16 as it is packed, as autocast and the CUDA back end round it.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod dpbf16;
mod workspace;

#[cfg(target_arch = "x86_64")]
pub(crate) use dpbf16::{Panels, Residual, Small};

use crate::Float;
use crate::math::BLOCK;
use gemm::Parallelism;
use rayon::prelude::*;

pub use workspace::{Allocator, Workspace};

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `(K, N)` row-major, used as `x·W` (Hugging Face Conv1D: c_attn, c_proj, c_fc).
    KN,
    /// `(N, K)` row-major, used as `x·Wᵀ` (the LM head tied to wte `(V, C)`).
    NK,
}

/// Whether [`matmul_backward`] overwrites `dinp` or adds to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DinpMode {
    /// `dinp = dout · Wᵀ`.
    Overwrite,
    /// `dinp += dout · Wᵀ`: layers that read one input (Llama's q, k, v projections; gate and
    /// up) add their input gradients into one buffer, rounded once per layer.
    Accumulate,
}

/// Preferred tile sizes (rows, depth, columns) when the scratch allows them. Rows are tiled
/// even when nothing is widened: `gemm` computes a row-major product as its transpose and
/// packs our rows into a buffer it allocates per call, as many as the L3 cache holds (26 MB
/// for GPT-2's LM head weight gradient on a 32 MiB L3), outside every buffer the memory model
/// counts; tiled, it is bounded ([`GemmWorkspace`]).
///
/// The memory model copies the tiles, the slack and the depth block below
/// (`scheduler::kernel_figures`; `tests/figures.rs` holds them equal): change both.
const TILE: (usize, usize, usize) = (512, 1024, 1024);

/// Rows beyond a tile that gemm's panel rounding may pack, on either operand (its widest
/// register panel is 48 rows).
const PANEL_SLACK: usize = 64;

/// The most depth `gemm` packs at once on x86-64 (its `kc`: 512 unless the product is
/// shallower, then split evenly), which with [`TILE`]'s rows bounds its pack.
const GEMM_DEPTH_BLOCK: usize = 512;
/// Smallest tile edge; scratch shorter than `3 · 16²` cannot hold one tile of each operand.
const MIN_EDGE: usize = 16;

/// Shortest `scratch` any matmul accepts (f32 elements). Results are reproducible for a given
/// scratch length; a longer scratch gives larger tiles (faster) and may change the rounding of
/// f16/bf16 results, never of f32 ones.
pub const MIN_SCRATCH: usize = 3 * MIN_EDGE * MIN_EDGE;

/// Scratch length (f32 elements) for full-size tiles of an `(M, K) · (K, N)` product, the
/// largest any of its forward/backward calls can use. f32-only calls need none.
pub fn scratch_len(m: usize, k: usize, n: usize) -> usize {
    // Forward, dinp and the two dweight products, each with every operand widened.
    [(m, k, n), (m, n, k), (k, m, n), (n, m, k)]
        .into_iter()
        .map(|(m, k, n)| {
            need(
                [m.min(TILE.0), k.clamp(1, TILE.1), n.min(TILE.2)],
                (true, true, true),
            )
        })
        .max()
        .unwrap_or(0)
}

/// Forward: `out (M, N) = inp (M, K) · W + bias`.
///
/// `weight` is `(K, N)` for [`Layout::KN`] or `(N, K)` for [`Layout::NK`]; `bias` is `(N)`.
/// `out` is `X` or `f32` (logits). `scratch` needs [`MIN_SCRATCH`] elements unless every
/// operand is f32 (then it may be empty); see [`scratch_len`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<X: Float, Y: Float>(
    out: &mut [Y],
    inp: &[X],
    weight: &[X],
    bias: Option<&[X]>,
    layout: Layout,
    (m, k, n): (usize, usize, usize),
    scratch: &mut [f32],
) {
    assert_eq!(out.len(), m * n, "out must be (M, N)");
    assert_eq!(inp.len(), m * k, "inp must be (M, K)");
    assert_eq!(weight.len(), k * n, "weight must hold K·N elements");
    let w = match layout {
        Layout::KN => Operand::new(weight, n, false),
        Layout::NK => Operand::new(weight, k, true),
    };
    let init = match bias {
        Some(b) => {
            assert_eq!(b.len(), n, "bias must be (N)");
            Init::Bias(b)
        }
        None => Init::Zero,
    };
    product(
        out,
        Operand::new(inp, k, false),
        w,
        (m, k, n),
        init,
        scratch,
    );
}

/// Backward of [`matmul_forward`]: `dinp (M, K) = dout · Wᵀ` (overwritten, or added to with
/// [`DinpMode::Accumulate`]),
/// `dweight += inpᵀ · dout` in the layout of `weight` and `dbias (N) +=` column sums of `dout`.
///
/// `dout (M, N)` is `X` or `f32` (dlogits). Scratch as for [`matmul_forward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<X: Float, G: Float>(
    dinp: &mut [X],
    dweight: &mut [X],
    dbias: Option<&mut [X]>,
    dout: &[G],
    inp: &[X],
    weight: &[X],
    layout: Layout,
    (m, k, n): (usize, usize, usize),
    dinp_mode: DinpMode,
    scratch: &mut [f32],
) {
    matmul_backward_input(dinp, dout, weight, layout, (m, k, n), dinp_mode, scratch);
    matmul_backward_weight(dweight, dout, inp, layout, (m, k, n), scratch);
    if let Some(db) = dbias {
        assert_eq!(db.len(), n, "dbias must be (N)");
        column_sums(db, dout, n);
    }
}

/// Backward of [`matmul_forward`] through a frozen weight (LoRA's base): `dinp (M, K) = dout · Wᵀ`
/// only, as [`matmul_backward`] computes it, and no weight or bias gradient.
pub fn matmul_backward_input<X: Float, G: Float>(
    dinp: &mut [X],
    dout: &[G],
    weight: &[X],
    layout: Layout,
    (m, k, n): (usize, usize, usize),
    dinp_mode: DinpMode,
    scratch: &mut [f32],
) {
    assert_eq!(dinp.len(), m * k, "dinp must be (M, K)");
    assert_eq!(dout.len(), m * n, "dout must be (M, N)");
    assert_eq!(weight.len(), k * n, "weight must hold K·N elements");
    let dy = Operand::new(dout, n, false);
    let init = match dinp_mode {
        DinpMode::Overwrite => Init::<X>::Zero,
        DinpMode::Accumulate => Init::Read,
    };
    let w = match layout {
        Layout::KN => Operand::new(weight, n, true),
        Layout::NK => Operand::new(weight, k, false),
    };
    product(dinp, dy, w, (m, n, k), init, scratch);
}

/// The weight's part of [`matmul_backward`]: `dweight += inpᵀ · dout` in the layout of the
/// weight, and no input gradient (LoRA's A under dropout, whose input gradient is masked first).
pub fn matmul_backward_weight<X: Float, G: Float>(
    dweight: &mut [X],
    dout: &[G],
    inp: &[X],
    layout: Layout,
    (m, k, n): (usize, usize, usize),
    scratch: &mut [f32],
) {
    assert_eq!(dweight.len(), k * n, "dweight must hold K·N elements");
    assert_eq!(inp.len(), m * k, "inp must be (M, K)");
    assert_eq!(dout.len(), m * n, "dout must be (M, N)");
    let dy = Operand::new(dout, n, false);
    match layout {
        Layout::KN => {
            let xt = Operand::new(inp, k, true);
            product(dweight, xt, dy, (k, m, n), Init::<X>::Read, scratch);
        }
        Layout::NK => {
            let dyt = Operand::new(dout, n, true);
            let x = Operand::new(inp, k, false);
            product(dweight, dyt, x, (n, m, k), Init::<X>::Read, scratch);
        }
    }
}

/// `db[j] += Σ_i dout[i, j]`, each column summed in row order on one thread.
fn column_sums<X: Float, G: Float>(db: &mut [X], dout: &[G], n: usize) {
    const W: usize = BLOCK;
    db.par_chunks_mut(W).enumerate().for_each(|(c, db)| {
        let (j0, w) = (c * W, db.len());
        let (mut acc, mut row) = ([0f32; W], [0f32; W]);
        for r in dout.chunks_exact(n) {
            G::cast_to_f32(&r[j0..j0 + w], &mut row[..w]);
            acc.iter_mut().zip(&row[..w]).for_each(|(a, x)| *a += x);
        }
        for (d, a) in db.iter_mut().zip(acc) {
            *d = X::from_f32(d.to_f32() + a);
        }
    });
}

/// A row-major matrix `data` with leading dimension `ld`, used as itself or transposed.
pub(crate) struct Operand<'a, T> {
    data: &'a [T],
    ld: usize,
    trans: bool,
}

// Manual impls: a derive would require `T: Copy`.
impl<T> Clone for Operand<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Operand<'_, T> {}

impl<'a, T> Operand<'a, T> {
    pub(crate) fn new(data: &'a [T], ld: usize, trans: bool) -> Self {
        Self { data, ld, trans }
    }

    /// The operand from logical element (i0, j0) on: a block of depth cut from its start.
    fn from(&self, i0: usize, j0: usize) -> Self {
        Self::new(&self.data[self.offset(i0, j0)..], self.ld, self.trans)
    }

    /// Strides (row, column) of the logical matrix in `data`.
    fn strides(&self) -> (isize, isize) {
        if self.trans {
            (1, self.ld as isize)
        } else {
            (self.ld as isize, 1)
        }
    }

    /// Offset of logical element (i, j).
    fn offset(&self, i: usize, j: usize) -> usize {
        if self.trans {
            j * self.ld + i
        } else {
            i * self.ld + j
        }
    }
}

impl<T: Float> Operand<'_, T> {
    /// Widen the logical block rows `i0..i0+r`, cols `j0..j0+c` into `buf`, copying source rows
    /// as they lie; returns the block's strides in `buf`.
    fn widen(
        &self,
        (i0, j0): (usize, usize),
        (r, c): (usize, usize),
        buf: &mut [f32],
    ) -> (isize, isize) {
        let (rows, len, s0, t0) = if self.trans {
            (c, r, j0, i0)
        } else {
            (r, c, i0, j0)
        };
        let ld = self.ld;
        buf[..rows * len]
            .par_chunks_mut(len)
            .enumerate()
            .for_each(|(s, dst)| {
                let start = (s0 + s) * ld + t0;
                T::cast_to_f32(&self.data[start..start + len], dst);
            });
        if self.trans {
            (1, len as isize)
        } else {
            (len as isize, 1)
        }
    }
}

/// What the output holds before the product is added.
enum Init<'a, B> {
    Zero,
    Bias(&'a [B]),
    /// Accumulate into the existing values.
    Read,
}

/// Whether products of two bf16 operands run on `vdpbf16ps` (or AMX tiles) on this CPU (else
/// on the widening sgemm path).
pub fn has_bf16_dot_product() -> bool {
    #[cfg(target_arch = "x86_64")]
    return dpbf16::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Scratch (f32) that keeps the bf16 dot-product packs of a product `depth` deep in the
/// scratch, on any CPU: one B panel and one row block (64 dwords per pair on AMX, in steps of
/// 32 of depth). A shorter scratch than this (and than [`MIN_SCRATCH`]) still works; those
/// packs then go to the heap.
///
/// The memory model copies this (`scheduler::kernel_figures`; `tests/figures.rs` holds the two
/// equal): change both.
pub fn packs_len(depth: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    return dpbf16::packs_len(depth);
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Whether those products run on AMX tiles on this CPU.
pub fn has_bf16_tiles() -> bool {
    #[cfg(target_arch = "x86_64")]
    return dpbf16::available() && amx::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `c (m, n) = init + op(a) (m, k) · op(b) (k, n)`, `c` row-major.
fn product<A: Float, B: Float, C: Float, I: Float>(
    c: &mut [C],
    a: Operand<'_, A>,
    b: Operand<'_, B>,
    (m, k, n): (usize, usize, usize),
    init: Init<'_, I>,
    scratch: &mut [f32],
) {
    if m == 0 || n == 0 {
        return;
    }
    // A product without depth is its `init`, which the widening path writes.
    #[cfg(target_arch = "x86_64")]
    if let Some(bb) = B::as_bf16(b.data)
        && k > 0
        && dpbf16::available()
    {
        // Same contract as the widening path, whichever kernel the CPU gets.
        assert!(
            scratch.len() >= MIN_SCRATCH,
            "matmul scratch of {} f32 is too short for ({m}, {k}) · ({k}, {n}); at least {MIN_SCRATCH} needed",
            scratch.len()
        );
        let b = Operand::new(bb, b.ld, b.trans);
        if let Some(ab) = A::as_bf16(a.data) {
            let a = Operand::new(ab, a.ld, a.trans);
            return dpbf16::product(c, a, b, (m, k, n), init, scratch);
        }
        // The LM head's f32 dlogits beside bf16 weights or inputs, rounded as they are packed.
        if let Some(af) = A::as_f32(a.data) {
            let a = Operand::new(af, a.ld, a.trans);
            return dpbf16::product(c, a, b, (m, k, n), init, scratch);
        }
    }
    let af = A::as_f32(a.data).map(|d| Operand::new(d, a.ld, a.trans));
    let bf = B::as_f32(b.data).map(|d| Operand::new(d, b.ld, b.trans));
    let (mb, kb, nb) = tiles(
        (m, k, n),
        (af.is_none(), bf.is_none(), C::as_f32(c).is_none()),
        scratch.len(),
    );
    let (sa, rest) = scratch.split_at_mut(if af.is_none() { mb * kb } else { 0 });
    let (sb, sc) = rest.split_at_mut(if bf.is_none() { kb * nb } else { 0 });
    // f32 output: gemm accumulates straight into it; otherwise into an f32 tile of scratch.
    let direct = C::as_f32_mut(c).map(|cf| {
        match init {
            Init::Bias(bias) => cf
                .par_chunks_mut(n)
                .for_each(|row| I::cast_to_f32(bias, row)),
            Init::Zero if k == 0 => cf.fill(0.0),
            _ => {}
        }
        cf.as_mut_ptr()
    });
    let (mut a_key, mut b_key) = (None, None);
    let (mut a_st, mut b_st) = ((0, 0), (0, 0));
    for i0 in (0..m).step_by(mb) {
        let r = mb.min(m - i0);
        for j0 in (0..n).step_by(nb) {
            let w = nb.min(n - j0);
            let (c_tile, c_rs): (*mut f32, isize) = match direct {
                // SAFETY: (i0, j0) is inside the m×n output.
                Some(p) => (unsafe { p.add(i0 * n + j0) }, n as isize),
                None => {
                    // Only a bias is loaded; prior values (Init::Read) are added on store.
                    let t = &mut sc[..r * w];
                    match &init {
                        Init::Bias(bias) => t
                            .par_chunks_mut(w)
                            .for_each(|row| I::cast_to_f32(&bias[j0..j0 + w], row)),
                        _ if k == 0 => t.fill(0.0),
                        _ => {}
                    }
                    (t.as_mut_ptr(), w as isize)
                }
            };
            let mut read = match direct {
                Some(_) => !matches!(init, Init::Zero),
                None => matches!(init, Init::Bias(_)),
            };
            for k0 in (0..k).step_by(kb) {
                let d = kb.min(k - k0);
                let (a_ptr, (a_rs, a_cs)) = match &af {
                    Some(f) => (f.data[f.offset(i0, k0)..].as_ptr(), f.strides()),
                    None => {
                        if a_key != Some((i0, k0)) {
                            a_st = a.widen((i0, k0), (r, d), sa);
                            a_key = Some((i0, k0));
                        }
                        (sa.as_ptr(), a_st)
                    }
                };
                let (b_ptr, (b_rs, b_cs)) = match &bf {
                    Some(f) => (f.data[f.offset(k0, j0)..].as_ptr(), f.strides()),
                    None => {
                        if b_key != Some((k0, j0)) {
                            b_st = b.widen((k0, j0), (d, w), sb);
                            b_key = Some((k0, j0));
                        }
                        (sb.as_ptr(), b_st)
                    }
                };
                // SAFETY: every pointer/stride pair addresses an in-bounds r×d, d×w or r×w
                // block; the C tile is not aliased by the operands.
                workspace::in_gemm(|| unsafe {
                    gemm::gemm(
                        r,
                        w,
                        d,
                        c_tile,
                        1,
                        c_rs,
                        read,
                        a_ptr,
                        a_cs,
                        a_rs,
                        b_ptr,
                        b_cs,
                        b_rs,
                        1.0f32,
                        1.0f32,
                        false,
                        false,
                        false,
                        Parallelism::Rayon(0),
                    );
                });
                read = true;
            }
            if direct.is_none() {
                sc[..r * w]
                    .par_chunks(w)
                    .zip(c[i0 * n..(i0 + r) * n].par_chunks_mut(n))
                    .for_each(|(t, row)| match init {
                        Init::Read => add_store(t, &mut row[j0..j0 + w]),
                        _ => C::cast_from_f32(t, &mut row[j0..j0 + w]),
                    });
            }
        }
    }
}

/// `dst = round(dst + t)`, through a stack block.
fn add_store<C: Float>(t: &[f32], dst: &mut [C]) {
    let mut buf = [0f32; BLOCK];
    for (t, d) in t.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
        let b = &mut buf[..t.len()];
        C::cast_to_f32(d, b);
        b.iter_mut().zip(t).for_each(|(b, t)| *b += t);
        C::cast_from_f32(b, d);
    }
}

/// Tile sizes (rows, depth, cols) that fit `len` scratch elements given which of A, B and C
/// need an f32 copy. Edges that size a widened block start at [`TILE`] and the largest of
/// them is halved until the blocks fit; the others stay whole but for the rows, so an all-f32
/// product is one gemm call per [`TILE`] rows. Row tiles leave every output element's k order,
/// and so its bits, as one call gives them.
fn tiles(
    (m, k, n): (usize, usize, usize),
    widen: (bool, bool, bool),
    len: usize,
) -> (usize, usize, usize) {
    let (wa, wb, wc) = widen;
    let used = [wa || wc, wa || wb, wb || wc];
    // Unwidened rows are cut into equal tiles of at most TILE.0: long enough (over 256 when cut
    // at all) that gemm never takes its small-product path, whose depth blocks differ.
    let rows = if used[0] {
        m
    } else {
        m.div_ceil(m.div_ceil(TILE.0).max(1))
    };
    let mut t = [rows, k.max(1), n];
    for ((t, cap), used) in t.iter_mut().zip([TILE.0, TILE.1, TILE.2]).zip(used) {
        if used {
            *t = (*t).min(cap);
        }
    }
    while need(t, widen) > len {
        let (i, e) = (0..3)
            .filter(|&i| used[i])
            .map(|i| (i, t[i]))
            .max_by_key(|&(_, e)| e)
            .expect("a widened edge");
        assert!(
            e > MIN_EDGE,
            "matmul scratch of {len} f32 is too short for ({m}, {k}) · ({k}, {n}); at least {MIN_SCRATCH} needed"
        );
        t[i] = e.div_ceil(2).max(MIN_EDGE);
    }
    (t[0], t[1], t[2])
}

/// Scratch elements for tiles `t` when A, B, C (per flag) are widened.
fn need(t: [usize; 3], (wa, wb, wc): (bool, bool, bool)) -> usize {
    wa as usize * t[0] * t[1] + wb as usize * t[1] * t[2] + wc as usize * t[0] * t[2]
}

/// What the `gemm` crate allocates for itself, outside the caller's buffers (so outside the
/// accountant): the process overhead counts it (`scheduler::memory::process`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmWorkspace {
    /// Per thread that runs gemm's kernels: its thread-local slab, one L2 cache (`gemm`'s own
    /// reading of this CPU's caches).
    pub per_thread: u64,
    /// Per product in flight (one per rank thread, which keeps it for its run in a
    /// [`Workspace`]): the packed operand, at most a depth block
    /// of [`TILE`]'s rows rounded up to gemm's panels, and the other operand's prepacked
    /// panels, at most two L2-sized macro panels and a panel's rounding.
    pub per_call: u64,
}

/// [`GemmWorkspace`] on this CPU.
pub fn gemm_workspace() -> GemmWorkspace {
    gemm_workspace_for(gemm_common::cache::CACHE_INFO[1].cache_bytes as u64)
}

/// [`GemmWorkspace`] on cores with `l2` bytes of L2 cache.
pub fn gemm_workspace_for(l2: u64) -> GemmWorkspace {
    let f32_bytes = std::mem::size_of::<f32>() as u64;
    GemmWorkspace {
        per_thread: l2,
        per_call: f32_bytes * (GEMM_DEPTH_BLOCK * (TILE.0 + PANEL_SLACK)) as u64 + 2 * l2,
    }
}

/// Median GFLOP/s of a 2048³ f32 product on the current rayon pool: the peak that model FLOP
/// utilisation is measured against. Allocates 48 MiB and takes about a second.
pub fn measure_peak_gflops() -> f64 {
    const S: usize = 2048;
    let a: Vec<f32> = (0..S * S).map(|i| (i % 7) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..S * S).map(|i| (i % 5) as f32 * 0.5).collect();
    let mut c = vec![0f32; S * S];
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            let id = Operand::new(&a[..], S, false);
            product(
                &mut c,
                id,
                Operand::new(&b[..], S, false),
                (S, S, S),
                Init::<f32>::Zero,
                &mut [],
            );
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    2.0 * (S * S * S) as f64 / times[2] / 1e9
}
