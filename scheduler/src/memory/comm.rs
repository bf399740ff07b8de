//! Communication per optimizer step. Every collective is a ring over a buffer split in N equal
//! chunks (units are padded so they split exactly): reduce-scatter and all-gather send (N−1)
//! chunks per rank, all-reduce (reduce-scatter + all-gather) twice that.
//!
//! Stage 0 all-reduces gradients once per step; stage 1 reduce-scatters them once and
//! all-gathers the updated parameters; stage 2 reduce-scatters per micro-batch (only the own
//! shard is kept across micro-batches); stage 3 all-gathers every unit before its forward and
//! again before its backward (the final LayerNorm once: its backward follows its forward in
//! the loss head), and reduce-scatters its gradient, per micro-batch. With one micro-batch that
//! is the ZeRO paper's 2Ψ(N−1)/N elements for stages 0-2 and 3Ψ(N−1)/N for stage 3 (less the
//! 2C-element final norm). Every step also all-reduces three f32s (the loss, the squared
//! gradient norm of sharded gradients, non-finite on overflow, and the targets ignored), and sharded Adafactor its exact
//! (f64-limb) sums of its factored statistics and per-tensor RMS.

use serde::Serialize;

use super::Setup;
use crate::kernel_figures::ADAFACTOR_SUM_LIMBS;
use crate::model::{LoraLayout, Units};
use crate::spec::{Optimizer, ZeroStage};

/// Bytes one rank sends, by collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Comm {
    pub all_reduce: u64,
    pub reduce_scatter: u64,
    pub all_gather: u64,
}

impl Comm {
    pub fn total(&self) -> u64 {
        self.all_reduce + self.reduce_scatter + self.all_gather
    }
}

/// Bytes a rank sends in a reduce-scatter or all-gather of `bytes` over `n` ranks.
fn ring(bytes: u64, n: u64) -> u64 {
    (bytes * (n - 1)).div_ceil(n)
}

/// Elements padded to a multiple of `n`, as every ring buffer is.
fn padded(elems: u64, n: u64) -> u64 {
    elems.next_multiple_of(n)
}

pub(super) fn per_step(setup: &Setup) -> Comm {
    let n = setup.world_size as u64;
    if n == 1 {
        return Comm::default();
    }
    let x = setup.dtype.bytes();
    // The final norm's backward (and an untied LM head's) follows its forward at once (in the
    // loss head), and an untied embedding's backward reads no weights, so stage 3 gathers
    // those once per micro-batch rather than twice. A LoRA job reduces and updates only its
    // adapters; stage 3 gathers the frozen base (its NF4 bytes as they are) beside them.
    let moved = match (setup.arch.model(), setup.lora) {
        (Some(model), None) => {
            let units = model.units(setup.world_size);
            let bytes = x * units.padded_len() as u64;
            Moved {
                trained: bytes,
                gathered: bytes,
                gathered_once: x * units.gathered_once_padded_len() as u64,
                factored: units.factored_len() as u64,
                tensors: units.tensor_count() as u64,
            }
        }
        (Some(model), Some(adapters)) => {
            let layout = adapters.layout(&model, setup.world_size);
            let trained = x * layout.adapters.padded_len() as u64;
            Moved {
                trained,
                gathered: trained
                    + x * layout.base.padded_len() as u64
                    + layout.nf4.padded_len() as u64,
                gathered_once: x * layout.base.gathered_once_padded_len() as u64,
                factored: layout.adapters.factored_len() as u64,
                tensors: layout.adapters.tensor_count() as u64,
            }
        }
        (None, _) => {
            let psi = setup.arch.parameter_count();
            Moved {
                trained: x * psi,
                gathered: x * psi,
                gathered_once: 0,
                factored: 2 * psi.isqrt().max(1),
                tensors: 1,
            }
        }
    };
    let pass = ring(moved.trained, n);
    let micro = setup.grad_accum as u64;
    let mut c = match setup.stage {
        ZeroStage::Ddp => Comm {
            all_reduce: 2 * pass,
            ..Comm::default()
        },
        ZeroStage::Optimizer => Comm {
            reduce_scatter: pass,
            all_gather: pass,
            ..Comm::default()
        },
        ZeroStage::Gradients => Comm {
            reduce_scatter: micro * pass,
            all_gather: pass,
            ..Comm::default()
        },
        ZeroStage::Parameters => Comm {
            reduce_scatter: micro * pass,
            all_gather: micro * (2 * ring(moved.gathered, n) - ring(moved.gathered_once, n)),
            ..Comm::default()
        },
    };
    let all_reduce = |elem_bytes: u64, elems: u64| 2 * ring(elem_bytes * padded(elems, n), n);
    // Every step the ranks agree on three f32s: the step's loss, the squared gradient norm and
    // the targets ignored.
    c.all_reduce += all_reduce(4, 3);
    if setup.stage.shards_optimizer()
        && let Optimizer::Adafactor(_) = setup.optimizer
    {
        let limbs = ADAFACTOR_SUM_LIMBS as u64;
        c.all_reduce +=
            all_reduce(8, moved.factored * limbs) + all_reduce(8, moved.tensors * limbs);
    }
    c
}

/// Bytes a step's collectives move, by what they move.
struct Moved {
    /// The trained parameters (their gradients reduced, their updates gathered).
    trained: u64,
    /// Everything stage 3 gathers: every parameter, trained or frozen.
    gathered: u64,
    /// What stage 3 gathers once per micro-batch rather than twice.
    gathered_once: u64,
    /// Adafactor's factored statistics and tensors, over the trained parameters.
    factored: u64,
    tensors: u64,
}

/// [`scratch_bytes`] for a LoRA job: the adapters' collectives and, at stage 3, the frozen
/// base's gathers (in the compute dtype, NF4 as bytes).
pub(super) fn lora_scratch_bytes(setup: &Setup, layout: &LoraLayout) -> u64 {
    let adapters = scratch_bytes(setup, &layout.adapters);
    if !setup.stage.shards_params() || setup.world_size == 1 {
        return adapters;
    }
    let base = setup.dtype.bytes() * layout.base.largest_shard_len() as u64;
    adapters
        .max(base)
        .max(layout.nf4.largest_shard_len() as u64)
}

/// The receive buffer of the ring: one chunk of the largest buffer any collective moves.
pub(super) fn scratch_bytes<K>(setup: &Setup, units: &Units<K>) -> u64 {
    let n = setup.world_size as u64;
    if n == 1 {
        return 0;
    }
    // Gradients and parameters travel in the compute dtype; when the fp32 master weights are
    // sharded, the final export gathers them in fp32.
    let element = if setup.stage.shards_optimizer() {
        4
    } else {
        setup.dtype.bytes()
    };
    let mut chunk = element * units.largest_shard_len() as u64;
    if let Optimizer::Adafactor(_) = setup.optimizer
        && setup.stage.shards_optimizer()
    {
        let sums = (ADAFACTOR_SUM_LIMBS * units.factored_len()) as u64;
        chunk = chunk.max(8 * padded(sums, n) / n);
    }
    chunk
}
