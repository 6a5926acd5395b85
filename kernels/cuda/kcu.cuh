// kcu.cuh - the CUDA backend's internal kernels as its files call each other (C++; the
// ops table of backend-cuda.cu reaches them through cuda.h and block.cu).
#pragma once

#include "common.cuh"
#include "moe-plan.h"

enum kdt { KDT_F32 = 0, KDT_BF16 = 1 };

static inline size_t kdt_size(kdt t)
{
    return t == KDT_F32 ? 4 : 2;
}

// ---- gemm.cu: cuBLASLt, one algorithm per shape ----
int kcu_lt_init(struct cuda_ctx *c);
void kcu_lt_free(struct cuda_ctx *c);
// y[m, n] (ldy) = x[m, k] (ldx) · W[n, k]ᵀ (+ y when acc); W and x of the same type
// (BF16, or F32 for the FP32 router gate), FP32 accumulation.
int kcu_gemm(struct cuda_ctx *c, int m, int n, int k, const void *w, kdt wt, const void *x,
             int ldx, void *y, kdt yt, int ldy, bool acc);
// y[i] = BF16(x[i])
int kcu_to_bf16(struct cuda_ctx *c, const float *x, bf16 *y, size_t n);

// ---- moe.cu: MXFP4 on tensor cores ----
// Per local expert, device arrays of the repacked weights (mx4.h).
struct kcu_moe_w {
    const uint8_t *const *gate_nib, *const *gate_sc, *const *up_nib, *const *up_sc;
    const uint8_t *const *down_nib, *const *down_sc;
    bool nvfp4;                 // NVFP4 tiles (mx4.h nv4_*), else MXFP4
};
struct kcu_moe_args {
    int n_rows;                 // token rows (launch shape; rows >= *n_real carry ids -1)
    int top_k, hidden, inter, expert_first, n_local;
    float limit;
    const int32_t *ids;         // [n_rows, top_k] device
    const float *wts;           // [n_rows, top_k] device
    const void *x;              // [n_rows, hidden] (ldx = hidden)
    kdt xt;
    float *out;                 // [n_rows, hidden] FP32: out += routed experts
    const struct moe_plan_args *plan;   // or NULL: built by the router (kcu_moe_plan_take)
};
int kcu_moe(struct cuda_ctx *c, const struct kcu_moe_w *w, const struct kcu_moe_args *a);
// (token row, block of rows) counters of the combine in the down projection's epilogue
// (cuda_ctx.d_combine_done, moe-combine.cuh; kcu_combine_in_epilogue)
#define KCU_COMBINE_DONE_CAP 32768
// The plan's buffers taken from the workspace, first of what kcu_moe takes (a->ids set):
// for a router that builds the plan itself (kcu_router_gemv); pass it as a->plan.
int kcu_moe_plan_take(struct cuda_ctx *c, const struct kcu_moe_args *a,
                      struct moe_plan_args *ret);
// the plan by moe_plan_kernel (one block) into pa's buffers, for a call whose router did not
// build it; -E2BIG when its shared memory exceeds the device's
int kcu_moe_plan_launch(struct cuda_ctx *c, const struct moe_plan_args *pa, int n_local);
// out[t, :] += the token's FP32 pair rows y[slot_pair[t * top_k + k], :] in slot order
// (moe_combine_kernel<float>; fp8mma.cu past kcu_combine_in_epilogue); hidden even
int kcu_moe_combine_f32(struct cuda_ctx *c, float *out, const float *y, const int32_t *slot_pair,
                        int n_rows, int top_k, int hidden);
// dynamic shared memory of the plan's block (moe-plan.h: cnt, run, ccnt, es)
static inline size_t kcu_moe_plan_smem(int n_local)
{
    return sizeof(int32_t) * (3 * (size_t) n_local + MOE_PLAN_THREADS);
}
// The plan built by the MOE_PLAN_THREADS threads of the calling block, its phases between
// barriers; sh_i: kcu_moe_plan_smem bytes of shared memory (moe_plan_kernel and the
// router's last block)
static __device__ __forceinline__ void kcu_moe_plan_block(struct moe_plan_args *a, int32_t *sh_i)
{
    struct moe_plan_shared sh = { sh_i, sh_i + a->n_local, sh_i + 2 * a->n_local,
                                  sh_i + 3 * a->n_local };
    const int tid = threadIdx.x;

    moe_plan_p0(tid, a, &sh);
    __syncthreads();
    moe_plan_p1(tid, a, &sh);
    __syncthreads();
    moe_plan_p2(tid, a, &sh);
    __syncthreads();
    for (int base = 0; base < a->n_slots; base += MOE_PLAN_THREADS) {
        moe_plan_p3a(tid, base, a, &sh);
        __syncthreads();
        moe_plan_p3b(tid, base, a, &sh);
        __syncthreads();
        moe_plan_p3c(tid, a, &sh);
        __syncthreads();
    }
}
// y[n, rows] = x[n, cols] · Wᵀ for an MXFP4 weight (repacked)
int kcu_mx4_dense(struct cuda_ctx *c, const struct cuda_weight *w, int rows, int cols, int n,
                  const void *x, kdt xt, void *y, kdt yt);
// host table [6][n_local] of the local experts' device pointers: gate nibbles, gate
// scales, up nibbles, up scales, down nibbles, down scales (the layout of kcu_moe_w)
void kcu_expert_table(const struct moe_expert *ex, int n_local, const uint8_t **h);
// workspace bytes kcu_moe needs for n_rows token rows
size_t kcu_moe_ws(int n_rows, int top_k, int hidden, int inter, int n_local);

// ---- router.cu ----
// ids/w [n_rows, top_k] from logits [n_rows, n_exp] FP32; rows >= *n_real (when given)
// get ids -1, weights 0.  bias: device [n_exp] or NULL.
int kcu_router(struct cuda_ctx *c, const float *logits, const float *bias, int n_rows,
               const int32_t *n_real, int n_exp, int top_k, bool renorm, float scale,
               int32_t *ids, float *w);
// The same from x [n_rows, hidden] FP32 and the router w [n_exp, hidden] FP32: the logits
// computed in the kernel (no GEMM node); for few rows (KCU_ROUTER_GEMV_ROWS).
#define KCU_ROUTER_GEMV_ROWS 64
// plan (or NULL): the last block to finish also builds the MoE plan of the ids (one node
// for the GEMV, the top-k and the plan).
int kcu_router_gemv(struct cuda_ctx *c, const float *x, const float *w, int hidden,
                    const float *bias, int n_rows, const int32_t *n_real, int n_exp, int top_k,
                    bool renorm, float scale, int32_t *ids, float *wts,
                    const struct moe_plan_args *plan);
// whether the MoE combine of n_rows token rows runs in the down projection's epilogue
// (moe-combine.cuh; mx4_gemm, fp8_gemm) with row_blocks blocks of rows (its gridDim.y):
// up to KCU_ROUTER_GEMV_ROWS rows and KCU_COMBINE_DONE_CAP counters; else moe_combine_kernel
static inline bool kcu_combine_in_epilogue(int n_rows, int64_t row_blocks)
{
    return n_rows <= KCU_ROUTER_GEMV_ROWS && n_rows * row_blocks <= KCU_COMBINE_DONE_CAP;
}

// ---- norm.cu ----
// y = rmsnorm(x) (Gemma 1 + w), x FP32 [rows, dim]; writes y16 (BF16) and/or y32.
int kcu_rmsnorm(struct cuda_ctx *c, const float *x, const struct bweight *w, int rows, int dim,
                float eps, bf16 *y16, float *y32);
// out[i] = swiglu(gu[i][0..I), gu[i][I..2I)) for gu [rows, 2I] BF16 -> out [rows, I] BF16
int kcu_swiglu_fused(struct cuda_ctx *c, const bf16 *gu, int rows, int inter, float limit,
                     bf16 *out);
// The dense MLP's gate+up projection with SwiGLU in its epilogue (one node in place of a
// GEMM and kcu_swiglu_fused): act [rows, inter] BF16 = swiglu(x · gateᵀ, x · upᵀ) for the
// fused weight gu [2 inter, hidden] (gate rows, then up rows) and x [rows, hidden] BF16,
// FP32 sums; for few rows (decode), when kcu_gu_swiglu_ok.
#define KCU_GU_ROWS 32
#define KCU_GU_TOKENS 8
bool kcu_gu_swiglu_ok(int rows, int hidden);
int kcu_gu_swiglu(struct cuda_ctx *c, const bf16 *gu, const bf16 *x, int rows, int hidden,
                  int inter, float limit, bf16 *act);

// ---- attention.cu ----
// From the fused projection qkvg [rows, q_dim + 2 kv_dim + n_heads] (BF16): per-head
// rmsnorm of q and k (weights may be NULL), RoPE on the first rotary dims, k and v into
// the cache at slots (-1: not stored), q into q16 [rows, q_dim].
struct kcu_qkv_args {
    const bf16 *qkvg;
    int n_rows, n_heads, n_kv_heads, head_dim, ld;
    const void *q_norm, *k_norm;    // device BF16 [head_dim] or F32, or NULL
    int norm_f32;
    float eps;
    int rotary;                     // rotary dims (0: none)
    const float *inv_freq;          // device [rotary / 2]
    const int32_t *pos, *slots;     // device [n_rows]
    struct kv_layer *kv;
    bf16 *q16;
    bf16 *att;                      // or NULL: [n_rows, n_heads * head_dim] zeroed (the
                                    // attention output of rows no tile covers: graph padding)
};
int kcu_qkv_prep(struct cuda_ctx *c, const struct kcu_qkv_args *a);

// Paged attention on tensor cores (flash-decoding for decode, tiled for prefill).
struct kcu_attn_args {
    const void *q;                  // [n_tok, n_heads, head_dim]
    kdt qt;
    void *out;                      // [n_tok, n_heads, head_dim]
    kdt ot;
    const bf16 *gate;               // per (token, head) sigmoid gate, or NULL
    int gate_ld;
    int n_heads, n_kv_heads, head_dim, window;
    float scale;
    const struct kv_layer *kv;
    const int32_t *seq_start, *pos0, *tables, *boff;    // device
    const int32_t *table_shift;     // device: added to every table offset, or NULL
    const int32_t *tiles;           // device int4 [n_tiles]
    int n_tiles;                    // launch shape
    const int32_t *n_tiles_real;    // device or NULL
    int n_tok;                      // rows of out (rows of no tile are zeroed)
};
int kcu_attention(struct cuda_ctx *c, const struct kcu_attn_args *a);
// (tile, KV head) pairs of a split launch whose merge runs in flash_kernel's last split
// (cuda_ctx.d_split_done); more: flash_merge_kernel.  Splits happen below 2 blocks an SM.
#define KCU_SPLIT_DONE_CAP 4096
bool kcu_attention_ok(int n_heads, int n_kv_heads, int head_dim);
size_t kcu_attention_ws(const struct cuda_ctx *c, int n_tiles, int n_heads, int head_dim);
// host: tiles of ATTN_QT tokens for the runs [seq_start[s], seq_start[s+1]) into t[4*i]
int kcu_attention_tiles(const int32_t *seq_start, int n_seqs, int32_t *t);

// ---- backend-cuda.cu ----
// The step area's arrays for a call whose host arrays (positions, KV slots, runs, block
// table offsets and table) are all the last step_begin's with the same contents; false
// else (the caller stages them).  Pointers are fixed addresses: a graph may keep them.
struct step_arrays {
    const int32_t *pos, *slots, *seq_start, *pos0, *boff, *tables, *table_shift, *tiles,
                  *n_tiles_real, *n_real;
    int n_tiles;
};
bool cuda_step_arrays(struct cuda_ctx *c, int n_tok, int n_seqs, const int32_t *pos,
                      const int32_t *slots, const int32_t *seq_start, const int32_t *pos0,
                      const int32_t *boff, const int32_t *tables, struct step_arrays *ret);
