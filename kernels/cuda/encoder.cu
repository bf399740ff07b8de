// Token embeddings, plus position embeddings where the model has them (wpe null: none).

// out (B·T, C) = wte[tokens] (+ wpe[pos]). A token outside the vocabulary writes NaN rather
// than reading out of bounds.
template <typename X>
__device__ void forward(X *out, const unsigned *tokens, const X *wte, const X *wpe, long bt,
                        long t, long c, long v) {
    FOR_INDEX(i, bt * c) {
        long row = i / c, j = i % c;
        unsigned tok = tokens[row];
        float y = __int_as_float(0x7fc00000);
        if (tok < v) y = wpe ? load(wte[tok * c + j]) + load(wpe[(row % t) * c + j]) : load(wte[tok * c + j]);
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
// positions order[starts[r]..starts[r+1]] (ascending), all of token tokens[order[starts[r]]].
// Block (x, y) of 32 × WTE_Y threads takes columns 32x.. of runs y, y + gridDim.y, ... (grid y
// is at most 65,535): thread (tx, ty) sums positions ty, ty + WTE_Y, ... of the run in order,
// then the WTE_Y partials of a column are added in a fixed tree, so a frequent token (a long
// run) is summed WTE_Y ways at once. No two blocks write one element: no atomics.
#define WTE_Y 8

template <typename X>
__device__ void backward_wte(X *dwte, const X *dout, const unsigned *tokens,
                             const unsigned *order, const unsigned *starts, long runs, long c) {
    __shared__ float part[WTE_Y][33]; // padded: the tree reads down columns
    int tx = threadIdx.x, ty = threadIdx.y;
    long j = (long)blockIdx.x * 32 + tx;
    for (long r = blockIdx.y; r < runs; r += gridDim.y) {
        unsigned lo = starts[r], hi = starts[r + 1];
        float s = 0.0f;
        if (j < c) {
            for (unsigned k = lo + ty; k < hi; k += WTE_Y) s += load(dout[(long)order[k] * c + j]);
        }
        part[ty][tx] = s;
        sum_down_columns<WTE_Y>(part);
        if (ty == 0 && j < c) {
            long at = (long)tokens[order[lo]] * c + j;
            dwte[at] = store<X>(load(dwte[at]) + part[0][tx]);
        }
        __syncthreads(); // part is the next run's
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
