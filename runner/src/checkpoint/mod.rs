//! Checkpoints and the final export.
//!
//! A checkpoint is a directory `checkpoints/step-NNNNNNNN/` holding `manifest.json` and one
//! safetensors file per rank with that rank's buffers verbatim (parameters, master weights,
//! optimizer states). It is written under a temporary name, every file fsynced, then renamed
//! into place, and only then does the `checkpoints/latest` pointer (itself replaced by an
//! fsynced rename) move to it: a crash at any point leaves the previous checkpoint loadable.
//! Who removes old checkpoints depends on the host: a run on its own keeps the two newest; an
//! agent uploads each file to the server ([`Upload`]) and removes it then.
//!
//! On completion the model is exported in Hugging Face form ([`export`]); a run starts from
//! Hugging Face weights read by [`import`].

pub mod export;
pub mod import;
pub mod merge;
pub mod peft;

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use scheduler::spec::{Dtype as Precision, OptimizerKind, ZeroStage};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::data::Position;
use crate::loss_scale;
use crate::state_tensor::StateTensor;
use crate::tensor_file::TensorFile;
use crate::validation::ValidationLoss;
pub use export::{EXPORT_SHARD_BYTES, ModelFile};
pub use import::{HfWeights, UnitValues, load_hf, load_hf_file, max_hf_file_bytes};
pub use merge::{Base, write_merged};
pub use peft::{adapter_config, load_peft};
use wire::artifact::{Artifact, CHECKPOINTS, MANIFEST_FILE, checkpoint_dir, rank_file, step_name};
pub use wire::artifact::{CONFIG_FILE, INDEX_FILE, MODEL_FILE};

/// Where a run's files go once written, besides its output folder (an agent's: the server's
/// artifact store). Each rank sends its own checkpoint file before the checkpoint is published,
/// rank 0 the manifest once it is, and the export at the end.
pub trait Upload: Send + Sync + std::fmt::Debug {
    fn upload(&self, artifact: Artifact, file: &Path) -> Result<(), Error>;
}

/// Checkpoints a run on its own keeps on disk; older ones are removed once a newer one is in
/// place.
pub const KEEP: usize = 2;

/// Everything besides the ranks' buffers that a resumed run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Optimizer steps taken (including skipped ones): the next step is `step + 1`.
    pub step: u32,
    /// Optimizer updates applied (skipped fp16 steps excluded): Adam's bias-correction count.
    pub applied_steps: u64,
    pub world_size: usize,
    pub zero_stage: ZeroStage,
    /// Sequences in one batch across all ranks (micro-batch × world size): the data position
    /// counts these.
    pub sequences_per_batch: usize,
    pub dtype: Precision,
    pub optimizer: OptimizerKind,
    pub loss_scaler: loss_scale::State,
    pub data: Position,
    /// Losses of the steps so far, so a resumed run reports the whole history.
    pub losses: Vec<f64>,
    /// Validation losses so far, likewise.
    #[serde(default)]
    pub validation: Vec<ValidationLoss>,
    /// Values the job trains: the model's, or a LoRA job's adapters' (its checkpoints hold
    /// only those). Absent in checkpoints written before LoRA jobs were trained, which were all
    /// full fine-tuning's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trained_parameters: Option<u64>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

fn sync_dir(dir: &Path) -> Result<(), Error> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))
}

/// Writes `tensors` as a safetensors file and fsyncs it.
fn write_tensors(path: &Path, tensors: &[StateTensor<'_>]) -> Result<(), Error> {
    let views = tensors
        .iter()
        .map(|t| {
            let elems = t.bytes.len() / t.dtype.bitsize().div_ceil(8).max(1);
            TensorView::new(t.dtype, vec![elems], t.bytes).map(|v| (t.name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| io(path, e))?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| io(path, e))?;
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(path, e))
}

/// Where the checkpoint of `step` is assembled before it is published.
pub fn staging_dir(out: &Path, step: u32) -> PathBuf {
    out.join(CHECKPOINTS)
        .join(format!(".{}.tmp", step_name(step)))
}

/// Where the checkpoint of `step` is published under `out`.
pub fn step_dir(out: &Path, step: u32) -> PathBuf {
    out.join(checkpoint_dir(step))
}

/// Starts assembling a checkpoint in `tmp` (rank 0, before the ranks write).
pub fn begin(tmp: &Path) -> Result<(), Error> {
    if tmp.exists() {
        fs::remove_dir_all(tmp).map_err(|e| io(tmp, e))?;
    }
    fs::create_dir_all(tmp).map_err(|e| io(tmp, e))
}

/// Writes one rank's buffers into the checkpoint being assembled in `tmp`.
/// On a node without rank 0 (whose folder rank 0 never made), the folder is made here.
/// Returns the file written.
pub fn write_rank(tmp: &Path, rank: usize, tensors: &[StateTensor<'_>]) -> Result<PathBuf, Error> {
    fs::create_dir_all(tmp).map_err(|e| io(tmp, e))?;
    let path = tmp.join(rank_file(rank));
    write_tensors(&path, tensors)?;
    Ok(path)
}

/// Publishes the checkpoint assembled in `tmp` (rank 0, after every rank wrote): writes the
/// manifest, renames the directory into place and moves `latest` to it.
pub fn publish(out: &Path, tmp: &Path, manifest: &Manifest) -> Result<(), Error> {
    let root = out.join(CHECKPOINTS);
    let manifest_path = tmp.join(MANIFEST_FILE);
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| io(&manifest_path, e))?;
    write_synced(&manifest_path, &json)?;
    sync_dir(tmp)?;
    let name = step_name(manifest.step);
    let dir = root.join(&name);
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
    }
    fs::rename(tmp, &dir).map_err(|e| io(&dir, e))?;
    sync_dir(&root)?;
    let pointer = root.join("latest");
    let pointer_tmp = root.join(".latest.tmp");
    write_synced(&pointer_tmp, name.as_bytes())?;
    fs::rename(&pointer_tmp, &pointer).map_err(|e| io(&pointer, e))?;
    sync_dir(&root)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let mut f = File::create(path).map_err(|e| io(path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| io(path, e))
}

/// Removes all but the newest `keep` checkpoints under `out`, and leftovers of interrupted
/// writes.
pub fn keep_newest(out: &Path, keep: usize) -> Result<(), Error> {
    let root = out.join(CHECKPOINTS);
    let mut published = step_dirs(&root)?;
    published.sort_unstable();
    let oldest_kept = published
        .len()
        .checked_sub(keep)
        .map_or(published.first(), |i| published.get(i))
        .copied();
    remove_steps(&root, |step| oldest_kept.is_none_or(|kept| step < kept))?;
    for leftover in names(&root)?
        .into_iter()
        .filter(|n| n.starts_with(".step-") && n.ends_with(".tmp"))
    {
        let path = root.join(leftover);
        fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

fn remove_steps(root: &Path, remove: impl Fn(u32) -> bool) -> Result<(), Error> {
    for step in step_dirs(root)?.into_iter().filter(|&s| remove(s)) {
        let dir = root.join(step_name(step));
        fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
    }
    Ok(())
}

/// The steps of the checkpoints published in `root`.
fn step_dirs(root: &Path) -> Result<Vec<u32>, Error> {
    Ok(names(root)?
        .iter()
        .filter_map(|n| n.strip_prefix("step-")?.parse().ok())
        .collect())
}

/// The entries of `root`, none if it does not exist.
fn names(root: &Path) -> Result<Vec<String>, Error> {
    match fs::read_dir(root) {
        Ok(entries) => Ok(entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(io(root, e)),
    }
}

/// The checkpoint `checkpoints/latest` points to, if any.
pub fn latest(out: &Path) -> Result<Option<PathBuf>, Error> {
    let pointer = out.join(CHECKPOINTS).join("latest");
    match fs::read_to_string(&pointer) {
        Ok(name) => Ok(Some(out.join(CHECKPOINTS).join(name.trim()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&pointer, e)),
    }
}

pub fn load_manifest(dir: &Path) -> Result<Manifest, Error> {
    let path = dir.join(MANIFEST_FILE);
    let text = fs::read(&path).map_err(|e| io(&path, e))?;
    serde_json::from_slice(&text).map_err(|e| io(&path, e))
}

/// Opens `rank`'s file of the checkpoint in `dir` and hands it to `read`.
pub fn read_rank(
    dir: &Path,
    rank: usize,
    read: impl FnOnce(&TensorFile) -> Result<(), String>,
) -> Result<(), Error> {
    let path = dir.join(rank_file(rank));
    let file = File::open(&path).map_err(|e| io(&path, e))?;
    let file = TensorFile::new(file).map_err(|e| io(&path, e))?;
    read(&file).map_err(|e| io(&path, e))
}

/// Fills `tensors` from `rank`'s file of the checkpoint in `dir`, each read straight into its
/// buffer: every name must be there with the same dtype and size.
pub fn load_rank(dir: &Path, rank: usize, tensors: &mut [StateTensor<'_>]) -> Result<(), Error> {
    read_rank(dir, rank, |file| {
        for t in tensors.iter_mut() {
            let info = file
                .info(&t.name)
                .ok_or_else(|| format!("{}: missing", t.name))?;
            let bytes = info.data_offsets.1 - info.data_offsets.0;
            if info.dtype != t.dtype || bytes != t.bytes.len() {
                return Err(format!(
                    "{} is {:?} of {bytes} bytes; this run needs {:?} of {} bytes",
                    t.name,
                    info.dtype,
                    t.dtype,
                    t.bytes.len()
                ));
            }
            file.read(&t.name, 0, t.bytes)?;
        }
        Ok(())
    })
}
