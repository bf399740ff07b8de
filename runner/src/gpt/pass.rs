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
use crate::{Error, model};

/// The model tensor of a GPT-2 projection weight, as adapters are keyed.
fn proj(t: T) -> ModelTensor {
    ModelTensor::Gpt2(t)
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
        let (p, d, acts) = (block::<D, X>(unit, &self.shape), &self.dims, &mut self.acts);
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
        ad.forward(
            dev,
            proj(T::AttnWeight),
            a.qkv.view_mut(),
            a.ln1.view(),
            n,
            mm,
        )?;
        dev.attention_forward(
            a.atty.view_mut(),
            a.lse.view_mut(),
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
        ad.forward(
            dev,
            proj(T::AttnProjWeight),
            a.res2.view_mut(),
            a.atty.view(),
            n,
            mm,
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
        ad.forward(
            dev,
            proj(T::FcWeight),
            a.fch.view_mut(),
            a.ln2.view(),
            n,
            mm,
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
        let fc_out = a.fch_gelu.view();
        ad.forward(dev, proj(T::FcProjWeight), out.view_mut(), fc_out, n, mm)?;
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
        let (p, g) = (
            block::<D, X>(unit, &self.shape),
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
        let grads = |w: Option<_>, b: Option<_>| w.zip(b).map(|(w, b)| (w, Some(b)));
        let kn = |inp, w| (inp, D::share(w));
        // MLP.
        model::linear_backward(
            dev,
            dwide.view_mut(),
            grads(g.fcproj_w, g.fcproj_b),
            dres.view(),
            kn(a.fch_gelu.view(), &p.fcproj_w),
            Layout::KN,
            (n, 4 * c, c),
            Overwrite,
            mm,
        )?;
        let fc_out = a.fch_gelu.view();
        ad.backward(
            dev,
            proj(T::FcProjWeight),
            dwide.view_mut(),
            dres.view(),
            fc_out,
            n,
            mm,
        )?;
        dev.gelu_backward(dwide.view_mut(), a.fch.view())?;
        model::linear_backward(
            dev,
            dchan.view_mut(),
            grads(g.fc_w, g.fc_b),
            dwide.view(),
            kn(a.ln2.view(), &p.fc_w),
            Layout::KN,
            (n, c, 4 * c),
            Overwrite,
            mm,
        )?;
        ad.backward(
            dev,
            proj(T::FcWeight),
            dchan.view_mut(),
            dwide.view(),
            a.ln2.view(),
            n,
            mm,
        )?;
        model::layernorm_backward(
            dev,
            dres.view_mut(),
            g.ln2_w.zip(g.ln2_b).map(<[_; 2]>::from),
            dchan.view(),
            (a.res2.view(), D::share(&p.ln2_w)),
            (a.ln2_mean.view(), a.ln2_rstd.view()),
        )?;
        // Attention; dres now holds ∂loss/∂res2.
        model::linear_backward(
            dev,
            dchan.view_mut(),
            grads(g.proj_w, g.proj_b),
            dres.view(),
            kn(a.atty.view(), &p.proj_w),
            Layout::KN,
            (n, c, c),
            Overwrite,
            mm,
        )?;
        let atty = a.atty.view();
        ad.backward(
            dev,
            proj(T::AttnProjWeight),
            dchan.view_mut(),
            dres.view(),
            atty,
            n,
            mm,
        )?;
        let dqkv = 0..n * 3 * c;
        dev.attention_backward(
            dwide.at_mut(dqkv.clone()),
            acts.delta.view_mut(),
            dchan.view(),
            a.qkv.view(),
            a.atty.view(),
            a.lse.view(),
            d.attention(),
        )?;
        model::linear_backward(
            dev,
            dchan.view_mut(),
            grads(g.attn_w, g.attn_b),
            dwide.at(dqkv.clone()),
            kn(a.ln1.view(), &p.attn_w),
            Layout::KN,
            (n, c, 3 * c),
            Overwrite,
            mm,
        )?;
        let (dchan_in, dqkv) = (dchan.view_mut(), dwide.at(dqkv));
        ad.backward(
            dev,
            proj(T::AttnWeight),
            dchan_in,
            dqkv,
            a.ln1.view(),
            n,
            mm,
        )?;
        model::layernorm_backward(
            dev,
            dres.view_mut(),
            g.ln1_w.zip(g.ln1_b).map(<[_; 2]>::from),
            dchan.view(),
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
