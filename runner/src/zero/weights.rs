//! Setting and reading the model's weights: each family's initialisation, Hugging Face
//! weights, and the fp32 values the export writes.

use std::ops::Range;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use scheduler::model::TensorInit;

use super::Engine;
use super::layout::Part;
use crate::Error;
use crate::checkpoint::{HfWeights, ModelFile};
use crate::comm::{Collective, DeviceCollectives, Summable};
use crate::device::Num;

impl<X: Num + Summable, D: DeviceCollectives> Engine<X, D> {
    /// Sets every parameter from Hugging Face weights, keeping this rank's part: each unit's
    /// values stream from the file a chunk at a time.
    pub fn load_weights(&mut self, weights: &HfWeights) -> Result<(), Error> {
        for ui in 0..self.units.iter().count() {
            let len = self.unit_len(ui);
            let mut values = weights.unit(ui);
            self.write_tensor(ui, 0..len, || values.next().unwrap_or(0.0))?;
            values.result()?;
        }
        Ok(())
    }

    /// Writes each unit's fp32 weights (the master copy in mixed precision) into `file`, which
    /// rank 0 holds (the others pass `None`). Sharded units are gathered piece by piece through
    /// the logits buffer, dead once training is over, so the export holds no byte the memory
    /// model does not already count.
    pub fn export(&mut self, file: Option<&ModelFile>) -> Result<(), Error> {
        let Engine {
            dev,
            units,
            layout,
            bufs,
            master,
            passes,
            comm,
            ..
        } = self;
        let logits = &mut passes.batch().logits;
        let (n, rank) = (comm.world_size(), comm.rank());
        let part = if master.is_some() {
            Part::State
        } else {
            Part::Params
        };
        let piece = logits.len() / n;
        if layout.sharded(part) && piece == 0 {
            return Err(Error::Untrainable {
                reason: format!(
                    "the logits buffer is too small to gather the model through ({n} ranks)"
                ),
            });
        }
        for (u, unit) in units.iter().enumerate() {
            let weights = match master {
                Some(m) => m[u].view_mut(),
                None => D::as_f32_mut(bufs.params[u].view_mut())
                    .expect("without master weights the parameters are fp32"),
            };
            if !layout.sharded(part) {
                if let Some(file) = file {
                    dev.on_host(weights, |w| file.write(u, 0, &w[..unit.len]))??;
                }
                continue;
            }
            let weights = D::freeze(weights);
            let shard = layout.held(part, u).len();
            // A piece is no longer than a shard: the ring's scratch holds one shard's chunk.
            let piece = piece.min(shard);
            for start in (0..shard).step_by(piece) {
                let len = piece.min(shard - start);
                let mut pieces = logits.at_mut(0..n * piece);
                dev.copy(
                    D::slice_mut(D::reborrow(&mut pieces), rank * piece..rank * piece + len),
                    D::slice(D::reborrow_ref(&weights), start..start + len),
                )?;
                dev.collective(comm, Collective::AllGather, D::reborrow(&mut pieces))?;
                let Some(file) = file else { continue };
                dev.on_host(pieces, |p| {
                    (0..n).try_for_each(|r| {
                        let at = r * shard + start;
                        let len = len.min(unit.len.saturating_sub(at));
                        file.write(u, at, &p[r * piece..r * piece + len])
                    })
                })??;
            }
        }
        Ok(())
    }

    /// The family's initialisation (`ModelTensor::init`). Each tensor draws from its own
    /// stream keyed by the seed, the unit and the tensor, so the values do not depend on how
    /// units are sharded.
    pub(super) fn init_weights(&mut self, seed: u64) -> Result<(), Error> {
        let units = self.units.clone();
        for (ui, unit) in units.iter().enumerate() {
            for (ti, t) in unit.tensors.iter().enumerate() {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&seed.to_le_bytes());
                key[8..16].copy_from_slice(&(ui as u64).to_le_bytes());
                key[16..24].copy_from_slice(&(ti as u64).to_le_bytes());
                let mut rng = ChaCha8Rng::from_seed(key);
                let value: Box<dyn FnMut() -> f32> = match t.kind.init(&self.model) {
                    TensorInit::Ones => Box::new(|| 1.0),
                    TensorInit::Zeros => Box::new(|| 0.0),
                    TensorInit::Normal { std } => {
                        let normal = Normal::new(0.0, std).expect("a positive standard deviation");
                        Box::new(move || normal.sample(&mut rng) as f32)
                    }
                };
                self.write_tensor(ui, t.range(), value)?;
            }
        }
        Ok(())
    }

    /// Writes the values `next` yields for elements `range` of unit `ui` into this rank's
    /// parameters and master weights, wherever they hold them.
    fn write_tensor(
        &mut self,
        ui: usize,
        range: Range<usize>,
        mut next: impl FnMut() -> f32,
    ) -> Result<(), Error> {
        let params_at = self.layout.held(Part::Params, ui);
        let master_at = self.layout.held(Part::State, ui);
        let dev = &self.dev;
        let params = self.bufs.params[ui].view_mut();
        dev.on_host(params, |params| {
            let write = |master: &mut [f32]| {
                for i in range {
                    let v = next();
                    if params_at.contains(&i) {
                        params[i - params_at.start] = X::from_f32(v);
                    }
                    if !master.is_empty() && master_at.contains(&i) {
                        master[i - master_at.start] = v;
                    }
                }
            };
            match &mut self.master {
                Some(m) => dev.on_host(m[ui].view_mut(), write),
                None => {
                    write(&mut []);
                    Ok(())
                }
            }
        })?
    }
}
