/* main.c - `stepd`, the coordinator: flags, logging, coord_new/coord_run. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "file.h"
#include "coord.h"
#include "err.h"
#include "log.h"
#include "serve.h"
#include "stepd-config.h"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: stepd [options]\n"
        "       stepd serve MODEL_DIR [options] [serve options]\n"
        "Coordinator for stepd worker groups: public gRPC API (stepd.v1.Inference),\n"
        "Admin, worker control service, health and Prometheus metrics.\n\n"
        "Listening (loopback by default):\n"
        "  --listen ADDR              public gRPC (default 127.0.0.1:20051; unix:/path allowed)\n"
        "  --admin-listen ADDR        Admin + health (default 127.0.0.1:20053)\n"
        "  --control-listen ADDR      worker control (default 127.0.0.1:20052)\n"
        "  --metrics-listen ADDR      HTTP /metrics, /healthz, /health, /ready (default 127.0.0.1:9464;\n"
        "                             \"\" = off; /metrics is also on the API port)\n"
        "  --host HOST --port PORT    OpenAI HTTP API (default 127.0.0.1 port 8000; --port off = none)\n"
        "  --insecure-listen          allow non-loopback listens without TLS + API key\n"
        "Security:\n"
        "  --tls-cert FILE --tls-key FILE   TLS on the public port\n"
        "  --tls-client-ca FILE       CA for client certificates\n"
        "  --tls-require-client-cert  mTLS (needs --tls-client-ca)\n"
        "  --api-key-file FILE        API key for every RPC except health (or $STEPD_API_KEY)\n"
        "  --control-key-file FILE    the cluster key: workers send it, their engines check it\n"
        "                             (or $STEPD_CONTROL_KEY; required, as `stepd serve` makes one)\n"
        "  --insecure-control         no control key: accept keyless workers (and engines)\n"
        "Text:\n"
        "  --tokenizer FILE           tokenizer.json (enables text/chat input, Tokenize)\n"
        "  --model-name NAME          served model name (default: reported by rank 0)\n"
        "  --served-model-name NAME   the same; repeat it (or NAME,ALIAS,...) for aliases the model\n"
        "                             answers to (the first is the one reported)\n"
        "  --reasoning-parser P       step3p5 (default) or none: reasoning split from the content\n"
        "  --tool-call-parser P       step3p5 (default) or none: tool calls parsed from the output\n"
        "  --enable-auto-tool-choice  accepted (tool_choice \"auto\" is served with the parser)\n"
        "  --vocab-size N             vocabulary size until an engine reports one\n"
        "Limits:\n"
        "  --max-running N            requests in flight to engines (default 1024)\n"
        "  --max-queue N              requests waiting for a slot (default 1024)\n"
        "  --max-input-tokens N       prompt cap (default: context length)\n"
        "  --max-tokens-cap N         cap on max_tokens (default 32768)\n"
        "  --default-max-tokens N     max_tokens when unset (default 256)\n"
        "  --max-recv-msg-bytes N     gRPC receive limit (default 4194304)\n"
        "  --max-concurrent-streams N per connection (default 1024)\n"
        "  --stream-buffer-bytes N    per-stream send buffer before a slow client is cut (1 MiB)\n"
        "  --max-n N                  HTTP: cap on n, choices per request (default 16)\n"
        "  --http-max-body-bytes N    HTTP request body cap, 413 above (default 4194304)\n"
        "  --http-max-header-bytes N  HTTP request line + headers cap, 431 above (default 32768)\n"
        "  --http-max-connections N   HTTP connections at once (default 1024; idle ones make room)\n"
        "  --http-max-connections-per-ip N  HTTP connections of one client address (default 256)\n"
        "  --http-header-timeout SECONDS  HTTP: a request head must arrive within this (default 10)\n"
        "  --http-timeout SECONDS     HTTP: a request must arrive within this; idle connections close\n"
        "                             after it (default 30)\n"
        "  --request-timeout SECONDS  HTTP: deadline of a generation request, 504 past it (0 = none)\n"
        "  --allowed-hosts LIST       HTTP: Host names served beside IP literals, localhost and --host\n"
        "                             (comma-separated or a JSON list; \"*\" any)\n"
        "  --allowed-origins LIST     HTTP: browser origins served with CORS (default none: a request\n"
        "                             with an Origin header is refused)\n"
        "Behaviour:\n"
        "  --drain-timeout SECONDS    finish in-flight work within this on SIGTERM (default 30)\n"
        "  --heartbeat-ms N           control heartbeat period (default 1000)\n"
        "  --loads-poll-ms N          engine GetLoads period (default 250)\n"
        "  --worker-timeout-ms N      declare a silent rank gone after N ms (default 10000)\n"
        "  --prefix-affinity N        route a request to the group that holds the longest prefix of\n"
        "                             its prompt, in blocks of N tokens (default 16; 0 = off)\n"
        "  --prefix-affinity-entries N  prompt blocks remembered for that (default 65536)\n"
        "  --log-level LEVEL          error|warn|info|debug\n"
        "  --version, --help\n"
        "stepd serve MODEL_DIR: this coordinator starts and supervises its worker ranks\n"
        "(names as vLLM's where the meaning is the same):\n"
        "  --tensor-parallel-size N   ranks per group: 1, 2, 4, 8 (default 1)\n"
        "  --data-parallel-size D     groups (default 1)\n"
        "  --device cpu|cuda          rank r of group d runs on cuda:(d*N + r) (default cpu)\n"
        "  --enable-expert-parallel   accepted: routed experts are always expert-parallel over a group\n"
        "  --speculative-config JSON  '{\"method\":\"mtp\",\"num_speculative_tokens\":K}', K 0..3\n"
        "  --max-model-len L, --max-num-batched-tokens T, --max-num-seqs S   engine sizes\n"
        "  --gpu-memory-utilization F passed to workers that take it\n"
        "  --threads T                CPU threads per rank (default: the CPUs shared out)\n"
        "  --worker-binary PATH       stepd-worker to run (default: beside stepd, else $PATH)\n"
        "  --worker-arg ARG           one more flag for every rank (repeatable)\n"
        "  --worker-restart-limit N   failures in a row before a group is given up (default 5)\n"
        "  --worker-backoff-ms MS     first restart delay, doubling up to --worker-backoff-max-ms\n"
        "                             (defaults 500 and 30000)\n"
        "  --worker-stop-timeout S    seconds ranks get to stop before SIGTERM (default 15)\n"
        "  --spec-log-interval S      spec-decoding metrics in the log every S s (default 10, 0 = off)\n"
        "The control key is generated per run (or --control-key-file) and handed to the ranks in\n"
        "a file; the tokenizer defaults to MODEL_DIR/tokenizer.json.\n");
}

static int parse_uint(const char *flag, const char *s, unsigned long max, unsigned long *ret)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v > max) {
        log_error("%s: expected an integer in [0, %lu], got '%s'", flag, max, s);
        return -EINVAL;
    }
    *ret = v;
    return 0;
}

/* glibc malloc settings for the coordinator: no per-thread caches (tcache) and one
 * arena. Every thread of gRPC keeps up to 7 freed chunks of each small size in its
 * tcache, and each thread allocates in an arena of its own; after a load those
 * chunks lie scattered over the heaps, so the pages under them stay resident even
 * though the load's memory was freed and trimmed. Measured after 1000-stream loads
 * (docs/RELIABILITY.md A1, RSS within 5 % of the pre-test figure after idle): with the glibc
 * defaults RSS stayed 6-10 % up; with these two settings 1-3 %, and the coordinator's
 * CPU per token did not change (bench_coord.py cost; its threads are few and mostly
 * one at a time, so one arena is not contended).
 *
 * The tcache size is a tunable that glibc reads only when a program starts, so stepd
 * runs itself again, once, with GLIBC_TUNABLES set, and puts the variable back as it
 * was for anything it might start. Not done when the operator set either tunable
 * already, with STEPD_MALLOC_TUNE=0, under valgrind (/proc/self/exe is the tool
 * there), in sanitizer builds (their allocator is not glibc's), or when the file
 * it was started from is gone (replaced on disk). */
#define MALLOC_TUNABLES "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=1"
#define MALLOC_TUNED_ENV "STEPD_MALLOC_TUNED"

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define STEPD_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STEPD_SANITIZED 1
#endif

/* true when malloc_tune() found its settings in effect */
static bool malloc_tuned;

static void malloc_tune(char **argv)
{
#if defined(__GLIBC__) && !defined(STEPD_SANITIZED)
    const char *tuned = getenv(MALLOC_TUNED_ENV);
    if (tuned) {
        /* second run: the tunables are in effect; restore the environment */
        malloc_tuned = true;
        if (tuned[0] == '=')
            setenv("GLIBC_TUNABLES", tuned + 1, 1);
        else
            unsetenv("GLIBC_TUNABLES");
        unsetenv(MALLOC_TUNED_ENV);
        return;
    }
    const char *opt = getenv("STEPD_MALLOC_TUNE");
    if (opt && strcmp(opt, "0") == 0)
        return;
    const char *cur = getenv("GLIBC_TUNABLES");
    if (cur && (strstr(cur, "glibc.malloc.tcache_count") || strstr(cur, "glibc.malloc.arena_max")))
        return;
    const char *pre = getenv("LD_PRELOAD");
    if (pre && strstr(pre, "vgpreload"))
        return;
    size_t n = (cur ? strlen(cur) : 0) + sizeof(MALLOC_TUNABLES) + 2;
    char *val = malloc(n), *saved = malloc(n);
    if (!val || !saved)
        goto out;
    snprintf(val, n, "%s%s" MALLOC_TUNABLES, cur ? cur : "", cur && *cur ? ":" : "");
    snprintf(saved, n, "%s%s", cur ? "=" : "-", cur ? cur : "");
    /* the program's own path, not /proc/self/exe: the process name (ps, ss, systemd)
     * comes from the file name run */
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (len <= 0 || (size_t)len >= sizeof(self) - 1)
        goto out;
    self[len] = '\0';
    if (strstr(self, " (deleted)"))
        goto out;                      /* replaced on disk since it started */
    if (setenv(MALLOC_TUNED_ENV, saved, 1) == 0 && setenv("GLIBC_TUNABLES", val, 1) == 0) {
        execv(self, argv);
        fprintf(stderr, "stepd: warning: running itself again for its malloc settings failed (%s); "
                "continuing with glibc's defaults\n", strerror(errno));
    }
    if (cur)
        setenv("GLIBC_TUNABLES", cur, 1);
    else
        unsetenv("GLIBC_TUNABLES");
    unsetenv(MALLOC_TUNED_ENV);
out:
    free(val);
    free(saved);
#else
    (void)argv;
#endif
}

enum {
    OPT_LISTEN = 256, OPT_ADMIN, OPT_CONTROL, OPT_METRICS, OPT_INSECURE, OPT_TLS_CERT, OPT_TLS_KEY,
    OPT_TLS_CA, OPT_TLS_REQ, OPT_KEY_FILE, OPT_CKEY_FILE, OPT_TOKENIZER, OPT_MODEL, OPT_VOCAB,
    OPT_MAX_RUNNING, OPT_MAX_QUEUE, OPT_MAX_INPUT, OPT_MAX_TOKENS_CAP, OPT_DEF_MAX_TOKENS, OPT_MAX_RECV,
    OPT_MAX_STREAMS, OPT_STREAM_BUF, OPT_DRAIN, OPT_HEARTBEAT, OPT_LOADS, OPT_AFFINITY, OPT_AFFINITY_N, OPT_LOG, OPT_VERSION,
    OPT_API_KEY, OPT_WTIMEOUT, OPT_HOST, OPT_PORT, OPT_SERVED, OPT_RPARSER, OPT_TPARSER, OPT_AUTO_TOOLS,
    OPT_MAX_N, OPT_HTTP_BODY, OPT_HTTP_HEADER, OPT_HTTP_CONNS, OPT_HTTP_TIMEOUT, OPT_REQ_TIMEOUT, OPT_INSECURE_CTL,
    OPT_ALLOWED_HOSTS, OPT_ALLOWED_ORIGINS, OPT_HTTP_CONNS_IP, OPT_HTTP_HEAD_TIMEOUT,
    /* stepd serve */
    OPT_S_TP, OPT_S_DP, OPT_S_DEVICE, OPT_S_EP, OPT_S_SPEC, OPT_S_MAXLEN, OPT_S_MAXBT, OPT_S_MAXSEQS,
    OPT_S_GPUMEM, OPT_S_THREADS, OPT_S_WBIN, OPT_S_WARG, OPT_S_LIMIT, OPT_S_BACKOFF,
    OPT_S_BACKOFF_MAX, OPT_S_STOP, OPT_S_SPECLOG,
};

#define SERVE_MAX_WORKER_ARGS 32
#define SERVE_MAX_NAMES 16

/* Seconds as milliseconds, in [0, 86400]. */
static int parse_seconds(const char *flag, const char *s, unsigned *ret)
{
    char *end;
    double v = strtod(s, &end);

    if (end == s || *end || !(v >= 0 && v <= 86400)) {
        log_error("%s: expected seconds in [0, 86400], got '%s'", flag, s);
        return -EINVAL;
    }
    *ret = (unsigned)(v * 1000.0);
    return 0;
}

/* "step3p5" or "none". */
static int parse_parser(const char *flag, const char *s, bool *ret)
{
    if (!strcmp(s, "step3p5") || !strcmp(s, "step3")) {
        *ret = true;
        return 0;
    }
    if (!strcmp(s, "none")) {
        *ret = false;
        return 0;
    }
    log_error("%s: stepd has the step3p5 parser (or none), not '%s'", flag, s);
    return -EINVAL;
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "listen", required_argument, NULL, OPT_LISTEN },
        { "admin-listen", required_argument, NULL, OPT_ADMIN },
        { "control-listen", required_argument, NULL, OPT_CONTROL },
        { "metrics-listen", required_argument, NULL, OPT_METRICS },
        { "insecure-listen", no_argument, NULL, OPT_INSECURE },
        { "insecure-control", no_argument, NULL, OPT_INSECURE_CTL },
        { "tls-cert", required_argument, NULL, OPT_TLS_CERT },
        { "tls-key", required_argument, NULL, OPT_TLS_KEY },
        { "tls-client-ca", required_argument, NULL, OPT_TLS_CA },
        { "tls-require-client-cert", no_argument, NULL, OPT_TLS_REQ },
        { "api-key-file", required_argument, NULL, OPT_KEY_FILE },
        { "api-key", required_argument, NULL, OPT_API_KEY },
        { "control-key-file", required_argument, NULL, OPT_CKEY_FILE },
        { "tokenizer", required_argument, NULL, OPT_TOKENIZER },
        { "model-name", required_argument, NULL, OPT_MODEL },
        { "vocab-size", required_argument, NULL, OPT_VOCAB },
        { "max-running", required_argument, NULL, OPT_MAX_RUNNING },
        { "max-queue", required_argument, NULL, OPT_MAX_QUEUE },
        { "max-input-tokens", required_argument, NULL, OPT_MAX_INPUT },
        { "max-tokens-cap", required_argument, NULL, OPT_MAX_TOKENS_CAP },
        { "default-max-tokens", required_argument, NULL, OPT_DEF_MAX_TOKENS },
        { "max-recv-msg-bytes", required_argument, NULL, OPT_MAX_RECV },
        { "max-concurrent-streams", required_argument, NULL, OPT_MAX_STREAMS },
        { "stream-buffer-bytes", required_argument, NULL, OPT_STREAM_BUF },
        { "drain-timeout", required_argument, NULL, OPT_DRAIN },
        { "heartbeat-ms", required_argument, NULL, OPT_HEARTBEAT },
        { "loads-poll-ms", required_argument, NULL, OPT_LOADS },
        { "worker-timeout-ms", required_argument, NULL, OPT_WTIMEOUT },
        { "prefix-affinity", required_argument, NULL, OPT_AFFINITY },
        { "prefix-affinity-entries", required_argument, NULL, OPT_AFFINITY_N },
        { "log-level", required_argument, NULL, OPT_LOG },
        { "version", no_argument, NULL, OPT_VERSION },
        { "tensor-parallel-size", required_argument, NULL, OPT_S_TP },
        { "data-parallel-size", required_argument, NULL, OPT_S_DP },
        { "device", required_argument, NULL, OPT_S_DEVICE },
        { "enable-expert-parallel", no_argument, NULL, OPT_S_EP },
        { "speculative-config", required_argument, NULL, OPT_S_SPEC },
        { "max-model-len", required_argument, NULL, OPT_S_MAXLEN },
        { "max-num-batched-tokens", required_argument, NULL, OPT_S_MAXBT },
        { "max-num-seqs", required_argument, NULL, OPT_S_MAXSEQS },
        { "gpu-memory-utilization", required_argument, NULL, OPT_S_GPUMEM },
        { "served-model-name", required_argument, NULL, OPT_SERVED },
        { "host", required_argument, NULL, OPT_HOST },
        { "port", required_argument, NULL, OPT_PORT },
        { "reasoning-parser", required_argument, NULL, OPT_RPARSER },
        { "tool-call-parser", required_argument, NULL, OPT_TPARSER },
        { "enable-auto-tool-choice", no_argument, NULL, OPT_AUTO_TOOLS },
        { "max-n", required_argument, NULL, OPT_MAX_N },
        { "http-max-body-bytes", required_argument, NULL, OPT_HTTP_BODY },
        { "http-max-header-bytes", required_argument, NULL, OPT_HTTP_HEADER },
        { "http-max-connections", required_argument, NULL, OPT_HTTP_CONNS },
        { "http-timeout", required_argument, NULL, OPT_HTTP_TIMEOUT },
        { "request-timeout", required_argument, NULL, OPT_REQ_TIMEOUT },
        { "allowed-hosts", required_argument, NULL, OPT_ALLOWED_HOSTS },
        { "http-max-connections-per-ip", required_argument, NULL, OPT_HTTP_CONNS_IP },
        { "http-header-timeout", required_argument, NULL, OPT_HTTP_HEAD_TIMEOUT },
        { "allowed-origins", required_argument, NULL, OPT_ALLOWED_ORIGINS },
        { "threads", required_argument, NULL, OPT_S_THREADS },
        { "worker-binary", required_argument, NULL, OPT_S_WBIN },
        { "worker-arg", required_argument, NULL, OPT_S_WARG },
        { "worker-restart-limit", required_argument, NULL, OPT_S_LIMIT },
        { "worker-backoff-ms", required_argument, NULL, OPT_S_BACKOFF },
        { "worker-backoff-max-ms", required_argument, NULL, OPT_S_BACKOFF_MAX },
        { "worker-stop-timeout", required_argument, NULL, OPT_S_STOP },
        { "spec-log-interval", required_argument, NULL, OPT_S_SPECLOG },
        { "help", no_argument, NULL, 'h' },
        { NULL, 0, NULL, 0 },
    };
    struct coord_opts o;
    struct coord *co = NULL;
    char *api_key = NULL, *ctl_key = NULL;
    const char *key_file = NULL, *ckey_file = NULL;
    unsigned long v;
    int c, r, rc = 2;
    /* stepd serve */
    struct serve_opts so;
    struct serve *sv = NULL;
    const char *worker_args[SERVE_MAX_WORKER_ARGS];
    const char *serve_flag = NULL;  /* the first serve-only flag seen */
    char tokenizer[4096], model_name[256];
    char *served = NULL;            /* --served-model-name NAME[,ALIAS...], repeated: all of them */
    const char *aliases[SERVE_MAX_NAMES];
    size_t n_names = 0;
    bool serve_mode = argc > 1 && strcmp(argv[1], "serve") == 0;

    malloc_tune(argv);
    log_init("stepd", NULL);
    serve_opts_default(&so);
    so.worker_args = worker_args;
    if (serve_mode) {
        argv++;                     /* getopt sees "serve" as the program name */
        argc--;
    }
    log_debug("malloc: %s", malloc_tuned ? "glibc per-thread caches off, one arena (STEPD_MALLOC_TUNE=0 keeps "
                                           "glibc's defaults)" : "glibc's defaults");
    coord_opts_default(&o);
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case OPT_LISTEN: o.listen = optarg; break;
        case OPT_ADMIN: o.admin_listen = optarg; break;
        case OPT_CONTROL: o.control_listen = optarg; break;
        case OPT_METRICS: o.metrics_listen = optarg; break;
        case OPT_INSECURE: o.insecure_listen = true; break;
        case OPT_INSECURE_CTL: o.insecure_control = true; break;
        case OPT_TLS_CERT: o.tls.cert_file = optarg; break;
        case OPT_TLS_KEY: o.tls.key_file = optarg; break;
        case OPT_TLS_CA: o.tls.root_file = optarg; break;
        case OPT_TLS_REQ: o.tls.require_client_cert = true; break;
        case OPT_KEY_FILE: key_file = optarg; break;
        case OPT_CKEY_FILE: ckey_file = optarg; break;
        case OPT_API_KEY:
            log_error("--api-key: keys are never taken from the command line (visible in ps); "
                      "use --api-key-file FILE or $STEPD_API_KEY");
            return 2;
        case OPT_TOKENIZER: o.tokenizer_path = optarg; break;
        case OPT_MODEL: o.model_name = optarg; break;
#define UINT_OPT(id, flag, max, field) \
        case id: if (parse_uint(flag, optarg, max, &v) < 0) return 2; o.field = v; break;
        UINT_OPT(OPT_VOCAB, "--vocab-size", 1u << 30, fallback_vocab_size)
        UINT_OPT(OPT_MAX_RUNNING, "--max-running", 1u << 20, max_running)
        UINT_OPT(OPT_MAX_QUEUE, "--max-queue", 1u << 20, max_queue)
        UINT_OPT(OPT_MAX_INPUT, "--max-input-tokens", 1u << 24, max_input_tokens)
        UINT_OPT(OPT_MAX_TOKENS_CAP, "--max-tokens-cap", 1u << 24, max_tokens_cap)
        UINT_OPT(OPT_DEF_MAX_TOKENS, "--default-max-tokens", 1u << 24, default_max_tokens)
        UINT_OPT(OPT_MAX_RECV, "--max-recv-msg-bytes", 1u << 30, max_recv_msg_bytes)
        UINT_OPT(OPT_MAX_STREAMS, "--max-concurrent-streams", 1u << 20, max_concurrent_streams)
        UINT_OPT(OPT_STREAM_BUF, "--stream-buffer-bytes", 1u << 30, max_call_buffer_bytes)
        UINT_OPT(OPT_HEARTBEAT, "--heartbeat-ms", 3600000, heartbeat_ms)
        UINT_OPT(OPT_LOADS, "--loads-poll-ms", 3600000, loads_poll_ms)
        UINT_OPT(OPT_WTIMEOUT, "--worker-timeout-ms", 3600000, worker_timeout_ms)
        UINT_OPT(OPT_AFFINITY, "--prefix-affinity", 1u << 20, prefix_affinity)
        UINT_OPT(OPT_AFFINITY_N, "--prefix-affinity-entries", 1u << 24, prefix_affinity_entries)
        UINT_OPT(OPT_MAX_N, "--max-n", 128, max_n)
        UINT_OPT(OPT_HTTP_BODY, "--http-max-body-bytes", 1u << 30, http_max_body_bytes)
        UINT_OPT(OPT_HTTP_HEADER, "--http-max-header-bytes", 1u << 24, http_max_header_bytes)
        UINT_OPT(OPT_HTTP_CONNS, "--http-max-connections", 1u << 20, http_max_connections)
        UINT_OPT(OPT_HTTP_CONNS_IP, "--http-max-connections-per-ip", 1u << 20, http_max_connections_per_ip)
#undef UINT_OPT
        case OPT_DRAIN: {
            char *end;
            double s = strtod(optarg, &end);
            if (end == optarg || *end || !(s >= 0 && s <= 86400)) {
                log_error("--drain-timeout: expected seconds in [0, 86400], got '%s'", optarg);
                return 2;
            }
            o.drain_timeout_ms = (unsigned)(s * 1000.0);
            break;
        }
        case OPT_LOG: {
            enum log_level l;
            if (log_level_parse(optarg, &l) < 0) {
                log_error("--log-level: expected error|warn|info|debug, got '%s'", optarg);
                return 2;
            }
            log_set_level(l);
            break;
        }
        case OPT_VERSION:
            printf("stepd %s\n", STEPD_VERSION);
            return 0;
#define SERVE_UINT(id, flag, lo, hi, field) \
        case id: serve_flag = serve_flag ? serve_flag : flag; \
            if (parse_uint(flag, optarg, hi, &v) < 0) return 2; \
            if (v < lo) { log_error("%s: at least %lu", flag, (unsigned long)(lo)); return 2; } \
            so.field = (unsigned)v; break;
        SERVE_UINT(OPT_S_TP, "--tensor-parallel-size", 1, 8, tensor_parallel)
        SERVE_UINT(OPT_S_DP, "--data-parallel-size", 1, 64, data_parallel)
        SERVE_UINT(OPT_S_MAXLEN, "--max-model-len", 2, 1u << 22, max_model_len)
        SERVE_UINT(OPT_S_MAXBT, "--max-num-batched-tokens", 4, 1u << 20, max_num_batched_tokens)
        SERVE_UINT(OPT_S_MAXSEQS, "--max-num-seqs", 1, 4096, max_num_seqs)
        SERVE_UINT(OPT_S_LIMIT, "--worker-restart-limit", 1, 1000, restart_limit)
        SERVE_UINT(OPT_S_BACKOFF, "--worker-backoff-ms", 1, 3600000, backoff_ms)
        SERVE_UINT(OPT_S_BACKOFF_MAX, "--worker-backoff-max-ms", 1, 3600000, backoff_max_ms)
#undef SERVE_UINT
        case OPT_S_STOP:
        case OPT_S_SPECLOG: {
            const char *flag = c == OPT_S_STOP ? "--worker-stop-timeout" : "--spec-log-interval";
            char *end;
            double sec = strtod(optarg, &end);
            serve_flag = serve_flag ? serve_flag : flag;
            if (end == optarg || *end || !(sec >= 0 && sec <= 86400)) {
                log_error("%s: expected seconds in [0, 86400], got '%s'", flag, optarg);
                return 2;
            }
            if (c == OPT_S_STOP)
                so.worker_stop_timeout_ms = (unsigned)(sec * 1000.0);
            else
                so.spec_log_interval_ms = (unsigned)(sec * 1000.0);
            break;
        }
        case OPT_S_THREADS:
            serve_flag = serve_flag ? serve_flag : "--threads";
            if (parse_uint("--threads", optarg, 1024, &v) < 0)
                return 2;
            so.threads = (unsigned)v;
            break;
        case OPT_S_DEVICE: serve_flag = serve_flag ? serve_flag : "--device"; so.device = optarg; break;
        case OPT_S_EP: serve_flag = serve_flag ? serve_flag : "--enable-expert-parallel"; break;
        case OPT_S_SPEC:
            serve_flag = serve_flag ? serve_flag : "--speculative-config";
            so.speculative_config = optarg;
            break;
        case OPT_S_GPUMEM: {
            char *end;
            serve_flag = serve_flag ? serve_flag : "--gpu-memory-utilization";
            so.gpu_memory_utilization = strtod(optarg, &end);
            if (end == optarg || *end || !(so.gpu_memory_utilization > 0 && so.gpu_memory_utilization <= 1)) {
                log_error("--gpu-memory-utilization: expected a fraction in (0, 1], got '%s'", optarg);
                return 2;
            }
            break;
        }
        case OPT_SERVED: {
            size_t old = served ? strlen(served) : 0;
            char *n = realloc(served, old + strlen(optarg) + 2);

            if (!n)
                return 1;
            if (!served)
                n[0] = '\0';
            served = n;
            snprintf(served + old, strlen(optarg) + 2, "%s%s", old ? "," : "", optarg);
            break;
        }
        case OPT_HOST: o.http_host = optarg; break;
        case OPT_PORT:
            if (!strcmp(optarg, "off") || !optarg[0]) {
                o.http_port = -1;
                break;
            }
            if (parse_uint("--port", optarg, 65535, &v) < 0)
                return 2;
            o.http_port = (int)v;
            break;
        case OPT_RPARSER: if (parse_parser("--reasoning-parser", optarg, &o.reasoning_parser) < 0) return 2; break;
        case OPT_TPARSER: if (parse_parser("--tool-call-parser", optarg, &o.tool_parser) < 0) return 2; break;
        case OPT_AUTO_TOOLS: break;
        case OPT_HTTP_TIMEOUT:
            if (parse_seconds("--http-timeout", optarg, &o.http_timeout_ms) < 0)
                return 2;
            if (o.http_timeout_ms < 1000) {
                log_error("--http-timeout: at least 1 second");
                return 2;
            }
            break;
        case OPT_ALLOWED_HOSTS: o.http_allowed_hosts = optarg; break;
        case OPT_HTTP_HEAD_TIMEOUT:
            if (parse_seconds("--http-header-timeout", optarg, &o.http_header_timeout_ms) < 0)
                return 2;
            if (o.http_header_timeout_ms < 1000) {
                log_error("--http-header-timeout: at least 1 second");
                return 2;
            }
            break;
        case OPT_ALLOWED_ORIGINS: o.http_allowed_origins = optarg; break;
        case OPT_REQ_TIMEOUT:
            if (parse_seconds("--request-timeout", optarg, &o.request_timeout_ms) < 0)
                return 2;
            break;
        case OPT_S_WBIN: serve_flag = serve_flag ? serve_flag : "--worker-binary"; so.worker_binary = optarg; break;
        case OPT_S_WARG:
            serve_flag = serve_flag ? serve_flag : "--worker-arg";
            if (so.n_worker_args == SERVE_MAX_WORKER_ARGS) {
                log_error("--worker-arg: at most %d", SERVE_MAX_WORKER_ARGS);
                return 2;
            }
            worker_args[so.n_worker_args++] = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (serve_mode) {
        if (optind >= argc) {
            log_error("stepd serve: MODEL_DIR is required (stepd serve MODEL_DIR [options])");
            return 2;
        }
        so.model_dir = argv[optind++];
    } else if (serve_flag) {
        log_error("%s is a flag of `stepd serve MODEL_DIR`", serve_flag);
        return 2;
    }
    if (optind < argc) {
        log_error("unexpected argument '%s'", argv[optind]);
        return 2;
    }
    if (served) {
        /* the first name is the one reported, the others are aliases */
        char *save = NULL;

        for (char *t = strtok_r(served, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (!t[0])
                continue;
            if (n_names == SERVE_MAX_NAMES) {
                log_error("--served-model-name: at most %d names", SERVE_MAX_NAMES);
                return 2;
            }
            aliases[n_names++] = t;
        }
        if (n_names) {
            o.model_name = aliases[0];
            o.model_aliases = aliases + 1;
            o.n_model_aliases = n_names - 1;
        }
    }
    if (o.max_n == 0 || o.http_max_connections == 0 || o.http_max_header_bytes < 4096) {
        log_error("--max-n and --http-max-connections must be at least 1, --http-max-header-bytes at least 4096");
        return 2;
    }
    if (o.heartbeat_ms == 0 || o.loads_poll_ms == 0 || o.worker_timeout_ms < 200) {
        log_error("--heartbeat-ms and --loads-poll-ms must be at least 1, --worker-timeout-ms at least 200");
        return 2;
    }
    if (key_file) {
        if ((r = file_read_secret(key_file, &api_key)) < 0) {
            log_error("--api-key-file %s: %s", key_file, r == -ENODATA ? "file is empty" : err_str(r));
            return 2;
        }
    } else if (getenv("STEPD_API_KEY") && getenv("STEPD_API_KEY")[0]) {
        api_key = strdup(getenv("STEPD_API_KEY"));
    }
    if (ckey_file) {
        if ((r = file_read_secret(ckey_file, &ctl_key)) < 0) {
            log_error("--control-key-file %s: %s", ckey_file, r == -ENODATA ? "file is empty" : err_str(r));
            goto out;
        }
    } else if (getenv("STEPD_CONTROL_KEY") && getenv("STEPD_CONTROL_KEY")[0]) {
        ctl_key = strdup(getenv("STEPD_CONTROL_KEY"));
    }
    o.api_key = api_key;
    o.control_key = ctl_key;
    if ((o.tls.cert_file != NULL) != (o.tls.key_file != NULL)) {
        log_error("--tls-cert and --tls-key go together");
        goto out;
    }
    if (serve_mode) {
        char *key = NULL;
        /* the model directory's tokenizer and name, unless given */
        if (!o.tokenizer_path) {
            snprintf(tokenizer, sizeof(tokenizer), "%s/tokenizer.json", so.model_dir);
            if (access(tokenizer, R_OK) == 0)
                o.tokenizer_path = tokenizer;
        }
        if (!o.model_name) {
            const char *b = so.model_dir + strlen(so.model_dir);
            while (b > so.model_dir && b[-1] == '/')
                b--;
            const char *e = b;
            while (b > so.model_dir && b[-1] != '/')
                b--;
            snprintf(model_name, sizeof(model_name), "%.*s", (int)(e - b), b);
            if (model_name[0])
                o.model_name = model_name;
        }
        if ((r = serve_prepare(&so, ctl_key, &sv, &key)) < 0) {
            rc = 2;
            goto out;
        }
        if (ctl_key) {
            memset(ctl_key, 0, strlen(ctl_key));
            free(ctl_key);
        }
        ctl_key = key;
        o.control_key = ctl_key;
    }
    if ((r = coord_new(&o, &co)) < 0) {
        log_error("cannot start: %s", err_str(r));
        rc = 1;
        goto out;
    }
    if (sv && (r = serve_start(sv, co)) < 0) {
        log_error("cannot start the workers: %s", err_str(r));
        rc = 1;
    }
    rc = r < 0 ? rc : coord_run(co);
    coord_free(co);
out:
    serve_free(sv);
    if (api_key) {
        memset(api_key, 0, strlen(api_key));
        free(api_key);
    }
    if (ctl_key) {
        memset(ctl_key, 0, strlen(ctl_key));
        free(ctl_key);
    }
    free(served);
    return rc;
}
