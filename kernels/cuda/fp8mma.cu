// fp8mma.cu - block-scaled FP8 weights (WFMT_FP8: E4M3 codes, an F32 scale per blk_rows x
// blk_cols block) on the tensor cores (docs/GPU.md "Weight formats"): the routed experts
// through the MoE plan's work items (moe-plan.h, as moe.cu's mx4_gemm) and the dense
// matmul above FP8_MMA_MIN_TOKENS tokens (lowp.cu keeps the warp GEMV below).
//
// The weights stay E4M3 in device memory.  A warp owns 16 weight rows, the mma's A operand
// ("swap AB"), and up to 8·NT tokens (B, BF16 in shared memory).  Per 32-k group a lane
// loads 8 codes of row g and of row g + 8 (g = lane / 4, c = lane % 4: k 8c .. 8c + 7)
// and decodes them in registers to BF16 exactly (E4M3's 3 mantissa bits and its exponent
// range fit BF16's): the code's bits placed in a BF16 are its value times 2^-120 (normal
// and subnormal alike), one HMUL2 by 2^120 restores it.  The group's two k16 steps take
// the lane's codes in their order (step j: k 8c + 4j .. + 3), so the tokens' fragment of
// step j is the pair of 32-bit words at the same k of token g: one 16-byte shared load a
// group and tile, no ldmatrix and no permutation of the staged tokens.  The products
// accumulate in FP32 per scale block (part) and each block's FP32 scale multiplies that
// sum once, at the block's last group (acc += part · scale: the weights' values exact,
// never a BF16 product of code and scale).  The activations are BF16 (the fused FFN half's
// a16; FP32 inputs rounded while staged), the only rounding against the CPU oracle.
#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"
#include "mma.cuh"
#include "moe-combine.cuh"
#include "moe-plan.h"

enum { F8_GATE_UP = 0, F8_DOWN = 1, F8_DENSE = 2 };

struct f8_args {
    const struct lowp_w *tab;   // experts: device [3][n_local] (gate, up, down)
    struct lowp_w dense;        // F8_DENSE: the one matrix
    int n_local;
    int rows, cols;             // N and K of the weight
    int blk_rows, blk_cols;     // its scale blocks (every matrix of the launch)
    const int32_t *offsets, *pair_slot, *items, *counts;
    int chunk, top_k;           // the plan's pairs per item
    const void *x;
    int ldx;
    const float *route_w;       // F8_DOWN: routing weights by slot
    float *out;                 // F8_DOWN: combine into out (moe-combine.cuh), or NULL
    const int32_t *slot_pair;   // F8_DOWN with out
    int32_t *done;              // F8_DOWN with out: [n_rows][gridDim.y]
    float limit;                // F8_GATE_UP
    void *y;                    // F8_GATE_UP: BF16 act; else FP32
    int ldy;
    int n_dense;                // F8_DENSE: tokens
};

// k per stage (4 groups of 32) and the shared row stride: rows g and g + 1 of a 16-byte
// load's 8 lanes fall in opposite halves of the banks (320 bytes = 64 mod 128)
#define F8_KS 128
#define F8_LDS (F8_KS + 32)

// the E4M3 codes of bytes (lo, hi) of q (sel: __byte_perm selector placing them in the high
// byte of each half) as a BF16 pair, exact
static __device__ __forceinline__ uint32_t e4m3x2_bf16(uint32_t q, uint32_t sel)
{
    const uint32_t w = __byte_perm(q, 0, sel);
    const uint32_t b = (w & 0x80008000u) | ((w >> 4) & 0x07f007f0u);   // value · 2^-120
    return bf16x2_mul(b, 0x7b807b80u);                                 // · 2^120 (BF16)
}

// 8 activations at src as BF16 into dst (zeros when !valid)
template <typename TX>
static __device__ __forceinline__ void f8_stage8(bf16 *dst, const TX *src, bool valid);

template <>
__device__ __forceinline__ void f8_stage8<bf16>(bf16 *dst, const bf16 *src, bool valid)
{
    *(uint4 *) dst = valid ? *(const uint4 *) src : make_uint4(0, 0, 0, 0);
}

template <>
__device__ __forceinline__ void f8_stage8<float>(bf16 *dst, const float *src, bool valid)
{
    stage8_f32_bf16(dst, src, valid);
}

// 8 bytes global, read-only
static __device__ __forceinline__ uint2 ldg8(const void *p)
{
    return __ldg((const uint2 *) p);
}

// Block (blockIdx.x, blockIdx.y): token chunk x of 8·NT tokens (experts: item x / SUB, its
// sub-chunk x % SUB), WB warps of 16 rows from row 16·WB·y.
template <int NT, int WB, int MODE, typename TX>
static __global__ void __launch_bounds__(WB * 32) fp8_gemm(const struct f8_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    constexpr int CH = 8 * NT;
    constexpr int TWO = MODE == F8_GATE_UP ? 2 : 1;
    extern __shared__ __align__(16) unsigned char f8_smem[];
    bf16 *xs = (bf16 *) f8_smem;                            // [CH][F8_LDS]
    int32_t *rowsrc = (int32_t *) (xs + CH * F8_LDS);       // [CH]

    int e = 0, p0, cnt;
    if (MODE == F8_DENSE) {
        p0 = blockIdx.x * CH;
        if (p0 >= a.n_dense)
            return;
        cnt = min(CH, a.n_dense - p0);
    } else {
        const int sub_n = (a.chunk + CH - 1) / CH;
        const int item = blockIdx.x / sub_n, sub = blockIdx.x % sub_n;
        if (item >= a.counts[1])
            return;
        e = a.items[2 * item];
        const int i0 = a.items[2 * item + 1] + sub * CH;    // within the expert's pairs
        const int n_e = a.offsets[e + 1] - a.offsets[e];
        cnt = min(min(CH, a.chunk - sub * CH), n_e - i0);
        if (cnt <= 0)
            return;
        p0 = a.offsets[e] + i0;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c4 = lane & 3;
    const int row0 = ((int) blockIdx.y * WB + warp) * 16;
    const bool active = row0 < a.rows;

    for (int i = threadIdx.x; i < CH; i += WB * 32) {
        int src = 0;
        if (i < cnt)
            src = MODE == F8_GATE_UP ? a.pair_slot[p0 + i] / a.top_k : p0 + i;
        rowsrc[i] = src;
    }

    // this lane's codes of row row0 + g (row + 8: + 8 cols) and the row block's scales
    const uint8_t *wr[TWO];
    const float *sr[TWO];
    const int kb_n = a.cols / a.blk_cols;
#pragma unroll
    for (int m = 0; m < TWO; m++) {
        const struct lowp_w *w = MODE == F8_DENSE ? &a.dense : &a.tab[(MODE == F8_DOWN ? 2 : m) * a.n_local + e];
        wr[m] = w->data + (size_t) (row0 + g) * a.cols + 8 * c4;
        sr[m] = (const float *) w->scale + (size_t) (row0 / a.blk_rows) * kb_n;
    }
    const int gpb = a.blk_cols / 32;        // groups per scale block
    float acc[TWO][NT][4], part[TWO][NT][4];
#pragma unroll
    for (int m = 0; m < TWO; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][t][i] = part[m][t][i] = 0.0f;

    const TX *x = (const TX *) a.x;
    const bf16 *xl = xs + g * F8_LDS + 8 * c4;
    const size_t row8 = (size_t) 8 * a.cols;
    for (int k0 = 0; k0 < a.cols; k0 += F8_KS) {
        const int ng = min(4, (a.cols - k0) / 32);
        __syncthreads();        // rowsrc written; the last stage's tokens read
        for (int i = threadIdx.x; i < CH * (F8_KS / 8); i += WB * 32) {
            const int r = i / (F8_KS / 8), c8 = i % (F8_KS / 8);
            const bool valid = r < cnt && k0 + 8 * c8 < a.cols;
            f8_stage8<TX>(xs + r * F8_LDS + 8 * c8,
                          x + (size_t) rowsrc[r] * a.ldx + k0 + 8 * c8, valid);
        }
        // the stage's weights requested before the barrier: in flight meanwhile
        uint2 wv[TWO][4][2];
#pragma unroll
        for (int m = 0; m < TWO; m++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (active && q < ng) {
                    wv[m][q][0] = ldg8(wr[m] + k0 + 32 * q);
                    wv[m][q][1] = ldg8(wr[m] + row8 + k0 + 32 * q);
                }
        __syncthreads();        // the stage's tokens in
        if (!active)
            continue;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            if (q >= ng)
                break;
            // A of steps 0 (words .x) and 1 (.y): a0 / a2 row g, a1 / a3 row g + 8
            uint32_t am[TWO][2][4];
#pragma unroll
            for (int m = 0; m < TWO; m++) {
                const uint32_t lo[2] = { wv[m][q][0].x, wv[m][q][0].y };
                const uint32_t hi[2] = { wv[m][q][1].x, wv[m][q][1].y };
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    am[m][j][0] = e4m3x2_bf16(lo[j], 0x1404);
                    am[m][j][1] = e4m3x2_bf16(hi[j], 0x1404);
                    am[m][j][2] = e4m3x2_bf16(lo[j], 0x3424);
                    am[m][j][3] = e4m3x2_bf16(hi[j], 0x3424);
                }
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t > 0 && t * 8 >= cnt)
                    break;
                const uint4 b = *(const uint4 *) (xl + t * 8 * F8_LDS + 32 * q);
#pragma unroll
                for (int m = 0; m < TWO; m++) {
                    mma_bf16(part[m][t], am[m][0][0], am[m][0][1], am[m][0][2], am[m][0][3],
                             b.x, b.y);
                    mma_bf16(part[m][t], am[m][1][0], am[m][1][1], am[m][1][2], am[m][1][3],
                             b.z, b.w);
                }
            }
            // the scale block's last group: its sums times its scale, once
            const int kg = k0 / 32 + q;
            if ((kg + 1) % gpb == 0) {
#pragma unroll
                for (int m = 0; m < TWO; m++) {
                    const float s = __ldg(sr[m] + kg / gpb);
#pragma unroll
                    for (int t = 0; t < NT; t++)
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            acc[m][t][i] = fmaf(part[m][t][i], s, acc[m][t][i]);
                            part[m][t][i] = 0.0f;
                        }
                }
            }
        }
    }
    // acc[m][t][2h + c] = (row row0 + g + 8h, token 8t + 2·c4 + c)
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (!active)
            break;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int tok = t * 8 + 2 * c4 + c;
            if (tok >= cnt)
                continue;
            const float rw = MODE == F8_DOWN ? a.route_w[a.pair_slot[p0 + tok]] : 1.0f;
            const int64_t yo = (int64_t) (p0 + tok) * a.ldy + row0 + g;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float v0 = acc[0][t][2 * h + c];
                if (MODE == F8_GATE_UP)
                    ((bf16 *) a.y)[yo + 8 * h] =
                        __float2bfloat16_rn(swiglu1(v0, acc[TWO - 1][t][2 * h + c], a.limit));
                else
                    ((float *) a.y)[yo + 8 * h] = v0 * rw;
            }
        }
    }
    // the combine (every warp of the block: barriers); rowsrc is no longer read
    if (MODE == F8_DOWN && a.out) {
        const int rb0 = blockIdx.y * WB * 16;
        moe_combine_epilogue<WB * 32>(a.pair_slot, a.slot_pair, a.done, a.out,
                                      (const float *) a.y, a.top_k, a.ldy, p0, cnt, rb0,
                                      min(WB * 16, a.rows - rb0), rowsrc);
    }
}

// The kernel's shape for up to m tokens per item: NT n8 tiles, WB warps.  Decode (m <= 16)
// one warp per block, so that the blocks spread over the SMs; more tokens 4 warps sharing
// 32 staged tokens.
struct f8_shape {
    int nt, wb;
};

static struct f8_shape f8_shape_for(int m)
{
    if (m <= 8)
        return { 1, 1 };
    if (m <= 16)
        return { 2, 1 };
    return { 4, 4 };
}

// blocks of rows (gridDim.y) of a launch for up to m tokens per item
static int f8_row_blocks(int rows, int m)
{
    const int wb = f8_shape_for(m).wb;
    return (rows / 16 + wb - 1) / wb;
}

// grid_x(ch): blocks along x for chunks of ch tokens.  The launches name their shape (the
// emulator's list of kernels run tells them apart: fmt.sh's FMT_KERNELS).
template <int MODE, typename TX, class GX>
static int f8_dispatch(struct cuda_ctx *c, const struct f8_args &a, int m, GX grid_x)
{
    const struct f8_shape sh = f8_shape_for(m);
    const int gx = grid_x(8 * sh.nt);
    const dim3 grid(gx, (unsigned) f8_row_blocks(a.rows, m));
    const size_t smem = (size_t) 8 * sh.nt * (F8_LDS * sizeof(bf16) + sizeof(int32_t));
    if (gx <= 0)
        return 0;
    if (sh.nt == 1)
        cuda_launch(c, fp8_gemm<1, 1, MODE, TX>, grid, 32, smem, a);
    else if (sh.nt == 2)
        cuda_launch(c, fp8_gemm<2, 1, MODE, TX>, grid, 32, smem, a);
    else
        cuda_launch(c, fp8_gemm<4, 4, MODE, TX>, grid, 128, smem, a);
    return CUDA_LAUNCH_CHECK();
}

bool kcu_fp8_mma_ok(const struct lowp_w *h, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (h[i].fmt != WFMT_FP8 || h[i].blk_rows % 16 || h[i].blk_cols % 32 ||
            h[i].blk_rows != h[0].blk_rows || h[i].blk_cols != h[0].blk_cols)
            return false;
    return n > 0;
}

// the plan (when no router built it) and, past kcu_combine_in_epilogue, the combine:
// moe.cu's (kcu_moe_plan_launch, kcu_moe_combine_f32)

size_t kcu_fp8_moe_ws(int n_rows, int top_k, int hidden, int inter, int n_local)
{
    // kcu_moe's plan, BF16 act and BF16 y, with y FP32 here
    return kcu_moe_ws(n_rows, top_k, hidden, inter, n_local) +
           (((size_t) 2 * n_rows * top_k * hidden + 255) & ~(size_t) 255);
}

int kcu_fp8_moe(struct cuda_ctx *c, const struct lowp_w *tab, int blk_rows, int blk_cols,
                const struct kcu_moe_args *a)
{
    const int n_slots = a->n_rows * a->top_k;
    int r;

    if (a->n_rows == 0 || a->n_local == 0)
        return 0;
    if (a->hidden % 16 || a->inter % 16)
        return -EINVAL;
    struct moe_plan_args pa;
    if (a->plan) {
        pa = *a->plan;
    } else {
        r = kcu_moe_plan_take(c, a, &pa);
        if (r < 0)
            return r;
    }
    bf16 *act = (bf16 *) cuda_ws_take(c, 2 * (size_t) n_slots * a->inter);
    float *y = (float *) cuda_ws_take(c, 4 * (size_t) n_slots * a->hidden);
    if (!act || !y)
        return -ENOMEM;
    if (!a->plan) {
        r = kcu_moe_plan_launch(c, &pa, a->n_local);
        if (r < 0)
            return r;
    }
    // an expert has at most n_rows pairs (a token routes to it once)
    const int m = a->n_rows < pa.chunk ? a->n_rows : pa.chunk;
    const int items_max = moe_items_max(n_slots, a->n_local, pa.chunk);
    auto gx = [&](int ch) { return items_max * ((pa.chunk + ch - 1) / ch); };

    struct f8_args g = {};
    g.tab = tab;
    g.n_local = a->n_local;
    g.rows = a->inter;
    g.cols = a->hidden;
    g.blk_rows = blk_rows;
    g.blk_cols = blk_cols;
    g.offsets = pa.offsets;
    g.pair_slot = pa.pair_slot;
    g.items = pa.items;
    g.counts = pa.counts;
    g.chunk = pa.chunk;
    g.top_k = a->top_k;
    g.x = a->x;
    g.ldx = a->hidden;
    g.limit = a->limit;
    g.y = act;
    g.ldy = a->inter;
    r = a->xt == KDT_BF16 ? f8_dispatch<F8_GATE_UP, bf16>(c, g, m, gx)
                          : f8_dispatch<F8_GATE_UP, float>(c, g, m, gx);
    if (r < 0)
        return r;
    struct f8_args d = g;
    d.rows = a->hidden;
    d.cols = a->inter;
    d.x = act;
    d.ldx = a->inter;
    d.route_w = a->wts;
    d.y = y;
    d.ldy = a->hidden;
    // the combine in the down projection's epilogue: a counter per token and block of rows
    if (kcu_combine_in_epilogue(a->n_rows, f8_row_blocks(a->hidden, m))) {
        d.out = a->out;
        d.slot_pair = pa.slot_pair;
        d.done = c->d_combine_done;
    }
    r = f8_dispatch<F8_DOWN, bf16>(c, d, m, gx);
    if (r < 0 || d.out)
        return r;
    return kcu_moe_combine_f32(c, a->out, y, pa.slot_pair, a->n_rows, a->top_k, a->hidden);
}

int kcu_fp8_dense(struct cuda_ctx *c, const struct lowp_w *w, int rows, const float *x, int n,
                  float *y)
{
    if (n == 0)
        return 0;
    if (rows % 16 || !kcu_fp8_mma_ok(w, 1))
        return -EINVAL;
    struct f8_args a = {};
    a.dense = *w;
    a.rows = rows;
    a.cols = (int) w->cols;
    a.blk_rows = w->blk_rows;
    a.blk_cols = w->blk_cols;
    a.x = x;
    a.ldx = (int) w->cols;
    a.y = y;
    a.ldy = rows;
    a.n_dense = n;
    auto gx = [&](int ch) { return (n + ch - 1) / ch; };
    return f8_dispatch<F8_DENSE, float>(c, a, n, gx);
}
