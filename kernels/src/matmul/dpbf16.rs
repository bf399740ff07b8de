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
//! (AMX: 16 × 48) micro-tiles over every row block of its row range. The packs live in the
//! caller's matmul scratch (which the memory model counts): `48·k` bf16 per B slot, and as
//! many rows of A as then fit, a pass of rows at a time.

use half::bf16;
use rayon::prelude::*;
use std::arch::x86_64::*;

use super::{Init, Operand, amx};
use crate::Float;
use crate::par::{SharedMut, for_ranges};

/// Rows of a micro-tile (one broadcast each per pair).
const MR: usize = 8;
/// zmm registers per micro-tile row.
const NR: usize = 3;
/// Columns of a micro-tile and of a packed B panel.
pub(super) const NC: usize = 16 * NR;
/// Tasks to aim for when B has few panels (rows are then split too).
const MIN_TASKS: usize = 16;

/// Whether this CPU has the instructions the kernel uses.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
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

    /// Pairs of depth the packs hold for depth `k`: tiles take whole steps of
    /// [`amx::PAIRS`], padded with zeros.
    fn pairs(self, k: usize) -> usize {
        match self {
            Self::Vector => k.div_ceil(2),
            Self::Tiles => k.div_ceil(2 * amx::PAIRS) * amx::PAIRS,
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
/// time. Only a scratch too short for one slot and one row block ([`packs_len`]; the
/// trainer's is sized for its deepest product) sends the packs to the heap. Callers check
/// [`available`] and pass a depth `k > 0`.
pub(super) fn product<C: Float, I: Float>(
    c: &mut [C],
    a: Operand<'_, bf16>,
    b: Operand<'_, bf16>,
    dims: (usize, usize, usize),
    init: Init<'_, I>,
    scratch: &mut [f32],
) {
    product_on(Engine::best(), c, a, b, dims, init, scratch);
}

/// [`product`] on the given engine.
fn product_on<C: Float, I: Float>(
    engine: Engine,
    c: &mut [C],
    a: Operand<'_, bf16>,
    b: Operand<'_, bf16>,
    (m, k, n): (usize, usize, usize),
    init: Init<'_, I>,
    scratch: &mut [f32],
) {
    let (mr, kp) = (engine.rows(), engine.pairs(k));
    let blocks = m.div_ceil(mr);
    let (a_block, b_len) = (kp * mr, kp * NC);
    let mut heap = Vec::new();
    let packs: &mut [u32] = if scratch.len() >= a_block + b_len {
        // SAFETY: f32 and u32 have the same size and alignment; any bits are valid u32.
        unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast(), scratch.len()) }
    } else {
        heap.resize(a_block + b_len, 0u32);
        &mut heap
    };
    let slots = rayon::current_num_threads()
        .min((packs.len() - a_block) / b_len)
        .max(1);
    let pass = ((packs.len() - slots * b_len) / a_block).min(blocks);
    let (pbs, pa) = packs.split_at_mut(slots * b_len);
    let panels = n.div_ceil(NC);
    let out = SharedMut::new(c);
    for first in (0..blocks).step_by(pass) {
        let rows = pass.min(blocks - first);
        {
            let dst = SharedMut::new(pa);
            for_ranges(rows, 1, |r| {
                for rb in r {
                    // SAFETY: each row block owns its part of the pack.
                    let out = unsafe { dst.slice(rb * a_block..(rb + 1) * a_block) };
                    let i0 = (first + rb) * mr;
                    match engine {
                        // SAFETY: `available` was checked by the caller.
                        Engine::Vector => unsafe { pack_a(&a, i0, m, k, out) },
                        Engine::Tiles => pack_a_rows(&a, i0, m, k, out),
                    }
                }
            });
        }
        let per_chunk = rows.div_ceil(MIN_TASKS.div_ceil(panels).clamp(1, rows));
        let chunks = rows.div_ceil(per_chunk);
        let tasks = panels * chunks;
        let (pa, pbs) = (&*pa, SharedMut::new(pbs));
        // Slot s takes every slots-th task, so a slot is one thread's at a time.
        (0..slots).into_par_iter().for_each(|slot| {
            // SAFETY: slots are disjoint.
            let pb = unsafe { pbs.slice(slot * b_len..(slot + 1) * b_len) };
            // The tiles stay configured for the slot's whole run: nothing below calls into
            // rayon, where this thread could steal another slot and reconfigure them.
            // SAFETY: `Engine::Tiles` is chosen only where `amx::available`.
            let _tiles = (engine == Engine::Tiles).then(|| unsafe { amx::Tiles::configure() });
            let mut tile = [0f32; amx::ROWS * NC];
            for task in (slot..tasks).step_by(slots) {
                let (panel, chunk) = (task / chunks, task % chunks);
                let (j0, w) = (panel * NC, NC.min(n - panel * NC));
                // SAFETY: `available` was checked by the caller.
                unsafe { pack_b(&b, j0, w, k, pb) };
                for rb in chunk * per_chunk..((chunk + 1) * per_chunk).min(rows) {
                    let pa = pa[rb * a_block..].as_ptr();
                    // SAFETY: the packs hold kp pairs of the engine's rows and NC columns;
                    // features checked; tiles configured on this thread above.
                    unsafe {
                        match engine {
                            Engine::Vector => micro(kp, pa, pb.as_ptr(), &mut tile),
                            Engine::Tiles => amx::micro(kp, pa, pb.as_ptr(), tile.as_mut_ptr()),
                        }
                    }
                    let i0 = (first + rb) * mr;
                    for (r, t) in tile.chunks_exact(NC).take(mr.min(m - i0)).enumerate() {
                        let at = (i0 + r) * n + j0;
                        // SAFETY: tasks own disjoint (row range, panel) blocks of c.
                        store(unsafe { out.slice(at..at + w) }, &t[..w], &init, j0);
                    }
                }
            }
        });
    }
}

/// `row = round(init + t)` for the columns `j0..` of one output row.
#[inline]
fn store<C: Float, I: Float>(row: &mut [C], t: &[f32], init: &Init<'_, I>, j0: usize) {
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

/// Elements `2p` and `2p + 1` of a pair as one dword. The instruction adds the product of
/// the high halves first, so element `2p` goes there: the accumulation runs in k order.
#[inline(always)]
fn pair(first: bf16, second: bf16) -> u32 {
    u32::from(first.to_bits()) << 16 | u32::from(second.to_bits())
}

/// Rows `i0..i0 + MR` of `op(a)` as `[pair][row]`; rows past `m` and the odd tail of k are 0.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a(a: &Operand<'_, bf16>, i0: usize, m: usize, k: usize, out: &mut [u32]) {
    let (h, zero) = (MR.min(m - i0), bf16::ZERO);
    if a.trans {
        // Element (i, kk) is data[kk·ld + i]: each pair is two runs of h rows.
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
                        *o = pair(x, zero);
                    }
                }
                _ => unreachable!("pairs cover k"),
            }
            o[h..].fill(0);
        }
    } else {
        // Row i is data[i·ld..][..k]: its pairs are adjacent.
        for r in 0..MR {
            let slots = out.iter_mut().skip(r).step_by(MR);
            if r >= h {
                slots.for_each(|o| *o = 0);
                continue;
            }
            let (pairs, tail) = a.data[(i0 + r) * a.ld..][..k].as_chunks::<2>();
            for (o, &[x, y]) in slots.zip(pairs) {
                *o = pair(x, y);
            }
            if let [last] = tail {
                out[(k / 2) * MR + r] = pair(*last, zero);
            }
        }
    }
}

/// Rows `i0..i0 + 16` of `op(a)` as `[row][pair]`, `out.len() / 16` pairs a row (the AMX
/// layout); rows past `m` and depth past `k` are 0.
fn pack_a_rows(a: &Operand<'_, bf16>, i0: usize, m: usize, k: usize, out: &mut [u32]) {
    let (h, zero) = (amx::ROWS.min(m - i0), bf16::ZERO);
    let kp = out.len() / amx::ROWS;
    let full = k / 2;
    out[h * kp..].fill(0);
    if a.trans {
        // Element (i, kk) is data[kk·ld + i]: pair p of every row from two runs of h rows.
        let at = |kk: usize, r: usize| {
            if kk < k {
                a.data[kk * a.ld + i0 + r]
            } else {
                zero
            }
        };
        for p in 0..kp {
            for r in 0..h {
                out[r * kp + p] = pair(at(2 * p, r), at(2 * p + 1, r));
            }
        }
    } else {
        // Row i is data[i·ld..][..k]: its pairs are adjacent.
        for (r, o) in out.chunks_exact_mut(kp).take(h).enumerate() {
            let (pairs, tail) = a.data[(i0 + r) * a.ld..][..k].as_chunks::<2>();
            for (o, &[x, y]) in o.iter_mut().zip(pairs) {
                *o = pair(x, y);
            }
            let rest = &mut o[full..];
            rest.fill(0);
            if let [last] = tail {
                rest[0] = pair(*last, zero);
            }
        }
    }
}

/// Columns `j0..j0 + w` of `op(b)` as `[pair][column]`, `NC` columns per pair, as many pairs
/// as `out` holds (zeros past `w` and past the depth).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b(b: &Operand<'_, bf16>, j0: usize, w: usize, k: usize, out: &mut [u32]) {
    let zero = bf16::ZERO;
    if b.trans {
        // Column j of op(b) is row j of the data: its pairs are adjacent dwords (first element
        // in the low half, so rotated by 16). Blocks of 16 columns × 16 pairs are transposed
        // in registers; the rest goes one dword at a time.
        let full = k / 2;
        let (c16, p16) = (w / 16 * 16, full / 16 * 16);
        let col = |c: usize| &b.data[(j0 + c) * b.ld..][..k];
        for c0 in (0..c16).step_by(16) {
            for p0 in (0..p16).step_by(16) {
                // SAFETY: columns c0..c0 + 16 hold pairs p0..p0 + 16; out holds NC per pair.
                unsafe {
                    let rows: [__m512i; 16] = std::array::from_fn(|j| {
                        let src = col(c0 + j)[2 * p0..].as_ptr();
                        _mm512_rol_epi32::<16>(_mm512_loadu_si512(src.cast()))
                    });
                    for (p, v) in transpose16(rows).into_iter().enumerate() {
                        _mm512_storeu_si512(out[(p0 + p) * NC + c0..].as_mut_ptr().cast(), v);
                    }
                }
            }
        }
        for c in 0..NC {
            let (from, src) = if c < c16 {
                (p16, Some(col(c)))
            } else {
                (0, (c < w).then(|| col(c)))
            };
            for p in from..out.len() / NC {
                out[p * NC + c] = match src {
                    Some(s) if 2 * p + 1 < k => pair(s[2 * p], s[2 * p + 1]),
                    Some(s) if 2 * p < k => pair(s[2 * p], zero),
                    _ => 0,
                };
            }
        }
    } else {
        for (p, o) in out.chunks_exact_mut(NC).enumerate() {
            let row = |kk: usize| (kk < k).then(|| &b.data[kk * b.ld + j0..][..w]);
            match (row(2 * p), row(2 * p + 1)) {
                (Some(lo), Some(hi)) => {
                    for ((o, &l), &h) in o.iter_mut().zip(lo).zip(hi) {
                        *o = pair(l, h);
                    }
                }
                (Some(lo), None) => {
                    for (o, &l) in o.iter_mut().zip(lo) {
                        *o = pair(l, zero);
                    }
                }
                // Depth padding (AMX packs whole tile steps).
                (None, _) => o.fill(0),
            }
            o[w..].fill(0);
        }
    }
}

/// One `MR × NC` tile over `kp` pairs: `tile = Σ_p a[p] · b[p]`.
///
/// # Safety
/// `a` holds `kp · MR` and `b` `kp · NC` dwords, `tile` at least `MR · NC`; the CPU has
/// AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro(kp: usize, a: *const u32, b: *const u32, tile: &mut [f32]) {
    debug_assert!(tile.len() >= MR * NC);
    // SAFETY: in bounds by the contract; unaligned loads and stores.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        for p in 0..kp {
            let bp = b.add(p * NC);
            let bv: [__m512bh; NR] = [
                bh(_mm512_loadu_si512(bp.cast())),
                bh(_mm512_loadu_si512(bp.add(16).cast())),
                bh(_mm512_loadu_si512(bp.add(32).cast())),
            ];
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
                _mm512_storeu_ps(tile.as_mut_ptr().add(r * NC + 16 * j), v);
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
    /// that holds everything: passes of rows and fewer slots only reorder the same work.
    #[test]
    fn row_passes_and_fewer_slots_give_the_same_bits() {
        let (m, k, n) = (37, 70, 100);
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
            let (a_block, b_len) = (kp * engine.rows(), kp * NC);
            for b_trans in [false, true] {
                let whole = run(1 << 16, b_trans);
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

    /// Every engine gives the exact (f64) product within the rounding of an f32 sum over the
    /// depth, for each operand stored either way, with its packs in the scratch or (a scratch
    /// too short) on the heap, and a shape off every block edge (rows not a multiple of 16,
    /// columns of 48, depth odd and not a multiple of 32).
    #[test]
    fn every_engine_matches_the_f64_product() {
        let (m, k, n) = (37, 71, 100);
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
