/* test-comm-nccl.c - the NCCL struct comm on a real GPU (suite 'gpu'; exit 77 without one).
 *
 * One GPU cannot host two ranks of one communicator ("may lead to hangs", NCCL docs), so
 * with one device this runs world size 1 through the full non-blocking path (unique id,
 * init, all-reduce, all-gather, broadcast, barrier, finalize); with two or more devices
 * it forks one rank per device (up to 4) and checks the sums across ranks.
 *
 * Each rank then joins a second communicator on a compute stream of its own (the id
 * travels over the first), the way the CUDA backend's ranks use it: an all-reduce with
 * dependent work queued behind it in stream order, then the same captured in a CUDA graph
 * (copy in, all-reduce, copy out) replayed twice with new inputs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include "comm-nccl.h"
#include "harness.h"

static float cs_value(int rank, size_t i, int scale)
{
    return (float)(scale * ((int)((rank * 7 + i) % 13) - 6));
}

static void cs_check(const float *h, size_t cnt, int rank, int n, int scale, const char *what)
{
    for (size_t i = 0; i < cnt; i++) {
        float ref = 0;

        for (int r = 0; r < n; r++)
            ref += cs_value(r, i, scale);
        if (h[i] != ref)
            FAIL("rank %d: %s [%zu] = %g, expected %g", rank, what, i, h[i], ref);
    }
}

/* A communicator on a compute stream: collectives in stream order with dependent work,
 * eagerly and captured in a graph.  c (own stream) carries rank 0's id for it. */
static void run_compute_stream(struct comm *c, int rank, int n)
{
    const size_t cnt = 65536;
    unsigned char id[COMM_NCCL_ID_BYTES], *did;
    float *src, *buf, *out, *h = malloc(cnt * sizeof(float));
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t x;
    struct comm *cs;

    ASSERT_TRUE(h);
    if (rank == 0)
        ASSERT_OK(comm_nccl_unique_id(id, sizeof(id)));
    ASSERT_EQ(cudaMalloc((void **)&did, sizeof(id)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(did, id, sizeof(id), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_OK(comm_broadcast(c, did, sizeof(id), 0));
    ASSERT_EQ(cudaMemcpy(id, did, sizeof(id), cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(did);
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_OK(comm_nccl_new(rank, n, rank, id, COMM_NCCL_ID_BYTES, 30000, s, &cs));
    ASSERT_EQ(cudaMalloc((void **)&src, cnt * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc((void **)&buf, cnt * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc((void **)&out, cnt * sizeof(float)), cudaSuccess);

    /* eager: the copy behind the all-reduce sees its result */
    for (size_t i = 0; i < cnt; i++)
        h[i] = cs_value(rank, i, 1);
    ASSERT_EQ(cudaMemcpyAsync(buf, h, cnt * sizeof(float), cudaMemcpyHostToDevice, s), cudaSuccess);
    ASSERT_OK(comm_allreduce_sum(cs, buf, cnt));
    ASSERT_EQ(cudaMemcpyAsync(out, buf, cnt * sizeof(float), cudaMemcpyDeviceToDevice, s),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    ASSERT_OK(comm_nccl_step_done(cs));
    ASSERT_EQ(cudaMemcpy(h, out, cnt * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    cs_check(h, cnt, rank, n, 1, "compute-stream all-reduce");

    /* captured: copy in, all-reduce, copy out; replayed with new inputs */
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(buf, src, cnt * sizeof(float), cudaMemcpyDeviceToDevice, s),
              cudaSuccess);
    ASSERT_OK(comm_allreduce_sum(cs, buf, cnt));
    ASSERT_EQ(cudaMemcpyAsync(out, buf, cnt * sizeof(float), cudaMemcpyDeviceToDevice, s),
              cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&x, g, 0), cudaSuccess);
    for (int scale = 2; scale <= 3; scale++) {
        for (size_t i = 0; i < cnt; i++)
            h[i] = cs_value(rank, i, scale);
        ASSERT_EQ(cudaMemcpy(src, h, cnt * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(x, s), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        ASSERT_OK(comm_nccl_step_done(cs));
        ASSERT_EQ(cudaMemcpy(h, out, cnt * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        cs_check(h, cnt, rank, n, scale, "graph-captured all-reduce");
    }
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    comm_free(cs);
    cudaFree(src);
    cudaFree(buf);
    cudaFree(out);
    cudaStreamDestroy(s);
    free(h);
    printf("rank %d of %d: compute-stream all-reduce, eager and graph-captured (2 replays) ok\n",
           rank, n);
}

static void run_rank(int rank, int n, const unsigned char *id)
{
    size_t cnt = 1000003;
    float *d, *h = malloc(cnt * sizeof(float));
    unsigned char *dg, hg[4 * 7];
    struct comm *c;

    ASSERT_TRUE(h);
    ASSERT_OK(comm_nccl_new(rank, n, rank, id, COMM_NCCL_ID_BYTES, 30000, NULL, &c));
    ASSERT_STREQ(c->ops->name, "nccl");
    ASSERT_EQ(cudaMalloc((void **)&d, cnt * sizeof(float)), cudaSuccess);
    for (size_t i = 0; i < cnt; i++)
        h[i] = (float)((int)((rank * 31 + i) % 97) - 48);
    ASSERT_EQ(cudaMemcpy(d, h, cnt * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_OK(comm_allreduce_sum(c, d, cnt));
    ASSERT_EQ(cudaMemcpy(h, d, cnt * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < cnt; i++) {
        float ref = 0;

        for (int r = 0; r < n; r++)
            ref += (float)((int)((r * 31 + i) % 97) - 48);
        if (h[i] != ref)
            FAIL("rank %d: allreduce[%zu] = %g, expected %g", rank, i, h[i], ref);
    }
    ASSERT_EQ(cudaMalloc((void **)&dg, sizeof(hg)), cudaSuccess);
    memset(hg, 0, sizeof(hg));
    for (int i = 0; i < 7; i++)
        hg[rank * 7 + i] = (unsigned char)(rank * 10 + i);
    ASSERT_EQ(cudaMemcpy(dg, hg, sizeof(hg), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_OK(comm_allgather(c, dg + rank * 7, dg, 7));
    ASSERT_EQ(cudaMemcpy(hg, dg, sizeof(hg), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int r = 0; r < n; r++)
        for (int i = 0; i < 7; i++)
            ASSERT_EQ(hg[r * 7 + i], r * 10 + i);
    ASSERT_OK(comm_broadcast(c, dg, 7, 0));
    ASSERT_OK(comm_barrier(c));
    ASSERT_ERR(comm_broadcast_var(c, hg, &(size_t){ 3 }, sizeof(hg), 0), -EOPNOTSUPP);
    run_compute_stream(c, rank, n);
    cudaFree(d);
    cudaFree(dg);
    comm_free(c);
    free(h);
    printf("rank %d of %d: NCCL all-reduce of %zu floats, all-gather, broadcast, barrier ok\n",
           rank, n, cnt);
}

int main(void)
{
    unsigned char id[COMM_NCCL_ID_BYTES];
    int pfd[2], n;
    pid_t pid[4];

    /* count devices in a child so that the parent never initialises CUDA before fork */
    if (pipe(pfd) < 0)
        return 1;
    pid[0] = fork();
    if (pid[0] == 0) {
        int k = comm_nccl_device_count();

        if (write(pfd[1], &k, sizeof(k)) != sizeof(k))
            _exit(1);
        _exit(0);
    }
    if (read(pfd[0], &n, sizeof(n)) != sizeof(n))
        n = 0;
    waitpid(pid[0], NULL, 0);
    if (n < 1) {
        printf("no CUDA device: skipped\n");
        return TEST_SKIP;
    }
    if (n == 1) {
        ASSERT_OK(comm_nccl_unique_id(id, sizeof(id)));
        run_rank(0, 1, id);
        return 0;
    }
    if (n > 4)
        n = 4;
    /* rank 0 makes the id in its own process; the parent relays it */
    int idp[2], relay[4][2];

    if (pipe(idp) < 0)
        return 1;
    for (int r = 0; r < n; r++) {
        if (pipe(relay[r]) < 0)
            return 1;
        pid[r] = fork();
        if (pid[r] == 0) {
            if (r == 0) {
                ASSERT_OK(comm_nccl_unique_id(id, sizeof(id)));
                if (write(idp[1], id, sizeof(id)) != sizeof(id))
                    _exit(1);
            } else if (read(relay[r][0], id, sizeof(id)) != sizeof(id)) {
                _exit(1);
            }
            run_rank(r, n, id);
            _exit(0);
        }
    }
    if (read(idp[0], id, sizeof(id)) != sizeof(id))
        FAIL("rank 0 produced no NCCL id");
    for (int r = 1; r < n; r++)
        if (write(relay[r][1], id, sizeof(id)) != sizeof(id))
            FAIL("relay to rank %d", r);
    for (int r = 0; r < n; r++) {
        int st;

        waitpid(pid[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            FAIL("rank %d ended with status 0x%x", r, st);
    }
    return 0;
}
