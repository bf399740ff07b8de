//! The board: what the one scheduler keeps in memory between passes, so that a pass reads only
//! what changed since the last one: the queue in scheduling order, the devices of live nodes
//! and which of them jobs hold, and the ranks each owner holds.
//!
//! How a pass learns what changed. Every change of a job's state is a row of `transitions`,
//! written in the same transaction as the change, with an `id` that rises row after row. The
//! board remembers the highest id it read; a pass reads the rows after it and re-reads the jobs
//! they name, whose current row decides (so the order in which changes arrive does not matter,
//! and a change seen twice changes nothing). PostgreSQL gives a row its id when it is inserted,
//! not when it commits, so an id below the highest read may still appear: ids skipped are kept
//! and looked for again. Nodes and devices change only under the scheduling lock, each time
//! raising `scheduling.nodes_version`; the board re-reads them when it moved. Unlike the
//! server's own events, the table also carries what other replicas did. A full load, when the
//! lease is taken, after a pass failed and every [`RESYNC_EVERY`] as a safety net, rebuilds the
//! board from the tables.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use scheduler::inventory::DeviceSlot;
use scheduler::queue::{BoardDevice, BoardNode, HeldRanks, QueuedJob};

use super::StoreError;
use super::backend::{Conn, on};
use super::lease::Held;
use super::rows::{json, kind, state, to_u32};
use crate::domain::{JobId, JobState, NodeId};

/// How often the board is rebuilt from the tables even though nothing seemed to be missed.
pub const RESYNC_EVERY: Duration = Duration::from_secs(300);

/// At a full load, transition ids this far below the highest that are not in the table yet are
/// looked for afterwards: they may belong to transactions still running.
const LOAD_WINDOW: i64 = 1000;

/// Skipped ids to look for in every pass before a full load is cheaper.
const MAX_MISSING: usize = 1000;

/// Jobs re-read per statement.
const JOBS_PER_SELECT: usize = 500;

/// The devices a job holds.
#[derive(Debug, Clone, PartialEq)]
struct Hold {
    attempt: u32,
    owner: String,
    world_size: u32,
    /// Whether its ranks count towards its owner's (the job is scheduled or running).
    counted: bool,
    slots: Vec<(NodeId, u32)>,
}

/// Priority descending, then oldest, then id.
type QueueKey = (Reverse<i32>, i64, JobId);

/// Where in `transitions` the board has read to.
#[derive(Debug, Clone, Default)]
struct Cursor {
    last: i64,
    /// Ids below `last` not read yet.
    missing: BTreeSet<i64>,
    /// More ids were skipped than are worth looking for: only a load can tell what they were.
    overflowed: bool,
}

impl Cursor {
    /// Notes ids read, in any order.
    fn saw(&mut self, ids: impl IntoIterator<Item = i64>) {
        let mut ids: Vec<i64> = ids.into_iter().collect();
        ids.sort_unstable();
        for id in ids {
            if id > self.last {
                let skipped = usize::try_from(id - self.last - 1).unwrap_or(usize::MAX);
                if self.missing.len().saturating_add(skipped) > MAX_MISSING {
                    self.overflowed = true;
                } else {
                    self.missing.extend(self.last + 1..id);
                }
                self.last = id;
            } else {
                self.missing.remove(&id);
            }
        }
    }
}

/// See the module documentation. Two boards are equal when they show the same queue, devices
/// and holds, wherever each has read to.
#[derive(Debug, Clone, Default)]
pub struct Board {
    /// The lease term the board is in step with; `None` until loaded (or after a failed pass).
    term: Option<i64>,
    nodes_version: i64,
    loaded_at: Option<Instant>,
    cursor: Cursor,
    queue: BTreeMap<QueueKey, QueuedJob>,
    queued: HashMap<JobId, QueueKey>,
    /// Live nodes in registration order.
    nodes: Vec<BoardNode>,
    node_at: HashMap<NodeId, usize>,
    holds: HashMap<JobId, Hold>,
    held_ranks: HeldRanks,
}

impl PartialEq for Board {
    fn eq(&self, other: &Board) -> bool {
        self.queue == other.queue
            && self.nodes == other.nodes
            && self.holds == other.holds
            && self.held_ranks == other.held_ranks
    }
}

impl Board {
    /// The queued jobs, priority descending, then oldest first.
    pub fn queue(&self) -> impl Iterator<Item = &QueuedJob> {
        self.queue.values()
    }

    pub fn queued(&self, id: &JobId) -> Option<&QueuedJob> {
        self.queue.get(self.queued.get(id)?)
    }

    /// Live nodes, in registration order, with every device.
    pub fn nodes(&self) -> &[BoardNode] {
        &self.nodes
    }

    /// Ranks held by each owner's scheduled and running jobs.
    pub fn held_ranks(&self) -> &HeldRanks {
        &self.held_ranks
    }

    /// Device `index` of node `node_id` as (node position, index) if it is live and free.
    pub(super) fn free_slot(&self, node_id: &NodeId, index: u32) -> Option<(usize, u32)> {
        let at = *self.node_at.get(node_id)?;
        let device = self.nodes[at].devices.iter().find(|d| d.index == index)?;
        (!device.held).then_some((at, index))
    }

    pub(super) fn node_name(&self, node_id: &NodeId) -> Option<&str> {
        Some(&self.nodes[*self.node_at.get(node_id)?].name)
    }

    /// Whether the next pass must load the board from the tables.
    pub(super) fn stale(&self, lease: Held) -> bool {
        self.term != Some(lease.term)
            || self.loaded_at.is_none_or(|t| t.elapsed() >= RESYNC_EVERY)
            || self.cursor.overflowed
    }

    /// Forgets everything: the next pass loads.
    pub(super) fn clear(&mut self) {
        *self = Board::default();
    }

    /// Marks the board out of step while a pass changes it: a pass that fails leaves it so,
    /// and the next one loads.
    pub(super) fn begin(&mut self) {
        self.term = None;
    }

    /// Marks the board in step with `lease`, once its pass committed.
    pub(super) fn in_step(&mut self, lease: Held) {
        self.term = Some(lease.term);
    }

    /// Notes transitions the board's own pass wrote.
    pub(super) fn saw(&mut self, ids: impl IntoIterator<Item = i64>) {
        self.cursor.saw(ids);
    }

    /// Records a placement the pass committed: `job` at `attempt` on `slots`.
    pub(super) fn placed(&mut self, job_id: &JobId, attempt: u32, slots: &[(NodeId, u32)]) {
        let Some(job) = self.dequeue(job_id) else {
            return;
        };
        for (node, index) in slots {
            if let Some(d) = self.device_mut(node, *index) {
                d.held = true;
            }
        }
        *self.held_ranks.entry(job.owner.clone()).or_default() += job.world_size;
        self.holds.insert(
            job.id,
            Hold {
                attempt,
                owner: job.owner,
                world_size: job.world_size,
                counted: true,
                slots: slots.to_vec(),
            },
        );
    }

    fn device_mut(&mut self, node_id: &NodeId, index: u32) -> Option<&mut BoardDevice> {
        let node = &mut self.nodes[*self.node_at.get(node_id)?];
        node.devices.iter_mut().find(|d| d.index == index)
    }

    fn enqueue(&mut self, job: QueuedJob) {
        self.dequeue(&job.id);
        let key = (Reverse(job.priority), job.created_at, job.id.clone());
        self.queued.insert(job.id.clone(), key.clone());
        self.queue.insert(key, job);
    }

    fn dequeue(&mut self, id: &JobId) -> Option<QueuedJob> {
        let key = self.queued.remove(id)?;
        self.queue.remove(&key)
    }

    /// Frees the devices job `id` held.
    fn release(&mut self, id: &JobId) {
        let Some(hold) = self.holds.remove(id) else {
            return;
        };
        for (node, index) in &hold.slots {
            if let Some(d) = self.device_mut(node, *index) {
                d.held = false;
            }
        }
        if hold.counted {
            self.uncount(&hold.owner, hold.world_size);
        }
    }

    fn uncount(&mut self, owner: &str, ranks: u32) {
        if let Some(n) = self.held_ranks.get_mut(owner) {
            *n = n.saturating_sub(ranks);
            if *n == 0 {
                self.held_ranks.remove(owner);
            }
        }
    }

    /// Applies a job's current row; false when it holds devices the board does not know of
    /// (someone else placed it), and only a load can tell which.
    fn apply(&mut self, row: JobRow) -> Result<bool, StoreError> {
        let s = state(&row.state)?;
        let attempt = to_u32(row.attempt, "job attempt")?;
        match s {
            JobState::Queued => {
                self.release(&row.id);
                let plan = row.plan.as_deref().unwrap_or_default();
                self.enqueue(QueuedJob {
                    priority: i32::try_from(row.priority).map_err(|_| StoreError::Corrupt {
                        what: "job priority".into(),
                        reason: row.priority.to_string(),
                    })?,
                    attempt,
                    world_size: to_u32(row.world_size, "job world size")?,
                    plan: json(plan, "job plan")?,
                    created_at: row.created_at,
                    queued_at: row.updated_at,
                    owner: row.owner,
                    id: row.id,
                });
            }
            JobState::Scheduled | JobState::Running => {
                self.dequeue(&row.id);
                if self.holds.get(&row.id).map(|h| h.attempt) != Some(attempt) {
                    return Ok(false);
                }
            }
            JobState::Succeeded | JobState::Failed | JobState::Cancelled => {
                self.dequeue(&row.id);
                self.release(&row.id);
            }
        }
        Ok(true)
    }
}

/// The columns of a job the board reads; `plan` only for queued jobs.
#[derive(sqlx::FromRow)]
struct JobRow {
    #[sqlx(try_from = "String")]
    id: JobId,
    state: String,
    attempt: i64,
    owner: String,
    priority: i64,
    world_size: i64,
    created_at: i64,
    updated_at: i64,
    plan: Option<String>,
}

const JOB_COLUMNS: &str = "id, state, attempt, owner, priority, world_size, created_at, \
     updated_at, CASE WHEN state = 'queued' THEN plan END AS plan";

/// Rebuilds `board` from the tables.
pub(super) async fn load(
    c: &mut Conn<'_>,
    board: &mut Board,
    lease: Held,
) -> Result<(), StoreError> {
    board.clear();
    // The cursor first: whatever commits while the rest is read has a later id, or one of the
    // ids found missing here, and is read again by the next pass.
    let ids = on!(c, c => {
        sqlx::query_scalar::<_, i64>(
            "SELECT id FROM transitions \
             WHERE id > (SELECT COALESCE(MAX(id), 0) FROM transitions) - $1 ORDER BY id",
        )
        .bind(LOAD_WINDOW)
        .fetch_all(&mut **c)
        .await?
    });
    if let Some(&last) = ids.last() {
        board.cursor.last = (last - LOAD_WINDOW).max(0);
        board.cursor.saw(ids);
    }
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'queued'");
    let queued = on!(c, c => {
        sqlx::query_as::<_, JobRow>(&sql).fetch_all(&mut **c).await?
    });
    for row in queued {
        board.apply(row)?;
    }
    let held = on!(c, c => {
        sqlx::query_as::<_, (String, i64, String, i64, String, i64, String)>(
            "SELECT a.job_id, a.attempt, a.node_id, a.device, j.owner, j.world_size, j.state \
             FROM assignments a JOIN jobs j ON j.id = a.job_id \
             WHERE a.released_at IS NULL ORDER BY a.job_id, a.rank",
        )
        .fetch_all(&mut **c)
        .await?
    });
    for (job_id, attempt, node, device, owner, world_size, job_state) in held {
        let (job_id, node) = (JobId::from(job_id), NodeId::from(node));
        let device = to_u32(device, "device index")?;
        if let Some(hold) = board.holds.get_mut(&job_id) {
            hold.slots.push((node, device));
            continue;
        }
        let world_size = to_u32(world_size, "job world size")?;
        let counted = state(&job_state)?.holds_devices();
        if counted {
            *board.held_ranks.entry(owner.clone()).or_default() += world_size;
        }
        board.holds.insert(
            job_id,
            Hold {
                attempt: to_u32(attempt, "attempt")?,
                owner,
                world_size,
                counted,
                slots: vec![(node, device)],
            },
        );
    }
    load_nodes(c, board).await?;
    board.nodes_version = lease.nodes_version;
    board.loaded_at = Some(Instant::now());
    Ok(())
}

/// Brings `board` up to date with what changed since the last pass; false when that cannot be
/// told from the changes and the board must be loaded.
pub(super) async fn sync(
    c: &mut Conn<'_>,
    board: &mut Board,
    lease: Held,
) -> Result<bool, StoreError> {
    let missing: Vec<i64> = board.cursor.missing.iter().copied().collect();
    let mut sql = format!(
        "SELECT id, job_id FROM transitions WHERE id > {}",
        c.param(1)
    );
    if !missing.is_empty() {
        let params: Vec<String> = (0..missing.len()).map(|i| c.param(i + 2)).collect();
        sql.push_str(&format!(" OR id IN ({})", params.join(", ")));
    }
    let changes = on!(c, c => {
        let mut q = sqlx::query_as::<_, (i64, String)>(&sql).bind(board.cursor.last);
        for id in &missing {
            q = q.bind(id);
        }
        q.fetch_all(&mut **c).await?
    });
    board.cursor.saw(changes.iter().map(|(id, _)| *id));
    let changed: BTreeSet<String> = changes.into_iter().map(|(_, job)| job).collect();
    let changed: Vec<String> = changed.into_iter().collect();
    for chunk in changed.chunks(JOBS_PER_SELECT) {
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE id IN ({})",
            (0..chunk.len())
                .map(|i| c.param(i + 1))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let rows = on!(c, c => {
            let mut q = sqlx::query_as::<_, JobRow>(&sql);
            for id in chunk {
                q = q.bind(id);
            }
            q.fetch_all(&mut **c).await?
        });
        for row in rows {
            if !board.apply(row)? {
                return Ok(false);
            }
        }
    }
    if lease.nodes_version != board.nodes_version {
        load_nodes(c, board).await?;
        board.nodes_version = lease.nodes_version;
    }
    Ok(true)
}

/// A live node's device, with the job and attempt the node is reserved for.
type NodeRow = (
    String,
    String,
    Option<String>,
    Option<i64>,
    i64,
    String,
    i64,
);

/// Reads the devices of live nodes again and marks those the board's holds hold.
async fn load_nodes(c: &mut Conn<'_>, board: &mut Board) -> Result<(), StoreError> {
    let rows = on!(c, c => {
        sqlx::query_as::<_, NodeRow>(
            "SELECT d.node_id, n.name, n.reserved_for, n.reserved_attempt, d.idx, d.kind, \
             d.memory_bytes \
             FROM devices d JOIN nodes n ON n.id = d.node_id \
             WHERE NOT n.lost ORDER BY n.registered_at, n.id, d.idx",
        )
        .fetch_all(&mut **c)
        .await?
    });
    board.nodes.clear();
    board.node_at.clear();
    for (node_id, name, job, attempt, index, kind_name, bytes) in rows {
        let node_id = NodeId::from(node_id);
        if board.nodes.last().is_none_or(|n| n.id != node_id) {
            board.node_at.insert(node_id.clone(), board.nodes.len());
            board.nodes.push(BoardNode {
                id: node_id,
                name,
                devices: Vec::new(),
                reserved_for: match (job, attempt) {
                    (Some(job), Some(attempt)) => Some((job.into(), to_u32(attempt, "attempt")?)),
                    _ => None,
                },
            });
        }
        board
            .nodes
            .last_mut()
            .expect("pushed")
            .devices
            .push(BoardDevice {
                index: to_u32(index, "device index")?,
                spec: DeviceSlot {
                    kind: kind(&kind_name)?,
                    memory_bytes: bytes as u64,
                },
                held: false,
            });
    }
    let held: Vec<(NodeId, u32)> = board
        .holds
        .values()
        .flat_map(|h| h.slots.iter().cloned())
        .collect();
    for (node, index) in held {
        if let Some(d) = board.device_mut(&node, index) {
            d.held = true;
        }
    }
    Ok(())
}
