//! The scheduling loop: every scheduling interval (or sooner, when a job arrives or devices free
//! up), declare silent nodes lost, then place queued jobs on free devices. Only the replica
//! holding the scheduler lease places; it keeps the queue and the devices on its board between
//! passes (`store::Board`). `decide` is the policy, a pure function: priority, then submission
//! order; gang placement of all of a job's ranks on devices of its plan's kind
//! (`scheduler::placement::place`'s choices, with the safety margin); and backfill: while the
//! head of the queue waits for devices of a kind, jobs of that kind smaller than it that fit now
//! start (a job waiting for GPUs holds up no CPU job). A pass places at most
//! [`RANKS_PER_PASS`] ranks and, when it stops there, the next pass follows at once: filling an
//! empty cluster is a few short passes rather than one long write.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use scheduler::memory::DeviceKind;
use scheduler::plan::Plan;
use scheduler::pool::Pool;

use crate::app::{AppState, JobEvent, now_ms};
use crate::domain::JobState;
use crate::retention;
use crate::store::{BoardNode, Decision, HeldRanks, Placement, QueuedJob, StoreError};

/// How much of the cluster one owner may hold: `held` ranks now, at most `limit` at once.
#[derive(Debug, Clone, Copy)]
pub struct OwnerQuota<'a> {
    pub held: &'a HeldRanks,
    pub limit: u32,
}

/// The ranks one pass places at most (a larger job still goes alone). A pass holds the store's
/// write lock while it writes, so this bounds how long submissions and heartbeats wait behind
/// it: medians of 7-10 ms of writes on either store (`cargo bench -p server --bench schedule`),
/// where one pass filling 8,000 free devices wrote for 68-139 ms. Stopping early changes only
/// timing: the next pass, on the board with these placements, decides as this one would have
/// gone on (Slurm bounds its passes the same way, `sched_max_job_start`).
pub const RANKS_PER_PASS: u32 = 512;

/// What one pass decided.
#[derive(Debug, Default)]
pub struct Decided {
    /// Placements in scheduling order.
    pub decisions: Vec<Decision>,
    /// The pass stopped at its rank budget with jobs left to try: run the next one now.
    pub capped: bool,
}

/// Placements for as many of `queue` (in scheduling order) as fit on the free devices of
/// `nodes`, keeping `margin` of every device free, stopping before the job that would take the
/// pass past `max_ranks` (unless it is the first placed). A job that would take its owner past
/// `quota` waits, without holding up other owners' jobs.
pub fn decide<'a>(
    queue: impl IntoIterator<Item = &'a QueuedJob>,
    nodes: &[BoardNode],
    margin: f64,
    quota: OwnerQuota<'_>,
    max_ranks: u32,
) -> Decided {
    let mut held: HeldRanks = quota.held.clone();
    let mut free = Free::new(nodes);
    let mut decided = Decided::default();
    let mut ranks: u32 = 0;
    // Per kind, bytes the first job that had to wait needs in all; only smaller jobs may pass.
    let mut head_waits: HashMap<DeviceKind, u128> = HashMap::new();
    // Free devices only shrink during a pass, so a shape that did not fit never will.
    let mut failed: HashSet<(u32, u64, DeviceKind)> = HashSet::new();
    for job in queue {
        if free.pool.is_empty() {
            break;
        }
        let plan = &job.plan;
        let base = plan.need_on(plan.device);
        let size = u128::from(base) * u128::from(job.world_size);
        let shape = (job.world_size, base, plan.device);
        if head_waits
            .get(&plan.device)
            .is_some_and(|&head| size >= head)
            || failed.contains(&shape)
        {
            continue;
        }
        let owner_ranks = held.get(&job.owner).copied().unwrap_or(0);
        if owner_ranks.saturating_add(job.world_size) > quota.limit {
            continue;
        }
        if ranks > 0 && ranks.saturating_add(job.world_size) > max_ranks {
            decided.capped = true;
            break;
        }
        match free.place(job.world_size as usize, margin, plan) {
            Some(slots) => {
                held.insert(job.owner.clone(), owner_ranks + job.world_size);
                ranks += job.world_size;
                decided.decisions.push(Decision {
                    job_id: job.id.clone(),
                    slots,
                });
            }
            None => {
                failed.insert(shape);
                head_waits.entry(plan.device).or_insert(size);
            }
        }
    }
    decided
}

/// The free devices of a pass in a placement pool, nodes by id (placement's tie-break), with
/// the node id and device index each pool slot stands for.
struct Free<'a> {
    pool: Pool,
    slots: Vec<(&'a str, Vec<u32>)>,
}

impl<'a> Free<'a> {
    fn new(nodes: &'a [BoardNode]) -> Free<'a> {
        let mut order: Vec<&BoardNode> = nodes
            .iter()
            .filter(|n| n.devices.iter().any(|d| !d.held))
            .collect();
        order.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        let mut pool = Pool::default();
        let mut slots = Vec::with_capacity(order.len());
        for node in order {
            let free = || node.devices.iter().filter(|d| !d.held);
            pool.add_node(free().map(|d| d.spec));
            slots.push((node.id.as_str(), free().map(|d| d.index).collect()));
        }
        Free { pool, slots }
    }

    /// Places every rank or none, taking the devices used out of the pool.
    fn place(&mut self, ranks: usize, margin: f64, plan: &Plan) -> Option<Vec<(String, u32)>> {
        let slots = self
            .pool
            .place(ranks, margin, plan.device, plan.need_on(plan.device))?;
        Some(
            slots
                .iter()
                .map(|s| {
                    let (node, devices) = &self.slots[s.node];
                    (node.to_string(), devices[s.device])
                })
                .collect(),
        )
    }
}

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
            match retention::collect(&state, now_ms()).await {
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
/// scheduler; a pass capped at [`RANKS_PER_PASS`] wakes the loop for the next), refresh the job
/// gauges and drop the series of jobs that ended a while ago. Returns the placements made.
pub async fn pass(state: &AppState) -> Result<Vec<Placement>, StoreError> {
    let start = Instant::now();
    reap(state).await?;
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
    drop(board);
    if capped {
        state.wake_scheduler.notify_one();
    }
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
    let mut nodes: Vec<&str> = placed
        .iter()
        .flat_map(|p| p.slots.iter().map(|(node, _)| node.as_str()))
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    for node in nodes {
        state.wake_agents(Some(node));
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
    if state.started.elapsed() < state.settings.heartbeat_timeout {
        return Ok(());
    }
    let timeout = i64::try_from(state.settings.heartbeat_timeout.as_millis()).unwrap_or(i64::MAX);
    for id in state.store.reap_lost_nodes(now_ms() - timeout).await? {
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
    end_overdue(state, now_ms()).await?;
    state
        .metrics
        .set_job_counts(&state.store.count_by_state().await?);
    state.metrics.expire(state.settings.finished_series_ttl);
    Ok(())
}

/// Fails every job whose current attempt has held its devices longer than `max_wall_time` at
/// `now`; its agents are told to stop at their next heartbeat. Returns the jobs failed.
pub async fn end_overdue(state: &AppState, now: i64) -> Result<Vec<String>, StoreError> {
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

#[cfg(test)]
mod tests {
    use scheduler::inventory::Device;
    use scheduler::memory::Breakdown;
    use scheduler::plan::Choices;
    use scheduler::spec::ZeroStage;

    use super::*;
    use crate::store::BoardDevice;

    /// `decide` with no owner holding anything and no owner limit.
    fn decide(queue: &[QueuedJob], nodes: &[BoardNode], margin: f64) -> Vec<Decision> {
        let held = HeldRanks::new();
        let quota = OwnerQuota {
            held: &held,
            limit: u32::MAX,
        };
        super::decide(queue, nodes, margin, quota, u32::MAX).decisions
    }

    const GB: u64 = 1_000_000_000;

    fn job(id: &str, world_size: u32, gb_per_rank: u64) -> QueuedJob {
        QueuedJob {
            id: id.into(),
            owner: "t".into(),
            priority: 0,
            attempt: 1,
            world_size,
            plan: Plan {
                chosen: Choices {
                    zero_stage: ZeroStage::Gradients,
                    activation_checkpointing: false,
                    micro_batch_size: 4,
                    grad_accum_steps: 1,
                },
                per_rank_bytes: Breakdown {
                    params: gb_per_rank * GB,
                    ..Breakdown::default()
                },
                device: DeviceKind::Cpu,
                comm_bytes_per_step: 0,
                devices_that_fit: 1,
                bytes_by_rank: Vec::new(),
            },
            created_at: 0,
            queued_at: 0,
        }
    }

    /// A node of free CPU devices of `gbs` GB.
    fn node(id: &str, gbs: &[u64]) -> BoardNode {
        BoardNode {
            id: id.into(),
            name: id.into(),
            devices: gbs
                .iter()
                .enumerate()
                .map(|(i, &gb)| BoardDevice {
                    index: i as u32,
                    spec: Device {
                        kind: DeviceKind::Cpu,
                        memory_bytes: gb * GB,
                    },
                    held: false,
                })
                .collect(),
        }
    }

    fn placed(decisions: &[Decision]) -> Vec<&str> {
        decisions.iter().map(|d| d.job_id.as_str()).collect()
    }

    #[test]
    fn the_queue_is_served_in_order_until_the_devices_run_out() {
        let queue = [job("urgent", 1, 10), job("old", 1, 10), job("new", 1, 10)];
        let nodes = [node("n", &[16, 16])];
        assert_eq!(placed(&decide(&queue, &nodes, 0.0)), ["urgent", "old"]);
    }

    #[test]
    fn all_ranks_of_a_job_are_placed_or_none() {
        let queue = [job("four", 4, 10)];
        assert!(decide(&queue, &[node("n", &[16, 16, 16])], 0.0).is_empty());
        let nodes = [node("a", &[16, 16]), node("b", &[16, 16])];
        let d = decide(&queue, &nodes, 0.0);
        assert_eq!(
            d[0].slots,
            [("a", 0), ("a", 1), ("b", 0), ("b", 1)].map(|(n, i)| (n.to_string(), i))
        );
    }

    #[test]
    fn held_devices_are_not_offered() {
        let mut nodes = [node("a", &[16, 16]), node("b", &[16, 16])];
        nodes[0].devices[0].held = true;
        nodes[1].devices[1].held = true;
        let d = decide(&[job("two", 2, 10)], &nodes, 0.0);
        assert_eq!(
            d[0].slots,
            [("a", 1), ("b", 0)].map(|(n, i)| (n.to_string(), i))
        );
    }

    #[test]
    fn nodes_are_tried_in_id_order_whatever_order_they_come_in() {
        let nodes = [node("b", &[16]), node("a", &[16])];
        let d = decide(&[job("one", 1, 10)], &nodes, 0.0);
        assert_eq!(d[0].slots, [("a".to_string(), 0)]);
    }

    #[test]
    fn smaller_jobs_backfill_while_the_head_waits() {
        let queue = [
            job("head", 4, 10),
            job("small", 1, 10),
            job("same-size", 4, 10),
        ];
        let nodes = [node("n", &[16, 16, 16])];
        assert_eq!(placed(&decide(&queue, &nodes, 0.0)), ["small"]);
    }

    #[test]
    fn a_job_as_large_as_the_waiting_head_does_not_pass_it() {
        let queue = [job("head", 2, 20), job("wide", 4, 10)];
        assert!(decide(&queue, &[node("n", &[16, 16, 16, 16])], 0.0).is_empty());
    }

    #[test]
    fn devices_taken_by_one_job_are_not_given_to_another() {
        let queue = [job("a", 2, 10), job("b", 2, 10)];
        let d = decide(&queue, &[node("n", &[16, 16, 16])], 0.0);
        assert_eq!(placed(&d), ["a"]);
        assert_eq!(d[0].slots.len(), 2);
    }

    #[test]
    fn the_safety_margin_keeps_part_of_each_device_free() {
        let queue = [job("j", 1, 15)];
        let nodes = [node("n", &[16])];
        assert_eq!(decide(&queue, &nodes, 0.0).len(), 1);
        assert!(
            decide(&queue, &nodes, 0.1).is_empty(),
            "15 GB > 90% of 16 GB"
        );
    }

    /// `node` with its devices made GPUs.
    fn gpu_node(id: &str, gbs: &[u64]) -> BoardNode {
        let mut n = node(id, gbs);
        for d in &mut n.devices {
            d.spec.kind = DeviceKind::Cuda;
        }
        n
    }

    fn gpu_job(id: &str, world_size: u32, gb_per_rank: u64) -> QueuedJob {
        let mut j = job(id, world_size, gb_per_rank);
        j.plan.device = DeviceKind::Cuda;
        j
    }

    #[test]
    fn a_cuda_device_pays_its_runtime_overhead() {
        let queue = [gpu_job("j", 1, 15)];
        let mut nodes = [gpu_node("gpu", &[16])];
        nodes[0].devices[0].spec.memory_bytes = 15 * GB + DeviceKind::Cuda.overhead_bytes() - 1;
        assert!(decide(&queue, &nodes, 0.0).is_empty());
        nodes[0].devices[0].spec.memory_bytes += 1;
        assert_eq!(decide(&queue, &nodes, 0.0).len(), 1);
    }

    #[test]
    fn jobs_land_on_their_kind_and_a_job_waiting_for_gpus_holds_up_no_cpu_job() {
        let queue = [
            gpu_job("gpu-head", 4, 10),
            gpu_job("gpu-small", 1, 10),
            // Larger than the waiting GPU head, but it waits for other devices.
            job("cpu-wide", 3, 15),
        ];
        let nodes = [node("cpu", &[16, 16, 16]), gpu_node("gpu", &[80, 80])];
        let d = decide(&queue, &nodes, 0.0);
        assert_eq!(placed(&d), ["gpu-small", "cpu-wide"]);
        assert_eq!(d[0].slots, [("gpu".to_string(), 0)]);
        assert!(d[1].slots.iter().all(|(node, _)| node == "cpu"), "{d:?}");
    }

    #[test]
    fn an_owner_past_its_running_ranks_waits_while_others_run() {
        let mut queue = [job("alice-1", 2, 1), job("alice-2", 2, 1), job("bob", 2, 1)];
        queue[0].owner = "alice".into();
        queue[1].owner = "alice".into();
        let nodes = [node("n", &[16; 8])];
        let mut held = HeldRanks::new();
        held.insert("alice".into(), 1);
        let quota = OwnerQuota {
            held: &held,
            limit: 4,
        };
        // alice holds 1: her first job takes her to 3, the second would pass 4 and waits.
        let d = super::decide(&queue, &nodes, 0.0, quota, u32::MAX).decisions;
        assert_eq!(placed(&d), ["alice-1", "bob"]);
        let none_held = HeldRanks::new();
        let quota = OwnerQuota {
            held: &none_held,
            limit: 4,
        };
        assert_eq!(
            placed(&super::decide(&queue, &nodes, 0.0, quota, u32::MAX).decisions),
            ["alice-1", "alice-2", "bob"]
        );
    }

    #[test]
    fn capped_passes_place_what_one_pass_would_in_the_same_order() {
        // A head that waits, backfill behind it, jobs of several widths.
        let mut queue: Vec<QueuedJob> = (0..24)
            .map(|i| job(&format!("j{i:02}"), [1, 2, 3, 9][i % 4], 10))
            .collect();
        queue[0] = job("head", 40, 10);
        let mut nodes: Vec<BoardNode> = (0..4).map(|n| node(&format!("n{n}"), &[16; 8])).collect();
        let whole = decide(&queue, &nodes, 0.0);
        assert!(whole.len() > 4, "{:?}", placed(&whole));

        let none_held = HeldRanks::new();
        let quota = OwnerQuota {
            held: &none_held,
            limit: u32::MAX,
        };
        let (mut in_passes, mut passes) = (Vec::new(), 0);
        loop {
            passes += 1;
            let d = super::decide(&queue, &nodes, 0.0, quota, 5);
            let ranks: usize = d.decisions.iter().map(|d| d.slots.len()).sum();
            assert!(
                ranks <= 5 || d.decisions.len() == 1,
                "{ranks} ranks in a pass"
            );
            // The board after the commit: placed jobs leave the queue, their devices are held.
            for decision in &d.decisions {
                queue.retain(|j| j.id != decision.job_id);
                for (id, index) in &decision.slots {
                    let n = nodes.iter_mut().find(|n| &n.id == id).unwrap();
                    n.devices[*index as usize].held = true;
                }
            }
            in_passes.extend(d.decisions);
            if !d.capped {
                break;
            }
        }
        assert!(passes > 2, "{passes} passes");
        assert_eq!(in_passes, whole);
    }

    #[test]
    fn a_job_wider_than_the_budget_goes_alone() {
        let queue = [job("wide", 4, 10), job("one", 1, 10)];
        let none_held = HeldRanks::new();
        let quota = OwnerQuota {
            held: &none_held,
            limit: u32::MAX,
        };
        let d = super::decide(&queue, &[node("n", &[16; 8])], 0.0, quota, 2);
        assert_eq!(placed(&d.decisions), ["wide"]);
        assert!(d.capped);
    }

    #[test]
    fn the_need_replaces_the_planned_device_overhead() {
        let mut j = job("j", 1, 10);
        j.plan.per_rank_bytes.overhead = DeviceKind::Cuda.overhead_bytes();
        let plan = &j.plan;
        assert_eq!(
            plan.need_on(DeviceKind::Cpu),
            10 * GB + DeviceKind::Cpu.overhead_bytes()
        );
        assert_eq!(
            plan.need_on(DeviceKind::Cuda),
            10 * GB + DeviceKind::Cuda.overhead_bytes()
        );
    }
}
