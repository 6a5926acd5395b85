/* test-vision-ops.c - the vision encoder's host kernels (kernels/vision-ops.h) against naive
 * double-precision references written from their definitions: LayerNorm, quick-GELU,
 * LayerScale, bias rows, the stride-2 3x3 convolution via im2col (direct convolution as
 * the reference), 2-D RoPE (rotation angles from the row/column definition), softmax,
 * patchify (pixel (y, x, c) of the image lands in patch column (c, py, px)) and the bilinear
 * resample (PyTorch align_corners=False: corner and centre values by hand).  Odd shapes,
 * fixed seeds; tolerances at each check. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "vision-ops.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float) ((double) (rng >> 11) / (double) (1ull << 53) * 2.0 - 1.0);
}

static float *rand_vec(size_t n, float scale)
{
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        x[i] = frand() * scale;
    return x;
}

static void test_layernorm(void)
{
    const int rows = 5, dim = 67;
    float *x = rand_vec(rows * dim, 3.0f), *g = rand_vec(dim, 1.0f), *b = rand_vec(dim, 1.0f);
    float y[5 * 67];

    for (int i = 0; i < dim; i++)
        x[i] += 100.0f;                 /* a large mean: the variance must not cancel */
    vops_layernorm(x, g, b, rows, dim, 1e-5f, y);
    for (int r = 0; r < rows; r++) {
        double mu = 0, var = 0;
        for (int i = 0; i < dim; i++)
            mu += x[r * dim + i];
        mu /= dim;
        for (int i = 0; i < dim; i++)
            var += (x[r * dim + i] - mu) * (x[r * dim + i] - mu);
        var /= dim;
        for (int i = 0; i < dim; i++)
            ASSERT_NEAR(y[r * dim + i], (x[r * dim + i] - mu) / sqrt(var + 1e-5) * g[i] + b[i], 2e-5);
    }
    vops_layernorm(x, g, b, rows, dim, 1e-5f, x);   /* in place */
    ASSERT_TRUE(memcmp(x, y, sizeof(y)) == 0);
    free(x); free(g); free(b);
}

static void test_pointwise(void)
{
    float x[9] = {-8, -2, -1, -0.25f, 0, 0.25f, 1, 2, 8}, h[2 * 3] = {1, 2, 3, 4, 5, 6};
    const float gam[3] = {0.5f, -1, 2}, y[6] = {1, 1, 1, 2, 2, 2}, b[3] = {10, 20, 30};

    vops_quick_gelu(x, 9);
    for (int i = 0; i < 9; i++) {
        double v = (double[]){-8, -2, -1, -0.25, 0, 0.25, 1, 2, 8}[i];
        ASSERT_NEAR(x[i], v / (1 + exp(-1.702 * v)), 1e-6);
    }
    vops_scale_add(h, gam, y, 2, 3);
    ASSERT_TRUE(h[0] == 1.5f && h[1] == 1 && h[2] == 5 && h[3] == 5 && h[4] == 3 && h[5] == 10);
    vops_bias_add(h, b, 2, 3);
    ASSERT_TRUE(h[0] == 11.5f && h[5] == 40);
}

static void test_conv_s2(void)
{
    static const int gs[3] = {7, 8, 1};
    const int C = 5, O = 3;
    for (int k = 0; k < 3; k++) {
        int g = gs[k], go = vops_s2_side(g);
        float *x = rand_vec((size_t) g * g * C, 1.0f), *w = rand_vec((size_t) O * C * 9, 1.0f);
        float *cols = malloc((size_t) go * go * C * 9 * sizeof(float));

        ASSERT_EQ(go, (g + 2 - 3) / 2 + 1);
        vops_im2col_s2(x, g, C, cols);
        for (int oy = 0; oy < go; oy++)
            for (int ox = 0; ox < go; ox++)
                for (int o = 0; o < O; o++) {
                    double direct = 0, gemm = 0;
                    for (int c = 0; c < C; c++)
                        for (int ky = 0; ky < 3; ky++)
                            for (int kx = 0; kx < 3; kx++) {
                                int iy = 2 * oy - 1 + ky, ix = 2 * ox - 1 + kx;
                                if (iy >= 0 && iy < g && ix >= 0 && ix < g)
                                    direct += (double) w[((o * C + c) * 3 + ky) * 3 + kx] * x[(iy * g + ix) * C + c];
                            }
                    for (int j = 0; j < C * 9; j++)
                        gemm += (double) w[o * C * 9 + j] * cols[(oy * go + ox) * C * 9 + j];
                    ASSERT_NEAR(gemm, direct, 1e-9);
                }
        free(x); free(w); free(cols);
    }
    ASSERT_EQ(vops_s2_side(52), 26);
    ASSERT_EQ(vops_s2_side(26), 13);
    ASSERT_EQ(vops_s2_side(36), 18);
    ASSERT_EQ(vops_s2_side(18), 9);
}

static void test_rope2d(void)
{
    const int g = 5, heads = 3, D = 12;
    const int64_t ld = heads * D + 7;       /* rows wider than the heads (the fused qkv) */
    float *x = rand_vec((size_t) g * g * ld, 1.0f), *x0 = malloc((size_t) g * g * ld * sizeof(float));

    memcpy(x0, x, (size_t) g * g * ld * sizeof(float));
    vops_rope2d(x, g, ld, heads, D, 100.0);
    for (int t = 0; t < g * g; t++) {
        for (int h = 0; h < heads; h++)
            for (int j = 0; j < D / 2; j++) {
                /* pair j: the column for the first D/4 pairs, the row for the rest */
                double pos = j < D / 4 ? t % g : t / g, f = pow(100.0, -4.0 * (j % (D / 4)) / D);
                double a = pos * f, u = x0[t * ld + h * D + 2 * j], v = x0[t * ld + h * D + 2 * j + 1];
                ASSERT_NEAR(x[t * ld + h * D + 2 * j], u * cos(a) - v * sin(a), 1e-5);
                ASSERT_NEAR(x[t * ld + h * D + 2 * j + 1], v * cos(a) + u * sin(a), 1e-5);
            }
        for (int i = heads * D; i < ld; i++)
            ASSERT_TRUE(x[t * ld + i] == x0[t * ld + i]);   /* past the heads: untouched */
    }
    free(x); free(x0);
}

static void test_softmax(void)
{
    float s[2 * 3] = {1, 2, 3, 1000, 1000, -1000};

    vops_softmax_rows(s, 2, 3, 0.5f);
    double z = exp(-1.0) + exp(-0.5) + 1;
    ASSERT_NEAR(s[0], exp(-1.0) / z, 1e-6);
    ASSERT_NEAR(s[2], 1 / z, 1e-6);
    ASSERT_NEAR(s[3], 0.5, 1e-6);           /* large logits: no overflow */
    ASSERT_NEAR(s[5], 0, 1e-6);
}

static void test_patchify(void)
{
    const int P = 3, size = 6, g = 2;
    uint8_t rgb[6 * 6 * 3];
    float out[4 * 27];
    const float mean[3] = {0.5f, 0.25f, 0}, std[3] = {0.5f, 0.25f, 2};

    for (int i = 0; i < (int) sizeof(rgb); i++)
        rgb[i] = (uint8_t) (i * 7);
    vops_patchify(rgb, size, P, mean, std, out);
    for (int y = 0; y < size; y++)
        for (int x = 0; x < size; x++)
            for (int c = 0; c < 3; c++) {
                int patch = (y / P) * g + x / P, col = (c * P + y % P) * P + x % P;
                double want = (rgb[(y * size + x) * 3 + c] / 255.0 - mean[c]) / std[c];
                ASSERT_NEAR(out[patch * 27 + col], want, 1e-6);
            }
}

static void test_bilinear(void)
{
    const int g0 = 4, C = 2;
    float src[16 * 2], dst[3 * 3 * 2], same[16 * 2];

    for (int i = 0; i < 16; i++) {
        src[i * 2] = (float) i;             /* value = 4 * row + col */
        src[i * 2 + 1] = (float) (i * i);
    }
    vops_bilinear(src, g0, g0, C, same);
    ASSERT_TRUE(memcmp(same, src, sizeof(src)) == 0);
    /* 4 -> 3: source coordinate (o + 0.5) * 4/3 - 0.5 = 1/6, 1.5, 17/6 (no clamp needed) */
    vops_bilinear(src, g0, 3, C, dst);
    const double s[3] = {1.0 / 6, 1.5, 17.0 / 6};
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 3; x++)
            ASSERT_NEAR(dst[(y * 3 + x) * 2], 4 * s[y] + s[x], 1e-5);   /* linear: exact */
    /* 2 -> 3 upsample: output 0 maps to -1/6, clamped to 0 (the corner value) */
    float s2[4] = {0, 10, 20, 30}, d2[9];
    vops_bilinear(s2, 2, 3, 1, d2);
    ASSERT_NEAR(d2[0], 0, 1e-6);
    ASSERT_NEAR(d2[4], 15, 1e-5);           /* centre: source 0.5, 0.5 */
    ASSERT_NEAR(d2[8], 30, 1e-6);
}

int main(void)
{
    test_layernorm();
    test_pointwise();
    test_conv_s2();
    test_rope2d();
    test_softmax();
    test_patchify();
    test_bilinear();
    printf("vision ops: all checks passed\n");
    return 0;
}
