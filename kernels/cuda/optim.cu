// Fused elementwise optimizer updates of fp32 master weights: gradients of dtype G times
// grad_scale, states in f32, and when param_out is not null the rounded compute copy (dtype X)
// of the new master. Bias corrections and step sizes are computed on the host. `decay`
// multiplies master first, in the same pass (decoupled weight decay; 1 for none).

extern "C" __global__ void decay(float *master, float factor, long n) {
    FOR_INDEX(i, n) master[i] *= factor;
}

template <typename G, typename X>
__device__ void sgd(float *master, const G *grad, X *out, long n, float lr, float grad_scale,
                    float decay) {
    FOR_INDEX(i, n) {
        float p = master[i] * decay - lr * (load(grad[i]) * grad_scale);
        master[i] = p;
        if (out) out[i] = store<X>(p);
    }
}

template <typename G, typename X>
__device__ void momentum(float *master, const G *grad, float *buf, X *out, long n, float lr,
                         float mu, int nesterov, float grad_scale, float decay) {
    FOR_INDEX(i, n) {
        float g = load(grad[i]) * grad_scale;
        float b = mu * buf[i] + g;
        buf[i] = b;
        float p = master[i] * decay - lr * (nesterov ? g + mu * b : b);
        master[i] = p;
        if (out) out[i] = store<X>(p);
    }
}

// step_size = lr / (1 - β1^t), bc2_sqrt = sqrt(1 - β2^t).
template <typename G, typename X>
__device__ void adamw(float *master, const G *grad, float *m, float *v, X *out, long n,
                      float beta1, float beta2, float eps, float step_size, float bc2_sqrt,
                      float grad_scale, float decay) {
    FOR_INDEX(i, n) {
        float g = load(grad[i]) * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = master[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        master[i] = p;
        if (out) out[i] = store<X>(p);
    }
}

template <typename G, typename X>
__device__ void lion(float *master, const G *grad, float *m, X *out, long n, float lr,
                     float beta1, float beta2, float grad_scale, float decay) {
    FOR_INDEX(i, n) {
        float g = load(grad[i]) * grad_scale;
        float c = beta1 * m[i] + (1.0f - beta1) * g;
        float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
        float p = master[i] * decay - lr * sign;
        m[i] = beta2 * m[i] + (1.0f - beta2) * g;
        master[i] = p;
        if (out) out[i] = store<X>(p);
    }
}

#define ENTRY(gn, G, xn, X)                                                                   \
    extern "C" __global__ void sgd_step_##gn##_##xn(float *master, const G *grad, X *out,     \
                                                    long n, float lr, float grad_scale,       \
                                                    float decay) {                            \
        sgd(master, grad, out, n, lr, grad_scale, decay);                                     \
    }                                                                                         \
    extern "C" __global__ void momentum_step_##gn##_##xn(                                     \
        float *master, const G *grad, float *buf, X *out, long n, float lr, float mu,         \
        int nesterov, float grad_scale, float decay) {                                        \
        momentum(master, grad, buf, out, n, lr, mu, nesterov, grad_scale, decay);             \
    }                                                                                         \
    extern "C" __global__ void adamw_step_##gn##_##xn(                                        \
        float *master, const G *grad, float *m, float *v, X *out, long n, float beta1,        \
        float beta2, float eps, float step_size, float bc2_sqrt, float grad_scale,            \
        float decay) {                                                                        \
        adamw(master, grad, m, v, out, n, beta1, beta2, eps, step_size, bc2_sqrt, grad_scale, \
              decay);                                                                         \
    }                                                                                         \
    extern "C" __global__ void lion_step_##gn##_##xn(float *master, const G *grad, float *m,  \
                                                     X *out, long n, float lr, float beta1,   \
                                                     float beta2, float grad_scale,           \
                                                     float decay) {                           \
        lion(master, grad, m, out, n, lr, beta1, beta2, grad_scale, decay);                   \
    }
#define ENTRY_G(gn, G) ENTRY(gn, G, f32, float) ENTRY(gn, G, bf16, bf16) ENTRY(gn, G, f16, f16)
FOR_EACH_DTYPE(ENTRY_G)
