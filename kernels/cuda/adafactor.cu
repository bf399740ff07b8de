// Adafactor phases (Hugging Face semantics, relative_step=False, scale_parameter=False) on an
// element range [start, start + len) of a (rows, cols) matrix or of a vector, as the CPU back
// end. Sums that cross shards are exact: LIMBS integer-valued f64 limbs per sum, limb j a
// multiple of 2^(24j - 149). Integer-valued f64 additions below 2^53 are exact, so the f64
// atomics here give the same bits in any order: deterministic, and equal to the CPU's sums.

#define LIMBS 12

// Add a non-negative f32 exactly; inf or NaN poisons limb 0 as a float sum would.
__device__ void exact_add(double *acc, float x) {
    if (!finite(x)) {
        atomicAdd(acc, (double)x);
        return;
    }
    unsigned bits = __float_as_uint(x) & 0x7fffffffu, e = bits >> 23, m = bits & 0x7fffffu;
    unsigned sig = e == 0 ? m : (m | 0x800000u), s = e == 0 ? 0 : e - 1;
    unsigned long long v = (unsigned long long)sig << (s % 24);
    int j = s / 24;
    atomicAdd(acc + j, (double)(v & 0xffffffull));
    atomicAdd(acc + j + 1, (double)(v >> 24));
}

// The f32 nearest the exact sum: carries normalised, limbs added from the top.
__device__ float exact_value(const double *acc) {
    double total = 0.0;
    bool all_finite = true;
    for (int j = 0; j < LIMBS; j++) {
        total += acc[j];
        all_finite = all_finite && isfinite(acc[j]);
    }
    if (!all_finite) return (float)total;
    unsigned long long digits[LIMBS + 2], carry = 0;
    for (int j = 0; j < LIMBS + 2; j++) {
        unsigned long long t = (j < LIMBS ? (unsigned long long)acc[j] : 0ull) + carry;
        digits[j] = t & 0xffffffull;
        carry = t >> 24;
    }
    double v = 0.0;
    for (int j = LIMBS + 1; j >= 0; j--) v += ldexp((double)digits[j], 24 * j - 149);
    return (float)v;
}

// Phase 1 (matrix): row and column sums of g² + eps1 over the range.
template <typename G>
__device__ void sq_sums(const G *grad, long start, long len, long cols, float grad_scale,
                        float eps1, double *row_sums, double *col_sums) {
    FOR_INDEX(i, len) {
        float g = load(grad[i]) * grad_scale;
        float sq = g * g + eps1;
        long at = start + i;
        exact_add(row_sums + (at / cols) * LIMBS, sq);
        exact_add(col_sums + (at % cols) * LIMBS, sq);
    }
}

// Phase 2 (matrix), once for the rows (n = cols) and once for the columns (n = rows):
// s = b·s + (1-b)·(sum / n).
extern "C" __global__ void adafactor_update_stats(float *s, const double *sums, long count,
                                                  float n, float b) {
    FOR_INDEX(i, count) s[i] = b * s[i] + (1.0f - b) * (exact_value(sums + i * LIMBS) / n);
}

// mean(row) in the CPU's order: 16 lanes over the row, then the lanes pairwise. One block of
// 16 threads.
extern "C" __global__ void adafactor_row_mean(float *mean, const float *row, long rows) {
    __shared__ float acc[16];
    float s = 0.0f;
    for (long i = threadIdx.x; i < rows; i += 16) s += row[i];
    acc[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 8; w > 0; w /= 2) {
            for (int l = 0; l < w; l++) acc[l] += acc[l + w];
        }
        *mean = acc[0] / (float)rows;
    }
}

// Phase 1 (vector): v = b·v + (1-b)·(g² + eps1) and Σ u² of u = g / sqrt(v).
template <typename G>
__device__ void vector_ema(float *v, const G *grad, long len, float grad_scale, float eps1,
                           float b, double *rms_sum) {
    FOR_INDEX(i, len) {
        float g = load(grad[i]) * grad_scale;
        float vi = b * v[i] + (1.0f - b) * (g * g + eps1);
        v[i] = vi;
        float u = (1.0f / sqrtf(vi)) * g;
        exact_add(rms_sum, u * u);
    }
}

// The per-element scale of the update: factored (row, col, row_mean) or full (v, by range index).
__device__ __forceinline__ float moment_scale(long i, long start, long cols, const float *row,
                                              const float *col, const float *row_mean,
                                              const float *v) {
    if (v) return 1.0f / sqrtf(v[i]);
    long at = start + i;
    return (1.0f / sqrtf(row[at / cols] / *row_mean)) * (1.0f / sqrtf(col[at % cols]));
}

// Phase 3 (matrix): Σ u² of u = scale · g over the range.
template <typename G>
__device__ void rms_sum(const G *grad, long start, long len, long cols, float grad_scale,
                        const float *row, const float *col, const float *row_mean,
                        double *sum) {
    FOR_INDEX(i, len) {
        float u = moment_scale(i, start, cols, row, col, row_mean, nullptr) * (load(grad[i]) * grad_scale);
        exact_add(sum, u * u);
    }
}

// Last phase: u = scale·g / max(rms(u)/clip, 1)·lr, optionally through the EMA exp_avg, then
// master -= u. v not null selects the full moment, else row/col/row_mean.
template <typename G, typename X>
__device__ void apply(float *master, const G *grad, float *exp_avg, X *out, long start, long len,
                      long cols, const float *row, const float *col, const float *row_mean,
                      const float *v, const double *rms, float numel, float lr, float clip,
                      float beta1, float grad_scale) {
    float r = sqrtf(exact_value(rms)) / sqrtf(numel);
    float denom = fmaxf(r / clip, 1.0f);
    FOR_INDEX(i, len) {
        float g = load(grad[i]) * grad_scale;
        float u = moment_scale(i, start, cols, row, col, row_mean, v) * g / denom * lr;
        if (exp_avg) {
            u = beta1 * exp_avg[i] + (1.0f - beta1) * u;
            exp_avg[i] = u;
        }
        float p = master[i] - u;
        master[i] = p;
        if (out) out[i] = store<X>(p);
    }
}

#define ENTRY_G(gn, G)                                                                        \
    extern "C" __global__ void adafactor_sq_sums_##gn(const G *grad, long start, long len,    \
                                                      long cols, float grad_scale,            \
                                                      float eps1, double *row_sums,           \
                                                      double *col_sums) {                     \
        sq_sums(grad, start, len, cols, grad_scale, eps1, row_sums, col_sums);                \
    }                                                                                         \
    extern "C" __global__ void adafactor_vector_ema_##gn(float *v, const G *grad, long len,   \
                                                         float grad_scale, float eps1,        \
                                                         float b, double *rms_sum) {          \
        vector_ema(v, grad, len, grad_scale, eps1, b, rms_sum);                               \
    }                                                                                         \
    extern "C" __global__ void adafactor_rms_sum_##gn(                                        \
        const G *grad, long start, long len, long cols, float grad_scale, const float *row,   \
        const float *col, const float *row_mean, double *sum) {                               \
        rms_sum(grad, start, len, cols, grad_scale, row, col, row_mean, sum);                 \
    }                                                                                         \
    ENTRY(gn, G, f32, float) ENTRY(gn, G, bf16, bf16) ENTRY(gn, G, f16, f16)
#define ENTRY(gn, G, xn, X)                                                                   \
    extern "C" __global__ void adafactor_apply_##gn##_##xn(                                   \
        float *master, const G *grad, float *exp_avg, X *out, long start, long len,           \
        long cols, const float *row, const float *col, const float *row_mean,                 \
        const float *v, const double *rms, float numel, float lr, float clip, float beta1,    \
        float grad_scale) {                                                                   \
        apply(master, grad, exp_avg, out, start, len, cols, row, col, row_mean, v, rms,       \
              numel, lr, clip, beta1, grad_scale);                                            \
    }
FOR_EACH_DTYPE(ENTRY_G)
