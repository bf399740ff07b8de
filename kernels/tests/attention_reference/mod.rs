//! The f64 expectations of the tiled attention kernels, for the tests that run them (the CUDA
//! kernels on the CPU shim, `cuda_on_cpu.rs`, and on the GPU, `cuda_parity.rs`): out, lse,
//! delta, dq, dk, dv as the contract defines them, from `kernels::reference`'s materialising
//! f64 attention.
#![allow(dead_code)] // each test binary uses a different subset

use kernels::Float;
use kernels::attention::AttentionDims;
use kernels::reference;

use crate::common::{Rng, rounded, rtol};

/// The outputs checked, in the order of [`AttentionCase::expected`] and [`tolerances`].
pub const OUTPUTS: [&str; 6] = ["out", "lse", "delta", "dq", "dk", "dv"];

/// Relative tolerances of [`OUTPUTS`]: lse and delta are f32 sums over exact inputs, the rest
/// are stored as X.
pub fn tolerances<X: Float>() -> [f64; 6] {
    let x = rtol::<X>();
    [x, 1e-5, 1e-5, x, x, x]
}

/// The inputs of one call, as the exact values of X: `q`, `dout (B, T, NH·hs)`, `k`,
/// `v (B, T, KV·hs)`.
pub struct AttentionCase {
    pub d: AttentionDims,
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub dout: Vec<f64>,
}

impl AttentionCase {
    /// Random inputs; queries and keys of ±2, for a sharper softmax whose running max moves.
    pub fn new<X: Float>(d: AttentionDims, seed: u64) -> AttentionCase {
        let mut rng = Rng::new(seed);
        let (qn, kn) = (d.b * d.t * d.q_width(), d.b * d.t * d.kv_width());
        AttentionCase {
            d,
            q: rounded::<X>(&rng.vec(qn, 2.0)),
            k: rounded::<X>(&rng.vec(kn, 2.0)),
            v: rounded::<X>(&rng.vec(kn, 1.0)),
            dout: rounded::<X>(&rng.vec(qn, 1.0)),
        }
    }

    /// The expected [`OUTPUTS`], the backward's for the `out` the forward stored (as f64).
    pub fn expected(&self, stored_out: &[f64]) -> [Vec<f64>; 6] {
        let AttentionCase { d, q, k, v, dout } = self;
        let (out, att) = reference::gqa_attention_forward(q, k, v, *d);
        let (dq, dk, dv) = reference::gqa_attention_backward(dout, q, k, v, &att, stored_out, *d);
        let lse = reference::gqa_attention_lse(q, k, *d);
        [out, lse, reference_delta(dout, stored_out, *d), dq, dk, dv]
    }
}

/// The packed `(B, T, 3C)` of `q`, `k`, `v (B, T, C)`: rows `[q | k | v]`.
pub fn pack<T: Copy>(q: &[T], k: &[T], v: &[T], c: usize) -> Vec<T> {
    q.chunks(c)
        .zip(k.chunks(c))
        .zip(v.chunks(c))
        .flat_map(|((q, k), v)| [q, k, v].concat())
        .collect()
}

/// `q`, `k`, `v (B, T, C)` of a packed `(B, T, 3C)`.
pub fn unpack<T: Copy>(qkv: &[T], c: usize) -> [Vec<T>; 3] {
    [0, 1, 2].map(|p| {
        qkv.chunks(3 * c)
            .flat_map(|row| &row[p * c..(p + 1) * c])
            .copied()
            .collect()
    })
}

/// `delta (B, NH, T)`: `Σ_j dout·out` per query row, in f64.
fn reference_delta(dout: &[f64], out: &[f64], d: AttentionDims) -> Vec<f64> {
    let hs = d.head_size;
    let mut delta = vec![0.0; d.b * d.nh * d.t];
    for (i, (dy, o)) in dout.chunks(hs).zip(out.chunks(hs)).enumerate() {
        let (bt, h) = (i / d.nh, i % d.nh);
        let (b, t) = (bt / d.t, bt % d.t);
        delta[(b * d.nh + h) * d.t + t] = dy.iter().zip(o).map(|(a, b)| a * b).sum();
    }
    delta
}
