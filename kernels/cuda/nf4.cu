// NF4: QLoRA's 4-bit storage of frozen weights, as bitsandbytes stores it (kernels/src/nf4.rs
// says the rules). One thread quantizes a block of 64 values; one dequantizes one value.

__device__ __forceinline__ float nf4_code(int q) {
    const float code[16] = {
        -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
        -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
        0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
        0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
    return code[q];
}

// How many midpoints between adjacent codes lie strictly below `scaled` (a tie goes low).
__device__ __forceinline__ int nf4_index(float scaled) {
    scaled = fminf(fmaxf(scaled, -1.0f), 1.0f);
    int q = 0;
    for (int i = 0; i < 15; i++) q += (nf4_code(i) + nf4_code(i + 1)) / 2.0f < scaled;
    return q;
}

#define NF4_BLOCK 64
#define NF4_ZERO 7

#define ENTRY(name, X)                                                                          \
    extern "C" __global__ void nf4_quantize_##name(unsigned char *codes, float *absmax,        \
                                                   const X *src, long n) {                     \
        FOR_INDEX(b, (n + NF4_BLOCK - 1) / NF4_BLOCK) {                                         \
            long start = b * NF4_BLOCK, end = min(start + NF4_BLOCK, n);                        \
            float max = 0.0f;                                                                   \
            for (long i = start; i < end; i++) max = fmaxf(max, fabsf(load(src[i])));           \
            bool full = end - start == NF4_BLOCK;                                               \
            float inverse = 1.0f / max;                                                         \
            for (long i = start; i < end; i += 2) {                                             \
                int high = NF4_ZERO, low = NF4_ZERO;                                            \
                if (max != 0.0f) {                                                              \
                    float a = load(src[i]);                                                     \
                    high = nf4_index(full ? a * inverse : a / max);                             \
                    if (i + 1 < end) {                                                          \
                        float b2 = load(src[i + 1]);                                            \
                        low = nf4_index(full ? b2 * inverse : b2 / max);                        \
                    }                                                                           \
                }                                                                               \
                codes[i / 2] = (unsigned char)(high << 4 | low);                                \
            }                                                                                   \
            /* bitsandbytes clamps a short block's absmax to 1e-38 and stores that. */          \
            absmax[b] = max != 0.0f || full ? max : 1e-38f;                                     \
        }                                                                                       \
    }                                                                                           \
    extern "C" __global__ void nf4_dequantize_##name(X *out, const unsigned char *codes,       \
                                                     const float *absmax, long n) {            \
        FOR_INDEX(i, n) {                                                                       \
            int q = (codes[i / 2] >> (i % 2 == 0 ? 4 : 0)) & 0xf;                               \
            out[i] = store<X>(nf4_code(q) * absmax[i / NF4_BLOCK]);                             \
        }                                                                                       \
    }
FOR_EACH_DTYPE(ENTRY)
