//! The engine's persistent state as checkpoints see it: named buffers, written by every rank,
//! and read back either verbatim or resharded from another world size or stage.

use std::ops::Range;

use scheduler::model::Units;
use scheduler::spec::ZeroStage;

use super::Engine;
use super::layout::{Part, ShardLayout};
use crate::Error;
use crate::checkpoint;
use crate::comm::{DeviceCollectives, Summable};
use crate::device::Num;
use crate::state_tensor::{self, StateTensor};
use wire::artifact::Artifact;

impl<X: Num + Summable, D: DeviceCollectives> Engine<X, D> {
    /// Writes this rank's part of a checkpoint (and uploads it, given `upload`); rank 0 then
    /// publishes it (every rank waits), so once it is published every rank's file is written
    /// and sent.
    pub fn save_checkpoint(
        &mut self,
        out: &std::path::Path,
        manifest: &checkpoint::Manifest,
        upload: Option<&dyn checkpoint::Upload>,
    ) -> Result<(), Error> {
        let (rank, step) = (self.comm.rank(), manifest.step);
        let tmp = checkpoint::staging_dir(out, step);
        if rank == 0 {
            checkpoint::begin(&tmp)?;
        }
        self.comm.barrier()?;
        let (dev, state) = self.state();
        let file = state_tensor::on_host(dev, state, |t| checkpoint::write_rank(&tmp, rank, t))??;
        if let Some(up) = upload {
            up.upload(Artifact::Rank { step, rank }, &file)?;
        }
        self.comm.barrier()?;
        if rank == 0 {
            checkpoint::publish(out, &tmp, manifest)?;
            if let Some(up) = upload {
                let manifest = checkpoint::step_dir(out, step).join(wire::artifact::MANIFEST_FILE);
                up.upload(Artifact::Manifest { step }, &manifest)?;
            }
        }
        self.comm.barrier()
    }

    /// Fills this rank's state from its file of checkpoint `dir` (same world size and stage).
    pub fn load_rank(&mut self, dir: &std::path::Path) -> Result<(), Error> {
        let rank = self.comm.rank();
        let (dev, state) = self.state();
        state_tensor::on_host(dev, state, |t| checkpoint::load_rank(dir, rank, t))?
    }

    /// This rank's persistent buffers, named for checkpoints: parameters, master weights and
    /// optimizer states (gradients and activations are rebuilt every step), and their device.
    fn state(&mut self) -> (&D, Vec<StateTensor<'_, D>>) {
        let dtype = match X::NAME {
            "f16" => safetensors::Dtype::F16,
            "bf16" => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F32,
        };
        let t = &mut self.trained;
        let mut out: Vec<StateTensor<'_, D>> = t
            .held
            .params
            .iter_mut()
            .enumerate()
            .map(|(u, p)| StateTensor {
                name: format!("u{u}.params"),
                dtype,
                bytes: D::bytes_mut(p.view_mut()),
            })
            .collect();
        if let Some(master) = &mut t.master {
            out.extend(master.iter_mut().enumerate().map(|(u, m)| StateTensor {
                name: format!("u{u}.master"),
                dtype: safetensors::Dtype::F32,
                bytes: D::bytes_mut(m.view_mut()),
            }));
        }
        out.extend(t.optimizer.state());
        (&self.dev, out)
    }

    /// Fills this rank's state from a checkpoint written by `old_world` ranks at `old_stage`:
    /// every element of each buffer is taken from whichever old rank held it.
    pub fn load_resharded(
        &mut self,
        dir: &std::path::Path,
        old_world: usize,
        old_stage: ZeroStage,
    ) -> Result<(), Error> {
        let held = &self.trained.held;
        let (units, layout) = (held.units.clone(), held.layout.clone());
        let old_units = self.trained_units(old_world);
        let old_layouts: Vec<ShardLayout> = (0..old_world)
            .map(|r| ShardLayout::new(old_stage, &old_units, r))
            .collect();
        let fail = |reason: String| Error::Checkpoint {
            path: dir.to_path_buf(),
            reason,
        };
        let (dev, tensors) = self.state();
        let targets = tensors
            .iter()
            .map(|t| placement(&t.name, &units, &layout).map_err(&fail))
            .collect::<Result<Vec<_>, _>>()?;
        state_tensor::on_host(dev, tensors, |tensors| {
            reshard(dir, tensors, &targets, &old_units, &old_layouts)
        })?
    }
}

/// Copies into `tensors` (placed at `targets` in the new layout) every element that one of the
/// old ranks' files holds.
fn reshard<K>(
    dir: &std::path::Path,
    tensors: &mut [StateTensor<'_>],
    targets: &[Option<(usize, Range<usize>)>],
    old_units: &Units<K>,
    old_layouts: &[ShardLayout],
) -> Result<(), Error> {
    for (old_rank, old_layout) in old_layouts.iter().enumerate() {
        checkpoint::read_rank(dir, old_rank, |file| {
            for (t, target) in tensors.iter_mut().zip(targets) {
                let elem = t.dtype.bitsize() / 8;
                match target {
                    None if old_rank == 0 => file.read(&t.name, 0, t.bytes)?,
                    None => {}
                    Some((_, new)) => {
                        let (_, old) = placement(&t.name, old_units, old_layout)?
                            .expect("placed in both layouts");
                        let (start, end) = (new.start.max(old.start), new.end.min(old.end));
                        if start < end {
                            let dst =
                                &mut t.bytes[(start - new.start) * elem..(end - new.start) * elem];
                            file.read(&t.name, (start - old.start) * elem, dst)?;
                        }
                    }
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Where state tensor `name` lies in one rank's `layout` of `units`: its unit and element
/// range there, or `None` for state every rank holds whole (Adafactor's factored statistics).
fn placement<K>(
    name: &str,
    units: &Units<K>,
    layout: &ShardLayout,
) -> Result<Option<(usize, Range<usize>)>, String> {
    if name.starts_with("adafactor.") {
        return Ok(None);
    }
    let (u, kind) = name
        .strip_prefix('u')
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(u, kind)| Some((u.parse::<usize>().ok()?, kind)))
        .ok_or_else(|| format!("unknown state tensor {name}"))?;
    let unit = units
        .iter()
        .nth(u)
        .ok_or_else(|| format!("{name}: no unit {u} in this model"))?;
    let held = layout.held(Part::State, u);
    let range = match kind {
        "params" => layout.held(Part::Params, u),
        "master" | "m" | "v" | "momentum" | "exp_avg" => held,
        "m8" | "v8" | "absmax_m" | "absmax_v" => {
            return Err(
                "8-bit Adam states are quantised per block of a shard and cannot be resharded; \
                        resume with the world size and stage that wrote the checkpoint"
                    .into(),
            );
        }
        vector => {
            let t = vector
                .strip_prefix('t')
                .and_then(|v| v.strip_suffix(".v"))
                .and_then(|i| unit.tensors.get(i.parse::<usize>().ok()?))
                .ok_or_else(|| format!("unknown state tensor {name}"))?
                .range();
            t.start.max(held.start)..t.end.min(held.end)
        }
    };
    Ok(Some((u, range)))
}
