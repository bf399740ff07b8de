//! The Llama family (Llama, Mistral, Qwen2, Qwen3) on flat per-unit buffers: named views of a
//! block's tensors, the activations of one micro-batch, the RoPE tables and each unit's
//! passes. Linear weights are Hugging Face's (out, in), used as x·Wᵀ + b.

mod acts;
mod pass;
mod rope;

pub use acts::Acts;
pub use rope::rope_tables;

use kernels::attention::AttentionDims;
use kernels::rope::RopeDims;
use scheduler::model::{LlamaShape, LlamaTensor, ModelTensor};

use crate::Error;
use crate::accounting::Accountant;
use crate::device::{Device, Num, front, front_mut};

/// Sizes of one micro-batch of one model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    /// C: hidden size.
    pub c: usize,
    /// H query heads and KV key/value heads of D channels.
    pub h: usize,
    pub kv: usize,
    pub d: usize,
    /// I: intermediate size.
    pub i: usize,
    pub v: usize,
    pub l: usize,
    pub eps: f32,
}

impl Dims {
    pub fn new(s: &LlamaShape, b: usize, t: usize) -> Dims {
        Dims {
            b,
            t,
            c: s.hidden_size,
            h: s.num_attention_heads,
            kv: s.num_key_value_heads,
            d: s.head_dim,
            i: s.intermediate_size,
            v: s.vocab_size,
            l: s.num_hidden_layers,
            eps: s.rms_norm_eps as f32,
        }
    }

    pub fn tokens(&self) -> usize {
        self.b * self.t
    }

    /// H·D: width of the queries and of the attention output.
    pub fn q(&self) -> usize {
        self.h * self.d
    }

    /// KV·D: width of the keys and of the values.
    pub fn kv_width(&self) -> usize {
        self.kv * self.d
    }

    fn attention(&self) -> AttentionDims {
        AttentionDims::gqa(self.b, self.t, self.h, self.kv, self.d)
    }

    fn rope(&self, heads: usize) -> RopeDims {
        RopeDims {
            t: self.t,
            heads,
            head_dim: self.d,
        }
    }
}

/// The tensors of a block as views `S` of its unit buffer; `None` where the shape has no such
/// tensor (biases, Qwen3's q/k norms) or the unit does not hold it (a QLoRA base's NF4
/// projection weights, which `lora::Adapted::weight` dequantizes).
pub struct Block<S> {
    pub q: Option<S>,
    pub q_bias: Option<S>,
    pub k: Option<S>,
    pub k_bias: Option<S>,
    pub v: Option<S>,
    pub v_bias: Option<S>,
    pub o: Option<S>,
    pub o_bias: Option<S>,
    pub q_norm: Option<S>,
    pub k_norm: Option<S>,
    pub gate: Option<S>,
    pub gate_bias: Option<S>,
    pub up: Option<S>,
    pub up_bias: Option<S>,
    pub down: Option<S>,
    pub down_bias: Option<S>,
    pub norm1: S,
    pub norm2: S,
}

impl<S> Block<S> {
    /// Names the views `take` cuts, in turn, for each of the shape's block tensors the unit
    /// holds (`held`).
    fn cut(
        shape: &LlamaShape,
        held: impl Fn(ModelTensor) -> bool,
        mut take: impl FnMut(usize) -> S,
    ) -> Block<S> {
        use LlamaTensor as T;
        let mut parts: Vec<(T, S)> = shape
            .block()
            .into_iter()
            .filter(|&t| held(ModelTensor::Llama(t)))
            .map(|t| (t, take(t.dims(shape).numel())))
            .collect();
        let mut get = |kind: T| {
            let i = parts.iter().position(|(t, _)| *t == kind)?;
            Some(parts.swap_remove(i).1)
        };
        let (q, k, v, o) = (get(T::QProj), get(T::KProj), get(T::VProj), get(T::OProj));
        let (gate, up, down) = (get(T::GateProj), get(T::UpProj), get(T::DownProj));
        let mut need = |kind: T| get(kind).expect("every block has its norms");
        let (norm1, norm2) = (need(T::InputNorm), need(T::PostAttentionNorm));
        Block {
            q,
            q_bias: get(T::QBias),
            k,
            k_bias: get(T::KBias),
            v,
            v_bias: get(T::VBias),
            o,
            o_bias: get(T::OBias),
            q_norm: get(T::QNorm),
            k_norm: get(T::KNorm),
            gate,
            gate_bias: get(T::GateBias),
            up,
            up_bias: get(T::UpBias),
            down,
            down_bias: get(T::DownBias),
            norm1,
            norm2,
        }
    }
}

/// Block `unit`'s tensors, to read: those it holds (`held`).
pub fn block<'a, D: Device, X>(
    unit: D::View<'a, X>,
    shape: &LlamaShape,
    held: impl Fn(ModelTensor) -> bool,
) -> Block<D::View<'a, X>> {
    Block::cut(shape, held, front::<D, X>(unit))
}

/// Block `unit`'s tensors, to write (its gradient); every one `None` without one (frozen).
pub fn block_mut<'a, D: Device, X>(
    unit: Option<D::ViewMut<'a, X>>,
    shape: &LlamaShape,
) -> Block<Option<D::ViewMut<'a, X>>> {
    // Only a model that is trained has a gradient, and it holds every tensor.
    Block::cut(shape, |_| true, front_mut::<D, X>(unit))
}

/// A Llama-family model's passes over one micro-batch's activations (`pass.rs`).
pub struct Model<X: Num, D: Device> {
    pub shape: LlamaShape,
    pub dims: Dims,
    pub acts: Acts<X, D>,
}

impl<X: Num, D: Device> Model<X, D> {
    pub fn new(
        dev: &D,
        acct: &Accountant,
        shape: &LlamaShape,
        b: usize,
        t: usize,
        checkpointing: bool,
    ) -> Result<Self, Error> {
        Ok(Model {
            shape: *shape,
            dims: Dims::new(shape, b, t),
            acts: Acts::new(dev, acct, shape, b, t, checkpointing)?,
        })
    }
}
