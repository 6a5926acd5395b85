// moe.cu - routed experts of one MoE layer for the experts local to this rank.
// Phase 1: act[t, k, j] = swiglu(gate_e[j]·x_t, up_e[j]·x_t) for every selected local
// expert e = ids[t, k] (one warp per (t, k, j)); phase 2: out[t, o] += sum_k w[t, k] *
// down_e[o]·act[t, k] (one warp per (t, o)).  Non-local selections contribute nothing
// (their rank adds them in the all-reduce).  ids/weights are device (router outputs).
#include "common.cuh"
#include "cuda.h"

// per local expert: 6 pointers (gate data, gate scale, up data, up scale, down data, down scale)
#define MOE_PTRS 6

static inline __device__ float row_dot(int fmt, const void *w, const uint8_t *sc, int64_t cols,
                                       int64_t o, const float *x, int lane)
{
    float acc = 0.0f;
    for (int64_t i = lane; i < cols; i += 32)
        acc += weight_at(fmt, w, sc, cols, o, i) * x[i];
    return warp_sum(acc);
}

static __global__ void moe_up_kernel(const float *x, int n_tok, int hidden, int inter, int top_k,
                                     const int32_t *ids, int first, int n_local, void *const *ptrs,
                                     int fmt_gate, int fmt_up, float limit, float *act)
{
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (int64_t) n_tok * top_k * inter)
        return;
    const int j = (int) (warp % inter);
    const int64_t tk = warp / inter;
    const int t = (int) (tk / top_k);
    const int e = ids[tk] - first;
    if (e < 0 || e >= n_local) {
        if (lane == 0)
            act[warp] = 0.0f;
        return;
    }
    void *const *p = ptrs + (int64_t) e * MOE_PTRS;
    const float *xt = x + (int64_t) t * hidden;
    float u = row_dot(fmt_gate, p[0], (const uint8_t *) p[1], hidden, j, xt, lane);
    float w = row_dot(fmt_up, p[2], (const uint8_t *) p[3], hidden, j, xt, lane);
    if (lane == 0) {
        float s = u / (1.0f + expf(-u));
        if (limit > 0.0f) {
            s = fminf(s, limit);
            w = fminf(fmaxf(w, -limit), limit);
        }
        act[warp] = s * w;
    }
}

static __global__ void moe_down_kernel(float *out, int n_tok, int hidden, int inter, int top_k,
                                       const int32_t *ids, const float *weights, int first,
                                       int n_local, void *const *ptrs, int fmt_down, const float *act)
{
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= (int64_t) n_tok * hidden)
        return;
    const int t = (int) (warp / hidden), o = (int) (warp % hidden);
    float sum = 0.0f;
    for (int k = 0; k < top_k; k++) {
        const int e = ids[(int64_t) t * top_k + k] - first;
        if (e < 0 || e >= n_local)
            continue;
        void *const *p = ptrs + (int64_t) e * MOE_PTRS;
        const float d = row_dot(fmt_down, p[4], (const uint8_t *) p[5], inter, o,
                                act + ((int64_t) t * top_k + k) * inter, lane);
        sum += weights[(int64_t) t * top_k + k] * d;
    }
    if (lane == 0)
        out[warp] += sum;
}

static int moe_tables(struct cuda_ctx *c, const struct moe_args *a)
{
    if (c->moe_cached == a->experts && c->moe_cached_n == a->n_local && c->moe_ptrs)
        return 0;
    void **h = (void **) calloc((size_t) a->n_local * MOE_PTRS, sizeof(void *));
    if (!h)
        return -ENOMEM;
    int r = 0;
    for (int e = 0; e < a->n_local && r == 0; e++) {
        const struct bweight *w[3] = { &a->experts[e].gate, &a->experts[e].up, &a->experts[e].down };
        for (int m = 0; m < 3 && r == 0; m++) {
            const void *d;
            const uint8_t *s;
            r = cuda_weight_dev(w[m], &d, &s);
            h[e * MOE_PTRS + 2 * m] = (void *) d;
            h[e * MOE_PTRS + 2 * m + 1] = (void *) s;
        }
    }
    if (r == 0) {
        cudaFree(c->moe_ptrs);
        c->moe_ptrs = NULL;
        r = err_from_cuda(cudaMalloc((void **) &c->moe_ptrs, sizeof(void *) * a->n_local * MOE_PTRS));
    }
    if (r == 0)
        r = err_from_cuda(cudaMemcpy(c->moe_ptrs, h, sizeof(void *) * a->n_local * MOE_PTRS,
                                     cudaMemcpyHostToDevice));
    free(h);
    if (r == 0) {
        c->moe_cached = a->experts;
        c->moe_cached_n = a->n_local;
    }
    return r;
}

int kcuda_moe(struct backend *be, const struct moe_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (a->n_tok == 0 || a->n_local == 0)
        return 0;
    // all local experts share one format per projection (the loader guarantees it)
    const int fg = a->experts[0].gate.fmt, fu = a->experts[0].up.fmt, fd = a->experts[0].down.fmt;
    int r = moe_tables(c, a);
    if (r < 0)
        return r;
    const size_t need = (size_t) a->n_tok * a->top_k * a->inter * sizeof(float);
    if (need > c->moe_act_size) {
        r = err_from_cuda(cudaStreamSynchronize(c->stream));
        if (r < 0)
            return r;
        cudaFree(c->moe_act);
        c->moe_act = NULL;
        c->moe_act_size = 0;
        r = err_from_cuda(cudaMalloc((void **) &c->moe_act, need));
        if (r < 0)
            return r;
        c->moe_act_size = need;
    }
    const size_t w1 = (size_t) a->n_tok * a->top_k * a->inter * 32;
    moe_up_kernel<<<cuda_blocks(w1, 256), 256, 0, c->stream>>>(a->x, a->n_tok, a->hidden, a->inter,
        a->top_k, a->ids, a->expert_first, a->n_local, c->moe_ptrs, fg, fu, a->limit, c->moe_act);
    r = CUDA_LAUNCH_CHECK();
    if (r < 0)
        return r;
    const size_t w2 = (size_t) a->n_tok * a->hidden * 32;
    moe_down_kernel<<<cuda_blocks(w2, 256), 256, 0, c->stream>>>(a->out, a->n_tok, a->hidden, a->inter,
        a->top_k, a->ids, a->weights, a->expert_first, a->n_local, c->moe_ptrs, fd, c->moe_act);
    return CUDA_LAUNCH_CHECK();
}
