// Casts between f32 and the 16-bit storage dtypes (RNE, NaN payloads kept: see common.cuh).

template <typename X> __device__ void to_f32(float *dst, const X *src, long n) {
    FOR_INDEX(i, n) dst[i] = load(src[i]);
}

template <typename X> __device__ void from_f32(X *dst, const float *src, long n) {
    FOR_INDEX(i, n) dst[i] = store<X>(src[i]);
}

#define ENTRY(name, X)                                                                     \
    extern "C" __global__ void cast_to_f32_##name(float *dst, const X *src, long n) {      \
        to_f32(dst, src, n);                                                               \
    }                                                                                      \
    extern "C" __global__ void cast_from_f32_##name(X *dst, const float *src, long n) {    \
        from_f32(dst, src, n);                                                             \
    }
ENTRY(bf16, bf16)
ENTRY(f16, f16)
