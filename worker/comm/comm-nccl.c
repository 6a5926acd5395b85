/* comm-nccl.c - struct comm over NCCL, device buffers, non-blocking with a deadline. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "clock.h"
#include "comm-nccl.h"
#include "err.h"

struct nccl {
    struct comm c;
    ncclComm_t comm;
    cudaStream_t stream;
    int device;
    float *scratch;         /* one float on the device, for the barrier */
};

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

/* Poll the communicator (and, when stream_too, the stream) until idle, an error or the
 * deadline.  Any failure aborts the communicator. */
static int wait_comm(struct nccl *n, const char *op, bool stream_too)
{
    uint64_t deadline = n->c.timeout_msec > 0 ? now_usec() + (uint64_t)n->c.timeout_msec * 1000u : 0;
    ncclResult_t st;
    cudaError_t ce;

    for (;;) {
        st = ncclSuccess;
        ncclCommGetAsyncError(n->comm, &st);
        if (st != ncclSuccess && st != ncclInProgress) {
            int r = comm__fail(&n->c, err_from_nccl(st), "%s: NCCL error: %s", op,
                               ncclGetErrorString(st));

            n->c.ops->abort(&n->c);
            return r;
        }
        if (st == ncclSuccess) {
            if (!stream_too)
                return 0;
            ce = cudaStreamQuery(n->stream);
            if (ce == cudaSuccess)
                return 0;
            if (ce != cudaErrorNotReady) {
                int r = comm__fail(&n->c, err_from_cuda(ce), "%s: CUDA error: %s", op,
                                   cudaGetErrorString(ce));

                n->c.ops->abort(&n->c);
                return r;
            }
        }
        if (deadline && now_usec() >= deadline) {
            int r = comm__fail(&n->c, -ETIMEDOUT, "%s: timed out after %d ms", op,
                               n->c.timeout_msec);

            n->c.ops->abort(&n->c);
            return r;
        }
        struct timespec ts = { 0, 10000 };
        nanosleep(&ts, NULL);
    }
}

static int enqueued(struct nccl *n, ncclResult_t r, const char *op)
{
    if (r != ncclSuccess && r != ncclInProgress) {
        int e = comm__fail(&n->c, err_from_nccl(r), "%s: %s", op, ncclGetErrorString(r));

        n->c.ops->abort(&n->c);
        return e;
    }
    return wait_comm(n, op, true);
}

static int nccl_allreduce_sum(struct comm *c, float *buf, size_t count)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, n->comm, n->stream),
                    "allreduce");
}

static int nccl_allgather(struct comm *c, const void *send, void *recv, size_t nbytes)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, ncclAllGather(send, recv, nbytes, ncclUint8, n->comm, n->stream), "allgather");
}

static int nccl_broadcast(struct comm *c, void *buf, size_t nbytes, int root)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, ncclBroadcast(buf, buf, nbytes, ncclUint8, root, n->comm, n->stream),
                    "broadcast");
}

static int nccl_broadcast_var(struct comm *c, void *buf, size_t *len, size_t cap, int root)
{
    return -EOPNOTSUPP;     /* the step plan travels on the host path */
}

static int nccl_barrier(struct comm *c)
{
    struct nccl *n = to_nccl(c);

    return enqueued(n, ncclAllReduce(n->scratch, n->scratch, 1, ncclFloat32, ncclSum, n->comm,
                                     n->stream), "barrier");
}

static void nccl_abort(struct comm *c)
{
    struct nccl *n = to_nccl(c);

    if (!c->error)
        comm__fail(c, -ECANCELED, "communicator aborted");
    if (n->comm) {
        ncclCommAbort(n->comm);
        n->comm = NULL;
    }
}

static void nccl_free(struct comm *c)
{
    struct nccl *n = to_nccl(c);

    if (n->comm && !c->error) {
        /* orderly: finalize (non-blocking, polled with the deadline; a failure aborts
         * and clears n->comm), then destroy */
        ncclResult_t fr = ncclCommFinalize(n->comm);

        if ((fr == ncclSuccess || fr == ncclInProgress) && wait_comm(n, "finalize", false) == 0) {
            ncclCommDestroy(n->comm);
            n->comm = NULL;
        }
    }
    if (n->comm) {
        ncclCommAbort(n->comm);
        n->comm = NULL;
    }
    if (n->scratch)
        cudaFree(n->scratch);
    if (n->stream)
        cudaStreamDestroy(n->stream);
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
    r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
        return err_from_nccl(r);
    memcpy(ret_id, id.internal, sizeof(id.internal));
    return 0;
}

int comm_nccl_new(int rank, int world_size, int device, const void *id, size_t id_len,
                  int timeout_msec, struct comm **ret)
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
    memcpy(uid.internal, id, sizeof(uid.internal));
    n = calloc(1, sizeof(*n));
    if (!n)
        return -ENOMEM;
    n->c.ops = &nccl_ops;
    n->c.rank = rank;
    n->c.world_size = world_size;
    n->c.timeout_msec = timeout_msec;
    n->device = device;
    ce = cudaSetDevice(device);
    if (ce == cudaSuccess)
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
    nr = ncclCommInitRankConfig(&n->comm, world_size, uid, rank, &config);
    if (nr != ncclSuccess && nr != ncclInProgress) {
        n->comm = NULL;
        r = err_from_nccl(nr);
        goto out_free;
    }
    r = wait_comm(n, "init", false);
    if (r < 0)
        goto out_free;
    *ret = &n->c;
    return 0;

out_free:
    nccl_free(&n->c);
    return r;
}
