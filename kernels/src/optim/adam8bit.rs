//! Block-wise 8-bit Adam (bitsandbytes `Adam8bit` semantics).
//!
//! `m` and `v` are stored as one byte per element: an index into bitsandbytes' dynamic
//! quantisation map (signed for `m`, unsigned for `v`) scaled by a per-block f32 absmax.
//! Blocks are counted from the start of the slice given, so a ZeRO shard whose start is a
//! multiple of the block size quantises exactly like the whole buffer. Zeroed bytes and
//! absmax are the initial (all-zero) state.

use super::{AdamW, bias_correction};
use crate::Float;
use crate::par::{SharedMut, for_ranges};

/// bitsandbytes' default block size.
pub const DEFAULT_BLOCK: usize = 2048;

/// Number of absmax entries for `n` elements in blocks of `block`.
pub fn adam8bit_blocks(n: usize, block: usize) -> usize {
    n.div_ceil(block)
}

/// One Adam step (`t ≥ 1`) on quantised states: dequantise, update in f32 as
/// [`super::adamw_step`], step the parameters with the unquantised new states, requantise
/// each block against its new absmax (nearest code). `m, v (N)` bytes,
/// `absmax_m, absmax_v (ceil(N / block))`.
#[allow(clippy::too_many_arguments)]
pub fn adam8bit_step<G: Float, X: Float>(
    master: &mut [f32],
    grad: &[G],
    m: &mut [u8],
    v: &mut [u8],
    absmax_m: &mut [f32],
    absmax_v: &mut [f32],
    param_out: Option<&mut [X]>,
    hp: &AdamW,
    step: u64,
    grad_scale: f32,
    block: usize,
) {
    let n = master.len();
    assert!(block > 0, "block size must be positive");
    assert!(
        grad.len() == n && m.len() == n && v.len() == n,
        "grad, m, v must match master"
    );
    let blocks = adam8bit_blocks(n, block);
    assert!(
        absmax_m.len() == blocks && absmax_v.len() == blocks,
        "absmax must hold one f32 per block"
    );
    if let Some(p) = &param_out {
        assert_eq!(p.len(), n, "param_out must match master");
    }
    let (code_m, code_v) = (dynamic_map(true), dynamic_map(false));
    let AdamW {
        lr,
        beta1,
        beta2,
        eps,
    } = *hp;
    let (step_size, bc2_sqrt) = bias_correction(lr, beta1, beta2, step);
    let (eps_hat, step_size) = (eps * bc2_sqrt, step_size * bc2_sqrt);
    let (pm, qm, qv) = (SharedMut::new(master), SharedMut::new(m), SharedMut::new(v));
    let (am, av) = (SharedMut::new(absmax_m), SharedMut::new(absmax_v));
    let out = param_out.map(SharedMut::new);
    for_ranges(n, block, |r| {
        let b = r.start / block;
        // SAFETY: each task owns one block of every buffer and its absmax entries.
        let (p, m, v) = unsafe {
            (
                pm.slice(r.clone()),
                qm.slice(r.clone()),
                qv.slice(r.clone()),
            )
        };
        let (am, av) = unsafe { (&mut am.slice(b..b + 1)[0], &mut av.slice(b..b + 1)[0]) };
        let (old_m, old_v) = (*am, *av);
        let new = |i: usize, qm: u8, qv: u8| {
            let g = grad[r.start + i].to_f32() * grad_scale;
            let s1 = beta1 * (code_m[qm as usize] * old_m) + (1.0 - beta1) * g;
            let s2 = beta2 * (code_v[qv as usize] * old_v) + (1.0 - beta2) * g * g;
            (s1, s2)
        };
        // The new states are recomputed rather than stored: no per-block buffer.
        let (mut max1, mut max2) = (0f32, 0f32);
        for i in 0..r.len() {
            let (s1, s2) = new(i, m[i], v[i]);
            (max1, max2) = (max1.max(s1.abs()), max2.max(s2));
        }
        for i in 0..r.len() {
            let (s1, s2) = new(i, m[i], v[i]);
            p[i] -= step_size * s1 / (s2.sqrt() + eps_hat);
            m[i] = quantize(&code_m, if max1 > 0.0 { s1 / max1 } else { 0.0 });
            v[i] = quantize(&code_v, if max2 > 0.0 { s2 / max2 } else { 0.0 });
        }
        (*am, *av) = (max1, max2);
        if let Some(out) = &out {
            // SAFETY: as above.
            X::cast_from_f32(p, unsafe { out.slice(r.clone()) });
        }
    });
}

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: for each
/// decade `10^(i-6)`, i < 7, the midpoints of `linspace(0.1, 1, 2^i + 1)` (signed, both
/// signs) or `linspace(0.1, 1, 2^(i+1) + 1)` (unsigned), plus 0 and 1; sorted.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut code = [0f32; 256];
    let mut k = 0;
    for i in 0..7 {
        let n = if signed {
            (1 << i) + 1
        } else {
            (1 << (i + 1)) + 1
        };
        let scale = 10f64.powi(i - 6);
        let edge = |j: usize| 0.1 + 0.9 * j as f64 / (n - 1) as f64;
        for j in 0..n - 1 {
            let mean = ((edge(j) + edge(j + 1)) / 2.0 * scale) as f32;
            code[k] = mean;
            k += 1;
            if signed {
                code[k] = -mean;
                k += 1;
            }
        }
    }
    code[k] = 1.0; // and code[k + 1] stays 0
    debug_assert_eq!(k + 2, 256);
    code.sort_by(f32::total_cmp);
    code
}

/// Index of the code nearest to `x` (ties to the upper code, as bitsandbytes).
fn quantize(code: &[f32; 256], x: f32) -> u8 {
    let i = code.partition_point(|&c| c < x);
    match i {
        0 => 0,
        256 => 255,
        _ if x - code[i - 1] < code[i] - x => (i - 1) as u8,
        _ => i as u8,
    }
}
