// SwiGLU, the gated MLP activation of Llama-family models: silu(gate)·up, silu(g) = g·σ(g);
// the same operations in the same order as the CPU back end.

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename X> __device__ void forward(X *out, const X *gate, const X *up, long n) {
    FOR_INDEX(i, n) {
        float g = load(gate[i]);
        out[i] = store<X>(g * sigmoid(g) * load(up[i]));
    }
}

// In place: dup holds dout on entry and dout·silu(g) on exit; dgate = dout·up·σ(g)·(1 + g·(1 − σ(g)))
// is overwritten.
template <typename X>
__device__ void backward(X *dgate, X *dup, const X *gate, const X *up, long n) {
    FOR_INDEX(i, n) {
        float g = load(gate[i]), u = load(up[i]), y = load(dup[i]), s = sigmoid(g);
        dgate[i] = store<X>(y * u * (s * (1.0f + g * (1.0f - s))));
        dup[i] = store<X>(y * (g * s));
    }
}

#define ENTRY(name, X)                                                                        \
    extern "C" __global__ void swiglu_forward_##name(X *out, const X *gate, const X *up,      \
                                                     long n) {                                \
        forward(out, gate, up, n);                                                            \
    }                                                                                         \
    extern "C" __global__ void swiglu_backward_##name(X *dgate, X *dup, const X *gate,        \
                                                      const X *up, long n) {                  \
        backward(dgate, dup, gate, up, n);                                                    \
    }
FOR_EACH_DTYPE(ENTRY)
