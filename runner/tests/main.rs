//! The `runner` package's integration tests as one binary, a module per concern: one link
//! instead of one per file (CI's build time). One module alone:
//! `cargo test -p runner --test runner MODULE::`.

// The allocator the `zerotrain` binary declares, so that rank threads keep gemm's packing buffer
// here as they do there.
#[global_allocator]
static ALLOCATOR: kernels::matmul::Allocator = kernels::matmul::Allocator;

mod rings;

mod checkpoint;
mod comm;
mod data;
mod devices;
mod extremes;
mod llama_parity;
mod lora_parity;
mod loss_scale;
mod qlora;
mod roots;
mod tcp;
mod text;
mod train;
mod zero;
