//! The activations and buffers of one micro-batch, allocated exactly as
//! `scheduler::model::ActivationTensor` describes them, so the memory model counts them.

use scheduler::memory::{Category, DeviceKind};
use scheduler::model::{ActivationTensor as A, GptShape, MATMUL_SCRATCH_F32};

use crate::Error;
use crate::accounting::{Accountant, Buffer};
use crate::device::{Device, Elem, Num};

/// What one block's forward keeps for its backward (its output is in `Acts::res3`).
pub struct BlockActs<X, D: Device> {
    pub ln1: Buffer<X, D>,
    pub ln1_mean: Buffer<f32, D>,
    pub ln1_rstd: Buffer<f32, D>,
    pub qkv: Buffer<X, D>,
    pub att: Buffer<X, D>,
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
    /// and of the attention scores.
    pub dres: Buffer<X, D>,
    pub dchan: Buffer<X, D>,
    pub dwide: Buffer<X, D>,
    pub datt: Buffer<f32, D>,
    pub logits: Buffer<f32, D>,
    pub losses: Buffer<f32, D>,
    pub inputs: Buffer<u32, D>,
    pub targets: Buffer<u32, D>,
    /// Where the matmuls widen fp16/bf16 tiles (empty for fp32).
    pub matmul_scratch: Buffer<f32, D>,
}

struct Alloc<'a, D> {
    dev: &'a D,
    acct: &'a Accountant,
    shape: &'a GptShape,
    b: usize,
    t: usize,
}

impl<D: Device> Alloc<'_, D> {
    fn take<T: Elem>(&self, tensor: A, compute_bytes: usize) -> Result<Buffer<T, D>, Error> {
        debug_assert_eq!(
            size_of::<T>() as u64,
            tensor.element().bytes(compute_bytes as u64)
        );
        let category = if tensor.is_buffer() {
            Category::Buffers
        } else {
            Category::Activations
        };
        self.acct
            .alloc_on(self.dev, category, tensor.len(self.shape, self.b, self.t))
    }
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
        let a = Alloc {
            dev,
            acct,
            shape,
            b,
            t,
        };
        let x = X::BYTES;
        let saved = if checkpointing { 1 } else { shape.n_layer };
        let blocks = (0..saved)
            .map(|_| {
                Ok(BlockActs {
                    ln1: a.take(A::Ln1, x)?,
                    ln1_mean: a.take(A::Ln1Mean, x)?,
                    ln1_rstd: a.take(A::Ln1Rstd, x)?,
                    qkv: a.take(A::Qkv, x)?,
                    att: a.take(A::Att, x)?,
                    atty: a.take(A::AttY, x)?,
                    res2: a.take(A::Res2, x)?,
                    ln2: a.take(A::Ln2, x)?,
                    ln2_mean: a.take(A::Ln2Mean, x)?,
                    ln2_rstd: a.take(A::Ln2Rstd, x)?,
                    fch: a.take(A::Fch, x)?,
                    fch_gelu: a.take(A::FchGelu, x)?,
                })
            })
            .collect::<Result<_, Error>>()?;
        // Only the CPU's GEMMs widen 16-bit tiles (scheduler::memory::rank_breakdown_on).
        let scratch = if X::as_f32(&[]).is_some() || D::KIND != DeviceKind::Cpu {
            0
        } else {
            MATMUL_SCRATCH_F32
        };
        Ok(Acts {
            encoded: a.take(A::Encoded, x)?,
            blocks,
            res3: (0..shape.n_layer)
                .map(|_| a.take(A::Res3, x))
                .collect::<Result<_, Error>>()?,
            lnf: a.take(A::Lnf, x)?,
            lnf_mean: a.take(A::LnfMean, x)?,
            lnf_rstd: a.take(A::LnfRstd, x)?,
            dres: a.take(A::DResidual, x)?,
            dchan: a.take(A::DChannels, x)?,
            dwide: a.take(A::DWide, x)?,
            datt: a.take(A::DAtt, x)?,
            logits: a.take(A::Logits, x)?,
            losses: a.take(A::Losses, x)?,
            inputs: a.take(A::Inputs, x)?,
            targets: a.take(A::Targets, x)?,
            matmul_scratch: acct.alloc_on(dev, Category::Buffers, scratch)?,
        })
    }
}
