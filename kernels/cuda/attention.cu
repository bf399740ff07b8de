// Causal multi-head self-attention (scale 1/sqrt(hs)), materialising the probabilities, as
// the CPU back end: qkv (B, T, 3C) laid out [q | k | v], head h in columns h·hs..(h+1)·hs;
// att (B, NH, T, T). One block of 32·ATT_WARPS threads per (query or key row t, head (b, h)):
// grid (T, B·NH). These are the fused reference kernels (scores materialised, T ≤ MAX_T).
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

// out (B, T, C) and att from qkv.
template <typename X>
__device__ void forward(X *out, X *att, const X *qkv, int t_len, int c, int nh) {
    __shared__ float s[MAX_T];
    __shared__ float q[MAX_HS];
    __shared__ float part[ATT_WARPS][MAX_HS];
    __shared__ float scratch[32];
    int t = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh % nh, hs = c / nh;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.0f / sqrtf((float)hs);
    const X *base = qkv + (long)b * t_len * 3 * c + h * hs;
    for (int j = threadIdx.x; j < hs; j += blockDim.x) q[j] = load(base[(long)t * 3 * c + j]);
    __syncthreads();
    float mx = __int_as_float(0xff800000);
    for (int t2 = warp; t2 <= t; t2 += ATT_WARPS) {
        float d = warp_dot(q, base + (long)t2 * 3 * c + c, hs) * scale;
        if (lane == 0) s[t2] = d;
        mx = fmaxf(mx, d);
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
    float o = weighted_rows(part, s, base + 2 * c, 3L * c, t, hs); // Σ_t2 p[t2]·v[t2]
    if ((int)threadIdx.x < hs) out[((long)b * t_len + t) * c + h * hs + threadIdx.x] = store<X>(o);
}

// Per query row t: datt = dout·v, ds = att ⊙ (datt - Σ att·datt) into datt (f32, 0 above the
// diagonal), dq = scale · Σ ds·k.
template <typename X>
__device__ void backward_query(X *dqkv, float *datt, const X *dout, const X *qkv, const X *att,
                               int t_len, int c, int nh) {
    __shared__ float ds[MAX_T];
    __shared__ float dy[MAX_HS];
    __shared__ float part[ATT_WARPS][MAX_HS];
    __shared__ float scratch[32];
    int t = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh % nh, hs = c / nh;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.0f / sqrtf((float)hs);
    const X *base = qkv + (long)b * t_len * 3 * c + h * hs;
    for (int j = threadIdx.x; j < hs; j += blockDim.x) {
        dy[j] = load(dout[((long)b * t_len + t) * c + h * hs + j]);
    }
    __syncthreads();
    const X *a = att + ((long)bh * t_len + t) * t_len;
    float total = 0.0f;
    for (int t2 = warp; t2 <= t; t2 += ATT_WARPS) {
        float d = warp_dot(dy, base + (long)t2 * 3 * c + 2 * c, hs);
        if (lane == 0) {
            ds[t2] = d;
            total += load(a[t2]) * d;
        }
    }
    total = block_sum(total, scratch); // its barriers publish ds
    float *row = datt + ((long)bh * t_len + t) * t_len;
    for (int t2 = threadIdx.x; t2 < t_len; t2 += blockDim.x) {
        float g = t2 <= t ? load(a[t2]) * (ds[t2] - total) : 0.0f;
        if (t2 <= t) ds[t2] = g;
        row[t2] = g;
    }
    __syncthreads();
    float g = weighted_rows(part, ds, base + c, 3L * c, t, hs); // Σ_t2 ds[t2]·k[t2]
    if ((int)threadIdx.x < hs) {
        dqkv[((long)b * t_len + t) * 3 * c + h * hs + threadIdx.x] = store<X>(g * scale);
    }
}

// Per key row t2 (after backward_query): dk = scale · Σ_t ds[t, t2]·q[t],
// dv = Σ_t att[t, t2]·dout[t].
template <typename X>
__device__ void backward_key(X *dqkv, const float *datt, const X *dout, const X *qkv,
                             const X *att, int t_len, int c, int nh) {
    __shared__ float part_k[ATT_WARPS][MAX_HS];
    __shared__ float part_v[ATT_WARPS][MAX_HS];
    int t2 = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh % nh, hs = c / nh;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float scale = 1.0f / sqrtf((float)hs);
    const X *base = qkv + (long)b * t_len * 3 * c + h * hs;
    float gk[COLS] = {}, gv[COLS] = {};
    for (int t = t2 + warp; t < t_len; t += ATT_WARPS) {
        long at = ((long)bh * t_len + t) * t_len + t2;
        float g = datt[at], p = load(att[at]);
        const X *q = base + (long)t * 3 * c;
        const X *dy = dout + ((long)b * t_len + t) * c + h * hs;
        for (int i = 0; i < COLS; i++) {
            int j = lane + 32 * i;
            if (j < hs) {
                gk[i] += g * load(q[j]);
                gv[i] += p * load(dy[j]);
            }
        }
    }
    put_warp_part(part_k, gk, hs);
    put_warp_part(part_v, gv, hs);
    float k = sum_warp_parts(part_k, hs), v = sum_warp_parts(part_v, hs);
    if ((int)threadIdx.x < hs) {
        X *d = dqkv + ((long)b * t_len + t2) * 3 * c + h * hs + threadIdx.x;
        d[c] = store<X>(k * scale);
        d[2 * c] = store<X>(v);
    }
}

#define ENTRY(name, X)                                                                        \
    extern "C" __global__ void attention_forward_##name(X *out, X *att, const X *qkv,         \
                                                        int t_len, int c, int nh) {           \
        forward(out, att, qkv, t_len, c, nh);                                                 \
    }                                                                                         \
    extern "C" __global__ void attention_backward_query_##name(                               \
        X *dqkv, float *datt, const X *dout, const X *qkv, const X *att, int t_len, int c,    \
        int nh) {                                                                             \
        backward_query(dqkv, datt, dout, qkv, att, t_len, c, nh);                             \
    }                                                                                         \
    extern "C" __global__ void attention_backward_key_##name(                                 \
        X *dqkv, const float *datt, const X *dout, const X *qkv, const X *att, int t_len,     \
        int c, int nh) {                                                                      \
        backward_key(dqkv, datt, dout, qkv, att, t_len, c, nh);                               \
    }
FOR_EACH_DTYPE(ENTRY)
