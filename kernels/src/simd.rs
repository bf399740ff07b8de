//! Run-time choice of an AVX-512 or AVX2 build of the kernels' inner loops.
//!
//! Each hot loop is written once, as plain Rust over `f32` slices and fixed lane arrays, and
//! compiled three times: at the crate's baseline target (SSE2 on x86-64), and inside
//! `#[target_feature]` wrappers where LLVM vectorises the same loops with 8-lane (AVX2) or
//! 16-lane (AVX-512) registers. Rust never reassociates or contracts floating-point operations
//! (no fast-math, no implicit FMA), so every build performs the same operations in the same
//! order and gives the same bits; the tests check this kernel by kernel
//! (`tests/determinism.rs`). A thread runs the best build its CPU has, up to the cap of the
//! pool it belongs to ([`crate::cpu::Simd`]).

use std::cell::Cell;
use std::sync::OnceLock;

/// The builds of the inner loops, in the order of the registers they use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Baseline,
    Avx2,
    Avx512,
}

thread_local! {
    /// The best build the calling thread may run (lowered on the threads of a capped pool).
    static CAP: Cell<Level> = const { Cell::new(Level::Avx512) };
}

/// Caps the builds the calling thread runs at `cap`.
pub(crate) fn set_cap(cap: Level) {
    CAP.with(|c| c.set(cap));
}

/// The build the calling thread runs: the best this CPU has, up to the thread's cap.
#[inline]
pub(crate) fn level() -> Level {
    detected().min(CAP.with(Cell::get))
}

/// The best build this CPU has the features for.
pub(crate) fn detected() -> Level {
    static DETECTED: OnceLock<Level> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            // Every feature the wrappers below enable.
            let avx2 = has!("avx2")
                && has!("avx")
                && has!("fma")
                && has!("f16c")
                && has!("bmi1")
                && has!("bmi2")
                && has!("lzcnt")
                && has!("popcnt");
            let avx512 =
                has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq");
            match (avx2, avx512) {
                (true, true) => return Level::Avx512,
                (true, false) => return Level::Avx2,
                _ => {}
            }
        }
        Level::Baseline
    })
}

/// Runs `f`, compiled for the build [`level`] gives. Pass an `#[inline(always)]` closure so
/// that its body (and what it inlines) is compiled inside the wrappers.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: each wrapper's target features were detected on this CPU.
    #[cfg(target_arch = "x86_64")]
    match level() {
        Level::Avx512 => return unsafe { with_avx512(f) },
        Level::Avx2 => return unsafe { with_avx2(f) },
        Level::Baseline => {}
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(
    enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,avx,fma,f16c,bmi1,bmi2,lzcnt,popcnt"
)]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx,fma,f16c,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
