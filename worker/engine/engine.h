/* engine.h - the serving engine of rank 0: requests in, token deltas out.
 *
 * The engine owns the scheduler (batcher.h), the KV block manager (kv.h), sampling
 * (sampler.h) and MTP speculation (spec.h) and drives a struct forward (forward.h: the
 * real model or the mock).  One engine step: take new requests and abort flags, expire
 * deadlines, schedule, hand the step plan to the optional on_plan hook (the dist layer
 * broadcasts it to ranks 1..N-1), run forward.step, verify drafts and sample, apply stop
 * conditions, propose the next drafts, then deliver outputs.  A step (an MTP chain) whose
 * every row's token is its raw argmax runs the forward's greedy form instead (forward.h,
 * step_argmax / mtp_step_argmax: no logits row copied); a trunk step whose rows are greedy
 * or sampled from a top_k <= 64 with no processor before it runs its sampled form
 * (step_topk: k candidates a row copied, sampler_sample_cands); otherwise every row is
 * copied.
 *
 * Prefix cache (kv.h; engine_config.enable_prefix_caching, on by default): a request is
 * admitted from the longest cached prefix of its tokens (only the rest costs budget and
 * compute; engine_output.n_cached says how many), and after every step the blocks each
 * request completed are keyed for later requests, generated tokens included (multi-turn).
 *
 * Threads: engine_submit, engine_abort and engine_get_loads may be called from any
 * thread.  Everything else in a step runs on one thread: the engine's own (after
 * engine_start) or the caller of engine_step (tests; never both).  Output callbacks run
 * on that thread with no engine lock held; they may call engine_submit/engine_abort but
 * must not block.  Typical use (worker/main.c on rank 0):
 *
 *     engine_config_init(&cfg); cfg.eos_ids = ...; cfg.on_plan = bcast; ...
 *     engine_new(forward, &cfg, &eng, &err);
 *     engine_start(eng);
 *     struct engine_rpc_opts ro = { .addr = "127.0.0.1:20061", .group = "g0", ... };
 *     engine_rpc_start(eng, &ro, &rpc, &port, &err);     (engine-rpc.c, below)
 *     ... run until SIGTERM ...
 *     engine_rpc_stop(rpc); engine_free(eng);
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "clock.h"
#include "err.h"
#include "forward.h"
#include "plan.h"
#include "sampler.h"
#include "spec-policy.h"
#include "spec.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ENGINE_MAX_EOS 8
#define ENGINE_MAX_STOP_IDS 64
#define ENGINE_MAX_ID_LEN 128
#define ENGINE_MAX_LOGPROBS 20
#define ENGINE_MAX_CACHE_SALT 1024

struct engine;

/* Images (issue 40).  A view: uint8 RGB, row-major [height, width, 3] (the encoder
 * normalises).  An image: its content hash (the encoder cache's and the prefix cache's
 * key) and its views in token order. */
struct engine_view {
    int width, height;
    const uint8_t *rgb;
};

struct engine_image {
    uint8_t sha256[32];
    const struct engine_view *views;
    int n_views;
};

/* The vision encoder the engine calls on its own thread (worker.c: vision.h on rank 0).
 * view_tokens: the embedding rows of a view, or a negative errno when the encoder cannot
 * take it; encode: the rows of n views, in order, into out [sum of view_tokens, hidden]. */
struct engine_vision {
    int32_t image_token_id;
    int hidden;
    int (*view_tokens)(void *ctx, const struct engine_view *v);
    int (*encode)(void *ctx, const struct engine_view *v, int n, float *out, struct err_buf *e);
    void *ctx;
};

struct engine_config {
    int max_num_batched_tokens;   /* token budget per step (default 512) */
    int max_num_seqs;             /* running sequences (default: forward->max_seqs) */
    int max_model_len;            /* prompt + output cap in tokens (default 4096) */
    int max_waiting;              /* waiting queue (default 256): at most max_num_seqs +
                                     max_waiting requests alive at once */
    int sliding_window;           /* tokens seen by sliding layers; 0 = never release */
    int num_speculative_tokens;   /* default K (0 .. min(3, forward->n_mtp)): the most drafts */
    enum spec_draft_policy spec_policy; /* drafts per step: adaptive (default) or fixed K */
    /* the draft vocabulary (forward.h set_draft_vocab): 0 (default) the MTP heads score the
     * whole vocabulary; N (a multiple of 64) the N token ids this engine has emitted most
     * often, ranked from its own output counts once it has emitted 8 N tokens and again at
     * every doubling (ties to the lower id).  Drafts are still verified by the trunk, so
     * outputs are unchanged; only the cost of a draft and how many are accepted move. */
    int draft_vocab;
    int32_t eos_ids[ENGINE_MAX_EOS];
    int n_eos;
    /* what requests' logprobs report: false (default) the target model's distribution before
     * any sampling transform (vLLM's raw_logprobs); true the processed one the sampler drew
     * from (processed_logprobs: after penalties, temperature, top-k/p; sampler_logprobs) */
    bool logprobs_processed;
    bool enable_prefix_caching;   /* reuse cached KV blocks of shared prefixes (default on) */
    /* structured output: the model's tokenizer.json (borrowed, outlives the engine), read by
     * the grammar engine (common/grammar.h) at the first constrained request; NULL = such
     * requests are refused.  An engine that never sees one never loads llguidance. */
    const char *grammar_tokenizer;
    const char *prefix_cache_salt;/* deployment salt of the cache keys; NULL = 32 random bytes
                                     drawn at engine_new (kv.h, kv_prefix_root) */
    int test_digest_cut_bits;     /* tests only (kv_pool_config.test_digest_cut_bits) */
    /* called once per step, before forward.step, with the plan (may be NULL) */
    int (*on_plan)(void *ctx, const struct step_plan *p);
    void *on_plan_ctx;
    /* words for a failed step (rc < 0 from the plan broadcast, the forward or the MTP
     * chain), e.g. which rank of the group was lost; NULL = the errno's text.  Engine
     * thread. */
    void (*describe_failure)(void *ctx, int rc, char *buf, size_t len);
    void *describe_failure_ctx;
    /* the time source of deadlines (engine_request.deadline_usec) and of the engine's
     * measurements: the draft policy's costs and clock (spec_policy_new), forward_s, mtp_s
     * and engine_s; zeroed (default) the monotonic clock of engine_now_usec().  Tests drive
     * simulated time with it (a mock forward that advances it instead of sleeping).
     * Request timings (engine_timings) stay on engine_now_usec(). */
    struct clk_src clock;
    /* the vision encoder (NULL: none; requests with images are refused) and how many
     * images' encoder outputs the engine keeps by content hash (LRU; default 16, 0 = none);
     * image_batch_views: the most views of one encoder call over the images new in a step
     * (default 8; an image with more views goes alone) */
    const struct engine_vision *vision;
    int image_cache_entries;
    int image_batch_views;
};

void engine_config_init(struct engine_config *cfg);

enum engine_finish {
    ENGINE_FINISH_NONE,       /* not finished */
    ENGINE_FINISH_STOP,       /* EOS or a stop token id */
    ENGINE_FINISH_LENGTH,     /* max_tokens or max_model_len */
    ENGINE_FINISH_ABORT,      /* engine_abort or engine shutdown */
    ENGINE_FINISH_DEADLINE,   /* deadline passed (queued or running) */
    ENGINE_FINISH_ERROR,      /* the step failed (a rank lost, ...): the request ends with
                                 a status (UNAVAILABLE), never a final; message says why */
    _ENGINE_FINISH_MAX,
};

const char *engine_finish_name(enum engine_finish f);

struct engine_request {
    const char *id;                   /* copied; 1..128 printable bytes */
    const int32_t *prompt;            /* copied */
    int n_prompt;
    struct sampling_params sampling;  /* logit_bias copied */
    int max_tokens;                   /* <= 0: up to max_model_len */
    int min_tokens;                   /* stop/EOS ignored before this many outputs */
    bool ignore_eos;
    const int32_t *stop_token_ids;    /* copied */
    int n_stop_token_ids;
    int priority;                     /* lower = earlier */
    int num_speculative_tokens;       /* -1 = engine default, else 0..3 */
    int64_t deadline_usec;            /* absolute, on engine_config.clock (by default
                                         engine_now_usec()); 0 = none */
    int logprobs;                     /* -1 = none; N in 0..ENGINE_MAX_LOGPROBS: each output
                                         token's logprob and the N most likely tokens' */
    const char *cache_salt;           /* prefix-cache tenant: requests share cached KV only
                                         with requests of the same salt; NULL/"" = none */
    bool seed_random;                 /* sampling.seed was drawn at random (the client gave
                                         none): the tokens need be exact in distribution
                                         only, not the seed's realisation (the prefix
                                         cache's MTP rule, docs/ARCHITECTURE.md) */
    /* structured output (grammar.h): kind "json_schema", "json_object", "regex" or "lark"
     * and its text (NULL = free); every output token is drawn under the grammar's mask,
     * from the one after the first constraint_start token when that is >= 0 (the end of
     * the reasoning), else from the first.  MTP drafts are checked against it. */
    const char *constraint_kind;
    const char *constraint;
    int32_t constraint_start;
    /* images in prompt order (copied): the prompt holds, per image, one image_token_id
     * per embedding row of its views (engine_vision.view_tokens), and no other
     * image_token_id.  Encoded at the first step that sees the request (once per image
     * while the cache keeps it).  The engine keys an image by SHA-256 over its sha256 and
     * its views' sizes and pixels (a hash that lies about its pixels shares nothing); the
     * keys enter the prefix-cache root, so only requests with the same images in the same
     * order share KV. */
    const struct engine_image *images;
    int n_images;
};

void engine_request_init(struct engine_request *r);

struct engine_timings {
    double queue_s;             /* arrival -> first scheduled */
    double prefill_s;           /* first scheduled -> first token */
    double first_token_s;       /* arrival -> first token (TTFT) */
    double decode_s;            /* first token -> last token */
    double mean_inter_token_s;
    double e2e_s;
};

/* One output token's logprob and the top N of the distribution it came from (the target
 * model's, also for tokens MTP drafted), most likely first (lower id on ties). */
struct engine_logprob {
    int32_t token;
    float logprob;
    int n_top;
    int32_t top_ids[ENGINE_MAX_LOGPROBS];
    float top_logprobs[ENGINE_MAX_LOGPROBS];
};

struct engine_output {
    const char *id;
    const int32_t *tokens;      /* new tokens since the last output (borrowed) */
    int n_tokens;
    const struct engine_logprob *logprobs;  /* [n_tokens] when the request asked; else NULL */
    bool finished;
    enum engine_finish finish;
    int32_t stop_token;         /* matched EOS / stop id, -1 otherwise */
    const char *message;        /* detail for ERROR / DEADLINE, "" otherwise */
    int n_prompt;
    int n_cached;               /* prompt tokens reused from the prefix cache (first admission) */
    int n_completion;           /* cumulative */
    int n_preempted;
    struct spec_stats mtp;      /* cumulative */
    struct engine_timings timings; /* final only */
};

typedef void (*engine_output_cb)(void *ud, const struct engine_output *out);

/* Create an engine over f (borrowed; must outlive the engine).  -EINVAL with a sentence
 * in err on a bad config. */
int engine_new(struct forward *f, const struct engine_config *cfg, struct engine **ret,
               struct err_buf *err);
/* Stop the thread if started, finish every live request with ABORT (callbacks run),
 * and free.  NULL-safe. */
void engine_free(struct engine *e);

/* Run steps on an engine thread until engine_stop/engine_free. */
int engine_start(struct engine *e);
void engine_stop(struct engine *e);

/* Queue a request.  Returns 0; -EINVAL (err names the field), -EEXIST (id in flight),
 * -EAGAIN (max_num_seqs + max_waiting requests alive: the engine's capacity),
 * -ESHUTDOWN (engine failed or stopping), -ENOMEM.
 * On success cb will be called at least once, the last time with finished set. */
int engine_submit(struct engine *e, const struct engine_request *r, engine_output_cb cb, void *ud,
                  struct err_buf *err);
/* Flag requests for abort; each is finished (blocks freed) by the next step.  Returns
 * how many of the ids were in flight. */
int engine_abort(struct engine *e, const char *const *ids, int n_ids);

/* One step on the caller's thread (only when not started).  Returns the number of
 * sequences in the step (0 = idle) or a negative errno from the forward. */
int engine_step(struct engine *e);
/* Step until nothing is alive (tests).  Returns 0 or the first error. */
int engine_run_until_idle(struct engine *e);

struct engine_loads {
    int n_running;
    int n_waiting;
    int n_alive;                /* submitted and not yet finished */
    int max_num_seqs, max_waiting;  /* capacity: n_alive stays <= their sum */
    int kv_blocks_used;         /* held by running sequences, both pools */
    int kv_blocks_total;
    int kv_blocks_cached;       /* unreferenced blocks kept for prefix reuse, both pools */
    double kv_usage;            /* used / total over both pools */
    struct {
        int used, cached, total;
    } kv_pool[_KV_GROUP_MAX];   /* per pool kind (enum kv_group) */
    uint64_t prefix_queries;    /* tokens of admitted requests looked up in the prefix cache */
    uint64_t prefix_hits;       /* of those, tokens reused from cached blocks */
    uint64_t prefix_evictions;  /* cached blocks evicted to make room */
    uint64_t n_preemptions;
    uint64_t n_steps;
    uint64_t n_generated;       /* output tokens over the engine's life */
    double tokens_per_s;        /* output tokens/s over the last few seconds */
    struct spec_stats mtp;
    double mean_accept_len;
    int last_error;             /* forward error that stopped the engine, 0 if none */
    uint64_t n_requests_created;/* request states allocated (admin counters for the */
    uint64_t n_requests_freed;  /*   D1 invariant: equal at idle) */
    double forward_s;           /* wall time in forward.step */
    double mtp_s;               /* wall time in the MTP chain (forward.mtp_step + drafting) */
    double engine_s;            /* wall time in the rest of engine_step */
    int draft_vocab;            /* ids in the installed draft vocabulary (0: none yet) */
    double draft_vocab_cover;   /* share of the counted output tokens inside it */
    uint64_t draft_vocab_installs;
    struct spec_policy_stats policy;    /* the adaptive draft policy's counts (spec-policy.h) */
    uint64_t image_encodes;     /* images run through the vision encoder */
    uint64_t image_cache_hits;  /* images whose rows came from the encoder cache */
};

void engine_get_loads(struct engine *e, struct engine_loads *ret);

/* Accounting invariant: KV pool consistent, and when nothing is alive no block is held
 * (free + cached == total in both pools) and no slot is held.  Returns 0 or -EUCLEAN.
 * Engine thread (or stopped). */
int engine_check(struct engine *e);

const struct engine_config *engine_get_config(const struct engine *e);
int engine_vocab_size(const struct engine *e);
int engine_max_spec(const struct engine *e);

/* --- the engine gRPC service (engine-rpc.c): stepd.v1.Engine on rank 0 ---
 * Generate (token_ids input only; server-streaming Chunk token deltas then one Final
 * with finish reason, usage, MTP statistics and timings), Abort, GetLoads, GetModelInfo.
 * Runs its own thread (libuv loop + rpc/rpc.h glue); engine outputs are handed to it
 * through a queue.  The gRPC deadline becomes the request's deadline; a cancelled call
 * aborts the request.  Errors are status codes: INVALID_ARGUMENT naming the field,
 * RESOURCE_EXHAUSTED (queue full), ALREADY_EXISTS (id in flight), UNAVAILABLE (engine
 * failed or stopping), DEADLINE_EXCEEDED. */
struct engine_rpc;

struct engine_rpc_opts {
    const char *addr;             /* "127.0.0.1:20061", "127.0.0.1:0", "unix:/path" */
    const char *api_key;          /* NULL = none */
    const char *group;            /* worker group name reported in Final and GetLoads */
    const char *model_name;
    const char *model_type;       /* e.g. "step3p7" */
    const char *quantization;
    int num_layers, hidden_size, num_experts, num_experts_per_tok;
    int max_recv_msg_bytes;       /* 0 = rpc default */
    size_t output_stream_buffer;  /* bytes queued on an output stream whose client does not
                                     read before it ends RESOURCE_EXHAUSTED; 0 = 64 MiB */
};

/* Start serving engine e (borrowed; it must keep running until engine_rpc_stop returns).
 * *ret_port (may be NULL) gets the bound TCP port.  -EADDRINUSE/-EIO/-EINVAL with a
 * sentence in err. */
int engine_rpc_start(struct engine *e, const struct engine_rpc_opts *o, struct engine_rpc **ret,
                     int *ret_port, struct err_buf *err);
/* Stop accepting calls, abort the requests of live calls, wait for their finals, and
 * free.  Call before engine_stop/engine_free.  NULL-safe. */
void engine_rpc_stop(struct engine_rpc *s);
/* Any thread: fail every request in flight with UNAVAILABLE naming msg (every output
 * stream ends, every Generate call is finished, their requests are aborted); the service
 * keeps serving.  For a rank that lost its coordinator.  NULL-safe. */
void engine_rpc_fail_all(struct engine_rpc *s, const char *msg);

/* CLOCK_MONOTONIC in microseconds (the clock of deadline_usec unless engine_config.clock
 * says otherwise). */
int64_t engine_now_usec(void);

#ifdef __cplusplus
}
#endif
