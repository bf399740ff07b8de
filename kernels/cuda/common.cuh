// Prepended to every kernel source (NVRTC compiles one string; no include paths needed).
//
// Storage dtypes: `float`, and `bf16` / `f16` as 16-bit patterns. Kernels compute in f32 and
// round once on store with round-to-nearest-even, matching the CPU back end (and the `half`
// crate) bit for bit, NaN payloads included.

struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

// The hardware's f16 conversions (exact; round to nearest even). The CPU shim that runs these
// kernels in tests (kernels/shim/cuda_shim.h) defines them in software instead.
#ifndef ZEROTRAIN_CUDA_SHIM
__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f32_to_f16_bits_rn(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#endif

__device__ __forceinline__ float load(float x) { return x; }

__device__ __forceinline__ float load(bf16 x) {
    return __uint_as_float((unsigned)x.bits << 16);
}

__device__ __forceinline__ float load(f16 x) {
    unsigned h = x.bits;
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0) {
        // NaN: quieted, payload kept (cvt would return the canonical NaN).
        return __uint_as_float(((h & 0x8000u) << 16) | 0x7fc00000u | ((h & 0x03ffu) << 13));
    }
    return f16_bits_to_f32((unsigned short)h);
}

template <typename X> __device__ __forceinline__ X store(float x);

template <> __device__ __forceinline__ float store<float>(float x) { return x; }

template <> __device__ __forceinline__ bf16 store<bf16>(float x) {
    unsigned u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        unsigned round = (u & 0x8000u) != 0 && (u & 0x17fffu) != 0;
        r.bits = (unsigned short)((u >> 16) + round);
    }
    return r;
}

template <> __device__ __forceinline__ f16 store<f16>(float x) {
    unsigned u = __float_as_uint(x);
    f16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)(((u >> 16) & 0x8000u) | 0x7e00u | ((u & 0x007fffffu) >> 13));
    } else {
        r.bits = f32_to_f16_bits_rn(x);
    }
    return r;
}

// One extern "C" entry point per storage dtype: NAME_f32, NAME_bf16, NAME_f16.
#define FOR_EACH_DTYPE(M) M(f32, float) M(bf16, bf16) M(f16, f16)

// Sum over the block in a fixed order (butterfly within each warp, then the warp sums by
// warp 0): deterministic for a given blockDim, which must be a multiple of 32, at most 1024.
// `scratch` holds 32 floats; every thread gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ float block_sum(float v, float *scratch) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v, float *scratch) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : __int_as_float(0xff800000);
    return warp_max(v);
}

// Column sums in a block of 32 × Y threads: each thread has written part[threadIdx.y]
// [threadIdx.x]; the Y values of each column are added in a fixed tree, and part[0][x] holds
// the total once this returns (for every thread: it ends on a barrier).
template <int Y> __device__ void sum_down_columns(float (*part)[33]) {
    __syncthreads();
    for (int s = Y / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.y < s) part[threadIdx.y][threadIdx.x] += part[threadIdx.y + s][threadIdx.x];
        __syncthreads();
    }
}

// Grid-stride loop over n elements.
#define FOR_INDEX(i, n) \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)(n); i += (long)gridDim.x * blockDim.x)

__device__ __forceinline__ bool finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}
