//! Dropout on the GPU, as the CPU's `dropout` (the same mask, bit for bit): one thread per
//! element.

use cudarc::driver::{CudaView, CudaViewMut};

use super::device::{elementwise, launch};
use super::{DeviceFloat, Error, Gpu};
use crate::dropout::Mask;

/// `out = dropout(inp)`, as `dropout::dropout_forward`.
pub fn dropout_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    inp: &CudaView<'_, X>,
    mask: Mask,
) -> Result<(), Error> {
    assert_eq!(out.len(), inp.len(), "out and inp must have the same shape");
    let n = inp.len() as i64;
    let Mask { p, key, offset } = mask;
    launch!(dev, "dropout.cu", format!("dropout_forward_{}", X::NAME), elementwise(inp.len()); out, inp, &p, &key, &offset, &n);
    Ok(())
}

/// `dinp += dropout(dout)`, as `dropout::dropout_backward`.
pub fn dropout_backward<X: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, X>,
    mask: Mask,
) -> Result<(), Error> {
    assert_eq!(
        dinp.len(),
        dout.len(),
        "dinp and dout must have the same shape"
    );
    let n = dout.len() as i64;
    let Mask { p, key, offset } = mask;
    launch!(dev, "dropout.cu", format!("dropout_backward_{}", X::NAME), elementwise(dout.len()); dinp, dout, &p, &key, &offset, &n);
    Ok(())
}
