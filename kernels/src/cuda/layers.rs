//! The forward and backward layer passes on the GPU, with the shapes and semantics of the CPU
//! functions of the same names (`crate::encoder`, `crate::layernorm`, …). All launch on the
//! device's stream and return once queued.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::device::{MAX_GRID, THREADS, elementwise, input_ptr, launch, rows};
use super::{DeviceFloat, Error, Gpu};
use crate::attention::AttentionDims;
use crate::encoder::check_positions;
use crate::layernorm::EPS;
use crate::rope::{self, RopeDims};

fn len(n: usize) -> i64 {
    n as i64
}

/// `out = round(src)` for a 16-bit `X`: the trainer's compute copies.
pub fn cast_from_f32<X: DeviceFloat>(
    dev: &Gpu,
    dst: &mut CudaViewMut<'_, X>,
    src: &CudaView<'_, f32>,
) -> Result<(), Error> {
    assert_eq!(dst.len(), src.len(), "cast length mismatch");
    let n = len(src.len());
    launch!(dev, "casts.cu", format!("cast_from_f32_{}", X::NAME), elementwise(src.len()); dst, src, &n);
    Ok(())
}

/// `dst = src as f32` for a 16-bit `X`.
pub fn cast_to_f32<X: DeviceFloat>(
    dev: &Gpu,
    dst: &mut CudaViewMut<'_, f32>,
    src: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert_eq!(dst.len(), src.len(), "cast length mismatch");
    let n = len(src.len());
    launch!(dev, "casts.cu", format!("cast_to_f32_{}", X::NAME), elementwise(src.len()); dst, src, &n);
    Ok(())
}

/// `out (B, T, C) = wte[tokens] (+ wpe[0..T])`; a token outside the vocabulary gives NaN rows.
pub fn encoder_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    tokens: &CudaView<'_, u32>,
    wte: &CudaView<'_, X>,
    wpe: Option<&CudaView<'_, X>>,
    t: usize,
    c: usize,
) -> Result<(), Error> {
    let bt = tokens.len();
    assert_eq!(out.len(), bt * c, "out must be (B, T, C)");
    check_positions(bt, t, c, wpe.map(|w| w.len()));
    let (bt, t, c, v) = (len(bt), len(t), len(c), len(wte.len() / c));
    let cfg = elementwise(out.len());
    let (wpe, _wpe) = input_ptr(wpe, dev.stream());
    launch!(dev, "encoder.cu", format!("encoder_forward_{}", X::NAME), cfg;
        out, tokens, wte, &wpe, &bt, &t, &c, &v);
    Ok(())
}

/// Backward: `dwte[v] += Σ dout` over the positions holding token v and, when the model has
/// learned positions, `dwpe[t] += Σ_b dout[b, t]`.
/// `tokens` is the host copy of the batch: positions are grouped by token on the host (as the
/// CPU back end does), so each row of dwte is summed by one block in position order.
pub fn encoder_backward<X: DeviceFloat>(
    dev: &Gpu,
    dwte: &mut CudaViewMut<'_, X>,
    dwpe: Option<&mut CudaViewMut<'_, X>>,
    dout: &CudaView<'_, X>,
    tokens: &[u32],
    t: usize,
    c: usize,
) -> Result<(), Error> {
    let bt = tokens.len();
    assert_eq!(dout.len(), bt * c, "dout must be (B, T, C)");
    check_positions(bt, t, c, dwpe.as_ref().map(|w| w.len()));
    let v = dwte.len() / c;
    if let Some(&bad) = tokens.iter().find(|&&tok| tok as usize >= v) {
        panic!("token {bad} outside the vocabulary of {v}");
    }
    let (order, starts) = group_by_token(tokens);
    let runs = starts.len() - 1;
    let (d_tokens, d_order, d_starts) = (
        dev.upload(tokens)?,
        dev.upload(&order)?,
        dev.upload(&starts)?,
    );
    let (n, tl, cl) = (len(bt), len(t), len(c));
    if let Some(dwpe) = dwpe {
        launch!(dev, "encoder.cu", format!("encoder_backward_wpe_{}", X::NAME), elementwise(t * c);
            dwpe, dout, &n, &tl, &cl);
    }
    let cfg = encoder_wte_config(c, runs);
    let runs = len(runs);
    launch!(dev, "encoder.cu", format!("encoder_backward_wte_{}", X::NAME), cfg;
        dwte, dout, &d_tokens, &d_order, &d_starts, &runs, &cl);
    Ok(())
}

/// The launch of `encoder_backward_wte` over `runs` distinct tokens of width `c`: blocks of
/// 32 × 8 threads per 32 columns (grid x) and run (grid y, striding past 65,535 runs).
pub fn encoder_wte_config(c: usize, runs: usize) -> LaunchConfig {
    let dim = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    LaunchConfig {
        grid_dim: (
            dim(c.div_ceil(32)),
            dim(runs.clamp(1, MAX_GRID.1 as usize)),
            1,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// The positions of `tokens` grouped by token, as `encoder_backward_wte` takes them: `order`
/// lists the positions sorted by token (stable: ascending within a token), and run `r` of one
/// token is `order[starts[r]..starts[r + 1]]` (`starts` ends with `tokens.len()`).
pub fn group_by_token(tokens: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let n = tokens.len();
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by_key(|&i| tokens[i as usize]);
    let mut starts: Vec<u32> = (0..n)
        .filter(|&i| i == 0 || tokens[order[i] as usize] != tokens[order[i - 1] as usize])
        .map(|i| i as u32)
        .collect();
    starts.push(n as u32);
    (order, starts)
}

/// Rows per block of the LayerNorm row kernels (a warp each; `LN_WARPS` in layernorm.cu).
const LN_ROWS_PER_BLOCK: usize = THREADS as usize / 32;

/// The launch of `layernorm_forward` and `layernorm_backward_rows` over `n` rows: a warp per
/// row.
pub fn layernorm_rows_config(n: usize) -> LaunchConfig {
    rows(n.div_ceil(LN_ROWS_PER_BLOCK).max(1), 1)
}

/// Column sums of an `(rows, cols)` matrix in two stages (LayerNorm's dweight/dbias, a dense
/// layer's dbias): partial sums over chunks of `chunk` rows (blocks of (32, 8) threads, one
/// per 32 columns and chunk), then each column's partials added in order. `scratch` f32 hold
/// `sums` partials per column and chunk.
#[derive(Clone, Copy, Debug)]
pub struct ColumnSums {
    pub parts: LaunchConfig,
    pub sums: LaunchConfig,
    pub chunk: usize,
    pub scratch: usize,
}

impl ColumnSums {
    /// At most this many chunks of rows (partials per column): enough blocks to fill a GPU at
    /// C = 768, few enough that the second stage is short.
    pub const MAX_CHUNKS: usize = 64;

    pub fn new(rows: usize, cols: usize, sums: usize) -> Self {
        Self::with_max_chunks(rows, cols, sums, Self::MAX_CHUNKS)
    }

    /// With at most `max_chunks` chunks (≥ 1), for a scratch buffer of bounded size.
    pub fn with_max_chunks(rows: usize, cols: usize, sums: usize, max_chunks: usize) -> Self {
        let chunk = rows.div_ceil(max_chunks.max(1)).max(32);
        let chunks = rows.div_ceil(chunk).max(1);
        let dim = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Self {
            parts: LaunchConfig {
                grid_dim: (dim(cols.div_ceil(32)), dim(chunks), 1),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            },
            sums: elementwise(cols),
            chunk,
            scratch: sums * chunks * cols,
        }
    }
}

/// `out (N, C) = (inp - mean)·rstd·weight + bias`, writing `mean (N)` and `rstd (N)`.
pub fn layernorm_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    mean: &mut CudaViewMut<'_, f32>,
    rstd: &mut CudaViewMut<'_, f32>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    bias: &CudaView<'_, X>,
) -> Result<(), Error> {
    let c = weight.len();
    let n = check_rows(inp.len(), c, &[mean.len(), rstd.len()]);
    assert!(
        out.len() == inp.len() && bias.len() == c,
        "out must be (N, C), bias (C)"
    );
    let (cl, nl, eps) = (len(c), len(n), EPS);
    launch!(dev, "layernorm.cu", format!("layernorm_forward_{}", X::NAME), layernorm_rows_config(n);
        out, mean, rstd, inp, weight, bias, &cl, &nl, &eps);
    Ok(())
}

/// Backward: `dinp += ∂L/∂inp`, `dweight += Σ dout·norm`, `dbias += Σ dout`. The column sums
/// take `2·min(N/32, 64)·C` f32 of device scratch for the call (384 KiB at most at C = 768).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<X: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dweight: &mut CudaViewMut<'_, X>,
    dbias: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, X>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    mean: &CudaView<'_, f32>,
    rstd: &CudaView<'_, f32>,
) -> Result<(), Error> {
    let c = weight.len();
    assert!(
        dweight.len() == c && dbias.len() == c,
        "dweight, dbias must be (C)"
    );
    layernorm_backward_input(dev, dinp, dout, inp, weight, mean, rstd)?;
    let n = inp.len() / c;
    let (nl, cl) = (len(n), len(c));
    let cols = ColumnSums::new(n, c, 2);
    let mut parts = dev.zeros::<f32>(cols.scratch)?;
    let chunk = len(cols.chunk);
    launch!(dev, "layernorm.cu", format!("layernorm_backward_column_parts_{}", X::NAME), cols.parts;
        &mut parts, dout, inp, mean, rstd, &nl, &cl, &chunk);
    launch!(dev, "layernorm.cu", format!("layernorm_backward_column_sums_{}", X::NAME), cols.sums;
        dweight, dbias, &parts, &nl, &cl, &chunk);
    Ok(())
}

/// `out (N, C) = inp · rstd · weight`, writing `rstd (N) = 1/sqrt(mean(inp²) + eps)`
/// (RMSNorm: layernorm.cu's kernels, not centred).
pub fn rmsnorm_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    rstd: &mut CudaViewMut<'_, f32>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    eps: f32,
) -> Result<(), Error> {
    let c = weight.len();
    let n = check_rows(inp.len(), c, &[rstd.len()]);
    assert_eq!(out.len(), inp.len(), "out must be (N, C)");
    let (cl, nl) = (len(c), len(n));
    launch!(dev, "layernorm.cu", format!("rmsnorm_forward_{}", X::NAME), layernorm_rows_config(n);
        out, rstd, inp, weight, &cl, &nl, &eps);
    Ok(())
}

/// Backward: `dinp += ∂L/∂inp`, `dweight += Σ dout·inp·rstd`. The column sums take
/// `min(N/32, 64)·C` f32 of device scratch for the call.
pub fn rmsnorm_backward<X: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dweight: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, X>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    rstd: &CudaView<'_, f32>,
) -> Result<(), Error> {
    let c = weight.len();
    assert_eq!(dweight.len(), c, "dweight must be (C)");
    rmsnorm_backward_input(dev, dinp, dout, inp, weight, rstd)?;
    let n = inp.len() / c;
    let (nl, cl) = (len(n), len(c));
    let cols = ColumnSums::new(n, c, 1);
    let mut parts = dev.zeros::<f32>(cols.scratch)?;
    let chunk = len(cols.chunk);
    launch!(dev, "layernorm.cu", format!("rmsnorm_backward_column_parts_{}", X::NAME), cols.parts;
        &mut parts, dout, inp, rstd, &nl, &cl, &chunk);
    launch!(dev, "layernorm.cu", format!("rmsnorm_backward_column_sums_{}", X::NAME), cols.sums;
        dweight, &parts, &nl, &cl, &chunk);
    Ok(())
}

/// [`rmsnorm_backward`] through a frozen weight: `dinp += ∂L/∂inp` only.
pub fn rmsnorm_backward_input<X: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, X>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    rstd: &CudaView<'_, f32>,
) -> Result<(), Error> {
    let c = weight.len();
    let n = check_rows(inp.len(), c, &[rstd.len()]);
    assert!(
        dinp.len() == inp.len() && dout.len() == inp.len(),
        "dinp, dout must be (N, C)"
    );
    let (nl, cl) = (len(n), len(c));
    launch!(dev, "layernorm.cu", format!("rmsnorm_backward_rows_{}", X::NAME), layernorm_rows_config(n);
        dinp, dout, inp, weight, rstd, &cl, &nl);
    Ok(())
}

/// [`layernorm_backward`] through a frozen weight and bias: `dinp += ∂L/∂inp` only.
pub fn layernorm_backward_input<X: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, X>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    mean: &CudaView<'_, f32>,
    rstd: &CudaView<'_, f32>,
) -> Result<(), Error> {
    let c = weight.len();
    let n = check_rows(inp.len(), c, &[mean.len(), rstd.len()]);
    assert!(
        dinp.len() == inp.len() && dout.len() == inp.len(),
        "dinp, dout must be (N, C)"
    );
    let (nl, cl) = (len(n), len(c));
    launch!(dev, "layernorm.cu", format!("layernorm_backward_rows_{}", X::NAME), layernorm_rows_config(n);
        dinp, dout, inp, weight, mean, rstd, &cl, &nl);
    Ok(())
}

/// Rows of `inp (N, C)`, after checking it and the statistics (N each).
fn check_rows(len: usize, c: usize, stats: &[usize]) -> usize {
    assert!(
        c > 0 && len.is_multiple_of(c),
        "inp must be (N, C) with C = weight.len()"
    );
    assert!(
        stats.iter().all(|&s| s == len / c),
        "the statistics (mean, rstd) must be (N)"
    );
    len / c
}

/// The kernels' shape arguments `[T, NH, KV, hs]`, after checking the grid: a block row per
/// query head (b, h), so B·NH within grid y's 65,535 (the head size is checked with the
/// operands, against `MAX_HEAD_SIZE`).
fn attention_args(d: &AttentionDims) -> [i32; 4] {
    let heads = d.b * d.nh;
    assert!(
        heads <= MAX_GRID.1 as usize,
        "B·NH = {heads} query heads: attention.cu takes at most 65,535 (the grid's y limit)"
    );
    assert!(
        i32::try_from(d.t).is_ok(),
        "T = {} is over attention.cu's int",
        d.t
    );
    [d.t, d.nh, d.kv_heads, d.head_size].map(|n| n as i32)
}

/// Floats of attention.cu's shared tiles: a forward query tile holds at most
/// `FWD_QUERY_FLOATS` (rows × head size), every other tile `TILE_FLOATS`.
const ATTENTION_FWD_QUERY_FLOATS: usize = 4096;
const ATTENTION_TILE_FLOATS: usize = 2048;

/// Threads per attention block (`ATT_THREADS` in attention.cu), whatever THREADS is.
const ATTENTION_THREADS: u32 = 256;

/// Rows of queries (`q`) and of keys (`k`) per block of attention.cu's kernels. With the head
/// size padded to `hp = max(64, hs.next_power_of_two())`, tiles of `4096/hp` and `2048/hp`
/// rows fill attention.cu's shared memory (about 42 KiB of the 48 KiB a block may have).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionTiles {
    pub q: usize,
    pub k: usize,
}

impl AttentionTiles {
    /// The forward's: 64 query × 32 key rows at hs ≤ 64, 32 × 16 at 128, 16 × 8 at 256.
    pub fn forward(head_size: usize) -> Self {
        let hp = Self::padded(head_size);
        Self {
            q: ATTENTION_FWD_QUERY_FLOATS / hp,
            k: ATTENTION_TILE_FLOATS / hp,
        }
    }

    /// The backward's (both kernels): 32 × 32 rows at hs ≤ 64, 16 × 16 at 128, 8 × 8 at 256.
    pub fn backward(head_size: usize) -> Self {
        let rows = ATTENTION_TILE_FLOATS / Self::padded(head_size);
        Self { q: rows, k: rows }
    }

    fn padded(head_size: usize) -> usize {
        head_size.next_power_of_two().max(64)
    }

    /// The kernels' `tile_q, tile_k`.
    fn args(self) -> [i32; 2] {
        [self.q, self.k].map(|n| n as i32)
    }
}

/// The launch of the forward and query-gradient kernels: a block per query tile (grid x) and
/// query head (b, h) (grid y).
pub fn attention_config(d: &AttentionDims, tiles: AttentionTiles) -> LaunchConfig {
    attention_blocks(d.t.div_ceil(tiles.q), d.b * d.nh)
}

/// The launch of the key/value-gradient kernel: per key tile and key/value head (b, g).
pub fn attention_key_config(d: &AttentionDims, tiles: AttentionTiles) -> LaunchConfig {
    attention_blocks(d.t.div_ceil(tiles.k), d.b * d.kv_heads)
}

fn attention_blocks(tiles: usize, heads: usize) -> LaunchConfig {
    let mut cfg = rows(tiles, heads);
    cfg.block_dim.0 = ATTENTION_THREADS;
    cfg
}

/// Forward: `out (B, T, C)` and `lse (B, NH, T)`, the log-sum-exp of each query row's scaled
/// scores, from `qkv (B, T, 3C)`.
pub fn attention_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    lse: &mut CudaViewMut<'_, f32>,
    qkv: &CudaView<'_, X>,
    d: AttentionDims,
) -> Result<(), Error> {
    d.packed(qkv.len(), out.len(), lse.len());
    let [t, nh, _, hs] = attention_args(&d);
    let c = nh * hs;
    let tiles = AttentionTiles::forward(d.head_size);
    let [tq, tk] = tiles.args();
    launch!(dev, "attention.cu", format!("attention_forward_{}", X::NAME), attention_config(&d, tiles);
        out, lse, qkv, &t, &c, &nh, &tq, &tk);
    Ok(())
}

/// Backward: `dqkv (B, T, 3C)` (overwritten) from `dout (B, T, C)` and the forward's `qkv`,
/// `out` and `lse`; `delta (B, NH, T)` f32 scratch, left holding rowsum(dout ∘ out).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<X: DeviceFloat>(
    dev: &Gpu,
    dqkv: &mut CudaViewMut<'_, X>,
    delta: &mut CudaViewMut<'_, f32>,
    dout: &CudaView<'_, X>,
    qkv: &CudaView<'_, X>,
    out: &CudaView<'_, X>,
    lse: &CudaView<'_, f32>,
    d: AttentionDims,
) -> Result<(), Error> {
    d.packed(qkv.len(), dout.len(), lse.len());
    assert!(
        dqkv.len() == qkv.len() && out.len() == dout.len() && delta.len() == lse.len(),
        "dqkv must be (B, T, 3C), out (B, T, C), delta (B, NH, T)"
    );
    let [t, nh, _, hs] = attention_args(&d);
    let c = nh * hs;
    let tiles = AttentionTiles::backward(d.head_size);
    let [tq, tk] = tiles.args();
    launch!(dev, "attention.cu", format!("attention_backward_query_{}", X::NAME), attention_config(&d, tiles);
        &mut *dqkv, &mut *delta, dout, qkv, out, lse, &t, &c, &nh, &tq, &tk);
    let delta = delta.as_view();
    launch!(dev, "attention.cu", format!("attention_backward_key_{}", X::NAME), attention_key_config(&d, tiles);
        dqkv, dout, qkv, lse, &delta, &t, &c, &nh, &tq, &tk);
    Ok(())
}

/// Grouped-query forward: `out (B, T, NH·hs)` and `lse (B, NH, T)` from `q (B, T, NH·hs)`,
/// `k` and `v (B, T, KV·hs)`; query head h reads key/value head `h / d.group()`.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    lse: &mut CudaViewMut<'_, f32>,
    q: &CudaView<'_, X>,
    k: &CudaView<'_, X>,
    v: &CudaView<'_, X>,
    d: AttentionDims,
) -> Result<(), Error> {
    d.separate([q.len(), k.len(), v.len(), out.len()], lse.len());
    let [t, nh, kv, hs] = attention_args(&d);
    let tiles = AttentionTiles::forward(d.head_size);
    let [tq, tk] = tiles.args();
    launch!(dev, "attention.cu", format!("gqa_attention_forward_{}", X::NAME), attention_config(&d, tiles);
        out, lse, q, k, v, &t, &nh, &kv, &hs, &tq, &tk);
    Ok(())
}

/// Grouped-query backward: `dq`, `dk`, `dv` (overwritten; a key/value head's gradients summed
/// over its query heads in head order) from `dout (B, T, NH·hs)` and the forward's inputs,
/// `out` and `lse`; `delta (B, NH, T)` f32 scratch, left holding rowsum(dout ∘ out).
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention_backward<X: DeviceFloat>(
    dev: &Gpu,
    dq: &mut CudaViewMut<'_, X>,
    dk: &mut CudaViewMut<'_, X>,
    dv: &mut CudaViewMut<'_, X>,
    delta: &mut CudaViewMut<'_, f32>,
    dout: &CudaView<'_, X>,
    q: &CudaView<'_, X>,
    k: &CudaView<'_, X>,
    v: &CudaView<'_, X>,
    out: &CudaView<'_, X>,
    lse: &CudaView<'_, f32>,
    d: AttentionDims,
) -> Result<(), Error> {
    d.separate([q.len(), k.len(), v.len(), dout.len()], lse.len());
    assert!(
        dq.len() == q.len() && dk.len() == k.len() && dv.len() == v.len(),
        "dq, dk, dv must have the shapes of q, k, v"
    );
    assert!(
        out.len() == dout.len() && delta.len() == lse.len(),
        "out must be (B, T, NH·hs), delta (B, NH, T)"
    );
    let [t, nh, kv, hs] = attention_args(&d);
    let tiles = AttentionTiles::backward(d.head_size);
    let [tq, tk] = tiles.args();
    launch!(dev, "attention.cu", format!("gqa_attention_backward_query_{}", X::NAME), attention_config(&d, tiles);
        dq, &mut *delta, dout, q, k, v, out, lse, &t, &nh, &kv, &hs, &tq, &tk);
    let delta = delta.as_view();
    launch!(dev, "attention.cu", format!("gqa_attention_backward_key_{}", X::NAME), attention_key_config(&d, tiles);
        dk, dv, dout, q, k, v, lse, &delta, &t, &nh, &kv, &hs, &tq, &tk);
    Ok(())
}

/// In place on `x (B, T, heads, D)`: rotary embedding by the `(T', D/2)` tables, T' ≥ T.
pub fn rope_forward<X: DeviceFloat>(
    dev: &Gpu,
    x: &mut CudaViewMut<'_, X>,
    cos: &CudaView<'_, f32>,
    sin: &CudaView<'_, f32>,
    d: RopeDims,
) -> Result<(), Error> {
    rotate(dev, "rope_forward", x, cos, sin, d)
}

/// Backward, in place on `dx`: the transposed rotation.
pub fn rope_backward<X: DeviceFloat>(
    dev: &Gpu,
    dx: &mut CudaViewMut<'_, X>,
    cos: &CudaView<'_, f32>,
    sin: &CudaView<'_, f32>,
    d: RopeDims,
) -> Result<(), Error> {
    rotate(dev, "rope_backward", dx, cos, sin, d)
}

fn rotate<X: DeviceFloat>(
    dev: &Gpu,
    kernel: &str,
    x: &mut CudaViewMut<'_, X>,
    cos: &CudaView<'_, f32>,
    sin: &CudaView<'_, f32>,
    d: RopeDims,
) -> Result<(), Error> {
    let rows = rope::check(x.len(), cos.len(), sin.len(), &d);
    let h = d.head_dim / 2;
    let (rl, tl, hl, half) = (len(rows), len(d.t), len(d.heads), len(h));
    launch!(dev, "rope.cu", format!("{kernel}_{}", X::NAME), elementwise(rows * h);
        x, cos, sin, &rl, &tl, &hl, &half);
    Ok(())
}

/// `out = silu(gate) · up`.
pub fn swiglu_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    gate: &CudaView<'_, X>,
    up: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert!(
        out.len() == gate.len() && gate.len() == up.len(),
        "out, gate and up must have the same shape"
    );
    let n = len(gate.len());
    launch!(dev, "swiglu.cu", format!("swiglu_forward_{}", X::NAME), elementwise(gate.len());
        out, gate, up, &n);
    Ok(())
}

/// Backward, overwriting `dgate` and `dup`.
pub fn swiglu_backward<X: DeviceFloat>(
    dev: &Gpu,
    dgate: &mut CudaViewMut<'_, X>,
    dup: &mut CudaViewMut<'_, X>,
    gate: &CudaView<'_, X>,
    up: &CudaView<'_, X>,
) -> Result<(), Error> {
    let n = gate.len();
    assert!(
        dgate.len() == n && dup.len() == n && up.len() == n,
        "dgate, dup, gate and up must have the same shape"
    );
    let nl = len(n);
    launch!(dev, "swiglu.cu", format!("swiglu_backward_{}", X::NAME), elementwise(n);
        dgate, dup, gate, up, &nl);
    Ok(())
}

/// `out = gelu(inp)`.
pub fn gelu_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    inp: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert_eq!(out.len(), inp.len(), "out and inp must have the same shape");
    let n = len(inp.len());
    launch!(dev, "gelu.cu", format!("gelu_forward_{}", X::NAME), elementwise(inp.len()); out, inp, &n);
    Ok(())
}

/// In place: `grad = grad · gelu'(inp)`.
pub fn gelu_backward<X: DeviceFloat>(
    dev: &Gpu,
    grad: &mut CudaViewMut<'_, X>,
    inp: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert_eq!(
        grad.len(),
        inp.len(),
        "grad and inp must have the same shape"
    );
    let n = len(inp.len());
    launch!(dev, "gelu.cu", format!("gelu_backward_{}", X::NAME), elementwise(inp.len()); grad, inp, &n);
    Ok(())
}

/// `out = a + b`.
pub fn residual_forward<X: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, X>,
    a: &CudaView<'_, X>,
    b: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert!(
        out.len() == a.len() && a.len() == b.len(),
        "out, a and b must have the same shape"
    );
    let n = len(a.len());
    launch!(dev, "residual.cu", format!("residual_forward_{}", X::NAME), elementwise(a.len()); out, a, b, &n);
    Ok(())
}

/// `a += b`.
pub fn residual_accumulate<X: DeviceFloat>(
    dev: &Gpu,
    a: &mut CudaViewMut<'_, X>,
    b: &CudaView<'_, X>,
) -> Result<(), Error> {
    assert_eq!(a.len(), b.len(), "a and b must have the same shape");
    let n = len(b.len());
    launch!(dev, "residual.cu", format!("residual_accumulate_{}", X::NAME), elementwise(b.len()); a, b, &n);
    Ok(())
}

/// `x *= s`.
pub fn scale<X: DeviceFloat>(dev: &Gpu, x: &mut CudaViewMut<'_, X>, s: f32) -> Result<(), Error> {
    let n = len(x.len());
    launch!(dev, "residual.cu", format!("scale_{}", X::NAME), elementwise(x.len()); x, &s, &n);
    Ok(())
}

/// `losses (N) = logsumexp(logits[i]) - logits[i, targets[i]]` for `logits (N, V)`; with
/// `dloss = Some(s)` the logits become `(softmax - onehot)·s`. One block of 1024 per row.
pub fn crossentropy_forward(
    dev: &Gpu,
    losses: &mut CudaViewMut<'_, f32>,
    logits: &mut CudaViewMut<'_, f32>,
    targets: &CudaView<'_, u32>,
    v: usize,
    dloss: Option<f32>,
) -> Result<(), Error> {
    assert!(
        v > 0 && logits.len() == losses.len() * v,
        "logits must be (N, V), losses (N)"
    );
    assert_eq!(targets.len(), losses.len(), "targets must be (N)");
    let (vl, has, s) = (len(v), dloss.is_some() as i32, dloss.unwrap_or(0.0));
    launch!(dev, "crossentropy.cu", "crossentropy_forward", crossentropy_config(losses.len());
        losses, logits, targets, &vl, &has, &s);
    Ok(())
}

/// The launch of `crossentropy_forward`: a block of 1024 threads per row.
pub fn crossentropy_config(n: usize) -> LaunchConfig {
    let mut cfg = rows(n, 1);
    cfg.block_dim.0 = 1024;
    cfg
}
