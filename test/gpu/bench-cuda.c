/* bench-cuda.c - the GPU path's table (issue: "The GPU path for real"), on one GPU.
 *
 *   bench-cuda [--model DIR [--mtp]] [--quick]
 *
 * Rows, each the median of repeated runs timed on the host around a stream sync (the
 * launch costs are in: that is what a step pays outside a graph):
 *   copy ceiling     a device-to-device copy of 2 GiB (bytes read + written / time)
 *   MoE              the routed experts of one layer (moe op: plan, gate+up with SwiGLU,
 *                    down with the routing weights, combine), experts of 4096x1280 /
 *                    1280x4096, decode of T = 1, 8, 32, 64 tokens routed top-8 over 288
 *                    experts, uniformly and by a Zipf(1) popularity (real decode batches
 *                    touch ~60-170 experts at T = 32): the experts touched, their weight
 *                    bytes (data + scales, fmt_bytes) / time and % of the copy ceiling;
 *                    T = 2048: TFLOP/s.  --quick: T = 1, 4, 16, 64 on the same 8 experts
 *                    (the ncu run).  Each row in the three release formats, MXFP4, FP8
 *                    (E4M3, F32 scales per 128 x 128) and NVFP4 (E2M1, E4M3 scales per 16,
 *                    a global scale), on the same routing ids, one format's 288 x 3
 *                    matrices prepared at a time; the FP8 and NVFP4 rows end with their
 *                    share of the ceiling (prefill: their TFLOP/s) over MXFP4's
 *   projection       a BF16 matmul of the fused QKV + gate shape [14432, 4096] at batch 1
 *                    (cuBLASLt): weight bytes / time, % of the ceiling
 *   attention        decode of one sequence, 64 query / 8 KV heads of 128, BF16 KV, at 4k
 *                    and 32k keys: KV bytes / time
 *   model step       with --model (stepd-mkmodel's synthetic full-width checkpoint): one
 *                    decode step at batch 1, 8, 64, with graphs and without, and the byte
 *                    floor of batch 1 (every weight the step reads, once, at the ceiling);
 *                    the per-layer time (step - lm_head and logits download, over the
 *                    layers) and the 45-layer extrapolation (45 layers + the head): ms,
 *                    tok/s per sequence and the bytes it reads / time as % of the copy
 *                    ceiling; --mtp (a checkpoint with an MTP layer): one MTP depth after
 *                    the batch-1 step
 * Exits 77 without a GPU.  On the host emulator (STEPD_TEST_EMULATED, test/cuemu/run.sh)
 * one timed call a row, a 32 MiB copy, experts of 512x256 and the MoE rows only: it proves
 * the formats' paths run clean under AddressSanitizer, its figures mean nothing.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "harness.h"
#include "loader.h"
#include "model.h"

#define BS 16
#define MAXLEN 640
#define NSEQ 64
#define TPLAN_SEED 0x2545F4914F6CDD1Dull
#include "tplan.h"

static struct backend *gpu;
static bool quick;
static bool emulated;       /* STEPD_TEST_EMULATED (test/cuemu/run.sh): one timed call a row */
static double copy_bw;      /* bytes/s, read + write */

static double now_sec(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef int (*bench_fn)(void *arg);

/* median seconds of one call over reps timed runs of inner calls (after one untimed); on
 * the host emulator one run of one call, whose figure means nothing (it proves the paths
 * run clean under AddressSanitizer) */
static double time_median(bench_fn fn, void *arg, int reps, int inner)
{
    double t[64];

    reps = emulated ? 1 : reps > 64 ? 64 : reps;
    inner = emulated ? 1 : inner;
    ASSERT_OK(fn(arg));
    ASSERT_OK(backend_sync(gpu));
    for (int i = 0; i < reps; i++) {
        double a = now_sec();
        for (int j = 0; j < inner; j++)
            ASSERT_OK(fn(arg));
        ASSERT_OK(backend_sync(gpu));
        t[i] = (now_sec() - a) / inner;
    }
    qsort(t, (size_t)reps, sizeof(double), cmp_d);
    return t[reps / 2];
}

static void *dev_random(size_t bytes)
{
    uint8_t *h = malloc(bytes);
    void *d;

    ASSERT_TRUE(h);
    for (size_t i = 0; i < bytes; i++)
        h[i] = (uint8_t)(rnd() >> 7);
    ASSERT_OK(backend_buf_alloc(gpu, bytes, 256, &d));
    ASSERT_OK(backend_upload(gpu, d, h, bytes));
    ASSERT_OK(backend_sync(gpu));
    free(h);
    return d;
}

/* floats in [-1, 1) on the device */
static float *dev_floats(size_t n, float scale)
{
    float *h = malloc(n * sizeof(float));
    void *d;

    ASSERT_TRUE(h);
    for (size_t i = 0; i < n; i++)
        h[i] = ((float)(rnd() & 0xFFFF) / 32768.0f - 1.0f) * scale;
    ASSERT_OK(backend_buf_alloc(gpu, n * sizeof(float), 256, &d));
    ASSERT_OK(backend_upload(gpu, d, h, n * sizeof(float)));
    ASSERT_OK(backend_sync(gpu));
    free(h);
    return d;
}

/* ---- copy ceiling ---- */

struct copy_arg {
    void *a, *b;
    int rows;
    size_t row_bytes;
};

static int run_copy(void *p)
{
    struct copy_arg *c = p;
    return backend_copy_rows(gpu, c->b, NULL, c->a, NULL, c->rows, c->row_bytes);
}

static void bench_copy(void)
{
    struct copy_arg c = { .rows = emulated ? 16 : 1024, .row_bytes = 2u << 20 };
    ASSERT_OK(backend_buf_alloc(gpu, (size_t)c.rows * c.row_bytes, 256, &c.a));
    ASSERT_OK(backend_buf_alloc(gpu, (size_t)c.rows * c.row_bytes, 256, &c.b));
    double t = time_median(run_copy, &c, quick ? 3 : 9, 4);
    copy_bw = 2.0 * c.rows * c.row_bytes / t;
    printf("| copy ceiling (device to device, read + write) | %s | %.0f GB/s | 100 %% |\n",
           emulated ? "32 MiB" : "2 GiB", copy_bw / 1e9);
    backend_buf_free(gpu, c.a);
    backend_buf_free(gpu, c.b);
}

/* ---- routed experts: MXFP4, FP8, NVFP4 ---- */

struct mx_expert_mem {
    uint8_t *p[3], *s[3];
};

/* host MXFP4 weights [rows, cols]: random codes, scales around 2^-7 */
static void mx_host(int64_t rows, int64_t cols, uint8_t **packed, uint8_t **scale)
{
    *packed = malloc((size_t)(rows * cols / 2));
    *scale = malloc((size_t)(rows * cols / 32));
    ASSERT_TRUE(*packed && *scale);
    for (int64_t i = 0; i < rows * cols / 2; i++)
        (*packed)[i] = (uint8_t)(rnd() >> 5);
    for (int64_t i = 0; i < rows * cols / 32; i++)
        (*scale)[i] = (uint8_t)(118 + rnd() % 4);
}

/* The formats the CUDA backend computes routed experts in, MXFP4 first (the ratios' base,
 * and the mx4_gemm launches device-check's ncu-moe stage skips into) */
static const enum wfmt moe_fmt[3] = { WFMT_MXFP4, WFMT_FP8, WFMT_NVFP4 };
static const char *const moe_fmt_name[3] = { "MXFP4", "FP8", "NVFP4" };
#define FP8_BLK 128     /* the FP8 release's scale blocks (blk_rows x blk_cols) */

struct fmt_host {
    uint8_t *data, *scale;
    float gscale;
};

/* host weights [rows, cols] of one format, random codes with scales that keep them finite:
 * MXFP4 packed nibbles, E8M0 scales around 2^-7; FP8 E4M3 codes (no NaN, 0x7F / 0xFF) with
 * F32 scales per 128 x 128 block; NVFP4 packed nibbles, E4M3 scales in [0.5, 1) and a
 * global scale of 2^-8 */
static void fmt_host(enum wfmt fmt, int64_t rows, int64_t cols, struct fmt_host *h)
{
    const int64_t n = rows * cols;

    h->gscale = 0;
    if (fmt == WFMT_MXFP4) {
        mx_host(rows, cols, &h->data, &h->scale);
    } else if (fmt == WFMT_FP8) {
        const int64_t ns = (rows / FP8_BLK) * (cols / FP8_BLK);
        float *s;
        h->data = malloc((size_t)n);
        h->scale = malloc((size_t)ns * sizeof(float));
        ASSERT_TRUE(h->data && h->scale);
        for (int64_t i = 0; i < n; i++) {
            uint8_t b = (uint8_t)(rnd() >> 7);
            h->data[i] = (b & 0x7F) == 0x7F ? (uint8_t)(b ^ 1) : b;
        }
        s = (float *)h->scale;
        for (int64_t i = 0; i < ns; i++)
            s[i] = ldexpf(1.0f + (float)(rnd() % 4) / 4, -9);
    } else {
        h->data = malloc((size_t)(n / 2));
        h->scale = malloc((size_t)(n / 16));
        ASSERT_TRUE(h->data && h->scale);
        for (int64_t i = 0; i < n / 2; i++)
            h->data[i] = (uint8_t)(rnd() >> 5);
        for (int64_t i = 0; i < n / 16; i++)
            h->scale[i] = (uint8_t)(0x30 + rnd() % 8);
        h->gscale = 1.0f / 256;
    }
}

/* The bytes one pass over a [rows, cols] weight reads (data + scales):
 *   MXFP4  rows x cols / 2 (E2M1 nibbles) + rows x cols / 32 (an E8M0 byte per 32)
 *   FP8    rows x cols (E4M3) + (rows / 128) x (cols / 128) x 4 (an F32 per 128 x 128 block)
 *   NVFP4  rows x cols / 2 (E2M1 nibbles) + rows x cols / 16 (an E4M3 byte per 16); the
 *          global scale is a kernel argument, not counted */
static double fmt_bytes(enum wfmt fmt, int64_t rows, int64_t cols)
{
    const double n = (double)rows * (double)cols;
    if (fmt == WFMT_MXFP4)
        return n / 2 + n / 32;
    if (fmt == WFMT_FP8)
        return n + (double)(rows / FP8_BLK) * (double)(cols / FP8_BLK) * 4;
    return n / 2 + n / 16;
}

struct moe_arg {
    struct moe_args a;
};

static int run_moe(void *p)
{
    return backend_moe(gpu, &((struct moe_arg *)p)->a);
}

/* ids[T, K]: K distinct experts of n_exp per token, uniformly or with expert e's
 * popularity proportional to 1 / (1 + rank(e)) (Zipf, a fixed random ranking); returns
 * the number of experts the T tokens touch */
static int route_top8(int32_t *ids, int T, int K, int n_exp, bool zipf)
{
    double cdf[512], sum = 0;
    int32_t rank[512];
    bool used[512] = { false };
    int touched = 0;

    ASSERT_TRUE(n_exp <= 512);
    for (int e = 0; e < n_exp; e++)
        rank[e] = e;
    for (int e = n_exp - 1; e > 0; e--) {
        int j = (int)(rnd() % (uint32_t)(e + 1)), tmp = rank[e];
        rank[e] = rank[j];
        rank[j] = tmp;
    }
    for (int e = 0; e < n_exp; e++) {
        sum += zipf ? 1.0 / (1 + rank[e]) : 1.0;
        cdf[e] = sum;
    }
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) {
            int e;
            bool dup;
            do {
                double u = (double)(rnd() & 0xFFFFFF) / 16777216.0 * sum;
                e = 0;
                while (e < n_exp - 1 && cdf[e] <= u)
                    e++;
                dup = false;
                for (int j = 0; j < k; j++)
                    dup |= ids[t * K + j] == e;
            } while (dup);
            ids[t * K + k] = e;
            touched += !used[e];
            used[e] = true;
        }
    }
    return touched;
}

/* one row of the MoE table: T tokens routed by ids (the same for every format) */
struct moe_row {
    int T, touched, zipf;       /* zipf: -1 = every token on experts 0..7 (--quick) */
    bool prefill;
    int32_t *ids;
    double mx_share;            /* MXFP4's share of the copy ceiling (prefill: its FLOP/s) */
};

static void bench_moe(void)
{
    /* on the emulator experts of 512x256 / 256x512: the same kernels, 40 x less work */
    const int H = emulated ? 512 : 4096, I = emulated ? 256 : 1280, K = 8, E_dec = 8,
              E_pre = 288;
    const int n_exp = quick ? E_dec : E_pre;
    struct moe_expert *ex = calloc((size_t)n_exp, sizeof(*ex));
    const int64_t shape[3][2] = { { I, H }, { I, H }, { H, I } };
    const int decode_quick[4] = { 1, 4, 16, 64 }, decode_real[4] = { 1, 8, 32, 64 };
    struct moe_row rows[9];
    int n_rows = 0;

    /* the routing first, then every format's rows on the same ids */
    for (int d = 0; d < 4 && quick; d++) {
        struct moe_row *r = &rows[n_rows++];
        *r = (struct moe_row){ .T = decode_quick[d], .touched = E_dec, .zipf = -1 };
        r->ids = malloc(sizeof(int32_t) * r->T * K);
        ASSERT_TRUE(r->ids);
        for (int t = 0; t < r->T; t++)
            for (int k = 0; k < K; k++)
                r->ids[t * K + k] = k;          /* every token on experts 0..7 */
    }
    for (int zipf = 0; zipf < 2 && !quick; zipf++) {
        for (int d = 0; d < 4; d++) {
            struct moe_row *r = &rows[n_rows++];
            *r = (struct moe_row){ .T = decode_real[d], .zipf = zipf };
            r->ids = malloc(sizeof(int32_t) * r->T * K);
            ASSERT_TRUE(r->ids);
            r->touched = route_top8(r->ids, r->T, K, E_pre, zipf);
        }
    }
    if (!quick) {
        struct moe_row *r = &rows[n_rows++];
        *r = (struct moe_row){ .T = 2048, .prefill = true };
        r->ids = malloc(sizeof(int32_t) * r->T * K);
        ASSERT_TRUE(r->ids);
        route_top8(r->ids, r->T, K, E_pre, 0);
    }

    float *x = dev_floats((size_t)2048 * H, 1.0f), *out = dev_floats((size_t)2048 * H, 0.0f);
    float *w_h = malloc(sizeof(float) * 2048 * K);
    void *ids, *wts;
    ASSERT_TRUE(w_h);
    ASSERT_OK(backend_buf_alloc(gpu, sizeof(int32_t) * 2048 * K, 256, &ids));
    ASSERT_OK(backend_buf_alloc(gpu, sizeof(float) * 2048 * K, 256, &wts));
    for (int i = 0; i < 2048 * K; i++)
        w_h[i] = 0.125f;
    ASSERT_OK(backend_upload(gpu, wts, w_h, sizeof(float) * 2048 * K));

    /* one format prepared at a time (288 experts x 3 matrices: 4.5 GB in FP8), released
     * before the next */
    for (int f = 0; f < 3; f++) {
        const enum wfmt fmt = moe_fmt[f];
        const char *name = moe_fmt_name[f];
        struct fmt_host hw[3];
        double wbytes = 0;      /* one expert */

        /* one host copy of each matrix's bytes, prepared (uploaded, repacked) per expert */
        for (int m = 0; m < 3; m++) {
            fmt_host(fmt, shape[m][0], shape[m][1], &hw[m]);
            wbytes += fmt_bytes(fmt, shape[m][0], shape[m][1]);
        }
        for (int e = 0; e < n_exp; e++) {
            struct bweight *w[3] = { &ex[e].gate, &ex[e].up, &ex[e].down };
            for (int m = 0; m < 3; m++) {
                *w[m] = (struct bweight){ .fmt = fmt, .rows = shape[m][0], .cols = shape[m][1],
                                          .data = hw[m].data, .scale = hw[m].scale,
                                          .gscale = hw[m].gscale };
                if (fmt == WFMT_FP8)
                    w[m]->blk_rows = w[m]->blk_cols = FP8_BLK;
                ASSERT_OK(backend_weight_prepare(gpu, w[m]));
            }
        }
        for (int i = 0; i < n_rows; i++) {
            struct moe_row *r = &rows[i];
            const int T = r->T;
            char ratio[48] = "";
            ASSERT_OK(backend_upload(gpu, ids, r->ids, sizeof(int32_t) * T * K));
            struct moe_arg ma = { { x, out, T, H, I, K, ids, wts, ex, 0, n_exp, 0.0f } };
            if (r->prefill) {
                double t = time_median(run_moe, &ma, 9, 2);
                double flop = 2.0 * 3 * H * I * (double)T * K;
                if (f == 0)
                    r->mx_share = flop / t;
                else
                    snprintf(ratio, sizeof(ratio), " %.2f x MXFP4's", flop / t / r->mx_share);
                printf("| %s MoE prefill, 2048 tokens top-8 of 288 experts | %.2f ms | "
                       "%.0f TFLOP/s |%s |\n", name, t * 1e3, flop / t / 1e12, ratio);
                continue;
            }
            /* the non-MXFP4 formats fewer reps outside --quick (device-check's bench stage) */
            double t = time_median(run_moe, &ma, r->zipf < 0 ? 5 : f == 0 ? 15 : 9, 10);
            double bw = r->touched * wbytes / t, share = bw / copy_bw;
            if (f == 0)
                r->mx_share = share;
            else
                snprintf(ratio, sizeof(ratio), " (%.2f x MXFP4's)", share / r->mx_share);
            if (r->zipf < 0)
                printf("| %s MoE decode, %2d token%s x 8 experts (%dx%d, %dx%d) | "
                       "%.1f us | %.0f GB/s | %.0f %%%s |\n", name, T, T > 1 ? "s" : " ",
                       H, I, I, H, t * 1e6, bw / 1e9, 100 * share, ratio);
            else
                printf("| %s MoE decode, %2d token%s top-8 of 288 (%s), %3d experts touched | "
                       "%.1f us | %.0f GB/s | %.0f %%%s |\n", name, T, T > 1 ? "s" : " ",
                       r->zipf ? "Zipf(1) popularity" : "uniform", r->touched, t * 1e6,
                       bw / 1e9, 100 * share, ratio);
        }
        for (int e = 0; e < n_exp; e++) {
            backend_weight_release(gpu, &ex[e].gate);
            backend_weight_release(gpu, &ex[e].up);
            backend_weight_release(gpu, &ex[e].down);
        }
        for (int m = 0; m < 3; m++) {
            free(hw[m].data);
            free(hw[m].scale);
        }
    }
    for (int i = 0; i < n_rows; i++)
        free(rows[i].ids);
    backend_buf_free(gpu, x);
    backend_buf_free(gpu, out);
    backend_buf_free(gpu, ids);
    backend_buf_free(gpu, wts);
    free(w_h);
    free(ex);
}

/* ---- BF16 projection ---- */

struct mm_arg {
    struct bweight *w;
    float *x, *y;
    int n;
};

static int run_mm(void *p)
{
    struct mm_arg *m = p;
    return backend_matmul(gpu, m->w, m->x, m->n, m->y);
}

static void bench_projection(void)
{
    const int rows = 14432, cols = 4096;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)rows * cols);
    for (size_t i = 0; i < (size_t)rows * cols; i++)
        h[i] = (uint16_t)(0x3c00 + (rnd() & 0x3ff)) ^ (uint16_t)((rnd() & 1) << 15);
    struct bweight w = { WFMT_BF16, rows, cols, h, NULL, NULL };
    ASSERT_OK(backend_weight_prepare(gpu, &w));
    struct mm_arg m = { &w, dev_floats((size_t)64 * cols, 1.0f), NULL, 1 };
    ASSERT_OK(backend_buf_alloc(gpu, sizeof(float) * 64 * rows, 256, (void **)&m.y));
    for (int n = 1; n <= 8; n *= 8) {
        m.n = n;
        double t = time_median(run_mm, &m, quick ? 5 : 21, 10);
        double bw = 2.0 * rows * cols / t;
        printf("| BF16 projection [14432, 4096] (cuBLASLt), batch %d | %.1f us | %.0f GB/s | "
               "%.0f %% |\n", n, t * 1e6, bw / 1e9, 100 * bw / copy_bw);
    }
    backend_weight_release(gpu, &w);
    backend_buf_free(gpu, m.x);
    backend_buf_free(gpu, m.y);
    free(h);
}

/* ---- attention decode ---- */

struct at_arg {
    struct attn_args a;
};

static int run_at(void *p)
{
    return backend_attention(gpu, &((struct at_arg *)p)->a);
}

static void bench_attention(void)
{
    const int heads = 64, kvh = 8, hd = 128;
    const int ctxs[2] = { 4096, 32768 };
    for (int c = 0; c < 2; c++) {
        const int L = ctxs[c], nb = L / BS + 1;
        int32_t *tables = malloc(sizeof(int32_t) * nb);
        for (int i = 0; i < nb; i++)
            tables[i] = (i * 7919) % nb;
        struct kv_layer kv = { NULL, NULL, 0, nb, BS, kvh, hd };
        kv.k = dev_random((size_t)nb * BS * kvh * hd * 2);
        kv.v = dev_random((size_t)nb * BS * kvh * hd * 2);
        int32_t start[2] = { 0, 1 }, pos0[1] = { L - 1 }, off[1] = { 0 };
        struct at_arg aa = { { dev_floats((size_t)heads * hd, 1.0f), NULL, 1, heads, kvh, hd,
                               1.0f / sqrtf((float)hd), 0, &kv, 1, start, pos0, tables, off } };
        ASSERT_OK(backend_buf_alloc(gpu, sizeof(float) * heads * hd, 256, (void **)&aa.a.out));
        double t = time_median(run_at, &aa, quick ? 5 : 21, 10);
        double bytes = (double)L * kvh * hd * 2 * 2;
        printf("| attention decode, 1 sequence, %dk keys, 64/8 heads of 128, BF16 KV | %.1f us | "
               "%.0f GB/s | %.0f %% |\n", L / 1024, t * 1e6, bytes / t / 1e9,
               100 * bytes / t / copy_bw);
        backend_buf_free(gpu, kv.k);
        backend_buf_free(gpu, kv.v);
        backend_buf_free(gpu, (void *)aa.a.q);
        backend_buf_free(gpu, aa.a.out);
        free(tables);
    }
}

/* ---- the synthetic model's decode step ---- */

/* bytes of weights a decode step of B sequences reads (each once) */
static double step_bytes(const struct model_config *cfg, int B)
{
    const double H = cfg->hidden_size;
    double b = (double)cfg->vocab_size * H * 2;       /* lm_head */
    for (int l = 0; l < cfg->n_layers; l++) {
        const struct layer_config *lc = &cfg->layers[l];
        double q = (double)lc->n_heads * lc->head_dim, kv = (double)lc->n_kv_heads * lc->head_dim;
        b += (q + 2 * kv + lc->n_heads) * H * 2 + q * H * 2;
        if (lc->is_moe) {
            double act = 8.0 * B < cfg->n_experts ? 8.0 * B : cfg->n_experts;
            b += (double)cfg->n_experts * H * 4;        /* FP32 router */
            b += 3.0 * H * cfg->shared_expert_dim * 2;
            b += act * 3.0 * H * cfg->moe_intermediate_size * (0.5 + 1.0 / 32);
        } else {
            b += 3.0 * H * cfg->intermediate_size * 2;
        }
    }
    return b;
}

struct step_arg {
    struct model *m;
    struct tplan tp;
    float *logits;
};

static int run_step(void *p)
{
    struct step_arg *s = p;
    return model_step(s->m, &s->tp.p, s->logits);
}

struct mtp_arg {
    struct step_arg *s;
    int32_t n_valid[NSEQ], tok[NSEQ];
    float *logits;
};

/* the trunk step, then MTP depth 0 of the same plan */
static int run_step_mtp(void *p)
{
    struct mtp_arg *a = p;
    int r = model_step(a->s->m, &a->s->tp.p, a->s->logits);
    return r < 0 ? r : model_mtp_step(a->s->m, 0, &a->s->tp.p, a->n_valid, a->tok, a->logits);
}

struct head_arg {
    struct bweight w;
    float *x, *y, *host;
    int n;
};

/* what a step costs besides its layers: the lm_head [vocab, hidden] BF16 and the logits'
 * download */
static int run_head(void *p)
{
    struct head_arg *h = p;
    int r = backend_matmul(gpu, &h->w, h->x, h->n, h->y);
    return r < 0 ? r : backend_download(gpu, h->host, h->y, sizeof(float) * h->n * h->w.rows);
}

static double time_head(int V, int H, int B)
{
    uint16_t *hw = malloc(sizeof(uint16_t) * (size_t)V * H);
    struct head_arg h = { { WFMT_BF16, V, H, hw, NULL, NULL }, NULL, NULL, NULL, B };

    ASSERT_TRUE(hw);
    for (size_t i = 0; i < (size_t)H; i++)
        hw[i] = (uint16_t)(0x3c00 + (rnd() & 0x3ff)) ^ (uint16_t)((rnd() & 1) << 15);
    for (size_t r = 1; r < (size_t)V; r++)
        memcpy(hw + r * H, hw, sizeof(uint16_t) * H);
    ASSERT_OK(backend_weight_prepare(gpu, &h.w));
    h.x = dev_floats((size_t)B * H, 1.0f);
    ASSERT_OK(backend_buf_alloc(gpu, sizeof(float) * (size_t)B * V, 256, (void **)&h.y));
    h.host = malloc(sizeof(float) * (size_t)B * V);
    ASSERT_TRUE(h.host);
    double t = time_median(run_head, &h, quick ? 5 : 15, 5);
    backend_weight_release(gpu, &h.w);
    backend_buf_free(gpu, h.x);
    backend_buf_free(gpu, h.y);
    free(h.host);
    free(hw);
    return t;
}

static void bench_model(const char *dir, bool mtp)
{
    struct err_buf e = {{0}};
    struct ckpt *ck;
    struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = mtp ? 1 : 0 };

    if (ckpt_open(dir, &co, &ck, &e) < 0)
        FAIL("ckpt_open %s: %s", dir, e.msg);
    const struct model_config *cfg = ckpt_config(ck);
    const int batches[3] = { 1, 8, 64 };
    double t_graph[3] = { 0 }, t_eager[3] = { 0 }, t_head[3] = { 0 }, t_mtp = 0;
    tables_shuffle();
    for (int pass = 0; pass < 2; pass++) {
        struct backend *be;
        struct backend_cfg bc = { .device = 0 };
        struct model *m;
        struct model_opts mo = {
            .max_tokens_per_step = 256, .max_seqs = NSEQ, .max_logit_rows = NSEQ,
            .block_size = BS, .n_blocks = { NBLK, NBLK }, .max_seq_len = MAXLEN,
        };
        if (pass == 1)
            setenv("STEPD_CUDA_NO_GRAPHS", "1", 1);
        ASSERT_OK(backend_new("cuda", &bc, &be));
        if (model_new(ck, be, NULL, &mo, &m, &e) < 0)
            FAIL("model_new: %s", e.msg);
        struct backend *keep = gpu;
        gpu = be;
        for (int bi = 0; bi < 3; bi++) {
            const int B = batches[bi], ctx = 512;
            struct step_arg sa = { .m = m };
            int32_t toks[MAXLEN];
            sa.logits = malloc(sizeof(float) * (size_t)B * cfg->vocab_size);
            for (int i = 0; i < ctx; i++)
                toks[i] = (int32_t)(rnd() % (uint32_t)cfg->vocab_size);
            /* the context: prefill of each sequence (256 tokens a step), then decode */
            for (int s = 0; s < B; s++)
                for (int p0 = 0; p0 < ctx; p0 += 256) {
                    tp_init(&sa.tp);
                    tp_add_run(&sa.tp, s, p0, toks + p0, 256, 1, 0, 0);
                    ASSERT_OK(run_step(&sa));
                }
            tp_init(&sa.tp);
            for (int s = 0; s < B; s++)
                tp_add_run(&sa.tp, s, ctx, toks, 1, 1, mtp ? 1 : 0, 0);
            double t = time_median(run_step, &sa, quick ? 5 : 15, 5);
            (pass ? t_eager : t_graph)[bi] = t;
            if (pass == 0)
                t_head[bi] = time_head(cfg->vocab_size, cfg->hidden_size, B);
            if (pass == 0 && mtp && B == 1) {
                struct mtp_arg ma = { &sa, { 1 }, { toks[1] }, NULL };
                ma.logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
                ASSERT_TRUE(ma.logits);
                t_mtp = time_median(run_step_mtp, &ma, quick ? 5 : 15, 5) - t;
                free(ma.logits);
            }
            free(sa.logits);
        }
        gpu = keep;
        model_free(m);
        backend_free(be);
        unsetenv("STEPD_CUDA_NO_GRAPHS");
    }
    const double floor1 = step_bytes(cfg, 1) / (copy_bw / 2);   /* read-only bytes at ceiling */
    for (int bi = 0; bi < 3; bi++)
        printf("| synthetic model (%d layers) decode step, batch %d | %.2f ms graphs, %.2f ms "
               "eager | %.0f GB/s (graphs) | byte floor %.2f ms: %.2fx |\n", cfg->n_layers,
               batches[bi], t_graph[bi] * 1e3, t_eager[bi] * 1e3,
               step_bytes(cfg, batches[bi]) / t_graph[bi] / 1e9,
               step_bytes(cfg, batches[bi]) / (copy_bw / 2) * 1e3,
               t_graph[bi] / (step_bytes(cfg, batches[bi]) / (copy_bw / 2)));
    printf("batch-1 step over its byte floor (target <= 1.5x): %.2fx\n", t_graph[0] / floor1);
    /* per layer: the step less its head (lm_head + logits download), over the layers; the
     * 45-layer model: 45 such layers + the head */
    const double head_bytes = (double)cfg->vocab_size * cfg->hidden_size * 2;
    for (int bi = 0; bi < 3; bi++) {
        const int B = batches[bi];
        const double t_layer = (t_graph[bi] - t_head[bi]) / cfg->n_layers;
        const double layer_bytes = (step_bytes(cfg, B) - head_bytes) / cfg->n_layers;
        const double t45 = 45 * t_layer + t_head[bi], b45 = 45 * layer_bytes + head_bytes;
        printf("| per layer (graphs), batch %d | head %.3f ms, layer %.3f ms | %.0f GB/s | %.0f %% |\n",
               B, t_head[bi] * 1e3, t_layer * 1e3, layer_bytes / t_layer / 1e9,
               100 * layer_bytes / t_layer / copy_bw);
        printf("| 45-layer extrapolation, batch %d | %.2f ms/step, %.1f tok/s per sequence | "
               "%.0f GB/s | %.0f %% |\n", B, t45 * 1e3, 1 / t45, b45 / t45 / 1e9,
               100 * b45 / t45 / copy_bw);
    }
    if (mtp)
        printf("| one MTP depth after the batch-1 step (eager) | %.3f ms | | |\n", t_mtp * 1e3);
    ckpt_close(ck);
}

int main(int argc, char **argv)
{
    const char *model = NULL;
    bool mtp = false;
    struct backend_cfg cfg = { .device = 0 };

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc)
            model = argv[++i];
        else if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--mtp") == 0)
            mtp = true;
        else
            FAIL("usage: bench-cuda [--model DIR [--mtp]] [--quick]");
    }
    emulated = getenv("STEPD_TEST_EMULATED") != NULL;
    setvbuf(stdout, NULL, _IOLBF, 0);   /* each row as it is measured (device-check's log) */
    int r = backend_new("cuda", &cfg, &gpu);
    if (r == -ENODEV || r == -EINVAL) {
        printf("SKIP: no CUDA backend here (%s)\n", strerror(-r));
        return TEST_SKIP;
    }
    ASSERT_OK(r);
    printf("| what | shape | time / rate | %% of copy |\n| --- | --- | --- | --- |\n");
    bench_copy();
    bench_moe();
    if (!emulated) {    /* the emulator runs the MoE formats' paths only (test/cuemu) */
        bench_projection();
        bench_attention();
    }
    if (model)
        bench_model(model, mtp);
    backend_free(gpu);
    return 0;
}
