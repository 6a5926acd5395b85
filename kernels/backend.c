/* backend.c - the backend registry and the thin backend_<op>() wrappers.
 *
 * "cpu" is built in.  "cuda" is a plugin, libstepd-cuda.so, opened with dlopen() from
 * $STEPD_PLUGIN_DIR, then the build tree, then the install libdir; it exports
 * stepd_backend_cuda_ops().  A build without CUDA looks in $STEPD_PLUGIN_DIR only (where
 * the suite puts the host emulator's build of the plugin, test/cuemu).  This file is the
 * only place that knows HAVE_CUDA (ggml-backend-reg.cpp does the same).
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stepd-config.h"
#include "err.h"
#include "log.h"
#include "backend.h"
#include "cpu/cpu.h"

#ifndef STEPD_PLUGIN_BUILD_DIR
#define STEPD_PLUGIN_BUILD_DIR ""
#endif
#ifndef STEPD_PLUGIN_LIBDIR
#define STEPD_PLUGIN_LIBDIR ""
#endif

#define CUDA_PLUGIN_FILE "libstepd-cuda.so"
#define CUDA_PLUGIN_SYM "stepd_backend_cuda_ops"

/* struct backend is public; the registry keeps the plugin handle beside it. */
struct backend_impl {
    struct backend be;      /* first: backend_free() casts back */
    void *dl;
};

const char *backend_names(void)
{
#ifdef HAVE_CUDA
    return "cpu,cuda";
#else
    return "cpu";
#endif
}

/* A candidate that does not load is a debug line, a warning where the operator named its
 * directory ($STEPD_PLUGIN_DIR): the dlerror() text says why (absent, not ELF, cut short,
 * a missing symbol), where -ENODEV alone does not. */
static void *plugin_try(const char *dir, bool named)
{
    char path[4096];
    void *dl;

    if (!dir || !dir[0])
        return NULL;
    if (snprintf(path, sizeof(path), "%s/%s", dir, CUDA_PLUGIN_FILE) >= (int)sizeof(path))
        return NULL;
    dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!dl && named)
        log_warn("backend: the plugin of $STEPD_PLUGIN_DIR does not load: %s", dlerror());
    else if (!dl)
        log_debug("backend: %s: %s", path, dlerror());
    return dl;
}

/* Open the CUDA plugin; -ENODEV when no candidate loads or it lacks the entry point. */
static int plugin_open(void **ret_dl, const struct backend_ops **ret_ops)
{
    const struct backend_ops *(*entry)(void);
    const struct backend_ops *ops;
    void *dl;

    dl = plugin_try(getenv("STEPD_PLUGIN_DIR"), true);
#ifdef HAVE_CUDA
    if (!dl)
        dl = plugin_try(STEPD_PLUGIN_BUILD_DIR, false);
    if (!dl)
        dl = plugin_try(STEPD_PLUGIN_LIBDIR, false);
#endif
    if (!dl)
        return -ENODEV;
    *(void **)&entry = dlsym(dl, CUDA_PLUGIN_SYM);
    if (!entry) {
        log_warn("backend: %s has no symbol %s", CUDA_PLUGIN_FILE, CUDA_PLUGIN_SYM);
        dlclose(dl);
        return -ENODEV;
    }
    ops = entry();
    if (!ops || !ops->init || !ops->free) {
        log_warn("backend: %s returned an incomplete ops table", CUDA_PLUGIN_FILE);
        dlclose(dl);
        return -ENODEV;
    }
    *ret_dl = dl;
    *ret_ops = ops;
    return 0;
}

int backend_new(const char *name, const struct backend_cfg *cfg, struct backend **ret)
{
    static const struct backend_cfg cfg_default;
    const struct backend_ops *ops = NULL;
    struct backend_impl *impl;
    void *dl = NULL;
    int r;

    ASSERT(name && ret);
    *ret = NULL;
    if (!cfg)
        cfg = &cfg_default;
    if (cfg->n_threads < 0)
        return -EINVAL;

    if (strcmp(name, "cpu") == 0) {
        ops = &backend_cpu_ops;
    } else if (strcmp(name, "cuda") == 0) {
        r = plugin_open(&dl, &ops);
        if (r < 0)
            return r;
    } else {
        log_debug("backend: unknown backend '%s' (known: %s)", name, backend_names());
        return -EINVAL;
    }

    impl = calloc(1, sizeof(*impl));
    if (!impl) {
        r = -ENOMEM;
        goto fail;
    }
    impl->dl = dl;
    impl->be.ops = ops;
    impl->be.device = cfg->device;
    r = ops->init(&impl->be, cfg);
    if (r < 0)
        goto fail;
    *ret = &impl->be;
    return 0;

fail:
    free(impl);
    if (dl)
        dlclose(dl);
    return r;
}

void backend_free(struct backend *be)
{
    struct backend_impl *impl = (struct backend_impl *)be;

    if (!be)
        return;
    if (be->ops && be->ops->free)
        be->ops->free(be);
    if (impl->dl)
        dlclose(impl->dl);
    free(impl);
}

/* ---- memory ---- */

int backend_buf_alloc(struct backend *be, size_t bytes, size_t align, void **ret)
{
    void *p;

    ASSERT(be && ret);
    ASSERT(align == 0 || (align & (align - 1)) == 0);
    *ret = NULL;
    if (be->ops->buf_alloc)
        return be->ops->buf_alloc(be, bytes, align, ret);
    if (align < sizeof(void *))
        align = sizeof(void *);
    if (posix_memalign(&p, align, bytes ? bytes : 1) != 0)
        return -ENOMEM;
    *ret = p;
    return 0;
}

void backend_buf_free(struct backend *be, void *p)
{
    ASSERT(be);
    if (!p)
        return;
    if (be->ops->buf_free)
        be->ops->buf_free(be, p);
    else
        free(p);
}

int backend_upload(struct backend *be, void *dst, const void *src, size_t n)
{
    ASSERT(be && (n == 0 || (dst && src)));
    if (be->ops->upload)
        return be->ops->upload(be, dst, src, n);
    if (n)
        memcpy(dst, src, n);
    return 0;
}

int backend_download(struct backend *be, void *dst, const void *src, size_t n)
{
    ASSERT(be && (n == 0 || (dst && src)));
    if (be->ops->download)
        return be->ops->download(be, dst, src, n);
    if (n)
        memcpy(dst, src, n);
    return 0;
}

int backend_sync(struct backend *be)
{
    ASSERT(be);
    return be->ops->sync ? be->ops->sync(be) : 0;
}

bool backend_supports(struct backend *be, const char *op, enum wfmt fmt)
{
    ASSERT(be && op);
    ASSERT(fmt >= 0 && fmt < _WFMT_MAX);
    return be->ops->supports ? be->ops->supports(be, op, fmt) : true;
}

static void bweight_check(const struct bweight *w)
{
    ASSERT(w);
    ASSERT(w->fmt >= 0 && w->fmt < _WFMT_MAX);
    ASSERT(w->rows > 0 && w->cols > 0);
    ASSERT(w->data || w->priv);
    if (w->fmt == WFMT_MXFP4)
        ASSERT(w->cols % 32 == 0 && (w->scale || w->priv));
}

int backend_weight_prepare(struct backend *be, struct bweight *w)
{
    ASSERT(be);
    bweight_check(w);
    return be->ops->weight_prepare ? be->ops->weight_prepare(be, w) : 0;
}

void backend_weight_release(struct backend *be, struct bweight *w)
{
    ASSERT(be && w);
    if (be->ops->weight_release)
        be->ops->weight_release(be, w);
}

/* ---- ops ---- */

#define OP_CALL(be, slot, ...) \
    ((be)->ops->slot ? (be)->ops->slot((be), __VA_ARGS__) : -ENOSYS)

int backend_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n,
                  float *out)
{
    ASSERT(be && ids && out && n >= 0);
    bweight_check(table);
    return OP_CALL(be, embed, table, ids, n, out);
}

int backend_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                    float eps, float *y)
{
    ASSERT(be && x && y && rows >= 0 && dim > 0);
    bweight_check(w);
    ASSERT(w->rows * w->cols == dim);
    return OP_CALL(be, rmsnorm, x, w, rows, dim, eps, y);
}

int backend_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y)
{
    ASSERT(be && x && y && n >= 0);
    bweight_check(w);
    return OP_CALL(be, matmul, w, x, n, y);
}

int backend_matmul_rows(struct backend *be, const struct bweight *w, const float *x, int n, float *y,
                        int64_t ldy, int64_t r0, int64_t r1)
{
    ASSERT(be && x && y && n >= 0);
    bweight_check(w);
    ASSERT(0 <= r0 && r0 <= r1 && r1 <= w->rows && ldy >= r1 - r0);
    ASSERT(r0 % 32 == 0 && (r1 % 32 == 0 || r1 == w->rows));
    return OP_CALL(be, matmul_rows, w, x, n, y, ldy, r0, r1);
}

int backend_rope(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
                 const int32_t *pos, const struct rope_freqs *f)
{
    ASSERT(be && x && pos && f && f->inv_freq);
    ASSERT(n_tok >= 0 && n_heads > 0 && head_dim > 0);
    ASSERT(f->rotary_dims > 0 && f->rotary_dims % 2 == 0 && f->rotary_dims <= head_dim);
    return OP_CALL(be, rope, x, n_tok, n_heads, head_dim, pos, f);
}

int backend_kv_store(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                     int n_tok, const int32_t *slots)
{
    ASSERT(be && kv && kv->k && kv->v && k && v && slots && n_tok >= 0);
    return OP_CALL(be, kv_store, kv, k, v, n_tok, slots);
}

int backend_attention(struct backend *be, const struct attn_args *a)
{
    ASSERT(be && a && a->q && a->out && a->kv);
    ASSERT(a->n_tok >= 0 && a->n_seqs >= 0 && a->seq_tok_start && a->seq_pos0);
    ASSERT(a->block_tables && a->block_table_off);
    ASSERT(a->n_heads > 0 && a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0);
    ASSERT(a->head_dim == a->kv->head_dim && a->n_kv_heads == a->kv->n_kv_heads);
    ASSERT(a->window >= 0);
    return OP_CALL(be, attention, a);
}

int backend_head_gate(struct backend *be, float *o, const float *g, int n_tok, int n_heads,
                      int head_dim)
{
    ASSERT(be && o && g && n_tok >= 0 && n_heads > 0 && head_dim > 0);
    return OP_CALL(be, head_gate, o, g, n_tok, n_heads, head_dim);
}

int backend_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
                   float limit, float *out)
{
    ASSERT(be && gate && up && out && n >= 0 && dim > 0 && limit >= 0.0f);
    return OP_CALL(be, swiglu, gate, up, n, dim, limit, out);
}

int backend_router(struct backend *be, const float *logits, const float *bias, int n_tok,
                   int n_exp, int top_k, bool renorm, float scale, int32_t *ids, float *weights)
{
    ASSERT(be && logits && ids && weights && n_tok >= 0);
    ASSERT(n_exp > 0 && top_k > 0 && top_k <= n_exp);
    return OP_CALL(be, router, logits, bias, n_tok, n_exp, top_k, renorm, scale, ids, weights);
}

int backend_argmax(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
                   float *vals)
{
    ASSERT(be && x && ids && rows >= 0 && n > 0 && k >= 1 && k <= BACKEND_ARGMAX_K_MAX && k <= n);
    return OP_CALL(be, argmax, x, rows, n, k, ids, vals);
}

int backend_row_expsum(struct backend *be, const float *x, int rows, int n, const float *mx,
                       const float *temps, double *sums)
{
    ASSERT(be && x && rows >= 0 && n > 0 && (rows == 0 || (mx && temps && sums)));
    return OP_CALL(be, row_expsum, x, rows, n, mx, temps, sums);
}

int backend_moe(struct backend *be, const struct moe_args *a)
{
    ASSERT(be && a && a->x && a->out && a->ids && a->weights);
    ASSERT(a->n_tok >= 0 && a->hidden > 0 && a->inter > 0 && a->top_k > 0);
    ASSERT(a->n_local >= 0 && a->expert_first >= 0 && (a->n_local == 0 || a->experts));
    ASSERT(a->limit >= 0.0f);
    return OP_CALL(be, moe, a);
}

int backend_add(struct backend *be, float *y, const float *x, size_t n)
{
    ASSERT(be && (n == 0 || (x && y)));
    return OP_CALL(be, add, y, x, n);
}

int backend_split_width(struct backend *be)
{
    ASSERT(be);
    return be->ops->split_width ? be->ops->split_width(be) : 1;
}

int backend_split_run(struct backend *be, int n_parts, bool together, backend_part_fn fn,
                      void *arg)
{
    ASSERT(be && fn && n_parts >= 1);
    if (!be->ops->split_run)
        return -ENOSYS;
    if (n_parts > backend_split_width(be))
        return -EINVAL;
    return be->ops->split_run(be, n_parts, together, fn, arg);
}

int backend_graph_begin(struct backend *be)
{
    ASSERT(be);
    return be->ops->graph_begin ? be->ops->graph_begin(be) : 0;
}

int backend_graph_end(struct backend *be)
{
    ASSERT(be);
    return be->ops->graph_end ? be->ops->graph_end(be) : 0;
}

/* ---- the GPU path ---- */

int backend_capture_begin(struct backend *be)
{
    ASSERT(be);
    return be->ops->capture_begin ? be->ops->capture_begin(be) : 0;
}

int backend_capture_end(struct backend *be, bool ok)
{
    ASSERT(be);
    return be->ops->capture_end ? be->ops->capture_end(be, ok) : 0;
}

bool backend_has_blocks(struct backend *be)
{
    ASSERT(be);
    return be->ops->attn_block && be->ops->ffn_block && be->ops->attn_prepare &&
           be->ops->ffn_prepare && backend_supports(be, "blocks", WFMT_BF16);
}

int backend_reserve(struct backend *be, const struct backend_reserve *r)
{
    ASSERT(be && r && r->max_tokens > 0 && r->max_seqs > 0 && r->hidden > 0);
    return be->ops->reserve ? be->ops->reserve(be, r) : 0;
}

int backend_step_begin(struct backend *be, const struct backend_step *s)
{
    ASSERT(be && s && s->n_tok >= 0 && s->n_seqs >= 0);
    ASSERT(s->n_tok == 0 || (s->ids && s->pos && s->seq_start && s->seq_pos0));
    return be->ops->step_begin ? be->ops->step_begin(be, s) : 0;
}

int backend_attn_prepare(struct backend *be, struct attn_weights *w)
{
    ASSERT(be && w && w->in_norm && w->wq && w->wk && w->wv && w->wo);
    return be->ops->attn_prepare ? be->ops->attn_prepare(be, w) : -ENOTSUP;
}

void backend_attn_release(struct backend *be, struct attn_weights *w)
{
    ASSERT(be && w);
    if (be->ops->attn_release && w->priv)
        be->ops->attn_release(be, w);
}

int backend_ffn_prepare(struct backend *be, struct ffn_weights *w)
{
    ASSERT(be && w && w->post_norm);
    ASSERT(w->router || (w->gate && w->up && w->down));
    ASSERT(!w->router || w->n_local == 0 || w->experts);
    return be->ops->ffn_prepare ? be->ops->ffn_prepare(be, w) : -ENOTSUP;
}

void backend_ffn_release(struct backend *be, struct ffn_weights *w)
{
    ASSERT(be && w);
    if (be->ops->ffn_release && w->priv)
        be->ops->ffn_release(be, w);
}

int backend_attn_block(struct backend *be, const struct attn_block_args *a)
{
    ASSERT(be && a && a->x && a->w && a->kv && a->n_tok >= 0 && a->n_seqs >= 0);
    ASSERT(a->n_tok == 0 || (a->pos && a->slots && a->seq_tok_start && a->seq_pos0 &&
                             a->block_tables && a->block_table_off));
    ASSERT(a->n_heads > 0 && a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0);
    ASSERT(a->head_dim == a->kv->head_dim && a->n_kv_heads == a->kv->n_kv_heads);
    return be->ops->attn_block ? be->ops->attn_block(be, a) : -ENOSYS;
}

int backend_ffn_block(struct backend *be, const struct ffn_block_args *a)
{
    ASSERT(be && a && a->x && a->w && a->n_tok >= 0 && a->hidden > 0);
    ASSERT(a->limit_dense >= 0.0f && a->limit_routed >= 0.0f);
    return be->ops->ffn_block ? be->ops->ffn_block(be, a) : -ENOSYS;
}

int backend_copy_rows(struct backend *be, void *dst, const int32_t *dst_rows, const void *src,
                      const int32_t *src_rows, int n, size_t row_bytes)
{
    ASSERT(be && n >= 0 && (n == 0 || (dst && src && row_bytes > 0)));
    return be->ops->copy_rows ? be->ops->copy_rows(be, dst, dst_rows, src, src_rows, n, row_bytes)
                              : -ENOSYS;
}

void *backend_native(struct backend *be, const char *what)
{
    ASSERT(be && what);
    return be->ops->native ? be->ops->native(be, what) : NULL;
}

int backend_mem_info(struct backend *be, size_t *ret_free, size_t *ret_total)
{
    ASSERT(be && ret_free && ret_total);
    return be->ops->mem_info ? be->ops->mem_info(be, ret_free, ret_total) : -ENOSYS;
}

void *backend_plugin_symbol(struct backend *be, const char *name)
{
    struct backend_impl *impl = (struct backend_impl *)be;

    ASSERT(be && name);
    return impl->dl ? dlsym(impl->dl, name) : NULL;
}
