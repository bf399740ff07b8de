//! The memory model: bytes per rank by category, and bytes each rank sends per step, for one
//! resolved training configuration. Exact for every model family `crate::model` describes (its
//! parameter layout, shard padding and activation tensors come from there, the same description
//! the trainer allocates from); closed-form for a bare parameter count. A pure function: no
//! I/O, no printing.

mod comm;
mod optimizer;
pub mod process;

pub use comm::Comm;

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};
use strum::{EnumString, IntoStaticStr, VariantArray};

use crate::kernel_figures::CUDA_GEMM_RESIDENT_BYTES;
use crate::model::{Adapters, ModelShape, Units};
use crate::spec::{Architecture, Dtype, JobSpec, MAX_SYNTHETIC_VOCAB, Optimizer, ZeroStage};

/// What a byte is held for. The trainer's accounting allocator uses the same categories.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    IntoStaticStr,
    VariantArray,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Category {
    /// Weights in the compute dtype (fp32 training: the only copy).
    Params,
    /// Gradients in the compute dtype.
    Grads,
    /// fp32 master weights (mixed precision) and optimizer states.
    Optimizer,
    /// Tensors saved for backward and the backward's scratch.
    Activations,
    /// Logits, token ids, communication scratch, unit gradient buffers, gathered stage-3 units,
    /// the data loader's buffers.
    Buffers,
    /// Runtime cost outside the trainer's buffers: a CUDA context per GPU, or on CPU devices
    /// the process itself (`process`), paid by the first rank of each process.
    Overhead,
}

impl Category {
    pub const ALL: &[Category] = <Category as VariantArray>::VARIANTS;

    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// The kind of device a rank runs on.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    Serialize,
    Deserialize,
    IntoStaticStr,
    EnumString,
    VariantArray,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum DeviceKind {
    /// A virtual CPU device with a memory budget.
    #[default]
    Cpu,
    Cuda,
}

/// CUDA context, loaded kernel modules, NCCL channel buffers and a few KiB of reduction
/// scratch per GPU: an allowance until it is measured on the GPU machines.
pub const CUDA_CONTEXT_BYTES: u64 = (1 << 30) - CUDA_GEMM_RESIDENT_BYTES;

/// Everything a GPU holds outside the trainer's accounted buffers.
pub const CUDA_OVERHEAD_BYTES: u64 = CUDA_CONTEXT_BYTES + CUDA_GEMM_RESIDENT_BYTES;

impl DeviceKind {
    /// The name job specs and the agent protocol use: `cpu`, `cuda`.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// What a rank pays beside its buffers, planned for before the node is known: a CUDA
    /// context, or a CPU process as [`process::CpuProcess::PLANNING`] describes it.
    pub fn overhead_bytes(self) -> u64 {
        match self {
            DeviceKind::Cpu => process::CpuProcess::PLANNING.overhead_bytes(),
            DeviceKind::Cuda => CUDA_OVERHEAD_BYTES,
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Bytes one rank holds, by category.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Breakdown {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub buffers: u64,
    pub overhead: u64,
}

impl Breakdown {
    pub fn get(&self, c: Category) -> u64 {
        match c {
            Category::Params => self.params,
            Category::Grads => self.grads,
            Category::Optimizer => self.optimizer,
            Category::Activations => self.activations,
            Category::Buffers => self.buffers,
            Category::Overhead => self.overhead,
        }
    }

    pub fn get_mut(&mut self, c: Category) -> &mut u64 {
        match c {
            Category::Params => &mut self.params,
            Category::Grads => &mut self.grads,
            Category::Optimizer => &mut self.optimizer,
            Category::Activations => &mut self.activations,
            Category::Buffers => &mut self.buffers,
            Category::Overhead => &mut self.overhead,
        }
    }

    /// Parameters, gradients and optimizer states: what the ZeRO paper's Table 1 counts.
    pub fn model_states(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    pub fn total(&self) -> u64 {
        Category::ALL.iter().map(|&c| self.get(c)).sum()
    }
}

impl Serialize for Breakdown {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Breakdown", 7)?;
        for &c in Category::ALL {
            st.serialize_field(c.name(), &self.get(c))?;
        }
        st.serialize_field("total", &self.total())?;
        st.end()
    }
}

/// One fully resolved way of running a job: no `"auto"` left.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setup {
    pub arch: Architecture,
    pub dtype: Dtype,
    pub optimizer: Optimizer,
    pub stage: ZeroStage,
    pub world_size: usize,
    pub micro_batch: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    pub checkpointing: bool,
    /// Whether ranks agree on a scalar each step (found-inf for fp16, the norm for clipping).
    pub reduces_norm: bool,
    /// Bytes per token of the data files, or 0 for synthetic data (`Data::token_width`).
    pub token_width: usize,
    /// Whether a second loader reads validation data (`data.validation`).
    pub validates: bool,
    /// The adapters of a LoRA job: only they are trained, the base is frozen.
    pub lora: Option<Adapters>,
}

impl Setup {
    /// The spec's configuration with the given choices for its `"auto"` fields.
    pub fn new(
        spec: &JobSpec,
        stage: ZeroStage,
        checkpointing: bool,
        micro_batch: u32,
        grad_accum: u32,
    ) -> Setup {
        Setup {
            arch: spec.architecture(),
            dtype: spec.precision.dtype,
            optimizer: spec.optimizer,
            stage,
            world_size: spec.world_size.get() as usize,
            micro_batch: micro_batch as usize,
            seq_len: spec.training.seq_len.get() as usize,
            grad_accum: grad_accum as usize,
            checkpointing,
            reduces_norm: spec.precision.dtype == Dtype::Fp16 || spec.training.grad_clip > 0.0,
            token_width: spec.data.token_width(),
            validates: spec.data.validation().is_some(),
            lora: spec
                .lora
                .as_ref()
                .zip(spec.architecture().model())
                .map(|(lora, model)| lora.adapters(&model)),
        }
    }
}

impl Setup {
    /// The model's parameters, a LoRA job's adapters included, and those the optimizer
    /// updates: all of them, or the adapters.
    pub fn parameter_counts(&self) -> (u64, u64) {
        let base = self.arch.parameter_count();
        match self.lora.zip(self.arch.model()) {
            Some((adapters, model)) => {
                let trained = adapters.parameter_count(&model);
                (base + trained, trained)
            }
            None => (base, base),
        }
    }
}

/// The memory model's answer for one setup on one kind of device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Estimate {
    /// The model's parameters (unpadded), adapters included.
    pub parameters: u64,
    /// Parameters the optimizer updates: all of them, or a LoRA job's adapters.
    pub trainable_parameters: u64,
    /// The rank with the largest total (ranks differ only by Adafactor's per-tensor state).
    pub per_rank: Breakdown,
    /// Bytes each rank sends per optimizer step, by collective.
    pub comm: Comm,
}

pub fn estimate(setup: &Setup, device: DeviceKind) -> Estimate {
    let per_rank = distinct_ranks(setup, device)
        .into_iter()
        .max_by_key(Breakdown::total)
        .unwrap_or_default();
    let (parameters, trainable_parameters) = setup.parameter_counts();
    Estimate {
        parameters,
        trainable_parameters,
        per_rank: Breakdown {
            overhead: device.overhead_bytes(),
            ..per_rank
        },
        comm: comm::per_step(setup),
    }
}

/// Each rank's bytes on a `device`, without its overhead, where ranks differ (exact Adafactor with sharded
/// states); otherwise only rank 0's, which stands for all.
pub fn distinct_ranks(setup: &Setup, device: DeviceKind) -> Vec<Breakdown> {
    let count = match (setup.arch.model(), setup.optimizer) {
        (Some(_), Optimizer::Adafactor(_)) if setup.stage.shards_optimizer() => setup.world_size,
        _ => 1,
    };
    (0..count)
        .map(|r| rank_breakdown_on(setup, r, device))
        .collect()
}

/// Bytes of the receive buffer of the ring collectives (one chunk of the largest buffer any
/// of them moves); 0 for a single rank.
pub fn ring_scratch_bytes(setup: &Setup) -> u64 {
    match (setup.arch.model(), setup.lora) {
        (Some(model), None) => comm::scratch_bytes(setup, &model.units(setup.world_size)),
        (Some(model), Some(adapters)) => {
            comm::lora_scratch_bytes(setup, &adapters.layout(&model, setup.world_size))
        }
        (None, _) => 0,
    }
}

/// Bytes rank `rank` holds on a CPU, without device overhead.
pub fn rank_breakdown(setup: &Setup, rank: usize) -> Breakdown {
    rank_breakdown_on(setup, rank, DeviceKind::Cpu)
}

/// Bytes rank `rank` holds on a `device`, without its overhead: a GPU's GEMMs widen no tiles
/// (cuBLASLt reads 16-bit operands), so it has no matmul scratch.
pub fn rank_breakdown_on(setup: &Setup, rank: usize, device: DeviceKind) -> Breakdown {
    match setup.arch.model() {
        Some(model) => {
            let mut b = match setup.lora {
                None => exact(setup, &model, rank),
                Some(adapters) => exact_lora(setup, &model, &adapters, rank),
            };
            if device == DeviceKind::Cuda {
                let depth = model.matmul_depth(setup.micro_batch, setup.seq_len);
                b.buffers -= crate::model::matmul_scratch_bytes(setup.dtype.bytes(), depth);
            }
            b
        }
        None => closed_form(setup, setup.arch.parameter_count()),
    }
}

/// A described model's bytes, from its units and activations.
fn exact(setup: &Setup, model: &ModelShape, rank: usize) -> Breakdown {
    let n = setup.world_size;
    let units = model.units(n);
    let x = setup.dtype.bytes();
    let (whole, shard) = (units.padded_len() as u64, units.shard_len() as u64);
    let held = |sharded: bool| if sharded { shard } else { whole };
    let stage = setup.stage;

    let acts = model.activations(setup.micro_batch, setup.seq_len, setup.checkpointing, x);
    let mut buffers =
        acts.buffers + comm::scratch_bytes(setup, &units) + loader_bytes(setup, model.vocab_size());
    // Pinned units: the embeddings when the LM head is tied to them (the encoder and the head
    // both use them, at the two ends of the step); every other unit is used and released in
    // turn, so one unit-sized buffer (two when prefetching) holds any of them.
    let (pinned, streamed) = (
        units.pinned_padded_len(),
        units.largest_streamed_padded_len(),
    );
    if stage.shards_grads() {
        // Full gradients of the unit in backward, and of the pinned embeddings, which the tied
        // LM head and the encoder both add to, from the first backward op to the last.
        buffers += x * (pinned + streamed) as u64;
    }
    if stage.shards_params() {
        // Gathered pinned embeddings and two streamed units (current, prefetched): for an
        // untied head, two slots of the largest unit, the token embedding or the LM head.
        buffers += x * (pinned + 2 * streamed) as u64;
    }

    let opt_elems = held(stage.shards_optimizer());
    let master = if setup.dtype.has_master_weights() {
        4 * opt_elems
    } else {
        0
    };
    Breakdown {
        params: x * held(stage.shards_params()),
        grads: x * held(stage.shards_grads()),
        optimizer: master + optimizer::state_bytes(setup, &units, rank),
        activations: acts.activations,
        buffers,
        overhead: 0,
    }
}

/// A LoRA job's bytes: the frozen base as weights only (sharded at stage 3, like any
/// parameter, and gathered a unit at a time), the adapters as the trainable units whose
/// gradients and optimizer states the stages shard, and the adapters' activations beside
/// full fine-tuning's (whose saved projection inputs are the adapters' inputs too).
fn exact_lora(setup: &Setup, model: &ModelShape, adapters: &Adapters, rank: usize) -> Breakdown {
    let n = setup.world_size;
    let layout = adapters.layout(model, n);
    let (base, trained, nf4) = (&layout.base, &layout.adapters, &layout.nf4);
    let x = setup.dtype.bytes();
    let stage = setup.stage;
    let (b, t) = (setup.micro_batch, setup.seq_len);

    let acts = model.activations(b, t, setup.checkpointing, x);
    let mut buffers = acts.buffers
        + comm::lora_scratch_bytes(setup, &layout)
        + loader_bytes(setup, model.vocab_size())
        + adapters.dequantize_scratch_bytes(model, x);
    if stage.shards_grads() {
        // Whole gradients of the block whose backward runs; adapters have no pinned unit.
        buffers += x * trained.largest_streamed_padded_len() as u64;
    }
    if stage.shards_params() {
        // As for full fine-tuning (pinned embeddings, two streamed slots), for the base, its
        // NF4 bytes and the adapters alike.
        buffers += x * (base.pinned_padded_len() + 2 * base.largest_streamed_padded_len()) as u64
            + 2 * nf4.largest_streamed_padded_len() as u64
            + x * 2 * trained.largest_streamed_padded_len() as u64;
    }
    let opt_elems = held(trained, stage.shards_optimizer());
    let master = if setup.dtype.has_master_weights() {
        4 * opt_elems
    } else {
        0
    };
    let frozen = x * held(base, stage.shards_params()) + held(nf4, stage.shards_params());
    Breakdown {
        params: frozen + x * held(trained, stage.shards_params()),
        grads: x * held(trained, stage.shards_grads()),
        optimizer: master + optimizer::state_bytes(setup, trained, rank),
        activations: acts.activations
            + adapters.activation_bytes(model, (b, t), setup.checkpointing, x),
        buffers,
        overhead: 0,
    }
}

/// Elements a rank holds of `units`: its shard of each, or each whole.
fn held<K>(units: &Units<K>, sharded: bool) -> u64 {
    (if sharded {
        units.shard_len()
    } else {
        units.padded_len()
    }) as u64
}

/// The data loaders' buffers: for files, one window of `B·T + 1` tokens (u32) and its raw
/// bytes, for training and again for validation; for the synthetic corpus, its successor table
/// (four u32 per context of two tokens) and one row of `T + 1` tokens.
fn loader_bytes(setup: &Setup, vocab_size: usize) -> u64 {
    let window = (setup.micro_batch * setup.seq_len + 1) as u64;
    match setup.token_width {
        0 => {
            let v = vocab_size.min(MAX_SYNTHETIC_VOCAB) as u64;
            16 * v * v + 4 * (setup.seq_len as u64 + 1)
        }
        width => (1 + u64::from(setup.validates)) * window * (4 + width as u64),
    }
}

/// Model-state bytes per parameter, unsharded: parameters and gradients in the compute dtype,
/// and the fp32 master copy (mixed precision) with the optimizer's per-element state under
/// `optimizer` (8-bit Adam's block scales and Adafactor's factored statistics aside).
pub fn bytes_per_parameter(dtype: Dtype, optimizer: &Optimizer) -> Breakdown {
    let master = if dtype.has_master_weights() { 4 } else { 0 };
    Breakdown {
        params: dtype.bytes(),
        grads: dtype.bytes(),
        optimizer: master + optimizer::per_element_bytes(optimizer),
        ..Breakdown::default()
    }
}

/// A bare parameter count Ψ: model states only (nothing is known of activations or units).
/// Shards hold exactly Ψ/N elements, as in the ZeRO paper; bytes are rounded up cumulatively
/// (each category ends where the rounded-up running total ends), so the total is the exact
/// value rounded up and each category is within a byte of its exact value.
fn closed_form(setup: &Setup, psi: u64) -> Breakdown {
    let n = setup.world_size as u128;
    let stage = setup.stage;
    let per_param = bytes_per_parameter(setup.dtype, &setup.optimizer);
    // Numerators over the common denominator N.
    let over_n = |bytes_per_param: u64, sharded: bool| {
        u128::from(bytes_per_param) * u128::from(psi) * if sharded { 1 } else { n }
    };
    let exact = [
        over_n(per_param.params, stage.shards_params()),
        over_n(per_param.grads, stage.shards_grads()),
        over_n(per_param.optimizer, stage.shards_optimizer()),
    ];
    let mut rounded = [0u64; 3];
    let (mut running, mut previous) = (0u128, 0u128);
    for (out, part) in rounded.iter_mut().zip(exact) {
        running += part;
        let end = running.div_ceil(n);
        *out = u64::try_from(end - previous).expect("model states fit in u64 bytes");
        previous = end;
    }
    let opt_ranks = if stage.shards_optimizer() {
        setup.world_size as u64
    } else {
        1
    };
    Breakdown {
        params: rounded[0],
        grads: rounded[1],
        optimizer: rounded[2]
            + optimizer::closed_form_extra_bytes(&setup.optimizer, psi, opt_ranks),
        ..Breakdown::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strum_names_are_serde_names() {
        for &c in Category::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.name());
        }
        for &k in DeviceKind::VARIANTS {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
            assert_eq!(k.as_str().parse::<DeviceKind>(), Ok(k));
        }
    }
}
