//! The `zerotrain` package's integration tests as one binary, a module per concern: one link
//! instead of one per file (CI's build time). One module alone:
//! `cargo test -p zerotrain --test zerotrain MODULE::`.

// The allocator the `zerotrain` binary declares, so that rank threads keep gemm's packing buffer
// here as they do there.
#[global_allocator]
static ALLOCATOR: kernels::matmul::Allocator = kernels::matmul::Allocator;

#[path = "../server/tests/api_helpers/mod.rs"]
mod api_helpers;
mod live;
mod pyenv;

mod api_server;
mod console;
mod dashboard;
mod docs;
mod e2e;
mod estimate_cli;
mod kubernetes;
mod prometheus;
mod security;
mod slurm;
mod train_cli;
mod train_rss;
