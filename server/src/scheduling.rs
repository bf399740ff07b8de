//! The scheduling loop: every scheduling interval (or sooner, when a job arrives or devices free
//! up), declare silent nodes lost, then place queued jobs on free devices. `decide` is the
//! policy, a pure function: priority, then submission order; gang placement of all of a job's
//! ranks on devices of its plan's kind (`scheduler::placement::place`, with the safety margin);
//! and backfill: while the head of the queue waits for devices of a kind, jobs of that kind
//! smaller than it that fit now start (a job waiting for GPUs holds up no CPU job).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use scheduler::inventory::{Device, Inventory, Node};
use scheduler::memory::DeviceKind;
use scheduler::placement::place;
use scheduler::plan::Plan;

use crate::app::{AppState, now_ms};
use crate::domain::{Job, JobState};
use crate::retention;
use crate::store::{Decision, FreeDevice, HeldRanks, StoreError};

/// How much of the cluster one owner may hold: `held` ranks now, at most `limit` at once.
#[derive(Debug, Clone, Copy)]
pub struct OwnerQuota<'a> {
    pub held: &'a HeldRanks,
    pub limit: u32,
}

/// Placements for as many of `jobs` as fit on `free`, keeping `margin` of every device free. A
/// job that would take its owner past `quota` waits, without holding up other owners' jobs.
pub fn decide(
    jobs: &[Job],
    free: &[FreeDevice],
    margin: f64,
    quota: OwnerQuota<'_>,
) -> Vec<Decision> {
    let mut held: HeldRanks = quota.held.clone();
    let mut order: Vec<&Job> = jobs.iter().collect();
    order.sort_by(|a, b| {
        (b.priority.cmp(&a.priority))
            .then(a.created_at.cmp(&b.created_at))
            .then(a.id.cmp(&b.id))
    });
    let mut pool = Pool::new(free);
    let mut decisions = Vec::new();
    // Per kind, bytes the first job that had to wait needs in all; only smaller jobs may pass.
    let mut head_waits: HashMap<DeviceKind, u128> = HashMap::new();
    // Free devices only shrink during a pass, so a shape that did not fit never will.
    let mut failed: HashSet<(u32, u64, DeviceKind)> = HashSet::new();
    for job in order {
        if pool.is_empty() {
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
        match pool.place(job.world_size as usize, margin, plan) {
            Some(slots) => {
                held.insert(job.owner.clone(), owner_ranks + job.world_size);
                decisions.push(Decision {
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
    decisions
}

/// The free devices left in a pass, as an inventory (node names are node ids) with the device
/// index each inventory slot stands for.
struct Pool {
    inventory: Inventory,
    indices: Vec<Vec<u32>>,
}

impl Pool {
    fn new(free: &[FreeDevice]) -> Pool {
        let mut sorted: Vec<&FreeDevice> = free.iter().collect();
        sorted.sort_by(|a, b| (&a.node_id, a.device).cmp(&(&b.node_id, b.device)));
        let mut inventory = Inventory::default();
        let mut indices: Vec<Vec<u32>> = Vec::new();
        for d in sorted {
            if inventory.nodes.last().is_none_or(|n| n.name != d.node_id) {
                inventory.nodes.push(Node {
                    name: d.node_id.clone(),
                    devices: Vec::new(),
                });
                indices.push(Vec::new());
            }
            let device: Device = d.spec;
            inventory
                .nodes
                .last_mut()
                .expect("pushed")
                .devices
                .push(device);
            indices.last_mut().expect("pushed").push(d.device);
        }
        Pool { inventory, indices }
    }

    fn is_empty(&self) -> bool {
        self.indices.iter().all(Vec::is_empty)
    }

    /// Places every rank or none, taking the devices used out of the pool.
    fn place(&mut self, ranks: usize, margin: f64, plan: &Plan) -> Option<Vec<(String, u32)>> {
        let need = plan.need_on(plan.device);
        let slots = place(&self.inventory, ranks, margin, plan.device, need)?;
        let chosen: Vec<(String, u32)> = slots
            .iter()
            .map(|s| {
                (
                    self.inventory.nodes[s.node].name.clone(),
                    self.indices[s.node][s.device],
                )
            })
            .collect();
        let mut taken: Vec<(usize, usize)> = slots.iter().map(|s| (s.node, s.device)).collect();
        taken.sort_unstable_by(|a, b| b.cmp(a));
        for (node, device) in taken {
            self.inventory.nodes[node].devices.remove(device);
            self.indices[node].remove(device);
        }
        Some(chosen)
    }
}

/// While no device is free, placing passes run only when something may have freed one (a job
/// ended, a node registered: both wake the loop) and at least this often, in case another
/// replica saw that event alone.
const PLACE_AT_LEAST_EVERY: Duration = Duration::from_secs(30);

/// Runs scheduling passes until the server shuts down.
pub async fn run(state: AppState) {
    let mut stop = state.shutdown.subscribe();
    let mut last_placing = Instant::now();
    let mut last_retention: Option<Instant> = None;
    loop {
        let woken = tokio::select! {
            () = tokio::time::sleep(state.settings.scheduling_interval) => false,
            () = state.wake_scheduler.notified() => true,
            _ = stop.wait_for(|stopped| *stopped) => return,
        };
        let place = woken
            || state.devices_free.load(Ordering::Relaxed)
            || last_placing.elapsed() >= PLACE_AT_LEAST_EVERY;
        let done = if place {
            last_placing = Instant::now();
            pass(&state).await.map(drop)
        } else {
            // Placing would find nothing free, and would hold the store's scheduling lock
            // over the whole queue for nothing.
            match reap(&state).await {
                Ok(()) => housekeeping(&state).await,
                Err(e) => Err(e),
            }
        };
        if let Err(e) = done {
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
}

/// One pass: requeue the jobs of lost nodes, place what fits, refresh the job gauges and drop
/// the series of jobs that ended a while ago. Returns the placements made.
pub async fn pass(state: &AppState) -> Result<Vec<Decision>, StoreError> {
    let start = Instant::now();
    reap(state).await?;
    let margin = state.settings.safety_margin;
    let limit = state.settings.limits.running_ranks_per_owner;
    let mut queued_since = Vec::new();
    let mut left_free = true;
    let decisions = state
        .store
        .schedule(|jobs, free, held| {
            let decisions = decide(jobs, free, margin, OwnerQuota { held, limit });
            queued_since = jobs.iter().map(|j| (j.id.clone(), j.updated_at)).collect();
            let taken: usize = decisions.iter().map(|d| d.slots.len()).sum();
            left_free = free.len() > taken;
            decisions
        })
        .await?;
    state.devices_free.store(left_free, Ordering::Relaxed);
    let now = now_ms();
    for d in &decisions {
        if let Some((_, since)) = queued_since.iter().find(|(id, _)| *id == d.job_id) {
            let waited = (now - since).max(0) as f64 / 1000.0;
            state.metrics.server.queue_wait_seconds.observe(waited);
        }
        if let Some(job) = state.store.get_job(&d.job_id).await? {
            state.announce(&job);
        }
    }
    let mut nodes: Vec<&str> = decisions
        .iter()
        .flat_map(|d| d.slots.iter().map(|(node, _)| node.as_str()))
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
    Ok(decisions)
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
    use scheduler::memory::Breakdown;
    use scheduler::plan::Choices;
    use scheduler::spec::{JobSpec, Purpose, ZeroStage};

    use super::*;

    /// `decide` with no owner holding anything and no owner limit.
    fn decide(jobs: &[Job], free: &[FreeDevice], margin: f64) -> Vec<Decision> {
        let held = HeldRanks::new();
        let quota = OwnerQuota {
            held: &held,
            limit: u32::MAX,
        };
        super::decide(jobs, free, margin, quota)
    }

    const GB: u64 = 1_000_000_000;

    fn job(id: &str, priority: i32, created_at: i64, world_size: u32, gb_per_rank: u64) -> Job {
        Job {
            id: id.into(),
            name: None,
            state: JobState::Queued,
            priority,
            attempt: 1,
            world_size,
            spec: JobSpec::parse(r#"{"model": {"preset": "gpt2-tiny"}}"#, Purpose::Train)
                .unwrap()
                .spec,
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
            unsupported_keys: vec![],
            owner: "t".into(),
            reason: String::new(),
            master: None,
            created_at,
            updated_at: created_at,
        }
    }

    fn devices(node: &str, gbs: &[u64]) -> Vec<FreeDevice> {
        gbs.iter()
            .enumerate()
            .map(|(i, &gb)| FreeDevice {
                node_id: node.into(),
                device: i as u32,
                spec: Device {
                    kind: DeviceKind::Cpu,
                    memory_bytes: gb * GB,
                },
            })
            .collect()
    }

    fn placed(decisions: &[Decision]) -> Vec<&str> {
        decisions.iter().map(|d| d.job_id.as_str()).collect()
    }

    #[test]
    fn higher_priority_runs_first_then_submission_order() {
        let jobs = [
            job("old", 0, 1, 1, 10),
            job("urgent", 5, 3, 1, 10),
            job("new", 0, 2, 1, 10),
        ];
        let free = devices("n", &[16, 16]);
        assert_eq!(placed(&decide(&jobs, &free, 0.0)), ["urgent", "old"]);
    }

    #[test]
    fn all_ranks_of_a_job_are_placed_or_none() {
        let jobs = [job("four", 0, 1, 4, 10)];
        let free = devices("n", &[16, 16, 16]);
        assert!(decide(&jobs, &free, 0.0).is_empty());
        let free = [devices("a", &[16, 16]), devices("b", &[16, 16])].concat();
        let d = decide(&jobs, &free, 0.0);
        assert_eq!(
            d[0].slots,
            [("a", 0), ("a", 1), ("b", 0), ("b", 1)].map(|(n, i)| (n.to_string(), i))
        );
    }

    #[test]
    fn smaller_jobs_backfill_while_the_head_waits() {
        let jobs = [
            job("head", 0, 1, 4, 10),
            job("small", 0, 2, 1, 10),
            job("same-size", 0, 3, 4, 10),
        ];
        let free = devices("n", &[16, 16, 16]);
        assert_eq!(placed(&decide(&jobs, &free, 0.0)), ["small"]);
    }

    #[test]
    fn a_job_as_large_as_the_waiting_head_does_not_pass_it() {
        let jobs = [job("head", 0, 1, 2, 20), job("wide", 0, 2, 4, 10)];
        let free = devices("n", &[16, 16, 16, 16]);
        assert!(decide(&jobs, &free, 0.0).is_empty());
    }

    #[test]
    fn devices_taken_by_one_job_are_not_given_to_another() {
        let jobs = [job("a", 0, 1, 2, 10), job("b", 0, 2, 2, 10)];
        let free = devices("n", &[16, 16, 16]);
        let d = decide(&jobs, &free, 0.0);
        assert_eq!(placed(&d), ["a"]);
        assert_eq!(d[0].slots.len(), 2);
    }

    #[test]
    fn the_safety_margin_keeps_part_of_each_device_free() {
        let jobs = [job("j", 0, 1, 1, 15)];
        let free = devices("n", &[16]);
        assert_eq!(decide(&jobs, &free, 0.0).len(), 1);
        assert!(decide(&jobs, &free, 0.1).is_empty(), "15 GB > 90% of 16 GB");
    }

    #[test]
    fn a_cuda_device_pays_its_runtime_overhead() {
        let mut jobs = [job("j", 0, 1, 1, 15)];
        jobs[0].plan.device = DeviceKind::Cuda;
        let mut free = devices("gpu", &[16]);
        free[0].spec.kind = DeviceKind::Cuda;
        free[0].spec.memory_bytes = 15 * GB + DeviceKind::Cuda.overhead_bytes() - 1;
        assert!(decide(&jobs, &free, 0.0).is_empty());
        free[0].spec.memory_bytes += 1;
        assert_eq!(decide(&jobs, &free, 0.0).len(), 1);
    }

    #[test]
    fn jobs_land_on_their_kind_and_a_job_waiting_for_gpus_holds_up_no_cpu_job() {
        let mut gpu_head = job("gpu-head", 0, 1, 4, 10);
        gpu_head.plan.device = DeviceKind::Cuda;
        let mut gpu_small = job("gpu-small", 0, 2, 1, 10);
        gpu_small.plan.device = DeviceKind::Cuda;
        // Larger than the waiting GPU head, but it waits for other devices.
        let cpu_wide = job("cpu-wide", 0, 3, 3, 15);
        let mut free = devices("cpu", &[16, 16, 16]);
        let mut gpus = devices("gpu", &[80, 80]);
        for d in &mut gpus {
            d.spec.kind = DeviceKind::Cuda;
        }
        free.extend(gpus);
        let d = decide(&[gpu_head, gpu_small, cpu_wide], &free, 0.0);
        assert_eq!(placed(&d), ["gpu-small", "cpu-wide"]);
        assert_eq!(d[0].slots, [("gpu".to_string(), 0)]);
        assert!(d[1].slots.iter().all(|(node, _)| node == "cpu"), "{d:?}");
    }

    #[test]
    fn an_owner_past_its_running_ranks_waits_while_others_run() {
        let mut jobs = [
            job("alice-1", 0, 1, 2, 1),
            job("alice-2", 0, 2, 2, 1),
            job("bob", 0, 3, 2, 1),
        ];
        jobs[0].owner = "alice".into();
        jobs[1].owner = "alice".into();
        let free = devices("n", &[16; 8]);
        let mut held = HeldRanks::new();
        held.insert("alice".into(), 1);
        let quota = OwnerQuota {
            held: &held,
            limit: 4,
        };
        // alice holds 1: her first job takes her to 3, the second would pass 4 and waits.
        let d = super::decide(&jobs, &free, 0.0, quota);
        assert_eq!(placed(&d), ["alice-1", "bob"]);
        let none_held = HeldRanks::new();
        let quota = OwnerQuota {
            held: &none_held,
            limit: 4,
        };
        assert_eq!(
            placed(&super::decide(&jobs, &free, 0.0, quota)),
            ["alice-1", "alice-2", "bob"]
        );
    }

    #[test]
    fn the_need_replaces_the_planned_device_overhead() {
        let mut j = job("j", 0, 1, 1, 10);
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
