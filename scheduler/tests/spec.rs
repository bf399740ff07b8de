//! The job spec: what is refused (and where, and why), the documented defaults, the issue's
//! example, round trips through JSON, and the translation of DeepSpeed configs.

use std::num::NonZeroU32;
use std::panic::{AssertUnwindSafe, catch_unwind};

use proptest::prelude::*;
use scheduler::memory::DeviceKind;
use scheduler::model::{GptShape, Preset};
use scheduler::spec::{
    AdaFactor, Adam8bit, AdamW, Auto, CheckpointRef, Data, Dtype, DynamicLossScale, InitFrom,
    JobArtifact, JobSpec, Lion, LossScale, LrSchedule, ModelSource, Momentum, Optimizer, Parsed,
    Purpose, ScalerSemantics, Sgd, TokenizerSource, Validation, WarmupType, ZeroStage,
};
use scheduler::{Error, FieldError};
use serde_json::{Value, json};

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn parse(json: &str) -> Parsed {
    JobSpec::parse(json, Purpose::Train).unwrap_or_else(|e| panic!("{json} was refused: {e}"))
}

fn parse_value(v: Value) -> Parsed {
    parse(&v.to_string())
}

/// One invalid spec: the JSON, the purpose it is parsed for, the field path the error must name
/// and a piece of the reason it must give.
struct Invalid {
    json: &'static str,
    purpose: Purpose,
    field: &'static str,
    reason: &'static str,
}

const fn train(json: &'static str, field: &'static str, reason: &'static str) -> Invalid {
    Invalid {
        json,
        purpose: Purpose::Train,
        field,
        reason,
    }
}

const fn estimate(json: &'static str, field: &'static str, reason: &'static str) -> Invalid {
    Invalid {
        json,
        purpose: Purpose::Estimate,
        field,
        reason,
    }
}

const INVALID: &[Invalid] = &[
    // Not a spec at all.
    train(r#"{"model": "#, "spec", "not valid JSON"),
    // model
    train(r#"{}"#, "model", "missing field `model`"),
    train(
        r#"{"training": {"steps": 10}}"#,
        "model",
        "missing field `model`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-huge"}}"#,
        "model.preset",
        "unknown variant `gpt2-huge`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny", "n_layer": 4}}"#,
        "model",
        "exactly one of preset, an explicit shape, or params",
    ),
    estimate(
        r#"{"model": {"preset": "gpt2-tiny", "params": 1e9}}"#,
        "model",
        "exactly one of",
    ),
    train(
        r#"{"model": {"vocab_size": 512, "context_length": 128, "n_layer": 2, "n_embd": 64}}"#,
        "model",
        "missing n_head",
    ),
    train(
        r#"{"model": {"vocab_size": 3, "context_length": 64, "n_layer": 1, "n_head": 1, "n_embd": 8}}"#,
        "data.kind",
        "synthetic data needs model.vocab_size ≥ 4, not 3",
    ),
    // Heads wider than the attention kernels take: trainable no, estimable yes.
    train(
        r#"{"model": {"vocab_size": 64, "context_length": 64, "n_layer": 1, "n_head": 1, "n_embd": 512}}"#,
        "model.n_head",
        "512 channels per attention head; the trainer's attention kernels take at most 256",
    ),
    train(
        r#"{"model": {"config": {"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 1,
            "head_dim": 264, "max_position_embeddings": 64}}}"#,
        "model.config.head_dim",
        "264 channels per attention head",
    ),
    train(
        r#"{"model": {"init_from": "gpt2.safetensors"}}"#,
        "model",
        "give a preset",
    ),
    train(
        r#"{"model": {"vocab_size": 512, "context_length": 128, "n_layer": 2, "n_head": 12, "n_embd": 100}}"#,
        "model.n_embd",
        "100 is not divisible by model.n_head 12",
    ),
    train(
        r#"{"model": {"vocab_size": 512, "context_length": 128, "n_layer": 0, "n_head": 4, "n_embd": 64}}"#,
        "model.n_layer",
        "must be positive",
    ),
    train(
        r#"{"model": {"vocab_size": 512, "context_length": 128, "n_layer": -2, "n_head": 4, "n_embd": 64}}"#,
        "model.n_layer",
        "invalid value: integer `-2`",
    ),
    train(
        r#"{"model": {"vocab_size": 512, "context_length": 2000000, "n_layer": 2, "n_head": 4, "n_embd": 64}}"#,
        "model.context_length",
        "larger than zerotrain supports",
    ),
    estimate(
        r#"{"model": {"vocab_size": 1048576, "context_length": 1048576, "n_layer": 4096, "n_head": 1, "n_embd": 1048576}}"#,
        "model",
        "exceeds 1e15",
    ),
    train(
        r#"{"model": {"params": 7.5e9}}"#,
        "model.params",
        "estimated but not trained",
    ),
    estimate(r#"{"model": {"params": 7.5}}"#, "model", "whole number"),
    estimate(r#"{"model": {"params": -1e9}}"#, "model", "whole number"),
    estimate(r#"{"model": {"params": 0}}"#, "model", "whole number"),
    estimate(
        r#"{"model": {"params": 2e15}}"#,
        "model",
        "between 1 and 1e15",
    ),
    estimate(
        r#"{"model": {"params": 1e9, "init_from": "w.safetensors"}}"#,
        "model.init_from",
        "not a bare parameter count",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny", "init_from": " "}}"#,
        "model.init_from",
        "path to a .safetensors file",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny", "init_from": {"job": "j", "artifact": "config"}}}"#,
        "model.init_from.artifact",
        "only \"model\"",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny", "init_from": {"job": "", "artifact": "model"}}}"#,
        "model.init_from.job",
        "must be a job's id",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "resume_from": {"job": "j", "artifact": "model"}}"#,
        "resume_from.artifact",
        "must be a checkpoint",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "resume_from": {"job": "j", "artifact": "checkpoints/step-2"}}"#,
        "resume_from.artifact",
        "must be a checkpoint",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "resume_from": {"job": " ", "artifact": "checkpoints/step-00000002"}}"#,
        "resume_from.job",
        "must be a job's id",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 2},
            "resume_from": {"job": "j", "artifact": "checkpoints/step-00000002"}}"#,
        "training.steps",
        "more than the 2 steps",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny", "init_from": "w.safetensors"},
            "resume_from": {"job": "j", "artifact": "checkpoints/step-00000002"}}"#,
        "model.init_from",
        "takes its weights from there",
    ),
    // unknown fields, top level and nested
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "epochs": 3}"#,
        "epochs",
        "unknown field `epochs`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny", "dropout": 0.1}}"#,
        "model.dropout",
        "unknown field `dropout`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"learning_rate": 0.1}}"#,
        "training.learning_rate",
        "unknown field `learning_rate`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "zero": {"stage": 1, "offload": true}}"#,
        "zero.offload",
        "unknown field `offload`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "sgd", "momentum": 0.9}}"#,
        "optimizer.momentum",
        "unknown field `momentum`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "synthetic", "path": "x.txt"}}"#,
        "data",
        "unknown field `path`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "text", "path": "a.txt", "shuffle": true}}"#,
        "data",
        "unknown field `shuffle`",
    ),
    // training
    train(
        r#"{"model": {"preset": "gpt2-124M"}, "training": {"seq_len": 2048}}"#,
        "training.seq_len",
        "2048 exceeds model.context_length 1024",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 0}}"#,
        "training.seq_len",
        "nonzero",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"micro_batch_size": 0}}"#,
        "training.micro_batch_size",
        "nonzero",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"micro_batch_size": "big"}}"#,
        "training.micro_batch_size",
        "(or \"auto\")",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 0}}"#,
        "training.steps",
        "nonzero",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"grad_accum_steps": 0}}"#,
        "training.grad_accum_steps",
        "nonzero",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"lr": -0.001}}"#,
        "training.lr",
        "-0.001 must be a finite number ≥ 0",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"lr": 0}}"#,
        "training.lr",
        "must be positive",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"lr": 3e-4, "min_lr": 1e-3}}"#,
        "training.min_lr",
        "0.001 exceeds training.lr 0.0003",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"warmup_start_lr": -1e-5}}"#,
        "training.warmup_start_lr",
        "finite number ≥ 0",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"lr_schedule": "step"}}"#,
        "training.lr_schedule",
        "unknown variant `step`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"warmup_type": "exp"}}"#,
        "training.warmup_type",
        "unknown variant `exp`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 50, "warmup_steps": 50}}"#,
        "training.warmup_steps",
        "50 must be less than the decay horizon 50",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 100, "decay_steps": 20, "warmup_steps": 30, "lr_schedule": "linear"}}"#,
        "training.warmup_steps",
        "decay horizon 20",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"grad_clip": -1.0}}"#,
        "training.grad_clip",
        "-1 must be a finite number ≥ 0",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 4, "training": {"batch_size": 32, "micro_batch_size": 4, "grad_accum_steps": 1}}"#,
        "training.batch_size",
        "32 disagrees with micro_batch_size 4 × grad_accum_steps 1 × world_size 4 = 16",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 4, "training": {"batch_size": 30, "micro_batch_size": "auto"}}"#,
        "training.batch_size",
        "30 is not divisible by world_size 4",
    ),
    // micro × accumulation × world overflows 32 bits: refused, not wrapped around or panicking.
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 2, "training": {"batch_size": 2, "micro_batch_size": 65536, "grad_accum_steps": 32768}}"#,
        "training.batch_size",
        "disagrees",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 4, "training": {"micro_batch_size": 65536, "grad_accum_steps": 65536}}"#,
        "training.grad_accum_steps",
        "= 17179869184 is more than 4294967295 sequences per step",
    ),
    // precision
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp8"}}"#,
        "precision.dtype",
        "unknown variant `fp8`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "bf16", "loss_scale": 1024}}"#,
        "precision.loss_scale",
        "only fp16 takes a loss scale, not bf16",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"loss_scale": {"init": 1024}}}"#,
        "precision.loss_scale",
        "not fp32",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": 0}}"#,
        "precision.loss_scale",
        "static scale 0 must be a positive number",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": "dynamic"}}"#,
        "precision.loss_scale",
        "expected a number (static scale) or an object (dynamic scale)",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": {"backoff_factor": 1.0}}}"#,
        "precision.loss_scale.backoff_factor",
        "1 must be between 0 and 1",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": {"growth_factor": 1.0}}}"#,
        "precision.loss_scale.growth_factor",
        "1 must be greater than 1",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": {"init": 512, "min": 1024}}}"#,
        "precision.loss_scale.min",
        "1024 must be positive and at most init 512",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": {"init": 0}}}"#,
        "precision.loss_scale.init",
        "must be a positive number",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": {"growth_interval": 0}}}"#,
        "precision.loss_scale.growth_interval",
        "must be positive",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16", "loss_scale": {"window": 100}}}"#,
        "precision.loss_scale",
        "unknown field `window`",
    ),
    // optimizer
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adam"}}"#,
        "optimizer.type",
        "unknown variant `adam`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"betas": [0.9, 1.5]}}"#,
        "optimizer.betas[1]",
        "1.5 must be in [0, 1)",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adamw", "betas": [0.9, 1.0]}}"#,
        "optimizer.betas[1]",
        "1 must be in [0, 1)",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "lion", "betas": [-0.1, 0.99]}}"#,
        "optimizer.betas[0]",
        "must be in [0, 1)",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adamw", "eps": 0}}"#,
        "optimizer.eps",
        "0 must be positive",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adamw", "weight_decay": -0.1}}"#,
        "optimizer.weight_decay",
        "-0.1 must be a finite number ≥ 0",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adam8bit", "block_size": 1000}}"#,
        "optimizer.block_size",
        "1000 must be a power of two",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "momentum", "momentum": 0.0, "nesterov": true}}"#,
        "optimizer.nesterov",
        "nesterov needs a positive momentum",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "momentum", "momentum": 1.0}}"#,
        "optimizer.momentum",
        "1 must be in [0, 1)",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adafactor", "decay_rate": 0.5}}"#,
        "optimizer.decay_rate",
        "must be in [-1, 0)",
    ),
    // zero, world size
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "zero": {"stage": 4}}"#,
        "zero.stage",
        "stage 4 does not exist",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "zero": {"stage": "max"}}"#,
        "zero.stage",
        "(or \"auto\")",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 0}"#,
        "world_size",
        "nonzero",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "activation_checkpointing": "sometimes"}"#,
        "activation_checkpointing",
        "expected a boolean",
    ),
    // data
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "csv", "path": "a.csv"}}"#,
        "data.kind",
        "unknown variant `csv`",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "text", "path": ""}}"#,
        "data.path",
        "must not be empty",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "tokens", "path": "  "}}"#,
        "data.path",
        "must not be empty",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "tokens"}}"#,
        "data.path",
        "missing field `path`",
    ),
    train(
        r#"{"model": {"vocab_size": 128, "context_length": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}, "data": {"kind": "text", "path": "a.txt"}}"#,
        "data.kind",
        "byte-level text needs model.vocab_size ≥ 256, not 128",
    ),
    // name
    train(
        r#"{"name": "my job!", "model": {"preset": "gpt2-tiny"}}"#,
        "name",
        "must be 1-64 characters of letters, digits",
    ),
    train(
        r#"{"name": "", "model": {"preset": "gpt2-tiny"}}"#,
        "name",
        "must be 1-64 characters",
    ),
    train(
        r#"{"name": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "model": {"preset": "gpt2-tiny"}}"#,
        "name",
        "must be 1-64 characters",
    ),
    train(
        r#"{"name": "résumé", "model": {"preset": "gpt2-tiny"}}"#,
        "name",
        "must be 1-64 characters",
    ),
    // DeepSpeed form
    train(
        r#"{"deepspeed": {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, "world_size": 4, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.train_batch_size",
        "30 disagrees with train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 × world_size 4 = 32",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "world_size": 4, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.train_batch_size",
        "30 is not divisible by train_micro_batch_size_per_gpu 4 × world_size 4 = 16, so gradient_accumulation_steps cannot be derived",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 30}, "world_size": 4, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.train_batch_size",
        "30 is not divisible by world_size 4, so train_micro_batch_size_per_gpu",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 65536, "gradient_accumulation_steps": 65536}, "world_size": 2, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.train_batch_size",
        "disagrees",
    ),
    train(
        r#"{"deepspeed": {"gradient_accumulation_steps": 2}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.train_batch_size",
        "give train_batch_size or train_micro_batch_size_per_gpu",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4}}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.optimizer.type",
        "OneBitAdam is not supported",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.optimizer.params.adam_w_mode",
        "not supported",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5}}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.scheduler.type",
        "OneCycle is not supported",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.scheduler.params.total_num_steps",
        "missing",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "zero_optimization": {"stage": 4}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.zero_optimization.stage",
        "stage 4 does not exist",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "fp16": {"enabled": "yes"}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.fp16.enabled",
        "expected a boolean",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.optimizer.params.betas",
        "invalid length 1",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, "x"]}}}, "model": {"preset": "gpt2-tiny"}}"#,
        "deepspeed.optimizer.params.betas[1]",
        "invalid type",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8}, "model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "sgd"}}"#,
        "optimizer",
        "unknown field `optimizer`",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8}, "model": {"preset": "gpt2-tiny"}, "training": {"lr": 0.1}}"#,
        "training.lr",
        "unknown field `lr`",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8}}"#,
        "model",
        "missing field `model`",
    ),
    // device
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "device": "tpu"}"#,
        "device",
        "unknown variant `tpu`, expected `cpu` or `cuda` (or \"auto\")",
    ),
    train(
        r#"{"model": {"preset": "gpt2-tiny"}, "device": "cuda:0"}"#,
        "device",
        "unknown variant `cuda:0`",
    ),
    train(
        r#"{"deepspeed": {"train_batch_size": 8}, "model": {"preset": "gpt2-124M"}, "training": {"seq_len": 2048}}"#,
        "training.seq_len",
        "2048 exceeds model.context_length 1024",
    ),
];

#[test]
fn invalid_specs_are_refused_naming_the_field_and_the_reason() {
    assert!(INVALID.len() >= 30);
    let mut failures = Vec::new();
    for (i, row) in INVALID.iter().enumerate() {
        let outcome = catch_unwind(AssertUnwindSafe(|| JobSpec::parse(row.json, row.purpose)));
        let problem = match outcome {
            Err(_) => "panicked".to_string(),
            Ok(Ok(parsed)) => format!("was accepted as {:?}", parsed.spec),
            Ok(Err(Error::InvalidSpec(errors))) => {
                let [FieldError { field, reason }] = errors.as_slice() else {
                    failures.push(format!("row {i} {}\n    gave {errors:?}", row.json));
                    continue;
                };
                if field == row.field && reason.contains(row.reason) {
                    continue;
                }
                format!(
                    "gave {field:?}: {reason:?}, expected {:?}: …{:?}…",
                    row.field, row.reason
                )
            }
            Ok(Err(other)) => format!("gave a non-spec error {other:?}"),
        };
        failures.push(format!("row {i} {}\n    {problem}", row.json));
    }
    assert!(
        failures.is_empty(),
        "{} of {} invalid specs misbehaved:\n{}",
        failures.len(),
        INVALID.len(),
        failures.join("\n")
    );
}

/// The fields a spec's refusal names, in order.
fn refused_fields(json: &str, purpose: Purpose) -> Vec<String> {
    match JobSpec::parse(json, purpose) {
        Err(Error::InvalidSpec(errors)) => errors.into_iter().map(|e| e.field).collect(),
        other => panic!("expected a refusal of {json}, got {other:?}"),
    }
}

#[test]
fn a_spec_with_three_independent_mistakes_names_all_three() {
    let fields = refused_fields(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 0},
            "optimizer": {"type": "adamw", "betas": [0.9, 1.0]}, "world_size": 0}"#,
        Purpose::Train,
    );
    let mut sorted = fields.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        ["optimizer.betas[1]", "training.seq_len", "world_size"],
        "{fields:?}"
    );
}

#[test]
fn a_deepspeed_config_s_mistakes_are_named_together_fp16_and_bf16_at_both_blocks() {
    // Once the batch-size mistake stopped the translation, and the precision was never read.
    let fields = refused_fields(
        r#"{"deepspeed": {"fp16": {"enabled": true}, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 4}}, "model": {"preset": "gpt2-tiny"}}"#,
        Purpose::Train,
    );
    assert_eq!(
        fields,
        [
            "deepspeed.train_batch_size",
            "deepspeed.fp16",
            "deepspeed.bf16",
            "deepspeed.zero_optimization.stage"
        ]
    );
}

#[test]
fn a_mistake_inside_an_array_names_the_array_not_its_block() {
    for (optimizer, field) in [
        (
            r#"{"type": "adamw", "betas": [0.9, 0.99, 0.5]}"#,
            "optimizer.betas",
        ),
        (r#"{"betas": [0.9]}"#, "optimizer.betas"),
        (
            r#"{"type": "lion", "betas": [0.9, "x"]}"#,
            "optimizer.betas[1]",
        ),
        (r#"{"type": "adamw", "beta": 0.9}"#, "optimizer.beta"),
        (
            r#"{"type": "momentum", "nesterov": "yes"}"#,
            "optimizer.nesterov",
        ),
    ] {
        let json = format!(r#"{{"model": {{"preset": "gpt2-tiny"}}, "optimizer": {optimizer}}}"#);
        assert_eq!(
            refused_fields(&json, Purpose::Train),
            [field],
            "{optimizer}"
        );
    }
}

#[test]
fn a_type_error_does_not_hide_its_block_s_range_checks() {
    // `micro_batch_size: 0` and `steps: "x"` fail to read; the block read without them still
    // checks `lr` and `grad_clip`.
    let fields = refused_fields(
        r#"{"model": {"preset": "gpt2-tiny"},
            "training": {"micro_batch_size": 0, "steps": "x", "lr": -1, "grad_clip": -2},
            "world_size": 0}"#,
        Purpose::Train,
    );
    let mut sorted = fields.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        [
            "training.grad_clip",
            "training.lr",
            "training.micro_batch_size",
            "training.steps",
            "world_size"
        ],
        "{fields:?}"
    );
}

#[test]
fn a_resume_from_naming_no_checkpoint_is_refused_with_the_other_mistakes() {
    // Its job, its name, its clash with `init_from` and another block's mistake, all at once.
    let fields = refused_fields(
        r#"{"model": {"preset": "gpt2-tiny", "init_from": "w.safetensors"}, "world_size": 0,
            "resume_from": {"job": " ", "artifact": "model"}}"#,
        Purpose::Train,
    );
    assert_eq!(
        fields,
        [
            "world_size",
            "resume_from.job",
            "resume_from.artifact",
            "model.init_from"
        ]
    );
    // A member that fails to read leaves the rest checked, the steps against the checkpoint's.
    let fields = refused_fields(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 2},
            "resume_from": {"job": "j", "artifact": "checkpoints/step-00000002", "at": 1}}"#,
        Purpose::Train,
    );
    assert_eq!(fields, ["resume_from.at", "training.steps"]);
    // The same for a DeepSpeed config.
    let fields = refused_fields(
        r#"{"deepspeed": {"train_batch_size": 4}, "model": {"preset": "gpt2-tiny"},
            "resume_from": {"job": "", "artifact": "checkpoints/step-2"}}"#,
        Purpose::Train,
    );
    assert_eq!(fields, ["resume_from.job", "resume_from.artifact"]);
}

#[test]
fn resume_from_holds_the_step_its_checkpoint_s_name_gives() {
    let parsed = parse(
        r#"{"model": {"preset": "gpt2-tiny"}, "training": {"steps": 200},
            "resume_from": {"job": "j1", "artifact": "checkpoints/step-00000100"}}"#,
    );
    let want = CheckpointRef {
        job: "j1".into(),
        step: 100,
    };
    assert_eq!(parsed.spec.resume_from, Some(want));
    let back = serde_json::to_value(&parsed.spec).unwrap();
    assert_eq!(
        back["resume_from"],
        json!({"job": "j1", "artifact": "checkpoints/step-00000100"})
    );
    assert_eq!(
        serde_json::from_value::<JobSpec>(back.clone()).unwrap(),
        parsed.spec
    );
    // A stored spec's name is read as strictly.
    let mut bad = back;
    bad["resume_from"]["artifact"] = json!("model");
    assert!(serde_json::from_value::<JobSpec>(bad).is_err());
}

#[test]
fn every_mistake_within_one_block_is_named() {
    // Two that fail to read, then (in a block that reads) three that fail their checks.
    assert_eq!(
        refused_fields(
            r#"{"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 0, "steps": 0}}"#,
            Purpose::Train
        ),
        ["training.seq_len", "training.steps"]
    );
    assert_eq!(
        refused_fields(
            r#"{"model": {"preset": "gpt2-tiny"},
                "training": {"lr": -1, "grad_clip": -2, "warmup_steps": 60, "steps": 50}}"#,
            Purpose::Train
        ),
        ["training.lr", "training.grad_clip", "training.warmup_steps"]
    );
    assert_eq!(
        refused_fields(
            r#"{"model": {"vocab_size": 0, "context_length": 128, "n_layer": 9999, "n_head": 4, "n_embd": 64}}"#,
            Purpose::Train
        ),
        ["model.vocab_size", "model.n_layer"]
    );
}

#[test]
fn checks_that_involve_a_block_in_error_are_not_run_on_its_defaults() {
    // world_size 0 cannot be read: the batch is not checked against world size 1, which it
    // would disagree with.
    assert_eq!(
        refused_fields(
            r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 0,
                "training": {"batch_size": 32, "micro_batch_size": 4}}"#,
            Purpose::Train
        ),
        ["world_size"]
    );
    // An unknown preset: the sequence length is not checked against a stand-in model, but the
    // other blocks are still read and checked.
    assert_eq!(
        refused_fields(
            r#"{"model": {"preset": "gpt2-huge"}, "training": {"seq_len": 100000},
                "optimizer": {"type": "lion", "betas": [2, 0.5]}, "epochs": 3}"#,
            Purpose::Train
        ),
        ["epochs", "model.preset", "optimizer.betas[0]"]
    );
}

#[test]
fn an_optimizer_without_type_is_adamw_with_the_fields_given() {
    let spec =
        parse(r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"betas": [0.8, 0.95]}}"#).spec;
    assert_eq!(
        spec.optimizer,
        Optimizer::Adamw(AdamW {
            betas: [0.8, 0.95],
            ..AdamW::default()
        })
    );
    // Its fields are still AdamW's: a Lion-only field is refused.
    let fields = refused_fields(
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"momentum": 0.9}}"#,
        Purpose::Train,
    );
    assert_eq!(fields, ["optimizer.momentum"]);
}

#[test]
fn spec_error_displays_as_field_colon_reason() {
    let err = JobSpec::parse(
        r#"{"model": {"preset": "gpt2-124M"}, "training": {"micro_batch_size": 4, "seq_len": 2048}}"#,
        Purpose::Train,
    )
    .unwrap_err();
    assert_eq!(
        err,
        Error::InvalidSpec(vec![FieldError {
            field: "training.seq_len".into(),
            reason: "2048 exceeds model.context_length 1024".into(),
        }])
    );
    assert_eq!(
        err.to_string(),
        "training.seq_len: 2048 exceeds model.context_length 1024"
    );
}

#[test]
fn init_from_names_a_file_or_another_job_s_model() {
    let from_job = parse(
        r#"{"model": {"preset": "gpt2-tiny", "init_from": {"job": "j1", "artifact": "model"}}}"#,
    );
    let want = InitFrom::Artifact(JobArtifact {
        job: "j1".into(),
        artifact: "model".into(),
    });
    assert_eq!(from_job.spec.model.init_from, Some(want));
    let back = serde_json::to_value(&from_job.spec).unwrap();
    assert_eq!(
        back["model"]["init_from"],
        json!({"job": "j1", "artifact": "model"})
    );
    let from_file = parse(r#"{"model": {"preset": "gpt2-tiny", "init_from": "w.safetensors"}}"#);
    assert_eq!(
        from_file.spec.model.init_from,
        Some(InitFrom::Path("w.safetensors".into()))
    );
}

#[test]
fn preset_alone_is_a_valid_job_with_every_default() {
    let Parsed {
        spec,
        unsupported_keys,
    } = parse(r#"{"model": {"preset": "gpt2-tiny"}}"#);
    assert!(unsupported_keys.is_empty());
    assert_eq!(spec.name, None);
    assert_eq!(spec.model.source, ModelSource::Preset(Preset::Tiny));
    assert_eq!(spec.model.init_from, None);

    let t = spec.training;
    assert_eq!(t.micro_batch_size, Auto::Fixed(nz(4)));
    assert_eq!(t.batch_size, None);
    assert_eq!(t.seq_len, nz(64));
    assert_eq!(t.grad_accum_steps, nz(1));
    assert_eq!(t.steps, nz(50));
    assert_eq!(t.lr, 3e-4);
    assert_eq!(t.min_lr, 0.0);
    assert_eq!(t.warmup_steps, 0);
    assert_eq!(t.warmup_type, WarmupType::Linear);
    assert_eq!(t.warmup_start_lr, 0.0);
    assert_eq!(t.lr_schedule, LrSchedule::Cosine);
    assert_eq!(t.decay_steps, None);
    assert_eq!(t.decay_horizon(), 50);
    assert_eq!(t.seed, 1);
    assert_eq!(t.grad_clip, 1.0);
    assert_eq!(t.sequences_per_rank(spec.world_size), 4);

    assert_eq!(spec.precision.dtype, Dtype::Fp32);
    assert_eq!(spec.precision.loss_scale, None);
    assert_eq!(spec.precision.effective_loss_scale(), None);
    assert_eq!(
        spec.optimizer,
        Optimizer::Adamw(AdamW {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
        })
    );
    assert_eq!(spec.zero.stage, Auto::Auto);
    assert_eq!(spec.activation_checkpointing, Auto::Auto);
    assert_eq!(spec.world_size, nz(1));
    assert_eq!(spec.data, Data::Synthetic);
    assert_eq!(spec.checkpoint.every_steps, 0);
    assert_eq!(spec.device, Auto::Auto);
    assert_eq!(spec.architecture().gpt(), Some(&Preset::Tiny.shape()));
}

#[test]
fn the_device_kind_is_cuda_cpu_or_auto_in_either_form() {
    for (device, kind) in [
        ("\"cuda\"", Auto::Fixed(DeviceKind::Cuda)),
        ("\"cpu\"", Auto::Fixed(DeviceKind::Cpu)),
        ("\"auto\"", Auto::Auto),
    ] {
        let native = format!(r#"{{"model": {{"preset": "gpt2-tiny"}}, "device": {device}}}"#);
        assert_eq!(parse(&native).spec.device, kind, "{native}");
        let ds = format!(
            r#"{{"deepspeed": {{"train_batch_size": 4}}, "model": {{"preset": "gpt2-tiny"}}, "device": {device}}}"#
        );
        assert_eq!(parse(&ds).spec.device, kind, "{ds}");
    }
    let spec = parse(r#"{"model": {"preset": "gpt2-tiny"}, "device": "cuda"}"#).spec;
    assert_eq!(serde_json::to_value(&spec).unwrap()["device"], "cuda");
    assert_eq!(reparse(&spec, Purpose::Train), spec);
}

#[test]
fn fp16_without_a_loss_scale_gets_a_dynamic_scale_with_torch_semantics() {
    let spec = parse(r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16"}}"#).spec;
    assert_eq!(spec.precision.loss_scale, None);
    let expected = DynamicLossScale {
        semantics: ScalerSemantics::Torch,
        init: 65536.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2000,
        hysteresis: 1,
        consecutive_hysteresis: false,
        min: 1.0,
    };
    assert_eq!(
        spec.precision.effective_loss_scale(),
        Some(LossScale::Dynamic(expected))
    );
}

#[test]
fn partial_dynamic_loss_scale_fills_the_defaults_of_its_semantics() {
    let scale = |json: &str| {
        let spec = parse(&format!(
            r#"{{"model": {{"preset": "gpt2-tiny"}}, "precision": {{"dtype": "fp16", "loss_scale": {json}}}}}"#
        ))
        .spec;
        spec.precision.loss_scale.unwrap()
    };
    assert_eq!(
        scale(r#"{"init": 1024}"#),
        LossScale::Dynamic(DynamicLossScale {
            init: 1024.0,
            ..DynamicLossScale::torch()
        })
    );
    assert_eq!(
        scale(r#"{"semantics": "deepspeed"}"#),
        LossScale::Dynamic(DynamicLossScale {
            semantics: ScalerSemantics::Deepspeed,
            init: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min: 1.0,
        })
    );
    assert_eq!(scale("256"), LossScale::Static(256.0));
}

#[test]
fn each_optimizer_type_alone_gets_its_documented_defaults() {
    let optimizer = |kind: &str| {
        parse(&format!(
            r#"{{"model": {{"preset": "gpt2-tiny"}}, "optimizer": {{"type": "{kind}"}}}}"#
        ))
        .spec
        .optimizer
    };
    assert_eq!(optimizer("sgd"), Optimizer::Sgd(Sgd { weight_decay: 0.0 }));
    assert_eq!(
        optimizer("momentum"),
        Optimizer::Momentum(Momentum {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        })
    );
    assert_eq!(
        optimizer("adamw"),
        Optimizer::Adamw(AdamW {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
        })
    );
    assert_eq!(
        optimizer("lion"),
        Optimizer::Lion(Lion {
            betas: [0.9, 0.99],
            weight_decay: 0.0,
        })
    );
    assert_eq!(
        optimizer("adafactor"),
        Optimizer::Adafactor(AdaFactor {
            eps: 1e-30,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
        })
    );
    assert_eq!(
        optimizer("adam8bit"),
        Optimizer::Adam8bit(Adam8bit {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            block_size: 2048,
        })
    );
}

const ISSUE_EXAMPLE: &str = r#"{"name": "tiny-z2",
 "model": {"preset": "gpt2-124M"},
 "training": {"micro_batch_size": 4, "seq_len": 64, "grad_accum_steps": 1, "steps": 20,
              "lr": 3e-4, "warmup_steps": 0, "lr_schedule": "cosine", "seed": 1, "grad_clip": 1.0},
 "precision": {"dtype": "fp16", "loss_scale": {"init": 65536, "growth_factor": 2.0,
               "backoff_factor": 0.5, "growth_interval": 2000, "hysteresis": 1, "min": 1.0}},
 "optimizer": {"type": "adamw", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
 "zero": {"stage": 2},
 "activation_checkpointing": false,
 "world_size": 4,
 "data": {"kind": "synthetic"},
 "checkpoint": {"every_steps": 10}}"#;

#[test]
fn issue_example_parses_to_its_values() {
    let Parsed {
        spec,
        unsupported_keys,
    } = parse(ISSUE_EXAMPLE);
    assert!(unsupported_keys.is_empty());
    assert_eq!(spec.name.as_deref(), Some("tiny-z2"));
    assert_eq!(spec.model.source, ModelSource::Preset(Preset::Gpt2Small));
    assert_eq!(spec.architecture().parameter_count(), 124_439_808);
    let t = spec.training;
    assert_eq!(t.micro_batch_size, Auto::Fixed(nz(4)));
    assert_eq!(t.seq_len, nz(64));
    assert_eq!(t.grad_accum_steps, nz(1));
    assert_eq!(t.steps, nz(20));
    assert_eq!(t.lr, 3e-4);
    assert_eq!(t.warmup_steps, 0);
    assert_eq!(t.lr_schedule, LrSchedule::Cosine);
    assert_eq!(t.seed, 1);
    assert_eq!(t.grad_clip, 1.0);
    assert_eq!(t.sequences_per_rank(spec.world_size), 4);
    assert_eq!(spec.precision.dtype, Dtype::Fp16);
    assert_eq!(
        spec.precision.loss_scale,
        Some(LossScale::Dynamic(DynamicLossScale::torch()))
    );
    assert_eq!(
        spec.optimizer,
        Optimizer::Adamw(AdamW {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
        })
    );
    assert_eq!(spec.zero.stage, Auto::Fixed(ZeroStage::Gradients));
    assert_eq!(spec.activation_checkpointing, Auto::Fixed(false));
    assert_eq!(spec.world_size, nz(4));
    assert_eq!(spec.data, Data::Synthetic);
    assert_eq!(spec.checkpoint.every_steps, 10);
}

#[test]
fn model_shape_params_and_data_kinds_parse() {
    let shape = parse(
        r#"{"model": {"vocab_size": 256, "context_length": 64, "n_layer": 3, "n_head": 2, "n_embd": 16, "init_from": "w.safetensors"},
            "data": {"kind": "text", "path": "corpus.txt"}}"#,
    )
    .spec;
    assert_eq!(
        shape.model.source,
        ModelSource::Shape(GptShape {
            vocab_size: 256,
            context_length: 64,
            n_layer: 3,
            n_head: 2,
            n_embd: 16,
        })
    );
    assert_eq!(
        shape.model.init_from.as_ref().and_then(InitFrom::path),
        Some("w.safetensors")
    );
    assert_eq!(
        shape.data,
        Data::Text {
            path: "corpus.txt".into(),
            validation: None,
            tokenizer: None,
        }
    );

    let params = JobSpec::parse(r#"{"model": {"params": 7.5e9}}"#, Purpose::Estimate)
        .unwrap()
        .spec;
    assert_eq!(params.model.source, ModelSource::Params(7_500_000_000));
    assert_eq!(params.architecture().parameter_count(), 7_500_000_000);

    let tokens = parse(
        r#"{"model": {"preset": "gpt2-tiny"}, "data": {"kind": "tokens", "path": "shards/*.bin"}}"#,
    )
    .spec;
    assert_eq!(
        tokens.data,
        Data::Tokens {
            path: "shards/*.bin".into(),
            shuffle: false,
            validation: None,
        }
    );
}

#[test]
fn auto_fields_parse_as_auto() {
    let spec = parse(
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 4,
            "training": {"micro_batch_size": "auto", "batch_size": 32},
            "zero": {"stage": "auto"}, "activation_checkpointing": "auto"}"#,
    )
    .spec;
    assert_eq!(spec.training.micro_batch_size, Auto::Auto);
    assert_eq!(spec.training.batch_size, Some(nz(32)));
    assert_eq!(spec.training.sequences_per_rank(spec.world_size), 8);
    assert_eq!(spec.zero.stage, Auto::Auto);
    assert_eq!(spec.activation_checkpointing, Auto::Auto);
}

/// Serialises the spec and parses the JSON again, for the purpose it was parsed for.
///
/// Exact equality needs serde_json's `float_roundtrip` feature: its default parser is best-effort
/// and reads some shortest-form floats back one ULP off (`1e-30`, Adafactor's default eps, becomes
/// `9.999999999999999e-31`; `0.009250000000000001` becomes `0.00925`).
fn reparse(spec: &JobSpec, purpose: Purpose) -> JobSpec {
    let json = serde_json::to_string(spec).unwrap();
    JobSpec::parse(&json, purpose)
        .unwrap_or_else(|e| panic!("serialised spec {json} was refused: {e}"))
        .spec
}

#[test]
fn serialised_specs_parse_back_to_equal_specs() {
    let specs = [
        r#"{"model": {"preset": "gpt2-tiny"}}"#,
        ISSUE_EXAMPLE,
        r#"{"model": {"vocab_size": 256, "context_length": 32, "n_layer": 3, "n_head": 2, "n_embd": 16, "init_from": "w.safetensors"},
            "training": {"seq_len": 32}, "data": {"kind": "text", "path": "corpus.txt"}, "precision": {"dtype": "fp16", "loss_scale": 128}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "world_size": 2, "data": {"kind": "tokens", "path": "s/*.bin", "shuffle": true},
            "training": {"micro_batch_size": "auto", "batch_size": 16, "decay_steps": 40, "warmup_steps": 5, "warmup_type": "log", "lr_schedule": "linear"},
            "precision": {"dtype": "fp16", "loss_scale": {"semantics": "deepspeed", "consecutive_hysteresis": true}}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adafactor", "beta1": 0.9}, "precision": {"dtype": "bf16"}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adafactor"}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "momentum", "nesterov": true}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "sgd"}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "lion"}}"#,
        r#"{"model": {"preset": "gpt2-tiny"}, "optimizer": {"type": "adam8bit", "block_size": 256}}"#,
    ];
    for json in specs {
        let spec = parse(json).spec;
        assert_eq!(reparse(&spec, Purpose::Train), spec, "{json}");
    }
    let estimate = JobSpec::parse(r#"{"model": {"params": 7.5e9}}"#, Purpose::Estimate)
        .unwrap()
        .spec;
    assert_eq!(reparse(&estimate, Purpose::Estimate), estimate);
}

#[test]
fn translated_deepspeed_job_serialises_to_an_equal_native_spec() {
    let spec = parse_value(realistic_deepspeed_job()).spec;
    let json = serde_json::to_value(&spec).unwrap();
    assert!(json.get("deepspeed").is_none());
    assert_eq!(reparse(&spec, Purpose::Train), spec);
}

fn arb_optimizer() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u32..=100).prop_map(|wd| json!({"type": "sgd", "weight_decay": f64::from(wd) / 1000.0})),
        (0u32..=99, any::<bool>()).prop_map(|(m, n)| {
            json!({"type": "momentum", "momentum": f64::from(m.max(1)) / 100.0, "nesterov": n})
        }),
        (0u32..=99, 900u32..=999, 1u32..=9).prop_map(|(b1, b2, e)| {
            json!({"type": "adamw", "betas": [f64::from(b1) / 100.0, f64::from(b2) / 1000.0],
                   "eps": f64::from(e) * 1e-9})
        }),
        (0u32..=99).prop_map(|b| json!({"type": "lion", "betas": [f64::from(b) / 100.0, 0.99]})),
        prop::option::of(0u32..=99).prop_map(|b| {
            json!({"type": "adafactor", "beta1": b.map(|b| f64::from(b) / 100.0)})
        }),
        (6u32..=16).prop_map(|p| json!({"type": "adam8bit", "block_size": 1u32 << p})),
    ]
}

fn arb_precision() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!({"dtype": "fp32"})),
        Just(json!({"dtype": "bf16"})),
        (0u32..=24).prop_map(|p| json!({"dtype": "fp16", "loss_scale": 2f64.powi(p as i32)})),
        (0u32..=24, 1u32..=5000, 1u32..=4, any::<bool>()).prop_map(|(p, window, h, ds)| {
            json!({"dtype": "fp16", "loss_scale": {
                "semantics": if ds { "deepspeed" } else { "torch" },
                "init": 2f64.powi(p as i32), "growth_interval": window, "hysteresis": h}})
        }),
    ]
}

proptest! {
    #[test]
    fn generated_specs_survive_a_json_round_trip(
        micro in prop::option::of(1u32..=64),
        accum in 1u32..=16,
        world in 1u32..=8,
        give_batch in any::<bool>(),
        seq_len in 1u32..=128,
        steps in 2u32..=10_000,
        warmup_fraction in 0.0f64..1.0,
        lr_milli in 1u32..=1000,
        schedule in prop::sample::select(vec!["constant", "cosine", "linear"]),
        seed in any::<u64>(),
        clip_tenths in 0u32..=50,
        stage in prop::option::of(0u32..=3),
        checkpointing in prop::option::of(any::<bool>()),
        precision in arb_precision(),
        optimizer in arb_optimizer(),
        name in "[A-Za-z0-9._-]{1,64}",
    ) {
        let lr = f64::from(lr_milli) * 1e-5;
        let warmup = (f64::from(steps) * warmup_fraction) as u32;
        let mut training = json!({
            "micro_batch_size": micro.map_or(json!("auto"), |m| json!(m)),
            "grad_accum_steps": accum,
            "seq_len": seq_len,
            "steps": steps,
            "warmup_steps": warmup,
            "lr": lr,
            "min_lr": lr / 10.0,
            "lr_schedule": schedule,
            "seed": seed,
            "grad_clip": f64::from(clip_tenths) / 10.0,
        });
        if give_batch {
            training["batch_size"] = json!(micro.unwrap_or(4) * accum * world);
        }
        let spec_json = json!({
            "name": name,
            "model": {"preset": "gpt2-tiny"},
            "training": training,
            "precision": precision,
            "optimizer": optimizer,
            "zero": {"stage": stage.map_or(json!("auto"), |s| json!(s))},
            "activation_checkpointing": checkpointing.map_or(json!("auto"), |c| json!(c)),
            "world_size": world,
        });
        let spec = parse_value(spec_json).spec;
        prop_assert_eq!(spec.training.micro_batch_size, micro.map_or(Auto::Auto, |m| Auto::Fixed(nz(m))));
        prop_assert_eq!(spec.training.seed, seed);
        prop_assert_eq!(spec.training.lr, lr);
        prop_assert_eq!(spec.world_size.get(), world);
        prop_assert_eq!(spec.zero.stage.fixed().map(|s| u32::from(s.index())), stage);
        prop_assert_eq!(spec.name.as_deref(), Some(name.as_str()));
        prop_assert_eq!(reparse(&spec, Purpose::Train), spec);
    }
}

// ---- DeepSpeed translation ----

fn realistic_deepspeed_job() -> Value {
    json!({
        "deepspeed": {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10,
            "wall_clock_breakdown": false,
            "gradient_clipping": 1.0,
            "fp16": {
                "enabled": true,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 2,
                "min_loss_scale": 1
            },
            "zero_optimization": {
                "stage": 2,
                "overlap_comm": true,
                "reduce_bucket_size": 500_000_000
            },
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
            },
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": 0,
                    "warmup_max_lr": 6e-4,
                    "warmup_num_steps": 10,
                    "total_num_steps": 100
                }
            }
        },
        "model": {"preset": "gpt2-124M"},
        "world_size": 4,
        "training": {"steps": 100, "seq_len": 128}
    })
}

#[test]
fn realistic_deepspeed_config_translates_to_the_equivalent_job() {
    let Parsed {
        spec,
        mut unsupported_keys,
    } = parse_value(realistic_deepspeed_job());

    let t = spec.training;
    assert_eq!(spec.world_size, nz(4));
    assert_eq!(t.micro_batch_size, Auto::Fixed(nz(4)));
    assert_eq!(t.grad_accum_steps, nz(2));
    assert_eq!(t.sequences_per_rank(spec.world_size), 8);
    assert_eq!(t.steps, nz(100));
    assert_eq!(t.seq_len, nz(128));
    assert_eq!(t.grad_clip, 1.0);

    assert_eq!(spec.precision.dtype, Dtype::Fp16);
    assert_eq!(
        spec.precision.loss_scale,
        Some(LossScale::Dynamic(DynamicLossScale {
            semantics: ScalerSemantics::Deepspeed,
            init: 4096.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 500,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min: 1.0,
        }))
    );
    assert_eq!(spec.zero.stage, Auto::Fixed(ZeroStage::Gradients));
    assert_eq!(
        spec.optimizer,
        Optimizer::Adamw(AdamW {
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.1,
        })
    );
    // WarmupDecayLR: `warmup_num_steps` of log warmup from warmup_min_lr to warmup_max_lr, then
    // linear decay back to warmup_min_lr at total_num_steps.
    assert_eq!(t.lr, 6e-4);
    assert_eq!(t.warmup_steps, 10);
    assert_eq!(t.warmup_type, WarmupType::Log);
    assert_eq!(t.warmup_start_lr, 0.0);
    assert_eq!(t.lr_schedule, LrSchedule::Linear);
    assert_eq!(t.min_lr, 0.0);
    assert_eq!(t.decay_steps, Some(nz(100)));

    unsupported_keys.sort();
    assert_eq!(
        unsupported_keys,
        [
            "deepspeed.steps_per_print",
            "deepspeed.wall_clock_breakdown",
            "deepspeed.zero_optimization.overlap_comm",
            "deepspeed.zero_optimization.reduce_bucket_size",
        ]
    );
}

#[test]
fn unsupported_deepspeed_keys_are_reported_at_every_depth() {
    let mut keys = parse_value(json!({
        "deepspeed": {
            "train_micro_batch_size_per_gpu": 2,
            "fp16": {"enabled": true, "auto_cast": false},
            "bf16": {"enabled": false, "immediate_grad_update": true},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": true}, "legacy_fusion": false},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "last_batch_iteration": -1}},
            "activation_checkpointing": {"partition_activations": true}
        },
        "model": {"preset": "gpt2-tiny"}
    }))
    .unsupported_keys;
    keys.sort();
    assert_eq!(
        keys,
        [
            "deepspeed.activation_checkpointing",
            "deepspeed.bf16.immediate_grad_update",
            "deepspeed.fp16.auto_cast",
            "deepspeed.optimizer.legacy_fusion",
            "deepspeed.optimizer.params.torch_adam",
            "deepspeed.scheduler.params.last_batch_iteration",
        ]
    );
}

#[test]
fn deepspeed_batch_keys_any_two_determine_the_third_and_one_alone_means_no_accumulation() {
    // (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    //  world_size) → (micro-batch, accumulation)
    type Case = (Option<u32>, Option<u32>, Option<u32>, u32, (u32, u32));
    let cases: [Case; 9] = [
        (Some(32), Some(4), Some(2), 4, (4, 2)),
        (Some(32), Some(4), None, 4, (4, 2)),
        (Some(32), None, Some(2), 4, (4, 2)),
        (None, Some(4), Some(2), 4, (4, 2)),
        (Some(32), None, None, 4, (8, 1)),
        (None, Some(4), None, 4, (4, 1)),
        (Some(24), Some(3), None, 1, (3, 8)),
        (Some(6), None, Some(6), 1, (1, 6)),
        (Some(7), None, None, 1, (7, 1)),
    ];
    for (global, micro, accum, world, (want_micro, want_accum)) in cases {
        let mut ds = json!({});
        if let Some(g) = global {
            ds["train_batch_size"] = json!(g);
        }
        if let Some(m) = micro {
            ds["train_micro_batch_size_per_gpu"] = json!(m);
        }
        if let Some(a) = accum {
            ds["gradient_accumulation_steps"] = json!(a);
        }
        let case = format!("{ds} on {world} ranks");
        let parsed = parse_value(json!({
            "deepspeed": ds, "model": {"preset": "gpt2-tiny"}, "world_size": world
        }));
        assert!(parsed.unsupported_keys.is_empty(), "{case}");
        let t = parsed.spec.training;
        assert_eq!(t.micro_batch_size, Auto::Fixed(nz(want_micro)), "{case}");
        assert_eq!(t.grad_accum_steps, nz(want_accum), "{case}");
        assert_eq!(
            t.sequences_per_rank(parsed.spec.world_size) * world,
            global.unwrap_or(want_micro * want_accum * world),
            "{case}"
        );
    }
}

#[test]
fn deepspeed_auto_micro_batch_keeps_the_global_batch_for_the_planner() {
    let spec = parse_value(json!({
        "deepspeed": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"},
        "model": {"preset": "gpt2-tiny"}, "world_size": 4
    }))
    .spec;
    assert_eq!(spec.training.micro_batch_size, Auto::Auto);
    assert_eq!(spec.training.batch_size, Some(nz(32)));
    assert_eq!(spec.training.sequences_per_rank(spec.world_size), 8);
}

#[test]
fn deepspeed_static_loss_scale_becomes_a_static_scale() {
    let spec = parse_value(json!({
        "deepspeed": {"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 128}},
        "model": {"preset": "gpt2-tiny"}
    }))
    .spec;
    assert_eq!(spec.precision.dtype, Dtype::Fp16);
    assert_eq!(spec.precision.loss_scale, Some(LossScale::Static(128.0)));
    assert_eq!(
        spec.precision.effective_loss_scale(),
        Some(LossScale::Static(128.0))
    );
}

#[test]
fn deepspeed_fp16_section_alone_uses_deepspeed_scaler_defaults() {
    let spec = parse_value(json!({
        "deepspeed": {"train_batch_size": 8, "fp16": {"enabled": true}},
        "model": {"preset": "gpt2-tiny"}
    }))
    .spec;
    assert_eq!(
        spec.precision.loss_scale,
        Some(LossScale::Dynamic(DynamicLossScale {
            semantics: ScalerSemantics::Deepspeed,
            init: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min: 1.0,
        }))
    );
}

#[test]
fn deepspeed_disabled_fp16_and_enabled_bf16_train_in_bf16_without_a_loss_scale() {
    let spec = parse_value(json!({
        "deepspeed": {"train_batch_size": 8, "fp16": {"enabled": false, "loss_scale": 0},
                      "bf16": {"enabled": true}},
        "model": {"preset": "gpt2-tiny"}
    }))
    .spec;
    assert_eq!(spec.precision.dtype, Dtype::Bf16);
    assert_eq!(spec.precision.loss_scale, None);
}

#[test]
fn deepspeed_config_without_sections_gets_deepspeed_defaults() {
    let Parsed {
        spec,
        unsupported_keys,
    } = parse_value(json!({
        "deepspeed": {"train_batch_size": 8},
        "model": {"preset": "gpt2-tiny"}
    }));
    assert!(unsupported_keys.is_empty());
    assert_eq!(spec.zero.stage, Auto::Fixed(ZeroStage::Ddp));
    assert_eq!(spec.precision.dtype, Dtype::Fp32);
    assert_eq!(spec.precision.loss_scale, None);
    assert_eq!(
        spec.optimizer,
        Optimizer::Adamw(AdamW {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
        })
    );
    let t = spec.training;
    assert_eq!(t.lr, 1e-3);
    assert_eq!(t.grad_clip, 0.0);
    assert_eq!(t.lr_schedule, LrSchedule::Constant);
    assert_eq!(t.warmup_steps, 0);
    assert_eq!(t.min_lr, 0.0);
    assert_eq!(t.micro_batch_size, Auto::Fixed(nz(8)));
    assert_eq!(t.grad_accum_steps, nz(1));
    assert_eq!(t.steps, nz(50));
    assert_eq!(t.seq_len, nz(64));
    assert_eq!(spec.world_size, nz(1));
    assert_eq!(spec.activation_checkpointing, Auto::Auto);
    assert_eq!(spec.data, Data::Synthetic);
}

#[test]
fn deepspeed_optimizer_without_params_gets_fused_adam_defaults() {
    let (spec, from_absent) = (
        parse_value(json!({
            "deepspeed": {"train_batch_size": 8, "optimizer": {"type": "AdamW"}},
            "model": {"preset": "gpt2-tiny"}
        }))
        .spec,
        parse_value(json!({
            "deepspeed": {"train_batch_size": 8},
            "model": {"preset": "gpt2-tiny"}
        }))
        .spec,
    );
    assert_eq!(spec.optimizer, from_absent.optimizer);
    assert_eq!(spec.training.lr, from_absent.training.lr);
}

#[test]
fn deepspeed_optimizer_types_are_case_insensitive_and_map_to_zerotrain_optimizers() {
    let optimizer = |section: Value| {
        let spec = parse_value(json!({
            "deepspeed": {"train_batch_size": 8, "optimizer": section},
            "model": {"preset": "gpt2-tiny"}
        }))
        .spec;
        (spec.optimizer, spec.training.lr)
    };
    assert_eq!(
        optimizer(json!({"type": "adam", "params": {"lr": 2e-4}})),
        (
            Optimizer::Adamw(AdamW {
                betas: [0.9, 0.999],
                eps: 1e-8,
                weight_decay: 0.0
            }),
            2e-4
        )
    );
    assert_eq!(
        optimizer(json!({"type": "Lion", "params": {"weight_decay": 0.1}})),
        (
            Optimizer::Lion(Lion {
                betas: [0.9, 0.999],
                weight_decay: 0.1
            }),
            1e-3
        )
    );
    assert_eq!(
        optimizer(json!({"type": "SGD", "params": {"lr": 0.1}})),
        (Optimizer::Sgd(Sgd { weight_decay: 0.0 }), 0.1)
    );
    assert_eq!(
        optimizer(json!({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}})),
        (
            Optimizer::Momentum(Momentum {
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.0
            }),
            0.1
        )
    );
    // DeepSpeed treats AdamW as decoupled whatever adam_w_mode says.
    assert_eq!(
        optimizer(json!({"type": "AdamW", "params": {"adam_w_mode": false}})).0,
        Optimizer::Adamw(AdamW {
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0
        })
    );
}

#[test]
fn deepspeed_schedulers_translate_to_warmup_and_decay() {
    let training = |scheduler: Value| {
        parse_value(json!({
            "deepspeed": {"train_batch_size": 8,
                          "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
                          "scheduler": scheduler},
            "model": {"preset": "gpt2-tiny"},
            "training": {"steps": 200}
        }))
        .spec
        .training
    };

    // WarmupLR: its own warmup_max_lr (default 1e-3) replaces the optimizer's lr; log warmup of
    // 1000 steps by default, then constant.
    let t = training(json!({"type": "WarmupLR"}));
    assert_eq!(
        (
            t.lr,
            t.warmup_start_lr,
            t.warmup_steps,
            t.warmup_type,
            t.lr_schedule
        ),
        (1e-3, 0.0, 1000, WarmupType::Log, LrSchedule::Constant)
    );
    let t = training(json!({"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4, "warmup_num_steps": 20, "warmup_type": "linear"}}));
    assert_eq!(
        (
            t.lr,
            t.warmup_start_lr,
            t.warmup_steps,
            t.warmup_type,
            t.lr_schedule
        ),
        (2e-4, 1e-5, 20, WarmupType::Linear, LrSchedule::Constant)
    );

    // WarmupCosineLR: ratios of the optimizer's lr, cosine decay to cos_min_ratio × lr.
    let t = training(json!({"type": "WarmupCosineLR", "params": {
        "total_num_steps": 200, "warmup_num_steps": 20, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}}));
    assert_eq!(t.lr, 5e-4);
    assert_eq!(t.warmup_start_lr, 5e-4 * 0.1);
    assert_eq!(t.min_lr, 5e-4 * 0.01);
    assert_eq!(t.warmup_steps, 20);
    assert_eq!(t.warmup_type, WarmupType::Log);
    assert_eq!(t.lr_schedule, LrSchedule::Cosine);
    assert_eq!(t.decay_steps, Some(nz(200)));
    let t = training(json!({"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}));
    assert_eq!(
        (t.warmup_start_lr, t.min_lr, t.warmup_steps),
        (0.0, 5e-4 * 1e-4, 1000)
    );
}

#[test]
fn deepspeed_job_carries_name_data_checkpoint_and_activation_checkpointing() {
    let spec = parse_value(json!({
        "name": "ds-job",
        "deepspeed": {"train_batch_size": 8},
        "model": {"preset": "gpt2-tiny"},
        "data": {"kind": "tokens", "path": "a.bin", "shuffle": true},
        "checkpoint": {"every_steps": 5},
        "activation_checkpointing": true,
        "training": {"steps": 7, "seq_len": 32, "seed": 9}
    }))
    .spec;
    assert_eq!(spec.name.as_deref(), Some("ds-job"));
    assert_eq!(
        spec.data,
        Data::Tokens {
            path: "a.bin".into(),
            shuffle: true,
            validation: None,
        }
    );
    assert_eq!(spec.checkpoint.every_steps, 5);
    assert_eq!(spec.activation_checkpointing, Auto::Fixed(true));
    assert_eq!(
        (
            spec.training.steps,
            spec.training.seq_len,
            spec.training.seed
        ),
        (nz(7), nz(32), 9)
    );
}

#[test]
fn text_data_parses_with_its_tokenizer_and_validation() {
    let spec = parse(
        r#"{"model": {"preset": "llama-tiny"},
            "data": {"kind": "jsonl", "path": "chat/*.jsonl", "tokenizer": "tok/tokenizer.json",
                     "validation": {"split": 0.01, "every_steps": 50}}}"#,
    )
    .spec;
    let validation = Validation {
        path: None,
        split: Some(0.01),
        every_steps: 50,
        batches: 20,
    };
    assert_eq!(
        spec.data,
        Data::Jsonl {
            path: "chat/*.jsonl".into(),
            field: "text".into(),
            prompt: None,
            completion: None,
            messages: None,
            tokenizer: Some("tok/tokenizer.json".into()),
            validation: Some(validation),
        }
    );
    assert_eq!(
        spec.data.tokenizer(None),
        Some(TokenizerSource::Named("tok/tokenizer.json"))
    );
    // Without a tokenizer of its own, JSON Lines use init_from's directory's.
    let fine_tune = parse(
        r#"{"model": {"preset": "llama-tiny", "init_from": "models/tiny"},
            "data": {"kind": "jsonl", "path": "d.jsonl", "field": "body"}}"#,
    )
    .spec;
    assert_eq!(
        fine_tune.data.tokenizer(fine_tune.model.init_from.as_ref()),
        Some(TokenizerSource::InitFrom("models/tiny"))
    );
}

#[test]
fn text_data_that_cannot_be_read_as_given_is_refused_by_field() {
    let refused = |data: &str| {
        refused_fields(
            &format!(r#"{{"model": {{"preset": "llama-tiny"}}, "data": {data}}}"#),
            Purpose::Train,
        )
    };
    for (data, field) in [
        (r#"{"kind": "jsonl", "path": "d.jsonl"}"#, "data.tokenizer"),
        (
            r#"{"kind": "jsonl", "path": "d.jsonl", "field": "", "tokenizer": "t.json"}"#,
            "data.field",
        ),
        (
            r#"{"kind": "tokens", "path": "s.bin", "validation": {"split": 0.1}}"#,
            "data.validation.split",
        ),
        (
            r#"{"kind": "text", "path": "c.txt", "validation": {"split": 0.1}}"#,
            "data.validation.split",
        ),
        (
            r#"{"kind": "text", "path": "c.txt", "tokenizer": "t.json", "validation": {"split": 1.0}}"#,
            "data.validation.split",
        ),
        (
            r#"{"kind": "tokens", "path": "s.bin", "validation": {"path": "v.bin", "split": 0.1}}"#,
            "data.validation",
        ),
        (
            r#"{"kind": "tokens", "path": "s.bin", "validation": {}}"#,
            "data.validation",
        ),
        (
            r#"{"kind": "tokens", "path": "s.bin", "validation": {"path": "v.bin", "every_steps": 0}}"#,
            "data.validation.every_steps",
        ),
        (
            r#"{"kind": "tokens", "path": "s.bin", "validation": {"path": "v.bin", "batches": 0}}"#,
            "data.validation.batches",
        ),
    ] {
        assert_eq!(refused(data), [field], "{data}");
    }
}
