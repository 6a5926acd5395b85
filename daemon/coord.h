/* coord.h - the coordinator daemon `stepd`: public face of the serving system.
 *
 * Serves stepd.v1.Inference and grpc.health.v1.Health on the public port, Admin
 * (+ health) on a loopback admin port, the internal stepd.ctl.v1.Control service
 * (+ health) for workers, and Prometheus text metrics over HTTP. It validates and
 * admits requests (running cap + bounded queue), routes whole requests to ready
 * worker groups (least loaded, optional prefix affinity), forwards them to the
 * group's rank-0 engine over stepd.v1.Engine, and streams the answer back.
 * See docs/ARCHITECTURE.md §1 and §4.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "rpc.h"

struct coord;

struct coord_opts {
    const char *listen;             /* public gRPC, default 127.0.0.1:20051 */
    const char *admin_listen;       /* Admin + health, default 127.0.0.1:20053 */
    const char *control_listen;     /* worker control, default 127.0.0.1:20052 */
    const char *metrics_listen;     /* HTTP /metrics, default 127.0.0.1:9464; "" = off */
    const char *http_host;          /* OpenAI HTTP API (--host/--port), default 127.0.0.1 */
    int http_port;                  /* default 8000; 0 = any free port; -1 = off */
    bool insecure_listen;           /* allow non-loopback without TLS + API key */
    struct rpc_tls_files tls;       /* public port TLS when tls.cert_file is set */
    const char *api_key;            /* public + admin (never from argv) */
    /* the cluster key: workers send it on the control port, the coordinator to rank 0's
     * engine; required unless insecure_control */
    const char *control_key;
    bool insecure_control;          /* no control key: accept keyless workers and engines */
    const char *tokenizer_path;     /* tokenizer.json for text/chat input */
    /* --default-chat-template-kwargs: a JSON object (checked with coord_chat_kwargs_check)
     * applied under every chat request's own chat_template_kwargs, or NULL */
    const char *default_chat_template_kwargs;
    const char *model_name;         /* served model name (default: from rank 0) */
    const char *const *model_aliases;   /* more names the model answers to (--served-model-name) */
    size_t n_model_aliases;
    bool reasoning_parser;          /* chat output: reasoning split from content (step3p5) */
    bool tool_parser;               /* chat output: tool calls parsed (step3p5) */
    unsigned max_n;                 /* HTTP: cap on n (choices per request) */
    unsigned responses_store_size;  /* HTTP: stored responses kept (0 = no store) */
    unsigned responses_store_ttl_s; /* HTTP: how long one is kept (0 = no store) */
    size_t http_max_body_bytes;     /* HTTP request body cap (413 above) */
    size_t http_max_header_bytes;   /* HTTP request line + headers cap (431 above) */
    unsigned http_max_connections;
    unsigned http_max_connections_per_ip;   /* 0 = none beyond http_max_connections */
    unsigned http_header_timeout_ms;    /* HTTP: a request head must arrive within this */
    unsigned http_timeout_ms;       /* HTTP: a request must arrive within this, idle connections
                                       are closed after it */
    unsigned request_timeout_ms;    /* HTTP: a generation request's deadline; 0 = none */
    const char *http_allowed_hosts;     /* --allowed-hosts (http.h), or NULL */
    const char *http_allowed_origins;   /* --allowed-origins (http.h), or NULL: CORS off */
    unsigned max_running;           /* requests dispatched to engines at once */
    unsigned max_queue;             /* requests waiting for a slot */
    unsigned max_input_tokens;      /* 0 = model context - 1 */
    unsigned max_tokens_cap;        /* cap on sampling_params.max_tokens */
    unsigned default_max_tokens;
    unsigned max_stop, max_stop_len, max_logprobs, max_logit_bias, max_stop_token_ids;
    unsigned max_prompt_bytes;      /* text/chat input size cap */
    unsigned drain_timeout_ms;
    unsigned heartbeat_ms;          /* control-session heartbeat period */
    unsigned worker_timeout_ms;     /* a rank that stops answering (keepalive on its control
                                       session, GetLoads on rank 0) this long is declared gone */
    unsigned loads_poll_ms;         /* engine GetLoads period */
    unsigned prefix_affinity;       /* prefix-affine routing: blocks of N tokens (0 = off) */
    unsigned prefix_affinity_entries; /* prefix blocks remembered (the LRU table's size) */
    int max_recv_msg_bytes;
    int max_concurrent_streams;
    size_t max_call_buffer_bytes;   /* per-stream send buffer cap (slow consumers) */
    uint32_t fallback_vocab_size;   /* when no engine has reported model info */
};

void coord_opts_default(struct coord_opts *o);
/* Validate options, load the tokenizer, bind every listener. Logs the reason and
 * returns a negative errno on failure (e.g. -EPERM for an insecure non-loopback
 * listen, -EADDRINUSE). */
int coord_new(const struct coord_opts *o, struct coord **ret);
/* Run until drained or forced; returns the process exit code. */
int coord_run(struct coord *co);
void coord_free(struct coord *co);
/* Check a JSON object of chat_template_kwargs (--default-chat-template-kwargs): 0, or
 * -EINVAL with a sentence in msg. */
int coord_chat_kwargs_check(const char *json, char *msg, size_t len);

/* True when host:port / unix: address is loopback-only. */
