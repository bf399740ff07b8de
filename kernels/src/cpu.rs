//! Per-thread CPU settings for training threads.

use crate::simd::{self, Level};

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

/// Which build of the kernels' inner loops (and of the bf16 casts) a pool's threads run (see
/// [`thread_pool_with`]). Every build gives the same bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Simd {
    /// The best build the CPU has: AVX-512, else AVX2, else the baseline one.
    #[default]
    Detect,
    /// At most the AVX2 build: on an AVX-512 CPU, what an AVX2-only CPU runs (for tests and
    /// comparisons).
    Avx2,
    /// Always the baseline build (for tests and comparisons).
    Portable,
}

impl Simd {
    fn cap(self) -> Level {
        match self {
            Simd::Detect => Level::Avx512,
            Simd::Avx2 => Level::Avx2,
            Simd::Portable => Level::Baseline,
        }
    }
}

/// Whether this CPU runs the AVX-512 build of the inner loops (in pools that detect it).
pub fn has_avx512() -> bool {
    simd::detected() >= Level::Avx512
}

/// Whether this CPU runs the AVX2 build of the inner loops (at least; in pools that allow it).
pub fn has_avx2() -> bool {
    simd::detected() >= Level::Avx2
}

/// A rayon pool of `threads` threads, each with denormals flushed; run kernels inside
/// `pool.install(..)`.
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    pool_builder(threads, Simd::Detect).build()
}

/// [`thread_pool`] whose threads run the given build of the kernels (gemm chooses its own).
pub fn thread_pool_with(
    threads: usize,
    simd: Simd,
) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    pool_builder(threads, simd).build()
}

/// A pool of `threads` kernel threads, set up as kernels want them (denormals flushed, the
/// given build of the inner loops), to build: a binary makes it rayon's global pool
/// (`build_global`) so that kernels called from any thread run there, such as one per
/// data-parallel rank, which may block on its neighbours without holding a kernel thread.
/// The kernels themselves never set up a pool: they run on the caller's current one.
pub fn pool_builder(threads: usize, simd: Simd) -> rayon::ThreadPoolBuilder {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("kernels-{i}"))
        .start_handler(move |_| {
            flush_denormals();
            simd::set_cap(simd.cap());
        })
}

/// Threads of the pool kernels called from this thread run on (the global one outside
/// `pool.install(..)`).
pub fn pool_threads() -> usize {
    rayon::current_num_threads()
}
