// The bias gradient of a dense layer: dbias[j] += Σ_i dout[i, j] over the M rows of an (M, N)
// dout. cuBLASLt's bias-gradient epilogue overwrites; the trainer accumulates across
// micro-steps, so the sum is a kernel of its own, in two stages (deterministic for any M):
//
// 1. matmul_bias_backward_parts_<dout dtype>: block (x, y) of 32 × 8 threads takes columns
//    32x.. and rows [y·chunk, (y+1)·chunk); thread (tx, ty) sums rows ty, ty + 8, … of its
//    column in order (coalesced along rows), then the 8 partials of a column are added in a
//    fixed tree into parts[y][j]. Grid y spreads the M rows over the GPU (B·T = 65,536 rows
//    at B 64 would leave one block per 32 columns serial over them all).
// 2. matmul_bias_backward_sums_<dbias dtype>: dbias[j] += the ceil(M / chunk) partials of
//    column j in order, in f32, rounded once.

#define ROWS_Y 8

template <typename G>
__device__ void bias_parts(float *parts, const G *dout, long m, long n, long chunk) {
    __shared__ float part[ROWS_Y][33]; // padded: the tree reads down columns
    int tx = threadIdx.x, ty = threadIdx.y;
    long j = (long)blockIdx.x * 32 + tx, lo = (long)blockIdx.y * chunk, hi = min(m, lo + chunk);
    float acc = 0.0f;
    if (j < n) {
        for (long i = lo + ty; i < hi; i += ROWS_Y) acc += load(dout[i * n + j]);
    }
    part[ty][tx] = acc;
    sum_down_columns<ROWS_Y>(part);
    if (ty == 0 && j < n) parts[(long)blockIdx.y * n + j] = part[0][tx];
}

template <typename X>
__device__ void bias_sums(X *dbias, const float *parts, long m, long n, long chunk) {
    long p = (m + chunk - 1) / chunk;
    FOR_INDEX(j, n) {
        float s = 0.0f;
        for (long r = 0; r < p; r++) s += parts[r * n + j];
        dbias[j] = store<X>(load(dbias[j]) + s);
    }
}

#define ENTRY(name, X)                                                                      \
    extern "C" __global__ void matmul_bias_backward_parts_##name(                           \
        float *parts, const X *dout, long m, long n, long chunk) {                          \
        bias_parts<X>(parts, dout, m, n, chunk);                                            \
    }                                                                                       \
    extern "C" __global__ void matmul_bias_backward_sums_##name(                            \
        X *dbias, const float *parts, long m, long n, long chunk) {                         \
        bias_sums<X>(dbias, parts, m, n, chunk);                                            \
    }
FOR_EACH_DTYPE(ENTRY)
