//! Forward and backward of each unit for one micro-batch (llm.c's structure, Hugging Face's
//! layout), on any device. Backward kernels accumulate into gradient buffers (`+=`), so
//! gradients of successive micro-batches add up; `dres` carries ∂loss/∂(residual stream) down
//! the blocks.

use kernels::matmul::{DinpMode, Layout};
use scheduler::model::GptShape;

use super::{
    Acts, BatchDims, Block, BlockActs, embeddings, embeddings_mut, final_norm, final_norm_mut,
};
use crate::Error;
use crate::device::{Device, Num};

/// `encoded = wte[inputs] + wpe[0..T]`.
pub fn embed_forward<D: Device, X: Num>(
    dev: &D,
    emb: D::View<'_, X>,
    shape: &GptShape,
    d: &BatchDims,
    acts: &mut Acts<X, D>,
) -> Result<(), Error> {
    let [wte, wpe] = embeddings::<D, X>(emb, shape);
    let out = acts.encoded.view_mut();
    dev.encoder_forward(out, acts.inputs.view(), wte, Some(wpe), d.t, d.c)
}

/// Adds ∂loss/∂wte and ∂loss/∂wpe from `dres` (∂loss/∂encoded) into the embeddings' gradient.
pub fn embed_backward<D: Device, X: Num>(
    dev: &D,
    demb: D::ViewMut<'_, X>,
    shape: &GptShape,
    d: &BatchDims,
    acts: &Acts<X, D>,
) -> Result<(), Error> {
    let [dwte, dwpe] = embeddings_mut::<D, X>(demb, shape);
    let (dres, inputs) = (acts.dres.view(), acts.inputs.view());
    dev.encoder_backward(dwte, Some(dwpe), dres, inputs, d.t, d.c)
}

/// Block `l`: from its input (`encoded` or the previous block's output) to `res3[l]`, saving
/// what backward needs in `acts.blocks[slot]`.
pub fn block_forward<D: Device, X: Num>(
    dev: &D,
    p: &Block<D::View<'_, X>>,
    acts: &mut Acts<X, D>,
    l: usize,
    slot: usize,
    d: &BatchDims,
) -> Result<(), Error> {
    let (n, c) = (d.tokens(), d.c);
    let (before, from_l) = acts.res3.split_at_mut(l);
    let input = if l == 0 {
        acts.encoded.view()
    } else {
        before[l - 1].view()
    };
    let out = &mut from_l[0];
    let a = &mut acts.blocks[slot];
    let mm = &mut acts.matmul_scratch;
    dev.layernorm_forward(
        a.ln1.view_mut(),
        a.ln1_mean.view_mut(),
        a.ln1_rstd.view_mut(),
        D::share(&input),
        D::share(&p.ln1_w),
        D::share(&p.ln1_b),
    )?;
    dev.matmul_forward(
        a.qkv.view_mut(),
        a.ln1.view(),
        D::share(&p.attn_w),
        Some(D::share(&p.attn_b)),
        Layout::KN,
        (n, c, 3 * c),
        mm.view_mut(),
    )?;
    dev.attention_forward(
        a.atty.view_mut(),
        a.att.view_mut(),
        a.qkv.view(),
        d.attention(),
    )?;
    dev.matmul_forward(
        a.res2.view_mut(),
        a.atty.view(),
        D::share(&p.proj_w),
        Some(D::share(&p.proj_b)),
        Layout::KN,
        (n, c, c),
        mm.view_mut(),
    )?;
    dev.residual_accumulate(a.res2.view_mut(), D::share(&input))?;
    dev.layernorm_forward(
        a.ln2.view_mut(),
        a.ln2_mean.view_mut(),
        a.ln2_rstd.view_mut(),
        a.res2.view(),
        D::share(&p.ln2_w),
        D::share(&p.ln2_b),
    )?;
    dev.matmul_forward(
        a.fch.view_mut(),
        a.ln2.view(),
        D::share(&p.fc_w),
        Some(D::share(&p.fc_b)),
        Layout::KN,
        (n, c, 4 * c),
        mm.view_mut(),
    )?;
    dev.gelu_forward(a.fch_gelu.view_mut(), a.fch.view())?;
    dev.matmul_forward(
        out.view_mut(),
        a.fch_gelu.view(),
        D::share(&p.fcproj_w),
        Some(D::share(&p.fcproj_b)),
        Layout::KN,
        (n, 4 * c, c),
        mm.view_mut(),
    )?;
    dev.residual_accumulate(out.view_mut(), a.res2.view())
}

/// Backward of block `l`: `dres` holds ∂loss/∂res3[l] on entry and ∂loss/∂(block input) on
/// exit; the block's parameter gradients are added into `g`.
pub fn block_backward<D: Device, X: Num>(
    dev: &D,
    p: &Block<D::View<'_, X>>,
    g: Block<D::ViewMut<'_, X>>,
    acts: &mut Acts<X, D>,
    l: usize,
    slot: usize,
    d: &BatchDims,
) -> Result<(), Error> {
    let (n, c) = (d.tokens(), d.c);
    let input = if l == 0 {
        acts.encoded.view()
    } else {
        acts.res3[l - 1].view()
    };
    let a: &BlockActs<X, D> = &acts.blocks[slot];
    let (dres, dchan, dwide) = (&mut acts.dres, &mut acts.dchan, &mut acts.dwide);
    let mm = &mut acts.matmul_scratch;
    // MLP.
    dev.matmul_backward(
        dwide.view_mut(),
        g.fcproj_w,
        Some(g.fcproj_b),
        dres.view(),
        a.fch_gelu.view(),
        D::share(&p.fcproj_w),
        Layout::KN,
        (n, 4 * c, c),
        DinpMode::Overwrite,
        mm.view_mut(),
    )?;
    dev.gelu_backward(dwide.view_mut(), a.fch.view())?;
    dev.matmul_backward(
        dchan.view_mut(),
        g.fc_w,
        Some(g.fc_b),
        dwide.view(),
        a.ln2.view(),
        D::share(&p.fc_w),
        Layout::KN,
        (n, c, 4 * c),
        DinpMode::Overwrite,
        mm.view_mut(),
    )?;
    dev.layernorm_backward(
        dres.view_mut(),
        g.ln2_w,
        g.ln2_b,
        dchan.view(),
        a.res2.view(),
        D::share(&p.ln2_w),
        a.ln2_mean.view(),
        a.ln2_rstd.view(),
    )?;
    // Attention; dres now holds ∂loss/∂res2.
    dev.matmul_backward(
        dchan.view_mut(),
        g.proj_w,
        Some(g.proj_b),
        dres.view(),
        a.atty.view(),
        D::share(&p.proj_w),
        Layout::KN,
        (n, c, c),
        DinpMode::Overwrite,
        mm.view_mut(),
    )?;
    let dqkv = 0..n * 3 * c;
    dev.attention_backward(
        dwide.at_mut(dqkv.clone()),
        acts.datt.view_mut(),
        dchan.view(),
        a.qkv.view(),
        a.att.view(),
        d.attention(),
    )?;
    dev.matmul_backward(
        dchan.view_mut(),
        g.attn_w,
        Some(g.attn_b),
        dwide.at(dqkv),
        a.ln1.view(),
        D::share(&p.attn_w),
        Layout::KN,
        (n, c, 3 * c),
        DinpMode::Overwrite,
        mm.view_mut(),
    )?;
    dev.layernorm_backward(
        dres.view_mut(),
        g.ln1_w,
        g.ln1_b,
        dchan.view(),
        input,
        D::share(&p.ln1_w),
        a.ln1_mean.view(),
        a.ln1_rstd.view(),
    )
}

/// The final LayerNorm, the tied LM head and the cross-entropy, forward and backward at once:
/// returns the micro-batch's mean loss, leaves ∂loss/∂(last block output) in `dres`, and adds
/// into the final norm's gradient `dnorm` and wte's part of `demb`. `dloss` is the gradient of
/// the loss each token contributes (the loss scale over the tokens averaged).
#[allow(clippy::too_many_arguments)]
pub fn head<D: Device, X: Num>(
    dev: &D,
    norm: D::View<'_, X>,
    emb: D::View<'_, X>,
    dnorm: D::ViewMut<'_, X>,
    demb: D::ViewMut<'_, X>,
    acts: &mut Acts<X, D>,
    shape: &GptShape,
    d: &BatchDims,
    dloss: f32,
) -> Result<f64, Error> {
    let (n, c, v) = (d.tokens(), d.c, d.v);
    let input = acts.res3[d.l - 1].view();
    let [w, b] = final_norm::<D, X>(norm, shape);
    let [wte, _] = embeddings::<D, X>(emb, shape);
    let mm = &mut acts.matmul_scratch;
    dev.layernorm_forward(
        acts.lnf.view_mut(),
        acts.lnf_mean.view_mut(),
        acts.lnf_rstd.view_mut(),
        D::share(&input),
        D::share(&w),
        b,
    )?;
    dev.matmul_forward(
        acts.logits.view_mut(),
        acts.lnf.view(),
        D::share(&wte),
        None,
        Layout::NK,
        (n, c, v),
        mm.view_mut(),
    )?;
    dev.crossentropy_forward(
        acts.losses.view_mut(),
        acts.logits.view_mut(),
        acts.targets.view(),
        v,
        Some(dloss),
    )?;
    let [dwte, _] = embeddings_mut::<D, X>(demb, shape);
    let dlnf = &mut acts.dchan;
    dev.matmul_backward(
        dlnf.view_mut(),
        dwte,
        None,
        acts.logits.view(),
        acts.lnf.view(),
        wte,
        Layout::NK,
        (n, c, v),
        DinpMode::Overwrite,
        mm.view_mut(),
    )?;
    dev.fill_zero(acts.dres.view_mut())?;
    let [dw, db] = final_norm_mut::<D, X>(dnorm, shape);
    dev.layernorm_backward(
        acts.dres.view_mut(),
        dw,
        db,
        dlnf.view(),
        input,
        w,
        acts.lnf_mean.view(),
        acts.lnf_rstd.view(),
    )?;
    let losses = dev.to_host(acts.losses.view())?;
    Ok(losses.iter().map(|&l| f64::from(l)).sum::<f64>() / n as f64)
}
