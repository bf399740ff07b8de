//! Jobs: insertion with idempotency keys, lookups and pages, and compare-and-set transitions
//! that record their reason and release devices.

use super::backend::{Arg, Conn, bind_args, on};
use super::rows::{JOB_COLUMNS, JobRow, TransitionRow, state, to_json, to_u32};
use super::{JobFilter, SortKey, StoreError};
use crate::domain::{Job, JobId, JobState, Transition, mint};

/// The page size when a filter asks for 0 jobs.
pub const DEFAULT_PAGE: u32 = 100;

/// Inserts a queued job; see [`super::Store::submit_job`]. `None` when the owner already has
/// `queued_limit` queued jobs.
pub(super) async fn insert(
    c: &mut Conn<'_>,
    job: &Job,
    idempotency_key: Option<&str>,
    queued_limit: Option<u32>,
    now: i64,
) -> Result<Option<Job>, StoreError> {
    if let Some(limit) = queued_limit {
        if let Some(key) = idempotency_key
            && let Some(existing) = by_key(c, &job.owner, key).await?
        {
            return Ok(Some(existing));
        }
        if queued_of(c, &job.owner).await? >= i64::from(limit) {
            return Ok(None);
        }
    }
    let id = if job.id.as_str().is_empty() {
        mint()
    } else {
        job.id.clone()
    };
    let created_at = if job.created_at > 0 {
        job.created_at
    } else {
        now
    };
    let reason = if job.reason.is_empty() {
        "submitted".to_string()
    } else {
        job.reason.clone()
    };
    let attempt = job.attempt.max(1);
    let inserted = on!(c, c => {
        sqlx::query(
            "INSERT INTO jobs (id, name, state, priority, attempt, world_size, spec, plan, \
             unsupported_keys, owner, idempotency_key, reason, master, created_at, updated_at) \
             VALUES ($1, $2, 'queued', $3, $4, $5, $6, $7, $8, $9, $10, $11, NULL, $12, $12) \
             ON CONFLICT (owner, idempotency_key) DO NOTHING",
        )
        .bind(id.as_str())
        .bind(&job.name)
        .bind(i64::from(job.priority))
        .bind(i64::from(attempt))
        .bind(i64::from(job.world_size))
        .bind(to_json(&job.spec))
        .bind(to_json(&job.plan))
        .bind(to_json(&job.unsupported_keys))
        .bind(&job.owner)
        .bind(idempotency_key)
        .bind(&reason)
        .bind(created_at)
        .execute(&mut **c)
        .await?
        .rows_affected()
    });
    if inserted == 0 {
        // Only the (owner, idempotency_key) constraint is skipped, so the key exists.
        let key = idempotency_key.unwrap_or_default();
        return Ok(Some(by_key(c, &job.owner, key).await?.ok_or_else(
            || StoreError::Corrupt {
                what: "job".into(),
                reason: format!("idempotency key {key:?} clashed but is not found"),
            },
        )?));
    }
    record(c, &id, attempt, None, JobState::Queued, &reason, now).await?;
    Ok(Some(Job {
        id,
        state: JobState::Queued,
        attempt,
        reason,
        master: None,
        created_at,
        updated_at: created_at,
        ..job.clone()
    }))
}

/// The job `owner` submitted with idempotency key `key`.
async fn by_key(c: &mut Conn<'_>, owner: &str, key: &str) -> Result<Option<Job>, StoreError> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE owner = $1 AND idempotency_key = $2");
    let row = on!(c, c => {
        sqlx::query_as::<_, JobRow>(&sql)
            .bind(owner)
            .bind(key)
            .fetch_optional(&mut **c)
            .await?
    });
    row.map(Job::try_from).transpose()
}

/// How many queued jobs `owner` has. On PostgreSQL the owner's submissions are serialised for
/// the rest of the transaction first, so two of them cannot both see room for one more.
async fn queued_of(c: &mut Conn<'_>, owner: &str) -> Result<i64, StoreError> {
    if let Conn::Postgres(c) = c {
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtext('zerotrain.owner.' || current_schema() || '.' || $1))",
        )
        .bind(owner)
        .execute(&mut **c)
        .await?;
    }
    let n = on!(c, c => {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM jobs WHERE owner = $1 AND state = 'queued'",
        )
        .bind(owner)
        .fetch_one(&mut **c)
        .await?
    });
    Ok(n)
}

/// Jobs holding devices (scheduled or running) whose current attempt was placed before
/// `before`: (id, attempt).
pub(super) async fn placed_before(
    c: &mut Conn<'_>,
    before: i64,
) -> Result<Vec<(JobId, u32)>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT j.id, j.attempt FROM jobs j WHERE j.state IN ('scheduled', 'running') \
             AND EXISTS (SELECT 1 FROM assignments a WHERE a.job_id = j.id \
                 AND a.attempt = j.attempt AND a.assigned_at < $1)",
        )
        .bind(before)
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter()
        .map(|(id, attempt)| Ok((JobId::from(id), to_u32(attempt, "attempt")?)))
        .collect()
}

pub(super) async fn get(c: &mut Conn<'_>, id: &JobId) -> Result<Option<Job>, StoreError> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1");
    let row = on!(c, c => {
        sqlx::query_as::<_, JobRow>(&sql).bind(id.as_str()).fetch_optional(&mut **c).await?
    });
    row.map(Job::try_from).transpose()
}

pub(super) async fn list(c: &mut Conn<'_>, filter: &JobFilter) -> Result<Vec<Job>, StoreError> {
    let mut conditions = Vec::new();
    let mut args = Vec::new();
    let mut condition = |column_op: &str, arg: Arg| {
        args.push(arg);
        conditions.push(format!("{column_op} ${}", args.len()));
    };
    if let Some(s) = filter.state {
        condition("state =", Arg::Text(s.as_str().to_string()));
    }
    if let Some(name) = &filter.name {
        condition("name =", Arg::Text(name.clone()));
    }
    if let Some(owner) = &filter.owner {
        condition("owner =", Arg::Text(owner.clone()));
    }
    let column = match filter.sort.key {
        SortKey::Created => "id",
        SortKey::Name => "COALESCE(name, '')",
        SortKey::State => "state",
        SortKey::Owner => "owner",
        SortKey::Priority => "priority",
    };
    let (direction, past) = if filter.sort.descending {
        ("DESC", "<")
    } else {
        ("ASC", ">")
    };
    if let Some(before) = &filter.before {
        // Keyset paging: past the cursor job's (sort key, id), read from its row.
        args.push(Arg::Text(before.to_string()));
        conditions.push(format!(
            "({column}, id) {past} (SELECT {column}, id FROM jobs WHERE id = ${})",
            args.len()
        ));
    }
    let limit = if filter.limit == 0 {
        DEFAULT_PAGE
    } else {
        filter.limit
    };
    args.push(Arg::Int(i64::from(limit)));
    let filter_sql = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    let sql = format!(
        "SELECT {JOB_COLUMNS} FROM jobs {filter_sql} \
         ORDER BY {column} {direction}, id {direction} LIMIT ${}",
        args.len()
    );
    let rows = on!(c, c => {
        bind_args!(sqlx::query_as::<_, JobRow>(&sql), args).fetch_all(&mut **c).await?
    });
    rows.into_iter().map(Job::try_from).collect()
}

/// Moves job `id` to `to` if it is in one of `from` (and at `attempt`, when given): the shared
/// body of every state change. See [`super::Store::transition`].
pub(super) async fn transition(
    c: &mut Conn<'_>,
    id: &JobId,
    attempt: Option<u32>,
    from: &[JobState],
    to: JobState,
    reason: &str,
    now: i64,
) -> Result<Option<Job>, StoreError> {
    let current = on!(c, c => {
        sqlx::query_as::<_, (String, i64)>("SELECT state, attempt FROM jobs WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(&mut **c)
            .await?
    });
    let Some((current_state, current_attempt)) = current else {
        return Ok(None);
    };
    let current_state = state(&current_state)?;
    if !from.contains(&current_state) || attempt.is_some_and(|a| i64::from(a) != current_attempt) {
        return Ok(None);
    }
    let requeue = to == JobState::Queued;
    let new_attempt = current_attempt + i64::from(requeue);
    // Compare-and-set on what was read: under PostgreSQL's READ COMMITTED another transaction
    // may have moved the job since, and then this updates nothing.
    let sql = format!(
        "UPDATE jobs SET state = $1, reason = $2, updated_at = $3, attempt = $4{} \
         WHERE id = $5 AND state = $6 AND attempt = $7 RETURNING {JOB_COLUMNS}",
        if requeue { ", master = NULL" } else { "" }
    );
    let row = on!(c, c => {
        sqlx::query_as::<_, JobRow>(&sql)
            .bind(to.as_str())
            .bind(reason)
            .bind(now)
            .bind(new_attempt)
            .bind(id.as_str())
            .bind(current_state.as_str())
            .bind(current_attempt)
            .fetch_optional(&mut **c)
            .await?
    });
    let Some(row) = row else {
        return Ok(None);
    };
    let job = Job::try_from(row)?;
    if requeue || to.is_terminal() {
        release(c, id, now).await?;
    }
    record(c, id, job.attempt, Some(current_state), to, reason, now).await?;
    Ok(Some(job))
}

/// Ends every device hold of job `id`.
async fn release(c: &mut Conn<'_>, id: &JobId, now: i64) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query(
            "UPDATE assignments SET released_at = $1 WHERE job_id = $2 AND released_at IS NULL",
        )
        .bind(now)
        .bind(id.as_str())
        .execute(&mut **c)
        .await?;
    });
    Ok(())
}

/// Records a state change of job `id`, now at `attempt`.
pub(super) async fn record(
    c: &mut Conn<'_>,
    id: &JobId,
    attempt: u32,
    from: Option<JobState>,
    to: JobState,
    reason: &str,
    now: i64,
) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query(
            "INSERT INTO transitions (job_id, attempt, from_state, to_state, reason, at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id.as_str())
        .bind(i64::from(attempt))
        .bind(from.map(JobState::as_str))
        .bind(to.as_str())
        .bind(reason)
        .bind(now)
        .execute(&mut **c)
        .await?;
    });
    Ok(())
}

pub(super) async fn transitions(
    c: &mut Conn<'_>,
    id: &JobId,
) -> Result<Vec<Transition>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, TransitionRow>(
            "SELECT at, from_state, to_state, reason FROM transitions WHERE job_id = $1 ORDER BY id",
        )
        .bind(id.as_str())
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter().map(Transition::try_from).collect()
}

pub(super) async fn count_by_state(c: &mut Conn<'_>) -> Result<Vec<(JobState, i64)>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (String, i64)>("SELECT state, COUNT(*) FROM jobs GROUP BY state")
            .fetch_all(&mut **c)
            .await?
    });
    let mut counts: Vec<(JobState, i64)> = JobState::ALL.iter().map(|&s| (s, 0)).collect();
    for (s, n) in rows {
        let s = state(&s)?;
        if let Some(entry) = counts.iter_mut().find(|(k, _)| *k == s) {
            entry.1 = n;
        }
    }
    Ok(counts)
}
