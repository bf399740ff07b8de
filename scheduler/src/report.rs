//! The estimate report: per-rank bytes for every ZeRO stage, communication, and the plan, for
//! one spec on one inventory. The `zerotrain estimate` CLI and `POST /v1/estimate` both render it.

use serde::Serialize;

use crate::Error;
use crate::compare::Comparison;
use crate::inventory::Inventory;
use crate::memory::{self, Breakdown, Comm, DeviceKind, Setup};
use crate::model::{ModelSummary, StepScratch};
use crate::plan::{self, Plan};
use crate::spec::{JobSpec, ZeroStage};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The model's family and shape; absent for a bare parameter count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSummary>,
    /// The model's parameters, a LoRA job's adapters included.
    pub parameters: u64,
    /// Parameters the optimizer updates (PEFT's `print_trainable_parameters`): Ψ, or a LoRA
    /// job's adapters.
    pub trainable_parameters: u64,
    pub world_size: u32,
    pub micro_batch_size: u32,
    pub grad_accum_steps: u32,
    pub activation_checkpointing: bool,
    /// What the stage table's activations and buffers hold for attention (linear in T) and for
    /// the loss (logits of one chunk of rows); absent for a bare parameter count.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_scratch: Option<StepScratch>,
    /// Device overhead the stage table includes.
    pub device_kind: DeviceKind,
    pub stages: Vec<StageRow>,
    pub plan: PlanOutcome,
    /// DeepSpeed keys zerotrain ignored.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unsupported_keys: Vec<String>,
    /// DeepSpeed's and accelerate's figures for the same job, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compare: Option<Comparison>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StageRow {
    pub stage: u8,
    pub per_rank_bytes: Breakdown,
    pub comm_bytes_per_step: u64,
    pub comm_bytes_by_collective: Comm,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum PlanOutcome {
    Fits {
        fits: bool,
        #[serde(flatten)]
        plan: Box<Plan>,
    },
    DoesNotFit {
        fits: bool,
        reason: String,
    },
}

impl Report {
    /// The stage table uses the spec's fixed choices, taking for `"auto"` no checkpointing and
    /// the whole per-rank batch in one micro-batch; the plan resolves `"auto"` properly.
    pub fn new(
        spec: &JobSpec,
        unsupported_keys: Vec<String>,
        inventory: &Inventory,
        device_kind: DeviceKind,
    ) -> Result<Report, Error> {
        let t = &spec.training;
        let (micro, accum) = match t.micro_batch_size.fixed() {
            Some(m) => (m.get(), t.grad_accum_steps.get()),
            None => (t.sequences_per_rank(spec.world_size), 1),
        };
        let ckpt = spec.activation_checkpointing.fixed().unwrap_or(false);
        let setup = |stage| Setup::new(spec, stage, ckpt, micro, accum);
        let (parameters, trainable_parameters) = setup(ZeroStage::Ddp).parameter_counts();
        let stages = ZeroStage::ALL
            .iter()
            .map(|&stage| {
                let e = memory::estimate(&setup(stage), device_kind);
                StageRow {
                    stage: stage.index(),
                    per_rank_bytes: e.per_rank,
                    comm_bytes_per_step: e.comm.total(),
                    comm_bytes_by_collective: e.comm,
                }
            })
            .collect();
        let plan = match plan::plan(spec, inventory) {
            Ok(plan) => PlanOutcome::Fits {
                fits: true,
                plan: Box::new(plan),
            },
            Err(e @ (Error::DoesNotFit(_) | Error::NoDevicesOfKind(_))) => {
                PlanOutcome::DoesNotFit {
                    fits: false,
                    reason: e.to_string(),
                }
            }
            Err(other) => return Err(other),
        };
        Ok(Report {
            model: spec.architecture().model().map(|m| m.summary()),
            parameters,
            trainable_parameters,
            world_size: spec.world_size.get(),
            micro_batch_size: micro,
            grad_accum_steps: accum,
            activation_checkpointing: ckpt,
            step_scratch: spec
                .architecture()
                .model()
                .map(|m| m.step_scratch(micro as usize, t.seq_len.get() as usize, ckpt)),
            device_kind,
            stages,
            plan,
            unsupported_keys,
            compare: None,
        })
    }

    /// This report with the other estimators' figures for `spec` (the spec it was made from).
    pub fn with_comparison(self, spec: &JobSpec) -> Report {
        Report {
            compare: Some(Comparison::new(spec, &self.stages)),
            ..self
        }
    }
}
