//! Slurm allocations: one per attempt of a job that Slurm is to place, live until `end`. Ending
//! one declares its nodes lost, so a job still running there goes back to the queue as on any
//! lost node.

use super::StoreError;
use super::backend::{Conn, lock_scheduling, on};
use super::rows::{JOB_COLUMNS, JobRow, to_u32};
use super::{lease, nodes};
use crate::domain::{Job, JobId, JobState, SlurmAllocation};

const COLUMNS: &str =
    "slurm_job_id, job_id, attempt, partition, nodes, state, reason, submitted_at";

type Row = (i64, String, i64, String, i64, String, String, i64);

fn allocation(r: Row) -> Result<SlurmAllocation, StoreError> {
    Ok(SlurmAllocation {
        slurm_job_id: r.0 as u64,
        job_id: JobId::from(r.1),
        attempt: to_u32(r.2, "attempt")?,
        partition: r.3,
        nodes: to_u32(r.4, "nodes")?,
        state: r.5,
        reason: r.6,
        submitted_at: r.7,
    })
}

pub(super) async fn insert(
    c: &mut Conn<'_>,
    a: &SlurmAllocation,
    token_hash: &str,
) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query(
            "INSERT INTO slurm_allocations (slurm_job_id, job_id, attempt, partition, nodes, \
             state, reason, submitted_at, token_hash) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(a.slurm_job_id as i64)
        .bind(a.job_id.as_str())
        .bind(i64::from(a.attempt))
        .bind(&a.partition)
        .bind(i64::from(a.nodes))
        .bind(&a.state)
        .bind(&a.reason)
        .bind(a.submitted_at)
        .bind(token_hash)
        .execute(&mut **c)
        .await?;
    });
    Ok(())
}

/// Live allocations matching `condition` (with `$1` = `arg`), oldest first.
pub(super) async fn live(
    c: &mut Conn<'_>,
    condition: &str,
    arg: Option<&str>,
) -> Result<Vec<SlurmAllocation>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM slurm_allocations WHERE ended_at IS NULL AND {condition} \
         ORDER BY slurm_job_id"
    );
    let rows = on!(c, c => {
        let mut q = sqlx::query_as::<_, Row>(&sql);
        if let Some(arg) = arg {
            q = q.bind(arg);
        }
        q.fetch_all(&mut **c).await?
    });
    rows.into_iter().map(allocation).collect()
}

/// Records what `squeue` said of a live allocation.
pub(super) async fn seen(
    c: &mut Conn<'_>,
    slurm_job_id: u64,
    state: &str,
    reason: &str,
) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query("UPDATE slurm_allocations SET state = $1, reason = $2 WHERE slurm_job_id = $3")
            .bind(state)
            .bind(reason)
            .bind(slurm_job_id as i64)
            .execute(&mut **c)
            .await?;
    });
    Ok(())
}

/// Ends a live allocation: its token no longer registers a node, its nodes are lost, and a
/// job holding devices there goes back to the queue with `reason`. Returns the jobs requeued.
pub(super) async fn end(
    c: &mut Conn<'_>,
    slurm_job_id: u64,
    reason: &str,
    now: i64,
) -> Result<Vec<JobId>, StoreError> {
    lock_scheduling(c).await?;
    let id = slurm_job_id.to_string();
    on!(c, c => {
        sqlx::query(
            "UPDATE slurm_allocations SET ended_at = $1 WHERE slurm_job_id = $2 \
             AND ended_at IS NULL",
        )
        .bind(now)
        .bind(slurm_job_id as i64)
        .execute(&mut **c)
        .await?;
    });
    let lost = on!(c, c => {
        sqlx::query("UPDATE nodes SET lost = TRUE WHERE NOT lost AND allocation = $1")
            .bind(slurm_job_id as i64)
            .execute(&mut **c)
            .await?
            .rows_affected()
    });
    if lost > 0 {
        lease::nodes_changed(c).await?;
    }
    let on_it = "n.allocation = CAST($1 AS BIGINT)";
    nodes::requeue_jobs_on(c, on_it, Some(&id), reason, now).await
}

/// Whether attempt `attempt` of job `job` holds devices on nodes of allocation `slurm_job_id`.
pub(super) async fn runs_on(
    c: &mut Conn<'_>,
    slurm_job_id: u64,
    job: &JobId,
    attempt: u32,
) -> Result<bool, StoreError> {
    let held = on!(c, c => {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM assignments a JOIN nodes n ON n.id = a.node_id \
             WHERE a.job_id = $1 AND a.attempt = $2 AND n.allocation = $3",
        )
        .bind(job.as_str())
        .bind(i64::from(attempt))
        .bind(slurm_job_id as i64)
        .fetch_one(&mut **c)
        .await?
    });
    Ok(held > 0)
}

/// Sets the reason of job `id` while it is queued at `attempt` (what it waits for), without a
/// change of state; the job as it is now, if it was changed.
pub(super) async fn set_waiting_reason(
    c: &mut Conn<'_>,
    id: &JobId,
    attempt: u32,
    reason: &str,
    now: i64,
) -> Result<Option<Job>, StoreError> {
    let sql = format!(
        "UPDATE jobs SET reason = $1, updated_at = $2 WHERE id = $3 AND attempt = $4 \
         AND state = $5 RETURNING {JOB_COLUMNS}"
    );
    let row = on!(c, c => {
        sqlx::query_as::<_, JobRow>(&sql)
            .bind(reason)
            .bind(now)
            .bind(id.as_str())
            .bind(i64::from(attempt))
            .bind(JobState::Queued.as_str())
            .fetch_optional(&mut **c)
            .await?
    });
    row.map(Job::try_from).transpose()
}
