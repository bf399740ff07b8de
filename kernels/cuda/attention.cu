// Causal self-attention (scale 1/sqrt(hs)), tiled as FlashAttention-2: memory linear in T, no
// bound on T. Two layouts share every kernel body: GPT-2's multi-head attention on a packed qkv
// (B, T, 3C) laid out [q | k | v], head h in columns h·hs..(h+1)·hs of each part, and
// grouped-query attention (Llama) on q (B, T, NH·hs), k and v (B, T, KV·hs), where query head
// h reads key/value head h / (NH/KV).
//
// - forward, one block per (query tile, query head (b, h)): the key/value tiles t2 <= t are
//   staged in shared memory one after the other, with a running max m and sum l per query row
//   and the output rows rescaled in registers; out = o / l (X) and lse = m + ln l (f32,
//   (B, NH, T), natural log of Σ_{t2<=t} exp(scale·q_t·k_t2)).
// - backward, in two kernels that recompute P = exp(scale·q·kᵀ − lse) tile by tile, with no
//   atomics: backward_query per (query tile, (b, h)) writes delta = rowsum(dout ∘ out) and
//   dq = scale · Σ P ∘ (dout·vᵀ − delta)·k; backward_key per (key tile, key/value head (b, g)),
//   after it, goes over the group's query heads in order, then the query rows t >= t2:
//   dv += Pᵀ·dout, dk += scale · dSᵀ·q.
//
// A block is ATT_THREADS threads, each owning fixed elements of every tile it computes, so each
// sum runs in one fixed order: the results are the same bits run to run. Rows are widened to
// f32 once, when staged; sums are f32, outputs rounded once.
//
// Tiles (tile_q query rows, tile_k key rows) are the launcher's choice (AttentionTiles in
// kernels/src/cuda/layers.rs), within this file's shared memory: for the head size padded to
// hp = max(64, 2^⌈log2 hs⌉), the forward takes (4096/hp, 2048/hp) rows, the backward
// (2048/hp, 2048/hp): 64 × 32 and 32 × 32 at hs <= 64, down to 16 × 8 and 8 × 8 at 256.
// The shared arrays are static, sized for the largest tiles: forward 42,496 bytes per block,
// backward_query 37,760, backward_key 41,984, within the 48 KiB a block has without opting in.

#define ATT_THREADS 256
#define FWD_QUERY_FLOATS 4096 // tile_q·hs of a forward query tile
#define TILE_FLOATS 2048      // tile·hs of every other tile
#define FWD_ROWS 64           // the most query rows of a forward tile
#define ROWS 32               // the most rows of every other tile
// Elements per thread of the (rows × hs) sums kept in registers.
#define FWD_ACC (FWD_QUERY_FLOATS / ATT_THREADS)
#define BWD_ACC (TILE_FLOATS / ATT_THREADS)

// Staged rows are padded to an odd stride, hs | 1: the rows a warp reads at once (one column
// of many rows) then fall in different banks. Score tiles are padded to tile_k + 1 likewise.
#define FWD_QUERY_TILE (FWD_QUERY_FLOATS + FWD_ROWS)
#define TILE (TILE_FLOATS + ROWS)

#define NEG_INF __int_as_float(0xff800000)

// The shapes of a call: sequence length, query and key/value heads, head size.
struct Dims {
    int t_len, nh, kv, hs;
    __device__ __forceinline__ int group() const { return nh / kv; }
};

// Rows per query tile and per key tile.
struct Tiles {
    int q, k;
};

// Where a tensor keeps its heads: row (b, t) of head h starts at p + (b·T + t)·stride + h·hs.
template <typename P> struct Heads {
    P *p;
    long stride;
    __device__ __forceinline__ P *row(long b, long t, long h, const Dims &d) const {
        return p + (b * d.t_len + t) * stride + h * d.hs;
    }
};

// Rows t0..t0+rows of head h of batch b into `tile` (stride hs | 1), as f32; rows at or past T
// are zeros.
template <typename X>
__device__ void stage(float *tile, Heads<const X> x, int b, int t0, int rows, int h,
                      const Dims &d) {
    int hs = d.hs, ld = hs | 1;
    for (int e = threadIdx.x; e < rows * hs; e += blockDim.x) {
        int r = e / hs, j = e % hs, t = t0 + r;
        tile[r * ld + j] = t < d.t_len ? load(x.row(b, t, h, d)[j]) : 0.0f;
    }
}

// Entries t0..t0+rows of one head's per-row statistic (lse or delta, from `row0`, its t = 0);
// 0 past T.
__device__ void stage_rows(float *dst, const float *row0, int t0, int rows, int t_len) {
    for (int r = threadIdx.x; r < rows; r += blockDim.x) dst[r] = t0 + r < t_len ? row0[t0 + r] : 0.0f;
}

__device__ __forceinline__ float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

// Query tiles count from the last: the longest rows (most key tiles) start first.
__device__ __forceinline__ int query_tile_start(int rows) {
    return (gridDim.x - 1 - blockIdx.x) * rows;
}

// out and lse for query tile blockIdx.x (counted from the last) of query head blockIdx.y.
template <typename X>
__device__ void forward(Heads<X> out, float *lse, Heads<const X> q, Heads<const X> k,
                        Heads<const X> v, Dims d, Tiles tiles) {
    __shared__ float qs[FWD_QUERY_TILE], ks[TILE], vs[TILE];
    __shared__ float p[FWD_ROWS * (ROWS + 1)]; // scores, then probabilities (unnormalised)
    __shared__ float m[FWD_ROWS], l[FWD_ROWS], alpha[FWD_ROWS];
    int bh = blockIdx.y, b = bh / d.nh, h = bh % d.nh, g = h / d.group();
    int hs = d.hs, ld = hs | 1, bq = tiles.q, bk = tiles.k, lp = bk + 1;
    int t0 = query_tile_start(bq), last = min(t0 + bq, d.t_len) - 1;
    float scale = 1.0f / sqrtf((float)hs);
    stage(qs, q, b, t0, bq, h, d);
    for (int r = threadIdx.x; r < bq; r += blockDim.x) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
    }
    float o[FWD_ACC] = {}; // element tid + i·ATT_THREADS of the tile's (tile_q × hs) output
    for (int k0 = 0; k0 <= last; k0 += bk) {
        __syncthreads(); // the previous key tile is read
        stage(ks, k, b, k0, bk, g, d);
        stage(vs, v, b, k0, bk, g, d);
        __syncthreads();
        // Key 0 is in every row's first tile, so m is finite from then on (rows past T too).
        for (int e = threadIdx.x; e < bq * bk; e += blockDim.x) {
            int r = e / bk, c = e % bk, t = t0 + r, t2 = k0 + c;
            bool seen = t2 <= t && t2 < d.t_len;
            p[r * lp + c] = seen ? scale * dot(&qs[r * ld], &ks[c * ld], hs) : NEG_INF;
        }
        __syncthreads();
        for (int r = threadIdx.x; r < bq; r += blockDim.x) {
            float *row = &p[r * lp], mx = m[r], sum = 0.0f;
            for (int c = 0; c < bk; c++) mx = fmaxf(mx, row[c]);
            for (int c = 0; c < bk; c++) {
                row[c] = expf(row[c] - mx);
                sum += row[c];
            }
            alpha[r] = expf(m[r] - mx);
            l[r] = l[r] * alpha[r] + sum;
            m[r] = mx;
        }
        __syncthreads();
        for (int i = 0; i < FWD_ACC; i++) {
            int e = threadIdx.x + i * ATT_THREADS, r = e / hs, j = e % hs;
            if (r >= bq) break;
            float acc = o[i] * alpha[r];
            for (int c = 0; c < bk; c++) acc += p[r * lp + c] * vs[c * ld + j];
            o[i] = acc;
        }
    }
    for (int i = 0; i < FWD_ACC; i++) {
        int e = threadIdx.x + i * ATT_THREADS, r = e / hs, j = e % hs;
        if (r >= bq) break;
        if (t0 + r < d.t_len) out.row(b, t0 + r, h, d)[j] = store<X>(o[i] / l[r]);
    }
    for (int r = threadIdx.x; r < bq && t0 + r < d.t_len; r += blockDim.x) {
        lse[(long)bh * d.t_len + t0 + r] = m[r] + logf(l[r]);
    }
}

// The probability of key row t2 for query row t, P = exp(scale·q·k − lse), and the score
// gradient P ∘ (dout·v − delta); both 0 where t2 > t or t >= T.
struct ScoreGrad {
    float p, ds;
};

__device__ __forceinline__ ScoreGrad score_grad(const float *q, const float *k, const float *dy,
                                                const float *v, float lse, float delta,
                                                float scale, int t, int t2, int t_len, int hs) {
    if (t2 > t || t >= t_len) return {0.0f, 0.0f};
    float p = expf(scale * dot(q, k, hs) - lse);
    return {p, p * (dot(dy, v, hs) - delta)};
}

// delta and dq for query tile blockIdx.x (counted from the last) of query head blockIdx.y.
template <typename X>
__device__ void backward_query(Heads<X> dq, float *delta, Heads<const X> dout, Heads<const X> out,
                               Heads<const X> q, Heads<const X> k, Heads<const X> v,
                               const float *lse, Dims d, Tiles tiles) {
    __shared__ float qs[TILE], dys[TILE], ks[TILE], vs[TILE];
    __shared__ float ds[ROWS * (ROWS + 1)];
    __shared__ float lse_s[ROWS], delta_s[ROWS];
    int bh = blockIdx.y, b = bh / d.nh, h = bh % d.nh, g = h / d.group();
    int hs = d.hs, ld = hs | 1, bq = tiles.q, bk = tiles.k, lp = bk + 1;
    int t0 = query_tile_start(bq), last = min(t0 + bq, d.t_len) - 1;
    float scale = 1.0f / sqrtf((float)hs);
    long row0 = (long)bh * d.t_len; // (b, h, t = 0) of lse and delta
    stage(qs, q, b, t0, bq, h, d);
    stage(dys, dout, b, t0, bq, h, d);
    stage_rows(lse_s, lse + row0, t0, bq, d.t_len);
    stage(ks, out, b, t0, bq, h, d); // out's rows, in ks until the first key tile
    __syncthreads();
    // delta, a thread per row, summed in the order of dot(dout, v) below: where P is one-hot
    // (as at T = 1) out = v exactly, and dS comes out exactly 0.
    for (int r = threadIdx.x; r < bq; r += blockDim.x) {
        delta_s[r] = dot(&dys[r * ld], &ks[r * ld], hs);
        if (t0 + r < d.t_len) delta[row0 + t0 + r] = delta_s[r];
    }
    float acc[BWD_ACC] = {}; // element tid + i·ATT_THREADS of the tile's (tile_q × hs) dq
    for (int k0 = 0; k0 <= last; k0 += bk) {
        __syncthreads(); // the previous key tile is read (and delta_s written)
        stage(ks, k, b, k0, bk, g, d);
        stage(vs, v, b, k0, bk, g, d);
        __syncthreads();
        for (int e = threadIdx.x; e < bq * bk; e += blockDim.x) {
            int r = e / bk, c = e % bk;
            ds[r * lp + c] = score_grad(&qs[r * ld], &ks[c * ld], &dys[r * ld], &vs[c * ld],
                                        lse_s[r], delta_s[r], scale, t0 + r, k0 + c, d.t_len, hs)
                                 .ds;
        }
        __syncthreads();
        for (int i = 0; i < BWD_ACC; i++) {
            int e = threadIdx.x + i * ATT_THREADS, r = e / hs, j = e % hs;
            if (r >= bq) break;
            float a = acc[i];
            for (int c = 0; c < bk; c++) a += ds[r * lp + c] * ks[c * ld + j];
            acc[i] = a;
        }
    }
    for (int i = 0; i < BWD_ACC; i++) {
        int e = threadIdx.x + i * ATT_THREADS, r = e / hs, j = e % hs;
        if (r >= bq) break;
        if (t0 + r < d.t_len) dq.row(b, t0 + r, h, d)[j] = store<X>(acc[i] * scale);
    }
}

// dk and dv for key tile blockIdx.x of key/value head blockIdx.y (after backward_query).
template <typename X>
__device__ void backward_key(Heads<X> dk, Heads<X> dv, Heads<const X> dout, Heads<const X> q,
                             Heads<const X> k, Heads<const X> v, const float *lse,
                             const float *delta, Dims d, Tiles tiles) {
    __shared__ float ks[TILE], vs[TILE], qs[TILE], dys[TILE];
    __shared__ float p[ROWS * (ROWS + 1)], ds[ROWS * (ROWS + 1)];
    __shared__ float lse_s[ROWS], delta_s[ROWS];
    int bg = blockIdx.y, b = bg / d.kv, g = bg % d.kv;
    int hs = d.hs, ld = hs | 1, bq = tiles.q, bk = tiles.k, lp = bk + 1;
    int k0 = blockIdx.x * bk;
    float scale = 1.0f / sqrtf((float)hs);
    stage(ks, k, b, k0, bk, g, d);
    stage(vs, v, b, k0, bk, g, d);
    // Element tid + i·ATT_THREADS of the tile's (tile_k × hs) dk and dv.
    float gk[BWD_ACC] = {}, gv[BWD_ACC] = {};
    for (int h = g * d.group(); h < (g + 1) * d.group(); h++) {
        long row0 = ((long)b * d.nh + h) * d.t_len;
        for (int t0 = k0 / bq * bq; t0 < d.t_len; t0 += bq) {
            __syncthreads(); // the previous query tile is read
            stage(qs, q, b, t0, bq, h, d);
            stage(dys, dout, b, t0, bq, h, d);
            stage_rows(lse_s, lse + row0, t0, bq, d.t_len);
            stage_rows(delta_s, delta + row0, t0, bq, d.t_len);
            __syncthreads();
            for (int e = threadIdx.x; e < bq * bk; e += blockDim.x) {
                int r = e / bk, c = e % bk;
                ScoreGrad s = score_grad(&qs[r * ld], &ks[c * ld], &dys[r * ld], &vs[c * ld],
                                         lse_s[r], delta_s[r], scale, t0 + r, k0 + c, d.t_len, hs);
                p[r * lp + c] = s.p;
                ds[r * lp + c] = s.ds;
            }
            __syncthreads();
            for (int i = 0; i < BWD_ACC; i++) {
                int e = threadIdx.x + i * ATT_THREADS, c = e / hs, j = e % hs;
                if (c >= bk) break;
                float ak = gk[i], av = gv[i];
                for (int r = 0; r < bq; r++) {
                    av += p[r * lp + c] * dys[r * ld + j];
                    ak += ds[r * lp + c] * qs[r * ld + j];
                }
                gk[i] = ak;
                gv[i] = av;
            }
        }
    }
    for (int i = 0; i < BWD_ACC; i++) {
        int e = threadIdx.x + i * ATT_THREADS, c = e / hs, j = e % hs;
        if (c >= bk) break;
        if (k0 + c < d.t_len) {
            dk.row(b, k0 + c, g, d)[j] = store<X>(gk[i] * scale);
            dv.row(b, k0 + c, g, d)[j] = store<X>(gv[i]);
        }
    }
}

// Packed qkv: q, k, v are the three parts of each row of 3C; one key/value head per query head.
#define ENTRY(name, X)                                                                         \
    extern "C" __global__ void attention_forward_##name(X *out, float *lse, const X *qkv,      \
                                                        int t_len, int c, int nh, int tile_q,  \
                                                        int tile_k) {                          \
        Dims d{t_len, nh, nh, c / nh};                                                         \
        long s = 3L * c;                                                                       \
        forward<X>({out, c}, lse, {qkv, s}, {qkv + c, s}, {qkv + 2 * c, s}, d,                 \
                   {tile_q, tile_k});                                                          \
    }                                                                                          \
    extern "C" __global__ void attention_backward_query_##name(                                \
        X *dqkv, float *delta, const X *dout, const X *qkv, const X *out, const float *lse,    \
        int t_len, int c, int nh, int tile_q, int tile_k) {                                    \
        Dims d{t_len, nh, nh, c / nh};                                                         \
        long s = 3L * c;                                                                       \
        backward_query<X>({dqkv, s}, delta, {dout, c}, {out, c}, {qkv, s}, {qkv + c, s},       \
                          {qkv + 2 * c, s}, lse, d, {tile_q, tile_k});                         \
    }                                                                                          \
    extern "C" __global__ void attention_backward_key_##name(                                  \
        X *dqkv, const X *dout, const X *qkv, const float *lse, const float *delta, int t_len, \
        int c, int nh, int tile_q, int tile_k) {                                               \
        Dims d{t_len, nh, nh, c / nh};                                                         \
        long s = 3L * c;                                                                       \
        backward_key<X>({dqkv + c, s}, {dqkv + 2 * c, s}, {dout, c}, {qkv, s}, {qkv + c, s},   \
                        {qkv + 2 * c, s}, lse, delta, d, {tile_q, tile_k});                    \
    }                                                                                          \
    extern "C" __global__ void gqa_attention_forward_##name(                                   \
        X *out, float *lse, const X *q, const X *k, const X *v, int t_len, int nh, int kv,     \
        int hs, int tile_q, int tile_k) {                                                      \
        Dims d{t_len, nh, kv, hs};                                                             \
        long qc = (long)nh * hs, kc = (long)kv * hs;                                           \
        forward<X>({out, qc}, lse, {q, qc}, {k, kc}, {v, kc}, d, {tile_q, tile_k});            \
    }                                                                                          \
    extern "C" __global__ void gqa_attention_backward_query_##name(                            \
        X *dq, float *delta, const X *dout, const X *q, const X *k, const X *v, const X *out,  \
        const float *lse, int t_len, int nh, int kv, int hs, int tile_q, int tile_k) {         \
        Dims d{t_len, nh, kv, hs};                                                             \
        long qc = (long)nh * hs, kc = (long)kv * hs;                                           \
        backward_query<X>({dq, qc}, delta, {dout, qc}, {out, qc}, {q, qc}, {k, kc}, {v, kc},   \
                          lse, d, {tile_q, tile_k});                                           \
    }                                                                                          \
    extern "C" __global__ void gqa_attention_backward_key_##name(                              \
        X *dk, X *dv, const X *dout, const X *q, const X *k, const X *v, const float *lse,     \
        const float *delta, int t_len, int nh, int kv, int hs, int tile_q, int tile_k) {       \
        Dims d{t_len, nh, kv, hs};                                                             \
        long qc = (long)nh * hs, kc = (long)kv * hs;                                           \
        backward_key<X>({dk, kc}, {dv, kc}, {dout, qc}, {q, qc}, {k, kc}, {v, kc}, lse, delta, \
                        d, {tile_q, tile_k});                                                  \
    }
FOR_EACH_DTYPE(ENTRY)
