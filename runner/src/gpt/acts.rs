//! The activations and buffers of one micro-batch, allocated exactly as
//! `scheduler::model::ActivationTensor` describes them, so the memory model counts them.

use scheduler::model::{ActivationTensor as A, GptShape};

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::device::{Device, Num};
use crate::model::{Alloc, Batch};

/// What one block's forward keeps for its backward (its output is in `Acts::res3`).
pub struct BlockActs<X, D: Device> {
    pub ln1: Buffer<X, D>,
    pub ln1_mean: Buffer<f32, D>,
    pub ln1_rstd: Buffer<f32, D>,
    pub qkv: Buffer<X, D>,
    /// fp32 log-sum-exp of each query row's attention scores.
    pub lse: Buffer<f32, D>,
    pub atty: Buffer<X, D>,
    pub res2: Buffer<X, D>,
    pub ln2: Buffer<X, D>,
    pub ln2_mean: Buffer<f32, D>,
    pub ln2_rstd: Buffer<f32, D>,
    pub fch: Buffer<X, D>,
    pub fch_gelu: Buffer<X, D>,
}

pub struct Acts<X, D: Device> {
    /// Block 0's input.
    pub encoded: Buffer<X, D>,
    /// One per layer, or under activation checkpointing one that every block recomputes into.
    pub blocks: Vec<BlockActs<X, D>>,
    /// Each block's output (always kept: checkpointing restarts from them).
    pub res3: Vec<Buffer<X, D>>,
    pub lnf: Buffer<X, D>,
    pub lnf_mean: Buffer<f32, D>,
    pub lnf_rstd: Buffer<f32, D>,
    /// Backward scratch: gradient of the residual stream, of a C-wide and a 4C-wide tensor,
    /// and the attention's row sums of dout ∘ out.
    pub dres: Buffer<X, D>,
    pub dchan: Buffer<X, D>,
    pub dwide: Buffer<X, D>,
    pub delta: Buffer<f32, D>,
    pub batch: Batch<D>,
    /// Where the matmuls widen fp16/bf16 tiles (empty for fp32).
    pub matmul_scratch: Buffer<f32, D>,
}

impl<X: Num, D: Device> Acts<X, D> {
    pub fn new(
        dev: &D,
        acct: &Accountant,
        shape: &GptShape,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Acts<X, D>, Error> {
        let a = Alloc::<D, GptShape, X>::new(dev, acct, shape, b, t);
        let saved = if checkpointing { 1 } else { shape.n_layer };
        let blocks = (0..saved)
            .map(|_| {
                Ok(BlockActs {
                    ln1: a.take(A::Ln1)?,
                    ln1_mean: a.take(A::Ln1Mean)?,
                    ln1_rstd: a.take(A::Ln1Rstd)?,
                    qkv: a.take(A::Qkv)?,
                    lse: a.take(A::AttLse)?,
                    atty: a.take(A::AttY)?,
                    res2: a.take(A::Res2)?,
                    ln2: a.take(A::Ln2)?,
                    ln2_mean: a.take(A::Ln2Mean)?,
                    ln2_rstd: a.take(A::Ln2Rstd)?,
                    fch: a.take(A::Fch)?,
                    fch_gelu: a.take(A::FchGelu)?,
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok(Acts {
            encoded: a.take(A::Encoded)?,
            blocks,
            res3: (0..shape.n_layer)
                .map(|_| a.take(A::Res3))
                .collect::<Result<_, Error>>()?,
            lnf: a.take(A::Lnf)?,
            lnf_mean: a.take(A::LnfMean)?,
            lnf_rstd: a.take(A::LnfRstd)?,
            dres: a.take(A::DResidual)?,
            dchan: a.take(A::DChannels)?,
            dwide: a.take(A::DWide)?,
            delta: a.take(A::AttDelta)?,
            batch: a.batch([A::Inputs, A::Targets, A::Logits, A::Losses])?,
            matmul_scratch: a.matmul_scratch::<A>()?,
        })
    }
}
