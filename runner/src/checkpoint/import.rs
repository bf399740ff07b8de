//! Hugging Face weights in: one file or transformers' sharded set, checked against the model
//! and read a chunk at a time.

use std::fs::File;
use std::path::Path;

use safetensors::tensor::Dtype;
use scheduler::bytes::human;
use scheduler::model::{ModelShape, ModelTensor, TensorDims};

use crate::Error;
use crate::data::{DataRoots, describe};
use crate::tensor_file::TensorFile;
use wire::artifact::{INDEX_FILE, MODEL_FILE};

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
    /// Per unit, per tensor in unit order: where its values are.
    sources: Vec<Vec<Source>>,
}

/// Where one tensor's values are: the file holding it, its name there and its element count.
#[derive(Debug)]
struct Source {
    file: usize,
    name: String,
    numel: usize,
}

/// A tensor [`HfWeights`] must find: its names, as a file may call it (the first is the one
/// errors use), and its dimensions.
pub(super) struct Wanted {
    pub names: Vec<String>,
    pub dims: TensorDims,
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
        // Each tensor by its full state-dict name, or (GPT-2) without the model's prefix.
        let candidates = |kind: ModelTensor, layer| {
            let full = kind.state_dict_name(layer);
            let local = kind.hf_name(layer);
            if full == local {
                vec![local]
            } else {
                vec![local, full]
            }
        };
        let wanted = model
            .units(1)
            .iter()
            .map(|u| {
                u.tensors
                    .iter()
                    .map(|t| Wanted {
                        names: candidates(t.kind, u.layer()),
                        dims: t.dims,
                    })
                    .collect()
            })
            .collect();
        HfWeights::locate(files, what, wanted, |n| model.ignores_hf_tensor(n))
    }

    /// The weights `wanted` (per unit, per tensor) in `files`, each found under one of its
    /// names with its shape and a dtype this reads; any other tensor but those `ignored` is
    /// refused.
    pub(super) fn locate(
        files: Vec<TensorFile>,
        what: String,
        wanted: Vec<Vec<Wanted>>,
        ignored: impl Fn(&str) -> bool,
    ) -> Result<HfWeights, Error> {
        let fail = |reason: String| Error::Data {
            what: what.clone(),
            reason,
        };
        let unexpected = files
            .iter()
            .flat_map(TensorFile::names)
            .filter(|n| !ignored(n) && !wanted.iter().flatten().any(|w| w.names.contains(n)))
            .count();
        if unexpected > 0 {
            // Their names are the file's content: count them only.
            return Err(fail(format!(
                "has {unexpected} tensor(s) this model does not have"
            )));
        }
        let mut sources = Vec::new();
        for unit in wanted {
            let mut unit_sources = Vec::new();
            for w in unit {
                let name = &w.names[0];
                let (source, info) = w
                    .names
                    .iter()
                    .find_map(|n| {
                        let (file, info) = files
                            .iter()
                            .enumerate()
                            .find_map(|(f, file)| Some((f, file.info(n)?.clone())))?;
                        let numel = w.dims.numel();
                        let name = n.clone();
                        Some((Source { file, name, numel }, info))
                    })
                    .ok_or_else(|| fail(format!("missing tensor {name}")))?;
                let want = w.dims.to_vec();
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
                unit_sources.push(source);
            }
            sources.push(unit_sources);
        }
        Ok(HfWeights {
            files,
            what,
            sources,
        })
    }

    /// Unit `u`'s values in order (`len` of them, no padding), read a chunk at a time; a read
    /// that fails ends them early, and [`UnitValues::result`] says why.
    pub fn unit(&self, u: usize) -> UnitValues<'_> {
        UnitValues {
            weights: self,
            sources: &self.sources[u],
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
    sources: &'a [Source],
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
        while let Some(t) = self.sources.get(self.tensor) {
            let (numel, name) = (t.numel, &t.name);
            if self.at == numel {
                (self.tensor, self.at) = (self.tensor + 1, 0);
                continue;
            }
            let file = &self.weights.files[t.file];
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
