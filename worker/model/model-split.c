/* model-split.c - a CPU step as per-core parts, and MTP layers as per-core halves.
 *
 * On a 2-thread CPU backend (backend_split_run) a step of several sequences (or one long
 * enough run) is cut in two and each half runs all its layers on one core, with its own
 * activations; steps of at most MODEL_COOP_MAX_TOKENS compute dense MLPs with both cores.
 * The MTP draft layers instead run as two halves (heads, MLP units, eh_proj rows), one per
 * core, exchanging three partial results per layer.  Outputs of split steps are bit for
 * bit those of the whole step (test/model/test-model-split.c); MTP halves differ from the
 * whole layer only in the order of some fp32 sums.  The script (model.c) sees a part only
 * through its struct batch_hooks.  Calls the script and model-load.c's weight views.
 */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "model-int.h"
#include "mxfp4.h"

/* smallest trunk step that runs as per-core parts (see split steps, before model_step) */
#define MODEL_SPLIT_MIN_TOKENS 4
/* split steps of at most this many tokens run their parts at once, and dense MLPs with
 * both cores (struct split_coop); measured on the tiny model's layer-0 MLP (768 x 256,
 * BF16): 4 tokens 33 us vs 43.5 us each part alone, 16 tokens 57 vs 52 us (the exchanges
 * grow with the tokens, the weights do not) */
#define MODEL_COOP_MAX_TOKENS 4

/* A split step's parts when the cut falls inside a run: part 1's first queries attend to
 * keys part 0 writes, layer by layer.  Part 0 counts the layers whose KV it has stored;
 * part 1 waits for the count before each attention.  Part 0 never waits (causal), so a
 * late core, or one thread running both parts in turn, cannot deadlock. */
struct split_sync {
    _Atomic int kv_layers;          /* layers whose KV part 0 has stored */
    _Atomic int failed;             /* part 0 stopped early: part 1 gives up */
    int seen;                       /* part 1: attentions passed */
};

/* The parts of a split step run at the same time: a dense MLP is then computed by both
 * cores, each for half of its weights' rows and every token of the step (part_dense_mlp),
 * instead of each core streaming all of the MLP's weights for its own tokens.  Each
 * output element stays one core's dot product, in the kernel's order, so the step's
 * outputs are still bit for bit those of the whole batch.  The parts exchange the MLP's
 * inputs, activation halves and output halves through x, act and out, each exchange
 * behind a barrier (a counter that only grows: part p's c-th wait passes at 2c).  A part
 * that fails marks `failed`, and the other gives up at its next wait. */
struct split_coop {
    float *x, *act, *out;           /* [n_tok, H], [n_tok, inter], [n_tok, H] */
    int n_tok;
    _Atomic int arrive, failed;
    int count[2];                   /* waits passed, per part */
    int n_mlps;                     /* part_dense_mlp calls (part 0) */
};

/* ------------------------------------------- MTP layers across the cores -- */

/* Rows [r0, r1) of w as a weight of its own: the same memory, prepared anew. */
static int slice_rows(struct model *m, const struct bweight *w, int64_t r0, int64_t r1,
                      struct bweight *out, struct err_buf *e)
{
    if (model__row_view(w, r0, r1, out) < 0)
        return err_set(e, -EINVAL, "MTP split: weight format %d", (int)w->fmt);
    return model__prepare(m, out, "MTP layer half (rows)", e);
}

/* Columns [c0, c1) of w (multiples of 32) copied into a weight of its own. */
static int slice_cols(struct model *m, const struct bweight *w, int64_t c0, int64_t c1,
                      struct bweight *out, struct err_buf *e)
{
    const int64_t rows = w->rows, nc = c1 - c0;
    size_t esz = w->fmt == WFMT_BF16 ? 2 : 4, bytes;
    uint8_t *buf;
    int r;

    memset(out, 0, sizeof(*out));
    out->fmt = w->fmt;
    out->rows = rows;
    out->cols = nc;
    if (w->fmt != WFMT_BF16 && w->fmt != WFMT_F32 && w->fmt != WFMT_MXFP4)
        return err_set(e, -EINVAL, "MTP split: weight format %d", (int)w->fmt);
    bytes = w->fmt == WFMT_MXFP4 ? (size_t)(rows * (nc / 2 + nc / MXFP4_GROUP))
                                  : (size_t)(rows * nc) * esz;
    buf = malloc(bytes ? bytes : 1);
    if (!buf)
        return err_set(e, -ENOMEM, "MTP split: out of memory");
    for (int64_t i = 0; i < rows; i++) {
        if (w->fmt == WFMT_MXFP4) {
            memcpy(buf + i * (nc / 2), (const uint8_t *)w->data + i * (w->cols / 2) + c0 / 2,
                   (size_t)(nc / 2));
            memcpy(buf + rows * (nc / 2) + i * (nc / MXFP4_GROUP),
                   w->scale + i * (w->cols / MXFP4_GROUP) + c0 / MXFP4_GROUP,
                   (size_t)(nc / MXFP4_GROUP));
        } else {
            memcpy(buf + (size_t)(i * nc) * esz,
                   (const uint8_t *)w->data + (size_t)(i * w->cols + c0) * esz, (size_t)nc * esz);
        }
    }
    r = model__own(m, buf);
    if (r < 0) {
        free(buf);
        return err_set(e, r, "out of memory");
    }
    out->data = buf;
    if (w->fmt == WFMT_MXFP4)
        out->scale = buf + rows * (nc / 2);
    return model__prepare(m, out, "MTP layer half (columns)", e);
}

/* On a 2-part backend, every MTP layer as two halves for mtp_tp_run: half p has query heads
 * [p*nh/2, ...) with their KV heads and gate rows, the matching columns of o_proj, MLP
 * units [p*I/2, ...) (gate/up rows, down columns) and eh_proj rows [p*H/2, ...).  Dense MTP
 * layers with even head counts and 32-aligned halves only; else the layers run whole. */
int model__build_mtp_tp(struct model *m, struct err_buf *e)
{
    const int H = m->hidden;
    int r;

    if (m->sharded || backend_split_width(m->be) < 2 || m->n_mtp <= 0 || m->o.no_mtp_tp ||
        H % 64 || m->vocab % 2)
        return 0;
    for (int k = 0; k < m->n_mtp; k++) {
        const struct mlayer *L = &m->layers[m->n_layers + k];
        if (L->is_moe || !L->has_ffn_dense || L->n_heads % 2 || L->n_kv_heads % 2 ||
            (L->n_heads / 2 * L->head_dim) % MXFP4_GROUP || L->inter % (2 * MXFP4_GROUP) ||
            !L->eh_e.data)
            return 0;
    }
    m->tp_half = calloc(2 * (size_t)m->n_mtp, sizeof(*m->tp_half));
    if (!m->tp_half)
        return err_set(e, -ENOMEM, "out of memory");
    for (int k = 0; k < m->n_mtp; k++) {
        const struct mlayer *L = &m->layers[m->n_layers + k];
        for (int p = 0; p < 2; p++) {
            struct mlayer *h = &m->tp_half[2 * k + p];
            const int hq = L->n_heads / 2 * L->head_dim, hkv = L->n_kv_heads / 2 * L->head_dim;
            const int hi = L->inter / 2;

            *h = *L;                /* norms, rope table, window, group: shared */
            h->n_heads = L->n_heads / 2;
            h->n_kv_heads = L->n_kv_heads / 2;
            h->inter = hi;
            h->is_mtp = false;      /* layer_forward reduces its partial sums (comm) */
            memset(&h->kv, 0, sizeof(h->kv));
            r = slice_rows(m, &L->wq, (int64_t)p * hq, (int64_t)(p + 1) * hq, &h->wq, e);
            r = r ? r : slice_rows(m, &L->wk, (int64_t)p * hkv, (int64_t)(p + 1) * hkv, &h->wk, e);
            r = r ? r : slice_rows(m, &L->wv, (int64_t)p * hkv, (int64_t)(p + 1) * hkv, &h->wv, e);
            if (!r && m->cfg->use_head_wise_attn_gate)
                r = slice_rows(m, &L->wg, (int64_t)p * h->n_heads, (int64_t)(p + 1) * h->n_heads,
                               &h->wg, e);
            r = r ? r : slice_cols(m, &L->wo, (int64_t)p * hq, (int64_t)(p + 1) * hq, &h->wo, e);
            r = r ? r : slice_rows(m, &L->gate, (int64_t)p * hi, (int64_t)(p + 1) * hi, &h->gate, e);
            r = r ? r : slice_rows(m, &L->up, (int64_t)p * hi, (int64_t)(p + 1) * hi, &h->up, e);
            r = r ? r : slice_cols(m, &L->down, (int64_t)p * hi, (int64_t)(p + 1) * hi, &h->down, e);
            r = r ? r : slice_rows(m, &L->eh_e, (int64_t)p * H / 2, (int64_t)(p + 1) * H / 2,
                                   &h->eh_e, e);
            r = r ? r : slice_rows(m, &L->eh_h, (int64_t)p * H / 2, (int64_t)(p + 1) * H / 2,
                                   &h->eh_h, e);
            r = r ? r : slice_rows(m, &L->head, (int64_t)p * (m->vocab / 2),
                                   (int64_t)(p + 1) * (m->vocab / 2), &h->head, e);
            if (r < 0)
                return r;
        }
    }
    m->mtp_tp = true;
    return 0;
}

/* Spin (pause; a sched_yield now and then) until *v >= want (acquire), or -ECANCELED once
 * *failed is set: the waits between the parts of a split step, which run on two cores. */
static int spin_until(_Atomic int *v, int want, _Atomic int *failed)
{
    for (unsigned i = 1; atomic_load_explicit(v, memory_order_acquire) < want; i++) {
        if (atomic_load_explicit(failed, memory_order_relaxed))
            return -ECANCELED;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
        if ((i & 1023) == 0)
            sched_yield();
    }
    return 0;
}

/* One part of a split step as layer_forward sees it (struct batch_hooks): the key
 * hand-off when the cut falls inside a run, and the shared dense MLPs of small steps. */
struct part_hooks {
    struct batch_hooks h;
    struct split_sync *sync;        /* NULL: no run is cut */
    int sync_role;                  /* 0 = writes the earlier keys, 1 = reads them */
    struct split_coop *coop;        /* NULL: the parts do not run at once */
    int coop_part, coop_t0;         /* this part, and its first token (row) in the step */
};

/* Part 0 of a step cut inside a run has stored a layer's KV. */
static void part_kv_stored(void *ctx)
{
    struct part_hooks *ph = ctx;

    if (ph->sync && ph->sync_role == 0)
        atomic_fetch_add_explicit(&ph->sync->kv_layers, 1, memory_order_release);
}

/* Part 1 of a step cut inside a run: wait until part 0 has stored this layer's KV. */
static int part_attention_wait(void *ctx)
{
    struct part_hooks *ph = ctx;
    struct split_sync *ss = ph->sync;

    if (!ss || ph->sync_role != 1)
        return 0;
    return spin_until(&ss->kv_layers, ++ss->seen, &ss->failed);
}

static int coop_wait(struct split_coop *c, int part)
{
    const int want = 2 * ++c->count[part];

    atomic_fetch_add_explicit(&c->arrive, 1, memory_order_acq_rel);
    return spin_until(&c->arrive, want, &c->failed);
}

/* The dense MLP of this part's n rows a[] into out[], computed with the other part
 * (struct split_coop): gate/up rows [p I/2, (p+1) I/2) and down rows [p H/2, (p+1) H/2)
 * for every token of the step.  Only where the halves' first rows are multiples of 32
 * (matmul_rows); else 0 and the part runs the MLP alone. */
static int part_dense_mlp(void *ctx, struct model *m, const struct mlayer *L, const float *a,
                          int n, float limit, float *out)
{
    struct part_hooks *ph = ctx;
    struct split_coop *c = ph->coop;
    const int p = ph->coop_part, H = m->hidden, I = L->inter;
    const int Ih = I / 2, Hh = H / 2;
    int N, r;

    if (!c || L->is_moe || I % 64 || H % 64)
        return 0;
    N = c->n_tok;
    memcpy(c->x + (size_t)ph->coop_t0 * H, a, sizeof(float) * (size_t)n * H);
    TRY(coop_wait(c, p));
    TRY(backend_matmul_rows(m->be, &L->gate, c->x, N, m->ff_gate, Ih, (int64_t)p * Ih, (int64_t)(p + 1) * Ih));
    TRY(backend_matmul_rows(m->be, &L->up, c->x, N, m->ff_up, Ih, (int64_t)p * Ih, (int64_t)(p + 1) * Ih));
    TRY(backend_swiglu(m->be, m->ff_gate, m->ff_up, N, Ih, limit, m->ff_act));
    for (int i = 0; i < N; i++)
        memcpy(c->act + (size_t)i * I + (size_t)p * Ih, m->ff_act + (size_t)i * Ih, sizeof(float) * Ih);
    TRY(coop_wait(c, p));
    TRY(backend_matmul_rows(m->be, &L->down, c->act, N, m->ff_gate, Hh, (int64_t)p * Hh, (int64_t)(p + 1) * Hh));
    for (int i = 0; i < N; i++)
        memcpy(c->out + (size_t)i * H + (size_t)p * Hh, m->ff_gate + (size_t)i * Hh, sizeof(float) * Hh);
    TRY(coop_wait(c, p));
    memcpy(out, c->out + (size_t)ph->coop_t0 * H, sizeof(float) * (size_t)n * H);
    if (p == 0)
        c->n_mlps++;
    return 1;
}

/* ------------------------------------------------------- split steps -- */

/* A trunk step of several sequences may run as two parts, each a group of whole
 * sequences (contiguous runs) taken through embedding and every layer on a core of its own
 * (backend_split_run), instead of every op cut in two across the cores.  The ops hand
 * their activations to each other, and where a cache line written by one core is slow for
 * the other to read (a 2-vCPU VM: 24 KB in 4 us), an op split by rows pays that on its
 * inputs and outputs, so the second core bought little at batch 16 (and lost at 1 - 4
 * tokens, hence small ops run on one core).  A part keeps its activations on its core;
 * only the weights (read-only) are shared.  Outputs are bit for bit those of the whole
 * batch: every kernel computes a token's row from that token alone, whatever the batch
 * (the batch invariance the engine's tests pin), attention a run from its own keys, and
 * the MoE a token's experts in a fixed order.  A part's ops run on a single-threaded
 * backend of that core, so MODEL_SPLIT_MIN_TOKENS keeps smaller steps (batch-1 decode)
 * on the whole backend, where a big op still splits by rows; in steps of up to
 * MODEL_COOP_MAX_TOKENS the parts compute dense MLPs together (struct split_coop). */
struct split_part {
    struct batch b;
    struct part_hooks hooks;
    int t0;                 /* first token (row of the batch) */
    int r;
};

struct split_step {
    struct model *m;
    struct mlayer *mtp;     /* NULL: the trunk's embedding and layers; else this MTP layer */
    struct split_part part[2];
};

/* Bytes of w as the backend reads them (the format's own size). */
static double weight_bytes(const struct bweight *w)
{
    double n = (double)w->rows * (double)w->cols;

    switch (w->fmt) {
    case WFMT_BF16: return 2.0 * n;
    case WFMT_F32: return 4.0 * n;
    case WFMT_MXFP4: return n * (0.5 + 1.0 / MXFP4_GROUP);
    default: return 0.0;
    }
}

/* Every part of a split step reads all the weights its tokens need: those every token
 * needs (attention, dense MLPs, shared experts, routers) twice a step.  While they fit the
 * last-level cache the second read is nearly free and the parts win (the tiny model's
 * trunk: under 4 MB); Step-3.7-Flash's are ~180 MB per layer, read from DRAM twice, and
 * the parts lost: bench-shapes, 2 threads, batch 4, 4 full-width layers + head: per-core
 * parts 728 ms vs 598 ms whole.  Above this size a step runs whole (its big ops split by
 * rows, so each weight is read once). */
#define MODEL_SPLIT_MAX_SHARED (64.0 * 1024 * 1024)

void model__split_fit(struct model *m)
{
    double shared = 0;

    if (m->split_parts < 2 || m->o.split_any_size)
        return;
    for (int l = 0; l < m->n_layers; l++) {
        const struct mlayer *L = &m->layers[l];

        shared += weight_bytes(&L->wq) + weight_bytes(&L->wk) + weight_bytes(&L->wv) +
                  weight_bytes(&L->wg) + weight_bytes(&L->wo) + weight_bytes(&L->router);
        if (L->has_ffn_dense)
            shared += weight_bytes(&L->gate) + weight_bytes(&L->up) + weight_bytes(&L->down);
    }
    if (shared > MODEL_SPLIT_MAX_SHARED) {
        log_info("model: trunk steps run whole, not as per-core parts: the trunk's shared "
                 "weights (%.0f MB) would be read once per part", shared / 1e6);
        m->split_parts = 1;
    }
}

/* Where to cut batch b in two: token t, in or before run `run`.  A cut between runs
 * nearest half the tokens when the smaller part keeps a third of them; else half the tokens,
 * inside the run that holds the middle (part 1's first queries then wait for part 0's keys,
 * struct split_sync).  false: too small to split. */
bool model__split_choose(const struct model *m, const struct batch *b, struct split_cut *c)
{
    int best = 0, best_t = 0;

    if (m->split_parts < 2 || b->n_tok < MODEL_SPLIT_MIN_TOKENS)
        return false;
    for (int i = 1; i < b->n_seqs; i++) {
        int t = b->seq_start[i];
        if (!best || abs(2 * t - b->n_tok) < abs(2 * best_t - b->n_tok)) {
            best = i;
            best_t = t;
        }
    }
    if (best && 3 * (best_t < b->n_tok - best_t ? best_t : b->n_tok - best_t) >= b->n_tok) {
        *c = (struct split_cut){ .t = best_t, .run = best, .inside = false };
        return true;
    }
    c->t = b->n_tok / 2;
    for (c->run = 0; b->seq_start[c->run + 1] <= c->t; c->run++)
        ;
    c->inside = b->seq_start[c->run] < c->t;
    return true;
}

/* *v = m as part `part` of a split sees it: its backend, part 1's own activations. */
static void part_view(const struct model *m, int part, struct backend *sub, struct model *v)
{
    *v = *m;
    v->be = sub;
    if (part == 1) {
        v->a = m->s_a; v->tmp = m->s_tmp; v->q = m->s_q; v->k = m->s_k; v->v = m->s_v;
        v->g = m->s_g; v->att = m->s_att; v->ff_gate = m->s_ff_gate; v->ff_up = m->s_ff_up;
        v->ff_act = m->s_ff_act; v->rlogits = m->s_rlogits; v->rweights = m->s_rweights;
        v->rids = m->s_rids;
    }
}

static void split_part_run(void *arg, int part, struct backend *sub)
{
    struct split_step *ss = arg;
    struct model *m = ss->m;
    struct split_part *sp = &ss->part[part];
    struct model v;         /* a view: this part's backend and activations */
    const size_t off = (size_t)sp->t0 * m->hidden;
    int r;

    part_view(m, part, sub, &v);
    if (ss->mtp) {
        /* part 0's layer writes m->a rows [0, t0 of part 1) only: part 1's g rows stay */
        r = model__mtp_layer_run(&v, ss->mtp, &sp->b, m->a + off, m->me + off, m->mn + off,
                                 m->x + off);
    } else {
        r = model__trunk_forward(&v, &sp->b, m->hid + off);
    }
    if (r < 0 && sp->hooks.sync && part == 0)
        atomic_store_explicit(&sp->hooks.sync->failed, 1, memory_order_relaxed);
    if (r < 0 && sp->hooks.coop)
        atomic_store_explicit(&sp->hooks.coop->failed, 1, memory_order_relaxed);
    sp->r = r;
}

int model__split_layers(struct model *m, const struct batch *b, const struct split_cut *c,
                        struct mlayer *mtp)
{
    struct split_step ss = { .m = m, .mtp = mtp };
    struct split_part *p0 = &ss.part[0], *p1 = &ss.part[1];
    struct split_sync sync = { 0 };
    struct split_coop coop = { .x = m->coop_x, .act = m->coop_act, .out = m->coop_out, .n_tok = b->n_tok };
    const int t = c->t, at = c->run;
    int r;

    for (int i = 0; i < 2; i++) {
        ss.part[i].hooks.h = (struct batch_hooks){ .ctx = &ss.part[i].hooks,
                                                   .kv_stored = part_kv_stored,
                                                   .attention_wait = part_attention_wait,
                                                   .dense_mlp = part_dense_mlp };
    }
    p0->b = *b;
    p0->b.hooks = &p0->hooks.h;
    p0->b.n_tok = t;
    p0->b.n_seqs = at + c->inside;
    p0->t0 = 0;
    if (c->inside) {            /* run `at` ends at t in part 0 */
        memcpy(m->h_seq_start3, b->seq_start, sizeof(int32_t) * (size_t)(at + 1));
        m->h_seq_start3[at + 1] = t;
        p0->b.seq_start = m->h_seq_start3;
        p0->hooks.sync = &sync;
        p0->hooks.sync_role = 0;
    }
    p1->b = *b;
    p1->b.hooks = &p1->hooks.h;
    p1->b.n_tok = b->n_tok - t;
    p1->b.n_seqs = b->n_seqs - at;
    p1->t0 = t;
    p1->b.ids = b->ids + t;
    p1->b.pos = b->pos + t;
    p1->b.img_row = b->img_row ? b->img_row + t : NULL;
    for (int i = 0; i <= p1->b.n_seqs; i++)
        m->h_seq_start2[i] = i ? b->seq_start[at + i] - t : 0;
    for (int i = 0; i < p1->b.n_seqs; i++)
        m->h_seq_pos02[i] = b->seq_pos0[at + i];
    m->h_seq_pos02[0] += t - b->seq_start[at];     /* run `at` starts at t in part 1 */
    p1->b.seq_start = m->h_seq_start2;
    p1->b.seq_pos0 = m->h_seq_pos02;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        p1->b.slots[g] = b->slots[g] + t;
        p1->b.boff[g] = b->boff[g] + at;
    }
    if (c->inside) {
        p1->hooks.sync = &sync;
        p1->hooks.sync_role = 1;
    }
    /* small steps: both parts at once, so that their dense MLPs cooperate (struct
     * split_coop); else a late part may run after the other on the caller's thread */
    bool together = b->n_tok <= MODEL_COOP_MAX_TOKENS;
    if (together) {
        p0->hooks.coop = p1->hooks.coop = &coop;
        p0->hooks.coop_part = 0;
        p1->hooks.coop_part = 1;
        p0->hooks.coop_t0 = 0;
        p1->hooks.coop_t0 = t;
    }
    r = backend_split_run(m->be, 2, together, split_part_run, &ss);
    if (r < 0)
        return r;
    m->n_split_steps++;
    m->n_coop_mlps += (uint64_t)coop.n_mlps;
    return p0->r < 0 ? p0->r : p1->r;
}

/* The two halves of an MTP layer exchange partial sums (layer_forward's two reductions)
 * and eh_proj's row halves through tp_buf: part p writes set[c % 2][p] at its c-th
 * exchange, both wait for the other (a barrier counter that only grows), then read both.
 * Double-buffered sets: a part writes a set again only after the next barrier, which the
 * other passes only once it has read it.  A part that fails marks `failed`, and the other
 * gives up at its next wait. */
struct tp_run {
    struct model *m;
    int k;
    const struct batch *b;
    const struct batch *tail;       /* non-NULL: b's KV, then the layer for these rows */
    _Atomic int arrive, failed;
    int r[2];
};

struct tp_part {
    struct tp_run *t;
    int part, count;
};

static int tp_wait(struct tp_part *tp)
{
    struct tp_run *t = tp->t;
    const int want = 2 * ++tp->count;

    atomic_fetch_add_explicit(&t->arrive, 1, memory_order_acq_rel);
    return spin_until(&t->arrive, want, &t->failed);
}

/* comm.allreduce_sum of the halves: buf = part 0's + part 1's, in that order on both. */
static int tp_allreduce(void *ctx, float *buf, size_t n)
{
    struct tp_part *tp = ctx;
    struct model *m = tp->t->m;
    const int set = tp->count & 1;
    int r;

    memcpy(m->tp_buf[set][tp->part], buf, n * sizeof(float));
    r = tp_wait(tp);
    if (r < 0)
        return r;
    const float *a = m->tp_buf[set][0], *b = m->tp_buf[set][1];
    for (size_t i = 0; i < n; i++)
        buf[i] = a[i] + b[i];
    return 0;
}

static void tp_part_run(void *arg, int part, struct backend *sub)
{
    struct tp_run *t = arg;
    struct model *m = t->m;
    const struct batch *b = t->b;
    struct mlayer *L = &m->layers[m->n_layers + t->k], *h = &m->tp_half[2 * t->k + part];
    struct tp_part tp = { .t = t, .part = part };
    struct model v;         /* this part's backend, activations and exchange */
    const int n = b->n_tok, H = m->hidden, H2 = H / 2;
    float *x = part ? m->s_x : m->x, *me = part ? m->s_me : m->me, *mn = part ? m->s_mn : m->mn;
    int r, set;

    part_view(m, part, sub, &v);
    v.sharded = true;
    v.comm = (struct model_comm){ .ctx = &tp, .rank = part, .world = 2,
                                  .allreduce_sum = tp_allreduce };
    /* x rows [p*H/2, ...) = We_p·enorm(E[ids]) + Wh_p·hnorm(g), then both halves of x */
    r = model__embed(&v, b, me);
    r = r ? r : backend_rmsnorm(sub, me, &L->enorm, n, H, m->cfg->rms_norm_eps, me);
    r = r ? r : backend_rmsnorm(sub, m->a, &L->hnorm, n, H, m->cfg->rms_norm_eps, mn);
    set = tp.count & 1;
    r = r ? r : backend_matmul(sub, &h->eh_e, me, n, m->tp_buf[set][part]);
    r = r ? r : backend_matmul(sub, &h->eh_h, mn, n, v.tmp);
    r = r ? r : backend_add(sub, m->tp_buf[set][part], v.tmp, (size_t)n * H2);
    r = r ? r : tp_wait(&tp);
    for (int i = 0; i < n && !r; i++)
        for (int q = 0; q < 2; q++)
            memcpy(x + (size_t)i * H + q * H2, m->tp_buf[set][q] + (size_t)i * H2,
                   sizeof(float) * (size_t)H2);
    if (t->tail) {
        /* every row's keys and values, then each run's last row moved to row si (rows
         * only move down, each read before it is written) and the layer for those rows:
         * their KV again (the same values), the rest as layer_forward always computes a
         * row, from that row and the cache alone */
        r = r ? r : backend_rmsnorm(sub, x, &h->in_norm, n, H, m->cfg->rms_norm_eps, v.a);
        r = r ? r : model__layer_kv(&v, h, b);
        for (int si = 0; si < b->n_seqs && !r; si++) {
            int last = b->seq_start[si + 1] - 1;
            if (last != si)
                r = backend_upload(sub, x + (size_t)si * H, x + (size_t)last * H,
                                   sizeof(float) * (size_t)H);
        }
        r = r ? r : model__layer_forward(&v, h, x, t->tail);
    } else {
        r = r ? r : model__layer_forward(&v, h, x, b);
    }
    /* this half of the vocab's draft logits, from each run's last row (the head's rows are
     * split, so every logit is the whole head's) */
    for (int si = 0; si < b->n_seqs && !r; si++)
        r = backend_upload(sub, v.tmp + (size_t)si * H,
                           x + (size_t)(t->tail ? si : b->seq_start[si + 1] - 1) * H,
                           sizeof(float) * (size_t)H);
    r = r ? r : model__mtp_head(&v, L, m->dv_on ? &h->head_sub : &h->head, v.tmp, b->n_seqs,
                                m->tp_logits[part]);
    if (r < 0)
        atomic_store_explicit(&t->failed, 1, memory_order_relaxed);
    t->r[part] = r;
}

/* MTP layer k over batch b, each core running half of it (tensor parallel, in process):
 * each streams half the layer's weights and both exchange three partial results per layer
 * (eh_proj's halves, then the two reductions of layer_forward), instead of both streaming
 * all of it for half the positions (split_layers).  The output (m->x) is the same on both
 * halves; it differs from the whole layer's in the order of some fp32 sums, a choice made
 * once at load (build_mtp_tp), so every MTP batch of a model computes the same way. */
int model__mtp_tp_run(struct model *m, int k, const struct batch *b, const struct batch *tail)
{
    struct tp_run t = { .m = m, .k = k, .b = b, .tail = tail };
    int r = backend_split_run(m->be, 2, true, tp_part_run, &t);

    if (r < 0)
        return r;
    return t.r[0] < 0 ? t.r[0] : t.r[1];
}

bool model_mtp_halves(const struct model *m)
{
    return m->mtp_tp;
}

uint64_t model_mtp_tails(const struct model *m)
{
    return m->n_mtp_tails;
}

uint64_t model_split_steps(const struct model *m)
{
    return m->n_split_steps;
}

uint64_t model_coop_mlps(const struct model *m)
{
    return m->n_coop_mlps;
}

