//! The queue policy: which queued jobs a scheduling pass places, and where. A pure function
//! of the queue in scheduling order and the free devices of live nodes: priority, then
//! submission order; gang placement of all of a job's ranks on devices of its plan's kind
//! ([`crate::placement::place`]'s choices, with the safety margin); and backfill: while the
//! head of the queue waits for devices of a kind, jobs of that kind smaller than it that fit now
//! start (a job waiting for GPUs holds up no CPU job). Nodes a cluster manager started for one
//! job (a Slurm allocation's) take that job only, and that job waits for them. A pass places at most
//! [`RANKS_PER_PASS`] ranks; the server's loop runs the next one at once when a pass stopped
//! there, so filling an empty cluster is a few short passes rather than one long write.

use std::collections::{HashMap, HashSet};

use crate::ids::{JobId, NodeId};
use crate::inventory::DeviceSlot;
use crate::memory::DeviceKind;
use crate::plan::Plan;
use crate::pool::Pool;

/// Ranks held by each owner's scheduled and running jobs, by owner (token name).
pub type HeldRanks = HashMap<String, u32>;

/// A placement decided by a scheduling pass: the job (at its current attempt) and, per rank in
/// order, the node id and device index.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub job_id: JobId,
    pub slots: Vec<(NodeId, u32)>,
}

/// A queued job as the scheduler needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuedJob {
    pub id: JobId,
    pub owner: String,
    pub priority: i32,
    pub attempt: u32,
    pub world_size: u32,
    pub plan: Plan,
    pub created_at: i64,
    /// When it entered the queue (again).
    pub queued_at: i64,
}

/// A live node and its devices, by index.
#[derive(Debug, Clone, PartialEq)]
pub struct BoardNode {
    pub id: NodeId,
    pub name: String,
    pub devices: Vec<BoardDevice>,
    /// The job and attempt whose allocation started this node's agent: it serves that
    /// attempt only (a later attempt of the job gets an allocation of its own).
    pub reserved_for: Option<(JobId, u32)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BoardDevice {
    pub index: u32,
    pub spec: DeviceSlot,
    /// An unreleased assignment holds it.
    pub held: bool,
}

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
    let mut reserved: HashMap<(&JobId, u32), Vec<&BoardNode>> = HashMap::new();
    for n in nodes {
        if let Some((job, attempt)) = &n.reserved_for {
            reserved.entry((job, *attempt)).or_default().push(n);
        }
    }
    let mut free = Free::new(nodes.iter().filter(|n| n.reserved_for.is_none()));
    let mut decided = Decided::default();
    let mut ranks: u32 = 0;
    // Per kind, bytes the first job that had to wait needs in all; only smaller jobs may pass.
    let mut head_waits: HashMap<DeviceKind, u128> = HashMap::new();
    // Free devices only shrink during a pass, so a shape that did not fit never will.
    let mut failed: HashSet<(u32, u64, DeviceKind)> = HashSet::new();
    for job in queue {
        // All of its allocation's nodes or none; until they are all there it waits.
        if let Some(own) = reserved.get(&(&job.id, job.attempt)) {
            let slots =
                Free::new(own.iter().copied()).place(job.world_size as usize, margin, &job.plan);
            if let Some(slots) = slots {
                *held.entry(job.owner.clone()).or_default() += job.world_size;
                ranks += job.world_size;
                decided.decisions.push(Decision {
                    job_id: job.id.clone(),
                    slots,
                });
            }
            continue;
        }
        if free.pool.is_empty() {
            if reserved.is_empty() {
                break;
            }
            continue;
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
    slots: Vec<(&'a NodeId, Vec<u32>)>,
}

impl<'a> Free<'a> {
    fn new(nodes: impl IntoIterator<Item = &'a BoardNode>) -> Free<'a> {
        let mut order: Vec<&BoardNode> = nodes
            .into_iter()
            .filter(|n| n.devices.iter().any(|d| !d.held))
            .collect();
        order.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        let mut pool = Pool::default();
        let mut slots = Vec::with_capacity(order.len());
        for node in order {
            let free = || node.devices.iter().filter(|d| !d.held);
            pool.add_node(free().map(|d| d.spec));
            slots.push((&node.id, free().map(|d| d.index).collect()));
        }
        Free { pool, slots }
    }

    /// Places every rank or none, taking the devices used out of the pool.
    fn place(&mut self, ranks: usize, margin: f64, plan: &Plan) -> Option<Vec<(NodeId, u32)>> {
        let slots = self
            .pool
            .place(ranks, margin, plan.device, plan.need_on(plan.device))?;
        Some(
            slots
                .iter()
                .map(|s| {
                    let (node, devices) = &self.slots[s.node];
                    ((*node).clone(), devices[s.device])
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Breakdown;
    use crate::plan::Choices;
    use crate::spec::ZeroStage;

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
                    spec: DeviceSlot {
                        kind: DeviceKind::Cpu,
                        memory_bytes: gb * GB,
                    },
                    held: false,
                })
                .collect(),
            reserved_for: None,
        }
    }

    /// `node` started for attempt 1 of job `job` alone.
    fn reserved(id: &str, gbs: &[u64], job: &str) -> BoardNode {
        BoardNode {
            reserved_for: Some((job.into(), 1)),
            ..node(id, gbs)
        }
    }

    fn placed(decisions: &[Decision]) -> Vec<&str> {
        decisions.iter().map(|d| d.job_id.as_str()).collect()
    }

    fn slots(slots: &[(&str, u32)]) -> Vec<(NodeId, u32)> {
        slots.iter().map(|&(n, i)| (NodeId::from(n), i)).collect()
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
        assert_eq!(d[0].slots, slots(&[("a", 0), ("a", 1), ("b", 0), ("b", 1)]));
    }

    #[test]
    fn held_devices_are_not_offered() {
        let mut nodes = [node("a", &[16, 16]), node("b", &[16, 16])];
        nodes[0].devices[0].held = true;
        nodes[1].devices[1].held = true;
        let d = decide(&[job("two", 2, 10)], &nodes, 0.0);
        assert_eq!(d[0].slots, slots(&[("a", 1), ("b", 0)]));
    }

    #[test]
    fn nodes_are_tried_in_id_order_whatever_order_they_come_in() {
        let nodes = [node("b", &[16]), node("a", &[16])];
        let d = decide(&[job("one", 1, 10)], &nodes, 0.0);
        assert_eq!(d[0].slots, slots(&[("a", 0)]));
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
    fn an_allocations_nodes_take_its_job_only_and_all_at_once() {
        let queue = [job("first", 2, 10), job("slurm", 2, 10)];
        // Only "slurm"'s node is free: "first" may not take it.
        let one = [reserved("s1", &[16], "slurm")];
        assert!(decide(&queue, &one, 0.0).is_empty(), "half its gang");
        let both = [one[0].clone(), reserved("s2", &[16], "slurm")];
        let d = decide(&queue, &both, 0.0);
        assert_eq!(placed(&d), ["slurm"]);
        assert_eq!(d[0].slots, slots(&[("s1", 0), ("s2", 0)]));
        // With an open node as well, "slurm" still waits for its own.
        let open = [node("n", &[16, 16, 16, 16]), one[0].clone()];
        let d = decide(&queue, &open, 0.0);
        assert_eq!(placed(&d), ["first"]);
        // Its next attempt waits for an allocation of its own.
        let mut again = queue[1].clone();
        again.attempt = 2;
        assert!(decide(&[again], &both, 0.0).is_empty());
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
        assert_eq!(d[0].slots, slots(&[("gpu", 0)]));
        assert!(
            d[1].slots.iter().all(|(node, _)| node.as_str() == "cpu"),
            "{d:?}"
        );
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
