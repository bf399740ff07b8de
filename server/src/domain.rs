//! The service's records: jobs and their states, nodes, assignments, and what agents report.
//! Timestamps are Unix milliseconds.

use std::collections::BTreeMap;

use scheduler::inventory::DeviceSlot;
use scheduler::memory::Breakdown;
use scheduler::plan::Plan;
use scheduler::spec::JobSpec;
use serde::{Deserialize, Serialize};
use strum::{EnumString, IntoStaticStr, VariantArray};
use utoipa::ToSchema;
use wire::Op;

// The ids are the scheduler's, as the queue and the agent protocol carry them. In OpenAPI
// schemas a field of either type is declared `value_type = String`, so the documents show
// plain strings; the store binds and reads them as text.
pub use scheduler::ids::{JobId, NodeId};

/// A fresh id of either type: a UUIDv7, so ids sort by creation time.
pub fn mint<Id: From<String>>() -> Id {
    Id::from(uuid::Uuid::now_v7().to_string())
}

/// queued → scheduled → running → succeeded | failed | cancelled; a job whose node is lost goes
/// back to queued with its attempt raised.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    ToSchema,
    IntoStaticStr,
    EnumString,
    VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum JobState {
    Queued,
    Scheduled,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: &[JobState] = <JobState as VariantArray>::VARIANTS;

    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(s: &str) -> Option<JobState> {
        s.parse().ok()
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }

    /// States whose assignments hold devices.
    pub fn holds_devices(self) -> bool {
        matches!(self, JobState::Scheduled | JobState::Running)
    }
}

/// A job as stored and as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Job {
    /// A UUIDv7: ids sort by submission time.
    #[schema(value_type = String)]
    pub id: JobId,
    pub name: Option<String>,
    pub state: JobState,
    /// Higher runs first; equal priorities run in submission order.
    pub priority: i32,
    /// 1 for the first run; raised each time a lost node sends the job back to the queue.
    pub attempt: u32,
    pub world_size: u32,
    /// The normalised job spec (native form; DeepSpeed jobs as translated).
    #[schema(value_type = Object)]
    pub spec: JobSpec,
    /// Admission's plan (`scheduler::plan::Plan`): the planner's choices for the spec's
    /// `"auto"` fields and the bytes each rank holds, which every node runs as they are.
    #[schema(value_type = Object)]
    pub plan: Plan,
    /// DeepSpeed keys zerotrain ignored.
    pub unsupported_keys: Vec<String>,
    /// Name of the token that submitted it.
    pub owner: String,
    /// Why the job is in its state (the last transition's reason).
    pub reason: String,
    /// Where rank 0 of the current attempt listens, once its node reported it (jobs spanning
    /// nodes only).
    pub master: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One state change, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Transition {
    pub at: i64,
    pub from: Option<JobState>,
    pub to: JobState,
    pub reason: String,
}

/// A registered runner agent and its devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NodeRecord {
    #[schema(value_type = String)]
    pub id: NodeId,
    pub name: String,
    /// Where the node's ranks accept TCP connections.
    pub host: String,
    #[schema(value_type = Vec<Object>)]
    pub devices: Vec<DeviceSlot>,
    pub registered_at: i64,
    pub last_heartbeat: i64,
    /// Silent past the heartbeat timeout; its jobs were requeued.
    pub lost: bool,
    /// The job whose Slurm allocation started this node's agent: it serves that job only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub reserved_for: Option<JobId>,
}

/// Rank `rank` of attempt `attempt` of a job runs on device `device` of node `node_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AssignmentRecord {
    #[schema(value_type = String)]
    pub job_id: JobId,
    pub attempt: u32,
    pub rank: u32,
    #[schema(value_type = String)]
    pub node_id: NodeId,
    pub device: u32,
}

/// One optimizer step of a job, as rank 0's node reported it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepRecord {
    pub attempt: u32,
    pub step: u32,
    pub loss: f64,
    pub loss_scale: f32,
    pub tokens_per_second: f64,
    pub skipped: bool,
    pub step_seconds: f64,
    pub at: i64,
    /// The mean loss over the validation batches when validation ran after this step, else
    /// null (also for a loss that was not a number).
    // Null rather than left out: every step has the same fields, for tables and DataFrames.
    #[schema(required = true)]
    pub validation_loss: Option<f64>,
}

/// A rank's measured peak bytes by category next to the memory model's prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RankMemoryRecord {
    pub rank: u32,
    #[schema(value_type = Object)]
    pub measured: Breakdown,
    #[schema(value_type = Object)]
    pub predicted: Breakdown,
    #[schema(value_type = Object)]
    pub comm_bytes_sent: BTreeMap<Op, u64>,
    /// The peak resident set of the process that ran the rank, when it finished: the same for
    /// ranks that are threads of one process. Absent if the agent did not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_peak_rss_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LogLine {
    /// Increases by one per line of a job.
    pub seq: i64,
    pub at: i64,
    pub line: String,
}

/// A bearer token as the store describes it; the token itself is shown once, when created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenRecord {
    pub name: String,
    pub role: Role,
    pub created_at: i64,
}

/// What a bearer token may do: viewers read, submitters also submit and cancel, admins also
/// manage; agents only speak the agent protocol.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    ToSchema,
    IntoStaticStr,
    EnumString,
    VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Role {
    Viewer,
    Submitter,
    Admin,
    /// The join token agents register with.
    AgentJoin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(s: &str) -> Option<Role> {
        s.parse().ok()
    }

    /// Whether this role may do what `needed` may (agent join tokens only join).
    pub fn allows(self, needed: Role) -> bool {
        match (self, needed) {
            (Role::AgentJoin, n) => n == Role::AgentJoin,
            (_, Role::AgentJoin) => false,
            (have, n) => have >= n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strum_names_are_serde_names() {
        for &state in JobState::ALL {
            assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
            assert_eq!(JobState::parse(state.as_str()), Some(state));
        }
        for &role in Role::VARIANTS {
            assert_eq!(serde_json::to_value(role).unwrap(), role.as_str());
            assert_eq!(Role::parse(role.as_str()), Some(role));
        }
    }
}

/// An allocation the scheduler asked Slurm for, to run attempt `attempt` of job `job_id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmAllocation {
    pub slurm_job_id: u64,
    pub job_id: JobId,
    pub attempt: u32,
    pub partition: String,
    pub nodes: u32,
    /// What `squeue` said last (`PENDING`, `RUNNING`, …; `SUBMITTED` before it said anything).
    pub state: String,
    /// Slurm's reason for that state (`Resources`, `Priority`, `None`, …).
    pub reason: String,
    pub submitted_at: i64,
}
