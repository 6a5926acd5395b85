// router.cu - the MoE router (docs/MODEL.md §2.5) in one parallel kernel: one warp per token
// (router_kernel, from the logits), or a block per token with the router GEMV in front
// (router_gemv_kernel, from the normed activations: decode).
// s = sigmoid(z); the top_k of s + bias are chosen by top_k rounds of a warp arg-max
// (ties: the lower expert id, as the CPU oracle); weights are s of the chosen experts,
// renormalised (optional) and scaled.  ids/weights [n_tok, top_k] in selection order.
// Rows at or past *n_real (graph padding) get ids -1 and weights 0.
#include <math.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"

#define ROUTER_MAX_K 16
#define ROUTER_MAX_PER_LANE 32      // experts per lane: n_exp <= 1024

// The selection of one token's row z (global or shared) by one warp: ids/weights of its
// top_k in selection order.
static __device__ void router_select(const float *z, const float *bias, int n_exp, int top_k,
                                     int renorm, float scale, int lane, int32_t *id, float *wt)
{
    float cand[ROUTER_MAX_PER_LANE];
    uint32_t taken = 0;
    const int per = (n_exp + 31) / 32;
#pragma unroll
    for (int i = 0; i < ROUTER_MAX_PER_LANE; i++) {
        const int e = lane + 32 * i;
        cand[i] = -INFINITY;
        if (i < per && e < n_exp) {
            const float zz = z[e];
            cand[i] = isnan(zz) ? -INFINITY : sigmoidf_(zz) + (bias ? bias[e] : 0.0f);
        }
    }
    float sum = 0.0f, my_w = 0.0f;
    int my_id = -1;
    for (int k = 0; k < top_k; k++) {
        // this lane's best untaken candidate (lowest index on ties: i ascending)
        float best = -INFINITY;
        int bi = -1;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX_PER_LANE; i++) {
            if (i < per && !(taken >> i & 1) && lane + 32 * i < n_exp && (bi < 0 || cand[i] > best)) {
                best = cand[i];
                bi = i;
            }
        }
        int be = bi < 0 ? 0x7fffffff : lane + 32 * bi;
        // warp arg-max: larger value, then lower expert id
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ov > best || (ov == best && oe < be)) {
                best = ov;
                be = oe;
            }
        }
        if (be % 32 == lane)
            taken |= 1u << (be / 32);
        const float s = sigmoidf_(z[be]);
        sum += s;
        if (lane == k) {
            my_id = be;
            my_w = s;
        }
    }
    if (lane < top_k) {
        id[lane] = my_id;
        wt[lane] = (renorm ? my_w / sum : my_w) * scale;
    }
}

static __device__ void router_pad(int top_k, int lane, int32_t *id, float *wt)
{
    for (int k = lane; k < top_k; k += 32) {
        id[k] = -1;
        wt[k] = 0.0f;
    }
}

static __global__ void router_kernel(const float *logits, const float *bias, int n_rows,
                                     const int32_t *n_real, int n_exp, int top_k, int renorm,
                                     float scale, int32_t *ids, float *weights)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int t = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= n_rows)
        return;
    int32_t *id = ids + (int64_t) t * top_k;
    float *wt = weights + (int64_t) t * top_k;
    if (n_real && t >= *n_real) {
        router_pad(top_k, lane, id, wt);
        return;
    }
    router_select(logits + (int64_t) t * n_exp, bias, n_exp, top_k, renorm, scale, lane, id, wt);
}

// z[e] = x · w[e] for e = warp, warp + warps, ...: FP32, lanes over the hidden dim
static __device__ void router_logits(const float *xr, const float *w, int hidden, int n_exp,
                                     int warp, int warps, int lane, float *z)
{
    const bool vec = (hidden & 3) == 0;
    for (int e = warp; e < n_exp; e += warps) {
        const float *wr = w + (int64_t) e * hidden;
        float acc = 0.0f;
        if (vec) {
            for (int i = 4 * lane; i < hidden; i += 128) {
                const float4 a = *(const float4 *) (xr + i), b = *(const float4 *) (wr + i);
                acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        } else {
            for (int i = lane; i < hidden; i += 32)
                acc += xr[i] * wr[i];
        }
        acc = warp_sum(acc);
        if (lane == 0)
            z[e] = acc;
    }
}

// The router's GEMV and the selection in one kernel (decode: one node instead of a GEMM
// and the router): a block per token, its warps compute the logits z[e] = x[t] · w[e]
// (FP32, lanes over the hidden dim, 4 columns a load when aligned) into shared memory,
// then warp 0 selects from there.  With a plan (plan.n_slots > 0, MOE_PLAN_THREADS
// threads): the last block to finish (a counter in device memory, reset by that block for
// the next launch or graph replay) builds the MoE plan of all rows' ids (moe-plan.h), in
// place of moe_plan_kernel.
// (launch bounds: 1024 threads with the plan, so at most 64 registers a thread)
static __global__ void __launch_bounds__(MOE_PLAN_THREADS)
router_gemv_kernel(const float *x, const float *w, int hidden, const float *bias,
                   const int32_t *n_real, int n_exp, int top_k, int renorm, float scale,
                   int32_t *ids, float *weights, struct moe_plan_args plan, int32_t *done)
{
    PDL_WAIT();
    extern __shared__ float router_z[];     // [n_exp], then the plan's shared state
    __shared__ int last[1];
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int32_t *id = ids + (int64_t) t * top_k;
    float *wt = weights + (int64_t) t * top_k;
    if (n_real && t >= *n_real) {           // the whole block takes the same branch
        if (warp == 0)
            router_pad(top_k, lane, id, wt);
    } else {
        router_logits(x + (int64_t) t * hidden, w, hidden, n_exp, warp, warps, lane, router_z);
        __syncthreads();
        if (warp == 0)
            router_select(router_z, bias, n_exp, top_k, renorm, scale, lane, id, wt);
    }
    PDL_TRIGGER();
    if (plan.n_slots == 0)
        return;
    // this block's ids are written: the last block (all ids visible) builds the plan
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last[0] = atomicAdd(done, 1) == (int) gridDim.x - 1;
    }
    __syncthreads();
    if (!last[0])
        return;
    __threadfence();
    kcu_moe_plan_block(&plan, (int32_t *) router_z);
    if (threadIdx.x == 0)
        *done = 0;
}

static bool router_shape_ok(int n_exp, int top_k)
{
    return top_k > 0 && top_k <= n_exp && top_k <= ROUTER_MAX_K &&
           n_exp <= 32 * ROUTER_MAX_PER_LANE;
}

int kcu_router_gemv(struct cuda_ctx *c, const float *x, const float *w, int hidden,
                    const float *bias, int n_rows, const int32_t *n_real, int n_exp, int top_k,
                    bool renorm, float scale, int32_t *ids, float *wts,
                    const struct moe_plan_args *plan)
{
    if (!router_shape_ok(n_exp, top_k) || hidden <= 0)
        return -EINVAL;
    if (n_rows == 0)
        return 0;
    struct moe_plan_args pa = {};
    size_t smem = sizeof(float) * n_exp;
    int threads = 256;
    if (plan && plan->n_slots > 0) {
        pa = *plan;
        threads = MOE_PLAN_THREADS;
        if (kcu_moe_plan_smem(pa.n_local) > smem)
            smem = kcu_moe_plan_smem(pa.n_local);
        if (smem > 48 * 1024)
            return -E2BIG;          // the plan kernel's path (kcu_moe) takes it
    }
    cuda_launch(c, router_gemv_kernel, n_rows, threads, smem, x, w, hidden, bias, n_real, n_exp,
                top_k, renorm, scale, ids, wts, pa, c->d_done);
    return CUDA_LAUNCH_CHECK();
}

int kcu_router(struct cuda_ctx *c, const float *logits, const float *bias, int n_rows,
               const int32_t *n_real, int n_exp, int top_k, bool renorm, float scale,
               int32_t *ids, float *w)
{
    if (!router_shape_ok(n_exp, top_k))
        return -EINVAL;
    if (n_rows == 0)
        return 0;
    const int warps = 4;
    cuda_launch(c, router_kernel, cuda_blocks((size_t) n_rows, warps), warps * 32, 0, logits, bias,
                n_rows, n_real, n_exp, top_k, renorm, scale, ids, w);
    return CUDA_LAUNCH_CHECK();
}

int kcuda_router(struct backend *be, const float *logits, const float *bias, int n_tok, int n_exp,
                 int top_k, bool renorm, float scale, int32_t *ids, float *weights)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const float *dbias = NULL;

    if (n_tok == 0)
        return 0;
    if (bias) {
        cuda_stage_reset(c);
        dbias = (const float *) cuda_stage(c, bias, sizeof(float) * n_exp);
        if (!dbias)
            return -ENOMEM;
    }
    return kcu_router(c, logits, dbias, n_tok, NULL, n_exp, top_k, renorm, scale, ids, weights);
}
