//! What the kernel benches share: timing and deterministic inputs.

use std::time::Instant;

use kernels::Float;

/// Median seconds of `runs` calls of `f`, after one call to warm caches and the thread pool.
pub fn median_seconds(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

/// `n` values spread over `±scale`, the same on every run.
pub fn fill<X: Float>(n: usize, scale: f32) -> Vec<X> {
    (0..n)
        .map(|i| X::from_f32(((i * 7919 % 1000) as f32 / 500.0 - 1.0) * scale))
        .collect()
}
