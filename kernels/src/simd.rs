//! Run-time choice of an AVX-512 build of the kernels' inner loops.
//!
//! Each hot loop is written once, as plain Rust over `f32` slices and fixed lane arrays, and
//! compiled twice: at the crate's baseline target, and inside a `#[target_feature]` wrapper
//! where LLVM vectorises the same loops with 16-lane registers. Rust never reassociates or
//! contracts floating-point operations (no fast-math, no implicit FMA), so both builds
//! perform the same operations in the same order and give the same bits; the tests check
//! this kernel by kernel (`tests/determinism.rs`). The AVX-512 build runs when the CPU has
//! the features, unless the calling thread belongs to a pool built with
//! [`crate::cpu::Simd::Portable`].

use std::cell::Cell;

thread_local! {
    /// Set on the threads of a [`crate::cpu::Simd::Portable`] pool.
    static PORTABLE: Cell<bool> = const { Cell::new(false) };
}

/// Makes the calling thread run the baseline build (`true`) or the detected one.
pub(crate) fn set_portable(portable: bool) {
    PORTABLE.with(|p| p.set(portable));
}

/// Whether the AVX-512 build may run on this thread.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn avx512() -> bool {
    avx512_detected() && !PORTABLE.with(Cell::get)
}

/// Whether this CPU has the features the AVX-512 build is compiled for.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn avx512_detected() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vl")
        && has!("avx512dq")
        && has!("fma")
        && has!("f16c")
}

/// Runs `f`, compiled for AVX-512 when [`avx512`] says so. Pass an `#[inline(always)]`
/// closure so that its body (and what it inlines) is compiled inside the wrapper.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the wrapper's target features were detected on this CPU.
        return unsafe { with_avx512(f) };
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
