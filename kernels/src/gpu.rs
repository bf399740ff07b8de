//! A GPU as the CUDA driver describes it: what `cuda::gpus::discover` (feature `cuda`) finds and
//! an agent registers, a plain record in every build.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The CUDA device ordinal (`cuda:N`).
    pub ordinal: usize,
    /// The product name, e.g. `NVIDIA H200`.
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` prints it.
    pub uuid: String,
    pub total_bytes: u64,
}
