/* test-cuda-host.c - the host/device headers of the CUDA backend (kernels/cuda/mx4.h,
 * moe-plan.h, flash.h, graph-pad.h) compiled for the host and checked against the CPU
 * backend.  Needs no GPU: it runs in the normal suite on every machine.
 *
 * Properties:
 *  - mx4: the repacked layout holds every source element exactly once (padding decodes
 *    to 0); the in-register decode of every word (all 16 codes at all 8 nibble positions,
 *    then random words) times its scale equals the checkpoint's value; a GEMM read through
 *    the A-fragment mapping of the layout equals the CPU backend's MXFP4 matmul.
 *  - moe-plan: the device's phases, run for every thread id, give the CPU backend's
 *    grouping (pairs by expert in token order, offsets, inverse map, work items); a MoE
 *    layer computed through the plan equals the CPU backend's moe.
 *  - flash: split contexts merged equal a one-pass softmax; attention over a paged cache
 *    computed with the kernel's key ranges, masks, splits and merge equals the CPU
 *    backend's attention (full causal and sliding window, GQA).
 *  - graph-pad: buckets are the smallest listed size >= n, within the stated padding.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "flash.h"
#include "graph-pad.h"
#include "harness.h"
#include "moe-plan.h"
#include "tensor.h"
#include "mx4.h"
#include "mxfp4.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;

static uint32_t rnd32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static float frand(void)
{
    return (float)(rnd32() & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
}

static float bf16_val(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;

    memcpy(&f, &u, 4);
    return f;
}

static struct backend *cpu;

/* A random MXFP4 matrix [rows, cols] with scales in [lo, lo + span). */
static void mx_random(int64_t rows, int64_t cols, unsigned lo, unsigned span, uint8_t **packed,
                      uint8_t **scale)
{
    *packed = malloc((size_t)(rows * cols / 2));
    *scale = malloc((size_t)(rows * cols / 32));
    ASSERT_TRUE(*packed && *scale);
    for (int64_t i = 0; i < rows * cols / 2; i++)
        (*packed)[i] = (uint8_t)rnd32();
    for (int64_t i = 0; i < rows * cols / 32; i++)
        (*scale)[i] = (uint8_t)(lo + rnd32() % span);
}

/* ---------------------------------------------------------------- mx4 -- */

static void test_mx4_decode_words(void)
{
    /* every code at every nibble position, the other nibbles random */
    for (int pos = 0; pos < 8; pos++) {
        for (unsigned c = 0; c < 16; c++) {
            for (int rep = 0; rep < 8; rep++) {
                uint32_t w = rnd32(), r[4];

                w = (w & ~mx4_place(0xF, pos)) | mx4_place(c, pos);
                ASSERT_EQ(mx4_code(w, pos), c);
                mx4_word_bf16(w, r);
                for (int i = 0; i < 8; i++) {
                    unsigned code = mx4_code(w, i);
                    uint16_t h = (uint16_t)(r[i / 2] >> (16 * (i & 1)));
                    /* placed: the value times 2^-126 (code 1 a BF16 subnormal) */
                    float want = ldexpf(mxfp4_e2m1_value(code), MX4_PLACED_ON ? -126 : 0);

                    if (bf16_val(h) != want || signbit(bf16_val(h)) != signbit(want))
                        FAIL("word %08x element %d: code %u decoded %g (bits %04x), want %g", w,
                             i, code, bf16_val(h), h, want);
                }
            }
        }
    }
    /* scales: the BF16 pair of byte s is 2^(s-127) in both halves (s >= 1) */
    for (unsigned s = 1; s < 255; s++) {
        uint32_t v = mx4_scale_bf16x2(s << 16, 2);

        ASSERT_TRUE(bf16_val((uint16_t)v) == ldexpf(1.0f, (int)s - 127));
        ASSERT_TRUE(bf16_val((uint16_t)(v >> 16)) == ldexpf(1.0f, (int)s - 127));
    }
    ASSERT_EQ(mx4_scale_bf16x2(0, 0), 0);
    /* the stored scale byte: placed, s + 126 (the decode's 2^-126 undone), 0 kept, s up to
     * 128 only (2^(s-1) a finite BF16) */
    for (unsigned s = 0; s <= 128; s++) {
        ASSERT_TRUE(mx4_scale_placeable(s));
        ASSERT_EQ(mx4_scale_e8m0(mx4_scale_store(s)), s);
        ASSERT_EQ(mx4_scale_store(s), MX4_PLACED_ON && s ? s + 126 : s);
    }
    ASSERT_EQ(mx4_scale_placeable(129), !MX4_PLACED_ON);
    for (int rep = 0; rep < 1000; rep++) {
        uint32_t sw = rnd32(), sp[4];

        mx4_scales_bf16x2(sw, sp);
        for (int b = 0; b < 4; b++)
            ASSERT_EQ(sp[b], mx4_scale_bf16x2(sw, b));
    }
    /* the FP32 scales of mx4_gemm at NT 1: 2^(s-127) of byte `which`, byte 0 gives 0 */
    for (int rep = 0; rep < 1000; rep++) {
        uint32_t sw = rnd32();

        for (int b = 0; b < 4; b++) {
            unsigned s = (sw >> (8 * b)) & 0xFF;

            if (s == 0 || s == 255)
                continue;
            ASSERT_TRUE(mx4_scale_f32(sw, b) == ldexpf(1.0f, (int)s - 127));
        }
    }
    ASSERT_TRUE(mx4_scale_f32(0x00FF0100u, 0) == 0.0f);
    ASSERT_TRUE(mx4_scale_f32(0x00FF0100u, 1) == ldexpf(1.0f, -126));
    ASSERT_TRUE(isinf(mx4_scale_f32(0x00FF0100u, 2)));
    /* mx4_gemm's 32-bit token-row offsets: x_rows·(ldx/8) + 64 must stay under 2^32 - 1 */
    ASSERT_TRUE(mx4_x_fits(2048, 4096));
    ASSERT_TRUE(mx4_x_fits(((int64_t)1 << 23) - 1, 4096));
    ASSERT_TRUE(!mx4_x_fits((int64_t)1 << 23, 4096));
    ASSERT_TRUE(!mx4_x_fits(1, (int64_t)1 << 35));
    printf("mx4: decode of all codes at all positions exact, scales exact\n");
}

/* Decode element (row, k) from the repacked bytes the way a lane does: its word through
 * mx4_word_bf16, its scale through mx4_scale_bf16x2, the product of two BF16 values. */
static float mx4_lane_value(const uint8_t *nib, const uint8_t *sc, int64_t cols, int64_t t,
                            int l, int j, int i)
{
    uint32_t w, s, r[4];

    memcpy(&w, nib + t * MX4_TILE_NIB_BYTES + l * 16 + j * 4, 4);
    memcpy(&s, sc + t * MX4_TILE_SCALE_BYTES + (l / 4) * 4, 4);
    mx4_word_bf16(w, r);
    {
        uint32_t sv = mx4_scale_bf16x2(s, mx4_scale_which(j, i / 2));
        float a = bf16_val((uint16_t)(r[i / 2] >> (16 * (i & 1))));
        float b = bf16_val((uint16_t)(sv >> (16 * (i & 1))));

        (void)cols;
        return a * b;       /* exact: a power of two times a 2-bit mantissa */
    }
}

static void test_mx4_layout(int64_t rows, int64_t cols)
{
    uint8_t *packed, *scale;
    int64_t rp = mx4_rows_padded(rows), kp = mx4_cols_padded(cols);
    int64_t n_tiles = rp / 16 * (kp / 64);
    uint8_t *nib = malloc((size_t)mx4_nib_bytes(rows, cols));
    uint8_t *sc = malloc((size_t)mx4_scale_bytes(rows, cols));
    float *ref = malloc((size_t)cols * sizeof(float));
    uint8_t *seen = calloc((size_t)(rp * kp), 1);

    ASSERT_TRUE(nib && sc && ref && seen);
    ASSERT_EQ(mx4_nib_bytes(rows, cols), n_tiles * MX4_TILE_NIB_BYTES);
    ASSERT_EQ(mx4_scale_bytes(rows, cols), n_tiles * MX4_TILE_SCALE_BYTES);
    mx_random(rows, cols, 100, 29, &packed, &scale);   /* 2^-27 .. 2^1: the placed limit */
    mx4_repack(packed, scale, rows, cols, nib, sc);
    /* the fragment mapping covers every (row, k) of the padded matrix once, and each
     * element decodes (as a lane decodes it) to the checkpoint's value */
    for (int64_t t = 0; t < n_tiles; t++) {
        for (int l = 0; l < 32; l++) {
            for (int j = 0; j < 4; j++) {
                for (int i = 0; i < 8; i++) {
                    int64_t rt = t / (kp / 64), kt = t % (kp / 64);
                    int64_t row = mx4_elem_row(rt, l, i), k = mx4_elem_col(kt, j, l, i);
                    float got = mx4_lane_value(nib, sc, cols, t, l, j, i), want = 0.0f;
                    int el;

                    ASSERT_TRUE(row < rp && k < kp);
                    ASSERT_EQ(seen[row * kp + k]++, 0);
                    ASSERT_EQ(mx4_word_offset(cols, row, k, &el),
                              t * MX4_TILE_NIB_BYTES + l * 16 + j * 4);
                    ASSERT_EQ(el, i);
                    ASSERT_EQ(mx4_scale_offset(cols, row, k),
                              t * MX4_TILE_SCALE_BYTES + (l / 4) * 4 + mx4_scale_which(j, i / 2));
                    if (row < rows && k < cols) {
                        ASSERT_OK(mxfp4_row_decode(packed + row * (cols / 2),
                                                   scale + row * (cols / 32), cols, ref));
                        want = ref[k];
                    }
                    if (got != want)
                        FAIL("%lldx%lld: element (%lld, %lld) decoded %g, want %g",
                             (long long)rows, (long long)cols, (long long)row, (long long)k, got,
                             want);
                }
            }
        }
    }
    /* a GEMM read through the layout (as the kernel's fragments) = the CPU backend's */
    {
        const int n = 3;
        float *x = malloc((size_t)n * cols * sizeof(float));
        float *y = malloc((size_t)n * rows * sizeof(float));
        double *acc = calloc((size_t)n * rows, sizeof(double));
        struct bweight w = { .fmt = WFMT_MXFP4, .rows = rows, .cols = cols, .data = packed,
                             .scale = scale };

        ASSERT_TRUE(x && y && acc);
        for (int64_t i = 0; i < n * cols; i++)
            x[i] = frand();
        ASSERT_OK(backend_weight_prepare(cpu, &w));
        ASSERT_OK(backend_matmul(cpu, &w, x, n, y));
        for (int64_t t = 0; t < n_tiles; t++) {
            int64_t rt = t / (kp / 64), kt = t % (kp / 64);

            for (int l = 0; l < 32; l++)
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 8; i++) {
                        int64_t row = mx4_elem_row(rt, l, i), k = mx4_elem_col(kt, j, l, i);
                        float v = mx4_lane_value(nib, sc, cols, t, l, j, i);

                        if (row >= rows || k >= cols)
                            continue;
                        for (int tok = 0; tok < n; tok++)
                            acc[tok * rows + row] += (double)v * x[tok * cols + k];
                    }
        }
        for (int64_t i = 0; i < n * rows; i++)
            ASSERT_NEAR(acc[i], y[i], 1e-4 * (1.0 + fabs(acc[i])));
        backend_weight_release(cpu, &w);
        free(x);
        free(y);
        free(acc);
    }
    printf("mx4 %lldx%lld: layout covers every element once, decode exact, GEMM = CPU backend\n",
           (long long)rows, (long long)cols);
    free(packed);
    free(scale);
    free(nib);
    free(sc);
    free(ref);
    free(seen);
}

/* ----------------------------------------------------------- moe-plan -- */

struct plan_buf {
    int32_t *offsets, *pair_slot, *slot_pair, *items, counts[2], *shared;
};

static void plan_build(const int32_t *ids, int n_slots, int first, int n_local, int chunk,
                       struct plan_buf *pb, struct moe_plan_args *a)
{
    int max_items = moe_items_max(n_slots, n_local, chunk);

    pb->offsets = malloc(sizeof(int32_t) * (size_t)(n_local + 1));
    pb->pair_slot = malloc(sizeof(int32_t) * (size_t)(n_slots + 1));
    pb->slot_pair = malloc(sizeof(int32_t) * (size_t)(n_slots + 1));
    pb->items = malloc(sizeof(int32_t) * 2 * (size_t)(max_items + 1));
    pb->shared = malloc(sizeof(int32_t) * (size_t)(3 * n_local + MOE_PLAN_THREADS));
    ASSERT_TRUE(pb->offsets && pb->pair_slot && pb->slot_pair && pb->items && pb->shared);
    *a = (struct moe_plan_args){ ids, n_slots, first, n_local, chunk, pb->offsets, pb->pair_slot,
                                 pb->slot_pair, pb->items, pb->counts };
    moe_plan_host(a, pb->shared);
    ASSERT_LE(pb->counts[1], max_items);
}

static void plan_free(struct plan_buf *pb)
{
    free(pb->offsets);
    free(pb->pair_slot);
    free(pb->slot_pair);
    free(pb->items);
    free(pb->shared);
}

/* The plan against the CPU backend's grouping (kernels/cpu/moe.c: a counting sort of the
 * local pairs by expert, token order kept). */
static void test_plan_order(int n_tok, int top_k, int n_exp, int first, int n_local, int chunk)
{
    int n_slots = n_tok * top_k;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_slots);
    int32_t *cnt = calloc((size_t)n_local + 1, sizeof(int32_t));
    int32_t *ref = malloc(sizeof(int32_t) * (size_t)n_slots);
    struct plan_buf pb;
    struct moe_plan_args a;
    int n_pairs = 0, item = 0;

    ASSERT_TRUE(ids && cnt && ref);
    for (int t = 0; t < n_tok; t++) {
        /* distinct experts per token, or -1 (graph padding) for a few tokens */
        for (int k = 0; k < top_k; k++) {
            int32_t e;
            bool dup;

            do {
                e = t % 17 == 5 ? -1 : (int32_t)(rnd32() % (unsigned)n_exp);
                dup = false;
                for (int j = 0; j < k && e >= 0; j++)
                    dup |= ids[t * top_k + j] == e;
            } while (dup);
            ids[t * top_k + k] = e;
        }
    }
    for (int s = 0; s < n_slots; s++) {
        int e = ids[s] - first;
        if (ids[s] >= 0 && e >= 0 && e < n_local)
            cnt[e + 1]++;
    }
    for (int e = 0; e < n_local; e++)
        cnt[e + 1] += cnt[e];
    for (int s = 0; s < n_slots; s++) {
        int e = ids[s] - first;
        if (ids[s] >= 0 && e >= 0 && e < n_local)
            ref[cnt[e]++] = s, n_pairs++;
    }
    plan_build(ids, n_slots, first, n_local, chunk, &pb, &a);
    ASSERT_EQ(pb.counts[0], n_pairs);
    for (int p = 0; p < n_pairs; p++) {
        ASSERT_EQ(pb.pair_slot[p], ref[p]);
        ASSERT_EQ(pb.slot_pair[ref[p]], p);
    }
    for (int s = 0; s < n_slots; s++) {
        int e = moe_local(ids[s], first, n_local);

        if (e < 0)
            ASSERT_EQ(pb.slot_pair[s], -1);
        else
            ASSERT_TRUE(pb.slot_pair[s] >= pb.offsets[e] && pb.slot_pair[s] < pb.offsets[e + 1]);
    }
    for (int e = 0; e < n_local; e++) {
        for (int m0 = 0; m0 < pb.offsets[e + 1] - pb.offsets[e]; m0 += chunk, item++) {
            ASSERT_LT(item, pb.counts[1]);
            ASSERT_EQ(pb.items[2 * item], e);
            ASSERT_EQ(pb.items[2 * item + 1], m0);
        }
    }
    ASSERT_EQ(item, pb.counts[1]);
    printf("moe-plan %d tokens x top-%d of %d, local [%d, +%d), chunk %d: %d pairs, %d items = "
           "CPU order\n", n_tok, top_k, n_exp, first, n_local, chunk, n_pairs, pb.counts[1]);
    plan_free(&pb);
    free(ids);
    free(cnt);
    free(ref);
}

static double silu_clamped(double g, double u, double limit)
{
    double s = g / (1.0 + exp(-g));

    if (limit > 0) {
        s = s < limit ? s : limit;
        u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    return s * u;
}

/* A MoE layer through the plan (items -> pairs -> per-pair rows weighted, then the
 * combine in slot order) against the CPU backend's moe (exact path). */
static void test_plan_moe(void)
{
    const int n_tok = 9, top_k = 3, n_exp = 10, first = 2, n_local = 6, hidden = 64, inter = 96;
    const int chunk = 4;
    const float limit = 1.5f;
    int n_slots = n_tok * top_k;
    int32_t ids[9 * 3];
    float wts[9 * 3];
    uint8_t *gp[6], *gs[6], *up[6], *us[6], *dp[6], *ds[6];
    struct moe_expert ex[6];
    float *x = malloc(sizeof(float) * n_tok * hidden);
    float *out = calloc((size_t)n_tok * hidden, sizeof(float));
    double *y = calloc((size_t)n_slots * hidden, sizeof(double));
    double *ref = calloc((size_t)n_tok * hidden, sizeof(double));
    float *g = malloc(sizeof(float) * hidden), *u = malloc(sizeof(float) * hidden);
    float *dw = malloc(sizeof(float) * inter);
    struct plan_buf pb;
    struct moe_plan_args a;

    for (int i = 0; i < n_tok * hidden; i++)
        x[i] = frand();
    for (int t = 0; t < n_tok; t++)
        for (int k = 0; k < top_k; k++) {
            ids[t * top_k + k] = (t * 7 + k * 3) % n_exp;
            wts[t * top_k + k] = 0.2f + 0.1f * (float)k;
        }
    for (int e = 0; e < n_local; e++) {
        mx_random(inter, hidden, 122, 4, &gp[e], &gs[e]);
        mx_random(inter, hidden, 122, 4, &up[e], &us[e]);
        mx_random(hidden, inter, 122, 4, &dp[e], &ds[e]);
        ex[e].gate = (struct bweight){ WFMT_MXFP4, inter, hidden, gp[e], gs[e], NULL };
        ex[e].up = (struct bweight){ WFMT_MXFP4, inter, hidden, up[e], us[e], NULL };
        ex[e].down = (struct bweight){ WFMT_MXFP4, hidden, inter, dp[e], ds[e], NULL };
        ASSERT_OK(backend_weight_prepare(cpu, &ex[e].gate));
        ASSERT_OK(backend_weight_prepare(cpu, &ex[e].up));
        ASSERT_OK(backend_weight_prepare(cpu, &ex[e].down));
    }
    {
        struct moe_args ma = { x, out, n_tok, hidden, inter, top_k, ids, wts, ex, first, n_local,
                               limit };
        ASSERT_OK(backend_moe(cpu, &ma));
    }
    plan_build(ids, n_slots, first, n_local, chunk, &pb, &a);
    for (int it = 0; it < pb.counts[1]; it++) {
        int e = pb.items[2 * it], m0 = pb.items[2 * it + 1];
        int p1 = pb.offsets[e] + m0 + chunk;

        p1 = p1 < pb.offsets[e + 1] ? p1 : pb.offsets[e + 1];
        for (int p = pb.offsets[e] + m0; p < p1; p++) {
            int s = pb.pair_slot[p], t = s / top_k;
            double act[96];

            for (int r = 0; r < inter; r++) {
                double gv = 0, uv = 0;

                ASSERT_OK(mxfp4_row_decode(gp[e] + r * (hidden / 2), gs[e] + r * (hidden / 32),
                                           hidden, g));
                ASSERT_OK(mxfp4_row_decode(up[e] + r * (hidden / 2), us[e] + r * (hidden / 32),
                                           hidden, u));
                for (int k = 0; k < hidden; k++) {
                    gv += (double)g[k] * x[t * hidden + k];
                    uv += (double)u[k] * x[t * hidden + k];
                }
                act[r] = silu_clamped(gv, uv, limit);
            }
            for (int r = 0; r < hidden; r++) {
                double acc = 0;

                ASSERT_OK(mxfp4_row_decode(dp[e] + r * (inter / 2), ds[e] + r * (inter / 32),
                                           inter, dw));
                for (int k = 0; k < inter; k++)
                    acc += (double)dw[k] * act[k];
                y[(size_t)p * hidden + r] = acc * wts[s];
            }
        }
    }
    /* the combine: each token sums its local pairs in slot (k) order */
    for (int t = 0; t < n_tok; t++)
        for (int k = 0; k < top_k; k++) {
            int p = pb.slot_pair[t * top_k + k];

            for (int r = 0; p >= 0 && r < hidden; r++)
                ref[t * hidden + r] += y[(size_t)p * hidden + r];
        }
    for (int i = 0; i < n_tok * hidden; i++)
        ASSERT_NEAR(ref[i], out[i], 1e-4 * (1.0 + fabs(ref[i])));
    printf("moe-plan: a MoE layer through the plan = CPU backend moe (%d pairs, %d items)\n",
           pb.counts[0], pb.counts[1]);
    plan_free(&pb);
    for (int e = 0; e < n_local; e++) {
        backend_weight_release(cpu, &ex[e].gate);
        backend_weight_release(cpu, &ex[e].up);
        backend_weight_release(cpu, &ex[e].down);
        free(gp[e]); free(gs[e]); free(up[e]); free(us[e]); free(dp[e]); free(ds[e]);
    }
    free(x); free(out); free(y); free(ref); free(g); free(u); free(dw);
}

/* -------------------------------------------------------------- flash -- */

static void test_split(void)
{
    for (int64_t total = 0; total < 700; total += 13) {
        for (int parts = 1; parts <= 9; parts++) {
            int64_t next = 0;

            for (int p = 0; p < parts; p++) {
                int64_t lo, hi;

                hd_split(total, 64, parts, p, &lo, &hi);
                ASSERT_TRUE(lo <= hi);
                if (lo < hi) {
                    ASSERT_EQ(lo, next);
                    ASSERT_EQ(lo % 64, 0);
                    next = hi;
                }
            }
            ASSERT_EQ(next, total);
        }
    }
    ASSERT_EQ(flash_n_splits(8, 132), 33);
    ASSERT_EQ(flash_n_splits(512, 132), 1);
    ASSERT_EQ(flash_n_splits(1, 132), FLASH_MAX_SPLITS);
    printf("split: every part tile-aligned, the parts cover the range once\n");
}

/* One part's (m, l, o) over keys [lo, hi) in tiles, with the kernel's online update. */
static void flash_part(const float *s, const float *v, int d, int64_t lo, int64_t hi, float *m,
                       float *l, float *o)
{
    *m = -INFINITY;
    *l = 0.0f;
    for (int j = 0; j < d; j++)
        o[j] = 0.0f;
    for (int64_t t0 = lo; t0 < hi; t0 += FLASH_KEY_TILE) {
        int64_t t1 = t0 + FLASH_KEY_TILE < hi ? t0 + FLASH_KEY_TILE : hi;
        float mt = *m, alpha;

        for (int64_t t = t0; t < t1; t++)
            mt = s[t] > mt ? s[t] : mt;
        alpha = flash_rescale(*m, mt);
        *l *= alpha;
        for (int j = 0; j < d; j++)
            o[j] *= alpha;
        for (int64_t t = t0; t < t1; t++) {
            float p = flash_p(s[t], mt);

            *l += p;
            for (int j = 0; j < d; j++)
                o[j] += p * v[t * d + j];
        }
        *m = mt;
    }
}

static void test_flash_merge(int64_t n_keys, int n_splits, int masked_every)
{
    const int d = 8;
    float *s = malloc(sizeof(float) * (size_t)n_keys), *v = malloc(sizeof(float) * (size_t)n_keys * d);
    float m[FLASH_MAX_SPLITS], l[FLASH_MAX_SPLITS], coef[FLASH_MAX_SPLITS];
    float *o = malloc(sizeof(float) * FLASH_MAX_SPLITS * d);
    double mx = -INFINITY, sum = 0, ref[8] = { 0 };

    for (int64_t t = 0; t < n_keys; t++) {
        s[t] = (masked_every && t % masked_every == 0) ? -INFINITY : frand() * 30.0f;
        for (int j = 0; j < d; j++)
            v[t * d + j] = frand();
        mx = s[t] > mx ? s[t] : mx;
    }
    for (int64_t t = 0; t < n_keys; t++) {
        double p = s[t] == -INFINITY ? 0 : exp2((double)s[t] - mx);
        sum += p;
        for (int j = 0; j < d; j++)
            ref[j] += p * v[t * d + j];
    }
    for (int i = 0; i < n_splits; i++) {
        int64_t lo, hi;

        flash_split_range(0, n_keys, n_splits, i, &lo, &hi);
        flash_part(s, v, d, lo, hi, &m[i], &l[i], o + i * d);
    }
    flash_merge_coef(n_splits, m, l, 1, coef);
    for (int j = 0; j < d; j++) {
        double got = 0;

        for (int i = 0; i < n_splits; i++)
            got += (double)coef[i] * o[i * d + j];
        ASSERT_NEAR(got, sum > 0 ? ref[j] / sum : 0.0, 2e-6);
    }
    free(s);
    free(v);
    free(o);
}

/* Attention over a paged cache the way attention.cu computes it (per sequence: the key
 * range of its run, tiles of keys with the masks, splits, merge), against the CPU. */
static void test_flash_attention(int window, int n_splits)
{
    const int heads = 6, kvh = 2, hd = 16, bs = 4, n_blocks = 80, G = heads / kvh;
    const int n_tok = 14;
    int32_t start[3] = { 0, 11, 14 }, pos0[2] = { 0, 150 }, tables[2 * 40], off[2] = { 0, 40 };
    size_t pool = (size_t)n_blocks * bs * kvh * hd;
    float *kc = malloc(pool * 4), *vc = malloc(pool * 4);
    float *q = malloc(sizeof(float) * n_tok * heads * hd), *out = malloc(sizeof(float) * n_tok * heads * hd);
    struct kv_layer kv = { kc, vc, 1, n_blocks, bs, kvh, hd };
    const float scale = 1.0f / sqrtf((float)hd);

    for (int i = 0; i < 80; i++)
        tables[i] = (i * 37 + 11) % n_blocks;
    for (size_t i = 0; i < pool; i++) {
        kc[i] = frand();
        vc[i] = frand();
    }
    for (int i = 0; i < n_tok * heads * hd; i++)
        q[i] = frand();
    {
        struct attn_args a = { q, out, n_tok, heads, kvh, hd, scale, window, &kv, 2, start, pos0,
                               tables, off };
        ASSERT_OK(backend_attention(cpu, &a));
    }
    for (int sq = 0; sq < 2; sq++) {
        int n = start[sq + 1] - start[sq];
        int64_t klo, khi;

        flash_key_range(pos0[sq], pos0[sq] + n - 1, window, &klo, &khi);
        for (int i = 0; i < n; i++) {
            int64_t t = pos0[sq] + i;

            for (int h = 0; h < heads; h++) {
                const float *qh = q + ((size_t)(start[sq] + i) * heads + h) * hd;
                float m[FLASH_MAX_SPLITS], l[FLASH_MAX_SPLITS], coef[FLASH_MAX_SPLITS];
                float o[FLASH_MAX_SPLITS][16];

                for (int sp = 0; sp < n_splits; sp++) {
                    int64_t lo, hi;
                    float *sc, *vv;

                    flash_split_range(klo, khi, n_splits, sp, &lo, &hi);
                    sc = malloc(sizeof(float) * (size_t)(khi + 1));
                    vv = malloc(sizeof(float) * (size_t)(khi + 1) * hd);
                    for (int64_t tau = lo; tau < hi; tau++) {
                        int64_t slot = (int64_t)tables[off[sq] + tau / bs] * bs + tau % bs;
                        const float *kr = kc + (slot * kvh + h / G) * hd;
                        float dot = 0;

                        for (int j = 0; j < hd; j++)
                            dot += qh[j] * kr[j];
                        sc[tau] = flash_key_ok(tau, t, window) ? dot * scale * FLASH_LOG2E
                                                               : -INFINITY;
                        memcpy(vv + tau * hd, vc + (slot * kvh + h / G) * hd, sizeof(float) * hd);
                    }
                    flash_part(sc, vv, hd, lo, hi, &m[sp], &l[sp], o[sp]);
                    free(sc);
                    free(vv);
                }
                flash_merge_coef(n_splits, m, l, 1, coef);
                for (int j = 0; j < hd; j++) {
                    float got = 0;

                    for (int sp = 0; sp < n_splits; sp++)
                        got += coef[sp] * o[sp][j];
                    ASSERT_NEAR(got, out[((size_t)(start[sq] + i) * heads + h) * hd + j], 2e-5);
                }
            }
        }
    }
    printf("flash: paged attention window %d in %d splits = CPU backend attention\n", window,
           n_splits);
    free(kc);
    free(vc);
    free(q);
    free(out);
}

/* ---------------------------------------------------------- graph-pad -- */

static void test_graph_pad(void)
{
    int prev = 0;
    int32_t a[16];

    for (int i = 0; i < GRAPH_N_BUCKETS; i++) {
        ASSERT_LT(prev, graph_bucket_size(i));
        prev = graph_bucket_size(i);
        ASSERT_EQ(graph_bucket_index(prev), i);
    }
    ASSERT_EQ(graph_bucket_size(GRAPH_N_BUCKETS - 1), 512);
    ASSERT_EQ(graph_bucket_index(3), -1);
    for (int n = 1; n <= 600; n++) {
        int b = graph_bucket(n, 512);

        if (n > 512) {
            ASSERT_EQ(b, 0);
            continue;
        }
        ASSERT_TRUE(b >= n && graph_bucket_index(b) >= 0);
        ASSERT_TRUE(graph_bucket_index(b) == 0 || graph_bucket_size(graph_bucket_index(b) - 1) < n);
        ASSERT_TRUE(n > 16 ? b < 1.5 * n : b < 2 * n);
    }
    ASSERT_EQ(graph_bucket(0, 512), 0);
    ASSERT_EQ(graph_bucket(9, 12), 0);      /* 16 is above the step's capacity */
    ASSERT_EQ(graph_bucket(5, 12), 8);
    for (int i = 0; i < 16; i++)
        a[i] = i;
    graph_pad_i32(a, 5, 8, -1);
    for (int i = 0; i < 16; i++)
        ASSERT_EQ(a[i], i < 5 ? i : i < 8 ? -1 : i);
    printf("graph-pad: buckets minimal, padding within bounds\n");
}

/* NVFP4 in the tile layout (mx4.h nv4_*): every element of the padded matrix, decoded as
 * mx4_gemm's nv4_tile does (the word through mx4_gemm's PRMT decode, the group's E4M3
 * through nv4_scale_f32, times the global scale), equals the CPU decode of the checkpoint
 * bytes (common/tensor.c nvfp4_row_decode) to its last bit; padding decodes to 0; every E4M3 byte but
 * the NaNs converts exactly. */
static void test_nv4_layout(int64_t rows, int64_t cols)
{
    int64_t rp = mx4_rows_padded(rows), kp = mx4_cols_padded(cols);
    int64_t n_tiles = rp / 16 * (kp / 64);
    float *f = malloc((size_t)(rows * cols) * sizeof(float)), *ref = malloc((size_t)cols * sizeof(float));
    uint8_t *packed = malloc((size_t)(rows * cols / 2)), *scale = malloc((size_t)(rows * cols / 16));
    uint8_t *nib = malloc((size_t)mx4_nib_bytes(rows, cols)), *sc = malloc((size_t)nv4_scale_bytes(rows, cols));
    struct mx4_tab tb = { MX4_Z_LO, MX4_Z_HI, MX4_T_LO, MX4_T_HI };

    ASSERT_TRUE(f && ref && packed && scale && nib && sc);
    for (unsigned b = 0; b < 256; b++)
        if ((b & 0x7F) != 0x7F)
            ASSERT_TRUE(nv4_scale_f32(b, 0, 0) == fp8_e4m3_value((uint8_t)b));
    ASSERT_EQ(nv4_scale_bytes(rows, cols), n_tiles * NV4_TILE_SCALE_BYTES);
    for (int64_t i = 0; i < rows * cols; i++)       /* groups of very different amax */
        f[i] = frand() * ldexpf(1.0f, (int)((i / 16) % 13) - 6);
    float gs = nvfp4_global_scale(f, rows * cols);
    for (int64_t r = 0; r < rows; r++)
        ASSERT_OK(nvfp4_row_quantize(f + r * cols, cols, gs, packed + r * cols / 2,
                                     scale + r * cols / 16));
    nv4_repack(packed, scale, rows, cols, nib, sc);
    for (int64_t t = 0; t < n_tiles; t++) {
        int64_t rt = t / (kp / 64), kt = t % (kp / 64);

        for (int l = 0; l < 32; l++) {
            uint32_t s[2];

            memcpy(s, sc + t * NV4_TILE_SCALE_BYTES + (l / 4) * 8, 8);
            for (int j = 0; j < 4; j++) {
                uint32_t w, r[4];

                memcpy(&w, nib + t * MX4_TILE_NIB_BYTES + l * 16 + j * 4, 4);
                mx4_word_bf16_prmt(w, &tb, r);
                for (int i = 0; i < 8; i++) {
                    int64_t row = mx4_elem_row(rt, l, i), k = mx4_elem_col(kt, j, l, i);
                    float v = bf16_val((uint16_t)(r[i / 2] >> (16 * (i & 1))));
                    float got = v * nv4_scale_f32(s[0], s[1], 4 * ((i >> 1) & 1) + j) * gs;
                    float want = 0.0f;
                    int el;

                    ASSERT_EQ(mx4_word_offset(cols, row, k, &el), t * MX4_TILE_NIB_BYTES + l * 16 + j * 4);
                    ASSERT_EQ(nv4_code(w, el), nv4_code(w, i));
                    ASSERT_EQ(nv4_scale_offset(cols, row, k),
                              t * NV4_TILE_SCALE_BYTES + (l / 4) * 8 + 4 * ((i >> 1) & 1) + j);
                    if (row < rows && k < cols) {
                        ASSERT_OK(nvfp4_row_decode(packed + row * (cols / 2), scale + row * (cols / 16),
                                                   gs, cols, ref));
                        want = ref[k];
                    }
                    /* (E2M1 · E4M3, exact) · gs against E2M1 · (E4M3 · gs): one rounding */
                    if (!(fabsf(got - want) <= 0x1p-23f * fabsf(want)))
                        FAIL("nv4 %lldx%lld: element (%lld, %lld) decoded %g, want %g",
                             (long long)rows, (long long)cols, (long long)row, (long long)k, got, want);
                }
            }
        }
    }
    printf("nv4 %lldx%lld: every element through the tile layout = the CPU decode\n",
           (long long)rows, (long long)cols);
    free(f); free(ref); free(packed); free(scale); free(nib); free(sc);
}

int main(void)
{
    struct backend_cfg cfg = { .n_threads = 1, .mxfp4_exact = true };

    ASSERT_OK(backend_new("cpu", &cfg, &cpu));
    test_mx4_decode_words();
    test_mx4_layout(16, 64);
    test_mx4_layout(7, 32);
    test_mx4_layout(77, 320);
    test_mx4_layout(130, 96);
    test_mx4_layout(48, 1280);
    test_nv4_layout(16, 64);
    test_nv4_layout(7, 48);
    test_nv4_layout(40, 336);
    test_plan_order(1, 8, 288, 0, 288, 8);
    test_plan_order(16, 8, 288, 0, 288, 8);
    test_plan_order(64, 8, 288, 72, 72, 64);
    test_plan_order(128, 8, 288, 0, 288, 128);       /* exactly one chunk of slots */
    test_plan_order(2048, 8, 288, 0, 288, 128);      /* 16 chunks */
    test_plan_order(333, 3, 16, 5, 7, 16);
    test_plan_moe();
    test_split();
    test_flash_merge(1, 1, 0);
    test_flash_merge(1000, 7, 0);
    test_flash_merge(1000, 64, 3);
    test_flash_merge(200, 9, 1);                      /* every key masked */
    test_flash_merge(4096, 33, 0);
    test_flash_attention(0, 1);
    test_flash_attention(0, 3);
    test_flash_attention(5, 2);
    test_flash_attention(64, 5);
    test_graph_pad();
    backend_free(cpu);
    printf("host/device headers agree with the CPU backend\n");
    return 0;
}
