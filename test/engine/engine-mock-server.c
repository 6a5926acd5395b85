/* engine-mock-server.c - test helper: the stepd.v1.Engine service over the mock forward on
 * 127.0.0.1:0 (--output-stream-buffer BYTES: engine_rpc_opts.output_stream_buffer).
 * Prints "PORT <n>" once listening, serves until stdin reaches EOF, then
 * stops the service and the engine and exits 0 only if the KV invariant holds (every
 * block free, no request state alive).  Used by test-engine-grpcio.py (a real grpcio
 * client). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine-rig.h"
#include "engine.h"
#include "log.h"
#include "mock.h"

int main(int argc, char **argv)
{
    log_init("engine-mock-server", NULL);
    /* --output-stream-buffer BYTES: engine_rpc_opts.output_stream_buffer */
    size_t ostream_buffer = 0;
    if (argc == 3 && strcmp(argv[1], "--output-stream-buffer") == 0) {
        ostream_buffer = strtoull(argv[2], NULL, 10);
    } else if (argc != 1) {
        fprintf(stderr, "usage: engine-mock-server [--output-stream-buffer BYTES]\n");
        return 2;
    }
    struct forward *f;
    struct engine *e = rig_mock_engine(300, 8, 3, &f);
    struct err_buf err;
    struct engine_rpc *srv;
    struct engine_rpc_opts o = { .addr = "127.0.0.1:0", .group = "g-mock", .model_name = "mock",
                                 .model_type = "mock", .output_stream_buffer = ostream_buffer };
    int port;
    if (engine_rpc_start(e, &o, &srv, &port, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("PORT %d\n", port);
    fflush(stdout);
    char buf[256];
    while (read(0, buf, sizeof(buf)) > 0)
        ;
    engine_rpc_stop(srv);
    for (int i = 0; i < 5000; i++) {
        struct engine_loads l;
        engine_get_loads(e, &l);
        if (!l.n_alive)
            break;
        usleep(1000);
    }
    engine_stop(e);
    int r = engine_check(e);
    struct engine_loads l;
    engine_get_loads(e, &l);
    fprintf(stderr, "engine-mock-server: %llu requests created, %llu freed, %d KV blocks used: %s\n",
            (unsigned long long) l.n_requests_created, (unsigned long long) l.n_requests_freed,
            l.kv_blocks_used, r == 0 ? "invariant ok" : "INVARIANT VIOLATED");
    engine_free(e);
    f->ops->free(f);
    return r == 0 ? 0 : 3;
}
