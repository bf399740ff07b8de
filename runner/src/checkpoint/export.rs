//! The export in Hugging Face form, the family's state-dict names in fp32 (GPT-2's
//! `transformer.`-prefixed, its LM head tied): `model.safetensors`, or past
//! [`EXPORT_SHARD_BYTES`] (or the limit the host sets) transformers' sharded layout, and
//! `config.json` ([`ModelFile`]).

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use scheduler::model::{AdapterTensor, ModelShape, Units};

use crate::Error;
use wire::artifact::Artifact;
use wire::artifact::INDEX_FILE;

use super::{io, names, sync_dir, write_synced};

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
    /// The config written beside it: `config.json`, or an adapter's `adapter_config.json`.
    config: serde_json::Map<String, serde_json::Value>,
    config_artifact: Artifact,
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

/// Every tensor of `units` in order, named by `name` from its kind and its unit's layer.
fn export_tensors<K: Copy>(
    units: &Units<K>,
    name: impl Fn(K, Option<usize>) -> String,
) -> Vec<ExportTensor> {
    units
        .iter()
        .enumerate()
        .flat_map(|(u, unit)| {
            let name = &name;
            unit.tensors.iter().map(move |t| ExportTensor {
                name: name(t.kind, unit.layer()),
                dims: t.dims.to_vec(),
                unit: u,
                elems: t.range(),
            })
        })
        .collect()
}

/// Where the file `path` is written before it is renamed into place: `.NAME.tmp` beside it.
fn temporary(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.tmp"))
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
        ModelFile::of_model(out, model, (Artifact::Config, config.clone()), shard_bytes)
    }

    /// A LoRA job's merged model, as [`ModelFile::create`] lays out a model but as one file:
    /// `merged/model.safetensors` and `merged/config.json` under `out`.
    pub fn merged(
        out: &Path,
        model: &ModelShape,
        config: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<ModelFile, Error> {
        ModelFile::of_model(
            out,
            model,
            (Artifact::MergedConfig, config.clone()),
            u64::MAX,
        )
    }

    fn of_model(
        out: &Path,
        model: &ModelShape,
        config: (Artifact, serde_json::Map<String, serde_json::Value>),
        shard_bytes: u64,
    ) -> Result<ModelFile, Error> {
        let layout = model.units(1);
        let tensors = export_tensors(&layout, |kind, layer| kind.state_dict_name(layer));
        ModelFile::lay_out(out, tensors, layout.iter().count(), config, shard_bytes)
    }

    /// A LoRA job's export in PEFT's form: `adapter_model.safetensors` (PEFT's tensor names,
    /// one file: PEFT does not shard adapters) and `adapter_config.json`, whose values are
    /// the adapters' units' (`Adapters::layout`) in order.
    pub fn adapter(
        out: &Path,
        units: &Units<AdapterTensor>,
        config: serde_json::Map<String, serde_json::Value>,
    ) -> Result<ModelFile, Error> {
        let tensors = export_tensors(units, |kind, layer| {
            kind.peft_name(layer.expect("adapters are per block"))
        });
        let (config, units) = ((Artifact::AdapterConfig, config), units.iter().count());
        ModelFile::lay_out(out, tensors, units, config, u64::MAX)
    }

    /// Creates the files of `tensors` (values of `units` units) under temporary names in
    /// `out` and writes their headers; `config` is the config file written beside them.
    fn lay_out(
        out: &Path,
        tensors: Vec<ExportTensor>,
        units: usize,
        (config_artifact, config): (Artifact, serde_json::Map<String, serde_json::Value>),
        shard_bytes: u64,
    ) -> Result<ModelFile, Error> {
        let weights = match config_artifact {
            Artifact::AdapterConfig => Artifact::Adapter,
            Artifact::MergedConfig => Artifact::MergedModel,
            _ => Artifact::Model,
        };
        let folder = out.join(weights.name());
        let folder = folder.parent().expect("a file's path has a folder");
        fs::create_dir_all(folder).map_err(|e| io(folder, e))?;
        let dealt = deal(&tensors, shard_bytes);
        let count = dealt.len() as u32;
        let artifact = |k: usize| match count {
            1 => weights,
            _ => Artifact::Shard {
                index: k as u32 + 1,
                count,
            },
        };
        let mut files = Vec::with_capacity(dealt.len());
        let mut places: Vec<Vec<Place>> = (0..units).map(|_| Vec::new()).collect();
        // By name, as transformers writes it.
        let mut weight_map = std::collections::BTreeMap::new();
        for (k, range) in dealt.iter().enumerate() {
            let artifact = artifact(k);
            let name = artifact.name();
            let tmp = temporary(&out.join(&name));
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
            config,
            config_artifact,
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
        let path = self.out.join(self.config_artifact.name());
        let text = serde_json::to_vec_pretty(&self.config).map_err(|e| io(&path, e))?;
        write_synced(&path, &text)?;
        written.push((self.config_artifact, path));
        sync_dir(&self.out)?;
        Ok(written)
    }
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
