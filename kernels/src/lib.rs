//! Numeric kernels for zerotrain's GPT-2 and Llama-family trainers (CPU back end).
//!
//! Activations live in a compute dtype `X` ([`Float`]: `f32`, `f16`, `bf16`); every kernel
//! computes in `f32` and rounds once on store (round-to-nearest-even). LayerNorm statistics,
//! logits and losses are `f32`; master weights and optimizer states are `f32`.
//!
//! Every kernel is deterministic: its output is bit-identical for identical input whatever the
//! rayon pool size, because work is split by fixed rules (rows, columns, blocks whose bounds
//! depend only on the shapes) and each reduction runs in one fixed order on one thread.
//! Kernels run on the caller's current rayon pool (see [`cpu::pool_builder`]) and keep no
//! allocations of their own between calls. What outlives a call is the caller's choice: a
//! thread that keeps a [`matmul::Workspace`] holds one block for gemm's packing buffer (lent
//! through [`matmul::Allocator`] where a binary declares it the process's allocator), and gemm
//! keeps one L2-sized buffer per thread that has run a product. The crate sets up nothing
//! process-wide: no allocator, no global pool, no allocator tunables.
//!
//! Shapes are written `(B, T, C)`: batch, sequence length, channels; `NH` heads of size `hs`
//! (`KV` key/value heads under grouped-query attention), vocabulary `V`. All tensors are row-major slices.

pub mod attention;
pub mod cpu;
pub mod crossentropy;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "no_cuda.rs"]
pub mod cuda;
pub mod dropout;
pub mod encoder;
pub mod float;
pub mod gelu;
pub mod gpu;
pub mod grad_norm;
pub mod layernorm;
mod math;
pub mod matmul;
pub mod nf4;
mod normalization;
pub mod optim;
mod par;
pub mod reference;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
mod simd;
pub mod swiglu;

pub use float::Float;
