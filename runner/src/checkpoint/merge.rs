//! A LoRA job's merged model, as PEFT's `merge_and_unload` makes it: every adapted projection's
//! weight `W + s·B·A` (transposed for GPT-2's Conv1D layout), the rest of the base as it is,
//! written under `merged/` in the export's Hugging Face form. Rank 0 writes it after the
//! adapter export, streaming the base from where the trainer took it (`model.init_from`, else
//! the seed) and reading each projection's A and B from the adapter file, so no rank's
//! buffers are touched and nothing larger than one projection's adapters is held.

use std::fs::File;
use std::path::{Path, PathBuf};

use scheduler::model::{AdapterPart, AdapterTensor, Adapters, ModelShape, Projection};
use wire::artifact::{ADAPTER_MODEL_FILE, Artifact};

use super::{HfWeights, ModelFile};
use crate::Error;
use crate::tensor_file::TensorFile;

/// Values written per call.
const CHUNK: usize = 1 << 16;

/// Where the base's weights come from: the file the trainer read, or the seed it drew them
/// from.
pub enum Base<'a> {
    File(&'a HfWeights),
    Seeded(u64),
}

/// Writes `merged/` under `out` (which holds the adapter export) for `model` with `adapters`;
/// `round` takes a base value to what the trainer held (the compute dtype), to which the
/// adapters' product is added in f32. Returns the files written.
pub fn write_merged(
    out: &Path,
    model: &ModelShape,
    config: &serde_json::Map<String, serde_json::Value>,
    base: Base<'_>,
    adapters: &Adapters,
    round: impl Fn(f32) -> f32,
) -> Result<Vec<(Artifact, PathBuf)>, Error> {
    let file = ModelFile::merged(out, model, config)?;
    let path = out.join(ADAPTER_MODEL_FILE);
    let fail = |reason: String| Error::Checkpoint {
        path: path.clone(),
        reason,
    };
    let opened = File::open(&path).map_err(|e| fail(e.to_string()))?;
    let adapter = TensorFile::new(opened).map_err(fail)?;
    let targets = adapters.targets.of(model);
    for (u, unit) in model.units(1).iter().enumerate() {
        let mut from_file = match base {
            Base::File(w) => Some(w.unit(u)),
            Base::Seeded(_) => None,
        };
        for (ti, t) in unit.tensors.iter().enumerate() {
            let target = targets.iter().find(|p| p.weight == t.kind);
            let delta = match (unit.layer(), target) {
                (Some(l), Some(p)) => {
                    Some(Delta::read(&adapter, model, p, l, adapters).map_err(fail)?)
                }
                _ => None,
            };
            let mut seeded = match base {
                Base::Seeded(seed) => Some(crate::zero::seeded_values(model, t.kind, seed, u, ti)),
                Base::File(_) => None,
            };
            let n = t.dims.numel();
            let mut chunk = Vec::with_capacity(CHUNK.min(n));
            for start in (0..n).step_by(CHUNK) {
                chunk.clear();
                for e in start..n.min(start + CHUNK) {
                    let w = match (&mut from_file, &mut seeded) {
                        (Some(values), _) => values.next().unwrap_or(0.0),
                        (None, Some(next)) => next(),
                        (None, None) => unreachable!("a base of one kind or the other"),
                    };
                    chunk.push(round(w) + delta.as_ref().map_or(0.0, |d| d.at(e)));
                }
                file.write(u, t.offset + start, &chunk)?;
            }
        }
        if let Some(values) = from_file {
            values.result()?;
        }
    }
    file.finish()
}

/// `s·B·A` of one adapted projection, element by element of its weight.
struct Delta {
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
    inputs: usize,
    outputs: usize,
    scaling: f32,
    /// GPT-2's Conv1D weights are (in, out): the product is transposed.
    transposed: bool,
}

impl Delta {
    fn read(
        adapter: &TensorFile,
        model: &ModelShape,
        p: &Projection,
        layer: usize,
        adapters: &Adapters,
    ) -> Result<Delta, String> {
        let values = |part| {
            let name = AdapterTensor {
                weight: p.weight,
                part,
            }
            .peft_name(layer);
            let len = match part {
                AdapterPart::A => adapters.rank * p.in_features,
                AdapterPart::B => adapters.rank * p.out_features,
            };
            let mut bytes = vec![0u8; 4 * len];
            adapter.read(&name, 0, &mut bytes)?;
            Ok::<_, String>(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<f32>>(),
            )
        };
        Ok(Delta {
            a: values(AdapterPart::A)?,
            b: values(AdapterPart::B)?,
            rank: adapters.rank,
            inputs: p.in_features,
            outputs: p.out_features,
            scaling: adapters.scaling,
            transposed: matches!(model, ModelShape::Gpt2(_)),
        })
    }

    /// The product's element `e` of the weight in its own layout.
    fn at(&self, e: usize) -> f32 {
        let (row, col) = if self.transposed {
            (e % self.outputs, e / self.outputs)
        } else {
            (e / self.inputs, e % self.inputs)
        };
        let r = self.rank;
        let dot: f32 = (0..r)
            .map(|k| self.b[row * r + k] * self.a[k * self.inputs + col])
            .sum();
        self.scaling * dot
    }
}
