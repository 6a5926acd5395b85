/* mock-engine.c - a fake worker rank for coordinator tests, built on rpc/.
 *
 * Registers with the coordinator's control service exactly like a worker (Session,
 * ReportState LOADING then READY after the rendezvous) and, as rank 0, serves
 * stepd.v1.Engine: Generate streams deterministic tokens
 *     token[i] = (sum(prompt) + 7 * i + 1) % vocab
 * one per --delay-ms (the first after --ttft-ms), then a Final with finish reason
 * LENGTH (or STOP at --eos-after tokens when set; --script ID,ID,... sends those ids instead,
 * then STOP: a chosen output, e.g. a tool call in the tokenizer's ids), usage (cached_tokens = the length of the
 * request's cache_salt, so that tests see both pass through the coordinator), fake MTP
 * statistics and timings. Abort and client cancellation stop a stream. Counters (generate calls,
 * aborts, cancels, tokens) go to --stats-file after every change of request state,
 * so tests can prove that a rejected request never reached an engine.
 *
 * Output streams: OpenOutputs registers a stream; a request Submit-ed to it is admitted
 * like a Generate (and counted as one), runs on the same per-request timer, and its
 * chunks and its Final (or an EngineStatus: DEADLINE_EXCEEDED at the Submit call's
 * deadline) wait in the stream's pending batch. A uv_check handle sends each stream's
 * batch once per loop iteration (an idle handle keeps poll from blocking while any is
 * pending), so the timers due in one iteration share one OutputBatch. Ending the stream
 * (cancel, shutdown, or RESOURCE_EXHAUSTED when the client stops reading) ends its
 * requests as cancels. --no-output-streams leaves both methods unregistered
 * (UNIMPLEMENTED, like an older engine).
 *
 * --send-log FILE appends one line per finished request, "<request_id> <t_us>...", the
 * rpc_now_us() time at which each token was handed to gRPC (for output streams: the
 * rpc_call_send of the batch that carried it), so that a client on the same host can
 * measure per-token delivery latency (loadgen --send-log).
 *
 * Refusals: --refuse-by-id refuses (Generate and Submit alike) a request whose id is
 * "refuse-<N>-..." with gRPC status N (1..16) and a message naming it.  Capacity:
 * --max-seqs S --max-waiting W report S + W (StateReport READY, GetLoads) and refuse the
 * request past S + W running with RESOURCE_EXHAUSTED ("over_capacity" in the stats: a
 * coordinator that honours the capacity never sees one).  Images: without --images it
 * reports no supports_images and refuses a request with images INVALID_ARGUMENT, as a
 * text-only engine does; with it, it reports them served and ignores the pixels.
 *
 * Fault hooks: --exit-after-tokens N (exit(3) after N tokens in total: "crash"),
 * --stall-file PATH (while it exists no tokens are produced),
 * --break-output-streams-after-tokens N (once N tokens were made, end every open output
 * stream UNAVAILABLE, and with them their requests; the engine stays up).
 *
 * The cluster key (--control-key-file FILE, or $STEPD_CONTROL_KEY) goes to the control
 * service and is required of every caller of its engine, as with stepd-worker; without one
 * the mock refuses to start unless --insecure-control.
 *
 * When the session ends with ABORTED (group re-forming) the mock registers again;
 * when it ends otherwise (coordinator gone) the mock exits 0.  --serving-epoch E registers
 * as a rank that already serves its group at epoch E (READY, as a worker does after its
 * coordinator restarted); a GroupAbort makes it register afresh next time.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "err.h"
#include "file.h"
#include "log.h"
#include "pb-util.h"
#include "rpc.h"
#include "stepd.pb-c.h"
#include "control.pb-c.h"

#define OUTPUTS_BUFFER_CAP_BYTES (64u << 20)
#define STREAM_ID_MAX 128

struct mock {
    uv_loop_t *loop;
    struct rpc_ctx *rpc;
    struct rpc_server *srv;
    struct rpc_channel *ctl;
    const char *coordinator, *group, *listen, *stats_file, *stall_file;
    char *key;                      /* the cluster key (control service, engine callers) */
    int stats_fd;                   /* stats_file, open from the first write on */
    FILE *send_log;
    unsigned rank, world, vocab, max_model_len, delay_ms, ttft_ms, eos_after;
    int32_t *script;                /* --script: the output, then STOP */
    size_t n_script;
    uint64_t exit_after_tokens;
    uint64_t break_streams_after;   /* --break-output-streams-after-tokens (once) */
    bool streams_broken;
    int port;
    char engine_addr[64];
    char session_id[128];
    uint64_t n_generate, n_abort, n_cancel, n_tokens, n_finished;
    uint64_t n_submit, n_batches;   /* of n_generate, how many came by Submit; OutputBatches sent */
    uint64_t n_refused, n_over;     /* --refuse-by-id refusals; refusals past the capacity */
    bool refuse_by_id;
    bool images;                /* --images: reports supports_images and takes images */
    unsigned max_seqs, max_waiting; /* reported capacity (0: none) */
    unsigned peak_running;
    uint64_t serving_epoch;         /* --serving-epoch: registered as already serving */
    unsigned running;
    struct mstream *streams;        /* every running request, Generate and Submit */
    struct ostream *ostreams;       /* open output streams */
    bool no_output_streams;         /* --no-output-streams */
    uv_check_t flush;               /* sends the pending batches, once per iteration */
    uv_idle_t flush_soon;           /* active while a batch is pending: poll does not block */
    uv_timer_t reconnect;
    bool quitting;
    bool srv_down;                  /* the server's shutdown completed */
};

/* One request: a Generate stream (call) or a request Submit-ed to an output stream (os). */
struct mstream {
    struct mock *m;
    struct mstream *prev, *next;
    struct rpc_call *call;          /* Generate: its stream, NULL once finished; Submit: NULL */
    struct ostream *os;             /* Submit: where its outputs go; Generate: NULL */
    struct mstream *next_ended;     /* Submit, ended: on os->ended until the flush after it */
    uv_timer_t timer;
    char id[136];
    int64_t seed;
    uint32_t n_prompt, max_tokens, n_out, n_salt;
    int64_t t0, t_first;
    int64_t deadline_ms;            /* Submit: the Submit call's (rpc_now_ms); else INT64_MAX */
    int64_t *t_send;                /* --send-log: per token chunk, rpc_now_us() */
    uint32_t n_send, cap_send;
    bool done;
};

/* A Final with the messages it points to. */
struct final_msg {
    Stepd__V1__Final f;
    Stepd__V1__Usage u;
    Stepd__V1__MtpStats mtp;
    Stepd__V1__Timings t;
    uint32_t per_pos[3];
};

/* One output waiting in an output stream's pending batch. Filled by value; the pointers
 * between its messages are set by pout_link() at the flush, once the array stops moving. */
struct pout {
    Stepd__V1__EngineOutput o;
    Stepd__V1__Chunk ch;
    struct final_msg fm;
    Stepd__V1__EngineStatus st;
    int32_t tok;
    struct mstream *s;              /* chunk: its request (kept until the flush, --send-log) */
    char id[136];
};

struct ostream {
    struct mock *m;
    struct ostream *prev, *next;
    struct rpc_call *call;
    char id[STREAM_ID_MAX + 1];
    struct pout *pending;           /* outputs since the last flush */
    Stepd__V1__EngineOutput **ptrs; /* into pending, built at the flush */
    size_t n_pending, cap_pending;
    struct mstream *ended;          /* requests ended since the last flush, freed after it */
};

static struct mock M;

/* The counters, rewritten in place at every change: fixed-width fields, so one pwrite
 * of the same length over the same bytes, no new file and no rename (a create and a
 * rename per request state change, two engines in one directory, stalled the loop for
 * tens of ms under 1000 streams: inter-token gaps the coordinator was blamed for).
 * Readers read until two reads agree (stepd_harness.py). */
static void stats_write(struct mock *m)
{
    char buf[512];

    if (!m->stats_file)
        return;
    if (m->stats_fd < 0) {
        m->stats_fd = open(m->stats_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (m->stats_fd < 0)
            return;
    }
    int n = snprintf(buf, sizeof(buf), "generate=%020" PRIu64 "\nabort=%020" PRIu64 "\ncancel=%020" PRIu64
                     "\ntokens=%020" PRIu64 "\nfinished=%020" PRIu64 "\nrunning=%010u\nsubmit=%020" PRIu64
                     "\nbatches=%020" PRIu64 "\nrefused=%020" PRIu64 "\nover_capacity=%020" PRIu64
                     "\npeak_running=%010u\n",
                     m->n_generate, m->n_abort, m->n_cancel, m->n_tokens, m->n_finished, m->running,
                     m->n_submit, m->n_batches, m->n_refused, m->n_over, m->peak_running);
    if (pwrite(m->stats_fd, buf, (size_t)n, 0) != n)
        fprintf(stderr, "mock-engine: writing %s failed\n", m->stats_file);
}

static void stream_closed(uv_handle_t *h)
{
    struct mstream *s = h->data;
    free(s->t_send);
    free(s);
}

static void send_log_write(struct mock *m, struct mstream *s)
{
    if (!m->send_log || !s->n_send)
        return;
    fputs(s->id, m->send_log);
    for (uint32_t i = 0; i < s->n_send; i++)
        fprintf(m->send_log, " %" PRId64, s->t_send[i]);
    fputc('\n', m->send_log);
    fflush(m->send_log);
}

/* Ends s once (its last output, if any, is sent or queued by the caller). A Submit-ed
 * request stays allocated until its stream's next flush (ended_release), which logs it. */
static void stream_end(struct mstream *s)
{
    struct mock *m = s->m;
    if (s->done)
        return;
    s->done = true;
    uv_timer_stop(&s->timer);
    if (s->prev)
        s->prev->next = s->next;
    else
        m->streams = s->next;
    if (s->next)
        s->next->prev = s->prev;
    m->running--;
    m->n_finished++;
    if (s->os) {
        s->next_ended = s->os->ended;
        s->os->ended = s;
    } else {
        send_log_write(m, s);
        uv_close((uv_handle_t *)&s->timer, stream_closed);
    }
    stats_write(m);
}

static void final_link(struct final_msg *fm)
{
    fm->mtp.accepted_per_position = fm->per_pos;
    fm->f.usage = &fm->u;
    fm->f.mtp = &fm->mtp;
    fm->f.timings = &fm->t;
}

/* The Final of s into fm; message must outlive fm (a string constant). */
static void final_fill(struct final_msg *fm, const struct mstream *s, int reason, const char *message)
{
    *fm = (struct final_msg){
        .f = STEPD__V1__FINAL__INIT, .u = STEPD__V1__USAGE__INIT,
        .mtp = STEPD__V1__MTP_STATS__INIT, .t = STEPD__V1__TIMINGS__INIT,
    };
    fm->u.prompt_tokens = s->n_prompt;
    fm->u.completion_tokens = s->n_out;
    fm->u.cached_tokens = s->n_salt;
    fm->mtp.num_drafts = s->n_out / 2;
    fm->mtp.num_draft_tokens = fm->mtp.num_drafts * 3;
    fm->per_pos[0] = fm->mtp.num_drafts;
    fm->per_pos[1] = fm->mtp.num_drafts / 2;
    fm->per_pos[2] = fm->mtp.num_drafts / 4;
    fm->mtp.num_accepted_tokens = fm->per_pos[0] + fm->per_pos[1] + fm->per_pos[2];
    fm->mtp.n_accepted_per_position = 3;
    fm->t.prefill_s = s->t_first ? (double)(s->t_first - s->t0) / 1000.0 : 0;
    fm->f.finish_reason = reason;
    fm->f.message = (char *)message;
    fm->f.request_id = (char *)s->id;
    final_link(fm);
}

/* Generate: the Final, then the stream's OK status. */
static void send_final(struct mstream *s, int reason, const char *message)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    struct final_msg fm;

    final_fill(&fm, s, reason, message);
    resp.request_id = s->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
    resp.final = &fm.f;
    rpc_call_send(s->call, &resp.base);
    rpc_call_finish(s->call, RPC_OK, NULL);
    s->call = NULL;
}

/* Generate: one token chunk. <0 when the stream is gone. */
static int send_chunk(struct mstream *s, int32_t tok)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Chunk ch = STEPD__V1__CHUNK__INIT;

    ch.n_token_ids = 1;
    ch.token_ids = &tok;
    resp.request_id = s->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
    resp.chunk = &ch;
    if (s->m->send_log && s->n_send < s->cap_send)
        s->t_send[s->n_send++] = rpc_now_us();
    return rpc_call_send(s->call, &resp.base);
}

/* ------------------------------------------------------------------ output streams */

static void flush_soon_cb(uv_idle_t *h)
{
}

/* A new entry at the end of the pending batch of s's output stream. */
static struct pout *pout_add(struct mstream *s, int kind)
{
    struct ostream *os = s->os;

    if (os->n_pending == os->cap_pending) {
        size_t cap = os->cap_pending ? 2 * os->cap_pending : 64;
        struct pout *p = realloc(os->pending, cap * sizeof(*p));
        Stepd__V1__EngineOutput **pp = p ? realloc(os->ptrs, cap * sizeof(*pp)) : NULL;
        if (p)
            os->pending = p;
        if (!pp) {
            fprintf(stderr, "mock-engine: out of memory for %zu outputs\n", cap);
            abort();
        }
        os->ptrs = pp;
        os->cap_pending = cap;
    }
    struct pout *p = &os->pending[os->n_pending++];
    p->o = (Stepd__V1__EngineOutput)STEPD__V1__ENGINE_OUTPUT__INIT;
    p->o.kind_case = kind;
    p->s = NULL;
    memcpy(p->id, s->id, sizeof(p->id));
    (void) uv_idle_start(&s->m->flush_soon, flush_soon_cb);
    return p;
}

static void pout_chunk(struct mstream *s, int32_t tok)
{
    struct pout *p = pout_add(s, STEPD__V1__ENGINE_OUTPUT__KIND_CHUNK);
    p->ch = (Stepd__V1__Chunk)STEPD__V1__CHUNK__INIT;
    p->tok = tok;
    p->s = s;
}

static void pout_final(struct mstream *s, int reason, const char *message)
{
    struct pout *p = pout_add(s, STEPD__V1__ENGINE_OUTPUT__KIND_FINAL);
    final_fill(&p->fm, s, reason, message);
}

static void pout_status(struct mstream *s, int code, const char *message)
{
    struct pout *p = pout_add(s, STEPD__V1__ENGINE_OUTPUT__KIND_STATUS);
    p->st = (Stepd__V1__EngineStatus)STEPD__V1__ENGINE_STATUS__INIT;
    p->st.code = code;
    p->st.message = (char *)message;
}

static void pout_link(struct pout *p)
{
    p->o.request_id = p->id;
    switch (p->o.kind_case) {
    case STEPD__V1__ENGINE_OUTPUT__KIND_CHUNK:
        p->ch.n_token_ids = 1;
        p->ch.token_ids = &p->tok;
        p->o.chunk = &p->ch;
        break;
    case STEPD__V1__ENGINE_OUTPUT__KIND_FINAL:
        final_link(&p->fm);
        p->fm.f.request_id = p->id;
        p->o.final = &p->fm.f;
        break;
    case STEPD__V1__ENGINE_OUTPUT__KIND_STATUS:
        p->o.status = &p->st;
        break;
    default:
        BUG_ON(1);
    }
}

/* A request's end: its Final, on whichever kind of stream it has. */
static void request_final(struct mstream *s, int reason, const char *message)
{
    if (s->os)
        pout_final(s, reason, message);
    else if (s->call)
        send_final(s, reason, message);
}

/* Logs and frees the requests of os that ended before this point. */
static void ended_release(struct ostream *os)
{
    struct mstream *s;

    while ((s = os->ended)) {
        os->ended = s->next_ended;
        send_log_write(os->m, s);
        uv_close((uv_handle_t *)&s->timer, stream_closed);
    }
}

static struct ostream *ostream_find(struct mock *m, const char *id)
{
    for (struct ostream *os = m->ostreams; os; os = os->next)
        if (strcmp(os->id, id) == 0)
            return os;
    return NULL;
}

/* Ends os with status (reset: at once, dropping queued batches, for a client that stopped
 * reading) and every request submitted to it, counted as cancels; frees os. */
static void ostream_close(struct ostream *os, int status, const char *msg, bool reset)
{
    struct mock *m = os->m;

    os->n_pending = 0;
    for (struct mstream *s = m->streams, *next; s; s = next) {
        next = s->next;
        if (s->os == os) {
            m->n_cancel++;
            stream_end(s);
        }
    }
    ended_release(os);
    if (os->prev)
        os->prev->next = os->next;
    else
        m->ostreams = os->next;
    if (os->next)
        os->next->prev = os->prev;
    rpc_call_on_cancel(os->call, NULL, NULL);
    if (reset)
        rpc_call_abort(os->call, status, msg);
    else
        rpc_call_finish(os->call, status, "%s", msg);
    free(os->pending);
    free(os->ptrs);
    free(os);
}

/* Sends the pending batch of os, if any, as one OutputBatch. */
static void ostream_flush(struct ostream *os)
{
    Stepd__V1__OutputBatch b = STEPD__V1__OUTPUT_BATCH__INIT;
    struct mock *m = os->m;

    if (!os->n_pending)
        return;
    for (size_t i = 0; i < os->n_pending; i++) {
        pout_link(&os->pending[i]);
        os->ptrs[i] = &os->pending[i].o;
    }
    b.n_outputs = os->n_pending;
    b.outputs = os->ptrs;
    int64_t t_us = rpc_now_us();
    int e = rpc_call_send(os->call, &b.base);
    if (e == 0)
        m->n_batches++;
    for (size_t i = 0; i < os->n_pending && m->send_log && e == 0; i++) {
        struct mstream *s = os->pending[i].s;
        if (s && s->n_send < s->cap_send)
            s->t_send[s->n_send++] = t_us;
    }
    os->n_pending = 0;
    ended_release(os);
    if (e == -ENOBUFS) {
        char msg[160];
        snprintf(msg, sizeof(msg), "client is not reading its output stream (%zu bytes buffered, cap reached)",
                 rpc_call_queued_bytes(os->call));
        ostream_close(os, RPC_RESOURCE_EXHAUSTED, msg, true);
    } else if (e < 0) {
        ostream_close(os, RPC_CANCELLED, "stream gone", false);
    }
}

static void flush_cb(uv_check_t *h)
{
    struct mock *m = h->data;

    for (struct ostream *os = m->ostreams, *next; os; os = next) {
        next = os->next;
        ostream_flush(os);
    }
    (void) uv_idle_stop(&m->flush_soon);
}

static void on_outputs_cancel(struct rpc_call *call, void *ud)
{
    struct ostream *os = ud;
    if (os->m->quitting)
        ostream_close(os, RPC_UNAVAILABLE, "engine shutting down", false);
    else
        ostream_close(os, RPC_CANCELLED, "cancelled", false);
}

static void h_open_outputs(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__V1__OpenOutputsRequest *r = (const void *)msg;
    Stepd__V1__OutputBatch b = STEPD__V1__OUTPUT_BATCH__INIT;
    size_t len = strlen(r->stream_id);
    struct ostream *os;

    if (len == 0 || len > STREAM_ID_MAX) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "stream_id: must be 1..%d bytes, not %zu",
                        STREAM_ID_MAX, len);
        return;
    }
    if (ostream_find(m, r->stream_id)) {
        rpc_call_finish(call, RPC_ALREADY_EXISTS, "stream_id: output stream %s is already open", r->stream_id);
        return;
    }
    os = calloc(1, sizeof(*os));
    if (!os) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    os->m = m;
    os->call = call;
    memcpy(os->id, r->stream_id, len + 1);
    os->next = m->ostreams;
    if (m->ostreams)
        m->ostreams->prev = os;
    m->ostreams = os;
    rpc_call_set_buffer_cap(call, OUTPUTS_BUFFER_CAP_BYTES);
    rpc_call_on_cancel(call, on_outputs_cancel, os);
    rpc_call_send(call, &b.base);
}

/* ------------------------------------------------------------------ requests */

static void tick(uv_timer_t *t)
{
    struct mstream *s = t->data;
    struct mock *m = s->m;

    if (s->deadline_ms != INT64_MAX && rpc_now_ms() >= s->deadline_ms) {
        m->n_cancel++;
        pout_status(s, RPC_DEADLINE_EXCEEDED, "deadline exceeded");
        stream_end(s);
        return;
    }
    if (m->stall_file && access(m->stall_file, F_OK) == 0)
        return;
    int32_t tok = m->n_script ? m->script[s->n_out % m->n_script]
                              : (int32_t)(((uint64_t)s->seed + 7ull * s->n_out + 1) % m->vocab);
    if (!s->t_first)
        s->t_first = rpc_now_ms();
    if (s->os) {
        pout_chunk(s, tok);
    } else if (send_chunk(s, tok) < 0) {
        rpc_call_finish(s->call, RPC_CANCELLED, "stream gone");
        s->call = NULL;
        stream_end(s);
        return;
    }
    s->n_out++;
    m->n_tokens++;
    if (m->exit_after_tokens && m->n_tokens >= m->exit_after_tokens) {
        fprintf(stderr, "mock-engine: fault hook: exiting after %" PRIu64 " tokens\n", m->n_tokens);
        stats_write(m);
        _exit(3);
    }
    if ((m->eos_after && s->n_out >= m->eos_after) || (m->n_script && s->n_out >= m->n_script)) {
        request_final(s, STEPD__V1__FINISH_REASON__FINISH_REASON_STOP, "eos");
        stream_end(s);
    } else if (s->n_out >= s->max_tokens) {
        request_final(s, STEPD__V1__FINISH_REASON__FINISH_REASON_LENGTH, "");
        stream_end(s);
    }
    if (m->break_streams_after && !m->streams_broken && m->n_tokens >= m->break_streams_after) {
        /* the engine stays up; only its output streams fail (their requests with them) */
        m->streams_broken = true;
        fprintf(stderr, "mock-engine: fault hook: breaking the output streams after %" PRIu64 " tokens\n",
                m->n_tokens);
        while (m->ostreams)
            ostream_close(m->ostreams, RPC_UNAVAILABLE, "output stream broken by a fault hook", true);
        stats_write(m);
    }
}

/* Admission, shared by Generate and Submit: counts a generate call and checks the input.
 * RPC_OK with *ret (running, its timer not started: request_run()), else the status to
 * end the call with and *ret_msg. */
static int request_new(struct mock *m, const Stepd__V1__GenerateRequest *r, struct mstream **ret,
                       const char **ret_msg)
{
    struct mstream *s;

    m->n_generate++;
    if (r->input_case != STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS || r->token_ids->n_ids == 0) {
        stats_write(m);
        *ret_msg = "input: the engine takes token_ids only";
        return RPC_INVALID_ARGUMENT;
    }
    if (r->n_images && !m->images) {
        stats_write(m);
        *ret_msg = "images: this model has no vision encoder (text only)";
        return RPC_INVALID_ARGUMENT;
    }
    if (m->refuse_by_id && strncmp(r->request_id, "refuse-", 7) == 0) {
        int code = atoi(r->request_id + 7);
        if (code >= 1 && code <= 16) {
            static char msg[96];
            m->n_refused++;
            stats_write(m);
            snprintf(msg, sizeof(msg), "the mock engine refuses this request with %s", rpc_status_name(code));
            *ret_msg = msg;
            return code;
        }
    }
    if ((m->max_seqs || m->max_waiting) && m->running >= m->max_seqs + m->max_waiting) {
        m->n_over++;
        stats_write(m);
        *ret_msg = "the mock engine is at capacity (max_seqs + max_waiting requests in flight)";
        return RPC_RESOURCE_EXHAUSTED;
    }
    s = calloc(1, sizeof(*s));
    if (!s) {
        stats_write(m);
        *ret_msg = "out of memory";
        return RPC_RESOURCE_EXHAUSTED;
    }
    s->m = m;
    snprintf(s->id, sizeof(s->id), "%s", r->request_id);
    for (size_t i = 0; i < r->token_ids->n_ids; i++)
        s->seed += r->token_ids->ids[i];
    s->n_prompt = (uint32_t)r->token_ids->n_ids;
    s->n_salt = r->cache_salt ? (uint32_t)strlen(r->cache_salt) : 0;
    s->max_tokens = r->sampling_params && PB_HAS(r->sampling_params, max_tokens)
                        ? (uint32_t)r->sampling_params->max_tokens : 16;
    s->t0 = rpc_now_ms();
    s->deadline_ms = INT64_MAX;
    if (m->send_log) {
        s->cap_send = s->max_tokens < 65536 ? s->max_tokens : 65536;
        s->t_send = malloc(s->cap_send * sizeof(*s->t_send));
        if (!s->t_send)
            s->cap_send = 0;
    }
    uv_timer_init(m->loop, &s->timer);
    s->timer.data = s;
    s->next = m->streams;
    if (m->streams)
        m->streams->prev = s;
    m->streams = s;
    m->running++;
    if (m->running > m->peak_running)
        m->peak_running = m->running;
    stats_write(m);
    *ret = s;
    return RPC_OK;
}

/* Starts the token timer of s: the first tick after --ttft-ms, or at its deadline when
 * that comes first. */
static void request_run(struct mstream *s)
{
    struct mock *m = s->m;
    uint64_t first = m->ttft_ms ? m->ttft_ms : m->delay_ms;

    if (s->deadline_ms != INT64_MAX) {
        int64_t left = s->deadline_ms - rpc_now_ms();
        if (left < (int64_t)first)
            first = left > 0 ? (uint64_t)left : 0;
    }
    uv_timer_start(&s->timer, tick, first, m->delay_ms ? m->delay_ms : 1);
}

static void on_stream_cancel(struct rpc_call *call, void *ud)
{
    struct mstream *s = ud;
    s->m->n_cancel++;
    rpc_call_finish(call, RPC_CANCELLED, "cancelled");
    s->call = NULL;
    stream_end(s);
}

static void h_generate(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    struct mstream *s;
    const char *err;

    int status = request_new(m, (const void *)msg, &s, &err);
    if (status != RPC_OK) {
        rpc_call_finish(call, status, "%s", err);
        return;
    }
    s->call = call;
    rpc_call_on_cancel(call, on_stream_cancel, s);
    request_run(s);
}

static void h_submit(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__V1__SubmitRequest *r = (const void *)msg;
    Stepd__V1__SubmitResponse resp = STEPD__V1__SUBMIT_RESPONSE__INIT;
    struct ostream *os;
    struct mstream *s;
    const char *err;

    if (!r->request || !r->request->request_id[0] || strlen(r->request->request_id) > 128) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request.request_id: required, at most 128 bytes");
        return;
    }
    os = ostream_find(m, r->stream_id);
    if (!os) {
        rpc_call_finish(call, RPC_FAILED_PRECONDITION, "stream_id: no output stream \"%.128s\" is open",
                        r->stream_id);
        return;
    }
    int status = request_new(m, r->request, &s, &err);
    if (status != RPC_OK) {
        rpc_call_finish(call, status, "%s", err);
        return;
    }
    s->os = os;
    s->deadline_ms = rpc_call_deadline_ms(call);
    m->n_submit++;
    request_run(s);
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_abort(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__V1__AbortRequest *r = (const void *)msg;
    Stepd__V1__AbortResponse resp = STEPD__V1__ABORT_RESPONSE__INIT;

    for (size_t i = 0; i < r->n_request_ids; i++) {
        m->n_abort++;
        for (struct mstream *s = m->streams; s; s = s->next) {
            if (strcmp(s->id, r->request_ids[i]) == 0) {
                if (s->call)
                    rpc_call_on_cancel(s->call, NULL, NULL);
                request_final(s, STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT, "aborted");
                stream_end(s);
                resp.aborted++;
                break;
            }
        }
    }
    stats_write(m);
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_loads(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    Stepd__V1__GetLoadsResponse resp = STEPD__V1__GET_LOADS_RESPONSE__INIT;
    Stepd__V1__GroupLoad l = STEPD__V1__GROUP_LOAD__INIT;
    Stepd__V1__GroupLoad *pl = &l;
    l.group = (char *)m->group;
    l.num_running = m->running;
    l.kv_blocks_total = 1024;
    l.kv_blocks_used = m->running > 1024 ? 1024 : m->running;
    l.kv_usage = l.kv_blocks_used / 1024.0;
    l.max_num_seqs = m->max_seqs;
    l.max_waiting = m->max_waiting;
    resp.n_loads = 1;
    resp.loads = &pl;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void fill_model(struct mock *m, Stepd__Ctl__V1__ModelSummary *ms, int32_t *eos)
{
    ms->model_name = "mock-step";
    ms->model_type = "step3p7";
    ms->vocab_size = m->vocab;
    ms->max_model_len = m->max_model_len;
    eos[0] = 1;
    ms->n_eos_token_ids = 1;
    ms->eos_token_ids = eos;
    ms->num_layers = 4;
    ms->hidden_size = 64;
    ms->num_experts = 8;
    ms->num_experts_per_tok = 2;
    ms->quantization = "mock";
    ms->num_mtp_layers = 3;
    ms->max_num_speculative_tokens = 3;
    ms->supports_images = m->images;
}

static void h_model_info(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    Stepd__V1__GetModelInfoResponse resp = STEPD__V1__GET_MODEL_INFO_RESPONSE__INIT;
    int32_t eos = 1;
    resp.model_name = "mock-step";
    resp.model_type = "step3p7";
    resp.vocab_size = m->vocab;
    resp.max_model_len = m->max_model_len;
    resp.n_eos_token_ids = 1;
    resp.eos_token_ids = &eos;
    resp.supports_images = m->images;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

/* ------------------------------------------------------------------ control client */

static void session_start(struct mock *m);

static void report_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    if (status != RPC_OK)
        fprintf(stderr, "mock-engine: ReportState: %s %s\n", rpc_status_name(status), details);
}

static void report(struct mock *m, int state, float progress)
{
    Stepd__Ctl__V1__StateReport r = STEPD__CTL__V1__STATE_REPORT__INIT;
    Stepd__Ctl__V1__EngineLimits lim = STEPD__CTL__V1__ENGINE_LIMITS__INIT;
    r.session_id = m->session_id;
    r.state = state;
    r.load_progress = progress;
    r.kv_blocks_total = 1024;
    if (m->max_seqs || m->max_waiting) {
        lim.max_num_seqs = m->max_seqs;
        lim.max_waiting = m->max_waiting;
        r.limits = &lim;
    }
    rpc_client_start(m->ctl, "/stepd.ctl.v1.Control/ReportState", &r.base,
                     &stepd__ctl__v1__state_ack__descriptor, rpc_now_ms() + 5000, NULL, report_done, m, NULL);
}

static void session_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__Ctl__V1__ControlEvent *ev = (const void *)msg;

    switch (ev->event_case) {
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_REGISTERED:
        snprintf(m->session_id, sizeof(m->session_id), "%s", ev->registered->session_id);
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_RENDEZVOUS:
        report(m, STEPD__CTL__V1__RANK_STATE__RANK_STATE_LOADING, 0.5f);
        report(m, STEPD__CTL__V1__RANK_STATE__RANK_STATE_READY, 1.0f);
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_GROUP_ABORT:
        fprintf(stderr, "mock-engine: group abort: %s\n", ev->group_abort->reason);
        m->serving_epoch = 0;       /* the group is gone: come back fresh */
        break;
    default:
        break;
    }
}

static void reconnect_cb(uv_timer_t *t)
{
    session_start(t->data);
}

static void quit(struct mock *m);

static void session_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct mock *m = ud;
    if (m->quitting)
        return;
    if (status == RPC_ABORTED || (status == RPC_UNAVAILABLE && !m->session_id[0])) {
        /* group re-forming, or coordinator not up yet: register again */
        m->session_id[0] = '\0';
        uv_timer_start(&m->reconnect, reconnect_cb, 200, 0);
        return;
    }
    fprintf(stderr, "mock-engine: control session ended (%s: %s); exiting\n", rpc_status_name(status), details);
    quit(m);
}

static void session_start(struct mock *m)
{
    Stepd__Ctl__V1__RegisterRequest r = STEPD__CTL__V1__REGISTER_REQUEST__INIT;
    Stepd__Ctl__V1__ModelSummary ms = STEPD__CTL__V1__MODEL_SUMMARY__INIT;
    Stepd__Ctl__V1__EngineLimits lim = STEPD__CTL__V1__ENGINE_LIMITS__INIT;
    int32_t eos[1];
    char host[64];

    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    r.group = (char *)m->group;
    r.rank = m->rank;
    r.world_size = m->world;
    r.device = "cpu";
    r.engine_address = m->rank == 0 ? m->engine_addr : "";
    r.pid = (uint32_t)getpid();
    r.hostname = host;
    r.incarnation = (uint64_t)rpc_now_ms();
    if (m->rank == 0) {
        fill_model(m, &ms, eos);
        r.model = &ms;
    }
    r.serving_epoch = m->serving_epoch;
    r.ready = m->serving_epoch != 0;
    if (m->serving_epoch && m->rank == 0) {
        r.kv_blocks_total = 1024;
        if (m->max_seqs || m->max_waiting) {
            lim.max_num_seqs = m->max_seqs;
            lim.max_waiting = m->max_waiting;
            r.limits = &lim;
        }
    }
    rpc_client_start(m->ctl, "/stepd.ctl.v1.Control/Session", &r.base, &stepd__ctl__v1__control_event__descriptor,
                     0, session_msg, session_done, m, NULL);
}

/* rpc_server_shutdown's on_done: the server is destroyed after uv_run returns, not here,
 * since the rest of this batch of events may still reference its calls. */
static void srv_down(void *ud)
{
    struct mock *m = ud;
    m->srv_down = true;
    uv_stop(m->loop);
}

static void quit(struct mock *m)
{
    if (m->quitting)
        return;
    m->quitting = true;
    stats_write(m);
    uv_close((uv_handle_t *)&m->reconnect, NULL);
    if (m->srv) {
        rpc_server_shutdown(m->srv, srv_down, m);
        rpc_server_cancel_all(m->srv);
    } else {
        uv_stop(m->loop);
    }
}

static void on_sig(uv_signal_t *h, int sig)
{
    uv_signal_stop(h);
    uv_close((uv_handle_t *)h, NULL);
    quit(h->data);
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "coordinator", required_argument, NULL, 'c' }, { "group", required_argument, NULL, 'g' },
        { "rank", required_argument, NULL, 'r' }, { "world", required_argument, NULL, 'w' },
        { "listen", required_argument, NULL, 'l' }, { "delay-ms", required_argument, NULL, 'd' },
        { "ttft-ms", required_argument, NULL, 't' }, { "vocab", required_argument, NULL, 'v' },
        { "max-model-len", required_argument, NULL, 'L' }, { "stats-file", required_argument, NULL, 's' },
        { "exit-after-tokens", required_argument, NULL, 'x' }, { "eos-after", required_argument, NULL, 'e' },
        { "stall-file", required_argument, NULL, 'S' }, { "send-log", required_argument, NULL, 'T' },
        { "no-output-streams", no_argument, NULL, 'O' },
        { "break-output-streams-after-tokens", required_argument, NULL, 'B' },
        { "refuse-by-id", no_argument, NULL, 'R' }, { "max-seqs", required_argument, NULL, 'M' },
        { "max-waiting", required_argument, NULL, 'W' }, { "serving-epoch", required_argument, NULL, 'E' },
        { "script", required_argument, NULL, 'P' }, { "images", no_argument, NULL, 'i' },
        { "control-key-file", required_argument, NULL, 'K' }, { "insecure-control", no_argument, NULL, 'I' },
        { NULL, 0, NULL, 0 },
    };
    struct mock *m = &M;
    bool insecure = false;
    int c;

    m->coordinator = "127.0.0.1:20052";
    m->group = "g0";
    m->world = 1;
    m->listen = "127.0.0.1:0";
    m->delay_ms = 5;
    m->stats_fd = -1;
    m->vocab = 1000;
    m->max_model_len = 4096;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'c': m->coordinator = optarg; break;
        case 'g': m->group = optarg; break;
        case 'r': m->rank = (unsigned)atoi(optarg); break;
        case 'w': m->world = (unsigned)atoi(optarg); break;
        case 'l': m->listen = optarg; break;
        case 'd': m->delay_ms = (unsigned)atoi(optarg); break;
        case 't': m->ttft_ms = (unsigned)atoi(optarg); break;
        case 'v': m->vocab = (unsigned)atoi(optarg); break;
        case 'L': m->max_model_len = (unsigned)atoi(optarg); break;
        case 's': m->stats_file = optarg; break;
        case 'x': m->exit_after_tokens = strtoull(optarg, NULL, 10); break;
        case 'e': m->eos_after = (unsigned)atoi(optarg); break;
        case 'S': m->stall_file = optarg; break;
        case 'O': m->no_output_streams = true; break;
        case 'B': m->break_streams_after = strtoull(optarg, NULL, 10); break;
        case 'R': m->refuse_by_id = true; break;
        case 'i': m->images = true; break;
        case 'M': m->max_seqs = (unsigned)atoi(optarg); break;
        case 'W': m->max_waiting = (unsigned)atoi(optarg); break;
        case 'E': m->serving_epoch = strtoull(optarg, NULL, 10); break;
        case 'P':
            for (char *p = optarg; *p;) {
                int32_t *n = realloc(m->script, (m->n_script + 1) * sizeof(*n));
                char *end;

                if (!n)
                    return 1;
                m->script = n;
                m->script[m->n_script++] = (int32_t)strtol(p, &end, 10);
                if (end == p) {
                    fprintf(stderr, "mock-engine: --script: expected ID,ID,...\n");
                    return 2;
                }
                p = *end == ',' ? end + 1 : end;
            }
            break;
        case 'I': insecure = true; break;
        case 'K':
            if (file_read_secret(optarg, &m->key) < 0) {
                fprintf(stderr, "mock-engine: --control-key-file %s: unreadable or empty\n", optarg);
                return 2;
            }
            break;
        case 'T':
            m->send_log = fopen(optarg, "a");
            if (!m->send_log) {
                fprintf(stderr, "mock-engine: --send-log %s: %s\n", optarg, strerror(errno));
                return 2;
            }
            break;
        default:
            fprintf(stderr, "usage: mock-engine --coordinator ADDR --group G [--rank R --world N] "
                            "[--delay-ms D] [--stats-file F] ...\n");
            return 2;
        }
    }
    if (!m->key && getenv("STEPD_CONTROL_KEY") && getenv("STEPD_CONTROL_KEY")[0])
        m->key = strdup(getenv("STEPD_CONTROL_KEY"));
    if (!m->key && !insecure) {
        fprintf(stderr, "mock-engine: no control key: give --control-key-file FILE (or "
                        "$STEPD_CONTROL_KEY), or --insecure-control\n");
        return 2;
    }
    log_init("mock-engine", m->group);
    signal(SIGPIPE, SIG_IGN);
    m->loop = uv_default_loop();
    if (rpc_ctx_create(m->loop, &m->rpc) < 0)
        return 1;
    uv_timer_init(m->loop, &m->reconnect);
    m->reconnect.data = m;
    uv_check_init(m->loop, &m->flush);
    m->flush.data = m;
    uv_check_start(&m->flush, flush_cb);
    uv_unref((uv_handle_t *)&m->flush);
    uv_idle_init(m->loop, &m->flush_soon);
    uv_unref((uv_handle_t *)&m->flush_soon);
    if (m->rank == 0) {
        /* --images: a request carries its images' views (the real worker's WORKER_IMAGE_MAX_MSG) */
        struct rpc_server_opts so = { .api_key = m->key, .max_recv_msg_bytes = m->images ? 512 << 20 : 0 };
        struct rpc_method ms[] = {
            { "/stepd.v1.Engine/Generate", &stepd__v1__generate_request__descriptor, true, false, h_generate, m },
            { "/stepd.v1.Engine/Abort", &stepd__v1__abort_request__descriptor, false, false, h_abort, m },
            { "/stepd.v1.Engine/GetLoads", &stepd__v1__get_loads_request__descriptor, false, false, h_loads, m },
            { "/stepd.v1.Engine/GetModelInfo", &stepd__v1__get_model_info_request__descriptor, false, false,
              h_model_info, m },
            /* last: --no-output-streams leaves these two out */
            { "/stepd.v1.Engine/OpenOutputs", &stepd__v1__open_outputs_request__descriptor, true, false,
              h_open_outputs, m },
            { "/stepd.v1.Engine/Submit", &stepd__v1__submit_request__descriptor, false, false, h_submit, m },
        };
        size_t n_ms = ARRAY_SIZE(ms) - (m->no_output_streams ? 2 : 0);
        if (rpc_server_create(m->rpc, &so, &m->srv) < 0)
            return 1;
        for (size_t i = 0; i < n_ms; i++)
            rpc_server_add_method(m->srv, &ms[i]);
        if (rpc_server_listen(m->srv, m->listen, &m->port) < 0)
            return 1;
        rpc_server_start(m->srv);
        snprintf(m->engine_addr, sizeof(m->engine_addr), "127.0.0.1:%d", m->port);
    }
    struct rpc_channel_opts co = { .api_key = m->key, .keepalive_time_ms = 10000 };
    if (rpc_channel_create(m->rpc, m->coordinator, &co, &m->ctl) < 0)
        return 1;
    uv_signal_t sterm;
    uv_signal_init(m->loop, &sterm);
    sterm.data = m;
    uv_signal_start(&sterm, on_sig, SIGTERM);
    stats_write(m);
    session_start(m);
    uv_run(m->loop, UV_RUN_DEFAULT);
    if (m->srv_down)
        rpc_server_destroy(m->srv);
    /* exit without a full teardown: the test harness only needs a clean exit code */
    stats_write(m);
    fprintf(stderr, "mock-engine %s/%u: exit (generate=%" PRIu64 ")\n", m->group, m->rank, m->n_generate);
    free(m->script);
    return 0;
}
