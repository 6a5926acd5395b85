/* test-cuda-ops.c - every CUDA op against the CPU oracle (kernels/cpu).
 *
 * Property: for random inputs on odd shapes, each kcuda op (reached through the
 * backend_<op> wrappers of the "cuda" plugin) matches the CPU backend's exact path
 * within a per-op tolerance.  Exits 77 (skipped) when the plugin or a GPU is absent.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "harness.h"

static struct backend *cpu, *gpu;
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static float frand(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static uint16_t bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static float *rnd(size_t n, float scale)
{
    float *p = malloc(n * sizeof(float));
    ASSERT_TRUE(p);
    for (size_t i = 0; i < n; i++)
        p[i] = frand() * scale;
    return p;
}

/* device copy of host floats */
static void *dup_dev(const void *h, size_t bytes)
{
    void *d;
    ASSERT_OK(backend_buf_alloc(gpu, bytes, 256, &d));
    ASSERT_OK(backend_upload(gpu, d, h, bytes));
    return d;
}

static void compare(const char *what, const float *ref, const void *dev, size_t n, double tol)
{
    float *got = malloc(n * sizeof(float));
    double worst = 0;
    ASSERT_TRUE(got);
    ASSERT_OK(backend_download(gpu, got, dev, n * sizeof(float)));
    ASSERT_OK(backend_sync(gpu));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]) / (1.0 + fabs(ref[i]));
        if (!(d <= worst))
            worst = isnan(d) ? INFINITY : (d > worst ? d : worst);
    }
    printf("%-22s n=%-8zu max rel err %.3g (tol %.1g)\n", what, n, worst, tol);
    if (!(worst <= tol))
        FAIL("%s: max relative error %g above %g", what, worst, tol);
    free(got);
}

/* A weight of the given format with random content, prepared on both backends. */
struct wpair { struct bweight c, g; void *data; uint8_t *scale; };

static void make_weight(struct wpair *w, enum wfmt fmt, int rows, int cols)
{
    size_t n = (size_t)rows * cols;
    memset(w, 0, sizeof(*w));
    if (fmt == WFMT_F32) {
        w->data = rnd(n, 0.5f);
    } else if (fmt == WFMT_BF16) {
        uint16_t *p = malloc(n * 2);
        for (size_t i = 0; i < n; i++)
            p[i] = bf16(frand() * 0.5f);
        w->data = p;
    } else {
        uint8_t *p = malloc(n / 2);
        w->scale = malloc(n / 32);
        for (size_t i = 0; i < n / 2; i++)
            p[i] = (uint8_t)(rng = rng * 6364136223846793005ull + 1442695040888963407ull) ;
        for (size_t i = 0; i < n / 32; i++)
            w->scale[i] = (uint8_t)(120 + (i % 7));
        w->data = p;
    }
    w->c = (struct bweight){ .fmt = fmt, .rows = rows, .cols = cols, .data = w->data, .scale = w->scale };
    w->g = w->c;
    ASSERT_OK(backend_weight_prepare(cpu, &w->c));
    ASSERT_OK(backend_weight_prepare(gpu, &w->g));
}

static void test_matmul(enum wfmt fmt, int rows, int cols, int n, double tol)
{
    struct wpair w;
    float *x = rnd((size_t)n * cols, 1.0f), *y = calloc((size_t)n * rows, 4);
    char name[64];

    make_weight(&w, fmt, rows, cols);
    ASSERT_OK(backend_matmul(cpu, &w.c, x, n, y));
    void *dx = dup_dev(x, (size_t)n * cols * 4), *dy;
    ASSERT_OK(backend_buf_alloc(gpu, (size_t)n * rows * 4, 256, &dy));
    ASSERT_OK(backend_matmul(gpu, &w.g, dx, n, dy));
    snprintf(name, sizeof(name), "matmul fmt=%d %dx%d n=%d", (int)fmt, rows, cols, n);
    compare(name, y, dy, (size_t)n * rows, tol);
    backend_weight_release(gpu, &w.g);
    backend_weight_release(cpu, &w.c);
    backend_buf_free(gpu, dx);
    backend_buf_free(gpu, dy);
    free(x); free(y); free(w.data); free(w.scale);
}

static void test_elementwise(void)
{
    const int n_tok = 7, heads = 5, hd = 24, dim = 96;
    float *x = rnd((size_t)n_tok * dim, 3.0f), *g = rnd((size_t)n_tok * heads, 2.0f);
    float *u = rnd((size_t)n_tok * dim, 12.0f), *v = rnd((size_t)n_tok * dim, 12.0f);
    float *ref = malloc((size_t)n_tok * dim * 4);
    struct wpair nw;
    void *dx, *dg, *du, *dv, *dout;

    /* rmsnorm (BF16 weight) */
    make_weight(&nw, WFMT_BF16, 1, dim);
    ASSERT_OK(backend_rmsnorm(cpu, x, &nw.c, n_tok, dim, 1e-5f, ref));
    dx = dup_dev(x, (size_t)n_tok * dim * 4);
    ASSERT_OK(backend_buf_alloc(gpu, (size_t)n_tok * dim * 4, 256, &dout));
    ASSERT_OK(backend_rmsnorm(gpu, dx, &nw.g, n_tok, dim, 1e-5f, dout));
    compare("rmsnorm", ref, dout, (size_t)n_tok * dim, 1e-5);

    /* swiglu with a clamp that binds */
    du = dup_dev(u, (size_t)n_tok * dim * 4);
    dv = dup_dev(v, (size_t)n_tok * dim * 4);
    ASSERT_OK(backend_swiglu(cpu, u, v, n_tok, dim, 7.0f, ref));
    ASSERT_OK(backend_swiglu(gpu, du, dv, n_tok, dim, 7.0f, dout));
    compare("swiglu limit 7", ref, dout, (size_t)n_tok * dim, 1e-5);

    /* head gate, in place: o = x viewed as [n_tok, heads, hd'] with hd' = dim / heads? use hd */
    float *o = rnd((size_t)n_tok * heads * hd, 1.0f);
    void *dov = dup_dev(o, (size_t)n_tok * heads * hd * 4);
    dg = dup_dev(g, (size_t)n_tok * heads * 4);
    ASSERT_OK(backend_head_gate(cpu, o, g, n_tok, heads, hd));
    ASSERT_OK(backend_head_gate(gpu, dov, dg, n_tok, heads, hd));
    compare("head_gate", o, dov, (size_t)n_tok * heads * hd, 1e-5);

    /* add */
    memcpy(ref, x, (size_t)n_tok * dim * 4);
    ASSERT_OK(backend_add(cpu, ref, u, (size_t)n_tok * dim));
    ASSERT_OK(backend_add(gpu, dx, du, (size_t)n_tok * dim));
    compare("add", ref, dx, (size_t)n_tok * dim, 1e-6);

    /* rope: partial (R = 16 of 24) with a llama3-scaled table */
    float inv[8];
    struct rope_llama3 l3 = { 2.0, 1.0, 32.0, 128.0 };
    struct rope_freqs f = { 16, inv };
    int32_t pos[7] = { 0, 1, 5, 63, 64, 200, 4000 };
    float *q = rnd((size_t)n_tok * heads * hd, 1.0f);
    void *dq = dup_dev(q, (size_t)n_tok * heads * hd * 4);
    ASSERT_OK(backend_rope_freqs_fill(inv, 16, 500000.0, &l3));
    ASSERT_OK(backend_rope(cpu, q, n_tok, heads, hd, pos, &f));
    ASSERT_OK(backend_rope(gpu, dq, n_tok, heads, hd, pos, &f));
    compare("rope R=16 llama3", q, dq, (size_t)n_tok * heads * hd, 1e-4);

    backend_buf_free(gpu, dx); backend_buf_free(gpu, du); backend_buf_free(gpu, dv);
    backend_buf_free(gpu, dg); backend_buf_free(gpu, dout); backend_buf_free(gpu, dov);
    backend_buf_free(gpu, dq);
    backend_weight_release(gpu, &nw.g); backend_weight_release(cpu, &nw.c);
    free(x); free(g); free(u); free(v); free(ref); free(o); free(q); free(nw.data);
}

static void test_embed_router_moe(void)
{
    const int vocab = 301, hidden = 64, n_tok = 5, n_exp = 12, top_k = 3, inter = 32;
    struct wpair emb;
    int32_t ids[5] = { 0, 300, 17, 17, 150 };
    float *ref = malloc((size_t)n_tok * hidden * 4);
    void *dout;

    make_weight(&emb, WFMT_BF16, vocab, hidden);
    ASSERT_OK(backend_embed(cpu, &emb.c, ids, n_tok, ref));
    ASSERT_OK(backend_buf_alloc(gpu, (size_t)n_tok * hidden * 4, 256, &dout));
    ASSERT_OK(backend_embed(gpu, &emb.g, ids, n_tok, dout));
    compare("embed", ref, dout, (size_t)n_tok * hidden, 0);

    /* router */
    float *z = rnd((size_t)n_tok * n_exp, 4.0f), *bias = rnd(n_exp, 0.3f);
    int32_t cids[5 * 3], gids[5 * 3];
    float cw[5 * 3];
    void *dz = dup_dev(z, (size_t)n_tok * n_exp * 4), *dids, *dw;
    ASSERT_OK(backend_buf_alloc(gpu, sizeof(gids), 256, &dids));
    ASSERT_OK(backend_buf_alloc(gpu, sizeof(cw), 256, &dw));
    ASSERT_OK(backend_router(cpu, z, bias, n_tok, n_exp, top_k, true, 2.5f, cids, cw));
    ASSERT_OK(backend_router(gpu, dz, bias, n_tok, n_exp, top_k, true, 2.5f, dids, dw));
    ASSERT_OK(backend_download(gpu, gids, dids, sizeof(gids)));
    ASSERT_OK(backend_sync(gpu));
    for (int i = 0; i < n_tok * top_k; i++)
        ASSERT_EQ(gids[i], cids[i]);
    compare("router weights", cw, dw, (size_t)n_tok * top_k, 1e-5);

    /* moe over local experts [4, 4 + 6) with MXFP4 weights */
    struct wpair wp[6][3];
    struct moe_expert ce[6], ge[6];
    for (int e = 0; e < 6; e++) {
        make_weight(&wp[e][0], WFMT_MXFP4, inter, hidden);
        make_weight(&wp[e][1], WFMT_MXFP4, inter, hidden);
        make_weight(&wp[e][2], WFMT_MXFP4, hidden, inter);
        ce[e] = (struct moe_expert){ wp[e][0].c, wp[e][1].c, wp[e][2].c };
        ge[e] = (struct moe_expert){ wp[e][0].g, wp[e][1].g, wp[e][2].g };
    }
    float *x = rnd((size_t)n_tok * hidden, 1.0f);
    float *out = calloc((size_t)n_tok * hidden, 4);
    void *dx = dup_dev(x, (size_t)n_tok * hidden * 4), *dmo = dup_dev(out, (size_t)n_tok * hidden * 4);
    struct moe_args ca = { x, out, n_tok, hidden, inter, top_k, cids, cw, ce, 4, 6, 7.0f };
    struct moe_args ga = { dx, dmo, n_tok, hidden, inter, top_k, dids, dw, ge, 4, 6, 7.0f };
    ASSERT_OK(backend_moe(cpu, &ca));
    ASSERT_OK(backend_moe(gpu, &ga));
    compare("moe mxfp4 local 4..9", out, dmo, (size_t)n_tok * hidden, 2e-3);
    free(x); free(out); free(z); free(bias); free(ref);
}

static void test_attention(int window, int kv_f32)
{
    const int heads = 6, kvh = 2, hd = 32, bs = 4, n_blocks = 40;
    /* two sequences: seq 0 prefill of 9 tokens at pos 0, seq 1 decode of 2 at pos 37 */
    const int n_tok = 11;
    int32_t start[3] = { 0, 9, 11 }, pos0[2] = { 0, 37 };
    int32_t tables[2 * 10], off[2] = { 0, 10 };
    int32_t slots[11], posv[11];
    struct kv_layer ckv = { 0 }, gkv;
    size_t pool = (size_t)n_blocks * bs * kvh * hd;

    for (int i = 0; i < 20; i++)
        tables[i] = (i * 7 + 3) % n_blocks;    /* shuffled physical blocks */
    ckv = (struct kv_layer){ calloc(pool, 4), calloc(pool, 4), kv_f32, n_blocks, bs, kvh, hd };
    gkv = ckv;
    ASSERT_OK(backend_buf_alloc(gpu, pool * 4, 256, &gkv.k));
    ASSERT_OK(backend_buf_alloc(gpu, pool * 4, 256, &gkv.v));
    /* fill the history of seq 1 (positions 0..36) and both runs */
    for (int s = 0; s < 2; s++) {
        int first = s == 0 ? 0 : 0, last = s == 0 ? 8 : 38;
        for (int p = first; p <= last; p++) {
            float *k = rnd((size_t)kvh * hd, 1.0f), *v = rnd((size_t)kvh * hd, 1.0f);
            int32_t slot = tables[off[s] + p / bs] * bs + p % bs;
            void *dk = dup_dev(k, (size_t)kvh * hd * 4), *dv = dup_dev(v, (size_t)kvh * hd * 4);
            ASSERT_OK(backend_kv_store(cpu, &ckv, k, v, 1, &slot));
            ASSERT_OK(backend_kv_store(gpu, &gkv, dk, dv, 1, &slot));
            backend_buf_free(gpu, dk); backend_buf_free(gpu, dv);
            free(k); free(v);
        }
    }
    (void)slots; (void)posv;
    float *q = rnd((size_t)n_tok * heads * hd, 1.0f), *out = calloc((size_t)n_tok * heads * hd, 4);
    void *dq = dup_dev(q, (size_t)n_tok * heads * hd * 4), *dout;
    ASSERT_OK(backend_buf_alloc(gpu, (size_t)n_tok * heads * hd * 4, 256, &dout));
    struct attn_args a = { q, out, n_tok, heads, kvh, hd, 1.0f / sqrtf(hd), window, &ckv, 2,
                           start, pos0, tables, off };
    ASSERT_OK(backend_attention(cpu, &a));
    a.q = dq; a.out = dout; a.kv = &gkv;
    ASSERT_OK(backend_attention(gpu, &a));
    char name[64];
    snprintf(name, sizeof(name), "attention w=%d f32=%d", window, kv_f32);
    compare(name, out, dout, (size_t)n_tok * heads * hd, kv_f32 ? 1e-4 : 1e-2);
    backend_buf_free(gpu, gkv.k); backend_buf_free(gpu, gkv.v);
    backend_buf_free(gpu, dq); backend_buf_free(gpu, dout);
    free(ckv.k); free(ckv.v); free(q); free(out);
}

int main(void)
{
    struct backend_cfg cfg = { .n_threads = 1, .device = 0, .mxfp4_exact = true };
    int r = backend_new("cuda", &cfg, &gpu);

    if (r == -ENODEV || r == -EINVAL) {
        printf("SKIP: no CUDA backend here (%s)\n", strerror(-r));
        return TEST_SKIP;
    }
    ASSERT_OK(r);
    ASSERT_OK(backend_new("cpu", &cfg, &cpu));

    test_matmul(WFMT_F32, 37, 96, 3, 1e-5);
    test_matmul(WFMT_BF16, 129, 256, 5, 1e-5);
    test_matmul(WFMT_MXFP4, 77, 320, 1, 1e-5);
    test_matmul(WFMT_MXFP4, 256, 1280, 9, 1e-5);
    test_elementwise();
    test_embed_router_moe();
    test_attention(0, 1);
    test_attention(5, 1);
    test_attention(5, 0);

    backend_free(cpu);
    backend_free(gpu);
    printf("all CUDA ops match the CPU oracle\n");
    return 0;
}
