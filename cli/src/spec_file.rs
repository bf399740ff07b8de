//! The job spec `estimate`, `submit` and `train` read: a spec file, and with `--model-dir DIR` a
//! Hugging Face model directory, whose `config.json` becomes `model.config` and whose weights
//! `model.init_from` (read here, so the server admits the job without reaching an agent's disk).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::{Map, Value, json};

#[derive(clap::Args)]
pub struct SpecArgs {
    /// A job spec (native or DeepSpeed form), JSON [default with --model-dir: `{}`, every
    /// field but the model at its default].
    #[arg(required_unless_present = "model_dir")]
    pub spec: Option<PathBuf>,
    /// A Hugging Face model directory: its config.json becomes the spec's `model.config` and
    /// the directory (its `model.safetensors` when it holds one file of weights) the spec's
    /// `model.init_from`. The spec then gives no `model` of its own.
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
}

impl SpecArgs {
    /// The spec's JSON text.
    pub fn text(&self) -> anyhow::Result<String> {
        let text = match &self.spec {
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?,
            None => "{}".to_string(),
        };
        let Some(dir) = &self.model_dir else {
            return Ok(text);
        };
        let mut spec: Value = serde_json::from_str(&text).with_context(|| {
            format!(
                "reading {}",
                self.spec.as_deref().unwrap_or(Path::new("-")).display()
            )
        })?;
        let Some(map) = spec.as_object_mut() else {
            bail!("the spec must be a JSON object to take --model-dir");
        };
        if map.contains_key("model") {
            bail!(
                "--model-dir gives the spec's model: remove `model` from the spec, or --model-dir"
            );
        }
        map.insert("model".into(), model(dir)?);
        Ok(spec.to_string())
    }
}

/// `{"config": DIR/config.json, "init_from": …}` for the model directory `dir`.
fn model(dir: &Path) -> anyhow::Result<Value> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config: Map<String, Value> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON object", path.display()))?;
    let dir = std::path::absolute(dir).with_context(|| format!("resolving {}", dir.display()))?;
    // One file of weights is what `init_from` names today; a sharded set is named by its
    // directory (its index beside it).
    let single = dir.join("model.safetensors");
    let init_from = if single.is_file() { single } else { dir };
    let Some(init_from) = init_from.to_str() else {
        bail!("{} is not UTF-8", init_from.display());
    };
    Ok(json!({"config": config, "init_from": init_from}))
}
