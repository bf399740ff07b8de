//! Slurm as the engine that hands zerotrain its nodes (issue 40). Each `--slurm-partition` is a
//! pool: its nodes' shape (`nodes`, read with `scontrol`) joins admission's inventory, and a
//! queued job that no registered node takes gets an allocation of its own there (`batch`,
//! `allocations`), whose agents serve that job alone and leave with it. Slurm's state is the
//! job's: pending and why, ended, cancelled.

pub mod allocations;
pub mod batch;
pub mod gpus;
pub mod nodes;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use scheduler::inventory::{DeviceSlot, Node};
use scheduler::memory::DeviceKind;

use crate::settings::SlurmSettings;
pub use nodes::{Gres, SlurmNode, parse_nodes};

/// How often the partitions' nodes are read again.
const REFRESH_EVERY: Duration = Duration::from_secs(60);
/// How long one Slurm command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
#[error("{command}: {reason}")]
pub struct SlurmError {
    command: String,
    reason: String,
}

/// The partitions zerotrain runs jobs on, and what it last read of their nodes.
pub struct Slurm {
    pub settings: SlurmSettings,
    /// The partitions' nodes, as `scontrol` showed them last.
    nodes: RwLock<Vec<SlurmNode>>,
    /// The URL agents reach the server at, known once it listens.
    pub server_url: OnceLock<String>,
    read_at: Mutex<Option<Instant>>,
    progress: Mutex<allocations::Progress>,
}

impl Slurm {
    /// The pool of `settings`' partitions; `None` when it names none.
    pub fn new(settings: &SlurmSettings) -> Option<Slurm> {
        (!settings.partitions.is_empty()).then(|| Slurm {
            settings: settings.clone(),
            nodes: RwLock::default(),
            server_url: OnceLock::new(),
            read_at: Mutex::default(),
            progress: Mutex::default(),
        })
    }

    /// Reads the partitions' nodes again if the last read is [`REFRESH_EVERY`] old (or failed).
    pub async fn refresh_if_due(&self) {
        let due = self
            .read_at
            .lock()
            .expect("not poisoned")
            .is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
        if due {
            match self.refresh().await {
                Ok(()) => *self.read_at.lock().expect("not poisoned") = Some(Instant::now()),
                Err(e) => tracing::warn!("reading the Slurm partitions: {e}"),
            }
        }
    }

    /// Reads the partitions' nodes again.
    pub async fn refresh(&self) -> Result<(), SlurmError> {
        let text = self.run("scontrol", &["show", "node", "-o"], None).await?;
        let all = parse_nodes(&text).map_err(|reason| SlurmError {
            command: "scontrol show node -o".into(),
            reason,
        })?;
        let mine: Vec<SlurmNode> = all
            .into_iter()
            .filter(|n| self.settings.partitions.iter().any(|p| n.in_partition(p)))
            .collect();
        *self.nodes.write().expect("not poisoned") = mine;
        Ok(())
    }

    /// The devices of `partition`'s nodes (every partition's when `None`), as admission and
    /// allocations see them; `usable`: only nodes Slurm would start a job on.
    pub fn inventory(&self, partition: Option<&str>, usable: bool) -> Vec<Node> {
        let nodes = self.nodes.read().expect("not poisoned");
        nodes
            .iter()
            .filter(|n| partition.is_none_or(|p| n.in_partition(p)))
            .filter(|n| !usable || n.usable())
            .map(|n| Node {
                name: n.name.clone(),
                devices: self.devices(n),
            })
            .filter(|n| !n.devices.is_empty())
            .collect()
    }

    /// What a node offers: a `cuda` device per GPU of a type whose memory is known; on a node
    /// without GPUs, `--slurm-cpu-devices` CPU devices sharing at most its memory.
    fn devices(&self, node: &SlurmNode) -> Vec<DeviceSlot> {
        if !node.gpus.is_empty() {
            return node
                .gpus
                .iter()
                .filter_map(|g| {
                    let bytes = gpus::memory(g.kind.as_deref()?, &self.settings.gpu_memory)?;
                    let slot = DeviceSlot {
                        kind: DeviceKind::Cuda,
                        memory_bytes: bytes,
                    };
                    Some(std::iter::repeat_n(slot, g.count))
                })
                .flatten()
                .collect();
        }
        let cpus = self.settings.cpu_devices;
        let slot = DeviceSlot {
            kind: DeviceKind::Cpu,
            memory_bytes: self.cpu_device_memory(node),
        };
        vec![slot; cpus]
    }

    /// A CPU device's budget on `node`: `--slurm-device-memory`, or an equal share of the
    /// node's memory where that is less.
    fn cpu_device_memory(&self, node: &SlurmNode) -> u64 {
        let share = node.memory_bytes / self.settings.cpu_devices.max(1) as u64;
        self.settings.device_memory.min(share)
    }

    /// The `zerotrain` binary the nodes run: `--slurm-agent-binary`, else this one.
    pub fn agent_binary(&self) -> String {
        let own = || std::env::current_exe().unwrap_or_else(|_| "zerotrain".into());
        let path = self.settings.agent_binary.clone().unwrap_or_else(own);
        path.display().to_string()
    }

    /// [`run`] with this cluster's configuration.
    pub async fn run(
        &self,
        program: &str,
        args: &[&str],
        script: Option<&Script<'_>>,
    ) -> Result<String, SlurmError> {
        run(self.settings.conf.as_deref(), program, args, script).await
    }

    /// The node called `name` in the partitions.
    pub fn node(&self, name: &str) -> Option<SlurmNode> {
        let nodes = self.nodes.read().expect("not poisoned");
        nodes.iter().find(|n| n.name == name).cloned()
    }
}

/// Where Slurm writes the output of the allocations of a server with data dir `data_dir`.
pub fn output_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("slurm")
}

/// A batch script and the variables its job gets beside the server's own.
pub struct Script<'a> {
    pub text: &'a str,
    pub env: &'a [(&'a str, String)],
}

/// The standard output of `program args…` (fed `script`), or why it failed. The server's
/// `ZEROTRAIN_*` variables, secrets among them, are not passed on, only those `script` sets;
/// `--slurm-conf` becomes `SLURM_CONF`.
async fn run(
    conf: Option<&std::path::Path>,
    program: &str,
    args: &[&str],
    script: Option<&Script<'_>>,
) -> Result<String, SlurmError> {
    let err = |reason: String| SlurmError {
        command: format!("{program} {}", args.join(" ")),
        reason,
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(if script.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("ZEROTRAIN_") {
            cmd.env_remove(var);
        }
    }
    if let Some(conf) = conf {
        cmd.env("SLURM_CONF", conf);
    }
    if let Some(script) = script {
        cmd.envs(script.env.iter().map(|(k, v)| (*k, v)));
    }
    let mut child = cmd.spawn().map_err(|e| err(e.to_string()))?;
    if let Some(Script { text, .. }) = script {
        use tokio::io::AsyncWriteExt;
        let mut pipe = child.stdin.take().expect("piped");
        pipe.write_all(text.as_bytes())
            .await
            .map_err(|e| err(e.to_string()))?;
    }
    let out = tokio::time::timeout(COMMAND_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| err(format!("no answer in {COMMAND_TIMEOUT:?}")))?
        .map_err(|e| err(e.to_string()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(err(format!("{}: {}", out.status, stderr.trim())));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
