// moe.cu - routed experts of a MoE layer, W4A16 on tensor cores (docs/GPU.md §MoE).
//
//  1. moe_plan: the router's top-k grouped by local expert on the device (moe-plan.h):
//     offsets, the pairs of each expert in token order, work items of `chunk` pairs;
//  2. mx4_gemm<GATE_UP>: for every work item and block of rows, act[p] = swiglu(gate·x,
//     up·x) with the clamps, both projections in one pass over the item's tokens;
//  3. mx4_gemm<DOWN>: y[p] = w_route[p] · down·act[p] (routing weight in the epilogue);
//  4. the combine: out[t] += sum over the token's local pairs in slot order (fixed order:
//     the result does not depend on scheduling).  Up to KCU_ROUTER_GEMV_ROWS rows it runs
//     in the down projection's epilogue: per token and block of rows, the last block to
//     write its y (a counter, reset by that block) adds them up; else moe_combine_kernel.
// One launch per step for all local experts of the layer; nothing returns to the host.
//
// mx4_gemm: a warp owns 16 weight rows (one mx4 row tile) and all of the item's tokens
// (up to 8·NT): the weights are the mma's A operand ("swap AB"), read with one 16-byte
// load per lane per 64 k (mx4.h), decoded in registers; the tokens are B, staged in
// shared memory (cp.async, double-buffered, 64·D k per stage) and read with ldmatrix.
// Decode (NT <= 2) runs one warp per block so that the blocks spread over all SMs;
// larger token counts run 4 warps per block, which share the staged tokens.  The same
// kernel in DENSE mode is the MXFP4 matmul of the op path (MTP drafts quantised at load).
#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"
#include "mma.cuh"
#include "moe-combine.cuh"
#include "moe-plan.h"
#include "mx4.h"

enum { MX_GATE_UP = 0, MX_DOWN = 1, MX_DENSE = 2 };

struct mx4_args {
    const uint8_t *const *nib0, *const *sc0, *const *nib1, *const *sc1;
    const uint8_t *dense_nib, *dense_sc;        // MX_DENSE: the one matrix
    int rows, cols;                             // N and K of the weight
    const int32_t *offsets, *pair_slot, *items, *counts;
    int top_k;
    const void *x;
    int ldx;
    const float *route_w;                       // MX_DOWN: weights by slot
    float *out;                                 // MX_DOWN: combine into out, or NULL
    const int32_t *slot_pair;                   // MX_DOWN with out
    int32_t *done;                              // MX_DOWN with out: [n_rows][gridDim.y]
    float limit;                                // MX_GATE_UP
    void *y;
    int ldy;
    int n_dense;                                // MX_DENSE: tokens
    int y_f32;                                  // MX_DENSE: output type
};

template <typename TX>
static __device__ __forceinline__ void stage_chunk(bf16 *dst, const TX *src, bool valid);

template <>
__device__ __forceinline__ void stage_chunk<bf16>(bf16 *dst, const bf16 *src, bool valid)
{
    cp_async16(dst, src, valid ? 16 : 0);
}

template <>
__device__ __forceinline__ void stage_chunk<float>(bf16 *dst, const float *src, bool valid)
{
    stage8_f32_bf16(dst, src, valid);
}

// The four A registers of k-step j of a tile word, scaled (mx4.h; sp: mx4_scales_bf16x2).
// prmt: the matrix is in the nibble layout (mx4_matrix_placed 0), else the build's decode.
static __device__ __forceinline__ void mx4_a_regs(uint32_t w, const uint32_t sp[4], int j,
                                                  const struct mx4_tab &tb, bool prmt,
                                                  uint32_t a[4])
{
    uint32_t r[4];
    if (prmt)
        mx4_word_bf16_prmt(w, &tb, r);
    else
        mx4_word_bf16_tab(w, &tb, r);
    const uint32_t s_lo = sp[mx4_scale_which(j, 0)];
    const uint32_t s_hi = sp[mx4_scale_which(j, 1)];
    a[0] = bf16x2_mul(r[0], s_lo);
    a[1] = bf16x2_mul(r[1], s_hi);
    a[2] = bf16x2_mul(r[2], s_lo);
    a[3] = bf16x2_mul(r[3], s_hi);
}

// d = A·B (no accumulator in): the sum of one k-step pair, scaled after (mx4_gemm, NT 1).
static __device__ __forceinline__ void mma_bf16_first(float d[4], uint32_t a0, uint32_t a1,
                                                      uint32_t a2, uint32_t a3, uint32_t b0,
                                                      uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

static __device__ __forceinline__ uint32_t u4_at(const uint4 &v, int j)
{
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The combine in the down projection's epilogue (moe-combine.cuh): this block's rows [16 WB
// blockIdx.y, +16 WB) of its cnt pairs' BF16 y are written.  last: CH ints of shared
// memory no longer read.
template <int WB>
static __device__ __forceinline__ void mx4_combine(const struct mx4_args &a, int p0, int cnt,
                                                   int32_t *last)
{
    const int row0 = blockIdx.y * WB * 16;
    moe_combine_epilogue<WB * 32>(a.pair_slot, a.slot_pair, a.done, a.out,
                                  (const uint16_t *) a.y, a.top_k, a.ldy, p0, cnt, row0,
                                  min(WB * 16, a.rows - row0), last);
}

static __device__ __forceinline__ uint32_t mx4_sw_word(uint32_t s)
{
    return s;
}

// One 64-k tile d of NVFP4 weights (TWO matrices) against the staged tokens xd (this
// lane's ldmatrix rows at the tile's k): per k-step j (one 16-k scale group) the FP32 sum
// of each n8 token tile, scaled by the group's E4M3 scale (rows l/4: scale byte j, acc 0,
// 1; l/4 + 8: byte 4 + j, acc 2, 3) into acc.  The codes decoded to exact E2M1 values
// (mx4_word_bf16_prmt); the global scale is the epilogue's.
template <int NT, int TWO, int D>
static __device__ __forceinline__ void nv4_tile(const uint4 (&wc)[TWO][D], const uint2 (&sc)[TWO][D],
                                                int d, const struct mx4_tab &tb, const bf16 *xd,
                                                int cnt, float (&acc)[TWO][NT][4])
{
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
        uint32_t am[TWO][2][4];
        float s[TWO][2][2];
#pragma unroll
        for (int m = 0; m < TWO; m++) {
            mx4_word_bf16_prmt(u4_at(wc[m][d], j), &tb, am[m][0]);
            mx4_word_bf16_prmt(u4_at(wc[m][d], j + 1), &tb, am[m][1]);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                s[m][i][0] = nv4_scale_f32(sc[m][d].x, sc[m][d].y, j + i);
                s[m][i][1] = nv4_scale_f32(sc[m][d].x, sc[m][d].y, 4 + j + i);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t > 0 && t * 8 >= cnt)
                break;
            uint32_t b[4];
            ldsm_x4(b, xd + t * 8 * (64 * D + 8) + j * 16);
#pragma unroll
            for (int m = 0; m < TWO; m++) {
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float g[4];
                    mma_bf16_first(g, am[m][i][0], am[m][i][1], am[m][i][2], am[m][i][3],
                                   b[2 * i], b[2 * i + 1]);
                    acc[m][t][0] = fmaf(g[0], s[m][i][0], acc[m][t][0]);
                    acc[m][t][1] = fmaf(g[1], s[m][i][0], acc[m][t][1]);
                    acc[m][t][2] = fmaf(g[2], s[m][i][1], acc[m][t][2]);
                    acc[m][t][3] = fmaf(g[3], s[m][i][1], acc[m][t][3]);
                }
            }
        }
    }
}

// The type of a lane's scale bytes of one k tile: 4 E8M0 (MXFP4), 8 E4M3 (NVFP4).
template <bool NV> struct mx4_sw { typedef uint32_t t; };
template <> struct mx4_sw<true> { typedef uint2 t; };

static __device__ __forceinline__ uint32_t ldg_sw(const uint8_t *p, uint32_t)
{
    return ldg4(p);
}

static __device__ __forceinline__ uint2 ldg_sw(const uint8_t *p, uint2)
{
    return __ldg((const uint2 *) p);
}

template <int NT, int D, int WB, int MODE, typename TX, bool NV>
static __global__ void __launch_bounds__(WB * 32)
mx4_gemm(const struct mx4_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    constexpr int CH = 8 * NT;              // tokens of a work item
    constexpr int KS = 64 * D;              // k per stage
    constexpr int LDS = KS + 8;             // shared row stride (elements): ldmatrix without conflicts
    constexpr int TWO = MODE == MX_GATE_UP ? 2 : 1;
    // One n8 tile of tokens: the E8M0 scales multiply the FP32 sums of each 32-k group
    // (four FMAs a group) rather than the decoded BF16 weights (four HMUL2 a k-step);
    // with more tiles the FMAs would outnumber the HMUL2s.
    // NVFP4 (NV): each k-step is one 16-k scale group; its FP32 sum is scaled by the group's
    // E4M3 scale (4 FMAs a k-step and token tile), the global scale in the epilogue.
    constexpr bool FSCALE = NT == 1 && !MX4_PLACED_ON && !NV;
    typedef typename mx4_sw<NV>::t SW;
    constexpr int SCB = NV ? NV4_TILE_SCALE_BYTES : MX4_TILE_SCALE_BYTES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *xs = (bf16 *) smem_raw;           // [2][CH][LDS]
    int32_t *rowsrc = (int32_t *) (xs + 2 * CH * LDS);  // [CH]: source row of each token

    int e = 0, p0, cnt;
    if (MODE == MX_DENSE) {
        p0 = blockIdx.x * CH;
        if (p0 >= a.n_dense)
            return;
        cnt = min(CH, a.n_dense - p0);
    } else {
        if ((int) blockIdx.x >= a.counts[1])
            return;
        e = a.items[2 * blockIdx.x];
        p0 = a.offsets[e] + a.items[2 * blockIdx.x + 1];
        cnt = min(CH, a.offsets[e + 1] - p0);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // 32-bit sizes: rows, cols < 2^31 (kernel arguments); offsets that could pass 2^32
    // bytes stay in pointers, advanced once per stage
    const int kt_n = (int) (((unsigned) a.cols + 63) / 64);   // 64-k tiles of a row
    const int rt = (int) blockIdx.y * WB + warp;                // this warp's row tile
    const bool active = rt * 16 < a.rows;
    const int n_stages = (int) (((unsigned) kt_n + D - 1) / D);

    for (int i = threadIdx.x; i < CH; i += WB * 32) {
        int src = -1;
        if (i < cnt)
            src = MODE == MX_GATE_UP ? a.pair_slot[p0 + i] / a.top_k : p0 + i;
        rowsrc[i] = src;
    }
    __syncthreads();

    // Token staging: a thread copies the same 16-byte column chunk c8 of token rows r0 +
    // i·RSTEP at every stage, the rows of the item's cnt tokens only (the columns of the
    // others are never read back).  Their offsets in x, in 8-element units with c8
    // included (32-bit: the host keeps x under 2^35 elements, mx4_x_fits), are computed
    // once into registers at decode (one warp a block); larger shapes read rowsrc per
    // stage (registers kept for the accumulators).
    constexpr int CPR = KS / 8;                 // 16-byte chunks per token row and stage
    constexpr int RSTEP = WB * 32 / CPR;        // token rows one pass of the block covers
    constexpr int XIT = CH / RSTEP;             // chunks per thread and stage
    constexpr bool XREG = WB == 1 && NT == 1;
    static_assert((WB * 32) % CPR == 0 && CH % RSTEP == 0, "mx4_gemm staging shape");
    const int tid = WB == 1 ? lane : (int) threadIdx.x;
    const int c8 = tid % CPR, r0 = tid / CPR;
    const TX *x = (const TX *) a.x;
    auto x_off = [&](int i) -> uint32_t {
        return (uint32_t) max(rowsrc[r0 + i * RSTEP], 0) * (uint32_t) (a.ldx / 8) + c8;
    };
    uint32_t xo[XREG ? XIT : 1];
#pragma unroll
    for (int i = 0; i < (XREG ? XIT : 0); i++)
        xo[i] = x_off(i);
    bf16 *const xdst = xs + r0 * LDS + c8 * 8;
    auto load_stage = [&](int s, int buf) {
        // past the row's end (K not a multiple of 64·D): a zero chunk, nothing read
        const bool valid = s * KS + c8 * 8 < a.cols;
        const TX *xk = x + (size_t) s * KS;
        bf16 *dst = xdst + buf * CH * LDS;
#pragma unroll
        for (int i = 0; i < XIT; i++) {
            if (r0 + i * RSTEP >= cnt)
                break;
            const uint32_t o = XREG ? xo[i] : x_off(i);
            stage_chunk<TX>(dst + i * RSTEP * LDS, xk + (size_t) o * 8, valid);
        }
    };

    // This lane's bytes of the first k tile, per matrix: 16 nibble bytes, 4 scale bytes.
    // kl: tiles left to load (0: an idle warp).
    const uint8_t *wp[TWO], *sp[TWO];
    float gs[TWO];                              // NVFP4: the global scales
    bool prmt[TWO];                             // MXFP4: the matrix's decode (mx4.h)
#pragma unroll
    for (int m = 0; m < TWO; m++) {
        const uint8_t *nbm = MODE == MX_DENSE ? a.dense_nib : m == 0 ? a.nib0[e] : a.nib1[e];
        const uint8_t *sbm = MODE == MX_DENSE ? a.dense_sc : m == 0 ? a.sc0[e] : a.sc1[e];
        wp[m] = nbm + (size_t) rt * kt_n * MX4_TILE_NIB_BYTES + lane * 16;
        sp[m] = sbm + (size_t) rt * kt_n * SCB + (lane >> 2) * (SCB / 8);
        gs[m] = NV ? *(const float *) (sbm + nv4_scale_bytes(a.rows, a.cols)) : 1.0f;
        prmt[m] = MX4_PLACED_ON && !NV && !mx4_matrix_placed(sbm, a.rows, a.cols);
    }
    int kl = active ? kt_n : 0;
    auto load_w = [&](uint4 (&wd)[TWO][D], SW (&sd)[TWO][D]) {
#pragma unroll
        for (int m = 0; m < TWO; m++) {
#pragma unroll
            for (int d = 0; d < D; d++)
                if (d < kl) {
                    wd[m][d] = ldg16(wp[m] + d * MX4_TILE_NIB_BYTES);
                    sd[m][d] = ldg_sw(sp[m] + d * SCB, SW());
                }
            wp[m] += D * MX4_TILE_NIB_BYTES;
            sp[m] += D * SCB;
        }
        kl -= D;
    };

    float acc[TWO][NT][4];
#pragma unroll
    for (int m = 0; m < TWO; m++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][t][i] = 0.0f;

    // ldmatrix rows of this lane: token t·8 + lane%8, k offset (lane/8)·8 of a 32-k pair
    const bf16 *const xl = xs + (lane & 7) * LDS + (lane >> 3) * 8;
    int kc = active ? kt_n : 0;                 // tiles left to compute
    const struct mx4_tab tb = mx4_tables();
    // Stage s (buffer par = s & 1): once its tokens are in, stage s + 1's tokens and
    // weights are requested into the other buffers, then stage s is decoded and multiplied
    // while they load.  The weights alternate between two register sets, the loop below
    // running two stages a turn, so that nothing is copied from one to the other.
    // P: whether a matrix may be in the PRMT layout (a constant at each call below: the
    // common case, every matrix placed, runs a loop without the per-word branch)
    auto stage = [&](bool P, int s, int par, const uint4 (&wc)[TWO][D], const SW (&sc)[TWO][D],
                     uint4 (&wn)[TWO][D], SW (&sn)[TWO][D]) {
        cp_async_wait<0>();     // stage s's tokens: this thread's copies
        __syncthreads();        // everyone's, and stage s - 1's buffer is read
        if (s + 1 < n_stages) {
            load_stage(s + 1, par ^ 1);
            cp_async_commit();
            load_w(wn, sn);
        }
        const bf16 *xb = xl + par * CH * LDS;
#pragma unroll
        for (int d = 0; d < D; d++) {
            if (d >= kc)
                break;
            if constexpr (NV) {
                nv4_tile<NT, TWO>(wc, sc, d, tb, xb + d * 64, cnt, acc);
            } else {
#pragma unroll
                for (int j = 0; j < 4; j += 2) {
                    // k-steps j, j + 1: 32-k group j / 2 of the tile
                    uint32_t am[TWO][2][4];
#pragma unroll
                    for (int m = 0; m < TWO; m++) {
                        if (FSCALE) {
                            mx4_word_bf16_tab(u4_at(wc[m][d], j), &tb, am[m][0]);
                            mx4_word_bf16_tab(u4_at(wc[m][d], j + 1), &tb, am[m][1]);
                        } else {
                            uint32_t sp4[4];
                            mx4_scales_bf16x2(mx4_sw_word(sc[m][d]), sp4);
                            const bool pm = P && prmt[m];
                            mx4_a_regs(u4_at(wc[m][d], j), sp4, j, tb, pm, am[m][0]);
                            mx4_a_regs(u4_at(wc[m][d], j + 1), sp4, j + 1, tb, pm, am[m][1]);
                        }
                    }
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        if (t > 0 && t * 8 >= cnt)
                            break;
                        uint32_t b[4];
                        ldsm_x4(b, xb + t * 8 * LDS + d * 64 + j * 16);
#pragma unroll
                        for (int m = 0; m < TWO; m++) {
                            if (FSCALE) {
                                // the group's sum, then its rows' scales (rows l/4: acc 0, 1;
                                // l/4 + 8: acc 2, 3)
                                float g[4];
                                mma_bf16_first(g, am[m][0][0], am[m][0][1], am[m][0][2],
                                               am[m][0][3], b[0], b[1]);
                                mma_bf16(g, am[m][1][0], am[m][1][1], am[m][1][2], am[m][1][3],
                                         b[2], b[3]);
                                const float s_lo = mx4_scale_f32(mx4_sw_word(sc[m][d]),
                                                                 mx4_scale_which(j, 0));
                                const float s_hi = mx4_scale_f32(mx4_sw_word(sc[m][d]),
                                                                 mx4_scale_which(j, 1));
                                acc[m][t][0] = fmaf(g[0], s_lo, acc[m][t][0]);
                                acc[m][t][1] = fmaf(g[1], s_lo, acc[m][t][1]);
                                acc[m][t][2] = fmaf(g[2], s_hi, acc[m][t][2]);
                                acc[m][t][3] = fmaf(g[3], s_hi, acc[m][t][3]);
                            } else {
                                mma_bf16(acc[m][t], am[m][0][0], am[m][0][1], am[m][0][2],
                                         am[m][0][3], b[0], b[1]);
                                mma_bf16(acc[m][t], am[m][1][0], am[m][1][1], am[m][1][2],
                                         am[m][1][3], b[2], b[3]);
                            }
                        }
                    }
                }
            }
        }
        kc -= D;
    };

    uint4 w0[TWO][D], w1[TWO][D];
    SW s0[TWO][D], s1[TWO][D];
    load_stage(0, 0);
    cp_async_commit();
    load_w(w0, s0);
    if (prmt[0] || prmt[TWO - 1]) {
        for (int s = 0; s < n_stages; s += 2) {
            stage(true, s, 0, w0, s0, w1, s1);
            if (s + 1 < n_stages)
                stage(true, s + 1, 1, w1, s1, w0, s0);
        }
    } else {
        for (int s = 0; s < n_stages; s += 2) {
            stage(false, s, 0, w0, s0, w1, s1);
            if (s + 1 < n_stages)
                stage(false, s + 1, 1, w1, s1, w0, s0);
        }
    }
    // epilogue: acc[m][t][2h + c] = (row 16rt + lane/4 + 8h, token 8t + 2(lane%4) + c)
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (!active)
            break;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int tok = t * 8 + 2 * (lane % 4) + c;
            if (tok >= cnt)
                continue;
            float rw = 1.0f;
            if (MODE == MX_DOWN)
                rw = a.route_w[a.pair_slot[p0 + tok]];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int64_t row = rt * 16 + lane / 4 + 8 * h;
                if (row >= a.rows)
                    continue;
                // NVFP4: the global scale, once (gs 1 for MXFP4)
                const float v0 = NV ? acc[0][t][2 * h + c] * gs[0] : acc[0][t][2 * h + c];
                if (MODE == MX_GATE_UP) {
                    const float v1 = NV ? acc[TWO - 1][t][2 * h + c] * gs[TWO - 1]
                                        : acc[TWO - 1][t][2 * h + c];
                    const float v = swiglu1(v0, v1, a.limit);
                    ((bf16 *) a.y)[(int64_t) (p0 + tok) * a.ldy + row] = __float2bfloat16_rn(v);
                } else if (MODE == MX_DOWN) {
                    ((bf16 *) a.y)[(int64_t) (p0 + tok) * a.ldy + row] = __float2bfloat16_rn(v0 * rw);
                } else if (a.y_f32) {
                    ((float *) a.y)[(int64_t) (p0 + tok) * a.ldy + row] = v0;
                } else {
                    ((bf16 *) a.y)[(int64_t) (p0 + tok) * a.ldy + row] = __float2bfloat16_rn(v0);
                }
            }
        }
    }
    if (MODE == MX_DOWN && a.out)
        mx4_combine<WB>(a, p0, cnt, rowsrc);
}

// The kernel's shape for up to m tokens per item: NT n8 tiles, D k-tiles per stage, WB warps.
struct mx4_shape {
    int nt, d, wb;
};

static struct mx4_shape mx4_shape_for(int m)
{
    if (m <= 8)
        return { 1, 4, 1 };
    if (m <= 16)
        return { 2, 4, 1 };
    if (m <= 32)
        return { 4, 2, 4 };
    return { 8, 2, 4 };
}

static size_t mx4_smem(struct mx4_shape s)
{
    return (size_t) 2 * 8 * s.nt * (64 * s.d + 8) * sizeof(bf16) + 8 * s.nt * sizeof(int32_t);
}

template <int NT, int D, int WB, int MODE, typename TX, bool NV>
static int mx4_launch(struct cuda_ctx *c, const struct mx4_args &a, int grid_x)
{
    const struct mx4_shape s = { NT, D, WB };
    const int64_t row_tiles = mx4_rows_padded(a.rows) / 16;
    dim3 grid(grid_x, (unsigned) ((row_tiles + WB - 1) / WB));
    if (grid_x <= 0)
        return 0;
    if (NV) {
        // its own name in the emulator's list of kernels run (test/cuemu)
        void (*const nv4_gemm)(const struct mx4_args) = mx4_gemm<NT, D, WB, MODE, TX, NV>;
        cuda_launch(c, nv4_gemm, grid, WB * 32, mx4_smem(s), a);
    } else {
        cuda_launch(c, mx4_gemm<NT, D, WB, MODE, TX, NV>, grid, WB * 32, mx4_smem(s), a);
    }
    return CUDA_LAUNCH_CHECK();
}

template <int MODE, typename TX, bool NV = false>
static int mx4_dispatch(struct cuda_ctx *c, const struct mx4_args &a, int m, int grid_x)
{
    switch (mx4_shape_for(m).nt) {
    case 1: return mx4_launch<1, 4, 1, MODE, TX, NV>(c, a, grid_x);
    case 2: return mx4_launch<2, 4, 1, MODE, TX, NV>(c, a, grid_x);
    case 4: return mx4_launch<4, 2, 4, MODE, TX, NV>(c, a, grid_x);
    default: return mx4_launch<8, 2, 4, MODE, TX, NV>(c, a, grid_x);
    }
}

// The routed experts' launches of kcu_moe: MXFP4, or NVFP4 (nv) in the same tile layout.
template <int MODE, typename TX>
static int mx4_dispatch_fmt(struct cuda_ctx *c, const struct mx4_args &a, int m, int grid_x,
                            bool nv)
{
    return nv ? mx4_dispatch<MODE, TX, true>(c, a, m, grid_x)
              : mx4_dispatch<MODE, TX, false>(c, a, m, grid_x);
}

// ---- the plan ----

static __global__ void __launch_bounds__(MOE_PLAN_THREADS) moe_plan_kernel(struct moe_plan_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    extern __shared__ int32_t plan_sh[];

    kcu_moe_plan_block(&a, plan_sh);
}

int kcu_moe_plan_launch(struct cuda_ctx *c, const struct moe_plan_args *pa, int n_local)
{
    const size_t plan_smem = kcu_moe_plan_smem(n_local);
    if (plan_smem > 48 * 1024 && plan_smem > c->smem_optin)
        return -E2BIG;
    if (plan_smem > 48 * 1024)
        cudaFuncSetAttribute(moe_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int) plan_smem);
    cuda_launch(c, moe_plan_kernel, 1, MOE_PLAN_THREADS, plan_smem, *pa);
    return CUDA_LAUNCH_CHECK();
}

// out[t, :] += sum_k y[slot_pair[t * top_k + k], :] (k ascending), two columns a thread;
// y BF16 (mx4_gemm's down projection) or FP32 (fp8mma.cu's)
template <typename T>
static __global__ void moe_combine_kernel(float *out, const T *y, const int32_t *slot_pair,
                                          int top_k, int hidden)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int t = blockIdx.x;
    const int col = 2 * (blockIdx.y * blockDim.x + threadIdx.x);
    if (col >= hidden)
        return;
    float s0 = 0.0f, s1 = 0.0f;
    for (int k = 0; k < top_k; k++) {
        const int p = slot_pair[(int64_t) t * top_k + k];
        if (p < 0)
            continue;
        const T *v = y + (int64_t) p * hidden + col;
        s0 += to_f32<T>(v[0]);
        s1 += to_f32<T>(v[1]);
    }
    float2 *o = (float2 *) (out + (int64_t) t * hidden + col);
    float2 cur = *o;
    cur.x += s0;
    cur.y += s1;
    *o = cur;
}

template <typename T>
static int moe_combine(struct cuda_ctx *c, float *out, const T *y, const int32_t *slot_pair,
                       int n_rows, int top_k, int hidden)
{
    dim3 grid(n_rows, cuda_blocks((size_t) hidden / 2, 256));
    cuda_launch(c, moe_combine_kernel<T>, grid, 256, 0, out, y, slot_pair, top_k, hidden);
    return CUDA_LAUNCH_CHECK();
}

int kcu_moe_combine_f32(struct cuda_ctx *c, float *out, const float *y, const int32_t *slot_pair,
                        int n_rows, int top_k, int hidden)
{
    return hidden % 2 ? -EINVAL : moe_combine(c, out, y, slot_pair, n_rows, top_k, hidden);
}

static size_t align256(size_t n)
{
    return (n + 255) & ~(size_t) 255;
}

static int moe_chunk(int n_rows)
{
    const int m = n_rows < 64 ? n_rows : 64;   // most tokens one expert can have, capped
    return 8 * mx4_shape_for(m).nt;
}

size_t kcu_moe_ws(int n_rows, int top_k, int hidden, int inter, int n_local)
{
    const size_t n_slots = (size_t) n_rows * top_k;
    const size_t items = (size_t) moe_items_max((int) n_slots, n_local, moe_chunk(n_rows));
    const size_t mx4 = align256(4 * ((size_t) n_local + 1)) + 2 * align256(4 * n_slots) +
                       align256(8 * (items + 1)) + align256(16) + align256(2 * n_slots * inter) +
                       align256(2 * n_slots * hidden);
    // FP8 / NVFP4 experts (lowp.cu): their FP32 act
    const size_t lowp = align256(moe_warp_act_bytes(n_rows, top_k, inter));
    return mx4 > lowp ? mx4 : lowp;
}

int kcu_moe_plan_take(struct cuda_ctx *c, const struct kcu_moe_args *a, struct moe_plan_args *pa)
{
    const int n_slots = a->n_rows * a->top_k;
    const int chunk = moe_chunk(a->n_rows);
    const int items_max = moe_items_max(n_slots, a->n_local, chunk);

    *pa = {};
    pa->ids = a->ids;
    pa->n_slots = n_slots;
    pa->expert_first = a->expert_first;
    pa->n_local = a->n_local;
    pa->chunk = chunk;
    pa->offsets = (int32_t *) cuda_ws_take(c, 4 * ((size_t) a->n_local + 1));
    pa->pair_slot = (int32_t *) cuda_ws_take(c, 4 * (size_t) n_slots);
    pa->slot_pair = (int32_t *) cuda_ws_take(c, 4 * (size_t) n_slots);
    pa->items = (int32_t *) cuda_ws_take(c, 8 * ((size_t) items_max + 1));
    pa->counts = (int32_t *) cuda_ws_take(c, 16);
    if (!pa->offsets || !pa->pair_slot || !pa->slot_pair || !pa->items || !pa->counts)
        return -ENOMEM;
    return 0;
}

int kcu_moe(struct cuda_ctx *c, const struct kcu_moe_w *w, const struct kcu_moe_args *a)
{
    const int n_slots = a->n_rows * a->top_k;
    const int m = a->n_rows < 64 ? a->n_rows : 64;
    const int items_max = moe_items_max(n_slots, a->n_local, moe_chunk(a->n_rows));
    int r;

    if (a->n_rows == 0 || a->n_local == 0)
        return 0;
    if (a->hidden % 32 || a->inter % 32 || a->hidden % 2)
        return -EINVAL;
    if (!mx4_x_fits(a->n_rows, a->hidden) || !mx4_x_fits(n_slots, a->inter))
        return -E2BIG;
    struct moe_plan_args pa;
    if (a->plan) {
        pa = *a->plan;          // built by the router
    } else {
        r = kcu_moe_plan_take(c, a, &pa);
        if (r < 0)
            return r;
    }
    bf16 *act = (bf16 *) cuda_ws_take(c, 2 * (size_t) n_slots * a->inter);
    bf16 *y = (bf16 *) cuda_ws_take(c, 2 * (size_t) n_slots * a->hidden);
    if (!act || !y)
        return -ENOMEM;
    int32_t *offsets = pa.offsets, *pair_slot = pa.pair_slot, *slot_pair = pa.slot_pair,
            *items = pa.items, *counts = pa.counts;

    if (!a->plan) {
        r = kcu_moe_plan_launch(c, &pa, a->n_local);
        if (r < 0)
            return r;
    }

    struct mx4_args g = {};
    g.nib0 = w->gate_nib;
    g.sc0 = w->gate_sc;
    g.nib1 = w->up_nib;
    g.sc1 = w->up_sc;
    g.rows = a->inter;
    g.cols = a->hidden;
    g.offsets = offsets;
    g.pair_slot = pair_slot;
    g.items = items;
    g.counts = counts;
    g.top_k = a->top_k;
    g.x = a->x;
    g.ldx = a->hidden;
    g.limit = a->limit;
    g.y = act;
    g.ldy = a->inter;
    r = a->xt == KDT_BF16 ? mx4_dispatch_fmt<MX_GATE_UP, bf16>(c, g, m, items_max, w->nvfp4)
                          : mx4_dispatch_fmt<MX_GATE_UP, float>(c, g, m, items_max, w->nvfp4);
    if (r < 0)
        return r;

    struct mx4_args d = g;
    d.nib0 = w->down_nib;
    d.sc0 = w->down_sc;
    d.nib1 = d.sc1 = NULL;
    d.rows = a->hidden;
    d.cols = a->inter;
    d.x = act;
    d.ldx = a->inter;
    d.route_w = a->wts;
    d.y = y;
    d.ldy = a->hidden;
    // the combine in the down projection's epilogue: a counter per token and block of rows
    const int64_t row_blocks = (mx4_rows_padded(a->hidden) / 16 + mx4_shape_for(m).wb - 1) /
                               mx4_shape_for(m).wb;
    if (kcu_combine_in_epilogue(a->n_rows, row_blocks)) {
        d.out = a->out;
        d.slot_pair = slot_pair;
        d.done = c->d_combine_done;
    }
    r = mx4_dispatch_fmt<MX_DOWN, bf16>(c, d, m, items_max, w->nvfp4);
    if (r < 0 || d.out)
        return r;

    return moe_combine(c, a->out, y, slot_pair, a->n_rows, a->top_k, a->hidden);
}

int kcu_mx4_dense(struct cuda_ctx *c, const struct cuda_weight *w, int rows, int cols, int n,
                  const void *x, kdt xt, void *y, kdt yt)
{
    const int m = n < 64 ? n : 64;
    const int chunk = 8 * mx4_shape_for(m).nt;
    struct mx4_args a = {};

    if (n == 0)
        return 0;
    if (!mx4_x_fits(n, cols))
        return -E2BIG;
    a.dense_nib = (const uint8_t *) w->data;
    a.dense_sc = w->scale;
    a.rows = rows;
    a.cols = cols;
    a.x = x;
    a.ldx = cols;
    a.y = y;
    a.ldy = rows;
    a.n_dense = n;
    a.y_f32 = yt == KDT_F32;
    const int grid_x = (n + chunk - 1) / chunk;
    return xt == KDT_BF16 ? mx4_dispatch<MX_DENSE, bf16>(c, a, m, grid_x)
                          : mx4_dispatch<MX_DENSE, float>(c, a, m, grid_x);
}

void kcu_expert_table(const struct moe_expert *ex, int n_local, const uint8_t **h)
{
    for (int e = 0; e < n_local; e++) {
        const struct bweight *w[3] = { &ex[e].gate, &ex[e].up, &ex[e].down };
        for (int m = 0; m < 3; m++) {
            const struct cuda_weight *cw = (const struct cuda_weight *) w[m]->priv;
            h[(2 * m) * n_local + e] = (const uint8_t *) cw->data;
            h[(2 * m + 1) * n_local + e] = cw->scale;
        }
    }
}

// ---- the op (FP32 interface) ----

int kcuda_moe(struct backend *be, const struct moe_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);

    if (a->n_tok == 0 || a->n_local == 0)
        return 0;
    if (a->n_tok < 0 || a->n_local < 0)
        return -EINVAL;
    // NVFP4 on the tensor-core path: mx4_gemm; FP8, and NVFP4 on the FP32 op path: lowp.cu
    const int fmt = a->experts[0].gate.fmt;
    if (fmt != WFMT_MXFP4 && fmt != WFMT_NVFP4 && fmt != WFMT_FP8)
        return -EINVAL;
    if (fmt == WFMT_FP8 || (fmt == WFMT_NVFP4 && c->exact))
        return kcu_lowp_moe(c, a);
    for (int e = 0; e < a->n_local; e++) {
        const struct moe_expert *x = &a->experts[e];
        if (x->gate.fmt != fmt || x->up.fmt != fmt || x->down.fmt != fmt ||
            x->gate.rows != a->inter || x->gate.cols != a->hidden || x->up.rows != a->inter ||
            x->up.cols != a->hidden || x->down.rows != a->hidden || x->down.cols != a->inter ||
            !x->gate.priv || !x->up.priv || !x->down.priv)
            return -EINVAL;
    }
    if (c->exact)
        return kcuda_moe_exact(be, a);
    // the table of the local experts' device pointers, for this call
    const size_t nt = 6 * (size_t) a->n_local;
    const uint8_t **h = (const uint8_t **) malloc(nt * sizeof(void *));
    if (!h)
        return -ENOMEM;
    kcu_expert_table(a->experts, a->n_local, h);
    int r = cuda_ws_ensure(c, kcu_moe_ws(a->n_tok, a->top_k, a->hidden, a->inter, a->n_local));
    if (r < 0) {
        free(h);
        return r;
    }
    cuda_stage_reset(c);
    cuda_ws_reset(c);
    const uint8_t *const *dt = (const uint8_t *const *) cuda_stage(c, h, nt * sizeof(void *));
    free(h);
    if (!dt)
        return -ENOMEM;
    struct kcu_moe_w w = { dt, dt + a->n_local, dt + 2 * a->n_local, dt + 3 * a->n_local,
                           dt + 4 * a->n_local, dt + 5 * a->n_local, fmt == WFMT_NVFP4 };
    struct kcu_moe_args ma = { a->n_tok, a->top_k, a->hidden, a->inter, a->expert_first,
                               a->n_local, a->limit, a->ids, a->weights, a->x, KDT_F32, a->out,
                               NULL };
    return kcu_moe(c, &w, &ma);
}
