//! zerotrain's scheduler library: job specs, the memory model of ZeRO-sharded mixed-precision
//! training, the planner that turns a spec into a configuration that fits, and the queue policy
//! that places queued jobs on free devices. No I/O, no async.

pub mod bytes;
pub mod compare;
mod error;
pub mod ids;
pub mod inventory;
pub mod kernel_figures;
pub mod memory;
pub mod model;
pub mod placement;
pub mod plan;
pub mod pool;
pub mod queue;
pub mod report;
pub mod spec;

pub use error::{Error, FieldError};
