//! Jobs given as a DeepSpeed config: `{"deepspeed": {…}, "model": …, "data": …}`. The keys
//! zerotrain understands are translated with DeepSpeed's own defaults; every other key is
//! reported back in `unsupported_keys`, never silently dropped.

use std::num::NonZeroU32;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::{
    AdamW, Auto, Checkpoint, Data, DynamicLossScale, JobArtifact, JobSpec, Lion, LossScale,
    LrSchedule, ModelSpec, Momentum, Optimizer, Parsed, Precision, Sgd, Training, WarmupType, Zero,
    ZeroStage, from_value,
};
use crate::error::{Error, FieldError, Problems};
use crate::memory::DeviceKind;
use crate::spec::Dtype;

/// The zerotrain side of a DeepSpeed-form job: everything a DeepSpeed config does not say.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeepSpeedJob {
    deepspeed: Map<String, Value>,
    model: ModelSpec,
    #[serde(default)]
    name: Option<String>,
    #[serde(default = "super::one")]
    world_size: NonZeroU32,
    #[serde(default)]
    data: Data,
    #[serde(default)]
    checkpoint: Checkpoint,
    #[serde(default = "super::auto")]
    activation_checkpointing: Auto<bool>,
    #[serde(default)]
    training: Extra,
    #[serde(default = "super::auto")]
    device: Auto<DeviceKind>,
    #[serde(default)]
    resume_from: Option<JobArtifact>,
}

/// Training fields a DeepSpeed config has no key for.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Extra {
    steps: NonZeroU32,
    seq_len: NonZeroU32,
    seed: u64,
}

impl Default for Extra {
    fn default() -> Self {
        let t = Training::default();
        Extra {
            steps: t.steps,
            seq_len: t.seq_len,
            seed: t.seed,
        }
    }
}

/// The job, and its `resume_from` as given: validation reads the checkpoint it names into the
/// spec. Each section's mistakes are reported together with the others'.
pub(super) fn translate(value: Value) -> Result<(Parsed, Option<JobArtifact>), Error> {
    let job: DeepSpeedJob = from_value(value)?;
    let mut unsupported = Vec::new();
    let mut ds = Section::new("deepspeed".into(), job.deepspeed);
    let world = job.world_size;

    let mut p = Problems::default();
    let mut training = Training {
        steps: job.training.steps,
        seq_len: job.training.seq_len,
        seed: job.training.seed,
        grad_clip: p
            .note(ds.take::<f64>("gradient_clipping"))
            .flatten()
            .unwrap_or(0.0),
        lr_schedule: LrSchedule::Constant,
        ..Training::default()
    };
    p.note(batch(&mut ds, world, &mut training));
    let precision = p.note(precision(&mut ds, &mut unsupported));
    let stage = p.note(zero_stage(&mut ds, &mut unsupported));
    let optimizer = p.note(optimizer(&mut ds, &mut training, &mut unsupported));
    p.note(scheduler(&mut ds, &mut training, &mut unsupported));
    p.finish()?;
    let (Some(precision), Some(stage), Some(optimizer)) = (precision, stage, optimizer) else {
        unreachable!("a section that failed recorded its mistakes");
    };
    ds.finish(&mut unsupported);

    let parsed = Parsed {
        spec: JobSpec {
            name: job.name,
            model: job.model,
            training,
            precision,
            optimizer,
            zero: Zero {
                stage: Auto::Fixed(stage),
            },
            activation_checkpointing: job.activation_checkpointing,
            world_size: world,
            data: job.data,
            checkpoint: job.checkpoint,
            device: job.device,
            resume_from: None,
            lora: None,
        },
        unsupported_keys: unsupported,
    };
    Ok((parsed, job.resume_from))
}

/// `zero_optimization.stage` (0 without the section).
fn zero_stage(ds: &mut Section, unsupported: &mut Vec<String>) -> Result<ZeroStage, Error> {
    let Some(mut z) = ds.section("zero_optimization")? else {
        return Ok(ZeroStage::Ddp);
    };
    let stage = z.take::<u64>("stage")?.unwrap_or(0);
    let stage = ZeroStage::from_index(stage)
        .ok_or_else(|| Error::spec(z.field("stage"), format!("stage {stage} does not exist")))?;
    z.finish(unsupported);
    Ok(stage)
}

/// DeepSpeed's batch rule: train_batch_size = micro × accumulation × world size; any two
/// determine the third, and one alone means no accumulation.
fn batch(ds: &mut Section, world: NonZeroU32, t: &mut Training) -> Result<(), Error> {
    let global: Option<NonZeroU32> = ds.take("train_batch_size")?;
    let micro: Option<Auto<NonZeroU32>> = ds.take("train_micro_batch_size_per_gpu")?;
    let accum: Option<NonZeroU32> = ds.take("gradient_accumulation_steps")?;
    let w = world.get();
    // `terms` names the given factors of `den`; the quotient is the missing key, `derived`.
    // In u64, so that large factors are refused rather than overflowing.
    let exact = |g: NonZeroU32, den: u64, terms: &str, derived: &str| {
        let g = g.get();
        u32::try_from(u64::from(g) / den)
            .ok()
            .and_then(NonZeroU32::new)
            .filter(|_| u64::from(g) % den == 0)
            .ok_or_else(|| {
                Error::spec(
                    ds.field("train_batch_size"),
                    format!("{g} is not divisible by {terms}, so {derived} cannot be derived"),
                )
            })
    };
    let (micro, accum) = match (global, micro, accum) {
        (Some(g), Some(Auto::Fixed(m)), Some(a)) => {
            let implied = u64::from(m.get()) * u64::from(a.get()) * u64::from(w);
            if u64::from(g.get()) != implied {
                return Err(Error::spec(
                    ds.field("train_batch_size"),
                    format!(
                        "{g} disagrees with train_micro_batch_size_per_gpu {m} × gradient_accumulation_steps {a} × world_size {w} = {implied}"
                    ),
                ));
            }
            (Auto::Fixed(m), a)
        }
        (Some(g), Some(Auto::Fixed(m)), None) => {
            let den = u64::from(m.get()) * u64::from(w);
            let terms = format!("train_micro_batch_size_per_gpu {m} × world_size {w} = {den}");
            (
                Auto::Fixed(m),
                exact(g, den, &terms, "gradient_accumulation_steps")?,
            )
        }
        (Some(g), None, Some(a)) => {
            let den = u64::from(a.get()) * u64::from(w);
            let terms = format!("gradient_accumulation_steps {a} × world_size {w} = {den}");
            let m = exact(g, den, &terms, "train_micro_batch_size_per_gpu")?;
            (Auto::Fixed(m), a)
        }
        (Some(g), None, None) => {
            let terms = format!("world_size {w}");
            let m = exact(g, u64::from(w), &terms, "train_micro_batch_size_per_gpu")?;
            (Auto::Fixed(m), NonZeroU32::MIN)
        }
        (g, Some(Auto::Auto), a) => {
            t.batch_size = g;
            (Auto::Auto, a.unwrap_or(NonZeroU32::MIN))
        }
        (None, Some(m), a) => (m, a.unwrap_or(NonZeroU32::MIN)),
        (None, None, _) => {
            return Err(Error::spec(
                "deepspeed.train_batch_size",
                "give train_batch_size or train_micro_batch_size_per_gpu",
            ));
        }
    };
    t.micro_batch_size = micro;
    t.grad_accum_steps = accum;
    Ok(())
}

fn precision(ds: &mut Section, unsupported: &mut Vec<String>) -> Result<Precision, Error> {
    let mut fp16 = false;
    let mut loss_scale = None;
    if let Some(mut s) = ds.section("fp16")? {
        fp16 = s.take("enabled")?.unwrap_or(false);
        let d = DynamicLossScale::deepspeed();
        let power: u32 = s.take("initial_scale_power")?.unwrap_or(16);
        let dynamic = DynamicLossScale {
            init: 2f64.powi(power.min(127) as i32),
            growth_interval: s.take("loss_scale_window")?.unwrap_or(d.growth_interval),
            hysteresis: s.take("hysteresis")?.unwrap_or(d.hysteresis),
            consecutive_hysteresis: s.take("consecutive_hysteresis")?.unwrap_or(false),
            min: s.take("min_loss_scale")?.unwrap_or(d.min),
            ..d
        };
        let fixed: f64 = s.take("loss_scale")?.unwrap_or(0.0);
        loss_scale = Some(if fixed > 0.0 {
            LossScale::Static(fixed)
        } else {
            LossScale::Dynamic(dynamic)
        });
        s.finish(unsupported);
    }
    let mut bf16 = false;
    for key in ["bf16", "bfloat16"] {
        if let Some(mut s) = ds.section(key)? {
            bf16 |= s.take::<bool>("enabled")?.unwrap_or(false);
            s.finish(unsupported);
        }
    }
    let dtype = match (fp16, bf16) {
        (true, true) => {
            let both = |(this, other)| FieldError {
                field: format!("deepspeed.{this}"),
                reason: format!("cannot be enabled together with deepspeed.{other}"),
            };
            return Err(Error::InvalidSpec(
                [("fp16", "bf16"), ("bf16", "fp16")].map(both).into(),
            ));
        }
        (true, false) => Dtype::Fp16,
        (false, true) => Dtype::Bf16,
        (false, false) => Dtype::Fp32,
    };
    Ok(Precision {
        dtype,
        loss_scale: loss_scale.filter(|_| fp16),
    })
}

/// DeepSpeed's optimizer section: Adam/AdamW (FusedAdam defaults: lr 1e-3, weight_decay 0),
/// Lion (FusedLion: betas 0.9/0.999), SGD (momentum 0 unless given). Without the section the job
/// gets FusedAdam with its defaults, as with `{"type": "AdamW"}`.
fn optimizer(
    ds: &mut Section,
    t: &mut Training,
    unsupported: &mut Vec<String>,
) -> Result<Optimizer, Error> {
    let Some(mut o) = ds.section("optimizer")? else {
        t.lr = 1e-3;
        return Ok(Optimizer::Adamw(AdamW {
            weight_decay: 0.0,
            ..AdamW::default()
        }));
    };
    let kind: String = o
        .take("type")?
        .ok_or_else(|| Error::spec(o.field("type"), "missing"))?;
    let type_field = o.field("type");
    let mut p = o
        .section("params")?
        .unwrap_or_else(|| Section::new(o.field("params"), Map::new()));
    t.lr = p.take("lr")?.unwrap_or(1e-3);
    let weight_decay = p.take("weight_decay")?.unwrap_or(0.0);
    let lower = kind.to_ascii_lowercase();
    let optimizer = match lower.as_str() {
        "adam" | "adamw" => {
            // DeepSpeed applies adam_w_mode to "Adam" only; "AdamW" is always decoupled.
            let decoupled: bool = p.take("adam_w_mode")?.unwrap_or(true);
            if lower == "adam" && !decoupled {
                return Err(Error::spec(
                    p.field("adam_w_mode"),
                    "Adam with L2 regularisation (adam_w_mode false) is not supported; zerotrain's Adam is AdamW",
                ));
            }
            Optimizer::Adamw(AdamW {
                betas: p.take("betas")?.unwrap_or([0.9, 0.999]),
                eps: p.take("eps")?.unwrap_or(1e-8),
                weight_decay,
            })
        }
        "lion" => Optimizer::Lion(Lion {
            betas: p.take("betas")?.unwrap_or([0.9, 0.999]),
            weight_decay,
        }),
        "sgd" => {
            let momentum: f64 = p.take("momentum")?.unwrap_or(0.0);
            let nesterov: bool = p.take("nesterov")?.unwrap_or(false);
            if momentum > 0.0 {
                Optimizer::Momentum(Momentum {
                    momentum,
                    nesterov,
                    weight_decay,
                })
            } else {
                Optimizer::Sgd(Sgd { weight_decay })
            }
        }
        _ => {
            return Err(Error::spec(
                type_field,
                format!("{kind} is not supported; use Adam, AdamW, Lion or SGD"),
            ));
        }
    };
    p.finish(unsupported);
    o.finish(unsupported);
    Ok(optimizer)
}

/// DeepSpeed's LR schedulers: WarmupLR (warmup, then constant), WarmupDecayLR (then linear decay
/// to warmup_min_lr at total_num_steps) and WarmupCosineLR (ratio-based, cosine decay).
/// DeepSpeed warms up logarithmically unless `warmup_type` is "linear".
fn scheduler(
    ds: &mut Section,
    t: &mut Training,
    unsupported: &mut Vec<String>,
) -> Result<(), Error> {
    let Some(mut s) = ds.section("scheduler")? else {
        return Ok(());
    };
    let kind: String = s
        .take("type")?
        .ok_or_else(|| Error::spec(s.field("type"), "missing"))?;
    let type_field = s.field("type");
    let mut p = s
        .section("params")?
        .unwrap_or_else(|| Section::new(s.field("params"), Map::new()));
    t.warmup_steps = p.take("warmup_num_steps")?.unwrap_or(1000);
    t.warmup_type = p.take("warmup_type")?.unwrap_or(WarmupType::Log);
    match kind.as_str() {
        "WarmupLR" | "WarmupDecayLR" => {
            t.warmup_start_lr = p.take("warmup_min_lr")?.unwrap_or(0.0);
            t.lr = p.take("warmup_max_lr")?.unwrap_or(1e-3);
            if kind == "WarmupDecayLR" {
                t.lr_schedule = LrSchedule::Linear;
                t.min_lr = t.warmup_start_lr;
                t.decay_steps = Some(total_steps(&mut p)?);
            }
        }
        "WarmupCosineLR" => {
            let start: f64 = p.take("warmup_min_ratio")?.unwrap_or(0.0);
            let end: f64 = p.take("cos_min_ratio")?.unwrap_or(1e-4);
            t.warmup_start_lr = t.lr * start;
            t.min_lr = t.lr * end;
            t.lr_schedule = LrSchedule::Cosine;
            t.decay_steps = Some(total_steps(&mut p)?);
        }
        other => {
            return Err(Error::spec(
                type_field,
                format!("{other} is not supported; use WarmupLR, WarmupDecayLR or WarmupCosineLR"),
            ));
        }
    }
    p.finish(unsupported);
    s.finish(unsupported);
    Ok(())
}

fn total_steps(p: &mut Section) -> Result<NonZeroU32, Error> {
    p.take("total_num_steps")?
        .ok_or_else(|| Error::spec(p.field("total_num_steps"), "missing"))
}

/// One object of the DeepSpeed config; keys are taken out as they are understood, and the
/// rest are reported as unsupported when the section is finished.
struct Section {
    path: String,
    map: Map<String, Value>,
}

impl Section {
    fn new(path: String, map: Map<String, Value>) -> Section {
        Section { path, map }
    }

    fn field(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    fn take<T: DeserializeOwned>(&mut self, key: &str) -> Result<Option<T>, Error> {
        match self.map.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => from_value(v).map(Some).map_err(|e| match e {
                Error::InvalidSpec(mut errors) => {
                    for e in &mut errors {
                        e.field = match e.field.as_str() {
                            "spec" => self.field(key),
                            index if index.starts_with('[') => {
                                format!("{}{index}", self.field(key))
                            }
                            inner => format!("{}.{inner}", self.field(key)),
                        };
                    }
                    Error::InvalidSpec(errors)
                }
                other => other,
            }),
        }
    }

    fn section(&mut self, key: &str) -> Result<Option<Section>, Error> {
        let path = self.field(key);
        Ok(self
            .take::<Map<String, Value>>(key)?
            .map(|map| Section::new(path, map)))
    }

    fn finish(self, unsupported: &mut Vec<String>) {
        unsupported.extend(self.map.keys().map(|k| format!("{}.{k}", self.path)));
    }
}
