//! Forward and backward of each unit for one micro-batch (llm.c's structure, Hugging Face's
//! layout), on any device. Backward kernels accumulate into gradient buffers (`+=`), so
//! gradients of successive micro-batches add up; `dres` carries ∂loss/∂(residual stream) down
//! the blocks.

use kernels::matmul::{DinpMode, Layout};
use scheduler::model::{ModelTensor, TensorKind as T};

use super::{
    BlockActs, Model, block, block_mut, embeddings, embeddings_mut, final_norm, final_norm_mut,
};
use crate::device::{Device, Num};
use crate::lora::Adapted;
use crate::model::{Linear, Stored, projection, projection_backward};
use crate::{Error, model};

/// A Conv1D projection `t`, weight W (K, N) used as x·W + b.
fn conv1d<'p, 'v, X, D: Device>(
    t: T,
    w: Stored<'p, 'v, X, D>,
    b: &'p D::View<'v, X>,
) -> Linear<'p, 'v, X, D> {
    Linear {
        kind: ModelTensor::Gpt2(t),
        w,
        b: Some(D::reborrow_ref(b)),
        layout: Layout::KN,
    }
}

impl<X: Num, D: Device> Model<X, D> {
    /// `encoded = wte[inputs] + wpe[0..T]`.
    pub fn embed_forward(&mut self, dev: &D, emb: D::View<'_, X>) -> Result<(), Error> {
        let (d, acts) = (&self.dims, &mut self.acts);
        let [wte, wpe] = embeddings::<D, X>(emb, &self.shape);
        let out = acts.encoded.view_mut();
        dev.encoder_forward(out, acts.batch.inputs.view(), wte, Some(wpe), d.t, d.c)
    }

    /// Adds ∂loss/∂wte and ∂loss/∂wpe from `dres` (∂loss/∂encoded) into the embeddings' gradient.
    pub fn embed_backward(&self, dev: &D, demb: D::ViewMut<'_, X>) -> Result<(), Error> {
        let (d, acts) = (&self.dims, &self.acts);
        let [dwte, dwpe] = embeddings_mut::<D, X>(demb, &self.shape);
        let (dres, inputs) = (acts.dres.view(), acts.batch.inputs.view());
        dev.encoder_backward(dwte, Some(dwpe), dres, inputs, d.t, d.c)
    }

    /// Block `l`: from its input (`encoded` or the previous block's output) to `res3[l]`, saving
    /// what backward needs in `acts.blocks[slot]` (and the adapters' in theirs).
    pub fn block_forward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        mut ad: Adapted<'_, X, D>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        let held = |w| ad.in_base(w);
        let (p, d, acts) = (
            block::<D, X>(unit, &self.shape, held),
            &self.dims,
            &mut self.acts,
        );
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
        let (attn, x) = (conv1d(T::AttnWeight, &p.attn_w, &p.attn_b), a.ln1.view());
        projection(dev, &mut ad, attn, &mut a.qkv, x, (n, c, 3 * c), mm)?;
        dev.attention_forward(
            a.atty.view_mut(),
            a.lse.view_mut(),
            a.qkv.view(),
            d.attention(),
        )?;
        let (attn_proj, x) = (
            conv1d(T::AttnProjWeight, &p.proj_w, &p.proj_b),
            a.atty.view(),
        );
        projection(dev, &mut ad, attn_proj, &mut a.res2, x, (n, c, c), mm)?;
        dev.residual_accumulate(a.res2.view_mut(), D::share(&input))?;
        dev.layernorm_forward(
            a.ln2.view_mut(),
            a.ln2_mean.view_mut(),
            a.ln2_rstd.view_mut(),
            a.res2.view(),
            D::share(&p.ln2_w),
            D::share(&p.ln2_b),
        )?;
        let (fc, x) = (conv1d(T::FcWeight, &p.fc_w, &p.fc_b), a.ln2.view());
        projection(dev, &mut ad, fc, &mut a.fch, x, (n, c, 4 * c), mm)?;
        dev.gelu_forward(a.fch_gelu.view_mut(), a.fch.view())?;
        let fc_proj = conv1d(T::FcProjWeight, &p.fcproj_w, &p.fcproj_b);
        projection(
            dev,
            &mut ad,
            fc_proj,
            out,
            a.fch_gelu.view(),
            (n, 4 * c, c),
            mm,
        )?;
        dev.residual_accumulate(out.view_mut(), a.res2.view())
    }

    /// Backward of block `l`: `dres` holds ∂loss/∂res3[l] on entry and ∂loss/∂(block input) on
    /// exit; the block's parameter gradients are added into `grad` (none: frozen) and its
    /// adapters' into theirs.
    pub fn block_backward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        grad: Option<D::ViewMut<'_, X>>,
        mut ad: Adapted<'_, X, D>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        use DinpMode::Overwrite;
        let held = |w| ad.in_base(w);
        let (p, g) = (
            block::<D, X>(unit, &self.shape, held),
            block_mut::<D, X>(grad, &self.shape),
        );
        let (d, acts) = (&self.dims, &mut self.acts);
        let (n, c) = (d.tokens(), d.c);
        let input = if l == 0 {
            acts.encoded.view()
        } else {
            acts.res3[l - 1].view()
        };
        let a: &BlockActs<X, D> = &acts.blocks[slot];
        let (dres, dchan, dwide) = (&mut acts.dres, &mut acts.dchan, &mut acts.dwide);
        let mm = &mut acts.matmul_scratch;
        let grads =
            |w: Option<Option<_>>, b: Option<_>| w.flatten().zip(b).map(|(w, b)| (w, Some(b)));
        let (wide, chan) = (n * 4 * c, n * c);
        // MLP.
        let fc_proj = conv1d(T::FcProjWeight, &p.fcproj_w, &p.fcproj_b);
        let (dinp, dout, x) = ((&mut *dwide, 0..wide), dres.view(), a.fch_gelu.view());
        let (dw, mkn) = (grads(g.fcproj_w, g.fcproj_b), ((n, 4 * c, c), Overwrite));
        projection_backward(dev, &mut ad, fc_proj, dinp, dw, dout, x, mkn, mm)?;
        dev.gelu_backward(dwide.at_mut(0..wide), a.fch.view())?;
        let fc = conv1d(T::FcWeight, &p.fc_w, &p.fc_b);
        let (dinp, dout, x) = ((&mut *dchan, 0..chan), dwide.at(0..wide), a.ln2.view());
        let (dw, mkn) = (grads(g.fc_w, g.fc_b), ((n, c, 4 * c), Overwrite));
        projection_backward(dev, &mut ad, fc, dinp, dw, dout, x, mkn, mm)?;
        model::layernorm_backward(
            dev,
            dres.view_mut(),
            g.ln2_w.zip(g.ln2_b).map(<[_; 2]>::from),
            dchan.at(0..chan),
            (a.res2.view(), D::share(&p.ln2_w)),
            (a.ln2_mean.view(), a.ln2_rstd.view()),
        )?;
        // Attention; dres now holds ∂loss/∂res2.
        let attn_proj = conv1d(T::AttnProjWeight, &p.proj_w, &p.proj_b);
        let (dinp, dout, x) = ((&mut *dchan, 0..chan), dres.view(), a.atty.view());
        let (dw, mkn) = (grads(g.proj_w, g.proj_b), ((n, c, c), Overwrite));
        projection_backward(dev, &mut ad, attn_proj, dinp, dw, dout, x, mkn, mm)?;
        let dqkv = 0..n * 3 * c;
        dev.attention_backward(
            dwide.at_mut(dqkv.clone()),
            acts.delta.view_mut(),
            dchan.at(0..chan),
            a.qkv.view(),
            a.atty.view(),
            a.lse.view(),
            d.attention(),
        )?;
        let attn = conv1d(T::AttnWeight, &p.attn_w, &p.attn_b);
        let (dinp, dout, x) = ((&mut *dchan, 0..chan), dwide.at(dqkv), a.ln1.view());
        let (dw, mkn) = (grads(g.attn_w, g.attn_b), ((n, c, 3 * c), Overwrite));
        projection_backward(dev, &mut ad, attn, dinp, dw, dout, x, mkn, mm)?;
        model::layernorm_backward(
            dev,
            dres.view_mut(),
            g.ln1_w.zip(g.ln1_b).map(<[_; 2]>::from),
            dchan.at(0..chan),
            (input, D::share(&p.ln1_w)),
            (a.ln1_mean.view(), a.ln1_rstd.view()),
        )
    }

    /// The final LayerNorm, the tied LM head and the cross-entropy, forward and backward through
    /// the head: returns the micro-batch's mean loss, leaves ∂loss/∂lnf in `dchan` and adds wte's
    /// gradient into `dhead` (the embeddings unit's). `dloss` is the gradient of the loss each
    /// token contributes (the loss scale over the tokens averaged).
    pub fn loss(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        head: D::View<'_, X>,
        dhead: Option<D::ViewMut<'_, X>>,
        dloss: Option<f32>,
    ) -> Result<f64, Error> {
        let (d, acts) = (&self.dims, &mut self.acts);
        let (n, c, v) = (d.tokens(), d.c, d.v);
        let input = acts.res3[d.l - 1].view();
        let [w, b] = final_norm::<D, X>(norm, &self.shape);
        let [wte, _] = embeddings::<D, X>(head, &self.shape);
        dev.layernorm_forward(
            acts.lnf.view_mut(),
            acts.lnf_mean.view_mut(),
            acts.lnf_rstd.view_mut(),
            input,
            w,
            b,
        )?;
        let dwte = dhead.map(|dh| {
            let [dwte, _] = embeddings_mut::<D, X>(dh, &self.shape);
            dwte
        });
        let mm = &mut acts.matmul_scratch;
        let (x, dx) = (acts.lnf.view(), acts.dchan.view_mut());
        acts.batch
            .lm_head(dev, x, (wte, dwte), dx, (n, c, v), dloss, mm)
    }

    /// Back through the final LayerNorm: `dres` becomes ∂loss/∂(last block output) and the norm's
    /// gradient is added into `dnorm` (none: frozen).
    pub fn norm_backward(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        dnorm: Option<D::ViewMut<'_, X>>,
    ) -> Result<(), Error> {
        let (d, acts) = (&self.dims, &mut self.acts);
        let [w, _] = final_norm::<D, X>(norm, &self.shape);
        let grads = dnorm.map(|dn| final_norm_mut::<D, X>(dn, &self.shape));
        dev.fill_zero(acts.dres.view_mut())?;
        model::layernorm_backward(
            dev,
            acts.dres.view_mut(),
            grads,
            acts.dchan.view(),
            (acts.res3[d.l - 1].view(), w),
            (acts.lnf_mean.view(), acts.lnf_rstd.view()),
        )
    }
}
