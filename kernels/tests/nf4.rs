//! NF4 quantization and dequantization against what bitsandbytes 0.50.0 stores and returns for
//! the same inputs (`tests/reference/nf4`, made by its `make.py`): bit for bit.

use half::{bf16, f16};
use kernels::Float;
use kernels::nf4::{self, blocks, code_bytes};
use safetensors::{Dtype, SafeTensors};

const CASES: [&str; 6] = [
    "bf16_weight",
    "bf16_ragged",
    "fp16_wide",
    "fp32_ties",
    "fp32_odd",
    "fp32_short",
];

fn reference() -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/reference/nf4/nf4.safetensors"
    );
    std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn bytes<'a>(file: &'a SafeTensors<'_>, name: &str) -> &'a [u8] {
    file.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
}

fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Quantizes and dequantizes case `name` (its tensors read as `X` by `read`) and compares both
/// with bitsandbytes' bytes.
fn check<X: Float>(file: &SafeTensors<'_>, name: &str, read: impl Fn(&[u8]) -> Vec<X>) {
    let input = read(bytes(file, &format!("{name}.input")));
    let want_codes = bytes(file, &format!("{name}.codes")).to_vec();
    let want_absmax = f32s(bytes(file, &format!("{name}.absmax")));
    let want_back = read(bytes(file, &format!("{name}.dequantized")));
    let n = input.len();

    let mut codes = vec![0u8; code_bytes(n)];
    let mut absmax = vec![f32::NAN; blocks(n)];
    nf4::quantize(&input, &mut codes, &mut absmax);
    assert_eq!(codes, want_codes, "{name}: codes");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&absmax), bits(&want_absmax), "{name}: absmax");

    let mut back = vec![X::from_f32(f32::NAN); n];
    nf4::dequantize(&want_codes, &want_absmax, &mut back);
    let mismatches = back
        .iter()
        .zip(&want_back)
        .filter(|(a, b)| a.to_f32().to_bits() != b.to_f32().to_bits())
        .count();
    assert_eq!(
        mismatches, 0,
        "{name}: dequantized values differ from bitsandbytes'"
    );
}

#[test]
fn quantization_and_dequantization_are_bitsandbytes_bit_for_bit() {
    let bytes = reference();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    for name in CASES {
        match file.tensor(&format!("{name}.input")).unwrap().dtype() {
            Dtype::BF16 => check(&file, name, |b| {
                u16s(b).into_iter().map(bf16::from_bits).collect()
            }),
            Dtype::F16 => check(&file, name, |b| {
                u16s(b).into_iter().map(f16::from_bits).collect()
            }),
            Dtype::F32 => check(&file, name, f32s),
            other => panic!("{name}: unexpected dtype {other:?}"),
        }
    }
}

#[test]
fn codes_round_trip_to_the_nearest_code() {
    // Every code times a scale comes back as itself: quantization picks the nearest code.
    let scale = 0.25f32;
    let x: Vec<f32> = nf4::CODE
        .iter()
        .map(|c| c * scale)
        .chain([scale; 48])
        .collect();
    let mut codes = vec![0u8; code_bytes(64)];
    let mut absmax = [0f32; 1];
    nf4::quantize(&x, &mut codes, &mut absmax);
    assert_eq!(absmax[0], scale);
    let mut back = vec![0f32; 64];
    nf4::dequantize(&codes, &absmax, &mut back);
    assert_eq!(back, x);
}
