// router.cu - the MoE router (docs/MODEL.md §2.5) in one parallel kernel: one warp per token.
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

static __global__ void router_kernel(const float *logits, const float *bias, int n_rows,
                                     const int32_t *n_real, int n_exp, int top_k, int renorm,
                                     float scale, int32_t *ids, float *weights)
{
    const int t = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= n_rows)
        return;
    int32_t *id = ids + (int64_t) t * top_k;
    float *wt = weights + (int64_t) t * top_k;
    if (n_real && t >= *n_real) {
        for (int k = lane; k < top_k; k += 32) {
            id[k] = -1;
            wt[k] = 0.0f;
        }
        return;
    }
    const float *z = logits + (int64_t) t * n_exp;
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

int kcu_router(struct cuda_ctx *c, const float *logits, const float *bias, int n_rows,
               const int32_t *n_real, int n_exp, int top_k, bool renorm, float scale,
               int32_t *ids, float *w)
{
    if (top_k <= 0 || top_k > n_exp || top_k > ROUTER_MAX_K || n_exp > 32 * ROUTER_MAX_PER_LANE)
        return -EINVAL;
    if (n_rows == 0)
        return 0;
    const int warps = 4;
    router_kernel<<<cuda_blocks((size_t) n_rows, warps), warps * 32, 0, c->stream>>>(
        logits, bias, n_rows, n_real, n_exp, top_k, renorm, scale, ids, w);
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
