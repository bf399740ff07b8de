//! Mixed-precision gradient checks on the GPU: unscaling with a found-inf flag and the sum of
//! squares for the global norm (fixed-order f64 partial sums, no float atomics).

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::device::{THREADS, elementwise, launch};
use super::{DeviceFloat, Error, Gpu};

/// Partial sums of [`sum_squares`], as the CPU's `grad_norm::sum_squares`.
const PARTS: usize = 256;

/// `grad *= inv_scale` in place; sets `found_inf[0] = 1` when any result is inf or NaN (it is
/// never cleared here: zero it once per step).
pub fn unscale<G: DeviceFloat>(
    dev: &Gpu,
    grad: &mut CudaViewMut<'_, G>,
    inv_scale: f32,
    found_inf: &mut CudaViewMut<'_, i32>,
) -> Result<(), Error> {
    assert_eq!(found_inf.len(), 1, "found_inf is one i32");
    let n = grad.len() as i64;
    let cfg = elementwise(grad.len());
    launch!(dev, "norm.cu", format!("unscale_{}", G::NAME), cfg; grad, &inv_scale, &n, found_inf);
    Ok(())
}

/// `Σ x²` in f64 into `total[0]` (one value per rank's share of the global norm; non-finite
/// when any element is). `parts` is scratch of [`sum_squares_parts_len`] f64.
pub fn sum_squares<X: DeviceFloat>(
    dev: &Gpu,
    total: &mut CudaViewMut<'_, f64>,
    parts: &mut CudaViewMut<'_, f64>,
    x: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert_eq!(total.len(), 1, "total is one f64");
    assert_eq!(
        parts.len(),
        PARTS,
        "parts holds sum_squares_parts_len() f64"
    );
    let (n, chunk) = (x.len() as i64, x.len().div_ceil(PARTS).max(1) as i64);
    let (cfg, one) = sum_squares_configs();
    launch!(dev, "norm.cu", format!("sum_squares_parts_{}", X::NAME), cfg; &mut *parts, x, &n, &chunk);
    let count = PARTS as i32;
    let parts = parts.as_view();
    launch!(dev, "norm.cu", "sum_parts", one; total, &parts, &count);
    Ok(())
}

/// Scratch length of [`sum_squares`].
pub fn sum_squares_parts_len() -> usize {
    PARTS
}

/// The launches of [`sum_squares`]: `sum_squares_parts` (a block of `THREADS` per partial sum)
/// and `sum_parts` (one thread).
pub fn sum_squares_configs() -> (LaunchConfig, LaunchConfig) {
    let parts = LaunchConfig {
        grid_dim: (PARTS as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    (parts, one)
}
