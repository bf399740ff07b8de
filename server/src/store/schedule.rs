//! One scheduling pass: read the queue and the free devices, let the caller decide, and apply
//! the decisions that are still valid, all in one transaction that no other replica's pass
//! can interleave with.

use std::collections::{HashMap, HashSet};

use scheduler::inventory::Device;

use super::backend::{Arg, Conn, bind_args, insert_rows, lock_scheduling, on};
use super::rows::{kind, to_u32};
use super::{Decision, FreeDevice, HeldRanks, StoreError, jobs};
use crate::domain::{Job, JobState};

/// Decisions applied per UPDATE statement.
const DECISIONS_PER_UPDATE: usize = 500;

pub(super) async fn pass<F>(
    c: &mut Conn<'_>,
    decide: F,
    now: i64,
) -> Result<Vec<Decision>, StoreError>
where
    F: FnOnce(&[Job], &[FreeDevice], &HeldRanks) -> Vec<Decision> + Send,
{
    lock_scheduling(c).await?;
    let queue = jobs::queue(c).await?;
    let (free, node_names) = free_devices(c).await?;
    let held = jobs::held_ranks(c).await?;
    let decisions = decide(&queue, &free, &held);
    let valid = validate(decisions, &queue, &free);
    let mut applied = Vec::with_capacity(valid.len());
    for batch in valid.chunks(DECISIONS_PER_UPDATE) {
        apply(c, batch, &node_names, now, &mut applied).await?;
    }
    Ok(applied)
}

/// Devices of live nodes that no unreleased assignment holds, by node registration then index;
/// and node names by id, for reasons.
async fn free_devices(
    c: &mut Conn<'_>,
) -> Result<(Vec<FreeDevice>, HashMap<String, String>), StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, (String, String, i64, String, i64)>(
            "SELECT d.node_id, n.name, d.idx, d.kind, d.memory_bytes \
             FROM devices d JOIN nodes n ON n.id = d.node_id \
             WHERE NOT n.lost AND NOT EXISTS (SELECT 1 FROM assignments a \
                 WHERE a.node_id = d.node_id AND a.device = d.idx AND a.released_at IS NULL) \
             ORDER BY n.registered_at, n.id, d.idx",
        )
        .fetch_all(&mut **c)
        .await?
    });
    let mut names = HashMap::new();
    let mut free = Vec::with_capacity(rows.len());
    for (node_id, name, idx, kind_name, bytes) in rows {
        if !names.contains_key(&node_id) {
            names.insert(node_id.clone(), name);
        }
        free.push(FreeDevice {
            node_id,
            device: to_u32(idx, "device index")?,
            spec: Device {
                kind: kind(&kind_name)?,
                memory_bytes: bytes as u64,
            },
        });
    }
    Ok((free, names))
}

/// Keeps the decisions that place a job `decide` was shown, once, with one slot per rank on
/// devices it was shown as free, no device twice in the pass. The rest are bugs in `decide`:
/// logged and dropped, so they never reach the database.
fn validate(decisions: Vec<Decision>, queue: &[Job], free: &[FreeDevice]) -> Vec<Decision> {
    let world_sizes: HashMap<&str, u32> = queue
        .iter()
        .map(|j| (j.id.as_str(), j.world_size))
        .collect();
    let free: HashSet<(&str, u32)> = free
        .iter()
        .map(|f| (f.node_id.as_str(), f.device))
        .collect();
    let mut taken: HashSet<(String, u32)> = HashSet::new();
    let mut placed: HashSet<String> = HashSet::new();
    let mut valid = Vec::with_capacity(decisions.len());
    for d in decisions {
        let problem = match world_sizes.get(d.job_id.as_str()) {
            None => Some("the job is not queued".to_string()),
            Some(_) if placed.contains(&d.job_id) => Some("the job is placed twice".to_string()),
            Some(&n) if d.slots.len() != n as usize => {
                Some(format!("{} slots for world size {n}", d.slots.len()))
            }
            Some(_) => d
                .slots
                .iter()
                .enumerate()
                .find(|(i, (node, device))| {
                    !free.contains(&(node.as_str(), *device))
                        || taken.contains(&(node.clone(), *device))
                        || d.slots[..*i].contains(&(node.clone(), *device))
                })
                .map(|(_, (node, device))| format!("device {device} of node {node} is not free")),
        };
        match problem {
            Some(problem) => {
                tracing::warn!(job = %d.job_id, "scheduling decision dropped: {problem}");
            }
            None => {
                taken.extend(d.slots.iter().cloned());
                placed.insert(d.job_id.clone());
                valid.push(d);
            }
        }
    }
    valid
}

/// Moves the batch's jobs from queued to scheduled (compare-and-set: a job someone moved since
/// the queue was read is skipped) and records their transitions and assignments.
async fn apply(
    c: &mut Conn<'_>,
    batch: &[Decision],
    node_names: &HashMap<String, String>,
    now: i64,
    applied: &mut Vec<Decision>,
) -> Result<(), StoreError> {
    let reasons: HashMap<&str, String> = batch
        .iter()
        .map(|d| (d.job_id.as_str(), reason(d, node_names)))
        .collect();
    // Primary-key lookups on both databases (SQLite plans UPDATE … FROM (VALUES …) as a scan:
    // 0.2-0.4 s per 500 jobs); the reason per job is a CASE. Parameters in textual order.
    let mut args = vec![Arg::Int(now)];
    let mut n = 1;
    let mut param = || {
        n += 1;
        c.param(n)
    };
    let mut cases = String::new();
    for d in batch {
        cases.push_str(&format!(" WHEN {} THEN {}", param(), param()));
        args.push(Arg::Text(d.job_id.clone()));
        args.push(Arg::Text(reasons[d.job_id.as_str()].clone()));
    }
    let mut ids = Vec::with_capacity(batch.len());
    for d in batch {
        ids.push(param());
        args.push(Arg::Text(d.job_id.clone()));
    }
    let sql = format!(
        "UPDATE jobs SET state = 'scheduled', updated_at = {}, reason = CASE id{cases} END \
         WHERE id IN ({}) AND state = 'queued' RETURNING id, attempt",
        c.param(1),
        ids.join(", ")
    );
    let moved = on!(c, c => {
        bind_args!(sqlx::query_as::<_, (String, i64)>(&sql), args)
            .fetch_all(&mut **c)
            .await?
    });
    let attempts: HashMap<String, i64> = moved.into_iter().collect();
    let mut transitions = Vec::with_capacity(attempts.len());
    let mut assignments = Vec::new();
    for d in batch {
        let Some(&attempt) = attempts.get(&d.job_id) else {
            continue;
        };
        transitions.push(vec![
            Arg::Text(d.job_id.clone()),
            Arg::Int(attempt),
            Arg::Text(JobState::Queued.as_str().to_string()),
            Arg::Text(JobState::Scheduled.as_str().to_string()),
            Arg::Text(reasons[d.job_id.as_str()].clone()),
            Arg::Int(now),
        ]);
        for (rank, (node, device)) in d.slots.iter().enumerate() {
            assignments.push(vec![
                Arg::Text(d.job_id.clone()),
                Arg::Int(attempt),
                Arg::Int(rank as i64),
                Arg::Text(node.clone()),
                Arg::Int(i64::from(*device)),
                Arg::Int(now),
            ]);
        }
        applied.push(d.clone());
    }
    insert_rows(
        c,
        "transitions (job_id, attempt, from_state, to_state, reason, at)",
        6,
        transitions,
        "",
    )
    .await?;
    insert_rows(
        c,
        "assignments (job_id, attempt, rank, node_id, device, assigned_at)",
        6,
        assignments,
        "",
    )
    .await?;
    Ok(())
}

/// "placed on gpu-a[0,1,2,3] gpu-b[0,1]": nodes in rank order with their devices.
fn reason(d: &Decision, node_names: &HashMap<String, String>) -> String {
    let mut parts: Vec<(String, Vec<String>)> = Vec::new();
    for (node, device) in &d.slots {
        let name = node_names
            .get(node)
            .cloned()
            .unwrap_or_else(|| node.clone());
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
