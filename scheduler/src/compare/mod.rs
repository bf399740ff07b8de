//! zerotrain's estimate beside the estimators users already know: DeepSpeed 0.19.8's ZeRO-2/3
//! model-state estimators and accelerate 1.15's `estimate-memory`, computed by their own
//! formulas for the same model and world size, with one line per difference saying why.

pub mod accelerate;
pub mod deepspeed;

use serde::Serialize;

use crate::bytes::human;
use crate::memory::{self, Breakdown};
use crate::model::ModelShape;
use crate::report::StageRow;
use crate::spec::{Architecture, Dtype, JobSpec, Optimizer};

pub const DEEPSPEED_VERSION: &str = "0.19.8";
pub const ACCELERATE_VERSION: &str = "1.15";

/// Per ZeRO stage, zerotrain's per-rank bytes beside what the other estimators give for it:
/// DeepSpeed estimates stages 2 and 3 only, accelerate an unsharded device (stage 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StageFigures {
    pub stage: u8,
    pub zerotrain_bytes: u64,
    /// Parameters, gradients and optimizer states: what the others count.
    pub zerotrain_model_states_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deepspeed_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accelerate_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub world_size: u32,
    /// DeepSpeed's `L`: the most parameters one module owns (GPT-2: the token embedding);
    /// unknown for a bare parameter count, which the ZeRO-3 figure then takes as 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_layer_params: Option<u64>,
    pub stages: Vec<StageFigures>,
    /// accelerate's phases, of which it reports the largest.
    pub accelerate_phases: accelerate::Phases,
    /// Why the figures differ, one line per difference.
    pub reasons: Vec<String>,
}

/// The Hugging Face module that owns the most parameters directly, and their count. GPT-2: the
/// token embedding (also the tied LM head), the position embedding, or the MLP expansion;
/// Llama: the token embedding (or the LM head, of the same size) or an MLP projection.
pub fn largest_layer(model: &ModelShape) -> (&'static str, u64) {
    let candidates = match *model {
        ModelShape::Gpt2(s) => {
            let [v, t, c] = [s.vocab_size, s.context_length, s.n_embd].map(|x| x as u64);
            vec![
                ("the token embedding", v * c),
                ("the position embedding", t * c),
                ("an MLP expansion", 4 * c * c + 4 * c),
            ]
        }
        ModelShape::Llama(s) => {
            let [v, c, i] = [s.vocab_size, s.hidden_size, s.intermediate_size].map(|x| x as u64);
            let bias = if s.mlp_bias { i } else { 0 };
            vec![
                ("the token embedding", v * c),
                ("an MLP projection", i * c + bias),
            ]
        }
    };
    candidates
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .expect("candidates")
}

/// accelerate's dtype argument for a zerotrain compute dtype.
pub fn accelerate_dtype(dtype: Dtype) -> accelerate::Dtype {
    match dtype {
        Dtype::Fp32 => accelerate::Dtype::Float32,
        Dtype::Fp16 => accelerate::Dtype::Float16,
        Dtype::Bf16 => accelerate::Dtype::Bfloat16,
    }
}

impl Comparison {
    /// Compares `stages` (the estimate report's rows for `spec`, stages 0-3) with the other
    /// estimators on one node of `world_size` GPUs.
    pub fn new(spec: &JobSpec, stages: &[StageRow]) -> Comparison {
        let arch = spec.architecture();
        let psi = arch.parameter_count();
        let n = spec.world_size.get();
        let largest = arch.model().as_ref().map(largest_layer);
        let l = largest.map_or(0, |(_, l)| l);
        let cluster = deepspeed::Cluster::one_node(u64::from(n));
        let ds2 = deepspeed::zero2(psi as f64, &cluster, deepspeed::Offload::None);
        let ds3 = deepspeed::zero3(
            psi as f64,
            l as f64,
            &cluster,
            deepspeed::Zero3Options {
                offload_param: deepspeed::Offload::None,
                offload_optimizer: deepspeed::Offload::None,
                zero_init: true,
            },
        );
        let phases = accelerate::training_usage(4 * psi, accelerate_dtype(spec.precision.dtype))
            .expect("zerotrain's dtypes are all ones accelerate estimates");
        let figures = stages
            .iter()
            .map(|row| StageFigures {
                stage: row.stage,
                zerotrain_bytes: row.per_rank_bytes.total(),
                zerotrain_model_states_bytes: row.per_rank_bytes.model_states(),
                deepspeed_bytes: match row.stage {
                    2 => Some(ds2.gpu_bytes_per_gpu),
                    3 => Some(ds3.gpu_bytes_per_gpu),
                    _ => None,
                },
                accelerate_bytes: (row.stage == 0).then(|| phases.training_using_adam()),
            })
            .collect();
        let why = Why {
            spec,
            arch,
            stages,
            largest,
            ds3_largest: deepspeed::largest_layer_memory(l as f64),
            phases,
        };
        Comparison {
            world_size: n,
            largest_layer_params: largest.map(|(_, l)| l),
            stages: figures,
            accelerate_phases: phases,
            reasons: why.reasons(ds2.gpu_bytes_per_gpu, ds3.gpu_bytes_per_gpu),
        }
    }
}

/// What the reasons are computed from.
struct Why<'a> {
    spec: &'a JobSpec,
    arch: Architecture,
    stages: &'a [StageRow],
    largest: Option<(&'static str, u64)>,
    ds3_largest: u64,
    phases: accelerate::Phases,
}

impl Why<'_> {
    fn stage(&self, s: u8) -> Option<&Breakdown> {
        self.stages
            .iter()
            .find(|r| r.stage == s)
            .map(|r| &r.per_rank_bytes)
    }

    /// zerotrain's model states of stage `s` as `aΨ + bΨ/N`.
    fn formula(&self, s: u8) -> String {
        let per = memory::bytes_per_parameter(self.spec.precision.dtype, &self.spec.optimizer);
        let sharded = [s >= 3, s >= 2, s >= 1];
        let parts = [per.params, per.grads, per.optimizer];
        let sum = |want: bool| -> u64 {
            parts
                .iter()
                .zip(sharded)
                .filter(|(_, sh)| *sh == want)
                .map(|(b, _)| b)
                .sum()
        };
        match (sum(false), sum(true)) {
            (a, 0) => format!("{a}Ψ"),
            (0, b) => format!("{b}Ψ/N"),
            (a, b) => format!("{a}Ψ + {b}Ψ/N"),
        }
    }

    fn reasons(&self, ds2: u64, ds3: u64) -> Vec<String> {
        let psi = self.arch.parameter_count();
        let n = u64::from(self.spec.world_size.get());
        let mut out = Vec::new();
        if let Some(z2) = self.stage(2) {
            out.push(format!(
                "DeepSpeed ZeRO-2 ({}): 2Ψ + 18Ψ/N counts an fp32 copy of the gradient shard \
                 (4Ψ/N = {}) beside the paper's 2Ψ + 14Ψ/N; zerotrain's stage-2 model states are \
                 {} = {}",
                human(ds2),
                human(4 * psi / n),
                self.formula(2),
                human(z2.model_states()),
            ));
        }
        if let Some(z3) = self.stage(3) {
            let largest = match self.largest {
                Some((name, l)) => format!(
                    "4L = {} for the largest layer ({l} parameters, {name}) gathered whole as \
                     fp16 parameters and gradients",
                    human(self.ds3_largest)
                ),
                None => "L is unknown for a bare parameter count and taken as 0".to_string(),
            };
            out.push(format!(
                "DeepSpeed ZeRO-3 ({}): 4L + 18Ψ/N, the same 18 bytes per parameter over N as its \
                 ZeRO-2 ({} more than the paper's 16Ψ/N), and {largest}; zerotrain's stage-3 model \
                 states are {} = {}, and what it gathers (the embeddings and two blocks) it counts \
                 in buffers ({})",
                human(ds3),
                human(2 * psi / n),
                self.formula(3),
                human(z3.model_states()),
                human(z3.buffers),
            ));
        }
        if let Some(z0) = self.stage(0) {
            let p = &self.phases;
            let precision = if self.spec.precision.dtype == Dtype::Fp32 {
                "in fp32 its step phase is the 16Ψ of weights, gradients and Adam"
            } else {
                "under mixed precision its step phase is Adam's 8Ψ alone, half the 16Ψ mixed \
                 precision holds"
            };
            out.push(format!(
                "accelerate ({}): the largest of its phases (model {}, gradients {}, optimizer \
                 {}, step {}), not their sum, for one unsharded device whatever N; {precision}; \
                 zerotrain's unsharded model states are {} = {}",
                human(p.training_using_adam()),
                human(p.model),
                human(p.gradients),
                human(p.optimizer),
                human(p.step),
                self.formula(0),
                human(z0.model_states()),
            ));
        }
        if self.spec.precision.dtype == Dtype::Fp32 {
            out.push(
                "DeepSpeed's formulas assume fp16 parameters with fp32 master weights; this job \
                 trains in fp32 (4-byte parameters and gradients, no master copy)"
                    .to_string(),
            );
        }
        if !matches!(self.spec.optimizer, Optimizer::Adamw(_)) {
            let per = memory::bytes_per_parameter(self.spec.precision.dtype, &self.spec.optimizer);
            let master = if self.spec.precision.dtype.has_master_weights() {
                4
            } else {
                0
            };
            out.push(format!(
                "both assume Adam's 8 bytes of state per parameter; {} keeps {}",
                self.spec.optimizer.name(),
                per.optimizer - master,
            ));
        }
        if let Some(z) = self.stage(0) {
            let mut uncounted = Vec::new();
            for (what, bytes) in [
                ("activations", z.activations),
                ("buffers", z.buffers),
                ("device overhead", z.overhead),
            ] {
                if bytes > 0 {
                    uncounted.push(format!("{what} ({} at stage 0)", human(bytes)));
                }
            }
            if let Some(last) = uncounted.pop() {
                let list = if uncounted.is_empty() {
                    last
                } else {
                    format!("{} or {last}", uncounted.join(", "))
                };
                out.push(format!(
                    "neither counts {list}, which zerotrain's per-rank totals include"
                ));
            }
        }
        out
    }
}
