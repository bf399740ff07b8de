// LayerNorm over the last dimension, statistics in f32 (eps passed by the caller).

// One block per row: out = (x - mean)·rstd·w + b; writes mean and rstd = 1/sqrt(var + eps).
template <typename X>
__device__ void forward(X *out, float *mean, float *rstd, const X *inp, const X *weight,
                        const X *bias, long c, float eps) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    const X *x = inp + row * c;
    float s = 0.0f;
    for (long j = threadIdx.x; j < c; j += blockDim.x) s += load(x[j]);
    float m = block_sum(s, scratch) / (float)c;
    float v = 0.0f;
    for (long j = threadIdx.x; j < c; j += blockDim.x) {
        float d = load(x[j]) - m;
        v += d * d;
    }
    float r = 1.0f / sqrtf(block_sum(v, scratch) / (float)c + eps);
    for (long j = threadIdx.x; j < c; j += blockDim.x) {
        out[row * c + j] = store<X>((load(x[j]) - m) * r * load(weight[j]) + load(bias[j]));
    }
    if (threadIdx.x == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// One block per row: dinp += (w·dy - mean(w·dy) - norm·mean(w·dy·norm))·rstd.
template <typename X>
__device__ void backward_rows(X *dinp, const X *dout, const X *inp, const X *weight,
                              const float *mean, const float *rstd, long c) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    const X *x = inp + row * c, *dy = dout + row * c;
    float m = mean[row], r = rstd[row];
    float s1 = 0.0f, s2 = 0.0f;
    for (long j = threadIdx.x; j < c; j += blockDim.x) {
        float wd = load(weight[j]) * load(dy[j]);
        s1 += wd;
        s2 += wd * (load(x[j]) - m) * r;
    }
    s1 = block_sum(s1, scratch) / (float)c;
    s2 = block_sum(s2, scratch) / (float)c;
    for (long j = threadIdx.x; j < c; j += blockDim.x) {
        float g = (load(weight[j]) * load(dy[j]) - s1 - (load(x[j]) - m) * r * s2) * r;
        dinp[row * c + j] = store<X>(load(dinp[row * c + j]) + g);
    }
}

// One thread per column: dweight += Σ_rows dy·norm, dbias += Σ_rows dy, rows in order (the
// CPU order). Deterministic but only C threads: a two-stage reduction is the faster follow-up.
template <typename X>
__device__ void backward_columns(X *dweight, X *dbias, const X *dout, const X *inp,
                                 const float *mean, const float *rstd, long n, long c) {
    FOR_INDEX(j, c) {
        float aw = 0.0f, ab = 0.0f;
        for (long row = 0; row < n; row++) {
            float dy = load(dout[row * c + j]);
            aw += dy * ((load(inp[row * c + j]) - mean[row]) * rstd[row]);
            ab += dy;
        }
        dweight[j] = store<X>(load(dweight[j]) + aw);
        dbias[j] = store<X>(load(dbias[j]) + ab);
    }
}

#define ENTRY(name, X)                                                                        \
    extern "C" __global__ void layernorm_forward_##name(X *out, float *mean, float *rstd,     \
                                                        const X *inp, const X *weight,        \
                                                        const X *bias, long c, float eps) {   \
        forward(out, mean, rstd, inp, weight, bias, c, eps);                                  \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_rows_##name(                                \
        X *dinp, const X *dout, const X *inp, const X *weight, const float *mean,             \
        const float *rstd, long c) {                                                          \
        backward_rows(dinp, dout, inp, weight, mean, rstd, c);                                \
    }                                                                                         \
    extern "C" __global__ void layernorm_backward_columns_##name(                             \
        X *dweight, X *dbias, const X *dout, const X *inp, const float *mean,                 \
        const float *rstd, long n, long c) {                                                  \
        backward_columns(dweight, dbias, dout, inp, mean, rstd, n, c);                        \
    }
FOR_EACH_DTYPE(ENTRY)
