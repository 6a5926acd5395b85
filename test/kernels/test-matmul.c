/* test-matmul.c - matmul for F32, BF16 and MXFP4 (exact and fast paths) against naive
 * references on odd shapes, with 1, 2 and 3 threads.
 *
 * Properties:
 *  - MXFP4 exact == decode (docs/MODEL.md §5.3 formula) then fp64 dot in the documented
 *    16-lane order, bit for bit; and within 1e-6 relative of a sequential fp64 dot.
 *  - MXFP4 fast: |y - ref| <= Σ_j |w_j|·d_b/2 (the activation rounding bound, d_b =
 *    amax_b/127) + 1e-5·Σ|w·x|; its median relative error is reported.
 *  - BF16/F32: |y - ref| <= 1e-5·Σ|w·x| + 1e-6 (exact path; F32 on both paths).
 *  - BF16 fast path (backend_cfg.mxfp4_exact off): |y - ref| <= 2^-8·Σ|w·x| (the
 *    activations' rounding) + 1e-5·Σ|w·x| + 1e-6, and where it runs a BF16 kernel within
 *    1e-5·Σ|w·x| + 1e-6 of the fp64 dot with the activations rounded to BF16 (RNE) first;
 *    it differs from the exact path
 *    where the CPU has a fast kernel (AMX, AVX-512 BF16 with cols % 32 == 0) and equals it
 *    bit for bit elsewhere; the exact path equals the exact row kernels bit for bit (also
 *    with the fast path switched off by cpu_bf16_fast_off on a fast context, and for a
 *    weight marked bweight.exact, the MoE routers, on a fast context).
 *  - Results do not depend on the thread count or the token count (row i of a batch ==
 *    the same row alone).
 *  - BF16 batch invariance, exact and fast paths, with the AMX-BF16 path on (where the CPU
 *    has it) and off:
 *    for the tiny model's shapes and odd ones, every output row of a token is bit-identical
 *    whatever n (1, 3, 16, 37), whichever tokens share the call, the thread count (1, 2)
 *    and the row range a direct row-kernel call covers; and within the fp64 bound.
 *  - The worked examples of docs/MODEL.md §5.3; E8M0 255 is rejected at prepare.
 */
#include "kref.h"
#include "kisa.h"
#include "cpu.h"

static double fast_rel_max, fast_rel_sum;  /* |fast - ref| / Σ|w·x| over all outputs */
static long fast_rel_n;
static double bf16_rel_max, bf16_rel_sum;  /* the same for the BF16 fast path */
static long bf16_rel_n;

/* |y - ref| bound of a BF16 matmul on the exact or the fast path (see the header) */
static double bf16_tol(bool fast, double mag)
{
    return (fast ? 0x1p-8 + 1e-5 : 1e-5) * mag + 1e-6;
}

/* reference for the exact path: same lanes, same fold, independent decode */
static float ref_exact_dot(const struct bweight *w, int64_t o, const float *x)
{
    double acc[16] = { 0 };

    for (int64_t i = 0; i < w->cols; i++)
        acc[i % 16] += (double)kref_w(w, o, i) * (double)x[i];
    for (int s = 8; s > 0; s /= 2)
        for (int l = 0; l < s; l++)
            acc[l] += acc[l + s];
    return (float)acc[0];
}

static void check_mxfp4(int64_t rows, int64_t cols, int n, int nth)
{
    struct bweight w = kref_mxfp4_new(rows, cols, 120, 130), w_raw;
    struct backend *bx = kref_backend(nth, true), *bf = kref_backend(nth, false);
    float *x = malloc(sizeof(float) * n * cols);
    float *ye = malloc(sizeof(float) * n * rows), *yf = malloc(sizeof(float) * n * rows);
    float *yraw = malloc(sizeof(float) * n * rows), *y1 = malloc(sizeof(float) * rows);
    double *yr = malloc(sizeof(double) * n * rows), *mag = malloc(sizeof(double) * n * rows);

    krng_fill(x, (size_t)(n * cols), 3.0f);
    /* a few exact zeros and a larger outlier per row */
    for (int t = 0; t < n; t++) {
        x[(int64_t)t * cols] = 0.0f;
        x[(int64_t)t * cols + cols / 2 + 1] = 40.0f;
    }
    w_raw = w;
    ASSERT_OK(backend_matmul(bx, &w_raw, x, n, yraw));      /* unprepared: on-disk bytes */
    ASSERT_OK(backend_weight_prepare(bx, &w));
    ASSERT_TRUE(w.priv != NULL);
    ASSERT_OK(backend_matmul(bx, &w, x, n, ye));
    ASSERT_OK(backend_matmul(bf, &w, x, n, yf));
    kref_matmul(&w, x, n, yr, mag);

    for (int t = 0; t < n; t++) {
        const float *xt = x + (int64_t)t * cols;

        for (int64_t o = 0; o < rows; o++) {
            int64_t k = (int64_t)t * rows + o;
            float ex = ref_exact_dot(&w, o, xt);
            double bound = 0.0;

            if (ye[k] != ex || yraw[k] != ex)
                FAIL("exact mxfp4 %lldx%lld n=%d th=%d: y[%d,%lld] = %.9g / raw %.9g, ref %.9g",
                     (long long)rows, (long long)cols, n, nth, t, (long long)o, ye[k], yraw[k], ex);
            ASSERT_NEAR(ye[k], yr[k], 1e-6 * mag[k] + 1e-30);
            for (int64_t b = 0; b < cols / 32; b++) {
                float amax = 0.0f;
                double sw = 0.0;

                for (int j = 0; j < 32; j++) {
                    amax = fmaxf(amax, fabsf(xt[b * 32 + j]));
                    sw += fabs(kref_w(&w, o, b * 32 + j));
                }
                bound += sw * (amax / 127.0) / 2.0;
            }
            if (mag[k] > 0) {
                double rel = fabs(yf[k] - yr[k]) / mag[k];

                fast_rel_max = rel > fast_rel_max ? rel : fast_rel_max;
                fast_rel_sum += rel;
                fast_rel_n++;
            }
            if (!(fabs(yf[k] - yr[k]) <= bound * 1.0001 + 1e-5 * mag[k]))
                FAIL("fast mxfp4 %lldx%lld n=%d th=%d: y[%d,%lld] = %.9g, ref %.9g, bound %.3g",
                     (long long)rows, (long long)cols, n, nth, t, (long long)o, yf[k], yr[k], bound);
        }
    }
    /* the fast path really ran (it rounds activations, so some output differs) */
    if (rows * cols >= 37 * 1056 && cpu_isa_has(CPU_ISA_AVX2)) {
        int differ = 0;

        for (int64_t k = 0; k < n * rows; k++)
            differ += yf[k] != ye[k];
        ASSERT_TRUE(differ > 0);
    }
    /* token-count independence: last token alone gives the same row */
    ASSERT_OK(backend_matmul(bf, &w, x + (int64_t)(n - 1) * cols, 1, y1));
    ASSERT_TRUE(memcmp(y1, yf + (int64_t)(n - 1) * rows, sizeof(float) * rows) == 0);
    ASSERT_OK(backend_matmul(bx, &w, x + (int64_t)(n - 1) * cols, 1, y1));
    ASSERT_TRUE(memcmp(y1, ye + (int64_t)(n - 1) * rows, sizeof(float) * rows) == 0);

    backend_weight_release(bf, &w);
    ASSERT_TRUE(w.priv == NULL);
    kref_weight_free(&w);
    backend_free(bx);
    backend_free(bf);
    free(x); free(ye); free(yf); free(yraw); free(y1); free(yr); free(mag);
}

/* The 16-row AVX-512 VNNI kernel equals the 4-row kernel bit for bit: random weights
 * (scale bytes 0..3 included: zero and denormal scales), activations with zeros, an
 * outlier and (nonfinite) an infinity and a NaN; n = 1..nmax, identity and gathered
 * token rows (repeats, any order), whole and partial row ranges (16-row groups cut by
 * r0 and r1, row tails). */
static void check_t16(int64_t rows, int64_t cols, int nmax, bool nonfinite)
{
    struct bweight w = kref_mxfp4_new(rows, cols, 118, 131);
    struct backend *be = kref_backend(1, false);
    const int ntok = nmax + 3;
    float *x = malloc(sizeof(float) * ntok * cols);
    float *ya = malloc(sizeof(float) * nmax * rows), *yb = malloc(sizeof(float) * nmax * rows);
    int32_t *xidx = malloc(sizeof(int32_t) * nmax);
    void *mem = malloc(cpu_qact_bytes(ntok, cols));
    struct cpu_qact qa;
    const bool have = cpu_isa_has(CPU_ISA_VNNI);
    int64_t ranges[4][2] = { { 0, rows }, { 4, rows }, { 0, rows - rows % 4 }, { 20, 44 } };

    ASSERT_TRUE(x && ya && yb && xidx && mem);
    if (!have) {
        ASSERT_EQ(cpu_mxfp4_row_align(&w), MXFP4_TILE_ROWS);
        goto out;
    }
    ASSERT_EQ(cpu_mxfp4_row_align(&w), 16);
    for (int64_t i = 0; i < rows * cols / 32; i += 7)
        ((uint8_t *)w.scale)[i] = (uint8_t)(i % 4);     /* e <= 1: 0 on this path; 2, 3 */
    krng_fill(x, (size_t)(ntok * cols), 2.0f);
    for (int t = 0; t < ntok; t++) {
        x[(int64_t)t * cols + 3] = 0.0f;
        x[(int64_t)t * cols + cols - 1] = 50.0f;
        if (t % 3 == 1)
            memset(x + (int64_t)t * cols + 32, 0, 32 * sizeof(float));     /* d = 0 block */
    }
    if (nonfinite) {
        x[1 * cols + 5] = INFINITY;
        x[2 * cols + cols - 7] = NAN;
    }
    ASSERT_OK(backend_weight_prepare(be, &w));
    cpu_qact_init(&qa, mem, ntok, cols);
    for (int t = 0; t < ntok; t++)
        cpu_qact_quantize(&qa, t, x + (int64_t)t * cols, 0, cols / 32);
    for (int n = 1; n <= nmax; n++) {
        for (int k = 0; k < n; k++)
            xidx[k] = (int32_t)(krng_u64() % (uint64_t)ntok);
        for (int g = 0; g < 2; g++) {
            for (int rg = 0; rg < 4; rg++) {
                int64_t r0 = ranges[rg][0], r1 = ranges[rg][1] < rows ? ranges[rg][1] : rows;

                if (r0 >= r1)
                    continue;
                memset(ya, 0xa5, sizeof(float) * nmax * rows);
                memset(yb, 0xa5, sizeof(float) * nmax * rows);
                cpu_mxfp4_t16_off = 1;
                cpu_matmul_mxfp4_fast_rows(&w, &qa, g ? xidx : NULL, n, ya, rows, r0, r1);
                cpu_mxfp4_t16_off = 0;
                cpu_matmul_mxfp4_fast_rows(&w, &qa, g ? xidx : NULL, n, yb, rows, r0, r1);
                if (memcmp(ya, yb, sizeof(float) * n * rows) != 0) {
                    for (int64_t k = 0; k < n * rows; k++)
                        if (memcmp(ya + k, yb + k, 4) != 0)
                            FAIL("t16 %lldx%lld n=%d gather=%d rows [%lld,%lld): y[%lld,%lld] "
                                 "= %.9g, 4-row kernel %.9g", (long long)rows, (long long)cols, n,
                                 g, (long long)r0, (long long)r1, (long long)(k / rows),
                                 (long long)(k % rows), yb[k], ya[k]);
                }
            }
        }
    }
    backend_weight_release(be, &w);
out:
    kref_weight_free(&w);
    backend_free(be);
    free(x); free(ya); free(yb); free(xidx); free(mem);
}

/* fast path results are identical for every thread count */
static void check_thread_invariance(void)
{
    struct bweight w = kref_mxfp4_new(45, 352, 122, 128), wb = kref_bf16_new(45, 352, 1.0f);
    float x[3 * 352], y[3][3 * 45], yb[3][3 * 45];

    krng_fill(x, 3 * 352, 1.0f);
    for (int th = 1; th <= 3; th++) {
        struct backend *be = kref_backend(th, false);
        struct bweight wc = w;

        ASSERT_OK(backend_weight_prepare(be, &wc));
        ASSERT_OK(backend_matmul(be, &wc, x, 3, y[th - 1]));
        ASSERT_OK(backend_matmul(be, &wb, x, 3, yb[th - 1]));
        backend_weight_release(be, &wc);
        backend_free(be);
    }
    ASSERT_TRUE(memcmp(y[0], y[1], sizeof(y[0])) == 0 && memcmp(y[0], y[2], sizeof(y[0])) == 0);
    ASSERT_TRUE(memcmp(yb[0], yb[1], sizeof(yb[0])) == 0 && memcmp(yb[0], yb[2], sizeof(yb[0])) == 0);
    kref_weight_free(&w);
    kref_weight_free(&wb);
}

/* backend_matmul_rows: rows [r0, r1) into a strided y, bit for bit the rows of
 * backend_matmul, for every format and path (MXFP4 fast and exact, BF16 with and without
 * AMX, F32) and thread count; y's other columns untouched. */
static void check_matmul_rows(void)
{
    enum { R = 200, C = 256, N = 5, LD = 100 };
    static const int64_t ranges[][2] = { { 0, 64 }, { 32, 128 }, { 96, 192 }, { 160, R }, { 64, 64 } };
    float *x = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * R);
    float *yr = malloc(sizeof(float) * N * LD);

    krng_fill(x, (size_t)N * C, 1.0f);
    for (int f = 0; f < 5; f++) {
        struct bweight w = f < 2 ? kref_mxfp4_new(R, C, 120, 130) : f < 4 ? kref_bf16_new(R, C, 1.0f)
                                                                    : kref_f32_new(R, C, 1.0f);
        for (int nth = 1; nth <= 2; nth++) {
            struct backend *be = kref_backend(nth, f == 1);     /* f 1: MXFP4 exact path */
            struct bweight wc = w;

            cpu_amx_off = f == 3;
            ASSERT_OK(backend_weight_prepare(be, &wc));
            ASSERT_OK(backend_matmul(be, &wc, x, N, y));
            for (size_t q = 0; q < ARRAY_SIZE(ranges); q++) {
                const int64_t r0 = ranges[q][0], r1 = ranges[q][1];

                for (int k = 0; k < N * LD; k++)
                    yr[k] = -7.0f;
                ASSERT_OK(backend_matmul_rows(be, &wc, x, N, yr, LD, r0, r1));
                for (int i = 0; i < N; i++)
                    for (int64_t c = 0; c < LD; c++) {
                        float want = c < r1 - r0 ? y[i * R + r0 + c] : -7.0f;
                        if (memcmp(&yr[i * LD + c], &want, sizeof(float)) != 0)
                            FAIL("matmul_rows fmt %d th %d rows [%lld, %lld): y[%d][%lld] = %.9g, want %.9g", f,
                                 nth, (long long)r0, (long long)r1, i, (long long)c, yr[i * LD + c], want);
                    }
            }
            backend_weight_release(be, &wc);
            backend_free(be);
            cpu_amx_off = false;
        }
        kref_weight_free(&w);
    }
    free(x); free(y); free(yr);
}

static void check_dense(enum wfmt fmt, int64_t rows, int64_t cols, int n, int nth)
{
    struct bweight w = fmt == WFMT_BF16 ? kref_bf16_new(rows, cols, 1.0f) : kref_f32_new(rows, cols, 1.0f);
    float *x = malloc(sizeof(float) * n * cols), *y = malloc(sizeof(float) * n * rows);
    double *yr = malloc(sizeof(double) * n * rows), *mag = malloc(sizeof(double) * n * rows);

    krng_fill(x, (size_t)(n * cols), 2.0f);
    kref_matmul(&w, x, n, yr, mag);
    for (int fast = 0; fast <= 1; fast++) {
        struct backend *be = kref_backend(nth, !fast);
        const bool bf = fmt == WFMT_BF16 && fast;

        ASSERT_OK(backend_weight_prepare(be, &w));
        ASSERT_OK(backend_matmul(be, &w, x, n, y));
        for (int64_t k = 0; k < n * rows; k++)
            if (!(fabs(y[k] - yr[k]) <= bf16_tol(bf, mag[k])))
                FAIL("%s %lldx%lld n=%d th=%d fast=%d: y[%lld] = %.9g, ref %.9g",
                     fmt == WFMT_BF16 ? "bf16" : "f32", (long long)rows, (long long)cols, n, nth,
                     fast, (long long)k, y[k], yr[k]);
        backend_free(be);
    }
    kref_weight_free(&w);
    free(x); free(y); free(yr); free(mag);
}

/* The BF16 fast/exact switch (see the header) for n tokens of a rows x cols weight */
static void check_bf16_switch(int64_t rows, int64_t cols, int n, int nth)
{
    struct bweight w = kref_bf16_new(rows, cols, 1.0f);
    float *x = malloc(sizeof(float) * n * cols), *xr = malloc(sizeof(float) * n * cols);
    float *ye = malloc(sizeof(float) * n * rows), *yf = malloc(sizeof(float) * n * rows);
    float *yk = malloc(sizeof(float) * n * rows);
    double *yr = malloc(sizeof(double) * n * rows), *mag = malloc(sizeof(double) * n * rows);
    double *yb = malloc(sizeof(double) * n * rows), *magb = malloc(sizeof(double) * n * rows);
    struct backend *bx = kref_backend(nth, true), *bf = kref_backend(nth, false);
    const bool has_fast = cpu_isa_has(CPU_ISA_AVX2) && (cpu_bf16_use_amx(&w) || cpu_bf16_dp_fits(&w));
    int differ = 0;

    ASSERT_TRUE(x && xr && ye && yf && yk && yr && mag && yb && magb);
    krng_fill(x, (size_t)n * cols, 2.0f);
    for (int64_t k = 0; k < (int64_t)n * cols; k++)     /* the activations as BF16, RNE */
        xr[k] = kbf16_to_f32(cpu_f32_to_bf16(x[k]));
    kref_matmul(&w, x, n, yr, mag);
    kref_matmul(&w, xr, n, yb, magb);
    ASSERT_OK(backend_matmul(bx, &w, x, n, ye));
    ASSERT_OK(backend_matmul(bf, &w, x, n, yf));
    /* the exact path is the exact row kernels, bit for bit */
    cpu_matmul_bf16_rows(&w, x, NULL, n, yk, rows, 0, rows, cpu_isa_has(CPU_ISA_AVX2), false);
    ASSERT_TRUE(memcmp(ye, yk, sizeof(float) * n * rows) == 0);
    /* and so is a fast context with the fast path switched off (the benchmarks' "old") */
    cpu_bf16_fast_off = 1;
    ASSERT_OK(backend_matmul(bf, &w, x, n, yk));
    cpu_bf16_fast_off = 0;
    ASSERT_TRUE(memcmp(ye, yk, sizeof(float) * n * rows) == 0);
    /* and so is a weight marked exact (the MoE routers) on the fast context */
    w.exact = true;
    ASSERT_OK(backend_matmul(bf, &w, x, n, yk));
    w.exact = false;
    ASSERT_TRUE(memcmp(ye, yk, sizeof(float) * n * rows) == 0);
    for (int64_t k = 0; k < (int64_t)n * rows; k++) {
        if (!(fabs(yf[k] - yr[k]) <= bf16_tol(true, mag[k])) ||
            (has_fast && !(fabs(yf[k] - yb[k]) <= 1e-5 * magb[k] + 1e-6)))
            FAIL("bf16 fast %lldx%lld n=%d th=%d: y[%lld] = %.9g, ref %.9g (bf16 activations "
                 "%.9g), sum|w*x| %.3g", (long long)rows, (long long)cols, n, nth, (long long)k,
                 yf[k], yr[k], yb[k], mag[k]);
        if (mag[k] > 0) {
            double rel = fabs(yf[k] - yr[k]) / mag[k];

            bf16_rel_max = rel > bf16_rel_max ? rel : bf16_rel_max;
            bf16_rel_sum += rel;
            bf16_rel_n++;
        }
        differ += yf[k] != ye[k];
    }
    if (has_fast)
        ASSERT_TRUE(differ > 0);
    else
        ASSERT_EQ(differ, 0);
    backend_free(bx);
    backend_free(bf);
    kref_weight_free(&w);
    free(x); free(xr); free(ye); free(yf); free(yk); free(yr); free(mag); free(yb); free(magb);
}

/* BF16 batch invariance (see the header), with cpu_amx_off = amx_off, on the exact or
 * the fast path */
static void check_bf16_invariance(int64_t rows, int64_t cols, bool amx_off, bool fast)
{
    enum { NT = 37 };
    static const int ns[] = { 1, 3, 6, 11, 16, 21, 32, NT };
    struct bweight w = kref_bf16_new(rows, cols, 1.0f);
    float *x = malloc(sizeof(float) * NT * cols), *yall = malloc(sizeof(float) * NT * rows);
    float *y = malloc(sizeof(float) * NT * rows), *yoff = malloc(sizeof(float) * NT * rows);
    double *yr = malloc(sizeof(double) * NT * rows), *mag = malloc(sizeof(double) * NT * rows);
    int32_t xidx[NT];
    int differ = 0;

    ASSERT_TRUE(x && yall && y && yoff && yr && mag);
    krng_fill(x, (size_t)(NT * cols), 2.0f);
    /* token 1 spans many binades (the hi/lo split must hold everywhere); token 2 has zeros */
    for (int64_t j = 0; j < cols; j++) {
        x[cols + j] = ldexpf(x[cols + j], (int)(j % 41) - 20);
        if (j % 3 == 0)
            x[2 * cols + j] = 0.0f;
    }
    kref_matmul(&w, x, NT, yr, mag);
    cpu_amx_off = 1;
    {
        struct backend *be = kref_backend(1, !fast);

        ASSERT_OK(backend_matmul(be, &w, x, NT, yoff));
        backend_free(be);
    }
    cpu_amx_off = amx_off;
    for (int th = 1; th <= 2; th++) {
        struct backend *be = kref_backend(th, !fast);

        if (th == 1) {
            ASSERT_OK(backend_matmul(be, &w, x, NT, yall));
            for (int64_t k = 0; k < NT * rows; k++) {
                if (!(fabs(yall[k] - yr[k]) <= bf16_tol(fast, mag[k])))
                    FAIL("bf16 %lldx%lld amx_off=%d fast=%d: y[%lld] = %.9g, ref %.9g",
                         (long long)rows, (long long)cols, amx_off, fast, (long long)k, yall[k],
                         yr[k]);
                differ += yall[k] != yoff[k];
            }
        }
        for (size_t a = 0; a < ARRAY_SIZE(ns); a++) {
            const int n = ns[a], off = (n * 7 + th) % (NT - n + 1);

            ASSERT_OK(backend_matmul(be, &w, x + (int64_t)off * cols, n, y));
            if (memcmp(y, yall + (int64_t)off * rows, sizeof(float) * n * rows) != 0)
                FAIL("bf16 %lldx%lld amx_off=%d fast=%d: tokens %d..%d in a call of %d on %d "
                     "threads differ from the same tokens in a call of %d", (long long)rows,
                     (long long)cols, amx_off, fast, off, off + n - 1, n, th, NT);
        }
        backend_free(be);
    }
    /* the row kernel directly (as moe.c calls it): tokens picked by xidx in reverse, a
     * row range that starts and ends off the 16-row blocks */
    for (int i = 0; i < NT; i++)
        xidx[i] = NT - 1 - i;
    {
        int64_t r0 = rows > 20 ? 5 : 0, r1 = rows > 20 ? rows - 3 : rows;

        cpu_matmul_bf16_rows(&w, x, xidx, NT, y, r1 - r0, r0, r1, true, fast);
        for (int i = 0; i < NT; i++)
            if (memcmp(y + (int64_t)i * (r1 - r0), yall + (int64_t)xidx[i] * rows + r0,
                       sizeof(float) * (r1 - r0)) != 0)
                FAIL("bf16 %lldx%lld amx_off=%d fast=%d: rows [%lld, %lld) of token %d via the "
                     "row kernel differ from the matmul op", (long long)rows, (long long)cols,
                     amx_off, fast, (long long)r0, (long long)r1, xidx[i]);
    }
    /* the AMX path really ran where it applies (it rounds differently from AVX-512; the
     * fast path's kernels may agree on a small shape: check_bf16_switch covers them) */
    if (!amx_off && !fast && cpu_bf16_use_amx(&w))
        ASSERT_TRUE(differ > 0);
    if (amx_off)
        ASSERT_EQ(differ, 0);
    cpu_amx_off = 0;
    kref_weight_free(&w);
    free(x); free(y); free(yall); free(yoff); free(yr); free(mag);
}

/* AMX schemes (matmul-amx.c): calls of 6 .. 40 tokens (part tiles of 16 tokens, a short part
 * block for a rest of 11 .. 15, groups of 5 for the rest) give every token bit for bit what
 * calls of at most 5 tokens (group tiles only) give, on 1 and 2 threads, through the matmul
 * op and through the row kernel with tokens picked by xidx */
static void check_amx_schemes(int64_t rows, int64_t cols, bool fast)
{
    enum { NT = 48, NMIN = 6, NMAX = 40 };
    struct bweight w = kref_bf16_new(rows, cols, 1.0f);
    float *x = malloc(sizeof(float) * NT * cols), *yg = malloc(sizeof(float) * NT * rows);
    float *y = malloc(sizeof(float) * NT * rows);
    int32_t xidx[NT];

    ASSERT_TRUE(x && yg && y);
    krng_fill(x, (size_t)(NT * cols), 2.0f);
    for (int64_t j = 0; j < cols; j++) {     /* wide binades and zeros, as above */
        x[3 * cols + j] = ldexpf(x[3 * cols + j], (int)(j % 41) - 20);
        if (j % 3 == 0)
            x[20 * cols + j] = 0.0f;
    }
    cpu_amx_off = 0;
    {
        struct backend *be = kref_backend(1, !fast);

        for (int i = 0; i < NT; i += 5)
            ASSERT_OK(backend_matmul(be, &w, x + (int64_t)i * cols, NT - i < 5 ? NT - i : 5,
                                     yg + (int64_t)i * rows));
        backend_free(be);
    }
    for (int th = 1; th <= 2; th++) {
        struct backend *be = kref_backend(th, !fast);

        for (int n = NMIN; n <= NMAX; n++) {
            const int off = (n * 5 + th) % (NT - n + 1);

            memset(y, 0xff, sizeof(float) * n * rows);
            ASSERT_OK(backend_matmul(be, &w, x + (int64_t)off * cols, n, y));
            if (memcmp(y, yg + (int64_t)off * rows, sizeof(float) * n * rows) != 0)
                FAIL("bf16 AMX %lldx%lld fast=%d: tokens %d..%d in a call of %d on %d threads "
                     "differ from calls of <= 5 tokens", (long long)rows, (long long)cols, fast,
                     off, off + n - 1, n, th);
        }
        backend_free(be);
    }
    /* the row kernel (moe.c's way): tokens by xidx, a row range off the 16-row blocks */
    for (int n = NMIN; n <= NMAX; n += 3) {
        int64_t r0 = rows > 20 ? 3 : 0, r1 = rows > 20 ? rows - 5 : rows;

        for (int i = 0; i < n; i++)
            xidx[i] = (i * 7 + n) % NT;
        cpu_matmul_bf16_rows(&w, x, xidx, n, y, r1 - r0, r0, r1, true, fast);
        for (int i = 0; i < n; i++)
            if (memcmp(y + (int64_t)i * (r1 - r0), yg + (int64_t)xidx[i] * rows + r0,
                       sizeof(float) * (r1 - r0)) != 0)
                FAIL("bf16 AMX %lldx%lld fast=%d: rows [%lld, %lld) of token %d (%d of a row-kernel "
                     "call of %d) differ from calls of <= 5 tokens", (long long)rows,
                     (long long)cols, fast, (long long)r0, (long long)r1, xidx[i], i, n);
    }
    kref_weight_free(&w);
    free(x); free(y); free(yg);
}

/* Inf and NaN activations give the IEEE results (±Inf by the weight's sign, NaN) on every
 * BF16 path, and the other tokens stay finite */
static void check_bf16_nonfinite(void)
{
    enum { R = 32, C = 64 };
    struct bweight w = kref_bf16_new(R, C, 1.0f);
    uint16_t *wp = (uint16_t *)w.data;
    float x[3 * C], y[2][3 * R];

    for (int64_t k = 0; k < R * C; k++)     /* no zero weights: Inf * 0 would be NaN */
        if ((wp[k] & 0x7fff) == 0)
            wp[k] = 0x3f80;
    krng_fill(x, 3 * C, 1.0f);
    x[3] = INFINITY;
    x[C + 5] = NAN;
    for (int k = 0; k < 4; k++) {
        const int off = k % 2;
        struct backend *be = kref_backend(1, k < 2);   /* exact, then the fast path */

        cpu_amx_off = off;
        ASSERT_OK(backend_matmul(be, &w, x, 3, y[off]));
        for (int r = 0; r < R; r++) {
            float wr3 = kbf16_to_f32(wp[r * C + 3]);

            ASSERT_TRUE(isinf(y[off][r]) && (y[off][r] > 0) == (wr3 > 0));
            ASSERT_TRUE(isnan(y[off][R + r]));
            ASSERT_TRUE(isfinite(y[off][2 * R + r]));
        }
        backend_free(be);
    }
    cpu_amx_off = 0;
    kref_weight_free(&w);
}

static void check_worked_examples(void)
{
    /* docs/MODEL.md §5.3: 0xB3 @ 0x7E -> +0.75, -0.75; 0x70 @ 0x81 -> 0, 24 */
    uint8_t packed[2][16] = { { 0xB3 }, { 0 } }, scale[2] = { 0x7E, 0x81 };
    struct bweight w = { .fmt = WFMT_MXFP4, .rows = 2, .cols = 32, .data = packed, .scale = scale };
    struct backend *be = kref_backend(1, true);
    float x[32] = { 0 }, y[2];

    packed[1][0] = 0x70;
    ASSERT_OK(backend_weight_prepare(be, &w));
    x[0] = 1.0f;
    ASSERT_OK(backend_matmul(be, &w, x, 1, y));
    ASSERT_EQ(y[0] == 0.75f, 1);
    ASSERT_EQ(y[1] == 0.0f, 1);
    x[0] = 0.0f;
    x[1] = 1.0f;
    ASSERT_OK(backend_matmul(be, &w, x, 1, y));
    ASSERT_EQ(y[0] == -0.75f, 1);
    ASSERT_EQ(y[1] == 24.0f, 1);
    backend_weight_release(be, &w);

    /* a reserved scale byte is a corrupt file */
    scale[1] = 255;
    ASSERT_ERR(backend_weight_prepare(be, &w), -EINVAL);
    ASSERT_TRUE(w.priv == NULL);
    backend_free(be);
}

int main(void)
{
    setenv("STEPD_CPU_MIN_WORK", "0", 0);   /* split every op over all threads */
    const enum cpu_isa isa = kt_isa_require("matmul", CPU_ISA_SCALAR);
    static const int64_t shapes[][2] = { { 1, 32 }, { 7, 96 }, { 13, 160 }, { 4, 64 }, { 37, 1056 }, { 66, 4096 } };
    static const int ns[] = { 1, 2, 3, 5, 9 };

    krng_seed(1234);
    check_worked_examples();
    for (size_t s = 0; s < ARRAY_SIZE(shapes); s++)
        for (size_t k = 0; k < ARRAY_SIZE(ns); k++)
            check_mxfp4(shapes[s][0], shapes[s][1], ns[k], 1 + (int)((s + k) % 3));
    check_thread_invariance();
    check_matmul_rows();
    {
        static const int64_t t16_shapes[][3] = { { 128, 256, 20 }, { 256, 128, 20 }, { 37, 96, 20 },
                                                 { 45, 352, 9 }, { 64, 32, 6 }, { 4096, 256, 9 },
                                                 { 1280, 4096, 5 }, { 100, 1056, 7 } };

        for (size_t a = 0; a < ARRAY_SIZE(t16_shapes); a++)
            check_t16(t16_shapes[a][0], t16_shapes[a][1], (int)t16_shapes[a][2], a % 2 == 0);
    }
    check_dense(WFMT_BF16, 1, 7, 1, 1);
    check_dense(WFMT_BF16, 33, 100, 5, 2);
    check_dense(WFMT_BF16, 19, 4096, 6, 3);
    check_dense(WFMT_BF16, 5, 47, 13, 2);
    check_dense(WFMT_F32, 17, 61, 3, 2);
    check_dense(WFMT_F32, 3, 1024, 9, 1);
    /* every register-tile shape of the multi-token kernels (AVX2 3x4, AVX-512 4x6) and
     * their row / token / column remainders */
    {
        static const int64_t tile_rows[] = { 1, 2, 3, 4, 5, 7, 9, 17 };
        static const int64_t tile_cols[] = { 8, 15, 16, 33, 256 };
        static const int tile_ns[] = { 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 25 };

        for (size_t a = 0; a < ARRAY_SIZE(tile_rows); a++)
            for (size_t b = 0; b < ARRAY_SIZE(tile_cols); b++)
                for (size_t k = 0; k < ARRAY_SIZE(tile_ns); k++)
                    check_dense((a + b + k) % 2 ? WFMT_BF16 : WFMT_F32, tile_rows[a],
                                tile_cols[b], tile_ns[k], 1 + (int)((a + k) % 2));
    }
    /* BF16 batch invariance on the tiny model's shapes and odd ones (row tails, rows < 16,
     * an odd number of 32-column k-steps, cols % 32 != 0, 16384 columns: token blocks of
     * 32, so a call of 37 spans two), AMX on and off */
    {
        static const int64_t inv_shapes[][2] = { { 4096, 256 }, { 768, 256 }, { 256, 768 },
                                                 { 256, 384 }, { 128, 256 }, { 37, 1056 },
                                                 { 16, 32 }, { 21, 96 }, { 9, 64 }, { 40, 100 },
                                                 { 24, 16384 } };

        check_bf16_nonfinite();
        if (cpu_isa_has(CPU_ISA_AVX2))
            for (size_t a = 0; a < ARRAY_SIZE(inv_shapes); a++)
                for (int fast = 0; fast <= 1; fast++) {
                    check_bf16_invariance(inv_shapes[a][0], inv_shapes[a][1], false, fast);
                    check_bf16_invariance(inv_shapes[a][0], inv_shapes[a][1], true, fast);
                }
        ASSERT_EQ(cpu_amx_bf16_ok(), isa == CPU_ISA_AMX);
        if (cpu_amx_bf16_ok()) {
            static const int64_t amx_shapes[][2] = { { 4096, 256 }, { 128, 256 }, { 256, 768 },
                                                     { 768, 256 }, { 37, 1056 }, { 16, 32 },
                                                     { 21, 96 } };

            for (size_t a = 0; a < ARRAY_SIZE(amx_shapes); a++)
                for (int fast = 0; fast <= 1; fast++)
                    check_amx_schemes(amx_shapes[a][0], amx_shapes[a][1], fast);
        }
        printf("matmul: bf16 AMX path %s\n", cpu_amx_bf16_ok() ? "available and tested"
                                                               : "not available (AVX kernels tested)");
    }
    /* the BF16 fast/exact switch: tile remainders (rows, tokens), cols % 32 != 0, long rows */
    {
        static const int64_t sw_shapes[][3] = { { 7, 32, 1 }, { 21, 96, 5 }, { 45, 352, 7 },
                                                { 33, 100, 3 }, { 16, 64, 16 }, { 130, 1024, 13 },
                                                { 37, 4096, 2 }, { 64, 256, 40 } };

        for (size_t a = 0; a < ARRAY_SIZE(sw_shapes); a++)
            check_bf16_switch(sw_shapes[a][0], sw_shapes[a][1], (int)sw_shapes[a][2], 1 + (int)(a % 2));
        printf("matmul: bf16 fast path %s; error |y-ref|/sum|w*x|: mean %.2e max %.2e over %ld "
               "outputs (bound %.2e)\n",
               cpu_isa_has(CPU_ISA_AMX) ? "AMX one-part tiles"
               : cpu_isa_has(CPU_ISA_VNNI) && __builtin_cpu_supports("avx512bf16") ? "vdpbf16ps"
               : "= exact kernels (no BF16 instructions at this level)",
               bf16_rel_sum / (bf16_rel_n ? bf16_rel_n : 1), bf16_rel_max, bf16_rel_n, 0x1p-8);
    }
    printf("matmul: all checks passed; mxfp4 fast path error |y-ref|/sum|w*x|: mean %.2e max %.2e "
           "over %ld outputs\n", fast_rel_sum / (fast_rel_n ? fast_rel_n : 1), fast_rel_max, fast_rel_n);
    return 0;
}
