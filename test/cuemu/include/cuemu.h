// cuemu.h - the device model the kernels of kernels/cuda see when they are compiled as
// host C++ by the emulator (test/cuemu/README.md, docs/GPU.md "The host emulator").
// Each thread block runs as blockDim cooperative fibers on one host thread; fibers switch
// only at __syncthreads, warp collectives (shfl, mma, ldmatrix, syncwarp) and exit, in a
// seeded random order.  The runtime is cuemu.cc.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(8))) int2 { int x, y; };
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return { x, y, z, w }; }
static inline int4 make_int4(int x, int y, int z, int w) { return { x, y, z, w }; }
static inline float4 make_float4(float x, float y, float z, float w) { return { x, y, z, w }; }
static inline float2 make_float2(float x, float y) { return { x, y }; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return { x, y }; }
static inline int2 make_int2(int x, int y) { return { x, y }; }

typedef struct cuemu_stream *cudaStream_t;

namespace cuemu {

struct fiber {
    uint3 tid;
    int linear, warp, lane;
};
struct block_info {
    uint3 idx;
    dim3 dim, grid;
};
extern fiber *g_cur;
extern block_info g_blk;

// ---- the runtime (cuemu.cc) ----
void syncthreads();
void syncwarp(unsigned mask);
uint64_t shfl(unsigned mask, uint64_t v, int mode, int arg, int width);
void *dyn_smem(size_t align);
void *static_smem(int id, size_t bytes, size_t align);
uint32_t cvta_shared(const void *p);
[[noreturn]] void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// one PTX instruction of an asm statement: outputs (written, "+" ones also read) and inputs
struct asm_op {
    void *p;            // outputs: where to write
    uint64_t v;         // the value (inputs; "+" outputs: the value before)
    int size;
    char kind;          // constraint letter: r, l, f, n, h
};
template <class T> static inline asm_op asm_out(const char *c, T &x)
{
    asm_op o = { &x, 0, (int) sizeof(T), c[strlen(c) - 1] };
    memcpy(&o.v, &x, sizeof(T));
    return o;
}
template <class T> static inline asm_op asm_in(const char *c, T x)
{
    asm_op o = { nullptr, 0, (int) sizeof(T), c[strlen(c) - 1] };
    if constexpr (std::is_pointer<T>::value)
        o.v = (uint64_t) (uintptr_t) x;
    else if constexpr (std::is_floating_point<T>::value)
        memcpy(&o.v, &x, sizeof(T));
    else
        o.v = (uint64_t) (int64_t) x;
    return o;
}
void ptx(const char *tmpl, std::initializer_list<asm_op> outs, std::initializer_list<asm_op> ins);

// ---- launches ----
typedef void (*thunk_fn)(void *);
// flags: LAUNCH_PDL, the launch carries cudaLaunchAttributeProgrammaticStreamSerialization
enum { LAUNCH_PDL = 1 };
int run_kernel(const char *name, const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
               unsigned flags, thunk_fn thunk, void *ctx, void (*free_ctx)(void *),
               void *(*copy_ctx)(void *));

template <class... P, class... A>
static inline int launch_ex(const char *name, void (*fn)(P...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t s, unsigned flags, A &&...args)
{
    typedef std::tuple<std::decay_t<P>...> tup;
    struct ctx { void (*fn)(P...); tup args; };
    ctx *c = new ctx{ fn, tup(std::forward<A>(args)...) };
    return run_kernel(name, (const void *) fn, grid, block, smem, s, flags,
                      [](void *p) { ctx *x = (ctx *) p; std::apply(x->fn, x->args); }, c,
                      [](void *p) { delete (ctx *) p; },
                      [](void *p) -> void * { return new ctx(*(ctx *) p); });
}

// kernel<<<grid, block, smem, s>>>(args), as rewrite.py writes it
template <class... P, class... A>
static inline void launch(const char *name, void (*fn)(P...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t s, A &&...args)
{
    launch_ex(name, fn, grid, block, smem, s, 0, std::forward<A>(args)...);
}

// The name of the next cudaLaunchKernelEx: the kernel expression that starts `what` (the
// text of a launch helper's arguments, "kernel<A, B>, grid, ..."), kept until that launch.
void launch_name(const char *what);
const char *take_launch_name();

// Programmatic dependent launch, device side: cudaGridDependencySynchronize (the wait),
// cudaTriggerProgrammaticLaunchCompletion (the trigger); pdl_check: the thread of a PDL
// launch that has not waited may not reach `what` (cuemu.cc, docs/GPU.md §10).
void pdl_wait();
void pdl_trigger();
void pdl_check(const char *what);

}  // namespace cuemu

#define threadIdx (cuemu::g_cur->tid)
// the block's built-ins are names of the running block's, not macros: a struct may have
// members of these names (cudaLaunchConfig_t's gridDim and blockDim)
static uint3 &blockIdx = cuemu::g_blk.idx;
static dim3 &blockDim = cuemu::g_blk.dim;
static dim3 &gridDim = cuemu::g_blk.grid;
static const int warpSize = 32;

static inline void __syncthreads() { cuemu::syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu::syncwarp(mask); }
// blocks run one at a time, each to its end: every earlier block's writes are visible
static inline void __threadfence() {}
// a launch runs to its end before the next starts: the wait orders nothing more, but a
// thread of a launch with programmatic stream serialization must reach it before it
// touches device memory (cuemu.cc pdl_check)
static inline void cudaGridDependencySynchronize() { cuemu::pdl_wait(); }
static inline void cudaTriggerProgrammaticLaunchCompletion() { cuemu::pdl_trigger(); }

template <class T> static inline T cuemu_from_bits(uint64_t b)
{
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T> static inline uint64_t cuemu_bits(T v)
{
    static_assert(sizeof(T) <= 8, "shfl of a type wider than 64 bits");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> static inline T __shfl_sync(unsigned m, T v, int src, int w = 32)
{ return cuemu_from_bits<T>(cuemu::shfl(m, cuemu_bits(v), 0, src, w)); }
template <class T> static inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32)
{ return cuemu_from_bits<T>(cuemu::shfl(m, cuemu_bits(v), 1, (int) d, w)); }
template <class T> static inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32)
{ return cuemu_from_bits<T>(cuemu::shfl(m, cuemu_bits(v), 2, (int) d, w)); }
template <class T> static inline T __shfl_xor_sync(unsigned m, T v, int x, int w = 32)
{ return cuemu_from_bits<T>(cuemu::shfl(m, cuemu_bits(v), 3, x, w)); }

// atomics: one fiber runs at a time, so a read-modify-write is atomic by construction;
// kept out of the race detector's view (not inlined, not instrumented)
#define CUEMU_ATOMIC __attribute__((noinline, no_sanitize("coverage")))
// (a thread of a PDL launch reaches none before its wait: cuemu.cc pdl_check)
#define CUEMU_AT cuemu::pdl_check("issues an atomic")
template <class T> CUEMU_ATOMIC static T atomicAdd(T *p, T v) { CUEMU_AT; T o = *p; *p = o + v; return o; }
template <class T> CUEMU_ATOMIC static T atomicMax(T *p, T v) { CUEMU_AT; T o = *p; *p = o > v ? o : v; return o; }
template <class T> CUEMU_ATOMIC static T atomicMin(T *p, T v) { CUEMU_AT; T o = *p; *p = o < v ? o : v; return o; }
template <class T> CUEMU_ATOMIC static T atomicExch(T *p, T v) { CUEMU_AT; T o = *p; *p = v; return o; }
template <class T> CUEMU_ATOMIC static T atomicCAS(T *p, T c, T v)
{
    CUEMU_AT;
    T o = *p;
    if (o == c)
        *p = v;
    return o;
}

template <class T> static inline T __ldg(const T *p) { return *p; }
static inline size_t __cvta_generic_to_shared(const void *p) { return cuemu::cvta_shared(p); }

static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static inline int __ffs(unsigned x) { return __builtin_ffs((int) x); }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s)
{
    uint64_t src = ((uint64_t) y << 32) | x;
    unsigned d = 0;
    for (int k = 0; k < 4; k++)
        d |= (unsigned) ((src >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k);
    return d;
}

// CUDA's device min/max are overloaded for every arithmetic type
#define CUEMU_MINMAX(T) \
    static inline T min(T a, T b) { return a < b ? a : b; } \
    static inline T max(T a, T b) { return a > b ? a : b; }
CUEMU_MINMAX(int)
CUEMU_MINMAX(unsigned)
CUEMU_MINMAX(long)
CUEMU_MINMAX(unsigned long)
CUEMU_MINMAX(long long)
CUEMU_MINMAX(unsigned long long)
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
#undef CUEMU_MINMAX
