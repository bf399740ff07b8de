//! What every handler and background task shares: [`App`] behind [`AppState`], and the job
//! events followers of a job receive.

use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;
use tokio::sync::{Mutex, Notify, broadcast, watch};
use utoipa::ToSchema;

use wire::data_roots::DataRoots;

use crate::app::BuildError;
use crate::artifacts::Artifacts;
use crate::domain::{Job, JobId, JobState, LogLine, NodeId, StepRecord};
use crate::metrics::Metrics;
use crate::settings::Settings;
use crate::slurm::Slurm;
use crate::store::{Board, Store, StoreError};
use crate::throttle::AuthThrottle;

/// What every handler and background task shares.
pub struct App {
    /// Jobs, nodes, assignments, reports and tokens.
    pub store: Store,
    pub settings: Settings,
    /// `settings.data_roots` resolved: submissions naming a file outside them are refused,
    /// and `zerotrain up`'s local agent reads only inside them.
    pub data_roots: DataRoots,
    /// Where jobs' checkpoints and exports are kept (`settings.artifacts()`).
    pub artifacts: Artifacts,
    /// Every Prometheus series this server exports.
    pub metrics: Metrics,
    /// Job state changes, steps and log lines as this server sees them, for SSE followers.
    /// Followers also poll the store, so changes another replica makes still arrive.
    pub events: broadcast::Sender<JobEvent>,
    /// Starts a scheduling pass now (a job arrived or devices freed up).
    pub wake_scheduler: Notify,
    /// The queue and devices as the scheduling loop keeps them between passes, while this
    /// replica holds the scheduler lease (empty otherwise).
    pub board: Mutex<Board>,
    /// Wakes agents' waiting heartbeats: `Some(node)` when that node has a new assignment,
    /// `None` when any node may have one or must stop an attempt (a job was requeued,
    /// cancelled or failed, or a rendezvous address became known). Waiting heartbeats also
    /// look again every scheduling interval, for what another replica did.
    pub agent_wake: broadcast::Sender<Option<NodeId>>,
    /// Whether the last scheduling pass left devices free. While none are, a new job cannot
    /// start, and waking the scheduler for it would only make passes (which hold the store's
    /// scheduling lock) run back to back while jobs pour in.
    pub devices_free: AtomicBool,
    /// Becomes `true` when the server shuts down: streams end, the scheduling loop stops.
    pub shutdown: watch::Sender<bool>,
    /// Failed authentications by client address.
    pub auth_throttle: AuthThrottle,
    /// When this server started, by the store's clock (nodes are not declared lost in its
    /// first heartbeat timeout).
    pub started_ms: i64,
    /// The Slurm partitions jobs run on, if any (`--slurm-partition`).
    pub slurm: Option<Slurm>,
}

#[derive(Clone)]
pub struct AppState(pub Arc<App>);

impl Deref for AppState {
    type Target = App;

    fn deref(&self) -> &App {
        &self.0
    }
}

/// Something that happened to a job, as `GET /v1/jobs/{id}/events` streams it.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobEvent {
    State {
        #[schema(value_type = String)]
        job_id: JobId,
        state: JobState,
        attempt: u32,
        reason: String,
        at: i64,
    },
    Step {
        #[schema(value_type = String)]
        job_id: JobId,
        #[serde(flatten)]
        step: StepRecord,
    },
    Log {
        #[schema(value_type = String)]
        job_id: JobId,
        #[serde(flatten)]
        line: LogLine,
    },
}

impl JobEvent {
    pub fn job_id(&self) -> &JobId {
        match self {
            JobEvent::State { job_id, .. }
            | JobEvent::Step { job_id, .. }
            | JobEvent::Log { job_id, .. } => job_id,
        }
    }

    pub fn state(job: &Job) -> JobEvent {
        JobEvent::State {
            job_id: job.id.clone(),
            state: job.state,
            attempt: job.attempt,
            reason: job.reason.clone(),
            at: job.updated_at,
        }
    }
}

impl AppState {
    /// The state over `store`; fails when a data root cannot be one (missing, or holding the
    /// data dir).
    pub fn new(store: Store, settings: Settings) -> Result<AppState, BuildError> {
        let data_roots = settings.open_data_roots().map_err(BuildError::DataRoots)?;
        let artifacts = Artifacts::open(&settings.artifacts(), &settings.s3)?;
        let auth_throttle = AuthThrottle::new(settings.limits.auth_failures_per_minute);
        let started_ms = store.clock().now_ms();
        let slurm = Slurm::new(&settings.slurm);
        Ok(AppState(Arc::new(App {
            store,
            settings,
            data_roots,
            artifacts,
            metrics: Metrics::default(),
            events: broadcast::channel(1024).0,
            wake_scheduler: Notify::new(),
            board: Mutex::new(Board::default()),
            agent_wake: broadcast::channel(1024).0,
            devices_free: AtomicBool::new(true),
            shutdown: watch::channel(false).0,
            auth_throttle,
            started_ms,
            slurm,
        })))
    }
}

impl App {
    /// Unix milliseconds now, by the service's clock (the store's).
    pub fn now_ms(&self) -> i64 {
        self.store.clock().now_ms()
    }

    /// Moves a job between states in the store and tells everyone who cares: SSE followers,
    /// the scheduler (devices freed or a job requeued) and the metrics (an ended job's series
    /// go after the grace period).
    pub async fn transition(
        &self,
        id: &JobId,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let job = self.store.transition(id, from, to, reason).await?;
        if let Some(job) = &job {
            self.announce(job);
        }
        Ok(job)
    }

    /// `transition`, only if the job is still at `attempt` (for agents' reports).
    pub async fn transition_attempt(
        &self,
        id: &JobId,
        attempt: u32,
        from: &[JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<Job>, StoreError> {
        let job = self
            .store
            .transition_attempt(id, attempt, from, to, reason)
            .await?;
        if let Some(job) = &job {
            self.announce(job);
        }
        Ok(job)
    }

    /// Publishes a job's (new) state.
    pub fn announce(&self, job: &Job) {
        // Nobody listening is not an error.
        let _ = self.events.send(JobEvent::state(job));
        if job.state.is_terminal() {
            self.metrics.job_ended(&job.id);
            self.devices_free.store(true, Ordering::Relaxed);
        }
        let queued_and_may_fit =
            job.state == JobState::Queued && self.devices_free.load(Ordering::Relaxed);
        if job.state.is_terminal() || queued_and_may_fit {
            self.wake_scheduler.notify_one();
        }
        // Its ranks elsewhere must stop (placements wake their nodes themselves).
        if matches!(
            job.state,
            JobState::Queued | JobState::Cancelled | JobState::Failed
        ) {
            self.wake_agents(None);
        }
    }

    /// Wakes the waiting heartbeat of `node` (`None`: of every node).
    pub fn wake_agents(&self, node: Option<&NodeId>) {
        // Nobody waiting is not an error.
        let _ = self.agent_wake.send(node.cloned());
    }

    pub fn publish(&self, event: JobEvent) {
        let _ = self.events.send(event);
    }

    /// Appends `lines` to job `job_id`'s log, now, and tells its followers.
    pub async fn append_logs(&self, job_id: &JobId, lines: Vec<String>) -> Result<(), StoreError> {
        let at = self.now_ms();
        self.append_logs_at(job_id, lines.into_iter().map(|l| (at, l)).collect())
            .await
    }

    /// Appends `lines` (each with its time) to job `job_id`'s log and tells its followers.
    pub async fn append_logs_at(
        &self,
        job_id: &JobId,
        lines: Vec<(i64, String)>,
    ) -> Result<(), StoreError> {
        let last = self.store.append_logs(job_id, &lines).await?;
        let first = last - lines.len() as i64 + 1;
        for (i, (at, line)) in lines.into_iter().enumerate() {
            self.publish(JobEvent::Log {
                job_id: job_id.clone(),
                line: LogLine {
                    seq: first + i as i64,
                    at,
                    line,
                },
            });
        }
        Ok(())
    }
}
