// backend-cuda.cu - the CUDA backend instance: lifecycle, memory plan, weights, the step
// area, graphs, ops table (docs/GPU.md).
//
// Built as the plugin libstepd-cuda.so and opened by kernels/backend.c with dlopen(), so
// CPU-only machines never need CUDA libraries.  The plugin links the CUDA runtime
// statically and cuBLASLt dynamically (rpath to the toolkit it was built with); NCCL is
// opened only when a multi-GPU group asks for it (comm-nccl.c).  With no usable device,
// init returns -ENODEV (cudaGetDeviceCount fails with cudaErrorInsufficientDriver = 35 on
// a machine without a driver).
//
// Invariant: after reserve() no op allocates device memory, and nothing a step does waits
// on the host except the caller's sync (and download of results): index arrays arrive in
// one transfer (step_begin), everything else stays on the device.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"
#include "mx4.h"

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

static void warn(const char *what, cudaError_t e)
{
    fprintf(stderr, "stepd-cuda: %s: %s\n", what, cudaGetErrorString(e));
}

// ---- the calling thread's device ----

static int dev_get(int *dev)
{
    return err_from_cuda(cudaGetDevice(dev));
}

static int dev_set(int dev)
{
    return err_from_cuda(cudaSetDevice(dev));
}

static const struct sg_dev_ops dev_ops = { dev_get, dev_set };

void cuda_use_device(const struct cuda_ctx *c)
{
    // a failure here fails the op's first CUDA call, which reports it
    (void) sg_use_device(&dev_ops, c->device);
}

// The workspace or step area moved: every graph captured so far reads the old addresses.
static void mem_moved(struct cuda_ctx *c)
{
    c->mem_epoch++;
}

// ---- staging and workspace ----

void cuda_stage_reset(struct cuda_ctx *c)
{
    c->stage_used = 0;
}

void *cuda_stage(struct cuda_ctx *c, const void *host, size_t n)
{
    size_t off = (c->stage_used + 255) & ~(size_t) 255;
    if (c->capturing)
        return NULL;        // a graph may only read the step area
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

void cuda_ws_reset(struct cuda_ctx *c)
{
    c->ws_used = 0;
}

int cuda_ws_ensure(struct cuda_ctx *c, size_t bytes)
{
    bytes += 4096;          // alignment of the pieces
    if (bytes <= c->ws_size)
        return 0;
    // only without a plan (single ops in tests) or for a shape the plan did not foresee
    if (c->capturing)
        return -ENOMEM;
    if (c->reserved)
        fprintf(stderr, "stepd-cuda: workspace of %zu bytes grows to %zu (not planned)\n",
                c->ws_size, bytes);
    return cuda_ws_plan(c, bytes);
}

int cuda_ws_plan(struct cuda_ctx *c, size_t bytes)
{
    const size_t old = c->ws_size;
    if (bytes <= c->ws_size)
        return 0;
    int r = err_from_cuda(cudaStreamSynchronize(c->stream));
    if (r < 0)
        return r;
    cudaFree(c->ws);
    c->ws = NULL;
    c->ws_size = 0;
    mem_moved(c);
    r = err_from_cuda(cudaMalloc((void **) &c->ws, bytes));
    if (r == 0) {
        c->ws_size = bytes;
        return 0;
    }
    (void) cudaGetLastError();
    c->ws = NULL;
    if (old && cudaMalloc((void **) &c->ws, old) == cudaSuccess)
        c->ws_size = old;   // the plan that was keeps working
    else
        (void) cudaGetLastError();
    return r;
}

void *cuda_ws_take(struct cuda_ctx *c, size_t bytes)
{
    const size_t off = (c->ws_used + 255) & ~(size_t) 255;
    if (off + bytes > c->ws_size)
        return NULL;
    c->ws_used = off + bytes;
    return c->ws + off;
}

// ---- the step area ----

// Layout (int32 offsets), capacities from reserve: hdr | ids[T] pos[T] slots[G][T] |
// seq_start[S+1] pos0[S] boff[G][S] | tiles[4 * tile_cap] | tables (group 0, then 1)
static size_t step_fixed_ints(const struct cuda_ctx *c)
{
    return STEP_HDR + (size_t) c->t_cap * (2 + BACKEND_KV_GROUPS) +
           (size_t) c->s_cap * (2 + BACKEND_KV_GROUPS) + 1 + 4 * (size_t) c->tile_cap;
}

static void step_views(struct cuda_ctx *c, int32_t *base, struct step_dev *v)
{
    int32_t *p = base;
    v->hdr = p; p += STEP_HDR;
    v->ids = p; p += c->t_cap;
    v->pos = p; p += c->t_cap;
    for (int g = 0; g < BACKEND_KV_GROUPS; g++) {
        v->slots[g] = p;
        p += c->t_cap;
    }
    v->seq_start = p; p += c->s_cap + 1;
    v->pos0 = p; p += c->s_cap;
    for (int g = 0; g < BACKEND_KV_GROUPS; g++) {
        v->boff[g] = p;
        p += c->s_cap;
    }
    v->tok_seq = NULL;
    v->tiles = p; p += 4 * c->tile_cap;
    v->tables[0] = p;
    v->tables[1] = p;       // + hdr[4] on the device (group 1 follows group 0)
}

static int step_area_alloc(struct cuda_ctx *c, int t_cap, int s_cap, int table_cap)
{
    c->t_cap = t_cap;
    c->s_cap = s_cap;
    c->tile_cap = t_cap + s_cap;
    c->table_cap = table_cap;
    c->step_ints = step_fixed_ints(c) + (size_t) BACKEND_KV_GROUPS * table_cap;
    CU_TRY(cudaMalloc((void **) &c->d_step, c->step_ints * sizeof(int32_t)));
    for (int i = 0; i < 2; i++) {
        CU_TRY(cudaHostAlloc((void **) &c->h_step[i], c->step_ints * sizeof(int32_t),
                             cudaHostAllocDefault));
        CU_TRY(cudaEventCreateWithFlags(&c->h_ev[i], cudaEventDisableTiming));
    }
    step_views(c, c->d_step, &c->sd);
    return 0;
}

static void step_area_free(struct cuda_ctx *c)
{
    cudaFree(c->d_step);
    c->d_step = NULL;
    for (int i = 0; i < 2; i++) {
        if (c->h_step[i])
            cudaFreeHost(c->h_step[i]);
        if (c->h_ev[i])
            cudaEventDestroy(c->h_ev[i]);
        c->h_step[i] = NULL;
        c->h_ev[i] = NULL;
    }
}

// host copy of the last step's arrays (the pinned buffer that was sent)
static const int32_t *step_host(struct cuda_ctx *c)
{
    return c->h_step[c->h_cur ^ 1];
}

static bool same(const int32_t *host, const int32_t *reg, const int32_t *copy, size_t n,
                 size_t have)
{
    return host == reg && n <= have && memcmp(host, copy, n * sizeof(int32_t)) == 0;
}

// The step area's copy of host array `host` (n int32), NULL when it is not the last
// step_begin's array with these contents.  *group: which KV group's slots/boff/table.
static const int32_t *step_find(struct cuda_ctx *c, const int32_t *host, size_t n, int *group)
{
    *group = 0;
    if (c->map.valid && host) {
        const struct step_map *m = &c->map;
        const int32_t *h = step_host(c);
        struct step_dev hv;
        step_views(c, (int32_t *) h, &hv);
        const size_t T = (size_t) m->n_rows, S = (size_t) m->n_seqs;
        // n may cover padded rows (a graph); the padding is ours, the real part must match
        const size_t nt = n < (size_t) m->n_tok ? n : (size_t) m->n_tok;
        if (n <= T && same(host, m->ids, hv.ids, nt, m->n_tok))
            return c->sd.ids;
        if (n <= T && same(host, m->pos, hv.pos, nt, m->n_tok))
            return c->sd.pos;
        for (int g = 0; g < BACKEND_KV_GROUPS; g++)
            if (n <= T && same(host, m->slots[g], hv.slots[g], nt, m->n_tok)) {
                *group = g;
                return c->sd.slots[g];
            }
        if (same(host, m->seq_start, hv.seq_start, n, S + 1))
            return c->sd.seq_start;
        if (same(host, m->seq_pos0, hv.pos0, n, S))
            return c->sd.pos0;
        for (int g = 0; g < BACKEND_KV_GROUPS; g++) {
            *group = g;
            if (same(host, m->boff[g], hv.boff[g], n, S))
                return c->sd.boff[g];
            // tables: the plan's, constant for the step; group 1 follows group 0
            if (host == m->tables[g] && n <= (size_t) m->n_table[g])
                return c->sd.tables[0] + (g ? m->n_table[0] : 0);
        }
    }
    return NULL;
}

const int32_t *cuda_index(struct cuda_ctx *c, const int32_t *host, size_t n)
{
    int g;
    const int32_t *d = step_find(c, host, n, &g);
    return d ? d : (const int32_t *) cuda_stage(c, host, n * sizeof(int32_t));
}

bool cuda_step_arrays(struct cuda_ctx *c, int n_tok, int n_seqs, const int32_t *pos,
                      const int32_t *slots, const int32_t *seq_start, const int32_t *pos0,
                      const int32_t *boff, const int32_t *tables, struct step_arrays *ret)
{
    int g, gs, gb, gt;
    if (!c->map.valid || n_tok != c->map.n_tok || n_seqs != c->map.n_seqs)
        return false;
    ret->pos = step_find(c, pos, n_tok, &g);
    ret->slots = step_find(c, slots, n_tok, &gs);
    ret->seq_start = step_find(c, seq_start, (size_t) n_seqs + 1, &g);
    ret->pos0 = step_find(c, pos0, n_seqs, &g);
    ret->boff = step_find(c, boff, n_seqs, &gb);
    gt = tables == c->map.tables[0] ? 0 : tables == c->map.tables[1] ? 1 : -1;
    if (!ret->pos || !ret->slots || !ret->seq_start || !ret->pos0 || !ret->boff || gt < 0 ||
        ret->pos != c->sd.pos || ret->seq_start != c->sd.seq_start || ret->pos0 != c->sd.pos0)
        return false;
    // graph-safe pointers: the group's table offset is read on the device (hdr[3 + g])
    ret->tables = c->sd.tables[0];
    ret->table_shift = c->sd.hdr + 3 + gt;
    ret->tiles = c->sd.tiles;
    ret->n_tiles = c->map.n_tiles;
    ret->n_tiles_real = c->sd.hdr + 2;
    ret->n_real = c->sd.hdr;
    (void) gs;
    (void) gb;
    return true;
}

static int cuda_step_begin(struct backend *be, const struct backend_step *s)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    struct step_map *m = &c->map;
    int r;

    m->valid = false;
    sg_blocks_reset(&c->blocks);
    if (!c->d_step || s->n_tok <= 0 || s->n_seqs <= 0)
        return 0;
    int bucket = 0;
    if (c->graphs && s->graph && s->max_run <= GRAPH_MAX_RUN)
        bucket = graph_bucket(s->n_tok, c->t_cap < c->s_cap ? c->t_cap : c->s_cap);
    const int rows = bucket ? bucket : s->n_tok, seqs = bucket ? bucket : s->n_seqs;
    if (rows > c->t_cap || seqs > c->s_cap)
        return 0;
    for (int g = 0; g < BACKEND_KV_GROUPS; g++)
        if (s->tables[g] && s->n_table[g] > c->table_cap)
            return 0;
    // the host buffer about to be filled was sent two steps ago
    r = err_from_cuda(cudaEventSynchronize(c->h_ev[c->h_cur]));
    if (r < 0)
        return r;
    int32_t *h = c->h_step[c->h_cur];
    struct step_dev v;
    step_views(c, h, &v);
    memset(h, 0, STEP_HDR * sizeof(int32_t));
    const int n = s->n_tok, S = s->n_seqs;
    memcpy(v.ids, s->ids, n * sizeof(int32_t));
    memcpy(v.pos, s->pos, n * sizeof(int32_t));
    graph_pad_i32(v.ids, n, rows, 0);
    graph_pad_i32(v.pos, n, rows, 0);
    for (int g = 0; g < BACKEND_KV_GROUPS; g++) {
        if (s->slots[g])
            memcpy(v.slots[g], s->slots[g], n * sizeof(int32_t));
        graph_pad_i32(v.slots[g], s->slots[g] ? n : 0, rows, -1);
        if (s->boff[g])
            memcpy(v.boff[g], s->boff[g], S * sizeof(int32_t));
        graph_pad_i32(v.boff[g], s->boff[g] ? S : 0, seqs, 0);
    }
    memcpy(v.seq_start, s->seq_start, (S + 1) * sizeof(int32_t));
    graph_pad_i32(v.seq_start, S + 1, seqs + 1, n);
    memcpy(v.pos0, s->seq_pos0, S * sizeof(int32_t));
    graph_pad_i32(v.pos0, S, seqs, 0);
    const int n_tiles = kcu_attention_tiles(s->seq_start, S, v.tiles);
    int tiles = n_tiles;
    if (bucket) {
        // a graph has one tile per possible sequence; the unused ones are empty
        for (; tiles < seqs; tiles++) {
            v.tiles[4 * tiles] = 0;
            v.tiles[4 * tiles + 1] = n;
            v.tiles[4 * tiles + 2] = n;
            v.tiles[4 * tiles + 3] = 0;
        }
        if (n_tiles > seqs)
            bucket = 0;     // a verify run longer than a tile: not a graph shape
    }
    int32_t *tab = v.tables[0];
    int nt0 = s->tables[0] ? s->n_table[0] : 0, nt1 = s->tables[1] ? s->n_table[1] : 0;
    if (nt0)
        memcpy(tab, s->tables[0], nt0 * sizeof(int32_t));
    if (nt1)
        memcpy(tab + nt0, s->tables[1], nt1 * sizeof(int32_t));
    v.hdr[0] = n;
    v.hdr[1] = S;
    v.hdr[2] = n_tiles;
    v.hdr[3] = 0;
    v.hdr[4] = nt0;
    const size_t ints = step_fixed_ints(c) + nt0 + nt1;
    r = err_from_cuda(cudaMemcpyAsync(c->d_step, h, ints * sizeof(int32_t), cudaMemcpyHostToDevice,
                                      c->stream));
    if (r == 0)
        r = err_from_cuda(cudaEventRecord(c->h_ev[c->h_cur], c->stream));
    if (r < 0)
        return r;
    c->h_cur ^= 1;
    m->valid = true;
    m->n_tok = n;
    m->n_seqs = S;
    m->n_rows = bucket ? rows : n;
    m->n_tiles = bucket ? tiles : n_tiles;
    m->bucket = bucket;
    m->qclass = s->max_run <= 1 ? 0 : 1;
    m->ids = s->ids;
    m->pos = s->pos;
    m->seq_start = s->seq_start;
    m->seq_pos0 = s->seq_pos0;
    for (int g = 0; g < BACKEND_KV_GROUPS; g++) {
        m->slots[g] = s->slots[g];
        m->boff[g] = s->boff[g];
        m->tables[g] = s->tables[g];
        m->n_table[g] = g ? nt1 : nt0;
    }
    return 0;
}

// ---- graphs ----

static int cuda_capture_begin(struct backend *be)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    c->replay = false;
    if (!c->graphs || !c->map.valid || !c->map.bucket)
        return 0;
    const int bi = graph_bucket_index(c->map.bucket), q = c->map.qclass;
    if (bi < 0)
        return 0;
    switch (sg_graph_lookup(c->exec[bi][q] != NULL, c->exec_epoch[bi][q], c->mem_epoch)) {
    case SG_GRAPH_REPLAY:
        c->replay = true;
        return 1;
    case SG_GRAPH_RECAPTURE:
        cudaGraphExecDestroy(c->exec[bi][q]);
        c->exec[bi][q] = NULL;
        break;
    case SG_GRAPH_CAPTURE:
        break;
    }
    int r = err_from_cuda(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    if (r < 0) {
        warn("graph capture begin", cudaGetLastError());
        c->graphs = false;
        return 0;
    }
    c->capturing = 1;
    c->launch_rows = c->map.bucket;
    return 0;
}

static int cuda_capture_end(struct backend *be, bool ok)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int bi = c->map.bucket ? graph_bucket_index(c->map.bucket) : -1, q = c->map.qclass;

    if (c->replay) {
        c->replay = false;
        return err_from_cuda(cudaGraphLaunch(c->exec[bi][q], c->stream));
    }
    if (!c->capturing)
        return 0;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    c->capturing = 0;
    c->launch_rows = 0;
    if (!ok) {
        if (g)
            cudaGraphDestroy(g);
        (void) cudaGetLastError();
        return 0;
    }
    cudaGraphExec_t x = NULL;
    if (e == cudaSuccess)
        e = cudaGraphInstantiate(&x, g, 0);
    if (g)
        cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        warn("graph capture (graphs are off from now on)", e);
        (void) cudaGetLastError();
        c->graphs = false;
        return -EAGAIN;
    }
    c->exec[bi][q] = x;
    c->exec_epoch[bi][q] = c->mem_epoch;
    return err_from_cuda(cudaGraphLaunch(x, c->stream));
}

// ---- lifecycle ----

static __global__ void copy_rows_kernel(char *dst, const int32_t *dr, const char *src,
                                        const int32_t *sr, int n, size_t row_bytes);

// Programmatic dependent launch (common.cuh cuda_launch): only where the code this device
// runs was compiled for sm_90 (its kernels wait; the fat binary's sm_80 code has no wait
// and runs on any later device), and STEPD_CUDA_NO_PDL is not set.
static bool cuda_pdl_on(void)
{
    if (getenv("STEPD_CUDA_NO_PDL"))
        return false;
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, copy_rows_kernel) != cudaSuccess) {
        (void) cudaGetLastError();
        return false;
    }
    return fa.ptxVersion >= 90;
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
    c->exact = cfg->mxfp4_exact;
    c->graphs = !c->exact && !getenv("STEPD_CUDA_NO_GRAPHS");
    r = err_from_cuda(cudaSetDevice(c->device));
    cudaDeviceProp p;
    if (r == 0)
        r = err_from_cuda(cudaGetDeviceProperties(&p, c->device));
    if (r == 0) {
        c->sms = p.multiProcessorCount;
        c->smem_optin = p.sharedMemPerBlockOptin;
        if (p.major < 8)
            r = -ENODEV;    // mma.sync BF16 needs sm_80
    }
    if (r == 0)
        c->pdl = cuda_pdl_on();
    if (r == 0)
        r = err_from_cuda(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    if (r == 0)
        r = kcu_lt_init(c);
    if (r == 0)
        r = err_from_cuda(cudaMalloc((void **) &c->d_done, sizeof(int32_t)));
    if (r == 0)
        r = err_from_cuda(cudaMemset(c->d_done, 0, sizeof(int32_t)));
    if (r == 0)
        r = err_from_cuda(cudaMalloc((void **) &c->d_split_done, KCU_SPLIT_DONE_CAP * sizeof(int32_t)));
    if (r == 0)
        r = err_from_cuda(cudaMemset(c->d_split_done, 0, KCU_SPLIT_DONE_CAP * sizeof(int32_t)));
    if (r == 0)
        r = err_from_cuda(cudaMalloc((void **) &c->d_combine_done,
                                     KCU_COMBINE_DONE_CAP * sizeof(int32_t)));
    if (r == 0)
        r = err_from_cuda(cudaMemset(c->d_combine_done, 0, KCU_COMBINE_DONE_CAP * sizeof(int32_t)));
    if (r < 0) {
        cudaFree(c->d_combine_done);
        cudaFree(c->d_split_done);
        cudaFree(c->d_done);
        kcu_lt_free(c);
        if (c->stream)
            cudaStreamDestroy(c->stream);
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
    for (int i = 0; i < GRAPH_N_BUCKETS; i++)
        for (int q = 0; q < GRAPH_QCLASSES; q++)
            if (c->exec[i][q])
                cudaGraphExecDestroy(c->exec[i][q]);
    kcu_lt_free(c);
    cudaFree(c->d_done);
    cudaFree(c->d_split_done);
    cudaFree(c->d_combine_done);
    cudaFree(c->stage);
    cudaFree(c->ws);
    step_area_free(c);
    cudaStreamDestroy(c->stream);
    free(c);
    be->ctx = NULL;
}

static int cuda_buf_alloc(struct backend *be, size_t bytes, size_t align, void **ret)
{
    void *p = NULL;
    (void) align;   // cudaMalloc returns 256-byte aligned memory
    (void) cuda_ctx_of(be);     // on the backend's device
    int r = err_from_cuda(cudaMalloc(&p, bytes ? bytes : 1));
    if (r < 0)
        return r;
    *ret = p;
    return 0;
}

static void cuda_buf_free(struct backend *be, void *p)
{
    if (p) {
        (void) cuda_ctx_of(be);
        cudaFree(p);
    }
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
    if (strcmp(op, "blocks") == 0)
        return !cuda_ctx_of(be)->exact;
    if (lowp_fmt(fmt))      // FP8, NVFP4: lowp.cu
        return strcmp(op, "matmul") == 0 || strcmp(op, "moe") == 0;
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
        if (strcmp(op, ops[i]) == 0)
            return strcmp(op, "rmsnorm") != 0 || fmt != WFMT_MXFP4;
    return false;
}

// ---- weights ----

static size_t weight_data_bytes(const struct bweight *w)
{
    switch (w->fmt) {
    case WFMT_F32: return (size_t) w->rows * w->cols * 4;
    case WFMT_BF16: return (size_t) w->rows * w->cols * 2;
    case WFMT_MXFP4:
    case WFMT_NVFP4: return (size_t) w->rows * w->cols / 2;
    default: return 0;
    }
}

static void cuda_weight_release(struct backend *be, struct bweight *w)
{
    struct cuda_weight *cw = (struct cuda_weight *) w->priv;
    if (!cw)
        return;
    (void) cuda_ctx_of(be);     // free on the backend's device
    if (!cw->borrowed)
        cudaFree(cw->data);
    cudaFree(cw->scale);
    cudaFree(cw->f32);
    free(cw);
    w->priv = NULL;
}

// one thread per (tile, lane): the lane's 16 nibble bytes and (lanes 4q) its scale word(s);
// nv: NVFP4 (mx4.h nv4_lane_gather)
static __global__ void mx4_repack_kernel(const uint8_t *packed, const uint8_t *scale, int64_t rows,
                                         int64_t cols, int64_t n_tiles, bool nv, bool placed,
                                         uint8_t *nib, uint8_t *sc)
{
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_tiles * 32)
        return;
    const int64_t t = i / 32;
    const int l = (int) (i % 32);
    uint32_t w[4], s[2];
    if (nv)
        nv4_lane_gather(packed, scale, rows, cols, t, l, w, s);
    else
        mx4_lane_gather_as(packed, scale, rows, cols, t, l, placed, w, &s[0]);
    *(uint4 *) (nib + t * MX4_TILE_NIB_BYTES + l * 16) = make_uint4(w[0], w[1], w[2], w[3]);
    if (l % 4 == 0 && nv)
        *(uint2 *) (sc + t * NV4_TILE_SCALE_BYTES + (l / 4) * 8) = make_uint2(s[0], s[1]);
    else if (l % 4 == 0)
        *(uint32_t *) (sc + t * MX4_TILE_SCALE_BYTES + (l / 4) * 4) = s[0];
}

// MXFP4 or NVFP4 (the global scale after the scales, mx4.h) repacked into the tile layout;
// MXFP4: placed (the build's default) unless a block scale is above 2^1, then the nibble
// layout of the PRMT decode, the choice in the word after the scales (mx4_matrix_placed)
static int mx4_prepare(struct cuda_ctx *c, struct bweight *w, struct cuda_weight *cw, bool placed)
{
    const bool nv = w->fmt == WFMT_NVFP4;
    const size_t nd = (size_t) w->rows * w->cols / 2;
    const size_t ns = (size_t) w->rows * (w->cols / (nv ? 16 : 32));
    const int64_t n_tiles = mx4_rows_padded(w->rows) / 16 * (mx4_cols_padded(w->cols) / 64);
    const size_t nsc = nv ? (size_t) nv4_scale_bytes(w->rows, w->cols)
                          : (size_t) mx4_scale_bytes(w->rows, w->cols);
    uint8_t *raw = NULL;
    int r;

    r = err_from_cuda(cudaMalloc((void **) &cw->data, (size_t) mx4_nib_bytes(w->rows, w->cols)));
    if (r == 0)
        r = err_from_cuda(cudaMalloc((void **) &cw->scale, nsc + 4));
    const uint32_t word = placed;
    if (r == 0)
        r = err_from_cuda(cudaMemcpyAsync(cw->scale + nsc, nv ? (const void *) &w->gscale : &word,
                                          4, cudaMemcpyHostToDevice, c->stream));
    if (r == 0)
        r = err_from_cuda(cudaMalloc((void **) &raw, nd + ns));
    if (r == 0)
        r = err_from_cuda(cudaMemcpyAsync(raw, w->data, nd, cudaMemcpyHostToDevice, c->stream));
    if (r == 0)
        r = err_from_cuda(cudaMemcpyAsync(raw + nd, w->scale, ns, cudaMemcpyHostToDevice, c->stream));
    if (r == 0) {
        mx4_repack_kernel<<<cuda_blocks((size_t) n_tiles * 32, 256), 256, 0, c->stream>>>(
            raw, raw + nd, w->rows, w->cols, n_tiles, nv, placed, (uint8_t *) cw->data,
            cw->scale);
        r = CUDA_LAUNCH_CHECK();
    }
    if (r == 0)
        r = err_from_cuda(cudaStreamSynchronize(c->stream));
    cudaFree(raw);
    return r;
}

static int cuda_weight_prepare(struct backend *be, struct bweight *w)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    size_t nd = weight_data_bytes(w);
    int r;

    if (w->priv)
        return 0;
    if (w->fmt == WFMT_FP8)
        return kcu_lowp_prepare(c, w);
    if (nd == 0 || (w->fmt == WFMT_MXFP4 && (w->cols % 32 != 0 || !w->scale)))
        return -EINVAL;
    if (w->fmt == WFMT_NVFP4) {
        // E2M1 in MXFP4's tiles, for mx4_gemm (and lowp.cu's FP32 op path)
        const size_t ns = (size_t) w->rows * (w->cols / 16);
        if (w->cols % 16 || !w->scale || !isfinite(w->gscale))
            return -EINVAL;
        for (size_t i = 0; i < ns; i++)
            if ((w->scale[i] & 0x7F) == 0x7F)
                return -EINVAL;     // E4M3 NaN: corrupt file
    }
    bool placed = MX4_PLACED_ON;
    if (w->fmt == WFMT_MXFP4) {
        const size_t ns = (size_t) w->rows * (w->cols / 32);
        unsigned big = 0;
        for (size_t i = 0; i < ns; i++) {
            if (w->scale[i] == 0xFF)
                return -EINVAL;     // E8M0 NaN: corrupt file
            if (!mx4_scale_placeable(w->scale[i]) && w->scale[i] > big)
                big = w->scale[i];
        }
        if (big) {
            // this matrix only: the nibble layout and the PRMT decode (docs/GPU.md §3)
            placed = false;
            fprintf(stderr, "stepd-cuda: info: %s [%lld, %lld]: MXFP4 block scale 2^%d above "
                    "the placed decode's 2^1, this matrix uses the PRMT decode\n",
                    w->name ? w->name : "an MXFP4 weight", (long long) w->rows,
                    (long long) w->cols, (int) big - 127);
        }
    }
    struct cuda_weight *cw = (struct cuda_weight *) calloc(1, sizeof(*cw));
    if (!cw)
        return -ENOMEM;
    w->priv = cw;
    if (w->fmt == WFMT_MXFP4 || w->fmt == WFMT_NVFP4) {
        r = mx4_prepare(c, w, cw, placed && w->fmt == WFMT_MXFP4);
    } else {
        r = err_from_cuda(cudaMalloc(&cw->data, nd));
        if (r == 0)
            r = err_from_cuda(cudaMemcpyAsync(cw->data, w->data, nd, cudaMemcpyHostToDevice, c->stream));
        if (r == 0)
            r = err_from_cuda(cudaStreamSynchronize(c->stream));
    }
    if (r < 0)
        cuda_weight_release(be, w);
    return r;
}

// ---- the memory plan ----

static size_t a256(size_t n)
{
    return (n + 255) & ~(size_t) 255;
}

static int cuda_reserve(struct backend *be, const struct backend_reserve *res)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const size_t T = (size_t) res->max_tokens, H = (size_t) res->hidden;
    const size_t Q = (size_t) res->max_q_dim, KV = (size_t) res->max_kv_dim;
    const size_t I = (size_t) (res->max_inter > 0 ? res->max_inter : 1);
    const size_t E = (size_t) res->n_experts, K = (size_t) (res->top_k > 0 ? res->top_k : 1);
    size_t attn, ffn, ops, need;
    int r;

    attn = a256(T * H * 2) + a256(T * (Q + 2 * KV + res->max_heads) * 2) + 2 * a256(T * Q * 2) +
           a256(kcu_attention_ws(c, (int) (T + res->max_seqs), res->max_heads, res->max_head_dim)) +
           4096;
    ffn = a256(T * H * 2) + a256(T * H * 4) + a256(T * 2 * I * 2) + a256(T * I * 2) + 4096;
    if (E) {
        ffn += a256(T * E * 4) + 2 * a256(T * K * 4) +
               a256(kcu_moe_ws((int) T, (int) K, (int) H, res->moe_inter,
                               res->max_local_experts));
    }
    // the op path: an activation converted to BF16 (matmul), the MoE op, attention partials
    size_t kmax = H > Q ? H : Q;
    kmax = kmax > I ? kmax : I;
    ops = a256(T * kmax * 2);
    if (E)
        ops = ops > kcu_moe_ws((int) T, (int) K, (int) H, res->moe_inter, res->max_local_experts)
                  ? ops : kcu_moe_ws((int) T, (int) K, (int) H, res->moe_inter, res->max_local_experts);
    need = attn > ffn ? attn : ffn;
    need = need > ops ? need : ops;
    need += 1u << 20;
    // only grows: the vision encoder's plan (vision.cu) may have come first
    r = cuda_ws_plan(c, need);
    if (r < 0)
        return r;
    step_area_free(c);
    mem_moved(c);
    r = step_area_alloc(c, res->max_tokens, res->max_seqs,
                        res->max_block_ids > 0 ? res->max_block_ids : 1);
    if (r < 0)
        return r;
    c->res = *res;
    c->reserved = true;
    return 0;
}

// ---- rows between activation buffers ----

static __global__ void copy_rows_kernel(char *dst, const int32_t *dr, const char *src,
                                        const int32_t *sr, int n, size_t row_bytes)
{
    const int i = blockIdx.x;
    PDL_WAIT();
    PDL_TRIGGER();
    if (i >= n)
        return;
    char *d = dst + (size_t) (dr ? dr[i] : i) * row_bytes;
    const char *s = src + (size_t) (sr ? sr[i] : i) * row_bytes;
    if (row_bytes % 16 == 0 && ((uintptr_t) d | (uintptr_t) s) % 16 == 0) {
        for (size_t j = threadIdx.x; j < row_bytes / 16; j += blockDim.x)
            ((uint4 *) d)[j] = ((const uint4 *) s)[j];
    } else {
        for (size_t j = threadIdx.x; j < row_bytes; j += blockDim.x)
            d[j] = s[j];
    }
}

static int cuda_copy_rows(struct backend *be, void *dst, const int32_t *dst_rows, const void *src,
                          const int32_t *src_rows, int n, size_t row_bytes)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (n == 0)
        return 0;
    cuda_stage_reset(c);
    const int32_t *dr = dst_rows ? (const int32_t *) cuda_stage(c, dst_rows, sizeof(int32_t) * n) : NULL;
    const int32_t *sr = src_rows ? (const int32_t *) cuda_stage(c, src_rows, sizeof(int32_t) * n) : NULL;
    if ((dst_rows && !dr) || (src_rows && !sr))
        return -ENOMEM;
    cuda_launch(c, copy_rows_kernel, n, 256, 0, (char *) dst, dr, (const char *) src, sr, n,
                row_bytes);
    return CUDA_LAUNCH_CHECK();
}

static void *cuda_native(struct backend *be, const char *what)
{
    if (strcmp(what, "stream") == 0)
        return cuda_ctx_of(be)->stream;
    if (strcmp(what, "vision") == 0)
        return (void *) kcuda_vision_ops();
    return NULL;
}

static int cuda_mem_info(struct backend *be, size_t *ret_free, size_t *ret_total)
{
    (void) cuda_ctx_of(be);     // the backend's device, not the calling thread's
    return err_from_cuda(cudaMemGetInfo(ret_free, ret_total));
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
    .matmul_rows = NULL,
    .graph_begin = NULL,
    .graph_end = NULL,
    .split_width = NULL,
    .split_run = NULL,
    .reserve = cuda_reserve,
    .step_begin = cuda_step_begin,
    .attn_prepare = kcuda_attn_prepare,
    .attn_release = kcuda_attn_release,
    .ffn_prepare = kcuda_ffn_prepare,
    .ffn_release = kcuda_ffn_release,
    .attn_block = kcuda_attn_block,
    .ffn_block = kcuda_ffn_block,
    .copy_rows = cuda_copy_rows,
    .native = cuda_native,
    .mem_info = cuda_mem_info,
    .capture_begin = cuda_capture_begin,
    .capture_end = cuda_capture_end,
    .argmax = kcuda_argmax,
    .row_expsum = kcuda_row_expsum,
};

extern "C" __attribute__((visibility("default"))) const struct backend_ops *stepd_backend_cuda_ops(void)
{
    return &backend_cuda_ops;
}
