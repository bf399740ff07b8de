//! The agent's own Prometheus series, served by `zerotrain agent` on its `/metrics`.

use prometheus::{IntCounter, IntGauge, IntGaugeVec, Opts, Registry};

pub struct AgentMetrics {
    registry: Registry,
    /// Heartbeats the server answered.
    pub heartbeats: IntCounter,
    /// Heartbeats that failed (their reports are sent again with the next).
    pub heartbeat_failures: IntCounter,
    /// Registrations the server accepted: more than one after it had declared the node lost.
    pub registrations: IntCounter,
    /// Registrations that failed and were tried again.
    pub registration_failures: IntCounter,
    /// Attempts whose ranks were stopped because the server said they were over (or no
    /// longer knew the node).
    pub attempts_fenced: IntCounter,
    /// Jobs with ranks running on this node.
    pub jobs_running: IntGauge,
    /// Optimizer steps this node's rank-0 runs finished.
    pub steps: IntCounter,
    /// Memory budget of each device this node offers.
    pub device_memory_bytes: IntGaugeVec,
    /// Each GPU offered (`device` is its index among the node's devices): 1, labelled with its
    /// CUDA ordinal, name and UUID.
    gpu_info: IntGaugeVec,
    /// Each GPU's total memory, as the driver reports it.
    gpu_memory_total_bytes: IntGaugeVec,
    /// Each GPU's memory in use by every process, as the driver reports it when scraped.
    gpu_memory_used_bytes: IntGaugeVec,
    #[cfg(feature = "cuda")]
    probes: std::sync::Mutex<Vec<(usize, kernels::cuda::gpus::MemoryProbe)>>,
}

impl AgentMetrics {
    pub fn new() -> AgentMetrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(format!("zerotrain_agent_{name}"), help).expect("a valid name");
            registry
                .register(Box::new(c.clone()))
                .expect("registered once");
            c
        };
        let heartbeats = counter("heartbeats_total", "Heartbeats the server answered.");
        let heartbeat_failures = counter(
            "heartbeat_failures_total",
            "Heartbeats that failed; their reports go with the next.",
        );
        let registrations = counter(
            "registrations_total",
            "Registrations the server accepted; more than one after the node was declared lost.",
        );
        let registration_failures = counter(
            "registration_failures_total",
            "Registrations that failed and were tried again.",
        );
        let attempts_fenced = counter(
            "attempts_fenced_total",
            "Attempts whose ranks stopped because the server said they were over.",
        );
        let steps = counter(
            "steps_total",
            "Optimizer steps finished by ranks 0 on this node.",
        );
        let jobs_running = IntGauge::new(
            "zerotrain_agent_jobs_running",
            "Jobs with ranks running here.",
        )
        .expect("a valid name");
        registry
            .register(Box::new(jobs_running.clone()))
            .expect("registered once");
        let device_memory_bytes = IntGaugeVec::new(
            Opts::new(
                "zerotrain_agent_device_memory_bytes",
                "Memory budget of each device offered.",
            ),
            &["device"],
        )
        .expect("a valid name");
        registry
            .register(Box::new(device_memory_bytes.clone()))
            .expect("registered once");
        let gauges = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(format!("zerotrain_agent_{name}"), help), labels)
                .expect("a valid name");
            registry
                .register(Box::new(g.clone()))
                .expect("registered once");
            g
        };
        let gpu_info = gauges(
            "gpu_info",
            "Each GPU offered: 1, with its CUDA ordinal, name and UUID.",
            &["device", "ordinal", "name", "uuid"],
        );
        let gpu_memory_total_bytes = gauges(
            "gpu_memory_total_bytes",
            "Each GPU's total memory, as the driver reports it.",
            &["device"],
        );
        let gpu_memory_used_bytes = gauges(
            "gpu_memory_used_bytes",
            "Each GPU's memory in use by every process, as the driver reports it (cuMemGetInfo).",
            &["device"],
        );
        AgentMetrics {
            registry,
            heartbeats,
            heartbeat_failures,
            registrations,
            registration_failures,
            attempts_fenced,
            jobs_running,
            steps,
            device_memory_bytes,
            gpu_info,
            gpu_memory_total_bytes,
            gpu_memory_used_bytes,
            #[cfg(feature = "cuda")]
            probes: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Exports `gpus` (the node's first devices, in order), and their memory in use at every
    /// scrape.
    pub fn watch_gpus(&self, gpus: &[super::Gpu]) {
        for (i, g) in gpus.iter().enumerate() {
            let device = i.to_string();
            self.gpu_info
                .with_label_values(&[&device, &g.ordinal.to_string(), &g.name, &g.uuid])
                .set(1);
            self.gpu_memory_total_bytes
                .with_label_values(&[&device])
                .set(i64::try_from(g.total_bytes).unwrap_or(i64::MAX));
            #[cfg(feature = "cuda")]
            match kernels::cuda::gpus::MemoryProbe::new(g.ordinal) {
                Ok(probe) => self
                    .probes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((i, probe)),
                Err(e) => eprintln!("agent: GPU {} memory will not be exported: {e}", g.ordinal),
            }
        }
    }

    /// Device `device` (a GPU) has `bytes` in use.
    pub fn set_gpu_memory_used(&self, device: usize, bytes: u64) {
        self.gpu_memory_used_bytes
            .with_label_values(&[&device.to_string()])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Reads each watched GPU's memory in use now.
    fn sample_gpus(&self) {
        #[cfg(feature = "cuda")]
        for (device, probe) in self.probes.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if let Ok(used) = probe.used_bytes() {
                self.set_gpu_memory_used(*device, used);
            }
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        self.sample_gpus();
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .expect("metrics encode as text")
    }
}

impl Default for AgentMetrics {
    fn default() -> Self {
        AgentMetrics::new()
    }
}
