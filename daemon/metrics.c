/* metrics.c - the coordinator's metrics and their Prometheus text exposition (served by
 * http.c as GET /metrics on the API port and on --metrics-listen).  Names mirror vLLM's
 * (vllm:time_to_first_token_seconds, ...) under the "stepd:" prefix. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"
#include "strbuf.h"
#include "err.h"
#include "log.h"

static const double b_ttft[] = { 0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0 };
static const double b_itl[] = { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0 };
static const double b_e2e[] = { 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0 };
static const double b_len[] = { 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                                100000, 200000, 500000, 1000000 };

static void hist_init(struct histogram *h, const double *b, size_t n)
{
    memset(h, 0, sizeof(*h));
    BUG_ON(n > METRICS_MAX_BUCKETS);
    h->bounds = b;
    h->n_bounds = n;
}

void metrics_init(struct metrics *m)
{
    memset(m, 0, sizeof(*m));
    hist_init(&m->ttft, b_ttft, ARRAY_SIZE(b_ttft));
    hist_init(&m->itl, b_itl, ARRAY_SIZE(b_itl));
    hist_init(&m->e2e, b_e2e, ARRAY_SIZE(b_e2e));
    hist_init(&m->queue, b_e2e, ARRAY_SIZE(b_e2e));
    hist_init(&m->prompt_len, b_len, ARRAY_SIZE(b_len));
    hist_init(&m->gen_len, b_len, ARRAY_SIZE(b_len));
}

void metrics_observe(struct histogram *h, double v)
{
    size_t i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

static void hist_render(struct strbuf *b, const char *name, const char *help, const struct histogram *h)
{
    uint64_t cum = 0;
    strbuf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (size_t i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        strbuf_printf(b, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name, h->bounds[i], cum);
    }
    cum += h->counts[h->n_bounds];
    strbuf_printf(b, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n%s_sum %.9g\n%s_count %" PRIu64 "\n", name, cum, name,
              h->sum, name, h->count);
}

static void counter(struct strbuf *b, const char *name, const char *help, uint64_t v)
{
    strbuf_printf(b, "# HELP %s %s\n# TYPE %s counter\n%s %" PRIu64 "\n", name, help, name, name, v);
}

static void gauge(struct strbuf *b, const char *name, const char *help, double v)
{
    strbuf_printf(b, "# HELP %s %s\n# TYPE %s gauge\n%s %.9g\n", name, help, name, name, v);
}

char *metrics_render(struct coord *co, size_t *ret_len)
{
    struct strbuf b = STRBUF_INIT;
    /* the loop's counters plus the rejections answered on the CQ thread (coord_gate) */
    struct metrics mc = co->m;
    const struct metrics *m = &mc;
    uint64_t cq_full = atomic_load_explicit(&co->gate.rejected_full, memory_order_relaxed);
    mc.rejected_full += cq_full;
    mc.status[RPC_RESOURCE_EXHAUSTED] += cq_full;
    static const char *reasons[] = { "unspecified", "stop", "length", "abort", "error" };
    double kv_used = 0, kv_total = 0;

    hist_render(&b, "stepd:time_to_first_token_seconds", "Time to first token (coordinator view).", &m->ttft);
    hist_render(&b, "stepd:inter_token_latency_seconds", "Gap between streamed chunks.", &m->itl);
    hist_render(&b, "stepd:e2e_request_latency_seconds", "Arrival to final message.", &m->e2e);
    hist_render(&b, "stepd:request_queue_time_seconds", "Time spent waiting for an admission slot.", &m->queue);
    hist_render(&b, "stepd:request_prompt_tokens", "Prompt length of finished requests.", &m->prompt_len);
    hist_render(&b, "stepd:request_generation_tokens", "Generated tokens of finished requests.", &m->gen_len);
    gauge(&b, "stepd:num_requests_running", "Requests dispatched to engines.", co->admit.running);
    gauge(&b, "stepd:num_requests_waiting", "Requests waiting for an admission slot.", co->admit.queued);
    counter(&b, "stepd:prompt_tokens_total", "Prompt tokens of finished requests.", m->prompt_tokens);
    counter(&b, "stepd:generation_tokens_total", "Generated tokens of finished requests.", m->generation_tokens);
    strbuf_printf(&b, "# HELP stepd:request_success_total Finished requests by finish reason.\n"
                  "# TYPE stepd:request_success_total counter\n");
    for (int i = 1; i < 5; i++)
        strbuf_printf(&b, "stepd:request_success_total{finished_reason=\"%s\"} %" PRIu64 "\n", reasons[i],
                  m->finished[i]);
    strbuf_printf(&b, "# HELP stepd:request_status_total Terminal gRPC status of Generate calls.\n"
                  "# TYPE stepd:request_status_total counter\n");
    for (int i = 0; i < 17; i++)
        if (m->status[i])
            strbuf_printf(&b, "stepd:request_status_total{code=\"%s\"} %" PRIu64 "\n", rpc_status_name(i),
                      m->status[i]);
    strbuf_printf(&b, "# HELP stepd:requests_rejected_total Requests refused before reaching an engine.\n"
                  "# TYPE stepd:requests_rejected_total counter\n"
                  "stepd:requests_rejected_total{reason=\"queue_full\"} %" PRIu64 "\n"
                  "stepd:requests_rejected_total{reason=\"invalid\"} %" PRIu64 "\n"
                  "stepd:requests_rejected_total{reason=\"draining\"} %" PRIu64 "\n"
                  "stepd:requests_rejected_total{reason=\"unavailable\"} %" PRIu64 "\n",
              m->rejected_full, m->rejected_invalid, m->rejected_draining, m->rejected_unavailable);
    counter(&b, "stepd:requests_accepted_total", "Admitted Generate requests.", m->accepted);
    counter(&b, "stepd:aborts_sent_total", "Abort RPCs sent to engines.", m->aborts_sent);
    counter(&b, "stepd:structured_output_requests_total",
            "Requests with a structured-output constraint checked by the coordinator.", m->so_requests);
    counter(&b, "stepd:structured_output_compiles_total",
            "Structured-output constraints compiled by the coordinator (the rest were known good).",
            m->so_compiles);
    counter(&b, "stepd:group_failures_total", "Times a ready or loading worker group went down.", m->group_failures);
    counter(&b, "stepd:idle_trims_total", "Times the idle coordinator gave freed heap back to the system.",
            m->idle_trims);
    counter(&b, "stepd:spec_decode_num_drafts_total", "MTP verification steps with drafts.", m->spec_drafts);
    counter(&b, "stepd:spec_decode_num_draft_tokens_total", "MTP draft tokens proposed.", m->spec_draft_tokens);
    counter(&b, "stepd:spec_decode_num_accepted_tokens_total", "MTP draft tokens accepted.", m->spec_accepted);
    gauge(&b, "stepd:spec_decode_mean_acceptance_length", "Tokens per verification step with drafts since the "
          "start, 1 + accepted / drafts (vLLM's mean acceptance length; 0 before any draft).",
          m->spec_drafts ? 1.0 + (double)m->spec_accepted / (double)m->spec_drafts : 0.0);
    strbuf_printf(&b, "# HELP stepd:spec_decode_num_accepted_tokens_per_pos_total Accepted drafts by position.\n"
                  "# TYPE stepd:spec_decode_num_accepted_tokens_per_pos_total counter\n");
    for (int i = 0; i < 3; i++)
        strbuf_printf(&b, "stepd:spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"} %" PRIu64 "\n", i,
                  m->spec_accepted_pos[i]);
    strbuf_printf(&b, "# HELP stepd:spec_decode_num_steps_by_drafts_total Decode steps by the number of drafts "
                  "verified (the depth the draft policy chose).\n"
                  "# TYPE stepd:spec_decode_num_steps_by_drafts_total counter\n");
    for (int i = 0; i <= 3; i++)
        strbuf_printf(&b, "stepd:spec_decode_num_steps_by_drafts_total{drafts=\"%d\"} %" PRIu64 "\n", i,
                  m->spec_steps_by_drafts[i]);
    strbuf_printf(&b, "# HELP stepd:group_ready Worker group readiness (1 ready).\n# TYPE stepd:group_ready gauge\n");
    for (struct group *g = co->groups; g; g = g->next)
        strbuf_printf(&b, "stepd:group_ready{group=\"%s\"} %d\n", g->name, g->state == GROUP_READY);
    strbuf_printf(&b, "# HELP stepd:group_in_flight Requests in flight per group.\n# TYPE stepd:group_in_flight gauge\n");
    for (struct group *g = co->groups; g; g = g->next)
        strbuf_printf(&b, "stepd:group_in_flight{group=\"%s\"} %u\n", g->name, g->in_flight);
    strbuf_printf(&b, "# HELP stepd:group_kv_cache_usage_perc KV usage per group (engine report).\n"
                  "# TYPE stepd:group_kv_cache_usage_perc gauge\n");
    uint64_t preempt = 0;
    for (struct group *g = co->groups; g; g = g->next) {
        strbuf_printf(&b, "stepd:group_kv_cache_usage_perc{group=\"%s\"} %.6f\n", g->name, g->kv_usage);
        if (g->state == GROUP_READY) {
            kv_used += g->kv_used;
            kv_total += g->kv_total;
        }
        preempt += g->preemptions;
    }
    {
        /* per pool kind, the busiest ready group's: what runs out first */
        static const char *const kinds[2] = { "full_attention", "sliding_window" };
        uint64_t queries = 0, hits = 0, encodes = 0, img_hits = 0;
        double pool[2] = { 0, 0 };

        for (struct group *g = co->groups; g; g = g->next) {
            queries += g->prefix_queries;
            hits += g->prefix_hits;
            encodes += g->image_encodes;
            img_hits += g->image_cache_hits;
            for (unsigned i = 0; i < g->n_kv_pools && g->state == GROUP_READY; i++)
                for (int k = 0; k < 2; k++)
                    if (strcmp(g->kv_pools[i].kind, kinds[k]) == 0 && g->kv_pools[i].usage > pool[k])
                        pool[k] = g->kv_pools[i].usage;
        }
        /* without per-pool reports (older engines): the groups' block totals as the full pool */
        if (pool[0] == 0 && pool[1] == 0 && kv_total > 0)
            pool[0] = kv_used / kv_total;
        strbuf_printf(&b, "# HELP stepd:kv_cache_usage_perc KV-cache usage per pool kind "
                      "(the highest over ready groups; 1 = full).\n"
                      "# TYPE stepd:kv_cache_usage_perc gauge\n");
        for (int k = 0; k < 2; k++)
            strbuf_printf(&b, "stepd:kv_cache_usage_perc{kind=\"%s\"} %.6f\n", kinds[k], pool[k]);
        counter(&b, "stepd:prefix_cache_queries_total",
                "Prompt tokens looked up in the engines' prefix caches.", queries);
        counter(&b, "stepd:prefix_cache_hits_total",
                "Prompt tokens served from the engines' prefix caches.", hits);
        counter(&b, "stepd:image_encodes_total", "Images run through the engines' vision encoders.", encodes);
        counter(&b, "stepd:image_cache_hits_total",
                "Images taken from the engines' encoder caches instead of encoded again.", img_hits);
        gauge(&b, "stepd:prefix_affinity_entries", "Prompt blocks the router remembers a group for.",
              affinity_size(co->aff));
    }
    counter(&b, "stepd:num_preemptions_total", "Engine preemptions (sum of group reports).", preempt);
    gauge(&b, "stepd:groups_ready", "Ready worker groups.", wpool_ready_count(co));
    gauge(&b, "stepd:ready", "Readiness (1 SERVING).", coord_ready(co));
    gauge(&b, "stepd:live_rpc_calls", "Live gRPC calls in the coordinator.", (double)rpc_ctx_live_calls(co->rpc));
    if (b.oom) {
        strbuf_done(&b);
        return NULL;
    }
    *ret_len = b.len;
    return b.p;
}
