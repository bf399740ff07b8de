//! The Llama family (Llama 2/3.x, SmolLM2, TinyLlama, Qwen2/2.5, Qwen3, Mistral): RMSNorm,
//! rotary position embeddings, a SwiGLU MLP, grouped-query attention, optional q/k/v/o and MLP
//! biases, optional per-head q/k RMSNorm (Qwen3), tied or untied LM head. Its units and tensors
//! (Hugging Face names and shapes) and the activations one training step keeps, as
//! `params.rs` and `activations.rs` describe GPT-2's: the memory model counts exactly this, and
//! a Llama trainer is to allocate exactly this.
//!
//! B = micro-batch, T = sequence length, C = hidden size, H = attention heads, KV = key/value
//! heads, D = head dim, I = intermediate size, V = vocabulary, L = layers.

use super::activations::{Activations, Element, StepTensors, copies, loss_chunk_rows, tally};
use super::params::{TensorDims, TensorInit, UnitKind, Units};

/// Which Hugging Face `model_type` a Llama-family model is: they share the arithmetic below and
/// differ in which optional tensors they have (`LlamaShape` records those).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlamaType {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl LlamaType {
    pub fn name(self) -> &'static str {
        match self {
            LlamaType::Llama => "llama",
            LlamaType::Mistral => "mistral",
            LlamaType::Qwen2 => "qwen2",
            LlamaType::Qwen3 => "qwen3",
        }
    }
}

/// Llama 3's frequency-dependent RoPE scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Rotary position embedding, Hugging Face's rotate-half convention over the whole head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// `None`: `rope_type` `default`.
    pub llama3: Option<Llama3Rope>,
}

/// Hyper-parameters of a Llama-family model (Hugging Face `LlamaConfig` names), read from a
/// `config.json` (`model.config`) or a preset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaShape {
    pub model_type: LlamaType,
    pub vocab_size: usize,
    /// C.
    pub hidden_size: usize,
    /// I: width of the gate and up projections.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    /// H: query heads.
    pub num_attention_heads: usize,
    /// KV: key/value heads; divides H (grouped-query attention).
    pub num_key_value_heads: usize,
    /// D: channels per head (H·D need not be C: Qwen3).
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (`attention_bias`; Qwen2 always).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias` except for Qwen2).
    pub o_bias: bool,
    /// Biases on the gate, up and down projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The attention window some layer slides, if any; a job's sequence must fit in it.
    pub sliding_window: Option<usize>,
}

/// The parameter tensors of a Llama-family model, in Hugging Face state-dict order within a
/// unit. Linear weights are (out, in), as `nn.Linear` stores them (used as x·Wᵀ + b).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlamaTensor {
    /// (V, C) token embedding; also the LM head when tied.
    EmbedTokens,
    /// (H·D, C).
    QProj,
    QBias,
    /// (KV·D, C).
    KProj,
    KBias,
    /// (KV·D, C).
    VProj,
    VBias,
    /// (C, H·D).
    OProj,
    OBias,
    /// (D) RMSNorm of each query head (Qwen3).
    QNorm,
    /// (D) RMSNorm of each key head (Qwen3).
    KNorm,
    /// (I, C).
    GateProj,
    GateBias,
    /// (I, C).
    UpProj,
    UpBias,
    /// (C, I).
    DownProj,
    DownBias,
    /// (C) RMSNorm before attention.
    InputNorm,
    /// (C) RMSNorm before the MLP.
    PostAttentionNorm,
    /// (C) the final RMSNorm.
    FinalNorm,
    /// (V, C) the untied LM head.
    LmHead,
}

impl LlamaTensor {
    /// Every block tensor in state-dict order; a shape keeps those it has (`LlamaShape::block`).
    const BLOCK: [LlamaTensor; 18] = [
        Self::QProj,
        Self::QBias,
        Self::KProj,
        Self::KBias,
        Self::VProj,
        Self::VBias,
        Self::OProj,
        Self::OBias,
        Self::QNorm,
        Self::KNorm,
        Self::GateProj,
        Self::GateBias,
        Self::UpProj,
        Self::UpBias,
        Self::DownProj,
        Self::DownBias,
        Self::InputNorm,
        Self::PostAttentionNorm,
    ];

    pub fn dims(self, s: &LlamaShape) -> TensorDims {
        use TensorDims::{Matrix, Vector};
        let (c, i, v) = (s.hidden_size, s.intermediate_size, s.vocab_size);
        let (q, kv) = (s.q_width(), s.kv_width());
        match self {
            Self::EmbedTokens | Self::LmHead => Matrix(v, c),
            Self::QProj => Matrix(q, c),
            Self::QBias => Vector(q),
            Self::KProj | Self::VProj => Matrix(kv, c),
            Self::KBias | Self::VBias => Vector(kv),
            Self::OProj => Matrix(c, q),
            Self::QNorm | Self::KNorm => Vector(s.head_dim),
            Self::GateProj | Self::UpProj => Matrix(i, c),
            Self::GateBias | Self::UpBias => Vector(i),
            Self::DownProj => Matrix(c, i),
            Self::OBias
            | Self::DownBias
            | Self::InputNorm
            | Self::PostAttentionNorm
            | Self::FinalNorm => Vector(c),
        }
    }

    /// Weight decay applies to tensors of two dimensions (embeddings, linear weights), not to
    /// biases or norm weights, as for GPT-2.
    pub fn decayed(self, s: &LlamaShape) -> bool {
        matches!(self.dims(s), TensorDims::Matrix(..))
    }

    /// Hugging Face's initialisation (`initializer_range` 0.02): matrices N(0, 0.02), biases 0,
    /// norm weights 1.
    pub fn init(self, s: &LlamaShape) -> TensorInit {
        match self {
            Self::InputNorm
            | Self::PostAttentionNorm
            | Self::FinalNorm
            | Self::QNorm
            | Self::KNorm => TensorInit::Ones,
            k if !k.decayed(s) => TensorInit::Zeros,
            _ => TensorInit::Normal { std: 0.02 },
        }
    }

    /// The full Hugging Face `LlamaForCausalLM` (`Qwen2ForCausalLM`, …) state-dict name.
    pub fn hf_name(self, layer: Option<usize>) -> String {
        let local = match self {
            Self::EmbedTokens => return "model.embed_tokens.weight".into(),
            Self::FinalNorm => return "model.norm.weight".into(),
            Self::LmHead => return "lm_head.weight".into(),
            Self::QProj => "self_attn.q_proj.weight",
            Self::QBias => "self_attn.q_proj.bias",
            Self::KProj => "self_attn.k_proj.weight",
            Self::KBias => "self_attn.k_proj.bias",
            Self::VProj => "self_attn.v_proj.weight",
            Self::VBias => "self_attn.v_proj.bias",
            Self::OProj => "self_attn.o_proj.weight",
            Self::OBias => "self_attn.o_proj.bias",
            Self::QNorm => "self_attn.q_norm.weight",
            Self::KNorm => "self_attn.k_norm.weight",
            Self::GateProj => "mlp.gate_proj.weight",
            Self::GateBias => "mlp.gate_proj.bias",
            Self::UpProj => "mlp.up_proj.weight",
            Self::UpBias => "mlp.up_proj.bias",
            Self::DownProj => "mlp.down_proj.weight",
            Self::DownBias => "mlp.down_proj.bias",
            Self::InputNorm => "input_layernorm.weight",
            Self::PostAttentionNorm => "post_attention_layernorm.weight",
        };
        format!(
            "model.layers.{}.{local}",
            layer.expect("block tensors belong to a layer")
        )
    }
}

impl LlamaShape {
    /// H·D: width of the queries and of the attention output.
    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// KV·D: width of the keys and of the values.
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The tensors of one block, in state-dict order.
    pub fn block(&self) -> Vec<LlamaTensor> {
        use LlamaTensor as P;
        LlamaTensor::BLOCK
            .into_iter()
            .filter(|t| match t {
                P::QBias | P::KBias | P::VBias => self.qkv_bias,
                P::OBias => self.o_bias,
                P::GateBias | P::UpBias | P::DownBias => self.mlp_bias,
                P::QNorm | P::KNorm => self.qk_norm,
                _ => true,
            })
            .collect()
    }

    /// The units: the token embedding, each block, the final norm and, untied, the LM head.
    pub fn units(&self, world_size: usize) -> Units<LlamaTensor> {
        let with_dims =
            |kinds: &[LlamaTensor]| kinds.iter().map(|&k| (k, k.dims(self))).collect::<Vec<_>>();
        let block = with_dims(&self.block());
        let mut units = vec![(UnitKind::Embeddings, with_dims(&[LlamaTensor::EmbedTokens]))];
        units.extend((0..self.num_hidden_layers).map(|l| (UnitKind::Block(l), block.clone())));
        units.push((UnitKind::FinalNorm, with_dims(&[LlamaTensor::FinalNorm])));
        if !self.tie_word_embeddings {
            units.push((UnitKind::Head, with_dims(&[LlamaTensor::LmHead])));
        }
        Units::lay_out(units, self.tie_word_embeddings, world_size)
    }

    /// Exact number of trainable parameters (a tied head counted once), as transformers counts.
    pub fn parameter_count(&self) -> u64 {
        self.units(1).len() as u64
    }
}

/// Every tensor a Llama-family trainer allocates per micro-batch, named for its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlamaActivation {
    // Saved by each block's forward for its backward.
    /// (B, T, C) output of the RMSNorm before attention.
    Norm1,
    /// (B, T) fp32 reciprocal RMS of that norm.
    Norm1Rstd,
    /// (B, T, H·D) queries before their RMSNorm (Qwen3 only: what the q-norm's backward reads).
    QPreNorm,
    /// (B, T, H) fp32 reciprocal RMS of each query head (Qwen3).
    QNormRstd,
    /// (B, T, KV·D) keys before their RMSNorm (Qwen3).
    KPreNorm,
    /// (B, T, KV) fp32 reciprocal RMS of each key head (Qwen3).
    KNormRstd,
    /// (B, T, H·D) queries after RoPE, by query head.
    Q,
    /// (B, T, KV·D) keys after RoPE, by key/value head.
    K,
    /// (B, T, KV·D) values, by key/value head.
    V,
    /// (B, H, T) fp32 log-sum-exp of each query row's scores: all the attention backward
    /// needs of the probabilities, which it recomputes tile by tile.
    AttLse,
    /// (B, T, H·D) attention output before the output projection.
    AttY,
    /// (B, T, C) residual stream after attention.
    Res2,
    /// (B, T, C) output of the RMSNorm before the MLP.
    Norm2,
    Norm2Rstd,
    /// (B, T, I) gate projection (before SiLU).
    Gate,
    /// (B, T, I) up projection.
    Up,
    /// (B, T, I) SiLU(gate)·up: the down projection's input.
    Product,
    /// (B, T, C) block output: the next block's input. The only per-block tensor kept under
    /// activation checkpointing.
    Res3,
    // Saved once.
    /// (B, T, C) token embedding: block 0's input.
    Encoded,
    /// (T, D/2) fp32 RoPE cosines and sines of every position and frequency, shared by layers.
    RopeCos,
    RopeSin,
    /// (B, T, C) final RMSNorm output and its fp32 statistics.
    NormF,
    NormFRstd,
    // Backward scratch, reused by every block.
    /// (B, T, C) gradient of the residual stream.
    DResidual,
    /// (B, T, max(C, H·D)) gradient of a norm output or of the attention output.
    DChannels,
    /// (B, T, max(2I, (H + 2KV)·D)) gradients of gate and up, then of q, k and v; with q/k
    /// norms (B, T, max(2I, (2H + 2KV)·D)): also the gradient of the queries before their norm.
    DWide,
    /// (B, H, T) fp32 `rowsum(dout ∘ out)` of each query row, the attention backward's scratch.
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

impl LlamaActivation {
    /// Tensors saved per block (all of them unless activation checkpointing is on); a shape
    /// without q/k norms has no elements in theirs.
    pub const BLOCK: [LlamaActivation; 18] = [
        Self::Norm1,
        Self::Norm1Rstd,
        Self::QPreNorm,
        Self::QNormRstd,
        Self::KPreNorm,
        Self::KNormRstd,
        Self::Q,
        Self::K,
        Self::V,
        Self::AttLse,
        Self::AttY,
        Self::Res2,
        Self::Norm2,
        Self::Norm2Rstd,
        Self::Gate,
        Self::Up,
        Self::Product,
        Self::Res3,
    ];
    /// Tensors held once per step.
    pub const ONCE: [LlamaActivation; 13] = [
        Self::Encoded,
        Self::RopeCos,
        Self::RopeSin,
        Self::NormF,
        Self::NormFRstd,
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
    pub fn len(self, s: &LlamaShape, b: usize, t: usize) -> usize {
        let tokens = b * t;
        let (c, i) = (s.hidden_size, s.intermediate_size);
        let (q, kv) = (s.q_width(), s.kv_width());
        let qk_norm = usize::from(s.qk_norm);
        match self {
            Self::Norm1Rstd
            | Self::Norm2Rstd
            | Self::NormFRstd
            | Self::Losses
            | Self::Inputs
            | Self::Targets => tokens,
            Self::Norm1
            | Self::Res2
            | Self::Norm2
            | Self::Res3
            | Self::Encoded
            | Self::NormF
            | Self::DResidual => tokens * c,
            Self::QPreNorm => qk_norm * tokens * q,
            Self::KPreNorm => qk_norm * tokens * kv,
            Self::QNormRstd => qk_norm * tokens * s.num_attention_heads,
            Self::KNormRstd => qk_norm * tokens * s.num_key_value_heads,
            Self::Q | Self::AttY => tokens * q,
            Self::K | Self::V => tokens * kv,
            Self::AttLse | Self::AttDelta => tokens * s.num_attention_heads,
            Self::Gate | Self::Up | Self::Product => tokens * i,
            Self::RopeCos | Self::RopeSin => t * (s.head_dim / 2),
            Self::DChannels => tokens * c.max(q),
            Self::DWide => tokens * (2 * i).max(q + 2 * kv + qk_norm * q),
            Self::Logits => loss_chunk_rows(tokens, s.vocab_size) * s.vocab_size,
        }
    }

    pub fn element(self) -> Element {
        match self {
            Self::Norm1Rstd
            | Self::QNormRstd
            | Self::KNormRstd
            | Self::Norm2Rstd
            | Self::NormFRstd
            | Self::RopeCos
            | Self::RopeSin
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
    pub fn copies(self, s: &LlamaShape, checkpointing: bool) -> usize {
        copies(self, s, checkpointing)
    }
}

impl StepTensors for LlamaActivation {
    type Shape = LlamaShape;
    const PER_BLOCK: &'static [Self] = &Self::BLOCK;
    const PER_STEP: &'static [Self] = &Self::ONCE;
    const BLOCK_OUTPUT: Self = Self::Res3;
    const ATTENTION: [Self; 2] = [Self::AttLse, Self::AttDelta];
    const LOGITS: Self = Self::Logits;
    fn elements(self, s: &LlamaShape, b: usize, t: usize) -> usize {
        self.len(s, b, t)
    }
    fn stored_as(self) -> Element {
        self.element()
    }
    fn buffer(self) -> bool {
        self.is_buffer()
    }
    fn layers(s: &LlamaShape) -> usize {
        s.num_hidden_layers
    }
    fn widest(s: &LlamaShape) -> usize {
        s.intermediate_size
            .max(s.hidden_size)
            .max(s.q_width())
            .max(s.kv_width())
    }
}

impl Activations {
    /// A Llama-family model's bytes of activations and buffers for one rank (CPU matmul
    /// scratch included, as for GPT-2).
    pub fn llama(s: &LlamaShape, b: usize, t: usize, checkpointing: bool, compute: u64) -> Self {
        tally::<LlamaActivation>(s, b, t, checkpointing, compute)
    }
}

/// Named Llama-family models: the published configurations in `tests/reference/hf_configs/`,
/// and a test-sized one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlamaPreset {
    /// Test-sized: grouped-query attention (4 heads, 2 KV heads), an untied head, vocabulary
    /// 512, 2 layers, C 64.
    Tiny,
    SmolLm2_135M,
    Qwen25_05B,
    Qwen3_06B,
    TinyLlama11B,
    Llama32_1B,
    Llama2_7B,
    Llama31_8B,
}

impl LlamaPreset {
    pub const ALL: [LlamaPreset; 8] = [
        Self::Tiny,
        Self::SmolLm2_135M,
        Self::Qwen25_05B,
        Self::Qwen3_06B,
        Self::TinyLlama11B,
        Self::Llama32_1B,
        Self::Llama2_7B,
        Self::Llama31_8B,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Tiny => "llama-tiny",
            Self::SmolLm2_135M => "smollm2-135M",
            Self::Qwen25_05B => "qwen2.5-0.5B",
            Self::Qwen3_06B => "qwen3-0.6B",
            Self::TinyLlama11B => "tinyllama-1.1B",
            Self::Llama32_1B => "llama-3.2-1B",
            Self::Llama2_7B => "llama-2-7B",
            Self::Llama31_8B => "llama-3.1-8B",
        }
    }

    pub fn from_name(name: &str) -> Option<LlamaPreset> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    pub fn shape(self) -> LlamaShape {
        let base = LlamaShape {
            model_type: LlamaType::Llama,
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: 128,
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            rope: Rope {
                theta: 10000.0,
                llama3: None,
            },
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
        };
        let llama3 = |factor| {
            Some(Llama3Rope {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })
        };
        match self {
            Self::Tiny => LlamaShape {
                vocab_size: 512,
                hidden_size: 64,
                intermediate_size: 176,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 16,
                max_position_embeddings: 128,
                ..base
            },
            Self::SmolLm2_135M => LlamaShape {
                vocab_size: 49152,
                hidden_size: 576,
                intermediate_size: 1536,
                num_hidden_layers: 30,
                num_attention_heads: 9,
                num_key_value_heads: 3,
                head_dim: 64,
                max_position_embeddings: 8192,
                rope: Rope {
                    theta: 100000.0,
                    llama3: None,
                },
                tie_word_embeddings: true,
                ..base
            },
            Self::Qwen25_05B => LlamaShape {
                model_type: LlamaType::Qwen2,
                vocab_size: 151936,
                hidden_size: 896,
                intermediate_size: 4864,
                num_hidden_layers: 24,
                num_attention_heads: 14,
                num_key_value_heads: 2,
                head_dim: 64,
                max_position_embeddings: 32768,
                rms_norm_eps: 1e-6,
                rope: Rope {
                    theta: 1_000_000.0,
                    llama3: None,
                },
                tie_word_embeddings: true,
                qkv_bias: true,
                ..base
            },
            Self::Qwen3_06B => LlamaShape {
                model_type: LlamaType::Qwen3,
                vocab_size: 151936,
                hidden_size: 1024,
                intermediate_size: 3072,
                num_hidden_layers: 28,
                num_attention_heads: 16,
                num_key_value_heads: 8,
                head_dim: 128,
                max_position_embeddings: 40960,
                rms_norm_eps: 1e-6,
                rope: Rope {
                    theta: 1_000_000.0,
                    llama3: None,
                },
                tie_word_embeddings: true,
                qk_norm: true,
                ..base
            },
            Self::TinyLlama11B => LlamaShape {
                hidden_size: 2048,
                intermediate_size: 5632,
                num_hidden_layers: 22,
                num_key_value_heads: 4,
                head_dim: 64,
                max_position_embeddings: 2048,
                ..base
            },
            Self::Llama32_1B => LlamaShape {
                vocab_size: 128256,
                hidden_size: 2048,
                intermediate_size: 8192,
                num_hidden_layers: 16,
                num_key_value_heads: 8,
                head_dim: 64,
                max_position_embeddings: 131072,
                rope: Rope {
                    theta: 500000.0,
                    llama3: llama3(32.0),
                },
                tie_word_embeddings: true,
                ..base
            },
            Self::Llama2_7B => base,
            Self::Llama31_8B => LlamaShape {
                vocab_size: 128256,
                intermediate_size: 14336,
                num_key_value_heads: 8,
                max_position_embeddings: 131072,
                rope: Rope {
                    theta: 500000.0,
                    llama3: llama3(8.0),
                },
                ..base
            },
        }
    }
}
