//! Nodes (runner agents) and their devices, heartbeats, lost nodes, and the assignments agents
//! read.

use scheduler::inventory::DeviceSlot;

use super::StoreError;
use super::backend::{Arg, Conn, insert_rows, lock_scheduling, on};
use super::rows::{
    A_ASSIGNMENT_COLUMNS, AssignmentRow, J_JOB_COLUMNS, JobRow, NODE_DEVICE_COLUMNS, NodeDeviceRow,
    nodes_from_rows, to_u32,
};
use super::{jobs, lease};
use crate::domain::{
    AssignmentRecord, Job, JobId, JobState, NodeId, NodeRecord, SlurmAllocation, mint,
};

pub(super) async fn register(
    c: &mut Conn<'_>,
    name: &str,
    host: &str,
    devices: &[DeviceSlot],
    token_hash: &str,
    allocation: Option<&SlurmAllocation>,
    now: i64,
) -> Result<NodeRecord, StoreError> {
    let slurm_job = allocation.map(|a| a.slurm_job_id as i64);
    let reserved_for = allocation.map(|a| a.job_id.as_str());
    let reserved_attempt = allocation.map(|a| i64::from(a.attempt));
    // Devices change: no scheduling pass may be placing on them meanwhile.
    lock_scheduling(c).await?;
    let existing = on!(c, c => {
        sqlx::query_scalar::<_, String>("SELECT id FROM nodes WHERE token_hash = $1")
            .bind(token_hash)
            .fetch_optional(&mut **c)
            .await?
    });
    let id: NodeId = match existing.map(NodeId::from) {
        Some(id) => {
            // The same agent again (restarted): the ranks it ran are gone.
            let reason = format!("node {name} registered again");
            requeue_jobs_on(c, "n.id = $1", Some(id.as_str()), &reason, now).await?;
            on!(c, c => {
                sqlx::query(
                    "UPDATE nodes SET name = $1, host = $2, registered_at = $3, \
                     last_heartbeat = $3, lost = FALSE, allocation = $4, reserved_for = $5, \
                     reserved_attempt = $6 WHERE id = $7",
                )
                .bind(name)
                .bind(host)
                .bind(now)
                .bind(slurm_job)
                .bind(reserved_for)
                .bind(reserved_attempt)
                .bind(id.as_str())
                .execute(&mut **c)
                .await?;
                sqlx::query("DELETE FROM devices WHERE node_id = $1")
                    .bind(id.as_str())
                    .execute(&mut **c)
                    .await?;
            });
            id
        }
        None => {
            let id: NodeId = mint();
            on!(c, c => {
                sqlx::query(
                    "INSERT INTO nodes (id, name, host, token_hash, registered_at, \
                     last_heartbeat, lost, allocation, reserved_for, reserved_attempt) \
                     VALUES ($1, $2, $3, $4, $5, $5, FALSE, $6, $7, $8)",
                )
                .bind(id.as_str())
                .bind(name)
                .bind(host)
                .bind(token_hash)
                .bind(now)
                .bind(slurm_job)
                .bind(reserved_for)
                .bind(reserved_attempt)
                .execute(&mut **c)
                .await?;
            });
            id
        }
    };
    let rows = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            vec![
                Arg::Text(id.to_string()),
                Arg::Int(i as i64),
                Arg::Text(d.kind.as_str().into()),
                Arg::Int(d.memory_bytes as i64),
            ]
        })
        .collect();
    insert_rows(c, "devices (node_id, idx, kind, memory_bytes)", 4, rows, "").await?;
    lease::nodes_changed(c).await?;
    Ok(NodeRecord {
        id,
        name: name.to_string(),
        host: host.to_string(),
        devices: devices.to_vec(),
        registered_at: now,
        last_heartbeat: now,
        lost: false,
        reserved_for: reserved_for.map(JobId::from),
    })
}

/// Nodes matching `condition` on `nodes n` (with `$1` = `arg`), devices in order.
pub(super) async fn select(
    c: &mut Conn<'_>,
    condition: &str,
    arg: Option<&str>,
) -> Result<Vec<NodeRecord>, StoreError> {
    let sql = format!(
        "SELECT {NODE_DEVICE_COLUMNS} FROM nodes n LEFT JOIN devices d ON d.node_id = n.id \
         WHERE {condition} ORDER BY n.registered_at, n.id, d.idx"
    );
    let rows = on!(c, c => {
        let mut q = sqlx::query_as::<_, NodeDeviceRow>(&sql);
        if let Some(arg) = arg {
            q = q.bind(arg);
        }
        q.fetch_all(&mut **c).await?
    });
    nodes_from_rows(rows)
}

pub(super) async fn heartbeat(
    c: &mut Conn<'_>,
    node_id: &NodeId,
    at: i64,
) -> Result<bool, StoreError> {
    let updated = on!(c, c => {
        sqlx::query("UPDATE nodes SET last_heartbeat = $1 WHERE id = $2 AND NOT lost")
            .bind(at)
            .bind(node_id.as_str())
            .execute(&mut **c)
            .await?
            .rows_affected()
    });
    Ok(updated > 0)
}

pub(super) async fn reap(
    c: &mut Conn<'_>,
    before: i64,
    now: i64,
) -> Result<Vec<JobId>, StoreError> {
    lock_scheduling(c).await?;
    let lost = on!(c, c => {
        sqlx::query("UPDATE nodes SET lost = TRUE WHERE NOT lost AND last_heartbeat < $1")
            .bind(before)
            .execute(&mut **c)
            .await?
            .rows_affected()
    });
    if lost > 0 {
        lease::nodes_changed(c).await?;
    }
    // Every job still holding a device of any lost node, not only of those lost just now.
    requeue_jobs_on(c, "n.lost", None, "lost", now).await
}

/// Sends the jobs holding devices on nodes matching `condition` back to the queue, the reason
/// naming the node (`what` = "lost", or a full reason when `arg` is given).
pub(super) async fn requeue_jobs_on(
    c: &mut Conn<'_>,
    condition: &str,
    arg: Option<&str>,
    what: &str,
    now: i64,
) -> Result<Vec<JobId>, StoreError> {
    let sql = format!(
        "SELECT DISTINCT a.job_id, n.name FROM assignments a \
         JOIN nodes n ON n.id = a.node_id JOIN jobs j ON j.id = a.job_id \
         WHERE a.released_at IS NULL AND j.state IN ('scheduled', 'running') AND {condition} \
         ORDER BY a.job_id, n.name"
    );
    let held = on!(c, c => {
        let mut q = sqlx::query_as::<_, (String, String)>(&sql);
        if let Some(arg) = arg {
            q = q.bind(arg);
        }
        q.fetch_all(&mut **c).await?
    });
    let mut requeued: Vec<JobId> = Vec::new();
    for (job_id, node) in held {
        let job_id = JobId::from(job_id);
        if requeued.last() == Some(&job_id) {
            continue;
        }
        let reason = match arg {
            None => format!("node {node} {what}"),
            Some(_) => what.to_string(),
        };
        let from = [JobState::Scheduled, JobState::Running];
        if jobs::transition(c, &job_id, None, &from, JobState::Queued, &reason, now)
            .await?
            .is_some()
        {
            requeued.push(job_id);
        }
    }
    Ok(requeued)
}

pub(super) async fn assignments_for_node(
    c: &mut Conn<'_>,
    node_id: &NodeId,
) -> Result<Vec<(Job, Vec<AssignmentRecord>)>, StoreError> {
    #[derive(sqlx::FromRow)]
    struct Row {
        #[sqlx(flatten)]
        job: JobRow,
        a_rank: i64,
        a_device: i64,
    }
    let sql = format!(
        "SELECT {J_JOB_COLUMNS}, a.rank AS a_rank, a.device AS a_device \
         FROM assignments a JOIN jobs j ON j.id = a.job_id AND j.attempt = a.attempt \
         WHERE a.node_id = $1 AND a.released_at IS NULL AND j.state IN ('scheduled', 'running') \
         ORDER BY j.priority DESC, j.created_at, j.id, a.rank"
    );
    let rows = on!(c, c => {
        sqlx::query_as::<_, Row>(&sql).bind(node_id.as_str()).fetch_all(&mut **c).await?
    });
    let mut out: Vec<(Job, Vec<AssignmentRecord>)> = Vec::new();
    for r in rows {
        let job = Job::try_from(r.job)?;
        let record = AssignmentRecord::try_from(AssignmentRow {
            job_id: job.id.clone(),
            attempt: i64::from(job.attempt),
            rank: r.a_rank,
            node_id: node_id.clone(),
            device: r.a_device,
        })?;
        match out.last_mut() {
            Some((last, records)) if last.id == job.id => records.push(record),
            _ => out.push((job, vec![record])),
        }
    }
    Ok(out)
}

pub(super) async fn assignments_for_job(
    c: &mut Conn<'_>,
    job_id: &JobId,
) -> Result<Vec<AssignmentRecord>, StoreError> {
    let sql = format!(
        "SELECT {A_ASSIGNMENT_COLUMNS} FROM assignments a \
         JOIN jobs j ON j.id = a.job_id AND j.attempt = a.attempt \
         WHERE a.job_id = $1 ORDER BY a.rank"
    );
    let rows = on!(c, c => {
        sqlx::query_as::<_, AssignmentRow>(&sql).bind(job_id.as_str()).fetch_all(&mut **c).await?
    });
    rows.into_iter().map(AssignmentRecord::try_from).collect()
}

pub(super) async fn node_ranks(
    c: &mut Conn<'_>,
    job_id: &JobId,
    node_id: &NodeId,
) -> Result<Vec<(u32, u32)>, StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT attempt, rank FROM assignments WHERE job_id = $1 AND node_id = $2 \
             ORDER BY attempt, rank",
        )
        .bind(job_id.as_str())
        .bind(node_id.as_str())
        .fetch_all(&mut **c)
        .await?
    });
    rows.into_iter()
        .map(|(attempt, rank)| Ok((to_u32(attempt, "attempt")?, to_u32(rank, "rank")?)))
        .collect()
}

pub(super) async fn set_master(
    c: &mut Conn<'_>,
    job_id: &JobId,
    attempt: u32,
    master: &str,
) -> Result<(), StoreError> {
    on!(c, c => {
        sqlx::query("UPDATE jobs SET master = $1 WHERE id = $2 AND attempt = $3")
            .bind(master)
            .bind(job_id.as_str())
            .bind(i64::from(attempt))
            .execute(&mut **c)
            .await?;
    });
    Ok(())
}
