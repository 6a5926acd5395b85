/* test-rpc.c - rpc/ glue over loopback: unary and streaming calls, an undecodable
 * response, cancel and deadline callbacks, UNIMPLEMENTED, API key, message-size limit, UTF-8 check,
 * shutdown with no leaked calls, the CQ-thread fast path (cq_hook) answering while
 * the server's loop is not running, rpc_ctx_run (callbacks on the CQ thread while the
 * loop waits, one at a time, in order, waking the loop for timers they start),
 * rpc_ctx_cork (sends to many calls held, then started together, in order). Uses the grpc.health.v1 messages as payloads. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "rpc.h"
#include "health.pb-c.h"

#define CHECK_PATH "/grpc.health.v1.Health/Check"
#define WATCH_PATH "/grpc.health.v1.Health/Watch"

static uv_loop_t *loop;
static int server_cancels;
static struct rpc_call *hanging;

static void on_hang_cancel(struct rpc_call *call, void *ud)
{
    server_cancels++;
    hanging = NULL;
    rpc_call_finish(call, RPC_CANCELLED, "cancelled");
}

static void h_check(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    if (strcmp(r->service, "") != 0) {
        rpc_call_finish(call, RPC_NOT_FOUND, "unknown service '%s'", r->service);
        return;
    }
    resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    ASSERT_OK(rpc_call_send(call, &resp.base));
    rpc_call_finish(call, RPC_OK, NULL);
}

#define FAN_N 200
static struct rpc_call *fan[FAN_N];
static bool fan_odd[FAN_N];
static int n_fan;

static void h_watch(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    if (strncmp(r->service, "fan", 3) == 0) {  /* test_cork: answered later, all at once */
        ASSERT_TRUE(n_fan < FAN_N);
        fan_odd[n_fan] = strcmp(r->service, "fan1") == 0;
        fan[n_fan++] = call;
        return;
    }
    if (strcmp(r->service, "hang") == 0) {
        resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
        ASSERT_OK(rpc_call_send(call, &resp.base));
        ASSERT_TRUE(rpc_call_deadline_ms(call) > rpc_now_ms());
        rpc_call_on_cancel(call, on_hang_cancel, NULL);
        hanging = call;
        return;
    }
    for (int i = 0; i < 5; i++) {
        resp.status = i % 2 ? 1 : 2;
        ASSERT_OK(rpc_call_send(call, &resp.base));
    }
    rpc_call_finish(call, RPC_OK, NULL);
}

struct result {
    bool done;
    int status;
    char details[256];
    int msgs;
    int last_status;
    struct rpc_client_call *call;
    int cancel_after;
};

static void on_msg(struct rpc_client_call *c, const ProtobufCMessage *m, void *ud)
{
    struct result *r = ud;
    const Grpc__Health__V1__HealthCheckResponse *resp = (const void *)m;
    r->msgs++;
    r->last_status = resp->status;
    if (r->cancel_after && r->msgs == r->cancel_after)
        rpc_client_cancel(c);
}

static void on_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct result *r = ud;
    r->done = true;
    r->status = status;
    snprintf(r->details, sizeof(r->details), "%s", details);
}

static void run_until(bool *flag)
{
    int64_t end = rpc_now_ms() + 10000;
    while (!*flag) {
        ASSERT_TRUE(rpc_now_ms() < end);
        uv_run(loop, UV_RUN_ONCE);
    }
}

static struct result call(struct rpc_channel *ch, const char *path, const char *service,
                          int64_t deadline_ms, int cancel_after)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    struct result r = { .cancel_after = cancel_after };
    req.service = (char *)service;
    ASSERT_OK(rpc_client_start(ch, path, &req.base, &grpc__health__v1__health_check_response__descriptor,
                               deadline_ms, on_msg, on_done, &r, &r.call));
    run_until(&r.done);
    return r;
}

static bool shut;
static void on_shutdown(void *ud)
{
    shut = true;
}

/* ------------------------------------------------------------------ cq_hook */

#define FAST_MARK 7
static _Atomic int hook_runs;       /* CQ thread */
static int handler_marks[4], n_handled, n_unmarked;

/* "fast": answered on the CQ thread; "deny": RESOURCE_EXHAUSTED + trailer there;
 * anything else: passed to the loop with a mark. */
static bool fast_hook(struct rpc_call *call, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)rpc_cq_request(call);
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    hook_runs++;
    if (!r)
        return false;
    if (strcmp(r->service, "fast") == 0) {
        resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
        rpc_cq_reply(call, &resp.base, RPC_OK, NULL, NULL, NULL);
        return true;
    }
    if (strcmp(r->service, "deny") == 0) {
        rpc_cq_reply(call, NULL, RPC_RESOURCE_EXHAUSTED, "denied on the CQ thread", "grpc-retry-pushback-ms", "100");
        return true;
    }
    rpc_cq_set_mark(call, FAST_MARK);
    return false;
}

static void fast_unmark(int mark, void *ud)
{
    ASSERT_EQ(mark, FAST_MARK);
    n_unmarked++;
}

static void h_fast(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    ASSERT_TRUE(strcmp(r->service, "fast") != 0 && strcmp(r->service, "deny") != 0);
    if (n_handled < 4)
        handler_marks[n_handled] = rpc_call_cq_mark(call);
    n_handled++;
    resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    ASSERT_OK(rpc_call_send(call, &resp.base));
    rpc_call_finish(call, RPC_OK, NULL);
}

static void start_on(struct rpc_channel *ch, const char *service, int64_t deadline_ms, struct result *r)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    ASSERT_OK(rpc_client_start(ch, CHECK_PATH, &req.base, &grpc__health__v1__health_check_response__descriptor,
                               deadline_ms, on_msg, on_done, r, &r->call));
}

/* Shut down and free a server on its own loop (sloop/sctx) and its client (cctx/ch):
 * no call may be left. */
static void server_teardown(struct rpc_server *srv, uv_loop_t *sloop, struct rpc_ctx *sctx,
                            struct rpc_ctx *cctx, struct rpc_channel *ch)
{
    shut = false;
    rpc_server_shutdown(srv, on_shutdown, NULL);
    while (!shut)
        uv_run(sloop, UV_RUN_ONCE);
    shut = false;
    rpc_server_destroy(srv);
    ASSERT_EQ(rpc_ctx_live_calls(sctx), 0);
    rpc_channel_destroy(ch);
    rpc_ctx_destroy(sctx);
    rpc_ctx_destroy(cctx);
    uv_run(sloop, UV_RUN_DEFAULT);
    uv_run(loop, UV_RUN_DEFAULT);
    ASSERT_OK(uv_loop_close(sloop));
}

/* The server's loop (sloop) is only run where said: everything the client gets
 * meanwhile was answered on the server's CQ thread. */
static void test_cq_hook(void)
{
    uv_loop_t sloop;
    struct rpc_ctx *sctx, *cctx;
    struct rpc_server *srv;
    struct rpc_channel *ch;
    char addr[64];
    int port;

    ASSERT_OK(uv_loop_init(&sloop));
    ASSERT_OK(rpc_ctx_create(&sloop, &sctx));
    ASSERT_OK(rpc_ctx_create(loop, &cctx));
    ASSERT_OK(rpc_server_create(sctx, NULL, &srv));
    struct rpc_method m = { CHECK_PATH, &grpc__health__v1__health_check_request__descriptor, false, false,
                            h_fast, NULL, 16, fast_hook, fast_unmark };
    ASSERT_OK(rpc_server_add_method(srv, &m));
    ASSERT_OK(rpc_server_listen(srv, "127.0.0.1:0", &port));
    ASSERT_OK(rpc_server_start(srv));
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    ASSERT_OK(rpc_channel_create(cctx, addr, NULL, &ch));

    /* 200 fast calls (more than the 16 kept requested, so the CQ thread re-requests)
     * and 50 denials, all answered while the server loop never runs */
    static struct result fr[250];
    for (int i = 0; i < 250; i++)
        start_on(ch, i < 200 ? "fast" : "deny", rpc_now_ms() + 10000, &fr[i]);
    for (int i = 0; i < 250; i++)
        run_until(&fr[i].done);
    for (int i = 0; i < 250; i++) {
        if (i < 200) {
            ASSERT_EQ(fr[i].status, RPC_OK);
            ASSERT_EQ(fr[i].msgs, 1);
            ASSERT_EQ(fr[i].last_status, 1);
        } else {
            ASSERT_EQ(fr[i].status, RPC_RESOURCE_EXHAUSTED);
            ASSERT_EQ(fr[i].msgs, 0);
            ASSERT_CONTAINS(fr[i].details, "denied on the CQ thread");
        }
    }
    ASSERT_EQ(hook_runs, 250);
    ASSERT_EQ(n_handled, 0);
    ASSERT_EQ(rpc_ctx_live_calls(sctx), 0);      /* never handed to the loop */

    /* a passed call waits for the loop; its handler sees the mark */
    struct result slow = { 0 };
    start_on(ch, "slow", rpc_now_ms() + 10000, &slow);
    while (hook_runs < 251)
        uv_run(loop, UV_RUN_NOWAIT);
    ASSERT_TRUE(!slow.done);
    while (!slow.done) {            /* the loop path needs the server loop (status after the message) */
        uv_run(&sloop, UV_RUN_NOWAIT);
        uv_run(loop, UV_RUN_NOWAIT);
    }
    ASSERT_EQ(slow.status, RPC_OK);
    ASSERT_EQ(slow.last_status, 2);
    ASSERT_EQ(handler_marks[0], FAST_MARK);

    /* a marked call whose deadline passes before the loop gets to it: the mark comes
     * back through cq_unmark, the handler never runs */
    struct result late = { 0 };
    int64_t late_start = rpc_now_ms();
    start_on(ch, "late", late_start + 150, &late);
    while (hook_runs < 252)
        uv_run(loop, UV_RUN_NOWAIT);
    run_until(&late.done);
    ASSERT_EQ(late.status, RPC_DEADLINE_EXCEEDED);
    /* the server's copy of the deadline is the client's remaining timeout counted from
     * when the call arrived, so it can fall a little after the client's: give it a
     * generous margin before the server loop sees the call (else, on a loaded box, the
     * handler runs and the mark is consumed normally) */
    while (rpc_now_ms() < late_start + 150 + 1000)
        uv_run(loop, UV_RUN_NOWAIT);
    {
        int64_t end = rpc_now_ms() + 10000;

        while (n_unmarked < 1) {
            ASSERT_TRUE(rpc_now_ms() < end);
            uv_run(&sloop, UV_RUN_NOWAIT);
        }
    }
    ASSERT_EQ(n_unmarked, 1);
    ASSERT_EQ(n_handled, 1);

    /* undecodable / invalid UTF-8 requests are left to the loop's usual answer */
    struct result bad = { 0 };
    start_on(ch, "bad\xff\xfe", rpc_now_ms() + 10000, &bad);
    while (!bad.done) {
        uv_run(&sloop, UV_RUN_NOWAIT);
        uv_run(loop, UV_RUN_NOWAIT);
    }
    ASSERT_EQ(bad.status, RPC_INVALID_ARGUMENT);
    ASSERT_EQ(n_handled, 1);

    server_teardown(srv, &sloop, sctx, cctx, ch);
    printf("test-rpc: cq_hook: 200 answers + 50 rejections with the server loop stopped; mark and unmark\n");
}

/* ------------------------------------------------------------------ own_cq */

#define BLOCK_PATH "/stepd.test.Block/Check"
static _Atomic int block_entered, block_left;
static bool block_release;
static pthread_mutex_t block_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t block_cv = PTHREAD_COND_INITIALIZER;

/* Holds the server's main CQ thread (what a long callback does) until the test
 * releases it, or 30 s; asleep meanwhile (no wake-ups: it never waits for a CPU). */
static bool block_hook(struct rpc_call *call, void *ud)
{
    struct timespec end;

    clock_gettime(CLOCK_REALTIME, &end);
    end.tv_sec += 30;
    block_entered = 1;
    pthread_mutex_lock(&block_mu);
    while (!block_release)
        if (pthread_cond_timedwait(&block_cv, &block_mu, &end) != 0)
            break;
    pthread_mutex_unlock(&block_mu);
    block_left = 1;
    rpc_cq_reply(call, NULL, RPC_NOT_FOUND, "held", NULL, NULL);
    return true;
}

/* "fast": SERVING; "pass": to the loop; anything else (loadgen's requests): NOT_FOUND */
static bool own_hook(struct rpc_call *call, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)rpc_cq_request(call);
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    if (!r || strcmp(r->service, "pass") == 0)
        return false;
    if (strcmp(r->service, "fast") != 0) {
        rpc_cq_reply(call, NULL, RPC_NOT_FOUND, "unknown service", NULL, NULL);
        return true;
    }
    resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    rpc_cq_reply(call, &resp.base, RPC_OK, NULL, NULL, NULL);
    return true;
}

/* loadgen (another process: in this one, any thread waiting in gRPC may read the
 * server's sockets) calling `method` n times with a deadline; per-call statuses to dump */
static pid_t spawn_loadgen(const char *bin, const char *addr, const char *method, int n, int deadline_s,
                           const char *dump)
{
    char ns[16], ds[16], env_dump[300];
    char *argv[] = { (char *)bin, "--addr", (char *)addr, "--method", (char *)method, "--streams", ns,
                     "--tokens", "1", "--deadline-s", ds, NULL };
    char *envp[] = { env_dump, NULL };
    pid_t pid;

    snprintf(ns, sizeof(ns), "%d", n);
    snprintf(ds, sizeof(ds), "%d", deadline_s);
    snprintf(env_dump, sizeof(env_dump), "LOADGEN_DUMP=%s", dump);
    posix_spawn_file_actions_t fa;

    ASSERT_OK(posix_spawn_file_actions_init(&fa));
    ASSERT_OK(posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0));
    ASSERT_OK(posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0));
    ASSERT_OK(posix_spawn(&pid, bin, &fa, NULL, argv, envp));
    posix_spawn_file_actions_destroy(&fa);
    return pid;
}

/* A method with its own CQ is answered while the main CQ thread is held: 20 Checks
 * from another process are read off the socket and answered by the second CQ's thread
 * (the held hook is released only after they all ended; with the main CQ they would
 * wait for it, and without the second thread's polling nobody would read them: their
 * 5 s deadlines would expire first). Calls of that method its hook passes on go to the
 * loop as usual, and the server shuts down cleanly with calls requested on both
 * queues. */
static void test_own_cq(void)
{
    const char *lg = getenv("LOADGEN_BIN");
    uv_loop_t sloop;
    struct rpc_ctx *sctx, *cctx;
    struct rpc_server *srv;
    struct rpc_channel *ch;
    char addr[64], dump[64], line[256];
    int port, st, n = 0;

    ASSERT_OK(uv_loop_init(&sloop));
    ASSERT_OK(rpc_ctx_create(&sloop, &sctx));
    ASSERT_OK(rpc_server_create(sctx, NULL, &srv));
    struct rpc_method mb = { BLOCK_PATH, &grpc__health__v1__health_check_request__descriptor, false, false,
                             h_check, NULL, 4, block_hook, NULL };
    struct rpc_method mo = { CHECK_PATH, &grpc__health__v1__health_check_request__descriptor, false, false,
                             h_check, NULL, 4, own_hook, NULL, true };
    struct rpc_method bad = { "/x/y", &grpc__health__v1__health_check_request__descriptor, false, false,
                              h_check, NULL, 4, NULL, NULL, true };
    ASSERT_EQ(rpc_server_add_method(srv, &bad), -EINVAL);      /* own_cq needs a cq_hook */
    ASSERT_OK(rpc_server_add_method(srv, &mb));
    ASSERT_OK(rpc_server_add_method(srv, &mo));
    ASSERT_OK(rpc_server_listen(srv, "127.0.0.1:0", &port));
    ASSERT_OK(rpc_server_start(srv));
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);

    if (lg && lg[0]) {
        pid_t held = spawn_loadgen(lg, addr, BLOCK_PATH, 1, 60, "/dev/null");
        int64_t end = rpc_now_ms() + 20000;

        while (!block_entered) {
            ASSERT_TRUE(rpc_now_ms() < end);
            usleep(1000);
        }
        snprintf(dump, sizeof(dump), "/tmp/test-rpc-own-cq.%d", (int)getpid());
        pid_t checks = spawn_loadgen(lg, addr, CHECK_PATH, 20, 5, dump);
        ASSERT_EQ(waitpid(checks, &st, 0), checks);
        ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        ASSERT_TRUE(!block_left);       /* all ended while the main CQ thread was held */
        FILE *f = fopen(dump, "r");
        ASSERT_TRUE(f != NULL);
        while (fgets(line, sizeof(line), f)) {
            int idx, status;
            ASSERT_EQ(sscanf(line, "%d %d", &idx, &status), 2);
            ASSERT_EQ(status, RPC_NOT_FOUND);       /* answered, not DEADLINE_EXCEEDED */
            n++;
        }
        fclose(f);
        unlink(dump);
        ASSERT_EQ(n, 20);
        pthread_mutex_lock(&block_mu);
        block_release = true;
        pthread_cond_signal(&block_cv);
        pthread_mutex_unlock(&block_mu);
        ASSERT_EQ(waitpid(held, &st, 0), held);
    } else {
        printf("test-rpc: own_cq: LOADGEN_BIN not set, the out-of-process part is skipped\n");
    }

    /* in process: a Check answered on the second CQ, and a passed-on call handled on the
     * server's loop */
    ASSERT_OK(rpc_ctx_create(loop, &cctx));
    ASSERT_OK(rpc_channel_create(cctx, addr, NULL, &ch));
    struct result fast = { 0 }, passed = { 0 };
    start_on(ch, "fast", rpc_now_ms() + 10000, &fast);
    run_until(&fast.done);
    ASSERT_EQ(fast.status, RPC_OK);
    ASSERT_EQ(fast.last_status, 1);
    start_on(ch, "pass", rpc_now_ms() + 10000, &passed);
    while (!passed.done) {
        uv_run(&sloop, UV_RUN_NOWAIT);
        uv_run(loop, UV_RUN_NOWAIT);
    }
    ASSERT_EQ(passed.status, RPC_NOT_FOUND);    /* h_check: service "pass" is unknown */

    server_teardown(srv, &sloop, sctx, cctx, ch);
    printf("test-rpc: own_cq: %d Checks from another process answered while the main CQ thread was held; "
           "passed-on call on the loop\n", n);
}

/* ------------------------------------------------------------------ rpc_ctx_run */

#define RUN_MSGS 300
static struct {
    uv_loop_t loop;
    struct rpc_ctx *ctx;
    struct rpc_server *srv;
    struct rpc_channel *ch;
    uv_timer_t guard, spin, next, last, srvt;
    struct rpc_call *late;
    pthread_t main_thread;
    _Atomic int in_cb;              /* set while any callback of this test runs */
    int msgs, msgs_off_loop, out_of_order, spins;
    bool late_off_loop;
    bool stream_done, check_done, shut;
    int stream_status, check_status;
    struct rpc_ctx_stats st;
} rr;

/* every callback of this test: no two may overlap (the loop lock) */
static void rr_enter(void)
{
    ASSERT_EQ(atomic_exchange(&rr.in_cb, 1), 0);
}

static void rr_leave(void)
{
    atomic_store(&rr.in_cb, 0);
}

/* loop thread, 20 ms after the "late" call started: its last message and status */
static void rr_late_cb(uv_timer_t *t)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    rr_enter();
    resp.status = 3;
    ASSERT_OK(rpc_call_send(rr.late, &resp.base));
    rpc_call_finish(rr.late, RPC_OK, NULL);
    rr.late = NULL;
    rr_leave();
}

static void rr_h_stream(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    rr_enter();
    if (strcmp(r->service, "late") == 0) {
        resp.status = 1;
        ASSERT_OK(rpc_call_send(call, &resp.base));
        rr.late = call;
        uv_timer_start(&rr.srvt, rr_late_cb, 20, 0);
        rr_leave();
        return;
    }
    for (int i = 0; i < RUN_MSGS; i++) {
        resp.status = i % 4;
        ASSERT_OK(rpc_call_send(call, &resp.base));
    }
    rpc_call_finish(call, RPC_OK, NULL);
    rr_leave();
}

static void rr_after_check(uv_timer_t *t);

static void rr_on_msg(struct rpc_client_call *c, const ProtobufCMessage *m, void *ud)
{
    const Grpc__Health__V1__HealthCheckResponse *resp = (const void *)m;

    rr_enter();
    if (ud == &rr.stream_done) {
        if ((int)resp->status != rr.msgs % 4)
            rr.out_of_order++;
        rr.msgs++;
        if (!pthread_equal(pthread_self(), rr.main_thread))
            rr.msgs_off_loop++;
    } else if (resp->status == 3) {
        /* the late message arrives while the loop waits for the 30 s guard only, so
         * this likely runs on the CQ thread: the timer must wake the loop */
        if (!pthread_equal(pthread_self(), rr.main_thread))
            rr.late_off_loop = true;
        uv_timer_start(&rr.next, rr_after_check, 1, 0);
    }
    rr_leave();
}

/* while the stream runs the loop thread is busy every millisecond: overlaps with
 * callbacks on the CQ thread would trip rr_enter */
static void rr_spin_cb(uv_timer_t *t)
{
    rr_enter();
    ASSERT_TRUE(pthread_equal(pthread_self(), rr.main_thread));
    int64_t end = rpc_now_us() + 200;
    while (rpc_now_us() < end)
        ;
    rr.spins++;
    rr_leave();
}

static void rr_guard_cb(uv_timer_t *t)
{
    /* reached only if a timer started by a callback on the CQ thread did not wake
     * the loop, which waited for this 30 s timer instead */
    fprintf(stderr, "test-rpc: rpc_ctx_run did not wake the loop for a timer started on the CQ thread\n");
    ASSERT_TRUE(false);
}

static void rr_shut_cb(void *ud)
{
    rr_enter();
    rr.shut = true;
    uv_timer_start(&rr.last, (uv_timer_cb)ud, 0, 0);
    rr_leave();
}

static void rr_close(uv_timer_t *t)
{
    rr_enter();
    ASSERT_TRUE(pthread_equal(pthread_self(), rr.main_thread));
    rpc_server_destroy(rr.srv);
    rpc_channel_destroy(rr.ch);
    ASSERT_EQ(rpc_ctx_live_calls(rr.ctx), 0);
    rpc_ctx_stats(rr.ctx, &rr.st);
    uv_close((uv_handle_t *)&rr.guard, NULL);
    uv_close((uv_handle_t *)&rr.spin, NULL);
    uv_close((uv_handle_t *)&rr.next, NULL);
    uv_close((uv_handle_t *)&rr.last, NULL);
    uv_close((uv_handle_t *)&rr.srvt, NULL);
    rpc_ctx_destroy(rr.ctx);   /* inside rpc_ctx_run: freed when it returns */
    rr_leave();
}

static void rr_after_check(uv_timer_t *t)
{
    rr_enter();
    if (!rr.check_done) {           /* its on_done runs on the loop thread, maybe later */
        uv_timer_start(&rr.next, rr_after_check, 1, 0);
        rr_leave();
        return;
    }
    rpc_server_shutdown(rr.srv, rr_shut_cb, (void *)rr_close);
    rr_leave();
}

static void rr_on_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    rr_enter();
    if (ud == &rr.stream_done) {
        rr.stream_done = true;
        rr.stream_status = status;
    } else {
        rr.check_done = true;
        rr.check_status = status;
    }
    rr_leave();
}

/* loop thread: the stream is over; one unary call, its completion starts a timer */
static void rr_start_check(uv_timer_t *t)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;

    rr_enter();
    if (!rr.stream_done) {
        rr_leave();
        return;
    }
    uv_timer_stop(&rr.spin);
    uv_timer_stop(&rr.next);
    req.service = "late";
    ASSERT_OK(rpc_client_start(rr.ch, WATCH_PATH, &req.base, &grpc__health__v1__health_check_response__descriptor,
                               0, rr_on_msg, rr_on_done, &rr.check_done, NULL));
    rr_leave();
}

static void test_ctx_run(void)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    char addr[64];
    int port;

    rr.main_thread = pthread_self();
    ASSERT_OK(uv_loop_init(&rr.loop));
    ASSERT_OK(rpc_ctx_create(&rr.loop, &rr.ctx));
    ASSERT_OK(rpc_server_create(rr.ctx, NULL, &rr.srv));
    struct rpc_method mw = { WATCH_PATH, &grpc__health__v1__health_check_request__descriptor, true,
                             false, rr_h_stream, NULL };
    ASSERT_OK(rpc_server_add_method(rr.srv, &mw));
    ASSERT_OK(rpc_server_listen(rr.srv, "127.0.0.1:0", &port));
    ASSERT_OK(rpc_server_start(rr.srv));
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    ASSERT_OK(rpc_channel_create(rr.ctx, addr, NULL, &rr.ch));
    uv_timer_init(&rr.loop, &rr.guard);
    uv_timer_init(&rr.loop, &rr.spin);
    uv_timer_init(&rr.loop, &rr.next);
    uv_timer_init(&rr.loop, &rr.last);
    uv_timer_init(&rr.loop, &rr.srvt);
    uv_timer_start(&rr.guard, rr_guard_cb, 30000, 0);
    uv_timer_start(&rr.spin, rr_spin_cb, 1, 1);
    uv_timer_start(&rr.next, rr_start_check, 5, 5);
    req.service = "stream";
    ASSERT_OK(rpc_client_start(rr.ch, WATCH_PATH, &req.base, &grpc__health__v1__health_check_response__descriptor,
                               0, rr_on_msg, rr_on_done, &rr.stream_done, NULL));
    ASSERT_OK(rpc_ctx_run(rr.ctx));   /* returns once everything is closed */
    ASSERT_EQ(uv_loop_close(&rr.loop), 0);
    ASSERT_EQ(rr.stream_status, RPC_OK);
    ASSERT_EQ(rr.msgs, RUN_MSGS);
    ASSERT_EQ(rr.out_of_order, 0);
    ASSERT_EQ(rr.check_status, RPC_OK);
    ASSERT_TRUE(rr.shut);
    /* the point of rpc_ctx_run: completions were dispatched on the CQ thread (which
     * ones depends on timing: an event waits in the queue while the loop is busy) */
    ASSERT_TRUE(rr.st.direct > 0);
    printf("test-rpc: rpc_ctx_run: %d messages (%d on the CQ thread), %d loop spins; late message on the %s "
           "thread; events %llu direct, %llu queued, %llu wake-ups\n", rr.msgs, rr.msgs_off_loop, rr.spins,
           rr.late_off_loop ? "CQ" : "loop", (unsigned long long)rr.st.direct,
           (unsigned long long)rr.st.queued, (unsigned long long)rr.st.wakes);
}

/* ------------------------------------------------------------------ cork */

struct fan_result {
    bool done;
    int status;
    int msgs;
    int seq[4];
};

static void fan_on_msg(struct rpc_client_call *c, const ProtobufCMessage *m, void *ud)
{
    struct fan_result *r = ud;
    const Grpc__Health__V1__HealthCheckResponse *resp = (const void *)m;
    if (r->msgs < 4)
        r->seq[r->msgs] = resp->status;
    r->msgs++;
}

static void fan_on_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct fan_result *r = ud;
    r->done = true;
    r->status = status;
}

/* FAN_N streaming calls; one pass answers them all (three messages and OK for even
 * ones, one message and ABORTED for odd ones) between rpc_ctx_cork() and
 * rpc_ctx_uncork(), nested once: nothing starts before the outer uncork, then each
 * call's first send is one held send, and every client gets its messages in order
 * and its status. With and without the sender thread. */
static void test_cork(struct rpc_ctx *ctx, struct rpc_channel *ch, bool sender)
{
    static struct fan_result res[FAN_N];
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    struct rpc_ctx_stats st0, st1;

    req.service = "fan0";
    ASSERT_OK(rpc_ctx_set_sender(ctx, sender));
    memset(res, 0, sizeof(res));
    n_fan = 0;
    for (int i = 0; i < FAN_N; i++, req.service = i % 2 ? "fan1" : "fan0")
        ASSERT_OK(rpc_client_start(ch, WATCH_PATH, &req.base, &grpc__health__v1__health_check_response__descriptor,
                                   0, fan_on_msg, fan_on_done, &res[i], NULL));
    int64_t end = rpc_now_ms() + 10000;
    while (n_fan < FAN_N) {
        ASSERT_TRUE(rpc_now_ms() < end);
        uv_run(loop, UV_RUN_ONCE);
    }
    rpc_ctx_stats(ctx, &st0);
    rpc_ctx_cork(ctx);
    rpc_ctx_cork(ctx);
    for (int i = 0; i < FAN_N; i++) {
        for (int k = 0; k < (fan_odd[i] ? 1 : 3); k++) {
            resp.status = 1 + k;
            ASSERT_OK(rpc_call_send(fan[i], &resp.base));
        }
        if (fan_odd[i])
            rpc_call_finish(fan[i], RPC_ABORTED, "odd");
        else
            rpc_call_finish(fan[i], RPC_OK, NULL);
    }
    rpc_ctx_uncork(ctx);
    rpc_ctx_stats(ctx, &st1);
    ASSERT_EQ(st1.corked_sends, st0.corked_sends);      /* still held (nested) */
    ASSERT_EQ(st1.corked_batches, st0.corked_batches);
    usleep(20000);
    for (int i = 0; i < 3; i++)
        uv_run(loop, UV_RUN_NOWAIT);
    for (int i = 0; i < FAN_N; i++)
        ASSERT_EQ(res[i].msgs, 0);                          /* nothing went out */
    rpc_ctx_uncork(ctx);
    rpc_ctx_stats(ctx, &st1);
    ASSERT_EQ(st1.corked_sends - st0.corked_sends, FAN_N);
    ASSERT_EQ(st1.corked_batches - st0.corked_batches, 1);
    uint64_t by_sender = st1.sender_sends - st0.sender_sends;
    if (!sender)
        ASSERT_EQ(by_sender, 0);
    for (int i = 0; i < FAN_N; i++) {
        run_until(&res[i].done);
        if (i % 2) {
            ASSERT_EQ(res[i].status, RPC_ABORTED);
            ASSERT_EQ(res[i].msgs, 1);
        } else {
            ASSERT_EQ(res[i].status, RPC_OK);
            ASSERT_EQ(res[i].msgs, 3);
            ASSERT_EQ(res[i].seq[1], 2);
            ASSERT_EQ(res[i].seq[2], 3);
        }
        ASSERT_EQ(res[i].seq[0], 1);
    }
    /* sends outside a cork start at once */
    rpc_ctx_stats(ctx, &st0);
    struct result r = call(ch, WATCH_PATH, "five", 0, 0);
    ASSERT_EQ(r.status, RPC_OK);
    ASSERT_EQ(r.msgs, 5);
    rpc_ctx_stats(ctx, &st1);
    ASSERT_EQ(st1.corked_sends, st0.corked_sends);
    printf("test-rpc: cork (sender thread %s): %d calls answered in one uncork, %" PRIu64
           " sends started by the sender thread\n", sender ? "on" : "off", FAN_N, by_sender);
}

int main(void)
{
    struct rpc_ctx *ctx;
    struct rpc_server *srv, *srv_key;
    struct rpc_channel *ch, *ch_key, *ch_badkey;
    int port, port_key;
    char addr[64];

    setvbuf(stdout, NULL, _IOLBF, 0);
    loop = uv_default_loop();
    test_ctx_run();
    test_cq_hook();
    test_own_cq();
    ASSERT_OK(rpc_ctx_create(loop, &ctx));

    struct rpc_server_opts o = { .max_recv_msg_bytes = 1024 };
    ASSERT_OK(rpc_server_create(ctx, &o, &srv));
    struct rpc_method mc = { CHECK_PATH, &grpc__health__v1__health_check_request__descriptor, false,
                             false, h_check, NULL };
    struct rpc_method mw = { WATCH_PATH, &grpc__health__v1__health_check_request__descriptor, true,
                             false, h_watch, NULL };
    ASSERT_OK(rpc_server_add_method(srv, &mc));
    ASSERT_OK(rpc_server_add_method(srv, &mw));
    ASSERT_OK(rpc_server_listen(srv, "127.0.0.1:0", &port));
    ASSERT_OK(rpc_server_start(srv));

    struct rpc_server_opts ok = { .api_key = "s3cret-Key" };
    ASSERT_OK(rpc_server_create(ctx, &ok, &srv_key));
    struct rpc_method mw_open = mw;
    mw_open.no_auth = true;
    ASSERT_OK(rpc_server_add_method(srv_key, &mc));
    ASSERT_OK(rpc_server_add_method(srv_key, &mw_open));
    ASSERT_OK(rpc_server_listen(srv_key, "127.0.0.1:0", &port_key));
    ASSERT_OK(rpc_server_start(srv_key));

    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    ASSERT_OK(rpc_channel_create(ctx, addr, NULL, &ch));

    test_cork(ctx, ch, false);
    test_cork(ctx, ch, true);
    test_cork(ctx, ch, true);

    /* unary */
    struct result r = call(ch, CHECK_PATH, "", 0, 0);
    ASSERT_EQ(r.status, RPC_OK);
    ASSERT_EQ(r.msgs, 1);
    ASSERT_EQ(r.last_status, 1);
    r = call(ch, CHECK_PATH, "nope", rpc_now_ms() + 5000, 0);
    ASSERT_EQ(r.status, RPC_NOT_FOUND);
    ASSERT_CONTAINS(r.details, "unknown service 'nope'");
    /* streaming */
    r = call(ch, WATCH_PATH, "five", 0, 0);
    ASSERT_EQ(r.status, RPC_OK);
    ASSERT_EQ(r.msgs, 5);
    /* a response that does not decode as the expected message (a varint where a string
     * is due): INTERNAL naming it, and the call ends (its status is asked for then) */
    {
        Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        struct result rb = { 0 };
        req.service = "";
        ASSERT_OK(rpc_client_start(ch, CHECK_PATH, &req.base, &grpc__health__v1__health_check_request__descriptor,
                                   0, on_msg, on_done, &rb, &rb.call));
        run_until(&rb.done);
        ASSERT_EQ(rb.status, RPC_INTERNAL);
        ASSERT_EQ(rb.msgs, 0);
        ASSERT_CONTAINS(rb.details, "could not be decoded");
    }
    /* client cancel mid-stream -> server cancel callback */
    r = call(ch, WATCH_PATH, "hang", 0, 1);
    ASSERT_EQ(r.status, RPC_CANCELLED);
    while (server_cancels < 1)
        uv_run(loop, UV_RUN_ONCE);
    ASSERT_EQ(server_cancels, 1);
    /* deadline -> DEADLINE_EXCEEDED on the client, cancel callback on the server */
    int64_t t0 = rpc_now_ms();
    r = call(ch, WATCH_PATH, "hang", t0 + 200, 0);
    ASSERT_EQ(r.status, RPC_DEADLINE_EXCEEDED);
    ASSERT_TRUE(rpc_now_ms() - t0 >= 190);
    while (server_cancels < 2)
        uv_run(loop, UV_RUN_ONCE);
    /* unknown method */
    r = call(ch, "/nope.Svc/Nothing", "", 0, 0);
    ASSERT_EQ(r.status, RPC_UNIMPLEMENTED);
    /* over the 1 KiB receive limit, then the channel still works */
    char big[2048];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    r = call(ch, CHECK_PATH, big, 0, 0);
    ASSERT_EQ(r.status, RPC_RESOURCE_EXHAUSTED);
    r = call(ch, CHECK_PATH, "", 0, 0);
    ASSERT_EQ(r.status, RPC_OK);
    /* invalid UTF-8 in a string field */
    r = call(ch, CHECK_PATH, "bad\xff\xfe", 0, 0);
    ASSERT_EQ(r.status, RPC_INVALID_ARGUMENT);
    ASSERT_CONTAINS(r.details, "service");

    /* API key */
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port_key);
    rpc_channel_destroy(ch);
    ASSERT_OK(rpc_channel_create(ctx, addr, NULL, &ch));
    struct rpc_channel_opts good = { .api_key = "s3cret-Key" }, bad = { .api_key = "s3cret-key" };
    ASSERT_OK(rpc_channel_create(ctx, addr, &good, &ch_key));
    ASSERT_OK(rpc_channel_create(ctx, addr, &bad, &ch_badkey));
    r = call(ch, CHECK_PATH, "", 0, 0);
    ASSERT_EQ(r.status, RPC_UNAUTHENTICATED);
    r = call(ch_badkey, CHECK_PATH, "", 0, 0);
    ASSERT_EQ(r.status, RPC_UNAUTHENTICATED);
    r = call(ch_key, CHECK_PATH, "", 0, 0);
    ASSERT_EQ(r.status, RPC_OK);
    r = call(ch, WATCH_PATH, "five", 0, 0);  /* no_auth method */
    ASSERT_EQ(r.status, RPC_OK);
    ASSERT_EQ(r.msgs, 5);

    ASSERT_TRUE(rpc_secret_equal("abc", "abc"));
    ASSERT_TRUE(!rpc_secret_equal("abc", "abd"));
    ASSERT_TRUE(!rpc_secret_equal("abc", "abcd"));
    ASSERT_TRUE(!rpc_secret_equal("abc", ""));

    /* shutdown: a hanging call is cancelled by cancel_all */
    struct result hr = { 0 };
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = "hang";
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    struct rpc_channel *ch2;
    ASSERT_OK(rpc_channel_create(ctx, addr, NULL, &ch2));
    ASSERT_OK(rpc_client_start(ch2, WATCH_PATH, &req.base, &grpc__health__v1__health_check_response__descriptor,
                               0, on_msg, on_done, &hr, NULL));
    while (hr.msgs < 1)
        uv_run(loop, UV_RUN_ONCE);
    rpc_server_shutdown(srv, on_shutdown, NULL);
    rpc_server_cancel_all(srv);
    run_until(&shut);
    run_until(&hr.done);
    ASSERT_EQ(server_cancels, 3);
    shut = false;
    rpc_server_shutdown(srv_key, on_shutdown, NULL);
    run_until(&shut);
    rpc_server_destroy(srv);
    rpc_server_destroy(srv_key);
    ASSERT_EQ(rpc_ctx_live_calls(ctx), 0);
    rpc_channel_destroy(ch);
    rpc_channel_destroy(ch2);
    rpc_channel_destroy(ch_key);
    rpc_channel_destroy(ch_badkey);
    rpc_ctx_destroy(ctx);
    uv_run(loop, UV_RUN_DEFAULT);
    printf("test-rpc: all checks passed\n");
    return 0;
}
