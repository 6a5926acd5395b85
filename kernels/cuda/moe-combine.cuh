// moe-combine.cuh - the MoE combine in the down projection's epilogue, shared by the
// routed experts' GEMMs (moe.cu mx4_gemm: BF16 y; fp8mma.cu fp8_gemm: FP32 y) at up to
// KCU_ROUTER_GEMV_ROWS rows (docs/GPU.md §3, §3.1): out[t] += the token's local pairs'
// y rows in slot order, as moe_combine_kernel adds them (the same sums in the same order),
// without a launch of its own and without atomic adds of values.
//
// Per (token, block of rows) a device counter (cuda_ctx.d_combine_done, [n_rows][gridDim.y],
// zero between launches): each block, once its y rows are written, adds its pairs of the
// token; the block whose add brings the count to the token's number of local pairs reads
// the other blocks' y (after __threadfence: theirs came before their counts) and adds the
// token's rows to out, then sets the counter back to 0 for the next launch or graph replay.
#pragma once

#include "common.cuh"

// a y element as FP32: BF16 bits or FP32, read past the L1 (another block wrote it)
static __device__ __forceinline__ float moe_combine_ld(const volatile uint16_t *p)
{
    return bf16_to_f32(*p);
}

static __device__ __forceinline__ float moe_combine_ld(const volatile float *p)
{
    return *p;
}

// The calling block (NTHR threads) has written y rows [row0, row0 + nrows) of its cnt pairs
// p0 .. p0 + cnt - 1 (pair_slot: their slots, token = slot / top_k); slot_pair: each slot's
// pair or -1; done: the counters; ld: the row stride of y and out (the hidden size).
// last: cnt ints of shared memory the block no longer reads.  Every thread of the block
// calls it (it holds barriers).
template <int NTHR, typename W>
static __device__ __forceinline__ void moe_combine_epilogue(const int32_t *pair_slot,
                                                            const int32_t *slot_pair,
                                                            int32_t *done, float *out,
                                                            const W *yw, int top_k, int ld,
                                                            int p0, int cnt, int row0,
                                                            int nrows, int32_t *last)
{
    __threadfence();            // this block's y before its counts
    __syncthreads();
    for (int i = threadIdx.x; i < cnt; i += NTHR) {
        const int t = pair_slot[p0 + i] / top_k;
        int np = 0;
        for (int k = 0; k < top_k; k++)
            np += slot_pair[(int64_t) t * top_k + k] >= 0;
        int32_t *d = done + (int64_t) t * gridDim.y + blockIdx.y;
        const bool l = atomicAdd(d, 1) == np - 1;
        if (l)
            *d = 0;
        last[i] = l ? t : -1;
    }
    __syncthreads();
    __threadfence();            // the other blocks' y after their counts
    const volatile W *y = (const volatile W *) yw;
    for (int i = 0; i < cnt; i++) {
        const int t = last[i];
        if (t < 0)
            continue;
        for (int r = threadIdx.x; r < nrows; r += NTHR) {
            float s = 0.0f;
            for (int k = 0; k < top_k; k++) {
                const int p = slot_pair[(int64_t) t * top_k + k];
                if (p >= 0)
                    s += moe_combine_ld(y + (int64_t) p * ld + row0 + r);
            }
            out[(int64_t) t * ld + row0 + r] += s;
        }
    }
}
