/* vision.c - the vision encoder on the backend (vision.h; docs/ARCHITECTURE.md "Vision
 * encoder").  The GEMMs go through backend_matmul (BF16 weights as loaded, FP32
 * activations); attention is two GEMMs per view and head with FP32 "weights" (K, then Vᵀ);
 * the rest are the host kernels of kernels/vision-ops.h.  On a backend whose buffers are
 * device memory (CUDA: backend_native(be, "vision"), kernels/vision-dev.h) every vector
 * and activation lives on the device and the same sequence runs on the device ops
 * (encode_dev); only the output comes back to the host. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vision-dev.h"
#include "vision-ops.h"
#include "vision.h"

#define LN_EPS 1e-5f
#define ROPE_THETA 10000.0

/* CLIP mean/std of the reference processor (vLLM Step3VisionProcessor) */
static const float img_mean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
static const float img_std[3] = {0.26862954f, 0.26130258f, 0.27577711f};

/* the device path's activation buffers (encode_dev) */
enum { VB_X, VB_HS, VB_A, VB_QKV, VB_O, VB_M, VB_D1, VB_D2, VB_Y, VB_RGB, VB_N };

struct vblock {
    struct bweight qkv, out, fc, proj;
    float *qkv_b, *out_b, *fc_b, *proj_b, *ln1_g, *ln1_b, *ln2_g, *ln2_b, *ls1, *ls2;
};

struct vision {
    struct vision_config cfg;
    struct backend *be;
    const struct vision_dev_ops *dev;   /* the backend's device ops, or NULL: host buffers */
    struct bweight conv1, ds1, ds2, projector;
    float *pos;                 /* [grid^2, width] */
    float *ln_pre_g, *ln_pre_b, *ds1_b, *ds2_b;
    struct vblock *blocks;
    struct bweight **prepared;
    int n_prepared;
    float **vecs;               /* every FP32 vector above (device buffers with dev), for vision_free */
    int n_vecs;
    /* the memory plan (vision_plan, dev): buffers for calls of up to plan_t patches (plan_t1,
     * plan_t2 after each downsampler, views of up to plan_side pixels); 0: none, each call
     * allocates its own */
    void *pbuf[VB_N];
    int64_t plan_t, plan_t1, plan_t2;
    int plan_side;
};

const struct vision_config *vision_cfg(const struct vision *v)
{
    return &v->cfg;
}

static int get_view(struct vision *v, const char *name, struct tview *t, struct ckpt *c, struct err_buf *e)
{
    int r = ckpt_get(c, name, t);

    if (r < 0)
        return err_set(e, r, "vision tensor '%s' not available from the loader: %s", name, err_str(r));
    if (t->dtype != DTYPE_BF16 && t->dtype != DTYPE_F32)
        return err_set(e, -EINVAL, "%s: dtype %s, expected BF16 or F32", name, dtype_name(t->dtype));
    (void) v;
    return 0;
}

/* A weight [rows, numel / rows] (convolutions flattened to [out, in*kh*kw]), prepared. */
static int load_w(struct vision *v, struct ckpt *c, const char *name, int64_t rows, struct bweight *w,
                  struct err_buf *e)
{
    struct tview t;
    int r = get_view(v, name, &t, c, e);

    if (r < 0)
        return r;
    memset(w, 0, sizeof(*w));
    w->fmt = t.dtype == DTYPE_BF16 ? WFMT_BF16 : WFMT_F32;
    w->rows = rows;
    w->cols = tview_numel(&t) / rows;
    w->data = t.data;
    if (w->rows * w->cols != tview_numel(&t))
        return err_set(e, -EINVAL, "%s: %lld elements do not make %lld rows", name,
                       (long long) tview_numel(&t), (long long) rows);
    r = backend_weight_prepare(v->be, w);
    if (r < 0)
        return err_set(e, r, "%s: backend '%s' cannot prepare weight [%lld, %lld]: %s", name,
                       v->be->ops->name, (long long) w->rows, (long long) w->cols, err_str(r));
    v->prepared[v->n_prepared++] = w;
    return 0;
}

/* An FP32 copy of a vector (or table) of n elements. */
static int load_vec(struct vision *v, struct ckpt *c, const char *name, int64_t n, float **ret,
                    struct err_buf *e)
{
    struct tview t;
    float *x;
    int r = get_view(v, name, &t, c, e);

    if (r < 0)
        return r;
    if (tview_numel(&t) != n)
        return err_set(e, -EINVAL, "%s: %lld elements, expected %lld", name, (long long) tview_numel(&t),
                       (long long) n);
    x = malloc((size_t) n * sizeof(float));
    if (!x)
        return err_set(e, -ENOMEM, "out of memory");
    for (int64_t i = 0; i < n; i++) {
        if (t.dtype == DTYPE_F32) {
            memcpy(&x[i], (const char *) t.data + i * 4, 4);
        } else {
            uint16_t b;
            uint32_t u;
            memcpy(&b, (const char *) t.data + i * 2, 2);
            u = (uint32_t) b << 16;
            memcpy(&x[i], &u, 4);
        }
    }
    if (v->dev) {
        void *d = NULL;
        r = backend_buf_alloc(v->be, (size_t) n * sizeof(float), 256, &d);
        if (r == 0)
            r = backend_upload(v->be, d, x, (size_t) n * sizeof(float));
        if (r == 0)
            r = backend_sync(v->be);
        free(x);
        if (r < 0) {
            if (d)
                backend_buf_free(v->be, d);
            return err_set(e, r, "%s: cannot copy %lld floats to backend '%s': %s", name, (long long) n,
                           v->be->ops->name, err_str(r));
        }
        x = (float *) d;
    }
    v->vecs[v->n_vecs++] = x;
    *ret = x;
    return 0;
}

int vision_new(struct ckpt *c, struct backend *be, struct vision **ret, struct err_buf *e)
{
    const struct vision_config *cfg = ckpt_vision(c);
    struct vision *v;
    char nm[VISION_NAME_MAX];
    int64_t C, I, L;
    int r;

    *ret = NULL;
    if (!cfg)
        return err_set(e, -ENOENT, "the checkpoint plan has no vision tower");
    C = cfg->width;
    I = cfg->inter;
    L = cfg->layers;
    v = calloc(1, sizeof(*v));
    if (!v)
        return err_set(e, -ENOMEM, "out of memory");
    v->cfg = *cfg;
    v->be = be;
    v->dev = backend_native(be, "vision");
    {
        size_t fr, tot;
        /* device buffers (the backend reports device memory) need the backend's own ops */
        if (!v->dev && backend_mem_info(be, &fr, &tot) == 0) {
            r = err_set(e, -ENOTSUP, "backend '%s' has device buffers but no vision ops "
                        "(backend_native \"vision\")", be->ops->name);
            goto fail;
        }
    }
    v->blocks = calloc((size_t) L, sizeof(*v->blocks));
    v->prepared = calloc((size_t) (4 * L + 4), sizeof(*v->prepared));
    v->vecs = calloc((size_t) (10 * L + 5), sizeof(*v->vecs));
    if (!v->blocks || !v->prepared || !v->vecs) {
        r = err_set(e, -ENOMEM, "out of memory");
        goto fail;
    }
#define TRY(x) do { r = (x); if (r < 0) goto fail; } while (0)
    TRY(load_w(v, c, "vision_model.conv1.weight", C, &v->conv1, e));
    TRY(load_vec(v, c, "vision_model.positional_embedding", (int64_t) cfg->grid * cfg->grid * C, &v->pos, e));
    TRY(load_vec(v, c, "vision_model.ln_pre.weight", C, &v->ln_pre_g, e));
    TRY(load_vec(v, c, "vision_model.ln_pre.bias", C, &v->ln_pre_b, e));
    for (int l = 0; l < L; l++) {
        struct vblock *b = &v->blocks[l];
#define NM(s) (snprintf(nm, sizeof(nm), "vision_model.transformer.resblocks.%d.%s", l, s), nm)
        TRY(load_w(v, c, NM("attn.in_proj_weight"), 3 * C, &b->qkv, e));
        TRY(load_vec(v, c, NM("attn.in_proj_bias"), 3 * C, &b->qkv_b, e));
        TRY(load_w(v, c, NM("attn.out_proj.weight"), C, &b->out, e));
        TRY(load_vec(v, c, NM("attn.out_proj.bias"), C, &b->out_b, e));
        TRY(load_vec(v, c, NM("ln_1.weight"), C, &b->ln1_g, e));
        TRY(load_vec(v, c, NM("ln_1.bias"), C, &b->ln1_b, e));
        TRY(load_vec(v, c, NM("ln_2.weight"), C, &b->ln2_g, e));
        TRY(load_vec(v, c, NM("ln_2.bias"), C, &b->ln2_b, e));
        TRY(load_vec(v, c, NM("ls_1.gamma"), C, &b->ls1, e));
        TRY(load_vec(v, c, NM("ls_2.gamma"), C, &b->ls2, e));
        TRY(load_w(v, c, NM("mlp.c_fc.weight"), I, &b->fc, e));
        TRY(load_vec(v, c, NM("mlp.c_fc.bias"), I, &b->fc_b, e));
        TRY(load_w(v, c, NM("mlp.c_proj.weight"), C, &b->proj, e));
        TRY(load_vec(v, c, NM("mlp.c_proj.bias"), C, &b->proj_b, e));
#undef NM
    }
    TRY(load_w(v, c, "vision_model.vit_downsampler1.weight", 2 * C, &v->ds1, e));
    TRY(load_vec(v, c, "vision_model.vit_downsampler1.bias", 2 * C, &v->ds1_b, e));
    TRY(load_w(v, c, "vision_model.vit_downsampler2.weight", 4 * C, &v->ds2, e));
    TRY(load_vec(v, c, "vision_model.vit_downsampler2.bias", 4 * C, &v->ds2_b, e));
    TRY(load_w(v, c, "vit_large_projector.weight", cfg->text_hidden, &v->projector, e));
#undef TRY
    *ret = v;
    return 0;
fail:
    vision_free(v);
    return r;
}

void vision_free(struct vision *v)
{
    if (!v)
        return;
    for (int i = 0; v->prepared && i < v->n_prepared; i++)
        backend_weight_release(v->be, v->prepared[i]);
    for (int i = 0; v->vecs && i < v->n_vecs; i++)
        if (v->dev)
            backend_buf_free(v->be, v->vecs[i]);
        else
            free(v->vecs[i]);
    for (int i = 0; i < VB_N; i++)
        if (v->pbuf[i])
            backend_buf_free(v->be, v->pbuf[i]);
    free(v->prepared);
    free(v->vecs);
    free(v->blocks);
    free(v);
}

int vision_view_tokens(const struct vision *v, int size)
{
    int g;

    if (size <= 0 || size % v->cfg.patch || size > v->cfg.image_size)
        return -EINVAL;
    g = vops_s2_side(vops_s2_side(size / v->cfg.patch));
    return g * g;
}

/* one view's bookkeeping inside a call */
struct vview {
    int g, g1, g2;              /* grid sides: ViT, after ds1, after ds2 */
    int64_t t0, t1, t2;         /* first row of the view in each stage's batch */
};

static void *xmalloc_f(int64_t n)
{
    return malloc((size_t) (n > 0 ? n : 1) * sizeof(float));
}

/* Per-part scratch of the attention: scores [n, n], q, k, vᵀ, out of one head. */
struct attn_scratch {
    float *s, *qh, *kh, *vt, *oh;
};

/* One head of one view's bidirectional attention on backend be: qkv [n, 3C] rows (RoPE
 * applied to q, k), o [n, C] (this head's columns). */
static int head_attention(struct vision *v, struct backend *be, const float *qkv, int64_t n, int h, float *o,
                          const struct attn_scratch *w)
{
    int C = v->cfg.width, D = v->cfg.head_dim;
    struct bweight kw = {.fmt = WFMT_F32, .rows = n, .cols = D, .data = w->kh};
    struct bweight vw = {.fmt = WFMT_F32, .rows = D, .cols = n, .data = w->vt};
    int r;

    for (int64_t t = 0; t < n; t++) {
        memcpy(w->qh + t * D, qkv + t * 3 * C + (int64_t) h * D, (size_t) D * sizeof(float));
        memcpy(w->kh + t * D, qkv + t * 3 * C + C + (int64_t) h * D, (size_t) D * sizeof(float));
        for (int d = 0; d < D; d++)
            w->vt[(int64_t) d * n + t] = qkv[t * 3 * C + 2 * C + (int64_t) h * D + d];
    }
    r = backend_matmul(be, &kw, w->qh, (int) n, w->s);         /* s [n, n] = q kᵀ */
    if (r < 0)
        return r;
    vops_softmax_rows(w->s, n, n, 1.0f / sqrtf((float) D));
    r = backend_matmul(be, &vw, w->s, (int) n, w->oh);         /* oh [n, D] = p v */
    if (r < 0)
        return r;
    for (int64_t t = 0; t < n; t++)
        memcpy(o + t * C + (int64_t) h * D, w->oh + t * D, (size_t) D * sizeof(float));
    return 0;
}

struct attn_job {
    struct vision *v;
    const float *qkv;
    int64_t n;
    float *o;
    const struct attn_scratch *w;   /* [n_parts] */
    int n_parts;
    int err[2];
};

/* split_run part: heads part, part + n_parts, ... on the part's one-thread backend, so the
 * softmax and the copies run on every core, not only the GEMMs */
static void attn_part(void *arg, int part, struct backend *sub)
{
    struct attn_job *j = arg;

    for (int h = part; h < j->v->cfg.heads && !j->err[part]; h += j->n_parts)
        j->err[part] = head_attention(j->v, sub, j->qkv, j->n, h, j->o, &j->w[part]);
}

/* Bidirectional attention of one view: heads split over the backend's parts when it has
 * them (CPU, 2 threads), else head by head on the whole backend. */
static int view_attention(struct vision *v, const float *qkv, int64_t n, float *o, const struct attn_scratch *w,
                          int n_parts)
{
    struct attn_job j = {.v = v, .qkv = qkv, .n = n, .o = o, .w = w, .n_parts = n_parts};
    int r;

    if (n_parts > 1) {
        r = backend_split_run(v->be, n_parts, false, attn_part, &j);
        return r < 0 ? r : j.err[0] < 0 ? j.err[0] : j.err[1];
    }
    for (int h = 0; h < v->cfg.heads; h++) {
        r = head_attention(v, v->be, qkv, n, h, o, &w[0]);
        if (r < 0)
            return r;
    }
    return 0;
}

/* ---- the device path (v->dev): the sequence of vision_encode on device buffers ---- */

/* a stage of view i to the trace, through a host copy */
static int trace_dev(struct vision *v, vision_trace_fn trace, void *arg, enum vision_stage st, int view,
                     const float *x, int64_t rows, int cols)
{
    size_t bytes = (size_t) rows * cols * sizeof(float);
    float *h = malloc(bytes ? bytes : 1);
    int r;

    if (!h)
        return -ENOMEM;
    r = backend_download(v->be, h, x, bytes);
    if (r == 0)
        r = backend_sync(v->be);
    if (r == 0)
        trace(arg, st, view, h, (int) rows, cols);
    free(h);
    return r;
}

/* The bytes of the device path's buffers for a call of T patches (T1, T2 after each
 * downsampler), views of up to side pixels. */
static void dev_sizes(const struct vision_config *cf, int64_t T, int64_t T1, int64_t T2, int side,
                      int64_t bytes[VB_N])
{
    int64_t C = cf->width, xs = T * 3 * (int64_t) cf->patch * cf->patch;

    xs = T1 * 9 * C > xs ? T1 * 9 * C : xs;
    xs = T2 * 18 * C > xs ? T2 * 18 * C : xs;
    bytes[VB_X] = xs * 4; bytes[VB_HS] = T * C * 4; bytes[VB_A] = T * C * 4; bytes[VB_QKV] = T * 3 * C * 4;
    bytes[VB_O] = T * C * 4; bytes[VB_M] = T * cf->inter * 4; bytes[VB_D1] = T1 * 2 * C * 4;
    bytes[VB_D2] = T2 * 4 * C * 4; bytes[VB_Y] = T2 * cf->text_hidden * 4;
    bytes[VB_RGB] = (int64_t) side * side * 3;
}

/* The most FP32 elements one GEMM of such a call takes in (rows x k): the backend's
 * workspace converts them (vision_dev_ops.reserve). */
static int64_t dev_gemm_elems(const struct vision_config *cf, int64_t T, int64_t T1, int64_t T2)
{
    int64_t C = cf->width, k[] = {T * 3 * (int64_t) cf->patch * cf->patch, T * C, T * cf->inter,
                                  T1 * 9 * C, T2 * 18 * C, T2 * 4 * C};
    int64_t m = 0;

    for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++)
        m = k[i] > m ? k[i] : m;
    return m;
}

static int dev_bufs_alloc(struct backend *be, const int64_t bytes[VB_N], void *buf[VB_N])
{
    int r = 0;

    for (int i = 0; i < VB_N && r == 0; i++)
        r = backend_buf_alloc(be, (size_t) (bytes[i] > 0 ? bytes[i] : 1), 256, &buf[i]);
    if (r < 0)
        for (int i = 0; i < VB_N; i++) {
            if (buf[i])
                backend_buf_free(be, buf[i]);
            buf[i] = NULL;
        }
    return r;
}

/* Views [0, n) of one part of a call (vv's rows counted from the part's first; base: the
 * index of view 0 in the call, for the trace) on the buffers buf, out its output rows. */
static int encode_dev_part(struct vision *v, const struct vision_view *views, const struct vview *vv, int n,
                           int base, int64_t T, int64_t T1, int64_t T2, void *const buf[VB_N], float *out,
                           vision_trace_fn trace, void *trace_arg, struct err_buf *e)
{
    const struct vision_config *cf = &v->cfg;
    const struct vision_dev_ops *d = v->dev;
    struct backend *be = v->be;
    int C = cf->width, P = cf->patch, I = cf->inter, H = cf->text_hidden;
    int64_t K1 = 3 * (int64_t) P * P;
    float *x = buf[VB_X], *h = buf[VB_HS], *a = buf[VB_A], *qkv = buf[VB_QKV], *o = buf[VB_O], *m = buf[VB_M];
    float *d1 = buf[VB_D1], *d2 = buf[VB_D2], *y = buf[VB_Y];
    uint8_t *rgb = buf[VB_RGB];
    int r = 0;

#define DO(call, what) do { \
        r = (call); \
        if (r < 0) { err_set(e, r, "vision: %s failed on backend '%s': %s", what, be->ops->name, err_str(r)); goto out; } \
    } while (0)
#define GEMM(w, in, rows, y_) DO(backend_matmul(be, (w), (in), (int) (rows), (y_)), "matmul")
#define TRACE(st, i, p, rows, cols) do { \
        if (trace) DO(trace_dev(v, trace, trace_arg, (st), base + (i), (p), (rows), (cols)), "trace"); \
    } while (0)

    /* patch embedding: each view's pixels up (one buffer, the stream orders the reuse) */
    for (int i = 0; i < n; i++) {
        DO(backend_upload(be, rgb, views[i].rgb, (size_t) views[i].size * views[i].size * 3), "upload");
        DO(d->patchify(be, rgb, views[i].size, P, img_mean, img_std, x + vv[i].t0 * K1), "patchify");
    }
    GEMM(&v->conv1, x, T, h);
    for (int i = 0; i < n; i++) {
        DO(d->bilinear(be, v->pos, cf->grid, vv[i].g, C, h + vv[i].t0 * C, 1), "bilinear");
        TRACE(VISION_PATCH_EMBED, i, h + vv[i].t0 * C, (int64_t) vv[i].g * vv[i].g, C);
    }
    DO(d->layernorm(be, h, v->ln_pre_g, v->ln_pre_b, T, C, LN_EPS, h), "layernorm");
    for (int l = 0; l < cf->layers; l++) {
        struct vblock *b = &v->blocks[l];

        DO(d->layernorm(be, h, b->ln1_g, b->ln1_b, T, C, LN_EPS, a), "layernorm");
        GEMM(&b->qkv, a, T, qkv);
        DO(d->bias_act(be, qkv, b->qkv_b, T, 3 * C, 0), "bias");
        for (int i = 0; i < n; i++) {
            float *q = qkv + vv[i].t0 * 3 * C;
            DO(d->rope2d(be, q, vv[i].g, 3 * C, cf->heads, cf->head_dim, ROPE_THETA), "rope2d");
            DO(d->rope2d(be, q + C, vv[i].g, 3 * C, cf->heads, cf->head_dim, ROPE_THETA), "rope2d");
            DO(d->attention(be, q, (int64_t) vv[i].g * vv[i].g, cf->heads, cf->head_dim, o + vv[i].t0 * C),
               "attention");
        }
        GEMM(&b->out, o, T, a);
        DO(d->scale_add(be, h, b->ls1, a, b->out_b, T, C), "layerscale");
        DO(d->layernorm(be, h, b->ln2_g, b->ln2_b, T, C, LN_EPS, a), "layernorm");
        GEMM(&b->fc, a, T, m);
        DO(d->bias_act(be, m, b->fc_b, T, I, 1), "bias + quick-GELU");
        GEMM(&b->proj, m, T, a);
        DO(d->scale_add(be, h, b->ls2, a, b->proj_b, T, C), "layerscale");
        if (l == 0)
            for (int i = 0; i < n; i++)
                TRACE(VISION_BLOCK0, i, h + vv[i].t0 * C, (int64_t) vv[i].g * vv[i].g, C);
    }
    for (int i = 0; i < n; i++)
        TRACE(VISION_VIT, i, h + vv[i].t0 * C, (int64_t) vv[i].g * vv[i].g, C);
    for (int i = 0; i < n; i++)
        DO(d->im2col_s2(be, h + vv[i].t0 * C, vv[i].g, C, x + vv[i].t1 * 9 * C), "im2col");
    GEMM(&v->ds1, x, T1, d1);
    DO(d->bias_act(be, d1, v->ds1_b, T1, 2 * C, 0), "bias");
    for (int i = 0; i < n; i++)
        TRACE(VISION_DS1, i, d1 + vv[i].t1 * 2 * C, (int64_t) vv[i].g1 * vv[i].g1, 2 * C);
    for (int i = 0; i < n; i++)
        DO(d->im2col_s2(be, d1 + vv[i].t1 * 2 * C, vv[i].g1, 2 * C, x + vv[i].t2 * 18 * C), "im2col");
    GEMM(&v->ds2, x, T2, d2);
    DO(d->bias_act(be, d2, v->ds2_b, T2, 4 * C, 0), "bias");
    for (int i = 0; i < n; i++)
        TRACE(VISION_DS2, i, d2 + vv[i].t2 * 4 * C, (int64_t) vv[i].g2 * vv[i].g2, 4 * C);
    GEMM(&v->projector, d2, T2, y);
    DO(backend_download(be, out, y, (size_t) T2 * H * sizeof(float)), "download");
    DO(backend_sync(be), "sync");
    if (trace)
        for (int i = 0; i < n; i++)
            trace(trace_arg, VISION_PROJ, base + i, out + vv[i].t2 * H, vv[i].g2 * vv[i].g2, H);
#undef TRACE
#undef GEMM
#undef DO
out:
    return r;
}

static int encode_dev(struct vision *v, const struct vision_view *views, const struct vview *vv, int n,
                      int64_t T, int64_t T1, int64_t T2, float *out, vision_trace_fn trace, void *trace_arg,
                      struct err_buf *e)
{
    const int H = v->cfg.text_hidden;
    struct vview *pv;
    int r = 0;

    if (!v->plan_t) {
        /* no plan: this call's own buffers */
        void *buf[VB_N] = {0};
        int64_t bytes[VB_N];
        int side = 0;
        for (int i = 0; i < n; i++)
            side = views[i].size > side ? views[i].size : side;
        dev_sizes(&v->cfg, T, T1, T2, side, bytes);
        r = dev_bufs_alloc(v->be, bytes, buf);
        if (r < 0)
            return err_set(e, r, "vision: %lld patches: no device memory for the activations: %s", (long long) T,
                           err_str(r));
        r = encode_dev_part(v, views, vv, n, 0, T, T1, T2, buf, out, trace, trace_arg, e);
        if (r < 0)
            (void) backend_sync(v->be);     /* nothing queued may still use the buffers */
        for (int i = 0; i < VB_N; i++)
            backend_buf_free(v->be, buf[i]);
        return r;
    }
    /* the plan's buffers: the views in parts that fit them, in order (a view's rows do not
     * depend on the others of its call) */
    pv = calloc((size_t) n, sizeof(*pv));
    if (!pv)
        return err_set(e, -ENOMEM, "out of memory");
    for (int i0 = 0, i1; i0 < n && r == 0; i0 = i1) {
        int64_t t = 0, t1 = 0, t2 = 0;
        for (i1 = i0; i1 < n; i1++) {
            const struct vview *w = &vv[i1];
            int64_t gg = (int64_t) w->g * w->g, gg1 = (int64_t) w->g1 * w->g1, gg2 = (int64_t) w->g2 * w->g2;
            if (views[i1].size > v->plan_side || t + gg > v->plan_t || t1 + gg1 > v->plan_t1 ||
                t2 + gg2 > v->plan_t2)
                break;
            pv[i1] = (struct vview){w->g, w->g1, w->g2, t, t1, t2};
            t += gg;
            t1 += gg1;
            t2 += gg2;
        }
        if (i1 == i0) {
            r = err_set(e, -E2BIG, "vision: view %d (%d pixels) is larger than the memory plan's views (%d)", i0,
                        views[i0].size, v->plan_side);
            break;
        }
        r = encode_dev_part(v, views + i0, pv + i0, i1 - i0, i0, t, t1, t2, v->pbuf, out + vv[i0].t2 * H, trace,
                            trace_arg, e);
    }
    if (r < 0)
        (void) backend_sync(v->be);         /* the next call may reuse the buffers */
    free(pv);
    return r;
}

int vision_plan(struct vision *v, int max_views, int max_side, int64_t *ret_bytes, struct err_buf *e)
{
    const struct vision_config *cf = &v->cfg;
    int g = max_side / cf->patch, g1 = vops_s2_side(g), g2 = vops_s2_side(g1);
    int64_t T, T1, T2, bytes[VB_N], act = 0, gemm;
    size_t ws = 0, fr, tot;
    char why[96] = "";
    int r;

    if (ret_bytes)
        *ret_bytes = 0;
    if (max_views < 1)
        return err_set(e, -EINVAL, "vision plan: %d views per call, expected at least 1", max_views);
    if (vision_view_tokens(v, max_side) < 0)
        return err_set(e, -EINVAL, "vision plan: views of %d pixels: not a multiple of the patch %d up to %d",
                       max_side, cf->patch, cf->image_size);
    if (!v->dev)
        return 0;       /* host buffers: each call allocates its own */
    T = (int64_t) max_views * g * g;
    T1 = (int64_t) max_views * g1 * g1;
    T2 = (int64_t) max_views * g2 * g2;
    dev_sizes(cf, T, T1, T2, max_side, bytes);
    for (int i = 0; i < VB_N; i++)
        act += bytes[i];
    gemm = dev_gemm_elems(cf, T, T1, T2);
    if (!v->dev->reserve || !v->dev->ws_need)
        return err_set(e, -ENOTSUP, "backend '%s': its vision ops cannot plan their memory", v->be->ops->name);
    for (int i = 0; i < VB_N; i++)
        if (v->pbuf[i]) {
            backend_buf_free(v->be, v->pbuf[i]);
            v->pbuf[i] = NULL;
        }
    v->plan_t = v->plan_t1 = v->plan_t2 = 0;
    /* the activations first, the workspace (which only grows) last: a refused plan leaves the
     * device memory as it was, the workspace its size */
    ws = v->dev->ws_need(v->be, gemm, (int64_t) g * g, cf->heads, cf->head_dim);
    r = dev_bufs_alloc(v->be, bytes, v->pbuf);
    if (r == 0 && (r = v->dev->reserve(v->be, gemm, (int64_t) g * g, cf->heads, cf->head_dim, &ws)) < 0)
        for (int i = 0; i < VB_N; i++) {
            backend_buf_free(v->be, v->pbuf[i]);
            v->pbuf[i] = NULL;
        }
    if (r < 0) {
        if (backend_mem_info(v->be, &fr, &tot) == 0)
            snprintf(why, sizeof(why), " (%zu of %zu bytes free)", fr, tot);
        return err_set(e, r, "the vision encoder needs %lld bytes of device memory for %d views of %d patches "
                       "(%lld of activations, %zu of workspace) and backend '%s' cannot give them%s: %s",
                       (long long) act + (long long) ws, max_views, g * g, (long long) act, ws,
                       v->be->ops->name, why, err_str(r));
    }
    v->plan_t = T;
    v->plan_t1 = T1;
    v->plan_t2 = T2;
    v->plan_side = max_side;
    if (ret_bytes)
        *ret_bytes = act + (int64_t) ws;
    return 0;
}

int vision_encode(struct vision *v, const struct vision_view *views, int n, float *out,
                  vision_trace_fn trace, void *trace_arg, struct err_buf *e)
{
    const struct vision_config *cf = &v->cfg;
    int C = cf->width, P = cf->patch, I = cf->inter;
    int64_t T = 0, T1 = 0, T2 = 0, nmax = 0, K1 = 3 * (int64_t) P * P;
    struct vview *vv;
    float *x = NULL, *h = NULL, *a = NULL, *qkv = NULL, *o = NULL, *m = NULL, *d1 = NULL, *d2 = NULL;
    struct attn_scratch w[2] = {{0}};
    int n_parts = backend_split_width(v->be) >= 2 ? 2 : 1;
    int r = 0;

    if (n <= 0)
        return err_set(e, -EINVAL, "no views to encode");
    vv = calloc((size_t) n, sizeof(*vv));
    if (!vv)
        return err_set(e, -ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) {
        if (!views[i].rgb || vision_view_tokens(v, views[i].size) < 0) {
            r = err_set(e, -EINVAL, "view %d: side %d is not a multiple of the patch %d up to %d", i,
                        views[i].size, P, cf->image_size);
            goto out;
        }
        vv[i].g = views[i].size / P;
        vv[i].g1 = vops_s2_side(vv[i].g);
        vv[i].g2 = vops_s2_side(vv[i].g1);
        vv[i].t0 = T;
        vv[i].t1 = T1;
        vv[i].t2 = T2;
        T += (int64_t) vv[i].g * vv[i].g;
        T1 += (int64_t) vv[i].g1 * vv[i].g1;
        T2 += (int64_t) vv[i].g2 * vv[i].g2;
        nmax = (int64_t) vv[i].g * vv[i].g > nmax ? (int64_t) vv[i].g * vv[i].g : nmax;
    }
    if (v->dev) {
        r = encode_dev(v, views, vv, n, T, T1, T2, out, trace, trace_arg, e);
        goto out;
    }
    {
        int64_t xs = T * K1;                                    /* patches, then im2col */
        xs = T1 * 9 * C > xs ? T1 * 9 * C : xs;
        xs = T2 * 18 * C > xs ? T2 * 18 * C : xs;
        x = xmalloc_f(xs);
    }
    h = xmalloc_f(T * C);
    a = xmalloc_f(T * C);
    qkv = xmalloc_f(T * 3 * C);
    o = xmalloc_f(T * C);
    m = xmalloc_f(T * I);
    d1 = xmalloc_f(T1 * 2 * C);
    d2 = xmalloc_f(T2 * 4 * C);
    for (int p = 0; p < n_parts; p++) {
        w[p].s = xmalloc_f(nmax * nmax);
        w[p].qh = xmalloc_f(nmax * cf->head_dim);
        w[p].kh = xmalloc_f(nmax * cf->head_dim);
        w[p].vt = xmalloc_f(nmax * cf->head_dim);
        w[p].oh = xmalloc_f(nmax * cf->head_dim);
    }
    if (!x || !h || !a || !qkv || !o || !m || !d1 || !d2 || !w[0].s || !w[0].qh || !w[0].kh || !w[0].vt ||
        !w[0].oh || (n_parts > 1 && (!w[1].s || !w[1].qh || !w[1].kh || !w[1].vt || !w[1].oh))) {
        r = err_set(e, -ENOMEM, "out of memory for %d views (%lld patches)", n, (long long) T);
        goto out;
    }
#define GEMM(w, in, rows, y) do { \
        r = backend_matmul(v->be, (w), (in), (int) (rows), (y)); \
        if (r < 0) { err_set(e, r, "vision: matmul failed: %s", err_str(r)); goto out; } \
    } while (0)

    /* patch embedding: normalise + patchify, one GEMM for every view, + position table */
    for (int i = 0; i < n; i++)
        vops_patchify(views[i].rgb, views[i].size, P, img_mean, img_std, x + vv[i].t0 * K1);
    GEMM(&v->conv1, x, T, h);
    for (int i = 0; i < n; i++) {
        int64_t gg = (int64_t) vv[i].g * vv[i].g;
        vops_bilinear(v->pos, cf->grid, vv[i].g, C, a);
        for (int64_t k = 0; k < gg * C; k++)
            h[vv[i].t0 * C + k] += a[k];
        if (trace)
            trace(trace_arg, VISION_PATCH_EMBED, i, h + vv[i].t0 * C, (int) gg, C);
    }
    vops_layernorm(h, v->ln_pre_g, v->ln_pre_b, T, C, LN_EPS, h);

    for (int l = 0; l < cf->layers; l++) {
        struct vblock *b = &v->blocks[l];

        vops_layernorm(h, b->ln1_g, b->ln1_b, T, C, LN_EPS, a);
        GEMM(&b->qkv, a, T, qkv);
        vops_bias_add(qkv, b->qkv_b, T, 3 * C);
        for (int i = 0; i < n; i++) {
            float *q = qkv + vv[i].t0 * 3 * C;
            vops_rope2d(q, vv[i].g, 3 * C, cf->heads, cf->head_dim, ROPE_THETA);        /* q */
            vops_rope2d(q + C, vv[i].g, 3 * C, cf->heads, cf->head_dim, ROPE_THETA);    /* k */
            r = view_attention(v, q, (int64_t) vv[i].g * vv[i].g, o + vv[i].t0 * C, w, n_parts);
            if (r < 0) {
                err_set(e, r, "vision: attention failed: %s", err_str(r));
                goto out;
            }
        }
        GEMM(&b->out, o, T, a);
        vops_bias_add(a, b->out_b, T, C);
        vops_scale_add(h, b->ls1, a, T, C);
        vops_layernorm(h, b->ln2_g, b->ln2_b, T, C, LN_EPS, a);
        GEMM(&b->fc, a, T, m);
        vops_bias_add(m, b->fc_b, T, I);
        vops_quick_gelu(m, (size_t) (T * I));
        GEMM(&b->proj, m, T, a);
        vops_bias_add(a, b->proj_b, T, C);
        vops_scale_add(h, b->ls2, a, T, C);
        if (l == 0 && trace)
            for (int i = 0; i < n; i++)
                trace(trace_arg, VISION_BLOCK0, i, h + vv[i].t0 * C, vv[i].g * vv[i].g, C);
    }
    if (trace)
        for (int i = 0; i < n; i++)
            trace(trace_arg, VISION_VIT, i, h + vv[i].t0 * C, vv[i].g * vv[i].g, C);

    /* downsamplers: im2col of every view, one GEMM each */
    for (int i = 0; i < n; i++)
        vops_im2col_s2(h + vv[i].t0 * C, vv[i].g, C, x + vv[i].t1 * 9 * C);
    GEMM(&v->ds1, x, T1, d1);
    vops_bias_add(d1, v->ds1_b, T1, 2 * C);
    if (trace)
        for (int i = 0; i < n; i++)
            trace(trace_arg, VISION_DS1, i, d1 + vv[i].t1 * 2 * C, vv[i].g1 * vv[i].g1, 2 * C);
    for (int i = 0; i < n; i++)
        vops_im2col_s2(d1 + vv[i].t1 * 2 * C, vv[i].g1, 2 * C, x + vv[i].t2 * 18 * C);
    GEMM(&v->ds2, x, T2, d2);
    vops_bias_add(d2, v->ds2_b, T2, 4 * C);
    if (trace)
        for (int i = 0; i < n; i++)
            trace(trace_arg, VISION_DS2, i, d2 + vv[i].t2 * 4 * C, vv[i].g2 * vv[i].g2, 4 * C);
    GEMM(&v->projector, d2, T2, out);
    if (trace)
        for (int i = 0; i < n; i++)
            trace(trace_arg, VISION_PROJ, i, out + vv[i].t2 * cf->text_hidden, vv[i].g2 * vv[i].g2,
                  cf->text_hidden);
#undef GEMM
    r = 0;
out:
    free(x); free(h); free(a); free(qkv); free(o); free(m); free(d1); free(d2);
    for (int p = 0; p < 2; p++) {
        free(w[p].s); free(w[p].qh); free(w[p].kh); free(w[p].vt); free(w[p].oh);
    }
    free(vv);
    return r;
}

int vision_splice(const int32_t *ids, int n_tok, int32_t image_token_id, const float *emb, int n_emb,
                  int *cursor, float *x, int hidden)
{
    int need = 0, c = *cursor;

    for (int i = 0; i < n_tok; i++)
        need += ids[i] == image_token_id;
    if (c < 0 || need > n_emb - c)
        return -ERANGE;
    for (int i = 0; i < n_tok; i++)
        if (ids[i] == image_token_id)
            memcpy(x + (int64_t) i * hidden, emb + (int64_t) c++ * hidden, (size_t) hidden * sizeof(float));
    *cursor = c;
    return need;
}
