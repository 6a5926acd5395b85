/* engine-rig.h - what the engine tests share (on the tiny checkpoint: test-engine-model,
 * test-engine-mtp-repair, test-engine-prefix; on the mock: test-engine-rpc and
 * engine-mock-server): a collector of one request's outputs, an engine config, a run that
 * submits each request before its step and steps until all are done, the idle accounting
 * check before free, and the mock engine of the RPC tests.  Every request of rig_submit
 * ignores EOS, so each one ends with exactly its max_tokens. */
#pragma once

#include <stdlib.h>

#include "engine.h"
#include "harness.h"
#include "mock.h"

#define RIG_MAXTOK 512

struct rig_out {
    int32_t toks[RIG_MAXTOK];
    int n;
    bool finished;
    enum engine_finish why;
    int n_cached;
    struct spec_stats mtp;
};

/* One request: greedy unless temperature > 0. */
struct rig_req {
    const int32_t *prompt;
    int n_prompt;
    int max_tokens;
    int at_step;            /* submitted before this engine step (rig_run) */
    int k;                  /* num_speculative_tokens override + 1 (0 = engine default) */
    float temperature;
    float top_p;            /* 0: the default */
    int top_k;              /* 0: the default (off) */
    float min_p;            /* 0: off */
    uint64_t seed;
    bool seed_random;       /* the seed stands for one the worker drew (the client gave none) */
    float repetition_penalty;   /* 0: off */
    int logprobs;           /* engine_request.logprobs + 1 (0 = none) */
};

static inline void rig_on_out(void *ud, const struct engine_output *o)
{
    struct rig_out *c = ud;
    ASSERT_TRUE(c->n + o->n_tokens <= RIG_MAXTOK);
    memcpy(c->toks + c->n, o->tokens, (size_t) o->n_tokens * sizeof(int32_t));
    c->n += o->n_tokens;
    c->mtp = o->mtp;
    c->n_cached = o->n_cached;
    if (o->finished) {
        c->finished = true;
        c->why = o->finish;
    }
}

/* the defaults but max_num_batched_tokens, max_num_seqs, max_model_len, the sliding window
 * and K */
static inline void rig_engine_config(struct engine_config *ec, int max_tokens, int max_seqs,
                                     int max_len, int window, int k)
{
    engine_config_init(ec);
    ec->max_num_batched_tokens = max_tokens;
    ec->max_num_seqs = max_seqs;
    ec->max_model_len = max_len;
    ec->sliding_window = window;
    ec->num_speculative_tokens = k;
}

static inline struct engine *rig_engine_new(struct forward *f, const struct engine_config *ec)
{
    struct engine *e;
    struct err_buf err;
    if (engine_new(f, ec, &e, &err) < 0)
        FAIL("engine_new: %s", err.msg);
    return e;
}

/* The RPC tests' engine, started: on a mock forward (*ret_f) of step_usec per step, 64-token
 * steps, 8 sequences of up to 512 tokens, max_waiting queued, K = k, window 64, EOS 255. */
static inline struct engine *rig_mock_engine(long step_usec, int max_waiting, int k,
                                             struct forward **ret_f)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_config_init(&mc);
    mc.step_usec = step_usec;
    ASSERT_OK(mock_forward_new(&mc, ret_f));
    rig_engine_config(&ec, 64, 8, 512, 64, k);
    ec.max_waiting = max_waiting;
    ec.eos_ids[ec.n_eos++] = 255;
    struct engine *e = rig_engine_new(*ret_f, &ec);
    ASSERT_OK(engine_start(e));
    return e;
}

/* the accounting invariant at idle (nothing held), then free; *ret (if not NULL): the loads */
static inline void rig_engine_close(struct engine *e, struct engine_loads *ret)
{
    struct engine_loads l;
    ASSERT_OK(engine_check(e));
    engine_get_loads(e, &l);
    ASSERT_EQ(l.n_alive, 0);
    ASSERT_EQ(l.kv_blocks_used, 0);
    ASSERT_TRUE(l.kv_blocks_cached <= l.kv_blocks_total);
    if (ret)
        *ret = l;
    engine_free(e);
}

static inline void rig_submit(struct engine *e, const char *id, const struct rig_req *s,
                              struct rig_out *out)
{
    struct engine_request q;
    struct err_buf err;
    engine_request_init(&q);
    q.id = id;
    q.prompt = s->prompt;
    q.n_prompt = s->n_prompt;
    q.max_tokens = s->max_tokens;
    q.ignore_eos = true;
    q.num_speculative_tokens = s->k - 1;
    q.logprobs = s->logprobs - 1;
    if (s->repetition_penalty > 0)
        q.sampling.repetition_penalty = s->repetition_penalty;
    if (s->temperature > 0) {
        q.sampling.temperature = s->temperature;
        if (s->top_p > 0)
            q.sampling.top_p = s->top_p;
        q.sampling.top_k = s->top_k > 0 ? s->top_k : q.sampling.top_k;
        q.sampling.min_p = s->min_p;
        q.sampling.seed = s->seed;
        q.seed_random = s->seed_random;
    }
    if (engine_submit(e, &q, rig_on_out, out, &err) < 0)
        FAIL("submit %s: %s", id, err.msg);
}

/* Submit request i (id "r<i>") before step s[i].at_step, step until all n are done; each one
 * must have finished with its max_tokens.  out[] is cleared first. */
static inline void rig_run(struct engine *e, const struct rig_req *s, int n, struct rig_out *out)
{
    int next = 0;
    memset(out, 0, (size_t) n * sizeof(*out));
    for (int step = 0;; step++) {
        while (next < n && s[next].at_step <= step) {
            char id[16];
            snprintf(id, sizeof(id), "r%d", next);
            rig_submit(e, id, &s[next], &out[next]);
            next++;
        }
        ASSERT_TRUE(engine_step(e) >= 0);
        struct engine_loads l;
        engine_get_loads(e, &l);
        if (next == n && !l.n_alive)
            break;
        if (step >= 1000000)
            FAIL("requests still running after %d steps", step);
    }
    for (int i = 0; i < n; i++) {
        ASSERT_TRUE(out[i].finished);
        ASSERT_EQ(out[i].n, s[i].max_tokens);
    }
}

/* a and b: the same tokens */
static inline void rig_same(const struct rig_out *a, const struct rig_out *b, const char *what)
{
    ASSERT_EQ(a->n, b->n);
    for (int t = 0; t < a->n; t++)
        if (a->toks[t] != b->toks[t])
            FAIL("%s: token %d differs (%d vs %d)", what, t, a->toks[t], b->toks[t]);
}
