//! The CUDA back end (feature `cuda`): cuBLASLt GEMMs and NVRTC-compiled kernels from
//! `kernels/cuda/*.cu`, launched through cudarc. cudarc loads the driver and NVRTC at run time, so this compiles
//! on machines without CUDA; there a missing library is an [`Error`], never a panic.

mod device;
pub mod dropout;
pub mod gpus;
pub mod grad_norm;
pub mod layers;
pub mod matmul;
pub mod nccl;
pub mod nf4;
pub mod optim;
mod program;

pub use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DeviceRepr, DriverError, ValidAsZeroBits,
};
pub use device::{
    DeviceFloat, Gpu, MAX_GRID, MAX_SHARED, MAX_THREADS, OpeningMemory, THREADS, check_launch,
    elementwise, rows,
};

pub use program::{
    Arch, Image, PROGRAMS, Program, cache_dir, cache_file, compile, compile_all, compile_all_in,
    nvrtc_present,
};

/// Errors of the CUDA back end.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no CUDA driver found: libcuda.so is not on the loader path")]
    NoDriver,
    #[error(
        "NVRTC not found: libnvrtc.so.13 is not on the loader path (pip's nvidia-cuda-nvrtc puts it in nvidia/cu13/lib; add that to LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    #[error(
        "cuBLASLt not found: libcublasLt.so.13 is not on the loader path (pip's nvidia-cublas puts it in nvidia/cu13/lib; add that to LD_LIBRARY_PATH)"
    )]
    NoCublasLt,
    #[error(
        "NCCL not found: libnccl.so is not on the loader path (pip's nvidia-nccl-cu13 ships only libnccl.so.2: link it as libnccl.so in a folder on LD_LIBRARY_PATH)"
    )]
    NoNccl,
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("kernel source {0} contains a NUL byte")]
    Source(String),
    #[error("NVRTC failed to compile {program} ({status:?}, options {options}):\n{log}")]
    Compile {
        program: String,
        options: String,
        status: cudarc::nvrtc::result::NvrtcError,
        log: String,
    },
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLASLt: {0}")]
    Cublas(#[from] cudarc::cublaslt::result::CublasError),
    #[error("NVRTC: {0:?}")]
    Nvrtc(cudarc::nvrtc::result::NvrtcError),
    /// A launch the GPU would refuse (grid, block or shared memory over the limits), caught
    /// before the driver's bare "invalid value".
    #[error("cannot launch {kernel}: {reason}")]
    Launch { kernel: String, reason: String },
}
