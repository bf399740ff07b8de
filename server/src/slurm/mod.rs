//! Slurm as the engine that hands zerotrain its nodes (issue 40): what a partition holds, as
//! Slurm's own commands print it (`nodes`). The real-Slurm tests (tests/slurm.rs) read a
//! cluster they start on localhost through it.

pub mod nodes;

pub use nodes::{Gres, SlurmNode, parse_nodes};
