//! The scheduling loop: every scheduling interval (or sooner, when a job arrives or devices free
//! up), declare silent nodes lost, then place queued jobs on free devices. Only the replica
//! holding the scheduler lease places; it keeps the queue and the devices on its board between
//! passes (`store::Board`). Which jobs go where is `scheduler::queue::decide`, a pure function;
//! a pass capped at its rank budget wakes the loop for the next one at once.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use scheduler::queue::{OwnerQuota, QueuedJob, RANKS_PER_PASS, decide};

use crate::domain::{JobId, JobState, NodeId};
use crate::retention;
use crate::slurm;
use crate::state::{AppState, JobEvent};
use crate::store::{Placement, StoreError};

/// Runs scheduling passes until the server shuts down, then hands the scheduler lease over.
pub async fn run(state: AppState) {
    let mut stop = state.shutdown.subscribe();
    let mut last_retention: Option<Instant> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(state.settings.scheduling_interval) => {}
            () = state.wake_scheduler.notified() => {}
            _ = stop.wait_for(|stopped| *stopped) => break,
        }
        if let Err(e) = pass(&state).await {
            tracing::warn!("scheduling pass failed: {e}");
        }
        if last_retention.is_none_or(|t| t.elapsed() >= retention::EVERY) {
            last_retention = Some(Instant::now());
            match retention::collect(&state, state.now_ms()).await {
                Ok(r) if r != retention::Removed::default() => {
                    tracing::info!(?r, "removed finished jobs' outputs past their retention")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("retention failed: {e}"),
            }
        }
    }
    if let Err(e) = state.store.release_lease().await {
        tracing::warn!("releasing the scheduler lease failed: {e}");
    }
}

/// One pass: requeue the jobs of lost nodes, place what fits (if this replica is the
/// scheduler; a pass capped at [`RANKS_PER_PASS`] wakes the loop for the next), follow and ask
/// for Slurm allocations (the scheduler too), refresh the job gauges and drop the series of
/// jobs that ended a while ago. Returns the placements made.
pub async fn pass(state: &AppState) -> Result<Vec<Placement>, StoreError> {
    let start = Instant::now();
    reap(state).await?;
    if let Some(slurm) = &state.slurm {
        slurm.refresh_if_due().await;
    }
    let margin = state.settings.safety_margin;
    let limit = state.settings.limits.running_ranks_per_owner;
    let mut board = state.board.lock().await;
    let mut capped = false;
    let done = state
        .store
        .schedule(&mut board, state.settings.scheduler_lease, |b| {
            let quota = OwnerQuota {
                held: b.held_ranks(),
                limit,
            };
            let decided = decide(b.queue(), b.nodes(), margin, quota, RANKS_PER_PASS);
            capped = decided.capped;
            decided.decisions
        })
        .await?;
    let left_free = board
        .nodes()
        .iter()
        .any(|n| n.devices.iter().any(|d| !d.held));
    // Jobs left waiting, for Slurm to find nodes for (only the scheduler asks it).
    let waiting: Vec<QueuedJob> = match (&state.slurm, &done) {
        (Some(_), Some(_)) => {
            let first = board.queue().take(slurm::allocations::CONSIDERED_PER_PASS);
            first.cloned().collect()
        }
        _ => Vec::new(),
    };
    drop(board);
    if capped {
        state.wake_scheduler.notify_one();
    }
    let done_by_me = done.is_some();
    let placed = match done {
        Some(pass) => {
            tracing::debug!(
                placed = pass.placed.len(),
                loaded = pass.loaded,
                read_ms = pass.read.as_secs_f64() * 1e3,
                decide_ms = pass.decide.as_secs_f64() * 1e3,
                write_ms = pass.write.as_secs_f64() * 1e3,
                "scheduling pass"
            );
            pass.placed
        }
        // Another replica schedules.
        None => Vec::new(),
    };
    state.devices_free.store(left_free, Ordering::Relaxed);
    for p in &placed {
        let waited = (p.at - p.queued_at).max(0) as f64 / 1000.0;
        state.metrics.server.queue_wait_seconds.observe(waited);
        state.publish(JobEvent::State {
            job_id: p.job_id.clone(),
            state: JobState::Scheduled,
            attempt: p.attempt,
            reason: p.reason.clone(),
            at: p.at,
        });
    }
    let mut nodes: Vec<&NodeId> = placed
        .iter()
        .flat_map(|p| p.slots.iter().map(|(node, _)| node))
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    for node in nodes {
        state.wake_agents(Some(node));
    }
    if let Some(slurm) = &state.slurm
        && done_by_me
    {
        let waiting = waiting
            .into_iter()
            .filter(|j| !placed.iter().any(|p| p.job_id == j.id))
            .collect();
        slurm::allocations::pass(state, slurm, waiting).await?;
    }
    housekeeping(state).await?;
    state
        .metrics
        .server
        .scheduling_pass_duration_seconds
        .observe(start.elapsed().as_secs_f64());
    Ok(placed)
}

/// Declares nodes silent past the heartbeat timeout lost; their jobs go back to the queue. A
/// server that started less than a timeout ago declares none: its own downtime (a crash, a
/// restart) is not its nodes' silence, and they get one timeout to reach it again.
async fn reap(state: &AppState) -> Result<(), StoreError> {
    let timeout = i64::try_from(state.settings.heartbeat_timeout.as_millis()).unwrap_or(i64::MAX);
    let now = state.now_ms();
    if now - state.started_ms < timeout {
        return Ok(());
    }
    for id in state.store.reap_lost_nodes(now - timeout).await? {
        if let Some(job) = state.store.get_job(&id).await? {
            tracing::info!(job = %id, attempt = job.attempt, "requeued: its node was lost");
            state.announce(&job);
        }
    }
    Ok(())
}

/// Fails jobs past the wall-time limit, refreshes the job gauges and drops the series of jobs
/// that ended a while ago.
async fn housekeeping(state: &AppState) -> Result<(), StoreError> {
    end_overdue(state, state.now_ms()).await?;
    state
        .metrics
        .set_job_counts(&state.store.count_by_state().await?);
    state.metrics.expire(state.settings.finished_series_ttl);
    Ok(())
}

/// Fails every job whose current attempt has held its devices longer than `max_wall_time` at
/// `now`; its agents are told to stop at their next heartbeat. Returns the jobs failed.
pub async fn end_overdue(state: &AppState, now: i64) -> Result<Vec<JobId>, StoreError> {
    let limit = state.settings.limits.max_wall_time;
    let cutoff = now.saturating_sub(i64::try_from(limit.as_millis()).unwrap_or(i64::MAX));
    let reason = format!("exceeded max_wall_time of {}", short_duration(limit));
    let mut ended = Vec::new();
    for (id, attempt) in state.store.placed_before(cutoff).await? {
        let from = [JobState::Scheduled, JobState::Running];
        if state
            .transition_attempt(&id, attempt, &from, JobState::Failed, &reason)
            .await?
            .is_some()
        {
            tracing::info!(job = %id, attempt, "{reason}");
            ended.push(id);
        }
    }
    Ok(ended)
}

/// `72h`, `90m`, `45s`, `1500ms`: the largest unit that divides the duration.
fn short_duration(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".into(),
        _ if ms.is_multiple_of(3_600_000) => format!("{}h", ms / 3_600_000),
        _ if ms.is_multiple_of(60_000) => format!("{}m", ms / 60_000),
        _ if ms.is_multiple_of(1000) => format!("{}s", ms / 1000),
        _ => format!("{ms}ms"),
    }
}
