//! A CUDA GPU (feature `cuda`): buffers are `CudaSlice`s, views cudarc's `CudaView`s, and
//! every kernel is `kernels::cuda`'s, queued on the device's one stream.

use std::ops::Range;
use std::sync::Mutex;

use kernels::attention::AttentionDims;
use kernels::cuda::{self as k, CudaSlice, CudaView, CudaViewMut};
use kernels::dropout::Mask;
use kernels::matmul::{DinpMode, Layout};
use kernels::optim::{Adafactor, AdamW, Lion, Momentum};
use kernels::rope::RopeDims;

use super::{Adam8bitState, Device, Elem, Moment, Num};
use scheduler::memory::DeviceKind;

use crate::Error;

/// One GPU with its kernels, and the few bytes of scratch its reductions and 8-bit Adam need.
pub struct Cuda {
    dev: k::Gpu,
    scratch: Mutex<Scratch>,
    codes: k::optim::Adam8bitCodes,
}

/// A device allocation of `len` elements (the driver allocates none of zero bytes, so an empty
/// buffer holds one unused element).
pub struct Alloc<T> {
    slice: CudaSlice<T>,
    len: usize,
}

struct Scratch {
    total: CudaSlice<f64>,
    parts: CudaSlice<f64>,
    row_mean: CudaSlice<f32>,
}

impl Cuda {
    /// Opens GPU `ordinal`: "no CUDA driver found: …" where there is none.
    pub fn new(ordinal: usize) -> Result<Cuda, Error> {
        let dev = k::Gpu::new(ordinal)?;
        let scratch = Scratch {
            total: dev.zeros(1)?,
            parts: dev.zeros(k::grad_norm::sum_squares_parts_len())?,
            row_mean: dev.zeros(1)?,
        };
        Ok(Cuda {
            codes: k::optim::Adam8bitCodes::new(&dev)?,
            scratch: Mutex::new(scratch),
            dev,
        })
    }

    /// The GPU itself (NCCL joins on it).
    pub(crate) fn gpu(&self) -> &k::Gpu {
        &self.dev
    }

    fn scratch(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl From<k::Error> for Error {
    fn from(e: k::Error) -> Error {
        Error::Device(e.to_string())
    }
}

impl From<k::DriverError> for Error {
    fn from(e: k::DriverError) -> Error {
        Error::Device(format!("CUDA driver: {e}"))
    }
}

/// `v` for as long as the allocation it was cut from is borrowed.
///
/// SAFETY (for callers): `v` must have been cut from a view borrowed for `'a` that is not
/// used again. cudarc builds sub-views field by field from the parent's `'a` references and a
/// pointer, so they refer to nothing of the consumed parent itself.
unsafe fn detach<'a, T>(v: CudaViewMut<'_, T>) -> CudaViewMut<'a, T> {
    // SAFETY: the two types differ only in the lifetime; see above.
    unsafe { std::mem::transmute(v) }
}

fn opt<'b, T>(v: &'b mut Option<CudaViewMut<'_, T>>) -> Option<&'b mut CudaViewMut<'b, T>> {
    // Reborrowing through `as_mut` shortens the view's lifetime to the borrow's.
    v.as_mut().map(|v| {
        let r: &'b mut CudaViewMut<'_, T> = v;
        // SAFETY: a shorter lifetime of the same view, borrowed exclusively for it.
        unsafe { std::mem::transmute::<&'b mut CudaViewMut<'_, T>, &'b mut CudaViewMut<'b, T>>(r) }
    })
}

impl Device for Cuda {
    const KIND: DeviceKind = DeviceKind::Cuda;
    type Buf<T> = Alloc<T>;
    type View<'a, T: 'a> = CudaView<'a, T>;
    type ViewMut<'a, T: 'a> = CudaViewMut<'a, T>;

    fn zeros<T: Elem>(&self, len: usize) -> Result<Alloc<T>, Error> {
        Ok(Alloc {
            slice: self.dev.zeros(len.max(1))?,
            len,
        })
    }
    fn view<T>(buf: &Alloc<T>) -> CudaView<'_, T> {
        buf.slice.slice(0..buf.len)
    }
    fn view_mut<T>(buf: &mut Alloc<T>) -> CudaViewMut<'_, T> {
        buf.slice.slice_mut(0..buf.len)
    }
    fn share<'a, T: 'a>(v: &CudaView<'a, T>) -> CudaView<'a, T> {
        v.slice(..)
    }
    fn slice<'a, T: 'a>(v: CudaView<'a, T>, r: Range<usize>) -> CudaView<'a, T> {
        v.slice(r)
    }
    fn slice_mut<'a, T: 'a>(v: CudaViewMut<'a, T>, r: Range<usize>) -> CudaViewMut<'a, T> {
        let mut v = v;
        // SAFETY: cut from `v`, which is consumed.
        unsafe { detach(v.slice_mut(r)) }
    }
    fn split_at<'a, T: 'a>(v: CudaView<'a, T>, mid: usize) -> (CudaView<'a, T>, CudaView<'a, T>) {
        v.split_at(mid)
    }
    fn split_at_mut<'a, T: 'a>(
        v: CudaViewMut<'a, T>,
        mid: usize,
    ) -> (CudaViewMut<'a, T>, CudaViewMut<'a, T>) {
        let mut v = v;
        let (a, b) = v.split_at_mut(mid);
        // SAFETY: disjoint halves cut from `v`, which is consumed.
        unsafe { (detach(a), detach(b)) }
    }
    fn freeze<'a, T: 'a>(v: CudaViewMut<'a, T>) -> CudaView<'a, T> {
        let view = v.as_view();
        // SAFETY: `as_view` copies the fields of `v` (its `'a` references and pointer), which
        // is consumed; reading is all the view allows.
        unsafe { std::mem::transmute::<CudaView<'_, T>, CudaView<'a, T>>(view) }
    }
    fn as_f32_mut<'a, X: Num + 'a>(v: CudaViewMut<'a, X>) -> Option<CudaViewMut<'a, f32>> {
        if X::NAME != "f32" {
            return None;
        }
        let mut v = v;
        let len = v.len();
        // SAFETY: X is f32; the view is consumed.
        unsafe { v.transmute_mut::<f32>(len).map(|f| detach(f)) }
    }
    fn bytes_mut<'a, T: Elem + 'a>(v: CudaViewMut<'a, T>) -> CudaViewMut<'a, u8> {
        let mut v = v;
        let len = v.len() * size_of::<T>();
        // SAFETY: every T is plain old data, so its bytes are any u8s and any u8s written back
        // are a valid T (bytemuck::Pod); the view is consumed.
        unsafe { detach(v.transmute_mut::<u8>(len).expect("the same bytes")) }
    }
    fn reborrow_ref<'b, 'a: 'b, T: 'a>(v: &'b CudaView<'a, T>) -> CudaView<'b, T> {
        v.slice(..)
    }
    fn reborrow<'b, 'a: 'b, T: 'a>(v: &'b mut CudaViewMut<'a, T>) -> CudaViewMut<'b, T> {
        v.slice_mut(..)
    }

    fn on_host<T: Elem, R>(
        &self,
        v: CudaViewMut<'_, T>,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> Result<R, Error> {
        if v.is_empty() {
            return Ok(f(&mut []));
        }
        let mut v = v;
        let s = self.dev.stream();
        let mut host = s.clone_dtoh(&v)?;
        let r = f(&mut host);
        s.memcpy_htod(&host, &mut v)?;
        s.synchronize()?;
        Ok(r)
    }
    fn to_host<T: Elem>(&self, v: CudaView<'_, T>) -> Result<Vec<T>, Error> {
        Ok(self.dev.stream().clone_dtoh(&v)?)
    }
    fn used_bytes(&self) -> Result<Option<u64>, Error> {
        let (free, total) = self.dev.stream().context().mem_get_info()?;
        Ok(Some((total - free) as u64))
    }
    fn fill_zero<T: Elem>(&self, v: CudaViewMut<'_, T>) -> Result<(), Error> {
        let mut v = v;
        Ok(self.dev.stream().memset_zeros(&mut v)?)
    }
    fn copy<T: Elem>(&self, dst: CudaViewMut<'_, T>, src: CudaView<'_, T>) -> Result<(), Error> {
        let mut dst = dst;
        Ok(self.dev.stream().memcpy_dtod(&src, &mut dst)?)
    }

    fn encoder_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        tokens: CudaView<'_, u32>,
        wte: CudaView<'_, X>,
        wpe: Option<CudaView<'_, X>>,
        t: usize,
        c: usize,
    ) -> Result<(), Error> {
        Ok(k::layers::encoder_forward(
            &self.dev,
            &mut out,
            &tokens,
            &wte,
            wpe.as_ref(),
            t,
            c,
        )?)
    }
    fn encoder_backward<X: Num>(
        &self,
        mut dwte: CudaViewMut<'_, X>,
        mut dwpe: Option<CudaViewMut<'_, X>>,
        dout: CudaView<'_, X>,
        tokens: CudaView<'_, u32>,
        t: usize,
        c: usize,
    ) -> Result<(), Error> {
        // The kernel groups positions by token on the host: B·T u32 come back once per
        // micro-batch.
        let tokens = self.to_host(tokens)?;
        Ok(k::layers::encoder_backward(
            &self.dev,
            &mut dwte,
            opt(&mut dwpe),
            &dout,
            &tokens,
            t,
            c,
        )?)
    }
    fn layernorm_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        mut mean: CudaViewMut<'_, f32>,
        mut rstd: CudaViewMut<'_, f32>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        bias: CudaView<'_, X>,
    ) -> Result<(), Error> {
        Ok(k::layers::layernorm_forward(
            &self.dev, &mut out, &mut mean, &mut rstd, &inp, &weight, &bias,
        )?)
    }
    fn layernorm_backward<X: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        mut dweight: CudaViewMut<'_, X>,
        mut dbias: CudaViewMut<'_, X>,
        dout: CudaView<'_, X>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        mean: CudaView<'_, f32>,
        rstd: CudaView<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::layers::layernorm_backward(
            &self.dev,
            &mut dinp,
            &mut dweight,
            &mut dbias,
            &dout,
            &inp,
            &weight,
            &mean,
            &rstd,
        )?)
    }
    fn matmul_forward<X: Num, Y: Num>(
        &self,
        mut out: CudaViewMut<'_, Y>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        bias: Option<CudaView<'_, X>>,
        layout: Layout,
        mkn: (usize, usize, usize),
        _scratch: CudaViewMut<'_, f32>,
    ) -> Result<(), Error> {
        // cuBLASLt's bias has out's dtype; the trainer's biased layers write X.
        let bias = bias.map(|b| {
            assert_eq!(Y::NAME, X::NAME, "a bias needs out of the weights' dtype");
            // SAFETY: Y is X.
            unsafe { b.transmute::<Y>(b.len()) }.expect("the same elements")
        });
        Ok(k::matmul::matmul_forward(
            &self.dev,
            &mut out,
            &inp,
            &weight,
            bias.as_ref(),
            layout,
            mkn,
        )?)
    }
    fn matmul_backward<X: Num, G: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        mut dweight: CudaViewMut<'_, X>,
        mut dbias: Option<CudaViewMut<'_, X>>,
        dout: CudaView<'_, G>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        layout: Layout,
        mkn: (usize, usize, usize),
        dinp_mode: DinpMode,
        _scratch: CudaViewMut<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::matmul::matmul_backward(
            &self.dev,
            &mut dinp,
            &mut dweight,
            opt(&mut dbias),
            &dout,
            &inp,
            &weight,
            layout,
            mkn,
            dinp_mode,
        )?)
    }
    fn matmul_backward_input<X: Num, G: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        dout: CudaView<'_, G>,
        weight: CudaView<'_, X>,
        layout: Layout,
        mkn: (usize, usize, usize),
        dinp_mode: DinpMode,
        _scratch: CudaViewMut<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::matmul::matmul_backward_input(
            &self.dev, &mut dinp, &dout, &weight, layout, mkn, dinp_mode,
        )?)
    }
    fn matmul_backward_weight<X: Num, G: Num>(
        &self,
        mut dweight: CudaViewMut<'_, X>,
        dout: CudaView<'_, G>,
        inp: CudaView<'_, X>,
        layout: Layout,
        mkn: (usize, usize, usize),
        _scratch: CudaViewMut<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::matmul::matmul_backward_weight(
            &self.dev,
            &mut dweight,
            &dout,
            &inp,
            layout,
            mkn,
        )?)
    }
    fn dropout_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        inp: CudaView<'_, X>,
        mask: Mask,
    ) -> Result<(), Error> {
        Ok(k::dropout::dropout_forward(
            &self.dev, &mut out, &inp, mask,
        )?)
    }
    fn dropout_backward<X: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        dout: CudaView<'_, X>,
        mask: Mask,
    ) -> Result<(), Error> {
        Ok(k::dropout::dropout_backward(
            &self.dev, &mut dinp, &dout, mask,
        )?)
    }
    fn attention_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        mut lse: CudaViewMut<'_, f32>,
        qkv: CudaView<'_, X>,
        d: AttentionDims,
    ) -> Result<(), Error> {
        Ok(k::layers::attention_forward(
            &self.dev, &mut out, &mut lse, &qkv, d,
        )?)
    }
    fn attention_backward<X: Num>(
        &self,
        mut dqkv: CudaViewMut<'_, X>,
        mut delta: CudaViewMut<'_, f32>,
        dout: CudaView<'_, X>,
        qkv: CudaView<'_, X>,
        out: CudaView<'_, X>,
        lse: CudaView<'_, f32>,
        d: AttentionDims,
    ) -> Result<(), Error> {
        Ok(k::layers::attention_backward(
            &self.dev, &mut dqkv, &mut delta, &dout, &qkv, &out, &lse, d,
        )?)
    }
    fn gqa_attention_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        mut lse: CudaViewMut<'_, f32>,
        q: CudaView<'_, X>,
        k: CudaView<'_, X>,
        v: CudaView<'_, X>,
        d: AttentionDims,
    ) -> Result<(), Error> {
        Ok(k::layers::gqa_attention_forward(
            &self.dev, &mut out, &mut lse, &q, &k, &v, d,
        )?)
    }
    fn gqa_attention_backward<X: Num>(
        &self,
        mut dq: CudaViewMut<'_, X>,
        mut dk: CudaViewMut<'_, X>,
        mut dv: CudaViewMut<'_, X>,
        mut delta: CudaViewMut<'_, f32>,
        dout: CudaView<'_, X>,
        q: CudaView<'_, X>,
        k: CudaView<'_, X>,
        v: CudaView<'_, X>,
        out: CudaView<'_, X>,
        lse: CudaView<'_, f32>,
        d: AttentionDims,
    ) -> Result<(), Error> {
        Ok(k::layers::gqa_attention_backward(
            &self.dev, &mut dq, &mut dk, &mut dv, &mut delta, &dout, &q, &k, &v, &out, &lse, d,
        )?)
    }
    fn layernorm_backward_input<X: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        dout: CudaView<'_, X>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        mean: CudaView<'_, f32>,
        rstd: CudaView<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::layers::layernorm_backward_input(
            &self.dev, &mut dinp, &dout, &inp, &weight, &mean, &rstd,
        )?)
    }
    fn rmsnorm_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        mut rstd: CudaViewMut<'_, f32>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        eps: f32,
    ) -> Result<(), Error> {
        Ok(k::layers::rmsnorm_forward(
            &self.dev, &mut out, &mut rstd, &inp, &weight, eps,
        )?)
    }
    fn rmsnorm_backward<X: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        mut dweight: CudaViewMut<'_, X>,
        dout: CudaView<'_, X>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        rstd: CudaView<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::layers::rmsnorm_backward(
            &self.dev,
            &mut dinp,
            &mut dweight,
            &dout,
            &inp,
            &weight,
            &rstd,
        )?)
    }
    fn rmsnorm_backward_input<X: Num>(
        &self,
        mut dinp: CudaViewMut<'_, X>,
        dout: CudaView<'_, X>,
        inp: CudaView<'_, X>,
        weight: CudaView<'_, X>,
        rstd: CudaView<'_, f32>,
    ) -> Result<(), Error> {
        Ok(k::layers::rmsnorm_backward_input(
            &self.dev, &mut dinp, &dout, &inp, &weight, &rstd,
        )?)
    }
    fn rope_forward<X: Num>(
        &self,
        mut x: CudaViewMut<'_, X>,
        cos: CudaView<'_, f32>,
        sin: CudaView<'_, f32>,
        d: RopeDims,
    ) -> Result<(), Error> {
        Ok(k::layers::rope_forward(&self.dev, &mut x, &cos, &sin, d)?)
    }
    fn rope_backward<X: Num>(
        &self,
        mut dx: CudaViewMut<'_, X>,
        cos: CudaView<'_, f32>,
        sin: CudaView<'_, f32>,
        d: RopeDims,
    ) -> Result<(), Error> {
        Ok(k::layers::rope_backward(&self.dev, &mut dx, &cos, &sin, d)?)
    }
    fn swiglu_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        gate: CudaView<'_, X>,
        up: CudaView<'_, X>,
    ) -> Result<(), Error> {
        Ok(k::layers::swiglu_forward(&self.dev, &mut out, &gate, &up)?)
    }
    fn swiglu_backward<X: Num>(
        &self,
        mut dgate: CudaViewMut<'_, X>,
        mut dup: CudaViewMut<'_, X>,
        gate: CudaView<'_, X>,
        up: CudaView<'_, X>,
    ) -> Result<(), Error> {
        Ok(k::layers::swiglu_backward(
            &self.dev, &mut dgate, &mut dup, &gate, &up,
        )?)
    }
    fn gelu_forward<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        inp: CudaView<'_, X>,
    ) -> Result<(), Error> {
        Ok(k::layers::gelu_forward(&self.dev, &mut out, &inp)?)
    }
    fn gelu_backward<X: Num>(
        &self,
        mut grad: CudaViewMut<'_, X>,
        inp: CudaView<'_, X>,
    ) -> Result<(), Error> {
        Ok(k::layers::gelu_backward(&self.dev, &mut grad, &inp)?)
    }
    fn residual_accumulate<X: Num>(
        &self,
        mut acc: CudaViewMut<'_, X>,
        x: CudaView<'_, X>,
    ) -> Result<(), Error> {
        Ok(k::layers::residual_accumulate(&self.dev, &mut acc, &x)?)
    }
    fn scale<X: Num>(&self, mut x: CudaViewMut<'_, X>, s: f32) -> Result<(), Error> {
        Ok(k::layers::scale(&self.dev, &mut x, s)?)
    }
    fn crossentropy_forward(
        &self,
        mut losses: CudaViewMut<'_, f32>,
        mut logits: CudaViewMut<'_, f32>,
        targets: CudaView<'_, u32>,
        v: usize,
        dloss: Option<f32>,
    ) -> Result<(), Error> {
        Ok(k::layers::crossentropy_forward(
            &self.dev,
            &mut losses,
            &mut logits,
            &targets,
            v,
            dloss,
        )?)
    }

    fn nf4_quantize<X: Num>(
        &self,
        mut codes: CudaViewMut<'_, u8>,
        mut absmax: CudaViewMut<'_, u8>,
        src: CudaView<'_, X>,
    ) -> Result<(), Error> {
        let blocks = absmax.len() / size_of::<f32>();
        // SAFETY: any bytes are an f32's; the view starts 4-byte aligned (the caller's layout).
        let mut absmax = unsafe { absmax.transmute_mut::<f32>(blocks) }.expect("the same bytes");
        Ok(k::nf4::quantize(&self.dev, &mut codes, &mut absmax, &src)?)
    }
    fn nf4_dequantize<X: Num>(
        &self,
        mut out: CudaViewMut<'_, X>,
        codes: CudaView<'_, u8>,
        absmax: CudaView<'_, u8>,
    ) -> Result<(), Error> {
        let blocks = absmax.len() / size_of::<f32>();
        // SAFETY: as in `nf4_quantize`.
        let absmax = unsafe { absmax.transmute::<f32>(blocks) }.expect("the same bytes");
        Ok(k::nf4::dequantize(&self.dev, &mut out, &codes, &absmax)?)
    }

    fn sum_squares<X: Num>(&self, x: CudaView<'_, X>) -> Result<f64, Error> {
        let mut s = self.scratch();
        let Scratch { total, parts, .. } = &mut *s;
        k::grad_norm::sum_squares(
            &self.dev,
            &mut total.as_view_mut(),
            &mut parts.as_view_mut(),
            &x,
        )?;
        Ok(self.dev.download(total)?[0])
    }

    fn decay(&self, mut master: CudaViewMut<'_, f32>, factor: f32) -> Result<(), Error> {
        Ok(k::optim::decay(&self.dev, &mut master, factor)?)
    }
    fn sgd_step<X: Num>(
        &self,
        mut master: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        mut param_out: Option<CudaViewMut<'_, X>>,
        lr: f32,
        grad_scale: f32,
        decay: f32,
    ) -> Result<(), Error> {
        Ok(k::optim::sgd_step(
            &self.dev,
            &mut master,
            &grad,
            opt(&mut param_out),
            lr,
            grad_scale,
            decay,
        )?)
    }
    fn momentum_step<X: Num>(
        &self,
        mut master: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        mut buf: CudaViewMut<'_, f32>,
        mut param_out: Option<CudaViewMut<'_, X>>,
        hp: &Momentum,
        grad_scale: f32,
        decay: f32,
    ) -> Result<(), Error> {
        Ok(k::optim::momentum_step(
            &self.dev,
            &mut master,
            &grad,
            &mut buf,
            opt(&mut param_out),
            hp,
            grad_scale,
            decay,
        )?)
    }
    fn lion_step<X: Num>(
        &self,
        mut master: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        mut m: CudaViewMut<'_, f32>,
        mut param_out: Option<CudaViewMut<'_, X>>,
        hp: &Lion,
        grad_scale: f32,
        decay: f32,
    ) -> Result<(), Error> {
        Ok(k::optim::lion_step(
            &self.dev,
            &mut master,
            &grad,
            &mut m,
            opt(&mut param_out),
            hp,
            grad_scale,
            decay,
        )?)
    }
    fn adamw_step<X: Num>(
        &self,
        mut master: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        mut m: CudaViewMut<'_, f32>,
        mut v: CudaViewMut<'_, f32>,
        mut param_out: Option<CudaViewMut<'_, X>>,
        hp: &AdamW,
        step: u64,
        grad_scale: f32,
        decay: f32,
    ) -> Result<(), Error> {
        Ok(k::optim::adamw_step(
            &self.dev,
            &mut master,
            &grad,
            &mut m,
            &mut v,
            opt(&mut param_out),
            hp,
            step,
            grad_scale,
            decay,
        )?)
    }
    fn adam8bit_step<X: Num>(
        &self,
        mut master: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        s: Adam8bitState<'_, Self>,
        mut param_out: Option<CudaViewMut<'_, X>>,
        hp: &AdamW,
        step: u64,
        grad_scale: f32,
        block: usize,
    ) -> Result<(), Error> {
        let Adam8bitState {
            mut m,
            mut v,
            mut absmax_m,
            mut absmax_v,
        } = s;
        Ok(k::optim::adam8bit_step(
            &self.dev,
            &mut master,
            &grad,
            &mut m,
            &mut v,
            &mut absmax_m,
            &mut absmax_v,
            opt(&mut param_out),
            &self.codes,
            hp,
            step,
            grad_scale,
            block,
        )?)
    }
    fn adafactor_sq_sums<X: Num>(
        &self,
        grad: CudaView<'_, X>,
        start: usize,
        grad_scale: f32,
        hp: &Adafactor,
        mut row_sums: CudaViewMut<'_, f64>,
        mut col_sums: CudaViewMut<'_, f64>,
    ) -> Result<(), Error> {
        Ok(k::optim::adafactor_sq_sums(
            &self.dev,
            &grad,
            start,
            grad_scale,
            hp,
            &mut row_sums,
            &mut col_sums,
        )?)
    }
    fn adafactor_update_stats(
        &self,
        mut row: CudaViewMut<'_, f32>,
        mut col: CudaViewMut<'_, f32>,
        row_sums: CudaView<'_, f64>,
        col_sums: CudaView<'_, f64>,
        hp: &Adafactor,
        step: u64,
    ) -> Result<(), Error> {
        Ok(k::optim::adafactor_update_stats(
            &self.dev, &mut row, &mut col, &row_sums, &col_sums, hp, step,
        )?)
    }
    fn adafactor_vector_ema<X: Num>(
        &self,
        mut v: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        grad_scale: f32,
        hp: &Adafactor,
        step: u64,
        mut rms_sum: CudaViewMut<'_, f64>,
    ) -> Result<(), Error> {
        Ok(k::optim::adafactor_vector_ema(
            &self.dev,
            &mut v,
            &grad,
            grad_scale,
            hp,
            step,
            &mut rms_sum,
        )?)
    }
    fn adafactor_rms_sum<X: Num>(
        &self,
        grad: CudaView<'_, X>,
        grad_scale: f32,
        moment: Moment<'_, Self>,
        mut rms_sum: CudaViewMut<'_, f64>,
    ) -> Result<(), Error> {
        let Moment::Factored { row, col, start } = moment else {
            unreachable!("vectors add their Σ u² in adafactor_vector_ema")
        };
        let mut s = self.scratch();
        Ok(k::optim::adafactor_rms_sum(
            &self.dev,
            &grad,
            grad_scale,
            &row,
            &col,
            &mut s.row_mean.as_view_mut(),
            start,
            &mut rms_sum,
        )?)
    }
    fn adafactor_apply<X: Num>(
        &self,
        mut master: CudaViewMut<'_, f32>,
        grad: CudaView<'_, X>,
        mut exp_avg: Option<CudaViewMut<'_, f32>>,
        mut param_out: Option<CudaViewMut<'_, X>>,
        moment: Moment<'_, Self>,
        rms_sum: CudaView<'_, f64>,
        hp: &Adafactor,
        grad_scale: f32,
    ) -> Result<(), Error> {
        let mut s = self.scratch();
        let mut row_mean = s.row_mean.as_view_mut();
        let (row, col, v);
        let moment = match moment {
            Moment::Factored {
                row: r,
                col: c,
                start,
            } => {
                (row, col) = (r, c);
                k::optim::Moment::Factored {
                    row: &row,
                    col: &col,
                    row_mean: &mut row_mean,
                    start,
                }
            }
            Moment::Full { v: full, numel } => {
                v = full;
                k::optim::Moment::Full { v: &v, numel }
            }
        };
        Ok(k::optim::adafactor_apply(
            &self.dev,
            &mut master,
            &grad,
            opt(&mut exp_avg),
            opt(&mut param_out),
            moment,
            &rms_sum,
            hp,
            grad_scale,
        )?)
    }
}
