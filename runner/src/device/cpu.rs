//! The CPU: buffers are host vectors and every kernel is the `kernels` crate's, called with
//! exactly the slices the trainer passed before the device interface (so bit for bit and
//! call for call the same), inlined away.

use std::ops::Range;

use rayon::prelude::*;

use kernels::attention::AttentionDims;
use kernels::dropout::{self, Mask};
use kernels::matmul::{DinpMode, Layout};
use kernels::optim::{self as k, Adafactor, AdamW, Lion, Momentum};
use kernels::rope::RopeDims;
use kernels::{
    attention, crossentropy, encoder, gelu, grad_norm, layernorm, matmul, nf4, residual,
};
use kernels::{rmsnorm, rope, swiglu};

use super::{Adam8bitState, Device, Elem, Moment, Num};
use scheduler::memory::DeviceKind;

use crate::Error;
use crate::step_timers::{self, Group};

/// A method per entry of `kernels!` that calls the `kernels` function of the same name with the
/// same arguments: the CPU's kernels are those functions, so its methods only forward (and
/// cannot fail). Its views are slices, so the entries' types are the functions' own.
macro_rules! forward {
    ($($(#[$attr:meta])* $module:ident::$name:ident $(<$($g:ident: $bound:ident),+>)? ($($arg:ident: $ty:ty),* $(,)?);)+) => {
        $(
            #[inline]
            fn $name $(<$($g: $bound),+>)? (&self, $($arg: $ty),*) -> Result<(), Error> {
                let group = || Group::of_module(stringify!($module));
                step_timers::time(group, || $module::$name($($arg),*));
                Ok(())
            }
        )+
    };
}

/// Maps `buf`'s whole pages now, writable, in one system call. A zeroed allocation is otherwise
/// mapped on first touch: a read (the optimizer reads its moments before it writes them) maps the
/// shared zero page, and the first write faults again and flushes the other cores' TLBs. In a
/// SmolLM2-135M job that made the first step 3-6 s slower than the next ones (525k faults in
/// its AdamW). Advice only: where the kernel declines (before Linux 5.14), pages are mapped on
/// first touch as before.
#[cfg(target_os = "linux")]
fn make_resident(buf: &mut [u8]) {
    let (start, len) = whole_pages(buf);
    if len > 0 {
        // SAFETY: the range is page-aligned and inside `buf`, which this function borrows
        // exclusively; the advice does not change the bytes there.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
    }
}

/// The whole pages inside `buf`: their first address and their length in bytes (0 if none).
#[cfg(target_os = "linux")]
fn whole_pages(buf: &[u8]) -> (usize, usize) {
    let page = page_size();
    let range = buf.as_ptr_range();
    let start = (range.start as usize).next_multiple_of(page);
    let end = range.end as usize / page * page;
    (start, end.saturating_sub(start))
}

#[cfg(target_os = "linux")]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
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
        #[cfg_attr(not(target_os = "linux"), allow(unused_mut))]
        let mut buf = vec![T::default(); len];
        #[cfg(target_os = "linux")]
        make_resident(bytemuck::cast_slice_mut(&mut buf));
        Ok(buf)
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

    fn fill_zero<T: Elem>(&self, v: &mut [T]) -> Result<(), Error> {
        // One core's stores reach half the memory bandwidth of two (a step's gradients are
        // hundreds of megabytes: docs/benchmarks.md has the figures).
        const BYTES: usize = 1 << 20;
        v.par_chunks_mut(BYTES / size_of::<T>())
            .for_each(|c| c.fill(T::default()));
        Ok(())
    }
    #[inline]
    fn copy<T: Elem>(&self, dst: &mut [T], src: &[T]) -> Result<(), Error> {
        dst.copy_from_slice(src);
        Ok(())
    }

    kernels!(forward);

    #[inline]
    fn sum_squares<X: Num>(&self, x: &[X]) -> Result<f64, Error> {
        Ok(step_timers::time(
            || Group::Optimizer,
            || grad_norm::sum_squares(x),
        ))
    }

    fn nf4_quantize<X: Num>(
        &self,
        codes: &mut [u8],
        absmax: &mut [u8],
        src: &[X],
    ) -> Result<(), Error> {
        let absmax = bytemuck::cast_slice_mut(absmax);
        step_timers::time(|| Group::Products, || nf4::quantize(src, codes, absmax));
        Ok(())
    }
    fn nf4_dequantize<X: Num>(
        &self,
        out: &mut [X],
        codes: &[u8],
        absmax: &[u8],
    ) -> Result<(), Error> {
        let absmax = bytemuck::cast_slice(absmax);
        // Part of the cost of a product through an NF4 weight.
        step_timers::time(|| Group::Products, || nf4::dequantize(codes, absmax, out));
        Ok(())
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
        step_timers::time(
            || Group::Optimizer,
            || {
                k::adam8bit_step(
                    master, grad, m, v, absmax_m, absmax_v, param_out, hp, step, grad_scale, block,
                )
            },
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
        let moment = moment.into();
        step_timers::time(
            || Group::Optimizer,
            || k::adafactor_rms_sum(grad, grad_scale, moment, rms_sum),
        );
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
        let moment = moment.into();
        step_timers::time(
            || Group::Optimizer,
            || {
                k::adafactor_apply(
                    master, grad, exp_avg, param_out, moment, rms_sum, hp, grad_scale,
                )
            },
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Every whole page of a fresh buffer is resident before anything touches it (Linux 5.14
    /// and later), so the optimizer's first read of its moments takes no fault.
    #[test]
    fn zeroed_buffers_are_resident_before_their_first_touch() {
        let buf: Vec<f32> = Cpu.zeros(4 << 20).unwrap();
        let (start, len) = whole_pages(bytemuck::cast_slice(&buf));
        let mut resident = vec![0u8; len / page_size()];
        // SAFETY: the range is page-aligned and mapped (it is inside `buf`); `resident` holds a
        // byte per page.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, resident.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        let missing = resident.iter().filter(|&&r| r & 1 == 0).count();
        assert_eq!(
            missing,
            0,
            "{missing} of {} pages not resident",
            resident.len()
        );
        assert!(buf.iter().all(|&x| x == 0.0));
    }
}
