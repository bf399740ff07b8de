// Residual additions, and scaling by a constant (a LoRA adapter's alpha/rank).

#define ENTRY(name, X)                                                                          \
    extern "C" __global__ void residual_forward_##name(X *out, const X *a, const X *b, long n) { \
        FOR_INDEX(i, n) out[i] = store<X>(load(a[i]) + load(b[i]));                             \
    }                                                                                           \
    extern "C" __global__ void residual_accumulate_##name(X *a, const X *b, long n) {           \
        FOR_INDEX(i, n) a[i] = store<X>(load(a[i]) + load(b[i]));                               \
    }                                                                                           \
    extern "C" __global__ void scale_##name(X *x, float s, long n) {                            \
        FOR_INDEX(i, n) x[i] = store<X>(load(x[i]) * s);                                        \
    }
FOR_EACH_DTYPE(ENTRY)
