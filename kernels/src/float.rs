//! The compute dtypes and vectorised casts between them and `f32`.
//!
//! Conversions round to nearest even and match `half`'s scalar conversions bit for bit,
//! including NaN (quieted, payload kept), infinities and subnormals. On x86_64 the casts use
//! the vector build [`crate::simd::level`] gives the calling thread: with AVX-512, 16 lanes, bf16
//! by integer rounding (not `vcvtneps2bf16`, which flushes subnormal inputs to zero) and f16 by
//! `vcvtps2ph`/`vcvtph2ps`; with AVX2, bf16 by the same integer rounding in 8 lanes and f16 by
//! `half`'s F16C casts. None reads MXCSR's FTZ/DAZ bits, so casts give the same bits in
//! flushed training threads.

#[cfg(target_arch = "x86_64")]
use crate::simd::{self, Level};
use half::{bf16, f16};
use std::fmt::Debug;

/// A storage dtype for activations, weights copies and gradients.
pub trait Float: Copy + Send + Sync + Default + PartialEq + Debug + 'static {
    const ZERO: Self;
    /// Size in bytes.
    const BYTES: usize;
    /// Short name (`"f32"`, `"f16"`, `"bf16"`).
    const NAME: &'static str;

    fn to_f32(self) -> f32;
    /// Round to nearest even.
    fn from_f32(x: f32) -> Self;
    /// True unless the value is infinite or NaN.
    fn is_finite(self) -> bool;
    /// `Some` when `Self` is `f32`, so kernels can skip a conversion.
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// Mutable counterpart of [`Float::as_f32`].
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    /// `Some` when `Self` is `bf16` (for kernels with bf16 instructions).
    #[inline(always)]
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }
    /// Mutable counterpart of [`Float::as_bf16`].
    #[inline(always)]
    fn as_bf16_mut(_: &mut [Self]) -> Option<&mut [bf16]> {
        None
    }
    /// `dst[i] = src[i] as f32`; lengths must match.
    fn cast_to_f32(src: &[Self], dst: &mut [f32]);
    /// `dst[i] = round(src[i])`; lengths must match.
    fn cast_from_f32(src: &[f32], dst: &mut [Self]);
}

/// Widen a slice to `f32` (`src.len() == dst.len()`).
pub fn to_f32<X: Float>(src: &[X], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "cast length mismatch");
    X::cast_to_f32(src, dst);
}

/// Round a slice of `f32` to `X` (`src.len() == dst.len()`).
pub fn from_f32<X: Float>(src: &[f32], dst: &mut [X]) {
    assert_eq!(src.len(), dst.len(), "cast length mismatch");
    X::cast_from_f32(src, dst);
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    const BYTES: usize = 4;
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn cast_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn cast_from_f32(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Float for bf16 {
    const ZERO: Self = bf16::ZERO;
    const BYTES: usize = 2;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        self.to_bits() & 0x7f80 != 0x7f80
    }
    #[inline(always)]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    #[inline(always)]
    fn as_bf16(s: &[Self]) -> Option<&[bf16]> {
        Some(s)
    }
    #[inline(always)]
    fn as_bf16_mut(s: &mut [Self]) -> Option<&mut [bf16]> {
        Some(s)
    }
    fn cast_to_f32(src: &[Self], dst: &mut [f32]) {
        // SAFETY (each arm): the build's CPU features were detected at run time.
        #[cfg(target_arch = "x86_64")]
        match simd::level() {
            Level::Avx512 => return unsafe { x86::bf16_to_f32(src, dst) },
            Level::Avx2 => return unsafe { x86::bf16_to_f32_avx2(src, dst) },
            Level::Baseline => {}
        }
        src.iter().zip(dst).for_each(|(s, d)| *d = s.to_f32());
    }
    fn cast_from_f32(src: &[f32], dst: &mut [Self]) {
        // SAFETY (each arm): the build's CPU features were detected at run time.
        #[cfg(target_arch = "x86_64")]
        match simd::level() {
            Level::Avx512 => return unsafe { x86::f32_to_bf16(src, dst) },
            Level::Avx2 => return unsafe { x86::f32_to_bf16_avx2(src, dst) },
            Level::Baseline => {}
        }
        src.iter()
            .zip(dst)
            .for_each(|(s, d)| *d = bf16::from_f32(*s));
    }
}

impl Float for f16 {
    const ZERO: Self = f16::ZERO;
    const BYTES: usize = 2;
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        self.to_bits() & 0x7c00 != 0x7c00
    }
    #[inline(always)]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    // Below AVX-512, `half`'s slice casts (F16C where the CPU has it).
    fn cast_to_f32(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::level() == Level::Avx512 {
            // SAFETY: the build's CPU features were detected at run time.
            return unsafe { x86::f16_to_f32(src, dst) };
        }
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
    fn cast_from_f32(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if simd::level() == Level::Avx512 {
            // SAFETY: the build's CPU features were detected at run time.
            return unsafe { x86::f32_to_f16(src, dst) };
        }
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= len for both slices; unaligned loads and stores.
            unsafe {
                let x = _mm512_loadu_ps(src.as_ptr().add(i));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), round_to_bf16(x));
            }
        }
        for (s, d) in src[n..].iter().zip(&mut dst[n..]) {
            *d = bf16::from_f32(*s);
        }
    }

    /// 16 f32 rounded to bf16 as `bf16::from_f32` rounds them.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) fn round_to_bf16(x: __m512) -> __m256i {
        let x = _mm512_castps_si512(x);
        let exp_mask = _mm512_set1_epi32(0x7fff_ffff);
        let inf = _mm512_set1_epi32(0x7f80_0000);
        let bias = _mm512_set1_epi32(0x7fff);
        let one = _mm512_set1_epi32(1);
        let quiet = _mm512_set1_epi32(0x40);
        let is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, exp_mask), inf);
        let lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
        let rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(bias, lsb)), 16);
        let nan = _mm512_or_si512(_mm512_srli_epi32(x, 16), quiet);
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan))
    }

    /// 16 bf16 widened as `bf16::to_f32` widens them.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) fn widen_bf16(h: __m256i) -> __m512 {
        let abs = _mm512_set1_epi32(0x7fff);
        let inf = _mm512_set1_epi32(0x7f80);
        let quiet = _mm512_set1_epi32(0x40);
        let h = _mm512_cvtepu16_epi32(h);
        let is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(h, abs), inf);
        let h = _mm512_mask_or_epi32(h, is_nan, h, quiet);
        _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= len for both slices; unaligned loads and stores.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), widen_bf16(h));
            }
        }
        for (s, d) in src[n..].iter().zip(&mut dst[n..]) {
            *d = s.to_f32();
        }
    }

    /// 8 f32 rounded to bf16 as [`round_to_bf16`] rounds them.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn round_to_bf16_avx2(x: __m256) -> __m128i {
        let x = _mm256_castps_si256(x);
        let abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
        // Signed compare: `abs` has its sign bit clear.
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
        let lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
        let rounded = _mm256_srli_epi32(_mm256_add_epi32(x, bias), 16);
        let nan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
        let r = _mm256_blendv_epi8(rounded, nan, is_nan);
        // Each lane holds 16 bits: pack them within the 128-bit halves, then take the low
        // 64 bits of each half.
        let packed = _mm256_packus_epi32(r, r);
        _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b10_00>(packed))
    }

    /// 8 bf16 widened as [`widen_bf16`] widens them.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn widen_bf16_avx2(h: __m128i) -> __m256 {
        let h = _mm256_cvtepu16_epi32(h);
        let abs = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80));
        let h = _mm256_or_si256(h, _mm256_and_si256(is_nan, _mm256_set1_epi32(0x40)));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn f32_to_bf16_avx2(src: &[f32], dst: &mut [bf16]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= len for both slices; unaligned loads and stores.
            unsafe {
                let x = _mm256_loadu_ps(src.as_ptr().add(i));
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), round_to_bf16_avx2(x));
            }
        }
        for (s, d) in src[n..].iter().zip(&mut dst[n..]) {
            *d = bf16::from_f32(*s);
        }
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn bf16_to_f32_avx2(src: &[bf16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= len for both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), widen_bf16_avx2(h));
            }
        }
        for (s, d) in src[n..].iter().zip(&mut dst[n..]) {
            *d = s.to_f32();
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= len for both slices; unaligned loads and stores.
            unsafe {
                let x = _mm512_loadu_ps(src.as_ptr().add(i));
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
            }
        }
        for (s, d) in src[n..].iter().zip(&mut dst[n..]) {
            *d = f16::from_f32(*s);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= len for both slices; unaligned loads and stores.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        for (s, d) in src[n..].iter().zip(&mut dst[n..]) {
            *d = s.to_f32();
        }
    }
}
