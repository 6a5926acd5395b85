/* backend.h - THE compute interface: one struct of function pointers per backend
 * (ggml-backend style), ops at layer granularity over host-visible or device
 * pointers owned by the backend's buffers.  The CPU backend (kernels/cpu/) is the
 * oracle; the CUDA backend (kernels/cuda/) is a plugin loaded with dlopen() by the
 * registry in backend.c, the only place that knows HAVE_CUDA.
 *
 * Conventions: activations are FP32 row-major [n_tok, dim]; weights are described by
 * struct bweight (BF16 dense, F32 dense, or MXFP4 packed+scale as on disk, docs/MODEL.md §5)
 * and prepared once with backend_weight_prepare() (repack/upload).  Every op returns 0
 * or a negative errno.  Call sites use the backend_<op>() wrappers, never be->ops->.
 * Plain C: no CUDA headers here.
 *
 * Changes after the lead's skeleton (all additive, no slot changed):
 *  - backend_<op>() wrappers and backend_buf_alloc/free, upload, download, sync, supports, weight_prepare/release
 *    wrappers below; NULL-slot fallbacks are documented at each one.
 *  - struct rope_llama3 + backend_rope_freqs_fill(): builds inv_freq tables (docs/MODEL.md §2.3.4).
 *  - backend_names() for diagnostics.
 *  - mem_info (optional): device memory free/total, for KV sizing.
 *  - Semantics pinned down (they were implicit): router ties go to the lower expert id;
 *    attention returns -EINVAL if a needed KV block is -1 or out of range; MXFP4 weights
 *    must be prepared before matmul/moe on the fast path (unprepared ones run the exact
 *    path from the on-disk bytes); weight_prepare rejects E8M0 scale 255 with -EINVAL.
 *  - Thread-safety: one backend instance serves one calling thread at a time (like a
 *    CUDA stream); ops use the backend's own worker threads internally.
 *
 * The GPU path (docs/GPU.md), all optional slots that the CPU backend leaves NULL, so that
 * the CPU path is unchanged:
 *  - reserve: the device memory plan (every size a step may need), given once at load;
 *  - step_begin: a step's index arrays in one transfer; ops given those same host arrays
 *    then read the device copies;
 *  - capture_begin/capture_end: the trunk's layers captured and replayed as a CUDA graph
 *    (graph_begin/graph_end stay the CPU pool's busy bracket);
 *  - attn_block/ffn_block (with attn_prepare/ffn_prepare): the two halves of a decoder
 *    layer fused, BF16 activations between their kernels, the FP32 residual stream at the
 *    interface (struct attn_block_args / ffn_block_args: exactly the op script of
 *    worker/model/model.c layer_forward, so the CPU backend stays the oracle of both);
 *  - copy_rows: row gathers between activation buffers on the device;
 *  - native/mem_info: the device stream (for a device-side comm) and free memory.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum wfmt {
    WFMT_F32,
    WFMT_BF16,
    WFMT_MXFP4,     /* data = packed U8 [rows, cols/2] (low nibble = even col), scale = U8 [rows, cols/32] E8M0 */
    WFMT_FP8,       /* data = E4M3 [rows, cols], scale = F32 [rows/blk_rows, cols/blk_cols] (bytes) */
    WFMT_NVFP4,     /* data = packed U8 as MXFP4, scale = E4M3 [rows, cols/16], gscale the F32 global scale */
    _WFMT_MAX,
};

/* A weight matrix [rows = out, cols = in].  data/scale borrow from the loader (host) until
 * prepared; priv belongs to the backend (repacked copy, device buffer) after prepare. */
struct bweight {
    enum wfmt fmt;
    int64_t rows, cols;
    const void *data;
    const uint8_t *scale;
    void *priv;
    int32_t blk_rows, blk_cols;     /* WFMT_FP8: the scale blocks */
    float gscale;                   /* WFMT_NVFP4: weight_scale_2 */
    const char *name;               /* the tensor's name for messages, or NULL */
    bool exact;     /* BF16 on the CPU: the exact kernels whatever the context's path, never the
                     * BF16 fast path's rounded activations (the MoE routers: a rounding must
                     * not change which experts a token reaches; other formats ignore it) */
};

/* KV cache of one layer: a pool of blocks, each block_size tokens × n_kv_heads × head_dim,
 * K and V separate.  Physical slot s = block_id * block_size + offset. */
struct kv_layer {
    void *k, *v;            /* [n_blocks * block_size, n_kv_heads, head_dim], dtype below */
    int dtype_f32;          /* 1: FP32 storage, 0: BF16 storage */
    int n_blocks, block_size, n_kv_heads, head_dim;
};

/* Attention over a paged cache for a batch of sequences, each contributing a run of
 * consecutive query tokens (prefill chunk, decode token, or K+1 verify tokens). */
struct attn_args {
    const float *q;         /* [n_tok, n_heads, head_dim] after q-norm and RoPE */
    float *out;             /* [n_tok, n_heads, head_dim] */
    int n_tok, n_heads, n_kv_heads, head_dim;
    float scale;            /* 1/sqrt(head_dim) */
    int window;             /* 0 = full causal; else keys t-window+1 .. t */
    const struct kv_layer *kv;
    int n_seqs;
    const int32_t *seq_tok_start;   /* [n_seqs+1]: tokens of seq s are [start[s], start[s+1]) */
    const int32_t *seq_pos0;        /* [n_seqs]: absolute position of each seq's first query token */
    const int32_t *block_tables;    /* concatenated physical block ids (-1 = released) */
    const int32_t *block_table_off; /* [n_seqs]: offset of seq s's table in block_tables */
};

/* Rotary table for one (theta, rotary_dims, llama3) combination: inv_freq[rotary_dims/2]. */
struct rope_freqs {
    int rotary_dims;
    const float *inv_freq;
};

struct moe_expert {
    struct bweight gate, up, down;   /* gate/up [inter, hidden], down [hidden, inter] */
};

struct moe_args {
    const float *x;             /* [n_tok, hidden] (post-attention norm output) */
    float *out;                 /* [n_tok, hidden]: out += sum over LOCAL selected experts */
    int n_tok, hidden, inter, top_k;
    const int32_t *ids;         /* [n_tok, top_k] global expert ids */
    const float *weights;       /* [n_tok, top_k] final routing weights */
    const struct moe_expert *experts; /* local experts, index e - expert_first */
    int expert_first, n_local;
    float limit;                /* swiglu clamp; 0 = none */
};

struct backend;

struct backend_cfg {
    int n_threads;              /* CPU: worker threads (0 = online cores) */
    int device;                 /* CUDA ordinal */
    bool mxfp4_exact;           /* CPU: use the exact W4A32 path instead of the int8 fast path;
                                   CUDA: FP32 activations op by op (W4A32, no fused halves,
                                   no graphs), the diagnostic path */
};

/* ---- the GPU path (optional slots) ---- */

#define BACKEND_KV_GROUPS 2     /* = worker/plan.h _KV_GROUP_MAX */

/* Everything a step may touch, for a backend that plans its device memory once.  Sizes are
 * maxima over the model's layers (this rank's slice). */
struct backend_reserve {
    int max_tokens;             /* activation rows of a step (MTP re-runs included) */
    int max_seqs;
    int hidden;
    int max_heads, max_kv_heads, max_head_dim;
    int max_q_dim, max_kv_dim;  /* n_heads * head_dim, n_kv_heads * head_dim */
    int max_inter;              /* dense MLP / shared expert intermediate (local) */
    int n_experts, top_k, moe_inter, max_local_experts;   /* 0 without MoE layers */
    int max_block_ids;          /* block-table entries per KV group */
};

/* A step's index arrays (host), as the model builds them from the plan.  Padding rows of
 * a graph bucket are the backend's business (kernels/cuda/graph-pad.h). */
struct backend_step {
    int n_tok, n_seqs;
    const int32_t *ids, *pos;                       /* [n_tok] */
    const int32_t *slots[BACKEND_KV_GROUPS];        /* [n_tok] */
    const int32_t *seq_start;                       /* [n_seqs + 1] */
    const int32_t *seq_pos0;                        /* [n_seqs] */
    const int32_t *boff[BACKEND_KV_GROUPS];         /* [n_seqs] */
    const int32_t *tables[BACKEND_KV_GROUPS];
    int n_table[BACKEND_KV_GROUPS];                 /* entries in tables[g] */
    int max_run;                                    /* longest run of the step */
    bool graph;                                     /* the trunk may run as a graph */
};

/* One decoder layer's weights for the fused halves, prepared individually first; the
 * prepare call may fuse them (QKV + gate, gate + up) into one device copy that the parts
 * then borrow.  NULL: absent (wg without the head-wise gate, q/k_norm without QK norm,
 * gate/up/down on a MoE layer without shared expert, router on a dense layer). */
struct attn_weights {
    struct bweight *in_norm, *wq, *wk, *wv, *wg, *q_norm, *k_norm, *wo;
    const struct rope_freqs *freqs;     /* host table (rotary_dims 0 or NULL: no RoPE) */
    void *priv;
};

struct ffn_weights {
    struct bweight *post_norm;
    struct bweight *gate, *up, *down;   /* dense MLP or shared expert, intermediate `inter` */
    int inter;
    struct bweight *router;             /* [n_experts, hidden] */
    const float *router_bias;           /* host [n_experts] or NULL */
    struct moe_expert *experts;         /* [n_local] */
    int expert_first, n_local, n_experts, moe_inter;
    void *priv;
};

/* The attention half of a decoder layer: x [n_tok, hidden] FP32, the residual stream.
 *   a = rmsnorm(x; in_norm); q, k, v, g = a·W; q, k per-head rmsnorm (q/k_norm); RoPE on
 *   the first rotary dims (freqs, NULL = none) at pos; k, v stored at slots; attention
 *   (as struct attn_args); o *= sigmoid(g) per head; y = o·Woᵀ.
 *   out == NULL: x += y; else out = y (the caller all-reduces and adds). */
struct attn_block_args {
    float *x, *out;
    int n_tok, hidden, n_heads, n_kv_heads, head_dim;
    float eps, scale;
    const struct attn_weights *w;
    const struct rope_freqs *freqs;
    const int32_t *pos, *slots;         /* host, [n_tok] */
    struct kv_layer *kv;
    int window, n_seqs;
    const int32_t *seq_tok_start, *seq_pos0, *block_tables, *block_table_off;   /* host */
};

/* The FFN half: a = rmsnorm(x; post_norm); dense layer (router NULL): y = down(swiglu(
 * gate·a, up·a; limit_dense)); MoE layer: y = shared expert (limit_dense, when gate != NULL)
 * + routed experts (router: sigmoid + bias top_k, renorm, scale; limit_routed).
 * out == NULL: x += y; else out = y. */
struct ffn_block_args {
    float *x, *out;
    int n_tok, hidden;
    float eps, limit_dense, limit_routed, route_scale;
    int top_k;
    bool renorm;
    const struct ffn_weights *w;
};

/* One part of backend_split_run (see split_run below). */
typedef void (*backend_part_fn)(void *arg, int part, struct backend *sub);

struct backend_ops {
    const char *name;
    /* lifecycle */
    int (*init)(struct backend *be, const struct backend_cfg *cfg);
    void (*free)(struct backend *be);
    /* memory */
    int (*buf_alloc)(struct backend *be, size_t bytes, size_t align, void **ret);
    void (*buf_free)(struct backend *be, void *p);
    int (*upload)(struct backend *be, void *dst, const void *src, size_t n);
    int (*download)(struct backend *be, void *dst, const void *src, size_t n);
    int (*sync)(struct backend *be);
    /* capability */
    bool (*supports)(struct backend *be, const char *op, enum wfmt fmt);
    /* weights */
    int (*weight_prepare)(struct backend *be, struct bweight *w);
    void (*weight_release)(struct backend *be, struct bweight *w);
    /* ops */
    int (*embed)(struct backend *be, const struct bweight *table, const int32_t *ids, int n, float *out);
    int (*rmsnorm)(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                   float eps, float *y);                       /* Gemma (1+w); y may alias x */
    int (*matmul)(struct backend *be, const struct bweight *w, const float *x, int n, float *y);
                                                               /* y[n, rows] = x[n, cols] · Wᵀ */
    int (*rope)(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
                const int32_t *pos, const struct rope_freqs *f);  /* NeoX half-split on first R dims */
    int (*kv_store)(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                    int n_tok, const int32_t *slots);
    int (*attention)(struct backend *be, const struct attn_args *a);
    int (*head_gate)(struct backend *be, float *o, const float *g, int n_tok, int n_heads, int head_dim);
    int (*swiglu)(struct backend *be, const float *gate, const float *up, int n, int dim,
                  float limit, float *out);
    int (*router)(struct backend *be, const float *logits, const float *bias, int n_tok, int n_exp,
                  int top_k, bool renorm, float scale, int32_t *ids, float *weights);
    int (*moe)(struct backend *be, const struct moe_args *a);
    int (*add)(struct backend *be, float *y, const float *x, size_t n);
    /* optional (NULL when absent) */
    /* rows [r0, r1) of matmul: y[i * ldy + (r - r0)] for r in [r0, r1); r0 and r1 multiples
     * of 32 (or r1 = rows), the same values matmul gives for those rows */
    int (*matmul_rows)(struct backend *be, const struct bweight *w, const float *x, int n, float *y,
                       int64_t ldy, int64_t r0, int64_t r1);
    int (*graph_begin)(struct backend *be);
    int (*graph_end)(struct backend *be);
    /* Parts that split_run can run at once (CPU: 2 on a 2-thread backend); absent = 1. */
    int (*split_width)(struct backend *be);
    /* Run fn(arg, part, sub) for part = 0 .. n_parts - 1 (n_parts <= split_width) at the
     * same time, each part's ops on `sub`: a backend of its own with ONE thread and its own
     * scratch, that takes this backend's prepared weights (host memory).  A part's ops
     * never touch another part's cache lines, so each core keeps its own activations.
     * Returns when every part has returned.  together = false: a part whose thread is late
     * runs on the caller after the caller's own (so part j may wait for parts < j only);
     * true: every part on its own thread at once (parts may wait for each other). */
    int (*split_run)(struct backend *be, int n_parts, bool together, backend_part_fn fn,
                     void *arg);
    /* the GPU path (see the top of this file) */
    int (*reserve)(struct backend *be, const struct backend_reserve *r);
    int (*step_begin)(struct backend *be, const struct backend_step *s);
    int (*attn_prepare)(struct backend *be, struct attn_weights *w);
    void (*attn_release)(struct backend *be, struct attn_weights *w);
    int (*ffn_prepare)(struct backend *be, struct ffn_weights *w);
    void (*ffn_release)(struct backend *be, struct ffn_weights *w);
    int (*attn_block)(struct backend *be, const struct attn_block_args *a);
    int (*ffn_block)(struct backend *be, const struct ffn_block_args *a);
    /* dst row dst_rows[i] <- src row src_rows[i], i < n, rows of row_bytes; the row lists
     * are host arrays, NULL = 0 .. n-1 */
    int (*copy_rows)(struct backend *be, void *dst, const int32_t *dst_rows, const void *src,
                     const int32_t *src_rows, int n, size_t row_bytes);
    /* "stream": the cudaStream_t the ops run on; "vision": the vision encoder's device ops
     * (kernels/vision-dev.h); NULL for anything else */
    void *(*native)(struct backend *be, const char *what);
    /* Device memory now: free and total bytes of the backend's device (CUDA:
     * cudaMemGetInfo).  Absent where buffers are host memory (CPU: the KV budget is a flag,
     * --kv-cache-memory); the worker sizes a device's KV pools from it (model_opts.kv_blocks
     * runs after the weights and activations are reserved). */
    int (*mem_info)(struct backend *be, size_t *ret_free, size_t *ret_total);
    int (*capture_begin)(struct backend *be);
    int (*capture_end)(struct backend *be, bool ok);
    /* Greedy choice on the device (backend_argmax below) */
    int (*argmax)(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
                  float *vals);
    /* Sampling from candidates on the device (backend_row_expsum below) */
    int (*row_expsum)(struct backend *be, const float *x, int rows, int n, const float *mx,
                      const float *temps, double *sums);
};

struct backend {
    const struct backend_ops *ops;
    void *ctx;
    int device;
};

/* Registry: name "cpu" or "cuda" (plugin libstepd-cuda.so, loaded on demand from
 * $STEPD_PLUGIN_DIR, the build dir, then the install libdir; the plugin exports
 * `const struct backend_ops *stepd_backend_cuda_ops(void)`).
 * -ENODEV when the backend is not available on this machine, -EINVAL for an unknown name. */
int backend_new(const char *name, const struct backend_cfg *cfg, struct backend **ret);
void backend_free(struct backend *be);
/* "cpu" or "cpu,cuda" depending on the build (the plugin may still be absent at run time). */
const char *backend_names(void);

/* ---- wrappers: call sites use these, never be->ops-> ----
 * Each asserts its pointer/shape arguments (programmer errors abort) and returns the
 * slot's result.  Fallbacks when a slot is NULL: buf_alloc -> aligned host malloc,
 * buf_free -> free, upload/download -> memcpy (host-visible memory), sync -> 0,
 * supports -> true for the mandatory ops, weight_prepare/release -> nothing to do,
 * graph_begin/end -> 0.  A NULL op slot returns -ENOSYS. */
int backend_buf_alloc(struct backend *be, size_t bytes, size_t align, void **ret);
void backend_buf_free(struct backend *be, void *p);
int backend_upload(struct backend *be, void *dst, const void *src, size_t n);
int backend_download(struct backend *be, void *dst, const void *src, size_t n);
int backend_sync(struct backend *be);
bool backend_supports(struct backend *be, const char *op, enum wfmt fmt);
int backend_weight_prepare(struct backend *be, struct bweight *w);
void backend_weight_release(struct backend *be, struct bweight *w);

int backend_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n,
                  float *out);
int backend_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                    float eps, float *y);
int backend_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y);
int backend_matmul_rows(struct backend *be, const struct bweight *w, const float *x, int n, float *y,
                        int64_t ldy, int64_t r0, int64_t r1);
int backend_rope(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
                 const int32_t *pos, const struct rope_freqs *f);
int backend_kv_store(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                     int n_tok, const int32_t *slots);
int backend_attention(struct backend *be, const struct attn_args *a);
int backend_head_gate(struct backend *be, float *o, const float *g, int n_tok, int n_heads,
                      int head_dim);
int backend_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
                   float limit, float *out);
int backend_router(struct backend *be, const float *logits, const float *bias, int n_tok,
                   int n_exp, int top_k, bool renorm, float scale, int32_t *ids, float *weights);
int backend_moe(struct backend *be, const struct moe_args *a);
int backend_add(struct backend *be, float *y, const float *x, size_t n);
/* split_width: 1 when the slot is absent.  split_run: -ENOSYS when absent; n_parts must be
 * 1 .. split_width. */
int backend_split_width(struct backend *be);
int backend_split_run(struct backend *be, int n_parts, bool together, backend_part_fn fn,
                      void *arg);
int backend_graph_begin(struct backend *be);
int backend_graph_end(struct backend *be);

/* Graphs of the trunk (after step_begin, around the embedding and the layers):
 *   r = backend_capture_begin(be): 1 = the step's graph exists and capture_end launches
 *       it, the caller skips the ops; 0 = run the ops (captured when the step's shape is a
 *       graph bucket, else eager); < 0 error.
 *   backend_capture_end(be, ok): called after capture_begin whatever happened; ok = the
 *       ops (if run) succeeded.  Ends a capture and launches the graph (ok), or discards
 *       it (!ok, returns 0); -EAGAIN when the capture itself failed (graphs are then off:
 *       run the ops again, eagerly).
 * Absent slots: begin 0, end 0 (eager). */
int backend_capture_begin(struct backend *be);
int backend_capture_end(struct backend *be, bool ok);

/* The GPU path wrappers.  Absent slots: reserve, step_begin -> 0 (nothing to plan);
 * attn/ffn_prepare -> -ENOTSUP (the caller keeps the op script), release -> nothing;
 * attn/ffn_block, copy_rows, mem_info -> -ENOSYS; native -> NULL. */
bool backend_has_blocks(struct backend *be);
int backend_reserve(struct backend *be, const struct backend_reserve *r);
int backend_step_begin(struct backend *be, const struct backend_step *s);
int backend_attn_prepare(struct backend *be, struct attn_weights *w);
void backend_attn_release(struct backend *be, struct attn_weights *w);
int backend_ffn_prepare(struct backend *be, struct ffn_weights *w);
void backend_ffn_release(struct backend *be, struct ffn_weights *w);
int backend_attn_block(struct backend *be, const struct attn_block_args *a);
int backend_ffn_block(struct backend *be, const struct ffn_block_args *a);
int backend_copy_rows(struct backend *be, void *dst, const int32_t *dst_rows, const void *src,
                      const int32_t *src_rows, int n, size_t row_bytes);
void *backend_native(struct backend *be, const char *what);
int backend_mem_info(struct backend *be, size_t *ret_free, size_t *ret_total);
/* The largest k of each row, on the backend: x [rows, n] is a backend buffer (logits),
 * ids [rows, k] and vals [rows, k] (vals may be NULL) are HOST memory, filled when the call
 * returns (it waits for the backend's queue), so the host reads k pairs per row instead of
 * the row.  Order: decreasing value, equal values by increasing index (the lowest index of
 * the maximum first, as sampler_argmax breaks ties; -0.0 equals +0.0); NaN is never
 * chosen; -inf is.  Places past a row's non-NaN elements get id -1 and value NaN, except
 * that an all-NaN row's place 0 is id 0 (sampler_argmax's answer).  k is 1 ..
 * BACKEND_ARGMAX_K_MAX and at most n; rows = 0 does nothing (a probe: -ENOSYS where the
 * op is absent; download the rows instead).
 * The CPU backend's is the oracle (kernels/cpu/argmax.c). */
#define BACKEND_ARGMAX_K_MAX 64
int backend_argmax(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
                   float *vals);
/* The softmax mass of each row that a sampled row's top-p reads (worker/engine/sampler.h,
 * sampler_cands.sum): sums[r] = the sum over i = 0 .. n-1 of expf((x[r, i] - mx[r]) /
 * temps[r]), where mx[r] is the row's largest value (backend_argmax's place 0).  x is a
 * backend buffer; mx, temps and sums [rows] are HOST memory (sums filled when the call
 * returns); a row with temps[r] <= 0 is skipped (sums[r] = 0).  The CPU backend's adds the
 * terms in double in index order, as the sampler does (so its sums are the sampler's to
 * the bit); the CUDA kernel adds them in double in another order with the device's expf:
 * equal within FP32 rounding of the terms.  rows = 0 does nothing (a probe: -ENOSYS where
 * the op is absent). */
int backend_row_expsum(struct backend *be, const float *x, int rows, int n, const float *mx,
                       const float *temps, double *sums);
/* A symbol of the backend's plugin (dlsym; NULL for built-in backends): the CUDA plugin
 * exports the NCCL comm this way (worker/comm/comm-nccl.h), so that CPU-only binaries
 * never link CUDA libraries. */
void *backend_plugin_symbol(struct backend *be, const char *name);

/* ---- rotary tables (host helper, no backend needed) ---- */

/* llama3 frequency scaling (docs/MODEL.md §2.3 step 4): factor s, low_freq_factor lf,
 * high_freq_factor hf, original_max_position_embeddings L0. */
struct rope_llama3 {
    double factor, low_freq_factor, high_freq_factor;
    double original_max_pos;
};

/* inv_freq[i] = theta^(-2i/R) for i < R/2, then llama3 scaling when llama3 != NULL.
 * -EINVAL when R is odd or <= 0, theta <= 1, or the scaling parameters are invalid
 * (factor <= 0, hf <= lf, L0 <= 0). */
int backend_rope_freqs_fill(float *inv_freq, int rotary_dims, double theta,
                            const struct rope_llama3 *llama3);

#ifdef __cplusplus
}
#endif
