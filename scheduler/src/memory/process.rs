//! The trainer process's own memory on CPU devices, beside the buffers its accountant counts.
//! A process pays it once, on its first rank: ranks that are threads of one process share it,
//! ranks that are processes each pay it.
//!
//! `overhead = resident at start + GROWTH_BYTES + threads × (STACK_BYTES + GEMM slab)
//!             + ranks × GEMM call workspace`
//!
//! Measured where the process runs (`zerotrain train` reads them at start): its resident set
//! before training (the binary's and libraries' touched pages, the runtime) and the GEMM
//! library's workspace, which follows the CPU's L2 cache (`kernels::matmul::gemm_workspace`).
//! Constants: the growth after start and each thread's stack. Planning, before a node is
//! known, uses [`CpuProcess::PLANNING`].

use crate::kernel_figures::gemm_workspace;

/// Resident bytes a process gains after it starts that no buffer accounts for: code pages
/// first touched by training, the allocator's per-thread arenas, the ranks' and the agent's
/// small allocations. Measured: gpt2-124M fp32 on one rank peaked 16.7 MB over its accounted
/// bytes, 8.6 MB of them resident at start, so 8.1 MB after it, GEMM workspace and stacks
/// included (`zerotrain train --json`'s `process`, a 2-core EPYC); with headroom.
pub const GROWTH_BYTES: u64 = 12 << 20;

/// Each thread's touched stack: the kernels keep row blocks and micro-tiles there (tens of
/// KiB), the runtime a little more.
pub const STACK_BYTES: u64 = 256 << 10;

/// What a CPU trainer process is made of, as far as its own memory goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuProcess {
    /// Its resident set before training starts.
    pub resident_at_start: u64,
    /// Threads that run GEMMs: the kernel pool's and one per rank.
    pub threads: usize,
    /// Ranks it runs as threads, each with one GEMM in flight.
    pub ranks: usize,
    /// The GEMM library's slab per thread.
    pub gemm_per_thread: u64,
    /// The GEMM library's workspace per product in flight.
    pub gemm_per_call: u64,
}

impl CpuProcess {
    /// What planning assumes for a CPU rank, whose node's cores it does not know: a 16-thread
    /// process of one rank on cores with 2 MiB of L2 (the largest current x86 cores), starting
    /// with 16 MiB resident (8.6 MB measured for `zerotrain train`).
    pub const PLANNING: CpuProcess = CpuProcess {
        resident_at_start: 16 << 20,
        threads: 16,
        ranks: 1,
        gemm_per_thread: gemm_workspace(2 << 20).0,
        gemm_per_call: gemm_workspace(2 << 20).1,
    };

    /// Resident bytes outside the accounted buffers.
    pub fn overhead_bytes(&self) -> u64 {
        self.resident_at_start
            + GROWTH_BYTES
            + self.threads as u64 * (STACK_BYTES + self.gemm_per_thread)
            + self.ranks as u64 * self.gemm_per_call
    }
}
