//! The job spec: what a user submits, parsed into types that cannot hold an untrainable job.
//! Unknown fields are rejected; every field but `model` has a default (see each type).
//! A DeepSpeed config is accepted too (`deepspeed` module).

mod blocks;
mod data;
mod deepspeed;
mod lora;
mod model;
mod optimizer;
mod precision;
mod training;

pub use data::{
    Data, Fields, MAX_SYNTHETIC_VOCAB, MIN_SYNTHETIC_VOCAB, TOKENIZER_FILE, TokenizerSource,
    Validation,
};
pub use lora::{Lora, MAX_LORA_RANK, Quantization, TargetModules};
pub use model::{
    Architecture, CheckpointRef, HfConfig, InitFrom, JobArtifact, MODEL_TYPES, ModelSource,
    ModelSpec, PRESET_NAMES,
};
pub use optimizer::{AdaFactor, Adam8bit, AdamW, Lion, Momentum, Optimizer, OptimizerKind, Sgd};
pub use precision::{Dtype, DynamicLossScale, LossScale, Precision, ScalerSemantics};
pub use training::{LrSchedule, Training, WarmupType};

use std::num::NonZeroU32;

use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Problems};
use crate::memory::DeviceKind;

/// A value the planner may choose (`"auto"`) or a fixed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auto<T> {
    Auto,
    Fixed(T),
}

impl<T: Copy> Auto<T> {
    pub fn fixed(self) -> Option<T> {
        match self {
            Auto::Auto => None,
            Auto::Fixed(v) => Some(v),
        }
    }
}

impl<T: Serialize> Serialize for Auto<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Auto::Auto => s.serialize_str("auto"),
            Auto::Fixed(v) => v.serialize(s),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Auto<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        if v.as_str() == Some("auto") {
            return Ok(Auto::Auto);
        }
        T::deserialize(v)
            .map(Auto::Fixed)
            .map_err(|e| D::Error::custom(format!("{e} (or \"auto\")")))
    }
}

/// ZeRO stage: which model states are sharded across the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Stage 0: plain data parallelism (DDP), gradients all-reduced.
    Ddp,
    /// Stage 1: optimizer states (and fp32 master weights) sharded.
    Optimizer,
    /// Stage 2: gradients sharded too.
    Gradients,
    /// Stage 3: parameters sharded too.
    Parameters,
}

impl ZeroStage {
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Ddp,
        ZeroStage::Optimizer,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];

    pub fn index(self) -> u8 {
        self as u8
    }

    pub fn from_index(i: u64) -> Option<ZeroStage> {
        Self::ALL.get(usize::try_from(i).ok()?).copied()
    }

    pub fn shards_optimizer(self) -> bool {
        self >= ZeroStage::Optimizer
    }

    pub fn shards_grads(self) -> bool {
        self >= ZeroStage::Gradients
    }

    pub fn shards_params(self) -> bool {
        self == ZeroStage::Parameters
    }
}

impl Serialize for ZeroStage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.index())
    }
}

impl<'de> Deserialize<'de> for ZeroStage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let i = u64::deserialize(d)?;
        ZeroStage::from_index(i)
            .ok_or_else(|| D::Error::custom(format!("stage {i} does not exist; use 0, 1, 2 or 3")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Zero {
    /// Default `"auto"`: the planner picks the lowest stage that fits.
    #[serde(default = "auto")]
    pub stage: Auto<ZeroStage>,
}

impl Default for Zero {
    fn default() -> Self {
        Zero { stage: Auto::Auto }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// Save a resumable checkpoint every this many steps; 0 (default) saves only the final
    /// Hugging Face export.
    #[serde(default)]
    pub every_steps: u32,
}

fn auto<T>() -> Auto<T> {
    Auto::Auto
}

fn one() -> NonZeroU32 {
    NonZeroU32::MIN
}

/// A training job as submitted, with every default filled in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// 1-64 characters of `[A-Za-z0-9._-]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub model: ModelSpec,
    #[serde(default)]
    pub training: Training,
    #[serde(default)]
    pub precision: Precision,
    #[serde(default)]
    pub optimizer: Optimizer,
    #[serde(default)]
    pub zero: Zero,
    /// Recompute each block in backward instead of keeping its activations. Default `"auto"`.
    #[serde(default = "auto")]
    pub activation_checkpointing: Auto<bool>,
    /// Data-parallel ranks. Default 1.
    #[serde(default = "one")]
    pub world_size: NonZeroU32,
    #[serde(default)]
    pub data: Data,
    #[serde(default)]
    pub checkpoint: Checkpoint,
    /// The kind of device every rank runs on: `"cuda"`, `"cpu"`, or `"auto"` (default): GPUs
    /// when any are registered, else CPU devices. A job never mixes kinds.
    #[serde(default = "auto")]
    pub device: Auto<DeviceKind>,
    /// Another job's committed checkpoint to continue from, `{"job": ID, "artifact":
    /// "checkpoints/step-NNNNNNNN"}` (the folder its artifact list names the files in):
    /// weights, optimizer state, loss scale and data position, at any world size and stage.
    #[serde(default)]
    pub resume_from: Option<CheckpointRef>,
    /// Train low-rank adapters on a frozen base (LoRA; QLoRA with `quantize_base`) instead of
    /// every weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Lora>,
}

/// The folder of the checkpoint of `step` among a job's artifacts.
pub fn checkpoint_artifact(step: u32) -> String {
    format!("checkpoints/step-{step:08}")
}

/// What a spec is for: a bare parameter count can be estimated but not trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Train,
    Estimate,
}

/// A parsed spec and the keys of a DeepSpeed config that zerotrain does not support (and so
/// ignores); empty for native specs, which reject unknown keys instead.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub spec: JobSpec,
    pub unsupported_keys: Vec<String>,
}

impl JobSpec {
    /// Parses and validates a native job spec or a DeepSpeed-form job (`{"deepspeed": …}`).
    pub fn parse(json: &str, purpose: Purpose) -> Result<Parsed, Error> {
        JobSpec::parse_value(read_json(json)?, purpose)
    }

    /// [`JobSpec::parse`] for JSON already read. A native spec's mistakes are all reported at
    /// once; a DeepSpeed config's from the first that stops its translation.
    pub fn parse_value(mut value: serde_json::Value, purpose: Purpose) -> Result<Parsed, Error> {
        if value.get("deepspeed").is_some() {
            let (mut parsed, resume_from) = deepspeed::translate(value)?;
            let mut problems = Problems::default();
            let spec = &mut parsed.spec;
            spec.resume_from = spec.check(resume_from.as_ref(), purpose, &|_| true, &mut problems);
            problems.finish()?;
            return Ok(parsed);
        }
        let serde_json::Value::Object(map) = &mut value else {
            return Err(Error::spec("spec", "must be a JSON object"));
        };
        // `optimizer` without `type` is AdamW (the default optimizer) with the fields given.
        if let Some(serde_json::Value::Object(opt)) = map.get_mut("optimizer") {
            opt.entry("type").or_insert_with(|| "adamw".into());
        }
        let mut problems = Problems::default();
        let (blocks, mut spec) = blocks::read(map, &mut problems);
        if let Some(spec) = &mut spec {
            let read = |block: &str| blocks.read(block);
            spec.resume_from =
                spec.check(blocks.resume_from.as_ref(), purpose, &read, &mut problems);
        }
        problems.finish()?;
        Ok(Parsed {
            spec: spec.expect("a spec read without mistakes"),
            unsupported_keys: Vec::new(),
        })
    }

    /// Checks ranges and cross-field consistency, naming every offending field.
    pub fn validate(&self, purpose: Purpose) -> Result<(), Error> {
        let mut problems = Problems::default();
        let resume_from = self.resume_from.clone().map(JobArtifact::from);
        self.check(resume_from.as_ref(), purpose, &|_| true, &mut problems);
        problems.finish()
    }

    /// Records the mistakes of the top-level members for which `read` holds (the others were
    /// not read, so checks that involve them are skipped rather than run on defaults), with
    /// `resume_from` as given in place of the spec's own; returns the checkpoint that names.
    fn check(
        &self,
        resume_from: Option<&JobArtifact>,
        purpose: Purpose,
        read: &dyn Fn(&str) -> bool,
        p: &mut Problems,
    ) -> Option<CheckpointRef> {
        if let Some(name) = self.name.as_ref().filter(|_| read("name")) {
            p.ensure(
                (1..=64).contains(&name.len())
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
                "name",
                || format!("{name:?} must be 1-64 characters of letters, digits, '.', '_' or '-'"),
            );
        }
        let arch = if read("model") {
            self.model.validate(purpose, p)
        } else {
            None
        };
        if read("training") {
            let world = read("world_size").then_some(self.world_size);
            self.training.validate(arch.as_ref(), world, p);
        }
        if read("precision") {
            self.precision.validate(p);
        }
        if read("optimizer") {
            self.optimizer.validate(p);
        }
        if let (Some(lora), Some(arch)) = (self.lora.as_ref().filter(|_| read("lora")), &arch) {
            lora.validate(arch, p);
        }
        if let Some(arch) = arch.as_ref().filter(|_| read("data")) {
            p.note(self.data.validate(arch, self.model.init_from.as_ref()));
        }
        let from = resume_from.filter(|_| read("resume_from"))?;
        p.ensure(!from.job.trim().is_empty(), "resume_from.job", || {
            "must be a job's id".into()
        });
        let step = from.checkpoint_step();
        p.ensure(step.is_some(), "resume_from.artifact", || {
            from.not_a_checkpoint()
        });
        if let Some(step) = step.filter(|_| read("training")) {
            p.ensure(self.training.steps.get() > step, "training.steps", || {
                format!("must be more than the {step} steps the checkpoint has taken")
            });
        }
        p.ensure(
            self.model.init_from.is_none() || !read("model"),
            "model.init_from",
            || "a job resuming from a checkpoint takes its weights from there".into(),
        );
        Some(CheckpointRef {
            job: from.job.clone(),
            step: step?,
        })
    }

    pub fn architecture(&self) -> Architecture {
        self.model.source.architecture()
    }
}

/// The JSON of a spec, or why it is not JSON.
pub fn read_json(json: &str) -> Result<serde_json::Value, Error> {
    serde_json::from_str(json).map_err(|e| Error::spec("spec", format!("not valid JSON: {e}")))
}

/// Deserializes `value` as `T`, reporting the path of the first offending field.
pub(crate) fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, Error> {
    serde_path_to_error::deserialize(&value).map_err(|e| {
        let path = e.path().to_string();
        let reason = e.into_inner().to_string();
        // serde reports a missing field at its parent; name the field itself.
        let field = match reason.strip_prefix("missing field `") {
            Some(rest) => {
                let missing = rest.split('`').next().unwrap_or_default();
                if path == "." {
                    missing.to_string()
                } else {
                    format!("{path}.{missing}")
                }
            }
            None if path == "." => "spec".to_string(),
            None => path,
        };
        // An internally tagged block is read whole before its variant is chosen, so serde names
        // the block; read as its variant alone, the mistake is named at its field.
        if field == "optimizer" || field.ends_with(".optimizer") {
            let block = field.split('.').try_fold(&value, |v, key| v.get(key));
            if let Some(inside) = block.and_then(|b| Optimizer::mistake_inside(b, &field)) {
                return inside;
            }
        }
        Error::spec(field, reason)
    })
}
