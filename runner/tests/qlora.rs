//! QLoRA: adapters on a base whose adapted projections are held as bitsandbytes' NF4 (the
//! kernels' `nf4`, bit-identical to bitsandbytes on the committed reference tensors) compute
//! with exactly the NF4 round trip of those weights: a QLoRA job trains the same bits as a LoRA
//! job on a base whose adapted weights were quantized and dequantized beforehand, each as
//! bitsandbytes holds it, (out, in): GPT-2's Conv1D weights (in, out) transposed first, as
//! transformers transposes them.

use std::path::Path;

use kernels::nf4;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::lora_parity::tensors;
use crate::zero::train;

/// `dir`'s model with every block's matrix (every projection: what "all-linear" adapts) put
/// through NF4 and back, (out, in) (`transposed`: the file's (in, out) transposed there and
/// back), written with its config into `into`; how many were.
fn round_trip_projections(dir: &Path, into: &Path, transposed: bool) -> usize {
    let mut tensors = tensors(&std::fs::read(dir.join("model.safetensors")).unwrap());
    let mut quantized = 0;
    for (name, (shape, values)) in &mut tensors {
        let in_block = name.contains(".h.") || name.contains("layers.");
        if in_block && shape.len() == 2 {
            let (rows, cols) = (shape[0], shape[1]);
            let transpose = |v: &[f32], (r, c): (usize, usize)| -> Vec<f32> {
                (0..r * c).map(|e| v[(e % r) * c + e / r]).collect()
            };
            let mut held = match transposed {
                true => transpose(values, (rows, cols)),
                false => values.clone(),
            };
            let mut codes = vec![0; nf4::code_bytes(held.len())];
            let mut absmax = vec![0.0; nf4::blocks(held.len())];
            nf4::quantize(&held, &mut codes, &mut absmax);
            nf4::dequantize(&codes, &absmax, &mut held);
            *values = match transposed {
                true => transpose(&held, (cols, rows)),
                false => held,
            };
            quantized += 1;
        }
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (shape, values))| {
            let data: &[u8] = bytemuck::cast_slice(values);
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &into.join("model.safetensors")).unwrap();
    std::fs::copy(dir.join("config.json"), into.join("config.json")).unwrap();
    quantized
}

#[test]
fn qlora_trains_the_bits_lora_trains_on_the_nf4_round_trip_of_its_base() {
    for (preset, projections, transposed) in [("gpt2-tiny", 4, true), ("llama-tiny", 7, false)] {
        let job = |init_from: &Path, lora: &str| {
            format!(
                r#"{{"model": {{"preset": "{preset}", "init_from": "{}"}}{lora},
                    "training": {{"steps": 4, "micro_batch_size": 2, "lr": 1e-2}}}}"#,
                init_from.display()
            )
        };
        // Trains `json` on one rank into `out`; its losses.
        let losses = |json: &str, out: &Path| train(json, Some(out)).losses;
        // A base with weights of its own: the seed's, moved by a few steps of full training.
        let (seed, base) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let seeded = format!(
            r#"{{"model": {{"preset": "{preset}"}},
                "training": {{"steps": 2, "micro_batch_size": 2, "lr": 1e-2}}}}"#
        );
        losses(&seeded, seed.path());
        let layers = 2;
        assert_eq!(
            round_trip_projections(seed.path(), base.path(), transposed),
            projections * layers,
            "{preset}"
        );
        let adapters = r#", "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear""#;
        let nf4 = format!(r#"{adapters}, "quantize_base": "nf4"}}"#);
        let plain = format!("{adapters}}}");
        let (qlora_out, lora_out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let qlora = losses(&job(seed.path(), &nf4), qlora_out.path());
        let lora = losses(&job(base.path(), &plain), lora_out.path());
        assert_eq!(qlora, lora, "{preset}: losses");
        let adapter = |out: &Path| std::fs::read(out.join("adapter_model.safetensors")).unwrap();
        assert!(
            adapter(qlora_out.path()) == adapter(lora_out.path()),
            "{preset}: the trained adapters differ"
        );
        // And not what the same adapters train on the unquantized base.
        let unquantized = losses(
            &job(seed.path(), &plain),
            tempfile::tempdir().unwrap().path(),
        );
        assert_ne!(unquantized, lora, "{preset}: NF4 changed no loss");
    }
}
