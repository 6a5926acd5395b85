/* http.c - the HTTP server of the coordinator (see http.h): libmicrohttpd in external epoll
 * mode on the libuv loop.
 *
 * Owns: the MHD daemon, the listen socket (accepted here, under the connection limits, and
 * handed to MHD: conn_admit), a uv_poll_t on MHD's epoll fd and a uv_timer_t for MHD's
 * timeouts (every MHD callback runs from those, on the loop), a per-connection record
 * (struct http_conn: when its current request began, a watch on its socket while suspended)
 * and a per-request record (struct http_req: route, body, the pending or streamed response).
 * A sweep timer enforces the request-head and request-arrival deadlines (slow-loris) that MHD's
 * idle timeout alone does not (a byte every few seconds keeps a connection from being idle).
 *
 * Invariant: a suspended connection (waiting for its handler's answer, or for stream data) is
 * not polled by MHD, so its socket is watched here for the peer's hang-up; the watch is
 * stopped before the connection is resumed, and MHD_stop_daemon() only runs with no
 * connection suspended.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <gnutls/gnutls.h>
#include <jansson.h>
#include <microhttpd.h>

#include "coord-int.h"
#include "err.h"
#include "file.h"
#include "http.h"
#include "log.h"
#include "strbuf.h"

#define SWEEP_MS 250

struct http_conn {
    struct http_server *s;
    struct http_conn *prev, *next;
    struct MHD_Connection *mc;
    int fd;
    bool tls;
    int64_t t_base;                 /* the current request's arrival began (connection start,
                                       or the end of the previous request) */
    struct http_req *cur;           /* the request in progress (handler reached) */
    int kill_stage;                 /* 1: 408 sent and write side shut; 2: shut down */
    unsigned served;                /* requests completed on it (keep-alive) */
    bool watch_init, watching, closing;
    bool bad_target;                /* the current request target decoded to a NUL or control
                                       byte (unescape_cb; req_begin refuses it) */
    bool evicted;                   /* shut down to make room for a new one (conn_admit) */
    struct sockaddr_storage sa;     /* the client's address (per-address limit) */
    uv_poll_t watch;                /* while suspended: the peer's hang-up */
    char peer[96];
};

struct http_req {
    struct http_server *s;
    struct MHD_Connection *mc;
    struct http_conn *c;            /* NULL: no record (out of memory) or already closed */
    const struct http_route *route;
    char method[16];
    char path[256];
    struct strbuf body;
    bool too_big;
    bool dispatched, in_handler, queued, suspended, aborted;
    bool keyed;
    uint64_t key_hash;
    char origin[256];               /* an allowed Origin: echoed with CORS headers */
    /* the answer */
    struct MHD_Response *resp;      /* made, not yet queued */
    unsigned status;
    bool streaming, stream_ended;
    struct strbuf out;              /* stream bytes not yet handed to MHD */
    size_t out_off;
    http_close_fn on_close;
    void *close_ud;
    int64_t t_start;
};

struct http_server {
    struct http_server_opts o;
    char *api_key;
    char *name;
    uv_loop_t *loop;
    struct MHD_Daemon *d;
    int listen_fd;
    int port;
    uv_poll_t poll;
    uv_poll_t lpoll;                /* listen_fd: accepted here, handed to MHD */
    uv_timer_t timer, sweep;
    int reserve_fd;                 /* /dev/null: given up to answer a client at EMFILE */
    uint64_t n_evicted, n_refused;  /* connections closed to make room, refused (log) */
    int64_t t_refusal_log;
    struct http_conn *conns;
    unsigned active;
    int closing;                    /* handles still closing (stop) */
    bool run_soon;                  /* the timer is set to run MHD at the next turn */
    char *tls_cert, *tls_key, *tls_ca;
    struct http_list { char **v; size_t n; bool any; } hosts, origins;  /* allowed (http.h) */
};

static void server_run(struct http_server *s);
static void conn_suspend(struct http_req *hr);
static bool path_match(const char *pat, const char *path);

/* ------------------------------------------------------------------ errors */

/* OpenAI's error object; type and code follow the status as OpenAI's API and its clients use
 * them (the clients pick their exception class by the status). */
static char *error_json(unsigned status, const char *param, const char *msg)
{
    const char *type = "invalid_request_error", *code = NULL;
    json_t *o;
    char *out;

    switch (status) {
    case 401: type = "authentication_error"; code = "invalid_api_key"; break;
    case 403: type = "permission_error"; break;
    case 404: code = "not_found"; break;
    case 408: type = "timeout_error"; code = "request_timeout"; break;
    case 413: code = "request_too_large"; break;
    case 415: code = "unsupported_media_type"; break;
    case 429: type = "rate_limit_error"; code = "server_overloaded"; break;
    case 503: type = "service_unavailable_error"; code = "unavailable"; break;
    case 504: type = "timeout_error"; code = "deadline_exceeded"; break;
    default:
        if (status >= 500)
            type = "server_error";
    }
    o = json_pack("{s:{s:s, s:s, s:s?, s:s?}}", "error", "message", msg, "type", type, "param", param,
                  "code", code);
    out = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return out;
}

/* The error body of a request in the shape of the API its path belongs to: its route's
 * error_body (a route of the path under any method before the route is known), OpenAI's
 * without one or without a request yet. */
static char *req_error_json(const struct http_req *hr, unsigned status, const char *param, const char *msg)
{
    const struct http_route *r = hr ? hr->route : NULL;
    size_t n = strlen(msg), i = 0, ok;
    char *clean = malloc(n + 1), *out;

    if (!clean)
        return NULL;
    /* the message quotes the client's bytes (a Host, a path): what is not UTF-8 becomes '?',
     * or JSON could not hold it and there would be no answer */
    while (i < n) {
        ok = tok_utf8_valid_prefix(msg + i, n - i);
        memcpy(clean + i, msg + i, ok);
        i += ok;
        if (i < n)
            clean[i++] = '?';
    }
    clean[n] = '\0';
    for (size_t k = 0; !r && hr && k < hr->s->o.n_routes; k++)
        if (path_match(hr->s->o.routes[k].path, hr->path))
            r = &hr->s->o.routes[k];
    out = r && r->error_body ? r->error_body(status, param, clean) : error_json(status, param, clean);
    free(clean);
    return out;
}

/* ------------------------------------------------------------------ responses */

static int add_headers(struct MHD_Response *resp, const char *ctype, const char *const *headers)
{
    if (ctype && MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype) != MHD_YES)
        return -ENOMEM;
    for (size_t i = 0; headers && headers[i]; i += 2)
        if (MHD_add_response_header(resp, headers[i], headers[i + 1]) != MHD_YES)
            return -ENOMEM;
    return 0;
}

static void watch_stop(struct http_conn *c)
{
    if (c && c->watching) {
        uv_poll_stop(&c->watch);
        c->watching = false;
    }
}

static void timer_cb(uv_timer_t *t);

/* Resume hr's connection and have MHD run at the loop's next turn: in external epoll mode a
 * resume does not wake MHD's epoll fd (measured: it waited for the next timeout), and one run
 * serves every connection resumed meanwhile (one engine step's tokens for all streams). */
static void req_resume(struct http_req *hr)
{
    if (!hr->suspended)
        return;
    hr->suspended = false;
    watch_stop(hr->c);
    MHD_resume_connection(hr->mc);
    if (!hr->s->run_soon) {
        hr->s->run_soon = true;
        uv_timer_start(&hr->s->timer, timer_cb, 0, 0);
    }
}

/* Hand hr's response to MHD: now (in its handler, the access callback queues it) or, the
 * connection suspended, at once and resume it. */
static int req_answer(struct http_req *hr, struct MHD_Response *resp, unsigned status)
{
    if (hr->resp || hr->queued) {
        MHD_destroy_response(resp);
        return -EALREADY;
    }
    if (hr->origin[0] && (MHD_add_response_header(resp, "Access-Control-Allow-Origin", hr->origin) != MHD_YES ||
                          MHD_add_response_header(resp, "Vary", "Origin") != MHD_YES)) {
        MHD_destroy_response(resp);
        return -ENOMEM;
    }
    hr->status = status;
    if (hr->in_handler) {
        hr->resp = resp;
        return 0;
    }
    if (!hr->suspended) {
        /* between the access callbacks: the next one queues it */
        hr->resp = resp;
        return 0;
    }
    hr->queued = true;
    MHD_queue_response(hr->mc, status, resp);
    MHD_destroy_response(resp);
    req_resume(hr);
    return 0;
}

int http_respond(struct http_req *hr, unsigned status, const char *ctype, const char *body, size_t len,
                 const char *const *headers)
{
    struct MHD_Response *resp;

    if (hr->aborted)
        return -ECANCELED;
    resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp)
        return -ENOMEM;
    if (add_headers(resp, ctype, headers) < 0) {
        MHD_destroy_response(resp);
        return -ENOMEM;
    }
    return req_answer(hr, resp, status);
}

int http_respond_error(struct http_req *hr, unsigned status, const char *param, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    char *body;
    int r;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    body = req_error_json(hr, status, param, msg);
    if (!body)
        return -ENOMEM;
    r = http_respond(hr, status, "application/json", body, strlen(body), NULL);
    free(body);
    return r;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct http_req *hr = cls;
    size_t avail = hr->out.len - hr->out_off;

    (void)pos;
    if (hr->aborted)
        return MHD_CONTENT_READER_END_WITH_ERROR;
    if (avail) {
        size_t n = avail < max ? avail : max;

        memcpy(buf, hr->out.p + hr->out_off, n);
        hr->out_off += n;
        if (hr->out_off == hr->out.len) {
            strbuf_reset(&hr->out);
            hr->out_off = 0;
        }
        return (ssize_t)n;
    }
    if (hr->stream_ended)
        return MHD_CONTENT_READER_END_OF_STREAM;
    /* nothing to send: wait for the next write (http_stream_write resumes) */
    conn_suspend(hr);
    return 0;
}

int http_stream_start(struct http_req *hr, unsigned status, const char *ctype)
{
    static const char *const hdrs[] = { "Cache-Control", "no-cache", "X-Accel-Buffering", "no", NULL };
    struct MHD_Response *resp;

    if (hr->aborted)
        return -ECANCELED;
    resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, hr, NULL);
    if (!resp)
        return -ENOMEM;
    if (add_headers(resp, ctype, hdrs) < 0) {
        MHD_destroy_response(resp);
        return -ENOMEM;
    }
    hr->streaming = true;
    return req_answer(hr, resp, status);
}

int http_stream_write(struct http_req *hr, const char *data, size_t len)
{
    if (hr->aborted || hr->stream_ended)
        return -ECANCELED;
    if (hr->out.len - hr->out_off + len > hr->s->o.stream_buffer_bytes)
        return -ENOBUFS;
    if (strbuf_add(&hr->out, data, len) < 0)
        return -ENOMEM;
    if (hr->queued)
        req_resume(hr);
    return 0;
}

void http_stream_end(struct http_req *hr)
{
    hr->stream_ended = true;
    if (hr->queued)
        req_resume(hr);
}

void http_req_abort(struct http_req *hr)
{
    if (hr->aborted)
        return;
    hr->aborted = true;
    if (hr->c && hr->c->fd >= 0)
        shutdown(hr->c->fd, SHUT_RDWR);
    if (!hr->queued && !hr->resp) {
        /* a deferred answer that will never come: close with no response */
        struct MHD_Response *resp = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);

        if (resp)
            req_answer(hr, resp, 500);
        return;
    }
    req_resume(hr);
}

/* ------------------------------------------------------------------ accessors */

const char *http_req_method(const struct http_req *hr) { return hr->method; }
const char *http_req_path(const struct http_req *hr) { return hr->path; }
const char *http_req_peer(const struct http_req *hr) { return hr->c ? hr->c->peer : "unknown"; }

const char *http_req_body(const struct http_req *hr, size_t *len)
{
    *len = hr->body.len;
    return strbuf_str(&hr->body);
}

bool http_req_keyed(const struct http_req *hr, uint64_t *key_hash)
{
    if (hr->keyed && key_hash)
        *key_hash = hr->key_hash;
    return hr->keyed;
}

void http_req_on_close(struct http_req *hr, http_close_fn fn, void *ud)
{
    hr->on_close = fn;
    hr->close_ud = ud;
}

/* ------------------------------------------------------------------ suspended connections */

static void watch_cb(uv_poll_t *h, int status, int events)
{
    struct http_conn *c = h->data;
    struct http_req *hr = c->cur;

    (void)events;
    watch_stop(c);
    if (!hr || !hr->suspended)
        return;
    /* the peer hung up (or the socket failed) while its request waits: resume, so that MHD
     * finds the connection closed and ends the request (on_close: not completed) */
    log_debug("%s: client %s went away (%s)", c->s->name, c->peer, status < 0 ? uv_strerror(status) : "hang-up");
    hr->aborted = true;
    if (!hr->queued && !hr->resp) {
        struct MHD_Response *resp = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);

        if (resp) {
            req_answer(hr, resp, 500);
            return;
        }
    }
    req_resume(hr);
}

static void conn_suspend(struct http_req *hr)
{
    struct http_conn *c = hr->c;

    MHD_suspend_connection(hr->mc);
    hr->suspended = true;
    if (!c || c->fd < 0)
        return;
    if (!c->watch_init) {
        if (uv_poll_init(c->s->loop, &c->watch, c->fd) < 0)
            return;
        c->watch.data = c;
        c->watch_init = true;
    }
    if (uv_poll_start(&c->watch, UV_DISCONNECT, watch_cb) == 0)
        c->watching = true;
}

/* ------------------------------------------------------------------ MHD callbacks */

static void format_peer(const struct sockaddr *sa, char *buf, size_t n)
{
    char host[INET6_ADDRSTRLEN] = "?";

    if (!sa) {
        snprintf(buf, n, "unknown");
    } else if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const void *)sa;

        inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
        snprintf(buf, n, "ipv4:%s:%u", host, ntohs(in->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const void *)sa;

        inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
        snprintf(buf, n, "ipv6:[%s]:%u", host, ntohs(in6->sin6_port));
    } else {
        snprintf(buf, n, "unknown");
    }
}

static void conn_freed(uv_handle_t *h)
{
    free(h->data);
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    struct http_server *s = cls;
    struct http_conn *c = *socket_context;

    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *fi = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
        const union MHD_ConnectionInfo *ai = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CLIENT_ADDRESS);

        c = calloc(1, sizeof(*c));
        if (!c)
            return;     /* no record: no sweep, no disconnect watch for this one */
        c->s = s;
        c->mc = mc;
        c->fd = fi ? fi->connect_fd : -1;
        c->tls = s->o.tls != NULL;
        c->t_base = rpc_now_ms();
        format_peer(ai ? ai->client_addr : NULL, c->peer, sizeof(c->peer));
        if (ai && ai->client_addr)
            memcpy(&c->sa, ai->client_addr, ai->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                                                 : sizeof(struct sockaddr_in));
        c->next = s->conns;
        if (s->conns)
            s->conns->prev = c;
        s->conns = c;
        *socket_context = c;
        return;
    }
    if (!c)
        return;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    if (c->cur)
        c->cur->c = NULL;
    c->fd = -1;
    if (c->watch_init) {
        watch_stop(c);
        uv_close((uv_handle_t *)&c->watch, conn_freed);
    } else {
        free(c);
    }
    *socket_context = NULL;
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    struct http_server *s = cls;
    struct http_req *hr = *con_cls;

    (void)mc;
    if (!hr)
        return;
    *con_cls = NULL;
    if (hr->c) {
        hr->c->cur = NULL;
        hr->c->served++;
        hr->c->t_base = rpc_now_ms();
        watch_stop(hr->c);
    }
    if (hr->on_close)
        hr->on_close(hr, toe == MHD_REQUEST_TERMINATED_COMPLETED_OK && !hr->aborted, hr->close_ud);
    if (hr->resp)
        MHD_destroy_response(hr->resp);
    strbuf_done(&hr->body);
    strbuf_done(&hr->out);
    s->active--;
    free(hr);
}

/* A route's path: exact, or with a last segment "*": any one non-empty segment there. */
static bool path_match(const char *pat, const char *path)
{
    size_t n = strlen(pat);

    if (n >= 2 && pat[n - 1] == '*' && pat[n - 2] == '/')
        return !strncmp(pat, path, n - 1) && path[n - 1] && !strchr(path + n - 1, '/');
    return !strcmp(pat, path);
}

static const struct http_route *route_find(const struct http_server *s, const char *method, const char *path,
                                           bool *path_known)
{
    *path_known = false;
    for (size_t i = 0; i < s->o.n_routes; i++) {
        const struct http_route *r = &s->o.routes[i];

        if (!path_match(r->path, path))
            continue;
        *path_known = true;
        if (!strcmp(r->method, method) || (!strcmp(r->method, "GET") && !strcmp(method, "HEAD")))
            return r;
    }
    return NULL;
}

/* The client certificate, when the port requires one (mTLS): verified against the CA. */
static bool client_cert_ok(struct MHD_Connection *mc)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_GNUTLS_SESSION);
    unsigned st = 0, n = 0;

    if (!ci || !ci->tls_session || !gnutls_certificate_get_peers((gnutls_session_t)ci->tls_session, &n) || !n)
        return false;
    return gnutls_certificate_verify_peers2((gnutls_session_t)ci->tls_session, &st) == 0 && st == 0;
}

/* ------------------------------------------------------------------ framing (RFC 9112) */

/* A NUL, a C0 control other than HTAB, or DEL in s[0..n). */
static bool has_ctl(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];

        if ((ch < 0x20 && ch != '\t') || ch == 0x7f)
            return true;
    }
    return false;
}

/* MHD's percent-decoding of the request target (the path, each query key and value), with
 * what a C string would hide flagged: "/v1/chat/completions%00junk" decodes to a path whose
 * strlen() is a route's; req_begin refuses the request instead. */
static size_t unescape_cb(void *cls, struct MHD_Connection *mc, char *val)
{
    const union MHD_ConnectionInfo *sc = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    struct http_conn *c = sc ? sc->socket_context : NULL;
    size_t n = MHD_http_unescape(val);

    (void)cls;
    if (c && has_ctl(val, n))
        c->bad_target = true;
    return n;
}

struct framing {
    unsigned n_cl, n_te;
    const char *cl, *te;
    const char *bad_header;         /* a header holding a control byte */
};

static enum MHD_Result framing_header(void *cls, enum MHD_ValueKind kind, const char *key, size_t key_size,
                                      const char *value, size_t value_size)
{
    struct framing *f = cls;

    (void)kind;
    if (!f->bad_header && (has_ctl(key, key_size) || (value && has_ctl(value, value_size))))
        f->bad_header = key;
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
        f->n_cl++;
        f->cl = value;
    } else if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
        f->n_te++;
        f->te = value;
    }
    return MHD_YES;
}

/* The message framing a front proxy could read otherwise than MHD does (request smuggling,
 * RFC 9112 6.1-6.3): Content-Length with Transfer-Encoding, Content-Length twice or not a
 * plain decimal, a transfer coding other than chunked, Transfer-Encoding on HTTP/1.0; and a
 * control byte in the decoded target or in a header.  The reason, or NULL. */
static const char *framing_error(struct http_conn *c, struct MHD_Connection *mc, const char *version,
                                 char *buf, size_t n)
{
    struct framing f = { 0 };

    if (c && c->bad_target)
        return "the request target decodes to a NUL or control byte";
    MHD_get_connection_values_n(mc, MHD_HEADER_KIND, framing_header, &f);
    if (f.bad_header) {
        snprintf(buf, n, "header %.64s holds a control byte", f.bad_header);
        return buf;
    }
    if (f.n_cl && f.n_te)
        return "Content-Length together with Transfer-Encoding";
    if (f.n_cl > 1)
        return "more than one Content-Length";
    if (f.n_cl && (!f.cl || !f.cl[0] || strspn(f.cl, "0123456789") != strlen(f.cl) || strlen(f.cl) > 18))
        return "Content-Length is not a decimal number of bytes";
    if (f.n_te && version && !strcmp(version, MHD_HTTP_VERSION_1_0))
        return "Transfer-Encoding on an HTTP/1.0 request";
    if (f.n_te > 1 || (f.n_te && (!f.te || strcasecmp(f.te, "chunked"))))
        return "a transfer coding other than chunked";
    return NULL;
}

/* A framing error: 400 naming it, and the connection closed after the answer (what follows
 * on it cannot be delimited). */
static int framing_refuse(struct http_req *hr, const char *why)
{
    static const char *const hdrs[] = { "Connection", "close", NULL };
    char msg[256];
    char *body;
    int r;

    log_info("%s: client %s: bad request framing (%s): closing", hr->s->name, http_req_peer(hr), why);
    snprintf(msg, sizeof(msg), "bad request framing: %s", why);
    body = req_error_json(hr, 400, NULL, msg);
    r = body ? http_respond(hr, 400, "application/json", body, strlen(body), hdrs) : -ENOMEM;
    free(body);
    return r;
}

/* ------------------------------------------------------------------ browsers */

static void list_free(struct http_list *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
    *l = (struct http_list){ 0 };
}

static int list_add(struct http_list *l, const char *item, size_t len)
{
    char **v;

    while (len && (*item == ' ' || *item == '\t'))
        item++, len--;
    while (len && (item[len - 1] == ' ' || item[len - 1] == '\t'))
        len--;
    if (!len)
        return 0;
    if (len == 1 && *item == '*') {
        l->any = true;
        return 0;
    }
    v = realloc(l->v, (l->n + 1) * sizeof(*v));
    if (!v)
        return -ENOMEM;
    l->v = v;
    if (!(v[l->n] = strndup(item, len)))
        return -ENOMEM;
    l->n++;
    return 0;
}

/* --allowed-hosts / --allowed-origins: a JSON list of strings (vLLM's form) or a
 * comma-separated list. */
static int list_parse(const char *flag, const char *spec, struct http_list *l)
{
    int r = 0;

    if (!spec)
        return 0;
    if (spec[0] == '[') {
        json_error_t je;
        json_t *a = json_loads(spec, 0, &je), *it;
        size_t i;

        if (!json_is_array(a)) {
            json_decref(a);
            log_error("%s: not a JSON list of strings: %s", flag, je.text);
            return -EINVAL;
        }
        json_array_foreach(a, i, it) {
            if (!json_is_string(it)) {
                log_error("%s: item %zu is not a string", flag, i);
                r = -EINVAL;
                break;
            }
            if ((r = list_add(l, json_string_value(it), json_string_length(it))) < 0)
                break;
        }
        json_decref(a);
        return r;
    }
    for (const char *p = spec; r == 0; p++) {
        size_t n = strcspn(p, ",");

        r = list_add(l, p, n);
        p += n;
        if (!*p)
            break;
    }
    return r;
}

static bool list_has(const struct http_list *l, const char *item)
{
    if (l->any)
        return true;
    for (size_t i = 0; i < l->n; i++)
        if (!strcasecmp(l->v[i], item))
            return true;
    return false;
}

/* The Host header names this server: an IP literal (no DNS name to rebind), localhost, the
 * listen host, or an --allowed-hosts name; the port is not checked. */
static bool host_ok(const struct http_server *s, const char *host)
{
    char name[256];
    const char *end;
    size_t n;
    struct in6_addr a6;
    struct in_addr a4;

    if (host[0] == '[') {
        end = strchr(host, ']');
        if (!end || (end[1] && end[1] != ':'))
            return false;
        host++;
    } else {
        end = strchr(host, ':');
        if (end && strchr(end + 1, ':'))
            return false;       /* an IPv6 address without brackets */
        if (!end)
            end = host + strlen(host);
    }
    n = (size_t)(end - host);
    if (n == 0 || n >= sizeof(name))
        return false;
    memcpy(name, host, n);
    name[n] = '\0';
    if (*end == ']' ? inet_pton(AF_INET6, name, &a6) == 1 : inet_pton(AF_INET, name, &a4) == 1)
        return true;
    if (n > 1 && name[n - 1] == '.')
        name[n - 1] = '\0';   /* "localhost." */
    return !strcasecmp(name, "localhost") || (s->o.host && !strcasecmp(name, s->o.host)) ||
           list_has(&s->hosts, name);
}

/* A media type is application/json (parameters such as charset aside). */
static bool is_json(const char *ctype)
{
    size_t n;

    if (!ctype)
        return false;
    while (*ctype == ' ')
        ctype++;
    n = strcspn(ctype, "; \t");
    return n == 16 && !strncasecmp(ctype, "application/json", 16);
}

/* A CORS preflight (OPTIONS with an allowed Origin) for a known path. */
static int preflight(struct http_req *hr, struct MHD_Connection *mc)
{
    const char *req_hdrs = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "Access-Control-Request-Headers");
    const char *const hdrs[] = { "Access-Control-Allow-Methods", "GET, POST, OPTIONS",
                                 "Access-Control-Allow-Headers",
                                 req_hdrs && !has_ctl(req_hdrs, strlen(req_hdrs)) ? req_hdrs
                                                                                  : "Authorization, Content-Type",
                                 "Access-Control-Max-Age", "600", NULL };

    return http_respond(hr, 204, NULL, "", 0, hdrs);
}

/* Browsers: a foreign Host (DNS rebinding) or Origin is refused, a preflight answered. 1 when
 * answered, 0 to go on. */
static int req_browser(struct http_req *hr, struct MHD_Connection *mc)
{
    struct http_server *s = hr->s;
    const char *host = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
    const char *origin = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "Origin");
    bool known;

    if (host && !host_ok(s, host)) {
        http_respond_error(hr, 403, NULL, "Host %.100s is not a name of this server (allow it with "
                           "--allowed-hosts)", host);
        return 1;
    }
    if (origin) {
        if (!list_has(&s->origins, origin) || strlen(origin) >= sizeof(hr->origin)) {
            http_respond_error(hr, 403, NULL, "cross-origin request from %.100s refused (allow it with "
                               "--allowed-origins)", origin);
            return 1;
        }
        snprintf(hr->origin, sizeof(hr->origin), "%s", origin);
    }
    if (!strcmp(hr->method, "OPTIONS")) {
        (void)route_find(s, "", hr->path, &known);
        if (!origin || !known)
            http_respond_error(hr, known ? 405 : 404, NULL, "%s", known ? "OPTIONS is a CORS preflight: it "
                               "needs an Origin header" : "no such endpoint");
        else
            preflight(hr, mc);
        return 1;
    }
    return 0;
}

/* The request's first call: framing, route, key, size; an error answer now, or 0 to read on. */
static int req_begin(struct http_req *hr, struct MHD_Connection *mc, const char *version)
{
    struct http_server *s = hr->s;
    const char *cl = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    const char *auth, *xkey = NULL, *why;
    char why_buf[128];
    bool known;

    why = framing_error(hr->c, mc, version, why_buf, sizeof(why_buf));
    if (hr->c)
        hr->c->bad_target = false;
    if (why)
        return framing_refuse(hr, why);
    if (req_browser(hr, mc))
        return 0;
    if (s->o.tls && s->o.tls->require_client_cert && !client_cert_ok(mc))
        return http_respond_error(hr, 403, NULL, "a client certificate signed by the server's CA is required");
    hr->route = route_find(s, hr->method, hr->path, &known);
    if (!hr->route) {
        if (known)
            return http_respond_error(hr, 405, NULL, "%s is not allowed on %s", hr->method, hr->path);
        return http_respond_error(hr, 404, NULL, "no such endpoint: %s %.200s", hr->method, hr->path);
    }
    auth = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    /* Anthropic's clients send the key as x-api-key: the same key */
    if (!auth && (xkey = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "x-api-key")))
        auth = "";
    if (s->api_key && auth && (xkey || strncasecmp(auth, "Bearer ", 7) == 0)) {
        const char *k = xkey ? xkey : auth + 7;

        while (*k == ' ')
            k++;
        if (rpc_secret_equal(s->api_key, k)) {
            hr->keyed = true;
            hr->key_hash = coord_fnv1a(k, strlen(k), COORD_FNV_SEED);
        }
    }
    if (s->api_key && hr->route->auth && !hr->keyed) {
        static const char *const hdrs[] = { "WWW-Authenticate", "Bearer", NULL };
        char *body = req_error_json(hr, 401, NULL, auth ? "invalid API key" : "an API key is required "
                                "(Authorization: Bearer <key>)");
        int r = body ? http_respond(hr, 401, "application/json", body, strlen(body), hdrs) : -ENOMEM;

        free(body);
        return r;
    }
    if (cl) {
        char *end;
        unsigned long long v = strtoull(cl, &end, 10);

        if (end != cl && !*end && v > s->o.max_body_bytes)
            return http_respond_error(hr, 413, NULL, "request body of %llu bytes is over the limit of %zu bytes",
                                      v, s->o.max_body_bytes);
    }
    /* a JSON body only: a browser's "simple" cross-origin POST (text/plain, a form) needs no
     * preflight, so it is refused here */
    if (!strcmp(hr->route->method, "POST")) {
        const char *ct = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);

        if (!is_json(ct))
            return http_respond_error(hr, 415, NULL, "Content-Type must be application/json%s%.100s",
                                      ct ? ", not " : " (none given)", ct ? ct : "");
    }
    return 0;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **con_cls)
{
    struct http_server *s = cls;
    struct http_req *hr = *con_cls;
    const union MHD_ConnectionInfo *sc;

    if (!hr) {
        hr = calloc(1, sizeof(*hr));
        if (!hr)
            return MHD_NO;
        hr->s = s;
        hr->mc = mc;
        sc = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        hr->c = sc ? sc->socket_context : NULL;
        if (hr->c)
            hr->c->cur = hr;
        hr->t_start = rpc_now_ms();
        snprintf(hr->method, sizeof(hr->method), "%s", method);
        snprintf(hr->path, sizeof(hr->path), "%s", url);
        *con_cls = hr;
        s->active++;
        hr->in_handler = true;
        (void)req_begin(hr, mc, version);
        hr->in_handler = false;
        if (hr->resp)
            goto queue;
        return MHD_YES;
    }
    if (*upload_data_size) {
        if (!hr->too_big) {
            if (hr->body.len + *upload_data_size > s->o.max_body_bytes) {
                hr->too_big = true;
                strbuf_done(&hr->body);
            } else if (strbuf_add(&hr->body, upload_data, *upload_data_size) < 0) {
                hr->too_big = true;
                strbuf_done(&hr->body);
            }
        }
        *upload_data_size = 0;      /* consumed (or dropped, over the limit) */
        return MHD_YES;
    }
    if (hr->resp)
        goto queue;
    if (hr->queued)
        return MHD_YES;
    if (!hr->dispatched) {
        hr->dispatched = true;
        hr->in_handler = true;
        if (!hr->route) {
            /* req_begin refused it but its answer could not be made (out of memory) */
            log_warn("%s: client %s: no answer could be made for %s %.200s: closing", s->name,
                     http_req_peer(hr), hr->method, hr->path);
            return MHD_NO;
        }
        if (hr->too_big)
            http_respond_error(hr, 413, NULL, "request body is over the limit of %zu bytes", s->o.max_body_bytes);
        else
            hr->route->fn(hr, s->o.ud);
        hr->in_handler = false;
        if (hr->resp)
            goto queue;
    }
    /* the answer comes later */
    conn_suspend(hr);
    return MHD_YES;
queue:
    {
        struct MHD_Response *resp = hr->resp;
        enum MHD_Result r;

        hr->resp = NULL;
        hr->queued = true;
        r = MHD_queue_response(mc, hr->status, resp);
        MHD_destroy_response(resp);
        return r;
    }
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    struct http_server *s = cls;
    char msg[512];

    vsnprintf(msg, sizeof(msg), fmt, ap);
    msg[strcspn(msg, "\n")] = '\0';
    log_debug("%s: %s", s->name, msg);
}

/* ------------------------------------------------------------------ the loop */

static void timer_cb(uv_timer_t *t)
{
    server_run(t->data);
}

static void poll_cb(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    server_run(h->data);
}

static void server_run(struct http_server *s)
{
    MHD_UNSIGNED_LONG_LONG to;

    if (!s->d)
        return;
    s->run_soon = false;
    MHD_run(s->d);
    if (s->run_soon)
        return;     /* resumed during the run: the timer runs it again */
    if (MHD_get_timeout(s->d, &to) == MHD_YES)
        uv_timer_start(&s->timer, timer_cb, to, 0);
    else
        uv_timer_stop(&s->timer);
}

/* The request-arrival deadline: headers and body within timeout_ms (slow-loris). */
static void sweep_cb(uv_timer_t *t)
{
    struct http_server *s = t->data;
    int64_t now = rpc_now_ms();

    for (struct http_conn *c = s->conns; c; c = c->next) {
        struct http_req *hr = c->cur;
        int64_t since = hr ? hr->t_start : c->t_base;

        /* no request head yet: the shorter header deadline */
        unsigned limit = !hr && s->o.header_timeout_ms && s->o.header_timeout_ms < s->o.timeout_ms
                         ? s->o.header_timeout_ms : s->o.timeout_ms;

        if (c->fd < 0 || (hr && (hr->dispatched || hr->queued || hr->resp)))
            continue;
        if (now - since < (int64_t)limit)
            continue;
        if (c->kill_stage == 0) {
            if (hr || !c->served)
                log_info("%s: client %s did not send its request %s within %u ms: closing", s->name, c->peer,
                         hr ? "body" : "head", limit);
            /* an idle keep-alive connection is closed without a word (a client that sends its
             * next request just then must not read a 408 as its answer) */
            if (!c->tls && (hr || !c->served)) {
                /* nothing went out on this connection for this request: a 408 of our own */
                char msg[160], head[256];
                char *body;
                int hl;

                snprintf(msg, sizeof(msg), "the request did not arrive within the %u ms limit", limit);
                body = req_error_json(hr, 408, NULL, msg);
                if (body) {
                    hl = snprintf(head, sizeof(head), "HTTP/1.1 408 Request Timeout\r\nContent-Type: "
                                  "application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                                  strlen(body));
                    (void)!send(c->fd, head, (size_t)hl, MSG_NOSIGNAL | MSG_DONTWAIT);
                    (void)!send(c->fd, body, strlen(body), MSG_NOSIGNAL | MSG_DONTWAIT);
                    free(body);
                }
            }
            shutdown(c->fd, c->tls ? SHUT_RDWR : SHUT_WR);
            c->kill_stage = 1;
        } else if (c->kill_stage == 1) {
            shutdown(c->fd, SHUT_RDWR);
            c->kill_stage = 2;
        }
    }
    server_run(s);
}

/* ------------------------------------------------------------------ accepting */

static bool same_address(const struct sockaddr_storage *a, const struct sockaddr *b)
{
    if (a->ss_family != b->sa_family)
        return false;
    if (b->sa_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (b->sa_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                       sizeof(struct in6_addr));
    return true;
}

/* A connection not taken: an answer (plaintext only: TLS has not begun), what the client
 * sent read and dropped so that the close is not a reset that loses the answer, closed. */
static void conn_refuse(struct http_server *s, int fd, const struct sockaddr *sa, unsigned status, const char *msg)
{
    char head[256], peer[96], junk[4096];
    char *body = s->o.tls ? NULL : error_json(status, NULL, msg);
    int64_t now = rpc_now_ms();

    if (body) {
        int hl = snprintf(head, sizeof(head), "HTTP/1.1 %u %s\r\nContent-Type: application/json\r\nContent-Length: "
                          "%zu\r\nRetry-After: 1\r\nConnection: close\r\n\r\n", status,
                          status == 429 ? "Too Many Requests" : "Service Unavailable", strlen(body));

        (void)!send(fd, head, (size_t)hl, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)!send(fd, body, strlen(body), MSG_NOSIGNAL | MSG_DONTWAIT);
        free(body);
    }
    shutdown(fd, SHUT_WR);
    while (recv(fd, junk, sizeof(junk), MSG_DONTWAIT) > 0)
        ;
    close(fd);
    s->n_refused++;
    if (now - s->t_refusal_log >= 1000) {
        s->t_refusal_log = now;
        format_peer(sa, peer, sizeof(peer));
        log_warn("%s: client %s refused %u: %s (%" PRIu64 " refused, %" PRIu64 " idle connections closed to make "
                 "room so far)", s->name, peer, status, msg, s->n_refused, s->n_evicted);
    }
}

/* Make room: an idle connection (no request in progress) is shut down; MHD closes it at its
 * next run. */
static void conn_evict(struct http_server *s, struct http_conn *c)
{
    shutdown(c->fd, SHUT_RDWR);
    c->evicted = true;
    s->n_evicted++;
}

/* A new connection within the limits, by closing the oldest idle one of its address or of
 * all when one is full, else refused; then MHD's. */
static void conn_admit(struct http_server *s, int fd, const struct sockaddr *sa, socklen_t sl)
{
    struct http_conn *idle_mine = NULL, *idle_any = NULL;
    unsigned mine = 0, total = 0;
    char msg[160];

    /* newest first: the last idle one seen is the oldest */
    for (struct http_conn *c = s->conns; c; c = c->next) {
        bool idle = !c->cur && c->fd >= 0;

        if (c->evicted || c->kill_stage)
            continue;
        total++;
        if (same_address(&c->sa, sa)) {
            mine++;
            if (idle)
                idle_mine = c;
        }
        if (idle)
            idle_any = c;
    }
    if (s->o.max_connections_per_client && mine >= s->o.max_connections_per_client) {
        if (!idle_mine) {
            snprintf(msg, sizeof(msg), "%u connections of this client address are busy (the limit)", mine);
            conn_refuse(s, fd, sa, 429, msg);
            return;
        }
        conn_evict(s, idle_mine);
    } else if (total >= s->o.max_connections) {
        if (!idle_any) {
            snprintf(msg, sizeof(msg), "%u connections are busy (the limit)", total);
            conn_refuse(s, fd, sa, 503, msg);
            return;
        }
        conn_evict(s, idle_any);
    }
    if (MHD_add_connection(s->d, fd, sa, sl) != MHD_YES)     /* it closed fd */
        log_warn("%s: a connection was not taken: %s", s->name, strerror(errno));
}

static void accept_cb(uv_poll_t *h, int status, int events)
{
    struct http_server *s = h->data;

    (void)status;
    (void)events;
    for (int i = 0; i < 64 && s->listen_fd >= 0; i++) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof(sa);
        int fd = accept4(s->listen_fd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);

        if (fd < 0 && (errno == EMFILE || errno == ENFILE) && s->reserve_fd >= 0) {
            /* out of descriptors: one given up to answer this client, then taken back */
            close(s->reserve_fd);
            sl = sizeof(sa);
            fd = accept4(s->listen_fd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd >= 0)
                conn_refuse(s, fd, (struct sockaddr *)&sa, 503, "the server is out of file descriptors");
            s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            if (fd >= 0)
                continue;
        }
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            break;      /* EAGAIN: all taken; another error: again at the next readiness */
        }
        conn_admit(s, fd, (struct sockaddr *)&sa, sl);
    }
    server_run(s);
}

/* ------------------------------------------------------------------ start / stop */

static int listen_socket(const char *host, int port, int *ret_fd, int *ret_port)
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
    struct addrinfo *ai = NULL;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char ps[16];
    int fd, one = 1, r;

    snprintf(ps, sizeof(ps), "%d", port);
    if ((r = getaddrinfo(host, ps, &hints, &ai)) != 0)
        return -EINVAL;
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        r = -errno;
        freeaddrinfo(ai);
        return r;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 511) < 0) {
        r = -errno;
        freeaddrinfo(ai);
        close(fd);
        return r;
    }
    freeaddrinfo(ai);
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
        *ret_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                   : ((struct sockaddr_in *)&ss)->sin_port);
    *ret_fd = fd;
    return 0;
}

static int read_pem(const char *path, const char *what, char **ret)
{
    size_t n;
    int r = file_read_all(path, 1 << 20, 0, ret, &n);

    if (r < 0)
        log_error("%s %s: %s", what, path, err_str(r));
    return r;
}

int http_server_start(uv_loop_t *loop, const struct http_server_opts *o, struct http_server **ret)
{
    struct http_server *s = calloc(1, sizeof(*s));
    struct MHD_OptionItem opts[16];
    unsigned flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET;
    const union MHD_DaemonInfo *di;
    size_t k = 0;
    int r;

    if (!s)
        return -ENOMEM;
    s->o = *o;
    s->loop = loop;
    s->listen_fd = -1;
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    s->name = strdup(o->name ? o->name : "http");
    s->api_key = o->api_key && o->api_key[0] ? strdup(o->api_key) : NULL;
    if (!s->name || (o->api_key && o->api_key[0] && !s->api_key)) {
        r = -ENOMEM;
        goto fail;
    }
    if ((r = list_parse("--allowed-hosts", o->allowed_hosts, &s->hosts)) < 0 ||
        (r = list_parse("--allowed-origins", o->allowed_origins, &s->origins)) < 0)
        goto fail;
    if (o->tls) {
        if ((r = read_pem(o->tls->cert_file, "--tls-cert", &s->tls_cert)) < 0 ||
            (r = read_pem(o->tls->key_file, "--tls-key", &s->tls_key)) < 0 ||
            (o->tls->root_file && (r = read_pem(o->tls->root_file, "--tls-client-ca", &s->tls_ca)) < 0))
            goto fail;
        flags |= MHD_USE_TLS;
        opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_HTTPS_MEM_CERT, 0, s->tls_cert };
        opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_HTTPS_MEM_KEY, 0, s->tls_key };
        if (s->tls_ca)
            opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_HTTPS_MEM_TRUST, 0, s->tls_ca };
    }
    if ((r = listen_socket(o->host, o->port, &s->listen_fd, &s->port)) < 0) {
        log_error("%s: cannot listen on %s port %d: %s", s->name, o->host, o->port,
                  r == -EINVAL ? "not an address of this host" : err_str(r));
        goto fail;
    }
    /* conn_admit keeps the limits; MHD's is room for those it has yet to close */
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_CONNECTION_LIMIT, 2 * (intptr_t)o->max_connections + 64, NULL };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_CONNECTION_TIMEOUT, (o->timeout_ms + 999) / 1000, NULL };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_CONNECTION_MEMORY_LIMIT, (intptr_t)o->max_header_bytes, NULL };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_NOTIFY_COMPLETED, (intptr_t)on_completed, s };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_NOTIFY_CONNECTION, (intptr_t)on_connection, s };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_EXTERNAL_LOGGER, (intptr_t)mhd_log, s };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_STRICT_FOR_CLIENT, 1, NULL };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_UNESCAPE_CALLBACK, (intptr_t)unescape_cb, s };
    opts[k++] = (struct MHD_OptionItem){ MHD_OPTION_END, 0, NULL };
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_access, s, MHD_OPTION_ARRAY, opts, MHD_OPTION_END);
    if (!s->d) {
        log_error("%s: the HTTP server did not start (libmicrohttpd%s)", s->name,
                  o->tls ? "; check the TLS certificate and key" : "");
        r = -EINVAL;
        goto fail;
    }
    di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_EPOLL_FD);
    if (!di || (r = uv_poll_init(loop, &s->poll, di->epoll_fd)) < 0) {
        MHD_stop_daemon(s->d);
        s->d = NULL;
        r = -EIO;
        goto fail;
    }
    if (uv_poll_init(loop, &s->lpoll, s->listen_fd) < 0) {
        MHD_stop_daemon(s->d);
        s->d = NULL;
        uv_close((uv_handle_t *)&s->poll, NULL);
        uv_run(loop, UV_RUN_NOWAIT);
        r = -EIO;
        goto fail;
    }
    s->poll.data = s->lpoll.data = s;
    uv_poll_start(&s->lpoll, UV_READABLE, accept_cb);
    uv_timer_init(loop, &s->timer);
    uv_timer_init(loop, &s->sweep);
    s->timer.data = s->sweep.data = s;
    uv_poll_start(&s->poll, UV_READABLE, poll_cb);
    uv_timer_start(&s->sweep, sweep_cb, SWEEP_MS, SWEEP_MS);
    *ret = s;
    return 0;
fail:
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    free(s->tls_cert);
    if (s->tls_key) {
        memset(s->tls_key, 0, strlen(s->tls_key));
        free(s->tls_key);
    }
    free(s->tls_ca);
    free(s->api_key);
    free(s->name);
    list_free(&s->hosts);
    list_free(&s->origins);
    free(s);
    return r;
}

int http_server_port(const struct http_server *s)
{
    return s ? s->port : 0;
}

unsigned http_server_active(const struct http_server *s)
{
    return s ? s->active : 0;
}

void http_server_quiesce(struct http_server *s)
{
    if (!s || !s->d || s->listen_fd < 0)
        return;
    uv_poll_stop(&s->lpoll);
    close(s->listen_fd);
    s->listen_fd = -1;
    server_run(s);
}

static void server_freed(uv_handle_t *h)
{
    struct http_server *s = h->data;

    if (--s->closing > 0)
        return;     /* the last of its four handles frees it */
    if (s->tls_key) {
        memset(s->tls_key, 0, strlen(s->tls_key));
        free(s->tls_key);
    }
    free(s->tls_cert);
    free(s->tls_ca);
    if (s->api_key) {
        memset(s->api_key, 0, strlen(s->api_key));
        free(s->api_key);
    }
    free(s->name);
    list_free(&s->hosts);
    list_free(&s->origins);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    free(s);
}

void http_server_stop(struct http_server *s)
{
    if (!s)
        return;
    /* MHD must not stop with a connection suspended: resume them all (their requests end
     * as not completed) */
    for (struct http_conn *c = s->conns; c; c = c->next)
        if (c->cur && c->cur->suspended) {
            c->cur->aborted = true;
            req_resume(c->cur);
        }
    if (s->d) {
        MHD_run(s->d);
        MHD_stop_daemon(s->d);
        s->d = NULL;
    }
    s->closing = 4;
    uv_close((uv_handle_t *)&s->timer, server_freed);
    uv_close((uv_handle_t *)&s->sweep, server_freed);
    uv_close((uv_handle_t *)&s->poll, server_freed);
    uv_close((uv_handle_t *)&s->lpoll, server_freed);   /* leaves epoll before the close */
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    s->listen_fd = -1;
}
