// Rotary position embedding (Hugging Face's rotate-half convention over the whole head), in
// place on x (B, T, heads, D), as the CPU back end: with h = D/2, pair (x[i], x[i+h]) of a row
// at position p (its index in the sequence) turns by the angle whose cosine and sine are
// cosines[p·h + i], sines[p·h + i]; the backward turns by the negative angle (the transpose).

// A thread per pair, over rows·h pairs.
template <typename X>
__device__ void rotate(X *x, const float *cosines, const float *sines, long rows, long t,
                       long heads, long h, bool back) {
    FOR_INDEX(k, rows * h) {
        long row = k / h, i = k % h, p = (row / heads) % t;
        float c = cosines[p * h + i], s = back ? -sines[p * h + i] : sines[p * h + i];
        X *r = x + row * 2 * h;
        float u = load(r[i]), v = load(r[i + h]);
        r[i] = store<X>(u * c - v * s);
        r[i + h] = store<X>(v * c + u * s);
    }
}

#define ENTRY(name, X)                                                                        \
    extern "C" __global__ void rope_forward_##name(X *x, const float *cosines,                \
                                                   const float *sines, long rows, long t,     \
                                                   long heads, long h) {                      \
        rotate(x, cosines, sines, rows, t, heads, h, false);                                  \
    }                                                                                         \
    extern "C" __global__ void rope_backward_##name(X *dx, const float *cosines,              \
                                                    const float *sines, long rows, long t,    \
                                                    long heads, long h) {                     \
        rotate(dx, cosines, sines, rows, t, heads, h, true);                                  \
    }
FOR_EACH_DTYPE(ENTRY)
