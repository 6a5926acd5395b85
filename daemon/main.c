/* main.c - `stepd`, the coordinator: flags, logging, coord_new/coord_run. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
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

enum {
    OPT_LISTEN = 256, OPT_ADMIN, OPT_CONTROL, OPT_METRICS, OPT_INSECURE, OPT_TLS_CERT, OPT_TLS_KEY,
    OPT_TLS_CA, OPT_TLS_REQ, OPT_KEY_FILE, OPT_CKEY_FILE, OPT_TOKENIZER, OPT_MODEL, OPT_VOCAB,
    OPT_MAX_RUNNING, OPT_MAX_QUEUE, OPT_MAX_INPUT, OPT_MAX_TOKENS_CAP, OPT_DEF_MAX_TOKENS, OPT_MAX_RECV,
    OPT_MAX_STREAMS, OPT_STREAM_BUF, OPT_DRAIN, OPT_HEARTBEAT, OPT_LOADS, OPT_AFFINITY, OPT_AFFINITY_N, OPT_LOG, OPT_VERSION,
    OPT_API_KEY, OPT_WTIMEOUT, OPT_HOST, OPT_PORT, OPT_SERVED, OPT_RPARSER, OPT_TPARSER, OPT_AUTO_TOOLS,
    OPT_MAX_N, OPT_RESP_STORE, OPT_RESP_TTL, OPT_HTTP_BODY, OPT_HTTP_HEADER, OPT_HTTP_CONNS, OPT_HTTP_TIMEOUT, OPT_REQ_TIMEOUT, OPT_INSECURE_CTL,
    OPT_ALLOWED_HOSTS, OPT_ALLOWED_ORIGINS, OPT_HTTP_CONNS_IP, OPT_HTTP_HEAD_TIMEOUT,
    OPT_PORT_OFFSET, OPT_HELP, OPT_HELP_VLLM,
    /* stepd serve */
    OPT_S_TP, OPT_S_DP, OPT_S_DEVICE, OPT_S_EP, OPT_S_SPEC, OPT_S_MAXLEN, OPT_S_MAXBT, OPT_S_MAXSEQS,
    OPT_S_GPUMEM, OPT_S_THREADS, OPT_S_WBIN, OPT_S_WARG, OPT_S_LIMIT, OPT_S_BACKOFF,
    OPT_S_BACKOFF_MAX, OPT_S_STOP, OPT_S_SPECLOG, OPT_S_KV_DTYPE, OPT_S_KV_MEM, OPT_S_PREFIX_ON,
    OPT_S_PREFIX_OFF, OPT_S_BLOCK, OPT_S_DTYPE, OPT_S_QUANT, OPT_S_CHAT_TEMPLATE, OPT_S_TEMPLATE_KW,
    OPT_S_LIMIT_MM, OPT_S_ALLOW_LONG, OPT_S_NOTE, OPT_S_PASS, OPT_S_PASS_UINT,
    OPT_S_MEDIA_DOMAINS, OPT_IMG_BYTES, OPT_IMG_PIXELS,   /* images in (daemon/media.c) */
};

/* What an option is: where it applies, and how the docs' table of vLLM flags shows it. */
#define OPTF_SERVE 1u           /* a flag of `stepd serve MODEL_DIR` only */
#define OPTF_VLLM 2u            /* vLLM's flag (same name, same meaning): in the docs' table */
#define OPTF_HIDDEN 4u          /* not in --help (the docs' table generator) */

/* One declaration per option: getopt_long's table, --help and the docs' table of vLLM
 * flags (`stepd --help-vllm-flags`, docs/OPERATIONS.md §1) all come from it.  An entry
 * without a name is a heading of --help.  OPT_S_NOTE options are accepted with one log line,
 * `vllm`: what stepd does instead. */
struct optdecl {
    const char *name;
    const char *arg;            /* the value's name in --help; NULL: a switch */
    int id;
    unsigned flags;
    const char *help;           /* --help text ("\n" continues it on the next line) */
    const char *vllm;           /* OPTF_VLLM: what stepd does with vLLM's flag */
};

#define SERVE_VLLM (OPTF_SERVE | OPTF_VLLM)

static const struct optdecl optdecls[] = {
    { NULL, NULL, 0, 0, "Listening (loopback by default):", NULL },
    { "listen", "ADDR", OPT_LISTEN, 0, "public gRPC (default 127.0.0.1:20051; unix:/path allowed)", NULL },
    { "admin-listen", "ADDR", OPT_ADMIN, 0, "Admin + health (default 127.0.0.1:20053)", NULL },
    { "control-listen", "ADDR", OPT_CONTROL, 0, "worker control (default 127.0.0.1:20052)", NULL },
    { "metrics-listen", "ADDR", OPT_METRICS, 0, "HTTP /metrics, /healthz, /health, /ready (default 127.0.0.1:9464;\n"
      "\"\" = off; /metrics is also on the API port)", NULL },
    { "host", "HOST", OPT_HOST, OPTF_VLLM, "OpenAI HTTP API host (default 127.0.0.1)", "the OpenAI HTTP API's address" },
    { "port", "PORT", OPT_PORT, OPTF_VLLM, "OpenAI HTTP API port (default 8000; off = none)", "the OpenAI HTTP API's port" },
    { "port-offset", "N", OPT_PORT_OFFSET, 0, "add N to every port above (given or default; 0 stays 0): a second\n"
      "instance on one host moves all of them at once", NULL },
    { "insecure-listen", NULL, OPT_INSECURE, 0, "allow non-loopback listens without TLS + API key", NULL },
    { NULL, NULL, 0, 0, "Security:", NULL },
    { "tls-cert", "FILE", OPT_TLS_CERT, 0, "TLS certificate of the public port (with --tls-key)", NULL },
    { "tls-key", "FILE", OPT_TLS_KEY, 0, "its key", NULL },
    { "tls-client-ca", "FILE", OPT_TLS_CA, 0, "CA for client certificates", NULL },
    { "tls-require-client-cert", NULL, OPT_TLS_REQ, 0, "mTLS (needs --tls-client-ca)", NULL },
    { "api-key-file", "FILE", OPT_KEY_FILE, 0, "API key for every RPC except health (or $STEPD_API_KEY)", NULL },
    { "api-key", "KEY", OPT_API_KEY, OPTF_VLLM, "refused: a key on the command line is visible in ps", "refused (a key in argv "
      "is visible in ps): use --api-key-file FILE or $STEPD_API_KEY" },
    { "control-key-file", "FILE", OPT_CKEY_FILE, 0, "the cluster key: workers send it, their engines check it\n"
      "(or $STEPD_CONTROL_KEY; `stepd serve` makes one per run)", NULL },
    { "insecure-control", NULL, OPT_INSECURE_CTL, 0, "no control key: accept keyless workers (and engines)", NULL },
    { NULL, NULL, 0, 0, "Text:", NULL },
    { "tokenizer", "FILE", OPT_TOKENIZER, OPTF_VLLM, "tokenizer.json (enables text/chat input, Tokenize; `stepd serve`:\n"
      "default MODEL_DIR/tokenizer.json)", "the tokenizer.json file (default MODEL_DIR/tokenizer.json)" },
    { "model-name", "NAME", OPT_MODEL, 0, "served model name (default: reported by rank 0)", NULL },
    { "served-model-name", "NAME", OPT_SERVED, OPTF_VLLM, "the same; repeat it (or NAME,ALIAS,...) for aliases the\n"
      "model answers to (the first is the one reported)", "the model's name in the API, aliases after it" },
    { "reasoning-parser", "P", OPT_RPARSER, OPTF_VLLM, "step3p5 (default) or none: reasoning split from the content",
      "step3p5 (built in, the default) or none; others are refused" },
    { "tool-call-parser", "P", OPT_TPARSER, OPTF_VLLM, "step3p5 (default) or none: tool calls parsed from the output",
      "step3p5 (built in, the default) or none; others are refused" },
    { "enable-auto-tool-choice", NULL, OPT_AUTO_TOOLS, OPTF_VLLM, "accepted (tool_choice \"auto\" is served with the parser)",
      "accepted: tool_choice \"auto\" is always served with the tool-call parser" },
    { "vocab-size", "N", OPT_VOCAB, 0, "vocabulary size until an engine reports one", NULL },
    { NULL, NULL, 0, 0, "Limits:", NULL },
    { "max-running", "N", OPT_MAX_RUNNING, 0, "requests in flight to engines (default 1024)", NULL },
    { "max-queue", "N", OPT_MAX_QUEUE, 0, "requests waiting for a slot (default 1024)", NULL },
    { "max-input-tokens", "N", OPT_MAX_INPUT, 0, "prompt cap (default: context length)", NULL },
    { "max-tokens-cap", "N", OPT_MAX_TOKENS_CAP, 0, "cap on max_tokens (default 32768)", NULL },
    { "default-max-tokens", "N", OPT_DEF_MAX_TOKENS, 0, "max_tokens when unset (default 256)", NULL },
    { "max-recv-msg-bytes", "N", OPT_MAX_RECV, 0, "gRPC receive limit (default 4194304)", NULL },
    { "max-concurrent-streams", "N", OPT_MAX_STREAMS, 0, "per connection (default 1024)", NULL },
    { "stream-buffer-bytes", "N", OPT_STREAM_BUF, 0, "per-stream send buffer before a slow client is cut (1 MiB)", NULL },
    { "max-n", "N", OPT_MAX_N, 0, "HTTP: cap on n, choices per request (default 16)", NULL },
    { "responses-store-size", "N", OPT_RESP_STORE, 0,
      "HTTP: /v1/responses kept for previous_response_id (default 1024; 0 = off)", NULL },
    { "responses-store-ttl", "SECONDS", OPT_RESP_TTL, 0,
      "how long a stored response is kept (default 3600; 0 = off)", NULL },
    { "http-max-body-bytes", "N", OPT_HTTP_BODY, 0, "HTTP request body cap, 413 above (default 4194304)", NULL },
    { "http-max-header-bytes", "N", OPT_HTTP_HEADER, 0, "HTTP request line + headers cap, 431 above (default 32768)", NULL },
    { "http-max-connections", "N", OPT_HTTP_CONNS, 0, "HTTP connections at once (default 1024; idle ones make room)", NULL },
    { "http-max-connections-per-ip", "N", OPT_HTTP_CONNS_IP, 0, "HTTP connections of one client address (default 256)", NULL },
    { "http-header-timeout", "SECONDS", OPT_HTTP_HEAD_TIMEOUT, 0, "HTTP: a request head must arrive within this (default 10)", NULL },
    { "http-timeout", "SECONDS", OPT_HTTP_TIMEOUT, 0, "HTTP: a request must arrive within this; idle connections\n"
      "close after it (default 30)", NULL },
    { "request-timeout", "SECONDS", OPT_REQ_TIMEOUT, 0, "HTTP: deadline of a generation request, 504 past it (0 = none)", NULL },
    { "allowed-hosts", "LIST", OPT_ALLOWED_HOSTS, 0, "HTTP: Host names served beside IP literals, localhost and --host\n"
      "(comma-separated or a JSON list; \"*\" any)", NULL },
    { "allowed-origins", "LIST", OPT_ALLOWED_ORIGINS, OPTF_VLLM, "HTTP: browser origins served with CORS (default none: a request\n"
      "with an Origin header is refused)", "CORS for the browser origins listed (default none)" },
    { NULL, NULL, 0, 0, "Behaviour:", NULL },
    { "drain-timeout", "SECONDS", OPT_DRAIN, 0, "finish in-flight work within this on SIGTERM (default 30)", NULL },
    { "heartbeat-ms", "N", OPT_HEARTBEAT, 0, "control heartbeat period (default 1000)", NULL },
    { "loads-poll-ms", "N", OPT_LOADS, 0, "engine GetLoads period (default 250)", NULL },
    { "worker-timeout-ms", "N", OPT_WTIMEOUT, 0, "declare a silent rank gone after N ms (default 10000)", NULL },
    { "prefix-affinity", "N", OPT_AFFINITY, 0, "route a request to the group that holds the longest prefix of\n"
      "its prompt, in blocks of N tokens (default 16; 0 = off)", NULL },
    { "prefix-affinity-entries", "N", OPT_AFFINITY_N, 0, "prompt blocks remembered for that (default 65536)", NULL },
    { "log-level", "LEVEL", OPT_LOG, 0, "error|warn|info|debug", NULL },
    { "version", NULL, OPT_VERSION, 0, "print the version and exit", NULL },
    { "help", NULL, OPT_HELP, 0, "this text", NULL },
    { "help-vllm-flags", NULL, OPT_HELP_VLLM, OPTF_HIDDEN, "", NULL },
    { NULL, NULL, 0, OPTF_SERVE, "stepd serve MODEL_DIR: this coordinator starts and supervises its worker ranks\n"
      "(vLLM's flag names and meanings; --a_b is --a-b, --flag=value is --flag value):", NULL },
    { "tensor-parallel-size", "N", OPT_S_TP, SERVE_VLLM, "ranks per group: 1, 2, 4, 8 (default 1)",
      "ranks per group (1, 2, 4, 8): attention heads and experts sharded over them" },
    { "data-parallel-size", "D", OPT_S_DP, SERVE_VLLM, "groups (default 1)", "groups g0..g{D-1}, requests spread over them" },
    { "device", "cpu|cuda", OPT_S_DEVICE, SERVE_VLLM, "rank r of group d runs on cuda:(d*N + r) (default cpu); cuda\n"
      "without a GPU or the CUDA plugin is refused before any rank starts",
      "cpu (default) or cuda: rank r of group d on cuda:(d*N + r)" },
    { "enable-expert-parallel", NULL, OPT_S_EP, SERVE_VLLM, "accepted: routed experts are always expert-parallel over a group",
      "accepted: routed experts are always split over the ranks of a group (expert parallel)" },
    { "speculative-config", "JSON", OPT_S_SPEC, SERVE_VLLM, "'{\"method\":\"mtp\",\"num_speculative_tokens\":K}', K 0..3 (plus\n"
      "draft_quantization, draft_policy, draft_vocab); checked before any rank starts",
      "method \"mtp\" (the checkpoint's MTP layers), num_speculative_tokens 0..3 (default: the layers there are), "
      "model (a directory with the MTP layers); other methods and unknown keys are refused before any rank starts" },
    { "max-model-len", "L", OPT_S_MAXLEN, SERVE_VLLM, "longest sequence (default 1024); above the model's\n"
      "max_position_embeddings only with --allow-long-max-model-len",
      "longest sequence; above the model's max_position_embeddings refused unless --allow-long-max-model-len" },
    { "allow-long-max-model-len", NULL, OPT_S_ALLOW_LONG, OPTF_SERVE, "serve a --max-model-len above the model's\n"
      "max_position_embeddings (or $VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)", NULL },
    { "max-num-batched-tokens", "T", OPT_S_MAXBT, SERVE_VLLM, "tokens per engine step (default 256)",
      "tokens per engine step; longer prompts are prefilled in chunks of it" },
    { "max-num-seqs", "S", OPT_S_MAXSEQS, SERVE_VLLM, "sequences per engine step (default 8)", "sequences per engine step" },
    { "block-size", "BS", OPT_S_BLOCK, SERVE_VLLM, "KV cache block, in tokens (default 16)", "KV cache block, in tokens" },
    { "gpu-memory-utilization", "F", OPT_S_GPUMEM, SERVE_VLLM, "share of a GPU's memory for a CUDA rank (default 0.9)",
      "share of each GPU's memory a CUDA rank uses (the KV cache takes what the weights leave); "
      "no effect on CPU ranks" },
    { "kv-cache-memory", "BYTES", OPT_S_KV_MEM, SERVE_VLLM, "KV cache per rank, e.g. 8GiB (default: on CPU every sequence\n"
      "at --max-model-len, on a GPU --gpu-memory-utilization); one too small for\n"
      "one sequence is refused before any rank starts",
      "KV cache bytes per rank (e.g. 8GiB); below one sequence of --max-model-len refused before any rank starts" },
    { "kv-cache-dtype", "D", OPT_S_KV_DTYPE, SERVE_VLLM, "auto or bf16 (default), fp32",
      "auto/bf16 (default) or fp32; fp8 and others are refused" },
    { "enable-prefix-caching", NULL, OPT_S_PREFIX_ON, SERVE_VLLM, "reuse cached KV blocks of prompts (the default)",
      "the default: prompts reuse cached KV blocks" },
    { "no-enable-prefix-caching", NULL, OPT_S_PREFIX_OFF, SERVE_VLLM, "recompute every prompt", "every prompt is recomputed" },
    { "dtype", "D", OPT_S_DTYPE, SERVE_VLLM, "auto, bfloat16 or bf16: stepd computes with BF16 weights\n"
      "and FP32 accumulation; float16 and float32 are refused",
      "auto, bfloat16: BF16 weights, FP32 accumulation; float16/float32 are refused" },
    { "quantization", "Q", OPT_S_QUANT, SERVE_VLLM, "mxfp4: the checkpoint's MXFP4 routed experts (the only\n"
      "quantization; a BF16 checkpoint is served as it is, without the flag)",
      "mxfp4 (the checkpoint's MXFP4 routed experts; refused for a BF16 checkpoint); other methods are refused" },
    { "chat-template", "FILE", OPT_S_CHAT_TEMPLATE, SERVE_VLLM, "refused: stepd renders the Step-3.x chat template built in",
      "refused: stepd renders the Step-3.x chat template built in (no Jinja)" },
    { "default-chat-template-kwargs", "JSON", OPT_S_TEMPLATE_KW, SERVE_VLLM, "defaults of chat_template_kwargs for every\n"
      "chat request (reasoning_effort, preserve_thinking, add_generation_prompt);\n"
      "a request's own keys win",
      "defaults of chat_template_kwargs (reasoning_effort, preserve_thinking, add_generation_prompt); a request's own win" },
    { "limit-mm-per-prompt", "JSON", OPT_S_LIMIT_MM, SERVE_VLLM, "'{\"image\": N}': images per prompt (default 16; 0 = text\n"
      "only); other media must be 0",
      "'{\"image\": N}' caps image_url parts per prompt (default 16; 0: text only); other media must be 0" },
    { "allowed-media-domains", "HOSTS", OPT_S_MEDIA_DOMAINS, SERVE_VLLM, "http(s) image URL hosts (comma-separated,\n"
      "repeatable); stepd does not fetch: URLs get a 400 asking for a data URL",
      "names the hosts whose http(s) image URLs are allowed; stepd does not fetch them yet (400: send a data URL)" },
    { "image-max-bytes", "N", OPT_IMG_BYTES, 0, "an image's encoded size cap, 400 above (default 20971520)", NULL },
    { "image-max-pixels", "N", OPT_IMG_PIXELS, 0, "an image's declared width x height cap, 400 above, checked\n"
      "before decoding (default 40000000; 16384 per side)", NULL },
    { "disable-cascade-attn", NULL, OPT_S_NOTE, SERVE_VLLM, NULL,
      "stepd has no cascade attention: every sequence's attention is computed on its own blocks" },
    { "enforce-eager", NULL, OPT_S_NOTE, SERVE_VLLM, NULL,
      "stepd captures no CUDA graphs: every step runs eagerly already" },
    { "trust-remote-code", NULL, OPT_S_NOTE, SERVE_VLLM, NULL,
      "stepd runs no code from the model directory: config.json and the safetensors are read by its own loader" },
    { "linear-backend", "B", OPT_S_NOTE, SERVE_VLLM, NULL,
      "stepd picks its own matmul kernels per device and CPU (MXFP4 experts included); the value is not used" },
    { "async-scheduling", NULL, OPT_S_NOTE, SERVE_VLLM, NULL,
      "stepd's engine has one scheduler (continuous batching); nothing to switch" },
    { "enable-chunked-prefill", NULL, OPT_S_NOTE, SERVE_VLLM, NULL,
      "always on: prompts longer than --max-num-batched-tokens are prefilled in chunks" },
    { "enable-eplb", NULL, OPT_S_NOTE, SERVE_VLLM, NULL,
      "stepd places the routed experts statically (a contiguous share per rank); no load balancer" },
    { "logprobs-mode", "M", OPT_S_PASS, SERVE_VLLM, "raw_logprobs (default) or processed_logprobs: what logprobs\n"
      "report (the worker's flag)", "raw_logprobs (default) or processed_logprobs, as vLLM" },
    { "threads", "T", OPT_S_THREADS, OPTF_SERVE, "CPU threads per rank (default: the CPUs shared out)", NULL },
    { "max-waiting", "N", OPT_S_PASS_UINT, OPTF_SERVE, "requests an engine queues beyond --max-num-seqs (the worker's\n"
      "flag; default: the KV pool's block count, within 64..4096)", NULL },
    { "kv-blocks", "B", OPT_S_PASS_UINT, OPTF_SERVE, "full-attention KV blocks per rank, overriding the budget", NULL },
    { "prefix-cache-salt", "S", OPT_S_PASS, OPTF_SERVE, "deployment salt of the prefix-cache keys (default: random)", NULL },
    { "exact", NULL, OPT_S_PASS, OPTF_SERVE, "CPU: the exact W4A32 MXFP4 path instead of the int8 fast path", NULL },
    { "mtp-model", "DIR", OPT_S_PASS, OPTF_SERVE, "MTP layers from another directory", NULL },
    { "comm-net-devices", "DEVS", OPT_S_PASS, OPTF_SERVE, "network devices the groups' UCX transports bind (default lo)",
      NULL },
    { "collective-timeout", "MS", OPT_S_PASS_UINT, OPTF_SERVE, "deadline of every collective (default 30000)", NULL },
    { "rendezvous-timeout", "MS", OPT_S_PASS_UINT, OPTF_SERVE, "how long a rank waits for the others (default 60000)",
      NULL },
    { "load-timeout", "MS", OPT_S_PASS_UINT, OPTF_SERVE, "how long ranks wait for each other to load (default 1800000)",
      NULL },
    { "worker-binary", "PATH", OPT_S_WBIN, OPTF_SERVE, "stepd-worker to run (default: beside stepd, else $PATH)", NULL },
    { "worker-arg", "ARG", OPT_S_WARG, OPTF_SERVE, "one more flag for every rank (repeatable)", NULL },
    { "worker-restart-limit", "N", OPT_S_LIMIT, OPTF_SERVE, "failures in a row before a group is given up (default 5)", NULL },
    { "worker-backoff-ms", "MS", OPT_S_BACKOFF, OPTF_SERVE, "first restart delay, doubling (default 500)", NULL },
    { "worker-backoff-max-ms", "MS", OPT_S_BACKOFF_MAX, OPTF_SERVE, "longest restart delay (default 30000)", NULL },
    { "worker-stop-timeout", "S", OPT_S_STOP, OPTF_SERVE, "seconds ranks get to stop before SIGTERM (default 15)", NULL },
    { "spec-log-interval", "S", OPT_S_SPECLOG, OPTF_SERVE, "spec-decoding metrics in the log every S s (default 10, 0 = off)",
      NULL },
};

static void usage(FILE *f)
{
    fprintf(f, "usage: stepd [options]\n"
               "       stepd serve MODEL_DIR [options] [serve options]\n"
               "Coordinator for stepd worker groups: public gRPC API (stepd.v1.Inference),\n"
               "Admin, worker control service, health and Prometheus metrics.\n");
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];
        const char *h = d->id == OPT_S_NOTE ? d->vllm : d->help;    /* what stepd does instead */
        char head[64];
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

/* docs/OPERATIONS.md's table: each vLLM flag stepd takes, and what stepd does with it. */
static void usage_vllm(FILE *f)
{
    fprintf(f, "| vLLM flag | stepd |\n|---|---|\n");
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];
        const char *a = d->arg ? d->arg : "";

        if (!d->name || !(d->flags & OPTF_VLLM))
            continue;
        fprintf(f, "| `--%s%s", d->name, d->arg ? " " : "");
        for (; *a; a++)                 /* a '|' in a table cell is escaped */
            fprintf(f, *a == '|' ? "\\|" : "%c", *a);
        fprintf(f, "` | %s |\n", d->vllm);
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

int main(int argc, char **argv)
{
    struct option longopts[ARRAY_SIZE(optdecls) + 1];
    const struct optdecl *lo_decl[ARRAY_SIZE(optdecls)];
    size_t n_lo = 0;
    int lo_index;
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
    unsigned port_offset = 0;
    char pass_flags[SERVE_MAX_WORKER_ARGS][48];
    size_t n_pass = 0;
    char ports[4][300], msg[256];

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
    for (size_t i = 0; i < ARRAY_SIZE(optdecls); i++) {
        const struct optdecl *d = &optdecls[i];

        if (!d->name)
            continue;
        lo_decl[n_lo] = d;
        longopts[n_lo++] = (struct option){ d->name, d->arg ? required_argument : no_argument, NULL, d->id };
    }
    longopts[n_lo] = (struct option){ NULL, 0, NULL, 0 };
    if (normalize_flags(argc, argv) < 0)
        return 2;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", longopts, (lo_index = -1, &lo_index))) != -1) {
        const struct optdecl *d = lo_index >= 0 && (size_t)lo_index < n_lo ? lo_decl[lo_index] : NULL;

        if (d && (d->flags & OPTF_SERVE) && !serve_flag)
            serve_flag = d->name;
        switch (c) {
        case OPT_S_PASS_UINT: {
            char fl[64];

            snprintf(fl, sizeof(fl), "--%s", d->name);
            if (parse_uint(fl, optarg, INT32_MAX, &v) < 0)
                return 2;
            if (v == 0) {
                log_error("%s: at least 1", fl);
                return 2;
            }
        }
            /* fall through */
        case OPT_S_PASS:
            /* the worker's own flag, passed to every rank as it is */
            if (d->name && !strcmp(d->name, "logprobs-mode") && strcmp(optarg, "raw_logprobs") &&
                strcmp(optarg, "processed_logprobs")) {
                log_error("--logprobs-mode %s: expected raw_logprobs or processed_logprobs", optarg);
                return 2;
            }
            if (so.n_worker_args + 2 > SERVE_MAX_WORKER_ARGS) {
                log_error("--%s: at most %d worker flags in all", d->name, SERVE_MAX_WORKER_ARGS);
                return 2;
            }
            snprintf(pass_flags[n_pass], sizeof(pass_flags[n_pass]), "--%s", d->name);
            worker_args[so.n_worker_args++] = pass_flags[n_pass++];
            if (d->arg)
                worker_args[so.n_worker_args++] = optarg;
            break;
        case OPT_S_NOTE:
            log_notice("--%s%s%s: %s", d->name, d->arg ? " " : "", d->arg ? optarg : "", d->vllm);
            break;
        case OPT_S_KV_DTYPE: {
            struct err_buf e;
            bool f32;

            if (cli_parse_kv_dtype("--kv-cache-dtype", optarg, &f32, &e) < 0) {
                log_error("%s", e.msg);
                return 2;
            }
            so.kv_cache_dtype = f32 ? "fp32" : "bf16";
            break;
        }
        case OPT_S_KV_MEM: {
            struct err_buf e;

            if (cli_parse_bytes("--kv-cache-memory", optarg, 1, INT64_MAX / 2, &so.kv_cache_memory, &e) < 0) {
                log_error("%s", e.msg);
                return 2;
            }
            break;
        }
        case OPT_S_PREFIX_ON: so.prefix_caching = 1; break;
        case OPT_S_PREFIX_OFF: so.prefix_caching = 0; break;
        case OPT_S_ALLOW_LONG: so.allow_long_max_model_len = true; break;
        case OPT_S_DTYPE:
            if (strcmp(optarg, "auto") && strcmp(optarg, "bfloat16") && strcmp(optarg, "bf16")) {
                log_error("--dtype %s: stepd computes with the checkpoint's BF16 weights and FP32 accumulation "
                          "(auto, bfloat16)", optarg);
                return 2;
            }
            break;
        case OPT_S_QUANT:
            if (strcmp(optarg, "mxfp4") != 0) {
                log_error("--quantization %s: stepd serves the checkpoint's own weights, BF16 or MXFP4 routed "
                          "experts (--quantization mxfp4)", optarg);
                return 2;
            }
            so.quantization = optarg;
            break;
        case OPT_S_CHAT_TEMPLATE:
            log_error("--chat-template %s: stepd renders the Step-3.x chat template built in and takes no "
                      "template file (--default-chat-template-kwargs sets its variables)", optarg);
            return 2;
        case OPT_S_TEMPLATE_KW:
            if (coord_chat_kwargs_check(optarg, msg, sizeof(msg)) < 0) {
                log_error("--default-chat-template-kwargs: %s", msg);
                return 2;
            }
            o.default_chat_template_kwargs = optarg;
            break;
        case OPT_S_LIMIT_MM:
        case OPT_S_MEDIA_DOMAINS: {
            char mmsg[256] = "";
            int mr = c == OPT_S_LIMIT_MM ? media_limit_mm_parse(optarg, mmsg, sizeof(mmsg))
                                              : media_allowed_domains_add(optarg, mmsg, sizeof(mmsg));
            if (mr < 0) {
                log_error("--%s: %s", d->name, mr == -ENOMEM ? "out of memory" : mmsg);
                return 2;
            }
            break;
        }
        case OPT_IMG_BYTES:
        case OPT_IMG_PIXELS:
            if (parse_uint(c == OPT_IMG_BYTES ? "--image-max-bytes" : "--image-max-pixels", optarg, 1u << 30, &v) < 0)
                return 2;
            if (c == OPT_IMG_BYTES)
                media_conf.lim.max_bytes = v;
            else
                media_conf.lim.max_pixels = v;
            break;
        case OPT_PORT_OFFSET:
            if (parse_uint("--port-offset", optarg, 65535, &v) < 0)
                return 2;
            port_offset = (unsigned)v;
            break;
        case OPT_HELP_VLLM:
            usage_vllm(stdout);
            return 0;
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
        UINT_OPT(OPT_RESP_STORE, "--responses-store-size", 1u << 20, responses_store_size)
        UINT_OPT(OPT_RESP_TTL, "--responses-store-ttl", 86400u * 365, responses_store_ttl_s)
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
        SERVE_UINT(OPT_S_BLOCK, "--block-size", 1, 4096, block_size)
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
        case OPT_ALLOWED_ORIGINS: o.http_allowed_origins = optarg; break;
        case OPT_HTTP_HEAD_TIMEOUT:
            if (parse_seconds("--http-header-timeout", optarg, &o.http_header_timeout_ms) < 0)
                return 2;
            if (o.http_header_timeout_ms < 1000) {
                log_error("--http-header-timeout: at least 1 second");
                return 2;
            }
            break;
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
        case OPT_HELP:
            usage(stdout);
            return 0;
        case ':':
            log_error("%s: needs a value (stepd --help)", argv[optind - 1]);
            return 2;
        case '?':
            unknown_flag(argv[optind - 1]);
            return 2;
        default:
            ASSERT(!"an option without a handler");
        }
    }
    if (port_offset && apply_port_offset(&o, port_offset, ports, sizeof(ports[0])) < 0)
        return 2;
    if (getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN") && (!strcmp(getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN"), "1") ||
                                                    !strcasecmp(getenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN"), "true")))
        so.allow_long_max_model_len = true;
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
