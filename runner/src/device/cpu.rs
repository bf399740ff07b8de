//! The CPU: buffers are host vectors and every kernel is the `kernels` crate's, called with
//! exactly the slices the trainer passed before the device interface (so bit for bit and
//! call for call the same), inlined away.

use std::ops::Range;

use kernels::attention::AttentionDims;
use kernels::matmul::{DinpMode, Layout};
use kernels::optim::{self as k, Adafactor, AdamW, Lion, Momentum};
use kernels::rope::RopeDims;
use kernels::{attention, crossentropy, encoder, gelu, grad_norm, layernorm, matmul, residual};
use kernels::{rmsnorm, rope, swiglu};

use super::{Adam8bitState, Device, Elem, Moment, Num};
use scheduler::memory::DeviceKind;

use crate::Error;

/// Methods that call the `kernels` function of the same name with the same arguments: the
/// CPU's kernels are those functions, so its methods only forward (and cannot fail).
macro_rules! forward {
    ($($module:ident::$name:ident $(<$($g:ident: $bound:ident),+>)? ($($arg:ident: $ty:ty),* $(,)?);)+) => {
        $(
            #[inline]
            fn $name $(<$($g: $bound),+>)? (&self, $($arg: $ty),*) -> Result<(), Error> {
                $module::$name($($arg),*);
                Ok(())
            }
        )+
    };
}

/// Host memory and the CPU kernels (their thread pool is `kernels::cpu`'s).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl Device for Cpu {
    const KIND: DeviceKind = DeviceKind::Cpu;
    type Buf<T> = Vec<T>;
    type View<'a, T: 'a> = &'a [T];
    type ViewMut<'a, T: 'a> = &'a mut [T];

    fn zeros<T: Elem>(&self, len: usize) -> Result<Vec<T>, Error> {
        Ok(vec![T::default(); len])
    }
    #[inline]
    fn view<T>(buf: &Vec<T>) -> &[T] {
        buf
    }
    #[inline]
    fn view_mut<T>(buf: &mut Vec<T>) -> &mut [T] {
        buf
    }
    #[inline]
    fn share<'a, T: 'a>(v: &&'a [T]) -> &'a [T] {
        v
    }
    #[inline]
    fn slice<'a, T: 'a>(v: &'a [T], r: Range<usize>) -> &'a [T] {
        &v[r]
    }
    #[inline]
    fn slice_mut<'a, T: 'a>(v: &'a mut [T], r: Range<usize>) -> &'a mut [T] {
        &mut v[r]
    }
    #[inline]
    fn split_at<'a, T: 'a>(v: &'a [T], mid: usize) -> (&'a [T], &'a [T]) {
        v.split_at(mid)
    }
    #[inline]
    fn split_at_mut<'a, T: 'a>(v: &'a mut [T], mid: usize) -> (&'a mut [T], &'a mut [T]) {
        v.split_at_mut(mid)
    }

    #[inline]
    fn freeze<'a, T: 'a>(v: &'a mut [T]) -> &'a [T] {
        v
    }
    #[inline]
    fn as_f32_mut<'a, X: Num + 'a>(v: &'a mut [X]) -> Option<&'a mut [f32]> {
        X::as_f32_mut(v)
    }
    #[inline]
    fn bytes_mut<'a, T: Elem + 'a>(v: &'a mut [T]) -> &'a mut [u8] {
        bytemuck::cast_slice_mut(v)
    }
    #[inline]
    fn reborrow_ref<'b, 'a: 'b, T: 'a>(v: &'b &'a [T]) -> &'b [T] {
        v
    }
    #[inline]
    fn reborrow<'b, 'a: 'b, T: 'a>(v: &'b mut &'a mut [T]) -> &'b mut [T] {
        v
    }

    #[inline]
    fn on_host<T: Elem, R>(&self, v: &mut [T], f: impl FnOnce(&mut [T]) -> R) -> Result<R, Error> {
        Ok(f(v))
    }
    fn to_host<T: Elem>(&self, v: &[T]) -> Result<Vec<T>, Error> {
        Ok(v.to_vec())
    }

    #[inline]
    fn fill_zero<T: Elem>(&self, v: &mut [T]) -> Result<(), Error> {
        v.fill(T::default());
        Ok(())
    }
    #[inline]
    fn copy<T: Elem>(&self, dst: &mut [T], src: &[T]) -> Result<(), Error> {
        dst.copy_from_slice(src);
        Ok(())
    }

    forward! {
        encoder::encoder_forward<X: Num>(
            out: &mut [X],
            tokens: &[u32],
            wte: &[X],
            wpe: Option<&[X]>,
            t: usize,
            c: usize,
        );
        encoder::encoder_backward<X: Num>(
            dwte: &mut [X],
            dwpe: Option<&mut [X]>,
            dout: &[X],
            tokens: &[u32],
            t: usize,
            c: usize,
        );
        layernorm::layernorm_forward<X: Num>(
            out: &mut [X],
            mean: &mut [f32],
            rstd: &mut [f32],
            inp: &[X],
            weight: &[X],
            bias: &[X],
        );
        layernorm::layernorm_backward<X: Num>(
            dinp: &mut [X],
            dweight: &mut [X],
            dbias: &mut [X],
            dout: &[X],
            inp: &[X],
            weight: &[X],
            mean: &[f32],
            rstd: &[f32],
        );
        matmul::matmul_forward<X: Num, Y: Num>(
            out: &mut [Y],
            inp: &[X],
            weight: &[X],
            bias: Option<&[X]>,
            layout: Layout,
            mkn: (usize, usize, usize),
            scratch: &mut [f32],
        );
        matmul::matmul_backward<X: Num, G: Num>(
            dinp: &mut [X],
            dweight: &mut [X],
            dbias: Option<&mut [X]>,
            dout: &[G],
            inp: &[X],
            weight: &[X],
            layout: Layout,
            mkn: (usize, usize, usize),
            dinp_mode: DinpMode,
            scratch: &mut [f32],
        );
        attention::attention_forward<X: Num>(
            out: &mut [X],
            lse: &mut [f32],
            qkv: &[X],
            d: AttentionDims,
        );
        attention::attention_backward<X: Num>(
            dqkv: &mut [X],
            delta: &mut [f32],
            dout: &[X],
            qkv: &[X],
            out: &[X],
            lse: &[f32],
            d: AttentionDims,
        );
        attention::gqa_attention_forward<X: Num>(
            out: &mut [X],
            lse: &mut [f32],
            q: &[X],
            k: &[X],
            v: &[X],
            d: AttentionDims,
        );
        attention::gqa_attention_backward<X: Num>(
            dq: &mut [X],
            dk: &mut [X],
            dv: &mut [X],
            delta: &mut [f32],
            dout: &[X],
            q: &[X],
            k: &[X],
            v: &[X],
            out: &[X],
            lse: &[f32],
            d: AttentionDims,
        );
        rmsnorm::rmsnorm_forward<X: Num>(
            out: &mut [X],
            rstd: &mut [f32],
            inp: &[X],
            weight: &[X],
            eps: f32,
        );
        rmsnorm::rmsnorm_backward<X: Num>(
            dinp: &mut [X],
            dweight: &mut [X],
            dout: &[X],
            inp: &[X],
            weight: &[X],
            rstd: &[f32],
        );
        rope::rope_forward<X: Num>(x: &mut [X], cos: &[f32], sin: &[f32], d: RopeDims);
        rope::rope_backward<X: Num>(dx: &mut [X], cos: &[f32], sin: &[f32], d: RopeDims);
        swiglu::swiglu_forward<X: Num>(out: &mut [X], gate: &[X], up: &[X]);
        swiglu::swiglu_backward<X: Num>(dgate: &mut [X], dup: &mut [X], gate: &[X], up: &[X]);
        gelu::gelu_forward<X: Num>(out: &mut [X], inp: &[X]);
        gelu::gelu_backward<X: Num>(grad: &mut [X], inp: &[X]);
        residual::residual_accumulate<X: Num>(acc: &mut [X], x: &[X]);
        crossentropy::crossentropy_forward(
            losses: &mut [f32],
            logits: &mut [f32],
            targets: &[u32],
            v: usize,
            dloss: Option<f32>,
        );
        k::sgd_step<X: Num>(
            master: &mut [f32],
            grad: &[X],
            param_out: Option<&mut [X]>,
            lr: f32,
            grad_scale: f32,
        );
        k::momentum_step<X: Num>(
            master: &mut [f32],
            grad: &[X],
            buf: &mut [f32],
            param_out: Option<&mut [X]>,
            hp: &Momentum,
            grad_scale: f32,
        );
        k::lion_step<X: Num>(
            master: &mut [f32],
            grad: &[X],
            m: &mut [f32],
            param_out: Option<&mut [X]>,
            hp: &Lion,
            grad_scale: f32,
        );
        k::adamw_step<X: Num>(
            master: &mut [f32],
            grad: &[X],
            m: &mut [f32],
            v: &mut [f32],
            param_out: Option<&mut [X]>,
            hp: &AdamW,
            step: u64,
            grad_scale: f32,
        );
        k::adafactor_update_stats(
            row: &mut [f32],
            col: &mut [f32],
            row_sums: &[f64],
            col_sums: &[f64],
            hp: &Adafactor,
            step: u64,
        );
        k::adafactor_vector_ema<X: Num>(
            v: &mut [f32],
            grad: &[X],
            grad_scale: f32,
            hp: &Adafactor,
            step: u64,
            rms_sum: &mut [f64],
        );
        k::decay(master: &mut [f32], factor: f32);
        k::adafactor_sq_sums<X: Num>(
            grad: &[X],
            start: usize,
            grad_scale: f32,
            hp: &Adafactor,
            row_sums: &mut [f64],
            col_sums: &mut [f64],
        );
    }

    #[inline]
    fn sum_squares<X: Num>(&self, x: &[X]) -> Result<f64, Error> {
        Ok(grad_norm::sum_squares(x))
    }

    #[inline]
    fn adam8bit_step<X: Num>(
        &self,
        master: &mut [f32],
        grad: &[X],
        s: Adam8bitState<'_, Self>,
        param_out: Option<&mut [X]>,
        hp: &AdamW,
        step: u64,
        grad_scale: f32,
        block: usize,
    ) -> Result<(), Error> {
        let Adam8bitState {
            m,
            v,
            absmax_m,
            absmax_v,
        } = s;
        k::adam8bit_step(
            master, grad, m, v, absmax_m, absmax_v, param_out, hp, step, grad_scale, block,
        );
        Ok(())
    }
    #[inline]
    fn adafactor_rms_sum<X: Num>(
        &self,
        grad: &[X],
        grad_scale: f32,
        moment: Moment<'_, Self>,
        rms_sum: &mut [f64],
    ) -> Result<(), Error> {
        k::adafactor_rms_sum(grad, grad_scale, moment.into(), rms_sum);
        Ok(())
    }
    #[inline]
    fn adafactor_apply<X: Num>(
        &self,
        master: &mut [f32],
        grad: &[X],
        exp_avg: Option<&mut [f32]>,
        param_out: Option<&mut [X]>,
        moment: Moment<'_, Self>,
        rms_sum: &[f64],
        hp: &Adafactor,
        grad_scale: f32,
    ) -> Result<(), Error> {
        k::adafactor_apply(
            master,
            grad,
            exp_avg,
            param_out,
            moment.into(),
            rms_sum,
            hp,
            grad_scale,
        );
        Ok(())
    }
}

impl<'a> From<Moment<'a, Cpu>> for k::Moment<'a> {
    #[inline]
    fn from(m: Moment<'a, Cpu>) -> Self {
        match m {
            Moment::Factored { row, col, start } => k::Moment::Factored { row, col, start },
            Moment::Full { v, numel } => k::Moment::Full { v, numel },
        }
    }
}
