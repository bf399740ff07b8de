//! What agents report about a job: steps, rank memory, logs, checkpoints.

use super::backend::{Arg, Conn, insert_rows, on, unknown_job_on_fk};
use super::rows::{json, real, to_json, to_u32};
use super::{CheckpointRecord, StoreError};
use crate::domain::{JobId, LogLine, RankMemoryRecord, StepRecord};

pub(super) async fn add_steps(
    c: &mut Conn<'_>,
    job_id: &JobId,
    steps: &[StepRecord],
) -> Result<(), StoreError> {
    // A batch the agent sends again after a lost reply changes nothing.
    let rows: Vec<Vec<Arg>> = steps
        .iter()
        .map(|s| {
            vec![
                Arg::Text(job_id.to_string()),
                Arg::Int(i64::from(s.attempt)),
                Arg::Int(i64::from(s.step)),
                Arg::Real(real(s.loss)),
                Arg::Real(real(f64::from(s.loss_scale))),
                Arg::Real(real(s.tokens_per_second)),
                Arg::Bool(s.skipped),
                Arg::Real(real(s.step_seconds)),
                Arg::Int(s.at),
                Arg::Real(s.validation_loss.and_then(real)),
            ]
        })
        .collect();
    insert_rows(
        c,
        "steps (job_id, attempt, step, loss, loss_scale, tokens_per_second, skipped, \
         step_seconds, at, validation_loss)",
        10,
        rows,
        "ON CONFLICT (job_id, attempt, step) DO NOTHING",
    )
    .await
    .map_err(unknown_job_on_fk(job_id))
}

pub(super) async fn steps(c: &mut Conn<'_>, job_id: &JobId) -> Result<Vec<StepRecord>, StoreError> {
    type Row = (
        i64,
        i64,
        Option<f64>,
        Option<f64>,
        Option<f64>,
        bool,
        Option<f64>,
        i64,
        Option<f64>,
    );
    let rows = on!(c, c => {
        sqlx::query_as::<_, Row>(
            "SELECT attempt, step, loss, loss_scale, tokens_per_second, skipped, step_seconds, at, \
             validation_loss FROM steps WHERE job_id = $1 ORDER BY attempt, step",
        )
        .bind(job_id.as_str())
        .fetch_all(&mut **c)
        .await?
    });
    let nan = |v: Option<f64>| v.unwrap_or(f64::NAN);
    rows.into_iter()
        .map(
            |(attempt, step, loss, scale, tps, skipped, secs, at, validation)| {
                Ok(StepRecord {
                    attempt: to_u32(attempt, "step attempt")?,
                    step: to_u32(step, "step")?,
                    loss: nan(loss),
                    loss_scale: nan(scale) as f32,
                    tokens_per_second: nan(tps),
                    skipped,
                    step_seconds: nan(secs),
                    at,
                    validation_loss: validation,
                })
            },
        )
        .collect()
}

pub(super) async fn set_rank_memory(
    c: &mut Conn<'_>,
    job_id: &JobId,
    m: &RankMemoryRecord,
    now: i64,
) -> Result<(), StoreError> {
    let result: Result<(), StoreError> = on!(c, c => {
        sqlx::query(
            "INSERT INTO rank_memory (job_id, rank, measured, predicted, comm_bytes_sent, \
             process_peak_rss_bytes, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (job_id, rank) DO UPDATE SET measured = excluded.measured, \
             predicted = excluded.predicted, comm_bytes_sent = excluded.comm_bytes_sent, \
             process_peak_rss_bytes = excluded.process_peak_rss_bytes, \
             updated_at = excluded.updated_at",
        )
        .bind(job_id.as_str())
        .bind(i64::from(m.rank))
        .bind(to_json(&m.measured))
        .bind(to_json(&m.predicted))
        .bind(to_json(&m.comm_bytes_sent))
        .bind(m.process_peak_rss_bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX)))
        .bind(now)
        .execute(&mut **c)
        .await
        .map(|_| ())
        .map_err(StoreError::from)
    });
    result.map_err(unknown_job_on_fk(job_id))
}

pub(super) async fn rank_memory(
    c: &mut Conn<'_>,
    job_id: &JobId,
) -> Result<Vec<RankMemoryRecord>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (i64, String, String, String, Option<i64>)>(
            "SELECT rank, measured, predicted, comm_bytes_sent, process_peak_rss_bytes \
             FROM rank_memory WHERE job_id = $1 ORDER BY rank",
        )
        .bind(job_id.as_str())
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter()
        .map(|(rank, measured, predicted, comm, rss)| {
            Ok(RankMemoryRecord {
                rank: to_u32(rank, "rank")?,
                measured: json(&measured, "measured memory")?,
                predicted: json(&predicted, "predicted memory")?,
                comm_bytes_sent: json(&comm, "communication bytes")?,
                process_peak_rss_bytes: rss.and_then(|b| u64::try_from(b).ok()),
            })
        })
        .collect()
}

pub(super) async fn append_logs(
    c: &mut Conn<'_>,
    job_id: &JobId,
    lines: &[(i64, String)],
) -> Result<i64, StoreError> {
    // The job row holds the counter: raising it takes the row's lock, so concurrent appends to
    // one job get consecutive, distinct numbers on PostgreSQL too.
    let last = on!(c, c => {
        sqlx::query_scalar::<_, i64>(
            "UPDATE jobs SET log_seq = log_seq + $1 WHERE id = $2 RETURNING log_seq",
        )
        .bind(lines.len() as i64)
        .bind(job_id.as_str())
        .fetch_optional(&mut **c)
        .await?
    });
    let last = last.ok_or_else(|| StoreError::UnknownJob(job_id.clone()))?;
    let first = last - lines.len() as i64 + 1;
    let rows = lines
        .iter()
        .enumerate()
        .map(|(i, (at, line))| {
            vec![
                Arg::Text(job_id.to_string()),
                Arg::Int(first + i as i64),
                Arg::Int(*at),
                Arg::Text(line.clone()),
            ]
        })
        .collect();
    insert_rows(c, "logs (job_id, seq, at, line)", 4, rows, "").await?;
    Ok(last)
}

pub(super) async fn logs(
    c: &mut Conn<'_>,
    job_id: &JobId,
    after: i64,
    limit: u32,
) -> Result<Vec<LogLine>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (i64, i64, String)>(
            "SELECT seq, at, line FROM logs WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(job_id.as_str())
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&mut **c)
        .await?
    });
    Ok(rows
        .into_iter()
        .map(|(seq, at, line)| LogLine { seq, at, line })
        .collect())
}

pub(super) async fn add_checkpoint(
    c: &mut Conn<'_>,
    job_id: &JobId,
    attempt: u32,
    step: u32,
    now: i64,
) -> Result<bool, StoreError> {
    // Recorded only while `attempt` is the job's current one, checked in the same statement: a
    // requeue committed meanwhile wins.
    let result: Result<u64, StoreError> = on!(c, c => {
        sqlx::query(
            "INSERT INTO checkpoints (job_id, attempt, step, at) \
             SELECT id, attempt, $3, $4 FROM jobs WHERE id = $1 AND attempt = $2 \
             ON CONFLICT (job_id, attempt, step) DO UPDATE SET at = excluded.at",
        )
        .bind(job_id.as_str())
        .bind(i64::from(attempt))
        .bind(i64::from(step))
        .bind(now)
        .execute(&mut **c)
        .await
        .map(|r| r.rows_affected())
        .map_err(StoreError::from)
    });
    Ok(result? > 0)
}

pub(super) async fn checkpoints(
    c: &mut Conn<'_>,
    job_id: &JobId,
) -> Result<Vec<CheckpointRecord>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT attempt, step, at FROM checkpoints WHERE job_id = $1 \
             ORDER BY step, attempt",
        )
        .bind(job_id.as_str())
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter()
        .map(|(attempt, step, at)| {
            Ok(CheckpointRecord {
                attempt: to_u32(attempt, "checkpoint attempt")?,
                step: to_u32(step, "checkpoint step")?,
                at,
            })
        })
        .collect()
}
