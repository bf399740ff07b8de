//! The runner agent: registers this node's devices with the server, keeps a heartbeat
//! waiting at the server (a long-poll, so assignments arrive as soon as they are made), runs
//! the ranks it is assigned (each job on threads of its own), reports their progress, and
//! stops an attempt the moment the server says it is over. A node the server declared lost
//! stops all its work and registers again. Synchronous: one thread runs the loop, each
//! request goes out on a thread of its own, and kernels share the process's rayon pool.

mod client;
pub mod gpus;
mod job;
mod metrics;
mod registration;

pub use metrics::AgentMetrics;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;

use crate::Error;
use crate::data::DataRoots;
use crate::device::Target;
use client::Client;
use gpus::Gpu;
use registration::{Ended, Registration};
use wire::agent::RegisterRequest;

/// Where to find the server and what this node offers.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The server's base URL, e.g. `http://127.0.0.1:8080`.
    pub server: String,
    /// The join token agents register with.
    pub join_token: String,
    pub name: String,
    /// The address other nodes reach this node's ranks at.
    pub host: String,
    /// What the node offers: a `cuda` device for each of `gpus`, in order, then its CPU
    /// devices ([`offered_devices`]).
    pub devices: Vec<DeviceSlot>,
    /// The GPUs offered; a rank placed on device `i < gpus.len()` trains on `gpus[i]`.
    pub gpus: Vec<Gpu>,
    /// The only directories jobs may read their inputs from.
    pub data_roots: DataRoots,
    /// Where attempts write their files before uploading them (each attempt's folder is
    /// removed when it ends).
    pub work_dir: std::path::PathBuf,
    /// The largest file of a job's export: a larger one is sharded
    /// (`checkpoint::EXPORT_SHARD_BYTES` by default).
    pub export_shard_bytes: u64,
    /// Serve one attempt of one job, then stop (an agent a Slurm allocation started: the
    /// server gives it that job only, and its leaving releases the allocation). It also stops,
    /// rather than registering again, when the server no longer knows the node.
    pub one_job: bool,
}

/// The devices a node offers: each GPU, then `cpus` virtual CPU devices of `cpu_memory` bytes.
pub fn offered_devices(gpus: &[Gpu], cpus: usize, cpu_memory: u64) -> Vec<DeviceSlot> {
    let cpu = DeviceSlot {
        kind: DeviceKind::Cpu,
        memory_bytes: cpu_memory,
    };
    gpus.iter()
        .map(gpus::device)
        .chain(std::iter::repeat_n(cpu, cpus))
        .collect()
}

impl AgentConfig {
    /// Where a rank placed on device `index` trains: pinned to its own GPU, or on the CPU.
    pub fn target(&self, index: usize) -> Target {
        match self.gpus.get(index) {
            Some(gpu) => Target::Cuda(gpu.ordinal),
            None => Target::Cpu,
        }
    }

    fn check_devices(&self) -> Result<(), Error> {
        let kinds_agree = self
            .devices
            .iter()
            .enumerate()
            .all(|(i, d)| (d.kind == DeviceKind::Cuda) == (i < self.gpus.len()));
        if kinds_agree {
            Ok(())
        } else {
            Err(Error::Device(
                "an agent's devices must be a cuda device per GPU, in order, then CPU devices"
                    .into(),
            ))
        }
    }
}

/// Longest an HTTP call may take, a long-poll's wait included.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the agent until `stop` is set (or its one job ended): registers (trying again with
/// backoff until the server answers), then heartbeats; when the server has declared the node
/// lost, stops every rank it ran and registers again.
pub fn run(cfg: &AgentConfig, stop: &AtomicBool, metrics: &AgentMetrics) -> Result<(), Error> {
    cfg.check_devices()?;
    metrics.watch_gpus(&cfg.gpus);
    for (i, d) in cfg.devices.iter().enumerate() {
        metrics
            .series
            .device_memory_bytes
            .with_label_values(&[&i.to_string()])
            .set(d.memory_bytes as i64);
    }
    let client = Client::new(&cfg.server, HTTP_TIMEOUT);
    let request = RegisterRequest {
        name: cfg.name.clone(),
        devices: cfg.devices.clone(),
        host: cfg.host.clone(),
    };
    loop {
        let registered = client.register(&cfg.join_token, &request, stop, |e, again| {
            metrics.series.registration_failures_total.inc();
            eprintln!(
                "agent {}: registering failed ({e}); trying again in {again:.1?}",
                cfg.name
            );
        })?;
        let Some(registered) = registered else {
            return Ok(());
        };
        metrics.series.registrations_total.inc();
        let placed_cfg;
        let cfg = match &registered.host {
            Some(host) => {
                placed_cfg = AgentConfig {
                    host: host.clone(),
                    ..cfg.clone()
                };
                &placed_cfg
            }
            None => cfg,
        };
        match Registration::new(cfg, &client, metrics, registered).run(stop) {
            Ended::Stopped => return Ok(()),
            Ended::Lost if cfg.one_job => {
                eprintln!(
                    "agent {}: the server no longer knows this node; leaving",
                    cfg.name
                );
                return Ok(());
            }
            Ended::Lost => eprintln!(
                "agent {}: the server no longer knows this node; its ranks stopped, registering again",
                cfg.name
            ),
        }
    }
}
