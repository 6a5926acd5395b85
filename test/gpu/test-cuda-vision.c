/* test-cuda-vision.c - the vision encoder on the CUDA backend against the CPU (issue 40).
 *
 *   test-cuda-vision ops                      each op of backend_native(cuda, "vision")
 *                                             (kernels/cuda/vision.cu) against its vops_
 *                                             namesake of kernels/cpu/vision-ops.c
 *   test-cuda-vision tower MODEL_DIR [SIZE..] the model's vision tower (worker/model/vision.c)
 *                                             on the CUDA backend against the CPU encoder,
 *                                             every stage of every view (sizes in pixels,
 *                                             default 140 98 42: bilinear-resized position
 *                                             tables, odd grids for the stride-2 convs);
 *                                             and a backend with device memory but no
 *                                             vision ops is refused at vision_new
 *   test-cuda-vision plan MODEL_DIR [PATH]     the encoder's memory plan (vision_plan): it
 *                                             takes the device memory it names at load;
 *                                             views of 42 and 28 pixels (3 x 3 and 2 x 2
 *                                             patches) encoded after a plan of one 42 view
 *                                             run in two parts on its buffers: no device
 *                                             allocation (the free memory seen from every
 *                                             stage unchanged), no "not planned" line, the
 *                                             output of a call without a plan; a view
 *                                             larger than the plan's is refused; a device
 *                                             too small for a plan refuses it naming the
 *                                             need (planning only, no encoder run).  PATH
 *                                             'exact' or 'fast' runs that CUDA path only
 *
 * Both CUDA paths: the FP32 op path (backend_cfg.mxfp4_exact) and the tensor-core path
 * (BF16 activations into the cuBLASLt GEMMs).  Fresh random inputs each run (the seed is
 * printed; STEPD_TEST_SEED replays it); device outputs are poisoned (NaN) first, so an
 * element an op does not write fails.  Max error per op / stage printed.  Exits 77
 * (skipped) when the plugin or a GPU is absent; in the suite it runs on the host emulator
 * (test/cuemu: cuemu-vision-ops, cuemu-vision-tower, and cuemu-vision-plan on the
 * tensor-core path only).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "harness.h"
#include "gpu-test.h"
#include "loader.h"
#include "vision-dev.h"
#include "vision-ops.h"
#include "vision.h"

static struct backend *cpu;
static const struct vision_dev_ops *dev;
static bool fast;

/* max |got - ref| / max(1, max |ref|): the error relative to the output's scale */
static double max_err(const float *ref, const float *got, size_t n)
{
    double worst = 0, scale = 1;
    for (size_t i = 0; i < n; i++)
        scale = fabs(ref[i]) > scale ? fabs(ref[i]) : scale;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]) / scale;
        if (!(d <= worst))
            worst = isnan(d) ? INFINITY : d;
    }
    return worst;
}

static void compare(const char *what, const float *ref, const void *d, size_t n, double tol)
{
    float *got = malloc((n ? n : 1) * sizeof(float));
    double worst;
    ASSERT_TRUE(got);
    ASSERT_OK(backend_download(gpu, got, d, n * sizeof(float)));
    ASSERT_OK(backend_sync(gpu));
    worst = max_err(ref, got, n);
    printf("%-28s n=%-8zu max err %.3g (tol %.1g)\n", what, n, worst, tol);
    if (!(worst <= tol))
        FAIL("%s: max error %g above %g", what, worst, tol);
    free(got);
}

/* ---- ops ---- */

static void test_layernorm(int64_t rows, int dim)
{
    float *x = rnd((size_t)(rows * dim), 3.0f), *g = rnd((size_t)dim, 1.0f), *b = rnd((size_t)dim, 0.5f);
    float *ref = malloc((size_t)(rows * dim) * sizeof(float));
    void *dx = dup_dev(x, (size_t)(rows * dim) * 4), *dg = dup_dev(g, (size_t)dim * 4), *db = dup_dev(b, (size_t)dim * 4);
    void *dy = poisoned((size_t)(rows * dim) * 4);
    char what[64];

    for (int64_t i = 0; i < rows * dim; i++)
        x[i] += 2.0f;   /* a mean away from 0: the two-pass variance */
    ASSERT_OK(backend_upload(gpu, dx, x, (size_t)(rows * dim) * 4));
    vops_layernorm(x, g, b, rows, dim, 1e-5f, ref);
    ASSERT_OK(dev->layernorm(gpu, dx, dg, db, rows, dim, 1e-5f, dy));
    snprintf(what, sizeof(what), "layernorm %lldx%d", (long long)rows, dim);
    compare(what, ref, dy, (size_t)(rows * dim), 2e-6);
    ASSERT_OK(dev->layernorm(gpu, dx, dg, db, rows, dim, 1e-5f, dx));     /* in place */
    snprintf(what, sizeof(what), "layernorm %lldx%d in place", (long long)rows, dim);
    compare(what, ref, dx, (size_t)(rows * dim), 2e-6);
    free(x); free(g); free(b); free(ref);
    backend_buf_free(gpu, dx); backend_buf_free(gpu, dg); backend_buf_free(gpu, db); backend_buf_free(gpu, dy);
}

static void test_bias_scale(int64_t rows, int dim)
{
    size_t n = (size_t)(rows * dim);
    float *y = rnd(n, 4.0f), *b = rnd((size_t)dim, 1.0f), *gm = rnd((size_t)dim, 0.2f), *h = rnd(n, 2.0f);
    float *ref = malloc(n * sizeof(float)), *hr = malloc(n * sizeof(float));
    void *dy = dup_dev(y, n * 4), *db = dup_dev(b, (size_t)dim * 4), *dgm = dup_dev(gm, (size_t)dim * 4);
    void *dh = dup_dev(h, n * 4);

    memcpy(ref, y, n * sizeof(float));
    vops_bias_add(ref, b, rows, dim);
    ASSERT_OK(dev->bias_act(gpu, dy, db, rows, dim, 0));
    compare("bias add", ref, dy, n, 0);
    /* LayerScale residual with the bias fused: h += gamma * (y + b) */
    memcpy(hr, h, n * sizeof(float));
    vops_scale_add(hr, gm, ref, rows, dim);
    ASSERT_OK(backend_upload(gpu, dy, y, n * 4));
    ASSERT_OK(dev->scale_add(gpu, dh, dgm, dy, db, rows, dim));
    compare("layerscale + bias", hr, dh, n, 1e-6);
    vops_scale_add(hr, gm, y, rows, dim);
    ASSERT_OK(dev->scale_add(gpu, dh, dgm, dy, NULL, rows, dim));
    compare("layerscale", hr, dh, n, 1e-6);
    /* bias + quick-GELU */
    vops_quick_gelu(ref, n);
    ASSERT_OK(dev->bias_act(gpu, dy, db, rows, dim, 1));
    compare("bias + quick-GELU", ref, dy, n, 1e-6);
    free(y); free(b); free(gm); free(h); free(ref); free(hr);
    backend_buf_free(gpu, dy); backend_buf_free(gpu, db); backend_buf_free(gpu, dgm); backend_buf_free(gpu, dh);
}

static void test_rope2d(int g, int heads, int hd)
{
    int C = heads * hd;
    size_t n = (size_t)g * g * 3 * C;
    float *x = rnd(n, 2.0f);
    void *dx = dup_dev(x, n * 4);
    char what[64];

    /* q and k of a qkv row: ld 3C, the v third untouched */
    vops_rope2d(x, g, 3 * C, heads, hd, 10000.0);
    vops_rope2d(x + C, g, 3 * C, heads, hd, 10000.0);
    ASSERT_OK(dev->rope2d(gpu, dx, g, 3 * C, heads, hd, 10000.0));
    ASSERT_OK(dev->rope2d(gpu, (float *)dx + C, g, 3 * C, heads, hd, 10000.0));
    snprintf(what, sizeof(what), "rope2d g=%d %dx%d", g, heads, hd);
    compare(what, x, dx, n, 1e-6);
    free(x);
    backend_buf_free(gpu, dx);
}

static void test_patchify(int size, int P)
{
    static const float mean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
    static const float sd[3] = {0.26862954f, 0.26130258f, 0.27577711f};
    size_t np = (size_t)size * size * 3, n = (size_t)(size / P) * (size / P) * 3 * P * P;
    uint8_t *rgb = malloc(np);
    float *ref = malloc(n * sizeof(float));
    void *drgb, *dout = poisoned(n * 4);

    for (size_t i = 0; i < np; i++)
        rgb[i] = (uint8_t)(frand() * 128 + 128);
    drgb = dup_dev(rgb, np);
    vops_patchify(rgb, size, P, mean, sd, ref);
    ASSERT_OK(dev->patchify(gpu, drgb, size, P, mean, sd, dout));
    compare("patchify + normalise", ref, dout, n, 1e-6);
    free(rgb); free(ref);
    backend_buf_free(gpu, drgb); backend_buf_free(gpu, dout);
}

static void test_bilinear(int g0, int g, int C)
{
    size_t n = (size_t)g * g * C;
    float *src = rnd((size_t)g0 * g0 * C, 1.0f), *ref = malloc(n * sizeof(float)), *base = rnd(n, 1.0f);
    void *ds = dup_dev(src, (size_t)g0 * g0 * C * 4), *dd = poisoned(n * 4);
    char what[64];

    vops_bilinear(src, g0, g, C, ref);
    ASSERT_OK(dev->bilinear(gpu, ds, g0, g, C, dd, 0));
    snprintf(what, sizeof(what), "bilinear %d->%d", g0, g);
    compare(what, ref, dd, n, 1e-6);
    /* add into an activation (the patch embedding) */
    ASSERT_OK(backend_upload(gpu, dd, base, n * 4));
    for (size_t i = 0; i < n; i++)
        ref[i] += base[i];
    ASSERT_OK(dev->bilinear(gpu, ds, g0, g, C, dd, 1));
    snprintf(what, sizeof(what), "bilinear %d->%d add", g0, g);
    compare(what, ref, dd, n, 1e-6);
    free(src); free(ref); free(base);
    backend_buf_free(gpu, ds); backend_buf_free(gpu, dd);
}

static void test_im2col(int g, int C)
{
    int go = vops_s2_side(g);
    size_t n = (size_t)go * go * 9 * C;
    float *x = rnd((size_t)g * g * C, 1.0f), *ref = malloc(n * sizeof(float));
    void *dx = dup_dev(x, (size_t)g * g * C * 4), *dc = poisoned(n * 4);
    char what[64];

    vops_im2col_s2(x, g, C, ref);
    ASSERT_OK(dev->im2col_s2(gpu, dx, g, C, dc));
    snprintf(what, sizeof(what), "im2col s2 g=%d C=%d", g, C);
    compare(what, ref, dc, n, 0);
    free(x); free(ref);
    backend_buf_free(gpu, dx); backend_buf_free(gpu, dc);
}

/* one view's attention: the host reference is the CPU encoder's (GEMM on the CPU backend,
 * vops_softmax_rows, GEMM), per head */
static void test_attention(int64_t n, int heads, int D)
{
    int C = heads * D;
    float *qkv = rnd((size_t)(n * 3 * C), 2.0f), *ref = malloc((size_t)(n * C) * sizeof(float));
    float *s = malloc((size_t)(n * n) * sizeof(float));
    void *dq = dup_dev(qkv, (size_t)(n * 3 * C) * 4), *dout = poisoned((size_t)(n * C) * 4);
    char what[64];

    for (int h = 0; h < heads; h++) {
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < n; j++) {
                double acc = 0;
                for (int d = 0; d < D; d++)
                    acc += (double)qkv[i * 3 * C + h * D + d] * qkv[j * 3 * C + C + h * D + d];
                s[i * n + j] = (float)acc;
            }
        vops_softmax_rows(s, n, n, 1.0f / sqrtf((float)D));
        for (int64_t i = 0; i < n; i++)
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int64_t j = 0; j < n; j++)
                    acc += (double)s[i * n + j] * qkv[j * 3 * C + 2 * C + h * D + d];
                ref[i * C + h * D + d] = (float)acc;
            }
    }
    ASSERT_OK(dev->attention(gpu, dq, n, heads, D, dout));
    snprintf(what, sizeof(what), "attention n=%lld %dx%d", (long long)n, heads, D);
    compare(what, ref, dout, (size_t)(n * C), 2e-6);
    free(qkv); free(ref); free(s);
    backend_buf_free(gpu, dq); backend_buf_free(gpu, dout);
}

static void run_ops(bool emulated)
{
    test_layernorm(37, 96);
    test_layernorm(5, emulated ? 1536 : 6144);
    test_bias_scale(23, 75);
    test_rope2d(5, 3, 16);
    test_rope2d(7, 2, 64);
    test_patchify(42, 14);
    test_bilinear(5, 3, 7);
    test_bilinear(4, 7, 5);
    test_bilinear(6, 6, 3);
    test_im2col(7, 5);
    test_im2col(4, 3);
    test_attention(49, 2, 16);
    test_attention(emulated ? 100 : 1296, 3, emulated ? 32 : 96);
}

/* ---- the tower ---- */

#define MAX_VIEWS 8

struct trace {
    float *ref[_VISION_STAGES][MAX_VIEWS];    /* the CPU run's stages */
    size_t n[_VISION_STAGES][MAX_VIEWS];
    double worst[_VISION_STAGES];
    bool record;
};

static void on_stage(void *arg, enum vision_stage st, int view, const float *x, int rows, int cols)
{
    struct trace *t = arg;
    size_t n = (size_t)rows * cols;

    if (t->record) {
        t->ref[st][view] = malloc(n * sizeof(float));
        ASSERT_TRUE(t->ref[st][view]);
        memcpy(t->ref[st][view], x, n * sizeof(float));
        t->n[st][view] = n;
        return;
    }
    ASSERT_EQ(t->n[st][view], n);
    double e = max_err(t->ref[st][view], x, n);
    t->worst[st] = e > t->worst[st] || isnan(e) ? e : t->worst[st];
}

/* a backend that reports device memory but gives no vision ops (the CPU's ops otherwise) */
static int fake_mem_info(struct backend *be, size_t *ret_free, size_t *ret_total)
{
    (void)be;
    *ret_free = *ret_total = (size_t)1 << 30;
    return 0;
}

static void *fake_native(struct backend *be, const char *what)
{
    (void)be; (void)what;
    return NULL;
}

static void refuse_device_without_ops(struct ckpt *ck)
{
    struct backend_ops ops = *cpu->ops;
    struct backend fb = *cpu;
    struct vision *v = NULL;
    struct err_buf e = {{0}};

    ops.mem_info = fake_mem_info;
    ops.native = fake_native;
    fb.ops = &ops;
    ASSERT_ERR(vision_new(ck, &fb, &v, &e), -ENOTSUP);
    ASSERT_TRUE(v == NULL);
    ASSERT_CONTAINS(e.msg, "no vision ops");
    printf("a device backend without vision ops: %s\n", e.msg);
}

static const char *const stage_name[_VISION_STAGES] = {"patch_embed", "block0", "vit", "ds1", "ds2",
                                                       "proj"};

static void tower(const char *model, const int *sizes, int n_views, const char *cuda_path)
{
    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct err_buf e = {{0}};
    struct ckpt *ck;
    struct vision *vc, *vg;
    struct vision_view views[MAX_VIEWS];
    struct trace tr = {.record = true};
    int tokens = 0;
    float *out_c, *out_g;
    /* the FP32 op path differs from the CPU by summation order only; the tensor-core path
     * rounds the GEMMs' activations to BF16 (2^-9), as AMX-BF16 hosts do on the CPU
     * (test/model/test-vision.c TOL_STAGE_BF16_ACT 3e-2; measured on the emulator: 4.1e-3
     * exact path 3.4e-7) */
    double tol = fast ? 1.5e-2 : 1e-5;

    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    if (!fast)
        refuse_device_without_ops(ck);
    if (vision_new(ck, cpu, &vc, &e) < 0)
        FAIL("%s", e.msg);
    if (vision_new(ck, gpu, &vg, &e) < 0)
        FAIL("cuda: %s", e.msg);
    for (int i = 0; i < n_views; i++) {
        size_t np = (size_t)sizes[i] * sizes[i] * 3;
        uint8_t *rgb = malloc(np);
        int k = vision_view_tokens(vc, sizes[i]);
        ASSERT_TRUE(rgb && k > 0);
        for (size_t j = 0; j < np; j++)
            rgb[j] = (uint8_t)(frand() * 128 + 128);
        views[i] = (struct vision_view){rgb, sizes[i]};
        tokens += k;
    }
    int H = vision_cfg(vc)->text_hidden;
    out_c = malloc((size_t)tokens * H * sizeof(float));
    out_g = malloc((size_t)tokens * H * sizeof(float));
    ASSERT_TRUE(out_c && out_g);
    if (vision_encode(vc, views, n_views, out_c, on_stage, &tr, &e) < 0)
        FAIL("cpu encode: %s", e.msg);
    tr.record = false;
    memset(out_g, 0xFF, (size_t)tokens * H * sizeof(float));
    if (vision_encode(vg, views, n_views, out_g, on_stage, &tr, &e) < 0)
        FAIL("cuda encode: %s", e.msg);
    for (int s = 0; s < _VISION_STAGES; s++)
        printf("tower %-7s %-12s max err %.3g of max|ref| (tol %.2g)\n", cuda_path, stage_name[s], tr.worst[s], tol);
    double w = max_err(out_c, out_g, (size_t)tokens * H);
    printf("tower %-7s output       %d views, %d tokens x %d: max err %.3g (tol %.2g)\n", cuda_path, n_views,
           tokens, H, w, tol);
    for (int s = 0; s < _VISION_STAGES; s++)
        if (!(tr.worst[s] <= tol))
            FAIL("stage %s: max error %g above %g", stage_name[s], tr.worst[s], tol);
    if (!(w <= tol))
        FAIL("encoder output: max error %g above %g", w, tol);
    /* the same views one call each: the device buffers of a call hold no state */
    int off = 0;
    for (int i = 0; i < n_views; i++) {
        if (vision_encode(vg, &views[i], 1, out_c + (size_t)off * H, NULL, NULL, &e) < 0)
            FAIL("cuda encode view %d: %s", i, e.msg);
        off += vision_view_tokens(vg, sizes[i]);
    }
    w = max_err(out_g, out_c, (size_t)tokens * H);
    printf("tower %-7s per-view calls against one call: max err %.3g\n", cuda_path, w);
    if (!(w <= tol))
        FAIL("per-view calls differ from one call by %g", w);
    /* a bad view is refused with the message, the encoder still works */
    struct vision_view bad = {views[0].rgb, sizes[0] + 1};
    ASSERT_ERR(vision_encode(vg, &bad, 1, out_g, NULL, NULL, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "not a multiple of the patch");
    for (int s = 0; s < _VISION_STAGES; s++)
        for (int i = 0; i < n_views; i++)
            free(tr.ref[s][i]);
    for (int i = 0; i < n_views; i++)
        free((void *)views[i].rgb);
    free(out_c); free(out_g);
    vision_free(vg);
    vision_free(vc);
    ckpt_close(ck);
}

struct mem_watch {
    size_t lowest;          /* the least free device memory seen from a stage */
    int stages;
};

static void on_stage_mem(void *arg, enum vision_stage st, int view, const float *x, int rows, int cols)
{
    struct mem_watch *m = arg;
    size_t fr, tot;

    (void)st; (void)view; (void)x; (void)rows; (void)cols;
    ASSERT_OK(backend_mem_info(gpu, &fr, &tot));
    m->lowest = fr < m->lowest ? fr : m->lowest;
    m->stages++;
}

static void plan(const char *model, double tol)
{
    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct err_buf e = {{0}};
    struct ckpt *ck;
    struct vision *v, *v0;
    size_t fr0, fr1, fr2, tot;
    int64_t planned;
    char path[] = "/tmp/test-cuda-vision-XXXXXX";
    /* the smallest views that need parts: a plan of one 3 x 3 view, a call of two */
    enum { NV = 2, PLAN_SIDE = 42 };
    int sizes[NV] = {PLAN_SIDE, 28}, tokens = 0;
    struct vision_view views[NV];

    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    if (vision_new(ck, gpu, &v, &e) < 0 || vision_new(ck, gpu, &v0, &e) < 0)
        FAIL("cuda: %s", e.msg);
    const struct vision_config *cf = vision_cfg(v);

    /* the worker's order: the encoder's plan, then the text model's (a small one) */
    ASSERT_ERR(vision_plan(v, 1, PLAN_SIDE + 1, &planned, &e), -EINVAL);
    ASSERT_OK(backend_mem_info(gpu, &fr0, &tot));
    if (vision_plan(v, 1, PLAN_SIDE, &planned, &e) < 0)
        FAIL("vision_plan: %s", e.msg);
    ASSERT_OK(backend_mem_info(gpu, &fr1, &tot));
    struct backend_reserve br = {.max_tokens = 4, .max_seqs = 1, .hidden = cf->text_hidden, .max_heads = 1,
                                 .max_kv_heads = 1, .max_head_dim = 16, .max_q_dim = 16, .max_kv_dim = 16,
                                 .max_inter = 16, .max_block_ids = 4};
    ASSERT_OK(backend_reserve(gpu, &br));
    ASSERT_OK(backend_mem_info(gpu, &fr2, &tot));
    printf("plan: %lld bytes planned for 1 view of %d pixels; free device memory %zu -> %zu (-%zu), "
           "after the text plan %zu\n", (long long)planned, PLAN_SIDE, fr0, fr1, fr0 - fr1, fr2);
    if (!(planned > 0 && fr0 - fr1 >= (size_t)planned))
        FAIL("the plan took %zu bytes of device memory, it names %lld", fr0 - fr1, (long long)planned);

    for (int i = 0; i < NV; i++) {
        size_t np = (size_t)sizes[i] * sizes[i] * 3;
        uint8_t *rgb = malloc(np);
        ASSERT_TRUE(rgb);
        for (size_t j = 0; j < np; j++)
            rgb[j] = (uint8_t)(frand() * 255);
        views[i] = (struct vision_view){rgb, sizes[i]};
        tokens += vision_view_tokens(v, sizes[i]);
    }
    size_t out_n = (size_t)tokens * cf->text_hidden;
    float *out = malloc(out_n * sizeof(float)), *ref = malloc(out_n * sizeof(float));
    ASSERT_TRUE(out && ref);
    if (vision_encode(v0, views, NV, ref, NULL, NULL, &e) < 0)
        FAIL("encode without a plan: %s", e.msg);
    /* two views for a plan of one: two parts, on the plan's buffers */
    struct mem_watch mw = {.lowest = (size_t)-1};
    int fd = mkstemp(path), saved = dup(2);
    ASSERT_TRUE(fd >= 0 && saved >= 0);
    fflush(stderr);
    dup2(fd, 2);
    memset(out, 0xFF, out_n * sizeof(float));
    int r = vision_encode(v, views, NV, out, on_stage_mem, &mw, &e);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char log[4096] = "";
    ssize_t n = pread(fd, log, sizeof(log) - 1, 0);
    log[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
    fputs(log, stderr);
    if (r < 0)
        FAIL("encode: %s", e.msg);
    double w = max_err(ref, out, out_n);
    printf("plan: views of %d and %d pixels: %d stages seen, least free device memory %zu (%zu before); "
           "against a call without a plan max err %.3g (tol %.2g)\n", sizes[0], sizes[1], mw.stages, mw.lowest,
           fr2, w, tol);
    ASSERT_EQ(mw.stages, NV * _VISION_STAGES);
    if (mw.lowest != fr2)
        FAIL("an encoder call allocated %zu bytes of device memory after the plan", fr2 - mw.lowest);
    if (strstr(log, "not planned"))
        FAIL("the workspace grew at an encoder call: %s", log);
    if (!(w <= tol))
        FAIL("the planned call differs from a call without a plan by %g", w);
    /* a view larger than the plan's views is refused before any op runs */
    uint8_t *big = calloc(56 * 56 * 3, 1);
    ASSERT_TRUE(big);
    ASSERT_ERR(vision_encode(v, &(struct vision_view){big, 56}, 1, out, NULL, NULL, &e), -E2BIG);
    free(big);
    ASSERT_CONTAINS(e.msg, "larger than the memory plan");

    /* a device too small: views of image_size beyond its free memory (their patch rows alone,
     * image_size^2 x 12 bytes a view, exceed it) refuse with the need named */
    ASSERT_OK(backend_mem_info(gpu, &fr0, &tot));
    int too_many = (int)(fr0 / ((size_t)cf->image_size * cf->image_size * 12) + 1);
    ASSERT_ERR(vision_plan(v, too_many, cf->image_size, &planned, &e), -ENOMEM);
    printf("plan: %d views on %zu free bytes: %s\n", too_many, fr0, e.msg);
    ASSERT_CONTAINS(e.msg, "the vision encoder needs");
    ASSERT_CONTAINS(e.msg, "of device memory");
    ASSERT_EQ(planned, 0);
    /* a refused plan takes no device memory (v's former plan is dropped: some comes back) */
    ASSERT_OK(backend_mem_info(gpu, &fr1, &tot));
    if (fr1 < fr0)
        FAIL("a refused plan of %d views left %zu bytes of device memory taken", too_many, fr0 - fr1);

    /* and leaves it exactly as it was on v0, which has no plan of its own to drop: the
     * workspace does not grow, whether the activations (too_many views) or the workspace (as
     * many views as the activations leave 4 MB of the device free for: its GEMM inputs do
     * not fit) are what the device cannot give */
    long long act = 0;
    size_t ws = 0;
    const char *need = strchr(e.msg, '(');
    ASSERT_TRUE(need && sscanf(need, "(%lld of activations, %zu of workspace)", &act, &ws) == 2);
    int fit = (int)((fr0 - (4u << 20)) / (size_t)(act / too_many + 1));
    const int cases[2] = {too_many, fit};
    for (int i = 0; i < 2; i++) {
        ASSERT_OK(backend_mem_info(gpu, &fr0, &tot));
        ASSERT_ERR(vision_plan(v0, cases[i], cf->image_size, &planned, &e), -ENOMEM);
        ASSERT_OK(backend_mem_info(gpu, &fr1, &tot));
        printf("plan: a refused plan of %d views: free device memory %zu -> %zu: %s\n", cases[i], fr0, fr1, e.msg);
        if (fr1 != fr0)
            FAIL("a refused plan of %d views left %lld bytes of device memory taken", cases[i],
                 (long long)fr0 - (long long)fr1);
        need = strchr(e.msg, '(');
        ASSERT_TRUE(need && sscanf(need, "(%lld of activations, %zu of workspace)", &act, &ws) == 2);
        if (i == 1 && !(act < (long long)fr0 && act + (long long)ws > (long long)fr0))
            FAIL("%d views: %lld bytes of activations and %zu of workspace on %zu free: not a plan whose "
                 "workspace alone does not fit", fit, act, ws, fr0);
    }

    for (int i = 0; i < NV; i++)
        free((void *)views[i].rgb);
    free(out);
    free(ref);
    vision_free(v0);
    vision_free(v);
    ckpt_close(ck);
}

int main(int argc, char **argv)
{
    struct backend_cfg cc = { .n_threads = 1, .mxfp4_exact = true };
    uint64_t seed = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull | 1;
    bool ops = argc >= 2 && strcmp(argv[1], "ops") == 0;
    bool planning = argc >= 3 && strcmp(argv[1], "plan") == 0;
    int sizes[MAX_VIEWS] = {140, 98, 42}, n_sizes = 3;

    if (!ops && !planning && !(argc >= 3 && strcmp(argv[1], "tower") == 0)) {
        fprintf(stderr, "usage: test-cuda-vision ops | tower MODEL_DIR [SIZE...] | plan MODEL_DIR [exact|fast]\n");
        return 2;
    }
    const char *only = planning && argc >= 4 ? argv[3] : NULL;
    if (only && strcmp(only, "exact") != 0 && strcmp(only, "fast") != 0) {
        fprintf(stderr, "test-cuda-vision: unknown CUDA path '%s', expected exact or fast\n", only);
        return 2;
    }
    if (!ops && !planning && argc > 3) {
        n_sizes = 0;
        for (int i = 3; i < argc && n_sizes < MAX_VIEWS; i++)
            sizes[n_sizes++] = atoi(argv[i]);
    }
    if (getenv("STEPD_TEST_SEED"))
        seed = strtoull(getenv("STEPD_TEST_SEED"), NULL, 0) | 1;
    ASSERT_OK(backend_new("cpu", &cc, &cpu));
    for (int pass = 0; pass < 2; pass++) {
        if (only && strcmp(only, pass == 1 ? "fast" : "exact") != 0)
            continue;
        struct backend_cfg cfg = { .n_threads = 1, .device = 0, .mxfp4_exact = pass == 0 };
        int r = backend_new("cuda", &cfg, &gpu);

        if (r == -ENODEV || r == -EINVAL) {
            printf("SKIP: no CUDA backend here (%s)\n", strerror(-r));
            backend_free(cpu);
            return TEST_SKIP;
        }
        ASSERT_OK(r);
        dev = backend_native(gpu, "vision");
        ASSERT_TRUE(dev != NULL);
        fast = pass == 1;
        rng = seed;
        printf("== %s path (seed %llu)\n", fast ? "tensor-core" : "FP32 op", (unsigned long long)seed);
        if (ops)
            run_ops(getenv("STEPD_TEST_EMULATED") != NULL);
        else if (planning)
            plan(argv[2], fast ? 1.5e-2 : 1e-5);
        else
            tower(argv[2], sizes, n_sizes, fast ? "fast" : "exact");
        backend_free(gpu);
        /* the ops take no BF16 path: one pass tests them */
        if (ops)
            break;
    }
    backend_free(cpu);
    printf("the vision encoder on CUDA matches the CPU\n");
    return 0;
}
