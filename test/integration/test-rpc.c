/* test-rpc.c - daemon/rpc glue over loopback: unary and streaming calls, cancel and
 * deadline callbacks, UNIMPLEMENTED, API key, message-size limit, UTF-8 check,
 * shutdown with no leaked calls. Uses the grpc.health.v1 messages as payloads. */
#include <stdio.h>
#include <string.h>

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

static void h_watch(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

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

int main(void)
{
    struct rpc_ctx *ctx;
    struct rpc_server *srv, *srv_key;
    struct rpc_channel *ch, *ch_key, *ch_badkey;
    int port, port_key;
    char addr[64];

    loop = uv_default_loop();
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
