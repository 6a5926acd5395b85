/* coord-int.h - the coordinator's internal objects, shared by coord.c, req.c,
 * wpool.c, openai-*.c and metrics.c. Everything here runs on the one loop thread.
 *
 * Ownership: struct coord owns the loop, the rpc context and servers, the HTTP servers
 * (http.c), the groups (struct group, wpool.c) and the live requests (struct req, req.c).
 * A request is freed when both its client side (its door: the gRPC call or the HTTP
 * request, struct req_client_ops) has ended and its engine call has delivered on_done
 * (req_free_if_done). An engine connection (struct engine_conn) is shared by
 * the requests, aborts and load polls that use it and outlives its group if calls
 * are still draining.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "admit.h"
#include "affinity.h"
#include "chunk.h"
#include "coord.h"
#include "engine-conn.h"
#include "rpc.h"

#include "stepd.pb-c.h"
#include "control.pb-c.h"
#include "health.pb-c.h"

#include <jansson.h>

#include "chat.h"
#include "gen.h"
#include "grammar.h"
#include "parser.h"
#include "request.h"
#include "tokenizer.h"

#define COORD_MAX_WORLD 8
#define REQ_OWNER_LEN 96
#define COORD_MAX_EOS 8
#define GROUP_MAX_KV_POOLS 4

struct coord;
struct group;
struct req;

#define COORD_FNV_SEED 1469598103934665603ull

/* 128 random bits in hex (getrandom; a clock-seeded generator if that fails): request and
 * session ids nobody can guess. */
#define COORD_RANDOM_HEX 33
/* 32 random hex digits (owner.c). */
void coord_random_hex(char out[COORD_RANDOM_HEX]);

/* FNV-1a over n bytes from h (COORD_FNV_SEED to start): prefix affinity, request ids. */
static inline uint64_t coord_fnv1a(const void *p, size_t n, uint64_t h)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* ------------------------------------------------------------------ metrics */

#define METRICS_MAX_BUCKETS 24
#define METRICS_MAX_POS 8

struct histogram {
    const double *bounds;       /* upper bounds, ascending */
    size_t n_bounds;
    uint64_t counts[METRICS_MAX_BUCKETS + 1];
    double sum;
    uint64_t count;
};

struct metrics {
    struct histogram ttft, itl, e2e, queue, prompt_len, gen_len;
    uint64_t prompt_tokens, generation_tokens;
    uint64_t finished[5];           /* by FinishReason */
    uint64_t status[17];            /* terminal gRPC status of Generate calls */
    uint64_t rejected_full, rejected_invalid, rejected_draining, rejected_unavailable;
    uint64_t aborts_sent;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted;
    uint64_t spec_accepted_pos[METRICS_MAX_POS];
    uint64_t spec_steps_by_drafts[METRICS_MAX_POS];   /* decode steps by drafts verified */
    uint64_t accepted;              /* admitted Generate requests */
    uint64_t so_requests;           /* structured-output requests checked (structured.c) */
    uint64_t so_compiles;           /* ... of which compiled (not in the checked cache) */
    uint64_t group_failures;
    uint64_t idle_trims;            /* heap given back while idle (loads_cb) */
};

void metrics_init(struct metrics *m);
void metrics_observe(struct histogram *h, double v);
/* Render Prometheus text exposition into a malloc'd string. */
char *metrics_render(struct coord *co, size_t *ret_len);

/* ------------------------------------------------------------------ model */

struct model_info {
    bool known;
    char name[128];
    char type[64];
    uint32_t vocab_size;
    uint32_t max_model_len;
    int32_t eos[COORD_MAX_EOS];
    size_t n_eos;
    uint32_t num_layers, hidden_size, num_experts, num_experts_per_tok;
    char quantization[64];
    uint32_t num_mtp_layers, max_num_speculative_tokens;
    bool supports_images;       /* the engine encodes images (GetModelInfoResponse) */
};

/* ------------------------------------------------------------------ groups (wpool.c) */

enum group_state {
    GROUP_FORMING,      /* waiting for ranks */
    GROUP_LOADING,      /* rendezvous sent */
    GROUP_READY,
    GROUP_FAILED,       /* waiting for ranks to come back */
};

struct rank {
    bool present;
    struct rpc_call *session;       /* the open Session stream */
    char session_id[128];
    int state;                      /* Stepd__V1__WorkerState */
    char device[32];
    uint8_t *peer;
    size_t peer_len;
    char hostname[64];
    uint32_t pid;
    float progress;
    char message[256];
    uint64_t incarnation;
    uint64_t claim_epoch;           /* registered as serving this epoch already (0: fresh) */
    uint32_t *experts;
    size_t n_experts;
    struct group *g;
    int rank;
};

struct group {
    struct coord *co;
    struct group *next;
    char name[72];
    uint64_t id;                    /* affinity.c's name for it: a hash of name, never 0 */
    unsigned world;
    bool pinned;                    /* listed by `stepd serve`: never pruned */
    int64_t dead_since_ms;          /* no rank present since then (0: some are), wpool_prune */
    uint64_t epoch;
    enum group_state state;
    struct rank ranks[COORD_MAX_WORLD];
    char engine_addr[256];
    uint8_t nccl_id[256];
    size_t nccl_len;
    struct model_info model;
    struct engine_conn *eng;
    /* load from the engine's GetLoads */
    uint32_t load_running, load_waiting, kv_used, kv_total;
    double kv_usage, tokens_per_s;
    double mean_acceptance_length;  /* MTP tokens per verify step, from the engine */
    uint32_t requests_alive;        /* engine request states alive (0 at idle) */
    uint64_t requests_created, requests_freed;  /* engine request states over its life */
    uint64_t prefix_queries, prefix_hits;       /* the engine's prefix cache, in tokens */
    uint64_t image_encodes, image_cache_hits;   /* images encoded, taken from its encoder cache */
    struct group_kv_pool {
        char kind[32];
        uint32_t used, total, cached;
        double usage;
    } kv_pools[GROUP_MAX_KV_POOLS]; /* the engine's KV pools, as GetLoads reports them */
    unsigned n_kv_pools;
    /* the engine's capacity (StateReport READY, GetLoads): at most cap_seqs + cap_waiting
     * requests routed here at once; 0 = not reported (no limit) */
    uint32_t cap_seqs, cap_waiting;
    uint64_t preemptions;
    bool loads_pending;
    int64_t loads_ok_ms;            /* last successful GetLoads (or when it became ready) */
    /* in-flight requests routed here */
    struct req *reqs;
    unsigned in_flight;
    uint64_t routed, completed, failed, aborts_sent;
    char last_error[256];
};

int wpool_init(struct coord *co);
void wpool_done(struct coord *co);
int wpool_register_methods(struct coord *co, struct rpc_server *s);
/* The group named name, created (FORMING, no ranks) with world ranks when absent; NULL
 * when out of memory.  Registration and `stepd serve` (groups listed before they form:
 * pin, they are never freed). */
struct group *wpool_group_get(struct coord *co, const char *name, unsigned world, bool pin);
/* The group for a request: among the ready groups with room (below their engine's
 * capacity) whose context holds need_len tokens (prompt + max_tokens), the one that holds
 * the longest prefix of the prompt (keys: its prefix chain, affinity.h), else the prefix's
 * home by a hash of its first block, unless that group is clearly busier than the least
 * loaded one, which is taken then; a request with images only goes to a group whose engine
 * serves images (model_info.supports_images).  NULL: none; *ret_full then says whether a ready group
 * would hold the request once it has room. */
struct group *wpool_pick(struct coord *co, const uint64_t *keys, size_t n_keys, uint32_t need_len,
                         bool images, bool *ret_full);
unsigned wpool_ready_count(const struct coord *co);
/* Some group whose engine reported its model encodes images (images: only those take them). */
bool wpool_serves_images(const struct coord *co);
/* GetLoads/GetGroups: a group's load as the coordinator knows it (its in-flight count and
 * the engine's last GetLoads answer); the message points into m and g. */
struct group_load_msg {
    Stepd__V1__GroupLoad l;
    Stepd__V1__KvPoolLoad pools[GROUP_MAX_KV_POOLS];
    Stepd__V1__KvPoolLoad *pp[GROUP_MAX_KV_POOLS];
};
void wpool_load_fill(const struct group *g, struct group_load_msg *m);
unsigned wpool_count(const struct coord *co);
void wpool_heartbeat(struct coord *co);
void wpool_poll_loads(struct coord *co);
void wpool_shutdown_sessions(struct coord *co);

/* ------------------------------------------------------------------ requests (req.c) */

/* Who asked (both doors), for the log and for scoping what a caller may touch: the key it
 * presented (a hash, never the key) and its connection. */
struct req_caller {
    bool keyed;                     /* it presented the API key */
    uint64_t key_hash;              /* coord_fnv1a of the key it presented (keyed) */
    char peer[96];                  /* "ipv4:127.0.0.1:4242", "ipv6:[::1]:4242", "unix:..." */
};

/* The client side of a request: the door it came through (the gRPC call of
 * Inference.Generate, or an HTTP request of the OpenAI API).  req.c drives every request the
 * same way and tells its door only this:
 *   chunk    one chunk of new output (chunk.h, door-neutral: each door renders it); 0,
 *            or <0 when the door has given up on its client
 *            (a slow reader): it has then ended its side itself (req_client_detach), and
 *            req.c stops the engine
 *   final    the request's final (chunk.h): the door ends its side OK
 *   end      the request ends with a status (enum rpc_status: the door maps it to its own
 *            codes); retry_ms > 0: the client may retry after that long (queue full)
 *   watch    the request is admitted: from now on the door reports its client going away
 *            (req_client_cancel) until final or end
 * After final or end req.c never calls the door for r again (r->client is NULL). */
struct req_client_ops {
    int (*chunk)(struct req *r, const struct chunk *ch);
    void (*final)(struct req *r, const struct chunk_final *f);
    void (*end)(struct req *r, int status, int retry_ms, const char *msg);
    void (*watch)(struct req *r);
};

struct req {
    struct coord *co;
    struct req *prev, *next;        /* coord->reqs (all live) */
    struct req *gprev, *gnext;      /* group->reqs (while routed) */
    struct admit_item hold;         /* on coord->held: admitted, waiting for a group with room */
    struct admit_item ai;
    char id[136];
    const struct req_client_ops *cops;
    void *client;                   /* the door's object; NULL once the client side ended */
    uint32_t choice;                /* n > 1: this request's index among the n */
    struct req_caller caller;
    /* who created it, as its front door authenticated the caller ("api-key", or without a
     * key the connection: "peer:ipv4:127.0.0.1:40312"); Abort by id reaches only requests
     * of the same owner (req_caller_owner, coord_call_owner for an Abort call), or an
     * Abort that lists abort_token (sent in the gRPC stream's first message). */
    char owner[REQ_OWNER_LEN];
    char abort_token[COORD_RANDOM_HEX];
    bool token_sent;
    struct request *in;             /* as asked, validated (shared by the n choices) */
    int32_t *prompt;
    size_t n_prompt;
    uint32_t *image_pos;            /* where in->images[i]'s tokens start in prompt */
    struct group *grp;
    char grp_name[72];
    struct engine_conn *eng;
    struct rpc_client_call *ecall;  /* Generate, or Submit while it is in flight */
    struct req *onext;              /* eng->out_tab chain */
    struct engine_conn *submit_eng; /* while Submit is in flight (ecall): the ref it holds */
    bool in_out_tab;
    bool abort_pending;             /* Abort wanted while Submit was in flight */
    bool abort_sent;
    bool engine_done;
    bool final_sent;
    bool cancelled;                 /* client went away */
    bool text_mode;
    bool want_ids;
    bool continuous_usage;
    bool in_reasoning;              /* chat output still inside the reasoning (reasoning tokens) */
    bool primed;                    /* the parsers have seen the prompt's forced opening */
    bool tools_parsed;              /* chat output through the tool-call parser */
    bool content_seen;              /* tools_parsed: content other than whitespace sent */
    bool calls_seen;                /* tools_parsed: a tool call started */
    bool calls_cut;                 /* single_tool_call: a second call started, the output ends */
    char *ws_held;                  /* tools_parsed: whitespace-only content not sent yet */
    size_t n_ws_held;
    int64_t deadline_ms;
    int64_t t_arrival, t_dispatch, t_first, t_last;
    uint32_t n_out;
    uint32_t n_reasoning;           /* output tokens inside the reasoning */
    double itl_sum;
    uint32_t n_itl;
    struct tok_gen *gen;            /* text and chat input: the output pipeline */
    uint64_t *aff_keys;             /* the prompt's prefix chain for routing (affinity.h) */
    size_t n_aff_keys;
};

/* A request from a door: what the door knows of it besides the request itself. */
struct req_origin {
    const struct req_client_ops *ops;
    void **clients;                 /* [n]: the door's object for each choice */
    uint32_t n;                     /* choices: n engine requests sharing one prompt */
    int64_t deadline_ms;            /* absolute (rpc_now_ms); INT64_MAX = none */
    const struct req_caller *caller;
};
/* Serve `in` (owned from here, also on failure): the checks before any work (draining,
 * deadline, queue full, validation, a ready group, the id), the prompt built once for the
 * n choices, the text pipeline, admission and routing.  Refusals are reported through the
 * door (ops->end) of every choice before this returns; a choice admitted is handed to its
 * door by ops->watch.  An entry point (frees what it ends). */
void req_submit(struct coord *co, struct request *in, const struct req_origin *o);
/* A fresh request id ("stepd-" and 32 random hex digits) into buf. */
void req_id_assign(char *buf, size_t n);
/* The door's client went away (disconnect, its deadline passed): stop r.  An entry point:
 * r may be freed. */
void req_client_cancel(struct req *r);
/* The door ended its side on its own with status (e.g. a slow reader): no more calls to it
 * for r. */
void req_client_detach(struct req *r, int status, const char *msg);

/* Inference.Generate (grpc-door.c): the gRPC door's handler on the loop. */
void req_generate(struct rpc_call *call, const ProtobufCMessage *msg, void *ud);
/* Fail every request routed to g (group down); message names the group. */
void req_fail_group(struct group *g, const char *why);
/* Route the held requests (admitted, waiting for a group with room) while groups have room;
 * with no ready group left, end them UNAVAILABLE.  Call whenever room may have appeared
 * (a request left a group, a group became ready or reported its capacity) or a group went
 * down.  An admission promotion: it frees the held requests it ends. */
void req_held_kick(struct coord *co);
/* Dispatch a request promoted from the queue: 0, or <0 when it failed (the client
 * call is finished; the caller still holds and must release its slot). */
int req_dispatch_promoted(struct req *r);
/* Free r if nothing references it any more.  The one rule for freeing a request: only
 * the entry points - the callbacks rpc/ and libuv call (a client call's cancel, an engine
 * call's messages and end, the output stream's batches and end, Submit's answer, the
 * timers) - and the admission promotions (req_slot_release, req_held_kick: they free
 * the other requests they fail to route) call this, once, after they are done with r; the
 * helpers they call (req_finish, req_engine_end, req_stop_engine, ...) never free r.  A
 * walk over a list must not keep a pointer to the next element across a call that may
 * free (req_sweep_deadlines starts again, req_fail_all ends the waiting ones first). */
void req_free_if_done(struct req *r);
/* Abort by client-visible id (Inference.Abort) among the requests of owner (struct
 * req.owner) or whose abort_token is among the n_tokens tokens. Returns 1 if found. */
int req_abort_by_id(struct coord *co, const char *id, const char *owner, char *const *tokens, size_t n_tokens);
/* End requests on an output stream whose engine let their deadline pass by more than
 * a second (a Generate call has its own gRPC deadline; a Submit-ed request does not). */
void req_sweep_deadlines(struct coord *co);
/* Fail everything (forced shutdown). */
void req_fail_all(struct coord *co, int status, const char *why);
/* The engine's answers for r (engine-conn.c's output stream, or r's own Generate call):
 * one chunk or final, and the end of the engine's part (status OK: a final came first).
 * Neither frees r (see req_free_if_done). */
void req_engine_output(struct req *r, const Stepd__V1__GenerateResponse *er);
void req_engine_end(struct req *r, int status, const char *details);
/* validate.c: in against the server's limits and the model: 0 or -EINVAL with the field
 * named in msg (in->names). */
int request_validate(const struct coord *co, const struct request *in, char *msg, size_t len);
/* Structured output (structured.c): set in's one constraint (0, or -EINVAL naming field
 * when another is set); the OpenAI doors' fields (response_format, structured_outputs,
 * guided_*) and the gRPC door's; compile in's constraint with the grammar engine: 0,
 * -EINVAL naming the field with the engine's message, -EOPNOTSUPP without llguidance. */
int request_set_structured(struct request *in, const char *field, const char *kind,
                           const char *text, char *msg, size_t len);
int door_structured_openai(const json_t *body, struct request *in, char *msg, size_t len);
int coord_structured_check(struct coord *co, const struct request *in, char *msg, size_t len);
/* Tool calls on chat input as in's constraint: tool_choice "required" or named, the rest of the
 * opened call (the function's name among the tools, each parameter following its schema);
 * "auto" (unless another constraint is set), every call from the <tool_call> token call_id
 * on (in->so_start).  end_id: the </tool_call> token (-1: its text).  0 or -EINVAL. */
int door_tool_constraint(struct request *in, int32_t call_id, int32_t end_id, char *msg, size_t len);
/* The chat part only (messages, tools, template kwargs, reasoning effort). */
int request_validate_chat(const struct coord *co, const struct request *in, char *msg, size_t len);

/* chat.c: render a chat request with the Step-3.7 template (docs/MODEL.md §7) into a malloc'd
 * prompt string; -EINVAL with the field named in msg. */
int coord_chat_render(struct coord *co, const struct request *in, char **ret, char *msg, size_t len);
/* A text or chat request's prompt as the engine receives it: tokenized (a chat rendered by its
 * template first), each image's placeholder replaced by the image's token layout
 * (media_prompt_expand; *image_pos: where each starts, malloc, NULL without images).  The
 * generation and the tokenize endpoints count alike.  0, or a negative errno with msg naming
 * the field. */
struct tok_ids;
int coord_prompt_encode(struct coord *co, const struct request *in, struct tok_ids *ids, uint32_t **image_pos,
                        char *msg, size_t len);
/* The output a forced tool choice puts at the end of the prompt (into buf): its length, or 0
 * when the request's tool choice forces nothing. */
size_t coord_chat_forced_prefix(const struct request *in, char *buf, size_t len);

/* ------------------------------------------------------------------ coordinator */

#ifdef STEPD_HAVE_ABSL_TUNE
/* absl-tune.cc: turn off absl::Mutex deadlock detection (a debugging aid that
 * Debian's Abseil leaves on) for gRPC's locks. */
void coord_absl_tune(void);
#endif

/* What the CQ thread reads to answer without the loop (rpc cq_hook): overload
 * rejections of Generate and health Check. The loop publishes; the CQ thread reads
 * and counts. Admission: the CQ thread refuses a Generate call (RESOURCE_EXHAUSTED,
 * pushback) when running + queued (admit_published) + in_transit >= max_running +
 * max_queue, and otherwise passes it to the loop, counted in in_transit until its
 * handler starts (or it ends before that, cq_unmark). The admission on the loop stays
 * the exact authority: a call the CQ thread passes in a race is refused there. The
 * one approximation: a call can be refused while an earlier one that will turn out
 * invalid is still in transit (it counted as holding a slot). */
struct coord_gate {
    _Atomic unsigned in_transit;    /* Generate calls passed to the loop, handler not yet run */
    _Atomic bool closed;            /* draining or exiting: the loop answers (UNAVAILABLE) */
    _Atomic int health[2];          /* Check answer: [0] liveness, [1] readiness */
    _Atomic uint64_t rejected_full; /* RESOURCE_EXHAUSTED answered on the CQ thread */
};

struct health_watch {
    struct health_watch *next;
    struct rpc_call *call;
    int kind;                       /* 0 liveness, 1 readiness, -1 unknown */
    int last;
};

/* What the files below the loop owner tell the ones above them: calls through these
 * pointers (coord.c's table, set by coord_new) rather than by name, so that daemon/'s
 * call graph stays without a circle (tools/dev/callgraph.py, test callgraph): wpool.c,
 * serve.c and engine-conn.c call no function of req.c, health.c or coord.c, and req.c
 * none of coord.c. */
struct coord_upcalls {
    /* wpool.c: group g went down: fail the requests routed to it (req_fail_group) */
    void (*group_failed)(struct group *g, const char *why);
    /* wpool.c: room may have appeared, or a group went down: route the held requests
     * (req_held_kick) */
    void (*room)(struct coord *co);
    /* wpool.c, serve.c: a group or a rank changed: readiness again (coord_health_update) */
    void (*health_changed)(struct coord *co);
    /* serve.c: the service manager's STATUS line again (health_status_line) */
    void (*status_line)(struct coord *co);
    /* req.c: a request was freed: the drain may be complete (coord_check_drained) */
    void (*req_freed)(struct coord *co);
    /* engine-conn.c: an output of r's engine (req_engine_output), and the end of r's
     * engine side (req_engine_ended: r may be freed) */
    void (*engine_output)(struct req *r, const Stepd__V1__GenerateResponse *er);
    void (*engine_ended)(struct req *r, int status, const char *details);
};

struct coord {
    struct coord_opts o;
    const struct coord_upcalls *up;
    uv_loop_t loop;
    struct rpc_ctx *rpc;
    struct rpc_server *srv_pub, *srv_admin, *srv_ctl;
    int pub_port, admin_port, ctl_port, metrics_port;
    struct resp_store *responses;   /* stored responses (responses.c) */
    unsigned servers_live;
    uv_signal_t sigterm, sigint;
    uv_timer_t t_heartbeat, t_loads, t_watchdog, t_drain, t_force;
    int signals;
    bool draining;
    bool exiting;
    int exit_code;
    int64_t start_ms;
    struct admit admit;
    struct req *reqs;
    unsigned n_reqs;
    struct admit_list held;         /* requests admitted that no group has room for yet */
    struct group *groups;
    struct model_info model;        /* from the first group that registered one */
    struct metrics m;
    struct coord_gate gate;
    struct health_watch *watches;
    int last_ready;                 /* readiness last broadcast */
    int64_t busy_ms;                /* last time requests were in flight */
    size_t trim_free;               /* heap bytes free at the last idle malloc_trim */
    int64_t trim_idle_ms;           /* next scheduled idle trim, in ms of idle */
    struct tokenizer *tok;          /* NULL without --tokenizer: token input only */
    struct grammar_vocab *gv;       /* structured output: built at the first constraint */
    uint8_t so_ok[64][32];          /* digests of constraints that compiled (a ring) */
    unsigned so_ok_n;               /* entries written so far */
    struct affinity *aff;           /* prefix-affine routing (NULL: off) */
    int32_t tok_think_start, tok_think_end, tok_tool_call;  /* the parsers' tags (-1: none) */
    struct http_server *http;       /* the OpenAI HTTP API (--host/--port), or NULL */
    struct http_server *http_metrics;   /* --metrics-listen: /metrics and probes only */
    int http_port;                  /* bound */
    struct serve *serve;            /* `stepd serve`: the supervised ranks (serve.c), or NULL */
};

/* ---- health.c ---- */
/* Re-evaluate readiness; notify Watch subscribers and systemd when it changed;
 * publish readiness and the drain state for the CQ thread (struct coord_gate). */
void coord_health_update(struct coord *co);
/* Publish the state the CQ thread answers from (health Check, the drain gate). */
void health_publish(struct coord *co);
/* Periodic: forget ended Watch streams, publish again. */
void health_tick(struct coord *co);
/* The service manager's STATUS line: groups ready, loading progress, running, queued. */
void health_status_line(struct coord *co);
/* Shutdown: end every Watch stream with NOT_SERVING and UNAVAILABLE. */
void health_watches_end(struct coord *co);
/* grpc.health.v1.Health Check and Watch on server s. */
int health_register_methods(struct coord *co, struct rpc_server *s);
/* CQ thread (rpc cq_hook of Generate, grpc-door.c): answer RESOURCE_EXHAUSTED at once when full. */
bool req_generate_cq(struct rpc_call *call, void *ud);
void req_generate_unmark(int mark, void *ud);
bool coord_ready(const struct coord *co);
/* The same owner string for a request's caller, whichever door it came through. */
void req_caller_owner(const struct coord *co, const struct req_caller *c, char *buf, size_t n);
/* The owner string of a gRPC call (an Abort's): "api-key" with a server key, else its peer. */
void coord_call_owner(const struct coord *co, const struct rpc_call *call, char *buf, size_t n);
/* Why readiness is NOT_SERVING, for people (/healthz, logs): "" when ready. */
void coord_unready_reason(const struct coord *co, char *buf, size_t n);
/* Called when the last request finished (drain completion). */
void coord_check_drained(struct coord *co);
/* The served vocabulary's size, and the longest context of a ready group (model-limits.c). */
uint32_t coord_vocab_size(const struct coord *co);
uint32_t coord_max_model_len(const struct coord *co);
/* The engine side of r ended (req_engine_end), then r freed if nothing else holds it. */
void req_engine_ended(struct req *r, int status, const char *details);
