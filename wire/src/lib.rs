//! What zerotrain's server and its runner agents agree on, and nothing else: the agent
//! protocol (`agent`), the names of a job's files (`artifact`) and the names of the collectives
//! whose bytes agents report (`op`). The server links this, not the trainer.

pub mod agent;
pub mod artifact;
mod op;

pub use op::Op;
