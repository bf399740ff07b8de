//! Dropout on LoRA adapters' input (PEFT's `lora_dropout`, `nn.Dropout` in training), with a
//! mask nobody stores: element `i` of a tensor is dropped when a counter-based hash of the
//! mask's key and of `offset + i` falls below `p`, and kept elements are scaled by `1/(1 − p)`.
//! Drawn again from the same [`Mask`], backward reads forward's mask; `dropout.cu` hashes
//! alike, so every device draws the same one.

use crate::Float;
use crate::math::BLOCK;
use crate::par::{SharedMut, for_ranges};

const CHUNK: usize = 1 << 14;

/// Which elements a dropout keeps: those whose draw is at least `p`. Element `i` of the tensor
/// is the mask's element `offset + i`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mask {
    pub p: f32,
    pub key: u64,
    pub offset: u64,
}

/// splitmix64's output function: a bijection of u64 that mixes every bit into every other.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Mask {
    /// The draw of element `i`, uniform in [0, 1) in steps of 2⁻²⁴ (exact in f32): the
    /// `offset + i`-th output of splitmix64 seeded with the key.
    pub fn draw(&self, i: usize) -> f32 {
        const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
        let counter = self.offset.wrapping_add(i as u64).wrapping_add(1);
        let h = mix(self.key.wrapping_add(counter.wrapping_mul(GAMMA)));
        (h >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// What a kept element is multiplied by.
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// `x[i]` dropped or scaled, for the elements of `x` at `start..` of the tensor.
    fn apply(&self, x: &mut [f32], start: usize) {
        let scale = self.scale();
        for (i, v) in x.iter_mut().enumerate() {
            *v = if self.draw(start + i) < self.p {
                0.0
            } else {
                *v * scale
            };
        }
    }
}

/// `out = dropout(inp)`, any shape.
pub fn dropout_forward<X: Float>(out: &mut [X], inp: &[X], mask: Mask) {
    assert_eq!(out.len(), inp.len(), "out and inp must have the same shape");
    let out = SharedMut::new(out);
    for_ranges(inp.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let out = unsafe { out.slice(r.clone()) };
        let mut x = [0f32; BLOCK];
        for (b, (o, i)) in out
            .chunks_mut(BLOCK)
            .zip(inp[r.clone()].chunks(BLOCK))
            .enumerate()
        {
            let n = o.len();
            X::cast_to_f32(i, &mut x[..n]);
            mask.apply(&mut x[..n], r.start + b * BLOCK);
            X::cast_from_f32(&x[..n], o);
        }
    });
}

/// Backward of [`dropout_forward`] with the same mask: `dinp += dropout(dout)`, any shape.
pub fn dropout_backward<X: Float>(dinp: &mut [X], dout: &[X], mask: Mask) {
    assert_eq!(
        dinp.len(),
        dout.len(),
        "dinp and dout must have the same shape"
    );
    let dinp = SharedMut::new(dinp);
    for_ranges(dout.len(), CHUNK, |r| {
        // SAFETY: ranges are disjoint.
        let dinp = unsafe { dinp.slice(r.clone()) };
        let (mut acc, mut g) = ([0f32; BLOCK], [0f32; BLOCK]);
        let blocks = dinp.chunks_mut(BLOCK).zip(dout[r.clone()].chunks(BLOCK));
        for (b, (d, o)) in blocks.enumerate() {
            let n = d.len();
            X::cast_to_f32(d, &mut acc[..n]);
            X::cast_to_f32(o, &mut g[..n]);
            mask.apply(&mut g[..n], r.start + b * BLOCK);
            acc[..n].iter_mut().zip(&g[..n]).for_each(|(a, g)| *a += g);
            X::cast_from_f32(&acc[..n], d);
        }
    });
}
