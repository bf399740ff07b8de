//! The agent protocol (`wire::agent`): registration with the join token, and
//! heartbeats that carry reports in and assignments and cancellations out.

pub mod heartbeat;
pub mod register;
mod reports;
