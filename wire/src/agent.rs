//! What the agent and the server say to each other (JSON over HTTP, bearer-authenticated).
//!
//! - `POST /v1/agents/register` (join token): an agent announces its devices and the address
//!   its ranks listen on; the server answers with the node's id and an agent token.
//! - `POST /v1/agents/{node}/heartbeat` (agent token): the agent reports what happened since
//!   the last beat (steps, logs, memory, checkpoints, finished or failed ranks); the reply
//!   carries new assignments, the attempts here that are over, and the reports it refused. With
//!   `wait_ms` the server holds the reply until it has an assignment or a fence for the node
//!   (a long-poll), so an agent always has one beat waiting and hears of a placement at once.
//!   A node silent for the server's heartbeat timeout is lost: its jobs go back to the queue
//!   and its beats are answered 410 until it registers again.
//!
//! - `PUT /v1/agents/{node}/jobs/{job}/attempts/{attempt}/artifacts/{name}` (agent token):
//!   one file of a checkpoint or of the export (`crate::artifact` names it), streamed to the
//!   server's artifact store as soon as it is written; `GET /v1/agents/{node}/jobs/{job}/
//!   artifacts/{name}` fetches one the job has (the checkpoint an attempt resumes from), or
//!   one of the export its `model.init_from` names. No node needs a filesystem shared with
//!   the server or with other nodes.
//!
//! Fencing: the server applies a report or an upload only for a (job, attempt) this node holds
//! ranks of and that is still the job's current attempt (a rank's checkpoint file only from the
//! node running that rank). A checkpoint is reported once every rank uploaded its file and
//! counts (is *committed*) only if the server recorded it with all its files, and a new attempt
//! resumes from the newest committed one (`resume_from`), never from whatever an earlier
//! attempt left on disk.

use std::collections::BTreeMap;

use scheduler::inventory::DeviceSlot;
use scheduler::memory::Breakdown;
use scheduler::plan::Plan;
use scheduler::spec::JobSpec;
use serde::{Deserialize, Serialize};
use strum::{IntoStaticStr, VariantArray};

use crate::{JobId, NodeId, Op};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// A name for the node (its hostname by default).
    pub name: String,
    pub devices: Vec<DeviceSlot>,
    /// Host the node's ranks accept TCP connections on (for jobs spanning nodes).
    pub host: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegisterResponse {
    pub node_id: NodeId,
    /// Bearer token for this node's heartbeats.
    pub agent_token: String,
    pub heartbeat_interval_ms: u64,
    /// Where other nodes reach this node's ranks, when the server knows better than the agent
    /// (Slurm's address for a node of an allocation): the agent's rendezvous uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// One attempt of one job, as much of it as runs on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: JobId,
    /// Starts at 1; a job requeued after losing its node runs again with the next attempt.
    pub attempt: u32,
    /// The normalised job spec, as admitted (its `"auto"` fields unresolved).
    pub spec: JobSpec,
    /// Admission's plan: the configuration every node runs, and the bytes each rank holds.
    pub plan: Plan,
    /// The ranks this node runs, and the device index of each.
    pub ranks: Vec<RankSlot>,
    pub transport: RankTransport,
    /// The newest checkpoint the server recorded as committed (by an earlier attempt): the
    /// attempt resumes from it, and from nothing else.
    pub resume_from: Option<ResumeFrom>,
    /// The weights files of the export `spec.model.init_from` names (another job's:
    /// `model.safetensors`, or a sharded export's index and shards), which the node downloads
    /// (`GET /v1/agents/{node}/jobs/{job}/artifacts/{name}`) before it starts, unless it
    /// resumes; empty when the job starts from no job's model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub init_from: Vec<String>,
}

/// A committed checkpoint to resume from: its step and the names of its files, which the
/// node downloads (`GET /v1/agents/{node}/jobs/{job}/artifacts/{name}`) before it starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeFrom {
    pub step: u32,
    pub files: Vec<String>,
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
        job_id: JobId,
        attempt: u32,
        master: String,
    },
    /// The job's ranks started (sent once per attempt, by the node running rank 0).
    Started {
        job_id: JobId,
        attempt: u32,
        resumed_from: Option<u32>,
    },
    /// A finished optimizer step (rank 0's view: the loss all ranks agreed on).
    Step {
        job_id: JobId,
        attempt: u32,
        step: u32,
        loss: f64,
        loss_scale: f32,
        tokens_per_second: f64,
        skipped: bool,
        step_seconds: f64,
        /// The mean loss over the validation batches, when this step was one to evaluate at.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        validation_loss: Option<f64>,
    },
    /// A rank's measured peak bytes (the server sets the plan's beside them), and what it sent.
    Memory {
        job_id: JobId,
        attempt: u32,
        rank: usize,
        measured: Breakdown,
        comm_bytes_sent: BTreeMap<Op, u64>,
        /// The peak resident set of the process the rank ran in (the agent's), when it ended.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        process_peak_rss_bytes: Option<u64>,
        /// The most memory the rank's GPU had in use after a step, by every process, as the
        /// driver reports it; absent for CPU devices.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device_used_bytes: Option<u64>,
    },
    Log {
        job_id: JobId,
        attempt: u32,
        line: String,
    },
    /// A checkpoint of `step`, every file of it uploaded (sent only once it is published).
    Checkpoint {
        job_id: JobId,
        attempt: u32,
        step: u32,
    },
    /// Every rank of the job on this node finished; from rank 0's node: the job succeeded.
    Finished {
        job_id: JobId,
        attempt: u32,
        final_loss: f64,
    },
    Failed {
        job_id: JobId,
        attempt: u32,
        error: String,
        /// Every rank here failed only because a rank on another node left or failed (its
        /// connection closed, it stalled): the cause lies elsewhere, perhaps in a node that
        /// died and will never report.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        peer: bool,
    },
    /// Ranks stopped on a cancellation.
    Cancelled { job_id: JobId, attempt: u32 },
}

impl Report {
    /// The (job, attempt) the report speaks for.
    pub fn key(&self) -> (&JobId, u32) {
        match self {
            Report::Rendezvous {
                job_id, attempt, ..
            }
            | Report::Started {
                job_id, attempt, ..
            }
            | Report::Step {
                job_id, attempt, ..
            }
            | Report::Memory {
                job_id, attempt, ..
            }
            | Report::Log {
                job_id, attempt, ..
            }
            | Report::Checkpoint {
                job_id, attempt, ..
            }
            | Report::Finished {
                job_id, attempt, ..
            }
            | Report::Failed {
                job_id, attempt, ..
            }
            | Report::Cancelled { job_id, attempt } => (job_id, *attempt),
        }
    }

    /// Whether the report is about the job itself rather than one rank: only the node running
    /// rank 0 sends these.
    pub fn from_rank_0_only(&self) -> bool {
        matches!(
            self,
            Report::Rendezvous { .. }
                | Report::Started { .. }
                | Report::Step { .. }
                | Report::Checkpoint { .. }
        )
    }

    /// Whether the server should hear of it now rather than with the next beat: everything but
    /// the steady stream of steps, log lines and memory figures.
    pub fn is_urgent(&self) -> bool {
        !matches!(
            self,
            Report::Step { .. } | Report::Log { .. } | Report::Memory { .. }
        )
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Heartbeat {
    pub reports: Vec<Report>,
    /// Jobs (id, attempt) with ranks running here now (and any the server offered again that
    /// this node has already run, so it stops offering them).
    pub running: Vec<(JobId, u32)>,
    /// Hold the reply up to this many milliseconds until there is an assignment or a fence for
    /// this node; 0 (the default) answers at once. The server caps it.
    #[serde(default)]
    pub wait_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub assignments: Vec<Assignment>,
    /// Attempts (job id, attempt) of `running` that are over (the job was cancelled, ended, or
    /// requeued to a later attempt): their ranks here must stop at once.
    pub cancel: Vec<(JobId, u32)>,
    /// The reports of the beat the server did not apply.
    #[serde(default)]
    pub refused: Vec<Refusal>,
}

/// A report the server did not apply: its index in the beat's `reports`, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub index: usize,
    pub reason: RefusalReason,
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, IntoStaticStr, VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum RefusalReason {
    /// There is no such job.
    UnknownJob,
    /// This node holds no rank of that (job, attempt).
    NotAssigned,
    /// The job has moved on to a later attempt (it was requeued): this one is fenced off.
    AttemptOver,
    /// A report about the whole job (rendezvous, start, step, checkpoint) from a node that does
    /// not run its rank 0.
    #[serde(rename = "not_rank_0")]
    #[strum(serialize = "not_rank_0")]
    NotRank0,
    /// The node was declared lost: the whole beat was answered 410.
    NodeLost,
    /// A checkpoint reported before all its files were uploaded.
    Incomplete,
}

impl RefusalReason {
    pub const ALL: &[RefusalReason] = <RefusalReason as VariantArray>::VARIANTS;

    /// The name on the wire (and the `reason` label of the refused-reports counter).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_plain_strings_on_the_wire() {
        let beat = Heartbeat {
            reports: vec![Report::Cancelled {
                job_id: "j".into(),
                attempt: 2,
            }],
            running: vec![("j".into(), 2)],
            wait_ms: 0,
        };
        let json = serde_json::json!({
            "reports": [{"kind": "cancelled", "job_id": "j", "attempt": 2}],
            "running": [["j", 2]],
            "wait_ms": 0,
        });
        assert_eq!(serde_json::to_value(&beat).unwrap(), json);
        assert_eq!(serde_json::from_value::<Heartbeat>(json).unwrap(), beat);
    }
}
