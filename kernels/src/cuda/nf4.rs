//! NF4 storage of frozen weights on the GPU, as the CPU's `nf4` (bitsandbytes' format, bit for
//! bit): one thread per block of values to quantize, one per value to dequantize.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::device::{elementwise, launch};
use super::{DeviceFloat, Error, Gpu};
use crate::nf4::{BLOCK, check_lens};

/// `codes` and `absmax` of `src`, as `nf4::quantize`.
pub fn quantize<X: DeviceFloat>(
    dev: &Gpu,
    codes: &mut CudaViewMut<'_, u8>,
    absmax: &mut CudaViewMut<'_, f32>,
    src: &CudaView<'_, X>,
) -> Result<(), Error> {
    let n = src.len();
    check_lens(n, codes.len(), absmax.len());
    let len = n as i64;
    launch!(dev, "nf4.cu", format!("nf4_quantize_{}", X::NAME), quantize_config(n); codes, absmax, src, &len);
    Ok(())
}

/// `out` from `codes` and `absmax`, as `nf4::dequantize`.
pub fn dequantize<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    codes: &CudaView<'_, u8>,
    absmax: &CudaView<'_, f32>,
) -> Result<(), Error> {
    let n = out.len();
    check_lens(n, codes.len(), absmax.len());
    let len = n as i64;
    launch!(dev, "nf4.cu", format!("nf4_dequantize_{}", X::NAME), elementwise(n); out, codes, absmax, &len);
    Ok(())
}

/// The launch of [`quantize`] over `n` values: a thread per block of [`BLOCK`].
pub fn quantize_config(n: usize) -> LaunchConfig {
    elementwise(n.div_ceil(BLOCK))
}
