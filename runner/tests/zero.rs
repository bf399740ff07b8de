//! ZeRO stages 0-3 over ranks as threads: same parameters at every stage, the same as one rank
//! with the whole batch, and memory and communication exactly as the memory model states, for
//! every model family (the same test bodies over `MODELS`).

use std::path::Path;

use runner::comm::Op;
use runner::train::{Options, Summary, run};
use safetensors::SafeTensors;
use scheduler::memory::{self, Category, DeviceKind, Setup};
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};

fn spec(json: &str) -> JobSpec {
    JobSpec::parse(json, Purpose::Train)
        .unwrap_or_else(|e| panic!("{e}: {json}"))
        .spec
}

pub(crate) fn train(json: &str, out: Option<&Path>) -> Summary {
    let opts = Options {
        out_dir: out.map(Path::to_path_buf),
        ..Options::default()
    };
    let spec = spec(json);
    let plan = plan_local(&spec, None).unwrap();
    run(&spec, &plan, &opts, &mut |_| {}).unwrap_or_else(|e| panic!("{e}: {json}"))
}

/// A test-sized model of each family: GPT-2 (tied head, LayerNorm, learned positions) and
/// the Llama family (grouped-query attention, RoPE, SwiGLU, RMSNorm, untied head).
const MODELS: [&str; 2] = ["gpt2-tiny", "llama-tiny"];

fn job(world: usize, stage: u8, micro: usize, extra: &str) -> String {
    job_of("gpt2-tiny", world, stage, micro, extra)
}

fn job_of(model: &str, world: usize, stage: u8, micro: usize, extra: &str) -> String {
    format!(
        r#"{{"model": {{"preset": "{model}"}}, "world_size": {world}, "zero": {{"stage": {stage}}},
            "activation_checkpointing": false,
            "training": {{"steps": 5, "micro_batch_size": {micro}, "lr": 1e-3}}{extra}}}"#
    )
}

/// Adapters on every projection of the model, for a LoRA job's rows.
const LORA: &str = r#", "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"}"#;

/// As [`LORA`] on an NF4 base with dropout, as QLoRA's paper trains.
const QLORA: &str = r#", "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear",
    "quantize_base": "nf4", "dropout": 0.1}"#;

/// The export's weights: the model's, or a LoRA job's adapter.
fn exported(json: &str) -> Vec<u8> {
    let out = tempfile::tempdir().unwrap();
    train(json, Some(out.path()));
    weights(out.path())
}

fn weights(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors"))
        .or_else(|_| std::fs::read(dir.join("adapter_model.safetensors")))
        .unwrap()
}

fn values(bytes: &[u8]) -> Vec<f32> {
    let file = SafeTensors::deserialize(bytes).unwrap();
    let mut names = file.names();
    names.sort();
    names
        .iter()
        .flat_map(|n| {
            file.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn every_stage_at_4_ranks_gives_the_same_bits_and_matches_one_rank_with_the_whole_batch() {
    for model in MODELS {
        same_bits_at_every_stage(model, "");
    }
}

#[test]
fn lora_adapters_get_the_same_bits_at_every_stage_at_4_ranks_as_at_one() {
    for model in MODELS {
        same_bits_at_every_stage(model, LORA);
        same_bits_at_every_stage(model, QLORA);
    }
}

fn same_bits_at_every_stage(model: &str, extra: &str) {
    // Without clipping: stage 0 adds up the gradient norm in another order than the sharded
    // stages, so a clipping coefficient below 1 differs in its last bits.
    let job = |world, stage, micro| {
        job_of(model, world, stage, micro, extra)
            .replace(r#""lr": 1e-3"#, r#""lr": 1e-3, "grad_clip": 0"#)
    };
    let stage0 = exported(&job(4, 0, 2));
    for stage in 1..=3 {
        assert!(
            exported(&job(4, stage, 2)) == stage0,
            "{model}{extra}: stage {stage} differs from stage 0"
        );
    }
    let (sharded, single) = (values(&stage0), values(&exported(&job(1, 0, 8))));
    let diff: f64 = sharded
        .iter()
        .zip(&single)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = single
        .iter()
        .map(|b| f64::from(*b).powi(2))
        .sum::<f64>()
        .sqrt();
    eprintln!(
        "{model}{extra}: ‖4 ranks − 1 rank‖/‖1 rank‖ = {:e}",
        diff / norm
    );
    assert!(
        diff / norm < 1e-5,
        "{model}{extra}: ‖4 ranks − 1 rank‖/‖1 rank‖ = {:e}",
        diff / norm
    );
    assert!(
        diff > 0.0,
        "sums in another order should differ in the last bits"
    );
}

#[test]
fn adafactor_gives_the_same_bits_at_every_stage_at_4_ranks() {
    // Its factored statistics need every element: the ranks sum them over their shards where
    // the state is sharded, and compute them alone where it is whole (stage 0). Without
    // clipping, as stage 0 adds up the gradient norm in another order than the sharded stages.
    let adafactor = |stage| {
        job(
            4,
            stage,
            2,
            r#", "optimizer": {"type": "adafactor", "beta1": 0.9}"#,
        )
        .replace(r#""lr": 1e-3"#, r#""lr": 1e-3, "grad_clip": 0"#)
    };
    let stage0 = exported(&adafactor(0));
    for stage in 1..=3 {
        assert!(
            exported(&adafactor(stage)) == stage0,
            "stage {stage} differs from stage 0"
        );
    }
}

fn setup(json: &str) -> Setup {
    let s = spec(json);
    let micro = s.training.micro_batch_size.fixed().unwrap().get();
    Setup::new(&s, s.zero.stage.fixed().unwrap(), false, micro, 1)
}

#[test]
fn measured_memory_per_rank_equals_the_model_for_every_stage_and_world_size() {
    for (model, world) in MODELS
        .into_iter()
        .flat_map(|m| [1, 2, 4, 8].map(|w| (m, w)))
    {
        for stage in 0..=3 {
            for dtype in ["fp32", "bf16"] {
                let json = job_of(
                    model,
                    world,
                    stage,
                    2,
                    &format!(r#", "precision": {{"dtype": "{dtype}"}}"#),
                )
                .replace("\"steps\": 5", "\"steps\": 2");
                let summary = train(&json, None);
                assert_eq!(summary.ranks.len(), world);
                for r in &summary.ranks {
                    for &c in Category::ALL {
                        assert_eq!(
                            r.measured_peak_bytes.get(c),
                            r.predicted_bytes.get(c),
                            "{model}: {} at N={world}, stage {stage}, {dtype}, rank {}",
                            c.name(),
                            r.rank
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn lora_jobs_measured_memory_per_rank_equals_the_model_at_every_stage() {
    // The adapters' activations differ with checkpointing (one block's saved products), so
    // half the rows checkpoint; half of them hold an NF4 base (QLoRA), each dtype at every
    // other stage.
    for (model, world) in MODELS.into_iter().flat_map(|m| [1, 2, 4].map(|w| (m, w))) {
        for stage in 0..=3 {
            for (d, dtype) in ["fp32", "bf16"].into_iter().enumerate() {
                let ckpt = (stage + world as u8) % 2 == 1;
                let lora = if (stage as usize + d).is_multiple_of(2) {
                    QLORA
                } else {
                    LORA
                };
                let extra = format!(r#", "precision": {{"dtype": "{dtype}"}}{lora}"#);
                let json = job_of(model, world, stage, 2, &extra)
                    .replace("\"steps\": 5", "\"steps\": 2")
                    .replace(
                        "\"activation_checkpointing\": false",
                        &format!("\"activation_checkpointing\": {ckpt}"),
                    );
                let summary = train(&json, None);
                for r in &summary.ranks {
                    for &c in Category::ALL {
                        assert_eq!(
                            r.measured_peak_bytes.get(c),
                            r.predicted_bytes.get(c),
                            "{model}{lora}: {} at N={world}, stage {stage}, {dtype}, \
                             checkpointing {ckpt}, rank {}",
                            c.name(),
                            r.rank
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn stage_3_at_8_ranks_keeps_an_eighth_of_the_model_states_plus_gathered_units() {
    let at = |stage| {
        train(
            &job(8, stage, 2, "").replace("\"steps\": 5", "\"steps\": 1"),
            None,
        )
        .ranks[0]
            .measured_peak_bytes
    };
    let (s0, s3) = (at(0), at(3));
    assert_eq!(s3.model_states() * 8, s0.model_states());
    let units = scheduler::model::Units::new(&scheduler::model::Preset::Tiny.shape(), 8);
    let (emb, block) = (
        units.embeddings().padded_len as u64,
        units.largest_other_padded_len() as u64,
    );
    // fp32: gathered embeddings and two block-sized units, plus the unit gradient buffers.
    assert_eq!(
        s3.buffers - s0.buffers,
        4 * (emb + 2 * block) + 4 * (emb + block)
    );
}

#[test]
fn bytes_sent_per_step_equal_the_model_for_every_stage() {
    let steps = 3;
    let rows = MODELS
        .into_iter()
        .flat_map(|m| (0..=3).flat_map(move |s| [(m, s, ""), (m, s, LORA)]))
        // Stage 3 gathers QLoRA's NF4 bytes beside the base.
        .chain(MODELS.map(|m| (m, 3, QLORA)));
    for (model, stage, extra) in rows {
        let json = job_of(model, 4, stage, 2, extra)
            .replace("\"steps\": 5", &format!("\"steps\": {steps}"));
        let predicted = memory::estimate(&setup(&json), DeviceKind::Cpu).comm;
        let summary = train(&json, None);
        for r in &summary.ranks {
            let sent = |op| r.comm_bytes_sent.get(&op).copied().unwrap_or(0);
            assert_eq!(
                sent(Op::AllReduce),
                steps * predicted.all_reduce,
                "{model}{extra}: stage {stage} rank {}",
                r.rank
            );
            assert_eq!(
                sent(Op::ReduceScatter),
                steps * predicted.reduce_scatter,
                "{model}{extra}: stage {stage}"
            );
            assert_eq!(
                sent(Op::AllGather),
                steps * predicted.all_gather,
                "{model}{extra}: stage {stage}"
            );
        }
        if model != "gpt2-tiny" || !extra.is_empty() {
            continue;
        }
        // GPT-2's traffic in closed form, independently of the model's own arithmetic.
        let units = scheduler::model::Units::new(&scheduler::model::Preset::Tiny.shape(), 4);
        let pass = |elems: usize| elems as u64 * 3 / 4 * 4; // Ψ(N−1)/N fp32 elements
        let passes = if stage == 3 {
            3 * pass(units.padded_len()) - pass(units.iter().last().unwrap().padded_len)
        } else {
            2 * pass(units.padded_len())
        };
        // Every step the ranks also agree on the loss and the norm: 4 f32 slots, twice round.
        assert_eq!(predicted.total(), passes + 2 * 3 * 4, "stage {stage}");
    }
}

fn norm_relative(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    diff / b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt()
}

#[test]
fn resuming_on_another_world_size_and_stage_reshards_and_continues() {
    // (world, stage, micro-batch) before and after; the batch per step stays 8 sequences. The
    // models take turns; the last moves are LoRA jobs', whose checkpoints hold the adapters
    // only (QLoRA's resumption quantizes its base again and draws its dropout masks as the
    // whole run drew them).
    let moves = [
        ((4, 2, 2), (2, 1, 4), ""),
        ((2, 3, 4), (8, 0, 1), ""),
        ((4, 1, 2), (1, 3, 8), ""),
        ((2, 3, 4), (4, 1, 2), LORA),
        ((4, 3, 2), (2, 2, 4), QLORA),
    ];
    for ((before, after, lora), model) in moves.into_iter().zip(MODELS.into_iter().cycle()) {
        let with_checkpoints = |(n, s, m): (usize, u8, usize)| {
            let extra = format!(r#", "checkpoint": {{"every_steps": 4}}{lora}"#);
            job_of(model, n, s, m, &extra).replace("\"steps\": 5", "\"steps\": 10")
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let whole = train(&with_checkpoints(before), Some(a.path()));
        let step4 = Path::new("checkpoints").join("step-00000004");
        std::fs::create_dir_all(b.path().join(&step4)).unwrap();
        for entry in std::fs::read_dir(a.path().join(&step4)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), b.path().join(&step4).join(entry.file_name())).unwrap();
        }
        std::fs::write(b.path().join("checkpoints/latest"), "step-00000004").unwrap();
        let resumed = train(&with_checkpoints(after), Some(b.path()));
        assert_eq!(resumed.resumed_from, Some(4));
        // Steps 1-4 of the resumed history are the manifest's; steps 5-10 it trained itself.
        assert_eq!(resumed.losses.len(), 10);
        for step in 4..10 {
            let (got, want) = (resumed.losses[step], whole.losses[step]);
            assert!(
                (got - want).abs() < 1e-5,
                "{before:?} → {after:?}: step {} loss {got} vs {want}",
                step + 1
            );
        }
        let model = |dir: &Path| values(&weights(dir));
        let rel = norm_relative(&model(b.path()), &model(a.path()));
        assert!(
            rel < 1e-5,
            "{before:?} → {after:?}: parameters differ by {rel:e} (norm-relative)"
        );
    }
}

#[test]
fn eight_bit_adam_states_are_not_resharded() {
    let j = |n: usize, m: usize| {
        job(
            n,
            1,
            m,
            r#", "optimizer": {"type": "adam8bit"}, "checkpoint": {"every_steps": 2}"#,
        )
        .replace("\"steps\": 5", "\"steps\": 3")
    };
    let out = tempfile::tempdir().unwrap();
    train(&j(2, 4), Some(out.path()));
    let opts = Options {
        out_dir: Some(out.path().to_path_buf()),
        ..Options::default()
    };
    let spec = spec(&j(4, 2));
    let err = run(&spec, &plan_local(&spec, None).unwrap(), &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot be resharded"), "{err}");
}
