//! The model families zerotrain describes exactly: for each, its shape, its parameter layout
//! in flat per-unit buffers (tensors with their Hugging Face names and shapes), and the
//! activations one training step keeps. GPT-2 (`GptShape`, `TensorKind`, `ActivationTensor`)
//! and the Llama family (`llama`: Llama, Mistral, Qwen2, Qwen3); LoRA adapters on either
//! (`lora`). The trainer allocates exactly
//! what this module describes and the memory model counts exactly the same, so the two cannot
//! drift apart; `ModelShape` is the one place a family is told from another.

mod activations;
mod gpt;
mod llama;
mod lora;
mod params;

pub use activations::{
    Activations, Element, LOSS_CHUNK_BYTES, StepScratch, StepTensors, loss_chunk_rows,
    matmul_depth, matmul_scratch_bytes, matmul_scratch_f32,
};
pub use gpt::{ActivationTensor, GptShape, Preset, TensorKind};
pub use llama::{
    Llama3Rope, LlamaActivation, LlamaPreset, LlamaShape, LlamaTensor, LlamaType, Rope,
};
pub use lora::{
    AdapterPart, AdapterTensor, Adapters, BaseStorage, LoraLayout, Nf4Part, Projection, Targets,
};
pub use params::{ParamTensor, SHARD_ALIGN, TensorDims, TensorInit, Unit, UnitKind, Units};

use serde::Serialize;

/// A model of a family zerotrain describes exactly: the family and its shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ModelShape {
    Gpt2(GptShape),
    Llama(LlamaShape),
}

/// A parameter tensor of any family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelTensor {
    Gpt2(TensorKind),
    Llama(LlamaTensor),
}

impl ModelTensor {
    /// The tensor's name in the family's Hugging Face state dict (GPT-2's without its
    /// `transformer.` prefix, as `TensorKind::hf_name`).
    pub fn hf_name(self, layer: Option<usize>) -> String {
        match self {
            ModelTensor::Gpt2(k) => k.hf_name(layer),
            ModelTensor::Llama(k) => k.hf_name(layer),
        }
    }
}

impl ModelTensor {
    /// The tensor's full name in a Hugging Face `*ForCausalLM` state dict (GPT-2's under
    /// `transformer.`), as an export writes it.
    pub fn state_dict_name(self, layer: Option<usize>) -> String {
        match self {
            ModelTensor::Gpt2(k) => format!("transformer.{}", k.hf_name(layer)),
            ModelTensor::Llama(k) => k.hf_name(layer),
        }
    }

    /// How the tensor starts when a job loads no weights.
    pub fn init(self, model: &ModelShape) -> TensorInit {
        match (self, model) {
            (ModelTensor::Gpt2(k), ModelShape::Gpt2(s)) => k.init(s),
            (ModelTensor::Llama(k), ModelShape::Llama(s)) => k.init(s),
            _ => panic!("{self:?} is not a tensor of {model:?}"),
        }
    }
}

/// What the estimate report says of a model: its family and shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    /// `gpt2` or `llama`.
    pub family: &'static str,
    /// The Hugging Face `model_type`: gpt2, llama, mistral, qwen2, qwen3.
    pub model_type: &'static str,
    pub layers: usize,
    pub hidden_size: usize,
    pub attention_heads: usize,
    pub key_value_heads: usize,
    pub head_dim: usize,
    /// Width of the MLP's hidden layer (GPT-2: 4C; Llama: each of gate and up).
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_positions: usize,
    pub tied_embeddings: bool,
}

impl ModelSummary {
    /// One line: `llama (qwen3): 28 layers, hidden 1024, 16 heads / 8 KV × 128, MLP 3072, …`.
    pub fn line(&self) -> String {
        format!(
            "{}{}: {} layers, hidden {}, {} heads / {} KV × {}, MLP {}, vocabulary {}, {} positions, {} head",
            self.family,
            if self.family == self.model_type {
                String::new()
            } else {
                format!(" ({})", self.model_type)
            },
            self.layers,
            self.hidden_size,
            self.attention_heads,
            self.key_value_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
            self.max_positions,
            if self.tied_embeddings {
                "tied"
            } else {
                "untied"
            },
        )
    }
}

impl ModelShape {
    /// The units laid out for `world_size` ranks.
    pub fn units(&self, world_size: usize) -> Units<ModelTensor> {
        match self {
            ModelShape::Gpt2(s) => Units::new(s, world_size).map_kinds(ModelTensor::Gpt2),
            ModelShape::Llama(s) => s.units(world_size).map_kinds(ModelTensor::Llama),
        }
    }

    /// Bytes of activations and buffers of one micro-batch of `b` × `t` tokens.
    pub fn activations(
        &self,
        b: usize,
        t: usize,
        checkpointing: bool,
        compute: u64,
    ) -> Activations {
        match self {
            ModelShape::Gpt2(s) => Activations::new(s, b, t, checkpointing, compute),
            ModelShape::Llama(s) => Activations::llama(s, b, t, checkpointing, compute),
        }
    }

    /// The deepest matmul of a micro-batch of `b` × `t` tokens ([`matmul_depth`]).
    pub fn matmul_depth(&self, b: usize, t: usize) -> usize {
        match self {
            ModelShape::Gpt2(s) => matmul_depth::<ActivationTensor>(s, b, t),
            ModelShape::Llama(s) => matmul_depth::<LlamaActivation>(s, b, t),
        }
    }

    /// What the attention and the loss hold of a micro-batch of `b` × `t` tokens.
    pub fn step_scratch(&self, b: usize, t: usize, checkpointing: bool) -> StepScratch {
        let v = self.vocab_size();
        match self {
            ModelShape::Gpt2(s) => StepScratch::of::<ActivationTensor>(s, (b, t, v), checkpointing),
            ModelShape::Llama(s) => StepScratch::of::<LlamaActivation>(s, (b, t, v), checkpointing),
        }
    }

    pub fn parameter_count(&self) -> u64 {
        match self {
            ModelShape::Gpt2(s) => s.parameter_count(),
            ModelShape::Llama(s) => s.parameter_count(),
        }
    }

    /// Whether a tensor named `name` in a Hugging Face weights file of this model is one that
    /// is not a parameter here and is skipped: GPT-2's causal-mask buffers, older Llama files'
    /// RoPE `inv_freq`, a tied LM head saved anyway.
    pub fn ignores_hf_tensor(&self, name: &str) -> bool {
        let local = name.strip_prefix("transformer.").unwrap_or(name);
        match self {
            ModelShape::Gpt2(_) => {
                local.ends_with("attn.bias")
                    || local.ends_with("attn.masked_bias")
                    || name == "lm_head.weight"
            }
            ModelShape::Llama(s) => {
                name.ends_with("rotary_emb.inv_freq")
                    || (s.tie_word_embeddings && name == "lm_head.weight")
            }
        }
    }

    /// The most a Hugging Face weights file of this model carries beyond its parameters, as
    /// (values, tensors): the tensors [`ModelShape::ignores_hf_tensor`] skips.
    pub fn hf_extra(&self) -> (u64, u64) {
        let s = self.summary();
        let [v, t, l, c, d] = [
            s.vocab_size,
            s.max_positions,
            s.layers,
            s.hidden_size,
            s.head_dim,
        ]
        .map(|n| n as u64);
        match self {
            ModelShape::Gpt2(_) => (v * c + l * (t * t + 1), 1 + 2 * l),
            ModelShape::Llama(_) => (v * c + l * (d / 2), 1 + l),
        }
    }

    /// The longest sequence the model takes.
    pub fn max_positions(&self) -> usize {
        self.summary().max_positions
    }

    pub fn vocab_size(&self) -> usize {
        self.summary().vocab_size
    }

    /// The attention window some layer slides, if any: sequences must fit in it.
    pub fn sliding_window(&self) -> Option<usize> {
        match self {
            ModelShape::Gpt2(_) => None,
            ModelShape::Llama(s) => s.sliding_window,
        }
    }

    pub fn summary(&self) -> ModelSummary {
        match *self {
            ModelShape::Gpt2(s) => ModelSummary {
                family: "gpt2",
                model_type: "gpt2",
                layers: s.n_layer,
                hidden_size: s.n_embd,
                attention_heads: s.n_head,
                key_value_heads: s.n_head,
                head_dim: s.head_size(),
                intermediate_size: 4 * s.n_embd,
                vocab_size: s.vocab_size,
                max_positions: s.context_length,
                tied_embeddings: true,
            },
            ModelShape::Llama(s) => ModelSummary {
                family: "llama",
                model_type: s.model_type.name(),
                layers: s.num_hidden_layers,
                hidden_size: s.hidden_size,
                attention_heads: s.num_attention_heads,
                key_value_heads: s.num_key_value_heads,
                head_dim: s.head_dim,
                intermediate_size: s.intermediate_size,
                vocab_size: s.vocab_size,
                max_positions: s.max_position_embeddings,
                tied_embeddings: s.tie_word_embeddings,
            },
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
