/* client.c - client channels (credentials, keepalive, own connection) and calls (unary and
 * server streaming) completing on the loop thread. */
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
#include <grpc/byte_buffer_reader.h>

/* ------------------------------------------------------------------ client */

struct rpc_channel {
    struct rpc_ctx *ctx;
    grpc_channel *ch;
    char *target;
    char *auth;                 /* "Bearer <key>" or NULL */
    size_t live;
};

struct rpc_client_call {
    struct rpc_channel *ch;
    grpc_call *call;
    const ProtobufCMessageDescriptor *resp_desc;
    rpc_client_msg_fn on_msg;
    rpc_client_done_fn on_done;
    void *ud;
    struct rpc_op op_start, op_recv, op_status;
    grpc_metadata_array init_md, trail_md;
    grpc_byte_buffer *send_buf, *recv_buf;
    grpc_status_code status;
    grpc_slice details;
    grpc_metadata auth_md;
    bool start_pending, recv_pending, status_pending, bad_response, has_auth_md;
    bool status_posted;     /* RECV_STATUS asked for (once the messages have ended) */
};

int rpc_channel_create(struct rpc_ctx *ctx, const char *target, const struct rpc_channel_opts *opts,
                       struct rpc_channel **ret)
{
    struct rpc_channel *ch = calloc(1, sizeof(*ch));
    grpc_channel_credentials *creds = NULL;
    char *cert = NULL, *key = NULL, *root = NULL;
    struct rpc_channel_opts o = { 0 };
    int r = 0;

    if (!ch)
        return -ENOMEM;
    if (opts)
        o = *opts;
    ch->ctx = ctx;
    ch->target = strdup(target);
    if (!ch->target) {
        r = -ENOMEM;
        goto fail;
    }
    if (o.api_key && o.api_key[0]) {
        if (asprintf(&ch->auth, "Bearer %s", o.api_key) < 0) {
            ch->auth = NULL;
            r = -ENOMEM;
            goto fail;
        }
    }
    if (o.tls) {
        if (o.tls->root_file && (r = file_read_all(o.tls->root_file, 16u << 20, 0, &root, NULL)) < 0) {
            log_error("rpc: %s: %s", o.tls->root_file, strerror(-r));
            goto fail;
        }
        if (o.tls->cert_file && (r = file_read_all(o.tls->cert_file, 16u << 20, 0, &cert, NULL)) < 0) {
            log_error("rpc: %s: %s", o.tls->cert_file, strerror(-r));
            goto fail;
        }
        if (o.tls->key_file && (r = file_read_all(o.tls->key_file, 16u << 20, 0, &key, NULL)) < 0) {
            log_error("rpc: %s: %s", o.tls->key_file, strerror(-r));
            goto fail;
        }
        grpc_ssl_pem_key_cert_pair pair = { .private_key = key, .cert_chain = cert };
        creds = grpc_ssl_credentials_create(root, (cert && key) ? &pair : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (!creds) {
        r = -EINVAL;
        goto fail;
    }
    int ka = o.keepalive_time_ms == 0 ? 10000 : o.keepalive_time_ms < 0 ? INT32_MAX : o.keepalive_time_ms;
    grpc_arg args[8];
    size_t na = 0;
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, { .integer = ka } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             { .integer = o.keepalive_timeout_ms > 0 ? o.keepalive_timeout_ms : 5000 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             { .integer = o.keepalive_time_ms < 0 ? 0 : 1 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, { .integer = 0 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                             { .integer = o.max_recv_msg_bytes > 0 ? o.max_recv_msg_bytes : 4 << 20 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_RETRIES, { .integer = 0 } };
    if (o.ssl_target_name)
        args[na++] = (grpc_arg){ GRPC_ARG_STRING, GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                                 { .string = (char *)o.ssl_target_name } };
    if (o.own_connection)
        args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, { .integer = 1 } };
    grpc_channel_args ca = { .num_args = na, .args = args };
    ch->ch = grpc_channel_create(target, creds, &ca);
    grpc_channel_credentials_release(creds);
    if (!ch->ch) {
        r = -EINVAL;
        goto fail;
    }
    *ret = ch;
    r = 0;
    goto cleanup;
fail:
    free(ch->target);
    free(ch->auth);
    free(ch);
cleanup:
    free(cert);
    free(key);
    free(root);
    return r;
}

void rpc_channel_destroy(struct rpc_channel *ch)
{
    if (!ch)
        return;
    if (ch->live)
        log_warn("rpc: channel %s destroyed with %zu live calls", ch->target, ch->live);
    grpc_channel_destroy(ch->ch);
    free(ch->target);
    free(ch->auth);
    free(ch);
}

static void client_maybe_done(struct rpc_client_call *c)
{
    char details[1024];

    if (c->start_pending || c->recv_pending || c->status_pending || !c->status_posted)
        return;
    snprintf(details, sizeof(details), "%.*s", (int)GRPC_SLICE_LENGTH(c->details),
             (const char *)GRPC_SLICE_START_PTR(c->details));
    int st = (int)c->status;
    if (c->bad_response && st == RPC_OK)
        st = RPC_INTERNAL;
    /* the call no longer counts as live: on_done may destroy the channel */
    c->ch->live--;
    c->ch->ctx->live_calls--;
    c->ch = NULL;
    c->on_done(c, st, details, c->ud);
    grpc_slice_unref(c->details);
    grpc_metadata_array_destroy(&c->init_md);
    grpc_metadata_array_destroy(&c->trail_md);
    if (c->has_auth_md) {
        grpc_slice_unref(c->auth_md.key);
        grpc_slice_unref(c->auth_md.value);
    }
    grpc_call_unref(c->call);
    free(c);
}

/* The status is asked for only once the messages have ended (a read returned none, or
 * the call was cancelled): a RECV_STATUS posted with the call would be one more tag
 * outstanding on the CQ for the call's whole life, and a libgrpc built without NDEBUG
 * (Debian's) scans every outstanding tag on each completion. */
static void client_post_status(struct rpc_client_call *c)
{
    grpc_op op;

    if (c->status_posted)
        return;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &c->trail_md;
    op.data.recv_status_on_client.status = &c->status;
    op.data.recv_status_on_client.status_details = &c->details;
    c->status_posted = true;
    c->status_pending = true;
    grpc_call_error e = grpc_call_start_batch(c->call, &op, 1, &c->op_status, NULL);
    BUG_ON(e != GRPC_CALL_OK);
}

static void client_start_recv(struct rpc_client_call *c)
{
    grpc_op op;

    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    c->recv_pending = true;
    if (grpc_call_start_batch(c->call, &op, 1, &c->op_recv, NULL) != GRPC_CALL_OK) {
        c->recv_pending = false;
        client_post_status(c);
    }
}

static void client_on_recv(struct rpc_op *op, bool ok)
{
    struct rpc_client_call *c = (struct rpc_client_call *)((char *)op - offsetof(struct rpc_client_call, op_recv));

    c->recv_pending = false;
    if (ok && c->recv_buf) {
        ProtobufCMessage *m = rpc__bb_decode(c->recv_buf, c->resp_desc);
        grpc_byte_buffer_destroy(c->recv_buf);
        c->recv_buf = NULL;
        if (!m) {
            c->bad_response = true;
            grpc_call_cancel_with_status(c->call, GRPC_STATUS_INTERNAL,
                                         "response could not be decoded", NULL);
            client_post_status(c);
        } else {
            /* the next read is posted before the message is forwarded: gRPC can take
             * the next one in meanwhile (its completion runs after this callback) */
            client_start_recv(c);
            if (c->on_msg)
                c->on_msg(c, m, c->ud);
            protobuf_c_message_free_unpacked(m, NULL);
        }
    } else {
        if (c->recv_buf) {
            grpc_byte_buffer_destroy(c->recv_buf);
            c->recv_buf = NULL;
        }
        client_post_status(c);      /* the messages have ended */
    }
    client_maybe_done(c);
}

static void client_on_start(struct rpc_op *op, bool ok)
{
    struct rpc_client_call *c = (struct rpc_client_call *)((char *)op - offsetof(struct rpc_client_call, op_start));
    c->start_pending = false;
    if (c->send_buf) {
        grpc_byte_buffer_destroy(c->send_buf);
        c->send_buf = NULL;
    }
    client_maybe_done(c);
}

static void client_on_status(struct rpc_op *op, bool ok)
{
    struct rpc_client_call *c = (struct rpc_client_call *)((char *)op - offsetof(struct rpc_client_call, op_status));
    c->status_pending = false;
    client_maybe_done(c);
}

int rpc_client_start(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *resp_desc, int64_t deadline_ms,
                     rpc_client_msg_fn on_msg, rpc_client_done_fn on_done, void *ud,
                     struct rpc_client_call **ret)
{
    struct rpc_client_call *c;
    grpc_op ops[4];
    size_t n = 0;

    if (!on_done || !req || !resp_desc)
        return -EINVAL;
    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->ch = ch;
    c->resp_desc = resp_desc;
    c->on_msg = on_msg;
    c->on_done = on_done;
    c->ud = ud;
    c->op_start.fn = client_on_start;
    c->op_recv.fn = client_on_recv;
    c->op_recv.direct = true;
    c->op_status.fn = client_on_status;
    grpc_metadata_array_init(&c->init_md);
    grpc_metadata_array_init(&c->trail_md);
    c->details = grpc_empty_slice();
    grpc_slice m = grpc_slice_from_copied_string(method);
    c->call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, ch->ctx->cq, m, NULL,
                                       rpc__deadline_from_ms(deadline_ms), NULL);
    grpc_slice_unref(m);
    if (!c->call) {
        grpc_metadata_array_destroy(&c->init_md);
        grpc_metadata_array_destroy(&c->trail_md);
        free(c);
        return -EIO;
    }
    c->send_buf = rpc__bb_encode(req, NULL);
    memset(ops, 0, sizeof(ops));
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (ch->auth) {
        c->auth_md.key = grpc_slice_from_static_string("authorization");
        c->auth_md.value = grpc_slice_from_copied_string(ch->auth);
        ops[n].data.send_initial_metadata.count = 1;
        ops[n].data.send_initial_metadata.metadata = &c->auth_md;
        c->has_auth_md = true;
    }
    n++;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->send_buf;
    n++;
    ops[n].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    n++;
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n].data.recv_initial_metadata.recv_initial_metadata = &c->init_md;
    n++;
    ch->live++;
    ch->ctx->live_calls++;
    c->start_pending = true;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->op_start, NULL);
    BUG_ON(e != GRPC_CALL_OK);
    client_start_recv(c);
    if (ret)
        *ret = c;
    return 0;
}

void rpc_client_cancel(struct rpc_client_call *c)
{
    grpc_call_cancel(c->call, NULL);
}

