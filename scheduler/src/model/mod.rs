//! The GPT-2 architecture zerotrain trains: its shape, its parameter layout in flat per-unit
//! buffers, and the activations one training step keeps. The trainer allocates exactly what this
//! module describes and the memory model counts exactly the same, so the two cannot drift apart.

mod activations;
mod params;

pub use activations::{
    ActivationTensor, Activations, Element, MATMUL_SCRATCH_F32, matmul_scratch_bytes,
};
pub use params::{ParamTensor, SHARD_ALIGN, TensorDims, TensorKind, Unit, UnitKind, Units};

use serde::{Deserialize, Serialize};

/// Hyper-parameters of a GPT-2 model (Hugging Face `GPT2Config` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptShape {
    /// V: vocabulary size (50257 for GPT-2's BPE; not padded).
    pub vocab_size: usize,
    /// maxT: number of learned positions.
    pub context_length: usize,
    /// L: transformer blocks.
    pub n_layer: usize,
    /// NH: attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// C: channels.
    pub n_embd: usize,
}

impl GptShape {
    /// Exact number of trainable parameters (LM head tied to the token embedding).
    pub fn parameter_count(&self) -> u64 {
        Units::new(self, 1).iter().map(|u| u.len as u64).sum()
    }

    /// Channels per attention head.
    pub fn head_size(&self) -> usize {
        self.n_embd / self.n_head
    }
}

/// Named model sizes, following the GPT-2 family (`gpt2-tiny` is a test-sized model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Preset {
    #[serde(rename = "gpt2-tiny")]
    Tiny,
    #[serde(rename = "gpt2-124M")]
    Gpt2Small,
    #[serde(rename = "gpt2-350M")]
    Gpt2Medium,
    #[serde(rename = "gpt2-774M")]
    Gpt2Large,
    #[serde(rename = "gpt2-1558M")]
    Gpt2Xl,
}

impl Preset {
    pub fn shape(self) -> GptShape {
        let gpt2 = |n_layer, n_head, n_embd| GptShape {
            vocab_size: 50257,
            context_length: 1024,
            n_layer,
            n_head,
            n_embd,
        };
        match self {
            Preset::Tiny => GptShape {
                vocab_size: 512,
                context_length: 128,
                n_layer: 2,
                n_head: 4,
                n_embd: 64,
            },
            Preset::Gpt2Small => gpt2(12, 12, 768),
            Preset::Gpt2Medium => gpt2(24, 16, 1024),
            Preset::Gpt2Large => gpt2(36, 20, 1280),
            Preset::Gpt2Xl => gpt2(48, 25, 1600),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_has_124_439_808_parameters_with_tied_embeddings() {
        assert_eq!(Preset::Gpt2Small.shape().parameter_count(), 124_439_808);
    }

    #[test]
    fn gpt2_family_parameter_counts_match_hugging_face() {
        // `sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(name).parameters())`
        assert_eq!(Preset::Gpt2Medium.shape().parameter_count(), 354_823_168);
        assert_eq!(Preset::Gpt2Large.shape().parameter_count(), 774_030_080);
        assert_eq!(Preset::Gpt2Xl.shape().parameter_count(), 1_557_611_200);
    }
}
