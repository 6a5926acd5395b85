// common.cuh - shared internals of the CUDA backend plugin (not a public header).
//
// Pointer conventions (kernels/backend.h, docs/GPU.md):
//  - activations, KV pools, logits, router outputs (ids/weights) and every buffer from
//    buf_alloc are DEVICE pointers;
//  - the small index arrays the model builds from the step plan (token ids, positions,
//    KV slots, sequence tables, block tables) and the rope / router-bias tables are HOST
//    pointers.  Arrays given to the last step_begin() are found in the device step area
//    (one transfer per step; cuda_index() checks that their contents did not change),
//    others are staged into the stage area on the stream;
//  - weights: bweight.data/scale are host (loader mmap) until weight_prepare() uploads
//    them; then bweight.priv is a struct cuda_weight: BF16/F32/FP8/NVFP4 as on disk,
//    MXFP4 repacked into the tile layout of mx4.h.
//
// Memory plan: reserve() sizes one workspace (the fused halves, the MoE plan and its
// pair buffers, flash-decoding partials, activation conversions) and the step area;
// after it no op allocates.  Ops called without reserve() (tests of single ops) grow the
// workspace on demand, never while a graph is captured.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <utility>

#include "backend.h"
#include "graph-pad.h"
#include "step-guard.h"

typedef __nv_bfloat16 bf16;

struct cuda_weight {
    void *data;             // device: row-major BF16/F32, or MXFP4 tile nibbles (mx4.h)
    uint8_t *scale;         // device: MXFP4 tile scales, FP8/NVFP4 scales as on disk, else NULL
    float *f32;             // device FP32 copy (a router, for the FP32 gate GEMM) or NULL
    bool borrowed;          // data lies in a fused buffer of attn/ffn_prepare
};

// The device step area: the step's index arrays at fixed addresses (a graph reads them
// there), int32 throughout.  hdr: [0] n_tok, [1] n_seqs (real), [2] n_tiles.
#define STEP_HDR 16
struct step_dev {
    int32_t *hdr, *ids, *pos, *slots[BACKEND_KV_GROUPS], *seq_start, *pos0,
            *boff[BACKEND_KV_GROUPS], *tok_seq, *tiles, *tables[BACKEND_KV_GROUPS];
};

// Attention work: a tile is up to ATTN_QT consecutive query tokens of one sequence
// (int4: seq, first token, end token, 0), built on the host by step_begin.
#define ATTN_QT 8

// The host side of the last step_begin(): which host arrays it uploaded, with copies
// to check them against when an op is handed one of them.
struct step_map {
    bool valid;
    int n_tok, n_seqs, n_rows, n_tiles;     // n_rows: padded rows (graph bucket) or n_tok
    int bucket;                             // graph bucket of the step (0: eager)
    int qclass;                             // 0 decode (runs of 1), 1 verify (runs <= 8)
    const int32_t *ids, *pos, *slots[BACKEND_KV_GROUPS], *seq_start, *seq_pos0,
                  *boff[BACKEND_KV_GROUPS], *tables[BACKEND_KV_GROUPS];
    int n_table[BACKEND_KV_GROUPS];
};

#define GRAPH_QCLASSES 2

struct lt_entry;

struct cuda_ctx {
    int device, sms;
    size_t smem_optin;
    bool exact;             // backend_cfg.mxfp4_exact: FP32 op path only
    bool pdl;               // cuda_launch() sets programmatic stream serialization (sm_90)
    cudaStream_t stream;
    // cuBLASLt: one handle, one workspace, an algorithm per shape (gemm.cu)
    cublasLtHandle_t lt;
    void *lt_ws;
    size_t lt_ws_size;
    struct lt_entry *lt_cache;
    int lt_n, lt_cap;
    // staging of host index arrays that are not in the step area
    char *stage;
    size_t stage_size, stage_used;
    // workspace (reserve): carved per op / per fused half
    char *ws;
    size_t ws_size, ws_used;
    bool reserved;
    struct backend_reserve res;
    // step area: device copy and two pinned host buffers (alternating, with an event each)
    int32_t *d_step, *h_step[2];
    size_t step_ints;
    int h_cur;
    cudaEvent_t h_ev[2];
    struct step_dev sd;
    struct step_map map;
    int t_cap, s_cap, tile_cap, table_cap;
    // graphs: one per (bucket, qclass), captured on first use
    bool graphs;
    cudaGraphExec_t exec[GRAPH_N_BUCKETS][GRAPH_QCLASSES];
    int capturing;          // 1 while the stream is captured
    bool replay;            // capture_begin found the graph: capture_end launches it
    int launch_rows;        // rows kernels are launched for while capturing (bucket), else 0
    // the workspace or step area moved: graphs of an older epoch are captured again
    uint32_t mem_epoch;
    uint32_t exec_epoch[GRAPH_N_BUCKETS][GRAPH_QCLASSES];
    struct sg_blocks_memo blocks;   // block ids checked once per step (step-guard.h)
    bool lt_warned;         // a cuBLASLt heuristic miss was reported (gemm.cu)
    int32_t *d_done;        // device: blocks of router_gemv done (0 between launches)
    int32_t *d_split_done;  // device [KCU_SPLIT_DONE_CAP]: flash splits done, per (tile, KV head)
    int32_t *d_combine_done;    // device [KCU_COMBINE_DONE_CAP]: MoE down blocks done (moe.cu)
    // MoE tables of the ffn halves are per layer (ffn_prepare); the op path builds one
    // table per call into the workspace
};

// Make the backend's device current on the calling thread (step-guard.h); every entry
// point does it through cuda_ctx_of().
void cuda_use_device(const struct cuda_ctx *c);

static inline struct cuda_ctx *cuda_ctx_of(struct backend *be)
{
    struct cuda_ctx *c = (struct cuda_ctx *) be->ctx;
    if (c)
        cuda_use_device(c);
    return c;
}

// The one translation point for cudaError_t -> negative errno.
int err_from_cuda(cudaError_t e);

#define CUDA_LAUNCH_CHECK() err_from_cuda(cudaGetLastError())
#define CU_TRY(expr) do { int _r = err_from_cuda(expr); if (_r < 0) return _r; } while (0)

// Stage n bytes of host memory into the stage area (device pointer, NULL on failure).
// cuda_stage_reset() at the start of each op.
void cuda_stage_reset(struct cuda_ctx *c);
void *cuda_stage(struct cuda_ctx *c, const void *host, size_t n);

// The device copy of host index array `host` of n int32: from the step area when it is
// the same array (same pointer, same contents) as the last step_begin's, else staged.
const int32_t *cuda_index(struct cuda_ctx *c, const int32_t *host, size_t n);

// Workspace: an op calls cuda_ws_ensure() with all it needs (a no-op after reserve();
// grows it otherwise, never while capturing), cuda_ws_reset(), then cuda_ws_take() for
// each 256-aligned piece (NULL past the end).
int cuda_ws_ensure(struct cuda_ctx *c, size_t bytes);
// The memory plan's workspace (reserve, the vision encoder's plan): at least bytes, sized
// now, with no warning; the old contents are lost.
int cuda_ws_plan(struct cuda_ctx *c, size_t bytes);
void cuda_ws_reset(struct cuda_ctx *c);
void *cuda_ws_take(struct cuda_ctx *c, size_t bytes);

// Rows a kernel is launched for: the graph bucket while capturing, else n.
static inline int cuda_rows(const struct cuda_ctx *c, int n)
{
    return c->launch_rows > n ? c->launch_rows : n;
}

// Device copies of a prepared weight; -EINVAL when weight_prepare() was not called.
static inline int cuda_weight_dev(const struct bweight *w, const void **ret_data,
                                  const uint8_t **ret_scale)
{
    const struct cuda_weight *cw = (const struct cuda_weight *) w->priv;
    if (!cw || !cw->data)
        return -EINVAL;
    *ret_data = cw->data;
    *ret_scale = cw->scale;
    return 0;
}

// ---- launches: programmatic dependent launch (docs/GPU.md §6) ----
//
// cuda_launch(c, kernel, grid, block, smem, args...) launches kernel on the backend's
// stream; with c->pdl (the device runs the sm_90 code, STEPD_CUDA_NO_PDL unset) it sets
// cudaLaunchAttributeProgrammaticStreamSerialization, so that the kernel may start while
// the one before it in the stream still runs (a graph captures the edge as programmatic).
// Every kernel launched so calls PDL_WAIT() (griddepcontrol.wait: the whole previous grid
// completed and its writes are visible) before it reads anything an earlier kernel wrote
// or writes anything an earlier kernel reads: at its entry, after index arithmetic only.
// PDL_TRIGGER() (griddepcontrol.launch_dependents) says where the rest of its work no
// longer gates the next kernel's start; correctness never depends on where, since the
// next kernel's PDL_WAIT() waits for this whole grid.  On sm_80 code both are no-ops (and
// c->pdl is false: the attribute is never set for code that does not wait).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() cudaGridDependencySynchronize()
#define PDL_TRIGGER() cudaTriggerProgrammaticLaunchCompletion()
#else
#define PDL_WAIT() ((void) 0)
#define PDL_TRIGGER() ((void) 0)
#endif

// what: the launch's text (the macro's), the emulator's name of the kernel (its prefix)
template <class... P, class... A>
static inline cudaError_t cuda_launch_(const char *what, const struct cuda_ctx *c, void (*k)(P...),
                                       dim3 grid, dim3 block, size_t smem, A &&...args)
{
    cudaLaunchAttribute at[1];
    memset(at, 0, sizeof(at));
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = c->pdl ? at : NULL;
    cfg.numAttrs = c->pdl ? 1 : 0;
#ifdef CUEMU
    cuemu::launch_name(what);
#else
    (void) what;
#endif
    return cudaLaunchKernelEx(&cfg, k, std::forward<A>(args)...);
}
#define cuda_launch(c, ...) cuda_launch_(#__VA_ARGS__, c, __VA_ARGS__)

static inline unsigned cuda_blocks(size_t n, unsigned threads)
{
    return (unsigned) ((n + threads - 1) / threads);
}

// ---- device helpers ----

static inline __device__ float bf16_to_f32(uint16_t b)
{
    return __uint_as_float(((uint32_t) b) << 16);
}

// round to nearest even, NaN kept quiet (the CPU backend's conversion)
static inline __device__ uint16_t f32_to_bf16(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t) ((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t) (u >> 16);
}

template <typename T> static inline __device__ float to_f32(T v);
template <> inline __device__ float to_f32<float>(float v) { return v; }
template <> inline __device__ float to_f32<bf16>(bf16 v) { return __bfloat162float(v); }

template <typename T> static inline __device__ T from_f32(float v);
template <> inline __device__ float from_f32<float>(float v) { return v; }
template <> inline __device__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

// E2M1 magnitude table, docs/MODEL.md §5.1
static __device__ __constant__ float k_e2m1[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

static inline __device__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static inline __device__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The block's sum (max: maximum) of v, returned to every thread; shared32: a float per warp.
static inline __device__ float block_reduce(float v, float *shared32, bool max)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = max ? warp_max(v) : warp_sum(v);
    if (lane == 0)
        shared32[wid] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nw) ? shared32[threadIdx.x] : max ? -INFINITY : 0.0f;
    if (wid == 0)
        v = max ? warp_max(v) : warp_sum(v);
    if (threadIdx.x == 0)
        shared32[0] = v;
    __syncthreads();
    v = shared32[0];
    __syncthreads();
    return v;
}

static inline __device__ float block_sum(float v, float *shared32)
{
    return block_reduce(v, shared32, false);
}

static inline __device__ float block_max(float v, float *shared32)
{
    return block_reduce(v, shared32, true);
}

static inline __device__ float sigmoidf_(float z)
{
    return 1.0f / (1.0f + expf(-z));
}

// docs/MODEL.md §2.4: min(silu(g), L) * clamp(u, -L, L), or silu(g) * u when L = 0
static inline __device__ float swiglu1(float g, float u, float limit)
{
    float s = g / (1.0f + expf(-g));
    if (limit > 0.0f) {
        s = fminf(s, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return s * u;
}
