// Block-wise 8-bit Adam (bitsandbytes Adam8bit semantics, as the CPU back end): m and v are
// byte indices into the signed / unsigned dynamic maps scaled by a per-block absmax. One CUDA
// block per quantisation block of `block` elements; the maxima are order-independent, so the
// result is deterministic. eps_hat = eps·sqrt(1-β2^t), step_size = lr·sqrt(1-β2^t)/(1-β1^t).

// Index of the code nearest to x (ties to the upper code).
__device__ __forceinline__ unsigned char quantize(const float *code, float x) {
    int lo = 0, hi = 256; // first index with code[i] >= x
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (code[mid] < x) lo = mid + 1; else hi = mid;
    }
    if (lo == 0) return 0;
    if (lo == 256) return 255;
    return x - code[lo - 1] < code[lo] - x ? lo - 1 : lo;
}

template <typename G, typename X>
__device__ void step(float *master, const G *grad, unsigned char *m, unsigned char *v,
                     float *absmax_m, float *absmax_v, X *out, const float *code_m,
                     const float *code_v, long n, long block, float beta1, float beta2,
                     float eps_hat, float step_size, float grad_scale) {
    __shared__ float cm[256], cv[256], scratch[32];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        cm[i] = code_m[i];
        cv[i] = code_v[i];
    }
    long b = blockIdx.x, lo = b * block, hi = min(n, lo + block);
    float old_m = absmax_m[b], old_v = absmax_v[b];
    __syncthreads();
    float max1 = 0.0f, max2 = 0.0f;
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float g = load(grad[i]) * grad_scale;
        float s1 = beta1 * (cm[m[i]] * old_m) + (1.0f - beta1) * g;
        float s2 = beta2 * (cv[v[i]] * old_v) + (1.0f - beta2) * g * g;
        max1 = fmaxf(max1, fabsf(s1));
        max2 = fmaxf(max2, s2);
    }
    max1 = block_max(max1, scratch);
    max2 = block_max(max2, scratch);
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float g = load(grad[i]) * grad_scale;
        float s1 = beta1 * (cm[m[i]] * old_m) + (1.0f - beta1) * g;
        float s2 = beta2 * (cv[v[i]] * old_v) + (1.0f - beta2) * g * g;
        float p = master[i] - step_size * s1 / (sqrtf(s2) + eps_hat);
        master[i] = p;
        m[i] = quantize(cm, max1 > 0.0f ? s1 / max1 : 0.0f);
        v[i] = quantize(cv, max2 > 0.0f ? s2 / max2 : 0.0f);
        if (out) out[i] = store<X>(p);
    }
    if (threadIdx.x == 0) {
        absmax_m[b] = max1;
        absmax_v[b] = max2;
    }
}

#define ENTRY(gn, G, xn, X)                                                                   \
    extern "C" __global__ void adam8bit_step_##gn##_##xn(                                     \
        float *master, const G *grad, unsigned char *m, unsigned char *v, float *absmax_m,    \
        float *absmax_v, X *out, const float *code_m, const float *code_v, long n,            \
        long block, float beta1, float beta2, float eps_hat, float step_size,                 \
        float grad_scale) {                                                                   \
        step(master, grad, m, v, absmax_m, absmax_v, out, code_m, code_v, n, block, beta1,    \
             beta2, eps_hat, step_size, grad_scale);                                          \
    }
#define ENTRY_G(gn, G) ENTRY(gn, G, f32, float) ENTRY(gn, G, bf16, bf16) ENTRY(gn, G, f16, f16)
FOR_EACH_DTYPE(ENTRY_G)
