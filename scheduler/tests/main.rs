//! The `scheduler` package's integration tests as one binary, a module per concern: one link
//! instead of one per file (CI's build time). One module alone:
//! `cargo test -p scheduler --test scheduler MODULE::`.

mod estimators;
mod families;
mod lora;
mod memory;
mod plan;
mod spec;
