//! bf16 · bf16 products on AVX512-BF16: `vdpbf16ps` multiplies 16 pairs of bf16 values and
//! adds both products into 16 f32 lanes, twice the multiply-adds of an f32 FMA per
//! instruction (and per cycle on Zen 4). Where the CPU has AMX, the micro-tiles run on its
//! tiles instead (`amx`), with the same packs of B.
//!
//! Numerics: a product of two bf16 values is exact in f32; the instruction adds the product
//! of the pair's high halves and then that of the low halves, each addition rounded to
//! nearest even, with denormal inputs and results flushed to zero (what FTZ/DAZ training
//! threads do anyway). Packing element `2p` into the high half makes every output element an
//! f32 fused multiply-add chain over its whole depth in k order, as an sgemm micro-kernel
//! computes it within one depth block, computed by one thread; `init` (bias or the prior
//! value) is added afterwards and the sum rounded once on store. On AMX the same products
//! are summed per 32 of depth before they reach the accumulator (`amx`). The result does not
//! depend on the pool, the tiling or the task split.
//!
//! Layout: A is packed once per call, per row block (8 rows as `[pair][row]` u32, two bf16 in
//! one dword; on AMX 16 rows as `[row][pair]`); each task packs one 48-column panel of B as
//! `[pair][column]` u32 (a transposed B through 16 × 16 register transposes) and runs 8 × 48
//! (AMX: 16 × 48) micro-tiles over every row block of its row range (AMX: a block of the
//! panel's depth that fits L1 at a time, over groups of row blocks whose tiles wait on the
//! stack). The packs live in the caller's matmul scratch (which the memory model counts):
//! `48·k` bf16 per B slot, and as many rows of A as then fit, a pass of rows at a time.

use half::bf16;
use rayon::prelude::*;
use std::arch::x86_64::*;

use super::{Init, Operand, amx};
use crate::Float;
use crate::float::x86::{round_to_bf16, widen_bf16};
use crate::par::{SharedMut, for_ranges};

/// Rows of a micro-tile (one broadcast each per pair).
const MR: usize = 8;
/// zmm registers per micro-tile row.
const NR: usize = 3;
/// Columns of a micro-tile and of a packed B panel.
pub(super) const NC: usize = 16 * NR;
/// Tasks to aim for when B has few panels (rows are then split too).
const MIN_TASKS: usize = 16;
/// A micro-tile's f32 results, on either engine.
const TILE: usize = amx::ROWS * NC;
type Tile = [f32; TILE];
/// The tiles of an AMX group, on cache lines of their own: tile loads and stores that split
/// lines were slower.
#[repr(align(64))]
struct Group([Tile; AMX_GROUP]);
/// Most bytes of B packed whole before the tiles (a shallow product's: LoRA's `V·Bᵀ`, the LM
/// head's weight gradient, whose B is the chunk's inputs): each thread then takes whole rows
/// of the output, every panel of them, with its row block of A in L1 and B in L2. At 256 KiB
/// the head's B (about 400 KiB) went to the per-task panels, which stream A from memory once
/// per panel (kernels/README.md has the figures).
const WHOLE_B_BYTES: usize = 512 << 10;
/// Fewest rows of a task that splits rows: each task packs its panel of B again.
const MIN_CHUNK_ROWS: usize = 64;
/// Pairs of depth a plain B's pack prefetches ahead of the pair it packs.
const PREFETCH: usize = 8;
/// Pairs of depth of the B block that AMX's tiles keep in L1 (24 KiB of a 48-wide panel) while
/// a group of [`AMX_GROUP`] row blocks runs over it; a deeper panel streamed every tile's B
/// from L2.
const AMX_DEPTH_PAIRS: usize = 128;
/// Row blocks whose AMX tiles run over one block of B's depth before the next block.
const AMX_GROUP: usize = 16;
/// Depth of the blocks a deeper product runs in (the LM head's input gradient, as deep as the
/// vocabulary): packs of its whole depth would leave room for one thread's panel of B.
const DEPTH_BLOCK: usize = 4096;

/// Whether this CPU has the instructions the kernel uses.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
}

/// What runs the micro-tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// `vdpbf16ps` on zmm registers.
    Vector,
    /// `tdpbf16ps` on AMX tiles.
    Tiles,
}

impl Engine {
    /// AMX where the CPU and the OS offer it.
    fn best() -> Self {
        if amx::available() {
            Self::Tiles
        } else {
            Self::Vector
        }
    }

    /// Rows of a micro-tile, and of a packed row block of A.
    fn rows(self) -> usize {
        match self {
            Self::Vector => MR,
            Self::Tiles => amx::ROWS,
        }
    }

    /// zmm registers of a micro-tile row for an output `n` wide: the vector engine sizes its
    /// panels to the output (LoRA's rank-16 products would leave two thirds of a 48-wide
    /// panel zero, attention's 64-wide tiles a third of two), 3 where that pads no more than
    /// 2; AMX tiles are always [`NC`] wide.
    fn vectors(self, n: usize) -> usize {
        let padded = |r: usize| n.div_ceil(16 * r) * 16 * r;
        match self {
            Self::Vector if n <= 16 => 1,
            Self::Vector if padded(2) < padded(NR) => 2,
            Self::Vector | Self::Tiles => NR,
        }
    }

    /// Pairs of depth the packs hold for depth `k`: tiles take whole steps of
    /// [`amx::PAIRS`], padded with zeros.
    fn pairs(self, k: usize) -> usize {
        match self {
            Self::Vector => k.div_ceil(2),
            Self::Tiles => k.div_ceil(2 * amx::PAIRS) * amx::PAIRS,
        }
    }

    /// One micro-tile, `t = a · b` over `kp` pairs, rows `16·nr` apart.
    ///
    /// # Safety
    /// `a` and `b` hold `kp` pairs of the engine's rows and of `16·nr` columns; the CPU has
    /// AVX512-BF16 ([`available`]); for `Tiles`, [`amx::Tiles`] is configured on this thread.
    #[inline]
    unsafe fn micro(self, nr: usize, kp: usize, a: &[u32], b: &[u32], t: &mut Tile) {
        let (a, b) = (a.as_ptr(), b.as_ptr());
        // SAFETY: the caller's contract.
        unsafe {
            match (self, nr) {
                (Self::Vector, 1) => micro::<1>(kp, a, b, t),
                (Self::Vector, 2) => micro::<2>(kp, a, b, t),
                (Self::Vector, _) => micro::<NR>(kp, a, b, t),
                (Self::Tiles, _) => amx::micro(kp, a, kp, b, t.as_mut_ptr(), false),
            }
        }
    }

    /// Rows `i0..` of `op(a)` packed as this engine's row block (`kp` pairs of its rows).
    ///
    /// # Safety
    /// The CPU has AVX-512 (F, BW, VL).
    unsafe fn pack_a<T: Source>(
        self,
        a: &Operand<'_, T>,
        i0: usize,
        m: usize,
        k: usize,
        out: &mut [u32],
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Self::Vector => pack_a(a, i0, m, k, out),
                Self::Tiles => pack_a_rows(a, i0, m, k, out),
            }
        }
    }
}

/// Scratch (f32) that holds one B panel and one row block of packs for a depth of `k`, on
/// either engine: a scratch this long keeps [`product`]'s packs off the heap.
pub(super) fn packs_len(k: usize) -> usize {
    let need = |e: Engine| e.pairs(k) * (e.rows() + NC);
    need(Engine::Vector).max(need(Engine::Tiles))
}

/// `c (m, n) = init + op(a) (m, k) · op(b) (k, n)`, `c` row-major; see the module notes.
/// The packs live in `scratch`: as many B panel slots as the pool has threads and fit beside
/// one row block of A, then as many row blocks of A as fit in the rest, a pass of rows at a
/// time. A B small enough ([`WHOLE_B_BYTES`], or one panel: LoRA's rank-wide and rank-deep
/// products) is packed whole first, and each row block of A just before its tiles, in a slot
/// of its thread, where it stays in cache; each thread takes a range of whole output rows.
/// A product deeper than [`DEPTH_BLOCK`] runs in blocks of that depth, summed in f32 in order
/// (in `c` itself, or in the scratch where it holds the f32 result beside the packs).
/// Only a scratch too short for one slot and one row block ([`packs_len`]; the trainer's is
/// sized for its deepest product) sends the packs to the heap. Callers check
/// [`available`] and pass a depth `k > 0`.
pub(super) fn product<A: Source, C: Float, I: Float>(
    c: &mut [C],
    a: Operand<'_, A>,
    b: Operand<'_, bf16>,
    dims: (usize, usize, usize),
    init: Init<'_, I>,
    scratch: &mut [f32],
) {
    product_on(Engine::best(), c, a, b, dims, init, scratch);
}

/// [`product`] on the given engine.
fn product_on<A: Source, C: Float, I: Float>(
    engine: Engine,
    c: &mut [C],
    a: Operand<'_, A>,
    b: Operand<'_, bf16>,
    (m, k, n): (usize, usize, usize),
    init: Init<'_, I>,
    scratch: &mut [f32],
) {
    if k > DEPTH_BLOCK {
        // Each block of the depth into `acc`: the first with `init`, the rest added to it.
        let blocks = |acc: &mut [f32], init: Init<'_, I>, scratch: &mut [f32]| {
            let mut init = Some(init);
            for k0 in (0..k).step_by(DEPTH_BLOCK) {
                let (a, b) = (a.from(0, k0), b.from(k0, 0));
                let d = DEPTH_BLOCK.min(k - k0);
                let init = init.take().unwrap_or(Init::Read);
                product_on(engine, acc, a, b, (m, d, n), init, scratch);
            }
        };
        if let Some(c) = C::as_f32_mut(c) {
            return blocks(c, init, scratch);
        }
        if scratch.len() >= m * n + packs_len(DEPTH_BLOCK) {
            let (acc, scratch) = scratch.split_at_mut(m * n);
            blocks(acc, Init::Zero, scratch);
            let out = SharedMut::new(c);
            for_ranges(m, 1, |rows| {
                for i in rows {
                    // SAFETY: each row of c is one task's.
                    let row = unsafe { out.slice(i * n..(i + 1) * n) };
                    for (j0, t) in (0..n).step_by(NC).zip(acc[i * n..(i + 1) * n].chunks(NC)) {
                        store(&mut row[j0..j0 + t.len()], t, &init, j0);
                    }
                }
            });
            return;
        }
    }
    let (mr, kp, nr) = (engine.rows(), engine.pairs(k), engine.vectors(n));
    let (blocks, nc) = (m.div_ceil(mr), 16 * nr);
    let (a_block, b_len) = (kp * mr, kp * nc);
    let mut heap = Vec::new();
    let packs: &mut [u32] = if scratch.len() >= a_block + b_len {
        // SAFETY: f32 and u32 have the same size and alignment; any bits are valid u32.
        unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast(), scratch.len()) }
    } else {
        heap.resize(a_block + b_len, 0u32);
        &mut heap
    };
    let out = SharedMut::new(c);
    // The first column and the width of panel `panel` of B and of c.
    let span = |panel: usize| (panel * nc, nc.min(n - panel * nc));
    // Row `r` of row block `rb`'s output, columns j0..j0 + w.
    let row = |rb: usize, r: usize, (j0, w): (usize, usize)| {
        let i = rb * mr + r;
        // SAFETY: tasks own disjoint (row range, panel) blocks of c.
        unsafe { out.slice(i * n + j0..i * n + j0 + w) }
    };
    let rows_of = |rb: usize| mr.min(m - rb * mr);
    // The rows a tile stores (and reads, to add to them) are a page each when c is wide:
    // asked for before the tile computes, they arrive while it does.
    let prefetch_rows = |rb: usize, span| (0..rows_of(rb)).for_each(|r| prefetch(row(rb, r, span)));
    let put = |rb: usize, (j0, w): (usize, usize), t: &Tile| {
        for (r, t) in t.chunks_exact(nc).take(rows_of(rb)).enumerate() {
            store(row(rb, r, (j0, w)), &t[..w], &init, j0);
        }
    };
    // Row block `rb` of A (packed at `pa`) times the B panel at `pb`, columns j0..j0 + w, into
    // c through the slot's tile buffer `t`.
    let tile = |rb: usize, pa: &[u32], pb: &[u32], span: (usize, usize), t: &mut Tile| {
        prefetch_rows(rb, span);
        // SAFETY: the packs hold kp pairs of the engine's rows and nc columns; features
        // checked by the caller; tiles configured on this thread by the caller.
        unsafe { engine.micro(nr, kp, pa, pb, t) };
        put(rb, span, t);
    };
    // SAFETY: `available` was checked by the caller.
    let pack_a_block =
        |rb: usize, out: &mut [u32]| unsafe { engine.pack_a(&a, rb * mr, m, k, out) };
    // The tiles stay configured for a slot's whole run: nothing in a slot calls into rayon,
    // where its thread could steal another slot and reconfigure them.
    // SAFETY: `Engine::Tiles` is chosen only where `amx::available`.
    let configure = || (engine == Engine::Tiles).then(|| unsafe { amx::Tiles::configure() });
    let panels = n.div_ceil(nc);
    let whole = panels * b_len;
    if (panels == 1 || whole * 4 <= WHOLE_B_BYTES) && packs.len() >= whole + a_block {
        let (pbs, pas) = packs.split_at_mut(whole);
        let slots = rayon::current_num_threads().min(pas.len() / a_block).max(1);
        {
            let dst = SharedMut::new(pbs);
            for_ranges(panels, 1, |r| {
                for panel in r {
                    let (j0, w) = span(panel);
                    // SAFETY: each panel owns its part of the pack; `available` was checked
                    // by the caller.
                    unsafe {
                        pack_b(
                            &b,
                            j0,
                            w,
                            k,
                            dst.slice(panel * b_len..(panel + 1) * b_len),
                            nc,
                        )
                    };
                }
            });
        }
        let (pbs, pas) = (&*pbs, SharedMut::new(pas));
        (0..slots).into_par_iter().for_each(|slot| {
            // SAFETY: slots are disjoint.
            let pa = unsafe { pas.slice(slot * a_block..(slot + 1) * a_block) };
            let (_tiles, t) = (configure(), &mut [0f32; TILE]);
            for rb in blocks * slot / slots..blocks * (slot + 1) / slots {
                pack_a_block(rb, pa);
                for (panel, pb) in pbs.chunks_exact(b_len).enumerate() {
                    tile(rb, pa, pb, span(panel), t);
                }
            }
        });
        return;
    }
    let slots = rayon::current_num_threads()
        .min((packs.len() - a_block) / b_len)
        .max(1);
    let pass = ((packs.len() - slots * b_len) / a_block).min(blocks);
    let (pbs, pa) = packs.split_at_mut(slots * b_len);
    for first in (0..blocks).step_by(pass) {
        let rows = pass.min(blocks - first);
        {
            let dst = SharedMut::new(pa);
            for_ranges(rows, 1, |r| {
                for rb in r {
                    // SAFETY: each row block owns its part of the pack.
                    pack_a_block(first + rb, unsafe {
                        dst.slice(rb * a_block..(rb + 1) * a_block)
                    });
                }
            });
        }
        // Rows are split among tasks only while each keeps MIN_CHUNK_ROWS: every task packs
        // its panel of B.
        let most = (rows * mr / MIN_CHUNK_ROWS).max(1);
        let per_chunk = rows.div_ceil(MIN_TASKS.div_ceil(panels).clamp(1, most));
        let chunks = rows.div_ceil(per_chunk);
        let tasks = panels * chunks;
        let (pa, pbs) = (&*pa, SharedMut::new(pbs));
        // Slot s takes every slots-th task, so a slot is one thread's at a time.
        (0..slots).into_par_iter().for_each(|slot| {
            // SAFETY: slots are disjoint.
            let pb = unsafe { pbs.slice(slot * b_len..(slot + 1) * b_len) };
            let (_tiles, t) = (configure(), &mut [0f32; TILE]);
            let group = &mut Group([[0f32; TILE]; AMX_GROUP]).0;
            for task in (slot..tasks).step_by(slots) {
                let (panel, chunk) = (task / chunks, task % chunks);
                let (j0, w) = span(panel);
                // SAFETY: `available` was checked by the caller.
                unsafe { pack_b(&b, j0, w, k, pb, nc) };
                let blocks = chunk * per_chunk..((chunk + 1) * per_chunk).min(rows);
                if engine != Engine::Tiles || kp <= AMX_DEPTH_PAIRS {
                    for rb in blocks {
                        tile(first + rb, &pa[rb * a_block..], pb, (j0, w), t);
                    }
                    continue;
                }
                // AMX: the panel's depth a block at a time, so that the block of B stays in
                // L1 for a group of row blocks, whose tiles wait in `group` between blocks.
                for g0 in blocks.clone().step_by(AMX_GROUP) {
                    let g = g0..(g0 + AMX_GROUP).min(blocks.end);
                    g.clone().for_each(|rb| prefetch_rows(first + rb, (j0, w)));
                    for p0 in (0..kp).step_by(AMX_DEPTH_PAIRS) {
                        let pn = AMX_DEPTH_PAIRS.min(kp - p0);
                        for (rb, t) in g.clone().zip(group.iter_mut()) {
                            let pa = &pa[rb * a_block + p0..];
                            // SAFETY: row block rb's pack holds kp pairs of 16 rows, kp apart;
                            // the panel's pack kp rows of nc; tiles configured above.
                            unsafe {
                                amx::micro(
                                    pn,
                                    pa.as_ptr(),
                                    kp,
                                    pb[p0 * nc..].as_ptr(),
                                    t.as_mut_ptr(),
                                    p0 > 0,
                                )
                            };
                        }
                    }
                    for (rb, t) in g.zip(group.iter()) {
                        put(first + rb, (j0, w), t);
                    }
                }
            }
        });
    }
}

/// A B operand packed whole for [`Small`]: every panel of its `n` columns, `k` deep.
#[derive(Default)]
pub(crate) struct Panels {
    data: Vec<u32>,
    k: usize,
    n: usize,
}

impl Panels {
    /// Columns of the packed operand.
    pub(crate) fn width(&self) -> usize {
        self.n
    }
}

/// Products small enough for one thread (attention's tiles, 64 rows or columns and 64 deep),
/// on the engine [`product`] chooses: B packed whole once ([`Panels`]: a tile that meets every
/// tile of the other side), A one row block at a time just before its micro-tiles, the f32
/// results written or added into the caller's tile. Each element is [`product`]'s chain, so
/// its bits do not depend on which of the two computed it. While it lives it holds its
/// thread's AMX tile configuration: keep it on one thread, out of rayon.
pub(crate) struct Small {
    engine: Engine,
    a: Vec<u32>,
    _tiles: Option<amx::Tiles>,
}

impl Small {
    /// None where the CPU lacks AVX512-BF16.
    pub(crate) fn new() -> Option<Self> {
        available().then(|| Self::on(Engine::best()))
    }

    /// On `engine`, which this CPU runs.
    fn on(engine: Engine) -> Self {
        // SAFETY: `Engine::Tiles` is passed only where `amx::available`.
        let _tiles = (engine == Engine::Tiles).then(|| unsafe { amx::Tiles::configure() });
        Self {
            engine,
            a: Vec::new(),
            _tiles,
        }
    }

    /// Packs `op(b) (k, n)` into `panels` (its buffer reused).
    pub(crate) fn pack(&self, b: Operand<'_, bf16>, (k, n): (usize, usize), panels: &mut Panels) {
        let (kp, nr) = (self.engine.pairs(k), self.engine.vectors(n));
        let nc = 16 * nr;
        (panels.k, panels.n) = (k, n);
        panels.data.resize(n.div_ceil(nc) * kp * nc, 0);
        for (j0, out) in (0..n)
            .step_by(nc)
            .zip(panels.data.chunks_exact_mut(kp * nc))
        {
            // SAFETY: `available` held when `self` was made.
            unsafe { pack_b(&b, j0, nc.min(n - j0), k, out, nc) };
        }
    }

    /// `c (m, n) = op(a) (m, k) · b`, or with `add` `c += …`; `c` row-major, `ldc` apart.
    pub(crate) fn product<A: Source>(
        &mut self,
        c: &mut [f32],
        ldc: usize,
        a: Operand<'_, A>,
        m: usize,
        b: &Panels,
        add: bool,
    ) {
        let engine = self.engine;
        let (mr, kp, nr) = (engine.rows(), engine.pairs(b.k), engine.vectors(b.n));
        let nc = 16 * nr;
        self.a.resize(kp * mr, 0);
        let t = &mut [0f32; TILE];
        for i0 in (0..m).step_by(mr) {
            // SAFETY: `available` held when `self` was made.
            unsafe { engine.pack_a(&a, i0, m, b.k, &mut self.a) };
            for (j0, pb) in (0..b.n).step_by(nc).zip(b.data.chunks_exact(kp * nc)) {
                // SAFETY: both packs hold kp pairs; tiles configured by `new` on this thread.
                unsafe { engine.micro(nr, kp, &self.a, pb, t) };
                let w = nc.min(b.n - j0);
                for (r, t) in t.chunks_exact(nc).take(mr.min(m - i0)).enumerate() {
                    let row = &mut c[(i0 + r) * ldc + j0..][..w];
                    match add {
                        true => row.iter_mut().zip(t).for_each(|(c, t)| *c += t),
                        false => row.copy_from_slice(&t[..w]),
                    }
                }
            }
        }
    }
}

/// `row = round(init + t)` for the columns `j0..` of one output row.
#[inline]
fn store<C: Float, I: Float>(row: &mut [C], t: &[f32], init: &Init<'_, I>, j0: usize) {
    if let (Some(row), Init::Zero | Init::Read) = (C::as_bf16_mut(row), init) {
        // SAFETY: the caller checked `available`.
        return unsafe { store_bf16(row, t, matches!(init, Init::Read)) };
    }
    let mut buf = [0f32; NC];
    let v = &mut buf[..t.len()];
    match init {
        Init::Zero => v.copy_from_slice(t),
        Init::Bias(bias) => {
            I::cast_to_f32(&bias[j0..j0 + t.len()], v);
            v.iter_mut().zip(t).for_each(|(v, t)| *v += t);
        }
        Init::Read => {
            C::cast_to_f32(row, v);
            v.iter_mut().zip(t).for_each(|(v, t)| *v += t);
        }
    }
    C::cast_from_f32(v, row);
}

/// [`store`] of a bf16 row without a bias, in registers: `row = round(t)`, or with `add`
/// `round(row + t)`, rounded as the slice casts round.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn store_bf16(row: &mut [bf16], t: &[f32], add: bool) {
    for c0 in (0..t.len()).step_by(16) {
        let mask = low_bits(t.len() - c0);
        let (t, dst) = (t[c0..].as_ptr(), row[c0..].as_mut_ptr().cast());
        // SAFETY: the masked loads and store stay within the row's and t's common length.
        unsafe {
            let mut v = _mm512_maskz_loadu_ps(mask, t);
            if add {
                v = _mm512_add_ps(widen_bf16(_mm256_maskz_loadu_epi16(mask, dst)), v);
            }
            _mm256_mask_storeu_epi16(dst, mask, round_to_bf16(v));
        }
    }
}

/// What an A operand holds: bf16, or f32 (the LM head's dlogits) rounded to bf16 as it is
/// packed, as autocast rounds the gradient of the head's output; the packs are the same.
pub(crate) trait Source: Copy + Sync {
    fn to_bf16(self) -> bf16;

    /// The `mask`ed of 16 consecutive elements at `src` as bf16 bits (zeros elsewhere).
    ///
    /// # Safety
    /// The masked elements are readable; the CPU has AVX-512 (F, BW, VL).
    unsafe fn load16(src: *const Self, mask: u16) -> __m256i;

    /// Eight consecutive elements at `a` and eight at `b` as 16 bf16, `a`'s first: two runs of
    /// a transposed A converted as one vector.
    ///
    /// # Safety
    /// Both runs are readable; the CPU has AVX-512 (F, BW, VL).
    unsafe fn load8x2(a: *const Self, b: *const Self) -> __m256i;
}

/// Eight f32 at `a` and eight at `b` in one vector, `a`'s first.
///
/// # Safety
/// Both runs are readable; the CPU has AVX-512 (F, BW, VL).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn two_runs(a: *const f32, b: *const f32) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe {
        let (a, b) = (_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        _mm512_castsi512_ps(_mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_castps_si256(a)),
            _mm256_castps_si256(b),
        ))
    }
}

impl Source for bf16 {
    #[inline(always)]
    fn to_bf16(self) -> bf16 {
        self
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(src: *const Self, mask: u16) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { _mm256_maskz_loadu_epi16(mask, src.cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load8x2(a: *const Self, b: *const Self) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            let a = _mm256_castsi128_si256(_mm_loadu_si128(a.cast()));
            _mm256_inserti128_si256::<1>(a, _mm_loadu_si128(b.cast()))
        }
    }
}

impl Source for f32 {
    #[inline(always)]
    fn to_bf16(self) -> bf16 {
        bf16::from_f32(self)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(src: *const Self, mask: u16) -> __m256i {
        // SAFETY: the caller's contract; `round_to_bf16` rounds as `bf16::from_f32`.
        unsafe { round_to_bf16(_mm512_maskz_loadu_ps(mask, src)) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load8x2(a: *const Self, b: *const Self) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { round_to_bf16(two_runs(a, b)) }
    }
}

/// What an f32 leaves after its bf16 rounding, `x - bf16(x)`, itself rounded to bf16: an A of
/// f32 values packed once as themselves and once as this (two products into one sum) keeps 16
/// of their bits, not 8 (attention's probabilities and their gradients, whose sums over a
/// column of queries cancel). Exact in f32; finite where `x` is.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Residual(f32);

impl Residual {
    /// The residuals of `x`, read in place.
    pub(crate) fn of(x: &[f32]) -> &[Residual] {
        // SAFETY: `Residual` is a transparent f32.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len()) }
    }

    /// The residuals of 16 f32 lanes, rounded to bf16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn round(x: __m512) -> __m256i {
        round_to_bf16(_mm512_sub_ps(x, widen_bf16(round_to_bf16(x))))
    }
}

impl Source for Residual {
    #[inline(always)]
    fn to_bf16(self) -> bf16 {
        bf16::from_f32(self.0 - bf16::from_f32(self.0).to_f32())
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(src: *const Self, mask: u16) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { Residual::round(_mm512_maskz_loadu_ps(mask, src.cast())) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load8x2(a: *const Self, b: *const Self) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { Residual::round(two_runs(a.cast(), b.cast())) }
    }
}

/// 32 consecutive elements at `src` as 16 pairs: dword `p` is `pair(src[2p], src[2p + 1])`.
///
/// # Safety
/// 32 elements are readable; the CPU has AVX-512 (F, BW, VL).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load_pairs<T: Source>(src: *const T) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe {
        let (lo, hi) = (T::load16(src, !0), T::load16(src.add(16), !0));
        // In memory element 2p is the low half of dword p: rotate it into the high half.
        _mm512_rol_epi32::<16>(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi))
    }
}

/// Elements `2p` and `2p + 1` of a pair as one dword. The instruction adds the product of
/// the high halves first, so element `2p` goes there: the accumulation runs in k order.
#[inline(always)]
fn pair<T: Source>(first: T, second: T) -> u32 {
    u32::from(first.to_bf16().to_bits()) << 16 | u32::from(second.to_bf16().to_bits())
}

/// Rows `i0..i0 + MR` of `op(a)` as `[pair][row]`; rows past `m` and the odd tail of k are 0.
/// Whole row blocks go through vector registers: a transposed A (a gradient's transpose) as
/// two interleaved runs of rows per pair, a plain one 16 pairs at a time through a register
/// transpose; the rest one pair at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a<T: Source>(a: &Operand<'_, T>, i0: usize, m: usize, k: usize, out: &mut [u32]) {
    let h = MR.min(m - i0);
    let full = k / 2;
    if a.trans && h == MR {
        // Element (i, kk) is data[kk·ld + i]: each pair is two runs of MR rows, interleaved.
        let (run, ld) = (&a.data[i0..(k - 1) * a.ld + i0 + MR], a.ld);
        let rows = (1u16 << MR) - 1;
        // SAFETY: each run holds MR = 8 values.
        let at =
            |kk: usize| unsafe { _mm256_castsi256_si128(T::load16(run[kk * ld..].as_ptr(), rows)) };
        // SAFETY: as above.
        let at2 = |k0: usize, k1: usize| unsafe {
            T::load8x2(run[k0 * ld..].as_ptr(), run[k1 * ld..].as_ptr())
        };
        // Two pairs at a time, their runs converted in one vector each: lane half h of an
        // unpack is pair 2q + h's, so the halves are regrouped by pair before the stores.
        let quads = k / 4;
        for (q, o) in out.chunks_exact_mut(2 * MR).take(quads).enumerate() {
            let (x, y) = (at2(4 * q, 4 * q + 2), at2(4 * q + 1, 4 * q + 3));
            // Dword j of an unpack is y[j] | x[j] << 16: `pair(x[j], y[j])`.
            let (lo, hi) = (_mm256_unpacklo_epi16(y, x), _mm256_unpackhi_epi16(y, x));
            let o = o.as_mut_ptr().cast::<__m256i>();
            // SAFETY: o holds 2·MR = 16 dwords; unaligned.
            unsafe {
                _mm256_storeu_si256(o, _mm256_permute2x128_si256::<0x20>(lo, hi));
                _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256::<0x31>(lo, hi));
            }
        }
        for (p, o) in out.chunks_exact_mut(MR).enumerate().skip(2 * quads) {
            let (x, y) = match 2 * p + 1 < k {
                true => (at(2 * p), at(2 * p + 1)),
                false => (at(2 * p), _mm_setzero_si128()),
            };
            let o = o.as_mut_ptr().cast::<__m128i>();
            // SAFETY: o holds MR = 8 dwords; unaligned.
            unsafe {
                _mm_storeu_si128(o, _mm_unpacklo_epi16(y, x));
                _mm_storeu_si128(o.add(1), _mm_unpackhi_epi16(y, x));
            }
        }
    } else if a.trans {
        // The last row block, shorter than MR: one pair at a time.
        for (p, o) in out.chunks_exact_mut(MR).enumerate() {
            let run = |kk: usize| (kk < k).then(|| &a.data[kk * a.ld + i0..][..h]);
            match (run(2 * p), run(2 * p + 1)) {
                (Some(x), Some(y)) => {
                    for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                        *o = pair(x, y);
                    }
                }
                (Some(x), None) => {
                    for (o, &x) in o.iter_mut().zip(x) {
                        *o = pair(x.to_bf16(), bf16::ZERO);
                    }
                }
                _ => unreachable!("pairs cover k"),
            }
            o[h..].fill(0);
        }
    } else {
        // Row i is data[i·ld..][..k]: its pairs are adjacent; 16 of them from each row are
        // transposed in registers.
        let p16 = full / 16 * 16;
        for p0 in (0..p16).step_by(16) {
            // SAFETY: rows below h hold pairs p0..p0 + 16; out holds MR dwords a pair.
            unsafe {
                let rows: [__m512i; 16] = std::array::from_fn(|r| match r < h {
                    true => load_pairs(a.data[(i0 + r) * a.ld + 2 * p0..].as_ptr()),
                    false => _mm512_setzero_si512(),
                });
                for (p, v) in transpose16(rows).into_iter().enumerate() {
                    let dst = out[(p0 + p) * MR..].as_mut_ptr().cast();
                    _mm256_storeu_si256(dst, _mm512_castsi512_si256(v));
                }
            }
        }
        for r in 0..MR {
            let slots = out.iter_mut().skip(p16 * MR + r).step_by(MR);
            if r >= h {
                slots.for_each(|o| *o = 0);
                continue;
            }
            let row = &a.data[(i0 + r) * a.ld..][2 * p16..k];
            let (pairs, tail) = row.as_chunks::<2>();
            for (o, &[x, y]) in slots.zip(pairs) {
                *o = pair(x, y);
            }
            if let [last] = tail {
                out[full * MR + r] = pair(last.to_bf16(), bf16::ZERO);
            }
        }
    }
}

/// Rows `i0..i0 + 16` of `op(a)` as `[row][pair]`, `out.len() / 16` pairs a row (the AMX
/// layout, a whole number of 16-pair steps); rows past `m` and depth past `k` are 0. A plain
/// A goes 16 pairs of a row at a time through a vector register, a transposed one as 16
/// pairs of all 16 rows through a register transpose; the tail of a plain row one pair at a
/// time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_rows<T: Source>(
    a: &Operand<'_, T>,
    i0: usize,
    m: usize,
    k: usize,
    out: &mut [u32],
) {
    let h = amx::ROWS.min(m - i0);
    let kp = out.len() / amx::ROWS;
    if a.trans {
        // Element (i, kk) is data[kk·ld + i]: pair p of every row from two runs of h rows,
        // widened to dwords and merged, then 16 pairs transposed to rows.
        let mask = low_bits(h);
        // SAFETY: run kk < k holds the h masked rows.
        let run = |kk: usize| unsafe {
            match kk < k {
                true => _mm512_cvtepu16_epi32(T::load16(a.data[kk * a.ld + i0..].as_ptr(), mask)),
                false => _mm512_setzero_si512(),
            }
        };
        for p0 in (0..kp).step_by(16) {
            let pairs: [__m512i; 16] = std::array::from_fn(|p| {
                let kk = 2 * (p0 + p);
                _mm512_or_si512(_mm512_slli_epi32::<16>(run(kk)), run(kk + 1))
            });
            // SAFETY: out holds 16 rows of kp dwords; rows past h are zeros from the masks.
            unsafe {
                for (r, v) in transpose16(pairs).into_iter().enumerate() {
                    _mm512_storeu_si512(out[r * kp + p0..].as_mut_ptr().cast(), v);
                }
            }
        }
        return;
    }
    out[h * kp..].fill(0);
    let (full, p16) = (k / 2, k / 32 * 16);
    // Row i is data[i·ld..][..k]: its pairs are adjacent.
    for (r, o) in out.chunks_exact_mut(kp).take(h).enumerate() {
        let row = &a.data[(i0 + r) * a.ld..][..k];
        for p0 in (0..p16).step_by(16) {
            // SAFETY: the row holds 32 elements from 2·p0; o holds 16 dwords from p0.
            unsafe {
                let v = load_pairs(row[2 * p0..].as_ptr());
                _mm512_storeu_si512(o[p0..].as_mut_ptr().cast(), v);
            }
        }
        let (pairs, tail) = row[2 * p16..].as_chunks::<2>();
        for (o, &[x, y]) in o[p16..].iter_mut().zip(pairs) {
            *o = pair(x, y);
        }
        let rest = &mut o[full..];
        rest.fill(0);
        if let [last] = tail {
            rest[0] = pair(last.to_bf16(), bf16::ZERO);
        }
    }
}

/// Columns `j0..j0 + w` of `op(b)` as `[pair][column]`, `nc` columns per pair (a multiple of
/// 16), as many pairs as `out` holds (zeros past `w` and past the depth).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b(b: &Operand<'_, bf16>, j0: usize, w: usize, k: usize, out: &mut [u32], nc: usize) {
    let zero = bf16::ZERO;
    if b.trans {
        // Column j of op(b) is row j of the data: its pairs are adjacent dwords (first element
        // in the low half, so rotated by 16). Blocks of 16 columns × up to 16 pairs are
        // transposed in registers; the rest goes one dword at a time.
        let (full, c16) = (k / 2, w / 16 * 16);
        let col = |c: usize| &b.data[(j0 + c) * b.ld..][..k];
        for c0 in (0..c16).step_by(16) {
            let cols: [*const bf16; 16] = std::array::from_fn(|j| col(c0 + j).as_ptr());
            for p0 in (0..full).step_by(16) {
                let np = (full - p0).min(16);
                // SAFETY: columns c0..c0 + 16 hold pairs p0..p0 + np (the load is masked to
                // them); out holds nc per pair.
                unsafe {
                    let rows: [__m512i; 16] = std::array::from_fn(|j| {
                        let src = cols[j].add(2 * p0);
                        let v = _mm512_maskz_loadu_epi32(low_bits(np), src.cast());
                        _mm512_rol_epi32::<16>(v)
                    });
                    for (p, v) in transpose16(rows).into_iter().take(np).enumerate() {
                        _mm512_storeu_si512(out[(p0 + p) * nc + c0..].as_mut_ptr().cast(), v);
                    }
                }
            }
        }
        for c in 0..nc {
            let (from, src) = if c < c16 {
                (full, Some(col(c)))
            } else {
                (0, (c < w).then(|| col(c)))
            };
            for p in from..out.len() / nc {
                out[p * nc + c] = match src {
                    Some(s) if 2 * p + 1 < k => pair(s[2 * p], s[2 * p + 1]),
                    Some(s) if 2 * p < k => pair(s[2 * p], zero),
                    _ => 0,
                };
            }
        }
    } else {
        // Rows 2p and 2p + 1 of the data, 16 columns at a time, zero-extended and merged; an
        // odd depth's last row pairs with zeros.
        let zeros = [zero; NC];
        let row = |kk: usize| &b.data[kk * b.ld + j0..][..w];
        for (p, o) in out.chunks_exact_mut(nc).enumerate() {
            if 2 * p >= k {
                // Depth padding (AMX packs whole tile steps).
                o.fill(0);
                continue;
            }
            let first = row(2 * p);
            let second = if 2 * p + 1 < k {
                row(2 * p + 1)
            } else {
                &zeros[..w]
            };
            // Each row is a new page or two when B is wide: ask for the rows PREFETCH pairs on
            // now, or the loads below wait on them (kernels/README.md has the figures).
            let ahead = 2 * (p + PREFETCH);
            if ahead + 1 < k {
                prefetch(row(ahead));
                prefetch(row(ahead + 1));
            }
            for (c0, o) in (0..w).step_by(16).zip(o.chunks_exact_mut(16)) {
                let mask = low_bits(w - c0);
                // SAFETY: the loads are masked to the rows' w columns; o holds 16 dwords.
                unsafe {
                    let load = |r: &[bf16]| {
                        let v = _mm256_maskz_loadu_epi16(mask, r[c0..].as_ptr().cast());
                        _mm512_cvtepu16_epi32(v)
                    };
                    let v = _mm512_or_si512(_mm512_slli_epi32::<16>(load(first)), load(second));
                    _mm512_storeu_si512(o.as_mut_ptr().cast(), v);
                }
            }
            o[w.div_ceil(16) * 16..].fill(0);
        }
    }
}

/// Asks for the cache lines of `s` (a prefetch neither faults nor waits).
#[inline(always)]
fn prefetch<T>(s: &[T]) {
    let (p, bytes) = (s.as_ptr().cast::<i8>(), std::mem::size_of_val(s));
    for at in (0..bytes).step_by(64).chain([bytes.saturating_sub(1)]) {
        // SAFETY: SSE is x86-64's baseline; a prefetch of any address is harmless.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at)) };
    }
}

/// A mask of the lowest `n` of 16 lanes.
#[inline(always)]
fn low_bits(n: usize) -> u16 {
    ((1u32 << n.min(16)) - 1) as u16
}

/// One `MR × 16·R` tile over `kp` pairs: `tile = Σ_p a[p] · b[p]`, rows `16·R` apart.
///
/// # Safety
/// `a` holds `kp · MR` and `b` `kp · 16·R` dwords, `tile` at least `MR · 16·R`; the CPU has
/// AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro<const R: usize>(kp: usize, a: *const u32, b: *const u32, tile: &mut [f32]) {
    debug_assert!(tile.len() >= MR * 16 * R);
    // SAFETY: in bounds by the contract; unaligned loads and stores.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; MR];
        for p in 0..kp {
            let bp = b.add(p * 16 * R);
            let bv: [__m512bh; R] =
                std::array::from_fn(|j| bh(_mm512_loadu_si512(bp.add(16 * j).cast())));
            let ap = a.add(p * MR);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = bh(_mm512_set1_epi32(*ap.add(r) as i32));
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_dpbf16_ps(*acc, av, bv);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, &v) in acc.iter().enumerate() {
                _mm512_storeu_ps(tile.as_mut_ptr().add((r * R + j) * 16), v);
            }
        }
    }
}

/// 32 bf16 values from their bits.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain vectors; every bit pattern is a valid bf16 vector.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Transposes a 16 × 16 block of dwords (`rows[i]` lane `j` to `out[j]` lane `i`).
#[inline(always)]
unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // SAFETY: register-only shuffles; the caller's function enables AVX-512.
    unsafe {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for h in 0..2 {
            let o = 8 * h;
            for i in 0..4 {
                t[o + i] = _mm512_shuffle_i32x4::<0x88>(u[o + i], u[o + 4 + i]);
                t[o + 4 + i] = _mm512_shuffle_i32x4::<0xdd>(u[o + i], u[o + 4 + i]);
            }
        }
        for i in 0..8 {
            u[i] = _mm512_shuffle_i32x4::<0x88>(t[i], t[8 + i]);
            u[8 + i] = _mm512_shuffle_i32x4::<0xdd>(t[i], t[8 + i]);
        }
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engines this CPU runs.
    fn engines() -> Vec<Engine> {
        let tiles = amx::available().then_some(Engine::Tiles);
        available()
            .then_some(Engine::Vector)
            .into_iter()
            .chain(tiles)
            .collect()
    }

    /// Values of a test operand, in ±0.6 steps of 0.1 (exact products, no denormals).
    fn value(i: usize) -> bf16 {
        bf16::from_f32((i * 7 % 13) as f32 * 0.1 - 0.6)
    }

    /// A scratch that holds one B slot and one row block of A at a time gives the bits of one
    /// that holds everything: passes of rows and fewer slots only reorder the same work. The
    /// last shape's B is past [`WHOLE_B_BYTES`], so each task packs its panels. On AMX the
    /// per-task panels deeper than [`AMX_DEPTH_PAIRS`] run a depth block at a time, and the
    /// 300-deep shape's whole B (packed whole with room for it) runs the whole depth at once;
    /// its 10 row blocks make two groups.
    #[test]
    fn row_passes_and_fewer_slots_give_the_same_bits() {
        let shapes = [
            (37, 70, 100),
            (37, 71, 16),
            (40, 16, 100),
            (150, 300, 100),
            (40, 530, 530),
        ];
        for (m, k, n) in shapes {
            same_bits_in_any_scratch((m, k, n));
        }
    }

    fn same_bits_in_any_scratch((m, k, n): (usize, usize, usize)) {
        let a: Vec<bf16> = (0..m * k).map(value).collect();
        let b: Vec<bf16> = (0..k * n).map(|i| value(i + 5)).collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
        for engine in engines() {
            let run = |len: usize, b_trans: bool| {
                let mut c = vec![0f32; m * n];
                let b = if b_trans {
                    Operand::new(&b[..], k, true)
                } else {
                    Operand::new(&b[..], n, false)
                };
                let a = Operand::new(&a[..], k, false);
                let dims = (m, k, n);
                product_on(
                    engine,
                    &mut c,
                    a,
                    b,
                    dims,
                    Init::Bias(&bias),
                    &mut vec![0f32; len],
                );
                c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let kp = engine.pairs(k);
            let nc = 16 * engine.vectors(n);
            let (a_block, b_len) = (kp * engine.rows(), kp * nc);
            let packed_b = n.div_ceil(nc) * b_len;
            for b_trans in [false, true] {
                let whole = run(packed_b + (m + 16) * kp, b_trans);
                assert_eq!(
                    run(a_block + b_len, b_trans),
                    whole,
                    "{engine:?}: one block a pass"
                );
                let three = run(3 * a_block + b_len + 7, b_trans);
                assert_eq!(three, whole, "{engine:?}: three a pass");
            }
        }
    }

    /// Shapes off every block edge (rows not a multiple of 16, columns of 48, depth odd and not
    /// a multiple of 32), LoRA's thin ones: outputs one or two vectors wide (narrowed panels,
    /// packed whole) and a depth shorter than 16 pairs (masked register transposes); and one
    /// deeper than [`DEPTH_BLOCK`], in two blocks, the second odd.
    const SHAPES: [(usize, usize, usize); 5] = [
        (37, 71, 100),
        (37, 71, 16),
        (40, 16, 100),
        (40, 70, 20),
        (20, DEPTH_BLOCK + 99, 40),
    ];

    /// A scratch that holds the deep shape's f32 result beside the packs of a block.
    const SCRATCH: usize = 1 << 18;

    /// An f32 A (the LM head's dlogits) gives the bits of its bf16 rounding, in every layout
    /// and engine, through the vector packs and their scalar tails alike.
    #[test]
    fn an_f32_a_is_its_bf16_rounding() {
        for engine in engines() {
            for (m, k, n) in SHAPES {
                let a: Vec<f32> = (0..m * k)
                    .map(|i| value(i).to_f32() * 1.003 + 1e-4)
                    .collect();
                let rounded: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
                assert!(a.iter().zip(&rounded).any(|(x, r)| *x != r.to_f32()));
                let b: Vec<bf16> = (0..k * n).map(|i| value(3 * i + 1)).collect();
                for (a_trans, b_trans) in [(false, false), (true, true)] {
                    let (a_ld, b_ld) = (if a_trans { m } else { k }, if b_trans { k } else { n });
                    let ob = Operand::new(&b[..], b_ld, b_trans);
                    let got =
                        bf16_product(engine, Operand::new(&a[..], a_ld, a_trans), ob, (m, k, n));
                    let want = bf16_product(
                        engine,
                        Operand::new(&rounded[..], a_ld, a_trans),
                        ob,
                        (m, k, n),
                    );
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "{engine:?} {m}×{k}×{n} a_trans {a_trans}"
                    );
                }
            }
        }
    }

    /// `op(a) (m, k) · op(b) (k, n)` as bf16, with [`SCRATCH`].
    fn bf16_product<A: Source>(
        engine: Engine,
        a: Operand<'_, A>,
        b: Operand<'_, bf16>,
        (m, k, n): (usize, usize, usize),
    ) -> Vec<bf16> {
        let mut c = vec![bf16::ZERO; m * n];
        let scratch = &mut vec![0f32; SCRATCH];
        product_on(engine, &mut c, a, b, (m, k, n), Init::<f32>::Zero, scratch);
        c
    }

    /// Every engine gives the exact (f64) product within the rounding of an f32 sum over the
    /// depth, for each operand stored either way, with its packs in the scratch or (a scratch
    /// too short) on the heap, for every shape of [`SHAPES`].
    #[test]
    fn every_engine_matches_the_f64_product() {
        for (m, k, n) in SHAPES {
            matches_the_f64_product((m, k, n));
        }
    }

    fn matches_the_f64_product((m, k, n): (usize, usize, usize)) {
        let a: Vec<bf16> = (0..m * k).map(value).collect();
        let b: Vec<bf16> = (0..k * n).map(|i| value(3 * i + 5)).collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01).collect();
        let layouts = [(false, false), (false, true), (true, false), (true, true)];
        let cases = layouts.into_iter().flat_map(|l| [(l, false), (l, true)]);
        for engine in engines() {
            for ((a_trans, b_trans), short) in cases.clone() {
                // Logical (i, kk) of A and (kk, j) of B, wherever they are stored.
                let (a_ld, b_ld) = (if a_trans { m } else { k }, if b_trans { k } else { n });
                let at = |i: usize, kk: usize| if a_trans { kk * m + i } else { i * k + kk };
                let bt = |kk: usize, j: usize| if b_trans { j * k + kk } else { kk * n + j };
                let mut c = vec![0f32; m * n];
                let (oa, ob) = (
                    Operand::new(&a[..], a_ld, a_trans),
                    Operand::new(&b[..], b_ld, b_trans),
                );
                let len = if short {
                    crate::matmul::MIN_SCRATCH
                } else {
                    1 << 16
                };
                let (scratch, init) = (&mut vec![0f32; len], Init::Bias(&bias[..]));
                product_on(engine, &mut c, oa, ob, (m, k, n), init, scratch);
                for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
                    let terms = (0..k).map(|kk| f64::from(a[at(i, kk)]) * f64::from(b[bt(kk, j)]));
                    let (sum, size) = terms.fold(
                        (f64::from(bias[j]), f64::from(bias[j]).abs()),
                        |(s, z), t| (s + t, z + t.abs()),
                    );
                    let bound = (k + 2) as f64 * f64::from(f32::EPSILON) * size;
                    let got = f64::from(c[i * n + j]);
                    assert!(
                        (got - sum).abs() <= bound,
                        "{engine:?} a_trans {a_trans} b_trans {b_trans} short {short} ({i}, {j}): \
                         {got} vs {sum} (bound {bound})"
                    );
                }
            }
        }
    }

    /// A bf16 output is the f32 result rounded once: added to the prior value (`Init::Read`)
    /// or alone (`Init::Zero`), as the slice casts round.
    #[test]
    fn bf16_outputs_round_the_f32_result_once() {
        for engine in engines() {
            for (m, k, n) in SHAPES {
                let a: Vec<bf16> = (0..m * k).map(value).collect();
                let b: Vec<bf16> = (0..k * n).map(|i| value(5 * i + 1)).collect();
                let prior: Vec<bf16> = (0..m * n).map(|i| value(i + 3)).collect();
                let (oa, ob) = (
                    Operand::new(&a[..], k, false),
                    Operand::new(&b[..], n, false),
                );
                let scratch = &mut vec![0f32; SCRATCH];
                let mut exact = vec![0f32; m * n];
                let zero = || Init::<f32>::Zero;
                product_on(engine, &mut exact, oa, ob, (m, k, n), zero(), scratch);
                let mut sum = prior.clone();
                product_on(
                    engine,
                    &mut sum,
                    oa,
                    ob,
                    (m, k, n),
                    Init::<f32>::Read,
                    scratch,
                );
                let mut alone = vec![bf16::ZERO; m * n];
                product_on(engine, &mut alone, oa, ob, (m, k, n), zero(), scratch);
                for i in 0..m * n {
                    let want = bf16::from_f32(prior[i].to_f32() + exact[i]);
                    assert_eq!(
                        sum[i].to_bits(),
                        want.to_bits(),
                        "{engine:?} {m}×{k}×{n} [{i}]"
                    );
                    let want = bf16::from_f32(exact[i]);
                    assert_eq!(
                        alone[i].to_bits(),
                        want.to_bits(),
                        "{engine:?} {m}×{k}×{n} [{i}]"
                    );
                }
            }
        }
    }

    /// [`Small`]'s products are [`product`]'s, bit for bit, written or added, for A as bf16 or
    /// as an f32 transpose (attention's probabilities), B packed plain or transposed, shapes
    /// off the micro-tile's edges.
    #[test]
    fn small_products_are_products() {
        for engine in engines() {
            let mut small = Small::on(engine);
            let mut panels = Panels::default();
            for (m, k, n) in [
                (64, 64, 64),
                (37, 20, 64),
                (64, 64, 20),
                (5, 3, 17),
                (9, 7, 256),
            ] {
                let a16: Vec<bf16> = (0..m * k).map(value).collect();
                let a32: Vec<f32> = (0..m * k).map(|i| value(i).to_f32() * 1.003).collect();
                let b: Vec<bf16> = (0..k * n).map(|i| value(3 * i + 1)).collect();
                let prior: Vec<f32> = (0..m * n).map(|i| value(i + 2).to_f32()).collect();
                for b_trans in [false, true] {
                    let ob = Operand::new(&b[..], if b_trans { k } else { n }, b_trans);
                    small.pack(ob, (k, n), &mut panels);
                    let cases = [
                        compare(
                            &mut small,
                            &panels,
                            Operand::new(&a16[..], k, false),
                            ob,
                            m,
                            None,
                        ),
                        compare(
                            &mut small,
                            &panels,
                            Operand::new(&a32[..], m, true),
                            ob,
                            m,
                            Some(&prior),
                        ),
                    ];
                    for ((got, want), what) in cases
                        .iter()
                        .zip(["bf16 A, written", "f32 A transposed, added"])
                    {
                        let same = got
                            .iter()
                            .zip(want)
                            .all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(same, "{engine:?} {m}×{k}×{n} b_trans {b_trans}: {what}");
                    }
                }
            }
        }
    }

    /// `small`'s product, written (`prior` None, over NaN) or added to `prior`, beside
    /// [`product_on`]'s; `small` writes rows `LDC` apart and must leave the rest of them alone.
    fn compare<A: Source>(
        small: &mut Small,
        panels: &Panels,
        a: Operand<'_, A>,
        b: Operand<'_, bf16>,
        m: usize,
        prior: Option<&[f32]>,
    ) -> (Vec<f32>, Vec<f32>) {
        const LDC: usize = 300;
        let (n, k) = (panels.n, panels.k);
        let (mut want, init) = match prior {
            Some(p) => (p.to_vec(), Init::<f32>::Read),
            None => (vec![f32::NAN; m * n], Init::Zero),
        };
        let mut got = vec![f32::NAN; m * LDC];
        for (row, w) in got.chunks_exact_mut(LDC).zip(want.chunks_exact(n)) {
            row[..n].copy_from_slice(w);
        }
        small.product(&mut got, LDC, a, m, panels, prior.is_some());
        assert!(
            got.chunks_exact(LDC)
                .all(|r| r[n..].iter().all(|x| x.is_nan()))
        );
        let scratch = &mut vec![0f32; SCRATCH];
        product_on(small.engine, &mut want, a, b, (m, k, n), init, scratch);
        let got = got
            .chunks_exact(LDC)
            .flat_map(|r| &r[..n])
            .copied()
            .collect();
        (got, want)
    }

    /// A [`Residual`] A packs as the bf16 rounding of `x - bf16(x)`, through the vector loads
    /// and the scalar tails; with the value's own rounding it is within 2⁻¹⁷ of the value (the
    /// residual is at most 2⁻⁸ of it, and its own rounding loses at most 2⁻⁹ of that).
    #[test]
    fn a_residual_is_what_the_rounding_leaves() {
        let (m, k, n) = (40, 70, 20);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        for &x in &x {
            let (hi, lo) = (bf16::from_f32(x), Residual(x).to_bf16());
            let kept = f64::from(hi) + f64::from(lo);
            assert!(
                (kept - f64::from(x)).abs() <= f64::from(x).abs() * 2f64.powi(-17),
                "{x}"
            );
        }
        let lo: Vec<bf16> = x.iter().map(|&x| Residual(x).to_bf16()).collect();
        let b: Vec<bf16> = (0..k * n).map(|i| value(3 * i + 1)).collect();
        let ob = Operand::new(&b[..], n, false);
        for engine in engines() {
            for a_trans in [false, true] {
                let ld = if a_trans { m } else { k };
                let got = bf16_product(
                    engine,
                    Operand::new(Residual::of(&x), ld, a_trans),
                    ob,
                    (m, k, n),
                );
                let want = bf16_product(engine, Operand::new(&lo[..], ld, a_trans), ob, (m, k, n));
                assert_eq!(got, want, "{engine:?} a_trans {a_trans}");
            }
        }
    }

    #[test]
    fn transpose16_transposes() {
        if !available() {
            return;
        }
        let m: Vec<u32> = (0..256).collect();
        #[target_feature(enable = "avx512f")]
        unsafe fn run(m: &[u32]) -> Vec<u32> {
            // SAFETY: 16 rows of 16 dwords in and out.
            unsafe {
                let rows = std::array::from_fn(|i| _mm512_loadu_si512(m[16 * i..].as_ptr().cast()));
                let mut out = vec![0u32; 256];
                for (i, v) in transpose16(rows).into_iter().enumerate() {
                    _mm512_storeu_si512(out[16 * i..].as_mut_ptr().cast(), v);
                }
                out
            }
        }
        // SAFETY: available() checked the features.
        let t = unsafe { run(&m) };
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(t[16 * i + j], m[16 * j + i], "({i}, {j})");
            }
        }
    }
}
