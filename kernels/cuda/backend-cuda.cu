// backend-cuda.cu - the CUDA backend instance: lifecycle, memory, weights, ops table.
//
// Built as the plugin libstepd-cuda.so and opened by kernels/backend.c with dlopen(), so
// CPU-only machines never need CUDA libraries.  The plugin links the CUDA runtime
// statically; only the driver (libcuda.so) must exist where it is loaded.  With no
// usable device, init returns -ENODEV (cudaGetDeviceCount fails with
// cudaErrorInsufficientDriver = 35 on a machine without a driver).
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cuda.h"

int err_from_cuda(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return 0;
    case cudaErrorMemoryAllocation:
        return -ENOMEM;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
        return -EINVAL;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
        return -ENODEV;
    case cudaErrorNotSupported:
        return -ENOTSUP;
    default:
        return -EIO;    // sticky errors (illegal address, ECC): the worker exits and restarts
    }
}

void cuda_stage_reset(struct cuda_ctx *c)
{
    c->stage_used = 0;
}

void *cuda_stage(struct cuda_ctx *c, const void *host, size_t n)
{
    size_t off = (c->stage_used + 255) & ~(size_t) 255;
    if (off + n > c->stage_size) {
        // grow: wait for queued kernels that may still read the old area
        size_t sz = c->stage_size ? c->stage_size : (1u << 20);
        while (sz < off + n)
            sz *= 2;
        if (cudaStreamSynchronize(c->stream) != cudaSuccess)
            return NULL;
        char *p = NULL;
        if (cudaMalloc(&p, sz) != cudaSuccess)
            return NULL;
        cudaFree(c->stage);
        c->stage = p;
        c->stage_size = sz;
        off = 0;
        c->stage_used = 0;
    }
    if (cudaMemcpyAsync(c->stage + off, host, n, cudaMemcpyHostToDevice, c->stream) != cudaSuccess)
        return NULL;
    c->stage_used = off + n;
    return c->stage + off;
}

static int cuda_init(struct backend *be, const struct backend_cfg *cfg)
{
    int n = 0, r;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        (void) cudaGetLastError();
        return -ENODEV;
    }
    if (cfg->device < 0 || cfg->device >= n)
        return -ENODEV;
    struct cuda_ctx *c = (struct cuda_ctx *) calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->device = cfg->device;
    r = err_from_cuda(cudaSetDevice(c->device));
    if (r == 0)
        r = err_from_cuda(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    if (r < 0) {
        free(c);
        return r;
    }
    be->ctx = c;
    be->device = c->device;
    return 0;
}

static void cuda_free_ctx(struct backend *be)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (!c)
        return;
    cudaStreamSynchronize(c->stream);
    cudaFree(c->stage);
    cudaFree(c->moe_ptrs);
    cudaFree(c->moe_act);
    cudaStreamDestroy(c->stream);
    free(c);
    be->ctx = NULL;
}

static int cuda_buf_alloc(struct backend *be, size_t bytes, size_t align, void **ret)
{
    void *p = NULL;
    (void) align;   // cudaMalloc returns 256-byte aligned memory
    int r = err_from_cuda(cudaMalloc(&p, bytes ? bytes : 1));
    if (r < 0)
        return r;
    *ret = p;
    return 0;
}

static void cuda_buf_free(struct backend *be, void *p)
{
    if (p)
        cudaFree(p);
}

static int cuda_upload(struct backend *be, void *dst, const void *src, size_t n)
{
    return err_from_cuda(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, cuda_ctx_of(be)->stream));
}

static int cuda_download(struct backend *be, void *dst, const void *src, size_t n)
{
    return err_from_cuda(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, cuda_ctx_of(be)->stream));
}

static int cuda_sync(struct backend *be)
{
    return err_from_cuda(cudaStreamSynchronize(cuda_ctx_of(be)->stream));
}

static bool cuda_supports(struct backend *be, const char *op, enum wfmt fmt)
{
    static const char *const ops[] = {
        "embed", "rmsnorm", "matmul", "rope", "kv_store", "attention", "head_gate",
        "swiglu", "router", "moe", "add",
    };
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
        if (strcmp(op, ops[i]) == 0)
            return strcmp(op, "rmsnorm") != 0 || fmt != WFMT_MXFP4;
    return false;
}

static size_t weight_data_bytes(const struct bweight *w)
{
    switch (w->fmt) {
    case WFMT_F32: return (size_t) w->rows * w->cols * 4;
    case WFMT_BF16: return (size_t) w->rows * w->cols * 2;
    case WFMT_MXFP4: return (size_t) w->rows * w->cols / 2;
    default: return 0;
    }
}

static void cuda_weight_release(struct backend *be, struct bweight *w)
{
    struct cuda_weight *cw = (struct cuda_weight *) w->priv;
    if (!cw)
        return;
    cudaFree(cw->data);
    cudaFree(cw->scale);
    free(cw);
    w->priv = NULL;
}

static int cuda_weight_prepare(struct backend *be, struct bweight *w)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    size_t nd = weight_data_bytes(w), ns = 0;
    int r;

    if (w->priv)
        return 0;
    if (nd == 0 || (w->fmt == WFMT_MXFP4 && (w->cols % 32 != 0 || !w->scale)))
        return -EINVAL;
    if (w->fmt == WFMT_MXFP4) {
        ns = (size_t) w->rows * (w->cols / 32);
        for (size_t i = 0; i < ns; i++)
            if (w->scale[i] == 0xFF)
                return -EINVAL;     // E8M0 NaN: corrupt file
    }
    struct cuda_weight *cw = (struct cuda_weight *) calloc(1, sizeof(*cw));
    if (!cw)
        return -ENOMEM;
    w->priv = cw;
    r = err_from_cuda(cudaMalloc(&cw->data, nd));
    if (r == 0)
        r = err_from_cuda(cudaMemcpyAsync(cw->data, w->data, nd, cudaMemcpyHostToDevice, c->stream));
    if (r == 0 && ns) {
        r = err_from_cuda(cudaMalloc((void **) &cw->scale, ns));
        if (r == 0)
            r = err_from_cuda(cudaMemcpyAsync(cw->scale, w->scale, ns, cudaMemcpyHostToDevice, c->stream));
    }
    if (r == 0)
        r = err_from_cuda(cudaStreamSynchronize(c->stream));
    if (r < 0)
        cuda_weight_release(be, w);
    return r;
}

static const struct backend_ops backend_cuda_ops = {
    .name = "cuda",
    .init = cuda_init,
    .free = cuda_free_ctx,
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .sync = cuda_sync,
    .supports = cuda_supports,
    .weight_prepare = cuda_weight_prepare,
    .weight_release = cuda_weight_release,
    .embed = kcuda_embed,
    .rmsnorm = kcuda_rmsnorm,
    .matmul = kcuda_matmul,
    .rope = kcuda_rope,
    .kv_store = kcuda_kv_store,
    .attention = kcuda_attention,
    .head_gate = kcuda_head_gate,
    .swiglu = kcuda_swiglu,
    .router = kcuda_router,
    .moe = kcuda_moe,
    .add = kcuda_add,
    .graph_begin = NULL,
    .graph_end = NULL,
};

extern "C" __attribute__((visibility("default"))) const struct backend_ops *stepd_backend_cuda_ops(void)
{
    return &backend_cuda_ops;
}
