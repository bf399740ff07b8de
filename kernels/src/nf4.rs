//! 4-bit NormalFloat (NF4), QLoRA's storage of frozen weights, exactly as bitsandbytes 0.50
//! stores it (`bitsandbytes.functional.quantize_4bit(x, blocksize=64, quant_type="nf4")` on
//! CPU): values in blocks of [`BLOCK`], each with its fp32 absmax; each value scaled into
//! [-1, 1] and given the index of the nearest of 16 codes ([`CODE`]), two indices to a byte,
//! the even value's in the high nibble. Dequantization is `CODE[q]·absmax` in fp32, rounded
//! once to the output's dtype. Both are bit-identical to bitsandbytes (the committed reference
//! tensors in `tests/reference/nf4`), including its quirks: a full block is multiplied by the
//! reciprocal of its absmax and a short last block divided by it; a tie between two codes goes
//! to the lower; an odd count is padded with a zero, which is code 7.

use crate::Float;
use crate::par::{SharedMut, for_ranges};

/// Values per absmax.
pub const BLOCK: usize = 64;

/// The NF4 codes (quantiles of N(0, 1) scaled to [-1, 1]), as bitsandbytes' `get_4bit_type("nf4")`.
#[allow(clippy::excessive_precision)]
pub const CODE: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// The index of code 0.0: what zeros, and the padding of an odd count, quantize to.
const ZERO: u8 = 7;

/// What bitsandbytes clamps a short last block's absmax to (and stores).
const TINY_ABSMAX: f32 = 1e-38;

/// Blocks per task: whole blocks, an even number of values, so tasks own whole bytes.
const BLOCKS_PER_TASK: usize = 256;

/// Bytes of codes for `n` values.
pub fn code_bytes(n: usize) -> usize {
    n.div_ceil(2)
}

/// Absmax values for `n` values.
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// Panics unless `codes` and `absmax` hold `n` values' NF4 form.
pub(crate) fn check_lens(n: usize, codes: usize, absmax: usize) {
    assert_eq!(codes, code_bytes(n), "codes must hold two values a byte");
    assert_eq!(absmax, blocks(n), "absmax must hold one value a block");
}

/// The code index of a value already scaled into [-1, 1]: how many midpoints between adjacent
/// codes lie strictly below it (`torch.bucketize`, `right=False`).
fn index(scaled: f32) -> u8 {
    let mut q = 0;
    for pair in CODE.windows(2) {
        q += u8::from((pair[0] + pair[1]) / 2.0 < scaled);
    }
    q
}

/// Quantizes `src` into `codes` (`code_bytes(src.len())`) and `absmax`
/// (`blocks(src.len())`).
pub fn quantize<X: Float>(src: &[X], codes: &mut [u8], absmax: &mut [f32]) {
    let n = src.len();
    check_lens(n, codes.len(), absmax.len());
    let count = absmax.len();
    let (codes, absmax) = (SharedMut::new(codes), SharedMut::new(absmax));
    for_ranges(count, BLOCKS_PER_TASK, |blocks| {
        let values = blocks.start * BLOCK..(blocks.end * BLOCK).min(n);
        // SAFETY: tasks own disjoint blocks, hence disjoint bytes (blocks hold an even count).
        let codes = unsafe { codes.slice(values.start / 2..values.end.div_ceil(2)) };
        let absmax = unsafe { absmax.slice(blocks) };
        let src = &src[values];
        let mut x = [0f32; BLOCK];
        for ((block, codes), absmax) in src
            .chunks(BLOCK)
            .zip(codes.chunks_mut(BLOCK / 2))
            .zip(absmax.iter_mut())
        {
            let x = &mut x[..block.len()];
            X::cast_to_f32(block, x);
            *absmax = quantize_block(x, codes);
        }
    });
}

/// One block's codes (its values scaled in place), and the absmax bitsandbytes stores for it.
fn quantize_block(x: &mut [f32], codes: &mut [u8]) -> f32 {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let full = x.len() == BLOCK;
    if max == 0.0 {
        // Decided here rather than by dividing by the tiny clamp, which flush-to-zero threads
        // would read as 0.
        codes.fill(ZERO << 4 | ZERO);
        return if full { 0.0 } else { TINY_ABSMAX };
    }
    if full {
        let inverse = 1.0 / max;
        x.iter_mut().for_each(|v| *v *= inverse);
    } else {
        x.iter_mut().for_each(|v| *v /= max);
    }
    for (byte, pair) in codes.iter_mut().zip(x.chunks(2)) {
        let high = index(pair[0].clamp(-1.0, 1.0));
        let low = pair.get(1).map_or(ZERO, |v| index(v.clamp(-1.0, 1.0)));
        *byte = high << 4 | low;
    }
    max
}

/// `out[i] = CODE[q_i]·absmax[i / BLOCK]`, rounded once to `X`.
pub fn dequantize<X: Float>(codes: &[u8], absmax: &[f32], out: &mut [X]) {
    let n = out.len();
    check_lens(n, codes.len(), absmax.len());
    let out = SharedMut::new(out);
    for_ranges(absmax.len(), BLOCKS_PER_TASK, |blocks| {
        let values = blocks.start * BLOCK..(blocks.end * BLOCK).min(n);
        let codes = &codes[values.start / 2..values.end.div_ceil(2)];
        // SAFETY: tasks own disjoint blocks.
        let out = unsafe { out.slice(values) };
        let mut x = [0f32; BLOCK];
        for ((out, codes), &scale) in out
            .chunks_mut(BLOCK)
            .zip(codes.chunks(BLOCK / 2))
            .zip(&absmax[blocks])
        {
            let x = &mut x[..out.len()];
            for (pair, byte) in x.chunks_mut(2).zip(codes) {
                pair[0] = CODE[usize::from(byte >> 4)] * scale;
                if let Some(low) = pair.get_mut(1) {
                    *low = CODE[usize::from(byte & 0xf)] * scale;
                }
            }
            X::cast_from_f32(x, out);
        }
    });
}
