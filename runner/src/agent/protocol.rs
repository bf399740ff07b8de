//! What the agent and the server say to each other (JSON over HTTP, bearer-authenticated).
//!
//! - `POST /v1/agents/register` (join token): an agent announces its devices and the address
//!   its ranks listen on; the server answers with the node's id and an agent token.
//! - `POST /v1/agents/{node}/heartbeat` (agent token), every `heartbeat_interval`: the agent
//!   reports what happened since the last beat (steps, logs, memory, checkpoints, finished or
//!   failed ranks); the reply carries new assignments and cancellations. A node silent for
//!   the server's heartbeat timeout is lost: its jobs go back to the queue.

use std::collections::BTreeMap;

use scheduler::inventory::Device;
use scheduler::memory::Breakdown;
use serde::{Deserialize, Serialize};

use crate::comm::Op;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// A name for the node (its hostname by default).
    pub name: String,
    pub devices: Vec<Device>,
    /// Host the node's ranks accept TCP connections on (for jobs spanning nodes).
    pub host: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterResponse {
    pub node_id: String,
    /// Bearer token for this node's heartbeats.
    pub agent_token: String,
    pub heartbeat_interval_ms: u64,
}

/// One attempt of one job, as much of it as runs on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: String,
    /// Starts at 1; a job requeued after losing its node runs again with the next attempt.
    pub attempt: u32,
    /// The normalised job spec (`scheduler::spec::JobSpec` as JSON), with the plan's choices
    /// for its `"auto"` fields already filled in.
    pub spec: serde_json::Value,
    /// The ranks this node runs, and the device index of each.
    pub ranks: Vec<RankSlot>,
    pub transport: RankTransport,
    /// Where the job's checkpoints and export live (shared by every node that runs it).
    pub out_dir: String,
}

/// How the job's ranks reach each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RankTransport {
    /// Every rank is on this node: the in-process ring.
    Local,
    /// The job spans nodes: TCP. On rank 0's node `master` is `None`: the agent listens on a
    /// port of its choosing and reports it (`Report::Rendezvous`); the other nodes receive
    /// their assignments only then, with `master` set.
    Tcp { master: Option<String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSlot {
    pub rank: usize,
    pub device: usize,
}

/// Something that happened to a job on this node since the last heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Report {
    /// Rank 0 of a job spanning nodes listens for its peers at `master` (`host:port`).
    Rendezvous {
        job_id: String,
        attempt: u32,
        master: String,
    },
    /// The job's ranks started (sent once per attempt, by the node running rank 0).
    Started {
        job_id: String,
        attempt: u32,
        resumed_from: Option<u32>,
    },
    /// A finished optimizer step (rank 0's view: the loss all ranks agreed on).
    Step {
        job_id: String,
        attempt: u32,
        step: u32,
        loss: f64,
        loss_scale: f32,
        tokens_per_second: f64,
        skipped: bool,
        step_seconds: f64,
    },
    /// A rank's measured peak bytes next to the model's prediction, and what it sent.
    Memory {
        job_id: String,
        attempt: u32,
        rank: usize,
        measured: Breakdown,
        predicted: Breakdown,
        comm_bytes_sent: BTreeMap<Op, u64>,
        /// The peak resident set of the process the rank ran in (the agent's), when it ended.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        process_peak_rss_bytes: Option<u64>,
    },
    Log {
        job_id: String,
        attempt: u32,
        line: String,
    },
    Checkpoint {
        job_id: String,
        attempt: u32,
        step: u32,
        path: String,
    },
    /// Every rank of the job on this node finished; from rank 0's node: the job succeeded.
    Finished {
        job_id: String,
        attempt: u32,
        final_loss: f64,
    },
    Failed {
        job_id: String,
        attempt: u32,
        error: String,
    },
    /// Ranks stopped on a cancellation.
    Cancelled { job_id: String, attempt: u32 },
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Heartbeat {
    pub reports: Vec<Report>,
    /// Jobs (id, attempt) with ranks running here now.
    pub running: Vec<(String, u32)>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub assignments: Vec<Assignment>,
    /// Jobs (id, attempt) whose ranks here must stop.
    pub cancel: Vec<(String, u32)>,
}
