// The bias gradient of a dense layer: dbias[j] += Σ_i dout[i, j] over the M rows of an (M, N)
// dout. cuBLASLt's bias-gradient epilogue overwrites; the trainer accumulates across
// micro-steps, so the sum is a kernel of its own.
//
// One block of 32 × 32 threads per 32 columns: thread (x, y) sums rows y, y + 32, … of its
// column in order, then the 32 partials of each column are added in a fixed tree and the total
// is added to dbias in f32 and rounded once. Deterministic for any M; coalesced along rows.

template <typename X, typename G>
__device__ void bias_backward(X *dbias, const G *dout, long m, long n) {
    __shared__ float part[32][33]; // padded: the tree reads down columns
    long j = (long)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (j < n) {
        for (long i = threadIdx.y; i < m; i += 32) acc += load(dout[i * n + j]);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (threadIdx.y < s) part[threadIdx.y][threadIdx.x] += part[threadIdx.y + s][threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.y == 0 && j < n) dbias[j] = store<X>(load(dbias[j]) + part[0][threadIdx.x]);
}

// matmul_bias_backward_<dbias dtype>_<dout dtype>: dout is X, or f32 (dlogits).
#define ENTRY(xname, X, gname, G)                                                          \
    extern "C" __global__ void matmul_bias_backward_##xname##_##gname(                     \
        X *dbias, const G *dout, long m, long n) {                                          \
        bias_backward<X, G>(dbias, dout, m, n);                                             \
    }
ENTRY(f32, float, f32, float)
ENTRY(bf16, bf16, bf16, bf16)
ENTRY(f16, f16, f16, f16)
ENTRY(bf16, bf16, f32, float)
ENTRY(f16, f16, f32, float)
