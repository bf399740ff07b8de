//! Engine-level checks: fp16 underflow and the whole-model gradient.

use std::ops::Range;

use super::*;
use crate::data::{BatchLayout, Input};
use crate::gpt::{self, BatchDims};
use crate::llama;
use half::f16;
use scheduler::model::{GptShape, LlamaShape};
use scheduler::spec::{Data, JobSpec, Purpose, ZeroStage};

/// A single-rank stage-0 engine for `json` (seeded by `seed`) with micro-batch `b` of the
/// spec's sequence length, and its data.
fn engine<X: Num + Summable>(json: &str, b: usize, seed: u64) -> (Engine<X>, DataLoader) {
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    let t = spec.training.seq_len.get() as usize;
    let setup = Setup::new(&spec, ZeroStage::Ddp, false, b as u32, 1);
    let model = spec.architecture().model().unwrap();
    let acct = Accountant::new(None);
    let e = Engine::<X>::new(&setup, model, seed, Communicator::solo(), acct.clone()).unwrap();
    let layout = BatchLayout {
        batch: b,
        seq_len: t,
        rank: 0,
        world_size: 1,
    };
    assert_eq!(spec.data, Data::Synthetic);
    let data = DataLoader::new(&Input::Synthetic, layout, 1, model.vocab_size(), &acct).unwrap();
    (e, data)
}

/// Loads the engine's next micro-batch from `data`.
fn next_batch<X: Num + Summable>(e: &mut Engine<X>, data: &mut DataLoader) {
    let batch = e.passes.batch();
    data.next_batch(&mut batch.inputs, &mut batch.targets)
        .unwrap();
}

/// Gradient elements that are zero in fp16 but not in fp32, after one micro-batch whose
/// per-token loss gradient is multiplied by `scale`.
fn underflowed(scale: f32) -> usize {
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16"}}"#;
    let (mut half, mut d16) = engine::<f16>(json, 8, 1);
    let (mut full, mut d32) = engine::<f32>(json, 8, 1);
    let tokens = half.passes.tokens() as f32;
    next_batch(&mut half, &mut d16);
    next_batch(&mut full, &mut d32);
    half.micro_step(scale / tokens).unwrap();
    full.micro_step(1.0 / tokens).unwrap();
    let pairs = half.trained.grads.iter().zip(&full.trained.grads);
    pairs
        .map(|(h, f)| {
            h.iter()
                .zip(f.iter())
                .filter(|(h, f)| h.to_f32() == 0.0 && **f != 0.0)
                .count()
        })
        .sum()
}

#[test]
fn fp16_gradients_underflow_without_loss_scaling_and_survive_with_it() {
    let (unscaled, scaled) = (underflowed(1.0), underflowed(65536.0));
    // At scale 1 the smallest gradients of gpt2-tiny (below fp16's 6e-8) become 0.
    assert!(
        unscaled >= 20,
        "only {unscaled} gradients flushed to zero at scale 1"
    );
    assert_eq!(scaled, 0, "gradients still flushed to zero at scale 65536");
}

/// The loss of the same GPT in f64, from the kernels' plain reference implementations.
fn reference_loss(
    units: &[Vec<f64>],
    shape: &GptShape,
    inputs: &[u32],
    targets: &[u32],
    d: BatchDims,
) -> f64 {
    use kernels::matmul::Layout::{KN, NK};
    use kernels::reference as r;
    let (n, c) = (d.tokens(), d.c);
    let [wte, wpe] = gpt::embeddings::<Cpu, f64>(&units[EMB], shape);
    let mut x = r::encoder_forward(inputs, wte, wpe, d.t, c);
    for l in 0..d.l {
        let p = gpt::block::<Cpu, f64>(&units[l + 1], shape, |_| true);
        let every = "a full model's unit holds every weight";
        let (ln1, _, _) = r::layernorm_forward(&x, p.ln1_w, p.ln1_b);
        let qkv = r::matmul_forward(
            &ln1,
            p.attn_w.expect(every),
            Some(p.attn_b),
            KN,
            (n, c, 3 * c),
        );
        let (atty, _) = r::attention_forward(&qkv, d.attention());
        let proj = r::matmul_forward(&atty, p.proj_w.expect(every), Some(p.proj_b), KN, (n, c, c));
        let res2 = r::residual_forward(&x, &proj);
        let (ln2, _, _) = r::layernorm_forward(&res2, p.ln2_w, p.ln2_b);
        let fch = r::matmul_forward(&ln2, p.fc_w.expect(every), Some(p.fc_b), KN, (n, c, 4 * c));
        let mlp = r::matmul_forward(
            &r::gelu_forward(&fch),
            p.fcproj_w.expect(every),
            Some(p.fcproj_b),
            KN,
            (n, 4 * c, c),
        );
        x = r::residual_forward(&res2, &mlp);
    }
    let [w, b] = gpt::final_norm::<Cpu, f64>(&units[d.l + 1], shape);
    let (lnf, _, _) = r::layernorm_forward(&x, w, b);
    let logits = r::matmul_forward(&lnf, wte, None, NK, (n, c, d.v));
    r::crossentropy_forward(&logits, targets, d.v)
        .iter()
        .sum::<f64>()
        / n as f64
}

/// The loss of the same Llama-family model in f64, from the kernels' reference
/// implementations (RoPE tables as the trainer's, in f32).
fn llama_reference_loss(
    units: &[Vec<f64>],
    s: &LlamaShape,
    inputs: &[u32],
    targets: &[u32],
    d: llama::Dims,
) -> f64 {
    use kernels::attention::AttentionDims;
    use kernels::matmul::Layout::NK;
    use kernels::reference as r;
    use kernels::rope::RopeDims;
    let (n, c, q, kv, i, v) = (d.tokens(), d.c, d.q(), d.kv_width(), d.i, d.v);
    let eps = s.rms_norm_eps;
    let (cos, sin) = llama::rope_tables(&s.rope, d.d, d.t);
    let (cos, sin): (Vec<f64>, Vec<f64>) = (
        cos.into_iter().map(f64::from).collect(),
        sin.into_iter().map(f64::from).collect(),
    );
    let rotate = |x: &[f64], heads| {
        let rd = RopeDims {
            t: d.t,
            heads,
            head_dim: d.d,
        };
        r::rope(x, &cos, &sin, rd, false)
    };
    let lin = |x: &[f64], w: &[f64], b: Option<&&[f64]>, (k, out): (usize, usize)| {
        r::matmul_forward(x, w, b.copied(), NK, (n, k, out))
    };
    let wte = &units[EMB][..v * c];
    let mut x: Vec<f64> = inputs
        .iter()
        .flat_map(|&t| wte[t as usize * c..][..c].iter().copied())
        .collect();
    for l in 0..d.l {
        let p = llama::block::<Cpu, f64>(&units[l + 1], s, |_| true);
        let every = "a full model's unit holds every weight";
        let (h1, _) = r::rmsnorm_forward(&x, p.norm1, eps);
        let mut qs = lin(&h1, p.q.expect(every), p.q_bias.as_ref(), (c, q));
        let mut ks = lin(&h1, p.k.expect(every), p.k_bias.as_ref(), (c, kv));
        let vs = lin(&h1, p.v.expect(every), p.v_bias.as_ref(), (c, kv));
        if let (Some(qn), Some(kn)) = (p.q_norm, p.k_norm) {
            qs = r::rmsnorm_forward(&qs, qn, eps).0;
            ks = r::rmsnorm_forward(&ks, kn, eps).0;
        }
        let (qs, ks) = (rotate(&qs, d.h), rotate(&ks, d.kv));
        let (y, _) =
            r::gqa_attention_forward(&qs, &ks, &vs, AttentionDims::gqa(d.b, d.t, d.h, d.kv, d.d));
        let res2 = r::residual_forward(&x, &lin(&y, p.o.expect(every), p.o_bias.as_ref(), (q, c)));
        let (h2, _) = r::rmsnorm_forward(&res2, p.norm2, eps);
        let gate = lin(&h2, p.gate.expect(every), p.gate_bias.as_ref(), (c, i));
        let up = lin(&h2, p.up.expect(every), p.up_bias.as_ref(), (c, i));
        let mlp = lin(
            &r::swiglu_forward(&gate, &up),
            p.down.expect(every),
            p.down_bias.as_ref(),
            (i, c),
        );
        x = r::residual_forward(&res2, &mlp);
    }
    let (hf, _) = r::rmsnorm_forward(&x, &units[d.l + 1][..c], eps);
    let head = if s.tie_word_embeddings { EMB } else { d.l + 2 };
    let logits = r::matmul_forward(&hf, &units[head][..v * c], None, NK, (n, c, v));
    r::crossentropy_forward(&logits, targets, v)
        .iter()
        .sum::<f64>()
        / n as f64
}

/// The first, middle and last element of every tensor.
fn three(r: Range<usize>, _: &[f32]) -> Vec<usize> {
    vec![r.start, (r.start + r.end) / 2, r.end - 1]
}

/// Checks the elements `picks` chooses of every tensor's gradient after one micro-batch of `b`
/// sequences of `json` against central finite differences of `reference` (the f64 loss of the
/// engine's parameters, given its inputs and targets), after the loss itself; returns how many
/// it checked.
fn gradients_agree_with_finite_differences(
    json: &str,
    b: usize,
    picks: fn(Range<usize>, &[f32]) -> Vec<usize>,
    reference: impl Fn(&Passes<f32, Cpu>, &[Vec<f64>], &[u32], &[u32]) -> f64,
) -> usize {
    let (mut e, mut data) = engine::<f32>(json, b, 3);
    next_batch(&mut e, &mut data);
    let loss = e.micro_step(1.0 / e.passes.tokens() as f32).unwrap();
    let mut params: Vec<Vec<f64>> = e
        .trained
        .held
        .params
        .iter()
        .map(|p| p.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let (inputs, targets) = {
        let batch = e.passes.batch();
        (batch.inputs.to_vec(), batch.targets.to_vec())
    };
    let f = |params: &[Vec<f64>]| reference(&e.passes, params, &inputs, &targets);
    let at_start = f(&params);
    assert!(
        (loss - at_start).abs() < 1e-5,
        "f32 loss {loss} vs f64 reference {at_start}"
    );
    let (mut checked, mut worst) = (0, 0f64);
    for (u, unit) in e.trained.held.units.iter().enumerate() {
        for t in &unit.tensors {
            let r = t.range();
            for i in picks(r.clone(), &e.trained.grads[u]) {
                let eps = 1e-5;
                let keep = params[u][i];
                params[u][i] = keep + eps;
                let up = f(&params);
                params[u][i] = keep - eps;
                let down = f(&params);
                params[u][i] = keep;
                let fd = (up - down) / (2.0 * eps);
                let analytic = f64::from(e.trained.grads[u][i]);
                let err = (analytic - fd).abs() / (analytic.abs().max(fd.abs()) + 1e-6);
                worst = worst.max(err);
                assert!(
                    err < 2e-4,
                    "{:?}[{}]: analytic {analytic:e} vs finite difference {fd:e}",
                    t.kind,
                    i - r.start
                );
                checked += 1;
            }
        }
    }
    eprintln!("{checked} gradients checked, worst relative error {worst:.1e}");
    checked
}

#[test]
fn whole_model_gradients_agree_with_finite_differences_of_an_f64_reference() {
    let json = r#"{"model": {"vocab_size": 32, "context_length": 16, "n_layer": 2, "n_head": 2, "n_embd": 16},
                   "training": {"seq_len": 8}}"#;
    let checked = gradients_agree_with_finite_differences(json, 2, three, gpt_reference);
    assert_eq!(checked, 3 * (2 + 12 * 2 + 2));
}

fn gpt_reference(passes: &Passes<f32, Cpu>, params: &[Vec<f64>], i: &[u32], t: &[u32]) -> f64 {
    let Passes::Gpt2(m) = passes else {
        unreachable!("a GPT-2 spec")
    };
    reference_loss(params, &m.shape, i, t, m.dims)
}

fn llama_reference(passes: &Passes<f32, Cpu>, params: &[Vec<f64>], i: &[u32], t: &[u32]) -> f64 {
    let Passes::Llama(m) = passes else {
        unreachable!("a Llama-family spec")
    };
    llama_reference_loss(params, &m.shape, i, t, m.dims)
}

/// Tiled attention at sequences past the 1,024 tokens the materialising kernels stopped at:
/// the loss at T = 1024 within 1e-5 of the f64 reference's (which materialises the
/// probabilities), and at T = 2048 the loss and the largest element of every tensor's gradient
/// against finite differences of that reference (an average over 2,048 tokens, a small element
/// is mostly f32 cancellation).
#[test]
fn long_sequences_agree_with_the_materialising_f64_reference() {
    let gpt = |t| {
        format!(
            r#"{{"model": {{"vocab_size": 32, "context_length": 2048, "n_layer": 1, "n_head": 2, "n_embd": 16}},
                "training": {{"seq_len": {t}}}}}"#
        )
    };
    let llama = |t| {
        format!(
            r#"{{"model": {{"config": {{"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
                "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 2048}}}},
                "training": {{"seq_len": {t}}}}}"#
        )
    };
    let largest = |r: Range<usize>, g: &[f32]| {
        vec![
            r.clone()
                .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                .unwrap(),
        ]
    };
    let none = |_, _: &[f32]| Vec::new();
    // The families side by side, a thread each: the f64 reference runs on one core.
    std::thread::scope(|s| {
        let gpt2 = s.spawn(|| {
            assert_eq!(
                gradients_agree_with_finite_differences(&gpt(1024), 1, none, gpt_reference),
                0
            );
            assert_eq!(
                gradients_agree_with_finite_differences(&gpt(2048), 1, largest, gpt_reference),
                16
            );
        });
        assert_eq!(
            gradients_agree_with_finite_differences(&llama(1024), 1, none, llama_reference),
            0
        );
        assert_eq!(
            gradients_agree_with_finite_differences(&llama(2048), 1, largest, llama_reference),
            12
        );
        gpt2.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
    });
}

#[test]
fn llama_family_gradients_agree_with_finite_differences_of_an_f64_reference() {
    // Between them every optional tensor of the family: grouped-query attention, q/k norms and
    // a head dim that is not C/H, llama3 RoPE scaling, q/k/v/o and MLP biases, tied and untied
    // heads.
    let shape = r#""vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0"#;
    let llama3 = r#""rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}"#;
    for config in [
        format!(
            r#"{{"model_type": "qwen3", {shape}, "head_dim": 6, "attention_bias": true,
                "tie_word_embeddings": false, {llama3}}}"#
        ),
        format!(
            r#"{{"model_type": "llama", {shape}, "attention_bias": true, "mlp_bias": true,
                "tie_word_embeddings": true}}"#
        ),
    ] {
        let json = format!(r#"{{"model": {{"config": {config}}}, "training": {{"seq_len": 8}}}}"#);
        let spec = JobSpec::parse(&json, Purpose::Train).unwrap().spec;
        let tensors = spec.architecture().model().unwrap().units(1).tensor_count();
        let checked = gradients_agree_with_finite_differences(&json, 2, three, llama_reference);
        assert_eq!(checked, 3 * tensors, "{config}");
    }
}

/// LoRA's dropout: the adapters' gradients, with the input's gradient through every adapter
/// masked as forward masked its input, agree with central differences of the loss the engine
/// computes under the same masks (drawn again for every evaluation, so the same each time).
#[test]
fn lora_gradients_through_dropout_agree_with_finite_differences_under_the_same_masks() {
    use rand::SeedableRng;
    use rand_distr::{Distribution, Uniform};
    for preset in ["gpt2-tiny", "llama-tiny"] {
        let json = format!(
            r#"{{"model": {{"preset": "{preset}"}}, "training": {{"seq_len": 16}},
                "lora": {{"rank": 2, "alpha": 4, "target_modules": "all-linear", "dropout": 0.5}}}}"#
        );
        let (mut e, mut data) = engine::<f32>(&json, 2, 3);
        // Adapters of some size: B starts at zero, where A's gradient is zero.
        let (mut rng, size) = (
            rand::rngs::ChaCha8Rng::seed_from_u64(5),
            Uniform::new(-0.3f32, 0.3).unwrap(),
        );
        for p in &mut e.trained.held.params {
            p.iter_mut().for_each(|v| *v = size.sample(&mut rng));
        }
        next_batch(&mut e, &mut data);
        e.drop_for(Some(0));
        let trained = e.micro_step(1.0 / e.passes.tokens() as f32).unwrap();
        let loss = |e: &mut Engine<f32>| {
            e.forward().unwrap();
            e.head_loss(None).unwrap()
        };
        assert_eq!(
            loss(&mut e),
            trained,
            "{preset}: the masks are drawn alike each time"
        );
        e.drop_for(None);
        assert_ne!(loss(&mut e), trained, "{preset}: evaluation drops nothing");
        e.drop_for(Some(0));
        let (mut checked, mut worst) = (0, 0f64);
        let units = e.trained.held.units.clone();
        for (u, unit) in units.iter().enumerate() {
            for t in &unit.tensors {
                let g = &e.trained.grads[u];
                let i = t
                    .range()
                    .max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                    .unwrap();
                let analytic = f64::from(g[i]);
                let eps = 2e-3;
                let keep = e.trained.held.params[u][i];
                e.trained.held.params[u][i] = keep + eps;
                let up = loss(&mut e);
                e.trained.held.params[u][i] = keep - eps;
                let down = loss(&mut e);
                e.trained.held.params[u][i] = keep;
                let fd = (up - down) / (2.0 * f64::from(eps));
                let err = (analytic - fd).abs() / analytic.abs().max(fd.abs());
                worst = worst.max(err);
                assert!(
                    err < 1e-2,
                    "{preset} {:?}: analytic {analytic:e} vs finite difference {fd:e}",
                    t.kind
                );
                checked += 1;
            }
        }
        eprintln!(
            "{preset}: {checked} adapter gradients checked, worst relative error {worst:.1e}"
        );
    }
}
