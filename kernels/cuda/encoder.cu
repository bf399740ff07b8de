// Token + position embeddings.

// out (B·T, C) = wte[tokens] + wpe[pos]. A token outside the vocabulary writes NaN rather
// than reading out of bounds.
template <typename X>
__device__ void forward(X *out, const unsigned *tokens, const X *wte, const X *wpe, long bt,
                        long t, long c, long v) {
    FOR_INDEX(i, bt * c) {
        long row = i / c, j = i % c;
        unsigned tok = tokens[row];
        float y = tok < v ? load(wte[tok * c + j]) + load(wpe[(row % t) * c + j])
                          : __int_as_float(0x7fc00000);
        out[i] = store<X>(y);
    }
}

// dwpe[pos] += Σ_b dout[b, pos], summed in b order, added once.
template <typename X>
__device__ void backward_wpe(X *dwpe, const X *dout, long bt, long t, long c) {
    FOR_INDEX(i, t * c) {
        long pos = i / c, j = i % c;
        float s = 0.0f;
        for (long row = pos; row < bt; row += t) s += load(dout[row * c + j]);
        dwpe[i] = store<X>(load(dwpe[i]) + s);
    }
}

// dwte[token] += Σ dout over its positions. The host groups positions by token: run r holds
// positions order[starts[r]..starts[r+1]] (ascending), all of token tokens[order[starts[r]]];
// block row y takes runs y, y + gridDim.y, ... (grid y is at most 65,535), so no two threads
// write one element and no atomics are needed.
template <typename X>
__device__ void backward_wte(X *dwte, const X *dout, const unsigned *tokens,
                             const unsigned *order, const unsigned *starts, long runs, long c) {
    for (long r = blockIdx.y; r < runs; r += gridDim.y) {
        unsigned lo = starts[r], hi = starts[r + 1];
        long tok = tokens[order[lo]];
        for (long j = (long)blockIdx.x * blockDim.x + threadIdx.x; j < c; j += (long)gridDim.x * blockDim.x) {
            float s = 0.0f;
            for (unsigned k = lo; k < hi; k++) s += load(dout[(long)order[k] * c + j]);
            dwte[tok * c + j] = store<X>(load(dwte[tok * c + j]) + s);
        }
    }
}

#define ENTRY(name, X)                                                                       \
    extern "C" __global__ void encoder_forward_##name(X *out, const unsigned *tokens,        \
                                                      const X *wte, const X *wpe, long bt,   \
                                                      long t, long c, long v) {              \
        forward(out, tokens, wte, wpe, bt, t, c, v);                                         \
    }                                                                                        \
    extern "C" __global__ void encoder_backward_wpe_##name(X *dwpe, const X *dout, long bt,  \
                                                           long t, long c) {                 \
        backward_wpe(dwpe, dout, bt, t, c);                                                  \
    }                                                                                        \
    extern "C" __global__ void encoder_backward_wte_##name(                                  \
        X *dwte, const X *dout, const unsigned *tokens, const unsigned *order,               \
        const unsigned *starts, long runs, long c) {                                         \
        backward_wte(dwte, dout, tokens, order, starts, runs, c);                            \
    }
FOR_EACH_DTYPE(ENTRY)
