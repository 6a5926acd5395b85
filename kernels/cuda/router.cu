// router.cu - sigmoid router with selection-only bias (docs/MODEL.md §2.5), one thread per
// token: s = sigmoid(z); pick top_k of s + bias (ties: lower id, as the CPU oracle);
// weights = s renormalised (optional) times scale.  logits/ids/weights are device
// pointers; bias (F32 [n_exp] or NULL) is a HOST pointer, staged like the index arrays.
#include <math.h>

#include "common.cuh"
#include "cuda.h"

#define ROUTER_MAX_K 16

static __global__ void router_kernel(const float *logits, const float *bias, int n_tok, int n_exp,
                                     int top_k, int renorm, float scale, int32_t *ids, float *weights)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tok)
        return;
    const float *z = logits + (int64_t) t * n_exp;
    int32_t *id = ids + (int64_t) t * top_k;
    float *wt = weights + (int64_t) t * top_k;
    float sum = 0.0f;
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        float bestc = 0.0f;
        for (int e = 0; e < n_exp; e++) {
            bool taken = false;
            for (int j = 0; j < k && !taken; j++)
                taken = id[j] == e;
            if (taken)
                continue;
            const float c = 1.0f / (1.0f + expf(-z[e])) + (bias ? bias[e] : 0.0f);
            if (best < 0 || c > bestc) {
                best = e;
                bestc = c;
            }
        }
        id[k] = best;
        wt[k] = 1.0f / (1.0f + expf(-z[best]));
        sum += wt[k];
    }
    for (int k = 0; k < top_k; k++)
        wt[k] = (renorm ? wt[k] / sum : wt[k]) * scale;
}

int kcuda_router(struct backend *be, const float *logits, const float *bias, int n_tok, int n_exp,
                 int top_k, bool renorm, float scale, int32_t *ids, float *weights)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (top_k <= 0 || top_k > n_exp || top_k > ROUTER_MAX_K)
        return -EINVAL;
    if (n_tok == 0)
        return 0;
    const float *dbias = NULL;
    if (bias) {
        cuda_stage_reset(c);
        dbias = (const float *) cuda_stage(c, bias, sizeof(float) * n_exp);
        if (!dbias)
            return -ENOMEM;
    }
    router_kernel<<<cuda_blocks(n_tok, 128), 128, 0, c->stream>>>(logits, dbias, n_tok, n_exp, top_k,
                                                                  renorm, scale, ids, weights);
    return CUDA_LAUNCH_CHECK();
}
