//! The activations and buffers of one micro-batch, allocated exactly as
//! `scheduler::model::LlamaActivation` lists them, so the memory model counts them.

use scheduler::model::{LlamaActivation as A, LlamaShape};

use super::rope_tables;
use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::device::{Device, Num};
use crate::model::{Alloc, Batch};

/// What one block's forward keeps for its backward (its output is in `Acts::res3`). The q/k
/// norm tensors are empty without q/k norms.
pub struct BlockActs<X, D: Device> {
    pub norm1: Buffer<X, D>,
    pub norm1_rstd: Buffer<f32, D>,
    pub q_pre_norm: Buffer<X, D>,
    pub q_norm_rstd: Buffer<f32, D>,
    pub k_pre_norm: Buffer<X, D>,
    pub k_norm_rstd: Buffer<f32, D>,
    /// Queries and keys after RoPE, values.
    pub q: Buffer<X, D>,
    pub k: Buffer<X, D>,
    pub v: Buffer<X, D>,
    /// fp32 log-sum-exp of each query row's attention scores.
    pub lse: Buffer<f32, D>,
    pub atty: Buffer<X, D>,
    pub res2: Buffer<X, D>,
    pub norm2: Buffer<X, D>,
    pub norm2_rstd: Buffer<f32, D>,
    pub gate: Buffer<X, D>,
    pub up: Buffer<X, D>,
    pub product: Buffer<X, D>,
}

pub struct Acts<X, D: Device> {
    /// Block 0's input.
    pub encoded: Buffer<X, D>,
    /// One per layer, or under activation checkpointing one that every block recomputes into.
    pub blocks: Vec<BlockActs<X, D>>,
    /// Each block's output (always kept: checkpointing restarts from them).
    pub res3: Vec<Buffer<X, D>>,
    /// RoPE's (T, D/2) tables, filled once.
    pub rope_cos: Buffer<f32, D>,
    pub rope_sin: Buffer<f32, D>,
    pub normf: Buffer<X, D>,
    pub normf_rstd: Buffer<f32, D>,
    /// Backward scratch: the residual stream's gradient; a C- (or H·D-) wide gradient; the
    /// gradients of gate and up, then of q, k, v (and q before its norm); the attention's row
    /// sums of dout ∘ out.
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
        shape: &LlamaShape,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Acts<X, D>, Error> {
        let a = Alloc::<D, LlamaShape, X>::new(dev, acct, shape, b, t);
        let saved = if checkpointing {
            1
        } else {
            shape.num_hidden_layers
        };
        let blocks = (0..saved)
            .map(|_| {
                Ok(BlockActs {
                    norm1: a.take(A::Norm1)?,
                    norm1_rstd: a.take(A::Norm1Rstd)?,
                    q_pre_norm: a.take(A::QPreNorm)?,
                    q_norm_rstd: a.take(A::QNormRstd)?,
                    k_pre_norm: a.take(A::KPreNorm)?,
                    k_norm_rstd: a.take(A::KNormRstd)?,
                    q: a.take(A::Q)?,
                    k: a.take(A::K)?,
                    v: a.take(A::V)?,
                    lse: a.take(A::AttLse)?,
                    atty: a.take(A::AttY)?,
                    res2: a.take(A::Res2)?,
                    norm2: a.take(A::Norm2)?,
                    norm2_rstd: a.take(A::Norm2Rstd)?,
                    gate: a.take(A::Gate)?,
                    up: a.take(A::Up)?,
                    product: a.take(A::Product)?,
                })
            })
            .collect::<Result<_, Error>>()?;
        let mut rope_cos = a.take(A::RopeCos)?;
        let mut rope_sin = a.take(A::RopeSin)?;
        let (cos, sin) = rope_tables(&shape.rope, shape.head_dim, t);
        dev.on_host(rope_cos.view_mut(), |c| c.copy_from_slice(&cos))?;
        dev.on_host(rope_sin.view_mut(), |s| s.copy_from_slice(&sin))?;
        Ok(Acts {
            encoded: a.take(A::Encoded)?,
            blocks,
            res3: (0..shape.num_hidden_layers)
                .map(|_| a.take(A::Res3))
                .collect::<Result<_, Error>>()?,
            rope_cos,
            rope_sin,
            normf: a.take(A::NormF)?,
            normf_rstd: a.take(A::NormFRstd)?,
            dres: a.take(A::DResidual)?,
            dchan: a.take(A::DChannels)?,
            dwide: a.take(A::DWide)?,
            delta: a.take(A::AttDelta)?,
            batch: a.batch([A::Inputs, A::Targets, A::Logits, A::Losses])?,
            matmul_scratch: a.matmul_scratch::<A>()?,
        })
    }
}
