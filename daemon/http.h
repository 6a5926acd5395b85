/* http.h - an HTTP/1.1 server on the coordinator's libuv loop, over libmicrohttpd (Debian's
 * libmicrohttpd, in its external epoll mode: MHD's epoll fd is watched by a uv_poll_t and its
 * timeouts by a uv_timer_t, so every MHD callback runs on the loop thread, under the loop's
 * lock, never blocking it).  It serves the OpenAI API (openai-routes.c) and the metrics port.
 *
 * A request's body is read whole (up to max_body_bytes: 413 above, refused from its
 * Content-Length before any byte is read), then its route's handler runs.  The handler
 * answers at once (http_respond), later (the connection is suspended until it does: the
 * client's disconnect is still noticed, by a watch on the socket, and reported through
 * on_close), or as a stream (http_stream_start, http_stream_write ... http_stream_end:
 * chunked transfer, the connection resumed whenever there is something to send).
 *
 * Limits: max_header_bytes for the request line and headers (MHD's connection memory: 431
 * above); max_connections and max_connections_per_client, counted as connections are accepted
 * (here, not by MHD): past either, the oldest idle connection (no request in progress) of all
 * or of that address is closed to make room, and only when none is idle is the new one
 * refused (503, or 429 for one address, then closed), so idle clients cannot starve the port;
 * header_timeout_ms for a request head to arrive, and timeout_ms both as the idle timeout and
 * as the time a request (headers and body) has to arrive in full, from the connection's start
 * or the end of its previous request (a slow-loris client gets 408 and its connection
 * closed).  Routes marked
 * auth need "Authorization: Bearer <api_key>" (or Anthropic's "x-api-key: <api_key>") when a
 * key is set (401 otherwise).  Errors the
 * server answers itself are OpenAI error objects.
 *
 * Lifetime: a struct http_req is valid from its handler's call until on_close has run (it
 * runs exactly once, when MHD is done with the request, completed or not); a door that stops
 * caring earlier clears it with http_req_on_close(hr, NULL, NULL).  Loop thread only.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "rpc.h"

struct http_server;
struct http_req;

typedef void (*http_handler_fn)(struct http_req *hr, void *ud);
typedef void (*http_close_fn)(struct http_req *hr, bool completed, void *ud);
/* An error answer's body (malloc'd JSON text) in an API's shape; NULL when out of memory. */
typedef char *(*http_error_fn)(unsigned status, const char *param, const char *msg);

struct http_route {
    const char *method;             /* "GET", "POST" */
    const char *path;               /* exact path, without the query; a last segment "*" matches any one segment */
    bool auth;                      /* needs the API key (when one is set) */
    http_handler_fn fn;
    http_error_fn error_body;       /* the errors of a request to this path, those http.c answers
                                       itself too (401, 403, 408, 413, 415, framing); NULL: OpenAI's */
};

struct http_server_opts {
    const char *host;               /* "127.0.0.1", "::1", "0.0.0.0", "localhost" */
    int port;                       /* 0: any free port */
    const struct rpc_tls_files *tls;    /* NULL: plaintext */
    const char *api_key;            /* NULL: none */
    size_t max_body_bytes;
    size_t max_header_bytes;
    unsigned max_connections;       /* at once; a new one past it closes the oldest idle one
                                       (no request in progress), else is refused 503 */
    unsigned max_connections_per_client;    /* of one client address, the same way but 429;
                                               0: none */
    unsigned timeout_ms;            /* a request, head and body, must arrive within this */
    unsigned header_timeout_ms;     /* a request head must arrive within this (0: timeout_ms) */
    size_t stream_buffer_bytes;     /* queued stream bytes before a slow reader is cut */
    const struct http_route *routes;
    size_t n_routes;
    void *ud;                       /* handed to every handler */
    const char *name;               /* for the log: "http", "metrics" */
    /* browsers (DNS rebinding, cross-origin requests): both a JSON list '["a","b"]' or a
     * comma-separated one; "*" matches everything */
    const char *allowed_hosts;      /* Host names served beside IP literals, localhost and
                                       host; NULL: those only (403 otherwise) */
    const char *allowed_origins;    /* Origins served, with CORS headers and preflights;
                                       NULL: a request with an Origin is refused (403) */
};

/* Bind and start serving on loop.  -EADDRINUSE, -EINVAL (bad host or TLS files), ... with
 * the reason logged. */
int http_server_start(uv_loop_t *loop, const struct http_server_opts *o, struct http_server **ret);
int http_server_port(const struct http_server *s);
/* Stop accepting connections (the drain's end); requests in progress go on. */
void http_server_quiesce(struct http_server *s);
/* Requests in progress (handlers run, response not yet done). */
unsigned http_server_active(const struct http_server *s);
/* Close everything and free (suspended connections are resumed first).  The uv handles
 * close on the loop: run it once more afterwards. */
void http_server_stop(struct http_server *s);

/* ---- one request (the handler's) ---- */
const char *http_req_method(const struct http_req *hr);
const char *http_req_path(const struct http_req *hr);
/* The body as received (NUL-terminated; may hold NULs before len). */
const char *http_req_body(const struct http_req *hr, size_t *len);
/* The client's address ("ipv4:127.0.0.1:4242") and whether it presented the API key (with the
 * key's hash, coord_fnv1a, in *key_hash). */
const char *http_req_peer(const struct http_req *hr);
bool http_req_keyed(const struct http_req *hr, uint64_t *key_hash);
/* Called when MHD is done with the request (completed: the whole response went out). */
void http_req_on_close(struct http_req *hr, http_close_fn fn, void *ud);

/* The whole answer (body copied).  headers: NULL or a NULL-terminated list of
 * "Name", "value" pairs. */
int http_respond(struct http_req *hr, unsigned status, const char *ctype, const char *body, size_t len,
                 const char *const *headers);
/* An OpenAI error object: {"error": {"message", "type", "param", "code"}}; type and code
 * from the status; param NULL = null. */
int http_respond_error(struct http_req *hr, unsigned status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A streamed answer: status and content type now, the body as it comes. */
int http_stream_start(struct http_req *hr, unsigned status, const char *ctype);
/* Append to the stream: 0, or -ENOBUFS when the client has not read stream_buffer_bytes
 * (nothing appended: end the stream with http_req_abort). */
int http_stream_write(struct http_req *hr, const char *data, size_t len);
void http_stream_end(struct http_req *hr);
/* Drop the connection now (a slow reader): on_close runs later, not completed. */
void http_req_abort(struct http_req *hr);
