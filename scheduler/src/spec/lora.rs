//! `lora`: fine-tune low-rank adapters on a frozen base, with PEFT's meanings and defaults
//! (`LoraConfig`: `r` here `rank`, `lora_alpha` here `alpha`, `lora_dropout` here `dropout`).

use serde::de::{SeqAccess, Unexpected, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Architecture;
use crate::error::Problems;
use crate::model::{Adapters, BaseStorage, ModelShape, Targets};

/// The largest rank a spec may ask for: far beyond any useful adapter, small enough that
/// every byte count stays exact.
pub const MAX_LORA_RANK: u32 = 1 << 16;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lora {
    /// The adapters' rank r. Default 8.
    #[serde(default = "eight")]
    pub rank: u32,
    /// The update is scaled by `alpha / rank`. Default 8.
    #[serde(default = "eight_f64")]
    pub alpha: f64,
    /// Dropout on the adapters' input, in [0, 1). Default 0.
    #[serde(default)]
    pub dropout: f64,
    /// The projections that get adapters; default PEFT's for the model type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_modules: Option<TargetModules>,
    /// `"nf4"` stores the adapted projections' frozen weights as bitsandbytes' 4-bit NormalFloat
    /// (QLoRA); default: the compute dtype.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize_base: Option<Quantization>,
    /// A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) to start
    /// from, read inside the agent's data roots; its config must agree with this block.
    /// Default: PEFT's initialisation from the job's seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<String>,
}

/// `target_modules`: module names as PEFT matches them (a module whose path ends with the
/// name), or `"all-linear"`: every linear projection but the LM head.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    AllLinear,
    Names(Vec<String>),
}

impl Serialize for TargetModules {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            TargetModules::AllLinear => s.serialize_str("all-linear"),
            TargetModules::Names(names) => names.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for TargetModules {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // A visitor rather than an untagged enum, so that a wrong element is named at its
        // index (`lora.target_modules[1]`).
        struct Modules;
        impl<'de> Visitor<'de> for Modules {
            type Value = TargetModules;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of module names or \"all-linear\"")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<TargetModules, E> {
                match s {
                    "all-linear" => Ok(TargetModules::AllLinear),
                    _ => Err(E::invalid_value(Unexpected::Str(s), &self)),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TargetModules, A::Error> {
                let mut names = Vec::new();
                while let Some(name) = seq.next_element::<String>()? {
                    names.push(name);
                }
                Ok(TargetModules::Names(names))
            }
        }
        d.deserialize_any(Modules)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantization {
    /// 4-bit NormalFloat in blocks of 64 with an fp32 absmax each, as
    /// `bitsandbytes.functional.quantize_4bit(quant_type="nf4")` stores it.
    Nf4,
}

fn eight() -> u32 {
    8
}

fn eight_f64() -> f64 {
    8.0
}

impl Lora {
    /// What the layout and the memory model need of this block, for `model`. Entries that
    /// match nothing select nothing: [`Lora::validate`] reports them.
    pub fn adapters(&self, model: &ModelShape) -> Adapters {
        let targets = match &self.target_modules {
            Some(TargetModules::AllLinear) => Targets::all(model),
            Some(TargetModules::Names(names)) => {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                Targets::matching(model, &names)
            }
            None => Targets::matching(model, model.default_lora_targets()),
        };
        Adapters {
            rank: self.rank as usize,
            scaling: (self.alpha / f64::from(self.rank)) as f32,
            targets,
            dropout: self.dropout as f32,
            base: match self.quantize_base {
                None => BaseStorage::Compute,
                Some(Quantization::Nf4) => BaseStorage::Nf4,
            },
        }
    }

    pub(super) fn validate(&self, arch: &Architecture, p: &mut Problems) {
        p.ensure(
            (1..=MAX_LORA_RANK).contains(&self.rank),
            "lora.rank",
            || format!("{} must be from 1 to {MAX_LORA_RANK}", self.rank),
        );
        p.ensure(self.alpha.is_finite(), "lora.alpha", || {
            format!("{} must be a finite number", self.alpha)
        });
        p.ensure((0.0..1.0).contains(&self.dropout), "lora.dropout", || {
            format!("{} must be in [0, 1)", self.dropout)
        });
        let Some(model) = arch.model() else {
            p.ensure(false, "lora", || {
                "adapters need a model whose modules are known: a preset, a config or a model directory, not a bare parameter count".into()
            });
            return;
        };
        let Some(TargetModules::Names(names)) = &self.target_modules else {
            return;
        };
        p.ensure(!names.is_empty(), "lora.target_modules", || {
            "must name at least one module (or be \"all-linear\")".into()
        });
        let before = p.count();
        for (i, name) in names.iter().enumerate() {
            p.ensure(
                !Targets::matching(&model, &[name.as_str()]).is_empty(),
                &format!("lora.target_modules[{i}]"),
                || {
                    let mut known: Vec<&str> = Vec::new();
                    for p in model.projections() {
                        if !known.contains(&p.name) {
                            known.push(p.name);
                        }
                    }
                    format!(
                        "{name:?} matches no linear module of this {} model; it has {}",
                        model.summary().model_type,
                        known.join(", ")
                    )
                },
            );
        }
        if p.count() > before {
            return;
        }
        let entries: Vec<&str> = names.iter().map(String::as_str).collect();
        for (path, layers) in Targets::partial(&model, &entries) {
            p.ensure(false, "lora.target_modules", || {
                format!(
                    "names {path} in layers {layers:?} only; an adapter is held for every layer or none (name the module without its layer)"
                )
            });
        }
    }
}
