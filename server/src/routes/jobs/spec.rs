//! The job spec's schema as the API documents it for `POST /v1/jobs` and `POST /v1/estimate`:
//! the top level of `scheduler::spec::JobSpec` in either form and `model` in full; each
//! section's own fields and defaults are those of its type in `scheduler/src/spec/`.
//!
//! The schema never refuses a spec the server accepts (so a client or fuzzer trusting it
//! loses nothing), but it cannot say everything the server checks: ranges that depend on
//! other fields, and whether any registered device could hold a rank, give 422 too.

use std::borrow::Cow;

use scheduler::spec::{MODEL_TYPES, PRESET_NAMES};
use serde_json::json;
use utoipa::openapi::{RefOr, Schema};
use utoipa::{PartialSchema, ToSchema};

/// The body of `POST /v1/jobs` and `POST /v1/estimate`.
pub struct JobSpecBody;

impl PartialSchema for JobSpecBody {
    fn schema() -> RefOr<Schema> {
        let section = |what: &str| json!({"type": "object", "description": what});
        let schema = json!({
            "type": "object",
            "description": "A job spec: native, or DeepSpeed form when `deepspeed` is present \
                (then `precision`, `optimizer` and `zero` come from the DeepSpeed config, and \
                `training` takes only `steps`, `seq_len` and `seed`). Unknown keys are refused.",
            "required": ["model"],
            "additionalProperties": false,
            "properties": {
                "name": {
                    "type": ["string", "null"],
                    "pattern": "^[A-Za-z0-9._-]{1,64}$",
                },
                "model": model(),
                "training": section(
                    "`scheduler::spec::Training`: steps, micro_batch_size, grad_accum_steps, \
                     seq_len, lr, lr_schedule, warmup, grad_clip, seed"
                ),
                "precision": section(
                    "`scheduler::spec::Precision`: dtype (fp32, fp16, bf16) and loss_scale"
                ),
                "optimizer": section(
                    "`scheduler::spec::Optimizer`, by `type`: adamw (default), sgd, momentum, \
                     lion, adafactor, adam8bit"
                ),
                "zero": section("`{\"stage\": 0-3 or \"auto\"}` (default auto)"),
                "activation_checkpointing": {
                    "description": "Recompute each block in backward (default auto)",
                    "oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["auto"]}],
                },
                "world_size": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": u32::MAX,
                    "description": "Data-parallel ranks (default 1)",
                },
                "data": section(
                    "By `kind`: synthetic (default), text {path}, tokens {path, shuffle}; paths \
                     as the agents' operator allows"
                ),
                "checkpoint": section("`{\"every_steps\": N}` (default 0: only the final export)"),
                "lora": section(
                    "`scheduler::spec::Lora`: train low-rank adapters on the frozen model, with \
                     PEFT's meanings: rank (8), alpha (8), dropout (0), target_modules (module \
                     names or \"all-linear\"), quantize_base (\"nf4\"), init_from (a PEFT \
                     adapter directory inside the agents' data roots); the export is PEFT's \
                     adapter files"
                ),
                "device": {
                    "type": "string",
                    "enum": ["cuda", "cpu", "auto"],
                    "description": "The kind of device every rank runs on (default auto: GPUs \
                        when any are registered, else CPU devices); a kind no node has \
                        registered gets 422 naming `device`",
                },
                "deepspeed": section("A DeepSpeed config; keys zerotrain does not support are \
                    returned in `unsupported_keys`"),
                "resume_from": {
                    "description": "Another job's committed checkpoint to continue from (its \
                        weights, optimizer state, loss scale and data position), as its artifact \
                        list names the folder: `{\"job\": ID, \"artifact\": \
                        \"checkpoints/step-00000100\"}`; same model, dtype and optimizer, any \
                        world size and stage",
                    "oneOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "required": ["job", "artifact"],
                            "additionalProperties": false,
                            "properties": {
                                "job": {"type": "string"},
                                "artifact": {"type": "string", "pattern": "^checkpoints/step-[0-9]{8,}$"},
                            },
                        },
                    ],
                },
            },
        });
        serde_json::from_value(schema).expect("the job spec's schema is a schema")
    }
}

impl ToSchema for JobSpecBody {
    fn name() -> Cow<'static, str> {
        "JobSpec".into()
    }
}

/// `model`: exactly one of `preset`, `config`, the five shape fields, or (estimates only)
/// `params`.
fn model() -> serde_json::Value {
    let size = |max: u64| json!({"type": ["integer", "null"], "minimum": 1, "maximum": max});
    let mut presets: Vec<serde_json::Value> = PRESET_NAMES.iter().map(|&p| json!(p)).collect();
    presets.push(serde_json::Value::Null);
    json!({
        "type": "object",
        "description": "Exactly one of `preset`, `config`, an explicit GPT-2 shape (all five of \
            vocab_size, context_length, n_layer, n_head, n_embd) or, for estimates only, \
            `params` (a bare parameter count cannot be trained). A Hugging Face \
            `config` may be of model_type gpt2, llama, mistral, qwen2 or qwen3",
        "additionalProperties": false,
        "properties": {
            "preset": {
                "type": ["string", "null"],
                "enum": presets,
            },
            "config": {
                "type": ["object", "null"],
                "description": format!(
                    "A Hugging Face config.json object as published, of model_type {MODEL_TYPES}: \
                     the fields that set the model's arithmetic are read (a value zerotrain \
                     cannot compute with is a 422 naming `model.config.FIELD`), the others \
                     ignored"
                ),
            },
            "vocab_size": size(1 << 20),
            "context_length": size(1 << 20),
            "n_layer": size(4096),
            "n_head": size(4096),
            "n_embd": size(1 << 20),
            "params": {
                "type": ["number", "null"],
                "minimum": 1,
                "maximum": 1e15,
                "description": "A bare parameter count, for closed-form estimates",
            },
            "init_from": {
                "description": "The weights to start from: a safetensors file of Hugging Face \
                    GPT-2 weights (a path the agents' operator allows), or another job's \
                    export, `{\"job\": ID, \"artifact\": \"model\"}`",
                "oneOf": [
                    {"type": "null"},
                    {"type": "string"},
                    {
                        "type": "object",
                        "required": ["job", "artifact"],
                        "additionalProperties": false,
                        "properties": {
                            "job": {"type": "string"},
                            "artifact": {"type": "string", "enum": ["model"]},
                        },
                    },
                ],
            },
        },
    })
}
