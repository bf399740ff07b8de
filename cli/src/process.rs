//! What the `zerotrain` process sets up for training, once, before anything trains: glibc's mmap
//! threshold and the kernels' thread pool. (Its allocator is declared in `main.rs`.) No library
//! of the workspace sets up any of these; the runner's benches include this file to train as
//! the binary does.

/// For the commands that run ranks (`train`, `agent`, `up`), first thing, with their
/// `--threads` (default: all cores).
pub fn for_training(threads: Option<usize>) {
    return_freed_memory();
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    kernels::cpu::pool_builder(threads, kernels::cpu::Simd::Detect)
        .build_global()
        .expect("the kernel pool is set up once, before any kernel runs");
}

/// Large buffers come from `mmap` and go back to the system when freed, so the resident set
/// follows what the accountant frees. glibc otherwise raises its mmap threshold after the first
/// large free (up to 32 MiB), after which freed buffers stay resident in the heap and the
/// process's peak grows past what was ever live at once.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables; 128 KiB is glibc's initial threshold,
    // here fixed so it no longer moves.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}
