//! PEFT's adapter directories: in, `adapter_config.json` checked against the job's `lora`
//! block and `adapter_model.safetensors` read with PEFT's tensor names
//! (`AdapterTensor::peft_name`) into the adapters' units; out, the config a LoRA job's export
//! carries (its weights are written by `ModelFile::adapter`).

use std::io::Read;

use scheduler::model::{Adapters, ModelShape, Targets};
use scheduler::spec::Lora;
use serde::Deserialize;

use super::import::{HfWeights, Wanted};
use crate::Error;
use crate::data::{DataRoots, describe};
use crate::tensor_file::TensorFile;
use wire::artifact::{ADAPTER_CONFIG_FILE as ADAPTER_CONFIG, ADAPTER_MODEL_FILE as ADAPTER_MODEL};

/// The spec field that names an adapter directory.
const FIELD: &str = "lora.init_from";

/// Largest `adapter_config.json` read (PEFT's are a few KiB; an expanded "all-linear" of a
/// 126-layer model lists about 900 modules).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// What of PEFT's `LoraConfig` decides the adapters' layout and arithmetic; the rest (dropout,
/// the base's name, task) does not change what the tensors mean.
#[derive(Debug, Deserialize)]
struct AdapterConfig {
    peft_type: String,
    r: u32,
    lora_alpha: f64,
    target_modules: PeftTargets,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default = "no_bias")]
    bias: String,
    #[serde(default)]
    layers_to_transform: Option<serde_json::Value>,
    #[serde(default)]
    rank_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    alpha_pattern: serde_json::Map<String, serde_json::Value>,
}

fn no_bias() -> String {
    "none".into()
}

/// `target_modules` as PEFT saves it: a list of names, or one string (`"all-linear"`; PEFT
/// also takes a regular expression, which is not read here).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PeftTargets {
    Names(Vec<String>),
    One(String),
}

/// The adapter directory `dir` within the data roots, as the weights of `adapters` for
/// `model`, once its config agrees with the job's `lora` block.
pub fn load_peft(
    roots: &DataRoots,
    dir: &str,
    model: &ModelShape,
    lora: &Lora,
    adapters: &Adapters,
) -> Result<HfWeights, Error> {
    let dir = dir.trim_end_matches('/');
    let config_path = format!("{dir}/{ADAPTER_CONFIG}");
    let what = describe(FIELD, &config_path);
    let fail = |reason: String| Error::Data {
        what: what.clone(),
        reason,
    };
    let (_, file) = roots.open(FIELD, &config_path)?;
    let mut json = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut json)
        .map_err(|e| fail(format!("cannot read: {}", e.kind())))?;
    if json.len() as u64 > MAX_CONFIG_BYTES {
        return Err(fail(format!("larger than {MAX_CONFIG_BYTES} bytes")));
    }
    let config: AdapterConfig = serde_json::from_slice(&json)
        .map_err(|e| fail(format!("not a PEFT LoRA adapter config: {e}")))?;
    check(&config, model, lora, adapters).map_err(fail)?;

    let model_path = format!("{dir}/{ADAPTER_MODEL}");
    let what = describe(FIELD, &model_path);
    let (_, file) = roots.open(FIELD, &model_path)?;
    let file = TensorFile::new(file).map_err(|reason| Error::Data {
        what: what.clone(),
        reason,
    })?;
    let wanted = adapters
        .layout(model, 1)
        .adapters
        .iter()
        .enumerate()
        .map(|(l, unit)| {
            unit.tensors
                .iter()
                .map(|t| Wanted {
                    names: vec![t.kind.peft_name(l)],
                    dims: t.dims,
                })
                .collect()
        })
        .collect();
    HfWeights::locate(vec![file], what, wanted, |_| false)
}

/// Whether the adapter `config` describes is the one the spec asks for: the same rank, scale
/// and projections, and nothing PEFT would compute differently.
fn check(
    config: &AdapterConfig,
    model: &ModelShape,
    lora: &Lora,
    adapters: &Adapters,
) -> Result<(), String> {
    let differs = |what: &str, theirs: String, ours: String| {
        Err(format!(
            "the adapter's {what} is {theirs}; the spec's lora block says {ours}"
        ))
    };
    if config.peft_type != "LORA" {
        return Err(format!(
            "a {} adapter; only LoRA adapters are read",
            config.peft_type
        ));
    }
    if config.r != lora.rank {
        return differs("r", config.r.to_string(), format!("rank {}", lora.rank));
    }
    if config.lora_alpha != lora.alpha {
        let ours = format!("alpha {}", lora.alpha);
        return differs("lora_alpha", config.lora_alpha.to_string(), ours);
    }
    let theirs = match &config.target_modules {
        PeftTargets::One(s) if s == "all-linear" => Targets::all(model),
        PeftTargets::One(s) => {
            return Err(format!(
                "target_modules {s:?} is a pattern; give the module names or \"all-linear\""
            ));
        }
        PeftTargets::Names(names) => {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            if !Targets::partial(model, &names).is_empty() {
                return Err("target_modules adapts some layers only".into());
            }
            Targets::matching(model, &names)
        }
    };
    if theirs != adapters.targets {
        let names = |t: Targets| {
            let paths: Vec<&str> = t.of(model).iter().map(|p| p.path).collect();
            paths.join(", ")
        };
        return differs(
            "target_modules",
            names(theirs),
            format!("target_modules {}", names(adapters.targets)),
        );
    }
    let unsupported = [
        (config.use_rslora, "use_rslora"),
        (config.use_dora, "use_dora"),
        (config.bias != "none", "bias"),
        (
            config
                .layers_to_transform
                .as_ref()
                .is_some_and(|v| !v.is_null()),
            "layers_to_transform",
        ),
        (!config.rank_pattern.is_empty(), "rank_pattern"),
        (!config.alpha_pattern.is_empty(), "alpha_pattern"),
    ];
    match unsupported.iter().find(|(set, _)| *set) {
        Some((_, key)) => Err(format!(
            "{key} is set; zerotrain trains plain LoRA adapters"
        )),
        None => Ok(()),
    }
}

/// The `adapter_config.json` of a job's adapters, as PEFT writes one for `LoraConfig` with the
/// same meaning: each adapted projection named as PEFT names modules (`q_proj`), or by its
/// path in the block (`mlp.c_proj`) where the name alone would select more.
pub fn adapter_config(
    model: &ModelShape,
    lora: &Lora,
    adapters: &Adapters,
) -> serde_json::Map<String, serde_json::Value> {
    let all = model.projections();
    let chosen = adapters.targets.of(model);
    let mut modules: Vec<&str> = Vec::new();
    for p in &chosen {
        let whole_name = all
            .iter()
            .filter(|q| q.name == p.name)
            .all(|q| chosen.contains(q));
        let module = if whole_name { p.name } else { p.path };
        if !modules.contains(&module) {
            modules.push(module);
        }
    }
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": null,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "fan_in_fan_out": matches!(model, ModelShape::Gpt2(_)),
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    match config {
        serde_json::Value::Object(map) => map,
        _ => unreachable!("a JSON object"),
    }
}
