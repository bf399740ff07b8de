//! bf16 · bf16 micro-tiles on AMX (Xeons since Sapphire Rapids): one `tdpbf16ps` multiplies
//! a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 accumulators, 16 times the
//! multiply-adds of a `vdpbf16ps`. Linux hands the tile registers only to a process that asks
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`available`] asks once.
//!
//! Numerics (the SDM's pseudo-code): an instruction sums, per output element, its 32 products
//! in f32 (each exact; each addition rounded to nearest even, denormals flushed), then adds
//! that partial sum to the accumulator. The products are `dpbf16`'s; only their association
//! differs (a partial sum per 32 of depth). An element is still computed by one thread in a
//! fixed order, whatever the pool size or the tiling.
//!
//! Registers: the output tile of 16 × 48 is tmm0-2, the A tile tmm3, the B tiles tmm4-6; every
//! tile is 16 rows of 64 bytes (16 dwords, each a pair of bf16 along the depth).

use std::arch::asm;
use std::sync::OnceLock;

use super::dpbf16::NC;

/// Rows of an A tile, and of the output micro-tile.
pub(super) const ROWS: usize = 16;
/// Pairs (dwords) of depth per tile row: one instruction spans 32 of depth.
pub(super) const PAIRS: usize = 16;

/// Whether this CPU has AMX-BF16 and the kernel let this process use the tiles.
pub(super) fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        // CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && request_tiles()
    })
}

/// Asks Linux for the tile data state (per process, for every thread).
#[cfg(target_os = "linux")]
fn request_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this arch_prctl only extends the process's permitted xstate features.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> bool {
    false
}

/// The tile configuration of one thread's run of micro-tiles; released on drop, so that the
/// thread's context switches stop saving 8 KiB of tile state.
pub(super) struct Tiles(());

impl Tiles {
    /// # Safety
    /// [`available`] returned true.
    pub(super) unsafe fn configure() -> Self {
        // Palette 1; bytes 16.. hold each tile's bytes per row (u16), bytes 48.. its rows.
        let mut cfg = [0u8; 64];
        cfg[0] = 1;
        for t in 0..7 {
            cfg[16 + 2 * t..][..2].copy_from_slice(&(4 * PAIRS as u16).to_le_bytes());
            cfg[48 + t] = ROWS as u8;
        }
        // SAFETY: a valid palette-1 configuration; the caller checked AMX.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.as_ptr(), options(nostack, readonly)) };
        Self(())
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured on this thread (`configure`).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// `tile (16 × NC f32, row-major) = a · b` over `kp` pairs of depth, a multiple of [`PAIRS`]:
/// `a` is 16 rows `lda` dwords apart, `b` is `kp` rows of `NC` dwords. With `add`, the tile's
/// values are the accumulators' start instead of zero: a depth block after the first adds
/// onto the tile as the next steps of one call over the whole depth would (the same bits).
///
/// # Safety
/// [`Tiles`] is configured on this thread; `a`, `b` and `tile` hold `16` rows of `lda ≥ kp`
/// dwords, `kp·NC` and `16·NC` elements.
pub(super) unsafe fn micro(
    kp: usize,
    a: *const u32,
    lda: usize,
    b: *const u32,
    tile: *mut f32,
    add: bool,
) {
    debug_assert!(kp > 0 && kp.is_multiple_of(PAIRS) && lda >= kp);
    // SAFETY: every load and store stays within the three buffers, by the contract.
    unsafe {
        asm!(
            "test {add}, {add}",
            "jz 3f",
            "tileloadd tmm0, [{tile} + {ldb}]",
            "tileloadd tmm1, [{tile} + {ldb} + 64]",
            "tileloadd tmm2, [{tile} + {ldb} + 128]",
            "jmp 2f",
            "3:",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "2:",
            "tileloadd tmm3, [{a} + {lda}]",
            "tileloadd tmm4, [{b} + {ldb}]",
            "tileloadd tmm5, [{b} + {ldb} + 64]",
            "tileloadd tmm6, [{b} + {ldb} + 128]",
            "tdpbf16ps tmm0, tmm3, tmm4",
            "tdpbf16ps tmm1, tmm3, tmm5",
            "tdpbf16ps tmm2, tmm3, tmm6",
            "add {a}, {a_step}",
            "add {b}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{tile} + {ldb}], tmm0",
            "tilestored [{tile} + {ldb} + 64], tmm1",
            "tilestored [{tile} + {ldb} + 128], tmm2",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            steps = inout(reg) kp / PAIRS => _,
            lda = in(reg) lda * 4,
            ldb = in(reg) NC * 4,
            a_step = const PAIRS * 4,
            b_step = in(reg) PAIRS * NC * 4,
            tile = in(reg) tile,
            add = in(reg) usize::from(add),
            options(nostack),
        );
    }
}
