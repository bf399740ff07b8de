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
//! On completion the model is exported in Hugging Face form, the family's state-dict names in
//! fp32 (GPT-2's `transformer.`-prefixed, its LM head tied): `model.safetensors`, or past
//! [`EXPORT_SHARD_BYTES`] (or the limit the host sets) transformers' sharded layout, and
//! `config.json` ([`ModelFile`]).

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use scheduler::bytes::human;
use scheduler::model::{ModelShape, ModelTensor, ParamTensor, Units};
use scheduler::spec::{Dtype as Precision, OptimizerKind, ZeroStage};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::data::{DataRoots, Position, describe};
use crate::device::{Cpu, Device};
use crate::loss_scale;
use crate::tensor_file::TensorFile;
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
    pub validation: Vec<crate::train::ValidationLoss>,
}

/// One named buffer of a rank's state, as bytes on device `D` (files are written and read
/// from host ones: [`on_host`]).
pub struct StateTensor<'a, D: Device = Cpu> {
    pub name: String,
    pub dtype: Dtype,
    pub bytes: D::ViewMut<'a, u8>,
}

/// Lets `f` read and write every tensor as host bytes (the CPU hands them over; a GPU copies
/// them out, and back after `f`).
pub fn on_host<D: Device, R>(
    dev: &D,
    tensors: Vec<StateTensor<'_, D>>,
    f: impl FnOnce(&mut [StateTensor<'_>]) -> R,
) -> Result<R, Error> {
    let mut f = Some(f);
    let mut tensors = tensors;
    tensors.reverse();
    nest(dev, tensors, Vec::new(), &mut |host| {
        (f.take().expect("called once"))(host)
    })
}

/// Takes the tensors one by one onto the host (`rest` reversed), then calls `f` with all.
fn nest<D: Device, R>(
    dev: &D,
    mut rest: Vec<StateTensor<'_, D>>,
    done: Vec<(String, Dtype, &mut [u8])>,
    f: &mut dyn FnMut(&mut [StateTensor<'_>]) -> R,
) -> Result<R, Error> {
    let Some(StateTensor { name, dtype, bytes }) = rest.pop() else {
        let mut host: Vec<StateTensor<'_>> = done
            .into_iter()
            .map(|(name, dtype, bytes)| StateTensor { name, dtype, bytes })
            .collect();
        return Ok(f(&mut host));
    };
    dev.on_host(bytes, move |host| {
        let mut done = done;
        done.push((name, dtype, host));
        nest(dev, rest, done, f)
    })?
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

/// The largest file the export writes unless told otherwise (2 GB, decimal): a larger export
/// is sharded ([`ModelFile`]).
pub const EXPORT_SHARD_BYTES: u64 = 2_000_000_000;

/// The Hugging Face export (the family's state-dict names, fp32), written in place as the
/// ranks' shards arrive: the headers come from the shape alone, and each unit's values,
/// concatenated in unit order, are written where they belong, so no rank ever holds the whole
/// model. It is one `model.safetensors`, or, where that file would be larger than the limit,
/// the shards `model-KKKKK-of-NNNNN.safetensors` (the same tensors in the same order, each file
/// at most the limit unless it holds a single larger tensor) and `model.safetensors.index.json`,
/// as transformers' `save_pretrained` writes them.
pub struct ModelFile {
    out: PathBuf,
    /// The `config.json` written beside it.
    config: serde_json::Map<String, serde_json::Value>,
    /// The files, under temporary names until [`ModelFile::finish`].
    files: Vec<Part>,
    /// Per unit, where each of its tensors' values go.
    places: Vec<Vec<Place>>,
    /// The index of a sharded export, written once every shard is in place.
    index: Option<Vec<u8>>,
}

/// One file of the export being written.
struct Part {
    artifact: Artifact,
    tmp: PathBuf,
    file: File,
}

/// Where elements `elems` of a unit (one tensor) lie: in file `file` from byte `offset` on.
struct Place {
    elems: std::ops::Range<usize>,
    file: usize,
    offset: u64,
}

/// One tensor of the export, in file order.
struct ExportTensor {
    name: String,
    dims: Vec<usize>,
    unit: usize,
    /// Its elements within the unit.
    elems: std::ops::Range<usize>,
}

impl ExportTensor {
    fn bytes(&self) -> u64 {
        4 * self.elems.len() as u64
    }

    /// Its safetensors header entry, its values starting `begin` bytes into the file's data.
    fn header_entry(&self, begin: u64) -> serde_json::Value {
        serde_json::json!({
            "dtype": "F32",
            "shape": self.dims,
            "data_offsets": [begin, begin + self.bytes()],
        })
    }
}

/// The metadata every file of the export carries, as transformers' writes it.
fn export_metadata() -> serde_json::Value {
    serde_json::json!({ "format": "pt" })
}

/// The size of a safetensors file as tensors are added to it: its header's JSON (compact, as
/// `serde_json::to_vec` writes it) and its data.
#[derive(Debug, Clone, Copy)]
struct FileSize {
    json: u64,
    data: u64,
}

impl FileSize {
    /// A file with only the metadata: `{"__metadata__":{…}}`.
    fn new() -> FileSize {
        let json = serde_json::json!({ "__metadata__": export_metadata() }).to_string();
        FileSize {
            json: json.len() as u64,
            data: 0,
        }
    }

    /// The file with `t` added: `,"NAME":{…}` more header, and its values.
    fn with(self, t: &ExportTensor) -> FileSize {
        let name = serde_json::Value::from(t.name.as_str()).to_string();
        let entry = t.header_entry(self.data).to_string();
        FileSize {
            json: self.json + 1 + name.len() as u64 + 1 + entry.len() as u64,
            data: self.data + t.bytes(),
        }
    }

    /// Bytes on disk: the header's length, the header padded to 8 bytes, the data.
    fn total(self) -> u64 {
        8 + self.json.next_multiple_of(8) + self.data
    }
}

/// The export's tensors dealt into files of at most `limit` bytes each, in order: a file is
/// closed when the next tensor would take it past the limit, and a tensor larger than the
/// limit on its own gets a file of its own. Each range is one file's tensors.
fn deal(tensors: &[ExportTensor], limit: u64) -> Vec<std::ops::Range<usize>> {
    let mut files = Vec::new();
    let (mut start, mut size) = (0, FileSize::new());
    for (i, t) in tensors.iter().enumerate() {
        let grown = size.with(t);
        if grown.total() > limit && i > start {
            files.push(start..i);
            (start, size) = (i, FileSize::new().with(t));
        } else {
            size = grown;
        }
    }
    files.push(start..tensors.len());
    files
}

/// A safetensors header for `tensors` in order, padded with spaces to a multiple of 8 bytes
/// as safetensors' own writer pads it.
fn export_header(tensors: &[ExportTensor], path: &Path) -> Result<Vec<u8>, Error> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), export_metadata());
    let mut at = 0;
    for t in tensors {
        header.insert(t.name.clone(), t.header_entry(at));
        at += t.bytes();
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| io(path, e))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    Ok(json)
}

impl ModelFile {
    /// Creates the export's files under temporary names in `out` and writes their headers:
    /// shards of at most `shard_bytes` each where one file would be larger. `config` is the
    /// `config.json` [`ModelFile::finish`] writes beside them.
    pub fn create(
        out: &Path,
        model: &ModelShape,
        config: &serde_json::Map<String, serde_json::Value>,
        shard_bytes: u64,
    ) -> Result<ModelFile, Error> {
        fs::create_dir_all(out).map_err(|e| io(out, e))?;
        let layout = model.units(1);
        let tensors: Vec<ExportTensor> = layout
            .iter()
            .enumerate()
            .flat_map(|(u, unit)| {
                unit.tensors.iter().map(move |t| ExportTensor {
                    name: t.kind.state_dict_name(unit.layer()),
                    dims: t.dims.to_vec(),
                    unit: u,
                    elems: t.range(),
                })
            })
            .collect();
        let dealt = deal(&tensors, shard_bytes);
        let count = dealt.len() as u32;
        let artifact = |k: usize| match count {
            1 => Artifact::Model,
            _ => Artifact::Shard {
                index: k as u32 + 1,
                count,
            },
        };
        let mut files = Vec::with_capacity(dealt.len());
        let mut places: Vec<Vec<Place>> = layout.iter().map(|_| Vec::new()).collect();
        // By name, as transformers writes it.
        let mut weight_map = std::collections::BTreeMap::new();
        for (k, range) in dealt.iter().enumerate() {
            let artifact = artifact(k);
            let name = artifact.name();
            let tmp = out.join(format!(".{name}.tmp"));
            let json = export_header(&tensors[range.clone()], &tmp)?;
            let mut file = File::create(&tmp).map_err(|e| io(&tmp, e))?;
            file.write_all(&(json.len() as u64).to_le_bytes())
                .and_then(|_| file.write_all(&json))
                .map_err(|e| io(&tmp, e))?;
            let mut offset = 8 + json.len() as u64;
            for t in &tensors[range.clone()] {
                places[t.unit].push(Place {
                    elems: t.elems.clone(),
                    file: k,
                    offset,
                });
                offset += t.bytes();
                weight_map.insert(t.name.as_str(), name.clone());
            }
            files.push(Part {
                artifact,
                tmp,
                file,
            });
        }
        let index = if count > 1 {
            let total_size: u64 = tensors.iter().map(ExportTensor::bytes).sum();
            let index = serde_json::json!({
                "metadata": { "total_size": total_size },
                "weight_map": weight_map,
            });
            let mut text =
                serde_json::to_vec_pretty(&index).map_err(|e| io(&out.join(INDEX_FILE), e))?;
            text.push(b'\n');
            Some(text)
        } else {
            None
        };
        Ok(ModelFile {
            out: out.to_path_buf(),
            config: config.clone(),
            files,
            places,
            index,
        })
    }

    /// Writes `values` as elements `at..` of unit `unit`.
    pub fn write(&self, unit: usize, at: usize, values: &[f32]) -> Result<(), Error> {
        use std::os::unix::fs::FileExt;
        let end = at + values.len();
        for place in &self.places[unit] {
            let (from, to) = (at.max(place.elems.start), end.min(place.elems.end));
            if from >= to {
                continue;
            }
            let part = &self.files[place.file];
            let offset = place.offset + 4 * (from - place.elems.start) as u64;
            part.file
                .write_all_at(bytemuck::cast_slice(&values[from - at..to - at]), offset)
                .map_err(|e| io(&part.tmp, e))?;
        }
        Ok(())
    }

    /// Syncs the files, renames them into place (a sharded export's index last, so the set
    /// is complete once it names it) and writes `config.json` beside them; the files written,
    /// in that order. Weights an earlier export left in `out` that these do not replace are
    /// removed first, so the folder never holds two exports' weights.
    pub fn finish(self) -> Result<Vec<(Artifact, PathBuf)>, Error> {
        for part in &self.files {
            part.file.sync_all().map_err(|e| io(&part.tmp, e))?;
        }
        for name in names(&self.out)? {
            let stale = Artifact::parse(&name).is_some_and(|a| {
                a.is_weights()
                    && (a == Artifact::Index || !self.files.iter().any(|p| p.artifact == a))
            });
            if stale {
                let path = self.out.join(name);
                fs::remove_file(&path).map_err(|e| io(&path, e))?;
            }
        }
        let mut written = Vec::new();
        for part in self.files {
            let path = self.out.join(part.artifact.name());
            fs::rename(&part.tmp, &path).map_err(|e| io(&path, e))?;
            written.push((part.artifact, path));
        }
        if let Some(index) = &self.index {
            let path = self.out.join(INDEX_FILE);
            let tmp = self.out.join(format!(".{INDEX_FILE}.tmp"));
            write_synced(&tmp, index)?;
            fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
            written.push((Artifact::Index, path));
        }
        let path = self.out.join(CONFIG_FILE);
        let text = serde_json::to_vec_pretty(&self.config).map_err(|e| io(&path, e))?;
        write_synced(&path, &text)?;
        written.push((Artifact::Config, path));
        sync_dir(&self.out)?;
        Ok(written)
    }
}

/// Bytes of safetensors header allowed per tensor (its JSON entry: name, dtype, shape and
/// offsets take about 100).
const HEADER_BYTES_PER_TENSOR: u64 = 256;

/// The largest Hugging Face weights file of `model` that `load_hf` reads: every tensor in
/// fp32, plus what such files may also carry (`ModelShape::hf_extra`: GPT-2's causal masks, a
/// tied `lm_head.weight`, RoPE's `inv_freq`), and a header of `HEADER_BYTES_PER_TENSOR` per
/// tensor and 4 KiB of metadata. The file is read whole, so this bounds what reading it adds
/// to the process.
pub fn max_hf_file_bytes(model: &ModelShape) -> u64 {
    let units = model.units(1);
    let tensors: u64 = units.iter().map(|u| u.tensors.len() as u64).sum();
    let values: u64 = units.iter().map(|u| u.len as u64).sum();
    let (extra_values, extra_tensors) = model.hf_extra();
    8 + 4 * (values + extra_values) + HEADER_BYTES_PER_TENSOR * (tensors + extra_tensors) + 4096
}

/// Hugging Face weights of a model, one file or a sharded set, checked and read a chunk at a
/// time: GPT-2's names with or without the `transformer.` prefix, tensors that are not
/// parameters here skipped (`ModelShape::ignores_hf_tensor`), tensors in F32, F16 or BF16.
#[derive(Debug)]
pub struct HfWeights {
    files: Vec<TensorFile>,
    /// The weights, as errors name them.
    what: String,
    layout: Units<ModelTensor>,
    /// Per unit, per tensor: the file holding it and its name there.
    names: Vec<Vec<(usize, String)>>,
}

/// Largest index read (Llama-3.1-405B's is under 100 KiB).
const MAX_INDEX_BYTES: u64 = 4 << 20;

/// The files of a sharded set, from its index: the distinct values of `weight_map`, each a
/// plain file name beside the index.
fn shard_names(index: &[u8]) -> Result<Vec<String>, String> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let index: Index =
        serde_json::from_slice(index).map_err(|e| format!("not a safetensors index: {e}"))?;
    let mut files: Vec<String> = index.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    match files.iter().find(|f| {
        f.contains('/') || f.contains('\\') || f.starts_with('.') || !f.ends_with(".safetensors")
    }) {
        Some(_) => Err("names a file that is not a .safetensors file beside it".into()),
        None if files.is_empty() => Err("names no files".into()),
        None => Ok(files),
    }
}

/// Values read from the file at a time (64 KiB of f32).
const READ_CHUNK: usize = 1 << 14;

/// The spec's `model.init_from` (a weights file, or a Hugging Face model directory holding
/// `model.safetensors` or a sharded set with its `model.safetensors.index.json`), every file
/// opened only inside `roots`; weights larger than `max_hf_file_bytes` are refused before a
/// byte of them is read.
pub fn load_hf(roots: &DataRoots, path: &str, model: &ModelShape) -> Result<HfWeights, Error> {
    const FIELD: &str = "model.init_from";
    if !roots.resolve(FIELD, path)?.is_dir() {
        let (_, file) = roots.open(FIELD, path)?;
        return HfWeights::new(vec![file], describe(FIELD, path), model);
    }
    let dir = path.trim_end_matches('/');
    let single = format!("{dir}/{MODEL_FILE}");
    if roots.resolve(FIELD, &single).is_ok() {
        let (_, file) = roots.open(FIELD, &single)?;
        return HfWeights::new(vec![file], describe(FIELD, &single), model);
    }
    let index = format!("{dir}/{INDEX_FILE}");
    let what = describe(FIELD, &index);
    let (_, file) = roots.open(FIELD, &index).map_err(|_| Error::Data {
        what: describe(FIELD, path),
        reason: format!("a model directory holds {MODEL_FILE} or {INDEX_FILE}; this holds neither"),
    })?;
    load_sharded(&file, what, model, |name| {
        Ok(roots.open(FIELD, &format!("{dir}/{name}"))?.1)
    })
}

/// The sharded set whose index is `index` (at most `MAX_INDEX_BYTES` of it read; `what` names
/// it in errors), each file it names opened by `open`.
fn load_sharded(
    index: &File,
    what: String,
    model: &ModelShape,
    open: impl Fn(&str) -> Result<File, Error>,
) -> Result<HfWeights, Error> {
    let fail = |reason: String| Error::Data {
        what: what.clone(),
        reason,
    };
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(index, MAX_INDEX_BYTES + 1),
        &mut bytes,
    )
    .map_err(|e| fail(format!("cannot read: {}", e.kind())))?;
    if bytes.len() as u64 > MAX_INDEX_BYTES {
        return Err(fail(format!("larger than {}", human(MAX_INDEX_BYTES))));
    }
    let files = shard_names(&bytes)
        .map_err(fail)?
        .iter()
        .map(|name| open(name))
        .collect::<Result<Vec<_>, Error>>()?;
    HfWeights::new(files, what, model)
}

/// [`load_hf`] of a file (or model directory) the host fetched itself (an agent: another
/// job's export, from the server), read wherever it is.
pub fn load_hf_file(path: &Path, model: &ModelShape) -> Result<HfWeights, Error> {
    let open = |path: &Path| {
        File::open(path).map_err(|e| Error::Data {
            what: path.display().to_string(),
            reason: format!("cannot open: {}", e.kind()),
        })
    };
    let single = path.join(MODEL_FILE);
    if path.is_dir() && !single.exists() {
        // A sharded set: its index names the files beside it.
        let index = path.join(INDEX_FILE);
        let what = index.display().to_string();
        return load_sharded(&open(&index)?, what, model, |name| open(&path.join(name)));
    }
    let path = if path.is_dir() {
        single
    } else {
        path.to_path_buf()
    };
    HfWeights::new(vec![open(&path)?], path.display().to_string(), model)
}

impl HfWeights {
    fn new(files: Vec<File>, what: String, model: &ModelShape) -> Result<HfWeights, Error> {
        let fail = |reason: String| Error::Data {
            what: what.clone(),
            reason,
        };
        let limit = max_hf_file_bytes(model);
        let mut size = 0;
        for file in &files {
            size += file
                .metadata()
                .map_err(|e| fail(format!("cannot read its size: {}", e.kind())))?
                .len();
        }
        if size > limit {
            return Err(fail(format!(
                "larger than a weights file of this model can be ({} at most)",
                human(limit)
            )));
        }
        let files = files
            .into_iter()
            .map(TensorFile::new)
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let layout = model.units(1);
        // Each tensor by its full state-dict name, or (GPT-2) without the model's prefix.
        let candidates = |kind: ModelTensor, layer| {
            let full = kind.state_dict_name(layer);
            let local = kind.hf_name(layer);
            if full == local {
                vec![full]
            } else {
                vec![full, local]
            }
        };
        let known: Vec<String> = layout
            .iter()
            .flat_map(|u| u.tensors.iter().flat_map(|t| candidates(t.kind, u.layer())))
            .collect();
        let unexpected = files
            .iter()
            .flat_map(TensorFile::names)
            .filter(|n| !model.ignores_hf_tensor(n) && !known.iter().any(|k| k == n))
            .count();
        if unexpected > 0 {
            // Their names are the file's content: count them only.
            return Err(fail(format!(
                "has {unexpected} tensor(s) this model does not have"
            )));
        }
        let mut names = Vec::new();
        for unit in layout.iter() {
            let mut unit_names = Vec::new();
            for t in &unit.tensors {
                let name = t.kind.hf_name(unit.layer());
                let (in_file, info) = candidates(t.kind, unit.layer())
                    .into_iter()
                    .find_map(|n| {
                        let (f, info) = files
                            .iter()
                            .enumerate()
                            .find_map(|(f, file)| Some((f, file.info(&n)?.clone())))?;
                        Some(((f, n), info))
                    })
                    .ok_or_else(|| fail(format!("missing tensor {name}")))?;
                let want = t.dims.to_vec();
                if info.shape != want {
                    return Err(fail(format!(
                        "{name} has shape {:?}; the model needs {want:?}",
                        info.shape
                    )));
                }
                if !matches!(info.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                    return Err(fail(format!(
                        "{name} is {:?}; expected F32, F16 or BF16",
                        info.dtype
                    )));
                }
                unit_names.push(in_file);
            }
            names.push(unit_names);
        }
        Ok(HfWeights {
            files,
            what,
            layout,
            names,
        })
    }

    /// Unit `u`'s values in order (`len` of them, no padding), read a chunk at a time; a read
    /// that fails ends them early, and [`UnitValues::result`] says why.
    pub fn unit(&self, u: usize) -> UnitValues<'_> {
        let unit = self.layout.iter().nth(u).expect("a unit of the layout");
        UnitValues {
            weights: self,
            tensors: &unit.tensors,
            names: &self.names[u],
            tensor: 0,
            at: 0,
            bytes: Vec::new(),
            chunk: Vec::new(),
            pos: 0,
            error: None,
        }
    }

    /// Unit `u`'s values, whole (for checks; the trainer streams them).
    pub fn unit_values(&self, u: usize) -> Result<Vec<f32>, Error> {
        let mut values = self.unit(u);
        let out: Vec<f32> = values.by_ref().collect();
        values.result().map(|()| out)
    }
}

/// The values of one unit of [`HfWeights`], as an iterator.
pub struct UnitValues<'a> {
    weights: &'a HfWeights,
    tensors: &'a [ParamTensor<ModelTensor>],
    /// Each tensor's file and name there.
    names: &'a [(usize, String)],
    tensor: usize,
    /// Elements of the tensor read so far.
    at: usize,
    /// The chunk as read, and widened to f32.
    bytes: Vec<u8>,
    chunk: Vec<f32>,
    pos: usize,
    error: Option<String>,
}

impl UnitValues<'_> {
    /// Whether every value was read.
    pub fn result(&self) -> Result<(), Error> {
        match &self.error {
            None => Ok(()),
            Some(reason) => Err(Error::Data {
                what: self.weights.what.clone(),
                reason: reason.clone(),
            }),
        }
    }

    /// Reads the next chunk of the unit's values; false at its end or on an error.
    fn refill(&mut self) -> bool {
        while let Some(t) = self.tensors.get(self.tensor) {
            let numel = t.range().len();
            if self.at == numel {
                (self.tensor, self.at) = (self.tensor + 1, 0);
                continue;
            }
            let (f, name) = &self.names[self.tensor];
            let file = &self.weights.files[*f];
            let dtype = file.info(name).expect("checked on opening").dtype;
            let width = dtype.bitsize() / 8;
            let n = READ_CHUNK.min(numel - self.at);
            self.bytes.resize(n * width, 0);
            if let Err(e) = file.read(name, self.at * width, &mut self.bytes) {
                self.error = Some(e);
                return false;
            }
            self.chunk.resize(n, 0.0);
            widen(dtype, &self.bytes, &mut self.chunk).expect("checked on opening");
            (self.at, self.pos) = (self.at + n, 0);
            return true;
        }
        false
    }
}

impl Iterator for UnitValues<'_> {
    type Item = f32;

    fn next(&mut self) -> Option<f32> {
        if self.pos == self.chunk.len() && (self.error.is_some() || !self.refill()) {
            return None;
        }
        self.pos += 1;
        Some(self.chunk[self.pos - 1])
    }
}

/// Little-endian F32/F16/BF16 bytes (at any alignment) to f32; other dtypes are refused.
fn widen(dtype: Dtype, bytes: &[u8], dst: &mut [f32]) -> Result<(), Dtype> {
    match dtype {
        Dtype::F32 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::BF16 => {
            for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        other => return Err(other),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dims: &[usize]) -> ExportTensor {
        let n = dims.iter().product();
        ExportTensor {
            name: name.into(),
            dims: dims.to_vec(),
            unit: 0,
            elems: 0..n,
        }
    }

    /// Bytes of the file holding `tensors`, as written.
    fn written(tensors: &[ExportTensor]) -> u64 {
        let header = export_header(tensors, Path::new("x")).unwrap();
        8 + header.len() as u64 + tensors.iter().map(ExportTensor::bytes).sum::<u64>()
    }

    #[test]
    fn dealing_counts_each_file_as_it_is_written_and_fills_it_up_to_the_limit() {
        let tensors: Vec<ExportTensor> = (0..40)
            .map(|i| {
                tensor(
                    &format!("model.layers.{i}.\"w\"\u{e9}"),
                    &[i % 7 + 1, 3 * i + 1],
                )
            })
            .collect();
        for limit in [0, 200, 1000, 4000, 50_000] {
            let files = deal(&tensors, limit);
            assert_eq!(files.first().unwrap().start, 0);
            assert_eq!(files.last().unwrap().end, tensors.len());
            for (k, range) in files.iter().enumerate() {
                let file = &tensors[range.clone()];
                let size = file.iter().fold(FileSize::new(), |s, t| s.with(t));
                assert_eq!(size.total(), written(file), "limit {limit}, file {k}");
                assert!(size.total() <= limit || file.len() == 1, "limit {limit}");
                if let Some(next) = files.get(k + 1) {
                    assert_eq!(next.start, range.end);
                    let grown = &tensors[range.start..range.end + 1];
                    assert!(written(grown) > limit, "limit {limit}: file {k} had room");
                }
            }
        }
        assert_eq!(deal(&tensors, u64::MAX), vec![0..tensors.len()]);
    }
}
