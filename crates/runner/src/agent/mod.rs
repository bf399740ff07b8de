//! The runner agent: registers this node's devices with the server, heartbeats, runs the ranks
//! it is assigned and reports their progress.

pub mod protocol;
