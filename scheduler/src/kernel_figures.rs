//! Every number the memory model and admission take from a kernel, each beside the kernel
//! figure it mirrors. The scheduler links no kernel, so these are copies: `kernels`' test
//! `figures` holds each one equal to the kernel's own, and fails naming the figure when either
//! side changes alone.

/// `kernels::attention::MAX_HEAD_SIZE`: the most channels per attention head the attention
/// kernels run; admission refuses a wider head for training.
pub const MAX_HEAD_SIZE: usize = 256;

/// `kernels::cuda::MAX_GRID.1`: the most query heads (sequences × heads) one attention launch
/// takes on a GPU, since attention.cu's grid runs one y index per head
/// (`kernels::cuda::layers::attention_config`).
pub const CUDA_MAX_ATTENTION_HEADS: usize = 65_535;

/// `kernels::optim::LIMBS`: f64 limbs per exact Adafactor sum. Partial sums of g² taken over
/// any split of a matrix add up to the same bits, so sharded and whole steps agree exactly.
pub const ADAFACTOR_SUM_LIMBS: usize = 12;

/// `kernels::cuda::matmul::resident_bytes()`: what the CUDA back end's GEMMs hold per GPU for
/// its life, cuBLASLt's 32 MiB workspace and the 32 MiB staging buffer f32 gradients are
/// rounded in.
pub const CUDA_GEMM_RESIDENT_BYTES: u64 = 64 << 20;

/// `kernels::matmul::scratch_len` of full tiles: the f32 scratch the CPU products widen
/// fp16/bf16 tiles into (512×1024 inputs, 1024×1024 weights, 512×1024 outputs; the kernels'
/// `TILE`). fp32 needs none.
pub const MATMUL_SCRATCH_F32: usize = 1 << 21;

/// `kernels::matmul::packs_len(depth)`: f32 words of the bf16 dot-product kernels' packs of one
/// B panel and one row block for products `depth` deep: 64 dwords per pair on AMX (the larger
/// of the two engines), for whole steps of 32.
pub fn matmul_packs_f32(depth: usize) -> usize {
    1024 * depth.div_ceil(32)
}

/// `kernels::matmul::gemm_workspace_for(l2)`: what the `gemm` crate allocates for itself on
/// cores with `l2` bytes of L2, as (per thread: its slab, one L2; per product in flight: a depth
/// block of 512 of the tile's 512 rows and a panel's rounding, 64, in f32, and two L2-sized
/// panels of the other operand).
pub const fn gemm_workspace(l2: u64) -> (u64, u64) {
    (l2, 4 * 512 * (512 + 64) + 2 * l2)
}

/// `kernels::nf4::BLOCK`: values per fp32 absmax of NF4-stored weights (bitsandbytes'
/// `blocksize=64`).
pub const NF4_BLOCK: usize = 64;

/// `kernels::nf4::code_bytes(n) + 4·kernels::nf4::blocks(n)`: bytes of `numel` values stored as
/// NF4, two codes a byte and an fp32 absmax per [`NF4_BLOCK`].
pub fn nf4_bytes(numel: usize) -> usize {
    numel.div_ceil(2) + 4 * numel.div_ceil(NF4_BLOCK)
}
