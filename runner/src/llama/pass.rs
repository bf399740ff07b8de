//! Forward and backward of each unit for one micro-batch, on any device, in Hugging Face's
//! `LlamaDecoderLayer` order. Backward kernels add into gradient buffers (`+=`), so gradients
//! of successive micro-batches add up; `dres` carries ∂loss/∂(residual stream) down the blocks.

use kernels::matmul::{DinpMode, Layout};

use scheduler::model::{LlamaTensor as T, ModelTensor};

use super::{Model, block, block_mut};
use crate::device::{Device, Num};
use crate::lora::Adapted;
use crate::model::{Linear, Stored, projection, projection_backward};
use crate::{Error, model};

/// An `nn.Linear` projection `t`, weight W (N, K) used as x·Wᵀ + b.
fn linear<'p, 'v, X, D: Device>(
    t: T,
    (w, b): (Stored<'p, 'v, X, D>, Stored<'p, 'v, X, D>),
) -> Linear<'p, 'v, X, D> {
    Linear {
        kind: ModelTensor::Llama(t),
        w,
        b: b.as_ref().map(D::reborrow_ref),
        layout: Layout::NK,
    }
}

/// A projection's weight and bias gradients, as [`block_mut`] cuts them, for
/// [`projection_backward`]: none where the weight is frozen.
fn grads<S>(weight: Option<Option<S>>, bias: Option<Option<S>>) -> Option<(S, Option<S>)> {
    weight.flatten().map(|w| (w, bias.flatten()))
}

impl<X: Num, D: Device> Model<X, D> {
    /// `encoded = embed_tokens[inputs]` (no learned positions: RoPE rotates q and k).
    pub fn embed_forward(&mut self, dev: &D, emb: D::View<'_, X>) -> Result<(), Error> {
        let (d, acts) = (self.dims, &mut self.acts);
        let wte = D::slice(emb, 0..d.v * d.c);
        let out = acts.encoded.view_mut();
        dev.encoder_forward(out, acts.batch.inputs.view(), wte, None, d.t, d.c)
    }

    /// Adds ∂loss/∂embed_tokens from `dres` (∂loss/∂encoded) into the embeddings' gradient.
    pub fn embed_backward(&self, dev: &D, demb: D::ViewMut<'_, X>) -> Result<(), Error> {
        let (d, acts) = (self.dims, &self.acts);
        let dwte = D::slice_mut(demb, 0..d.v * d.c);
        dev.encoder_backward(
            dwte,
            None,
            acts.dres.view(),
            acts.batch.inputs.view(),
            d.t,
            d.c,
        )
    }

    /// Block `l`: from its input (`encoded` or the previous block's output) to `res3[l]`,
    /// saving what backward needs in `acts.blocks[slot]` (and the adapters' in theirs).
    pub fn block_forward(
        &mut self,
        dev: &D,
        unit: D::View<'_, X>,
        mut ad: Adapted<'_, X, D>,
        l: usize,
        slot: usize,
    ) -> Result<(), Error> {
        let p = block::<D, X>(unit, &self.shape, |w| ad.in_base(w));
        let (d, acts) = (self.dims, &mut self.acts);
        let (n, c, q, kv, i) = (d.tokens(), d.c, d.q(), d.kv_width(), d.i);
        let (before, from_l) = acts.res3.split_at_mut(l);
        let input = if l == 0 {
            acts.encoded.view()
        } else {
            before[l - 1].view()
        };
        let out = &mut from_l[0];
        let a = &mut acts.blocks[slot];
        let mm = &mut acts.matmul_scratch;
        let (cos, sin) = (&acts.rope_cos, &acts.rope_sin);
        dev.rmsnorm_forward(
            a.norm1.view_mut(),
            a.norm1_rstd.view_mut(),
            D::share(&input),
            D::share(&p.norm1),
            d.eps,
        )?;
        // With q/k norms (Qwen3) the projections land before their norms, which write q and k.
        let qk_norms = p.q_norm.as_ref().zip(p.k_norm.as_ref());
        let (q_out, k_out) = match qk_norms {
            Some(_) => (&mut a.q_pre_norm, &mut a.k_pre_norm),
            None => (&mut a.q, &mut a.k),
        };
        let x = a.norm1.view();
        let qw = (&p.q, &p.q_bias);
        projection(
            dev,
            &mut ad,
            linear(T::QProj, qw),
            q_out,
            D::share(&x),
            (n, c, q),
            mm,
        )?;
        let kw = (&p.k, &p.k_bias);
        projection(
            dev,
            &mut ad,
            linear(T::KProj, kw),
            k_out,
            D::share(&x),
            (n, c, kv),
            mm,
        )?;
        let vw = (&p.v, &p.v_bias);
        projection(
            dev,
            &mut ad,
            linear(T::VProj, vw),
            &mut a.v,
            x,
            (n, c, kv),
            mm,
        )?;
        if let Some((qn, kn)) = qk_norms {
            let (qp, kp) = (a.q_pre_norm.view(), a.k_pre_norm.view());
            let (qr, kr) = (a.q_norm_rstd.view_mut(), a.k_norm_rstd.view_mut());
            dev.rmsnorm_forward(a.q.view_mut(), qr, qp, D::share(qn), d.eps)?;
            dev.rmsnorm_forward(a.k.view_mut(), kr, kp, D::share(kn), d.eps)?;
        }
        dev.rope_forward(a.q.view_mut(), cos.view(), sin.view(), d.rope(d.h))?;
        dev.rope_forward(a.k.view_mut(), cos.view(), sin.view(), d.rope(d.kv))?;
        dev.gqa_attention_forward(
            a.atty.view_mut(),
            a.lse.view_mut(),
            a.q.view(),
            a.k.view(),
            a.v.view(),
            d.attention(),
        )?;
        let ow = (&p.o, &p.o_bias);
        let atty = a.atty.view();
        projection(
            dev,
            &mut ad,
            linear(T::OProj, ow),
            &mut a.res2,
            atty,
            (n, q, c),
            mm,
        )?;
        dev.residual_accumulate(a.res2.view_mut(), input)?;
        dev.rmsnorm_forward(
            a.norm2.view_mut(),
            a.norm2_rstd.view_mut(),
            a.res2.view(),
            D::share(&p.norm2),
            d.eps,
        )?;
        let x = a.norm2.view();
        let (gw, uw) = ((&p.gate, &p.gate_bias), (&p.up, &p.up_bias));
        projection(
            dev,
            &mut ad,
            linear(T::GateProj, gw),
            &mut a.gate,
            D::share(&x),
            (n, c, i),
            mm,
        )?;
        projection(
            dev,
            &mut ad,
            linear(T::UpProj, uw),
            &mut a.up,
            x,
            (n, c, i),
            mm,
        )?;
        dev.swiglu_forward(a.product.view_mut(), a.gate.view(), a.up.view())?;
        let (dw, product) = ((&p.down, &p.down_bias), a.product.view());
        projection(
            dev,
            &mut ad,
            linear(T::DownProj, dw),
            out,
            product,
            (n, i, c),
            mm,
        )?;
        dev.residual_accumulate(out.view_mut(), a.res2.view())
    }

    /// Backward of block `l`: `dres` holds ∂loss/∂res3[l] on entry and ∂loss/∂(block input)
    /// on exit; the block's parameter gradients are added into `grad` (none: frozen) and its
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
        use DinpMode::{Accumulate, Overwrite};
        let (p, g) = (
            block::<D, X>(unit, &self.shape, |w| ad.in_base(w)),
            block_mut::<D, X>(grad, &self.shape),
        );
        let (d, acts) = (self.dims, &mut self.acts);
        let (n, c, q, kv, i) = (d.tokens(), d.c, d.q(), d.kv_width(), d.i);
        let input = if l == 0 {
            acts.encoded.view()
        } else {
            acts.res3[l - 1].view()
        };
        let a = &acts.blocks[slot];
        let (dres, dchan, dwide) = (&mut acts.dres, &mut acts.dchan, &mut acts.dwide);
        let mm = &mut acts.matmul_scratch;
        let (cos, sin) = (&acts.rope_cos, &acts.rope_sin);
        let dx = 0..n * c;
        // MLP: ∂loss/∂product into the up projection's half of dwide, which SwiGLU's backward
        // turns, in place, into ∂loss/∂up beside ∂loss/∂gate.
        let (gate_at, up_at) = (0..n * i, n * i..2 * n * i);
        let down = grads(g.down, g.down_bias);
        let (w, mkn) = (&p.down, ((n, i, c), Overwrite));
        let (dinp, dout, x) = ((&mut *dwide, up_at.clone()), dres.view(), a.product.view());
        projection_backward(
            dev,
            &mut ad,
            linear(T::DownProj, (w, &None)),
            dinp,
            down,
            dout,
            x,
            mkn,
            mm,
        )?;
        let (dgate, dup) = D::split_at_mut(dwide.at_mut(0..2 * n * i), n * i);
        dev.swiglu_backward(dgate, dup, a.gate.view(), a.up.view())?;
        let (x, gate, up) = (
            a.norm2.view(),
            grads(g.gate, g.gate_bias),
            grads(g.up, g.up_bias),
        );
        let (dinp, dout, w) = ((&mut *dchan, dx.clone()), dwide.at(gate_at), &p.gate);
        let (xg, mkn) = (D::share(&x), ((n, c, i), Overwrite));
        projection_backward(
            dev,
            &mut ad,
            linear(T::GateProj, (w, &None)),
            dinp,
            gate,
            dout,
            xg,
            mkn,
            mm,
        )?;
        let (dinp, dout, w) = ((&mut *dchan, dx.clone()), dwide.at(up_at), &p.up);
        let mkn = ((n, c, i), Accumulate);
        projection_backward(
            dev,
            &mut ad,
            linear(T::UpProj, (w, &None)),
            dinp,
            up,
            dout,
            x,
            mkn,
            mm,
        )?;
        model::rmsnorm_backward(
            dev,
            dres.view_mut(),
            g.norm2,
            dchan.at(dx.clone()),
            (a.res2.view(), D::share(&p.norm2), a.norm2_rstd.view()),
        )?;
        // Attention; dres now holds ∂loss/∂res2.
        let o = grads(g.o, g.o_bias);
        let (dinp, dout, x) = ((&mut *dchan, 0..n * q), dres.view(), a.atty.view());
        let mkn = ((n, q, c), Overwrite);
        projection_backward(
            dev,
            &mut ad,
            linear(T::OProj, (&p.o, &None)),
            dinp,
            o,
            dout,
            x,
            mkn,
            mm,
        )?;
        let (dq_at, dk_at, dv_at) = (
            0..n * q,
            n * q..n * (q + kv),
            n * (q + kv)..n * (q + 2 * kv),
        );
        let (dq, dkv) = D::split_at_mut(dwide.at_mut(0..n * (q + 2 * kv)), n * q);
        let (dk, dv) = D::split_at_mut(dkv, n * kv);
        dev.gqa_attention_backward(
            dq,
            dk,
            dv,
            acts.delta.view_mut(),
            dchan.at(0..n * q),
            a.q.view(),
            a.k.view(),
            a.v.view(),
            a.atty.view(),
            a.lse.view(),
            d.attention(),
        )?;
        dev.rope_backward(
            dwide.at_mut(dq_at.clone()),
            cos.view(),
            sin.view(),
            d.rope(d.h),
        )?;
        dev.rope_backward(
            dwide.at_mut(dk_at.clone()),
            cos.view(),
            sin.view(),
            d.rope(d.kv),
        )?;
        let (dq_at, dk_at) = match (&p.q_norm, &p.k_norm) {
            (Some(qn), Some(kn)) => {
                let (dqn, dkn) = (g.q_norm.flatten(), g.k_norm.flatten());
                let dqkv = n * (q + 2 * kv);
                let q_pre = dqkv..dqkv + n * q;
                dev.fill_zero(dwide.at_mut(q_pre.clone()))?;
                // Queries: from dwide's q part into the part after v.
                let (lo, hi) = D::split_at_mut(dwide.at_mut(0..q_pre.end), dqkv);
                let dq = D::freeze(D::slice_mut(lo, 0..n * q));
                let dq_pre = D::slice_mut(hi, 0..n * q);
                let (qp, qr) = (a.q_pre_norm.view(), a.q_norm_rstd.view());
                model::rmsnorm_backward(dev, dq_pre, dqn, dq, (qp, D::share(qn), qr))?;
                // Keys: from dwide's k part into the q part, now free.
                dev.fill_zero(dwide.at_mut(0..n * kv))?;
                let (lo, hi) = D::split_at_mut(dwide.at_mut(0..n * (q + kv)), n * q);
                let (dk_pre, dk) = (D::slice_mut(lo, 0..n * kv), D::freeze(hi));
                let (kp, kr) = (a.k_pre_norm.view(), a.k_norm_rstd.view());
                model::rmsnorm_backward(dev, dk_pre, dkn, dk, (kp, D::share(kn), kr))?;
                (q_pre, 0..n * kv)
            }
            _ => (dq_at, dk_at),
        };
        let x = a.norm1.view();
        let (wq, wk, wv) = (
            grads(g.q, g.q_bias),
            grads(g.k, g.k_bias),
            grads(g.v, g.v_bias),
        );
        let qkv = [
            (T::QProj, wq, dq_at, &p.q, q, Overwrite),
            (T::KProj, wk, dk_at, &p.k, kv, Accumulate),
            (T::VProj, wv, dv_at, &p.v, kv, Accumulate),
        ];
        for (kind, grads, dout_at, w, width, mode) in qkv {
            let (dinp, dout) = ((&mut *dchan, dx.clone()), dwide.at(dout_at));
            let mkn = ((n, c, width), mode);
            projection_backward(
                dev,
                &mut ad,
                linear(kind, (w, &None)),
                dinp,
                grads,
                dout,
                D::share(&x),
                mkn,
                mm,
            )?;
        }
        model::rmsnorm_backward(
            dev,
            dres.view_mut(),
            g.norm1,
            dchan.at(dx),
            (input, D::share(&p.norm1), a.norm1_rstd.view()),
        )
    }

    /// The final RMSNorm, the LM head and the cross-entropy, forward and backward through the
    /// head: returns the micro-batch's mean loss, leaves ∂loss/∂normf in `dchan` and adds the
    /// head weight's gradient into `dhead`. `head` is the unit holding the (V, C) weight first
    /// (`embed_tokens` when tied, `lm_head` otherwise).
    pub fn loss(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        head: D::View<'_, X>,
        dhead: Option<D::ViewMut<'_, X>>,
        dloss: Option<f32>,
    ) -> Result<f64, Error> {
        let (d, acts) = (self.dims, &mut self.acts);
        let (n, c, v) = (d.tokens(), d.c, d.v);
        let mm = &mut acts.matmul_scratch;
        dev.rmsnorm_forward(
            acts.normf.view_mut(),
            acts.normf_rstd.view_mut(),
            acts.res3[d.l - 1].view(),
            D::slice(norm, 0..c),
            d.eps,
        )?;
        let dhead = dhead.map(|dh| D::slice_mut(dh, 0..v * c));
        let head = (D::slice(head, 0..v * c), dhead);
        let (x, dx) = (acts.normf.view(), acts.dchan.at_mut(0..n * c));
        acts.batch.lm_head(dev, x, head, dx, (n, c, v), dloss, mm)
    }

    /// Back through the final RMSNorm: `dres` becomes ∂loss/∂(last block output) and the
    /// norm's gradient is added into `dnorm` (none: frozen).
    pub fn norm_backward(
        &mut self,
        dev: &D,
        norm: D::View<'_, X>,
        dnorm: Option<D::ViewMut<'_, X>>,
    ) -> Result<(), Error> {
        let (d, acts) = (self.dims, &mut self.acts);
        let (n, c) = (d.tokens(), d.c);
        dev.fill_zero(acts.dres.view_mut())?;
        model::rmsnorm_backward(
            dev,
            acts.dres.view_mut(),
            dnorm.map(|dn| D::slice_mut(dn, 0..c)),
            acts.dchan.at(0..n * c),
            (
                acts.res3[d.l - 1].view(),
                D::slice(norm, 0..c),
                acts.normf_rstd.view(),
            ),
        )
    }
}
