// CUDA on the CPU, for tests: the `.cu` kernels compiled by the system C++ compiler and run with
// one OS thread per CUDA thread of a block (kernels/tests/cuda_on_cpu.rs builds and loads it).
//
// - `__global__` functions are plain C++ functions; `launch` runs one of them over a grid,
//   one block after another, each block on blockDim.x·y·z threads created once per launch.
// - `__syncthreads()` is a std::barrier across the block's threads; a thread that returns drops
//   out of it (as an exited CUDA thread does), so early returns after the last barrier work.
// - Warp shuffles, votes and `__syncwarp` go through a per-warp exchange array between the 32
//   lanes, with a barrier per exchange (two buffers, so one barrier suffices).
// - `__shared__` is `static`: launches are serialised and blocks run one at a time, so a static
//   local is exactly one block's shared memory.
// - threadIdx and blockIdx are thread_locals; blockDim, gridDim are the launch's.
// - bf16/f16 conversions in software, round-to-nearest-even, as the hardware's cvt.rn.
// - Floating point: compiled with -ffp-contract=off (NVRTC: --fmad=false); no FTZ (the CPU
//   reference does not flush either), IEEE division and square root as --prec-div/--prec-sqrt.
//   expf, logf, tanhf are the C library's (within the GPU's documented 1-2 ulp).
//
// Not emulated: independent thread scheduling inside a warp (lanes run as threads that meet at
// every shuffle), shuffles with partial masks, dynamic shared memory, streams.
// (No include guard: the test pastes it once at the top of one generated file.)

#define ZEROTRAIN_CUDA_SHIM 1

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

// ---- Qualifiers ----------------------------------------------------------------------------
#define __global__
#define __device__ inline
#define __host__
#define __forceinline__
#define __noinline__
#define __shared__ static
#define __constant__ static
#define __launch_bounds__(...)

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline constexpr int warpSize = 32;

namespace shim {

// The launch's geometry (one launch at a time) and this thread's place in it.
inline dim3 grid_dim, block_dim;
inline thread_local uint3 thread_idx, block_idx;
inline thread_local unsigned lane_id, warp_id, exchanges;

struct Warp {
    std::optional<std::barrier<>> bar;
    unsigned long long slot[2][32];
};

inline std::optional<std::barrier<>> block_bar;
inline std::vector<Warp> warps;

inline void syncthreads() { block_bar->arrive_and_wait(); }

// Every lane writes `v`, then reads lane `src`'s (its own when src is outside the warp).
template <typename T> T exchange(T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Warp &w = warps[warp_id];
    unsigned p = exchanges++ & 1;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    w.slot[p][lane_id] = bits;
    w.bar->arrive_and_wait();
    if (src < 0 || src >= 32) return v;
    T r;
    memcpy(&r, &w.slot[p][src], sizeof(T));
    return r;
}

// The first lane of `lane`'s segment of `width` lanes.
inline int segment(int width) { return (int)lane_id / width * width; }

} // namespace shim

#define threadIdx (::shim::thread_idx)
#define blockIdx (::shim::block_idx)
#define blockDim (::shim::block_dim)
#define gridDim (::shim::grid_dim)

inline void __syncthreads() { shim::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { shim::warps[shim::warp_id].bar->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T> T __shfl_sync(unsigned, T v, int src, int width = 32) {
    return shim::exchange(v, shim::segment(width) + (src % width));
}
// As CUDA: a lane may read from its own or an earlier group of `width`, never a later one.
template <typename T> T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    int src = (int)shim::lane_id ^ mask;
    return shim::exchange(v, src < shim::segment(width) + width ? src : (int)shim::lane_id);
}
template <typename T> T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    int src = (int)shim::lane_id + (int)delta;
    return shim::exchange(v, src < shim::segment(width) + width ? src : (int)shim::lane_id);
}
template <typename T> T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    int src = (int)shim::lane_id - (int)delta;
    return shim::exchange(v, src >= shim::segment(width) ? src : (int)shim::lane_id);
}
inline unsigned __ballot_sync(unsigned, int pred) {
    shim::Warp &w = shim::warps[shim::warp_id];
    unsigned p = shim::exchanges++ & 1;
    w.slot[p][shim::lane_id] = pred != 0;
    w.bar->arrive_and_wait();
    unsigned r = 0;
    for (int l = 0; l < 32; l++) r |= (unsigned)(w.slot[p][l] != 0) << l;
    unsigned threads = shim::block_dim.x * shim::block_dim.y * shim::block_dim.z;
    unsigned lanes = threads - shim::warp_id * 32 < 32 ? threads - shim::warp_id * 32 : 32;
    return lanes == 32 ? r : r & ((1u << lanes) - 1);
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
    unsigned threads = shim::block_dim.x * shim::block_dim.y * shim::block_dim.z;
    unsigned lanes = threads - shim::warp_id * 32 < 32 ? threads - shim::warp_id * 32 : 32;
    return __ballot_sync(m, pred) == (lanes == 32 ? 0xffffffffu : (1u << lanes) - 1);
}

// ---- Atomics (on plain memory, as CUDA's) ---------------------------------------------------
template <typename T> T __shim_atomic_add(T *p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed);
}
inline float atomicAdd(float *p, float v) { return __shim_atomic_add(p, v); }
inline double atomicAdd(double *p, double v) { return __shim_atomic_add(p, v); }
inline int atomicAdd(int *p, int v) { return __shim_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned *p, unsigned v) { return __shim_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __shim_atomic_add(p, v);
}
template <typename T> T atomicMax(T *p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load(std::memory_order_relaxed);
    while (old < v && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
    }
    return old;
}
template <typename T> T atomicMin(T *p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load(std::memory_order_relaxed);
    while (old > v && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
    }
    return old;
}
template <typename T> T atomicExch(T *p, T v) {
    return std::atomic_ref<T>(*p).exchange(v, std::memory_order_relaxed);
}
template <typename T> T atomicCAS(T *p, T expected, T desired) {
    std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired, std::memory_order_relaxed);
    return expected;
}

// ---- Integer and float helpers ---------------------------------------------------------------
template <typename A, typename B> std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)b < (C)a ? (C)b : (C)a;
}
template <typename A, typename B> std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a < (C)b ? (C)b : (C)a;
}

inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, 4);
    return i;
}
inline long long __double_as_longlong(double d) {
    long long i;
    memcpy(&i, &d, 8);
    return i;
}
inline double __longlong_as_double(long long i) {
    double d;
    memcpy(&d, &i, 8);
    return d;
}
template <typename T> T __ldg(const T *p) { return *p; }

// Fast-math intrinsics: the accurate functions (the GPU's are within a few ulp of these).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

// ---- 16-bit floats in software (the hardware's cvt.rn) --------------------------------------

// f16 bits → f32, exact (NaN: the canonical 0x7fffffff, as cvt.f32.f16).
inline float f16_bits_to_f32(unsigned short h) {
    unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    unsigned u;
    if (e == 0x1f) {
        u = m ? 0x7fffffffu : (sign | 0x7f800000u);
    } else if (e != 0) {
        u = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        u = sign;
    } else {
        // Subnormal: m·2^-24, normalised.
        int shift = 0;
        while (!(m & 0x400u)) {
            m <<= 1;
            shift++;
        }
        u = sign | ((unsigned)(113 - shift) << 23) | ((m & 0x3ffu) << 13);
    }
    return __uint_as_float(u);
}

// f32 → f16 bits, round to nearest even (NaN: quiet, top payload bits kept).
inline unsigned short f32_to_f16_bits_rn(float x) {
    unsigned u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u); // ≥ 65520: inf
    if (a >= 0x38800000u) {                                          // normal f16
        unsigned h = ((a >> 23) - 112) << 10 | ((a >> 13) & 0x3ffu), rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
        return (unsigned short)(sign | h);
    }
    unsigned e = a >> 23;
    if (e < 102) return (unsigned short)sign; // below 2^-25: rounds to zero
    unsigned mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    unsigned h = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (unsigned short)(sign | h);
}

// f32 → bf16 bits, round to nearest even (NaN: quiet).
inline unsigned short f32_to_bf16_bits_rn(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// cuda_fp16.h / cuda_bf16.h's types and conversions, for kernels that use them.
struct __half {
    unsigned short __x;
};
struct __nv_bfloat16 {
    unsigned short __x;
};
inline __half __float2half(float x) { return __half{f32_to_f16_bits_rn(x)}; }
inline __half __float2half_rn(float x) { return __float2half(x); }
inline float __half2float(__half h) { return f16_bits_to_f32(h.__x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16{f32_to_bf16_bits_rn(x)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __float2bfloat16(x); }
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.__x << 16); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }

// ---- Launching ----------------------------------------------------------------------------------
namespace shim {

// What a launch may ask of an H200 (and every GPU since sm_30).
inline const char *check_geometry(dim3 g, dim3 b) {
    unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (threads == 0 || g.x == 0 || g.y == 0 || g.z == 0) return "an empty grid or block";
    if (threads > 1024) return "more than 1024 threads per block";
    if (b.x > 1024 || b.y > 1024 || b.z > 64) return "block dimensions over (1024, 1024, 64)";
    if (g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
        return "grid dimensions over (2^31-1, 65535, 65535)";
    }
    return nullptr;
}

// Seconds a launch may take before the shim calls it a hang (a __syncthreads some threads
// never reach): it prints which kernel and aborts, rather than leaving CI waiting.
inline constexpr int HANG_SECONDS = 300;

struct Launch {
    const char *name;
    void (*body)(void *);
    void *ctx;
    unsigned threads;
    unsigned long long blocks;
    std::optional<std::barrier<void (*)() noexcept>> end;
    std::mutex m;
    std::condition_variable cv;
    unsigned finished = 0;
};

inline Launch *current;

// Between blocks (every thread has finished the last one): fresh barriers for the next.
inline void reset_barriers() noexcept {
    unsigned n = current->threads;
    block_bar.emplace(n);
    for (unsigned w = 0; w < warps.size(); w++) {
        unsigned lanes = n - w * 32 < 32 ? n - w * 32 : 32;
        warps[w].bar.emplace(lanes);
    }
}

inline void *worker(void *arg) {
    Launch &l = *current;
    unsigned t = (unsigned)(uintptr_t)arg;
    thread_idx = uint3{t % block_dim.x, t / block_dim.x % block_dim.y, t / (block_dim.x * block_dim.y)};
    lane_id = t % 32;
    warp_id = t / 32;
    for (unsigned long long b = 0; b < l.blocks; b++) {
        block_idx = uint3{(unsigned)(b % grid_dim.x), (unsigned)(b / grid_dim.x % grid_dim.y),
                          (unsigned)(b / ((unsigned long long)grid_dim.x * grid_dim.y))};
        exchanges = 0;
        l.body(l.ctx);
        warps[warp_id].bar->arrive_and_drop();
        block_bar->arrive_and_drop();
        l.end->arrive_and_wait();
    }
    std::lock_guard<std::mutex> g(l.m);
    if (++l.finished == l.threads) l.cv.notify_one();
    return nullptr;
}

// Run `body(ctx)` as kernel `name` over grid × block; 0, or -1 with `err` filled.
inline int launch(const char *name, dim3 g, dim3 b, void (*body)(void *), void *ctx, char *err,
                  size_t errlen) {
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> lock(one_at_a_time);
    if (const char *why = check_geometry(g, b)) {
        snprintf(err, errlen, "%s: grid (%u, %u, %u), block (%u, %u, %u): %s", name, g.x, g.y, g.z,
                 b.x, b.y, b.z, why);
        return -1;
    }
    Launch l;
    l.name = name;
    l.body = body;
    l.ctx = ctx;
    l.threads = b.x * b.y * b.z;
    l.blocks = (unsigned long long)g.x * g.y * g.z;
    grid_dim = g;
    block_dim = b;
    current = &l;
    warps = std::vector<Warp>((l.threads + 31) / 32);
    reset_barriers();
    l.end.emplace(l.threads, &reset_barriers);

    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    std::vector<pthread_t> threads(l.threads);
    for (unsigned t = 0; t < l.threads; t++) {
        if (pthread_create(&threads[t], &attr, worker, (void *)(uintptr_t)t) != 0) {
            fprintf(stderr, "cuda shim: %s: cannot create thread %u of %u\n", name, t, l.threads);
            abort();
        }
    }
    pthread_attr_destroy(&attr);
    {
        std::unique_lock<std::mutex> g(l.m);
        if (!l.cv.wait_for(g, std::chrono::seconds(HANG_SECONDS),
                           [&] { return l.finished == l.threads; })) {
            fprintf(stderr,
                    "cuda shim: %s did not finish in %d s (a __syncthreads or shuffle that some "
                    "threads never reach?)\n",
                    name, HANG_SECONDS);
            abort();
        }
    }
    for (pthread_t &t : threads) pthread_join(t, nullptr);
    current = nullptr;
    return 0;
}

// A kernel's parameters, as cuLaunchKernel takes them: `args[i]` points at parameter i, of
// `sizes[i]` bytes (checked against the C++ signature).
template <typename... A> struct Call {
    void (*kernel)(A...);
    void **args;
    template <size_t... I> void run(std::index_sequence<I...>) {
        kernel(*static_cast<std::remove_reference_t<A> *>(args[I])...);
    }
    static void body(void *self) {
        static_cast<Call *>(self)->run(std::index_sequence_for<A...>{});
    }
};

template <typename... A>
int launch_kernel(const char *name, void (*kernel)(A...), const unsigned *grid,
                  const unsigned *block, void **args, const size_t *sizes, size_t nargs, char *err,
                  size_t errlen) {
    const size_t want[] = {sizeof(A)..., 0};
    if (nargs != sizeof...(A)) {
        snprintf(err, errlen, "%s takes %zu parameters, got %zu", name, sizeof...(A), nargs);
        return -1;
    }
    for (size_t i = 0; i < nargs; i++) {
        if (sizes[i] != want[i]) {
            snprintf(err, errlen, "%s: parameter %zu is %zu bytes, got %zu", name, i, want[i],
                     sizes[i]);
            return -1;
        }
    }
    Call<A...> call{kernel, args};
    return launch(name, dim3{grid[0], grid[1], grid[2]}, dim3{block[0], block[1], block[2]},
                  &Call<A...>::body, &call, err, errlen);
}

} // namespace shim
