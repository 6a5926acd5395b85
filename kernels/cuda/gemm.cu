// gemm.cu - the BF16 projections through cuBLASLt (QKV + gate, o_proj, dense MLP, shared
// expert, lm_head) and the FP32 router gate; the matmul op.
//
// y[m, n] = x[m, k] · W[n, k]ᵀ in row-major terms is, column-major, Dᵀ[n, m] = W[k, n]ᵀ ·
// Xᵀ[k, m]: A = W (transposed, lda = k), B = x (ldb = ldx), C = D = y (ldc = ldy); beta = 1
// adds into y (the residual stream).  One matmul descriptor, four layouts and the
// heuristic's first algorithm are kept per shape (the cache below): chosen once, then
// every call is one cublasLtMatmul on the backend's stream with the workspace of init.
// A shape the heuristic has no algorithm for (or that cublasLtMatmul rejects as not
// supported) runs on plain_gemm_kernel instead, with one warning per backend
// (step-guard.h sg_gemm_pick).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"

#define LT_WORKSPACE (32u << 20)

struct lt_entry {
    int m, n, k, ldx, ldy;
    kdt wt, yt;
    bool acc;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    bool plain;             // no cuBLASLt algorithm: plain_gemm_kernel
};

static int err_from_lt(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return 0;
    case CUBLAS_STATUS_ALLOC_FAILED: return -ENOMEM;
    case CUBLAS_STATUS_INVALID_VALUE: return -EINVAL;
    case CUBLAS_STATUS_NOT_SUPPORTED: return -ENOTSUP;
    case CUBLAS_STATUS_ARCH_MISMATCH: return -ENODEV;
    default: return -EIO;
    }
}

int kcu_lt_init(struct cuda_ctx *c)
{
    int r = err_from_lt(cublasLtCreate(&c->lt));
    if (r < 0)
        return r;
    c->lt_ws_size = LT_WORKSPACE;
    return err_from_cuda(cudaMalloc(&c->lt_ws, c->lt_ws_size));
}

static void lt_entry_free(struct lt_entry *e)
{
    if (e->op)
        cublasLtMatmulDescDestroy(e->op);
    if (e->la)
        cublasLtMatrixLayoutDestroy(e->la);
    if (e->lb)
        cublasLtMatrixLayoutDestroy(e->lb);
    if (e->lc)
        cublasLtMatrixLayoutDestroy(e->lc);
    e->op = NULL;
    e->la = e->lb = e->lc = NULL;
}

void kcu_lt_free(struct cuda_ctx *c)
{
    for (int i = 0; i < c->lt_n; i++)
        lt_entry_free(&c->lt_cache[i]);
    free(c->lt_cache);
    c->lt_cache = NULL;
    c->lt_n = c->lt_cap = 0;
    cudaFree(c->lt_ws);
    c->lt_ws = NULL;
    if (c->lt)
        cublasLtDestroy(c->lt);
    c->lt = NULL;
}

static cudaDataType_t lt_type(kdt t)
{
    return t == KDT_F32 ? CUDA_R_32F : CUDA_R_16BF;
}

struct lt_pick {
    struct cuda_ctx *c;
    struct lt_entry *e;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t res;
};

static int lt_heuristic(void *ctx, int *found)
{
    struct lt_pick *p = (struct lt_pick *) ctx;
    return err_from_lt(cublasLtMatmulAlgoGetHeuristic(p->c->lt, p->e->op, p->e->la, p->e->lb,
                                                      p->e->lc, p->e->lc, p->pref, 1, &p->res,
                                                      found));
}

static void lt_miss_warn(void *ctx)
{
    const struct lt_entry *e = ((struct lt_pick *) ctx)->e;
    fprintf(stderr, "stepd-cuda: cuBLASLt has no algorithm for a %d x %d x %d GEMM; such shapes "
            "run on a plain kernel (slower)\n", e->m, e->n, e->k);
}

static int lt_entry_make(struct cuda_ctx *c, struct lt_entry *e)
{
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    struct lt_pick pick = { c, e, NULL, {} };
    const struct sg_gemm_ops ops = { lt_heuristic, lt_miss_warn, &pick };
    int r;

    r = err_from_lt(cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    if (!r)
        r = err_from_lt(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                       sizeof(ta)));
    if (!r)
        r = err_from_lt(cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                       sizeof(tb)));
    if (!r)
        r = err_from_lt(cublasLtMatrixLayoutCreate(&e->la, lt_type(e->wt), e->k, e->n, e->k));
    if (!r)
        r = err_from_lt(cublasLtMatrixLayoutCreate(&e->lb, lt_type(e->wt), e->k, e->m, e->ldx));
    if (!r)
        r = err_from_lt(cublasLtMatrixLayoutCreate(&e->lc, lt_type(e->yt), e->n, e->m, e->ldy));
    if (!r)
        r = err_from_lt(cublasLtMatmulPreferenceCreate(&pick.pref));
    if (!r)
        r = err_from_lt(cublasLtMatmulPreferenceSetAttribute(
            pick.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &c->lt_ws_size,
            sizeof(c->lt_ws_size)));
    if (!r)
        r = sg_gemm_pick(&ops, &c->lt_warned, &e->plain);
    if (pick.pref)
        cublasLtMatmulPreferenceDestroy(pick.pref);
    if (r < 0 || e->plain) {
        lt_entry_free(e);
        return r;
    }
    e->algo = pick.res.algo;
    return 0;
}

static struct lt_entry *lt_lookup(struct cuda_ctx *c, int m, int n, int k, kdt wt, int ldx,
                                  kdt yt, int ldy, bool acc, int *ret)
{
    for (int i = 0; i < c->lt_n; i++) {
        struct lt_entry *e = &c->lt_cache[i];
        if (e->m == m && e->n == n && e->k == k && e->wt == wt && e->ldx == ldx && e->yt == yt &&
            e->ldy == ldy && e->acc == acc)
            return e;
    }
    if (c->lt_n == c->lt_cap) {
        int cap = c->lt_cap ? 2 * c->lt_cap : 64;
        struct lt_entry *p = (struct lt_entry *) realloc(c->lt_cache, cap * sizeof(*p));
        if (!p) {
            *ret = -ENOMEM;
            return NULL;
        }
        c->lt_cache = p;
        c->lt_cap = cap;
    }
    struct lt_entry *e = &c->lt_cache[c->lt_n];
    memset(e, 0, sizeof(*e));
    e->m = m;
    e->n = n;
    e->k = k;
    e->wt = wt;
    e->ldx = ldx;
    e->yt = yt;
    e->ldy = ldy;
    e->acc = acc;
    *ret = lt_entry_make(c, e);
    if (*ret < 0)
        return NULL;
    c->lt_n++;
    return e;
}

// The fallback: a warp per output element, FP32 accumulation; W [n, k] and x [m, ldx] of
// type WT (FP32 or BF16), y [m, ldy] of type YT, beta 1 adds into y.
template <typename WT>
static __device__ __forceinline__ float plain_ld(const WT *p, int64_t i);
template <>
__device__ __forceinline__ float plain_ld<float>(const float *p, int64_t i)
{
    return p[i];
}
template <>
__device__ __forceinline__ float plain_ld<bf16>(const bf16 *p, int64_t i)
{
    return __bfloat162float(p[i]);
}

static __device__ __forceinline__ void plain_st(float *p, float v)
{
    *p = v;
}
static __device__ __forceinline__ void plain_st(bf16 *p, float v)
{
    *p = __float2bfloat16_rn(v);
}

template <typename WT, typename YT>
static __global__ void plain_gemm_kernel(int m, int n, int k, const WT *w, const WT *x, int ldx,
                                         YT *y, int ldy, bool acc)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, row = blockIdx.y;
    const int lane = threadIdx.x % 32;
    if (col >= n || row >= m)
        return;
    const WT *wr = w + (int64_t) col * k, *xr = x + (int64_t) row * ldx;
    float s = 0.0f;
    for (int i = lane; i < k; i += 32)
        s += plain_ld<WT>(wr, i) * plain_ld<WT>(xr, i);
    s = warp_sum(s);
    if (lane == 0) {
        YT *yp = y + (int64_t) row * ldy + col;
        if (acc)
            s += plain_ld<YT>(yp, 0);
        plain_st(yp, s);
    }
}

static int plain_gemm(struct cuda_ctx *c, int m, int n, int k, const void *w, kdt wt,
                      const void *x, int ldx, void *y, kdt yt, int ldy, bool acc)
{
    const dim3 grid((unsigned) ((n + 7) / 8), (unsigned) m);
    if (wt == KDT_F32 && yt == KDT_F32)
        cuda_launch(c, plain_gemm_kernel<float, float>, grid, 256, 0, m, n, k, (const float *) w,
                    (const float *) x, ldx, (float *) y, ldy, acc);
    else if (wt == KDT_F32)
        cuda_launch(c, plain_gemm_kernel<float, bf16>, grid, 256, 0, m, n, k, (const float *) w,
                    (const float *) x, ldx, (bf16 *) y, ldy, acc);
    else if (yt == KDT_F32)
        cuda_launch(c, plain_gemm_kernel<bf16, float>, grid, 256, 0, m, n, k, (const bf16 *) w,
                    (const bf16 *) x, ldx, (float *) y, ldy, acc);
    else
        cuda_launch(c, plain_gemm_kernel<bf16, bf16>, grid, 256, 0, m, n, k, (const bf16 *) w,
                    (const bf16 *) x, ldx, (bf16 *) y, ldy, acc);
    return CUDA_LAUNCH_CHECK();
}

int kcu_gemm(struct cuda_ctx *c, int m, int n, int k, const void *w, kdt wt, const void *x,
             int ldx, void *y, kdt yt, int ldy, bool acc)
{
    const float alpha = 1.0f, beta = acc ? 1.0f : 0.0f;
    int r = 0;

    if (m == 0 || n == 0)
        return 0;
    struct lt_entry *e = lt_lookup(c, m, n, k, wt, ldx, yt, ldy, acc, &r);
    if (!e)
        return r;
    if (!e->plain) {
        r = err_from_lt(cublasLtMatmul(c->lt, e->op, &alpha, w, e->la, x, e->lb, &beta, y,
                                       e->lc, y, e->lc, &e->algo, c->lt_ws, c->lt_ws_size,
                                       c->stream));
        if (r != -ENOTSUP)
            return r;
        // the algorithm the heuristic chose is refused at run time: a miss as well
        if (!c->lt_warned) {
            struct lt_pick pick = { c, e, NULL, {} };
            c->lt_warned = true;
            lt_miss_warn(&pick);
        }
        lt_entry_free(e);
        e->plain = true;
    }
    return plain_gemm(c, m, n, k, w, wt, x, ldx, y, yt, ldy, acc);
}

static __global__ void to_bf16_kernel(const float *x, bf16 *y, size_t n)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const size_t i = ((size_t) blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (i + 1 < n) {
        const float2 v = *(const float2 *) (x + i);
        *(__nv_bfloat162 *) (y + i) = __floats2bfloat162_rn(v.x, v.y);
    } else if (i < n) {
        y[i] = __float2bfloat16_rn(x[i]);
    }
}

int kcu_to_bf16(struct cuda_ctx *c, const float *x, bf16 *y, size_t n)
{
    if (n == 0)
        return 0;
    cuda_launch(c, to_bf16_kernel, cuda_blocks((n + 1) / 2, 256), 256, 0, x, y, n);
    return CUDA_LAUNCH_CHECK();
}

// ---- the op: y[n, rows] = x[n, cols] · Wᵀ, FP32 activations at the interface ----

int kcuda_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const struct cuda_weight *cw = (const struct cuda_weight *) w->priv;

    if (!cw || !cw->data)
        return -EINVAL;
    if (n == 0)
        return 0;
    if (lowp_fmt(w->fmt))
        return kcu_lowp_matmul(c, w, x, n, y);
    if (c->exact)
        return kcuda_matmul_exact(be, w, x, n, y);
    n = cuda_rows(c, n);
    switch (w->fmt) {
    case WFMT_F32:
        return kcu_gemm(c, n, (int) w->rows, (int) w->cols, cw->data, KDT_F32, x, (int) w->cols,
                        y, KDT_F32, (int) w->rows, false);
    case WFMT_BF16: {
        int r = cuda_ws_ensure(c, (size_t) n * w->cols * sizeof(bf16));
        if (r < 0)
            return r;
        cuda_ws_reset(c);
        bf16 *xb = (bf16 *) cuda_ws_take(c, (size_t) n * w->cols * sizeof(bf16));
        if (!xb)
            return -ENOMEM;
        r = kcu_to_bf16(c, x, xb, (size_t) n * w->cols);
        if (r < 0)
            return r;
        return kcu_gemm(c, n, (int) w->rows, (int) w->cols, cw->data, KDT_BF16, xb, (int) w->cols,
                        y, KDT_F32, (int) w->rows, false);
    }
    case WFMT_MXFP4:
        return kcu_mx4_dense(c, cw, (int) w->rows, (int) w->cols, n, x, KDT_F32, y, KDT_F32);
    default:
        return -EINVAL;
    }
}
