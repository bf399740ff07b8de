// GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

#define GELU_K 0.7978845608f
#define GELU_A 0.044715f

template <typename X> __device__ void forward(X *out, const X *inp, long n) {
    FOR_INDEX(i, n) {
        float x = load(inp[i]);
        out[i] = store<X>(0.5f * x * (1.0f + tanhf(GELU_K * (x + GELU_A * x * x * x))));
    }
}

// In place: grad = grad · gelu'(inp).
template <typename X> __device__ void backward(X *grad, const X *inp, long n) {
    FOR_INDEX(i, n) {
        float x = load(inp[i]);
        float th = tanhf(GELU_K * (x + GELU_A * x * x * x));
        float sech2 = 1.0f - th * th;
        float d = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * GELU_A * x * x);
        grad[i] = store<X>(load(grad[i]) * d);
    }
}

#define ENTRY(name, X)                                                                          \
    extern "C" __global__ void gelu_forward_##name(X *out, const X *inp, long n) {              \
        forward(out, inp, n);                                                                   \
    }                                                                                           \
    extern "C" __global__ void gelu_backward_##name(X *grad, const X *inp, long n) {            \
        backward(grad, inp, n);                                                                 \
    }
FOR_EACH_DTYPE(ENTRY)
