//! Rows as the databases return them (integers as i64, JSON as text) and their conversion to
//! the domain records, which is where stored values are checked. Ids are text: they are
//! `scheduler`'s types, which this crate cannot teach sqlx, so queries bind `as_str()` and rows
//! read a `String` (`#[sqlx(try_from = "String")]`).

use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;
use serde::de::DeserializeOwned;

use super::StoreError;
use crate::domain::{AssignmentRecord, Job, JobId, JobState, NodeId, NodeRecord, Transition};

/// The columns of `jobs` that make a [`Job`], in [`JobRow`]'s order.
pub(super) const JOB_COLUMNS: &str = "id, name, state, priority, attempt, world_size, spec, plan, \
     unsupported_keys, owner, reason, master, created_at, updated_at";

/// [`JOB_COLUMNS`] qualified by the alias `j`.
pub(super) const J_JOB_COLUMNS: &str = "j.id, j.name, j.state, j.priority, j.attempt, \
     j.world_size, j.spec, j.plan, j.unsupported_keys, j.owner, j.reason, j.master, \
     j.created_at, j.updated_at";

fn corrupt(what: &str, reason: impl ToString) -> StoreError {
    StoreError::Corrupt {
        what: what.to_string(),
        reason: reason.to_string(),
    }
}

pub(super) fn to_u32(v: i64, what: &str) -> Result<u32, StoreError> {
    u32::try_from(v).map_err(|_| corrupt(what, format!("{v} is not a u32")))
}

pub(super) fn state(s: &str) -> Result<JobState, StoreError> {
    JobState::parse(s).ok_or_else(|| corrupt("job state", format!("unknown state {s:?}")))
}

pub(super) fn json<T: DeserializeOwned>(text: &str, what: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| corrupt(what, e))
}

pub(super) fn to_json(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).expect("records serialize to JSON")
}

pub(super) fn kind(name: &str) -> Result<DeviceKind, StoreError> {
    name.parse()
        .map_err(|_| corrupt("device kind", format!("unknown kind {name:?}")))
}

/// SQLite stores NaN as NULL; both stores read NULL back as NaN.
pub(super) fn real(v: f64) -> Option<f64> {
    (!v.is_nan()).then_some(v)
}

#[derive(sqlx::FromRow)]
pub(super) struct JobRow {
    #[sqlx(try_from = "String")]
    id: JobId,
    name: Option<String>,
    state: String,
    priority: i64,
    attempt: i64,
    world_size: i64,
    spec: String,
    plan: String,
    unsupported_keys: String,
    owner: String,
    reason: String,
    master: Option<String>,
    created_at: i64,
    updated_at: i64,
}

impl TryFrom<JobRow> for Job {
    type Error = StoreError;

    fn try_from(r: JobRow) -> Result<Job, StoreError> {
        Ok(Job {
            state: state(&r.state)?,
            priority: i32::try_from(r.priority).map_err(|_| corrupt("job priority", r.priority))?,
            attempt: to_u32(r.attempt, "job attempt")?,
            world_size: to_u32(r.world_size, "job world size")?,
            spec: json(&r.spec, "job spec")?,
            plan: json(&r.plan, "job plan")?,
            unsupported_keys: json(&r.unsupported_keys, "job unsupported keys")?,
            id: r.id,
            name: r.name,
            owner: r.owner,
            reason: r.reason,
            master: r.master,
            created_at: r.created_at,
            updated_at: r.updated_at,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct TransitionRow {
    at: i64,
    from_state: Option<String>,
    to_state: String,
    reason: String,
}

impl TryFrom<TransitionRow> for Transition {
    type Error = StoreError;

    fn try_from(r: TransitionRow) -> Result<Transition, StoreError> {
        Ok(Transition {
            at: r.at,
            from: r.from_state.as_deref().map(state).transpose()?,
            to: state(&r.to_state)?,
            reason: r.reason,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct AssignmentRow {
    #[sqlx(try_from = "String")]
    pub(super) job_id: JobId,
    pub(super) attempt: i64,
    pub(super) rank: i64,
    #[sqlx(try_from = "String")]
    pub(super) node_id: NodeId,
    pub(super) device: i64,
}

/// The columns of `assignments` that make an [`AssignmentRecord`], qualified by the alias `a`.
pub(super) const A_ASSIGNMENT_COLUMNS: &str = "a.job_id, a.attempt, a.rank, a.node_id, a.device";

impl TryFrom<AssignmentRow> for AssignmentRecord {
    type Error = StoreError;

    fn try_from(r: AssignmentRow) -> Result<AssignmentRecord, StoreError> {
        Ok(AssignmentRecord {
            attempt: to_u32(r.attempt, "assignment attempt")?,
            rank: to_u32(r.rank, "assignment rank")?,
            device: to_u32(r.device, "assignment device")?,
            job_id: r.job_id,
            node_id: r.node_id,
        })
    }
}

/// A node joined with one of its devices (none for a node without devices).
#[derive(sqlx::FromRow)]
pub(super) struct NodeDeviceRow {
    #[sqlx(try_from = "String")]
    id: NodeId,
    name: String,
    host: String,
    registered_at: i64,
    last_heartbeat: i64,
    lost: bool,
    reserved_for: Option<String>,
    idx: Option<i64>,
    kind: Option<String>,
    memory_bytes: Option<i64>,
}

/// The columns of `nodes n LEFT JOIN devices d` that make a [`NodeDeviceRow`].
pub(super) const NODE_DEVICE_COLUMNS: &str = "n.id, n.name, n.host, n.registered_at, \
     n.last_heartbeat, n.lost, n.reserved_for, d.idx, d.kind, d.memory_bytes";

/// Groups rows ordered by node, then device index, into nodes.
pub(super) fn nodes_from_rows(rows: Vec<NodeDeviceRow>) -> Result<Vec<NodeRecord>, StoreError> {
    let mut nodes: Vec<NodeRecord> = Vec::new();
    for r in rows {
        if nodes.last().is_none_or(|n| n.id != r.id) {
            nodes.push(NodeRecord {
                id: r.id,
                name: r.name,
                host: r.host,
                devices: Vec::new(),
                registered_at: r.registered_at,
                last_heartbeat: r.last_heartbeat,
                lost: r.lost,
                reserved_for: r.reserved_for.map(JobId::from),
            });
        }
        let node = nodes.last_mut().expect("pushed above");
        if let (Some(idx), Some(k), Some(bytes)) = (r.idx, r.kind, r.memory_bytes) {
            if idx != node.devices.len() as i64 {
                return Err(corrupt(
                    "node devices",
                    format!("node {} lacks device {}", node.id, node.devices.len()),
                ));
            }
            node.devices.push(DeviceSlot {
                kind: kind(&k)?,
                memory_bytes: u64::try_from(bytes).map_err(|_| corrupt("device memory", bytes))?,
            });
        }
    }
    Ok(nodes)
}
