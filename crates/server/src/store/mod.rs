//! The store: SQLite (a file, WAL; the embedded default) or PostgreSQL, behind one API. Every
//! method is one transaction; state changes are compare-and-set on the job's current state and
//! record a `Transition`. Migrations (`migrations/sqlite`, `migrations/postgres`) run at connect.

use scheduler::inventory::Device;

use crate::domain::{
    AssignmentRecord, Job, JobState, LogLine, NodeRecord, RankMemoryRecord, Role, StepRecord,
    Transition,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migration: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    #[error("unsupported database URL {0:?}: use sqlite://PATH or postgres://…")]
    Url(String),
    #[error("stored {what} is corrupt: {reason}")]
    Corrupt { what: String, reason: String },
}

/// Which database the store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A filter and a page of `GET /v1/jobs`: newest first; `before` is the id of the last job of
/// the previous page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobFilter {
    pub state: Option<JobState>,
    pub name: Option<String>,
    pub before: Option<String>,
    pub limit: u32,
}

/// A device no job holds now: node id, device index, the device.
#[derive(Debug, Clone, PartialEq)]
pub struct FreeDevice {
    pub node_id: String,
    pub device: u32,
    pub spec: Device,
}

/// A placement decided by a scheduling pass: the job (at its current attempt) and, per rank in
/// order, the node id and device index.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub job_id: String,
    pub slots: Vec<(String, u32)>,
}

#[derive(Clone)]
pub struct Store {
    // The helper implementing the store chooses the representation (e.g. an enum of pools).
}

#[allow(unused_variables)]
impl Store {
    /// Connects to `url` (`sqlite://PATH` creates the file; `postgres://…`) and migrates.
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        todo!()
    }

    pub fn backend(&self) -> Backend {
        todo!()
    }

    /// Inserts a queued job (and its first transition). With an idempotency key already used
    /// by the same owner, inserts nothing and returns the job that key created.
    pub async fn insert_job(
        &self,
        job: &Job,
        idempotency_key: Option<&str>,
    ) -> Result<Job, StoreError> {
        todo!()
    }

    pub async fn get_job(&self, id: &str) -> Result<Option<Job>, StoreError> {
        todo!()
    }

    pub async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<Job>, StoreError> {
        todo!()
    }

    /// Moves job `id` to `to` if it is in one of `from`, recording `reason`; `Ok(None)` when it
    /// was not (someone else moved it first) or does not exist. Moving to `queued` raises the
    /// attempt and releases the job's assignments; moving to a terminal state releases them.
    pub async fn transition(
        &self,
        id: &str,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        todo!()
    }

    pub async fn transitions(&self, id: &str) -> Result<Vec<Transition>, StoreError> {
        todo!()
    }

    pub async fn count_by_state(&self) -> Result<Vec<(JobState, i64)>, StoreError> {
        todo!()
    }

    /// Registers a node; `token_hash` authenticates its heartbeats.
    pub async fn register_node(
        &self,
        name: &str,
        host: &str,
        devices: &[Device],
        token_hash: &str,
    ) -> Result<NodeRecord, StoreError> {
        todo!()
    }

    pub async fn node_by_token(&self, token_hash: &str) -> Result<Option<NodeRecord>, StoreError> {
        todo!()
    }

    /// Records a heartbeat at `at`; false when the node is unknown or was declared lost.
    pub async fn heartbeat(&self, node_id: &str, at: i64) -> Result<bool, StoreError> {
        todo!()
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        todo!()
    }

    /// Declares nodes silent since before `before` lost and sends their scheduled or running
    /// jobs back to the queue (attempt raised); returns the requeued job ids.
    pub async fn reap_lost_nodes(&self, before: i64) -> Result<Vec<String>, StoreError> {
        todo!()
    }

    /// One scheduling pass, atomic and exclusive across server replicas: `decide` sees the
    /// queued jobs (priority descending, then oldest first) and the free devices of live nodes,
    /// and returns placements; those jobs move to `scheduled` with their assignments recorded.
    /// Returns the decisions applied (a job another replica moved meanwhile is skipped).
    pub async fn schedule<F>(&self, decide: F) -> Result<Vec<Decision>, StoreError>
    where
        F: FnOnce(&[Job], &[FreeDevice]) -> Vec<Decision> + Send,
    {
        todo!()
    }

    /// The assignments of jobs holding devices (scheduled or running) on `node_id`, with their
    /// jobs, at each job's current attempt.
    pub async fn assignments_for_node(
        &self,
        node_id: &str,
    ) -> Result<Vec<(Job, Vec<AssignmentRecord>)>, StoreError> {
        todo!()
    }

    /// Records where rank 0 of `attempt` listens (ignored if the job moved to another attempt).
    pub async fn set_master(
        &self,
        job_id: &str,
        attempt: u32,
        master: &str,
    ) -> Result<(), StoreError> {
        todo!()
    }

    pub async fn assignments_for_job(
        &self,
        job_id: &str,
    ) -> Result<Vec<AssignmentRecord>, StoreError> {
        todo!()
    }

    pub async fn add_steps(&self, job_id: &str, steps: &[StepRecord]) -> Result<(), StoreError> {
        todo!()
    }

    pub async fn steps(&self, job_id: &str) -> Result<Vec<StepRecord>, StoreError> {
        todo!()
    }

    pub async fn set_rank_memory(
        &self,
        job_id: &str,
        memory: &RankMemoryRecord,
    ) -> Result<(), StoreError> {
        todo!()
    }

    pub async fn rank_memory(&self, job_id: &str) -> Result<Vec<RankMemoryRecord>, StoreError> {
        todo!()
    }

    /// Appends lines (with their timestamps) and returns their sequence numbers' last.
    pub async fn append_logs(
        &self,
        job_id: &str,
        lines: &[(i64, String)],
    ) -> Result<i64, StoreError> {
        todo!()
    }

    /// Lines after sequence number `after`, at most `limit`.
    pub async fn logs(
        &self,
        job_id: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<LogLine>, StoreError> {
        todo!()
    }

    pub async fn add_checkpoint(
        &self,
        job_id: &str,
        attempt: u32,
        step: u32,
        path: &str,
    ) -> Result<(), StoreError> {
        todo!()
    }

    /// Stores a bearer token (only its SHA-256 is kept) under `name` with `role`.
    pub async fn insert_token(
        &self,
        name: &str,
        role: Role,
        token: &str,
    ) -> Result<(), StoreError> {
        todo!()
    }

    /// The name and role of a bearer token, if it is known.
    pub async fn token(&self, token: &str) -> Result<Option<(String, Role)>, StoreError> {
        todo!()
    }

    /// Whether any admin token exists (`zerotrain up` creates one on first start).
    pub async fn has_admin(&self) -> Result<bool, StoreError> {
        todo!()
    }

    /// Whether the database answers (for `/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        todo!()
    }
}
