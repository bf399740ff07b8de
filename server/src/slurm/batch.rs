//! What the server asks of Slurm, as the words it runs: one allocation per attempt of a job
//! (`sbatch`, held until the server has recorded it), and what `squeue` says of them.

use std::collections::HashMap;
use std::time::Duration;

use scheduler::memory::DeviceKind;

use crate::domain::JobId;

/// One allocation for one attempt of a job: `nodes` nodes running `ranks_per_node` ranks each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub job_id: JobId,
    pub attempt: u32,
    pub partition: String,
    pub nodes: usize,
    pub ranks_per_node: usize,
    pub kind: DeviceKind,
    /// Per CPU device (a rank's memory budget); GPU nodes ask for no memory of their own.
    pub cpu_device_memory: u64,
    pub time_limit: Duration,
    /// The `zerotrain` binary on the nodes.
    pub binary: String,
    /// Where Slurm writes the batch script's output (`%j` is the Slurm job id).
    pub output: String,
}

impl Request {
    /// `sbatch`'s arguments: held (`scontrol release` starts it), sized by the plan, the job
    /// named in `--job-name` and `--comment`.
    pub fn sbatch_args(&self) -> Vec<String> {
        let mut args = vec![
            "--parsable".into(),
            "--hold".into(),
            format!("--partition={}", self.partition),
            format!("--nodes={}", self.nodes),
            format!("--ntasks-per-node={}", self.ranks_per_node),
            format!("--time={}", self.time_limit.as_secs().div_ceil(60).max(1)),
            format!("--job-name=zerotrain-{}", self.job_id),
            format!(
                "--comment=zerotrain job {} attempt {}",
                self.job_id, self.attempt
            ),
            format!("--output={}", self.output),
            // A lost allocation is the server's to replace, with the job's next attempt.
            "--no-requeue".into(),
        ];
        match self.kind {
            DeviceKind::Cuda => args.push(format!("--gres=gpu:{}", self.ranks_per_node)),
            DeviceKind::Cpu => {
                let mib = (self.cpu_device_memory >> 20) * self.ranks_per_node as u64;
                args.push(format!("--mem={mib}M"));
            }
        }
        args
    }

    /// The batch script: one agent per node, serving this job only; one failing ends them all.
    pub fn script(&self) -> String {
        let offer = match self.kind {
            DeviceKind::Cuda => "--gpus all".to_string(),
            DeviceKind::Cpu => format!(
                "--gpus none --cpu-devices {} --device-memory {}",
                self.ranks_per_node, self.cpu_device_memory
            ),
        };
        format!(
            "#!/bin/sh\n\
             # zerotrain job {} attempt {}: an agent on each node serves it, then leaves.\n\
             exec srun --nodes={} --ntasks-per-node=1 --kill-on-bad-exit=1 {} agent --slurm {offer}\n",
            self.job_id,
            self.attempt,
            self.nodes,
            shell_word(&self.binary),
        )
    }
}

/// `s` as one word of a POSIX shell command.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:@%".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// What `squeue` says of one Slurm job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queued {
    /// `PENDING`, `RUNNING`, `COMPLETING`, `COMPLETED`, `CANCELLED`, `TIMEOUT`, `NODE_FAIL`, …
    pub state: String,
    /// Why it is in that state (`Resources`, `Priority`, `None`, …).
    pub reason: String,
    /// The nodes it runs on, Slurm's host list (`n[1-2]`); empty while pending.
    pub nodes: String,
}

impl Queued {
    /// Whether the allocation is over (or never will start), by Slurm's job state codes.
    pub fn ended(&self) -> bool {
        !matches!(
            self.state.as_str(),
            "PENDING"
                | "CONFIGURING"
                | "RUNNING"
                | "COMPLETING"
                | "RESIZING"
                | "SUSPENDED"
                | "REQUEUED"
                | "REQUEUE_HOLD"
                | "REQUEUE_FED"
                | "SIGNALING"
                | "STAGE_OUT"
                | "STOPPED"
                | "RESV_DEL_HOLD"
        )
    }
}

/// `squeue`'s format for [`parse_queue`]: id, state, reason, nodes.
pub const QUEUE_FORMAT: &str = "%i|%T|%r|%N";

/// The jobs of `squeue -h -o QUEUE_FORMAT`'s output, by id (array and het-job members, whose
/// ids are not plain numbers, are not the server's and are skipped).
pub fn parse_queue(text: &str) -> HashMap<u64, Queued> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.trim().splitn(4, '|');
            let id = f.next()?.parse().ok()?;
            let state = f.next()?.to_string();
            let reason = f.next()?.to_string();
            let nodes = f.next().unwrap_or("").to_string();
            Some((
                id,
                Queued {
                    state,
                    reason,
                    nodes,
                },
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(kind: DeviceKind) -> Request {
        Request {
            job_id: "0190a1b2-0000-7000-8000-000000000001".into(),
            attempt: 2,
            partition: "gpu".into(),
            nodes: 2,
            ranks_per_node: 4,
            kind,
            cpu_device_memory: 2 << 30,
            time_limit: Duration::from_secs(72 * 3600),
            binary: "/opt/zerotrain bin/zerotrain".into(),
            output: "/var/lib/zerotrain/slurm/slurm-%j.out".into(),
        }
    }

    #[test]
    fn an_allocation_is_sized_by_the_plan_and_names_its_job() {
        let args = request(DeviceKind::Cuda).sbatch_args();
        for a in [
            "--partition=gpu",
            "--nodes=2",
            "--ntasks-per-node=4",
            "--gres=gpu:4",
            "--time=4320",
            "--job-name=zerotrain-0190a1b2-0000-7000-8000-000000000001",
            "--comment=zerotrain job 0190a1b2-0000-7000-8000-000000000001 attempt 2",
            "--hold",
        ] {
            assert!(args.iter().any(|x| x == a), "{a} not in {args:?}");
        }
        assert!(!args.iter().any(|a| a.starts_with("--mem")), "{args:?}");
        let cpu = request(DeviceKind::Cpu).sbatch_args();
        assert!(cpu.iter().any(|a| a == "--mem=8192M"), "{cpu:?}");
        assert!(!cpu.iter().any(|a| a.starts_with("--gres")), "{cpu:?}");
    }

    #[test]
    fn the_script_starts_one_agent_per_node_for_this_job() {
        let script = request(DeviceKind::Cpu).script();
        assert!(script.starts_with("#!/bin/sh\n"), "{script}");
        assert!(
            script.contains(
                "exec srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 \
                 '/opt/zerotrain bin/zerotrain' agent --slurm --gpus none --cpu-devices 4 \
                 --device-memory 2147483648\n"
            ),
            "{script}"
        );
        assert!(
            request(DeviceKind::Cuda)
                .script()
                .contains("agent --slurm --gpus all\n")
        );
        assert_eq!(shell_word("it's"), r"'it'\''s'");
    }

    #[test]
    fn squeue_lines_are_read_by_id() {
        let text = "12|PENDING|Resources|\n13|RUNNING|None|n[1-2]\n14_3|RUNNING|None|n1\n\
                    15|NODE_FAIL|NodeDown|n2\n";
        let q = parse_queue(text);
        assert_eq!(q.len(), 3);
        assert_eq!(q[&12].reason, "Resources");
        assert!(!q[&12].ended() && !q[&13].ended());
        assert_eq!(q[&13].nodes, "n[1-2]");
        assert!(q[&15].ended());
    }
}
