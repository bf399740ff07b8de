//! Optimizer state bytes beyond the fp32 master weights.

use crate::kernel_figures::ADAFACTOR_SUM_LIMBS;
use crate::model::{TensorDims, Unit, Units};
use crate::spec::{Adam8bit, Optimizer};

use super::Setup;

/// fp32 state bytes kept per element of the range an optimizer updates.
pub(super) fn per_element_bytes(opt: &Optimizer) -> u64 {
    match opt {
        Optimizer::Sgd(_) => 0,
        Optimizer::Momentum(_) | Optimizer::Lion(_) => 4,
        Optimizer::Adamw(_) => 8,
        Optimizer::Adafactor(a) => 4 * u64::from(a.beta1.is_some()),
        // m and v quantised to one byte each.
        Optimizer::Adam8bit(_) => 2,
    }
}

/// Optimizer state bytes of rank `rank` for a model laid out as `units`. Adafactor keeps its
/// factored statistics (rows + cols of every matrix, `Units::factored_len`) on every rank (they
/// are small) and all-reduces its partial sums into them each step, and one partial sum of
/// squared updates per tensor (`Units::tensor_count`) for its RMS clipping.
pub(super) fn state_bytes<K>(setup: &Setup, units: &Units<K>, rank: usize) -> u64 {
    let sharded = setup.stage.shards_optimizer();
    let held = |u: &Unit<K>| {
        if sharded {
            u.shard_range(rank)
        } else {
            0..u.padded_len
        }
    };
    let elems: usize = units.iter().map(|u| held(u).len()).sum();
    let mut bytes = per_element_bytes(&setup.optimizer) * elems as u64;
    match setup.optimizer {
        Optimizer::Adam8bit(Adam8bit { block_size, .. }) => {
            let blocks: usize = units
                .iter()
                .map(|u| held(u).len().div_ceil(block_size as usize))
                .sum();
            // One fp32 absmax per block, for m and for v.
            bytes += 2 * 4 * blocks as u64;
        }
        Optimizer::Adafactor(_) => {
            // Unfactored second moment for the vector elements this rank updates.
            let vector_elems: usize = units
                .iter()
                .flat_map(|u| {
                    let range = held(u);
                    u.tensors.iter().filter_map(move |t| match t.dims {
                        TensorDims::Vector(_) => {
                            let r = t.range();
                            Some(
                                r.end
                                    .min(range.end)
                                    .saturating_sub(r.start.max(range.start)),
                            )
                        }
                        TensorDims::Matrix(..) => None,
                    })
                })
                .sum();
            // Factored statistics (fp32), the exact partial sums of every row and column and
            // the per-tensor sums of squared updates (f64 limbs), all-reduced each step.
            let factored = units.factored_len();
            let sums = ADAFACTOR_SUM_LIMBS * (factored + units.tensor_count());
            bytes += 4 * (factored + vector_elems) as u64 + 8 * sums as u64;
        }
        _ => {}
    }
    bytes
}

/// State bytes that do not scale per element, for a bare parameter count split over `ranks`.
pub(super) fn closed_form_extra_bytes(opt: &Optimizer, psi: u64, ranks: u64) -> u64 {
    match opt {
        Optimizer::Adam8bit(a) => 2 * 4 * psi.div_ceil(ranks * u64::from(a.block_size)),
        // Taken as one square matrix: its row and column statistics and their exact sums.
        Optimizer::Adafactor(_) => {
            let factored = 2 * psi.isqrt().max(1);
            4 * factored + 8 * ADAFACTOR_SUM_LIMBS as u64 * (factored + 1)
        }
        _ => 0,
    }
}
