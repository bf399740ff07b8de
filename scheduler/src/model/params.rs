//! Parameter layout: one flat buffer per unit (the embeddings, each block, the final norm and,
//! for an untied head, the LM head), padded to `SHARD_ALIGN × world_size` elements and split into `world_size` equal contiguous
//! shards, as FSDP flat parameters are. Gradients and optimizer states share the layout, so
//! sharding is `(offset, len)` arithmetic and every ZeRO stage uses the same buffers.

use std::ops::Range;

use super::TensorKind;

/// Shards start on multiples of this many elements (64 bytes of fp32), so every shard of every
/// dtype is SIMD-aligned relative to its buffer.
pub const SHARD_ALIGN: usize = 16;

/// Dimensions of a parameter tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorDims {
    Vector(usize),
    /// Row-major (rows, cols).
    Matrix(usize, usize),
}

impl TensorDims {
    /// Number of elements.
    pub fn numel(self) -> usize {
        match self {
            TensorDims::Vector(n) => n,
            TensorDims::Matrix(r, c) => r * c,
        }
    }

    pub fn to_vec(self) -> Vec<usize> {
        match self {
            TensorDims::Vector(n) => vec![n],
            TensorDims::Matrix(r, c) => vec![r, c],
        }
    }
}

/// How a tensor starts when a job loads no weights (each family's own initialisation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TensorInit {
    Zeros,
    Ones,
    Normal {
        std: f64,
    },
    /// Uniform in `[-bound, bound)`.
    Uniform {
        bound: f64,
    },
}

/// Which part of the model a unit holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitKind {
    Embeddings,
    Block(usize),
    FinalNorm,
    /// An LM head not tied to the token embedding (`lm_head.weight`), its own unit.
    Head,
}

/// A tensor's place in its unit's flat buffer. `K` names the tensor within its family (GPT-2's
/// `TensorKind` by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamTensor<K = TensorKind> {
    pub kind: K,
    pub dims: TensorDims,
    /// Element offset within the unit.
    pub offset: usize,
}

impl<K> ParamTensor<K> {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.dims.numel()
    }
}

/// One flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit<K = TensorKind> {
    pub kind: UnitKind,
    pub tensors: Vec<ParamTensor<K>>,
    /// Elements holding parameters.
    pub len: usize,
    /// `len` rounded up to a multiple of `SHARD_ALIGN × world_size`; the tail is zero padding.
    pub padded_len: usize,
    world_size: usize,
}

impl<K> Unit<K> {
    /// Elements in each rank's shard.
    pub fn shard_len(&self) -> usize {
        self.padded_len / self.world_size
    }

    /// The element range of `rank`'s shard within the unit.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        let n = self.shard_len();
        rank * n..(rank + 1) * n
    }

    pub fn layer(&self) -> Option<usize> {
        match self.kind {
            UnitKind::Block(l) => Some(l),
            UnitKind::Embeddings | UnitKind::FinalNorm | UnitKind::Head => None,
        }
    }

    /// Whether the unit runs in the loss head, where its backward follows its forward at once
    /// (the final norm, an untied LM head): stage 3 gathers it once per micro-batch.
    pub fn in_loss_head(&self) -> bool {
        matches!(self.kind, UnitKind::FinalNorm | UnitKind::Head)
    }

    /// The same unit with its tensors named by `f`.
    pub fn map_kinds<J>(self, f: impl Fn(K) -> J) -> Unit<J> {
        Unit {
            kind: self.kind,
            tensors: self
                .tensors
                .into_iter()
                .map(|t| ParamTensor {
                    kind: f(t.kind),
                    dims: t.dims,
                    offset: t.offset,
                })
                .collect(),
            len: self.len,
            padded_len: self.padded_len,
            world_size: self.world_size,
        }
    }
}

/// All units of a model, laid out for `world_size` ranks, in Hugging Face state-dict order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Units<K = TensorKind> {
    units: Vec<Unit<K>>,
    /// The LM head is the token embedding: the embeddings unit is used at both ends of a step.
    tied: bool,
}

impl<K> Units<K> {
    /// Lays out `units` (each its tensors in order) for `world_size` ranks; `tied` when the
    /// first unit, the embeddings, is also the LM head.
    pub fn lay_out(
        units: Vec<(UnitKind, Vec<(K, TensorDims)>)>,
        tied: bool,
        world_size: usize,
    ) -> Units<K> {
        assert!(world_size > 0, "world_size must be positive");
        let units = units
            .into_iter()
            .map(|(kind, kinds)| {
                let mut offset = 0;
                let tensors = kinds
                    .into_iter()
                    .map(|(kind, dims)| {
                        let t = ParamTensor { kind, dims, offset };
                        offset += dims.numel();
                        t
                    })
                    .collect();
                Unit {
                    kind,
                    tensors,
                    len: offset,
                    padded_len: offset.next_multiple_of(SHARD_ALIGN * world_size),
                    world_size,
                }
            })
            .collect();
        Units { units, tied }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Unit<K>> {
        self.units.iter()
    }

    pub fn embeddings(&self) -> &Unit<K> {
        &self.units[0]
    }

    /// Whether the embeddings unit is also the LM head.
    pub fn tied(&self) -> bool {
        self.tied
    }

    /// The same layout with its tensors named by `f`.
    pub fn map_kinds<J>(self, f: impl Fn(K) -> J + Copy) -> Units<J> {
        Units {
            units: self.units.into_iter().map(|u| u.map_kinds(f)).collect(),
            tied: self.tied,
        }
    }

    /// Elements of the units a step keeps whole from its first operation to its last: the
    /// embeddings when the LM head is tied to them (the encoder and the head both use them).
    pub fn pinned_padded_len(&self) -> usize {
        if self.tied {
            self.embeddings().padded_len
        } else {
            0
        }
    }

    /// The largest unit that is used and released in turn (every unit but the pinned ones):
    /// what one gathered slot, or one whole-gradient buffer, must hold.
    pub fn largest_streamed_padded_len(&self) -> usize {
        let skip = usize::from(self.tied);
        self.units[skip..]
            .iter()
            .map(|u| u.padded_len)
            .max()
            .unwrap_or(0)
    }

    /// Elements of the units stage 3 gathers once per micro-batch rather than twice: those in
    /// the loss head (`Unit::in_loss_head`), and untied embeddings, whose backward reads only
    /// the token ids (a tied embedding is gathered again for the LM head).
    pub fn gathered_once_padded_len(&self) -> usize {
        self.units
            .iter()
            .filter(|u| u.in_loss_head() || (!self.tied && u.kind == UnitKind::Embeddings))
            .map(|u| u.padded_len)
            .sum()
    }

    /// Sum of padded unit lengths: the elements a whole (unsharded) copy occupies.
    pub fn padded_len(&self) -> usize {
        self.units.iter().map(|u| u.padded_len).sum()
    }

    /// Sum of shard lengths: the elements one rank's shard of every unit occupies.
    pub fn shard_len(&self) -> usize {
        self.units.iter().map(|u| u.shard_len()).sum()
    }

    /// Elements holding parameters (Ψ).
    pub fn len(&self) -> usize {
        self.units.iter().map(|u| u.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// The largest unit other than the embeddings (blocks or the final LayerNorm).
    pub fn largest_other_padded_len(&self) -> usize {
        self.units[1..]
            .iter()
            .map(|u| u.padded_len)
            .max()
            .unwrap_or(0)
    }

    pub fn largest_shard_len(&self) -> usize {
        self.units.iter().map(|u| u.shard_len()).max().unwrap_or(0)
    }

    /// Elements of Adafactor's factored statistics: rows + cols of every matrix.
    pub fn factored_len(&self) -> usize {
        self.units
            .iter()
            .flat_map(|u| &u.tensors)
            .map(|t| match t.dims {
                TensorDims::Matrix(r, c) => r + c,
                TensorDims::Vector(_) => 0,
            })
            .sum()
    }

    /// Parameter tensors.
    pub fn tensor_count(&self) -> usize {
        self.units.iter().map(|u| u.tensors.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;

    #[test]
    fn shards_are_equal_aligned_and_cover_every_parameter() {
        let shape = Preset::Tiny.shape();
        for world in [1, 2, 3, 4, 8] {
            let units = Units::new(&shape, world);
            for u in units.iter() {
                assert_eq!(u.padded_len % (SHARD_ALIGN * world), 0);
                assert!(u.padded_len >= u.len && u.padded_len - u.len < SHARD_ALIGN * world);
                assert_eq!(u.shard_range(world - 1).end, u.padded_len);
                let last = u.tensors.last().unwrap();
                assert_eq!(last.range().end, u.len);
            }
        }
    }
}
