//! The `kernels` package's integration tests as one binary, a module per concern: one link
//! instead of one per file (CI's build time). One module alone:
//! `cargo test -p kernels --test kernels MODULE::`.

#[macro_use]
mod common;
// The CUDA modules' own helpers.
#[cfg(feature = "cuda")]
mod attention_reference;
#[cfg(feature = "cuda")]
mod shim;

mod against_reference;
mod casts;
mod cuda_on_cpu;
mod cuda_parity;
mod determinism;
mod dropout;
mod figures;
mod finite_differences;
mod frozen;
mod nf4;
mod nvrtc;
mod optim;
