//! `model`: a preset, a Hugging Face `config.json` (`config`), an explicit GPT-2 shape, or (for
//! estimates only) a bare parameter count.

mod hf_config;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::Purpose;
use crate::error::{Error, Problems};
use crate::kernel_figures::MAX_HEAD_SIZE;
use crate::model::{GptShape, LlamaPreset, LlamaShape, ModelShape, Preset};

pub use hf_config::MODEL_TYPES;

/// The largest bare parameter count accepted (1e15, a petaparameter; exact in f64).
const MAX_PARAMS: f64 = 1e15;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "ModelDoc", into = "ModelDoc")]
pub struct ModelSpec {
    pub source: ModelSource,
    /// The weights to start from.
    pub init_from: Option<InitFrom>,
}

/// Weights a job starts from (`model.init_from`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InitFrom {
    /// A safetensors file of Hugging Face GPT-2 weights, read inside the agent's data roots.
    Path(String),
    /// Another job's export, `{"job": ID, "artifact": "model"}`: fine-tuning a finished job.
    Artifact(JobArtifact),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobArtifact {
    pub job: String,
    /// `model`: the job's exported `model.safetensors`; for `resume_from`, one of its
    /// checkpoints (`checkpoints/step-NNNNNNNN`).
    pub artifact: String,
}

impl JobArtifact {
    /// The step of the checkpoint `artifact` names (`checkpoints/step-NNNNNNNN`), if it names one.
    pub(super) fn checkpoint_step(&self) -> Option<u32> {
        let step = self
            .artifact
            .strip_prefix("checkpoints/step-")?
            .parse()
            .ok()?;
        (super::checkpoint_artifact(step) == self.artifact).then_some(step)
    }

    /// Why `artifact` does not name a checkpoint.
    pub(super) fn not_a_checkpoint(&self) -> String {
        format!(
            "{:?}: must be a checkpoint, as \"checkpoints/step-00000100\"",
            self.artifact
        )
    }
}

/// Another job's checkpoint to resume from: the job, and the step its artifact's name
/// (`checkpoints/step-NNNNNNNN`) was read into by validation, which reads `resume_from` as a
/// [`JobArtifact`] so that a name that is not a checkpoint's is reported with the spec's other
/// mistakes. Its JSON is that `JobArtifact`'s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "JobArtifact", into = "JobArtifact")]
pub struct CheckpointRef {
    pub job: String,
    pub step: u32,
}

/// For specs validated already (stored ones, agents' assignments): their names read.
impl TryFrom<JobArtifact> for CheckpointRef {
    type Error = String;

    fn try_from(a: JobArtifact) -> Result<CheckpointRef, String> {
        let step = a.checkpoint_step().ok_or_else(|| a.not_a_checkpoint())?;
        Ok(CheckpointRef { job: a.job, step })
    }
}

impl From<CheckpointRef> for JobArtifact {
    fn from(c: CheckpointRef) -> JobArtifact {
        JobArtifact {
            job: c.job,
            artifact: super::checkpoint_artifact(c.step),
        }
    }
}

impl InitFrom {
    /// The file, when it is one.
    pub fn path(&self) -> Option<&str> {
        match self {
            InitFrom::Path(p) => Some(p),
            InitFrom::Artifact(_) => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// A GPT-2 preset.
    Preset(Preset),
    /// A Llama-family preset.
    LlamaPreset(LlamaPreset),
    /// A Hugging Face `config.json`.
    Config(HfConfig),
    Shape(GptShape),
    /// A bare parameter count, for closed-form estimates of any model.
    Params(u64),
}

/// A Hugging Face `config.json` as given (kept whole, so that it travels and is shown as
/// written) and the shape read from it.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    raw: Map<String, Value>,
    shape: ModelShape,
}

impl HfConfig {
    /// Reads `raw`, naming each mistake's field under `model.config`.
    pub fn read(raw: Map<String, Value>) -> Result<HfConfig, Error> {
        let mut p = Problems::default();
        let shape = hf_config::read(&raw, &mut p);
        p.finish()?;
        Ok(HfConfig {
            raw,
            shape: shape.expect("a config read without mistakes"),
        })
    }

    /// The object as given.
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }

    pub fn shape(&self) -> ModelShape {
        self.shape
    }
}

/// What the memory model and the trainer see.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Architecture {
    Gpt(GptShape),
    Llama(LlamaShape),
    Params(u64),
}

impl From<ModelShape> for Architecture {
    fn from(m: ModelShape) -> Architecture {
        match m {
            ModelShape::Gpt2(s) => Architecture::Gpt(s),
            ModelShape::Llama(s) => Architecture::Llama(s),
        }
    }
}

impl Architecture {
    pub fn parameter_count(&self) -> u64 {
        match self.model() {
            Some(m) => m.parameter_count(),
            None => self.params().unwrap_or_default(),
        }
    }

    /// What the console and `zerotrain jobs` call the model: its Hugging Face `model_type` and
    /// its size (`qwen3 596.0M`, `gpt2 124.4M`), or the bare count (`7.0B parameters`).
    pub fn label(&self) -> String {
        let n = self.parameter_count() as f64;
        let size = if n >= 1e9 {
            format!("{:.1}B", n / 1e9)
        } else if n >= 1e6 {
            format!("{:.1}M", n / 1e6)
        } else {
            format!("{:.1}K", n / 1e3)
        };
        match self.model() {
            Some(m) => format!("{} {size}", m.summary().model_type),
            None => format!("{size} parameters"),
        }
    }

    /// The model zerotrain describes exactly, unless this is a bare parameter count.
    pub fn model(&self) -> Option<ModelShape> {
        match *self {
            Architecture::Gpt(s) => Some(ModelShape::Gpt2(s)),
            Architecture::Llama(s) => Some(ModelShape::Llama(s)),
            Architecture::Params(_) => None,
        }
    }

    fn params(&self) -> Option<u64> {
        match *self {
            Architecture::Params(n) => Some(n),
            _ => None,
        }
    }

    /// The GPT-2 shape, when the model is a GPT-2.
    pub fn gpt(&self) -> Option<&GptShape> {
        match self {
            Architecture::Gpt(s) => Some(s),
            Architecture::Llama(_) | Architecture::Params(_) => None,
        }
    }
}

impl ModelSpec {
    /// The `config.json` an export of this model carries: the job's own when it gave one (its
    /// dtype set to the export's float32), else the one transformers writes for the shape;
    /// `None` for a bare parameter count.
    pub fn hf_config(&self) -> Option<Map<String, Value>> {
        match &self.source {
            ModelSource::Config(c) => {
                let mut raw = c.raw().clone();
                let key = if raw.contains_key("dtype") {
                    "dtype"
                } else {
                    "torch_dtype"
                };
                raw.insert(key.into(), "float32".into());
                Some(raw)
            }
            source => source.architecture().model().map(|m| hf_config::write(&m)),
        }
    }
}

impl ModelSource {
    pub fn architecture(&self) -> Architecture {
        match self {
            ModelSource::Preset(p) => Architecture::Gpt(p.shape()),
            ModelSource::LlamaPreset(p) => Architecture::Llama(p.shape()),
            ModelSource::Config(c) => c.shape().into(),
            ModelSource::Shape(s) => Architecture::Gpt(*s),
            ModelSource::Params(n) => Architecture::Params(*n),
        }
    }
}

impl ModelSpec {
    /// The architecture, unless the model is in error (then its mistakes are recorded).
    pub(super) fn validate(&self, purpose: Purpose, p: &mut Problems) -> Option<Architecture> {
        let before = p.count();
        let arch = self.source.architecture();
        match (arch, purpose) {
            (Architecture::Params(_), Purpose::Train) => {
                p.note::<()>(Err(Error::spec(
                    "model.params",
                    "a bare parameter count can be estimated but not trained; give a preset or a shape",
                )));
            }
            (Architecture::Params(_), Purpose::Estimate) => {}
            (Architecture::Gpt(s), _) => validate_shape(&s, p),
            // Read and checked with the config, or a preset.
            (Architecture::Llama(_), _) => {}
        }
        if let (Some(model), Purpose::Train) = (arch.model(), purpose) {
            let hs = model.summary().head_dim;
            let field = match arch {
                Architecture::Llama(_) => "model.config.head_dim",
                _ => "model.n_head",
            };
            p.ensure(hs <= MAX_HEAD_SIZE, field, || {
                format!(
                    "{hs} channels per attention head; the trainer's attention kernels take at most {MAX_HEAD_SIZE}"
                )
            });
        }
        match &self.init_from {
            Some(InitFrom::Path(path)) => {
                p.ensure(!path.trim().is_empty(), "model.init_from", || {
                    "must be a path to a .safetensors file".into()
                });
            }
            Some(InitFrom::Artifact(a)) => {
                p.ensure(!a.job.trim().is_empty(), "model.init_from.job", || {
                    "must be a job's id".into()
                });
                p.ensure(a.artifact == "model", "model.init_from.artifact", || {
                    format!(
                        "{:?}: only \"model\" (the weights of the job's export) can be started from",
                        a.artifact
                    )
                });
            }
            None => {}
        }
        if self.init_from.is_some() {
            p.ensure(arch.model().is_some(), "model.init_from", || {
                "needs a preset, a config or a shape, not a bare parameter count".into()
            });
        }
        (p.count() == before).then_some(arch)
    }
}

fn validate_shape(s: &GptShape, p: &mut Problems) {
    let before = p.count();
    // Caps keep a layout (one unit per layer) and every byte count small enough to compute.
    for (field, v, max) in [
        ("vocab_size", s.vocab_size, 1 << 20),
        ("context_length", s.context_length, 1 << 20),
        ("n_layer", s.n_layer, 4096),
        ("n_head", s.n_head, 4096),
        ("n_embd", s.n_embd, 1 << 20),
    ] {
        let field = format!("model.{field}");
        if p.ensure(v > 0, &field, || "must be positive".into()) {
            p.ensure(v <= max, &field, || {
                format!("{v} is larger than zerotrain supports ({max})")
            });
        }
    }
    if p.count() > before {
        return;
    }
    p.ensure(s.n_embd.is_multiple_of(s.n_head), "model.n_embd", || {
        format!("{} is not divisible by model.n_head {}", s.n_embd, s.n_head)
    });
    // Closed form of `GptShape::parameter_count` (which lays out every block), checked first so
    // that no later sum of bytes can overflow: (V + T)·C + L·(12C² + 13C) + 2C.
    let [v, t, l, c] = [s.vocab_size, s.context_length, s.n_layer, s.n_embd].map(|x| x as f64);
    let params = (v + t) * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c;
    p.ensure(params <= MAX_PARAMS, "model", || {
        format!("this shape has {params:.3e} parameters, which exceeds 1e15")
    });
}

/// The wire form: exactly one of `preset`, `config`, the five shape fields, or `params`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelDoc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    preset: Option<AnyPreset>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    config: Option<Map<String, Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vocab_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context_length: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    n_layer: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    n_head: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    n_embd: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    params: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    init_from: Option<InitFrom>,
}

impl TryFrom<ModelDoc> for ModelSpec {
    type Error = String;

    fn try_from(d: ModelDoc) -> Result<Self, String> {
        let shape_fields = [
            ("vocab_size", d.vocab_size),
            ("context_length", d.context_length),
            ("n_layer", d.n_layer),
            ("n_head", d.n_head),
            ("n_embd", d.n_embd),
        ];
        let any_shape = shape_fields.iter().any(|(_, v)| v.is_some());
        if let Some(config) = d.config {
            if d.preset.is_some() || any_shape || d.params.is_some() {
                return Err(
                    "give exactly one of preset, an explicit shape, or params, or a config".into(),
                );
            }
            return Ok(ModelSpec {
                source: ModelSource::Config(HfConfig::read(config).map_err(|e| e.to_string())?),
                init_from: d.init_from,
            });
        }
        let source = match (d.preset, any_shape, d.params) {
            (Some(AnyPreset::Gpt2(p)), false, None) => ModelSource::Preset(p),
            (Some(AnyPreset::Llama(p)), false, None) => ModelSource::LlamaPreset(p),
            (None, true, None) => {
                if let Some((missing, _)) = shape_fields.iter().find(|(_, v)| v.is_none()) {
                    return Err(format!(
                        "missing {missing}: an explicit shape needs vocab_size, context_length, n_layer, n_head and n_embd"
                    ));
                }
                let [v, t, l, h, c] = shape_fields.map(|(_, v)| v.unwrap_or_default());
                ModelSource::Shape(GptShape {
                    vocab_size: v,
                    context_length: t,
                    n_layer: l,
                    n_head: h,
                    n_embd: c,
                })
            }
            (None, false, Some(p)) => {
                if !((1.0..=MAX_PARAMS).contains(&p) && p.fract() == 0.0) {
                    return Err(format!(
                        "params {p} must be a whole number of parameters between 1 and 1e15"
                    ));
                }
                ModelSource::Params(p as u64)
            }
            (None, false, None) => {
                return Err(format!(
                    "give a preset ({}), a config (a Hugging Face config.json), a shape or params",
                    PRESET_NAMES.join(", ")
                ));
            }
            _ => {
                return Err(
                    "give exactly one of preset, an explicit shape, or params, or a config".into(),
                );
            }
        };
        Ok(ModelSpec {
            source,
            init_from: d.init_from,
        })
    }
}

impl From<ModelSpec> for ModelDoc {
    fn from(m: ModelSpec) -> ModelDoc {
        let mut d = ModelDoc {
            init_from: m.init_from,
            ..ModelDoc::default()
        };
        match m.source {
            ModelSource::Preset(p) => d.preset = Some(AnyPreset::Gpt2(p)),
            ModelSource::LlamaPreset(p) => d.preset = Some(AnyPreset::Llama(p)),
            ModelSource::Config(c) => d.config = Some(c.raw),
            ModelSource::Params(n) => d.params = Some(n as f64),
            ModelSource::Shape(s) => {
                d.vocab_size = Some(s.vocab_size);
                d.context_length = Some(s.context_length);
                d.n_layer = Some(s.n_layer);
                d.n_head = Some(s.n_head);
                d.n_embd = Some(s.n_embd);
            }
        }
        d
    }
}

/// Every preset's name, GPT-2's first (`Preset`'s serde names, then `LlamaPreset::name`).
pub const PRESET_NAMES: &[&str] = &[
    "gpt2-tiny",
    "gpt2-124M",
    "gpt2-350M",
    "gpt2-774M",
    "gpt2-1558M",
    "llama-tiny",
    "smollm2-135M",
    "qwen2.5-0.5B",
    "qwen3-0.6B",
    "tinyllama-1.1B",
    "llama-3.2-1B",
    "llama-2-7B",
    "llama-3.1-8B",
];

/// `model.preset`: a preset of either family, by name.
#[derive(Debug, Clone, Copy, PartialEq)]
enum AnyPreset {
    Gpt2(Preset),
    Llama(LlamaPreset),
}

impl Serialize for AnyPreset {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AnyPreset::Gpt2(p) => p.serialize(s),
            AnyPreset::Llama(p) => s.serialize_str(p.name()),
        }
    }
}

impl<'de> Deserialize<'de> for AnyPreset {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        if let Some(p) = LlamaPreset::from_name(&name) {
            return Ok(AnyPreset::Llama(p));
        }
        serde_json::from_value(Value::String(name.clone()))
            .map(AnyPreset::Gpt2)
            .map_err(|_| serde::de::Error::unknown_variant(&name, PRESET_NAMES))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_names_are_every_preset_of_both_families() {
        let names: Vec<String> = Preset::ALL
            .into_iter()
            .map(|p| {
                serde_json::to_value(p)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .chain(LlamaPreset::ALL.into_iter().map(|p| p.name().to_string()))
            .collect();
        assert_eq!(names, PRESET_NAMES);
    }
}
