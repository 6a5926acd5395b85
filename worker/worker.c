/* worker.c - one rank of a worker group: rendezvous, comm, shard load, lockstep loop. */
#include <ctype.h>
#include <signal.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "stepd-config.h"

#include "backend.h"
#include "comm.h"
#include "comm-nccl.h"
#include "engine.h"
#include "health.h"
#include "kvplan.h"
#include "loader.h"
#include "loadwatch.h"
#include "log.h"
#include "net.h"
#include "mock.h"
#include "progress.h"
#include "model.h"
#include "vision.h"
#include "cli.h"
#include "rpc.h"
#include "worker.h"

void worker_opts_init(struct worker_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->group = "g0";
    o->world_size = 1;
    o->device = "cpu";
    o->max_seqs = KVPLAN_DEFAULT_MAX_SEQS;
    o->max_batched_tokens = KVPLAN_DEFAULT_MAX_BATCHED_TOKENS;
    o->max_model_len = KVPLAN_DEFAULT_MAX_MODEL_LEN;
    o->block_size = KVPLAN_DEFAULT_BLOCK_SIZE;
    o->gpu_memory_utilization = 0.9;
    o->rendezvous_timeout_msec = 60000;
    o->collective_timeout_msec = 30000;
    o->load_timeout_msec = 30 * 60 * 1000;
    o->max_tokens = 32;
    o->engine_listen = "127.0.0.1:20061";
}

static uint64_t now_msec(void)
{
    return (uint64_t)clk_now_ms();
}

/* ---- the model's collective hooks -------------------------------------------------- */

/* ctx is where the comm lives (struct comm **): a rank that re-forms its group gets a new
 * communicator under the same model */
static int hook_allreduce(void *ctx, float *buf, size_t n)
{
    return comm_allreduce_sum(*(struct comm **)ctx, buf, n);
}

static int hook_allgather(void *ctx, const float *in, float *out, size_t n)
{
    return comm_allgather(*(struct comm **)ctx, in, out, n * sizeof(float));
}

/* ---- CUDA groups: the NCCL comm of the model's collectives --------------------------- */

/* ---- helpers --------------------------------------------------------------------- */

static bool group_name_ok(const char *g)
{
    size_t n = strlen(g);

    if (n < 1 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)g[i]) && !strchr("._-", g[i]))
            return false;
    return true;
}

/* Resident bytes of this process from /proc/self/status: total, anonymous, file-backed
 * (mapped checkpoint pages).  -1 where unknown. */
struct rss {
    long total, anon, file;
};

static void rss_read(struct rss *r)
{
    char line[256];
    long kb;
    FILE *f = fopen("/proc/self/status", "r");

    r->total = r->anon = r->file = -1;
    if (!f)
        return;
    while (fgets(line, sizeof(line), f)) {
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
            r->total = kb * 1024;
        else if (sscanf(line, "RssAnon: %ld kB", &kb) == 1)
            r->anon = kb * 1024;
        else if (sscanf(line, "RssFile: %ld kB", &kb) == 1)
            r->file = kb * 1024;
    }
    fclose(f);
}


struct worker {
    const struct worker_opts *o;
    struct comm *comm;
    struct comm *dcomm;         /* CUDA groups: NCCL on the backend's stream (the model's
                                   collectives); the step plan stays on comm */
    const struct comm_nccl_api *nccl;
    struct worker_ctl *ctl;
    struct backend *be;
    struct ckpt *ck;
    struct forward *fwd;        /* model or mock */
    struct vision *vision;      /* rank 0 (CPU or CUDA backend) with a vision_config: the image
                                   encoder (docs/ARCHITECTURE.md 5.1), else NULL */
    struct engine_vision ev;    /* the engine's view of it (images served: encode set) */
    struct forward *lock;       /* rank 0 with world > 1: the broadcasting wrapper */
    struct step_plan_limits lim;
    size_t plan_cap;
    int vocab, n_mtp, logit_rows;
    int32_t eos[ENGINE_MAX_EOS];
    int n_eos, sliding_window;
    const struct model_config *mc;      /* NULL with --mock */
    struct worker_health *health;       /* sd_notify and the HTTP probes */
    struct load_watch *lw;              /* load progress, while stage_load() runs */
};

/* A CUDA group's trunk steps end with the NCCL comm's step check (async error, the
 * watchdog's busy mark cleared): the collectives ran in stream order inside the step, with
 * no host wait of their own. */
static int dcomm_wrap(struct worker *w, struct err_buf *e)
{
    struct forward *f;

    if (worker_nccl_forward_new(w->fwd, w->nccl, w->dcomm, &f) < 0)
        return err_set(e, -ENOMEM, "out of memory");
    w->fwd = f;
    return 0;
}

/* Rank 0 makes the NCCL unique id and broadcasts it over the group's host comm (already
 * connected through the rendezvous); every rank joins on its device, enqueuing on the
 * backend's stream. */
static int nccl_join(struct worker *w, int device, struct err_buf *e)
{
    const struct worker_opts *o = w->o;
    const struct comm_nccl_api *(*entry)(void);
    uint8_t id[COMM_NCCL_ID_BYTES] = { 0 };
    int r;

    *(void **)&entry = backend_plugin_symbol(w->be, STEPD_COMM_NCCL_API);
    if (!entry)
        return err_set(e, -ENOTSUP, "--device %s with --world-size %d: the CUDA plugin was "
                       "built without NCCL (no nccl.h)", o->device, o->world_size);
    w->nccl = entry();
    if (o->rank == 0) {
        r = w->nccl->unique_id(id, sizeof(id));
        if (r < 0)
            return err_set(e, r, "NCCL unique id: %s", err_str(r));
    }
    r = comm_broadcast(w->comm, id, sizeof(id), 0);
    if (r < 0)
        return err_set(e, r, "broadcasting the NCCL id: %s", comm_last_error(w->comm));
    r = w->nccl->create(o->rank, o->world_size, device, id, sizeof(id),
                        o->collective_timeout_msec, backend_native(w->be, "stream"), &w->dcomm);
    if (r < 0)
        return err_set(e, r, "joining the NCCL communicator on device %d: %s", device, err_str(r));
    r = comm_watchdog_start(w->dcomm, 10000, WORKER_EXIT_COMM);
    if (r < 0)
        return err_set(e, r, "cannot start the NCCL watchdog: %s", err_str(r));
    log_info("group %s: rank %d joined NCCL on cuda:%d", o->group, o->rank, device);
    return 0;
}

static void limits_init(struct worker *w)
{
    const struct worker_opts *o = w->o;
    int per_seq = (o->max_model_len + 3 + o->block_size - 1) / o->block_size + 1;

    w->lim = (struct step_plan_limits){
        .max_seqs = o->max_seqs,
        .max_tokens = o->max_batched_tokens,
        .vocab_size = w->vocab,
        .max_blocks = { w->fwd->n_blocks[0], w->fwd->n_blocks[1] },
        .max_positions = o->max_model_len + 4,
        .max_block_ids = o->max_seqs * per_seq,
        .block_size = o->block_size,
        .max_mtp_depth = w->n_mtp > 0 ? w->n_mtp : 0,
        /* rank 0's image rows reach every rank (a real model's hidden; --mock takes none) */
        .img_width = w->mc ? w->mc->hidden_size : 0,
    };
    w->plan_cap = step_plan_max_packed_size(&w->lim);
}

/* ---- set-up stages ----------------------------------------------------------------- */

/* The control thread, told that the group re-forms: a collective waiting on a peer (a
 * follower's receive of the next plan has no deadline) gives up at once. */
static void on_group_abort(void *ud)
{
    comm_interrupt(ud);
}

static int stage_comm(struct worker *w, struct err_buf *e)
{
    const struct worker_opts *o = w->o;
    struct worker_peers peers = { 0 };
    const void *addr = NULL;
    size_t alen = 0;
    uint64_t t0 = now_msec();
    int r;

    if (o->world_size == 1 && !o->coordinator)
        return comm_single_new(&w->comm) < 0 ? err_set(e, -ENOMEM, "out of memory") : 0;
#ifdef HAVE_UCX
    if (o->world_size > 1) {
        r = comm_ucx_new(o->rank, o->world_size, o->collective_timeout_msec, &w->comm);
        if (r < 0)
            return err_set(e, r, "cannot create the UCX worker: %s", err_str(r));
        comm_ucx_address(w->comm, &addr, &alen);
    }
#else
    if (o->world_size > 1)
        return err_set(e, -EOPNOTSUPP, "world size %d needs UCX, which this build lacks",
                       o->world_size);
#endif
    if (o->world_size == 1) {
        r = comm_single_new(&w->comm);
        if (r < 0)
            return err_set(e, r, "out of memory");
    }
    if (o->coordinator) {
        struct worker_ctl_register reg = {
            .group = o->group, .rank = o->rank, .world_size = o->world_size, .device = o->device,
            .peer_address = addr, .peer_address_len = alen,
            .engine_address = o->rank == 0 ? o->engine_listen : NULL,
            .control_key = o->control_key,
            .tls = o->control_tls.root_file || o->control_tls.cert_file ? &o->control_tls : NULL,
            .on_group_abort = on_group_abort, .abort_ud = w->comm,
        };

        r = worker_ctl_open(o->coordinator, &reg, o->rendezvous_timeout_msec, &w->ctl, &peers, e);
    } else {
        r = worker_rendezvous_dir(o->rendezvous_dir, o->group, o->rank, o->world_size, addr, alen,
                                  o->rendezvous_timeout_msec, &peers, e);
    }
    if (r < 0)
        return r;
    if (o->world_size > 1) {
        if (peers.world_size != o->world_size) {
            r = err_set(e, -EBADMSG, "rendezvous: %d peers for a world of %d", peers.world_size,
                        o->world_size);
            goto out;
        }
#ifdef HAVE_UCX
        r = comm_ucx_connect(w->comm, (const void *const *)peers.addr, peers.len);
        if (r < 0) {
            r = err_set(e, r, "connecting the group: %s", comm_last_error(w->comm));
            goto out;
        }
#endif
    }
    if (o->rendezvous_dir)
        worker_rendezvous_dir_clean(o->rendezvous_dir, o->group, o->rank);
    /* a collective stuck in the transport past its deadline + 10 s ends the process */
    if (o->world_size > 1) {
        r = comm_watchdog_start(w->comm, 10000, WORKER_EXIT_COMM);
        if (r < 0) {
            r = err_set(e, r, "cannot start the collective watchdog: %s", err_str(r));
            goto out;
        }
    }
    log_info("group %s: %d rank%s connected over %s in %llu ms", o->group, o->world_size,
             o->world_size > 1 ? "s" : "", w->comm->ops->name,
             (unsigned long long)(now_msec() - t0));
out:
    worker_peers_done(&peers);
    return r;
}

/* ---- KV pools (kvplan.h) --------------------------------------------------------------- */

/* MemAvailable of /proc/meminfo in bytes, or -1. */
static int64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long long kb = -1;

    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1)
            break;
    fclose(f);
    return kb < 0 ? -1 : (int64_t)kb * 1024;
}

/* The smallest of v[0..1] over the group (every rank calls it, under the load deadline:
 * ranks get here at their own pace), so that every rank runs with the same pools. */
static int group_min2(struct worker *w, int32_t v[2], struct err_buf *e)
{
    int n = w->o->world_size, saved = w->comm->timeout_msec, r;
    int32_t *all;

    if (n == 1)
        return 0;
    all = calloc((size_t)n * 2, sizeof(int32_t));
    if (!all)
        return err_set(e, -ENOMEM, "out of memory");
    w->comm->timeout_msec = w->o->load_timeout_msec;
    r = comm_allgather(w->comm, v, all, 2 * sizeof(int32_t));
    w->comm->timeout_msec = saved;
    if (r < 0) {
        free(all);
        return err_set(e, r, "agreeing on the KV pools: %s", comm_last_error(w->comm));
    }
    for (int k = 0; k < n; k++)
        for (int g = 0; g < 2; g++)
            v[g] = all[2 * k + g] < v[g] ? all[2 * k + g] : v[g];
    free(all);
    return 0;
}

static void kv_req_init(const struct worker *w, const int64_t block_bytes[2], struct kvplan_req *q)
{
    const struct worker_opts *o = w->o;
    int k = ckpt_mtp_depth(w->ck);      /* the group's, as the engine's margin on rank 0 */

    *q = (struct kvplan_req){
        .block_size = o->block_size, .max_num_seqs = o->max_seqs,
        .max_model_len = o->max_model_len, .max_batched_tokens = o->max_batched_tokens,
        .sliding_window = w->sliding_window,
        .mtp_margin = k < KVPLAN_MAX_DRAFTS ? k : KVPLAN_MAX_DRAFTS,
    };
    for (int g = 0; g < 2; g++)
        q->bytes_per_token[g] = block_bytes[g] / o->block_size;
}

/* Plan the pools for budget (< 0: none given), agree on them over the group (a rank whose
 * budget cannot hold them says so with -1, so that none waits for it) and apply
 * --kv-blocks; `what` names where the budget came from, for the error. */
static int kv_plan_apply(struct worker *w, const int64_t block_bytes[2], int64_t budget,
                         const char *what, int n_blocks[2], struct err_buf *e)
{
    struct kvplan_req q;
    struct kvplan p = { { 0 } };
    struct err_buf pe = { "" };
    char b1[32], b2[32];
    int r, rc;

    kv_req_init(w, block_bytes, &q);
    rc = kvplan_compute(&q, budget, &p, &pe);
    if (rc == 0 && w->o->kv_blocks > 0)
        p.n_blocks[KVPLAN_FULL] = w->o->kv_blocks;
    int32_t v[2] = { rc < 0 ? -1 : p.n_blocks[0], rc < 0 ? -1 : p.n_blocks[1] };
    r = group_min2(w, v, e);
    if (r < 0)
        return r;
    if (rc < 0)
        return err_set(e, rc, "%s: %s", what, pe.msg);
    if (v[0] < 0)
        return err_set(e, -ENOSPC, "another rank of the group cannot hold the KV cache (its "
                       "log says why)");
    n_blocks[0] = v[0];
    n_blocks[1] = v[1];
    log_info("KV cache (%s, %s): full-attention pool %d blocks = %lld tokens (%s), sliding-window "
             "pool %d blocks = %lld tokens (%s); sequences of %d tokens the full pool holds at once: "
             "%lld",
             w->o->kv_f32 ? "FP32" : "BF16", what, v[0], (long long)v[0] * w->o->block_size,
             kvplan_fmt_bytes(v[0] * p.block_bytes[0], b1, sizeof(b1)), v[1],
             (long long)v[1] * w->o->block_size,
             kvplan_fmt_bytes(v[1] * p.block_bytes[1], b2, sizeof(b2)), w->o->max_model_len,
             (long long)v[0] / p.seq_blocks);
    return 0;
}

/* model_opts.kv_blocks on a device: the budget is --gpu-memory-utilization of its memory
 * minus what is in use once the weights and activations are there. */
static int kv_blocks_device(void *ctx, const int64_t block_bytes[2], int n_blocks[2],
                            struct err_buf *e)
{
    struct worker *w = ctx;
    size_t free_b, total_b;
    char what[160], t[32], u[32];
    int r = backend_mem_info(w->be, &free_b, &total_b);

    if (r < 0)
        return err_set(e, r, "device memory: %s", err_str(r));
    int64_t used = (int64_t)(total_b - free_b);
    int64_t budget = (int64_t)(w->o->gpu_memory_utilization * (double)total_b) - used;
    snprintf(what, sizeof(what), "--gpu-memory-utilization %.2f of %s with %s in use", 
             w->o->gpu_memory_utilization, kvplan_fmt_bytes((int64_t)total_b, t, sizeof(t)),
             kvplan_fmt_bytes(used, u, sizeof(u)));
    return kv_plan_apply(w, block_bytes, budget < 0 ? 0 : budget, what, n_blocks, e);
}

static int ev_view_tokens(void *ctx, const struct engine_view *v)
{
    return v->width != v->height ? -EINVAL : vision_view_tokens(ctx, v->width);
}

/* The engine's encoder call: views of one image (square, vision_view_tokens checked them at
 * submit) through vision_encode in one batch. */
static int ev_encode(void *ctx, const struct engine_view *v, int n, float *out, struct err_buf *e)
{
    struct vision_view *vv = calloc((size_t)n, sizeof(*vv));
    int r;

    if (!vv)
        return err_set(e, -ENOMEM, "out of memory for %d views", n);
    for (int i = 0; i < n; i++)
        vv[i] = (struct vision_view){ v[i].rgb, v[i].width };
    r = vision_encode(ctx, vv, n, out, NULL, NULL, e);
    free(vv);
    return r;
}

#define WORKER_IMAGE_MAX_MSG (512 << 20)

/* Images are served by rank 0 of any group whose config names image_token_id: it encodes
 * them, and each step's image rows travel with the plan to the other ranks (plan-wire.c),
 * which splice them as rank 0 does; else the engine refuses them. */
static void worker_vision_serve(struct worker *w, const struct vision_config *vc)
{
    const char *why = vc->image_token_id < 0 ? "config.json has no image_token_id" : NULL;

    log_info("vision encoder: %d blocks of width %d, projector to %d (%s%s)", vc->layers,
             vc->width, vc->text_hidden, why ? "images are not served: " : "images served",
             why ? why : "");
    if (why)
        return;
    w->ev = (struct engine_vision){ .image_token_id = vc->image_token_id, .hidden = vc->text_hidden,
                                    .view_tokens = ev_view_tokens, .encode = ev_encode,
                                    .ctx = w->vision };
}

/* Host memory (CPU, or a backend that reports no device memory): --kv-cache-memory, else
 * every sequence at full length, at most 90 % of the memory available now. */
static int kv_blocks_host(struct worker *w, const struct model_config *mc, int n_blocks[2],
                          int64_t ret_block_bytes[2], struct err_buf *e)
{
    int64_t bpt[2], bb[2], budget = w->o->kv_cache_memory > 0 ? w->o->kv_cache_memory : -1;
    char what[160], a[32];
    struct kvplan_req q;
    struct kvplan p;
    struct err_buf pe;


    kvplan_bytes_per_token(mc, w->o->world_size, w->o->rank, ckpt_mtp_depth(w->ck),
                           w->o->kv_f32 ? 4 : 2, bpt);
    for (int g = 0; g < 2; g++)
        ret_block_bytes[g] = bb[g] = bpt[g] * w->o->block_size;
    if (budget > 0) {
        snprintf(what, sizeof(what), "--kv-cache-memory");
        return kv_plan_apply(w, bb, budget, what, n_blocks, e);
    }
    kv_req_init(w, bb, &q);
    int64_t avail = mem_available();
    if (kvplan_compute(&q, -1, &p, &pe) == 0 && (avail < 0 || p.all_bytes <= avail / 10 * 9)) {
        snprintf(what, sizeof(what), "%d sequences of %d tokens", w->o->max_seqs,
                 w->o->max_model_len);
        return kv_plan_apply(w, bb, -1, what, n_blocks, e);
    }
    snprintf(what, sizeof(what), "90%% of the %s of memory available (no --kv-cache-memory)",
             kvplan_fmt_bytes(avail, a, sizeof(a)));
    return kv_plan_apply(w, bb, avail / 10 * 9, what, n_blocks, e);
}

static int stage_load(struct worker *w, struct err_buf *e)
{
    const struct worker_opts *o = w->o;
    int r;

    w->logit_rows = o->max_batched_tokens;
    if (o->mock) {
        /* no KV memory: one block per position of every sequence, in both pools */
        int n_blocks = o->kv_blocks > 0 ? o->kv_blocks
                           : o->max_seqs * ((o->max_model_len + 3 + o->block_size - 1) /
                                            o->block_size + 1);
        struct mock_config mc;

        mock_config_init(&mc);
        mc.n_mtp = spec_config_depth(&o->spec, SPEC_MAX_K);
        mc.max_tokens_per_step = o->max_batched_tokens;
        mc.max_seqs = o->max_seqs;
        mc.block_size = o->block_size;
        mc.n_blocks[0] = mc.n_blocks[1] = n_blocks;
        r = mock_forward_new(&mc, &w->fwd);
        if (r < 0)
            return err_set(e, r, "mock forward: %s", err_str(r));
        w->vocab = w->fwd->vocab_size;
        w->n_mtp = spec_config_depth(&o->spec, SPEC_MAX_K);
        w->eos[0] = 1;
        w->n_eos = 0;
        return 0;
    }
    struct model_config declared;
    char cfg_path[PATH_MAX];

    snprintf(cfg_path, sizeof(cfg_path), "%s/config.json", o->model_dir);
    r = model_config_load(cfg_path, &declared, e);
    if (r < 0)
        return r;
    struct ckpt_opts co = { .mtp_dir = o->mtp_dir, .world_size = o->world_size, .rank = o->rank,
                            .mtp_depth = o->rank == 0 ? spec_config_depth(&o->spec, declared.n_mtp_layers) : 0 };
    r = ckpt_open(o->model_dir, &co, &w->ck, e);
    if (r < 0)
        return r;
    load_watch_set(w->lw, w->ck);
    for (const char *wl = ckpt_warnings(w->ck); *wl;) {
        size_t n = strcspn(wl, "\n");

        log_warn("checkpoint: %.*s", (int)n, wl);
        wl += n + (wl[n] == '\n');
    }
    const struct model_config *mc = ckpt_config(w->ck);
    w->mc = mc;
    r = model_config_check_len(mc, o->max_model_len, o->allow_long_max_model_len, e);
    if (r < 0)
        return r;
    w->vocab = mc->vocab_size;
    w->n_mtp = o->rank == 0 ? ckpt_mtp_depth(w->ck) : 0;
    if (o->rank == 0 && o->spec.num_speculative_tokens > w->n_mtp)
        log_warn("--mtp %d requested but %s: serving %s", o->spec.num_speculative_tokens,
                 w->n_mtp ? "fewer MTP layers are available" : "the MTP layers are absent or incomplete",
                 w->n_mtp ? "with fewer drafts" : "without speculation (the trunk only)");
    w->sliding_window = mc->sliding_window;
    for (int i = 0; i < mc->n_eos && w->n_eos < ENGINE_MAX_EOS; i++)
        w->eos[w->n_eos++] = mc->eos_token_ids[i];

    struct backend_cfg bc = { .n_threads = o->threads, .mxfp4_exact = o->exact };
    const char *bname = "cpu";
    if (strncmp(o->device, "cuda:", 5) == 0) {
        bname = "cuda";
        bc.device = atoi(o->device + 5);
    }
    r = backend_new(bname, &bc, &w->be);
    if (r < 0)
        return err_set(e, r, "backend %s (%s): %s", bname, o->device, err_str(r));
    struct model_comm hooks = { .ctx = &w->comm, .rank = o->rank, .world = o->world_size,
                                .allreduce_sum = hook_allreduce, .allgather = hook_allgather };
    const bool cuda = strcmp(bname, "cuda") == 0;
    if (cuda && o->world_size > 1) {
        r = nccl_join(w, bc.device, e);
        if (r < 0)
            return r;
        hooks.ctx = &w->dcomm;  /* the model's buffers are device memory */
    }
    struct model_opts mo = {
        .max_tokens_per_step = o->max_batched_tokens, .max_seqs = o->max_seqs,
        .max_logit_rows = w->logit_rows, .block_size = o->block_size,
        .max_seq_len = o->max_model_len + 4, .kv_f32 = o->kv_f32,
        .draft_quant = spec_draft_mxfp4(o->spec.draft_quant, bname) ? MODEL_DRAFT_MXFP4
                                                               : MODEL_DRAFT_CHECKPOINT,
    };
    size_t dev_free, dev_total;
    int64_t planned[2] = { 0, 0 }, reserved[2];
    if (o->kv_cache_memory <= 0 && backend_mem_info(w->be, &dev_free, &dev_total) == 0) {
        mo.kv_blocks = kv_blocks_device;
        mo.kv_blocks_ctx = w;
    } else {
        if (strcmp(bname, "cpu") != 0 && o->kv_cache_memory <= 0)
            log_warn("backend %s reports no device memory (backend_ops.mem_info): sizing the KV "
                     "cache as on the host; give --kv-cache-memory", bname);
        r = kv_blocks_host(w, mc, mo.n_blocks, planned, e);
        if (r < 0)
            return r;
    }
    if (ckpt_vision(w->ck)) {
        /* first: the encoder's weights and memory plan are in use when the KV pools are sized */
        struct engine_config ec;
        int64_t vbytes;
        engine_config_init(&ec);
        r = vision_new(w->ck, w->be, &w->vision, e);
        if (r == 0)
            r = vision_plan(w->vision, ec.image_batch_views, ckpt_vision(w->ck)->image_size, &vbytes, e);
        if (r < 0)
            return r;
        if (vbytes > 0)
            log_info("vision encoder: %lld bytes of device memory planned for calls of %d views",
                     (long long)vbytes, ec.image_batch_views);
        worker_vision_serve(w, vision_cfg(w->vision));
    }
    r = model_forward_new(w->ck, w->be, &hooks, &mo, &w->fwd, e);
    if (r < 0)
        return r;
    model_kv_block_bytes(model_from_forward(w->fwd), reserved);
    if (!mo.kv_blocks && (reserved[0] != planned[0] || reserved[1] != planned[1]))
        return err_set(e, -EPROTO, "KV plan: %lld + %lld bytes per block planned, the model "
                       "reserved %lld + %lld (kvplan.c and the model disagree)",
                       (long long)planned[0], (long long)planned[1], (long long)reserved[0],
                       (long long)reserved[1]);
    return w->dcomm ? dcomm_wrap(w, e) : 0;
}

/* The load's progress (loadwatch.c, on its thread): to the coordinator and STATUS=. */
static void load_report(void *ctx, float frac, const char *line)
{
    struct worker *w = ctx;

    worker_health_phase(w->health, WORKER_PHASE_LOADING, "%s: group %s rank %d of %d", line,
                        w->o->group, w->o->rank, w->o->world_size);
    if (w->ctl)
        (void)worker_ctl_report(w->ctl, 1, frac, line, NULL);
}

static void report_memory(struct worker *w, const struct rss *before, int64_t load_ms)
{
    struct ckpt_plan_stats ps = { 0 };
    struct rss now;
    char line[640], took[96];
    int fd;

    rss_read(&now);
    if (w->ck)
        ckpt_plan_stats(w->ck, &ps);
    snprintf(line, sizeof(line),
             "{\"group\":\"%s\",\"rank\":%d,\"world_size\":%d,\"planned_bytes\":%lld,"
             "\"tensors\":%lld,\"experts\":[%d,%d],\"rss_bytes\":%ld,\"rss_anon_bytes\":%ld,"
             "\"rss_file_bytes\":%ld,\"rss_before_load_bytes\":%ld}\n",
             w->o->group, w->o->rank, w->o->world_size, (long long)ps.bytes,
             (long long)ps.n_tensors, ps.expert_first, ps.expert_count, now.total, now.anon,
             now.file, before->total);
    progress_done(took, sizeof(took), ps.bytes, load_ms);
    log_info("loaded: %lld planned bytes in %lld tensors, experts [%d, +%d); resident %ld bytes "
             "(%ld anonymous, %ld file-backed; %ld before loading); loaded %s",
             (long long)ps.bytes, (long long)ps.n_tensors, ps.expert_first, ps.expert_count,
             now.total, now.anon, now.file, before->total, took);
    if (!w->o->report_file)
        return;
    fd = open(w->o->report_file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        if (write(fd, line, strlen(line)) < 0)
            log_warn("%s: %s", w->o->report_file, strerror(errno));
        close(fd);
    }
}

/* Every rank must run with the same shapes, or plans from rank 0 would be rejected (or
 * worse, mean something else) on the others: compare them once, before the first step. */
struct group_shape {
    int32_t vocab, max_seqs, max_batched_tokens, max_model_len, block_size;
    int32_t n_blocks[_KV_GROUP_MAX];
    int32_t world_size, mock;
};
_Static_assert(sizeof(struct group_shape) == 9 * sizeof(int32_t), "compared as int32_t[9]");

static int check_group_shape(struct worker *w, struct err_buf *e)
{
    static const char *const names[] = { "vocab size", "--max-seqs", "--max-batched-tokens",
                                         "--max-model-len", "--block-size", "KV blocks (full)",
                                         "KV blocks (sliding)", "--world-size", "--mock" };
    struct group_shape mine = {
        .vocab = w->vocab, .max_seqs = w->o->max_seqs,
        .max_batched_tokens = w->o->max_batched_tokens, .max_model_len = w->o->max_model_len,
        .block_size = w->o->block_size, .n_blocks = { w->fwd->n_blocks[0], w->fwd->n_blocks[1] },
        .world_size = w->o->world_size, .mock = w->o->mock,
    };
    struct group_shape *all;
    int n = w->o->world_size, r;

    if (n == 1)
        return 0;
    all = calloc((size_t)n, sizeof(*all));
    if (!all)
        return err_set(e, -ENOMEM, "out of memory");
    /* this is also the "everyone has loaded" barrier: ranks load at different speeds, so
     * it runs under the load deadline, not the per-collective one */
    int saved = w->comm->timeout_msec;

    w->comm->timeout_msec = w->o->load_timeout_msec;
    r = comm_allgather(w->comm, &mine, all, sizeof(mine));
    w->comm->timeout_msec = saved;
    if (r < 0) {
        r = err_set(e, r, "exchanging the group's shapes: %s", comm_last_error(w->comm));
        goto out;
    }
    for (int k = 0; k < n; k++) {
        const int32_t *a = (const int32_t *)&all[0], *b = (const int32_t *)&all[k];

        for (size_t f = 0; f < ARRAY_SIZE(names); f++)
            if (a[f] != b[f]) {
                r = err_set(e, -EINVAL, "rank %d runs with %s %d, rank 0 with %d: every rank of "
                            "a group needs the same model and sizes", k, names[f], b[f], a[f]);
                goto out;
            }
    }
out:
    free(all);
    return r;
}

/* ---- re-forming the group --------------------------------------------------------- */

/* Not an exit status: the rank leaves its group and registers again (regroup). */
#define WORKER_REGROUP 100

/* rank 0 serving: SIGTERM/SIGINT stop the serve loop (run_serve) */
static volatile sig_atomic_t stop_requested;

static void on_stop_signal(int sig)
{
    stop_requested = 1;
}

/* a rank waiting for its group to re-form has nothing in flight: a stop ends it at once */
static void on_stop_exit(int sig)
{
    _exit(WORKER_EXIT_OK);
}

/* A rank registered with a coordinator outlives its group: when a peer is lost (its
 * collectives fail) or the coordinator tells the group to re-form, it keeps its weights,
 * registers afresh and joins the group's next epoch, so that only the lost rank is
 * restarted.  Not for CUDA groups (the NCCL communicator is not rebuilt) nor the offline
 * drivers. */
static bool can_regroup(const struct worker *w)
{
    const struct worker_opts *o = w->o;

    return o->coordinator && w->ctl && !w->dcomm && !o->generate_file && !o->logits_file &&
           !stop_requested;
}

/* The status of a collective failure: re-form the group when the rank can, else exit 4. */
static int comm_failed_rc(const struct worker *w)
{
    return can_regroup(w) ? WORKER_REGROUP : WORKER_EXIT_COMM;
}

/* Leave the group and join its next epoch: a new communicator and control session, the
 * rendezvous, then what a freshly started rank does with the group after its load (the KV
 * pool agreement, offering the blocks this rank holds, and the shape check), without
 * loading again.  An exit status on failure. */
static int regroup(struct worker *w)
{
    const struct worker_opts *o = w->o;
    struct err_buf e = { "" };
    int r;

    signal(SIGTERM, on_stop_exit);
    signal(SIGINT, on_stop_exit);
    if (stop_requested)
        return WORKER_EXIT_OK;
    log_notice("group %s: leaving the group (%s); registering again with the weights kept",
               o->group, w->comm->error ? comm_last_error(w->comm) : "told to re-form");
    worker_health_phase(w->health, WORKER_PHASE_RENDEZVOUS, "re-forming: group %s rank %d of %d",
                        o->group, o->rank, o->world_size);
    comm_abort(w->comm);            /* the live peers learn it at once */
    worker_ctl_free(w->ctl);        /* joins the control thread, whose hook holds w->comm */
    w->ctl = NULL;
    comm_free(w->comm);
    w->comm = NULL;
    r = stage_comm(w, &e);
    if (r < 0) {
        log_error("%s", e.msg);
        worker_health_phase(w->health, WORKER_PHASE_FAILED, "rendezvous failed: %s", e.msg);
        return WORKER_EXIT_RENDEZVOUS;
    }
    worker_ctl_report(w->ctl, 1, 0.0f, "re-forming (weights kept)", NULL);
    worker_health_phase(w->health, WORKER_PHASE_LOADING, "re-forming: group %s rank %d of %d, "
                        "waiting for the other ranks", o->group, o->rank, o->world_size);
    if (!o->mock) {
        int32_t v[2] = { w->fwd->n_blocks[0], w->fwd->n_blocks[1] };

        r = group_min2(w, v, &e);
        for (int g = 0; r == 0 && g < 2; g++)
            if (v[g] >= 0 && v[g] < w->fwd->n_blocks[g]) {
                log_warn("group %s: another rank holds %d KV blocks in pool %d, this one %d: using "
                         "%d", o->group, v[g], g, w->fwd->n_blocks[g], v[g]);
                w->fwd->n_blocks[g] = v[g];
            }
    }
    if (r == 0)
        r = check_group_shape(w, &e);
    if (r < 0) {
        log_error("%s", e.msg);
        worker_ctl_report(w->ctl, 3, 0.0f, e.msg, NULL);
        worker_health_phase(w->health, WORKER_PHASE_FAILED, "group shape: %s", e.msg);
        /* a lost peer or a shape the flags got wrong: asked before comm_abort, which sets
         * the comm's error either way */
        r = w->comm->error ? WORKER_EXIT_COMM : WORKER_EXIT_USAGE;
        comm_abort(w->comm);
        return r;
    }
    limits_init(w);
    log_notice("group %s: rank %d joined the group again", o->group, o->rank);
    return WORKER_EXIT_OK;
}

/* ---- ranks 1..N-1 ------------------------------------------------------------------- */

static int follower_loop(struct worker *w)
{
    struct step_plan_buf pb;
    struct err_buf e = { "" };
    void *scratch = malloc(w->plan_cap);
    float *logits = calloc((size_t)w->logit_rows * (size_t)w->vocab, sizeof(float));
    int32_t *ids = calloc((size_t)w->logit_rows, sizeof(int32_t));
    uint64_t steps = 0;
    int kind, r, rc = WORKER_EXIT_OK;

    step_plan_buf_init(&pb);
    if (!scratch || !logits || !ids) {
        log_error("out of memory for the plan buffer");
        rc = WORKER_EXIT_FAILURE;
        goto out;
    }
    for (;;) {
        /* wait without a deadline between steps: an idle group is not a failure; a dead
         * rank 0 is still detected by the peer error handler */
        int saved = w->comm->timeout_msec;

        w->comm->timeout_msec = 0;
        worker_health_wait(w->health, true);
        r = comm_plan_recv(w->comm, scratch, w->plan_cap, &w->lim, &pb, &kind, &e);
        worker_health_wait(w->health, false);
        w->comm->timeout_msec = saved;
        if (r < 0) {
            log_error("after %llu steps: %s", (unsigned long long)steps, e.msg);
            rc = w->comm->error ? comm_failed_rc(w) : WORKER_EXIT_FAILURE;
            comm_abort(w->comm);
            goto out;
        }
        if (kind == PLAN_MSG_STOP) {
            log_info("stop after %llu steps", (unsigned long long)steps);
            comm_barrier(w->comm);
            break;
        }
        r = worker_follow_step(w->fwd, &pb.plan, logits, ids);
        if (r < 0) {
            log_error("step %llu failed: %s", (unsigned long long)pb.plan.step_id,
                      w->comm->error ? comm_last_error(w->comm) : err_str(r));
            rc = w->comm->error ? comm_failed_rc(w) : WORKER_EXIT_FAILURE;
            comm_abort(w->comm);
            goto out;
        }
        steps++;
        worker_health_beat(w->health);
    }
out:
    step_plan_buf_done(&pb);
    free(scratch);
    free(logits);
    free(ids);
    return rc;
}

/* ---- rank 0 drivers ----------------------------------------------------------------- */

/* The engine's waiting queue: --max-waiting, or by default the full-attention KV pool's
 * block count (every waiting request needs a block to start, so a longer queue could never
 * be admitted at once), within [64, 4096]. */
static int waiting_limit(const struct worker *w)
{
    int n = w->fwd->n_blocks[KV_GROUP_FULL];

    if (w->o->max_waiting > 0)
        return w->o->max_waiting;
    return n < 64 ? 64 : n > 4096 ? 4096 : n;
}

struct gen_req {
    int32_t *out;
    int n_out, cap;
    bool finished;
    enum engine_finish finish;
    char message[256];
};

static void gen_cb(void *ud, const struct engine_output *out)
{
    struct gen_req *g = ud;

    if (out->n_tokens > 0) {
        if (g->n_out + out->n_tokens > g->cap) {
            int cap = (g->n_out + out->n_tokens) * 2;
            int32_t *p = realloc(g->out, sizeof(int32_t) * (size_t)cap);

            if (!p)
                return;
            g->out = p;
            g->cap = cap;
        }
        memcpy(g->out + g->n_out, out->tokens, sizeof(int32_t) * (size_t)out->n_tokens);
        g->n_out += out->n_tokens;
    }
    if (out->finished) {
        g->finished = true;
        g->finish = out->finish;
        snprintf(g->message, sizeof(g->message), "%s", out->message ? out->message : "");
    }
}

static void describe_failure(void *ctx, int rc, char *buf, size_t len);

/* The engine's configuration from the options, the only place it is filled (the offline
 * drivers and the served engine run the same engine). */
static void engine_config_fill(struct worker *w, struct engine_config *cfg)
{
    const struct worker_opts *o = w->o;

    engine_config_init(cfg);
    cfg->max_num_batched_tokens = o->max_batched_tokens;
    cfg->max_num_seqs = o->max_seqs;
    cfg->max_model_len = o->max_model_len;
    cfg->sliding_window = w->sliding_window;
    cfg->num_speculative_tokens = spec_config_k(&o->spec, w->n_mtp);
    cfg->max_waiting = waiting_limit(w);
    cfg->logprobs_processed = o->logprobs_processed;
    cfg->spec_policy = o->spec.draft_policy;
    cfg->draft_vocab = o->spec.draft_vocab;
    memcpy(cfg->eos_ids, w->eos, sizeof(w->eos));
    cfg->n_eos = w->n_eos;
    cfg->enable_prefix_caching = !o->no_prefix_cache;
    cfg->prefix_cache_salt = o->prefix_cache_salt;
    cfg->describe_failure = describe_failure;
    cfg->describe_failure_ctx = w;
    cfg->vision = w->ev.encode ? &w->ev : NULL;
}

static int step_delay_hook(void *ctx, const struct step_plan *p)
{
    const struct worker_opts *o = ctx;
    struct timespec ts = { o->step_delay_msec / 1000, (long)(o->step_delay_msec % 1000) * 1000000L };

    if (p)
        nanosleep(&ts, NULL);
    return 0;
}

static int run_generate(struct worker *w, struct forward *f)
{
    const struct worker_opts *o = w->o;
    struct engine_config cfg;
    struct engine *eng = NULL;
    struct err_buf e = { "" };
    struct gen_req *reqs = NULL;
    char line[65536];
    int n_req = 0, r, rc = WORKER_EXIT_OK;
    FILE *in = fopen(o->generate_file, "r"), *out = stdout;

    if (!in) {
        log_error("--generate %s: %s", o->generate_file, strerror(errno));
        return WORKER_EXIT_USAGE;
    }
    engine_config_fill(w, &cfg);
    if (o->step_delay_msec > 0) {
        cfg.on_plan = step_delay_hook;
        cfg.on_plan_ctx = (void *)o;
    }
    r = engine_new(f, &cfg, &eng, &e);
    if (r < 0) {
        log_error("engine: %s", e.msg);
        rc = WORKER_EXIT_FAILURE;
        goto out;
    }
    /* read every prompt first so that reqs[] never moves once callbacks hold it */
    int32_t **prompts = NULL;
    int *lens = NULL;
    while (fgets(line, sizeof(line), in)) {
        int32_t *ids, **pp;
        int n, *ll;

        if (line[0] == '\n' || line[0] == '#')
            continue;
        if (cli_parse_ids("--generate", line, w->vocab, &ids, &n, &e) < 0) {
            log_error("%s: request %d of %s", e.msg, n_req, o->generate_file);
            rc = WORKER_EXIT_USAGE;
            goto out_prompts;
        }
        pp = realloc(prompts, sizeof(*pp) * (size_t)(n_req + 1));
        ll = realloc(lens, sizeof(*ll) * (size_t)(n_req + 1));
        if (pp)
            prompts = pp;
        if (ll)
            lens = ll;
        if (!pp || !ll) {
            free(ids);
            rc = WORKER_EXIT_FAILURE;
            goto out_prompts;
        }
        prompts[n_req] = ids;
        lens[n_req++] = n;
    }
    reqs = calloc((size_t)n_req + 1, sizeof(*reqs));
    if (!reqs) {
        rc = WORKER_EXIT_FAILURE;
        goto out_prompts;
    }
    for (int i = 0; i < n_req; i++) {
        struct engine_request rq;
        char id[32];

        engine_request_init(&rq);
        snprintf(id, sizeof(id), "req-%d", i);
        rq.id = id;
        rq.prompt = prompts[i];
        rq.n_prompt = lens[i];
        rq.max_tokens = o->max_tokens;
        rq.ignore_eos = true;
        rq.num_speculative_tokens = cfg.num_speculative_tokens;
        r = engine_submit(eng, &rq, gen_cb, &reqs[i], &e);
        if (r < 0) {
            log_error("request %d: %s", i, e.msg);
            rc = WORKER_EXIT_FAILURE;
            goto out_prompts;
        }
    }
    for (int i = 0; i < n_req; i++)
        free(prompts[i]);
    free(prompts);
    free(lens);
    prompts = NULL;
    lens = NULL;
    r = engine_run_until_idle(eng);
    if (r < 0)
        log_error("generation failed: %s", w->comm->error ? comm_last_error(w->comm) : err_str(r));
    if (o->output_file) {
        out = fopen(o->output_file, "w");
        if (!out) {
            log_error("%s: %s", o->output_file, strerror(errno));
            out = stdout;
        }
    }
    for (int i = 0; i < n_req; i++) {
        struct gen_req *g = &reqs[i];

        fprintf(out, "%d finish=%s n=%d ids=", i,
                g->finished ? engine_finish_name(g->finish) : "unfinished", g->n_out);
        for (int k = 0; k < g->n_out; k++)
            fprintf(out, "%s%d", k ? "," : "", g->out[k]);
        if (g->message[0])
            fprintf(out, " message=\"%s\"", g->message);
        fputc('\n', out);
        if (!g->finished || g->finish == ENGINE_FINISH_ERROR)
            rc = w->comm->error ? WORKER_EXIT_COMM : WORKER_EXIT_FAILURE;
    }
    if (out != stdout)
        fclose(out);
    else
        fflush(out);
    if (r < 0 && rc == WORKER_EXIT_OK)
        rc = w->comm->error ? WORKER_EXIT_COMM : WORKER_EXIT_FAILURE;
out_prompts:
    if (prompts) {
        for (int i = 0; i < n_req; i++)
            free(prompts[i]);
        free(prompts);
        free(lens);
    }
out:
    engine_free(eng);
    if (reqs)
        for (int i = 0; i < n_req; i++)
            free(reqs[i].out);
    free(reqs);
    fclose(in);
    return rc;
}

/* One prefill step of a single sequence; every position's logits to a raw FP32 file. */
static int run_dump_logits(struct worker *w, struct forward *f)
{
    const struct worker_opts *o = w->o;
    int32_t *ids = NULL, *table = NULL;
    float *logits = NULL;
    int n = 0, nb, rc = WORKER_EXIT_FAILURE, r;
    struct err_buf e;
    FILE *out;

    if (cli_parse_ids("--prompt-ids", o->prompt_ids ? o->prompt_ids : "", w->vocab, &ids, &n, &e) < 0) {
        log_error("%s", e.msg);
        return WORKER_EXIT_USAGE;
    }
    if (n > w->logit_rows || n > o->max_model_len) {
        log_error("--prompt-ids: %d tokens, more than --max-batched-tokens %d", n, w->logit_rows);
        free(ids);
        return WORKER_EXIT_USAGE;
    }
    nb = (n + o->block_size - 1) / o->block_size;
    table = calloc((size_t)nb, sizeof(int32_t));
    logits = calloc((size_t)n * (size_t)w->vocab, sizeof(float));
    if (!table || !logits)
        goto out;
    for (int b = 0; b < nb; b++)
        table[b] = b;
    struct step_seq s = { .slot = 0, .pos0 = 0, .n_tokens = n, .n_logits = n, .tok_off = 0,
                          .n_blocks = nb, .block_off = { 0, 0 } };
    struct step_plan p = { .step_id = 1, .n_seqs = 1, .n_tokens = n, .seqs = &s, .tokens = ids,
                           .n_block_ids = { nb, nb }, .blocks = { table, table } };
    r = f->ops->step(f, &p, logits);
    if (r < 0) {
        log_error("prefill step failed: %s", w->comm->error ? comm_last_error(w->comm) : err_str(r));
        rc = w->comm->error ? WORKER_EXIT_COMM : WORKER_EXIT_FAILURE;
        goto out;
    }
    out = fopen(o->logits_file, "wb");
    if (!out || fwrite(logits, sizeof(float), (size_t)n * (size_t)w->vocab, out) !=
                    (size_t)n * (size_t)w->vocab) {
        log_error("%s: cannot write", o->logits_file);
        if (out)
            fclose(out);
        goto out;
    }
    fclose(out);
    rc = WORKER_EXIT_OK;
out:
    free(ids);
    free(table);
    free(logits);
    return rc;
}

/* Serve stepd.v1.Engine until the coordinator ends the session, the engine fails (a
 * collective failed: exit 4, or the group re-forms) or SIGTERM/SIGINT. */

/* engine_config.describe_failure: a failed step names the group, this rank and what the
 * communicator says (which peer was lost, in which collective). */
static void describe_failure(void *ctx, int rc, char *buf, size_t len)
{
    const struct worker *w = ctx;

    if (w->comm && w->comm->error)
        snprintf(buf, len, "worker group %s (rank %d): %s", w->o->group, w->o->rank,
                 comm_last_error(w->comm));
    else
        snprintf(buf, len, "worker group %s (rank %d): %s", w->o->group, w->o->rank, err_str(rc));
}

static int run_serve(struct worker *w, struct forward *f)
{
    struct engine_config cfg;
    struct engine *eng = NULL;
    struct engine_rpc *rpc = NULL;
    struct err_buf e = { "" };
    struct engine_loads ld;
    int r, port = 0, rc = WORKER_EXIT_OK;

    engine_config_fill(w, &cfg);
    /* structured output reads the model's tokenizer at the first constrained request */
    char tokjson[4096];
    if (w->o->model_dir && snprintf(tokjson, sizeof(tokjson), "%s/tokenizer.json",
                                    w->o->model_dir) < (int) sizeof(tokjson))
        cfg.grammar_tokenizer = tokjson;
    r = engine_new(f, &cfg, &eng, &e);
    if (r < 0) {
        log_error("engine: %s", e.msg);
        return WORKER_EXIT_FAILURE;
    }
    r = engine_start(eng);
    if (r < 0) {
        engine_free(eng);
        return WORKER_EXIT_FAILURE;
    }
    struct engine_rpc_opts ro = {
        .addr = w->o->engine_listen, .group = w->o->group, .api_key = w->o->control_key,
        .model_name = w->o->model_dir ? w->o->model_dir : "mock",
        .model_type = w->mc ? "step3p7" : "mock", .quantization = w->mc ? "mxfp4" : "",
        .num_layers = w->mc ? w->mc->n_layers : 0, .hidden_size = w->mc ? w->mc->hidden_size : 0,
        .num_experts = w->mc ? w->mc->n_experts : 0,
        .num_experts_per_tok = w->mc ? w->mc->top_k : 0,
        /* a request's images travel as their views' RGB (a 728x728 global view is 1.6 MB, a
         * 504x504 crop 0.76 MB): the coordinator's limits (--limit-mm-per-prompt, at most 16
         * images of at most 36 crops by default) stay under this */
        .max_recv_msg_bytes = w->ev.encode ? WORKER_IMAGE_MAX_MSG : 0,
    };
    r = engine_rpc_start(eng, &ro, &rpc, &port, &e);
    if (r < 0) {
        log_error("engine service on %s: %s", w->o->engine_listen, e.msg);
        if (w->ctl)
            worker_ctl_report(w->ctl, 3, 0.0f, e.msg, NULL);
        engine_free(eng);
        return WORKER_EXIT_FAILURE;
    }
    engine_get_loads(eng, &ld);
    if (w->ctl) {
        struct worker_ctl_engine ce = { .kv_blocks_total = ld.kv_blocks_total,
                                        .max_num_seqs = ld.max_num_seqs, .max_waiting = ld.max_waiting };

        worker_ctl_report(w->ctl, 2, 1.0f, "ready", &ce);
    }
    log_notice("rank 0 ready: stepd.v1.Engine on %s (port %d), %d KV blocks, group of %d, "
               "capacity %d requests (%d running + %d waiting)", w->o->engine_listen, port,
               ld.kv_blocks_total, w->o->world_size, ld.max_num_seqs + ld.max_waiting,
               ld.max_num_seqs, ld.max_waiting);
    worker_health_phase(w->health, WORKER_PHASE_READY, "ready: group %s of %d, engine on %s, %d KV blocks",
                        w->o->group, w->o->world_size, w->o->engine_listen, ld.kv_blocks_total);
    signal(SIGTERM, on_stop_signal);
    signal(SIGINT, on_stop_signal);
    uint64_t last_steps = ld.n_steps;
    int64_t last_step_ms = clk_now_ms();
    unsigned lost = 0, n_lost = 0;     /* control sessions lost (none without a coordinator) */
    while (!stop_requested) {
        usleep(20 * 1000);
        engine_get_loads(eng, &ld);
        /* the idle loop beats while the engine is idle or its steps advance: an engine with
         * work whose step count stands still is stuck, and the watchdog must see it */
        int64_t now = clk_now_ms();
        if (ld.n_steps != last_steps || ld.n_alive == 0) {
            last_steps = ld.n_steps;
            last_step_ms = now;
        }
        if (now - last_step_ms < WORKER_HEALTH_STEP_STALL_MS)
            worker_health_beat(w->health);
        if (ld.last_error) {
            log_error("engine stopped: %s", w->comm->error ? comm_last_error(w->comm)
                                                           : err_str(ld.last_error));
            rc = w->comm->error ? comm_failed_rc(w) : WORKER_EXIT_FAILURE;
            break;
        }
        r = w->ctl ? worker_ctl_poll(w->ctl, &n_lost, &e) : 0;
        if (r == 2 && can_regroup(w)) {
            /* what the group had in flight cannot finish: the rank leaves the group */
            char msg[600];

            snprintf(msg, sizeof(msg), "worker group %s re-forms: %s", w->o->group, e.msg);
            engine_rpc_fail_all(rpc, msg);
            rc = WORKER_REGROUP;
            break;
        }
        if (r > 0) {
            log_notice("control session ended: %s", e.msg);
            rc = r == 2 && !stop_requested ? WORKER_EXIT_RENDEZVOUS : rc;
            break;
        }
        if (n_lost != lost) {
            /* the coordinator is gone: what it sent cannot be delivered; the group stays */
            lost = n_lost;
            engine_rpc_fail_all(rpc, "the control session with the coordinator was lost");
        }
    }
    worker_health_phase(w->health, WORKER_PHASE_STOPPING, "stopping: %s",
                        stop_requested ? "signal" : rc ? "engine failed" : "control session ended");
    engine_rpc_stop(rpc);
    engine_free(eng);
    return rc;
}

/* A stage after the rendezvous failed (msg logged by the caller): reported to stepctl and
 * the health endpoint as failed ("<what>: msg"), the group aborted (the others are waiting
 * for this rank in a collective: they see a peer failure at once rather than their
 * deadline).  Returns the exit code: WORKER_EXIT_COMM when a peer was already lost (a
 * collective failure), else code. */
static int stage_failed(struct worker *w, const char *what, const char *msg, int code)
{
    if (w->ctl)
        worker_ctl_report(w->ctl, 3, 0.0f, msg, NULL);
    worker_health_phase(w->health, WORKER_PHASE_FAILED, "%s: %s", what, msg);
    if (w->comm->error)
        code = WORKER_EXIT_COMM;
    comm_abort(w->comm);
    return code;
}

int worker_run(const struct worker_opts *o)
{
    struct worker w = { .o = o };
    struct err_buf e = { "" };
    int rc = WORKER_EXIT_FAILURE, r;

    if (!group_name_ok(o->group)) {
        log_error("--group '%s': 1 to 64 of [A-Za-z0-9._-]", o->group);
        return WORKER_EXIT_USAGE;
    }
    if (o->world_size != 1 && o->world_size != 2 && o->world_size != 4 && o->world_size != 8) {
        log_error("--world-size %d: must be 1, 2, 4 or 8", o->world_size);
        return WORKER_EXIT_USAGE;
    }
    if (o->rank < 0 || o->rank >= o->world_size) {
        log_error("--rank %d: must be in [0, %d)", o->rank, o->world_size);
        return WORKER_EXIT_USAGE;
    }
    if (o->world_size > 1 && !o->coordinator && !o->rendezvous_dir) {
        log_error("world size %d needs --coordinator ADDR or --rendezvous-dir DIR", o->world_size);
        return WORKER_EXIT_USAGE;
    }
    if (!o->mock && !o->model_dir) {
        log_error("--model DIR is required (or --mock)");
        return WORKER_EXIT_USAGE;
    }
    /* the cluster key guards both ends of the control session and rank 0's engine: a rank
     * that registers or serves needs it (a follower of a file rendezvous serves nothing) */
    bool serves = o->rank == 0 && !o->generate_file && !o->logits_file;
    if ((o->coordinator || serves) && !(o->control_key && o->control_key[0])) {
        if (!o->insecure_control) {
            log_error("no control key: the %s would be unauthenticated; give --control-key-file "
                      "FILE (or $STEPD_CONTROL_KEY), the coordinator's cluster key, or "
                      "--insecure-control", serves ? "engine service" : "control session");
            return WORKER_EXIT_USAGE;
        }
        log_warn("no control key (--insecure-control): %s", serves ? "the engine service accepts "
                 "any caller that reaches it" : "registering without authentication");
    }
    if (serves && !net_addr_is_loopback(o->engine_listen)) {
        /* E2: off loopback the engine needs the cluster key, as the control port does (it
         * is plaintext either way: a private network) */
        if (!(o->control_key && o->control_key[0]) && !o->insecure_listen) {
            log_error("refusing to serve the engine on non-loopback %s without the control key "
                      "(--control-key-file) or --insecure-listen", o->engine_listen);
            return WORKER_EXIT_USAGE;
        }
        if (!(o->control_key && o->control_key[0]))
            log_warn("engine service on non-loopback %s without authentication (--insecure-listen)",
                     o->engine_listen);
    }
    if (o->max_seqs < 1 || o->max_batched_tokens < 4 || o->max_model_len < 2 || o->block_size < 1) {
        log_error("--max-seqs, --max-batched-tokens, --max-model-len or --block-size out of range");
        return WORKER_EXIT_USAGE;
    }

    r = worker_health_start(o->health_listen, &w.health, &e);
    if (r < 0) {
        log_error("%s", e.msg);
        return WORKER_EXIT_USAGE;
    }
    worker_health_phase(w.health, WORKER_PHASE_RENDEZVOUS, "rendezvous: group %s rank %d of %d",
                        o->group, o->rank, o->world_size);
    r = stage_comm(&w, &e);
    if (r < 0) {
        log_error("%s", e.msg);
        worker_health_phase(w.health, WORKER_PHASE_FAILED, "rendezvous failed: %s", e.msg);
        rc = WORKER_EXIT_RENDEZVOUS;
        goto out;
    }
    if (w.ctl)
        worker_ctl_report(w.ctl, 1, 0.0f, "loading", NULL);
    worker_health_phase(w.health, WORKER_PHASE_LOADING, "loading: group %s rank %d of %d, %s",
                        o->group, o->rank, o->world_size, o->mock ? "mock forward" : o->model_dir);
    struct rss before;
    struct load_watch_opts lwo = { .report = load_report, .ctx = &w };
    int64_t load_ms, t_load = clk_now_ms();

    rss_read(&before);
    r = load_watch_start(&lwo, &w.lw);
    if (r < 0)
        log_warn("no load progress reports: %s", err_str(r));
    r = stage_load(&w, &e);
    load_watch_stop(w.lw);
    w.lw = NULL;
    load_ms = clk_now_ms() - t_load;
    if (r < 0) {
        log_error("load: %s", e.msg);
        rc = stage_failed(&w, "load failed", e.msg, WORKER_EXIT_FAILURE);
        goto out;
    }
    limits_init(&w);
    report_memory(&w, &before, load_ms);
    r = check_group_shape(&w, &e);
    if (r < 0) {
        log_error("%s", e.msg);
        rc = stage_failed(&w, "group shape", e.msg, WORKER_EXIT_USAGE);
        goto out;
    }

    for (;;) {
        if (o->rank > 0) {
            if (w.ctl)
                worker_ctl_report(w.ctl, 2, 1.0f, "ready", NULL);
            worker_health_phase(w.health, WORKER_PHASE_READY, "ready: group %s rank %d of %d, "
                                "following rank 0", o->group, o->rank, o->world_size);
            rc = follower_loop(&w);
            if (rc != WORKER_REGROUP)
                worker_health_phase(w.health, WORKER_PHASE_STOPPING, "stopping: %s",
                                    rc ? "step failed" : "stop from rank 0");
        } else {
            struct forward *f = w.fwd;

            if (o->world_size > 1) {
                r = worker_bcast_forward_new(w.fwd, w.comm, w.plan_cap, &w.lock);
                if (r < 0) {
                    log_error("out of memory");
                    goto out;
                }
                f = w.lock;
            }
            if (o->logits_file)
                rc = run_dump_logits(&w, f);
            else if (o->generate_file)
                rc = run_generate(&w, f);
            else
                rc = run_serve(&w, f);
        }
        if (rc != WORKER_REGROUP)
            break;
        if (w.lock)
            w.lock->ops->free(w.lock);
        w.lock = NULL;
        if ((rc = regroup(&w)) != WORKER_EXIT_OK)
            goto out;
    }
    if (o->rank > 0)
        goto out;
    if (o->world_size > 1 && !w.comm->error) {
        void *buf = malloc(w.plan_cap);

        if (buf && comm_plan_send_stop(w.comm, buf, w.plan_cap) == 0)
            comm_barrier(w.comm);
        free(buf);
    }
out:
    if (w.comm && w.comm->error && rc == WORKER_EXIT_OK)
        rc = WORKER_EXIT_COMM;
    /* the control thread's abort hook points at w.comm (a GroupAbort may arrive while this
     * rank stops): the thread is joined before the comm is freed (RELIABILITY.md 1.4) */
    worker_ctl_free(w.ctl);
    w.ctl = NULL;
    if (w.lock)
        w.lock->ops->free(w.lock);
    if (w.fwd)
        w.fwd->ops->free(w.fwd);
    vision_free(w.vision);
    ckpt_close(w.ck);
    comm_free(w.dcomm);         /* its code and stream are the CUDA plugin's */
    if (w.be)
        backend_free(w.be);
    comm_free(w.comm);
    worker_health_stop(w.health);
    return rc;
}
