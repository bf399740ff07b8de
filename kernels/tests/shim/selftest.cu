// The shim's own primitives, beyond what kernels/cuda uses today: every shuffle (with widths),
// votes, shared-memory atomics, threads that return before others' __syncthreads, and the
// cuda_fp16/cuda_bf16 conversions. Thread t writes SELFTEST_OUT ints at out[t · SELFTEST_OUT].

#define SELFTEST_OUT 12

extern "C" __global__ void shim_selftest(int *out) {
    __shared__ int counter;
    __shared__ int maxed;
    int lane = threadIdx.x % 32;
    int *o = out + (blockIdx.x * blockDim.x + threadIdx.x) * SELFTEST_OUT;
    o[0] = __shfl_xor_sync(0xffffffffu, lane, 5);
    o[1] = __shfl_down_sync(0xffffffffu, lane, 3);
    o[2] = __shfl_up_sync(0xffffffffu, lane, 3);
    o[3] = __shfl_sync(0xffffffffu, lane, 7);
    o[4] = (int)__ballot_sync(0xffffffffu, lane & 1);
    o[5] = __any_sync(0xffffffffu, lane == 3) + 2 * __all_sync(0xffffffffu, lane < 31);
    o[6] = __shfl_down_sync(0xffffffffu, lane, 4, 16);
    o[7] = __shfl_xor_sync(0xffffffffu, lane, 16, 16);
    if (threadIdx.x == 0) {
        counter = 0;
        maxed = 0;
    }
    __syncthreads();
    atomicAdd(&counter, 1);
    atomicMax(&maxed, (int)threadIdx.x);
    __syncthreads();
    o[8] = counter;
    o[9] = maxed;
    o[10] = __half_as_ushort(__float2half(1.0f / 3.0f)) << 16 |
            __bfloat16_as_ushort(__float2bfloat16(1.0f / 3.0f));
    // Odd warps leave; the even ones still synchronise (exited threads do not hold them up).
    if ((threadIdx.x / 32) % 2) return;
    __syncthreads();
    o[11] = blockIdx.x * 1000 + blockDim.x;
}
