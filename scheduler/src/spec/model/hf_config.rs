//! `model.config`: a Hugging Face `config.json` object as published, for `model_type` `gpt2`,
//! `llama`, `mistral`, `qwen2` and `qwen3`, in transformers 4's form or transformers 5's
//! (`rope_parameters`, `layer_types`, `dtype`). The fields that set the arithmetic are read;
//! the others (`architectures`, `torch_dtype`, token ids, dropout, …) are accepted and ignored;
//! a value zerotrain cannot compute with is a mistake at its field. Every mistake is recorded.

use serde_json::{Map, Value};

use crate::error::Problems;
use crate::model::{GptShape, Llama3Rope, LlamaShape, LlamaType, ModelShape, Rope};

const PREFIX: &str = "model.config";

/// The `model_type`s read, for messages.
pub const MODEL_TYPES: &str = "llama, mistral, qwen2, qwen3, gpt2";

/// Mistral's window when `config.json` does not name one (`MistralConfig`'s default).
const MISTRAL_DEFAULT_WINDOW: usize = 4096;

/// The shape `config` describes, or `None` after recording its mistakes.
pub(crate) fn read(config: &Map<String, Value>, p: &mut Problems) -> Option<ModelShape> {
    let before = p.count();
    let mut r = Reader { map: config, p };
    let shape = match r.string("model_type") {
        None => {
            r.fail("model_type", format!("missing: one of {MODEL_TYPES}"));
            None
        }
        Some("gpt2") => gpt2(&mut r).map(ModelShape::Gpt2),
        Some(t) => match llama_type(t) {
            Some(t) => llama(&mut r, t).map(ModelShape::Llama),
            None => {
                r.fail(
                    "model_type",
                    format!("{t:?} is not a model zerotrain knows ({MODEL_TYPES})"),
                );
                None
            }
        },
    };
    shape.filter(|_| p.count() == before)
}

fn llama_type(name: &str) -> Option<LlamaType> {
    [
        LlamaType::Llama,
        LlamaType::Mistral,
        LlamaType::Qwen2,
        LlamaType::Qwen3,
    ]
    .into_iter()
    .find(|t| t.name() == name)
}

/// Reads fields of one object, recording mistakes under `model.config.`.
struct Reader<'a> {
    map: &'a Map<String, Value>,
    p: &'a mut Problems,
}

impl<'a> Reader<'a> {
    fn fail(&mut self, key: &str, reason: String) {
        self.p.ensure(false, &format!("{PREFIX}.{key}"), || reason);
    }

    /// The value of `key`, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn string(&mut self, key: &str) -> Option<&'a str> {
        let v = self.get(key)?;
        let s = v.as_str();
        if s.is_none() {
            self.fail(key, format!("must be a string, not {v}"));
        }
        s
    }

    /// A whole number in 1..=max; `default` when absent (`None`: required).
    fn count(&mut self, key: &str, default: Option<usize>, max: usize) -> Option<usize> {
        let Some(v) = self.get(key) else {
            if default.is_none() {
                self.fail(key, "missing".into());
            }
            return default;
        };
        match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if (1..=max).contains(&n) => Some(n),
            Some(0) => {
                self.fail(key, "must be positive".into());
                None
            }
            Some(n) => {
                self.fail(
                    key,
                    format!("{n} is larger than zerotrain supports ({max})"),
                );
                None
            }
            None => {
                self.fail(key, format!("must be a positive whole number, not {v}"));
                None
            }
        }
    }

    /// As `count`, but never missing: `default` (perhaps `None`) when absent.
    fn optional(&mut self, key: &str, default: Option<usize>, max: usize) -> Option<usize> {
        match self.get(key) {
            Some(_) => self.count(key, None, max),
            None => default,
        }
    }

    /// A finite positive number, or `default` when absent.
    fn positive(&mut self, key: &str, default: f64) -> Option<f64> {
        let Some(v) = self.get(key) else {
            return Some(default);
        };
        match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Some(x),
            _ => {
                self.fail(key, format!("must be a positive number, not {v}"));
                None
            }
        }
    }

    fn flag(&mut self, key: &str, default: bool) -> bool {
        match self.get(key) {
            None => default,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                self.fail(key, format!("must be true or false, not {v}"));
                default
            }
        }
    }

    /// Refuses `key` unless it is absent or `ok` holds for it.
    fn only(&mut self, key: &str, ok: impl Fn(&Value) -> bool, what: &str) {
        if let Some(v) = self.get(key).filter(|v| !ok(v)) {
            self.fail(
                key,
                format!("{v} is not supported: zerotrain computes {what}"),
            );
        }
    }
}

/// The largest vocabulary, width, layer count and context zerotrain lays out.
const MAX_WIDTH: usize = 1 << 20;
const MAX_LAYERS: usize = 4096;
const MAX_POSITIONS: usize = 1 << 24;

fn gpt2(r: &mut Reader) -> Option<GptShape> {
    let vocab_size = r.count("vocab_size", None, MAX_WIDTH);
    let n_ctx = r.count("n_ctx", Some(1024), MAX_WIDTH);
    let context_length = r.count("n_positions", n_ctx, MAX_WIDTH);
    let n_layer = r.count("n_layer", None, MAX_LAYERS);
    let n_head = r.count("n_head", None, MAX_LAYERS);
    let n_embd = r.count("n_embd", None, MAX_WIDTH);
    r.only(
        "activation_function",
        |v| matches!(v.as_str(), Some("gelu_new" | "gelu_pytorch_tanh")),
        "GELU with the tanh approximation (gelu_new)",
    );
    r.only(
        "layer_norm_epsilon",
        |v| v.as_f64() == Some(1e-5),
        "LayerNorm with epsilon 1e-5",
    );
    r.only(
        "tie_word_embeddings",
        |v| v.as_bool() == Some(true),
        "GPT-2 with its LM head tied to the token embedding",
    );
    for key in ["scale_attn_by_inverse_layer_idx", "add_cross_attention"] {
        r.only(
            key,
            |v| v.as_bool() == Some(false),
            "GPT-2's plain attention",
        );
    }
    let shape = GptShape {
        vocab_size: vocab_size?,
        context_length: context_length?,
        n_layer: n_layer?,
        n_head: n_head?,
        n_embd: n_embd?,
    };
    r.only(
        "n_inner",
        |v| v.as_u64() == Some(4 * shape.n_embd as u64),
        "an MLP of 4·n_embd",
    );
    Some(shape)
}

fn llama(r: &mut Reader, model_type: LlamaType) -> Option<LlamaShape> {
    let before = r.p.count();
    let vocab_size = r.count("vocab_size", None, MAX_WIDTH);
    let hidden_size = r.count("hidden_size", None, MAX_WIDTH);
    let intermediate_size = r.count("intermediate_size", None, 4 * MAX_WIDTH);
    let layers = r.count("num_hidden_layers", None, MAX_LAYERS);
    let heads = r.count("num_attention_heads", None, MAX_LAYERS);
    // Defaults that derive from another field are absent when that one is in error (and
    // recorded there), so the derived field is not reported missing too.
    let kv_heads = r.optional("num_key_value_heads", heads, MAX_LAYERS);
    // transformers' default head_dim is hidden/heads, except Qwen3Config's, which is 128.
    let default_head_dim = match model_type {
        LlamaType::Qwen3 => Some(128),
        _ => hidden_size.zip(heads).map(|(c, h)| (c / h).max(1)),
    };
    let explicit_head_dim = r.get("head_dim").is_some();
    let head_dim = r.optional("head_dim", default_head_dim, 1 << 16);
    let positions = r.count("max_position_embeddings", None, MAX_POSITIONS);
    let rms_norm_eps = r.positive("rms_norm_eps", 1e-6);
    let tie = r.flag("tie_word_embeddings", false);
    let attention_bias = r.flag("attention_bias", false);
    let mlp_bias = r.flag("mlp_bias", false);
    r.only(
        "hidden_act",
        |v| v.as_str() == Some("silu"),
        "SwiGLU (hidden_act \"silu\")",
    );
    r.only(
        "pretraining_tp",
        |v| v.as_u64() == Some(1),
        "the exact linear layers (pretraining_tp 1)",
    );
    r.only(
        "partial_rotary_factor",
        |v| v.as_f64() == Some(1.0),
        "RoPE over the whole head (partial_rotary_factor 1)",
    );
    let rope = rope(r);
    let sliding_window = sliding_window(r, model_type);
    if r.p.count() > before {
        return None;
    }
    let (c, h, kv, d) = (hidden_size?, heads?, kv_heads?, head_dim?);
    r.p.ensure(
        h.is_multiple_of(kv),
        &format!("{PREFIX}.num_key_value_heads"),
        || format!("{kv} does not divide num_attention_heads {h}"),
    );
    if !explicit_head_dim && model_type != LlamaType::Qwen3 {
        r.p.ensure(
            c.is_multiple_of(h),
            &format!("{PREFIX}.hidden_size"),
            || format!("{c} is not divisible by num_attention_heads {h}; give head_dim"),
        );
    }
    r.p.ensure(d.is_multiple_of(2), &format!("{PREFIX}.head_dim"), || {
        format!("{d} must be even: RoPE rotates pairs of channels")
    });
    let shape = LlamaShape {
        model_type,
        vocab_size: vocab_size?,
        hidden_size: c,
        intermediate_size: intermediate_size?,
        num_hidden_layers: layers?,
        num_attention_heads: h,
        num_key_value_heads: kv,
        head_dim: d,
        max_position_embeddings: positions?,
        rms_norm_eps: rms_norm_eps?,
        rope: rope?,
        tie_word_embeddings: tie,
        // Qwen2 has q/k/v biases whatever attention_bias says, and no o_proj bias; Mistral's
        // projections have no biases; Llama and Qwen3 follow attention_bias for all four.
        qkv_bias: match model_type {
            LlamaType::Qwen2 => true,
            LlamaType::Mistral => false,
            LlamaType::Llama | LlamaType::Qwen3 => attention_bias,
        },
        o_bias: matches!(model_type, LlamaType::Llama | LlamaType::Qwen3) && attention_bias,
        // Only LlamaMLP reads mlp_bias.
        mlp_bias: model_type == LlamaType::Llama && mlp_bias,
        qk_norm: model_type == LlamaType::Qwen3,
        sliding_window,
    };
    // Closed form of the parameter count (the layout is not built before it is known to be
    // small enough to count in bytes).
    let [v, c, i, l, q, kv] = [
        shape.vocab_size,
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_hidden_layers,
        shape.q_width(),
        shape.kv_width(),
    ]
    .map(|x| x as f64);
    let params = v * c * if tie { 1.0 } else { 2.0 } + l * (2.0 * c * (q + kv) + 3.0 * c * i);
    r.p.ensure(params <= 1e15, PREFIX, || {
        format!("this model has about {params:.3e} parameters, which exceeds 1e15")
    });
    (r.p.count() == before).then_some(shape)
}

/// RoPE as `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4).
fn rope(r: &mut Reader) -> Option<Rope> {
    let (params, field) = match r.get("rope_parameters") {
        Some(v) => (Some(v), "rope_parameters"),
        None => (r.get("rope_scaling"), "rope_scaling"),
    };
    let theta_default = 10000.0;
    let Some(params) = params else {
        let theta = r.positive("rope_theta", theta_default)?;
        return Some(Rope {
            theta,
            llama3: None,
        });
    };
    let Some(map) = params.as_object() else {
        r.fail(field, format!("must be an object or null, not {params}"));
        return None;
    };
    let theta = if field == "rope_parameters" {
        Reader { map, p: r.p }.positive("rope_theta", theta_default)
    } else {
        r.positive("rope_theta", theta_default)
    };
    let mut inner = Reader { map, p: r.p };
    let kind = inner
        .string("rope_type")
        .or_else(|| inner.string("type"))
        .unwrap_or("default");
    let llama3 = match kind {
        "default" => None,
        "llama3" => {
            let mut number = |key: &str| {
                let v = inner.positive(key, f64::NAN);
                if v.is_some_and(f64::is_nan) {
                    inner
                        .p
                        .ensure(false, &format!("{PREFIX}.{field}.{key}"), || {
                            "missing: rope_type llama3 needs it".into()
                        });
                    return None;
                }
                v
            };
            let factor = number("factor");
            let low_freq_factor = number("low_freq_factor");
            let high_freq_factor = number("high_freq_factor");
            let original = number("original_max_position_embeddings");
            Some(Llama3Rope {
                factor: factor?,
                low_freq_factor: low_freq_factor?,
                high_freq_factor: high_freq_factor?,
                original_max_position_embeddings: original? as usize,
            })
        }
        other => {
            let key = if map.contains_key("rope_type") {
                "rope_type"
            } else {
                "type"
            };
            inner.p.ensure(false, &format!("{PREFIX}.{field}.{key}"), || {
                format!("{other:?} is not supported: zerotrain computes RoPE of rope_type \"default\" or \"llama3\"")
            });
            return None;
        }
    };
    if let Some(f) = map
        .get("partial_rotary_factor")
        .filter(|v| v.as_f64() != Some(1.0))
    {
        inner.p.ensure(
            false,
            &format!("{PREFIX}.{field}.partial_rotary_factor"),
            || format!("{f} is not supported: zerotrain computes RoPE over the whole head"),
        );
        return None;
    }
    Some(Rope {
        theta: theta?,
        llama3,
    })
}

/// The window some layer attends within, if any: Mistral's `sliding_window` (4096 when not
/// given); Qwen's when `use_sliding_window` is true or `layer_types` names a sliding layer.
fn sliding_window(r: &mut Reader, model_type: LlamaType) -> Option<usize> {
    let mut sliding = false;
    if let Some(types) = r.get("layer_types") {
        match types.as_array() {
            Some(types) => {
                for t in types {
                    match t.as_str() {
                        Some("full_attention") => {}
                        Some("sliding_attention") => sliding = true,
                        _ => r.fail(
                            "layer_types",
                            format!("{t} is not supported: zerotrain computes full_attention layers (or sliding_attention within a window no shorter than the sequence)"),
                        ),
                    }
                }
            }
            None => r.fail("layer_types", format!("must be a list, not {types}")),
        }
    }
    let window = match model_type {
        LlamaType::Mistral => match r.map.get("sliding_window") {
            None => return Some(MISTRAL_DEFAULT_WINDOW),
            Some(_) => r.count("sliding_window", Some(usize::MAX), usize::MAX),
        },
        LlamaType::Qwen2 | LlamaType::Qwen3 => {
            if !(r.flag("use_sliding_window", false) || sliding) {
                return None;
            }
            r.count("sliding_window", Some(usize::MAX), usize::MAX)
        }
        LlamaType::Llama => return None,
    };
    window.filter(|&w| w != usize::MAX)
}

/// The `config.json` transformers writes for `model` (fp32 weights): what an export carries
/// when the job gave no config of its own.
pub(crate) fn write(model: &ModelShape) -> Map<String, Value> {
    let config = match model {
        ModelShape::Gpt2(s) => serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": s.vocab_size,
            "n_positions": s.context_length,
            "n_ctx": s.context_length,
            "n_embd": s.n_embd,
            "n_layer": s.n_layer,
            "n_head": s.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "tie_word_embeddings": true,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "torch_dtype": "float32"
        }),
        ModelShape::Llama(s) => {
            let architecture = match s.model_type {
                LlamaType::Llama => "LlamaForCausalLM",
                LlamaType::Mistral => "MistralForCausalLM",
                LlamaType::Qwen2 => "Qwen2ForCausalLM",
                LlamaType::Qwen3 => "Qwen3ForCausalLM",
            };
            let rope_scaling = s.rope.llama3.map(|l| {
                serde_json::json!({
                    "rope_type": "llama3",
                    "factor": l.factor,
                    "low_freq_factor": l.low_freq_factor,
                    "high_freq_factor": l.high_freq_factor,
                    "original_max_position_embeddings": l.original_max_position_embeddings,
                })
            });
            let mut c = serde_json::json!({
                "architectures": [architecture],
                "model_type": s.model_type.name(),
                "vocab_size": s.vocab_size,
                "hidden_size": s.hidden_size,
                "intermediate_size": s.intermediate_size,
                "num_hidden_layers": s.num_hidden_layers,
                "num_attention_heads": s.num_attention_heads,
                "num_key_value_heads": s.num_key_value_heads,
                "head_dim": s.head_dim,
                "max_position_embeddings": s.max_position_embeddings,
                "rms_norm_eps": s.rms_norm_eps,
                "rope_theta": s.rope.theta,
                "rope_scaling": rope_scaling,
                "hidden_act": "silu",
                "tie_word_embeddings": s.tie_word_embeddings,
                "initializer_range": 0.02,
                "torch_dtype": "float32"
            });
            let m = c.as_object_mut().expect("an object");
            match s.model_type {
                LlamaType::Llama | LlamaType::Mistral => {
                    m.insert("attention_bias".into(), s.o_bias.into());
                    m.insert("mlp_bias".into(), s.mlp_bias.into());
                }
                LlamaType::Qwen3 => {
                    m.insert("attention_bias".into(), s.qkv_bias.into());
                }
                LlamaType::Qwen2 => {}
            }
            if matches!(
                s.model_type,
                LlamaType::Mistral | LlamaType::Qwen2 | LlamaType::Qwen3
            ) {
                m.insert("sliding_window".into(), s.sliding_window.into());
            }
            c
        }
    };
    match config {
        Value::Object(m) => m,
        _ => unreachable!("configs are objects"),
    }
}
