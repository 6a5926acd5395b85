// lowp.h - device decode of the FP8 and NVFP4 weight formats (lowp.cu; docs/MODEL.md §5.6,
// §5.7): E4M3 -> FP32 exactly by bit placement, E2M1 through k_e2m1, and the warp dot
// product of one weight row against a few FP32 activation rows; the routed experts one
// warp per output element over any such row product (lowp.cu, and exact.cu's MXFP4 oracle);
// FP8 on the tensor cores (fp8mma.cu).
#pragma once

#include "common.cuh"
#include "mx4.h"

// One prepared FP8 / NVFP4 weight as a kernel sees it (device pointers; bytes as on disk).
struct lowp_w {
    const uint8_t *data;        // FP8: E4M3 [rows, cols]; NVFP4: MXFP4's tiles (mx4.h nv4_*)
    const uint8_t *scale;       // FP8: F32 [rows / blk_rows, cols / blk_cols]; NVFP4: E4M3 tiles
    int64_t cols;
    int fmt;
    int blk_rows, blk_cols;     // FP8
    float gscale;               // NVFP4
};

static inline bool lowp_fmt(int fmt)
{
    return fmt == WFMT_FP8 || fmt == WFMT_NVFP4;
}

// weight_prepare of an FP8 weight: its bytes uploaded as they are (w->priv set); -EINVAL
// for a shape the kernels do not take.  (NVFP4: backend-cuda.cu repacks it into the tiles
// of mx4.h, which mx4_gemm and the FP32 op path here both read.)
int kcu_lowp_prepare(struct cuda_ctx *c, struct bweight *w);
// the ops with FP32 activations: y[n, rows] = x[n, cols] · Wᵀ; the routed experts (all
// local experts FP8 or NVFP4)
int kcu_lowp_matmul(struct cuda_ctx *c, const struct bweight *w, const float *x, int n, float *y);
int kcu_lowp_moe(struct cuda_ctx *c, const struct moe_args *a);

// E4M3 (bias 7, no infinities, S.1111.111 = NaN) -> FP32, exact: a normal code's exponent
// moves to FP32's bias, a subnormal is m * 2^-9
static inline __device__ float e4m3_to_f32(uint32_t b)
{
    const uint32_t e = (b >> 3) & 0xF, m = b & 7;
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    if (e == 0xF && m == 7)
        return __uint_as_float(0x7fc00000u);
    if (e == 0)
        return sign * (float) m * 0x1p-9f;
    return __uint_as_float(((b & 0x80u) << 24) | ((e + 120) << 23) | (m << 20));
}

// acc[t] = Σ_i W[o, i] · x[t * ldx + i] for t < nt, summed over the warp (every lane gets
// the sums).  FP8: 4 codes per lane and load (blk_cols % 4 == 0); NVFP4 (the FP32 op path
// only: the tensor-core path runs mx4_gemm): one element per lane and step, read from
// the tile layout, its value E2M1 · (E4M3 · global scale) as the CPU backend's.
template <int NT>
static inline __device__ void lowp_row_dot(const struct lowp_w *w, int64_t o, const float *x,
                                           int64_t ldx, int nt, int lane, float *acc)
{
    for (int t = 0; t < NT; t++)
        acc[t] = 0.0f;
    const int64_t cols = w->cols;
    if (w->fmt == WFMT_FP8) {
        const uint32_t *row = (const uint32_t *) (w->data + o * cols);
        const float *sc = (const float *) w->scale + (o / w->blk_rows) * (cols / w->blk_cols);
        for (int64_t i = 4 * lane; i < cols; i += 128) {
            const uint32_t q = row[i / 4];
            const float s = sc[i / w->blk_cols];
            const float d0 = e4m3_to_f32(q & 0xff), d1 = e4m3_to_f32((q >> 8) & 0xff);
            const float d2 = e4m3_to_f32((q >> 16) & 0xff), d3 = e4m3_to_f32(q >> 24);
            for (int t = 0; t < NT; t++) {
                if (t >= nt)
                    break;
                const float *xt = x + t * ldx + i;
                acc[t] += s * (d0 * xt[0] + d1 * xt[1] + d2 * xt[2] + d3 * xt[3]);
            }
        }
    } else {
        for (int64_t i = lane; i < cols; i += 32) {
            int el;
            const uint32_t q = *(const uint32_t *) (w->data + mx4_word_offset(cols, o, i, &el));
            const float s = e4m3_to_f32(w->scale[nv4_scale_offset(cols, o, i)]) * w->gscale;
            const float d = k_e2m1[nv4_code(q, el)];
            for (int t = 0; t < NT; t++) {
                if (t >= nt)
                    break;
                acc[t] += s * (d * x[t * ldx + i]);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        acc[t] = warp_sum(acc[t]);
}

// ---- the routed experts, one warp per output element, FP32 activations ----
// act[tk, j] = swiglu(gate_e · x_t, up_e · x_t) per (token t, slot k, row j) and out[t, o]
// += Σ_k w[tk] · down_e · act[tk] in slot order, for e = ids[tk] - first when local (else
// act 0, no term).  RD: the weight format's row product, a functor
//   __device__ float operator()(int m, int e, int64_t row, const float *x, int64_t cols,
//                               int lane) const
// of matrix m (0 gate, 1 up, 2 down) of local expert e, summed over the warp.

struct moe_warp_args {
    const float *x;             // [n_tok, hidden] FP32
    int n_tok, hidden, inter, top_k;
    const int32_t *ids;         // [n_tok, top_k] device (-1: no expert)
    const float *wts;           // [n_tok, top_k] device
    int first, n_local;
    float limit;
    float *act;                 // [n_tok * top_k, inter] FP32 (moe_warp_act_bytes)
    float *out;                 // [n_tok, hidden] FP32: out += the routed experts
};

static inline size_t moe_warp_act_bytes(int n_tok, int top_k, int inter)
{
    return (size_t) n_tok * top_k * inter * sizeof(float);
}

template <class RD>
static __global__ void moe_warp_up(RD rd, const struct moe_warp_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (int64_t) a.n_tok * a.top_k * a.inter)
        return;
    const int j = (int) (warp % a.inter);
    const int64_t tk = warp / a.inter;
    const int t = (int) (tk / a.top_k);
    const int e = a.ids[tk] - a.first;
    if (a.ids[tk] < 0 || e < 0 || e >= a.n_local) {
        if (lane == 0)
            a.act[warp] = 0.0f;
        return;
    }
    const float *xt = a.x + (int64_t) t * a.hidden;
    const float g = rd(0, e, j, xt, a.hidden, lane);
    const float u = rd(1, e, j, xt, a.hidden, lane);
    if (lane == 0)
        a.act[warp] = swiglu1(g, u, a.limit);
}

template <class RD>
static __global__ void moe_warp_down(RD rd, const struct moe_warp_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (int64_t) a.n_tok * a.hidden)
        return;
    const int t = (int) (warp / a.hidden), o = (int) (warp % a.hidden);
    float sum = 0.0f;
    for (int k = 0; k < a.top_k; k++) {
        const int64_t tk = (int64_t) t * a.top_k + k;
        const int e = a.ids[tk] - a.first;
        if (a.ids[tk] < 0 || e < 0 || e >= a.n_local)
            continue;
        sum += a.wts[tk] * rd(2, e, o, a.act + tk * a.inter, a.inter, lane);
    }
    if (lane == 0)
        a.out[warp] += sum;
}

// the two launches (threads per block: a multiple of 32)
template <class RD>
static int moe_warp_run(const struct cuda_ctx *c, RD rd, const struct moe_warp_args &a,
                        unsigned threads)
{
    const size_t w1 = (size_t) a.n_tok * a.top_k * a.inter * 32;
    cuda_launch(c, moe_warp_up<RD>, cuda_blocks(w1, threads), threads, 0, rd, a);
    const int r = CUDA_LAUNCH_CHECK();
    if (r < 0)
        return r;
    const size_t w2 = (size_t) a.n_tok * a.hidden * 32;
    cuda_launch(c, moe_warp_down<RD>, cuda_blocks(w2, threads), threads, 0, rd, a);
    return CUDA_LAUNCH_CHECK();
}

// The descriptors of n_local experts' gate, up and down (h: host [3][n_local]), checked
// against the layer's shapes; -EINVAL for a shape, format or unprepared weight the
// kernels do not take.
int kcu_lowp_expert_table(const struct moe_expert *ex, int n_local, int hidden, int inter,
                          struct lowp_w *h);
// The routed experts (moe_warp_run) over a device table of kcu_lowp_expert_table: the op
// stages its table per call, the fused FFN half (block.cu) keeps one per layer, so this
// launch alone is what a graph captures.
int kcu_lowp_experts(struct cuda_ctx *c, const struct lowp_w *tab, const struct moe_warp_args *a);

// ---- fp8mma.cu: FP8 on the tensor cores (BF16 activations, FP32 sums, block scales on
// the FP32 sums) ----
// The dense matmul of an FP8 weight takes the tensor cores from this many tokens (the
// tensor-core path's own checks permitting), the warp GEMV below: up to LOWP_NT = 4 tokens
// the GEMV reads each weight row once, as the tensor cores do, with FP32 activations; from
// 5 it reads the weights once per 4 tokens, the tensor cores once per 32.
#define FP8_MMA_MIN_TOKENS 5
// true when the n descriptors are all FP8 with scale blocks the kernels take (rows a
// multiple of 16, cols of 32) and all alike
bool kcu_fp8_mma_ok(const struct lowp_w *h, size_t n);
// workspace bytes kcu_fp8_moe takes for n_rows token rows
size_t kcu_fp8_moe_ws(int n_rows, int top_k, int hidden, int inter, int n_local);
// The routed experts of a device table [3][n_local] (kcu_lowp_expert_table, kcu_fp8_mma_ok
// with blocks blk_rows x blk_cols): the plan (a->plan, or built here), act = swiglu(gate·x,
// up·x) BF16 per pair, y = w · down·act FP32 per pair, out += y in slot order.
struct kcu_moe_args;
int kcu_fp8_moe(struct cuda_ctx *c, const struct lowp_w *tab, int blk_rows, int blk_cols,
                const struct kcu_moe_args *a);
// y[n, rows] = x[n, cols] · Wᵀ for an FP8 weight's descriptor (kcu_fp8_mma_ok), FP32 x and
// y (x rounded to BF16 as staged)
int kcu_fp8_dense(struct cuda_ctx *c, const struct lowp_w *w, int rows, const float *x, int n,
                  float *y);
