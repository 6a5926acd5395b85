/* model.c - the Step forward pass (trunk + MTP) as a readable script over the backend ops.
 *
 * Layout of this file:
 *   1. weights: views into the loader's tensors, validated and prepared once;
 *   2. start-up reservation: KV caches per layer, activations, scratch, index buffers;
 *   3. plan checks and the per-step index arrays (positions, KV slots, block tables);
 *   4. the script: layer_forward() (MODEL.md §2.3), the trunk step (§2) and the MTP
 *      step (§3), in that order;
 *   5. struct forward glue.
 *
 * Everything a step touches was reserved in model_new(); a step allocates nothing.
 * Memory convention of the backends (kernels/backend.h, kernels/cuda/common.cuh):
 * activations, KV caches and router outputs live in backend buffers (device memory on
 * CUDA); the small index arrays built from the plan (token ids, positions, KV slots, run
 * starts, block tables) and the rope / router-bias tables are HOST arrays that the backend
 * stages itself.  Row gathers between activation buffers (logit rows, MTP rows) go through
 * a host bounce buffer with download/upload, the only copies the interface offers.
 */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "mxfp4.h"

#define MODEL_ALIGN 64

/* One decoder layer (trunk or MTP), this rank's slice. */
/* smallest trunk step that runs as per-core parts (see split steps, before model_step) */
#define MODEL_SPLIT_MIN_TOKENS 4
/* split steps of at most this many tokens run their parts at once, and dense MLPs with
 * both cores (struct split_coop); measured on the tiny model's layer-0 MLP (768 x 256,
 * BF16): 4 tokens 33 us vs 43.5 us each part alone, 16 tokens 57 vs 52 us (the exchanges
 * grow with the tokens, the weights do not) */
#define MODEL_COOP_MAX_TOKENS 4

struct mlayer {
    int idx;                        /* global layer index (MTP: n_layers + k) */
    const struct layer_config *lc;
    enum kv_group group;
    int n_heads, n_kv_heads;        /* local to this rank */
    int head_dim;
    int window;                     /* 0 = full causal */
    float limit_shared, limit_routed;
    bool is_moe, is_mtp;

    struct bweight in_norm, post_norm, q_norm, k_norm;
    struct bweight wq, wk, wv, wg, wo;

    /* dense MLP (dense trunk layers, MTP layers) or shared expert (MoE layers) */
    struct bweight gate, up, down;
    int inter;                      /* local intermediate of gate/up/down above */
    bool has_ffn_dense;

    /* MoE */
    struct bweight router;
    float *router_bias;             /* host [n_experts] or NULL */
    struct moe_expert *experts;     /* [n_local] */
    int expert_first, n_local;

    struct rope_freqs freqs;        /* inv_freq: host table */
    float *inv_freq;
    struct kv_layer kv;

    /* MTP only */
    struct bweight enorm, hnorm, eh_e, eh_h, head_norm, head;
    uint16_t *eh_split;             /* host copy of eh_proj split into [H,H] | [H,H] (BF16) */
    float *eh_split_f32;            /* same when eh_proj is F32 */
};

/* The index arrays of one batch (trunk step or one MTP depth): host arrays. */
struct batch {
    int n_tok, n_seqs;
    const int32_t *ids, *pos;
    const int32_t *slots[_KV_GROUP_MAX];
    const int32_t *seq_start;       /* [n_seqs + 1] */
    const int32_t *seq_pos0;        /* [n_seqs] */
    const int32_t *boff[_KV_GROUP_MAX];   /* [n_seqs] */
    const int32_t *tables[_KV_GROUP_MAX]; /* the plan's tables */
    struct split_sync *sync;        /* split step cut inside a run (NULL: none): the KV */
    int sync_role;                  /* hand-off; 0 = writes the earlier keys, 1 = reads them */
    struct split_coop *coop;        /* split step whose parts run at once (NULL: none) */
    int coop_part, coop_t0;         /* this part, and its first token (row) in the step */
};

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
 * cores, each for half of its weights' rows and every token of the step (coop_mlp),
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
    int n_mlps;                     /* coop_mlp calls (part 0) */
};

struct model {
    struct forward fwd;             /* first: model_from_forward() */
    struct ckpt *ckpt;
    struct backend *be;
    const struct model_config *cfg;
    struct model_comm comm;
    bool sharded;                   /* comm present and world > 1 */
    struct model_opts o;
    int hidden;
    int vocab, vocab_local;
    int n_layers, n_mtp;
    int max_logit_rows;
    int table_cap;                  /* block-table capacity per group */
    int max_rows;                   /* activation rows: max_tokens_per_step + MTP re-run rows */
    bool group_used[_KV_GROUP_MAX];

    struct bweight embed, final_norm, lm_head;
    struct mlayer *layers;          /* [n_layers + n_mtp] */

    /* activations [T, ...] */
    float *x;                       /* MTP residual stream [T, H] */
    float *a, *q, *k, *v, *g, *att, *tmp, *ff_gate, *ff_up, *ff_act;
    float *rlogits, *rweights;
    int32_t *rids;
    float *hid;                     /* trunk pre-final-norm hidden of the last step [T, H] */
    float *mh;                      /* output of the last MTP depth per batch row [max_rows, H] */
    float *me, *mn;                 /* MTP: embedding, normed halves [max_rows, H] */
    float *rows_h;                  /* gathered rows [R, H] */
    float *rows_logits;             /* [R, vocab_local] */
    float *gather;                  /* [world, R, vocab_local] */
    float *mtp_logits;              /* [max_seqs, vocab] */

    float *bounce;                  /* host [T, H]: row copies between activation buffers */
    float *zeros;                   /* host [T, H] zeros, only when a MoE layer has no shared expert */
    int32_t *h_last;                /* MTP: last row of each batch seq */
    /* host index arrays of the current batch */
    int32_t *h_ids, *h_pos, *h_slots[_KV_GROUP_MAX], *h_seq_start, *h_seq_pos0,
            *h_boff[_KV_GROUP_MAX], *h_rows, *h_src;

    /* MTP protocol state */
    uint64_t last_step_id;
    int32_t last_n_tokens, last_n_seqs;
    bool have_step;
    int mtp_next_k;
    int32_t *mtp_hist;              /* [max_seqs(plan index), n_mtp] tok_in per depth */
    /* MTP repair ("no trace" of rejected drafts, see model_mtp_step): per sequence slot and
     * MTP layer j, the layer wrote positions [mtp_lo, mtp_end) contiguously for the slot's
     * current sequence (mtp_end = -1: nothing), and mring keeps its outputs h' of the last
     * ring = n_mtp of them, row ((slot * n_mtp + j) * ring + pos % ring). */
    int32_t *mtp_lo, *mtp_end;      /* host [max_seqs(slot), n_mtp] */
    int32_t *mtp_ids;               /* host, rows as mring: the input id each position used */
    float *mring;                   /* [max_seqs * n_mtp * ring, H] */
    float *mstash;                  /* [max_seqs(slot), H]: layer k-1's h' just before its batch */
    int32_t *mtp_rr;                /* [max_seqs(plan index)] rows re-run at the last depth */
    int32_t *mtp_nv;                /* [max_seqs(plan index)] n_valid of the last depth */
    uint64_t n_mtp_rerun;           /* positions re-run so far (model_mtp_repair_stats) */
    uint64_t n_mtp_missed;          /* positions that needed a re-run but could not get one */
    int32_t *mtp_row0;              /* [max_seqs(plan index)] batch row of the run's t = 0 */
    bool *mtp_stash_ok;             /* [max_seqs(plan index)] mstash holds the row before them */
    int32_t *h_ring;                /* host [2 * max_rows]: row lists (dst | src) of a copy */
    bool mtp_no_repair;             /* model_opts.mtp_no_repair (diagnostics) */

    /* ownership lists */
    void **bufs;
    int n_bufs, cap_bufs;
    struct bweight **prepared;
    int n_prepared, cap_prepared;
    void **owned;                   /* host buffers the model made (re-quantised drafts) */
    int n_owned, cap_owned;
    bool quant_now;                 /* load_layer: this layer's linears get draft_quant */

    /* split steps (model_step): part 1's activations and rebased runs; split_parts = 2
     * when the backend runs parts on separate cores and the model may split */
    int split_parts;
    float *s_a, *s_tmp, *s_q, *s_k, *s_v, *s_g, *s_att, *s_ff_gate, *s_ff_up, *s_ff_act;
    float *s_rlogits, *s_rweights;
    int32_t *s_rids, *h_seq_start2, *h_seq_start3, *h_seq_pos02;
    uint64_t n_split_steps;
    /* MTP layers across the two cores (mtp_tp_run): per MTP layer two halves (heads, MLP
     * units, eh_proj rows), part 1's MTP rows, the partial-sum exchange */
    bool mtp_tp;
    struct mlayer *tp_half;         /* [n_mtp * 2] */
    float *tp_buf[2][2];            /* [set][part] [max_rows, H] */
    float *coop_x, *coop_act, *coop_out;    /* struct split_coop's rows */
    uint64_t n_coop_mlps;           /* dense MLPs run by both parts of a split step */
    uint64_t n_mtp_tails;           /* last MTP depths run as a tail (struct batch) */
    int32_t *h_tail_pos, *h_tail_start, *h_tail_slots[_KV_GROUP_MAX];
    float *s_x, *s_me, *s_mn;
    float *tp_logits[2];            /* [part] [max_seqs, vocab / 2]: draft logits halves */

    struct err_buf last_err;
};

static const struct forward_ops model_forward_ops;

/* ---------------------------------------------------------------- memory -- */

static int track(void ***arr, int *n, int *cap, void *p)
{
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 64;
        void **na = realloc(*arr, (size_t)nc * sizeof(*na));
        if (!na)
            return -ENOMEM;
        *arr = na;
        *cap = nc;
    }
    (*arr)[(*n)++] = p;
    return 0;
}

/* Reserve a backend buffer owned by the model (freed in model_free). */
static int mbuf(struct model *m, size_t bytes, void *ret)
{
    void *p = NULL;
    int r;

    if (bytes == 0)
        bytes = MODEL_ALIGN;
    r = backend_buf_alloc(m->be, bytes, MODEL_ALIGN, &p);
    if (r < 0)
        return r;
    r = track(&m->bufs, &m->n_bufs, &m->cap_bufs, p);
    if (r < 0) {
        backend_buf_free(m->be, p);
        return r;
    }
    *(void **)ret = p;
    return 0;
}

/* --------------------------------------------------------------- weights -- */

static int prepare(struct model *m, struct bweight *w, const char *name, struct err_buf *e)
{
    int r = backend_weight_prepare(m->be, w);

    if (r < 0)
        return err_set(e, r, "%s: backend '%s' cannot prepare weight [%lld, %lld]: %s", name,
                       m->be->ops->name, (long long)w->rows, (long long)w->cols, err_str(r));
    r = track((void ***)&m->prepared, &m->n_prepared, &m->cap_prepared, w);
    if (r < 0) {
        backend_weight_release(m->be, w);
        return err_set(e, r, "out of memory");
    }
    return 0;
}

/* Re-quantise a dense draft weight to MXFP4 in a model-owned buffer (model_opts
 * draft_quant); a weight whose in-features are not a multiple of 32 stays as it is. */
static int quantize_draft(struct model *m, struct bweight *w, const char *name, struct err_buf *e)
{
    int64_t rows = w->rows, cols = w->cols;
    size_t pbytes = (size_t)rows * (size_t)(cols / 2), sbytes = (size_t)rows * (size_t)(cols / 32);
    uint8_t *buf;
    float *row;
    int r;

    if (w->fmt != WFMT_BF16 && w->fmt != WFMT_F32)
        return 0;
    if (cols % MXFP4_GROUP)
        return 0;
    buf = malloc(pbytes + sbytes);
    row = malloc((size_t)cols * sizeof(float));
    if (!buf || !row) {
        free(buf);
        free(row);
        return err_set(e, -ENOMEM, "%s: out of memory re-quantising a draft weight", name);
    }
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *src = (const uint8_t *)w->data + (size_t)i * (size_t)cols *
                             (w->fmt == WFMT_BF16 ? 2 : 4);

        if (w->fmt == WFMT_F32) {
            memcpy(row, src, (size_t)cols * sizeof(float));
        } else {
            for (int64_t j = 0; j < cols; j++) {
                uint16_t h;
                uint32_t u;

                memcpy(&h, src + 2 * j, 2);
                u = (uint32_t)h << 16;
                memcpy(&row[j], &u, 4);
            }
        }
        r = mxfp4_row_quantize(row, cols, buf + (size_t)i * (size_t)(cols / 2),
                               buf + pbytes + (size_t)i * (size_t)(cols / 32));
        if (r < 0) {
            free(buf);
            free(row);
            return err_set(e, r, "%s: row %lld cannot be re-quantised to MXFP4 (non-finite "
                           "values?)", name, (long long)i);
        }
    }
    free(row);
    r = track(&m->owned, &m->n_owned, &m->cap_owned, buf);
    if (r < 0) {
        free(buf);
        return err_set(e, r, "out of memory");
    }
    w->fmt = WFMT_MXFP4;
    w->data = buf;
    w->scale = buf + pbytes;
    return 0;
}

/* prepare() for a linear layer's weight, re-quantising MTP draft weights when asked. */
static int prepare_linear(struct model *m, struct bweight *w, const char *name,
                          struct err_buf *e)
{
    if (m->quant_now) {
        int r = quantize_draft(m, w, name, e);

        if (r < 0)
            return r;
    }
    return prepare(m, w, name, e);
}

static int view_to_weight(const struct tview *v, const char *name, struct bweight *w,
                          struct err_buf *e)
{
    memset(w, 0, sizeof(*w));
    switch (v->dtype) {
    case DTYPE_BF16: w->fmt = WFMT_BF16; break;
    case DTYPE_F32: w->fmt = WFMT_F32; break;
    default:
        return err_set(e, -EINVAL, "%s: dtype %s not supported for a dense weight (BF16 or F32)",
                       name, dtype_name(v->dtype));
    }
    if (v->ndim == 1) {
        w->rows = 1;
        w->cols = v->shape[0];
    } else if (v->ndim == 2) {
        w->rows = v->shape[0];
        w->cols = v->shape[1];
    } else {
        return err_set(e, -EINVAL, "%s: expected 1 or 2 dimensions, got %d", name, v->ndim);
    }
    w->data = v->data;
    return 0;
}

/* Dense vector (norm weight) of exactly n elements. */
static int load_vec(struct model *m, const char *name, int64_t n, struct bweight *w,
                    struct err_buf *e)
{
    struct tview v;
    int r = ckpt_get(m->ckpt, name, &v);

    if (r < 0)
        return err_set(e, r, "tensor '%s' not available from the loader: %s", name, err_str(r));
    r = view_to_weight(&v, name, w, e);
    if (r < 0)
        return r;
    if (w->rows * w->cols != n)
        return err_set(e, -EINVAL, "%s: has %lld elements, expected %lld", name,
                       (long long)(w->rows * w->cols), (long long)n);
    w->rows = 1;
    w->cols = n;
    return prepare(m, w, name, e);
}

/* A linear layer "<base>.weight" (dense) or "<base>.weight_packed" + ".weight_scale"
 * (MXFP4).  rows/cols: expected local shape [out, in]. */
static int load_linear(struct model *m, const char *base, int64_t rows, int64_t cols,
                       struct bweight *w, struct err_buf *e)
{
    char name[256];
    struct tview v, s;
    int r;

    snprintf(name, sizeof(name), "%s.weight", base);
    r = ckpt_get(m->ckpt, name, &v);
    if (r == 0) {
        r = view_to_weight(&v, name, w, e);
        if (r < 0)
            return r;
        if (v.ndim != 2 || w->rows != rows || w->cols != cols)
            return err_set(e, -EINVAL, "%s: local shape [%lld, %lld], expected [%lld, %lld]",
                           name, (long long)w->rows, (long long)w->cols, (long long)rows,
                           (long long)cols);
        return prepare_linear(m, w, name, e);
    }
    if (r != -ENOENT)
        return err_set(e, r, "tensor '%s': %s", name, err_str(r));

    snprintf(name, sizeof(name), "%s.weight_packed", base);
    r = ckpt_get(m->ckpt, name, &v);
    if (r < 0)
        return err_set(e, r, "tensor '%s.weight' (or .weight_packed) not available from the loader: %s",
                       base, err_str(r));
    snprintf(name, sizeof(name), "%s.weight_scale", base);
    r = ckpt_get(m->ckpt, name, &s);
    if (r < 0)
        return err_set(e, r, "tensor '%s' not available from the loader: %s", name, err_str(r));
    if (cols % 32)
        return err_set(e, -EINVAL, "%s: MXFP4 needs in-features divisible by 32, got %lld", base,
                       (long long)cols);
    if (v.dtype != DTYPE_U8 || v.ndim != 2 || v.shape[0] != rows || v.shape[1] != cols / 2)
        return err_set(e, -EINVAL, "%s.weight_packed: %s [%lld, %lld], expected U8 [%lld, %lld]",
                       base, dtype_name(v.dtype), (long long)v.shape[0],
                       (long long)(v.ndim > 1 ? v.shape[1] : 0), (long long)rows,
                       (long long)cols / 2);
    if (s.dtype != DTYPE_U8 || s.ndim != 2 || s.shape[0] != rows || s.shape[1] != cols / 32)
        return err_set(e, -EINVAL, "%s.weight_scale: %s [%lld, %lld], expected U8 [%lld, %lld]",
                       base, dtype_name(s.dtype), (long long)s.shape[0],
                       (long long)(s.ndim > 1 ? s.shape[1] : 0), (long long)rows,
                       (long long)cols / 32);
    memset(w, 0, sizeof(*w));
    w->fmt = WFMT_MXFP4;
    w->rows = rows;
    w->cols = cols;
    w->data = v.data;
    w->scale = s.data;
    return prepare(m, w, base, e);
}

/* inv_freq for one layer: f_i = theta^(-2i/R), llama3-scaled where the layer asks
 * (MODEL.md §2.3 step 4). */
static int build_freqs(struct model *m, struct mlayer *L, struct err_buf *e)
{
    const struct model_config *cfg = m->cfg;
    int R = L->lc->rotary_dims;
    float *inv;
    int r;

    L->freqs.rotary_dims = R;
    L->freqs.inv_freq = NULL;
    if (R == 0)
        return 0;
    if (R < 0 || R % 2 || R > L->head_dim)
        return err_set(e, -EINVAL, "layer %d: rotary dims %d invalid for head_dim %d", L->idx, R,
                       L->head_dim);
    inv = calloc((size_t)(R / 2), sizeof(float));
    if (!inv)
        return err_set(e, -ENOMEM, "out of memory");
    L->inv_freq = inv;
    if (L->lc->rope_llama3 && cfg->rope_scaling.present) {
        struct rope_llama3 l3 = {
            .factor = cfg->rope_scaling.factor,
            .low_freq_factor = cfg->rope_scaling.low_freq_factor,
            .high_freq_factor = cfg->rope_scaling.high_freq_factor,
            .original_max_pos = cfg->rope_scaling.original_max_position_embeddings,
        };
        r = backend_rope_freqs_fill(inv, R, L->lc->rope_theta, &l3);
    } else {
        r = backend_rope_freqs_fill(inv, R, L->lc->rope_theta, NULL);
    }
    if (r < 0)
        return err_set(e, r, "layer %d: rope table (theta %g, R %d) rejected: %s", L->idx,
                       L->lc->rope_theta, R, err_str(r));
    L->freqs.inv_freq = inv;
    return 0;
}

/* Split a [H, 2H] eh_proj into its embedding half and hidden half (contiguous copies, so
 * each is an ordinary [H, H] matrix): m = We·enorm(e) + Wh·hnorm(g). */
static int split_eh(struct model *m, struct mlayer *L, const char *name, struct err_buf *e)
{
    struct tview v;
    int64_t H = m->hidden;
    size_t esz;
    uint8_t *dst;
    int r = ckpt_get(m->ckpt, name, &v);

    if (r < 0)
        return err_set(e, r, "tensor '%s' not available from the loader: %s", name, err_str(r));
    if (v.ndim != 2 || v.shape[0] != H || v.shape[1] != 2 * H)
        return err_set(e, -EINVAL, "%s: shape [%lld, %lld], expected [%lld, %lld]", name,
                       (long long)v.shape[0], (long long)(v.ndim > 1 ? v.shape[1] : 0),
                       (long long)H, (long long)(2 * H));
    if (v.dtype != DTYPE_BF16 && v.dtype != DTYPE_F32)
        return err_set(e, -EINVAL, "%s: dtype %s not supported (BF16 or F32)", name,
                       dtype_name(v.dtype));
    esz = v.dtype == DTYPE_BF16 ? 2 : 4;
    dst = malloc((size_t)(2 * H * H) * esz);
    if (!dst)
        return err_set(e, -ENOMEM, "%s: out of memory splitting eh_proj", name);
    if (esz == 2)
        L->eh_split = (uint16_t *)dst;
    else
        L->eh_split_f32 = (float *)dst;
    for (int64_t o = 0; o < H; o++) {
        const uint8_t *row = (const uint8_t *)v.data + (size_t)o * (size_t)(2 * H) * esz;
        memcpy(dst + (size_t)o * H * esz, row, (size_t)H * esz);
        memcpy(dst + (size_t)(H * H + o * H) * esz, row + (size_t)H * esz, (size_t)H * esz);
    }
    memset(&L->eh_e, 0, sizeof(L->eh_e));
    L->eh_e.fmt = esz == 2 ? WFMT_BF16 : WFMT_F32;
    L->eh_e.rows = H;
    L->eh_e.cols = H;
    L->eh_h = L->eh_e;
    L->eh_e.data = dst;
    L->eh_h.data = dst + (size_t)(H * H) * esz;
    /* the input projection stays as the checkpoint has it even with draft_quant: it is
     * 6 % of a draft layer's weights, and its rounding error reaches everything after it
     * (MXFP4 here cost ~0.1 of the mean acceptance length on the tiny model) */
    r = prepare(m, &L->eh_e, name, e);
    if (r < 0)
        return r;
    return prepare(m, &L->eh_h, name, e);
}

/* ------------------------------------------- MTP layers across the cores -- */

/* Rows [r0, r1) of w as a weight of its own: the same memory, prepared anew. */
static int slice_rows(struct model *m, const struct bweight *w, int64_t r0, int64_t r1,
                      struct bweight *out, struct err_buf *e)
{
    memset(out, 0, sizeof(*out));
    out->fmt = w->fmt;
    out->rows = r1 - r0;
    out->cols = w->cols;
    switch (w->fmt) {
    case WFMT_BF16: out->data = (const uint8_t *)w->data + r0 * w->cols * 2; break;
    case WFMT_F32: out->data = (const uint8_t *)w->data + r0 * w->cols * 4; break;
    case WFMT_MXFP4:
        out->data = (const uint8_t *)w->data + r0 * (w->cols / 2);
        out->scale = w->scale + r0 * (w->cols / MXFP4_GROUP);
        break;
    default:
        return err_set(e, -EINVAL, "MTP split: weight format %d", (int)w->fmt);
    }
    return prepare(m, out, "MTP layer half (rows)", e);
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
    r = track(&m->owned, &m->n_owned, &m->cap_owned, buf);
    if (r < 0) {
        free(buf);
        return err_set(e, r, "out of memory");
    }
    out->data = buf;
    if (w->fmt == WFMT_MXFP4)
        out->scale = buf + rows * (nc / 2);
    return prepare(m, out, "MTP layer half (columns)", e);
}

/* On a 2-part backend, every MTP layer as two halves for mtp_tp_run: half p has query heads
 * [p*nh/2, ...) with their KV heads and gate rows, the matching columns of o_proj, MLP
 * units [p*I/2, ...) (gate/up rows, down columns) and eh_proj rows [p*H/2, ...).  Dense MTP
 * layers with even head counts and 32-aligned halves only; else the layers run whole. */
static int build_mtp_tp(struct model *m, struct err_buf *e)
{
    const int H = m->hidden;
    int r;

    if (m->sharded || backend_split_width(m->be) < 2 || m->n_mtp == 0 || m->o.no_mtp_tp ||
        H % 64 || m->vocab % 2)
        return 0;
    for (int k = 0; k < m->n_mtp; k++) {
        const struct mlayer *L = &m->layers[m->n_layers + k];
        if (L->is_moe || !L->has_ffn_dense || L->n_heads % 2 || L->n_kv_heads % 2 ||
            (L->n_heads / 2 * L->head_dim) % MXFP4_GROUP || L->inter % (2 * MXFP4_GROUP) ||
            !L->eh_e.data)
            return 0;
    }
    m->tp_half = calloc((size_t)(2 * m->n_mtp), sizeof(*m->tp_half));
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

static int load_layer(struct model *m, struct mlayer *L, int idx, struct err_buf *e)
{
    const struct model_config *cfg = m->cfg;
    const struct layer_config *lc = &cfg->layers[idx];
    int world = m->sharded ? m->comm.world : 1;
    int64_t H = m->hidden;
    char p[160], n[200];
    int r;

    L->idx = idx;
    L->lc = lc;
    L->is_mtp = idx >= cfg->n_layers;
    m->quant_now = L->is_mtp && m->o.draft_quant == MODEL_DRAFT_MXFP4;
    L->is_moe = lc->is_moe && !L->is_mtp;
    L->group = lc->kind == LAYER_KIND_FULL ? KV_GROUP_FULL : KV_GROUP_SLIDING;
    L->window = lc->kind == LAYER_KIND_SLIDING ? cfg->sliding_window : 0;
    L->head_dim = lc->head_dim;
    L->limit_shared = lc->swiglu_limit_shared;
    L->limit_routed = lc->swiglu_limit;
    /* MTP layers are unsharded (rank 0 only) */
    if (L->is_mtp)
        world = 1;
    if (lc->n_heads % world || lc->n_kv_heads % world)
        return err_set(e, -EINVAL, "layer %d: %d query / %d KV heads do not split over %d ranks",
                       idx, lc->n_heads, lc->n_kv_heads, world);
    if (lc->n_heads % lc->n_kv_heads)
        return err_set(e, -EINVAL, "layer %d: %d query heads not a multiple of %d KV heads", idx,
                       lc->n_heads, lc->n_kv_heads);
    L->n_heads = lc->n_heads / world;
    L->n_kv_heads = lc->n_kv_heads / world;
    if (L->window < 0 || (lc->kind == LAYER_KIND_SLIDING && L->window == 0))
        return err_set(e, -EINVAL, "layer %d: sliding layer with window %d", idx, L->window);

    snprintf(p, sizeof(p), "model.layers.%d", idx);
#define LOADV(field, fmt, len) do { snprintf(n, sizeof(n), fmt, p); \
        r = load_vec(m, n, (len), &L->field, e); if (r < 0) return r; } while (0)
#define LOADW(field, fmt, rows, cols) do { snprintf(n, sizeof(n), fmt, p); \
        r = load_linear(m, n, (rows), (cols), &L->field, e); if (r < 0) return r; } while (0)

    LOADV(in_norm, "%s.input_layernorm.weight", H);
    LOADV(post_norm, "%s.post_attention_layernorm.weight", H);
    LOADW(wq, "%s.self_attn.q_proj", (int64_t)L->n_heads * L->head_dim, H);
    LOADW(wk, "%s.self_attn.k_proj", (int64_t)L->n_kv_heads * L->head_dim, H);
    LOADW(wv, "%s.self_attn.v_proj", (int64_t)L->n_kv_heads * L->head_dim, H);
    LOADW(wo, "%s.self_attn.o_proj", H, (int64_t)L->n_heads * L->head_dim);
    if (cfg->use_head_wise_attn_gate)
        LOADW(wg, "%s.self_attn.g_proj", L->n_heads, H);
    if (cfg->use_qk_norm) {
        LOADV(q_norm, "%s.self_attn.q_norm.weight", L->head_dim);
        LOADV(k_norm, "%s.self_attn.k_norm.weight", L->head_dim);
    }

    if (L->is_moe) {
        int first, count;
        int64_t I = cfg->moe_intermediate_size;

        if (cfg->shared_expert_dim % world)
            return err_set(e, -EINVAL, "layer %d: shared expert dim %d does not split over %d ranks",
                           idx, cfg->shared_expert_dim, world);
        L->inter = cfg->shared_expert_dim / world;
        L->has_ffn_dense = L->inter > 0;
        if (L->has_ffn_dense) {
            LOADW(gate, "%s.share_expert.gate_proj", L->inter, H);
            LOADW(up, "%s.share_expert.up_proj", L->inter, H);
            LOADW(down, "%s.share_expert.down_proj", H, L->inter);
        }
        LOADW(router, "%s.moe.gate", cfg->n_experts, H);
        if (cfg->use_router_bias) {
            struct tview v;
            float *tmpb;
            snprintf(n, sizeof(n), "%s.moe.router_bias", p);
            r = ckpt_get(m->ckpt, n, &v);
            if (r < 0)
                return err_set(e, r, "tensor '%s' not available from the loader: %s", n, err_str(r));
            if (tview_numel(&v) != cfg->n_experts)
                return err_set(e, -EINVAL, "%s: %lld elements, expected %d", n,
                               (long long)tview_numel(&v), cfg->n_experts);
            tmpb = calloc((size_t)cfg->n_experts, sizeof(float));
            if (!tmpb)
                return err_set(e, -ENOMEM, "out of memory");
            L->router_bias = tmpb;
            for (int i = 0; i < cfg->n_experts; i++) {
                if (v.dtype == DTYPE_F32) {
                    memcpy(&tmpb[i], (const char *)v.data + 4 * (size_t)i, 4);
                } else if (v.dtype == DTYPE_BF16) {
                    uint16_t h;
                    uint32_t u;
                    memcpy(&h, (const char *)v.data + 2 * (size_t)i, 2);
                    u = (uint32_t)h << 16;
                    memcpy(&tmpb[i], &u, 4);
                } else {
                    return err_set(e, -EINVAL, "%s: dtype %s not supported (F32 or BF16)", n,
                                   dtype_name(v.dtype));
                }
            }
        }
        ckpt_expert_range(m->ckpt, &first, &count);
        if (count <= 0 || first < 0 || first + count > cfg->n_experts)
            return err_set(e, -EINVAL, "loader expert range [%d, %d) invalid for %d experts", first,
                           first + count, cfg->n_experts);
        L->expert_first = first;
        L->n_local = count;
        L->experts = calloc((size_t)count, sizeof(*L->experts));
        if (!L->experts)
            return err_set(e, -ENOMEM, "out of memory");
        for (int x = 0; x < count; x++) {
            char eb[200];
            snprintf(eb, sizeof(eb), "%s.moe.experts.%d.gate_proj", p, first + x);
            r = load_linear(m, eb, I, H, &L->experts[x].gate, e);
            if (r < 0)
                return r;
            snprintf(eb, sizeof(eb), "%s.moe.experts.%d.up_proj", p, first + x);
            r = load_linear(m, eb, I, H, &L->experts[x].up, e);
            if (r < 0)
                return r;
            snprintf(eb, sizeof(eb), "%s.moe.experts.%d.down_proj", p, first + x);
            r = load_linear(m, eb, H, I, &L->experts[x].down, e);
            if (r < 0)
                return r;
        }
    } else {
        if (cfg->intermediate_size % world)
            return err_set(e, -EINVAL, "layer %d: intermediate size %d does not split over %d ranks",
                           idx, cfg->intermediate_size, world);
        L->inter = cfg->intermediate_size / world;
        L->has_ffn_dense = true;
        LOADW(gate, "%s.mlp.gate_proj", L->inter, H);
        LOADW(up, "%s.mlp.up_proj", L->inter, H);
        LOADW(down, "%s.mlp.down_proj", H, L->inter);
    }

    if (L->is_mtp) {
        LOADV(enorm, "%s.enorm.weight", H);
        LOADV(hnorm, "%s.hnorm.weight", H);
        LOADV(head_norm, "%s.transformer.shared_head.norm.weight", H);
        LOADW(head, "%s.transformer.shared_head.output", m->vocab, H);
        snprintf(n, sizeof(n), "%s.eh_proj.weight", p);
        r = split_eh(m, L, n, e);
        if (r < 0)
            return r;
    }
#undef LOADV
#undef LOADW
    return build_freqs(m, L, e);
}

/* ---------------------------------------------------------- reservation -- */

static int reserve_kv(struct model *m, struct mlayer *L, struct err_buf *e)
{
    struct kv_layer *kv = &L->kv;
    size_t per, bytes;
    int r;

    kv->dtype_f32 = m->o.kv_bf16 ? 0 : 1;
    kv->n_blocks = m->o.n_blocks[L->group];
    kv->block_size = m->o.block_size;
    kv->n_kv_heads = L->n_kv_heads;
    kv->head_dim = L->head_dim;
    if (kv->n_blocks <= 0)
        return err_set(e, -EINVAL, "layer %d uses KV group %s but it has no blocks (n_blocks = %d)",
                       L->idx, L->group == KV_GROUP_FULL ? "FULL" : "SLIDING", kv->n_blocks);
    per = (size_t)kv->n_blocks * (size_t)kv->block_size * (size_t)kv->n_kv_heads *
          (size_t)kv->head_dim * (kv->dtype_f32 ? 4 : 2);
    bytes = per;
    r = mbuf(m, bytes, &kv->k);
    if (r == 0)
        r = mbuf(m, bytes, &kv->v);
    if (r < 0)
        return err_set(e, r, "layer %d: cannot reserve KV cache (%zu bytes x 2): %s", L->idx, bytes,
                       err_str(r));
    return 0;
}

static int host_i32(int32_t **p, size_t n)
{
    *p = calloc(n ? n : 1, sizeof(int32_t));
    return *p ? 0 : -ENOMEM;
}

static int reserve(struct model *m, struct err_buf *e)
{
    size_t T0 = (size_t)m->o.max_tokens_per_step, H = (size_t)m->hidden;
    size_t S = (size_t)m->o.max_seqs, R = (size_t)m->max_logit_rows;
    /* an MTP depth k also re-runs up to k positions per sequence before its run */
    size_t T = T0 + (m->n_mtp > 1 ? S * (size_t)(m->n_mtp - 1) : 0);
    size_t qmax = 0, kvmax = 0, hmax = 0, imax = 1, nexp = 1, topk = 1;
    int r = 0;

    for (int i = 0; i < m->n_layers + m->n_mtp; i++) {
        struct mlayer *L = &m->layers[i];
        qmax = qmax > (size_t)L->n_heads * L->head_dim ? qmax : (size_t)L->n_heads * L->head_dim;
        kvmax = kvmax > (size_t)L->n_kv_heads * L->head_dim ? kvmax
                                                             : (size_t)L->n_kv_heads * L->head_dim;
        hmax = hmax > (size_t)L->n_heads ? hmax : (size_t)L->n_heads;
        imax = imax > (size_t)L->inter ? imax : (size_t)L->inter;
        if (L->is_moe) {
            nexp = (size_t)m->cfg->n_experts;
            topk = (size_t)m->cfg->top_k;
        }
    }
#define F(p, n) do { if (!r) r = mbuf(m, sizeof(float) * (n), &m->p); } while (0)
    m->max_rows = (int)T;
    F(a, T * H); F(tmp, T * H); F(hid, T0 * H);
    F(q, T * qmax); F(k, T * kvmax); F(v, T * kvmax); F(g, T * hmax); F(att, T * qmax);
    F(ff_gate, T * imax); F(ff_up, T * imax); F(ff_act, T * imax);
    F(rlogits, T0 * nexp); F(rweights, T0 * topk);
    F(rows_h, R * H); F(rows_logits, R * (size_t)m->vocab_local);
    if (m->sharded)
        F(gather, R * (size_t)m->vocab);
    if (m->n_mtp) {
        F(x, T * H); F(mh, T * H); F(me, T * H); F(mn, T * H);
        F(mtp_logits, S * (size_t)m->vocab);
        F(mring, S * (size_t)m->n_mtp * (size_t)m->n_mtp * H); F(mstash, S * H);
    }
#undef F
    if (!r)
        r = mbuf(m, sizeof(int32_t) * T0 * topk, &m->rids);
    /* split steps and MTP halves: part 1 gets activations of its own (parts run layers out
     * of step) */
    if (!r && (m->split_parts > 1 || m->mtp_tp)) {
#define F(p, n) do { if (!r) r = mbuf(m, sizeof(float) * (n), &m->p); } while (0)
        F(s_a, T * H); F(s_tmp, T * H); F(s_q, T * qmax); F(s_k, T * kvmax);
        F(s_v, T * kvmax); F(s_g, T * hmax); F(s_att, T * qmax); F(s_ff_gate, T * imax);
        F(s_ff_up, T * imax); F(s_ff_act, T * imax); F(s_rlogits, T0 * nexp);
        F(s_rweights, T0 * topk); F(coop_x, T * H); F(coop_act, T * imax); F(coop_out, T * H);
#undef F
        if (!r)
            r = mbuf(m, sizeof(int32_t) * T0 * topk, &m->s_rids);
    }
    if (!r && m->mtp_tp) {
#define F(p, n) do { if (!r) r = mbuf(m, sizeof(float) * (n), &m->p); } while (0)
        F(tp_buf[0][0], T * H); F(tp_buf[0][1], T * H); F(tp_buf[1][0], T * H);
        F(tp_buf[1][1], T * H); F(s_x, T * H); F(s_me, T * H); F(s_mn, T * H);
        F(tp_logits[0], S * (size_t)(m->vocab / 2)); F(tp_logits[1], S * (size_t)(m->vocab / 2));
#undef F
    }
    if (r < 0)
        return err_set(e, r, "cannot reserve activations for %zu tokens per step: %s", T, err_str(r));

    m->bounce = malloc(sizeof(float) * T * H);
    r = m->bounce ? 0 : -ENOMEM;
    for (int i = 0; i < m->n_layers && !r; i++)
        if (m->layers[i].is_moe && !m->layers[i].has_ffn_dense && !m->zeros) {
            m->zeros = calloc(T * H, sizeof(float));
            r = m->zeros ? 0 : -ENOMEM;
        }
    r = r ? r : host_i32(&m->h_ids, T);
    r = r ? r : host_i32(&m->h_last, T);
    r = r ? r : host_i32(&m->h_pos, T);
    r = r ? r : host_i32(&m->h_seq_start, S + 1);
    r = r ? r : host_i32(&m->h_seq_start2, S + 1);
    r = r ? r : host_i32(&m->h_seq_start3, S + 1);
    r = r ? r : host_i32(&m->h_seq_pos02, S);
    r = r ? r : host_i32(&m->h_tail_pos, S);
    r = r ? r : host_i32(&m->h_tail_start, S + 1);
    r = r ? r : host_i32(&m->h_seq_pos0, S);
    r = r ? r : host_i32(&m->h_rows, T);
    r = r ? r : host_i32(&m->h_src, T);
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        r = r ? r : host_i32(&m->h_slots[g], T);
        r = r ? r : host_i32(&m->h_boff[g], S);
        r = r ? r : host_i32(&m->h_tail_slots[g], S);
    }
    if (!r && m->n_mtp) {
        r = host_i32(&m->mtp_hist, S * (size_t)m->n_mtp);
        r = r ? r : host_i32(&m->mtp_lo, S * (size_t)m->n_mtp);
        r = r ? r : host_i32(&m->mtp_end, S * (size_t)m->n_mtp);
        r = r ? r : host_i32(&m->mtp_ids, S * (size_t)m->n_mtp * (size_t)m->n_mtp);
        r = r ? r : host_i32(&m->mtp_rr, S);
        r = r ? r : host_i32(&m->mtp_row0, S);
        r = r ? r : host_i32(&m->mtp_nv, S);
        r = r ? r : host_i32(&m->h_ring, 2 * T);
        if (!r) {
            m->mtp_stash_ok = calloc(S, sizeof(bool));
            r = m->mtp_stash_ok ? 0 : -ENOMEM;
        }
        for (size_t i = 0; !r && i < S * (size_t)m->n_mtp; i++)
            m->mtp_end[i] = -1;
    }
    if (r < 0)
        return err_set(e, r, "out of memory for index staging");

    /* MTP layers that run as halves keep their KV in the halves only */
    for (int i = 0; i < (m->mtp_tp ? m->n_layers : m->n_layers + m->n_mtp); i++) {
        r = reserve_kv(m, &m->layers[i], e);
        if (r < 0)
            return r;
    }
    for (int i = 0; m->mtp_tp && i < 2 * m->n_mtp; i++) {
        r = reserve_kv(m, &m->tp_half[i], e);
        if (r < 0)
            return r;
    }
    return 0;
}

/* ------------------------------------------------------------------ new -- */

int model_new(struct ckpt *c, struct backend *be, const struct model_comm *comm,
              const struct model_opts *opts, struct model **ret, struct err_buf *e)
{
    const struct model_config *cfg = ckpt_config(c);
    struct model *m;
    struct tview v;
    int world, r;

    if (!opts || opts->max_tokens_per_step <= 0 || opts->max_seqs <= 0 || opts->block_size <= 0)
        return err_set(e, -EINVAL, "model options: max_tokens_per_step, max_seqs and block_size "
                       "must be positive");
    if (opts->max_seqs > opts->max_tokens_per_step)
        return err_set(e, -EINVAL, "model options: max_seqs %d exceeds max_tokens_per_step %d",
                       opts->max_seqs, opts->max_tokens_per_step);
    m = calloc(1, sizeof(*m));
    if (!m)
        return err_set(e, -ENOMEM, "out of memory");
    m->ckpt = c;
    m->be = be;
    m->cfg = cfg;
    m->o = *opts;
    m->mtp_no_repair = opts->mtp_no_repair;
#ifdef MODEL_MTP_NO_REPAIR
    m->mtp_no_repair = true;        /* diagnostic builds: measure the repair's effect */
#endif
    if (comm)
        m->comm = *comm;
    world = comm ? comm->world : 1;
    if (world < 1 || (comm && (comm->rank < 0 || comm->rank >= world))) {
        r = err_set(e, -EINVAL, "model comm: rank %d of world %d", comm ? comm->rank : 0, world);
        goto out;
    }
    m->sharded = comm && world > 1;
    if (m->sharded && (!comm->allreduce_sum || !comm->allgather)) {
        r = err_set(e, -EINVAL, "model comm: world %d needs allreduce_sum and allgather", world);
        goto out;
    }
    /* split steps: over the backend's cores (2 parts), never under tensor parallelism (the
     * parts would all-reduce out of step) */
    m->split_parts = !opts->no_split && !m->sharded && backend_split_width(be) >= 2 ? 2 : 1;
    m->hidden = cfg->hidden_size;
    m->vocab = cfg->vocab_size;
    m->n_layers = cfg->n_layers;
    m->n_mtp = ckpt_mtp_depth(c);
    if (m->sharded && m->comm.rank != 0)
        m->n_mtp = 0;
    if (m->o.max_seq_len <= 0)
        m->o.max_seq_len = cfg->max_position_embeddings;
    m->table_cap = m->o.max_seqs * ((m->o.max_seq_len + m->o.block_size - 1) / m->o.block_size);
    m->max_logit_rows = opts->max_logit_rows > 0 ? opts->max_logit_rows
                                                 : opts->max_seqs * (1 + (m->n_mtp > 3 ? m->n_mtp : 3));
    if (m->max_logit_rows > opts->max_tokens_per_step)
        m->max_logit_rows = opts->max_tokens_per_step;
    if (cfg->n_layers + m->n_mtp > MODEL_MAX_LAYERS) {
        r = err_set(e, -EINVAL, "%d layers exceed the limit %d", cfg->n_layers + m->n_mtp,
                    MODEL_MAX_LAYERS);
        goto out;
    }
    if (cfg->rms_norm_eps <= 0) {
        r = err_set(e, -EINVAL, "config: rms_norm_eps %g must be positive", cfg->rms_norm_eps);
        goto out;
    }

    /* globals: embedding and final norm replicated, lm_head = this rank's vocab rows */
    r = ckpt_get(c, "model.embed_tokens.weight", &v);
    if (r < 0) {
        r = err_set(e, r, "tensor 'model.embed_tokens.weight' not available: %s", err_str(r));
        goto out;
    }
    r = view_to_weight(&v, "model.embed_tokens.weight", &m->embed, e);
    if (r < 0)
        goto out;
    if (m->embed.rows != m->vocab || m->embed.cols != m->hidden) {
        r = err_set(e, -EINVAL, "model.embed_tokens.weight: shape [%lld, %lld], expected [%d, %d]",
                    (long long)m->embed.rows, (long long)m->embed.cols, m->vocab, m->hidden);
        goto out;
    }
    r = prepare(m, &m->embed, "model.embed_tokens.weight", e);
    if (r < 0)
        goto out;
    r = load_vec(m, "model.norm.weight", m->hidden, &m->final_norm, e);
    if (r < 0)
        goto out;
    if (m->vocab % world) {
        r = err_set(e, -EINVAL, "vocab %d does not split over %d ranks", m->vocab, world);
        goto out;
    }
    m->vocab_local = m->vocab / world;
    if (cfg->tie_word_embeddings) {
        /* tied head: this rank's rows of the embedding table */
        size_t esz = m->embed.fmt == WFMT_BF16 ? 2 : 4;
        m->lm_head = m->embed;
        m->lm_head.priv = NULL;
        m->lm_head.rows = m->vocab_local;
        m->lm_head.data = (const uint8_t *)v.data +
                          (size_t)(m->sharded ? m->comm.rank : 0) * m->vocab_local * m->hidden * esz;
        r = prepare(m, &m->lm_head, "lm_head (tied)", e);
    } else {
        r = load_linear(m, "lm_head", m->vocab_local, m->hidden, &m->lm_head, e);
    }
    if (r < 0)
        goto out;

    m->layers = calloc((size_t)(m->n_layers + m->n_mtp), sizeof(*m->layers));
    if (!m->layers) {
        r = err_set(e, -ENOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < m->n_layers + m->n_mtp; i++) {
        r = load_layer(m, &m->layers[i], i, e);
        if (r < 0)
            goto out;
        m->group_used[m->layers[i].group] = true;
    }
    m->quant_now = false;
    r = build_mtp_tp(m, e);
    if (r < 0)
        goto out;
    r = reserve(m, e);
    if (r < 0)
        goto out;

    m->fwd.ops = &model_forward_ops;
    m->fwd.vocab_size = m->vocab;
    m->fwd.n_mtp = m->n_mtp;
    m->fwd.max_tokens_per_step = m->o.max_tokens_per_step;
    m->fwd.max_seqs = m->o.max_seqs;
    m->fwd.block_size = m->o.block_size;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        m->fwd.n_blocks[g] = m->o.n_blocks[g];
    m->fwd.impl = m;
    *ret = m;
    return 0;
out:
    model_free(m);
    return r;
}

void model_free(struct model *m)
{
    if (!m)
        return;
    for (int i = m->n_prepared - 1; i >= 0; i--)
        backend_weight_release(m->be, m->prepared[i]);
    free(m->prepared);
    for (int i = m->n_bufs - 1; i >= 0; i--)
        backend_buf_free(m->be, m->bufs[i]);
    free(m->bufs);
    for (int i = 0; i < m->n_owned; i++)
        free(m->owned[i]);
    free(m->owned);
    if (m->layers) {
        for (int i = 0; i < m->n_layers + m->n_mtp; i++) {
            free(m->layers[i].experts);
            free(m->layers[i].inv_freq);
            free(m->layers[i].router_bias);
            free(m->layers[i].eh_split);
            free(m->layers[i].eh_split_f32);
        }
        free(m->layers);
    }
    free(m->tp_half);
    free(m->bounce);
    free(m->zeros);
    free(m->h_last);
    free(m->h_ids);
    free(m->h_pos);
    free(m->h_seq_start);
    free(m->h_seq_start2);
    free(m->h_seq_start3);
    free(m->h_seq_pos0);
    free(m->h_seq_pos02);
    free(m->h_tail_pos);
    free(m->h_tail_start);
    free(m->h_rows);
    free(m->h_src);
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        free(m->h_slots[g]);
        free(m->h_boff[g]);
        free(m->h_tail_slots[g]);
    }
    free(m->mtp_hist);
    free(m->mtp_lo);
    free(m->mtp_end);
    free(m->mtp_ids);
    free(m->mtp_rr);
    free(m->mtp_row0);
    free(m->mtp_nv);
    free(m->mtp_stash_ok);
    free(m->h_ring);
    free(m);
}

/* ----------------------------------------------------------- plan checks -- */

#define PLAN_ERR(m, code, ...) err_set(&(m)->last_err, (code), __VA_ARGS__)

/* Physical block for (seq, group, logical block b), -1 if released. */
static int32_t block_of(const struct step_plan *p, const struct step_seq *s, int g, int b)
{
    return p->blocks[g][s->block_off[g] + b];
}

static int check_plan(struct model *m, const struct step_plan *p)
{
    int bs = m->o.block_size;

    if (!p || p->n_seqs <= 0 || p->n_seqs > m->o.max_seqs)
        return PLAN_ERR(m, -EINVAL, "plan: %d sequences (1 .. %d allowed)", p ? p->n_seqs : 0,
                        m->o.max_seqs);
    if (p->n_tokens <= 0 || p->n_tokens > m->o.max_tokens_per_step)
        return PLAN_ERR(m, p->n_tokens > 0 ? -E2BIG : -EINVAL,
                        "plan: %d tokens (1 .. %d reserved per step)", p->n_tokens,
                        m->o.max_tokens_per_step);
    if (!p->seqs || !p->tokens)
        return PLAN_ERR(m, -EINVAL, "plan: seqs or tokens missing");
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        if (!m->group_used[g])
            continue;
        if (p->n_block_ids[g] < 0 || p->n_block_ids[g] > m->table_cap)
            return PLAN_ERR(m, -E2BIG, "plan: %d block ids in group %d (capacity %d)",
                            p->n_block_ids[g], g, m->table_cap);
        if (p->n_block_ids[g] > 0 && !p->blocks[g])
            return PLAN_ERR(m, -EINVAL, "plan: block table of group %d missing", g);
    }
    int32_t sum = 0, n_rows = 0;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        int64_t end = (int64_t)s->pos0 + s->n_tokens;

        if (s->slot < 0 || s->slot >= m->o.max_seqs)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: slot %d out of range 0 .. %d", i, s->slot,
                            m->o.max_seqs - 1);
        if (s->n_tokens <= 0 || s->pos0 < 0 || end > m->o.max_seq_len)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: positions %d .. %lld outside 0 .. %d", i,
                            s->pos0, (long long)end - 1, m->o.max_seq_len - 1);
        if (s->tok_off < 0 || (int64_t)s->tok_off + s->n_tokens > p->n_tokens)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: tokens [%d, %d) outside the plan's %d", i,
                            s->tok_off, s->tok_off + s->n_tokens, p->n_tokens);
        if (s->n_logits < 0 || s->n_logits > s->n_tokens)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: n_logits %d with %d tokens", i, s->n_logits,
                            s->n_tokens);
        if (s->mtp_depth < 0)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: mtp_depth %d", i, s->mtp_depth);
        if ((int64_t)s->n_blocks * bs < end)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: %d blocks of %d do not cover position %lld",
                            i, s->n_blocks, bs, (long long)end - 1);
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            int first_needed;
            if (!m->group_used[g])
                continue;
            if (s->block_off[g] < 0 || (int64_t)s->block_off[g] + s->n_blocks > p->n_block_ids[g])
                return PLAN_ERR(m, -EINVAL, "plan seq %d: block table [%d, +%d) outside group %d's %d ids",
                                i, s->block_off[g], s->n_blocks, g, p->n_block_ids[g]);
            /* blocks attention may read: full = all, sliding = the window of the first query */
            first_needed = 0;
            if (g == KV_GROUP_SLIDING && m->cfg->sliding_window > 0) {
                int lo = s->pos0 - m->cfg->sliding_window + 1;
                first_needed = lo > 0 ? lo / bs : 0;
            }
            for (int b = first_needed; b <= (int)((end - 1) / bs); b++) {
                int32_t id = block_of(p, s, g, b);
                if (id < 0 || id >= m->o.n_blocks[g])
                    return PLAN_ERR(m, -EINVAL, "plan seq %d: group %d logical block %d -> %d "
                                    "(pool has %d blocks)", i, g, b, id, m->o.n_blocks[g]);
            }
        }
        sum += s->n_tokens;
        n_rows += s->n_logits;
    }
    if (sum != p->n_tokens)
        return PLAN_ERR(m, -EINVAL, "plan: runs hold %d tokens, plan says %d", sum, p->n_tokens);
    /* attention takes runs as [start[s], start[s+1]): contiguous, in plan order */
    for (int i = 0; i < p->n_seqs; i++) {
        int32_t start = i ? p->seqs[i - 1].tok_off + p->seqs[i - 1].n_tokens : 0;
        if (p->seqs[i].tok_off != start)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: run starts at token %d, expected %d (runs "
                            "must be contiguous in plan order)", i, p->seqs[i].tok_off, start);
    }
    if (n_rows > m->max_logit_rows)
        return PLAN_ERR(m, -E2BIG, "plan: %d logit rows (%d reserved per step)", n_rows,
                        m->max_logit_rows);
    for (int t = 0; t < p->n_tokens; t++)
        if (p->tokens[t] < 0 || p->tokens[t] >= m->vocab)
            return PLAN_ERR(m, -EINVAL, "plan: token %d at index %d outside the vocab (%d)",
                            p->tokens[t], t, m->vocab);
    return 0;
}

/* Slot of position pos of seq s in group g (blocks already checked). */
static int32_t slot_of(const struct model *m, const struct step_plan *p, const struct step_seq *s,
                       int g, int32_t pos)
{
    int bs = m->o.block_size;
    return block_of(p, s, g, pos / bs) * bs + pos % bs;
}

/* Point a batch at the host index arrays (filled for n_tok tokens / n_seqs runs) and the
 * plan's block tables. */
static void batch_fill(const struct model *m, struct batch *b, const struct step_plan *p, int n_tok,
                       int n_seqs)
{
    *b = (struct batch){ .n_tok = n_tok, .n_seqs = n_seqs };
    b->ids = m->h_ids;
    b->pos = m->h_pos;
    b->seq_start = m->h_seq_start;
    b->seq_pos0 = m->h_seq_pos0;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        b->slots[g] = m->h_slots[g];
        b->boff[g] = m->h_boff[g];
        b->tables[g] = p->blocks[g];
    }
}

/* dst[dst_rows[i]] <- src[src_rows[i]] for i < n, rows of H floats in backend buffers
 * (NULL row list = rows 0..n-1), through the host bounce buffer; runs of consecutive rows
 * move in one transfer. */
static int copy_rows(struct model *m, float *dst, const int32_t *dst_rows, const float *src,
                     const int32_t *src_rows, int n)
{
    size_t H = (size_t)m->hidden;
    int r = 0;

    for (int i = 0, j; i < n && !r; i = j) {
        int32_t s0 = src_rows ? src_rows[i] : i;
        for (j = i + 1; j < n && (src_rows ? src_rows[j] : j) == s0 + (j - i); j++)
            ;
        r = backend_download(m->be, m->bounce + (size_t)i * H, src + (size_t)s0 * H,
                             sizeof(float) * H * (size_t)(j - i));
    }
    r = r ? r : backend_sync(m->be);
    for (int i = 0, j; i < n && !r; i = j) {
        int32_t d0 = dst_rows ? dst_rows[i] : i;
        for (j = i + 1; j < n && (dst_rows ? dst_rows[j] : j) == d0 + (j - i); j++)
            ;
        r = backend_upload(m->be, dst + (size_t)d0 * H, m->bounce + (size_t)i * H,
                           sizeof(float) * H * (size_t)(j - i));
    }
    return r;
}

/* ---------------------------------------------------------- collectives -- */

static int allreduce(struct model *m, float *buf, size_t n)
{
    if (!m->sharded)
        return 0;
    return m->comm.allreduce_sum(m->comm.ctx, buf, n);
}

/* ------------------------------------------------------------ the script -- */

#define TRY(expr) do { r = (expr); if (r < 0) return r; } while (0)

/* FFN with SwiGLU: out = down(act(gate(x), up(x))). */
static int swiglu_mlp(struct model *m, const struct mlayer *L, const float *x, int n, float limit,
                      float *out)
{
    int r;

    TRY(backend_matmul(m->be, &L->gate, x, n, m->ff_gate));
    TRY(backend_matmul(m->be, &L->up, x, n, m->ff_up));
    TRY(backend_swiglu(m->be, m->ff_gate, m->ff_up, n, L->inter, limit, m->ff_act));
    return backend_matmul(m->be, &L->down, m->ff_act, n, out);
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

/* Part 1 of a step cut inside a run: wait until part 0 has stored this layer's KV. */
static int split_wait(struct split_sync *ss)
{
    return spin_until(&ss->kv_layers, ++ss->seen, &ss->failed);
}

static int coop_wait(struct split_coop *c, int part)
{
    const int want = 2 * ++c->count[part];

    atomic_fetch_add_explicit(&c->arrive, 1, memory_order_acq_rel);
    return spin_until(&c->arrive, want, &c->failed);
}

/* Can dense MLP L be split in row halves (struct split_coop)?  The halves' first rows
 * must be multiples of 32 (matmul_rows). */
static bool coop_fits(const struct model *m, const struct mlayer *L, const struct batch *b)
{
    return b->coop && !L->is_moe && L->inter % 64 == 0 && m->hidden % 64 == 0;
}

/* swiglu_mlp of this part's n rows a[] into out[], computed with the other part
 * (struct split_coop): gate/up rows [p I/2, (p+1) I/2) and down rows [p H/2, (p+1) H/2)
 * for every token of the step. */
static int coop_mlp(struct model *m, const struct mlayer *L, const struct batch *b, const float *a,
                    float limit, float *out)
{
    struct split_coop *c = b->coop;
    const int p = b->coop_part, N = c->n_tok, n = b->n_tok, H = m->hidden, I = L->inter;
    const int Ih = I / 2, Hh = H / 2;
    int r;

    memcpy(c->x + (size_t)b->coop_t0 * H, a, sizeof(float) * (size_t)n * H);
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
    memcpy(out, c->out + (size_t)b->coop_t0 * H, sizeof(float) * (size_t)n * H);
    if (p == 0)
        c->n_mlps++;
    return 0;
}

/* The keys and values of layer L for the batch's rows, from their normed inputs m->a:
 * projected, normed, rotated and stored in L's cache at the rows' slots. */
static int layer_kv(struct model *m, struct mlayer *L, const struct batch *b)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, hd = L->head_dim;
    int r;

    TRY(backend_matmul(m->be, &L->wk, m->a, n, m->k));
    TRY(backend_matmul(m->be, &L->wv, m->a, n, m->v));
    if (cfg->use_qk_norm)
        TRY(backend_rmsnorm(m->be, m->k, &L->k_norm, n * L->n_kv_heads, hd, cfg->rms_norm_eps, m->k));
    if (L->freqs.rotary_dims > 0)
        TRY(backend_rope(m->be, m->k, n, L->n_kv_heads, hd, b->pos, &L->freqs));
    TRY(backend_kv_store(m->be, &L->kv, m->k, m->v, n, b->slots[L->group]));
    if (b->sync && b->sync_role == 0)
        atomic_fetch_add_explicit(&b->sync->kv_layers, 1, memory_order_release);
    return 0;
}

/* One decoder layer (MODEL.md §2.3) over the batch, in place on the residual x [n, H].
 * Trunk layers reduce over ranks at the two marked points; MTP layers are unsharded. */
static int layer_forward(struct model *m, struct mlayer *L, float *x, const struct batch *b)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, H = m->hidden, hd = L->head_dim;
    int g = L->group;
    float eps = cfg->rms_norm_eps;
    bool reduce = m->sharded && !L->is_mtp;
    int r;

    /* attention block */
    TRY(backend_rmsnorm(m->be, x, &L->in_norm, n, H, eps, m->a));
    TRY(layer_kv(m, L, b));
    TRY(backend_matmul(m->be, &L->wq, m->a, n, m->q));
    if (cfg->use_head_wise_attn_gate)
        TRY(backend_matmul(m->be, &L->wg, m->a, n, m->g));
    if (cfg->use_qk_norm)
        TRY(backend_rmsnorm(m->be, m->q, &L->q_norm, n * L->n_heads, hd, eps, m->q));
    if (L->freqs.rotary_dims > 0)
        TRY(backend_rope(m->be, m->q, n, L->n_heads, hd, b->pos, &L->freqs));
    if (b->sync && b->sync_role == 1)
        TRY(split_wait(b->sync));

    struct attn_args aa = {
        .q = m->q,
        .out = m->att,
        .n_tok = n,
        .n_heads = L->n_heads,
        .n_kv_heads = L->n_kv_heads,
        .head_dim = hd,
        .scale = 1.0f / sqrtf((float)hd),
        .window = L->window,
        .kv = &L->kv,
        .n_seqs = b->n_seqs,
        .seq_tok_start = b->seq_start,
        .seq_pos0 = b->seq_pos0,
        .block_tables = b->tables[g],
        .block_table_off = b->boff[g],
    };
    TRY(backend_attention(m->be, &aa));
    if (cfg->use_head_wise_attn_gate)
        TRY(backend_head_gate(m->be, m->att, m->g, n, L->n_heads, hd));
    TRY(backend_matmul(m->be, &L->wo, m->att, n, m->tmp));
    if (reduce)
        TRY(allreduce(m, m->tmp, (size_t)n * H));                  /* [all-reduce 1] */
    TRY(backend_add(m->be, x, m->tmp, (size_t)n * H));

    /* FFN block */
    TRY(backend_rmsnorm(m->be, x, &L->post_norm, n, H, eps, m->a));
    if (L->is_moe) {
        TRY(backend_matmul(m->be, &L->router, m->a, n, m->rlogits));
        TRY(backend_router(m->be, m->rlogits, L->router_bias, n, cfg->n_experts, cfg->top_k,
                           cfg->norm_expert_weight, cfg->router_scaling_factor, m->rids,
                           m->rweights));
        if (L->has_ffn_dense)
            TRY(swiglu_mlp(m, L, m->a, n, L->limit_shared, m->tmp));   /* shared expert */
        else
            TRY(backend_upload(m->be, m->tmp, m->zeros, sizeof(float) * (size_t)n * H));
        struct moe_args ma = {
            .x = m->a,
            .out = m->tmp,
            .n_tok = n,
            .hidden = H,
            .inter = cfg->moe_intermediate_size,
            .top_k = cfg->top_k,
            .ids = m->rids,
            .weights = m->rweights,
            .experts = L->experts,
            .expert_first = L->expert_first,
            .n_local = L->n_local,
            .limit = L->limit_routed,
        };
        TRY(backend_moe(m->be, &ma));                                  /* routed experts */
    } else if (coop_fits(m, L, b)) {
        TRY(coop_mlp(m, L, b, m->a, L->limit_shared, m->tmp));         /* dense, both parts */
    } else {
        TRY(swiglu_mlp(m, L, m->a, n, L->limit_shared, m->tmp));       /* dense MLP */
    }
    if (reduce)
        TRY(allreduce(m, m->tmp, (size_t)n * H));                  /* [all-reduce 2] */
    return backend_add(m->be, x, m->tmp, (size_t)n * H);
}

/* logits[rows, vocab] = lm_head · final_norm(hid[rows]), gathered over the vocab slices. */
static int trunk_logits(struct model *m, const int32_t *rows, int n_rows, float *logits)
{
    int H = m->hidden, V = m->vocab, Vl = m->vocab_local;
    int r;

    TRY(copy_rows(m, m->rows_h, NULL, m->hid, rows, n_rows));
    TRY(backend_rmsnorm(m->be, m->rows_h, &m->final_norm, n_rows, H, m->cfg->rms_norm_eps,
                        m->rows_h));
    TRY(backend_matmul(m->be, &m->lm_head, m->rows_h, n_rows, m->rows_logits));
    if (!m->sharded) {
        if (logits)
            TRY(backend_download(m->be, logits, m->rows_logits,
                                 sizeof(float) * (size_t)n_rows * (size_t)V));
        return 0;
    }
    /* [all-gather]: gather[w] = rank w's [n_rows, Vl]; row i = concat over w */
    TRY(m->comm.allgather(m->comm.ctx, m->rows_logits, m->gather, (size_t)n_rows * Vl));
    if (!logits)
        return 0;
    for (int w = 0; w < m->comm.world; w++)
        for (int i = 0; i < n_rows; i++)
            TRY(backend_download(m->be, logits + (size_t)i * V + (size_t)w * Vl,
                                 m->gather + ((size_t)w * n_rows + i) * Vl, sizeof(float) * (size_t)Vl));
    return 0;
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
    int t0;                 /* first token (row of the batch) */
    int r;
};

struct split_step {
    struct model *m;
    struct mlayer *mtp;     /* NULL: the trunk's embedding and layers; else this MTP layer */
    struct split_part part[2];
};

/* Where to cut batch b in two: token t, in or before run `run`.  A cut between runs
 * nearest half the tokens when the smaller part keeps a third of them; else half the tokens,
 * inside the run that holds the middle (part 1's first queries then wait for part 0's keys,
 * struct split_sync).  false: too small to split. */
struct split_cut {
    int t, run;
    bool inside;            /* t falls inside run `run` (else run `run` starts at t) */
};

static bool split_choose(const struct model *m, const struct batch *b, struct split_cut *c)
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

/* MTP layer L over batch b (MODEL.md §3.2): x = We·enorm(E[ids]) + Wh·hnorm(g), g the
 * batch's rows of g_rows, then the decoder layer on x.  me, mn: scratch rows [n, H]. */
static int mtp_layer_run(struct model *m, struct mlayer *L, const struct batch *b,
                         const float *g_rows, float *me, float *mn, float *x)
{
    int n = b->n_tok, H = m->hidden, r;

    TRY(backend_embed(m->be, &m->embed, b->ids, n, me));
    TRY(backend_rmsnorm(m->be, me, &L->enorm, n, H, m->cfg->rms_norm_eps, me));
    TRY(backend_rmsnorm(m->be, g_rows, &L->hnorm, n, H, m->cfg->rms_norm_eps, mn));
    TRY(backend_matmul(m->be, &L->eh_e, me, n, x));
    TRY(backend_matmul(m->be, &L->eh_h, mn, n, m->tmp));
    TRY(backend_add(m->be, x, m->tmp, (size_t)n * H));
    return layer_forward(m, L, x, b);
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
        r = mtp_layer_run(&v, ss->mtp, &sp->b, m->a + off, m->me + off, m->mn + off, m->x + off);
    } else {
        r = backend_embed(sub, &m->embed, sp->b.ids, sp->b.n_tok, m->hid + off);
        for (int l = 0; l < m->n_layers && r >= 0; l++)
            r = layer_forward(&v, &m->layers[l], m->hid + off, &sp->b);
    }
    if (r < 0 && sp->b.sync && part == 0)
        atomic_store_explicit(&sp->b.sync->failed, 1, memory_order_relaxed);
    if (r < 0 && sp->b.coop)
        atomic_store_explicit(&sp->b.coop->failed, 1, memory_order_relaxed);
    sp->r = r;
}

/* Run batch b (the trunk's layers, or MTP layer `mtp`) as two parts cut at c. */
static int split_layers(struct model *m, const struct batch *b, const struct split_cut *c,
                        struct mlayer *mtp)
{
    struct split_step ss = { .m = m, .mtp = mtp };
    struct split_part *p0 = &ss.part[0], *p1 = &ss.part[1];
    struct split_sync sync = { 0 };
    struct split_coop coop = { .x = m->coop_x, .act = m->coop_act, .out = m->coop_out, .n_tok = b->n_tok };
    const int t = c->t, at = c->run;
    int r;

    p0->b = *b;
    p0->b.n_tok = t;
    p0->b.n_seqs = at + c->inside;
    p0->t0 = 0;
    if (c->inside) {            /* run `at` ends at t in part 0 */
        memcpy(m->h_seq_start3, b->seq_start, sizeof(int32_t) * (size_t)(at + 1));
        m->h_seq_start3[at + 1] = t;
        p0->b.seq_start = m->h_seq_start3;
        p0->b.sync = &sync;
        p0->b.sync_role = 0;
    }
    p1->b = *b;
    p1->b.n_tok = b->n_tok - t;
    p1->b.n_seqs = b->n_seqs - at;
    p1->t0 = t;
    p1->b.ids = b->ids + t;
    p1->b.pos = b->pos + t;
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
        p1->b.sync = &sync;
        p1->b.sync_role = 1;
    }
    /* small steps: both parts at once, so that their dense MLPs cooperate (struct
     * split_coop); else a late part may run after the other on the caller's thread */
    bool together = b->n_tok <= MODEL_COOP_MAX_TOKENS;
    if (together) {
        p0->b.coop = p1->b.coop = &coop;
        p0->b.coop_part = 0;
        p1->b.coop_part = 1;
        p0->b.coop_t0 = 0;
        p1->b.coop_t0 = t;
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
    r = backend_embed(sub, &m->embed, b->ids, n, me);
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
        r = r ? r : layer_kv(&v, h, b);
        for (int si = 0; si < b->n_seqs && !r; si++) {
            int last = b->seq_start[si + 1] - 1;
            if (last != si)
                r = backend_upload(sub, x + (size_t)si * H, x + (size_t)last * H,
                                   sizeof(float) * (size_t)H);
        }
        r = r ? r : layer_forward(&v, h, x, t->tail);
    } else {
        r = r ? r : layer_forward(&v, h, x, b);
    }
    /* this half of the vocab's draft logits, from each run's last row (the head's rows are
     * split, so every logit is the whole head's) */
    for (int si = 0; si < b->n_seqs && !r; si++)
        r = backend_upload(sub, v.tmp + (size_t)si * H,
                           x + (size_t)(t->tail ? si : b->seq_start[si + 1] - 1) * H,
                           sizeof(float) * (size_t)H);
    r = r ? r : backend_rmsnorm(sub, v.tmp, &L->head_norm, b->n_seqs, H, m->cfg->rms_norm_eps, v.tmp);
    r = r ? r : backend_matmul(sub, &h->head, v.tmp, b->n_seqs, m->tp_logits[part]);
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
static int mtp_tp_run(struct model *m, int k, const struct batch *b, const struct batch *tail)
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

/* The trunk step (forward.h protocol step 1). */
int model_step(struct model *m, const struct step_plan *p, float *logits)
{
    int n_rows = 0, r;

    m->have_step = false;
    r = check_plan(m, p);
    if (r < 0)
        return r;

    /* index arrays: token ids, positions, KV slots per group, runs, table offsets */
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        /* a run from position 0 starts a new sequence in the slot (new request, preemption
         * by recompute): the MTP layers' history of the slot's previous one is void */
        for (int j = 0; j < m->n_mtp && s->pos0 == 0; j++)
            m->mtp_end[(size_t)s->slot * m->n_mtp + j] = -1;
        m->h_seq_start[i] = s->tok_off;
        m->h_seq_pos0[i] = s->pos0;
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            m->h_boff[g][i] = s->block_off[g];
        for (int t = 0; t < s->n_tokens; t++) {
            int j = s->tok_off + t;
            m->h_ids[j] = p->tokens[j];
            m->h_pos[j] = s->pos0 + t;
            for (int g = 0; g < _KV_GROUP_MAX; g++)
                if (m->group_used[g])
                    m->h_slots[g][j] = slot_of(m, p, s, g, s->pos0 + t);
        }
        for (int t = s->n_tokens - s->n_logits; t < s->n_tokens; t++)
            m->h_rows[n_rows++] = s->tok_off + t;
    }
    m->h_seq_start[p->n_seqs] = p->n_tokens;
    struct batch b;
    batch_fill(m, &b, p, p->n_tokens, p->n_seqs);

    /* the script: the residual stream lives in hid, which keeps the pre-final-norm hidden
     * states for the logits and for MTP depth 0 */
    struct split_cut cut;
    if (split_choose(m, &b, &cut)) {
        r = split_layers(m, &b, &cut, NULL);
    } else {
        r = backend_embed(m->be, &m->embed, b.ids, p->n_tokens, m->hid);
        for (int l = 0; l < m->n_layers && r >= 0; l++)
            r = layer_forward(m, &m->layers[l], m->hid, &b);
    }
    if (r < 0)
        return PLAN_ERR(m, r, "step: forward failed: %s", err_str(r));
    if (n_rows > 0) {
        r = trunk_logits(m, m->h_rows, n_rows, logits);
        if (r < 0)
            return PLAN_ERR(m, r, "step: logits failed: %s", err_str(r));
    }
    r = backend_sync(m->be);
    if (r < 0)
        return PLAN_ERR(m, r, "step: backend sync failed: %s", err_str(r));

    m->have_step = true;
    m->last_step_id = p->step_id;
    m->last_n_tokens = p->n_tokens;
    m->last_n_seqs = p->n_seqs;
    m->mtp_next_k = 0;
    return 0;
}

/* Can MTP layer L re-run queries from position q of seq s (q < s->pos0)?  Their KV slots
 * and, for a sliding layer, the keys of q's window must be in valid blocks of the plan
 * (check_plan only vouches for the window of pos0; a full layer's blocks are all checked). */
static bool rerun_fits(const struct model *m, const struct step_plan *p, const struct step_seq *s,
                       const struct mlayer *L, int32_t q)
{
    int bs = m->o.block_size, g = L->group;
    int32_t lo;

    if (q < 0)
        return false;
    if (L->window <= 0)
        return true;
    lo = q - L->window + 1 > 0 ? q - L->window + 1 : 0;
    for (int32_t b = lo / bs; b <= (s->pos0 - 1) / bs; b++) {
        int32_t id = block_of(p, s, g, b);
        if (id < 0 || id >= m->o.n_blocks[g])
            return false;
    }
    return true;
}

/* One MTP depth (forward.h protocol step 2, MODEL.md §3.2), with the repair of the
 * positions the previous step computed from drafts (model.h). */
int model_mtp_step(struct model *m, int k, const struct step_plan *p, const int32_t *n_valid,
                   const int32_t *tok_in, float *logits)
{
    struct mlayer *L;
    int H = m->hidden, V = m->vocab, NM = m->n_mtp, ring = m->n_mtp;
    bool keep;                      /* layer k's outputs feed depth k+1's re-run rows */
    int n = 0, ns = 0, n_rr = 0, n_missed = 0, r;
    const char *what = "forward";

    if (k < 0 || k >= m->n_mtp)
        return PLAN_ERR(m, -EINVAL, "mtp_step: depth %d but %d MTP layers loaded", k, m->n_mtp);
    if (!m->have_step || !p || p->step_id != m->last_step_id || p->n_tokens != m->last_n_tokens ||
        p->n_seqs != m->last_n_seqs)
        return PLAN_ERR(m, -EINVAL, "mtp_step: plan is not the one of the last successful step");
    if (k != m->mtp_next_k)
        return PLAN_ERR(m, -EINVAL, "mtp_step: depth %d called, expected depth %d", k, m->mtp_next_k);
    if (!n_valid || !tok_in || !logits)
        return PLAN_ERR(m, -EINVAL, "mtp_step: n_valid, tok_in and logits are required");
    L = &m->layers[m->n_layers + k];
    keep = !m->mtp_no_repair && k + 1 < NM;

    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        if (s->mtp_depth <= k)
            continue;
        if (n_valid[i] < 0 || n_valid[i] > s->n_tokens)
            return PLAN_ERR(m, -EINVAL, "mtp_step: seq %d: n_valid %d of %d tokens", i, n_valid[i],
                            s->n_tokens);
        if (k > 0 && n_valid[i] != m->mtp_nv[i])
            return PLAN_ERR(m, -EINVAL, "mtp_step: seq %d: n_valid %d at depth %d but %d at depth "
                            "%d (must be the same at every depth)", i, n_valid[i], k,
                            m->mtp_nv[i], k - 1);
        if (tok_in[i] < 0 || tok_in[i] >= V)
            return PLAN_ERR(m, -EINVAL, "mtp_step: seq %d: token %d outside the vocab (%d)", i,
                            tok_in[i], V);
    }
    m->mtp_next_k = k + 1;

    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        const int32_t *run = p->tokens + s->tok_off;
        const int32_t *hist = m->mtp_hist + (size_t)i * NM;
        size_t st = (size_t)s->slot * NM + k;
        int nv, rr = 0, prr = m->mtp_rr[i], prow0 = m->mtp_row0[i];
        bool pok = m->mtp_stash_ok[i], contig;

        if (s->mtp_depth <= k)
            continue;
        nv = n_valid[i];
        m->mtp_hist[(size_t)i * NM + k] = tok_in[i];
        m->mtp_nv[i] = nv;
        m->mtp_rr[i] = 0;
        m->mtp_row0[i] = -1;
        m->mtp_stash_ok[i] = false;
        if (nv == 0)
            continue;
        /* The last k positions this layer wrote (pos0-k .. pos0-1) took ids from beyond
         * the accepted tokens.  Position pos0+t must be re-run when its id now differs
         * from the one it used (a rejected draft, a new draft) or its g changed (depth k-1
         * re-ran it: t >= -prr), and with it every later position (they attended to it).
         * A re-run row before depth k-1's batch takes its g from the stash. */
        contig = m->mtp_end[st] == s->pos0;
        if (!m->mtp_no_repair && k > 0) {
            int have = contig ? s->pos0 - m->mtp_lo[st] : 0, need = prr, cap;
            if (have > k)
                have = k;
            for (int t = -have; t < -need; t++) {
                int idx = t + k + 1;
                int32_t id = idx < nv ? run[idx] : hist[idx - nv];
                if (id != m->mtp_ids[st * ring + (size_t)((s->pos0 + t) % ring)]) {
                    need = -t;
                    break;
                }
            }
            if (!contig)        /* a hole: what the layer holds is unknown */
                need = k < s->pos0 ? k : s->pos0;
            cap = have < prr + (pok ? 1 : 0) ? have : prr + (pok ? 1 : 0);
            rr = need < cap ? need : cap;
            while (rr > 0 && !rerun_fits(m, p, s, L, s->pos0 - rr))
                rr--;
            n_missed += need - rr;
        }
        if (n + rr + nv > m->max_rows)
            return PLAN_ERR(m, -E2BIG, "mtp_step %d: %d rows exceed the %d reserved", k,
                            n + rr + nv, m->max_rows);
        m->h_seq_start[ns] = n;
        m->h_seq_pos0[ns] = s->pos0 - rr;
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            m->h_boff[g][ns] = s->block_off[g];
        for (int t = -rr; t < nv; t++) {
            /* input id at position pos0+t is the token k+1 further along: accepted run
             * tokens, then the sampled token (depth 0) and the drafts (depths 1..k) */
            int idx = t + k + 1;
            m->h_ids[n] = idx < nv ? run[idx] : hist[idx - nv];
            m->h_pos[n] = s->pos0 + t;
            /* g: trunk hidden (plan row), depth k-1's output (its batch row), or the stash */
            if (k == 0)
                m->h_src[n] = s->tok_off + t;
            else if (t >= -prr)
                m->h_src[n] = prow0 + t;
            else
                m->h_src[n] = -1 - s->slot;
            for (int g = 0; g < _KV_GROUP_MAX; g++)
                if (m->group_used[g])
                    m->h_slots[g][n] = slot_of(m, p, s, g, s->pos0 + t);
            n++;
        }
        m->mtp_rr[i] = rr;
        n_rr += rr;
        m->mtp_row0[i] = m->h_seq_start[ns] + rr;
        /* the stash for depth k+1: this layer's (clean) output just before the re-run rows,
         * still in the ring from an earlier step */
        {
            int32_t q = s->pos0 - rr - 1;
            m->mtp_stash_ok[i] = keep && contig && q >= 0 && q >= m->mtp_lo[st] &&
                                 q >= s->pos0 - ring;
        }
        m->h_rows[ns] = i;      /* logits row (plan order) of this batch seq */
        ns++;
    }
    if (ns == 0)
        return 0;
    m->h_seq_start[ns] = n;
    struct batch mb;
    batch_fill(m, &mb, p, n, ns);

    /* g rows: from the trunk / the previous depth's batch, then the stash rows */
    if (k == 0) {
        r = copy_rows(m, m->a, NULL, m->hid, m->h_src, n);
    } else {
        int32_t *dst = m->h_ring, *src = m->h_ring + m->max_rows;
        int nd = 0;
        for (int j = 0; j < n; j++)
            if (m->h_src[j] >= 0) {
                dst[nd] = j;
                src[nd++] = m->h_src[j];
            }
        r = copy_rows(m, m->a, dst, m->mh, src, nd);
        for (int32_t j = 0; j < n && !r; j++)
            if (m->h_src[j] < 0) {
                int32_t slot = -1 - m->h_src[j];
                r = copy_rows(m, m->a, &j, m->mstash, &slot, 1);
            }
    }
    /* g = trunk hidden (k = 0) or MTP layer k-1's output, in m->a: the layer, whole or as
     * per-core parts */
    if (!r) {
        struct split_cut cut;
        if (m->mtp_tp && k == NM - 1 && !m->o.no_mtp_tail) {
            /* the last depth: only each run's last row feeds anything (the draft logits;
             * no depth reads this layer's outputs), the others just need their KV */
            struct batch tail = mb;
            tail.n_tok = ns;
            tail.ids = NULL;
            tail.pos = tail.seq_pos0 = m->h_tail_pos;
            tail.seq_start = m->h_tail_start;
            for (int si = 0; si < ns; si++) {
                int last = m->h_seq_start[si + 1] - 1;
                m->h_tail_pos[si] = m->h_pos[last];
                m->h_tail_start[si] = si;
                for (int g = 0; g < _KV_GROUP_MAX; g++)
                    m->h_tail_slots[g][si] = m->h_slots[g][last];
            }
            m->h_tail_start[ns] = ns;
            for (int g = 0; g < _KV_GROUP_MAX; g++)
                tail.slots[g] = m->h_tail_slots[g];
            r = mtp_tp_run(m, k, &mb, &tail);
            m->n_mtp_tails++;
        } else if (m->mtp_tp) {
            r = mtp_tp_run(m, k, &mb, NULL);
        } else {
            r = split_choose(m, &mb, &cut) ? split_layers(m, &mb, &cut, L)
                                           : mtp_layer_run(m, L, &mb, m->a, m->me, m->mn, m->x);
        }
    }
    if (r < 0)
        goto fail;

    /* the ids the last `ring` positions used, for the next step's comparison */
    for (int si = 0; si < ns && !m->mtp_no_repair && k > 0; si++) {
        const struct step_seq *s = &p->seqs[m->h_rows[si]];
        int32_t first = m->h_seq_pos0[si], end = m->h_seq_pos0[si] +
                        (m->h_seq_start[si + 1] - m->h_seq_start[si]);
        int32_t *ids = m->mtp_ids + ((size_t)s->slot * NM + k) * ring;
        for (int32_t pos = end - ring > first ? end - ring : first; pos < end; pos++)
            ids[pos % ring] = m->h_ids[m->h_seq_start[si] + (pos - first)];
    }

    /* keep h' for the re-runs of later steps: first the stash (the row before this step's
     * rows, still in the ring), then the ring gets the last `ring` positions written */
    if (keep) {
        int32_t *dst = m->h_ring, *src = m->h_ring + m->max_rows;
        int nr = 0;
        for (int si = 0; si < ns && !r; si++) {
            int i = m->h_rows[si];
            const struct step_seq *s = &p->seqs[i];
            int32_t base = (s->slot * NM + k) * ring, first = m->h_seq_pos0[si];
            int32_t end = s->pos0 + m->mtp_nv[i];
            if (m->mtp_stash_ok[i]) {
                int32_t q = first - 1, row = base + q % ring, slot = s->slot;
                r = copy_rows(m, m->mstash, &slot, m->mring, &row, 1);
            }
            for (int32_t pos = end - ring > first ? end - ring : first; pos < end; pos++) {
                dst[nr] = base + pos % ring;
                src[nr++] = m->h_seq_start[si] + (pos - first);
            }
        }
        r = r ? r : copy_rows(m, m->mring, dst, m->x, src, nr);
        if (r < 0)
            goto fail;
    }

    /* draft logits from each seq's last valid position (the halves computed theirs, one
     * half of the vocab each); h' feeds the next depth */
    if (!m->mtp_tp) {
        for (int si = 0; si < ns; si++)
            m->h_last[si] = m->h_seq_start[si + 1] - 1;
        r = copy_rows(m, m->rows_h, NULL, m->x, m->h_last, ns);
        if (r < 0)
            goto fail;
    }
    {
        float *t = m->mh;
        m->mh = m->x;
        m->x = t;
    }
    if (m->mtp_tp) {
        const int V2 = V / 2;
        for (int si = 0; si < ns && !r; si++)
            for (int q = 0; q < 2 && !r; q++)
                r = backend_download(m->be, logits + (size_t)m->h_rows[si] * V + (size_t)q * V2,
                                     m->tp_logits[q] + (size_t)si * V2, sizeof(float) * (size_t)V2);
    } else {
        r = backend_rmsnorm(m->be, m->rows_h, &L->head_norm, ns, H, m->cfg->rms_norm_eps, m->rows_h);
        r = r ? r : backend_matmul(m->be, &L->head, m->rows_h, ns, m->mtp_logits);
        for (int si = 0; si < ns && !r; si++)
            r = backend_download(m->be, logits + (size_t)m->h_rows[si] * V,
                                 m->mtp_logits + (size_t)si * V, sizeof(float) * (size_t)V);
    }
    r = r ? r : backend_sync(m->be);
    if (r < 0) {
        what = "draft logits";
        goto fail;
    }

    /* the layer now holds positions [lo, pos0 + n_valid) of each slot contiguously */
    for (int si = 0; si < ns; si++) {
        int i = m->h_rows[si];
        const struct step_seq *s = &p->seqs[i];
        size_t st = (size_t)s->slot * NM + k;
        if (m->mtp_end[st] != s->pos0)
            m->mtp_lo[st] = s->pos0;
        m->mtp_end[st] = s->pos0 + m->mtp_nv[i];
    }
    m->n_mtp_rerun += (uint64_t)n_rr;
    m->n_mtp_missed += (uint64_t)n_missed;
    return 0;
fail:
    /* the layer's KV / kept outputs of these slots are partly written: no later repair may
     * rely on them, and the chain of this step is over */
    for (int si = 0; si < ns; si++)
        m->mtp_end[(size_t)p->seqs[m->h_rows[si]].slot * NM + k] = -1;
    m->mtp_next_k = NM;
    return PLAN_ERR(m, r, "mtp_step %d: %s failed: %s", k, what, err_str(r));
}

const char *model_last_error(const struct model *m)
{
    return m->last_err.msg;
}

const struct model_config *model_config(const struct model *m)
{
    return m->cfg;
}

int model_vocab_size(const struct model *m)
{
    return m->vocab;
}

int model_n_mtp(const struct model *m)
{
    return m->n_mtp;
}

void model_mtp_repair_stats(const struct model *m, uint64_t *ret_rerun, uint64_t *ret_missed)
{
    if (ret_rerun)
        *ret_rerun = m->n_mtp_rerun;
    if (ret_missed)
        *ret_missed = m->n_mtp_missed;
}

/* ------------------------------------------------------------- forward -- */

static int fwd_step(struct forward *f, const struct step_plan *p, float *logits)
{
    return model_step(f->impl, p, logits);
}

static int fwd_mtp_step(struct forward *f, int k, const struct step_plan *p, const int32_t *n_valid,
                        const int32_t *tok_in, float *logits)
{
    return model_mtp_step(f->impl, k, p, n_valid, tok_in, logits);
}

static void fwd_free(struct forward *f)
{
    if (f)
        model_free(f->impl);
}

static const struct forward_ops model_forward_ops = {
    .name = "model",
    .step = fwd_step,
    .mtp_step = fwd_mtp_step,
    .free = fwd_free,
};

int model_forward_new(struct ckpt *c, struct backend *be, const struct model_comm *comm,
                      const struct model_opts *opts, struct forward **ret, struct err_buf *e)
{
    struct model *m;
    int r = model_new(c, be, comm, opts, &m, e);

    if (r < 0)
        return r;
    *ret = &m->fwd;
    return 0;
}

struct model *model_from_forward(struct forward *f)
{
    if (!f || f->ops != &model_forward_ops)
        return NULL;
    return f->impl;
}
