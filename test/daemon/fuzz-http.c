/* fuzz-http.c - libFuzzer target: the HTTP door, raw bytes in (docs/RELIABILITY.md C10,
 * issue 41).  One http_server (daemon/http.c over libmicrohttpd, on a libuv loop, with the
 * limits, API key, Host/Origin checks and framing checks stepd's API port has) serves a few
 * routes whose handlers stand in for the engine: one answers the body's length at once, one
 * streams it back in chunks.  Each input is written to a fresh loopback connection, whose
 * write side is then shut; the loop runs until the server closes the connection (bounded).
 * Checks per input: whatever came back starts with an HTTP/1.x status line; once the client
 * is gone no request stays in progress (http_server_active() == 0); and the server still
 * answers a normal GET /health on a new connection.  The committed corpus (corpus/http: the
 * framing, browser and limit cases of test_http_*.py as raw requests) replays in 'unit';
 * with CC=clang -Dfuzz=true a bounded run is in suite 'fuzz'. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <uv.h>

#include "http.h"
#include "log.h"

#define SPINS 400           /* loop turns (1 ms polls) an input may take before the client gives up */
#define SETTLE 650          /* turns for the server to end every request once the client left */
#define QUIET 10            /* turns without a new byte, once all is sent, before it does */

static uv_loop_t loop;
static struct http_server *srv;

static void h_answer(struct http_req *hr, void *ud)
{
    size_t n;
    char body[64];

    (void)ud;
    http_req_body(hr, &n);
    snprintf(body, sizeof(body), "{\"bytes\":%zu}", n);
    http_respond(hr, 200, "application/json", body, strlen(body), NULL);
}

static void h_stream(struct http_req *hr, void *ud)
{
    size_t n;
    const char *b = http_req_body(hr, &n);

    (void)ud;
    if (http_stream_start(hr, 200, "text/event-stream") < 0)
        return;
    for (size_t off = 0; off < n; off += 7)
        if (http_stream_write(hr, b + off, n - off < 7 ? n - off : 7) < 0) {
            http_req_abort(hr);
            return;
        }
    http_stream_end(hr);
}

static void h_health(struct http_req *hr, void *ud)
{
    (void)ud;
    http_respond(hr, 200, "text/plain", "ok\n", 3, NULL);
}

static const struct http_route routes[] = {
    { "POST", "/v1/chat/completions", true, h_stream, NULL },
    { "POST", "/v1/completions", true, h_answer, NULL },
    { "GET", "/v1/models/*", true, h_answer, NULL },
    { "GET", "/health", false, h_health, NULL },
};

static void server_start(void)
{
    struct http_server_opts o = {
        .host = "127.0.0.1",
        .api_key = "fuzz-key",
        .max_body_bytes = 4096,
        .max_header_bytes = 8192,
        .max_connections = 8,
        .max_connections_per_client = 4,
        .timeout_ms = 200,          /* short: see settle() */
        .header_timeout_ms = 100,
        .stream_buffer_bytes = 1 << 16,
        .routes = routes,
        .n_routes = sizeof(routes) / sizeof(routes[0]),
        .name = "fuzz-http",
        .allowed_hosts = "api.example",
        .allowed_origins = "http://ok.example",
    };

    log_init("fuzz-http", NULL);
    log_set_level(getenv("FUZZ_HTTP_LOG") ? LOG_LEVEL_DEBUG : LOG_LEVEL_ERROR);
    if (uv_loop_init(&loop) < 0 || http_server_start(&loop, &o, &srv) < 0) {
        fprintf(stderr, "fuzz-http: the HTTP server did not start\n");
        abort();
    }
}

static int dial(void)
{
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)http_server_port(srv)) };
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0 ||
        (connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0 && errno != EINPROGRESS && errno != EINTR)) {
        fprintf(stderr, "fuzz-http: connect: %s\n", strerror(errno));
        abort();
    }
    /* the connect completes once the server's loop (this thread's) makes room in its accept
     * backlog: run it until the socket is writable.  A blocking connect here was interrupted by
     * libFuzzer's timer signal (EINTR) when the backlog was full. */
    for (int spin = 0;; spin++) {
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        int err = 0;
        socklen_t len = sizeof(err);

        if (poll(&p, 1, 0) > 0) {
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err) {
                fprintf(stderr, "fuzz-http: connect: %s\n", strerror(err ? err : errno));
                abort();
            }
            return fd;
        }
        if (spin == 1000000) {
            fprintf(stderr, "fuzz-http: connect: the server never accepted\n");
            abort();
        }
        uv_run(&loop, UV_RUN_NOWAIT);
    }
}

/* Send data on a new connection, shut the write side, collect the answer (its first bytes in
 * head) until the server closes, nothing more comes for QUIET turns or SPINS turns pass (the
 * handlers answer at once: any answer comes within a turn or two).  Returns the bytes
 * received. */
static size_t exchange(const uint8_t *data, size_t size, char *head, size_t head_cap)
{
    int fd = dial();
    size_t sent = 0, got = 0, last = 0;
    bool shut = false;
    int quiet = 0;
    char buf[16384];

    for (int spin = 0; spin < SPINS; spin++) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        ssize_t n = 0;

        while (sent < size && (n = send(fd, data + sent, size - sent, MSG_NOSIGNAL)) > 0)
            sent += (size_t)n;
        if (!shut && (sent == size || (n < 0 && errno != EAGAIN))) {
            shutdown(fd, SHUT_WR);
            shut = true;
        }
        uv_run(&loop, UV_RUN_NOWAIT);
        poll(&p, 1, 1);
        while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
            if (got < head_cap)
                memcpy(head + got, buf, (size_t)n < head_cap - got ? (size_t)n : head_cap - got);
            got += (size_t)n;
        }
        if (n == 0 || (n < 0 && errno != EAGAIN))
            break;
        /* everything sent and a quiet while: the server waits for more (a partial head, a
         * keep-alive connection): the client leaves */
        quiet = got == last ? quiet + 1 : 0;
        last = got;
        if (shut && quiet >= QUIET)
            break;
    }
    close(fd);
    return got;
}

/* Run the loop until the server has no request in progress.  A client that leaves in the
 * middle of a body (its FIN came with the body's last bytes) is not noticed by
 * libmicrohttpd: its request ends at the request timeout (timeout_ms, checked every
 * SWEEP_MS = 250 ms), so the bound is SETTLE turns, past both, and under libFuzzer's -timeout. */
static void settle(void)
{
    for (int spin = 0; spin < SETTLE && http_server_active(srv) > 0; spin++) {
        uv_run(&loop, UV_RUN_NOWAIT);
        poll(NULL, 0, 1);
    }
    if (http_server_active(srv) > 0) {
        fprintf(stderr, "fuzz-http: %u requests still in progress after their client left\n",
                http_server_active(srv));
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char health[] = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    char head[16];
    size_t got;

    if (!srv)
        server_start();
    got = exchange(data, size, head, sizeof(head));
    if (got > 0 && (got < 12 || memcmp(head, "HTTP/1.", 7) != 0)) {
        fprintf(stderr, "fuzz-http: an answer that is not an HTTP/1.x status line: '%.*s'\n",
                (int)(got < sizeof(head) ? got : sizeof(head)), head);
        abort();
    }
    settle();
    got = exchange((const uint8_t *)health, sizeof(health) - 1, head, sizeof(head));
    if (got < 12 || memcmp(head, "HTTP/1.1 200", 12) != 0) {
        fprintf(stderr, "fuzz-http: GET /health after the input was not answered 200 (%zu bytes)\n", got);
        abort();
    }
    settle();
    return 0;
}
