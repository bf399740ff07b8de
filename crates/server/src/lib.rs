//! zerotrain's service: the HTTP API, the store, the scheduling loop and the command line.

pub mod cli;
pub mod domain;
pub mod store;
