//! Per-thread CPU settings for training threads.

/// Set FTZ (flush-to-zero) and DAZ (denormals-are-zero) in the calling thread's MXCSR.
///
/// Optimizer states decay towards denormals, which are ~100x slower on x86; llm.c gets the
/// same effect from `-Ofast`. No-op on other architectures.
pub fn flush_denormals() {
    #[cfg(target_arch = "x86_64")]
    {
        const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
        let csr = mxcsr();
        // SAFETY: ldmxcsr only changes this thread's SSE rounding/flush mode; the value keeps
        // every other bit as it was.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &(csr | FTZ_DAZ), options(nostack, readonly));
        }
    }
}

/// Whether both FTZ and DAZ are set on the calling thread (always false off x86_64).
pub fn denormals_flushed() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        mxcsr() & ((1 << 15) | (1 << 6)) == (1 << 15) | (1 << 6)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
fn mxcsr() -> u32 {
    let mut csr = 0u32;
    // SAFETY: stmxcsr writes 4 bytes to a valid, exclusively borrowed u32.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack));
    }
    csr
}

/// A rayon pool of `threads` threads, each with denormals flushed; run kernels inside
/// `pool.install(..)`.
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("kernels-{i}"))
        .start_handler(|_| flush_denormals())
        .build()
}
