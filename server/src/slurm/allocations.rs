//! The Slurm half of a scheduling pass, run by the replica holding the scheduler lease: Slurm's
//! word on each live allocation becomes its job's (pending and why, running, ended: the job goes
//! back to the queue as from a lost node), an allocation no job needs any more is cancelled,
//! and a queued job that no registered node took, that fits a partition, gets an allocation.
//! Everything is read again from the store and `squeue` each pass, so a restarted server
//! picks up where the last one stopped.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use scheduler::inventory::Inventory;
use scheduler::placement;
use scheduler::queue::QueuedJob;

use super::batch::{self, Queued, Request};
use super::{Script, Slurm, SlurmError, output_dir};
use crate::auth::new_token;
use crate::domain::{JobId, JobState, SlurmAllocation};
use crate::state::AppState;
use crate::store::{StoreError, token_hash};

/// How long a job whose `sbatch` failed waits before the next try.
const RETRY_AFTER: Duration = Duration::from_secs(60);
/// Queued jobs a pass looks at for an allocation, in scheduling order (the rest wait for the
/// next pass: each costs a placement over the partitions' nodes).
pub const CONSIDERED_PER_PASS: usize = 256;
/// Lines of an allocation's output file copied into its job's log.
const OUTPUT_LINES: usize = 200;

/// Attempts of jobs whose last allocation Slurm refused or ended before the job ran on it,
/// and when: they wait [`RETRY_AFTER`] before the next (a node that cannot run the agent must
/// not cost an allocation a pass).
#[derive(Default)]
pub struct Progress {
    refused: HashMap<(JobId, u32), Instant>,
}

impl Progress {
    fn refuse(&mut self, key: (JobId, u32)) {
        self.refused.retain(|_, t| t.elapsed() < RETRY_AFTER);
        self.refused.insert(key, Instant::now());
    }

    fn refused_lately(&self, key: &(JobId, u32)) -> bool {
        self.refused
            .get(key)
            .is_some_and(|t| t.elapsed() < RETRY_AFTER)
    }
}

/// One pass over the allocations, then allocations for `waiting` (queued jobs this pass did
/// not place, in scheduling order, at most [`CONSIDERED_PER_PASS`]). Slurm failing is logged
/// and tried again next pass.
pub async fn pass(
    state: &AppState,
    slurm: &Slurm,
    waiting: Vec<QueuedJob>,
) -> Result<(), StoreError> {
    let progress = &slurm.progress;
    let live = state.store.live_allocations().await?;
    let mut covered: HashSet<(JobId, u32)> = HashSet::new();
    if !live.is_empty() {
        let queue = match squeue(slurm).await {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!("{e}");
                return Ok(());
            }
        };
        for a in live {
            if follow(state, slurm, &a, queue.get(&a.slurm_job_id)).await? {
                covered.insert((a.job_id.clone(), a.attempt));
            }
        }
    }
    let pools = if waiting.is_empty() {
        Vec::new()
    } else {
        pools(slurm)
    };
    for job in waiting {
        let key = (job.id.clone(), job.attempt);
        let refused = progress.lock().expect("not poisoned").refused_lately(&key);
        if covered.contains(&key) || refused {
            continue;
        }
        let Some(request) = request_for(state, slurm, &pools, &job) else {
            continue;
        };
        if !submit(state, slurm, &request).await? {
            progress.lock().expect("not poisoned").refuse(key);
        }
    }
    Ok(())
}

/// Every job of this server's user Slurm lists, finished ones for as long as it keeps them.
async fn squeue(slurm: &Slurm) -> Result<HashMap<u64, Queued>, SlurmError> {
    let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
    let user = format!("--user={uid}");
    let args = ["-h", "--states=all", &user, "-o", batch::QUEUE_FORMAT];
    Ok(batch::parse_queue(&slurm.run("squeue", &args, None).await?))
}

/// Brings allocation `a` in line with its job and with what Slurm says of it (`queued`);
/// whether it is still live.
async fn follow(
    state: &AppState,
    slurm: &Slurm,
    a: &SlurmAllocation,
    queued: Option<&Queued>,
) -> Result<bool, StoreError> {
    let id = a.slurm_job_id;
    let job = state.store.get_job(&a.job_id).await?;
    let current = job
        .as_ref()
        .filter(|j| j.attempt == a.attempt && !j.state.is_terminal());
    let wanted = match current {
        None => false,
        Some(j) if j.state == JobState::Queued => true,
        Some(j) => state.store.runs_on_allocation(id, &j.id, j.attempt).await?,
    };
    let running = queued.is_some_and(|q| !q.ended());
    if !wanted {
        if running && let Err(e) = slurm.run("scancel", &[&id.to_string()], None).await {
            tracing::warn!("{e}");
            return Ok(true);
        }
        let why = match &job {
            Some(j) if j.attempt == a.attempt => format!("the job {}", j.state.as_str()),
            _ => format!("attempt {} of the job is over", a.attempt),
        };
        end(state, a, &format!("Slurm job {id} released: {why}")).await?;
        return Ok(false);
    }
    let Some(q) = queued.filter(|_| running) else {
        let mut what = queued.map_or("Slurm no longer lists it".to_string(), |q| {
            format!("{} ({})", q.state, q.reason)
        });
        // Ended before the job ran on it: the next allocation waits a while.
        if current.is_some_and(|j| j.state == JobState::Queued) {
            slurm
                .progress
                .lock()
                .expect("not poisoned")
                .refuse((a.job_id.clone(), a.attempt));
            what += &format!(" before the job ran on it; asking again in {RETRY_AFTER:?}");
        }
        end(state, a, &format!("Slurm job {id} ended: {what}")).await?;
        return Ok(false);
    };
    if (q.state.as_str(), q.reason.as_str()) != (a.state.as_str(), a.reason.as_str()) {
        state.store.allocation_seen(id, &q.state, &q.reason).await?;
        let mut line = format!("Slurm job {id}: {} ({})", q.state, q.reason);
        if !q.nodes.is_empty() {
            line += &format!(" on {}", q.nodes);
        }
        state.append_logs(&a.job_id, vec![line]).await?;
        let reason = format!("waiting for Slurm job {id}: {} ({})", q.state, q.reason);
        if let Some(job) = state
            .store
            .set_waiting_reason(&a.job_id, a.attempt, &reason)
            .await?
        {
            state.announce(&job);
        }
    }
    Ok(true)
}

/// Ends allocation `a` for `why`: a job running there goes back to the queue, and its log
/// gets the reason and the tail of Slurm's output file.
async fn end(state: &AppState, a: &SlurmAllocation, why: &str) -> Result<(), StoreError> {
    let requeued = state.store.end_allocation(a.slurm_job_id, why).await?;
    tracing::info!(job = %a.job_id, slurm_job = a.slurm_job_id, "{why}");
    let mut lines = vec![why.to_string()];
    let output = output_dir(&state.settings.data_dir).join(format!("slurm-{}.out", a.slurm_job_id));
    if let Ok(text) = std::fs::read_to_string(&output) {
        let all: Vec<&str> = text.lines().collect();
        let tail = &all[all.len().saturating_sub(OUTPUT_LINES)..];
        lines.push(format!("{} ({} lines):", output.display(), all.len()));
        lines.extend(tail.iter().map(|l| format!("| {l}")));
    }
    state.append_logs(&a.job_id, lines).await?;
    for id in requeued {
        if let Some(job) = state.store.get_job(&id).await? {
            state.announce(&job);
        }
    }
    state.wake_agents(None);
    Ok(())
}

/// A partition's nodes as a pass sees them: those Slurm would start a job on, then all.
type Pools = Vec<(String, [Inventory; 2])>;

fn pools(slurm: &Slurm) -> Pools {
    let inventory = |p: &str, usable| Inventory {
        nodes: slurm.inventory(Some(p), usable),
    };
    let partitions = &slurm.settings.partitions;
    partitions
        .iter()
        .map(|p| (p.clone(), [inventory(p, true), inventory(p, false)]))
        .collect()
}

/// The allocation `job` would take in the first partition of `pools` whose nodes hold it:
/// free nodes first, else any (Slurm then says what it waits for).
fn request_for(state: &AppState, slurm: &Slurm, pools: &Pools, job: &QueuedJob) -> Option<Request> {
    let kind = job.plan.device;
    let need = job.plan.need_on(kind);
    let margin = state.settings.safety_margin;
    pools.iter().find_map(|(partition, inventories)| {
        let (inventory, slots) = inventories.iter().find_map(|inventory| {
            let slots = placement::place(inventory, job.world_size as usize, margin, kind, need)?;
            Some((inventory, slots))
        })?;
        let mut per_node: HashMap<usize, usize> = HashMap::new();
        for s in &slots {
            *per_node.entry(s.node).or_default() += 1;
        }
        let cpu_device_memory = slots
            .iter()
            .map(|s| inventory.nodes[s.node].devices[s.device].memory_bytes)
            .min()?;
        Some(Request {
            job_id: job.id.clone(),
            attempt: job.attempt,
            partition: partition.clone(),
            nodes: per_node.len(),
            ranks_per_node: per_node.values().copied().max()?,
            kind,
            cpu_device_memory,
            time_limit: state.settings.limits.max_wall_time,
            binary: slurm.agent_binary(),
            output: output_dir(&state.settings.data_dir)
                .join("slurm-%j.out")
                .display()
                .to_string(),
        })
    })
}

/// Submits `r` held, records it, then lets Slurm start it (so its agents never join before
/// the server knows their token); false when Slurm refused it.
async fn submit(state: &AppState, slurm: &Slurm, r: &Request) -> Result<bool, StoreError> {
    let dir = output_dir(&state.settings.data_dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!("creating {}: {e}", dir.display());
        return Ok(false);
    }
    let token = new_token();
    let roots: Vec<String> = state
        .data_roots
        .dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    let env = [
        (
            "ZEROTRAIN_URL",
            slurm.server_url.get().cloned().unwrap_or_default(),
        ),
        ("ZEROTRAIN_AGENT_TOKEN", token.clone()),
        (
            "ZEROTRAIN_DATA_DIR",
            state.settings.data_dir.display().to_string(),
        ),
        ("ZEROTRAIN_DATA_ROOTS", roots.join(":")),
    ];
    let args = r.sbatch_args();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let script = r.script();
    let batch = Script {
        text: &script,
        env: &env,
    };
    let submitted = slurm.run("sbatch", &words, Some(&batch)).await;
    let id = submitted.and_then(|out| {
        let first = out.trim().split(';').next().unwrap_or("");
        first.parse::<u64>().map_err(|_| SlurmError {
            command: "sbatch".into(),
            reason: format!("printed {out:?}, not a job id"),
        })
    });
    let id = match id {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(job = %r.job_id, "{e}");
            let line = format!(
                "asking Slurm for an allocation failed (trying again in {RETRY_AFTER:?}): {e}"
            );
            state.append_logs(&r.job_id, vec![line]).await?;
            return Ok(false);
        }
    };
    let allocation = SlurmAllocation {
        slurm_job_id: id,
        job_id: r.job_id.clone(),
        attempt: r.attempt,
        partition: r.partition.clone(),
        nodes: r.nodes as u32,
        state: "SUBMITTED".into(),
        reason: "None".into(),
        submitted_at: state.now_ms(),
    };
    state
        .store
        .insert_allocation(&allocation, &token_hash(&token))
        .await?;
    let mut lines = vec![format!(
        "submitted Slurm job {id}: sbatch {}",
        args.join(" ")
    )];
    lines.extend(script.lines().map(|l| format!("| {l}")));
    state.append_logs(&r.job_id, lines).await?;
    if let Err(e) = slurm
        .run("scontrol", &["release", &id.to_string()], None)
        .await
    {
        tracing::warn!("{e}");
        let _ = slurm.run("scancel", &[&id.to_string()], None).await;
        end(
            state,
            &allocation,
            &format!("Slurm job {id} not released: {e}"),
        )
        .await?;
        return Ok(false);
    }
    let reason = format!("waiting for Slurm job {id}: SUBMITTED");
    if let Some(job) = state
        .store
        .set_waiting_reason(&r.job_id, r.attempt, &reason)
        .await?
    {
        state.announce(&job);
    }
    tracing::info!(job = %r.job_id, slurm_job = id, nodes = r.nodes, "asked Slurm for an allocation");
    Ok(true)
}
