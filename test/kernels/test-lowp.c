/* test-lowp.c - the FP8 (block-scaled E4M3) and NVFP4 matmul kernels (matmul-fp8.c,
 * matmul-nvfp4.c) at this run's dispatch level, through backend_matmul (matmul.c) and
 * backend_moe (moe.c), against an fp64 reference with its own decode (the bit fields of
 * docs/MODEL.md §5.6-§5.7, not the kernels' tables):
 *   - exact path: bit for bit the reference summed in the documented 16-lane order;
 *   - fast path: within 1e-5 of Σ|w·x| of each output (fp32 decode and FMA order); NVFP4
 *     at levels vnni and avx2 (matmul-nvfp4-vnni.c, int8 activations as MXFP4's fast path) within
 *     the activation rounding's bound Σ|w_i|·d_b(i)/2 (d_b = amax of x's 32-block / 127);
 *     FP8 at level vnni with AVX-512 BF16 (matmul-fp8-bf16.c; at level amx its AMX tiles)
 *     within 2^-8 Σ|w·x| more, also on row ranges directly (check_fp8_rows);
 *   - the "fp16" run (test-lowp-fp16: level vnni with AVX512-FP16, else skipped; the other
 *     runs keep that form off): FP8 on FP16 FMAs (matmul-fp8-fp16.c) within fp16_bound,
 *     on adversarial data too, and batch-invariant bit for bit (check_fp8_fp16);
 *   - at level amx the FP8 AMX tiles (switched on here: cpu_fp8_amx_on) put back the tile
 *     configuration the BF16 AMX matmul keeps, and a configuration built in a function of
 *     its own is loaded whole (check_tilecfg: cpu_tile_loadconfig), and a tile load sees
 *     the stores before it (check_tile_loads: CPU_TILE_LOADD);
 *   - from AVX2 on the fast path is batch-invariant: a token's outputs equal a solo call's
 *     (NVFP4 with columns not a multiple of 64 too: matmul-nvfp4.c's fused form);
 *   - at level avx2 FP8's fast path is bit for bit a scalar model of its decode and order
 *     (fp8_avx2_model: every code, 1-21 tokens, 1-3 threads);
 *   - the weights stay in their format: the backend reads the checkpoint's bytes;
 *   - an E4M3 NaN code is refused at weight_prepare;
 *   - at levels vnni and avx2 an NVFP4 weight with 64-column pairs is repacked at
 *     weight_prepare, and the fast path (matmul and MoE) reads the repacked stream: a wrong
 *     repack fails the bounds above; its kernel on row ranges directly (check_nvfp4_rows);
 *     at level avx2 each output is the vnni kernel's bit for bit where the host has level
 *     vnni, and batch-invariant (check_nvfp4_levels). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <string.h>

#include "backend.h"
#include "cpu.h"
#include "harness.h"
#include "kisa.h"
#include "kref.h"
#include "tensor.h"

static double e4m3_ref(uint8_t b)
{
    int ex = (b >> 3) & 15, man = b & 7;
    double v = ex ? ldexp(1.0 + man / 8.0, ex - 7) : ldexp(man, -9);
    return (b & 0x80) ? -v : v;
}

static double w_ref(const struct bweight *w, int64_t o, int64_t i)
{
    static const double e2m1[8] = { 0, 0.5, 1, 1.5, 2, 3, 4, 6 };
    if (w->fmt == WFMT_FP8) {
        float s;
        memcpy(&s, w->scale + 4 * ((o / w->blk_rows) * (w->cols / w->blk_cols) + i / w->blk_cols), 4);
        return e4m3_ref(((const uint8_t *)w->data)[o * w->cols + i]) * s;
    }
    uint8_t c = (((const uint8_t *)w->data)[o * (w->cols / 2) + i / 2] >> (4 * (i % 2))) & 15;
    return e2m1[c & 7] * ((c & 8) ? -1 : 1) * e4m3_ref(w->scale[o * (w->cols / 16) + i / 16]) * w->gscale;
}

/* a random weight in fmt, quantised from uniform values by tensor.c's quantisers */
static struct bweight lowp_new(enum wfmt fmt, int64_t rows, int64_t cols, int br, int bc)
{
    struct bweight w = { .fmt = fmt, .rows = rows, .cols = cols };
    float *f = malloc(sizeof(float) * (size_t)(rows * cols));

    krng_fill(f, (size_t)(rows * cols), 0.5f);
    f[0] = 0.0f;
    if (fmt == WFMT_FP8) {
        uint8_t *q = malloc((size_t)(rows * cols));
        float *s = malloc(sizeof(float) * (size_t)((rows / br) * (cols / bc)));
        ASSERT_OK(fp8_block_quantize(f, rows, cols, br, bc, q, s));
        w.data = q;
        w.scale = (const uint8_t *)s;
        w.blk_rows = br;
        w.blk_cols = bc;
    } else {
        uint8_t *q = malloc((size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / 16));
        w.gscale = nvfp4_global_scale(f, rows * cols);
        for (int64_t r = 0; r < rows; r++)
            ASSERT_OK(nvfp4_row_quantize(f + r * cols, cols, w.gscale, q + r * cols / 2, s + r * cols / 16));
        w.data = q;
        w.scale = s;
    }
    free(f);
    return w;
}

static void lowp_free(struct bweight *w)
{
    free((void *)w->data);
    free((void *)w->scale);
}

static double ref_dot(const struct bweight *w, int64_t o, const float *x, double *mag)
{
    double acc[16] = { 0 };
    *mag = 0;
    for (int64_t i = 0; i < w->cols; i++) {
        acc[i % 16] += w_ref(w, o, i) * (double)x[i];
        *mag += fabs(w_ref(w, o, i) * (double)x[i]);
    }
    for (int s = 8; s > 0; s /= 2)
        for (int l = 0; l < s; l++)
            acc[l] += acc[l + s];
    return acc[0];
}

/* NVFP4 on the int8 path (levels vnni and up, and avx2; 64-column pairs): the bound of the activations'
 * rounding to int8 per 32-block, Σ |w_i| · d_b(i) / 2; FP8 on the BF16 path (level vnni
 * with AVX-512 BF16, 32-column multiples): the activations x scale rounded to BF16,
 * 2^-8 Σ |w·x| */
static bool int8_path(enum wfmt fmt, int64_t cols)
{
    return fmt == WFMT_NVFP4 && cols % 64 == 0 && (cpu_isa_has(CPU_ISA_VNNI) || cpu_isa() == CPU_ISA_AVX2);
}

static bool bf16_path(const struct bweight *w)
{
    return w->fmt == WFMT_FP8 && cpu_fp8_bf16_fits(w);
}

/* FP8 on the FP16 path (matmul-fp8-fp16.c: level vnni with AVX512-FP16, 32-column
 * multiples; the test's "fp16" run, else cpu_fp8_fp16_off keeps it off): x times a power of
 * two per token and chunk (up to 128 columns of a scale block) rounded to FP16, each lane's
 * up to 4 products summed by FP16 FMAs: |err| <= 5.05 · 2^-11 Σ|w·x| (x's rounding and 4
 * more, with their second-order terms) plus the subnormal floor 2^-27 Σ_chunks scale ·
 * amax|x| · columns (FP16's half subnormal spacing 2^-25 per rounding, the prescale
 * putting amax|x| at 2^12 or more) */
static bool fp16_path(const struct bweight *w)
{
    return w->fmt == WFMT_FP8 && cpu_fp8_fp16_fits(w);
}

static double fp16_bound(const struct bweight *w, int64_t o, const float *x, double mag)
{
    double b = 5.05 * 0x1p-11 * mag;

    for (int64_t c0 = 0; c0 < w->cols; c0 += w->blk_cols)
        for (int64_t c = c0; c < c0 + w->blk_cols; c += 128) {
            const int64_t e = c + 128 < c0 + w->blk_cols ? c + 128 : c0 + w->blk_cols;
            float amax = 0.0f, s;

            for (int64_t i = c; i < e; i++)
                amax = fmaxf(amax, fabsf(x[i]));
            memcpy(&s, w->scale + 4 * ((o / w->blk_rows) * (w->cols / w->blk_cols) + c0 / w->blk_cols), 4);
            b += 0x1p-27 * fabs((double)s) * amax * (double)(e - c);
        }
    return b;
}

/* the FP8 fast path's bound beyond fp32 rounding (FP16 or BF16 path; none on the fp32 ones) */
static double fp8_lowp_bound(const struct bweight *w, int64_t o, const float *x, double mag)
{
    return fp16_path(w) ? fp16_bound(w, o, x, mag) : bf16_path(w) ? 0x1p-8 * mag : 0.0;
}

static double int8_bound(const struct bweight *w, int64_t o, const float *x)
{
    double b = 0;
    for (int64_t k = 0; k < w->cols; k += 32) {
        float amax = 0.0f;
        for (int64_t i = k; i < k + 32; i++)
            amax = fmaxf(amax, fabsf(x[i]));
        for (int64_t i = k; i < k + 32; i++)
            b += fabs(w_ref(w, o, i)) * (amax / 127.0f) / 2;
    }
    return b;
}

/* w (freed here) on both paths against the reference */
static void check_matmul_w(struct bweight w, int n, int nth)
{
    const enum wfmt fmt = w.fmt;
    const int64_t rows = w.rows, cols = w.cols;
    struct backend *bx = kref_backend(nth, true), *bf = kref_backend(nth, false);
    float *x = malloc(sizeof(float) * (size_t)(n * cols));
    float *ye = malloc(sizeof(float) * (size_t)(n * rows)), *yf = malloc(sizeof(float) * (size_t)(n * rows));

    krng_fill(x, (size_t)(n * cols), 2.0f);
    ASSERT_OK(backend_weight_prepare(bx, &w));
    if (int8_path(fmt, cols) && !w.priv)
        FAIL("nvfp4 [%lldx%lld]: not repacked at weight_prepare", (long long)rows, (long long)cols);
    ASSERT_OK(backend_matmul(bx, &w, x, n, ye));
    ASSERT_OK(backend_matmul(bf, &w, x, n, yf));
    for (int t = 0; t < n; t++)
        for (int64_t o = 0; o < rows; o++) {
            double mag, ref = ref_dot(&w, o, x + (int64_t)t * cols, &mag);
            float e = ye[(int64_t)t * rows + o], f = yf[(int64_t)t * rows + o];
            if (e != (float)ref)
                FAIL("%s exact [%lldx%lld] n=%d t=%d row %lld: %.9g, reference %.9g", fmt == WFMT_FP8 ? "fp8" : "nvfp4",
                     (long long)rows, (long long)cols, n, t, (long long)o, e, (float)ref);
            double tol = 1e-5 * mag + 1e-30;
            if (int8_path(fmt, cols))
                tol += int8_bound(&w, o, x + (int64_t)t * cols);
            if (fmt == WFMT_FP8)
                tol += fp8_lowp_bound(&w, o, x + (int64_t)t * cols, mag);
            if (fabs(f - ref) > tol)
                FAIL("%s fast [%lldx%lld] t=%d row %lld: %.9g, reference %.9g (tolerance %g)",
                     fmt == WFMT_FP8 ? "fp8" : "nvfp4", (long long)rows, (long long)cols, t, (long long)o, f, ref, tol);
        }
    backend_weight_release(bx, &w);
    backend_free(bx);
    backend_free(bf);
    lowp_free(&w);
    free(x);
    free(ye);
    free(yf);
}

static void check_matmul(enum wfmt fmt, int64_t rows, int64_t cols, int br, int bc, int n, int nth)
{
    check_matmul_w(lowp_new(fmt, rows, cols, br, bc), n, nth);
}

/* every E4M3 code but NaN in an FP8 weight: row 0 only the subnormals and ±0 (the BF16
 * path converts those through its table), rows 1-4 all codes; scale blocks 32 wide (the
 * BF16 path's 32-column form) or 64 (its 64-column form where the host has VBMI) */
static void check_fp8_codes(int n, int bc)
{
    struct bweight w = lowp_new(WFMT_FP8, 6, 64, 2, bc);
    uint8_t *q = (uint8_t *)w.data;

    for (int c = 0; c < 64; c++)
        q[c] = (uint8_t)((c & 7) | ((c & 8) << 4));
    for (int i = 0; i < 256; i++)
        q[64 + i] = (uint8_t)((i & 0x7f) == 0x7f ? 0 : i);
    check_matmul_w(w, n, 1);
}

/* From AVX2 on, the fast path's (row, token) sum does not depend on how many tokens share
 * the call (matmul-lowp512.c, matmul-fp8.c, matmul-nvfp4*.c): each token of an n-token call equals, bit for bit,
 * a call with that token alone (the MoE relies on it: an expert reached by one token
 * computes what it would with sixteen, so MTP K=3 verifies what K=0 decodes) */
static void check_batch_invariant(enum wfmt fmt, int64_t rows, int64_t cols, int br, int bc, int n, int nth)
{
    struct bweight w = lowp_new(fmt, rows, cols, br, bc);
    struct backend *bf = kref_backend(nth, false);
    float *x = malloc(sizeof(float) * (size_t)(n * cols));
    float *yn = malloc(sizeof(float) * (size_t)(n * rows)), *y1 = malloc(sizeof(float) * (size_t)rows);

    krng_fill(x, (size_t)(n * cols), 2.0f);
    ASSERT_OK(backend_weight_prepare(bf, &w));
    ASSERT_OK(backend_matmul(bf, &w, x, n, yn));
    for (int t = 0; t < n; t++) {
        ASSERT_OK(backend_matmul(bf, &w, x + (int64_t)t * cols, 1, y1));
        for (int64_t o = 0; o < rows; o++)
            if (memcmp(&y1[o], &yn[(int64_t)t * rows + o], sizeof(float)) != 0)
                FAIL("%s [%lldx%lld] n=%d token %d row %lld: %.9g, alone %.9g", fmt == WFMT_FP8 ? "fp8" : "nvfp4",
                     (long long)rows, (long long)cols, n, t, (long long)o, yn[(int64_t)t * rows + o], y1[o]);
    }
    backend_weight_release(bf, &w);
    backend_free(bf);
    lowp_free(&w);
    free(x);
    free(yn);
    free(y1);
}

/* Level avx2, FP8's fast path (matmul-fp8.c, fp8_rows_avx2) in scalar, from the test's own
 * decode: each code's value x 2^-8 (exact in fp32), per scale block 4 fp32 FMA chains of 8
 * lanes (32-column steps: columns +0..7, +8..15, +16..23, +24..31 on chains 0-3; a last 16
 * on chains 0 and 1), lane-wise (c0 + c1) + (c2 + c3) FMAed with the block scale x 2^8 into
 * 8 lane accumulators, summed lane 0 to 7 from 0 */
static float fp8_avx2_model(const struct bweight *w, int64_t o, const float *x)
{
    const int64_t bc = w->blk_cols;
    float acc[8] = { 0 }, r = 0.0f;

    for (int64_t b = 0; b < w->cols; b += bc) {
        float c[4][8] = { { 0 } }, s;
        int64_t j = 0;

        memcpy(&s, w->scale + 4 * ((o / w->blk_rows) * (w->cols / bc) + b / bc), 4);
        s *= 0x1p8f;
        for (; j < bc; j += 32)
            for (int k = 0; k < (j + 16 < bc ? 4 : 2); k++)
                for (int l = 0; l < 8; l++) {
                    const int64_t i = o * w->cols + b + j + 8 * k + l;
                    const float v = (float)(e4m3_ref(((const uint8_t *)w->data)[i]) * 0x1p-8);
                    c[k][l] = fmaf(v, x[b + j + 8 * k + l], c[k][l]);
                }
        for (int l = 0; l < 8; l++)
            acc[l] = fmaf((c[0][l] + c[1][l]) + (c[2][l] + c[3][l]), s, acc[l]);
    }
    for (int l = 0; l < 8; l++)
        r += acc[l];
    return r;
}

/* Level avx2: FP8's fast path bit for bit fp8_avx2_model, on the given weight (freed here)
 * at 1-21 tokens (token passes of 3 and blocks of 16, groups of 1 row up to 2 tokens and 4
 * from 3) and 1-3 threads: its decode of every code and its order, the same at every token
 * count (batch-invariant) */
static void check_fp8_avx2_bits(struct bweight w)
{
    static const int ns[] = { 1, 2, 3, 4, 5, 9, 16, 21 };
    const int64_t rows = w.rows, cols = w.cols;
    float *x = malloc(sizeof(float) * 21 * (size_t)cols), *y = malloc(sizeof(float) * 21 * (size_t)rows);

    krng_fill(x, 21 * (size_t)cols, 2.0f);
    for (size_t k = 0; k < ARRAY_SIZE(ns); k++) {
        struct backend *bf = kref_backend(1 + (int)(k % 3), false);

        ASSERT_OK(backend_weight_prepare(bf, &w));
        ASSERT_OK(backend_matmul(bf, &w, x, ns[k], y));
        for (int t = 0; t < ns[k]; t++)
            for (int64_t o = 0; o < rows; o++) {
                const float f = y[(int64_t)t * rows + o], m = fp8_avx2_model(&w, o, x + (int64_t)t * cols);
                if (memcmp(&f, &m, sizeof(f)) != 0)
                    FAIL("fp8 avx2 [%lldx%lld] blocks %dx%d n=%d t=%d row %lld: %.9g, model %.9g", (long long)rows,
                         (long long)cols, w.blk_rows, w.blk_cols, ns[k], t, (long long)o, f, m);
            }
        backend_weight_release(bf, &w);
        backend_free(bf);
    }
    lowp_free(&w);
    free(x);
    free(y);
}

/* The MoE op with FP8 / NVFP4 experts: out += Σ weight · down(swiglu(gate x, up x)),
 * against the same computation from the fp64-decoded weights (within the fp32 rounding of
 * the intermediate activations, on the exact and the fast path; NVFP4's int8 path: 1 % of
 * Σ|terms|, the int8 rounding of x and of the intermediate activations; FP8's BF16 path
 * likewise) */
static void check_moe(enum wfmt fmt, int nth, bool exact)
{
    const int H = 64, I = 64, E = 4, T = 3, K = 2;
    struct moe_expert ex[4];
    struct backend *bx = kref_backend(nth, exact);
    float x[3 * 64], out[3 * 64] = { 0 }, wts[3 * 2] = { 0.7f, 0.3f, 0.5f, 0.5f, 1.0f, 0.25f };
    int32_t ids[3 * 2] = { 0, 3, 1, 2, 3, 0 };

    krng_fill(x, sizeof(x) / sizeof(x[0]), 1.0f);
    for (int e = 0; e < E; e++) {
        ex[e].gate = lowp_new(fmt, I, H, 32, 32);
        ex[e].up = lowp_new(fmt, I, H, 32, 32);
        ex[e].down = lowp_new(fmt, H, I, 32, 32);
        ASSERT_OK(backend_weight_prepare(bx, &ex[e].gate));
        ASSERT_OK(backend_weight_prepare(bx, &ex[e].up));
        ASSERT_OK(backend_weight_prepare(bx, &ex[e].down));
    }
    struct moe_args a = { .x = x, .out = out, .n_tok = T, .hidden = H, .inter = I, .top_k = K, .ids = ids,
                          .weights = wts, .experts = ex, .expert_first = 0, .n_local = E };
    ASSERT_OK(backend_moe(bx, &a));
    for (int t = 0; t < T; t++) {
        double ref[64] = { 0 }, mag[64] = { 0 };
        for (int k = 0; k < K; k++) {
            const struct moe_expert *m = &ex[ids[t * K + k]];
            double act[64];
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int h = 0; h < H; h++) {
                    g += w_ref(&m->gate, i, h) * x[t * H + h];
                    u += w_ref(&m->up, i, h) * x[t * H + h];
                }
                act[i] = g / (1 + exp(-g)) * u;
            }
            for (int h = 0; h < H; h++) {
                double d = 0, dm = 0;
                for (int i = 0; i < I; i++) {
                    d += w_ref(&m->down, h, i) * act[i];
                    dm += fabs(w_ref(&m->down, h, i) * act[i]);
                }
                ref[h] += wts[t * K + k] * d;
                mag[h] += fabs(wts[t * K + k]) * dm;
            }
        }
        for (int h = 0; h < H; h++)
            if (fabs(out[t * H + h] - ref[h]) >
                (!exact && (int8_path(fmt, H) || bf16_path(&ex[0].gate) || fp16_path(&ex[0].gate)) ? 1e-2 : 1e-5) *
                        mag[h] + 1e-12)
                FAIL("%s moe t=%d h=%d: %.9g, reference %.9g", fmt == WFMT_FP8 ? "fp8" : "nvfp4", t, h,
                     out[t * H + h], ref[h]);
    }
    for (int e = 0; e < E; e++) {
        backend_weight_release(bx, &ex[e].gate);
        backend_weight_release(bx, &ex[e].up);
        backend_weight_release(bx, &ex[e].down);
        lowp_free(&ex[e].gate);
        lowp_free(&ex[e].up);
        lowp_free(&ex[e].down);
    }
    backend_free(bx);
}

/* weight_prepare refuses an E4M3 NaN code (FP8 weight, NVFP4 group scale), as MXFP4's
 * E8M0 255: a corrupt file, not a value */
static void check_nan_refused(void)
{
    struct backend *be = kref_backend(1, false);

    for (int f = 0; f < 2; f++) {
        struct bweight w = lowp_new(f ? WFMT_NVFP4 : WFMT_FP8, 4, 32, 2, 16);
        uint8_t *p = (uint8_t *)(f ? w.scale : w.data);
        ASSERT_OK(backend_weight_prepare(be, &w));
        backend_weight_release(be, &w);
        p[5] = f ? 0xff : 0x7f;
        ASSERT_ERR(backend_weight_prepare(be, &w), -EINVAL);
        lowp_free(&w);
    }
    backend_free(be);
}

/* w's fast-path row kernel (cpu_matmul_fp8_rows / cpu_matmul_nvfp4_rows) called on row
 * ranges directly, R rows x C columns, tokens gathered through xidx in reverse, 1-33 tokens,
 * the given ranges; each output against the reference within 1e-5 Σ|w·x| plus the path's
 * bound (NVFP4: the int8 one; FP8: 2^-8 Σ|w·x|), the rows outside the range untouched */
static void check_rows(const struct bweight *w, const int *ns, size_t n_ns, const int64_t (*ranges)[2],
                       size_t n_ranges)
{
    enum { N = 33 };
    const int64_t R = w->rows, C = w->cols;
    const char *name = w->fmt == WFMT_FP8 ? "fp8" : "nvfp4";
    float *x = malloc(sizeof(float) * N * (size_t)C), *y = malloc(sizeof(float) * N * (size_t)R);
    float *buf = aligned_alloc(64, sizeof(float) * (size_t)CPU_LOWP_BUF(C));
    int32_t xidx[N];

    krng_fill(x, N * (size_t)C, 2.0f);
    for (size_t k = 0; k < n_ns; k++)
        for (size_t g = 0; g < n_ranges; g++) {
            const int n = ns[k];
            const int64_t r0 = ranges[g][0], r1 = ranges[g][1];

            for (int i = 0; i < n; i++)
                xidx[i] = n - 1 - i;
            for (int64_t i = 0; i < N * R; i++)
                y[i] = -7.0f;
            if (w->fmt == WFMT_FP8)
                cpu_matmul_fp8_rows(w, x, xidx, n, y, R, r0, r1, false, buf);
            else
                cpu_matmul_nvfp4_rows(w, x, xidx, n, y, R, r0, r1, false, buf);
            /* token t's outputs: y[t * R + (o - r0)] for rows o in [r0, r1), the rest untouched */
            for (int t = 0; t < n; t++)
                for (int64_t at = 0; at < R; at++) {
                    const int64_t o = r0 + at;
                    const float f = y[(int64_t)t * R + at];
                    const float *xt = x + (int64_t)xidx[t] * C;
                    double mag, ref, tol;

                    if (o >= r1) {
                        if (f != -7.0f)
                            FAIL("%s rows [%lld, %lld) n=%d t=%d: slot %lld written", name, (long long)r0,
                                 (long long)r1, n, t, (long long)at);
                        continue;
                    }
                    ref = ref_dot(w, o, xt, &mag);
                    tol = 1e-5 * mag + 1e-30 + (w->fmt == WFMT_FP8 ? fp8_lowp_bound(w, o, xt, mag) : int8_bound(w, o, xt));
                    if (fabs(f - ref) > tol)
                        FAIL("%s rows [%lld, %lld) n=%d t=%d row %lld: %.9g, reference %.9g (tolerance %g)", name,
                             (long long)r0, (long long)r1, n, t, (long long)o, f, ref, tol);
                }
        }
    free(x);
    free(y);
    free(buf);
}

/* Levels vnni and avx2, NVFP4's int8 kernels (matmul-nvfp4-vnni.c) on row ranges (check_rows):
 * 40 rows (groups of 16, the last 8 rows padding) x 192 columns, 1-33 tokens (passes of 8
 * or 4 and their tails, 16-token blocks, 128-row chunks), ranges starting on a group and inside
 * one: a scale or nibble put in another row's lane, or a group stored at the wrong rows,
 * fails */
static void check_nvfp4_rows(void)
{
    static const int ns[] = { 1, 7, 8, 9, 16, 17, 33 };
    static const int64_t ranges[][2] = { { 0, 40 }, { 16, 40 }, { 5, 37 }, { 0, 16 } };
    struct bweight w = lowp_new(WFMT_NVFP4, 40, 192, 0, 0);
    struct backend *bf = kref_backend(1, false);

    ASSERT_OK(backend_weight_prepare(bf, &w));
    if (!w.priv)
        FAIL("nvfp4 [40x192]: not repacked at weight_prepare");
    check_rows(&w, ns, ARRAY_SIZE(ns), ranges, ARRAY_SIZE(ranges));
    backend_weight_release(bf, &w);
    backend_free(bf);
    lowp_free(&w);
}

/* Level avx2, NVFP4's int8 path (matmul-nvfp4-vnni.c, the 8-row vpmaddubsw kernel): each
 * output equals, bit for bit, a one-token call of the vnni kernel (where the host has level
 * vnni: cpu_isa_set raises the level for the reference and lowers it back; else of the avx2
 * kernel): 200 rows (16-row groups, the last one half padding) x 320 columns, 23 and 6
 * tokens through the backend on 1 and 3 threads (passes of 4 and tails of 3 and 2, two
 * 16-token blocks, 128-row chunks, row splits) and 23 through the row kernel on ranges inside a group with the
 * tokens gathered by a permuting xidx: a float operation out of the vnni kernel's order, a
 * 16-bit sum that saturates, or a token's sum that depends on its pass fails */
static void check_nvfp4_levels(void)
{
    enum { R = 200, C = 320, N = 23 };
    static const int64_t ranges[][2] = { { 5, 37 }, { 16, 200 }, { 0, 8 } };
    const enum cpu_isa ref_level = cpu_isa_host() >= CPU_ISA_VNNI ? CPU_ISA_VNNI : CPU_ISA_AVX2;
    struct bweight w = lowp_new(WFMT_NVFP4, R, C, 0, 0);
    struct backend *be[2] = { kref_backend(1, false), kref_backend(3, false) };
    float *x = malloc(sizeof(float) * N * C), *y1 = malloc(sizeof(float) * N * R);
    float *yn = malloc(sizeof(float) * N * R), *buf = aligned_alloc(64, sizeof(float) * (size_t)CPU_LOWP_BUF(C));
    int32_t xidx[N];

    krng_fill(x, N * C, 2.0f);
    /* the 16-bit sums' extreme: token 0's first pair all q = 127 against rows 0 and 9 all
     * +6 (biased 24): 4 x 2 x 24 x 127 = 24384 per lane (more pairs summed would saturate) */
    for (int i = 0; i < 64; i++)
        x[i] = 3.0f;
    for (int r = 0; r < 10; r += 9)
        memset((uint8_t *)w.data + r * (C / 2), 0x77, 32);
    ASSERT_OK(backend_weight_prepare(be[0], &w));
    if (!w.priv || !cpu_nvfp4_int8_fits(&w))
        FAIL("nvfp4 [%dx%d]: not repacked for the int8 path at level avx2", R, C);
    cpu_isa_set(ref_level);
    if (!cpu_nvfp4_int8_fits(&w))
        FAIL("nvfp4: not on the int8 path at level %s", cpu_isa_name(ref_level));
    for (int t = 0; t < N; t++) {
        xidx[0] = t;
        cpu_matmul_nvfp4_rows(&w, x, xidx, 1, y1 + (int64_t)t * R, R, 0, R, false, buf);
    }
    cpu_isa_set(CPU_ISA_AVX2);
    for (int k = 0; k < 4; k++) {
        const int n = k < 2 ? N : 6;

        ASSERT_OK(backend_matmul(be[k % 2], &w, x, n, yn));
        for (int64_t i = 0; i < n * R; i++)
            if (memcmp(&yn[i], &y1[i], sizeof(float)) != 0)
                FAIL("nvfp4 avx2 [%dx%d] n=%d on %d threads token %lld row %lld: %.9g, %s solo %.9g", R, C, n,
                     k % 2 ? 3 : 1, (long long)(i / R), (long long)(i % R), yn[i], cpu_isa_name(ref_level), y1[i]);
    }
    for (size_t g = 0; g < ARRAY_SIZE(ranges); g++) {
        const int64_t r0 = ranges[g][0], r1 = ranges[g][1];

        for (int i = 0; i < N; i++)
            xidx[i] = (5 * i + 2) % N;
        cpu_matmul_nvfp4_rows(&w, x, xidx, N, yn, R, r0, r1, false, buf);
        for (int t = 0; t < N; t++)
            for (int64_t o = r0; o < r1; o++)
                if (memcmp(&yn[(int64_t)t * R + (o - r0)], &y1[(int64_t)xidx[t] * R + o], sizeof(float)) != 0)
                    FAIL("nvfp4 avx2 rows [%lld, %lld) t=%d row %lld: %.9g, %s solo %.9g", (long long)r0,
                         (long long)r1, t, (long long)o, yn[(int64_t)t * R + (o - r0)], cpu_isa_name(ref_level),
                         y1[(int64_t)xidx[t] * R + o]);
    }
    backend_weight_release(be[0], &w);
    backend_free(be[0]);
    backend_free(be[1]);
    lowp_free(&w);
    free(x);
    free(y1);
    free(yn);
    free(buf);
}

/* Level vnni and up, FP8's BF16 kernels (matmul-fp8-bf16.c: vdpbf16ps, or at level amx the
 * AMX tiles) on row ranges (check_rows): 48 rows in row blocks of 24 (so 16-row groups are
 * cut short by a block's end and by the range's) x 192 columns in 64-column scale blocks,
 * 1-33 tokens (16-token blocks and their tails: the AMX tiles configured per token count),
 * ranges starting on a group and inside one: a row put in another's tile row, a token's
 * activations in another's tile column, or a block's scales on the wrong rows fails */
static void check_fp8_rows(void)
{
    static const int ns[] = { 1, 2, 7, 16, 17, 33 };
    static const int64_t ranges[][2] = { { 0, 48 }, { 16, 48 }, { 5, 37 }, { 0, 16 }, { 3, 9 } };
    struct bweight w = lowp_new(WFMT_FP8, 48, 192, 24, 64);

    if (!bf16_path(&w) && !fp16_path(&w))
        FAIL("fp8 [48x192]: not on the BF16 or FP16 path at level vnni");
    check_rows(&w, ns, ARRAY_SIZE(ns), ranges, ARRAY_SIZE(ranges));
    lowp_free(&w);
}

/* An FP8 weight for the FP16 path's adversarial check: codes ±448 (E4M3's extremes),
 * subnormals and random ones, row 0 all +448 (with an all-positive chunk of x near the top
 * of its binade each lane's 4-term FP16 sum is 7 · 0.999 · 2^13, just under FP16's
 * largest: a prescale twice too large overflows), block scales from 2^-100 to 2^60 */
static struct bweight fp16_adv_weight(int64_t rows, int64_t cols, int br, int bc)
{
    static const float base[] = { 0x1p-100f, 0x1p-60f, 0x1p-8f, 1.0f, 0x1p20f, 0x1p60f };
    struct bweight w = { .fmt = WFMT_FP8, .rows = rows, .cols = cols, .blk_rows = br, .blk_cols = bc };
    uint8_t *q = malloc((size_t)(rows * cols));
    float *s = malloc(sizeof(float) * (size_t)((rows / br) * (cols / bc)));

    for (int64_t i = 0; i < rows * cols; i++) {
        const uint64_t r = krng_u64();
        const uint8_t sign = (uint8_t)((r >> 8) & 0x80);

        if (i < cols)
            q[i] = 0x7e;
        else if (r % 4 == 0)
            q[i] = 0x7e | sign;
        else if (r % 4 == 1)
            q[i] = (uint8_t)((r >> 16) % 8) | sign;
        else
            q[i] = (uint8_t)((r >> 16) % 127) | sign;   /* 0x7f (NaN) excluded */
    }
    for (int64_t k = 0; k < (rows / br) * (cols / bc); k++)
        s[k] = base[krng_u64() % ARRAY_SIZE(base)] * (1.0f + 0.5f * fabsf(krng_f()));
    w.data = q;
    w.scale = (const uint8_t *)s;
    return w;
}

/* n tokens of x per 128 columns: zero; uniform at 2^e (e in [-30, 20]); all positive at
 * 0.999 · 2^e (the overflow case of fp16_adv_weight's row 0); one element 2^e and the rest
 * 2^(e-30) (FP16 subnormals after the prescale); exact powers of two; FP32 subnormals */
static void fp16_adv_x(float *x, int n, int64_t cols)
{
    for (int t = 0; t < n; t++)
        for (int64_t c = 0; c < cols; c += 32) {
            float *v = x + (int64_t)t * cols + c;
            const int mode = (int)(krng_u64() % 6), e = (int)(krng_u64() % 51) - 30;

            for (int i = 0; i < 32; i++) {
                const float r = krng_f();

                switch (mode) {
                case 0: v[i] = 0.0f; break;
                case 1: v[i] = ldexpf(r, e); break;
                case 2: v[i] = ldexpf(0.999f, e); break;
                case 3: v[i] = i == 5 ? ldexpf(1.0f, e) : ldexpf(r, e - 30); break;
                case 4: v[i] = ldexpf(r < 0 ? -1.0f : 1.0f, e - (int)(krng_u64() % 20)); break;
                default: v[i] = ldexpf(r, -135); break;
                }
            }
        }
}

/* Level vnni with AVX512-FP16 (the "fp16" run): the FP16 path on fp16_adv_weight and
 * fp16_adv_x, 128-column blocks (4-product chunks), 160 (a chunk of 128 and one of 32) and
 * 64, row blocks of 10 and 4 (tiles cut short): each token alone within fp16_bound of the
 * reference; then every n = 1..40 (token blocks of 12 and their tails) on 1-3 threads, each
 * token bit for bit its solo result; and the row kernel on row ranges with the tokens
 * gathered through a permuting xidx, bit for bit too */
static void check_fp8_fp16(void)
{
    enum { N = 40 };
    static const int64_t shapes[][4] = { { 40, 512, 10, 128 }, { 40, 320, 10, 160 }, { 12, 192, 4, 64 } };
    static const int64_t ranges[][2] = { { 0, 40 }, { 3, 35 }, { 5, 9 }, { 0, 12 } };
    struct backend *be[4] = { NULL, kref_backend(1, false), kref_backend(2, false), kref_backend(3, false) };

    for (size_t k = 0; k < ARRAY_SIZE(shapes); k++) {
        const int64_t R = shapes[k][0], C = shapes[k][1];
        struct bweight w = fp16_adv_weight(R, C, (int)shapes[k][2], (int)shapes[k][3]);
        float *x = malloc(sizeof(float) * N * (size_t)C), *y1 = malloc(sizeof(float) * N * (size_t)R);
        float *yn = malloc(sizeof(float) * N * (size_t)R);
        float *buf = aligned_alloc(64, sizeof(float) * (size_t)CPU_LOWP_BUF(C));
        int32_t xidx[N];

        if (!fp16_path(&w))
            FAIL("fp8 [%lldx%lld]: not on the FP16 path", (long long)R, (long long)C);
        fp16_adv_x(x, N, C);
        for (int t = 0; t < N; t++) {
            ASSERT_OK(backend_matmul(be[1], &w, x + (int64_t)t * C, 1, y1 + (int64_t)t * R));
            for (int64_t o = 0; o < R; o++) {
                double mag, ref = ref_dot(&w, o, x + (int64_t)t * C, &mag);
                double tol = 1e-5 * mag + 1e-30 + fp16_bound(&w, o, x + (int64_t)t * C, mag);
                float f = y1[(int64_t)t * R + o];

                if (!(fabs(f - ref) <= tol))
                    FAIL("fp8 fp16 [%lldx%lld/%lld] t=%d row %lld: %.9g, reference %.9g (tolerance %g)",
                         (long long)R, (long long)C, (long long)shapes[k][3], t, (long long)o, f, ref, tol);
            }
        }
        for (int n = 1; n <= N; n++) {
            ASSERT_OK(backend_matmul(be[1 + n % 3], &w, x, n, yn));
            if (memcmp(yn, y1, sizeof(float) * (size_t)(n * R)) != 0)
                FAIL("fp8 fp16 [%lldx%lld] n=%d on %d threads: a token differs from its solo call", (long long)R,
                     (long long)C, n, 1 + n % 3);
        }
        for (size_t g = 0; g < ARRAY_SIZE(ranges); g++)
            for (int n = 13; n <= N; n += 27) {
                const int64_t r0 = ranges[g][0], r1 = ranges[g][1] < R ? ranges[g][1] : R;

                for (int i = 0; i < n; i++)
                    xidx[i] = (7 * i + 3) % N;
                cpu_matmul_fp8_rows(&w, x, xidx, n, yn, R, r0, r1, false, buf);
                for (int t = 0; t < n; t++)
                    for (int64_t o = r0; o < r1; o++)
                        if (memcmp(&yn[(int64_t)t * R + (o - r0)], &y1[(int64_t)xidx[t] * R + o], sizeof(float)))
                            FAIL("fp8 fp16 rows [%lld, %lld) n=%d t=%d row %lld: %.9g, solo %.9g", (long long)r0,
                                 (long long)r1, n, t, (long long)o, yn[(int64_t)t * R + (o - r0)],
                                 y1[(int64_t)xidx[t] * R + o]);
            }
        lowp_free(&w);
        free(x);
        free(y1);
        free(yn);
        free(buf);
    }
    for (int i = 1; i < 4; i++)
        backend_free(be[i]);
}

/* Level amx: the FP8 tiles load their own tile configuration (B and C tiles as wide as the
 * token count) and put back the one in place, which the BF16 AMX matmul (matmul-amx.c)
 * loads once per thread and keeps: a BF16 matmul after an FP8 one gives what it gave
 * before it, bit for bit */
/* Level amx: a tile configuration built in a function of its own and loaded there by
 * cpu_tile_loadconfig (cpu.h, the kernels' LDTILECFG) is what the CPU then holds: STTILECFG
 * gives back its 64 bytes.  GCC 12's _tile_loadconfig in its place lets the compiler drop
 * the stores of colsb and rows (its operand is 8 bytes): the CPU holds zero-sized tiles. */
static void tilecfg_fill(struct cpu_tilecfg *c, int nt)
{
    memset(c, 0, sizeof(*c));
    c->palette = 1;
    for (int i = 0; i < 8; i++) {
        c->colsb[i] = (uint16_t)(i == 4 || i == 5 ? 64 : 4 * nt);
        c->rows[i] = (uint8_t)(16 - i);
    }
}

__attribute__((noinline)) static void tilecfg_load(int nt)
{
    struct cpu_tilecfg c;

    tilecfg_fill(&c, nt);
    cpu_tile_loadconfig(&c);
}

static void check_tilecfg(void)
{
    struct cpu_tilecfg had, want, got;

    cpu_tile_storeconfig(&had);     /* this thread's configuration, put back at the end */
    for (int nt = 1; nt <= 16; nt++) {
        tilecfg_load(nt);
        tilecfg_fill(&want, nt);
        memset(&got, 0xa5, sizeof(got));
        cpu_tile_storeconfig(&got);
        for (int i = 0; i < 8; i++)
            if (got.palette != 1 || got.colsb[i] != want.colsb[i] || got.rows[i] != want.rows[i])
                FAIL("tile configuration for %d tokens: tile %d holds palette %d, %d rows of %d bytes; "
                     "loaded palette 1, %d rows of %d bytes", nt, i, got.palette, got.rows[i], got.colsb[i],
                     want.rows[i], want.colsb[i]);
    }
    if (had.palette)
        cpu_tile_loadconfig(&had);
    else
        __asm__ volatile("tilerelease");
}

/* Level amx: tiles loaded by CPU_TILE_LOADD (cpu.h, the kernels' TILELOADD) from a buffer
 * that the same function fills anew before each load, in a loop the compiler unrolls: each
 * product uses its own fill.  With GCC 12's _tile_loadd, which names no memory, the fills
 * but the last are dead stores to the compiler: it keeps one, and the sum is wrong. */
__attribute__((target("amx-tile,amx-bf16"), noinline)) static void tiles_refill(const uint16_t *a,
                                                                                const uint16_t *b, float *c)
{
    uint16_t buf[16][32] __attribute__((aligned(64)));

    _tile_zero(0);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 32; j++)
                buf[i][j] = a[k * 512 + i * 32 + j];
        CPU_TILE_LOADD(4, buf, 64);
        CPU_TILE_LOADD(6, b + k * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, c, 64);
}

static void check_tile_loads(void)
{
    struct cpu_tilecfg had, cfg;
    uint16_t a[4 * 512], b[4 * 512];
    float c[16 * 16];

    /* small integers in BF16: every product and sum exact in any order */
    for (int i = 0; i < 4 * 512; i++) {
        a[i] = cpu_f32_to_bf16((float)((i * 7 + i / 512) % 5) - 2.0f);
        b[i] = cpu_f32_to_bf16((float)((i * 3 + 1) % 7) - 3.0f);
    }
    cpu_tile_storeconfig(&had);
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    cpu_tile_loadconfig(&cfg);
    tiles_refill(a, b, c);
    if (had.palette)
        cpu_tile_loadconfig(&had);
    else
        __asm__ volatile("tilerelease");
    /* C[i][j] = sum over k, p < 16, e < 2 of A_k[i][2p + e] B_k[p][2j + e] */
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float want = 0.0f;

            for (int k = 0; k < 4; k++)
                for (int p = 0; p < 16; p++)
                    for (int e = 0; e < 2; e++)
                        want += cpu_bf16_to_f32(a[k * 512 + i * 32 + 2 * p + e]) *
                                cpu_bf16_to_f32(b[k * 512 + p * 32 + 2 * j + e]);
            if (c[i * 16 + j] != want)
                FAIL("tiles loaded from a buffer refilled 4 times: C[%d][%d] = %g, want %g", i, j,
                     c[i * 16 + j], want);
        }
}

static void check_amx_config_kept(void)
{
    enum { R = 32, C = 128, N = 5 };
    struct bweight wb = kref_bf16_new(R, C, 1.0f), w8 = lowp_new(WFMT_FP8, R, C, 32, 64);
    struct backend *bf = kref_backend(1, false);
    float *x = malloc(sizeof(float) * N * C), *y0 = malloc(sizeof(float) * N * R);
    float *y1 = malloc(sizeof(float) * N * R), *y8 = malloc(sizeof(float) * N * R);

    if (!cpu_bf16_use_amx(&wb) || !cpu_fp8_amx_fits(&w8))
        FAIL("level amx: BF16 [%dx%d] or FP8 not on the AMX tiles", R, C);
    krng_fill(x, N * C, 1.0f);
    ASSERT_OK(backend_matmul(bf, &wb, x, N, y0));
    for (int n = 1; n <= 2; n++) {
        ASSERT_OK(backend_matmul(bf, &w8, x, n, y8));
        ASSERT_OK(backend_matmul(bf, &wb, x, N, y1));
        if (memcmp(y0, y1, sizeof(float) * N * R) != 0)
            FAIL("bf16 on AMX after an fp8 matmul of %d tokens: outputs changed", n);
    }
    backend_free(bf);
    kref_weight_free(&wb);
    lowp_free(&w8);
    free(x);
    free(y0);
    free(y1);
    free(y8);
}

int main(int argc, char **argv)
{
    setenv("STEPD_CPU_MIN_WORK", "0", 0);   /* split every op over all threads */
    /* "fp16": the run of the FP16 path (level vnni and AVX512-FP16, else skipped); the other
     * runs keep it off, so the vdpbf16ps form stays tested on every AVX512-BF16 host */
    const bool fp16 = argc > 1 && strcmp(argv[1], "fp16") == 0;
    const enum cpu_isa level = kt_isa_require("lowp", fp16 ? CPU_ISA_VNNI : CPU_ISA_SCALAR);
    if (fp16 && !cpu_avx512fp16()) {
        printf("SKIP lowp fp16: this CPU has no AVX512-FP16 (or STEPD_CPU_NO_FP16 is set)\n");
        return TEST_SKIP;
    }
    cpu_fp8_fp16_off = !fp16;
    const struct bweight probe = { .fmt = WFMT_FP8, .rows = 1, .cols = 32, .blk_rows = 1, .blk_cols = 32 };
    const struct bweight probe64 = { .fmt = WFMT_FP8, .rows = 1, .cols = 64, .blk_rows = 1, .blk_cols = 64 };
    if (level >= CPU_ISA_AMX && !fp16) {
        cpu_fp8_amx_on = 1;     /* every FP8 check below on the AMX tiles (the fp16 run: FP16) */
        if (!cpu_fp8_amx_fits(&probe64))
            FAIL("level amx: FP8 with 64-column blocks not on the AMX tiles");
    }
    if (fp16 && !fp16_path(&probe))
        FAIL("fp16 run: FP8 not on the FP16 path");
    printf("test-lowp: FP8 fast path %s\n", cpu_fp8_amx_fits(&probe64) ? "BF16 (AMX tiles)"
                                              : fp16_path(&probe) ? "FP16 (vfmadd231ph)"
                                              : bf16_path(&probe) ? "BF16 (vdpbf16ps)" : "fp32 activations");
    static const int64_t shapes[][4] = { { 1, 32, 1, 32 }, { 7, 96, 7, 16 }, { 64, 256, 32, 128 },
                                         { 128, 4096, 128, 128 }, { 33, 160, 11, 32 }, { 5, 48, 5, 16 },
                                         { 7, 128, 7, 64 }, { 200, 320, 8, 64 } };
    /* AVX2: FP8 one row a group up to 2 tokens, 4 from 3, token passes of 3 (9, 16, 21:
     * blocks of 16 and tails); NVFP4 the fused fast path at every count where its int8 path
     * does not fit;
     * AVX-512: 4-row x 5-token tiles, so 9 and 16 tokens cover full and edge token blocks
     * and 7, 33 and 5 rows the edge row tiles; 48 columns: an odd count of 16-column
     * groups, the fused loops' tails (NVFP4 at AVX2: the shapes whose columns are not a
     * multiple of 64); levels vnni and avx2 (NVFP4, 64-column pairs): 16-row groups (7, 33
     * and 200 rows their edges), passes of 8 tokens, 4 at avx2 (9, 16, 21: whole and tails),
     * 16-token blocks (16 tokens: one; 21: two), 128-row chunks when there are several token
     * blocks (200 rows: two) */
    static const int ns[] = { 1, 2, 3, 9, 16, 21 };

    krng_seed(4321);
    for (size_t s = 0; s < ARRAY_SIZE(shapes); s++)
        for (size_t k = 0; k < ARRAY_SIZE(ns); k++) {
            check_matmul(WFMT_FP8, shapes[s][0], shapes[s][1], (int)shapes[s][2], (int)shapes[s][3], ns[k],
                         1 + (int)((s + k) % 3));
            check_matmul(WFMT_NVFP4, shapes[s][0], shapes[s][1], 0, 0, ns[k], 1 + (int)((s + k) % 3));
        }
    for (size_t k = 0; k < ARRAY_SIZE(ns); k++)
        for (int bc = 32; bc <= 64; bc *= 2)
            check_fp8_codes(ns[k], bc);
    for (int exact = 0; exact < 2; exact++) {
        check_moe(WFMT_FP8, 2, exact);
        check_moe(WFMT_NVFP4, 1, exact);
    }
    if (level == CPU_ISA_AVX2) {
        /* every code but NaN in rows 1-4 (check_fp8_codes' weight), then the shapes */
        for (int bc = 16; bc <= 64; bc *= 2) {
            struct bweight w = lowp_new(WFMT_FP8, 6, 64, 2, bc);
            for (int i = 0; i < 256; i++)
                ((uint8_t *)w.data)[64 + i] = (uint8_t)((i & 0x7f) == 0x7f ? 0 : i);
            check_fp8_avx2_bits(w);
        }
        for (size_t s = 0; s < ARRAY_SIZE(shapes); s++)
            check_fp8_avx2_bits(lowp_new(WFMT_FP8, shapes[s][0], shapes[s][1], (int)shapes[s][2], (int)shapes[s][3]));
        check_nvfp4_rows();
        check_nvfp4_levels();
    }
    for (size_t s = 0; level >= CPU_ISA_AVX2 && s < ARRAY_SIZE(shapes); s++) {
        check_batch_invariant(WFMT_FP8, shapes[s][0], shapes[s][1], (int)shapes[s][2], (int)shapes[s][3], 16, 2);
        /* NVFP4 at every level from avx2: at avx2 the int8 path (columns a multiple of 64)
         * and the fused form (32, 48, 96, 160 columns here), 11 tokens on 1 and 2 threads */
        check_batch_invariant(WFMT_NVFP4, shapes[s][0], shapes[s][1], 0, 0, 11, 1 + (int)(s % 2));
    }
    if (level >= CPU_ISA_VNNI && cpu_isa_has(CPU_ISA_VNNI)) {
        check_nvfp4_rows();
        if (fp16)
            check_fp8_fp16();
        if (bf16_path(&probe) || fp16_path(&probe)) {
            check_fp8_rows();
            /* two token blocks of 16 and 5: each token equals its solo call (AMX: tiles of
             * 16, 5 and 1 columns) */
            check_batch_invariant(WFMT_FP8, 200, 320, 8, 64, 21, 1);
        }
    }
    if (level >= CPU_ISA_AMX) {
        check_tilecfg();
        check_tile_loads();
        if (!fp16)      /* the fp16 run keeps FP8 off the AMX tiles */
            check_amx_config_kept();
    }
    check_nan_refused();
    printf("test-lowp: all passed\n");
    return 0;
}
