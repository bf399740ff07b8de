//! DeepSpeed 0.19.8's model-state estimators, `estimate_zero2_model_states_mem_needs` in
//! `deepspeed/runtime/zero/stage_1_and_2.py` and `estimate_zero3_model_states_mem_needs` in
//! `stage3.py`, as they compute: Python floats in the same order, truncated where they call
//! `int()`. Bytes per GPU and per node's host memory, for Adam with fp16 parameters.

use serde::Serialize;

/// What DeepSpeed's `additional_buffer_factor` defaults to (it scales the CPU figures only).
pub const BUFFER_FACTOR: f64 = 1.5;

/// Where the estimator is told a state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    None,
    Cpu,
}

/// The hardware the estimators are asked about.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    pub gpus_per_node: u64,
    pub nodes: u64,
    pub buffer_factor: f64,
}

impl Cluster {
    /// One node holding `gpus` GPUs, with DeepSpeed's default buffer factor.
    pub fn one_node(gpus: u64) -> Cluster {
        Cluster {
            gpus_per_node: gpus,
            nodes: 1,
            buffer_factor: BUFFER_FACTOR,
        }
    }

    fn total_gpus(&self) -> f64 {
        (self.gpus_per_node * self.nodes) as f64
    }
}

/// One estimator answer in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Needs {
    pub cpu_bytes_per_node: u64,
    pub gpu_bytes_per_gpu: u64,
}

/// ZeRO-2. GPU without offload: `2Ψ + int(18Ψ/N)` (18 = 2 fp16 grads + 4 fp32 grads + 4 fp32
/// params + 8 Adam m, v); offloading the optimizer leaves `2Ψ` on the GPU.
pub fn zero2(total_params: f64, c: &Cluster, offload_optimizer: Offload) -> Needs {
    let p = total_params;
    let n = c.total_gpus();
    let (cpu, gpu) = match offload_optimizer {
        Offload::Cpu => (p * (4.0 * n).max(16.0) * c.buffer_factor, 2.0 * p),
        Offload::None => (
            p * 4.0 * c.gpus_per_node as f64 * c.buffer_factor,
            2.0 * p + (18.0 * p / n).trunc(),
        ),
    };
    Needs {
        cpu_bytes_per_node: cpu as u64,
        gpu_bytes_per_gpu: gpu as u64,
    }
}

/// ZeRO-3 options, as `estimate_zero3_model_states_mem_needs_all_cold` prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zero3Options {
    pub offload_param: Offload,
    pub offload_optimizer: Offload,
    pub zero_init: bool,
}

/// ZeRO-3. Every GPU figure starts from `4L`, 2 bytes of fp16 parameters and 2 of gradients of
/// the largest layer (`L`, the most parameters any one module owns) gathered whole. Without
/// offload: `4L + int(18Ψ/N)`. Offloading parameters matters only with the optimizer
/// offloaded too (DeepSpeed ignores it otherwise).
pub fn zero3(total_params: f64, largest_layer_params: f64, c: &Cluster, o: Zero3Options) -> Needs {
    let (p, l) = (total_params, largest_layer_params);
    let n = c.total_gpus();
    let gpus_factor = 1.0 / c.nodes as f64;
    let gpn = c.gpus_per_node as f64;
    let largest_layer = 4.0 * l;
    let abf = c.buffer_factor;
    let (cpu, gpu) = match (o.offload_optimizer, o.offload_param) {
        (Offload::Cpu, Offload::Cpu) => (
            if o.zero_init {
                p * 18.0 * gpus_factor * abf
            } else {
                p * (4.0 * gpn).max(18.0 * gpus_factor) * abf
            },
            largest_layer,
        ),
        (Offload::Cpu, Offload::None) => (
            if o.zero_init {
                p * 16.0 * gpus_factor * abf
            } else {
                p * (4.0 * gpn).max(16.0 * gpus_factor) * abf
            },
            largest_layer + (2.0 * p / n).trunc(),
        ),
        (Offload::None, _) => (
            if o.zero_init {
                l * 4.0 * gpn * abf
            } else {
                p * 4.0 * gpn * abf
            },
            largest_layer + (18.0 * p / n).trunc(),
        ),
    };
    Needs {
        cpu_bytes_per_node: cpu as u64,
        gpu_bytes_per_gpu: gpu as u64,
    }
}

/// `4L`: the bytes ZeRO-3's estimate keeps for the largest layer gathered whole.
pub fn largest_layer_memory(largest_layer_params: f64) -> u64 {
    (4.0 * largest_layer_params) as u64
}

/// How `*_all_cold` prints a byte count: `bytes / 2**30` with two decimals (labelled "GB").
pub fn as_printed(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 30) as f64)
}
