/* model-int.h - the model's internals, shared by its files (not a public header).
 *
 * The files in layers; each calls only files below it (no circle):
 *
 *   model-api.c    model.h's entry points: model_new() / model_free(), the trunk step
 *                  model_step(), the facts and the struct forward glue;
 *   model-mtp.c    the MTP step model_mtp_step() in phases (docs/MODEL.md §3), with the
 *                  repair of draft positions, and the draft vocabulary;
 *   model-split.c  a CPU step as per-core parts, and MTP layers as per-core halves;
 *   model-gpu.c    a GPU backend's fast paths: step inputs in one transfer, fused layer
 *                  halves, the trunk as a captured graph;
 *   model-load.c   weights as views into the loader's tensors, validated and prepared once;
 *                  the start-up reservation of KV caches, activations and index buffers;
 *   model-plan.c   the plan's checks and the index arrays of a batch;
 *   model.c        the forward script: embedding, layer_forward() (docs/MODEL.md §2.3) as
 *                  its attention half and FFN half, final norm and head, the MTP layer's
 *                  input mix and head.  It calls kernels/ only.
 *
 * model-api.c calls the five below it; model-mtp.c calls model-split.c, model-gpu.c,
 * model-load.c, model-plan.c and model.c; model-split.c calls model-load.c and model.c;
 * model-gpu.c calls model.c.  model-load.c, model-plan.c and model.c call no model file.
 *
 * Everything a step touches was reserved in model_new(); a step allocates nothing.
 * Memory convention of the backends (kernels/backend.h, kernels/cuda/common.cuh):
 * activations, KV caches and router outputs live in backend buffers (device memory on
 * CUDA); the small index arrays built from the plan (token ids, positions, KV slots, run
 * starts, block tables) and the rope / router-bias tables are HOST arrays that the backend
 * stages itself.  Row gathers between activation buffers (logit rows, MTP rows) go through
 * a host bounce buffer with download/upload, the only copies the interface offers.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "model.h"

#define MODEL_ALIGN 64

struct model;
struct mlayer;
struct batch_hooks;

/* One decoder layer (trunk or MTP), this rank's slice. */
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

    /* the fused halves of a GPU backend (backend_has_blocks): this layer's weights as the
     * backend prepared them; blocks = both halves run fused */
    struct attn_weights aw;
    struct ffn_weights fw;
    bool blocks;

    /* MTP only */
    struct bweight enorm, hnorm, eh_e, eh_h, head_norm, head;
    struct bweight head_sub;        /* head's rows of the draft vocabulary (model.h,
                                     * model_set_draft_vocab); rows 0: none */
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
    const struct batch_hooks *hooks;      /* a part of a split step (model-split.c); NULL: whole */
    /* image rows of the plan (step_plan.img_emb) and per token the row or -1 (NULL: none) */
    const float *img_emb;
    const int32_t *img_row;
};

/* What a part of a step that runs as per-core parts (model-split.c) adds to the script:
 * the hand-off of keys between the parts and the dense MLP the parts compute together.
 * layer_forward() calls them at three points; a whole step has none. */
struct batch_hooks {
    void *ctx;
    void (*kv_stored)(void *ctx);           /* this part stored a layer's keys and values */
    int (*attention_wait)(void *ctx);       /* before attention reads the layer's cache */
    /* the dense MLP of layer L for this part's n rows x: 1 when done, 0 to let the script
     * run it alone (swiglu_mlp), or a negative errno */
    int (*dense_mlp)(void *ctx, struct model *m, const struct mlayer *L, const float *x, int n,
                     float limit, float *out);
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
    int64_t kv_block_bytes[_KV_GROUP_MAX];  /* one block over the group's layers (reserved) */
    int64_t buf_bytes;              /* backend buffers reserved: activations + KV caches */

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
    int32_t *argmax_ids;            /* set by model_step_argmax / model_mtp_step_argmax: the
                                       rows' argmax goes here, no logits row to the host */
    int topk_k;                     /* model_step_topk: > 0, argmax_ids [R, k] get each row's k
                                       best ids, topk_vals their values */
    float *topk_vals;
    const float *topk_temps;        /* model_step_topk: NULL, or [R] and topk_sums [R] */
    double *topk_sums;
    int32_t *am_id;                 /* sharded: host [R, k] each row's k best in this rank's
                                       slice (k 1 .. BACKEND_ARGMAX_K_MAX) */
    float *am_val;                  /* sharded: host [R, k] their values */
    float *am_pairs;                /* sharded: host [world, R, k, 2] every rank's (value,
                                       global id bits) per row, as all-gathered */
    uint64_t logits_host_bytes;     /* logits copied to the host (model_logits_host_bytes) */

    float *bounce;                  /* host [T, H]: row copies between activation buffers */
    float *zeros;                   /* host [T, H] zeros, only when a MoE layer has no shared expert */
    int32_t *h_last;                /* MTP: last row of each batch seq */
    /* host index arrays of the current batch */
    int32_t *h_ids, *h_pos, *h_slots[_KV_GROUP_MAX], *h_seq_start, *h_seq_pos0,
            *h_boff[_KV_GROUP_MAX], *h_rows, *h_src,
            *h_img_row;             /* MTP batch: the image row of each row's input id, or -1 */

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

    /* the draft vocabulary (model_set_draft_vocab): head_sub of every MTP layer (and of
     * its halves) holds the rows dv_ids[0 .. dv_n); dv_buf their host rows */
    int32_t *dv_ids;
    int dv_n;
    void *dv_buf;                   /* one allocation: dv_ids, dv_host, the rows */
    float *dv_host;                 /* host [max_seqs, dv_n]: draft logits before scatter */
    bool dv_on;                     /* this MTP step drafts over it (step_plan.draft_sub) */

    struct err_buf last_err;
};

#define TRY(expr) do { r = (expr); if (r < 0) return r; } while (0)
#define PLAN_ERR(m, code, ...) err_set(&(m)->last_err, (code), __VA_ARGS__)

/* ---- model.c: the forward script (calls kernels/ only) ---- */
/* comm.allreduce_sum of buf[0 .. n) where the model is sharded (a no-op otherwise). */
int model__allreduce(struct model *m, float *buf, size_t n);
int model__copy_rows(struct model *m, float *dst, const int32_t *dst_rows, const float *src,
                     const int32_t *src_rows, int n);
int model__layer_kv(struct model *m, struct mlayer *L, const struct batch *b);
/* The two halves of a decoder layer, and the layer (both halves; reduce: all-reduce the
 * partial sums over the ranks). */
int model__attention_half(struct model *m, struct mlayer *L, float *x, const struct batch *b,
                          bool reduce);
int model__ffn_half(struct model *m, struct mlayer *L, float *x, const struct batch *b, bool reduce);
int model__layer_forward(struct model *m, struct mlayer *L, float *x, const struct batch *b);
int model__embed(struct model *m, const struct batch *b, float *x);
int model__trunk_forward(struct model *m, const struct batch *b, float *x);
int model__trunk_logits(struct model *m, const int32_t *rows, int n_rows, float *logits);
/* 0 when model_step_argmax / model_mtp_step_argmax can run, else -ENOTSUP and why. */
int model__argmax_check(struct model *m, const char *what);
int model__mtp_input(struct model *m, struct mlayer *L, const struct batch *b,
                     const float *g_rows, float *me, float *mn, float *x);
int model__mtp_layer_run(struct model *m, struct mlayer *L, const struct batch *b,
                         const float *g_rows, float *me, float *mn, float *x);
int model__mtp_head(struct model *m, const struct mlayer *L, const struct bweight *head, float *x,
                    int n, float *out);

/* ---- model-plan.c: the plan and a batch's index arrays (calls kernels/ only) ---- */
int model__check_plan(struct model *m, const struct step_plan *p);
int32_t model__block_of(const struct step_plan *p, const struct step_seq *s, int g, int b);
int32_t model__slot_of(const struct model *m, const struct step_plan *p,
                       const struct step_seq *s, int g, int32_t pos);
void model__batch_fill(const struct model *m, struct batch *b, const struct step_plan *p,
                       int n_tok, int n_seqs);
int model__trunk_batch(struct model *m, const struct step_plan *p, struct batch *b);

/* ---- model-load.c: weights and memory (calls kernels/ and the loader only) ---- */
/* The model of checkpoint c with its weights loaded and prepared (model_new's first part);
 * on error nothing is kept. */
int model__load(struct ckpt *c, struct backend *be, const struct model_comm *comm,
                const struct model_opts *opts, struct model **ret, struct err_buf *e);
/* Reserve the activations, index arrays and KV caches (after the split's halves). */
int model__reserve(struct model *m, struct err_buf *e);
/* Free what model__load and model__reserve hold, and m. */
void model__unload(struct model *m);
/* Prepare w on the model's backend and own the preparation (released in model_free). */
int model__prepare(struct model *m, struct bweight *w, const char *name, struct err_buf *e);
/* Bytes of one row of w in its host format, and (MXFP4) of its row of scales; 0: a format
 * without host rows. */
size_t model__row_bytes(const struct bweight *w, size_t *ret_scale);
/* Rows [r0, r1) of w as a weight of their own over the same host memory, not prepared.
 * -EINVAL for a format without host rows. */
int model__row_view(const struct bweight *w, int64_t r0, int64_t r1, struct bweight *out);
/* The model owns host buffer p (freed in model_free); on -ENOMEM p is not taken. */
int model__own(struct model *m, void *p);

/* ---- model-gpu.c: a GPU backend's fast paths (calls model.c) ---- */
/* The batch's index arrays to the backend in one go (backend_step_begin); graph: the
 * trunk's layers may be replayed as a graph. */
int model__step_inputs(struct model *m, const struct batch *b, const struct step_plan *p,
                       bool graph);
int model__gpu_prepare(struct model *m, struct err_buf *e);
void model__gpu_release(struct model *m);
int model__layer_forward_fused(struct model *m, struct mlayer *L, float *x, const struct batch *b);
int model__trunk_graph(struct model *m, const struct batch *b, const struct step_plan *p);

/* ---- model-split.c: per-core parts and MTP halves (calls model-load.c, model.c) ---- */
/* Where a step of batch b would be cut in two parts (false: it runs whole). */
struct split_cut {
    int t, run;
    bool inside;            /* t falls inside run `run` (else run `run` starts at t) */
};
bool model__split_choose(const struct model *m, const struct batch *b, struct split_cut *c);
/* After the layers are loaded: no per-core parts when the trunk's shared weights are too
 * big to be read twice (MODEL_SPLIT_MAX_SHARED). */
void model__split_fit(struct model *m);
/* Batch b (the trunk's embedding and layers, or MTP layer `mtp`) as two parts cut at c. */
int model__split_layers(struct model *m, const struct batch *b, const struct split_cut *c,
                        struct mlayer *mtp);
/* MTP layers as per-core halves (set up at load), and MTP layer k over b run that way. */
int model__build_mtp_tp(struct model *m, struct err_buf *e);
int model__mtp_tp_run(struct model *m, int k, const struct batch *b, const struct batch *tail);

/* ---- model-mtp.c: the MTP step (calls model-split.c, model-gpu.c and those below) ---- */
/* The MTP history of the slots whose sequence starts afresh in plan p (model_step). */
void model__mtp_restart(struct model *m, const struct step_plan *p);
/* Release the draft vocabulary's weights and buffers (model_free, and before a new one). */
void model__draft_vocab_release(struct model *m);

/* ---- model-api.c ---- */
extern const struct forward_ops model__forward_ops;
