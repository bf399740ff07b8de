//! The agent protocol (`wire::agent`): registration with the join token, and
//! heartbeats that carry reports in and assignments and cancellations out, and the files of
//! the attempts a node runs (`artifacts`).

pub mod artifacts;
pub mod heartbeat;
pub mod register;
mod reports;
