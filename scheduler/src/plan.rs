//! The planner: resolve a spec's `"auto"` fields to the configuration that fits the devices with
//! the least communication and recomputation. Escalation order: raise the ZeRO stage (0 → 3),
//! then turn on activation checkpointing, then halve the micro-batch while raising accumulation
//! (the batch per step is unchanged). When nothing fits, say why in numbers.

use std::fmt;

use serde::Serialize;

use crate::bytes::human;
use crate::error::Error;
use crate::inventory::{Device, Inventory};
use crate::memory::{self, Breakdown, Comm, DeviceKind, Setup};
use crate::spec::{Auto, JobSpec, ZeroStage};

/// A configuration the planner considered, with its per-rank bytes before device overhead.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Candidate {
    pub zero_stage: ZeroStage,
    pub activation_checkpointing: bool,
    pub micro_batch_size: u32,
    pub grad_accum_steps: u32,
    #[serde(skip)]
    pub setup: Setup,
    #[serde(skip)]
    pub base: Breakdown,
    #[serde(skip)]
    pub comm: Comm,
}

impl Candidate {
    fn new(spec: &JobSpec, stage: ZeroStage, ckpt: bool, micro: u32, accum: u32) -> Candidate {
        let setup = Setup::new(spec, stage, ckpt, micro, accum);
        let estimate = memory::estimate(&setup, DeviceKind::Cpu);
        Candidate {
            zero_stage: stage,
            activation_checkpointing: ckpt,
            micro_batch_size: micro,
            grad_accum_steps: accum,
            setup,
            base: Breakdown {
                overhead: 0,
                ..estimate.per_rank
            },
            comm: estimate.comm,
        }
    }

    /// Bytes one rank needs on a device of `kind`.
    pub fn need_on(&self, kind: DeviceKind) -> u64 {
        self.base.total() + kind.overhead_bytes()
    }

    fn fits(&self, d: &Device) -> bool {
        self.need_on(d.kind) <= d.memory_bytes
    }

    fn describe(&self, relative_to: &Candidate) -> String {
        let mut s = format!("stage {}", self.zero_stage.index());
        if self.activation_checkpointing && !relative_to.activation_checkpointing {
            s.push_str(" with activation checkpointing");
        }
        if self.micro_batch_size != relative_to.micro_batch_size {
            s.push_str(&format!(
                " at micro-batch {} × {} accumulation steps",
                self.micro_batch_size, self.grad_accum_steps
            ));
        }
        s
    }
}

/// The chosen configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Plan {
    #[serde(flatten)]
    pub chosen: Candidate,
    /// Per-rank bytes on the devices it was planned for (overhead of the largest fitting kind).
    pub per_rank_bytes: Breakdown,
    pub comm_bytes_per_step: u64,
    /// Devices in the inventory that can hold one rank.
    pub devices_that_fit: usize,
}

/// Why no configuration fits, in numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct NoFit {
    pub world_size: usize,
    /// The allowed configuration needing the least memory.
    pub closest: Candidate,
    pub closest_need_bytes: u64,
    pub largest_device_bytes: u64,
    /// Devices that could hold one rank of `closest`.
    pub fitting_devices: usize,
    /// The first configuration beyond the spec's fixed choices that fits (`true`), or else the
    /// smallest of all (`false`) when it is smaller than `closest`.
    pub alternative: Option<(Candidate, u64, bool)>,
}

impl fmt::Display for NoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.closest;
        let plural =
            |n: usize, one: &'static str, many: &'static str| if n == 1 { one } else { many };
        write!(
            f,
            "needs {} per rank at {} on {} {}; ",
            human(self.closest_need_bytes),
            c.describe(&Candidate {
                activation_checkpointing: false,
                ..*c
            }),
            self.world_size,
            plural(self.world_size, "device", "devices"),
        )?;
        if self.fitting_devices > 0 {
            let n = self.fitting_devices;
            let has = plural(n, "device has", "devices have");
            write!(f, "only {n} {has} that much")?;
        } else {
            write!(f, "largest device has {}", human(self.largest_device_bytes))?;
        }
        match &self.alternative {
            Some((alt, need, true)) => {
                write!(f, "; {} needs {} (fits)", alt.describe(c), human(*need))
            }
            Some((alt, need, false)) => write!(
                f,
                "; the smallest configuration, {}, needs {}",
                alt.describe(c),
                human(*need)
            ),
            None => Ok(()),
        }
    }
}

/// Every configuration the spec allows, in the order the planner prefers them.
fn candidates(spec: &JobSpec, relax: bool) -> Vec<Candidate> {
    let t = &spec.training;
    let stages: Vec<ZeroStage> = match spec.zero.stage {
        Auto::Fixed(s) if !relax => vec![s],
        _ => ZeroStage::ALL.to_vec(),
    };
    let ckpts: Vec<bool> = match spec.activation_checkpointing {
        Auto::Fixed(c) if !relax => vec![c],
        _ => vec![false, true],
    };
    let micro: Vec<(u32, u32)> = match t.micro_batch_size {
        Auto::Fixed(m) if !relax => vec![(m.get(), t.grad_accum_steps.get())],
        _ => {
            let per_rank = t.sequences_per_rank(spec.world_size);
            (1..=per_rank)
                .rev()
                .filter(|m| per_rank.is_multiple_of(*m))
                .map(|m| (m, per_rank / m))
                .collect()
        }
    };
    let mut out = Vec::new();
    for &(m, accum) in &micro {
        for &ckpt in &ckpts {
            for &stage in &stages {
                out.push(Candidate::new(spec, stage, ckpt, m, accum));
            }
        }
    }
    out
}

/// Chooses the preferred configuration of `spec` that fits `world_size` devices of `inventory`.
pub fn plan(spec: &JobSpec, inventory: &Inventory) -> Result<Plan, Error> {
    let n = spec.world_size.get() as usize;
    let devices: Vec<&Device> = inventory.devices().collect();
    let fitting = |c: &Candidate| devices.iter().filter(|d| c.fits(d)).count();
    // Overhead of the kind a rank would land on: the largest device that fits it.
    let need = |c: &Candidate| {
        let kind = devices
            .iter()
            .filter(|d| c.fits(d))
            .chain(devices.iter())
            .max_by_key(|d| (c.fits(d), d.memory_bytes))
            .map_or(DeviceKind::Cpu, |d| d.kind);
        c.need_on(kind)
    };

    let allowed = candidates(spec, false);
    if let Some(chosen) = allowed.iter().find(|c| fitting(c) >= n) {
        let overhead = need(chosen) - chosen.base.total();
        return Ok(Plan {
            chosen: *chosen,
            per_rank_bytes: Breakdown {
                overhead,
                ..chosen.base
            },
            comm_bytes_per_step: chosen.comm.total(),
            devices_that_fit: fitting(chosen),
        });
    }

    let closest = *allowed
        .iter()
        .min_by_key(|c| need(c))
        .expect("a valid spec allows at least one configuration");
    let relaxed = candidates(spec, true);
    let alternative = match relaxed.iter().find(|c| fitting(c) >= n) {
        Some(c) => Some((*c, need(c), true)),
        None => relaxed
            .iter()
            .min_by_key(|c| need(c))
            .filter(|c| need(c) < need(&closest))
            .map(|c| (*c, need(c), false)),
    };
    Err(Error::DoesNotFit(Box::new(NoFit {
        world_size: n,
        closest,
        closest_need_bytes: need(&closest),
        largest_device_bytes: devices.iter().map(|d| d.memory_bytes).max().unwrap_or(0),
        fitting_devices: fitting(&closest),
        alternative,
    })))
}
