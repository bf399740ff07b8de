//! Setting and reading the model's weights: GPT-2's initialisation, Hugging Face weights, and
//! the gathered fp32 values the export writes.

use std::ops::Range;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use scheduler::model::TensorKind;

use super::Engine;
use super::layout::Part;
use crate::Error;
use crate::comm::Wire;
use crate::device::{Device, Num};

impl<X: Num + Wire, D: Device> Engine<X, D> {
    /// Sets every parameter from one fp32 vector per unit of the single-rank layout (e.g.
    /// Hugging Face weights), keeping this rank's part.
    pub fn load_weights(&mut self, units: &[Vec<f32>]) -> Result<(), Error> {
        for (ui, values) in units.iter().enumerate() {
            let len = values.len().min(self.unit_len(ui));
            let mut it = values[..len].iter().copied();
            self.write_tensor(ui, 0..len, || it.next().unwrap_or(0.0))?;
        }
        Ok(())
    }

    /// Each unit's fp32 weights (the master copy in mixed precision), gathered from every rank
    /// where they are sharded, for the final export.
    pub fn unit_values(&mut self) -> Result<Vec<Vec<f32>>, Error> {
        let layout = &self.layout;
        let mut out = Vec::with_capacity(self.bufs.params.len());
        for (u, unit) in self.units.iter().enumerate() {
            let held = layout.held(Part::State, u);
            let mut full = vec![0f32; unit.padded_len];
            match &self.master {
                Some(m) => full[held].copy_from_slice(&self.dev.to_host(m[u].view())?),
                None => {
                    let within = layout.held_within(Part::State, Part::Params, u);
                    let mine = self.dev.to_host(self.bufs.params[u].at(within))?;
                    full[held]
                        .iter_mut()
                        .zip(mine)
                        .for_each(|(f, x)| *f = x.to_f32());
                }
            }
            if layout.sharded(Part::State) {
                self.comm.all_gather(&mut full)?;
            }
            full.truncate(unit.len);
            out.push(full);
        }
        Ok(out)
    }

    /// GPT-2's initialisation: weights N(0, 0.02), the residual projections N(0, 0.02/√(2L)),
    /// biases 0, LayerNorm weights 1. Each tensor draws from its own stream keyed by the seed,
    /// the unit and the tensor, so the values do not depend on how units are sharded.
    pub(super) fn init_weights(&mut self, seed: u64) -> Result<(), Error> {
        let std = 0.02;
        let residual_std = std / (2.0 * self.shape.n_layer as f64).sqrt();
        let units = self.units.clone();
        for (ui, unit) in units.iter().enumerate() {
            for (ti, t) in unit.tensors.iter().enumerate() {
                let mut key = [0u8; 32];
                key[..8].copy_from_slice(&seed.to_le_bytes());
                key[8..16].copy_from_slice(&(ui as u64).to_le_bytes());
                key[16..24].copy_from_slice(&(ti as u64).to_le_bytes());
                let mut rng = ChaCha8Rng::from_seed(key);
                let value: Box<dyn FnMut() -> f32> = match t.kind {
                    TensorKind::Ln1Weight | TensorKind::Ln2Weight | TensorKind::LnfWeight => {
                        Box::new(|| 1.0)
                    }
                    k if !k.decayed(&self.shape) => Box::new(|| 0.0),
                    k => {
                        let s = match k {
                            TensorKind::AttnProjWeight | TensorKind::FcProjWeight => residual_std,
                            _ => std,
                        };
                        let normal = Normal::new(0.0, s).expect("a positive standard deviation");
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
