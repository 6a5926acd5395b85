/* wpool.c - worker registry: the stepd.ctl.v1.Control service (server side),
 * group formation and rendezvous, death detection, engine connections, load
 * polling and routing. See control.proto for the protocol.
 *
 * A rank's place in a group is its live session's: a second registration for a rank whose
 * session is open is refused (ALREADY_EXISTS), never obeyed, unless it is the same process
 * (incarnation) dialling again.  A group without a rank (every session ended) is kept for
 * GetGroups while it is among the WPOOL_DEAD_KEEP most recent such groups, then freed,
 * unless `stepd serve` listed it (pinned): registrations cost nothing once they end.
 * Client calls that outlive a group (GetLoads, GetModelInfo) find it through their engine
 * connection (engine_conn.g, NULL once detached), never through a pointer of their own. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"
#include "err.h"
#include "log.h"
#include "pb-util.h"

#define CTL_SESSION "/stepd.ctl.v1.Control/Session"
#define CTL_REPORT "/stepd.ctl.v1.Control/ReportState"
#define ENGINE_GETLOADS "/stepd.v1.Engine/GetLoads"
#define WPOOL_DEAD_KEEP 16      /* groups without ranks kept for GetGroups (the latest) */

static const char *group_state_name(enum group_state s)
{
    switch (s) {
    case GROUP_FORMING: return "forming";
    case GROUP_LOADING: return "loading";
    case GROUP_READY: return "ready";
    case GROUP_FAILED: return "failed";
    }
    return "?";
}

static bool name_valid(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static struct group *group_find(struct coord *co, const char *name)
{
    for (struct group *g = co->groups; g; g = g->next)
        if (strcmp(g->name, name) == 0)
            return g;
    return NULL;
}

unsigned wpool_ready_count(const struct coord *co)
{
    unsigned n = 0;
    for (const struct group *g = co->groups; g; g = g->next)
        n += g->state == GROUP_READY;
    return n;
}

bool wpool_serves_images(const struct coord *co)
{
    for (const struct group *g = co->groups; g; g = g->next)
        if (g->state == GROUP_READY && g->model.known && g->model.supports_images)
            return true;
    return false;
}

unsigned wpool_count(const struct coord *co)
{
    unsigned n = 0;
    for (const struct group *g = co->groups; g; g = g->next)
        n++;
    return n;
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

struct group *wpool_group_get(struct coord *co, const char *name, unsigned world, bool pin)
{
    struct group *g = group_find(co, name);

    if (g) {
        g->pinned |= pin;
        return g;
    }
    g = calloc(1, sizeof(*g));
    if (!g)
        return NULL;
    g->co = co;
    snprintf(g->name, sizeof(g->name), "%s", name);
    g->id = mix64(coord_fnv1a(g->name, strlen(g->name), COORD_FNV_SEED)) | 1;
    g->world = world;
    g->pinned = pin;
    for (int i = 0; i < COORD_MAX_WORLD; i++) {
        g->ranks[i].g = g;
        g->ranks[i].rank = i;
    }
    struct group **pp = &co->groups;
    while (*pp)
        pp = &(*pp)->next;
    *pp = g;
    return g;
}

static bool group_has_ranks(const struct group *g)
{
    for (unsigned i = 0; i < g->world; i++)
        if (g->ranks[i].present)
            return true;
    return false;
}

static void group_free(struct group *g);

/* Forget groups whose every session ended, beyond the WPOOL_DEAD_KEEP latest ones. */
static void wpool_prune(struct coord *co)
{
    unsigned dead = 0;
    int64_t now = rpc_now_ms();

    for (struct group *g = co->groups; g; g = g->next) {
        if (g->pinned || group_has_ranks(g)) {
            g->dead_since_ms = 0;
            continue;
        }
        if (!g->dead_since_ms)
            g->dead_since_ms = now;
        dead++;
    }
    while (dead > WPOOL_DEAD_KEEP) {
        struct group **oldest = NULL;

        for (struct group **pp = &co->groups; *pp; pp = &(*pp)->next)
            if ((*pp)->dead_since_ms && (!oldest || (*pp)->dead_since_ms < (*oldest)->dead_since_ms))
                oldest = pp;
        struct group *g = *oldest;
        *oldest = g->next;
        group_free(g);
        dead--;
    }
}

/* ------------------------------------------------------------------ sessions */

static void group_maybe_ready(struct group *g);
static void group_set_limits(struct group *g, uint32_t max_seqs, uint32_t max_waiting);

static void rank_clear(struct rank *rk)
{
    free(rk->peer);
    free(rk->experts);
    struct group *g = rk->g;
    int idx = rk->rank;
    memset(rk, 0, sizeof(*rk));
    rk->g = g;
    rk->rank = idx;
    rk->state = STEPD__V1__WORKER_STATE__WORKER_STATE_GONE;
}

static void session_send(struct rank *rk, Stepd__Ctl__V1__ControlEvent *ev)
{
    if (rk->session)
        (void)rpc_call_send(rk->session, &ev->base);
}

/* End a rank's session from our side (status to the worker). */
static void session_end(struct rank *rk, int status, const char *why)
{
    if (rk->session) {
        struct rpc_call *c = rk->session;
        rk->session = NULL;
        rpc_call_on_cancel(c, NULL, NULL);
        rpc_call_finish(c, status, "%s", why);
    }
    rank_clear(rk);
}

/* The group cannot continue (a rank left or failed): fail its requests, tell the
 * survivors to tear down and re-register, detach the engine connection. */
static void group_fail(struct group *g, const char *why)
{
    struct coord *co = g->co;
    bool was_active = g->state == GROUP_READY || g->state == GROUP_LOADING;

    snprintf(g->last_error, sizeof(g->last_error), "%s", why);
    if (was_active) {
        log_warn("group %s (epoch %" PRIu64 ") is down: %s", g->name, g->epoch, why);
        co->m.group_failures++;
        Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
        Stepd__Ctl__V1__GroupAbort ga = STEPD__CTL__V1__GROUP_ABORT__INIT;
        ga.epoch = g->epoch;
        ga.reason = (char *)why;
        ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_GROUP_ABORT;
        ev.group_abort = &ga;
        for (unsigned i = 0; i < g->world; i++) {
            struct rank *rk = &g->ranks[i];
            if (!rk->present)
                continue;
            session_send(rk, &ev);
            session_end(rk, RPC_ABORTED, "group re-forming; register again");
        }
        g->state = GROUP_FAILED;
    }
    co->up->group_failed(g, why);
    if (g->eng) {
        engine_conn_detach(g->eng);
        g->eng = NULL;
    }
    g->loads_pending = false;
    g->cap_seqs = g->cap_waiting = 0;   /* the next engine says its own */
    /* nothing runs on an engine that is gone: its last GetLoads no longer holds */
    g->load_running = g->load_waiting = g->kv_used = g->requests_alive = 0;
    g->kv_usage = 0.0;
    for (unsigned i = 0; i < g->n_kv_pools; i++) {
        g->kv_pools[i].used = g->kv_pools[i].cached = 0;
        g->kv_pools[i].usage = 0.0;
    }
    co->up->room(co);           /* with no ready group left, the held ones end */
    if (!group_has_ranks(g))
        g->state = was_active ? GROUP_FAILED : GROUP_FORMING;
    co->up->health_changed(co);
}

/* An unguessable session id (ReportState names the session with it): "group/rank/hex". */
static void session_id_new(struct rank *rk)
{
    char hex[COORD_RANDOM_HEX];

    coord_random_hex(hex);
    snprintf(rk->session_id, sizeof(rk->session_id), "%s/%d/%s", rk->g->name, rk->rank, hex);
}

static void session_cancelled(struct rpc_call *call, void *ud)
{
    struct rank *rk = ud;
    struct group *g = rk->g;
    char why[256];

    snprintf(why, sizeof(why), "rank %d (pid %u on %s) disconnected", rk->rank, rk->pid,
             rk->hostname[0] ? rk->hostname : "?");
    log_info("control: group %s: %s", g->name, why);
    rk->session = NULL;
    rpc_call_finish(call, RPC_CANCELLED, "session ended");
    rank_clear(rk);
    group_fail(g, why);
    wpool_prune(g->co);
}

/* The group's ranks all registered as serving epoch `epoch` already (the coordinator was
 * restarted, or a world-1 group's session came back): take the group as it is - no
 * rendezvous, no reload.  It becomes ready as soon as every rank is READY. */
static void group_adopt(struct group *g, uint64_t epoch)
{
    g->epoch = epoch;
    g->state = GROUP_LOADING;
    g->last_error[0] = '\0';
    log_notice("control: group %s re-adopted at epoch %" PRIu64 ": its %u rank%s already serve it "
               "(no rendezvous, no reload)", g->name, epoch, g->world, g->world > 1 ? "s" : "");
    group_maybe_ready(g);
}

/* A rank registers with serving_epoch (it belongs to a running group) or without it (a
 * fresh process): the group can only be taken over when every rank claims the same epoch,
 * and only form afresh when none does.  A claimant that cannot be adopted gets GroupAbort
 * (it exits and comes back fresh); a fresh rank makes the waiting claimants do the same.
 * False: call is finished (the claimant refused). */
static bool claim_fits(struct group *g, const Stepd__Ctl__V1__RegisterRequest *r, struct rpc_call *call)
{
    Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
    Stepd__Ctl__V1__GroupAbort ga = STEPD__CTL__V1__GROUP_ABORT__INIT;
    char why[256];

    ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_GROUP_ABORT;
    ev.group_abort = &ga;
    ga.reason = why;
    if (r->serving_epoch) {
        const char *conflict = NULL;
        uint64_t other = 0;

        if (g->state == GROUP_LOADING || g->state == GROUP_READY) {
            conflict = "the group formed again meanwhile";
            other = g->epoch;
        }
        for (unsigned i = 0; i < g->world && !conflict; i++) {
            const struct rank *o = &g->ranks[i];
            if (o->present && o->claim_epoch != r->serving_epoch) {
                conflict = o->claim_epoch ? "another rank serves another epoch" : "another rank started afresh";
                other = o->claim_epoch;
            }
        }
        if (!conflict)
            return true;
        snprintf(why, sizeof(why), "group %s cannot be re-adopted: rank %u serves epoch %" PRIu64 ", but %s "
                 "(epoch %" PRIu64 "); register afresh", g->name, r->rank, r->serving_epoch, conflict, other);
        log_warn("control: %s", why);
        ga.epoch = r->serving_epoch;
        (void)rpc_call_send(call, &ev.base);
        rpc_call_finish(call, RPC_ABORTED, "%s", why);
        return false;
    }
    /* a fresh rank: claimants waiting to be re-adopted cannot be any more */
    for (unsigned i = 0; i < g->world; i++) {
        struct rank *o = &g->ranks[i];
        if (!o->present || !o->claim_epoch || g->state == GROUP_LOADING || g->state == GROUP_READY)
            continue;
        snprintf(why, sizeof(why), "group %s re-forms: rank %u registered afresh while rank %u waited to be "
                 "re-adopted at epoch %" PRIu64, g->name, r->rank, i, o->claim_epoch);
        log_warn("control: %s", why);
        ga.epoch = o->claim_epoch;
        session_send(o, &ev);
        session_end(o, RPC_ABORTED, why);
    }
    return true;
}

/* The same rank's new session takes over from its old one; the group is untouched. */
static void session_resume(struct rank *rk, struct rpc_call *call)
{
    struct coord *co = rk->g->co;
    struct rpc_call *old = rk->session;
    Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
    Stepd__Ctl__V1__Registered reg = STEPD__CTL__V1__REGISTERED__INIT;

    if (old) {
        rpc_call_on_cancel(old, NULL, NULL);
        rpc_call_finish(old, RPC_ABORTED, "superseded by this rank's new session");
    }
    rk->session = call;
    session_id_new(rk);
    rpc_call_on_cancel(call, session_cancelled, rk);
    log_info("control: group %s rank %d (pid %u) dialled again: its session goes on", rk->g->name, rk->rank,
             rk->pid);
    reg.session_id = rk->session_id;
    reg.heartbeat_interval_ms = co->o.heartbeat_ms;
    ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_REGISTERED;
    ev.registered = &reg;
    session_send(rk, &ev);
}

static void group_rendezvous(struct group *g)
{
    Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
    Stepd__Ctl__V1__Rendezvous rv = STEPD__CTL__V1__RENDEZVOUS__INIT;
    Stepd__Ctl__V1__PeerInfo peers[COORD_MAX_WORLD];
    Stepd__Ctl__V1__PeerInfo *pp[COORD_MAX_WORLD];

    g->epoch++;
    for (unsigned i = 0; i < g->world; i++) {
        stepd__ctl__v1__peer_info__init(&peers[i]);
        peers[i].rank = i;
        peers[i].device = g->ranks[i].device;
        peers[i].peer_address.data = g->ranks[i].peer;
        peers[i].peer_address.len = g->ranks[i].peer_len;
        peers[i].hostname = g->ranks[i].hostname;
        pp[i] = &peers[i];
    }
    rv.epoch = g->epoch;
    rv.world_size = g->world;
    rv.n_peers = g->world;
    rv.peers = pp;
    rv.nccl_unique_id.data = g->nccl_id;
    rv.nccl_unique_id.len = g->nccl_len;
    ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_RENDEZVOUS;
    ev.rendezvous = &rv;
    for (unsigned i = 0; i < g->world; i++) {
        session_send(&g->ranks[i], &ev);
        g->ranks[i].state = STEPD__V1__WORKER_STATE__WORKER_STATE_LOADING;
    }
    g->state = GROUP_LOADING;
    g->last_error[0] = '\0';
    log_info("control: group %s complete (world %u): rendezvous sent, epoch %" PRIu64, g->name,
             g->world, g->epoch);
}

/* Served model name: a path component at most (never a server path, D5). */
static void model_name_set(struct model_info *mi, const char *name)
{
    size_t n = strlen(name);
    while (n > 1 && name[n - 1] == '/')
        n--;
    const char *b = name;
    for (size_t i = 0; i < n; i++)
        if (name[i] == '/')
            b = name + i + 1;
    snprintf(mi->name, sizeof(mi->name), "%.*s", (int)(n - (size_t)(b - name)), b);
}

static void model_from_pb(struct model_info *mi, const Stepd__Ctl__V1__ModelSummary *m)
{
    memset(mi, 0, sizeof(*mi));
    mi->known = true;
    model_name_set(mi, m->model_name);
    snprintf(mi->type, sizeof(mi->type), "%s", m->model_type);
    mi->vocab_size = m->vocab_size;
    mi->max_model_len = m->max_model_len;
    for (size_t i = 0; i < m->n_eos_token_ids && i < COORD_MAX_EOS; i++)
        mi->eos[mi->n_eos++] = m->eos_token_ids[i];
    mi->num_layers = m->num_layers;
    mi->hidden_size = m->hidden_size;
    mi->num_experts = m->num_experts;
    mi->num_experts_per_tok = m->num_experts_per_tok;
    snprintf(mi->quantization, sizeof(mi->quantization), "%s", m->quantization);
    mi->num_mtp_layers = m->num_mtp_layers;
    mi->max_num_speculative_tokens = m->max_num_speculative_tokens;
    mi->supports_images = m->supports_images;
}

static void h_session(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__Ctl__V1__RegisterRequest *r = (const void *)msg;
    struct group *g;

    if (co->draining) {
        rpc_call_finish(call, RPC_UNAVAILABLE, "coordinator is draining");
        return;
    }
    if (!name_valid(r->group)) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "group: must match [A-Za-z0-9._-]{1,64}");
        return;
    }
    if (r->world_size != 1 && r->world_size != 2 && r->world_size != 4 && r->world_size != 8) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "world_size: must be 1, 2, 4 or 8 (got %u)",
                        r->world_size);
        return;
    }
    if (r->rank >= r->world_size) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "rank: %u is not below world_size %u", r->rank,
                        r->world_size);
        return;
    }
    if (!r->device[0] || strlen(r->device) > 31) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "device: must be 1..31 bytes (\"cpu\", \"cuda:N\")");
        return;
    }
    if (r->peer_address.len > 65536) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "peer_address: longer than 64 KiB");
        return;
    }
    if (r->nccl_unique_id.len > sizeof(g->nccl_id)) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "nccl_unique_id: longer than %zu bytes",
                        sizeof(g->nccl_id));
        return;
    }
    if (r->rank == 0 && (!r->engine_address[0] || strlen(r->engine_address) >= sizeof(g->engine_addr))) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "engine_address: required for rank 0 (< 256 bytes)");
        return;
    }
    if (r->rank == 0 && strncmp(r->engine_address, "unix", 4) != 0) {
        size_t el = strlen(r->engine_address);
        if (el >= 2 && strcmp(r->engine_address + el - 2, ":0") == 0) {
            rpc_call_finish(call, RPC_INVALID_ARGUMENT,
                            "engine_address: '%s' has port 0; register the bound port", r->engine_address);
            return;
        }
    }
    if (strlen(r->hostname) >= sizeof(((struct rank *)0)->hostname)) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "hostname: longer than 63 bytes");
        return;
    }
    g = wpool_group_get(co, r->group, r->world_size, false);
    if (!g) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    if (g->world != r->world_size) {
        bool any = false;
        for (unsigned i = 0; i < g->world; i++)
            any |= g->ranks[i].present;
        if (any) {
            rpc_call_finish(call, RPC_FAILED_PRECONDITION,
                            "world_size: group %s has world size %u, this rank says %u", g->name,
                            g->world, r->world_size);
            return;
        }
        g->world = r->world_size;
    }
    struct rank *rk = &g->ranks[r->rank];
    if (rk->present && r->serving_epoch && r->serving_epoch == g->epoch && r->incarnation == rk->incarnation &&
        (g->state == GROUP_LOADING || g->state == GROUP_READY)) {
        /* the same process dialled again before the end of its old session reached us:
         * the group goes on (nothing of it was lost) */
        session_resume(rk, call);
        return;
    }
    if (rk->present && (r->incarnation != rk->incarnation || g->state == GROUP_LOADING ||
                        g->state == GROUP_READY)) {
        /* the rank is another live session's: a claim on it is refused, not obeyed (a
         * restarted process is taken once the end of its old session reaches us: the
         * connection's reset, or the keepalive within --worker-timeout-ms) */
        log_warn("control: group %s rank %u: registration from pid %u on %s refused: the rank is "
                 "held by a live session (pid %u on %s)", g->name, r->rank, r->pid, r->hostname,
                 rk->pid, rk->hostname);
        rpc_call_finish(call, RPC_ALREADY_EXISTS, "rank: group %s rank %u is held by a live session "
                        "(pid %u on %s); register again once it ends", g->name, r->rank, rk->pid,
                        rk->hostname);
        return;
    }
    if (rk->present) {
        /* the same process dialling again before its group formed: the new session goes on */
        session_end(rk, RPC_ABORTED, "superseded by this rank's new session");
    }
    if (!claim_fits(g, r, call))
        return;
    rank_clear(rk);
    rk->present = true;
    rk->session = call;
    rk->state = STEPD__V1__WORKER_STATE__WORKER_STATE_REGISTERED;
    snprintf(rk->device, sizeof(rk->device), "%s", r->device);
    snprintf(rk->hostname, sizeof(rk->hostname), "%s", r->hostname);
    rk->pid = r->pid;
    rk->incarnation = r->incarnation;
    rk->claim_epoch = r->serving_epoch;
    if (r->serving_epoch) {
        /* a rank of a group that already runs: its state is as it says */
        rk->state = r->ready ? STEPD__V1__WORKER_STATE__WORKER_STATE_READY
                             : STEPD__V1__WORKER_STATE__WORKER_STATE_LOADING;
        rk->progress = r->ready ? 1.0f : 0.0f;
        if (r->rank == 0 && r->kv_blocks_total)
            g->kv_total = r->kv_blocks_total;
        if (r->rank == 0 && r->limits)
            group_set_limits(g, r->limits->max_num_seqs, r->limits->max_waiting);
    }
    if (r->peer_address.len) {
        rk->peer = malloc(r->peer_address.len);
        if (rk->peer) {
            memcpy(rk->peer, r->peer_address.data, r->peer_address.len);
            rk->peer_len = r->peer_address.len;
        }
    }
    if (r->n_experts) {
        rk->experts = malloc(r->n_experts * sizeof(uint32_t));
        if (rk->experts) {
            memcpy(rk->experts, r->experts, r->n_experts * sizeof(uint32_t));
            rk->n_experts = r->n_experts;
        }
    }
    session_id_new(rk);
    if (r->rank == 0) {
        snprintf(g->engine_addr, sizeof(g->engine_addr), "%s", r->engine_address);
        if (r->nccl_unique_id.len)
            memcpy(g->nccl_id, r->nccl_unique_id.data, r->nccl_unique_id.len);
        g->nccl_len = r->nccl_unique_id.len;
        if (r->model && r->model->vocab_size) {
            model_from_pb(&g->model, r->model);
            if (!co->model.known)
                co->model = g->model;
        }
    }
    rpc_call_on_cancel(call, session_cancelled, rk);
    log_info("control: group %s rank %u/%u registered (device %s, pid %u, host %s)", g->name,
             r->rank, r->world_size, r->device, r->pid, r->hostname);

    Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
    Stepd__Ctl__V1__Registered reg = STEPD__CTL__V1__REGISTERED__INIT;
    reg.session_id = rk->session_id;
    reg.heartbeat_interval_ms = co->o.heartbeat_ms;
    ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_REGISTERED;
    ev.registered = &reg;
    session_send(rk, &ev);

    bool complete = true;
    for (unsigned i = 0; i < g->world; i++)
        complete &= g->ranks[i].present;
    if (complete && g->state != GROUP_LOADING && g->state != GROUP_READY) {
        if (r->serving_epoch)
            group_adopt(g, r->serving_epoch);   /* claim_fits: every rank claims it */
        else
            group_rendezvous(g);
    }
}

/* The engine's capacity as it reported it; held requests move when it grew. */
static void group_set_limits(struct group *g, uint32_t max_seqs, uint32_t max_waiting)
{
    bool more = max_seqs + max_waiting > g->cap_seqs + g->cap_waiting;

    if (max_seqs == g->cap_seqs && max_waiting == g->cap_waiting)
        return;
    if (!g->cap_seqs && !g->cap_waiting)
        log_info("group %s: the engine admits %u requests at once (%u running + %u waiting)", g->name,
                 max_seqs + max_waiting, max_seqs, max_waiting);
    else
        log_info("group %s: the engine's capacity is now %u + %u (was %u + %u)", g->name, max_seqs,
                 max_waiting, g->cap_seqs, g->cap_waiting);
    g->cap_seqs = max_seqs;
    g->cap_waiting = max_waiting;
    if (more && g->state == GROUP_READY)
        g->co->up->room(g->co);
}

static struct rank *rank_by_session(struct coord *co, const char *sid)
{
    for (struct group *g = co->groups; g; g = g->next)
        for (unsigned i = 0; i < g->world; i++)
            if (g->ranks[i].present && strcmp(g->ranks[i].session_id, sid) == 0)
                return &g->ranks[i];
    return NULL;
}

struct model_fetch {
    struct engine_conn *eng;        /* its group: eng->g, NULL once detached */
};

static void model_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct model_fetch *mf = ud;
    const Stepd__V1__GetModelInfoResponse *r = (const void *)msg;
    struct group *g = mf->eng->g;

    if (!g || r->vocab_size == 0)
        return;
    struct model_info *mi = &g->model;
    memset(mi, 0, sizeof(*mi));
    mi->known = true;
    model_name_set(mi, r->model_name);
    snprintf(mi->type, sizeof(mi->type), "%s", r->model_type);
    mi->vocab_size = r->vocab_size;
    mi->max_model_len = r->max_model_len;
    for (size_t i = 0; i < r->n_eos_token_ids && i < COORD_MAX_EOS; i++)
        mi->eos[mi->n_eos++] = r->eos_token_ids[i];
    mi->num_layers = r->num_layers;
    mi->hidden_size = r->hidden_size;
    mi->num_experts = r->num_experts;
    mi->num_experts_per_tok = r->num_experts_per_tok;
    snprintf(mi->quantization, sizeof(mi->quantization), "%s", r->quantization);
    mi->num_mtp_layers = r->num_mtp_layers;
    mi->max_num_speculative_tokens = r->max_num_speculative_tokens;
    mi->supports_images = r->supports_images;
    if (!g->co->model.known)
        g->co->model = *mi;
    log_info("group %s: model %s (%s), vocab %u, context %u, %s (from the engine)", g->name, mi->name,
             mi->type, mi->vocab_size, mi->max_model_len, mi->supports_images ? "images served" : "text only");
}

static void group_set_ready(struct group *g);

static void model_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct model_fetch *mf = ud;
    struct group *g = mf->eng->g;

    if (g && g->state == GROUP_LOADING) {
        if (status == RPC_OK && g->model.known) {
            group_set_ready(g);
        } else {
            char why[300];
            snprintf(why, sizeof(why), "engine GetModelInfo failed: %s: %.200s", rpc_status_name(status), details);
            group_fail(g, why);
        }
    }
    engine_conn_unref(mf->eng);
    free(mf);
}

/* Registration without model information (or an older worker): ask the engine. */
static void group_fetch_model(struct group *g)
{
    Stepd__V1__GetModelInfoRequest req = STEPD__V1__GET_MODEL_INFO_REQUEST__INIT;
    struct model_fetch *mf = malloc(sizeof(*mf));

    if (!mf)
        return;
    mf->eng = g->eng;
    g->eng->refs++;
    if (rpc_client_start(g->eng->ch, "/stepd.v1.Engine/GetModelInfo", &req.base,
                         &stepd__v1__get_model_info_response__descriptor, rpc_now_ms() + 5000, model_msg,
                         model_done, mf, NULL) < 0) {
        g->eng->refs--;
        free(mf);
    }
}

/* Every ready group must serve the same model: requests are routed to any of them and
 * validated against one vocabulary.  Writes the reason and returns false on a mismatch. */
static bool group_model_matches(const struct group *g, char *why, size_t n)
{
    const struct model_info *m = &g->model;

    for (const struct group *h = g->co->groups; h; h = h->next) {
        const struct model_info *o = &h->model;

        if (h == g || h->state != GROUP_READY || !o->known)
            continue;
        if (o->vocab_size != m->vocab_size || o->hidden_size != m->hidden_size ||
            o->num_layers != m->num_layers || strcmp(o->type, m->type) != 0) {
            snprintf(why, n, "model mismatch: group %s serves %s '%s' (vocab %u, hidden %u, %u layers) "
                     "but ready group %s serves %s '%s' (vocab %u, hidden %u, %u layers)",
                     g->name, m->type, m->name, m->vocab_size, m->hidden_size, m->num_layers,
                     h->name, o->type, o->name, o->vocab_size, o->hidden_size, o->num_layers);
            return false;
        }
    }
    return true;
}

static void group_set_ready(struct group *g)
{
    struct coord *co = g->co;
    char why[1024];

    if (!group_model_matches(g, why, sizeof(why))) {
        log_error("%s", why);
        group_fail(g, why);
        return;
    }
    g->state = GROUP_READY;
    g->loads_ok_ms = rpc_now_ms();
    engine_out_open(g->eng);
    log_info("group %s is ready (epoch %" PRIu64 ", engine %s)", g->name, g->epoch, g->engine_addr);
    co->up->health_changed(co);
    wpool_poll_loads(co);
    co->up->room(co);
}

static void group_maybe_ready(struct group *g)
{
    struct coord *co = g->co;

    if (g->state != GROUP_LOADING || g->eng)
        return;
    for (unsigned i = 0; i < g->world; i++)
        if (g->ranks[i].state != STEPD__V1__WORKER_STATE__WORKER_STATE_READY)
            return;
    g->eng = engine_conn_new(co, g->engine_addr);
    if (!g->eng) {
        group_fail(g, "cannot create a channel to the engine address");
        return;
    }
    g->eng->g = g;
    /* the group is routable once the coordinator knows its model (vocabulary and
     * context length drive validation): ask the engine when registration lacked it */
    if (g->model.known)
        group_set_ready(g);
    else
        group_fetch_model(g);
}

static void h_report(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__Ctl__V1__StateReport *r = (const void *)msg;
    struct rank *rk = rank_by_session(co, r->session_id);
    Stepd__Ctl__V1__StateAck ack = STEPD__CTL__V1__STATE_ACK__INIT;

    if (!rk) {
        rpc_call_finish(call, RPC_NOT_FOUND, "session_id: unknown or expired session '%s'", r->session_id);
        return;
    }
    struct group *g = rk->g;
    if (!(r->load_progress >= 0.0f && r->load_progress <= 1.0f)) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "load_progress: must be in [0, 1]");
        return;
    }
    snprintf(rk->message, sizeof(rk->message), "%s", r->message);
    switch (r->state) {
    case STEPD__CTL__V1__RANK_STATE__RANK_STATE_LOADING:
        if (g->state != GROUP_LOADING) {
            rpc_call_finish(call, RPC_FAILED_PRECONDITION, "state: group %s is %s, not loading",
                            g->name, group_state_name(g->state));
            return;
        }
        rk->progress = r->load_progress;
        break;
    case STEPD__CTL__V1__RANK_STATE__RANK_STATE_READY:
        if (g->state != GROUP_LOADING && g->state != GROUP_READY) {
            rpc_call_finish(call, RPC_FAILED_PRECONDITION, "state: group %s is %s; READY needs a rendezvous first",
                            g->name, group_state_name(g->state));
            return;
        }
        rk->progress = 1.0f;
        rk->state = STEPD__V1__WORKER_STATE__WORKER_STATE_READY;
        if (rk->rank == 0 && r->kv_blocks_total)
            g->kv_total = r->kv_blocks_total;
        if (rk->rank == 0 && r->limits)
            group_set_limits(g, r->limits->max_num_seqs, r->limits->max_waiting);
        group_maybe_ready(g);
        break;
    case STEPD__CTL__V1__RANK_STATE__RANK_STATE_FAILED: {
        char why[400];
        snprintf(why, sizeof(why), "rank %d failed: %s", rk->rank, r->message[0] ? r->message : "(no reason given)");
        ack.epoch = g->epoch;
        rpc_call_send(call, &ack.base);
        rpc_call_finish(call, RPC_OK, NULL);
        group_fail(g, why);
        return;
    }
    case STEPD__CTL__V1__RANK_STATE__RANK_STATE_DRAINING:
        rk->state = STEPD__V1__WORKER_STATE__WORKER_STATE_DRAINING;
        break;
    default:
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "state: unknown value %d", (int)r->state);
        return;
    }
    ack.epoch = g->epoch;
    rpc_call_send(call, &ack.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

int wpool_register_methods(struct coord *co, struct rpc_server *s)
{
    struct rpc_method ms[] = {
        { CTL_SESSION, &stepd__ctl__v1__register_request__descriptor, true, false, h_session, co },
        { CTL_REPORT, &stepd__ctl__v1__state_report__descriptor, false, false, h_report, co },
    };
    for (size_t i = 0; i < ARRAY_SIZE(ms); i++) {
        int r = rpc_server_add_method(s, &ms[i]);
        if (r < 0)
            return r;
    }
    return 0;
}

/* ------------------------------------------------------------------ heartbeat, loads */

void wpool_heartbeat(struct coord *co)
{
    static uint64_t seq;
    Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
    Stepd__Ctl__V1__Heartbeat hb = STEPD__CTL__V1__HEARTBEAT__INIT;

    hb.seq = ++seq;
    hb.coordinator_time_ms = (uint64_t)rpc_now_ms();
    ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_HEARTBEAT;
    ev.heartbeat = &hb;
    for (struct group *g = co->groups; g; g = g->next) {
        for (unsigned i = 0; i < g->world; i++) {
            struct rank *rk = &g->ranks[i];
            if (!rk->present || !rk->session)
                continue;
            int r = rpc_call_send(rk->session, &ev.base);
            if (r == -ENOBUFS) {
                char why[200];
                snprintf(why, sizeof(why), "rank %u (pid %u) stopped reading heartbeats", i, rk->pid);
                session_end(rk, RPC_UNAVAILABLE, "heartbeats not read");
                group_fail(g, why);
                break;
            }
        }
    }
}

struct loads_poll {
    struct engine_conn *eng;        /* its group: eng->g, NULL once detached */
};

static void loads_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct loads_poll *lp = ud;
    const Stepd__V1__GetLoadsResponse *r = (const void *)msg;
    struct group *g = lp->eng->g;

    if (!g || r->n_loads < 1)
        return;
    g->loads_ok_ms = rpc_now_ms();
    const Stepd__V1__GroupLoad *l = r->loads[0];
    g->load_running = l->num_running;
    g->load_waiting = l->num_waiting;
    g->kv_used = l->kv_blocks_used;
    if (l->kv_blocks_total)
        g->kv_total = l->kv_blocks_total;
    g->kv_usage = l->kv_usage;
    g->preemptions = l->num_preemptions;
    g->tokens_per_s = l->tokens_per_s;
    g->mean_acceptance_length = l->mean_acceptance_length;
    g->requests_alive = l->num_requests_alive;
    g->requests_created = l->requests_created;
    g->requests_freed = l->requests_freed;
    g->prefix_queries = l->prefix_cache_queries;
    g->prefix_hits = l->prefix_cache_hits;
    g->image_encodes = l->image_encodes;
    g->image_cache_hits = l->image_cache_hits;
    g->n_kv_pools = 0;
    for (size_t i = 0; i < l->n_kv_pools && i < GROUP_MAX_KV_POOLS; i++) {
        struct group_kv_pool *kp = &g->kv_pools[g->n_kv_pools++];

        snprintf(kp->kind, sizeof(kp->kind), "%s", l->kv_pools[i]->kind);
        kp->used = l->kv_pools[i]->blocks_used;
        kp->total = l->kv_pools[i]->blocks_total;
        kp->cached = l->kv_pools[i]->blocks_cached;
        kp->usage = l->kv_pools[i]->usage;
    }
    if (l->max_num_seqs || l->max_waiting)
        group_set_limits(g, l->max_num_seqs, l->max_waiting);
}

static void loads_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct loads_poll *lp = ud;
    struct group *g = lp->eng->g;
    if (g) {
        g->loads_pending = false;
        if (status != RPC_OK)
            log_debug("group %s: GetLoads failed: %s %s", g->name, rpc_status_name(status), details);
    }
    engine_conn_unref(lp->eng);
    free(lp);
}

void wpool_poll_loads(struct coord *co)
{
    Stepd__V1__GetLoadsRequest req = STEPD__V1__GET_LOADS_REQUEST__INIT;

    wpool_prune(co);

    for (struct group *g = co->groups; g; g = g->next) {
        if (g->state == GROUP_READY && rpc_now_ms() - g->loads_ok_ms > (int64_t)co->o.worker_timeout_ms) {
            char why[200];
            snprintf(why, sizeof(why), "engine (rank 0, pid %u) has not answered GetLoads for %u ms",
                     g->ranks[0].pid, co->o.worker_timeout_ms);
            group_fail(g, why);
            continue;
        }
        if (g->state != GROUP_READY || !g->eng)
            continue;
        engine_out_open(g->eng);        /* again, once a failed output stream's back-off is over */
        if (g->loads_pending)
            continue;
        struct loads_poll *lp = malloc(sizeof(*lp));
        if (!lp)
            return;
        lp->eng = g->eng;
        g->eng->refs++;
        if (rpc_client_start(g->eng->ch, ENGINE_GETLOADS, &req.base,
                             &stepd__v1__get_loads_response__descriptor, rpc_now_ms() + (int64_t)co->o.worker_timeout_ms / 2, loads_msg,
                             loads_done, lp, NULL) < 0) {
            g->eng->refs--;
            free(lp);
            continue;
        }
        g->loads_pending = true;
    }
}

void wpool_load_fill(const struct group *g, struct group_load_msg *m)
{
    Stepd__V1__GroupLoad *l = &m->l;

    stepd__v1__group_load__init(l);
    l->group = (char *)g->name;
    l->num_running = g->in_flight > g->load_running ? g->in_flight : g->load_running;
    l->num_waiting = g->load_waiting;
    l->kv_blocks_used = g->kv_used;
    l->kv_blocks_total = g->kv_total;
    l->kv_usage = g->kv_usage;
    l->num_preemptions = g->preemptions;
    l->tokens_per_s = g->tokens_per_s;
    l->mean_acceptance_length = g->mean_acceptance_length;
    l->num_requests_alive = g->requests_alive;
    l->requests_created = g->requests_created;
    l->requests_freed = g->requests_freed;
    l->prefix_cache_queries = g->prefix_queries;
    l->prefix_cache_hits = g->prefix_hits;
    l->image_encodes = g->image_encodes;
    l->image_cache_hits = g->image_cache_hits;
    l->max_num_seqs = g->cap_seqs;
    l->max_waiting = g->cap_waiting;
    for (unsigned i = 0; i < g->n_kv_pools; i++) {
        Stepd__V1__KvPoolLoad *p = &m->pools[i];

        stepd__v1__kv_pool_load__init(p);
        p->kind = (char *)g->kv_pools[i].kind;
        p->blocks_used = g->kv_pools[i].used;
        p->blocks_total = g->kv_pools[i].total;
        p->blocks_cached = g->kv_pools[i].cached;
        p->usage = g->kv_pools[i].usage;
        m->pp[i] = p;
    }
    l->n_kv_pools = g->n_kv_pools;
    l->kv_pools = m->pp;
}

/* ------------------------------------------------------------------ routing */



/* Requests g may still take (UINT32_MAX when its engine reported no capacity). */
static uint32_t wpool_room(const struct group *g)
{
    uint32_t cap = g->cap_seqs + g->cap_waiting;

    if (!g->cap_seqs && !g->cap_waiting)
        return UINT32_MAX;
    return g->in_flight < cap ? cap - g->in_flight : 0;
}

/* The routing score of g: lower is less loaded.  The coordinator-side in-flight count is
 * exact; the engine's waiting count adds what other routers (or the engine's own queue)
 * contribute. */
static uint64_t load_score(const struct group *g)
{
    return (uint64_t)g->in_flight * 1024 + (uint64_t)g->load_waiting * 1024 +
           (uint64_t)(g->kv_usage * 512);
}

struct pick {
    struct coord *co;
    uint32_t need_len;
    bool images;            /* the request has images: groups that encode them only */
    bool full;              /* a ready group that would hold it has no room */
};

/* g could take the request now. */
static bool routable(const struct group *g, struct pick *p)
{
    if (g->state != GROUP_READY || !g->eng)
        return false;
    if (g->model.known && g->model.max_model_len && p->need_len > g->model.max_model_len)
        return false;
    if (p->images && !g->model.supports_images)
        return false;
    if (wpool_room(g) == 0) {
        p->full = true;     /* at its engine's capacity: never sent more than it admits */
        return false;
    }
    return true;
}

static struct group *group_by_id(struct coord *co, uint64_t id)
{
    for (struct group *g = co->groups; g; g = g->next)
        if (g->id == id)
            return g;
    return NULL;
}

static bool affinity_usable(uint64_t id, void *ctx)
{
    struct pick *p = ctx;
    struct group *g = group_by_id(p->co, id);

    return g && routable(g, p);
}

struct group *wpool_pick(struct coord *co, const uint64_t *keys, size_t n_keys, uint32_t need_len,
                         bool images, bool *ret_full)
{
    struct pick p = { .co = co, .need_len = need_len, .images = images };
    struct group *best = NULL, *aff = NULL;
    uint64_t best_score = UINT64_MAX, aff_w = 0;
    size_t depth;

    for (struct group *g = co->groups; g; g = g->next) {
        if (!routable(g, &p))
            continue;
        if (load_score(g) < best_score) {
            best_score = load_score(g);
            best = g;
        }
        if (n_keys) {
            /* the prefix's home: highest random weight of (first block, group) */
            uint64_t w = mix64(keys[0] ^ g->id);

            if (!aff || w > aff_w) {
                aff = g;
                aff_w = w;
            }
        }
    }
    *ret_full = !best && p.full;
    if (!best)
        return NULL;
    if (n_keys && co->aff) {
        struct group *held = group_by_id(co, affinity_find(co->aff, keys, n_keys, affinity_usable,
                                                           &p, &depth));
        if (held)
            aff = held;         /* it has the longest part of this prefix cached */
    }
    /* keep affinity unless the preferred group is clearly busier */
    if (aff && load_score(aff) <= best_score * 2 + 8 * 1024)
        return aff;
    return best;
}

/* ------------------------------------------------------------------ lifetime */

int wpool_init(struct coord *co)
{
    co->groups = NULL;
    return 0;
}

void wpool_shutdown_sessions(struct coord *co)
{
    Stepd__Ctl__V1__ControlEvent ev = STEPD__CTL__V1__CONTROL_EVENT__INIT;
    Stepd__Ctl__V1__Shutdown sd = STEPD__CTL__V1__SHUTDOWN__INIT;
    sd.reason = "coordinator shutting down";
    ev.event_case = STEPD__CTL__V1__CONTROL_EVENT__EVENT_SHUTDOWN;
    ev.shutdown = &sd;
    for (struct group *g = co->groups; g; g = g->next) {
        for (unsigned i = 0; i < g->world; i++) {
            struct rank *rk = &g->ranks[i];
            if (!rk->present)
                continue;
            session_send(rk, &ev);
            session_end(rk, RPC_UNAVAILABLE, "coordinator shutting down");
        }
        if (g->eng) {
            engine_conn_detach(g->eng);
            g->eng = NULL;
        }
        g->state = GROUP_FAILED;
    }
}

static void group_free(struct group *g)
{
    if (g->eng) {
        engine_conn_detach(g->eng);
        g->eng = NULL;
    }
    for (unsigned i = 0; i < COORD_MAX_WORLD; i++)
        rank_clear(&g->ranks[i]);
    free(g);
}

void wpool_done(struct coord *co)
{
    struct group *g = co->groups;
    while (g) {
        struct group *n = g->next;
        group_free(g);
        g = n;
    }
    co->groups = NULL;
}
