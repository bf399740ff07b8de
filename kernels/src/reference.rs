//! Plain f64 implementations of every forward and backward, the ground truth for tests.
//! Shapes and meanings match the optimised kernels; backward functions return fresh gradients
//! (the kernels' accumulate-or-overwrite conventions are the caller's business here).

use crate::attention::AttentionDims;
use crate::matmul::Layout;
use crate::rope::RopeDims;

/// `out (B·T, C) = wte[tokens] + wpe[t]`.
pub fn encoder_forward(tokens: &[u32], wte: &[f64], wpe: &[f64], t: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; tokens.len() * c];
    for (i, &tok) in tokens.iter().enumerate() {
        for j in 0..c {
            out[i * c + j] = wte[tok as usize * c + j] + wpe[(i % t) * c + j];
        }
    }
    out
}

/// `(dwte (V, C), dwpe (T, C))`.
pub fn encoder_backward(
    dout: &[f64],
    tokens: &[u32],
    v: usize,
    t: usize,
    c: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    for (i, &tok) in tokens.iter().enumerate() {
        for j in 0..c {
            dwte[tok as usize * c + j] += dout[i * c + j];
            dwpe[(i % t) * c + j] += dout[i * c + j];
        }
    }
    (dwte, dwpe)
}

/// `(out (N, C), mean (N), rstd (N))`, eps 1e-5.
pub fn layernorm_forward(inp: &[f64], w: &[f64], b: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = w.len();
    let (mut out, mut mean, mut rstd) = (vec![0.0; inp.len()], vec![], vec![]);
    for (x, o) in inp.chunks(c).zip(out.chunks_mut(c)) {
        let m = x.iter().sum::<f64>() / c as f64;
        let var = x.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / c as f64;
        let r = 1.0 / (var + 1e-5).sqrt();
        for j in 0..c {
            o[j] = (x[j] - m) * r * w[j] + b[j];
        }
        mean.push(m);
        rstd.push(r);
    }
    (out, mean, rstd)
}

/// `(dinp (N, C), dweight (C), dbias (C))`.
pub fn layernorm_backward(
    dout: &[f64],
    inp: &[f64],
    w: &[f64],
    mean: &[f64],
    rstd: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let c = w.len();
    let (mut dinp, mut dw, mut db) = (vec![0.0; inp.len()], vec![0.0; c], vec![0.0; c]);
    for (i, (x, dy)) in inp.chunks(c).zip(dout.chunks(c)).enumerate() {
        let norm: Vec<f64> = x.iter().map(|x| (x - mean[i]) * rstd[i]).collect();
        let s1 = (0..c).map(|j| w[j] * dy[j]).sum::<f64>() / c as f64;
        let s2 = (0..c).map(|j| w[j] * dy[j] * norm[j]).sum::<f64>() / c as f64;
        for j in 0..c {
            dw[j] += dy[j] * norm[j];
            db[j] += dy[j];
            dinp[i * c + j] = (w[j] * dy[j] - s1 - norm[j] * s2) * rstd[i];
        }
    }
    (dinp, dw, db)
}

/// `W[k, n]` for either layout.
fn w_at(w: &[f64], layout: Layout, k: usize, n: usize, (kk, nn): (usize, usize)) -> f64 {
    match layout {
        Layout::KN => w[k * nn + n],
        Layout::NK => w[n * kk + k],
    }
}

/// `out (M, N) = inp (M, K) · W + bias`.
pub fn matmul_forward(
    inp: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    layout: Layout,
    (m, k, n): (usize, usize, usize),
) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| inp[i * k + p] * w_at(w, layout, p, j, (k, n)))
                .sum();
            out[i * n + j] = s + bias.map_or(0.0, |b| b[j]);
        }
    }
    out
}

/// `(dinp (M, K), dweight (layout of W), dbias (N))`.
pub fn matmul_backward(
    dout: &[f64],
    inp: &[f64],
    w: &[f64],
    layout: Layout,
    (m, k, n): (usize, usize, usize),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut dinp, mut dw, mut db) = (vec![0.0; m * k], vec![0.0; k * n], vec![0.0; n]);
    for i in 0..m {
        for j in 0..n {
            let g = dout[i * n + j];
            db[j] += g;
            for p in 0..k {
                dinp[i * k + p] += g * w_at(w, layout, p, j, (k, n));
                let at = match layout {
                    Layout::KN => p * n + j,
                    Layout::NK => j * k + p,
                };
                dw[at] += g * inp[i * k + p];
            }
        }
    }
    (dinp, dw, db)
}

/// `(out (B, T, C), att (B, NH, T, T))` from `qkv (B, T, 3C)`.
pub fn attention_forward(qkv: &[f64], d: AttentionDims) -> (Vec<f64>, Vec<f64>) {
    let [q, k, v] = unpack(qkv, d.q_width());
    gqa_attention_forward(&q, &k, &v, d)
}

/// `lse (B, NH, T)` from `qkv (B, T, 3C)` (see [`gqa_attention_lse`]).
pub fn attention_lse(qkv: &[f64], d: AttentionDims) -> Vec<f64> {
    let [q, k, _] = unpack(qkv, d.q_width());
    gqa_attention_lse(&q, &k, d)
}

/// `dqkv (B, T, 3C)` from `dout (B, T, C)` and the forward's `qkv`, `att` and `out`.
pub fn attention_backward(
    dout: &[f64],
    qkv: &[f64],
    att: &[f64],
    out: &[f64],
    d: AttentionDims,
) -> Vec<f64> {
    let [q, k, v] = unpack(qkv, d.q_width());
    let (dq, dk, dv) = gqa_attention_backward(dout, &q, &k, &v, att, out, d);
    let c = d.q_width();
    let mut dqkv = Vec::with_capacity(qkv.len());
    for ((dq, dk), dv) in dq.chunks(c).zip(dk.chunks(c)).zip(dv.chunks(c)) {
        dqkv.extend([dq, dk, dv].concat());
    }
    dqkv
}

/// q, k and v `(B, T, C)` of a packed `(B, T, 3C)`.
fn unpack(qkv: &[f64], c: usize) -> [Vec<f64>; 3] {
    [0, 1, 2].map(|p| {
        qkv.chunks(3 * c)
            .flat_map(|row| &row[p * c..(p + 1) * c])
            .copied()
            .collect()
    })
}

/// Index of element `i` of head `h` at (b, t) in a `(B, T, heads·hs)` tensor.
fn head_at(d: &AttentionDims, heads: usize, (b, t, h, i): (usize, usize, usize, usize)) -> usize {
    (b * d.t + t) * heads * d.head_size + h * d.head_size + i
}

/// The scaled scores of query row t of head h of batch b against keys `0..=t`.
fn scores(q: &[f64], k: &[f64], d: &AttentionDims, (b, t, h): (usize, usize, usize)) -> Vec<f64> {
    (0..=t)
        .map(|t2| {
            (0..d.head_size)
                .map(|i| {
                    q[head_at(d, d.nh, (b, t, h, i))]
                        * k[head_at(d, d.kv_heads, (b, t2, h / d.group(), i))]
                })
                .sum::<f64>()
                / (d.head_size as f64).sqrt()
        })
        .collect()
}

/// The maximum of scores `s` and the sum of `exp(s - max)`.
fn max_and_sum(s: &[f64]) -> (f64, f64) {
    let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    (max, s.iter().map(|s| (s - max).exp()).sum())
}

/// `(out (B, T, NH·hs), att (B, NH, T, T))` from `q (B, T, NH·hs)`, `k`, `v (B, T, KV·hs)`;
/// query head h reads key/value head h / (NH/KV).
pub fn gqa_attention_forward(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d: AttentionDims,
) -> (Vec<f64>, Vec<f64>) {
    let (tn, nh, hs, kv) = (d.t, d.nh, d.head_size, d.kv_heads);
    let (qi, ki) = (
        |b, t, h, i| head_at(&d, nh, (b, t, h, i)),
        |b, t, h, i| head_at(&d, kv, (b, t, h / d.group(), i)),
    );
    let (mut out, mut att) = (vec![0.0; q.len()], vec![0.0; d.b * nh * tn * tn]);
    for b in 0..d.b {
        for h in 0..nh {
            for t in 0..tn {
                let s = scores(q, k, &d, (b, t, h));
                let (max, z) = max_and_sum(&s);
                let row = ((b * nh + h) * tn + t) * tn;
                for t2 in 0..=t {
                    let p = (s[t2] - max).exp() / z;
                    att[row + t2] = p;
                    for i in 0..hs {
                        out[qi(b, t, h, i)] += p * v[ki(b, t2, h, i)];
                    }
                }
            }
        }
    }
    (out, att)
}

/// `lse (B, NH, T)`: each query row's log-sum-exp of its scaled scores, from `q (B, T, NH·hs)`
/// and `k (B, T, KV·hs)`.
pub fn gqa_attention_lse(q: &[f64], k: &[f64], d: AttentionDims) -> Vec<f64> {
    let mut lse = Vec::with_capacity(d.b * d.nh * d.t);
    for b in 0..d.b {
        for h in 0..d.nh {
            for t in 0..d.t {
                let (max, z) = max_and_sum(&scores(q, k, &d, (b, t, h)));
                lse.push(max + z.ln());
            }
        }
    }
    lse
}

/// `(dq, dk, dv)` from `dout (B, T, NH·hs)` and the forward's `q`, `k`, `v`, `att` and `out`.
/// As the kernels do, each query row's `Σ att·(dout·vᵀ)` is taken as `dout·out`: equal for
/// the exact `out`, and for a rounded one the gradient a kernel reading it should give.
pub fn gqa_attention_backward(
    dout: &[f64],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    att: &[f64],
    out: &[f64],
    d: AttentionDims,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (tn, nh, hs, kv) = (d.t, d.nh, d.head_size, d.kv_heads);
    let scale = 1.0 / (hs as f64).sqrt();
    let (qi, ki) = (
        |b, t, h, i| head_at(&d, nh, (b, t, h, i)),
        |b, t, h, i| head_at(&d, kv, (b, t, h / d.group(), i)),
    );
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for b in 0..d.b {
        for h in 0..nh {
            for t in 0..tn {
                let row = ((b * nh + h) * tn + t) * tn;
                let dy = |i: usize| dout[qi(b, t, h, i)];
                let datt: Vec<f64> = (0..=t)
                    .map(|t2| (0..hs).map(|i| dy(i) * v[ki(b, t2, h, i)]).sum())
                    .collect();
                let total: f64 = (0..hs).map(|i| dy(i) * out[qi(b, t, h, i)]).sum();
                for t2 in 0..=t {
                    let ds = att[row + t2] * (datt[t2] - total) * scale;
                    for i in 0..hs {
                        dv[ki(b, t2, h, i)] += att[row + t2] * dy(i);
                        dq[qi(b, t, h, i)] += ds * k[ki(b, t2, h, i)];
                        dk[ki(b, t2, h, i)] += ds * q[qi(b, t, h, i)];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// `(out (N, C), rstd (N))`: `out = inp · rstd · w`, `rstd = 1/sqrt(mean(inp²) + eps)`.
pub fn rmsnorm_forward(inp: &[f64], w: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>) {
    let c = w.len();
    let (mut out, mut rstd) = (vec![0.0; inp.len()], vec![]);
    for (x, o) in inp.chunks(c).zip(out.chunks_mut(c)) {
        let r = 1.0 / (x.iter().map(|x| x * x).sum::<f64>() / c as f64 + eps).sqrt();
        for j in 0..c {
            o[j] = x[j] * r * w[j];
        }
        rstd.push(r);
    }
    (out, rstd)
}

/// `(dinp (N, C), dweight (C))`.
pub fn rmsnorm_backward(
    dout: &[f64],
    inp: &[f64],
    w: &[f64],
    rstd: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let c = w.len();
    let (mut dinp, mut dw) = (vec![0.0; inp.len()], vec![0.0; c]);
    for (i, (x, dy)) in inp.chunks(c).zip(dout.chunks(c)).enumerate() {
        let r = rstd[i];
        // ∂rstd/∂x_j = -x_j · rstd³ / C.
        let s = (0..c).map(|j| w[j] * dy[j] * x[j]).sum::<f64>();
        for j in 0..c {
            dw[j] += dy[j] * x[j] * r;
            dinp[i * c + j] = w[j] * dy[j] * r - x[j] * r * r * r * s / c as f64;
        }
    }
    (dinp, dw)
}

/// Rotary embedding of `x (B, T, heads, D)` by `cos`, `sin` `(T, D/2)` (rotate-half), or
/// by the negative angles (`back`: the backward, rotation's transpose).
pub fn rope(x: &[f64], cos: &[f64], sin: &[f64], d: RopeDims, back: bool) -> Vec<f64> {
    let (dim, h) = (d.head_dim, d.head_dim / 2);
    let mut out = x.to_vec();
    for (row, (o, x)) in out.chunks_mut(dim).zip(x.chunks(dim)).enumerate() {
        let p = (row / d.heads) % d.t;
        for i in 0..h {
            let (c, s) = (
                cos[p * h + i],
                if back {
                    -sin[p * h + i]
                } else {
                    sin[p * h + i]
                },
            );
            o[i] = x[i] * c - x[i + h] * s;
            o[i + h] = x[i + h] * c + x[i] * s;
        }
    }
    out
}

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

/// `silu(gate) · up`.
pub fn swiglu_forward(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| g * sigmoid(g) * u)
        .collect()
}

/// `(dgate, dup)`.
pub fn swiglu_backward(dout: &[f64], gate: &[f64], up: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let s = |g: f64| sigmoid(g) * (1.0 + g * (1.0 - sigmoid(g)));
    let dgate = (0..gate.len())
        .map(|i| dout[i] * up[i] * s(gate[i]))
        .collect();
    let dup = (0..gate.len())
        .map(|i| dout[i] * gate[i] * sigmoid(gate[i]))
        .collect();
    (dgate, dup)
}

const GELU_K: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)

pub fn gelu_forward(x: &[f64]) -> Vec<f64> {
    x.iter()
        .map(|&x| 0.5 * x * (1.0 + (GELU_K * (x + 0.044715 * x * x * x)).tanh()))
        .collect()
}

/// `dinp = dout · gelu'(x)`.
pub fn gelu_backward(dout: &[f64], x: &[f64]) -> Vec<f64> {
    x.iter()
        .zip(dout)
        .map(|(&x, &g)| {
            let th = (GELU_K * (x + 0.044715 * x * x * x)).tanh();
            g * (0.5 * (1.0 + th)
                + 0.5 * x * (1.0 - th * th) * GELU_K * (1.0 + 3.0 * 0.044715 * x * x))
        })
        .collect()
}

pub fn residual_forward(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a + b).collect()
}

/// Per-row `logsumexp(logits) - logits[target]` for `logits (N, V)`.
pub fn crossentropy_forward(logits: &[f64], targets: &[u32], v: usize) -> Vec<f64> {
    logits
        .chunks(v)
        .zip(targets)
        .map(|(row, &t)| {
            if t == crate::crossentropy::IGNORE {
                return 0.0;
            }
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln() - row[t as usize]
        })
        .collect()
}

/// `dlogits = (softmax - onehot) · dloss`.
pub fn crossentropy_backward(logits: &[f64], targets: &[u32], v: usize, dloss: f64) -> Vec<f64> {
    let mut d = Vec::with_capacity(logits.len());
    for (row, &t) in logits.chunks(v).zip(targets) {
        if t == crate::crossentropy::IGNORE {
            d.extend(std::iter::repeat_n(0.0, v));
            continue;
        }
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|x| (x - max).exp()).sum();
        d.extend(
            row.iter()
                .enumerate()
                .map(|(j, x)| ((x - max).exp() / z - (j == t as usize) as u8 as f64) * dloss),
        );
    }
    d
}
