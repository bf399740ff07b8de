//! The agent's own Prometheus series, served by `zerotrain agent` on its `/metrics`.

use prometheus::{IntCounter, IntGauge, IntGaugeVec, Registry};

wire::metrics! {
    /// The agent's series.
    pub struct AgentSeries("zerotrain_agent_") {
        /// Heartbeats the server answered.
        pub heartbeats_total: IntCounter;
        /// Heartbeats that failed; their reports go with the next.
        pub heartbeat_failures_total: IntCounter;
        /// Registrations the server accepted; more than one after the node was declared lost.
        pub registrations_total: IntCounter;
        /// Registrations that failed and were tried again.
        pub registration_failures_total: IntCounter;
        /// Attempts whose ranks stopped because the server said they were over (or no longer knew the node).
        pub attempts_fenced_total: IntCounter;
        /// Jobs with ranks running here.
        pub jobs_running: IntGauge;
        /// Optimizer steps finished by ranks 0 on this node.
        pub steps_total: IntCounter;
        /// Memory budget of each device offered.
        pub device_memory_bytes: IntGaugeVec, labels = ["device"];
        /// Each GPU offered (`device` is its index among the node's devices): 1, with its CUDA ordinal, name and UUID.
        pub gpu_info: IntGaugeVec, labels = ["device", "ordinal", "name", "uuid"];
        /// Each GPU's total memory, as the driver reports it.
        pub gpu_memory_total_bytes: IntGaugeVec, labels = ["device"];
        /// Each GPU's memory in use by every process, as the driver reports it (cuMemGetInfo).
        pub gpu_memory_used_bytes: IntGaugeVec, labels = ["device"];
    }
}

pub struct AgentMetrics {
    registry: Registry,
    pub series: AgentSeries,
    probes: std::sync::Mutex<Vec<(usize, kernels::cuda::gpus::MemoryProbe)>>,
}

impl AgentMetrics {
    pub fn new() -> AgentMetrics {
        let registry = Registry::new();
        AgentMetrics {
            series: AgentSeries::new(&registry),
            registry,
            probes: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Exports `gpus` (the node's first devices, in order), and their memory in use at every
    /// scrape.
    pub fn watch_gpus(&self, gpus: &[super::Gpu]) {
        for (i, g) in gpus.iter().enumerate() {
            let device = i.to_string();
            self.series
                .gpu_info
                .with_label_values(&[&device, &g.ordinal.to_string(), &g.name, &g.uuid])
                .set(1);
            self.series
                .gpu_memory_total_bytes
                .with_label_values(&[&device])
                .set(i64::try_from(g.total_bytes).unwrap_or(i64::MAX));
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
        self.series
            .gpu_memory_used_bytes
            .with_label_values(&[&device.to_string()])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Reads each watched GPU's memory in use now.
    fn sample_gpus(&self) {
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
