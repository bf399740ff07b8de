//! Backward through frozen weights (LoRA's base): the `_input` forms compute `dinp` exactly as
//! the full backward does, and touch no weight gradient (they take none).

use crate::common::*;
use half::bf16;
use kernels::matmul::{self, DinpMode, Layout};
use kernels::{Float, layernorm, rmsnorm};

fn bits<X: Float>(v: &[X]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn matmul_case<X: Float>(layout: Layout, mode: DinpMode) {
    let (m, k, n) = (37, 48, 24);
    let mut rng = Rng::new(7);
    let (dout, inp, weight) = (
        random::<X>(&mut rng, m * n, 1.0),
        random::<X>(&mut rng, m * k, 1.0),
        random::<X>(&mut rng, k * n, 0.5),
    );
    let start = random::<X>(&mut rng, m * k, 1.0);
    let mut scratch = vec![0f32; matmul::scratch_len(m, k, n)];
    let (mut full, mut dw) = (start.clone(), vec![X::ZERO; k * n]);
    let mkn = (m, k, n);
    matmul::matmul_backward(
        &mut full,
        &mut dw,
        None,
        &dout,
        &inp,
        &weight,
        layout,
        mkn,
        mode,
        &mut scratch,
    );
    let mut frozen = start.clone();
    matmul::matmul_backward_input(&mut frozen, &dout, &weight, layout, mkn, mode, &mut scratch);
    assert_eq!(
        bits(&frozen),
        bits(&full),
        "{layout:?} {mode:?} ({})",
        X::NAME
    );
    assert!(
        dw.iter().any(|w| w.to_f32() != 0.0),
        "the full backward made a weight gradient"
    );
}

#[test]
fn a_frozen_weights_input_gradient_is_the_full_backwards() {
    for layout in [Layout::KN, Layout::NK] {
        for mode in [DinpMode::Overwrite, DinpMode::Accumulate] {
            matmul_case::<f32>(layout, mode);
            matmul_case::<bf16>(layout, mode);
        }
    }
}

#[test]
fn frozen_norms_give_the_full_backwards_input_gradient() {
    let (n, c) = (9, 40);
    let mut rng = Rng::new(8);
    let (dout, inp) = (
        random::<f32>(&mut rng, n * c, 1.0),
        random::<f32>(&mut rng, n * c, 1.0),
    );
    let (weight, bias) = (
        random::<f32>(&mut rng, c, 1.0),
        random::<f32>(&mut rng, c, 0.1),
    );
    let start = random::<f32>(&mut rng, n * c, 1.0);

    let (mut out, mut rstd) = (vec![0f32; n * c], vec![0f32; n]);
    rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &inp, &weight, 1e-6);
    let (mut full, mut dw) = (start.clone(), vec![0f32; c]);
    rmsnorm::rmsnorm_backward(&mut full, &mut dw, &dout, &inp, &weight, &rstd);
    let mut frozen = start.clone();
    rmsnorm::rmsnorm_backward_input(&mut frozen, &dout, &inp, &weight, &rstd);
    assert_eq!(bits(&frozen), bits(&full), "rmsnorm");

    let mut mean = vec![0f32; n];
    layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &weight, &bias);
    let (mut full, mut dw, mut db) = (start.clone(), vec![0f32; c], vec![0f32; c]);
    layernorm::layernorm_backward(
        &mut full, &mut dw, &mut db, &dout, &inp, &weight, &mean, &rstd,
    );
    let mut frozen = start;
    layernorm::layernorm_backward_input(&mut frozen, &dout, &inp, &weight, &mean, &rstd);
    assert_eq!(bits(&frozen), bits(&full), "layernorm");
}
