//! The store: SQLite (a file, WAL; the embedded default) or PostgreSQL, behind one API. Every
//! method is one transaction; state changes are compare-and-set on the job's current state and
//! record a `Transition`. Migrations (`migrations/sqlite`, `migrations/postgres`) run at connect.
//!
//! Exclusivity of placement: only the replica holding the scheduler lease places jobs (see
//! `lease`), and every scheduling pass, node registration and lost-node reaping holds the
//! scheduling lock for its whole transaction (PostgreSQL: a transaction-scoped advisory lock;
//! SQLite: `BEGIN IMMEDIATE`, one writer at a time). The database backs it up: an attempt's
//! ranks are a primary key, and a partial unique index allows one unreleased assignment per
//! device.

mod artifacts;
mod backend;
mod board;
mod jobs;
mod lease;
mod nodes;
mod reports;
mod rows;
mod schedule;
mod sessions;
mod slurm;
mod tokens;

use std::time::Duration;

use scheduler::inventory::DeviceSlot;
use scheduler::queue::Decision;
use sqlx::postgres::PgConnectOptions;

use backend::Pool;
pub use board::{Board, RESYNC_EVERY};
pub use jobs::DEFAULT_PAGE;
pub use schedule::{Placement, SchedulingPass};
use tokens::OnConflict;
pub use tokens::{Revoked, token_hash};

use crate::clock::Clock;
use crate::domain::{
    AssignmentRecord, Job, JobId, JobState, LogLine, NodeId, NodeRecord, RankMemoryRecord, Role,
    SlurmAllocation, StepRecord, TokenRecord, Transition,
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
    #[error("cannot create {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A report (steps, memory, logs, checkpoint) for a job that does not exist.
    #[error("no job {0}")]
    UnknownJob(JobId),
}

/// Which database the store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A filter and a page of `GET /v1/jobs`, in `sort` order; `before` is the id of the last job
/// of the previous page. A `limit` of 0 means [`DEFAULT_PAGE`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobFilter {
    pub state: Option<JobState>,
    pub name: Option<String>,
    pub owner: Option<String>,
    pub sort: JobSort,
    pub before: Option<JobId>,
    pub limit: u32,
}

/// The order of a job list: a column, then the id (submission order) to break ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSort {
    pub key: SortKey,
    pub descending: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, strum::IntoStaticStr, strum::EnumString)]
#[strum(serialize_all = "lowercase")]
pub enum SortKey {
    /// Submission time (the id is a UUIDv7).
    #[default]
    Created,
    Name,
    State,
    Owner,
    Priority,
}

impl Default for JobSort {
    fn default() -> Self {
        JobSort::NEWEST
    }
}

impl JobSort {
    pub const NEWEST: JobSort = JobSort {
        key: SortKey::Created,
        descending: true,
    };

    /// `created`, `name`, `state`, `owner` or `priority`; a leading `-` for descending.
    pub fn parse(s: &str) -> Option<JobSort> {
        let (descending, key) = match s.strip_prefix('-') {
            Some(key) => (true, key),
            None => (false, s),
        };
        let key = key.parse().ok()?;
        Some(JobSort { key, descending })
    }

    /// The form `parse` reads.
    pub fn as_string(self) -> String {
        let key: &str = self.key.into();
        format!("{}{key}", if self.descending { "-" } else { "" })
    }
}

/// A checkpoint the ranks of `attempt` completed at `step`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRecord {
    pub attempt: u32,
    pub step: u32,
    pub at: i64,
}

/// A file an agent uploaded for `attempt` (see `crate::artifacts`): its name, the checkpoint
/// step it belongs to (the job's last step for the export), size and SHA-256 (hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactRecord {
    pub attempt: u32,
    pub name: String,
    pub step: u32,
    pub bytes: u64,
    pub sha256: String,
    pub at: i64,
}

/// The store: cheap to clone (a pool of connections). Clones are one replica: they share its
/// name as a holder of the scheduler lease.
#[derive(Debug, Clone)]
pub struct Store {
    pool: Pool,
    /// This replica's name in the scheduler lease, new at each connect.
    holder: String,
    /// What rows are stamped with.
    clock: Clock,
}

impl Store {
    /// Connects to `url` (`sqlite://PATH` creates the file; `postgres://…`) and migrates.
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        Ok(Store::over(Pool::connect(url).await?))
    }

    /// Connects to PostgreSQL with `options` (for instance with a `search_path` choosing the
    /// schema) and migrates.
    pub async fn connect_postgres(options: PgConnectOptions) -> Result<Store, StoreError> {
        Ok(Store::over(Pool::connect_postgres(options).await?))
    }

    fn over(pool: Pool) -> Store {
        Store {
            pool,
            // Any unique name; a UUID like the ids.
            holder: uuid::Uuid::now_v7().to_string(),
            clock: Clock::system(),
        }
    }

    /// The store with its rows stamped by `clock` (tests move a manual one).
    pub fn with_clock(self, clock: Clock) -> Store {
        Store { clock, ..self }
    }

    /// The clock rows are stamped with: the service's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Closes the pool: waits for connections in use to come back, then closes them all.
    pub async fn close(&self) {
        self.pool.close().await
    }

    pub fn backend(&self) -> Backend {
        self.pool.backend()
    }

    /// Inserts a queued job (and its first transition). With an idempotency key already used
    /// by the same owner, inserts nothing and returns the job that key created.
    pub async fn insert_job(
        &self,
        job: &Job,
        idempotency_key: Option<&str>,
    ) -> Result<Job, StoreError> {
        let inserted = self.submit_job(job, idempotency_key, None).await?;
        Ok(inserted.expect("without a limit a job is always inserted"))
    }

    /// [`Store::insert_job`], unless the owner already has `queued_limit` queued jobs: then
    /// `None`, and nothing is written (a known idempotency key still returns its job).
    pub async fn submit_job(
        &self,
        job: &Job,
        idempotency_key: Option<&str>,
        queued_limit: Option<u32>,
    ) -> Result<Option<Job>, StoreError> {
        let mut tx = self.pool.write().await?;
        let job = jobs::insert(
            &mut tx.conn(),
            job,
            idempotency_key,
            queued_limit,
            self.clock.now_ms(),
        )
        .await?;
        tx.commit().await?;
        Ok(job)
    }

    /// Jobs holding devices whose current attempt was placed before `before` (Unix ms):
    /// (id, attempt), for the wall-time limit.
    pub async fn placed_before(&self, before: i64) -> Result<Vec<(JobId, u32)>, StoreError> {
        jobs::placed_before(&mut self.pool.acquire().await?.conn(), before).await
    }

    pub async fn get_job(&self, id: &JobId) -> Result<Option<Job>, StoreError> {
        jobs::get(&mut self.pool.acquire().await?.conn(), id).await
    }

    pub async fn list_jobs(&self, filter: &JobFilter) -> Result<Vec<Job>, StoreError> {
        jobs::list(&mut self.pool.acquire().await?.conn(), filter).await
    }

    /// Moves job `id` to `to` if it is in one of `from`, recording `reason`; `Ok(None)` when it
    /// was not (someone else moved it first) or does not exist. Moving to `queued` raises the
    /// attempt and releases the job's assignments; moving to a terminal state releases them.
    pub async fn transition(
        &self,
        id: &JobId,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let mut tx = self.pool.write().await?;
        let job = jobs::transition(
            &mut tx.conn(),
            id,
            None,
            from,
            to,
            reason,
            self.clock.now_ms(),
        )
        .await?;
        tx.commit().await?;
        Ok(job)
    }

    /// [`Store::transition`], only if the job is still at `attempt`: what a report from the
    /// agent running one attempt must use, so that a late report of an attempt the job has
    /// left (its node was declared lost) cannot move the next attempt.
    pub async fn transition_attempt(
        &self,
        id: &JobId,
        attempt: u32,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let mut tx = self.pool.write().await?;
        let job = jobs::transition(
            &mut tx.conn(),
            id,
            Some(attempt),
            from,
            to,
            reason,
            self.clock.now_ms(),
        )
        .await?;
        tx.commit().await?;
        Ok(job)
    }

    /// The job's state changes, oldest first.
    pub async fn transitions(&self, id: &JobId) -> Result<Vec<Transition>, StoreError> {
        jobs::transitions(&mut self.pool.acquire().await?.conn(), id).await
    }

    /// The number of jobs in each state, every state listed.
    pub async fn count_by_state(&self) -> Result<Vec<(JobState, i64)>, StoreError> {
        jobs::count_by_state(&mut self.pool.acquire().await?.conn()).await
    }

    /// Registers a node; `token_hash` authenticates its heartbeats. Registering again with the
    /// `token_hash` of a known node is the same agent restarted: the node keeps its id, comes
    /// back live with the new name, host and devices, and the jobs it held go back to the queue.
    /// A node of Slurm `allocation` serves that allocation's attempt of its job only.
    pub async fn register_node(
        &self,
        name: &str,
        host: &str,
        devices: &[DeviceSlot],
        token_hash: &str,
        allocation: Option<&SlurmAllocation>,
    ) -> Result<NodeRecord, StoreError> {
        let mut tx = self.pool.write().await?;
        let node = nodes::register(
            &mut tx.conn(),
            name,
            host,
            devices,
            token_hash,
            allocation,
            self.clock.now_ms(),
        )
        .await?;
        tx.commit().await?;
        Ok(node)
    }

    pub async fn node_by_token(&self, token_hash: &str) -> Result<Option<NodeRecord>, StoreError> {
        let mut c = self.pool.acquire().await?;
        let nodes = nodes::select(&mut c.conn(), "n.token_hash = $1", Some(token_hash)).await?;
        Ok(nodes.into_iter().next())
    }

    /// Records a heartbeat at `at`; false when the node is unknown or was declared lost.
    pub async fn heartbeat(&self, node_id: &NodeId, at: i64) -> Result<bool, StoreError> {
        nodes::heartbeat(&mut self.pool.acquire().await?.conn(), node_id, at).await
    }

    /// Every node, lost ones included, in registration order.
    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        nodes::select(&mut self.pool.acquire().await?.conn(), "TRUE", None).await
    }

    /// Declares nodes silent since before `before` lost and sends their scheduled or running
    /// jobs back to the queue (attempt raised); returns the requeued job ids. Jobs still holding
    /// devices of nodes declared lost earlier are requeued too.
    pub async fn reap_lost_nodes(&self, before: i64) -> Result<Vec<JobId>, StoreError> {
        let mut tx = self.pool.write().await?;
        let requeued = nodes::reap(&mut tx.conn(), before, self.clock.now_ms()).await?;
        tx.commit().await?;
        Ok(requeued)
    }

    /// One scheduling pass, atomic, by the one scheduler among server replicas. It takes or
    /// renews the scheduler lease for `lease` and returns `None`, changing nothing, when
    /// another replica holds it. Otherwise it brings `board` (this replica's; one per store)
    /// up to date with the tables, reading only what changed since its last pass (or
    /// everything, the first time), lets `decide` place jobs on it, and moves the jobs placed
    /// to `scheduled` with their assignments. A decision for a job not queued on the board,
    /// with a slot count other than the job's world size, or with a device not free on the
    /// board or used twice in the pass is dropped with a warning; a job someone else moved
    /// meanwhile is skipped.
    pub async fn schedule<F>(
        &self,
        board: &mut Board,
        lease: Duration,
        decide: F,
    ) -> Result<Option<SchedulingPass>, StoreError>
    where
        F: FnOnce(&Board) -> Vec<Decision>,
    {
        let mut tx = self.pool.write().await?;
        let started = schedule::pass(
            &mut tx.conn(),
            board,
            &self.holder,
            lease,
            decide,
            self.clock.now_ms(),
        )
        .await?;
        let Some((mut pass, held, transitions)) = started else {
            tx.commit().await?;
            return Ok(None);
        };
        let commit = std::time::Instant::now();
        tx.commit().await?;
        pass.write += commit.elapsed();
        schedule::committed(board, &pass, held, transitions);
        Ok(Some(pass))
    }

    /// Gives up the scheduler lease if this replica holds it, so another takes it over at its
    /// next pass instead of when the lease lapses.
    pub async fn release_lease(&self) -> Result<(), StoreError> {
        lease::release(&mut self.pool.acquire().await?.conn(), &self.holder).await
    }

    /// The assignments of jobs holding devices (scheduled or running) on `node_id`, with their
    /// jobs, at each job's current attempt: per job (in queue order) its ranks on this node, by
    /// rank.
    pub async fn assignments_for_node(
        &self,
        node_id: &NodeId,
    ) -> Result<Vec<(Job, Vec<AssignmentRecord>)>, StoreError> {
        nodes::assignments_for_node(&mut self.pool.acquire().await?.conn(), node_id).await
    }

    /// Records where rank 0 of `attempt` listens (ignored if the job moved to another attempt).
    pub async fn set_master(
        &self,
        job_id: &JobId,
        attempt: u32,
        master: &str,
    ) -> Result<(), StoreError> {
        nodes::set_master(
            &mut self.pool.acquire().await?.conn(),
            job_id,
            attempt,
            master,
        )
        .await
    }

    /// The (attempt, rank) pairs of job `job_id` that node `node_id` was ever assigned.
    pub async fn node_ranks(
        &self,
        job_id: &JobId,
        node_id: &NodeId,
    ) -> Result<Vec<(u32, u32)>, StoreError> {
        nodes::node_ranks(&mut self.pool.acquire().await?.conn(), job_id, node_id).await
    }

    /// All ranks of the job's current attempt, by rank (also after the attempt ended).
    pub async fn assignments_for_job(
        &self,
        job_id: &JobId,
    ) -> Result<Vec<AssignmentRecord>, StoreError> {
        nodes::assignments_for_job(&mut self.pool.acquire().await?.conn(), job_id).await
    }

    /// Records steps; a step already recorded for its attempt is kept as it was.
    pub async fn add_steps(&self, job_id: &JobId, steps: &[StepRecord]) -> Result<(), StoreError> {
        let mut tx = self.pool.write().await?;
        reports::add_steps(&mut tx.conn(), job_id, steps).await?;
        tx.commit().await
    }

    /// Steps by attempt, then step. A NaN stored reads back as NaN.
    pub async fn steps(&self, job_id: &JobId) -> Result<Vec<StepRecord>, StoreError> {
        reports::steps(&mut self.pool.acquire().await?.conn(), job_id).await
    }

    /// Replaces the rank's memory record.
    pub async fn set_rank_memory(
        &self,
        job_id: &JobId,
        memory: &RankMemoryRecord,
    ) -> Result<(), StoreError> {
        reports::set_rank_memory(
            &mut self.pool.acquire().await?.conn(),
            job_id,
            memory,
            self.clock.now_ms(),
        )
        .await
    }

    pub async fn rank_memory(&self, job_id: &JobId) -> Result<Vec<RankMemoryRecord>, StoreError> {
        reports::rank_memory(&mut self.pool.acquire().await?.conn(), job_id).await
    }

    /// Appends lines (with their timestamps) and returns their sequence numbers' last. A job's
    /// lines are numbered 1, 2, 3, … in the order appended.
    pub async fn append_logs(
        &self,
        job_id: &JobId,
        lines: &[(i64, String)],
    ) -> Result<i64, StoreError> {
        let mut tx = self.pool.write().await?;
        let last = reports::append_logs(&mut tx.conn(), job_id, lines).await?;
        tx.commit().await?;
        Ok(last)
    }

    /// Lines after sequence number `after`, at most `limit`.
    pub async fn logs(
        &self,
        job_id: &JobId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<LogLine>, StoreError> {
        reports::logs(&mut self.pool.acquire().await?.conn(), job_id, after, limit).await
    }

    /// Records (commits) a checkpoint if `attempt` is still the job's current attempt; false,
    /// writing nothing, when it is not or the job does not exist. The same attempt and step
    /// again records the later time.
    pub async fn add_checkpoint(
        &self,
        job_id: &JobId,
        attempt: u32,
        step: u32,
    ) -> Result<bool, StoreError> {
        reports::add_checkpoint(
            &mut self.pool.acquire().await?.conn(),
            job_id,
            attempt,
            step,
            self.clock.now_ms(),
        )
        .await
    }

    /// The job's checkpoints, by step (then attempt); the last is where a requeued job resumes.
    pub async fn checkpoints(&self, job_id: &JobId) -> Result<Vec<CheckpointRecord>, StoreError> {
        reports::checkpoints(&mut self.pool.acquire().await?.conn(), job_id).await
    }

    /// Records an upload of `a.attempt` if it is still the job's current attempt; false,
    /// writing nothing, when it is not or the job does not exist. The same name again
    /// replaces the record.
    pub async fn add_artifact(
        &self,
        job_id: &JobId,
        a: &ArtifactRecord,
    ) -> Result<bool, StoreError> {
        artifacts::add_artifact(&mut self.pool.acquire().await?.conn(), job_id, a).await
    }

    /// Every upload of the job, by name (then attempt).
    pub async fn artifacts(&self, job_id: &JobId) -> Result<Vec<ArtifactRecord>, StoreError> {
        artifacts::artifacts(&mut self.pool.acquire().await?.conn(), job_id).await
    }

    /// The jobs that have uploads.
    pub async fn jobs_with_artifacts(&self) -> Result<Vec<JobId>, StoreError> {
        artifacts::jobs_with_artifacts(&mut self.pool.acquire().await?.conn()).await
    }

    /// Forgets the job's uploads (only its checkpoints' with `checkpoints_only`); how many.
    pub async fn remove_artifacts(
        &self,
        job_id: &JobId,
        checkpoints_only: bool,
    ) -> Result<u64, StoreError> {
        artifacts::remove_artifacts(
            &mut self.pool.acquire().await?.conn(),
            job_id,
            checkpoints_only,
        )
        .await
    }

    /// Records allocation `a`, whose agents join with the token of hash `token_hash`.
    pub async fn insert_allocation(
        &self,
        a: &SlurmAllocation,
        token_hash: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.write().await?;
        slurm::insert(&mut tx.conn(), a, token_hash).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Every live allocation, oldest first.
    pub async fn live_allocations(&self) -> Result<Vec<SlurmAllocation>, StoreError> {
        slurm::live(&mut self.pool.acquire().await?.conn(), "TRUE", None).await
    }

    /// The live allocation whose agents join with the token of hash `token_hash`.
    pub async fn allocation_by_token(
        &self,
        token_hash: &str,
    ) -> Result<Option<SlurmAllocation>, StoreError> {
        let mut c = self.pool.acquire().await?;
        let found = slurm::live(&mut c.conn(), "token_hash = $1", Some(token_hash)).await?;
        Ok(found.into_iter().next())
    }

    /// Records what `squeue` said of allocation `slurm_job_id`.
    pub async fn allocation_seen(
        &self,
        slurm_job_id: u64,
        state: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.write().await?;
        slurm::seen(&mut tx.conn(), slurm_job_id, state, reason).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Ends allocation `slurm_job_id`: its nodes are lost and the jobs running there go back
    /// to the queue with `reason` (returned).
    pub async fn end_allocation(
        &self,
        slurm_job_id: u64,
        reason: &str,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut tx = self.pool.write().await?;
        let requeued =
            slurm::end(&mut tx.conn(), slurm_job_id, reason, self.clock.now_ms()).await?;
        tx.commit().await?;
        Ok(requeued)
    }

    /// Whether attempt `attempt` of `job` holds devices on nodes of allocation `slurm_job_id`.
    pub async fn runs_on_allocation(
        &self,
        slurm_job_id: u64,
        job: &JobId,
        attempt: u32,
    ) -> Result<bool, StoreError> {
        slurm::runs_on(
            &mut self.pool.acquire().await?.conn(),
            slurm_job_id,
            job,
            attempt,
        )
        .await
    }

    /// Sets what job `id`, queued at `attempt`, waits for; the job if it is still so.
    pub async fn set_waiting_reason(
        &self,
        id: &JobId,
        attempt: u32,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let mut tx = self.pool.write().await?;
        let now = self.clock.now_ms();
        let job = slurm::set_waiting_reason(&mut tx.conn(), id, attempt, reason, now).await?;
        tx.commit().await?;
        Ok(job)
    }

    /// Stores a bearer token (only its SHA-256 is kept) under `name` with `role`. Storing a
    /// known token again replaces its name and role.
    pub async fn insert_token(
        &self,
        name: &str,
        role: Role,
        token: &str,
    ) -> Result<(), StoreError> {
        let mut c = self.pool.acquire().await?;
        tokens::insert(
            &mut c.conn(),
            name,
            role,
            token,
            self.clock.now_ms(),
            OnConflict::Rename,
        )
        .await?;
        Ok(())
    }

    /// Stores a new token under `name`; `None`, writing nothing, when the name is taken.
    pub async fn create_token(
        &self,
        name: &str,
        role: Role,
        token: &str,
    ) -> Result<Option<TokenRecord>, StoreError> {
        let mut c = self.pool.acquire().await?;
        let created_at = self.clock.now_ms();
        let created = tokens::insert(
            &mut c.conn(),
            name,
            role,
            token,
            created_at,
            OnConflict::Keep,
        )
        .await?;
        Ok(created.then(|| TokenRecord {
            name: name.to_string(),
            role,
            created_at,
        }))
    }

    /// The name and role of a bearer token, if it is known.
    pub async fn token(&self, token: &str) -> Result<Option<(String, Role)>, StoreError> {
        tokens::lookup(&mut self.pool.acquire().await?.conn(), token).await
    }

    /// Every token's name, role and creation time (never the token), by name.
    pub async fn tokens(&self) -> Result<Vec<TokenRecord>, StoreError> {
        tokens::list(&mut self.pool.acquire().await?.conn()).await
    }

    /// Deletes the token named `name`, unless it is the last admin token.
    pub async fn revoke_token(&self, name: &str) -> Result<Revoked, StoreError> {
        let mut tx = self.pool.write().await?;
        let revoked = tokens::revoke(&mut tx.conn(), name).await?;
        tx.commit().await?;
        Ok(revoked)
    }

    /// Stores console session `session` for `token` until `expires_at`; false, writing
    /// nothing, when the token is not known.
    pub async fn insert_session(
        &self,
        session: &str,
        token: &str,
        expires_at: i64,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool.write().await?;
        let inserted = sessions::insert(
            &mut tx.conn(),
            session,
            token,
            self.clock.now_ms(),
            expires_at,
        )
        .await?;
        tx.commit().await?;
        Ok(inserted)
    }

    /// The name and role of the token behind a console session, while both are live.
    pub async fn session(&self, session: &str) -> Result<Option<(String, Role)>, StoreError> {
        sessions::lookup(
            &mut self.pool.acquire().await?.conn(),
            session,
            self.clock.now_ms(),
        )
        .await
    }

    /// Ends a console session (logging out).
    pub async fn delete_session(&self, session: &str) -> Result<(), StoreError> {
        sessions::delete(&mut self.pool.acquire().await?.conn(), session).await
    }

    /// Whether any admin token exists (`zerotrain up` creates one on first start).
    pub async fn has_admin(&self) -> Result<bool, StoreError> {
        tokens::has_admin(&mut self.pool.acquire().await?.conn()).await
    }

    /// Whether the database answers (for `/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut c = self.pool.acquire().await?;
        backend::on!(&mut c.conn(), c => {
            sqlx::query("SELECT 1").execute(&mut **c).await?;
        });
        Ok(())
    }
}
