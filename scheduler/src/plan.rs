//! The planner: resolve a spec's `"auto"` fields to the configuration that fits the devices with
//! the least communication and recomputation. Escalation order: raise the ZeRO stage (0 → 3),
//! then turn on activation checkpointing, then halve the micro-batch while raising accumulation
//! (the batch per step is unchanged). When nothing fits, say why in numbers.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::bytes::human;
use crate::error::Error;
use crate::inventory::{DeviceSlot, Inventory};
use crate::kernel_figures::CUDA_MAX_ATTENTION_HEADS;
use crate::memory::{self, Breakdown, Category, Comm, DeviceKind, Setup};
use crate::spec::{Auto, JobSpec, ZeroStage};

/// Values for a spec's `"auto"` fields: with the spec, one fully resolved way to run the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Choices {
    pub zero_stage: ZeroStage,
    pub activation_checkpointing: bool,
    pub micro_batch_size: u32,
    pub grad_accum_steps: u32,
}

impl Choices {
    /// `spec` run with these choices.
    pub fn setup(&self, spec: &JobSpec) -> Setup {
        Setup::new(
            spec,
            self.zero_stage,
            self.activation_checkpointing,
            self.micro_batch_size,
            self.grad_accum_steps,
        )
    }
}

/// A configuration the planner considered, with its per-rank bytes before device overhead.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub chosen: Choices,
    pub setup: Setup,
    pub base: Breakdown,
    pub comm: Comm,
}

impl Candidate {
    fn new(spec: &JobSpec, stage: ZeroStage, ckpt: bool, micro: u32, accum: u32) -> Candidate {
        let chosen = Choices {
            zero_stage: stage,
            activation_checkpointing: ckpt,
            micro_batch_size: micro,
            grad_accum_steps: accum,
        };
        let setup = chosen.setup(spec);
        let estimate = memory::estimate(&setup, DeviceKind::Cpu);
        Candidate {
            chosen,
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

    fn fits(&self, d: &DeviceSlot) -> bool {
        self.need_on(d.kind) <= d.memory_bytes
    }

    fn describe(&self, relative_to: &Candidate) -> String {
        let (c, r) = (&self.chosen, &relative_to.chosen);
        let mut s = format!("stage {}", c.zero_stage.index());
        if c.activation_checkpointing && !r.activation_checkpointing {
            s.push_str(" with activation checkpointing");
        }
        if c.micro_batch_size != r.micro_batch_size {
            s.push_str(&format!(
                " at micro-batch {} × {} accumulation steps",
                c.micro_batch_size, c.grad_accum_steps
            ));
        }
        s
    }
}

/// The chosen configuration and what it costs: admission's plan, stored with the job and
/// executed by its ranks as it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    #[serde(flatten)]
    pub chosen: Choices,
    /// The kind of device every rank runs on (placement takes no other).
    #[serde(default)]
    pub device: DeviceKind,
    /// Per-rank bytes on the devices it was planned for (with that kind's overhead): the
    /// largest rank's.
    pub per_rank_bytes: Breakdown,
    pub comm_bytes_per_step: u64,
    /// Devices in the inventory that can hold one rank.
    pub devices_that_fit: usize,
    /// Each rank's bytes, with the same overhead, where ranks differ (Adafactor's factored
    /// state is split by tensor); empty when every rank holds `per_rank_bytes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bytes_by_rank: Vec<Breakdown>,
}

impl Plan {
    /// What rank `rank` holds under the plan.
    pub fn rank_bytes(&self, rank: usize) -> Breakdown {
        self.bytes_by_rank
            .get(rank)
            .copied()
            .unwrap_or(self.per_rank_bytes)
    }

    /// Bytes one rank needs on a device of `kind`: the plan's with the overhead of the device
    /// kind it was planned for replaced by `kind`'s.
    pub fn need_on(&self, kind: DeviceKind) -> u64 {
        self.per_rank_bytes.total() - self.per_rank_bytes.overhead + kind.overhead_bytes()
    }

    /// The first category in which `setup`'s rank `rank` on a `device` holds other bytes than
    /// the plan says,
    /// as (category, planned, setup's), leaving out the overhead: it is the process's, not the
    /// rank's buffers.
    pub fn differs(
        &self,
        setup: &Setup,
        rank: usize,
        device: DeviceKind,
    ) -> Option<(Category, u64, u64)> {
        let planned = self.rank_bytes(rank);
        let have = memory::rank_breakdown_on(setup, rank, device);
        Category::ALL
            .iter()
            .copied()
            .filter(|&c| c != Category::Overhead)
            .map(|c| (c, planned.get(c), have.get(c)))
            .find(|(_, p, h)| p != h)
    }
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
                chosen: Choices {
                    activation_checkpointing: false,
                    ..c.chosen
                },
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

/// Plans `spec` for a run in one's own process, without a service: `world_size` CPU devices of
/// `device_memory` bytes each (unbounded when `None`).
pub fn plan_local(spec: &JobSpec, device_memory: Option<u64>) -> Result<Plan, Error> {
    plan_local_on(spec, device_memory, DeviceKind::Cpu)
}

/// [`plan_local`] on devices of `kind`, whatever the spec's `device` asks for: the run's own
/// device decides.
pub fn plan_local_on(
    spec: &JobSpec,
    device_memory: Option<u64>,
    kind: DeviceKind,
) -> Result<Plan, Error> {
    let world = spec.world_size.get() as usize;
    let budget = device_memory.unwrap_or(u64::MAX);
    plan_on(spec, &Inventory::uniform(world, budget, kind), kind)
}

/// The kind of device `spec`'s ranks run on in `inventory`: the one it asks for, or for
/// `"auto"` GPUs when any are registered, else CPU devices.
pub fn device_kind(spec: &JobSpec, inventory: &Inventory) -> DeviceKind {
    spec.device.fixed().unwrap_or_else(|| {
        if inventory.devices().any(|d| d.kind == DeviceKind::Cuda) {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        }
    })
}

/// Chooses the preferred configuration of `spec` that fits `world_size` devices of `inventory`,
/// all of the kind [`device_kind`] picks. A kind the spec names but `inventory` lacks is
/// [`Error::NoDevicesOfKind`].
pub fn plan(spec: &JobSpec, inventory: &Inventory) -> Result<Plan, Error> {
    let kind = device_kind(spec, inventory);
    if spec.device.fixed().is_some() && !inventory.devices().any(|d| d.kind == kind) {
        return Err(Error::NoDevicesOfKind(kind));
    }
    plan_on(spec, inventory, kind)
}

/// The largest micro-batch `kind`'s kernels run for `spec`'s model, if bounded.
fn micro_batch_limit(spec: &JobSpec, kind: DeviceKind) -> Option<u32> {
    let model = spec
        .architecture()
        .model()
        .filter(|_| kind == DeviceKind::Cuda)?;
    Some((CUDA_MAX_ATTENTION_HEADS / model.summary().attention_heads) as u32)
}

/// [`plan`] on the devices of `kind` in `inventory`, ignoring the others.
fn plan_on(spec: &JobSpec, inventory: &Inventory, kind: DeviceKind) -> Result<Plan, Error> {
    let n = spec.world_size.get() as usize;
    let devices: Vec<&DeviceSlot> = inventory.devices().filter(|d| d.kind == kind).collect();
    let fitting = |c: &Candidate| devices.iter().filter(|d| c.fits(d)).count();
    let need = |c: &Candidate| c.need_on(kind);
    let limit = micro_batch_limit(spec, kind).unwrap_or(u32::MAX);
    let runnable = |relax| {
        let mut all = candidates(spec, relax);
        all.retain(|c| c.chosen.micro_batch_size <= limit);
        all
    };

    let allowed = runnable(false);
    if allowed.is_empty() {
        return Err(Error::spec(
            "training.micro_batch_size",
            format!(
                "a GPU's attention runs at most {CUDA_MAX_ATTENTION_HEADS} sequences × heads at once: at most {limit} sequences of this model"
            ),
        ));
    }
    if let Some(chosen) = allowed.iter().find(|c| fitting(c) >= n) {
        // The plan states the bytes of the kind its ranks land on, which the trainer must
        // then hold exactly.
        let with_overhead = |b: Breakdown| Breakdown {
            overhead: kind.overhead_bytes(),
            ..b
        };
        let ranks = memory::distinct_ranks(&chosen.setup, kind);
        return Ok(Plan {
            chosen: chosen.chosen,
            device: kind,
            per_rank_bytes: memory::estimate(&chosen.setup, kind).per_rank,
            comm_bytes_per_step: chosen.comm.total(),
            devices_that_fit: fitting(chosen),
            bytes_by_rank: if ranks.len() > 1 {
                ranks.into_iter().map(with_overhead).collect()
            } else {
                Vec::new()
            },
        });
    }

    let closest = *allowed
        .iter()
        .min_by_key(|c| need(c))
        .expect("a valid spec allows at least one configuration");
    let relaxed = runnable(true);
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
