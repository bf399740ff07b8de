// Causal multi-head self-attention (scale 1/sqrt(hs)), materialising the probabilities, as
// the CPU back end: qkv (B, T, 3C) laid out [q | k | v], head h in columns h·hs..(h+1)·hs;
// att (B, NH, T, T). One block per (query row t, head (b, h)); blockDim ≥ hs, a multiple of 32.
// These are the fused reference kernels: the scores are dot products in a loop, not a GEMM.

#define MAX_T 1024
#define MAX_HS 256

// out (B, T, C) and att from qkv.
template <typename X>
__device__ void forward(X *out, X *att, const X *qkv, int t_len, int c, int nh) {
    __shared__ float s[MAX_T];
    __shared__ float q[MAX_HS];
    __shared__ float scratch[32];
    int t = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh % nh, hs = c / nh;
    float scale = 1.0f / sqrtf((float)hs);
    const X *base = qkv + (long)b * t_len * 3 * c + h * hs;
    for (int j = threadIdx.x; j < hs; j += blockDim.x) q[j] = load(base[(long)t * 3 * c + j]);
    __syncthreads();
    float mx = __int_as_float(0xff800000);
    for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
        const X *k = base + (long)t2 * 3 * c + c;
        float d = 0.0f;
        for (int j = 0; j < hs; j++) d += q[j] * load(k[j]);
        s[t2] = d * scale;
        mx = fmaxf(mx, s[t2]);
    }
    mx = block_max(mx, scratch);
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
    for (int j = threadIdx.x; j < hs; j += blockDim.x) {
        float o = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) o += s[t2] * load(base[(long)t2 * 3 * c + 2 * c + j]);
        out[((long)b * t_len + t) * c + h * hs + j] = store<X>(o);
    }
}

// Per query row t: datt = dout·v, ds = att ⊙ (datt - Σ att·datt) into datt (f32, 0 above the
// diagonal), dq = scale · Σ ds·k.
template <typename X>
__device__ void backward_query(X *dqkv, float *datt, const X *dout, const X *qkv, const X *att,
                               int t_len, int c, int nh) {
    __shared__ float ds[MAX_T];
    __shared__ float dy[MAX_HS];
    __shared__ float scratch[32];
    int t = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh % nh, hs = c / nh;
    float scale = 1.0f / sqrtf((float)hs);
    const X *base = qkv + (long)b * t_len * 3 * c + h * hs;
    for (int j = threadIdx.x; j < hs; j += blockDim.x) {
        dy[j] = load(dout[((long)b * t_len + t) * c + h * hs + j]);
    }
    __syncthreads();
    const X *a = att + ((long)bh * t_len + t) * t_len;
    float total = 0.0f;
    for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
        const X *v = base + (long)t2 * 3 * c + 2 * c;
        float d = 0.0f;
        for (int j = 0; j < hs; j++) d += dy[j] * load(v[j]);
        ds[t2] = d;
        total += load(a[t2]) * d;
    }
    total = block_sum(total, scratch);
    float *row = datt + ((long)bh * t_len + t) * t_len;
    for (int t2 = threadIdx.x; t2 < t_len; t2 += blockDim.x) {
        float g = t2 <= t ? load(a[t2]) * (ds[t2] - total) : 0.0f;
        if (t2 <= t) ds[t2] = g;
        row[t2] = g;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < hs; j += blockDim.x) {
        float g = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) g += ds[t2] * load(base[(long)t2 * 3 * c + c + j]);
        dqkv[((long)b * t_len + t) * 3 * c + h * hs + j] = store<X>(g * scale);
    }
}

// Per key row t2 (after backward_query): dk = scale · Σ_t ds[t, t2]·q[t],
// dv = Σ_t att[t, t2]·dout[t].
template <typename X>
__device__ void backward_key(X *dqkv, const float *datt, const X *dout, const X *qkv,
                             const X *att, int t_len, int c, int nh) {
    int t2 = blockIdx.x, bh = blockIdx.y, b = bh / nh, h = bh % nh, hs = c / nh;
    float scale = 1.0f / sqrtf((float)hs);
    const X *base = qkv + (long)b * t_len * 3 * c + h * hs;
    for (int j = threadIdx.x; j < hs; j += blockDim.x) {
        float gk = 0.0f, gv = 0.0f;
        for (int t = t2; t < t_len; t++) {
            long at = ((long)bh * t_len + t) * t_len + t2;
            gk += datt[at] * load(base[(long)t * 3 * c + j]);
            gv += load(att[at]) * load(dout[((long)b * t_len + t) * c + h * hs + j]);
        }
        X *d = dqkv + ((long)b * t_len + t2) * 3 * c + h * hs + j;
        d[c] = store<X>(gk * scale);
        d[2 * c] = store<X>(gv);
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
