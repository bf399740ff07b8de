//! Where a step's time goes on the CPU, by kernel group (issue 41's breakdown): off unless
//! [`enable`]d (the benches do), and then one clock read either side of each kernel call; off,
//! one relaxed load. Totals add up over every thread that calls kernels, so ranks of one
//! process add theirs. A GPU's kernels run asynchronously to the host, so the CUDA device is
//! not timed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A group of kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Matrix products, with the casts and packs inside them.
    Products,
    Attention,
    /// Embeddings, norms, RoPE, activations, residual adds and scaling.
    NormsActivations,
    /// The cross-entropy over the logits (the LM head's products are `Products`).
    Loss,
    /// The optimizer, weight decay and the gradient norm.
    Optimizer,
    /// Collectives between ranks, through the host.
    Collectives,
}

impl Group {
    pub const ALL: [Group; 6] = [
        Group::Products,
        Group::Attention,
        Group::NormsActivations,
        Group::Loss,
        Group::Optimizer,
        Group::Collectives,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Group::Products => "products",
            Group::Attention => "attention",
            Group::NormsActivations => "norms and activations",
            Group::Loss => "loss",
            Group::Optimizer => "optimizer",
            Group::Collectives => "collectives",
        }
    }

    /// The group of a `kernels` module's functions (`matmul`, `rmsnorm`, …; `k` is `optim`).
    pub(crate) fn of_module(module: &str) -> Group {
        match module {
            "matmul" => Group::Products,
            "attention" => Group::Attention,
            "crossentropy" => Group::Loss,
            "k" | "optim" | "grad_norm" => Group::Optimizer,
            _ => Group::NormsActivations,
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Group::ALL.len()] = [const { AtomicU64::new(0) }; Group::ALL.len()];

/// Starts timing kernel calls, for the rest of the process.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Runs `f`, adding its time to `group`'s when timing is on.
#[inline]
pub(crate) fn time<T>(group: impl FnOnce() -> Group, f: impl FnOnce() -> T) -> T {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let nanos = start.elapsed().as_nanos() as u64;
    NANOS[group() as usize].fetch_add(nanos, Ordering::Relaxed);
    out
}

/// Each group's time since the last call (or since the process started), and a fresh start.
pub fn take() -> Vec<(Group, Duration)> {
    Group::ALL
        .iter()
        .map(|&g| {
            let nanos = NANOS[g as usize].swap(0, Ordering::Relaxed);
            (g, Duration::from_nanos(nanos))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Other tests of this binary call kernels on other threads meanwhile: once timing is on,
    // they may add to any group, so only what this test's own call must add is asserted.
    #[test]
    fn time_adds_to_the_group_only_once_enabled() {
        let nap = || std::thread::sleep(Duration::from_millis(2));
        take();
        time(|| Group::Loss, nap);
        assert!(
            take().iter().all(|(_, d)| d.is_zero()),
            "off: nothing timed"
        );
        enable();
        time(|| Group::Loss, nap);
        let loss = take().into_iter().find(|(g, _)| *g == Group::Loss);
        assert!(loss.is_some_and(|(_, d)| d >= Duration::from_millis(2)));
    }
}
