//! The CPU: buffers are host vectors and every kernel is the `kernels` crate's, called with
//! exactly the slices the trainer passed before the device interface (so bit for bit and
//! call for call the same), inlined away.

use std::ops::Range;

use kernels::attention::AttentionDims;
use kernels::matmul::Layout;
use kernels::{attention, crossentropy, encoder, gelu, layernorm, matmul, residual};

use super::{Device, Elem, Num};
use crate::Error;

/// Host memory and the CPU kernels (their thread pool is `kernels::cpu`'s).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl Device for Cpu {
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

    #[inline]
    fn encoder_forward<X: Num>(
        &self,
        out: &mut [X],
        tokens: &[u32],
        wte: &[X],
        wpe: &[X],
        t: usize,
        c: usize,
    ) -> Result<(), Error> {
        encoder::encoder_forward(out, tokens, wte, wpe, t, c);
        Ok(())
    }
    #[inline]
    fn encoder_backward<X: Num>(
        &self,
        dwte: &mut [X],
        dwpe: &mut [X],
        dout: &[X],
        tokens: &[u32],
        t: usize,
        c: usize,
    ) -> Result<(), Error> {
        encoder::encoder_backward(dwte, dwpe, dout, tokens, t, c);
        Ok(())
    }
    #[inline]
    fn layernorm_forward<X: Num>(
        &self,
        out: &mut [X],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[X],
        weight: &[X],
        bias: &[X],
    ) -> Result<(), Error> {
        layernorm::layernorm_forward(out, mean, rstd, inp, weight, bias);
        Ok(())
    }
    #[inline]
    fn layernorm_backward<X: Num>(
        &self,
        dinp: &mut [X],
        dweight: &mut [X],
        dbias: &mut [X],
        dout: &[X],
        inp: &[X],
        weight: &[X],
        mean: &[f32],
        rstd: &[f32],
    ) -> Result<(), Error> {
        layernorm::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd);
        Ok(())
    }
    #[inline]
    fn matmul_forward<X: Num, Y: Num>(
        &self,
        out: &mut [Y],
        inp: &[X],
        weight: &[X],
        bias: Option<&[X]>,
        layout: Layout,
        mkn: (usize, usize, usize),
        scratch: &mut [f32],
    ) -> Result<(), Error> {
        matmul::matmul_forward(out, inp, weight, bias, layout, mkn, scratch);
        Ok(())
    }
    #[inline]
    fn matmul_backward<X: Num, G: Num>(
        &self,
        dinp: &mut [X],
        dweight: &mut [X],
        dbias: Option<&mut [X]>,
        dout: &[G],
        inp: &[X],
        weight: &[X],
        layout: Layout,
        mkn: (usize, usize, usize),
        scratch: &mut [f32],
    ) -> Result<(), Error> {
        matmul::matmul_backward(
            dinp, dweight, dbias, dout, inp, weight, layout, mkn, scratch,
        );
        Ok(())
    }
    #[inline]
    fn attention_forward<X: Num>(
        &self,
        out: &mut [X],
        att: &mut [X],
        qkv: &[X],
        d: AttentionDims,
    ) -> Result<(), Error> {
        attention::attention_forward(out, att, qkv, d);
        Ok(())
    }
    #[inline]
    fn attention_backward<X: Num>(
        &self,
        dqkv: &mut [X],
        datt: &mut [f32],
        dout: &[X],
        qkv: &[X],
        att: &[X],
        d: AttentionDims,
    ) -> Result<(), Error> {
        attention::attention_backward(dqkv, datt, dout, qkv, att, d);
        Ok(())
    }
    #[inline]
    fn gelu_forward<X: Num>(&self, out: &mut [X], inp: &[X]) -> Result<(), Error> {
        gelu::gelu_forward(out, inp);
        Ok(())
    }
    #[inline]
    fn gelu_backward<X: Num>(&self, grad: &mut [X], inp: &[X]) -> Result<(), Error> {
        gelu::gelu_backward(grad, inp);
        Ok(())
    }
    #[inline]
    fn residual_accumulate<X: Num>(&self, acc: &mut [X], x: &[X]) -> Result<(), Error> {
        residual::residual_accumulate(acc, x);
        Ok(())
    }
    #[inline]
    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        logits: &mut [f32],
        targets: &[u32],
        v: usize,
        dloss: Option<f32>,
    ) -> Result<(), Error> {
        crossentropy::crossentropy_forward(losses, logits, targets, v, dloss);
        Ok(())
    }
}
