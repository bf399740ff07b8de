//! Engine-level checks: fp16 underflow and the whole-model gradient.

use super::*;
use crate::data::{BatchLayout, DataRoots};
use half::f16;
use scheduler::spec::{JobSpec, Purpose, ZeroStage};

/// A single-rank stage-0 engine for `json` (seeded by `seed`) with micro-batch `b` of the
/// spec's sequence length, and its data.
fn engine<X: Num + Summable>(json: &str, b: usize, seed: u64) -> (Engine<X>, DataLoader) {
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    let t = spec.training.seq_len.get() as usize;
    let setup = Setup::new(&spec, ZeroStage::Ddp, false, b as u32, 1);
    let shape = spec.architecture().gpt().copied().unwrap();
    let acct = Accountant::new(None);
    let e = Engine::<X>::new(&setup, shape, seed, Communicator::solo(), acct.clone()).unwrap();
    let layout = BatchLayout {
        batch: b,
        seq_len: t,
        rank: 0,
        world_size: 1,
    };
    let roots = DataRoots::anywhere();
    let data = DataLoader::new(&spec.data, &roots, layout, 1, shape.vocab_size, &acct).unwrap();
    (e, data)
}

/// Gradient elements that are zero in fp16 but not in fp32, after one micro-batch whose
/// per-token loss gradient is multiplied by `scale`.
fn underflowed(scale: f32) -> usize {
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16"}}"#;
    let (mut half, mut d16) = engine::<f16>(json, 8, 1);
    let (mut full, mut d32) = engine::<f32>(json, 8, 1);
    let tokens = (half.dims.tokens()) as f32;
    d16.next_batch(&mut half.acts.inputs, &mut half.acts.targets)
        .unwrap();
    d32.next_batch(&mut full.acts.inputs, &mut full.acts.targets)
        .unwrap();
    half.micro_step(scale / tokens).unwrap();
    full.micro_step(1.0 / tokens).unwrap();
    let pairs = half.bufs.grads.iter().zip(&full.bufs.grads);
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
        let p = gpt::block::<Cpu, f64>(&units[l + 1], shape);
        let (ln1, _, _) = r::layernorm_forward(&x, p.ln1_w, p.ln1_b);
        let qkv = r::matmul_forward(&ln1, p.attn_w, Some(p.attn_b), KN, (n, c, 3 * c));
        let (atty, _) = r::attention_forward(&qkv, d.attention());
        let proj = r::matmul_forward(&atty, p.proj_w, Some(p.proj_b), KN, (n, c, c));
        let res2 = r::residual_forward(&x, &proj);
        let (ln2, _, _) = r::layernorm_forward(&res2, p.ln2_w, p.ln2_b);
        let fch = r::matmul_forward(&ln2, p.fc_w, Some(p.fc_b), KN, (n, c, 4 * c));
        let mlp = r::matmul_forward(
            &r::gelu_forward(&fch),
            p.fcproj_w,
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

#[test]
fn whole_model_gradients_agree_with_finite_differences_of_an_f64_reference() {
    let json = r#"{"model": {"vocab_size": 32, "context_length": 16, "n_layer": 2, "n_head": 2, "n_embd": 16},
                   "training": {"seq_len": 8}}"#;
    let (mut e, mut data) = engine::<f32>(json, 2, 3);
    let shape = e.shape;
    data.next_batch(&mut e.acts.inputs, &mut e.acts.targets)
        .unwrap();
    let loss = e.micro_step(1.0 / e.dims.tokens() as f32).unwrap();
    let mut params: Vec<Vec<f64>> = e
        .bufs
        .params
        .iter()
        .map(|p| p.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let (inputs, targets) = (e.acts.inputs.to_vec(), e.acts.targets.to_vec());
    let reference = reference_loss(&params, &shape, &inputs, &targets, e.dims);
    assert!(
        (loss - reference).abs() < 1e-5,
        "f32 loss {loss} vs f64 reference {reference}"
    );
    let (mut checked, mut worst) = (0, 0f64);
    for (u, unit) in e.units.iter().enumerate() {
        for t in &unit.tensors {
            let r = t.range();
            for i in [r.start, (r.start + r.end) / 2, r.end - 1] {
                let eps = 1e-5;
                let keep = params[u][i];
                params[u][i] = keep + eps;
                let up = reference_loss(&params, &shape, &inputs, &targets, e.dims);
                params[u][i] = keep - eps;
                let down = reference_loss(&params, &shape, &inputs, &targets, e.dims);
                params[u][i] = keep;
                let fd = (up - down) / (2.0 * eps);
                let analytic = f64::from(e.bufs.grads[u][i]);
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
    assert_eq!(checked, 3 * (2 + 12 * 2 + 2));
}
