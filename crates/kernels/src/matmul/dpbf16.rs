//! bf16 · bf16 products on AVX512-BF16: `vdpbf16ps` multiplies 16 pairs of bf16 values and
//! adds both products into 16 f32 lanes, twice the multiply-adds of an f32 FMA per
//! instruction (and per cycle on Zen 4).
//!
//! Numerics: a product of two bf16 values is exact in f32; the instruction adds the product
//! of the pair's high halves and then that of the low halves, each addition rounded to
//! nearest even, with denormal inputs and results flushed to zero (what FTZ/DAZ training
//! threads do anyway). Packing element `2p` into the high half makes every output element an
//! f32 fused multiply-add chain over its whole depth in k order, as an sgemm micro-kernel
//! computes it within one depth block, computed by one thread; `init` (bias or the prior
//! value) is added afterwards and the sum rounded once on store. The result does not depend
//! on the pool, the tiling or the task split.
//!
//! Layout: A is packed once per call, per 8-row block as `[pair][row]` u32 (two bf16 in one
//! dword); each task packs one 48-column panel of B as `[pair][column]` u32 and runs 8 × 48
//! micro-tiles (24 zmm accumulators) over every row block of its row range. Both packs are
//! heap scratch of `m·k` and `48·k` bf16 (rounded up to pairs).

use half::bf16;
use std::arch::x86_64::*;

use super::{Init, Operand};
use crate::Float;
use crate::par::{SharedMut, for_ranges};

/// Rows of a micro-tile (one broadcast each per pair).
const MR: usize = 8;
/// zmm registers per micro-tile row.
const NR: usize = 3;
/// Columns of a micro-tile and of a packed B panel.
const NC: usize = 16 * NR;
/// Tasks to aim for when B has few panels (rows are then split too).
const MIN_TASKS: usize = 16;

/// Whether this CPU has the instructions the kernel uses.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

/// `c (m, n) = init + op(a) (m, k) · op(b) (k, n)`, `c` row-major; see the module notes.
/// Callers check [`available`].
pub(super) fn product<C: Float, I: Float>(
    c: &mut [C],
    a: Operand<'_, bf16>,
    b: Operand<'_, bf16>,
    (m, k, n): (usize, usize, usize),
    init: Init<'_, I>,
) {
    let kp = k.div_ceil(2);
    let blocks = m.div_ceil(MR);
    let mut pa = vec![0u32; blocks * kp * MR];
    {
        let dst = SharedMut::new(&mut pa);
        for_ranges(blocks, 1, |r| {
            for rb in r {
                // SAFETY: each row block owns its part of the pack.
                let out = unsafe { dst.slice(rb * kp * MR..(rb + 1) * kp * MR) };
                // SAFETY: `available` was checked by the caller.
                unsafe { pack_a(&a, rb * MR, m, k, out) };
            }
        });
    }
    let panels = n.div_ceil(NC);
    let per_chunk = blocks.div_ceil(MIN_TASKS.div_ceil(panels).clamp(1, blocks));
    let chunks = blocks.div_ceil(per_chunk);
    let (out, pa) = (SharedMut::new(c), &pa[..]);
    for_ranges(panels * chunks, 1, |tasks| {
        let mut pb = vec![0u32; kp * NC];
        let mut tile = [0f32; MR * NC];
        for task in tasks {
            let (panel, chunk) = (task / chunks, task % chunks);
            let (j0, w) = (panel * NC, NC.min(n - panel * NC));
            // SAFETY: `available` was checked by the caller.
            unsafe { pack_b(&b, j0, w, k, &mut pb) };
            for rb in chunk * per_chunk..((chunk + 1) * per_chunk).min(blocks) {
                // SAFETY: the packs hold kp pairs of MR rows and NC columns; features checked.
                unsafe { micro(kp, pa[rb * kp * MR..].as_ptr(), pb.as_ptr(), &mut tile) };
                let i0 = rb * MR;
                for (r, t) in tile.chunks_exact(NC).take(MR.min(m - i0)).enumerate() {
                    let at = (i0 + r) * n + j0;
                    // SAFETY: tasks own disjoint (row range, panel) blocks of c.
                    store(unsafe { out.slice(at..at + w) }, &t[..w], &init, j0);
                }
            }
        }
    });
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

/// Rows `i0..i0 + MR` of `op(a)` as `[pair][row]`; rows past `m` and the odd tail of k stay 0.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a(a: &Operand<'_, bf16>, i0: usize, m: usize, k: usize, out: &mut [u32]) {
    let zero = bf16::ZERO;
    for r in 0..MR.min(m - i0) {
        let i = i0 + r;
        let at = |kk: usize| {
            if kk < k {
                a.data[a.offset(i, kk)]
            } else {
                zero
            }
        };
        if a.trans {
            for (p, o) in out.iter_mut().skip(r).step_by(MR).enumerate() {
                *o = pair(at(2 * p), at(2 * p + 1));
            }
        } else {
            let row = &a.data[i * a.ld..][..k];
            let (pairs, tail) = row.as_chunks::<2>();
            for (o, &[lo, hi]) in out.iter_mut().skip(r).step_by(MR).zip(pairs) {
                *o = pair(lo, hi);
            }
            if let [last] = tail {
                out[(k / 2) * MR + r] = pair(*last, zero);
            }
        }
    }
}

/// Columns `j0..j0 + w` of `op(b)` as `[pair][column]`, `NC` columns per pair (zeros past `w`
/// and in the odd tail of k).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b(b: &Operand<'_, bf16>, j0: usize, w: usize, k: usize, out: &mut [u32]) {
    let zero = bf16::ZERO;
    if b.trans {
        // Column j of op(b) is row j of the data: its pairs are adjacent.
        out.fill(0);
        for c in 0..w {
            let col = &b.data[(j0 + c) * b.ld..][..k];
            let (pairs, tail) = col.as_chunks::<2>();
            for (o, &[lo, hi]) in out[c..].iter_mut().step_by(NC).zip(pairs) {
                *o = pair(lo, hi);
            }
            if let [last] = tail {
                out[(k / 2) * NC + c] = pair(*last, zero);
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
                _ => unreachable!("pairs cover k"),
            }
            o[w..].fill(0);
        }
    }
}

/// One `MR × NC` tile over `kp` pairs: `tile = Σ_p a[p] · b[p]`.
///
/// # Safety
/// `a` holds `kp · MR` and `b` `kp · NC` dwords; the CPU has AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro(kp: usize, a: *const u32, b: *const u32, tile: &mut [f32; MR * NC]) {
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
