//! A rank's state as named byte buffers on its device: what checkpoints write and read.

use safetensors::tensor::Dtype;

use crate::Error;
use crate::device::{Cpu, Device};

/// One named buffer of a rank's state, as bytes on device `D` (files are written and read
/// from host ones: [`on_host`]).
pub struct StateTensor<'a, D: Device = Cpu> {
    pub name: String,
    pub dtype: Dtype,
    pub bytes: D::ViewMut<'a, u8>,
}

/// Lets `f` read and write every tensor as host bytes (the CPU hands them over; a GPU copies
/// them out, and back after `f`).
pub fn on_host<D: Device, R>(
    dev: &D,
    tensors: Vec<StateTensor<'_, D>>,
    f: impl FnOnce(&mut [StateTensor<'_>]) -> R,
) -> Result<R, Error> {
    let mut f = Some(f);
    let mut tensors = tensors;
    tensors.reverse();
    nest(dev, tensors, Vec::new(), &mut |host| {
        (f.take().expect("called once"))(host)
    })
}

/// Takes the tensors one by one onto the host (`rest` reversed), then calls `f` with all.
fn nest<D: Device, R>(
    dev: &D,
    mut rest: Vec<StateTensor<'_, D>>,
    done: Vec<(String, Dtype, &mut [u8])>,
    f: &mut dyn FnMut(&mut [StateTensor<'_>]) -> R,
) -> Result<R, Error> {
    let Some(StateTensor { name, dtype, bytes }) = rest.pop() else {
        let mut host: Vec<StateTensor<'_>> = done
            .into_iter()
            .map(|(name, dtype, bytes)| StateTensor { name, dtype, bytes })
            .collect();
        return Ok(f(&mut host));
    };
    dev.on_host(bytes, move |host| {
        let mut done = done;
        done.push((name, dtype, host));
        nest(dev, rest, done, f)
    })?
}
