//! The trainer process's own memory on CPU devices, beside the buffers its accountant counts:
//! the binary and its libraries, the allocator's arenas, thread stacks, and the GEMM library's
//! per-thread packing buffers. A process pays it once, on its first rank: ranks that are
//! threads of one process share it, ranks that are processes each pay it.
//!
//! `overhead(T) = BASELINE_BYTES + T × PACKING_BYTES_PER_THREAD`, where T counts the threads
//! that run GEMMs: the kernel pool's and one per rank of the process.

/// A trainer process's resident bytes outside its buffers: 10.0-11.2 MB measured (peak RSS
/// less accounted bytes of `zerotrain train` gpt2-tiny, 1-8 kernel threads), with headroom for
/// other builds and C libraries.
pub const BASELINE_BYTES: u64 = 16 << 20;

/// Per GEMM thread: `gemm`'s thread-local packing slab, one L2 cache (1 MiB on the machine
/// measured, 2 MiB on the largest current cores), and the thread's touched stack. Measured:
/// 0.8 MB per added kernel thread (gpt2-124M fp32, 1 → 8 threads).
pub const PACKING_BYTES_PER_THREAD: u64 = 2 << 20;

/// The threads planning assumes for a CPU process, whose node's cores it does not know.
pub const PLANNING_THREADS: usize = 16;

/// The overhead of a process whose GEMMs run on `threads` threads.
pub fn overhead_bytes(threads: usize) -> u64 {
    BASELINE_BYTES + threads as u64 * PACKING_BYTES_PER_THREAD
}
