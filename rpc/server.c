/* server.c - server set-up: credentials and limits, registered methods and their request
 * slots, listen, start, shutdown. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "err.h"
#include "file.h"
#include "log.h"
#include "rpc-int.h"
#include <grpc/grpc_security.h>

static int slot_request(struct rpc_slot *sl)
{
    struct rpc_server *s = sl->s;
    struct reg_method *rm = sl->rm;
    grpc_call_error e;

    sl->call = NULL;
    sl->payload = NULL;
    grpc_metadata_array_init(&sl->md);
    if (rm) {
        grpc_completion_queue *cq = rm->m.own_cq ? s->ctx->pcq : s->ctx->cq;
        e = grpc_server_request_registered_call(s->srv, rm->handle, &sl->call, &sl->deadline, &sl->md,
                                                rm->m.req_desc ? &sl->payload : NULL, cq, cq, &sl->op);
    } else {
        grpc_call_details_init(&sl->details);
        e = grpc_server_request_call(s->srv, &sl->call, &sl->details, &sl->md, s->ctx->cq, s->ctx->cq,
                                     &sl->op);
    }
    if (e != GRPC_CALL_OK) {
        log_error("rpc: request_call failed: %d", (int)e);
        grpc_metadata_array_destroy(&sl->md);
        if (!rm)
            grpc_call_details_destroy(&sl->details);
        return -EIO;
    }
    s->requested++;
    return 0;
}

/* Request every free slot of the pool once half of them are free (req_mu held). */
static void pool_refill_locked(struct rpc_server *s, struct slot_pool *p)
{
    if (s->shutting_down || p->n - p->n_free > p->n / 2)
        return;
    while (p->free) {
        struct rpc_slot *sl = p->free;
        if (slot_request(sl) < 0)
            break;
        p->free = sl->next;
        p->n_free--;
    }
}

/* Give a slot whose tag came back to its pool (either thread). */
void rpc__slot_put(struct rpc_slot *sl)
{
    struct rpc_server *s = sl->s;
    struct slot_pool *p = sl->pool;

    sl->call = NULL;
    sl->payload = NULL;
    pthread_mutex_lock(&s->req_mu);
    sl->next = p->free;
    p->free = sl;
    p->n_free++;
    pool_refill_locked(s, p);
    pthread_mutex_unlock(&s->req_mu);
    s->requested--;                    /* last: rpc_server_destroy waits for 0 */
}

static int pool_start(struct rpc_server *s, struct slot_pool *p, struct reg_method *rm, int n)
{
    p->slots = calloc((size_t)n, sizeof(*p->slots));
    if (!p->slots)
        return -ENOMEM;
    p->n = n;
    for (int i = n - 1; i >= 0; i--) {
        struct rpc_slot *sl = &p->slots[i];
        sl->s = s;
        sl->rm = rm;
        sl->pool = p;
        sl->op.fn = rpc__slot_on_new;
        if (rm && rm->m.cq_hook)
            sl->op.cq_fn = rpc__slot_new_cq;
        sl->next = p->free;
        p->free = sl;
        p->n_free++;
    }
    pthread_mutex_lock(&s->req_mu);
    pool_refill_locked(s, p);
    pthread_mutex_unlock(&s->req_mu);
    return 0;
}

/* A positive millisecond count from the environment variable name into *ms (left as it is
 * when name is unset); -EINVAL with one line when it is set to anything else. */
static int env_ms(const char *name, int *ms)
{
    const char *v = getenv(name);
    char *end;
    long n;

    if (!v)
        return 0;
    errno = 0;
    n = strtol(v, &end, 10);
    if (errno || end == v || *end || n < 1 || n > INT32_MAX) {
        log_error("rpc: $%s: %s is not a positive number of milliseconds", name, v);
        return -EINVAL;
    }
    *ms = (int)n;
    return 0;
}

int rpc_server_create(struct rpc_ctx *ctx, const struct rpc_server_opts *opts, struct rpc_server **ret)
{
    struct rpc_server *s = calloc(1, sizeof(*s));
    char *cert = NULL, *key = NULL, *root = NULL;
    int r = 0;

    if (!s)
        return -ENOMEM;
    s->ctx = ctx;
    pthread_mutex_init(&s->req_mu, NULL);
    if (opts)
        s->opts = *opts;
#define DEF(f, v) if (s->opts.f <= 0) s->opts.f = (v)
    DEF(max_recv_msg_bytes, 4 << 20);
    DEF(max_concurrent_streams, 1024);
    DEF(max_metadata_bytes, 16 << 10);
    DEF(keepalive_time_ms, 60000);
    DEF(keepalive_timeout_ms, 20000);
    DEF(min_ping_interval_ms, 10000);
    DEF(max_ping_strikes, 2);
    DEF(requests_per_method, 8);
    DEF(max_connection_age_grace_ms, 900 * 1000);
#undef DEF
    if (s->opts.max_connection_age_ms > 0 &&
        ((r = env_ms("STEPD_GRPC_MAX_CONNECTION_AGE_MS", &s->opts.max_connection_age_ms)) < 0 ||
         (r = env_ms("STEPD_GRPC_MAX_CONNECTION_AGE_GRACE_MS", &s->opts.max_connection_age_grace_ms)) < 0))
        goto fail;
    if (s->opts.max_call_buffer_bytes == 0)
        s->opts.max_call_buffer_bytes = 1 << 20;
    if (opts && opts->api_key && opts->api_key[0]) {
        s->api_key = strdup(opts->api_key);
        if (!s->api_key) {
            r = -ENOMEM;
            goto fail;
        }
    }
    s->opts.api_key = NULL;
    s->opts.tls = NULL;

    if (opts && opts->tls) {
        const struct rpc_tls_files *t = opts->tls;
        if (!t->cert_file || !t->key_file) {
            log_error("rpc: TLS needs both a certificate and a key file");
            r = -EINVAL;
            goto fail;
        }
        if (t->require_client_cert && !t->root_file) {
            log_error("rpc: requiring client certificates needs a CA bundle (--tls-client-ca); "
                      "without it gRPC would silently skip client verification");
            r = -EINVAL;
            goto fail;
        }
        if ((r = file_read_all(t->cert_file, 16u << 20, 0, &cert, NULL)) < 0) {
            log_error("rpc: %s: %s", t->cert_file, strerror(-r));
            goto fail;
        }
        if ((r = file_read_all(t->key_file, 16u << 20, 0, &key, NULL)) < 0) {
            log_error("rpc: %s: %s", t->key_file, strerror(-r));
            goto fail;
        }
        if (t->root_file && (r = file_read_all(t->root_file, 16u << 20, 0, &root, NULL)) < 0) {
            log_error("rpc: %s: %s", t->root_file, strerror(-r));
            goto fail;
        }
        grpc_ssl_pem_key_cert_pair pair = { .private_key = key, .cert_chain = cert };
        s->creds = grpc_ssl_server_credentials_create_ex(
            root, &pair, 1,
            t->require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        if (!s->creds) {
            log_error("rpc: could not create TLS server credentials from %s / %s", t->cert_file,
                      t->key_file);
            r = -EINVAL;
            goto fail;
        }
    } else {
        s->creds = grpc_insecure_server_credentials_create();
    }

    grpc_arg args[] = {
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, { .integer = s->opts.max_recv_msg_bytes } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, { .integer = -1 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONCURRENT_STREAMS, { .integer = s->opts.max_concurrent_streams } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_METADATA_SIZE, { .integer = s->opts.max_metadata_bytes } },
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, { .integer = s->opts.keepalive_time_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, { .integer = s->opts.keepalive_timeout_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
          { .integer = s->opts.min_ping_interval_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PING_STRIKES, { .integer = s->opts.max_ping_strikes } },
        { GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, { .integer = 0 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONNECTION_AGE_MS, { .integer = s->opts.max_connection_age_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
          { .integer = s->opts.max_connection_age_grace_ms } },
    };
    size_t nargs = sizeof(args) / sizeof(args[0]) - (s->opts.max_connection_age_ms > 0 ? 0 : 2);
    grpc_channel_args ca = { .num_args = nargs, .args = args };
    s->srv = grpc_server_create(&ca, NULL);
    grpc_server_register_completion_queue(s->srv, ctx->cq, NULL);
    *ret = s;
    r = 0;
    goto cleanup;
fail:
    if (s->creds)
        grpc_server_credentials_release(s->creds);
    free(s->api_key);
    pthread_mutex_destroy(&s->req_mu);
    free(s);
cleanup:
    free(cert);
    if (key) {
        memset(key, 0, strlen(key));
        free(key);
    }
    free(root);
    return r;
}

int rpc_server_add_method(struct rpc_server *s, const struct rpc_method *m)
{
    if (s->started || !m->path || !m->req_desc || !m->handler || (m->own_cq && !m->cq_hook))
        return -EINVAL;
    if (m->own_cq && !s->ctx->pthread_started) {
        struct rpc_ctx *ctx = s->ctx;
        grpc_completion_queue_attributes np = { GRPC_CQ_CURRENT_VERSION, GRPC_CQ_NEXT, GRPC_CQ_NON_POLLING, NULL };
        int r;

        ctx->pcq = grpc_completion_queue_create(grpc_completion_queue_factory_lookup(&np), &np, NULL);
        ctx->poll_cq = grpc_completion_queue_create_for_next(NULL);
        r = -pthread_create(&ctx->pthread, NULL, rpc__pcq_thread_main, ctx);
        if (r < 0) {
            grpc_completion_queue_destroy(ctx->pcq);
            grpc_completion_queue_destroy(ctx->poll_cq);
            ctx->pcq = ctx->poll_cq = NULL;
            return r;
        }
        ctx->pthread_started = true;
    }
    if (m->own_cq && !s->pcq_registered) {
        /* poll_cq too: with a poller that keeps fds per pollset (not epoll1), it must be
         * one of the server's pollsets to see its connections */
        grpc_server_register_completion_queue(s->srv, s->ctx->pcq, NULL);
        grpc_server_register_completion_queue(s->srv, s->ctx->poll_cq, NULL);
        s->pcq_registered = true;
    }
    struct reg_method *n = realloc(s->methods, (s->n_methods + 1) * sizeof(*n));
    if (!n)
        return -ENOMEM;
    s->methods = n;
    /* realloc moved the array: pointers into it are taken only after start */
    struct reg_method *rm = &s->methods[s->n_methods++];
    memset(rm, 0, sizeof(*rm));
    rm->m = *m;
    rm->s = s;
    rm->handle = grpc_server_register_method(s->srv, m->path, NULL,
                                             GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!rm->handle) {
        s->n_methods--;
        return -EEXIST;
    }
    return 0;
}

int rpc_server_listen(struct rpc_server *s, const char *addr, int *ret_port)
{
    if (s->started)
        return -EINVAL;
    int port = grpc_server_add_http2_port(s->srv, addr, s->creds);
    if (port <= 0) {
        log_error("rpc: cannot listen on %s (address in use, bad address or permission)", addr);
        return -EADDRINUSE;
    }
    if (ret_port)
        *ret_port = port;
    return 0;
}

int rpc_server_start(struct rpc_server *s)
{
    if (s->started)
        return -EINVAL;
    grpc_server_start(s->srv);
    s->started = true;
    for (size_t i = 0; i < s->n_methods; i++) {
        int n = s->methods[i].m.requests > 0 ? s->methods[i].m.requests : s->opts.requests_per_method;
        if (pool_start(s, &s->methods[i].pool, &s->methods[i], n) < 0)
            return -ENOMEM;
    }
    /* unregistered methods -> UNIMPLEMENTED */
    return pool_start(s, &s->unreg_pool, NULL, 1);
}

static void server_on_shutdown(struct rpc_op *op, bool ok)
{
    struct rpc_server *s = (struct rpc_server *)((char *)op - offsetof(struct rpc_server, shutdown_op));
    s->shutdown_done = true;
    if (s->on_shutdown)
        s->on_shutdown(s->shutdown_ud);
}

void rpc_server_shutdown(struct rpc_server *s, void (*on_done)(void *ud), void *ud)
{
    if (s->shutting_down)
        return;
    pthread_mutex_lock(&s->req_mu);
    s->shutting_down = true;
    pthread_mutex_unlock(&s->req_mu);
    s->on_shutdown = on_done;
    s->shutdown_ud = ud;
    s->shutdown_op.fn = server_on_shutdown;
    grpc_server_shutdown_and_notify(s->srv, s->ctx->cq, &s->shutdown_op);
}

void rpc_server_cancel_all(struct rpc_server *s)
{
    grpc_server_cancel_all_calls(s->srv);
}

void rpc_server_destroy(struct rpc_server *s)
{
    if (!s)
        return;
    if (!s->shutting_down || !s->shutdown_done) {
        log_error("rpc: rpc_server_destroy before shutdown completed");
        abort();
    }
    /* the loop below waits for the CQ threads: never run it there (rpc_ctx_run) */
    BUG_ON(pthread_equal(pthread_self(), s->ctx->thread));
    BUG_ON(s->ctx->pthread_started && pthread_equal(pthread_self(), s->ctx->pthread));
    grpc_server_destroy(s->srv);
    /* Unused request tags come back failed on the CQ; process them now so their
     * memory is released before the server object goes away. */
    while (s->requested) {
        rpc__ctx_drain(s->ctx);
        if (s->requested)
            sched_yield();
    }
    grpc_server_credentials_release(s->creds);
    for (size_t i = 0; i < s->n_methods; i++)
        free(s->methods[i].pool.slots);
    free(s->unreg_pool.slots);
    free(s->methods);
    if (s->api_key) {
        memset(s->api_key, 0, strlen(s->api_key));
        free(s->api_key);
    }
    pthread_mutex_destroy(&s->req_mu);
    free(s);
}

