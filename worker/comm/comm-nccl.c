/* comm-nccl.c - struct comm over NCCL, device buffers, non-blocking with a deadline, on a
 * stream of its own or in order on a backend's compute stream (comm-nccl.h).  NCCL is
 * reached through a table of functions filled by dlopen() on first use. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "clock.h"
#include "comm-nccl.h"
#include "err.h"
#include "nccl-settle.h"

_Static_assert(NS_SUCCESS == ncclSuccess && NS_IN_PROGRESS == ncclInProgress,
               "nccl-settle.h names NCCL's values");

struct nccl {
    struct comm c;
    ncclComm_t comm;
    cudaStream_t stream;
    bool own_stream;        /* false: a backend's compute stream (no wait per collective) */
    int device;
    float *scratch;         /* one float on the device, for the barrier */
    /* an abort from another thread (the owner's comm_abort while this one polls): the
     * flag first, then the lock, so a poll never reads a communicator being destroyed */
    atomic_bool aborting;
    pthread_mutex_t lock;
};

/* the NCCL functions this file uses, from libnccl.so.2 */
static struct {
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommFinalize)(ncclComm_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    const char *(*GetErrorString)(ncclResult_t);
    int err;                /* 0, or why the library could not be used */
    char why[256];
} nccl_lib;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void)
{
    const char *path = getenv("STEPD_NCCL_LIB");
    void *dl = dlopen(path && path[0] ? path : "libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    struct { const char *name; void **slot; } syms[] = {
        { "ncclGetUniqueId", (void **)&nccl_lib.GetUniqueId },
        { "ncclCommInitRankConfig", (void **)&nccl_lib.CommInitRankConfig },
        { "ncclCommGetAsyncError", (void **)&nccl_lib.CommGetAsyncError },
        { "ncclAllReduce", (void **)&nccl_lib.AllReduce },
        { "ncclAllGather", (void **)&nccl_lib.AllGather },
        { "ncclBroadcast", (void **)&nccl_lib.Broadcast },
        { "ncclCommAbort", (void **)&nccl_lib.CommAbort },
        { "ncclCommFinalize", (void **)&nccl_lib.CommFinalize },
        { "ncclCommDestroy", (void **)&nccl_lib.CommDestroy },
        { "ncclGetErrorString", (void **)&nccl_lib.GetErrorString },
    };

    if (!dl) {
        nccl_lib.err = -ENOENT;
        snprintf(nccl_lib.why, sizeof(nccl_lib.why), "cannot open NCCL (%s): %s",
                 path && path[0] ? path : "libnccl.so.2; STEPD_NCCL_LIB names another file",
                 dlerror());
        return;
    }
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        *syms[i].slot = dlsym(dl, syms[i].name);
        if (!*syms[i].slot) {
            nccl_lib.err = -ENOENT;
            snprintf(nccl_lib.why, sizeof(nccl_lib.why), "NCCL library lacks %s", syms[i].name);
            return;
        }
    }
}

static int nccl_ready(void)
{
    pthread_once(&nccl_once, nccl_load);
    if (nccl_lib.err)
        fprintf(stderr, "comm-nccl: %s\n", nccl_lib.why);
    return nccl_lib.err;
}

static int err_from_nccl(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return 0;
    case ncclInProgress: return -EINPROGRESS;
    case ncclInvalidArgument: case ncclInvalidUsage: return -EINVAL;
    case ncclSystemError: return -EIO;
    case ncclRemoteError: return -ECONNRESET;
    case ncclUnhandledCudaError: return -EFAULT;
    case ncclInternalError: default: return -EPROTO;
    }
}

static int err_from_cuda(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return 0;
    case cudaErrorMemoryAllocation: return -ENOMEM;
    case cudaErrorNoDevice: case cudaErrorInvalidDevice: return -ENODEV;
    case cudaErrorInsufficientDriver: return -ENXIO;
    default: return -EIO;
    }
}

static uint64_t now_usec(void)
{
    return (uint64_t)clk_now_us();
}

static struct nccl *to_nccl(struct comm *c)
{
    return (struct nccl *)c;
}

static int settle_state(void *ctx, int *st)
{
    struct nccl *n = ctx;
    ncclResult_t r = ncclSuccess;

    if (atomic_load(&n->c.interrupted))
        return -ECANCELED;
    pthread_mutex_lock(&n->lock);
    if (atomic_load(&n->aborting) || !n->comm) {
        pthread_mutex_unlock(&n->lock);
        return -ECANCELED;
    }
    nccl_lib.CommGetAsyncError(n->comm, &r);
    pthread_mutex_unlock(&n->lock);
    *st = (int)r;
    return 0;
}

static uint64_t settle_now(void *ctx)
{
    (void)ctx;
    return now_usec();
}

static void settle_pause(void *ctx)
{
    struct timespec ts = { 0, 10000 };

    (void)ctx;
    nanosleep(&ts, NULL);
}

static int fail_abort(struct nccl *n, int err, const char *op, const char *what, const char *why)
{
    int r = comm__fail(&n->c, err, "%s: %s%s", op, what, why);

    n->c.ops->abort(&n->c);
    return r;
}

/* After a call that returned `issued`: poll the communicator until its state is
 * ncclSuccess (nccl-settle.h: no dependent work before that, in either stream mode), then,
 * when stream_too, the stream until idle; an error or the deadline aborts the
 * communicator. */
static int wait_comm(struct nccl *n, const char *op, ncclResult_t issued, bool stream_too)
{
    const uint64_t deadline = n->c.timeout_msec > 0 ? now_usec() + (uint64_t)n->c.timeout_msec * 1000u : 0;
    const struct nccl_settle s = { settle_state, settle_now, settle_pause, n, deadline };
    char ms[32];
    int st, r;
    cudaError_t ce;

    r = nccl_settle(&s, (int)issued, &st);
    if (r == -ECANCELED && !atomic_load(&n->aborting))
        return fail_abort(n, -ECANCELED, op, "interrupted: ", "the group is re-forming");
    if (r == -ECANCELED)
        return n->c.error ? n->c.error : r;
    if (r == -EPROTO)
        return fail_abort(n, err_from_nccl((ncclResult_t)st), op, "NCCL error: ",
                          nccl_lib.GetErrorString((ncclResult_t)st));
    snprintf(ms, sizeof(ms), "%d ms", n->c.timeout_msec);
    if (r == -ETIMEDOUT)
        return fail_abort(n, -ETIMEDOUT, op, "timed out after ", ms);
    while (stream_too) {
        ce = cudaStreamQuery(n->stream);
        if (ce == cudaSuccess)
            break;
        if (ce != cudaErrorNotReady)
            return fail_abort(n, err_from_cuda(ce), op, "CUDA error: ", cudaGetErrorString(ce));
        if (atomic_load(&n->c.interrupted))
            return fail_abort(n, -ECANCELED, op, "interrupted: ", "the group is re-forming");
        if (deadline && now_usec() >= deadline)
            return fail_abort(n, -ETIMEDOUT, op, "timed out after ", ms);
        settle_pause(n);
    }
    return 0;
}

static int enqueued(struct nccl *n, ncclResult_t r, const char *op)
{
    if (!n->own_stream && n->c.timeout_msec > 0) {
        /* in stream order with the compute: the step's sync waits, comm_nccl_step_done
         * checks; the watchdog sees how long the step has been in collectives */
        uint64_t zero = 0;

        atomic_compare_exchange_strong(&n->c.busy_since_usec, &zero, now_usec());
    }
    return wait_comm(n, op, r, n->own_stream);
}

int comm_nccl_step_done(struct comm *c)
{
    struct nccl *n = to_nccl(c);
    ncclResult_t st = ncclSuccess;

    atomic_store(&c->busy_since_usec, 0);
    if (c->error)
        return c->error;
    if (!n->comm)
        return -ECANCELED;
    nccl_lib.CommGetAsyncError(n->comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) {
        int r = comm__fail(c, err_from_nccl(st), "step: NCCL error: %s", nccl_lib.GetErrorString(st));

        c->ops->abort(c);
        return r;
    }
    return 0;
}

static int nccl_allreduce_sum(struct comm *c, float *buf, size_t count)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, nccl_lib.AllReduce(buf, buf, count, ncclFloat32, ncclSum, n->comm, n->stream),
                    "allreduce");
}

static int nccl_allgather(struct comm *c, const void *send, void *recv, size_t nbytes)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, nccl_lib.AllGather(send, recv, nbytes, ncclUint8, n->comm, n->stream), "allgather");
}

static int nccl_broadcast(struct comm *c, void *buf, size_t nbytes, int root)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, nccl_lib.Broadcast(buf, buf, nbytes, ncclUint8, root, n->comm, n->stream),
                    "broadcast");
}

static int nccl_broadcast_var(struct comm *c, void *buf, size_t *len, size_t cap, int root)
{
    return -EOPNOTSUPP;     /* the step plan travels on the host path */
}

static int nccl_barrier(struct comm *c)
{
    struct nccl *n = to_nccl(c);

    int r = enqueued(n, nccl_lib.AllReduce(n->scratch, n->scratch, 1, ncclFloat32, ncclSum,
                                           n->comm, n->stream), "barrier");

    /* a barrier is a host-side rendezvous in either mode */
    return r < 0 || n->own_stream ? r : wait_comm(n, "barrier", ncclSuccess, true);
}

static void nccl_abort(struct comm *c)
{
    struct nccl *n = to_nccl(c);

    if (!c->error)
        comm__fail(c, -ECANCELED, "communicator aborted");
    atomic_store(&n->aborting, true);
    pthread_mutex_lock(&n->lock);
    if (n->comm) {
        nccl_lib.CommAbort(n->comm);
        n->comm = NULL;
    }
    pthread_mutex_unlock(&n->lock);
}

static void nccl_free(struct comm *c)
{
    struct nccl *n = to_nccl(c);

    if (n->comm && !c->error) {
        /* orderly: finalize (non-blocking, polled with the deadline; a failure aborts
         * and clears n->comm), then destroy */
        ncclResult_t fr = nccl_lib.CommFinalize(n->comm);

        if (wait_comm(n, "finalize", fr, false) == 0) {
            nccl_lib.CommDestroy(n->comm);
            n->comm = NULL;
        }
    }
    if (n->comm) {
        nccl_lib.CommAbort(n->comm);
        n->comm = NULL;
    }
    if (n->scratch)
        cudaFree(n->scratch);
    if (n->stream && n->own_stream)
        cudaStreamDestroy(n->stream);
    pthread_mutex_destroy(&n->lock);
    free(n);
}

static const struct comm_ops nccl_ops = {
    .name = "nccl",
    .allreduce_sum = nccl_allreduce_sum,
    .allgather = nccl_allgather,
    .broadcast = nccl_broadcast,
    .broadcast_var = nccl_broadcast_var,
    .barrier = nccl_barrier,
    .abort = nccl_abort,
    .free = nccl_free,
};

int comm_nccl_device_count(void)
{
    int n = 0;

    if (cudaGetDeviceCount(&n) != cudaSuccess)
        return 0;
    return n;
}

int comm_nccl_unique_id(void *ret_id, size_t len)
{
    ncclUniqueId id;
    ncclResult_t r;

    if (len < sizeof(id.internal))
        return -EMSGSIZE;
    if (nccl_ready() < 0)
        return nccl_lib.err;
    r = nccl_lib.GetUniqueId(&id);
    if (r != ncclSuccess)
        return err_from_nccl(r);
    memcpy(ret_id, id.internal, sizeof(id.internal));
    return 0;
}

int comm_nccl_new(int rank, int world_size, int device, const void *id, size_t id_len,
                  int timeout_msec, void *stream, struct comm **ret)
{
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    ncclUniqueId uid;
    struct nccl *n;
    cudaError_t ce;
    ncclResult_t nr;
    int r;

    if (world_size < 1 || rank < 0 || rank >= world_size || device < 0)
        return -EINVAL;
    if (id_len != sizeof(uid.internal))
        return -EBADMSG;
    if (nccl_ready() < 0)
        return nccl_lib.err;
    memcpy(uid.internal, id, sizeof(uid.internal));
    n = calloc(1, sizeof(*n));
    if (!n)
        return -ENOMEM;
    pthread_mutex_init(&n->lock, NULL);
    atomic_init(&n->aborting, false);
    n->c.ops = &nccl_ops;
    n->c.rank = rank;
    n->c.world_size = world_size;
    n->c.timeout_msec = timeout_msec;
    n->device = device;
    n->own_stream = !stream;
    n->stream = (cudaStream_t)stream;
    ce = cudaSetDevice(device);
    if (ce == cudaSuccess && n->own_stream)
        ce = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking);
    if (ce == cudaSuccess)
        ce = cudaMalloc((void **)&n->scratch, sizeof(float));
    if (ce == cudaSuccess)
        ce = cudaMemset(n->scratch, 0, sizeof(float));
    if (ce != cudaSuccess) {
        r = err_from_cuda(ce);
        goto out_free;
    }
    config.blocking = 0;
    nr = nccl_lib.CommInitRankConfig(&n->comm, world_size, uid, rank, &config);
    if (nr != ncclSuccess && nr != ncclInProgress) {
        n->comm = NULL;
        r = err_from_nccl(nr);
        goto out_free;
    }
    r = wait_comm(n, "init", nr, false);
    if (r < 0)
        goto out_free;
    *ret = &n->c;
    return 0;

out_free:
    nccl_free(&n->c);
    return r;
}

static const struct comm_nccl_api nccl_api = {
    .unique_id = comm_nccl_unique_id,
    .device_count = comm_nccl_device_count,
    .create = comm_nccl_new,
    .step_done = comm_nccl_step_done,
};

__attribute__((visibility("default"))) const struct comm_nccl_api *stepd_comm_nccl_api(void)
{
    return &nccl_api;
}
