/* model-load.c - the model's weights and memory: views into the loader's tensors,
 * validated against the config and prepared once on the backend (repack, upload, MXFP4
 * drafts), then the start-up reservation of every KV cache, activation and index buffer a
 * step can need; what model_new() (model-api.c) loads first and model_free() frees last.
 * Calls kernels/ and the loader only.  See model-int.h for the file map.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "model-int.h"
#include "mxfp4.h"
#include "tensors.h"

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

int model__own(struct model *m, void *p)
{
    return track(&m->owned, &m->n_owned, &m->cap_owned, p);
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
    m->buf_bytes += (int64_t)bytes;
    *(void **)ret = p;
    return 0;
}

/* --------------------------------------------------------------- weights -- */

int model__prepare(struct model *m, struct bweight *w, const char *name, struct err_buf *e)
{
    const char *own = w->name;
    int r;

    if (!own)
        w->name = name;     /* for the backend's messages, during the call only */
    r = backend_weight_prepare(m->be, w);
    w->name = own;
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

size_t model__row_bytes(const struct bweight *w, size_t *ret_scale)
{
    *ret_scale = 0;
    switch (w->fmt) {
    case WFMT_BF16: return (size_t)w->cols * 2;
    case WFMT_F32: return (size_t)w->cols * 4;
    case WFMT_MXFP4:
        *ret_scale = (size_t)w->cols / MXFP4_GROUP;
        return (size_t)w->cols / 2;
    default: return 0;
    }
}

int model__row_view(const struct bweight *w, int64_t r0, int64_t r1, struct bweight *out)
{
    size_t sb, rb = model__row_bytes(w, &sb);

    memset(out, 0, sizeof(*out));
    if (!rb)
        return -EINVAL;
    out->fmt = w->fmt;
    out->rows = r1 - r0;
    out->cols = w->cols;
    out->data = (const uint8_t *)w->data + (size_t)r0 * rb;
    out->scale = sb ? w->scale + (size_t)r0 * sb : NULL;
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
    r = model__own(m, buf);
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
    return model__prepare(m, w, name, e);
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
    return model__prepare(m, w, name, e);
}

/* A block-scaled FP8 ("<base>.weight" E4M3 + ".weight_scale_inv" F32 blocks) or NVFP4
 * ("<base>.weight" U8 nibbles + ".weight_scale" E4M3 per 16 + ".weight_scale_2" F32) linear
 * layer, v its .weight: kept in its format (docs/MODEL.md §5.6, §5.7). */
static int load_lowp(struct model *m, const char *base, const struct tview *v, int64_t rows, int64_t cols,
                     struct bweight *w, struct err_buf *e)
{
    char name[256];
    struct tview s, g;
    bool fp8 = v->dtype == DTYPE_F8_E4M3;
    int r;

    snprintf(name, sizeof(name), "%s.%s", base, fp8 ? "weight_scale_inv" : "weight_scale");
    r = ckpt_get(m->ckpt, name, &s);
    if (r < 0)
        return err_set(e, r, "tensor '%s' not available from the loader: %s", name, err_str(r));
    memset(w, 0, sizeof(*w));
    w->rows = rows;
    w->cols = cols;
    w->data = v->data;
    w->scale = s.data;
    if (fp8) {
        if (v->ndim != 2 || v->shape[0] != rows || v->shape[1] != cols || s.dtype != DTYPE_F32 || s.ndim != 2 ||
            s.shape[0] <= 0 || s.shape[1] <= 0 || rows % s.shape[0] || cols % s.shape[1] ||
            (cols / s.shape[1]) % 16)
            return err_set(e, -EINVAL, "%s: FP8 weight %s [%lld, %lld] with scales %s [%lld, %lld] does not fit "
                           "[%lld, %lld] in blocks of a multiple of 16 columns", base, dtype_name(v->dtype),
                           (long long)v->shape[0], (long long)(v->ndim > 1 ? v->shape[1] : 0), dtype_name(s.dtype),
                           (long long)s.shape[0], (long long)(s.ndim > 1 ? s.shape[1] : 0), (long long)rows,
                           (long long)cols);
        w->fmt = WFMT_FP8;
        w->blk_rows = (int32_t)(rows / s.shape[0]);
        w->blk_cols = (int32_t)(cols / s.shape[1]);
        return model__prepare(m, w, base, e);
    }
    snprintf(name, sizeof(name), "%s.weight_scale_2", base);
    r = ckpt_get(m->ckpt, name, &g);
    if (r < 0)
        return err_set(e, r, "%s.weight: U8 without '%s' (NVFP4) from the loader: %s", base, name, err_str(r));
    if (cols % 16 || v->ndim != 2 || v->shape[0] != rows || v->shape[1] != cols / 2 || s.dtype != DTYPE_F8_E4M3 ||
        s.ndim != 2 || s.shape[0] != rows || s.shape[1] != cols / 16 || g.dtype != DTYPE_F32 || tview_numel(&g) != 1)
        return err_set(e, -EINVAL, "%s: NVFP4 tensors do not fit [%lld, %lld] (U8 [%lld, %lld], E4M3 [%lld, %lld], "
                       "one F32 global scale expected)", base, (long long)rows, (long long)cols, (long long)rows,
                       (long long)cols / 2, (long long)rows, (long long)cols / 16);
    w->fmt = WFMT_NVFP4;
    memcpy(&w->gscale, g.data, sizeof(float));
    return model__prepare(m, w, base, e);
}

/* A linear layer "<base>.weight" (dense BF16/F32, or FP8 / NVFP4: load_lowp) or
 * "<base>.weight_packed" + ".weight_scale" (MXFP4).  rows/cols: expected local shape [out, in]. */
static int load_linear(struct model *m, const char *base, int64_t rows, int64_t cols,
                       struct bweight *w, struct err_buf *e)
{
    char name[256];
    struct tview v, s;
    int r;

    snprintf(name, sizeof(name), "%s.weight", base);
    r = ckpt_get(m->ckpt, name, &v);
    if (r == 0 && (v.dtype == DTYPE_F8_E4M3 || v.dtype == DTYPE_U8))
        return load_lowp(m, base, &v, rows, cols, w, e);
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
    return model__prepare(m, w, base, e);
}

/* inv_freq for one layer: f_i = theta^(-2i/R), llama3-scaled where the layer asks
 * (docs/MODEL.md §2.3 step 4). */
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
    r = model__prepare(m, &L->eh_e, name, e);
    if (r < 0)
        return r;
    return model__prepare(m, &L->eh_h, name, e);
}

/* The router bias (F32 or BF16 [n_experts]) as host floats. */
static int load_router_bias(struct model *m, struct mlayer *L, const char *name, struct err_buf *e)
{
    int n_experts = m->cfg->n_experts;
    struct tview v;
    float *b;
    int r = ckpt_get(m->ckpt, name, &v);

    if (r < 0)
        return err_set(e, r, "tensor '%s' not available from the loader: %s", name, err_str(r));
    if (tview_numel(&v) != n_experts)
        return err_set(e, -EINVAL, "%s: %lld elements, expected %d", name, (long long)tview_numel(&v),
                       n_experts);
    if (v.dtype != DTYPE_F32 && v.dtype != DTYPE_BF16)
        return err_set(e, -EINVAL, "%s: dtype %s not supported (F32 or BF16)", name, dtype_name(v.dtype));
    b = calloc((size_t)n_experts, sizeof(float));
    if (!b)
        return err_set(e, -ENOMEM, "out of memory");
    L->router_bias = b;
    for (int i = 0; i < n_experts; i++) {
        if (v.dtype == DTYPE_F32) {
            memcpy(&b[i], (const char *)v.data + 4 * (size_t)i, 4);
        } else {
            uint16_t h;
            uint32_t u;

            memcpy(&h, (const char *)v.data + 2 * (size_t)i, 2);
            u = (uint32_t)h << 16;
            memcpy(&b[i], &u, 4);
        }
    }
    return 0;
}

/* Where layer L keeps the weight of table row t (common/tensors.c); NULL for the rows with
 * readers of their own (the router bias, eh_proj). */
static struct bweight *layer_weight(struct mlayer *L, const struct tensor_ref *t)
{
    struct moe_expert *x = t->expert >= 0 ? &L->experts[t->expert - L->expert_first] : NULL;

    switch (t->spec->role) {
    case TENSOR_IN_NORM: return &L->in_norm;
    case TENSOR_POST_NORM: return &L->post_norm;
    case TENSOR_Q: return &L->wq;
    case TENSOR_K: return &L->wk;
    case TENSOR_V: return &L->wv;
    case TENSOR_O: return &L->wo;
    case TENSOR_G: return &L->wg;
    case TENSOR_Q_NORM: return &L->q_norm;
    case TENSOR_K_NORM: return &L->k_norm;
    /* the dense MLP and the shared expert share the layer's gate/up/down */
    case TENSOR_MLP_GATE: case TENSOR_SHARED_GATE: return &L->gate;
    case TENSOR_MLP_UP: case TENSOR_SHARED_UP: return &L->up;
    case TENSOR_MLP_DOWN: case TENSOR_SHARED_DOWN: return &L->down;
    case TENSOR_ROUTER: return &L->router;
    case TENSOR_EXPERT_GATE: return &x->gate;
    case TENSOR_EXPERT_UP: return &x->up;
    case TENSOR_EXPERT_DOWN: return &x->down;
    case TENSOR_ENORM: return &L->enorm;
    case TENSOR_HNORM: return &L->hnorm;
    case TENSOR_HEAD_NORM: return &L->head_norm;
    case TENSOR_HEAD_OUT: return &L->head;
    default: return NULL;
    }
}

struct layer_load {
    struct model *m;
    struct mlayer *L;
    struct err_buf *e;
};

/* One tensor of the table into layer L, in this rank's shape. */
static int load_tensor(void *ctx, const struct tensor_ref *t)
{
    struct layer_load *x = ctx;
    struct bweight *w = layer_weight(x->L, t);
    char n[200];

    switch (t->spec->role) {
    case TENSOR_ROUTER_BIAS:
        return load_router_bias(x->m, x->L, t->name, x->e);
    case TENSOR_EH_PROJ:
        snprintf(n, sizeof(n), "%s.weight", t->name);
        return split_eh(x->m, x->L, n, x->e);
    default:
        break;
    }
    if (!w)
        return err_set(x->e, -EINVAL, "%s: no place for it in layer %d", t->name, x->L->idx);
    if (t->spec->dtype == TENSOR_DT_LINEAR) {
        int r = load_linear(x->m, t->name, t->shape[0], t->shape[1], w, x->e);

        /* the router on the exact BF16 kernels (as the CUDA one's FP32 GEMV) */
        w->exact = r == 0 && t->spec->role == TENSOR_ROUTER;
        return r;
    }
    return load_vec(x->m, t->name, t->shape[0], w, x->e);
}

static int load_layer(struct model *m, struct mlayer *L, int idx, struct err_buf *e)
{
    const struct model_config *cfg = m->cfg;
    const struct layer_config *lc = &cfg->layers[idx];
    struct layer_load ctx = { m, L, e };
    int world = m->sharded ? m->comm.world : 1;
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

    if (L->is_moe) {
        int first, count;

        if (cfg->shared_expert_dim % world)
            return err_set(e, -EINVAL, "layer %d: shared expert dim %d does not split over %d ranks",
                           idx, cfg->shared_expert_dim, world);
        L->inter = cfg->shared_expert_dim / world;
        ckpt_expert_range(m->ckpt, &first, &count);
        if (count <= 0 || first < 0 || first + count > cfg->n_experts)
            return err_set(e, -EINVAL, "loader expert range [%d, %d) invalid for %d experts", first,
                           first + count, cfg->n_experts);
        L->expert_first = first;
        L->n_local = count;
        L->experts = calloc((size_t)count, sizeof(*L->experts));
        if (!L->experts)
            return err_set(e, -ENOMEM, "out of memory");
    } else {
        if (cfg->intermediate_size % world)
            return err_set(e, -EINVAL, "layer %d: intermediate size %d does not split over %d ranks",
                           idx, cfg->intermediate_size, world);
        L->inter = cfg->intermediate_size / world;
    }
    L->has_ffn_dense = L->inter > 0;
    /* every tensor the table gives this layer, as this rank holds it */
    r = tensor_layer_each(cfg, idx, world, L->expert_first, L->n_local, load_tensor, &ctx);
    if (r < 0)
        return r;
    return build_freqs(m, L, e);
}

/* ---------------------------------------------------------- reservation -- */

static int reserve_kv(struct model *m, struct mlayer *L, struct err_buf *e)
{
    struct kv_layer *kv = &L->kv;
    size_t per, bytes;
    int r;

    kv->dtype_f32 = m->o.kv_f32 ? 1 : 0;
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

int model__reserve(struct model *m, struct err_buf *e)
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
    {
        /* a GPU backend plans its device memory once (kernels/backend.h) */
        struct backend_reserve br = {
            .max_tokens = (int)T, .max_seqs = (int)S, .hidden = (int)H, .max_heads = (int)hmax,
            .max_q_dim = (int)qmax, .max_kv_dim = (int)kvmax, .max_inter = (int)imax,
            .max_block_ids = m->table_cap,
        };
        for (int i = 0; i < m->n_layers + m->n_mtp; i++) {
            const struct mlayer *L = &m->layers[i];
            br.max_kv_heads = br.max_kv_heads > L->n_kv_heads ? br.max_kv_heads : L->n_kv_heads;
            br.max_head_dim = br.max_head_dim > L->head_dim ? br.max_head_dim : L->head_dim;
            if (L->is_moe) {
                br.n_experts = m->cfg->n_experts;
                br.top_k = m->cfg->top_k;
                br.moe_inter = m->cfg->moe_intermediate_size;
                br.max_local_experts = br.max_local_experts > L->n_local ? br.max_local_experts
                                                                         : L->n_local;
            }
        }
        r = backend_reserve(m->be, &br);
        if (r < 0)
            return err_set(e, r, "the backend cannot plan its memory for %zu tokens per step: %s",
                           T, err_str(r));
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
    r = r ? r : host_i32(&m->h_img_row, T);
    if (!r && m->sharded) {     /* the greedy and sampled rows' pairs (model__trunk_logits) */
        size_t W = (size_t)m->comm.world, RK = R * BACKEND_ARGMAX_K_MAX;

        r = host_i32(&m->am_id, RK);
        m->am_pairs = calloc((W * 2 + 1) * RK + 1, sizeof(float));
        if (!r && !m->am_pairs)
            r = -ENOMEM;
        if (m->am_pairs)
            m->am_val = m->am_pairs + W * 2 * RK;
    }
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
    int n_kv = (m->mtp_tp ? m->n_layers : m->n_layers + m->n_mtp) + (m->mtp_tp ? 2 * m->n_mtp : 0);
    for (int i = 0; i < n_kv; i++) {
        const struct mlayer *L = i < m->n_layers + (m->mtp_tp ? 0 : m->n_mtp)
                                     ? &m->layers[i] : &m->tp_half[i - m->n_layers];
        m->kv_block_bytes[L->group] += 2 * (int64_t)m->o.block_size * L->n_kv_heads *
                                       L->head_dim * (m->o.kv_f32 ? 4 : 2);
    }
    if (m->o.kv_blocks) {
        r = m->o.kv_blocks(m->o.kv_blocks_ctx, m->kv_block_bytes, m->o.n_blocks, e);
        if (r < 0)
            return r;
    }
    for (int i = 0; i < n_kv; i++) {
        struct mlayer *L = i < m->n_layers + (m->mtp_tp ? 0 : m->n_mtp)
                               ? &m->layers[i] : &m->tp_half[i - m->n_layers];
        r = reserve_kv(m, L, e);
        if (r < 0)
            return r;
    }
    return 0;
}

void model_kv_block_bytes(const struct model *m, int64_t ret[_KV_GROUP_MAX])
{
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        ret[g] = m->kv_block_bytes[g];
}

void model_reserved_bytes(const struct model *m, int64_t *ret_activations, int64_t *ret_kv)
{
    int64_t kv = 0;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        kv += m->group_used[g] ? m->kv_block_bytes[g] * m->o.n_blocks[g] : 0;
    *ret_activations = m->buf_bytes - kv;
    *ret_kv = kv;
}

/* ----------------------------------------------------------------- load -- */

int model__load(struct ckpt *c, struct backend *be, const struct model_comm *comm,
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
    r = model__prepare(m, &m->embed, "model.embed_tokens.weight", e);
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
        r = model__prepare(m, &m->lm_head, "lm_head (tied)", e);
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
    *ret = m;
    return 0;
out:
    model__unload(m);
    return r;
}

void model__unload(struct model *m)
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
    free(m->am_id);
    free(m->am_pairs);
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
    free(m->h_img_row);
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

