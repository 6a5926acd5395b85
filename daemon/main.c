/* main.c - `stepd`, the coordinator: flags, logging, coord_new/coord_run. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "cli.h"
#include "file.h"
#include "coord.h"
#include "err.h"
#include "log.h"
#include "media.h"
#include "serve.h"
#include "stepd-config.h"

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

#define SERVE_MAX_WORKER_ARGS 32
#define SERVE_MAX_NAMES 16

/* What the command line sets: the coordinator's and `stepd serve`'s options and what main()
 * still has to do with some of them (keys read from files, names split, ports moved). */
struct cli {
    struct coord_opts o;
    struct serve_opts so;
    const char *key_file, *ckey_file;
    char *served;                   /* --served-model-name NAME[,ALIAS...], repeated: all of them */
    unsigned port_offset;
    const char *worker_args[SERVE_MAX_WORKER_ARGS];
    char pass_flags[SERVE_MAX_WORKER_ARGS][48];
    size_t n_pass;
};

/* How an option's value is taken. */
enum optkind {
    K_HEAD,             /* no option: a heading of --help */
    K_STR,              /* the value itself, in a const char * field */
    K_SET,              /* a switch: the field (bool or int) set to .lo */
    K_UINT,             /* a decimal integer in [.lo, .hi], in an unsigned, int or size_t field */
    K_SECONDS,          /* seconds in [0, 86400] (at least .lo ms), as milliseconds in an unsigned */
    K_ACCEPT,           /* accepted, nothing to do (vLLM's flag for what stepd always does) */
    K_NOTE,             /* accepted with one log line: .vllm, what stepd does instead */
    K_PASS,             /* the worker's own flag, passed to every rank as it is (.hi: an integer
                         * in [.lo, .hi]) */
    K_FN,               /* .fn (with .off/.size when it stores into a field) */
};

/* What an option is: where it applies, and how the docs' table of vLLM flags shows it. */
#define OPTF_SERVE 1u           /* a flag of `stepd serve MODEL_DIR` only */
#define OPTF_VLLM 2u            /* vLLM's flag (same name, same meaning): in the docs' table */
#define OPTF_HIDDEN 4u          /* not in --help (the docs' table generators) */
#define SERVE_VLLM (OPTF_SERVE | OPTF_VLLM)

#define OPT_EXIT 1              /* a handler's return: done, exit 0 (--help, --version) */

struct optdecl;
typedef int opt_fn(struct cli *c, const struct optdecl *d, const char *flag, const char *val);

/* One declaration per option, one row each: its name, value, where it applies, how its
 * value is taken, its default and its help.  getopt_long's table, the defaults, the
 * handling, --help and the docs' tables (`stepd --help-vllm-flags`, docs/OPERATIONS.md §1.1,
 * and `stepd --help-flags-md`, §7.1) all come from the rows; a new option is one more row. */
struct optdecl {
    const char *name;           /* NULL: a heading of --help */
    const char *arg;            /* the value's name in --help; NULL: a switch */
    unsigned flags;             /* OPTF_* */
    enum optkind kind;
    size_t off, size;           /* the field in struct cli (V_FIELD) */
    unsigned long lo, hi;       /* see enum optkind */
    opt_fn *fn;                 /* K_FN */
    const char *def;            /* the default: given to the handler before the command line
                                 * (NULL: none, or the worker's, which --help states in words) */
    const char *help;           /* --help text ("\n" continues it on the next line; "{}" is .def) */
    const char *vllm;           /* OPTF_VLLM: what stepd does with vLLM's flag; K_NOTE: its log line */
    /* docs/OPERATIONS.md §7.1's table of stepd's own flags (`stepd --help-flags-md`) */
    const char *doc_def;        /* its default column when .def does not say it (NULL: .def or "—") */
    const char *doc;            /* its meaning column (NULL: the help text) */
};

/* The handler part of a row: kind, field, bounds, function. */
#define V_FIELD(f) offsetof(struct cli, f), sizeof(((struct cli *)0)->f)
#define V_HEAD K_HEAD, 0, 0, 0, 0, NULL
#define V_STR(f) K_STR, V_FIELD(f), 0, 0, NULL
#define V_SET(f, v) K_SET, V_FIELD(f), v, 0, NULL
#define V_UINT(f, lo, hi) K_UINT, V_FIELD(f), lo, hi, NULL
#define V_SECONDS(f, least_ms) K_SECONDS, V_FIELD(f), least_ms, 0, NULL
#define V_ACCEPT K_ACCEPT, 0, 0, 0, 0, NULL
#define V_NOTE K_NOTE, 0, 0, 0, 0, NULL
#define V_PASS K_PASS, 0, 0, 0, 0, NULL
#define V_PASS_UINT K_PASS, 0, 0, 1, INT32_MAX, NULL
#define V_FN(fn) K_FN, 0, 0, 0, 0, fn
#define V_FN_AT(fn, f) K_FN, V_FIELD(f), 0, 0, fn

static opt_fn opt_api_key, opt_served, opt_parser, opt_port, opt_log_level, opt_version, opt_help,
    opt_help_vllm, opt_help_flags, opt_gpumem, opt_kv_dtype, opt_kv_mem, opt_dtype, opt_quant, opt_chat_template,
    opt_template_kwargs, opt_limit_mm, opt_media_domains, opt_media_fetch_timeout, opt_image_limit, opt_logprobs_mode,
    opt_worker_arg;

static const struct optdecl optdecls[] = {
    { NULL, NULL, 0, V_HEAD, NULL, "Listening (loopback by default):" },
    { "listen", "ADDR", 0, V_STR(o.listen), "127.0.0.1:20051", "public gRPC (default {}; unix:/path allowed)",
      .doc = "public gRPC: `stepd.v1.Inference` + health (§1; `unix:/path` allowed)" },
    { "admin-listen", "ADDR", 0, V_STR(o.admin_listen), "127.0.0.1:20053", "Admin + health (default {})",
      .doc = "`stepd.v1.Admin` (Drain, GetGroups) + health" },
    { "control-listen", "ADDR", 0, V_STR(o.control_listen), "127.0.0.1:20052", "worker control (default {})",
      .doc = "`stepd.ctl.v1.Control` for workers + health" },
    { "metrics-listen", "ADDR", 0, V_STR(o.metrics_listen), "127.0.0.1:9464",
      "HTTP /metrics, /healthz, /health, /ready (default {};\n\"\" = off; /metrics is also on the API port)",
      .doc = "HTTP `GET /metrics`, `/healthz`, `/health`, `/ready` (`\"\"` = off)" },
    { "host", "HOST", OPTF_VLLM, V_STR(o.http_host), "127.0.0.1", "OpenAI HTTP API host (default {})",
      "the OpenAI HTTP API's address",
      .doc = "the OpenAI HTTP API's address (§12)" },
    { "port", "PORT", OPTF_VLLM, V_FN_AT(opt_port, o.http_port), "8000", "OpenAI HTTP API port (default {}; off = none)",
      "the OpenAI HTTP API's port",
      .doc = "the OpenAI HTTP API's port (§12); `--port 0` any free port, `--port off` none" },
    { "port-offset", "N", 0, V_UINT(port_offset, 0, 65535), NULL, "add N to every port above (given or default; 0 "
      "stays 0): a second\ninstance on one host moves all of them at once",
      .doc_def = "0", .doc = "adds N to every port: `--listen`, `--admin-listen`, `--control-listen`, "
      "`--metrics-listen` and `--port`, given or default (port 0 and unix sockets stay); a "
      "second instance on one host moves all five at once" },
    { "insecure-listen", NULL, 0, V_SET(o.insecure_listen, 1), NULL, "allow non-loopback listens without TLS + API key",
      .doc_def = "off", .doc = "allow the non-loopback listens of §6" },
    { NULL, NULL, 0, V_HEAD, NULL, "Security:" },
    { "tls-cert", "FILE", 0, V_STR(o.tls.cert_file), NULL, "TLS certificate of the public port (with --tls-key)",
      .doc_def = "none", .doc = "TLS on the public port (with `--tls-key`)" },
    { "tls-key", "FILE", 0, V_STR(o.tls.key_file), NULL, "its key",
      .doc_def = "none", .doc = "its key" },
    { "tls-client-ca", "FILE", 0, V_STR(o.tls.root_file), NULL, "CA for client certificates",
      .doc_def = "none", .doc = "CA for client certificates (mTLS)" },
    { "tls-require-client-cert", NULL, 0, V_SET(o.tls.require_client_cert, 1), NULL, "mTLS (needs --tls-client-ca)",
      .doc_def = "off", .doc = "mTLS (needs `--tls-client-ca`)" },
    { "api-key-file", "FILE", 0, V_STR(key_file), NULL, "API key for every RPC except health (or $STEPD_API_KEY)",
      .doc_def = "none", .doc = "API key for every RPC except health (or `$STEPD_API_KEY`)" },
    { "api-key", "KEY", OPTF_VLLM, V_FN(opt_api_key), NULL, "refused: a key on the command line is visible in ps",
      "refused (a key in argv is visible in ps): use --api-key-file FILE or $STEPD_API_KEY" },
    { "control-key-file", "FILE", 0, V_STR(ckey_file), NULL, "the cluster key: workers send it, their engines check "
      "it\n(or $STEPD_CONTROL_KEY; `stepd serve` makes one per run)",
      .doc_def = "none", .doc = "the cluster key: workers send it, their engines check it (or `$STEPD_CONTROL_KEY`; `stepd "
      "serve` makes one per run)" },
    { "insecure-control", NULL, 0, V_SET(o.insecure_control, 1), NULL,
      "no control key: accept keyless workers (and engines)",
      .doc_def = "off", .doc = "no control key: accept keyless workers (and engines)" },
    { NULL, NULL, 0, V_HEAD, NULL, "Text:" },
    { "tokenizer", "FILE", OPTF_VLLM, V_STR(o.tokenizer_path), NULL, "tokenizer.json (enables text/chat input, "
      "Tokenize; `stepd serve`:\ndefault MODEL_DIR/tokenizer.json)",
      "the tokenizer.json file (default MODEL_DIR/tokenizer.json)",
      .doc_def = "none", .doc = "tokenizer.json: enables text and chat input, Tokenize, Detokenize (`stepd serve`: "
      "MODEL_DIR/tokenizer.json)" },
    { "model-name", "NAME", 0, V_STR(o.model_name), NULL, "served model name (default: reported by rank 0)",
      .doc_def = "from rank 0", .doc = "served model name" },
    { "served-model-name", "NAME", OPTF_VLLM, V_FN(opt_served), NULL, "the same; repeat it (or NAME,ALIAS,...) for "
      "aliases the\nmodel answers to (the first is the one reported)",
      "the model's name in the API, aliases after it",
      .doc_def = "from rank 0", .doc = "the same (vLLM's name); repeat it or list aliases the model also answers to: both doors "
      "accept each, `/v1/models` lists them" },
    { "reasoning-parser", "P", OPTF_VLLM, V_FN_AT(opt_parser, o.reasoning_parser), "step3p5",
      "{} (default) or none: reasoning split from the content",
      "step3p5 (built in, the default) or none; others are refused",
      .doc = "`none` turns the reasoning split off (both doors)" },
    { "tool-call-parser", "P", OPTF_VLLM, V_FN_AT(opt_parser, o.tool_parser), "step3p5",
      "{} (default) or none: tool calls parsed from the output",
      "step3p5 (built in, the default) or none; others are refused",
      .doc = "`none` turns the tool-call parsing off (both doors)" },
    { "enable-auto-tool-choice", NULL, OPTF_VLLM, V_ACCEPT, NULL,
      "accepted (tool_choice \"auto\" is served with the parser)",
      "accepted: tool_choice \"auto\" is always served with the tool-call parser",
      .doc = "accepted (vLLM's flag; `tool_choice` auto is served with the parser)" },
    { "vocab-size", "N", 0, V_UINT(o.fallback_vocab_size, 0, 1u << 30), NULL,
      "vocabulary size until an engine reports one",
      .doc_def = "0", .doc = "vocabulary for validation until an engine reports one" },
    { NULL, NULL, 0, V_HEAD, NULL, "Limits:" },
    { "max-running", "N", 0, V_UINT(o.max_running, 0, 1u << 20), "1024", "requests in flight to engines (default {})",
      .doc = "requests dispatched to engines at once" },
    { "max-queue", "N", 0, V_UINT(o.max_queue, 0, 1u << 20), "1024", "requests waiting for a slot (default {})",
      .doc = "requests waiting for a running slot" },
    { "max-input-tokens", "N", 0, V_UINT(o.max_input_tokens, 0, 1u << 24), NULL, "prompt cap (default: context length)",
      .doc_def = "context − 1", .doc = "prompt cap" },
    { "max-tokens-cap", "N", 0, V_UINT(o.max_tokens_cap, 0, 1u << 24), "32768", "cap on max_tokens (default {})",
      .doc = "cap on `max_tokens`" },
    { "default-max-tokens", "N", 0, V_UINT(o.default_max_tokens, 0, 1u << 24), "256",
      "max_tokens when unset (default {})",
      .doc = "`max_tokens` when unset (clipped to the context)" },
    { "max-recv-msg-bytes", "N", 0, V_UINT(o.max_recv_msg_bytes, 0, 1u << 30), "4194304",
      "gRPC receive limit (default {})",
      .doc = "gRPC receive limit" },
    { "max-concurrent-streams", "N", 0, V_UINT(o.max_concurrent_streams, 0, 1u << 20), "1024",
      "per connection (default {})",
      .doc = "per connection" },
    { "stream-buffer-bytes", "N", 0, V_UINT(o.max_call_buffer_bytes, 0, 1u << 30), "1048576",
      "per-stream send buffer before a slow client is cut (1 MiB)",
      .doc_def = "1 MiB", .doc = "queued bytes per client stream before a slow reader is cut" },
    { "max-n", "N", 0, V_UINT(o.max_n, 1, 128), "16", "HTTP: cap on n, choices per request (default {})",
      .doc = "HTTP: choices per request (at most 128)" },
    { "responses-store-size", "N", 0, V_UINT(o.responses_store_size, 0, 1u << 20), "1024",
      "HTTP: /v1/responses kept for previous_response_id (default {}; 0 = off)",
      .doc = "HTTP: responses kept for `previous_response_id` and `GET /v1/responses/{id}` (oldest "
      "dropped first; 0 = no store) (§13)" },
    { "responses-store-ttl", "SECONDS", 0, V_UINT(o.responses_store_ttl_s, 0, 86400u * 365), "3600",
      "how long a stored response is kept (default {}; 0 = off)",
      .doc = "how long a stored response is kept (0 = no store)" },
    { "http-max-body-bytes", "N", 0, V_UINT(o.http_max_body_bytes, 0, 1u << 30), "4194304",
      "HTTP request body cap, 413 above (default {})",
      .doc_def = "4 MiB", .doc = "HTTP: request body cap, 413 above (§12)" },
    { "http-max-header-bytes", "N", 0, V_UINT(o.http_max_header_bytes, 4096, 1u << 24), "32768",
      "HTTP request line + headers cap, 431 above (default {})",
      .doc_def = "32 KiB", .doc = "HTTP: request line + headers cap, 431 above (§12)" },
    { "http-max-connections", "N", 0, V_UINT(o.http_max_connections, 1, 1u << 20), "1024",
      "HTTP connections at once (default {}; idle ones make room)",
      .doc = "HTTP: connections at once; idle ones make room (§12)" },
    { "http-max-connections-per-ip", "N", 0, V_UINT(o.http_max_connections_per_ip, 0, 1u << 20), "256",
      "HTTP connections of one client address (default {})",
      .doc = "HTTP: connections of one client address (§12: the oldest idle one closes to make room, "
      "else 429; 0 none)" },
    { "http-header-timeout", "SECONDS", 0, V_SECONDS(o.http_header_timeout_ms, 1000), "10",
      "HTTP: a request head must arrive within this (default {})",
      .doc = "HTTP: a request head must arrive within it, from the connection's start or its previous "
      "request (408, closed)" },
    { "http-timeout", "SECONDS", 0, V_SECONDS(o.http_timeout_ms, 1000), "30",
      "HTTP: a request must arrive within this; idle connections\nclose after it (default {})",
      .doc = "HTTP: idle connections close; a request must arrive within it" },
    { "request-timeout", "SECONDS", 0, V_SECONDS(o.request_timeout_ms, 0), NULL,
      "HTTP: deadline of a generation request, 504 past it (0 = none)",
      .doc_def = "0 (none)", .doc = "HTTP: a generation request's deadline (504)" },
    { "allowed-hosts", "LIST", 0, V_STR(o.http_allowed_hosts), NULL, "HTTP: Host names served beside IP literals, "
      "localhost and --host\n(comma-separated or a JSON list; \"*\" any)",
      .doc_def = "none", .doc = "HTTP: `Host` names served beside IP literals, `localhost` and `--host` (403 otherwise; "
      "comma-separated or a JSON list, `*` any; §12)" },
    { "allowed-origins", "LIST", OPTF_VLLM, V_STR(o.http_allowed_origins), NULL, "HTTP: browser origins served with "
      "CORS (default none: a request\nwith an Origin header is refused)",
      "CORS for the browser origins listed (default none)",
      .doc_def = "none", .doc = "HTTP: browser origins served, with CORS headers and preflights (403 for any other "
      "`Origin`; as vLLM's flag, a JSON list or comma-separated, `*` any; §12)" },
    { NULL, NULL, 0, V_HEAD, NULL, "Behaviour:" },
    { "drain-timeout", "SECONDS", 0, V_SECONDS(o.drain_timeout_ms, 0), "30",
      "finish in-flight work within this on SIGTERM (default {})",
      .doc = "finish in-flight work within this on SIGTERM (§3)" },
    { "heartbeat-ms", "N", 0, V_UINT(o.heartbeat_ms, 1, 3600000), "1000", "control heartbeat period (default {})",
      .doc = "control-session heartbeat period (also the deadline sweep of output-stream requests)" },
    { "loads-poll-ms", "N", 0, V_UINT(o.loads_poll_ms, 1, 3600000), "250", "engine GetLoads period (default {})",
      .doc = "engine `GetLoads` period" },
    { "worker-timeout-ms", "N", 0, V_UINT(o.worker_timeout_ms, 200, 3600000), "10000",
      "declare a silent rank gone after N ms (default {})",
      .doc = "a rank silent this long is declared gone (≥ 200)" },
    { "prefix-affinity", "N", 0, V_UINT(o.prefix_affinity, 0, 1u << 20), "16", "route a request to the group that "
      "holds the longest prefix of\nits prompt, in blocks of N tokens (default {}; 0 = off)",
      .doc = "prefix-affine routing in blocks of N tokens: a request prefers the group that served the "
      "longest prefix of its prompt (0 = off)" },
    { "prefix-affinity-entries", "N", 0, V_UINT(o.prefix_affinity_entries, 0, 1u << 24), "65536",
      "prompt blocks remembered for that (default {})",
      .doc = "prompt blocks the router remembers a group for (LRU)" },
    { "log-level", "LEVEL", 0, V_FN(opt_log_level), NULL, "error|warn|info|debug",
      .doc_def = "info", .doc = "error, warn, info, debug (or `$STEPD_LOG_LEVEL`)" },
    { "version", NULL, 0, V_FN(opt_version), NULL, "print the version and exit",
      .doc = "the version" },
    { "help", NULL, 0, V_FN(opt_help), NULL, "this text",
      .doc = "every option with its meaning (`--help-vllm-flags`: the table of §1.1; `--help-flags-md`: "
      "this table)" },
    { "help-vllm-flags", NULL, OPTF_HIDDEN, V_FN(opt_help_vllm), NULL, "" },
    { "help-flags-md", NULL, OPTF_HIDDEN, V_FN(opt_help_flags), NULL, "" },
    { NULL, NULL, OPTF_SERVE, V_HEAD, NULL, "stepd serve MODEL_DIR: this coordinator starts and supervises its worker "
      "ranks\n(vLLM's flag names and meanings; --a_b is --a-b, --flag=value is --flag value):" },
    { "tensor-parallel-size", "N", SERVE_VLLM, V_UINT(so.tensor_parallel, 1, 8), "1",
      "ranks per group: 1, 2, 4, 8 (default {})",
      "ranks per group (1, 2, 4, 8): attention heads and experts sharded over them" },
    { "data-parallel-size", "D", SERVE_VLLM, V_UINT(so.data_parallel, 1, 64), "1", "groups (default {})",
      "groups g0..g{D-1}, requests spread over them" },
    { "device", "cpu|cuda", SERVE_VLLM, V_STR(so.device), "cpu", "rank r of group d runs on cuda:(d*N + r) (default "
      "{}); cuda\nwithout a GPU or the CUDA plugin is refused before any rank starts",
      "cpu (default) or cuda: rank r of group d on cuda:(d*N + r)" },
    { "enable-expert-parallel", NULL, SERVE_VLLM, V_ACCEPT, NULL,
      "accepted: routed experts are always expert-parallel over a group",
      "accepted: routed experts are always split over the ranks of a group (expert parallel)" },
    { "speculative-config", "JSON", SERVE_VLLM, V_STR(so.speculative_config), NULL,
      "'{\"method\":\"mtp\",\"num_speculative_tokens\":K}', K 0..3 (plus\n"
      "draft_quantization, draft_policy, draft_vocab); checked before any rank starts",
      "method \"mtp\" (the checkpoint's MTP layers), num_speculative_tokens 0..3 (default: the layers there are), "
      "model (a directory with the MTP layers); other methods and unknown keys are refused before any rank starts" },
    { "max-model-len", "L", SERVE_VLLM, V_UINT(so.max_model_len, 2, 1u << 22), NULL, "longest sequence (default "
      "1024); above the model's\nmax_position_embeddings only with --allow-long-max-model-len",
      "longest sequence; above the model's max_position_embeddings refused unless --allow-long-max-model-len" },
    { "allow-long-max-model-len", NULL, OPTF_SERVE, V_SET(so.allow_long_max_model_len, 1), NULL,
      "serve a --max-model-len above the model's\nmax_position_embeddings (or $VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)" },
    { "max-num-batched-tokens", "T", SERVE_VLLM, V_UINT(so.max_num_batched_tokens, 4, 1u << 20), NULL,
      "tokens per engine step (default 256)", "tokens per engine step; longer prompts are prefilled in chunks of it" },
    { "max-num-seqs", "S", SERVE_VLLM, V_UINT(so.max_num_seqs, 1, 4096), NULL, "sequences per engine step (default 8)",
      "sequences per engine step" },
    { "block-size", "BS", SERVE_VLLM, V_UINT(so.block_size, 1, 4096), NULL, "KV cache block, in tokens (default 16)",
      "KV cache block, in tokens" },
    { "gpu-memory-utilization", "F", SERVE_VLLM, V_FN(opt_gpumem), NULL,
      "share of a GPU's memory for a CUDA rank (default 0.9)",
      "share of each GPU's memory a CUDA rank uses (the KV cache takes what the weights leave); "
      "no effect on CPU ranks" },
    { "kv-cache-memory", "BYTES", SERVE_VLLM, V_FN(opt_kv_mem), NULL, "KV cache per rank, e.g. 8GiB (default: on CPU "
      "every sequence\nat --max-model-len, on a GPU --gpu-memory-utilization); one too small for\n"
      "one sequence is refused before any rank starts",
      "KV cache bytes per rank (e.g. 8GiB); below one sequence of --max-model-len refused before any rank starts" },
    { "kv-cache-dtype", "D", SERVE_VLLM, V_FN(opt_kv_dtype), NULL, "auto or bf16 (default), fp32",
      "auto/bf16 (default) or fp32; fp8 and others are refused" },
    { "enable-prefix-caching", NULL, SERVE_VLLM, V_SET(so.prefix_caching, 1), NULL,
      "reuse cached KV blocks of prompts (the default)", "the default: prompts reuse cached KV blocks" },
    { "no-enable-prefix-caching", NULL, SERVE_VLLM, V_SET(so.prefix_caching, 0), NULL, "recompute every prompt",
      "every prompt is recomputed" },
    { "dtype", "D", SERVE_VLLM, V_FN(opt_dtype), NULL, "auto, bfloat16 or bf16: stepd computes with BF16 weights\n"
      "and FP32 accumulation; float16 and float32 are refused",
      "auto, bfloat16: BF16 weights, FP32 accumulation; float16/float32 are refused" },
    { "quantization", "Q", SERVE_VLLM, V_FN(opt_quant), NULL, "mxfp4: the checkpoint's MXFP4 routed experts (the "
      "only\nquantization; a BF16 checkpoint is served as it is, without the flag)",
      "mxfp4 (the checkpoint's MXFP4 routed experts; refused for a BF16 checkpoint); other methods are refused" },
    { "chat-template", "FILE", SERVE_VLLM, V_FN(opt_chat_template), NULL,
      "refused: stepd renders the Step-3.x chat template built in",
      "refused: stepd renders the Step-3.x chat template built in (no Jinja)" },
    { "default-chat-template-kwargs", "JSON", SERVE_VLLM, V_FN(opt_template_kwargs), NULL, "defaults of "
      "chat_template_kwargs for every\nchat request (reasoning_effort, preserve_thinking, add_generation_prompt);\n"
      "a request's own keys win",
      "defaults of chat_template_kwargs (reasoning_effort, preserve_thinking, add_generation_prompt); a request's "
      "own win" },
    { "limit-mm-per-prompt", "JSON", SERVE_VLLM, V_FN(opt_limit_mm), NULL, "'{\"image\": N}': images per prompt "
      "(default 16; 0 = text\nonly); other media must be 0",
      "'{\"image\": N}' caps images per prompt (every door) (default 16; 0: text only); other media must be 0" },
    { "allowed-media-domains", "HOSTS", SERVE_VLLM, V_FN(opt_media_domains), NULL, "http(s) image URL hosts "
      "(comma-separated,\nrepeatable; exact host names, no subdomains); other\nURLs get a 400",
      "the hosts whose http(s) image URLs stepd fetches (exact host names, case-insensitive; a subdomain is "
      "another host); none by default" },
    { "media-fetch-timeout", "SECONDS", 0, V_FN(opt_media_fetch_timeout), "10",
      "an http(s) image URL's fetch, redirects included,\nmust end within this (default {}); 400 above",
      .doc = "HTTP: an http(s) image URL's fetch (redirects included) must end within this; 400 \"timed out\" "
      "above (daemon/media-fetch.c)" },
    { "image-max-bytes", "N", 0, V_FN(opt_image_limit), "20971520",
      "an image's encoded size cap, 400 above (default {})",
      .doc = "HTTP: an image's encoded size cap, 400 above (daemon/media.c)" },
    { "image-max-pixels", "N", 0, V_FN(opt_image_limit), "40000000", "an image's declared width x height cap, "
      "400 above, checked\nbefore decoding (default {}; 16384 per side)",
      .doc = "HTTP: an image's declared width x height cap, checked before decoding; 16384 per side" },
    { "disable-cascade-attn", NULL, SERVE_VLLM, V_NOTE, NULL, NULL,
      "stepd has no cascade attention: every sequence's attention is computed on its own blocks" },
    { "enforce-eager", NULL, SERVE_VLLM, V_NOTE, NULL, NULL,
      "not used: CUDA ranks replay CUDA graphs for decode and verify steps ($STEPD_CUDA_NO_GRAPHS=1 "
      "runs every step eagerly)" },
    { "trust-remote-code", NULL, SERVE_VLLM, V_NOTE, NULL, NULL,
      "stepd runs no code from the model directory: config.json and the safetensors are read by its own loader" },
    { "linear-backend", "B", SERVE_VLLM, V_NOTE, NULL, NULL,
      "stepd picks its own matmul kernels per device and CPU (MXFP4 experts included); the value is not used" },
    { "async-scheduling", NULL, SERVE_VLLM, V_NOTE, NULL, NULL,
      "stepd's engine has one scheduler (continuous batching); nothing to switch" },
    { "enable-chunked-prefill", NULL, SERVE_VLLM, V_NOTE, NULL, NULL,
      "always on: prompts longer than --max-num-batched-tokens are prefilled in chunks" },
    { "enable-eplb", NULL, SERVE_VLLM, V_NOTE, NULL, NULL,
      "stepd places the routed experts statically (a contiguous share per rank); no load balancer" },
    { "logprobs-mode", "M", SERVE_VLLM, V_FN(opt_logprobs_mode), NULL, "raw_logprobs (default) or "
      "processed_logprobs: what logprobs\nreport (the worker's flag)", "raw_logprobs (default) or processed_logprobs, as vLLM" },
    { "threads", "T", OPTF_SERVE, V_UINT(so.threads, 0, 1024), NULL, "CPU threads per rank (default: the CPUs shared out)" },
    { "max-waiting", "N", OPTF_SERVE, V_PASS_UINT, NULL, "requests an engine queues beyond --max-num-seqs (the "
      "worker's\nflag; default: the KV pool's block count, within 64..4096)" },
    { "kv-blocks", "B", OPTF_SERVE, V_PASS_UINT, NULL, "full-attention KV blocks per rank, overriding the budget" },
    { "prefix-cache-salt", "S", OPTF_SERVE, V_PASS, NULL, "deployment salt of the prefix-cache keys (default: random)" },
    { "exact", NULL, OPTF_SERVE, V_PASS, NULL, "CPU: the exact W4A32 MXFP4 path instead of the int8 fast path" },
    { "mtp-model", "DIR", OPTF_SERVE, V_PASS, NULL, "MTP layers from another directory" },
    { "comm-net-devices", "DEVS", OPTF_SERVE, V_PASS, NULL, "network devices the groups' UCX transports bind (default lo)" },
    { "collective-timeout", "MS", OPTF_SERVE, V_PASS_UINT, NULL, "deadline of every collective (default 30000)" },
    { "rendezvous-timeout", "MS", OPTF_SERVE, V_PASS_UINT, NULL, "how long a rank waits for the others (default 60000)" },
    { "load-timeout", "MS", OPTF_SERVE, V_PASS_UINT, NULL, "how long ranks wait for each other to load (default 1800000)" },
    { "worker-binary", "PATH", OPTF_SERVE, V_STR(so.worker_binary), NULL,
      "stepd-worker to run (default: beside stepd, else $PATH)" },
    { "worker-arg", "ARG", OPTF_SERVE, V_FN(opt_worker_arg), NULL, "one more flag for every rank (repeatable)" },
    { "worker-restart-limit", "N", OPTF_SERVE, V_UINT(so.restart_limit, 1, 1000), "5",
      "failures in a row before a group is given up (default {})" },
    { "worker-backoff-ms", "MS", OPTF_SERVE, V_UINT(so.backoff_ms, 1, 3600000), "500",
      "first restart delay, doubling (default {})" },
    { "worker-backoff-max-ms", "MS", OPTF_SERVE, V_UINT(so.backoff_max_ms, 1, 3600000), "30000",
      "longest restart delay (default {})" },
    { "worker-stop-timeout", "S", OPTF_SERVE, V_SECONDS(so.worker_stop_timeout_ms, 0), "15",
      "seconds ranks get to stop before SIGTERM (default {})" },
    { "spec-log-interval", "S", OPTF_SERVE, V_SECONDS(so.spec_log_interval_ms, 0), "10",
      "spec-decoding metrics in the log every S s (default {}, 0 = off)" },
};

/* The row's --help text ("\n" for its line breaks), "{}" replaced by its default. */
static const char *help_text(const struct optdecl *d, char *buf, size_t len)
{
    const char *h = d->kind == K_NOTE ? d->vllm : d->help;     /* what stepd does instead */
    const char *dflt = strstr(h, "{}");

    if (!dflt)
        return h;
    ASSERT(d->def);
    snprintf(buf, len, "%.*s%s%s", (int)(dflt - h), h, d->def, dflt + 2);
    return buf;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: stepd [options]\n"
               "       stepd serve MODEL_DIR [options] [serve options]\n"
               "Coordinator for stepd worker groups: public gRPC API (stepd.v1.Inference),\n"
               "Admin, worker control service, health and Prometheus metrics.\n");
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];
        char head[64], text[512];
        const char *h = help_text(d, text, sizeof(text));
        int n;

        if (d->flags & OPTF_HIDDEN)
            continue;
        if (!d->name) {
            fprintf(f, "%s\n", h);
            continue;
        }
        n = snprintf(head, sizeof(head), "  --%s%s%s", d->name, d->arg ? " " : "", d->arg ? d->arg : "");
        for (bool first = true; first || *h; first = false) {
            size_t len = strcspn(h, "\n");

            fprintf(f, "%-*s %.*s\n", first ? (n > 28 ? n : 28) : 28, first ? head : "", (int)len, h);
            h += len + (h[len] == '\n');
        }
    }
    fprintf(f, "The control key is generated per run (or --control-key-file) and handed to the ranks in\n"
               "a file.  docs/OPERATIONS.md §1 has the table of vLLM's flags (stepd --help-vllm-flags).\n");
}

/* A markdown table cell: '|' escaped, "\n" (a --help line break) a space. */
static void md_cell(FILE *f, const char *s)
{
    for (; *s; s++)
        fprintf(f, *s == '|' ? "\\|" : *s == '\n' ? " " : "%c", *s);
}

/* docs/OPERATIONS.md's table: each vLLM flag stepd takes, and what stepd does with it. */
static void usage_vllm(FILE *f)
{
    fprintf(f, "| vLLM flag | stepd |\n|---|---|\n");
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];

        if (!d->name || !(d->flags & OPTF_VLLM))
            continue;
        fprintf(f, "| `--%s%s", d->name, d->arg ? " " : "");
        md_cell(f, d->arg ? d->arg : "");
        fprintf(f, "` | %s |\n", d->vllm);
    }
}

/* docs/OPERATIONS.md §7.1's table: stepd's own flags (not `stepd serve`'s), default, meaning. */
static void usage_flags_md(FILE *f)
{
    fprintf(f, "| flag | default | meaning |\n|---|---|---|\n");
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];
        const char *def = d->doc_def ? d->doc_def : d->def ? d->def : "—";
        char text[512];

        if (!d->name || (d->flags & (OPTF_SERVE | OPTF_HIDDEN)))
            continue;
        fprintf(f, "| `--%s%s", d->name, d->arg ? " " : "");
        md_cell(f, d->arg ? d->arg : "");
        fprintf(f, "` | ");
        md_cell(f, def);
        fprintf(f, " | ");
        md_cell(f, d->doc ? d->doc : help_text(d, text, sizeof(text)));
        fprintf(f, " |\n");
    }
}

/* Levenshtein distance of a and the first nb bytes of b. */
static size_t edit_distance(const char *a, const char *b, size_t nb)
{
    size_t na = strlen(a), row[128];

    if (na >= ARRAY_SIZE(row) || nb >= ARRAY_SIZE(row))
        return SIZE_MAX;
    for (size_t j = 0; j <= nb; j++)
        row[j] = j;
    for (size_t i = 1; i <= na; i++) {
        size_t diag = row[0];

        row[0] = i;
        for (size_t j = 1; j <= nb; j++) {
            size_t up = row[j], best = diag + (a[i - 1] != b[j - 1]);

            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[nb];
}

/* One line for a flag getopt did not know: the nearest known one, not the usage. */
static void unknown_flag(const char *arg)
{
    const char *name = arg + (arg[0] == '-') + (arg[0] == '-' && arg[1] == '-');
    size_t n = strcspn(name, "="), best = SIZE_MAX;
    const char *near = NULL;

    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        if (!optdecls[i].name || (optdecls[i].flags & OPTF_HIDDEN))
            continue;
        size_t d = edit_distance(optdecls[i].name, name, n);
        if (d < best) {
            best = d;
            near = optdecls[i].name;
        }
    }
    if (near && best <= (n / 3 > 2 ? n / 3 : 2))
        log_error("unknown flag %.*s: did you mean --%s? (stepd --help lists them)", (int)(n + (name - arg)), arg,
                  near);
    else
        log_error("unknown flag %.*s (stepd --help lists them)", (int)(n + (name - arg)), arg);
}

/* vLLM's spellings: --a_b is --a-b (the name, not a value after '=').  Every flag must be
 * spelled whole (getopt_long would take a unique prefix: --enable-prefix-cachin is a typo,
 * not --enable-prefix-caching): -EINVAL after one line naming the nearest flag. */
static int normalize_flags(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const struct optdecl *d = NULL;
        size_t n;

        if (strcmp(argv[i], "--") == 0)
            break;
        if (strncmp(argv[i], "--", 2) != 0)
            continue;
        for (char *p = argv[i] + 2; *p && *p != '='; p++)
            if (*p == '_')
                *p = '-';
        n = strcspn(argv[i] + 2, "=");
        for (size_t k = 0; k < ARRAY_SIZE(optdecls) && !d; k++)
            if (optdecls[k].name && strlen(optdecls[k].name) == n && strncmp(optdecls[k].name, argv[i] + 2, n) == 0)
                d = &optdecls[k];
        if (!d) {
            unknown_flag(argv[i]);
            return -EINVAL;
        }
        if (d->arg && !argv[i][2 + n])
            i++;                    /* its value, which may begin with "--" (--worker-arg) */
    }
    return 0;
}

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

/* --port-offset N: every port moved by N (0, any free port, stays 0; unix: sockets stay). */
static int shift_addr(const char *flag, const char **addr, unsigned off, char *buf, size_t len)
{
    const char *a = *addr, *colon;
    char *end;
    unsigned long port;

    if (!a || !a[0] || strncmp(a, "unix:", 5) == 0)
        return 0;
    colon = strrchr(a, ':');
    port = colon ? strtoul(colon + 1, &end, 10) : 0;
    if (!colon || end == colon + 1 || *end) {
        log_error("%s %s: expected HOST:PORT for --port-offset", flag, a);
        return -EINVAL;
    }
    if (port == 0)
        return 0;
    if (port + off > 65535) {
        log_error("%s %s: port %lu + --port-offset %u is above 65535", flag, a, port, off);
        return -EINVAL;
    }
    snprintf(buf, len, "%.*s:%lu", (int)(colon - a), a, port + off);
    *addr = buf;
    return 0;
}

static int apply_port_offset(struct coord_opts *o, unsigned off, char (*bufs)[300], size_t len)
{
    if (shift_addr("--listen", &o->listen, off, bufs[0], len) < 0 ||
        shift_addr("--admin-listen", &o->admin_listen, off, bufs[1], len) < 0 ||
        shift_addr("--control-listen", &o->control_listen, off, bufs[2], len) < 0 ||
        shift_addr("--metrics-listen", &o->metrics_listen, off, bufs[3], len) < 0)
        return -EINVAL;
    if (o->http_port > 0) {
        if (o->http_port + (int)off > 65535) {
            log_error("--port %d + --port-offset %u is above 65535", o->http_port, off);
            return -EINVAL;
        }
        o->http_port += (int)off;
    }
    return 0;
}

/* ------------------------------------------------------------------ option handlers */

static void *opt_field(struct cli *c, const struct optdecl *d)
{
    return (char *)c + d->off;
}

/* v into the row's field: a bool, 32 or 64 bits. */
static void opt_store(struct cli *c, const struct optdecl *d, unsigned long v)
{
    void *p = opt_field(c, d);

    if (d->size == sizeof(bool)) {
        bool b = v != 0;
        memcpy(p, &b, sizeof(b));
    } else if (d->size == sizeof(uint32_t)) {
        uint32_t u = (uint32_t)v;
        memcpy(p, &u, sizeof(u));
    } else {
        uint64_t u = v;
        ASSERT(d->size == sizeof(u));
        memcpy(p, &u, sizeof(u));
    }
}

/* An integer in the row's [lo, hi]. */
static int opt_uint(const char *flag, const struct optdecl *d, const char *val, unsigned long *ret)
{
    if (parse_uint(flag, val, d->hi, ret) < 0)
        return -EINVAL;
    if (*ret < d->lo) {
        log_error("%s: at least %lu", flag, d->lo);
        return -EINVAL;
    }
    return 0;
}

/* The worker's own flag (and its value), passed to every rank as it is. */
static int opt_pass(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    if (c->so.n_worker_args + 2 > SERVE_MAX_WORKER_ARGS) {
        log_error("%s: at most %d worker flags in all", flag, SERVE_MAX_WORKER_ARGS);
        return -EINVAL;
    }
    snprintf(c->pass_flags[c->n_pass], sizeof(c->pass_flags[c->n_pass]), "%s", flag);
    c->worker_args[c->so.n_worker_args++] = c->pass_flags[c->n_pass++];
    if (d->arg)
        c->worker_args[c->so.n_worker_args++] = val;
    return 0;
}

/* One option's value (NULL for a switch) as its row says: 0, OPT_EXIT, -EINVAL after one
 * line naming the flag, -ENOMEM. */
static int opt_apply(struct cli *c, const struct optdecl *d, const char *val)
{
    char flag[64];
    unsigned long v;
    unsigned ms;

    snprintf(flag, sizeof(flag), "--%s", d->name);
    switch (d->kind) {
    case K_STR:
        memcpy(opt_field(c, d), &val, sizeof(val));
        return 0;
    case K_SET:
        opt_store(c, d, d->lo);
        return 0;
    case K_UINT:
        if (opt_uint(flag, d, val, &v) < 0)
            return -EINVAL;
        opt_store(c, d, v);
        return 0;
    case K_SECONDS:
        if (parse_seconds(flag, val, &ms) < 0)
            return -EINVAL;
        if (ms < d->lo) {
            log_error("%s: at least %lu second%s", flag, d->lo / 1000, d->lo / 1000 == 1 ? "" : "s");
            return -EINVAL;
        }
        opt_store(c, d, ms);
        return 0;
    case K_ACCEPT:
        return 0;
    case K_NOTE:
        log_notice("%s%s%s: %s", flag, d->arg ? " " : "", d->arg ? val : "", d->vllm);
        return 0;
    case K_PASS:
        if (d->hi && opt_uint(flag, d, val, &v) < 0)
            return -EINVAL;
        return opt_pass(c, d, flag, val);
    case K_FN:
        return d->fn(c, d, flag, val);
    case K_HEAD:
        break;
    }
    ASSERT(!"an option without a handler");
    return -EINVAL;
}

static int opt_api_key(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    log_error("%s: keys are never taken from the command line (visible in ps); "
              "use --api-key-file FILE or $STEPD_API_KEY", flag);
    return -EINVAL;
}

/* Every --served-model-name, joined by commas: main() splits them into the name and aliases. */
static int opt_served(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    size_t old = c->served ? strlen(c->served) : 0;
    char *n = realloc(c->served, old + strlen(val) + 2);

    if (!n)
        return -ENOMEM;
    if (!c->served)
        n[0] = '\0';
    c->served = n;
    snprintf(c->served + old, strlen(val) + 2, "%s%s", old ? "," : "", val);
    return 0;
}

static int opt_parser(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    bool on;

    if (parse_parser(flag, val, &on) < 0)
        return -EINVAL;
    opt_store(c, d, on);
    return 0;
}

/* A port, or "off" (or "") for none: -1. */
static int opt_port(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    unsigned long v;
    int port;

    if (!strcmp(val, "off") || !val[0])
        port = -1;
    else if (parse_uint(flag, val, 65535, &v) < 0)
        return -EINVAL;
    else
        port = (int)v;
    ASSERT(d->size == sizeof(port));
    memcpy(opt_field(c, d), &port, sizeof(port));
    return 0;
}

static int opt_log_level(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    enum log_level l;

    if (log_level_parse(val, &l) < 0) {
        log_error("%s: expected error|warn|info|debug, got '%s'", flag, val);
        return -EINVAL;
    }
    log_set_level(l);
    return 0;
}

static int opt_version(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    printf("stepd %s\n", STEPD_VERSION);
    return OPT_EXIT;
}

static int opt_help(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    usage(stdout);
    return OPT_EXIT;
}

static int opt_help_vllm(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    usage_vllm(stdout);
    return OPT_EXIT;
}

static int opt_help_flags(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    usage_flags_md(stdout);
    return OPT_EXIT;
}

static int opt_gpumem(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    char *end;

    c->so.gpu_memory_utilization = strtod(val, &end);
    if (end == val || *end || !(c->so.gpu_memory_utilization > 0 && c->so.gpu_memory_utilization <= 1)) {
        log_error("%s: expected a fraction in (0, 1], got '%s'", flag, val);
        return -EINVAL;
    }
    return 0;
}

static int opt_kv_dtype(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    struct err_buf e;
    bool f32;

    if (cli_parse_kv_dtype(flag, val, &f32, &e) < 0) {
        log_error("%s", e.msg);
        return -EINVAL;
    }
    c->so.kv_cache_dtype = f32 ? "fp32" : "bf16";
    return 0;
}

static int opt_kv_mem(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    struct err_buf e;

    if (cli_parse_bytes(flag, val, 1, INT64_MAX / 2, &c->so.kv_cache_memory, &e) < 0) {
        log_error("%s", e.msg);
        return -EINVAL;
    }
    return 0;
}

static int opt_dtype(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    if (strcmp(val, "auto") && strcmp(val, "bfloat16") && strcmp(val, "bf16")) {
        log_error("%s %s: stepd computes with the checkpoint's BF16 weights and FP32 accumulation "
                  "(auto, bfloat16)", flag, val);
        return -EINVAL;
    }
    return 0;
}

static int opt_quant(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    if (strcmp(val, "mxfp4") != 0) {
        log_error("%s %s: stepd serves the checkpoint's own weights, BF16 or MXFP4 routed "
                  "experts (--quantization mxfp4)", flag, val);
        return -EINVAL;
    }
    c->so.quantization = val;
    return 0;
}

static int opt_chat_template(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    log_error("%s %s: stepd renders the Step-3.x chat template built in and takes no "
              "template file (--default-chat-template-kwargs sets its variables)", flag, val);
    return -EINVAL;
}

static int opt_template_kwargs(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    char msg[256];

    if (coord_chat_kwargs_check(val, msg, sizeof(msg)) < 0) {
        log_error("%s: %s", flag, msg);
        return -EINVAL;
    }
    c->o.default_chat_template_kwargs = val;
    return 0;
}

/* --limit-mm-per-prompt and --allowed-media-domains: daemon/media.c's settings, set by set
 * (0, or a negative errno with the reason in msg) */
static int media_opt(const char *flag, const char *val, int (*set)(const char *val, char *msg, size_t len))
{
    char msg[256] = "";
    int r = set(val, msg, sizeof(msg));

    if (r < 0)
        log_error("%s: %s", flag, r == -ENOMEM ? "out of memory" : msg);
    return r;
}

static int opt_limit_mm(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    return media_opt(flag, val, media_limit_mm_parse);
}

static int opt_media_domains(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    return media_opt(flag, val, media_allowed_domains_add);
}

/* --media-fetch-timeout: seconds (fractions too), more than 0 */
static int opt_media_fetch_timeout(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    unsigned ms;

    if (parse_seconds(flag, val, &ms) < 0)
        return -EINVAL;
    if (ms == 0) {
        log_error("%s: at least 0.001 seconds", flag);
        return -EINVAL;
    }
    media_conf.fetch_timeout_ms = ms;
    return 0;
}

/* --image-max-bytes, --image-max-pixels */
static int opt_image_limit(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    unsigned long v;

    if (parse_uint(flag, val, 1u << 30, &v) < 0)
        return -EINVAL;
    if (strcmp(d->name, "image-max-bytes") == 0)
        media_conf.lim.max_bytes = v;
    else
        media_conf.lim.max_pixels = v;
    return 0;
}

/* The worker's flag, checked here so that a bad value ends `stepd serve` before any rank. */
static int opt_logprobs_mode(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    if (strcmp(val, "raw_logprobs") && strcmp(val, "processed_logprobs")) {
        log_error("%s %s: expected raw_logprobs or processed_logprobs", flag, val);
        return -EINVAL;
    }
    return opt_pass(c, d, flag, val);
}

static int opt_worker_arg(struct cli *c, const struct optdecl *d, const char *flag, const char *val)
{
    if (c->so.n_worker_args == SERVE_MAX_WORKER_ARGS) {
        log_error("%s: at most %d", flag, SERVE_MAX_WORKER_ARGS);
        return -EINVAL;
    }
    c->worker_args[c->so.n_worker_args++] = val;
    return 0;
}

/* Where coord_opts_default or serve_opts_default (what the tests and fuzzers use without a
 * command line) set a field, the row's default, given to c, must be the same: one line
 * naming the flag, then an assertion (every start checks).  A field they leave zero takes
 * the row's default alone, so a new option is still one row. */
static void check_defaults(const struct cli *c)
{
    struct cli ref = { 0 };

    coord_opts_default(&ref.o);
    serve_opts_default(&ref.so);
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];
        const char *a = (const char *)c + d->off, *b = (const char *)&ref + d->off;
        bool same;

        if (!d->def || !d->size)
            continue;
        if (d->kind == K_STR) {
            const char *x, *y;

            memcpy(&x, a, sizeof(x));
            memcpy(&y, b, sizeof(y));
            same = !y || (x && strcmp(x, y) == 0);
        } else {
            static const char zero[sizeof(uint64_t)];

            ASSERT(d->size <= sizeof(zero));
            same = memcmp(a, b, d->size) == 0 || memcmp(b, zero, d->size) == 0;
        }
        if (!same)
            log_error("--%s: its default %s is not the one coord_opts_default or serve_opts_default sets",
                      d->name, d->def);
        ASSERT(same);
    }
}

/* A key from file (flag's), else from the environment variable env when set and not empty,
 * into *ret (NULL: none): 0, or a negative errno (logged). */
static int key_read(const char *flag, const char *file, const char *env, char **ret)
{
    const char *e = getenv(env);
    int r;

    if (file) {
        if ((r = file_read_secret(file, ret)) < 0)
            log_error("%s %s: %s", flag, file, r == -ENODATA ? "file is empty" : err_str(r));
        return r;
    }
    if (e && e[0] && !(*ret = strdup(e))) {
        log_error("%s: out of memory", env);
        return -ENOMEM;
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct option longopts[ARRAY_SIZE(optdecls) + 1];
    size_t n_lo = 0;
    struct cli cl = { 0 };
    struct coord *co = NULL;
    char *api_key = NULL, *ctl_key = NULL;
    int c, r, rc = 2;
    /* stepd serve */
    struct serve *sv = NULL;
    const struct optdecl *serve_flag = NULL;   /* the first serve-only flag seen */
    char tokenizer[4096], model_name[256];
    const char *aliases[SERVE_MAX_NAMES];
    size_t n_names = 0;
    bool serve_mode = argc > 1 && strcmp(argv[1], "serve") == 0;
    char ports[4][300];

    malloc_tune(argv);
    log_init("stepd", NULL);
    if (serve_mode) {
        argv++;                     /* getopt sees "serve" as the program name */
        argc--;
    }
    log_debug("malloc: %s", malloc_tuned ? "glibc per-thread caches off, one arena (STEPD_MALLOC_TUNE=0 keeps "
                                           "glibc's defaults)" : "glibc's defaults");
    coord_opts_default(&cl.o);
    serve_opts_default(&cl.so);
    cl.so.worker_args = cl.worker_args;
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];

        if (!d->name)
            continue;
        if (d->def && opt_apply(&cl, d, d->def) != 0)
            ASSERT(!"an option's default that its own handler refuses");
        longopts[n_lo++] = (struct option){ d->name, d->arg ? required_argument : no_argument, NULL, 256 + (int)i };
    }
    longopts[n_lo] = (struct option){ NULL, 0, NULL, 0 };
    check_defaults(&cl);
    if (normalize_flags(argc, argv) < 0)
        return 2;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        const struct optdecl *d;

        if (c == 'h') {
            usage(stdout);
            rc = 0;
            goto out;
        }
        if (c == ':') {
            log_error("%s: needs a value (stepd --help)", argv[optind - 1]);
            goto out;
        }
        if (c < 256 || (size_t)(c - 256) >= ARRAY_SIZE(optdecls)) {
            unknown_flag(argv[optind - 1]);
            goto out;
        }
        d = &optdecls[c - 256];
        if ((d->flags & OPTF_SERVE) && !serve_flag)
            serve_flag = d;
        r = opt_apply(&cl, d, optarg);
        if (r != 0) {
            rc = r == OPT_EXIT ? 0 : r == -ENOMEM ? 1 : 2;
            goto out;
        }
    }
    if (cl.port_offset && apply_port_offset(&cl.o, cl.port_offset, ports, sizeof(ports[0])) < 0)
        goto out;
    if (getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN") && (!strcmp(getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN"), "1") ||
                                                    !strcasecmp(getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN"), "true")))
        cl.so.allow_long_max_model_len = true;
    if (serve_mode) {
        if (optind >= argc) {
            log_error("stepd serve: MODEL_DIR is required (stepd serve MODEL_DIR [options])");
            goto out;
        }
        cl.so.model_dir = argv[optind++];
    } else if (serve_flag) {
        log_error("--%s is a flag of `stepd serve MODEL_DIR`", serve_flag->name);
        goto out;
    }
    if (optind < argc) {
        log_error("unexpected argument '%s'", argv[optind]);
        goto out;
    }
    if (cl.served) {
        /* the first name is the one reported, the others are aliases */
        char *save = NULL;

        for (char *t = strtok_r(cl.served, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (!t[0])
                continue;
            if (n_names == SERVE_MAX_NAMES) {
                log_error("--cl.served-model-name: at most %d names", SERVE_MAX_NAMES);
                goto out;
            }
            aliases[n_names++] = t;
        }
        if (n_names) {
            cl.o.model_name = aliases[0];
            cl.o.model_aliases = aliases + 1;
            cl.o.n_model_aliases = n_names - 1;
        }
    }
    if ((r = key_read("--api-key-file", cl.key_file, "STEPD_API_KEY", &api_key)) < 0 ||
        (r = key_read("--control-key-file", cl.ckey_file, "STEPD_CONTROL_KEY", &ctl_key)) < 0)
        goto out;
    cl.o.api_key = api_key;
    cl.o.control_key = ctl_key;
    if ((cl.o.tls.cert_file != NULL) != (cl.o.tls.key_file != NULL)) {
        log_error("--tls-cert and --tls-key go together");
        goto out;
    }
    if (serve_mode) {
        char *key = NULL;
        /* the model directory's tokenizer and name, unless given */
        if (!cl.o.tokenizer_path) {
            snprintf(tokenizer, sizeof(tokenizer), "%s/tokenizer.json", cl.so.model_dir);
            if (access(tokenizer, R_OK) == 0)
                cl.o.tokenizer_path = tokenizer;
        }
        if (!cl.o.model_name) {
            const char *b = cl.so.model_dir + strlen(cl.so.model_dir);
            while (b > cl.so.model_dir && b[-1] == '/')
                b--;
            const char *e = b;
            while (b > cl.so.model_dir && b[-1] != '/')
                b--;
            snprintf(model_name, sizeof(model_name), "%.*s", (int)(e - b), b);
            if (model_name[0])
                cl.o.model_name = model_name;
        }
        if ((r = serve_prepare(&cl.so, ctl_key, &sv, &key)) < 0) {
            rc = 2;
            goto out;
        }
        if (ctl_key) {
            memset(ctl_key, 0, strlen(ctl_key));
            free(ctl_key);
        }
        ctl_key = key;
        cl.o.control_key = ctl_key;
    }
    if ((r = coord_new(&cl.o, &co)) < 0) {
        if (r != -EADDRINUSE)           /* coord_new named the flag of the port in use */
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
    media_fetch_global_done();
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
    free(cl.served);
    return rc;
}
