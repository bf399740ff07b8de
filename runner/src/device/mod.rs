//! The device the trainer runs on: where its buffers live and which kernels run on them. The
//! passes and the engine are written once over [`Device`]; [`Cpu`] is the `kernels` crate's
//! CPU kernels on host memory (the same calls as before the trait, so the same bits and speed);
//! [`Cuda`] (feature `cuda`) is a GPU through `kernels::cuda`.
//!
//! A buffer is a flat allocation ([`Device::Buf`]); kernels take views of it, shared
//! ([`Device::View`]) or exclusive ([`Device::ViewMut`]), which split like slices so a unit's
//! buffer can be cut into its named tensors (`gpt::Block`).

use std::ops::Range;

use kernels::Float;
use kernels::attention::AttentionDims;
use kernels::dropout::Mask;
use kernels::matmul::{DinpMode, Layout};
use kernels::optim::{Adafactor, AdamW, Lion, Momentum};
use kernels::rope::RopeDims;

use scheduler::memory::DeviceKind;

use crate::Error;

/// The kernels every device runs with the shapes and semantics of the `kernels` function of
/// the same name, one entry each (`module::name<generics>(arguments);`, typed as [`Device`]'s
/// views): [`Device`] declares a method per entry and [`Cpu`] forwards each to that function,
/// so a new kernel is its CPU function, its CUDA function (`Cuda`'s method) and one entry here.
macro_rules! kernels {
    ($then:ident) => {
        $then! {
            encoder::encoder_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                tokens: Self::View<'_, u32>,
                wte: Self::View<'_, X>,
                wpe: Option<Self::View<'_, X>>,
                t: usize,
                c: usize,
            );
            encoder::encoder_backward<X: Num>(
                dwte: Self::ViewMut<'_, X>,
                dwpe: Option<Self::ViewMut<'_, X>>,
                dout: Self::View<'_, X>,
                tokens: Self::View<'_, u32>,
                t: usize,
                c: usize,
            );
            layernorm::layernorm_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                mean: Self::ViewMut<'_, f32>,
                rstd: Self::ViewMut<'_, f32>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                bias: Self::View<'_, X>,
            );
            layernorm::layernorm_backward<X: Num>(
                dinp: Self::ViewMut<'_, X>,
                dweight: Self::ViewMut<'_, X>,
                dbias: Self::ViewMut<'_, X>,
                dout: Self::View<'_, X>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                mean: Self::View<'_, f32>,
                rstd: Self::View<'_, f32>,
            );
            layernorm::layernorm_backward_input<X: Num>(
                dinp: Self::ViewMut<'_, X>,
                dout: Self::View<'_, X>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                mean: Self::View<'_, f32>,
                rstd: Self::View<'_, f32>,
            );
            /// `scratch` is the CPU's f32 widening buffer (`kernels::matmul::scratch_len`).
            matmul::matmul_forward<X: Num, Y: Num>(
                out: Self::ViewMut<'_, Y>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                bias: Option<Self::View<'_, X>>,
                layout: Layout,
                mkn: (usize, usize, usize),
                scratch: Self::ViewMut<'_, f32>,
            );
            matmul::matmul_backward<X: Num, G: Num>(
                dinp: Self::ViewMut<'_, X>,
                dweight: Self::ViewMut<'_, X>,
                dbias: Option<Self::ViewMut<'_, X>>,
                dout: Self::View<'_, G>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                layout: Layout,
                mkn: (usize, usize, usize),
                dinp_mode: DinpMode,
                scratch: Self::ViewMut<'_, f32>,
            );
            matmul::matmul_backward_input<X: Num, G: Num>(
                dinp: Self::ViewMut<'_, X>,
                dout: Self::View<'_, G>,
                weight: Self::View<'_, X>,
                layout: Layout,
                mkn: (usize, usize, usize),
                dinp_mode: DinpMode,
                scratch: Self::ViewMut<'_, f32>,
            );
            /// The weight's part of `matmul_backward` alone.
            matmul::matmul_backward_weight<X: Num, G: Num>(
                dweight: Self::ViewMut<'_, X>,
                dout: Self::View<'_, G>,
                inp: Self::View<'_, X>,
                layout: Layout,
                mkn: (usize, usize, usize),
                scratch: Self::ViewMut<'_, f32>,
            );
            dropout::dropout_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                inp: Self::View<'_, X>,
                mask: Mask,
            );
            /// Adds into `dinp`.
            dropout::dropout_backward<X: Num>(
                dinp: Self::ViewMut<'_, X>,
                dout: Self::View<'_, X>,
                mask: Mask,
            );
            attention::attention_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                lse: Self::ViewMut<'_, f32>,
                qkv: Self::View<'_, X>,
                d: AttentionDims,
            );
            attention::attention_backward<X: Num>(
                dqkv: Self::ViewMut<'_, X>,
                delta: Self::ViewMut<'_, f32>,
                dout: Self::View<'_, X>,
                qkv: Self::View<'_, X>,
                out: Self::View<'_, X>,
                lse: Self::View<'_, f32>,
                d: AttentionDims,
            );
            attention::gqa_attention_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                lse: Self::ViewMut<'_, f32>,
                q: Self::View<'_, X>,
                k: Self::View<'_, X>,
                v: Self::View<'_, X>,
                d: AttentionDims,
            );
            attention::gqa_attention_backward<X: Num>(
                dq: Self::ViewMut<'_, X>,
                dk: Self::ViewMut<'_, X>,
                dv: Self::ViewMut<'_, X>,
                delta: Self::ViewMut<'_, f32>,
                dout: Self::View<'_, X>,
                q: Self::View<'_, X>,
                k: Self::View<'_, X>,
                v: Self::View<'_, X>,
                out: Self::View<'_, X>,
                lse: Self::View<'_, f32>,
                d: AttentionDims,
            );
            rmsnorm::rmsnorm_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                rstd: Self::ViewMut<'_, f32>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                eps: f32,
            );
            rmsnorm::rmsnorm_backward<X: Num>(
                dinp: Self::ViewMut<'_, X>,
                dweight: Self::ViewMut<'_, X>,
                dout: Self::View<'_, X>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                rstd: Self::View<'_, f32>,
            );
            rmsnorm::rmsnorm_backward_input<X: Num>(
                dinp: Self::ViewMut<'_, X>,
                dout: Self::View<'_, X>,
                inp: Self::View<'_, X>,
                weight: Self::View<'_, X>,
                rstd: Self::View<'_, f32>,
            );
            rope::rope_forward<X: Num>(
                x: Self::ViewMut<'_, X>,
                cos: Self::View<'_, f32>,
                sin: Self::View<'_, f32>,
                d: RopeDims,
            );
            rope::rope_backward<X: Num>(
                dx: Self::ViewMut<'_, X>,
                cos: Self::View<'_, f32>,
                sin: Self::View<'_, f32>,
                d: RopeDims,
            );
            swiglu::swiglu_forward<X: Num>(
                out: Self::ViewMut<'_, X>,
                gate: Self::View<'_, X>,
                up: Self::View<'_, X>,
            );
            /// In place: `dup` holds ∂loss/∂out on entry.
            swiglu::swiglu_backward<X: Num>(
                dgate: Self::ViewMut<'_, X>,
                dup: Self::ViewMut<'_, X>,
                gate: Self::View<'_, X>,
                up: Self::View<'_, X>,
            );
            gelu::gelu_forward<X: Num>(out: Self::ViewMut<'_, X>, inp: Self::View<'_, X>);
            gelu::gelu_backward<X: Num>(grad: Self::ViewMut<'_, X>, inp: Self::View<'_, X>);
            residual::residual_accumulate<X: Num>(acc: Self::ViewMut<'_, X>, x: Self::View<'_, X>);
            residual::scale<X: Num>(x: Self::ViewMut<'_, X>, s: f32);
            crossentropy::crossentropy_forward(
                losses: Self::ViewMut<'_, f32>,
                logits: Self::ViewMut<'_, f32>,
                targets: Self::View<'_, u32>,
                v: usize,
                dloss: Option<f32>,
            );
            k::decay(master: Self::ViewMut<'_, f32>, factor: f32);
            k::sgd_step<X: Num>(
                master: Self::ViewMut<'_, f32>,
                grad: Self::View<'_, X>,
                param_out: Option<Self::ViewMut<'_, X>>,
                lr: f32,
                grad_scale: f32,
                decay: f32,
            );
            k::momentum_step<X: Num>(
                master: Self::ViewMut<'_, f32>,
                grad: Self::View<'_, X>,
                buf: Self::ViewMut<'_, f32>,
                param_out: Option<Self::ViewMut<'_, X>>,
                hp: &Momentum,
                grad_scale: f32,
                decay: f32,
            );
            k::lion_step<X: Num>(
                master: Self::ViewMut<'_, f32>,
                grad: Self::View<'_, X>,
                m: Self::ViewMut<'_, f32>,
                param_out: Option<Self::ViewMut<'_, X>>,
                hp: &Lion,
                grad_scale: f32,
                decay: f32,
            );
            k::adamw_step<X: Num>(
                master: Self::ViewMut<'_, f32>,
                grad: Self::View<'_, X>,
                m: Self::ViewMut<'_, f32>,
                v: Self::ViewMut<'_, f32>,
                param_out: Option<Self::ViewMut<'_, X>>,
                hp: &AdamW,
                step: u64,
                grad_scale: f32,
                decay: f32,
            );
            k::adafactor_sq_sums<X: Num>(
                grad: Self::View<'_, X>,
                start: usize,
                grad_scale: f32,
                hp: &Adafactor,
                row_sums: Self::ViewMut<'_, f64>,
                col_sums: Self::ViewMut<'_, f64>,
            );
            k::adafactor_update_stats(
                row: Self::ViewMut<'_, f32>,
                col: Self::ViewMut<'_, f32>,
                row_sums: Self::View<'_, f64>,
                col_sums: Self::View<'_, f64>,
                hp: &Adafactor,
                step: u64,
            );
            k::adafactor_vector_ema<X: Num>(
                v: Self::ViewMut<'_, f32>,
                grad: Self::View<'_, X>,
                grad_scale: f32,
                hp: &Adafactor,
                step: u64,
                rms_sum: Self::ViewMut<'_, f64>,
            );
        }
    };
}

/// A [`Device`] method declaration per entry of [`kernels!`].
macro_rules! declare {
    ($($(#[$attr:meta])* $module:ident::$name:ident $(<$($g:ident: $bound:ident),+>)? ($($arg:ident: $ty:ty),* $(,)?);)+) => {
        $(
            $(#[$attr])*
            #[allow(clippy::too_many_arguments)]
            fn $name $(<$($g: $bound),+>)? (&self, $($arg: $ty),*) -> Result<(), Error>;
        )+
    };
}

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

pub use cpu::Cpu;
#[cfg(feature = "cuda")]
pub use cuda::Cuda;

/// An element type a device buffer can hold (on a GPU too, where CUDA is built).
pub trait Elem:
    bytemuck::Pod + Default + Send + Sync + kernels::cuda::DeviceRepr + kernels::cuda::ValidAsZeroBits
{
}
impl<
    T: bytemuck::Pod
        + Default
        + Send
        + Sync
        + kernels::cuda::DeviceRepr
        + kernels::cuda::ValidAsZeroBits,
> Elem for T
{
}

/// A compute dtype (`f32`, `f16`, `bf16`) on every device.
pub trait Num: Float + Elem {}
impl<X: Float + Elem> Num for X {}

/// Where the trainer's buffers live and its kernels run. Kernels have the shapes and
/// semantics of the `kernels` functions of the same names; they may run asynchronously, and
/// every host transfer waits for what was queued before it.
#[allow(clippy::too_many_arguments)]
pub trait Device: Sized + 'static {
    /// What the memory model calls this kind of device.
    const KIND: DeviceKind;
    /// An allocation of `T`s on the device.
    type Buf<T>;
    type View<'a, T: 'a>;
    type ViewMut<'a, T: 'a>;

    /// A zeroed buffer of `len` elements (callers charge it to an `Accountant`).
    fn zeros<T: Elem>(&self, len: usize) -> Result<Self::Buf<T>, Error>;
    fn view<T>(buf: &Self::Buf<T>) -> Self::View<'_, T>;
    fn view_mut<T>(buf: &mut Self::Buf<T>) -> Self::ViewMut<'_, T>;
    /// The same elements again, for as long as the original.
    fn share<'a, T: 'a>(v: &Self::View<'a, T>) -> Self::View<'a, T>;
    fn slice<'a, T: 'a>(v: Self::View<'a, T>, r: Range<usize>) -> Self::View<'a, T>;
    fn slice_mut<'a, T: 'a>(v: Self::ViewMut<'a, T>, r: Range<usize>) -> Self::ViewMut<'a, T>;
    fn split_at<'a, T: 'a>(
        v: Self::View<'a, T>,
        mid: usize,
    ) -> (Self::View<'a, T>, Self::View<'a, T>);
    fn split_at_mut<'a, T: 'a>(
        v: Self::ViewMut<'a, T>,
        mid: usize,
    ) -> (Self::ViewMut<'a, T>, Self::ViewMut<'a, T>);
    /// `v`, to read only.
    fn freeze<'a, T: 'a>(v: Self::ViewMut<'a, T>) -> Self::View<'a, T>;
    /// `v` as the f32s it is, when `X` is f32 (fp32 parameters are their own master).
    fn as_f32_mut<'a, X: Num + 'a>(v: Self::ViewMut<'a, X>) -> Option<Self::ViewMut<'a, f32>>;
    /// The bytes of `v` (checkpoints store state as bytes).
    fn bytes_mut<'a, T: Elem + 'a>(v: Self::ViewMut<'a, T>) -> Self::ViewMut<'a, u8>;
    /// The same elements again, for as long as `v` is borrowed.
    fn reborrow_ref<'b, 'a: 'b, T: 'a>(v: &'b Self::View<'a, T>) -> Self::View<'b, T>;
    /// The same elements again, exclusively, for as long as `v` is borrowed.
    fn reborrow<'b, 'a: 'b, T: 'a>(v: &'b mut Self::ViewMut<'a, T>) -> Self::ViewMut<'b, T>;

    /// Lets `f` read and write `v` as host memory (the CPU hands it over; a GPU copies it out
    /// and back): collectives, checkpoints and weight initialisation.
    fn on_host<T: Elem, R>(
        &self,
        v: Self::ViewMut<'_, T>,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R, Error>;
    /// `v` copied to the host (the losses, the export).
    fn to_host<T: Elem>(&self, v: Self::View<'_, T>) -> Result<Vec<T>, Error>;

    /// The device's memory in use, by every process, as its driver reports it; `None` where
    /// memory is the host's (the accountant's figures are the CPU's whole story).
    fn used_bytes(&self) -> Result<Option<u64>, Error> {
        Ok(None)
    }

    fn fill_zero<T: Elem>(&self, v: Self::ViewMut<'_, T>) -> Result<(), Error>;
    fn copy<T: Elem>(&self, dst: Self::ViewMut<'_, T>, src: Self::View<'_, T>)
    -> Result<(), Error>;

    /// `Σ x²` in f64, on the host (the global norm's share of one buffer).
    fn sum_squares<X: Num>(&self, x: Self::View<'_, X>) -> Result<f64, Error>;

    /// `kernels::nf4::quantize` of `src` into an NF4 tensor's `codes` and the bytes of its
    /// fp32 absmax, which start 4-byte aligned (QLoRA's base is held as bytes).
    fn nf4_quantize<X: Num>(
        &self,
        codes: Self::ViewMut<'_, u8>,
        absmax: Self::ViewMut<'_, u8>,
        src: Self::View<'_, X>,
    ) -> Result<(), Error>;
    /// `kernels::nf4::dequantize` into `out` from what [`Device::nf4_quantize`] wrote.
    fn nf4_dequantize<X: Num>(
        &self,
        out: Self::ViewMut<'_, X>,
        codes: Self::View<'_, u8>,
        absmax: Self::View<'_, u8>,
    ) -> Result<(), Error>;

    // The optimizer updates of `kernels::optim`, gradients in the parameters' dtype.
    fn adam8bit_step<X: Num>(
        &self,
        master: Self::ViewMut<'_, f32>,
        grad: Self::View<'_, X>,
        state: Adam8bitState<'_, Self>,
        param_out: Option<Self::ViewMut<'_, X>>,
        hp: &AdamW,
        step: u64,
        grad_scale: f32,
        block: usize,
    ) -> Result<(), Error>;
    fn adafactor_rms_sum<X: Num>(
        &self,
        grad: Self::View<'_, X>,
        grad_scale: f32,
        moment: Moment<'_, Self>,
        rms_sum: Self::ViewMut<'_, f64>,
    ) -> Result<(), Error>;
    fn adafactor_apply<X: Num>(
        &self,
        master: Self::ViewMut<'_, f32>,
        grad: Self::View<'_, X>,
        exp_avg: Option<Self::ViewMut<'_, f32>>,
        param_out: Option<Self::ViewMut<'_, X>>,
        moment: Moment<'_, Self>,
        rms_sum: Self::View<'_, f64>,
        hp: &Adafactor,
        grad_scale: f32,
    ) -> Result<(), Error>;

    kernels!(declare);
}

/// 8-bit Adam's quantised moments and their per-block scales.
pub struct Adam8bitState<'a, D: Device> {
    pub m: D::ViewMut<'a, u8>,
    pub v: D::ViewMut<'a, u8>,
    pub absmax_m: D::ViewMut<'a, f32>,
    pub absmax_v: D::ViewMut<'a, f32>,
}

/// The second-moment statistics an Adafactor update is scaled by (`kernels::optim::Moment`).
pub enum Moment<'a, D: Device> {
    /// Row and column EMAs of a matrix; the range starts at element `start` of it.
    Factored {
        row: D::View<'a, f32>,
        col: D::View<'a, f32>,
        start: usize,
    },
    /// The range's slice of a vector's EMA; `numel` is the whole vector's length.
    Full { v: D::View<'a, f32>, numel: usize },
}

/// The device a run trains on: `cpu`, or `cuda[:N]` (GPU N, default 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Target {
    #[default]
    Cpu,
    Cuda(usize),
}

impl Target {
    pub fn kind(self) -> DeviceKind {
        match self {
            Target::Cpu => DeviceKind::Cpu,
            Target::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Target, String> {
        match s {
            "cpu" => Ok(Target::Cpu),
            "cuda" => Ok(Target::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Target::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: expected cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Cpu => f.write_str("cpu"),
            Target::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Cuts consecutive views from the front of `v`, each as long as asked for in turn.
pub fn front<'a, D: Device, T: 'a>(v: D::View<'a, T>) -> impl FnMut(usize) -> D::View<'a, T> {
    let mut rest = Some(v);
    move |n| {
        let (head, tail) = D::split_at(rest.take().expect("one view left"), n);
        rest = Some(tail);
        head
    }
}

/// As [`front`], exclusive; every view `None` without `v`.
pub fn front_mut<'a, D: Device, T: 'a>(
    v: Option<D::ViewMut<'a, T>>,
) -> impl FnMut(usize) -> Option<D::ViewMut<'a, T>> {
    let mut rest = v;
    move |n| {
        let (head, tail) = D::split_at_mut(rest.take()?, n);
        rest = Some(tail);
        Some(head)
    }
}

/// `N` consecutive views of the given lengths from the front of `v` (the rest is padding).
pub fn split<'a, D: Device, T: 'a, const N: usize>(
    v: D::View<'a, T>,
    lens: [usize; N],
) -> [D::View<'a, T>; N] {
    lens.map(front::<D, T>(v))
}

/// As [`split`], exclusive.
pub fn split_mut<'a, D: Device, T: 'a, const N: usize>(
    v: D::ViewMut<'a, T>,
    lens: [usize; N],
) -> [D::ViewMut<'a, T>; N] {
    let mut take = front_mut::<D, T>(Some(v));
    lens.map(|n| take(n).expect("one view left"))
}
