//! GPT-2: its shape and presets, its parameter tensors in Hugging Face state-dict order
//! (`TensorKind`) and the tensors one training step keeps (`ActivationTensor`), beside the
//! Llama family's (`llama`). The layout and counting they feed are the families' shared
//! `params` and `activations`.

use serde::{Deserialize, Serialize};

use super::activations::{Element, StepTensors, copies, loss_chunk_rows};
use super::params::{TensorDims, TensorInit, UnitKind, Units};

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
    pub const ALL: [Preset; 5] = [
        Preset::Tiny,
        Preset::Gpt2Small,
        Preset::Gpt2Medium,
        Preset::Gpt2Large,
        Preset::Gpt2Xl,
    ];

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
/// The kinds of parameter tensors of GPT-2, in Hugging Face state-dict order within a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// (V, C) token embedding, also the LM head (tied).
    Wte,
    /// (maxT, C) position embedding.
    Wpe,
    Ln1Weight,
    Ln1Bias,
    /// (C, 3C) query/key/value projection, used as x·W + b.
    AttnWeight,
    AttnBias,
    /// (C, C) attention output projection.
    AttnProjWeight,
    AttnProjBias,
    Ln2Weight,
    Ln2Bias,
    /// (C, 4C) MLP expansion.
    FcWeight,
    FcBias,
    /// (4C, C) MLP contraction.
    FcProjWeight,
    FcProjBias,
    LnfWeight,
    LnfBias,
}

impl TensorKind {
    pub const EMBEDDINGS: [TensorKind; 2] = [TensorKind::Wte, TensorKind::Wpe];
    pub const BLOCK: [TensorKind; 12] = [
        TensorKind::Ln1Weight,
        TensorKind::Ln1Bias,
        TensorKind::AttnWeight,
        TensorKind::AttnBias,
        TensorKind::AttnProjWeight,
        TensorKind::AttnProjBias,
        TensorKind::Ln2Weight,
        TensorKind::Ln2Bias,
        TensorKind::FcWeight,
        TensorKind::FcBias,
        TensorKind::FcProjWeight,
        TensorKind::FcProjBias,
    ];
    pub const FINAL_NORM: [TensorKind; 2] = [TensorKind::LnfWeight, TensorKind::LnfBias];

    pub fn dims(self, s: &GptShape) -> TensorDims {
        let c = s.n_embd;
        match self {
            TensorKind::Wte => TensorDims::Matrix(s.vocab_size, c),
            TensorKind::Wpe => TensorDims::Matrix(s.context_length, c),
            TensorKind::AttnWeight => TensorDims::Matrix(c, 3 * c),
            TensorKind::AttnBias => TensorDims::Vector(3 * c),
            TensorKind::AttnProjWeight => TensorDims::Matrix(c, c),
            TensorKind::FcWeight => TensorDims::Matrix(c, 4 * c),
            TensorKind::FcBias => TensorDims::Vector(4 * c),
            TensorKind::FcProjWeight => TensorDims::Matrix(4 * c, c),
            TensorKind::Ln1Weight
            | TensorKind::Ln1Bias
            | TensorKind::AttnProjBias
            | TensorKind::Ln2Weight
            | TensorKind::Ln2Bias
            | TensorKind::FcProjBias
            | TensorKind::LnfWeight
            | TensorKind::LnfBias => TensorDims::Vector(c),
        }
    }

    /// Weight decay applies to matrices (embeddings and linear weights), not to biases or
    /// LayerNorm parameters: the nanoGPT / llm.c rule.
    pub fn decayed(self, s: &GptShape) -> bool {
        matches!(self.dims(s), TensorDims::Matrix(..))
    }

    /// GPT-2's initialisation: weights N(0, 0.02), the residual projections N(0, 0.02/√(2L)),
    /// biases 0, LayerNorm weights 1.
    pub fn init(self, s: &GptShape) -> TensorInit {
        let std = 0.02;
        match self {
            TensorKind::Ln1Weight | TensorKind::Ln2Weight | TensorKind::LnfWeight => {
                TensorInit::Ones
            }
            k if !k.decayed(s) => TensorInit::Zeros,
            TensorKind::AttnProjWeight | TensorKind::FcProjWeight => TensorInit::Normal {
                std: std / (2.0 * s.n_layer as f64).sqrt(),
            },
            _ => TensorInit::Normal { std },
        }
    }

    /// The Hugging Face `GPT2LMHeadModel` state-dict name, without the `transformer.` prefix.
    pub fn hf_name(self, layer: Option<usize>) -> String {
        let local = match self {
            TensorKind::Wte => return "wte.weight".into(),
            TensorKind::Wpe => return "wpe.weight".into(),
            TensorKind::LnfWeight => return "ln_f.weight".into(),
            TensorKind::LnfBias => return "ln_f.bias".into(),
            TensorKind::Ln1Weight => "ln_1.weight",
            TensorKind::Ln1Bias => "ln_1.bias",
            TensorKind::AttnWeight => "attn.c_attn.weight",
            TensorKind::AttnBias => "attn.c_attn.bias",
            TensorKind::AttnProjWeight => "attn.c_proj.weight",
            TensorKind::AttnProjBias => "attn.c_proj.bias",
            TensorKind::Ln2Weight => "ln_2.weight",
            TensorKind::Ln2Bias => "ln_2.bias",
            TensorKind::FcWeight => "mlp.c_fc.weight",
            TensorKind::FcBias => "mlp.c_fc.bias",
            TensorKind::FcProjWeight => "mlp.c_proj.weight",
            TensorKind::FcProjBias => "mlp.c_proj.bias",
        };
        format!(
            "h.{}.{local}",
            layer.expect("block tensors belong to a layer")
        )
    }
}

impl Units {
    pub fn new(shape: &GptShape, world_size: usize) -> Units {
        let with_dims = |kinds: &[TensorKind]| kinds.iter().map(|&k| (k, k.dims(shape))).collect();
        let mut units = vec![(UnitKind::Embeddings, with_dims(&TensorKind::EMBEDDINGS))];
        units.extend(
            (0..shape.n_layer).map(|l| (UnitKind::Block(l), with_dims(&TensorKind::BLOCK))),
        );
        units.push((UnitKind::FinalNorm, with_dims(&TensorKind::FINAL_NORM)));
        Units::lay_out(units, true, world_size)
    }
}

/// Every tensor the trainer allocates per micro-batch, named for its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivationTensor {
    // Saved by each block's forward for its backward.
    /// (B, T, C) first LayerNorm output.
    Ln1,
    /// (B, T) fp32 statistics of the first LayerNorm.
    Ln1Mean,
    Ln1Rstd,
    /// (B, T, 3C) query, key, value.
    Qkv,
    /// (B, NH, T) fp32 log-sum-exp of each query row's scores: all the attention backward
    /// needs of the probabilities, which it recomputes tile by tile.
    AttLse,
    /// (B, T, C) attention output before its projection.
    AttY,
    /// (B, T, C) residual stream after attention.
    Res2,
    /// (B, T, C) second LayerNorm output.
    Ln2,
    Ln2Mean,
    Ln2Rstd,
    /// (B, T, 4C) MLP pre-activation.
    Fch,
    /// (B, T, 4C) MLP GELU output.
    FchGelu,
    /// (B, T, C) block output: the next block's input. The only per-block tensor kept under
    /// activation checkpointing.
    Res3,
    // Saved once.
    /// (B, T, C) token + position embedding: block 0's input.
    Encoded,
    /// (B, T, C) final LayerNorm output and its fp32 statistics.
    Lnf,
    LnfMean,
    LnfRstd,
    // Backward scratch, reused by every block.
    /// (B, T, C) gradient of the residual stream.
    DResidual,
    /// (B, T, C) gradient of a LayerNorm output or of the attention output.
    DChannels,
    /// (B, T, 4C) gradient of the MLP hidden layer, then of qkv.
    DWide,
    /// (B, NH, T) fp32 `rowsum(dout ∘ out)` of each query row, the attention backward's scratch.
    AttDelta,
    // Buffers.
    /// (rows, V) fp32 logits of one chunk of [`loss_chunk_rows`] tokens, overwritten in place
    /// by their gradient.
    Logits,
    /// (B, T) fp32 per-token losses.
    Losses,
    /// (B, T) input token ids.
    Inputs,
    /// (B, T) target token ids.
    Targets,
}

impl ActivationTensor {
    /// Tensors saved per block (all of them unless activation checkpointing is on).
    pub const BLOCK: [ActivationTensor; 13] = [
        Self::Ln1,
        Self::Ln1Mean,
        Self::Ln1Rstd,
        Self::Qkv,
        Self::AttLse,
        Self::AttY,
        Self::Res2,
        Self::Ln2,
        Self::Ln2Mean,
        Self::Ln2Rstd,
        Self::Fch,
        Self::FchGelu,
        Self::Res3,
    ];
    /// Tensors held once per step.
    pub const ONCE: [ActivationTensor; 12] = [
        Self::Encoded,
        Self::Lnf,
        Self::LnfMean,
        Self::LnfRstd,
        Self::DResidual,
        Self::DChannels,
        Self::DWide,
        Self::AttDelta,
        Self::Logits,
        Self::Losses,
        Self::Inputs,
        Self::Targets,
    ];

    /// Number of elements for a micro-batch of `b` sequences of `t` tokens.
    pub fn len(self, s: &GptShape, b: usize, t: usize) -> usize {
        let (c, tokens) = (s.n_embd, b * t);
        match self {
            Self::Ln1Mean
            | Self::Ln1Rstd
            | Self::Ln2Mean
            | Self::Ln2Rstd
            | Self::LnfMean
            | Self::LnfRstd
            | Self::Losses
            | Self::Inputs
            | Self::Targets => tokens,
            Self::AttLse | Self::AttDelta => tokens * s.n_head,
            Self::Ln1
            | Self::AttY
            | Self::Res2
            | Self::Ln2
            | Self::Res3
            | Self::Encoded
            | Self::Lnf
            | Self::DResidual
            | Self::DChannels => tokens * c,
            Self::Qkv => tokens * 3 * c,
            Self::Fch | Self::FchGelu | Self::DWide => tokens * 4 * c,
            Self::Logits => loss_chunk_rows(tokens, s.vocab_size) * s.vocab_size,
        }
    }

    pub fn element(self) -> Element {
        match self {
            Self::Ln1Mean
            | Self::Ln1Rstd
            | Self::Ln2Mean
            | Self::Ln2Rstd
            | Self::LnfMean
            | Self::LnfRstd
            | Self::AttLse
            | Self::AttDelta
            | Self::Logits
            | Self::Losses => Element::F32,
            Self::Inputs | Self::Targets => Element::U32,
            _ => Element::Compute,
        }
    }

    /// Logits and token ids count as buffers; everything else as activations.
    pub fn is_buffer(self) -> bool {
        matches!(
            self,
            Self::Logits | Self::Losses | Self::Inputs | Self::Targets
        )
    }

    /// How many copies a step holds: per-block tensors once per layer, or, under activation
    /// checkpointing, block outputs once per layer plus one block's worth to recompute into.
    pub fn copies(self, s: &GptShape, checkpointing: bool) -> usize {
        copies(self, s, checkpointing)
    }
}

impl StepTensors for ActivationTensor {
    type Shape = GptShape;
    const PER_BLOCK: &'static [Self] = &Self::BLOCK;
    const PER_STEP: &'static [Self] = &Self::ONCE;
    const BLOCK_OUTPUT: Self = Self::Res3;
    const ATTENTION: [Self; 2] = [Self::AttLse, Self::AttDelta];
    const LOGITS: Self = Self::Logits;
    fn elements(self, s: &GptShape, b: usize, t: usize) -> usize {
        self.len(s, b, t)
    }
    fn stored_as(self) -> Element {
        self.element()
    }
    fn buffer(self) -> bool {
        self.is_buffer()
    }
    fn layers(s: &GptShape) -> usize {
        s.n_layer
    }
    fn widest(s: &GptShape) -> usize {
        4 * s.n_embd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_names_follow_gpt2_state_dict() {
        assert_eq!(
            TensorKind::AttnWeight.hf_name(Some(3)),
            "h.3.attn.c_attn.weight"
        );
        assert_eq!(TensorKind::Wte.hf_name(None), "wte.weight");
        assert_eq!(TensorKind::LnfBias.hf_name(None), "ln_f.bias");
    }

    #[test]
    fn only_matrices_are_decayed() {
        let s = Preset::Tiny.shape();
        assert!(TensorKind::Wte.decayed(&s) && TensorKind::FcProjWeight.decayed(&s));
        assert!(!TensorKind::AttnBias.decayed(&s) && !TensorKind::Ln1Weight.decayed(&s));
    }
}
