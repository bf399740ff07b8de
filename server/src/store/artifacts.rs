//! What agents uploaded to the artifact store: one row per (job, attempt, name).

use super::backend::{Conn, on};
use super::rows::to_u32;
use super::{ArtifactRecord, StoreError};
use crate::domain::JobId;

pub(super) async fn add_artifact(
    c: &mut Conn<'_>,
    job_id: &JobId,
    a: &ArtifactRecord,
) -> Result<bool, StoreError> {
    // Recorded only while `attempt` is the job's current one, checked in the same statement.
    let result: Result<u64, StoreError> = on!(c, c => {
        sqlx::query(
            "INSERT INTO artifacts (job_id, attempt, name, step, bytes, sha256, at) \
             SELECT id, attempt, $3, $4, $5, $6, $7 FROM jobs WHERE id = $1 AND attempt = $2 \
             ON CONFLICT (job_id, attempt, name) DO UPDATE SET step = excluded.step, \
             bytes = excluded.bytes, sha256 = excluded.sha256, at = excluded.at",
        )
        .bind(job_id.as_str())
        .bind(i64::from(a.attempt))
        .bind(&a.name)
        .bind(i64::from(a.step))
        .bind(i64::try_from(a.bytes).unwrap_or(i64::MAX))
        .bind(&a.sha256)
        .bind(a.at)
        .execute(&mut **c)
        .await
        .map(|r| r.rows_affected())
        .map_err(StoreError::from)
    });
    Ok(result? > 0)
}

pub(super) async fn artifacts(
    c: &mut Conn<'_>,
    job_id: &JobId,
) -> Result<Vec<ArtifactRecord>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (i64, String, i64, i64, String, i64)>(
            "SELECT attempt, name, step, bytes, sha256, at FROM artifacts WHERE job_id = $1 \
             ORDER BY name, attempt",
        )
        .bind(job_id.as_str())
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter()
        .map(|(attempt, name, step, bytes, sha256, at)| {
            Ok(ArtifactRecord {
                attempt: to_u32(attempt, "artifact attempt")?,
                step: to_u32(step, "artifact step")?,
                bytes: u64::try_from(bytes).map_err(|_| StoreError::Corrupt {
                    what: format!("artifact {name}"),
                    reason: format!("{bytes} bytes"),
                })?,
                name,
                sha256,
                at,
            })
        })
        .collect()
}

pub(super) async fn remove_artifacts(
    c: &mut Conn<'_>,
    job_id: &JobId,
    checkpoints_only: bool,
) -> Result<u64, StoreError> {
    let sql = if checkpoints_only {
        "DELETE FROM artifacts WHERE job_id = $1 AND name LIKE 'checkpoints/%'"
    } else {
        "DELETE FROM artifacts WHERE job_id = $1"
    };
    let removed = on!(c, c => {
        sqlx::query(sql).bind(job_id.as_str()).execute(&mut **c).await?.rows_affected()
    });
    Ok(removed)
}

pub(super) async fn jobs_with_artifacts(c: &mut Conn<'_>) -> Result<Vec<JobId>, StoreError> {
    let ids = on!(c, c => {
        sqlx::query_scalar::<_, String>("SELECT DISTINCT job_id FROM artifacts ORDER BY job_id")
            .fetch_all(&mut **c)
            .await?
    });
    Ok(ids.into_iter().map(JobId::from).collect())
}
