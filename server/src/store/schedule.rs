//! One scheduling pass, in one transaction that no other replica's pass, node registration or
//! reaping can interleave with: renew the scheduler lease, bring the board up to date, let the
//! caller decide, and write the decisions that are still valid.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use scheduler::queue::Decision;

use super::backend::{
    Arg, Conn, bind_args, insert_rows, insert_rows_returning_ids, lock_scheduling,
};
use super::board::{self, Board};
use super::rows::to_u32;
use super::{StoreError, lease};
use crate::domain::{JobId, JobState, NodeId};

/// Jobs moved per UPDATE statement on SQLite.
const DECISIONS_PER_UPDATE: usize = 500;

/// What a pass did.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulingPass {
    /// The placements committed, in the order decided.
    pub placed: Vec<Placement>,
    /// Whether the board was loaded from the tables rather than brought up to date.
    pub loaded: bool,
    /// Renewing the lease and reading what changed (or loading).
    pub read: Duration,
    pub decide: Duration,
    /// Writing the placements and committing.
    pub write: Duration,
}

/// A job moved to `scheduled` at `at`: its attempt, one slot (node id, device index) per rank,
/// the reason recorded, and since when it had been queued.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub job_id: JobId,
    pub attempt: u32,
    pub slots: Vec<(NodeId, u32)>,
    pub reason: String,
    pub at: i64,
    pub queued_at: i64,
}

/// Everything of a pass but the commit; the board is out of step until the caller commits and
/// calls [`committed`].
pub(super) async fn pass<F>(
    c: &mut Conn<'_>,
    board: &mut Board,
    holder: &str,
    lease_for: Duration,
    decide: F,
    now: i64,
) -> Result<Option<(SchedulingPass, lease::Held, Vec<i64>)>, StoreError>
where
    F: FnOnce(&Board) -> Vec<Decision>,
{
    let start = Instant::now();
    lock_scheduling(c).await?;
    let until = now.saturating_add(i64::try_from(lease_for.as_millis()).unwrap_or(i64::MAX));
    let Some(held) = lease::renew(c, holder, now, until).await? else {
        board.clear();
        return Ok(None);
    };
    let stale = board.stale(held);
    board.begin();
    let loaded = stale || !board::sync(c, board, held).await?;
    if loaded {
        board::load(c, board, held).await?;
    }
    let read = start.elapsed();
    let start = Instant::now();
    let decisions = decide(board);
    let decide = start.elapsed();
    let start = Instant::now();
    let valid = validate(decisions, board);
    let (placed, transitions) = write(c, valid, board, now).await?;
    if placed.is_empty() {
        // Only the lease was renewed: a renewal lost in a crash of the database merely shortens
        // the lease, so the commit need not wait for the disk (PostgreSQL; SQLite's commits do
        // not sync).
        if let Conn::Postgres(c) = c {
            sqlx::query("SET LOCAL synchronous_commit TO OFF")
                .execute(&mut **c)
                .await?;
        }
    }
    Ok(Some((
        SchedulingPass {
            placed,
            loaded,
            read,
            decide,
            write: start.elapsed(),
        },
        held,
        transitions,
    )))
}

/// Records on the board what a committed pass wrote.
pub(super) fn committed(
    board: &mut Board,
    pass: &SchedulingPass,
    held: lease::Held,
    transitions: Vec<i64>,
) {
    for p in &pass.placed {
        board.placed(&p.job_id, p.attempt, &p.slots);
    }
    board.saw(transitions);
    board.in_step(held);
}

/// Keeps the decisions that place a job queued on the board, once, with one slot per rank on
/// devices free on the board, no device twice in the pass. The rest are bugs in `decide`:
/// logged and dropped, so they never reach the database.
fn validate(decisions: Vec<Decision>, board: &Board) -> Vec<Decision> {
    let mut taken: HashSet<(usize, u32)> = HashSet::new();
    let mut placed: HashSet<JobId> = HashSet::new();
    let mut valid = Vec::with_capacity(decisions.len());
    for d in decisions {
        let problem = match board.queued(&d.job_id) {
            None => Some("the job is not queued".to_string()),
            Some(_) if placed.contains(&d.job_id) => Some("the job is placed twice".to_string()),
            Some(j) if d.slots.len() != j.world_size as usize => Some(format!(
                "{} slots for world size {}",
                d.slots.len(),
                j.world_size
            )),
            Some(_) => {
                let mut mine = Vec::with_capacity(d.slots.len());
                let busy =
                    d.slots
                        .iter()
                        .find(|(node, device)| match board.free_slot(node, *device) {
                            Some(slot) if !taken.contains(&slot) && !mine.contains(&slot) => {
                                mine.push(slot);
                                false
                            }
                            _ => true,
                        });
                match busy {
                    None => {
                        taken.extend(mine);
                        None
                    }
                    Some((node, device)) => {
                        Some(format!("device {device} of node {node} is not free"))
                    }
                }
            }
        };
        match problem {
            Some(problem) => {
                tracing::warn!(job = %d.job_id, "scheduling decision dropped: {problem}");
            }
            None => {
                placed.insert(d.job_id.clone());
                valid.push(d);
            }
        }
    }
    valid
}

/// Moves the decided jobs from queued to scheduled (compare-and-set: a job someone moved since
/// the board last saw it is skipped) and records their transitions and assignments. Returns
/// the placements and the ids of the transitions written.
async fn write(
    c: &mut Conn<'_>,
    decisions: Vec<Decision>,
    board: &Board,
    now: i64,
) -> Result<(Vec<Placement>, Vec<i64>), StoreError> {
    if decisions.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let reasons: Vec<String> = decisions.iter().map(|d| reason(d, board)).collect();
    let attempts = move_to_scheduled(c, &decisions, &reasons, now).await?;
    let mut placed = Vec::with_capacity(attempts.len());
    for (d, reason) in decisions.into_iter().zip(reasons) {
        let (Some(&attempt), Some(job)) =
            (attempts.get(d.job_id.as_str()), board.queued(&d.job_id))
        else {
            continue;
        };
        placed.push(Placement {
            attempt: to_u32(attempt, "job attempt")?,
            queued_at: job.queued_at,
            job_id: d.job_id,
            slots: d.slots,
            reason,
            at: now,
        });
    }
    let transitions = placed
        .iter()
        .map(|p| {
            vec![
                Arg::Text(p.job_id.to_string()),
                Arg::Int(i64::from(p.attempt)),
                Arg::Text(JobState::Queued.as_str().to_string()),
                Arg::Text(JobState::Scheduled.as_str().to_string()),
                Arg::Text(p.reason.clone()),
                Arg::Int(now),
            ]
        })
        .collect();
    let ids = insert_rows_returning_ids(
        c,
        "transitions (job_id, attempt, from_state, to_state, reason, at)",
        6,
        transitions,
    )
    .await?;
    let assignments = placed
        .iter()
        .flat_map(|p| {
            p.slots.iter().enumerate().map(|(rank, (node, device))| {
                vec![
                    Arg::Text(p.job_id.to_string()),
                    Arg::Int(i64::from(p.attempt)),
                    Arg::Int(rank as i64),
                    Arg::Text(node.to_string()),
                    Arg::Int(i64::from(*device)),
                    Arg::Int(now),
                ]
            })
        })
        .collect();
    insert_rows(
        c,
        "assignments (job_id, attempt, rank, node_id, device, assigned_at)",
        6,
        assignments,
        "",
    )
    .await?;
    Ok((placed, ids))
}

/// `UPDATE jobs SET state = 'scheduled'` for the decided jobs still queued, with each job's
/// reason: their attempts, by id.
async fn move_to_scheduled(
    c: &mut Conn<'_>,
    decisions: &[Decision],
    reasons: &[String],
    now: i64,
) -> Result<HashMap<String, i64>, StoreError> {
    let mut attempts = HashMap::with_capacity(decisions.len());
    match c {
        // One statement over arrays: a primary-key lookup per job.
        Conn::Postgres(c) => {
            let ids: Vec<&str> = decisions.iter().map(|d| d.job_id.as_str()).collect();
            let moved = sqlx::query_as::<_, (String, i64)>(
                "UPDATE jobs SET state = 'scheduled', updated_at = $1, reason = p.reason \
                 FROM UNNEST($2::text[], $3::text[]) AS p (id, reason) \
                 WHERE jobs.id = p.id AND jobs.state = 'queued' RETURNING jobs.id, jobs.attempt",
            )
            .bind(now)
            .bind(ids)
            .bind(reasons)
            .fetch_all(&mut **c)
            .await?;
            attempts.extend(moved);
        }
        // SQLite plans UPDATE … FROM (VALUES …) as a scan (0.2-0.4 s per 500 jobs), so ids go
        // in an IN list (primary-key lookups) and the reason per job in a CASE; parameters in
        // textual order.
        Conn::Sqlite(c) => {
            for (batch, reasons) in decisions
                .chunks(DECISIONS_PER_UPDATE)
                .zip(reasons.chunks(DECISIONS_PER_UPDATE))
            {
                let mut args = vec![Arg::Int(now)];
                let mut cases = String::new();
                for (d, reason) in batch.iter().zip(reasons) {
                    cases.push_str(" WHEN ? THEN ?");
                    args.push(Arg::Text(d.job_id.to_string()));
                    args.push(Arg::Text(reason.clone()));
                }
                args.extend(batch.iter().map(|d| Arg::Text(d.job_id.to_string())));
                let sql = format!(
                    "UPDATE jobs SET state = 'scheduled', updated_at = ?, reason = CASE id{cases} \
                     END WHERE id IN ({}) AND state = 'queued' RETURNING id, attempt",
                    vec!["?"; batch.len()].join(", ")
                );
                let moved = bind_args!(sqlx::query_as::<_, (String, i64)>(&sql), args)
                    .fetch_all(&mut **c)
                    .await?;
                attempts.extend(moved);
            }
        }
    }
    Ok(attempts)
}

/// "placed on gpu-a[0,1,2,3] gpu-b[0,1]": nodes in rank order with their devices.
fn reason(d: &Decision, board: &Board) -> String {
    let mut parts: Vec<(&str, Vec<String>)> = Vec::new();
    for (node, device) in &d.slots {
        let name = board.node_name(node).unwrap_or(node.as_str());
        match parts.last_mut() {
            Some((last, devices)) if *last == name => devices.push(device.to_string()),
            _ => parts.push((name, vec![device.to_string()])),
        }
    }
    let parts: Vec<String> = parts
        .into_iter()
        .map(|(name, devices)| format!("{name}[{}]", devices.join(",")))
        .collect();
    format!("placed on {}", parts.join(" "))
}
