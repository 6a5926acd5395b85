/* test-ops.c - the small ops against naive references: embed, rmsnorm (also per head),
 * rope (+ inv_freq tables with llama3 scaling), kv_store, head_gate, swiglu, router, add.
 * Odd shapes, fixed seeds; tolerances stated at each check. */
#include "kref.h"
#include "kisa.h"
#include "cpu.h"

static void test_embed(struct backend *be)
{
    struct bweight tb = kref_bf16_new(11, 37, 1.0f), tf = kref_f32_new(11, 37, 1.0f);
    struct bweight tm = kref_mxfp4_new(11, 64, 120, 130);
    int32_t ids[5] = { 3, 0, 10, 3, 7 }, bad[2] = { 1, 11 };
    float out[5 * 64];

    ASSERT_OK(backend_embed(be, &tb, ids, 5, out));
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 37; j++)
            ASSERT_EQ(out[i * 37 + j] == kref_w(&tb, ids[i], j), 1);
    ASSERT_OK(backend_embed(be, &tf, ids, 5, out));
    for (int i = 0; i < 5; i++)
        ASSERT_TRUE(memcmp(out + i * 37, (const float *)tf.data + ids[i] * 37, 37 * 4) == 0);
    ASSERT_OK(backend_weight_prepare(be, &tm));
    ASSERT_OK(backend_embed(be, &tm, ids, 5, out));
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 64; j++)
            ASSERT_EQ(out[i * 64 + j] == kref_w(&tm, ids[i], j), 1);
    backend_weight_release(be, &tm);
    ASSERT_ERR(backend_embed(be, &tb, bad, 2, out), -EINVAL);
    bad[1] = -1;
    ASSERT_ERR(backend_embed(be, &tb, bad, 2, out), -EINVAL);
    kref_weight_free(&tb);
    kref_weight_free(&tf);
    kref_weight_free(&tm);
}

static void test_rmsnorm(struct backend *be)
{
    const int rows = 7, dim = 129;
    struct bweight w = kref_bf16_new(1, dim, 0.5f), wh = kref_f32_new(dim, 1, 0.3f);
    float x[7 * 129], y[7 * 129];

    krng_fill(x, rows * dim, 4.0f);
    for (int pass = 0; pass < 2; pass++) {
        const struct bweight *ww = pass ? &wh : &w;

        ASSERT_OK(backend_rmsnorm(be, x, ww, rows, dim, 1e-5f, y));
        for (int r = 0; r < rows; r++) {
            double ss = 0;

            for (int j = 0; j < dim; j++)
                ss += (double)x[r * dim + j] * x[r * dim + j];
            for (int j = 0; j < dim; j++) {
                double ref = x[r * dim + j] / sqrt(ss / dim + 1e-5) *
                             (1.0 + kref_w(ww, pass ? j : 0, pass ? 0 : j));
                ASSERT_NEAR(y[r * dim + j], ref, 2e-6 * fabs(ref) + 1e-7);
            }
        }
    }
    /* bit-exact against the documented arithmetic (4 fp64 lanes k mod 4, folded
     * (l0 + l2) + (l1 + l3); 1/sqrt in fp64; x * inv * (1 + w) in fp32), whichever path
     * (scalar or AVX2) the backend takes, for row counts around the batch of 8 and dims
     * with tails */
    {
        static float xb[37 * 256], yb[37 * 256];
        static const int dims[] = { 32, 131, 256, 3 };

        krng_fill(xb, 37 * 256, 3.0f);
        for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
            const int d = dims[di];
            struct bweight wd = kref_f32_new(1, d, 0.4f);

            for (int nr = 1; nr <= 37; nr += 6) {
                ASSERT_OK(backend_rmsnorm(be, xb, &wd, nr, d, 1e-5f, yb));
                for (int r = 0; r < nr; r++) {
                    const float *xr = xb + r * d;
                    double l4[4] = { 0 }, ss;
                    float inv;
                    int k = 0;

                    for (; k + 4 <= d; k += 4)
                        for (int l = 0; l < 4; l++)
                            l4[l] = l4[l] + (double)xr[k + l] * (double)xr[k + l];
                    for (; k < d; k++)
                        l4[0] = l4[0] + (double)xr[k] * (double)xr[k];
                    ss = (l4[0] + l4[2]) + (l4[1] + l4[3]);
                    inv = (float)(1.0 / sqrt(ss / d + (double)1e-5f));
                    for (k = 0; k < d; k++) {
                        const float g = 1.0f + (float)kref_w(&wd, 0, k);
                        float want = xr[k] * inv * g;

                        if (memcmp(&want, &yb[r * d + k], sizeof(float)) != 0)
                            FAIL("rmsnorm d %d rows %d: row %d col %d: %.9g vs %.9g", d, nr, r, k,
                                 want, yb[r * d + k]);
                    }
                }
            }
        }
    }
    /* in place, per head: rows = tokens*heads, dim = head_dim */
    {
        float z[6 * 8], zr[6 * 8];
        struct bweight hw = kref_f32_new(1, 8, 0.2f);

        krng_fill(z, 48, 1.0f);
        memcpy(zr, z, sizeof(z));
        ASSERT_OK(backend_rmsnorm(be, z, &hw, 6, 8, 1e-5f, z));
        for (int r = 0; r < 6; r++) {
            double ss = 0;
            for (int j = 0; j < 8; j++)
                ss += (double)zr[r * 8 + j] * zr[r * 8 + j];
            for (int j = 0; j < 8; j++)
                ASSERT_NEAR(z[r * 8 + j], zr[r * 8 + j] / sqrt(ss / 8 + 1e-5) *
                            (1.0 + ((const float *)hw.data)[j]), 1e-6);
        }
        kref_weight_free(&hw);
    }
    kref_weight_free(&w);
    kref_weight_free(&wh);
}

static void test_rope(struct backend *be)
{
    float inv[32], inv_s[32];
    struct rope_llama3 l3 = { .factor = 2.0, .low_freq_factor = 1.0, .high_freq_factor = 32.0,
                              .original_max_pos = 131072.0 };
    const int n_tok = 3, n_heads = 5, hd = 80, R = 64;
    int32_t pos[3] = { 0, 17, 131071 };
    float x[3 * 5 * 80], x0[3 * 5 * 80];

    ASSERT_OK(backend_rope_freqs_fill(inv, R, 5e6, NULL));
    for (int i = 0; i < R / 2; i++)
        ASSERT_NEAR(inv[i], pow(5e6, -2.0 * i / R), 1e-7 * pow(5e6, -2.0 * i / R));
    ASSERT_OK(backend_rope_freqs_fill(inv_s, R, 5e6, &l3));
    for (int i = 0; i < R / 2; i++) {
        double f = pow(5e6, -2.0 * i / R), lam = 2 * M_PI / f, ref;

        if (lam < 131072.0 / 32.0)
            ref = f;
        else if (lam > 131072.0)
            ref = f / 2.0;
        else {
            double mu = (131072.0 / lam - 1.0) / 31.0;
            ref = (1 - mu) * f / 2.0 + mu * f;
        }
        ASSERT_NEAR(inv_s[i], ref, 1e-7 * ref);
    }
    ASSERT_EQ(inv_s[0] == inv[0], 1);               /* highest frequency untouched */
    ASSERT_NEAR(inv_s[31], inv[31] / 2.0, 1e-12);  /* lowest frequency divided by s */
    ASSERT_ERR(backend_rope_freqs_fill(inv, 63, 1e4, NULL), -EINVAL);
    ASSERT_ERR(backend_rope_freqs_fill(inv, 64, 0.5, NULL), -EINVAL);

    krng_fill(x, sizeof(x) / 4, 1.0f);
    memcpy(x0, x, sizeof(x));
    struct rope_freqs rf = { .rotary_dims = R, .inv_freq = inv_s };
    ASSERT_OK(backend_rope(be, x, n_tok, n_heads, hd, pos, &rf));
    for (int t = 0; t < n_tok; t++) {
        for (int h = 0; h < n_heads; h++) {
            const float *a = x0 + (t * n_heads + h) * hd, *b = x + (t * n_heads + h) * hd;

            for (int i = 0; i < R / 2; i++) {
                double phi = (double)(float)((float)pos[t] * inv_s[i]);
                double r0 = a[i] * cos(phi) - a[i + R / 2] * sin(phi);
                double r1 = a[i + R / 2] * cos(phi) + a[i] * sin(phi);
                ASSERT_NEAR(b[i], r0, 1e-6);
                ASSERT_NEAR(b[i + R / 2], r1, 1e-6);
            }
            for (int i = R; i < hd; i++)
                ASSERT_EQ(a[i] == b[i], 1);                 /* dims past R untouched */
        }
    }
    /* position 0 is the identity */
    for (int i = 0; i < n_heads * hd; i++)
        ASSERT_EQ(x[i] == x0[i], 1);
    pos[1] = -1;
    ASSERT_ERR(backend_rope(be, x, n_tok, n_heads, hd, pos, &rf), -EINVAL);
}

static void test_kv_store(struct backend *be)
{
    float kbuf[4 * 3 * 2 * 5] = { 0 }, vbuf[4 * 3 * 2 * 5] = { 0 };
    uint16_t kb[4 * 3 * 2 * 5] = { 0 }, vb[4 * 3 * 2 * 5] = { 0 };
    struct kv_layer kv = { .k = kbuf, .v = vbuf, .dtype_f32 = 1, .n_blocks = 4, .block_size = 3,
                           .n_kv_heads = 2, .head_dim = 5 };
    struct kv_layer kv16 = kv;
    float k[3 * 10], v[3 * 10];
    int32_t slots[3] = { 7, -1, 11 }, bad[1] = { 12 };

    kv16.k = kb;
    kv16.v = vb;
    kv16.dtype_f32 = 0;
    krng_fill(k, 30, 2.0f);
    krng_fill(v, 30, 2.0f);
    ASSERT_OK(backend_kv_store(be, &kv, k, v, 3, slots));
    ASSERT_OK(backend_kv_store(be, &kv16, k, v, 3, slots));
    ASSERT_TRUE(memcmp(kbuf + 70, k, 40) == 0 && memcmp(vbuf + 70, v, 40) == 0);
    ASSERT_TRUE(memcmp(kbuf + 110, k + 20, 40) == 0 && memcmp(vbuf + 110, v + 20, 40) == 0);
    for (int i = 0; i < 10; i++) {
        ASSERT_EQ(kb[70 + i], kf32_to_bf16(k[i]));
        ASSERT_EQ(vb[110 + i], kf32_to_bf16(v[20 + i]));
    }
    /* the skipped token (slot -1) wrote nothing */
    for (int s = 0; s < 12; s++)
        if (s != 7 && s != 11)
            for (int i = 0; i < 10; i++)
                ASSERT_EQ(kbuf[s * 10 + i] == 0.0f && kb[s * 10 + i] == 0, 1);
    ASSERT_ERR(backend_kv_store(be, &kv, k, v, 1, bad), -EINVAL);
}

static void test_gate_swiglu_add(struct backend *be)
{
    float o[3 * 4 * 6], o0[3 * 4 * 6], g[12];
    float u[5 * 33], w[5 * 33], out[5 * 33], y[17], x[17], y0[17];

    krng_fill(o, 72, 2.0f);
    memcpy(o0, o, sizeof(o));
    krng_fill(g, 12, 6.0f);
    ASSERT_OK(backend_head_gate(be, o, g, 3, 4, 6));
    for (int th = 0; th < 12; th++)
        for (int d = 0; d < 6; d++)
            ASSERT_NEAR(o[th * 6 + d], o0[th * 6 + d] / (1.0 + exp(-(double)g[th])), 1e-6);

    krng_fill(u, 165, 12.0f);
    krng_fill(w, 165, 12.0f);
    for (int pass = 0; pass < 3; pass++) {
        float lim = pass == 0 ? 0.0f : (pass == 1 ? 7.0f : 0.5f);

        ASSERT_OK(backend_swiglu(be, u, w, 5, 33, lim, out));
        for (int i = 0; i < 165; i++)
            ASSERT_NEAR(out[i], kref_swiglu(u[i], w[i], lim), 2e-6 * fabs(kref_swiglu(u[i], w[i], lim)) + 1e-7);
    }
    /* silu first, then clamp: gate 10 -> silu ~ 9.9995 -> 7; up -9 -> -7 */
    {
        float gg = 10.0f, uu = -9.0f, r;
        ASSERT_OK(backend_swiglu(be, &gg, &uu, 1, 1, 7.0f, &r));
        ASSERT_EQ(r == -49.0f, 1);
        gg = -3.0f; uu = 100.0f;        /* negative silu is not clamped from below */
        ASSERT_OK(backend_swiglu(be, &gg, &uu, 1, 1, 7.0f, &r));
        ASSERT_NEAR(r, kref_silu(-3.0f) * 7.0f, 1e-6);
    }
    /* the vector rows equal the scalar element function bit for bit, at every length
     * (tails), with and without the limit, on wide ranges and special values */
    {
        static float gu[203], uu[203], r1[203], r2[203];
        static const float sp[] = { 0.0f, -0.0f, 87.2f, 87.4f, -87.4f, 88.5f, -88.5f, 100.0f,
                                    -100.0f, 1e30f, -1e30f, 1e-40f, INFINITY, -INFINITY, NAN };

        krng_fill(gu, 203, 40.0f);
        krng_fill(uu, 203, 40.0f);
        for (size_t k = 0; k < sizeof(sp) / sizeof(sp[0]); k++) {
            gu[7 * k] = sp[k];
            uu[7 * k + 3] = sp[k];
            uu[7 * k + 100] = sp[k];
            gu[7 * k + 100] = sp[(k + 3) % (sizeof(sp) / sizeof(sp[0]))];
        }
        for (int pass = 0; pass < 3; pass++) {
            float lim = pass == 0 ? 0.0f : (pass == 1 ? 7.0f : 0.5f);

            for (int n = 0; n <= 203; n += (n < 40 ? 1 : 17)) {
                memset(r1, 0, sizeof(r1));
                memset(r2, 0, sizeof(r2));
                cpu_swiglu_rows(gu, uu, r1, n, lim);
                cpu_swiglu_rows_scalar(gu, uu, r2, n, lim);
                ASSERT_TRUE(memcmp(r1, r2, sizeof(r1)) == 0);
            }
            cpu_swiglu_rows_scalar(gu, uu, r2, 203, lim);
            for (int i = 0; i < 203; i++)
                if (isfinite(gu[i]) && isfinite(uu[i]) && fabsf(gu[i]) < 80.0f)
                    ASSERT_NEAR(r2[i], kref_swiglu(gu[i], uu[i], lim),
                                2e-6 * fabs(kref_swiglu(gu[i], uu[i], lim)) + 1e-7);
        }
    }
    krng_fill(y, 17, 1.0f);
    krng_fill(x, 17, 1.0f);
    memcpy(y0, y, sizeof(y));
    ASSERT_OK(backend_add(be, y, x, 17));
    for (int i = 0; i < 17; i++)
        ASSERT_EQ(y[i] == y0[i] + x[i], 1);
}

static void test_router(struct backend *be)
{
    enum { T = 4, E = 37, K = 5 };
    float z[T * E], bias[E], wts[T * K];
    int32_t ids[T * K];

    krng_fill(z, T * E, 4.0f);
    krng_fill(bias, E, 0.5f);
    /* token 3: exact ties in score -> lower id wins */
    for (int e = 0; e < E; e++)
        z[3 * E + e] = 0.0f;
    ASSERT_OK(backend_router(be, z, bias, T, E, K, true, 3.0f, ids, wts));
    for (int t = 0; t < T; t++) {
        double sum = 0, chosen[K];
        bool used[E] = { false };

        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                double c = 1.0 / (1.0 + exp(-(double)z[t * E + e])) + bias[e];
                double cb = best < 0 ? 0 : 1.0 / (1.0 + exp(-(double)z[t * E + best])) + bias[best];
                if (!used[e] && (best < 0 || c > cb))
                    best = e;
            }
            used[best] = true;
            ASSERT_EQ(ids[t * K + k], best);
            chosen[k] = 1.0 / (1.0 + exp(-(double)z[t * E + best]));   /* bias not in weights */
            sum += chosen[k];
        }
        for (int k = 0; k < K; k++)
            ASSERT_NEAR(wts[t * K + k], 3.0 * chosen[k] / sum, 1e-6);
    }
    /* without renorm: weights are scale * sigmoid */
    ASSERT_OK(backend_router(be, z, NULL, 1, E, K, false, 1.0f, ids, wts));
    for (int k = 0; k < K; k++)
        ASSERT_NEAR(wts[k], 1.0 / (1.0 + exp(-(double)z[ids[k]])), 1e-6);
    /* exact ties: lower expert id first */
    ASSERT_OK(backend_router(be, z + 3 * E, NULL, 1, E, K, true, 1.0f, ids, wts));
    for (int k = 0; k < K; k++) {
        ASSERT_EQ(ids[k], k);
        ASSERT_NEAR(wts[k], 1.0 / K, 1e-7);
    }
    z[5] = NAN;
    ASSERT_ERR(backend_router(be, z, NULL, 1, E, K, false, 1.0f, ids, wts), -EINVAL);
}

int main(void)
{
    setenv("STEPD_CPU_MIN_WORK", "0", 0);   /* split every op over all threads */
    kt_isa_require("ops", CPU_ISA_SCALAR);
    struct backend *be = kref_backend(2, false);

    krng_seed(42);
    test_embed(be);
    test_rmsnorm(be);
    test_rope(be);
    test_kv_store(be);
    test_gate_swiglu_add(be);
    test_router(be);
    backend_free(be);
    printf("ops: all checks passed\n");
    return 0;
}
