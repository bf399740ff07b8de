// Causal self-attention (scale 1/sqrt(hs)), materialising the probabilities, as the CPU back
// end, in two layouts that share every kernel body: GPT-2's multi-head attention on a packed
// qkv (B, T, 3C) laid out [q | k | v], head h in columns h·hs..(h+1)·hs of each part, and
// grouped-query attention (Llama) on q (B, T, NH·hs), k and v (B, T, KV·hs), where query head
// h reads key/value head h / (NH/KV). att is (B, NH, T, T). One block of 32·ATT_WARPS threads
// per (query row t, query head (b, h)): grid (T, B·NH), or per (key row t, key/value head
// (b, g)) for the key gradients: grid (T, B·KV). These are the fused reference kernels (scores
// materialised, T ≤ MAX_T).
//
// Every thread works: a warp per key row for the dot products (lanes over the head's
// columns, butterfly sums), and for the weighted sums over rows (out, dq, dk, dv) each warp
// takes every ATT_WARPS-th row with its lanes over the columns, then the warps' partial rows
// are added in warp order. Deterministic for a given ATT_WARPS.

#define MAX_T 1024
#define MAX_HS 256
#define ATT_WARPS 8
#define COLS (MAX_HS / 32) // columns per lane

// Each thread j < hs gets Σ_warps part[w][j], in warp order; `part` is written by the caller's
// lanes before (this barriers first) and free again once this returns.
__device__ __forceinline__ float sum_warp_parts(float (*part)[MAX_HS], int hs) {
    __syncthreads();
    float s = 0.0f;
    if ((int)threadIdx.x < hs) {
        for (int w = 0; w < ATT_WARPS; w++) s += part[w][threadIdx.x];
    }
    __syncthreads();
    return s;
}

// acc[k] (column lane + 32k) into this warp's row of part, zero where nothing was added.
__device__ __forceinline__ void put_warp_part(float (*part)[MAX_HS], const float *acc, int hs) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int k = 0; k < COLS; k++) {
        int j = lane + 32 * k;
        if (j < hs) part[warp][j] = acc[k];
    }
}

// The dot product of `a` (shared, f32) and row `x` over hs columns: lanes stride the columns,
// every lane gets the total.
template <typename X>
__device__ __forceinline__ float warp_dot(const float *a, const X *x, int hs) {
    float d = 0.0f;
    for (int j = threadIdx.x % 32; j < hs; j += 32) d += a[j] * load(x[j]);
    return warp_sum(d);
}

// For the thread's column j = threadIdx.x < hs (0 for the others): Σ_{r ≤ last} w[r]·m[r][j],
// rows `stride` apart. Warp w takes rows w, w + ATT_WARPS, …, its lanes the columns.
template <typename X>
__device__ float weighted_rows(float (*part)[MAX_HS], const float *w, const X *m, long stride,
                               int last, int hs) {
    int lane = threadIdx.x % 32;
    float acc[COLS] = {};
    for (int r = threadIdx.x / 32; r <= last; r += ATT_WARPS) {
        const X *row = m + r * stride;
        for (int k = 0; k < COLS; k++) {
            int j = lane + 32 * k;
            if (j < hs) acc[k] += w[r] * load(row[j]);
        }
    }
    put_warp_part(part, acc, hs);
    return sum_warp_parts(part, hs);
}

// The shapes of a call: sequence length, query and key/value heads, head size.
struct Dims {
    int t_len, nh, kv, hs;
    __device__ __forceinline__ int group() const { return nh / kv; }
};

// Where a tensor keeps its heads: row (b, t) of head h starts at p + (b·T + t)·stride + h·hs.
template <typename P> struct Heads {
    P *p;
    long stride;
    __device__ __forceinline__ P *row(long b, long t, long h, const Dims &d) const {
        return p + (b * d.t_len + t) * stride + h * d.hs;
    }
};

// out and att for query row blockIdx.x of query head blockIdx.y.
template <typename X>
__device__ void forward(Heads<X> out, X *att, Heads<const X> q, Heads<const X> k,
                        Heads<const X> v, Dims d) {
    __shared__ float s[MAX_T];
    __shared__ float qs[MAX_HS];
    __shared__ float part[ATT_WARPS][MAX_HS];
    __shared__ float scratch[32];
    int t = blockIdx.x, bh = blockIdx.y, b = bh / d.nh, h = bh % d.nh, g = h / d.group();
    int hs = d.hs, t_len = d.t_len;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.0f / sqrtf((float)hs);
    const X *qr = q.row(b, t, h, d);
    for (int j = threadIdx.x; j < hs; j += blockDim.x) qs[j] = load(qr[j]);
    __syncthreads();
    float mx = __int_as_float(0xff800000);
    for (int t2 = warp; t2 <= t; t2 += ATT_WARPS) {
        float dt = warp_dot(qs, k.row(b, t2, g, d), hs) * scale;
        if (lane == 0) s[t2] = dt;
        mx = fmaxf(mx, dt);
    }
    mx = block_max(mx, scratch); // its barriers publish s
    float sum = 0.0f;
    for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
        s[t2] = expf(s[t2] - mx);
        sum += s[t2];
    }
    float inv = 1.0f / block_sum(sum, scratch);
    X *a = att + ((long)bh * t_len + t) * t_len;
    for (int t2 = threadIdx.x; t2 < t_len; t2 += blockDim.x) {
        float p = t2 <= t ? s[t2] * inv : 0.0f;
        if (t2 <= t) s[t2] = p;
        a[t2] = store<X>(p);
    }
    __syncthreads();
    float o = weighted_rows(part, s, v.row(b, 0, g, d), v.stride, t, hs); // Σ_t2 p[t2]·v[t2]
    if ((int)threadIdx.x < hs) out.row(b, t, h, d)[threadIdx.x] = store<X>(o);
}

// Per query row t of query head h: datt = dout·v, ds = att ⊙ (datt - Σ att·datt) into datt
// (f32, 0 above the diagonal), dq = scale · Σ ds·k.
template <typename X>
__device__ void backward_query(Heads<X> dq, float *datt, Heads<const X> dout, Heads<const X> k,
                               Heads<const X> v, const X *att, Dims d) {
    __shared__ float ds[MAX_T];
    __shared__ float dy[MAX_HS];
    __shared__ float part[ATT_WARPS][MAX_HS];
    __shared__ float scratch[32];
    int t = blockIdx.x, bh = blockIdx.y, b = bh / d.nh, h = bh % d.nh, g = h / d.group();
    int hs = d.hs, t_len = d.t_len;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.0f / sqrtf((float)hs);
    const X *dyr = dout.row(b, t, h, d);
    for (int j = threadIdx.x; j < hs; j += blockDim.x) dy[j] = load(dyr[j]);
    __syncthreads();
    const X *a = att + ((long)bh * t_len + t) * t_len;
    float total = 0.0f;
    for (int t2 = warp; t2 <= t; t2 += ATT_WARPS) {
        float dt = warp_dot(dy, v.row(b, t2, g, d), hs);
        if (lane == 0) {
            ds[t2] = dt;
            total += load(a[t2]) * dt;
        }
    }
    total = block_sum(total, scratch); // its barriers publish ds
    float *row = datt + ((long)bh * t_len + t) * t_len;
    for (int t2 = threadIdx.x; t2 < t_len; t2 += blockDim.x) {
        float gr = t2 <= t ? load(a[t2]) * (ds[t2] - total) : 0.0f;
        if (t2 <= t) ds[t2] = gr;
        row[t2] = gr;
    }
    __syncthreads();
    float gq = weighted_rows(part, ds, k.row(b, 0, g, d), k.stride, t, hs); // Σ_t2 ds[t2]·k[t2]
    if ((int)threadIdx.x < hs) dq.row(b, t, h, d)[threadIdx.x] = store<X>(gq * scale);
}

// Per key row t2 of key/value head g (after backward_query), over the group's query heads h
// in order, then t: dk = scale · Σ ds[t, t2]·q[t], dv = Σ att[t, t2]·dout[t].
template <typename X>
__device__ void backward_key(Heads<X> dk, Heads<X> dv, const float *datt, Heads<const X> dout,
                             Heads<const X> q, const X *att, Dims d) {
    __shared__ float part_k[ATT_WARPS][MAX_HS];
    __shared__ float part_v[ATT_WARPS][MAX_HS];
    int t2 = blockIdx.x, bg = blockIdx.y, b = bg / d.kv, g = bg % d.kv, hs = d.hs, t_len = d.t_len;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.0f / sqrtf((float)hs);
    float gk[COLS] = {}, gv[COLS] = {};
    for (int h = g * d.group(); h < (g + 1) * d.group(); h++) {
        long bh = (long)b * d.nh + h;
        for (int t = t2 + warp; t < t_len; t += ATT_WARPS) {
            long at = (bh * t_len + t) * t_len + t2;
            float w = datt[at], p = load(att[at]);
            const X *qr = q.row(b, t, h, d), *dy = dout.row(b, t, h, d);
            for (int i = 0; i < COLS; i++) {
                int j = lane + 32 * i;
                if (j < hs) {
                    gk[i] += w * load(qr[j]);
                    gv[i] += p * load(dy[j]);
                }
            }
        }
    }
    put_warp_part(part_k, gk, hs);
    put_warp_part(part_v, gv, hs);
    float sk = sum_warp_parts(part_k, hs), sv = sum_warp_parts(part_v, hs);
    if ((int)threadIdx.x < hs) {
        dk.row(b, t2, g, d)[threadIdx.x] = store<X>(sk * scale);
        dv.row(b, t2, g, d)[threadIdx.x] = store<X>(sv);
    }
}

// Packed qkv: q, k, v are the three parts of each row of 3C; one key/value head per query head.
#define ENTRY(name, X)                                                                        \
    extern "C" __global__ void attention_forward_##name(X *out, X *att, const X *qkv,         \
                                                        int t_len, int c, int nh) {           \
        Dims d{t_len, nh, nh, c / nh};                                                        \
        long s = 3L * c;                                                                      \
        forward<X>({out, c}, att, {qkv, s}, {qkv + c, s}, {qkv + 2 * c, s}, d);               \
    }                                                                                         \
    extern "C" __global__ void attention_backward_query_##name(                               \
        X *dqkv, float *datt, const X *dout, const X *qkv, const X *att, int t_len, int c,    \
        int nh) {                                                                             \
        Dims d{t_len, nh, nh, c / nh};                                                        \
        long s = 3L * c;                                                                      \
        backward_query<X>({dqkv, s}, datt, {dout, c}, {qkv + c, s}, {qkv + 2 * c, s}, att, d); \
    }                                                                                         \
    extern "C" __global__ void attention_backward_key_##name(                                 \
        X *dqkv, const float *datt, const X *dout, const X *qkv, const X *att, int t_len,     \
        int c, int nh) {                                                                      \
        Dims d{t_len, nh, nh, c / nh};                                                        \
        long s = 3L * c;                                                                      \
        backward_key<X>({dqkv + c, s}, {dqkv + 2 * c, s}, datt, {dout, c}, {qkv, s}, att, d); \
    }                                                                                         \
    extern "C" __global__ void gqa_attention_forward_##name(                                  \
        X *out, X *att, const X *q, const X *k, const X *v, int t_len, int nh, int kv,        \
        int hs) {                                                                             \
        Dims d{t_len, nh, kv, hs};                                                            \
        long qc = (long)nh * hs, kc = (long)kv * hs;                                          \
        forward<X>({out, qc}, att, {q, qc}, {k, kc}, {v, kc}, d);                             \
    }                                                                                         \
    extern "C" __global__ void gqa_attention_backward_query_##name(                           \
        X *dq, float *datt, const X *dout, const X *k, const X *v, const X *att, int t_len,   \
        int nh, int kv, int hs) {                                                             \
        Dims d{t_len, nh, kv, hs};                                                            \
        long qc = (long)nh * hs, kc = (long)kv * hs;                                          \
        backward_query<X>({dq, qc}, datt, {dout, qc}, {k, kc}, {v, kc}, att, d);              \
    }                                                                                         \
    extern "C" __global__ void gqa_attention_backward_key_##name(                             \
        X *dk, X *dv, const float *datt, const X *dout, const X *q, const X *att, int t_len,  \
        int nh, int kv, int hs) {                                                             \
        Dims d{t_len, nh, kv, hs};                                                            \
        long qc = (long)nh * hs, kc = (long)kv * hs;                                          \
        backward_key<X>({dk, kc}, {dv, kc}, datt, {dout, qc}, {q, qc}, att, d);               \
    }
FOR_EACH_DTYPE(ENTRY)
