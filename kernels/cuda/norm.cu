// Gradient checks for mixed precision: unscaling with a found-inf flag, and the sum of
// squares for the global norm in two fixed-order stages (no float atomics: the same bits
// every run).

// grad *= inv_scale in place; *found_inf = 1 if any result is inf or NaN (a plain store of the
// same value from any thread: no ordering matters).
template <typename G> __device__ void unscale(G *grad, float inv_scale, long n, int *found_inf) {
    FOR_INDEX(i, n) {
        float g = load(grad[i]) * inv_scale;
        if (!finite(g)) *found_inf = 1;
        grad[i] = store<G>(g);
    }
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block p writes Σ x² over [p·chunk, (p+1)·chunk) ∩ [0, n) to parts[p], in f64.
template <typename X> __device__ void sum_squares_parts(double *parts, const X *x, long n, long chunk) {
    __shared__ double scratch[32];
    long lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    double s = 0.0;
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        double v = load(x[i]);
        s += v * v;
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    s = warp_sum_f64(s);
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < blockDim.x / 32 ? scratch[lane] : 0.0;
        s = warp_sum_f64(s);
        if (lane == 0) parts[blockIdx.x] = s;
    }
}

// One thread: *total = Σ parts in index order.
extern "C" __global__ void sum_parts(double *total, const double *parts, int count) {
    double s = 0.0;
    for (int p = 0; p < count; p++) s += parts[p];
    *total = s;
}

#define ENTRY(name, X)                                                                         \
    extern "C" __global__ void unscale_##name(X *grad, float inv_scale, long n, int *found_inf) { \
        unscale(grad, inv_scale, n, found_inf);                                                \
    }                                                                                          \
    extern "C" __global__ void sum_squares_parts_##name(double *parts, const X *x, long n,     \
                                                        long chunk) {                          \
        sum_squares_parts(parts, x, n, chunk);                                                 \
    }
FOR_EACH_DTYPE(ENTRY)
