//! Vectorised casts against `half`'s scalar conversions: every 16-bit pattern, special and
//! random f32 patterns, with and without FTZ/DAZ.

use crate::common;

use common::Rng;
use half::{bf16, f16};
use kernels::float::{from_f32, to_f32};
use kernels::{Float, cpu};

/// f32 inputs covering ties, subnormals (of f32 and of the target), overflow, inf and NaNs.
fn f32_cases() -> Vec<f32> {
    let mut rng = Rng::new(21);
    let mut v: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        1e-40,
        -1e-45,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffc1_2345),
        65504.0,
        65520.0,
        65519.99,
        6e-8,
        3e-8,
        2.9e-8,
        1e-5,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x0001_8000),
    ];
    v.extend((0..200_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
    v
}

fn bits<X: Float>(x: &[X]) -> Vec<u32> {
    x.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn check_from_f32<X: Float>(scalar: impl Fn(f32) -> X) {
    common::note_unexercised_cpu_paths();
    let src = f32_cases();
    let mut got = vec![X::ZERO; src.len()];
    from_f32(&src, &mut got);
    let want: Vec<X> = src.iter().map(|&x| scalar(x)).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.to_f32().to_bits() == w.to_f32().to_bits()
                || (g.to_f32().is_nan() && w.to_f32().is_nan()),
            "{} cast of {:e} ({:#x}): got {g:?}, want {w:?} (index {i})",
            X::NAME,
            src[i],
            src[i].to_bits()
        );
    }
    assert_eq!(bits(&got), bits(&want), "{} cast bits", X::NAME);
}

fn check_to_f32<X: Float>(from_bits: impl Fn(u16) -> X) {
    common::note_unexercised_cpu_paths();
    let src: Vec<X> = (0..=u16::MAX).map(from_bits).collect();
    let mut got = vec![0f32; src.len()];
    to_f32(&src, &mut got);
    let want: Vec<u32> = src.iter().map(|x| x.to_f32().to_bits()).collect();
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want,
        "{} widening",
        X::NAME
    );
}

fn all_casts_match_half() {
    check_from_f32(bf16::from_f32);
    check_from_f32(f16::from_f32);
    check_from_f32(|x: f32| x);
    check_to_f32(bf16::from_bits);
    check_to_f32(f16::from_bits);
}

#[test]
fn casts_round_to_nearest_even_like_half() {
    // On this thread (the best build the CPU has) and on pools capped at each build.
    all_casts_match_half();
    for simd in [cpu::Simd::Avx2, cpu::Simd::Portable] {
        cpu::thread_pool_with(1, simd)
            .unwrap()
            .install(all_casts_match_half);
    }
    // Ties go to even: 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7.
    assert_eq!(bf16::from_f32(1.0 + 2f32.powi(-8)), bf16::ONE);
    let mut out = [bf16::ZERO; 17];
    from_f32(&[1.0 + 3.0 * 2f32.powi(-8); 17], &mut out);
    assert!(out.iter().all(|x| x.to_f32() == 1.0 + 2f32.powi(-6)));
}

/// Bits of every vectorised cast of the test inputs, on the calling thread.
fn vector_cast_bits() -> Vec<Vec<u32>> {
    common::note_unexercised_cpu_paths();
    let src = f32_cases();
    let (mut b, mut h) = (vec![bf16::ZERO; src.len()], vec![f16::ZERO; src.len()]);
    from_f32(&src, &mut b);
    from_f32(&src, &mut h);
    let (wb, wh): (Vec<bf16>, Vec<f16>) = (
        (0..=u16::MAX).map(bf16::from_bits).collect(),
        (0..=u16::MAX).map(f16::from_bits).collect(),
    );
    let (mut ob, mut oh) = (vec![0f32; wb.len()], vec![0f32; wh.len()]);
    to_f32(&wb, &mut ob);
    to_f32(&wh, &mut oh);
    vec![bits(&b), bits(&h), bits(&ob), bits(&oh)]
}

#[test]
fn casts_are_unaffected_by_flushed_denormals() {
    let flushed = std::thread::spawn(|| {
        cpu::flush_denormals();
        assert_eq!(cpu::denormals_flushed(), cfg!(target_arch = "x86_64"));
        vector_cast_bits()
    })
    .join()
    .unwrap();
    assert!(flushed == vector_cast_bits(), "casts changed under FTZ/DAZ");
}

#[test]
fn flush_denormals_only_affects_the_calling_thread() {
    let pool = cpu::thread_pool(2).unwrap();
    let flushed = pool.install(cpu::denormals_flushed);
    assert_eq!(flushed, cfg!(target_arch = "x86_64"));
    assert!(!cpu::denormals_flushed());
}
