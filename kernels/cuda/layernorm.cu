// LayerNorm and RMSNorm over the last dimension, statistics in f32 (eps passed by the caller).
// One body for both, as on the CPU: a null `mean` is RMSNorm (rows not centred, m = 0, and no
// bias: `bias`/`dbias` null and no bias partials).
//
// Rows (forward, dinp): one warp per row, blockDim.x / 32 rows per block (8 at the launcher's
// 256 threads); the lanes stride over the row and reduce with butterflies: no block barriers,
// and every thread busy whatever C is. dweight/dbias: two stages over chunks of rows,
// every partial in a fixed order (deterministic).

#define LN_WARPS 8 // blockDim.y of the column sums

// out = (x - m)·rstd·w (+ b) for rows blockIdx.x·warps + warp < n; writes mean (when
// centred) and rstd = 1/sqrt(mean((x - m)²) + eps).
template <typename X>
__device__ void forward(X *out, float *mean, float *rstd, const X *inp, const X *weight,
                        const X *bias, long c, long n, float eps) {
    long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return; // the whole warp: no shuffle is left waiting
    const X *x = inp + row * c;
    float m = 0.0f;
    if (mean) {
        float s = 0.0f;
        for (long j = lane; j < c; j += 32) s += load(x[j]);
        m = warp_sum(s) / (float)c;
    }
    float v = 0.0f;
    for (long j = lane; j < c; j += 32) {
        float d = load(x[j]) - m;
        v += d * d;
    }
    float r = 1.0f / sqrtf(warp_sum(v) / (float)c + eps);
    for (long j = lane; j < c; j += 32) {
        float y = (load(x[j]) - m) * r * load(weight[j]);
        out[row * c + j] = store<X>(bias ? y + load(bias[j]) : y);
    }
    if (lane == 0) {
        if (mean) mean[row] = m;
        rstd[row] = r;
    }
}

// A warp per row: dinp += (w·dy - mean(w·dy) - norm·mean(w·dy·norm))·rstd, without the
// mean(w·dy) term when not centred.
template <typename X>
__device__ void backward_rows(X *dinp, const X *dout, const X *inp, const X *weight,
                              const float *mean, const float *rstd, long c, long n) {
    long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    const X *x = inp + row * c, *dy = dout + row * c;
    float m = mean ? mean[row] : 0.0f, r = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
    for (long j = lane; j < c; j += 32) {
        float wd = load(weight[j]) * load(dy[j]);
        s1 += wd;
        s2 += wd * (load(x[j]) - m) * r;
    }
    s1 = mean ? warp_sum(s1) / (float)c : 0.0f;
    s2 = warp_sum(s2) / (float)c;
    for (long j = lane; j < c; j += 32) {
        float g = (load(weight[j]) * load(dy[j]) - s1 - (load(x[j]) - m) * r * s2) * r;
        dinp[row * c + j] = store<X>(load(dinp[row * c + j]) + g);
    }
}

// dweight/dbias, stage 1: block (x, y) of 32 × LN_WARPS threads (layers::ColumnSums) takes
// columns 32x.. and rows [y·chunk, (y+1)·chunk); thread (tx, ty) sums rows ty, ty + LN_WARPS,
// ... of its column in order, then the LN_WARPS partials of a column are added in a fixed
// tree. parts holds
// Σ dy·norm at [y][j] and, when centred, Σ dy at [gridDim.y + y][j] (2 · gridDim.y · c floats;
// gridDim.y · c for RMSNorm).
template <typename X>
__device__ void backward_column_parts(float *parts, const X *dout, const X *inp,
                                      const float *mean, const float *rstd, long n, long c,
                                      long chunk) {
    __shared__ float pw[LN_WARPS][33], pb[LN_WARPS][33]; // padded: the tree reads down columns
    int tx = threadIdx.x, ty = threadIdx.y;
    long j = (long)blockIdx.x * 32 + tx, lo = (long)blockIdx.y * chunk, hi = min(n, lo + chunk);
    float aw = 0.0f, ab = 0.0f;
    if (j < c) {
        for (long row = lo + ty; row < hi; row += LN_WARPS) {
            float dy = load(dout[row * c + j]);
            aw += dy * ((load(inp[row * c + j]) - (mean ? mean[row] : 0.0f)) * rstd[row]);
            ab += dy;
        }
    }
    pw[ty][tx] = aw;
    pb[ty][tx] = ab;
    sum_down_columns<LN_WARPS>(pw);
    if (mean) sum_down_columns<LN_WARPS>(pb);
    if (ty == 0 && j < c) {
        parts[(long)blockIdx.y * c + j] = pw[0][tx];
        if (mean) parts[((long)gridDim.y + blockIdx.y) * c + j] = pb[0][tx];
    }
}

// Stage 2: per column, the ceil(n / chunk) partials in order, added to dweight and (when not
// null) dbias once.
template <typename X>
__device__ void backward_column_sums(X *dweight, X *dbias, const float *parts, long n, long c,
                                     long chunk) {
    long p = (n + chunk - 1) / chunk;
    FOR_INDEX(j, c) {
        float aw = 0.0f, ab = 0.0f;
        for (long r = 0; r < p; r++) {
            aw += parts[r * c + j];
            if (dbias) ab += parts[(p + r) * c + j];
        }
        dweight[j] = store<X>(load(dweight[j]) + aw);
        if (dbias) dbias[j] = store<X>(load(dbias[j]) + ab);
    }
}

#define ENTRY(name, X)                                                                        \
    extern "C" __global__ void layernorm_forward_##name(X *out, float *mean, float *rstd,     \
                                                        const X *inp, const X *weight,        \
                                                        const X *bias, long c, long n,        \
                                                        float eps) {                          \
        forward(out, mean, rstd, inp, weight, bias, c, n, eps);                               \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_rows_##name(                                \
        X *dinp, const X *dout, const X *inp, const X *weight, const float *mean,             \
        const float *rstd, long c, long n) {                                                  \
        backward_rows(dinp, dout, inp, weight, mean, rstd, c, n);                             \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_column_parts_##name(                        \
        float *parts, const X *dout, const X *inp, const float *mean, const float *rstd,      \
        long n, long c, long chunk) {                                                         \
        backward_column_parts(parts, dout, inp, mean, rstd, n, c, chunk);                     \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_column_sums_##name(                         \
        X *dweight, X *dbias, const float *parts, long n, long c, long chunk) {               \
        backward_column_sums(dweight, dbias, parts, n, c, chunk);                             \
    }                                                                                         \
    extern "C" __global__ void rmsnorm_forward_##name(X *out, float *rstd, const X *inp,      \
                                                      const X *weight, long c, long n,        \
                                                      float eps) {                            \
        forward<X>(out, nullptr, rstd, inp, weight, nullptr, c, n, eps);                      \
    }                                                                                         \
    extern "C" __global__ void rmsnorm_backward_rows_##name(X *dinp, const X *dout,           \
                                                            const X *inp, const X *weight,    \
                                                            const float *rstd, long c,        \
                                                            long n) {                         \
        backward_rows<X>(dinp, dout, inp, weight, nullptr, rstd, c, n);                       \
    }                                                                                         \
    extern "C" __global__ void rmsnorm_backward_column_parts_##name(                          \
        float *parts, const X *dout, const X *inp, const float *rstd, long n, long c,         \
        long chunk) {                                                                         \
        backward_column_parts<X>(parts, dout, inp, nullptr, rstd, n, c, chunk);               \
    }                                                                                         \
    extern "C" __global__ void rmsnorm_backward_column_sums_##name(                           \
        X *dweight, const float *parts, long n, long c, long chunk) {                         \
        backward_column_sums<X>(dweight, nullptr, parts, n, c, chunk);                        \
    }
FOR_EACH_DTYPE(ENTRY)
