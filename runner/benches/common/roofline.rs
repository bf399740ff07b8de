//! The roofline of a training step: the products it runs (each linear layer forward and
//! backward, and the LM head over its chunks of rows), each timed alone on the kernels the
//! trainer calls, in the step's dtype, so that a step's time can be set beside the time its
//! products take at the rate this machine gives those shapes.

use std::time::Instant;

use kernels::Float;
use kernels::matmul::{self, DinpMode, Layout};
use scheduler::model::{ModelShape, loss_chunk_rows, matmul_scratch_f32};

/// One linear layer `(M, K) · (N, K)ᵀ` of a step, and how many times a step runs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Product {
    pub mkn: (usize, usize, usize),
    pub count: usize,
}

impl Product {
    /// FLOPs of one forward (2MKN) and one backward (4MKN: dinp and dweight).
    fn flops(&self) -> f64 {
        let (m, k, n) = self.mkn;
        6.0 * (m * k * n) as f64
    }
}

/// The products of one micro-batch of `b` × `t` tokens (no activation checkpointing).
pub fn products(model: &ModelShape, b: usize, t: usize) -> Vec<Product> {
    let s = model.summary();
    let (tokens, c, l) = (b * t, s.hidden_size, s.layers);
    let (q, kv, i) = (
        s.attention_heads * s.head_dim,
        s.key_value_heads * s.head_dim,
        s.intermediate_size,
    );
    let layer = |k: usize, n: usize, per_layer: usize| Product {
        mkn: (tokens, k, n),
        count: l * per_layer,
    };
    let mut out = match model {
        ModelShape::Gpt2(_) => vec![
            layer(c, 3 * c, 1),
            layer(c, c, 1),
            layer(c, 4 * c, 1),
            layer(4 * c, c, 1),
        ],
        ModelShape::Llama(_) => vec![
            layer(c, q, 1),
            layer(c, kv, 2),
            layer(q, c, 1),
            layer(c, i, 2),
            layer(i, c, 1),
        ],
    };
    let rows = loss_chunk_rows(tokens, s.vocab_size);
    let (whole, rest) = (tokens / rows, tokens % rows);
    out.push(Product {
        mkn: (rows, c, s.vocab_size),
        count: whole,
    });
    if rest > 0 {
        out.push(Product {
            mkn: (rest, c, s.vocab_size),
            count: 1,
        });
    }
    out
}

/// Seconds a step's `products` take in `X` (each timed alone, forward and backward, the median
/// of `runs`, times its count) and the GFLOP/s that makes.
pub fn seconds<X: Float>(products: &[Product], runs: usize) -> (f64, f64) {
    let mut total = 0.0;
    let mut flops = 0.0;
    for p in products {
        total += p.count as f64 * once::<X>(p.mkn, runs);
        flops += p.count as f64 * p.flops();
    }
    (total, flops / total / 1e9)
}

/// Median seconds of one forward and backward of `(m, k, n)` in `X`, as the trainer's linear
/// layers call them (NK weights, dinp overwritten, dweight added to).
fn once<X: Float>((m, k, n): (usize, usize, usize), runs: usize) -> f64 {
    let fill = |len: usize, step: usize| -> Vec<X> {
        (0..len)
            .map(|j| X::from_f32(((j * step) % 17) as f32 / 17.0 - 0.5))
            .collect()
    };
    let (x, w, dy) = (fill(m * k, 5), fill(n * k, 7), fill(m * n, 3));
    let (mut y, mut dx, mut dw) = (
        vec![X::ZERO; m * n],
        vec![X::ZERO; m * k],
        vec![X::ZERO; n * k],
    );
    // As the trainer holds it: the widening tiles, or the bf16 packs of a product this deep.
    let mut scratch = vec![0f32; matmul_scratch_f32(m.max(k).max(n))];
    let mut times: Vec<f64> = (0..runs + 1)
        .map(|_| {
            let start = Instant::now();
            matmul::matmul_forward(&mut y, &x, &w, None, Layout::NK, (m, k, n), &mut scratch);
            matmul::matmul_backward(
                &mut dx,
                &mut dw,
                None,
                &dy,
                &x,
                &w,
                Layout::NK,
                (m, k, n),
                DinpMode::Overwrite,
                &mut scratch,
            );
            start.elapsed().as_secs_f64()
        })
        .skip(1)
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// GFLOP/s of a 2048³ forward product in `X` (the median of 5), as
/// `kernels::matmul::measure_peak_gflops` measures f32.
pub fn square_gflops<X: Float>() -> f64 {
    const S: usize = 2048;
    let seconds = once::<X>((S, S, S), 5);
    // `once` times a forward and a backward: three products of 2·S³ each.
    6.0 * (S * S * S) as f64 / seconds / 1e9
}

/// Which engine runs products of two bf16 operands here.
pub fn bf16_engine() -> &'static str {
    if matmul::has_bf16_tiles() {
        "AMX tiles"
    } else if matmul::has_bf16_dot_product() {
        "vdpbf16ps"
    } else {
        "widened to f32"
    }
}
