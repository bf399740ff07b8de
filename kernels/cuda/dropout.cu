// Dropout on LoRA adapters' input with a mask nobody stores (kernels/src/dropout.rs says the
// rules): element i is dropped when the (offset + i)-th output of splitmix64 seeded with the key,
// as a draw in [0, 1) in steps of 2^-24, falls below p. One thread per element.

__device__ __forceinline__ unsigned long long dropout_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// x dropped (0) or scaled by 1/(1 - p), for element i of the mask.
__device__ __forceinline__ float dropout_apply(float x, float p, unsigned long long key,
                                               unsigned long long counter) {
    unsigned long long h = dropout_mix(key + (counter + 1ull) * 0x9e3779b97f4a7c15ull);
    float draw = (float)(h >> 40) * (1.0f / 16777216.0f);
    return draw < p ? 0.0f : x * (1.0f / (1.0f - p));
}

#define ENTRY(name, X)                                                                          \
    extern "C" __global__ void dropout_forward_##name(X *out, const X *inp, float p,           \
                                                      unsigned long long key,                   \
                                                      unsigned long long offset, long n) {      \
        FOR_INDEX(i, n) out[i] = store<X>(dropout_apply(load(inp[i]), p, key, offset + i));     \
    }                                                                                           \
    extern "C" __global__ void dropout_backward_##name(X *dinp, const X *dout, float p,        \
                                                       unsigned long long key,                  \
                                                       unsigned long long offset, long n) {     \
        FOR_INDEX(i, n) {                                                                       \
            float g = dropout_apply(load(dout[i]), p, key, offset + i);                         \
            dinp[i] = store<X>(load(dinp[i]) + g);                                              \
        }                                                                                       \
    }
FOR_EACH_DTYPE(ENTRY)
