//! What zerotrain's server and its runner agents agree on, and nothing else: the agent
//! protocol (`agent`), the names of a job's files (`artifact`), the names of the collectives
//! whose bytes agents report (`op`) and where jobs may read (`data_roots`, which the server
//! checks at submission and the agent when it opens), and how both declare their Prometheus
//! series (`metrics`). The server links this, not the trainer.

pub mod agent;
pub mod artifact;
pub mod data_roots;
pub mod metrics;
mod op;

pub use op::Op;
/// The ids the protocol carries; the scheduler defines them, since its queue names both.
pub use scheduler::ids::{JobId, NodeId};
