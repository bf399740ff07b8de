//! `kernels::cuda` in a build without the `cuda` feature: the names callers reach for outside
//! the GPU back end itself, each answering that CUDA was not built, so their code has no
//! `cfg` branch. Nothing here can be constructed: a build without CUDA has no GPU to hold.

/// Errors of the CUDA back end: here, only that it was not built.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("this zerotrain was built without CUDA support (cargo feature `cuda`)")]
    NotBuilt,
}

/// What a device buffer's element must be on a GPU: any type, where there is no GPU.
pub trait DeviceRepr {}
impl<T> DeviceRepr for T {}

/// What zeroed device memory must be valid as: any type, where there is no GPU.
pub trait ValidAsZeroBits {}
impl<T> ValidAsZeroBits for T {}

pub mod gpus {
    use super::Error;
    use crate::gpu::Gpu;

    /// Every GPU the driver sees: none can be, in this build.
    pub fn discover() -> Result<Vec<Gpu>, Error> {
        Err(Error::NotBuilt)
    }

    /// One GPU's memory in use: never opened in this build.
    pub enum MemoryProbe {}

    impl MemoryProbe {
        pub fn new(_ordinal: usize) -> Result<MemoryProbe, Error> {
            Err(Error::NotBuilt)
        }

        pub fn used_bytes(&self) -> Result<u64, Error> {
            match *self {}
        }
    }
}

pub mod nccl {
    /// What NCCL can carry: any type, where there is no NCCL to refuse it.
    pub trait NcclType {}
    impl<T> NcclType for T {}
}
