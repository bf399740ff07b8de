//! Forward and backward of each unit for one micro-batch (llm.c's structure, Hugging Face's
//! layout). Backward kernels accumulate into gradient buffers (`+=`), so gradients of
//! successive micro-batches add up; `dres` carries ∂loss/∂(residual stream) down the blocks.

use kernels::Float;
use kernels::attention::{attention_backward, attention_forward};
use kernels::crossentropy::crossentropy_forward;
use kernels::encoder::{encoder_backward, encoder_forward};
use kernels::gelu::{gelu_backward, gelu_forward};
use kernels::layernorm::{layernorm_backward, layernorm_forward};
use kernels::matmul::{Layout, matmul_backward, matmul_forward};
use kernels::residual::residual_accumulate;
use scheduler::model::GptShape;

use super::{
    Acts, BatchDims, Block, BlockActs, embeddings, embeddings_mut, final_norm, final_norm_mut,
};

/// `encoded = wte[inputs] + wpe[0..T]`.
pub fn embed_forward<X: Float>(emb: &[X], shape: &GptShape, d: &BatchDims, acts: &mut Acts<X>) {
    let [wte, wpe] = embeddings(emb, shape);
    encoder_forward(&mut acts.encoded, &acts.inputs, wte, wpe, d.t, d.c);
}

/// Adds ∂loss/∂wte and ∂loss/∂wpe from `dres` (∂loss/∂encoded) into the embeddings' gradient.
pub fn embed_backward<X: Float>(demb: &mut [X], shape: &GptShape, d: &BatchDims, acts: &Acts<X>) {
    let [dwte, dwpe] = embeddings_mut(demb, shape);
    encoder_backward(dwte, dwpe, &acts.dres, &acts.inputs, d.t, d.c);
}

/// Block `l`: from its input (`encoded` or the previous block's output) to `res3[l]`, saving
/// what backward needs in `acts.blocks[slot]`.
pub fn block_forward<X: Float>(
    p: &Block<&[X]>,
    acts: &mut Acts<X>,
    l: usize,
    slot: usize,
    d: &BatchDims,
) {
    let (n, c) = (d.tokens(), d.c);
    let (before, from_l) = acts.res3.split_at_mut(l);
    let input: &[X] = if l == 0 {
        &acts.encoded
    } else {
        &before[l - 1]
    };
    let out = &mut from_l[0];
    let a = &mut acts.blocks[slot];
    let mm = &mut acts.matmul_scratch[..];
    layernorm_forward(
        &mut a.ln1,
        &mut a.ln1_mean,
        &mut a.ln1_rstd,
        input,
        p.ln1_w,
        p.ln1_b,
    );
    matmul_forward(
        &mut a.qkv,
        &a.ln1,
        p.attn_w,
        Some(p.attn_b),
        Layout::KN,
        (n, c, 3 * c),
        mm,
    );
    attention_forward(&mut a.atty, &mut a.att, &a.qkv, d.attention());
    matmul_forward(
        &mut a.res2,
        &a.atty,
        p.proj_w,
        Some(p.proj_b),
        Layout::KN,
        (n, c, c),
        mm,
    );
    residual_accumulate(&mut a.res2, input);
    layernorm_forward(
        &mut a.ln2,
        &mut a.ln2_mean,
        &mut a.ln2_rstd,
        &a.res2,
        p.ln2_w,
        p.ln2_b,
    );
    matmul_forward(
        &mut a.fch,
        &a.ln2,
        p.fc_w,
        Some(p.fc_b),
        Layout::KN,
        (n, c, 4 * c),
        mm,
    );
    gelu_forward(&mut a.fch_gelu, &a.fch);
    let fcproj = (n, 4 * c, c);
    matmul_forward(
        out,
        &a.fch_gelu,
        p.fcproj_w,
        Some(p.fcproj_b),
        Layout::KN,
        fcproj,
        mm,
    );
    residual_accumulate(out, &a.res2);
}

/// Backward of block `l`: `dres` holds ∂loss/∂res3[l] on entry and ∂loss/∂(block input) on
/// exit; the block's parameter gradients are added into `g`.
pub fn block_backward<X: Float>(
    p: &Block<&[X]>,
    g: Block<&mut [X]>,
    acts: &mut Acts<X>,
    l: usize,
    slot: usize,
    d: &BatchDims,
) {
    let (n, c) = (d.tokens(), d.c);
    let input: &[X] = if l == 0 {
        &acts.encoded
    } else {
        &acts.res3[l - 1]
    };
    let a: &BlockActs<X> = &acts.blocks[slot];
    let (dres, dchan, dwide) = (&mut acts.dres[..], &mut acts.dchan[..], &mut acts.dwide[..]);
    let mm = &mut acts.matmul_scratch[..];
    // MLP.
    let fcproj = (n, 4 * c, c);
    matmul_backward(
        dwide,
        g.fcproj_w,
        Some(g.fcproj_b),
        dres,
        &a.fch_gelu,
        p.fcproj_w,
        Layout::KN,
        fcproj,
        mm,
    );
    gelu_backward(dwide, &a.fch);
    matmul_backward(
        dchan,
        g.fc_w,
        Some(g.fc_b),
        dwide,
        &a.ln2,
        p.fc_w,
        Layout::KN,
        (n, c, 4 * c),
        mm,
    );
    layernorm_backward(
        dres,
        g.ln2_w,
        g.ln2_b,
        dchan,
        &a.res2,
        p.ln2_w,
        &a.ln2_mean,
        &a.ln2_rstd,
    );
    // Attention; dres now holds ∂loss/∂res2.
    matmul_backward(
        dchan,
        g.proj_w,
        Some(g.proj_b),
        dres,
        &a.atty,
        p.proj_w,
        Layout::KN,
        (n, c, c),
        mm,
    );
    let dqkv = &mut dwide[..n * 3 * c];
    attention_backward(dqkv, &mut acts.datt, dchan, &a.qkv, &a.att, d.attention());
    matmul_backward(
        dchan,
        g.attn_w,
        Some(g.attn_b),
        dqkv,
        &a.ln1,
        p.attn_w,
        Layout::KN,
        (n, c, 3 * c),
        mm,
    );
    layernorm_backward(
        dres,
        g.ln1_w,
        g.ln1_b,
        dchan,
        input,
        p.ln1_w,
        &a.ln1_mean,
        &a.ln1_rstd,
    );
}

/// The final LayerNorm, the tied LM head and the cross-entropy, forward and backward at once:
/// returns the micro-batch's mean loss, leaves ∂loss/∂(last block output) in `dres`, and adds
/// into the final norm's gradient `dnorm` and wte's part of `demb`. `dloss` is the gradient of
/// the loss each token contributes (the loss scale over the tokens averaged).
#[allow(clippy::too_many_arguments)]
pub fn head<X: Float>(
    norm: &[X],
    emb: &[X],
    dnorm: &mut [X],
    demb: &mut [X],
    acts: &mut Acts<X>,
    shape: &GptShape,
    d: &BatchDims,
    dloss: f32,
) -> f64 {
    let (n, c, v) = (d.tokens(), d.c, d.v);
    let input = &acts.res3[d.l - 1];
    let [w, b] = final_norm(norm, shape);
    let [wte, _] = embeddings(emb, shape);
    let mm = &mut acts.matmul_scratch[..];
    layernorm_forward(
        &mut acts.lnf,
        &mut acts.lnf_mean,
        &mut acts.lnf_rstd,
        input,
        w,
        b,
    );
    matmul_forward(
        &mut acts.logits,
        &acts.lnf,
        wte,
        None,
        Layout::NK,
        (n, c, v),
        mm,
    );
    crossentropy_forward(
        &mut acts.losses,
        &mut acts.logits,
        &acts.targets,
        v,
        Some(dloss),
    );
    let [dwte, _] = embeddings_mut(demb, shape);
    let dlnf = &mut acts.dchan[..];
    matmul_backward(
        dlnf,
        dwte,
        None,
        &acts.logits,
        &acts.lnf,
        wte,
        Layout::NK,
        (n, c, v),
        mm,
    );
    acts.dres.fill(X::ZERO);
    let [dw, db] = final_norm_mut(dnorm, shape);
    layernorm_backward(
        &mut acts.dres,
        dw,
        db,
        dlnf,
        input,
        w,
        &acts.lnf_mean,
        &acts.lnf_rstd,
    );
    acts.losses.iter().map(|&l| f64::from(l)).sum::<f64>() / n as f64
}
