/* test-engine-rpc.c - the stepd.v1.Engine service over loopback gRPC on a mock engine:
 * Generate streams token deltas equal to the engine's greedy output then one Final (finish
 * reason, usage, MTP statistics, timings, matched stop id); text input and bad fields are
 * INVALID_ARGUMENT naming the field; Abort ends a stream with finish reason abort; a
 * client cancel and a gRPC deadline free the request's KV blocks; a full queue is
 * RESOURCE_EXHAUSTED; the prefix cache: usage.cached_tokens, cache_salt isolates and is
 * bounded, GetLoads counts queries and hits and reports both KV pools; GetLoads and
 * GetModelInfo report the engine; an output stream
 * (OpenOutputs + Submit) carries the same tokens as Generate, batched across requests,
 * and ends UNAVAILABLE when the service stops; stop returns cleanly. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "engine-rig.h"
#include "engine.h"
#include "harness.h"
#include "mock.h"
#include "pb-util.h"
#include "rpc.h"
#include "stepd.pb-c.h"

static uv_loop_t *loop;

struct res {
    bool done;
    int status;
    char details[256];
    int32_t toks[512];
    int n;
    int n_chunks;
    bool got_final;
    int finish_reason;
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    uint32_t drafts, accepted;
    size_t n_per_pos;
    int stop_id;
    double ttft;
    char group[32];
    uint32_t aborted;
    uint32_t running, waiting, kv_total, vocab, max_len;
    uint64_t prefix_queries, prefix_hits;
    size_t n_pools;
    char pool_kind[2][32];
    uint32_t pool_total[2], pool_cached[2];
    struct rpc_client_call *call;
    int cancel_after;
};

static void on_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct res *r = ud;
    if (msg->descriptor == &stepd__v1__generate_response__descriptor) {
        const Stepd__V1__GenerateResponse *g = (const void *) msg;
        if (g->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK) {
            for (size_t i = 0; i < g->chunk->n_token_ids; i++)
                r->toks[r->n++] = g->chunk->token_ids[i];
            r->n_chunks++;
            if (r->cancel_after && r->n_chunks == r->cancel_after)
                rpc_client_cancel(c);
        } else {
            const Stepd__V1__Final *f = g->final;
            r->got_final = true;
            r->finish_reason = f->finish_reason;
            r->prompt_tokens = f->usage->prompt_tokens;
            r->completion_tokens = f->usage->completion_tokens;
            r->cached_tokens = f->usage->cached_tokens;
            r->drafts = f->mtp->num_draft_tokens;
            r->accepted = f->mtp->num_accepted_tokens;
            r->n_per_pos = f->mtp->n_accepted_per_position;
            r->stop_id = f->matched_stop_case == STEPD__V1__FINAL__MATCHED_STOP_STOP_TOKEN_ID
                             ? f->stop_token_id : -1;
            r->ttft = f->timings->first_token_s;
            snprintf(r->group, sizeof(r->group), "%s", f->group);
        }
    } else if (msg->descriptor == &stepd__v1__abort_response__descriptor) {
        r->aborted = ((const Stepd__V1__AbortResponse *) msg)->aborted;
    } else if (msg->descriptor == &stepd__v1__get_loads_response__descriptor) {
        const Stepd__V1__GetLoadsResponse *l = (const void *) msg;
        ASSERT_EQ(l->n_loads, 1);
        r->running = l->loads[0]->num_running;
        r->waiting = l->loads[0]->num_waiting;
        r->kv_total = l->loads[0]->kv_blocks_total;
        r->prefix_queries = l->loads[0]->prefix_cache_queries;
        r->prefix_hits = l->loads[0]->prefix_cache_hits;
        r->n_pools = l->loads[0]->n_kv_pools;
        for (size_t i = 0; i < r->n_pools && i < 2; i++) {
            snprintf(r->pool_kind[i], sizeof(r->pool_kind[i]), "%s", l->loads[0]->kv_pools[i]->kind);
            r->pool_total[i] = l->loads[0]->kv_pools[i]->blocks_total;
            r->pool_cached[i] = l->loads[0]->kv_pools[i]->blocks_cached;
        }
    } else if (msg->descriptor == &stepd__v1__get_model_info_response__descriptor) {
        const Stepd__V1__GetModelInfoResponse *m = (const void *) msg;
        r->vocab = m->vocab_size;
        r->max_len = m->max_model_len;
    }
}

static void on_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct res *r = ud;
    r->done = true;
    r->status = status;
    snprintf(r->details, sizeof(r->details), "%s", details ? details : "");
}

static void run_until(bool *flag)
{
    int64_t end = rpc_now_ms() + 20000;
    while (!*flag) {
        ASSERT_TRUE(rpc_now_ms() < end);
        uv_run(loop, UV_RUN_ONCE);
    }
}

struct greq {
    Stepd__V1__GenerateRequest req;
    Stepd__V1__TokenIds ti;
    Stepd__V1__SamplingParams sp;
};

static void greq_init(struct greq *g, const char *id, const int32_t *prompt, int n, int max_tokens,
                      float temp)
{
    *g = (struct greq) {
        .req = STEPD__V1__GENERATE_REQUEST__INIT,
        .ti = STEPD__V1__TOKEN_IDS__INIT,
        .sp = STEPD__V1__SAMPLING_PARAMS__INIT,
    };
    g->ti.n_ids = (size_t) n;
    g->ti.ids = (int32_t *) prompt;
    g->req.request_id = (char *) id;
    g->req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    g->req.token_ids = &g->ti;
    PB_SET(&g->sp, temperature, temp);
    PB_SET(&g->sp, max_tokens, max_tokens);
    if (max_tokens >= 200)
        PB_SET(&g->sp, ignore_eos, true);  /* long runs must not stop early on EOS */
    g->req.sampling_params = &g->sp;
}

static void start_generate_salted(struct rpc_channel *ch, const char *id, const int32_t *prompt,
                                  int n, int max_tokens, float temp, int64_t deadline_ms,
                                  const char *salt, struct res *r)
{
    struct greq g;
    greq_init(&g, id, prompt, n, max_tokens, temp);
    g.req.cache_salt = (char *) (salt ? salt : "");
    ASSERT_OK(rpc_client_start(ch, "/stepd.v1.Engine/Generate", &g.req.base,
                               &stepd__v1__generate_response__descriptor, deadline_ms, on_msg,
                               on_done, r, &r->call));
}

static void start_generate(struct rpc_channel *ch, const char *id, const int32_t *prompt, int n,
                           int max_tokens, float temp, int64_t deadline_ms, struct res *r)
{
    start_generate_salted(ch, id, prompt, n, max_tokens, temp, deadline_ms, NULL, r);
}

/* One OpenOutputs stream; its requests are named "o<k>" (k < 4). */
struct ores {
    bool done;
    int status;
    int n_batches;
    int n_multi;                      /* batches with outputs of several requests */
    struct res req[4];
    struct rpc_client_call *call;
};

static void on_out_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct ores *o = ud;
    ASSERT_TRUE(msg->descriptor == &stepd__v1__output_batch__descriptor);
    const Stepd__V1__OutputBatch *b = (const void *) msg;
    o->n_batches++;
    bool multi = false;
    for (size_t i = 0; i < b->n_outputs; i++) {
        const Stepd__V1__EngineOutput *x = b->outputs[i];
        ASSERT_TRUE(x->request_id[0] == 'o' && x->request_id[1] >= '0' && x->request_id[1] < '4');
        struct res *r = &o->req[x->request_id[1] - '0'];
        ASSERT_TRUE(!r->done);
        multi |= strcmp(x->request_id, b->outputs[0]->request_id) != 0;
        if (x->kind_case == STEPD__V1__ENGINE_OUTPUT__KIND_CHUNK) {
            for (size_t j = 0; j < x->chunk->n_token_ids; j++)
                r->toks[r->n++] = x->chunk->token_ids[j];
            r->n_chunks++;
        } else if (x->kind_case == STEPD__V1__ENGINE_OUTPUT__KIND_FINAL) {
            r->done = r->got_final = true;
            r->finish_reason = x->final->finish_reason;
            r->completion_tokens = x->final->usage->completion_tokens;
            snprintf(r->group, sizeof(r->group), "%s", x->final->group);
        } else {
            ASSERT_EQ(x->kind_case, STEPD__V1__ENGINE_OUTPUT__KIND_STATUS);
            r->done = true;
            r->status = x->status->code;
            snprintf(r->details, sizeof(r->details), "%s", x->status->message);
        }
    }
    o->n_multi += multi;
}

static void on_out_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct ores *o = ud;
    o->done = true;
    o->status = status;
}

static void open_outputs(struct rpc_channel *ch, const char *stream_id, struct ores *o)
{
    Stepd__V1__OpenOutputsRequest req = STEPD__V1__OPEN_OUTPUTS_REQUEST__INIT;
    req.stream_id = (char *) stream_id;
    ASSERT_OK(rpc_client_start(ch, "/stepd.v1.Engine/OpenOutputs", &req.base,
                               &stepd__v1__output_batch__descriptor, 0, on_out_msg, on_out_done, o,
                               &o->call));
    while (o->n_batches == 0 && !o->done)    /* the open acknowledgement */
        uv_run(loop, UV_RUN_ONCE);
    ASSERT_TRUE(!o->done);
}

static void submit(struct rpc_channel *ch, const char *stream_id, const char *id,
                   const int32_t *prompt, int n, int max_tokens, float temp, struct res *r)
{
    struct greq g;
    Stepd__V1__SubmitRequest req = STEPD__V1__SUBMIT_REQUEST__INIT;
    greq_init(&g, id, prompt, n, max_tokens, temp);
    req.stream_id = (char *) stream_id;
    req.request = &g.req;
    ASSERT_OK(rpc_client_start(ch, "/stepd.v1.Engine/Submit", &req.base,
                               &stepd__v1__submit_response__descriptor, 0, NULL, on_done, r, NULL));
}

static void unary(struct rpc_channel *ch, const char *path, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *d, struct res *r)
{
    ASSERT_OK(rpc_client_start(ch, path, req, d, 0, on_msg, on_done, r, NULL));
    run_until(&r->done);
}

static void wait_idle(struct engine *e)
{
    for (int i = 0; i < 2000; i++) {
        struct engine_loads l;
        engine_get_loads(e, &l);
        if (l.n_alive == 0 && l.kv_blocks_used == 0)
            return;
        usleep(1000);
    }
    FAIL("engine did not become idle");
}

int main(void)
{
    struct forward *f;
    struct engine *e = rig_mock_engine(500, 4, 2, &f);
    struct err_buf err;
    struct engine_rpc *srv;
    struct engine_rpc_opts o = { .addr = "127.0.0.1:0", .group = "g0", .model_name = "tiny" };
    int port = 0;
    ASSERT_OK(engine_rpc_start(e, &o, &srv, &port, &err));
    ASSERT_TRUE(port > 0);
    struct engine_rpc_opts bad = { .addr = "256.1.1.1:99999" };
    struct engine_rpc *srv2;
    ASSERT_TRUE(engine_rpc_start(e, &bad, &srv2, NULL, &err) < 0);
    ASSERT_CONTAINS(err.msg, "listen");

    loop = uv_default_loop();
    struct rpc_ctx *ctx;
    struct rpc_channel *ch;
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    ASSERT_OK(rpc_ctx_create(loop, &ctx));
    ASSERT_OK(rpc_channel_create(ctx, target, NULL, &ch));

    /* greedy Generate equals the mock's reference continuation */
    int32_t prompt[12];
    for (int i = 0; i < 12; i++)
        prompt[i] = (i * 13 + 5) % 250;
    int32_t seq[64];
    float row[256];
    memcpy(seq, prompt, sizeof(prompt));
    int ref_n = 30;
    for (int t = 0; t < 30; t++) {
        mock_forward_row(f, seq, 12 + t, row);
        int b = 0;
        for (int v = 1; v < 256; v++)
            if (row[v] > row[b])
                b = v;
        seq[12 + t] = b;
        if (b == 255) {
            ref_n = t + 1;
            break;
        }
    }
    static struct res r1;
    start_generate(ch, "r1", prompt, 12, 30, 0.0f, 0, &r1);
    run_until(&r1.done);
    ASSERT_EQ(r1.status, RPC_OK);
    ASSERT_TRUE(r1.got_final);
    ASSERT_EQ(r1.n, ref_n);
    for (int i = 0; i < ref_n; i++)
        ASSERT_EQ(r1.toks[i], seq[12 + i]);
    ASSERT_EQ(r1.finish_reason, ref_n == 30 ? STEPD__V1__FINISH_REASON__FINISH_REASON_LENGTH
                                            : STEPD__V1__FINISH_REASON__FINISH_REASON_STOP);
    ASSERT_EQ(r1.prompt_tokens, 12);
    ASSERT_EQ(r1.completion_tokens, (uint32_t) ref_n);
    ASSERT_TRUE(r1.drafts > 0);
    ASSERT_EQ(r1.n_per_pos, 3);     /* one entry per MTP layer the engine can use */
    ASSERT_TRUE(r1.ttft > 0);
    ASSERT_STREQ(r1.group, "g0");
    ASSERT_EQ(r1.cached_tokens, 0);
    wait_idle(e);

    /* the prefix cache: a repeated 40-token prompt reuses 2 blocks of 16 (the last token is
     * always computed), another salt nothing; an over-long salt is refused */
    {
        static struct res ra, rb, rc, rd;
        static char big[1100];
        int32_t p40[40];
        for (int i = 0; i < 40; i++)
            p40[i] = (i * 7 + 3) % 250;
        start_generate(ch, "pa", p40, 40, 8, 0.0f, 0, &ra);
        run_until(&ra.done);
        start_generate(ch, "pb", p40, 40, 8, 0.0f, 0, &rb);
        run_until(&rb.done);
        start_generate_salted(ch, "pc", p40, 40, 8, 0.0f, 0, "tenant-2", &rc);
        run_until(&rc.done);
        ASSERT_EQ(ra.status, RPC_OK);
        ASSERT_EQ(ra.cached_tokens, 0);
        ASSERT_EQ(rb.cached_tokens, 32);
        ASSERT_EQ(rc.cached_tokens, 0);
        ASSERT_EQ(rb.n, ra.n);
        ASSERT_EQ(memcmp(rb.toks, ra.toks, (size_t) ra.n * sizeof(int32_t)), 0);
        memset(big, 's', sizeof(big) - 1);
        start_generate_salted(ch, "pd", p40, 40, 8, 0.0f, 0, big, &rd);
        run_until(&rd.done);
        ASSERT_EQ(rd.status, RPC_INVALID_ARGUMENT);
        ASSERT_CONTAINS(rd.details, "cache_salt");
        wait_idle(e);
    }

    /* text input is refused, naming the field */
    {
        Stepd__V1__GenerateRequest req = STEPD__V1__GENERATE_REQUEST__INIT;
        req.request_id = "t";
        req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TEXT;
        req.text = "hello";
        static struct res r;
        ASSERT_OK(rpc_client_start(ch, "/stepd.v1.Engine/Generate", &req.base,
                                   &stepd__v1__generate_response__descriptor, 0, on_msg, on_done, &r, NULL));
        run_until(&r.done);
        ASSERT_EQ(r.status, RPC_INVALID_ARGUMENT);
        ASSERT_CONTAINS(r.details, "token_ids");
    }
    /* a bad sampling field and an out-of-vocabulary token */
    {
        static struct res r, r2;
        start_generate(ch, "bad", prompt, 12, 10, -1.0f, 0, &r);
        run_until(&r.done);
        ASSERT_EQ(r.status, RPC_INVALID_ARGUMENT);
        ASSERT_CONTAINS(r.details, "sampling_params.temperature");
        int32_t badp[2] = { 1, 9999 };
        start_generate(ch, "bad2", badp, 2, 10, 0.0f, 0, &r2);
        run_until(&r2.done);
        ASSERT_EQ(r2.status, RPC_INVALID_ARGUMENT);
        ASSERT_CONTAINS(r2.details, "token_ids[1]");
    }
    /* Abort by id ends the stream with finish reason abort */
    {
        static struct res r, ra;
        start_generate(ch, "long", prompt, 12, 400, 1.0f, 0, &r);
        while (r.n < 3)
            uv_run(loop, UV_RUN_ONCE);
        Stepd__V1__AbortRequest ar = STEPD__V1__ABORT_REQUEST__INIT;
        char *ids[2] = { "long", "unknown" };
        ar.n_request_ids = 2;
        ar.request_ids = ids;
        unary(ch, "/stepd.v1.Engine/Abort", &ar.base, &stepd__v1__abort_response__descriptor, &ra);
        ASSERT_EQ(ra.status, RPC_OK);
        ASSERT_EQ(ra.aborted, 1);
        run_until(&r.done);
        ASSERT_EQ(r.status, RPC_OK);
        ASSERT_EQ(r.finish_reason, STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT);
        ASSERT_TRUE(r.n < 400);
        wait_idle(e);
    }
    /* client cancel aborts the request; a gRPC deadline expires it */
    {
        static struct res rc, rd;
        rc.cancel_after = 2;
        start_generate(ch, "cancel", prompt, 12, 400, 1.0f, 0, &rc);
        run_until(&rc.done);
        ASSERT_EQ(rc.status, RPC_CANCELLED);
        start_generate(ch, "deadline", prompt, 12, 480, 1.0f, rpc_now_ms() + 5, &rd);
        run_until(&rd.done);
        ASSERT_EQ(rd.status, RPC_DEADLINE_EXCEEDED);
        wait_idle(e);
    }
    /* queue bound: 8 running + 4 waiting; the 13th is RESOURCE_EXHAUSTED */
    {
        static struct res rs[13];
        char ids[13][8];
        for (int i = 0; i < 13; i++) {
            snprintf(ids[i], sizeof(ids[i]), "q%d", i);
            start_generate(ch, ids[i], prompt, 12, 200, 1.0f, 0, &rs[i]);
        }
        int exhausted = 0;
        for (int i = 0; i < 13; i++) {
            run_until(&rs[i].done);
            exhausted += rs[i].status == RPC_RESOURCE_EXHAUSTED;
            ASSERT_TRUE(rs[i].status == RPC_OK || rs[i].status == RPC_RESOURCE_EXHAUSTED);
        }
        ASSERT_TRUE(exhausted >= 1);
        wait_idle(e);
    }
    /* GetLoads / GetModelInfo */
    {
        static struct res rl, rm;
        Stepd__V1__GetLoadsRequest lr = STEPD__V1__GET_LOADS_REQUEST__INIT;
        unary(ch, "/stepd.v1.Engine/GetLoads", &lr.base, &stepd__v1__get_loads_response__descriptor, &rl);
        ASSERT_EQ(rl.status, RPC_OK);
        ASSERT_EQ(rl.running, 0);
        ASSERT_EQ(rl.kv_total, 512);
        ASSERT_TRUE(rl.prefix_queries >= 3 * 40);
        ASSERT_TRUE(rl.prefix_hits >= 32);
        ASSERT_EQ(rl.n_pools, 2);
        ASSERT_STREQ(rl.pool_kind[0], "full_attention");
        ASSERT_STREQ(rl.pool_kind[1], "sliding_window");
        ASSERT_EQ(rl.pool_total[0] + rl.pool_total[1], 512);
        ASSERT_TRUE(rl.pool_cached[0] > 0);
        Stepd__V1__GetModelInfoRequest mr = STEPD__V1__GET_MODEL_INFO_REQUEST__INIT;
        unary(ch, "/stepd.v1.Engine/GetModelInfo", &mr.base,
              &stepd__v1__get_model_info_response__descriptor, &rm);
        ASSERT_EQ(rm.vocab, 256);
        ASSERT_EQ(rm.max_len, 512);
    }
    /* an output stream: Generate's tokens, outputs of several requests per batch; an
     * unknown stream is FAILED_PRECONDITION */
    static struct ores os;
    {
        static struct res sub[4], rbad;
        open_outputs(ch, "c1", &os);
        for (int k = 0; k < 4; k++) {
            char id[4] = { 'o', (char) ('0' + k), 0 };
            submit(ch, "c1", id, prompt, 12, 30, 0.0f, &sub[k]);
        }
        for (int k = 0; k < 4; k++) {
            run_until(&sub[k].done);
            ASSERT_EQ(sub[k].status, RPC_OK);
            run_until(&os.req[k].done);
            ASSERT_TRUE(os.req[k].got_final);
            ASSERT_EQ(os.req[k].n, r1.n);
            ASSERT_EQ(memcmp(os.req[k].toks, r1.toks, (size_t) r1.n * sizeof(int32_t)), 0);
            ASSERT_EQ(os.req[k].finish_reason, r1.finish_reason);
            ASSERT_EQ(os.req[k].completion_tokens, (uint32_t) r1.n);
            ASSERT_STREQ(os.req[k].group, "g0");
        }
        ASSERT_TRUE(os.n_multi > 0);
        submit(ch, "nope", "o0", prompt, 12, 30, 0.0f, &rbad);
        run_until(&rbad.done);
        ASSERT_EQ(rbad.status, RPC_FAILED_PRECONDITION);
        ASSERT_CONTAINS(rbad.details, "stream_id");
        memset(os.req, 0, sizeof(os.req));
        wait_idle(e);
    }
    /* a stream in flight when the service stops ends with UNAVAILABLE; so does an
     * output stream, its request aborted */
    {
        static struct res r, rs;
        start_generate(ch, "inflight", prompt, 12, 400, 1.0f, 0, &r);
        submit(ch, "c1", "o1", prompt, 12, 400, 1.0f, &rs);
        while (r.n < 2 || os.req[1].n < 2)
            uv_run(loop, UV_RUN_ONCE);
        engine_rpc_stop(srv);
        run_until(&r.done);
        ASSERT_TRUE(r.status == RPC_UNAVAILABLE || r.status == RPC_CANCELLED);
        run_until(&os.done);
        ASSERT_TRUE(os.status == RPC_UNAVAILABLE || os.status == RPC_CANCELLED);
        ASSERT_TRUE(!os.req[1].done);
    }
    rpc_channel_destroy(ch);
    rpc_ctx_destroy(ctx);
    wait_idle(e);
    engine_stop(e);
    ASSERT_OK(engine_check(e));
    engine_free(e);
    f->ops->free(f);
    printf("engine-rpc: ok\n");
    return 0;
}
