//! The names of a job's files, as the trainer writes them, agents upload them and the server
//! stores and lists them: `checkpoints/step-NNNNNNNN/manifest.json` and
//! `checkpoints/step-NNNNNNNN/rank-KKKKK.safetensors` for a checkpoint, `model.safetensors` and
//! `config.json` for the final export. Anything else is not an artifact, so an agent cannot
//! write outside a job's folder in the store.

/// The files of the final export (Hugging Face GPT-2).
pub const MODEL_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";
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
}

impl Artifact {
    /// The artifact `name` is, if it is one (the exact spelling the trainer writes).
    pub fn parse(name: &str) -> Option<Artifact> {
        match name {
            MODEL_FILE => return Some(Artifact::Model),
            CONFIG_FILE => return Some(Artifact::Config),
            _ => {}
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
        }
    }

    /// The checkpoint step it belongs to; `None` for the export.
    pub fn step(self) -> Option<u32> {
        match self {
            Artifact::Manifest { step } | Artifact::Rank { step, .. } => Some(step),
            Artifact::Model | Artifact::Config => None,
        }
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
