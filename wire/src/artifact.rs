//! The names of a job's files, as the trainer writes them, agents upload them and the server
//! stores and lists them: `checkpoints/step-NNNNNNNN/manifest.json` and
//! `checkpoints/step-NNNNNNNN/rank-KKKKK.safetensors` for a checkpoint, `model.safetensors` and
//! `config.json` for the final export, or for an export sharded as Hugging Face shards one,
//! `model-KKKKK-of-NNNNN.safetensors` and `model.safetensors.index.json` in place of
//! `model.safetensors`; a LoRA job's export is PEFT's `adapter_model.safetensors` and
//! `adapter_config.json`, with its merged model as `merged/model.safetensors` and
//! `merged/config.json`. Anything else is not an artifact, so an agent cannot write outside a
//! job's folder in the store.

/// The files of the final export (Hugging Face form).
pub const MODEL_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";
/// The export of a LoRA job: the adapter in PEFT's form (`PeftModel.from_pretrained` loads it).
pub const ADAPTER_MODEL_FILE: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// A LoRA job's merged model (`W + (alpha/rank)·B·A`), in Hugging Face form beside its adapter.
pub const MERGED_MODEL_FILE: &str = "merged/model.safetensors";
pub const MERGED_CONFIG_FILE: &str = "merged/config.json";
/// The index of a sharded export (or of any sharded Hugging Face weights): which file holds
/// each tensor.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// What a checkpoint holds besides the ranks' files.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The folder of checkpoints, under a run's output folder.
pub const CHECKPOINTS: &str = "checkpoints";

/// `step-00000010`: a checkpoint's folder under [`CHECKPOINTS`].
pub fn step_name(step: u32) -> String {
    format!("step-{step:08}")
}

/// `checkpoints/step-00000010`: a checkpoint's folder under a run's output folder (and under
/// an attempt's in the artifact store), as a spec's `resume_from` names it.
pub fn checkpoint_dir(step: u32) -> String {
    scheduler::spec::checkpoint_artifact(step)
}

/// `name` as one segment of a URL path: unreserved characters as they are, every other byte
/// percent-encoded (so the `/`s of a checkpoint file's name become `%2F`).
pub fn url_segment(name: &str) -> String {
    let mut s = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// `rank-00003.safetensors`: one rank's buffers in a checkpoint.
pub fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// `model-00002-of-00005.safetensors`: file `index` (from 1) of a sharded export of `count`
/// files, as transformers' `save_pretrained` names them.
pub fn shard_file(index: u32, count: u32) -> String {
    format!("model-{index:05}-of-{count:05}.safetensors")
}

/// One file of a job, parsed from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Artifact {
    /// A checkpoint's manifest.
    Manifest {
        step: u32,
    },
    /// A checkpoint's file of one rank.
    Rank {
        step: u32,
        rank: usize,
    },
    Model,
    Config,
    /// A LoRA job's adapter weights and config (PEFT's files).
    Adapter,
    AdapterConfig,
    /// A LoRA job's merged model and its config, under `merged/`.
    MergedModel,
    MergedConfig,
    /// The index of a sharded export.
    Index,
    /// File `index` of the `count` (at least 2) of a sharded export; `1 <= index <= count`.
    Shard {
        index: u32,
        count: u32,
    },
}

impl Artifact {
    /// The artifact `name` is, if it is one (the exact spelling the trainer writes).
    pub fn parse(name: &str) -> Option<Artifact> {
        match name {
            MODEL_FILE => return Some(Artifact::Model),
            CONFIG_FILE => return Some(Artifact::Config),
            ADAPTER_MODEL_FILE => return Some(Artifact::Adapter),
            ADAPTER_CONFIG_FILE => return Some(Artifact::AdapterConfig),
            MERGED_MODEL_FILE => return Some(Artifact::MergedModel),
            MERGED_CONFIG_FILE => return Some(Artifact::MergedConfig),
            INDEX_FILE => return Some(Artifact::Index),
            _ => {}
        }
        if let Some(rest) = name.strip_prefix("model-") {
            let (index, count) = rest.strip_suffix(".safetensors")?.split_once("-of-")?;
            let (index, count) = (digits(index, 5)?, digits(count, 5)?);
            return (1 <= index && index <= count && count >= 2)
                .then_some(Artifact::Shard { index, count });
        }
        let rest = name.strip_prefix(CHECKPOINTS)?.strip_prefix("/step-")?;
        let (step, file) = rest.split_once('/')?;
        let step = digits(step, 8)?;
        if file == MANIFEST_FILE {
            return Some(Artifact::Manifest { step });
        }
        let rank = digits(file.strip_prefix("rank-")?.strip_suffix(".safetensors")?, 5)?;
        Some(Artifact::Rank {
            step,
            rank: rank as usize,
        })
    }

    /// Its name (the inverse of [`Artifact::parse`]).
    pub fn name(self) -> String {
        match self {
            Artifact::Manifest { step } => format!("{}/{MANIFEST_FILE}", checkpoint_dir(step)),
            Artifact::Rank { step, rank } => {
                format!("{}/{}", checkpoint_dir(step), rank_file(rank))
            }
            Artifact::Model => MODEL_FILE.into(),
            Artifact::Config => CONFIG_FILE.into(),
            Artifact::Adapter => ADAPTER_MODEL_FILE.into(),
            Artifact::AdapterConfig => ADAPTER_CONFIG_FILE.into(),
            Artifact::MergedModel => MERGED_MODEL_FILE.into(),
            Artifact::MergedConfig => MERGED_CONFIG_FILE.into(),
            Artifact::Index => INDEX_FILE.into(),
            Artifact::Shard { index, count } => shard_file(index, count),
        }
    }

    /// The checkpoint step it belongs to; `None` for the export.
    pub fn step(self) -> Option<u32> {
        match self {
            Artifact::Manifest { step } | Artifact::Rank { step, .. } => Some(step),
            Artifact::Model
            | Artifact::Config
            | Artifact::Adapter
            | Artifact::AdapterConfig
            | Artifact::MergedModel
            | Artifact::MergedConfig
            | Artifact::Index
            | Artifact::Shard { .. } => None,
        }
    }

    /// Whether it is a file of the export's weights: `model.safetensors`, or a sharded
    /// export's index or one of its shards.
    pub fn is_weights(self) -> bool {
        matches!(
            self,
            Artifact::Model | Artifact::Index | Artifact::Shard { .. }
        )
    }

    /// The step of the checkpoint the file `name` belongs to; `None` for the export and for
    /// names that are no artifact's.
    pub fn step_of(name: &str) -> Option<u32> {
        Artifact::parse(name).and_then(Artifact::step)
    }

    /// The files a checkpoint of `step` by `world_size` ranks is complete with.
    pub fn checkpoint(step: u32, world_size: usize) -> impl Iterator<Item = Artifact> {
        std::iter::once(Artifact::Manifest { step })
            .chain((0..world_size).map(move |rank| Artifact::Rank { step, rank }))
    }
}

/// `s` as a number if it is exactly `width` decimal digits.
fn digits(s: &str, width: usize) -> Option<u32> {
    (s.len() == width && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_itself() {
        let all = [
            Artifact::Manifest { step: 10 },
            Artifact::Rank { step: 10, rank: 3 },
            Artifact::Model,
            Artifact::Config,
            Artifact::Adapter,
            Artifact::AdapterConfig,
            Artifact::MergedModel,
            Artifact::MergedConfig,
            Artifact::Index,
            Artifact::Shard { index: 1, count: 2 },
            Artifact::Shard {
                index: 99999,
                count: 99999,
            },
        ];
        for a in all {
            assert_eq!(Artifact::parse(&a.name()), Some(a), "{}", a.name());
        }
        assert_eq!(
            Artifact::Rank { step: 7, rank: 2 }.name(),
            "checkpoints/step-00000007/rank-00002.safetensors"
        );
    }

    #[test]
    fn shards_are_named_as_transformers_names_them() {
        assert_eq!(
            Artifact::Shard { index: 2, count: 5 }.name(),
            "model-00002-of-00005.safetensors"
        );
        assert_eq!(
            Artifact::parse("model-00003-of-00003.safetensors"),
            Some(Artifact::Shard { index: 3, count: 3 })
        );
        assert_eq!(
            Artifact::parse("model.safetensors.index.json"),
            Some(Artifact::Index)
        );
        for name in [MODEL_FILE, INDEX_FILE, "model-00001-of-00002.safetensors"] {
            let a = Artifact::parse(name).unwrap();
            assert!(a.is_weights() && a.step().is_none(), "{name}");
        }
        assert!(!Artifact::Config.is_weights());
        assert!(!Artifact::Manifest { step: 1 }.is_weights());
    }

    #[test]
    fn shard_names_out_of_range_or_misspelt_are_not_artifacts() {
        for name in [
            // K > N, K = 0, a set of one.
            "model-00003-of-00002.safetensors",
            "model-00000-of-00002.safetensors",
            "model-00001-of-00001.safetensors",
            "model-00000-of-00000.safetensors",
            // Other digit counts.
            "model-1-of-2.safetensors",
            "model-0001-of-00002.safetensors",
            "model-00001-of-0002.safetensors",
            "model-000001-of-00002.safetensors",
            "model-00001-of-000002.safetensors",
            // Not digits, other separators, other suffixes.
            "model-0000a-of-00002.safetensors",
            "model-+0001-of-00002.safetensors",
            "model-00001_of_00002.safetensors",
            "model-00001-of-00002.bin",
            "model-00001-of-00002.safetensors.tmp",
            ".model-00001-of-00002.safetensors.tmp",
            "model-00001-of-00002",
            "model-00001-of-00002-of-00003.safetensors",
            // Paths.
            "x/model-00001-of-00002.safetensors",
            "../model-00001-of-00002.safetensors",
            "/model-00001-of-00002.safetensors",
            "model-00001-of-00002.safetensors/x",
            "model-00001/of-00002.safetensors",
            "model-00001-of-00002\\.safetensors",
            "checkpoints/step-00000010/model-00001-of-00002.safetensors",
            // The index, misspelt.
            "model.safetensors.index.json.tmp",
            "x/model.safetensors.index.json",
            "pytorch_model.bin.index.json",
        ] {
            assert_eq!(Artifact::parse(name), None, "{name:?}");
        }
    }

    #[test]
    fn a_checkpoint_folder_is_the_steps_folder_under_checkpoints() {
        assert_eq!(
            checkpoint_dir(10),
            format!("{CHECKPOINTS}/{}", step_name(10))
        );
    }

    #[test]
    fn slashes_in_names_are_percent_encoded() {
        assert_eq!(
            url_segment("checkpoints/step-00000020/manifest.json"),
            "checkpoints%2Fstep-00000020%2Fmanifest.json"
        );
        assert_eq!(url_segment("model.safetensors"), "model.safetensors");
    }

    #[test]
    fn names_outside_a_jobs_files_are_not_artifacts() {
        for name in [
            "",
            "model.safetensors/x",
            "../model.safetensors",
            "checkpoints/step-00000010/../../etc/passwd",
            "checkpoints/step-10/manifest.json",
            "checkpoints/step-0000001a/manifest.json",
            "checkpoints/step-00000010/rank-1.safetensors",
            "checkpoints/step-00000010/rank-00001.safetensors.tmp",
            "checkpoints/.step-00000010.tmp/manifest.json",
            "/model.safetensors",
            "token",
        ] {
            assert_eq!(Artifact::parse(name), None, "{name:?}");
        }
    }
}
