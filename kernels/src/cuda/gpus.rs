//! The GPUs the driver sees, without opening them (no context is created): what an agent
//! registers, and each GPU's memory in use as the driver reports it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError, result, sys};

use super::Error;
use crate::gpu::Gpu;

/// Every GPU the driver sees, in ordinal order: empty where the driver finds none, and
/// [`Error::NoDriver`] where libcuda cannot be loaded (cudarc would panic).
pub fn discover() -> Result<Vec<Gpu>, Error> {
    // SAFETY: only tries to dlopen libcuda's candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDriver);
    }
    match result::init() {
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => return Ok(Vec::new()),
        other => other?,
    }
    let count = result::device::get_count()?;
    (0..count)
        .map(|ordinal| {
            let dev = result::device::get(ordinal)?;
            // SAFETY: `dev` came from `device::get`.
            let total = unsafe { result::device::total_mem(dev) }?;
            Ok(Gpu {
                ordinal: ordinal as usize,
                name: result::device::get_name(dev)?,
                uuid: uuid_string(&result::device::get_uuid(dev)?.bytes),
                total_bytes: total as u64,
            })
        })
        .collect()
}

/// `GPU-` and the 16 bytes in the 8-4-4-4-12 hex groups of `nvidia-smi -L`.
fn uuid_string(bytes: &[std::ffi::c_char; 16]) -> String {
    let hex: Vec<String> = bytes.iter().map(|&b| format!("{:02x}", b as u8)).collect();
    let group = |r: std::ops::Range<usize>| hex[r].concat();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        group(0..4),
        group(4..6),
        group(6..8),
        group(8..10),
        group(10..16)
    )
}

/// Reads one GPU's memory in use, by every process, as the driver reports it (`cuMemGetInfo`
/// in the GPU's primary context, which it holds: the one this process's ranks share).
pub struct MemoryProbe {
    ctx: Arc<CudaContext>,
}

impl MemoryProbe {
    pub fn new(ordinal: usize) -> Result<MemoryProbe, Error> {
        // SAFETY: as in `discover`.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        Ok(MemoryProbe {
            ctx: CudaContext::new(ordinal)?,
        })
    }

    /// Bytes in use on the GPU now: its total less what the driver says is free.
    pub fn used_bytes(&self) -> Result<u64, Error> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok((total - free) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_as_nvidia_smi_does() {
        let bytes: [std::ffi::c_char; 16] = std::array::from_fn(|i| (i * 17) as u8 as _);
        assert_eq!(
            uuid_string(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }
}
