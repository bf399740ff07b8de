// Fused softmax + cross-entropy over f32 logits (N, V), one block per row.
//
// losses[i] = logsumexp(logits[i]) - logits[i, target]; with has_dloss the row is overwritten
// by its gradient (softmax - onehot(target))·dloss. An ignored target (0xffffffff, a
// fine-tuning prompt's position) gives a zero loss and a zero row; another target outside the
// vocabulary gives a NaN loss and leaves the row as it was.
extern "C" __global__ void crossentropy_forward(float *losses, float *logits,
                                                const unsigned *targets, long v, int has_dloss,
                                                float dloss) {
    __shared__ float scratch[32];
    long n = blockIdx.x;
    float *row = logits + n * v;
    unsigned target = targets[n];
    if (target == 0xffffffffu) {
        if (threadIdx.x == 0) losses[n] = 0.0f;
        if (has_dloss)
            for (long j = threadIdx.x; j < v; j += blockDim.x) row[j] = 0.0f;
        return;
    }
    float picked = target < v ? row[target] : __int_as_float(0x7fc00000);
    float mx = __int_as_float(0xff800000);
    for (long j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (long j = threadIdx.x; j < v; j += blockDim.x) sum += expf(row[j] - mx);
    float total = block_sum(sum, scratch);
    if (threadIdx.x == 0) losses[n] = mx + logf(total) - picked;
    if (!has_dloss || target >= v) return;
    float scale = dloss / total;
    for (long j = threadIdx.x; j < v; j += blockDim.x) {
        float g = expf(row[j] - mx) * scale;
        row[j] = j == target ? g - dloss : g;
    }
}
