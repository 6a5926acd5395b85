/* health.c - liveness and readiness: grpc.health.v1 Check (answered on the CQ thread from
 * the published state, so probes never wait behind the loop) and Watch, the readiness
 * transitions (logged, pushed to watchers and to the service manager's STATUS line), and
 * what the CQ thread reads to refuse work while draining (struct coord_gate).
 *
 * Services: "" and "liveness" answer SERVING until the process exits; "readiness" and
 * "stepd.v1.Inference" answer SERVING while a group is ready and the coordinator is not
 * draining.  Loop thread, but for the CQ-thread Check.
 */
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"
#include "log.h"
#include "notify.h"
#include "serve.h"

#define HEALTH_SERVING GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
#define HEALTH_NOT_SERVING GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
#define HEALTH_UNKNOWN_SVC GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN


bool coord_ready(const struct coord *co)
{
    return !co->draining && !co->exiting && wpool_ready_count(co) > 0;
}

/* Append what the loading ranks last reported ("; g0/r1 loading: 3.1 GB of 9.4 GB (33%),
 * 775 MB/s, ETA 8 s"), as far as buf holds it. */
static void load_progress(const struct coord *co, char *buf, size_t n)
{
    size_t len = strlen(buf);

    for (const struct group *g = co->groups; g; g = g->next) {
        if (g->state != GROUP_LOADING)
            continue;
        for (unsigned i = 0; i < g->world && len + 1 < n; i++) {
            const struct rank *rk = &g->ranks[i];

            if (!rk->present || strncmp(rk->message, "loading: ", 9) != 0)
                continue;
            snprintf(buf + len, n - len, "; %s/r%u %s", g->name, i, rk->message);
            len += strlen(buf + len);
        }
    }
}

void coord_unready_reason(const struct coord *co, char *buf, size_t n)
{
    char sv[512];
    unsigned total = wpool_count(co);

    buf[0] = '\0';
    if (coord_ready(co))
        return;
    if (co->exiting || co->draining) {
        snprintf(buf, n, "%s", co->exiting ? "shutting down" : "draining");
        return;
    }
    serve_unready_reason(co->serve, sv, sizeof(sv));
    if (sv[0])
        snprintf(buf, n, "no worker group is ready: %s", sv);
    else if (total == 0)
        snprintf(buf, n, "no worker group has registered");
    else
        snprintf(buf, n, "none of %u worker group%s is ready", total, total == 1 ? "" : "s");
    load_progress(co, buf, n);
}

static int health_kind(const char *svc)
{
    if (!strcmp(svc, "") || !strcmp(svc, "liveness"))
        return 0;
    if (!strcmp(svc, "stepd.v1.Inference") || !strcmp(svc, "readiness"))
        return 1;
    return -1;
}

static int health_status(const struct coord *co, int kind)
{
    if (kind == 0)
        return co->exiting ? HEALTH_NOT_SERVING : HEALTH_SERVING;
    if (kind == 1)
        return coord_ready(co) ? HEALTH_SERVING : HEALTH_NOT_SERVING;
    return HEALTH_UNKNOWN_SVC;
}

static void health_send(struct health_watch *w, int st)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = st;
    w->last = st;
    (void)rpc_call_send(w->call, &resp.base);
}

void health_status_line(struct coord *co)
{
    unsigned ready = wpool_ready_count(co), total = wpool_count(co);
    float prog = 0;
    unsigned nr = 0;
    char sv[256] = "", why[512] = "";

    if (co->serve) {
        /* serve mode: the supervisor's summary, and why nothing serves when nothing does */
        serve_status(co->serve, sv, sizeof(sv));
        coord_unready_reason(co, why, sizeof(why));
        notify_status("%s; groups ready %u/%u; %s; running %u, queued %u%s%s",
                      co->draining ? "draining" : ready ? "serving" : "starting", ready, total, sv,
                      co->admit.running, co->admit.queued, why[0] ? "; " : "", why);
        return;
    }
    for (struct group *g = co->groups; g; g = g->next)
        if (g->state == GROUP_LOADING)
            for (unsigned i = 0; i < g->world; i++) {
                prog += g->ranks[i].progress;
                nr++;
            }
    if (nr)
        notify_status("%s; groups ready %u/%u; loading %.0f%%; running %u, queued %u",
                      co->draining ? "draining" : "serving", ready, total, 100.0 * prog / nr,
                      co->admit.running, co->admit.queued);
    else
        notify_status("%s; groups ready %u/%u; running %u, queued %u",
                      co->draining ? "draining" : "serving", ready, total, co->admit.running,
                      co->admit.queued);
}

/* What health Check on the CQ thread answers, and whether Generate may be refused there. */
void health_publish(struct coord *co)
{
    atomic_store_explicit(&co->gate.health[0], health_status(co, 0), memory_order_release);
    atomic_store_explicit(&co->gate.health[1], health_status(co, 1), memory_order_release);
    atomic_store_explicit(&co->gate.closed, co->draining || co->exiting, memory_order_release);
}

void coord_health_update(struct coord *co)
{
    int ready = coord_ready(co);

    health_publish(co);
    for (struct health_watch *w = co->watches; w; w = w->next) {
        int st = health_status(co, w->kind);
        if (st != w->last)
            health_send(w, st);
    }
    if (ready != co->last_ready) {
        log_info("readiness: %s (%u of %u groups ready%s)", ready ? "SERVING" : "NOT_SERVING",
                 wpool_ready_count(co), wpool_count(co), co->draining ? ", draining" : "");
        co->last_ready = ready;
    }
    serve_check(co->serve);     /* stepd serve: "startup complete", READY=1 */
    health_status_line(co);
}

static void h_health_check(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)msg;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    int kind = health_kind(r->service);

    if (kind < 0) {
        rpc_call_finish(call, RPC_NOT_FOUND, "unknown service");
        return;
    }
    resp.status = health_status(co, kind);
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

/* Check on the CQ thread, from the published state: it never waits behind the loop
 * (A7: readiness probes stay fast under load). Undecodable requests go to the loop. */
static bool h_health_check_cq(struct rpc_call *call, void *ud)
{
    struct coord *co = ud;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)rpc_cq_request(call);
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;

    if (!r)
        return false;
    int kind = health_kind(r->service);
    if (kind < 0) {
        rpc_cq_reply(call, NULL, RPC_NOT_FOUND, "unknown service", NULL, NULL);
        return true;
    }
    resp.status = atomic_load_explicit(&co->gate.health[kind], memory_order_acquire);
    rpc_cq_reply(call, &resp.base, RPC_OK, NULL, NULL, NULL);
    return true;
}

static void watch_cancel(struct rpc_call *call, void *ud)
{
    struct health_watch *w = ud;
    w->call = NULL;
    rpc_call_finish(call, RPC_CANCELLED, NULL);
}

static void watches_gc(struct coord *co)
{
    struct health_watch **pp = &co->watches;
    while (*pp) {
        if (!(*pp)->call) {
            struct health_watch *d = *pp;
            *pp = d->next;
            free(d);
        } else {
            pp = &(*pp)->next;
        }
    }
}

static void h_health_watch(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)msg;
    struct health_watch *w;

    watches_gc(co);
    if (co->exiting) {
        rpc_call_finish(call, RPC_UNAVAILABLE, "server shutting down");
        return;
    }
    w = calloc(1, sizeof(*w));
    if (!w) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    w->call = call;
    w->kind = health_kind(r->service);
    w->next = co->watches;
    co->watches = w;
    rpc_call_on_cancel(call, watch_cancel, w);
    health_send(w, health_status(co, w->kind));
}

void health_watches_end(struct coord *co)
{
    for (struct health_watch *w = co->watches; w; w = w->next) {
        if (!w->call)
            continue;
        Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
        resp.status = HEALTH_NOT_SERVING;
        (void)rpc_call_send(w->call, &resp.base);
        rpc_call_on_cancel(w->call, NULL, NULL);
        rpc_call_finish(w->call, RPC_UNAVAILABLE, "server shutting down");
        w->call = NULL;
    }
    watches_gc(co);
}

void health_tick(struct coord *co)
{
    watches_gc(co);
    health_publish(co);
}

int health_register_methods(struct coord *co, struct rpc_server *s)
{
    struct rpc_method ms[] = {
        { "/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor, false, true,
          h_health_check, co, 0, h_health_check_cq, NULL, true },   /* own CQ: A7 */
        { "/grpc.health.v1.Health/Watch", &grpc__health__v1__health_check_request__descriptor, true, true,
          h_health_watch, co },
    };
    for (size_t i = 0; i < ARRAY_SIZE(ms); i++) {
        int r = rpc_server_add_method(s, &ms[i]);
        if (r < 0)
            return r;
    }
    return 0;
}
